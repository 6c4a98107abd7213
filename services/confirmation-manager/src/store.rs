//! The confirmation manager's SQL: one named function per transition, each set-based, on the
//! fenced writer; the reads of a drive, outside any transaction.
//!
//! State changes and announcements are the state machine's named moves through `txstore` (which
//! writes the `tx_events` row, announced or not, and the receipt columns); this module adds the
//! confirmation bookkeeping of migration 0007 (`confirmations`, `required_confirmations`,
//! `confirmed_at`, `watch_until_block`, `reorged_at`, `reorg_generation`) and, after a reorg, the
//! broadcaster's resubmission schedule of the latest attempt — fenced, in the same transaction.
//! State names come from [`TxState`]: bound, or written out by `txstore::state_in` where a
//! partial index must serve the query (migration 0010).

use sqlx::PgPool;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::fenced::{FENCE_PREDICATE, FenceError, Fenced, SIGNER_ROW};
use txflow_core::lease::LeaseKey;
use txflow_core::state::{Move, TxState};
use txflow_core::txstore::{self, MoveRow};
use uuid::Uuid;

/// The states the confirmation manager follows.
pub const FOLLOWED: [TxState; 3] = [TxState::Mined, TxState::Reverted, TxState::Confirmed];

/// The states of a signer's transactions that hold a nonce and are not mined yet.
pub const UNMINED: [TxState; 3] = [TxState::Allocated, TxState::Signed, TxState::Submitted];

/// How many followed transactions of a signer one drive reads.
pub const DRIVE_LIMIT: i64 = 1000;

/// The condition on `managed_tx m` of a followed transaction: mined (a receipt) and not final
/// yet, final and still watched, or undone by a deep reorg — the predicate of the partial index
/// `managed_tx_followed_idx`, written as the migration writes it — and in one of the followed
/// states, bound as `$states`.
fn followed_where(states: usize) -> String {
    format!(
        "((m.mined_block_number IS NOT NULL AND m.confirmed_at IS NULL)
          OR m.watch_until_block IS NOT NULL OR m.reorged_at IS NOT NULL)
         AND m.state = ANY(${states})"
    )
}

/// A followed transaction, as a drive reads it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Followed {
    pub tx_id: Uuid,
    pub request_id: String,
    /// `managed_tx.state`, as stored (parsed by the handler).
    pub state: String,
    pub nonce: i64,
    pub mined_block_number: Option<i64>,
    pub mined_block_hash: Option<String>,
    /// The mined attempt's hash (the receipt's), else the latest attempt's.
    pub tx_hash: Option<String>,
    /// The list last announced, as stored.
    pub confirmations: Option<serde_json::Value>,
    pub settled: bool,
    pub watch_until_block: Option<i64>,
    pub reorged: bool,
    pub reorg_generation: i32,
    /// Why it reverted (`managed_tx.receipt`'s `revert_reason`, as the receipt checker read it).
    pub revert_reason: Option<String>,
    /// The lowest nonce of the signer's transactions that hold one and are not mined yet
    /// ([`UNMINED`]), read in the same statement (so from the same snapshot) as the rows: the
    /// same on every row.
    pub lowest_unmined: Option<i64>,
}

/// The signer's followed transactions, in nonce order, each with the signer's lowest unmined
/// nonce (one lookup of the open-state index per statement).
pub async fn followed(pool: &PgPool, key: &LeaseKey) -> Result<Vec<Followed>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT m.tx_id, m.request_id, m.state, m.nonce, m.mined_block_number, m.mined_block_hash,
                coalesce(m.receipt->>'tx_hash',
                         (SELECT a.tx_hash FROM tx_attempts a WHERE a.tx_id = m.tx_id
                          ORDER BY a.attempt DESC LIMIT 1)) AS tx_hash,
                m.confirmations, m.confirmed_at IS NOT NULL AS settled, m.watch_until_block,
                m.reorged_at IS NOT NULL AS reorged, m.reorg_generation,
                m.receipt->>'revert_reason' AS revert_reason,
                (SELECT min(u.nonce) FROM managed_tx u
                  WHERE u.chain_id = $1 AND u.signer = $2 AND {unmined}) AS lowest_unmined
         FROM managed_tx m
         WHERE m.chain_id = $1 AND m.signer = $2 AND m.nonce IS NOT NULL AND {followed}
         ORDER BY m.nonce, m.tx_id LIMIT $4",
        unmined = txstore::state_in("u.state", &UNMINED),
        followed = followed_where(3)
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(txstore::names(&FOLLOWED))
    .bind(DRIVE_LIMIT)
    .fetch_all(pool)
    .await
}

/// One attempt of a transaction: its hash and signed bytes.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Attempt {
    pub tx_id: Uuid,
    pub attempt: i32,
    pub tx_hash: String,
    pub raw_tx: Vec<u8>,
}

/// Every attempt of these transactions, latest first per transaction.
pub async fn attempts(pool: &PgPool, tx_ids: &[Uuid]) -> Result<Vec<Attempt>, sqlx::Error> {
    if tx_ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_as(
        "SELECT tx_id, attempt, tx_hash, raw_tx FROM tx_attempts WHERE tx_id = ANY($1)
         ORDER BY tx_id, attempt DESC",
    )
    .bind(tx_ids.to_vec())
    .fetch_all(pool)
    .await
}

/// The hash of the signer's defensive cancellation of `nonce` (migration 0009), if one was
/// signed.
pub async fn cancellation_hash(
    pool: &PgPool,
    key: &LeaseKey,
    nonce: i64,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT tx_hash FROM tx_cancellations WHERE chain_id = $1 AND signer = $2 AND nonce = $3",
    )
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(nonce)
    .fetch_optional(pool)
    .await
}

/// The signers of `chain_id` with followed transactions.
pub async fn pending_signers(
    pool: &PgPool,
    chain_id: ChainId,
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT DISTINCT m.chain_id, m.signer FROM managed_tx m
         WHERE m.chain_id = $1 AND {}",
        followed_where(2)
    ))
    .bind(chain_id.0)
    .bind(txstore::names(&FOLLOWED))
    .fetch_all(pool)
    .await?;
    Ok(txstore::signer_keys(rows))
}

/// A transaction a message asks about, as the handler reads it in its transaction.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Asked {
    pub tx_id: Uuid,
    pub state: String,
    pub settled: bool,
    pub reorged: bool,
}

/// These transactions of the writer's signer.
pub async fn asked(w: &mut Fenced<'_>, tx_ids: &[Uuid]) -> Result<Vec<Asked>, FenceError> {
    let key = w.lease().key().clone();
    let sql = format!(
        "SELECT tx_id, state, confirmed_at IS NOT NULL AS settled, reorged_at IS NOT NULL AS reorged
         FROM managed_tx m WHERE tx_id = ANY($1) AND {SIGNER_ROW}"
    );
    w.read(
        "asked",
        sqlx::query_as(&sql)
            .bind(tx_ids.to_vec())
            .bind(key.chain_id.0)
            .bind(key.signer.as_str().to_string()),
    )
    .await
}

/// What a drive records for one transaction besides its move: the confirmation bookkeeping.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bookkeeping {
    pub tx_id: Uuid,
    /// The list announced with the move (`managed_tx.confirmations`, the JSON of a
    /// `Vec<BlockRef>`); `None` keeps it.
    pub announced: Option<serde_json::Value>,
    /// Final now: `confirmed_at` set, watched until this block, no longer re-evaluated.
    pub finished_watch_until: Option<i64>,
    /// No longer watched (`watch_until_block` cleared).
    pub unwatch: bool,
    /// A deep reorg undid it: re-evaluated from now on (`reorged_at`), its generation raised.
    pub park: bool,
    /// Re-evaluated and settled without being final again: `reorged_at` and `watch_until_block`
    /// cleared (a revert whose nonce another transaction consumed at depth: its outcome stands,
    /// it has no block to watch, and it is no longer followed).
    pub unpark: bool,
    /// Undone for good (back to RECEIVED): no longer final, watched nor re-evaluated
    /// (`confirmed_at`, `watch_until_block`, `reorged_at` cleared).
    pub undone: bool,
}

/// Applies `m` to `rows`; returns the ids of the rows that moved.
pub async fn apply(w: &mut Fenced<'_>, m: Move, rows: &[MoveRow]) -> Result<Vec<Uuid>, FenceError> {
    Ok(txstore::apply(w, m, rows)
        .await?
        .into_iter()
        .map(|l| l.tx_id)
        .collect())
}

/// Records the bookkeeping of these transactions (all of them just moved under this lease:
/// none touched is `Fenced`).
pub async fn bookkeeping(
    w: &mut Fenced<'_>,
    rows: &[Bookkeeping],
    required: u32,
) -> Result<(), FenceError> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.tx_id).collect();
    let lists: Vec<Option<serde_json::Value>> = rows.iter().map(|r| r.announced.clone()).collect();
    let finished: Vec<Option<i64>> = rows.iter().map(|r| r.finished_watch_until).collect();
    let unwatch: Vec<bool> = rows.iter().map(|r| r.unwatch).collect();
    let park: Vec<bool> = rows.iter().map(|r| r.park).collect();
    let unpark: Vec<bool> = rows.iter().map(|r| r.unpark).collect();
    let undone: Vec<bool> = rows.iter().map(|r| r.undone).collect();
    let sql = format!(
        "UPDATE managed_tx m SET
             confirmations = coalesce(u.list, m.confirmations),
             required_confirmations = CASE WHEN u.list IS NULL AND u.finished IS NULL
                                           THEN m.required_confirmations ELSE $13 END,
             confirmed_at = CASE WHEN u.finished IS NOT NULL THEN clock_timestamp()
                                 WHEN u.undone THEN NULL ELSE m.confirmed_at END,
             watch_until_block = CASE WHEN u.finished IS NOT NULL THEN u.finished
                                      WHEN u.unwatch OR u.unpark OR u.undone THEN NULL
                                      ELSE m.watch_until_block END,
             reorged_at = CASE WHEN u.park THEN clock_timestamp()
                               WHEN u.finished IS NOT NULL OR u.unpark OR u.undone THEN NULL
                               ELSE m.reorged_at END,
             reorg_generation = m.reorg_generation + CASE WHEN u.park THEN 1 ELSE 0 END
         FROM unnest($6::uuid[], $7::jsonb[], $8::bigint[], $9::boolean[], $10::boolean[],
                     $11::boolean[], $12::boolean[])
                AS u(tx_id, list, finished, unwatch, park, unpark, undone)
         WHERE m.tx_id = u.tx_id AND {SIGNER_ROW} AND {FENCE_PREDICATE}"
    );
    let touched = w
        .execute("confirmations", &sql, |q| {
            q.bind(ids)
                .bind(lists)
                .bind(finished)
                .bind(unwatch)
                .bind(park)
                .bind(unpark)
                .bind(undone)
                .bind(i32::try_from(required).unwrap_or(i32::MAX))
        })
        .await?;
    if touched != rows.len() as u64 {
        return Err(w.fenced("confirmations"));
    }
    Ok(())
}

/// The latest attempt of each of these transactions is due for the broadcaster's resubmission
/// after `after`: a reorg sent them back to SUBMITTED (the confirmation manager sends them once
/// itself). None touched is `Fenced`.
pub async fn resubmit_after(
    w: &mut Fenced<'_>,
    tx_ids: &[Uuid],
    after: std::time::Duration,
) -> Result<(), FenceError> {
    if tx_ids.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "UPDATE tx_attempts a SET next_resubmit_at = now() + $7 * interval '1 millisecond'
         WHERE (a.tx_id, a.attempt) IN (SELECT tx_id, max(attempt) FROM tx_attempts
                                        WHERE tx_id = ANY($6) GROUP BY tx_id)
           AND {FENCE_PREDICATE}"
    );
    w.execute("resubmit after reorg", &sql, |q| {
        q.bind(tx_ids.to_vec())
            .bind(i64::try_from(after.as_millis()).unwrap_or(i64::MAX))
    })
    .await
    .map(|_| ())
}
