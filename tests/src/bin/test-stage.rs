//! The test stage as a process of its own, for crash tests (kill -9, fault points, SIGSTOP).
//! Configured by environment: TXFLOW_DATABASE_URL, TXFLOW_BROKERS, TXFLOW_SCHEMA_REGISTRY_URL,
//! TEST_STAGE_INPUT, TEST_STAGE_OUTCOMES, TEST_STAGE_DLQ, TEST_STAGE_GROUP, TEST_STAGE_NODE,
//! TEST_STAGE_LEASE_MS, TEST_STAGE_PARTITIONS, TEST_STAGE_RECOVERY_MS. Stops on SIGTERM.

use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use txflow_core::codec::RegistryCodec;
use txflow_core::domain::NodeId;
use txflow_core::kafka::KafkaSettings;
use txflow_core::lease::{LeaseConfig, LeaseManager};
use txflow_core::role::Role;
use txflow_core::stage::{StageConfig, StageRuntime};
use txflow_tests::test_stage::{TestStage, create_external_system};

fn var(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| format!("{name} is not set"))
}

fn millis(name: &str, default: u64) -> anyhow::Result<Duration> {
    Ok(Duration::from_millis(match std::env::var(name) {
        Ok(v) => v.parse().with_context(|| format!("{name}={v:?}"))?,
        Err(_) => default,
    }))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TXFLOW_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let pool = txflow_core::db::connect(&var("TXFLOW_DATABASE_URL")?, 4).await?;
    create_external_system(&pool).await?;
    let lease_ms = millis("TEST_STAGE_LEASE_MS", 2_000)?;
    let lease = LeaseConfig {
        duration: lease_ms,
        renew_interval: lease_ms / 4,
        clock_skew: lease_ms / 10,
    };
    let node = std::env::var("TEST_STAGE_NODE")
        .map(NodeId::named)
        .unwrap_or_else(|_| NodeId::generate());
    let leases = LeaseManager::new(pool.clone(), Role::Allocator, node, lease)?;
    let mut config = StageConfig::new(var("TEST_STAGE_GROUP")?, var("TEST_STAGE_DLQ")?);
    config.lease = lease;
    config.partitions = var("TEST_STAGE_PARTITIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    config.recovery_interval = millis("TEST_STAGE_RECOVERY_MS", 1_000)?;
    config.retry_backoff = Duration::from_millis(100);
    let outcomes = var("TEST_STAGE_OUTCOMES")?;
    config.topics = vec![outcomes.clone()];
    let mut kafka = KafkaSettings::new(var("TXFLOW_BROKERS")?);
    kafka.session_timeout_ms = 6_000;
    let runtime = StageRuntime::new(
        TestStage {
            input: var("TEST_STAGE_INPUT")?,
            outcomes,
        },
        pool,
        RegistryCodec::new(&var("TXFLOW_SCHEMA_REGISTRY_URL")?),
        kafka,
        leases,
        config,
    );
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    tokio::spawn(async move {
        if let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            term.recv().await;
        }
        trigger.cancel();
    });
    runtime.run(shutdown).await?;
    Ok(())
}
