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

/// Runs `role` on `deps` until `shutdown` is cancelled (or it fails, or it is not built yet).
pub async fn run_role(role: Role, deps: &Deps, shutdown: CancellationToken) -> anyhow::Result<()> {
    match role {
        Role::Allocator => txflow_allocator::run_until(deps, shutdown).await?,
        Role::SignerGateway => txflow_signer_gateway::run_until(deps, shutdown).await?,
        Role::Broadcaster => txflow_broadcaster::run_until(deps, shutdown).await?,
        Role::ReceiptChecker => txflow_receipt_checker::run_until(deps, shutdown).await?,
        Role::ConfirmationManager => txflow_confirmation_manager::run_until(deps, shutdown).await?,
        other => run_unbuilt(other, &deps.config).await?,
    }
    Ok(())
}

/// The roles whose issue has not landed: they say so (needing no connection).
pub async fn run_unbuilt(role: Role, config: &Config) -> anyhow::Result<()> {
    match role {
        Role::TransferCoordinator => txflow_transfer_coordinator::run(config).await?,
        Role::SpotLedger => txflow_spot_ledger::run(config).await?,
        Role::Gateway => txflow_gateway::run(config).await?,
        Role::Allocator
        | Role::SignerGateway
        | Role::Broadcaster
        | Role::ReceiptChecker
        | Role::ConfirmationManager => {
            anyhow::bail!("{role} needs its clients: run it with run_role")
        }
    }
    Ok(())
}
