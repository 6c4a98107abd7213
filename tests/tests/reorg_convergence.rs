//! Every signer converges after a sequence of reorgs (issue 32 item 10): the whole pipeline on an
//! anvil that mines only when told, and a fixed schedule of reorgs — shallower and deeper than
//! the required confirmations, some putting our removed transactions back (their signed bytes,
//! `anvil_reorg` with a transaction list) at other heights, some leaving them out; then, once all
//! is final, two reorgs that replace every block holding a transaction of ours (defensive
//! cancellations included), the first putting ours back lower, the second leaving everything
//! out. After each phase, blocks are mined until the pipeline settles: every request ends
//! CONFIRMED and on the chain exactly once (by marker), none FAILED, the node's pool empty and
//! each signer's chain nonce its cursor (no gap). Real PostgreSQL, broker and anvil.

use std::time::Duration;

use alloy::network::TransactionBuilder;
use alloy::primitives::{Address, U256};
use alloy::providers::Provider;
use alloy::providers::ext::AnvilApi;
use alloy::rpc::types::TransactionRequest;
use alloy::rpc::types::anvil::{ReorgOptions, TransactionData};
use txflow_tests::pipeline::{Pipeline, SINK};
use txflow_tests::{AnvilNode, wait_until};

const LONG: Duration = Duration::from_secs(240);

/// anvil's first dev account: the sender of the transfers that make new blocks differ.
const OUTSIDER: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";

/// The transaction hashes of the last `depth` blocks.
async fn hashes_in_last(p: &Pipeline, depth: u64) -> Vec<String> {
    let provider = p.provider();
    let head = provider.get_block_number().await.expect("head");
    let mut hashes = Vec::new();
    for n in head + 1 - depth..=head {
        let block = provider
            .get_block_by_number(n.into())
            .await
            .expect("block")
            .expect("the block exists");
        hashes.extend(block.transactions.hashes().map(|h| format!("{h:#x}")));
    }
    hashes
}

/// Our signed bytes mined in the last `depth` blocks (from `tx_attempts`, by hash).
async fn ours_in_last(p: &Pipeline, depth: u64) -> Vec<Vec<u8>> {
    let hashes = hashes_in_last(p, depth).await;
    sqlx::query_scalar("SELECT raw_tx FROM tx_attempts WHERE tx_hash = ANY($1) ORDER BY tx_hash")
        .bind(hashes)
        .fetch_all(&p.db.pool)
        .await
        .expect("attempts")
}

/// Replaces the last `depth` blocks: an outsider's transfer in the first new one, and `again`
/// (our signed bytes) spread over the new blocks from the second on.
async fn reorg(p: &Pipeline, depth: u64, again: Vec<Vec<u8>>, salt: u64) {
    let outsider = TransactionRequest::default()
        .with_from(OUTSIDER.parse::<Address>().expect("address"))
        .with_to(SINK.parse::<Address>().expect("sink"))
        .with_value(U256::from(salt))
        .with_gas_limit(21_000);
    let mut pairs = vec![(TransactionData::JSON(outsider), 0)];
    for (i, raw) in again.into_iter().enumerate() {
        pairs.push((
            TransactionData::Raw(raw.into()),
            1 + i as u64 % (depth - 1).max(1),
        ));
    }
    p.provider()
        .anvil_reorg(ReorgOptions {
            depth,
            tx_block_pairs: pairs,
        })
        .await
        .expect("anvil_reorg");
}

/// Every signer's chain nonce is its cursor: nothing txflow allocated is missing on the chain.
async fn no_gap(p: &Pipeline) -> bool {
    let provider = p.provider();
    for (i, s) in p.signers.iter().enumerate() {
        let chain = provider
            .get_transaction_count(s.address())
            .await
            .expect("nonce");
        let cursor: Option<i64> =
            sqlx::query_scalar("SELECT next_nonce FROM signer_nonce_cursor WHERE signer = $1")
                .bind(p.signer(i))
                .fetch_optional(&p.db.pool)
                .await
                .expect("cursor");
        if cursor != Some(chain as i64) {
            return false;
        }
    }
    true
}

/// A row as the diagnosis shows it: request, state, nonce, re-evaluated, generation, block.
type RowState = (String, String, Option<i64>, bool, i32, Option<i64>);

/// Mines until every request is CONFIRMED (not being re-evaluated), the node's pool is empty and
/// no signer has a gap (each block gives the pipeline a chance to move), or fails after [`LONG`].
async fn settled(p: &Pipeline, n: i64) {
    let provider = p.provider();
    let diag = async {
        let rows: Vec<RowState> = sqlx::query_as(
            "SELECT request_id, state, nonce, reorged_at IS NOT NULL, reorg_generation, mined_block_number
             FROM managed_tx ORDER BY signer, nonce",
        )
        .fetch_all(&p.db.pool)
        .await
        .expect("rows");
        let cancels: Vec<(i64, i32, bool)> = sqlx::query_as(
            "SELECT nonce, sends, submitted_at IS NOT NULL FROM tx_cancellations ORDER BY nonce",
        )
        .fetch_all(&p.db.pool)
        .await
        .unwrap_or_default();
        let mut nonces = Vec::new();
        for s in &p.signers {
            nonces.push(
                provider
                    .get_transaction_count(s.address())
                    .await
                    .unwrap_or(0),
            );
        }
        eprintln!(
            "rows {rows:?}\ncancellations {cancels:?}\nchain nonces {nonces:?}\npool {:?}\nhead {:?}",
            p.pool_status().await,
            provider.get_block_number().await
        );
    };
    if tokio::time::timeout(LONG, async {
        loop {
            provider.anvil_mine(Some(1), None).await.expect("mine");
            if p.count(
                "SELECT count(*) FROM managed_tx WHERE kind = 'REQUEST' AND state = 'CONFIRMED'
                 AND reorged_at IS NULL",
            )
            .await
                == n
                && p.pool_status().await == ("0x0".into(), "0x0".into())
                && no_gap(p).await
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .is_err()
    {
        diag.await;
        panic!("not settled after {LONG:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_reorgs_deep_and_shallow_with_and_without_re_inclusion_every_request_is_on_chain_once_with_no_gap()
 {
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 2, |c| {
        c.confirmations_required = 3;
        c.resubmit_interval_ms = 1000;
    })
    .await;
    let config = p.config.clone();
    p.start_all_stages(&config).await;
    let provider = p.provider();
    provider.anvil_mine(Some(8), None).await.expect("mine");

    let mut ids = Vec::new();
    for round in 0..4 {
        for s in 0..2 {
            let id = format!("conv-{round}-{s}");
            p.send(&p.request(s, &id)).await;
            ids.push(id);
        }
    }
    let n = ids.len() as i64;
    wait_until("every request is submitted", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'SUBMITTED'")
            .await
            == n
    })
    .await;
    // (blocks mined, reorg depth, whether our removed transactions are put back)
    let schedule: [(u64, u64, bool); 8] = [
        (2, 1, false),
        (3, 4, true),
        (2, 2, true),
        (4, 5, false),
        (1, 1, true),
        (3, 6, true),
        (2, 3, false),
        (5, 4, true),
    ];
    for (k, (mine, depth, again)) in schedule.into_iter().enumerate() {
        provider.anvil_mine(Some(mine), None).await.expect("mine");
        // Let the stages see this chain before it changes again: every transaction of ours in
        // the blocks just mined has its receipt recorded.
        let mined = hashes_in_last(&p, mine).await;
        wait_until("the receipts of what was mined are read", LONG, || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM managed_tx m JOIN tx_attempts a USING (tx_id)
                 WHERE a.tx_hash = ANY($1) AND m.state = 'SUBMITTED'",
            )
            .bind(&mined)
            .fetch_one(&p.db.pool)
            .await
            .expect("count");
            waiting == 0
        })
        .await;
        let back = if again {
            ours_in_last(&p, depth).await
        } else {
            Vec::new()
        };
        reorg(&p, depth, back, 1000 + k as u64).await;
    }

    settled(&p, n).await;

    // Then reorgs deeper than the depth of what is all final: every block with a transaction of
    // ours replaced, ours put back lower (first) or left out (second), with the confirmation
    // manager seeing each new chain before the next.
    for (k, again) in [true, false].into_iter().enumerate() {
        let head = provider.get_block_number().await.expect("head");
        // The lowest block of a transaction the confirmation manager still watches: a reorg
        // below a transaction past its watch window (twice the confirmations, at least 64
        // blocks) is beyond what txflow follows, by design. `settled` mines a block every
        // 200 ms, so on a busy machine the first transactions can pass their window before
        // this reorg: they are then left on the chain, not reorged out.
        let first: i64 = sqlx::query_scalar(
            "SELECT min(mined_block_number) FROM managed_tx
             WHERE state = 'CONFIRMED' AND watch_until_block > $1",
        )
        .bind(head as i64)
        .fetch_one(&p.db.pool)
        .await
        .map(|b: Option<i64>| b.expect("a transaction still watched"))
        .expect("lowest block");
        let depth = head - (first as u64) + 2;
        let back = if again {
            ours_in_last(&p, depth).await
        } else {
            Vec::new()
        };
        reorg(&p, depth, back, 2000 + k as u64).await;
        wait_until("the deep reorg is seen", LONG, || async {
            p.count("SELECT count(*) FROM managed_tx WHERE reorged_at IS NOT NULL OR state <> 'CONFIRMED'")
                .await
                > 0
        })
        .await;
        settled(&p, n).await;
    }
    let markers = p.mined_markers().await;
    for id in &ids {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{id} on the chain exactly once: {markers:?}"
        );
    }
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED'")
            .await,
        0
    );
    for (i, s) in p.signers.iter().enumerate() {
        let chain: u64 = provider
            .get_transaction_count(s.address())
            .await
            .expect("nonce");
        let cursor: i64 =
            sqlx::query_scalar("SELECT next_nonce FROM signer_nonce_cursor WHERE signer = $1")
                .bind(p.signer(i))
                .fetch_one(&p.db.pool)
                .await
                .expect("cursor");
        assert_eq!(
            chain as i64, cursor,
            "signer {i}: the chain's nonce is the cursor"
        );
    }
    p.stop().await;
}
