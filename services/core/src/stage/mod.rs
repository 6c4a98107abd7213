//! The stage runtime: the one loop every consumer service runs on (ARCHITECTURE §1, §5).
//!
//! consume a batch → decode (or dead-letter) → group by signer → acquire/renew the role's leases →
//! run the handler per signer, in offset order, in one PostgreSQL transaction (a savepoint per
//! signer) → commit (re-checking every lease) → produce the outputs and await their
//! acknowledgements → only then store and commit the input offsets.
//!
//! After each commit, and in the recovery scan (on start, on partition assignment and
//! periodically), the runtime calls [`Handler::drive`] for the signers concerned, outside any
//! transaction: the place for external calls (intent committed → call → result recorded, fenced)
//! and for re-driving work that PostgreSQL knows but the broker forgot.
//!
//! Messages that cannot be processed now (their signer's lease is held elsewhere, was lost, or a
//! transient error) are not skipped: the partition is rewound to the first of them and they come
//! again after a back-off. Handlers are idempotent, so a re-delivered message re-emits the same
//! outputs with the same `event_id`.

pub mod partition;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::codec::{CodecError, RegistryCodec, Subjects};
use crate::domain::{ChainId, Signer};
use crate::events::Event;
use crate::fault;
use crate::fenced::{BatchCommitError, BatchTx, FenceError, Fenced};
use crate::kafka::{KafkaSettings, ensure_topics};
use crate::lease::{Acquisition, HeldLease, LeaseConfig, LeaseError, LeaseManager};
use crate::retry::{Classify, Retry};
use crate::role::Role;
use crate::telemetry;

/// How many signers' `drive` run at once.
const DRIVE_CONCURRENCY: usize = 16;

/// A message for the output topics, encoded by the runtime after the commit.
pub struct Output {
    pub topic: String,
    pub key: String,
    pub event_id: String,
    event: Box<dyn ErasedEvent>,
}

impl Output {
    pub fn new<E: Event + 'static>(
        topic: impl Into<String>,
        subjects: Subjects,
        key: impl Into<String>,
        event: E,
    ) -> Output {
        Output {
            topic: topic.into(),
            key: key.into(),
            event_id: event.event_id().to_string(),
            event: Box::new(Typed { event, subjects }),
        }
    }
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Output")
            .field("topic", &self.topic)
            .field("key", &self.key)
            .field("event_id", &self.event_id)
            .finish()
    }
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

trait ErasedEvent: Send + Sync {
    fn encode<'a>(
        &'a self,
        codec: &'a RegistryCodec,
        topic: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>, CodecError>>;
}

struct Typed<E> {
    event: E,
    subjects: Subjects,
}

impl<E: Event> ErasedEvent for Typed<E> {
    fn encode<'a>(
        &'a self,
        codec: &'a RegistryCodec,
        topic: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>, CodecError>> {
        Box::pin(codec.encode(topic, self.subjects, &self.event))
    }
}

/// A message the handler refuses for good: it goes to the dead-letter topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Stable machine-readable code (`error.code` header).
    pub code: String,
    /// Human-readable reason (`error.message` header).
    pub message: String,
}

impl Rejection {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Rejection {
        Rejection {
            code: code.into(),
            message: message.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Dead-letter the message. Return this before writing anything for it.
    #[error("rejected: {}: {}", .0.code, .0.message)]
    Reject(Rejection),
    /// The signer's lease is lost: its work in this batch is rolled back and retried later.
    #[error(transparent)]
    Fenced(#[from] FenceError),
    /// Try again later (an RPC node or a dependency is unavailable); nothing is lost.
    #[error("transient failure: {context}")]
    Transient {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl HandlerError {
    pub fn transient(
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        HandlerError::Transient {
            context: context.into(),
            source: Box::new(source),
        }
    }
    fn is_fenced(&self) -> bool {
        matches!(self, HandlerError::Fenced(e) if e.is_fenced())
    }
}

/// What [`Handler::drive`] works with: the signer's lease and the pool to open fenced
/// transactions from.
pub struct DriveCtx<'a> {
    pub lease: &'a HeldLease,
    pub pool: &'a PgPool,
    /// True when called by the recovery scan (start, assignment, periodic), false right after a
    /// batch committed work for this signer.
    pub recovery: bool,
}

/// A stage's logic, plugged into the runtime.
pub trait Handler: Send + Sync + 'static {
    type Input: Event;

    /// The role whose leases the stage takes.
    fn role(&self) -> Role;

    /// The topic the stage consumes.
    fn input_topic(&self) -> String;

    /// The signer a message belongs to, or a permanent rejection (invalid input).
    fn route(&self, input: &Self::Input) -> Result<(ChainId, Signer), Rejection>;

    /// Applies one message inside its signer's savepoint. Idempotent: a message seen before must
    /// re-emit the same outputs (same `event_id`) and change nothing.
    fn handle(
        &self,
        w: &mut Fenced<'_>,
        input: &Self::Input,
    ) -> impl Future<Output = Result<Vec<Output>, HandlerError>> + Send;

    /// Signers with work in this stage's input states in PostgreSQL (the recovery scan).
    fn pending_signers(
        &self,
        pool: &PgPool,
    ) -> impl Future<Output = Result<Vec<(ChainId, Signer)>, sqlx::Error>> + Send;

    /// Drives one signer's pending work from PostgreSQL, outside any transaction: external calls
    /// (intent → commit → call → record), and re-emission of what the broker may have lost.
    fn drive(
        &self,
        ctx: DriveCtx<'_>,
    ) -> impl Future<Output = Result<Vec<Output>, HandlerError>> + Send;
}

/// A shared handler (e.g. one stage state used by two runtimes) is a handler.
impl<H: Handler> Handler for Arc<H> {
    type Input = H::Input;
    fn role(&self) -> Role {
        (**self).role()
    }
    fn input_topic(&self) -> String {
        (**self).input_topic()
    }
    fn route(&self, input: &Self::Input) -> Result<(ChainId, Signer), Rejection> {
        (**self).route(input)
    }
    fn handle(
        &self,
        w: &mut Fenced<'_>,
        input: &Self::Input,
    ) -> impl Future<Output = Result<Vec<Output>, HandlerError>> + Send {
        (**self).handle(w, input)
    }
    fn pending_signers(
        &self,
        pool: &PgPool,
    ) -> impl Future<Output = Result<Vec<(ChainId, Signer)>, sqlx::Error>> + Send {
        (**self).pending_signers(pool)
    }
    fn drive(
        &self,
        ctx: DriveCtx<'_>,
    ) -> impl Future<Output = Result<Vec<Output>, HandlerError>> + Send {
        (**self).drive(ctx)
    }
}

/// Settings of one stage instance.
#[derive(Debug, Clone)]
pub struct StageConfig {
    pub group_id: String,
    /// Where poison messages go.
    pub dlq_topic: String,
    /// Topics the runtime makes sure exist (its input and outputs, and the DLQ).
    pub topics: Vec<String>,
    pub partitions: i32,
    pub batch_max: usize,
    /// After the first message, how long to wait for more to fill the batch.
    pub batch_linger: Duration,
    pub lease: LeaseConfig,
    /// Pause before retrying messages that could not be processed.
    pub retry_backoff: Duration,
    /// How often the recovery scan runs (besides on start and on assignment).
    pub recovery_interval: Duration,
}

impl StageConfig {
    pub fn new(group_id: impl Into<String>, dlq_topic: impl Into<String>) -> StageConfig {
        StageConfig {
            group_id: group_id.into(),
            dlq_topic: dlq_topic.into(),
            topics: Vec::new(),
            partitions: 16,
            batch_max: 500,
            batch_linger: Duration::from_millis(2),
            lease: LeaseConfig::default(),
            retry_backoff: Duration::from_millis(200),
            recovery_interval: Duration::from_secs(30),
        }
    }
}

impl StageConfig {
    /// The settings of a pipeline stage from the service configuration: group
    /// `{group prefix}.{group}`, the pipeline's DLQ, partitions and topics.
    pub fn for_pipeline(
        config: &crate::config::Config,
        group: &str,
        lease: LeaseConfig,
    ) -> StageConfig {
        let mut sc = StageConfig::new(
            format!("{}.{group}", config.group_prefix()),
            config.topics.dlq(),
        );
        sc.lease = lease;
        // Work that no message announces (a lost event, a released nonce) waits at most this long.
        sc.recovery_interval = Duration::from_secs(5);
        sc.partitions = config.partitions;
        sc.topics = config.topics.all();
        sc
    }
}

/// The signers of `chain_id` with transactions in any of `states`: what most stages'
/// [`Handler::pending_signers`] return.
pub async fn signers_in_states(
    pool: &PgPool,
    chain_id: ChainId,
    states: &[&str],
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT DISTINCT chain_id, signer FROM managed_tx WHERE chain_id = $1 AND state = ANY($2)",
    )
    .bind(chain_id.0)
    .bind(states)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(c, s)| Signer::parse(&s).ok().map(|s| (ChainId(c), s)))
        .collect())
}

/// A token cancelled on Ctrl-C, for a role run from the command line.
pub fn ctrl_c_token() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        t.cancel();
    });
    token
}

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("kafka client")]
    Kafka(#[source] rdkafka::error::KafkaError),
    #[error("topic administration")]
    Topics(#[source] crate::kafka::TopicAdminError),
    #[error("leases")]
    Lease(#[source] LeaseError),
}

impl Classify for StageError {
    fn retry(&self) -> Retry {
        match self {
            StageError::Lease(e) => e.retry(),
            StageError::Topics(e) => e.retry(),
            StageError::Kafka(_) => Retry::Transient,
        }
    }
}

enum RebalanceEvent {
    Assigned(Vec<(String, i32)>),
    Revoked(Vec<(String, i32)>),
}

/// Forwards rebalances to the runtime loop.
pub struct StageContext {
    events: std::sync::mpsc::Sender<RebalanceEvent>,
}

impl ClientContext for StageContext {}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<(String, i32)> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_string(), e.partition()))
        .collect()
}

impl ConsumerContext for StageContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Hand over cleanly: commit what was stored before the partitions go.
            let _ = consumer.commit_consumer_state(CommitMode::Sync);
            let _ = self
                .events
                .send(RebalanceEvent::Revoked(partitions_of(tpl)));
        }
    }
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let _ = self
                .events
                .send(RebalanceEvent::Assigned(partitions_of(tpl)));
        }
    }
}

/// One consumed message, decoded and routed.
struct Item<I> {
    partition: i32,
    offset: i64,
    input: I,
    signer: (ChainId, Signer),
    traceparent: Option<String>,
}

/// The runtime of one stage instance.
pub struct StageRuntime<H: Handler> {
    handler: Arc<H>,
    pool: PgPool,
    codec: RegistryCodec,
    kafka: KafkaSettings,
    leases: LeaseManager,
    config: StageConfig,
    held: Mutex<HashMap<(ChainId, Signer), (HeldLease, Instant)>>,
}

impl<H: Handler> StageRuntime<H> {
    pub fn new(
        handler: H,
        pool: PgPool,
        codec: RegistryCodec,
        kafka: KafkaSettings,
        leases: LeaseManager,
        config: StageConfig,
    ) -> Self {
        StageRuntime {
            handler: Arc::new(handler),
            pool,
            codec,
            kafka,
            leases,
            config,
            held: Mutex::new(HashMap::new()),
        }
    }

    pub fn leases(&self) -> &LeaseManager {
        &self.leases
    }

    /// Runs until `shutdown` fires; then finishes the batch in hand, commits offsets and releases
    /// its leases.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), StageError> {
        let input_topic = self.handler.input_topic();
        let mut topics = self.config.topics.clone();
        topics.push(input_topic.clone());
        topics.push(self.config.dlq_topic.clone());
        topics.sort();
        topics.dedup();
        ensure_topics(&self.kafka, &topics, self.config.partitions)
            .await
            .map_err(StageError::Topics)?;

        let (events_tx, events_rx) = std::sync::mpsc::channel();
        let consumer: StreamConsumer<StageContext> = self
            .kafka
            .consumer_config(&self.config.group_id)
            .create_with_context(StageContext { events: events_tx })
            .map_err(StageError::Kafka)?;
        consumer
            .subscribe(&[&input_topic])
            .map_err(StageError::Kafka)?;
        let producer: FutureProducer = self
            .kafka
            .producer_config()
            .create()
            .map_err(StageError::Kafka)?;

        let mut assigned: BTreeSet<i32> = BTreeSet::new();
        let mut next_scan = Instant::now() + self.config.recovery_interval;
        let mut retry_pause: Option<Duration> = None;
        tracing::info!(role = %self.handler.role(), node = %self.leases.node(), topic = %input_topic, "stage started");
        loop {
            // Rebalances reported by the consumer context since the last poll.
            let mut scan_now: Vec<i32> = Vec::new();
            while let Ok(ev) = events_rx.try_recv() {
                match ev {
                    RebalanceEvent::Assigned(parts) => {
                        let new: Vec<i32> = parts
                            .iter()
                            .filter(|(t, _)| *t == input_topic)
                            .map(|(_, p)| *p)
                            .collect();
                        telemetry::Rebalanced {
                            role: self.handler.role(),
                            node: self.leases.node(),
                            assigned: &new,
                            revoked: &[],
                        }
                        .emit();
                        assigned.extend(&new);
                        scan_now.extend(new);
                    }
                    RebalanceEvent::Revoked(parts) => {
                        let gone: Vec<i32> = parts
                            .iter()
                            .filter(|(t, _)| *t == input_topic)
                            .map(|(_, p)| *p)
                            .collect();
                        telemetry::Rebalanced {
                            role: self.handler.role(),
                            node: self.leases.node(),
                            assigned: &[],
                            revoked: &gone,
                        }
                        .emit();
                        for p in &gone {
                            assigned.remove(p);
                        }
                        self.release_partitions(&gone).await;
                    }
                }
            }
            if !scan_now.is_empty() {
                self.recovery_scan(&producer, &scan_now).await;
            }
            if Instant::now() >= next_scan {
                next_scan = Instant::now() + self.config.recovery_interval;
                // The broker may have lost topics (a memory broker restart): recreate them.
                if let Err(e) = ensure_topics(&self.kafka, &topics, self.config.partitions).await {
                    tracing::warn!(error = %e, "could not ensure topics");
                }
                let parts: Vec<i32> = assigned.iter().copied().collect();
                if !parts.is_empty() {
                    self.recovery_scan(&producer, &parts).await;
                }
            }
            if let Some(pause) = retry_pause.take() {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(pause) => {}
                }
            }

            // Poll: the first message, then whatever else arrives within the linger.
            let first = tokio::select! {
                () = shutdown.cancelled() => break,
                m = consumer.recv() => m,
                () = tokio::time::sleep(Duration::from_millis(200)) => continue,
            };
            let first = match first {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "consumer error");
                    retry_pause = Some(self.config.retry_backoff);
                    continue;
                }
            };
            let mut batch = vec![first];
            let linger_until = tokio::time::Instant::now() + self.config.batch_linger;
            while batch.len() < self.config.batch_max {
                match tokio::time::timeout_at(linger_until, consumer.recv()).await {
                    Ok(Ok(m)) => batch.push(m),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "consumer error");
                        break;
                    }
                    Err(_) => break,
                }
            }
            if self.process_batch(&consumer, &producer, batch).await {
                retry_pause = Some(self.config.retry_backoff);
            }
        }

        let _ = consumer.commit_consumer_state(CommitMode::Sync);
        let leases: Vec<HeldLease> = self
            .held
            .lock()
            .map(|mut h| h.drain().map(|(_, (l, _))| l).collect())
            .unwrap_or_default();
        for l in &leases {
            let _ = self.leases.release(l).await;
        }
        tracing::info!(role = %self.handler.role(), node = %self.leases.node(), "stage stopped");
        Ok(())
    }

    /// Processes one batch; returns true if some messages must be retried after a back-off.
    async fn process_batch(
        &self,
        consumer: &StreamConsumer<StageContext>,
        producer: &FutureProducer,
        batch: Vec<BorrowedMessage<'_>>,
    ) -> bool {
        let started = Instant::now();
        let topic = self.handler.input_topic();
        let mut items: Vec<Item<H::Input>> = Vec::with_capacity(batch.len());
        // Per partition: the last offset handled (or dead-lettered), and the first to retry.
        let mut last_done: BTreeMap<i32, i64> = BTreeMap::new();
        let mut first_retry: BTreeMap<i32, i64> = BTreeMap::new();

        for m in &batch {
            let retry_here = |first_retry: &mut BTreeMap<i32, i64>| {
                first_retry.entry(m.partition()).or_insert(m.offset());
            };
            if first_retry.contains_key(&m.partition()) {
                continue; // behind a message that must be retried: keep the partition's order
            }
            let decoded = match m.payload() {
                None => Err(Rejection::new("EMPTY_MESSAGE", "the message has no value")),
                Some(bytes) => match self.codec.decode::<H::Input>(bytes).await {
                    Ok(v) => self.handler.route(&v).map(|signer| (v, signer)),
                    Err(e) if e.is_transient() => {
                        tracing::warn!(error = ?e, "decoding needs the registry; retrying later");
                        retry_here(&mut first_retry);
                        continue;
                    }
                    Err(e) => Err(Rejection::new("UNDECODABLE", error_chain(&e))),
                },
            };
            match decoded {
                Ok((input, signer)) => items.push(Item {
                    partition: m.partition(),
                    offset: m.offset(),
                    input,
                    signer,
                    traceparent: header(m, "traceparent"),
                }),
                Err(rejection) => {
                    if self.dead_letter(producer, m, &rejection).await {
                        last_done.insert(m.partition(), m.offset());
                    } else {
                        retry_here(&mut first_retry);
                    }
                }
            }
        }

        // Group by signer, in offset order (one signer's messages share a partition).
        let mut by_signer: BTreeMap<(ChainId, Signer), Vec<usize>> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            by_signer.entry(item.signer.clone()).or_default().push(i);
        }
        let leases = self.leases_for(by_signer.keys().cloned().collect()).await;

        let mut outputs: Vec<(usize, Vec<Output>)> = Vec::new();
        let mut retry_items: BTreeSet<usize> = BTreeSet::new();
        let mut rejected: Vec<(usize, Rejection)> = Vec::new();
        let mut kept_signers: Vec<(ChainId, Signer)> = Vec::new();
        let committed = match BatchTx::begin(&self.pool, self.config.lease.duration * 2).await {
            Err(e) => {
                tracing::warn!(error = ?e, "cannot begin the batch transaction");
                retry_items.extend(0..items.len());
                false
            }
            Ok(mut tx) => {
                let mut first_signer = true;
                for (signer, idxs) in &by_signer {
                    let Some(lease) = leases.get(signer) else {
                        retry_items.extend(idxs);
                        continue;
                    };
                    if !first_signer {
                        fault::point(fault::MID_BATCH);
                    }
                    first_signer = false;
                    let mut scope = match tx.signer(lease).await {
                        Ok(s) => s,
                        Err(e) => {
                            if e.is_fenced() {
                                self.forget(signer);
                            }
                            retry_items.extend(idxs);
                            continue;
                        }
                    };
                    let mut signer_outputs = Vec::new();
                    let mut signer_rejected = Vec::new();
                    let mut failed: Option<HandlerError> = None;
                    for &i in idxs {
                        let span = tracing::debug_span!(
                            "handle",
                            role = %self.handler.role(),
                            signer = %signer.1,
                            chain_id = signer.0.0,
                            fencing_token = lease.token().0,
                            offset = items[i].offset,
                        );
                        let _guard = span.enter();
                        match self
                            .handler
                            .handle(&mut scope.writer(), &items[i].input)
                            .await
                        {
                            Ok(outs) => signer_outputs.push((i, outs)),
                            Err(HandlerError::Reject(r)) => signer_rejected.push((i, r)),
                            Err(e) => {
                                failed = Some(e);
                                break;
                            }
                        }
                    }
                    match failed {
                        None => match scope.keep().await {
                            Ok(()) => {
                                kept_signers.push(signer.clone());
                                outputs.extend(signer_outputs);
                                rejected.extend(signer_rejected);
                            }
                            Err(e) => {
                                tracing::warn!(error = ?e, signer = %signer.1, "could not keep the signer's work");
                                retry_items.extend(idxs);
                            }
                        },
                        Some(e) => {
                            if e.is_fenced() {
                                tracing::warn!(signer = %signer.1, "fenced: rolling the signer back");
                                self.forget(signer);
                            } else {
                                tracing::warn!(error = ?e, signer = %signer.1, "handler failed; retrying later");
                            }
                            let _ = scope.discard().await;
                            retry_items.extend(idxs);
                        }
                    }
                }
                match tx.commit().await {
                    Ok(()) => true,
                    Err(BatchCommitError::Fenced(lost)) => {
                        for l in &lost {
                            self.forget(&(l.key().chain_id, l.key().signer.clone()));
                        }
                        false
                    }
                    Err(e) => {
                        tracing::warn!(error = ?e, "batch commit failed");
                        false
                    }
                }
            }
        };
        if !committed {
            // Nothing of the batch was applied: everything comes again.
            outputs.clear();
            rejected.clear();
            retry_items.extend(0..items.len());
        }
        fault::point(fault::AFTER_COMMIT);

        // Rejections and outputs, in offset order, acknowledged before any offset moves.
        for (i, r) in &rejected {
            let m = batch
                .iter()
                .find(|m| m.partition() == items[*i].partition && m.offset() == items[*i].offset);
            if let Some(m) = m
                && !self.dead_letter(producer, m, r).await
            {
                retry_items.insert(*i);
            }
        }
        let all: Vec<(&Output, Option<&str>)> = outputs
            .iter()
            .flat_map(|(i, outs)| outs.iter().map(|o| (o, items[*i].traceparent.as_deref())))
            .collect();
        let produced_ok = self.produce(producer, &all).await;
        if !produced_ok {
            // The state is committed; the outputs are re-emitted when the messages come again.
            retry_items.extend(outputs.iter().map(|(i, _)| *i));
        }
        fault::point(fault::AFTER_PRODUCE);

        for (i, item) in items.iter().enumerate() {
            if retry_items.contains(&i) {
                let e = first_retry.entry(item.partition).or_insert(item.offset);
                *e = (*e).min(item.offset);
            }
        }
        for (i, item) in items.iter().enumerate() {
            if !retry_items.contains(&i)
                && first_retry
                    .get(&item.partition)
                    .is_none_or(|r| item.offset < *r)
            {
                let e = last_done.entry(item.partition).or_insert(item.offset);
                *e = (*e).max(item.offset);
            }
        }
        for (p, off) in &last_done {
            if first_retry.get(p).is_none_or(|r| off < r)
                && let Err(e) = consumer.store_offset(&topic, *p, *off)
            {
                tracing::warn!(error = %e, partition = p, "could not store the offset");
            }
        }
        if !last_done.is_empty()
            && let Err(e) = consumer.commit_consumer_state(CommitMode::Async)
        {
            tracing::debug!(error = %e, "offset commit");
        }
        for (p, off) in &first_retry {
            if let Err(e) = consumer.seek(&topic, *p, Offset::Offset(*off), Duration::from_secs(5))
            {
                tracing::warn!(error = %e, partition = p, offset = off, "could not rewind for a retry");
            }
        }

        // External calls and follow-ups for the signers whose work committed.
        if committed {
            let to_drive: Vec<&HeldLease> =
                kept_signers.iter().filter_map(|s| leases.get(s)).collect();
            self.drive_all(producer, &to_drive, false).await;
        }
        telemetry::BatchCommitted {
            role: self.handler.role(),
            node: self.leases.node(),
            messages: batch.len(),
            signers: by_signer.len(),
            retried: retry_items.len(),
            elapsed: started.elapsed(),
        }
        .emit();
        !first_retry.is_empty()
    }

    /// Holds (acquiring or renewing as needed) the leases for `signers`; those held elsewhere are
    /// left out.
    async fn leases_for(
        &self,
        signers: Vec<(ChainId, Signer)>,
    ) -> HashMap<(ChainId, Signer), HeldLease> {
        let renew_after = self.config.lease.renew_interval;
        let mut out = HashMap::new();
        let mut need: BTreeMap<ChainId, Vec<Signer>> = BTreeMap::new();
        if let Ok(held) = self.held.lock() {
            for s in signers {
                match held.get(&s) {
                    Some((l, at)) if at.elapsed() < renew_after => {
                        out.insert(s, l.clone());
                    }
                    _ => need.entry(s.0).or_default().push(s.1),
                }
            }
        }
        for (chain, list) in need {
            match self.leases.acquire_many(chain, &list).await {
                Ok(acqs) => {
                    for a in acqs {
                        if let Acquisition::Held(l, _) = a {
                            let key = (l.key().chain_id, l.key().signer.clone());
                            if let Ok(mut held) = self.held.lock() {
                                held.insert(key.clone(), (l.clone(), Instant::now()));
                            }
                            out.insert(key, l);
                        }
                    }
                }
                Err(e) => tracing::warn!(error = ?e, "lease acquisition failed"),
            }
        }
        out
    }

    fn forget(&self, signer: &(ChainId, Signer)) {
        if let Ok(mut held) = self.held.lock() {
            held.remove(signer);
        }
    }

    async fn release_partitions(&self, partitions: &[i32]) {
        let leases: Vec<HeldLease> = match self.held.lock() {
            Ok(mut held) => {
                let keys: Vec<(ChainId, Signer)> = held
                    .keys()
                    .filter(|(c, s)| {
                        partitions.contains(&partition::partition_for(
                            &crate::kafka::signer_key(c.0, s.as_str()),
                            self.config.partitions,
                        ))
                    })
                    .cloned()
                    .collect();
                keys.iter()
                    .filter_map(|k| held.remove(k).map(|(l, _)| l))
                    .collect()
            }
            Err(_) => Vec::new(),
        };
        for l in &leases {
            if let Err(e) = self.leases.release(l).await {
                tracing::warn!(error = ?e, "could not release a lease");
            }
        }
    }

    /// Drives the pending work of the signers on `partitions` from PostgreSQL.
    async fn recovery_scan(&self, producer: &FutureProducer, partitions: &[i32]) {
        let pending = match self.handler.pending_signers(&self.pool).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "recovery scan could not list pending work");
                return;
            }
        };
        let mine: Vec<(ChainId, Signer)> = pending
            .into_iter()
            .filter(|(c, s)| {
                partitions.contains(&partition::partition_for(
                    &crate::kafka::signer_key(c.0, s.as_str()),
                    self.config.partitions,
                ))
            })
            .collect();
        if mine.is_empty() {
            return;
        }
        tracing::info!(role = %self.handler.role(), signers = mine.len(), "recovery scan");
        let leases = self.leases_for(mine).await;
        let to_drive: Vec<&HeldLease> = leases.values().collect();
        self.drive_all(producer, &to_drive, true).await;
    }

    /// Drives several signers at once (each signer's own work stays sequential).
    async fn drive_all(&self, producer: &FutureProducer, leases: &[&HeldLease], recovery: bool) {
        use futures::StreamExt;
        let mut drives = Vec::with_capacity(leases.len());
        for lease in leases {
            drives.push(self.drive(producer, lease, recovery));
        }
        futures::stream::iter(drives)
            .buffer_unordered(DRIVE_CONCURRENCY)
            .collect::<Vec<()>>()
            .await;
    }

    async fn drive(&self, producer: &FutureProducer, lease: &HeldLease, recovery: bool) {
        match self
            .handler
            .drive(DriveCtx {
                lease,
                pool: &self.pool,
                recovery,
            })
            .await
        {
            Ok(outs) => {
                if !outs.is_empty() {
                    fault::point(fault::AFTER_DRIVE);
                }
                let all: Vec<(&Output, Option<&str>)> = outs.iter().map(|o| (o, None)).collect();
                self.produce(producer, &all).await;
            }
            Err(e) => {
                if e.is_fenced() {
                    self.forget(&(lease.key().chain_id, lease.key().signer.clone()));
                }
                tracing::warn!(error = ?e, signer = %lease.key().signer, "driving pending work failed; the recovery scan retries");
            }
        }
    }

    /// Encodes and produces one output, waiting for the acknowledgement.
    async fn produce(
        &self,
        producer: &FutureProducer,
        outputs: &[(&Output, Option<&str>)],
    ) -> bool {
        // Encode everything first (the registry is consulted once per schema), then enqueue in
        // order, then await every acknowledgement: the idempotent producer keeps each partition's
        // order, and the batch pays one round trip instead of one per message.
        let mut encoded = Vec::with_capacity(outputs.len());
        for (o, parent) in outputs {
            match o.event.encode(&self.codec, &o.topic).await {
                Ok(p) => encoded.push((*o, p, child_traceparent(*parent))),
                Err(e) => {
                    tracing::warn!(error = ?e, topic = %o.topic, "could not encode an output");
                    return false;
                }
            }
        }
        let sends = encoded.iter().map(|(o, payload, traceparent)| {
            let headers = OwnedHeaders::new()
                .insert(Header {
                    key: "traceparent",
                    value: Some(traceparent.as_bytes()),
                })
                .insert(Header {
                    key: "event_id",
                    value: Some(o.event_id.as_bytes()),
                });
            let record = FutureRecord::to(&o.topic)
                .key(&o.key)
                .payload(payload)
                .headers(headers);
            producer.send(record, Duration::from_secs(30))
        });
        let mut ok = true;
        for (result, (o, _, _)) in futures::future::join_all(sends)
            .await
            .into_iter()
            .zip(&encoded)
        {
            if let Err((e, _)) = result {
                tracing::warn!(error = %e, topic = %o.topic, "could not produce an output");
                ok = false;
            }
        }
        ok
    }

    /// Sends a message to the dead-letter topic with the reason in its headers.
    async fn dead_letter(
        &self,
        producer: &FutureProducer,
        m: &BorrowedMessage<'_>,
        r: &Rejection,
    ) -> bool {
        let partition = m.partition().to_string();
        let offset = m.offset().to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "error.code",
                value: Some(r.code.as_bytes()),
            })
            .insert(Header {
                key: "error.message",
                value: Some(r.message.as_bytes()),
            })
            .insert(Header {
                key: "source.topic",
                value: Some(m.topic().as_bytes()),
            })
            .insert(Header {
                key: "source.partition",
                value: Some(partition.as_bytes()),
            })
            .insert(Header {
                key: "source.offset",
                value: Some(offset.as_bytes()),
            });
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.config.dlq_topic).headers(headers);
        if let Some(k) = m.key() {
            record = record.key(k);
        }
        if let Some(p) = m.payload() {
            record = record.payload(p);
        }
        match producer.send(record, Duration::from_secs(30)).await {
            Ok(_) => {
                telemetry::DeadLettered {
                    role: self.handler.role(),
                    code: &r.code,
                    reason: &r.message,
                    topic: m.topic(),
                    partition: m.partition(),
                    offset: m.offset(),
                }
                .emit();
                true
            }
            Err((e, _)) => {
                tracing::warn!(error = %e, "could not dead-letter a message; retrying later");
                false
            }
        }
    }
}

fn header(m: &BorrowedMessage<'_>, name: &str) -> Option<String> {
    let headers = m.headers()?;
    headers
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// A W3C `traceparent` for an output: the input's trace with a new span, or a new trace.
pub fn child_traceparent(parent: Option<&str>) -> String {
    let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
    let trace = parent
        .and_then(|p| {
            let parts: Vec<&str> = p.split('-').collect();
            (parts.len() == 4
                && parts[1].len() == 32
                && parts[1].bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| parts[1].to_string())
        })
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    format!("00-{trace}-{span}-01")
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_keeps_the_trace_and_makes_a_new_span() {
        let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let child = child_traceparent(Some(parent));
        assert!(child.starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
        assert_ne!(child, parent);
        let fresh = child_traceparent(Some("garbage"));
        assert_eq!(fresh.split('-').count(), 4);
    }
}
