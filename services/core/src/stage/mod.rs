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
//! and for re-driving work that PostgreSQL knows but the broker forgot. Every
//! `ready_interval` it also drives the signers [`Handler::ready_signers`] names (work waiting on
//! a condition that cleared without a message, such as the allocator's in-flight budget).
//!
//! Messages that cannot be processed now (their signer's lease is held elsewhere, was lost, or a
//! transient error) are not skipped: the partition is rewound to the first of them and they come
//! again after a back-off. Handlers are idempotent, so a re-delivered message re-emits the same
//! outputs with the same `event_id`. A message that fails for good ([`HandlerError::Fail`]) is
//! dead-lettered and never pins its partition.
//!
//! The modules:
//! - [`handler`]: the API the stages implement (`Handler`, `HandlerError`, `Output`, `Rejection`,
//!   `DriveCtx`) — API boundary: the role crates use this and [`StageConfig`], nothing else;
//! - [`config`]: the stage's settings;
//! - `consumer`: the consumer context (rebalances), polling a batch, and the watch that reports a
//!   group that hands the stage no partition for `assignment_timeout` (an ERROR naming the group);
//! - `batch`: processing one batch;
//! - [`offsets`]: pure offset planning (which offset to store, where to rewind);
//! - `leases`: the held-lease cache;
//! - `recovery`: the recovery scan and driving signers;
//! - `produce`: outputs, dead letters, `traceparent`;
//! - [`partition`]: librdkafka's default partitioner.

mod batch;
pub mod config;
mod consumer;
pub mod handler;
mod leases;
pub mod offsets;
pub mod partition;
mod produce;
mod recovery;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, Producer as _};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::codec::RegistryCodec;
use crate::kafka::{KafkaSettings, TopicAdmin};
use crate::lease::{LeaseError, LeaseManager};
use crate::retry::{Classify, Retry};
use crate::telemetry;

pub use config::StageConfig;
pub use consumer::StageContext;
pub use handler::{BatchResults, DriveCtx, Handler, HandlerError, Output, Rejection};
pub use produce::{child_traceparent, dead_letter_record};

use consumer::{AssignmentWatch, Polled, RebalanceEvent};
use leases::HeldLeases;
use offsets::Settled;

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

/// The runtime of one stage instance.
pub struct StageRuntime<H: Handler> {
    handler: Arc<H>,
    pool: PgPool,
    codec: RegistryCodec,
    kafka: KafkaSettings,
    leases: LeaseManager,
    config: StageConfig,
    held: Mutex<HeldLeases>,
    /// Messages dead-lettered out of order, skipped when they come again (see `batch`).
    settled: Mutex<Settled>,
    /// The acknowledged outputs whose outbox rows are to go, flushed by a task of [`Self::run`].
    marks: crate::outbox::MarkQueue,
    /// A produce failed in a way the producer never recovers from (see [`produce::is_broken`]):
    /// the loop builds a new one.
    producer_broken: std::sync::atomic::AtomicBool,
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
            producer_broken: std::sync::atomic::AtomicBool::new(false),
            settled: Mutex::new(Settled::default()),
            marks: crate::outbox::MarkQueue::default(),
        }
    }

    /// The stage's handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    pub fn leases(&self) -> &LeaseManager {
        &self.leases
    }

    /// Runs until `shutdown` fires; then finishes the batch in hand, commits offsets and releases
    /// its leases.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), StageError> {
        // The outbox marks are written beside the loop, by one future of this task, and the
        // last of them once the loop has ended.
        let stop_marks = CancellationToken::new();
        let flushing = self.marks.flush(self.pool.clone(), stop_marks.clone());
        let running = async {
            let result = self.run_loop(shutdown).await;
            stop_marks.cancel();
            result
        };
        let (result, ()) = tokio::join!(running, flushing);
        result
    }

    async fn run_loop(&self, shutdown: CancellationToken) -> Result<(), StageError> {
        let input_topic = self.handler.input_topic();
        let mut topics = self.config.topics.clone();
        topics.push(input_topic.clone());
        topics.push(self.config.dlq_topic.clone());
        topics.sort();
        topics.dedup();
        // One admin client for the stage's life: the topics are ensured again on every
        // recovery scan (`TopicAdmin` says what a client per call cost), by a task of their own.
        let admin = Arc::new(TopicAdmin::new(&self.kafka).map_err(StageError::Topics)?);
        admin
            .ensure(&topics, self.config.partitions)
            .await
            .map_err(StageError::Topics)?;

        let (context, rebalances) = StageContext::new();
        let consumer: StreamConsumer<StageContext> = self
            .kafka
            .consumer_config(&self.config.group_id)
            .create_with_context(context)
            .map_err(StageError::Kafka)?;
        consumer
            .subscribe(&[&input_topic])
            .map_err(StageError::Kafka)?;
        let mut producer: FutureProducer = self
            .kafka
            .producer_config()
            .create()
            .map_err(StageError::Kafka)?;

        let mut assigned: BTreeSet<i32> = BTreeSet::new();
        let mut watch = AssignmentWatch::new(Instant::now(), self.config.assignment_timeout);
        let mut next_scan = Instant::now() + self.config.recovery_interval;
        let mut next_ready = Instant::now() + self.config.ready_interval;
        let mut retry_pause: Option<Duration> = None;
        let mut ensuring: Option<tokio::task::JoinHandle<()>> = None;
        tracing::info!(
            role = %self.handler.role(),
            node = %self.leases.node(),
            topic = %input_topic,
            group = %self.config.group_id,
            instance = ?self.kafka.group_instance_id,
            "stage started"
        );
        loop {
            if let Some(why) = self.producer_beyond_repair(&producer) {
                tracing::error!(role = %self.handler.role(), node = %self.leases.node(), reason = %why,
                    "the producer cannot produce any more (its idempotence state was fenced or lost by the broker): building a new one; the outbox relays what it did not deliver");
                producer = self
                    .kafka
                    .producer_config()
                    .create()
                    .map_err(StageError::Kafka)?;
            }
            // Rebalances reported by the consumer context since the last poll.
            let mut scan_now: Vec<i32> = Vec::new();
            while let Ok(ev) = rebalances.try_recv() {
                match ev {
                    RebalanceEvent::Assigned(parts) => {
                        let new = RebalanceEvent::partitions_of(&parts, &input_topic);
                        telemetry::Rebalanced {
                            role: self.handler.role(),
                            node: self.leases.node(),
                            assigned: &new,
                            revoked: &[],
                        }
                        .emit();
                        assigned.extend(&new);
                        if let Some(r) = watch.rebalanced(Instant::now(), assigned.len(), true) {
                            self.log_assigned(&input_topic, &assigned, r.waited, r.reported);
                        }
                        scan_now.extend(new);
                    }
                    RebalanceEvent::Revoked(parts) => {
                        let gone = RebalanceEvent::partitions_of(&parts, &input_topic);
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
                        watch.rebalanced(Instant::now(), assigned.len(), false);
                        if let Ok(mut s) = self.settled.lock() {
                            s.revoked(&gone);
                        }
                        self.release_partitions(&gone).await;
                    }
                }
            }
            if let Some(overdue) = watch.check(Instant::now()) {
                self.log_overdue(&input_topic, &overdue);
            }
            if !scan_now.is_empty() {
                self.recovery_scan(&producer, &scan_now).await;
            }
            if Instant::now() >= next_scan {
                next_scan = Instant::now() + self.config.recovery_interval;
                // The broker may have lost topics (a memory broker restart): recreate them, off
                // the loop. A broker that hangs answers no admin request for their 10 s
                // timeout; awaited here, every scan would hold the drives that long, and the
                // events they produce would reach the broker's queue only late in an outage.
                if ensuring.as_ref().is_none_or(|h| h.is_finished()) {
                    let (admin, topics, partitions) =
                        (admin.clone(), topics.clone(), self.config.partitions);
                    ensuring = Some(tokio::spawn(async move {
                        if let Err(e) = admin.ensure(&topics, partitions).await {
                            tracing::warn!(error = %e, "could not ensure topics");
                        }
                    }));
                }
                let parts: Vec<i32> = assigned.iter().copied().collect();
                if !parts.is_empty() {
                    self.recovery_scan(&producer, &parts).await;
                }
            }
            if Instant::now() >= next_ready {
                next_ready = Instant::now() + self.config.ready_interval;
                let parts: Vec<i32> = assigned.iter().copied().collect();
                if !parts.is_empty() {
                    self.drive_ready(&producer, &parts).await;
                }
            }
            if let Some(pause) = retry_pause.take() {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(pause) => {}
                }
            }

            let batch = match consumer::poll_batch(
                &consumer,
                &shutdown,
                self.config.batch_max,
                self.config.batch_linger,
            )
            .await
            {
                Polled::Shutdown => break,
                Polled::Idle => continue,
                Polled::Error => {
                    retry_pause = Some(self.config.retry_backoff);
                    continue;
                }
                Polled::Batch(batch) => batch,
            };
            retry_pause = self.process_batch(&consumer, &producer, batch).await;
        }

        let _ = consumer.commit_consumer_state(CommitMode::Sync);
        self.release_all().await;
        tracing::info!(role = %self.handler.role(), node = %self.leases.node(), "stage stopped");
        Ok(())
    }

    /// Why `producer` must be replaced, if it must: a fatal error set on it (librdkafka's
    /// idempotent producer raises one when the broker fences or forgets its producer id), or a
    /// produce since the last look that failed with such an error.
    fn producer_beyond_repair(&self, producer: &FutureProducer) -> Option<String> {
        let flagged = self
            .producer_broken
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        match producer.client().fatal_error() {
            Some((code, reason)) => Some(format!("fatal error {code:?}: {reason}")),
            None if flagged => Some("a produce failed with a producer-state error".into()),
            None => None,
        }
    }

    /// Partitions held again after none (the first assignment, or after a rebalance).
    fn log_assigned(&self, topic: &str, held: &BTreeSet<i32>, waited: Duration, reported: bool) {
        tracing::info!(
            target: "txflow::stage",
            event = "assigned",
            role = %self.handler.role(),
            node = %self.leases.node(),
            group = %self.config.group_id,
            topic,
            partitions = ?held,
            count = held.len(),
            waited_ms = waited.as_millis() as u64,
            after_overdue = reported,
            "partitions assigned"
        );
    }

    /// No partition for longer than `assignment_timeout`: said loudly, naming the group. The
    /// consumer keeps trying (librdkafka rejoins by itself); this is repeated every timeout.
    fn log_overdue(&self, topic: &str, overdue: &consumer::Overdue) {
        let why = if overdue.answered {
            "the group gave this member no partition: other members hold them all (more members \
             than partitions)"
        } else {
            "no rebalance of the group has completed for this member (a member that left while \
             leading a rebalance and that the broker still counts as leader, or a coordinator \
             that cannot be reached)"
        };
        tracing::error!(
            target: "txflow::stage",
            event = "assignment_overdue",
            role = %self.handler.role(),
            node = %self.leases.node(),
            group = %self.config.group_id,
            topic,
            waited_ms = overdue.waited.as_millis() as u64,
            "consumer group {}: no partition of {topic} assigned for {} s; {why}; still trying",
            self.config.group_id,
            overdue.waited.as_secs(),
        );
    }
}
