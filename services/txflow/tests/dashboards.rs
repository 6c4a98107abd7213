//! The Grafana dashboards and the Prometheus alert rules (issue 17, part 3) against the real thing.
//!
//! - `promtool check rules` passes on `deploy/prometheus/alerts.yml` and fails on a copy with one
//!   broken expression (so the check is real); `promtool check config` passes on
//!   `deploy/prometheus/prometheus.yml`.
//! - Every dashboard of `deploy/grafana/dashboards` parses, every panel has expressions, every
//!   target uses the `${datasource}` variable, and every expression passes `promtool check rules`.
//! - A pipeline run: the five stages as `txflow` processes with their `/metrics` on free ports
//!   (`TXFLOW_METRICS_ADDR`), a Prometheus (the Debian package, `PROMETHEUS_BIN`) scraping them
//!   every second and evaluating the repository's `alerts.yml` every second; requests of two
//!   funded signers mine and confirm, a signer without funds is held, one undecodable message is
//!   dead-lettered. Then every panel's expression (template variables substituted: `$__rate_interval`
//!   → `1m`, a multi-value variable → its "All" value `.*`), every variable's metric and every
//!   recording rule's expression returns a non-empty result from Prometheus's query API, every
//!   alert's left-hand side (a recorded series) exists, and the SignerHeld alert fires for the
//!   unfunded signer (after its own `for: 1m`: the rule file is used as shipped). An alert whose
//!   condition is false rightly returns nothing, so the alerts themselves are checked through
//!   their recorded signals. Each `/metrics` output passes `promtool check metrics`.
//!
//! Here rather than in `tests/tests/` because it runs `txflow` processes (Cargo builds this
//! crate's binary for its own tests, `CARGO_BIN_EXE_txflow`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use alloy::signers::local::PrivateKeySigner;
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, Command};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{free_port, spawn_child, unique, wait_for, wait_until};

const LONG: Duration = Duration::from_secs(300);

/// The alerts the issue asks for (the file may hold more).
const REQUIRED_ALERTS: [&str; 13] = [
    "FencedWritesSpike",
    "ReceiptBacklogGrowing",
    "ResubmissionRateHigh",
    "SignerHeld",
    "DefensiveCancellation",
    "TransactionsReverted",
    "ConservationViolation",
    "ConsumerLagHigh",
    "DeadLetters",
    "TransferStuckInTargetPending",
    "TransferRefundFailing",
    "TransfersHalted",
    "TransferRateAbnormal",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

/// A tool from its variable (`deploy/local/env.sh` exports them) or from `PATH`.
fn tool(var: &str, name: &str) -> PathBuf {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(name))
}

fn promtool() -> PathBuf {
    tool("PROMTOOL_BIN", "promtool")
}

/// A directory of the test's own, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(prefix: &str) -> TempDir {
        let dir = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `promtool <args>`: (success, stdout + stderr).
fn run_promtool(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(promtool())
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "run {} (deploy/local/install.sh installs it): {e}",
                promtool().display()
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn the_alert_rules_pass_promtool_and_a_broken_copy_does_not() {
    let rules = repo().join("deploy/prometheus/alerts.yml");
    let (ok, out) = run_promtool(&["check", "rules", rules.to_str().expect("utf-8 path")]);
    assert!(ok, "promtool check rules {}:\n{out}", rules.display());

    let config = repo().join("deploy/prometheus/prometheus.yml");
    let (ok, out) = run_promtool(&["check", "config", config.to_str().expect("utf-8 path")]);
    assert!(ok, "promtool check config {}:\n{out}", config.display());

    // The same file with one expression broken: the check must see it.
    let text = std::fs::read_to_string(&rules).expect("read alerts.yml");
    let good = "expr: txflow:signer_held:max > 0";
    assert!(text.contains(good), "alerts.yml has the line {good:?}");
    let broken = text.replacen(good, "expr: txflow:signer_held:max > (0", 1);
    let dir = TempDir::new("broken-rules");
    let copy = dir.0.join("alerts.yml");
    std::fs::write(&copy, broken).expect("write the broken copy");
    let (ok, out) = run_promtool(&["check", "rules", copy.to_str().expect("utf-8 path")]);
    assert!(!ok, "promtool accepted a broken expression:\n{out}");
    assert!(
        out.contains("SignerHeld") || out.contains("parse error"),
        "{out}"
    );
}

#[test]
fn mon_001_mon_002_mon_003_mon_004_transfer_alerts_fire_on_their_signals() {
    // deploy/prometheus/alerts_test.yml: the transfer alarms against series as the coordinator
    // exports them, evaluated by promtool (quiet before the signal, firing with the right
    // labels and annotations after it).
    let tests = repo().join("deploy/prometheus/alerts_test.yml");
    let (ok, out) = run_promtool(&["test", "rules", tests.to_str().expect("utf-8 path")]);
    assert!(ok, "promtool test rules {}:\n{out}", tests.display());
    // The check is real: an alert that fires differently makes it fail.
    let rules = std::fs::read_to_string(repo().join("deploy/prometheus/alerts.yml"))
        .expect("read alerts.yml");
    let dir = TempDir::new("mon-rules");
    let changed = "expr: txflow:transfer_refund_failed_3:max > 5";
    std::fs::write(
        dir.0.join("alerts.yml"),
        rules.replacen("expr: txflow:transfer_refund_failed_3:max > 0", changed, 1),
    )
    .expect("write the changed rules");
    std::fs::copy(&tests, dir.0.join("alerts_test.yml")).expect("copy the tests");
    let copy = dir.0.join("alerts_test.yml");
    let (ok, out) = run_promtool(&["test", "rules", copy.to_str().expect("utf-8 path")]);
    assert!(!ok, "promtool passed rules that no longer fire:\n{out}");
}

/// A dashboard file: its name and its JSON.
struct Dashboard {
    file: String,
    json: Value,
}

fn dashboards() -> Vec<Dashboard> {
    let dir = repo().join("deploy/grafana/dashboards");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no dashboard in {}", dir.display());
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).expect("read the dashboard");
            let json: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
            Dashboard {
                file: path
                    .file_name()
                    .expect("a file name")
                    .to_string_lossy()
                    .into_owned(),
                json,
            }
        })
        .collect()
}

/// Every panel, rows' nested panels included (a collapsed row keeps its panels inside).
fn panels(v: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for p in v["panels"].as_array().into_iter().flatten() {
        all.push(p);
        all.extend(panels(p));
    }
    all
}

/// A dashboard's template variables: (name, type, the value that stands for them in a query).
fn variables(d: &Dashboard) -> Vec<(String, String, Option<String>)> {
    d.json["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| {
            (
                v["name"].as_str().unwrap_or_default().to_string(),
                v["type"].as_str().unwrap_or_default().to_string(),
                v["allValue"].as_str().map(str::to_string),
            )
        })
        .collect()
}

/// `expr` with the dashboard's variables replaced as Grafana would for "All" over a range:
/// `$__rate_interval` and `$__interval` → `1m`, a variable → its `allValue`.
fn substitute(d: &Dashboard, expr: &str) -> String {
    let mut values: Vec<(String, String)> = vec![
        ("__rate_interval".into(), "1m".into()),
        ("__interval".into(), "1m".into()),
        ("__range".into(), "5m".into()),
    ];
    for (name, kind, all) in variables(d) {
        if kind != "datasource" {
            values.push((name, all.unwrap_or_else(|| ".*".into())));
        }
    }
    let mut out = expr.to_string();
    for (name, value) in &values {
        out = out.replace(&format!("${{{name}}}"), value);
        out = out.replace(&format!("[[{name}]]"), value);
        // `$name` not followed by more of a name (`$chain` must not eat `$chain_id`).
        let mut rest = out.as_str();
        let mut done = String::new();
        let needle = format!("${name}");
        while let Some(i) = rest.find(&needle) {
            let after = &rest[i + needle.len()..];
            done.push_str(&rest[..i]);
            if after
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                done.push_str(&needle);
            } else {
                done.push_str(value);
            }
            rest = after;
        }
        done.push_str(rest);
        out = done;
    }
    out
}

/// What a dashboard asks Prometheus: (where, the query with variables substituted). The panels'
/// targets, and for a `label_values(metric, label)` variable the series of its metric that have
/// the label.
fn queries(d: &Dashboard) -> Vec<(String, String)> {
    let mut all = Vec::new();
    for p in panels(&d.json) {
        if p["type"] == "row" {
            continue;
        }
        let title = p["title"].as_str().unwrap_or("(untitled)");
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = t["expr"].as_str() {
                all.push((
                    format!("{} / {title} / {}", d.file, t["refId"]),
                    substitute(d, expr),
                ));
            }
        }
    }
    for v in d.json["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let query = v["query"]["query"]
            .as_str()
            .or_else(|| v["query"].as_str())
            .unwrap_or_default();
        if let Some(args) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
        {
            let (metric, label) = args
                .rsplit_once(',')
                .unwrap_or_else(|| panic!("{}: label_values without a metric: {query}", d.file));
            let (metric, label) = (metric.trim(), label.trim());
            // The series of `metric` that have the label: what the drop-down lists.
            let with_label = match metric.split_once('{') {
                Some((name, rest)) => format!("{name}{{{label}!=\"\", {rest}"),
                None => format!("{metric}{{{label}!=\"\"}}"),
            };
            all.push((
                format!("{} / variable {}", d.file, v["name"]),
                substitute(d, &format!("group by ({label}) ({with_label})")),
            ));
        }
    }
    all
}

#[test]
fn every_dashboard_parses_and_every_panel_expression_passes_promtool() {
    let mut exprs = Vec::new();
    let mut uids = BTreeSet::new();
    for d in dashboards() {
        assert!(
            d.json["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
            "{}: schemaVersion",
            d.file
        );
        let uid = d.json["uid"].as_str().expect("a uid").to_string();
        assert!(uids.insert(uid.clone()), "{}: uid {uid} used twice", d.file);
        assert!(
            variables(&d)
                .iter()
                .any(|(name, kind, _)| name == "datasource" && kind == "datasource"),
            "{}: no `datasource` variable",
            d.file
        );
        let mut targets = 0;
        for p in panels(&d.json) {
            if p["type"] == "row" {
                continue;
            }
            let title = p["title"].as_str().unwrap_or("(untitled)");
            let ts = p["targets"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            assert!(!ts.is_empty(), "{} / {title}: no target", d.file);
            for t in ts {
                targets += 1;
                let expr = t["expr"].as_str().unwrap_or_default();
                assert!(!expr.trim().is_empty(), "{} / {title}: empty expr", d.file);
                for ds in [&p["datasource"], &t["datasource"]] {
                    assert_eq!(
                        ds["uid"], "${datasource}",
                        "{} / {title}: the data source is the variable",
                        d.file
                    );
                }
                // Labels a Collector path does not keep, or that would be unbounded.
                for banned in [
                    "otel_scope",
                    "target_info",
                    "service_name",
                    "tx_id",
                    "request_id",
                ] {
                    assert!(!expr.contains(banned), "{} / {title}: {banned}", d.file);
                }
            }
        }
        assert!(targets > 0, "{}: no panel with a query", d.file);
        exprs.extend(queries(&d));
    }

    // Every expression, variables substituted, as a recording rule: promtool parses each.
    let mut rules = String::from("groups:\n  - name: dashboards\n    rules:\n");
    for (i, (_, expr)) in exprs.iter().enumerate() {
        assert!(!expr.contains('$'), "a variable left in {expr}");
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(expr).expect("a JSON string is a YAML string")
        ));
    }
    let dir = TempDir::new("dashboard-rules");
    let file = dir.0.join("dashboards.yml");
    std::fs::write(&file, rules).expect("write");
    let (ok, out) = run_promtool(&["check", "rules", file.to_str().expect("utf-8 path")]);
    assert!(ok, "a dashboard expression does not parse:\n{out}");
}

/// A `txflow <role>` process with its metrics endpoint, killed on drop and with the test process.
struct RoleProcess {
    role: &'static str,
    port: u16,
    child: Child,
    log: PathBuf,
}

impl RoleProcess {
    fn spawn(p: &Pipeline, role: &'static str, port: u16, dir: &Path) -> RoleProcess {
        let log = dir.join(format!("{role}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
        cmd.arg(role)
            .envs(p.env())
            .env("TXFLOW_NODE_NAME", format!("{role}-1"))
            .env("TXFLOW_METRICS_ADDR", format!("127.0.0.1:{port}"))
            // Gauges sampled every second, so that a hold shows within a scrape or two.
            .env("TXFLOW_METRICS_SAMPLE_MS", "1000")
            .env("TXFLOW_LOG", "info")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("TXFLOW_FAULT")
            .env_remove("TXFLOW_PAUSE_AT")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        if role == "signer-gateway" {
            let (k, v) = p.signer_keys_env();
            cmd.env(k, v);
        }
        let child = spawn_child(cmd).unwrap_or_else(|e| panic!("spawn txflow {role}: {e}"));
        RoleProcess {
            role,
            port,
            child,
            log,
        }
    }

    fn metrics_url(&self) -> String {
        format!("http://127.0.0.1:{}/metrics", self.port)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// A Prometheus of the test's own on a free port, killed on drop and with the test process.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Prometheus {
    /// Scrapes `targets` (job name, port) every second and evaluates `rules` every second.
    fn start(dir: &Path, targets: &[(String, u16)], rules: &Path) -> Prometheus {
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n",
            serde_json::to_string(rules.to_str().expect("utf-8 path")).expect("json")
        );
        for (job, port) in targets {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [\"127.0.0.1:{port}\"]\n"
            ));
        }
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, config).expect("write prometheus.yml");
        let port = free_port();
        let log = dir.join("prometheus.log");
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(tool("PROMETHEUS_BIN", "prometheus"));
        cmd.arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        let child = spawn_child(cmd).unwrap_or_else(|e| {
            panic!("start prometheus (deploy/local/install.sh installs it): {e}")
        });
        Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// `GET /api/v1/<path>` with `params`: the `data` of a successful answer, or why not.
    async fn api(
        &self,
        http: &reqwest::Client,
        path: &str,
        params: &[(&str, &str)],
    ) -> Result<Value, String> {
        let url = reqwest::Url::parse_with_params(&format!("{}/api/v1/{path}", self.url), params)
            .map_err(|e| e.to_string())?;
        let body: Value = http
            .get(url)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        if body["status"] == "success" {
            Ok(body["data"].clone())
        } else {
            Err(format!("{}: {}", body["errorType"], body["error"]))
        }
    }

    /// An instant query's result series (an error is a failure of the test: the query is bad).
    async fn query(&self, http: &reqwest::Client, q: &str) -> Vec<Value> {
        match self.api(http, "query", &[("query", q)]).await {
            Ok(data) => data["result"].as_array().cloned().unwrap_or_default(),
            Err(e) if e.contains("bad_data") => panic!("Prometheus rejects {q}: {e}"),
            // Not answering (yet): empty, the caller polls.
            Err(_) => Vec::new(),
        }
    }
}

/// A rule as Prometheus loaded it (`/api/v1/rules`).
struct LoadedRule {
    kind: String,
    name: String,
    query: String,
    json: Value,
}

async fn loaded_rules(prom: &Prometheus, http: &reqwest::Client) -> Vec<LoadedRule> {
    let data = prom.api(http, "rules", &[]).await.expect("/api/v1/rules");
    let mut rules = Vec::new();
    for g in data["groups"].as_array().into_iter().flatten() {
        for r in g["rules"].as_array().into_iter().flatten() {
            rules.push(LoadedRule {
                kind: r["type"].as_str().unwrap_or_default().to_string(),
                name: r["name"].as_str().unwrap_or_default().to_string(),
                query: r["query"].as_str().unwrap_or_default().to_string(),
                json: r.clone(),
            });
        }
    }
    rules
}

/// An alert's condition as `<recorded signal> <op> <threshold>`: the signal.
fn alert_signal(query: &str) -> Option<&str> {
    let parts: Vec<&str> = query.split_whitespace().collect();
    let [signal, op, threshold] = parts.as_slice() else {
        return None;
    };
    let ok = signal.starts_with("txflow:")
        && ["<", ">", "<=", ">=", "==", "!="].contains(op)
        && threshold.parse::<f64>().is_ok();
    ok.then_some(*signal)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_run_feeds_every_panel_and_rule_and_a_signer_without_funds_fires_signer_held() {
    let dir = TempDir::new("txflow-prometheus");
    let mut p = Pipeline::prepare(2, |_| {}).await;
    // A third signer the signer gateway has the key of, with no funds at all (anvil starts it at
    // a balance of 0): the allocator cannot even pay a plain transfer's gas for it and holds it.
    let broke = PrivateKeySigner::random();
    p.signers.push(broke);
    let broke_addr = p.signer(2);

    // Every role's metrics port is chosen first: Prometheus scrapes all five from the start. The
    // receipt checker starts only once the funded requests are SUBMITTED and Prometheus has seen
    // them so: without it they stay SUBMITTED, so the receipt backlog's series (tx_open in
    // SUBMITTED) is sure to exist rather than depending on a sample falling in a short window.
    let ports: BTreeMap<&'static str, u16> = [
        "allocator",
        "signer-gateway",
        "broadcaster",
        "receipt-checker",
        "confirmation-manager",
    ]
    .into_iter()
    .map(|role| (role, free_port()))
    .collect();
    let mut roles: Vec<RoleProcess> = ports
        .iter()
        .filter(|(role, _)| **role != "receipt-checker")
        .map(|(role, port)| RoleProcess::spawn(&p, role, *port, &dir.0))
        .collect();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http client");
    let serves = |r: &RoleProcess| {
        let (http, url) = (http.clone(), r.metrics_url());
        async move {
            match http.get(url).send().await {
                Ok(resp) => resp.status().is_success(),
                Err(_) => false,
            }
        }
    };
    for r in &roles {
        wait_until(&format!("{} serves /metrics", r.role), LONG, || serves(r)).await;
    }

    let rules_file = repo().join("deploy/prometheus/alerts.yml");
    let targets: Vec<(String, u16)> = ports
        .iter()
        .map(|(role, port)| (format!("txflow-{role}"), *port))
        .collect();
    let mut prom = Prometheus::start(&dir.0, &targets, &rules_file);
    let targets_up = |n: usize| {
        let (prom, http) = (&prom, &http);
        async move {
            let Ok(data) = prom.api(http, "targets", &[]).await else {
                return false;
            };
            let active = data["activeTargets"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            active.iter().filter(|t| t["health"] == "up").count() == n
        }
    };
    wait_until(
        "Prometheus scrapes the running role processes",
        LONG,
        || targets_up(roles.len()),
    )
    .await;

    // The rules as Prometheus loaded them from the repository's file: the required alerts, each
    // `<recorded signal> <op> <threshold>` with a severity and its annotations.
    let rules = loaded_rules(&prom, &http).await;
    let recorded: BTreeSet<&str> = rules
        .iter()
        .filter(|r| r.kind == "recording")
        .map(|r| r.name.as_str())
        .collect();
    for name in REQUIRED_ALERTS {
        assert!(
            rules.iter().any(|r| r.kind == "alerting" && r.name == name),
            "alerts.yml has no alert {name}"
        );
    }
    for r in rules.iter().filter(|r| r.kind == "alerting") {
        let signal = alert_signal(&r.query)
            .unwrap_or_else(|| panic!("{}: `{}` is not `<signal> <op> <n>`", r.name, r.query));
        assert!(
            recorded.contains(signal),
            "{}: {signal} is no recording rule",
            r.name
        );
        assert!(
            r.json["labels"]["severity"].is_string(),
            "{}: severity",
            r.name
        );
        for a in ["summary", "description", "runbook"] {
            assert!(r.json["annotations"][a].is_string(), "{}: {a}", r.name);
        }
    }

    // The run: requests of the funded signers, one of the signer without funds, one message
    // nobody can decode.
    let mut ids = Vec::new();
    for signer in 0..2 {
        for i in 0..3 {
            let id = format!("ok-{signer}-{i}");
            p.send(&p.request(signer, &id)).await;
            ids.push(id);
        }
    }
    p.send(&p.request(2, "broke-0")).await;
    p.send_raw(&format!("31337:{}", p.signer(0)), b"not an avro message")
        .await;

    wait_until(
        "the funded signers' requests are SUBMITTED",
        LONG,
        || async {
            p.count("SELECT count(*) FROM managed_tx WHERE state = 'SUBMITTED'")
                .await
                == ids.len() as i64
        },
    )
    .await;
    wait_until("Prometheus has their SUBMITTED series", LONG, || async {
        !prom
            .query(&http, r#"tx_open{state="SUBMITTED"} > 0"#)
            .await
            .is_empty()
    })
    .await;
    let checker = RoleProcess::spawn(&p, "receipt-checker", ports["receipt-checker"], &dir.0);
    wait_until("the receipt checker serves /metrics", LONG, || {
        serves(&checker)
    })
    .await;
    roles.push(checker);
    wait_until("Prometheus scrapes every role process", LONG, || {
        targets_up(roles.len())
    })
    .await;

    wait_until("the funded signers' requests mine", LONG, || async {
        let mined = p.mined_markers().await;
        ids.iter()
            .all(|id| mined.contains_key(&format!("txflow:{id}")))
    })
    .await;
    wait_until("they are confirmed", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'")
            .await
            == ids.len() as i64
    })
    .await;
    wait_until("the signer without funds is held", LONG, || async {
        p.count(&format!(
            "SELECT count(*) FROM signer_holds WHERE signer = '{broke_addr}'"
        ))
        .await
            > 0
    })
    .await;

    // Every query of every dashboard and every rule returns a series; an alert's signal exists.
    let mut wanted: Vec<(String, String)> = dashboards().iter().flat_map(queries).collect();
    for r in &rules {
        match r.kind.as_str() {
            "recording" => {
                wanted.push((format!("rule {}", r.name), r.query.clone()));
                wanted.push((format!("recorded {}", r.name), r.name.clone()));
            }
            _ => {
                let signal = alert_signal(&r.query).expect("checked above");
                wanted.push((format!("alert {} signal", r.name), signal.to_string()));
            }
        }
    }
    let mut empty: BTreeMap<String, String> = wanted.iter().cloned().collect();
    let polled = tokio::time::timeout(LONG, async {
        loop {
            let mut still = BTreeMap::new();
            for (what, q) in &empty {
                if prom.query(&http, q).await.is_empty() {
                    still.insert(what.clone(), q.clone());
                }
            }
            empty = still;
            if empty.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    if polled.is_err() {
        let list: Vec<String> = empty.iter().map(|(w, q)| format!("{w}: {q}")).collect();
        panic!(
            "{} of {} queries still return nothing after {LONG:?}:\n{}\n\nPrometheus:\n{}\n\n{}",
            empty.len(),
            wanted.len(),
            list.join("\n"),
            prom.log_tail(),
            roles
                .iter()
                .map(|r| format!("{}:\n{}", r.role, r.log_tail()))
                .collect::<Vec<_>>()
                .join("\n\n")
        );
    }

    // The alert fires for real, for that signer and no other.
    let firing = wait_for(
        "SignerHeld fires for the signer without funds",
        LONG,
        || async {
            let data = prom.api(&http, "alerts", &[]).await.ok()?;
            let alerts = data["alerts"].as_array().cloned().unwrap_or_default();
            let held: Vec<Value> = alerts
                .into_iter()
                .filter(|a| a["labels"]["alertname"] == "SignerHeld")
                .collect();
            held.iter()
                .any(|a| a["labels"]["signer"] == broke_addr.as_str() && a["state"] == "firing")
                .then_some(held)
        },
    )
    .await;
    for a in &firing {
        assert_eq!(
            a["labels"]["signer"], broke_addr,
            "only the signer without funds is held: {a}"
        );
    }
    let a = firing
        .iter()
        .find(|a| a["state"] == "firing")
        .expect("firing");
    assert_eq!(a["labels"]["severity"], "critical", "{a}");
    assert_eq!(a["labels"]["chain_id"], "31337", "{a}");
    assert!(
        a["annotations"]["summary"]
            .as_str()
            .is_some_and(|s| s.contains(&broke_addr)),
        "{a}"
    );

    // Every exposition passes promtool's lint.
    for r in &roles {
        let body = http
            .get(r.metrics_url())
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("the exposition");
        let mut check = std::process::Command::new(promtool());
        check
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = tokio::process::Command::from(check)
            .spawn()
            .expect("run promtool check metrics");
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(body.as_bytes())
            .await
            .expect("feed promtool");
        drop(stdin);
        let out = child.wait_with_output().await.expect("promtool's answer");
        assert!(
            out.status.success(),
            "promtool check metrics on {}'s /metrics:\n{}{}",
            r.role,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let _ = prom.child.kill().await;
    for mut r in roles {
        let _ = r.child.kill().await;
    }
    p.stop().await;
}
