//! PostgreSQL: connection pools and the embedded, append-only migrations of `migrations/`.

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

/// A pool of at most `max_connections` connections to `url`.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(DbError::Connect)
}

/// Applies every migration not yet applied; returns how many the database has now.
pub async fn migrate(pool: &PgPool) -> Result<usize, DbError> {
    MIGRATOR.run(pool).await.map_err(DbError::Migrate)?;
    Ok(MIGRATOR.iter().count())
}
