use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection};

use crate::services;

/// Every test database's name starts so: `txflow_test_{created, unix seconds}_{12 hex digits}`.
/// (Before the creation time was in the name: `txflow_test_{12 hex digits}`.)
const PREFIX: &str = "txflow_test_";

/// A test database this old was left by a run that was killed (no destructor ran): no test runs
/// for anything near this long (nextest kills a test after 10 minutes).
const ABANDONED_AFTER: Duration = Duration::from_secs(2 * 3600);

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A new test database's name, with its creation time.
fn new_name() -> String {
    format!(
        "{PREFIX}{}_{}",
        now_secs(),
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// What a name says of a database: not one of the harness's (`None`), a test database created at
/// the given unix second (`Some(Some(secs))`), or one named before names held the creation time
/// (`Some(None)`). Only names made entirely of the pattern's characters are the harness's: what
/// is dropped is never anything else, and a name put into SQL holds nothing to quote.
fn parse_name(name: &str) -> Option<Option<u64>> {
    let hex12 =
        |s: &str| s.len() == 12 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let rest = name.strip_prefix(PREFIX)?;
    match rest.split_once('_') {
        Some((secs, id))
            if hex12(id)
                && (1..=19).contains(&secs.len())
                && secs.bytes().all(|b| b.is_ascii_digit()) =>
        {
            Some(Some(secs.parse().ok()?))
        }
        None if hex12(rest) => Some(None),
        _ => None,
    }
}

/// Drops the test databases that killed runs left: those whose name says they are older than
/// [`ABANDONED_AFTER`] (`WITH (FORCE)`: whatever is still connected to one belongs to a dead run,
/// e.g. a process it leaked). A younger one may be in use by a test running now and is never
/// touched, connected or not. Databases named before the creation time was in the name are aged
/// by their directory's creation (`pg_stat_file` of `PG_VERSION`, written once by CREATE
/// DATABASE; needs a superuser, and without one they are left alone). Returns what was dropped.
async fn sweep_abandoned(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT datname::text FROM pg_database WHERE datname LIKE 'txflow\\_test\\_%'",
    )
    .fetch_all(&mut *conn)
    .await?;
    let max_age = ABANDONED_AFTER.as_secs();
    let mut dropped = Vec::new();
    for name in names {
        let old = match parse_name(&name) {
            None => false,
            Some(Some(created)) => now_secs().saturating_sub(created) >= max_age,
            Some(None) => sqlx::query_scalar::<_, f64>(
                "SELECT extract(epoch FROM now() - (pg_stat_file('base/' || oid || '/PG_VERSION')).modification)::float8
                 FROM pg_database WHERE datname = $1",
            )
            .bind(&name)
            .fetch_optional(&mut *conn)
            .await
            .ok()
            .flatten()
            .is_some_and(|age| age >= max_age as f64),
        };
        // Another test process may be dropping the same one: IF EXISTS, and a failure skips it.
        if old
            && conn
                .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                .await
                .is_ok()
        {
            dropped.push(name);
        }
    }
    Ok(dropped)
}

/// A PostgreSQL database of the test's own, dropped (with its connections) when this is dropped.
/// The first one a test process creates also drops the databases of killed runs once they are old
/// (see `sweep_abandoned`).
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    /// A fresh database with every migration applied.
    pub async fn new() -> TestDb {
        let db = TestDb::empty().await;
        txflow_core::db::migrate(&db.pool)
            .await
            .expect("migrations apply to a fresh database");
        db
    }

    /// A fresh database with nothing in it.
    pub async fn empty() -> TestDb {
        static SWEPT: AtomicBool = AtomicBool::new(false);
        let name = new_name();
        let admin = &services().pg_admin_url;
        let mut conn = PgConnection::connect(admin)
            .await
            .unwrap_or_else(|e| panic!("connect to PostgreSQL at {admin}: {e}"));
        // Once per test process. Best effort: a test never fails on it.
        if !SWEPT.swap(true, Ordering::SeqCst) {
            match sweep_abandoned(&mut conn).await {
                Ok(dropped) if !dropped.is_empty() => eprintln!(
                    "dropped {} test database(s) left by killed runs: {}",
                    dropped.len(),
                    dropped.join(", ")
                ),
                Ok(_) => {}
                Err(e) => eprintln!("warning: no sweep of old test databases: {e}"),
            }
        }
        conn.execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .unwrap_or_else(|e| panic!("create database {name}: {e}"));
        let _ = conn.close().await;
        let url = format!(
            "{}/{name}",
            admin
                .rsplit_once('/')
                .map(|(base, _)| base)
                .unwrap_or(admin)
        );
        let pool = PgPoolOptions::new()
            .max_connections(5)
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
        TestDb { name, url, pool }
    }

    /// Another pool on the same database (separate connections, e.g. for concurrency tests).
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.url))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin = services().pg_admin_url.clone();
        // Drop runs outside async: use a short-lived runtime on its own thread.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let mut conn = PgConnection::connect(&admin).await.ok()?;
                conn.execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                    .await
                    .ok()
            })
        })
        .join();
        if !matches!(dropped, Ok(Some(_))) {
            eprintln!("warning: test database {} was not dropped", self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_harness_s_own_names_are_swept() {
        assert_eq!(
            parse_name("txflow_test_1700000000_0123456789ab"),
            Some(Some(1_700_000_000))
        );
        assert_eq!(parse_name(&new_name()).map(|t| t.is_some()), Some(true));
        assert_eq!(parse_name("txflow_test_0123456789ab"), Some(None));
        for other in [
            "txflow",
            "postgres",
            "txflow_test_",
            "txflow_test_1700000000_0123456789AB",
            "txflow_test_1700000000_0123456789abc",
            "txflow_test_17x0000000_0123456789ab",
            "txflow_test__0123456789ab",
            "txflow_test_1700000000_0123456789ab; DROP",
            "txflow_testx1700000000_0123456789ab",
        ] {
            assert_eq!(parse_name(other), None, "{other}");
        }
    }
}
