//! Publishing requests and commands the way txflow's allocator expects them.

use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use txflow_domain::events::{TxCommand, TxRequest};
use txflow_domain::ids::ChainId;
use txflow_domain::request::validate;
use txflow_wire::codec::{RegistryCodec, Subjects};
use txflow_wire::kafka::{Topics, signer_key};

use crate::{ClientError, Settings};

/// How long a produce may wait for the broker's acknowledgement before it is an error.
const ACK_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the broker put a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub partition: i32,
    pub offset: i64,
}

/// Publishes [`TxRequest`]s to `tx.requests` and [`TxCommand`]s to `tx.commands`. Cheap to clone
/// (one producer and one registry cache underneath); share it between tasks.
#[derive(Clone)]
pub struct Producer {
    producer: FutureProducer,
    codec: RegistryCodec,
    topics: Topics,
    chain: ChainId,
}

impl Producer {
    /// An idempotent producer (`acks=all`) for `settings`. Connects lazily: a broker that is down
    /// shows at the first publish, as a transient error.
    pub fn new(settings: &Settings) -> Result<Producer, ClientError> {
        let producer = settings
            .kafka()
            .producer_config()
            .create()
            .map_err(|source| ClientError::Kafka {
                context: "creating the producer".into(),
                source,
            })?;
        Ok(Producer {
            producer,
            codec: RegistryCodec::new(&settings.schema_registry_url),
            topics: settings.topics(),
            chain: ChainId(settings.chain_id),
        })
    }

    /// Validates `r` as the allocator would, then publishes it keyed `{chain}:{signer}` with its
    /// `event_id` header; returns once the broker acknowledged it. An invalid request is
    /// [`ClientError::Invalid`] and never reaches the broker. Publishing the same request again
    /// (same `request_id` and signer) is safe: txflow executes it at most once.
    pub async fn publish(&self, r: &TxRequest) -> Result<Published, ClientError> {
        validate(r, self.chain)?;
        let topic = self.topics.tx_requests();
        let bytes = self.codec.encode(&topic, Subjects::TopicName, r).await?;
        self.send(
            &topic,
            &signer_key(r.chain_id, &r.signer),
            &r.event_id,
            &bytes,
        )
        .await
    }

    /// Publishes an operator's command (approve, cancel, bump) for one transaction.
    pub async fn command(&self, c: &TxCommand) -> Result<Published, ClientError> {
        let topic = self.topics.tx_commands();
        let bytes = self.codec.encode(&topic, Subjects::TopicName, c).await?;
        self.send(
            &topic,
            &signer_key(c.chain_id, &c.signer),
            &c.event_id,
            &bytes,
        )
        .await
    }

    /// Publishes `payload` to `tx.requests` as it is, with no validation and no encoding: for
    /// testing a consumer's handling of bad records (txflow dead-letters them and moves on).
    pub async fn publish_raw(&self, key: &str, payload: &[u8]) -> Result<Published, ClientError> {
        let topic = self.topics.tx_requests();
        self.send(&topic, key, &uuid::Uuid::new_v4().to_string(), payload)
            .await
    }

    async fn send(
        &self,
        topic: &str,
        key: &str,
        event_id: &str,
        payload: &[u8],
    ) -> Result<Published, ClientError> {
        let headers = OwnedHeaders::new().insert(Header {
            key: "event_id",
            value: Some(event_id),
        });
        let delivery = self
            .producer
            .send(
                FutureRecord::to(topic)
                    .key(key)
                    .payload(payload)
                    .headers(headers),
                ACK_TIMEOUT,
            )
            .await
            .map_err(|(source, _)| ClientError::Kafka {
                context: format!("publishing to {topic}"),
                source,
            })?;
        Ok(Published {
            partition: delivery.partition,
            offset: delivery.offset,
        })
    }
}
