//! The `ChainClient` contract, run against both implementations: the JSON-RPC client (`Chain`)
//! on an anvil of the test's own, and the scripted `FakeChain` of the middle test tier. The same
//! calls get the same kinds of answers, so that what a stage is shown to do against the fake it
//! does against a node.

use alloy::primitives::{Address, Bytes, U256};
use alloy::signers::local::PrivateKeySigner;
use txflow_core::chain::{Chain, ChainClient, SendOutcome, Simulation};
use txflow_tests::AnvilNode;
use txflow_tests::fake_chain::{FakeChain, signed_transfer};

const SINK: &str = "0x000000000000000000000000000000000000dead";

/// What every `ChainClient` answers, for a funded `key` with no transactions yet; `mine` mines
/// one block with what the pool holds.
async fn contract<M, Fut>(c: &dyn ChainClient, key: &PrivateKeySigner, mine: M)
where
    M: Fn() -> Fut,
    Fut: Future<Output = ()>,
{
    let me = key.address();
    let sink: Address = SINK.parse().expect("sink");
    assert_eq!(c.latest_nonce(me).await.expect("latest"), 0);
    assert_eq!(c.pending_nonce(me).await.expect("pending"), 0);
    match c
        .simulate(me, sink, U256::from(1), Bytes::new())
        .await
        .expect("simulate")
    {
        Simulation::Ok { gas } => assert!(gas >= 21_000, "gas {gas}"),
        other => panic!("a plain transfer simulates fine: {other:?}"),
    }
    let (max_fee, tip) = c.fees().await.expect("fees");
    assert!(max_fee >= tip && max_fee > 0, "fees {max_fee} / {tip}");
    // Generous fees: the base fee may rise between the estimate and the block.
    let fees = (max_fee * 2, tip);
    let head = c.block_number().await.expect("block number");

    let t0 = signed_transfer(key, 0, sink, fees);
    assert_eq!(
        c.send_raw(&t0.raw).await.expect("send"),
        SendOutcome::Accepted
    );
    let again = c.send_raw(&t0.raw).await.expect("send again");
    assert!(
        matches!(again, SendOutcome::PossiblySent { .. }),
        "pooled, sent again: {again:?}"
    );
    assert_eq!(c.pending_nonce(me).await.expect("pending"), 1);
    assert_eq!(c.latest_nonce(me).await.expect("latest"), 0);
    assert!(c.knows_transaction(t0.hash).await.expect("known"));
    assert_eq!(c.receipt(t0.hash).await.expect("receipt"), None);

    mine().await;
    let n = c.block_number().await.expect("block number");
    assert!(n > head, "a block was mined ({head} → {n})");
    assert_eq!(c.latest_nonce(me).await.expect("latest"), 1);
    let receipt = c
        .receipt(t0.hash)
        .await
        .expect("receipt")
        .expect("mined: a receipt");
    assert!(receipt.status, "{receipt:?}");
    assert_eq!(receipt.tx_hash, t0.hash);
    assert_eq!(receipt.gas_used, 21_000);
    assert!(receipt.effective_gas_price > 0);
    let block = c
        .block(receipt.block_number)
        .await
        .expect("block")
        .expect("the receipt's block");
    assert_eq!(block.hash, receipt.block_hash);
    assert_eq!(block.number, receipt.block_number);
    let parent = c
        .block(receipt.block_number - 1)
        .await
        .expect("block")
        .expect("its parent");
    assert_eq!(block.parent_hash, parent.hash);
    assert_eq!(c.block(n + 1_000).await.expect("block"), None);

    // Mined: the same bytes, or another transaction at that nonce, are "nonce too low"; only
    // knows_transaction tells ours from someone else's.
    let again = c.send_raw(&t0.raw).await.expect("send again");
    assert!(
        matches!(again, SendOutcome::NonceTooLow { .. }),
        "mined, sent again: {again:?}"
    );
    let other = signed_transfer(key, 0, Address::repeat_byte(1), fees);
    let answer = c.send_raw(&other.raw).await.expect("send");
    assert!(
        matches!(answer, SendOutcome::NonceTooLow { .. }),
        "a used nonce: {answer:?}"
    );
    assert!(c.knows_transaction(t0.hash).await.expect("known"));
    assert!(!c.knows_transaction(other.hash).await.expect("unknown"));

    let answer = c.send_raw(b"not a transaction").await.expect("send");
    assert!(
        matches!(
            answer,
            SendOutcome::Rejected {
                retryable: false,
                ..
            }
        ),
        "garbage: {answer:?}"
    );
}

#[tokio::test]
async fn the_rpc_client_keeps_the_contract_on_anvil() {
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let key = anvil.funded_key().await;
    let chain = Chain::connect(&anvil.url, 31337).expect("connect");
    contract(&chain, &key, || anvil.mine_block()).await;
}

#[tokio::test]
async fn the_fake_chain_keeps_the_contract() {
    let chain = FakeChain::new();
    let key = PrivateKeySigner::random();
    contract(&chain, &key, || async {
        chain.mine();
    })
    .await;
}
