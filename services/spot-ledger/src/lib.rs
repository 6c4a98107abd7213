//! The spot-ledger role: the reference trading core of seed 004 (§5.3), the target and source of
//! internal transfers on the spot side. Balances in RAM (exact decimals, per-asset precision), an
//! fsync'd write-ahead log, the processed-operation set rebuilt from the log at start; idempotent
//! by `(req_id, op)`. Commands on `{prefix}.spot.commands`, replies on `{prefix}.spot.events`,
//! both keyed by user id (ARCHITECTURE.md, "Spot ledger").
//!
//! A CREDIT or DEBIT marked `external` is an outside movement (money entering or leaving the
//! trading core from outside the two ledgers), not a transfer leg: the ledger keeps its net per
//! (user, asset), rebuilt from the log, and a BALANCE reply carries it (`external_net`) for the
//! transfer conservation check (seed 004 §7.2).
//!
//! Single writer: it is an in-memory core, so one process per ledger. A second process on the
//! same log directory refuses to start (an exclusive lock); a second process on another directory
//! would be another ledger and diverge — do not run two.
//!
//! - `config.rs`: its settings, from the shared `Config` (`spot.wal_dir`, `spot.assets`);
//! - `decide.rs`: the ledger in RAM and the pure decisions;
//! - `store.rs`: the write-ahead log;
//! - `handler.rs`: the consume → decide → append → reply → commit loop.

pub mod config;
pub mod decide;
pub mod handler;
pub mod store;

pub use rust_decimal::Decimal;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;
use txflow_core::config::Config;
use txflow_core::kafka::{TopicAdminError, ensure_topics};

use crate::config::SpotConfig;
use crate::decide::{ApplyError, Ledger};
use crate::store::{Wal, WalError};

/// Why the spot ledger stopped.
#[derive(Debug, thiserror::Error)]
pub enum SpotError {
    #[error("spot-ledger write-ahead log")]
    Wal(#[from] WalError),
    #[error("spot-ledger: the write-ahead log does not replay")]
    Replay(#[from] ApplyError),
    #[error("spot-ledger: creating its topics")]
    Topics(#[from] TopicAdminError),
    #[error("spot-ledger: creating a Kafka client")]
    Kafka(#[from] KafkaError),
    #[error("spot-ledger: installing the signal handlers")]
    Signals(#[source] std::io::Error),
}

/// Opens the log and rebuilds the ledger from it.
pub fn recover(config: &SpotConfig) -> Result<(Wal, Ledger), SpotError> {
    let opened = Wal::open(&config.wal_dir)?;
    let mut ledger = Ledger::default();
    let n = opened.records.len();
    for r in opened.records {
        ledger.apply(r)?;
    }
    if opened.torn > 0 {
        tracing::warn!(
            path = %opened.wal.path().display(),
            bytes = opened.torn,
            "spot-ledger: cut off the torn tail of the write-ahead log (a write cut short by a crash, never acknowledged)"
        );
    }
    tracing::info!(path = %opened.wal.path().display(), records = n, "spot-ledger: ledger rebuilt from the write-ahead log");
    Ok((opened.wal, ledger))
}

/// Runs the role until SIGINT or SIGTERM.
pub async fn run(config: &Config) -> Result<(), SpotError> {
    let config = SpotConfig::from_config(config);
    let shutdown = CancellationToken::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(SpotError::Signals)?;
    let token = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        token.cancel();
    });
    run_until(config, shutdown).await
}

/// Runs the ledger on `config` until `shutdown` is cancelled.
pub async fn run_until(config: SpotConfig, shutdown: CancellationToken) -> Result<(), SpotError> {
    // The lock and the replay first: a second process fails at once, before touching Kafka.
    let (wal, ledger) = recover(&config)?;
    ensure_topics(&config.kafka, &config.topics, config.partitions).await?;
    let producer: FutureProducer = config.kafka.producer_config().create()?;
    let consumer: StreamConsumer = config.kafka.consumer_config(&config.group).create()?;
    consumer.subscribe(&[config.commands_topic.as_str()])?;
    tracing::info!(topic = %config.commands_topic, group = %config.group, "spot-ledger: consuming");
    let mut handler = handler::Handler::new(config, producer, wal, ledger);
    handler.run(&consumer, &shutdown).await
}
