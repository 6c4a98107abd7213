//! The confirmation-manager role: MINED → CONFIRMED and REVERTED settled at the required depth,
//! with each transaction's confirmation list announced on `tx.confirmations` (seed 001 §6.5,
//! newFork) and its final outcome (TxConfirmed, one `event_id` per transaction) on `tx.outcomes`;
//! reorgs.
//!
//! - It consumes `tx.receipts` (TxReceiptUpdated); the work is in the drives, which follow the
//!   chain's heads ([`heads`]) for every signer with followed transactions (MINED, REVERTED not
//!   settled, final ones watched for a deeper reorg), right after a batch and on every recovery
//!   scan ([`config::POLL_INTERVAL`]).
//! - The list of a transaction is the canonical blocks from its own up to the head, at most
//!   `confirmations.required` (`TXFLOW_CONFIRMATIONS_REQUIRED`) of them; each announcement
//!   carries the complete list: `new_fork = false` when it extends the one announced before,
//!   `true` when a block announced before is no longer canonical (it replaces it). At the required
//!   depth: CONFIRMED (or REVERTED settled) and TxConfirmed, never before a lower nonce of the
//!   signer is mined.
//! - A reorg that removes the block of a transaction not final yet sends it back to SUBMITTED
//!   (its receipt cleared, announced `new_fork = true` with an empty list) and sends its signed
//!   bytes again at once (anvil does not re-pool reorged transactions); the broadcaster's
//!   resubmission, scheduled in the same transaction, backs the send up.
//! - A reorg deeper than the required depth (the block of a final transaction is gone) raises the
//!   critical alert `confirmed_tx_reorged` (ERROR, target `txflow::alert`), announces
//!   `new_fork = true` with an empty list, keeps the transaction in its state with `reorged_at`
//!   set, and re-evaluates the outcome on the chain's proof — never rolling it back before the
//!   nonce is settled (seed 000 §4.4). Meanwhile the defensive cancellation goes out: the signer
//!   gateway (which holds the keys) signs a 0-value self-transfer at the nonce with a high priority
//!   fee and records it in `tx_cancellations`; the broadcaster sends it, again every
//!   `TXFLOW_RESUBMIT_INTERVAL_MS`, while the transaction is re-evaluated and not mined again.
//!   Whichever is mined settles it: its own attempt mined again → followed to the depth again (a
//!   TxConfirmed of the next generation); its nonce consumed at the depth by anything else (the
//!   cancellation, recorded as such in the `TxReorgUndone` audit row, or a transaction txflow did
//!   not send) → back to RECEIVED, simulated and checked against the policy again, then a fresh
//!   nonce (or an approval first, with `approval.after_deep_reorg`).
//!
//! The stage's files, as every stage's:
//! - [`config`]: its settings ([`ConfirmationConfig`]);
//! - [`handler`]: the [`Handler`](txflow_core::stage::Handler) ([`ConfirmStage`]);
//! - [`decide`]: the pure decisions (the list, newFork, finality, reorgs), with table tests;
//! - [`store`]: its SQL, set-based and fenced;
//! - [`heads`]: the chain's heads, followed and shared by the drives.

pub mod config;
pub mod decide;
pub mod handler;
pub mod heads;
pub mod store;

use tokio_util::sync::CancellationToken;
use txflow_core::deps::Deps;
use txflow_core::domain::NodeId;
use txflow_core::lease::LeaseConfig;
use txflow_core::role::RoleError;
use txflow_core::stage::{StageConfig, StageRuntime};

pub use config::ConfirmationConfig;
pub use handler::{ConfirmError, ConfirmStage, DEEP_REORG_ALERT};

/// The confirmation manager's stage runtime on `deps`.
pub async fn runtime(
    deps: &Deps,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<ConfirmStage>, RoleError> {
    runtime_with(
        deps,
        ConfirmationConfig::from_config(&deps.config),
        node,
        lease,
    )
    .await
}

/// [`runtime`] with settings of the caller's (a test's poll interval, say).
pub async fn runtime_with(
    deps: &Deps,
    settings: ConfirmationConfig,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<ConfirmStage>, RoleError> {
    let mut sc = StageConfig::for_pipeline(&deps.config, "confirmation-manager", lease);
    // The heads are followed on every recovery scan.
    sc.recovery_interval = settings.poll_interval;
    let stage = ConfirmStage::new(settings, deps.chain.clone());
    deps.stage_runtime(stage, node, sc)
}

/// Runs the role on `deps` until `shutdown`.
pub async fn run_until(deps: &Deps, shutdown: CancellationToken) -> Result<(), RoleError> {
    let rt = runtime(deps, deps.config.node(), deps.config.lease()).await?;
    rt.run(shutdown).await?;
    Ok(())
}
