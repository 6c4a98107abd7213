//! `txflow bench --scenario stage`: the stage runtime's own cost, with a no-op handler.
//!
//! Phase 1 (throughput): N requests over S signers are put on the input topic first, then the
//! stage starts; the time until every output is consumed gives messages per second.
//! Phase 2 (latency): requests are produced at `--rate` while the stage runs; each output's arrival
//! minus its request's send time is the added latency of one stage hop (consume → lease → batch
//! transaction → commit → produce → consume).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::domain::{ChainId, NodeId, Signer};
use txflow_core::events::{TxAccepted, TxRequest};
use txflow_core::fenced::Fenced;
use txflow_core::kafka::{delete_topics, ensure_topics, signer_key};
use txflow_core::lease::{LeaseConfig, LeaseManager};
use txflow_core::role::Role;
use txflow_core::stage::{
    DriveCtx, Handler, HandlerError, Output, Rejection, StageConfig, StageRuntime,
};

/// Echoes every request as a TxAccepted without touching any table.
struct NoopStage {
    input: String,
    output: String,
}

impl Handler for NoopStage {
    type Input = TxRequest;
    fn role(&self) -> Role {
        Role::Allocator
    }
    fn input_topic(&self) -> String {
        self.input.clone()
    }
    fn route(&self, r: &TxRequest) -> Result<(ChainId, Signer), Rejection> {
        Signer::parse(&r.signer)
            .map(|s| (ChainId(r.chain_id), s))
            .map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))
    }
    async fn handle(&self, w: &mut Fenced<'_>, r: &TxRequest) -> Result<Vec<Output>, HandlerError> {
        let accepted = TxAccepted {
            event_id: r.event_id.clone(),
            tx_id: r.request_id.clone(),
            request_id: r.request_id.clone(),
            chain_id: r.chain_id,
            signer: r.signer.clone(),
            fencing_token: w.lease().token().0,
            accepted_at_ms: 0,
        };
        Ok(vec![Output::new(
            self.output.clone(),
            Subjects::TopicRecordName,
            signer_key(r.chain_id, &r.signer),
            accepted,
        )])
    }
    async fn pending_signers(&self, _pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        Ok(Vec::new())
    }
    async fn drive(&self, _ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        Ok(Vec::new())
    }
}

fn request(i: u32, signers: u32) -> TxRequest {
    TxRequest {
        event_id: uuid::Uuid::new_v4().to_string(),
        request_id: format!("bench-{i}"),
        chain_id: 31337,
        signer: format!("0x{:040x}", 0xbe00 + (i % signers)),
        to: "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into(),
        value: "0".into(),
        data: vec![],
        gas_limit: None,
        max_fee_per_gas: None,
        max_priority_fee_per_gas: None,
        metadata: Default::default(),
        depends_on_request_id: None,
        depends_on_signer: None,
        submitted_by: None,
    }
}

async fn send(
    producer: &FutureProducer,
    codec: &RegistryCodec,
    topic: &str,
    r: &TxRequest,
) -> anyhow::Result<()> {
    let bytes = codec.encode(topic, Subjects::TopicName, r).await?;
    producer
        .send(
            FutureRecord::to(topic)
                .key(&signer_key(r.chain_id, &r.signer))
                .payload(&bytes),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)?;
    Ok(())
}

/// Receives `n` outputs; returns each request id with its arrival time.
async fn receive(
    consumer: &StreamConsumer,
    codec: &RegistryCodec,
    n: usize,
) -> anyhow::Result<Vec<(String, Instant)>> {
    let mut out = Vec::with_capacity(n);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    while out.len() < n {
        let m = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .map_err(|_| anyhow::anyhow!("received {} of {n} outputs within 300 s", out.len()))??;
        if let Some(p) = m.payload() {
            let a: TxAccepted = codec.decode(p).await?;
            out.push((a.request_id, Instant::now()));
        }
    }
    Ok(out)
}

pub async fn run(
    config: &Config,
    messages: u32,
    signers: u32,
    batch_max: u32,
    rate: u32,
    json: bool,
) -> anyhow::Result<()> {
    let signers = signers.max(1);
    let pool = txflow_core::db::connect_stages(&config.database_url, 4).await?;
    txflow_core::db::migrate(&pool).await?;
    let codec = RegistryCodec::new(&config.schema_registry_url);
    let run_id = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let input = format!("{}.bench.stage.{run_id}.in", config.topics.prefix);
    let output = format!("{}.bench.stage.{run_id}.out", config.topics.prefix);
    let dlq = format!("{}.bench.stage.{run_id}.dlq", config.topics.prefix);
    let topics = vec![input.clone(), output.clone(), dlq.clone()];
    ensure_topics(&config.kafka, &topics, 4).await?;
    let producer: FutureProducer = config.kafka.producer_config().create()?;

    // Phase 1: preload, then drain.
    println!(
        "stage bench: loading {messages} requests over {signers} signers (batch_max {batch_max})"
    );
    let loads: Vec<_> = (0..messages).map(|i| request(i, signers)).collect();
    for chunk in loads.chunks(1000) {
        let sends = chunk.iter().map(|r| send(&producer, &codec, &input, r));
        for r in futures::future::join_all(sends).await {
            r?;
        }
    }
    let consumer: StreamConsumer = config
        .kafka
        .consumer_config(&format!("bench-out-{run_id}"))
        .create()?;
    consumer.subscribe(&[&output])?;

    let lease = LeaseConfig::default();
    let leases = LeaseManager::new(pool.clone(), Role::Allocator, NodeId::generate(), lease)?;
    let mut stage_config = StageConfig::new(format!("bench-stage-{run_id}"), dlq.clone());
    stage_config.batch_max = batch_max as usize;
    stage_config.partitions = 4;
    stage_config.topics = vec![output.clone()];
    let runtime = StageRuntime::new(
        NoopStage {
            input: input.clone(),
            output: output.clone(),
        },
        pool.clone(),
        codec.clone(),
        config.kafka.clone(),
        leases,
        stage_config,
    );
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let stage = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { runtime.run(shutdown).await })
    };
    let arrivals = receive(&consumer, &codec, messages as usize).await?;
    let drained = started.elapsed();
    // From the first output to the last: the group join before the first batch is not counted.
    let span = match (arrivals.first(), arrivals.last()) {
        (Some((_, a)), Some((_, b))) => b.duration_since(*a).as_secs_f64(),
        _ => drained.as_secs_f64(),
    };
    let throughput = if span > 0.0 {
        f64::from(messages.saturating_sub(1)) / span
    } else {
        f64::NAN
    };
    println!(
        "  throughput: {throughput:.0} msg/s ({messages} messages; {span:.2} s from first to last output, {:.2} s with the group join)",
        drained.as_secs_f64()
    );

    // Phase 2: latency at a steady rate.
    let n = messages.min(2_000);
    let rate = if rate == 0 { 200 } else { rate };
    let mut sent_at: HashMap<String, Instant> = HashMap::new();
    let receiver = {
        let codec = codec.clone();
        tokio::spawn(async move { receive(&consumer, &codec, n as usize).await })
    };
    let t0 = Instant::now();
    for i in 0..n {
        let due = t0 + Duration::from_secs_f64(f64::from(i) / f64::from(rate));
        tokio::time::sleep_until(due.into()).await;
        let r = request(messages + i, signers);
        sent_at.insert(r.request_id.clone(), Instant::now());
        send(&producer, &codec, &input, &r).await?;
    }
    let arrivals = receiver.await??;
    let mut lat: Vec<f64> = arrivals
        .iter()
        .filter_map(|(id, at)| {
            sent_at
                .get(id)
                .map(|s| at.duration_since(*s).as_secs_f64() * 1000.0)
        })
        .collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| {
        lat.get(((lat.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let (p50, p95, p99) = (pct(0.5), pct(0.95), pct(0.99));
    println!(
        "  latency at {rate} msg/s over {n} requests (produce → stage → consume): p50 {p50:.1} ms, p95 {p95:.1} ms, p99 {p99:.1} ms"
    );

    shutdown.cancel();
    stage.await??;
    delete_topics(&config.kafka, &topics).await?;
    sqlx::query(
        "DELETE FROM signer_lease WHERE signer LIKE '0x000000000000000000000000000000000000be%'",
    )
    .execute(&pool)
    .await?;
    if json {
        let report = serde_json::json!({
            "scenario": "stage",
            "messages": messages,
            "signers": signers,
            "batch_max": batch_max,
            "msg_per_s": throughput.round(),
            "latency_rate": rate,
            "p50_ms": p50,
            "p95_ms": p95,
            "p99_ms": p99,
        });
        println!("{report}");
    }
    Ok(())
}
