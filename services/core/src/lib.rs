//! txflow-core: what every txflow service shares.
//!
//! - [`events`]: the Avro-described events and commands of the transaction pipeline, with their
//!   schemas (from `schemas/*.avsc`) compiled in.
//! - [`codec`] (from txflow-wire): Avro encoding, plain (datum) and in the Confluent wire format through a Schema
//!   Registry.
//! - [`kafka`] (from txflow-wire): client settings, topic names, topic administration.
//! - [`db`]: PostgreSQL connection and the embedded migrations.
//! - [`config`]: the typed configuration, from defaults and `TXFLOW_*` environment variables.
//! - [`config_file`]: the configuration file (`txflow --config`), the layer under the environment.
//! - [`role`]: the service roles and the error of a role that is not built yet.
//! - [`domain`]: the identities of txflow-domain (chain ids, signers, tokens, node ids, roles).
//! - [`lease`]: per-(role, chain, signer) leases with monotonic fencing tokens.
//! - [`fenced`]: fenced transactions, the only way to write critical state, and the nonce cursor.
//! - [`output`]: what a stage produces (`Output`), shared by the runtime and the outbox.
//! - [`outbox`]: the transactional outbox: announced events reach their topic at least once.
//! - [`stage`]: the stage runtime every consumer service runs on.
//! - [`fault`]: fault points for crash tests (feature `fault-injection`).
//! - [`telemetry`]: typed telemetry events.
//! - [`metrics`]: the metric instruments (OpenTelemetry; Prometheus and OTLP export).
//! - [`sampler`]: the gauges a role process samples from PostgreSQL and the broker.
//! - [`http`]: `/metrics`, `/healthz` and `/readyz`.
//! - [`otel`]: OpenTelemetry traces (OTLP export, the stage runtime's spans, `traceparent`).
//! - [`retry`]: the retry classification every error type carries.

pub mod chain;
pub mod config;
pub mod config_file;
pub mod db;
pub mod deps;
pub mod domain;
pub mod fault;
pub mod fenced;
pub mod holds;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod otel;
pub mod outbox;
pub mod output;
pub mod policy;
pub mod role;
pub mod sampler;
pub mod stage;
pub mod telemetry;
pub mod txstore;

// The domain (no I/O), re-exported so that `txflow_core::events::TxRequest` and the like keep
// one path for the services.
pub use txflow_domain::{events, failure, nonce_proof, request, retry, revert, state, transfer};
// The wire contract (codec, topics, keys, client settings), shared with txflow-client.
pub use txflow_wire::{codec, kafka};
