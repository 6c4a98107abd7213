//! The signer gateway stage: route → load → decide ([`crate::decide`]) → sign, with no database
//! transaction open → persist ([`crate::store`], fenced) → outputs (TxSigned on `tx.signed`,
//! TxFailed on `tx.outcomes`).
//!
//! A signature can take hundreds of milliseconds (a remote signer: a KMS, an HSM), so no
//! transaction is ever open while one is made: as in the broadcaster, a TxAllocated message writes
//! nothing. Its batch reads the row, answers what needs no signature (a transaction signed before
//! re-announces its stored TxSigned, an event that disagrees with the row is dead-lettered) and
//! hands the rows to sign to the drive that follows the batch's commit. The drive (that one, and
//! the recovery scan's for every ALLOCATED row of the signer) decides on the rows as read, signs
//! them in parallel with no transaction open, then records in one short fenced transaction: the
//! rows locked and compared with what was signed, ALLOCATED → SIGNED with the attempt rows (or
//! → FAILED, the nonce released), set-based; a row that moved meanwhile is left alone.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use alloy::primitives::U256;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use txflow_core::chain::{ChainClient, SignedTx, UnsignedTx};
use txflow_core::codec::Subjects;
use txflow_core::config::{
    DEFAULT_BUMP_AFTER_MS, DEFAULT_BUMP_PERCENT, DEFAULT_MAX_FEE_PER_GAS_WEI,
};
use txflow_core::domain::{ChainId, Signer, TxPayload};
use txflow_core::events::{TxAllocated, TxFailed, TxSigned};
use txflow_core::failure::{FailureCode, truncate_reason};
use txflow_core::fenced::Fenced;
use txflow_core::kafka::signer_key;
use txflow_core::lease::LeaseKey;
use txflow_core::metrics;
use txflow_core::retry::Classify;
use txflow_core::role::Role;
use txflow_core::stage::{BatchResults, DriveCtx, Handler, HandlerError, Output, Rejection};
use txflow_core::state::TxState;
use txflow_core::txstore::TxRow;
use uuid::Uuid;

use crate::config::SignerConfig;
use crate::decide::{self, Decision, Input};
use crate::keys::{Keys, SigningError, TxSigner};
use crate::store::{self, Failing, Signing};

/// How many signatures of one signer are in progress at once: a remote signer's latency is paid
/// once per this many transactions, not once per transaction.
pub const SIGN_CONCURRENCY: usize = 16;

/// The rows messages asked to have signed, by signer (as their batch read them, by id).
type Asked = HashMap<(ChainId, Signer), HashMap<Uuid, TxRow>>;

/// The signer gateway's stage: its settings and its keys.
pub struct SignStage {
    pub config: SignerConfig,
    pub keys: Keys,
    /// How the defensive cancellations after a deep reorg, and the gas bumps, are priced.
    cancellations: CancelPricing,
    /// When a sent transaction is bumped, and by how much.
    bumps: BumpSettings,
    /// What the drive right after a batch signs: the rows its messages asked for. A hint only:
    /// the drive decides again on each row and records only what PostgreSQL still holds as read,
    /// and the recovery scan signs every ALLOCATED row whatever is here.
    asked: Mutex<Asked>,
}

/// `resubmit.bump_after_ms` and `resubmit.bump_percent`.
#[derive(Debug, Clone, Copy)]
pub struct BumpSettings {
    pub after_ms: u64,
    pub percent: u32,
}

impl Default for BumpSettings {
    fn default() -> BumpSettings {
        BumpSettings {
            after_ms: DEFAULT_BUMP_AFTER_MS,
            percent: DEFAULT_BUMP_PERCENT,
        }
    }
}

/// What prices a defensive cancellation besides the original attempt's caps: the market's fees
/// (`eth_feeHistory`), when the stage has a chain to ask, and `fees.max_fee_per_gas`.
struct CancelPricing {
    chain: Option<Arc<dyn ChainClient>>,
    max_fee_per_gas: u128,
}

impl SignStage {
    /// A stage that prices the defensive cancellations from the original attempts alone, within
    /// the default `fees.max_fee_per_gas` (see [`SignStage::with_cancellations`]).
    pub fn new(config: SignerConfig, keys: Keys) -> SignStage {
        SignStage {
            config,
            keys,
            cancellations: CancelPricing {
                chain: None,
                max_fee_per_gas: DEFAULT_MAX_FEE_PER_GAS_WEI,
            },
            bumps: BumpSettings::default(),
            asked: Mutex::new(HashMap::new()),
        }
    }

    /// Prices the defensive cancellations from the market's fees on `chain` too, within
    /// `max_fee_per_gas` (`fees.max_fee_per_gas`).
    pub fn with_cancellations(
        mut self,
        chain: Arc<dyn ChainClient>,
        max_fee_per_gas: u128,
    ) -> SignStage {
        self.cancellations = CancelPricing {
            chain: Some(chain),
            max_fee_per_gas,
        };
        self
    }

    /// Bumps stuck transactions with `bumps` (`resubmit.bump_after_ms`, `resubmit.bump_percent`);
    /// a bump needs the chain of [`SignStage::with_cancellations`] (its nonce, its fees): without
    /// one, nothing is bumped.
    pub fn with_bumps(mut self, bumps: BumpSettings) -> SignStage {
        self.bumps = bumps;
        self
    }

    /// Hands rows to the signer's next drive.
    fn ask(&self, key: (ChainId, Signer), rows: Vec<TxRow>) {
        if rows.is_empty() {
            return;
        }
        // A poisoned lock only means a panic elsewhere while it was held; the map is still whole.
        let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
        let mine = asked.entry(key).or_default();
        for row in rows {
            mine.insert(row.tx_id, row);
        }
    }

    /// The rows handed to the signer's drive, in nonce order; forgotten here.
    fn take_asked(&self, key: &LeaseKey) -> Vec<TxRow> {
        let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<TxRow> = asked
            .remove(&(key.chain_id, key.signer.clone()))
            .map(|m| m.into_values().collect())
            .unwrap_or_default();
        rows.sort_by_key(|r| (r.nonce, r.tx_id));
        rows
    }
}

impl std::fmt::Debug for SignStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignStage")
            .field("config", &self.config)
            .field("keys", &self.keys)
            .field("max_fee_per_gas", &self.cancellations.max_fee_per_gas)
            .field("bumps", &self.bumps)
            .finish_non_exhaustive()
    }
}

impl Handler for SignStage {
    type Input = TxAllocated;

    fn role(&self) -> Role {
        Role::SignerGateway
    }

    fn input_topic(&self) -> String {
        self.config.topics.tx_allocated()
    }

    fn route(&self, a: &TxAllocated) -> Result<(ChainId, Signer), Rejection> {
        let s = Signer::parse(&a.signer)
            .map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))?;
        Ok((ChainId(a.chain_id), s))
    }

    async fn handle(
        &self,
        w: &mut Fenced<'_>,
        a: &TxAllocated,
    ) -> Result<Vec<Output>, HandlerError> {
        match self.handle_batch(w, &[a]).await?.pop() {
            Some(result) => result,
            None => Ok(Vec::new()),
        }
    }

    /// All of a signer's TxAllocated of a batch: their rows read and decided together. Writes
    /// nothing and signs nothing (the batch's transaction is open): a transaction signed before
    /// is announced again, one to sign or to fail is handed to the drive after the commit.
    async fn handle_batch(&self, w: &mut Fenced<'_>, inputs: &[&TxAllocated]) -> BatchResults {
        let lease_key = w.lease().key().clone();
        let mut requests = Vec::with_capacity(inputs.len());
        for a in inputs {
            requests.push(Uuid::parse_str(&a.tx_id).ok().map(|id| (id, *a)));
        }
        let ids: Vec<Uuid> = requests.iter().flatten().map(|(id, _)| *id).collect();

        // Load: the row is the truth (the event only says which transaction). Locked in nonce
        // order, as every transaction of the gateway takes them, for the batch's transaction,
        // which holds no signature.
        let rows = store::lock(w, &ids).await?;
        let by_id: HashMap<Uuid, &TxRow> = rows.iter().map(|r| (r.tx_id, r)).collect();
        let has_key = self.keys.get(&lease_key.signer).is_some();

        // Decide.
        enum Step {
            Invalid,
            Rejected(Rejection),
            Reannounce(Uuid),
            /// Nothing now: nothing to do, or announced by the drive after the commit.
            Later,
        }
        let mut steps = Vec::with_capacity(requests.len());
        let mut asked = Vec::new();
        let mut seen = HashSet::new();
        for request in &requests {
            let Some((tx_id, claimed)) = *request else {
                steps.push(Step::Invalid);
                continue;
            };
            let row = by_id.get(&tx_id).copied();
            let decision = decide::decide(&Input {
                tx_id,
                chain_id: lease_key.chain_id,
                signer: &lease_key.signer,
                row,
                claimed: Some(claimed),
                policy: &self.config.policy,
                has_key,
            });
            steps.push(match decision {
                Decision::Reject(r) => Step::Rejected(r),
                Decision::Reannounce => Step::Reannounce(tx_id),
                Decision::Nothing => Step::Later,
                Decision::Sign { row, .. } | Decision::Fail { row, .. } => {
                    if seen.insert(tx_id) {
                        asked.push(row.clone());
                    }
                    Step::Later
                }
            });
        }

        // The stored announcements of the transactions signed before.
        let to_reannounce: Vec<Uuid> = steps
            .iter()
            .filter_map(|s| match s {
                Step::Reannounce(id) => Some(*id),
                _ => None,
            })
            .collect();
        let mut stored: HashMap<Uuid, Vec<TxSigned>> = HashMap::new();
        for (tx_id, e) in store::signed_events(w, &to_reannounce).await? {
            stored.entry(tx_id).or_default().push(e);
        }
        let latest: HashMap<Uuid, TxSigned> = stored
            .into_iter()
            .filter_map(|(id, all)| decide::latest_signed(all).map(|e| (id, e)))
            .collect();
        self.ask((lease_key.chain_id, lease_key.signer.clone()), asked);

        let outputs = Outputs::new(&self.config, &lease_key);
        Ok(steps
            .into_iter()
            .zip(inputs)
            .map(|(step, a)| match step {
                Step::Invalid => Err(HandlerError::Reject(Rejection::new(
                    "INVALID_TX_ID",
                    format!("{:?} is not a transaction id", a.tx_id),
                ))),
                Step::Rejected(r) => Err(HandlerError::Reject(r)),
                Step::Reannounce(tx_id) => Ok(latest
                    .get(&tx_id)
                    .cloned()
                    .map(|e| vec![outputs.signed(e)])
                    .unwrap_or_default()),
                Step::Later => Ok(Vec::new()),
            })
            .collect())
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        store::pending_signers(pool, self.config.chain_id).await
    }

    /// Signs what there is to sign for the signer, with no transaction open, and records it
    /// fenced: right after a batch, the rows its messages asked for; on the recovery scan (start,
    /// assignment, every few seconds), every ALLOCATED row of the signer, in nonce order — what
    /// recovers a TxAllocated that was never produced (a crash between the allocator's commit and
    /// its produce) or that a broker lost, or a drive that did not finish.
    ///
    /// Right after a batch only the asked rows: the rows the allocator committed next are on
    /// their way as events, and signing them ahead of their events would announce each twice.
    ///
    /// The recovery scan first signs the defensive cancellations the signer's transactions undone
    /// by a deep reorg need (`cancel_undone`). A failure there is reported and tried
    /// again by the next scan; it never keeps the ALLOCATED rows from being signed.
    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let asked = self.take_asked(ctx.lease.key());
        if ctx.recovery {
            match self.cancel_undone(&ctx).await {
                Ok(()) => {}
                Err(e @ HandlerError::LeaseLost(_)) => return Err(e),
                Err(e) => tracing::warn!(
                    signer = %ctx.lease.key().signer,
                    error = %chain(&e),
                    "the defensive cancellations could not be signed or recorded: the next recovery scan tries again"
                ),
            }
            match self.bump_stuck(&ctx).await {
                Ok(()) => {}
                Err(e @ HandlerError::LeaseLost(_)) => return Err(e),
                Err(e) => tracing::warn!(
                    signer = %ctx.lease.key().signer,
                    error = %chain(&e),
                    "the gas bumps could not be signed or recorded: the next recovery scan tries again"
                ),
            }
        }
        let rows = if ctx.recovery {
            store::allocated(ctx.pool, ctx.lease.key()).await?
        } else {
            asked
        };
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.sign_rows(&ctx, rows).await
    }
}

/// One row to sign: the row as read and the transaction it holds.
struct ToSign<'r> {
    row: &'r TxRow,
    nonce: i64,
    tx: UnsignedTx,
}

impl SignStage {
    /// Decides on `rows` (as read, ALLOCATED ones of the lease's signer), signs those to sign with
    /// no transaction open, then records the signatures and failures in one fenced transaction.
    /// The outputs of the rows that moved, in nonce order.
    async fn sign_rows(
        &self,
        ctx: &DriveCtx<'_>,
        rows: Vec<TxRow>,
    ) -> Result<Vec<Output>, HandlerError> {
        let lease_key = ctx.lease.key();
        let key = self.keys.get(&lease_key.signer).cloned();
        let at = At {
            chain_id: lease_key.chain_id,
            signer: &lease_key.signer,
            token: ctx.lease.token().0,
        };

        // Decide, on the rows as read.
        let mut to_sign = Vec::new();
        let mut failings = Vec::new();
        for row in &rows {
            match decide::decide(&Input {
                tx_id: row.tx_id,
                chain_id: lease_key.chain_id,
                signer: &lease_key.signer,
                row: Some(row),
                claimed: None,
                policy: &self.config.policy,
                has_key: key.is_some(),
            }) {
                Decision::Sign { row, nonce, tx } => to_sign.push(ToSign { row, nonce, tx }),
                Decision::Fail {
                    row,
                    nonce,
                    code,
                    reason,
                } => failings.push(at.failing(row, nonce, code, &reason)),
                // Not ALLOCATED (any more): nothing to sign, and no message to answer here.
                Decision::Reannounce | Decision::Nothing | Decision::Reject(_) => {}
            }
        }

        // Sign, with no transaction open. Alloy's local signer is deterministic (RFC 6979): the
        // same unsigned transaction always gives the same bytes, so a signature made twice (a
        // drive whose recording was fenced or crashed, then the next owner's) is the same
        // transaction. That makes a repeated signature harmless, nothing more: what is announced
        // and sent is only ever the attempt recorded under the current lease by the
        // compare-and-set below, whatever a signer gives (a remote one need not be
        // deterministic), and a signature that is not recorded is dropped.
        let mut signings = Vec::new();
        let mut unavailable: Option<SigningError> = None;
        if let Some(key) = &key {
            for (s, result) in sign_all(key, to_sign).await {
                match result {
                    Ok(signed) => signings.push(at.signing(s.row, s.nonce, &s.tx, signed)),
                    Err(e) if e.is_transient() => {
                        tracing::warn!(signer = %lease_key.signer, nonce = s.nonce, error = %chain(&e), "the signer is unavailable; the recovery scan signs the transaction later");
                        unavailable.get_or_insert(e);
                    }
                    Err(e) => failings.push(at.failing(
                        s.row,
                        s.nonce,
                        FailureCode::SigningFailed,
                        &chain(&e),
                    )),
                }
            }
        }
        if signings.is_empty() && failings.is_empty() {
            return match unavailable {
                Some(e) => Err(HandlerError::classified("signing", e)),
                None => Ok(Vec::new()),
            };
        }
        self.record(ctx, &rows, signings, failings).await
    }

    /// Records signatures and failures decided on `read` in one short fenced transaction: the
    /// rows locked with their attempt numbers (one statement), those no longer as read (moved,
    /// re-allocated, changed) left alone, then ALLOCATED → SIGNED with the attempt rows and ALLOCATED → FAILED
    /// with the nonces released, one statement each. The outputs of the rows that moved.
    async fn record(
        &self,
        ctx: &DriveCtx<'_>,
        read: &[TxRow],
        mut signings: Vec<Signing>,
        mut failings: Vec<Failing>,
    ) -> Result<Vec<Output>, HandlerError> {
        let as_read: HashMap<Uuid, &TxRow> = read.iter().map(|r| (r.tx_id, r)).collect();
        let ids: Vec<Uuid> = signings
            .iter()
            .map(|s| s.tx_id)
            .chain(failings.iter().map(|f| f.tx_id))
            .collect();
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let (signed, failed) = {
            let mut w = tx.writer();
            let now = store::lock_with_attempts(&mut w, &ids).await?;
            let highest: HashMap<Uuid, i32> = now
                .iter()
                .filter_map(|(r, a)| a.map(|a| (r.tx_id, a)))
                .collect();
            let unchanged: HashSet<Uuid> = now
                .iter()
                .map(|(r, _)| r)
                .filter(|r| {
                    r.state == TxState::Allocated
                        && as_read.get(&r.tx_id).is_some_and(|was| {
                            was.state == r.state && was.nonce == r.nonce && was.payload == r.payload
                        })
                })
                .map(|r| r.tx_id)
                .collect();
            signings.retain(|s| unchanged.contains(&s.tx_id));
            failings.retain(|f| unchanged.contains(&f.tx_id));
            if signings.is_empty() && failings.is_empty() {
                (HashSet::new(), HashSet::new())
            } else {
                for s in &mut signings {
                    s.event.attempt = decide::next_attempt(highest.get(&s.tx_id).copied());
                }
                let signed = store::sign(&mut w, &signings).await?;
                let failed = store::fail_allocated(&mut w, &failings).await?;
                (signed, failed)
            }
        };
        if signed.is_empty() && failed.is_empty() {
            tx.rollback().await?;
            return Ok(Vec::new());
        }
        txflow_core::fault::point(txflow_core::fault::SIGNER_BEFORE_COMMIT);
        tx.commit().await?;

        let outputs = Outputs::new(&self.config, ctx.lease.key());
        let mut announced: Vec<(i64, Output)> = Vec::new();
        for s in signings.into_iter().filter(|s| signed.contains(&s.tx_id)) {
            announced.push((s.event.nonce, outputs.signed(s.event)));
        }
        for f in failings.into_iter().filter(|f| failed.contains(&f.tx_id)) {
            tracing::warn!(
                tx_id = %f.tx_id,
                nonce = f.event.nonce,
                code = f.code.as_str(),
                reason = %f.event.reason,
                "the transaction cannot be signed: failed, nonce released"
            );
            announced.push((f.event.nonce.unwrap_or_default(), outputs.failed(f.event)));
        }
        announced.sort_by_key(|(nonce, _)| *nonce);
        Ok(announced.into_iter().map(|(_, o)| o).collect())
    }
}

/// The stable event name of a defensive cancellation signed and recorded (WARN).
pub const CANCELLATION_SIGNED: &str = "reorg_cancellation_signed";

/// The stable event name of the critical alert raised when a transaction undone by a deep reorg
/// needs a defensive cancellation that cannot be signed (no key, nothing to price it from, the key
/// refused): its original may still be mined.
pub const CANCELLATION_UNSIGNED: &str = "reorg_cancellation_unsigned";

impl SignStage {
    /// The defensive cancellations of seed 000 §4.4, on the recovery scan: for each of the
    /// signer's transactions that a reorg deeper than the required depth undid, that is not mined
    /// again and whose nonce has none yet ([`decide::needs_cancellation`]), a 0-value transfer to
    /// the signer at that nonce with a high priority fee ([`decide::cancellation_fees`]: twice the
    /// original's caps or the market's, within `fees.max_fee_per_gas`), signed with no
    /// transaction open, then recorded in one short fenced transaction (`tx_cancellations`) if the
    /// transaction is still as read. The broadcaster sends it.
    async fn cancel_undone(&self, ctx: &DriveCtx<'_>) -> Result<(), HandlerError> {
        let lease_key = ctx.lease.key();
        let rows = store::undone(ctx.pool, lease_key)
            .await
            .map_err(|e| HandlerError::transient("list undone transactions", e))?;
        let mut todo = Vec::new();
        for row in &rows {
            match row.read() {
                Some(t) => {
                    if let Some(nonce) = decide::needs_cancellation(&t) {
                        todo.push((t, nonce));
                    }
                }
                None => tracing::error!(
                    target: "txflow::alert",
                    event = CANCELLATION_UNSIGNED,
                    alert = true,
                    signer = %lease_key.signer,
                    tx_id = %row.tx_id,
                    state = %row.state,
                    "a transaction undone by a deep reorg cannot be read (its state or its fees): no defensive cancellation"
                ),
            }
        }
        if todo.is_empty() {
            return Ok(());
        }
        let unsigned = |t: &decide::Undone, nonce: i64, reason: &str| {
            tracing::error!(
                target: "txflow::alert",
                event = CANCELLATION_UNSIGNED,
                alert = true,
                chain_id = lease_key.chain_id.0,
                signer = %lease_key.signer,
                tx_id = %t.tx_id,
                nonce,
                generation = t.generation,
                reason,
                "no defensive cancellation can be signed for a transaction undone by a deep reorg: its original may still be mined"
            );
        };
        let Some(key) = self.keys.get(&lease_key.signer).cloned() else {
            for (t, nonce) in &todo {
                unsigned(t, *nonce, "no signing key for the signer");
            }
            return Ok(());
        };
        let market = match &self.cancellations.chain {
            Some(node) => match node.fees().await {
                Ok((max_fee, tip)) => Some(decide::Caps { max_fee, tip }),
                Err(e) => {
                    tracing::warn!(signer = %lease_key.signer, error = %chain(&e), "the market's fees are unknown: the cancellations are priced from the originals alone");
                    None
                }
            },
            None => None,
        };

        // Sign, with no transaction open.
        let mut signed = Vec::new();
        for (t, nonce) in todo {
            let Some(fees) =
                decide::cancellation_fees(t.original, market, self.cancellations.max_fee_per_gas)
            else {
                unsigned(
                    &t,
                    nonce,
                    "neither the original's fees nor the market's are known",
                );
                continue;
            };
            let tx = match decide::cancellation_tx(
                lease_key.chain_id,
                &lease_key.signer,
                nonce,
                fees.caps,
            ) {
                Ok(tx) => tx,
                Err(field) => {
                    unsigned(
                        &t,
                        nonce,
                        &format!("the cancellation's {field} is not valid"),
                    );
                    continue;
                }
            };
            match key.sign(&tx).await {
                Ok(s) => signed.push((t, nonce, fees, s)),
                Err(e) if e.is_transient() => {
                    tracing::warn!(signer = %lease_key.signer, nonce, error = %chain(&e), "the signer is unavailable; the next recovery scan signs the cancellation");
                }
                Err(e) => unsigned(&t, nonce, &chain(&e)),
            }
        }
        if signed.is_empty() {
            return Ok(());
        }

        // Record, fenced.
        let rows: Vec<store::Cancellation> = signed
            .iter()
            .map(|(t, nonce, fees, s)| store::Cancellation {
                tx_id: t.tx_id,
                generation: t.generation,
                nonce: *nonce,
                tx_hash: format!("{:#x}", s.hash),
                raw_tx: s.raw.clone(),
                caps: fees.caps,
            })
            .collect();
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let recorded = {
            let mut w = tx.writer();
            store::record_cancellations(&mut w, &rows).await?
        };
        if recorded.is_empty() {
            tx.rollback().await?;
            return Ok(());
        }
        tx.commit().await?;
        metrics::get().tx_defensive_cancellation("signed", recorded.len() as u64);
        for (t, nonce, fees, s) in signed.iter().filter(|(_, n, _, _)| recorded.contains(n)) {
            tracing::warn!(
                target: "txflow::reorg",
                event = CANCELLATION_SIGNED,
                chain_id = lease_key.chain_id.0,
                signer = %lease_key.signer,
                tx_id = %t.tx_id,
                nonce,
                generation = t.generation,
                tx_hash = %format!("{:#x}", s.hash),
                max_fee_per_gas = %fees.caps.max_fee,
                max_priority_fee_per_gas = %fees.caps.tip,
                capped = fees.capped,
                replaces_original = fees.replaces_original,
                "defensive cancellation signed for a transaction undone by a deep reorg: the broadcaster sends it"
            );
            if !fees.replaces_original {
                tracing::warn!(
                    target: "txflow::reorg",
                    event = "reorg_cancellation_capped",
                    signer = %lease_key.signer,
                    tx_id = %t.tx_id,
                    nonce,
                    "fees.max_fee_per_gas keeps the cancellation below the replacement price of the original: a node holding the original keeps it"
                );
            }
        }
        Ok(())
    }
}

/// The stable event name of a gas bump signed and recorded (WARN).
pub const GAS_BUMPED: &str = "gas_bumped";

/// The stable event name logged when a stuck transaction is not bumped because its signer cannot
/// pay the bumped transaction (seed 003: a signer without funds — held, or about to be — is not
/// bumped; its attempts are sent again as they are, and the bump comes once funds arrive).
pub const GAS_BUMP_HELD: &str = "gas_bump_skipped_no_funds";

/// The stable event name of the critical alert raised when a stuck transaction cannot be bumped
/// because `fees.max_fee_per_gas` leaves no room for a replacement: its latest attempt is sent
/// again as it is.
pub const GAS_BUMP_AT_CAP: &str = "gas_bump_at_cap";

/// The stable event name of the critical alert raised when a stuck transaction cannot be bumped
/// for another reason (no key, a payload or fees that do not parse, the key refused).
pub const GAS_BUMP_UNSIGNED: &str = "gas_bump_unsigned";

impl SignStage {
    /// Gas bumps (issue 16 point 1, seed 003), on the recovery scan: each SUBMITTED transaction
    /// of the signer that [`decide::bump_due`] finds stuck (at the head of the queue for
    /// `resubmit.bump_after_ms`, or priced under the base fee) is signed again at its nonce as
    /// attempt n+1 with the caps of [`decide::bump_fees`], with no transaction open, then recorded
    /// fenced (`store::record_bumps`) while attempt n is still its latest. The broadcaster sends
    /// the latest attempt; a receipt for any attempt settles the transaction. The policy is not
    /// asked again: only the fees change, within `fees.max_fee_per_gas`.
    async fn bump_stuck(&self, ctx: &DriveCtx<'_>) -> Result<(), HandlerError> {
        let Some(node) = &self.cancellations.chain else {
            return Ok(());
        };
        let lease_key = ctx.lease.key();
        let rows = store::bump_candidates(ctx.pool, lease_key)
            .await
            .map_err(|e| HandlerError::transient("list submitted transactions", e))?;
        if rows.is_empty() {
            return Ok(());
        }
        let alert = |tx_id: Uuid, nonce: Option<i64>, reason: &str| {
            tracing::error!(
                target: "txflow::alert",
                event = GAS_BUMP_UNSIGNED,
                alert = true,
                chain_id = lease_key.chain_id.0,
                signer = %lease_key.signer,
                %tx_id,
                nonce,
                reason,
                "a stuck transaction cannot be bumped: its latest attempt is sent again as it is"
            );
        };
        let address = txflow_core::stage::handler::signer_address(lease_key)
            .map_err(|e| HandlerError::classified("signer address", e))?;
        let chain_nonce = match node.latest_nonce(address).await {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::warn!(signer = %lease_key.signer, error = %chain(&e), "the chain's nonce is unknown: only the base fee decides a bump");
                None
            }
        };
        let market = match node.fees().await {
            Ok((max_fee, tip)) => Some(decide::Caps { max_fee, tip }),
            Err(e) => {
                tracing::warn!(signer = %lease_key.signer, error = %chain(&e), "the market's fees are unknown: bumps are priced from the attempts alone");
                None
            }
        };
        let base_fee = market.map(decide::base_fee_of);
        let mut todo = Vec::new();
        for row in &rows {
            let Some(p) = row.read() else {
                alert(
                    row.tx_id,
                    row.nonce,
                    "its nonce or its latest attempt's fees do not parse",
                );
                continue;
            };
            let Some(why) = decide::bump_due(&p, chain_nonce, base_fee, self.bumps.after_ms) else {
                continue;
            };
            match decide::bump_fees(
                p.caps,
                market,
                self.bumps.percent,
                self.cancellations.max_fee_per_gas,
            ) {
                decide::BumpFees::AtCap => {
                    metrics::get().tx_gas_bump("at_cap", 1);
                    tracing::error!(
                        target: "txflow::alert",
                        event = GAS_BUMP_AT_CAP,
                        alert = true,
                        chain_id = lease_key.chain_id.0,
                        signer = %lease_key.signer,
                        tx_id = %row.tx_id,
                        nonce = p.nonce,
                        attempt = p.attempt,
                        reason = why.as_str(),
                        max_fee_per_gas = %p.caps.max_fee,
                        max_priority_fee_per_gas = %p.caps.tip,
                        base_fee = ?base_fee,
                        cap = %self.cancellations.max_fee_per_gas,
                        "a stuck transaction is at fees.max_fee_per_gas: not raised again, its latest attempt is sent again as it is"
                    )
                }
                decide::BumpFees::Raise { caps, capped } => {
                    todo.push((row, p, why, caps, capped));
                }
            }
        }
        if todo.is_empty() {
            return Ok(());
        }
        let Some(key) = self.keys.get(&lease_key.signer).cloned() else {
            for (row, p, ..) in &todo {
                alert(row.tx_id, Some(p.nonce), "no signing key for the signer");
            }
            return Ok(());
        };

        // What the signer can pay (seed 003: a signer without funds is not bumped). Read once;
        // unknown, nothing is bumped this time (the next scan asks again).
        let balance = match node.balance(address).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(signer = %lease_key.signer, error = %chain(&e), "the signer's balance is unknown: no bump this time");
                return Ok(());
            }
        };

        // Sign, with no transaction open.
        let mut signed = Vec::new();
        for (row, p, why, caps, capped) in todo {
            let tx = serde_json::from_value::<TxPayload>(row.payload.clone())
                .map_err(|_| "payload")
                .and_then(|payload| decide::unsigned_tx(lease_key.chain_id.0, p.nonce, &payload));
            let mut tx = match tx {
                Ok(tx) => tx,
                Err(field) => {
                    alert(
                        row.tx_id,
                        Some(p.nonce),
                        &format!("its {field} is not valid"),
                    );
                    continue;
                }
            };
            tx.max_fee_per_gas = caps.max_fee;
            tx.max_priority_fee_per_gas = caps.tip;
            let cost = U256::from(tx.gas_limit)
                .saturating_mul(U256::from(caps.max_fee))
                .saturating_add(tx.value);
            if balance < cost {
                tracing::info!(
                    target: "txflow::bumps",
                    event = GAS_BUMP_HELD,
                    chain_id = lease_key.chain_id.0,
                    signer = %lease_key.signer,
                    tx_id = %row.tx_id,
                    nonce = p.nonce,
                    balance = %balance,
                    cost = %cost,
                    "the signer cannot pay the bumped transaction: not bumped, its latest attempt is sent again as it is"
                );
                continue;
            }
            match key.sign(&tx).await {
                Ok(s) => signed.push((row, p, why, caps, capped, s)),
                Err(e) if e.is_transient() => {
                    tracing::warn!(signer = %lease_key.signer, nonce = p.nonce, error = %chain(&e), "the signer is unavailable; the next recovery scan signs the bump");
                }
                Err(e) => alert(row.tx_id, Some(p.nonce), &chain(&e)),
            }
        }
        if signed.is_empty() {
            return Ok(());
        }

        // Record, fenced.
        let bumps: Vec<store::Bump> = signed
            .iter()
            .map(|(row, p, _, caps, _, s)| store::Bump {
                tx_id: row.tx_id,
                nonce: p.nonce,
                attempt: p.attempt.saturating_add(1),
                tx_hash: format!("{:#x}", s.hash),
                raw_tx: s.raw.clone(),
                caps: *caps,
            })
            .collect();
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let recorded = {
            let mut w = tx.writer();
            store::record_bumps(&mut w, &bumps).await?
        };
        if recorded.is_empty() {
            tx.rollback().await?;
            return Ok(());
        }
        tx.commit().await?;
        metrics::get().tx_gas_bump("bumped", recorded.len() as u64);
        for (row, p, why, caps, capped, s) in
            signed.iter().filter(|t| recorded.contains(&t.0.tx_id))
        {
            tracing::warn!(
                target: "txflow::bump",
                event = GAS_BUMPED,
                chain_id = lease_key.chain_id.0,
                signer = %lease_key.signer,
                tx_id = %row.tx_id,
                nonce = p.nonce,
                attempt = p.attempt.saturating_add(1),
                reason = why.as_str(),
                tx_hash = %format!("{:#x}", s.hash),
                max_fee_per_gas = %caps.max_fee,
                max_priority_fee_per_gas = %caps.tip,
                previous_max_fee_per_gas = %p.caps.max_fee,
                previous_max_priority_fee_per_gas = %p.caps.tip,
                capped,
                "gas bump signed: the broadcaster sends the new attempt"
            );
        }
        Ok(())
    }
}

/// Signs every transaction of `to_sign` with `key`, at most [`SIGN_CONCURRENCY`] at once. A
/// signature whose task panicked is left out (its row stays ALLOCATED for the recovery scan).
async fn sign_all<'r>(
    key: &Arc<dyn TxSigner>,
    to_sign: Vec<ToSign<'r>>,
) -> Vec<(ToSign<'r>, Result<SignedTx, SigningError>)> {
    let limit = Arc::new(Semaphore::new(SIGN_CONCURRENCY));
    let mut tasks = JoinSet::new();
    for (k, s) in to_sign.iter().enumerate() {
        let (key, limit, tx) = (key.clone(), limit.clone(), s.tx.clone());
        tasks.spawn(async move {
            // The semaphore is never closed.
            let _permit = limit.acquire_owned().await;
            (k, key.sign(&tx).await)
        });
    }
    let mut results: Vec<Option<Result<SignedTx, SigningError>>> =
        to_sign.iter().map(|_| None).collect();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((k, result)) => {
                if let Some(slot) = results.get_mut(k) {
                    *slot = Some(result);
                }
            }
            Err(e) => tracing::error!(error = %e, "a signature task failed"),
        }
    }
    to_sign
        .into_iter()
        .zip(results)
        .filter_map(|(s, r)| r.map(|r| (s, r)))
        .collect()
}

/// `e` and its sources, `": "`-separated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The announcements of one signer: TxSigned on `tx.signed`, TxFailed on `tx.outcomes`.
struct Outputs<'c> {
    config: &'c SignerConfig,
    key: String,
}

impl<'c> Outputs<'c> {
    fn new(config: &'c SignerConfig, lease: &LeaseKey) -> Outputs<'c> {
        Outputs {
            config,
            key: signer_key(lease.chain_id.0, lease.signer.as_str()),
        }
    }

    fn signed(&self, e: TxSigned) -> Output {
        Output::new(
            self.config.topics.tx_signed(),
            Subjects::TopicName,
            self.key.clone(),
            e,
        )
    }

    fn failed(&self, e: TxFailed) -> Output {
        Output::new(
            self.config.topics.tx_outcomes(),
            Subjects::TopicRecordName,
            self.key.clone(),
            e,
        )
    }
}

/// The signer and lease the events are written for.
struct At<'a> {
    chain_id: ChainId,
    signer: &'a Signer,
    token: i64,
}

impl At<'_> {
    /// The signature of `row` to record (its attempt number is set once the highest recorded
    /// one is read).
    fn signing(&self, row: &TxRow, nonce: i64, tx: &UnsignedTx, signed: SignedTx) -> Signing {
        let event_id = Uuid::new_v4();
        Signing {
            tx_id: row.tx_id,
            event_id,
            event: TxSigned {
                event_id: event_id.to_string(),
                tx_id: row.tx_id.to_string(),
                chain_id: self.chain_id.0,
                signer: self.signer.as_str().to_string(),
                nonce,
                attempt: 1,
                tx_hash: format!("{:#x}", signed.hash),
                raw_tx: signed.raw,
                max_fee_per_gas: tx.max_fee_per_gas.to_string(),
                max_priority_fee_per_gas: tx.max_priority_fee_per_gas.to_string(),
                fencing_token: self.token,
            },
        }
    }

    /// The failure of `row` to record: FAILED with `code`, its nonce released.
    fn failing(&self, row: &TxRow, nonce: i64, code: FailureCode, reason: &str) -> Failing {
        let event_id = Uuid::new_v4();
        Failing {
            tx_id: row.tx_id,
            event_id,
            code,
            event: TxFailed {
                event_id: event_id.to_string(),
                tx_id: row.tx_id.to_string(),
                request_id: row.request_id.clone(),
                chain_id: self.chain_id.0,
                signer: self.signer.as_str().to_string(),
                code: code.as_str().to_string(),
                reason: truncate_reason(reason),
                nonce: Some(nonce),
                nonce_released: true,
                fencing_token: self.token,
            },
        }
    }
}
