//! The SPOT adapter of the transfer coordinator (`txflow_transfer_coordinator::spot`) against a
//! real `txflow spot-ledger` process on the shared broker and schema registry:
//!
//! - credit then debit succeed with the balances right; a repeat is the same success and moves
//!   nothing; a debit above the balance is EXPLICIT_FAIL(INSUFFICIENT_BALANCE); inputs the adapter
//!   refuses itself produce nothing;
//! - a frozen account is EXPLICIT_FAIL(ACCOUNT_FROZEN), and the compensation credit to it
//!   succeeds;
//! - with the ledger killed (`kill -9`) a call answers TIMEOUT within the configured timeout, never
//!   EXPLICIT_FAIL; after the ledger restarts, the same call succeeds and the money moved once;
//! - 20 concurrent calls (tokio tasks sharing one adapter) are each answered right;
//! - the same key called 10 times at once: all SUCCESS, applied once;
//! - outside movements (`external`) and `read_balance`: the balance and the net of the outside
//!   movements, transfer legs apart, and the net after `kill -9` and a restart.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use txflow_core::events::{SpotOp, SpotOutcome, SpotReply};
use txflow_core::kafka::{Topics, ensure_topics};
use txflow_core::transfer::{AdapterResponse, AssetRule, AssetStatus, AssetTable, TransferCode};
use txflow_spot_ledger::Decimal;
use txflow_tests::{kafka_settings, registry_url, spawn_child, unique, wait_for};
use txflow_transfer_coordinator::spot::{
    SpotAdapter, SpotAdapterConfig, SpotAnswer, SpotBalance, SpotCall, SpotReadError,
};

const LONG: Duration = Duration::from_secs(120);

/// One ledger process of the test's own (topics, log directory) and an adapter on it.
struct Bench {
    topics: Topics,
    wal_dir: PathBuf,
    ledger: Option<Child>,
    adapter: Arc<SpotAdapter>,
}

fn asset_table() -> AssetTable {
    let rule = |asset: &str, places: u32| AssetRule {
        asset: asset.into(),
        places,
        min_amount: Decimal::new(1, places),
        max_amount: Decimal::new(1_000_000_000, 0),
        status: AssetStatus::Active,
        internal_transfer_enabled: true,
    };
    AssetTable::new([rule("USDT", 6), rule("BTC", 8)]).expect("valid asset rules")
}

impl Bench {
    /// Topics, the adapter, then the ledger process, answering.
    async fn new(timeout: Duration) -> Bench {
        let topics = Topics::new(unique("spotad"));
        ensure_topics(&kafka_settings(), &topics.spot(), 2)
            .await
            .expect("create the spot topics");
        let config = SpotAdapterConfig {
            kafka: kafka_settings(),
            registry_url: registry_url().into(),
            commands_topic: topics.spot_commands(),
            events_topic: topics.spot_events(),
            timeout,
        };
        let adapter = SpotAdapter::start(config, asset_table())
            .await
            .expect("start the spot adapter");
        let mut b = Bench {
            topics,
            wal_dir: std::env::temp_dir().join(unique("spotad-wal")),
            ledger: None,
            adapter: Arc::new(adapter),
        };
        b.start_ledger();
        b.ready().await;
        b
    }

    fn start_ledger(&mut self) {
        let log = std::env::temp_dir().join(format!("{}.log", unique("spotad-ledger")));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
        cmd.arg("spot-ledger")
            .envs(common::spot_ledger_env(&self.topics.prefix, &self.wal_dir))
            .env("TXFLOW_LOG", "info")
            .env_remove("TXFLOW_FAULT")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        self.ledger = Some(spawn_child(cmd).expect("spawn txflow spot-ledger"));
    }

    async fn kill_9(&mut self) {
        let mut child = self.ledger.take().expect("a ledger runs");
        child.kill().await.expect("kill -9 the ledger");
    }

    /// Until the ledger answers a BALANCE query (a fresh process joins its group first).
    async fn ready(&self) {
        wait_for("the spot ledger answers", LONG, || async {
            let a = self
                .adapter
                .balance(&unique("ready"), "nobody", "USDT")
                .await;
            (a.response == AdapterResponse::Success).then_some(())
        })
        .await
    }

    async fn balance(&self, user: &str, asset: &str) -> Decimal {
        let a = self.adapter.balance(&unique("q"), user, asset).await;
        assert_eq!(a.response, AdapterResponse::Success, "{a:?}");
        dec(a
            .reply
            .and_then(|r| r.balance)
            .as_deref()
            .expect("a balance"))
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.wal_dir);
    }
}

fn call<'a>(req_id: &'a str, user: &'a str, asset: &'a str, amount: &'a str) -> SpotCall<'a> {
    SpotCall {
        req_id,
        user_id: user,
        asset,
        amount,
    }
}

fn dec(s: &str) -> Decimal {
    s.parse()
        .unwrap_or_else(|e| panic!("{s:?} is not a decimal: {e}"))
}

fn reply(a: &SpotAnswer) -> &SpotReply {
    a.reply.as_ref().expect("a reply from the ledger")
}

fn assert_success(a: &SpotAnswer, outcome: SpotOutcome, balance: &str) {
    assert_eq!(a.response, AdapterResponse::Success, "{a:?}");
    assert_eq!(reply(a).outcome, outcome, "{a:?}");
    assert_eq!(
        reply(a).balance.as_deref().map(dec),
        Some(dec(balance)),
        "{a:?}"
    );
}

fn fail(code: TransferCode) -> AdapterResponse {
    AdapterResponse::ExplicitFail(code)
}

#[tokio::test]
async fn spot_adapter_credit_debit_and_insufficient_balance() {
    let b = Bench::new(Duration::from_secs(10)).await;
    let a = &b.adapter;
    let u = unique("alice");

    let credit = a.credit(&call("t1", &u, "USDT", "100.5"), false).await;
    assert_success(&credit, SpotOutcome::Applied, "100.5");
    let debit = a.debit(&call("t2", &u, "USDT", "30.25")).await;
    assert_success(&debit, SpotOutcome::Applied, "70.25");
    assert_eq!(b.balance(&u, "USDT").await, dec("70.25"));

    // A repeat: the same success, nothing moved again.
    let again = a.credit(&call("t1", &u, "USDT", "100.5"), false).await;
    assert_success(&again, SpotOutcome::AlreadyApplied, "100.5");
    assert_eq!(b.balance(&u, "USDT").await, dec("70.25"));

    let too_much = a.debit(&call("t3", &u, "USDT", "1000")).await;
    assert_eq!(too_much.response, fail(TransferCode::InsufficientBalance));
    assert_eq!(
        reply(&too_much).code.as_deref(),
        Some("INSUFFICIENT_BALANCE")
    );
    assert_eq!(b.balance(&u, "USDT").await, dec("70.25"));

    // Refused by the adapter itself (defence in depth): nothing is produced, so no reply.
    for (amount, asset, code) in [
        ("-1", "USDT", TransferCode::InvalidAmount),
        ("0", "USDT", TransferCode::InvalidAmount),
        ("1e3", "USDT", TransferCode::InvalidAmount),
        ("0.0000001", "USDT", TransferCode::PrecisionOverflow),
        ("1", "DOGE", TransferCode::InvalidAsset),
    ] {
        let r = a.debit(&call("t4", &u, asset, amount)).await;
        assert_eq!(r.response, fail(code), "{amount} {asset}");
        assert!(r.reply.is_none(), "{r:?}");
    }
    let r = a.credit(&call("bad id", &u, "USDT", "1"), false).await;
    assert_eq!(r.response, fail(TransferCode::InvalidRequest));
    assert_eq!(b.balance(&u, "USDT").await, dec("70.25"));
}

/// The asset's status is a rule of a source never sent, on SPOT as on FUNDING: a new SPOT debit
/// of a suspended asset, or of one whose internal transfers are off, is refused by the adapter
/// (nothing produced); the same debit sent again as a source that may have gone out (checked
/// for its shape only) reaches the ledger, whose decision stands. Found by `txflow chaos
/// --transfers` (seed 4): SPOT → FUNDING transfers went on under a suspension that failed
/// their FUNDING → SPOT siblings with ASSET_SUSPENDED.
#[tokio::test]
async fn spot_adapter_refuses_a_new_source_of_a_suspended_asset_but_not_one_sent_again() {
    let b = Bench::new(Duration::from_secs(10)).await;
    let a = &b.adapter;
    let u = unique("suspended");
    let credit = a.credit(&call("s0", &u, "USDT", "50"), false).await;
    assert_success(&credit, SpotOutcome::Applied, "50");
    let changed = |status: AssetStatus, enabled: bool| {
        AssetTable::new(
            asset_table()
                .rule("USDT")
                .into_iter()
                .cloned()
                .map(|r| AssetRule {
                    status,
                    internal_transfer_enabled: enabled,
                    ..r
                }),
        )
        .expect("valid asset rules")
    };
    for (table, code) in [
        (
            changed(AssetStatus::Suspended, true),
            TransferCode::AssetSuspended,
        ),
        (
            changed(AssetStatus::Active, false),
            TransferCode::TransferNotAllowed,
        ),
    ] {
        a.set_assets(table);
        let r = a.debit(&call("s1", &u, "USDT", "20")).await;
        assert_eq!(r.response, fail(code));
        assert!(r.reply.is_none(), "refused before producing: {r:?}");
        assert_eq!(b.balance(&u, "USDT").await, dec("50"));
    }
    // Sent again as a source that may have gone out: the ledger decides, the rules do not.
    let again = a
        .shape_checked(&call("s1", &u, "USDT", "20"), SpotOp::Debit, false)
        .await;
    assert_success(&again, SpotOutcome::Applied, "30");
    a.set_assets(asset_table());
}

#[tokio::test]
async fn spot_adapter_frozen_account_fails_explicitly_and_compensation_credits() {
    let b = Bench::new(Duration::from_secs(10)).await;
    let a = &b.adapter;
    let u = unique("frozen");

    assert_success(
        &a.credit(&call("f1", &u, "USDT", "50"), false).await,
        SpotOutcome::Applied,
        "50",
    );
    // A spot → funding transfer took 20 out of spot.
    assert_success(
        &a.debit(&call("f2", &u, "USDT", "20")).await,
        SpotOutcome::Applied,
        "30",
    );
    let frozen = a.set_frozen(&unique("freeze"), &u, true).await;
    assert_eq!(frozen.response, AdapterResponse::Success, "{frozen:?}");

    // A funding → spot transfer into the frozen account fails explicitly.
    let into = a.credit(&call("f3", &u, "USDT", "10"), false).await;
    assert_eq!(into.response, fail(TransferCode::AccountFrozen), "{into:?}");
    assert_eq!(b.balance(&u, "USDT").await, dec("30"));

    // The refund of f2's own debit is applied even to a frozen account.
    let refund = a.credit(&call("f2", &u, "USDT", "20"), true).await;
    assert_success(&refund, SpotOutcome::Applied, "50");
    let again = a.credit(&call("f2", &u, "USDT", "20"), true).await;
    assert_success(&again, SpotOutcome::AlreadyApplied, "50");
    assert_eq!(b.balance(&u, "USDT").await, dec("50"));
}

#[tokio::test]
async fn spot_adapter_times_out_while_the_ledger_is_down_and_the_retry_moves_money_once() {
    let timeout = Duration::from_secs(2);
    let mut b = Bench::new(timeout).await;
    let u = unique("down");
    assert_success(
        &b.adapter
            .credit(&call("d0", &u, "USDT", "100"), false)
            .await,
        SpotOutcome::Applied,
        "100",
    );

    b.kill_9().await;
    let started = Instant::now();
    let down = b.adapter.debit(&call("d1", &u, "USDT", "40")).await;
    let took = started.elapsed();
    assert_eq!(down.response, AdapterResponse::Timeout, "{down:?}");
    assert!(
        took < timeout + Duration::from_millis(500),
        "TIMEOUT after {took:?}, the timeout is {timeout:?}"
    );

    // The coordinator's retry: the same call (same req_id, op) until the restarted ledger
    // answers; every answer in between is an unknown outcome, never an explicit failure.
    b.start_ledger();
    let timeouts = AtomicU32::new(0);
    let answer = wait_for("the retried debit is answered", LONG, || {
        let adapter = b.adapter.clone();
        let u = u.clone();
        let timeouts = &timeouts;
        async move {
            let r = adapter.debit(&call("d1", &u, "USDT", "40")).await;
            match r.response {
                AdapterResponse::Timeout => {
                    timeouts.fetch_add(1, Ordering::SeqCst);
                    None
                }
                AdapterResponse::Success => Some(r),
                other => panic!("the retry answered {other:?}: {r:?}"),
            }
        }
    })
    .await;
    eprintln!(
        "retries that timed out while the ledger restarted: {}",
        timeouts.load(Ordering::SeqCst)
    );
    // The first command (still in the topic) or the retry applied it, once.
    assert_eq!(
        reply(&answer).balance.as_deref().map(dec),
        Some(dec("60")),
        "{answer:?}"
    );
    assert_eq!(b.balance(&u, "USDT").await, dec("60"));
    let again = b.adapter.debit(&call("d1", &u, "USDT", "40")).await;
    assert_success(&again, SpotOutcome::AlreadyApplied, "60");
    assert_eq!(b.balance(&u, "USDT").await, dec("60"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spot_adapter_answers_20_concurrent_calls() {
    let b = Bench::new(Duration::from_secs(20)).await;
    let shared = unique("shared");
    assert_success(
        &b.adapter
            .credit(&call("c0", &shared, "USDT", "100"), false)
            .await,
        SpotOutcome::Applied,
        "100",
    );
    // 10 debits of 10 on one funded account would be exactly enough: add 5 more, so 5 fail;
    // and 5 credits to users of their own.
    let mut tasks = Vec::new();
    for i in 0..20 {
        let adapter = b.adapter.clone();
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            let req = format!("c{}", i + 1);
            if i < 15 {
                let r = adapter.debit(&call(&req, &shared, "USDT", "10")).await;
                (i, None, r)
            } else {
                let user = unique("own");
                let amount = format!("{}.5", i);
                let r = adapter
                    .credit(&call(&req, &user, "USDT", &amount), false)
                    .await;
                (i, Some((user, amount)), r)
            }
        }));
    }
    let mut debited = 0;
    let mut refused = 0;
    for t in tasks {
        let (i, own, r) = t.await.expect("a call task");
        match own {
            None => match r.response {
                AdapterResponse::Success => {
                    assert_eq!(reply(&r).outcome, SpotOutcome::Applied, "{r:?}");
                    debited += 1;
                }
                AdapterResponse::ExplicitFail(TransferCode::InsufficientBalance) => refused += 1,
                other => panic!("debit {i} answered {other:?}: {r:?}"),
            },
            Some((user, amount)) => {
                assert_success(&r, SpotOutcome::Applied, &amount);
                assert_eq!(b.balance(&user, "USDT").await, dec(&amount));
            }
        }
    }
    assert_eq!((debited, refused), (10, 5));
    assert_eq!(b.balance(&shared, "USDT").await, dec("0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spot_adapter_same_key_concurrently_applies_once() {
    let b = Bench::new(Duration::from_secs(20)).await;
    let u = unique("same");
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let adapter = b.adapter.clone();
            let u = u.clone();
            tokio::spawn(
                async move { adapter.credit(&call("s1", &u, "BTC", "0.125"), false).await },
            )
        })
        .collect();
    for t in tasks {
        let r = t.await.expect("a call task");
        assert_eq!(r.response, AdapterResponse::Success, "{r:?}");
        // Whichever reply answered it, it carries the balance after the one application.
        assert_eq!(
            reply(&r).balance.as_deref().map(dec),
            Some(dec("0.125")),
            "{r:?}"
        );
    }
    assert_eq!(b.balance(&u, "BTC").await, dec("0.125"));
}

#[tokio::test]
async fn spot_adapter_unreachable_registry_is_a_network_error_never_a_failure() {
    let b = Bench::new(Duration::from_secs(10)).await;
    // A second adapter on the same topics whose schema registry does not answer: nothing can
    // be encoded, so nothing is produced, and the outcome is a network error (retried).
    let config = SpotAdapterConfig {
        kafka: kafka_settings(),
        registry_url: "http://127.0.0.1:9".into(),
        commands_topic: b.topics.spot_commands(),
        events_topic: b.topics.spot_events(),
        timeout: Duration::from_secs(10),
    };
    let cut_off = SpotAdapter::start(config, asset_table())
        .await
        .expect("start the second adapter");
    let u = unique("noreg");
    let r = cut_off.credit(&call("n1", &u, "USDT", "5"), false).await;
    assert_eq!(r.response, AdapterResponse::NetworkError, "{r:?}");
    assert_eq!(b.balance(&u, "USDT").await, dec("0"));
}

#[tokio::test]
async fn spot_adapter_outside_movements_and_their_net_survive_kill_9() {
    let mut b = Bench::new(Duration::from_secs(10)).await;
    let a = b.adapter.clone();
    let u = unique("outside");
    let holding = |balance: &str, net: &str| SpotBalance {
        balance: dec(balance),
        external_net: dec(net),
    };

    // 100 deposited from outside, then a SPOT → FUNDING transfer takes 30.25 out.
    let deposit = call("dep-1", &u, "USDT", "100");
    assert_success(
        &a.external(&deposit, SpotOp::Credit).await,
        SpotOutcome::Applied,
        "100",
    );
    assert_success(
        &a.debit(&call("t-1", &u, "USDT", "30.25")).await,
        SpotOutcome::Applied,
        "69.75",
    );
    assert_eq!(
        a.read_balance(&u, "USDT").await,
        Ok(holding("69.75", "100"))
    );
    // 20 withdrawn to the outside; more than the balance is refused and moves nothing.
    assert_success(
        &a.external(&call("wd-1", &u, "USDT", "20"), SpotOp::Debit)
            .await,
        SpotOutcome::Applied,
        "49.75",
    );
    let too_much = a
        .external(&call("wd-2", &u, "USDT", "50"), SpotOp::Debit)
        .await;
    assert_eq!(too_much.response, fail(TransferCode::InsufficientBalance));
    // A movement is not a transfer: above the asset's transfer maximum is fine.
    assert_success(
        &a.external(&call("dep-2", &u, "BTC", "2000000000.5"), SpotOp::Credit)
            .await,
        SpotOutcome::Applied,
        "2000000000.5",
    );
    // Refused by the adapter itself: nothing produced.
    for (op, amount, asset, code) in [
        (SpotOp::Balance, "1", "USDT", TransferCode::InvalidRequest),
        (SpotOp::Credit, "-1", "USDT", TransferCode::InvalidAmount),
        (
            SpotOp::Credit,
            "0.0000001",
            "USDT",
            TransferCode::PrecisionOverflow,
        ),
        (SpotOp::Credit, "1", "DOGE", TransferCode::InvalidAsset),
    ] {
        let r = a.external(&call("m-x", &u, asset, amount), op).await;
        assert_eq!(r.response, fail(code), "{op:?} {amount} {asset}");
        assert!(r.reply.is_none(), "{r:?}");
    }
    assert_eq!(
        a.read_balance(&u, "DOGE").await,
        Err(SpotReadError::Refused(TransferCode::InvalidAsset))
    );
    let want = [
        ("USDT", holding("49.75", "80")),
        ("BTC", holding("2000000000.5", "2000000000.5")),
    ];
    for (asset, h) in &want {
        assert_eq!(a.read_balance(&u, asset).await, Ok(*h), "{asset}");
    }

    // kill -9 and a restart: rebuilt from the write-ahead log; the repeat moves nothing.
    b.kill_9().await;
    b.start_ledger();
    b.ready().await;
    for (asset, h) in &want {
        assert_eq!(
            a.read_balance(&u, asset).await,
            Ok(*h),
            "{asset} after kill -9"
        );
    }
    assert_success(
        &a.external(&deposit, SpotOp::Credit).await,
        SpotOutcome::AlreadyApplied,
        "100",
    );
    assert_eq!(a.read_balance(&u, "USDT").await, Ok(holding("49.75", "80")));
}
