//! Nonce healing (issue 6): a nonce whose transaction can no longer be sent is released and
//! either taken by the signer's next request or filled with a 0-value self-transfer, so that the
//! signer never stalls on a gap. Checked on the chain and in PostgreSQL.

use std::time::Duration;

use alloy::primitives::U256;
use txflow_core::config::Config;
use txflow_core::events::TxCommandKind;
use txflow_tests::pipeline::{Pipeline, SINK};
use txflow_tests::wait_until;

const LONG: Duration = Duration::from_secs(180);

/// The transaction of signer 0 with `nonce` on the chain: `(to, value, input)`.
async fn mined_at(p: &Pipeline, nonce: u64) -> Option<(String, U256, Vec<u8>)> {
    let me = p.signers[0].address();
    p.mined()
        .await
        .into_iter()
        .find(|tx| tx.signer == me && tx.nonce == nonce)
        .map(|tx| (tx.to, tx.value, tx.input))
}

async fn state(p: &Pipeline, request_id: &str) -> Option<(String, Option<i64>, bool)> {
    sqlx::query_as("SELECT state, nonce, nonce_released FROM managed_tx WHERE request_id = $1")
        .bind(request_id)
        .fetch_optional(&p.db.pool)
        .await
        .expect("query")
}

#[tokio::test]
async fn a_nonce_refused_at_signing_with_nobody_waiting_is_filled_by_a_noop() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let loose = p.config.clone();
    let strict = Config {
        policy_whitelist: vec![SINK.into()],
        ..loose.clone()
    };
    p.start_allocator(&loose, "alloc-1").await;
    p.start_signer_gateway(&strict).await;
    p.start_broadcaster(&loose).await;

    // Two fine requests, then one the signer gateway refuses, then nothing: no request waits for
    // the freed nonce.
    p.send(&p.request(0, "first")).await;
    p.send(&p.request(0, "second")).await;
    let mut refused = p.request(0, "refused");
    refused.to = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into();
    p.send(&refused).await;
    wait_until("the refused nonce is filled and mined", LONG, || async {
        p.mined_count().await >= 3
    })
    .await;
    let (st, nonce, released) = state(&p, "refused").await.expect("recorded");
    assert_eq!((st.as_str(), released), ("FAILED", true));
    let nonce = nonce.expect("it had a nonce");
    let (to, value, input) = mined_at(&p, nonce as u64)
        .await
        .expect("a transaction at the freed nonce");
    assert_eq!(to, p.signer(0), "a self-transfer");
    assert_eq!(value, U256::ZERO);
    assert!(input.is_empty());
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE kind = 'NOOP'")
            .await,
        1
    );
    let noop_nonce: i64 = sqlx::query_scalar("SELECT nonce FROM managed_tx WHERE kind = 'NOOP'")
        .fetch_one(&p.db.pool)
        .await
        .expect("noop");
    assert_eq!(noop_nonce, nonce);

    // Later requests of the signer still mine.
    p.send(&p.request(0, "later")).await;
    wait_until("the later request is mined", LONG, || async {
        p.mined_count().await >= 4
    })
    .await;
    let markers = p.mined_markers().await;
    for m in ["txflow:first", "txflow:second", "txflow:later"] {
        assert_eq!(markers.get(m), Some(&1), "{m}: {markers:?}");
    }
    assert!(!markers.contains_key("txflow:refused"));
    assert_eq!(
        p.count("SELECT count(*) FROM recycled_nonces").await,
        0,
        "no released nonce left"
    );
    p.stop().await;
}

#[tokio::test]
async fn a_cancel_after_allocation_releases_the_nonce_and_nothing_behind_it_stalls() {
    // No signer gateway yet: the requests stop at ALLOCATED, where they can be cancelled.
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let config = p.config.clone();
    p.start_allocator(&config, "alloc-1").await;
    p.start_broadcaster(&config).await;
    for i in 0..3 {
        p.send(&p.request(0, &format!("c-{i}"))).await;
    }
    wait_until("all three are allocated", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'ALLOCATED'")
            .await
            == 3
    })
    .await;
    let tx_id: String =
        sqlx::query_scalar("SELECT tx_id::text FROM managed_tx WHERE request_id = 'c-1'")
            .fetch_one(&p.db.pool)
            .await
            .expect("c-1");
    p.command(&tx_id, TxCommandKind::Cancel).await;
    wait_until("the cancelled transaction is failed", LONG, || async {
        state(&p, "c-1")
            .await
            .is_some_and(|(s, _, released)| s == "FAILED" && released)
    })
    .await;
    let (_, cancelled_nonce, _) = state(&p, "c-1").await.expect("c-1");
    assert_eq!(cancelled_nonce, Some(1));

    // Now sign: c-0 and c-2 go out; nonce 1 is filled (by a noop, since nobody waits), so c-2
    // is not stuck behind the gap.
    p.start_signer_gateway(&config).await;
    wait_until("c-0, the filler and c-2 are mined", LONG, || async {
        p.mined_count().await >= 3
    })
    .await;
    let (to, value, _) = mined_at(&p, 1).await.expect("nonce 1 mined");
    assert_eq!((to, value), (p.signer(0), U256::ZERO), "nonce 1 is a noop");
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:c-0"), Some(&1));
    assert_eq!(markers.get("txflow:c-2"), Some(&1));
    assert!(!markers.contains_key("txflow:c-1"));
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string())
    );
    p.stop().await;
}
