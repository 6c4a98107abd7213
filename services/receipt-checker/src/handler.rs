//! The receipt checker's stage: SUBMITTED → MINED | REVERTED (a receipt of one of its attempts)
//! | REPLACED (its nonce proven used by a transaction txflow did not send). Route → load
//! ([`store`]) → call the chain → decide ([`decide`]) → persist ([`store`], fenced) → outputs.
//!
//! Nothing is written when a TxSubmitted message arrives (the submission was recorded before it
//! was produced): the lookups happen in [`Handler::drive`], outside any transaction, right after a
//! batch commits and in the recovery scan, for the signer's SUBMITTED transactions that are due.

use std::sync::Arc;
use std::time::Duration;

use alloy::primitives::{Address, B256};
use futures::StreamExt;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use txflow_core::chain::{ChainClient, ChainError};
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{TxReceiptUpdated, TxReplaced, TxSubmitted};
use txflow_core::fenced::Fenced;
use txflow_core::kafka::signer_key;
use txflow_core::metrics;
use txflow_core::nonce_proof::{NonceFacts, NonceTooLow, nonce_too_low};
use txflow_core::retry::Classify;
use txflow_core::role::Role;
use txflow_core::stage::handler::{audit_json, db, route_signer, signer_address};
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output, Rejection};
use txflow_core::state::{MINE, REPLACE};
use txflow_core::txstore::MinedReceipt;
use uuid::Uuid;

use crate::config::ReceiptCheckerConfig;
use crate::decide::{self, Looked, StaleMark, Staleness, Whose};
use crate::store::{self, DueRow, Mined, Row, Schedule};

/// At most this many transactions of one signer are searched for the proof of a replacement in
/// one drive (each search asks the node up to `PassSearch::MAX_PROBES` questions); the next
/// scan takes the rest.
const PROOFS_PER_DRIVE: usize = 8;

/// The stable event name logged when the chain's nonce is back below a SUBMITTED transaction
/// that nothing sends any more (the broadcaster stopped when it saw the nonce passed, then a
/// reorg took the block): its latest attempt is scheduled to be sent again.
pub const NONCE_GAP_CLOSED: &str = "nonce_gap_closed";

/// The stable event name logged when a transaction is mined with status 0 (REVERTED), with the
/// reason its call reverted when the chain tells it.
pub const TX_REVERTED: &str = "tx_reverted";

/// The stable event name logged when a nonce used outside txflow is not final yet: the
/// transaction stays SUBMITTED at its nonce (REPLACED only once that block is final).
pub const REPLACEMENT_NOT_FINAL: &str = "replacement_not_final";

/// The receipt checker's handler.
#[derive(Debug)]
pub struct ReceiptStage {
    pub config: ReceiptCheckerConfig,
    pub chain: Arc<dyn ChainClient>,
    /// The pool of lookups (`confirmations.receipt_workers` permits), shared by every drive of
    /// this stage: at most that many transactions are being looked up at once.
    workers: Arc<Semaphore>,
}

fn millis(ms: Option<i64>) -> Option<Duration> {
    ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
}

/// A due transaction and what its lookups found.
struct Checked {
    row: DueRow,
    /// Its attempts' hashes, newest first (all of them, or none if one is not a hash).
    hashes: Vec<B256>,
    looked: Looked,
}

impl ReceiptStage {
    pub fn new(config: ReceiptCheckerConfig, chain: Arc<dyn ChainClient>) -> ReceiptStage {
        let workers = Arc::new(Semaphore::new(config.workers.max(1)));
        ReceiptStage {
            config,
            chain,
            workers,
        }
    }

    /// When `row` is looked up again after no receipt (or a failed lookup).
    fn next_check(&self, row: &DueRow) -> Duration {
        decide::next_check(
            millis(Some(row.since_move_ms)).unwrap_or_default(),
            self.config.poll_min,
            self.config.poll_max,
        )
    }
}

impl Handler for ReceiptStage {
    type Input = TxSubmitted;

    fn role(&self) -> Role {
        Role::ReceiptChecker
    }

    fn input_topic(&self) -> String {
        self.config.topics.tx_submitted()
    }

    fn route(&self, s: &TxSubmitted) -> Result<(ChainId, Signer), Rejection> {
        route_signer(s.chain_id, &s.signer)
    }

    /// A TxSubmitted only wakes the drive: its batches open no transaction.
    fn writes_on_input(&self) -> bool {
        false
    }

    /// Nothing to write: the submission was recorded before TxSubmitted was produced. The
    /// lookups happen in `drive`, right after the batch (which opens no transaction).
    async fn handle(
        &self,
        _w: &mut Fenced<'_>,
        _s: &TxSubmitted,
    ) -> Result<Vec<Output>, HandlerError> {
        Ok(Vec::new())
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        store::pending_signers(pool, self.config.chain_id).await
    }

    /// Looks up the receipts of the signer's due SUBMITTED transactions (a pool of
    /// `receipt_workers` lookups), then records in one fenced transaction what was found: MINE /
    /// REVERT with the receipt, REPLACE on proof, and the next lookup of the others.
    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let key = ctx.lease.key();
        let due = store::due(ctx.pool, key)
            .await
            .map_err(db("list due receipt lookups"))?;
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let checked: Vec<Checked> = futures::stream::iter(due)
            .map(|row| self.look_up(row))
            .buffered(self.config.workers.max(1))
            .collect()
            .await;
        self.record(&ctx, checked).await
    }
}

/// What one drive records, in one fenced transaction.
#[derive(Default)]
struct Plan {
    /// SUBMITTED → MINED, with the receipt.
    mined: Vec<Mined>,
    /// SUBMITTED → REVERTED, with the receipt.
    reverted: Vec<Mined>,
    /// SUBMITTED → REPLACED, proven.
    replaced: Vec<Row>,
    /// The next lookup of the others.
    schedules: Vec<Schedule>,
    /// Pending again (the chain's nonce not past theirs) while nothing sends them: sent again.
    rearm: Vec<Uuid>,
    /// The announcement of each receipt, in nonce order, emitted if its row moved.
    emits: Vec<(Uuid, TxReceiptUpdated)>,
    /// Lookups that told nothing certain, and the first one's reason.
    failures: usize,
    first_failure: Option<String>,
}

impl Plan {
    fn look_again(&mut self, tx_id: Uuid, after: Duration, mark: StaleMark) {
        self.schedules.push(Schedule { tx_id, after, mark });
    }

    fn failed(&mut self, tx_id: Uuid, after: Duration, why: String) {
        self.failures += 1;
        self.first_failure.get_or_insert(why);
        self.look_again(tx_id, after, StaleMark::Keep);
    }

    /// A receipt to record and announce.
    fn found(&mut self, f: decide::Found, tx_id: Uuid) -> Result<(), HandlerError> {
        let event_id = Uuid::parse_str(&f.event.event_id)
            .map_err(|e| HandlerError::fail("EVENT_ID", format!("{}: {e}", f.event.event_id)))?;
        let m = Mined {
            row: Row {
                tx_id,
                event_id,
                event: audit_json(f.to, &f.event)?,
            },
            receipt: MinedReceipt {
                receipt: audit_json(f.to, &f.stored)?,
                block_number: f.stored.block_number,
                block_hash: f.stored.block_hash.clone(),
            },
        };
        if f.to == MINE {
            self.mined.push(m);
        } else {
            self.reverted.push(m);
        }
        self.emits.push((tx_id, f.event));
        Ok(())
    }

    fn moves(&self) -> bool {
        !(self.mined.is_empty() && self.reverted.is_empty() && self.replaced.is_empty())
    }
}

impl ReceiptStage {
    /// Looks up the receipt of each of the transaction's hashes, newest attempt first, until one
    /// is found; with a permit of the pool.
    async fn look_up(&self, row: DueRow) -> Checked {
        let attempts = row.attempts.clone().unwrap_or_default();
        let recorded = row.hashes.clone().unwrap_or_default();
        let hashes: Vec<B256> = recorded.iter().filter_map(|h| h.parse().ok()).collect();
        if hashes.is_empty() || hashes.len() != recorded.len() || attempts.len() != hashes.len() {
            // A hash we cannot read could be the one mined: nothing can be told, ever; an
            // operator must look. Looked up again after the back-off, never a state change.
            return Checked {
                row,
                hashes: Vec::new(),
                looked: Looked::Failed("the transaction's recorded hashes are not usable".into()),
            };
        }
        let Ok(_permit) = self.workers.acquire().await else {
            return Checked {
                row,
                hashes,
                looked: Looked::Failed("the lookup pool is closed".into()),
            };
        };
        let mut answers = Vec::with_capacity(hashes.len());
        for (&attempt, &hash) in attempts.iter().zip(&hashes) {
            let answer = self.chain.receipt(hash).await.map_err(|e| {
                // Retried after the back-off all the same (a lookup never changes the state), but
                // an answer that will not change is for an operator to see.
                if !e.is_transient() {
                    tracing::error!(tx_id = %row.tx_id, %hash, error = %e, "eth_getTransactionReceipt fails with a permanent error: check the endpoint");
                }
                e.to_string()
            });
            let done = matches!(&answer, Ok(Some(r)) if r.tx_hash == hash);
            metrics::get().receipt_check(match &answer {
                Ok(Some(_)) if done => metrics::receipt_result::FOUND,
                Ok(_) => metrics::receipt_result::NOT_FOUND,
                Err(_) => metrics::receipt_result::ERROR,
            });
            answers.push(((attempt, hash), answer));
            if done {
                break;
            }
        }
        Checked {
            row,
            hashes,
            looked: decide::looked_up(answers),
        }
    }

    /// Why a transaction mined with status 0 reverted: its call (`row.payload`) replayed at its
    /// block with `eth_call`, the revert data decoded (`txflow_core::revert`). `None` when the
    /// payload does not read, the call succeeds there (the state it ran on is gone), or the node
    /// cannot answer: the receipt is recorded all the same.
    async fn revert_reason(&self, from: Address, row: &DueRow, block: u64) -> Option<String> {
        let p = &row.payload;
        let to: Address = p["to"].as_str()?.parse().ok()?;
        let value = p["value"]
            .as_str()
            .and_then(|v| alloy::primitives::U256::from_str_radix(v, 10).ok())?;
        let data = p["data"]
            .as_str()
            .and_then(|d| alloy::hex::decode(d.trim_start_matches("0x")).ok())?;
        match self
            .chain
            .revert_data(from, to, value, data.into(), block)
            .await
        {
            Ok(Some(revert)) => Some(txflow_core::revert::decode_revert(&revert)),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(tx_id = %row.tx_id, error = %e, "cannot read why the transaction reverted");
                None
            }
        }
    }

    /// Whether the transaction at `nonce` (no receipt for any of `hashes`) was proven REPLACED:
    /// the block where the signer's nonce passed ours holds none of our hashes.
    async fn prove(
        &self,
        address: Address,
        nonce: i64,
        hashes: &[B256],
        latest: u64,
    ) -> Result<NonceTooLow, ChainError> {
        let mut facts = NonceFacts {
            ours: hashes.to_vec(),
            known: false,
            latest: Some(latest),
            passed_in: None,
            required: self.config.confirmations_required,
        };
        if txflow_core::nonce_proof::needs_search(nonce, &facts)
            && let Ok(n) = u64::try_from(nonce)
        {
            facts.passed_in =
                txflow_core::chain::passed_in(self.chain.as_ref(), address, n).await?;
        }
        Ok(nonce_too_low(nonce, &facts))
    }

    /// Decides what the lookups found and records it in one fenced transaction; the outputs of
    /// the rows that moved, in nonce order.
    async fn record(
        &self,
        ctx: &DriveCtx<'_>,
        checked: Vec<Checked>,
    ) -> Result<Vec<Output>, HandlerError> {
        let key = ctx.lease.key();
        let signer = key.signer.as_str();
        // The signer's latest nonce, once, if a transaction has no receipt.
        let address = signer_address(key);
        let latest = match &address {
            Ok(a) if checked.iter().any(|c| c.looked == Looked::NotFound) => {
                match self.chain.latest_nonce(*a).await {
                    Ok(n) => Some(n),
                    Err(e) => {
                        tracing::warn!(%signer, error = %e, transient = e.is_transient(), "cannot read the signer's nonce: staleness not judged this time");
                        None
                    }
                }
            }
            Ok(_) => None,
            Err(e) => {
                tracing::error!(%signer, error = %e, "the signer is not an address");
                None
            }
        };

        let mut plan = Plan::default();
        let mut proofs = 0usize;
        for c in checked {
            let row = &c.row;
            let after = self.next_check(row);
            let Some(nonce) = row.nonce else {
                plan.failed(
                    row.tx_id,
                    after,
                    "a SUBMITTED transaction without a nonce".into(),
                );
                continue;
            };
            match c.looked {
                Looked::Found { attempt, receipt } => {
                    let whose = Whose {
                        tx_id: row.tx_id,
                        chain_id: key.chain_id.0,
                        signer,
                        nonce,
                        receipts_before: row.receipts_before,
                        fencing_token: ctx.lease.token().0,
                    };
                    match decide::found(whose, attempt, &receipt) {
                        Ok(mut f) => {
                            if !receipt.status
                                && let Ok(from) = &address
                            {
                                f.stored.revert_reason =
                                    self.revert_reason(*from, row, receipt.block_number).await;
                                tracing::warn!(
                                    target: "txflow::alert",
                                    event = TX_REVERTED,
                                    %signer,
                                    nonce,
                                    tx_id = %row.tx_id,
                                    block = receipt.block_number,
                                    reason = f.stored.revert_reason.as_deref().unwrap_or("unknown"),
                                    "a transaction was mined and reverted: its call had no effect, its fee was paid"
                                );
                            }
                            tracing::debug!(%signer, nonce, tx_id = %row.tx_id, attempt, block = f.stored.block_number, status = f.stored.status, "receipt found");
                            plan.found(f, row.tx_id)?;
                        }
                        Err(e) => plan.failed(row.tx_id, after, e.to_string()),
                    }
                }
                Looked::Failed(why) => plan.failed(row.tx_id, after, why),
                Looked::NotFound => {
                    let staleness = decide::staleness(
                        nonce,
                        latest,
                        millis(row.stale_ms),
                        self.config.stale_receipt_timeout,
                    );
                    if let (Staleness::Prove, Some(latest), Ok(address)) =
                        (staleness, latest, &address)
                        && proofs < PROOFS_PER_DRIVE
                    {
                        proofs += 1;
                        if let Some(replaced) = self
                            .replaced(ctx, row, nonce, *address, &c.hashes, latest)
                            .await?
                        {
                            plan.replaced.push(replaced);
                            continue;
                        }
                    }
                    // The chain's nonce is not past ours (again: a reorg took the block that had
                    // passed it), and the broadcaster stopped sending it when it saw it passed:
                    // nothing would send it, and every later nonce would queue behind it.
                    if staleness == Staleness::Pending && row.resubmit_stopped {
                        tracing::warn!(
                            target: "txflow::receipts",
                            event = NONCE_GAP_CLOSED,
                            %signer,
                            nonce,
                            tx_id = %row.tx_id,
                            chain_nonce = ?latest,
                            "the chain's nonce is back below a submitted transaction nothing sends: its latest attempt is sent again"
                        );
                        plan.rearm.push(row.tx_id);
                    }
                    // Not proven (yet), or the proof waits for a later drive: the mark stays set.
                    plan.look_again(row.tx_id, after, staleness.mark());
                }
            }
        }
        if plan.failures > 0 {
            tracing::warn!(%signer, failures = plan.failures, first = plan.first_failure.as_deref().unwrap_or(""), "receipt lookups failed: looked up again after a back-off");
        }
        if !plan.moves() && plan.schedules.is_empty() {
            return Ok(Vec::new());
        }
        if plan.moves() {
            txflow_core::fault::point(txflow_core::fault::AFTER_CALL);
        }

        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let mut w = tx.writer();
        let mined: Vec<&Mined> = plan.mined.iter().collect();
        let reverted: Vec<&Mined> = plan.reverted.iter().collect();
        let moved = store::mine_and_revert(&mut w, &mined, &reverted).await?;
        let gone = store::replace(&mut w, &plan.replaced).await?;
        let ended: Vec<Uuid> = moved.iter().chain(&gone).copied().collect();
        store::end_resubmissions(&mut w, &ended).await?;
        store::schedule(&mut w, &plan.schedules).await?;
        store::rearm_resubmissions(&mut w, &plan.rearm).await?;
        tx.commit().await?;
        metrics::get().tx_reverted(
            key.chain_id,
            plan.reverted
                .iter()
                .filter(|m| moved.contains(&m.row.tx_id))
                .count() as u64,
        );

        // On tx.receipts for the confirmation manager, and a copy on tx.outcomes for downstream.
        let skey = signer_key(key.chain_id.0, signer);
        let topics = &self.config.topics;
        Ok(plan
            .emits
            .into_iter()
            .filter(|(tx_id, _)| moved.contains(tx_id))
            .flat_map(|(_, e)| txflow_core::outbox::receipt(topics, skey.clone(), e))
            .collect())
    }

    /// The REPLACE row of a transaction without a receipt whose nonce has been passed for the
    /// stale timeout, if the chain proves that a transaction txflow did not send used its nonce
    /// ([`Self::prove`]); `None` while it cannot (it stays SUBMITTED, looked up again).
    async fn replaced(
        &self,
        ctx: &DriveCtx<'_>,
        row: &DueRow,
        nonce: i64,
        address: Address,
        hashes: &[B256],
        latest: u64,
    ) -> Result<Option<Row>, HandlerError> {
        let key = ctx.lease.key();
        let signer = key.signer.as_str();
        let (chain_nonce, block) = match self.prove(address, nonce, hashes, latest).await {
            Ok(NonceTooLow::Replaced { chain_nonce, block }) => (chain_nonce, block),
            Ok(NonceTooLow::PossiblySent) => {
                tracing::warn!(%signer, nonce, tx_id = %row.tx_id, "one of its hashes is in the block where the nonce passed, but no receipt was found: waiting for the receipt");
                return Ok(None);
            }
            Ok(NonceTooLow::NotFinal {
                block,
                confirmations,
                required,
            }) => {
                tracing::info!(
                    target: "txflow::receipts",
                    event = REPLACEMENT_NOT_FINAL,
                    %signer,
                    nonce,
                    tx_id = %row.tx_id,
                    block,
                    confirmations,
                    required,
                    "the nonce was used by a transaction txflow did not send, in a block not final yet: \
                     the transaction keeps its nonce (a reorg may still bring it back) until that block is final"
                );
                return Ok(None);
            }
            Ok(NonceTooLow::Undecided) => {
                tracing::warn!(%signer, nonce, tx_id = %row.tx_id, "the nonce passed without a receipt, and whose nonce it is cannot be told yet");
                return Ok(None);
            }
            Err(e) => {
                tracing::warn!(%signer, nonce, tx_id = %row.tx_id, error = %e, "cannot tell whose nonce this is yet");
                return Ok(None);
            }
        };
        let reason = format!(
            "nonce {nonce} was used by a transaction txflow did not send (in block {block}, which holds none of its hashes; chain nonce {chain_nonce}; no receipt for any of its hashes for {:?})",
            self.config.stale_receipt_timeout
        );
        tracing::warn!(%signer, nonce, tx_id = %row.tx_id, %reason, "replaced: re-allocating a fresh nonce");
        let event_id = Uuid::new_v4();
        let event = TxReplaced {
            event_id: event_id.to_string(),
            tx_id: row.tx_id.to_string(),
            chain_id: key.chain_id.0,
            signer: signer.to_string(),
            nonce,
            chain_nonce: i64::try_from(chain_nonce).unwrap_or(i64::MAX),
            reason,
            fencing_token: ctx.lease.token().0,
        };
        Ok(Some(Row {
            tx_id: row.tx_id,
            event_id,
            event: audit_json(REPLACE, &event)?,
        }))
    }
}
