//! `txflow bench`: load generators.
//!
//! - `--scenario broker-hop`: one produce → consume hop through the configured broker with the
//!   pipeline's client settings; reports the per-hop latency distribution and the rate achieved.
//! - `--scenario pipeline` (default): requests through the real pipeline (issue #5).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use txflow_core::config::Config;
use txflow_core::kafka::{delete_topics, ensure_topics};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[arg(long, value_enum, default_value_t = Scenario::Pipeline)]
    scenario: Scenario,
    /// Signers (pipeline, stage).
    #[arg(long, default_value_t = 1)]
    signers: u32,
    /// Requests per signer (pipeline).
    #[arg(long, default_value_t = 100)]
    txs: u32,
    /// Messages to send (broker-hop, stage).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    messages: u32,
    /// Largest batch the stage runtime takes (stage); 1 = one message per transaction.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
    batch_max: u32,
    /// Messages per second, 0 for as fast as possible (broker-hop; stage latency phase).
    #[arg(long, default_value_t = 2_000)]
    rate: u32,
    /// Payload size in bytes (broker-hop).
    #[arg(long, default_value_t = 256)]
    size: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Pipeline,
    BrokerHop,
    /// A no-op stage on the stage runtime: leases, batch transaction, commit, produce, offsets.
    Stage,
}

pub async fn run(config: &Config, args: BenchArgs) -> anyhow::Result<()> {
    match args.scenario {
        Scenario::Pipeline => {
            anyhow::bail!(
                "the pipeline benchmark needs the allocator, signer gateway and broadcaster (issue #5)"
            )
        }
        Scenario::BrokerHop => broker_hop(config, &args).await,
        Scenario::Stage => {
            crate::bench_stage::run(
                config,
                args.messages,
                args.signers,
                args.batch_max,
                args.rate,
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
    let rate = args.rate;
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
