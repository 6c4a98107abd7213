//! The `txflow` binary as a user runs it.

use std::process::Command;

use txflow_core::transfer::TransferState;
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
        "txflow demo ended with {:?}:\n{stdout}\n{}",
        out.status,
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
    // The table per signer: what tx.outcomes booked downstream (txflow-client's OutcomeReader)
    // equals what PostgreSQL holds CONFIRMED, signer by signer, 301 in all.
    let table: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("0x"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(table.len(), 5, "one row per signer:\n{stdout}");
    let mut booked = 0;
    for row in &table {
        // signer, in flight, confirmed, booked, failed, on chain
        assert_eq!(row.len(), 6, "{row:?}");
        assert_eq!(row[2], row[3], "confirmed = booked: {row:?}\n{stdout}");
        booked += row[3].parse::<i64>().expect("booked is a number");
    }
    assert_eq!(booked, 301, "{stdout}");
    // Then the transfers, through the gateway to the coordinator and the spot ledger: alice's
    // two commit, bob's into a frozen spot account is rolled back, carol's sent while the ledger
    // was killed was retried and committed once it came back; the sums were kept.
    // user, from, to, amount, state, error code, retries
    type Transfer = (String, String, String, String, i16, Option<String>, i32);
    let rows: Vec<Transfer> = sqlx::query_as(
        "SELECT user_id, source_account, target_account, amount::text, state, error_code, \
         retry_count FROM transfers ORDER BY created_at, transfer_id",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read the transfers");
    let of = |name: &str| {
        rows.iter()
            .filter(|r| r.0.starts_with("demo-") && r.0.ends_with(&format!("-{name}")))
            .map(|r| {
                (
                    r.1.as_str(),
                    r.2.as_str(),
                    TransferState::from_id(r.4).expect("a known state"),
                    r.5.as_deref(),
                    r.6,
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(rows.len(), 4, "{rows:?}\n{stdout}");
    let alice = of("alice");
    assert_eq!(alice.len(), 2, "{rows:?}");
    assert_eq!(
        (alice[0].0, alice[0].1, alice[0].2),
        ("FUNDING", "SPOT", TransferState::Committed)
    );
    assert_eq!(
        (alice[1].0, alice[1].1, alice[1].2),
        ("SPOT", "FUNDING", TransferState::Committed)
    );
    let bob = of("bob");
    assert_eq!(bob.len(), 1, "{rows:?}");
    assert_eq!(
        (bob[0].2, bob[0].3),
        (TransferState::RolledBack, Some("ACCOUNT_FROZEN")),
        "{rows:?}"
    );
    let carol = of("carol");
    assert_eq!(carol.len(), 1, "{rows:?}");
    assert_eq!(carol[0].2, TransferState::Committed, "{rows:?}");
    assert!(
        carol[0].4 >= 1,
        "retried while the ledger was down: {rows:?}"
    );
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM transfer_conservation_violations WHERE resolved_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count the open violations");
    assert_eq!(open, 0, "{stdout}");
    assert!(stdout.contains("ROLLED_BACK"), "{stdout}");
    assert!(
        stdout.contains("open conservation violations: 0"),
        "{stdout}"
    );
}

/// `txflow bench` against this test's database and `anvil`, with `env` on top; returns the exit
/// status, stdout and stderr.
async fn bench(
    db: &TestDb,
    anvil: &txflow_tests::AnvilNode,
    env: &[(&str, &str)],
    args: &[&str],
) -> (std::process::ExitStatus, String, String) {
    let services = txflow_tests::services();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_txflow"))
        .arg("bench")
        .args(args)
        .env("TXFLOW_DATABASE_URL", &db.url)
        .env("TXFLOW_BROKERS", &services.brokers)
        .env("TXFLOW_SCHEMA_REGISTRY_URL", &services.registry_url)
        .env("TXFLOW_RPC_URLS", &anvil.url)
        .env("TXFLOW_TOPIC_PREFIX", txflow_tests::unique("bench"))
        .env("TXFLOW_PARTITIONS", "4")
        .env("TXFLOW_LOG", "warn")
        .envs(env.iter().copied())
        .output()
        .await
        .expect("run txflow bench");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The bench's `--json` report: its last line.
fn report(stdout: &str) -> serde_json::Value {
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}):\n{stdout}"))
}

fn number(report: &serde_json::Value, field: &str) -> f64 {
    report[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{field} is not a number in {report}"))
}

/// `--scenario allocate` (one hot signer, the allocator's handler against PostgreSQL, a stub
/// node): every request of the signer ALLOCATED with the nonces 0..499, each once, as the report
/// says and as PostgreSQL holds them, each announced by one TxAllocated; its batches went
/// through one lease, one fencing token. Needs only PostgreSQL.
#[tokio::test]
async fn bench_allocate_takes_gap_free_nonces_for_one_hot_signer() {
    let db = TestDb::empty().await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_txflow"))
        .args([
            "bench",
            "--scenario",
            "allocate",
            "--txs",
            "500",
            "--batch-max",
            "120",
            "--json",
        ])
        .env("TXFLOW_DATABASE_URL", &db.url)
        .env("TXFLOW_LOG", "warn")
        .output()
        .await
        .expect("run txflow bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let r = report(&stdout);
    assert_eq!(r["scenario"], "allocate", "{r}");
    assert_eq!(r["nonces"], 500, "{r}");
    assert_eq!(r["allocated"], 500, "{r}");
    assert_eq!(r["announced"], 500, "{r}");
    assert_eq!(r["gaps"], 0, "{r}");
    assert_eq!(r["duplicates"], 0, "{r}");
    // 500 in batches of 120: four full ones and a last of 20.
    assert_eq!(r["batches"], 5, "{r}");
    // The CPU over the batches (a fraction of a second here: a process's share may round to 0
    // ticks, the machine's does not): this process's and PostgreSQL's, no broker or node.
    for who in ["txflow", "postgres", "postgres_db", "machine"] {
        assert!(number(&r["cpu_s"], who) >= 0.0, "{who}: {r}");
    }
    assert!(
        r["cpu_s"]["broker"].is_null() && r["cpu_s"]["anvil"].is_null(),
        "{r}"
    );
    assert!(number(&r, "machine_cpu_ms_per_batch") > 0.0, "{r}");
    let signer = r["signer"].as_str().expect("signer").to_string();
    let chain_id = r["chain_id"].as_i64().expect("chain_id");
    let nonces: Vec<i64> = sqlx::query_scalar(
        "SELECT nonce FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND state = 'ALLOCATED'
         ORDER BY nonce",
    )
    .bind(chain_id)
    .bind(&signer)
    .fetch_all(&db.pool)
    .await
    .expect("nonces");
    assert_eq!(nonces, (0..500).collect::<Vec<i64>>());
    let (rows, allocated_events, tokens): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), (SELECT count(*) FROM tx_events e JOIN managed_tx t USING (tx_id)
                           WHERE t.chain_id = $1 AND t.signer = $2 AND e.type = 'TxAllocated'),
                count(DISTINCT fencing_token)
         FROM managed_tx WHERE chain_id = $1 AND signer = $2",
    )
    .bind(chain_id)
    .bind(&signer)
    .fetch_one(&db.pool)
    .await
    .expect("rows");
    assert_eq!((rows, allocated_events, tokens), (500, 500, 1));
    let cursor: i64 = sqlx::query_scalar(
        "SELECT next_nonce FROM signer_nonce_cursor WHERE chain_id = $1 AND signer = $2",
    )
    .bind(chain_id)
    .bind(&signer)
    .fetch_one(&db.pool)
    .await
    .expect("cursor");
    assert_eq!(cursor, 500);
}

/// `--until confirmed` follows every request to CONFIRMED as a downstream team books it
/// (txflow-client's `OutcomeReader` on `tx.outcomes`) and checks the chain: every request
/// confirmed once, no nonce a request does not hold, and request → CONFIRMED no shorter than
/// request → SUBMITTED.
#[tokio::test]
async fn bench_until_confirmed_reports_every_request_confirmed_and_no_nonce_gap() {
    let db = TestDb::empty().await;
    let anvil = txflow_tests::AnvilNode::spawn().await;
    let (status, stdout, stderr) = bench(
        &db,
        &anvil,
        &[],
        &[
            "--signers",
            "2",
            "--txs",
            "10",
            "--until",
            "confirmed",
            "--json",
        ],
    )
    .await;
    assert!(status.success(), "{stdout}\n{stderr}");
    let r = report(&stdout);
    assert_eq!(r["until"], "confirmed", "{r}");
    assert_eq!(r["requests"], 20, "{r}");
    assert_eq!(r["mined"], 20, "{r}");
    assert_eq!(r["confirmed"], 20, "{r}");
    assert_eq!(r["duplicates"], 0, "{r}");
    assert_eq!(r["nonce_gaps"], 0, "{r}");
    assert_eq!(r["confirmations_required"], 12, "{r}");
    for (confirm, submit) in [("p50_confirm_ms", "p50_ms"), ("p99_confirm_ms", "p99_ms")] {
        assert!(
            number(&r, confirm) >= number(&r, submit),
            "{confirm} below {submit}: {r}"
        );
    }
    // Interval mining made the blocks: the bench had none to make.
    assert_eq!(r["blocks_mined_by_bench"], 0, "{r}");
    // What the report says, in PostgreSQL: the 20 requests and the 2 warm-ups CONFIRMED, each
    // with one TxConfirmed.
    let confirmed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'")
            .fetch_one(&db.pool)
            .await
            .expect("count");
    assert_eq!(confirmed, 22);
    let announced: (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT tx_id) FROM tx_events WHERE type = 'TxConfirmed'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count");
    assert_eq!(announced, (22, 22));
}

/// On a chain that mines only when a transaction comes (anvil's plain automine), no block follows
/// the last one: the bench mines the blocks the confirmations need.
#[tokio::test]
async fn bench_until_confirmed_makes_blocks_when_the_chain_stops() {
    let db = TestDb::empty().await;
    let anvil = txflow_tests::AnvilNode::spawn_with(&[]).await;
    let (status, stdout, stderr) = bench(
        &db,
        &anvil,
        &[("TXFLOW_CONFIRMATIONS_REQUIRED", "3")],
        &[
            "--signers",
            "1",
            "--txs",
            "5",
            "--until",
            "confirmed",
            "--json",
        ],
    )
    .await;
    assert!(status.success(), "{stdout}\n{stderr}");
    let r = report(&stdout);
    assert_eq!(r["confirmed"], 5, "{r}");
    assert_eq!(r["nonce_gaps"], 0, "{r}");
    assert!(number(&r, "blocks_mined_by_bench") >= 1.0, "{r}");
}

/// Confirmations that cannot come (more blocks than the deadline allows) end the bench at its
/// deadline with an error that says what is missing and where to look.
#[tokio::test]
async fn bench_until_confirmed_gives_up_at_the_deadline_with_a_clear_error() {
    let db = TestDb::empty().await;
    let anvil = txflow_tests::AnvilNode::spawn().await;
    let started = std::time::Instant::now();
    let (status, stdout, stderr) = bench(
        &db,
        &anvil,
        &[("TXFLOW_CONFIRMATIONS_REQUIRED", "10000")],
        &[
            "--signers",
            "1",
            "--txs",
            "1",
            "--until",
            "confirmed",
            // Long enough for the warm-up request to be mined on a loaded machine (a fresh-clone
            // run at 15 s failed with "the warm-up requests were not mined within 15 s").
            "--deadline-secs",
            "45",
        ],
    )
    .await;
    assert!(!status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("1 warm-up request(s) not CONFIRMED within 45 s")
            && stderr.contains("TXFLOW_CONFIRMATIONS_REQUIRED = 10000"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(120),
        "the bench gave up after {:?}",
        started.elapsed()
    );
}

/// Transactions with a `TxSubmitted` recorded, and rows in `managed_tx`, in the test's database.
async fn submitted_and_rows(db: &TestDb) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(DISTINCT tx_id) FROM tx_events WHERE type = 'TxSubmitted'),
                (SELECT count(*) FROM managed_tx)",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count")
}

/// `--compare` measures the chain alone, then the pipeline on the same node with as many signers
/// and requests, and reports them side by side: every request mined once, the ratio the quotient
/// of the two rates, and the CPU seconds of each process over each phase, this one's above zero.
#[tokio::test]
async fn bench_compare_reports_the_pipeline_next_to_the_chain_alone() {
    let db = TestDb::empty().await;
    let anvil = txflow_tests::AnvilNode::spawn().await;
    let (status, stdout, stderr) = bench(
        &db,
        &anvil,
        &[],
        &["--compare", "--signers", "2", "--txs", "10", "--json"],
    )
    .await;
    assert!(status.success(), "{stdout}\n{stderr}");
    let r = report(&stdout);
    assert_eq!(r["scenario"], "compare", "{r}");
    assert_eq!(r["requests"], 20, "{r}");
    assert_eq!(r["mined"], 20, "{r}");
    assert_eq!(r["duplicates"], 0, "{r}");
    assert_eq!(r["unmined"], 0, "{r}");
    assert_eq!(r["nonce_gaps"], 0, "{r}");
    // Read from PostgreSQL: requests signed more than once (a gas bump, a new nonce; normally
    // none).
    assert!(r["resigned"].is_u64(), "{r}");
    assert_eq!(r["anvil_mined"], 20, "{r}");
    assert_eq!(r["anvil_refused"], 0, "{r}");
    let (tx_per_s, anvil_tx_per_s) = (number(&r, "tx_per_s"), number(&r, "anvil_tx_per_s"));
    assert!(tx_per_s > 0.0 && anvil_tx_per_s > 0.0, "{r}");
    let ratio = number(&r, "ratio");
    assert!(
        (ratio - tx_per_s / anvil_tx_per_s).abs() <= 1e-9 * ratio.max(1.0),
        "ratio {ratio} is not tx_per_s / anvil_tx_per_s: {r}"
    );
    let (p50, p95, p99) = (
        number(&r, "p50_ms"),
        number(&r, "p95_ms"),
        number(&r, "p99_ms"),
    );
    assert!(0.0 <= p50 && p50 <= p95 && p95 <= p99, "{r}");
    // The same way step by step, from the events recorded in PostgreSQL.
    for step in [
        "request_to_accepted",
        "accepted_to_allocated",
        "allocated_to_signed",
        "signed_to_submitted",
    ] {
        let q = &r["steps_ms"][step];
        let (s50, s99) = (number(q, "p50"), number(q, "p99"));
        assert!(0.0 <= s50 && s50 <= s99 && s99 <= p99, "{step}: {r}");
    }
    for phase in ["cpu_s", "anvil_cpu_s"] {
        for who in [
            "txflow",
            "broker",
            "anvil",
            "postgres",
            "postgres_db",
            "machine",
        ] {
            let s = r[phase][who]
                .as_f64()
                .unwrap_or_else(|| panic!("{phase}.{who} is not a number: {r}"));
            assert!(s >= 0.0, "{phase}.{who}: {r}");
        }
    }
    // The pipeline ran in the bench's process: it used CPU.
    assert!(number(&r["cpu_s"], "txflow") > 0.0, "{r}");
    // The same per mined request, the rate the machine carries at that cost, and the cost at
    // which the pipeline could reach half of the chain's rate.
    let cores = r["cores"].as_u64().unwrap_or(0) as f64;
    assert!(cores >= 1.0, "{r}");
    for (phase, per) in [
        ("cpu_s", "cpu_ms_per_tx"),
        ("anvil_cpu_s", "anvil_cpu_ms_per_tx"),
    ] {
        for who in ["txflow", "anvil", "machine"] {
            let (s, ms) = (number(&r[phase], who), number(&r[per], who));
            assert!(
                (ms - s * 1000.0 / 20.0).abs() <= 1e-9 * ms.max(1.0),
                "{per}.{who}: {r}"
            );
        }
    }
    let machine_ms = number(&r["cpu_ms_per_tx"], "machine");
    let capacity = number(&r, "capacity_tx_per_s");
    assert!(
        (capacity - cores * 1000.0 / machine_ms).abs() <= 1e-6 * capacity,
        "{r}"
    );
    let budget = number(&r, "budget_ms_per_tx");
    assert!(
        (budget - cores * 1000.0 / (0.5 * anvil_tx_per_s)).abs() <= 1e-9 * budget,
        "{r}"
    );
    // Read from PostgreSQL: every mined request has at least its TxAccepted, TxSimulated,
    // TxAllocated, TxSigned and TxSubmitted rows, written in at least one transaction and in no
    // more transactions than rows.
    let (moves, transactions) = (
        number(&r, "moves_per_request"),
        number(&r, "write_transactions_per_request"),
    );
    assert!(
        moves >= 5.0 && 0.0 < transactions && transactions <= moves,
        "{r}"
    );
    // What the broker held before the run: the shared test broker answers its metadata.
    assert!(r["broker_topics"].as_u64().is_some(), "{r}");
    // RPC calls per request, from the roles' own `rpc_calls_total`: every request was sent at
    // least once, and nothing is sent without asking the chain something else too.
    let rpc = &r["rpc_calls_per_request"];
    assert!(
        number(rpc, "eth_sendRawTransaction") >= 1.0,
        "every request sent: {r}"
    );
    assert!(
        number(&r, "rpc_calls_per_request_total") > number(rpc, "eth_sendRawTransaction"),
        "{r}"
    );
    // The chain-alone phase went around txflow: PostgreSQL holds the 20 requests and the 2
    // warm-ups, each submitted, and nothing of the other 20 transactions.
    assert_eq!(submitted_and_rows(&db).await, (22, 22));
}

/// `--rate` offers the requests on a schedule instead of all at once, and every one is mined. No
/// request goes out before its time, so the last of 20 at 20/s leaves at least 0.95 s after the
/// schedule's start and the offered rate cannot exceed 20; it falls below only if the generator
/// fell behind (by a second, for 10/s).
#[tokio::test]
async fn bench_at_a_rate_sends_on_a_schedule_and_mines_every_request() {
    let db = TestDb::empty().await;
    let anvil = txflow_tests::AnvilNode::spawn().await;
    let (status, stdout, stderr) = bench(
        &db,
        &anvil,
        &[],
        &["--rate", "20", "--signers", "2", "--txs", "10", "--json"],
    )
    .await;
    assert!(status.success(), "{stdout}\n{stderr}");
    let r = report(&stdout);
    assert_eq!(r["rate"], 20, "{r}");
    assert_eq!(r["requests"], 20, "{r}");
    assert_eq!(r["mined"], 20, "{r}");
    assert_eq!(r["duplicates"], 0, "{r}");
    assert_eq!(r["unmined"], 0, "{r}");
    assert_eq!(r["nonce_gaps"], 0, "{r}");
    let at_least = 19.0 / 20.0;
    assert!(number(&r, "send_seconds") >= at_least, "{r}");
    assert!(number(&r, "seconds") >= at_least, "{r}");
    let offered = number(&r, "offered_per_s");
    assert!((10.0..=20.0 + 1e-9).contains(&offered), "{r}");
    assert!(number(&r, "send_lag_max_ms") >= 0.0, "{r}");
    assert!(number(&r, "p99_ms") >= number(&r, "p50_ms"), "{r}");
    assert_eq!(submitted_and_rows(&db).await, (22, 22));
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
