//! The broadcaster role: SIGNED → SUBMITTED. The signed payload persisted by the signer gateway is
//! sent outside any transaction (the intent is already committed), the node's answer classified
//! (accepted / possibly sent / rejected retryable / permanent), and the submission recorded,
//! fenced. A send that fails for now is sent again within the drive, after a short bounded
//! backoff ([`decide::send_backoff`]); a transaction still SIGNED after that is sent again by the
//! recovery scan. Sending the same raw transaction twice is harmless (the node answers "already
//! known").
//!
//! "nonce too low" is ours (possibly sent) when the chain knows one of the transaction's hashes,
//! and REPLACED when it does not and the chain's nonce is past ours (the signer was used outside
//! txflow): the allocator then re-allocates a fresh nonce. A signer that cannot pay is held (see
//! `txflow_core::holds`), nothing failed. A transaction the node refuses for good is FAILED with
//! its nonce released. Submitted transactions the chain has not mined are sent again every
//! `resubmit_interval` (`TXFLOW_RESUBMIT_INTERVAL_MS`), each resubmission audited.
//!
//! Not built yet: stuck detection and fee bumps.
//!
//! The stage's files, as every stage's:
//! - [`config`]: its settings ([`BroadcasterConfig`]);
//! - [`handler`]: the [`Handler`](txflow_core::stage::Handler) — route, load, call the chain,
//!   decide, persist, outputs ([`BroadcastStage`]);
//! - [`decide`]: the pure decisions (the node's answers, whose nonce, due resubmissions), with
//!   table tests;
//! - [`store`]: its SQL, one function per transition, set-based and fenced.

pub mod config;
pub mod decide;
pub mod handler;
pub mod store;

use tokio_util::sync::CancellationToken;
use txflow_core::deps::Deps;
use txflow_core::domain::NodeId;
use txflow_core::lease::LeaseConfig;
use txflow_core::role::RoleError;
use txflow_core::stage::{StageConfig, StageRuntime};

pub use config::BroadcasterConfig;
pub use handler::BroadcastStage;

/// The broadcaster's stage runtime on `deps`.
pub async fn runtime(
    deps: &Deps,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<BroadcastStage>, RoleError> {
    runtime_with(deps, node, lease, |_| {}).await
}

/// [`runtime`] with the stage settings as `customize` leaves them (a test's recovery interval,
/// say).
pub async fn runtime_with(
    deps: &Deps,
    node: NodeId,
    lease: LeaseConfig,
    customize: impl FnOnce(&mut StageConfig),
) -> Result<StageRuntime<BroadcastStage>, RoleError> {
    let config = &deps.config;
    let mut sc = StageConfig::for_pipeline(config, "broadcaster", lease);
    customize(&mut sc);
    let stage = BroadcastStage::new(BroadcasterConfig::from_config(config), deps.chain.clone());
    deps.stage_runtime(stage, node, sc)
}

/// Runs the role on `deps` until `shutdown`.
pub async fn run_until(deps: &Deps, shutdown: CancellationToken) -> Result<(), RoleError> {
    let rt = runtime(deps, deps.config.node(), deps.config.lease()).await?;
    rt.run(shutdown).await?;
    Ok(())
}
