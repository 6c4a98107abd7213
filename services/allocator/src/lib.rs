//! The allocator role: validates requests, records them (RECEIVED), simulates them (SIMULATED or
//! FAILED with the revert reason) and allocates nonces (ALLOCATED). Runs on the stage runtime.
//!
//! Not built yet: the destination whitelist and value limits, PENDING_APPROVAL and the
//! approve/cancel commands (issue #5).

pub mod handler;
pub mod validate;

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use txflow_core::chain::Chain;
use txflow_core::codec::RegistryCodec;
use txflow_core::config::Config;
use txflow_core::domain::{ChainId, NodeId};
use txflow_core::lease::{LeaseConfig, LeaseManager};
use txflow_core::role::{Role, RoleError};
use txflow_core::stage::{StageConfig, StageRuntime};

pub use handler::RequestStage;

/// The allocator's stage runtime for `config`.
pub async fn runtime(
    config: &Config,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<RequestStage>, RoleError> {
    let pool = txflow_core::db::connect(&config.database_url, 8).await?;
    let url = config
        .rpc_urls
        .first()
        .ok_or_else(|| RoleError::Config("TXFLOW_RPC_URLS is empty".into()))?;
    let chain = Chain::connect(url, config.chain_id as u64)?;
    let stage = RequestStage {
        topics: config.topics.clone(),
        chain,
        chain_id: ChainId(config.chain_id),
        nonce_state_timeout: Duration::from_secs(30),
    };
    let leases = LeaseManager::new(pool.clone(), Role::Allocator, node, lease)?;
    let mut sc = StageConfig::new(
        format!("{}.allocator", config.topics.prefix),
        config.topics.dlq(),
    );
    sc.lease = lease;
    sc.partitions = config.partitions;
    sc.topics = config.topics.all();
    Ok(StageRuntime::new(
        stage,
        pool,
        RegistryCodec::new(&config.schema_registry_url),
        config.kafka.clone(),
        leases,
        sc,
    ))
}

/// Runs the role until `shutdown`.
pub async fn run_until(config: &Config, shutdown: CancellationToken) -> Result<(), RoleError> {
    let rt = runtime(config, NodeId::generate(), LeaseConfig::default()).await?;
    rt.run(shutdown).await?;
    Ok(())
}

/// Runs the role until Ctrl-C.
pub async fn run(config: &Config) -> Result<(), RoleError> {
    run_until(config, ctrl_c()).await
}

fn ctrl_c() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        t.cancel();
    });
    token
}
