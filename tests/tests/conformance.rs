//! The stage conformance suite: what every stage must do, checked the same way for each, against
//! real PostgreSQL, broker and Schema Registry, with the scripted chain
//! (`txflow_tests::fake_chain`) in place of a node.
//!
//! 1. **Redelivery**: the same bytes produced twice re-emit outputs with the same `event_id`s
//!    and change nothing in PostgreSQL.
//! 2. **Poison**: undecodable bytes and a well-formed message with an invalid field go to the
//!    dead-letter topic with an `error.code`, write nothing, and the next message is processed.
//! 3. **Fencing**: a writer whose lease was stolen writes nothing (neither `handle` in a
//!    transaction opened before the steal, nor `drive`); the new owner does the work, under its
//!    own token.
//! 4. **Recovery**: work recorded in PostgreSQL with no message at all is driven on by the
//!    recovery scan.
//!
//! Each stage plugs in with one [`Fixture`]: how to build it, a valid message, a poison message,
//! how to record work in its input state, and what "driven" means. A new stage adds a fixture and
//! one `conformance!` line.
//!
//! Waiting is by condition with a deadline, never by sleeping. "Everything before this was
//! processed" is a barrier: undecodable marker messages on the signer's key (so on the same
//! partition, after what came before), each produced once the previous one reached the
//! dead-letter topic — the runtime processes batches one after the other, the drives of a batch
//! included, so the second marker's dead letter comes after everything sent before the first.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use alloy::primitives::{Bytes, U256};
use alloy::signers::local::PrivateKeySigner;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use txflow_core::chain::{UnsignedTx, sign};
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::domain::{ChainId, NodeId, Signer, TxPayload};
use txflow_core::events::{Event, TxAllocated, TxRequest, TxSigned, TxSubmitted};
use txflow_core::kafka::{KafkaSettings, Topics, delete_topics, ensure_topics, signer_key};
use txflow_core::lease::{Acquisition, LeaseConfig, LeaseManager};
use txflow_core::policy::Policy;
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output, StageConfig, StageRuntime};
use txflow_tests::fake_chain::FakeChain;
use txflow_tests::test_stage::{TestStage, create_external_system};
use txflow_tests::{TestDb, group_consumer, kafka_settings, producer, registry_url, unique};

const LONG: Duration = Duration::from_secs(90);
const CHAIN_ID: i64 = 31337;
const PARTITIONS: i32 = 2;
const SINK: &str = "0x000000000000000000000000000000000000dead";
const MAX_FEE: u128 = 2_000_000_000;
const TIP: u128 = 1_000_000_000;

/// The request id of work item `n`.
fn request_id(n: u32) -> String {
    format!("conformance-{n}")
}

// ---------------------------------------------------------------------------------------------
// The environment of one check.
// ---------------------------------------------------------------------------------------------

/// Reads topics from their beginning (assigned, no group membership), keeping what it saw.
struct Collector {
    consumer: StreamConsumer,
    seen: Vec<OwnedMessage>,
}

impl Collector {
    fn new(kafka: &KafkaSettings, topics: &[String]) -> Collector {
        let consumer = group_consumer(kafka, &unique("conformance-read"));
        let mut list = TopicPartitionList::new();
        for t in topics {
            for p in 0..PARTITIONS {
                list.add_partition_offset(t, p, Offset::Beginning)
                    .expect("partition");
            }
        }
        consumer.assign(&list).expect("assign");
        Collector {
            consumer,
            seen: Vec::new(),
        }
    }

    /// Receives until `done` holds for what was seen, or panics after [`LONG`].
    async fn until(&mut self, what: &str, done: impl Fn(&[OwnedMessage]) -> bool) {
        let deadline = tokio::time::Instant::now() + LONG;
        while !done(&self.seen) {
            match tokio::time::timeout_at(deadline, self.consumer.recv()).await {
                Ok(Ok(m)) => self.seen.push(m.detach()),
                Ok(Err(e)) => panic!("consuming while waiting until {what}: {e}"),
                Err(_) => panic!(
                    "timed out after {LONG:?} waiting until {what} ({} messages seen)",
                    self.seen.len()
                ),
            }
        }
    }
}

fn header(m: &OwnedMessage, key: &str) -> Option<String> {
    m.headers().and_then(|h| {
        h.iter()
            .find(|x| x.key == key)
            .and_then(|x| x.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    })
}

/// `(tx_id, request_id, state, nonce, fencing_token)` of a managed transaction.
type TxRow = (uuid::Uuid, String, String, Option<i64>, Option<i64>);

/// A stage runtime running in this process.
struct Running {
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

/// Database, topics, clients, the fake chain and the signer of one check.
struct Env {
    db: TestDb,
    topics: Topics,
    chain: Arc<FakeChain>,
    key: PrivateKeySigner,
    kafka: KafkaSettings,
    codec: RegistryCodec,
    producer: FutureProducer,
    input: String,
    created: Vec<String>,
    outputs: Collector,
    dlq: Collector,
    running: Option<Running>,
}

impl Env {
    async fn new<F: Fixture>() -> Env {
        let db = TestDb::new().await;
        let kafka = kafka_settings();
        let topics = Topics::new(unique(&format!("conf-{}", F::NAME)));
        let input = F::input_topic(&topics);
        let outputs = F::output_topics(&topics);
        let mut created = vec![input.clone(), topics.dlq()];
        created.extend(outputs.iter().cloned());
        ensure_topics(&kafka, &created, PARTITIONS)
            .await
            .expect("topics");
        let env = Env {
            chain: Arc::new(FakeChain::new()),
            key: PrivateKeySigner::random(),
            codec: RegistryCodec::new(registry_url()),
            producer: producer(&kafka),
            outputs: Collector::new(&kafka, &outputs),
            dlq: Collector::new(&kafka, &[topics.dlq()]),
            db,
            topics,
            kafka,
            input,
            created,
            running: None,
        };
        F::prepare(&env).await;
        env
    }

    /// The signer under test, lowercase 0x-hex.
    fn signer(&self) -> String {
        format!("{:#x}", self.key.address())
    }

    fn signer_key(&self) -> String {
        signer_key(CHAIN_ID, &self.signer())
    }

    /// Starts `F`'s stage on the stage runtime, with a recovery scan every `recovery_interval`.
    fn start<F: Fixture>(&mut self, pool: PgPool, recovery_interval: Duration) {
        let stage = F::stage(self);
        let role = stage.role();
        let mut config = StageConfig::new(unique("conformance"), self.topics.dlq());
        config.partitions = PARTITIONS;
        config.topics = F::output_topics(&self.topics);
        config.recovery_interval = recovery_interval;
        config.retry_backoff = Duration::from_millis(100);
        let mut kafka = self.kafka.clone();
        kafka.session_timeout_ms = 6_000;
        let leases = LeaseManager::new(
            pool.clone(),
            role,
            NodeId::named(unique("conformance")),
            LeaseConfig::default(),
        )
        .expect("lease manager");
        let runtime = StageRuntime::new(
            stage,
            pool,
            RegistryCodec::new(registry_url()),
            kafka,
            leases,
            config,
        );
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let task = tokio::spawn(async move { runtime.run(token).await.expect("the stage runs") });
        self.running = Some(Running { shutdown, task });
    }

    /// Stops the stage and the readers, then deletes the topics (never under a live client).
    async fn finish(mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown.cancel();
            tokio::time::timeout(LONG, r.task)
                .await
                .expect("the stage stops")
                .expect("the stage task");
        }
        let Env {
            kafka,
            created,
            outputs,
            dlq,
            producer,
            ..
        } = self;
        drop((outputs, dlq, producer));
        let _ =
            tokio::time::timeout(Duration::from_secs(10), delete_topics(&kafka, &created)).await;
    }

    /// `input` as the stage's input topic carries it.
    async fn encode<E: Event>(&self, input: &E) -> Vec<u8> {
        self.codec
            .encode(&self.input, Subjects::TopicName, input)
            .await
            .expect("encode")
    }

    /// Produces `bytes` on the input topic under the signer's key.
    async fn send(&self, bytes: &[u8]) {
        let key = self.signer_key();
        self.producer
            .send(
                FutureRecord::to(&self.input).key(&key).payload(bytes),
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
    }

    /// Returns once everything produced on the signer's key before it has been processed
    /// (handled, committed, announced and driven): see the module's documentation.
    async fn barrier(&mut self) {
        for _ in 0..2 {
            let mark = format!("barrier-{}", uuid::Uuid::new_v4()).into_bytes();
            self.send(&mark).await;
            self.dlq
                .until("a barrier marker was dead-lettered", |seen| {
                    seen.iter().any(|m| m.payload() == Some(mark.as_slice()))
                })
                .await;
        }
    }

    /// Waits until at least `n` outputs arrived; returns their `(topic, event_id)`s.
    async fn outputs(&mut self, n: usize) -> Vec<(String, String)> {
        self.outputs
            .until(&format!("{n} outputs arrived"), |seen| seen.len() >= n)
            .await;
        self.outputs
            .seen
            .iter()
            .map(|m| {
                let id = header(m, "event_id")
                    .unwrap_or_else(|| panic!("an output on {} without event_id", m.topic()));
                (m.topic().to_string(), id)
            })
            .collect()
    }

    /// How many of these event ids PostgreSQL recorded in tx_events.
    async fn recorded(&self, ids: &BTreeSet<String>) -> usize {
        let ids: Vec<uuid::Uuid> = ids
            .iter()
            .map(|s| uuid::Uuid::parse_str(s).expect("event ids are UUIDs"))
            .collect();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tx_events WHERE event_id = ANY($1)")
            .bind(&ids)
            .fetch_one(&self.db.pool)
            .await
            .expect("count events");
        n as usize
    }

    /// What PostgreSQL holds that a stage may change.
    async fn snapshot(&self) -> String {
        let pool = &self.db.pool;
        let txs: Vec<TxRow> = sqlx::query_as(
            "SELECT tx_id, request_id, state, nonce, fencing_token FROM managed_tx ORDER BY tx_id",
        )
        .fetch_all(pool)
        .await
        .expect("managed_tx");
        let events: i64 = sqlx::query_scalar("SELECT count(*) FROM tx_events")
            .fetch_one(pool)
            .await
            .expect("tx_events");
        let attempts: Vec<(uuid::Uuid, i32, String)> =
            sqlx::query_as("SELECT tx_id, attempt, tx_hash FROM tx_attempts ORDER BY 1, 2")
                .fetch_all(pool)
                .await
                .expect("tx_attempts");
        let cursors: Vec<(i64, String, i64, i64)> = sqlx::query_as(
            "SELECT chain_id, signer, next_nonce, fencing_token FROM signer_nonce_cursor ORDER BY 1, 2",
        )
        .fetch_all(pool)
        .await
        .expect("signer_nonce_cursor");
        let recycled: i64 = sqlx::query_scalar("SELECT count(*) FROM recycled_nonces")
            .fetch_one(pool)
            .await
            .expect("recycled_nonces");
        format!(
            "managed_tx: {txs:#?}\ntx_events: {events}\ntx_attempts: {attempts:?}\n\
             cursors: {cursors:?}\nrecycled nonces: {recycled}"
        )
    }

    /// The state of work item `n`, if it is recorded.
    async fn state(&self, n: u32) -> Option<String> {
        sqlx::query_scalar(
            "SELECT state FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND request_id = $3",
        )
        .bind(CHAIN_ID)
        .bind(self.signer())
        .bind(request_id(n))
        .fetch_optional(&self.db.pool)
        .await
        .expect("state")
    }

    /// The fencing token work item `n` was last written under.
    async fn token_of(&self, n: u32) -> Option<i64> {
        sqlx::query_scalar(
            "SELECT fencing_token FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND request_id = $3",
        )
        .bind(CHAIN_ID)
        .bind(self.signer())
        .bind(request_id(n))
        .fetch_optional(&self.db.pool)
        .await
        .expect("token")
        .flatten()
    }

    /// The transaction of work item `n`, as the signer gateway would sign it.
    fn unsigned(&self, n: u32) -> UnsignedTx {
        UnsignedTx {
            chain_id: CHAIN_ID as u64,
            nonce: n as u64,
            to: SINK.parse().expect("sink"),
            value: U256::from(1),
            data: Bytes::new(),
            gas_limit: 21_000,
            max_fee_per_gas: MAX_FEE,
            max_priority_fee_per_gas: TIP,
        }
    }

    /// Records work item `n` directly (unfenced: test setup) in `state`, with `nonce` and a full
    /// payload (fees and gas included) or a requested one (as the allocator records a request).
    async fn record(&self, n: u32, state: &str, nonce: Option<i64>, full: bool) -> uuid::Uuid {
        let payload = TxPayload {
            to: SINK.into(),
            value: "1".into(),
            data: "0x".into(),
            gas_limit: full.then_some(21_000),
            max_fee_per_gas: full.then(|| MAX_FEE.to_string()),
            max_priority_fee_per_gas: full.then(|| TIP.to_string()),
        };
        let tx_id = uuid::Uuid::now_v7();
        sqlx::query(
            "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(tx_id)
        .bind(CHAIN_ID)
        .bind(self.signer())
        .bind(request_id(n))
        .bind(nonce)
        .bind(serde_json::to_value(&payload).expect("payload"))
        .bind(state)
        .execute(&self.db.pool)
        .await
        .unwrap_or_else(|e| panic!("record work {n} in {state}: {e}"));
        tx_id
    }

    /// Records work item `n` as the signer gateway leaves it: SIGNED at nonce `n`, attempt 1
    /// with the raw transaction. Returns the TxSigned that announces it.
    async fn record_signed(&self, n: u32) -> TxSigned {
        let tx_id = self.record(n, "SIGNED", Some(n as i64), true).await;
        let signed = sign(&self.key, &self.unsigned(n)).expect("sign");
        let hash = format!("{:#x}", signed.hash);
        sqlx::query(
            "INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas, max_priority_fee_per_gas)
             VALUES ($1, 1, $2, $3, $4::numeric, $5::numeric)",
        )
        .bind(tx_id)
        .bind(&hash)
        .bind(&signed.raw)
        .bind(MAX_FEE.to_string())
        .bind(TIP.to_string())
        .execute(&self.db.pool)
        .await
        .expect("record the attempt");
        TxSigned {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            chain_id: CHAIN_ID,
            signer: self.signer(),
            nonce: n as i64,
            attempt: 1,
            tx_hash: hash,
            raw_tx: signed.raw,
            max_fee_per_gas: MAX_FEE.to_string(),
            max_priority_fee_per_gas: TIP.to_string(),
            fencing_token: 0,
        }
    }

    /// Whether the fake chain received work item `n`'s raw transaction.
    async fn chain_received(&self, n: u32) -> bool {
        let raw: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT a.raw_tx FROM tx_attempts a JOIN managed_tx m ON m.tx_id = a.tx_id
             WHERE m.chain_id = $1 AND m.signer = $2 AND m.request_id = $3
             ORDER BY a.attempt DESC LIMIT 1",
        )
        .bind(CHAIN_ID)
        .bind(self.signer())
        .bind(request_id(n))
        .fetch_optional(&self.db.pool)
        .await
        .expect("raw transaction");
        raw.is_some_and(|raw| self.chain.sent().contains(&raw))
    }
}

// ---------------------------------------------------------------------------------------------
// What a stage provides to be checked.
// ---------------------------------------------------------------------------------------------

type Input<F> = <<F as Fixture>::Stage as Handler>::Input;

/// One stage under the conformance checks.
trait Fixture: Send + Sync + 'static {
    type Stage: Handler;
    const NAME: &'static str;
    /// Outputs of one valid message on its first delivery (handled, then driven).
    const FIRST_OUTPUTS: usize;
    /// Outputs of its redelivery (a stage that re-emits on a duplicate: the same event again).
    const REDELIVERED_OUTPUTS: usize;
    /// Outputs of driving one work item recorded with [`Fixture::record`].
    const RECOVERED_OUTPUTS: usize;

    fn input_topic(topics: &Topics) -> String;
    fn output_topics(topics: &Topics) -> Vec<String>;
    /// The stage, on `env`'s topics and fake chain.
    fn stage(env: &Env) -> Self::Stage;
    /// What the stage needs besides the migrations.
    fn prepare(_env: &Env) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// A valid message about work item `n`, after recording what it refers to (if anything).
    fn message(env: &Env, n: u32) -> impl Future<Output = Input<Self>> + Send;
    /// A well-formed message with an invalid field, and the `error.code` it is dead-lettered with.
    fn poison(env: &Env) -> (Input<Self>, &'static str);
    /// Records work item `n` in the stage's input state, with no message.
    fn record(env: &Env, n: u32) -> impl Future<Output = ()> + Send;
    /// Whether work item `n` has moved on from the stage's input state.
    fn driven(env: &Env, n: u32) -> impl Future<Output = bool> + Send;
}

fn request(n: u32, signer: &str) -> TxRequest {
    TxRequest {
        event_id: uuid::Uuid::new_v4().to_string(),
        request_id: request_id(n),
        chain_id: CHAIN_ID,
        signer: signer.to_string(),
        to: SINK.into(),
        value: "1".into(),
        data: Vec::new(),
        gas_limit: None,
        max_fee_per_gas: None,
        max_priority_fee_per_gas: None,
        metadata: Default::default(),
        depends_on_request_id: None,
        depends_on_signer: None,
        submitted_by: None,
    }
}

/// The allocator's request stage: TxRequest → RECEIVED → (simulated) → ALLOCATED.
struct Allocator;

impl Fixture for Allocator {
    type Stage = txflow_allocator::RequestStage;
    const NAME: &'static str = "allocator";
    const FIRST_OUTPUTS: usize = 2; // TxAccepted, TxAllocated
    const REDELIVERED_OUTPUTS: usize = 1; // TxAccepted again
    const RECOVERED_OUTPUTS: usize = 1; // TxAllocated

    fn input_topic(topics: &Topics) -> String {
        topics.tx_requests()
    }
    fn output_topics(topics: &Topics) -> Vec<String> {
        vec![topics.tx_outcomes(), topics.tx_allocated()]
    }
    fn stage(env: &Env) -> Self::Stage {
        txflow_allocator::RequestStage {
            config: txflow_allocator::AllocatorConfig {
                topics: env.topics.clone(),
                policy: Policy::default(),
                chain_id: ChainId(CHAIN_ID),
                nonce_state_timeout: Duration::from_secs(30),
                confirmations_required: 1,
                max_in_flight: txflow_core::config::DEFAULT_MAX_IN_FLIGHT,
                approval_timeout: Duration::from_millis(
                    txflow_core::config::DEFAULT_APPROVAL_TIMEOUT_MS,
                ),
                approval_after_deep_reorg: false,
            },
            chain: env.chain.clone(),
        }
    }
    async fn message(env: &Env, n: u32) -> TxRequest {
        request(n, &env.signer())
    }
    fn poison(_env: &Env) -> (TxRequest, &'static str) {
        (request(999, "0xnot-an-address"), "INVALID_SIGNER")
    }
    async fn record(env: &Env, n: u32) {
        env.record(n, "RECEIVED", None, false).await;
    }
    async fn driven(env: &Env, n: u32) -> bool {
        env.state(n).await.as_deref() == Some("ALLOCATED")
    }
}

/// The signer gateway: ALLOCATED (TxAllocated) → SIGNED.
struct SignerGateway;

impl SignerGateway {
    fn allocated(tx_id: uuid::Uuid, n: u32, signer: &str) -> TxAllocated {
        TxAllocated {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            request_id: request_id(n),
            chain_id: CHAIN_ID,
            signer: signer.to_string(),
            nonce: n as i64,
            to: SINK.into(),
            value: "1".into(),
            data: Vec::new(),
            gas_limit: 21_000,
            max_fee_per_gas: MAX_FEE.to_string(),
            max_priority_fee_per_gas: TIP.to_string(),
            fencing_token: 0,
        }
    }
}

impl Fixture for SignerGateway {
    type Stage = txflow_signer_gateway::SignStage;
    const NAME: &'static str = "signer-gateway";
    const FIRST_OUTPUTS: usize = 1; // TxSigned
    const REDELIVERED_OUTPUTS: usize = 1; // the same TxSigned again
    const RECOVERED_OUTPUTS: usize = 1; // TxSigned

    fn input_topic(topics: &Topics) -> String {
        topics.tx_allocated()
    }
    fn output_topics(topics: &Topics) -> Vec<String> {
        vec![topics.tx_signed(), topics.tx_outcomes()]
    }
    fn stage(env: &Env) -> Self::Stage {
        txflow_signer_gateway::SignStage::new(
            txflow_signer_gateway::SignerConfig {
                chain_id: ChainId(CHAIN_ID),
                topics: env.topics.clone(),
                policy: Policy::default(),
            },
            txflow_signer_gateway::Keys::from_signers([env.key.clone()]),
        )
    }
    async fn message(env: &Env, n: u32) -> TxAllocated {
        let tx_id = env.record(n, "ALLOCATED", Some(n as i64), true).await;
        SignerGateway::allocated(tx_id, n, &env.signer())
    }
    fn poison(_env: &Env) -> (TxAllocated, &'static str) {
        (
            SignerGateway::allocated(uuid::Uuid::now_v7(), 999, "0xnot-an-address"),
            "INVALID_SIGNER",
        )
    }
    async fn record(env: &Env, n: u32) {
        env.record(n, "ALLOCATED", Some(n as i64), true).await;
    }
    async fn driven(env: &Env, n: u32) -> bool {
        env.state(n).await.as_deref() == Some("SIGNED")
    }
}

/// The broadcaster: SIGNED (TxSigned) → sent to the chain → SUBMITTED.
struct Broadcaster;

impl Fixture for Broadcaster {
    type Stage = txflow_broadcaster::BroadcastStage;
    const NAME: &'static str = "broadcaster";
    const FIRST_OUTPUTS: usize = 2; // TxSubmitted, and its copy on tx.outcomes
    const REDELIVERED_OUTPUTS: usize = 0; // handled before: nothing is SIGNED any more
    const RECOVERED_OUTPUTS: usize = 2; // TxSubmitted, and its copy on tx.outcomes

    fn input_topic(topics: &Topics) -> String {
        topics.tx_signed()
    }
    fn output_topics(topics: &Topics) -> Vec<String> {
        vec![topics.tx_submitted(), topics.tx_outcomes()]
    }
    fn stage(env: &Env) -> Self::Stage {
        txflow_broadcaster::BroadcastStage {
            config: txflow_broadcaster::BroadcasterConfig {
                chain_id: ChainId(CHAIN_ID),
                topics: env.topics.clone(),
                // Not within a check: resubmissions would change what the checks compare.
                resubmit_interval: Duration::from_secs(3600),
                confirmations_required: 1,
            },
            chain: env.chain.clone(),
        }
    }
    async fn message(env: &Env, n: u32) -> TxSigned {
        env.record_signed(n).await
    }
    fn poison(_env: &Env) -> (TxSigned, &'static str) {
        let signed = TxSigned {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: uuid::Uuid::now_v7().to_string(),
            chain_id: CHAIN_ID,
            signer: "0xnot-an-address".into(),
            nonce: 0,
            attempt: 1,
            tx_hash: format!("{:#x}", alloy::primitives::B256::ZERO),
            raw_tx: vec![1, 2, 3],
            max_fee_per_gas: MAX_FEE.to_string(),
            max_priority_fee_per_gas: TIP.to_string(),
            fencing_token: 0,
        };
        (signed, "INVALID_SIGNER")
    }
    async fn record(env: &Env, n: u32) {
        env.record_signed(n).await;
    }
    async fn driven(env: &Env, n: u32) -> bool {
        env.state(n).await.as_deref() == Some("SUBMITTED") && env.chain_received(n).await
    }
}

/// The runtime's test stage: TxRequest → RECEIVED → (external call) → SIMULATED.
struct TestStageFixture;

impl Fixture for TestStageFixture {
    type Stage = TestStage;
    const NAME: &'static str = "test-stage";
    const FIRST_OUTPUTS: usize = 1; // TxAccepted
    const REDELIVERED_OUTPUTS: usize = 1; // TxAccepted again
    const RECOVERED_OUTPUTS: usize = 0; // the external call's result is recorded, not announced

    fn input_topic(topics: &Topics) -> String {
        topics.tx_requests()
    }
    fn output_topics(topics: &Topics) -> Vec<String> {
        vec![topics.tx_outcomes()]
    }
    fn stage(env: &Env) -> Self::Stage {
        TestStage {
            input: env.topics.tx_requests(),
            outcomes: env.topics.tx_outcomes(),
        }
    }
    async fn prepare(env: &Env) {
        create_external_system(&env.db.pool)
            .await
            .expect("the test stage's external system");
    }
    async fn message(env: &Env, n: u32) -> TxRequest {
        request(n, &env.signer())
    }
    fn poison(_env: &Env) -> (TxRequest, &'static str) {
        (request(999, "0xnot-an-address"), "INVALID_SIGNER")
    }
    async fn record(env: &Env, n: u32) {
        env.record(n, "RECEIVED", None, false).await;
    }
    async fn driven(env: &Env, n: u32) -> bool {
        env.state(n).await.as_deref() == Some("SIMULATED")
    }
}

/// The receipt checker: SUBMITTED (TxSubmitted) → its receipt looked up on the chain → MINED,
/// with the receipt recorded and TxReceiptUpdated announced.
struct ReceiptChecker;

impl ReceiptChecker {
    /// Records work item `n` as the broadcaster leaves it (SUBMITTED at nonce `n`, attempt 1),
    /// mined on the fake chain (the signer's lower nonces used by other transactions first).
    /// Returns the TxSubmitted that announces it.
    async fn submitted_and_mined(env: &Env, n: u32) -> TxSubmitted {
        use txflow_core::chain::ChainClient as _;
        let signed = env.record_signed(n).await;
        sqlx::query("UPDATE managed_tx SET state = 'SUBMITTED' WHERE tx_id = $1::uuid")
            .bind(&signed.tx_id)
            .execute(&env.db.pool)
            .await
            .expect("record the submission");
        if n > 0 {
            env.chain
                .use_nonce_elsewhere(env.key.address(), u64::from(n) - 1);
        }
        env.chain.send_raw(&signed.raw_tx).await.expect("pooled");
        env.chain.mine();
        ReceiptChecker::submitted(&signed.tx_id, n, &env.signer(), &signed.tx_hash)
    }

    fn submitted(tx_id: &str, n: u32, signer: &str, tx_hash: &str) -> TxSubmitted {
        TxSubmitted {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            chain_id: CHAIN_ID,
            signer: signer.to_string(),
            nonce: n as i64,
            attempt: 1,
            tx_hash: tx_hash.to_string(),
            outcome: txflow_core::events::SubmitOutcome::Accepted,
            submitted_at_ms: 0,
            fencing_token: 0,
        }
    }
}

impl Fixture for ReceiptChecker {
    type Stage = txflow_receipt_checker::ReceiptStage;
    const NAME: &'static str = "receipt-checker";
    const FIRST_OUTPUTS: usize = 2; // TxReceiptUpdated, and its copy on tx.outcomes
    const REDELIVERED_OUTPUTS: usize = 0; // handled before: nothing is SUBMITTED any more
    const RECOVERED_OUTPUTS: usize = 2; // TxReceiptUpdated, and its copy on tx.outcomes

    fn input_topic(topics: &Topics) -> String {
        topics.tx_submitted()
    }
    fn output_topics(topics: &Topics) -> Vec<String> {
        vec![topics.tx_receipts(), topics.tx_outcomes()]
    }
    fn stage(env: &Env) -> Self::Stage {
        txflow_receipt_checker::ReceiptStage::new(
            txflow_receipt_checker::ReceiptCheckerConfig {
                chain_id: ChainId(CHAIN_ID),
                topics: env.topics.clone(),
                workers: 4,
                stale_receipt_timeout: Duration::from_secs(3600),
                poll_min: Duration::from_millis(100),
                poll_max: Duration::from_millis(100),
                confirmations_required: 1,
            },
            env.chain.clone(),
        )
    }
    async fn message(env: &Env, n: u32) -> TxSubmitted {
        ReceiptChecker::submitted_and_mined(env, n).await
    }
    fn poison(_env: &Env) -> (TxSubmitted, &'static str) {
        let hash = format!("{:#x}", alloy::primitives::B256::ZERO);
        (
            ReceiptChecker::submitted(
                &uuid::Uuid::now_v7().to_string(),
                0,
                "0xnot-an-address",
                &hash,
            ),
            "INVALID_SIGNER",
        )
    }
    async fn record(env: &Env, n: u32) {
        ReceiptChecker::submitted_and_mined(env, n).await;
    }
    async fn driven(env: &Env, n: u32) -> bool {
        let mined: Option<(String, Option<i32>, Option<String>)> = sqlx::query_as(
            "SELECT state, (receipt->>'attempt')::int, mined_block_hash FROM managed_tx
             WHERE chain_id = $1 AND signer = $2 AND request_id = $3",
        )
        .bind(CHAIN_ID)
        .bind(env.signer())
        .bind(request_id(n))
        .fetch_optional(&env.db.pool)
        .await
        .expect("receipt");
        mined.is_some_and(|(state, attempt, block)| {
            state == "MINED" && attempt == Some(1) && block.is_some()
        })
    }
}

/// The confirmation manager: MINED (TxReceiptUpdated) → its block followed on the chain → its
/// list announced and, at the required depth (one block here), CONFIRMED with TxConfirmed.
struct ConfirmationManager;

impl ConfirmationManager {
    /// Records work item `n` as the receipt checker leaves it: MINED at nonce `n`, attempt 1, in
    /// a block of the fake chain (the signer's lower nonces used by other transactions first),
    /// its receipt recorded. Returns the TxReceiptUpdated that announces it.
    async fn mined(env: &Env, n: u32) -> txflow_core::events::TxReceiptUpdated {
        use txflow_core::chain::ChainClient as _;
        let signed = env.record_signed(n).await;
        if n > 0 {
            env.chain
                .use_nonce_elsewhere(env.key.address(), u64::from(n) - 1);
        }
        env.chain.send_raw(&signed.raw_tx).await.expect("pooled");
        env.chain.mine();
        let hash: alloy::primitives::B256 = signed.tx_hash.parse().expect("hash");
        let r = env
            .chain
            .receipt(hash)
            .await
            .expect("receipt")
            .expect("mined");
        let block_hash = format!("{:#x}", r.block_hash);
        let receipt = serde_json::json!({
            "attempt": 1, "tx_hash": signed.tx_hash, "block_number": r.block_number,
            "block_hash": block_hash, "status": 1, "gas_used": r.gas_used,
            "effective_gas_price": r.effective_gas_price.to_string(),
        });
        sqlx::query(
            "UPDATE managed_tx SET state = 'MINED', receipt = $2, mined_block_number = $3,
                    mined_block_hash = $4 WHERE tx_id = $1::uuid",
        )
        .bind(&signed.tx_id)
        .bind(receipt)
        .bind(r.block_number as i64)
        .bind(&block_hash)
        .execute(&env.db.pool)
        .await
        .expect("record the receipt");
        ConfirmationManager::receipt_updated(&signed.tx_id, n, &env.signer(), Some(&block_hash))
    }

    fn receipt_updated(
        tx_id: &str,
        n: u32,
        signer: &str,
        block_hash: Option<&str>,
    ) -> txflow_core::events::TxReceiptUpdated {
        txflow_core::events::TxReceiptUpdated {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            chain_id: CHAIN_ID,
            signer: signer.to_string(),
            nonce: n as i64,
            status: txflow_core::events::ReceiptStatus::Mined,
            tx_hash: None,
            block_number: None,
            block_hash: block_hash.map(str::to_string),
            gas_used: None,
            effective_gas_price: None,
            fencing_token: 0,
        }
    }
}

impl Fixture for ConfirmationManager {
    type Stage = txflow_confirmation_manager::ConfirmStage;
    const NAME: &'static str = "confirmation-manager";
    const FIRST_OUTPUTS: usize = 2; // TxConfirmationsUpdated, TxConfirmed
    const REDELIVERED_OUTPUTS: usize = 1; // the same TxConfirmed again
    const RECOVERED_OUTPUTS: usize = 2; // TxConfirmationsUpdated, TxConfirmed

    fn input_topic(topics: &Topics) -> String {
        topics.tx_receipts()
    }
    fn output_topics(topics: &Topics) -> Vec<String> {
        vec![topics.tx_confirmations(), topics.tx_outcomes()]
    }
    fn stage(env: &Env) -> Self::Stage {
        txflow_confirmation_manager::ConfirmStage::new(
            txflow_confirmation_manager::ConfirmationConfig {
                chain_id: ChainId(CHAIN_ID),
                topics: env.topics.clone(),
                required: 1,
                watch_blocks: 64,
                poll_interval: Duration::from_millis(200),
                // Not within a check: a resubmission would change what the checks compare.
                resubmit_interval: Duration::from_secs(3600),
            },
            env.chain.clone(),
        )
    }
    async fn message(env: &Env, n: u32) -> txflow_core::events::TxReceiptUpdated {
        ConfirmationManager::mined(env, n).await
    }
    fn poison(_env: &Env) -> (txflow_core::events::TxReceiptUpdated, &'static str) {
        (
            ConfirmationManager::receipt_updated(
                &uuid::Uuid::now_v7().to_string(),
                0,
                "0xnot-an-address",
                None,
            ),
            "INVALID_SIGNER",
        )
    }
    async fn record(env: &Env, n: u32) {
        ConfirmationManager::mined(env, n).await;
    }
    async fn driven(env: &Env, n: u32) -> bool {
        env.state(n).await.as_deref() == Some("CONFIRMED")
    }
}

// ---------------------------------------------------------------------------------------------
// The checks.
// ---------------------------------------------------------------------------------------------

/// A recovery scan that does not run within a check (only the one on partition assignment).
const NO_PERIODIC_SCAN: Duration = Duration::from_secs(3600);

/// 1. The same bytes twice: the redelivery re-emits what the first delivery emitted (same
///    `event_id`s, nothing new) and changes nothing in PostgreSQL (nor on the chain).
async fn redelivery<F: Fixture>() {
    let mut env = Env::new::<F>().await;
    let pool = env.db.pool(4).await;
    env.start::<F>(pool, NO_PERIODIC_SCAN);
    // Running, assigned, and its assignment scan done: what follows is driven by messages only.
    env.barrier().await;

    let message = F::message(&env, 1).await;
    let bytes = env.encode(&message).await;
    env.send(&bytes).await;
    wait_driven::<F>(&env, 1, "the first delivery was driven").await;
    let first = env.outputs(F::FIRST_OUTPUTS).await;
    env.barrier().await;
    let before = env.snapshot().await;
    let sends = env.chain.calls("send_raw");

    env.send(&bytes).await;
    env.barrier().await;
    let after = env.snapshot().await;
    assert_eq!(
        before,
        after,
        "{}: a redelivered message changed PostgreSQL",
        F::NAME
    );
    assert_eq!(
        env.chain.calls("send_raw"),
        sends,
        "{}: a redelivered message was sent to the chain again",
        F::NAME
    );

    let all = env.outputs(F::FIRST_OUTPUTS + F::REDELIVERED_OUTPUTS).await;
    let ids = |outs: &[(String, String)]| -> BTreeSet<String> {
        outs.iter().map(|(_, id)| id.clone()).collect()
    };
    // Every output once: distinct (topic, event_id) pairs (a submission or a receipt is one
    // event on two topics, its own and tx.outcomes).
    assert_eq!(
        first.iter().collect::<BTreeSet<_>>().len(),
        F::FIRST_OUTPUTS,
        "{}: first outputs {first:?}",
        F::NAME
    );
    assert_eq!(
        ids(&all),
        ids(&first),
        "{}: the redelivery emitted new event_ids: first {first:?}, all {all:?}",
        F::NAME
    );
    if F::REDELIVERED_OUTPUTS > 0 {
        let again = &all[first.len()..];
        assert!(
            again.iter().all(|o| first.contains(o)),
            "{}: re-emitted {again:?}, first {first:?}",
            F::NAME
        );
    }
    assert_eq!(
        env.recorded(&ids(&all)).await,
        ids(&all).len(),
        "{}: every output is an event PostgreSQL recorded",
        F::NAME
    );
    env.finish().await;
}

/// 2. Undecodable bytes and a message with an invalid field are dead-lettered with their
///    `error.code` (and the source's coordinates), write nothing, and a later message is processed.
async fn poison<F: Fixture>() {
    let mut env = Env::new::<F>().await;
    let pool = env.db.pool(4).await;
    env.start::<F>(pool, NO_PERIODIC_SCAN);
    env.barrier().await;
    let before = env.snapshot().await;

    let garbage = format!("not avro {}", uuid::Uuid::new_v4()).into_bytes();
    let (invalid, code) = F::poison(&env);
    let invalid = env.encode(&invalid).await;
    env.send(&garbage).await;
    env.send(&invalid).await;
    env.barrier().await;
    assert_eq!(
        env.snapshot().await,
        before,
        "{}: a poison message wrote to PostgreSQL",
        F::NAME
    );
    let dead = |bytes: &[u8]| -> OwnedMessage {
        env.dlq
            .seen
            .iter()
            .find(|m| m.payload() == Some(bytes))
            .cloned()
            .unwrap_or_else(|| panic!("{}: a poison message was not dead-lettered", F::NAME))
    };
    for (bytes, expected) in [(&garbage, "UNDECODABLE"), (&invalid, code)] {
        let m = dead(bytes);
        assert_eq!(
            header(&m, "error.code").as_deref(),
            Some(expected),
            "{}",
            F::NAME
        );
        assert_eq!(
            header(&m, "source.topic").as_deref(),
            Some(env.input.as_str())
        );
        assert!(header(&m, "source.offset").is_some());
        assert!(header(&m, "error.message").is_some_and(|s| !s.is_empty()));
    }

    // The stage moved on.
    let message = F::message(&env, 1).await;
    let bytes = env.encode(&message).await;
    env.send(&bytes).await;
    wait_driven::<F>(&env, 1, "the message after the poison was driven").await;
    env.finish().await;
}

/// 3. A writer whose lease was stolen writes nothing, through `handle` (in a transaction opened
///    before the steal) or `drive`; the new owner does the work under its own token.
async fn fenced<F: Fixture>() {
    let env = Env::new::<F>().await;
    let pool = env.db.pool.clone();
    let stage = F::stage(&env);
    let message = F::message(&env, 1).await;
    F::record(&env, 2).await;

    let chain_id = ChainId(CHAIN_ID);
    let signer = Signer::parse(&env.signer()).expect("signer");
    let manager = |name: &str| {
        LeaseManager::new(
            pool.clone(),
            stage.role(),
            NodeId::named(format!("{name}-{}", uuid::Uuid::new_v4())),
            LeaseConfig::default(),
        )
        .expect("lease manager")
    };
    let (old_node, new_node) = (manager("old"), manager("new"));
    let held = |a: Acquisition| match a {
        Acquisition::Held(l, _) => l,
        busy => panic!("{}: lease not acquired: {busy:?}", F::NAME),
    };
    let old = held(
        old_node
            .acquire(chain_id, &signer)
            .await
            .expect("acquire the lease"),
    );
    let mut stale = old
        .begin(&pool)
        .await
        .expect("begin while the lease is ours");

    // Stolen: expired, then taken by another node.
    sqlx::query(
        "UPDATE signer_lease SET expires_at = now() - interval '1 hour'
         WHERE role = $1 AND chain_id = $2 AND signer = $3",
    )
    .bind(stage.role().to_string())
    .bind(CHAIN_ID)
    .bind(env.signer())
    .execute(&pool)
    .await
    .expect("expire the lease");
    let new = held(
        new_node
            .acquire(chain_id, &signer)
            .await
            .expect("steal the lease"),
    );
    assert!(
        new.token() > old.token(),
        "{}: a steal raises the token",
        F::NAME
    );

    let before = env.snapshot().await;
    let handled = stage.handle(&mut stale.writer(), &message).await;
    let outcome = match handled {
        Ok(outputs) => stale
            .commit()
            .await
            .map(|()| outputs.len())
            .map_err(|e| format!("{e:?}")),
        Err(e) => {
            let _ = stale.rollback().await;
            Err(format!("{e:?}"))
        }
    };
    match outcome {
        Err(e) => assert!(
            e.contains("Fenced"),
            "{}: the stale writer failed, but not as fenced: {e}",
            F::NAME
        ),
        Ok(n) => panic!(
            "{}: a stale writer's handle committed ({n} outputs)",
            F::NAME
        ),
    }
    let drove = stage
        .drive(DriveCtx {
            lease: &old,
            pool: &pool,
            recovery: true,
        })
        .await;
    match drove {
        Err(e) => assert!(
            format!("{e:?}").contains("Fenced"),
            "{}: the stale driver failed, but not as fenced: {e:?}",
            F::NAME
        ),
        Ok(outputs) => panic!(
            "{}: a stale driver succeeded with {} outputs",
            F::NAME,
            outputs.len()
        ),
    }
    assert_eq!(
        env.snapshot().await,
        before,
        "{}: a fenced writer changed PostgreSQL",
        F::NAME
    );
    let under_old: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM managed_tx WHERE fencing_token = $1)
              + (SELECT count(*) FROM signer_nonce_cursor WHERE fencing_token = $1)",
    )
    .bind(old.token().0)
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(
        under_old,
        0,
        "{}: rows written under the old token",
        F::NAME
    );

    // The new owner: the message, then the recorded work.
    let mut tx = new.begin(&pool).await.expect("begin as the new owner");
    stage
        .handle(&mut tx.writer(), &message)
        .await
        .unwrap_or_else(|e| panic!("{}: the new owner's handle: {e:?}", F::NAME));
    tx.commit().await.expect("the new owner commits");
    stage
        .drive(DriveCtx {
            lease: &new,
            pool: &pool,
            recovery: true,
        })
        .await
        .unwrap_or_else(|e| panic!("{}: the new owner's drive: {e:?}", F::NAME));
    for n in [1, 2] {
        assert!(
            F::driven(&env, n).await,
            "{}: work {n} was not driven by the new owner (state {:?})",
            F::NAME,
            env.state(n).await
        );
        assert_eq!(
            env.token_of(n).await,
            Some(new.token().0),
            "{}: work {n} is recorded under the new owner's token",
            F::NAME
        );
    }
    env.finish().await;
}

/// 4. Work recorded in PostgreSQL and announced by no message is driven on by the recovery scan.
async fn recovery<F: Fixture>() {
    let mut env = Env::new::<F>().await;
    F::record(&env, 1).await;
    F::record(&env, 2).await;
    let pool = env.db.pool(4).await;
    env.start::<F>(pool, Duration::from_millis(500));
    wait_driven::<F>(&env, 1, "recorded work 1 was driven by the recovery scan").await;
    wait_driven::<F>(&env, 2, "recorded work 2 was driven by the recovery scan").await;
    if F::RECOVERED_OUTPUTS > 0 {
        let outs = env.outputs(2 * F::RECOVERED_OUTPUTS).await;
        let ids: BTreeSet<String> = outs.into_iter().map(|(_, id)| id).collect();
        assert_eq!(
            env.recorded(&ids).await,
            ids.len(),
            "{}: what the recovery announced is recorded",
            F::NAME
        );
    }
    env.finish().await;
}

async fn wait_driven<F: Fixture>(env: &Env, n: u32, what: &str) {
    txflow_tests::wait_until(&format!("{}: {what}", F::NAME), LONG, || F::driven(env, n)).await;
}

/// Check 5: the same message twice in one batch (an event re-emitted upstream, both copies
/// fetched together) is applied once: both copies answer with the same announcement (same
/// `event_id`s), and a third copy in a later batch answers the same again and changes nothing.
async fn twice_in_one_batch<F: Fixture>() {
    let env = Env::new::<F>().await;
    let pool = env.db.pool.clone();
    let stage = F::stage(&env);
    let message = F::message(&env, 1).await;
    let signer = Signer::parse(&env.signer()).expect("signer");
    let manager = LeaseManager::new(
        pool.clone(),
        stage.role(),
        NodeId::named(format!("twice-{}", uuid::Uuid::new_v4())),
        LeaseConfig::default(),
    )
    .expect("lease manager");
    let lease = match manager
        .acquire(ChainId(CHAIN_ID), &signer)
        .await
        .expect("acquire the lease")
    {
        Acquisition::Held(l, _) => l,
        busy => panic!("{}: lease not acquired: {busy:?}", F::NAME),
    };
    let ids = |r: &Result<Vec<Output>, HandlerError>| -> Vec<String> {
        match r {
            Ok(outputs) => outputs.iter().map(|o| o.event_id.clone()).collect(),
            Err(e) => panic!("{}: a valid message failed: {e:?}", F::NAME),
        }
    };
    let mut tx = lease.begin(&pool).await.expect("begin");
    let both = stage
        .handle_batch(&mut tx.writer(), &[&message, &message])
        .await
        .unwrap_or_else(|e| panic!("{}: the batch failed: {e:?}", F::NAME));
    tx.commit().await.expect("commit");
    assert_eq!(both.len(), 2, "{}: one result per message", F::NAME);
    assert_eq!(
        ids(&both[0]),
        ids(&both[1]),
        "{}: both copies announce the same",
        F::NAME
    );
    let once = env.snapshot().await;

    let mut tx = lease.begin(&pool).await.expect("begin");
    let again = stage
        .handle_batch(&mut tx.writer(), &[&message])
        .await
        .unwrap_or_else(|e| panic!("{}: the later batch failed: {e:?}", F::NAME));
    tx.commit().await.expect("commit");
    assert_eq!(
        ids(&again[0]),
        ids(&both[0]),
        "{}: a later copy too",
        F::NAME
    );
    assert_eq!(env.snapshot().await, once, "{}: nothing changed", F::NAME);
    env.finish().await;
}

macro_rules! conformance {
    ($stage:ident, $fixture:ty) => {
        mod $stage {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_redelivered_message_re_emits_the_same_event_ids_and_changes_nothing() {
                redelivery::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn poison_is_dead_lettered_with_a_code_and_the_stage_moves_on() {
                poison::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_fenced_writer_writes_nothing_and_the_new_owner_does_the_work() {
                fenced::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_recovery_scan_re_drives_recorded_work() {
                recovery::<$fixture>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_twice_in_one_batch_is_applied_once() {
                twice_in_one_batch::<$fixture>().await;
            }
        }
    };
}

conformance!(allocator, Allocator);
conformance!(signer_gateway, SignerGateway);
conformance!(broadcaster, Broadcaster);
conformance!(receipt_checker, ReceiptChecker);
conformance!(confirmation_manager, ConfirmationManager);
conformance!(test_stage, TestStageFixture);
