//! Avro encoding of [`Event`]s: as a bare datum (golden tests, tools) and in the Confluent wire
//! format (`0x00`, 4-byte big-endian schema id, datum) through a Schema Registry.
//!
//! Schemas are registered under TopicNameStrategy (`{topic}-value`) with the schema text exactly
//! as written in `schemas/`, so that field defaults survive registration. Decoding reads with the
//! writer's schema from the registry and resolves to the reader's schema compiled into this
//! binary, so compatible evolution works in both directions.

use std::io::Cursor;

use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::types::Value;
use apache_avro::writer::datum::GenericDatumWriter;
use apache_avro::{Schema, from_value, to_value};
use schema_registry_converter::async_impl::easy_avro::{EasyAvroDecoder, EasyAvroEncoder};
use schema_registry_converter::async_impl::schema_registry::SrSettings;
use schema_registry_converter::error::SRCError;
use schema_registry_converter::schema_registry_common::{
    SchemaType, SubjectNameStrategy, SuppliedSchema,
};

use crate::kafka::Topics;
use txflow_domain::events::Event;
use txflow_domain::retry::{Classify, Retry};

/// Why a message could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The value does not fit the schema (a bug in the producer, or a broken schema).
    #[error("{name} does not fit its schema")]
    Encode {
        name: &'static str,
        #[source]
        source: apache_avro::Error,
    },
    /// The bytes are not a valid datum for the writer schema, or cannot be resolved to ours.
    #[error("message is not a valid {name}")]
    Decode {
        name: &'static str,
        #[source]
        source: apache_avro::Error,
    },
    /// The registry call failed; [`SRCError::retriable`] says whether it may succeed later.
    #[error("schema registry: {context}")]
    Registry {
        context: String,
        #[source]
        source: SRCError,
    },
    /// The message decoded, but as another record type than the one expected.
    #[error("expected a {expected} but the message is a {found}")]
    WrongType {
        expected: &'static str,
        found: String,
    },
}

impl Classify for CodecError {
    fn retry(&self) -> Retry {
        match self {
            CodecError::Registry { source, .. } if source.retriable => Retry::Transient,
            // The converter reports an unreachable registry as non-retriable; a connection
            // failure is still a transient condition for us.
            CodecError::Registry { source, .. }
                if source.error.contains("error sending request") =>
            {
                Retry::Transient
            }
            _ => Retry::Permanent,
        }
    }
}

/// Encodes an event as a bare Avro datum (no wire-format header) with its own schema.
pub fn encode_datum<E: Event>(event: &E) -> Result<Vec<u8>, CodecError> {
    let encode = |source| CodecError::Encode {
        name: E::FULL_NAME,
        source,
    };
    let value = to_value(event)
        .map_err(encode)?
        .resolve(E::schema())
        .map_err(encode)?;
    GenericDatumWriter::builder(E::schema())
        .build()
        .and_then(|w| w.write_value_to_vec(value))
        .map_err(encode)
}

/// Decodes a bare datum written with `writer` into `E`, resolving to `E`'s own schema.
pub fn decode_datum<E: Event>(writer: &Schema, bytes: &[u8]) -> Result<E, CodecError> {
    let decode = |source| CodecError::Decode {
        name: E::FULL_NAME,
        source,
    };
    let mut reader = Cursor::new(bytes);
    let value = GenericDatumReader::builder(writer)
        .reader_schema(E::schema())
        .build()
        .and_then(|r| r.read_value(&mut reader))
        .map_err(decode)?;
    if reader.position() != bytes.len() as u64 {
        return Err(CodecError::WrongType {
            expected: E::FULL_NAME,
            found: format!(
                "datum with {} trailing bytes",
                bytes.len() as u64 - reader.position()
            ),
        });
    }
    value_into::<E>(value)
}

fn value_into<E: Event>(value: Value) -> Result<E, CodecError> {
    from_value::<E>(&value).map_err(|source| CodecError::Decode {
        name: E::FULL_NAME,
        source,
    })
}

/// How a topic's value schemas are named in the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subjects {
    /// `{topic}-value`: the topic carries one record type (every topic but the outcomes topic).
    TopicName,
    /// `{topic}-{record full name}`: the topic carries several record types
    /// (`tx.outcomes`: TxAccepted, TxFailed, TxConfirmed).
    TopicRecordName,
}

/// The subject strategy for `E` on `topic`, carrying `E`'s schema text as written.
pub fn value_strategy<E: Event>(topic: &str, subjects: Subjects) -> SubjectNameStrategy {
    let supplied = SuppliedSchema::new(
        Some(E::FULL_NAME.to_string()),
        SchemaType::Avro,
        E::SCHEMA_JSON.to_string(),
    );
    match subjects {
        Subjects::TopicName => {
            SubjectNameStrategy::TopicNameStrategyWithSchema(topic.to_string(), false, supplied)
        }
        Subjects::TopicRecordName => {
            SubjectNameStrategy::TopicRecordNameStrategyWithSchema(topic.to_string(), supplied)
        }
    }
}

/// Confluent wire-format codec backed by a Schema Registry. Cheap to clone; schemas and ids are
/// cached after the first use.
#[derive(Clone, Debug)]
pub struct RegistryCodec {
    encoder: EasyAvroEncoder,
    decoder: EasyAvroDecoder,
}

impl RegistryCodec {
    pub fn new(registry_url: &str) -> Self {
        let settings = SrSettings::new(registry_url.trim_end_matches('/').to_string());
        RegistryCodec {
            encoder: EasyAvroEncoder::new(settings.clone()),
            decoder: EasyAvroDecoder::new(settings),
        }
    }

    /// Encodes `event` for `topic`, registering `E`'s schema under its subject on first use.
    pub async fn encode<E: Event>(
        &self,
        topic: &str,
        subjects: Subjects,
        event: &E,
    ) -> Result<Vec<u8>, CodecError> {
        self.encoder
            .encode_struct(event, &value_strategy::<E>(topic, subjects))
            .await
            .map_err(|source| CodecError::Registry {
                context: format!("encoding a {} for topic {topic}", E::FULL_NAME),
                source,
            })
    }

    /// Registers `E`'s schema for `topic` (if not yet registered) and returns its id.
    pub async fn register<E: Event>(
        &self,
        topic: &str,
        subjects: Subjects,
    ) -> Result<u32, CodecError> {
        let strategy = value_strategy::<E>(topic, subjects);
        let subject = strategy
            .get_subject()
            .map_err(|source| CodecError::Registry {
                context: format!("naming the subject of {} on {topic}", E::FULL_NAME),
                source,
            })?;
        let schema = self
            .encoder
            .get_schema_and_id(&subject, strategy)
            .await
            .map_err(|source| CodecError::Registry {
                context: format!("registering {} as {subject}", E::FULL_NAME),
                source,
            })?;
        Ok(schema.id)
    }

    /// Registers every schema of the transaction pipeline under the topics that carry it.
    pub async fn register_pipeline(
        &self,
        topics: &Topics,
    ) -> Result<Vec<(String, u32)>, CodecError> {
        use txflow_domain::events::*;
        let t = topics;
        let single = Subjects::TopicName;
        let multi = Subjects::TopicRecordName;
        Ok(vec![
            (
                TxRequest::FULL_NAME.into(),
                self.register::<TxRequest>(&t.tx_requests(), single).await?,
            ),
            (
                TxCommand::FULL_NAME.into(),
                self.register::<TxCommand>(&t.tx_commands(), single).await?,
            ),
            (
                TxAllocated::FULL_NAME.into(),
                self.register::<TxAllocated>(&t.tx_allocated(), single)
                    .await?,
            ),
            (
                TxSigned::FULL_NAME.into(),
                self.register::<TxSigned>(&t.tx_signed(), single).await?,
            ),
            (
                TxSubmitted::FULL_NAME.into(),
                self.register::<TxSubmitted>(&t.tx_submitted(), single)
                    .await?,
            ),
            (
                TxReceiptUpdated::FULL_NAME.into(),
                self.register::<TxReceiptUpdated>(&t.tx_receipts(), single)
                    .await?,
            ),
            (
                TxConfirmationsUpdated::FULL_NAME.into(),
                self.register::<TxConfirmationsUpdated>(&t.tx_confirmations(), single)
                    .await?,
            ),
            (
                TxAccepted::FULL_NAME.into(),
                self.register::<TxAccepted>(&t.tx_outcomes(), multi).await?,
            ),
            (
                TxFailed::FULL_NAME.into(),
                self.register::<TxFailed>(&t.tx_outcomes(), multi).await?,
            ),
            (
                TxConfirmed::FULL_NAME.into(),
                self.register::<TxConfirmed>(&t.tx_outcomes(), multi)
                    .await?,
            ),
            // Copies for downstream: the submission and the receipt also go on tx.outcomes.
            (
                TxSubmitted::FULL_NAME.into(),
                self.register::<TxSubmitted>(&t.tx_outcomes(), multi)
                    .await?,
            ),
            (
                TxReceiptUpdated::FULL_NAME.into(),
                self.register::<TxReceiptUpdated>(&t.tx_outcomes(), multi)
                    .await?,
            ),
            // Transfers (seed 004).
            (
                TransferRequested::FULL_NAME.into(),
                self.register::<TransferRequested>(&t.transfer_requests(), single)
                    .await?,
            ),
            (
                TransferUpdated::FULL_NAME.into(),
                self.register::<TransferUpdated>(&t.transfer_events(), single)
                    .await?,
            ),
            (
                SpotCommand::FULL_NAME.into(),
                self.register::<SpotCommand>(&t.spot_commands(), single)
                    .await?,
            ),
            (
                SpotReply::FULL_NAME.into(),
                self.register::<SpotReply>(&t.spot_events(), single).await?,
            ),
        ])
    }

    /// Decodes a wire-format message into `E`. Undecodable bytes and another record type are
    /// permanent errors (dead-letter them); an unreachable registry is transient.
    pub async fn decode<E: Event>(&self, bytes: &[u8]) -> Result<E, CodecError> {
        let result =
            self.decoder
                .decode(Some(bytes))
                .await
                .map_err(|source| CodecError::Registry {
                    context: format!("decoding a {}", E::FULL_NAME),
                    source,
                })?;
        let found = result.name.map(|n| n.fullname(None)).unwrap_or_default();
        if found != E::FULL_NAME {
            return Err(CodecError::WrongType {
                expected: E::FULL_NAME,
                found,
            });
        }
        let value = result
            .value
            .resolve(E::schema())
            .map_err(|source| CodecError::Decode {
                name: E::FULL_NAME,
                source,
            })?;
        value_into::<E>(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use txflow_domain::events::{TxCommand, TxCommandKind, TxRequest};

    fn request() -> TxRequest {
        TxRequest {
            event_id: "2f1c7a52-8b1e-4c1e-9a53-7d7f4f0a1b2c".into(),
            request_id: "order-1".into(),
            chain_id: 31337,
            signer: "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266".into(),
            to: "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into(),
            value: "1000000000000000000".into(),
            data: vec![0xde, 0xad, 0xbe, 0xef],
            gas_limit: None,
            max_fee_per_gas: Some("2000000000".into()),
            max_priority_fee_per_gas: None,
            metadata: [("desk".to_string(), "otc".to_string())]
                .into_iter()
                .collect(),
            depends_on_request_id: None,
            depends_on_signer: None,
            submitted_by: None,
        }
    }

    #[test]
    fn datum_round_trip() {
        let r = request();
        let bytes = encode_datum(&r).expect("encodes");
        let back: TxRequest = decode_datum(TxRequest::schema(), &bytes).expect("decodes");
        assert_eq!(back, r);
    }

    #[test]
    fn enum_round_trip() {
        let c = TxCommand {
            event_id: "e".into(),
            tx_id: "t".into(),
            chain_id: 1,
            signer: "0x00".into(),
            command: TxCommandKind::Cancel,
            requested_by: "ops".into(),
            reason: Some("fat finger".into()),
        };
        let back: TxCommand =
            decode_datum(TxCommand::schema(), &encode_datum(&c).expect("encodes"))
                .expect("decodes");
        assert_eq!(back, c);
    }

    #[test]
    fn garbage_is_a_permanent_decode_error() {
        let err = decode_datum::<TxRequest>(TxRequest::schema(), &[0xff, 0xff, 0xff, 0xff, 0x0f])
            .expect_err("garbage must not decode");
        assert_eq!(err.retry(), Retry::Permanent);
    }
}
