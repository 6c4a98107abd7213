//! The `txflow` binary as a user runs it.

use std::process::Command;

use txflow_tests::TestDb;

fn txflow() -> Command {
    Command::new(env!("CARGO_BIN_EXE_txflow"))
}

#[test]
fn help_lists_every_role_and_command() {
    let out = txflow().arg("--help").output().expect("run txflow --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for cmd in [
        "allocator",
        "signer-gateway",
        "broadcaster",
        "receipt-checker",
        "confirmation-manager",
        "transfer-coordinator",
        "spot-ledger",
        "gateway",
        "up",
        "migrate",
        "replay",
        "bench",
        "demo",
    ] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(cmd)),
            "--help does not list {cmd}:\n{help}"
        );
    }
}

#[test]
fn a_role_not_built_yet_says_so_and_fails() {
    let out = txflow()
        .arg("gateway")
        .output()
        .expect("run txflow gateway");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gateway role is not implemented yet"), "{err}");
}

#[tokio::test]
async fn migrate_applies_the_migrations_to_an_empty_database() {
    let db = TestDb::empty().await;
    let out = txflow()
        .args(["migrate", "--database-url", &db.url])
        .output()
        .expect("run txflow migrate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(&db.pool)
        .await
        .expect("migrations table");
    assert_eq!(applied as usize, txflow_core::db::MIGRATOR.iter().count());
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public' AND table_name IN \
         ('signer_lease','signer_nonce_cursor','managed_tx','tx_attempts','tx_events','recycled_nonces')",
    )
    .fetch_one(&db.pool)
    .await
    .expect("tables");
    assert_eq!(tables, 6);

    // Running it again changes nothing and succeeds.
    let again = txflow()
        .args(["migrate", "--database-url", &db.url])
        .output()
        .expect("run again");
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}

#[test]
fn an_unreachable_database_is_a_clear_error() {
    let out = txflow()
        .args([
            "migrate",
            "--database-url",
            "postgres://postgres@127.0.0.1:1/none",
        ])
        .output()
        .expect("run txflow migrate");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("connecting to PostgreSQL"), "{err}");
}

#[tokio::test]
async fn up_once_migrates_creates_topics_registers_schemas_and_reports_every_role() {
    let db = TestDb::empty().await;
    let services = txflow_tests::services();
    let prefix = txflow_tests::unique("up");
    let out = txflow()
        .args(["up", "--once"])
        .env("TXFLOW_DATABASE_URL", &db.url)
        .env("TXFLOW_BROKERS", &services.brokers)
        .env("TXFLOW_SCHEMA_REGISTRY_URL", &services.registry_url)
        .env("TXFLOW_TOPIC_PREFIX", &prefix)
        .env("TXFLOW_PARTITIONS", "2")
        .output()
        .expect("run txflow up --once");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for role in txflow_core::role::Role::ALL {
        assert!(
            stdout.contains(role.as_str()),
            "{role} missing from:\n{stdout}"
        );
    }
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&db.pool)
        .await
        .expect("migrations ran");
    assert!(applied >= 1);

    // The topics exist on the broker, with the partitions asked for.
    let settings = txflow_tests::kafka_settings();
    let topics = txflow_core::kafka::Topics::new(prefix.clone());
    let consumer: rdkafka::consumer::BaseConsumer =
        settings.assign_config().create().expect("consumer");
    let md = rdkafka::consumer::Consumer::fetch_metadata(
        &consumer,
        None,
        std::time::Duration::from_secs(10),
    )
    .expect("metadata");
    for name in topics.all() {
        let t = md.topics().iter().find(|t| t.name() == name);
        assert_eq!(t.map(|t| t.partitions().len()), Some(2), "{name}");
    }
    drop(consumer);
    txflow_core::kafka::delete_topics(&settings, &topics.all())
        .await
        .expect("clean up topics");

    // The schemas are registered under the topics' subjects.
    let subjects: Vec<String> = reqwest::get(format!("{}/subjects", services.registry_url))
        .await
        .expect("GET /subjects")
        .json()
        .await
        .expect("a JSON list");
    assert!(
        subjects.contains(&format!("{}-value", topics.tx_requests())),
        "{subjects:?}"
    );
}

#[tokio::test]
async fn the_demo_runs_end_to_end_and_reports_every_signer() {
    let db = TestDb::empty().await;
    let anvil = txflow_tests::AnvilNode::spawn().await;
    let services = txflow_tests::services();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_txflow"))
        .arg("demo")
        .env("TXFLOW_DATABASE_URL", &db.url)
        .env("TXFLOW_BROKERS", &services.brokers)
        .env("TXFLOW_SCHEMA_REGISTRY_URL", &services.registry_url)
        .env("TXFLOW_RPC_URLS", &anvil.url)
        .env("TXFLOW_TOPIC_PREFIX", txflow_tests::unique("demo"))
        .env("TXFLOW_PARTITIONS", "4")
        .env("TXFLOW_LOG", "warn")
        .output()
        .await
        .expect("run txflow demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("0 duplicates"), "{stdout}");
    assert!(
        stdout.contains("301 markers"),
        "300 requests and the approved one are mined:\n{stdout}"
    );
    assert!(stdout.contains("SIMULATION_REVERTED"), "{stdout}");
    // Followed to finality: the 301 mined transactions are CONFIRMED, each with one TxConfirmed
    // recorded, and nothing is left in flight.
    let confirmed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'")
            .fetch_one(&db.pool)
            .await
            .expect("count");
    assert_eq!(confirmed, 301, "{stdout}");
    let announced: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT tx_id) FROM tx_events WHERE type = 'TxConfirmed'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count");
    assert_eq!(announced, 301);
    assert!(stdout.contains("confirmed ("), "{stdout}");
}

/// SIGTERM (what a supervisor sends) stops a role cleanly: it finishes its batch and releases its
/// leases, so that another instance takes the signers over at once rather than after the lease.
#[tokio::test]
async fn sigterm_stops_a_role_that_releases_its_leases() {
    use std::time::Duration;
    use txflow_tests::pipeline::Pipeline;
    let p = Pipeline::prepare(1, |_| {}).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_txflow"))
        .arg("allocator")
        .envs(p.env())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn txflow allocator");
    p.send(&p.request(0, "term-1")).await;
    let held = "SELECT count(*) FROM signer_lease WHERE role = 'allocator' AND expires_at > clock_timestamp()";
    txflow_tests::wait_until(
        "the allocator allocates under a lease",
        Duration::from_secs(120),
        || async {
            p.count("SELECT count(*) FROM managed_tx WHERE nonce IS NOT NULL")
                .await
                == 1
                && p.count(held).await == 1
        },
    )
    .await;
    let pid = child.id().expect("running");
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill -TERM");
    assert!(sent.success());
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the allocator stops within a minute of SIGTERM")
        .expect("wait");
    assert!(status.success(), "exit status {status:?}");
    assert_eq!(p.count(held).await, 0, "leases released on SIGTERM");
    p.stop().await;
}
