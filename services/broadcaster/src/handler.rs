//! The broadcaster's stage: SIGNED → SUBMITTED | REPLACED | FAILED, and the resubmission of
//! SUBMITTED transactions the chain has not mined. Route → load ([`store`]) → call the chain →
//! decide ([`decide`]) → persist ([`store`], fenced) → outputs.
//!
//! Nothing is written when a TxSigned message arrives (the attempt was persisted before it was
//! produced): the sends happen in [`Handler::drive`], outside any transaction, right after a
//! batch commits and in the recovery scan.

use std::collections::HashSet;
use std::sync::Arc;

use alloy::primitives::{Address, B256};
use sqlx::PgPool;
use txflow_core::chain::{ChainClient, ChainError, SendOutcome};
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{TxFailed, TxReplaced, TxSigned, TxSubmitted};
use txflow_core::failure::{FailureCode, truncate_reason};
use txflow_core::fenced::Fenced;
use txflow_core::kafka::signer_key;
use txflow_core::metrics;
use txflow_core::retry::Classify;
use txflow_core::role::Role;
use txflow_core::stage::handler::{audit_json, db, route_signer, signer_address};
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output, Rejection};
use txflow_core::state::{FAIL_SIGNED, Move, REPLACE, RESUBMIT, SUBMIT};
use uuid::Uuid;

use crate::config::BroadcasterConfig;
use crate::decide::{
    self, Answer, Funds, IntoSent, NonceFacts, NonceTooLow, PassedIn, Record, Resent, Stop,
};
use crate::store::{self, DueRow, FailSigned, Row, SignedRow, Submit};

/// The broadcaster's handler.
#[derive(Debug)]
pub struct BroadcastStage {
    pub config: BroadcasterConfig,
    pub chain: Arc<dyn ChainClient>,
}

/// The audit row of `m` for an event: its id and its JSON.
fn audit_row<E: serde::Serialize>(
    tx_id: Uuid,
    event_id: Uuid,
    m: Move,
    event: &E,
) -> Result<Row, HandlerError> {
    Ok(Row {
        tx_id,
        event_id,
        event: audit_json(m, event)?,
    })
}

impl BroadcastStage {
    pub fn new(config: BroadcasterConfig, chain: Arc<dyn ChainClient>) -> BroadcastStage {
        BroadcastStage { config, chain }
    }
}

impl Handler for BroadcastStage {
    type Input = TxSigned;

    fn role(&self) -> Role {
        Role::Broadcaster
    }

    fn input_topic(&self) -> String {
        self.config.topics.tx_signed()
    }

    fn route(&self, s: &TxSigned) -> Result<(ChainId, Signer), Rejection> {
        route_signer(s.chain_id, &s.signer)
    }

    /// Nothing to write: the attempt was persisted before TxSigned was produced. The send happens
    /// in `drive`, right after the batch commits.
    async fn handle(
        &self,
        _w: &mut Fenced<'_>,
        _s: &TxSigned,
    ) -> Result<Vec<Output>, HandlerError> {
        Ok(Vec::new())
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        store::pending_signers(pool, self.config.chain_id).await
    }

    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let (outputs, mut funds, held) = self.send_signed(&ctx).await?;
        // Resubmissions are due every few seconds at most: the recovery scan's drives (which
        // include every signer with one due) are enough, not every batch's.
        // So are the defensive cancellations after a deep reorg (sent first: the most urgent).
        if ctx.recovery {
            let address = signer_address(ctx.lease.key())
                .map_err(|e| HandlerError::classified("signer address", e))?;
            let mut latest = LatestNonce::new(self.chain.as_ref(), address);
            funds = funds.and(self.send_cancellations(&ctx, &mut latest).await?);
            funds = funds.and(self.resubmit(&ctx, &mut latest).await?);
            self.close_gap(&ctx, &mut latest).await?;
        }
        // A refusal for funds held the signer where it happened. The hold clears only when a node
        // took a send of this drive and none was refused for funds ([`Funds`]); a drive that
        // failed clears nothing. When the drive's read of its SIGNED rows saw no hold there is
        // none to clear (only this stage, under the signer's lock, holds it, and a hold made
        // since means a refusal, so not `Paid`): no statement.
        if funds == Funds::Paid && held != Some(false) {
            txflow_core::holds::resume(ctx.pool, ctx.lease.key())
                .await
                .map_err(db("resume"))?;
        }
        Ok(outputs)
    }
}

/// The chain's latest nonce of a recovery drive's signer, read once, when first needed: the
/// defensive cancellations, the resubmissions and the gap check all compare with it. A block
/// mined between them only makes a later one look at a slightly older nonce, which costs at
/// most a send the node refuses as used; the next scan reads again.
struct LatestNonce<'a> {
    chain: &'a dyn ChainClient,
    address: Address,
    read: Option<u64>,
}

impl<'a> LatestNonce<'a> {
    fn new(chain: &'a dyn ChainClient, address: Address) -> LatestNonce<'a> {
        LatestNonce {
            chain,
            address,
            read: None,
        }
    }

    async fn get(&mut self) -> Result<u64, HandlerError> {
        if let Some(n) = self.read {
            return Ok(n);
        }
        let n = self
            .chain
            .latest_nonce(self.address)
            .await
            .map_err(|e| HandlerError::classified("latest nonce", e))?;
        self.read = Some(n);
        Ok(n)
    }
}

/// An output of a recorded send, emitted if its row moved.
enum Emit {
    Submitted(TxSubmitted),
    Failed(TxFailed),
}

impl BroadcastStage {
    /// Sends the signer's SIGNED transactions in nonce order, outside any transaction, and records
    /// what the node said; stops at the first one that must wait (later nonces would only queue
    /// behind it), once a send that failed for now was sent again a few times within the drive
    /// ([`Self::send_with_backoff`]). Holds the signer on "insufficient funds"; returns the
    /// outputs, what the sends said about the funds, and whether the signer was held when its
    /// rows were read (`None`: no SIGNED row).
    async fn send_signed(
        &self,
        ctx: &DriveCtx<'_>,
    ) -> Result<(Vec<Output>, Funds, Option<bool>), HandlerError> {
        let key = ctx.lease.key();
        let signed = store::signed_rows(ctx.pool, key)
            .await
            .map_err(db("list signed"))?;
        let mut funds = Funds::Untold;
        let Some(held) = signed.first().map(|r| r.held) else {
            return Ok((Vec::new(), funds, None));
        };
        let mut recorded = Vec::new();
        for row in signed {
            let nonce = row.nonce;
            let answer = match self.send_with_backoff(ctx, &row).await {
                Ok(outcome) => decide::classify_send(outcome),
                Err(e) => {
                    tracing::warn!(signer = %key.signer, nonce, error = %e, transient = e.is_transient(), "sending failed");
                    break;
                }
            };
            let sent = match answer {
                Answer::Decided(sent) => sent,
                Answer::NonceTooLow { reason } => match self.whose_nonce(ctx, &row).await {
                    Ok(decision) => decision.into_sent(nonce, &reason),
                    Err(e) => {
                        tracing::warn!(signer = %key.signer, nonce, error = %e, "cannot tell whose nonce this is yet");
                        break;
                    }
                },
            };
            let split = sent.split();
            funds = funds.and(match &split {
                Ok(record) => record.funds(),
                Err(stop) => stop.funds(),
            });
            match split {
                Ok(record) => recorded.push((row, record)),
                Err(Stop::Hold(reason)) => {
                    txflow_core::holds::hold(ctx.pool, key, &reason)
                        .await
                        .map_err(db("hold"))?;
                    break;
                }
                Err(Stop::Wait(reason)) => {
                    tracing::warn!(signer = %key.signer, nonce, %reason, "the node refused a transaction for now");
                    break;
                }
                Err(Stop::Undecided) => break,
            }
        }
        if recorded.is_empty() {
            return Ok((Vec::new(), funds, Some(held)));
        }
        txflow_core::fault::point(txflow_core::fault::AFTER_CALL);
        Ok((self.record_sends(ctx, recorded).await?, funds, Some(held)))
    }

    /// Sends `row`, and sends it again within the drive while the send fails for now
    /// ([`decide::send_again`], or a transient RPC error: every round of the client over the
    /// endpoints failed), after the pauses of [`decide::send_backoff`]; the last answer or error.
    /// Nothing later is sent meanwhile, so nonce order holds. The pauses are awaited in the drive:
    /// a drive dropped (lease lost, runtime stopped) drops them too.
    async fn send_with_backoff(
        &self,
        ctx: &DriveCtx<'_>,
        row: &SignedRow,
    ) -> Result<SendOutcome, ChainError> {
        let mut failures: u32 = 0;
        loop {
            let result = self.chain.send_raw(&row.raw_tx).await;
            metrics::get().tx_submit(txflow_core::chain::submit_result(&result));
            let again = match &result {
                Ok(outcome) => decide::send_again(outcome),
                Err(e) => e.is_transient(),
            };
            failures = failures.saturating_add(1);
            let pause = match decide::send_backoff(failures) {
                Some(pause) if again => pause,
                _ => return result,
            };
            let signer = &ctx.lease.key().signer;
            match &result {
                Ok(outcome) => {
                    tracing::info!(%signer, nonce = row.nonce, ?outcome, failures, pause_ms = pause.as_millis() as u64, "the node did not take the transaction for now: sent again within the drive")
                }
                Err(e) => {
                    tracing::info!(%signer, nonce = row.nonce, error = %e, failures, pause_ms = pause.as_millis() as u64, "sending failed: sent again within the drive")
                }
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// "nonce too low": gathers what the chain says of whose nonce it is, and
    /// [`decide::nonce_too_low`] decides. In order, each only if still needed: whether the node
    /// knows one of the transaction's hashes (by hash or by receipt); the signer's latest nonce;
    /// then the block where the signer's nonce passed ours ([`decide::PassSearch`]) and its transaction
    /// hashes. A lookup that fails is an error: undecided, tried again later.
    async fn whose_nonce(
        &self,
        ctx: &DriveCtx<'_>,
        row: &SignedRow,
    ) -> Result<NonceTooLow, ChainError> {
        // A failed read is as good as no hash: undecided, tried again later.
        let hashes = store::attempt_hashes(ctx.pool, row.tx_id)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(tx_id = %row.tx_id, error = %e, "could not read the transaction's hashes");
                Vec::new()
            });
        let mut facts = NonceFacts {
            ours: hashes
                .iter()
                .filter_map(|h| h.parse::<B256>().ok())
                .collect(),
            required: self.config.confirmations_required,
            ..NonceFacts::default()
        };
        if facts.ours.len() != hashes.len() {
            // A hash we cannot read could be the one mined: no proof can be complete.
            tracing::warn!(tx_id = %row.tx_id, "a recorded hash is not a hash");
            return Ok(NonceTooLow::Undecided);
        }
        for &hash in &facts.ours {
            if self.chain.knows_transaction(hash).await?
                || self.chain.receipt(hash).await?.is_some()
            {
                facts.known = true;
                return Ok(decide::nonce_too_low(row.nonce, &facts));
            }
        }
        let Ok(address) = signer_address(ctx.lease.key()) else {
            return Ok(NonceTooLow::Undecided);
        };
        facts.latest = Some(self.chain.latest_nonce(address).await?);
        if decide::needs_search(row.nonce, &facts)
            && let Ok(nonce) = u64::try_from(row.nonce)
        {
            facts.passed_in = self.passed_in(address, nonce).await?;
        }
        Ok(decide::nonce_too_low(row.nonce, &facts))
    }

    /// The block where `address`'s nonce passed `nonce`, and its transaction hashes: `None` if
    /// the chain's answers do not add up (or the block is gone).
    async fn passed_in(
        &self,
        address: Address,
        nonce: u64,
    ) -> Result<Option<PassedIn>, ChainError> {
        txflow_core::chain::passed_in(self.chain.as_ref(), address, nonce).await
    }

    /// Records the sends in one fenced transaction: SUBMIT, REPLACE and FAIL_SIGNED, each for all
    /// its rows at once. The outputs of the rows that moved, in nonce order.
    async fn record_sends(
        &self,
        ctx: &DriveCtx<'_>,
        recorded: Vec<(SignedRow, Record)>,
    ) -> Result<Vec<Output>, HandlerError> {
        let key = ctx.lease.key();
        let token = ctx.lease.token().0;
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let mut w = tx.writer();
        let refused: Vec<Uuid> = recorded
            .iter()
            .filter(|(_, r)| matches!(r, Record::Refused(_)))
            .map(|(row, _)| row.tx_id)
            .collect();
        let request_ids = store::request_ids(&mut w, &refused).await?;

        let mut submits = Vec::new();
        let mut replaces = Vec::new();
        let mut fails = Vec::new();
        let mut emits = Vec::with_capacity(recorded.len());
        for (row, record) in recorded {
            let event_id = Uuid::new_v4();
            let tx_id = row.tx_id;
            let nonce = row.nonce;
            match record {
                Record::Submitted(outcome) => {
                    let event = TxSubmitted {
                        event_id: event_id.to_string(),
                        tx_id: tx_id.to_string(),
                        chain_id: key.chain_id.0,
                        signer: key.signer.as_str().to_string(),
                        nonce,
                        attempt: row.attempt,
                        tx_hash: row.tx_hash,
                        outcome,
                        submitted_at_ms: chrono::Utc::now().timestamp_millis(),
                        fencing_token: token,
                    };
                    submits.push(Submit {
                        row: audit_row(tx_id, event_id, SUBMIT, &event)?,
                        attempt: row.attempt,
                    });
                    emits.push((tx_id, Emit::Submitted(event)));
                }
                Record::Replaced {
                    chain_nonce,
                    reason,
                } => {
                    tracing::warn!(signer = %key.signer, nonce, tx_id = %tx_id, %reason, "replaced: re-allocating a fresh nonce");
                    let event = TxReplaced {
                        event_id: event_id.to_string(),
                        tx_id: tx_id.to_string(),
                        chain_id: key.chain_id.0,
                        signer: key.signer.as_str().to_string(),
                        nonce,
                        chain_nonce: i64::try_from(chain_nonce).unwrap_or(i64::MAX),
                        reason,
                        fencing_token: token,
                    };
                    replaces.push(audit_row(tx_id, event_id, REPLACE, &event)?);
                }
                Record::Refused(reason) => {
                    tracing::error!(signer = %key.signer, nonce, tx_id = %tx_id, %reason, "the node refuses the transaction for good: failed, nonce released");
                    let event = TxFailed {
                        event_id: event_id.to_string(),
                        tx_id: tx_id.to_string(),
                        request_id: request_ids.get(&tx_id).cloned().unwrap_or_default(),
                        chain_id: key.chain_id.0,
                        signer: key.signer.as_str().to_string(),
                        code: FailureCode::SendRejected.as_str().to_string(),
                        reason: truncate_reason(&reason),
                        nonce: Some(nonce),
                        nonce_released: true,
                        fencing_token: token,
                    };
                    fails.push(FailSigned {
                        row: audit_row(tx_id, event_id, FAIL_SIGNED, &event)?,
                        reason: event.reason.clone(),
                    });
                    emits.push((tx_id, Emit::Failed(event)));
                }
            }
        }

        let mut moved: HashSet<Uuid> = HashSet::new();
        moved.extend(store::submit(&mut w, &submits, self.config.resubmit_interval).await?);
        store::replace(&mut w, &replaces).await?;
        moved.extend(store::fail_signed(&mut w, &fails).await?);
        tx.commit().await?;

        let skey = signer_key(key.chain_id.0, key.signer.as_str());
        let topics = &self.config.topics;
        Ok(emits
            .into_iter()
            .filter(|(tx_id, _)| moved.contains(tx_id))
            .flat_map(|(_, emit)| match emit {
                // On tx.submitted for the receipt checker, and a copy on tx.outcomes.
                Emit::Submitted(e) => txflow_core::outbox::submitted(topics, skey.clone(), e),
                Emit::Failed(e) => vec![Output::new(
                    topics.tx_outcomes(),
                    Subjects::TopicRecordName,
                    skey.clone(),
                    e,
                )],
            })
            .collect())
    }

    /// Closes a gap at the chain's nonce (issue 32 item 10): when txflow sent something for the
    /// signer at or above the chain's latest nonce and the node holds nothing pending at it (a
    /// reorg took the block that held our transactions; nodes do not re-pool them), what txflow
    /// signed for each nonce from the chain's up to the highest it sent is sent again as it is,
    /// in nonce order — the latest attempt of the transaction holding it (not being
    /// re-evaluated), else its defensive cancellation. The same bytes can only ever be mined
    /// once. It stops at a nonce with nothing to send (later ones would only queue behind it)
    /// or at a send that failed; the next scan looks again.
    async fn close_gap(
        &self,
        ctx: &DriveCtx<'_>,
        latest: &mut LatestNonce<'_>,
    ) -> Result<(), HandlerError> {
        let key = ctx.lease.key();
        let Some(highest) = store::highest_sent_nonce(ctx.pool, key)
            .await
            .map_err(db("highest sent nonce"))?
        else {
            return Ok(());
        };
        let address = latest.address;
        let latest = latest.get().await?;
        let Ok(from) = i64::try_from(latest) else {
            return Ok(());
        };
        if from > highest {
            return Ok(());
        }
        let pending = self
            .chain
            .pending_nonce(address)
            .await
            .map_err(|e| HandlerError::classified("pending nonce", e))?;
        if pending > latest {
            return Ok(());
        }
        for at in from..=highest {
            let Some((what, tx_id, raw)) = store::signed_at_nonce(ctx.pool, key, at)
                .await
                .map_err(db("signed at nonce"))?
            else {
                return Ok(());
            };
            let sent = self.chain.send_raw(&raw).await;
            tracing::warn!(
                target: "txflow::reorg",
                event = NONCE_GAP_RESENT,
                signer = %key.signer,
                nonce = at,
                highest_sent = highest,
                what,
                %tx_id,
                outcome = ?sent,
                "nothing is pending at the chain's nonce below what txflow sent: its signed bytes for that nonce are sent again"
            );
            if sent.is_err() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Sends again, every `resubmit_interval`, the latest attempt of each submitted transaction
    /// the chain has not mined yet (a node may drop what it accepted); stops tracking the ones
    /// whose nonce the chain has passed. Holds the signer on "insufficient funds"; returns what
    /// the resends said about the funds.
    async fn resubmit(
        &self,
        ctx: &DriveCtx<'_>,
        latest: &mut LatestNonce<'_>,
    ) -> Result<Funds, HandlerError> {
        let key = ctx.lease.key();
        let mut funds = Funds::Untold;
        let due = store::due_resubmissions(ctx.pool, key)
            .await
            .map_err(db("list due resubmissions"))?;
        if due.is_empty() {
            return Ok(funds);
        }
        let latest = latest.get().await?;
        let split = decide::split_due(due, latest, |d: &DueRow| d.nonce);
        let passed: Vec<Uuid> = split.passed.iter().map(|d| d.tx_id).collect();
        let mut resent = Vec::new();
        for d in split.resend {
            let nonce = d.nonce;
            let sent = self.chain.send_raw(&d.raw_tx).await;
            metrics::get().tx_submit(txflow_core::chain::submit_result(&sent));
            metrics::get().tx_resubmit(Role::Broadcaster);
            let answer = sent.map(|outcome| {
                funds = funds.and(decide::resend_funds(&outcome));
                decide::classify_resend(outcome)
            });
            match answer {
                Ok(Resent::Sent) => {
                    tracing::info!(signer = %key.signer, nonce, attempt = d.attempt, "resubmitted");
                    resent.push(d);
                }
                Ok(Resent::Refused(reason)) => {
                    tracing::warn!(signer = %key.signer, nonce, %reason, "resubmission refused");
                    resent.push(d);
                }
                Ok(Resent::Hold(reason)) => {
                    txflow_core::holds::hold(ctx.pool, key, &reason)
                        .await
                        .map_err(db("hold"))?;
                    break;
                }
                Err(e) => {
                    tracing::warn!(signer = %key.signer, nonce, error = %e, "resubmission failed");
                    break;
                }
            }
        }
        if passed.is_empty() && resent.is_empty() {
            return Ok(funds);
        }
        let token = ctx.lease.token().0;
        let rows = resent
            .iter()
            .map(|d| {
                let event = serde_json::json!({
                    "tx_id": d.tx_id.to_string(),
                    "nonce": d.nonce,
                    "attempt": d.attempt,
                    "fencing_token": token,
                });
                audit_row(d.tx_id, Uuid::new_v4(), RESUBMIT, &event)
            })
            .collect::<Result<Vec<Row>, HandlerError>>()?;
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let mut w = tx.writer();
        store::passed(&mut w, &passed).await?;
        store::resubmitted(&mut w, &rows, self.config.resubmit_interval).await?;
        tx.commit().await?;
        Ok(funds)
    }
}

/// The stable event name logged when the chain's nonce is below what txflow sent for the
/// signer and nothing is pending at it: the signed bytes txflow holds for that nonce are sent
/// again (a reorg took the block that held them, and nodes do not put reorged transactions back
/// in their pool).
pub const NONCE_GAP_RESENT: &str = "nonce_gap_resent";

/// The stable event name of a defensive cancellation sent (WARN the first time a node takes it,
/// INFO on every later send).
pub const CANCELLATION_SENT: &str = "reorg_cancellation_sent";

/// The stable event name of the critical alert raised when a node refuses a defensive
/// cancellation for good: the nonce it should void stays unprotected.
pub const CANCELLATION_REFUSED: &str = "reorg_cancellation_refused";

impl BroadcastStage {
    /// Sends the signer's defensive cancellations that are due (seed 000 §4.4: signed by the
    /// signer gateway for a transaction a deep reorg undid), outside any transaction, in nonce
    /// order, then records the look at each in one fenced statement; each is due again after
    /// `resubmit_interval` for as long as its transaction is re-evaluated and not mined again.
    /// One whose nonce the chain has passed is not sent (the cancellation or the original is
    /// mined: the confirmation manager tells which, from the chain); nothing here moves a state.
    /// Holds the signer on "insufficient funds"; returns what the sends said about the funds.
    async fn send_cancellations(
        &self,
        ctx: &DriveCtx<'_>,
        latest: &mut LatestNonce<'_>,
    ) -> Result<Funds, HandlerError> {
        let key = ctx.lease.key();
        let mut funds = Funds::Untold;
        let due = store::due_cancellations(ctx.pool, key)
            .await
            .map_err(db("list due cancellations"))?;
        if due.is_empty() {
            return Ok(funds);
        }
        let latest = latest.get().await?;
        let mut looked = Vec::with_capacity(due.len());
        for c in due {
            let nonce = c.nonce;
            if decide::nonce_consumed(nonce, latest) {
                tracing::debug!(signer = %key.signer, nonce, "the cancellation's nonce is used: not sent");
                looked.push((nonce, false));
                continue;
            }
            let outcome = match self.chain.send_raw(&c.raw_tx).await {
                Ok(outcome) => outcome,
                Err(e) => {
                    tracing::warn!(signer = %key.signer, nonce, error = %e, "sending a defensive cancellation failed: the next recovery scan tries again");
                    break;
                }
            };
            funds = funds.and(decide::resend_funds(&outcome));
            match decide::classify_cancellation(outcome) {
                decide::CancelSent::Taken => {
                    metrics::get().tx_defensive_cancellation("sent", 1);
                    if c.sends == 0 {
                        tracing::warn!(
                            target: "txflow::reorg",
                            event = CANCELLATION_SENT,
                            chain_id = key.chain_id.0,
                            signer = %key.signer,
                            tx_id = %c.tx_id,
                            nonce,
                            tx_hash = %c.tx_hash,
                            sends = c.sends + 1,
                            "defensive cancellation sent: whichever of it and the original is mined settles the nonce"
                        );
                    } else {
                        tracing::info!(
                            target: "txflow::reorg",
                            event = CANCELLATION_SENT,
                            chain_id = key.chain_id.0,
                            signer = %key.signer,
                            tx_id = %c.tx_id,
                            nonce,
                            tx_hash = %c.tx_hash,
                            sends = c.sends + 1,
                            "defensive cancellation sent again"
                        );
                    }
                    looked.push((nonce, true));
                }
                decide::CancelSent::Consumed => looked.push((nonce, false)),
                decide::CancelSent::Hold(reason) => {
                    txflow_core::holds::hold(ctx.pool, key, &reason)
                        .await
                        .map_err(db("hold"))?;
                    looked.push((nonce, false));
                    break;
                }
                decide::CancelSent::NotTaken {
                    reason,
                    alert: true,
                } => {
                    tracing::error!(
                        target: "txflow::alert",
                        event = CANCELLATION_REFUSED,
                        alert = true,
                        chain_id = key.chain_id.0,
                        signer = %key.signer,
                        tx_id = %c.tx_id,
                        nonce,
                        tx_hash = %c.tx_hash,
                        %reason,
                        "a node refuses the defensive cancellation for good: the nonce it voids is unprotected, sent again at the next interval"
                    );
                    looked.push((nonce, false));
                }
                decide::CancelSent::NotTaken {
                    reason,
                    alert: false,
                } => {
                    tracing::warn!(signer = %key.signer, tx_id = %c.tx_id, nonce, %reason, "a node did not take the defensive cancellation: sent again at the next interval");
                    looked.push((nonce, false));
                }
            }
        }
        if looked.is_empty() {
            return Ok(funds);
        }
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let mut w = tx.writer();
        store::cancellations_looked_at(&mut w, &looked, self.config.resubmit_interval).await?;
        tx.commit().await?;
        Ok(funds)
    }
}
