//! Handover between stage processes (issue 13), with the stages run as separate `txflow`
//! processes the way an operator deploys them:
//!
//! - setup leaves no ghost: after `txflow up --once`, role processes get their partitions promptly
//!   and 100 requests mine once (it used to start the role consumers and stop them while they were
//!   joining, and the local broker kept that departed consumer as the group's leader for ever);
//! - a stage that cannot get an assignment says so, naming its group, after
//!   `TXFLOW_ASSIGNMENT_TIMEOUT_MS` (a departed leader left behind on purpose; a group whose only
//!   partition another live member holds);
//! - chaos: two instances per role, `kill -9` of a random one every 4 s while 1,000 requests flow;
//!   every request mined once; the longest pause in mining, read from the chain's blocks, is
//!   printed (never asserted: it measures this machine as much as the code).
//!
//! `TXFLOW_TEST_BIN` runs these tests against another `txflow` build (e.g. the code as it was).
//! The chaos run uses the local tuning of the consumer groups (session timeout 2 s, heartbeat
//! 0.4 s, leases of 3 s) unless `TXFLOW_GROUP_SESSION_TIMEOUT_MS` / `TXFLOW_GROUP_HEARTBEAT_MS`
//! say otherwise; `TXFLOW_TEST_STATIC_MEMBERSHIP=1` gives each instance its name as
//! `TXFLOW_GROUP_INSTANCE_ID` (static membership).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{Consumer, ConsumerContext, StreamConsumer};
use rdkafka::{ClientConfig, ClientContext};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;
use txflow_tests::pipeline::{Mined, Pipeline};
use txflow_tests::{unique, wait_until};

const LONG: Duration = Duration::from_secs(600);
/// How soon a role process must hold its partitions: a functional deadline, far above the few
/// seconds a join takes here, not a benchmark.
const PROMPTLY: Duration = Duration::from_secs(30);

/// The `txflow` binary under test.
fn txflow_bin() -> PathBuf {
    std::env::var_os("TXFLOW_TEST_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_txflow")))
}

/// The log lines of a process (`TXFLOW_LOG_FORMAT=json`), parsed; other lines are skipped.
fn json_lines(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn field<'a>(line: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    line.get("fields").and_then(|f| f.get(name))
}

fn field_str<'a>(line: &'a serde_json::Value, name: &str) -> Option<&'a str> {
    field(line, name).and_then(|v| v.as_str())
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// A `txflow <role>` process of the test's own, logging JSON to a file; killed on drop.
struct RoleProcess {
    child: Child,
    log: PathBuf,
}

impl RoleProcess {
    fn spawn(role: &str, env: &[(String, String)], name: &str) -> RoleProcess {
        let log = std::env::temp_dir().join(format!("{}.log", unique(name)));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(txflow_bin())
            .arg(role)
            .envs(env.iter().cloned())
            .env("TXFLOW_NODE_NAME", name)
            .env("TXFLOW_LOG", "info")
            .env("TXFLOW_LOG_FORMAT", "json")
            .env_remove("TXFLOW_FAULT")
            .env_remove("TXFLOW_PAUSE_AT")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn txflow {role}: {e}"));
        RoleProcess { child, log }
    }

    /// The partitions of `group` it holds after its last `assigned` event, if it logged one.
    fn assigned(&self, group: &str) -> Option<u64> {
        json_lines(&self.log)
            .iter()
            .filter(|l| {
                field_str(l, "event") == Some("assigned") && field_str(l, "group") == Some(group)
            })
            .filter_map(|l| field(l, "count").and_then(|c| c.as_u64()))
            .next_back()
    }

    /// How many `rebalance` events (assignments and revocations of any of its groups) it logged.
    fn rebalances(&self) -> usize {
        json_lines(&self.log)
            .iter()
            .filter(|l| field_str(l, "event") == Some("rebalance"))
            .count()
    }

    /// Its `assignment_overdue` ERRORs.
    fn overdue(&self) -> Vec<serde_json::Value> {
        json_lines(&self.log)
            .into_iter()
            .filter(|l| {
                l.get("level").and_then(|v| v.as_str()) == Some("ERROR")
                    && field_str(l, "event") == Some("assignment_overdue")
            })
            .collect()
    }
}

/// Waits until `proc` holds all `partitions` of `group` or [`PROMPTLY`] has passed; then asserts
/// the former, with what the process logged.
async fn assert_assigned_promptly(
    proc: &RoleProcess,
    group: &str,
    partitions: u64,
    started: Instant,
) {
    let deadline = started + PROMPTLY;
    wait_until(
        &format!("{group} is assigned or time is up"),
        LONG,
        || async { proc.assigned(group) == Some(partitions) || Instant::now() >= deadline },
    )
    .await;
    assert_eq!(
        proc.assigned(group),
        Some(partitions),
        "{group} was not assigned its {partitions} partitions within {PROMPTLY:?} \
         ({} rebalance events in the process's log); its log ends:\n{}",
        proc.rebalances(),
        tail(&proc.log)
    );
    eprintln!(
        "{group}: all {partitions} partitions held {:.1} s after the process started",
        started.elapsed().as_secs_f64()
    );
}

#[tokio::test]
async fn after_up_once_the_role_processes_get_their_partitions_promptly_and_every_request_mines_once()
 {
    const REQUESTS: usize = 100;
    let p = Pipeline::prepare(4, |_| {}).await;
    let env = p.env();

    let out = Command::new(txflow_bin())
        .args(["up", "--once"])
        .envs(env.iter().cloned())
        .env("TXFLOW_LOG", "warn")
        .output()
        .await
        .expect("run txflow up --once");
    assert!(
        out.status.success(),
        "txflow up --once: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let mut signer_env = env.clone();
    signer_env.push(p.signer_keys_env());
    let started = Instant::now();
    let allocator = RoleProcess::spawn("allocator", &env, "alloc-up");
    let signer = RoleProcess::spawn("signer-gateway", &signer_env, "sign-up");
    let broadcaster = RoleProcess::spawn("broadcaster", &env, "bcast-up");

    // Groups `{prefix}.{stage}`: the ones `up` would have joined (the group prefix defaults to
    // the topic prefix).
    let prefix = &p.config.topics.prefix;
    let partitions = p.config.partitions as u64;
    for (proc, stage) in [
        (&allocator, "allocator"),
        (&allocator, "allocator.commands"),
        (&signer, "signer-gateway"),
        (&broadcaster, "broadcaster"),
    ] {
        assert_assigned_promptly(proc, &format!("{prefix}.{stage}"), partitions, started).await;
    }

    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| p.request(i % p.signers.len(), &format!("up-{i}")))
        .collect();
    futures::future::join_all(requests.iter().map(|r| p.send(r))).await;
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= REQUESTS as u64
    })
    .await;
    let markers = p.mined_markers().await;
    for r in &requests {
        assert_eq!(
            markers.get(&format!("txflow:{}", r.request_id)),
            Some(&1),
            "{} has exactly one mined transaction",
            r.request_id
        );
    }
    assert_eq!(
        markers.len(),
        REQUESTS,
        "nothing else was mined: {markers:?}"
    );
    drop((allocator, signer, broadcaster));
    p.stop().await;
}

/// Collects librdkafka's log lines (with `debug=cgrp`: the group protocol as the client sees it).
struct Captured(Arc<Mutex<Vec<String>>>);

impl ClientContext for Captured {
    fn log(&self, _level: rdkafka::config::RDKafkaLogLevel, fac: &str, line: &str) {
        if let Ok(mut l) = self.0.lock() {
            l.push(format!("{fac} {line}"));
        }
    }
}

impl ConsumerContext for Captured {}

/// A consumer of `group` with client id `client_id` (member ids start with it), subscribed to
/// `topic`, and the lines its librdkafka logs.
fn member(
    p: &Pipeline,
    group: &str,
    client_id: &str,
    topic: &str,
) -> (StreamConsumer<Captured>, Arc<Mutex<Vec<String>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let mut config: ClientConfig = p.config.kafka.consumer_config(group);
    config
        .set("client.id", client_id)
        .set("debug", "cgrp")
        .set_log_level(rdkafka::config::RDKafkaLogLevel::Debug);
    let consumer: StreamConsumer<Captured> = config
        .create_with_context(Captured(lines.clone()))
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    (consumer, lines)
}

/// Waits until `proc` has reported `group` overdue at least twice (it keeps trying and keeps
/// saying so), the latest report telling `why`; checks that every report names the group.
async fn assert_overdue_reported(proc: &RoleProcess, group: &str, why: &str) {
    let says_why = |e: &serde_json::Value| field_str(e, "message").is_some_and(|m| m.contains(why));
    wait_until(
        &format!("the stage reports {group} overdue twice, the latest saying {why:?}"),
        Duration::from_secs(60),
        || async {
            let errors = proc.overdue();
            errors.len() >= 2 && errors.last().is_some_and(says_why)
        },
    )
    .await;
    let errors = proc.overdue();
    for e in &errors {
        assert_eq!(field_str(e, "group"), Some(group), "{e}");
        let message = field_str(e, "message").unwrap_or_default();
        assert!(
            message.contains(group) && message.contains("still trying"),
            "{message}"
        );
        let waited = field(e, "waited_ms").and_then(|v| v.as_u64()).unwrap_or(0);
        assert!(
            waited >= 3_000,
            "reported after the timeout, not before: {e}"
        );
    }
    if let Some(last) = errors.last() {
        eprintln!("{}", field_str(last, "message").unwrap_or_default());
    }
}

#[tokio::test]
async fn a_stage_that_gets_no_partition_past_the_timeout_logs_an_error_naming_its_group() {
    // 1 partition per topic, so that a second live member of a group gets nothing.
    let p = Pipeline::prepare(1, |c| c.partitions = 1).await;
    let mut env = p.env();
    env.push(("TXFLOW_ASSIGNMENT_TIMEOUT_MS".into(), "3000".into()));
    let topic = p.config.topics.tx_signed();

    // 1. A departed leader: a member that leaves while its join is under way, as `up --once`
    //    used to do. The local broker keeps it as the group's leader (tansu removes a member
    //    that leaves a forming group but not its leadership), so no rebalance completes. The
    //    member leaves while its JoinGroup with the member id the broker gave it is pending
    //    (tansu holds a join for half the session timeout).
    let ghosted = unique("ghosted");
    let group = format!("{ghosted}.broadcaster");
    let (ghost, lines) = member(&p, &group, "departed", &topic);
    wait_until(
        "the departed member joins with its member id",
        Duration::from_secs(30),
        || async {
            // Keep the client's queue served while it joins.
            let _ = tokio::time::timeout(Duration::from_millis(50), ghost.recv()).await;
            lines
                .lock()
                .map(|l| {
                    l.iter()
                        .any(|l| l.contains("Joining group") && l.contains("member id \"departed-"))
                })
                .unwrap_or(false)
        },
    )
    .await;
    drop(ghost);
    let mut ghost_env = env.clone();
    ghost_env.push(("TXFLOW_GROUP_PREFIX".into(), ghosted));
    let stuck = RoleProcess::spawn("broadcaster", &ghost_env, "bcast-ghosted");
    assert_overdue_reported(&stuck, &group, "no rebalance of the group has completed").await;
    assert_eq!(
        stuck.assigned(&group),
        None,
        "a departed leader would not stop it (has the broker changed?)"
    );

    // 2. A live member holding the only partition: the range assignor gives it to the member
    //    whose id sorts first, and "a-holder-…" sorts before the stage's "rdkafka-…".
    let held = unique("held");
    let group = format!("{held}.broadcaster");
    let (holder, _) = member(&p, &group, "a-holder", &topic);
    let serving = CancellationToken::new();
    let serve = {
        let serving = serving.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = serving.cancelled() => break,
                    _ = holder.recv() => {}
                }
            }
            holder
        })
    };
    let mut held_env = env.clone();
    held_env.push(("TXFLOW_GROUP_PREFIX".into(), held));
    let idle = RoleProcess::spawn("broadcaster", &held_env, "bcast-idle");
    assert_overdue_reported(&idle, &group, "other members hold them all").await;
    serving.cancel();
    let holder = serve.await.expect("the holder's task");
    drop((stuck, idle, holder));
    p.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Chaos: two instances per role, kill -9 of a random one every 4 s.

/// One deployed instance of a role: a process manager restarts it at once whenever it dies,
/// under the same name (its `TXFLOW_NODE_NAME` and, with static membership, its
/// `TXFLOW_GROUP_INSTANCE_ID`).
struct Instance {
    name: String,
    pid: Arc<AtomicU32>,
    starts: Arc<AtomicU32>,
    task: tokio::task::JoinHandle<Vec<PathBuf>>,
}

impl Instance {
    fn start(
        role: &'static str,
        name: &str,
        env: Vec<(String, String)>,
        stop: &CancellationToken,
    ) -> Instance {
        let pid = Arc::new(AtomicU32::new(0));
        let starts = Arc::new(AtomicU32::new(0));
        let (pid2, starts2, stop2, name2) =
            (pid.clone(), starts.clone(), stop.clone(), name.to_string());
        let task = tokio::spawn(async move {
            let mut logs = Vec::new();
            while !stop2.is_cancelled() {
                let mut proc = RoleProcess::spawn(role, &env, &name2);
                pid2.store(proc.child.id().unwrap_or(0), Ordering::SeqCst);
                starts2.fetch_add(1, Ordering::SeqCst);
                logs.push(proc.log.clone());
                tokio::select! {
                    status = proc.child.wait() => {
                        if let Ok(s) = status {
                            use std::os::unix::process::ExitStatusExt;
                            if s.signal() != Some(9) {
                                eprintln!("{name2} ended by itself ({s}):\n{}", tail(&proc.log));
                            }
                        }
                    }
                    () = stop2.cancelled() => {
                        let _ = proc.child.kill().await;
                    }
                }
            }
            logs
        });
        Instance {
            name: name.to_string(),
            pid,
            starts,
            task,
        }
    }

    fn kill_9(&self) {
        let pid = self.pid.load(Ordering::SeqCst);
        if pid > 0 {
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
        }
    }
}

/// A pause in mining: between two consecutive blocks holding any of the transactions looked at.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Gap {
    /// By the blocks' timestamps (whole seconds).
    secs: u64,
    /// By block numbers (anvil mines one every 0.2 s).
    blocks: u64,
    /// The block before the pause.
    after_block: u64,
    /// Its timestamp (Unix seconds).
    after_time: u64,
}

/// The longest pause between consecutive blocks holding any of `mined`.
fn longest_gap<'a>(mined: impl Iterator<Item = &'a Mined>) -> Gap {
    let blocks: BTreeMap<u64, u64> = mined.map(|m| (m.block, m.timestamp)).collect();
    let mut longest = Gap::default();
    let mut prev: Option<(u64, u64)> = None;
    for (&b, &t) in &blocks {
        if let Some((pb, pt)) = prev {
            let gap = Gap {
                secs: t.saturating_sub(pt),
                blocks: b - pb,
                after_block: pb,
                after_time: pt,
            };
            if gap > longest {
                longest = gap;
            }
        }
        prev = Some((b, t));
    }
    longest
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

#[tokio::test]
async fn chaos_two_instances_per_role_with_a_random_kill_9_every_4_s_mines_every_request_once() {
    const SIGNERS: usize = 8;
    const REQUESTS: usize = 1_000;
    // 12.5 requests a second: the run lasts about 80 s of kills.
    const SEND_EVERY: Duration = Duration::from_millis(80);
    let p = Pipeline::prepare(SIGNERS, |_| {}).await;
    let mut env = p.env();
    let lease_ms = 3_000;
    env.push(("TXFLOW_LEASE_MS".into(), lease_ms.to_string()));
    // The local tuning (tansu holds every join for half the session timeout, so a short session
    // makes rebalances short too), unless the environment says otherwise.
    let mut group = Vec::new();
    for (var, local) in [
        ("TXFLOW_GROUP_SESSION_TIMEOUT_MS", "2000"),
        ("TXFLOW_GROUP_HEARTBEAT_MS", "400"),
    ] {
        let v = std::env::var(var).unwrap_or_else(|_| local.to_string());
        group.push((var.to_string(), v.clone()));
        env.push((var.to_string(), v));
    }
    let mut signer_env = env.clone();
    signer_env.push(p.signer_keys_env());

    let stop = CancellationToken::new();
    let mut instances = Vec::new();
    let static_membership = std::env::var("TXFLOW_TEST_STATIC_MEMBERSHIP").is_ok_and(|v| v == "1");
    for (role, short) in [
        ("allocator", "alloc"),
        ("signer-gateway", "sign"),
        ("broadcaster", "bcast"),
    ] {
        for which in ["a", "b"] {
            let name = format!("{short}-{which}");
            let mut e = if role == "signer-gateway" {
                signer_env.clone()
            } else {
                env.clone()
            };
            if static_membership {
                e.push(("TXFLOW_GROUP_INSTANCE_ID".into(), name.clone()));
            }
            instances.push(Instance::start(role, &name, e, &stop));
        }
    }
    let instances = Arc::new(instances);

    let killing = CancellationToken::new();
    let killer = {
        let (instances, killing) = (instances.clone(), killing.clone());
        tokio::spawn(async move {
            let mut kills: Vec<(f64, String)> = Vec::new();
            // A kill every 4 s: the chaos's own rhythm.
            let mut tick = tokio::time::interval(Duration::from_secs(4));
            tick.tick().await;
            loop {
                tokio::select! {
                    () = killing.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let i = (uuid::Uuid::new_v4().as_u128() % instances.len() as u128) as usize;
                instances[i].kill_9();
                kills.push((unix_now(), instances[i].name.clone()));
            }
            kills
        })
    };

    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| p.request(i % SIGNERS, &format!("chaos-{i}")))
        .collect();
    let started = Instant::now();
    let mut pace = tokio::time::interval(SEND_EVERY);
    for r in &requests {
        pace.tick().await;
        p.send(r).await;
    }
    eprintln!(
        "sent {REQUESTS} requests in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= REQUESTS as u64
    })
    .await;
    let run = started.elapsed();
    killing.cancel();
    let kills = killer.await.expect("the killer task");
    stop.cancel();
    let instances = Arc::try_unwrap(instances).unwrap_or_else(|_| panic!("instances still shared"));
    let mut logs = Vec::new();
    let mut starts = BTreeMap::new();
    for i in instances {
        starts.insert(i.name.clone(), i.starts.load(Ordering::SeqCst));
        logs.extend(i.task.await.expect("an instance's task"));
    }

    let mined = p.mined().await;
    let mut markers: BTreeMap<String, usize> = BTreeMap::new();
    for m in &mined {
        *markers.entry(m.marker()).or_insert(0) += 1;
    }
    for r in &requests {
        assert_eq!(
            markers.get(&format!("txflow:{}", r.request_id)),
            Some(&1),
            "{} has exactly one mined transaction",
            r.request_id
        );
    }

    // The pauses in mining, from the chain: over all our transactions, and per signer (a stage
    // instance that died holds some signers' partitions; the others go on).
    // The pauses in mining, from the chain: over all our transactions, and per signer (a stage
    // instance that died holds some signers' partitions; the others go on).
    let all = longest_gap(mined.iter());
    let (worst, worst_signer) = p
        .signers
        .iter()
        .map(|s| {
            let a = s.address();
            (longest_gap(mined.iter().filter(|m| m.signer == a)), a)
        })
        .max()
        .unwrap_or_default();
    let partition = txflow_core::stage::partition::partition_for(
        &txflow_core::kafka::signer_key(p.config.chain_id, &format!("{worst_signer:#x}")),
        p.config.partitions,
    );
    // The kills shortly before and during the worst pause, in seconds from its start.
    let around: Vec<String> = kills
        .iter()
        .map(|(t, n)| (t - worst.after_time as f64, n))
        .filter(|(dt, _)| *dt >= -10.0 && *dt <= worst.secs as f64 + 1.0)
        .map(|(dt, n)| format!("{n} at {dt:+.1} s"))
        .collect();
    let mut per_instance: BTreeMap<&str, u32> = BTreeMap::new();
    for (_, n) in &kills {
        *per_instance.entry(n.as_str()).or_default() += 1;
    }
    // What the members saw: the longest time one held no partition during a rebalance.
    let longest_rebalance = logs
        .iter()
        .flat_map(|l| json_lines(l))
        .filter(|l| field_str(l, "event") == Some("assigned"))
        .filter_map(|l| field(&l, "waited_ms").and_then(|v| v.as_u64()))
        .max();
    let distinct: BTreeSet<u64> = mined.iter().map(|m| m.block).collect();
    eprintln!(
        "chaos: {REQUESTS} requests over {SIGNERS} signers mined once each in {:.0} s ({} blocks \
         with our transactions); {} kill -9 {per_instance:?}; starts {starts:?}; lease {lease_ms} \
         ms; group settings {group:?}; static membership {}",
        run.as_secs_f64(),
        distinct.len(),
        kills.len(),
        if static_membership { "on" } else { "off" },
    );
    eprintln!(
        "chaos: longest pause in mining: {} s by block timestamps ({} blocks, after block {}); \
         longest pause of one signer: {} s ({} blocks, after block {}; signer {worst_signer:#x}, \
         partition {partition}; kills around it: {around:?}); longest wait of a member for its \
         partitions: {longest_rebalance:?} ms",
        all.secs, all.blocks, all.after_block, worst.secs, worst.blocks, worst.after_block,
    );
    p.stop().await;
}
