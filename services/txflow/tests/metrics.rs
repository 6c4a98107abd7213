//! Metrics and health endpoints (issue 17, points 2 and 5), against real processes: every
//! pipeline role runs as its own `txflow <role>` process with `TXFLOW_METRICS_ADDR` on a free
//! port, requests go through to CONFIRMED on anvil, and each `/metrics` is scraped and checked
//! against what PostgreSQL and the chain say, and linted with `promtool check metrics`. `/healthz`
//! answers 200, `/readyz` 200, and 503 naming the RPC check for a process whose only endpoint is
//! dead.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{free_port, spawn_child, unique, wait_for, wait_until};

const ROLES: [&str; 5] = [
    "allocator",
    "signer-gateway",
    "broadcaster",
    "receipt-checker",
    "confirmation-manager",
];

/// A `txflow <role>` process serving its metrics on `addr`; its log in a file, shown on failure.
struct Proc {
    role: String,
    addr: String,
    log: PathBuf,
    _child: Child,
}

impl Proc {
    fn spawn(role: &str, env: &[(String, String)]) -> Proc {
        let addr = format!("127.0.0.1:{}", free_port());
        let log = std::env::temp_dir().join(format!("{}.log", unique(role)));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
        cmd.arg(role)
            .envs(env.iter().cloned())
            .env("TXFLOW_NODE_NAME", role)
            .env("TXFLOW_METRICS_ADDR", &addr)
            .env("TXFLOW_METRICS_SAMPLE_MS", "300")
            .env("TXFLOW_LOG", "info")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("TXFLOW_FAULT")
            .env_remove("TXFLOW_PAUSE_AT")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        Proc {
            role: role.to_string(),
            addr,
            log,
            // Dies with the test process, even one killed by a timeout.
            _child: spawn_child(cmd).unwrap_or_else(|e| panic!("spawn txflow {role}: {e}")),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// `GET path`: (status, body), or `None` while nothing answers.
    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("http client");
        let r = client.get(self.url(path)).send().await.ok()?;
        let status = r.status().as_u16();
        Some((status, r.text().await.ok()?))
    }

    async fn metrics(&self) -> Exposition {
        let (status, body) = self.get("/metrics").await.unwrap_or_else(|| {
            panic!(
                "{} /metrics does not answer:\n{}",
                self.role,
                self.log_tail()
            )
        });
        assert_eq!(status, 200, "{} /metrics: {body}", self.role);
        Exposition::parse(&body)
    }
}

/// One sample of the text exposition: its name, its labels and its value.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A scraped `/metrics` (text format 0.0.4): enough of a parser for what the exporter writes.
#[derive(Debug, Clone)]
struct Exposition {
    text: String,
    samples: Vec<Sample>,
}

impl Exposition {
    fn parse(text: &str) -> Exposition {
        let mut samples = Vec::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("a sample line");
            let value: f64 = value.parse().unwrap_or(f64::NAN);
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let mut map = BTreeMap::new();
            // Values written by the exporter hold no `",` sequence here (no free text labels).
            for pair in labels.split("\",").filter(|p| !p.is_empty()) {
                if let Some((k, v)) = pair.split_once("=\"") {
                    map.insert(k.to_string(), v.trim_end_matches('"').to_string());
                }
            }
            samples.push(Sample {
                name: name.to_string(),
                labels: map,
                value,
            });
        }
        Exposition {
            text: text.to_string(),
            samples,
        }
    }

    /// The sum of `name`'s samples whose labels include every `(key, value)` of `with`.
    fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.matching(name, with).map(|s| s.value).sum()
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        with: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && with
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    fn has(&self, name: &str, with: &[(&str, &str)]) -> bool {
        self.matching(name, with).next().is_some()
    }
}

/// The sum over several processes' expositions.
fn total(all: &[(String, Exposition)], name: &str, with: &[(&str, &str)]) -> f64 {
    all.iter().map(|(_, e)| e.sum(name, with)).sum()
}

/// `promtool`: `PROMTOOL_BIN` (deploy/local/env.sh), else the one on the PATH; installed by
/// `deploy/local/install.sh --prometheus` when missing.
fn promtool() -> PathBuf {
    if let Some(p) = std::env::var_os("PROMTOOL_BIN").map(PathBuf::from)
        && p.exists()
    {
        return p;
    }
    let found = |p: &PathBuf| p.exists();
    let on_path = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("promtool"))
                .find(found)
        })
        .unwrap_or_default();
    if let Some(p) = on_path {
        return p;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/local/install.sh");
    let ok = std::process::Command::new("bash")
        .arg(&script)
        .arg("--prometheus")
        .status()
        .expect("run install.sh --prometheus")
        .success();
    assert!(ok, "deploy/local/install.sh --prometheus failed");
    PathBuf::from("/usr/bin/promtool")
}

/// `promtool check metrics` on `text`: its complaints, if any.
fn promtool_check(text: &str) -> Result<(), String> {
    use std::io::Write;
    let mut child = std::process::Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool output");
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Waits until `proc` is alive (`/healthz`) and ready (`/readyz`, every check ok).
async fn ready(proc: &Proc) {
    wait_until(
        &format!("{} answers /healthz", proc.role),
        Duration::from_secs(60),
        || async {
            proc.get("/healthz")
                .await
                .is_some_and(|(s, b)| s == 200 && b == "ok\n")
        },
    )
    .await;
    // Ready once every check passes (a busy machine can make the broker's first answer late).
    let (status, body) = wait_for(
        &format!("{} answers /readyz with 200", proc.role),
        Duration::from_secs(60),
        || async { proc.get("/readyz").await.filter(|(s, _)| *s == 200) },
    )
    .await;
    assert_eq!(status, 200, "{} /readyz: {body}", proc.role);
    let v: serde_json::Value = serde_json::from_str(&body).expect("readyz JSON");
    assert_eq!(v["status"], "ready", "{body}");
    for check in ["database", "broker", "rpc", "leases"] {
        assert_eq!(v["checks"][check], "ok", "{} /readyz: {body}", proc.role);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_role_process_serves_metrics_that_match_the_database_and_the_chain() {
    const N: usize = 12;
    let p = Pipeline::prepare(2, |_| {}).await;
    let mut env = p.env();
    env.extend([
        // Groups form quickly on the local broker with short sessions.
        ("TXFLOW_GROUP_SESSION_TIMEOUT_MS".into(), "2000".into()),
        ("TXFLOW_GROUP_HEARTBEAT_MS".into(), "400".into()),
        ("TXFLOW_CONFIRMATIONS_REQUIRED".into(), "3".into()),
        p.signer_keys_env(),
    ]);
    // The broadcaster starts only once the requests are SIGNED and every process's sampler has
    // recorded them so: without it they stay SIGNED, so the per-signer series of tx_open is
    // sure to be seen with its value rather than depending on a sample falling in the short
    // window a request is in flight.
    let mut procs: Vec<Proc> = ROLES
        .iter()
        .filter(|r| **r != "broadcaster")
        .map(|r| Proc::spawn(r, &env))
        .collect();
    for proc in &procs {
        ready(proc).await;
    }

    // Before any request, the known series are there at 0.
    let first = procs[0].metrics().await;
    for (name, labels) in [
        ("lease_fenced_total", vec![("role", "allocator")]),
        ("tx_create_total", vec![("result", "accepted")]),
        ("tx_reorg_total", vec![("depth", "deep")]),
        ("confirmations_newfork_total", vec![("chain_id", "31337")]),
        ("tx_reverted_total", vec![("chain_id", "31337")]),
        ("conservation_violations_total", vec![]),
        (
            "fsm_transition_total",
            vec![("from", "SUBMITTED"), ("to", "MINED")],
        ),
    ] {
        assert!(
            first.has(name, &labels),
            "allocator: no {name}{labels:?} at start:\n{}",
            first.text
        );
    }

    for i in 0..N {
        p.send(&p.request(i % 2, &format!("metrics-{i}"))).await;
    }
    wait_until(
        "every request is SIGNED (no broadcaster yet)",
        Duration::from_secs(120),
        || async {
            p.count("SELECT count(*) FROM managed_tx WHERE state = 'SIGNED'")
                .await
                == N as i64
        },
    )
    .await;
    // Open transactions by state per signer, as every process samples them: the rows in SIGNED.
    for proc in &procs {
        for s in [p.signer(0), p.signer(1)] {
            wait_until(
                &format!(
                    "{} samples tx_open{{state=SIGNED}} = {} for {s}",
                    proc.role,
                    N / 2
                ),
                Duration::from_secs(60),
                || async {
                    proc.metrics()
                        .await
                        .sum("tx_open", &[("signer", &s), ("state", "SIGNED")])
                        == (N / 2) as f64
                },
            )
            .await;
        }
    }
    let broadcaster = Proc::spawn("broadcaster", &env);
    ready(&broadcaster).await;
    procs.push(broadcaster);
    wait_until(
        "every request is CONFIRMED",
        Duration::from_secs(240),
        || async {
            p.count("SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'")
                .await
                == N as i64
        },
    )
    .await;
    let on_chain = p.mined().await.len();
    assert_eq!(on_chain, N, "each request mined once");

    // The counters of what happened, against PostgreSQL and the chain. Counters are recorded
    // before the scrape can see them: poll until the sampler and the last batch are in.
    let all: Vec<(String, Exposition)> = wait_for(
        "the metrics show the run",
        Duration::from_secs(60),
        || async {
            let mut all = Vec::new();
            for proc in &procs {
                all.push((proc.role.clone(), proc.metrics().await));
            }
            let done = total(
                &all,
                "fsm_transition_total",
                &[("from", "MINED"), ("to", "CONFIRMED")],
            ) >= N as f64
                && total(&all, "tx_open", &[]) == 0.0;
            done.then_some(all)
        },
    )
    .await;
    let by_role = |role: &str| {
        &all.iter()
            .find(|(r, _)| r == role)
            .expect("a role's metrics")
            .1
    };

    let accepted = total(&all, "tx_submit_total", &[("result", "accepted")]);
    eprintln!(
        "on chain {on_chain}; tx_submit_total{{accepted}} {accepted}; SUBMITTED->MINED {}; \
         MINED->CONFIRMED {}; batches {}; rpc calls ok {}",
        total(
            &all,
            "fsm_transition_total",
            &[("from", "SUBMITTED"), ("to", "MINED")]
        ),
        total(
            &all,
            "fsm_transition_total",
            &[("from", "MINED"), ("to", "CONFIRMED")]
        ),
        total(&all, "stage_batch_duration_seconds_count", &[]),
        total(&all, "rpc_calls_total", &[("result", "ok")]),
    );
    assert!(
        accepted >= on_chain as f64,
        "tx_submit_total{{result=accepted}} {accepted} < {on_chain} transactions on the chain"
    );
    assert!(
        by_role("allocator").sum("tx_create_total", &[("result", "accepted")]) >= N as f64,
        "tx_create_total{{result=accepted}}"
    );
    for (from, to) in [
        ("RECEIVED", "SIMULATED"),
        ("SIMULATED", "ALLOCATED"),
        ("ALLOCATED", "SIGNED"),
        ("SIGNED", "SUBMITTED"),
        ("SUBMITTED", "MINED"),
        ("MINED", "CONFIRMED"),
    ] {
        let n = total(&all, "fsm_transition_total", &[("from", from), ("to", to)]);
        assert!(
            n >= N as f64,
            "fsm_transition_total{{from={from},to={to}}} = {n} < {N}"
        );
    }
    let found = by_role("receipt-checker").sum("receipt_check_total", &[("result", "found")]);
    assert!(
        found >= N as f64,
        "receipt_check_total{{result=found}} = {found}"
    );

    // Histograms with the second-scale buckets, per role.
    for (role, e) in &all {
        for le in ["0.001", "0.0025", "0.25", "1", "60", "+Inf"] {
            assert!(
                e.has(
                    "stage_batch_duration_seconds_bucket",
                    &[("role", role), ("le", le)]
                ),
                "{role}: no stage_batch_duration_seconds bucket le={le}:\n{}",
                e.text
            );
        }
        assert!(
            !e.has("stage_batch_duration_seconds_bucket", &[("le", "5000")]),
            "{role}: millisecond-sized buckets"
        );
        assert!(
            e.sum("stage_batch_duration_seconds_count", &[("role", role)]) >= 1.0,
            "{role}: no batch recorded"
        );
        assert!(
            e.has("stage_batch_size_bucket", &[("role", role), ("le", "1000")]),
            "{role}: stage_batch_size buckets"
        );
        assert!(
            e.sum("stage_hop_latency_seconds_count", &[("role", role)]) >= 1.0,
            "{role}: no hop latency recorded"
        );
        // RPC calls by endpoint position, never by URL.
        assert!(
            e.sum("rpc_calls_total", &[("endpoint", "0"), ("result", "ok")]) >= 1.0,
            "{role}: no rpc_calls_total{{endpoint=\"0\",result=\"ok\"}}:\n{}",
            e.text
        );
        assert!(
            e.sum("rpc_endpoint_up", &[("endpoint", "0")]) == 1.0,
            "{role}: rpc_endpoint_up"
        );
        assert!(
            !e.text.contains(&p.anvil.url),
            "{role}: an endpoint URL in the metrics"
        );
        assert!(
            e.has(
                "rpc_duration_seconds_bucket",
                &[("endpoint", "0"), ("le", "0.005")]
            ),
            "{role}: rpc_duration_seconds"
        );
        // The sampled gauges.
        for s in [p.signer(0), p.signer(1)] {
            assert!(
                e.has(
                    "signer_held",
                    &[("role", role), ("signer", &s), ("chain_id", "31337")]
                ),
                "{role}: no signer_held for {s}:\n{}",
                e.text
            );
            assert_eq!(
                e.sum("signer_held", &[("signer", &s)]),
                0.0,
                "{role}: {s} is not held"
            );
        }
        assert!(e.has("outbox_backlog", &[]), "{role}: outbox_backlog");
        assert!(e.has("lease_held", &[("role", role)]), "{role}: lease_held");
        assert!(
            e.has("consumer_lag", &[]),
            "{role}: consumer_lag:\n{}",
            e.text
        );
        // No transaction, request or hash label.
        for bad in ["tx_id=", "request_id=", "hash=", "tx_hash="] {
            assert!(!e.text.contains(bad), "{role}: a {bad} label");
        }
        if let Err(lint) = promtool_check(&e.text) {
            panic!("{role}: promtool check metrics:\n{lint}\n{}", e.text);
        }
    }
    // Open transactions by state per signer, seen while in flight above, read 0 once confirmed.
    for (role, e) in &all {
        for s in [p.signer(0), p.signer(1)] {
            assert!(
                e.has("tx_open", &[("signer", &s), ("state", "SIGNED")]),
                "{role}: the tx_open series of {s} in SIGNED"
            );
            assert_eq!(
                e.sum("tx_open", &[("signer", &s)]),
                0.0,
                "{role}: {s} has no open transaction once all are confirmed"
            );
        }
    }

    // A process whose only RPC endpoint is dead: alive, not ready, the RPC check named.
    let mut dead_env: Vec<(String, String)> = env
        .iter()
        .filter(|(k, _)| k != "TXFLOW_RPC_URLS")
        .cloned()
        .collect();
    dead_env.extend([
        (
            "TXFLOW_RPC_URLS".into(),
            format!("http://127.0.0.1:{}", free_port()),
        ),
        ("TXFLOW_RPC_TIMEOUT_MS".into(), "300".into()),
        ("TXFLOW_RPC_ATTEMPTS".into(), "1".into()),
        // Its own groups: it takes no partition from the pipeline above.
        ("TXFLOW_GROUP_PREFIX".into(), unique("dead-rpc")),
    ]);
    let dead = Proc::spawn("receipt-checker", &dead_env);
    wait_until(
        "the dead-RPC process answers /healthz",
        Duration::from_secs(60),
        || async { dead.get("/healthz").await.is_some_and(|(s, _)| s == 200) },
    )
    .await;
    let (status, body) = dead.get("/readyz").await.expect("/readyz answers");
    assert_eq!(status, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("readyz JSON");
    assert_eq!(v["failed"], serde_json::json!(["rpc"]), "{body}");
    assert_eq!(v["checks"]["database"], "ok", "{body}");
    assert_eq!(v["checks"]["broker"], "ok", "{body}");
    let e = dead.metrics().await;
    assert!(
        e.sum("rpc_calls_total", &[("endpoint", "0"), ("result", "error")]) >= 1.0,
        "the failed probe is counted:\n{}",
        e.text
    );
    assert_eq!(e.sum("rpc_endpoint_up", &[("endpoint", "0")]), 0.0);

    drop(dead);
    drop(procs);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_process_pushes_its_metrics_by_otlp_when_an_endpoint_is_set() {
    let receiver = txflow_tests::otlp_metrics::OtlpMetricsReceiver::start().await;
    let p = Pipeline::prepare(1, |_| {}).await;
    let log = std::env::temp_dir().join(format!("{}.log", unique("otlp-metrics")));
    let file = std::fs::File::create(&log).expect("log file");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
    // No TXFLOW_METRICS_ADDR: the OTLP endpoint alone turns the metrics on.
    cmd.arg("allocator")
        .envs(p.env())
        .env_remove("TXFLOW_METRICS_ADDR")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint)
        .env("OTEL_METRIC_EXPORT_INTERVAL", "300")
        // This receiver takes metrics only.
        .env("OTEL_TRACES_EXPORTER", "none")
        .env("TXFLOW_LOG", "info")
        .stdout(Stdio::null())
        .stderr(file)
        .kill_on_drop(true);
    let _child = spawn_child(cmd).expect("spawn txflow allocator");
    p.send(&p.request(0, "otlp-metrics-0")).await;
    let names = wait_for(
        "the allocator's metrics arrive by OTLP",
        Duration::from_secs(60),
        || async {
            let got = receiver.metrics();
            let names: std::collections::BTreeSet<String> = got
                .iter()
                .filter(|m| m.service_name == "txflow-allocator")
                .map(|m| m.name.clone())
                .collect();
            [
                "lease.acquire",
                "fsm.transition",
                "tx.create",
                "stage.batch.duration",
            ]
            .iter()
            .all(|n| names.contains(*n))
            .then_some(names)
        },
    )
    .await;
    assert!(names.contains("rpc.calls"), "{names:?}");
    let _ = std::fs::remove_file(&log);
    p.stop().await;
}
