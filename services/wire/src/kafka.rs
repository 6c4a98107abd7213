//! Kafka plumbing the pipeline relies on: client settings, keys, topic names, topic creation.
//!
//! Only standard client features are used, so that the same code runs against Apache Kafka in
//! production and against tansu here (no transactions, no read_committed, no End/Tail offsets,
//! watermarks or timestamp lookups in the pipeline's correctness path; see ARCHITECTURE.md).

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use txflow_domain::retry::{Classify, Retry};

/// Connection and tuning settings shared by producers and consumers.
///
/// The consumer group settings decide how fast a stage's partitions change hands when a process
/// dies (ARCHITECTURE.md, "The broker"):
/// - a process killed with `kill -9` says nothing; the coordinator hands its partitions to the
///   others once it has not heard from it for `session_timeout_ms`, and the others learn of the
///   rebalance at their next heartbeat (`heartbeat_interval_ms`);
/// - with static membership (`group_instance_id`), a restarted process that comes back under the
///   same instance id within the session timeout takes its partitions back without a rebalance,
///   and a stopping process does not leave the group (no LeaveGroup is sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaSettings {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// `fetch.wait.max.ms`: longest time the broker may hold a fetch open waiting for data
    /// (default 100). Apache Kafka answers a waiting fetch as soon as data arrives, so this costs
    /// no latency there. On the local tansu each consumer's fetch comes back empty after this
    /// long while nothing arrives, so a short wait is paid in the broker's CPU: at 10 ms the
    /// pipeline's six consumers kept 0.4 of a core busy doing nothing and took a quarter of
    /// the machine's CPU in `txflow bench`; at 100 ms 0.1 core idle, 30-45 % more throughput
    /// at 50 × 40, the same idle latency (p50 request → SUBMITTED 41 against 47 ms); at 500 ms
    /// every hop waits (p50 352 ms). ARCHITECTURE.md "Performance" has the figures.
    pub fetch_wait_max_ms: u32,
    /// Producer batching delay.
    pub linger_ms: u32,
    /// `session.timeout.ms` (`TXFLOW_GROUP_SESSION_TIMEOUT_MS`): a member not heard from for this
    /// long is removed from its group and its partitions go to the others. It bounds the stall
    /// after a `kill -9`. Apache Kafka accepts 6,000 to 1,800,000 by default
    /// (`group.min.session.timeout.ms`, `group.max.session.timeout.ms`), hence the default of
    /// 6,000. The local tansu broker holds every JoinGroup for half the session timeout, so a
    /// shorter one makes each rebalance shorter too: 2,000 with a 400 ms heartbeat locally.
    pub session_timeout_ms: u32,
    /// `heartbeat.interval.ms` (`TXFLOW_GROUP_HEARTBEAT_MS`): how often a member tells the
    /// coordinator it lives, and so how soon it hears of a rebalance. Used as at most a third of
    /// the session timeout.
    pub heartbeat_interval_ms: u32,
    /// `group.instance.id` (`TXFLOW_GROUP_INSTANCE_ID`): static membership (KIP-345), off when
    /// `None`. Must be unique per process among the members of each group and stable across its
    /// restarts (e.g. the pod or unit name); two live processes with the same id fence each other.
    /// Keep it off with the local tansu broker: it reuses a returning instance's member id, but
    /// holds every static JoinGroup and SyncGroup for 3 s and, in a chaos run here (kill -9 every
    /// 4 s), left groups with no member assigned for the rest of the run (over 5 minutes).
    pub group_instance_id: Option<String>,
    /// Replication factor of the topics txflow creates (`kafka.replication_factor`,
    /// `TXFLOW_TOPIC_REPLICATION_FACTOR`, default 1), at least 1. The default suits a single
    /// broker, such as the local tansu; on an Apache Kafka cluster in production use at least 3,
    /// with `min.insync.replicas` at 2: the producer uses `acks=all`, so a write then survives
    /// the loss of a broker. Apache Kafka refuses a factor above its broker count
    /// (`InvalidReplicationFactor`); tansu accepts any and lists its one broker as every replica
    /// (`tests/tests/broker_conformance.rs`). It applies only to the topics [`ensure_topics`]
    /// creates: a topic that already exists is left as it is.
    pub replication_factor: i32,
}

/// The default session timeout: the lowest a stock Apache Kafka broker accepts.
pub const DEFAULT_SESSION_TIMEOUT_MS: u32 = 6_000;
/// The default heartbeat interval.
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u32 = 1_000;

impl KafkaSettings {
    pub fn new(brokers: impl Into<String>) -> Self {
        KafkaSettings {
            brokers: brokers.into(),
            fetch_wait_max_ms: 100,
            linger_ms: 2,
            session_timeout_ms: DEFAULT_SESSION_TIMEOUT_MS,
            heartbeat_interval_ms: DEFAULT_HEARTBEAT_INTERVAL_MS,
            group_instance_id: None,
            replication_factor: 1,
        }
    }

    /// The heartbeat interval used: the setting, at most a third of the session timeout (so that
    /// a live member never misses its session by a late heartbeat), at least 100 ms.
    pub fn effective_heartbeat_ms(&self) -> u32 {
        self.heartbeat_interval_ms
            .min(self.session_timeout_ms / 3)
            .max(100)
    }

    fn base(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("socket.nagle.disable", "true")
            .set("topic.metadata.refresh.interval.ms", "5000");
        // librdkafka's own debug contexts (e.g. "fetch,metadata"), for diagnosing a broker.
        if let Ok(debug) = std::env::var("TXFLOW_KAFKA_DEBUG") {
            c.set("debug", debug);
        }
        c
    }

    /// An idempotent producer that waits for every replica (`acks=all`): a retried send never
    /// duplicates or reorders a partition.
    pub fn producer_config(&self) -> ClientConfig {
        let mut c = self.base();
        c.set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", self.linger_ms.to_string())
            .set("message.timeout.ms", "30000");
        c
    }

    /// A group consumer that never stores or commits offsets on its own: the stage runtime stores
    /// an offset only after the Postgres commit and the produce acknowledgement, and commits
    /// explicitly. Its group settings are those of [`KafkaSettings`].
    pub fn consumer_config(&self, group_id: &str) -> ClientConfig {
        let mut c = self.reader_config();
        c.set("group.id", group_id)
            .set("session.timeout.ms", self.session_timeout_ms.to_string())
            .set(
                "heartbeat.interval.ms",
                self.effective_heartbeat_ms().to_string(),
            )
            .set("partition.assignment.strategy", "range");
        if let Some(id) = &self.group_instance_id {
            c.set("group.instance.id", id);
        }
        c
    }

    /// A consumer outside any group, for replay by explicit assignment: it never joins a group
    /// (it must not be subscribed), so it has no instance id.
    pub fn assign_config(&self) -> ClientConfig {
        let mut c = self.reader_config();
        c.set("group.id", "txflow-unused");
        c
    }

    /// What every reader shares: no automatic offset storing or committing, the fetch tuning.
    fn reader_config(&self) -> ClientConfig {
        let mut c = self.base();
        c.set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", self.fetch_wait_max_ms.to_string())
            .set("fetch.error.backoff.ms", "50");
        c
    }

    pub fn admin_config(&self) -> ClientConfig {
        self.base()
    }
}

/// The key of every transaction-pipeline message: `{chain_id}:{signer}` with the signer in
/// lowercase, so that one signer's messages stay in order on one partition.
pub fn signer_key(chain_id: i64, signer: &str) -> String {
    format!("{chain_id}:{}", signer.to_ascii_lowercase())
}

/// Topic names, all under one configurable prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    pub prefix: String,
}

impl Topics {
    pub fn new(prefix: impl Into<String>) -> Self {
        Topics {
            prefix: prefix.into(),
        }
    }
    fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }
    pub fn tx_requests(&self) -> String {
        self.name("tx.requests")
    }
    pub fn tx_commands(&self) -> String {
        self.name("tx.commands")
    }
    pub fn tx_allocated(&self) -> String {
        self.name("tx.allocated")
    }
    pub fn tx_signed(&self) -> String {
        self.name("tx.signed")
    }
    pub fn tx_submitted(&self) -> String {
        self.name("tx.submitted")
    }
    pub fn tx_receipts(&self) -> String {
        self.name("tx.receipts")
    }
    pub fn tx_confirmations(&self) -> String {
        self.name("tx.confirmations")
    }
    pub fn tx_outcomes(&self) -> String {
        self.name("tx.outcomes")
    }
    pub fn dlq(&self) -> String {
        self.name("dlq")
    }
    /// The spot ledger's commands (SpotCommand), keyed by user id.
    pub fn spot_commands(&self) -> String {
        self.name("spot.commands")
    }
    /// The spot ledger's replies (SpotReply), keyed by user id.
    pub fn spot_events(&self) -> String {
        self.name("spot.events")
    }
    /// Transfer requests (TransferRequested) from the gateway to the coordinator, keyed by user id.
    pub fn transfer_requests(&self) -> String {
        self.name("transfer.requests")
    }
    /// The coordinator's transfer state changes (TransferUpdated), keyed by user id.
    pub fn transfer_events(&self) -> String {
        self.name("transfer.events")
    }
    /// The transfer coordinator's topics: its input, its output, the spot ledger's and the
    /// dead-letter topic.
    pub fn transfers(&self) -> Vec<String> {
        vec![
            self.transfer_requests(),
            self.transfer_events(),
            self.spot_commands(),
            self.spot_events(),
            self.dlq(),
        ]
    }
    /// The spot ledger's topics (and the dead-letter topic it shares).
    pub fn spot(&self) -> Vec<String> {
        vec![self.spot_commands(), self.spot_events(), self.dlq()]
    }
    /// Every topic of the transaction pipeline.
    pub fn all(&self) -> Vec<String> {
        vec![
            self.tx_requests(),
            self.tx_commands(),
            self.tx_allocated(),
            self.tx_signed(),
            self.tx_submitted(),
            self.tx_receipts(),
            self.tx_confirmations(),
            self.tx_outcomes(),
            self.dlq(),
        ]
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TopicAdminError {
    #[error("creating the admin client")]
    Client(#[source] KafkaError),
    #[error("creating topics")]
    Request(#[source] KafkaError),
    #[error("creating topic {topic}: {code}")]
    Topic {
        topic: String,
        code: RDKafkaErrorCode,
    },
}

impl Classify for TopicAdminError {
    fn retry(&self) -> Retry {
        match self {
            TopicAdminError::Topic {
                code:
                    RDKafkaErrorCode::InvalidPartitions
                    | RDKafkaErrorCode::InvalidTopic
                    | RDKafkaErrorCode::InvalidReplicationFactor
                    | RDKafkaErrorCode::InvalidConfig,
                ..
            } => Retry::Permanent,
            _ => Retry::Transient,
        }
    }
}

/// Creates `topics` with `partitions` partitions and `settings.replication_factor` replicas each;
/// topics that already exist are left alone (their partitions and replicas unchanged). A client
/// for one call: a stage that ensures its topics again and again keeps a [`TopicAdmin`].
pub async fn ensure_topics(
    settings: &KafkaSettings,
    topics: &[String],
    partitions: i32,
) -> Result<(), TopicAdminError> {
    TopicAdmin::new(settings)?.ensure(topics, partitions).await
}

/// An admin client kept for the life of its owner, for [`TopicAdmin::ensure`] again and again.
/// A client made for one call costs a connection to the broker and, when dropped, about 100 ms
/// of librdkafka's teardown: made and dropped on every recovery scan, inside the stage's loop,
/// it held each stage's messages up that long every scan (every second for the confirmation
/// manager; docs/performance.md, "The broker").
pub struct TopicAdmin {
    admin: AdminClient<DefaultClientContext>,
    replication_factor: i32,
}

impl TopicAdmin {
    pub fn new(settings: &KafkaSettings) -> Result<TopicAdmin, TopicAdminError> {
        let admin = settings
            .admin_config()
            .create()
            .map_err(TopicAdminError::Client)?;
        Ok(TopicAdmin {
            admin,
            replication_factor: settings.replication_factor,
        })
    }

    /// Creates those of `topics` that do not exist, as [`ensure_topics`] does.
    pub async fn ensure(&self, topics: &[String], partitions: i32) -> Result<(), TopicAdminError> {
        let new: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|t| {
                NewTopic::new(
                    t,
                    partitions,
                    TopicReplication::Fixed(self.replication_factor),
                )
            })
            .collect();
        let opts = admin_options();
        let results = self
            .admin
            .create_topics(&new, &opts)
            .await
            .map_err(TopicAdminError::Request)?;
        per_topic(results, RDKafkaErrorCode::TopicAlreadyExists)
    }

    /// Deletes `topics`; those that do not exist are no error.
    pub async fn delete(&self, topics: &[String]) -> Result<(), TopicAdminError> {
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        let opts = admin_options();
        let results = self
            .admin
            .delete_topics(&names, &opts)
            .await
            .map_err(TopicAdminError::Request)?;
        per_topic(results, RDKafkaErrorCode::UnknownTopicOrPartition)
    }
}

/// An admin request's deadlines: 10 s for the broker to carry it out, and 10 s for it to
/// answer at all. Without the second, a broker that hangs (paused, or a network path that drops
/// everything) holds the caller for the client's socket timeout (60 s); a stage's loop, which
/// ensures its topics before each recovery scan, would stall that long instead of driving its
/// signers, whose events then wait in the outbox until the broker answers.
fn admin_options() -> AdminOptions {
    AdminOptions::new()
        .operation_timeout(Some(Duration::from_secs(10)))
        .request_timeout(Some(Duration::from_secs(10)))
}

/// The first topic an admin request failed for, other than with `fine` (the outcome asked for
/// was already there).
fn per_topic(
    results: Vec<Result<String, (String, RDKafkaErrorCode)>>,
    fine: RDKafkaErrorCode,
) -> Result<(), TopicAdminError> {
    for r in results {
        match r {
            Ok(_) => {}
            Err((_, code)) if code == fine => {}
            Err((topic, code)) => return Err(TopicAdminError::Topic { topic, code }),
        }
    }
    Ok(())
}

/// Deletes `topics` (best effort cleanup for tests and tools), with a client for the call.
pub async fn delete_topics(
    settings: &KafkaSettings,
    topics: &[String],
) -> Result<(), TopicAdminError> {
    TopicAdmin::new(settings)?.delete(topics).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_lowercase_per_signer() {
        assert_eq!(signer_key(1, "0xAbC"), "1:0xabc");
    }

    #[test]
    fn consumers_never_store_offsets_on_their_own() {
        let c = KafkaSettings::new("x:1").consumer_config("g");
        assert_eq!(c.get("enable.auto.offset.store"), Some("false"));
        assert_eq!(c.get("enable.auto.commit"), Some("false"));
    }

    #[test]
    fn group_settings_reach_the_consumer() {
        let mut s = KafkaSettings::new("x:1");
        let c = s.consumer_config("g");
        assert_eq!(c.get("session.timeout.ms"), Some("6000"));
        assert_eq!(c.get("heartbeat.interval.ms"), Some("1000"));
        assert_eq!(
            c.get("group.instance.id"),
            None,
            "static membership is opt-in"
        );

        s.session_timeout_ms = 1_500;
        s.heartbeat_interval_ms = 1_000;
        s.group_instance_id = Some("alloc-a".into());
        let c = s.consumer_config("g");
        assert_eq!(
            c.get("heartbeat.interval.ms"),
            Some("500"),
            "at most a third of the session timeout"
        );
        assert_eq!(c.get("group.instance.id"), Some("alloc-a"));
        // A replay consumer joins no group: no instance id, and still never commits by itself.
        let a = s.assign_config();
        assert_eq!(a.get("group.instance.id"), None);
        assert_eq!(a.get("enable.auto.commit"), Some("false"));
        assert_eq!(a.get("enable.auto.offset.store"), Some("false"));
    }

    #[test]
    fn topic_names_share_the_prefix() {
        let t = Topics::new("p");
        assert!(t.all().iter().all(|n| n.starts_with("p.")));
        assert_eq!(t.dlq(), "p.dlq");
    }
}
