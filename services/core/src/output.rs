//! What a stage produces: an event for a topic, encoded by the runtime after the commit
//! ([`Output`]). Its own module so that the stage runtime and the outbox ([`crate::outbox`]),
//! which both make outputs, do not depend on each other.

use std::future::Future;
use std::pin::Pin;

use crate::codec::{CodecError, RegistryCodec, Subjects};
use crate::events::Event;

/// A message for the output topics, encoded by the runtime after the commit.
pub struct Output {
    pub topic: String,
    pub key: String,
    pub event_id: String,
    /// The transaction the event is about (`Event::tx_id`): the traces follow it.
    pub tx_id: Option<String>,
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
            tx_id: event.tx_id().map(str::to_string),
            event: Box::new(Typed { event, subjects }),
        }
    }

    /// The event in the wire format of its topic (through the Schema Registry).
    pub(crate) fn encode<'a>(
        &'a self,
        codec: &'a RegistryCodec,
    ) -> BoxFuture<'a, Result<Vec<u8>, CodecError>> {
        self.event.encode(codec, &self.topic)
    }
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Output")
            .field("topic", &self.topic)
            .field("key", &self.key)
            .field("event_id", &self.event_id)
            .field("tx_id", &self.tx_id)
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
