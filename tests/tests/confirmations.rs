//! The confirmation manager end to end (issue 14 points 2 and 3): the whole pipeline — allocator,
//! signer gateway, broadcaster, receipt checker, confirmation manager — on an anvil that mines
//! only when told (`--no-mining`, `evm_mine`), reorganised with `anvil_reorg`, against real
//! PostgreSQL and broker.
//!
//! - TxConfirmed comes after exactly `confirmations.required` blocks (the transaction's own
//!   included), once per transaction (one `event_id`), in each signer's nonce order, after its
//!   TxAccepted; the lists grow one block at a time with `new_fork = false`;
//! - a reorg shallower than the depth that replaces a later block announces `new_fork = true` with
//!   the complete list; one that removes the transaction's block sends it back to SUBMITTED, it is
//!   sent again, mined again and confirmed once;
//! - a reorg deeper than the depth after TxConfirmed raises the critical alert, announces
//!   `new_fork = true`, and txflow sends a defensive cancellation of the nonce (signed by the signer
//!   gateway, sent by the broadcaster: a 0-value self-transfer with a high tip) while the
//!   transaction stays CONFIRMED; whichever of the two is mined settles it: the cancellation,
//!   buried at the depth → re-evaluated (SIMULATED), sent with a fresh nonce and confirmed again
//!   under a new `event_id`; the original (another producer's block) → confirmed again at its
//!   nonce, the cancellation never mined;
//! - replaying `tx.receipts` from the beginning changes nothing and re-emits the same TxConfirmed
//!   `event_id`s.
//!
//! Waiting is by condition with a deadline; nothing sleeps to synchronise.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use alloy::consensus::Transaction as _;
use alloy::network::TransactionBuilder;
use alloy::primitives::{Address, B256, Bytes, U256};
use alloy::providers::Provider;
use alloy::providers::ext::AnvilApi;
use alloy::rpc::types::TransactionRequest;
use alloy::rpc::types::anvil::{ReorgOptions, TransactionData};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::{Message, Offset, TopicPartitionList};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use txflow_core::chain::{UnsignedTx, sign};
use txflow_core::codec::RegistryCodec;
use txflow_core::config::Config;
use txflow_core::deps::Deps;
use txflow_core::domain::NodeId;
use txflow_core::events::TxCommandKind;
use txflow_core::events::{
    TxAccepted, TxConfirmationReverted, TxConfirmationsUpdated, TxConfirmed, TxReceiptUpdated,
    TxSubmitted,
};
use txflow_core::lease::LeaseConfig;
use txflow_tests::fault_proxy::{Fault, FaultProxy, Rule};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{AnvilNode, group_consumer, registry_url, unique, wait_until};

const LONG: Duration = Duration::from_secs(120);

/// anvil's first dev account (unlocked): the sender of the outsiders' transactions that make a
/// reorg's new blocks differ from the old ones.
const OUTSIDER: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";

// ---------------------------------------------------------------------------------------------
// The pipeline and what it announced.
// ---------------------------------------------------------------------------------------------

/// The pipeline on a `--no-mining` anvil with `required` confirmations, the confirmation manager
/// started by the test (so that it can be stopped and restarted alone).
struct Run {
    p: Pipeline,
    cm: Option<(CancellationToken, JoinHandle<()>)>,
    events: Events,
}

impl Run {
    async fn start(signers: usize, required: u32) -> Run {
        let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
        Run::start_on(anvil, signers, required, |_| {}).await
    }

    /// [`Run::start`] on `anvil` (`--no-mining`), the configuration customised.
    async fn start_on(
        anvil: AnvilNode,
        signers: usize,
        required: u32,
        customize: impl FnOnce(&mut Config),
    ) -> Run {
        let mut p = Pipeline::prepare_on(anvil, signers, |c| {
            c.confirmations_required = required;
            customize(c);
        })
        .await;
        let config = p.config.clone();
        p.start_allocator(&config, "alloc-1").await;
        p.start_signer_gateway(&config).await;
        p.start_broadcaster(&config).await;
        p.start_receipt_checker(&config).await;
        let events = Events::new(&p.config);
        let mut run = Run {
            p,
            cm: None,
            events,
        };
        run.start_cm("confirm-1").await;
        run
    }

    async fn start_cm(&mut self, name: &str) {
        let deps = Deps::connect(&self.p.config, 1).await.expect("clients");
        let rt = txflow_confirmation_manager::runtime(
            &deps,
            NodeId::named(unique(name)),
            LeaseConfig::default(),
        )
        .await
        .expect("confirmation manager");
        let token = CancellationToken::new();
        let t = token.clone();
        let task = tokio::spawn(async move {
            rt.run(t).await.expect("the confirmation manager runs");
            drop(deps);
        });
        self.cm = Some((token, task));
    }

    async fn stop_cm(&mut self) {
        if let Some((token, task)) = self.cm.take() {
            token.cancel();
            tokio::time::timeout(LONG, task)
                .await
                .expect("the confirmation manager stops")
                .expect("the confirmation manager task");
        }
    }

    async fn finish(mut self) {
        self.stop_cm().await;
        let Run { p, events, .. } = self;
        drop(events);
        p.stop().await;
    }

    /// Mines `n` blocks.
    async fn mine(&self, n: u64) {
        let provider = self.p.provider();
        for _ in 0..n {
            provider.evm_mine(None).await.expect("evm_mine");
        }
    }

    async fn head(&self) -> u64 {
        self.p.provider().get_block_number().await.expect("head")
    }

    /// The canonical hash of block `n`, lowercase 0x-hex.
    async fn hash_at(&self, n: u64) -> String {
        let block = self
            .p
            .provider()
            .get_block_by_number(n.into())
            .await
            .expect("block")
            .expect("the block exists");
        format!("{:#x}", block.header.hash)
    }

    /// Replaces the last `depth` blocks with as many new ones, the first holding a transfer of
    /// an outsider's (so that the new blocks differ from the old ones); transactions of the old
    /// blocks are dropped (anvil does not put them back in its pool).
    async fn reorg(&self, depth: u64) {
        let outsider = TransactionRequest::default()
            .with_from(OUTSIDER.parse::<Address>().expect("address"))
            .with_to(
                txflow_tests::pipeline::SINK
                    .parse::<Address>()
                    .expect("sink"),
            )
            .with_value(U256::from(depth))
            .with_gas_limit(21_000);
        self.p
            .provider()
            .anvil_reorg(ReorgOptions {
                depth,
                tx_block_pairs: vec![(TransactionData::JSON(outsider), 0)],
            })
            .await
            .expect("anvil_reorg");
    }

    async fn count(&self, sql: &str) -> i64 {
        self.p.count(sql).await
    }

    async fn wait_count(&self, what: &str, sql: &str, n: i64) {
        wait_until(what, LONG, || async { self.count(sql).await == n }).await;
    }

    /// Sends `requests` requests per signer, and waits until all are submitted to the node's pool.
    async fn submit(&self, prefix: &str, requests: usize) -> Vec<String> {
        let mut ids = Vec::new();
        for s in 0..self.p.signers.len() {
            for i in 0..requests {
                let id = format!("{prefix}-{s}-{i}");
                self.p.send(&self.p.request(s, &id)).await;
                ids.push(id);
            }
        }
        let n = ids.len() as i64;
        self.wait_count(
            "every request submitted",
            &format!(
                "SELECT count(*) FROM managed_tx WHERE state = 'SUBMITTED' AND request_id LIKE '{prefix}-%'"
            ),
            n,
        )
        .await;
        ids
    }

    /// Waits until every transaction of `prefix` is MINED or CONFIRMED with a list of `len`
    /// blocks announced.
    async fn wait_lists(&self, prefix: &str, n: i64, len: i64) {
        self.wait_count(
            &format!("{n} transactions announced with {len} confirmations"),
            &format!(
                "SELECT count(*) FROM managed_tx WHERE request_id LIKE '{prefix}-%'
                 AND state IN ('MINED', 'CONFIRMED') AND jsonb_array_length(confirmations) = {len}"
            ),
            n,
        )
        .await;
    }

    async fn tx_id(&self, request_id: &str) -> uuid::Uuid {
        sqlx::query_scalar("SELECT tx_id FROM managed_tx WHERE request_id = $1")
            .bind(request_id)
            .fetch_one(&self.p.db.pool)
            .await
            .expect("tx id")
    }

    async fn state(&self, request_id: &str) -> String {
        sqlx::query_scalar("SELECT state FROM managed_tx WHERE request_id = $1")
            .bind(request_id)
            .fetch_one(&self.p.db.pool)
            .await
            .expect("state")
    }

    /// Submits one request (`{prefix}-0-0`, of the only signer), mines the two blocks a run of
    /// [`Run::start`]`(1, 2)` requires and waits until it is CONFIRMED; its `tx_id`.
    async fn confirm_one(&self, prefix: &str) -> uuid::Uuid {
        self.submit(prefix, 1).await;
        let tx = self.tx_id(&format!("{prefix}-0-0")).await;
        self.mine(2).await;
        self.wait_count(
            "confirmed",
            "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'",
            1,
        )
        .await;
        tx
    }

    /// Waits until txflow has sent the defensive cancellation of the only signer's `nonce` (the
    /// signer gateway signed and recorded it, the broadcaster sent it), checks it in the node's
    /// pool — a 0-value transfer from the signer to itself at that nonce, no calldata, with a
    /// priority fee of at least twice the original's and 1 gwei, within `fees.max_fee_per_gas` —
    /// and returns its hash.
    async fn cancellation_sent(&self, tx: uuid::Uuid, nonce: i64) -> B256 {
        self.wait_count(
            "the defensive cancellation signed and sent",
            &format!(
                "SELECT count(*) FROM tx_cancellations WHERE nonce = {nonce} AND tx_id = '{tx}'
                 AND sends >= 1 AND submitted_at IS NOT NULL"
            ),
            1,
        )
        .await;
        let hash: String =
            sqlx::query_scalar("SELECT tx_hash FROM tx_cancellations WHERE nonce = $1")
                .bind(nonce)
                .fetch_one(&self.p.db.pool)
                .await
                .expect("the cancellation's hash");
        let hash: B256 = hash.parse().expect("a hash");
        let original_tip: String = sqlx::query_scalar(
            "SELECT max_priority_fee_per_gas::text FROM tx_attempts WHERE tx_id = $1 AND attempt = 1",
        )
        .bind(tx)
        .fetch_one(&self.p.db.pool)
        .await
        .expect("the original's tip");
        let original_tip: u128 = original_tip.parse().expect("wei");
        let pending = self
            .p
            .provider()
            .get_transaction_by_hash(hash)
            .await
            .expect("eth_getTransactionByHash")
            .expect("the node holds the cancellation");
        let signer = self.p.signers[0].address();
        assert_eq!(pending.inner.signer(), signer, "sent by the signer");
        assert_eq!(pending.nonce(), u64::try_from(nonce).expect("nonce"));
        assert_eq!(pending.to(), Some(signer), "to the signer itself");
        assert_eq!(pending.value(), U256::ZERO);
        assert!(pending.input().is_empty());
        assert_eq!(pending.gas_limit(), 21_000);
        let tip = pending
            .max_priority_fee_per_gas()
            .expect("an EIP-1559 transaction");
        assert!(
            tip >= 2 * original_tip && tip >= 1_000_000_000,
            "a high tip: {tip} wei, the original's {original_tip}"
        );
        assert!(pending.max_fee_per_gas() <= self.p.config.max_fee_per_gas_wei);
        hash
    }
}

/// What is on `tx.confirmations` and `tx.outcomes`, read from the beginning.
struct Events {
    consumer: StreamConsumer,
    codec: RegistryCodec,
    confirmations: String,
    outcomes: String,
    seen: Vec<Seen>,
}

#[derive(Debug, Clone)]
enum Decoded {
    List(TxConfirmationsUpdated),
    Confirmed(TxConfirmed),
    Reverted(TxConfirmationReverted),
    Accepted(TxAccepted),
    Submitted(TxSubmitted),
    Receipt(TxReceiptUpdated),
    Other,
}

#[derive(Debug, Clone)]
struct Seen {
    key: String,
    partition: i32,
    event_id: String,
    event: Decoded,
}

impl Events {
    fn new(config: &Config) -> Events {
        let consumer = group_consumer(&config.kafka, &unique("confirmations-read"));
        let confirmations = config.topics.tx_confirmations();
        let outcomes = config.topics.tx_outcomes();
        let mut list = TopicPartitionList::new();
        for t in [&confirmations, &outcomes] {
            for p in 0..config.partitions {
                list.add_partition_offset(t, p, Offset::Beginning)
                    .expect("partition");
            }
        }
        consumer.assign(&list).expect("assign");
        Events {
            consumer,
            codec: RegistryCodec::new(registry_url()),
            confirmations,
            outcomes,
            seen: Vec::new(),
        }
    }

    async fn decode(&self, m: &OwnedMessage) -> Decoded {
        let Some(bytes) = m.payload() else {
            return Decoded::Other;
        };
        if m.topic() == self.confirmations {
            return Decoded::List(self.codec.decode(bytes).await.expect("a confirmation list"));
        }
        if m.topic() == self.outcomes {
            if let Ok(c) = self.codec.decode::<TxConfirmed>(bytes).await {
                return Decoded::Confirmed(c);
            }
            if let Ok(r) = self.codec.decode::<TxConfirmationReverted>(bytes).await {
                return Decoded::Reverted(r);
            }
            if let Ok(a) = self.codec.decode::<TxAccepted>(bytes).await {
                return Decoded::Accepted(a);
            }
            if let Ok(s) = self.codec.decode::<TxSubmitted>(bytes).await {
                return Decoded::Submitted(s);
            }
            if let Ok(r) = self.codec.decode::<TxReceiptUpdated>(bytes).await {
                return Decoded::Receipt(r);
            }
        }
        Decoded::Other
    }

    /// Reads until `done` holds for what was seen, or panics after [`LONG`].
    async fn until(&mut self, what: &str, done: impl Fn(&[Seen]) -> bool) {
        let deadline = tokio::time::Instant::now() + LONG;
        while !done(&self.seen) {
            match tokio::time::timeout_at(deadline, self.consumer.recv()).await {
                Ok(Ok(m)) => {
                    let m = m.detach();
                    let event = self.decode(&m).await;
                    let event_id = m
                        .headers()
                        .and_then(|h| {
                            h.iter()
                                .find(|x| x.key == "event_id")
                                .and_then(|x| x.value)
                                .map(|v| String::from_utf8_lossy(v).into_owned())
                        })
                        .expect("every output carries an event_id header");
                    self.seen.push(Seen {
                        key: m
                            .key()
                            .map(|k| String::from_utf8_lossy(k).into_owned())
                            .unwrap_or_default(),
                        partition: m.partition(),
                        event_id,
                        event,
                    });
                }
                Ok(Err(e)) => panic!("reading while waiting until {what}: {e}"),
                Err(_) => panic!(
                    "timed out after {LONG:?} waiting until {what} ({} events seen)",
                    self.seen.len()
                ),
            }
        }
    }
}

fn confirmed(seen: &[Seen]) -> Vec<(&Seen, &TxConfirmed)> {
    seen.iter()
        .filter_map(|s| match &s.event {
            Decoded::Confirmed(c) => Some((s, c)),
            _ => None,
        })
        .collect()
}

/// A downstream ledger that reads `tx.outcomes` only and follows, word for word, the booking
/// rules of docs/events.md ("Downstream: `tx.outcomes`", "Booking from `tx.outcomes`"):
/// 1. skip an event whose `event_id` was seen;
/// 2. `TxConfirmed` of generation g: skip it if a reversal of g was seen; otherwise, if a lower
///    generation is still booked, reverse it first; then book g;
/// 3. `TxConfirmationReverted` of generation g: if g is booked, reverse it; remember g as
///    reverted either way.
#[derive(Debug, Default)]
struct Ledger {
    seen: BTreeSet<String>,
    /// Per transaction: the booked generation and what it said (success).
    booked: BTreeMap<String, (i32, bool)>,
    reverted: BTreeSet<(String, i32)>,
    /// What was done, in order: (tx_id, "book" | "reverse", generation).
    journal: Vec<(String, &'static str, i32)>,
}

impl Ledger {
    fn apply(&mut self, s: &Seen) {
        if !self.seen.insert(s.event_id.clone()) {
            return;
        }
        match &s.event {
            Decoded::Confirmed(c) => {
                let g = c.reorg_generation;
                if self.reverted.contains(&(c.tx_id.clone(), g)) {
                    return;
                }
                if let Some((lower, _)) = self.booked.get(&c.tx_id).copied()
                    && lower < g
                {
                    self.journal.push((c.tx_id.clone(), "reverse", lower));
                    self.reverted.insert((c.tx_id.clone(), lower));
                }
                self.booked.insert(c.tx_id.clone(), (g, c.success));
                self.journal.push((c.tx_id.clone(), "book", g));
            }
            Decoded::Reverted(r) => {
                let g = r.reorg_generation;
                if self.booked.get(&r.tx_id).is_some_and(|(b, _)| *b == g) {
                    self.booked.remove(&r.tx_id);
                    self.journal.push((r.tx_id.clone(), "reverse", g));
                }
                self.reverted.insert((r.tx_id.clone(), g));
            }
            _ => {}
        }
    }

    /// Applies every event of `tx.outcomes` in `seen`, in the order read.
    fn read(&mut self, seen: &[Seen]) {
        for s in seen {
            self.apply(s);
        }
    }
}

fn reversals(seen: &[Seen]) -> Vec<(&Seen, &TxConfirmationReverted)> {
    seen.iter()
        .filter_map(|s| match &s.event {
            Decoded::Reverted(r) => Some((s, r)),
            _ => None,
        })
        .collect()
}

fn lists_of<'a>(seen: &'a [Seen], tx_id: &str) -> Vec<&'a TxConfirmationsUpdated> {
    seen.iter()
        .filter_map(|s| match &s.event {
            Decoded::List(l) if l.tx_id == tx_id => Some(l),
            _ => None,
        })
        .collect()
}

/// Distinct TxConfirmed event ids per transaction.
fn confirmed_ids(seen: &[Seen]) -> BTreeMap<String, BTreeSet<String>> {
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (s, c) in confirmed(seen) {
        assert_eq!(s.event_id, c.event_id, "the header names the event");
        ids.entry(c.tx_id.clone())
            .or_default()
            .insert(c.event_id.clone());
    }
    ids
}

// ---------------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tx_confirmed_comes_after_exactly_the_required_blocks_once_per_transaction_in_nonce_order()
{
    let mut run = Run::start(2, 3).await;
    let ids = run.submit("c", 3).await;
    let n = ids.len() as i64;
    let block = run.head().await + 1;
    run.mine(1).await;
    run.wait_lists("c", n, 1).await;
    run.mine(1).await;
    run.wait_lists("c", n, 2).await;
    assert_eq!(
        run.count("SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'")
            .await,
        0,
        "two blocks of three: nothing final"
    );
    assert_eq!(
        run.count("SELECT count(*) FROM tx_events WHERE type = 'TxConfirmed'")
            .await,
        0
    );
    run.mine(1).await;
    run.wait_count(
        "every transaction confirmed at the third block",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'
         AND jsonb_array_length(confirmations) = 3 AND confirmed_at IS NOT NULL",
        n,
    )
    .await;

    // Past the watch of a final transaction (64 blocks): no longer followed, nothing announced.
    run.p
        .provider()
        .anvil_mine(Some(70), None)
        .await
        .expect("anvil_mine");
    run.wait_count(
        "every final transaction past its watch",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED' AND watch_until_block IS NULL",
        n,
    )
    .await;
    assert_eq!(
        run.count("SELECT count(*) FROM tx_events WHERE type = 'TxConfirmationsUpdated'")
            .await,
        3 * n,
        "one list per block, up to the depth"
    );
    assert_eq!(
        run.count("SELECT count(*) FROM tx_events WHERE type = 'TxConfirmed'")
            .await,
        n
    );

    run.events
        .until("every TxConfirmed and every list of three", |seen| {
            let done = confirmed_ids(seen);
            done.len() as i64 == n
                && done.keys().all(|tx| {
                    lists_of(seen, tx)
                        .iter()
                        .any(|l| l.confirmations.len() == 3)
                })
        })
        .await;
    let seen = run.events.seen.clone();
    for (tx, ids) in confirmed_ids(&seen) {
        assert_eq!(ids.len(), 1, "{tx}: one event_id");
    }
    for (_, c) in confirmed(&seen) {
        assert_eq!(c.block_number as u64, block, "{c:?}");
        assert_eq!(c.block_hash, run.hash_at(block).await);
        assert_eq!((c.confirmations, c.success), (3, true));
        // Lists of 1, 2 and 3 blocks, each extending the one before.
        let lists = lists_of(&seen, &c.tx_id);
        let lens: Vec<usize> = lists.iter().map(|l| l.confirmations.len()).collect();
        assert_eq!(lens, vec![1, 2, 3], "{}", c.tx_id);
        assert!(lists.iter().all(|l| !l.new_fork));
        for w in lists.windows(2) {
            assert!(w[1].confirmations.starts_with(&w[0].confirmations));
        }
        assert_eq!(lists[2].confirmations[0].hash, c.block_hash);
    }
    // Per signer (one key, one partition) on tx.outcomes, in order: each transaction's
    // TxAccepted, TxSubmitted, TxReceiptUpdated and TxConfirmed, one of each, and the TxConfirmed
    // in nonce order.
    let mut keys: BTreeMap<&str, Vec<&Seen>> = BTreeMap::new();
    for s in &seen {
        if !matches!(s.event, Decoded::List(_) | Decoded::Other) {
            keys.entry(s.key.as_str()).or_default().push(s);
        }
    }
    assert_eq!(keys.len(), 2);
    for (key, events) in keys {
        assert!(events.iter().all(|s| s.partition == events[0].partition));
        let nonces: Vec<i64> = events
            .iter()
            .filter_map(|s| match &s.event {
                Decoded::Confirmed(c) => Some(c.nonce),
                _ => None,
            })
            .collect();
        assert_eq!(nonces, vec![0, 1, 2], "{key}: TxConfirmed in nonce order");
        let mut stories: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for s in &events {
            let (tx, kind) = match &s.event {
                Decoded::Accepted(a) => (a.tx_id.as_str(), "TxAccepted"),
                Decoded::Submitted(e) => (e.tx_id.as_str(), "TxSubmitted"),
                Decoded::Receipt(r) => (r.tx_id.as_str(), "TxReceiptUpdated"),
                Decoded::Confirmed(c) => (c.tx_id.as_str(), "TxConfirmed"),
                Decoded::Reverted(r) => (r.tx_id.as_str(), "TxConfirmationReverted"),
                Decoded::List(_) | Decoded::Other => continue,
            };
            stories.entry(tx).or_default().push(kind);
        }
        assert_eq!(stories.len(), 3, "{key}: three transactions");
        for (tx, story) in stories {
            assert_eq!(
                story,
                [
                    "TxAccepted",
                    "TxSubmitted",
                    "TxReceiptUpdated",
                    "TxConfirmed"
                ],
                "{key}: {tx} on tx.outcomes"
            );
        }
    }
    assert!(
        run.p
            .announced_events_missing_from_topics(LONG)
            .await
            .is_empty()
    );
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reorg_shallower_than_the_depth_announces_a_new_fork_and_a_dropped_transaction_is_sent_again_and_confirmed_once()
 {
    let mut run = Run::start(1, 4).await;
    run.submit("s", 1).await;
    let tx_id = run.tx_id("s-0-0").await.to_string();
    let block = run.head().await + 1;
    run.mine(3).await;
    run.wait_lists("s", 1, 3).await;

    // A reorg of the last block: the transaction's block stays, the list's last block changes.
    run.reorg(1).await;
    let expected = [
        run.hash_at(block).await,
        run.hash_at(block + 1).await,
        run.hash_at(block + 2).await,
    ];
    run.events
        .until("a new fork with the complete list", |seen| {
            lists_of(seen, &tx_id)
                .iter()
                .any(|l| l.new_fork && l.confirmations.iter().map(|b| &b.hash).eq(expected.iter()))
        })
        .await;
    assert_eq!(run.state("s-0-0").await, "MINED");

    // A reorg of its block: back to SUBMITTED, announced empty, sent again.
    run.reorg(3).await;
    run.events
        .until("the transaction's block announced gone", |seen| {
            lists_of(seen, &tx_id)
                .iter()
                .any(|l| l.new_fork && l.confirmations.is_empty())
        })
        .await;
    let reorgs = run
        .count("SELECT count(*) FROM tx_events WHERE type = 'TxReorged'")
        .await;
    assert_eq!(reorgs, 1);
    wait_until(
        "the dropped transaction is in anvil's pool again",
        LONG,
        || async { run.p.pool_status().await.0 != "0x0" },
    )
    .await;
    let again = run.head().await + 1;
    run.mine(1).await;
    run.wait_count(
        "mined again in the next block",
        &format!(
            "SELECT count(*) FROM managed_tx WHERE request_id = 's-0-0' AND state = 'MINED'
             AND mined_block_number = {again}"
        ),
        1,
    )
    .await;
    run.mine(3).await;
    run.wait_count(
        "confirmed",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'",
        1,
    )
    .await;
    run.events
        .until("its TxConfirmed", |seen| !confirmed(seen).is_empty())
        .await;
    let seen = run.events.seen.clone();
    let ids = confirmed_ids(&seen);
    assert_eq!(
        ids.get(&tx_id).map(BTreeSet::len),
        Some(1),
        "confirmed once"
    );
    let (_, c) = confirmed(&seen)[0];
    assert_eq!(c.block_number as u64, again);
    assert_eq!(c.block_hash, run.hash_at(again).await);
    let markers = run.p.mined_markers().await;
    assert_eq!(markers.get("txflow:s-0-0"), Some(&1), "{markers:?}");
    run.finish().await;
}

/// The events the critical alerts carry (`target: txflow::alert`, ERROR) and the defensive
/// cancellation's (`target: txflow::reorg`), as this process logged them.
#[derive(Clone, Default)]
struct Alerts(Arc<Mutex<Vec<String>>>);

impl Alerts {
    fn install() -> Alerts {
        use tracing_subscriber::layer::SubscriberExt;
        let alerts = Alerts::default();
        let subscriber = tracing_subscriber::registry().with(alerts.clone());
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        alerts
    }

    fn raised(&self, event: &str) -> bool {
        self.0
            .lock()
            .map(|a| a.iter().any(|e| e == event))
            .unwrap_or(false)
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Alerts {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Name(Option<String>);
        impl tracing::field::Visit for Name {
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                if f.name() == "event" {
                    self.0 = Some(v.to_string());
                }
            }
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "event" && self.0.is_none() {
                    self.0 = Some(format!("{v:?}").trim_matches('"').to_string());
                }
            }
        }
        let target = event.metadata().target();
        if (target == "txflow::alert" && *event.metadata().level() == tracing::Level::ERROR)
            || target == "txflow::reorg"
        {
            let mut name = Name(None);
            event.record(&mut name);
            if let (Some(n), Ok(mut a)) = (name.0, self.0.lock()) {
                a.push(n);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reorg_deeper_than_the_depth_raises_the_alert_announces_a_new_fork_and_re_evaluates_once_the_nonce_is_cancelled()
 {
    a_deep_reorg_undone_by_the_cancellation(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_approval_after_deep_reorg_a_request_undone_by_a_deep_reorg_is_simulated_again_and_waits_for_an_approval()
 {
    a_deep_reorg_undone_by_the_cancellation(true).await;
}

/// A confirmed request, a reorg deeper than the depth, txflow's defensive cancellation mined and
/// buried at the depth: the request is undone, simulated and checked against the policy again
/// (seed 000 §4.4), then sent at a fresh nonce — after an operator's approval when `approve`
/// (`approval.after_deep_reorg`) — and confirmed again under a new `event_id`.
async fn a_deep_reorg_undone_by_the_cancellation(approve: bool) {
    let alerts = Alerts::install();
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut run = Run::start_on(anvil, 1, 2, |c| c.approval_after_deep_reorg = approve).await;
    run.submit("d", 1).await;
    let tx = run.tx_id("d-0-0").await;
    let tx_id = tx.to_string();
    run.mine(2).await;
    run.wait_count(
        "confirmed",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'",
        1,
    )
    .await;
    let first = txflow_confirmation_manager::decide::confirmed_event_id(tx, 0).to_string();

    // Three blocks replaced: its block (two below the head) is gone after TxConfirmed.
    run.mine(1).await;
    run.reorg(3).await;
    run.wait_count(
        "undone by a deep reorg: re-evaluated, generation 1",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED' AND reorged_at IS NOT NULL
         AND reorg_generation = 1 AND receipt IS NULL",
        1,
    )
    .await;
    assert!(
        alerts.raised(txflow_confirmation_manager::DEEP_REORG_ALERT),
        "the critical alert"
    );
    run.events
        .until("the new fork announced", |seen| {
            lists_of(seen, &tx_id)
                .iter()
                .any(|l| l.new_fork && l.confirmations.is_empty())
        })
        .await;
    // txflow's defensive cancellation of its nonce (a 0-value self-transfer with a high tip):
    // signed by the signer gateway, sent by the broadcaster. It is all the node's pool holds:
    // nothing sends the original again.
    let cancel = run.cancellation_sent(tx, 0).await;
    assert_eq!(run.p.pool_status().await, ("0x1".into(), "0x0".into()));
    for event in [
        txflow_signer_gateway::handler::CANCELLATION_SIGNED,
        txflow_broadcaster::handler::CANCELLATION_SENT,
    ] {
        assert!(alerts.raised(event), "{event} logged");
    }
    // Still CONFIRMED while the nonce is not settled: never rolled back before.
    assert_eq!(run.state("d-0-0").await, "CONFIRMED");

    // The cancellation mined and buried at the depth.
    run.mine(2).await;
    if approve {
        // Undone, simulated again, and waiting for an operator: no nonce, nothing sent.
        run.wait_count(
            "simulated again and waiting for an approval",
            "SELECT count(*) FROM managed_tx WHERE state = 'PENDING_APPROVAL'
             AND reorged_at IS NULL AND confirmed_at IS NULL",
            1,
        )
        .await;
        let reason: String = sqlx::query_scalar(
            "SELECT payload->>'reason' FROM tx_events WHERE tx_id = $1 AND type = 'TxPendingApproval'",
        )
        .bind(tx)
        .fetch_one(&run.p.db.pool)
        .await
        .expect("the audit row of the wait");
        assert_eq!(
            reason,
            txflow_allocator::handler::DEEP_REORG_APPROVAL_REASON
        );
        assert_eq!(run.p.pool_status().await, ("0x0".into(), "0x0".into()));
        run.p.command(&tx_id, TxCommandKind::Approve).await;
    }
    // Undone: RECEIVED, simulated and checked against the policy again, then re-allocated a
    // fresh nonce and submitted.
    run.wait_count(
        "re-evaluated and submitted at a fresh nonce",
        "SELECT count(*) FROM managed_tx WHERE state = 'SUBMITTED' AND nonce = 1
         AND reorged_at IS NULL AND confirmed_at IS NULL",
        1,
    )
    .await;
    assert_eq!(
        run.count(&format!(
            "SELECT count(*) FROM tx_events WHERE type = 'TxReorgUndone'
             AND payload->>'consumed_by' = 'defensive cancellation'
             AND payload->>'cancellation_hash' = '{cancel:#x}'"
        ))
        .await,
        1,
        "undone, on the proof that the cancellation consumed the nonce"
    );
    assert_eq!(
        run.count(&format!(
            "SELECT count(*) FROM tx_events u, tx_events s
             WHERE u.tx_id = '{tx}' AND s.tx_id = u.tx_id AND u.type = 'TxReorgUndone'
               AND s.type IN ('TxSimulated', 'TxPendingApproval') AND s.created_at > u.created_at
               AND (s.payload->>'reevaluated_after_deep_reorg')::boolean"
        ))
        .await,
        1,
        "simulated again after it was undone, before its new nonce"
    );
    run.mine(2).await;
    run.wait_count(
        "confirmed again",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED' AND reorged_at IS NULL",
        1,
    )
    .await;
    let second = txflow_confirmation_manager::decide::confirmed_event_id(tx, 1).to_string();
    run.events
        .until(
            "both TxConfirmed, and the list of two blocks at nonce 1",
            |seen| {
                confirmed_ids(seen).get(&tx_id).map(BTreeSet::len) == Some(2)
                    && lists_of(seen, &tx_id)
                        .iter()
                        .any(|l| l.nonce == 1 && l.confirmations.len() == 2)
            },
        )
        .await;
    let seen = run.events.seen.clone();
    assert_eq!(
        confirmed_ids(&seen).get(&tx_id),
        Some(&BTreeSet::from([first.clone(), second.clone()]))
    );
    // The first TxConfirmed before the second (one key, one partition); between them, on
    // tx.confirmations, the new fork that voided the first.
    let at = |id: &str| seen.iter().position(|s| s.event_id == id).expect("seen");
    assert!(at(&first) < at(&second));
    let lists = lists_of(&seen, &tx_id);
    let fork = lists
        .iter()
        .position(|l| l.new_fork && l.confirmations.is_empty())
        .expect("the new fork");
    assert!(
        lists[fork + 1..]
            .iter()
            .any(|l| l.confirmations.len() == 2 && !l.new_fork),
        "then the list of the transaction mined again: {lists:?}"
    );
    // On the chain: nonce 0 is txflow's cancellation (a 0-value self-transfer), the request's
    // transfer is mined once, at nonce 1; the cancellation was not sent again once mined.
    let mined = run.p.mined().await;
    assert_eq!(mined.len(), 2, "{mined:?}");
    let signer = format!("{:#x}", run.p.signers[0].address());
    assert_eq!(
        (mined[0].nonce, mined[0].value, mined[0].to.as_str()),
        (0, U256::ZERO, signer.as_str())
    );
    assert!(mined[0].input.is_empty());
    let receipt = run
        .p
        .provider()
        .get_transaction_receipt(cancel)
        .await
        .expect("eth_getTransactionReceipt")
        .expect("the cancellation is mined");
    assert!(receipt.status());
    assert_eq!(mined[1].nonce, 1);
    assert_eq!(mined[1].marker(), "txflow:d-0-0");
    assert_eq!(run.p.pool_status().await, ("0x0".into(), "0x0".into()));
    downstream_books_it_once(&seen, &tx_id, &first, &second, 1);
    run.finish().await;
}

/// What a downstream consumer of `tx.outcomes` ([`Ledger`]) makes of a transaction confirmed,
/// reverted by a deep reorg and confirmed again: the reversal of generation 0 on the topic
/// before the TxConfirmed of generation 1, which names it; booked, reversed, booked again, and
/// in the end booked once, at generation 1 (nonce `nonce`); reading everything again (a replay)
/// changes nothing.
fn downstream_books_it_once(seen: &[Seen], tx_id: &str, first: &str, second: &str, nonce: i64) {
    let reversal =
        txflow_confirmation_manager::decide::reversal_event_id(tx_id.parse().expect("a tx id"), 0)
            .to_string();
    let found = reversals(seen);
    let (rs, r) = found
        .iter()
        .find(|(s, _)| s.event_id == reversal)
        .expect("a TxConfirmationReverted of generation 0 on tx.outcomes");
    assert_eq!(
        (
            r.tx_id.as_str(),
            r.reorg_generation,
            r.reverted_event_id.as_str()
        ),
        (tx_id, 0, first),
        "it names the TxConfirmed it reverts"
    );
    assert!(r.success);
    let at = |id: &str| seen.iter().position(|s| s.event_id == id).expect("seen");
    let (_, c1) = confirmed(seen)
        .into_iter()
        .find(|(s, _)| s.event_id == second)
        .expect("the TxConfirmed of generation 1");
    assert_eq!((c1.reorg_generation, c1.nonce), (1, nonce));
    let (rs_partition, rs_key) = (rs.partition, rs.key.clone());
    let c1s = seen.iter().find(|s| s.event_id == second).expect("seen");
    assert_eq!(
        (c1s.partition, &c1s.key),
        (rs_partition, &rs_key),
        "one key"
    );
    assert!(
        at(first) < at(&reversal) && at(&reversal) < at(second),
        "TxConfirmed 0, its reversal, then TxConfirmed 1"
    );
    let outcomes: Vec<Seen> = seen
        .iter()
        .filter(|s| matches!(s.event, Decoded::Confirmed(_) | Decoded::Reverted(_)))
        .cloned()
        .collect();
    let mut ledger = Ledger::default();
    ledger.read(&outcomes);
    let of_tx: Vec<(&'static str, i32)> = ledger
        .journal
        .iter()
        .filter(|(t, ..)| t == tx_id)
        .map(|(_, a, g)| (*a, *g))
        .collect();
    assert_eq!(of_tx, [("book", 0), ("reverse", 0), ("book", 1)]);
    assert_eq!(ledger.booked.get(tx_id), Some(&(1, true)), "booked once");
    // A replay of the topic (every event again, same event_ids) changes nothing.
    let journal = ledger.journal.len();
    ledger.read(&outcomes);
    assert_eq!(ledger.journal.len(), journal);
    // Read in another order (a relayed reversal late): the same end.
    let mut late = Ledger::default();
    let mut shuffled = outcomes.clone();
    if let Some(i) = shuffled.iter().position(|s| s.event_id == reversal) {
        let r = shuffled.remove(i);
        shuffled.push(r);
    }
    late.read(&shuffled);
    assert_eq!(late.booked.get(tx_id), Some(&(1, true)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_of_the_receipts_changes_nothing_and_re_emits_the_same_event_ids() {
    let mut run = Run::start(2, 2).await;
    let ids = run.submit("r", 2).await;
    let n = ids.len() as i64;
    run.mine(2).await;
    run.wait_count(
        "every transaction confirmed",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'",
        n,
    )
    .await;
    run.events
        .until("every TxConfirmed", |seen| {
            confirmed_ids(seen).len() as i64 == n
        })
        .await;
    let before_ids = confirmed_ids(&run.events.seen);
    run.stop_cm().await;

    let snapshot = |pool: sqlx::PgPool| async move {
        type Row = (
            uuid::Uuid,
            String,
            Option<i64>,
            Option<i64>,
            Option<serde_json::Value>,
        );
        let txs: Vec<Row> =
            sqlx::query_as(
                "SELECT tx_id, state, nonce, fencing_token, confirmations FROM managed_tx ORDER BY tx_id",
            )
            .fetch_all(&pool)
            .await
            .expect("managed_tx");
        let events: Vec<(uuid::Uuid, String)> =
            sqlx::query_as("SELECT event_id, type FROM tx_events ORDER BY event_id")
                .fetch_all(&pool)
                .await
                .expect("tx_events");
        format!("{txs:?}\n{events:?}")
    };
    let before = snapshot(run.p.db.pool.clone()).await;
    let onchain = run.p.mined_count().await;

    // The group back to the beginning of tx.receipts, then the confirmation manager again.
    let group = format!("{}.confirmation-manager", run.p.config.group_prefix());
    let consumer = group_consumer(&run.p.config.kafka, &group);
    let mut offsets = TopicPartitionList::new();
    for p in 0..run.p.config.partitions {
        offsets
            .add_partition_offset(&run.p.config.topics.tx_receipts(), p, Offset::Offset(0))
            .expect("partition");
    }
    consumer
        .commit(&offsets, CommitMode::Sync)
        .expect("reset the group's offsets");
    drop(consumer);
    let seen_before = run.events.seen.len();
    run.start_cm("confirm-2").await;

    // Every TxConfirmed again, with the same event_id.
    run.events
        .until("every TxConfirmed re-emitted", |seen| {
            let again: BTreeSet<&str> = confirmed(&seen[seen_before..])
                .into_iter()
                .map(|(_, c)| c.tx_id.as_str())
                .collect();
            again.len() as i64 == n
        })
        .await;
    assert_eq!(
        confirmed_ids(&run.events.seen),
        before_ids,
        "the same event_ids"
    );
    assert_eq!(
        snapshot(run.p.db.pool.clone()).await,
        before,
        "nothing changed"
    );
    assert_eq!(run.p.mined_count().await, onchain, "nothing sent");
    assert_eq!(run.p.pool_status().await.0, "0x0");
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_undone_by_a_deep_reorg_and_mined_again_is_confirmed_again_at_its_nonce() {
    let mut run = Run::start(1, 2).await;
    let tx = run.confirm_one("m").await;
    let tx_id = tx.to_string();
    run.reorg(2).await;
    run.wait_count(
        "undone by a deep reorg",
        "SELECT count(*) FROM managed_tx WHERE reorged_at IS NOT NULL AND receipt IS NULL",
        1,
    )
    .await;

    // txflow sends its defensive cancellation of the nonce...
    let cancel = run.cancellation_sent(tx, 0).await;
    // ...but another node still had the original in its pool, and a block of another producer
    // includes it first: the head block is replaced by one holding it (on anvil, whose pool now
    // holds the cancellation, that is a reorg of depth 1 with the original's signed bytes).
    // Whichever of the two is mined settles the nonce: here the original.
    let raw: Vec<u8> =
        sqlx::query_scalar("SELECT raw_tx FROM tx_attempts WHERE tx_id = $1 AND attempt = 1")
            .bind(tx)
            .fetch_one(&run.p.db.pool)
            .await
            .expect("the signed bytes");
    let again = run.head().await;
    run.p
        .provider()
        .anvil_reorg(ReorgOptions {
            depth: 1,
            tx_block_pairs: vec![(TransactionData::Raw(raw.into()), 0)],
        })
        .await
        .expect("anvil_reorg");
    run.wait_count(
        "followed again from the block it is mined in now",
        &format!(
            "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED' AND reorged_at IS NOT NULL
             AND mined_block_number = {again} AND (receipt->>'attempt')::int = 1"
        ),
        1,
    )
    .await;
    run.mine(1).await;
    run.wait_count(
        "final again",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED' AND reorged_at IS NULL
         AND reorg_generation = 1 AND watch_until_block IS NOT NULL",
        1,
    )
    .await;
    run.events
        .until("the second TxConfirmed", |seen| {
            confirmed_ids(seen).get(&tx_id).map(BTreeSet::len) == Some(2)
        })
        .await;
    let seen = run.events.seen.clone();
    let second = txflow_confirmation_manager::decide::confirmed_event_id(tx, 1).to_string();
    let (_, c) = confirmed(&seen)
        .into_iter()
        .find(|(s, _)| s.event_id == second)
        .expect("the TxConfirmed of generation 1");
    assert_eq!((c.block_number as u64, c.nonce), (again, 0));
    // On the chain: the original alone, once; the cancellation never mined (its nonce is used:
    // the node dropped it) and not sent again.
    let mined = run.p.mined().await;
    assert_eq!(mined.len(), 1, "{mined:?}");
    assert_eq!(mined[0].marker(), "txflow:m-0-0");
    assert!(
        run.p
            .provider()
            .get_transaction_receipt(cancel)
            .await
            .expect("eth_getTransactionReceipt")
            .is_none(),
        "the cancellation is not mined"
    );
    assert_eq!(run.p.pool_status().await, ("0x0".into(), "0x0".into()));
    assert_eq!(
        run.count("SELECT count(*) FROM tx_events WHERE type = 'TxReorgUndone'")
            .await,
        0
    );
    let first = txflow_confirmation_manager::decide::confirmed_event_id(tx, 0).to_string();
    downstream_books_it_once(&seen, &tx_id, &first, &second, 0);
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reverted_transaction_is_settled_at_the_depth_with_success_false_and_keeps_its_state() {
    use alloy::signers::local::PrivateKeySigner;
    use txflow_core::chain::ChainClient as _;
    use txflow_core::domain::{ChainId, Signer};
    use txflow_core::lease::{Acquisition, LeaseManager};
    use txflow_core::role::Role;
    use txflow_core::stage::{DriveCtx, Handler as _};
    use txflow_tests::fake_chain::FakeChain;

    let db = txflow_tests::TestDb::new().await;
    let chain = Arc::new(FakeChain::new());
    let key = PrivateKeySigner::random();
    let signer = format!("{:#x}", key.address());
    let sink: Address = txflow_tests::pipeline::SINK.parse().expect("sink");
    chain.revert_calls_to(sink);
    let signed = sign(
        &key,
        &UnsignedTx {
            chain_id: 31337,
            nonce: 0,
            to: sink,
            value: U256::from(1),
            data: Bytes::new(),
            gas_limit: 21_000,
            max_fee_per_gas: 2_000_000_000,
            max_priority_fee_per_gas: 1_000_000_000,
        },
    )
    .expect("sign");
    chain.send_raw(&signed.raw).await.expect("pooled");
    chain.mine();
    let r = chain
        .receipt(signed.hash)
        .await
        .expect("receipt")
        .expect("mined");
    assert!(!r.status, "reverted");
    let tx = uuid::Uuid::now_v7();
    let block_hash = format!("{:#x}", r.block_hash);
    let tx_hash = format!("{:#x}", signed.hash);
    sqlx::query(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state,
                                 receipt, mined_block_number, mined_block_hash)
         VALUES ($1, 31337, $2, 'rev-0', 0, '{}'::jsonb, 'REVERTED', $3, $4, $5)",
    )
    .bind(tx)
    .bind(&signer)
    .bind(serde_json::json!({
        "attempt": 1, "tx_hash": tx_hash, "status": 0,
        "revert_reason": "Error(\"reverted by the fake chain\")",
    }))
    .bind(r.block_number as i64)
    .bind(&block_hash)
    .execute(&db.pool)
    .await
    .expect("record the revert");

    let stage = txflow_confirmation_manager::ConfirmStage::new(
        txflow_confirmation_manager::ConfirmationConfig {
            chain_id: ChainId(31337),
            topics: txflow_core::kafka::Topics::new(unique("rev")),
            required: 2,
            watch_blocks: 64,
            poll_interval: Duration::ZERO,
            resubmit_interval: Duration::from_secs(3600),
        },
        chain.clone(),
    );
    let leases = LeaseManager::new(
        db.pool.clone(),
        Role::ConfirmationManager,
        NodeId::named(unique("rev")),
        LeaseConfig::default(),
    )
    .expect("leases");
    let lease = match leases
        .acquire(ChainId(31337), &Signer::parse(&signer).expect("signer"))
        .await
        .expect("acquire")
    {
        Acquisition::Held(l, _) => l,
        busy => panic!("lease not acquired: {busy:?}"),
    };
    let drive = || {
        stage.drive(DriveCtx {
            lease: &lease,
            pool: &db.pool,
            recovery: true,
        })
    };
    let settled = || async {
        sqlx::query_as::<_, (String, bool)>(
            "SELECT state, confirmed_at IS NOT NULL FROM managed_tx WHERE tx_id = $1",
        )
        .bind(tx)
        .fetch_one(&db.pool)
        .await
        .expect("row")
    };

    let outs = drive().await.expect("drive");
    assert_eq!(outs.len(), 1, "one block: its list only");
    assert_eq!(settled().await, ("REVERTED".to_string(), false));
    chain.mine();
    let outs = drive().await.expect("drive");
    let confirmed_id = txflow_confirmation_manager::decide::confirmed_event_id(tx, 0).to_string();
    assert_eq!(outs.len(), 2, "its list of two blocks, and its outcome");
    assert_eq!(outs[1].event_id, confirmed_id);
    assert_eq!(settled().await, ("REVERTED".to_string(), true));
    let payload: serde_json::Value = sqlx::query_scalar(
        "SELECT payload FROM tx_events WHERE tx_id = $1 AND type = 'TxConfirmed'",
    )
    .bind(tx)
    .fetch_one(&db.pool)
    .await
    .expect("the recorded outcome");
    let c: TxConfirmed = serde_json::from_value(payload).expect("a TxConfirmed");
    assert_eq!(
        (c.success, c.block_hash.as_str(), c.confirmations),
        (false, block_hash.as_str(), 2)
    );
    assert_eq!(
        c.revert_reason.as_deref(),
        Some("Error(\"reverted by the fake chain\")"),
        "the TxConfirmed of a revert says why"
    );
    chain.mine();
    assert!(
        drive().await.expect("drive").is_empty(),
        "settled: nothing more"
    );

    // A reorg deeper than the depth removes its block: the TxConfirmed of the revert is
    // reverted (on tx.confirmations and tx.outcomes), and the outcome re-evaluated.
    chain.reorg(3);
    let outs = drive().await.expect("drive");
    let reversal = txflow_confirmation_manager::decide::reversal_event_id(tx, 0).to_string();
    assert_eq!(outs.len(), 2, "the new fork and the reversal: {outs:?}");
    assert!(outs.iter().all(|o| o.event_id == reversal));
    let followed = || async {
        sqlx::query_as::<_, (bool, bool, bool)>(
            "SELECT watch_until_block IS NOT NULL, reorged_at IS NOT NULL,
                    mined_block_number IS NOT NULL FROM managed_tx WHERE tx_id = $1",
        )
        .bind(tx)
        .fetch_one(&db.pool)
        .await
        .expect("row")
    };
    assert_eq!(followed().await, (true, true, false), "re-evaluated");
    // Another transaction uses its nonce, buried at the depth: the revert's outcome (no effect)
    // stands, and with no block to watch it is no longer followed.
    chain.use_nonce_elsewhere(key.address(), 0);
    chain.mine();
    drive().await.expect("drive");
    assert_eq!(settled().await, ("REVERTED".to_string(), true));
    assert_eq!(
        followed().await,
        (false, false, false),
        "neither watched nor re-evaluated"
    );
    let pending = txflow_confirmation_manager::store::pending_signers(&db.pool, ChainId(31337))
        .await
        .expect("pending signers");
    assert!(
        pending.is_empty(),
        "the signer is no longer driven for it: {pending:?}"
    );
    assert!(drive().await.expect("drive").is_empty());
}

/// Confirms one request at block `b`, then replaces the last three blocks with new ones in which
/// the original's signed bytes are included again at another height (`index` of the new blocks:
/// 0 is below its old block, 2 above it), the confirmation manager down across the reorg when
/// `cm_down`; then mines two blocks. The transaction is txflow's own attempt found on the chain:
/// CONFIRMED again at its original nonce, from the block it is in now, executed once, never
/// undone (no TxReorgUndone, no second signature of the request).
async fn a_deep_reorg_that_re_includes_the_original(cm_down: bool, index: usize) {
    let mut run = Run::start(1, 2).await;
    // Blocks below the request's, so that the reorg never reaches the genesis block.
    run.mine(2).await;
    let tx = run.confirm_one("ri").await;
    let tx_id = tx.to_string();
    let old_block: i64 = sqlx::query_scalar("SELECT mined_block_number FROM managed_tx")
        .fetch_one(&run.p.db.pool)
        .await
        .expect("its block");
    let raw: Vec<u8> =
        sqlx::query_scalar("SELECT raw_tx FROM tx_attempts WHERE tx_id = $1 AND attempt = 1")
            .bind(tx)
            .fetch_one(&run.p.db.pool)
            .await
            .expect("the signed bytes");
    if cm_down {
        run.stop_cm().await;
    }
    let head = run.head().await;
    assert_eq!(head, old_block as u64 + 1, "confirmed at depth 2");
    let outsider = TransactionRequest::default()
        .with_from(OUTSIDER.parse::<Address>().expect("address"))
        .with_to(
            txflow_tests::pipeline::SINK
                .parse::<Address>()
                .expect("sink"),
        )
        .with_value(U256::from(7))
        .with_gas_limit(21_000);
    // Blocks head-2 ..= head replaced; the outsider's transfer in a block other than ours.
    let outsider_at = if index == 0 { 1 } else { 0 };
    run.p
        .provider()
        .anvil_reorg(ReorgOptions {
            depth: 3,
            tx_block_pairs: vec![
                (TransactionData::JSON(outsider), outsider_at),
                (TransactionData::Raw(raw.into()), index as u64),
            ],
        })
        .await
        .expect("anvil_reorg");
    let again = head - 2 + index as u64;
    assert_ne!(again as i64, old_block, "another height");
    run.mine(2).await;
    if cm_down {
        run.start_cm("confirm-2").await;
    }
    run.wait_count(
        "confirmed again at its nonce, from the block it is in now",
        &format!(
            "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED' AND reorged_at IS NULL
             AND reorg_generation = 1 AND nonce = 0 AND mined_block_number = {again}"
        ),
        1,
    )
    .await;
    let second = txflow_confirmation_manager::decide::confirmed_event_id(tx, 1).to_string();
    run.events
        .until("the TxConfirmed of generation 1", |seen| {
            confirmed_ids(seen)
                .get(&tx_id)
                .is_some_and(|ids| ids.contains(&second))
        })
        .await;
    let seen = run.events.seen.clone();
    let (_, c) = confirmed(&seen)
        .into_iter()
        .find(|(s, _)| s.event_id == second)
        .expect("the TxConfirmed of generation 1");
    assert_eq!((c.block_number as u64, c.nonce), (again, 0));
    // Mined once, at its nonce; never undone, never re-allocated or signed again; nothing left
    // in the node's pool (the defensive cancellation was refused: the nonce is used).
    let mined = run.p.mined().await;
    assert_eq!(mined.len(), 1, "executed once: {mined:?}");
    assert_eq!((mined[0].nonce, mined[0].block), (0, again));
    assert_eq!(mined[0].marker(), "txflow:ri-0-0");
    assert_eq!(
        run.count("SELECT count(*) FROM tx_events WHERE type = 'TxReorgUndone'")
            .await,
        0,
        "never undone"
    );
    assert_eq!(
        run.count("SELECT count(*) FROM tx_attempts").await,
        1,
        "signed once"
    );
    assert_eq!(run.p.pool_status().await, ("0x0".into(), "0x0".into()));
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_confirmed_transaction_re_included_above_its_block_while_the_confirmation_manager_was_down_is_confirmed_again_and_executed_once()
 {
    a_deep_reorg_that_re_includes_the_original(true, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_confirmed_transaction_re_included_below_its_block_by_a_deep_reorg_is_confirmed_again_and_executed_once()
 {
    a_deep_reorg_that_re_includes_the_original(false, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_to_an_endpoint_lagging_more_than_the_depth_is_not_a_reorg() {
    let alerts = Alerts::install();
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    // Two endpoints of one chain: the first, which the pipeline uses while it answers, and a
    // second whose head the test holds back.
    let first = FaultProxy::start(&anvil.url, vec![])
        .await
        .expect("start the fault proxy");
    let behind = FaultProxy::start(&anvil.url, vec![])
        .await
        .expect("start the fault proxy");
    let urls = vec![first.url.clone(), behind.url.clone()];
    let run = Run::start_on(anvil, 1, 3, move |c| c.rpc_urls = urls).await;
    run.mine(2).await;
    // A transaction final and watched, and one mined and counting toward its depth.
    run.submit("lag-a", 1).await;
    run.mine(3).await;
    run.wait_count(
        "the first confirmed",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'",
        1,
    )
    .await;
    let a_block: i64 = sqlx::query_scalar(
        "SELECT mined_block_number FROM managed_tx WHERE request_id = 'lag-a-0-0'",
    )
    .fetch_one(&run.p.db.pool)
    .await
    .expect("its block");
    let a_block = a_block as u64;
    run.mine(2).await;
    run.submit("lag-b", 1).await;
    run.mine(1).await;
    run.wait_lists("lag-b", 1, 1).await;
    let head = run.head().await;
    assert_eq!(head, a_block + 5);

    // The first endpoint fails; the second has seen the first transaction's block and the one
    // above it, 4 blocks behind the head (more than the 3 required): not the second's block.
    behind.lag_at(Some(a_block + 1));
    first.set_rules(vec![Rule::all(1, Fault::Status(503))]);
    let reads = || {
        behind
            .calls()
            .get("eth_getBlockByNumber")
            .copied()
            .unwrap_or(0)
    };
    let before = reads();
    wait_until(
        "the confirmation manager follows the lagging endpoint",
        LONG,
        || async { reads() >= before + 20 },
    )
    .await;
    let (run_ref, alerts_ref) = (&run, &alerts);
    let nothing_undone = |when: &'static str| async move {
        let (run, alerts) = (run_ref, alerts_ref);
        assert_eq!(
            run.count(
                "SELECT count(*) FROM tx_events WHERE type IN ('TxReorged', 'TxReorgUndone')"
            )
            .await,
            0,
            "{when}: nothing went back to SUBMITTED or SIMULATED"
        );
        assert_eq!(
            run.count(
                "SELECT count(*) FROM tx_events WHERE type = 'TxConfirmationsUpdated'
                 AND (payload->>'new_fork')::boolean"
            )
            .await,
            0,
            "{when}: no new fork announced"
        );
        assert_eq!(
            run.count("SELECT count(*) FROM managed_tx WHERE reorged_at IS NOT NULL")
                .await,
            0,
            "{when}: no deep reorg recorded"
        );
        assert!(
            !alerts.raised(txflow_confirmation_manager::DEEP_REORG_ALERT),
            "{when}: no critical alert"
        );
    };
    nothing_undone("behind").await;
    assert_eq!(run.state("lag-a-0-0").await, "CONFIRMED");
    assert_eq!(run.state("lag-b-0-0").await, "MINED");

    // The endpoint catches up: the second transaction is confirmed at its depth.
    behind.lag_at(None);
    run.mine(2).await;
    run.wait_count(
        "the second confirmed",
        "SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'",
        2,
    )
    .await;
    nothing_undone("caught up").await;
    assert_eq!(run.p.mined().await.len(), 2, "each mined once");
    assert!(
        first.faults().values().sum::<u64>() > 0,
        "the first endpoint failed calls"
    );
    run.finish().await;
}
