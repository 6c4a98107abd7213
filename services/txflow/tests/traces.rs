//! One trace per request across every hop (issue 17): the five pipeline roles run as `txflow`
//! processes of the test's own, each exporting its spans (OTLP gRPC) to a receiver the test runs
//! (`txflow_tests::otlp`, which keeps each span's `service.name`). A request is published with a
//! `traceparent` header, followed to CONFIRMED in PostgreSQL, the processes are stopped with
//! SIGTERM (they export their last spans on the way out), and then the received spans must show:
//! - one trace: every span of the request's transaction (any span naming its `tx_id`) and a
//!   `process` span of every stage are in the request's trace;
//! - parent links that hold: every span's parent is a span received, or the request's own span;
//! - each process's `service.name`: `txflow-<role>`;
//! - the OpenTelemetry messaging conventions on the stage spans (kind consumer, `messaging.*`),
//!   the produced messages' `send` spans (kind producer), and the RPC calls as child spans
//!   (`rpc <method>`, kind client) of a stage's span, with no endpoint URL anywhere.
//!
//! That nothing is exported without an endpoint is `txflow_core::otel`'s unit test of `decide`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use tokio::process::{Child, Command};
use txflow_core::codec::Subjects;
use txflow_core::kafka::signer_key;
use txflow_tests::otlp::{OtlpReceiver, ReceivedSpan};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{spawn_child, unique, wait_until};

const LONG: Duration = Duration::from_secs(300);

/// The roles, in the order a request passes them.
const ROLES: [&str; 5] = [
    "allocator",
    "signer-gateway",
    "broadcaster",
    "receipt-checker",
    "confirmation-manager",
];

struct RoleProcess {
    role: &'static str,
    child: Child,
    log: PathBuf,
}

impl RoleProcess {
    fn spawn(p: &Pipeline, role: &'static str, endpoint: &str) -> RoleProcess {
        let log = std::env::temp_dir().join(format!("{}.log", unique(role)));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
        cmd.arg(role)
            .envs(p.env())
            .env("TXFLOW_NODE_NAME", role)
            .env("TXFLOW_LOG", "info")
            .env("TXFLOW_CONFIRMATIONS_REQUIRED", "2")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            // Batches of spans every 200 ms rather than 5 s.
            .env("OTEL_BSP_SCHEDULE_DELAY", "200")
            .env("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
            // The receiver takes traces only (the metrics would go to the same endpoint).
            .env("OTEL_METRICS_EXPORTER", "none")
            .env_remove("OTEL_SERVICE_NAME")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .env_remove("OTEL_SDK_DISABLED")
            .env_remove("OTEL_TRACES_EXPORTER")
            .env_remove("TXFLOW_FAULT")
            .env_remove("TXFLOW_PAUSE_AT")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        if role == "signer-gateway" {
            let (k, v) = p.signer_keys_env();
            cmd.env(k, v);
        }
        RoleProcess {
            role,
            // Dies with the test process, even one killed by a timeout.
            child: spawn_child(cmd).unwrap_or_else(|e| panic!("spawn txflow {role}: {e}")),
            log,
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process logged that it holds partitions of `topic`.
    fn assigned(&self, topic: &str) -> bool {
        self.log_text()
            .lines()
            .any(|l| l.contains("partitions assigned") && l.contains(topic))
    }

    fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGTERM, then the exit: a role finishes its batch, releases its leases and exports its
    /// last spans before it exits.
    async fn stop(mut self) {
        let pid = self.child.id().expect("the process runs").to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill")
            .success();
        assert!(sent, "kill -TERM {pid}");
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "txflow {} did not stop within 60 s of SIGTERM:\n{}",
                    self.role,
                    self.log_tail()
                )
            })
            .expect("the process status");
        assert!(
            status.success(),
            "txflow {} ended with {status} after SIGTERM:\n{}",
            self.role,
            self.log_tail()
        );
    }
}

/// A random lowercase hex string of `n` characters.
fn hex_id(n: usize) -> String {
    let mut s = String::new();
    while s.len() < n {
        s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    }
    s.truncate(n);
    s
}

fn show(spans: &[&ReceivedSpan]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "{} [{}] {} parent={} trace={}",
                s.name, s.service_name, s.span_id, s.parent_span_id, s.trace_id
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test]
async fn one_request_is_one_trace_across_every_role_process() {
    let started = Instant::now();
    let receiver = OtlpReceiver::start().await;
    let p = Pipeline::prepare(1, |_| {}).await;
    let processes: Vec<RoleProcess> = ROLES
        .iter()
        .map(|role| RoleProcess::spawn(&p, role, &receiver.endpoint))
        .collect();

    // Every stage holds its partitions first, so that the request's steps are the stages' answers
    // to its messages (a stage that joins late finds the work in its recovery scan instead, in a
    // trace of its own).
    let t = &p.config.topics;
    let inputs = [
        t.tx_requests(),
        t.tx_allocated(),
        t.tx_signed(),
        t.tx_submitted(),
        t.tx_receipts(),
    ];
    wait_until(
        "every role process holds its input's partitions",
        Duration::from_secs(120),
        || async {
            processes
                .iter()
                .zip(&inputs)
                .all(|(process, topic)| process.assigned(topic))
        },
    )
    .await;

    // The request, as an upstream service would publish it: with the context of its own span.
    let trace_id = hex_id(32);
    let request_span = hex_id(16);
    let traceparent = format!("00-{trace_id}-{request_span}-01");
    let request = p.request(0, &unique("traced"));
    let topic = p.config.topics.tx_requests();
    let bytes = p
        .codec
        .encode(&topic, Subjects::TopicName, &request)
        .await
        .expect("encode");
    let key = signer_key(request.chain_id, &request.signer);
    let producer = txflow_tests::producer(&p.config.kafka);
    producer
        .send(
            FutureRecord::to(&topic)
                .key(&key)
                .payload(&bytes)
                .headers(OwnedHeaders::new().insert(Header {
                    key: "traceparent",
                    value: Some(traceparent.as_bytes()),
                })),
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|(e, _)| panic!("produce the request: {e}"));

    // Polled like `wait_until`, with the processes' logs in the failure.
    let deadline = Instant::now() + LONG;
    while p.state_of(&request.request_id).await.as_deref() != Some("CONFIRMED") {
        if Instant::now() > deadline {
            let logs: Vec<String> = processes
                .iter()
                .map(|p| format!("--- {}\n{}", p.role, p.log_tail()))
                .collect();
            panic!("not CONFIRMED within {LONG:?}:\n{}", logs.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let tx_id: String = sqlx::query_scalar(
        "SELECT tx_id::text FROM managed_tx WHERE request_id = $1 AND state = 'CONFIRMED'",
    )
    .bind(&request.request_id)
    .fetch_one(&p.db.pool)
    .await
    .expect("the confirmed transaction");
    let recorded: Option<String> =
        sqlx::query_scalar("SELECT traceparent FROM managed_tx WHERE tx_id::text = $1")
            .bind(&tx_id)
            .fetch_one(&p.db.pool)
            .await
            .expect("its trace context");
    assert!(
        recorded
            .as_deref()
            .is_some_and(|r| r.starts_with(&format!("00-{trace_id}-"))),
        "the request's trace is recorded with its transaction: {recorded:?}"
    );
    let confirmed_after = started.elapsed();

    // Stopped as a supervisor stops them; each exports what it has left on the way out.
    for process in processes {
        process.stop().await;
    }

    // Every stage's span of the request has arrived (already, after the exits; polled all the
    // same).
    wait_until(
        "a process span of every stage in the request's trace",
        Duration::from_secs(30),
        || async {
            let spans = receiver.spans();
            ROLES.iter().all(|role| {
                spans
                    .iter()
                    .any(|s| s.trace_id == trace_id && s.name == format!("{role} process"))
            })
        },
    )
    .await;
    let all = receiver.spans();
    let ours: Vec<&ReceivedSpan> = all.iter().filter(|s| s.trace_id == trace_id).collect();
    let ids: BTreeSet<&str> = all.iter().map(|s| s.span_id.as_str()).collect();

    // One trace: every span that names the transaction is in the request's trace.
    let naming: Vec<&ReceivedSpan> = all
        .iter()
        .filter(|s| s.attr("tx_id") == Some(tx_id.as_str()))
        .collect();
    let elsewhere: Vec<&ReceivedSpan> = naming
        .iter()
        .copied()
        .filter(|s| s.trace_id != trace_id)
        .collect();
    assert!(
        elsewhere.is_empty(),
        "spans of the transaction outside the request's trace:\n{}",
        show(&elsewhere)
    );

    // Every stage took part, each under its own service name, with the messaging conventions.
    for role in ROLES {
        let service = format!("txflow-{role}");
        let process: Vec<&ReceivedSpan> = ours
            .iter()
            .copied()
            .filter(|s| s.name == format!("{role} process"))
            .collect();
        assert!(
            !process.is_empty(),
            "no {role} process span in the trace:\n{}",
            show(&ours)
        );
        // A message handled under the signer's lease carries its token (one retried for want of
        // the lease has none).
        assert!(
            process.iter().any(|s| s.attr("fencing_token").is_some()),
            "{role}: no process span with a fencing token: {process:?}"
        );
        for s in &process {
            assert_eq!(s.service_name, service, "{s:?}");
            assert_eq!(s.kind, 5, "a consumer span: {s:?}");
            assert_eq!(s.attr("messaging.system"), Some("kafka"), "{s:?}");
            assert_eq!(s.attr("messaging.operation.type"), Some("process"), "{s:?}");
            assert!(
                s.attr("messaging.destination.name")
                    .is_some_and(|t| t.starts_with(&p.config.topics.prefix)),
                "{s:?}"
            );
            assert_eq!(s.attr("signer"), Some(p.signer(0).as_str()), "{s:?}");
            assert_eq!(s.attr("chain_id"), Some("31337"), "{s:?}");
            if let Some(token) = s.attr("fencing_token") {
                assert!(token.parse::<i64>().is_ok_and(|t| t > 0), "{s:?}");
            }
            if role != "allocator" {
                assert_eq!(s.attr("tx_id"), Some(tx_id.as_str()), "{s:?}");
            }
        }
        // Every span named for a role came from that role's process, whose resource also holds
        // OTEL_RESOURCE_ATTRIBUTES.
        for s in all
            .iter()
            .filter(|s| s.name.starts_with(&format!("{role} ")))
        {
            assert_eq!(s.service_name, service, "{s:?}");
            assert_eq!(
                s.resource.get("deployment.environment").map(String::as_str),
                Some("test"),
                "{s:?}"
            );
        }
    }
    let services: BTreeSet<&str> = all.iter().map(|s| s.service_name.as_str()).collect();
    let expected: BTreeSet<String> = ROLES.iter().map(|r| format!("txflow-{r}")).collect();
    assert_eq!(
        services,
        expected.iter().map(String::as_str).collect(),
        "exactly the five role processes exported"
    );

    // The request's first hop is a child of the request's own span; every other parent is a
    // span that was received.
    let allocator = ours
        .iter()
        .find(|s| s.name == "allocator process")
        .expect("the allocator's span");
    assert_eq!(allocator.parent_span_id, request_span, "{allocator:?}");
    let orphans: Vec<&ReceivedSpan> = all
        .iter()
        .filter(|s| {
            !s.parent_span_id.is_empty()
                && s.parent_span_id != request_span
                && !ids.contains(s.parent_span_id.as_str())
        })
        .collect();
    assert!(
        orphans.is_empty(),
        "spans whose parent was never received:\n{}",
        show(&orphans)
    );

    // Each hop: the next stage's span is the child of the `send` span (kind producer) of the
    // message it consumed, in the trace.
    let by_id: BTreeMap<&str, &ReceivedSpan> =
        all.iter().map(|s| (s.span_id.as_str(), s)).collect();
    for role in &ROLES[1..] {
        let hop = ours
            .iter()
            .filter(|s| s.name == format!("{role} process"))
            .map(|s| by_id.get(s.parent_span_id.as_str()))
            .collect::<Vec<_>>();
        assert!(
            hop.iter()
                .all(|parent| parent.is_some_and(|s| s.kind == 4 && s.name.starts_with("send "))),
            "{role}: its messages' parents are send spans: {hop:?}"
        );
    }

    // RPC calls are child spans of a stage's span (a drive or a message), never roots, and no
    // attribute of any span holds an endpoint URL.
    let rpc: Vec<&ReceivedSpan> = all.iter().filter(|s| s.name.starts_with("rpc ")).collect();
    assert!(!rpc.is_empty(), "no RPC span at all");
    for s in &rpc {
        assert_eq!(s.kind, 3, "a client span: {s:?}");
        let parent = by_id
            .get(s.parent_span_id.as_str())
            .unwrap_or_else(|| panic!("an RPC span without a received parent: {s:?}"));
        assert!(
            parent.name.ends_with(" drive")
                || parent.name.ends_with(" process")
                || parent.name == "handle",
            "an RPC span under {parent:?}"
        );
    }
    // The request's own calls (the allocator's estimate, the broadcaster's send, the receipt
    // lookups) are in its trace, each under the drive or message span that made it.
    assert!(
        ours.iter().any(|s| s.name.starts_with("rpc ")),
        "no RPC span in the request's trace:\n{}",
        show(&ours)
    );
    let anvil_port = p.anvil.port.to_string();
    for s in &all {
        for (k, v) in &s.attributes {
            assert!(
                !v.contains("http://") && !v.contains(&format!(":{anvil_port}")),
                "{k}={v} on {s:?}"
            );
        }
    }

    eprintln!(
        "traces: {} spans received, {} in the request's trace; CONFIRMED after {:.1} s, whole test {:.1} s",
        all.len(),
        ours.len(),
        confirmed_after.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}
