//! `txflow chaos`: a seeded schedule of faults against the whole system on infrastructure of its
//! own, judged at the end by an oracle (the crate `txflow-chaos`; docs/chaos.md).

use std::path::PathBuf;

use clap::Args;
use txflow_chaos::schedule::{Kinds, Shape};

#[derive(Args, Debug)]
pub struct ChaosArgs {
    /// The seed of the schedule and the workload: the same seed replays the same faults and
    /// requests at the same offsets (not the same interleaving of threads and processes).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Faults in the schedule; the first are one of each kind drawn from.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// The kinds of fault to draw from, comma-separated (every kind by default): kill_role,
    /// pause_role, kill_broker, kill_postgres, reorg, rpc_errors, rpc_timeouts,
    /// lost_send_answers, lagging_head, duplicates, bad_records, chained, approvals,
    /// foreign_nonce, reorg_while_down, pause_broker; with --transfers also
    /// kill_transfer_role, pause_coordinator, asset_rules.
    #[arg(long, value_parser = txflow_chaos::schedule::Kinds::parse)]
    faults: Option<txflow_chaos::schedule::Kinds>,
    /// The deepest a reorg deeper than the confirmations goes (3 × confirmations + 2 by
    /// default).
    #[arg(long)]
    max_reorg_depth: Option<u64>,
    /// The time over which requests and faults are spread.
    #[arg(long, default_value_t = 2.0)]
    minutes: f64,
    #[arg(long, default_value_t = 4)]
    signers: usize,
    #[arg(long, default_value_t = 200)]
    requests: u64,
    /// Requests per second.
    #[arg(long, default_value_t = 5.0)]
    rate: f64,
    /// Internal transfers to ask of the gateway over the run, by four users (0: none). Runs the
    /// spot ledger and N transfer coordinators, and adds the transfer faults (kill_transfer_role,
    /// pause_coordinator, asset_rules) to those drawn from.
    #[arg(long, default_value_t = 0)]
    transfers: u64,
    /// Processes per role.
    #[arg(long, default_value_t = 2)]
    processes: usize,
    /// Confirmations a transaction needs (half the reorgs go deeper).
    #[arg(long, default_value_t = 3)]
    confirmations: u64,
    /// The lease of a signer (a pause longer than it lets another process steal the signer).
    #[arg(long, default_value_t = 3000)]
    lease_ms: u64,
    /// How long the healed system may take to end every request.
    #[arg(long, default_value_t = 300)]
    settle_secs: u64,
    /// Where the cluster and the logs go (a new directory under the temporary directory by
    /// default; removed after a passing run unless --keep).
    #[arg(long)]
    dir: Option<PathBuf>,
    #[arg(long)]
    keep: bool,
    /// Print the schedule the seed draws for these sizes, as JSON, and run nothing.
    #[arg(long)]
    schedule: bool,
    #[arg(long, env = "TXFLOW_TANSU_BIN")]
    tansu_bin: Option<PathBuf>,
    #[arg(long, env = "TXFLOW_REGISTRY_BIN")]
    registry_bin: Option<PathBuf>,
    #[arg(long, env = "TXFLOW_ANVIL_BIN")]
    anvil_bin: Option<PathBuf>,
    /// PostgreSQL's server binaries (initdb, postgres); the newest under /usr/lib/postgresql by
    /// default.
    #[arg(long, env = "TXFLOW_PG_BIN")]
    pg_bin: Option<PathBuf>,
}

fn newest_pg_bin() -> anyhow::Result<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, p)| p.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().map(|(_, p)| p).ok_or_else(|| {
        anyhow::anyhow!("no PostgreSQL server binaries under /usr/lib/postgresql (set --pg-bin)")
    })
}

pub async fn run(args: ChaosArgs) -> anyhow::Result<()> {
    let confirmations = args.confirmations.max(1);
    let kinds = match (args.faults, args.transfers) {
        (Some(k), 0) if k.has_transfer_kinds() => anyhow::bail!(
            "--faults names a transfer fault (kill_transfer_role, pause_coordinator, asset_rules): \
             it needs --transfers N"
        ),
        (Some(k), _) => k,
        (None, 0) => Kinds::PIPELINE,
        (None, _) => Kinds::ALL,
    };
    let max_reorg_depth = args
        .max_reorg_depth
        .unwrap_or_else(|| Shape::default_max_reorg_depth(confirmations));
    if args.schedule {
        let schedule = txflow_chaos::schedule::Schedule::draw(
            args.seed,
            Shape {
                steps: args.steps,
                span_ms: (args.minutes * 60_000.0) as u64,
                processes: args.processes.max(1),
                required_confirmations: confirmations,
                lease_ms: args.lease_ms,
                kinds,
                max_reorg_depth,
            },
        );
        println!("{}", serde_json::to_string(&schedule)?);
        return Ok(());
    }
    let tool = |p: Option<PathBuf>, flag: &str, env: &str| {
        p.ok_or_else(|| anyhow::anyhow!("{flag} (or {env}) is required to run"))
    };
    let tansu = tool(args.tansu_bin, "--tansu-bin", "TXFLOW_TANSU_BIN")?;
    let registry = tool(args.registry_bin, "--registry-bin", "TXFLOW_REGISTRY_BIN")?;
    let anvil = tool(args.anvil_bin, "--anvil-bin", "TXFLOW_ANVIL_BIN")?;
    let pg_bin = match args.pg_bin {
        Some(p) => p,
        None => newest_pg_bin()?,
    };
    let options = txflow_chaos::Options {
        seed: args.seed,
        steps: args.steps,
        minutes: args.minutes,
        signers: args.signers.max(1),
        requests: args.requests,
        rate: args.rate,
        transfers: args.transfers,
        processes: args.processes.max(1),
        confirmations,
        lease_ms: args.lease_ms,
        kinds,
        max_reorg_depth,
        settle_secs: args.settle_secs,
        dir: args.dir,
        keep: args.keep,
        tools: txflow_chaos::cluster::Tools {
            txflow: std::env::current_exe()?,
            tansu,
            registry,
            anvil,
            pg_bin,
        },
    };
    let seed = options.seed;
    let report = txflow_chaos::run(options).await?;
    println!("{}", report.line);
    anyhow::ensure!(
        report.passed,
        "the oracle found violations with seed {seed}: {} (replay: txflow chaos --seed {seed} with the same sizes)",
        report.line["first_violations"]
    );
    Ok(())
}
