//! What the gateway produces: Avro in the Confluent wire format through the schema registry
//! (`Subjects::TopicName`), with the `traceparent` (W3C) and `event_id` headers the stage runtime
//! also writes, on an idempotent producer (`acks=all`). A publish waits for the broker's
//! acknowledgement, at most [`PUBLISH_TIMEOUT`].
//!
//! The gateway's topics (`transfer.requests`, `tx.requests`, `tx.commands`) are created at start
//! with `ensure_topics`; a broker that is down does not stop the gateway: the creation is retried
//! in the background, and `/readyz` answers 503 (`broker`) until it succeeded, or again after a
//! publish failed, until the broker answers an admin request again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use txflow_core::codec::{CodecError, RegistryCodec, Subjects};
use txflow_core::events::Event;
use txflow_core::kafka::{KafkaSettings, TopicAdminError, ensure_topics};
use txflow_core::retry::{Classify, Retry};

/// How long a publish (the registry lookup and the broker's acknowledgement) may take.
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the topics' creation is retried while the broker does not answer.
const SETUP_RETRY: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("publisher: creating the Kafka producer")]
    Producer(#[source] KafkaError),
    #[error("publisher: encoding a {name} for {topic}")]
    Encode {
        name: &'static str,
        topic: String,
        #[source]
        source: Box<CodecError>,
    },
    #[error("publisher: producing to {topic}")]
    Produce {
        topic: String,
        #[source]
        source: KafkaError,
    },
    #[error("publisher: no acknowledgement for {topic} within {timeout:?}")]
    Timeout { topic: String, timeout: Duration },
}

impl Classify for PublishError {
    fn retry(&self) -> Retry {
        match self {
            PublishError::Producer(_) => Retry::Permanent,
            PublishError::Encode { source, .. } => source.retry(),
            PublishError::Produce { .. } | PublishError::Timeout { .. } => Retry::Transient,
        }
    }
}

/// The gateway's producer, shared by every request.
pub struct Publisher {
    producer: FutureProducer,
    codec: RegistryCodec,
    kafka: KafkaSettings,
    topics: Vec<String>,
    partitions: i32,
    /// The topics exist and the broker answered since the last failed publish.
    ready: AtomicBool,
    /// One readiness probe at a time.
    probe: tokio::sync::Mutex<()>,
}

impl Publisher {
    /// A producer for `kafka` (created lazily by librdkafka: no connection is made here) that
    /// will create `topics` with `partitions` partitions each.
    pub fn new(
        kafka: &KafkaSettings,
        registry_url: &str,
        topics: Vec<String>,
        partitions: i32,
    ) -> Result<Publisher, PublishError> {
        let mut config = kafka.producer_config();
        // An undelivered message fails within the publish's time, not after the default 30 s.
        config.set(
            "message.timeout.ms",
            PUBLISH_TIMEOUT.as_millis().to_string(),
        );
        let producer: FutureProducer = config.create().map_err(PublishError::Producer)?;
        Ok(Publisher {
            producer,
            codec: RegistryCodec::new(registry_url),
            kafka: kafka.clone(),
            topics,
            partitions,
            ready: AtomicBool::new(false),
            probe: tokio::sync::Mutex::new(()),
        })
    }

    /// Produces `event` to `topic` under `key` with its `traceparent` and `event_id` headers, and
    /// waits for the broker's acknowledgement.
    pub async fn publish<E: Event>(
        &self,
        topic: &str,
        key: &str,
        event: &E,
        traceparent: &str,
    ) -> Result<(), PublishError> {
        let result = tokio::time::timeout(
            PUBLISH_TIMEOUT,
            self.produce(topic, key, event, traceparent),
        )
        .await
        .unwrap_or_else(|_| {
            Err(PublishError::Timeout {
                topic: topic.to_string(),
                timeout: PUBLISH_TIMEOUT,
            })
        });
        if result.is_err() {
            // Readiness probes the broker again before it says ready.
            self.ready.store(false, Ordering::Relaxed);
        }
        result
    }

    async fn produce<E: Event>(
        &self,
        topic: &str,
        key: &str,
        event: &E,
        traceparent: &str,
    ) -> Result<(), PublishError> {
        let payload = self
            .codec
            .encode(topic, Subjects::TopicName, event)
            .await
            .map_err(|source| PublishError::Encode {
                name: E::FULL_NAME,
                topic: topic.to_string(),
                source: Box::new(source),
            })?;
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "traceparent",
                value: Some(traceparent.as_bytes()),
            })
            .insert(Header {
                key: "event_id",
                value: Some(event.event_id().as_bytes()),
            });
        let record = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(&payload)
            .headers(headers);
        self.producer
            .send(record, Timeout::After(PUBLISH_TIMEOUT))
            .await
            .map(|_| ())
            .map_err(|(source, _)| PublishError::Produce {
                topic: topic.to_string(),
                source,
            })
    }

    /// Creates the gateway's topics (those that exist are left alone); on success the publisher
    /// is ready.
    pub async fn ensure_topics(&self) -> Result<(), TopicAdminError> {
        ensure_topics(&self.kafka, &self.topics, self.partitions).await?;
        self.ready.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Whether the broker is usable: the topics were created and no publish failed since, or
    /// else a new attempt to create them succeeds within `within`.
    pub async fn ready(&self, within: Duration) -> bool {
        if self.ready.load(Ordering::Relaxed) {
            return true;
        }
        let Ok(_guard) = tokio::time::timeout(within, self.probe.lock()).await else {
            return false;
        };
        if self.ready.load(Ordering::Relaxed) {
            return true;
        }
        matches!(
            tokio::time::timeout(within, self.ensure_topics()).await,
            Ok(Ok(()))
        )
    }

    /// Creates the topics in the background, retrying until it succeeds or `shutdown`.
    pub fn spawn_setup(self: &Arc<Self>, shutdown: CancellationToken) {
        let publisher = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                match publisher.ensure_topics().await {
                    Ok(()) => {
                        tracing::info!(topics = ?publisher.topics, "gateway: topics ready");
                        return;
                    }
                    Err(e) => tracing::warn!(
                        error = %e,
                        source = ?std::error::Error::source(&e).map(|s| s.to_string()),
                        retry_in_ms = SETUP_RETRY.as_millis() as u64,
                        "gateway: cannot create the topics yet (is the broker up?)"
                    ),
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(SETUP_RETRY) => {}
                }
            }
        });
    }
}

/// The `event_id` of a transfer's TransferRequested: derived from its `req_id`, so that the one
/// event of a transfer has one id whoever produces it. A UUID of version 8 (custom): the first 16
/// bytes of `sha256("txflow/TransferRequested/{req_id}")`, as `confirmed_event_id` does with
/// keccak for TxConfirmed.
pub fn transfer_requested_event_id(req_id: &str) -> uuid::Uuid {
    let digest = Sha256::digest(format!("txflow/TransferRequested/{req_id}").as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// The `traceparent` of what a request produces: a child of the request's own W3C
/// `traceparent` header when it has a valid one, else the root of a new trace.
pub fn traceparent_of(headers: &axum::http::HeaderMap) -> String {
    let parent = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    txflow_core::stage::child_traceparent(parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfers_event_id_is_one_per_req_id() {
        let a = transfer_requested_event_id("0190a7e0-0000-7000-8000-000000000001");
        let b = transfer_requested_event_id("0190a7e0-0000-7000-8000-000000000002");
        assert_eq!(
            a,
            transfer_requested_event_id("0190a7e0-0000-7000-8000-000000000001")
        );
        assert_ne!(a, b);
        assert_eq!(a.get_version_num(), 8);
    }

    #[test]
    fn a_request_traceparent_is_continued() {
        let mut h = axum::http::HeaderMap::new();
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        h.insert("traceparent", parent.parse().expect("header"));
        let child = traceparent_of(&h);
        assert!(
            child.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{child}"
        );
        assert_ne!(child, parent);
        let root = traceparent_of(&axum::http::HeaderMap::new());
        assert_eq!(root.split('-').count(), 4, "{root}");
    }
}
