//! The receipt checker's SQL: one named function per transition, each set-based, on the fenced
//! writer; the reads of a drive, outside any transaction.
//!
//! State changes are the state machine's named moves through `txstore`: MINE and REVERT write the
//! receipt columns in the same statement ([`ReceiptWrite::Set`]), REPLACE clears them. This module
//! adds only the schedule of the lookups (`next_receipt_check_at`, `receipt_stale_since`) and the
//! end of the moved transactions' resubmissions (`tx_attempts.next_resubmit_at`), fenced, in the
//! same transaction. State names come from [`TxState`]: bound, or written out by
//! `txstore::state_in` where a partial index must serve the query (migration 0010).

use std::time::Duration;

use sqlx::PgPool;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::fenced::{FENCE_PREDICATE, FenceError, Fenced, SIGNER_ROW};
use txflow_core::lease::LeaseKey;
use txflow_core::state::{MINE, Move, REPLACE, REVERT, TxState};
use txflow_core::txstore::{self, MinedReceipt, MoveRow, ReceiptWrite};
use uuid::Uuid;

use crate::decide::StaleMark;

/// How many due transactions of one signer a drive looks up (the next scan takes the rest).
pub const DUE_LIMIT: i64 = 500;

/// A SUBMITTED transaction due to be looked up, with every attempt's hash, newest first.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DueRow {
    pub tx_id: Uuid,
    pub nonce: Option<i64>,
    /// `TxMined` / `TxReverted` rows recorded before (a reorg sent it back to SUBMITTED).
    pub receipts_before: i64,
    /// Milliseconds since its last move (submission, resubmission, reorg).
    pub since_move_ms: i64,
    /// Milliseconds since the receipt checker first saw the signer's nonce past this one with no
    /// receipt; `None` when it has not.
    pub stale_ms: Option<i64>,
    pub attempts: Option<Vec<i32>>,
    pub hashes: Option<Vec<String>>,
    /// `managed_tx.payload`: the call (to, value, data), replayed at its block when it reverted
    /// to read why.
    pub payload: serde_json::Value,
    /// The broadcaster stopped sending its latest attempt again (`next_resubmit_at` NULL: it saw
    /// the chain's nonce past this one). A reorg can bring the chain's nonce back below it.
    pub resubmit_stopped: bool,
}

/// One row of a transition: the transaction and its audit event (`tx_events.type` is the move's
/// event; an announced one holds the event it announces).
#[derive(Debug, Clone)]
pub struct Row {
    pub tx_id: Uuid,
    pub event_id: Uuid,
    /// The audit payload: the JSON of the event.
    pub event: serde_json::Value,
}

/// A receipt to record: the row, and the receipt with its block (`managed_tx.receipt` holds a
/// [`StoredReceipt`](crate::decide::StoredReceipt)).
#[derive(Debug, Clone)]
pub struct Mined {
    pub row: Row,
    pub receipt: MinedReceipt,
}

/// When one transaction is looked up again, and what becomes of its stale mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub tx_id: Uuid,
    pub after: Duration,
    pub mark: StaleMark,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn landed(rows: Vec<txstore::Landed>) -> Vec<Uuid> {
    rows.into_iter().map(|l| l.tx_id).collect()
}

async fn record(w: &mut Fenced<'_>, m: Move, rows: &[&Mined]) -> Result<Vec<Uuid>, FenceError> {
    let moves: Vec<MoveRow> = rows
        .iter()
        .map(|r| MoveRow {
            receipt: ReceiptWrite::Set(r.receipt.clone()),
            ..MoveRow::new(r.row.tx_id, r.row.event_id, r.row.event.clone())
        })
        .collect();
    Ok(landed(txstore::apply(w, m, &moves).await?))
}

/// SUBMITTED → MINED ([`MINE`], status 1) for `mined` and SUBMITTED → REVERTED ([`REVERT`],
/// status 0) for `reverted`, each with its receipt, in one statement per move. Returns the rows
/// that moved; a row no longer SUBMITTED is left alone.
pub async fn mine_and_revert(
    w: &mut Fenced<'_>,
    mined: &[&Mined],
    reverted: &[&Mined],
) -> Result<Vec<Uuid>, FenceError> {
    let mut moved = record(w, MINE, mined).await?;
    moved.extend(record(w, REVERT, reverted).await?);
    Ok(moved)
}

/// SUBMITTED → REPLACED ([`REPLACE`]): the nonce was used by a transaction txflow did not send
/// (proven). The receipt columns and the schedule are cleared: the allocator gives it a fresh
/// nonce and it is looked up anew once submitted again. Returns the rows that moved.
pub async fn replace(w: &mut Fenced<'_>, rows: &[Row]) -> Result<Vec<Uuid>, FenceError> {
    let moves: Vec<MoveRow> = rows
        .iter()
        .map(|r| MoveRow {
            receipt: ReceiptWrite::Clear,
            ..MoveRow::new(r.tx_id, r.event_id, r.event.clone())
        })
        .collect();
    Ok(landed(txstore::apply(w, REPLACE, &moves).await?))
}

/// Ends the resubmission of these transactions' attempts (`tx_attempts.next_resubmit_at`, the
/// broadcaster's schedule): mined, reverted or replaced, no attempt of theirs is sent again. Rows
/// already ended are left alone; `Fenced` when the lease is not current.
pub async fn end_resubmissions(w: &mut Fenced<'_>, tx_ids: &[Uuid]) -> Result<(), FenceError> {
    if tx_ids.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
         done AS (
             UPDATE tx_attempts SET next_resubmit_at = NULL
             WHERE tx_id = ANY($6) AND next_resubmit_at IS NOT NULL
               AND EXISTS (SELECT 1 FROM fence_ok)
             RETURNING tx_id)
         SELECT tx_id FROM done UNION ALL SELECT NULL FROM fence_ok"
    );
    let out: Vec<(Option<Uuid>,)> = w
        .fetch_all("end resubmissions", &sql, |q| q.bind(tx_ids.to_vec()))
        .await?;
    txstore::ids_or_fenced(w, "end resubmissions", out).map(|_| ())
}

/// Sends the latest attempt of these SUBMITTED transactions again (due now, on the broadcaster's
/// schedule): the chain's nonce is not past theirs and nothing sends them — the broadcaster
/// stopped when it saw the nonce passed, and a reorg took the block that had passed it (nodes do
/// not put a reorged transaction back in their pool). Without it their nonce is a gap every later
/// nonce of the signer queues behind. Attempts already due are left alone; `Fenced` when the
/// lease is not current.
pub async fn rearm_resubmissions(w: &mut Fenced<'_>, tx_ids: &[Uuid]) -> Result<(), FenceError> {
    if tx_ids.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
         latest AS (
             SELECT DISTINCT ON (tx_id) tx_id, attempt FROM tx_attempts
             WHERE tx_id = ANY($6) ORDER BY tx_id, attempt DESC),
         done AS (
             UPDATE tx_attempts a SET next_resubmit_at = now()
             FROM latest l
             WHERE a.tx_id = l.tx_id AND a.attempt = l.attempt AND a.next_resubmit_at IS NULL
               AND EXISTS (SELECT 1 FROM fence_ok)
             RETURNING a.tx_id)
         SELECT tx_id FROM done UNION ALL SELECT NULL FROM fence_ok"
    );
    let out: Vec<(Option<Uuid>,)> = w
        .fetch_all("rearm resubmissions", &sql, |q| q.bind(tx_ids.to_vec()))
        .await?;
    txstore::ids_or_fenced(w, "rearm resubmissions", out).map(|_| ())
}

/// Schedules the next lookup of these SUBMITTED transactions (no state change) and sets or
/// clears their stale marks. A row no longer SUBMITTED is left alone; `Fenced` when the lease is
/// not current (a sentinel row tells the two apart).
pub async fn schedule(w: &mut Fenced<'_>, rows: &[Schedule]) -> Result<(), FenceError> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.tx_id).collect();
    let after: Vec<i64> = rows.iter().map(|r| millis(r.after)).collect();
    let marks: Vec<&str> = rows
        .iter()
        .map(|r| match r.mark {
            StaleMark::Keep => "keep",
            StaleMark::Start => "start",
            StaleMark::Clear => "clear",
        })
        .collect();
    let sql = format!(
        "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
         u AS (SELECT * FROM unnest($6::uuid[], $7::bigint[], $8::text[]) AS u(tx_id, after_ms, mark)),
         done AS (
             UPDATE managed_tx m SET
                 next_receipt_check_at = clock_timestamp() + u.after_ms * interval '1 millisecond',
                 receipt_stale_since = CASE u.mark
                     WHEN 'start' THEN coalesce(m.receipt_stale_since, clock_timestamp())
                     WHEN 'clear' THEN NULL
                     ELSE m.receipt_stale_since END
             FROM u
             WHERE m.tx_id = u.tx_id AND {SIGNER_ROW} AND m.state = $9
               AND EXISTS (SELECT 1 FROM fence_ok)
             RETURNING m.tx_id)
         SELECT tx_id FROM done UNION ALL SELECT NULL FROM fence_ok"
    );
    let out: Vec<(Option<Uuid>,)> = w
        .fetch_all("schedule receipt checks", &sql, |q| {
            q.bind(ids)
                .bind(after)
                .bind(marks)
                .bind(TxState::Submitted.as_str())
        })
        .await?;
    txstore::ids_or_fenced(w, "schedule receipt checks", out).map(|_| ())
}

/// The signer's SUBMITTED transactions due to be looked up (never looked up, or their back-off
/// over), in nonce order, at most [`DUE_LIMIT`].
pub async fn due(pool: &PgPool, key: &LeaseKey) -> Result<Vec<DueRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT m.tx_id, m.nonce,
                (SELECT count(*) FROM tx_events e
                 WHERE e.tx_id = m.tx_id AND e.type = ANY($3)) AS receipts_before,
                (extract(epoch FROM now() - m.updated_at) * 1000)::bigint AS since_move_ms,
                (extract(epoch FROM now() - m.receipt_stale_since) * 1000)::bigint AS stale_ms,
                a.attempts, a.hashes, m.payload,
                coalesce((SELECT l.next_resubmit_at IS NULL FROM tx_attempts l
                          WHERE l.tx_id = m.tx_id ORDER BY l.attempt DESC LIMIT 1), false)
                    AS resubmit_stopped
         FROM managed_tx m
         JOIN LATERAL (SELECT array_agg(attempt ORDER BY attempt DESC) AS attempts,
                              array_agg(tx_hash ORDER BY attempt DESC) AS hashes
                       FROM tx_attempts WHERE tx_id = m.tx_id) a ON true
         WHERE m.chain_id = $1 AND m.signer = $2 AND {}
           AND (m.next_receipt_check_at IS NULL OR m.next_receipt_check_at <= now())
         ORDER BY m.nonce LIMIT $4",
        txstore::state_in("m.state", &[TxState::Submitted])
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind([MINE.event, REVERT.event])
    .bind(DUE_LIMIT)
    .fetch_all(pool)
    .await
}

/// The signers of `chain_id` with SUBMITTED transactions due to be looked up: the recovery
/// scan's (rebuilt from PostgreSQL on start, on assignment and every scan).
pub async fn pending_signers(
    pool: &PgPool,
    chain_id: ChainId,
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT DISTINCT chain_id, signer FROM managed_tx
         WHERE chain_id = $1 AND {}
           AND (next_receipt_check_at IS NULL OR next_receipt_check_at <= now())",
        txstore::state_in("state", &[TxState::Submitted])
    ))
    .bind(chain_id.0)
    .fetch_all(pool)
    .await?;
    Ok(txstore::signer_keys(rows))
}
