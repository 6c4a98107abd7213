//! Fenced writes: the only way to reach the critical tables (`signer_nonce_cursor`,
//! `recycled_nonces`, and later `managed_tx` and `tx_attempts`).
//!
//! A [`FencedTx`] is a PostgreSQL transaction opened from a [`HeldLease`]. Every statement it runs
//! carries the fencing predicate (ARCHITECTURE §4): the lease row must still name this node and
//! token and must not have expired, checked in the same statement, by the database clock. A
//! statement that matches no row because of it is a typed [`FenceError::Fenced`], never a silent
//! no-op. [`FencedTx::commit`] checks the lease once more and takes a share lock on the lease row,
//! so a steal cannot slip in between the check and the commit: a late commit of an old owner is
//! impossible. A paused owner cannot block a steal for long either: the transaction runs with
//! `idle_in_transaction_session_timeout` set to twice the lease duration, and a session ended
//! that way surfaces as `Fenced` too.

use sqlx::postgres::{PgArguments, PgPool};
use sqlx::query::{Query, QueryAs};
use sqlx::{PgConnection, Postgres, Row, Transaction};
use std::sync::LazyLock;

use crate::lease::HeldLease;
use crate::retry::{Classify, Retry};
use crate::telemetry;

/// The fencing predicate; the fence is bound as `$1`..`$5` (role, chain id, signer, node, token).
pub const FENCE_PREDICATE: &str = "EXISTS (SELECT 1 FROM signer_lease fence \
     WHERE fence.role = $1 AND fence.chain_id = $2 AND fence.signer = $3 \
       AND fence.owner_node = $4 AND fence.fencing_token = $5 \
       AND fence.expires_at > clock_timestamp())";

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// The lease is no longer held with this token: stop acting for this signer, roll back,
    /// back off and re-acquire.
    #[error(
        "fenced during {operation}: the {role} lease for {chain_id}:{signer} is no longer held by {node} with token {token}"
    )]
    Fenced {
        operation: &'static str,
        role: String,
        chain_id: i64,
        signer: String,
        node: String,
        token: i64,
    },
    /// The lease is current but rows expected in a state had moved on (a compare-and-set miss:
    /// another task of this node, or an operator's command, moved them first). Nothing of the
    /// transaction applies; retry after reading again. Never a lost lease.
    #[error("{operation}: {moved} of {expected} rows were no longer in the expected state")]
    Moved {
        operation: &'static str,
        expected: usize,
        moved: usize,
    },
    /// A statement without the fencing predicate was offered as a critical write: a bug.
    #[error("{operation}: refused to run a critical write without the fencing predicate")]
    Unfenced { operation: &'static str },
    #[error("database error during {operation}")]
    Db {
        operation: &'static str,
        #[source]
        source: sqlx::Error,
    },
}

/// SQLSTATE of a session ended by `idle_in_transaction_session_timeout`.
const IDLE_IN_TRANSACTION_TIMEOUT: &str = "25P03";

impl FenceError {
    pub fn is_fenced(&self) -> bool {
        matches!(self, FenceError::Fenced { .. })
    }
}

impl Classify for FenceError {
    fn retry(&self) -> Retry {
        match self {
            // The write must not be retried as is: the caller re-acquires first.
            FenceError::Fenced { .. } => Retry::Permanent,
            FenceError::Unfenced { .. } => Retry::Permanent,
            FenceError::Db { .. } | FenceError::Moved { .. } => Retry::Transient,
        }
    }
}

/// A database error inside a fenced transaction; a session ended for idling past twice the lease
/// (the owner was paused) is reported as `Fenced`: nothing of the transaction was applied.
fn db_error(lease: &HeldLease, operation: &'static str, source: sqlx::Error) -> FenceError {
    let idle_timeout = source
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|c| c == IDLE_IN_TRANSACTION_TIMEOUT);
    if idle_timeout {
        return fenced_error(lease, operation);
    }
    FenceError::Db { operation, source }
}

/// Reports a write refused by the fence.
fn write_fenced(lease: &HeldLease, operation: &str) {
    telemetry::WriteFenced {
        role: lease.key.role,
        chain_id: lease.key.chain_id,
        signer: &lease.key.signer,
        node: &lease.node,
        fencing_token: lease.token,
        operation,
    }
    .emit();
}

fn fenced_error(lease: &HeldLease, operation: &'static str) -> FenceError {
    write_fenced(lease, operation);
    FenceError::Fenced {
        operation,
        role: lease.key.role.as_str().to_string(),
        chain_id: lease.key.chain_id.0,
        signer: lease.key.signer.as_str().to_string(),
        node: lease.node.as_str().to_string(),
        token: lease.token.0,
    }
}

fn bind_fence<'q>(
    l: &HeldLease,
    q: Query<'q, Postgres, PgArguments>,
) -> Query<'q, Postgres, PgArguments> {
    q.bind(l.key.role.as_str())
        .bind(l.key.chain_id.0)
        .bind(l.key.signer.as_str().to_string())
        .bind(l.node.as_str().to_string())
        .bind(l.token.0)
}

fn bind_fence_as<'q, T>(
    l: &HeldLease,
    q: QueryAs<'q, Postgres, T, PgArguments>,
) -> QueryAs<'q, Postgres, T, PgArguments> {
    q.bind(l.key.role.as_str())
        .bind(l.key.chain_id.0)
        .bind(l.key.signer.as_str().to_string())
        .bind(l.node.as_str().to_string())
        .bind(l.token.0)
}

/// Run at the start of every batch transaction: the idle timeout ([`idle_timeout_ms`]) and
/// custom plans for its statements. A batch transaction holds the messages of a poll, up to
/// `batch_max` rows per signer, and its `create` joins the batch's `unnest`ed arrays to the rows
/// it inserted: a generic plan assumes 10 array elements whatever the batch (a nested loop that
/// rescans the array per row: 500 × 500 for one hot signer), so each execution is planned for its
/// own batch. Fenced transactions (drives) run with generic plans instead ([`BEGIN_FENCED`]).
const SET_IDLE_TIMEOUT: &str = "SELECT set_config('idle_in_transaction_session_timeout', $1, true),
            set_config('plan_cache_mode', 'force_custom_plan', true)";

/// A `managed_tx` row (alias `m`) of the fenced signer (`$2`, `$3`), written so that no index can
/// serve it: statements that join an array or an id list to `managed_tx` reach each row by
/// primary key and only check it against the signer, whatever plan a generic planning picks
/// (the doc of the private `BEGIN_FENCED` says why).
pub const SIGNER_ROW: &str = "m.chain_id + 0 = $2 AND m.signer || '' = $3";

/// The first statement of a fenced transaction (a drive's): its settings, local to it, and the
/// first check of the lease, in one round trip. The idle timeout is `$6` ([`idle_timeout_ms`]);
/// the others are [`crate::db::STAGE_SETTINGS`] (generic plans made once per connection and
/// statement, no sequential scans, no JIT, no parallel workers), set here too so that a drive
/// keeps them on any pool. Planning was the largest single cost of PostgreSQL's CPU in the
/// pipeline: the state machine's move statement took 0.5-0.75 ms to plan, once per execution,
/// and planning was 2.8-3.2 s of the ~11 s of statement time of a 2,000-request run; with generic
/// plans here 1.2-1.4 s, and the bench database's CPU fell from 5.7-5.9 to 4.5-4.6 s (`txflow
/// bench --compare --signers 50 --txs 40`, docs/performance.md, "Where PostgreSQL's time goes").
///
/// A generic plan is made without the parameters' values, often on a table that was nearly empty
/// when the connection first ran the statement, and kept until the table's statistics change. So
/// the statements of drives are written to have one good plan whatever the table: rows are
/// reached by primary key (`tx_id`) from the batch's array or id list, and the signer's own
/// predicate is written [`SIGNER_ROW`], `m.chain_id + 0 = $2 AND m.signer || '' = $3`, which no
/// index can serve, so that no plan reads the signer's whole history through its `(chain_id, signer, …)` indexes
/// (the plan an estimate of "a few rows per signer" picks, made on an empty table); queries by
/// state name their states as literals, so that the partial indexes stay usable
/// (`txstore::state_in`); and sequential scans are off, since a plan made on an empty table would
/// otherwise scan it, and go on scanning it once it has grown (seen: a 500-row move at 96 ms, a
/// sequential scan of `managed_tx` joined to a rescan of the array; 2,200 instead of 9,000
/// nonces/s on the first run of a fresh database). `tests/tests/batch_plans.rs` reads the
/// executed plans of a drive's moves.
static BEGIN_FENCED: LazyLock<String> = LazyLock::new(|| {
    let settings: Vec<String> = crate::db::STAGE_SETTINGS
        .iter()
        .map(|(name, value)| format!("set_config('{name}', '{value}', true)"))
        .collect();
    format!(
        "SELECT set_config('idle_in_transaction_session_timeout', $6, true), {}, \
         {FENCE_PREDICATE} AS current",
        settings.join(", ")
    )
});

/// Twice the lease duration, in milliseconds: how long a fenced transaction may sit idle before
/// PostgreSQL ends its session.
fn idle_timeout_ms(lease: &HeldLease) -> i64 {
    i64::try_from(lease.config.duration.as_millis())
        .unwrap_or(i64::MAX / 2)
        .saturating_mul(2)
        .max(1)
}

/// `(next_nonce, synced_at)` of a signer's nonce cursor.
pub type CursorState = (i64, Option<chrono::DateTime<chrono::Utc>>);

/// A transaction that may write critical state for one (role, chain, signer), as long as the lease
/// it was opened with is current.
#[derive(Debug)]
pub struct FencedTx {
    tx: Transaction<'static, Postgres>,
    lease: HeldLease,
}

impl HeldLease {
    /// Opens a fenced transaction. Fails with `Fenced` if the lease is already no longer current.
    pub async fn begin(&self, pool: &PgPool) -> Result<FencedTx, FenceError> {
        let op = "begin";
        let mut tx = pool.begin().await.map_err(|source| FenceError::Db {
            operation: op,
            source,
        })?;
        // Twice the lease: an owner paused that long has lost its lease, and its session (with any
        // row locks it holds) is ended by PostgreSQL so that the new owner is not blocked.
        // The settings and the first check of the lease in one round trip.
        let timeout = idle_timeout_ms(self);
        let current: bool = bind_fence(self, sqlx::query(BEGIN_FENCED.as_str()))
            .bind(timeout.to_string())
            .fetch_one(&mut *tx)
            .await
            .and_then(|row| row.try_get("current"))
            .map_err(|source| db_error(self, op, source))?;
        if !current {
            return Err(fenced_error(self, op));
        }
        Ok(FencedTx {
            tx,
            lease: self.clone(),
        })
    }
}

impl FencedTx {
    pub fn lease(&self) -> &HeldLease {
        &self.lease
    }

    /// The writer for this transaction's critical statements.
    pub fn writer(&mut self) -> Fenced<'_> {
        Fenced {
            conn: &mut self.tx,
            lease: &self.lease,
        }
    }

    /// Verifies the lease in this transaction and takes a share lock on the lease row, so that it
    /// cannot change before this transaction ends (the check at commit; the one at `begin` is in
    /// its settings statement).
    async fn check_locked(&mut self, operation: &'static str) -> Result<(), FenceError> {
        let sql = "SELECT 1 FROM signer_lease fence WHERE fence.role = $1 AND fence.chain_id = $2 \
             AND fence.signer = $3 AND fence.owner_node = $4 AND fence.fencing_token = $5 \
             AND fence.expires_at > clock_timestamp() FOR SHARE";
        let found = bind_fence(&self.lease, sqlx::query(sql))
            .fetch_optional(&mut *self.tx)
            .await
            .map_err(|source| db_error(&self.lease, operation, source))?;
        match found {
            Some(_) => Ok(()),
            None => Err(fenced_error(&self.lease, operation)),
        }
    }

    /// Commits, after checking once more (under a share lock on the lease row) that the lease is
    /// current. On `Fenced` nothing of this transaction is applied.
    pub async fn commit(mut self) -> Result<(), FenceError> {
        self.check_locked("commit").await?;
        let FencedTx { tx, lease } = self;
        tx.commit()
            .await
            .map_err(|source| db_error(&lease, "commit", source))
    }

    /// Rolls back everything written in this transaction.
    pub async fn rollback(self) -> Result<(), FenceError> {
        let FencedTx { tx, lease } = self;
        tx.rollback()
            .await
            .map_err(|source| db_error(&lease, "rollback", source))
    }

    /// See [`Fenced::execute`].
    pub async fn execute<'q>(
        &mut self,
        operation: &'static str,
        sql: &'q str,
        bind: impl FnOnce(Query<'q, Postgres, PgArguments>) -> Query<'q, Postgres, PgArguments>,
    ) -> Result<u64, FenceError> {
        self.writer().execute(operation, sql, bind).await
    }

    /// See [`Fenced::allocate_nonces`].
    pub async fn allocate_nonces(&mut self, n: u32) -> Result<Vec<i64>, FenceError> {
        self.writer().allocate_nonces(n).await
    }

    /// See [`Fenced::align_cursor`].
    pub async fn align_cursor(&mut self, chain_pending: i64) -> Result<i64, FenceError> {
        self.writer().align_cursor(chain_pending).await
    }

    /// See [`Fenced::release_nonce`].
    pub async fn release_nonce(&mut self, nonce: i64) -> Result<(), FenceError> {
        self.writer().release_nonce(nonce).await
    }

    /// See [`Fenced::cursor`].
    pub async fn cursor(&mut self) -> Result<Option<CursorState>, FenceError> {
        self.writer().cursor().await
    }
}

/// Critical statements for one lease over a connection inside a transaction: of a [`FencedTx`],
/// or of one signer's savepoint in a [`BatchTx`]. Every write carries the fencing predicate.
pub struct Fenced<'c> {
    conn: &'c mut PgConnection,
    lease: &'c HeldLease,
}

impl Fenced<'_> {
    pub fn lease(&self) -> &HeldLease {
        self.lease
    }

    /// Refuses SQL that does not carry the fencing predicate: a programming error, reported as
    /// such rather than run unfenced.
    fn require_fence(operation: &'static str, sql: &str) -> Result<(), FenceError> {
        if sql.contains(FENCE_PREDICATE) {
            Ok(())
        } else {
            Err(FenceError::Unfenced { operation })
        }
    }

    /// Runs a critical write. `sql` must contain [`FENCE_PREDICATE`] (the fence is bound as
    /// `$1`..`$5`; `bind` adds the statement's own parameters from `$6`). Zero rows affected is
    /// `Fenced`: use this for statements that always touch a row when the lease is current.
    pub async fn execute<'q>(
        &mut self,
        operation: &'static str,
        sql: &'q str,
        bind: impl FnOnce(Query<'q, Postgres, PgArguments>) -> Query<'q, Postgres, PgArguments>,
    ) -> Result<u64, FenceError> {
        Self::require_fence(operation, sql)?;
        let q = bind(bind_fence(self.lease, sqlx::query(sql)));
        let done = q
            .execute(&mut *self.conn)
            .await
            .map_err(|source| db_error(self.lease, operation, source))?;
        match done.rows_affected() {
            0 => Err(self.fenced(operation)),
            n => Ok(n),
        }
    }

    /// Runs a critical statement with `RETURNING` and returns its rows, which may be none (the
    /// caller decides whether none means fenced). `sql` must contain [`FENCE_PREDICATE`].
    pub async fn fetch_all<'q, T>(
        &mut self,
        operation: &'static str,
        sql: &'q str,
        bind: impl FnOnce(
            QueryAs<'q, Postgres, T, PgArguments>,
        ) -> QueryAs<'q, Postgres, T, PgArguments>,
    ) -> Result<Vec<T>, FenceError>
    where
        T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        Self::require_fence(operation, sql)?;
        let q = bind(bind_fence_as(self.lease, sqlx::query_as(sql)));
        q.fetch_all(&mut *self.conn)
            .await
            .map_err(|source| db_error(self.lease, operation, source))
    }

    /// Runs a critical statement with `RETURNING` that yields one row when the lease is current;
    /// no row is `Fenced`. `sql` must contain [`FENCE_PREDICATE`].
    pub async fn fetch_one<'q, T>(
        &mut self,
        operation: &'static str,
        sql: &'q str,
        bind: impl FnOnce(
            QueryAs<'q, Postgres, T, PgArguments>,
        ) -> QueryAs<'q, Postgres, T, PgArguments>,
    ) -> Result<T, FenceError>
    where
        T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        let mut rows = self.fetch_all(operation, sql, bind).await?;
        match rows.pop() {
            Some(row) => Ok(row),
            None => Err(self.fenced(operation)),
        }
    }

    /// Reads in this transaction (no fence needed to read; nothing is written).
    pub async fn read<'q, T>(
        &mut self,
        operation: &'static str,
        query: QueryAs<'q, Postgres, T, PgArguments>,
    ) -> Result<Vec<T>, FenceError>
    where
        T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        query
            .fetch_all(&mut *self.conn)
            .await
            .map_err(|source| db_error(self.lease, operation, source))
    }

    /// The `Fenced` error for `operation`, reported through telemetry.
    pub fn fenced(&self, operation: &'static str) -> FenceError {
        fenced_error(self.lease, operation)
    }

    // ---- nonce cursor (seed 001 §6.2, seed 003 recycled nonces) ----

    /// Allocates `n` nonces for the signer in one statement: the lowest recycled ones first, then
    /// the next ones from the cursor (created at 0 if the signer has none). Ascending.
    pub async fn allocate_nonces(&mut self, n: u32) -> Result<Vec<i64>, FenceError> {
        let sql = format!(
            "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
             pick AS (
                 SELECT nonce FROM recycled_nonces
                 WHERE chain_id = $2 AND signer = $3 AND EXISTS (SELECT 1 FROM fence_ok)
                 ORDER BY nonce LIMIT $6 FOR UPDATE),
             recycled AS (
                 DELETE FROM recycled_nonces r USING pick
                 WHERE r.chain_id = $2 AND r.signer = $3 AND r.nonce = pick.nonce
                 RETURNING r.nonce),
             fresh AS (SELECT $6 - (SELECT count(*) FROM recycled) AS n),
             cursor AS (
                 INSERT INTO signer_nonce_cursor AS c (chain_id, signer, next_nonce, fencing_token, updated_at)
                 SELECT $2, $3, fresh.n, $5, clock_timestamp() FROM fresh, fence_ok
                 ON CONFLICT (chain_id, signer) DO UPDATE
                    SET next_nonce = c.next_nonce + EXCLUDED.next_nonce, fencing_token = $5,
                        updated_at = clock_timestamp()
                    WHERE c.fencing_token <= $5
                 RETURNING c.next_nonce)
             SELECT nonce FROM recycled
             UNION ALL
             SELECT generate_series(cursor.next_nonce - fresh.n, cursor.next_nonce - 1) FROM cursor, fresh
             ORDER BY 1"
        );
        let rows: Vec<(i64,)> = self
            .fetch_all("allocate_nonces", &sql, |q| q.bind(i64::from(n)))
            .await?;
        if rows.len() as u64 != u64::from(n) {
            return Err(self.fenced("allocate_nonces"));
        }
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    /// Aligns the cursor with the chain's pending nonce, `next = max(cursor, chain)`, and drops
    /// recycled nonces below the chain's (they were consumed on chain). Returns the new `next`.
    pub async fn align_cursor(&mut self, chain_pending: i64) -> Result<i64, FenceError> {
        let sql = format!(
            "WITH fence_ok AS (SELECT 1 AS ok WHERE {FENCE_PREDICATE}),
             dropped AS (
                 DELETE FROM recycled_nonces
                 WHERE chain_id = $2 AND signer = $3 AND nonce < $6 AND EXISTS (SELECT 1 FROM fence_ok))
             INSERT INTO signer_nonce_cursor AS c (chain_id, signer, next_nonce, fencing_token, synced_at, updated_at)
             SELECT $2, $3, $6, $5, clock_timestamp(), clock_timestamp() FROM fence_ok
             ON CONFLICT (chain_id, signer) DO UPDATE
                SET next_nonce = GREATEST(c.next_nonce, $6), fencing_token = $5,
                    synced_at = clock_timestamp(), updated_at = clock_timestamp()
                WHERE c.fencing_token <= $5
             RETURNING c.next_nonce"
        );
        let (next,): (i64,) = self
            .fetch_one("align_cursor", &sql, |q| q.bind(chain_pending))
            .await?;
        Ok(next)
    }

    /// Puts `nonce` back for reuse by the next allocation of this signer.
    pub async fn release_nonce(&mut self, nonce: i64) -> Result<(), FenceError> {
        let sql = format!(
            "INSERT INTO recycled_nonces (chain_id, signer, nonce, released_at)
             SELECT $2, $3, $6, clock_timestamp() WHERE {FENCE_PREDICATE}
             ON CONFLICT (chain_id, signer, nonce) DO UPDATE SET released_at = EXCLUDED.released_at"
        );
        self.execute("release_nonce", &sql, |q| q.bind(nonce))
            .await
            .map(|_| ())
    }

    /// The cursor's state: `(next_nonce, synced_at)`, or `None` if the signer has none yet.
    pub async fn cursor(
        &mut self,
    ) -> Result<Option<(i64, Option<chrono::DateTime<chrono::Utc>>)>, FenceError> {
        let key = &self.lease.key;
        let q = sqlx::query_as("SELECT next_nonce, synced_at FROM signer_nonce_cursor WHERE chain_id = $1 AND signer = $2")
            .bind(key.chain_id.0)
            .bind(key.signer.as_str().to_string());
        Ok(self.read("cursor", q).await?.pop())
    }
}

/// Why a batch did not commit.
#[derive(Debug, thiserror::Error)]
pub enum BatchCommitError {
    /// These leases were no longer current at commit: the whole batch was rolled back.
    #[error("{} lease(s) were lost before the batch committed; nothing was applied", .0.len())]
    Fenced(Vec<HeldLease>),
    /// A batch without savepoints ([`BatchTx::begin_optimistic`]) had a signer's work discarded:
    /// it cannot be undone alone, so the whole batch was rolled back.
    #[error("a signer's work was discarded in a batch without savepoints; nothing was applied")]
    Abandoned,
    #[error("database error during {operation}")]
    Db {
        operation: &'static str,
        #[source]
        source: sqlx::Error,
    },
}

impl Classify for BatchCommitError {
    fn retry(&self) -> Retry {
        Retry::Transient
    }
}

/// One PostgreSQL transaction for a batch of several signers: the stage runtime's unit of
/// commit. The commit re-checks every kept lease under a share lock, as [`FencedTx::commit`]
/// does. Two ways to run it:
/// - guarded ([`BatchTx::begin`]): each signer's work runs in a savepoint of its own, opened with
///   a check of its lease ([`BatchTx::signer`]), so a signer that turns out to be fenced, or whose
///   work fails, is rolled back alone;
/// - optimistic ([`BatchTx::begin_optimistic`]): no savepoint and no check per signer (three
///   round trips fewer per signer: 12-19 % of a pipeline's statements). Every write still
///   carries the fence and the commit still checks every lease; but a signer's work cannot be
///   undone alone, so discarding it abandons the batch ([`BatchCommitError::Abandoned`]). The
///   stage runtime runs a batch optimistically first and, if a signer fails, runs it again
///   guarded (the handlers are idempotent and nothing of the first run was committed).
#[derive(Debug)]
pub struct BatchTx {
    tx: Transaction<'static, Postgres>,
    kept: Vec<HeldLease>,
    savepoints: u32,
    /// Each signer's work in a savepoint of its own.
    guarded: bool,
    /// An optimistic batch had a signer's work discarded: it must not commit.
    abandoned: bool,
}

impl BatchTx {
    /// Begins a guarded batch (a savepoint per signer) whose transaction may idle at most
    /// `idle_timeout` (use twice the lease).
    pub async fn begin(
        pool: &PgPool,
        idle_timeout: std::time::Duration,
    ) -> Result<BatchTx, BatchCommitError> {
        Self::begin_with(pool, idle_timeout, true).await
    }

    /// Begins an optimistic batch: no savepoint and no lease check per signer (see [`BatchTx`]).
    pub async fn begin_optimistic(
        pool: &PgPool,
        idle_timeout: std::time::Duration,
    ) -> Result<BatchTx, BatchCommitError> {
        Self::begin_with(pool, idle_timeout, false).await
    }

    /// Begins a guarded batch ([`BatchTx::begin`]) or an optimistic one
    /// ([`BatchTx::begin_optimistic`]).
    pub async fn begin_with(
        pool: &PgPool,
        idle_timeout: std::time::Duration,
        guarded: bool,
    ) -> Result<BatchTx, BatchCommitError> {
        let db = |source| BatchCommitError::Db {
            operation: "begin batch",
            source,
        };
        let mut tx = pool.begin().await.map_err(db)?;
        let ms = i64::try_from(idle_timeout.as_millis())
            .unwrap_or(i64::MAX)
            .max(1);
        sqlx::query(SET_IDLE_TIMEOUT)
            .bind(ms.to_string())
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        Ok(BatchTx {
            tx,
            kept: Vec::new(),
            savepoints: 0,
            guarded,
            abandoned: false,
        })
    }

    /// Whether each signer's work runs in a savepoint of its own ([`BatchTx::begin`]).
    pub fn guarded(&self) -> bool {
        self.guarded
    }

    /// Opens a savepoint for `lease`'s signer and checks the lease (in an optimistic batch:
    /// neither; its writes' fence and the commit check it). The scope must end with
    /// [`SignerScope::keep`] or [`SignerScope::discard`].
    pub async fn signer<'a>(
        &'a mut self,
        lease: &'a HeldLease,
    ) -> Result<SignerScope<'a>, FenceError> {
        if !self.guarded {
            return Ok(SignerScope {
                batch: self,
                lease,
                savepoint: None,
            });
        }
        self.savepoints += 1;
        let savepoint = format!("signer_{}", self.savepoints);
        sqlx::query(&format!("SAVEPOINT {savepoint}"))
            .execute(&mut *self.tx)
            .await
            .map_err(|source| db_error(lease, "savepoint", source))?;
        let found = bind_fence(
            lease,
            sqlx::query(
                "SELECT 1 FROM signer_lease fence WHERE fence.role = $1 AND fence.chain_id = $2 \
                 AND fence.signer = $3 AND fence.owner_node = $4 AND fence.fencing_token = $5 \
                 AND fence.expires_at > clock_timestamp()",
            ),
        )
        .fetch_optional(&mut *self.tx)
        .await
        .map_err(|source| db_error(lease, "begin signer", source))?;
        let mut scope = SignerScope {
            batch: self,
            lease,
            savepoint: Some(savepoint),
        };
        if found.is_none() {
            scope.rollback_savepoint().await?;
            return Err(fenced_error(lease, "begin signer"));
        }
        Ok(scope)
    }

    /// Commits the kept signers' work after checking, under a share lock on their lease rows,
    /// that every kept lease is still current. If any is not, nothing is applied. The rows are
    /// locked in (role, chain, address) order, the order of every statement that locks several
    /// lease rows ([`crate::lease`]), so that no two of them can deadlock.
    pub async fn commit(mut self) -> Result<(), BatchCommitError> {
        let db = |source| BatchCommitError::Db {
            operation: "commit batch",
            source,
        };
        if self.abandoned {
            self.tx.rollback().await.map_err(db)?;
            return Err(BatchCommitError::Abandoned);
        }
        if !self.kept.is_empty() {
            let roles: Vec<&str> = self.kept.iter().map(|l| l.key.role.as_str()).collect();
            let chains: Vec<i64> = self.kept.iter().map(|l| l.key.chain_id.0).collect();
            let signers: Vec<&str> = self.kept.iter().map(|l| l.key.signer.as_str()).collect();
            let nodes: Vec<&str> = self.kept.iter().map(|l| l.node.as_str()).collect();
            let tokens: Vec<i64> = self.kept.iter().map(|l| l.token.0).collect();
            let current: Vec<(String, i64, String)> = sqlx::query_as(
                "SELECT f.role, f.chain_id, f.signer FROM signer_lease f
                 JOIN unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::bigint[])
                      AS l(role, chain_id, signer, node, token)
                   ON f.role = l.role AND f.chain_id = l.chain_id AND f.signer = l.signer
                  AND f.owner_node = l.node AND f.fencing_token = l.token
                WHERE f.expires_at > clock_timestamp()
                ORDER BY f.role, f.chain_id, f.signer COLLATE \"C\"
                FOR SHARE OF f",
            )
            .bind(&roles)
            .bind(&chains)
            .bind(&signers)
            .bind(&nodes)
            .bind(&tokens)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db)?;
            let lost: Vec<HeldLease> = self
                .kept
                .iter()
                .filter(|l| {
                    !current.iter().any(|(r, c, s)| {
                        r == l.key.role.as_str()
                            && *c == l.key.chain_id.0
                            && s == l.key.signer.as_str()
                    })
                })
                .cloned()
                .collect();
            if !lost.is_empty() {
                for l in &lost {
                    write_fenced(l, "commit batch");
                }
                self.tx.rollback().await.map_err(db)?;
                return Err(BatchCommitError::Fenced(lost));
            }
        }
        self.tx.commit().await.map_err(db)
    }

    /// Rolls back everything of the batch.
    pub async fn rollback(self) -> Result<(), BatchCommitError> {
        self.tx
            .rollback()
            .await
            .map_err(|source| BatchCommitError::Db {
                operation: "rollback batch",
                source,
            })
    }
}

/// One signer's part of a [`BatchTx`].
pub struct SignerScope<'a> {
    batch: &'a mut BatchTx,
    lease: &'a HeldLease,
    /// None in an optimistic batch.
    savepoint: Option<String>,
}

impl SignerScope<'_> {
    /// The writer for this signer's critical statements.
    pub fn writer(&mut self) -> Fenced<'_> {
        Fenced {
            conn: &mut self.batch.tx,
            lease: self.lease,
        }
    }

    /// Rolls back to the signer's savepoint; in an optimistic batch, marks the batch abandoned.
    async fn rollback_savepoint(&mut self) -> Result<(), FenceError> {
        let Some(savepoint) = &self.savepoint else {
            self.batch.abandoned = true;
            return Ok(());
        };
        sqlx::query(&format!("ROLLBACK TO SAVEPOINT {savepoint}"))
            .execute(&mut *self.batch.tx)
            .await
            .map_err(|source| db_error(self.lease, "rollback signer", source))?;
        Ok(())
    }

    /// Keeps this signer's work in the batch.
    pub async fn keep(self) -> Result<(), FenceError> {
        if let Some(savepoint) = &self.savepoint {
            sqlx::query(&format!("RELEASE SAVEPOINT {savepoint}"))
                .execute(&mut *self.batch.tx)
                .await
                .map_err(|source| db_error(self.lease, "keep signer", source))?;
        }
        if !self.batch.kept.iter().any(|l| l.key == self.lease.key) {
            self.batch.kept.push(self.lease.clone());
        }
        Ok(())
    }

    /// Undoes this signer's work; the rest of the batch is unaffected. In an optimistic batch it
    /// cannot be undone alone: the batch is abandoned, and its commit rolls everything back
    /// ([`BatchCommitError::Abandoned`]).
    pub async fn discard(mut self) -> Result<(), FenceError> {
        self.rollback_savepoint().await
    }
}
