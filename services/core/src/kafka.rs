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

use crate::retry::{Classify, Retry};

/// Connection and tuning settings shared by producers and consumers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaSettings {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Longest time the broker may hold a fetch open waiting for data. Low values cut latency:
    /// tansu does not wake a waiting fetch when data arrives, so a hop costs about this much.
    pub fetch_wait_max_ms: u32,
    /// Producer batching delay.
    pub linger_ms: u32,
    /// Consumer group session timeout.
    pub session_timeout_ms: u32,
}

impl KafkaSettings {
    pub fn new(brokers: impl Into<String>) -> Self {
        KafkaSettings {
            brokers: brokers.into(),
            fetch_wait_max_ms: 10,
            linger_ms: 2,
            session_timeout_ms: 10_000,
        }
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
    /// explicitly.
    pub fn consumer_config(&self, group_id: &str) -> ClientConfig {
        let mut c = self.base();
        c.set("group.id", group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", self.fetch_wait_max_ms.to_string())
            .set("fetch.error.backoff.ms", "50")
            .set("session.timeout.ms", self.session_timeout_ms.to_string())
            .set(
                "heartbeat.interval.ms",
                (self.session_timeout_ms / 5).max(100).to_string(),
            )
            .set("partition.assignment.strategy", "range");
        c
    }

    /// A consumer outside any group, for replay by explicit assignment.
    pub fn assign_config(&self) -> ClientConfig {
        let mut c = self.consumer_config("txflow-unused");
        c.set("enable.auto.commit", "false");
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

/// Creates `topics` with `partitions` partitions each; topics that already exist are left alone.
pub async fn ensure_topics(
    settings: &KafkaSettings,
    topics: &[String],
    partitions: i32,
) -> Result<(), TopicAdminError> {
    let admin: AdminClient<DefaultClientContext> = settings
        .admin_config()
        .create()
        .map_err(TopicAdminError::Client)?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1)))
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = admin
        .create_topics(&new, &opts)
        .await
        .map_err(TopicAdminError::Request)?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(TopicAdminError::Topic { topic, code }),
        }
    }
    Ok(())
}

/// Deletes `topics` (best effort cleanup for tests and tools).
pub async fn delete_topics(
    settings: &KafkaSettings,
    topics: &[String],
) -> Result<(), TopicAdminError> {
    let admin: AdminClient<DefaultClientContext> = settings
        .admin_config()
        .create()
        .map_err(TopicAdminError::Client)?;
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = admin
        .delete_topics(&names, &opts)
        .await
        .map_err(TopicAdminError::Request)?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((topic, code)) => return Err(TopicAdminError::Topic { topic, code }),
        }
    }
    Ok(())
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
    fn topic_names_share_the_prefix() {
        let t = Topics::new("p");
        assert!(t.all().iter().all(|n| n.starts_with("p.")));
        assert_eq!(t.dlq(), "p.dlq");
    }
}
