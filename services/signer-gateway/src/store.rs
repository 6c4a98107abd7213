//! The signer gateway's SQL: one named function per transition, on the fenced primitives of
//! `txflow_core::txstore` (which compare-and-set the state and write the audit rows), its own
//! fenced attempt rows, and the reads its handler and drive need. Set-based: each function writes
//! all of its rows with one statement.
//!
//! No state name is written here as SQL text: states are bound from `TxState`.

use std::collections::HashSet;

use sqlx::PgPool;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{TxFailed, TxSigned};
use txflow_core::failure::FailureCode;
use txflow_core::fenced::{FENCE_PREDICATE, FenceError, Fenced, SIGNER_ROW};
use txflow_core::lease::LeaseKey;
use txflow_core::retry::{Classify, Retry};
use txflow_core::stage::HandlerError;
use txflow_core::state::{FAIL_ALLOCATED, Move, SIGN, TxState};
use txflow_core::txstore::{self, MoveRow, ReadError, TxRow};
use uuid::Uuid;

use crate::decide::{Caps, Undone};

/// The states the signer gateway drives: transactions waiting for a signature.
pub const DRIVEN: [TxState; 1] = [TxState::Allocated];

/// How many ALLOCATED transactions of a signer one recovery scan signs, in nonce order.
pub const SCAN_LIMIT: i64 = 500;

/// Errors of the signer gateway's store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Fence(#[from] FenceError),
    #[error(transparent)]
    Read(#[from] ReadError),
    /// An event that cannot be written as its audit row: a bug, not a passing condition.
    #[error("the {event_type} of transaction {tx_id} cannot be encoded as JSON")]
    Encode {
        tx_id: Uuid,
        event_type: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// A stored audit row that does not parse as its event: a corrupt row or a newer schema.
    #[error("the stored {event_type} of transaction {tx_id} is not valid")]
    StoredEvent {
        tx_id: Uuid,
        event_type: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl Classify for StoreError {
    fn retry(&self) -> Retry {
        match self {
            StoreError::Fence(e) => e.retry(),
            StoreError::Read(e) => e.retry(),
            StoreError::Encode { .. } | StoreError::StoredEvent { .. } => Retry::Permanent,
        }
    }
}

/// A lost lease is `LeaseLost` (core's conversion of [`FenceError`]); everything else as its
/// classification says (a database error is retried, a corrupt row or event is a `Fail`).
impl From<StoreError> for HandlerError {
    fn from(e: StoreError) -> HandlerError {
        match e {
            StoreError::Fence(e) | StoreError::Read(ReadError::Fence(e)) => e.into(),
            other => HandlerError::classified("signer gateway store", other),
        }
    }
}

/// A signature to record: ALLOCATED → SIGNED, its attempt row, and its TxSigned as audit.
#[derive(Debug, Clone)]
pub struct Signing {
    pub tx_id: Uuid,
    pub event_id: Uuid,
    /// The announced event; its nonce, attempt, hash, raw bytes and fees are what is recorded.
    pub event: TxSigned,
}

/// A transaction that cannot be signed: ALLOCATED → FAILED with `code`, and its TxFailed as
/// audit.
#[derive(Debug, Clone)]
pub struct Failing {
    pub tx_id: Uuid,
    pub event_id: Uuid,
    pub code: FailureCode,
    /// The announced event; its nonce is the one the row must still hold, its reason is stored.
    pub event: TxFailed,
}

/// The audit row of `m` for one transaction: `encoded` is the JSON of its event.
fn encoded(
    m: Move,
    tx_id: Uuid,
    encoded: serde_json::Result<serde_json::Value>,
) -> Result<serde_json::Value, StoreError> {
    encoded.map_err(|source| StoreError::Encode {
        tx_id,
        event_type: m.event,
        source,
    })
}

/// ALLOCATED → SIGNED for the rows still ALLOCATED at the nonce they were signed with, and the
/// attempt rows of those, in the caller's transaction. Returns the rows that moved; a row that
/// moved meanwhile is left alone (no attempt is written for it).
pub async fn sign(w: &mut Fenced<'_>, rows: &[Signing]) -> Result<HashSet<Uuid>, StoreError> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let moves = rows
        .iter()
        .map(|r| {
            let mut m = MoveRow::new(
                r.tx_id,
                r.event_id,
                encoded(SIGN, r.tx_id, serde_json::to_value(&r.event))?,
            );
            m.expect_nonce = Some(r.event.nonce);
            Ok(m)
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    let landed: HashSet<Uuid> = txstore::apply(w, SIGN, &moves)
        .await?
        .into_iter()
        .map(|l| l.tx_id)
        .collect();
    let moved: Vec<&Signing> = rows.iter().filter(|r| landed.contains(&r.tx_id)).collect();
    record_attempts(w, &moved).await?;
    Ok(landed)
}

/// The attempt rows of transactions that just moved to SIGNED: one fenced statement.
async fn record_attempts(w: &mut Fenced<'_>, rows: &[&Signing]) -> Result<(), StoreError> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.tx_id).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.event.attempt).collect();
    let hashes: Vec<&str> = rows.iter().map(|r| r.event.tx_hash.as_str()).collect();
    let raws: Vec<&[u8]> = rows.iter().map(|r| r.event.raw_tx.as_slice()).collect();
    let max_fees: Vec<&str> = rows
        .iter()
        .map(|r| r.event.max_fee_per_gas.as_str())
        .collect();
    let tips: Vec<&str> = rows
        .iter()
        .map(|r| r.event.max_priority_fee_per_gas.as_str())
        .collect();
    let sql = format!(
        "INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas, max_priority_fee_per_gas)
         SELECT u.tx_id, u.attempt, u.tx_hash, u.raw_tx, u.max_fee::numeric, u.tip::numeric
         FROM unnest($6::uuid[], $7::int[], $8::text[], $9::bytea[], $10::text[], $11::text[])
              AS u(tx_id, attempt, tx_hash, raw_tx, max_fee, tip)
         WHERE {FENCE_PREDICATE}"
    );
    let written = w
        .execute("record attempts", &sql, |q| {
            q.bind(ids)
                .bind(attempts)
                .bind(hashes)
                .bind(raws)
                .bind(max_fees)
                .bind(tips)
        })
        .await?;
    if written != rows.len() as u64 {
        return Err(w.fenced("record attempts").into());
    }
    Ok(())
}

/// ALLOCATED → FAILED for the rows still ALLOCATED at their nonce, the nonces released to
/// `recycled_nonces` by the move itself. Returns the rows that moved.
pub async fn fail_allocated(
    w: &mut Fenced<'_>,
    rows: &[Failing],
) -> Result<HashSet<Uuid>, StoreError> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let moves = rows
        .iter()
        .map(|r| {
            let mut m = MoveRow::new(
                r.tx_id,
                r.event_id,
                encoded(FAIL_ALLOCATED, r.tx_id, serde_json::to_value(&r.event))?,
            );
            m.failure = Some((r.code, r.event.reason.clone()));
            m.expect_nonce = r.event.nonce;
            Ok(m)
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(txstore::apply(w, FAIL_ALLOCATED, &moves)
        .await?
        .into_iter()
        .map(|l| l.tx_id)
        .collect())
}

/// These transactions of the writer's signer, locked for the rest of the transaction, in nonce
/// order (every transaction of the gateway takes them in that order).
pub async fn lock(w: &mut Fenced<'_>, tx_ids: &[Uuid]) -> Result<Vec<TxRow>, StoreError> {
    Ok(txstore::lock_rows(w, tx_ids).await?)
}

/// These transactions of the writer's signer, locked as [`lock`] locks them, each with its
/// highest recorded attempt (`None`: none yet), in one statement: what recording signatures
/// needs.
pub async fn lock_with_attempts(
    w: &mut Fenced<'_>,
    tx_ids: &[Uuid],
) -> Result<Vec<(TxRow, Option<i32>)>, StoreError> {
    #[derive(sqlx::FromRow)]
    struct Raw {
        #[sqlx(flatten)]
        row: txstore::RawRow,
        highest: Option<i32>,
    }
    let key = w.lease().key().clone();
    let raw: Vec<Raw> = w
        .read(
            "lock rows with attempts",
            sqlx::query_as(&format!(
                "SELECT {},
                        (SELECT max(a.attempt) FROM tx_attempts a WHERE a.tx_id = m.tx_id) AS highest
                 FROM managed_tx m
                 WHERE m.tx_id = ANY($1) AND {SIGNER_ROW} ORDER BY m.nonce, m.tx_id FOR UPDATE OF m",
                txstore::ROW_COLUMNS
            ))
            .bind(tx_ids.to_vec())
            .bind(key.chain_id.0)
            .bind(key.signer.as_str().to_string()),
        )
        .await?;
    raw.into_iter()
        .map(|r| {
            txstore::typed(r.row)
                .map(|row| (row, r.highest))
                .map_err(|e| StoreError::Read(ReadError::Corrupt(e)))
        })
        .collect()
}

/// The stored TxSigned events of these transactions (every attempt's).
pub async fn signed_events(
    w: &mut Fenced<'_>,
    tx_ids: &[Uuid],
) -> Result<Vec<(Uuid, TxSigned)>, StoreError> {
    if tx_ids.is_empty() {
        return Ok(Vec::new());
    }
    txstore::stored_events(w, tx_ids, SIGN.event)
        .await?
        .into_iter()
        .map(|(tx_id, payload)| {
            serde_json::from_value(payload)
                .map(|e| (tx_id, e))
                .map_err(|source| StoreError::StoredEvent {
                    tx_id,
                    event_type: SIGN.event,
                    source,
                })
        })
        .collect()
}

/// The signer's ALLOCATED transactions in nonce order, at most [`SCAN_LIMIT`], outside any
/// transaction: what a recovery scan signs (with no transaction open).
pub async fn allocated(pool: &PgPool, key: &LeaseKey) -> Result<Vec<TxRow>, StoreError> {
    Ok(txstore::rows_in_states(pool, key.chain_id, &key.signer, &DRIVEN, true, SCAN_LIMIT).await?)
}

/// Signers of `chain_id` with transactions waiting for a signature, with sent transactions that
/// may need a gas bump, or with a transaction a deep reorg undid whose nonce has no defensive
/// cancellation yet.
pub async fn pending_signers(
    pool: &PgPool,
    chain_id: ChainId,
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let mut signers = txstore::signers_in_states(pool, chain_id, &DRIVEN).await?;
    // Signers with sent, unmined transactions: the scan decides whether one needs a gas bump.
    for key in txstore::signers_in_states(pool, chain_id, &BUMPABLE).await? {
        if !signers.contains(&key) {
            signers.push(key);
        }
    }
    let undone: Vec<(i64, String)> = sqlx::query_as(
        "SELECT DISTINCT m.chain_id, m.signer FROM managed_tx m
         WHERE m.chain_id = $1 AND m.reorged_at IS NOT NULL AND m.mined_block_number IS NULL
           AND m.state = ANY($2) AND m.nonce IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM tx_cancellations c WHERE c.chain_id = m.chain_id
                           AND c.signer = m.signer AND c.nonce = m.nonce)",
    )
    .bind(chain_id.0)
    .bind(txstore::names(&VOIDABLE))
    .fetch_all(pool)
    .await?;
    for (chain_id, signer) in undone {
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
/// undid it (`managed_tx.reorged_at`).
pub const VOIDABLE: [TxState; 2] = [TxState::Confirmed, TxState::Reverted];

/// How many undone transactions of a signer one recovery scan looks at, in nonce order.
pub const UNDONE_LIMIT: i64 = 100;

/// A transaction a deep reorg undid, as read for its cancellation.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct UndoneRow {
    pub tx_id: Uuid,
    /// `managed_tx.state`, as stored.
    pub state: String,
    pub nonce: Option<i64>,
    pub reorg_generation: i32,
    /// It has a receipt again (its own attempt mined again).
    pub mined: bool,
    /// A cancellation is recorded for its nonce.
    pub cancelled: bool,
    /// The highest caps of its attempts, decimal wei.
    pub max_fee: Option<String>,
    pub tip: Option<String>,
}

impl UndoneRow {
    /// The row for the decision; `None` for a state or fees that do not parse (the caller reports
    /// it).
    pub fn read(&self) -> Option<Undone> {
        let caps = match (self.max_fee.as_deref(), self.tip.as_deref()) {
            (Some(max_fee), Some(tip)) => Some(Caps {
                max_fee: max_fee.parse().ok()?,
                tip: tip.parse().ok()?,
            }),
            _ => None,
        };
        Some(Undone {
            tx_id: self.tx_id,
            state: TxState::parse(&self.state).ok()?,
            nonce: self.nonce,
            reorged: true,
            mined: self.mined,
            cancelled: self.cancelled,
            generation: self.reorg_generation,
            original: caps,
        })
    }
}

/// The signer's transactions a deep reorg undid (`reorged_at` set), in nonce order, with whether
/// their nonce has a cancellation and their attempts' highest caps; outside any transaction.
pub async fn undone(pool: &PgPool, key: &LeaseKey) -> Result<Vec<UndoneRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT m.tx_id, m.state, m.nonce, m.reorg_generation,
                m.mined_block_number IS NOT NULL AS mined,
                EXISTS (SELECT 1 FROM tx_cancellations c WHERE c.chain_id = m.chain_id
                        AND c.signer = m.signer AND c.nonce = m.nonce) AS cancelled,
                a.max_fee::text AS max_fee, a.tip::text AS tip
         FROM managed_tx m
         LEFT JOIN LATERAL (SELECT max(max_fee_per_gas) AS max_fee,
                                   max(max_priority_fee_per_gas) AS tip
                            FROM tx_attempts WHERE tx_id = m.tx_id) a ON true
         WHERE m.chain_id = $1 AND m.signer = $2 AND m.reorged_at IS NOT NULL
         ORDER BY m.nonce LIMIT $3",
    )
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(UNDONE_LIMIT)
    .fetch_all(pool)
    .await
}

/// A signed defensive cancellation to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancellation {
    /// The transaction whose nonce it voids, and its deep-reorg generation as read.
    pub tx_id: Uuid,
    pub generation: i32,
    pub nonce: i64,
    pub tx_hash: String,
    pub raw_tx: Vec<u8>,
    pub caps: Caps,
}

/// Records signed cancellations, fenced, in the caller's transaction: each only if its
/// transaction is still as it was read (final, undone by a deep reorg, not mined again, at that
/// nonce) and its nonce has none yet. Returns the nonces recorded; `Fenced` when the lease is not
/// current.
pub async fn record_cancellations(
    w: &mut Fenced<'_>,
    rows: &[Cancellation],
) -> Result<HashSet<i64>, StoreError> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.tx_id).collect();
    let generations: Vec<i32> = rows.iter().map(|r| r.generation).collect();
    let nonces: Vec<i64> = rows.iter().map(|r| r.nonce).collect();
    let hashes: Vec<&str> = rows.iter().map(|r| r.tx_hash.as_str()).collect();
    let raws: Vec<&[u8]> = rows.iter().map(|r| r.raw_tx.as_slice()).collect();
    let max_fees: Vec<String> = rows.iter().map(|r| r.caps.max_fee.to_string()).collect();
    let tips: Vec<String> = rows.iter().map(|r| r.caps.tip.to_string()).collect();
    let sql = format!(
        "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
         recorded AS (
             INSERT INTO tx_cancellations (chain_id, signer, nonce, tx_id, reorg_generation, tx_hash,
                                           raw_tx, max_fee_per_gas, max_priority_fee_per_gas,
                                           fencing_token)
             SELECT m.chain_id, m.signer, u.nonce, u.tx_id, u.generation, u.tx_hash, u.raw_tx,
                    u.max_fee::numeric, u.tip::numeric, $5
             FROM unnest($6::uuid[], $7::int[], $8::bigint[], $9::text[], $10::bytea[], $11::text[],
                         $12::text[]) AS u(tx_id, generation, nonce, tx_hash, raw_tx, max_fee, tip)
             JOIN managed_tx m ON m.tx_id = u.tx_id AND {SIGNER_ROW}
                              AND m.nonce = u.nonce
             WHERE m.state = ANY($13) AND m.reorged_at IS NOT NULL AND m.mined_block_number IS NULL
               AND EXISTS (SELECT 1 FROM fence_ok)
             ON CONFLICT (chain_id, signer, nonce) DO NOTHING
             RETURNING nonce)
         SELECT nonce FROM recorded UNION ALL SELECT NULL FROM fence_ok"
    );
    let out: Vec<(Option<i64>,)> = w
        .fetch_all("record cancellations", &sql, |q| {
            q.bind(ids)
                .bind(generations)
                .bind(nonces)
                .bind(hashes)
                .bind(raws)
                .bind(max_fees)
                .bind(tips)
                .bind(txstore::names(&VOIDABLE))
        })
        .await?;
    if !out.iter().any(|(n,)| n.is_none()) {
        return Err(w.fenced("record cancellations").into());
    }
    Ok(out.into_iter().filter_map(|(n,)| n).collect())
}

// ---- Gas bumps (issue 16 point 1; no migration: attempt n+1 is a tx_attempts row) ----

/// The states whose latest attempt a gas bump replaces: sent, not mined.
pub const BUMPABLE: [TxState; 1] = [TxState::Submitted];

/// How many SUBMITTED transactions of a signer one recovery scan looks at for a bump, in nonce
/// order (the head of the queue first).
pub const BUMP_LIMIT: i64 = 100;

/// A SUBMITTED transaction and its latest attempt, as read for a bump.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct BumpRow {
    pub tx_id: Uuid,
    pub nonce: Option<i64>,
    pub payload: serde_json::Value,
    pub attempt: i32,
    /// The latest attempt's caps, decimal wei.
    pub max_fee: String,
    pub tip: String,
    /// How long ago the latest attempt was recorded, by the database clock.
    pub waited_ms: i64,
}

impl BumpRow {
    /// The row for the decision; `None` for a nonce or fees that do not parse (the caller
    /// reports it).
    pub fn read(&self) -> Option<crate::decide::Pending> {
        Some(crate::decide::Pending {
            nonce: self.nonce?,
            attempt: self.attempt,
            caps: Caps {
                max_fee: self.max_fee.parse().ok()?,
                tip: self.tip.parse().ok()?,
            },
            waited_ms: u64::try_from(self.waited_ms).unwrap_or(0),
        })
    }
}

/// The signer's SUBMITTED transactions with their latest attempt, in nonce order, at most
/// [`BUMP_LIMIT`], outside any transaction (what a bump is decided on; no transaction is open
/// while it is signed).
pub async fn bump_candidates(pool: &PgPool, key: &LeaseKey) -> Result<Vec<BumpRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT m.tx_id, m.nonce, m.payload, a.attempt, a.max_fee_per_gas::text AS max_fee,
                a.max_priority_fee_per_gas::text AS tip,
                (extract(epoch FROM clock_timestamp() - a.created_at) * 1000)::bigint AS waited_ms
         FROM managed_tx m
         JOIN LATERAL (SELECT attempt, max_fee_per_gas, max_priority_fee_per_gas, created_at
                       FROM tx_attempts WHERE tx_id = m.tx_id
                       ORDER BY attempt DESC LIMIT 1) a ON true
         WHERE m.chain_id = $1 AND m.signer = $2 AND {}
         ORDER BY m.nonce LIMIT $3",
        txstore::state_in("m.state", &BUMPABLE)
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(BUMP_LIMIT)
    .fetch_all(pool)
    .await
}

/// A signed attempt n+1 to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bump {
    pub tx_id: Uuid,
    pub nonce: i64,
    /// The attempt number n+1: recorded only while attempt n is still the latest.
    pub attempt: i32,
    pub tx_hash: String,
    pub raw_tx: Vec<u8>,
    pub caps: Caps,
}

/// Records signed bumps, fenced, in the caller's transaction: each attempt n+1 only if its
/// transaction is still SUBMITTED at that nonce and attempt n is still its latest (a bump signed
/// twice, by a drive whose recording was fenced and the next owner's, is recorded once). The new
/// attempt is due to be sent at once (`next_resubmit_at`): the broadcaster's resubmission sends
/// the latest attempt. Returns the transactions recorded; `Fenced` when the lease is not current.
pub async fn record_bumps(w: &mut Fenced<'_>, rows: &[Bump]) -> Result<HashSet<Uuid>, StoreError> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.tx_id).collect();
    let nonces: Vec<i64> = rows.iter().map(|r| r.nonce).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempt).collect();
    let hashes: Vec<&str> = rows.iter().map(|r| r.tx_hash.as_str()).collect();
    let raws: Vec<&[u8]> = rows.iter().map(|r| r.raw_tx.as_slice()).collect();
    let max_fees: Vec<String> = rows.iter().map(|r| r.caps.max_fee.to_string()).collect();
    let tips: Vec<String> = rows.iter().map(|r| r.caps.tip.to_string()).collect();
    let sql = format!(
        "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
         recorded AS (
             INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas,
                                      max_priority_fee_per_gas, next_resubmit_at)
             SELECT u.tx_id, u.attempt, u.tx_hash, u.raw_tx, u.max_fee::numeric, u.tip::numeric,
                    clock_timestamp()
             FROM unnest($6::uuid[], $7::bigint[], $8::int[], $9::text[], $10::bytea[],
                         $11::text[], $12::text[])
                  AS u(tx_id, nonce, attempt, tx_hash, raw_tx, max_fee, tip)
             JOIN managed_tx m ON m.tx_id = u.tx_id AND {SIGNER_ROW}
                              AND m.nonce = u.nonce
             WHERE m.state = ANY($13)
               AND u.attempt = 1 + (SELECT max(a.attempt) FROM tx_attempts a WHERE a.tx_id = u.tx_id)
               AND EXISTS (SELECT 1 FROM fence_ok)
             ON CONFLICT DO NOTHING
             RETURNING tx_id)
         SELECT tx_id FROM recorded UNION ALL SELECT NULL FROM fence_ok"
    );
    let out: Vec<(Option<Uuid>,)> = w
        .fetch_all("record bumps", &sql, |q| {
            q.bind(ids)
                .bind(nonces)
                .bind(attempts)
                .bind(hashes)
                .bind(raws)
                .bind(max_fees)
                .bind(tips)
                .bind(txstore::names(&BUMPABLE))
        })
        .await?;
    if !out.iter().any(|(id,)| id.is_none()) {
        return Err(w.fenced("record bumps").into());
    }
    Ok(out.into_iter().filter_map(|(id,)| id).collect())
}
