//! The receipt-checker role: SUBMITTED → MINED | REVERTED | REPLACED (issue 14 point 1).
//!
//! Consumes `tx.submitted` (its own role's leases, consumer group `{prefix}.receipt-checker`) and
//! follows the SUBMITTED transactions of its signers, rebuilt from PostgreSQL by the recovery scan
//! (on start, on assignment, every few seconds). In `drive`, outside any transaction, a pool of
//! `confirmations.receipt_workers` lookups asks `eth_getTransactionReceipt` for every attempt hash
//! of each due transaction; then one fenced transaction records what was found:
//! - a receipt → MINED (status 1) or REVERTED (status 0) with the receipt (which attempt, hash,
//!   block number and hash, status, gas used, effective gas price) in `managed_tx.receipt`,
//!   `mined_block_number`, `mined_block_hash`, in the statement of the move; `TxReceiptUpdated`
//!   on `tx.receipts` (announced through the outbox, a deterministic `event_id` per transaction
//!   and receipt);
//! - no receipt yet, or a lookup that failed (never a state change) → looked up again after a
//!   back-off (`managed_tx.next_receipt_check_at`);
//! - the signer's nonce past ours with no receipt for any of our hashes for
//!   `confirmations.stale_receipt_timeout` → REPLACED, only on proof (the block where the nonce
//!   passed holds none of our hashes: `txflow_core::nonce_proof`, shared with the broadcaster),
//!   and the allocator re-allocates it a fresh nonce.
//!
//! Not built yet: the block where the nonce passed is not required to be final (a reorg of it
//! could mislead the proof); receipts are not re-checked once recorded (the confirmation manager
//! follows mined transactions through reorgs).
//!
//! The stage's files, as every stage's:
//! - [`config`]: its settings ([`ReceiptCheckerConfig`]);
//! - [`handler`]: the [`Handler`](txflow_core::stage::Handler) — route, load, look up, decide,
//!   persist, outputs ([`ReceiptStage`]);
//! - [`decide`]: the pure decisions (what the lookups found, the receipt and its event, staleness,
//!   the back-off), with table tests;
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

pub use config::ReceiptCheckerConfig;
pub use handler::ReceiptStage;

/// The receipt checker's stage runtime on `deps`.
pub async fn runtime(
    deps: &Deps,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<ReceiptStage>, RoleError> {
    let config = &deps.config;
    let sc = StageConfig::for_pipeline(config, "receipt-checker", lease);
    let stage = ReceiptStage::new(
        ReceiptCheckerConfig::from_config(config),
        deps.chain.clone(),
    );
    deps.stage_runtime(stage, node, sc)
}

/// Runs the role on `deps` until `shutdown`.
pub async fn run_until(deps: &Deps, shutdown: CancellationToken) -> Result<(), RoleError> {
    let rt = runtime(deps, deps.config.node(), deps.config.lease()).await?;
    rt.run(shutdown).await?;
    Ok(())
}
