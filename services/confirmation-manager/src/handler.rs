//! The confirmation manager's stage: MINED → CONFIRMED, REVERTED settled, reorgs. Route → load
//! ([`store`]) → follow the heads ([`Heads`]) → decide ([`decide`]) → persist ([`store`],
//! fenced) → outputs.
//!
//! A TxReceiptUpdated writes nothing: the work is in [`Handler::drive`], right after a batch
//! commits and on every recovery scan (every [`POLL_INTERVAL`](crate::config::POLL_INTERVAL)),
//! for every signer with followed transactions. A receipt for a transaction that is final
//! already answers with its stored TxConfirmed (the same `event_id`): a redelivery or a replay of
//! `tx.receipts` re-emits the outcomes, and changes nothing.
//!
//! Every announcement is a `tx_events` row written with the move that records it (the outbox
//! relays what a crash left unproduced): TxConfirmationsUpdated for a list (a self-move of the
//! state), TxReorged for MINED / REVERTED → SUBMITTED (its payload is the `new_fork = true`
//! announcement of the empty list), TxConfirmed for a final outcome.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;

use alloy::primitives::{Address, B256};
use sqlx::PgPool;
use txflow_core::chain::{ChainClient, Receipt};
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{BlockRef, TxConfirmationsUpdated, TxConfirmed, TxReceiptUpdated};
use txflow_core::fenced::Fenced;
use txflow_core::kafka::signer_key;
use txflow_core::lease::LeaseKey;
use txflow_core::metrics;
use txflow_core::retry::{Classify, Retry};
use txflow_core::role::Role;
use txflow_core::stage::handler::{db, route_signer};
use txflow_core::stage::{BatchResults, DriveCtx, Handler, HandlerError, Output, Rejection};
use txflow_core::state::{
    CONFIRM, COUNT_CONFIRMED, COUNT_MINED, COUNT_REVERTED, Move, RECONFIRM, REORG,
    REVERSE_CONFIRMED, REVERSE_SETTLED, SETTLE_REVERTED, TxState, UNDO_CONFIRMED,
};
use txflow_core::txstore::{self, MinedReceipt, MoveRow, ReceiptWrite};
use uuid::Uuid;

use crate::config::ConfirmationConfig;
use crate::decide::{
    self, Announcement, Finish, Phase, Rechecked, Reevaluation, Rules, Step, Tracked, View,
};
use crate::heads::Heads;
use crate::store::{self, Bookkeeping, Followed};

/// The stable event name of the critical alert raised when a reorg deeper than the required
/// depth removes the block of a final transaction.
pub const DEEP_REORG_ALERT: &str = "confirmed_tx_reorged";

/// The confirmation manager's handler.
#[derive(Debug)]
pub struct ConfirmStage {
    pub config: ConfirmationConfig,
    pub chain: Arc<dyn ChainClient>,
    heads: Heads,
}

/// Deterministic failures of the confirmation manager: retrying would fail the same way.
#[derive(Debug, thiserror::Error)]
pub enum ConfirmError {
    #[error("the signer {signer} is not an address")]
    SignerAddress {
        signer: String,
        #[source]
        source: <Address as FromStr>::Err,
    },
    #[error("encoding the {event} payload")]
    Encode {
        event: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("the stored {event} of transaction {tx_id} does not decode")]
    Stored {
        event: &'static str,
        tx_id: Uuid,
        #[source]
        source: serde_json::Error,
    },
}

impl Classify for ConfirmError {
    fn retry(&self) -> Retry {
        match self {
            ConfirmError::SignerAddress { .. }
            | ConfirmError::Encode { .. }
            | ConfirmError::Stored { .. } => Retry::Permanent,
        }
    }
}

fn json<E: serde::Serialize>(
    event: &'static str,
    e: &E,
) -> Result<serde_json::Value, HandlerError> {
    serde_json::to_value(e).map_err(|source| {
        HandlerError::classified("encode", ConfirmError::Encode { event, source })
    })
}

impl ConfirmStage {
    pub fn new(config: ConfirmationConfig, chain: Arc<dyn ChainClient>) -> ConfirmStage {
        // Drives of several signers within a fraction of the poll share one read of the heads.
        let heads = Heads::new(config.poll_interval / 4);
        ConfirmStage {
            config,
            chain,
            heads,
        }
    }

    fn key(&self, key: &LeaseKey) -> String {
        signer_key(key.chain_id.0, key.signer.as_str())
    }
}

/// Whether a transaction's outcome is final as it stands (its TxConfirmed is re-emitted).
fn is_final(a: &store::Asked) -> bool {
    match TxState::parse(&a.state) {
        Ok(TxState::Confirmed) => !a.reorged,
        Ok(TxState::Reverted) => a.settled && !a.reorged,
        Ok(
            TxState::Received
            | TxState::Simulated
            | TxState::PendingApproval
            | TxState::Allocated
            | TxState::Signed
            | TxState::Submitted
            | TxState::Mined
            | TxState::Replaced
            | TxState::Failed,
        )
        | Err(_) => false,
    }
}

impl Handler for ConfirmStage {
    type Input = TxReceiptUpdated;

    fn role(&self) -> Role {
        Role::ConfirmationManager
    }

    fn input_topic(&self) -> String {
        self.config.topics.tx_receipts()
    }

    fn route(&self, r: &TxReceiptUpdated) -> Result<(ChainId, Signer), Rejection> {
        route_signer(r.chain_id, &r.signer)
    }

    async fn handle(
        &self,
        w: &mut Fenced<'_>,
        r: &TxReceiptUpdated,
    ) -> Result<Vec<Output>, HandlerError> {
        match self.handle_batch(w, &[r]).await?.pop() {
            Some(result) => result,
            None => Ok(Vec::new()),
        }
    }

    /// Writes nothing; answers each receipt of a final transaction with its stored TxConfirmed.
    async fn handle_batch(&self, w: &mut Fenced<'_>, inputs: &[&TxReceiptUpdated]) -> BatchResults {
        let ids: Vec<Option<Uuid>> = inputs
            .iter()
            .map(|r| Uuid::parse_str(&r.tx_id).ok())
            .collect();
        let known: Vec<Uuid> = ids.iter().flatten().copied().collect();
        let asked: HashMap<Uuid, store::Asked> = store::asked(w, &known)
            .await?
            .into_iter()
            .map(|a| (a.tx_id, a))
            .collect();
        let finals: Vec<Uuid> = asked
            .values()
            .filter(|a| is_final(a))
            .map(|a| a.tx_id)
            .collect();
        let mut confirmed: HashMap<Uuid, TxConfirmed> = HashMap::new();
        for (tx_id, payload) in txstore::stored_events(w, &finals, CONFIRM.event).await? {
            // Newest last: the latest generation's wins.
            let event = serde_json::from_value(payload).map_err(|source| {
                HandlerError::classified(
                    "stored TxConfirmed",
                    ConfirmError::Stored {
                        event: "TxConfirmed",
                        tx_id,
                        source,
                    },
                )
            })?;
            confirmed.insert(tx_id, event);
        }
        let key = self.key(w.lease().key());
        Ok(inputs
            .iter()
            .zip(ids)
            .map(|(r, id)| {
                let Some(tx_id) = id else {
                    return Err(HandlerError::Reject(Rejection::new(
                        "INVALID_TX_ID",
                        format!("{:?} is not a transaction id", r.tx_id),
                    )));
                };
                if !asked.contains_key(&tx_id) {
                    return Err(HandlerError::Reject(Rejection::new(
                        "UNKNOWN_TX",
                        format!(
                            "no transaction {tx_id} of {} on chain {}",
                            r.signer, r.chain_id
                        ),
                    )));
                }
                Ok(confirmed
                    .get(&tx_id)
                    .map(|e| {
                        Output::new(
                            self.config.topics.tx_outcomes(),
                            Subjects::TopicRecordName,
                            key.clone(),
                            e.clone(),
                        )
                    })
                    .into_iter()
                    .collect())
            })
            .collect())
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        store::pending_signers(pool, self.config.chain_id).await
    }

    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let key = ctx.lease.key();
        let rows = store::followed(ctx.pool, key)
            .await
            .map_err(db("list followed"))?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mined = || {
            rows.iter()
                .filter_map(|r| r.mined_block_number)
                .filter_map(|n| u64::try_from(n).ok())
        };
        let from = mined().min().unwrap_or(u64::MAX);
        let to = mined().max().unwrap_or(0);
        let view = self
            .heads
            .view(self.chain.as_ref(), from, to)
            .await
            .map_err(|e| HandlerError::classified("follow the heads", e))?;
        let rules = Rules {
            required: self.config.required,
            // Read with the rows (the same snapshot): a nonce below it mined since is not in
            // `rows`, so no later nonce is made final before it.
            lowest_unmined: rows.first().and_then(|r| r.lowest_unmined),
        };
        let mut plan = Vec::with_capacity(rows.len());
        for row in &rows {
            let Some(t) = Row::read(row) else {
                tracing::error!(tx_id = %row.tx_id, state = %row.state, "a followed transaction cannot be read: left as it is");
                continue;
            };
            let step = decide::track(&t.tracked(), &view, &rules);
            plan.push((t, step));
        }
        let rechecks: Vec<Uuid> = plan
            .iter()
            .filter(|(_, s)| *s == Step::Reevaluate)
            .map(|(t, _)| t.row.tx_id)
            .collect();
        let mut reevaluated = HashMap::new();
        let mut view = view;
        if !rechecks.is_empty() {
            reevaluated = self.recheck(ctx.pool, key, &plan, &view).await?;
            // An attempt found mined again below what the view reaches (it has no block of its
            // own to follow from until now): the view is read again down to that block, so that
            // its list is announced from it in this drive.
            let again: Vec<u64> = reevaluated
                .values()
                .filter_map(|r| match r {
                    Recheck::Mined(receipt, _) => Some(receipt.block_number),
                    _ => None,
                })
                .collect();
            if let Some(low) = again.iter().copied().min()
                && view.lowest().is_none_or(|l| low < l)
            {
                let high = again.iter().copied().max().unwrap_or(low).max(to);
                view = self
                    .heads
                    .view(self.chain.as_ref(), from.min(low), high)
                    .await
                    .map_err(|e| HandlerError::classified("follow the heads", e))?;
            }
        }
        self.record(&ctx, &view, plan, reevaluated).await
    }
}

/// A followed row, read.
struct Row<'a> {
    row: &'a Followed,
    state: TxState,
    phase: Phase,
    block: Option<(u64, &'a str)>,
    /// The list last announced; `None` if what is stored does not read as one (then any list
    /// replaces it).
    announced: Option<Vec<BlockRef>>,
}

/// What no list is: compared with it, every list is a new fork.
const UNREADABLE: &[BlockRef] = &[BlockRef {
    number: -1,
    hash: String::new(),
    parent_hash: String::new(),
}];

impl<'a> Row<'a> {
    fn read(row: &'a Followed) -> Option<Row<'a>> {
        let state = TxState::parse(&row.state).ok()?;
        let phase = Phase::of(state, row.settled, row.reorged)?;
        let block = match (row.mined_block_number, row.mined_block_hash.as_deref()) {
            (Some(n), Some(h)) => Some((u64::try_from(n).ok()?, h)),
            _ => None,
        };
        let announced = match &row.confirmations {
            None => Some(Vec::new()),
            Some(v) => serde_json::from_value(v.clone()).ok(),
        };
        Some(Row {
            row,
            state,
            phase,
            block,
            announced,
        })
    }

    fn tracked(&self) -> Tracked<'_> {
        Tracked {
            nonce: self.row.nonce,
            phase: self.phase,
            block: self.block,
            announced: self.announced.as_deref().unwrap_or(UNREADABLE),
            watch_until: self
                .row
                .watch_until_block
                .and_then(|w| u64::try_from(w).ok()),
        }
    }

    /// The self-move that announces a list in this state.
    fn count_move(&self) -> Move {
        match self.state {
            TxState::Reverted => COUNT_REVERTED,
            TxState::Confirmed => COUNT_CONFIRMED,
            // A followed row is MINED, CONFIRMED or REVERTED (`Phase::of`); the others count as
            // mined, which they never are here.
            TxState::Mined
            | TxState::Received
            | TxState::Simulated
            | TxState::PendingApproval
            | TxState::Allocated
            | TxState::Signed
            | TxState::Submitted
            | TxState::Replaced
            | TxState::Failed => COUNT_MINED,
        }
    }
}

/// A transaction re-evaluated after a deep reorg: what the chain showed.
enum Recheck {
    /// One of its own attempts is mined again in a canonical block.
    Mined(Receipt, i32),
    /// Its nonce was consumed at the depth by another transaction: `cancellation`, the hash of
    /// the defensive cancellation when it is the one mined (a canonical receipt), else `None` (a
    /// transaction txflow did not send).
    Undone {
        cancellation: Option<String>,
    },
    OutcomeChanged(Receipt),
    Wait,
}

/// The JSON of a receipt in `managed_tx.receipt`, as the receipt checker records it (its
/// `StoredReceipt`: status 1 or 0, numbers as `i64`, the gas price in decimal wei).
fn receipt_json(r: &Receipt, attempt: i32) -> serde_json::Value {
    serde_json::json!({
        "attempt": attempt,
        "tx_hash": format!("{:#x}", r.tx_hash),
        "block_number": i64::try_from(r.block_number).unwrap_or(i64::MAX),
        "block_hash": format!("{:#x}", r.block_hash),
        "status": i32::from(r.status),
        "gas_used": i64::try_from(r.gas_used).unwrap_or(i64::MAX),
        "effective_gas_price": r.effective_gas_price.to_string(),
    })
}

/// The writes and outputs of one drive, gathered per move.
#[derive(Default)]
struct Writes {
    moves: Vec<(Move, Vec<MoveRow>)>,
    books: HashMap<Uuid, Bookkeeping>,
    /// Per transaction, in nonce order: its outputs, each emitted if the move that records it
    /// landed.
    outputs: Vec<(Uuid, Move, Output)>,
    reorged: Vec<Uuid>,
    /// Announcements with `new_fork = true` (`confirmations.newfork`), counted if their move
    /// landed.
    new_forks: Vec<(Uuid, Move)>,
    /// Final transactions a deep reorg undid (`tx.reorg{depth="deep"}`), counted likewise.
    deep: Vec<(Uuid, Move)>,
}

impl Writes {
    fn push(&mut self, m: Move, row: MoveRow) {
        match self.moves.iter_mut().find(|(n, _)| n.name == m.name) {
            Some((_, rows)) => rows.push(row),
            None => self.moves.push((m, vec![row])),
        }
    }

    fn book(&mut self, tx_id: Uuid) -> &mut Bookkeeping {
        self.books.entry(tx_id).or_insert_with(|| Bookkeeping {
            tx_id,
            ..Bookkeeping::default()
        })
    }
}

/// The order in which a drive's moves are written: announcements first, then final outcomes,
/// then the moves that leave the followed states.
const MOVE_ORDER: [Move; 10] = [
    COUNT_MINED,
    COUNT_REVERTED,
    COUNT_CONFIRMED,
    REVERSE_CONFIRMED,
    REVERSE_SETTLED,
    CONFIRM,
    SETTLE_REVERTED,
    RECONFIRM,
    REORG,
    UNDO_CONFIRMED,
];

impl ConfirmStage {
    /// Asks the chain about the transactions undone by a deep reorg: a receipt of one of their
    /// own attempts in a canonical block, else whether their nonce was consumed at depth.
    async fn recheck(
        &self,
        pool: &PgPool,
        key: &LeaseKey,
        plan: &[(Row<'_>, Step)],
        view: &View,
    ) -> Result<HashMap<Uuid, Recheck>, HandlerError> {
        let ids: Vec<Uuid> = plan
            .iter()
            .filter(|(_, s)| *s == Step::Reevaluate)
            .map(|(t, _)| t.row.tx_id)
            .collect();
        let attempts = store::attempts(pool, &ids)
            .await
            .map_err(db("list attempts"))?;
        let address: Address = key.signer.as_str().parse().map_err(|source| {
            HandlerError::classified(
                "signer address",
                ConfirmError::SignerAddress {
                    signer: key.signer.as_str().to_string(),
                    source,
                },
            )
        })?;
        let chain_nonce = match decide::depth_block(view.head(), self.config.required) {
            Some(block) => Some(
                self.chain
                    .nonce_at(address, block)
                    .await
                    .map_err(|e| HandlerError::classified("nonce at depth", e))?,
            ),
            None => None,
        };
        let mut out = HashMap::new();
        for (t, step) in plan {
            if *step != Step::Reevaluate {
                continue;
            }
            let mut mined = None;
            for a in attempts.iter().filter(|a| a.tx_id == t.row.tx_id) {
                let Ok(hash) = a.tx_hash.parse::<B256>() else {
                    continue;
                };
                let receipt = self
                    .chain
                    .receipt(hash)
                    .await
                    .map_err(|e| HandlerError::classified("receipt", e))?;
                if let Some(r) = receipt
                    && self.canonical(view, r.block_number, r.block_hash).await?
                {
                    mined = Some((r, a.attempt));
                    break;
                }
            }
            let facts = Rechecked {
                mined_success: mined.as_ref().map(|(r, _)| r.status),
                consumed_at_depth: chain_nonce
                    .is_some_and(|n| u64::try_from(t.row.nonce).is_ok_and(|ours| n > ours)),
            };
            let recheck = match (decide::reevaluate(!t.phase.success(), &facts), mined) {
                (Reevaluation::Remined, Some((r, attempt))) => Recheck::Mined(r, attempt),
                (Reevaluation::OutcomeChanged, Some((r, _))) => Recheck::OutcomeChanged(r),
                (Reevaluation::Undone, _) => Recheck::Undone {
                    cancellation: self.mined_cancellation(pool, key, t.row.nonce).await?,
                },
                _ => Recheck::Wait,
            };
            out.insert(t.row.tx_id, recheck);
        }
        Ok(out)
    }

    /// Whether block `hash` is the canonical one at `number`: from the view where it reaches
    /// that block, else from the chain at that number. Our own attempt found in a block the view
    /// does not reach (a transaction undone by a deep reorg has no block of its own to follow
    /// from, so the view may hold the head alone) is checked there, never taken for a nonce
    /// consumed by someone else.
    async fn canonical(&self, view: &View, number: u64, hash: B256) -> Result<bool, HandlerError> {
        if let Some(holds) = view.holds(number, &format!("{hash:#x}")) {
            return Ok(holds);
        }
        let block = self
            .chain
            .block(number)
            .await
            .map_err(|e| HandlerError::classified("block", e))?;
        Ok(block.is_some_and(|b| b.hash == hash))
    }

    /// The hash of the signer's defensive cancellation of `nonce` (`tx_cancellations`) if it is
    /// mined in a canonical block: what consumed the nonce, for the record. `None` when there is
    /// none, or it is not the one mined. Its block is below what the view may reach (the
    /// transaction has no block of its own to follow from), so it is compared with the chain's
    /// canonical block at that number.
    async fn mined_cancellation(
        &self,
        pool: &PgPool,
        key: &LeaseKey,
        nonce: i64,
    ) -> Result<Option<String>, HandlerError> {
        let Some(hash) = store::cancellation_hash(pool, key, nonce)
            .await
            .map_err(db("cancellation"))?
        else {
            return Ok(None);
        };
        let Ok(h) = hash.parse::<B256>() else {
            return Ok(None);
        };
        let receipt = self
            .chain
            .receipt(h)
            .await
            .map_err(|e| HandlerError::classified("receipt", e))?;
        let Some(r) = receipt else {
            return Ok(None);
        };
        let canonical = self
            .chain
            .block(r.block_number)
            .await
            .map_err(|e| HandlerError::classified("block", e))?;
        Ok(canonical.filter(|b| b.hash == r.block_hash).map(|_| hash))
    }

    /// Records the plan in one fenced transaction and returns the outputs of what landed, in
    /// nonce order; then sends the reorged transactions again.
    async fn record(
        &self,
        ctx: &DriveCtx<'_>,
        view: &View,
        plan: Vec<(Row<'_>, Step)>,
        mut reevaluated: HashMap<Uuid, Recheck>,
    ) -> Result<Vec<Output>, HandlerError> {
        let key = ctx.lease.key();
        let token = ctx.lease.token().0;
        let skey = self.key(key);
        let topics = &self.config.topics;
        let required = i32::try_from(self.config.required).unwrap_or(i32::MAX);
        let mut w = Writes::default();

        let announcement = |t: &Row<'_>, a: &Announcement| {
            let id = Uuid::new_v4();
            let event = TxConfirmationsUpdated {
                event_id: id.to_string(),
                tx_id: t.row.tx_id.to_string(),
                chain_id: key.chain_id.0,
                signer: key.signer.as_str().to_string(),
                nonce: t.row.nonce,
                tx_hash: t.row.tx_hash.clone().unwrap_or_default(),
                new_fork: a.new_fork,
                confirmations: a.list.clone(),
                required_confirmations: required,
                fencing_token: token,
            };
            (id, event)
        };
        let gone = Announcement {
            list: Vec::new(),
            new_fork: true,
        };

        for (t, step) in &plan {
            let tx_id = t.row.tx_id;
            // Announces `a` with the state's self-move, writing `receipt`.
            let announce = |w: &mut Writes,
                            a: &Announcement,
                            tx_hash: Option<String>,
                            receipt: ReceiptWrite|
             -> Result<(), HandlerError> {
                let (id, mut event) = announcement(t, a);
                if let Some(h) = tx_hash {
                    event.tx_hash = h;
                }
                let m = t.count_move();
                // The announced list is written by the move itself (one version of the row).
                w.push(
                    m,
                    MoveRow {
                        receipt,
                        confirmations: Some((json("confirmations", &a.list)?, required)),
                        ..MoveRow::new(tx_id, id, json("TxConfirmationsUpdated", &event)?)
                    },
                );
                if a.new_fork {
                    w.new_forks.push((tx_id, m));
                }
                w.outputs.push((
                    tx_id,
                    m,
                    Output::new(
                        topics.tx_confirmations(),
                        Subjects::TopicName,
                        skey.clone(),
                        event,
                    ),
                ));
                Ok(())
            };
            match step {
                Step::Idle => {}
                Step::Progress {
                    announce: a,
                    finish,
                } => {
                    if let Some(a) = a {
                        announce(&mut w, a, None, ReceiptWrite::Keep)?;
                    }
                    if let Some(f) = finish {
                        self.finish(&mut w, t, *f, key, token)?;
                    }
                }
                Step::Reorg => {
                    let (id, event) = announcement(t, &gone);
                    let number = t.block.map_or(0, |(n, _)| n);
                    let canonical = view
                        .list(number, 1)
                        .and_then(|l| l.into_iter().next())
                        .map(|b| b.hash)
                        .unwrap_or_default();
                    tracing::warn!(
                        target: "txflow::confirmations",
                        event = "tx_reorged",
                        signer = %key.signer,
                        tx_id = %tx_id,
                        nonce = t.row.nonce,
                        block = ?t.block,
                        head = view.head(),
                        canonical_hash = %canonical,
                        "a reorg removed the block of a transaction before it was final: back to SUBMITTED, sent again"
                    );
                    w.push(
                        REORG,
                        MoveRow {
                            receipt: ReceiptWrite::Clear,
                            ..MoveRow::new(tx_id, id, json("TxReorged", &event)?)
                        },
                    );
                    w.book(tx_id).announced = Some(serde_json::json!([]));
                    w.new_forks.push((tx_id, REORG));
                    w.outputs.push((
                        tx_id,
                        REORG,
                        Output::new(
                            topics.tx_confirmations(),
                            Subjects::TopicName,
                            skey.clone(),
                            event,
                        ),
                    ));
                    w.reorged.push(tx_id);
                }
                Step::DeepReorg => {
                    let (number, lost) = t.block.unwrap_or((0, ""));
                    let canonical = view
                        .list(number, 1)
                        .and_then(|l| l.into_iter().next())
                        .map(|b| b.hash)
                        .unwrap_or_default();
                    tracing::error!(
                        target: "txflow::alert",
                        event = DEEP_REORG_ALERT,
                        alert = true,
                        chain_id = key.chain_id.0,
                        signer = %key.signer,
                        tx_id = %tx_id,
                        request_id = %t.row.request_id,
                        nonce = t.row.nonce,
                        state = %t.state,
                        block_number = number,
                        block_hash = lost,
                        canonical_hash = %canonical,
                        generation = t.row.reorg_generation + 1,
                        required = self.config.required,
                        "a reorg deeper than the required depth removed the block of a final transaction: \
                         downstream gets new_fork=true; the signer gateway signs a defensive cancellation of \
                         its nonce and the broadcaster sends it; whichever of it and the original is mined \
                         settles the outcome"
                    );
                    // What was booked on its TxConfirmed is reverted, on tx.outcomes, with the
                    // new fork on tx.confirmations: one audit row (the outbox relays both).
                    let reversal_id = decide::reversal_event_id(tx_id, t.row.reorg_generation);
                    let reversal = self
                        .confirmed(t, key, (number, lost), token)
                        .reversal(reversal_id.to_string());
                    let m = if t.state == TxState::Reverted {
                        REVERSE_SETTLED
                    } else {
                        REVERSE_CONFIRMED
                    };
                    w.push(
                        m,
                        MoveRow {
                            receipt: ReceiptWrite::Clear,
                            confirmations: Some((json("confirmations", &gone.list)?, required)),
                            ..MoveRow::new(
                                tx_id,
                                reversal_id,
                                json("TxConfirmationReverted", &reversal)?,
                            )
                        },
                    );
                    w.new_forks.push((tx_id, m));
                    for o in txflow_core::outbox::reversal(topics, skey.clone(), reversal) {
                        w.outputs.push((tx_id, m, o));
                    }
                    w.deep.push((tx_id, m));
                    w.book(tx_id).park = true;
                }
                Step::LostAgain => {
                    tracing::warn!(
                        target: "txflow::confirmations",
                        event = "reorged_tx_lost_again",
                        signer = %key.signer,
                        tx_id = %tx_id,
                        nonce = t.row.nonce,
                        "a transaction re-evaluated after a deep reorg lost its block again"
                    );
                    announce(&mut w, &gone, None, ReceiptWrite::Clear)?;
                }
                Step::Unwatch => {
                    w.book(tx_id).unwatch = true;
                }
                Step::Reevaluate => match reevaluated.remove(&tx_id) {
                    Some(Recheck::Mined(r, attempt)) => {
                        let number = r.block_number;
                        // Announced from its block once the view holds that very block.
                        if view.holds(number, &format!("{:#x}", r.block_hash)) != Some(true) {
                            continue;
                        }
                        let Some(list) = view.list(number, self.config.required) else {
                            continue;
                        };
                        let a = Announcement {
                            list,
                            new_fork: false,
                        };
                        tracing::warn!(
                            target: "txflow::confirmations",
                            event = "reorged_tx_mined_again",
                            signer = %key.signer,
                            tx_id = %tx_id,
                            nonce = t.row.nonce,
                            block = number,
                            "a transaction undone by a deep reorg is mined again: followed to its depth again"
                        );
                        announce(
                            &mut w,
                            &a,
                            Some(format!("{:#x}", r.tx_hash)),
                            ReceiptWrite::Set(MinedReceipt {
                                receipt: receipt_json(&r, attempt),
                                block_number: i64::try_from(number).unwrap_or(i64::MAX),
                                block_hash: format!("{:#x}", r.block_hash),
                            }),
                        )?;
                    }
                    Some(Recheck::OutcomeChanged(r)) => {
                        tracing::error!(
                            target: "txflow::alert",
                            event = "reorged_tx_outcome_changed",
                            alert = true,
                            signer = %key.signer,
                            tx_id = %tx_id,
                            nonce = t.row.nonce,
                            status = r.status,
                            block = r.block_number,
                            "a transaction undone by a deep reorg was mined again with another outcome: \
                             left for an operator"
                        );
                    }
                    Some(Recheck::Undone { cancellation }) => match t.state {
                        TxState::Confirmed => {
                            let consumed_by = if cancellation.is_some() {
                                "defensive cancellation"
                            } else {
                                "another transaction"
                            };
                            tracing::error!(
                                target: "txflow::alert",
                                event = "confirmed_tx_undone",
                                alert = true,
                                signer = %key.signer,
                                tx_id = %tx_id,
                                nonce = t.row.nonce,
                                consumed_by,
                                cancellation_hash = cancellation.as_deref().unwrap_or_default(),
                                "another transaction consumed the nonce of a confirmed transaction \
                                 undone by a deep reorg: back to RECEIVED, simulated and checked against the policy again before a fresh nonce"
                            );
                            let audit = serde_json::json!({
                                "tx_id": tx_id.to_string(),
                                "nonce": t.row.nonce,
                                "generation": t.row.reorg_generation,
                                "consumed_by": consumed_by,
                                "cancellation_hash": cancellation,
                                "fencing_token": token,
                            });
                            w.push(
                                UNDO_CONFIRMED,
                                MoveRow {
                                    receipt: ReceiptWrite::Clear,
                                    ..MoveRow::new(tx_id, Uuid::new_v4(), audit)
                                },
                            );
                            w.book(tx_id).undone = true;
                        }
                        _ => {
                            tracing::warn!(
                                target: "txflow::confirmations",
                                event = "reverted_tx_undone",
                                signer = %key.signer,
                                tx_id = %tx_id,
                                nonce = t.row.nonce,
                                by_cancellation = cancellation.is_some(),
                                "another transaction consumed the nonce of a reverted transaction undone \
                                 by a deep reorg: its outcome (no effect) stands"
                            );
                            w.book(tx_id).unpark = true;
                        }
                    },
                    Some(Recheck::Wait) | None => {}
                },
            }
        }
        if w.moves.is_empty() && w.books.is_empty() {
            return Ok(Vec::new());
        }

        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let mut fw = tx.writer();
        let mut landed: HashMap<&'static str, Vec<Uuid>> = HashMap::new();
        for m in MOVE_ORDER {
            if let Some((_, rows)) = w.moves.iter().find(|(n, _)| n.name == m.name) {
                landed.insert(m.name, store::apply(&mut fw, m, rows).await?);
            }
        }
        let moved = |m: Move, tx_id: &Uuid| landed.get(m.name).is_some_and(|l| l.contains(tx_id));
        // Bookkeeping for the rows that moved (or that only the bookkeeping concerns).
        let books: Vec<Bookkeeping> = w
            .books
            .values()
            .filter(|b| {
                let concerned: Vec<&Move> = w
                    .moves
                    .iter()
                    .filter(|(_, rows)| rows.iter().any(|r| r.tx_id == b.tx_id))
                    .map(|(m, _)| m)
                    .collect();
                concerned.is_empty() || concerned.iter().all(|m| moved(**m, &b.tx_id))
            })
            .cloned()
            .collect();
        store::bookkeeping(&mut fw, &books, self.config.required).await?;
        let reorged: Vec<Uuid> = w
            .reorged
            .iter()
            .filter(|id| moved(REORG, id))
            .copied()
            .collect();
        store::resubmit_after(&mut fw, &reorged, self.config.resubmit_interval).await?;
        tx.commit().await?;
        let landed_count =
            |list: &[(Uuid, Move)]| list.iter().filter(|(id, m)| moved(*m, id)).count() as u64;
        let m = metrics::get();
        m.confirmations_newfork(key.chain_id, landed_count(&w.new_forks));
        m.tx_reorg("shallow", reorged.len() as u64);
        m.tx_reorg("deep", landed_count(&w.deep));

        let outputs = w
            .outputs
            .into_iter()
            .filter(|(tx_id, m, _)| moved(*m, tx_id))
            .map(|(_, _, o)| o)
            .collect();
        self.rebroadcast(ctx.pool, key, &reorged).await;
        Ok(outputs)
    }

    /// The TxConfirmed of `t` in `block` (number, hash) for its generation: the one its final
    /// move announces, and the one its reversal reverts.
    fn confirmed(
        &self,
        t: &Row<'_>,
        key: &LeaseKey,
        block: (u64, &str),
        token: i64,
    ) -> TxConfirmed {
        let tx_id = t.row.tx_id;
        TxConfirmed {
            event_id: decide::confirmed_event_id(tx_id, t.row.reorg_generation).to_string(),
            tx_id: tx_id.to_string(),
            request_id: t.row.request_id.clone(),
            chain_id: key.chain_id.0,
            signer: key.signer.as_str().to_string(),
            nonce: t.row.nonce,
            tx_hash: t.row.tx_hash.clone().unwrap_or_default(),
            block_number: i64::try_from(block.0).unwrap_or(i64::MAX),
            block_hash: block.1.to_string(),
            success: t.phase.success(),
            confirmations: i32::try_from(self.config.required).unwrap_or(i32::MAX),
            fencing_token: token,
            reorg_generation: t.row.reorg_generation,
            revert_reason: if t.phase.success() {
                None
            } else {
                t.row.revert_reason.clone()
            },
        }
    }

    /// The final move of `t` and its TxConfirmed, whose `event_id` is derived from the
    /// transaction and its generation.
    fn finish(
        &self,
        w: &mut Writes,
        t: &Row<'_>,
        f: Finish,
        key: &LeaseKey,
        token: i64,
    ) -> Result<(), HandlerError> {
        let Some((number, hash)) = t.block else {
            return Ok(());
        };
        let m = match f {
            Finish::Confirm => CONFIRM,
            Finish::Settle => SETTLE_REVERTED,
            Finish::Reconfirm => RECONFIRM,
        };
        let tx_id = t.row.tx_id;
        let event_id = decide::confirmed_event_id(tx_id, t.row.reorg_generation);
        let event = self.confirmed(t, key, (number, hash), token);
        w.push(
            m,
            MoveRow::new(tx_id, event_id, json("TxConfirmed", &event)?),
        );
        w.book(tx_id).finished_watch_until = Some(
            i64::try_from(decide::watch_until(number, self.config.watch_blocks))
                .unwrap_or(i64::MAX),
        );
        w.outputs.push((
            tx_id,
            m,
            Output::new(
                self.config.topics.tx_outcomes(),
                Subjects::TopicRecordName,
                self.key(key),
                event,
            ),
        ));
        Ok(())
    }

    /// Sends the latest attempt of each reorged transaction again (anvil, and some nodes, do not
    /// put a reorged transaction back in their pool). A failed send is left to the broadcaster's
    /// resubmission, which the reorg scheduled.
    async fn rebroadcast(&self, pool: &PgPool, key: &LeaseKey, tx_ids: &[Uuid]) {
        if tx_ids.is_empty() {
            return;
        }
        let attempts = match store::attempts(pool, tx_ids).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, signer = %key.signer, "cannot read the reorged transactions' attempts: the broadcaster resubmits them");
                return;
            }
        };
        for tx_id in tx_ids {
            let Some(latest) = attempts.iter().find(|a| a.tx_id == *tx_id) else {
                continue;
            };
            match self.chain.send_raw(&latest.raw_tx).await {
                Ok(outcome) => {
                    tracing::info!(signer = %key.signer, tx_id = %tx_id, attempt = latest.attempt, ?outcome, "reorged transaction sent again")
                }
                Err(e) => {
                    tracing::warn!(signer = %key.signer, tx_id = %tx_id, error = %e, "sending a reorged transaction again failed: the broadcaster resubmits it")
                }
            }
        }
    }
}
