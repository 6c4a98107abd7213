//! The coordinator's SQL on `transfers` (seed 004 §6.2, §7.1): reads, and one fenced CAS per
//! transition of §2.2. Every write carries the user's lease predicate ([`FENCE_PREDICATE`]) and
//! expects the state it leaves, so two coordinators — or a coordinator and a stale copy of itself
//! — can never both move one transfer: the second CAS finds the state gone and skips (CON-001).

use std::time::Duration;

use sqlx::PgPool;
use txflow_core::events::TransferUpdated;
use txflow_core::fenced::{FENCE_PREDICATE, FenceError, Fenced};
use txflow_core::transfer::{Direction, TransferState, Transition, UnknownTransferState};

/// The open states of §6.2 as literals, so that the partial index `transfers_open_idx` serves
/// the queries that name them.
const OPEN: &str = "(0, 10, 20, 30, -20)";

const COLUMNS: &str = "transfer_id, req_id, user_id, asset, amount::text AS amount, \
     transfer_type, state, error_code, retry_count";

/// A `transfers` row as the coordinator reads it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TransferRow {
    pub transfer_id: i64,
    pub req_id: String,
    pub user_id: String,
    pub asset: String,
    /// `NUMERIC(38, 18)` as text, as stored (trailing zeros included): see [`TransferRow::amount`].
    amount: String,
    pub transfer_type: i16,
    pub state: i16,
    pub error_code: Option<String>,
    pub retry_count: i32,
}

/// A row the coordinator cannot read as a transfer (a state or type outside §2.1 / §7.1).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CorruptRow {
    #[error("transfer {req_id}: {source}")]
    State {
        req_id: String,
        #[source]
        source: UnknownTransferState,
    },
    #[error("transfer {req_id}: transfer_type {transfer_type} is neither 1 nor 2")]
    Type { req_id: String, transfer_type: i16 },
}

impl TransferRow {
    pub fn state(&self) -> Result<TransferState, CorruptRow> {
        TransferState::from_id(self.state).map_err(|source| CorruptRow::State {
            req_id: self.req_id.clone(),
            source,
        })
    }

    pub fn direction(&self) -> Result<Direction, CorruptRow> {
        match self.transfer_type {
            1 => Ok(Direction::FundingToSpot),
            2 => Ok(Direction::SpotToFunding),
            other => Err(CorruptRow::Type {
                req_id: self.req_id.clone(),
                transfer_type: other,
            }),
        }
    }

    /// The amount as the adapters take it: the stored text without the trailing zeros of the
    /// column's 18 places (an asset with 8 places would otherwise see 18).
    pub fn amount(&self) -> &str {
        trim_numeric(&self.amount)
    }
}

/// `100.500000` → `100.5`, `7.000` → `7`, `12` → `12`.
pub fn trim_numeric(text: &str) -> &str {
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        text
    }
}

/// What a CAS did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cas {
    /// This CAS moved the transfer.
    Moved,
    /// The transfer was no longer in the state the CAS leaves (another worker moved it, or it
    /// was never there): nothing written (seed 004 §9.2, "if !success: return db.get().state").
    Skipped(TransferState),
}

/// One transfer, in the fenced transaction (its lease is the row's user's).
pub async fn load(w: &mut Fenced<'_>, req_id: &str) -> Result<Option<TransferRow>, FenceError> {
    let sql = format!("SELECT {COLUMNS} FROM transfers WHERE req_id = $1");
    let mut rows = w
        .read("load transfer", sqlx::query_as(&sql).bind(req_id))
        .await?;
    Ok(rows.pop())
}

/// A TransferUpdated as the outbox records it: its id and its JSON.
#[derive(Debug, Clone)]
pub struct Announcement {
    pub event_id: uuid::Uuid,
    pub payload: serde_json::Value,
}

/// The CAS of `t` on one transfer (§9.2 `db.cas_update`), with the explicit failure's code and
/// message for FAILED and COMPENSATING, and its announcement: when the transfer moves, `event`
/// (its TransferUpdated) is recorded in `transfer_outbox` in the same statement, so it reaches the
/// topic even if the process dies before producing it. Zero rows is `Skipped` when the state has
/// moved on, and `Fenced` when it has not (the lease is no longer this instance's).
pub async fn cas(
    w: &mut Fenced<'_>,
    req_id: &str,
    t: Transition,
    error: Option<(&str, &str)>,
    event: &Announcement,
) -> Result<Cas, FenceError> {
    let sql = format!(
        "WITH moved AS ( \
             UPDATE transfers t SET state = $7, updated_at = now(), fencing_token = $5, \
                 error_code = COALESCE($8, t.error_code), \
                 error_message = COALESCE(left($9, 1024), t.error_message) \
             WHERE t.req_id = $6 AND t.state = $10 AND {FENCE_PREDICATE} \
             RETURNING t.transfer_id, t.user_id, t.req_id), \
         announced AS ( \
             INSERT INTO transfer_outbox (event_id, user_id, req_id, state, payload) \
             SELECT $11::uuid, m.user_id, m.req_id, $7, $12::jsonb FROM moved m \
             ON CONFLICT (event_id) DO NOTHING) \
         SELECT transfer_id FROM moved"
    );
    let (code, message) = match error {
        Some((c, m)) => (Some(c.to_string()), Some(m.to_string())),
        None => (None, None),
    };
    let (event_id, payload) = (event.event_id, event.payload.clone());
    let moved: Vec<(i64,)> = w
        .fetch_all("transfer cas", &sql, |q| {
            q.bind(req_id)
                .bind(t.to().id())
                .bind(code)
                .bind(message)
                .bind(t.from().id())
                .bind(event_id)
                .bind(payload)
        })
        .await?;
    if !moved.is_empty() {
        return Ok(Cas::Moved);
    }
    let now: Vec<(i16,)> = w
        .read(
            "transfer cas: read back",
            sqlx::query_as("SELECT state FROM transfers WHERE req_id = $1").bind(req_id),
        )
        .await?;
    match now.first().map(|(s,)| TransferState::from_id(*s)) {
        Some(Ok(state)) if state != t.from() => Ok(Cas::Skipped(state)),
        // Still in `from`: the fence refused the write.
        Some(Ok(_)) => Err(w.fenced("transfer cas")),
        // No such row, or a state outside §2.1: nothing to move.
        None | Some(Err(_)) => Ok(Cas::Skipped(t.from())),
    }
}

/// How old an unpublished transfer event must be before the coordinator relays it (the drive
/// that recorded it produces it within milliseconds): the tx stages' grace.
pub const RELAY_GRACE: Duration = txflow_core::outbox::GRACE;

/// How many unpublished events one drive relays for one user.
const RELAY_LIMIT: i64 = 1000;

/// The users with transfer events unpublished for longer than [`RELAY_GRACE`].
pub async fn users_with_unpublished(pool: &PgPool, limit: i64) -> Result<Vec<String>, sqlx::Error> {
    let rows: Vec<(String,)> = sqlx::query_as(
        "SELECT DISTINCT user_id FROM transfer_outbox \
         WHERE created_at < now() - make_interval(secs => $1) LIMIT $2",
    )
    .bind(RELAY_GRACE.as_secs_f64())
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|(u,)| u).collect())
}

/// A user's transfer events unpublished for longer than [`RELAY_GRACE`], oldest first: the
/// events as recorded, or the `event_id` of a payload that no longer decodes (left unpublished).
pub async fn unpublished_of_user(
    pool: &PgPool,
    user: &str,
) -> Result<Vec<Result<TransferUpdated, uuid::Uuid>>, sqlx::Error> {
    let rows: Vec<(uuid::Uuid, serde_json::Value)> = sqlx::query_as(
        "SELECT event_id, payload FROM transfer_outbox \
         WHERE user_id = $1 AND created_at < now() - make_interval(secs => $2) \
         ORDER BY created_at, event_id LIMIT $3",
    )
    .bind(user)
    .bind(RELAY_GRACE.as_secs_f64())
    .bind(RELAY_LIMIT)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, payload)| serde_json::from_value(payload).map_err(|_| id))
        .collect())
}

/// Records a step that stays (an unknown outcome, a refused refund): one more retry, its reason,
/// and `updated_at`, which sets the next retry a stale period later (§6.2). Nothing when the
/// transfer has moved on meanwhile.
pub async fn stayed(
    w: &mut Fenced<'_>,
    req_id: &str,
    state: TransferState,
    code: &str,
    message: &str,
) -> Result<(), FenceError> {
    let sql = format!(
        "UPDATE transfers t SET retry_count = t.retry_count + 1, updated_at = now(), \
             fencing_token = $5, error_code = $7, error_message = left($8, 1024) \
         WHERE t.req_id = $6 AND t.state = $9 AND {FENCE_PREDICATE} \
         RETURNING t.transfer_id"
    );
    let _: Vec<(i64,)> = w
        .fetch_all("transfer stayed", &sql, |q| {
            q.bind(req_id)
                .bind(code.to_string())
                .bind(message.to_string())
                .bind(state.id())
        })
        .await?;
    Ok(())
}

/// A user's open transfers, oldest first.
pub async fn open_of_user(pool: &PgPool, user_id: &str) -> Result<Vec<TransferRow>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM transfers WHERE user_id = $1 AND state IN {OPEN} \
         ORDER BY transfer_id"
    );
    sqlx::query_as(&sql).bind(user_id).fetch_all(pool).await
}

/// The users with an open transfer that has not moved for `stale` (the recovery worker's query,
/// §6.2), at most `limit` of them, the longest-waiting first.
pub async fn stale_users(
    pool: &PgPool,
    stale: Duration,
    limit: i64,
) -> Result<Vec<String>, sqlx::Error> {
    let sql = format!(
        "SELECT user_id FROM transfers \
         WHERE state IN {OPEN} AND updated_at < now() - make_interval(secs => $1) \
         GROUP BY user_id ORDER BY min(updated_at) LIMIT $2"
    );
    let rows: Vec<(String,)> = sqlx::query_as(&sql)
        .bind(stale.as_secs_f64())
        .bind(limit)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(|(u,)| u).collect())
}

/// True while a conservation violation is unresolved: transfers are halted (seed 004 MON-003).
pub async fn halted(pool: &PgPool) -> Result<bool, sqlx::Error> {
    let (halted,): (bool,) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM transfer_conservation_violations WHERE resolved_at IS NULL)",
    )
    .fetch_one(pool)
    .await?;
    Ok(halted)
}

#[cfg(test)]
mod tests {
    use super::trim_numeric;

    #[test]
    fn stored_amounts_lose_only_trailing_zeros() {
        assert_eq!(trim_numeric("100.500000000000000000"), "100.5");
        assert_eq!(trim_numeric("7.000000000000000000"), "7");
        assert_eq!(trim_numeric("12"), "12");
        assert_eq!(trim_numeric("0.000000000000000001"), "0.000000000000000001");
        assert_eq!(trim_numeric("100"), "100");
    }
}
