//! Request to chain: allocator → signer gateway → broadcaster on the stage runtime, against real
//! PostgreSQL, broker, Schema Registry and an anvil of the test's own. Outcomes are checked where
//! they are true: on the chain (one mined transaction per request marker), in PostgreSQL, on the
//! topics.

use std::time::Duration;

use alloy::primitives::Address;
use alloy::providers::{Provider, ProviderBuilder};
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::message::Headers;
use txflow_core::codec::Subjects;
use txflow_core::events::TxRequest;
use txflow_core::kafka::signer_key;
use txflow_tests::pipeline::{Pipeline, SINK};
use txflow_tests::{AnvilNode, group_consumer, unique, wait_until};

const LONG: Duration = Duration::from_secs(180);

#[tokio::test]
async fn a_thousand_requests_of_one_signer_become_a_thousand_mined_transactions() {
    let p = Pipeline::start(1).await;
    let n = 1000;
    let requests: Vec<TxRequest> = (0..n).map(|i| p.request(0, &format!("r-{i}"))).collect();
    for chunk in requests.chunks(100) {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
    }
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= n as u64
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.len(), n, "one mined transaction per request marker");
    assert!(markers.values().all(|c| *c == 1), "no marker mined twice");
    for r in &requests {
        assert_eq!(
            markers.get(&format!("txflow:{}", r.request_id)),
            Some(&1),
            "{}",
            r.request_id
        );
    }
    let distinct: i64 = p
        .count("SELECT count(DISTINCT (signer, nonce)) FROM managed_tx WHERE nonce IS NOT NULL")
        .await;
    assert_eq!(distinct, n as i64, "(signer, nonce) unique in PostgreSQL");
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string()),
        "nothing left pending or queued in anvil's pool"
    );
    p.stop().await;
}

#[tokio::test]
async fn the_same_request_sent_a_hundred_times_at_once_is_one_transaction() {
    let p = Pipeline::start(1).await;
    let r = p.request(0, "dup-1");
    futures::future::join_all((0..100).map(|_| p.send(&r))).await;
    let after = p.request(0, "after-dup");
    p.send(&after).await;
    wait_until("both distinct requests are mined", LONG, || async {
        p.mined_count().await >= 2
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:dup-1"), Some(&1), "{markers:?}");
    assert_eq!(markers.get("txflow:after-dup"), Some(&1), "{markers:?}");
    assert_eq!(markers.len(), 2);
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx").await,
        2,
        "one managed transaction per request id"
    );
    p.stop().await;
}

#[tokio::test]
async fn bad_requests_are_dead_lettered_with_their_reason_and_nothing_else_is_affected() {
    let p = Pipeline::start(1).await;
    let key = signer_key(31337, &p.signer(0));
    p.send_raw(&key, b"\x00\x00\x00\x00\x01garbage").await;
    let mut bad_address = p.request(0, "bad-to");
    bad_address.to = "0x1234".into();
    let mut negative = p.request(0, "negative");
    negative.value = "-5".into();
    let topic = p.config.topics.tx_requests();
    for r in [&bad_address, &negative] {
        let bytes = p
            .codec
            .encode(&topic, Subjects::TopicName, r)
            .await
            .expect("encode");
        p.send_raw(&key, &bytes).await;
    }
    p.send(&p.request(0, "fine")).await;
    wait_until("the valid request is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;

    let dlq = group_consumer(&p.config.kafka, &unique("dlq"));
    dlq.subscribe(&[&p.config.topics.dlq()]).expect("subscribe");
    let dead = txflow_tests::collect(&dlq, 3, LONG).await;
    let codes = error_codes(&dead);
    assert_eq!(codes, ["UNDECODABLE", "INVALID_TO", "INVALID_VALUE"]);
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx").await,
        1,
        "only the valid request is recorded"
    );
    assert_eq!(
        p.mined_markers().await.keys().collect::<Vec<_>>(),
        ["txflow:fine"]
    );
    p.stop().await;
}

/// Deploys a contract whose code always reverts (PUSH1 0 PUSH1 0 REVERT) and returns its address.
async fn deploy_reverter(anvil: &AnvilNode) -> Address {
    use alloy::network::TransactionBuilder;
    let provider = ProviderBuilder::new().connect_http(anvil.url.parse().expect("url"));
    let accounts = provider.get_accounts().await.expect("anvil's dev accounts");
    let init = hex::decode("6460006000fd6000526005601bf3").expect("hex");
    let tx = alloy::rpc::types::TransactionRequest::default()
        .from(accounts[0])
        .with_deploy_code(init);
    let receipt = provider
        .send_transaction(tx)
        .await
        .expect("deploy")
        .get_receipt()
        .await
        .expect("receipt");
    receipt.contract_address.expect("a contract was created")
}

#[tokio::test]
async fn a_reverting_call_fails_with_its_reason_holds_no_nonce_and_later_requests_mine() {
    let p = Pipeline::start(1).await;
    let reverter = deploy_reverter(&p.anvil).await;
    let mut bad = p.request(0, "reverts");
    bad.to = format!("{reverter:#x}");
    p.send(&bad).await;
    for i in 0..3 {
        p.send(&p.request(0, &format!("after-{i}"))).await;
    }
    wait_until("the later requests are mined", LONG, || async {
        p.mined_count().await >= 3
    })
    .await;
    let (state, code, reason, nonce): (String, Option<String>, Option<String>, Option<i64>) = sqlx::query_as(
        "SELECT state, failure_code, failure_reason, nonce FROM managed_tx WHERE request_id = 'reverts'",
    )
    .fetch_one(&p.db.pool)
    .await
    .expect("row");
    assert_eq!(state, "FAILED");
    assert_eq!(code.as_deref(), Some("SIMULATION_REVERTED"));
    assert!(
        reason.unwrap_or_default().contains("revert"),
        "the node's revert reason is kept"
    );
    assert_eq!(nonce, None, "a failed simulation never holds a nonce");
    let markers = p.mined_markers().await;
    assert!(!markers.contains_key("txflow:reverts"));
    assert_eq!(markers.len(), 3);
    let nonces: Vec<i64> =
        sqlx::query_scalar("SELECT nonce FROM managed_tx WHERE nonce IS NOT NULL ORDER BY nonce")
            .fetch_all(&p.db.pool)
            .await
            .expect("nonces");
    assert_eq!(nonces, vec![0, 1, 2], "no gap where the failed request was");

    // The failure is announced on the outcomes topic.
    let c = group_consumer(&p.config.kafka, &unique("outcomes"));
    c.subscribe(&[&p.config.topics.tx_outcomes()])
        .expect("subscribe");
    let mut failed = None;
    let deadline = tokio::time::Instant::now() + LONG;
    while failed.is_none() {
        let m = tokio::time::timeout_at(deadline, c.recv())
            .await
            .expect("an outcome in time")
            .expect("consume");
        if let Ok(f) = p
            .codec
            .decode::<txflow_core::events::TxFailed>(m.payload().expect("payload"))
            .await
        {
            failed = Some(f);
        }
    }
    let failed = failed.expect("TxFailed");
    assert_eq!(
        (failed.request_id.as_str(), failed.code.as_str()),
        ("reverts", "SIMULATION_REVERTED")
    );
    p.stop().await;
}

async fn state_of(p: &Pipeline, request_id: &str) -> Option<(String, String)> {
    sqlx::query_as("SELECT state, tx_id::text FROM managed_tx WHERE request_id = $1")
        .bind(request_id)
        .fetch_optional(&p.db.pool)
        .await
        .expect("query")
}

#[tokio::test]
async fn above_the_threshold_a_request_waits_for_approval_without_blocking_later_ones() {
    use txflow_core::events::TxCommandKind;
    let p =
        Pipeline::start_with(1, |c| c.policy_approval_threshold_wei = Some("1000".into())).await;
    let mut big = p.request(0, "big");
    big.value = "5000".into();
    p.send(&big).await;
    let mut other_big = p.request(0, "big-cancelled");
    other_big.value = "7000".into();
    p.send(&other_big).await;
    for i in 0..3 {
        p.send(&p.request(0, &format!("small-{i}"))).await;
    }
    wait_until(
        "the small requests mine while the big ones wait",
        LONG,
        || async { p.mined_count().await >= 3 },
    )
    .await;
    let (state, big_id) = state_of(&p, "big").await.expect("big is recorded");
    assert_eq!(state, "PENDING_APPROVAL");
    let (state, cancelled_id) = state_of(&p, "big-cancelled").await.expect("recorded");
    assert_eq!(state, "PENDING_APPROVAL");
    assert_eq!(
        p.count(
            "SELECT count(*) FROM managed_tx WHERE state = 'PENDING_APPROVAL' AND nonce IS NOT NULL"
        )
        .await,
        0,
        "a waiting request holds no nonce"
    );

    p.command(&big_id, TxCommandKind::Approve).await;
    p.command(&cancelled_id, TxCommandKind::Cancel).await;
    wait_until("the approved request is mined", LONG, || async {
        p.mined_count().await >= 4
    })
    .await;
    wait_until("the cancelled request is failed", LONG, || async {
        state_of(&p, "big-cancelled")
            .await
            .is_some_and(|(s, _)| s == "FAILED")
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:big"), Some(&1));
    assert!(!markers.contains_key("txflow:big-cancelled"));
    let code: Option<String> = sqlx::query_scalar(
        "SELECT failure_code FROM managed_tx WHERE request_id = 'big-cancelled'",
    )
    .fetch_one(&p.db.pool)
    .await
    .expect("code");
    assert_eq!(code.as_deref(), Some("CANCELLED"));
    p.stop().await;
}

#[tokio::test]
async fn policy_refuses_destinations_off_the_whitelist_and_values_above_the_limit() {
    let p = Pipeline::start_with(1, |c| {
        c.policy_whitelist = vec![SINK.into()];
        c.policy_max_value_wei = Some("100".into());
    })
    .await;
    let mut elsewhere = p.request(0, "elsewhere");
    elsewhere.to = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into();
    p.send(&elsewhere).await;
    let mut too_much = p.request(0, "too-much");
    too_much.value = "101".into();
    p.send(&too_much).await;
    p.send(&p.request(0, "fine")).await;
    wait_until("the allowed request is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;
    wait_until("both refused requests are failed", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED' AND failure_code = 'POLICY_DENIED' AND nonce IS NULL").await == 2
    })
    .await;
    assert_eq!(
        p.mined_markers().await.keys().collect::<Vec<_>>(),
        ["txflow:fine"]
    );
    p.stop().await;
}

/// The `error.code` header of each dead letter.
fn error_codes(messages: &[rdkafka::message::OwnedMessage]) -> Vec<String> {
    messages
        .iter()
        .map(|m| {
            m.headers()
                .and_then(|h| {
                    h.iter()
                        .find(|x| x.key == "error.code")
                        .and_then(|x| x.value)
                })
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default()
        })
        .collect()
}

#[tokio::test]
async fn the_signer_gateway_checks_the_policy_again_and_releases_the_refused_nonce() {
    // The policy tightened between allocation and signing: the allocator allows any destination,
    // the signer gateway only the sink.
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let loose = p.config.clone();
    let strict = txflow_core::config::Config {
        policy_whitelist: vec![SINK.into()],
        ..loose.clone()
    };
    p.start_allocator(&loose, "alloc-1").await;
    p.start_signer_gateway(&strict).await;
    p.start_broadcaster(&loose).await;

    let mut elsewhere = p.request(0, "elsewhere");
    elsewhere.to = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into();
    p.send(&elsewhere).await;
    for i in 0..3 {
        p.send(&p.request(0, &format!("after-{i}"))).await;
    }
    wait_until("the signer gateway refuses the request", LONG, || async {
        p.count(
            "SELECT count(*) FROM managed_tx WHERE request_id = 'elsewhere' AND state = 'FAILED'",
        )
        .await
            == 1
    })
    .await;
    let (code, released, nonce): (Option<String>, bool, Option<i64>) = sqlx::query_as(
        "SELECT failure_code, nonce_released, nonce FROM managed_tx WHERE request_id = 'elsewhere'",
    )
    .fetch_one(&p.db.pool)
    .await
    .expect("row");
    assert_eq!(code.as_deref(), Some("POLICY_DENIED"));
    assert!(released, "the refused transaction's nonce is released");
    let refused_nonce = nonce.expect("it had been allocated a nonce");

    // The freed nonce is used again, so nothing behind it stays stuck: by the signer's next
    // request, or by a 0-value no-op if the allocator's recovery scan fills it first (both are
    // the allocator's healing; which one wins is a race with the scan).
    p.send(&p.request(0, "filler")).await;
    wait_until("every allowed request is mined", LONG, || async {
        p.mined_markers().await.contains_key("txflow:filler")
    })
    .await;
    let signer = p.signers[0].address();
    let at_refused: Vec<_> = p
        .mined()
        .await
        .into_iter()
        .filter(|m| m.signer == signer && m.nonce == refused_nonce as u64)
        .collect();
    assert_eq!(at_refused.len(), 1, "the freed nonce is mined once");
    let reused = &at_refused[0];
    assert!(
        reused.marker() == "txflow:filler"
            || (reused.to == format!("{signer:#x}") && reused.value.is_zero()),
        "the freed nonce {refused_nonce} carries the next request or a no-op: {:?}",
        reused.marker()
    );
    let markers = p.mined_markers().await;
    let requests: Vec<&str> = markers
        .keys()
        .map(String::as_str)
        .filter(|m| m.starts_with("txflow:"))
        .collect();
    assert_eq!(
        requests,
        [
            "txflow:after-0",
            "txflow:after-1",
            "txflow:after-2",
            "txflow:filler"
        ]
    );
    assert!(
        markers
            .iter()
            .filter(|(m, _)| m.starts_with("txflow:"))
            .all(|(_, c)| *c == 1)
    );
    assert_eq!(
        p.count("SELECT count(*) FROM recycled_nonces").await,
        0,
        "no released nonce left waiting"
    );

    // A TxAllocated event for a transaction PostgreSQL does not know is dead-lettered, unsigned.
    let forged = txflow_core::events::TxAllocated {
        event_id: uuid::Uuid::new_v4().to_string(),
        tx_id: uuid::Uuid::new_v4().to_string(),
        request_id: "forged".into(),
        chain_id: 31337,
        signer: p.signer(0),
        nonce: 4,
        to: "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into(),
        value: "1000000".into(),
        data: Vec::new(),
        gas_limit: 21_000,
        max_fee_per_gas: "2000000000".into(),
        max_priority_fee_per_gas: "1".into(),
        fencing_token: 1,
    };
    let attempts = p.count("SELECT count(*) FROM tx_attempts").await;
    let topic = p.config.topics.tx_allocated();
    let bytes = p
        .codec
        .encode(&topic, Subjects::TopicName, &forged)
        .await
        .expect("encode");
    p.send_to(&topic, &signer_key(31337, &p.signer(0)), &bytes)
        .await;
    let dlq = group_consumer(&p.config.kafka, &unique("dlq"));
    dlq.subscribe(&[&p.config.topics.dlq()]).expect("subscribe");
    let dead = txflow_tests::collect(&dlq, 1, LONG).await;
    assert_eq!(error_codes(&dead), ["UNKNOWN_TX"]);
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts").await,
        attempts,
        "nothing was signed for the forged event"
    );
    p.stop().await;
}
