//! The allocator's two handlers, each route → load → decide (`decide.rs`) → persist
//! (`store.rs`) → outputs.
//!
//! - [`RequestStage`] (`tx.requests`): `handle` validates and records RECEIVED, idempotent on
//!   (chain, signer, request_id), with what it depends on; `drive` first keeps a chained request
//!   RECEIVED until its parent is CONFIRMED (or fails it with its parent), then simulates
//!   (RECEIVED → SIMULATED / PENDING_APPROVAL / FAILED; a request the signer cannot pay for
//!   stays RECEIVED, held alone with its reason and a back-off while the signer can pay for
//!   others, or with the whole signer held when it can pay for none), allocates nonces
//!   (SIMULATED / REPLACED → ALLOCATED; a transaction that cannot be allocated as recorded fails
//!   alone) and fills released nonces nobody took with no-ops.
//!   External calls run outside any transaction.
//! - [`CommandStage`] (`tx.commands`): APPROVE and CANCEL, compare-and-sets on the state of a
//!   transaction of the command's signer; a command naming a transaction that is not the
//!   signer's (`TX_NOT_OF_SIGNER`) or no transaction (`UNKNOWN_TX`) is dead-lettered.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use alloy::primitives::{Address, Bytes, U256};
use sqlx::PgPool;
use txflow_core::chain::{ChainClient, Simulation};
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer, TxPayload};
use txflow_core::events::{
    Event, TxAccepted, TxAllocated, TxCommand, TxCommandKind, TxFailed, TxRequest,
};
use txflow_core::failure::{FailureCode, truncate_reason};
use txflow_core::fenced::{Fenced, FencedTx};
use txflow_core::kafka::signer_key;
use txflow_core::lease::HeldLease;
use txflow_core::metrics;
use txflow_core::retry::Classify;
use txflow_core::role::Role;
use txflow_core::stage::{BatchResults, DriveCtx, Handler, HandlerError, Output, Rejection};
use txflow_core::state::{self, TxState};
use txflow_core::txstore::{Audit, Kind, MoveRow, NewTx, TxRow};
use uuid::Uuid;

use crate::config::AllocatorConfig;
use crate::decide::{self, AfterSimulation, CommandDecision, CommandTarget, SimError};
use crate::store;

/// Requests: RECEIVED on the message, then simulation and allocation in `drive`.
pub struct RequestStage {
    pub config: AllocatorConfig,
    pub chain: Arc<dyn ChainClient>,
}

/// The id of an event we made (a UUID), as `tx_events.event_id`.
fn event_uuid<E: Event>(event: &E) -> Result<Uuid, HandlerError> {
    Uuid::parse_str(event.event_id())
        .map_err(|e| HandlerError::fail("INVALID_EVENT_ID", e.to_string()))
}

/// The audit row of a created transaction: `event` (its JSON) under `event_type`.
fn audit<E: Event>(event_type: &'static str, event: &E) -> Result<Audit, HandlerError> {
    Ok(Audit {
        event_id: event_uuid(event)?,
        event_type,
        payload: json(event)?,
    })
}

fn json<T: serde::Serialize>(v: &T) -> Result<serde_json::Value, HandlerError> {
    serde_json::to_value(v).map_err(|e| HandlerError::fail("ENCODE", e.to_string()))
}

fn parse_payload(row: &TxRow) -> Result<TxPayload, String> {
    serde_json::from_value(row.payload.clone())
        .map_err(|e| format!("the recorded payload of {} does not parse: {e}", row.tx_id))
}

fn new_event_id() -> String {
    Uuid::new_v4().to_string()
}

/// The announcement of a failure.
fn failed_event(
    lease: &HeldLease,
    row: &TxRow,
    code: FailureCode,
    reason: &str,
    released_nonce: Option<i64>,
) -> TxFailed {
    TxFailed {
        event_id: new_event_id(),
        tx_id: row.tx_id.to_string(),
        request_id: row.request_id.clone(),
        chain_id: lease.key().chain_id.0,
        signer: lease.key().signer.as_str().to_string(),
        code: code.as_str().to_string(),
        reason: truncate_reason(reason),
        nonce: released_nonce,
        nonce_released: released_nonce.is_some(),
        fencing_token: lease.token().0,
    }
}

/// A move to FAILED with its announcement.
fn fail_row(
    lease: &HeldLease,
    row: &TxRow,
    code: FailureCode,
    reason: &str,
    released_nonce: Option<i64>,
) -> Result<(MoveRow, TxFailed), HandlerError> {
    let failed = failed_event(lease, row, code, reason, released_nonce);
    let mut m = MoveRow::new(row.tx_id, event_uuid(&failed)?, json(&failed)?);
    m.failure = Some((code, failed.reason.clone()));
    Ok((m, failed))
}

/// What a drive's simulation decided, before it is written.
struct SimWrites {
    /// RECEIVED → FAILED (announced by `failed` when they land).
    failing: Vec<MoveRow>,
    failed: Vec<TxFailed>,
    /// RECEIVED → PENDING_APPROVAL.
    waiting: Vec<MoveRow>,
    /// RECEIVED → SIMULATED.
    simulated: Vec<MoveRow>,
    /// Requests held alone (they stay RECEIVED).
    held: Vec<store::RequestHold>,
    /// The rows of `simulated` as they are once moved.
    as_simulated: Vec<TxRow>,
}

/// What an allocation decided before its transaction opens.
struct AllocationPlan {
    /// The signer's nonces in flight, as counted for the budget.
    in_flight: i64,
    /// The chain's nonce at its last final block, to align the cursor on, when it was asked.
    chain_nonce: Option<i64>,
    /// The rows to allocate, in request order, with their payloads as allocated.
    ready: Vec<(TxRow, TxPayload)>,
    /// SIMULATED rows that cannot be allocated as recorded: to FAILED, announced by `failed`.
    failing: Vec<MoveRow>,
    failed: Vec<TxFailed>,
}

impl RequestStage {
    fn key(&self, lease: &HeldLease) -> String {
        signer_key(lease.key().chain_id.0, lease.key().signer.as_str())
    }

    fn outcome<E: Event + 'static>(&self, key: &str, event: E) -> Output {
        Output::new(
            self.config.topics.tx_outcomes(),
            Subjects::TopicRecordName,
            key.to_string(),
            event,
        )
    }

    /// Announcements of the failures that landed.
    fn failures(
        &self,
        key: &str,
        failed: Vec<TxFailed>,
        landed: &[txflow_core::txstore::Landed],
    ) -> Vec<Output> {
        failed
            .into_iter()
            .filter(|f| landed.iter().any(|l| l.tx_id.to_string() == f.tx_id))
            .map(|f| self.outcome(key, f))
            .collect()
    }
}

impl Handler for RequestStage {
    type Input = TxRequest;

    fn role(&self) -> Role {
        Role::Allocator
    }

    fn input_topic(&self) -> String {
        self.config.topics.tx_requests()
    }

    fn route(&self, r: &TxRequest) -> Result<(ChainId, Signer), Rejection> {
        decide::validate(r, self.config.chain_id).map(|v| (v.chain_id, v.signer))
    }

    async fn handle(&self, w: &mut Fenced<'_>, r: &TxRequest) -> Result<Vec<Output>, HandlerError> {
        match self.handle_batch(w, &[r]).await?.pop() {
            Some(result) => result,
            None => Ok(Vec::new()),
        }
    }

    /// All of a signer's requests of a batch: validated one by one (a refusal is that message's
    /// dead letter), recorded RECEIVED in one statement, and the duplicates' stored TxAccepted
    /// read back in one more (re-emitted with their original `event_id`).
    async fn handle_batch(&self, w: &mut Fenced<'_>, inputs: &[&TxRequest]) -> BatchResults {
        let lease = w.lease().clone();
        let key = self.key(&lease);
        let mut results: Vec<Option<Result<Vec<Output>, HandlerError>>> =
            inputs.iter().map(|_| None).collect();
        let mut rows = Vec::with_capacity(inputs.len());
        let mut announced = Vec::with_capacity(inputs.len());
        let mut submitters: Vec<(Uuid, String)> = Vec::new();
        for (k, r) in inputs.iter().enumerate() {
            let v = match decide::validate(r, self.config.chain_id) {
                Ok(v) => v,
                Err(rejection) => {
                    metrics::get().tx_create(metrics::create_result::INVALID, 1);
                    results[k] = Some(Err(HandlerError::Reject(rejection)));
                    continue;
                }
            };
            let tx_id = Uuid::now_v7();
            let accepted = TxAccepted {
                event_id: new_event_id(),
                tx_id: tx_id.to_string(),
                request_id: r.request_id.clone(),
                chain_id: v.chain_id.0,
                signer: v.signer.as_str().to_string(),
                fencing_token: lease.token().0,
                accepted_at_ms: chrono::Utc::now().timestamp_millis(),
            };
            rows.push(NewTx {
                tx_id,
                request_id: r.request_id.clone(),
                kind: Kind::Request,
                nonce: None,
                payload: json(&decide::payload_of(&v))?,
                audit: audit("TxAccepted", &accepted)?,
            });
            if let Some(by) = &v.submitted_by {
                submitters.push((tx_id, by.clone()));
            }
            announced.push((
                k,
                tx_id,
                accepted,
                decide::payload_of(&v),
                v.depends_on_request_id
                    .zip(v.depends_on_signer.map(|s| s.as_str().to_string())),
            ));
        }
        let created = store::accept(w, &rows).await?;
        metrics::get().tx_create(metrics::create_result::ACCEPTED, created.len() as u64);
        metrics::get().tx_create(
            metrics::create_result::DUPLICATE,
            rows.len().saturating_sub(created.len()) as u64,
        );
        // What the new ones depend on, in the same transaction: a chained request is never
        // visible to a drive without its parent's name.
        let dependencies: Vec<(Uuid, (String, String))> = announced
            .iter()
            .filter(|(_, tx_id, ..)| created.contains(tx_id))
            .filter_map(|(_, tx_id, _, _, parent)| parent.clone().map(|p| (*tx_id, p)))
            .collect();
        store::record_dependencies(w, &dependencies).await?;
        submitters.retain(|(tx_id, _)| created.contains(tx_id));
        store::record_submitters(w, &submitters).await?;
        // Duplicates (of an earlier batch, or of a message earlier in this one).
        let duplicates: Vec<String> = announced
            .iter()
            .filter(|(_, tx_id, ..)| !created.contains(tx_id))
            .map(|(_, _, a, ..)| a.request_id.clone())
            .collect();
        let stored = if duplicates.is_empty() {
            Vec::new()
        } else {
            store::recorded_requests(w, &duplicates).await?
        };
        for (k, tx_id, accepted, asked, asked_parent) in announced {
            let event = if created.contains(&tx_id) {
                Ok(accepted)
            } else {
                match stored.iter().find(|r| r.request_id == accepted.request_id) {
                    Some(r) => {
                        let recorded = serde_json::from_value::<TxPayload>(r.payload.clone());
                        match recorded {
                            // The same request again: re-announce the original.
                            Ok(recorded)
                                if decide::same_request(&recorded, &asked)
                                    && r.parent() == asked_parent =>
                            {
                                serde_json::from_value(r.accepted.clone())
                                    .map_err(|e| HandlerError::fail("CORRUPT_EVENT", e.to_string()))
                            }
                            // The id reused for something else: never merged into the original.
                            Ok(_) => Err(HandlerError::Reject(Rejection::new(
                                "DUPLICATE_REQUEST_ID",
                                format!(
                                    "request_id {:?} is already recorded as transaction {} with another destination, value, data or dependency",
                                    accepted.request_id, r.tx_id
                                ),
                            ))),
                            Err(e) => Err(HandlerError::fail("CORRUPT_ROW", e.to_string())),
                        }
                    }
                    None => Err(HandlerError::fail(
                        "CORRUPT_EVENT",
                        format!(
                            "request {:?} is recorded without its TxAccepted",
                            accepted.request_id
                        ),
                    )),
                }
            };
            results[k] = Some(event.map(|e| vec![self.outcome(&key, e)]));
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// Signers with transactions to simulate or allocate (among them those waiting for the
    /// in-flight budget; `ready_signers` drives those sooner once it has room), released
    /// nonces, and approvals past `approval.timeout`.
    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        let mut signers = store::pending_signers(pool, self.config.chain_id).await?;
        let expired = store::signers_with_expired_approvals(
            pool,
            self.config.chain_id,
            self.config.approval_timeout,
        )
        .await?;
        for key in expired {
            if !signers.contains(&key) {
                signers.push(key);
            }
        }
        Ok(signers)
    }

    /// Signers with requests waiting for the in-flight budget and room in it again: driven about
    /// every second, so that what mining freed is allocated without waiting for the scan.
    async fn ready_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        store::ready_signers(pool, self.config.chain_id, self.config.max_in_flight).await
    }

    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        // Approvals expire on the recovery scan's drives (which `pending_signers` extends to the
        // signers with one due): a day's deadline needs no more precision than the scan
        // interval, and the drives after each batch stay free of the read.
        let mut outputs = if ctx.recovery {
            self.expire_approvals(&ctx).await?
        } else {
            Vec::new()
        };
        // What allocation, the fill of released nonces and the signer's hold need to know, in
        // one statement before anything else: each phase then reads only what it works on.
        let snapshot =
            store::drive_snapshot(ctx.pool, ctx.lease.key(), self.config.nonce_state_timeout)
                .await
                .map_err(|e| HandlerError::transient("drive snapshot", e))?;
        let (simulated_outputs, writes) = self.simulate(&ctx, &snapshot).await?;
        outputs.extend(simulated_outputs);
        outputs.extend(self.simulate_and_allocate(&ctx, &snapshot, writes).await?);
        // A nonce released after the snapshot was taken is filled by a later drive: the
        // recovery scan drives every signer with one (`pending_signers`).
        if snapshot.released > 0 {
            outputs.extend(self.fill_released(&ctx).await?);
        }
        Ok(outputs)
    }
}

fn signer_address(lease: &HeldLease) -> Result<Address, HandlerError> {
    lease
        .key()
        .signer
        .as_str()
        .parse()
        .map_err(|e: alloy::hex::FromHexError| HandlerError::fail("INVALID_SIGNER", e.to_string()))
}

/// A parent as [`decide::dependency`] reads it; `None` when the child's parent is not recorded
/// yet; an error for a row this binary cannot read (a state it does not know).
fn parent_of(f: &store::ParentRow) -> Result<Option<decide::Parent>, String> {
    let (Some(tx_id), Some(chain_id), Some(signer), Some(state)) =
        (f.tx_id, f.chain_id, f.signer.as_ref(), f.state.as_deref())
    else {
        return Ok(None);
    };
    let state = TxState::parse(state).map_err(|e| format!("parent {tx_id}: {e}"))?;
    Ok(Some(decide::Parent {
        tx_id,
        chain_id: ChainId(chain_id),
        signer: signer.clone(),
        state,
        settled: f.settled,
        reorged: f.reorged,
        failure: f
            .failure_code
            .clone()
            .map(|code| (code, f.failure_reason.clone().unwrap_or_default())),
    }))
}

/// Why a request undone by a deep reorg waits for an approval (`approval.after_deep_reorg`), as
/// its TxPendingApproval audit row says.
pub const DEEP_REORG_APPROVAL_REASON: &str = "its confirmed transaction was undone by a reorg deeper than the required confirmations \
     (another transaction took its nonce); simulated again, it waits for an approval before it is sent again";

impl RequestStage {
    /// PENDING_APPROVAL → FAILED (`APPROVAL_TIMEOUT`) for the signer's transactions that waited
    /// for an approval longer than `approval.timeout` (seed 000 §4.1), in one fenced transaction,
    /// announced by TxFailed. They hold no nonce, so nothing is released and nobody waited on
    /// them. A compare-and-set on the state: one approved or cancelled meanwhile (the command
    /// stage drives the signer under the same lock, so not at once) is left as it is, and only
    /// the failures that landed are announced. The deadline is applied by the recovery scan's
    /// drives, so within one scan interval (5 s) of it; an approval that lands before wins.
    async fn expire_approvals(&self, ctx: &DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let lease = ctx.lease;
        let expired = store::expired_approvals(ctx.pool, lease.key(), self.config.approval_timeout)
            .await
            .map_err(|e| HandlerError::transient("expired approvals", e))?;
        if expired.is_empty() {
            return Ok(Vec::new());
        }
        let rows = store::rows(ctx.pool, lease.key(), &[TxState::PendingApproval])
            .await
            .map_err(|e| HandlerError::classified("list pending approval", e))?;
        let reason = decide::approval_timeout_reason(self.config.approval_timeout);
        let (mut failing, mut failed) = (Vec::new(), Vec::new());
        for row in rows.iter().filter(|r| expired.contains(&r.tx_id)) {
            tracing::warn!(signer = %lease.key().signer, tx_id = %row.tx_id, request_id = %row.request_id, reason, "approval timed out; the transaction fails");
            let (m, f) = fail_row(lease, row, FailureCode::ApprovalTimeout, &reason, None)?;
            failing.push(m);
            failed.push(f);
        }
        let key = self.key(lease);
        let mut tx = lease.begin(ctx.pool).await?;
        let landed = store::fail_unallocated(&mut tx.writer(), &failing).await?;
        tx.commit().await?;
        Ok(self.failures(&key, failed, &landed))
    }

    /// RECEIVED → SIMULATED / PENDING_APPROVAL / FAILED. A request the signer cannot pay for
    /// stays RECEIVED: held alone (its reason on its row, simulated again after a back-off) when
    /// the signer can pay for others, or with the whole signer held when it can pay for none
    /// ([`decide::signer_funds`]). Requests held alone are not simulated before their
    /// `hold_retry_at`. Returns the announcements of what it committed itself (chained requests
    /// failed with their parent) and what it decided, to be written by
    /// [`Self::write_simulation`] in a fenced transaction ([`Self::simulate_and_allocate`]).
    async fn simulate(
        &self,
        ctx: &DriveCtx<'_>,
        snapshot: &store::DriveSnapshot,
    ) -> Result<(Vec<Output>, Option<SimWrites>), HandlerError> {
        let lease = ctx.lease;
        let received = store::received(ctx.pool, lease.key())
            .await
            .map_err(|e| HandlerError::classified("list received", e))?;
        if received.is_empty() {
            return Ok((Vec::new(), None));
        }
        let holds: BTreeMap<Uuid, store::RequestHoldState> = received
            .iter()
            .filter_map(|r| r.hold.map(|h| (r.row.tx_id, h)))
            .collect();
        let chained = received.iter().any(|r| r.chained);
        // Requests a deep reorg undid, simulated and checked against the policy again here
        // before a new nonce (seed 000 §4.4).
        let reevaluated: BTreeSet<Uuid> = received
            .iter()
            .filter(|r| r.reevaluated)
            .map(|r| r.row.tx_id)
            .collect();
        let rows: Vec<TxRow> = received.into_iter().map(|r| r.row).collect();
        // Chained requests whose parent is not CONFIRMED yet wait; those whose parent failed
        // fail (their own transaction, committed here). The rest are simulated.
        let (rows, outputs) = if chained {
            self.dependencies(ctx, rows).await?
        } else {
            (rows, Vec::new())
        };
        let rows: Vec<TxRow> = rows
            .into_iter()
            .filter(|r| !holds.get(&r.tx_id).is_some_and(|h| h.waiting))
            .collect();
        if rows.is_empty() {
            return Ok((outputs, None));
        }
        let from = signer_address(lease)?;
        // The calls run outside any transaction, several at a time.
        let payloads: Vec<Result<TxPayload, String>> = rows.iter().map(parse_payload).collect();
        let mut sims: Vec<Option<decide::SimResult>> = Vec::with_capacity(rows.len());
        for chunk in payloads.chunks(32) {
            let calls = chunk.iter().map(|p| async move {
                let Ok((to, value, data)) =
                    p.as_ref().map_err(Clone::clone).and_then(decide::call_of)
                else {
                    return None;
                };
                Some(self.simulation(from, to, value, data).await)
            });
            sims.extend(futures::future::join_all(calls).await);
        }
        txflow_core::fault::point(txflow_core::fault::AFTER_CALL);
        let decisions: Vec<AfterSimulation> = payloads
            .iter()
            .zip(&sims)
            .zip(&rows)
            .map(|((p, sim), row)| (p, sim, reevaluated.contains(&row.tx_id)))
            .map(|(p, sim, again)| {
                let d = match (p, sim) {
                    (Ok(p), Some(sim)) => decide::after_simulation(&self.config.policy, p, sim),
                    (Ok(p), None) => decide::after_simulation(
                        &self.config.policy,
                        p,
                        &Ok(Simulation::Ok { gas: 0 }),
                    ),
                    (Err(why), _) => AfterSimulation::Fail {
                        code: FailureCode::SimulationFailed,
                        reason: why.clone(),
                    },
                };
                // Undone by a deep reorg: with `approval.after_deep_reorg`, an operator decides
                // whether it is sent again.
                match d {
                    AfterSimulation::Simulated(p)
                        if again && self.config.approval_after_deep_reorg =>
                    {
                        AfterSimulation::AwaitApproval(p)
                    }
                    d => d,
                }
            })
            .collect();
        if let Some(reason) = decisions.iter().find_map(|d| match d {
            AfterSimulation::Retry { reason } => Some(reason.clone()),
            _ => None,
        }) {
            return Err(HandlerError::transient(
                "eth_estimateGas",
                std::io::Error::other(reason),
            ));
        }
        // Some request cannot be paid: can the signer pay for anything (the gas of a plain
        // transfer)? One more call, outside any transaction.
        let probe = if decide::needs_funds_probe(&decisions) {
            let (max_fee, _) = self
                .chain
                .fees()
                .await
                .map_err(|e| HandlerError::classified("fees", e))?;
            let value = decide::funds_probe_value(max_fee);
            let data = Bytes::from_static(&decide::FUNDS_PROBE_DATA);
            Some(self.simulation(from, from, value, data).await)
        } else {
            None
        };
        match decide::signer_funds(&decisions, probe.as_ref()) {
            // A signer that can pay for none of its requests is held: they all wait in RECEIVED
            // (the recovery scan simulates them again), none fails, and the hold is the alert.
            decide::SignerFunds::HoldSigner { reason } => {
                txflow_core::holds::hold(ctx.pool, lease.key(), &reason)
                    .await
                    .map_err(|e| HandlerError::transient("hold", e))?;
                return Ok((outputs, None));
            }
            decide::SignerFunds::Retry { reason } => {
                return Err(HandlerError::transient(
                    "eth_estimateGas (funds probe)",
                    std::io::Error::other(reason),
                ));
            }
            decide::SignerFunds::Enough | decide::SignerFunds::HoldRequests => {}
        }
        // Only this stage, under the signer's lock, holds it: the snapshot tells whether a
        // hold is there to clear.
        if snapshot.held {
            txflow_core::holds::resume(ctx.pool, lease.key())
                .await
                .map_err(|e| HandlerError::transient("resume", e))?;
        }

        let token = lease.token().0;
        let (mut simulated, mut waiting, mut failing, mut failed, mut held) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // The rows as they are once SIMULATED, for allocation.
        let mut as_simulated = Vec::new();
        for (row, d) in rows.iter().zip(&decisions) {
            match d {
                AfterSimulation::Simulated(p) | AfterSimulation::AwaitApproval(p) => {
                    let list = if matches!(d, AfterSimulation::AwaitApproval(_)) {
                        &mut waiting
                    } else {
                        &mut simulated
                    };
                    let mut event = serde_json::json!({
                        "tx_id": row.tx_id.to_string(), "gas_limit": p.gas_limit, "fencing_token": token,
                    });
                    if reevaluated.contains(&row.tx_id) {
                        let waits = matches!(d, AfterSimulation::AwaitApproval(_));
                        tracing::warn!(
                            signer = %lease.key().signer, tx_id = %row.tx_id, request_id = %row.request_id,
                            awaits_approval = waits,
                            "a request undone by a deep reorg was simulated and checked against the policy again"
                        );
                        event["reevaluated_after_deep_reorg"] = serde_json::json!(true);
                        if waits {
                            event["reason"] = serde_json::json!(DEEP_REORG_APPROVAL_REASON);
                        }
                    }
                    let mut row_move = MoveRow::new(row.tx_id, Uuid::new_v4(), event);
                    row_move.payload = Some(json(p)?);
                    if matches!(d, AfterSimulation::Simulated(_)) {
                        as_simulated.push(TxRow {
                            state: TxState::Simulated,
                            payload: json(p)?,
                            ..row.clone()
                        });
                    }
                    list.push(row_move);
                }
                AfterSimulation::Fail { code, reason } => {
                    let (m, f) = fail_row(lease, row, *code, reason, None)?;
                    failing.push(m);
                    failed.push(f);
                }
                AfterSimulation::CannotPay { reason } => {
                    let attempts = holds
                        .get(&row.tx_id)
                        .map_or(0, |h| h.attempts)
                        .saturating_add(1);
                    let reason = truncate_reason(&decide::request_hold_reason(reason));
                    tracing::warn!(
                        signer = %lease.key().signer, tx_id = %row.tx_id, request_id = %row.request_id,
                        attempts, reason, "request held: the signer cannot pay for it now; its other requests go on"
                    );
                    held.push(store::RequestHold {
                        tx_id: row.tx_id,
                        reason,
                        retry_after_ms: decide::HoldBackoff::DEFAULT.after_ms(attempts),
                    });
                }
                AfterSimulation::Retry { .. } => {}
            }
        }
        let writes = SimWrites {
            failing,
            failed,
            waiting,
            simulated,
            held,
            as_simulated,
        };
        Ok((outputs, Some(writes)))
    }

    /// Writes what a simulation decided in `tx`. Returns the announcements of the failures that
    /// landed and the rows that landed SIMULATED, as they now are.
    async fn write_simulation(
        &self,
        tx: &mut FencedTx,
        writes: SimWrites,
    ) -> Result<(Vec<Output>, Vec<TxRow>), HandlerError> {
        let SimWrites {
            failing,
            failed,
            waiting,
            simulated,
            held,
            mut as_simulated,
        } = writes;
        let key = self.key(tx.lease());
        let landed = store::fail_unallocated(&mut tx.writer(), &failing).await?;
        // A request that needs approval waits without a nonce, so it blocks nobody.
        store::await_approval(&mut tx.writer(), &waiting).await?;
        let moved = store::simulated(&mut tx.writer(), &simulated).await?;
        // A request that cannot be paid waits without a nonce too, so it blocks nobody either.
        store::hold_requests(&mut tx.writer(), &held).await?;
        as_simulated.retain(|r| moved.iter().any(|l| l.tx_id == r.tx_id));
        Ok((self.failures(&key, failed, &landed), as_simulated))
    }

    /// Writes a simulation's decisions and allocates. When nothing waited for a nonce before the
    /// drive, what the simulation moved to SIMULATED is all there is to allocate: both are
    /// written in one fenced transaction (one BEGIN, lease check and COMMIT fewer). Otherwise the
    /// simulation commits first and allocation reads the signer's waiting rows (older ones first)
    /// after it, in a transaction of its own. Either way the allocation's calls to the node run
    /// before its transaction opens, and when they fail the simulation is committed alone.
    async fn simulate_and_allocate(
        &self,
        ctx: &DriveCtx<'_>,
        snapshot: &store::DriveSnapshot,
        writes: Option<SimWrites>,
    ) -> Result<Vec<Output>, HandlerError> {
        let mut outputs = Vec::new();
        if let Some(writes) = writes {
            let held = writes.held.len() as u64;
            if snapshot.waiting {
                let mut tx = ctx.lease.begin(ctx.pool).await?;
                let (failures, _) = self.write_simulation(&mut tx, writes).await?;
                tx.commit().await?;
                metrics::get().tx_create(metrics::create_result::HELD, held);
                outputs.extend(failures);
            } else {
                // The allocation's calls to the node, before the transaction opens: the plan is
                // made on the rows as the simulation will leave them.
                let plan = self
                    .plan_allocation(ctx, snapshot, writes.as_simulated.clone())
                    .await;
                let mut tx = ctx.lease.begin(ctx.pool).await?;
                let (failures, landed) = self.write_simulation(&mut tx, writes).await?;
                outputs.extend(failures);
                let plan = match plan {
                    Ok(plan) => plan,
                    Err(e) => {
                        tx.commit().await?;
                        metrics::get().tx_create(metrics::create_result::HELD, held);
                        return Err(e);
                    }
                };
                if let Some(plan) = plan {
                    let landed: Vec<Uuid> = landed.iter().map(|r| r.tx_id).collect();
                    outputs.extend(self.write_allocation(&mut tx, plan, Some(&landed)).await?);
                }
                tx.commit().await?;
                metrics::get().tx_create(metrics::create_result::HELD, held);
                return Ok(outputs);
            }
        }
        // Rows waited before the drive (allocation reads them, with what the simulation just
        // committed), or nothing was simulated.
        if let Some(plan) = self.plan_allocation(ctx, snapshot, Vec::new()).await? {
            let mut tx = ctx.lease.begin(ctx.pool).await?;
            outputs.extend(self.write_allocation(&mut tx, plan, None).await?);
            tx.commit().await?;
        }
        Ok(outputs)
    }

    /// Sorts RECEIVED `rows` by what they depend on (`managed_tx.depends_on_request_id`, a
    /// chained task of seed 000 §6): one read for all of them joins each chained request to its
    /// parents ([`decide::dependency`] decides). A request whose parent failed is FAILED
    /// (DEPENDENCY_FAILED, the reason naming the parent) in one fenced transaction, announced
    /// by the TxFailed outputs returned; one whose parent is not CONFIRMED yet (or not recorded
    /// yet) is left out, holding no nonce — the next drive looks again, at the latest the
    /// recovery scan's, so a child goes on about one scan interval after its parent is
    /// confirmed, and a wait costs one read per scan, no call to the node. Returns the rows to
    /// simulate: those without a dependency and those whose parents are all CONFIRMED.
    async fn dependencies(
        &self,
        ctx: &DriveCtx<'_>,
        rows: Vec<TxRow>,
    ) -> Result<(Vec<TxRow>, Vec<Output>), HandlerError> {
        let lease = ctx.lease;
        // Read after `rows`: every chained request among them is in it (a request is recorded
        // with its dependency in one transaction); one recorded since is not in `rows`.
        let found = store::parents(ctx.pool, lease.key())
            .await
            .map_err(|e| HandlerError::transient("parents", e))?;
        if found.is_empty() {
            return Ok((rows, Vec::new()));
        }
        let mut chained: BTreeMap<Uuid, (String, Vec<decide::Parent>)> = BTreeMap::new();
        let mut unreadable = BTreeSet::new();
        for f in found {
            let entry = chained
                .entry(f.child)
                .or_insert_with(|| (f.parent_request_id.clone(), Vec::new()));
            match parent_of(&f) {
                Ok(Some(p)) => entry.1.push(p),
                Ok(None) => {}
                // A parent row this binary cannot read: the child waits (it never goes on or
                // fails on a guess), reported on every drive.
                Err(why) => {
                    tracing::error!(signer = %lease.key().signer, tx_id = %f.child, why, "a chained request's parent cannot be read; it waits");
                    unreadable.insert(f.child);
                }
            }
        }
        let (mut go, mut failing, mut failed) = (Vec::new(), Vec::new(), Vec::new());
        for row in rows {
            let Some((parent, parents)) = chained.get(&row.tx_id) else {
                go.push(row);
                continue;
            };
            if unreadable.contains(&row.tx_id) {
                continue;
            }
            match decide::dependency(parent, parents) {
                decide::Dependency::Met => {
                    tracing::info!(signer = %lease.key().signer, tx_id = %row.tx_id, request_id = %row.request_id, parent, "chained request goes on: its parent is confirmed");
                    go.push(row);
                }
                decide::Dependency::Wait { why } => {
                    tracing::debug!(signer = %lease.key().signer, tx_id = %row.tx_id, request_id = %row.request_id, why, "chained request waits");
                }
                decide::Dependency::Failed { reason } => {
                    tracing::warn!(signer = %lease.key().signer, tx_id = %row.tx_id, request_id = %row.request_id, reason, "chained request failed with its parent");
                    let (m, f) =
                        fail_row(lease, &row, FailureCode::DependencyFailed, &reason, None)?;
                    failing.push(m);
                    failed.push(f);
                }
            }
        }
        if failing.is_empty() {
            return Ok((go, Vec::new()));
        }
        let key = self.key(lease);
        let mut tx = lease.begin(ctx.pool).await?;
        let landed = store::fail_unallocated(&mut tx.writer(), &failing).await?;
        tx.commit().await?;
        Ok((go, self.failures(&key, failed, &landed)))
    }

    /// One `eth_estimateGas`, as the allocator's decisions see it.
    async fn simulation(
        &self,
        from: Address,
        to: Address,
        value: U256,
        data: Bytes,
    ) -> decide::SimResult {
        self.chain
            .simulate(from, to, value, data)
            .await
            .map_err(|e| SimError {
                transient: e.is_transient(),
                message: e.to_string(),
            })
    }

    /// SIMULATED / REPLACED → ALLOCATED, the part before the transaction: which rows, within
    /// the budget, with what payloads, and the node's calls ([`Self::write_allocation`] takes
    /// nonces from the fenced cursor for them, in request order). A SIMULATED transaction that
    /// cannot be allocated as recorded (its payload does not parse, or its numbers cannot be
    /// represented) fails alone with the reason, before any nonce is taken for it; the signer's
    /// others are allocated. `None`: nothing to allocate now.
    ///
    /// Within the in-flight budget (`nonce.max_in_flight`, [`decide::within_budget`]): the
    /// signer's nonces in flight are counted first (the drive's snapshot), and only the room left is
    /// allocated. The others stay SIMULATED / REPLACED without a nonce (nothing fails, nothing
    /// is dead-lettered) and are allocated by a later drive as mining frees the budget: after
    /// the next batch of the signer's requests, the runtime's drive of ready signers (about a
    /// second after room appears, [`store::ready_signers`]) or at the latest the recovery scan's
    /// (the signer stays among the pending ones while it has requests waiting). At the budget
    /// by PostgreSQL's states, the chain's latest nonce is asked once, and only the nonces at or
    /// above it count (a receipt not yet recorded must not stall allocation); a signer still at
    /// the budget then costs a drive its snapshot, two reads and that one call.
    ///
    /// The rows come from the drive's snapshot and simulation when nothing waited for a nonce
    /// before the drive: `simulated` (those its simulation moves to SIMULATED, as they will be)
    /// are then the oldest waiting, and are not read again.
    async fn plan_allocation(
        &self,
        ctx: &DriveCtx<'_>,
        snapshot: &store::DriveSnapshot,
        simulated: Vec<TxRow>,
    ) -> Result<Option<AllocationPlan>, HandlerError> {
        let lease = ctx.lease;
        // Nothing waited when the drive began, and its simulation moved nothing on: no read, no
        // call.
        if !snapshot.waiting && simulated.is_empty() {
            return Ok(None);
        }
        let mut in_flight = snapshot.in_flight;
        let max_in_flight = self.config.max_in_flight;
        let mut room = decide::within_budget(usize::MAX, in_flight, max_in_flight);
        if room == 0 {
            // Full by PostgreSQL's states; the budget is of nonces the chain has not used, and a
            // transaction mined whose receipt is not recorded yet (the receipt checker behind or
            // down) still counts there. Ask the chain before waiting: one call, only at the budget.
            let latest = self
                .chain
                .latest_nonce(signer_address(lease)?)
                .await
                .map_err(|e| HandlerError::classified("latest nonce", e))?;
            let latest = decide::chain_nonce(latest)
                .map_err(|e| HandlerError::fail("NONCE_OUT_OF_RANGE", e.to_string()))?;
            in_flight = store::in_flight_from(ctx.pool, lease.key(), latest)
                .await
                .map_err(|e| HandlerError::transient("in flight", e))?;
            room = decide::within_budget(usize::MAX, in_flight, max_in_flight);
        }
        // At the budget one row is still read: whether anything waits, for the report.
        let limit = i64::try_from(room.max(1)).unwrap_or(decide::MAX_ALLOCATIONS_PER_DRIVE);
        let rows = if snapshot.waiting {
            store::rows_limited(
                ctx.pool,
                lease.key(),
                &[TxState::Simulated, TxState::Replaced],
                limit,
            )
            .await
            .map_err(|e| HandlerError::classified("list allocatable", e))?
        } else {
            // Nothing waited before: the oldest waiting now are those this drive simulated, in
            // request order. One made SIMULATED or REPLACED meanwhile by another (an approval,
            // a reorg) is allocated by the next drive, the recovery scan's at the latest.
            let mut rows = simulated;
            rows.truncate(room.max(1));
            rows
        };
        if rows.is_empty() {
            return Ok(None);
        }
        if room == 0 {
            // Once per scan interval at INFO (the recovery scan's drives), not on every batch.
            if ctx.recovery {
                tracing::info!(signer = %lease.key().signer, in_flight, max_in_flight, "requests wait: the signer's in-flight budget is full");
            } else {
                tracing::debug!(signer = %lease.key().signer, in_flight, max_in_flight, "requests wait: the signer's in-flight budget is full");
            }
            return Ok(None);
        }
        // A REPLACED row read here that the snapshot did not see counts too.
        let replaced = snapshot.replaced || rows.iter().any(|r| r.state == TxState::Replaced);
        // External calls first, outside the transaction.
        let chain_nonce = if decide::needs_chain_nonce(snapshot.cursor_fresh, replaced) {
            // As the last final block has it: never past a nonce a reorg may still give back.
            let head = self
                .chain
                .block_number()
                .await
                .map_err(|e| HandlerError::classified("head", e))?;
            let at = decide::alignment_block(head, self.config.confirmations_required);
            let n = self
                .chain
                .nonce_at(signer_address(lease)?, at)
                .await
                .map_err(|e| HandlerError::classified("final nonce", e))?;
            Some(
                decide::chain_nonce(n)
                    .map_err(|e| HandlerError::fail("NONCE_OUT_OF_RANGE", e.to_string()))?,
            )
        } else {
            None
        };
        let parsed: Vec<Result<TxPayload, String>> = rows.iter().map(parse_payload).collect();
        let open: Vec<TxPayload> = parsed
            .iter()
            .filter_map(|p| p.as_ref().ok().cloned())
            .collect();
        let fees = if decide::needs_fees(&open) {
            Some(
                self.chain
                    .fees()
                    .await
                    .map_err(|e| HandlerError::classified("fees", e))?,
            )
        } else {
            None
        };
        let signer = &lease.key().signer;
        // What each row would be allocated as; checked before any nonce is taken.
        let (mut ready, mut failing, mut failed) = (Vec::new(), Vec::new(), Vec::new());
        for (row, p) in rows.into_iter().zip(parsed) {
            let checked = p.and_then(|p| {
                let p = decide::with_fees(p, fees);
                decide::allocatable(&p)
                    .map(|_| p)
                    .map_err(|e| e.to_string())
            });
            match (checked, row.state) {
                (Ok(p), _) => ready.push((row, p)),
                (Err(why), TxState::Simulated) => {
                    let reason = format!("cannot be allocated: {why}");
                    tracing::error!(signer = %signer, tx_id = %row.tx_id, reason, "transaction failed alone");
                    let (m, f) =
                        fail_row(lease, &row, FailureCode::SimulationFailed, &reason, None)?;
                    failing.push(m);
                    failed.push(f);
                }
                // A REPLACED transaction cannot move to FAILED (the transition table has no such
                // move): it stays, reported, and blocks nobody (the others are allocated).
                (Err(why), _) => {
                    tracing::error!(signer = %signer, tx_id = %row.tx_id, why, "replaced transaction cannot be re-allocated as recorded");
                }
            }
        }

        Ok(Some(AllocationPlan {
            in_flight,
            chain_nonce,
            ready,
            failing,
            failed,
        }))
    }

    /// Writes an allocation in `tx`: the rows that cannot be allocated failed, then nonces from
    /// the fenced cursor for the ready ones within the budget (only those among `landed`, when
    /// given: the rows this transaction moved to SIMULATED). Returns the announcements.
    async fn write_allocation(
        &self,
        tx: &mut FencedTx,
        plan: AllocationPlan,
        landed: Option<&[Uuid]>,
    ) -> Result<Vec<Output>, HandlerError> {
        let AllocationPlan {
            in_flight,
            chain_nonce,
            mut ready,
            failing,
            failed,
        } = plan;
        let lease = tx.lease().clone();
        let key = self.key(&lease);
        let signer = &lease.key().signer;
        let chain_id = lease.key().chain_id.0;
        let token = lease.token().0;
        let landed_failures = store::fail_unallocated(&mut tx.writer(), &failing).await?;
        let mut outputs = self.failures(&key, failed, &landed_failures);
        if let Some(landed) = landed {
            ready.retain(|(row, _)| landed.contains(&row.tx_id));
        }
        // `rows` were read up to the room left; the budget is checked again on what is ready.
        ready.truncate(decide::within_budget(
            ready.len(),
            in_flight,
            self.config.max_in_flight,
        ));
        if ready.is_empty() {
            return Ok(outputs);
        }
        if let Some(n) = chain_nonce {
            tx.align_cursor(n).await?;
        }
        let count = decide::allocation_count(ready.len())
            .map_err(|e| HandlerError::fail("OUT_OF_RANGE", e.to_string()))?;
        let nonces = tx.allocate_nonces(count).await?;
        let mut moves = Vec::with_capacity(ready.len());
        for ((row, p), nonce) in ready.into_iter().zip(nonces) {
            let allocated: TxAllocated = decide::allocated_event(
                new_event_id(),
                row.tx_id.to_string(),
                row.request_id.clone(),
                chain_id,
                signer,
                nonce,
                &p,
                token,
            )
            .map_err(|why| HandlerError::fail("CORRUPT_ROW", why.to_string()))?;
            let mut m = MoveRow::new(row.tx_id, event_uuid(&allocated)?, json(&allocated)?);
            m.nonce = Some(nonce);
            m.payload = Some(json(&p)?);
            moves.push(m);
            outputs.push(Output::new(
                self.config.topics.tx_allocated(),
                Subjects::TopicName,
                key.clone(),
                allocated,
            ));
        }
        store::allocate(&mut tx.writer(), &moves).await?;
        txflow_core::fault::point(txflow_core::fault::ALLOCATOR_BEFORE_COMMIT);
        Ok(outputs)
    }

    /// Released nonces that no waiting request took (allocation runs first and takes them) are
    /// filled with a 0-value self-transfer each, so that the signer's later nonces are not stuck
    /// behind a gap.
    async fn fill_released(&self, ctx: &DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let lease = ctx.lease;
        let released = store::released_nonces(ctx.pool, lease.key())
            .await
            .map_err(|e| HandlerError::transient("released nonces", e))?;
        if decide::noops_to_fill(released) == 0 {
            return Ok(Vec::new());
        }
        let fees = self
            .chain
            .fees()
            .await
            .map_err(|e| HandlerError::classified("fees", e))?;
        let signer = &lease.key().signer;
        let key = self.key(lease);
        let mut tx = lease.begin(ctx.pool).await?;
        let nonces = tx.allocate_nonces(decide::noops_to_fill(released)).await?;
        let mut rows = Vec::with_capacity(nonces.len());
        let mut outputs = Vec::with_capacity(nonces.len());
        for nonce in nonces {
            let tx_id = Uuid::now_v7();
            let request_id = format!("noop-{nonce}-{}", &tx_id.simple().to_string()[20..]);
            let payload = decide::noop_payload(signer, fees);
            let allocated = decide::allocated_event(
                new_event_id(),
                tx_id.to_string(),
                request_id.clone(),
                lease.key().chain_id.0,
                signer,
                nonce,
                &payload,
                lease.token().0,
            )
            .map_err(|why| HandlerError::fail("CORRUPT_ROW", why.to_string()))?;
            rows.push(NewTx {
                tx_id,
                request_id,
                kind: Kind::Noop,
                nonce: Some(nonce),
                payload: json(&payload)?,
                audit: audit(state::ALLOCATE.event, &allocated)?,
            });
            tracing::info!(signer = %signer, nonce, tx_id = %tx_id, "released nonce filled with a no-op");
            outputs.push(Output::new(
                self.config.topics.tx_allocated(),
                Subjects::TopicName,
                key.clone(),
                allocated,
            ));
        }
        store::fill_noops(&mut tx.writer(), &rows).await?;
        tx.commit().await?;
        Ok(outputs)
    }
}

/// Operator commands on `tx.commands`: APPROVE moves a PENDING_APPROVAL transaction on to
/// allocation (the approver recorded); CANCEL fails a transaction that is not signed yet,
/// releasing its nonce if it had one. Both act only on a transaction of the signer (and chain)
/// the command is keyed by, under that signer's lease: a command naming another signer's
/// transaction is dead-lettered `TX_NOT_OF_SIGNER`, one naming no transaction `UNKNOWN_TX`, and
/// the other transaction is not touched. A command for a transaction of the signer in another
/// state changes nothing (a redelivery is not a dead letter). BUMP is the signer gateway's and
/// is ignored here.
pub struct CommandStage {
    pub requests: Arc<RequestStage>,
}

impl Handler for CommandStage {
    type Input = TxCommand;

    fn role(&self) -> Role {
        Role::Allocator
    }

    fn input_topic(&self) -> String {
        self.requests.config.topics.tx_commands()
    }

    fn route(&self, c: &TxCommand) -> Result<(ChainId, Signer), Rejection> {
        if Uuid::parse_str(&c.tx_id).is_err() {
            return Err(Rejection::new(
                "INVALID_TX_ID",
                format!("{:?} is not a transaction id", c.tx_id),
            ));
        }
        let s = Signer::parse(&c.signer)
            .map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))?;
        Ok((ChainId(c.chain_id), s))
    }

    async fn handle(&self, w: &mut Fenced<'_>, c: &TxCommand) -> Result<Vec<Output>, HandlerError> {
        let tx_id = Uuid::parse_str(&c.tx_id).map_err(|_| {
            HandlerError::Reject(Rejection::new("INVALID_TX_ID", "not a transaction id"))
        })?;
        let lease = w.lease().clone();
        // The signer's own transaction, locked under its lease; otherwise only where it is.
        let row = store::command_target(w, tx_id)
            .await
            .map_err(|e| HandlerError::classified("command target", e))?;
        let target = match &row {
            Some(r) => CommandTarget::Own(r.state),
            None => match store::owner_of(w, tx_id).await? {
                Some((chain_id, signer)) => CommandTarget::Foreign {
                    chain_id: ChainId(chain_id),
                    signer,
                },
                None => CommandTarget::Unknown,
            },
        };
        if c.command == TxCommandKind::Approve && matches!(target, CommandTarget::Own(_)) {
            let by = store::submitted_by(w, tx_id).await?;
            if let Some(rejection) = decide::four_eyes(c, by.as_deref()) {
                return Err(HandlerError::Reject(rejection));
            }
        }
        let decision = decide::decide_command(c, &target);
        let row = match (decision.clone(), row) {
            // Dead-lettered with its code (the runtime reports it).
            (CommandDecision::Reject(rejection), _) => {
                return Err(HandlerError::Reject(rejection));
            }
            (CommandDecision::Ignore(why), _) => {
                if c.command != TxCommandKind::Bump {
                    tracing::info!(tx_id = %tx_id, command = ?c.command, why, "command changes nothing");
                }
                return Ok(Vec::new());
            }
            (_, Some(row)) => row,
            // A move is decided only for a transaction of the signer (`Own`), which is `row`.
            (_, None) => return Ok(Vec::new()),
        };
        let key = signer_key(c.chain_id, lease.key().signer.as_str());
        match decision {
            CommandDecision::Approve => {
                let event = serde_json::json!({
                    "tx_id": tx_id.to_string(), "approved_by": c.requested_by,
                    "command_event_id": c.event_id, "fencing_token": lease.token().0,
                });
                let mut m = MoveRow::new(tx_id, Uuid::new_v4(), event);
                m.approved_by = Some(c.requested_by.clone());
                let done = store::approve(w, &[m]).await?;
                tracing::info!(tx_id = %tx_id, by = %c.requested_by, applied = !done.is_empty(), "approve");
                Ok(Vec::new())
            }
            CommandDecision::CancelUnallocated => {
                let reason = decide::cancel_reason(&c.requested_by, c.reason.as_deref());
                let (m, f) = fail_row(&lease, &row, FailureCode::Cancelled, &reason, None)?;
                let landed = store::fail_unallocated(w, &[m]).await?;
                Ok(self.requests.failures(&key, vec![f], &landed))
            }
            CommandDecision::CancelAllocated => {
                let Some(nonce) = row.nonce else {
                    return Ok(Vec::new());
                };
                let reason = decide::cancel_reason(&c.requested_by, c.reason.as_deref());
                let (mut m, f) =
                    fail_row(&lease, &row, FailureCode::Cancelled, &reason, Some(nonce))?;
                m.expect_nonce = Some(nonce);
                let landed = store::cancel_allocated(w, &[m]).await?;
                tracing::info!(tx_id = %tx_id, nonce, by = %c.requested_by, "cancelled after allocation; nonce released");
                Ok(self.requests.failures(&key, vec![f], &landed))
            }
            CommandDecision::Ignore(_) | CommandDecision::Reject(_) => Ok(Vec::new()),
        }
    }

    async fn pending_signers(&self, _pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        Ok(Vec::new())
    }

    /// Allocates what an approval released.
    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        self.requests.drive(ctx).await
    }
}
