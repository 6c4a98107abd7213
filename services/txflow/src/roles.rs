//! The roles this binary runs, in one place, and the one shutdown root they share.
//!
//! `main` (a role subcommand), `up` (every role in one process) and `local` (the pipeline for
//! `bench` and `demo`) all run roles through [`run_role`] with a child of the token that
//! [`shutdown_root`] cancels on SIGINT or SIGTERM, so that a stopping process finishes the batch
//! in hand, commits its offsets and releases its leases.

use tokio_util::sync::CancellationToken;
use txflow_core::config::Config;
use txflow_core::deps::Deps;
use txflow_core::role::Role;

/// A token cancelled on the first SIGINT (Ctrl-C) or SIGTERM (a supervisor stopping the
/// process). Roles take child tokens of it.
pub fn shutdown_root() -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let t = token.clone();
    tokio::spawn(async move {
        let which = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(
            signal = which,
            "shutting down: finishing batches, releasing leases"
        );
        t.cancel();
    });
    Ok(token)
}

/// Connects the clients the roles share (`stages` stage runtimes' worth of connections).
pub async fn deps(config: &Config, stages: u32) -> anyhow::Result<Deps> {
    Ok(Deps::connect(config, stages).await?)
}

/// How many stage runtimes `role` runs (the allocator runs two: requests and commands).
pub fn stages_of(role: Role) -> u32 {
    match role {
        Role::Allocator => 2,
        _ => 1,
    }
}

/// Starts what a process exports about itself, when configured: the metrics (when
/// `TXFLOW_METRICS_ADDR` or an OTLP endpoint is set — `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`,
/// `OTEL_EXPORTER_OTLP_ENDPOINT`, `telemetry.otlp_endpoint`; otherwise the instruments stay
/// no-ops), the known series at 0, the gauge sampler and the `/metrics`, `/healthz`, `/readyz`
/// server. All stop with `shutdown`. `service` is the default `service.name` ("txflow-<role>",
/// "txflow").
pub async fn observe(
    deps: &Deps,
    roles: &[Role],
    service: &str,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    use txflow_core::metrics;
    let config = &deps.config;
    let otlp = metrics::otlp_wanted(config.otlp_endpoint.as_deref());
    if config.metrics_addr.is_none() && !otlp {
        return Ok(());
    }
    match metrics::init(&metrics::Setup {
        service_name: config.otel_service_name.clone(),
        default_service_name: service.to_string(),
        otlp_endpoint: config.otlp_endpoint.clone(),
        otlp_interval: None,
    }) {
        Ok(()) => {}
        Err(metrics::MetricsError::AlreadyInitialised) => {}
        Err(e) => return Err(e.into()),
    }
    metrics::get().register(
        roles,
        txflow_core::domain::ChainId(config.chain_id),
        config.rpc_urls.len(),
    );
    let lag = roles
        .iter()
        .filter_map(|r| crate::replay::role_targets(*r, config).ok())
        .flatten()
        .map(|t| txflow_core::sampler::LagTarget {
            group: t.group,
            topic: t.topic,
        })
        .collect();
    let sampler = txflow_core::sampler::Sampler {
        pool: deps.pool.clone(),
        config: config.clone(),
        roles: roles.to_vec(),
        lag,
    };
    tokio::spawn(sampler.run(shutdown.child_token()));
    if let Some(addr) = &config.metrics_addr {
        let ready = txflow_core::http::Readiness {
            pool: deps.pool.clone(),
            chain: deps.chain.clone(),
            kafka: config.kafka.clone(),
            roles: roles.to_vec(),
        };
        txflow_core::http::start(addr, ready, shutdown.child_token()).await?;
    }
    Ok(())
}

/// Pushes the metrics not exported yet (OTLP) before the process exits.
pub async fn stop_metrics() {
    if txflow_core::metrics::enabled() {
        let _ = tokio::task::spawn_blocking(txflow_core::metrics::shutdown).await;
    }
}

/// Runs `role` on `deps` until `shutdown` is cancelled (or it fails, or it is not built yet).
pub async fn run_role(role: Role, deps: &Deps, shutdown: CancellationToken) -> anyhow::Result<()> {
    match role {
        Role::Allocator => txflow_allocator::run_until(deps, shutdown).await?,
        Role::SignerGateway => txflow_signer_gateway::run_until(deps, shutdown).await?,
        Role::Broadcaster => txflow_broadcaster::run_until(deps, shutdown).await?,
        Role::ReceiptChecker => txflow_receipt_checker::run_until(deps, shutdown).await?,
        Role::ConfirmationManager => txflow_confirmation_manager::run_until(deps, shutdown).await?,
        Role::TransferCoordinator => txflow_transfer_coordinator::run_until(deps, shutdown).await?,
        // In `txflow up` only (one process per ledger otherwise: `txflow spot-ledger`).
        Role::SpotLedger => {
            let spot = txflow_spot_ledger::config::SpotConfig::from_config(&deps.config);
            txflow_spot_ledger::run_until(spot, shutdown).await?
        }
        // In `txflow up` only, when its JWT key is configured (`txflow gateway` otherwise).
        Role::Gateway => {
            let gateway = txflow_gateway::config::GatewayConfig::from_config(&deps.config)?;
            txflow_gateway::serve(gateway, shutdown).await?
        }
    }
    Ok(())
}
