//! The allocator's limits (issue 16 points 2 and 3), the whole pipeline against real PostgreSQL
//! and broker and an anvil of the test's own:
//!
//! - the in-flight budget (`nonce.max_in_flight`, seed 003): on a stalled chain (`--no-mining`)
//!   with 200 requests of one signer, at most the budget of nonces is ever allocated — sampled
//!   from PostgreSQL on every poll while it fills, and still exactly the budget after two more
//!   recovery scans of the allocator; the others wait SIMULATED without a nonce, none fails and
//!   none is dead-lettered. Once blocks are mined, all 200 are mined exactly once (counted on
//!   the chain by calldata marker), the budget holding throughout;
//! - the approval timeout (`approval.timeout`, seed 000 §4.1): a transaction in
//!   PENDING_APPROVAL past it is FAILED `APPROVAL_TIMEOUT` with no nonce taken, TxFailed
//!   announces it on `tx.outcomes`, and the signer's later requests are mined.
//!
//! A recovery scan is observed, not slept through: only a scan drives a signer with no new
//! message and no request waiting for a nonce (the runtime's ready drives name only those), so
//! an approval of another signer (sent alone) failing on its timeout shows that a scan — which
//! drives every pending signer, the one at the budget included — ran after it was recorded.
//! Waiting is by condition with a deadline.

use std::time::Duration;

use alloy::providers::Provider;
use alloy::providers::ext::AnvilApi;
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use txflow_core::events::TxFailed;
use txflow_core::kafka::signer_key;
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{AnvilNode, group_consumer, unique, wait_until};

const LONG: Duration = Duration::from_secs(240);
/// Smaller than the default (64) to keep the test quick.
const BUDGET: i64 = 16;
const REQUESTS: usize = 200;

/// How many of `signer`'s transactions ever had a nonce allocated (a nonce is never cleared).
async fn allocated(p: &Pipeline, signer: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM managed_tx WHERE signer = $1 AND nonce IS NOT NULL")
        .bind(signer)
        .fetch_one(&p.db.pool)
        .await
        .expect("allocated")
}

/// An upper bound of how many of `signer`'s nonces are in flight — allocated, not used on the
/// chain — read without a race: the nonces allocated first, then the chain's latest nonce
/// (which only grows, so the difference can only be larger than at any one instant).
async fn in_flight(p: &Pipeline, signer: &str) -> i64 {
    let allocated: i64 = sqlx::query_scalar(
        "SELECT coalesce(max(nonce) + 1, 0) FROM managed_tx WHERE signer = $1 AND nonce IS NOT NULL",
    )
    .bind(signer)
    .fetch_one(&p.db.pool)
    .await
    .expect("allocated");
    let address: alloy::primitives::Address = signer.parse().expect("address");
    let used = p
        .provider()
        .get_transaction_count(address)
        .latest()
        .await
        .expect("latest nonce");
    allocated - i64::try_from(used).expect("nonce")
}

/// The state and failure code of request `request_id`.
async fn outcome(p: &Pipeline, request_id: &str) -> Option<(String, Option<String>)> {
    sqlx::query_as("SELECT state, failure_code FROM managed_tx WHERE request_id = $1")
        .bind(request_id)
        .fetch_optional(&p.db.pool)
        .await
        .expect("outcome")
}

/// Sends a request of signer `signer` above the approval threshold and waits until its approval
/// timed out: a recovery scan of the allocator ran after it was recorded (nothing else drives a
/// signer with no new message and no request waiting for a nonce). Runs `check` on every poll
/// meanwhile.
async fn scan_observed<F, Fut>(p: &Pipeline, signer: usize, request_id: &str, check: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut probe = p.request(signer, request_id);
    probe.value = "5000".into();
    p.send(&probe).await;
    wait_until("the probe's approval timed out", LONG, || async {
        check().await;
        outcome(p, request_id).await == Some(("FAILED".into(), Some("APPROVAL_TIMEOUT".into())))
    })
    .await;
}

#[tokio::test]
async fn a_stalled_chain_holds_at_most_the_in_flight_budget_and_all_mine_once_it_resumes() {
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 2, |c| {
        c.max_in_flight = u32::try_from(BUDGET).expect("budget");
        // Signer 1's probes (above the threshold) time out at once: they show recovery scans.
        c.policy_approval_threshold_wei = Some("1000".into());
        c.approval_timeout_ms = 1_000;
    })
    .await;
    let config = p.config.clone();
    p.start_all_stages(&config).await;
    let signer = p.signer(0);
    for i in 0..REQUESTS {
        p.send(&p.request(0, &format!("req-{i}"))).await;
    }

    // The budget fills and is never exceeded while it does.
    wait_until("the in-flight budget is allocated", LONG, || async {
        let n = allocated(&p, &signer).await;
        assert!(n <= BUDGET, "{n} nonces allocated, budget {BUDGET}");
        n == BUDGET
    })
    .await;
    // Two more recovery scans of the allocator, the budget sampled meanwhile: still exactly the
    // budget, the others waiting without a nonce.
    let at_budget = || async {
        let n = allocated(&p, &signer).await;
        assert_eq!(n, BUDGET, "nonces allocated on a stalled chain");
    };
    scan_observed(&p, 1, "probe-1", at_budget).await;
    scan_observed(&p, 1, "probe-2", at_budget).await;
    assert_eq!(allocated(&p, &signer).await, BUDGET);
    assert_eq!(
        p.count(&format!(
            "SELECT max(nonce) + 1 FROM managed_tx WHERE signer = '{signer}'"
        ))
        .await,
        BUDGET,
        "the nonces allocated are 0 .. budget"
    );
    assert_eq!(
        p.count(&format!(
            "SELECT count(*) FROM managed_tx WHERE signer = '{signer}' AND state = 'SIMULATED' AND nonce IS NULL"
        ))
        .await,
        i64::try_from(REQUESTS).expect("requests") - BUDGET,
        "the others wait simulated, without a nonce"
    );
    assert_eq!(
        p.count(&format!(
            "SELECT count(*) FROM managed_tx WHERE signer = '{signer}' AND state = 'FAILED'"
        ))
        .await,
        0,
        "nothing failed"
    );
    assert_eq!(p.mined_count().await, 0, "the chain is stalled");

    // Blocks again: everything is mined, once, the budget holding throughout.
    p.provider()
        .anvil_set_interval_mining(1)
        .await
        .expect("interval mining on");
    wait_until("all requests are mined", LONG, || async {
        let n = in_flight(&p, &signer).await;
        assert!(n <= BUDGET, "{n} nonces in flight, budget {BUDGET}");
        p.count(&format!(
            "SELECT count(*) FROM managed_tx WHERE signer = '{signer}' AND state IN ('MINED', 'CONFIRMED')"
        ))
        .await
            == i64::try_from(REQUESTS).expect("requests")
    })
    .await;
    let markers = p.mined_markers().await;
    for i in 0..REQUESTS {
        assert_eq!(
            markers.get(&format!("txflow:req-{i}")),
            Some(&1),
            "req-{i} mined exactly once"
        );
    }
    assert_eq!(
        markers.values().sum::<usize>(),
        REQUESTS,
        "nothing else was mined (no no-op, no probe)"
    );
    assert_eq!(
        p.count(&format!(
            "SELECT count(DISTINCT nonce) FROM managed_tx WHERE signer = '{signer}'"
        ))
        .await,
        i64::try_from(REQUESTS).expect("requests"),
        "one nonce each, none skipped"
    );
    p.stop().await;
}

#[tokio::test]
async fn a_transaction_waiting_for_approval_past_the_timeout_fails_and_later_requests_mine() {
    let timeout_ms = 2_000;
    let p = Pipeline::start_with(1, |c| {
        c.policy_approval_threshold_wei = Some("1000".into());
        c.approval_timeout_ms = timeout_ms;
    })
    .await;
    let mut big = p.request(0, "big");
    big.value = "5000".into();
    p.send(&big).await;
    p.send(&p.request(0, "small-before")).await;
    wait_until("the big request waits for approval", LONG, || async {
        outcome(&p, "big")
            .await
            .is_some_and(|(s, _)| s == "PENDING_APPROVAL")
    })
    .await;
    wait_until("the big request failed on its timeout", LONG, || async {
        outcome(&p, "big").await == Some(("FAILED".into(), Some("APPROVAL_TIMEOUT".into())))
    })
    .await;
    let (tx_id, nonce, released, reason): (uuid::Uuid, Option<i64>, bool, Option<String>) =
        sqlx::query_as(
            "SELECT tx_id, nonce, nonce_released, failure_reason FROM managed_tx
             WHERE request_id = 'big'",
        )
        .fetch_one(&p.db.pool)
        .await
        .expect("big");
    assert_eq!((nonce, released), (None, false), "it held no nonce");
    let reason = reason.expect("a reason");
    assert!(reason.contains("approval.timeout (2000 ms)"), "{reason}");
    // Not before the timeout: from the move to PENDING_APPROVAL to the failure, by the audit.
    let waited_ms = p
        .count(&format!(
            "SELECT (extract(epoch FROM f.created_at - a.created_at) * 1000)::bigint
             FROM tx_events f JOIN tx_events a USING (tx_id)
             WHERE tx_id = '{tx_id}' AND f.type = 'TxFailed' AND a.type = 'TxPendingApproval'"
        ))
        .await;
    assert!(
        waited_ms >= i64::try_from(timeout_ms).expect("ms"),
        "failed after {waited_ms} ms"
    );

    // TxFailed on tx.outcomes, keyed by the signer, with its event_id as recorded.
    let outcomes = group_consumer(&p.config.kafka, &unique("approval-outcomes"));
    outcomes
        .subscribe(&[&p.config.topics.tx_outcomes()])
        .expect("subscribe");
    let deadline = tokio::time::Instant::now() + LONG;
    let (failed, key) = loop {
        let m = tokio::time::timeout_at(deadline, outcomes.recv())
            .await
            .expect("TxFailed of the big request on tx.outcomes in time")
            .expect("read tx.outcomes");
        let Ok(f) = p
            .codec
            .decode::<TxFailed>(m.payload().unwrap_or_default())
            .await
        else {
            continue;
        };
        if f.tx_id == tx_id.to_string() {
            break (f, m.key().map(|k| String::from_utf8_lossy(k).into_owned()));
        }
    };
    assert_eq!(key, Some(signer_key(31337, &p.signer(0))));
    assert_eq!(failed.code, "APPROVAL_TIMEOUT");
    assert_eq!(failed.request_id, "big");
    assert_eq!(failed.reason, reason, "announced as recorded");
    assert_eq!((failed.nonce, failed.nonce_released), (None, false));
    let recorded: uuid::Uuid =
        sqlx::query_scalar("SELECT event_id FROM tx_events WHERE tx_id = $1 AND type = 'TxFailed'")
            .bind(tx_id)
            .fetch_one(&p.db.pool)
            .await
            .expect("the TxFailed audit row");
    assert_eq!(failed.event_id, recorded.to_string());

    // Later requests are not affected.
    p.send(&p.request(0, "small-after")).await;
    wait_until("the small requests are mined", LONG, || async {
        let m = p.mined_markers().await;
        m.contains_key("txflow:small-before") && m.contains_key("txflow:small-after")
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:small-before"), Some(&1));
    assert_eq!(markers.get("txflow:small-after"), Some(&1));
    assert!(
        !markers.contains_key("txflow:big"),
        "the timed-out request is never sent"
    );
    p.stop().await;
}

/// `store::ready_signers` names the signers the runtime drives between recovery scans. A signer
/// at the budget by PostgreSQL's states whose transactions in flight were sent (SUBMITTED) is
/// named: the chain may have used those nonces while their receipts are not recorded yet (the
/// receipt checker polls behind the chain), and its drive asks the chain (`in_flight_from`).
/// A signer at the budget with nothing sent yet (ALLOCATED, SIGNED) is not: the chain cannot
/// have used those nonces, so nothing polls it. Failed on the code as it was: a hot signer whose
/// in-flight transactions were all SUBMITTED waited for the recovery scan (every 5 s) or a
/// receipt, whichever came first — one signer's 2,000 requests went at 16–22 tx/s.
#[tokio::test]
async fn ready_signers_names_a_signer_at_the_budget_whose_transactions_were_sent() {
    use txflow_core::domain::{ChainId, Signer};
    use txflow_core::state::TxState;

    const CHAIN: i64 = 31337;
    const MAX: u32 = 4;
    let db = txflow_tests::TestDb::new().await;
    let signer = |n: u8| format!("0x{:040x}", n);
    let insert = |n: u8, i: i64, state: TxState, nonce: Option<i64>| {
        let pool = db.pool.clone();
        let signer = signer(n);
        async move {
            sqlx::query(
                "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state, fencing_token)
                 VALUES ($1, $2, $3, $4, $5, '{}'::jsonb, $6, 1)",
            )
            .bind(uuid::Uuid::new_v4())
            .bind(CHAIN)
            .bind(&signer)
            .bind(format!("r-{n}-{i}"))
            .bind(nonce)
            .bind(state.as_str())
            .execute(&pool)
            .await
            .expect("insert");
        }
    };
    // 1: at the budget, all sent. 2: at the budget, nothing sent. 3: under the budget.
    // 4: at the budget, half sent. Each has one request waiting for a nonce.
    for i in 0..4 {
        insert(1, i, TxState::Submitted, Some(i)).await;
        let unsent = if i % 2 == 0 {
            TxState::Allocated
        } else {
            TxState::Signed
        };
        insert(2, i, unsent, Some(i)).await;
        if i < 2 {
            insert(3, i, TxState::Submitted, Some(i)).await;
        }
        let half = if i < 2 {
            TxState::Signed
        } else {
            TxState::Submitted
        };
        insert(4, i, half, Some(i)).await;
    }
    for n in 1..=4 {
        insert(n, 99, TxState::Simulated, None).await;
    }
    let named: std::collections::BTreeSet<String> =
        txflow_allocator::store::ready_signers(&db.pool, ChainId(CHAIN), MAX)
            .await
            .expect("ready signers")
            .into_iter()
            .map(|(c, s): (ChainId, Signer)| {
                assert_eq!(c, ChainId(CHAIN));
                s.as_str().to_string()
            })
            .collect();
    let want: std::collections::BTreeSet<String> = [1, 3, 4].into_iter().map(signer).collect();
    assert_eq!(
        named, want,
        "named: the sent-at-budget, under-budget and partly-sent signers"
    );
}
