//! The harness itself: each piece gives a test what it promises.

use std::time::Duration;

use alloy::providers::{Provider, ProviderBuilder};
use txflow_tests::{AnvilNode, TestDb, wait_for, wait_until};

#[tokio::test]
async fn a_test_database_is_fresh_migrated_and_dropped_afterwards() {
    let db = TestDb::new().await;
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("list tables");
    for t in [
        "managed_tx",
        "recycled_nonces",
        "signer_lease",
        "signer_nonce_cursor",
        "tx_attempts",
        "tx_events",
    ] {
        assert!(tables.iter().any(|x| x == t), "{t} missing from {tables:?}");
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM managed_tx")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(count, 0, "a fresh database is empty");

    let name = db.name.clone();
    drop(db);
    let other = TestDb::empty().await;
    let still_there: Option<i32> =
        sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
            .bind(&name)
            .fetch_optional(&other.pool)
            .await
            .expect("query pg_database");
    assert_eq!(still_there, None, "{name} was dropped with its TestDb");
}

#[tokio::test]
async fn an_anvil_of_its_own_answers_and_mines() {
    let a = AnvilNode::spawn().await;
    let b = AnvilNode::spawn().await;
    assert_ne!(a.port, b.port, "each test gets its own chain");
    let provider = ProviderBuilder::new().connect_http(a.url.parse().expect("url"));
    assert_eq!(provider.get_chain_id().await.expect("chain id"), 31337);
    let first = provider.get_block_number().await.expect("block number");
    wait_until(
        "anvil mines a block with --block-time",
        Duration::from_secs(30),
        || {
            let provider = provider.clone();
            async move { provider.get_block_number().await.is_ok_and(|n| n > first) }
        },
    )
    .await;
    let port = a.port;
    drop(a);
    wait_until(
        "the dropped anvil's port is closed",
        Duration::from_secs(30),
        || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
        },
    )
    .await;
}

#[tokio::test]
async fn wait_for_returns_the_value_once_the_condition_holds() {
    let mut calls = 0;
    let got = wait_for("the third call", Duration::from_secs(10), || {
        calls += 1;
        let n = calls;
        async move { (n >= 3).then_some(n) }
    })
    .await;
    assert_eq!(got, 3);
}

#[tokio::test]
#[should_panic(expected = "timed out after")]
async fn wait_until_fails_with_its_message_after_the_deadline() {
    wait_until(
        "a condition that never holds",
        Duration::from_millis(100),
        || async { false },
    )
    .await;
}
