//! PostgreSQL: connection pools and the embedded, append-only migrations of `migrations/`.

use std::sync::LazyLock;
use std::time::Duration;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::retry::{Classify, Retry};

/// The migrations of `migrations/`, compiled into the binary.
pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("connecting to PostgreSQL")]
    Connect(#[source] sqlx::Error),
    #[error("applying migrations")]
    Migrate(#[source] MigrateError),
}

impl Classify for DbError {
    fn retry(&self) -> Retry {
        match self {
            DbError::Connect(_) => Retry::Transient,
            DbError::Migrate(_) => Retry::Permanent,
        }
    }
}

/// The options of every pool: at most `max_connections`, a 10 s wait for a free one.
fn options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
}

/// A pool of at most `max_connections` connections to `url`.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    options(max_connections)
        .connect(url)
        .await
        .map_err(DbError::Connect)
}

/// The settings of every connection of a stage process ([`connect_stages`], as [`STAGE_SESSION`])
/// and of every fenced transaction (`fenced`, local to it): **generic plans**, made once per
/// connection and statement, and sequential scans off. The stages' statements — drives, recovery
/// scans, the outbox relay, the leases — run thousands of times a minute with the same shape;
/// with PostgreSQL's default (`auto`) most were planned at every execution (0.15-0.4 ms each:
/// 1.2 s of the 1.5 s of planning of a 2,000-request bench). They are written for one plan:
/// states as literals so that the partial indexes of the rows in flight serve them whatever the
/// parameters (`txstore::state_in`), rows reached by key. `enable_seqscan = off` is a cost
/// penalty, not a ban: a plan made while a table was empty would otherwise scan it and go on
/// scanning it once it has grown. A batch transaction sets custom plans for itself
/// (`fenced::BatchTx`). `tests/tests/scans.rs` and `tests/tests/batch_plans.rs` read the executed
/// plans on connections with these settings.
///
/// And **no JIT compilation, no parallel workers**: a generic plan is costed without the
/// parameters' values, so its estimate grows with the table. With 1,000,000 final rows in
/// `managed_tx` the signer gateway's and the confirmation manager's recovery scans (the followed
/// rows) got a parallel, JIT-compiled plan: ~28 ms a call for 2 to 25 buffers (JIT off alone: 5-12
/// ms, the workers' start), against 0.003-0.03 ms with both off. These statements read a handful
/// of rows; neither ever pays.
pub const STAGE_SETTINGS: [(&str, &str); 4] = [
    ("plan_cache_mode", "force_generic_plan"),
    ("enable_seqscan", "off"),
    ("jit", "off"),
    ("max_parallel_workers_per_gather", "0"),
];

/// [`STAGE_SETTINGS`] as the statement that sets them for a session.
pub static STAGE_SESSION: LazyLock<String> = LazyLock::new(|| {
    STAGE_SETTINGS
        .iter()
        .map(|(name, value)| format!("SET {name} = {value}"))
        .collect::<Vec<_>>()
        .join("; ")
});

/// A pool for stage runtimes: as [`connect`], each connection with [`STAGE_SESSION`].
pub async fn connect_stages(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    options(max_connections)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(conn, STAGE_SESSION.as_str()).await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .map_err(DbError::Connect)
}

/// Applies every migration not yet applied; returns how many the database has now.
pub async fn migrate(pool: &PgPool) -> Result<usize, DbError> {
    MIGRATOR.run(pool).await.map_err(DbError::Migrate)?;
    Ok(MIGRATOR.iter().count())
}
