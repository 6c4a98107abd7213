//! The transfer coordinator end to end (issue 18, seed 004 §10): real PostgreSQL, the shared
//! broker and schema registry, a running `txflow spot-ledger` process and one or two
//! `txflow transfer-coordinator` processes. A transfer is recorded in INIT and announced on
//! `transfer.requests` as the gateway does; outcomes are checked where they are true: the
//! `transfers` row, the FUNDING balances in PostgreSQL, the SPOT balances asked of the ledger.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::process::{Child, Command};
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::events::{SpotOp, TransferRequested, TransferUpdated};
use txflow_core::kafka::{Topics, ensure_topics};
use txflow_core::transfer::{AdapterResponse, AssetRule, AssetStatus, AssetTable, TransferState};
use txflow_spot_ledger::Decimal;
use txflow_tests::{TestDb, kafka_settings, registry_url, spawn_child, unique, wait_for};
use txflow_transfer_coordinator::funding::{FundingAdapter, FundingCall, FundingOutcome};
use txflow_transfer_coordinator::spot::{SpotAdapter, SpotAdapterConfig, SpotCall};

const LONG: Duration = Duration::from_secs(120);

fn d(s: &str) -> Decimal {
    Decimal::from_str_exact(s).expect("test decimal")
}

fn asset_table() -> AssetTable {
    AssetTable::new([AssetRule {
        asset: "USDT".into(),
        places: 6,
        min_amount: Decimal::new(1, 6),
        max_amount: Decimal::new(1_000_000_000, 0),
        status: AssetStatus::Active,
        internal_transfer_enabled: true,
    }])
    .expect("valid asset rules")
}

/// A database, topics, a spot ledger and coordinators of the test's own.
struct Rig {
    db: TestDb,
    topics: Topics,
    wal_dir: PathBuf,
    ledger: Option<Child>,
    coordinators: Vec<Child>,
    spot: Arc<SpotAdapter>,
    producer: FutureProducer,
    codec: RegistryCodec,
}

impl Rig {
    async fn new() -> Rig {
        let db = TestDb::new().await;
        sqlx::query(
            "INSERT INTO assets (asset, places, min_amount, max_amount) \
             VALUES ('USDT', 6, 0.000001, 1000000000)",
        )
        .execute(&db.pool)
        .await
        .expect("insert asset");
        let topics = Topics::new(unique("xfer"));
        ensure_topics(&kafka_settings(), &topics.transfers(), 2)
            .await
            .expect("create the transfer topics");
        let spot = SpotAdapter::start(
            SpotAdapterConfig {
                kafka: kafka_settings(),
                registry_url: registry_url().into(),
                commands_topic: topics.spot_commands(),
                events_topic: topics.spot_events(),
                timeout: Duration::from_secs(3),
            },
            asset_table(),
        )
        .await
        .expect("start the test's spot adapter");
        let producer: FutureProducer = kafka_settings()
            .producer_config()
            .create()
            .expect("producer");
        let mut rig = Rig {
            db,
            topics,
            wal_dir: std::env::temp_dir().join(unique("xfer-wal")),
            ledger: None,
            coordinators: Vec::new(),
            spot: Arc::new(spot),
            producer,
            codec: RegistryCodec::new(registry_url()),
        };
        rig.start_ledger().await;
        rig
    }

    fn command(&self, role: &str, name: &str) -> Command {
        let log = std::env::temp_dir().join(format!("{}.log", unique(&format!("xfer-{name}"))));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
        cmd.arg(role)
            .envs(common::spot_ledger_env(&self.topics.prefix, &self.wal_dir))
            .env("TXFLOW_DATABASE_URL", &self.db.url)
            .env("TXFLOW_SPOT_TIMEOUT_MS", "1500")
            .env("TXFLOW_TRANSFER_STALE_MS", "400")
            .env("TXFLOW_TRANSFER_CHECK_INTERVAL_MS", "300")
            .env("TXFLOW_LEASE_MS", "3000")
            .env("TXFLOW_NODE_NAME", name)
            .env("TXFLOW_LOG", "info")
            .env_remove("TXFLOW_FAULT")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        eprintln!("{name}: log in {}", log.display());
        cmd
    }

    async fn start_ledger(&mut self) {
        self.start_ledger_with(None).await;
    }

    /// The ledger, aborting (as kill -9) at fault point `point`.
    async fn start_ledger_with_fault(&mut self, point: &str) {
        self.start_ledger_with(Some(point)).await;
    }

    async fn start_ledger_with(&mut self, fault: Option<&str>) {
        let mut cmd = self.command("spot-ledger", "ledger");
        if let Some(point) = fault {
            cmd.env("TXFLOW_FAULT", point);
        }
        self.ledger = Some(spawn_child(cmd).expect("spawn txflow spot-ledger"));
        wait_for("the spot ledger answers", LONG, || async {
            let a = self.spot.balance(&unique("ready"), "nobody", "USDT").await;
            (a.response == AdapterResponse::Success).then_some(())
        })
        .await
    }

    async fn kill_ledger(&mut self) {
        let mut child = self.ledger.take().expect("a ledger runs");
        child.kill().await.expect("kill -9 the ledger");
    }

    /// A coordinator process; with `fault`, it aborts (as kill -9) at that point.
    fn start_coordinator(&mut self, name: &str, fault: Option<&str>) -> usize {
        let mut cmd = self.command("transfer-coordinator", name);
        if let Some(point) = fault {
            cmd.env("TXFLOW_FAULT", point);
        }
        self.coordinators
            .push(spawn_child(cmd).expect("spawn txflow transfer-coordinator"));
        self.coordinators.len() - 1
    }

    /// A coordinator serving `/metrics` on a free port; returns the port.
    fn start_coordinator_with_metrics(&mut self, name: &str) -> u16 {
        let port = txflow_tests::free_port();
        let mut cmd = self.command("transfer-coordinator", name);
        cmd.env("TXFLOW_METRICS_ADDR", format!("127.0.0.1:{port}"));
        self.coordinators
            .push(spawn_child(cmd).expect("spawn txflow transfer-coordinator"));
        port
    }

    /// Waits for coordinator `i` to die on its fault point.
    async fn crashed(&mut self, i: usize) {
        let child = &mut self.coordinators[i];
        let status = tokio::time::timeout(LONG, child.wait())
            .await
            .expect("the coordinator reaches its fault point")
            .expect("wait for the coordinator");
        assert!(!status.success(), "aborted, not exited: {status:?}");
    }

    /// A FUNDING account holding `available`, put in as an outside movement (what the
    /// conservation check counts), then given `status`.
    async fn funding(&self, user: &str, available: &str, status: &str) {
        sqlx::query(
            "INSERT INTO funding_balances (user_id, asset, available) VALUES ($1, 'USDT', 0)",
        )
        .bind(user)
        .execute(&self.db.pool)
        .await
        .expect("insert a funding account");
        if d(available) > Decimal::ZERO {
            let adapter = FundingAdapter::new(self.db.pool.clone());
            let done = adapter
                .external_movement(&unique("dep"), user, "USDT", available, "test deposit")
                .await
                .expect("deposit from outside");
            assert_eq!(done, FundingOutcome::Applied);
        }
        sqlx::query("UPDATE funding_balances SET status = $2 WHERE user_id = $1")
            .bind(user)
            .bind(status)
            .execute(&self.db.pool)
            .await
            .expect("set the account status");
    }

    async fn funding_balance(&self, user: &str) -> Decimal {
        let (text,): (String,) = sqlx::query_as(
            "SELECT available::text FROM funding_balances WHERE user_id = $1 AND asset = 'USDT'",
        )
        .bind(user)
        .fetch_one(&self.db.pool)
        .await
        .expect("read a funding balance");
        d(txflow_transfer_coordinator::store::trim_numeric(&text))
    }

    async fn spot_credit(&self, user: &str, amount: &str) {
        let req = unique("seed");
        let a = self
            .spot
            .external(
                &SpotCall {
                    req_id: &req,
                    user_id: user,
                    asset: "USDT",
                    amount,
                },
                SpotOp::Credit,
            )
            .await;
        assert_eq!(a.response, AdapterResponse::Success, "{a:?}");
    }

    async fn spot_balance(&self, user: &str) -> Decimal {
        let a = self.spot.balance(&unique("q"), user, "USDT").await;
        assert_eq!(a.response, AdapterResponse::Success, "{a:?}");
        d(a.reply
            .and_then(|r| r.balance)
            .as_deref()
            .expect("a balance"))
    }

    async fn spot_frozen(&self, user: &str, frozen: bool) {
        let a = self.spot.set_frozen(&unique("frz"), user, frozen).await;
        assert_eq!(a.response, AdapterResponse::Success, "{a:?}");
    }

    /// Records a transfer in INIT and announces it, as the gateway does. Returns its req_id.
    async fn transfer(&self, user: &str, from: &str, to: &str, amount: &str) -> String {
        let req_id = unique("t");
        let transfer_type: i16 = if from == "FUNDING" { 1 } else { 2 };
        sqlx::query(
            "INSERT INTO transfers (req_id, user_id, asset, amount, transfer_type, \
             source_account, target_account) VALUES ($1, $2, 'USDT', $3::numeric, $4, $5, $6)",
        )
        .bind(&req_id)
        .bind(user)
        .bind(amount)
        .bind(transfer_type)
        .bind(from)
        .bind(to)
        .execute(&self.db.pool)
        .await
        .expect("record a transfer");
        let event = TransferRequested {
            event_id: unique("ev"),
            req_id: req_id.clone(),
            user_id: user.into(),
            asset: "USDT".into(),
            amount: amount.into(),
            from_account: from.into(),
            to_account: to.into(),
            created_at_ms: 0,
            traceparent: None,
        };
        let topic = self.topics.transfer_requests();
        let bytes = self
            .codec
            .encode(&topic, Subjects::TopicName, &event)
            .await
            .expect("encode");
        self.producer
            .send(
                FutureRecord::to(&topic).key(user).payload(&bytes),
                Duration::from_secs(10),
            )
            .await
            .expect("announce the transfer");
        req_id
    }

    async fn state(&self, req_id: &str) -> (TransferState, Option<String>, i32) {
        let (state, code, retries): (i16, Option<String>, i32) = sqlx::query_as(
            "SELECT state, error_code, retry_count FROM transfers WHERE req_id = $1",
        )
        .bind(req_id)
        .fetch_one(&self.db.pool)
        .await
        .expect("read a transfer");
        (
            TransferState::from_id(state).expect("a state of §2.1"),
            code,
            retries,
        )
    }

    async fn reaches(&self, req_id: &str, want: TransferState) -> Option<String> {
        wait_for(&format!("{req_id} reaches {want}"), LONG, || async {
            let (state, code, _) = self.state(req_id).await;
            (state == want).then_some(code)
        })
        .await
    }
}

/// The transfer events on `topic` (2 partitions, from the beginning) until `want` distinct
/// (req_id, state) pairs arrived: each with its key and `event_id`.
async fn transfer_events(topic: &str, want: usize) -> Vec<(String, TransferUpdated)> {
    use rdkafka::Message;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    let consumer: StreamConsumer = kafka_settings()
        .assign_config()
        .create()
        .expect("a consumer");
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..2 {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Beginning)
            .expect("a partition");
    }
    consumer.assign(&tpl).expect("assign");
    let codec = RegistryCodec::new(registry_url());
    let mut seen = Vec::new();
    let mut distinct = std::collections::BTreeSet::new();
    while distinct.len() < want {
        let m = txflow_tests::collect(&consumer, 1, LONG).await.remove(0);
        let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
        let e: TransferUpdated = codec
            .decode(m.payload().unwrap_or_default())
            .await
            .expect("a TransferUpdated");
        distinct.insert((e.req_id.clone(), e.state.clone()));
        seen.push((key, e));
    }
    seen
}

/// The Prometheus text a process serves on `port`, once it answers.
async fn metrics(port: u16) -> Option<String> {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.wal_dir);
    }
}

#[tokio::test]
async fn fsm_001_fsm_002_inv_001_both_directions_commit_and_keep_the_sum() {
    let mut rig = Rig::new().await;
    rig.funding("alice", "100", "ACTIVE").await;
    rig.spot_credit("alice", "50").await;
    rig.start_coordinator("coord-1", None);
    let to_spot = rig.transfer("alice", "FUNDING", "SPOT", "30.5").await;
    assert_eq!(rig.reaches(&to_spot, TransferState::Committed).await, None);
    let to_funding = rig.transfer("alice", "SPOT", "FUNDING", "20").await;
    assert_eq!(
        rig.reaches(&to_funding, TransferState::Committed).await,
        None
    );
    assert_eq!(rig.funding_balance("alice").await, d("89.5"));
    assert_eq!(rig.spot_balance("alice").await, d("60.5"));
    // INV-001: funding + spot is what it was (no transfer is in flight).
    assert_eq!(
        rig.funding_balance("alice").await + rig.spot_balance("alice").await,
        d("150")
    );
    // Each leg applied once on the FUNDING side.
    let (ops,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM transfer_operations WHERE req_id IN ($1, $2) AND outcome = 'APPLIED'",
    )
    .bind(&to_spot)
    .bind(&to_funding)
    .fetch_one(&rig.db.pool)
    .await
    .expect("count operations");
    assert_eq!(ops, 2);
    // Every state of both was announced on transfer.events, keyed by the user, each state with
    // its one deterministic event_id.
    let events = transfer_events(&rig.topics.transfer_events(), 8).await;
    for t in [&to_spot, &to_funding] {
        for state in [
            TransferState::SourcePending,
            TransferState::SourceDone,
            TransferState::TargetPending,
            TransferState::Committed,
        ] {
            let found: Vec<&(String, TransferUpdated)> = events
                .iter()
                .filter(|(_, e)| &e.req_id == t && e.state == state.as_str())
                .collect();
            assert!(!found.is_empty(), "{t}: no {state} event");
            for (key, e) in found {
                assert_eq!(key, "alice");
                assert_eq!(e.state_id, i32::from(state.id()));
                assert_eq!(
                    e.event_id,
                    txflow_core::transfer::transfer_event_id(t, state)
                );
                assert_eq!(e.asset, "USDT");
            }
        }
    }
}

#[tokio::test]
async fn fsm_003_inv_002_bal_001_a_refused_source_fails_and_moves_nothing() {
    let mut rig = Rig::new().await;
    rig.funding("bob", "10", "ACTIVE").await;
    rig.start_coordinator("coord-1", None);
    let t = rig.transfer("bob", "FUNDING", "SPOT", "10.000001").await;
    assert_eq!(
        rig.reaches(&t, TransferState::Failed).await.as_deref(),
        Some("INSUFFICIENT_BALANCE")
    );
    assert_eq!(rig.funding_balance("bob").await, d("10"));
    assert_eq!(rig.spot_balance("bob").await, d("0"));
    // A SPOT source refusing is a failure too.
    let t = rig.transfer("bob", "SPOT", "FUNDING", "1").await;
    assert_eq!(
        rig.reaches(&t, TransferState::Failed).await.as_deref(),
        Some("INSUFFICIENT_BALANCE")
    );
    assert_eq!(rig.funding_balance("bob").await, d("10"));
}

#[tokio::test]
async fn fsm_004_inv_003_fnd_002_a_refused_target_is_compensated_and_rolled_back() {
    let mut rig = Rig::new().await;
    rig.funding("carol", "100", "ACTIVE").await;
    rig.spot_frozen("carol", true).await;
    rig.start_coordinator("coord-1", None);
    let t = rig.transfer("carol", "FUNDING", "SPOT", "40").await;
    assert_eq!(
        rig.reaches(&t, TransferState::RolledBack).await.as_deref(),
        Some("ACCOUNT_FROZEN")
    );
    // INV-003: the source is fully restored; the target got nothing.
    assert_eq!(rig.funding_balance("carol").await, d("100"));
    assert_eq!(rig.spot_balance("carol").await, d("0"));
    let (refunds,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM transfer_operations WHERE req_id = $1 AND op = 'REFUND' AND outcome = 'APPLIED'",
    )
    .bind(&t)
    .fetch_one(&rig.db.pool)
    .await
    .expect("count refunds");
    assert_eq!(refunds, 1);
}

#[tokio::test]
async fn fsm_005_idp_004_a_target_timeout_stays_and_commits_when_the_ledger_returns() {
    let mut rig = Rig::new().await;
    rig.funding("dave", "100", "ACTIVE").await;
    rig.start_coordinator("coord-1", None);
    rig.kill_ledger().await;
    let t = rig.transfer("dave", "FUNDING", "SPOT", "25").await;
    // Retried (several stale periods) without ever compensating.
    wait_for("the deposit is retried", LONG, || async {
        let (state, code, retries) = rig.state(&t).await;
        assert!(
            !matches!(
                state,
                TransferState::Compensating
                    | TransferState::RolledBack
                    | TransferState::Failed
                    | TransferState::Committed
            ),
            "{state}: an unknown outcome must never compensate"
        );
        (state == TransferState::TargetPending
            && retries >= 2
            && code.as_deref() == Some("OUTCOME_UNKNOWN"))
        .then_some(())
    })
    .await;
    assert_eq!(rig.funding_balance("dave").await, d("75"));
    rig.start_ledger().await;
    rig.reaches(&t, TransferState::Committed).await;
    assert_eq!(rig.funding_balance("dave").await, d("75"));
    assert_eq!(rig.spot_balance("dave").await, d("25"), "credited once");
}

#[tokio::test]
async fn a_refund_of_unknown_outcome_stays_compensating_until_it_succeeds() {
    let mut rig = Rig::new().await;
    // SPOT → FUNDING into a DISABLED funding account: the deposit is refused, so the spot
    // debit must be refunded — while the spot ledger is down.
    rig.funding("erin", "0", "DISABLED").await;
    rig.spot_credit("erin", "30").await;
    // The first coordinator dies once the deposit was refused, before it records it; the
    // ledger goes down; the next coordinator compensates, and its refund cannot get through.
    let first = rig.start_coordinator(
        "coord-1",
        Some(txflow_core::fault::TRANSFER_AFTER_TARGET_CALL),
    );
    let t = rig.transfer("erin", "SPOT", "FUNDING", "30").await;
    rig.crashed(first).await;
    assert_eq!(rig.state(&t).await.0, TransferState::TargetPending);
    rig.kill_ledger().await;
    rig.start_coordinator("coord-2", None);
    wait_for("the refund is retried", LONG, || async {
        let (state, code, retries) = rig.state(&t).await;
        assert!(
            matches!(
                state,
                TransferState::TargetPending | TransferState::Compensating
            ),
            "{state}: the refund cannot have succeeded"
        );
        (state == TransferState::Compensating
            && retries >= 2
            && code.as_deref() == Some("OUTCOME_UNKNOWN"))
        .then_some(())
    })
    .await;
    rig.start_ledger().await;
    rig.reaches(&t, TransferState::RolledBack).await;
    assert_eq!(rig.spot_balance("erin").await, d("30"));
    assert_eq!(rig.funding_balance("erin").await, d("0"));
}

#[tokio::test]
async fn a_funding_to_spot_credit_of_unknown_outcome_commits_after_the_rules_changed() {
    unknown_outcome_then_rule_change("FUNDING").await;
}

#[tokio::test]
async fn a_spot_to_funding_debit_of_unknown_outcome_commits_after_the_rules_changed() {
    unknown_outcome_then_rule_change("SPOT").await;
}

/// The SPOT leg of a transfer from `from` is applied by the ledger, which dies before replying
/// (outcome unknown); an operator then lowers the asset's `max_amount` below the amount; the
/// ledger comes back. The retry must ask the ledger's recorded outcome, not the new rule: the
/// transfer commits, with no refund (money created) and no failure (money lost).
async fn unknown_outcome_then_rule_change(from: &str) {
    let mut rig = Rig::new().await;
    let user = "frank";
    rig.funding(user, "100", "ACTIVE").await;
    if from == "SPOT" {
        rig.spot_credit(user, "100").await;
    }
    // The next command the ledger logs is the transfer's SPOT leg: it dies right after.
    rig.kill_ledger().await;
    rig.start_ledger_with_fault("spot.after_wal@1").await;
    rig.start_coordinator("coord-1", None);
    let to = if from == "FUNDING" { "SPOT" } else { "FUNDING" };
    let t = rig.transfer(user, from, to, "25").await;
    let pending = if from == "FUNDING" {
        TransferState::TargetPending
    } else {
        TransferState::SourcePending
    };
    let retries = wait_for("the SPOT leg's outcome is unknown", LONG, || async {
        let (state, code, retries) = rig.state(&t).await;
        (state == pending && code.as_deref() == Some("OUTCOME_UNKNOWN")).then_some(retries)
    })
    .await;
    sqlx::query("UPDATE assets SET max_amount = 10 WHERE asset = 'USDT'")
        .execute(&rig.db.pool)
        .await
        .expect("lower max_amount");
    // Retried under the new rule: the coordinator re-reads the rules every 300 ms and retries
    // every 400 ms, so three more retries are made with the lowered maximum in force.
    wait_for("retried after the rule changed", LONG, || async {
        let (state, _, now) = rig.state(&t).await;
        assert_eq!(
            state, pending,
            "an unknown outcome is never decided by a rule"
        );
        (now >= retries + 3).then_some(())
    })
    .await;
    rig.kill_ledger().await;
    rig.start_ledger().await;
    rig.reaches(&t, TransferState::Committed).await;
    let (funding, spot) = if from == "FUNDING" {
        (d("75"), d("25"))
    } else {
        (d("125"), d("75"))
    };
    assert_eq!(
        rig.funding_balance(user).await,
        funding,
        "FUNDING moved once"
    );
    assert_eq!(rig.spot_balance(user).await, spot, "SPOT moved once");
    let (refunds,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM transfer_operations WHERE req_id = $1 AND op = 'REFUND'",
    )
    .bind(&t)
    .fetch_one(&rig.db.pool)
    .await
    .expect("count refunds");
    assert_eq!(refunds, 0, "nothing compensated");
}

/// A FUNDING -> SPOT transfer whose coordinator is killed at `point`, resumed by a fresh one:
/// every state it passed through is announced on `transfer.events` at least once, each with its
/// one deterministic `event_id` (the outbox relays what the crash kept from being produced).
async fn every_state_announced_after_a_crash_at(point: &str) {
    let mut rig = Rig::new().await;
    rig.funding("olga", "100", "ACTIVE").await;
    let first = rig.start_coordinator("coord-crash", Some(point));
    let t = rig.transfer("olga", "FUNDING", "SPOT", "10").await;
    rig.crashed(first).await;
    rig.start_coordinator("coord-again", None);
    rig.reaches(&t, TransferState::Committed).await;
    let states = [
        TransferState::SourcePending,
        TransferState::SourceDone,
        TransferState::TargetPending,
        TransferState::Committed,
    ];
    let events = transfer_events(&rig.topics.transfer_events(), states.len()).await;
    for state in states {
        let found: Vec<&TransferUpdated> = events
            .iter()
            .map(|(_, e)| e)
            .filter(|e| e.req_id == t && e.state == state.as_str())
            .collect();
        assert!(!found.is_empty(), "{point}: no {state} event");
        for e in found {
            assert_eq!(
                e.event_id,
                txflow_core::transfer::transfer_event_id(&t, state),
                "{point}"
            );
        }
    }
    assert_eq!(rig.funding_balance("olga").await, d("90"));
    assert_eq!(rig.spot_balance("olga").await, d("10"));
}

#[tokio::test]
async fn every_state_is_announced_after_a_crash_before_the_start() {
    every_state_announced_after_a_crash_at(txflow_core::fault::TRANSFER_BEFORE_START).await;
}

#[tokio::test]
async fn every_state_is_announced_after_a_crash_after_the_start() {
    every_state_announced_after_a_crash_at(txflow_core::fault::TRANSFER_AFTER_START).await;
}

#[tokio::test]
async fn every_state_is_announced_after_a_crash_after_the_source_call() {
    every_state_announced_after_a_crash_at(txflow_core::fault::TRANSFER_AFTER_SOURCE_CALL).await;
}

#[tokio::test]
async fn every_state_is_announced_after_a_crash_after_the_source_is_done() {
    every_state_announced_after_a_crash_at(txflow_core::fault::TRANSFER_AFTER_SOURCE_DONE).await;
}

#[tokio::test]
async fn every_state_is_announced_after_a_crash_after_the_target_start() {
    every_state_announced_after_a_crash_at(txflow_core::fault::TRANSFER_AFTER_TARGET_START).await;
}

#[tokio::test]
async fn every_state_is_announced_after_a_crash_after_the_target_call() {
    every_state_announced_after_a_crash_at(txflow_core::fault::TRANSFER_AFTER_TARGET_CALL).await;
}

#[tokio::test]
async fn fsm_006_an_explicitly_refused_refund_stays_compensating_until_it_is_applied() {
    let mut rig = Rig::new().await;
    // FUNDING -> SPOT into a frozen spot account: the target refuses, the source is refunded.
    rig.funding("rita", "100", "ACTIVE").await;
    rig.spot_frozen("rita", true).await;
    // The first coordinator dies right after the target's refusal, before recording it.
    let first = rig.start_coordinator(
        "coord-1",
        Some(txflow_core::fault::TRANSFER_AFTER_TARGET_CALL),
    );
    let t = rig.transfer("rita", "FUNDING", "SPOT", "10").await;
    rig.crashed(first).await;
    assert_eq!(rig.state(&t).await.0, TransferState::TargetPending);
    // The withdrawal's record no longer matches the refund (as a ledger gone wrong would have
    // it): the refund is refused explicitly, REFUND_AMOUNT_MISMATCH.
    let pool = rig.db.pool.clone();
    let tamper = |delta: &'static str| {
        let (pool, t) = (pool.clone(), t.clone());
        async move {
            sqlx::query(
                "UPDATE transfer_operations SET amount = amount + $2::numeric \
                 WHERE req_id = $1 AND op = 'WITHDRAW'",
            )
            .bind(&t)
            .bind(delta)
            .execute(&pool)
            .await
            .expect("change the withdrawal's record");
        }
    };
    tamper("1").await;
    rig.start_coordinator("coord-2", None);
    wait_for("the refused refund is retried", LONG, || async {
        let (state, code, retries) = rig.state(&t).await;
        assert!(
            matches!(
                state,
                TransferState::TargetPending | TransferState::Compensating
            ),
            "{state}: a refused refund neither rolls back nor fails"
        );
        (state == TransferState::Compensating
            && retries >= 2
            && code.as_deref() == Some("REFUND_AMOUNT_MISMATCH"))
        .then_some(())
    })
    .await;
    assert_eq!(
        rig.funding_balance("rita").await,
        d("90"),
        "not refunded yet"
    );
    // Repaired: the next retry refunds, once.
    tamper("-1").await;
    rig.reaches(&t, TransferState::RolledBack).await;
    assert_eq!(rig.funding_balance("rita").await, d("100"));
    assert_eq!(rig.spot_balance("rita").await, d("0"));
}

/// A transfer whose coordinator is killed at `point`, then resumed by a fresh coordinator: it
/// ends in `end` with the balances of exactly one execution (INV-004, FND-004).
async fn crash_at(point: &str, from: &str, target_refuses: bool, end: TransferState) {
    let mut rig = Rig::new().await;
    let user = "crash";
    if from == "FUNDING" {
        rig.funding(user, "100", "ACTIVE").await;
        rig.spot_credit(user, "1").await;
        if target_refuses {
            rig.spot_frozen(user, true).await;
        }
    } else {
        rig.funding(
            user,
            "1",
            if target_refuses { "DISABLED" } else { "ACTIVE" },
        )
        .await;
        rig.spot_credit(user, "100").await;
    }
    let to = if from == "FUNDING" { "SPOT" } else { "FUNDING" };
    let first = rig.start_coordinator("coord-crash", Some(point));
    let t = rig.transfer(user, from, to, "10").await;
    rig.crashed(first).await;
    let (at_crash, _, _) = rig.state(&t).await;
    assert!(!at_crash.is_terminal(), "{point}: crashed in {at_crash}");
    rig.start_coordinator("coord-again", None);
    rig.reaches(&t, end).await;
    let (funding, spot) = (
        rig.funding_balance(user).await,
        rig.spot_balance(user).await,
    );
    assert_eq!(funding + spot, d("101"), "{point}: money kept");
    let moved = end == TransferState::Committed;
    let (want_funding, want_spot) = match (from, moved) {
        ("FUNDING", true) => (d("90"), d("11")),
        ("FUNDING", false) => (d("100"), d("1")),
        (_, true) => (d("11"), d("90")),
        (_, false) => (d("1"), d("100")),
    };
    assert_eq!((funding, spot), (want_funding, want_spot), "{point}");
}

#[tokio::test]
async fn cra_001_crash_after_init_before_source_pending() {
    crash_at(
        txflow_core::fault::TRANSFER_BEFORE_START,
        "FUNDING",
        false,
        TransferState::Committed,
    )
    .await;
}

#[tokio::test]
async fn cra_002_crash_in_source_pending_before_the_call() {
    crash_at(
        txflow_core::fault::TRANSFER_AFTER_START,
        "FUNDING",
        false,
        TransferState::Committed,
    )
    .await;
}

#[tokio::test]
async fn cra_003_fnd_005_crash_in_source_pending_after_the_call() {
    crash_at(
        txflow_core::fault::TRANSFER_AFTER_SOURCE_CALL,
        "SPOT",
        false,
        TransferState::Committed,
    )
    .await;
}

#[tokio::test]
async fn cra_004_crash_after_source_done_before_target_pending() {
    crash_at(
        txflow_core::fault::TRANSFER_AFTER_SOURCE_DONE,
        "FUNDING",
        false,
        TransferState::Committed,
    )
    .await;
}

#[tokio::test]
async fn cra_005_fnd_004_inv_004_crash_in_target_pending_before_and_after_the_call() {
    crash_at(
        txflow_core::fault::TRANSFER_AFTER_TARGET_START,
        "SPOT",
        false,
        TransferState::Committed,
    )
    .await;
    crash_at(
        txflow_core::fault::TRANSFER_AFTER_TARGET_CALL,
        "FUNDING",
        false,
        TransferState::Committed,
    )
    .await;
}

#[tokio::test]
async fn cra_006_crash_in_compensating_after_the_refund() {
    crash_at(
        txflow_core::fault::TRANSFER_AFTER_REFUND_CALL,
        "FUNDING",
        true,
        TransferState::RolledBack,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bal_003_concurrent_transfers_of_one_user_never_overdraw_end_to_end() {
    let mut rig = Rig::new().await;
    rig.funding("paul", "100", "ACTIVE").await;
    rig.start_coordinator("coord-1", None);
    rig.start_coordinator("coord-2", None);
    // Fifteen transfers of 10 from a balance of 100, announced at once to two coordinators.
    let ids =
        futures::future::join_all((0..15).map(|_| rig.transfer("paul", "FUNDING", "SPOT", "10")))
            .await;
    let mut ends = Vec::new();
    for t in &ids {
        let end = wait_for(&format!("{t} ends"), LONG, || async {
            let (state, code, _) = rig.state(t).await;
            state.is_terminal().then_some((state, code))
        })
        .await;
        ends.push(end);
    }
    let committed = ends
        .iter()
        .filter(|(s, _)| *s == TransferState::Committed)
        .count();
    let refused = ends
        .iter()
        .filter(|(s, c)| {
            *s == TransferState::Failed && c.as_deref() == Some("INSUFFICIENT_BALANCE")
        })
        .count();
    assert_eq!((committed, refused), (10, 5), "{ends:?}");
    assert_eq!(rig.funding_balance("paul").await, d("0"), "never overdrawn");
    assert_eq!(rig.spot_balance("paul").await, d("100"));
}

#[tokio::test]
async fn con_002_two_coordinators_move_each_transfer_once() {
    let mut rig = Rig::new().await;
    let users: Vec<String> = (0..6).map(|i| format!("u{i}")).collect();
    for u in &users {
        rig.funding(u, "100", "ACTIVE").await;
    }
    rig.start_coordinator("coord-a", None);
    rig.start_coordinator("coord-b", None);
    // Two transfers of the same amount per user, each with its own req_id (CON-002), announced
    // at once.
    let mut sent = Vec::new();
    for u in &users {
        for _ in 0..2 {
            sent.push((u.clone(), rig.transfer(u, "FUNDING", "SPOT", "7").await));
        }
    }
    for (_, t) in &sent {
        rig.reaches(t, TransferState::Committed).await;
    }
    for u in &users {
        assert_eq!(rig.funding_balance(u).await, d("86"), "{u}");
        assert_eq!(rig.spot_balance(u).await, d("14"), "{u}");
    }
    // Every transition was written once, under one user's lease at a time.
    let (withdrawals,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM transfer_operations WHERE op = 'WITHDRAW' AND outcome = 'APPLIED'",
    )
    .fetch_one(&rig.db.pool)
    .await
    .expect("count withdrawals");
    assert_eq!(withdrawals, 12);
}

#[tokio::test]
async fn mon_003_a_violated_sum_is_recorded_alerted_and_halts_new_transfers() {
    let mut rig = Rig::new().await;
    rig.funding("frank", "100", "ACTIVE").await;
    rig.spot_credit("frank", "5").await;
    let port = rig.start_coordinator_with_metrics("coord-mon");
    let first = rig.transfer("frank", "FUNDING", "SPOT", "10").await;
    rig.reaches(&first, TransferState::Committed).await;
    // Balanced so far: the check has run (every 300 ms) and found nothing.
    let open = |pool: sqlx::PgPool| async move {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM transfer_conservation_violations WHERE resolved_at IS NULL",
        )
        .fetch_one(&pool)
        .await
        .expect("count violations");
        n
    };
    assert_eq!(open(rig.db.pool.clone()).await, 0);
    // Money from nothing: a balance changed behind the ledger's back.
    sqlx::query("UPDATE funding_balances SET available = available + 1 WHERE user_id = 'frank'")
        .execute(&rig.db.pool)
        .await
        .expect("tamper with a balance");
    let (expected, actual): (String, String) = wait_for("the violation is found", LONG, || async {
        sqlx::query_as(
            "SELECT expected::text, actual::text FROM transfer_conservation_violations \
             WHERE user_id = 'frank' AND asset = 'USDT' AND resolved_at IS NULL",
        )
        .fetch_optional(&rig.db.pool)
        .await
        .expect("read violations")
    })
    .await;
    assert_eq!(
        d(txflow_transfer_coordinator::store::trim_numeric(&expected)),
        d("105")
    );
    assert_eq!(
        d(txflow_transfer_coordinator::store::trim_numeric(&actual)),
        d("106")
    );
    // Halted: a new transfer is not started.
    let second = rig.transfer("frank", "FUNDING", "SPOT", "10").await;
    let metrics = wait_for("the alarm is exported", LONG, || async {
        let body = metrics(port).await?;
        let line = |name: &str, label: &str, value: &str| {
            body.lines().any(|l| {
                l.starts_with(&format!("{name}{{"))
                    && l.contains(label)
                    && l.ends_with(&format!(" {value}"))
            })
        };
        (line("conservation_violations_total", "asset=\"USDT\"", "1")
            && line("transfer_attention", "reason=\"halted\"", "1"))
        .then_some(body)
    })
    .await;
    assert!(metrics.contains("transfer_attention"), "{metrics}");
    assert_eq!(rig.state(&second).await.0, TransferState::Init);
    // Resolved by an operator: the transfer goes on.
    sqlx::query("UPDATE funding_balances SET available = available - 1 WHERE user_id = 'frank'")
        .execute(&rig.db.pool)
        .await
        .expect("repair the balance");
    sqlx::query(
        "UPDATE transfer_conservation_violations SET resolved_at = now(), resolved_by = 'test'",
    )
    .execute(&rig.db.pool)
    .await
    .expect("resolve");
    rig.reaches(&second, TransferState::Committed).await;
    assert_eq!(open(rig.db.pool.clone()).await, 0);
}

/// The open conservation violations.
async fn violations(pool: &sqlx::PgPool) -> i64 {
    let (n,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM transfer_conservation_violations WHERE resolved_at IS NULL",
    )
    .fetch_one(pool)
    .await
    .expect("count violations");
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_movements_committed_while_the_check_reads_are_never_a_violation() {
    let mut rig = Rig::new().await;
    rig.funding("hana", "100", "ACTIVE").await;
    rig.start_coordinator("coord-1", None);
    let t = rig.transfer("hana", "FUNDING", "SPOT", "10").await;
    rig.reaches(&t, TransferState::Committed).await;
    // Deposits and withdrawals from outside, back to back, while checks run at once (this
    // process's and the coordinator's own, every 300 ms).
    let pool = rig.db.pool.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mover = {
        let (pool, stop) = (pool.clone(), stop.clone());
        tokio::spawn(async move {
            let adapter = FundingAdapter::new(pool);
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for amount in ["1", "-1"] {
                    let done = adapter
                        .external_movement(&unique("mv"), "hana", "USDT", amount, "test movement")
                        .await
                        .expect("an outside movement");
                    assert_eq!(done, FundingOutcome::Applied);
                    n += 1;
                }
            }
            n
        })
    };
    let check = txflow_transfer_coordinator::conservation::Conservation::new(
        pool.clone(),
        rig.spot.clone(),
    );
    for _ in 0..300 {
        let report = check.run_once().await.expect("a check");
        assert_eq!(report.violations, Vec::new(), "a movement half seen");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let moved = mover.await.expect("the mover");
    assert!(moved >= 100, "movements ran beside the checks: {moved}");
    assert_eq!(violations(&pool).await, 0);
}

#[tokio::test]
async fn a_transfer_with_an_unknown_outcome_does_not_hide_a_violation_of_its_pair() {
    let rig = Rig::new().await;
    rig.funding("ivan", "100", "ACTIVE").await;
    // A FUNDING -> SPOT transfer whose source was taken and whose target's outcome is unknown
    // (TARGET_PENDING), as a coordinator leaves it while the ledger does not answer.
    let req_id = unique("t");
    sqlx::query(
        "INSERT INTO transfers (req_id, user_id, asset, amount, transfer_type, source_account, \
                                target_account, state, error_code) \
         VALUES ($1, 'ivan', 'USDT', 25, 1, 'FUNDING', 'SPOT', 30, 'OUTCOME_UNKNOWN')",
    )
    .bind(&req_id)
    .execute(&rig.db.pool)
    .await
    .expect("insert a transfer");
    let withdrawn = FundingAdapter::new(rig.db.pool.clone())
        .withdraw(&FundingCall {
            req_id: &req_id,
            user_id: "ivan",
            asset: "USDT",
            amount: "25",
        })
        .await
        .expect("the source leg");
    assert_eq!(withdrawn, FundingOutcome::Applied);
    let check = txflow_transfer_coordinator::conservation::Conservation::new(
        rig.db.pool.clone(),
        rig.spot.clone(),
    );
    // The 25 in flight (or landed) explains the difference: no violation.
    let report = check.run_once().await.expect("a check");
    assert_eq!(
        (report.checked, report.violations.len()),
        (1, 0),
        "{report:?}"
    );
    // Money from nowhere while the outcome is still unknown: found, not put off.
    sqlx::query("UPDATE funding_balances SET available = available + 1 WHERE user_id = 'ivan'")
        .execute(&rig.db.pool)
        .await
        .expect("tamper with a balance");
    let report = check.run_once().await.expect("a check");
    assert_eq!(report.violations.len(), 1, "{report:?}");
    assert_eq!(violations(&rig.db.pool).await, 1);
}

#[tokio::test]
async fn mon_001_mon_002_mon_004_the_coordinator_samples_its_alarms() {
    let mut rig = Rig::new().await;
    rig.funding("gina", "100", "ACTIVE").await;
    rig.kill_ledger().await;
    let insert = |user: &'static str, state: i16, retries: i32, age_s: i32| {
        let pool = rig.db.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO transfers (req_id, user_id, asset, amount, transfer_type, \
                 source_account, target_account, state, retry_count, created_at, updated_at) \
                 VALUES ($1, $2, 'USDT', 1, 1, 'FUNDING', 'SPOT', $3, $4, \
                 now() - make_interval(secs => $5), now() - make_interval(secs => $5))",
            )
            .bind(unique("m"))
            .bind(user)
            .bind(state)
            .bind(retries)
            .bind(f64::from(age_s))
            .execute(&pool)
            .await
            .expect("insert a transfer");
        }
    };
    // MON-001: in TARGET_PENDING for two minutes (the spot ledger is down: it stays there).
    insert("gina", 30, 0, 120).await;
    // MON-002: a refund refused three times (no withdrawal to refund: it keeps being refused).
    insert("hank", -20, 3, 5).await;
    // MON-004: 61 transfers by one user within the minute.
    for _ in 0..61 {
        insert("ivan", 40, 0, 1).await;
    }
    let port = rig.start_coordinator_with_metrics("coord-mon");
    let value = |body: &str, reason: &str| -> Option<f64> {
        body.lines()
            .find(|l| l.starts_with("transfer_attention{") && l.contains(reason))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    wait_for("the alarms are sampled", LONG, || async {
        let body = metrics(port).await?;
        (value(&body, "reason=\"target_pending_1m\"") == Some(1.0)
            && value(&body, "reason=\"refund_failed_3\"") == Some(1.0)
            && value(&body, "reason=\"user_rate_1m\"") == Some(1.0)
            && value(&body, "reason=\"halted\"") == Some(0.0))
        .then_some(())
    })
    .await;
}

#[tokio::test]
async fn bal_002_bal_004_bal_005_balances_and_account_status_end_to_end() {
    let mut rig = Rig::new().await;
    rig.funding("exact", "25", "ACTIVE").await;
    rig.funding("race", "100", "ACTIVE").await;
    rig.funding("cold", "100", "FROZEN").await;
    rig.funding("gone", "100", "DISABLED").await;
    rig.start_coordinator("coord-1", None);
    // BAL-002: the whole balance moves; the account is left at 0.
    let exact = rig.transfer("exact", "FUNDING", "SPOT", "25").await;
    // Two transfers whose sum exceeds the balance: one of them (BAL-003 with real concurrency:
    // bal_003_concurrent_transfers_of_one_user_never_overdraw_end_to_end).
    let a = rig.transfer("race", "FUNDING", "SPOT", "60").await;
    let b = rig.transfer("race", "FUNDING", "SPOT", "60").await;
    // BAL-004 / BAL-005: frozen and disabled accounts send nothing.
    let cold = rig.transfer("cold", "FUNDING", "SPOT", "1").await;
    let gone = rig.transfer("gone", "FUNDING", "SPOT", "1").await;
    assert_eq!(rig.reaches(&exact, TransferState::Committed).await, None);
    assert_eq!(rig.funding_balance("exact").await, d("0"));
    assert_eq!(rig.spot_balance("exact").await, d("25"));
    let end = |t: String| {
        let rig = &rig;
        async move {
            wait_for("a terminal state", LONG, || async {
                let (state, code, _) = rig.state(&t).await;
                state.is_terminal().then_some((state, code))
            })
            .await
        }
    };
    let mut outcomes = vec![end(a).await, end(b).await];
    outcomes.sort_by_key(|(s, _)| s.id());
    assert_eq!(
        outcomes,
        vec![
            (
                TransferState::Failed,
                Some("INSUFFICIENT_BALANCE".to_string())
            ),
            (TransferState::Committed, None),
        ]
    );
    assert_eq!(rig.funding_balance("race").await, d("40"));
    assert_eq!(rig.spot_balance("race").await, d("60"));
    assert_eq!(
        rig.reaches(&cold, TransferState::Failed).await.as_deref(),
        Some("ACCOUNT_FROZEN")
    );
    assert_eq!(
        rig.reaches(&gone, TransferState::Failed).await.as_deref(),
        Some("ACCOUNT_DISABLED")
    );
    assert_eq!(rig.funding_balance("cold").await, d("100"));
    assert_eq!(rig.funding_balance("gone").await, d("100"));
}

#[tokio::test]
async fn con_003_a_transfer_and_an_outside_withdrawal_at_once_never_overdraw() {
    let mut rig = Rig::new().await;
    rig.start_coordinator("coord-1", None);
    for round in 0..5 {
        let user = format!("con3-{round}");
        rig.funding(&user, "100", "ACTIVE").await;
        let adapter = FundingAdapter::new(rig.db.pool.clone());
        let movement = unique("payout");
        // Both at once: the transfer's withdrawal (by the coordinator process) and a payout to
        // the outside world (here), each of 70 against 100.
        let (t, payout) = tokio::join!(
            rig.transfer(&user, "FUNDING", "SPOT", "70"),
            adapter.external_movement(&movement, &user, "USDT", "-70", "payout")
        );
        let payout = payout.expect("the payout answers");
        let state = wait_for("the transfer ends", LONG, || async {
            let (state, _, _) = rig.state(&t).await;
            state.is_terminal().then_some(state)
        })
        .await;
        let paid = payout == FundingOutcome::Applied;
        let moved = state == TransferState::Committed;
        assert!(
            paid != moved,
            "round {round}: exactly one of the two: {payout:?}, {state}"
        );
        assert_eq!(rig.funding_balance(&user).await, d("30"), "round {round}");
        assert_eq!(
            rig.spot_balance(&user).await,
            if moved { d("70") } else { d("0") },
            "round {round}"
        );
    }
}

#[tokio::test]
async fn an_asset_listed_after_the_coordinator_started_moves_without_a_restart() {
    let mut rig = Rig::new().await;
    rig.start_coordinator("coord-1", None);
    // Proof that the coordinator runs (and has read the asset rules, USDT only).
    rig.funding("judy", "10", "ACTIVE").await;
    let first = rig.transfer("judy", "FUNDING", "SPOT", "1").await;
    rig.reaches(&first, TransferState::Committed).await;
    sqlx::query(
        "INSERT INTO assets (asset, places, min_amount, max_amount) \
         VALUES ('BTC', 8, 0.00000001, 1000)",
    )
    .execute(&rig.db.pool)
    .await
    .expect("list BTC");
    sqlx::query(
        "INSERT INTO funding_balances (user_id, asset, available) VALUES ('judy', 'BTC', 0)",
    )
    .execute(&rig.db.pool)
    .await
    .expect("a BTC account");
    let done = FundingAdapter::new(rig.db.pool.clone())
        .external_movement(&unique("dep"), "judy", "BTC", "2", "test deposit")
        .await
        .expect("deposit BTC");
    assert_eq!(done, FundingOutcome::Applied);
    let req_id = unique("t");
    sqlx::query(
        "INSERT INTO transfers (req_id, user_id, asset, amount, transfer_type, \
         source_account, target_account) VALUES ($1, 'judy', 'BTC', 0.5, 1, 'FUNDING', 'SPOT')",
    )
    .bind(&req_id)
    .execute(&rig.db.pool)
    .await
    .expect("record a BTC transfer");
    // No announcement: the recovery worker starts it (as after a lost TransferRequested).
    assert_eq!(rig.reaches(&req_id, TransferState::Committed).await, None);
    let a = rig.spot.balance(&unique("q"), "judy", "BTC").await;
    assert_eq!(
        a.reply.and_then(|r| r.balance).as_deref().map(d),
        Some(d("0.5"))
    );
}

/// SIGTERM (what a supervisor sends) stops a coordinator that has been talking to the spot
/// ledger with exit status 0, every time: its SPOT adapter's reply reader is stopped before the
/// process exits (a librdkafka consumer torn down while the process exits could end it with
/// SIGSEGV). Several rounds, each with a transfer through both ledgers first.
#[tokio::test]
async fn a_coordinator_stops_cleanly_on_sigterm_after_moving_transfers() {
    let mut rig = Rig::new().await;
    rig.funding("kim", "100", "ACTIVE").await;
    for round in 0..4 {
        let i = rig.start_coordinator(&format!("coord-term-{round}"), None);
        let t = rig.transfer("kim", "FUNDING", "SPOT", "1").await;
        assert_eq!(rig.reaches(&t, TransferState::Committed).await, None);
        let child = &mut rig.coordinators[i];
        let pid = child.id().expect("the coordinator runs");
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success());
        let status = tokio::time::timeout(LONG, child.wait())
            .await
            .expect("the coordinator stops within the deadline of SIGTERM")
            .expect("wait for the coordinator");
        assert!(status.success(), "round {round}: {status:?}");
    }
    assert_eq!(rig.funding_balance("kim").await, d("96"));
    assert_eq!(rig.spot_balance("kim").await, d("4"));
}
