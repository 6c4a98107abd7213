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
use txflow_core::codec::RegistryCodec;
use txflow_core::config::Config;
use txflow_core::domain::NodeId;
use txflow_core::lease::{LeaseConfig, LeaseManager};
use txflow_core::role::{Role, RoleError};
use txflow_core::stage::{StageConfig, StageRuntime};

pub use config::AllocatorConfig;
pub use handler::{CommandStage, RequestStage};
pub use txflow_core::policy::{Policy, Verdict};

/// The allocator's two stage runtimes for `config`: requests and commands.
pub async fn runtimes(
    config: &Config,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<(StageRuntime<Arc<RequestStage>>, StageRuntime<CommandStage>), RoleError> {
    let pool = txflow_core::db::connect(&config.database_url, 8).await?;
    let stage = Arc::new(RequestStage {
        config: AllocatorConfig::from_config(config)?,
        chain: Arc::new(config.chain()?),
    });
    let codec = RegistryCodec::new(&config.schema_registry_url);
    let stage_config = |group: &str| StageConfig::for_pipeline(config, group, lease);
    let requests = StageRuntime::new(
        stage.clone(),
        pool.clone(),
        codec.clone(),
        config.kafka.clone(),
        LeaseManager::new(pool.clone(), Role::Allocator, node.clone(), lease)?,
        stage_config("allocator"),
    );
    let commands = StageRuntime::new(
        CommandStage { requests: stage },
        pool.clone(),
        codec,
        config.kafka.clone(),
        LeaseManager::new(pool, Role::Allocator, node, lease)?,
        stage_config("allocator.commands"),
    );
    Ok((requests, commands))
}

/// Runs the role until `shutdown`.
pub async fn run_until(config: &Config, shutdown: CancellationToken) -> Result<(), RoleError> {
    let (requests, commands) = runtimes(config, config.node(), config.lease()).await?;
    let (a, b) = tokio::join!(
        requests.run(shutdown.child_token()),
        commands.run(shutdown.child_token())
    );
    a?;
    b?;
    Ok(())
}

/// Runs the role until Ctrl-C.
pub async fn run(config: &Config) -> Result<(), RoleError> {
    run_until(config, txflow_core::stage::ctrl_c_token()).await
}
