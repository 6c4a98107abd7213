//! txflow-wire: what crosses the broker, and nothing that touches PostgreSQL.
//!
//! - [`codec`]: Avro encoding, plain (datum) and in the Confluent wire format through a Schema
//!   Registry.
//! - [`kafka`]: client settings the pipeline relies on, topic names, message keys, topic
//!   administration.
//!
//! The services reach these through `txflow_core::{codec, kafka}`; `txflow-client` (the library
//! of upstream and downstream teams) depends on this crate alone, with `txflow-domain`.

pub mod codec;
pub mod kafka;
