//! The transfer-coordinator role: internal transfers between the FUNDING ledger (PostgreSQL) and
//! the SPOT ledger (the trading core) without a shared transaction (seed 004; ARCHITECTURE.md,
//! "Transfers").
//!
//! Consumes `transfer.requests` (keyed by user; consumer group `{prefix}.transfer-coordinator`)
//! on the stage runtime with one lease per user, and drives each transfer through the state
//! machine of §2 — every state persisted by a fenced CAS before the adapter call it leads to,
//! only an explicit failure compensated (§2.3) — announcing each state on `transfer.events`.
//! The recovery worker of §6 is the runtime's recovery scan (on start, on assignment, and every
//! few seconds: the users with an open transfer that has not moved for `transfer.stale_ms`).
//! The conservation check of §7.2 runs every `transfer.check_interval_ms` ([`conservation`]).
//!
//! The stage's files, as every stage's:
//! - [`config`]: its settings ([`CoordinatorConfig`]);
//! - [`handler`]: the [`Handler`](txflow_core::stage::Handler) ([`CoordinatorStage`]);
//! - [`decide`]: the pure decisions (the step of each state, adapter results as responses);
//! - [`store`]: its SQL, one fenced CAS per transition;
//! - the adapters: [`funding`] (PostgreSQL) and [`spot`] (the spot ledger's command topics).

pub mod config;
pub mod conservation;
pub mod decide;
pub mod funding;
pub mod handler;
pub mod spot;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use txflow_core::deps::Deps;
use txflow_core::domain::NodeId;
use txflow_core::kafka::{TopicAdminError, ensure_topics};
use txflow_core::lease::LeaseConfig;
use txflow_core::retry::{Classify, Retry};
use txflow_core::role::RoleError;
use txflow_core::stage::{StageConfig, StageRuntime};

pub use config::CoordinatorConfig;
pub use handler::CoordinatorStage;

/// Why the coordinator could not run.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error("transfer coordinator: creating its topics")]
    Topics(#[source] TopicAdminError),
    #[error("transfer coordinator: starting the SPOT adapter")]
    Spot(#[source] spot::SpotAdapterError),
    #[error("transfer coordinator")]
    Role(#[from] RoleError),
}

impl Classify for CoordinatorError {
    fn retry(&self) -> Retry {
        match self {
            CoordinatorError::Topics(e) => e.retry(),
            CoordinatorError::Spot(e) => e.retry(),
            CoordinatorError::Role(e) => e.retry(),
        }
    }
}

/// The coordinator's stage runtime on `deps` (its topics created, its SPOT adapter started).
pub async fn runtime(
    deps: &Deps,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<CoordinatorStage>, CoordinatorError> {
    let config = &deps.config;
    let cc = CoordinatorConfig::from_config(config);
    let mut sc = StageConfig::for_pipeline(config, "transfer-coordinator", lease);
    sc.topics = config.topics.transfers();
    // Transfer events are announced from `drive`, not through the transaction outbox.
    sc.outbox = None;
    // The recovery worker looks for stale transfers twice per stale period (at most every 5 s).
    sc.recovery_interval = (cc.stale / 2).clamp(Duration::from_millis(200), Duration::from_secs(5));
    ensure_topics(&config.kafka, &sc.topics, sc.partitions)
        .await
        .map_err(CoordinatorError::Topics)?;
    // The adapter re-validates against the asset rules it is given; FUNDING reads them itself.
    let assets = funding::load_assets(&deps.pool)
        .await
        .map_err(|e| RoleError::ConfigSource {
            message: "transfer coordinator: reading the asset rules".into(),
            source: Box::new(e),
        })?;
    let spot = spot::SpotAdapter::start(cc.spot.clone(), assets)
        .await
        .map_err(CoordinatorError::Spot)?;
    let stage = CoordinatorStage::new(cc, deps.pool.clone(), Arc::new(spot));
    Ok(deps.stage_runtime(stage, node, sc)?)
}

/// Runs the role on `deps` until `shutdown`.
pub async fn run_until(deps: &Deps, shutdown: CancellationToken) -> Result<(), CoordinatorError> {
    let rt = runtime(deps, deps.config.node(), deps.config.lease()).await?;
    let spot = rt.handler().spot();
    let check = conservation::Conservation::new(deps.pool.clone(), spot.clone());
    let every = CoordinatorConfig::from_config(&deps.config).check_interval;
    let checking = tokio::spawn(check.run(every, shutdown.child_token()));
    let ran = rt.run(shutdown.clone()).await.map_err(RoleError::from);
    shutdown.cancel();
    let _ = checking.await;
    // The reply reader's consumer is dropped before the process exits (see `SpotAdapter::close`).
    spot.close().await;
    ran?;
    Ok(())
}
