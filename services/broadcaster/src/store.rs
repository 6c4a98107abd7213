//! The broadcaster's SQL: one named function per transition, each set-based, on the fenced
//! writer; the reads of a drive, outside any transaction.
//!
//! State changes are the state machine's named moves through `txstore` (which writes the
//! `tx_events` audit rows and, for FAILED, releases the nonce); this module adds only the
//! attempts' bookkeeping (`tx_attempts.submitted_at`, `last_submit_at`, `next_resubmit_at`),
//! fenced, in the same transaction. State names come from [`TxState`]: bound, or written out by
//! `txstore::state_in` where a partial index must serve the query (migration 0010).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use sqlx::PgPool;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::failure::FailureCode;
use txflow_core::fenced::{FENCE_PREDICATE, FenceError, Fenced};
use txflow_core::lease::LeaseKey;
use txflow_core::state::{FAIL_SIGNED, REPLACE, RESUBMIT, SUBMIT, TxState};
use txflow_core::txstore::{self, MoveRow};
use uuid::Uuid;

/// A SIGNED transaction with its latest attempt: what is sent.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SignedRow {
    pub tx_id: Uuid,
    pub nonce: i64,
    pub attempt: i32,
    pub tx_hash: String,
    pub raw_tx: Vec<u8>,
    /// The broadcaster holds the signer (`signer_holds`), as read with the rows: the same on
    /// every row (one lookup per statement).
    pub held: bool,
}

/// A SUBMITTED transaction whose latest attempt is due to be sent again.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DueRow {
    pub tx_id: Uuid,
    pub nonce: i64,
    pub attempt: i32,
    pub raw_tx: Vec<u8>,
}

/// One row of a transition: the transaction and its audit event (`tx_events.type` is the move's
/// event).
#[derive(Debug, Clone)]
pub struct Row {
    pub tx_id: Uuid,
    pub event_id: Uuid,
    /// The audit payload: the JSON of the event.
    pub event: serde_json::Value,
}

impl Row {
    fn moved(&self) -> MoveRow {
        MoveRow::new(self.tx_id, self.event_id, self.event.clone())
    }
}

/// A submission: the row and the attempt that was sent.
#[derive(Debug, Clone)]
pub struct Submit {
    pub row: Row,
    pub attempt: i32,
}

/// A refusal for good: the row and the node's reason.
#[derive(Debug, Clone)]
pub struct FailSigned {
    pub row: Row,
    pub reason: String,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// SIGNED → SUBMITTED ([`SUBMIT`]), and the sent attempt's bookkeeping: submitted (first time
/// only), last sent now, due again after `resubmit_after`. Returns the rows that moved; a row no
/// longer SIGNED is left alone.
pub async fn submit(
    w: &mut Fenced<'_>,
    rows: &[Submit],
    resubmit_after: Duration,
) -> Result<Vec<Uuid>, FenceError> {
    let moves: Vec<MoveRow> = rows.iter().map(|s| s.row.moved()).collect();
    let landed: Vec<Uuid> = txstore::apply(w, SUBMIT, &moves)
        .await?
        .into_iter()
        .map(|l| l.tx_id)
        .collect();
    if landed.is_empty() {
        return Ok(landed);
    }
    let moved: HashSet<Uuid> = landed.iter().copied().collect();
    let (ids, attempts): (Vec<Uuid>, Vec<i32>) = rows
        .iter()
        .filter(|s| moved.contains(&s.row.tx_id))
        .map(|s| (s.row.tx_id, s.attempt))
        .unzip();
    let sql = format!(
        "UPDATE tx_attempts a SET submitted_at = coalesce(a.submitted_at, now()), last_submit_at = now(),
                next_resubmit_at = now() + $8 * interval '1 millisecond'
         FROM unnest($6::uuid[], $7::int4[]) AS u(tx_id, attempt)
         WHERE a.tx_id = u.tx_id AND a.attempt = u.attempt AND {FENCE_PREDICATE}
         RETURNING a.tx_id"
    );
    w.fetch_all::<(Uuid,)>("submitted", &sql, |q| {
        q.bind(ids).bind(attempts).bind(millis(resubmit_after))
    })
    .await?;
    Ok(landed)
}

/// SIGNED → REPLACED ([`REPLACE`]): the nonce was used by a transaction txflow did not send.
/// Returns the rows that moved.
pub async fn replace(w: &mut Fenced<'_>, rows: &[Row]) -> Result<Vec<Uuid>, FenceError> {
    let moves: Vec<MoveRow> = rows.iter().map(|r| r.moved()).collect();
    Ok(txstore::apply(w, REPLACE, &moves)
        .await?
        .into_iter()
        .map(|l| l.tx_id)
        .collect())
}

/// SIGNED → FAILED ([`FAIL_SIGNED`]) with `SEND_REJECTED` and the node's reason; `txstore`
/// releases the nonce. Returns the rows that moved.
pub async fn fail_signed(w: &mut Fenced<'_>, rows: &[FailSigned]) -> Result<Vec<Uuid>, FenceError> {
    let moves: Vec<MoveRow> = rows
        .iter()
        .map(|f| MoveRow {
            failure: Some((FailureCode::SendRejected, f.reason.clone())),
            ..f.row.moved()
        })
        .collect();
    Ok(txstore::apply(w, FAIL_SIGNED, &moves)
        .await?
        .into_iter()
        .map(|l| l.tx_id)
        .collect())
}

/// SUBMITTED → SUBMITTED ([`RESUBMIT`], audited), and the attempts' bookkeeping: last sent now,
/// due again after `resubmit_after`. Returns the rows that moved.
pub async fn resubmitted(
    w: &mut Fenced<'_>,
    rows: &[Row],
    resubmit_after: Duration,
) -> Result<Vec<Uuid>, FenceError> {
    let moves: Vec<MoveRow> = rows.iter().map(|r| r.moved()).collect();
    let landed: Vec<Uuid> = txstore::apply(w, RESUBMIT, &moves)
        .await?
        .into_iter()
        .map(|l| l.tx_id)
        .collect();
    if landed.is_empty() {
        return Ok(landed);
    }
    // The attempts were due (`next_resubmit_at` set) when read under this lease: none touched is
    // `Fenced`.
    let sql = format!(
        "UPDATE tx_attempts SET last_submit_at = now(),
                next_resubmit_at = now() + $7 * interval '1 millisecond'
         WHERE tx_id = ANY($6) AND next_resubmit_at IS NOT NULL AND {FENCE_PREDICATE}"
    );
    w.execute("resubmit", &sql, |q| {
        q.bind(landed.clone()).bind(millis(resubmit_after))
    })
    .await?;
    Ok(landed)
}

/// Stops tracking the resubmission of these transactions: the chain's nonce is past theirs. No
/// state changes (the receipt decides what became of them). None touched is `Fenced`.
pub async fn passed(w: &mut Fenced<'_>, tx_ids: &[Uuid]) -> Result<(), FenceError> {
    if tx_ids.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "UPDATE tx_attempts SET next_resubmit_at = NULL
         WHERE tx_id = ANY($6) AND next_resubmit_at IS NOT NULL AND {FENCE_PREDICATE}"
    );
    w.execute("resubmit", &sql, |q| q.bind(tx_ids.to_vec()))
        .await
        .map(|_| ())
}

/// The request ids of these transactions, in the writer's transaction.
pub async fn request_ids(
    w: &mut Fenced<'_>,
    tx_ids: &[Uuid],
) -> Result<HashMap<Uuid, String>, FenceError> {
    if tx_ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<(Uuid, String)> = w
        .read(
            "refused",
            sqlx::query_as("SELECT tx_id, request_id FROM managed_tx WHERE tx_id = ANY($1)")
                .bind(tx_ids.to_vec()),
        )
        .await?;
    Ok(rows.into_iter().collect())
}

/// The signer's SIGNED transactions in nonce order, each with its latest attempt.
pub async fn signed_rows(pool: &PgPool, key: &LeaseKey) -> Result<Vec<SignedRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT m.tx_id, m.nonce, a.attempt, a.tx_hash, a.raw_tx,
                EXISTS (SELECT 1 FROM signer_holds h
                         WHERE h.role = $3 AND h.chain_id = $1 AND h.signer = $2) AS held
         FROM managed_tx m
         JOIN LATERAL (SELECT attempt, tx_hash, raw_tx FROM tx_attempts WHERE tx_id = m.tx_id
                       ORDER BY attempt DESC LIMIT 1) a ON true
         WHERE m.chain_id = $1 AND m.signer = $2 AND {} ORDER BY m.nonce",
        txstore::state_in("m.state", &[TxState::Signed])
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(key.role.as_str())
    .fetch_all(pool)
    .await
}

/// The signer's SUBMITTED transactions whose latest attempt is due to be sent again, in nonce
/// order, at most 500.
pub async fn due_resubmissions(pool: &PgPool, key: &LeaseKey) -> Result<Vec<DueRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT m.tx_id, m.nonce, a.attempt, a.raw_tx FROM managed_tx m
         JOIN LATERAL (SELECT attempt, raw_tx, next_resubmit_at FROM tx_attempts WHERE tx_id = m.tx_id
                       ORDER BY attempt DESC LIMIT 1) a ON true
         WHERE m.chain_id = $1 AND m.signer = $2 AND {}
           AND a.next_resubmit_at <= now()
         ORDER BY m.nonce LIMIT 500",
        txstore::state_in("m.state", &[TxState::Submitted])
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .fetch_all(pool)
    .await
}

/// Every hash recorded for the transaction's attempts.
pub async fn attempt_hashes(pool: &PgPool, tx_id: Uuid) -> Result<Vec<String>, sqlx::Error> {
    let rows: Vec<(String,)> = sqlx::query_as("SELECT tx_hash FROM tx_attempts WHERE tx_id = $1")
        .bind(tx_id)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(|(h,)| h).collect())
}

/// The signers of `chain_id` with work for the broadcaster: SIGNED transactions to send,
/// SUBMITTED ones with a resubmission due, or a defensive cancellation due.
pub async fn pending_signers(
    pool: &PgPool,
    chain_id: ChainId,
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let mut signers = txstore::signers_in_states(pool, chain_id, &[TxState::Signed]).await?;
    let due: Vec<(i64, String)> = sqlx::query_as(
        // Due attempts first (the partial index on next_resubmit_at), then their rows by key:
        // the join order does not depend on the planner's statistics.
        "WITH due AS MATERIALIZED (
             SELECT DISTINCT tx_id FROM tx_attempts
             WHERE next_resubmit_at IS NOT NULL AND next_resubmit_at <= now())
         SELECT DISTINCT m.chain_id, m.signer FROM due JOIN managed_tx m ON m.tx_id = due.tx_id
         WHERE m.chain_id = $1 AND m.state = $2",
    )
    .bind(chain_id.0)
    .bind(TxState::Submitted.as_str())
    .fetch_all(pool)
    .await?;
    let cancelling: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT DISTINCT m.chain_id, m.signer {CANCELLATION_DUE} AND m.chain_id = $1"
    ))
    .bind(chain_id.0)
    .bind(txstore::names(&VOIDED))
    .fetch_all(pool)
    .await?;
    for (chain_id, signer) in due.into_iter().chain(cancelling) {
        if let Ok(s) = Signer::parse(&signer) {
            let key = (ChainId(chain_id), s);
            if !signers.contains(&key) {
                signers.push(key);
            }
        }
    }
    Ok(signers)
}

// ---- The defensive cancellation (seed 000 §4.4, migration 0009) ----

/// The states of a final transaction whose nonce a defensive cancellation voids once a deep reorg
/// undid it.
pub const VOIDED: [TxState; 2] = [TxState::Confirmed, TxState::Reverted];

/// The cancellations due (`c`, with the transaction `m` whose nonce they void; states bound as
/// `$2`): the transaction is still final and being re-evaluated after a deep reorg
/// (`reorged_at`), not mined again, holding that nonce, and the cancellation's next look is due.
/// Once the transaction is mined again, settled again or undone, its cancellation is no longer
/// sent.
const CANCELLATION_DUE: &str = "FROM managed_tx m
     JOIN tx_cancellations c ON c.chain_id = m.chain_id AND c.signer = m.signer AND c.nonce = m.nonce
     WHERE m.reorged_at IS NOT NULL AND m.mined_block_number IS NULL AND m.state = ANY($2)
       AND (c.next_send_at IS NULL OR c.next_send_at <= now())";

/// A defensive cancellation due to be sent.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DueCancellation {
    /// The transaction whose nonce it voids.
    pub tx_id: Uuid,
    pub nonce: i64,
    pub tx_hash: String,
    pub raw_tx: Vec<u8>,
    /// How many sends a node took so far.
    pub sends: i32,
}

/// The signer's cancellations due, in nonce order, outside any transaction.
pub async fn due_cancellations(
    pool: &PgPool,
    key: &LeaseKey,
) -> Result<Vec<DueCancellation>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT m.tx_id, c.nonce, c.tx_hash, c.raw_tx, c.sends {CANCELLATION_DUE}
           AND m.chain_id = $1 AND m.signer = $3
         ORDER BY c.nonce LIMIT 100"
    ))
    .bind(key.chain_id.0)
    .bind(txstore::names(&VOIDED))
    .bind(key.signer.as_str())
    .fetch_all(pool)
    .await
}

/// Records that the signer's cancellations of these nonces were looked at now (`taken`: a node
/// took the send), and are due again after `after`. `Fenced` when the lease is not current.
pub async fn cancellations_looked_at(
    w: &mut Fenced<'_>,
    looked: &[(i64, bool)],
    after: Duration,
) -> Result<(), FenceError> {
    if looked.is_empty() {
        return Ok(());
    }
    let (nonces, taken): (Vec<i64>, Vec<bool>) = looked.iter().copied().unzip();
    let sql = format!(
        "UPDATE tx_cancellations c SET
             last_submit_at = now(),
             submitted_at = CASE WHEN u.taken THEN coalesce(c.submitted_at, now()) ELSE c.submitted_at END,
             sends = c.sends + CASE WHEN u.taken THEN 1 ELSE 0 END,
             next_send_at = now() + $8 * interval '1 millisecond'
         FROM unnest($6::bigint[], $7::boolean[]) AS u(nonce, taken)
         WHERE c.chain_id = $2 AND c.signer = $3 AND c.nonce = u.nonce AND {FENCE_PREDICATE}"
    );
    w.execute("cancellations sent", &sql, |q| {
        q.bind(nonces).bind(taken).bind(millis(after))
    })
    .await
    .map(|_| ())
}

/// The highest nonce the signer has sent something at: a transaction that reached a node
/// (SUBMITTED, MINED, REVERTED, CONFIRMED) or a defensive cancellation. `None`: nothing.
pub async fn highest_sent_nonce(pool: &PgPool, key: &LeaseKey) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "SELECT max(n) FROM (
             SELECT max(nonce) AS n FROM managed_tx
             WHERE chain_id = $1 AND signer = $2 AND {}
             UNION ALL
             SELECT max(nonce) FROM tx_cancellations WHERE chain_id = $1 AND signer = $2) s",
        txstore::state_in(
            "state",
            &[
                TxState::Submitted,
                TxState::Mined,
                TxState::Reverted,
                TxState::Confirmed
            ]
        )
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .fetch_one(pool)
    .await
}

/// What txflow signed for the signer's `nonce` and can send again as it is: the latest attempt
/// of the transaction holding it that reached a node (SUBMITTED, MINED, REVERTED, CONFIRMED) and
/// is not being re-evaluated after a deep reorg (its outcome is recorded as that transaction's:
/// only its own bytes may take the nonce), else the latest defensive cancellation of that nonce
/// (a deep reorg undid the transaction that held it). `(what, tx_id, raw bytes)`.
pub async fn signed_at_nonce(
    pool: &PgPool,
    key: &LeaseKey,
    nonce: i64,
) -> Result<Option<(&'static str, Uuid, Vec<u8>)>, sqlx::Error> {
    let attempt: Option<(Uuid, Vec<u8>)> = sqlx::query_as(&format!(
        "SELECT m.tx_id, a.raw_tx FROM managed_tx m
         JOIN LATERAL (SELECT raw_tx FROM tx_attempts WHERE tx_id = m.tx_id
                       ORDER BY attempt DESC LIMIT 1) a ON true
         WHERE m.chain_id = $1 AND m.signer = $2 AND m.nonce = $3 AND m.reorged_at IS NULL
           AND {}
         LIMIT 1",
        txstore::state_in(
            "m.state",
            &[
                TxState::Submitted,
                TxState::Mined,
                TxState::Reverted,
                TxState::Confirmed
            ]
        )
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(nonce)
    .fetch_optional(pool)
    .await?;
    if let Some((tx_id, raw)) = attempt {
        return Ok(Some(("transaction", tx_id, raw)));
    }
    let cancellation: Option<(Uuid, Vec<u8>)> = sqlx::query_as(
        "SELECT tx_id, raw_tx FROM tx_cancellations
         WHERE chain_id = $1 AND signer = $2 AND nonce = $3 ORDER BY created_at DESC LIMIT 1",
    )
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(nonce)
    .fetch_optional(pool)
    .await?;
    Ok(cancellation.map(|(tx_id, raw)| ("cancellation", tx_id, raw)))
}
