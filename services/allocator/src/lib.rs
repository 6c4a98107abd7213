//! The allocator role: validates requests, records them (RECEIVED), simulates them (SIMULATED,
//! PENDING_APPROVAL above the approval threshold, or FAILED with the reason) and allocates nonces
//! (ALLOCATED). Approve/cancel commands arrive on `tx.commands` and run on a second stage runtime
//! under the same role and node.
//!
//! Files, as in every stage: `config.rs` (settings), `handler.rs` (route → load → decide →
//! persist → outputs), `decide.rs` (pure decisions, table-tested), `store.rs` (the SQL, one
//! function per transition). This file only wires them to the runtime.

pub mod config;
pub mod decide;
pub mod handler;
pub mod store;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use txflow_core::deps::Deps;
use txflow_core::domain::NodeId;
use txflow_core::lease::{LeaseConfig, LeaseManager};
use txflow_core::role::{Role, RoleError};
use txflow_core::stage::{StageConfig, StageRuntime};

pub use config::AllocatorConfig;
pub use handler::{CommandStage, RequestStage};
pub use txflow_core::policy::{Policy, Verdict};

/// The allocator's two stage runtimes on `deps`: requests and commands, on one lease manager
/// (one role, one node), whose signer locks keep their drives of a signer one at a time.
pub async fn runtimes(
    deps: &Deps,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<(StageRuntime<Arc<RequestStage>>, StageRuntime<CommandStage>), RoleError> {
    let config = &deps.config;
    let stage = Arc::new(RequestStage {
        config: AllocatorConfig::from_config(config)?,
        chain: deps.chain.clone(),
    });
    let stage_config = |group: &str| StageConfig::for_pipeline(config, group, lease);
    // One manager for both runtimes: they act under the same leases (role and node), and its
    // clones share the signer locks, so that the two never drive one signer at once (both would
    // pass the fence, and both simulate and allocate the same requests).
    let leases = LeaseManager::new(deps.pool.clone(), Role::Allocator, node, lease)?;
    let requests = StageRuntime::new(
        stage.clone(),
        deps.pool.clone(),
        deps.codec.clone(),
        config.kafka.clone(),
        leases.clone(),
        stage_config("allocator"),
    );
    let commands = StageRuntime::new(
        CommandStage { requests: stage },
        deps.pool.clone(),
        deps.codec.clone(),
        config.kafka.clone(),
        leases,
        stage_config("allocator.commands"),
    );
    Ok((requests, commands))
}

/// Runs the role on `deps` until `shutdown`: the batches in hand finish and the leases are
/// released.
pub async fn run_until(deps: &Deps, shutdown: CancellationToken) -> Result<(), RoleError> {
    let (requests, commands) = runtimes(deps, deps.config.node(), deps.config.lease()).await?;
    let (a, b) = tokio::join!(
        requests.run(shutdown.child_token()),
        commands.run(shutdown.child_token())
    );
    a?;
    b?;
    Ok(())
}
