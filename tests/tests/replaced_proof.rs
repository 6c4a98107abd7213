//! REPLACED only on proof (issue 12, point 2): a transaction that is mined, but whose send the
//! broadcaster never heard answered, is sent again and answered "nonce too low"; the endpoint then
//! says "unknown" (`null`) for every one of its hashes, by transaction and by receipt (a lagging,
//! pruned or lying node). A missing hash lookup is no proof that another transaction used the
//! nonce: the chain's blocks are (the block where the signer's nonce passed ours holds our hash),
//! so the transaction is SUBMITTED at its nonce, never REPLACED, and mined once. Real PostgreSQL,
//! broker and anvil, with the JSON-RPC fault proxy in front of anvil.

use std::time::Duration;

use alloy::primitives::Address;
use alloy::signers::local::PrivateKeySigner;
use txflow_core::chain::{Chain, ChainClient, SendOutcome};
use txflow_tests::AnvilNode;
use txflow_tests::fake_chain::{FakeChain, signed_transfer};
use txflow_tests::fault_proxy::{Fault, Rule};
use txflow_tests::pipeline::{Pipeline, SINK};
use txflow_tests::{show_logs, wait_until};

const LONG: Duration = Duration::from_secs(180);

/// The lookups of a transaction by hash that the proxy answers "unknown" (`null`), always.
fn unknown_hashes() -> Vec<Rule> {
    vec![
        Rule::on(
            "eth_getTransactionByHash",
            1,
            Fault::Result(serde_json::Value::Null),
        ),
        Rule::on(
            "eth_getTransactionReceipt",
            1,
            Fault::Result(serde_json::Value::Null),
        ),
    ]
}

/// How many TxReplaced rows request `id`'s transaction has.
async fn replaced_events(p: &Pipeline, id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM tx_events e JOIN managed_tx m USING (tx_id)
         WHERE m.request_id = $1 AND e.type = 'TxReplaced'",
    )
    .bind(id)
    .fetch_one(&p.db.pool)
    .await
    .expect("TxReplaced rows")
}

#[tokio::test]
async fn a_mined_transaction_whose_hash_lookups_say_unknown_is_not_replaced_nor_sent_twice() {
    show_logs();
    let mut p = Pipeline::prepare(1, |_| {}).await;
    // Every send reaches anvil, which takes and mines it, but its answer is lost: the
    // transaction stays SIGNED. Every lookup of a hash says "unknown".
    let mut rules = vec![Rule::on(
        "eth_sendRawTransaction",
        1,
        Fault::ForwardThenLose,
    )];
    rules.extend(unknown_hashes());
    let proxy = p.behind_proxy(rules).await;
    let config = p.config.clone();
    p.start_stages(&config).await;

    p.send(&p.request(0, "proof-0")).await;
    wait_until("the transaction is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;
    assert!(
        proxy
            .faults()
            .get(&("eth_sendRawTransaction".to_string(), "forward_then_lose"))
            .is_some_and(|n| *n >= 1),
        "the send's answer was lost: {:?}",
        proxy.faults()
    );
    assert_eq!(
        p.state_of("proof-0").await.as_deref(),
        Some("SIGNED"),
        "no answer heard: still SIGNED"
    );

    // Sends are answered again: the same bytes now get "nonce too low", and the hash lookups
    // still say "unknown".
    proxy.set_rules(unknown_hashes());
    wait_until(
        "the transaction's \"nonce too low\" is settled",
        LONG,
        || async {
            p.state_of("proof-0").await.as_deref() == Some("SUBMITTED")
                || replaced_events(&p, "proof-0").await > 0
        },
    )
    .await;
    assert_eq!(
        replaced_events(&p, "proof-0").await,
        0,
        "a mined transaction whose hash lookups said \"unknown\" was REPLACED"
    );

    // A later request takes the next nonce: the signer moved on.
    p.send(&p.request(0, "proof-1")).await;
    wait_until("the second transaction is mined", LONG, || async {
        p.mined_count().await >= 2
    })
    .await;
    wait_until("the second transaction is SUBMITTED", LONG, || async {
        p.state_of("proof-1").await.as_deref() == Some("SUBMITTED")
    })
    .await;

    let markers = p.mined_markers().await;
    assert_eq!(
        markers.get("txflow:proof-0"),
        Some(&1),
        "mined exactly once: {markers:?}"
    );
    let nonces = p.mined_nonces().await;
    assert_eq!(
        nonces.get("txflow:proof-0"),
        Some(&vec![0]),
        "at its own nonce: {nonces:?}"
    );
    assert_eq!(
        nonces.get("txflow:proof-1"),
        Some(&vec![1]),
        "the next request at the next nonce: {nonces:?}"
    );
    assert_eq!(nonces.len(), 2, "nothing else was mined: {nonces:?}");

    let rows: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT request_id, nonce, state FROM managed_tx ORDER BY request_id")
            .fetch_all(&p.db.pool)
            .await
            .expect("rows");
    assert_eq!(
        rows,
        vec![
            ("proof-0".to_string(), 0, "SUBMITTED".to_string()),
            ("proof-1".to_string(), 1, "SUBMITTED".to_string()),
        ],
        "each at its one nonce, SUBMITTED"
    );
    assert_eq!(
        p.count(
            "SELECT count(*) FROM tx_attempts a JOIN managed_tx m USING (tx_id)
             WHERE m.request_id = 'proof-0'"
        )
        .await,
        1,
        "signed once: no second nonce, no second transaction"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxReplaced'")
            .await,
        0,
        "no TxReplaced"
    );
    assert_eq!(
        p.count(
            "SELECT count(*) FROM tx_events e JOIN managed_tx m USING (tx_id)
             WHERE m.request_id = 'proof-0' AND e.type = 'TxSubmitted'
               AND e.payload->>'outcome' = 'POSSIBLY_SENT'"
        )
        .await,
        1,
        "SUBMITTED as possibly sent, on the chain's proof"
    );
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string())
    );

    // The premise held: the node was asked by hash and by receipt, and said "unknown"; the
    // answer came from the chain's blocks.
    let faults = proxy.faults();
    for method in ["eth_getTransactionByHash", "eth_getTransactionReceipt"] {
        assert!(
            faults
                .get(&(method.to_string(), "result"))
                .is_some_and(|n| *n >= 1),
            "{method} was answered \"unknown\": {faults:?}"
        );
    }
    let calls = proxy.calls();
    assert!(
        calls.get("eth_getBlockByNumber").is_some_and(|n| *n >= 1),
        "the block where the nonce passed was read: {calls:?}"
    );
    p.stop().await;
}

/// What the proof is made of, asked of a `ChainClient` whose `key` is funded and has sent
/// nothing: the signer's nonce as of each block, and each block's transaction hashes. `mine`
/// mines one block with what the pool holds.
async fn history_contract<M, Fut>(c: &dyn ChainClient, key: &PrivateKeySigner, mine: M)
where
    M: Fn() -> Fut,
    Fut: Future<Output = ()>,
{
    let me = key.address();
    let sink: Address = SINK.parse().expect("sink");
    let (max_fee, tip) = c.fees().await.expect("fees");
    let fees = (max_fee * 2, tip);
    let before = c.block_number().await.expect("block number");
    let t0 = signed_transfer(key, 0, sink, fees);
    let t1 = signed_transfer(key, 1, sink, fees);
    for t in [&t0, &t1] {
        assert_eq!(
            c.send_raw(&t.raw).await.expect("send"),
            SendOutcome::Accepted
        );
    }
    mine().await;
    let block = c.block_number().await.expect("block number");
    assert!(block > before, "mined ({before} → {block})");
    assert_eq!(c.nonce_at(me, before).await.expect("nonce before"), 0);
    assert_eq!(c.nonce_at(me, block).await.expect("nonce after"), 2);
    assert_eq!(
        c.block_transaction_hashes(block).await.expect("hashes"),
        Some(vec![t0.hash, t1.hash]),
        "the block's transactions, in order"
    );
    assert_eq!(
        c.block_transaction_hashes(before).await.expect("hashes"),
        Some(vec![]),
        "the block before holds none of ours"
    );
    assert_eq!(
        c.block_transaction_hashes(block + 1_000)
            .await
            .expect("hashes"),
        None,
        "past the head"
    );
    assert!(
        c.nonce_at(me, block + 1_000).await.is_err(),
        "no nonce past the head"
    );
}

#[tokio::test]
async fn the_chains_history_is_the_same_on_anvil_and_on_the_fake_chain() {
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let key = anvil.funded_key().await;
    let chain = Chain::connect(&anvil.url, 31337).expect("connect");
    history_contract(&chain, &key, || anvil.mine_block()).await;

    let fake = FakeChain::new();
    let key = PrivateKeySigner::random();
    history_contract(&fake, &key, || async {
        fake.mine();
    })
    .await;
}
