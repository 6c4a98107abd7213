//! `txflow bench`: load generators.
//!
//! - `--scenario broker-hop`: one produce → consume hop through the configured broker with the
//!   pipeline's client settings; reports the per-hop latency distribution and the rate achieved.
//! - `--scenario pipeline` (default): requests through the real pipeline (issue #5), until every
//!   one is mined (`--until submitted`, the default) or CONFIRMED (`--until confirmed`: as a
//!   downstream reader books it, txflow-client's `OutcomeReader` on `tx.outcomes`). The requests
//!   go in through txflow-client's `Producer`.
//! - `--scenario anvil`: the chain alone — the same transactions (same signers × requests, same
//!   calldata markers) signed here and sent straight to the RPC endpoint, to put the pipeline's
//!   figures next to what the chain takes without txflow.
//! - `--compare` (pipeline): both against the same node, the chain alone first, with their ratio
//!   and the CPU seconds of txflow, the broker, the node and PostgreSQL over each (`bench_cpu.rs`).
//! - `--rate N` (pipeline): an open loop offering N requests per second, each on its schedule
//!   whatever the earlier ones are doing, latency counted from the scheduled time.
//! - `--scenario allocate`: one hot signer's nonce allocation through the allocator's handler
//!   against PostgreSQL (`bench_alloc.rs`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use txflow_core::config::Config;
use txflow_core::kafka::{delete_topics, ensure_topics};

use crate::bench_cpu::{self, CpuProbe, CpuUse};
use crate::local::{BlockNudge, LocalPipeline};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[arg(long, value_enum, default_value_t = Scenario::Pipeline)]
    scenario: Scenario,
    /// Signers (pipeline, stage).
    #[arg(long, default_value_t = 1)]
    signers: u32,
    /// Requests per signer (pipeline; allocate: of its one signer).
    #[arg(long, default_value_t = 100)]
    txs: u32,
    /// Messages to send (broker-hop, stage).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    messages: u32,
    /// Largest batch the stage runtime takes (stage, allocate); 1 = one message per transaction.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
    batch_max: u32,
    /// Messages per second, 0 for as fast as possible (broker-hop, default 2000; stage latency
    /// phase). Pipeline, allocate: requests offered per second, steadily (an open loop; without
    /// it all are sent at once).
    #[arg(long)]
    rate: Option<u32>,
    /// Measure the chain alone first (as `--scenario anvil`, fresh signers), then the pipeline
    /// with as many signers and requests, against the same node; report both and their ratio
    /// (pipeline).
    #[arg(long)]
    compare: bool,
    /// Payload size in bytes (broker-hop).
    #[arg(long, default_value_t = 256)]
    size: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
    /// Give up waiting for the chain after this many seconds (pipeline).
    #[arg(long, default_value_t = 600)]
    deadline_secs: u64,
    /// How far to follow the requests (pipeline).
    #[arg(long, value_enum, default_value_t = Until::Submitted)]
    until: Until,
}

/// Where the pipeline bench stops waiting. Either way `tx_per_s` is requests mined per second from
/// the first send to the last one mined, so that figures stay comparable across `--until`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Until {
    /// Every request SUBMITTED and its transaction mined (latencies: request → SUBMITTED).
    #[value(alias = "mined")]
    Submitted,
    /// Then every one CONFIRMED, `TXFLOW_CONFIRMATIONS_REQUIRED` blocks deep (adds `confirmed`
    /// and the request → CONFIRMED latencies).
    Confirmed,
}

impl Until {
    fn as_str(self) -> &'static str {
        match self {
            Until::Submitted => "submitted",
            Until::Confirmed => "confirmed",
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Pipeline,
    BrokerHop,
    /// A no-op stage on the stage runtime: leases, batch transaction, commit, produce, offsets.
    Stage,
    /// Signed transactions straight to the chain's RPC endpoint, no txflow in between.
    Anvil,
    /// One hot signer: `--txs` requests through the allocator's handler and PostgreSQL (no
    /// Kafka, a stub node) in batches of `--batch-max`; nonces per second, checked gap-free.
    Allocate,
}

/// Messages per second of `broker-hop` and the stage bench's latency phase when `--rate` is not
/// given.
const DEFAULT_MESSAGE_RATE: u32 = 2_000;

pub async fn run(config: &Config, args: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.compare || args.scenario == Scenario::Pipeline,
        "--compare puts the pipeline next to the chain alone: use it with --scenario pipeline \
         (the default)"
    );
    match args.scenario {
        Scenario::Pipeline if args.compare => compare(config, &args).await,
        Scenario::Pipeline => pipeline(config, &args).await,
        Scenario::BrokerHop => broker_hop(config, &args).await,
        Scenario::Anvil => anvil_raw(config, &args).await,
        Scenario::Allocate => {
            crate::bench_alloc::run(config, args.txs, args.batch_max, args.rate, args.json).await
        }
        Scenario::Stage => {
            crate::bench_stage::run(
                config,
                args.messages,
                args.signers,
                args.batch_max,
                args.rate.unwrap_or(DEFAULT_MESSAGE_RATE),
                args.json,
            )
            .await
        }
    }
}

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

async fn broker_hop(config: &Config, args: &BenchArgs) -> anyhow::Result<()> {
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("{}.bench.hop.{run_id}", config.topics.prefix);
    ensure_topics(&config.kafka, std::slice::from_ref(&topic), 1).await?;

    let consumer: StreamConsumer = config
        .kafka
        .consumer_config(&format!("bench-{run_id}"))
        .create()?;
    consumer.subscribe(&[&topic])?;
    // Wait for the group to hand us the partition before producing, so that join time is not
    // counted as latency.
    let joined_by = Instant::now() + Duration::from_secs(60);
    while consumer.assignment()?.count() == 0 {
        anyhow::ensure!(
            Instant::now() < joined_by,
            "the consumer was not assigned {topic} within 60 s"
        );
        let _ = tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await;
    }

    let producer: FutureProducer = config.kafka.producer_config().create()?;
    // Warm up: the first send waits for the idempotent producer id and the topic's metadata
    // (about a second); that is start-up, not per-hop latency. Send one message and consume it.
    producer
        .send(
            FutureRecord::to(&topic)
                .key("warm-up")
                .payload(&[0u8; 8][..]),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)?;
    tokio::time::timeout(Duration::from_secs(60), consumer.recv()).await??;
    let total = args.messages as usize;
    let size = args.size.max(8);
    let rate = args.rate.unwrap_or(DEFAULT_MESSAGE_RATE);
    let sender = {
        let topic = topic.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let mut deliveries = Vec::with_capacity(total);
            for i in 0..total {
                if rate > 0 {
                    let due = started + Duration::from_secs_f64(i as f64 / rate as f64);
                    tokio::time::sleep_until(due.into()).await;
                }
                let mut payload = vec![0u8; size];
                payload[..8].copy_from_slice(&now_micros().to_be_bytes());
                let key = format!("k{}", i % 64);
                let producer = producer.clone();
                let topic = topic.clone();
                deliveries.push(tokio::spawn(async move {
                    producer
                        .send(
                            FutureRecord::to(&topic).key(&key).payload(&payload),
                            Duration::from_secs(30),
                        )
                        .await
                        .map(|_| ())
                        .map_err(|(e, _)| e)
                }));
            }
            for d in deliveries {
                d.await??;
            }
            anyhow::Ok(started.elapsed())
        })
    };

    let started = Instant::now();
    let mut latencies = Vec::with_capacity(total);
    let deadline = Instant::now() + Duration::from_secs(120 + u64::from(args.messages) / 1000);
    while latencies.len() < total {
        let remaining = deadline.saturating_duration_since(Instant::now());
        anyhow::ensure!(
            !remaining.is_zero(),
            "received {} of {total} messages before the deadline",
            latencies.len()
        );
        if let Ok(msg) = tokio::time::timeout(remaining, consumer.recv()).await {
            let msg = msg?;
            if let Some(p) = msg.payload().filter(|p| p.len() >= 8) {
                let mut ts = [0u8; 8];
                ts.copy_from_slice(&p[..8]);
                latencies.push(now_micros().saturating_sub(u64::from_be_bytes(ts)));
            }
        }
    }
    let consumed_in = started.elapsed();
    let produced_in = sender.await??;
    // Leave the group before deleting the topic: librdkafka 2.12 crashes (SIGSEGV) when tansu
    // answers a fetch for a deleted topic (see ARCHITECTURE.md, "The broker").
    drop(consumer);
    delete_topics(&config.kafka, std::slice::from_ref(&topic)).await?;

    latencies.sort_unstable();
    let pct =
        |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize] as f64 / 1000.0;
    let (p50, p95, p99, max) = (pct(0.50), pct(0.95), pct(0.99), pct(1.0));
    let produce_rate = total as f64 / produced_in.as_secs_f64();
    let consume_rate = total as f64 / consumed_in.as_secs_f64();
    println!(
        "broker hop: {total} messages of {size} B at {} msg/s target\n  produced at {produce_rate:.0} msg/s, consumed at {consume_rate:.0} msg/s\n  latency produce→consume: p50 {p50:.1} ms, p95 {p95:.1} ms, p99 {p99:.1} ms, max {max:.1} ms\n  settings: fetch.wait.max.ms={} linger.ms={}",
        if rate == 0 {
            "unlimited".to_string()
        } else {
            rate.to_string()
        },
        config.kafka.fetch_wait_max_ms,
        config.kafka.linger_ms,
    );
    if args.json {
        let report = serde_json::json!({
            "scenario": "broker-hop",
            "messages": total,
            "size": size,
            "target_rate": rate,
            "produce_per_s": produce_rate.round(),
            "consume_per_s": consume_rate.round(),
            "p50_ms": p50,
            "p95_ms": p95,
            "p99_ms": p99,
            "max_ms": max,
        });
        println!("{report}");
    }
    Ok(())
}

/// N signers × M requests through the pipeline's stages, each request with a unique marker in its
/// calldata, until every one is mined — and with `--until confirmed` CONFIRMED — or the deadline
/// passes.
async fn pipeline(config: &Config, args: &BenchArgs) -> anyhow::Result<()> {
    let run = run_pipeline(config, args).await?;
    run.print();
    if args.json {
        println!("{}", run.json());
    }
    run.check()
}

/// `--compare`: the chain alone (as `--scenario anvil`, with fresh signers), then the pipeline with
/// as many signers and requests, against the same node. One after the other, so that neither
/// takes the machine from the other; both are reported, with their ratio.
async fn compare(config: &Config, args: &BenchArgs) -> anyhow::Result<()> {
    eprintln!("bench compare 1/2: the chain alone");
    let chain = run_anvil(config, args).await?;
    chain.print();
    // A ceiling with refused or unmined transactions is no ceiling: nothing to compare with.
    chain.check()?;
    eprintln!("bench compare 2/2: the pipeline");
    let pipeline = run_pipeline(config, args).await?;
    pipeline.print();
    println!(
        "pipeline / chain alone  {:.2}  ({:.0} / {:.0} tx/s)",
        ratio(pipeline.tx_per_s(), chain.tx_per_s()),
        pipeline.tx_per_s(),
        chain.tx_per_s()
    );
    let budget = budget_ms_per_tx(pipeline.cpu.cores, chain.tx_per_s());
    println!(
        "CPU per request for a ratio of {RATIO_GOAL}: {budget:.2} ms of the machine's {} cores; \
         the pipeline used {:.2} ms, the node alone {:.2} ms of it",
        pipeline.cpu.cores,
        per_tx(pipeline.cpu.machine, pipeline.mined),
        per_tx(pipeline.cpu.of("anvil"), pipeline.mined),
    );
    if args.json {
        println!("{}", compare_report(pipeline.json(), &chain.json()));
    }
    pipeline.check()
}

/// The pipeline's throughput over the chain's own; NaN (`null` in JSON) without a ceiling.
fn ratio(pipeline_tx_per_s: f64, chain_tx_per_s: f64) -> f64 {
    if chain_tx_per_s > 0.0 && chain_tx_per_s.is_finite() {
        pipeline_tx_per_s / chain_tx_per_s
    } else {
        f64::NAN
    }
}

/// The ratio issue 15 asks of the pipeline: half of the chain's own throughput.
const RATIO_GOAL: f64 = 0.5;

/// The machine CPU one request may cost for the pipeline to reach [`RATIO_GOAL`] of a chain that
/// takes `chain_tx_per_s` alone, with every one of `cores` busy: everything the pipeline runs on
/// this machine (the node, PostgreSQL, the broker, txflow) within that many milliseconds per
/// request. NaN (`null`) without a ceiling or a core count.
fn budget_ms_per_tx(cores: usize, chain_tx_per_s: f64) -> f64 {
    if cores > 0 && chain_tx_per_s > 0.0 && chain_tx_per_s.is_finite() {
        cores as f64 * 1000.0 / (RATIO_GOAL * chain_tx_per_s)
    } else {
        f64::NAN
    }
}

/// CPU milliseconds per transaction ([`bench_cpu::ms_per_tx`]); NaN when unknown, for printing.
fn per_tx(seconds: Option<f64>, txs: usize) -> f64 {
    bench_cpu::ms_per_tx(seconds, txs).unwrap_or(f64::NAN)
}

/// `--compare`'s JSON line: the pipeline's report with the chain-alone phase's figures beside it
/// (`anvil_*`), `ratio` = `tx_per_s` / `anvil_tx_per_s`, and `budget_ms_per_tx`: the machine
/// CPU per request at which the pipeline could reach [`RATIO_GOAL`] ([`budget_ms_per_tx`]), to
/// read beside its `cpu_ms_per_tx`.
fn compare_report(pipeline: serde_json::Value, chain: &serde_json::Value) -> serde_json::Value {
    let mut report = pipeline;
    let ratio = ratio(
        report["tx_per_s"].as_f64().unwrap_or(f64::NAN),
        chain["tx_per_s"].as_f64().unwrap_or(f64::NAN),
    );
    if let Some(fields) = report.as_object_mut() {
        fields.insert("scenario".into(), "compare".into());
        for (ours, theirs) in [
            ("anvil_tx_per_s", "tx_per_s"),
            ("anvil_send_per_s", "send_per_s"),
            ("anvil_seconds", "seconds"),
            ("anvil_refused", "refused"),
            ("anvil_mined", "mined"),
            ("anvil_cpu_s", "cpu_s"),
            ("anvil_cpu_ms_per_tx", "cpu_ms_per_tx"),
        ] {
            fields.insert(ours.into(), chain[theirs].clone());
        }
        fields.insert("ratio".into(), ratio.into());
        let cores = fields
            .get("cores")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        let budget = budget_ms_per_tx(
            usize::try_from(cores).unwrap_or(0),
            chain["tx_per_s"].as_f64().unwrap_or(f64::NAN),
        );
        fields.insert("budget_ms_per_tx".into(), budget.into());
    }
    report
}

/// What one run of the pipeline measured (`--scenario pipeline`, the second phase of `--compare`).
struct PipelineRun {
    until: Until,
    signers: usize,
    txs: usize,
    /// Distinct requests mined (a request mined twice counts once, and once in `duplicates`).
    mined: usize,
    duplicates: usize,
    unmined: usize,
    nonce_gaps: u64,
    /// Requests signed more than once (more than one attempt recorded): a gas bump replaced the
    /// transaction, or it was signed again for a new nonce. A run with one waited for that (a
    /// gas bump comes after a minute by default), so its `tx_per_s` is not the pipeline's
    /// throughput (docs/performance.md: a transaction anvil left in its pool).
    resigned: u64,
    /// First send → last request mined.
    elapsed: Duration,
    /// Request → SUBMITTED, ms, sorted.
    latencies: Vec<f64>,
    /// The same time step by step ([`STEPS`]), ms, each sorted.
    steps: Vec<Vec<f64>>,
    /// The open loop's schedule as kept (`--rate`).
    offered: Option<Offered>,
    /// Over `elapsed`.
    cpu: CpuUse,
    /// What PostgreSQL recorded for the measured requests when the run ended.
    writes: Writes,
    /// `--until confirmed`.
    confirmed: Option<ConfirmedRun>,
    /// Topics on the broker before the run created its own (`None`: could not be read).
    broker_topics: Option<usize>,
    /// JSON-RPC calls txflow made over `elapsed`, by method (every attempt on every endpoint:
    /// `rpc_calls_total`).
    rpc_calls: BTreeMap<String, f64>,
    head: u64,
    confirmations_required: u32,
    deadline: Duration,
}

/// The measured requests' recorded moves (`tx_events` rows: one per state change or
/// announcement) and the write transactions they were recorded in (distinct `created_at`: each is
/// its transaction's start), read when the run ended (the receipt checker and the confirmation
/// manager may still be at work on them). Transactions per request is what a stage's work per
/// signer and batch costs: fewer requests per signer and batch, more of them.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Writes {
    rows: u64,
    transactions: u64,
}

impl Writes {
    fn per_request(n: u64, requests: usize) -> f64 {
        if requests == 0 {
            f64::NAN
        } else {
            n as f64 / requests as f64
        }
    }
}

struct ConfirmedRun {
    confirmed: u64,
    /// First send → last request CONFIRMED.
    elapsed: Duration,
    /// Request → CONFIRMED, ms, sorted.
    latencies: Vec<f64>,
    blocks_mined: u64,
}

impl PipelineRun {
    fn requests(&self) -> usize {
        self.signers * self.txs
    }

    fn tx_per_s(&self) -> f64 {
        self.mined as f64 / self.elapsed.as_secs_f64()
    }

    fn print(&self) {
        let lat = &self.latencies;
        println!("requests   {}", self.requests());
        println!(
            "mined      {} (duplicates {}, unmined {})",
            self.mined, self.duplicates, self.unmined
        );
        println!("nonce gaps {}", self.nonce_gaps);
        let n = self.requests().max(1) as f64;
        println!(
            "rpc calls  {:.2} per request ({})",
            self.rpc_calls.values().sum::<f64>() / n,
            self.rpc_calls
                .iter()
                .map(|(m, c)| format!("{m} {:.2}", c / n))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if self.resigned > 0 {
            println!(
                "re-signed  {} (a gas bump or a new nonce: the time below includes that wait)",
                self.resigned
            );
        }
        println!(
            "time       {:.1} s  ({:.0} tx/s)",
            self.elapsed.as_secs_f64(),
            self.tx_per_s()
        );
        if let Some(o) = &self.offered {
            println!(
                "offered    {} at {}/s: {:.1}/s achieved (last sent {:.2} s after the start, at \
                 most {:.0} ms behind its schedule)",
                o.requests,
                o.rate,
                o.per_s(),
                o.last_sent.as_secs_f64(),
                o.max_lag.as_secs_f64() * 1000.0
            );
        }
        println!(
            "request -> SUBMITTED  p50 {:.0} ms  p95 {:.0} ms  p99 {:.0} ms",
            percentile(lat, 0.5),
            percentile(lat, 0.95),
            percentile(lat, 0.99)
        );
        for ((name, _), lat) in STEPS.iter().zip(&self.steps) {
            println!(
                "  {name:<22} p50 {:.0} ms  p99 {:.0} ms",
                percentile(lat, 0.5),
                percentile(lat, 0.99)
            );
        }
        println!("{}", self.cpu.line());
        println!(
            "per request: {:.2} ms of the machine's CPU (txflow {:.2}, broker {:.2}, node {:.2}, \
             the database's backends {:.2}), {:.0} tx/s at that cost with every core busy; {:.1} moves recorded \
             in {:.2} write transactions",
            per_tx(self.cpu.machine, self.mined),
            per_tx(self.cpu.of("txflow"), self.mined),
            per_tx(self.cpu.of("broker"), self.mined),
            per_tx(self.cpu.of("anvil"), self.mined),
            per_tx(self.cpu.of("postgres_db"), self.mined),
            self.cpu.capacity_per_s(self.mined),
            Writes::per_request(self.writes.rows, self.requests()),
            Writes::per_request(self.writes.transactions, self.requests()),
        );
        match self.broker_topics {
            Some(n) if n > MANY_TOPICS => println!(
                "broker     {n} topics before the run: warning, a broker holding many topics left by \
                 earlier runs costs more per request (docs/performance.md); measure on a fresh one"
            ),
            Some(n) => println!("broker     {n} topics before the run"),
            None => println!("broker     topic count not read"),
        }
        if let Some(c) = &self.confirmed {
            println!(
                "confirmed  {} in {:.1} s ({} confirmations each; {} block(s) mined by the bench)",
                c.confirmed,
                c.elapsed.as_secs_f64(),
                self.confirmations_required,
                c.blocks_mined
            );
            println!(
                "request -> CONFIRMED  p50 {:.0} ms  p95 {:.0} ms  p99 {:.0} ms",
                percentile(&c.latencies, 0.5),
                percentile(&c.latencies, 0.95),
                percentile(&c.latencies, 0.99)
            );
        }
    }

    fn json(&self) -> serde_json::Value {
        let lat = &self.latencies;
        let mut report = serde_json::json!({
            "scenario": "pipeline",
            "until": self.until.as_str(),
            "signers": self.signers,
            "txs_per_signer": self.txs,
            "requests": self.requests(),
            "mined": self.mined,
            "duplicates": self.duplicates,
            "unmined": self.unmined,
            "nonce_gaps": self.nonce_gaps,
            "resigned": self.resigned,
            "seconds": self.elapsed.as_secs_f64(),
            "tx_per_s": self.tx_per_s(),
            "p50_ms": percentile(lat, 0.5),
            "p95_ms": percentile(lat, 0.95),
            "p99_ms": percentile(lat, 0.99),
            "cpu_s": self.cpu.json(),
            "cores": self.cpu.cores,
            "cpu_ms_per_tx": self.cpu.ms_per_tx(self.mined),
            "capacity_tx_per_s": self.cpu.capacity_per_s(self.mined),
            "moves_per_request": Writes::per_request(self.writes.rows, self.requests()),
            "write_transactions_per_request":
                Writes::per_request(self.writes.transactions, self.requests()),
            "broker_topics": self.broker_topics,
        });
        let Some(fields) = report.as_object_mut() else {
            return report;
        };
        let n = self.requests().max(1) as f64;
        let rpc: serde_json::Map<String, serde_json::Value> = self
            .rpc_calls
            .iter()
            .map(|(method, calls)| (method.clone(), (calls / n).into()))
            .collect();
        fields.insert("rpc_calls_per_request".into(), rpc.into());
        fields.insert(
            "rpc_calls_per_request_total".into(),
            (self.rpc_calls.values().sum::<f64>() / n).into(),
        );
        let steps: serde_json::Map<String, serde_json::Value> = STEPS
            .iter()
            .zip(&self.steps)
            .map(|((name, _), lat)| {
                let q = serde_json::json!({
                    "p50": percentile(lat, 0.5),
                    "p99": percentile(lat, 0.99),
                });
                ((*name).to_string(), q)
            })
            .collect();
        fields.insert("steps_ms".into(), steps.into());
        if let Some(o) = &self.offered {
            fields.insert("rate".into(), o.rate.into());
            fields.insert("offered_per_s".into(), o.per_s().into());
            fields.insert("send_seconds".into(), o.last_sent.as_secs_f64().into());
            fields.insert(
                "send_lag_max_ms".into(),
                (o.max_lag.as_secs_f64() * 1000.0).into(),
            );
        }
        if let Some(c) = &self.confirmed {
            fields.insert("confirmed".into(), c.confirmed.into());
            fields.insert("confirm_seconds".into(), c.elapsed.as_secs_f64().into());
            fields.insert(
                "confirmations_required".into(),
                self.confirmations_required.into(),
            );
            fields.insert("blocks_mined_by_bench".into(), c.blocks_mined.into());
            for (field, q) in [
                ("p50_confirm_ms", 0.5),
                ("p95_confirm_ms", 0.95),
                ("p99_confirm_ms", 0.99),
            ] {
                fields.insert(field.into(), percentile(&c.latencies, q).into());
            }
        }
        report
    }

    /// Fails on a duplicate, and with `--until confirmed` on a request not CONFIRMED in time.
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.duplicates == 0,
            "{} duplicate transaction(s) were mined",
            self.duplicates
        );
        if let Some(c) = &self.confirmed
            && c.confirmed < self.requests() as u64
        {
            anyhow::bail!(
                "{}",
                not_confirmed(
                    "request",
                    self.requests() as u64 - c.confirmed,
                    self.deadline,
                    self.head,
                    self.confirmations_required,
                    c.blocks_mined
                )
            );
        }
        Ok(())
    }
}

async fn run_pipeline(config: &Config, args: &BenchArgs) -> anyhow::Result<PipelineRun> {
    use alloy::providers::Provider;
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let mut config = config.clone();
    config.topics =
        txflow_core::kafka::Topics::new(format!("{}.bench-{run}", config.topics.prefix));
    let (signers, txs) = (args.signers.max(1) as usize, args.txs.max(1) as usize);
    let total = signers * txs;
    let until = args.until;
    let rate = args.rate.filter(|r| *r > 0);
    eprintln!(
        "bench: {signers} signer(s) x {txs} request(s) = {total} until {}, {}, topics {}.*",
        until.as_str(),
        rate.map_or("all sent at once".to_string(), |r| format!(
            "offered at {r}/s"
        )),
        config.topics.prefix
    );
    let broker_topics = match topic_count(&config.kafka).await {
        Ok(n) => Some(n),
        Err(e) => {
            eprintln!("bench: could not count the broker's topics: {e}");
            None
        }
    };
    // The roles' metrics, in this process: the bench reads its RPC calls from them (a production
    // process records them too, so its CPU includes that).
    if !txflow_core::metrics::enabled()
        && let Err(e) = txflow_core::metrics::init(&txflow_core::metrics::Setup {
            default_service_name: "txflow-bench".into(),
            ..Default::default()
        })
    {
        eprintln!("bench: metrics not installed, RPC calls not counted: {e}");
    }
    let p = LocalPipeline::start(config.clone(), signers).await?;
    let pool = txflow_core::db::connect(&config.database_url, 2).await?;
    // CONFIRMED as a downstream team books it: txflow-client's OutcomeReader on tx.outcomes.
    let mut reader = match until {
        Until::Confirmed => Some(
            txflow_client::OutcomeReader::open(
                &crate::local::client_settings(&config),
                txflow_client::ReadOptions {
                    confirmations: false,
                },
            )
            .await?,
        ),
        Until::Submitted => None,
    };

    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} mined {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Warm up: one request per signer, mined (and confirmed, when that is measured), so that
    // group joins and first metadata lookups are not measured.
    bar.set_message("(warming up: one request per signer)");
    let warmups: Vec<_> = (0..signers)
        .map(|i| p.request(i, &format!("{run}-warmup-{i}"), crate::local::SINK, "1"))
        .collect();
    for r in futures::future::join_all(warmups.iter().map(|r| p.send(r))).await {
        r?;
    }
    let warm_for = Duration::from_secs(args.deadline_secs.min(120));
    let warm_deadline = Instant::now() + warm_for;
    while p.mined().await? < signers as u64 {
        anyhow::ensure!(
            Instant::now() < warm_deadline,
            "the warm-up requests were not mined within {} s",
            warm_for.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut blocks = BlockNudge::new();
    if let Some(reader) = &mut reader {
        let want = signers as u64;
        let confirmed = wait_confirmed(
            &p,
            reader,
            (&run, Phase::Warmup, want),
            warm_deadline,
            &mut blocks,
            None,
        )
        .await?;
        if confirmed < want {
            anyhow::bail!(
                "{}",
                not_confirmed(
                    "warm-up request",
                    want - confirmed,
                    warm_for,
                    p.provider.get_block_number().await?,
                    config.confirmations_required,
                    blocks.mined
                )
            );
        }
    }
    let requests: Vec<_> = (0..txs)
        .flat_map(|j| (0..signers).map(move |i| (i, j)))
        .map(|(i, j)| p.request(i, &format!("{run}-{i}-{j}"), crate::local::SINK, "1"))
        .collect();
    let probe = CpuProbe::new(
        config.rpc_urls.first().map_or("", String::as_str),
        &config.kafka.brokers,
        &config.database_url,
    );
    let cpu_start = probe.sample();
    let rpc_start = rpc_sample();
    let started = Instant::now();
    let sent = send_requests(&p, &requests, rate, started).await?;
    bar.set_message(format!(
        "(all {total} sent in {:.1} s)",
        started.elapsed().as_secs_f64()
    ));
    let deadline = started + Duration::from_secs(args.deadline_secs);
    // Each signer's warm-up request holds its nonce 0: the run's take nonces 1..=txs.
    let addresses: Vec<_> = p.signers.iter().map(|s| s.address()).collect();
    wait_mined(
        &p.provider,
        &addresses,
        (1, 1 + txs as u64),
        deadline,
        Some(&bar),
    )
    .await?;
    let elapsed = started.elapsed();
    let cpu = cpu_start.until(&probe.sample());
    let rpc_calls = rpc_delta(&rpc_start, &rpc_sample());
    bar.finish();

    // Finality: after the last transaction the chain must go on making blocks for the
    // confirmation manager to count (see `BlockNudge`).
    let mut confirmed = None;
    if let Some(reader) = &mut reader {
        let bar = indicatif::ProgressBar::new(total as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} confirmed {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(format!(
            "({} confirmations each)",
            config.confirmations_required
        ));
        let n = wait_confirmed(
            &p,
            reader,
            (&run, Phase::Measured, total as u64),
            deadline,
            &mut blocks,
            Some(&bar),
        )
        .await?;
        bar.finish();
        confirmed = Some((n, started.elapsed()));
    }

    let view = p.chain_view().await?;
    let markers = view.markers();
    let warmup = format!("txflow:{run}-warmup-");
    let ours: Vec<(&String, &usize)> = markers
        .iter()
        .filter(|(m, _)| m.starts_with(&format!("txflow:{run}-")) && !m.starts_with(&warmup))
        .collect();
    let distinct = ours.len();
    let duplicates: usize = ours.iter().map(|(_, c)| **c - 1).sum();
    let unmined = total - distinct.min(total);
    // Every nonce a signer used must carry one of the run's requests (warm-ups included).
    let run_marker = crate::local::marker(&format!("{run}-"));
    let nonce_gaps: u64 = view
        .next_nonces
        .iter()
        .enumerate()
        .map(|(i, next)| {
            nonce_gaps(
                *next,
                view.txs
                    .iter()
                    .filter(|t| t.signer == i && t.input.starts_with(&run_marker))
                    .map(|t| t.nonce),
            )
        })
        .sum();
    let mut marks = Vec::with_capacity(STEPS.len());
    for (_, event_type) in STEPS {
        marks.push(event_times(&pool, &run, event_type).await?);
    }
    let steps = step_latencies(&sent.at, &marks);
    let submitted = marks.pop().unwrap_or_default();
    let resigned = resigned(&pool, &run).await?;
    let writes = writes(&pool, &run).await?;
    let confirmed = match confirmed {
        Some((n, in_time)) => Some(ConfirmedRun {
            confirmed: n,
            elapsed: in_time,
            latencies: latencies(&event_times(&pool, &run, "TxConfirmed").await?, &sent.at),
            blocks_mined: blocks.mined,
        }),
        None => None,
    };
    let head = p.provider.get_block_number().await?;
    p.stop().await?;
    // The reader's consumer goes before its topics do (librdkafka #5280).
    drop(reader);
    delete_topics(&config.kafka, &config.topics.all()).await?;
    Ok(PipelineRun {
        until,
        signers,
        txs,
        mined: distinct,
        duplicates,
        unmined,
        nonce_gaps,
        resigned,
        elapsed,
        latencies: latencies(&submitted, &sent.at),
        steps,
        offered: sent.offered,
        cpu,
        writes,
        confirmed,
        broker_topics,
        rpc_calls,
        head,
        confirmations_required: config.confirmations_required,
        deadline: Duration::from_secs(args.deadline_secs),
    })
}

/// `rpc_calls_total` of this process by method (every endpoint and result), from the Prometheus
/// exposition; empty without metrics.
fn rpc_sample() -> BTreeMap<String, f64> {
    match txflow_core::metrics::encode_text() {
        Some(Ok(text)) => rpc_calls(&text),
        _ => BTreeMap::new(),
    }
}

/// The `rpc_calls_total` samples of an exposition, summed by `method`.
fn rpc_calls(text: &str) -> BTreeMap<String, f64> {
    let mut by_method = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("rpc_calls_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let method = labels
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix("method=\""))
            .and_then(|m| m.strip_suffix('"'));
        let value = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok());
        if let (Some(method), Some(value)) = (method, value) {
            *by_method.entry(method.to_string()).or_default() += value;
        }
    }
    by_method
}

/// The calls made between two samples, by method (methods with none left out).
fn rpc_delta(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(m, a)| (m.clone(), a - before.get(m).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .collect()
}

/// How many topics the broker holds (its metadata for all topics).
async fn topic_count(settings: &txflow_core::kafka::KafkaSettings) -> anyhow::Result<usize> {
    let config = settings.assign_config();
    tokio::task::spawn_blocking(move || -> anyhow::Result<usize> {
        let probe: rdkafka::consumer::BaseConsumer = config.create()?;
        let md =
            rdkafka::consumer::Consumer::fetch_metadata(&probe, None, Duration::from_secs(10))?;
        Ok(md.topics().len())
    })
    .await?
}

/// More topics than this on the broker before a run, and the bench warns: tansu's cost per
/// request grows with the topics and groups earlier runs left (docs/performance.md).
const MANY_TOPICS: usize = 200;

/// How the measured requests went out.
struct Sent {
    /// Each request's send time, ms since the epoch, by request id: when its chunk went out, or in
    /// the open loop its scheduled time — so that a request the generator or the producer held
    /// up counts that wait as latency rather than hiding it (coordinated omission).
    at: std::collections::HashMap<String, i64>,
    offered: Option<Offered>,
}

/// The open loop's schedule as it was kept.
struct Offered {
    /// Requests per second asked for.
    rate: u32,
    requests: usize,
    /// From the start of the schedule to the last request's send.
    last_sent: Duration,
    /// The latest any request was sent after its scheduled time.
    max_lag: Duration,
}

impl Offered {
    /// Requests sent per second over the schedule: the first is due at 0, so `n` requests span
    /// `n - 1` intervals. Never above `rate` (no request goes before its time); below it when the
    /// generator fell behind. NaN (`null`) for a single request.
    fn per_s(&self) -> f64 {
        offered_per_s(self.requests, self.last_sent)
    }
}

fn offered_per_s(requests: usize, last_sent: Duration) -> f64 {
    if requests < 2 || last_sent.is_zero() {
        return f64::NAN;
    }
    (requests - 1) as f64 / last_sent.as_secs_f64()
}

/// Hands `requests` to the broker. Without a rate: all at once, 200 acknowledgements awaited at a
/// time (a closed loop: the burst's queueing is part of every latency). With one: request `k` at
/// `started + k / rate`, each from a task of its own so that nothing earlier holds it up (an open
/// loop). Returns once every request is acknowledged.
async fn send_requests(
    p: &LocalPipeline,
    requests: &[txflow_core::events::TxRequest],
    rate: Option<u32>,
    started: Instant,
) -> anyhow::Result<Sent> {
    let mut at = std::collections::HashMap::with_capacity(requests.len());
    let Some(rate) = rate else {
        for chunk in requests.chunks(200) {
            let now = chrono::Utc::now().timestamp_millis();
            for r in chunk {
                at.insert(r.request_id.clone(), now);
            }
            for r in futures::future::join_all(chunk.iter().map(|r| p.send(r))).await {
                r?;
            }
        }
        return Ok(Sent { at, offered: None });
    };
    let epoch_ms = chrono::Utc::now().timestamp_millis();
    let sender = p.sender();
    let mut acks = Vec::with_capacity(requests.len());
    let (mut last_sent, mut max_lag) = (Duration::ZERO, Duration::ZERO);
    for (k, r) in requests.iter().enumerate() {
        let due = Duration::from_secs_f64(k as f64 / f64::from(rate));
        tokio::time::sleep_until((started + due).into()).await;
        at.insert(r.request_id.clone(), epoch_ms + due.as_millis() as i64);
        let (sender, r) = (sender.clone(), r.clone());
        acks.push(tokio::spawn(async move { sender.send(&r).await }));
        last_sent = started.elapsed();
        max_lag = max_lag.max(last_sent.saturating_sub(due));
    }
    for ack in acks {
        ack.await??;
    }
    Ok(Sent {
        at,
        offered: Some(Offered {
            rate,
            requests: requests.len(),
            last_sent,
            max_lag,
        }),
    })
}

/// Waits until each of `signers` has a transaction count of `to` (its phase's transactions all
/// mined, above the `from` it started with) or `deadline` passes; returns how many of the phase's
/// transactions are mined. Counts are read only when the head has moved and only for signers not
/// done yet: at 200 signers a poll of all of them every 50 ms would be thousands of calls a second
/// on the node being measured.
async fn wait_mined(
    provider: &alloy::providers::DynProvider,
    signers: &[alloy::primitives::Address],
    (from, to): (u64, u64),
    deadline: Instant,
    bar: Option<&indicatif::ProgressBar>,
) -> anyhow::Result<u64> {
    use alloy::providers::Provider;
    use futures::StreamExt;
    let mut counts = vec![from; signers.len()];
    let mut head = None;
    loop {
        let now = provider.get_block_number().await?;
        if head != Some(now) {
            head = Some(now);
            let behind: Vec<usize> = (0..signers.len()).filter(|i| counts[*i] < to).collect();
            let read: Vec<_> = futures::stream::iter(behind)
                .map(|i| async move {
                    let n = provider.get_transaction_count(signers[i]).latest().await;
                    (i, n)
                })
                .buffer_unordered(16)
                .collect()
                .await;
            for (i, n) in read {
                counts[i] = counts[i].max(n?.min(to));
            }
        }
        let mined: u64 = counts.iter().map(|c| c - from).sum();
        if let Some(bar) = bar {
            bar.set_position(mined);
        }
        if counts.iter().all(|c| *c >= to) || Instant::now() >= deadline {
            return Ok(mined);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Which of the run's requests a query counts: the warm-up ones or the measured ones.
#[derive(Clone, Copy)]
enum Phase {
    Warmup,
    Measured,
}

impl Phase {
    /// `request_id` is one of this phase's requests of `run`.
    fn matches(self, run: &str, request_id: &str) -> bool {
        let warmup = request_id.starts_with(&format!("{run}-warmup-"));
        match self {
            Phase::Warmup => warmup,
            Phase::Measured => request_id.starts_with(&format!("{run}-")) && !warmup,
        }
    }

    /// The phase's request ids are `LIKE` the first pattern and `NOT LIKE` the second.
    fn patterns(self, run: &str) -> (String, &'static str) {
        match self {
            Phase::Warmup => (format!("{run}-warmup-%"), ""),
            Phase::Measured => (format!("{run}-%"), "%-warmup-%"),
        }
    }
}

/// When each measured request of the run first had an event of `event_type` recorded (ms since
/// the epoch), by request id.
async fn event_times(
    pool: &sqlx::PgPool,
    run: &str,
    event_type: &str,
) -> anyhow::Result<Vec<(String, i64)>> {
    let (like, not_like) = Phase::Measured.patterns(run);
    Ok(sqlx::query_as(
        "SELECT m.request_id, (extract(epoch FROM min(e.created_at)) * 1000)::bigint
         FROM managed_tx m JOIN tx_events e ON e.tx_id = m.tx_id AND e.type = $3
         WHERE m.request_id LIKE $1 AND m.request_id NOT LIKE $2
         GROUP BY m.request_id",
    )
    .bind(like)
    .bind(not_like)
    .bind(event_type)
    .fetch_all(pool)
    .await?)
}

/// How many of the run's measured requests have more than one attempt recorded: signed again
/// for a gas bump or a new nonce.
async fn resigned(pool: &sqlx::PgPool, run: &str) -> anyhow::Result<u64> {
    let (like, not_like) = Phase::Measured.patterns(run);
    let n: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT m.tx_id)
         FROM managed_tx m JOIN tx_attempts a ON a.tx_id = m.tx_id AND a.attempt > 1
         WHERE m.request_id LIKE $1 AND m.request_id NOT LIKE $2",
    )
    .bind(like)
    .bind(not_like)
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// The measured requests' [`Writes`].
async fn writes(pool: &sqlx::PgPool, run: &str) -> anyhow::Result<Writes> {
    let (like, not_like) = Phase::Measured.patterns(run);
    let (rows, transactions): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT e.created_at)
         FROM managed_tx m JOIN tx_events e ON e.tx_id = m.tx_id
         WHERE m.request_id LIKE $1 AND m.request_id NOT LIKE $2",
    )
    .bind(like)
    .bind(not_like)
    .fetch_one(pool)
    .await?;
    Ok(Writes {
        rows: u64::try_from(rows).unwrap_or(0),
        transactions: u64::try_from(transactions).unwrap_or(0),
    })
}

/// A request's way to SUBMITTED, step by step: each step's name (a `steps_ms` field) and the
/// event that ends it, the previous step's event (the request's send, for the first) starting
/// it. An event's time is when the transaction that recorded it began (`tx_events.created_at`):
/// a step is the wait for the stage (the broker hop, the batch, the drive before its write) plus
/// the previous stage's transaction after that event. The last event is the one `p50_ms` …
/// `p99_ms` measure to.
const STEPS: [(&str, &str); 4] = [
    ("request_to_accepted", "TxAccepted"),
    ("accepted_to_allocated", "TxAllocated"),
    ("allocated_to_signed", "TxSigned"),
    ("signed_to_submitted", "TxSubmitted"),
];

/// For each step, the milliseconds between consecutive marks (`marks[k]` the time of step `k`'s
/// event per request; the request's send before the first), sorted; only requests with every
/// mark count, so that each step's percentiles are over the same requests.
fn step_latencies(
    sent_at: &std::collections::HashMap<String, i64>,
    marks: &[Vec<(String, i64)>],
) -> Vec<Vec<f64>> {
    let by_request: Vec<std::collections::HashMap<&str, i64>> = marks
        .iter()
        .map(|m| m.iter().map(|(r, t)| (r.as_str(), *t)).collect())
        .collect();
    let mut steps = vec![Vec::new(); marks.len()];
    for (request, sent) in sent_at {
        let times: Option<Vec<i64>> = by_request
            .iter()
            .map(|m| m.get(request.as_str()).copied())
            .collect();
        let Some(times) = times else { continue };
        let mut from = *sent;
        for (step, at) in steps.iter_mut().zip(times) {
            step.push((at - from) as f64);
            from = at;
        }
    }
    for step in &mut steps {
        step.sort_by(f64::total_cmp);
    }
    steps
}

/// Milliseconds from each request's send to `at`, sorted.
fn latencies(at: &[(String, i64)], sent_at: &std::collections::HashMap<String, i64>) -> Vec<f64> {
    let mut lat: Vec<f64> = at
        .iter()
        .filter_map(|(id, at)| sent_at.get(id).map(|s| (*at - *s).max(0) as f64))
        .collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    lat
}

/// The `q` quantile of `sorted` (nearest rank); NaN (`null` in JSON) when it is empty.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * q).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// Nonces a signer has used on chain (`0..next_nonce`, `next_nonce` being its transaction count)
/// that no transaction in `ours` (the nonces of its mined transactions that carry one of the run's
/// requests) holds. Each is a nonce that something else consumed — a no-op filling a released
/// nonce, a cancellation, another sender with the key — and that a clean run never needs. A nonce
/// of ours at or past `next_nonce` (read at another block) fills nothing below it: ignored.
fn nonce_gaps(next_nonce: u64, ours: impl IntoIterator<Item = u64>) -> u64 {
    let held: std::collections::BTreeSet<u64> =
        ours.into_iter().filter(|n| *n < next_nonce).collect();
    next_nonce - held.len() as u64
}

/// Waits until `want` requests of the run's `phase` are CONFIRMED or `deadline` passes, making
/// blocks come if the chain stops; returns how many are CONFIRMED.
async fn wait_confirmed(
    p: &crate::local::LocalPipeline,
    reader: &mut txflow_client::OutcomeReader,
    (run, phase, want): (&str, Phase, u64),
    deadline: Instant,
    blocks: &mut BlockNudge,
    bar: Option<&indicatif::ProgressBar>,
) -> anyhow::Result<u64> {
    loop {
        reader.poll(Duration::from_millis(100)).await?;
        let confirmed = reader
            .book()
            .views()
            .filter(|v| v.booked.is_some() && phase.matches(run, &v.request_id))
            .count() as u64;
        if let Some(bar) = bar {
            bar.set_position(confirmed);
        }
        if confirmed >= want || Instant::now() >= deadline {
            return Ok(confirmed);
        }
        blocks.tick(&p.provider).await?;
    }
}

/// The error for requests not CONFIRMED by the deadline, with what to look at.
fn not_confirmed(
    what: &str,
    missing: u64,
    waited: Duration,
    head: u64,
    required: u32,
    blocks_mined: u64,
) -> String {
    format!(
        "{missing} {what}(s) not CONFIRMED within {} s (chain head at block {head}, \
         {blocks_mined} block(s) mined by the bench; TXFLOW_CONFIRMATIONS_REQUIRED = {required}); \
         see the receipt checker's and the confirmation manager's logs",
        waited.as_secs(),
    )
}

/// The chain alone: N signers × M transactions like the pipeline's (1 wei to the sink with a
/// marker), signed here and sent with `eth_sendRawTransaction`, each signer's in nonce order,
/// signers concurrently, 200 sends in flight at most; then waits until all are mined.
async fn anvil_raw(config: &Config, args: &BenchArgs) -> anyhow::Result<()> {
    let run = run_anvil(config, args).await?;
    run.print();
    if args.json {
        println!("{}", run.json());
    }
    run.check()
}

/// What one run of the chain alone measured (`--scenario anvil`, the first phase of `--compare`).
struct AnvilRun {
    signers: usize,
    txs: usize,
    /// Sends the node did not accept.
    refused: usize,
    mined: u64,
    /// First send → last send answered.
    sent_in: Duration,
    /// First send → last transaction mined.
    mined_in: Duration,
    /// Over `mined_in`.
    cpu: CpuUse,
}

impl AnvilRun {
    fn requests(&self) -> usize {
        self.signers * self.txs
    }

    fn tx_per_s(&self) -> f64 {
        self.mined as f64 / self.mined_in.as_secs_f64()
    }

    fn send_per_s(&self) -> f64 {
        self.requests() as f64 / self.sent_in.as_secs_f64()
    }

    fn print(&self) {
        println!(
            "raw transactions  {} ({} refused by the node)",
            self.requests(),
            self.refused
        );
        println!(
            "sent in           {:.2} s  ({:.0} tx/s accepted by eth_sendRawTransaction)",
            self.sent_in.as_secs_f64(),
            self.send_per_s()
        );
        println!(
            "mined             {} in {:.2} s  ({:.0} tx/s)",
            self.mined,
            self.mined_in.as_secs_f64(),
            self.tx_per_s()
        );
        println!("{}", self.cpu.line());
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "scenario": "anvil",
            "signers": self.signers,
            "txs_per_signer": self.txs,
            "requests": self.requests(),
            "refused": self.refused,
            "mined": self.mined,
            "send_per_s": self.send_per_s(),
            "tx_per_s": self.tx_per_s(),
            "seconds": self.mined_in.as_secs_f64(),
            "cpu_s": self.cpu.json(),
            "cpu_ms_per_tx": self.cpu.ms_per_tx(usize::try_from(self.mined).unwrap_or(0)),
        })
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.refused == 0,
            "{} transaction(s) were refused",
            self.refused
        );
        anyhow::ensure!(
            self.mined == self.requests() as u64,
            "{} transaction(s) not mined before the deadline",
            self.requests() as u64 - self.mined
        );
        Ok(())
    }
}

async fn run_anvil(config: &Config, args: &BenchArgs) -> anyhow::Result<AnvilRun> {
    use alloy::primitives::{Address, Bytes, U256};
    use alloy::providers::ext::AnvilApi;
    use alloy::providers::{Provider, ProviderBuilder};
    use alloy::signers::local::PrivateKeySigner;
    use futures::StreamExt;
    use txflow_core::chain::{Chain, SendOutcome, UnsignedTx, sign};

    let url = config
        .rpc_urls
        .first()
        .ok_or_else(|| anyhow::anyhow!("TXFLOW_RPC_URLS is empty"))?;
    let chain = Chain::connect(url, config.chain_id as u64)?;
    let provider = ProviderBuilder::new().connect_http(url.parse()?).erased();
    let (signers, txs) = (args.signers.max(1) as usize, args.txs.max(1) as usize);
    let total = signers * txs;
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let keys: Vec<PrivateKeySigner> = (0..signers).map(|_| PrivateKeySigner::random()).collect();
    for k in &keys {
        provider
            .anvil_set_balance(k.address(), U256::from(10u128.pow(22)))
            .await?;
    }
    let (max_fee, tip) = chain.fees().await?;
    let sink: Address = crate::local::SINK.parse()?;
    // Signing is not what is measured: sign everything first.
    let mut per_signer: Vec<Vec<Vec<u8>>> = Vec::with_capacity(signers);
    for (i, k) in keys.iter().enumerate() {
        let mut raws = Vec::with_capacity(txs);
        for j in 0..txs {
            let marker = crate::local::marker(&format!("{run}-{i}-{j}"));
            let signed = sign(
                k,
                &UnsignedTx {
                    chain_id: config.chain_id as u64,
                    nonce: j as u64,
                    to: sink,
                    value: U256::from(1),
                    data: Bytes::from(marker),
                    gas_limit: 40_000,
                    max_fee_per_gas: max_fee * 2,
                    max_priority_fee_per_gas: tip,
                },
            )?;
            raws.push(signed.raw);
        }
        per_signer.push(raws);
    }
    eprintln!("bench anvil: {signers} signer(s) x {txs} raw transaction(s) = {total} to {url}");
    let probe = CpuProbe::new(url, &config.kafka.brokers, &config.database_url);
    let cpu_start = probe.sample();
    let started = Instant::now();
    // Round-robin over signers, in nonce order per signer; at most 200 sends in flight.
    let order: Vec<&Vec<u8>> = (0..txs)
        .flat_map(|j| per_signer.iter().map(move |r| &r[j]))
        .collect();
    let outcomes: Vec<_> = futures::stream::iter(order)
        .map(|raw| chain.send_raw(raw))
        .buffered(200)
        .collect()
        .await;
    let sent_in = started.elapsed();
    let refused = outcomes
        .iter()
        .filter(|o| !matches!(o, Ok(SendOutcome::Accepted)))
        .count();
    let addresses: Vec<Address> = keys.iter().map(|k| k.address()).collect();
    let deadline = started + Duration::from_secs(args.deadline_secs);
    let mined = wait_mined(&provider, &addresses, (0, txs as u64), deadline, None).await?;
    let mined_in = started.elapsed();
    let cpu = cpu_start.until(&probe.sample());
    Ok(AnvilRun {
        signers,
        txs,
        refused,
        mined,
        sent_in,
        mined_in,
        cpu,
    })
}

#[cfg(test)]
mod tests {
    use super::{
        Phase, Writes, budget_ms_per_tx, compare_report, nonce_gaps, offered_per_s, per_tx,
        percentile, ratio, rpc_calls, rpc_delta, step_latencies,
    };
    use std::time::Duration;

    #[test]
    fn the_ratio_is_the_pipeline_over_the_chain_and_null_without_a_ceiling() {
        assert_eq!(ratio(500.0, 2000.0), 0.25);
        assert_eq!(ratio(0.0, 2000.0), 0.0);
        for no_ceiling in [0.0, f64::NAN, f64::INFINITY, -1.0] {
            assert!(ratio(500.0, no_ceiling).is_nan(), "{no_ceiling}");
        }
        assert_eq!(serde_json::json!(ratio(1.0, 0.0)), serde_json::Value::Null);
    }

    #[test]
    fn the_compare_report_is_the_pipelines_with_the_chains_figures_beside_it() {
        let pipeline = serde_json::json!({
            "scenario": "pipeline", "requests": 20, "mined": 20, "duplicates": 0,
            "unmined": 0, "seconds": 0.5, "tx_per_s": 40.0, "p50_ms": 30.0, "p95_ms": 40.0,
            "p99_ms": 41.0, "cpu_s": {"txflow": 1.0, "broker": 0.1, "anvil": 0.2,
            "postgres": 0.3, "machine": 1.8}, "cores": 2,
        });
        let chain = serde_json::json!({
            "scenario": "anvil", "requests": 20, "refused": 0, "mined": 20,
            "send_per_s": 400.0, "tx_per_s": 160.0, "seconds": 0.125,
            "cpu_s": {"txflow": 0.01, "broker": 0.0, "anvil": 0.1, "postgres": 0.0,
            "machine": 0.2}, "cpu_ms_per_tx": {"anvil": 5.0, "machine": 10.0},
        });
        let r = compare_report(pipeline.clone(), &chain);
        assert_eq!(r["scenario"], "compare");
        assert_eq!(r["ratio"], 0.25);
        assert_eq!(r["anvil_tx_per_s"], 160.0);
        assert_eq!(r["anvil_send_per_s"], 400.0);
        assert_eq!(r["anvil_seconds"], 0.125);
        assert_eq!(r["anvil_refused"], 0);
        assert_eq!(r["anvil_mined"], 20);
        assert_eq!(r["anvil_cpu_s"], chain["cpu_s"]);
        assert_eq!(r["anvil_cpu_ms_per_tx"], chain["cpu_ms_per_tx"]);
        // Half of 160 tx/s on two cores: 2,000 ms of CPU a second over 80 requests.
        assert_eq!(r["budget_ms_per_tx"], 25.0);
        // The pipeline's own figures are kept as they were.
        for field in [
            "requests", "mined", "tx_per_s", "p99_ms", "cpu_s", "seconds",
        ] {
            assert_eq!(r[field], pipeline[field], "{field}");
        }
        // A chain phase that mined nothing gives no ratio.
        let none = compare_report(pipeline, &serde_json::json!({"tx_per_s": 0.0}));
        assert_eq!(none["ratio"], serde_json::Value::Null);
        assert_eq!(none["budget_ms_per_tx"], serde_json::Value::Null);
    }

    #[test]
    fn the_budget_is_the_machines_cpu_over_half_the_chains_rate() {
        // 4,000 tx/s alone: half is 2,000 requests a second, for which two cores have 2,000 ms
        // of CPU a second, 1 ms each; one core half of that.
        assert_eq!(budget_ms_per_tx(2, 4000.0), 1.0);
        assert_eq!(budget_ms_per_tx(1, 4000.0), 0.5);
        assert!(budget_ms_per_tx(0, 4000.0).is_nan());
        assert!(budget_ms_per_tx(2, 0.0).is_nan());
        assert!(budget_ms_per_tx(2, f64::INFINITY).is_nan());
        assert_eq!(per_tx(Some(3.0), 1500), 2.0);
        assert!(per_tx(None, 1500).is_nan());
        assert!(per_tx(Some(3.0), 0).is_nan());
        assert_eq!(Writes::per_request(21_000, 2000), 10.5);
        assert!(Writes::per_request(1, 0).is_nan());
    }

    #[test]
    fn the_offered_rate_counts_intervals_between_sends() {
        // 20 requests at 20/s: the last is due 0.95 s after the first.
        assert_eq!(offered_per_s(20, Duration::from_millis(950)), 20.0);
        // The generator fell behind: the last went out at 1.9 s.
        assert_eq!(offered_per_s(20, Duration::from_millis(1900)), 10.0);
        assert!(offered_per_s(1, Duration::ZERO).is_nan());
        assert!(offered_per_s(5, Duration::ZERO).is_nan());
    }

    #[test]
    fn nonce_gaps_count_the_nonces_no_request_of_the_run_holds() {
        let cases: &[(&str, u64, &[u64], u64)] = &[
            ("nothing sent", 0, &[], 0),
            ("every nonce a request", 4, &[0, 1, 2, 3], 0),
            ("in any order", 4, &[3, 0, 2, 1], 0),
            ("a no-op filled nonce 2", 4, &[0, 1, 3], 1),
            ("the highest nonce is not ours", 4, &[0, 1, 2], 1),
            ("nothing of ours mined", 3, &[], 3),
            ("two nonces lost", 6, &[0, 2, 4, 5], 2),
            // A request mined twice is a duplicate, not a filled gap: its nonce counts once.
            ("one nonce seen twice", 3, &[0, 1, 1, 2], 0),
            // Past the chain's count: read at another block; it fills nothing below.
            ("ours past the chain's count", 2, &[0, 1, 2, 3], 0),
            ("ours past the count, a hole below", 3, &[0, 2, 5], 1),
        ];
        for (name, next, ours, want) in cases {
            assert_eq!(
                nonce_gaps(*next, ours.iter().copied()),
                *want,
                "{name}: next nonce {next}, ours {ours:?}"
            );
        }
    }

    #[test]
    fn steps_are_the_times_between_consecutive_events_of_requests_that_have_them_all() {
        let sent: std::collections::HashMap<String, i64> = [
            ("a".to_string(), 1_000),
            ("b".to_string(), 2_000),
            ("c".to_string(), 3_000),
        ]
        .into_iter()
        .collect();
        let mark = |v: &[(&str, i64)]| -> Vec<(String, i64)> {
            v.iter().map(|(r, t)| (r.to_string(), *t)).collect()
        };
        let marks = vec![
            mark(&[("a", 1_010), ("b", 2_030), ("c", 3_005)]),
            // `c` never got further: it counts in no step.
            mark(&[("a", 1_050), ("b", 2_040)]),
        ];
        let steps = step_latencies(&sent, &marks);
        assert_eq!(steps, vec![vec![10.0, 30.0], vec![10.0, 40.0]]);
        assert!(step_latencies(&sent, &[]).is_empty());
    }

    #[test]
    fn rpc_calls_are_summed_by_method_over_endpoints_and_results() {
        let text = "# HELP rpc_calls_total JSON-RPC calls\n\
            # TYPE rpc_calls_total counter\n\
            rpc_calls_total{endpoint=\"0\",method=\"eth_sendRawTransaction\",result=\"ok\",otel_scope_name=\"txflow\"} 10\n\
            rpc_calls_total{endpoint=\"1\",method=\"eth_sendRawTransaction\",result=\"error\",otel_scope_name=\"txflow\"} 2\n\
            rpc_calls_total{endpoint=\"0\",method=\"eth_blockNumber\",result=\"ok\"} 3\n\
            rpc_duration_seconds_count{endpoint=\"0\",method=\"eth_blockNumber\"} 3\n";
        let calls = rpc_calls(text);
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(calls["eth_sendRawTransaction"], 12.0);
        assert_eq!(calls["eth_blockNumber"], 3.0);
        let before = std::collections::BTreeMap::from([("eth_blockNumber".to_string(), 3.0)]);
        let delta = rpc_delta(&before, &calls);
        assert_eq!(
            delta.len(),
            1,
            "a method with no new call is left out: {delta:?}"
        );
        assert_eq!(delta["eth_sendRawTransaction"], 12.0);
    }

    #[test]
    fn a_phase_holds_its_own_requests_of_its_own_run() {
        assert!(Phase::Warmup.matches("ab12", "ab12-warmup-3"));
        assert!(!Phase::Warmup.matches("ab12", "ab12-3-7"));
        assert!(Phase::Measured.matches("ab12", "ab12-3-7"));
        assert!(!Phase::Measured.matches("ab12", "ab12-warmup-3"));
        assert!(!Phase::Measured.matches("ab12", "cd34-3-7"));
        assert!(!Phase::Measured.matches("ab12", ""));
    }

    #[test]
    fn percentiles_are_nearest_rank_and_nan_when_empty() {
        let lat = [10.0, 20.0, 30.0, 40.0, 50.0];
        assert_eq!(percentile(&lat, 0.0), 10.0);
        assert_eq!(percentile(&lat, 0.5), 30.0);
        assert_eq!(percentile(&lat, 0.99), 50.0);
        assert_eq!(percentile(&lat, 1.0), 50.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
