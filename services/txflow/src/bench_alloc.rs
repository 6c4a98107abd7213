//! `txflow bench --scenario allocate`: one hot signer — how many nonces per second the allocator
//! takes from PostgreSQL for a single signer, and that they are gap-free.
//!
//! What runs is the allocator's own handler ([`RequestStage`]), called the way the stage runtime
//! calls it for one signer's batches, one batch after the other (a signer's batches are never
//! concurrent: one partition, one drive at a time):
//! 1. the lease acquired, then renewed when older than the renewal interval (the runtime's lease
//!    cache);
//! 2. the batch recorded RECEIVED by `handle_batch` in a `BatchTx` savepoint, committed with the
//!    lease re-checked under a share lock;
//! 3. the signer's `drive`: simulation (RECEIVED → SIMULATED) and allocation (the cursor aligned
//!    and advanced, recycled nonces first, SIMULATED → ALLOCATED as one fenced compare-and-set),
//!    each in its fenced transaction with the real lease and fencing token.
//!
//! Left out: Kafka (decoding, producing the outputs, storing offsets) and the node. The chain is
//! [`InstantChain`], which answers at once (every estimate 21,000 gas, fixed fees, pending nonce
//! 0), so the figure is the allocator's PostgreSQL path alone: the ceiling one signer reaches
//! whatever its node, and what the requests' `eth_estimateGas` calls add on top depends on the
//! node. The requests go to [`BENCH_CHAIN_ID`], a chain no stage serves, under a fresh signer, so
//! the rows left behind (for inspection) are never driven by a pipeline on the same database.
//! The in-flight budget (`nonce.max_in_flight`) is lifted: no nonce is ever mined here.
//!
//! Without `--rate` every request is waiting at the start (a backlog: batches are full, the
//! signer's ceiling). With `--rate N` the requests arrive steadily, N per second, and a batch
//! takes what has arrived (up to `--batch-max`) after the runtime's linger, as a consumer does;
//! the latency of each request, arrival → ALLOCATED committed, is reported.
//!
//! After the run the nonces are read back from PostgreSQL: exactly `0..n-1`, each held once.
//!
//! The CPU seconds of this process, of PostgreSQL and of the machine over the batches are
//! reported too (`cpu_s`, as the pipeline bench's, broker and node `null`), with the machine's per
//! batch: what a signer's batch and drive cost whatever they carry (docs/performance.md,
//! "Where PostgreSQL's time goes").

use std::time::{Duration, Instant};

use alloy::primitives::{Address, B256, Bytes, U256};
use txflow_allocator::{AllocatorConfig, RequestStage};
use txflow_core::chain::{
    BlockHeader, ChainClient, ChainError, ChainFuture, Receipt, SendOutcome, Simulation,
};
use txflow_core::config::Config;
use txflow_core::domain::{ChainId, NodeId, Signer};
use txflow_core::events::TxRequest;
use txflow_core::fenced::BatchTx;
use txflow_core::lease::{Acquisition, HeldLease, LeaseConfig, LeaseManager};
use txflow_core::policy::Policy;
use txflow_core::role::Role;
use txflow_core::stage::{DriveCtx, Handler, HandlerError, StageConfig};

/// The chain id of the bench's requests: no deployment's stages scan it (each serves its own
/// `TXFLOW_CHAIN_ID`), so what the bench leaves in the database is inert.
pub const BENCH_CHAIN_ID: i64 = 7_357_000_001;

/// The stub node of the bench: instant answers to what the allocator asks, an error to anything
/// else (the allocator asks nothing else).
#[derive(Debug)]
struct InstantChain;

/// The gas every simulation reports (a plain transfer).
const SIMULATED_GAS: u64 = 21_000;

fn not_served(method: &'static str) -> ChainError {
    ChainError::Rpc {
        method,
        code: -32601,
        message: "the allocation bench's stub chain answers only the allocator's calls".into(),
        data: None,
    }
}

impl ChainClient for InstantChain {
    fn pending_nonce(&self, _address: Address) -> ChainFuture<'_, u64> {
        Box::pin(async { Ok(0) })
    }
    fn latest_nonce(&self, _address: Address) -> ChainFuture<'_, u64> {
        Box::pin(async { Ok(0) })
    }
    fn knows_transaction(&self, _hash: B256) -> ChainFuture<'_, bool> {
        Box::pin(async { Err(not_served("eth_getTransactionByHash")) })
    }
    fn simulate(
        &self,
        _from: Address,
        _to: Address,
        _value: U256,
        _data: Bytes,
    ) -> ChainFuture<'_, Simulation> {
        Box::pin(async { Ok(Simulation::Ok { gas: SIMULATED_GAS }) })
    }
    fn fees(&self) -> ChainFuture<'_, (u128, u128)> {
        Box::pin(async { Ok((2_000_000_000, 1_000_000_000)) })
    }
    fn send_raw<'a>(&'a self, _raw: &'a [u8]) -> ChainFuture<'a, SendOutcome> {
        Box::pin(async { Err(not_served("eth_sendRawTransaction")) })
    }
    fn receipt(&self, _hash: B256) -> ChainFuture<'_, Option<Receipt>> {
        Box::pin(async { Err(not_served("eth_getTransactionReceipt")) })
    }
    fn block(&self, _number: u64) -> ChainFuture<'_, Option<BlockHeader>> {
        Box::pin(async { Err(not_served("eth_getBlockByNumber")) })
    }
    // The allocator aligns a stale cursor with the nonce at the last final block.
    fn block_number(&self) -> ChainFuture<'_, u64> {
        Box::pin(async { Ok(0) })
    }
    fn nonce_at(&self, _address: Address, _block: u64) -> ChainFuture<'_, u64> {
        Box::pin(async { Ok(0) })
    }
    fn block_transaction_hashes(&self, _number: u64) -> ChainFuture<'_, Option<Vec<B256>>> {
        Box::pin(async { Err(not_served("eth_getBlockByNumber")) })
    }
    fn balance(&self, _address: Address) -> ChainFuture<'_, U256> {
        Box::pin(async { Err(not_served("eth_getBalance")) })
    }
    fn revert_data(
        &self,
        _from: Address,
        _to: Address,
        _value: U256,
        _data: Bytes,
        _block: u64,
    ) -> ChainFuture<'_, Option<Bytes>> {
        Box::pin(async { Err(not_served("eth_call")) })
    }
}

/// A fresh random signer address (lowercase), so that every run starts at nonce 0.
fn fresh_signer() -> anyhow::Result<Signer> {
    let a = uuid::Uuid::new_v4();
    let b = uuid::Uuid::new_v4();
    let hex = format!("{}{}", a.simple(), &b.simple().to_string()[..8]);
    Ok(Signer::parse(&format!("0x{hex}"))?)
}

fn request(run: &str, i: u32, signer: &Signer) -> TxRequest {
    TxRequest {
        event_id: uuid::Uuid::new_v4().to_string(),
        request_id: format!("alloc-{run}-{i}"),
        chain_id: BENCH_CHAIN_ID,
        signer: signer.as_str().to_string(),
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

/// A handler error as the bench reports it (its retry class and source chain kept by anyhow).
fn handler(what: &'static str) -> impl FnOnce(HandlerError) -> anyhow::Error {
    move |e| anyhow::Error::new(e).context(what)
}

/// Nearest-rank percentile of sorted milliseconds.
fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * p).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// What PostgreSQL holds for the signer after the run.
#[derive(Debug, sqlx::FromRow)]
struct Held {
    /// Rows holding a nonce.
    rows: i64,
    /// Distinct nonces held.
    distinct: i64,
    /// `max(nonce) + 1`, 0 when none.
    span: i64,
    /// Rows in ALLOCATED.
    allocated: i64,
}

/// The lease for the signer, acquired or renewed; another holder is an error (the signer is
/// fresh, so none should exist).
async fn hold(leases: &LeaseManager, signer: &Signer) -> anyhow::Result<HeldLease> {
    match leases.acquire(ChainId(BENCH_CHAIN_ID), signer).await? {
        Acquisition::Held(l, _) => Ok(l),
        Acquisition::Busy { owner, .. } => {
            anyhow::bail!("the bench signer's lease is held by {owner:?}")
        }
    }
}

pub async fn run(
    config: &Config,
    txs: u32,
    batch: u32,
    rate: Option<u32>,
    json: bool,
) -> anyhow::Result<()> {
    let batch = batch.max(1);
    let rate = rate.filter(|r| *r > 0);
    let linger = StageConfig::new("", "").batch_linger;
    let pool = txflow_core::db::connect_stages(&config.database_url, 4).await?;
    txflow_core::db::migrate(&pool).await?;
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
    let signer = fresh_signer()?;
    // The allocator's configuration, on the bench's chain and with a policy that allows the
    // requests (the policy check is a comparison per request; what is measured is PostgreSQL).
    let mut allocator = AllocatorConfig::from_config(config)?;
    allocator.chain_id = ChainId(BENCH_CHAIN_ID);
    allocator.policy = Policy::default();
    // Nothing is mined here, so the in-flight budget (`nonce.max_in_flight`: nonces allocated and
    // not mined) would stop the signer at it; in production mining frees it at the chain's pace.
    // Lifted, so that what is measured is the allocation path (still at most
    // `MAX_ALLOCATIONS_PER_DRIVE` a drive).
    allocator.max_in_flight = u32::MAX;
    let allocated_topic = allocator.topics.tx_allocated();
    let stage = RequestStage {
        config: allocator,
        chain: std::sync::Arc::new(InstantChain),
    };
    let lease_config = LeaseConfig::default();
    let leases = LeaseManager::new(
        pool.clone(),
        Role::Allocator,
        NodeId::generate(),
        lease_config,
    )?;
    let offered = match rate {
        Some(r) => format!("offered at {r}/s"),
        None => "all waiting at the start".to_string(),
    };
    println!(
        "allocate bench: {txs} requests of one signer ({signer}, chain {BENCH_CHAIN_ID}), {offered}, in batches of at most {batch}"
    );

    let requests: Vec<TxRequest> = (0..txs).map(|i| request(&run_id, i, &signer)).collect();
    let mut lease = hold(&leases, &signer).await?;
    let mut renewed_at = Instant::now();
    let (mut batch_ms, mut record_ms, mut drive_ms) = (Vec::new(), Vec::new(), Vec::new());
    let mut announced = 0usize;
    let mut latency_ms = Vec::with_capacity(requests.len());
    let probe = crate::bench_cpu::CpuProbe::new("", "", &config.database_url);
    let cpu_start = probe.sample();
    let started = Instant::now();
    // When request `i` arrives: at the start (a backlog) or steadily at `rate`.
    let arrival = |i: usize| match rate {
        Some(r) => started + Duration::from_secs_f64(i as f64 / f64::from(r)),
        None => started,
    };
    let mut next = 0usize;
    while next < requests.len() {
        // Nothing arrived yet: wait for the next request, then linger for more (the runtime's
        // batch_linger after a first message).
        let first = arrival(next);
        if first > Instant::now() {
            tokio::time::sleep_until((first + linger).into()).await;
        }
        let now = Instant::now();
        let end = (next..requests.len().min(next + batch as usize))
            .take_while(|&i| arrival(i) <= now)
            .last()
            .map_or(next + 1, |i| i + 1);
        let chunk = &requests[next..end];
        let t0 = Instant::now();
        if renewed_at.elapsed() >= lease_config.renew_interval {
            lease = hold(&leases, &signer).await?;
            renewed_at = Instant::now();
        }
        // The batch: recorded RECEIVED in the signer's savepoint, committed.
        let inputs: Vec<&TxRequest> = chunk.iter().collect();
        let mut tx = BatchTx::begin(&pool, lease_config.duration * 2).await?;
        let mut scope = tx.signer(&lease).await?;
        let results = stage
            .handle_batch(&mut scope.writer(), &inputs)
            .await
            .map_err(handler("recording the batch"))?;
        anyhow::ensure!(
            results.len() == chunk.len(),
            "handle_batch answered {} of {} requests",
            results.len(),
            chunk.len()
        );
        for r in results {
            r.map_err(handler("recording a request"))?;
        }
        scope.keep().await?;
        tx.commit().await?;
        let t1 = Instant::now();
        // The drive that follows the commit: simulation, then allocation.
        let outputs = {
            let _alone = leases.lock_signer(ChainId(BENCH_CHAIN_ID), &signer).await;
            stage
                .drive(DriveCtx {
                    lease: &lease,
                    pool: &pool,
                    recovery: false,
                })
                .await
                .map_err(handler("driving the signer"))?
        };
        announced += outputs
            .iter()
            .filter(|o| o.topic == allocated_topic)
            .count();
        let t2 = Instant::now();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        record_ms.push(ms(t1 - t0));
        drive_ms.push(ms(t2 - t1));
        batch_ms.push(ms(t2 - t0));
        latency_ms.extend((next..end).map(|i| ms(t2.saturating_duration_since(arrival(i)))));
        next = end;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_start.until(&probe.sample());
    leases.release(&lease).await?;

    // The outcome, from PostgreSQL: every nonce 0..n-1 held once, every request ALLOCATED.
    let held: Held = sqlx::query_as(
        "SELECT count(*) AS rows, count(DISTINCT nonce) AS distinct,
                coalesce(max(nonce) + 1, 0) AS span,
                count(*) FILTER (WHERE state = $3) AS allocated
         FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND nonce IS NOT NULL",
    )
    .bind(BENCH_CHAIN_ID)
    .bind(signer.as_str())
    .bind(txflow_core::state::TxState::Allocated.as_str())
    .fetch_one(&pool)
    .await?;
    let gaps = held.span - held.distinct;
    let duplicates = held.rows - held.distinct;
    let nonces_per_s = if seconds > 0.0 {
        held.distinct as f64 / seconds
    } else {
        f64::NAN
    };
    for v in [
        &mut batch_ms,
        &mut record_ms,
        &mut drive_ms,
        &mut latency_ms,
    ] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    let batches = batch_ms.len();
    println!(
        "  {} nonces in {seconds:.2} s: {nonces_per_s:.0} nonces/s ({} allocated, {gaps} gap(s), {duplicates} held twice)",
        held.distinct, held.allocated
    );
    println!(
        "  per batch of {batch} ({batches} batches): p50 {:.1} ms, p99 {:.1} ms (record p50 {:.1} ms, drive p50 {:.1} ms)",
        pct(&batch_ms, 0.5),
        pct(&batch_ms, 0.99),
        pct(&record_ms, 0.5),
        pct(&drive_ms, 0.5)
    );
    let cpu_ms_per_batch = cpu.machine.map(|s| s * 1000.0 / batches.max(1) as f64);
    println!("  {}", cpu.line());
    if let Some(ms) = cpu_ms_per_batch {
        println!("  machine CPU per batch (record + drive): {ms:.2} ms");
    }
    if let Some(r) = rate {
        println!(
            "  at {r}/s offered: arrival → ALLOCATED p50 {:.1} ms, p99 {:.1} ms; mean batch {:.1}",
            pct(&latency_ms, 0.5),
            pct(&latency_ms, 0.99),
            f64::from(txs) / batches.max(1) as f64
        );
    }
    if json {
        let report = serde_json::json!({
            "scenario": "allocate",
            "requests": txs,
            "nonces": held.distinct,
            "allocated": held.allocated,
            "announced": announced,
            "gaps": gaps,
            "duplicates": duplicates,
            "seconds": seconds,
            "nonces_per_s": nonces_per_s.round(),
            "batch_max": batch,
            "batches": batches,
            "mean_batch": f64::from(txs) / batches.max(1) as f64,
            "rate": rate,
            "p50_latency_ms": rate.map(|_| pct(&latency_ms, 0.5)),
            "p99_latency_ms": rate.map(|_| pct(&latency_ms, 0.99)),
            "p50_batch_ms": pct(&batch_ms, 0.5),
            "p99_batch_ms": pct(&batch_ms, 0.99),
            "p50_record_ms": pct(&record_ms, 0.5),
            "p50_drive_ms": pct(&drive_ms, 0.5),
            "chain_id": BENCH_CHAIN_ID,
            "signer": signer.as_str(),
            "cpu_s": cpu.json(),
            "machine_cpu_ms_per_batch": cpu_ms_per_batch,
        });
        println!("{report}");
    }
    let expected = i64::from(txs);
    anyhow::ensure!(
        gaps == 0 && duplicates == 0 && held.distinct == expected && held.allocated == expected,
        "allocation is not gap-free: {} nonces for {txs} requests, {gaps} gap(s), {duplicates} held twice, {} ALLOCATED",
        held.distinct,
        held.allocated
    );
    Ok(())
}
