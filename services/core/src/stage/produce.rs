//! Producing: the outputs of a batch or a drive (encoded, enqueued in order, acknowledged
//! together), dead letters, and the `traceparent` that links an output to its input (traces
//! off) or to the span that produced it (traces exported: a `send` span per output, whose
//! context the header carries; see [`crate::otel`]).

use std::time::Duration;

use rdkafka::Message;
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::{Handler, Output, Rejection, StageRuntime};
use crate::otel;
use crate::telemetry;

/// Where the `traceparent` of an output comes from.
pub(super) enum Parent<'a> {
    /// Traces off: a new span id in the trace of the input's header (a new trace without one),
    /// as [`child_traceparent`] makes it.
    Header(Option<&'a str>),
    /// Traces exported: the output's `send` span is a child of `parent` (the span that produced
    /// it, or the recorded context of its transaction's trace), linked to `link`.
    Span {
        parent: opentelemetry::Context,
        link: Option<opentelemetry::trace::SpanContext>,
    },
}

impl<H: Handler> StageRuntime<H> {
    /// Encodes and produces `outputs` (each with the `traceparent` of its [`Parent`]), waiting
    /// for every acknowledgement; false if any could not be encoded or produced.
    pub(super) async fn produce(
        &self,
        producer: &FutureProducer,
        outputs: &[(&Output, Parent<'_>)],
    ) -> bool {
        // Encode everything first (the registry is consulted once per schema), then enqueue in
        // order, then await every acknowledgement: the idempotent producer keeps each partition's
        // order, and the batch pays one round trip instead of one per message.
        let mut encoded = Vec::with_capacity(outputs.len());
        for (o, parent) in outputs {
            match o.encode(&self.codec).await {
                Ok(p) => {
                    let (traceparent, span) = match parent {
                        Parent::Header(input) => (child_traceparent(*input), tracing::Span::none()),
                        Parent::Span { parent, link } => {
                            let span = otel::send_span(
                                &o.topic,
                                &o.key,
                                &o.event_id,
                                o.tx_id.as_deref(),
                                parent.clone(),
                                link.clone(),
                            );
                            let tp = otel::inject(&otel::context_of(&span))
                                .unwrap_or_else(|| child_traceparent(None));
                            (tp, span)
                        }
                    };
                    // The span ends with this function, once the broker answered.
                    encoded.push((*o, p, traceparent, span))
                }
                Err(e) => {
                    tracing::warn!(error = ?e, topic = %o.topic, "could not encode an output");
                    return false;
                }
            }
        }
        let sends = encoded.iter().map(|(o, payload, traceparent, _)| {
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
        let mut results = Vec::with_capacity(encoded.len());
        for (result, (o, _, _, span)) in futures::future::join_all(sends)
            .await
            .into_iter()
            .zip(&encoded)
        {
            if let Err((e, _)) = &result {
                tracing::warn!(parent: span, error = %e, topic = %o.topic, "could not produce an output");
                if is_broken(e) {
                    self.producer_broken
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
            results.push((o.event_id.as_str(), result.is_ok()));
        }
        let ok = results.iter().all(|(_, acked)| *acked);
        // The outbox: what the broker acknowledged is not relayed again (marked by the runtime's
        // flushing task, with other drives' marks). A failed mark only means a duplicate later,
        // never a loss.
        let acked = published(&results);
        self.marks.mark(&self.pool, acked).await;
        ok
    }

    /// Sends a message to the dead-letter topic with the reason in its headers; false if the
    /// broker did not acknowledge it (the message is then retried).
    pub(super) async fn dead_letter(
        &self,
        producer: &FutureProducer,
        m: &BorrowedMessage<'_>,
        r: &Rejection,
    ) -> bool {
        let record = dead_letter_record(&self.config.dlq_topic, m, &r.code, &r.message);
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

/// The value of header `name` of `m`, if present.
pub(super) fn header(m: &BorrowedMessage<'_>, name: &str) -> Option<String> {
    let headers = m.headers()?;
    headers
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The dead-letter record of `m`: its key and payload as they came, the reason (`error.code`,
/// `error.message`) and where it came from (`source.topic`, `.partition`, `.offset`) in headers.
/// Every consumer that dead-letters (the stage runtime, the spot ledger) builds it here.
pub fn dead_letter_record<'a>(
    dlq_topic: &'a str,
    m: &'a BorrowedMessage<'_>,
    code: &str,
    message: &str,
) -> FutureRecord<'a, [u8], [u8]> {
    let partition = m.partition().to_string();
    let offset = m.offset().to_string();
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "error.code",
            value: Some(code.as_bytes()),
        })
        .insert(Header {
            key: "error.message",
            value: Some(message.as_bytes()),
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
    let mut record: FutureRecord<'a, [u8], [u8]> = FutureRecord::to(dlq_topic).headers(headers);
    if let Some(k) = m.key() {
        record = record.key(k);
    }
    if let Some(p) = m.payload() {
        record = record.payload(p);
    }
    record
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

/// Whether a produce error means the producer itself will never produce again: the broker
/// fenced or forgot its producer id or epoch (a broker restarted without its state, a producer
/// that bumped its epoch past a broker pause longer than the delivery timeout: tansu then
/// answers ProducerFenced to everything), or librdkafka raised a fatal error. Only a new
/// producer (a new producer id) gets past it.
pub(super) fn is_broken(e: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(
            C::ProducerFenced
                | C::InvalidProducerEpoch
                | C::UnknownProducerId
                | C::InvalidProducerIdMapping
                | C::OutOfOrderSequenceNumber
                | C::Fatal
        )
    )
}

/// The events to mark published from the broker's answers (`event_id`, acknowledged): an event
/// produced on two topics (TxSubmitted and a receipt also go on `tx.outcomes`) only when every
/// one of its outputs was acknowledged, so that the relay produces the missing copy again.
fn published(results: &[(&str, bool)]) -> Vec<uuid::Uuid> {
    let failed: std::collections::HashSet<&str> = results
        .iter()
        .filter(|(_, acked)| !acked)
        .map(|(id, _)| *id)
        .collect();
    let mut ids: Vec<uuid::Uuid> = results
        .iter()
        .filter(|(id, acked)| *acked && !failed.contains(id))
        .filter_map(|(id, _)| uuid::Uuid::parse_str(id).ok())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn producer_state_errors_break_the_producer_and_others_do_not() {
        use rdkafka::error::KafkaError::MessageProduction as P;
        use rdkafka::types::RDKafkaErrorCode as C;
        for code in [
            C::ProducerFenced,
            C::InvalidProducerEpoch,
            C::UnknownProducerId,
            C::OutOfOrderSequenceNumber,
        ] {
            assert!(is_broken(&P(code)), "{code:?}");
        }
        for code in [
            C::MessageTimedOut,
            C::AllBrokersDown,
            C::UnknownTopicOrPartition,
            C::RequestTimedOut,
        ] {
            assert!(!is_broken(&P(code)), "{code:?}");
        }
    }

    #[test]
    fn traceparent_keeps_the_trace_and_makes_a_new_span() {
        let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let child = child_traceparent(Some(parent));
        assert!(child.starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
        assert_ne!(child, parent);
        let fresh = child_traceparent(Some("garbage"));
        assert_eq!(fresh.split('-').count(), 4);
    }

    #[test]
    fn an_event_is_published_only_when_every_copy_was_acknowledged() {
        let a = uuid::Uuid::now_v7().to_string();
        let b = uuid::Uuid::now_v7().to_string();
        let c = uuid::Uuid::now_v7().to_string();
        let results = [
            (a.as_str(), true),
            (a.as_str(), true),
            (b.as_str(), true),
            (b.as_str(), false),
            (c.as_str(), true),
            ("not-a-uuid", true),
        ];
        let ids: Vec<String> = published(&results).iter().map(|u| u.to_string()).collect();
        assert_eq!(ids, [a, c]);
    }
}
