//! The request-to-chain pipeline when the chain does not do what was asked (issue 6): a node that
//! drops a submitted transaction, a signer that cannot pay, a nonce taken by a transaction sent
//! outside txflow. Outcomes are read on the chain and in PostgreSQL.

use std::time::Duration;

use alloy::primitives::{B256, U256};
use alloy::providers::Provider;
use alloy::providers::ext::AnvilApi;
use txflow_tests::AnvilNode;
use txflow_tests::pipeline::Pipeline;
use txflow_tests::wait_until;

const LONG: Duration = Duration::from_secs(180);

#[tokio::test]
async fn a_submitted_transaction_the_node_drops_is_sent_again_and_mined_once() {
    // No mining until the test says so: the transaction sits in the pool where it can be dropped.
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 1, |c| c.resubmit_interval_ms = 500).await;
    let config = p.config.clone();
    p.start_stages(&config).await;

    p.send(&p.request(0, "dropped")).await;
    wait_until("the request is SUBMITTED", LONG, || async {
        p.state_of("dropped").await.as_deref() == Some("SUBMITTED")
    })
    .await;
    let hash: String =
        sqlx::query_scalar("SELECT a.tx_hash FROM tx_attempts a JOIN managed_tx m USING (tx_id) WHERE m.request_id = 'dropped'")
            .fetch_one(&p.db.pool)
            .await
            .expect("attempt");
    let hash: B256 = hash.parse().expect("hash");
    let provider = p.provider();
    provider
        .anvil_drop_transaction(hash)
        .await
        .expect("anvil_dropTransaction");
    assert_eq!(
        provider
            .get_transaction_by_hash(hash)
            .await
            .expect("lookup"),
        None,
        "the node no longer has it"
    );
    wait_until("the broadcaster sends it again", LONG, || async {
        provider
            .get_transaction_by_hash(hash)
            .await
            .expect("lookup")
            .is_some()
    })
    .await;
    provider.anvil_mine(Some(1), None).await.expect("mine");
    let receipt = provider
        .get_transaction_receipt(hash)
        .await
        .expect("receipt lookup")
        .expect("mined");
    assert!(receipt.status());
    assert_eq!(
        p.mined_markers().await.get("txflow:dropped"),
        Some(&1),
        "mined once"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts").await,
        1,
        "sent again as is, never signed again"
    );
    // Once the chain has passed its nonce, it is no longer sent.
    wait_until("resubmission stops after mining", LONG, || async {
        p.count("SELECT count(*) FROM tx_attempts WHERE next_resubmit_at IS NOT NULL")
            .await
            == 0
    })
    .await;
    p.stop().await;
}

#[tokio::test]
async fn a_signer_without_funds_is_held_and_its_requests_mine_once_funded() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let me = p.signers[0].address();
    p.provider()
        .anvil_set_balance(me, U256::ZERO)
        .await
        .expect("empty the account");
    let config = p.config.clone();
    p.start_stages(&config).await;

    for i in 0..3 {
        p.send(&p.request(0, &format!("poor-{i}"))).await;
    }
    wait_until("the signer is held", LONG, || async {
        p.count("SELECT count(*) FROM signer_holds").await == 1
    })
    .await;
    let reason: String = sqlx::query_scalar("SELECT reason FROM signer_holds")
        .fetch_one(&p.db.pool)
        .await
        .expect("hold");
    assert!(
        reason.to_lowercase().contains("insufficient funds"),
        "{reason}"
    );
    wait_until("all three requests are recorded", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx").await == 3
    })
    .await;
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED' OR nonce IS NOT NULL")
            .await,
        0,
        "nothing failed, no nonce taken while held"
    );
    assert_eq!(p.mined_count().await, 0);

    p.provider()
        .anvil_set_balance(me, U256::from(10u128.pow(21)))
        .await
        .expect("fund");
    wait_until("the three requests mine", LONG, || async {
        p.mined_count().await == 3
    })
    .await;
    let markers = p.mined_markers().await;
    for i in 0..3 {
        assert_eq!(
            markers.get(&format!("txflow:poor-{i}")),
            Some(&1),
            "{markers:?}"
        );
    }
    wait_until("the hold is cleared", LONG, || async {
        p.count("SELECT count(*) FROM signer_holds").await == 0
    })
    .await;
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED'")
            .await,
        0
    );
    p.stop().await;
}

#[tokio::test]
async fn a_nonce_used_outside_txflow_is_replaced_and_the_request_mines_at_a_fresh_nonce() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let config = p.config.clone();
    // Allocator and broadcaster first: the request takes nonce 0 and waits for its signature.
    p.start_allocator(&config, "alloc-1").await;
    p.start_broadcaster(&config).await;
    p.send(&p.request(0, "victim")).await;
    wait_until("the request is ALLOCATED", LONG, || async {
        p.state_of("victim").await.as_deref() == Some("ALLOCATED")
    })
    .await;
    let nonce: i64 = sqlx::query_scalar("SELECT nonce FROM managed_tx WHERE request_id = 'victim'")
        .fetch_one(&p.db.pool)
        .await
        .expect("nonce");
    assert_eq!(nonce, 0);

    // Someone uses the same key straight on the chain, at that nonce.
    p.spend_nonce_outside(0, 0).await;

    // Now txflow signs nonce 0, the node says "nonce too low", and the chain knows none of our
    // hashes: REPLACED, a fresh nonce, mined.
    p.start_signer_gateway(&config).await;
    p.send(&p.request(0, "after")).await;
    wait_until("both requests mine", LONG, || async {
        p.mined_count().await == 3
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:victim"), Some(&1), "{markers:?}");
    assert_eq!(markers.get("txflow:after"), Some(&1), "{markers:?}");
    assert_eq!(
        p.count(
            "SELECT count(*) FROM tx_events e JOIN managed_tx m USING (tx_id)
             WHERE m.request_id = 'victim' AND e.type = 'TxReplaced'"
        )
        .await,
        1
    );
    let (nonce, attempts): (i64, i64) = sqlx::query_as(
        "SELECT m.nonce, (SELECT count(*) FROM tx_attempts a WHERE a.tx_id = m.tx_id)
         FROM managed_tx m WHERE request_id = 'victim'",
    )
    .fetch_one(&p.db.pool)
    .await
    .expect("victim");
    assert!(nonce >= 1, "a fresh nonce, got {nonce}");
    assert_eq!(attempts, 2, "signed at nonce 0, then at its fresh nonce");
    assert_eq!(
        p.count("SELECT count(DISTINCT nonce) FROM managed_tx WHERE state = 'SUBMITTED'")
            .await,
        2
    );
    assert_eq!(p.pool_status().await, ("0x0".into(), "0x0".into()));
    p.stop().await;
}
