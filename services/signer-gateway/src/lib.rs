//! The signer gateway role: ALLOCATED → SIGNED. Signs with alloy's local signer (keys from
//! `TXFLOW_SIGNER_KEYS` or encrypted keystores, never logged) and persists the raw transaction and
//! its hash as attempt 1 before announcing TxSigned; a persisted attempt is never signed again.
//!
//! What is signed is what PostgreSQL holds for the transaction, never what the TxAllocated event
//! claims: an event that disagrees with the row is dead-lettered. The policy is checked again
//! before signing (the configuration may have tightened since allocation, or the row was written
//! by something other than the allocator); a refused transaction becomes FAILED (POLICY_DENIED)
//! and its nonce is released to `recycled_nonces` for the signer's next request; so is a
//! transaction that cannot be signed at all (no key for its signer, a signing failure).
//!
//! No database transaction is open while a transaction is signed (a remote signer, a KMS or an
//! HSM behind [`keys::TxSigner`], takes hundreds of milliseconds): a TxAllocated message writes
//! nothing, and the drive after its batch reads the rows, signs them in parallel, then records the
//! signatures in one short fenced transaction (a row that moved meanwhile is left alone).
//!
//! Signing is driven by PostgreSQL as well as by events: the recovery scan signs every ALLOCATED
//! transaction of the signers this instance owns, so a TxAllocated that was never produced (a
//! crash between the allocator's commit and its produce) or that the broker lost delays nothing.
//!
//! The defensive cancellation of seed 000 §4.4 is signed here too, since the keys are here: when a
//! reorg deeper than the required depth undid a final transaction (the confirmation manager set
//! its `reorged_at`), the recovery scan signs a 0-value transfer to the signer at its nonce with a
//! high priority fee — twice the original attempt's caps or the market's (`eth_feeHistory`),
//! within `fees.max_fee_per_gas` (`TXFLOW_MAX_FEE_PER_GAS_WEI`) — and records it in
//! `tx_cancellations`, fenced; the broadcaster sends it. Logged as `reorg_cancellation_signed`;
//! one that cannot be signed is the critical alert `reorg_cancellation_unsigned`.
//!
//! Gas bumps (seed 003) are signed here for the same reason: the recovery scan looks at the
//! signer's SUBMITTED transactions, and one whose nonce has waited at the head of the queue for
//! `resubmit.bump_after_ms`, or whose max fee the base fee has passed, is signed again at its nonce
//! as attempt n+1 with both caps raised by at least `resubmit.bump_percent` (and to the market's,
//! within `fees.max_fee_per_gas`), recorded in `tx_attempts`, fenced, due to be sent at once; the
//! broadcaster's resubmission sends the latest attempt. Logged as `gas_bumped`; a transaction the
//! cap keeps from being raised is the critical alert `gas_bump_at_cap` (its latest attempt is
//! still sent again).
//!
//! The files, as in every stage: `config` (settings), `handler` (route → load → decide → persist
//! → outputs), `decide` (pure decisions, table-tested), `store` (the SQL, one function per
//! transition), `keys` (the local keys). This file only wires them.

pub mod config;
pub mod decide;
pub mod handler;
pub mod keys;
pub mod store;

pub use config::SignerConfig;
pub use handler::{BumpSettings, SignStage};
pub use keys::{KeyError, Keys, SigningError, TxSigner};

use tokio_util::sync::CancellationToken;
use txflow_core::deps::Deps;
use txflow_core::domain::NodeId;
use txflow_core::lease::LeaseConfig;
use txflow_core::role::RoleError;
use txflow_core::stage::{StageConfig, StageRuntime};

/// The signer gateway's stage runtime on `deps`, with `keys`.
pub async fn runtime(
    deps: &Deps,
    keys: Keys,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<SignStage>, RoleError> {
    let config = &deps.config;
    let sc = StageConfig::for_pipeline(config, "signer-gateway", lease);
    let stage = SignStage::new(SignerConfig::from_config(config)?, keys)
        .with_cancellations(deps.chain.clone(), config.max_fee_per_gas_wei)
        .with_bumps(BumpSettings {
            after_ms: config.bump_after_ms,
            percent: config.bump_percent,
        });
    deps.stage_runtime(stage, node, sc)
}

/// Runs the role on `deps` until `shutdown`, with the keys of its configuration.
pub async fn run_until(deps: &Deps, shutdown: CancellationToken) -> Result<(), RoleError> {
    let keys = Keys::load(&deps.config)?;
    if keys.is_empty() {
        tracing::warn!(
            "no signing keys: set TXFLOW_SIGNER_KEYS or TXFLOW_SIGNER_KEYSTORE; every allocated transaction will be FAILED with NO_SIGNING_KEY and its nonce released"
        );
    } else {
        tracing::info!(signers = ?keys.addresses(), "signing keys loaded");
    }
    let rt = runtime(deps, keys, deps.config.node(), deps.config.lease()).await?;
    rt.run(shutdown).await?;
    Ok(())
}
