//! The allocator's SQL: one named function per transition, on the fenced primitives of
//! `txflow_core::txstore` (which write the audit rows), and the reads its drives need.

use std::time::Duration;

use sqlx::PgPool;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::fenced::{FENCE_PREDICATE, FenceError, Fenced, SIGNER_ROW};
use txflow_core::lease::LeaseKey;
use txflow_core::state::{
    ALLOCATE, APPROVE, AWAIT_APPROVAL, FAIL_ALLOCATED, FAIL_UNALLOCATED, SIMULATE, TxState,
};
use txflow_core::txstore::{self, Landed, MoveRow, NewTx, ReadError, TxRow};
use uuid::Uuid;

/// Records new requests (RECEIVED); returns the ids of those that were not duplicates.
pub async fn accept(w: &mut Fenced<'_>, rows: &[NewTx]) -> Result<Vec<Uuid>, FenceError> {
    txstore::create(w, rows).await
}

/// A request already recorded: its transaction, what it asked for and its announcement.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Recorded {
    pub request_id: String,
    pub tx_id: Uuid,
    /// `managed_tx.payload` (gas and fees filled in as the transaction went on).
    pub payload: serde_json::Value,
    /// The stored TxAccepted (re-emitted for a duplicate, same `event_id`).
    pub accepted: serde_json::Value,
    /// What it depends on (`managed_tx.depends_on_request_id`).
    pub depends_on_request_id: Option<String>,
    /// The signer of what it depends on (`managed_tx.depends_on_signer`; `NULL` on a row
    /// recorded before the column: its own signer).
    pub depends_on_signer: Option<String>,
    /// Its own signer.
    pub signer: String,
}

impl Recorded {
    /// Its parent: `(request_id, signer)`.
    pub fn parent(&self) -> Option<(String, String)> {
        self.depends_on_request_id.clone().map(|r| {
            (
                r,
                self.depends_on_signer
                    .clone()
                    .unwrap_or_else(|| self.signer.clone()),
            )
        })
    }
}

/// The recorded transactions of these requests of the writer's signer.
pub async fn recorded_requests(
    w: &mut Fenced<'_>,
    request_ids: &[String],
) -> Result<Vec<Recorded>, FenceError> {
    let key = w.lease().key().clone();
    w.read(
        "recorded requests",
        sqlx::query_as(
            "SELECT m.request_id, m.tx_id, m.payload, e.payload AS accepted, m.depends_on_request_id,
                    m.depends_on_signer, m.signer
             FROM managed_tx m JOIN tx_events e ON e.tx_id = m.tx_id AND e.type = $4
             WHERE m.chain_id = $1 AND m.signer = $2 AND m.request_id = ANY($3)",
        )
        .bind(key.chain_id.0)
        .bind(key.signer.as_str().to_string())
        .bind(request_ids.to_vec())
        .bind("TxAccepted"),
    )
    .await
}

/// Records who submitted new requests (`(tx_id, submitted_by)`), in the transaction that created
/// them (RECEIVED): one fenced statement. Every row must be there; none is `Fenced`.
pub async fn record_submitters(
    w: &mut Fenced<'_>,
    rows: &[(Uuid, String)],
) -> Result<(), FenceError> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
    let by: Vec<&str> = rows.iter().map(|(_, p)| p.as_str()).collect();
    let sql = format!(
        "UPDATE managed_tx m SET submitted_by = u.by
         FROM unnest($6::uuid[], $7::text[]) AS u(tx_id, by)
         WHERE m.tx_id = u.tx_id AND {SIGNER_ROW} AND m.state = $8
           AND {FENCE_PREDICATE}"
    );
    let touched = w
        .execute("record submitters", &sql, |q| {
            q.bind(ids).bind(by).bind(TxState::Received.as_str())
        })
        .await?;
    if touched != rows.len() as u64 {
        return Err(FenceError::Moved {
            operation: "record submitters",
            expected: rows.len(),
            moved: usize::try_from(touched).unwrap_or(usize::MAX),
        });
    }
    Ok(())
}

/// Who submitted a transaction of the writer's signer (`managed_tx.submitted_by`).
pub async fn submitted_by(w: &mut Fenced<'_>, tx_id: Uuid) -> Result<Option<String>, FenceError> {
    let key = w.lease().key().clone();
    let rows: Vec<(Option<String>,)> = w
        .read(
            "submitted by",
            sqlx::query_as(
                "SELECT submitted_by FROM managed_tx WHERE tx_id = $1 AND chain_id = $2 AND signer = $3",
            )
            .bind(tx_id)
            .bind(key.chain_id.0)
            .bind(key.signer.as_str().to_string()),
        )
        .await?;
    Ok(rows.into_iter().next().and_then(|(by,)| by))
}

/// Records what new requests depend on (`(tx_id, (depends_on_request_id, depends_on_signer))`),
/// in the transaction that created them (RECEIVED): one fenced statement. Every row must be
/// there; none is `Fenced`.
pub async fn record_dependencies(
    w: &mut Fenced<'_>,
    rows: &[(Uuid, (String, String))],
) -> Result<(), FenceError> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
    let parents: Vec<&str> = rows.iter().map(|(_, (p, _))| p.as_str()).collect();
    let signers: Vec<&str> = rows.iter().map(|(_, (_, s))| s.as_str()).collect();
    let sql = format!(
        "UPDATE managed_tx m SET depends_on_request_id = u.parent, depends_on_signer = u.signer
         FROM unnest($6::uuid[], $7::text[], $8::text[]) AS u(tx_id, parent, signer)
         WHERE m.tx_id = u.tx_id AND {SIGNER_ROW} AND m.state = $9
           AND {FENCE_PREDICATE}"
    );
    let touched = w
        .execute("record dependencies", &sql, |q| {
            q.bind(ids)
                .bind(parents)
                .bind(signers)
                .bind(TxState::Received.as_str())
        })
        .await?;
    if touched != rows.len() as u64 {
        return Err(FenceError::Moved {
            operation: "record dependencies",
            expected: rows.len(),
            moved: usize::try_from(touched).unwrap_or(usize::MAX),
        });
    }
    Ok(())
}

/// A chained request of the signer and the request it depends on (its parent: the one recorded
/// as `(chain_id, depends_on_signer, depends_on_request_id)`), as [`parents`] reads them; the
/// parent's columns are `None` when none is recorded yet.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ParentRow {
    pub child: Uuid,
    pub parent_request_id: String,
    pub tx_id: Option<Uuid>,
    pub chain_id: Option<i64>,
    pub signer: Option<String>,
    /// `managed_tx.state`, as stored (parsed by the handler).
    pub state: Option<String>,
    /// `confirmed_at` is set.
    pub settled: bool,
    /// `reorged_at` is set.
    pub reorged: bool,
    pub failure_code: Option<String>,
    pub failure_reason: Option<String>,
}

/// The signer's chained requests still waiting (RECEIVED, naming a parent) and their parents,
/// in one statement: each joined to the one request recorded as its chain, the signer it names
/// (`depends_on_signer`; its own on a row recorded before that column) and the `request_id` it
/// names — never to another signer's request that has the same id. A plain read, outside any transaction; what it decides is written under
/// the fence. The predicate is the partial index `managed_tx_waiting_child_idx`'s, written out
/// (the state name from [`TxState::as_str`]) so that the planner uses it whatever the plan.
pub async fn parents(pool: &PgPool, key: &LeaseKey) -> Result<Vec<ParentRow>, sqlx::Error> {
    let sql = format!(
        "SELECT c.tx_id AS child, c.depends_on_request_id AS parent_request_id,
                p.tx_id, p.chain_id, p.signer, p.state,
                p.confirmed_at IS NOT NULL AS settled, p.reorged_at IS NOT NULL AS reorged,
                p.failure_code, p.failure_reason
         FROM managed_tx c
         LEFT JOIN managed_tx p ON p.chain_id = c.chain_id
              AND p.signer = COALESCE(c.depends_on_signer, c.signer)
              AND p.request_id = c.depends_on_request_id
         WHERE c.chain_id = $1 AND c.signer = $2
           AND c.depends_on_request_id IS NOT NULL AND c.state = '{}'
         ORDER BY c.tx_id, p.created_at, p.tx_id",
        TxState::Received.as_str()
    );
    sqlx::query_as(&sql)
        .bind(key.chain_id.0)
        .bind(key.signer.as_str())
        .fetch_all(pool)
        .await
}

/// RECEIVED → SIMULATED (a hold of the request, if it had one, cleared by the move).
pub async fn simulated(w: &mut Fenced<'_>, rows: &[MoveRow]) -> Result<Vec<Landed>, FenceError> {
    txstore::apply(w, SIMULATE, rows).await
}

/// RECEIVED → PENDING_APPROVAL (a hold of the request, if it had one, cleared by the move).
pub async fn await_approval(
    w: &mut Fenced<'_>,
    rows: &[MoveRow],
) -> Result<Vec<Landed>, FenceError> {
    txstore::apply(w, AWAIT_APPROVAL, rows).await
}

/// RECEIVED / SIMULATED / PENDING_APPROVAL → FAILED (no nonce held; a hold of the request, if
/// it had one, cleared by the move).
pub async fn fail_unallocated(
    w: &mut Fenced<'_>,
    rows: &[MoveRow],
) -> Result<Vec<Landed>, FenceError> {
    txstore::apply(w, FAIL_UNALLOCATED, rows).await
}

/// A request held alone (the signer cannot pay for it now, but for others): it stays RECEIVED,
/// without a nonce, and is not simulated again for `retry_after_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHold {
    pub tx_id: Uuid,
    /// `managed_tx.hold_reason`: what operators read.
    pub reason: String,
    pub retry_after_ms: i64,
}

/// Records holds on RECEIVED requests, in one fenced statement: the reason, the first hold's
/// time (kept), one more attempt, and when to simulate again (the database clock). Returns the
/// ids held; a request no longer RECEIVED is left as it is.
pub async fn hold_requests(
    w: &mut Fenced<'_>,
    holds: &[RequestHold],
) -> Result<Vec<Uuid>, FenceError> {
    if holds.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = holds.iter().map(|h| h.tx_id).collect();
    let reasons: Vec<&str> = holds.iter().map(|h| h.reason.as_str()).collect();
    let waits: Vec<i64> = holds.iter().map(|h| h.retry_after_ms.max(0)).collect();
    let sql = format!(
        "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
         u AS (SELECT * FROM unnest($6::uuid[], $7::text[], $8::bigint[]) AS u(tx_id, reason, wait_ms)),
         held AS (
             UPDATE managed_tx m SET
                 hold_reason = u.reason,
                 held_since = coalesce(m.held_since, clock_timestamp()),
                 hold_attempts = least(m.hold_attempts, 2147483646) + 1,
                 hold_retry_at = clock_timestamp() + u.wait_ms * interval '1 millisecond',
                 updated_at = now()
             FROM u
             WHERE m.tx_id = u.tx_id AND {SIGNER_ROW} AND m.state = $9
               AND EXISTS (SELECT 1 FROM fence_ok)
             RETURNING m.tx_id)
         SELECT tx_id FROM held UNION ALL SELECT NULL FROM fence_ok"
    );
    let out: Vec<(Option<Uuid>,)> = w
        .fetch_all("hold requests", &sql, |q| {
            q.bind(ids)
                .bind(reasons)
                .bind(waits)
                .bind(TxState::Received.as_str())
        })
        .await?;
    txstore::ids_or_fenced(w, "hold requests", out)
}

/// A RECEIVED request of the signer, as a drive's simulation reads it: the row, whether it names
/// a parent, and its hold.
#[derive(Debug, Clone)]
pub struct ReceivedRow {
    pub row: TxRow,
    /// It depends on another request (`depends_on_request_id`): [`parents`] tells which.
    pub chained: bool,
    /// Held alone (`hold_reason` set): the attempts so far, and whether its back-off has not run
    /// out yet by the database clock (not simulated in this drive).
    pub hold: Option<RequestHoldState>,
    /// Back in RECEIVED after a reorg deeper than the required confirmations undid its
    /// confirmed transaction (`reorg_generation > 0`): re-evaluated before a new nonce.
    pub reevaluated: bool,
}

/// The hold of a RECEIVED request held alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHoldState {
    pub attempts: i32,
    pub waiting: bool,
}

#[derive(sqlx::FromRow)]
struct ReceivedRaw {
    #[sqlx(flatten)]
    row: txstore::RawRow,
    chained: bool,
    held: bool,
    hold_attempts: i32,
    waiting: bool,
    reevaluated: bool,
}

/// The signer's RECEIVED requests, oldest first, with whether each is chained and its hold, in
/// one statement (of the open-state index: the state written out).
pub async fn received(pool: &PgPool, key: &LeaseKey) -> Result<Vec<ReceivedRow>, ReadError> {
    let raw: Vec<ReceivedRaw> = sqlx::query_as(&format!(
        "SELECT {}, depends_on_request_id IS NOT NULL AS chained,
                hold_reason IS NOT NULL AS held, hold_attempts,
                coalesce(hold_retry_at > clock_timestamp(), false) AS waiting,
                reorg_generation > 0 AS reevaluated
         FROM managed_tx
         WHERE chain_id = $1 AND signer = $2 AND {}
         ORDER BY created_at, tx_id",
        txstore::ROW_COLUMNS,
        txstore::state_in("state", &[TxState::Received])
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .fetch_all(pool)
    .await
    .map_err(ReadError::Db)?;
    raw.into_iter()
        .map(|r| {
            Ok(ReceivedRow {
                row: txstore::typed(r.row)?,
                chained: r.chained,
                hold: r.held.then_some(RequestHoldState {
                    attempts: r.hold_attempts,
                    waiting: r.waiting,
                }),
                reevaluated: r.reevaluated,
            })
        })
        .collect()
}

/// PENDING_APPROVAL → SIMULATED, the approver recorded.
pub async fn approve(w: &mut Fenced<'_>, rows: &[MoveRow]) -> Result<Vec<Landed>, FenceError> {
    txstore::apply(w, APPROVE, rows).await
}

/// SIMULATED / REPLACED → ALLOCATED: every row must move (they were read under the lease).
pub async fn allocate(w: &mut Fenced<'_>, rows: &[MoveRow]) -> Result<Vec<Landed>, FenceError> {
    txstore::apply_all(w, ALLOCATE, rows).await
}

/// ALLOCATED → FAILED (cancelled before signing), nonce released.
pub async fn cancel_allocated(
    w: &mut Fenced<'_>,
    rows: &[MoveRow],
) -> Result<Vec<Landed>, FenceError> {
    txstore::apply(w, FAIL_ALLOCATED, rows).await
}

/// No-ops created in ALLOCATED on released nonces: every one must land.
pub async fn fill_noops(w: &mut Fenced<'_>, rows: &[NewTx]) -> Result<Vec<Uuid>, FenceError> {
    let created = txstore::create(w, rows).await?;
    if created.len() != rows.len() {
        return Err(FenceError::Moved {
            operation: "fill released nonce",
            expected: rows.len(),
            moved: rows.len() - created.len(),
        });
    }
    Ok(created)
}

/// The transaction a command names, if it is the signer's, locked.
pub async fn command_target(w: &mut Fenced<'_>, tx_id: Uuid) -> Result<Option<TxRow>, ReadError> {
    Ok(txstore::lock_rows(w, &[tx_id]).await?.pop())
}

/// Where a transaction that is not the writer's signer's is, if it exists at all: `(chain_id,
/// signer)`. A plain read (no lock, no fence): the row is another signer's and is not touched.
pub async fn owner_of(
    w: &mut Fenced<'_>,
    tx_id: Uuid,
) -> Result<Option<(i64, String)>, FenceError> {
    Ok(w.read(
        "command owner",
        sqlx::query_as("SELECT chain_id, signer FROM managed_tx WHERE tx_id = $1").bind(tx_id),
    )
    .await?
    .pop())
}

/// The states whose transactions the allocator drives.
pub const DRIVEN: [TxState; 3] = [TxState::Received, TxState::Simulated, TxState::Replaced];

/// Signers with work for the allocator: transactions to simulate or allocate, and released
/// nonces nobody has taken yet (filled by no-ops).
pub async fn pending_signers(
    pool: &PgPool,
    chain_id: ChainId,
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let mut signers = txstore::signers_in_states(pool, chain_id, &DRIVEN).await?;
    let released: Vec<(i64, String)> =
        sqlx::query_as("SELECT DISTINCT chain_id, signer FROM recycled_nonces WHERE chain_id = $1")
            .bind(chain_id.0)
            .fetch_all(pool)
            .await?;
    for (chain_id, signer) in released {
        if let Ok(s) = Signer::parse(&signer) {
            let key = (ChainId(chain_id), s);
            if !signers.contains(&key) {
                signers.push(key);
            }
        }
    }
    Ok(signers)
}

/// The signer's transactions in `states`, oldest first.
pub async fn rows(
    pool: &PgPool,
    key: &LeaseKey,
    states: &[TxState],
) -> Result<Vec<TxRow>, ReadError> {
    txstore::rows_in_states(pool, key.chain_id, &key.signer, states, false, i64::MAX).await
}

/// The signer's transactions in `states`, oldest first, at most `limit`.
pub async fn rows_limited(
    pool: &PgPool,
    key: &LeaseKey,
    states: &[TxState],
    limit: i64,
) -> Result<Vec<TxRow>, ReadError> {
    txstore::rows_in_states(pool, key.chain_id, &key.signer, states, false, limit).await
}

/// What an allocator drive reads of its signer before it starts, in one statement of index
/// lookups (the states written out, `txstore::state_in`, so that the open-state index serves
/// each whatever the plan): what allocation, the fill of released nonces and the signer's hold
/// would otherwise read one statement each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct DriveSnapshot {
    /// How many of the signer's nonces are in flight ([`IN_FLIGHT`]): its cost follows the
    /// signer's transactions in flight, not its history. Read before the allocation's
    /// transaction: while the allocator holds the signer's lock, only the later stages move
    /// these rows, and on (fewer in flight) but for a reorg (MINED back to SUBMITTED), which may
    /// take the count over the budget; drives then wait until it is back under.
    pub in_flight: i64,
    /// A transaction waits for a nonce (SIMULATED or REPLACED): allocation reads them.
    pub waiting: bool,
    /// A REPLACED transaction: the cursor is behind the chain.
    pub replaced: bool,
    /// The nonce cursor was aligned with the chain within `nonce.state_timeout`.
    pub cursor_fresh: bool,
    /// Released nonces wait for a no-op (`recycled_nonces`).
    pub released: i64,
    /// The allocator holds the signer (`signer_holds`): it cannot pay for anything.
    pub held: bool,
}

/// The signer's [`DriveSnapshot`], `cursor_timeout` being `nonce.state_timeout`.
pub async fn drive_snapshot(
    pool: &PgPool,
    key: &LeaseKey,
    cursor_timeout: Duration,
) -> Result<DriveSnapshot, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT
           (SELECT count(*) FROM managed_tx
             WHERE chain_id = $1 AND signer = $2 AND {in_flight}) AS in_flight,
           EXISTS (SELECT 1 FROM managed_tx
                    WHERE chain_id = $1 AND signer = $2 AND {waiting}) AS waiting,
           EXISTS (SELECT 1 FROM managed_tx
                    WHERE chain_id = $1 AND signer = $2 AND {replaced}) AS replaced,
           EXISTS (SELECT 1 FROM signer_nonce_cursor
                    WHERE chain_id = $1 AND signer = $2
                      AND synced_at > clock_timestamp() - $3 * interval '1 millisecond') AS cursor_fresh,
           (SELECT count(*) FROM recycled_nonces WHERE chain_id = $1 AND signer = $2) AS released,
           EXISTS (SELECT 1 FROM signer_holds
                    WHERE role = $4 AND chain_id = $1 AND signer = $2) AS held",
        in_flight = txstore::state_in("state", &IN_FLIGHT),
        waiting = txstore::state_in("state", &[TxState::Simulated, TxState::Replaced]),
        replaced = txstore::state_in("state", &[TxState::Replaced]),
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(i64::try_from(cursor_timeout.as_millis()).unwrap_or(i64::MAX))
    .bind(key.role.as_str())
    .fetch_one(pool)
    .await
}

/// How many released nonces of the signer wait for a no-op.
pub async fn released_nonces(pool: &PgPool, key: &LeaseKey) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM recycled_nonces WHERE chain_id = $1 AND signer = $2")
        .bind(key.chain_id.0)
        .bind(key.signer.as_str())
        .fetch_one(pool)
        .await
}

/// The states whose transactions count against the in-flight budget (`nonce.max_in_flight`):
/// those that hold a nonce the chain has not consumed yet. MINED and REVERTED hold theirs too
/// ([`TxState::holds_nonce`]), but the chain consumed it: they are no longer in flight, and a
/// reorg that undoes one takes it back to SUBMITTED, where it counts again. REPLACED holds none
/// (another transaction took its nonce): it waits for a new one like a SIMULATED request, and
/// takes it within the budget. PENDING_APPROVAL and FAILED hold none.
pub const IN_FLIGHT: [TxState; 3] = [TxState::Allocated, TxState::Signed, TxState::Submitted];

/// The in-flight states whose nonces the chain cannot have used: not sent yet.
const UNSENT: [TxState; 2] = [TxState::Allocated, TxState::Signed];

/// The signer's nonces in flight that the chain has not used yet: those of [`DriveSnapshot::in_flight`] at
/// or above `latest` (the chain's latest nonce). What the snapshot counts by state alone includes
/// transactions mined whose receipt is not recorded yet (the receipt checker behind or down).
pub async fn in_flight_from(
    pool: &PgPool,
    key: &LeaseKey,
    latest: i64,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM managed_tx
         WHERE chain_id = $1 AND signer = $2 AND {} AND nonce >= $3",
        txstore::state_in("state", &IN_FLIGHT)
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(latest)
    .fetch_one(pool)
    .await
}

/// The signer's transactions in PENDING_APPROVAL for longer than `timeout` (`approval.timeout`),
/// oldest first, by the database clock: `updated_at` is the time of the move to
/// PENDING_APPROVAL, since nothing else writes a row in that state (a hold is a RECEIVED
/// request's). The state is written out so that the open-state index serves it.
pub async fn expired_approvals(
    pool: &PgPool,
    key: &LeaseKey,
    timeout: Duration,
) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "SELECT tx_id FROM managed_tx
         WHERE chain_id = $1 AND signer = $2 AND {}
           AND updated_at < clock_timestamp() - $3 * interval '1 millisecond'
         ORDER BY updated_at, tx_id",
        txstore::state_in("state", &[TxState::PendingApproval])
    ))
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX))
    .fetch_all(pool)
    .await
}

/// The signers of `chain_id` with a transaction in PENDING_APPROVAL for longer than `timeout`:
/// the recovery scan drives them so that the expiry is applied without a message. It reads the
/// chain's PENDING_APPROVAL entries of the open-state index (few: each waits for an operator).
pub async fn signers_with_expired_approvals(
    pool: &PgPool,
    chain_id: ChainId,
    timeout: Duration,
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT DISTINCT chain_id, signer FROM managed_tx
         WHERE chain_id = $1 AND {}
           AND updated_at < clock_timestamp() - $2 * interval '1 millisecond'",
        txstore::state_in("state", &[TxState::PendingApproval])
    ))
    .bind(chain_id.0)
    .bind(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX))
    .fetch_all(pool)
    .await?;
    Ok(txstore::signer_keys(rows))
}

/// The signers of `chain_id` with transactions waiting for a nonce (SIMULATED, REPLACED) and
/// fewer than `max_in_flight` nonces in flight that were not sent yet (ALLOCATED, SIGNED): those
/// whose waiting requests mining may have let go on since their last drive (or that a drive has
/// not reached yet). The stage runtime drives them between recovery scans
/// (`Handler::ready_signers`), so that a signer at the budget goes on about a second after
/// mining frees it rather than at the next scan. SUBMITTED transactions do not keep a signer
/// out: the chain may have used their nonces while their receipts are not recorded yet (the
/// receipt checker polls behind the chain), and the drive asks the chain at the budget
/// (`in_flight_from`) — a signer whose sent transactions are really unmined costs that drive
/// (three reads and one call) every tick. A signer at the budget with nothing sent is not
/// named: the chain cannot have used those nonces. Both reads are of the open-state index
/// (states written out), so the cost follows the transactions in flight.
pub async fn ready_signers(
    pool: &PgPool,
    chain_id: ChainId,
    max_in_flight: u32,
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT w.chain_id, w.signer
         FROM (SELECT DISTINCT chain_id, signer FROM managed_tx
               WHERE chain_id = $1 AND {waiting}) w
         WHERE (SELECT count(*) FROM managed_tx f
                WHERE f.chain_id = w.chain_id AND f.signer = w.signer AND {in_flight}) < $2",
        waiting = txstore::state_in("state", &[TxState::Simulated, TxState::Replaced]),
        in_flight = txstore::state_in("f.state", &UNSENT),
    ))
    .bind(chain_id.0)
    .bind(i64::from(max_in_flight))
    .fetch_all(pool)
    .await?;
    Ok(txstore::signer_keys(rows))
}
