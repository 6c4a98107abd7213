//! The gateway's SQL on `transfers` and `assets` (migration 0012): the INIT row of a new transfer
//! (idempotent per user and `cid` by the table's `UNIQUE (user_id, cid)`), the reads of §8.2, and
//! the asset rules the domain validates against. Amounts are bound as text cast `::numeric` and
//! read as text with the trailing zeros of the column's scale trimmed. The daily limits of seed
//! 004 §1.5.6 (migration 0014) are checked in the transaction that inserts, under an advisory
//! lock per user ([`record_within_limits`]). Also the halt flag
//! (`transfer_conservation_violations`, migration 0013) and the reads of `managed_tx` for the tx
//! endpoints (the gateway never writes a transaction: the allocator owns them).

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};
use txflow_core::retry::{Classify, Retry};
use txflow_core::transfer::{AssetRule, AssetStatus, AssetTable, Direction, InvalidAssetRule};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("transfer store: {operation} failed")]
    Db {
        operation: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("transfer store: {what} holds an unreadable value")]
    Corrupt { what: &'static str },
    #[error("transfer store: bad asset rule")]
    AssetRule(#[source] InvalidAssetRule),
    #[error("transfer store: the cid conflicted but its transfer is not there")]
    CidVanished,
}

impl Classify for StoreError {
    fn retry(&self) -> Retry {
        match self {
            StoreError::Db { .. } | StoreError::CidVanished => Retry::Transient,
            StoreError::Corrupt { .. } | StoreError::AssetRule(_) => Retry::Permanent,
        }
    }
}

fn db(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Db { operation, source }
}

/// A `transfers` row as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TransferRow {
    pub transfer_id: i64,
    pub req_id: String,
    pub cid: Option<String>,
    pub user_id: String,
    pub asset: String,
    /// The exact amount, trailing zeros trimmed (`100.5`, `1`).
    pub amount: String,
    pub transfer_type: i16,
    pub source_account: String,
    pub target_account: String,
    pub state: i16,
    pub error_code: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

const COLUMNS: &str = "transfer_id, req_id, cid, user_id, asset, trim_scale(amount)::text AS amount, \
     transfer_type, source_account, target_account, state, error_code, created_at, updated_at";

/// A transfer to record in INIT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTransfer {
    pub req_id: String,
    pub cid: Option<String>,
    pub user_id: String,
    pub asset: String,
    /// The normalised amount (`Amount`'s `Display`).
    pub amount: String,
    pub direction: Direction,
}

/// What [`record_within_limits`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// A new INIT row.
    New(TransferRow),
    /// The user already has a transfer with this `cid` (nothing was written): the caller decides
    /// whether it is the same request.
    CidTaken(TransferRow),
    /// Refused, nothing written: the user already created `daily_count` transfers today (UTC).
    DailyCount { daily_count: u32 },
    /// Refused, nothing written: today's transfers of this asset plus this one would exceed the
    /// asset's `daily_limit` (the limit as text, trailing zeros trimmed).
    DailyAmount { daily_limit: String },
}

/// The advisory lock key of `user`'s daily limits: the first 8 bytes of
/// sha256("txflow.transfer.daily:" + user). A collision between two users only serialises them.
pub fn daily_lock_key(user: &str) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"txflow.transfer.daily:")
        .chain_update(user.as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// Records `t` in state INIT within the daily limits of seed 004 §1.5.6, in one transaction:
///
/// 1. `pg_advisory_xact_lock` on [`daily_lock_key`] of the user, so that one user's requests (on
///    any gateway process) are checked and inserted one at a time and two cannot both pass;
/// 2. a `cid` this user already used answers [`Recorded::CidTaken`] before any limit is checked:
///    a replay never counts twice, and is answered even when the user is at a limit;
/// 3. the user's transfers created since the start of the current UTC day (every state counts: a
///    failed or refunded transfer still used the allowance) are counted, and those of `t.asset`
///    summed: a count reaching `daily_count`, or a sum plus `t.amount` above the asset's
///    `daily_limit` (NULL: none), is refused and nothing is written;
/// 4. the INSERT (`ON CONFLICT (user_id, cid) DO NOTHING`, still the guard should a row arrive
///    outside the lock).
///
/// The day's rows are read through `transfers_user_created_idx (user_id, created_at)`; the sums
/// are compared in SQL, exactly (a sum of NUMERIC(38, 18) may not fit a `Decimal`).
pub async fn record_within_limits(
    pool: &PgPool,
    t: &NewTransfer,
    daily_count: u32,
) -> Result<Recorded, StoreError> {
    let mut tx = pool
        .begin()
        .await
        .map_err(db("begin a transfer's insert"))?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(daily_lock_key(&t.user_id))
        .execute(&mut *tx)
        .await
        .map_err(db("take the user's daily-limit lock"))?;
    if let Some(cid) = t.cid.as_deref()
        && let Some(row) = by_cid_on(&mut tx, &t.user_id, cid).await?
    {
        tx.commit().await.map_err(db("end a cid replay"))?;
        return Ok(Recorded::CidTaken(row));
    }
    let (count, over_amount, daily_limit): (i64, Option<bool>, Option<String>) = sqlx::query_as(
        "WITH today AS ( \
             SELECT asset, amount FROM transfers \
             WHERE user_id = $1 AND created_at >= date_trunc('day', now(), 'UTC') \
         ) \
         SELECT (SELECT count(*) FROM today), \
                coalesce((SELECT sum(amount) FROM today WHERE asset = $2), 0) + $3::numeric \
                    > (SELECT daily_limit FROM assets WHERE asset = $2), \
                (SELECT trim_scale(daily_limit)::text FROM assets WHERE asset = $2)",
    )
    .bind(&t.user_id)
    .bind(&t.asset)
    .bind(&t.amount)
    .fetch_one(&mut *tx)
    .await
    .map_err(db("read the user's transfers of the day"))?;
    let refused = if count >= i64::from(daily_count) {
        Some(Recorded::DailyCount { daily_count })
    } else if over_amount == Some(true) {
        Some(Recorded::DailyAmount {
            daily_limit: daily_limit.unwrap_or_default(),
        })
    } else {
        None
    };
    if let Some(refused) = refused {
        // Nothing written; rolled back now (not when the connection is next used), which
        // releases the lock for the user's next request.
        tx.rollback().await.map_err(db("end a refused transfer"))?;
        return Ok(refused);
    }
    let recorded = match insert_on(&mut tx, t).await? {
        Some(row) => Recorded::New(row),
        None => {
            let cid = t.cid.as_deref().ok_or(StoreError::CidVanished)?;
            let row = by_cid_on(&mut tx, &t.user_id, cid)
                .await?
                .ok_or(StoreError::CidVanished)?;
            Recorded::CidTaken(row)
        }
    };
    tx.commit().await.map_err(db("commit a transfer"))?;
    Ok(recorded)
}

async fn insert_on(
    conn: &mut PgConnection,
    t: &NewTransfer,
) -> Result<Option<TransferRow>, StoreError> {
    let sql = format!(
        "INSERT INTO transfers (req_id, cid, user_id, asset, amount, transfer_type, \
         source_account, target_account, state) \
         VALUES ($1, $2, $3, $4, $5::numeric, $6, $7, $8, 0) \
         ON CONFLICT (user_id, cid) DO NOTHING RETURNING {COLUMNS}"
    );
    sqlx::query_as::<_, TransferRow>(&sql)
        .bind(&t.req_id)
        .bind(&t.cid)
        .bind(&t.user_id)
        .bind(&t.asset)
        .bind(&t.amount)
        .bind(t.direction.transfer_type())
        .bind(t.direction.source().as_str())
        .bind(t.direction.target().as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(db("insert a transfer"))
}

/// `user`'s transfer with this `cid`, in the recording transaction.
async fn by_cid_on(
    conn: &mut PgConnection,
    user: &str,
    cid: &str,
) -> Result<Option<TransferRow>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM transfers WHERE user_id = $1 AND cid = $2");
    sqlx::query_as::<_, TransferRow>(&sql)
        .bind(user)
        .bind(cid)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db("read a transfer by cid"))
}

/// `user`'s transfer `req_id`: another user's is `None`, as an unknown one.
pub async fn by_req_id(
    pool: &PgPool,
    user: &str,
    req_id: &str,
) -> Result<Option<TransferRow>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM transfers WHERE req_id = $1 AND user_id = $2");
    sqlx::query_as::<_, TransferRow>(&sql)
        .bind(req_id)
        .bind(user)
        .fetch_optional(pool)
        .await
        .map_err(db("read a transfer"))
}

/// The rule of `asset` from the `assets` table, as an [`AssetTable`] (empty when there is no
/// such asset: the domain answers INVALID_ASSET).
pub async fn asset_table(pool: &PgPool, asset: &str) -> Result<AssetTable, StoreError> {
    let row: Option<(String, i16, String, String, String, bool)> = sqlx::query_as(
        "SELECT asset, places, min_amount::text, max_amount::text, status, internal_transfer_enabled \
         FROM assets WHERE asset = $1",
    )
    .bind(asset)
    .fetch_optional(pool)
    .await
    .map_err(db("read an asset rule"))?;
    let Some((asset, places, min, max, status, enabled)) = row else {
        return Ok(AssetTable::default());
    };
    let decimal =
        |what, s: &str| Decimal::from_str_exact(s).map_err(|_| StoreError::Corrupt { what });
    let rule = AssetRule {
        asset,
        places: u32::try_from(places).map_err(|_| StoreError::Corrupt {
            what: "assets.places",
        })?,
        min_amount: decimal("assets.min_amount", &min)?,
        max_amount: decimal("assets.max_amount", &max)?,
        status: AssetStatus::parse(&status).ok_or(StoreError::Corrupt {
            what: "assets.status",
        })?,
        internal_transfer_enabled: enabled,
    };
    AssetTable::new([rule]).map_err(StoreError::AssetRule)
}

/// Whether the database answers (`/readyz`).
pub async fn ping(pool: &PgPool) -> Result<(), StoreError> {
    sqlx::query("SELECT 1")
        .execute(pool)
        .await
        .map(|_| ())
        .map_err(db("ping"))
}

/// Whether transfers are halted: the conservation check found a violation nobody resolved yet
/// (`transfer_conservation_violations`, migration 0013).
pub async fn halted(pool: &PgPool) -> Result<bool, StoreError> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM transfer_conservation_violations WHERE resolved_at IS NULL)",
    )
    .fetch_one(pool)
    .await
    .map_err(db("check the transfer halt"))
}

/// A `managed_tx` row as the tx endpoints show it (migrations 0001 and later), with the hash of
/// the mined attempt, or else of the latest one.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TxRow {
    pub tx_id: uuid::Uuid,
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub kind: String,
    pub nonce: Option<i64>,
    pub state: String,
    pub sub_state: Option<String>,
    pub failure_code: Option<String>,
    pub failure_reason: Option<String>,
    pub to_address: Option<String>,
    pub value: Option<String>,
    pub tx_hash: Option<String>,
    pub attempts: i64,
    pub required_confirmations: i32,
    pub mined_block_number: Option<i64>,
    pub mined_block_hash: Option<String>,
    pub approved_by: Option<String>,
    pub approved_at: Option<DateTime<Utc>>,
    pub hold_reason: Option<String>,
    pub depends_on_request_id: Option<String>,
    pub depends_on_signer: Option<String>,
    pub submitted_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub confirmed_at: Option<DateTime<Utc>>,
}

const TX_COLUMNS: &str = "m.tx_id, m.request_id, m.chain_id, m.signer, m.kind, m.nonce, m.state, \
     m.sub_state, m.failure_code, m.failure_reason, m.payload->>'to' AS to_address, \
     m.payload->>'value' AS value, \
     coalesce(m.receipt->>'tx_hash', (SELECT a.tx_hash FROM tx_attempts a WHERE a.tx_id = m.tx_id \
         ORDER BY a.attempt DESC LIMIT 1)) AS tx_hash, \
     (SELECT count(*) FROM tx_attempts a WHERE a.tx_id = m.tx_id) AS attempts, \
     m.required_confirmations, m.mined_block_number, m.mined_block_hash, m.approved_by, \
     m.approved_at, m.hold_reason, m.depends_on_request_id, m.depends_on_signer, m.submitted_by, m.created_at, \
     m.updated_at, \
     m.confirmed_at";

/// The transaction `tx_id`.
pub async fn tx_by_id(pool: &PgPool, tx_id: uuid::Uuid) -> Result<Option<TxRow>, StoreError> {
    let sql = format!("SELECT {TX_COLUMNS} FROM managed_tx m WHERE m.tx_id = $1");
    sqlx::query_as::<_, TxRow>(&sql)
        .bind(tx_id)
        .fetch_optional(pool)
        .await
        .map_err(db("read a transaction"))
}

/// The transaction of a request (`managed_tx_request_uq`); `signer` in lowercase.
pub async fn tx_by_request(
    pool: &PgPool,
    chain_id: i64,
    signer: &str,
    request_id: &str,
) -> Result<Option<TxRow>, StoreError> {
    let sql = format!(
        "SELECT {TX_COLUMNS} FROM managed_tx m \
         WHERE m.chain_id = $1 AND m.signer = $2 AND m.request_id = $3"
    );
    sqlx::query_as::<_, TxRow>(&sql)
        .bind(chain_id)
        .bind(signer)
        .bind(request_id)
        .fetch_optional(pool)
        .await
        .map_err(db("read a transaction by request"))
}

/// The actions the audit log records (`gateway_audit.action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuditAction {
    Submit,
    Approve,
    Cancel,
}

impl AuditAction {
    pub const fn as_str(self) -> &'static str {
        match self {
            AuditAction::Submit => "tx.submit",
            AuditAction::Approve => "tx.approve",
            AuditAction::Cancel => "tx.cancel",
        }
    }
}

/// What came of an audited action (`gateway_audit.outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuditOutcome {
    /// Authorized (written before publishing: nothing is published unrecorded).
    Allowed,
    /// Refused, with its code.
    Refused,
    /// After an `Allowed` row: the broker did not take it (the caller got 503).
    Unpublished,
}

impl AuditOutcome {
    pub const fn as_str(self) -> &'static str {
        match self {
            AuditOutcome::Allowed => "allowed",
            AuditOutcome::Refused => "refused",
            AuditOutcome::Unpublished => "unpublished",
        }
    }
}

/// One `gateway_audit` row to write.
#[derive(Debug, Clone)]
pub struct AuditEntry<'a> {
    pub principal: &'a str,
    pub action: AuditAction,
    pub target: &'a str,
    pub outcome: AuditOutcome,
    pub code: Option<&'a str>,
    pub detail: Option<&'a str>,
}

/// Appends an audit row (the table refuses updates and deletes).
pub async fn audit(pool: &PgPool, e: &AuditEntry<'_>) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO gateway_audit (principal, action, target, outcome, code, detail) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(e.principal)
    .bind(e.action.as_str())
    .bind(e.target)
    .bind(e.outcome.as_str())
    .bind(e.code)
    .bind(e.detail)
    .execute(pool)
    .await
    .map(|_| ())
    .map_err(db("write an audit row"))
}

/// A `gateway_audit` row as read.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AuditRow {
    pub audit_id: i64,
    pub at: DateTime<Utc>,
    pub principal: String,
    pub action: String,
    pub target: String,
    pub outcome: String,
    pub code: Option<String>,
    pub detail: Option<String>,
}

/// Audit rows after `after` (an `audit_id`), oldest first, at most `limit`.
pub async fn audit_page(
    pool: &PgPool,
    after: i64,
    limit: i64,
) -> Result<Vec<AuditRow>, StoreError> {
    sqlx::query_as(
        "SELECT audit_id, at, principal, action, target, outcome, code, detail \
         FROM gateway_audit WHERE audit_id > $1 ORDER BY audit_id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await
    .map_err(db("read the audit log"))
}
