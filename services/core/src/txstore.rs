//! The write primitives of the transaction state machine (txflow-domain `state`): every change of
//! `managed_tx.state` is one of these, a fenced, set-based compare-and-set on the expected
//! state(s) that writes the `tx_events` audit row of each row that moved, in the same statement.
//! This module is the only place that inserts into `tx_events`.
//!
//! - [`create`]: new rows (a request in RECEIVED, a no-op in ALLOCATED), idempotent on
//!   (chain, signer, request_id).
//! - [`apply`]: a named [`Move`] for many rows at once (`UNNEST` arrays, the fence as a join on
//!   `signer_lease`, `RETURNING` to learn which rows moved). A move to FAILED from a state that
//!   holds a nonce releases it to `recycled_nonces` in the same statement. A row's side data
//!   ([`MoveRow`]) is written in the same statement: nonce, payload, failure, approver, the
//!   receipt columns ([`ReceiptWrite`]: set, cleared to NULL, or kept) and the confirmation
//!   manager's announced list.
//!
//! Both answer `Fenced` when the lease is not current (a sentinel row tells a fenced statement
//! from one whose rows were all in another state), and otherwise the rows that landed.

use sqlx::PgPool;
use txflow_domain::events::ANNOUNCED;
use txflow_domain::state::{CREATED_NOOP, CREATED_REQUEST, Move};
use txflow_domain::{ChainId, FailureCode, Signer, TxState};
use uuid::Uuid;

use crate::fenced::{FENCE_PREDICATE, FenceError, Fenced, SIGNER_ROW};

/// The audit rows of the rows that landed: `landed(tx_id)` joined with the input `u(tx_id,
/// event_id, event_type, event)`, for `create` (an INSERT's RETURNING names only the table's
/// columns; `apply` returns them from its UPDATE, [`audit_returned`]). Every row goes to
/// `tx_events`; an announced event ([`ANNOUNCED`](txflow_domain::events::ANNOUNCED)) also to
/// `tx_outbox` ([`crate::outbox`]), where it stays until the broker acknowledged it.
/// `announced` is the number of the statement's parameter bound to `ANNOUNCED`; the signer is
/// `$2`, `$3`.
fn audit(announced: usize) -> String {
    format!(
        "audit AS MATERIALIZED (SELECT u.event_id, u.tx_id, u.event_type, u.event FROM landed JOIN u USING (tx_id)),
         {}",
        audit_returned("audit", announced)
    )
}

/// The audit rows of `source(event_id, tx_id, event_type, event)`: the one `INSERT INTO
/// tx_events` of the code base, and the outbox rows of the announced ones.
fn audit_returned(source: &str, announced: usize) -> String {
    format!(
        "events AS (
     INSERT INTO tx_events (event_id, tx_id, type, payload)
     SELECT event_id, tx_id, event_type, event FROM {source}),
         outbox AS (
     INSERT INTO tx_outbox (event_id, tx_id, chain_id, signer, type)
     SELECT event_id, tx_id, $2, $3, event_type FROM {source}
     WHERE event_type = ANY(${announced}::text[]))"
    )
}

/// The kind of a new row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An upstream request: starts RECEIVED.
    Request,
    /// A 0-value self-transfer filling a released nonce: starts ALLOCATED, holding it.
    Noop,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Request => "REQUEST",
            Kind::Noop => "NOOP",
        }
    }
    fn initial(self) -> TxState {
        match self {
            Kind::Request => CREATED_REQUEST,
            Kind::Noop => CREATED_NOOP,
        }
    }
}

/// The audit row written with a change.
#[derive(Debug, Clone)]
pub struct Audit {
    pub event_id: Uuid,
    /// `tx_events.type`.
    pub event_type: &'static str,
    pub payload: serde_json::Value,
}

/// A new transaction row.
#[derive(Debug, Clone)]
pub struct NewTx {
    pub tx_id: Uuid,
    pub request_id: String,
    pub kind: Kind,
    /// Only for a no-op (it is created holding its nonce).
    pub nonce: Option<i64>,
    pub payload: serde_json::Value,
    pub audit: Audit,
}

/// One row of a [`Move`]: which transaction, its audit row (its type is the move's
/// [`Move::event`]), and the side data the move records.
#[derive(Debug, Clone)]
pub struct MoveRow {
    pub tx_id: Uuid,
    /// `tx_events.event_id` of the audit row (the event's own id when it is announced).
    pub event_id: Uuid,
    /// `tx_events.payload` of the audit row.
    pub event: serde_json::Value,
    /// Sets `nonce` (an allocation).
    pub nonce: Option<i64>,
    /// Replaces `payload` (gas limit after simulation, fees at allocation).
    pub payload: Option<serde_json::Value>,
    /// Sets `failure_code` / `failure_reason` (a move to FAILED).
    pub failure: Option<(FailureCode, String)>,
    /// Records who approved it (and when, by the database clock).
    pub approved_by: Option<String>,
    /// The compare-and-set also requires this nonce (the row must still hold what was decided on).
    pub expect_nonce: Option<i64>,
    /// What the move writes to the receipt columns (`receipt`, `mined_block_number`,
    /// `mined_block_hash`): nothing ([`ReceiptWrite::Keep`], the default), a receipt (MINE,
    /// REVERT) or NULL (REORG, REPLACE).
    pub receipt: ReceiptWrite,
    /// The confirmation manager's announced list (`managed_tx.confirmations`) with the
    /// confirmations required (`required_confirmations`), written by the move itself, so that an
    /// announcement costs one version of the row, not two; `None` keeps both.
    pub confirmations: Option<(serde_json::Value, i32)>,
}

/// What a move writes to `managed_tx.receipt`, `mined_block_number` and `mined_block_hash`,
/// always the three together (a CHECK of migration 0006). Writing them ([`ReceiptWrite::Set`] or
/// [`ReceiptWrite::Clear`]) also resets the receipt checker's schedule
/// (`next_receipt_check_at`, `receipt_stale_since` to NULL): a transaction back in SUBMITTED is
/// looked up at once.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum ReceiptWrite {
    /// Leaves the columns as they are.
    #[default]
    Keep,
    /// Records a receipt (a move to MINED or REVERTED).
    Set(MinedReceipt),
    /// Sets the three columns to NULL: the block is gone (REORG: MINED → SUBMITTED), or the
    /// transaction no longer holds its nonce (REPLACE).
    Clear,
}

/// A receipt as `managed_tx` records it.
#[derive(Debug, Clone, PartialEq)]
pub struct MinedReceipt {
    /// `managed_tx.receipt`: the receipt's JSON (the receipt checker's `StoredReceipt`).
    pub receipt: serde_json::Value,
    /// `managed_tx.mined_block_number`.
    pub block_number: i64,
    /// `managed_tx.mined_block_hash`: lowercase 0x-hex.
    pub block_hash: String,
}

impl ReceiptWrite {
    /// `(write, receipt, block number, block hash)`: the statement's arguments for one row.
    fn columns(&self) -> (bool, Option<serde_json::Value>, Option<i64>, Option<String>) {
        match self {
            ReceiptWrite::Keep => (false, None, None, None),
            ReceiptWrite::Set(r) => (
                true,
                Some(r.receipt.clone()),
                Some(r.block_number),
                Some(r.block_hash.clone()),
            ),
            ReceiptWrite::Clear => (true, None, None, None),
        }
    }
}

impl MoveRow {
    /// A row with only its audit row.
    pub fn new(tx_id: Uuid, event_id: Uuid, event: serde_json::Value) -> MoveRow {
        MoveRow {
            tx_id,
            event_id,
            event,
            nonce: None,
            payload: None,
            failure: None,
            approved_by: None,
            expect_nonce: None,
            receipt: ReceiptWrite::Keep,
            confirmations: None,
        }
    }
}

/// A row that landed: its id and its nonce after the move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Landed {
    pub tx_id: Uuid,
    pub nonce: Option<i64>,
}

/// Inserts new rows; a row whose (chain, signer, request_id) exists is left alone and not
/// returned (a duplicate request).
pub async fn create(w: &mut Fenced<'_>, rows: &[NewTx]) -> Result<Vec<Uuid>, FenceError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.tx_id).collect();
    let request_ids: Vec<&str> = rows.iter().map(|r| r.request_id.as_str()).collect();
    let kinds: Vec<&str> = rows.iter().map(|r| r.kind.as_str()).collect();
    let states: Vec<&str> = rows.iter().map(|r| r.kind.initial().as_str()).collect();
    let nonces: Vec<Option<i64>> = rows.iter().map(|r| r.nonce).collect();
    let payloads: Vec<serde_json::Value> = rows.iter().map(|r| r.payload.clone()).collect();
    let event_ids: Vec<Uuid> = rows.iter().map(|r| r.audit.event_id).collect();
    let event_types: Vec<&str> = rows.iter().map(|r| r.audit.event_type).collect();
    let events: Vec<serde_json::Value> = rows.iter().map(|r| r.audit.payload.clone()).collect();
    let audit = audit(15);
    let sql = format!(
        "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
         u AS (SELECT * FROM unnest($6::uuid[], $7::text[], $8::text[], $9::text[], $10::bigint[],
                                    $11::jsonb[], $12::uuid[], $13::text[], $14::jsonb[])
                 AS u(tx_id, request_id, kind, state, nonce, payload, event_id, event_type, event)),
         landed AS (
             INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, kind, nonce, payload, state, fencing_token)
             SELECT u.tx_id, $2, $3, u.request_id, u.kind, u.nonce, u.payload, u.state, $5
             FROM u WHERE EXISTS (SELECT 1 FROM fence_ok)
             ON CONFLICT (chain_id, signer, request_id) DO NOTHING
             RETURNING tx_id),
         {audit}
         SELECT tx_id FROM landed UNION ALL SELECT NULL FROM fence_ok"
    );
    let out: Vec<(Option<Uuid>,)> = w
        .fetch_all("create", &sql, |q| {
            q.bind(ids)
                .bind(request_ids)
                .bind(kinds)
                .bind(states)
                .bind(nonces)
                .bind(payloads)
                .bind(event_ids)
                .bind(event_types)
                .bind(events)
                .bind(ANNOUNCED)
        })
        .await?;
    ids_or_fenced(w, "create", out)
}

/// Applies `m` to `rows`: each row moves only if it is in one of `m.from` (and holds
/// `expect_nonce`, when given). Returns the rows that moved. A row that leaves RECEIVED loses its
/// request hold (`hold_reason`, `held_since`, `hold_retry_at`; `hold_attempts` stays).
pub async fn apply(
    w: &mut Fenced<'_>,
    m: Move,
    rows: &[MoveRow],
) -> Result<Vec<Landed>, FenceError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    // FAILED from a state that holds a nonce gives the nonce back.
    let releases = m.to == TxState::Failed && m.from.iter().all(|s| s.holds_nonce());
    let ids: Vec<Uuid> = rows.iter().map(|r| r.tx_id).collect();
    let event_ids: Vec<Uuid> = rows.iter().map(|r| r.event_id).collect();
    // The audit row of a move is always the move's own event type.
    let event_types: Vec<&str> = vec![m.event; rows.len()];
    let events: Vec<serde_json::Value> = rows.iter().map(|r| r.event.clone()).collect();
    let nonces: Vec<Option<i64>> = rows.iter().map(|r| r.nonce).collect();
    let payloads: Vec<Option<serde_json::Value>> = rows.iter().map(|r| r.payload.clone()).collect();
    let codes: Vec<Option<&str>> = rows
        .iter()
        .map(|r| r.failure.as_ref().map(|(c, _)| c.as_str()))
        .collect();
    let reasons: Vec<Option<String>> = rows
        .iter()
        .map(|r| {
            r.failure
                .as_ref()
                .map(|(_, why)| txflow_domain::failure::truncate_reason(why))
        })
        .collect();
    let approvers: Vec<Option<&str>> = rows.iter().map(|r| r.approved_by.as_deref()).collect();
    let expect: Vec<Option<i64>> = rows.iter().map(|r| r.expect_nonce).collect();
    let mut receipt_writes: Vec<bool> = Vec::with_capacity(rows.len());
    let mut receipts: Vec<Option<serde_json::Value>> = Vec::with_capacity(rows.len());
    let mut block_numbers: Vec<Option<i64>> = Vec::with_capacity(rows.len());
    let mut block_hashes: Vec<Option<String>> = Vec::with_capacity(rows.len());
    for r in rows {
        let (write, receipt, number, hash) = r.receipt.columns();
        receipt_writes.push(write);
        receipts.push(receipt);
        block_numbers.push(number);
        block_hashes.push(hash);
    }
    let lists: Vec<Option<serde_json::Value>> = rows
        .iter()
        .map(|r| r.confirmations.as_ref().map(|(l, _)| l.clone()))
        .collect();
    let required: Vec<Option<i32>> = rows
        .iter()
        .map(|r| r.confirmations.as_ref().map(|(_, n)| *n))
        .collect();
    // The state each row left (for `fsm.transition{from,to}`): known when the move has one
    // `from`; otherwise read from a second reference to the row, which the statement sees as
    // it was before the update (a primary-key lookup per row, only for these moves, and only
    // while metrics are on).
    let (prev_from, prev_join, prev_col) = if m.from.len() > 1 && crate::metrics::enabled() {
        (", managed_tx o", "AND o.tx_id = m.tx_id", "o.state")
    } else {
        ("", "", "NULL::text")
    };
    // A hold is a RECEIVED request's (`managed_tx.hold_reason`, the allocator's): a move out of
    // RECEIVED clears it in the same statement (the attempt count stays as the request's history).
    let clear_hold = if m.from.contains(&TxState::Received) {
        "hold_reason = NULL, held_since = NULL, hold_retry_at = NULL,"
    } else {
        ""
    };
    let audit = audit_returned("landed", 19);
    // One plan fits every batch (drives run it with generic plans, `fenced::BEGIN_FENCED`):
    // the array `u` is read once and each of its rows finds its `managed_tx` row by primary key
    // (`fenced::SIGNER_ROW`: no index serves the signer's predicate, only a check); the
    // audit rows come from the UPDATE's own RETURNING, not from joining `landed` to `u` again.
    let sql = format!(
        "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
         u AS (SELECT * FROM unnest($6::uuid[], $7::uuid[], $8::text[], $9::jsonb[], $10::bigint[],
                                    $11::jsonb[], $12::text[], $13::text[], $14::text[], $15::bigint[],
                                    $20::boolean[], $21::jsonb[], $22::bigint[], $23::text[],
                                    $24::jsonb[], $25::int4[])
                 AS u(tx_id, event_id, event_type, event, nonce, payload, failure_code,
                      failure_reason, approved_by, expect_nonce, receipt_write, receipt,
                      mined_block_number, mined_block_hash, confirmations, required)),
         landed AS (
             UPDATE managed_tx m SET
                 state = $16,
                 nonce = coalesce(u.nonce, m.nonce),
                 payload = coalesce(u.payload, m.payload),
                 failure_code = coalesce(u.failure_code, m.failure_code),
                 failure_reason = coalesce(u.failure_reason, m.failure_reason),
                 approved_by = coalesce(u.approved_by, m.approved_by),
                 approved_at = CASE WHEN u.approved_by IS NULL THEN m.approved_at ELSE clock_timestamp() END,
                 receipt = CASE WHEN u.receipt_write THEN u.receipt ELSE m.receipt END,
                 mined_block_number = CASE WHEN u.receipt_write THEN u.mined_block_number
                                           ELSE m.mined_block_number END,
                 mined_block_hash = CASE WHEN u.receipt_write THEN u.mined_block_hash
                                         ELSE m.mined_block_hash END,
                 next_receipt_check_at = CASE WHEN u.receipt_write THEN NULL
                                              ELSE m.next_receipt_check_at END,
                 receipt_stale_since = CASE WHEN u.receipt_write THEN NULL
                                            ELSE m.receipt_stale_since END,
                 confirmations = coalesce(u.confirmations, m.confirmations),
                 required_confirmations = coalesce(u.required, m.required_confirmations),
                 nonce_released = m.nonce_released OR $18,
                 {clear_hold}
                 fencing_token = $5,
                 updated_at = now()
             FROM u{prev_from}
             WHERE m.tx_id = u.tx_id AND {SIGNER_ROW} {prev_join}
               AND m.state = ANY($17::text[])
               AND (u.expect_nonce IS NULL OR m.nonce = u.expect_nonce)
               AND EXISTS (SELECT 1 FROM fence_ok)
             RETURNING m.tx_id, m.nonce, {prev_col} AS prev, u.event_id, u.event_type, u.event),
         released AS (
             INSERT INTO recycled_nonces (chain_id, signer, nonce, released_at)
             SELECT $2, $3, nonce, clock_timestamp() FROM landed WHERE $18 AND nonce IS NOT NULL
             ON CONFLICT (chain_id, signer, nonce) DO NOTHING),
         {audit}
         SELECT tx_id, nonce, prev FROM landed UNION ALL SELECT NULL, NULL, NULL FROM fence_ok"
    );
    let out: Vec<(Option<Uuid>, Option<i64>, Option<String>)> = w
        .fetch_all(m.name, &sql, |q| {
            q.bind(ids)
                .bind(event_ids)
                .bind(event_types)
                .bind(events)
                .bind(nonces)
                .bind(payloads)
                .bind(codes)
                .bind(reasons)
                .bind(approvers)
                .bind(expect)
                .bind(m.to.as_str())
                .bind(m.from_names())
                .bind(releases)
                .bind(ANNOUNCED)
                .bind(receipt_writes)
                .bind(receipts)
                .bind(block_numbers)
                .bind(block_hashes)
                .bind(lists)
                .bind(required)
        })
        .await?;
    count_transitions(m, &out);
    landed_or_fenced(
        w,
        m.name,
        out.into_iter().map(|(t, n, _)| t.map(|t| (t, n))),
    )
}

/// `fsm.transition{from,to}` for the rows a move's statement moved (counted when the statement
/// lands: a transaction rolled back afterwards, which is rare — a lease lost at commit, or an
/// optimistic batch that a failing signer made the runtime run again guarded — is counted all
/// the same).
fn count_transitions(m: Move, out: &[(Option<Uuid>, Option<i64>, Option<String>)]) {
    let metrics = crate::metrics::get();
    if let [from] = m.from {
        let n = out.iter().filter(|(t, _, _)| t.is_some()).count();
        metrics.fsm_transition(*from, m.to, n as u64);
        return;
    }
    let mut by_from: std::collections::BTreeMap<TxState, u64> = Default::default();
    for (_, _, prev) in out.iter().filter(|(t, _, _)| t.is_some()) {
        if let Some(from) = prev.as_deref().and_then(|p| TxState::parse(p).ok()) {
            *by_from.entry(from).or_default() += 1;
        }
    }
    for (from, n) in by_from {
        metrics.fsm_transition(from, m.to, n);
    }
}

/// The ids a fenced statement of the sentinel shape returned (`SELECT tx_id FROM … UNION ALL
/// SELECT NULL FROM fence_ok`: the rows it wrote, and a NULL row when the lease is current), or
/// `Fenced` when the sentinel row is missing. A statement that wrote nothing under a current lease
/// returns no ids, not an error.
pub fn ids_or_fenced(
    w: &Fenced<'_>,
    operation: &'static str,
    rows: Vec<(Option<Uuid>,)>,
) -> Result<Vec<Uuid>, FenceError> {
    if !rows.iter().any(|(id,)| id.is_none()) {
        return Err(w.fenced(operation));
    }
    Ok(rows.into_iter().filter_map(|(id,)| id).collect())
}

/// The landed rows, or `Fenced` when the sentinel row of `fence_ok` is missing.
fn landed_or_fenced(
    w: &Fenced<'_>,
    operation: &'static str,
    rows: impl Iterator<Item = Option<(Uuid, Option<i64>)>>,
) -> Result<Vec<Landed>, FenceError> {
    let mut fence_ok = false;
    let mut landed = Vec::new();
    for r in rows {
        match r {
            Some((tx_id, nonce)) => landed.push(Landed { tx_id, nonce }),
            None => fence_ok = true,
        }
    }
    if fence_ok {
        Ok(landed)
    } else {
        Err(w.fenced(operation))
    }
}

/// Like [`apply`], for a move every row must make (the caller locked or just read them under
/// the lease): if a row did not move, nothing applies and the answer is `Moved` (a
/// compare-and-set miss, retried after reading again), never `Fenced` — the lease is current.
pub async fn apply_all(
    w: &mut Fenced<'_>,
    m: Move,
    rows: &[MoveRow],
) -> Result<Vec<Landed>, FenceError> {
    let landed = apply(w, m, rows).await?;
    if landed.len() != rows.len() {
        return Err(FenceError::Moved {
            operation: m.name,
            expected: rows.len(),
            moved: rows.len() - landed.len(),
        });
    }
    Ok(landed)
}

/// The stored audit payloads of `event_type` for these transactions, newest last: what a
/// redelivered message re-emits (same `event_id`).
pub async fn stored_events(
    w: &mut Fenced<'_>,
    tx_ids: &[Uuid],
    event_type: &str,
) -> Result<Vec<(Uuid, serde_json::Value)>, FenceError> {
    w.read(
        "stored events",
        sqlx::query_as(
            "SELECT tx_id, payload FROM tx_events WHERE tx_id = ANY($1) AND type = $2
             ORDER BY created_at, event_id",
        )
        .bind(tx_ids.to_vec())
        .bind(event_type.to_string()),
    )
    .await
}

/// Records the trace context of new transactions (`(tx_id, traceparent)`), where none is
/// recorded yet: the stage runtime's part in the batch that created them, while traces are
/// exported (migration 0011). Fenced like every write of `managed_tx`; rows already carrying one
/// are left alone, so this never fails for them.
pub async fn record_traces(w: &mut Fenced<'_>, rows: &[(Uuid, String)]) -> Result<(), FenceError> {
    if rows.is_empty() {
        return Ok(());
    }
    let (ids, traceparents): (Vec<Uuid>, Vec<String>) = rows.iter().cloned().unzip();
    let sql = format!(
        "UPDATE managed_tx m SET traceparent = t.traceparent
         FROM unnest($6::uuid[], $7::text[]) AS t(tx_id, traceparent)
         WHERE m.tx_id = t.tx_id AND m.chain_id = $2 AND m.signer = $3
           AND m.traceparent IS NULL AND {FENCE_PREDICATE}
         RETURNING m.tx_id"
    );
    w.fetch_all::<(Uuid,)>("record traces", &sql, |q| q.bind(ids).bind(traceparents))
        .await?;
    Ok(())
}

/// The recorded trace contexts of `tx_ids` (those that have one): what the spans of a drive's
/// outputs continue.
pub async fn traceparents(
    pool: &PgPool,
    tx_ids: &[Uuid],
) -> Result<Vec<(Uuid, String)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT tx_id, traceparent FROM managed_tx
         WHERE tx_id = ANY($1) AND traceparent IS NOT NULL",
    )
    .bind(tx_ids.to_vec())
    .fetch_all(pool)
    .await
}

/// The state names of `states`, as bound to `state = ANY($n)`.
pub fn names(states: &[TxState]) -> Vec<&'static str> {
    states.iter().map(|s| s.as_str()).collect()
}

/// The open states: a transaction on its way to the chain, before a receipt. The predicate of
/// the partial index `managed_tx_open_idx` (migration 0010), which every periodic query by state
/// reads, so that its cost does not grow with the final rows (CONFIRMED, FAILED, settled
/// REVERTED) that make up nearly all of `managed_tx` after a while. From a receipt on, the
/// confirmation manager follows a transaction through `managed_tx_followed_idx` (0007).
pub const OPEN: [TxState; 7] = [
    TxState::Received,
    TxState::Simulated,
    TxState::PendingApproval,
    TxState::Allocated,
    TxState::Signed,
    TxState::Submitted,
    TxState::Replaced,
];

/// `{column} IN ('A', 'B')`: `states` written as SQL literals (from [`TxState::as_str`]), for a
/// query that must read a partial index (`managed_tx_open_idx`, with states among [`OPEN`]).
/// A bound parameter (`state = ANY($n)`) would not do: the generic plan of a prepared statement,
/// which PostgreSQL may choose from the sixth execution on, cannot prove from an unknown value
/// that the index's predicate holds, and reads the chain's every row instead.
pub fn state_in(column: &str, states: &[TxState]) -> String {
    if states.is_empty() {
        return "false".to_string();
    }
    let names: Vec<String> = states.iter().map(|s| format!("'{}'", s.as_str())).collect();
    format!("{column} IN ({})", names.join(", "))
}

/// The signers of `chain_id` with transactions in any of `states` (among [`OPEN`]): what most
/// stages' recovery scans look for.
pub async fn signers_in_states(
    pool: &PgPool,
    chain_id: ChainId,
    states: &[TxState],
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT DISTINCT chain_id, signer FROM managed_tx WHERE chain_id = $1 AND {}",
        state_in("state", states)
    ))
    .bind(chain_id.0)
    .fetch_all(pool)
    .await?;
    Ok(signer_keys(rows))
}

/// `(chain_id, signer)` rows as read from PostgreSQL, typed; a signer that is not an address
/// (the table's CHECK keeps them out) is skipped.
pub fn signer_keys(rows: Vec<(i64, String)>) -> Vec<(ChainId, Signer)> {
    rows.into_iter()
        .filter_map(|(c, s)| Signer::parse(&s).ok().map(|s| (ChainId(c), s)))
        .collect()
}

/// A transaction row as the stages read it.
#[derive(Debug, Clone)]
pub struct TxRow {
    pub tx_id: Uuid,
    pub request_id: String,
    pub kind: Kind,
    pub state: TxState,
    pub nonce: Option<i64>,
    pub payload: serde_json::Value,
    pub approved_by: Option<String>,
}

/// The columns of [`ROW_COLUMNS`] as read, before [`typed`] checks them. A store that reads more
/// columns beside them in one statement reads it `#[sqlx(flatten)]` in its own row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct RawRow {
    pub tx_id: Uuid,
    pub request_id: String,
    pub kind: String,
    pub state: String,
    pub nonce: Option<i64>,
    pub payload: serde_json::Value,
    pub approved_by: Option<String>,
}

/// A row whose state or kind this binary does not know: a corrupt row or a newer schema.
#[derive(Debug, thiserror::Error)]
#[error("transaction {tx_id}: {what}")]
pub struct CorruptRow {
    pub tx_id: Uuid,
    pub what: String,
}

/// A row as read ([`RawRow`]) as a [`TxRow`], or `CorruptRow` for a state or kind this binary
/// does not know.
pub fn typed(r: RawRow) -> Result<TxRow, CorruptRow> {
    let corrupt = |what: String| CorruptRow {
        tx_id: r.tx_id,
        what,
    };
    let state = TxState::parse(&r.state).map_err(|e| corrupt(e.to_string()))?;
    let kind = match r.kind.as_str() {
        "REQUEST" => Kind::Request,
        "NOOP" => Kind::Noop,
        other => return Err(corrupt(format!("unknown kind {other:?}"))),
    };
    Ok(TxRow {
        tx_id: r.tx_id,
        request_id: r.request_id,
        kind,
        state,
        nonce: r.nonce,
        payload: r.payload,
        approved_by: r.approved_by,
    })
}

/// The columns of a [`TxRow`], as [`RawRow`] names them.
pub const ROW_COLUMNS: &str = "tx_id, request_id, kind, state, nonce, payload, approved_by";

/// Errors of the typed reads.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Fence(#[from] FenceError),
    #[error("database error reading transactions")]
    Db(#[source] sqlx::Error),
    #[error(transparent)]
    Corrupt(#[from] CorruptRow),
}

impl crate::retry::Classify for ReadError {
    fn retry(&self) -> crate::retry::Retry {
        match self {
            ReadError::Fence(e) => e.retry(),
            ReadError::Db(_) => crate::retry::Retry::Transient,
            ReadError::Corrupt(_) => crate::retry::Retry::Permanent,
        }
    }
}

/// The signer's transactions in `states` (among [`OPEN`]), oldest first (or in nonce order),
/// outside any transaction: what a drive works on.
pub async fn rows_in_states(
    pool: &PgPool,
    chain_id: ChainId,
    signer: &Signer,
    states: &[TxState],
    by_nonce: bool,
    limit: i64,
) -> Result<Vec<TxRow>, ReadError> {
    let order = if by_nonce {
        "nonce, created_at"
    } else {
        "created_at, tx_id"
    };
    let raw: Vec<RawRow> = sqlx::query_as(&format!(
        "SELECT {ROW_COLUMNS} FROM managed_tx
         WHERE chain_id = $1 AND signer = $2 AND {} ORDER BY {order} LIMIT $3",
        state_in("state", states)
    ))
    .bind(chain_id.0)
    .bind(signer.as_str())
    .bind(limit)
    .fetch_all(pool)
    .await
    .map_err(ReadError::Db)?;
    Ok(raw.into_iter().map(typed).collect::<Result<_, _>>()?)
}

/// These transactions of the writer's signer, locked for the rest of the transaction (so that
/// an event and the recovery scan never act on the same row at once).
pub async fn lock_rows(w: &mut Fenced<'_>, tx_ids: &[Uuid]) -> Result<Vec<TxRow>, ReadError> {
    let key = w.lease().key().clone();
    let raw: Vec<RawRow> = w
        .read(
            "lock rows",
            sqlx::query_as(&format!(
                "SELECT {ROW_COLUMNS} FROM managed_tx m
                 WHERE tx_id = ANY($1) AND {SIGNER_ROW} ORDER BY nonce, tx_id FOR UPDATE"
            ))
            .bind(tx_ids.to_vec())
            .bind(key.chain_id.0)
            .bind(key.signer.as_str().to_string()),
        )
        .await?;
    Ok(raw.into_iter().map(typed).collect::<Result<_, _>>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_are_written_as_the_literals_a_partial_index_predicate_matches() {
        assert_eq!(
            state_in("m.state", &[TxState::Signed, TxState::Submitted]),
            "m.state IN ('SIGNED', 'SUBMITTED')"
        );
        assert_eq!(state_in("state", &[]), "false", "no state: no row");
    }
}
