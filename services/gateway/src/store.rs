//! The gateway's SQL on `transfers` and `assets` (migration 0012): the INIT row of a new transfer
//! (idempotent per user and `cid` by the table's `UNIQUE (user_id, cid)`), the reads of §8.2, and
//! the asset rules the domain validates against. Amounts are bound as text cast `::numeric` and
//! read as text with the trailing zeros of the column's scale trimmed.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use sqlx::PgPool;
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

/// Inserts `t` in state INIT. `None`: this user already has a transfer with this `cid` (nothing
/// was written); read it with [`by_cid`].
pub async fn insert(pool: &PgPool, t: &NewTransfer) -> Result<Option<TransferRow>, StoreError> {
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
        .fetch_optional(pool)
        .await
        .map_err(db("insert a transfer"))
}

/// `user`'s transfer with this `cid`.
pub async fn by_cid(
    pool: &PgPool,
    user: &str,
    cid: &str,
) -> Result<Option<TransferRow>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM transfers WHERE user_id = $1 AND cid = $2");
    sqlx::query_as::<_, TransferRow>(&sql)
        .bind(user)
        .bind(cid)
        .fetch_optional(pool)
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
