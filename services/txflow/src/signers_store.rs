//! The SQL of `txflow signers`: plain reads for the status table (no lease, no transaction: a
//! snapshot an operator reads, each query consistent on its own), the reads `reset-nonce` makes
//! inside its fenced transaction, and the take-over of a live lease that `--force` asks for.

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use txflow_core::fenced::{FenceError, Fenced};
use txflow_core::state::TxState;
use txflow_core::txstore::state_in;

/// States whose transactions hold a nonce that is not mined yet: the signer's in-flight work.
pub const IN_FLIGHT: [TxState; 3] = [TxState::Allocated, TxState::Signed, TxState::Submitted];

/// States of transactions waiting for a nonce (none held yet).
pub const QUEUED: [TxState; 4] = [
    TxState::Received,
    TxState::Simulated,
    TxState::PendingApproval,
    TxState::Replaced,
];

/// States whose rows occupy their nonce (`managed_tx_nonce_holder_uq`): such a nonce is never a
/// gap, whatever the chain says of it.
pub const HOLDERS: [TxState; 6] = [
    TxState::Allocated,
    TxState::Signed,
    TxState::Submitted,
    TxState::Mined,
    TxState::Confirmed,
    TxState::Reverted,
];

/// Which signers to show: all, one chain, or one signer.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub chain_id: Option<i64>,
    /// Lowercase 0x-hex, as stored.
    pub signer: Option<String>,
}

/// `$1` is the chain (or NULL), `$2` the signer (or NULL).
const FILTER: &str = "($1::bigint IS NULL OR chain_id = $1) AND ($2::text IS NULL OR signer = $2)";

/// Every signer txflow knows of: with a cursor, a lease, a hold, a released nonce or an open
/// transaction. The open states are written out so that `managed_tx_open_idx` serves the last.
pub async fn signers(pool: &PgPool, f: &Filter) -> Result<Vec<(i64, String)>, sqlx::Error> {
    let open: Vec<TxState> = QUEUED.iter().chain(IN_FLIGHT.iter()).copied().collect();
    let sql = format!(
        "SELECT chain_id, signer FROM signer_nonce_cursor WHERE {FILTER}
         UNION SELECT chain_id, signer FROM signer_lease WHERE {FILTER}
         UNION SELECT chain_id, signer FROM signer_holds WHERE {FILTER}
         UNION SELECT chain_id, signer FROM recycled_nonces WHERE {FILTER}
         UNION SELECT chain_id, signer FROM managed_tx WHERE {FILTER} AND {}
         ORDER BY 1, 2",
        state_in("state", &open)
    );
    sqlx::query_as(&sql)
        .bind(f.chain_id)
        .bind(f.signer.as_deref())
        .fetch_all(pool)
        .await
}

/// A signer's nonce cursor (`signer_nonce_cursor`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CursorRow {
    pub chain_id: i64,
    pub signer: String,
    pub next_nonce: i64,
    pub synced_at: Option<DateTime<Utc>>,
}

pub async fn cursors(pool: &PgPool, f: &Filter) -> Result<Vec<CursorRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT chain_id, signer, next_nonce, synced_at FROM signer_nonce_cursor WHERE {FILTER}"
    ))
    .bind(f.chain_id)
    .bind(f.signer.as_deref())
    .fetch_all(pool)
    .await
}

/// A signer's open transactions, counted.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct WorkRow {
    pub chain_id: i64,
    pub signer: String,
    pub in_flight: i64,
    pub queued: i64,
    /// RECEIVED requests held alone (`managed_tx.hold_reason`).
    pub held_requests: i64,
    /// The reason of one of them (the oldest hold), as operators read it.
    pub request_hold_reason: Option<String>,
    /// Seconds since the oldest in-flight transaction was recorded (database clock).
    pub oldest_in_flight_secs: Option<f64>,
    /// The lowest and highest nonce held in flight.
    pub lowest_in_flight: Option<i64>,
    pub highest_in_flight: Option<i64>,
}

pub async fn work(pool: &PgPool, f: &Filter) -> Result<Vec<WorkRow>, sqlx::Error> {
    let open: Vec<TxState> = QUEUED.iter().chain(IN_FLIGHT.iter()).copied().collect();
    let in_flight = state_in("state", &IN_FLIGHT);
    let queued = state_in("state", &QUEUED);
    let received = TxState::Received.as_str();
    let sql = format!(
        "SELECT chain_id, signer,
                count(*) FILTER (WHERE {in_flight}) AS in_flight,
                count(*) FILTER (WHERE {queued}) AS queued,
                count(*) FILTER (WHERE state = '{received}' AND hold_reason IS NOT NULL) AS held_requests,
                (array_agg(hold_reason ORDER BY held_since)
                   FILTER (WHERE state = '{received}' AND hold_reason IS NOT NULL))[1] AS request_hold_reason,
                extract(epoch FROM clock_timestamp() - min(created_at) FILTER (WHERE {in_flight}))::float8
                   AS oldest_in_flight_secs,
                min(nonce) FILTER (WHERE {in_flight}) AS lowest_in_flight,
                max(nonce) FILTER (WHERE {in_flight}) AS highest_in_flight
         FROM managed_tx WHERE {FILTER} AND {}
         GROUP BY chain_id, signer",
        state_in("state", &open)
    );
    sqlx::query_as(&sql)
        .bind(f.chain_id)
        .bind(f.signer.as_deref())
        .fetch_all(pool)
        .await
}

/// A stage's hold on a signer (`signer_holds`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct HoldRow {
    pub chain_id: i64,
    pub signer: String,
    pub role: String,
    pub reason: String,
    pub since: DateTime<Utc>,
}

pub async fn holds(pool: &PgPool, f: &Filter) -> Result<Vec<HoldRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT chain_id, signer, role, reason, since FROM signer_holds WHERE {FILTER}
         ORDER BY role"
    ))
    .bind(f.chain_id)
    .bind(f.signer.as_deref())
    .fetch_all(pool)
    .await
}

/// A role's lease on a signer (`signer_lease`), live or not by the database clock.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct LeaseRow {
    pub chain_id: i64,
    pub signer: String,
    pub role: String,
    pub owner_node: String,
    pub fencing_token: i64,
    /// `None` for a lease given back (its expiry is `-infinity`, which no `DateTime` holds).
    pub expires_at: Option<DateTime<Utc>>,
    pub live: bool,
}

pub async fn leases(pool: &PgPool, f: &Filter) -> Result<Vec<LeaseRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT chain_id, signer, role, owner_node, fencing_token,
                CASE WHEN isfinite(expires_at) THEN expires_at END AS expires_at,
                expires_at > clock_timestamp() AS live
         FROM signer_lease WHERE {FILTER} ORDER BY role"
    ))
    .bind(f.chain_id)
    .bind(f.signer.as_deref())
    .fetch_all(pool)
    .await
}

/// Released nonces waiting for a request or a no-op, per signer.
pub async fn released(pool: &PgPool, f: &Filter) -> Result<Vec<(i64, String, i64)>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT chain_id, signer, count(*) FROM recycled_nonces WHERE {FILTER}
         GROUP BY chain_id, signer"
    ))
    .bind(f.chain_id)
    .bind(f.signer.as_deref())
    .fetch_all(pool)
    .await
}

/// How many transactions of the signer are in flight: a plain read, for refusing early.
pub async fn in_flight(pool: &PgPool, chain_id: i64, signer: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND {}",
        state_in("state", &IN_FLIGHT)
    ))
    .bind(chain_id)
    .bind(signer)
    .fetch_one(pool)
    .await
}

/// Under the lease: the signer's in-flight count and the nonces at or above `from` that rows
/// occupy ([`HOLDERS`]), ascending.
pub async fn occupied(w: &mut Fenced<'_>, from: i64) -> Result<(i64, Vec<i64>), FenceError> {
    let key = w.lease().key().clone();
    let (chain_id, signer) = (key.chain_id.0, key.signer.as_str().to_string());
    let in_flight: Vec<(i64,)> = w
        .read(
            "count in flight",
            sqlx::query_as(&format!(
                "SELECT count(*) FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND {}",
                state_in("state", &IN_FLIGHT)
            ))
            .bind(chain_id)
            .bind(signer.clone()),
        )
        .await?;
    let held: Vec<(i64,)> = w
        .read(
            "occupied nonces",
            sqlx::query_as(&format!(
                "SELECT DISTINCT nonce FROM managed_tx
                 WHERE chain_id = $1 AND signer = $2 AND nonce >= $3 AND {}
                 ORDER BY nonce",
                state_in("state", &HOLDERS)
            ))
            .bind(chain_id)
            .bind(signer)
            .bind(from),
        )
        .await?;
    Ok((
        in_flight.first().map_or(0, |r| r.0),
        held.into_iter().map(|r| r.0).collect(),
    ))
}

/// Ends another node's live lease, if it is still held by `owner` with `token` (a
/// compare-and-set; a lease that moved on meanwhile is left alone), the way a lost session ends
/// it: its expiry is set in the past, so that the next acquisition raises the fencing token and
/// every later write of the old owner is refused by the fence. It waits for a fenced commit of
/// the old owner in progress (which holds a share lock on the row) and so never cuts one in
/// half. Only `reset-nonce --force` does this, at an operator's word.
pub async fn revoke_lease(
    pool: &PgPool,
    role: &str,
    chain_id: i64,
    signer: &str,
    owner: &str,
    token: i64,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE signer_lease SET expires_at = '-infinity', updated_at = clock_timestamp()
         WHERE role = $1 AND chain_id = $2 AND signer = $3 AND owner_node = $4 AND fencing_token = $5",
    )
    .bind(role)
    .bind(chain_id)
    .bind(signer)
    .bind(owner)
    .bind(token)
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}
