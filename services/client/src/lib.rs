//! txflow-client: what an upstream or downstream team depends on instead of re-implementing
//! txflow's contract (docs/client.md).
//!
//! - [`Producer`] publishes a [`TxRequest`] (or an operator's [`TxCommand`]) to `tx.requests`
//!   (`tx.commands`): Confluent-framed Avro through the Schema Registry, keyed `{chain}:{signer}`,
//!   with an `event_id` header, after the allocator's own validation
//!   ([`txflow_domain::request::validate`]), so that a bad address is refused here, not
//!   dead-lettered later.
//! - [`OutcomeReader`] consumes `tx.outcomes` (and `tx.confirmations` when asked) and applies the
//!   downstream contract of docs/events.md ("Booking from tx.outcomes") through a [`Book`]:
//!   deduplicate by `event_id`, never let a late event move a transaction back, book on
//!   `TxConfirmed`, reverse on `TxConfirmationReverted`. [`Book`] is pure and usable alone.
//!
//! Neither touches PostgreSQL or runs a stage: `cargo tree -p txflow-client` shows no sqlx.
//! Runnable examples: `examples/publish.rs` and `examples/outcomes.rs`.

mod book;
mod outcomes;
mod producer;

pub use book::{Book, Booking, Entry, Outcome, Progress, TxView};
pub use outcomes::{OutcomeReader, ReadOptions};
pub use producer::{Producer, Published};
pub use txflow_domain::events::{
    TxCommand, TxCommandKind, TxConfirmationReverted, TxConfirmed, TxFailed, TxReceiptUpdated,
    TxRequest, TxSubmitted,
};
pub use txflow_domain::request::Invalid;

use txflow_domain::retry::{Classify, Retry};

/// Where txflow's broker and registry are, and its topics' prefix.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// The Confluent-compatible Schema Registry.
    pub schema_registry_url: String,
    /// The prefix of every topic name (`txflow` by default: topics are `{prefix}.tx.requests`, ...).
    pub topic_prefix: String,
    /// The chain the requests are for: a request for another chain is refused (`WRONG_CHAIN`).
    pub chain_id: i64,
}

impl Settings {
    pub fn topics(&self) -> txflow_wire::kafka::Topics {
        txflow_wire::kafka::Topics::new(self.topic_prefix.clone())
    }

    pub fn kafka(&self) -> txflow_wire::kafka::KafkaSettings {
        txflow_wire::kafka::KafkaSettings::new(self.brokers.clone())
    }
}

/// Why a call of this crate failed. [`Classify::retry`] says whether to try again.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The request breaks the contract; the allocator would dead-letter it with this code.
    #[error("the request is refused before publishing: {0}")]
    Invalid(#[from] Invalid),
    #[error(transparent)]
    Codec(#[from] txflow_wire::codec::CodecError),
    #[error("kafka: {context}")]
    Kafka {
        context: String,
        #[source]
        source: rdkafka::error::KafkaError,
    },
}

impl Classify for ClientError {
    fn retry(&self) -> Retry {
        match self {
            ClientError::Invalid(_) => Retry::Permanent,
            ClientError::Codec(e) => e.retry(),
            // A broker that does not answer, a full queue, a timeout: try again later.
            ClientError::Kafka { .. } => Retry::Transient,
        }
    }
}
