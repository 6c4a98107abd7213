//! A flaky endpoint does not slow a signer to a crawl (issue 16, point 7): a send that fails for
//! now is sent again within the drive, after a short backoff, instead of waiting for the next
//! recovery scan. Real PostgreSQL, broker and anvil, with the JSON-RPC fault proxy in front of
//! anvil failing two `eth_sendRawTransaction` calls out of every three (an HTTP 503, then an
//! answer later than the client's timeout) and the client making one round only, so that every
//! transaction's first two sends fail as the broadcaster sees them.
//!
//! The broadcaster's recovery scan (and its ready drives) are set an hour apart: the drives that
//! follow the TxSigned messages are all there is, and each of them stops at its first failure
//! unless it sends again. With the drive stopping there (the code before this point) at most one
//! transaction of a drive is sent, most drives none, and the requests are never all mined.

use std::time::Duration;

use txflow_tests::fault_proxy::{Fault, Rule};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{show_logs, wait_until};

const LONG: Duration = Duration::from_secs(120);
const REQUESTS: usize = 8;
const SEND: &str = "eth_sendRawTransaction";

#[tokio::test]
async fn sends_failing_two_times_in_three_are_sent_again_within_the_drive_and_all_mine_once() {
    show_logs();
    let mut p = Pipeline::prepare(1, |c| {
        // One round per call: a failed send reaches the broadcaster (the client's own rounds
        // would otherwise hide every failure of this proxy).
        c.rpc_attempts = 1;
        // Shorter than the proxy's delay: a delayed answer is a timeout to the client (the
        // node still gets the transaction afterwards).
        c.rpc_timeout_ms = 1000;
    })
    .await;
    let proxy = p
        .behind_proxy(vec![
            Rule::on(SEND, 3, Fault::Status(503)).offset(1),
            Rule::on(SEND, 3, Fault::Delay(Duration::from_millis(1500))).offset(2),
        ])
        .await;
    let config = p.config.clone();
    p.start_allocator(&config, "alloc-1").await;
    p.start_signer_gateway(&config).await;
    let hour = Duration::from_secs(3600);
    p.start_broadcaster_with(&config, |sc| {
        sc.recovery_interval = hour;
        sc.ready_interval = hour;
    })
    .await;

    let ids: Vec<String> = (0..REQUESTS).map(|i| format!("flaky-{i}")).collect();
    for id in &ids {
        p.send(&p.request(0, id)).await;
    }
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= REQUESTS as u64
    })
    .await;
    wait_until("every send is recorded", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'SUBMITTED'")
            .await
            == REQUESTS as i64
    })
    .await;

    // Each request mined once, at its own nonce, in request order.
    let nonces = p.mined_nonces().await;
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            nonces.get(&format!("txflow:{id}")),
            Some(&vec![i as u64]),
            "{id} mined once, at nonce {i}: {nonces:?}"
        );
    }
    assert_eq!(nonces.len(), REQUESTS, "nothing else was mined: {nonces:?}");
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED' OR nonce_released")
            .await,
        0,
        "a send that failed for now fails nothing and releases no nonce"
    );
    // The faults happened, on (about) two sends of every three.
    let faults = proxy.faults();
    let failed_503 = faults.get(&(SEND.to_string(), "status")).copied();
    let delayed = faults.get(&(SEND.to_string(), "delay")).copied();
    assert!(
        failed_503.is_some_and(|n| n >= REQUESTS as u64 - 1)
            && delayed.is_some_and(|n| n >= REQUESTS as u64 - 1),
        "sends failed with 503 and timed out: {faults:?}"
    );
    assert!(
        proxy.calls().get(SEND).copied().unwrap_or(0) >= 3 * REQUESTS as u64 - 2,
        "each transaction was sent again after its failures: {:?}",
        proxy.calls()
    );
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string())
    );
    p.stop().await;
}
