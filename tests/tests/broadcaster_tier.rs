//! The broadcaster's middle tier: `BroadcastStage::drive` called directly, against a real
//! PostgreSQL (a fresh database per test, `TestDb`) and the scripted in-memory chain
//! (`txflow_tests::fake_chain`), with a broadcaster lease from `LeaseManager`. No broker: the
//! outputs `drive` returns are checked as values.
//!
//! Each test seeds SIGNED transactions as the signer gateway leaves them (a `managed_tx` row and
//! its attempt 1 with a really signed raw transaction, at the nonce the fake chain expects),
//! scripts the node's answer, drives, and checks what PostgreSQL and the chain hold afterwards —
//! never the code's own counters.
//!
//! 1. A permanent refusal fails the transaction (SEND_REJECTED) and releases its nonce.
//! 2. A retryable refusal changes nothing; a later drive submits. A send that fails for now (an
//!    RPC error, an unknown answer) is sent again within the drive, later nonces after it.
//! 3. Insufficient funds holds the signer and fails nothing; a later drive submits and clears it.
//! 4. "nonce too low" for a transaction the chain does not know: REPLACED when the chain's nonce
//!    is past ours, undecided (still SIGNED) when it is not.
//! 5. A drive under a stolen lease is `LeaseLost` and writes nothing.
//! 6. A hold clears only when the node took a send: no RPC error, refusal, replaced nonce or
//!    undecided "nonce too low" clears it.
//! 7. A hold set by a resubmission clears when a later resend is taken, with nothing SIGNED.
//! 8. A recovery drive whose SIGNED send is refused for funds keeps the hold though a resend is
//!    taken in the same drive: the hold does not come and go on every recovery drive.
//! 9. A defensive cancellation (seed 000 §4.4) is sent by the recovery drive while its transaction,
//!    undone by a deep reorg, is re-evaluated: once per interval, never once its nonce is used or
//!    the transaction is mined again, and without moving any state.
//! 10. A gap of several nonces at the chain's nonce (a reorg took the block of our
//!     transactions, and nodes do not re-pool them) is closed by one recovery drive: the signed
//!     bytes of every nonce from the chain's up to the highest sent go out again, in order.

use std::sync::Arc;
use std::time::Duration;

use alloy::primitives::{Address, B256, Bytes, U256};
use alloy::signers::local::PrivateKeySigner;
use serde_json::Value;
use txflow_broadcaster::{BroadcastStage, BroadcasterConfig, decide};
use txflow_core::chain::{SendOutcome, UnsignedTx, sign};
use txflow_core::domain::{ChainId, NodeId, Signer, TxPayload};
use txflow_core::kafka::{Topics, signer_key};
use txflow_core::lease::{Acquisition, HeldLease, LeaseConfig, LeaseManager};
use txflow_core::role::Role;
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output};
use txflow_tests::fake_chain::FakeChain;
use txflow_tests::{TestDb, unique};
use uuid::Uuid;

const CHAIN_ID: i64 = 31337;
const SINK: &str = "0x000000000000000000000000000000000000dead";
const MAX_FEE: u128 = 2_000_000_000;
const TIP: u128 = 1_000_000_000;

/// A SIGNED transaction seeded by [`Tier::seed_signed`].
struct Seeded {
    tx_id: Uuid,
    request_id: String,
    nonce: i64,
    hash: B256,
    raw: Vec<u8>,
}

/// `managed_tx` columns a drive may change.
#[derive(Debug, PartialEq, Eq)]
struct TxRow {
    state: String,
    failure_code: Option<String>,
    nonce_released: bool,
    fencing_token: Option<i64>,
}

/// One `tx_events` row.
#[derive(Debug)]
struct EventRow {
    event_id: Uuid,
    kind: String,
    payload: Value,
}

/// The database, the fake chain, the signer, the stage and the broadcaster lease of one test.
struct Tier {
    db: TestDb,
    chain: Arc<FakeChain>,
    key: PrivateKeySigner,
    topics: Topics,
    stage: BroadcastStage,
    lease: HeldLease,
}

/// A lease manager of the broadcaster role for a node of its own.
fn manager(pool: &sqlx::PgPool, name: &str) -> LeaseManager {
    LeaseManager::new(
        pool.clone(),
        Role::Broadcaster,
        NodeId::named(format!("{name}-{}", Uuid::new_v4())),
        LeaseConfig::default(),
    )
    .expect("lease manager")
}

async fn acquire(m: &LeaseManager, signer: &Signer) -> HeldLease {
    match m
        .acquire(ChainId(CHAIN_ID), signer)
        .await
        .expect("acquire the lease")
    {
        Acquisition::Held(lease, _) => lease,
        busy => panic!("lease not acquired: {busy:?}"),
    }
}

impl Tier {
    async fn new() -> Tier {
        let db = TestDb::new().await;
        let chain = Arc::new(FakeChain::new());
        let key = PrivateKeySigner::random();
        let topics = Topics::new(unique("broadcaster-tier"));
        let stage = BroadcastStage::new(
            BroadcasterConfig {
                chain_id: ChainId(CHAIN_ID),
                topics: topics.clone(),
                // Not within a test: a resubmission would be one more send to account for.
                resubmit_interval: Duration::from_secs(3600),
                // A nonce used elsewhere is final in its own block on the fake chain.
                confirmations_required: 1,
            },
            chain.clone(),
        );
        let signer = Signer::parse(&format!("{:#x}", key.address())).expect("signer");
        let lease = acquire(&manager(&db.pool, "owner"), &signer).await;
        Tier {
            db,
            chain,
            key,
            topics,
            stage,
            lease,
        }
    }

    fn address(&self) -> Address {
        self.key.address()
    }

    /// The signer, lowercase 0x-hex.
    fn signer(&self) -> String {
        format!("{:#x}", self.key.address())
    }

    fn pool(&self) -> &sqlx::PgPool {
        &self.db.pool
    }

    /// Records a SIGNED transaction at `nonce` as the signer gateway leaves it (unfenced: test
    /// setup): the row, and attempt 1 with the raw transaction signed by the test's key.
    async fn seed_signed(&self, nonce: i64) -> Seeded {
        let request_id = format!("tier-{nonce}-{}", Uuid::new_v4());
        let payload = TxPayload {
            to: SINK.into(),
            value: "1".into(),
            data: "0x".into(),
            gas_limit: Some(21_000),
            max_fee_per_gas: Some(MAX_FEE.to_string()),
            max_priority_fee_per_gas: Some(TIP.to_string()),
        };
        let tx_id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state)
             VALUES ($1, $2, $3, $4, $5, $6, 'SIGNED')",
        )
        .bind(tx_id)
        .bind(CHAIN_ID)
        .bind(self.signer())
        .bind(&request_id)
        .bind(nonce)
        .bind(serde_json::to_value(&payload).expect("payload"))
        .execute(self.pool())
        .await
        .expect("record the SIGNED row");
        let signed = sign(
            &self.key,
            &UnsignedTx {
                chain_id: CHAIN_ID as u64,
                nonce: nonce as u64,
                to: SINK.parse().expect("sink"),
                value: U256::from(1),
                data: Bytes::new(),
                gas_limit: 21_000,
                max_fee_per_gas: MAX_FEE,
                max_priority_fee_per_gas: TIP,
            },
        )
        .expect("sign");
        sqlx::query(
            "INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas, max_priority_fee_per_gas)
             VALUES ($1, 1, $2, $3, $4::numeric, $5::numeric)",
        )
        .bind(tx_id)
        .bind(format!("{:#x}", signed.hash))
        .bind(&signed.raw)
        .bind(MAX_FEE.to_string())
        .bind(TIP.to_string())
        .execute(self.pool())
        .await
        .expect("record the attempt");
        Seeded {
            tx_id,
            request_id,
            nonce,
            hash: signed.hash,
            raw: signed.raw,
        }
    }

    /// One drive under the test's lease, as after a batch (no resubmissions).
    async fn drive(&self) -> Result<Vec<Output>, HandlerError> {
        self.drive_as(&self.lease).await
    }

    async fn drive_as(&self, lease: &HeldLease) -> Result<Vec<Output>, HandlerError> {
        self.stage
            .drive(DriveCtx {
                lease,
                pool: self.pool(),
                recovery: false,
            })
            .await
    }

    /// A drive that must succeed.
    async fn drive_ok(&self) -> Vec<Output> {
        self.drive()
            .await
            .unwrap_or_else(|e| panic!("the drive failed: {e:?}"))
    }

    /// One drive of the recovery scan (SIGNED sends, then due resubmissions), which must succeed.
    async fn drive_recovery(&self) -> Vec<Output> {
        self.stage
            .drive(DriveCtx {
                lease: &self.lease,
                pool: self.pool(),
                recovery: true,
            })
            .await
            .unwrap_or_else(|e| panic!("the recovery drive failed: {e:?}"))
    }

    /// Makes the transaction's latest attempt due for resubmission now.
    async fn make_due(&self, s: &Seeded) {
        let done = sqlx::query(
            "UPDATE tx_attempts SET next_resubmit_at = now() - interval '1 second'
             WHERE tx_id = $1 AND next_resubmit_at IS NOT NULL",
        )
        .bind(s.tx_id)
        .execute(self.pool())
        .await
        .expect("make the resubmission due");
        assert_eq!(done.rows_affected(), 1, "a resubmission is tracked");
    }

    /// Scripts "insufficient funds" for the next send and drives: the signer is held.
    async fn hold_for_funds(&self) {
        self.chain.script_send(SendOutcome::InsufficientFunds {
            reason: "-32003: insufficient funds for gas * price + value".into(),
        });
        self.drive_ok().await;
        let holds = self.holds().await;
        assert_eq!(holds.len(), 1, "held: {holds:?}");
    }

    async fn tx(&self, s: &Seeded) -> TxRow {
        let (state, failure_code, nonce_released, fencing_token): (
            String,
            Option<String>,
            bool,
            Option<i64>,
        ) = sqlx::query_as(
            "SELECT state, failure_code, nonce_released, fencing_token FROM managed_tx WHERE tx_id = $1",
        )
        .bind(s.tx_id)
        .fetch_one(self.pool())
        .await
        .expect("managed_tx row");
        TxRow {
            state,
            failure_code,
            nonce_released,
            fencing_token,
        }
    }

    async fn state(&self, s: &Seeded) -> String {
        self.tx(s).await.state
    }

    /// The transaction's `tx_events` rows, oldest first.
    async fn events(&self, s: &Seeded) -> Vec<EventRow> {
        let rows: Vec<(Uuid, String, Value)> = sqlx::query_as(
            "SELECT event_id, type, payload FROM tx_events WHERE tx_id = $1 ORDER BY created_at, event_id",
        )
        .bind(s.tx_id)
        .fetch_all(self.pool())
        .await
        .expect("tx_events");
        rows.into_iter()
            .map(|(event_id, kind, payload)| EventRow {
                event_id,
                kind,
                payload,
            })
            .collect()
    }

    /// The signer's recycled nonces.
    async fn recycled(&self) -> Vec<i64> {
        sqlx::query_scalar(
            "SELECT nonce FROM recycled_nonces WHERE chain_id = $1 AND signer = $2 ORDER BY nonce",
        )
        .bind(CHAIN_ID)
        .bind(self.signer())
        .fetch_all(self.pool())
        .await
        .expect("recycled_nonces")
    }

    /// The signer's holds: `(role, reason)`.
    async fn holds(&self) -> Vec<(String, String)> {
        sqlx::query_as(
            "SELECT role, reason FROM signer_holds WHERE chain_id = $1 AND signer = $2 ORDER BY role",
        )
        .bind(CHAIN_ID)
        .bind(self.signer())
        .fetch_all(self.pool())
        .await
        .expect("signer_holds")
    }

    /// The broadcaster's hold of the signer: `(reason, since)`, `since` as text.
    async fn hold_since(&self) -> Option<(String, String)> {
        sqlx::query_as(
            "SELECT reason, since::text FROM signer_holds
             WHERE role = $1 AND chain_id = $2 AND signer = $3",
        )
        .bind(Role::Broadcaster.as_str())
        .bind(CHAIN_ID)
        .bind(self.signer())
        .fetch_optional(self.pool())
        .await
        .expect("signer_holds")
    }

    /// The kinds of the transaction's `tx_events` rows, oldest first.
    async fn event_kinds(&self, s: &Seeded) -> Vec<String> {
        self.events(s).await.into_iter().map(|e| e.kind).collect()
    }

    /// `(submitted_at is set, next_resubmit_at is set)` of the transaction's attempt 1.
    async fn attempt(&self, s: &Seeded) -> (bool, bool) {
        sqlx::query_as(
            "SELECT submitted_at IS NOT NULL, next_resubmit_at IS NOT NULL FROM tx_attempts
             WHERE tx_id = $1 AND attempt = 1",
        )
        .bind(s.tx_id)
        .fetch_one(self.pool())
        .await
        .expect("tx_attempts row")
    }

    /// Everything a drive may write, every column, as JSON (the lease table aside).
    async fn snapshot(&self) -> Value {
        let mut all = serde_json::Map::new();
        for (table, order) in [
            ("managed_tx", "tx_id"),
            ("tx_attempts", "tx_id, attempt"),
            ("tx_events", "event_id"),
            ("recycled_nonces", "chain_id, signer, nonce"),
            ("signer_holds", "role, chain_id, signer"),
            ("signer_nonce_cursor", "chain_id, signer"),
        ] {
            let rows: Value = sqlx::query_scalar(&format!(
                "SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY {order}), '[]'::jsonb) FROM {table} t"
            ))
            .fetch_one(self.pool())
            .await
            .unwrap_or_else(|e| panic!("snapshot of {table}: {e}"));
            all.insert(table.to_string(), rows);
        }
        Value::Object(all)
    }

    /// Whether the fake chain's pool holds this transaction (accepted, not mined).
    fn pooled(&self, s: &Seeded) -> bool {
        self.chain.pooled().iter().any(|p| p.hash == s.hash)
    }

    /// How many times the chain received this raw transaction.
    fn received(&self, s: &Seeded) -> usize {
        self.chain.sent().iter().filter(|r| **r == s.raw).count()
    }
}

/// `(topic, event_id)` of each output.
fn outputs_of(outputs: &[Output]) -> Vec<(String, String)> {
    outputs
        .iter()
        .map(|o| (o.topic.clone(), o.event_id.clone()))
        .collect()
}

/// 1. A permanent refusal: FAILED with SEND_REJECTED, the nonce released to `recycled_nonces`,
///    one TxFailed audit row saying so, and that same TxFailed announced on the outcomes topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_refusal_fails_the_transaction_and_releases_its_nonce() {
    let t = Tier::new().await;
    let s = t.seed_signed(0).await;
    t.chain.script_send(SendOutcome::Rejected {
        retryable: false,
        reason: "-32000: invalid sender".into(),
    });

    let outputs = t.drive_ok().await;

    assert_eq!(
        t.tx(&s).await,
        TxRow {
            state: "FAILED".into(),
            failure_code: Some("SEND_REJECTED".into()),
            nonce_released: true,
            fencing_token: Some(t.lease.token().0),
        }
    );
    assert_eq!(t.recycled().await, vec![s.nonce], "the nonce is recycled");
    let events = t.events(&s).await;
    assert_eq!(events.len(), 1, "one audit row: {events:?}");
    let failed = &events[0];
    assert_eq!(failed.kind, "TxFailed");
    assert_eq!(
        failed.payload["nonce_released"],
        Value::Bool(true),
        "{failed:?}"
    );
    assert_eq!(failed.payload["code"], "SEND_REJECTED", "{failed:?}");
    assert_eq!(failed.payload["nonce"], s.nonce, "{failed:?}");
    assert_eq!(
        failed.payload["request_id"],
        s.request_id.as_str(),
        "{failed:?}"
    );
    assert_eq!(
        outputs_of(&outputs),
        vec![(t.topics.tx_outcomes(), failed.event_id.to_string())],
        "one TxFailed on the outcomes topic, the audit row's event"
    );
    assert_eq!(
        outputs[0].key,
        signer_key(CHAIN_ID, &t.signer()),
        "keyed by signer"
    );
    assert!(t.holds().await.is_empty(), "a refusal holds nothing");
    assert_eq!(t.received(&s), 1, "sent once");
    assert!(!t.pooled(&s), "the node took nothing");

    // Nothing is SIGNED any more: a second drive neither sends nor writes.
    let before = t.snapshot().await;
    assert!(t.drive_ok().await.is_empty());
    assert_eq!(t.snapshot().await, before);
    assert_eq!(t.received(&s), 1, "not sent again");
}

/// 2. A retryable refusal changes nothing (and later nonces are not sent behind it); once the
///    node accepts, the next drive submits them, in nonce order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_refusal_changes_nothing_and_a_later_drive_submits() {
    let t = Tier::new().await;
    let first = t.seed_signed(0).await;
    let second = t.seed_signed(1).await;
    t.chain.script_send(SendOutcome::Rejected {
        retryable: true,
        reason: "-32603: replacement transaction underpriced".into(),
    });
    let before = t.snapshot().await;

    let outputs = t.drive_ok().await;

    assert!(outputs.is_empty(), "nothing announced");
    assert_eq!(
        t.snapshot().await,
        before,
        "a retryable refusal changed PostgreSQL"
    );
    assert_eq!(t.received(&first), 1, "the first was sent");
    assert_eq!(
        t.received(&second),
        0,
        "a later nonce is not sent behind a refused one"
    );

    // The node accepts now.
    let outputs = t.drive_ok().await;

    let mut announced = Vec::new();
    for s in [&first, &second] {
        assert_eq!(t.state(s).await, "SUBMITTED");
        let events = t.events(s).await;
        assert_eq!(events.len(), 1, "one audit row: {events:?}");
        assert_eq!(events[0].kind, "TxSubmitted");
        assert_eq!(events[0].payload["tx_hash"], format!("{:#x}", s.hash));
        assert_eq!(
            t.attempt(s).await,
            (true, true),
            "submitted_at and next_resubmit_at set"
        );
        assert!(t.pooled(s), "the chain's pool holds it");
        announced.push((t.topics.tx_submitted(), events[0].event_id.to_string()));
        announced.push((t.topics.tx_outcomes(), events[0].event_id.to_string()));
    }
    assert_eq!(
        outputs_of(&outputs),
        announced,
        "TxSubmitted for each, in nonce order, with its copy on tx.outcomes"
    );
    assert!(t.recycled().await.is_empty(), "nothing recycled");
}

/// 2b. A send that fails for now — an RPC error (every round of the client failed), an answer no
///     one knows — is sent again within the same drive after a short pause, and the later nonce
///     only once the first is taken: one drive submits both. A send that keeps failing stops the
///     drive after a bounded number of tries, nothing recorded and nothing sent behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_that_fails_for_now_is_sent_again_within_the_drive_in_nonce_order() {
    let t = Tier::new().await;
    let first = t.seed_signed(0).await;
    let second = t.seed_signed(1).await;
    // The first send fails on the transport, the second is answered with a wording no one
    // knows; the third is taken. The second transaction's first send fails on the transport.
    t.chain.fail_next("send_raw", 1);
    t.chain.script_send(SendOutcome::Unknown {
        reason: "-32000: upstream relay hiccup".into(),
    });

    let outputs = t.drive_ok().await;

    assert_eq!(
        t.chain.calls("send_raw"),
        4,
        "the first transaction was sent three times, the second once, in one drive"
    );
    assert_eq!(t.received(&second), 1, "the second was sent once");
    for s in [&first, &second] {
        assert_eq!(t.state(s).await, "SUBMITTED", "nonce {}", s.nonce);
        assert!(t.pooled(s), "the chain's pool holds nonce {}", s.nonce);
    }
    assert_eq!(outputs.len(), 4, "TxSubmitted and its copy, for each");

    // A send that keeps failing: the drive gives up after its tries, nothing sent behind it.
    let t = Tier::new().await;
    let first = t.seed_signed(0).await;
    let second = t.seed_signed(1).await;
    t.chain.fail_next("send_raw", 100);
    let before = t.snapshot().await;

    let outputs = t.drive_ok().await;

    assert!(outputs.is_empty(), "nothing announced");
    assert_eq!(
        t.chain.calls("send_raw"),
        1 + u64::from(decide::SEND_RETRIES),
        "sent once, then again at each pause of the backoff"
    );
    assert_eq!(t.snapshot().await, before, "PostgreSQL unchanged");
    assert_eq!(t.received(&first) + t.received(&second), 0);
    assert_eq!(t.state(&second).await, "SIGNED");
}

/// 3. Insufficient funds holds the signer (a `signer_holds` row of the broadcaster) and fails
///    nothing; once the node accepts, the next drive submits and the hold is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insufficient_funds_holds_the_signer_until_a_send_succeeds() {
    let t = Tier::new().await;
    let first = t.seed_signed(0).await;
    let second = t.seed_signed(1).await;
    t.chain.script_send(SendOutcome::InsufficientFunds {
        reason: "-32003: insufficient funds for gas * price + value".into(),
    });

    let outputs = t.drive_ok().await;

    assert!(outputs.is_empty(), "nothing announced");
    let holds = t.holds().await;
    assert_eq!(holds.len(), 1, "one hold: {holds:?}");
    assert_eq!(holds[0].0, "broadcaster");
    assert!(holds[0].1.contains("insufficient funds"), "{holds:?}");
    for s in [&first, &second] {
        assert_eq!(t.state(s).await, "SIGNED", "nothing fails");
        assert!(t.events(s).await.is_empty(), "no audit row");
        assert_eq!(t.attempt(s).await, (false, false), "not submitted");
    }
    assert!(t.recycled().await.is_empty(), "nothing recycled");
    assert_eq!(t.received(&second), 0, "nothing new sent while held");

    let outputs = t.drive_ok().await;

    assert_eq!(
        outputs_of(&outputs).len(),
        4,
        "TxSubmitted for each, on tx.submitted and tx.outcomes"
    );
    for s in [&first, &second] {
        assert_eq!(t.state(s).await, "SUBMITTED");
        assert!(t.pooled(s));
    }
    assert!(t.holds().await.is_empty(), "the hold is cleared");
}

/// 4a. "nonce too low" for a transaction the chain knows by no hash of ours, with the chain's
///     nonce past ours: the nonce was used outside txflow, REPLACED with one TxReplaced row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nonce_too_low_for_an_unknown_transaction_past_the_chain_nonce_is_replaced() {
    let t = Tier::new().await;
    let s = t.seed_signed(0).await;
    // The signer's nonce 0 was used outside txflow: the node itself answers "nonce too low".
    t.chain.use_nonce_elsewhere(t.address(), 0);

    let outputs = t.drive_ok().await;

    let row = t.tx(&s).await;
    assert_eq!(row.state, "REPLACED", "{row:?}");
    assert_eq!(row.fencing_token, Some(t.lease.token().0));
    assert!(!row.nonce_released, "{row:?}");
    let events = t.events(&s).await;
    assert_eq!(events.len(), 1, "one audit row: {events:?}");
    let replaced = &events[0];
    assert_eq!(replaced.kind, "TxReplaced");
    let nonce = replaced.payload["nonce"].as_i64().expect("nonce");
    let chain_nonce = replaced.payload["chain_nonce"]
        .as_i64()
        .expect("chain_nonce");
    assert_eq!(nonce, s.nonce, "{replaced:?}");
    assert!(chain_nonce > nonce, "{replaced:?}");
    assert!(
        t.recycled().await.is_empty(),
        "a nonce the chain consumed is not recycled"
    );
    assert!(
        !outputs
            .iter()
            .any(|o| o.topic == t.topics.tx_submitted() || o.topic == t.topics.tx_outcomes()),
        "neither submitted nor failed: {:?}",
        outputs_of(&outputs)
    );
    assert!(!t.chain.is_mined(s.hash) && !t.pooled(&s));
}

/// 4b. The same answer while the chain has not passed our nonce (its latest nonce equals ours):
///     whose nonce it is cannot be told, nothing changes; the next drive sends it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nonce_too_low_while_the_chain_has_not_passed_our_nonce_is_undecided() {
    let t = Tier::new().await;
    let s = t.seed_signed(1).await;
    // The chain's latest nonce is 1: nonce 0 is used, ours (1) is not.
    t.chain.use_nonce_elsewhere(t.address(), 0);
    t.chain.script_send(SendOutcome::NonceTooLow {
        reason: "-32003: nonce too low".into(),
    });
    let before = t.snapshot().await;

    let outputs = t.drive_ok().await;

    assert!(outputs.is_empty(), "nothing announced");
    assert_eq!(t.state(&s).await, "SIGNED");
    assert_eq!(t.snapshot().await, before, "an undecided answer wrote");
    assert!(
        t.chain.calls("latest_nonce") >= 1,
        "the chain's nonce was asked"
    );

    // Tried again later; the node accepts it now.
    t.drive_ok().await;
    assert_eq!(t.state(&s).await, "SUBMITTED");
    assert_eq!(t.received(&s), 2);
    assert!(t.pooled(&s));
}

/// 5. A drive under a stolen lease (expired, then taken by another node) is `LeaseLost` and
///    writes nothing; the new owner then does the work under its own token. The node accepts
///    here, so the stale drive reaches its fenced record (the send itself happens before any
///    fence check: sending the same raw transaction twice is harmless).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drive_under_a_stolen_lease_is_lease_lost_and_writes_nothing() {
    let t = Tier::new().await;
    let s = t.seed_signed(0).await;
    sqlx::query(
        "UPDATE signer_lease SET expires_at = now() - interval '1 hour'
         WHERE role = $1 AND chain_id = $2 AND signer = $3",
    )
    .bind(Role::Broadcaster.as_str())
    .bind(CHAIN_ID)
    .bind(t.signer())
    .execute(t.pool())
    .await
    .expect("expire the lease");
    let signer = Signer::parse(&t.signer()).expect("signer");
    let new = acquire(&manager(t.pool(), "thief"), &signer).await;
    assert!(new.token() > t.lease.token(), "a steal raises the token");
    let before = t.snapshot().await;

    match t.drive().await {
        Err(HandlerError::LeaseLost(e)) => assert!(e.is_fenced(), "{e:?}"),
        Err(e) => panic!("the stale drive failed, but not as lease lost: {e:?}"),
        Ok(outputs) => panic!("the stale drive succeeded: {:?}", outputs_of(&outputs)),
    }
    assert_eq!(t.snapshot().await, before, "a stale driver wrote");

    let outputs = t
        .drive_as(&new)
        .await
        .unwrap_or_else(|e| panic!("the new owner's drive: {e:?}"));
    let events = t.events(&s).await;
    assert_eq!(events.len(), 1, "one audit row: {events:?}");
    let id = events[0].event_id.to_string();
    assert_eq!(
        outputs_of(&outputs),
        [
            (t.topics.tx_submitted(), id.clone()),
            (t.topics.tx_outcomes(), id)
        ],
        "its TxSubmitted, and the copy for downstream"
    );
    let row = t.tx(&s).await;
    assert_eq!(row.state, "SUBMITTED");
    assert_eq!(
        row.fencing_token,
        Some(new.token().0),
        "under the new token"
    );
}

/// What stops a held signer's next drive, the node having taken nothing.
#[derive(Debug, Clone, Copy)]
enum NotTaken {
    /// `send_raw` fails as an unavailable node.
    SendUnavailable,
    /// The node refuses the transaction for now.
    RetryableRefusal,
    /// "nonce too low" while the chain has not passed our nonce: undecided.
    UndecidedNonceTooLow,
    /// "nonce too low", and asking the chain whether it knows our hash fails.
    NonceTooLowUnanswered,
    /// The node refuses the transaction for good: FAILED.
    PermanentRefusal,
    /// The nonce was used outside txflow: REPLACED.
    Replaced,
}

/// 6. A hold clears only when the node took a send (accepted, already known, or "nonce too low"
///    for one of our own hashes). Each stop that proves nothing of the kind — an RPC error, a
///    retryable refusal, an undecided or unanswered "nonce too low", a permanent refusal, a
///    replaced nonce — leaves the hold (and its alert) in place; the next send the node accepts
///    clears it. Each case on a fresh database and chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_clears_only_when_the_node_took_a_send() {
    use NotTaken::*;
    // (case, the state the drive leaves the transaction in)
    let cases = [
        (SendUnavailable, "SIGNED"),
        (RetryableRefusal, "SIGNED"),
        (UndecidedNonceTooLow, "SIGNED"),
        (NonceTooLowUnanswered, "SIGNED"),
        (PermanentRefusal, "FAILED"),
        (Replaced, "REPLACED"),
    ];
    let mut cleared = Vec::new();
    for (case, state) in cases {
        let t = Tier::new().await;
        let s = if matches!(case, UndecidedNonceTooLow) {
            // The chain's latest nonce is 1: nonce 0 is used, ours (1) is not.
            t.chain.use_nonce_elsewhere(t.address(), 0);
            t.seed_signed(1).await
        } else {
            t.seed_signed(0).await
        };
        t.hold_for_funds().await;
        let held = t.hold_since().await;

        match case {
            // Every send of the drive fails (the first and each one sent again after it).
            SendUnavailable => t
                .chain
                .fail_next("send_raw", 1 + decide::SEND_RETRIES as usize),
            RetryableRefusal => t.chain.script_send(SendOutcome::Rejected {
                retryable: true,
                reason: "-32603: replacement transaction underpriced".into(),
            }),
            UndecidedNonceTooLow => t.chain.script_send(SendOutcome::NonceTooLow {
                reason: "-32003: nonce too low".into(),
            }),
            NonceTooLowUnanswered => {
                t.chain.script_send(SendOutcome::NonceTooLow {
                    reason: "-32003: nonce too low".into(),
                });
                t.chain.fail_next("knows_transaction", 1);
            }
            PermanentRefusal => t.chain.script_send(SendOutcome::Rejected {
                retryable: false,
                reason: "-32000: invalid sender".into(),
            }),
            Replaced => t.chain.use_nonce_elsewhere(t.address(), 0),
        }
        t.drive_ok().await;

        assert_eq!(t.state(&s).await, state, "{case:?}");
        assert!(!t.pooled(&s), "{case:?}: the node took nothing");
        if t.hold_since().await != held {
            cleared.push(case);
        }
        if state == "SIGNED" {
            // The node accepts now: the hold clears.
            t.drive_ok().await;
            assert_eq!(t.state(&s).await, "SUBMITTED", "{case:?}");
            assert!(t.pooled(&s), "{case:?}");
            assert!(
                t.holds().await.is_empty(),
                "{case:?}: an accepted send clears the hold"
            );
        }
    }
    assert!(
        cleared.is_empty(),
        "the hold was cleared (or changed) though the node took nothing, after: {cleared:?}"
    );
}

/// 7. "insufficient funds" on a resubmission holds the signer, who has nothing SIGNED; a resend
///    the node does not take (an RPC error, "nonce too low", which is recorded) leaves the hold;
///    the next resend the node takes ("already known": its pool still holds it) clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_set_by_a_resubmission_clears_when_a_resend_is_taken() {
    let t = Tier::new().await;
    let s = t.seed_signed(0).await;
    t.drive_ok().await;
    assert_eq!(t.state(&s).await, "SUBMITTED");
    assert!(t.pooled(&s));

    t.make_due(&s).await;
    t.chain.script_send(SendOutcome::InsufficientFunds {
        reason: "-32003: insufficient funds for gas * price + value".into(),
    });
    t.drive_recovery().await;
    let held = t.hold_since().await;
    let Some((reason, _)) = &held else {
        panic!("a resend refused for funds holds the signer");
    };
    assert!(reason.contains("insufficient funds"), "{reason}");
    assert_eq!(t.event_kinds(&s).await, ["TxSubmitted"], "nothing recorded");
    assert_eq!(t.received(&s), 2, "sent, then resent");

    // The node is unavailable: the resend proves nothing.
    t.chain.fail_next("send_raw", 1);
    t.drive_recovery().await;
    assert_eq!(t.hold_since().await, held, "an RPC error cleared the hold");
    assert_eq!(t.received(&s), 2);

    // "nonce too low": recorded as resent, but the node took nothing.
    t.chain.script_send(SendOutcome::NonceTooLow {
        reason: "-32003: nonce too low".into(),
    });
    t.drive_recovery().await;
    assert_eq!(
        t.event_kinds(&s).await,
        ["TxSubmitted", "TxResubmitted"],
        "the resend is recorded"
    );
    assert_eq!(
        t.hold_since().await,
        held,
        "\"nonce too low\" cleared the hold"
    );

    // The node takes it ("already known"): the hold clears.
    t.make_due(&s).await;
    t.drive_recovery().await;
    assert_eq!(t.received(&s), 4);
    assert_eq!(
        t.event_kinds(&s).await,
        ["TxSubmitted", "TxResubmitted", "TxResubmitted"]
    );
    assert_eq!(t.state(&s).await, "SUBMITTED");
    assert!(
        t.holds().await.is_empty(),
        "a resend the node took did not clear the hold: {:?}",
        t.holds().await
    );
}

/// 8. One recovery drive sends a SIGNED transaction, refused for funds, and resends a submitted
///    one the node takes ("already known"): the drive's verdict is the refusal, the hold stays.
///    Two such drives keep the same hold row (`since` unchanged): it does not come and go, and
///    the alert does not fire again, on every recovery drive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_taken_does_not_clear_a_hold_set_in_the_same_drive() {
    let t = Tier::new().await;
    let first = t.seed_signed(0).await;
    t.drive_ok().await;
    assert_eq!(t.state(&first).await, "SUBMITTED");
    let second = t.seed_signed(1).await;

    let mut since = None;
    for round in 0..2 {
        t.make_due(&first).await;
        // The first send of the drive is the SIGNED one (nonce 1).
        t.chain.script_send(SendOutcome::InsufficientFunds {
            reason: "-32003: insufficient funds for gas * price + value".into(),
        });
        t.drive_recovery().await;
        assert_eq!(t.state(&second).await, "SIGNED", "round {round}");
        assert_eq!(
            t.event_kinds(&first).await.len(),
            2 + round,
            "round {round}: the resend of nonce 0 is recorded"
        );
        let Some((reason, at)) = t.hold_since().await else {
            panic!("round {round}: the hold was cleared in the drive that set it");
        };
        assert!(reason.contains("insufficient funds"), "{reason}");
        assert_eq!(
            *since.get_or_insert(at.clone()),
            at,
            "round {round}: the hold was cleared and set again"
        );
    }
}

/// 9. The defensive cancellation after a deep reorg: a CONFIRMED transaction with `reorged_at` set
/// and no block (as the confirmation manager leaves it) and its cancellation recorded (as the
/// signer gateway leaves it). The recovery drive sends it once and schedules the next look after
/// the interval; a drive before then sends nothing; once the chain's nonce is past it, nothing is
/// sent though it is due (the look is recorded); and once the transaction is mined again it is no
/// longer due at all. No state moves and no event is written: the confirmation manager decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_defensive_cancellation_is_sent_while_due_once_per_interval_and_never_once_the_nonce_is_used()
 {
    let t = Tier::new().await;
    let original = t.seed_signed(0).await;
    sqlx::query(
        "UPDATE managed_tx SET state = 'CONFIRMED', reorged_at = now(), reorg_generation = 1
         WHERE tx_id = $1",
    )
    .bind(original.tx_id)
    .execute(t.pool())
    .await
    .expect("undone by a deep reorg");
    let cancel = sign(
        &t.key,
        &UnsignedTx {
            chain_id: CHAIN_ID as u64,
            nonce: 0,
            to: t.address(),
            value: U256::ZERO,
            data: Bytes::new(),
            gas_limit: 21_000,
            max_fee_per_gas: 2 * MAX_FEE,
            max_priority_fee_per_gas: 2 * TIP,
        },
    )
    .expect("sign");
    sqlx::query(
        "INSERT INTO tx_cancellations (chain_id, signer, nonce, tx_id, reorg_generation, tx_hash,
                                       raw_tx, max_fee_per_gas, max_priority_fee_per_gas, fencing_token)
         VALUES ($1, $2, 0, $3, 1, $4, $5, $6::numeric, $7::numeric, 1)",
    )
    .bind(CHAIN_ID)
    .bind(t.signer())
    .bind(original.tx_id)
    .bind(format!("{:#x}", cancel.hash))
    .bind(&cancel.raw)
    .bind((2 * MAX_FEE).to_string())
    .bind((2 * TIP).to_string())
    .execute(t.pool())
    .await
    .expect("record the cancellation");
    let sent = || t.chain.sent().iter().filter(|r| **r == cancel.raw).count();
    let bookkeeping = || async {
        sqlx::query_as::<_, (i32, bool, bool)>(
            "SELECT sends, submitted_at IS NOT NULL, next_send_at > now() FROM tx_cancellations
             WHERE nonce = 0",
        )
        .fetch_one(t.pool())
        .await
        .expect("tx_cancellations row")
    };
    let make_due = || async {
        sqlx::query("UPDATE tx_cancellations SET next_send_at = now() - interval '1 second'")
            .execute(t.pool())
            .await
            .expect("make the cancellation due");
    };
    let signer = Signer::parse(&t.signer()).expect("signer");
    let pending = txflow_broadcaster::store::pending_signers(t.pool(), ChainId(CHAIN_ID))
        .await
        .expect("pending signers");
    assert_eq!(
        pending,
        [(ChainId(CHAIN_ID), signer.clone())],
        "a cancellation due"
    );

    // Sent once by the recovery drive; nothing else is (the original is not SIGNED).
    let outputs = t.drive_recovery().await;
    assert!(outputs.is_empty(), "nothing announced: {outputs:?}");
    assert_eq!(sent(), 1);
    assert_eq!(t.chain.sent().len(), 1, "only the cancellation");
    assert_eq!(
        bookkeeping().await,
        (1, true, true),
        "sent, due again later"
    );
    assert!(t.chain.pooled().iter().any(|p| p.hash == cancel.hash));
    // Not due again before the interval: not sent, and the signer has no work.
    t.drive_recovery().await;
    assert_eq!(sent(), 1);
    let pending = txflow_broadcaster::store::pending_signers(t.pool(), ChainId(CHAIN_ID))
        .await
        .expect("pending signers");
    assert!(pending.is_empty(), "{pending:?}");

    // Due again and still in the pool: sent again (already known to the node).
    make_due().await;
    t.drive_recovery().await;
    assert_eq!(sent(), 2);
    assert_eq!(bookkeeping().await.0, 2);

    // Mined: the chain's nonce is past it. Due again, but not sent; the look is recorded.
    t.chain.mine();
    assert!(t.chain.is_mined(cancel.hash));
    make_due().await;
    t.drive_recovery().await;
    assert_eq!(sent(), 2, "not sent once its nonce is used");
    assert_eq!(bookkeeping().await, (2, true, true));

    // Its transaction mined again (a receipt, as the confirmation manager records it): no
    // longer due at all.
    sqlx::query(
        "UPDATE managed_tx SET receipt = '{}'::jsonb, mined_block_number = 1,
                mined_block_hash = '0x0000000000000000000000000000000000000000000000000000000000000001'
         WHERE tx_id = $1",
    )
    .bind(original.tx_id)
    .execute(t.pool())
    .await
    .expect("mined again");
    make_due().await;
    let due = txflow_broadcaster::store::due_cancellations(t.pool(), t.lease.key())
        .await
        .expect("due cancellations");
    assert!(due.is_empty(), "{due:?}");

    // No state moved, no event written: the confirmation manager re-evaluates from the chain.
    assert_eq!(t.state(&original).await, "CONFIRMED");
    assert!(t.events(&original).await.is_empty());
}

#[tokio::test]
async fn a_gap_of_several_nonces_below_what_was_sent_is_closed_by_one_recovery_drive() {
    let t = Tier::new().await;
    let mut seeded = Vec::new();
    for nonce in 0..3 {
        seeded.push(t.seed_signed(nonce).await);
    }
    t.drive_ok().await;
    for s in &seeded {
        assert_eq!(t.state(s).await, "SUBMITTED");
    }
    t.chain.mine();
    assert!(seeded.iter().all(|s| t.chain.is_mined(s.hash)));
    // The block goes, and its transactions with it: the chain's nonce is 0 again, nothing is
    // pending, and txflow's rows still say SUBMITTED up to nonce 2.
    t.chain.reorg(1);
    assert!(t.chain.pooled().is_empty());
    assert!(seeded.iter().all(|s| !t.chain.is_mined(s.hash)));
    let before = t.chain.sent().len();

    t.drive_recovery().await;
    let resent: Vec<Vec<u8>> = t.chain.sent().split_off(before);
    let expected: Vec<Vec<u8>> = seeded.iter().map(|s| s.raw.clone()).collect();
    assert_eq!(
        resent.len(),
        expected.len(),
        "every nonce of the gap is sent again in one drive"
    );
    assert_eq!(resent, expected, "the same signed bytes, in nonce order");
    t.chain.mine();
    assert!(
        seeded.iter().all(|s| t.chain.is_mined(s.hash)),
        "the gap is closed by the next block"
    );
}
