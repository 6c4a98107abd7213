use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection};

use crate::{services, unique};

/// A PostgreSQL database of the test's own, dropped (with its connections) when this is dropped.
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
        let name = unique("txflow_test").replace('-', "_");
        let admin = &services().pg_admin_url;
        let mut conn = PgConnection::connect(admin)
            .await
            .unwrap_or_else(|e| panic!("connect to PostgreSQL at {admin}: {e}"));
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
