//! The coordinator's [`Handler`] (seed 004 §9.2 on the stage runtime): route a
//! `TransferRequested` to its user's lease, persist INIT → SOURCE_PENDING in the batch's fenced
//! transaction, then — in `drive`, outside any transaction — call the adapters and record each
//! answer with a fenced CAS, persisting every state before the call it leads to.
//!
//! One lease per user ([`lease_subject`]): two coordinator instances never drive one user's
//! transfers at once, and a write under a lost lease is refused (`Fenced`). The recovery worker
//! of §6 is the runtime's recovery scan: [`Handler::pending_signers`] names the users with an
//! open transfer that has not moved for `transfer.stale_ms`, and `drive` resumes each of their
//! open transfers from the state it is in ([`crate::decide::step`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sqlx::PgPool;
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{SpotOp, TransferRequested, TransferUpdated};
use txflow_core::fault;
use txflow_core::fenced::Fenced;
use txflow_core::role::Role;
use txflow_core::stage::handler::db;
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output, Rejection};
use txflow_core::transfer::{
    AdapterResponse, Next, Stay, TransferState, Transition, check_accounts, check_id, decide,
    lease_subject, parse_amount, transfer_event_id,
};
use uuid::Uuid;

use crate::config::CoordinatorConfig;
use crate::decide::{LegOp, Step, step};
use crate::funding::{FundingAdapter, FundingCall, funding_response};
use crate::spot::{SpotAdapter, SpotCall};
use crate::store::{self, Cas, TransferRow};

/// How many users one recovery scan resumes at most (the longest-waiting first).
const SCAN_LIMIT: i64 = 1_000;

/// The transfer coordinator stage.
pub struct CoordinatorStage {
    config: CoordinatorConfig,
    pool: PgPool,
    funding: FundingAdapter,
    spot: Arc<SpotAdapter>,
    /// The user behind each lease subject this instance has seen (a subject is a hash of the
    /// user id, see [`lease_subject`]).
    users: Mutex<HashMap<Signer, String>>,
}

impl CoordinatorStage {
    pub fn new(
        config: CoordinatorConfig,
        pool: PgPool,
        spot: Arc<SpotAdapter>,
    ) -> CoordinatorStage {
        CoordinatorStage {
            config,
            funding: FundingAdapter::new(pool.clone()),
            pool,
            spot,
            users: Mutex::new(HashMap::new()),
        }
    }

    /// The SPOT adapter (shared with the conservation check).
    pub fn spot(&self) -> Arc<SpotAdapter> {
        self.spot.clone()
    }

    fn subject(&self, user_id: &str) -> Signer {
        let subject = lease_subject(user_id);
        if let Ok(mut users) = self.users.lock() {
            users
                .entry(subject.clone())
                .or_insert_with(|| user_id.to_string());
        }
        subject
    }

    fn user_of(&self, subject: &Signer) -> Option<String> {
        self.users.lock().ok()?.get(subject).cloned()
    }

    /// The TransferUpdated of `row` entering `state`.
    fn event(&self, row: &TransferRow, state: TransferState, token: i64) -> TransferUpdated {
        let (from, to) = match row.direction() {
            Ok(d) => (d.source().as_str(), d.target().as_str()),
            Err(_) => ("?", "?"),
        };
        TransferUpdated {
            event_id: transfer_event_id(&row.req_id, state),
            req_id: row.req_id.clone(),
            user_id: row.user_id.clone(),
            asset: row.asset.clone(),
            amount: row.amount().to_string(),
            from_account: from.to_string(),
            to_account: to.to_string(),
            state: state.as_str().to_string(),
            state_id: i32::from(state.id()),
            error_code: row.error_code.clone(),
            fencing_token: token,
            updated_at_ms: chrono_ms(),
        }
    }

    /// The output of an event on `transfer.events`, keyed by its user.
    fn output(&self, event: TransferUpdated) -> Output {
        Output::new(
            self.config.topics.transfer_events(),
            Subjects::TopicName,
            event.user_id.clone(),
            event,
        )
    }

    fn updated(&self, row: &TransferRow, state: TransferState, token: i64) -> Output {
        self.output(self.event(row, state, token))
    }

    /// Calls the adapter of `account` for `op` (each idempotent by `req_id`). `fresh`: this
    /// drive moved the transfer into the step's state and made no call since, so the command
    /// was never sent; otherwise it may have been (a retry, a resumed leg).
    async fn call(&self, row: &TransferRow, step: Step, fresh: bool) -> AdapterResponse {
        let Step::Call { account, op } = step else {
            return AdapterResponse::Unknown;
        };
        let amount = row.amount();
        match account {
            txflow_core::transfer::AccountType::Funding => {
                let call = FundingCall {
                    req_id: &row.req_id,
                    user_id: &row.user_id,
                    asset: &row.asset,
                    amount,
                };
                // The source's rules are checked after its key's outcome is asked (the adapter
                // claims first); a target of a transfer under way is not re-checked against them.
                let result = match op {
                    LegOp::Withdraw => self.funding.withdraw(&call).await,
                    LegOp::Deposit => self.funding.deposit_onward(&call).await,
                    LegOp::Refund => self.funding.refund(&call).await,
                };
                if let Err(e) = &result {
                    tracing::warn!(req_id = %row.req_id, ?op, error = %e, "FUNDING call failed: outcome unknown, retried");
                }
                funding_response(&result)
            }
            txflow_core::transfer::AccountType::Spot => {
                // An asset listed since the rules were last read is looked up before the call
                // (the adapter would refuse it as INVALID_ASSET, and a target's refusal is
                // compensated).
                if !self.spot.knows(&row.asset) {
                    match crate::funding::load_assets(&self.pool).await {
                        Ok(assets) => self.spot.set_assets(assets),
                        Err(e) => {
                            tracing::warn!(req_id = %row.req_id, error = %e, "asset rules not re-read");
                            return AdapterResponse::NetworkError;
                        }
                    }
                }
                let call = SpotCall {
                    req_id: &row.req_id,
                    user_id: &row.user_id,
                    asset: &row.asset,
                    amount,
                };
                // Asset rules apply only to the source's command never sent (the transfer's
                // admission). A source that may have been sent is the same command again, whose
                // outcome the ledger knows; a target of a transfer under way is not re-checked.
                let answer = match (op, fresh) {
                    (LegOp::Withdraw, true) => self.spot.debit(&call).await,
                    (LegOp::Withdraw, false) => {
                        self.spot.shape_checked(&call, SpotOp::Debit, false).await
                    }
                    (LegOp::Deposit, _) => {
                        self.spot.shape_checked(&call, SpotOp::Credit, false).await
                    }
                    (LegOp::Refund, _) => self.spot.credit(&call, true).await,
                };
                answer.response
            }
            // Validation refuses every other account type before a row exists.
            other => {
                tracing::error!(req_id = %row.req_id, account = other.as_str(), "no adapter for this account type");
                AdapterResponse::Unknown
            }
        }
    }

    /// Drives one transfer from its state as far as it goes now: to a terminal state, or to a
    /// step that stays (an unknown outcome, a refused refund), or — halted — before INIT moves.
    async fn drive_transfer(
        &self,
        ctx: &DriveCtx<'_>,
        mut row: TransferRow,
        halted: bool,
        out: &mut Vec<Output>,
    ) -> Result<(), HandlerError> {
        let direction = row
            .direction()
            .map_err(|e| HandlerError::fail("CORRUPT_TRANSFER", e.to_string()))?;
        let token = ctx.lease.token().0;
        // Whether this drive's own CAS put the row in its state, with no call made since.
        let mut fresh = false;
        loop {
            let state = row
                .state()
                .map_err(|e| HandlerError::fail("CORRUPT_TRANSFER", e.to_string()))?;
            match step(state, direction) {
                Step::Done => return Ok(()),
                Step::Cas(t) => {
                    if t == Transition::START_SOURCE && halted {
                        tracing::warn!(req_id = %row.req_id, "transfers halted (conservation violation): not started");
                        return Ok(());
                    }
                    if t == Transition::START_SOURCE {
                        fault::point(fault::TRANSFER_BEFORE_START);
                    }
                    let event = self.event(&row, t.to(), token);
                    match self.cas(ctx, &row, t, None, &event).await? {
                        Cas::Moved => {
                            out.push(self.output(event));
                            txflow_core::metrics::get()
                                .transfer_transition(t.from().as_str(), t.to().as_str());
                            row.state = t.to().id();
                            fresh = true;
                        }
                        Cas::Skipped(now) => {
                            tracing::info!(req_id = %row.req_id, expected = %t.from(), now = %now, "transfer moved by another worker: skipped");
                            return Ok(());
                        }
                    }
                }
                call @ Step::Call { op, .. } => {
                    // The state is persisted (by this drive's CAS or by the batch's), the call
                    // not made yet: CRA-002 (SOURCE_PENDING) and CRA-005 (TARGET_PENDING).
                    match op {
                        LegOp::Withdraw => fault::point(fault::TRANSFER_AFTER_START),
                        LegOp::Deposit => fault::point(fault::TRANSFER_AFTER_TARGET_START),
                        LegOp::Refund => {}
                    }
                    // After the call the drive moves the row (a fresh state) or returns.
                    let response = self.call(&row, call, fresh).await;
                    fault::point(match op {
                        LegOp::Withdraw => fault::TRANSFER_AFTER_SOURCE_CALL,
                        LegOp::Deposit => fault::TRANSFER_AFTER_TARGET_CALL,
                        LegOp::Refund => fault::TRANSFER_AFTER_REFUND_CALL,
                    });
                    match decide(state, response) {
                        Next::Move(t) => {
                            let error = match response {
                                AdapterResponse::ExplicitFail(code) => Some(code),
                                _ => None,
                            };
                            let message = error.map(|c| format!("{op:?} refused: {}", c.as_str()));
                            let error = error.map(|c| c.as_str());
                            let detail = match (&error, &message) {
                                (Some(c), Some(m)) => Some((*c, m.as_str())),
                                _ => None,
                            };
                            let mut moved_row = row.clone();
                            if let Some(code) = error {
                                moved_row.error_code = Some(code.to_string());
                            }
                            let event = self.event(&moved_row, t.to(), token);
                            match self.cas(ctx, &row, t, detail, &event).await? {
                                Cas::Moved => {
                                    row = moved_row;
                                    out.push(self.output(event));
                                    txflow_core::metrics::get()
                                        .transfer_transition(t.from().as_str(), t.to().as_str());
                                    tracing::info!(req_id = %row.req_id, user_id = %row.user_id, from = %t.from(), to = %t.to(), fencing_token = token, "transfer moved");
                                    if t.to() == TransferState::SourceDone {
                                        fault::point(fault::TRANSFER_AFTER_SOURCE_DONE);
                                    }
                                    row.state = t.to().id();
                                    fresh = true;
                                }
                                Cas::Skipped(now) => {
                                    tracing::info!(req_id = %row.req_id, expected = %t.from(), now = %now, "transfer moved by another worker: skipped");
                                    return Ok(());
                                }
                            }
                        }
                        Next::Stay(why) => {
                            let (code, message) = match why {
                                Stay::OutcomeUnknown => (
                                    "OUTCOME_UNKNOWN".to_string(),
                                    format!("{op:?}: {response:?}; retried (never compensated)"),
                                ),
                                Stay::RefundRefused(c) => (
                                    c.as_str().to_string(),
                                    format!("refund refused: {}; retried", c.as_str()),
                                ),
                            };
                            self.stayed(ctx, &row, state, &code, &message).await?;
                            match (state, why) {
                                (TransferState::TargetPending, _) => tracing::error!(
                                    req_id = %row.req_id, user_id = %row.user_id, response = ?response,
                                    retry = row.retry_count + 1,
                                    "CRITICAL: target outcome unknown, funds in flight: retrying forever, never compensating"
                                ),
                                (TransferState::Compensating, _) => tracing::error!(
                                    req_id = %row.req_id, user_id = %row.user_id, response = ?response,
                                    retry = row.retry_count + 1,
                                    "CRITICAL: refund failed, funds in flight: retrying"
                                ),
                                _ => tracing::warn!(
                                    req_id = %row.req_id, user_id = %row.user_id, response = ?response,
                                    "source outcome unknown: retrying"
                                ),
                            }
                            return Ok(());
                        }
                        Next::NotAwaiting => return Ok(()),
                    }
                }
            }
        }
    }

    async fn cas(
        &self,
        ctx: &DriveCtx<'_>,
        row: &TransferRow,
        t: Transition,
        error: Option<(&str, &str)>,
        event: &TransferUpdated,
    ) -> Result<Cas, HandlerError> {
        let announcement = announcement(event)?;
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let done = store::cas(&mut tx.writer(), &row.req_id, t, error, &announcement).await?;
        tx.commit().await?;
        Ok(done)
    }

    async fn stayed(
        &self,
        ctx: &DriveCtx<'_>,
        row: &TransferRow,
        state: TransferState,
        code: &str,
        message: &str,
    ) -> Result<(), HandlerError> {
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        store::stayed(&mut tx.writer(), &row.req_id, state, code, message).await?;
        tx.commit().await?;
        Ok(())
    }
}

/// An event as the outbox records it.
fn announcement(event: &TransferUpdated) -> Result<store::Announcement, HandlerError> {
    let event_id = Uuid::parse_str(&event.event_id)
        .map_err(|e| HandlerError::fail("CORRUPT_EVENT_ID", format!("{}: {e}", event.event_id)))?;
    let payload = serde_json::to_value(event)
        .map_err(|e| HandlerError::fail("UNSERIALISABLE_EVENT", e.to_string()))?;
    Ok(store::Announcement { event_id, payload })
}

fn chrono_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The coordinator's own re-validation of a request (defence in depth, layer 2 of §9.2): what
/// the gateway checked is checked again, and the event must match the row it names.
fn check_request(input: &TransferRequested) -> Result<(), Rejection> {
    let refuse = |r: txflow_core::transfer::Rejected| Rejection::new(r.code.as_str(), r.detail);
    check_id("req_id", &input.req_id).map_err(refuse)?;
    check_id("user_id", &input.user_id).map_err(refuse)?;
    check_accounts(&input.from_account, &input.to_account).map_err(refuse)?;
    parse_amount(&input.amount).map_err(refuse)?;
    Ok(())
}

fn matches_row(input: &TransferRequested, row: &TransferRow) -> bool {
    let Ok(direction) = row.direction() else {
        return false;
    };
    let amount_matches = match (parse_amount(&input.amount), parse_amount(row.amount())) {
        (Ok(a), Ok(b)) => a.value() == b.value(),
        _ => false,
    };
    row.user_id == input.user_id
        && row.asset == input.asset
        && amount_matches
        && direction.source().as_str() == input.from_account
        && direction.target().as_str() == input.to_account
}

impl Handler for CoordinatorStage {
    type Input = TransferRequested;

    fn role(&self) -> Role {
        Role::TransferCoordinator
    }

    fn input_topic(&self) -> String {
        self.config.topics.transfer_requests()
    }

    fn route(&self, input: &TransferRequested) -> Result<(ChainId, Signer), Rejection> {
        check_request(input)?;
        Ok((ChainId(0), self.subject(&input.user_id)))
    }

    fn partition_key(&self, chain_id: ChainId, signer: &Signer) -> String {
        match self.user_of(signer) {
            Some(user) => user,
            None => txflow_core::kafka::signer_key(chain_id.0, signer.as_str()),
        }
    }

    async fn handle(
        &self,
        w: &mut Fenced<'_>,
        input: &TransferRequested,
    ) -> Result<Vec<Output>, HandlerError> {
        let Some(row) = store::load(w, &input.req_id).await? else {
            return Err(HandlerError::Reject(Rejection::new(
                "NOT_FOUND",
                format!(
                    "no transfer {} is recorded: the gateway records a transfer before it announces it",
                    input.req_id
                ),
            )));
        };
        if !matches_row(input, &row) {
            return Err(HandlerError::Reject(Rejection::new(
                "MISMATCH",
                format!(
                    "TransferRequested {} differs from its recorded transfer",
                    input.req_id
                ),
            )));
        }
        let state = row
            .state()
            .map_err(|e| HandlerError::fail("CORRUPT_TRANSFER", e.to_string()))?;
        let token = w.lease().token().0;
        match state {
            TransferState::Init => {
                if store::halted(&self.pool)
                    .await
                    .map_err(db("transfer halt check"))?
                {
                    tracing::warn!(req_id = %row.req_id, "transfers halted (conservation violation): left in INIT");
                    return Ok(Vec::new());
                }
                fault::point(fault::TRANSFER_BEFORE_START);
                let event = self.event(&row, TransferState::SourcePending, token);
                let announcement = announcement(&event)?;
                match store::cas(
                    w,
                    &row.req_id,
                    Transition::START_SOURCE,
                    None,
                    &announcement,
                )
                .await
                {
                    Ok(Cas::Moved) => Ok(vec![self.output(event)]),
                    Ok(Cas::Skipped(_)) => Ok(Vec::new()),
                    Err(e) => Err(e.into()),
                }
            }
            // Seen before (a redelivery): the same announcement again, same event_id.
            TransferState::SourcePending => Ok(vec![self.updated(&row, state, token)]),
            _ => Ok(Vec::new()),
        }
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        let mut users = store::stale_users(pool, self.config.stale, SCAN_LIMIT).await?;
        // Users with an event the outbox still holds: their drive relays it.
        for u in store::users_with_unpublished(pool, SCAN_LIMIT).await? {
            if !users.contains(&u) {
                users.push(u);
            }
        }
        Ok(users
            .iter()
            .map(|u| (ChainId(0), self.subject(u)))
            .collect())
    }

    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let Some(user) = self.user_of(&ctx.lease.key().signer) else {
            return Ok(Vec::new());
        };
        // What the outbox still holds after its grace: a crash between a CAS and its produce, a
        // produce that failed, outputs dropped with a lost lease. Same events, same ids.
        let mut out = Vec::new();
        for event in store::unpublished_of_user(ctx.pool, &user)
            .await
            .map_err(db("unpublished transfer events"))?
        {
            match event {
                Ok(event) => out.push(self.output(event)),
                Err(event_id) => {
                    tracing::error!(%event_id, %user, "transfer_outbox row does not decode as a TransferUpdated: left unpublished");
                }
            }
        }
        let rows = store::open_of_user(ctx.pool, &user)
            .await
            .map_err(db("open transfers of a user"))?;
        if rows.is_empty() {
            return Ok(out);
        }
        let halted = store::halted(ctx.pool)
            .await
            .map_err(db("transfer halt check"))?;
        for row in rows {
            let req_id = row.req_id.clone();
            if let Err(e) = self.drive_transfer(&ctx, row, halted, &mut out).await {
                // What was committed is announced; the rest is resumed by the recovery worker.
                tracing::warn!(%req_id, error = %e, "transfer drive stopped");
                if matches!(e, HandlerError::LeaseLost(_)) {
                    return Err(e);
                }
            }
        }
        Ok(out)
    }
}
