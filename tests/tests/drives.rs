//! Drives under their lease (issue 12 point 6), against real PostgreSQL, broker and an anvil of
//! the test's own behind the JSON-RPC fault proxy:
//! - a drive slower than the lease (a slow `eth_estimateGas` in the allocator, a slow
//!   `eth_sendRawTransaction` in the broadcaster) keeps its lease renewed: the fencing token in
//!   `signer_lease` never moves, nothing is fenced, and the work is done once;
//! - the allocator's two runtimes (requests and commands, one role and node, so one lease) never
//!   drive one signer at once: each request is simulated and allocated once, the nonces are
//!   contiguous, and no write is refused.
//!
//! The stages run in this process; a tracing layer records the lease events (`txflow::lease`) of
//! the test's own nodes, so a fenced write, a lost lease or a re-take is seen where it happened.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use txflow_core::config::Config;
use txflow_core::deps::Deps;
use txflow_core::domain::NodeId;
use txflow_core::events::TxCommandKind;
use txflow_core::lease::LeaseConfig;
use txflow_tests::fault_proxy::{Fault, FaultProxy, Rule};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{unique, wait_for, wait_until};

const LONG: Duration = Duration::from_secs(240);

/// The lease events of every node of this process, as the stages emitted them.
mod lease_events {
    use std::sync::{Mutex, Once};

    use tracing::field::{Field, Visit};
    use tracing_subscriber::filter::{EnvFilter, Targets};
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, fmt};

    /// One `txflow::lease` event: its kind (`lease_acquired`, `lease_renewed`, `lease_retaken`,
    /// `lease_stolen`, `lease_lost`, `write_fenced`, …), role, node and token.
    #[derive(Debug, Clone, Default)]
    pub struct LeaseEvent {
        pub event: String,
        pub role: String,
        pub node: String,
        pub token: i64,
        pub operation: String,
    }

    static EVENTS: Mutex<Vec<LeaseEvent>> = Mutex::new(Vec::new());
    static INIT: Once = Once::new();

    impl Visit for LeaseEvent {
        fn record_str(&mut self, field: &Field, value: &str) {
            self.set(field, value.to_string());
        }
        fn record_i64(&mut self, field: &Field, value: i64) {
            if field.name() == "fencing_token" {
                self.token = value;
            }
        }
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            self.set(field, format!("{value:?}"));
        }
    }

    impl LeaseEvent {
        fn set(&mut self, field: &Field, value: String) {
            match field.name() {
                "event" => self.event = value,
                "role" => self.role = value,
                "node" => self.node = value,
                "operation" => self.operation = value,
                _ => {}
            }
        }
    }

    struct Recorder;

    impl<S: tracing::Subscriber> Layer<S> for Recorder {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            let mut e = LeaseEvent::default();
            event.record(&mut e);
            EVENTS.lock().unwrap_or_else(|p| p.into_inner()).push(e);
        }
    }

    /// Records the lease events from now on; the stages' warnings go to the test's output.
    pub fn init() {
        INIT.call_once(|| {
            let shown = EnvFilter::try_from_env("TXFLOW_LOG")
                .unwrap_or_else(|_| "warn,librdkafka=error".into());
            let _ = tracing_subscriber::registry()
                .with(Recorder.with_filter(
                    Targets::new().with_target("txflow::lease", tracing::Level::TRACE),
                ))
                .with(fmt::layer().with_test_writer().with_filter(shown))
                .try_init();
        });
    }

    /// The events of `node`.
    pub fn of(node: &str) -> Vec<LeaseEvent> {
        EVENTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|e| e.node == node)
            .cloned()
            .collect()
    }

    /// The events of `node` that say its lease did not hold: a write refused by the fence, a
    /// renewal that found the lease gone, a re-take of its own expired lease (token + 1) or a
    /// steal.
    pub fn troubles(node: &str) -> Vec<LeaseEvent> {
        of(node)
            .into_iter()
            .filter(|e| {
                matches!(
                    e.event.as_str(),
                    "write_fenced" | "lease_lost" | "lease_retaken" | "lease_stolen"
                )
            })
            .collect()
    }
}

/// A lease of 2 s (renewed every 666 ms, 200 ms of clock skew), as `TXFLOW_LEASE_MS=2000` gives.
fn short_lease() -> LeaseConfig {
    let lease = Config {
        lease_ms: 2000,
        ..Config::default()
    }
    .lease();
    lease.validate().expect("a valid lease");
    lease
}

/// A pipeline of one signer behind a fault proxy with `rules`; a slow node, not a dead one: the
/// client waits up to 20 s for an answer.
async fn slow_pipeline(rules: Vec<Rule>) -> (Pipeline, FaultProxy) {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let proxy = p.behind_proxy(rules).await;
    p.config.rpc_timeout_ms = 20_000;
    (p, proxy)
}

/// The stage runtimes started by a test, stopped at its end.
struct Stages {
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Stages {
    fn new() -> Stages {
        Stages {
            shutdown: CancellationToken::new(),
            tasks: Vec::new(),
        }
    }

    /// The allocator (its requests and commands runtimes) as `node`, with `lease`.
    async fn allocator(&mut self, config: &Config, node: &NodeId, lease: LeaseConfig) {
        let deps = Deps::connect(config, 2).await.expect("clients");
        let (requests, commands) = txflow_allocator::runtimes(&deps, node.clone(), lease)
            .await
            .expect("allocator");
        let (t1, t2) = (self.shutdown.clone(), self.shutdown.clone());
        self.tasks.push(tokio::spawn(async move {
            commands.run(t2).await.expect("allocator commands run")
        }));
        self.tasks.push(tokio::spawn(async move {
            requests.run(t1).await.expect("allocator runs")
        }));
    }

    /// The broadcaster as `node`, with `lease`.
    async fn broadcaster(&mut self, config: &Config, node: &NodeId, lease: LeaseConfig) {
        let deps = Deps::connect(config, 1).await.expect("clients");
        let b = txflow_broadcaster::runtime(&deps, node.clone(), lease)
            .await
            .expect("broadcaster");
        let t = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            b.run(t).await.expect("broadcaster runs")
        }));
    }

    async fn stop(self) {
        self.shutdown.cancel();
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(180), t).await;
        }
    }
}

/// The fencing token of `role`'s lease on signer 0 of `p`.
async fn token(p: &Pipeline, role: &str) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT fencing_token FROM signer_lease WHERE role = $1 AND chain_id = 31337 AND signer = $2",
    )
    .bind(role)
    .bind(p.signer(0))
    .fetch_optional(&p.db.pool)
    .await
    .expect("lease row")
}

/// Publishes the requests of signer 0 all at once.
async fn send_all(p: &Pipeline, ids: &[String]) {
    let requests: Vec<_> = ids.iter().map(|id| p.request(0, id)).collect();
    futures::future::join_all(requests.iter().map(|r| p.send(r))).await;
}

/// Per request: how many rows, TxAllocated events, attempts and TxSubmitted events it has.
async fn per_request(p: &Pipeline, event_type: &str) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT m.request_id, (SELECT count(*) FROM tx_events e WHERE e.tx_id = m.tx_id AND e.type = $1)
         FROM managed_tx m",
    )
    .bind(event_type)
    .fetch_all(&p.db.pool)
    .await
    .expect("events per request");
    rows.into_iter().collect()
}

/// Every request mined exactly once, nothing else mined, one row per request holding nonces
/// 0..n of signer 0, one TxAllocated per transaction.
async fn check_done_once(p: &Pipeline, ids: &[String]) {
    let markers = p.mined_markers().await;
    for id in ids {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{id} is mined exactly once: {markers:?}"
        );
    }
    assert_eq!(
        markers.len(),
        ids.len(),
        "nothing else was mined: {markers:?}"
    );
    let nonces: Vec<i64> = sqlx::query_scalar(
        "SELECT nonce FROM managed_tx WHERE signer = $1 AND nonce IS NOT NULL ORDER BY nonce",
    )
    .bind(p.signer(0))
    .fetch_all(&p.db.pool)
    .await
    .expect("nonces");
    let n = i64::try_from(ids.len()).expect("count");
    assert_eq!(
        nonces,
        (0..n).collect::<Vec<i64>>(),
        "one transaction per nonce 0..{n}, no gap, no extra"
    );
    let allocated = per_request(p, "TxAllocated").await;
    assert_eq!(
        allocated.len(),
        ids.len(),
        "one row per request: {allocated:?}"
    );
    assert!(
        allocated.values().all(|&c| c == 1),
        "each transaction allocated once: {allocated:?}"
    );
    let cursor: i64 =
        sqlx::query_scalar("SELECT next_nonce FROM signer_nonce_cursor WHERE signer = $1")
            .bind(p.signer(0))
            .fetch_one(&p.db.pool)
            .await
            .expect("cursor");
    assert_eq!(cursor, n, "the cursor stopped right after the last nonce");
}

#[tokio::test]
async fn a_simulation_slower_than_the_lease_keeps_the_allocator_lease_and_runs_once() {
    lease_events::init();
    let lease = short_lease();
    // Every estimate takes longer than the whole lease (and its skew): a drive that does not
    // renew its lease finds it gone when it records the simulation.
    let slow = Duration::from_millis(3500);
    assert!(slow > lease.duration + lease.clock_skew);
    let (mut p, proxy) =
        slow_pipeline(vec![Rule::on("eth_estimateGas", 1, Fault::Delay(slow))]).await;
    let config = p.config.clone();
    let node = NodeId::named(unique("alloc"));
    let mut stages = Stages::new();
    stages.allocator(&config, &node, lease).await;
    p.start_signer_gateway(&config).await;
    p.start_broadcaster(&config).await;

    let ids: Vec<String> = (0..4).map(|i| format!("slow-sim-{i}")).collect();
    send_all(&p, &ids).await;
    let first = wait_for("the allocator holds signer 0's lease", LONG, || async {
        token(&p, "allocator").await
    })
    .await;
    wait_until(
        "every request is mined, or the allocator's lease changed token",
        LONG,
        || async { token(&p, "allocator").await != Some(first) || p.mined_count().await >= 4 },
    )
    .await;
    assert_eq!(
        token(&p, "allocator").await,
        Some(first),
        "the allocator kept its lease with the same token while its drive waited on the node"
    );
    check_done_once(&p, &ids).await;
    let estimates = proxy.calls().get("eth_estimateGas").copied().unwrap_or(0);
    assert_eq!(
        estimates,
        4,
        "each request simulated once: {:?}",
        proxy.calls()
    );
    let troubles = lease_events::troubles(node.as_str());
    assert!(
        troubles.is_empty(),
        "nothing fenced, no lease lost: {troubles:?}"
    );
    assert!(
        lease_events::of(node.as_str())
            .iter()
            .any(|e| e.event == "lease_renewed"),
        "the lease was renewed"
    );
    stages.stop().await;
    p.stop().await;
}

#[tokio::test]
async fn a_send_slower_than_the_lease_keeps_the_broadcaster_lease_and_sends_once() {
    lease_events::init();
    let lease = short_lease();
    // Every send takes longer than the lease: the broadcaster's drive sends them one after
    // the other and records them together.
    let slow = Duration::from_millis(3000);
    assert!(slow > lease.duration + lease.clock_skew);
    let rules = vec![Rule::on("eth_sendRawTransaction", 1, Fault::Delay(slow))];
    let (mut p, proxy) = slow_pipeline(rules).await;
    let config = p.config.clone();
    let node = NodeId::named(unique("bcast"));
    let mut stages = Stages::new();
    stages.broadcaster(&config, &node, lease).await;
    p.start_allocator(&config, &unique("alloc")).await;
    p.start_signer_gateway(&config).await;

    let ids: Vec<String> = (0..3).map(|i| format!("slow-send-{i}")).collect();
    send_all(&p, &ids).await;
    let first = wait_for("the broadcaster holds signer 0's lease", LONG, || async {
        token(&p, "broadcaster").await
    })
    .await;
    let submitted = || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'SUBMITTED'")
            .await
    };
    wait_until(
        "every request is recorded SUBMITTED, or the broadcaster's lease changed token",
        LONG,
        || async { token(&p, "broadcaster").await != Some(first) || submitted().await >= 3 },
    )
    .await;
    assert_eq!(
        token(&p, "broadcaster").await,
        Some(first),
        "the broadcaster kept its lease with the same token while its sends waited on the node"
    );
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= 3
    })
    .await;
    check_done_once(&p, &ids).await;
    let attempts: Vec<i64> = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM tx_attempts a WHERE a.tx_id = m.tx_id) FROM managed_tx m",
    )
    .fetch_all(&p.db.pool)
    .await
    .expect("attempts");
    assert_eq!(attempts, vec![1; 3], "one attempt per transaction");
    let submits = per_request(&p, "TxSubmitted").await;
    assert!(
        submits.values().all(|&c| c == 1),
        "each transaction recorded SUBMITTED once: {submits:?}"
    );
    let sends = proxy
        .calls()
        .get("eth_sendRawTransaction")
        .copied()
        .unwrap_or(0);
    assert_eq!(sends, 3, "each transaction sent once: {:?}", proxy.calls());
    let troubles = lease_events::troubles(node.as_str());
    assert!(
        troubles.is_empty(),
        "nothing fenced, no lease lost: {troubles:?}"
    );
    stages.stop().await;
    p.stop().await;
}

#[tokio::test]
async fn the_allocators_two_runtimes_never_drive_one_signer_at_once() {
    lease_events::init();
    // Slow estimates and nonce reads keep a drive of the requests runtime busy long enough for a
    // drive of the commands runtime (after a command of the same signer) to start beside it.
    let slow = Duration::from_millis(2000);
    let (mut p, proxy) = slow_pipeline(vec![
        Rule::on("eth_estimateGas", 1, Fault::Delay(slow)),
        Rule::on("eth_getTransactionCount", 1, Fault::Delay(slow)),
    ])
    .await;
    let config = p.config.clone();
    let node = NodeId::named(unique("alloc"));
    let mut stages = Stages::new();
    // The default lease (10 s): longer than any drive here, so only the two runtimes meet.
    stages
        .allocator(&config, &node, LeaseConfig::default())
        .await;
    p.start_signer_gateway(&config).await;
    p.start_broadcaster(&config).await;

    // The commands runtime is consuming once a command of signer 0 has made it drive the signer
    // (a BUMP is the signer gateway's: the allocator ignores it, then drives the signer).
    let bump = || async {
        let nobody = uuid::Uuid::new_v4().to_string();
        p.command(&nobody, TxCommandKind::Bump).await;
    };
    bump().await;
    wait_until(
        "the commands runtime took signer 0's lease",
        LONG,
        || async { token(&p, "allocator").await.is_some() },
    )
    .await;

    let ids: Vec<String> = (0..6).map(|i| format!("both-{i}")).collect();
    send_all(&p, &ids).await;
    wait_until("the requests are recorded", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx").await >= 6
    })
    .await;
    // The requests runtime is now driving signer 0 (simulating, ~2 s per call): a command of
    // the signer makes the commands runtime drive it too.
    bump().await;
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= 6
    })
    .await;
    check_done_once(&p, &ids).await;
    let estimates = proxy.calls().get("eth_estimateGas").copied().unwrap_or(0);
    assert_eq!(
        estimates,
        6,
        "each request simulated once, by one drive: {:?}",
        proxy.calls()
    );
    let troubles = lease_events::troubles(node.as_str());
    assert!(
        troubles.is_empty(),
        "no write refused, no lease lost: {troubles:?}"
    );
    stages.stop().await;
    p.stop().await;
}
