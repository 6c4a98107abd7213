//! Chained tasks (issue 14 point 5, seed 000 §6): a request naming `depends_on_request_id` is a
//! hop that waits — RECEIVED, holding no nonce, nothing sent — until that request is CONFIRMED,
//! then goes on like any request; if that request fails, the hop is FAILED (DEPENDENCY_FAILED,
//! the reason naming it) and TxFailed announces it on `tx.outcomes`. A request naming itself is
//! dead-lettered at once, and so is a request_id reused with another parent. The whole pipeline against real PostgreSQL and broker and an anvil of
//! the test's own; outcomes are read on the chain, in PostgreSQL and on the topics.
//!
//! A wait is shown, not slept through: a request of the child's signer sent after the parent
//! reached a state is simulated and submitted by a drive of that signer, which evaluated the
//! child too (a drive reads all of the signer's RECEIVED requests); once that request is
//! SUBMITTED, the child was looked at with the parent in that state.

use std::time::Duration;

use alloy::providers::Provider;
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::message::Headers;
use txflow_core::events::TxFailed;
use txflow_core::kafka::signer_key;
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{AnvilNode, collect, group_consumer, unique, wait_until};

const LONG: Duration = Duration::from_secs(120);

/// A request's row: (state, nonce, depends_on_request_id, failure_code, failure_reason).
type Row = (
    String,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
);

async fn row(p: &Pipeline, request_id: &str) -> Option<Row> {
    sqlx::query_as(
        "SELECT state, nonce, depends_on_request_id, failure_code, failure_reason
         FROM managed_tx WHERE request_id = $1",
    )
    .bind(request_id)
    .fetch_optional(&p.db.pool)
    .await
    .expect("query")
}

async fn state(p: &Pipeline, request_id: &str) -> Option<String> {
    row(p, request_id).await.map(|r| r.0)
}

async fn wait_state(p: &Pipeline, request_id: &str, want: &str) {
    wait_until(&format!("{request_id} is {want}"), LONG, || async {
        state(p, request_id).await.as_deref() == Some(want)
    })
    .await;
}

/// Signer `i`'s nonce counting the node's pool: every transaction sent for it, mined or not.
async fn pending_nonce(p: &Pipeline, i: usize) -> u64 {
    p.provider()
        .get_transaction_count(p.signers[i].address())
        .pending()
        .await
        .expect("pending nonce")
}

/// Sends a plain request of signer `i` and waits until it is SUBMITTED: a drive of that signer
/// ran after everything sent before it was recorded.
async fn probe(p: &Pipeline, i: usize, request_id: &str) {
    p.send(&p.request(i, request_id)).await;
    wait_state(p, request_id, "SUBMITTED").await;
}

/// The child is still waiting: RECEIVED, no nonce, no attempt, nothing of it on the chain or in
/// the node's pool (signer 1's pending nonce counts only its `probes`).
async fn assert_waiting(p: &Pipeline, child: &str, probes: u64, while_parent: &str) {
    let (state, nonce, parent, code, _) = row(p, child).await.expect("the child is recorded");
    assert_eq!(
        state, "RECEIVED",
        "waits while its parent is {while_parent}"
    );
    assert_eq!(
        nonce, None,
        "holds no nonce while its parent is {while_parent}"
    );
    assert_eq!(parent.as_deref(), Some("hop-1"));
    assert_eq!(code, None);
    assert_eq!(
        p.count(&format!(
            "SELECT count(*) FROM tx_attempts a JOIN managed_tx m USING (tx_id)
             WHERE m.request_id = '{child}'"
        ))
        .await,
        0,
        "nothing signed for it while its parent is {while_parent}"
    );
    assert_eq!(
        pending_nonce(p, 1).await,
        probes,
        "only the probes were sent for signer 1 while the parent is {while_parent}"
    );
    assert!(
        !p.mined_markers()
            .await
            .contains_key(&format!("txflow:{child}")),
        "not mined while its parent is {while_parent}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chained_request_on_another_signer_waits_for_its_parent_to_be_confirmed_then_mines() {
    txflow_tests::show_logs();
    // Blocks only when the test mines them, so that the parent can be held SUBMITTED and MINED;
    // CONFIRMED at depth 2 (its own block and one more).
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 2, |c| c.confirmations_required = 2).await;
    let config = p.config.clone();
    p.start_all_stages(&config).await;

    // The child first, on signer 1: its parent, on signer 0, is not even received yet.
    let mut child = p.request(1, "hop-2");
    child.depends_on_request_id = Some("hop-1".into());
    child.depends_on_signer = Some(p.signer(0));
    p.send(&child).await;
    probe(&p, 1, "probe-0").await;
    assert_waiting(&p, "hop-2", 1, "not received yet").await;

    p.send(&p.request(0, "hop-1")).await;
    wait_state(&p, "hop-1", "SUBMITTED").await;
    probe(&p, 1, "probe-1").await;
    assert_waiting(&p, "hop-2", 2, "SUBMITTED").await;

    // Mined (confirmation 1 of 2): still not final.
    p.anvil.mine_block().await;
    wait_state(&p, "hop-1", "MINED").await;
    probe(&p, 1, "probe-2").await;
    assert_waiting(&p, "hop-2", 3, "MINED").await;
    assert_eq!(state(&p, "hop-1").await.as_deref(), Some("MINED"));

    // One more block: the parent is CONFIRMED, and the child goes on within a recovery scan.
    p.anvil.mine_block().await;
    wait_state(&p, "hop-1", "CONFIRMED").await;
    wait_state(&p, "hop-2", "SUBMITTED").await;
    let (_, nonce, ..) = row(&p, "hop-2").await.expect("the child");
    assert_eq!(nonce, Some(3), "the signer's next nonce, after the probes");
    assert_eq!(
        p.count(
            "SELECT count(*) FROM managed_tx parent, managed_tx child, tx_events e
             WHERE parent.request_id = 'hop-1' AND child.request_id = 'hop-2'
               AND e.tx_id = child.tx_id AND e.type = 'TxAllocated'
               AND e.created_at > parent.confirmed_at"
        )
        .await,
        1,
        "the child took its nonce after its parent was confirmed"
    );

    // And from there on it is a request like any other: mined, then confirmed.
    p.anvil.mine_block().await;
    wait_state(&p, "hop-2", "MINED").await;
    p.anvil.mine_block().await;
    wait_state(&p, "hop-2", "CONFIRMED").await;
    let mined = p.mined().await;
    let hops: Vec<(String, u64)> = mined
        .iter()
        .filter(|m| m.marker().starts_with("txflow:hop-"))
        .map(|m| (m.marker(), m.nonce))
        .collect();
    assert_eq!(
        hops,
        [
            ("txflow:hop-1".to_string(), 0),
            ("txflow:hop-2".to_string(), 3)
        ],
        "each hop mined once, the parent first: {mined:?}"
    );
    assert_eq!(mined.len(), 5, "two hops and three probes: {mined:?}");
    assert_eq!(
        mined
            .iter()
            .find(|m| m.marker() == "txflow:hop-2")
            .map(|m| m.signer),
        Some(p.signers[1].address()),
        "the child is signer 1's"
    );
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chained_request_whose_parent_fails_is_failed_naming_it_and_one_naming_itself_is_dead_lettered()
 {
    txflow_tests::show_logs();
    // The policy refuses values above 100 wei: the parent (1000 wei) fails in the allocator.
    let p = Pipeline::start_with(2, |c| c.policy_max_value_wei = Some("100".into())).await;

    let mut child = p.request(1, "after-doomed");
    child.depends_on_request_id = Some("doomed".into());
    child.depends_on_signer = Some(p.signer(0));
    p.send(&child).await;
    let mut selfish = p.request(1, "selfish");
    selfish.depends_on_request_id = Some("selfish".into());
    p.send(&selfish).await;
    probe(&p, 1, "probe-0").await;
    let (state, nonce, ..) = row(&p, "after-doomed").await.expect("the child");
    assert_eq!(
        (state.as_str(), nonce),
        ("RECEIVED", None),
        "waits for a parent not received yet"
    );

    let mut parent = p.request(0, "doomed");
    parent.value = "1000".into();
    p.send(&parent).await;
    wait_state(&p, "doomed", "FAILED").await;
    wait_state(&p, "after-doomed", "FAILED").await;

    let parent_tx: uuid::Uuid =
        sqlx::query_scalar("SELECT tx_id FROM managed_tx WHERE request_id = 'doomed'")
            .fetch_one(&p.db.pool)
            .await
            .expect("the parent");
    let child_tx: uuid::Uuid =
        sqlx::query_scalar("SELECT tx_id FROM managed_tx WHERE request_id = 'after-doomed'")
            .fetch_one(&p.db.pool)
            .await
            .expect("the child");
    let (_, nonce, _, code, reason) = row(&p, "after-doomed").await.expect("the child");
    let reason = reason.expect("a reason");
    assert_eq!(code.as_deref(), Some("DEPENDENCY_FAILED"));
    assert_eq!(nonce, None, "it never held a nonce");
    assert!(
        reason.starts_with("depends on request \"doomed\", which failed: ")
            && reason.contains(&parent_tx.to_string())
            && reason.contains("POLICY_DENIED"),
        "the reason names the parent and why it failed: {reason}"
    );
    assert_eq!(
        p.count(&format!(
            "SELECT count(*) FROM tx_attempts WHERE tx_id = '{child_tx}'"
        ))
        .await,
        0,
        "nothing signed for it"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM recycled_nonces").await,
        0,
        "no nonce taken and released for it"
    );

    // TxFailed on tx.outcomes, keyed by the child's signer.
    let outcomes = group_consumer(&p.config.kafka, &unique("chained-outcomes"));
    outcomes
        .subscribe(&[&p.config.topics.tx_outcomes()])
        .expect("subscribe");
    let deadline = tokio::time::Instant::now() + LONG;
    let failed = loop {
        let m = tokio::time::timeout_at(deadline, outcomes.recv())
            .await
            .expect("TxFailed of the child on tx.outcomes in time")
            .expect("read tx.outcomes");
        let Ok(f) = p
            .codec
            .decode::<TxFailed>(m.payload().unwrap_or_default())
            .await
        else {
            continue;
        };
        if f.tx_id == child_tx.to_string() {
            let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned());
            let header = m.headers().and_then(|h| {
                h.iter()
                    .find(|x| x.key == "event_id")
                    .and_then(|x| x.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            });
            assert_eq!(key, Some(signer_key(31337, &p.signer(1))));
            assert_eq!(header.as_deref(), Some(f.event_id.as_str()));
            break f;
        }
    };
    assert_eq!(failed.code, "DEPENDENCY_FAILED");
    assert_eq!(failed.request_id, "after-doomed");
    assert_eq!(failed.reason, reason, "announced as recorded");
    assert_eq!((failed.nonce, failed.nonce_released), (None, false));

    // The child's request_id again with another parent is another request: refused, never
    // merged into the recorded one.
    let mut other = child.clone();
    other.event_id = uuid::Uuid::new_v4().to_string();
    other.depends_on_request_id = Some("probe-0".into());
    p.send(&other).await;

    // The request naming itself was refused at intake, recorded nowhere; so was the reuse.
    let dlq = group_consumer(&p.config.kafka, &unique("chained-dlq"));
    dlq.subscribe(&[&p.config.topics.dlq()]).expect("subscribe");
    let dead = collect(&dlq, 2, LONG).await;
    let codes: Vec<String> = dead
        .iter()
        .map(|m| {
            m.headers()
                .and_then(|h| {
                    h.iter()
                        .find(|x| x.key == "error.code")
                        .and_then(|x| x.value)
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                })
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(codes, ["SELF_DEPENDENCY", "DUPLICATE_REQUEST_ID"]);
    assert_eq!(
        row(&p, "after-doomed").await.and_then(|r| r.2).as_deref(),
        Some("doomed"),
        "the recorded dependency stands"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE request_id = 'selfish'")
            .await,
        0
    );

    // On the chain: only the probe; nothing for the parent or the child.
    wait_until("the probe is mined", LONG, || async {
        p.mined_markers().await.contains_key("txflow:probe-0")
    })
    .await;
    assert_eq!(
        p.mined_markers().await.keys().collect::<Vec<_>>(),
        ["txflow:probe-0"]
    );
    assert_eq!(pending_nonce(&p, 0).await, 0);
    assert_eq!(pending_nonce(&p, 1).await, 1);
    p.stop().await;
}

/// The state of signer `i`'s request `request_id`.
async fn state_of(p: &Pipeline, i: usize, request_id: &str) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM managed_tx WHERE signer = $1 AND request_id = $2")
        .bind(p.signer(i))
        .bind(request_id)
        .fetch_optional(&p.db.pool)
        .await
        .expect("query")
}

async fn wait_state_of(p: &Pipeline, i: usize, request_id: &str, want: &str) {
    wait_until(
        &format!("signer {i}'s {request_id} is {want}"),
        LONG,
        || async { state_of(p, i, request_id).await.as_deref() == Some(want) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chained_request_waits_for_its_own_parent_never_for_another_signers_request_with_the_same_id()
 {
    txflow_tests::show_logs();
    // The policy refuses values above 100 wei; final at the transaction's own block.
    let mut p = Pipeline::prepare(2, |c| {
        c.policy_max_value_wei = Some("100".into());
        c.confirmations_required = 1;
    })
    .await;
    let config = p.config.clone();
    p.start_all_stages(&config).await;

    // Children of signer 0, each naming a request of its own signer not received yet.
    let mut after_ok = p.request(0, "child-ok");
    after_ok.depends_on_request_id = Some("same-1".into());
    p.send(&after_ok).await;
    let mut after_bad = p.request(0, "child-bad");
    after_bad.depends_on_request_id = Some("same-2".into());
    p.send(&after_bad).await;

    // Signer 1's requests with the same ids: one confirmed, one failed. Neither is a parent.
    p.send(&p.request(1, "same-1")).await;
    let mut doomed = p.request(1, "same-2");
    doomed.value = "1000".into();
    p.send(&doomed).await;
    wait_state_of(&p, 1, "same-1", "CONFIRMED").await;
    wait_state_of(&p, 1, "same-2", "FAILED").await;
    // A drive of signer 0 after both: the children were looked at with them there.
    p.send(&p.request(0, "probe-0")).await;
    wait_until("probe-0 is submitted", LONG, || async {
        matches!(
            state(&p, "probe-0").await.as_deref(),
            Some("SUBMITTED" | "MINED" | "CONFIRMED")
        )
    })
    .await;
    for child in ["child-ok", "child-bad"] {
        let (state, nonce, _, code, _) = row(&p, child).await.expect("the child");
        assert_eq!(
            (state.as_str(), nonce, code),
            ("RECEIVED", None, None),
            "{child} waits for its own signer's request, whatever another signer's did"
        );
    }
    assert_eq!(
        p.count(
            "SELECT count(*) FROM managed_tx WHERE request_id LIKE 'child-%'
             AND depends_on_signer = signer"
        )
        .await,
        2,
        "recorded with the parent's signer: their own"
    );

    // Signer 0's own parents: one goes through, one is refused.
    p.send(&p.request(0, "same-1")).await;
    let mut own_doomed = p.request(0, "same-2");
    own_doomed.value = "1000".into();
    p.send(&own_doomed).await;
    wait_state_of(&p, 0, "same-1", "CONFIRMED").await;
    wait_state_of(&p, 0, "child-ok", "CONFIRMED").await;
    wait_state_of(&p, 0, "child-bad", "FAILED").await;
    let own_parent: uuid::Uuid = sqlx::query_scalar(
        "SELECT tx_id FROM managed_tx WHERE signer = $1 AND request_id = 'same-2'",
    )
    .bind(p.signer(0))
    .fetch_one(&p.db.pool)
    .await
    .expect("the parent");
    let (_, _, _, code, reason) = row(&p, "child-bad").await.expect("the child");
    assert_eq!(code.as_deref(), Some("DEPENDENCY_FAILED"));
    let reason = reason.expect("a reason");
    assert!(
        reason.contains(&own_parent.to_string()),
        "failed with its own parent: {reason}"
    );
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:child-ok"), Some(&1), "{markers:?}");
    assert_eq!(markers.get("txflow:child-bad"), None);
    p.stop().await;
}
