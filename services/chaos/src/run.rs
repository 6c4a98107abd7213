//! One chaos run: start the system, publish the workload and apply the schedule, heal, wait for
//! every request to end, stop, and judge with the [`crate::oracle`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use alloy::consensus::Transaction as _;
use alloy::eips::BlockNumberOrTag;
use alloy::primitives::{Address, Bytes, U256};
use alloy::providers::ext::AnvilApi;
use alloy::providers::{DynProvider, Provider, ProviderBuilder};
use alloy::rpc::types::anvil::{ReorgOptions, TransactionData};
use alloy::signers::local::PrivateKeySigner;
use anyhow::Context as _;
use serde_json::json;
use txflow_client::{
    Book, OutcomeReader, Producer, ReadOptions, Settings, TxCommandKind, TxRequest,
};

use crate::cluster::{Daemon, Slot, Tools, free_port, spawn_logged, txflow_command};
use crate::fault_proxy::{Fault as RpcFault, FaultProxy, Rule};
use crate::oracle::{self, Announced, Nonces, OnChain, Recorded, Requested};
use crate::rng::Rng;
use crate::schedule::{Fault, Kinds, ROLES, Schedule, Shape, Step};
use crate::transfers::{self, TransferLoad};

const CHAIN_ID: i64 = 31337;
/// A `managed_tx` row that is final (`TxState::is_terminal`, and REVERTED once settled).
const TERMINAL: &str =
    "(state IN ('CONFIRMED', 'FAILED') OR (state = 'REVERTED' AND confirmed_at IS NOT NULL))";
const SINK: &str = "0x000000000000000000000000000000000000dead";
const PREFIX: &str = "chaos";
/// Partitions of every topic.
const PARTITIONS: i32 = 4;
/// Once every request is final in PostgreSQL, how long the downstream may read nothing new before
/// the run is judged.
const QUIET: Duration = Duration::from_secs(20);
/// How often the pipeline stages' recovery scan runs (txflow-core's
/// `StageConfig::for_pipeline`).
const RECOVERY_SCAN_MS: u64 = 5_000;
/// With `asset_rules` and the ledger down: how long after the kill the rules change (past the
/// coordinators' 1.5 s call timeout and a retry).
const RULES_LEAD_MS: u64 = 2_500;
/// After a broker kill: how long the killed role processes wait before they start again (the
/// new broker starts meanwhile).
const BROKER_RESTART_MS: u64 = 1_500;
/// At or above this value a request waits for an approval.
const APPROVAL_THRESHOLD: u64 = 1_000_000;

/// The size and shape of a run.
#[derive(Debug, Clone)]
pub struct Options {
    pub seed: u64,
    pub steps: usize,
    /// The time over which the requests and the steps are spread.
    pub minutes: f64,
    pub signers: usize,
    pub requests: u64,
    /// Requests per second (the workload stops at `requests`).
    pub rate: f64,
    /// Internal transfers asked of the gateway over the run (0: none, and no coordinator or
    /// spot ledger runs).
    pub transfers: u64,
    pub processes: usize,
    pub confirmations: u64,
    pub lease_ms: u64,
    /// The kinds of fault the schedule draws from.
    pub kinds: Kinds,
    /// The deepest a reorg deeper than the confirmations goes.
    pub max_reorg_depth: u64,
    /// How long the healed system may take to end every request.
    pub settle_secs: u64,
    /// Where the logs and the cluster go (a new temporary directory by default).
    pub dir: Option<PathBuf>,
    /// Keep the directory even when the run passes.
    pub keep: bool,
    pub tools: Tools,
}

/// The outcome, printed as one JSON line.
pub struct Report {
    pub line: serde_json::Value,
    pub passed: bool,
}

fn progress(started: Instant, msg: impl AsRef<str>) {
    eprintln!(
        "[chaos {:>6.1}s] {}",
        started.elapsed().as_secs_f64(),
        msg.as_ref()
    );
}

/// What the workload published.
struct Workload {
    rng: Rng,
    keys: Vec<PrivateKeySigner>,
    requested: Vec<TxRequest>,
    /// Requests that wait for an operator: (index in `requested`, approve or cancel).
    approvals: Vec<(usize, TxCommandKind)>,
    next_id: u64,
    /// The steps applied so far (the one being applied counts as applied).
    applied: usize,
    /// For each request id, the first step it can have lived through.
    born: BTreeMap<String, usize>,
}

impl Workload {
    /// The signers the workload and the other faults draw from: all but the quiet one.
    fn busy(&self) -> usize {
        self.keys.len() - 1
    }

    fn signer(&self, i: usize) -> String {
        format!("{:#x}", self.keys[i].address())
    }

    fn request(
        &mut self,
        value: u64,
        depends_on: Option<String>,
        signer: Option<usize>,
    ) -> TxRequest {
        let signer = signer.unwrap_or_else(|| self.rng.below(self.busy() as u64) as usize);
        let request_id = format!("c-{}", self.next_id);
        self.next_id += 1;
        self.born.insert(request_id.clone(), self.applied);
        TxRequest {
            event_id: uuid::Uuid::new_v4().to_string(),
            request_id: request_id.clone(),
            chain_id: CHAIN_ID,
            signer: self.signer(signer),
            to: SINK.into(),
            value: value.to_string(),
            data: format!("txflow:{request_id}").into_bytes(),
            gas_limit: None,
            max_fee_per_gas: None,
            max_priority_fee_per_gas: None,
            metadata: Default::default(),
            depends_on_request_id: depends_on,
            depends_on_signer: None,
            submitted_by: None,
        }
    }
}

/// The broker-facing side: a producer and a reader, rebuilt after the broker is lost.
struct Client {
    settings: Settings,
    producer: Producer,
    reader: Option<OutcomeReader>,
    book: Book,
}

impl Client {
    async fn open(settings: Settings, book: Book) -> anyhow::Result<Client> {
        let producer = Producer::new(&settings)?;
        let reader = OutcomeReader::resume(
            &settings,
            ReadOptions {
                confirmations: true,
            },
            book,
        )
        .await?;
        Ok(Client {
            settings,
            producer,
            reader: Some(reader),
            book: Book::new(),
        })
    }

    fn book(&self) -> &Book {
        match &self.reader {
            Some(r) => r.book(),
            None => &self.book,
        }
    }

    async fn poll(&mut self, quiet: Duration) {
        if let Some(r) = &mut self.reader
            && let Err(e) = r.poll(quiet).await
        {
            eprintln!("chaos: reading tx.outcomes: {e}");
        }
    }

    /// Reads until the book holds everything the broker had acknowledged on `tx.outcomes` when
    /// this was called: it produces an empty record (no `event_id`: the reader counts it
    /// unreadable, nothing downstream books it) to each partition as a barrier and reads past
    /// them. False when it could not, within `within`.
    async fn catch_up(&mut self, within: Duration) -> bool {
        use rdkafka::producer::{FutureProducer, FutureRecord};
        let topic = self.settings.topics().tx_outcomes();
        let marks = async {
            let producer: FutureProducer = self.settings.kafka().producer_config().create()?;
            let mut marks = Vec::new();
            for p in 0..PARTITIONS {
                let d = producer
                    .send(
                        FutureRecord::<[u8], [u8]>::to(&topic)
                            .partition(p)
                            .payload(&[]),
                        Duration::from_secs(10),
                    )
                    .await
                    .map_err(|(e, _)| e)?;
                marks.push((topic.clone(), d.partition, d.offset));
            }
            Ok::<_, rdkafka::error::KafkaError>(marks)
        };
        let marks = match marks.await {
            Ok(m) => m,
            Err(e) => {
                eprintln!("chaos: producing the barrier to {topic}: {e}");
                return false;
            }
        };
        match &mut self.reader {
            Some(r) => match r.read_through(&marks, within).await {
                Ok(caught) => caught,
                Err(e) => {
                    eprintln!("chaos: catching up with tx.outcomes: {e}");
                    false
                }
            },
            None => false,
        }
    }

    /// Closes the reader (before the broker goes away), keeping its book.
    fn close(&mut self) {
        if let Some(r) = self.reader.take() {
            self.book = r.into_book();
        }
    }

    async fn reopen(&mut self) -> anyhow::Result<()> {
        let book = std::mem::take(&mut self.book);
        *self = Client::open(self.settings.clone(), book).await?;
        Ok(())
    }

    /// Publishes until the broker acknowledges (an upstream retries a transient failure).
    async fn publish(&self, r: &TxRequest) -> anyhow::Result<()> {
        for _ in 0..60 {
            match self.producer.publish(r).await {
                Ok(_) => return Ok(()),
                Err(txflow_client::ClientError::Invalid(e)) => {
                    anyhow::bail!("the workload built an invalid request: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        anyhow::bail!("request {} could not be published for 30 s", r.request_id)
    }
}

/// The block clock: a block every 500 ms (anvil runs with `--no-mining`), unless a fault holds
/// the clock (it then owns the lock and mines, or not, itself).
#[derive(Clone)]
struct Miner {
    clock: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl Miner {
    const BLOCK: Duration = Duration::from_millis(500);

    fn start(provider: DynProvider) -> Miner {
        let clock = std::sync::Arc::new(tokio::sync::Mutex::new(()));
        let held = clock.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Miner::BLOCK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let _clock = held.lock().await;
                if let Err(e) = provider.anvil_mine(Some(1), None).await {
                    eprintln!("chaos: mining a block: {e}");
                }
            }
        });
        Miner { clock }
    }

    /// Holds the block clock until the guard is dropped.
    async fn hold(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.clock.lock().await
    }
}

struct System {
    logs: PathBuf,
    postgres: Daemon,
    broker: Daemon,
    registry: Daemon,
    anvil: Daemon,
    proxy: FaultProxy,
    provider: DynProvider,
    miner: Miner,
    slots: Vec<Slot>,
    env: Vec<(String, String)>,
    db_url: String,
    tools: Tools,
    /// The HTTP gateway's port on 127.0.0.1.
    gateway_port: u16,
}

impl System {
    async fn setup(&self) -> anyhow::Result<()> {
        let cmd = txflow_command(&self.tools.txflow, &["up", "--once"], &self.env);
        let log = self.logs.join("setup.log");
        let status = spawn_logged(cmd, &log)?.wait().await?;
        anyhow::ensure!(
            status.success(),
            "txflow up --once failed (log: {})",
            log.display()
        );
        Ok(())
    }

    async fn pool(&self) -> anyhow::Result<sqlx::PgPool> {
        Ok(sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&self.db_url)
            .await?)
    }
}

/// Runs the whole thing. An error is a failure to run (a tool missing, a port taken), not a
/// violation; violations are in the report.
pub async fn run(o: Options) -> anyhow::Result<Report> {
    let started = Instant::now();
    let span_ms = (o.minutes * 60_000.0) as u64;
    let schedule = Schedule::draw(
        o.seed,
        Shape {
            steps: o.steps,
            span_ms,
            processes: o.processes,
            required_confirmations: o.confirmations,
            lease_ms: o.lease_ms,
            kinds: o.kinds,
            max_reorg_depth: o.max_reorg_depth,
        },
    );
    let dir = match &o.dir {
        Some(d) => d.clone(),
        None => {
            std::env::temp_dir().join(format!("txflow-chaos-{}-{}", o.seed, std::process::id()))
        }
    };
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    std::fs::write(
        dir.join("schedule.json"),
        serde_json::to_string_pretty(&schedule)?,
    )?;
    progress(
        started,
        format!(
            "seed {} · {} steps over {:.1} min · {} requests at {}/s over {} signers · logs in {}",
            o.seed,
            o.steps,
            o.minutes,
            o.requests,
            o.rate,
            o.signers,
            logs.display()
        ),
    );

    let mut system = start_system(&o, &dir, &logs).await?;
    progress(started, "system up");
    let result = drive(&o, &schedule, &mut system, started).await;
    for s in system.slots.drain(..) {
        s.stop().await;
    }
    let verdict = match result {
        Ok(v) => v,
        Err(e) => {
            stop_daemons(&mut system).await;
            return Err(e.context(format!("seed {} (logs: {})", o.seed, logs.display())));
        }
    };
    stop_daemons(&mut system).await;
    let (verdict, last_step, converged_after) = verdict;
    let passed = verdict.violations.is_empty();
    let line = json!({
        "seed": o.seed,
        "passed": passed,
        "steps": schedule.steps.len(),
        "fault_kinds": schedule.steps.iter().map(|s| s.fault.name()).collect::<std::collections::BTreeSet<_>>(),
        "requests": verdict.requests,
        "executed": verdict.executed,
        "failed": verdict.failed,
        "booked": verdict.booked,
        "reversals": verdict.reversals,
        "events_checked": verdict.events_checked,
        "lost_with_broker": verdict.lost_with_broker,
        "lost_with_broker_events": verdict.lost_with_broker_events,
        "transfers": verdict.transfers,
        "violations": verdict.violations.len(),
        "first_violations": verdict.violations.iter().take(10).collect::<Vec<_>>(),
        "last_step": last_step,
        // From the end of the last step to every request final in PostgreSQL with no nonce gap
        // and nothing of ours in the pool (null: not within the run), against a lease and a
        // recovery scan of the pipeline's stages (every 5 s).
        "converged_s": converged_after.map(|d| (d.as_secs_f64() * 10.0).round() / 10.0),
        "lease_and_scan_s": (o.lease_ms + RECOVERY_SCAN_MS) as f64 / 1000.0,
        "elapsed_s": (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        "logs": if passed && !o.keep { serde_json::Value::Null } else { json!(logs.display().to_string()) },
    });
    if passed && !o.keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(Report { line, passed })
}

/// How the run's own spot adapter reaches the ledger (to fund the users and read balances).
fn spot_config(s: &System) -> txflow_transfer_coordinator::spot::SpotAdapterConfig {
    let topics = txflow_client::Settings {
        brokers: env_of(&s.env, "TXFLOW_BROKERS"),
        schema_registry_url: env_of(&s.env, "TXFLOW_SCHEMA_REGISTRY_URL"),
        topic_prefix: PREFIX.into(),
        chain_id: CHAIN_ID,
    };
    txflow_transfer_coordinator::spot::SpotAdapterConfig {
        kafka: topics.kafka(),
        registry_url: topics.schema_registry_url.clone(),
        commands_topic: topics.topics().spot_commands(),
        events_topic: topics.topics().spot_events(),
        timeout: Duration::from_secs(5),
    }
}

/// Starts the spot ledger and the coordinators, mints each user's token (`txflow token`, scope
/// `transfer`) and funds the users.
async fn start_transfers(
    o: &Options,
    s: &mut System,
    db: &sqlx::PgPool,
    total: u64,
) -> anyhow::Result<TransferLoad> {
    s.slots.push(Slot::start(
        s.tools.txflow.clone(),
        "spot-ledger",
        0,
        s.env.clone(),
        s.logs.join("spot-ledger-0.log"),
    ));
    for index in 0..o.processes {
        s.slots.push(Slot::start(
            s.tools.txflow.clone(),
            "transfer-coordinator",
            index,
            s.env.clone(),
            s.logs.join(format!("transfer-coordinator-{index}.log")),
        ));
    }
    let mut tokens = Vec::new();
    for user in TransferLoad::users() {
        tokens.push(mint_token(s, &user, "transfer").await?);
    }
    TransferLoad::start(o.seed, total, db, spot_config(s), s.gateway_port, tokens).await
}

/// A bearer token from `txflow token` with the run's secret, valid for a day.
async fn mint_token(s: &System, sub: &str, scope: &str) -> anyhow::Result<String> {
    let out = txflow_command(
        &s.tools.txflow,
        &["token", "--sub", sub, "--scope", scope, "--ttl", "86400"],
        &s.env,
    )
    .output()
    .await?;
    anyhow::ensure!(
        out.status.success(),
        "txflow token failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

async fn stop_daemons(s: &mut System) {
    for d in [
        &mut s.broker,
        &mut s.registry,
        &mut s.anvil,
        &mut s.postgres,
    ] {
        d.kill().await;
    }
}

async fn start_system(
    o: &Options,
    dir: &std::path::Path,
    logs: &std::path::Path,
) -> anyhow::Result<System> {
    let t = &o.tools;
    let postgres = crate::cluster::postgres(t, dir, logs).await?;
    let admin = format!("postgres://postgres@127.0.0.1:{}/postgres", postgres.port);
    let db_url = format!("postgres://postgres@127.0.0.1:{}/txflow", postgres.port);
    {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&admin)
            .await?;
        sqlx::query("CREATE DATABASE txflow").execute(&pool).await?;
        pool.close().await;
    }
    let bport = free_port()?;
    let strings = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
    let url = format!("tcp://127.0.0.1:{bport}");
    let mut broker = Daemon::program(
        "broker",
        bport,
        logs,
        t.tansu.clone(),
        strings(&[
            "broker",
            "--storage-engine",
            "memory://tansu/",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
        ]),
    );
    broker.start().await?;
    let rport = free_port()?;
    let mut registry = Daemon::program(
        "registry",
        rport,
        logs,
        t.registry.clone(),
        strings(&[
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            &rport.to_string(),
            "--compatibility",
            "BACKWARD",
        ]),
    );
    registry.start().await?;
    let aport = free_port()?;
    let mut anvil = Daemon::program(
        "anvil",
        aport,
        logs,
        t.anvil.clone(),
        strings(&[
            "--host",
            "127.0.0.1",
            "--port",
            &aport.to_string(),
            // The block clock is the run's (`Miner`): a fault can hold it.
            "--no-mining",
            "--chain-id",
            &CHAIN_ID.to_string(),
        ]),
    );
    anvil.start().await?;
    let anvil_url = format!("http://127.0.0.1:{aport}");
    let provider = ProviderBuilder::new()
        .connect_http(anvil_url.parse()?)
        .erased();
    let proxy = FaultProxy::start(&anvil_url, vec![]).await?;
    let miner = Miner::start(provider.clone());
    // The HTTP gateway the operator approves and cancels through, with a secret of the run's own
    // (beside the logs, never in them).
    let gport = free_port()?;
    let secret_file = dir.join("gateway.secret");
    {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&secret_file)
            .with_context(|| format!("creating {}", secret_file.display()))?;
        write!(
            f,
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        )?;
    }
    let env: Vec<(String, String)> = [
        ("TXFLOW_DATABASE_URL", db_url.clone()),
        ("TXFLOW_BROKERS", format!("127.0.0.1:{bport}")),
        (
            "TXFLOW_SCHEMA_REGISTRY_URL",
            format!("http://127.0.0.1:{rport}"),
        ),
        ("TXFLOW_TOPIC_PREFIX", PREFIX.to_string()),
        ("TXFLOW_PARTITIONS", PARTITIONS.to_string()),
        ("TXFLOW_RPC_URLS", proxy.url.clone()),
        ("TXFLOW_CHAIN_ID", CHAIN_ID.to_string()),
        ("TXFLOW_LEASE_MS", o.lease_ms.to_string()),
        ("TXFLOW_CONFIRMATIONS_REQUIRED", o.confirmations.to_string()),
        ("TXFLOW_FETCH_WAIT_MAX_MS", "10".to_string()),
        ("TXFLOW_RPC_TIMEOUT_MS", "2000".to_string()),
        (
            "TXFLOW_POLICY_APPROVAL_THRESHOLD_WEI",
            APPROVAL_THRESHOLD.to_string(),
        ),
        ("TXFLOW_LOG", "info".to_string()),
        ("TXFLOW_GATEWAY_ADDR", format!("127.0.0.1:{gport}")),
        (
            "TXFLOW_GATEWAY_JWT_SECRET_FILE",
            secret_file.display().to_string(),
        ),
        // The operator's one token lives as long as a soak.
        ("TXFLOW_GATEWAY_JWT_MAX_LIFETIME_SECS", "86400".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .chain(transfers::env(dir))
    .collect();
    Ok(System {
        logs: logs.to_path_buf(),
        postgres,
        broker,
        registry,
        anvil,
        proxy,
        provider,
        miner,
        slots: Vec::new(),
        env,
        db_url,
        tools: o.tools.clone(),
        gateway_port: gport,
    })
}

/// The run proper; returns the verdict and the number of the last step applied.
async fn drive(
    o: &Options,
    schedule: &Schedule,
    s: &mut System,
    started: Instant,
) -> anyhow::Result<(oracle::Verdict, Option<usize>, Option<Duration>)> {
    let mut w = Workload {
        rng: Rng::new(o.seed ^ 0x005E_ED0F_1234),
        // The workload's signers, and one more that only `reorg_while_down` uses (its last).
        keys: (0..=o.signers)
            .map(|_| PrivateKeySigner::random())
            .collect(),
        requested: Vec::new(),
        approvals: Vec::new(),
        next_id: 0,
        applied: 0,
        born: BTreeMap::new(),
    };
    for k in &w.keys {
        s.provider
            .anvil_set_balance(k.address(), U256::from(10u128.pow(22)))
            .await?;
    }
    s.setup().await?;
    let keys: Vec<String> = w
        .keys
        .iter()
        .map(|k| format!("0x{}", alloy::hex::encode(k.to_bytes())))
        .collect();
    for role in ROLES {
        for index in 0..o.processes {
            let mut env = s.env.clone();
            if role == "signer-gateway" {
                env.push(("TXFLOW_SIGNER_KEYS".into(), keys.join(",")));
            }
            s.slots.push(Slot::start(
                s.tools.txflow.clone(),
                role,
                index,
                env,
                s.logs.join(format!("{role}-{index}.log")),
            ));
        }
    }
    // One gateway, outside the schedule's roles (its draws stay what they were).
    s.slots.push(Slot::start(
        s.tools.txflow.clone(),
        "gateway",
        0,
        s.env.clone(),
        s.logs.join("gateway-0.log"),
    ));
    let operator = Operator::new(s).await?;
    let db = s.pool().await?;
    let mut load = match o.transfers {
        0 => None,
        n => Some(start_transfers(o, s, &db, n).await?),
    };
    let settings = Settings {
        brokers: env_of(&s.env, "TXFLOW_BROKERS"),
        schema_registry_url: env_of(&s.env, "TXFLOW_SCHEMA_REGISTRY_URL"),
        topic_prefix: PREFIX.into(),
        chain_id: CHAIN_ID,
    };
    let mut client = Client::open(settings, Book::new()).await?;
    // When the broker last lost its topics, and what txflow said it had delivered before.
    let mut broker_loss = BrokerLoss::default();
    let span = Duration::from_millis((o.minutes * 60_000.0) as u64);
    let mut next_step = 0;
    let mut last_step = None;
    let mut heads: Vec<(usize, u64)> = Vec::new();
    let mut last_progress = Instant::now();
    let mut last_command = Instant::now();
    let mut convergence = Convergence::default();
    let run_start = Instant::now();
    // Workload and schedule.
    loop {
        let t = run_start.elapsed();
        let due = ((t.as_secs_f64() * o.rate) as u64).min(o.requests);
        while (w.requested.len() as u64) < due {
            let value = 1 + w.rng.below(1_000);
            let r = w.request(value, None, None);
            client.publish(&r).await?;
            w.requested.push(r);
        }
        if let Some(load) = &mut load {
            load.ask_due(t.as_secs_f64() / span.as_secs_f64().max(0.001));
        }
        while let Some(step) = schedule
            .steps
            .get(next_step)
            .filter(|x| Duration::from_millis(x.at_ms) <= t)
        {
            progress(
                started,
                format!(
                    "step {} {}",
                    step.number,
                    serde_json::to_string(&step.fault)?
                ),
            );
            let head = s.provider.get_block_number().await.unwrap_or(0);
            heads.push((step.number, head));
            w.applied = step.number;
            apply(step, s, &mut client, &mut w, &db, &mut broker_loss).await?;
            w.applied = step.number + 1;
            last_step = Some(step.number);
            next_step += 1;
        }
        if next_step >= schedule.steps.len() && convergence.last_step_done.is_none() {
            convergence.last_step_done = Some(Instant::now());
        }
        convergence.look(s, &db, &w).await;
        client.poll(Duration::from_millis(50)).await;
        if last_command.elapsed() > Duration::from_secs(3) {
            operator.act(&client, &w).await;
            last_command = Instant::now();
        }
        if last_progress.elapsed() > Duration::from_secs(5) {
            progress(started, status(&client, &w));
            if let Some(load) = &load {
                progress(started, load.status(&db).await);
            }
            last_progress = Instant::now();
        }
        if t >= span && w.requested.len() as u64 >= o.requests && next_step >= schedule.steps.len()
        {
            break;
        }
    }
    // Heal: no RPC fault, nobody paused; every request must now end.
    s.proxy.set_rules(vec![]);
    s.proxy.lag_at(None);
    for slot in &s.slots {
        slot.resume();
    }
    if load.is_some() {
        transfers::restore_rules(&db).await?;
    }
    progress(started, "healed; waiting for every request to end");
    let deadline = Instant::now() + Duration::from_secs(o.settle_secs);
    let mut last_republish = Instant::now();
    let mut last_read = (client.book().outcomes_read(), Instant::now());
    let mut halted_since: Option<Instant> = None;
    loop {
        client.poll(Duration::from_millis(200)).await;
        convergence.look(s, &db, &w).await;
        let open = unfinished(&client, &w);
        let read = client.book().outcomes_read();
        if read != last_read.0 {
            last_read = (read, Instant::now());
        }
        let transfers_ended = match &load {
            None => true,
            Some(t) => t.all_answered() && t.all_ended(&db).await.unwrap_or(false),
        };
        // txflow halted transfers on a conservation alarm: they will not end on their own (an
        // operator must look), so once the pipeline is done the run is judged.
        let halted = match &load {
            Some(_) if !transfers_ended => transfers::open_alarms(&db).await.unwrap_or(0) > 0,
            _ => false,
        };
        match (halted, halted_since) {
            (true, None) => halted_since = Some(Instant::now()),
            (false, _) => halted_since = None,
            (true, Some(_)) => {}
        }
        if halted_since.is_some_and(|t| t.elapsed() > QUIET)
            && open.is_empty()
            && terminal_in_db(&db).await.unwrap_or(false)
        {
            progress(
                started,
                format!(
                    "txflow has halted transfers on a conservation alarm for {} s; judging",
                    QUIET.as_secs()
                ),
            );
            break;
        }
        if transfers_ended && terminal_in_db(&db).await.unwrap_or(false) {
            if open.is_empty() {
                break;
            }
            // Every request is final in PostgreSQL and nothing new reaches the downstream: what
            // is missing went with the broker, or was lost (the oracle tells which).
            if last_read.1.elapsed() > QUIET {
                progress(
                    started,
                    format!(
                        "every request is final in PostgreSQL; {} have no final outcome downstream and nothing new was read for {} s; judging",
                        open.len(),
                        QUIET.as_secs()
                    ),
                );
                break;
            }
        }
        if Instant::now() > deadline {
            progress(
                started,
                format!(
                    "{} requests not final after {} s; judging as is",
                    open.len(),
                    o.settle_secs
                ),
            );
            break;
        }
        if last_command.elapsed() > Duration::from_secs(3) {
            operator.act(&client, &w).await;
            last_command = Instant::now();
        }
        // An upstream republishes what it has no answer for (the broker may have lost it).
        if last_republish.elapsed() > Duration::from_secs(10) {
            for i in open.iter().copied() {
                let r = w.requested[i].clone();
                if client
                    .book()
                    .by_request(&r.signer, &r.request_id)
                    .is_empty()
                {
                    let again = TxRequest {
                        event_id: uuid::Uuid::new_v4().to_string(),
                        ..r
                    };
                    client.publish(&again).await?;
                }
            }
            last_republish = Instant::now();
        }
        if last_progress.elapsed() > Duration::from_secs(5) {
            progress(started, status(&client, &w));
            if let Some(load) = &load {
                progress(started, load.status(&db).await);
            }
            last_progress = Instant::now();
        }
    }
    // The transfers' answers, rows and balances, while the spot ledger still runs.
    let transfers_done = match load.take() {
        Some(t) => Some(t.finish(&db, spot_config(s)).await?),
        None => None,
    };
    // A last look, unthrottled: the settling may have ended between two.
    convergence.last_look = None;
    convergence.look(s, &db, &w).await;
    // Stop every role, read what is left, judge.
    for slot in s.slots.drain(..) {
        slot.stop().await;
    }
    client.poll(Duration::from_secs(2)).await;
    progress(started, "judging");
    let mut verdict = judge(s, &db, &client, &w, &broker_loss).await?;
    if let Some(f) = transfers_done {
        verdict.transfers = Some(oracle::check_transfers(
            &f.submitted,
            &f.records,
            &f.ledgers,
            f.alarms,
            &mut verdict,
        ));
    }
    for v in &mut verdict.violations {
        v.since_step = v
            .request
            .as_ref()
            .and_then(|(_, id)| w.born.get(id))
            .copied()
            .filter(|born| heads.iter().any(|(n, _)| n == born));
        v.after_step = step_followed(v, &heads, last_step);
    }
    if let Some(first) = verdict.violations.first() {
        progress(
            started,
            format!(
                "VIOLATION {} — {} (seed {}, after step {:?}, its request living through steps from {:?}; logs: {})",
                first.check,
                first.detail,
                o.seed,
                first.after_step,
                first.since_step,
                s.logs.display()
            ),
        );
    }
    Ok((verdict, last_step, convergence.after))
}

/// The schedule step a violation followed: the last applied before the block that shows it;
/// without a block, the first its request lived through; otherwise the last step applied.
fn step_followed(
    v: &oracle::Violation,
    heads: &[(usize, u64)],
    last_step: Option<usize>,
) -> Option<usize> {
    match v.block {
        Some(block) => heads
            .iter()
            .rev()
            .find(|(_, head)| *head < block)
            .map(|(n, _)| *n),
        None => v.since_step.or(last_step),
    }
}

fn env_of(env: &[(String, String)], k: &str) -> String {
    env.iter()
        .find(|(x, _)| x == k)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

fn status(client: &Client, w: &Workload) -> String {
    let book = client.book();
    let finals = book
        .views()
        .filter(|v| v.progress == Some(txflow_client::Progress::Final))
        .count();
    let booked = book.views().filter(|v| v.executed()).count();
    format!(
        "published {} · outcomes read {} · final {} (booked {})",
        w.requested.len(),
        book.outcomes_read(),
        finals,
        booked
    )
}

/// Indexes of requests whose downstream view is not final.
fn unfinished(client: &Client, w: &Workload) -> Vec<usize> {
    w.requested
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            !client
                .book()
                .by_request(&r.signer, &r.request_id)
                .iter()
                .any(|v| v.progress == Some(txflow_client::Progress::Final))
        })
        .map(|(i, _)| i)
        .collect()
}

/// Per signer of the workload: txflow's cursor, the chain's nonce at `head`, and its
/// transactions in the node's pool.
async fn nonces(
    s: &System,
    db: &sqlx::PgPool,
    w: &Workload,
    head: u64,
) -> anyhow::Result<Vec<Nonces>> {
    let content: serde_json::Value = s.provider.raw_request("txpool_content".into(), ()).await?;
    let pooled = |a: Address| -> u64 {
        ["pending", "queued"]
            .iter()
            .filter_map(|part| content.get(part).and_then(|p| p.as_object()))
            .flat_map(|by_sender| by_sender.iter())
            .filter(|(sender, _)| sender.parse::<Address>().ok() == Some(a))
            .map(|(_, txs)| txs.as_object().map_or(0, |t| t.len() as u64))
            .sum()
    };
    let mut out = Vec::new();
    for k in &w.keys {
        let a = k.address();
        let signer = format!("{a:#x}");
        let cursor: Option<i64> =
            sqlx::query_scalar("SELECT next_nonce FROM signer_nonce_cursor WHERE signer = $1")
                .bind(&signer)
                .fetch_optional(db)
                .await?;
        let chain = s.provider.get_transaction_count(a).number(head).await?;
        out.push(Nonces {
            signer,
            cursor,
            chain,
            pooled: pooled(a),
        });
    }
    Ok(out)
}

/// Every request final in PostgreSQL, no signer with a nonce gap, nothing of ours in the pool.
async fn converged(s: &System, db: &sqlx::PgPool, w: &Workload) -> anyhow::Result<bool> {
    if !terminal_in_db(db).await? {
        return Ok(false);
    }
    let head = s.provider.get_block_number().await?;
    Ok(nonces(s, db, w, head).await?.iter().all(Nonces::converged))
}

/// Watches for convergence once the last step is applied: how long after it the system first
/// [`converged`].
#[derive(Default)]
struct Convergence {
    last_step_done: Option<Instant>,
    after: Option<Duration>,
    last_look: Option<Instant>,
}

impl Convergence {
    async fn look(&mut self, s: &System, db: &sqlx::PgPool, w: &Workload) {
        let Some(done) = self.last_step_done else {
            return;
        };
        if self.after.is_some()
            || self
                .last_look
                .is_some_and(|t| t.elapsed() < Duration::from_millis(250))
        {
            return;
        }
        self.last_look = Some(Instant::now());
        // A failed look (PostgreSQL or the node away) is no answer: the next one asks again.
        if converged(s, db, w).await.unwrap_or(false) {
            self.after = Some(done.elapsed());
        }
    }
}

async fn terminal_in_db(db: &sqlx::PgPool) -> anyhow::Result<bool> {
    let open: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM managed_tx WHERE NOT {TERMINAL}"
    ))
    .fetch_one(db)
    .await?;
    Ok(open == 0)
}

/// The operator: each request waiting for an approval is approved or cancelled (sent again
/// until the request is final: an early command finds nothing to approve yet).
/// The operator: approves or cancels the requests that wait for one through the HTTP gateway,
/// with a bearer token `txflow token` minted (scopes `tx:approve:*` and `tx:cancel:*`), as a
/// person at the console would. A command for a transaction already final changes nothing.
struct Operator {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Operator {
    async fn new(s: &System) -> anyhow::Result<Operator> {
        let token = mint_token(s, "chaos-operator", "tx:approve:* tx:cancel:*").await?;
        let port = s.gateway_port;
        crate::cluster::wait_port("gateway", port, 60, &s.logs.join("gateway-0.log")).await?;
        Ok(Operator {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            url: format!("http://127.0.0.1:{port}"),
            token,
        })
    }

    async fn act(&self, client: &Client, w: &Workload) {
        for (i, kind) in &w.approvals {
            let r = &w.requested[*i];
            let views = client.book().by_request(&r.signer, &r.request_id);
            let Some(v) = views.first() else { continue };
            if v.progress == Some(txflow_client::Progress::Final) {
                continue;
            }
            let verb = match kind {
                TxCommandKind::Approve => "approve",
                _ => "cancel",
            };
            let answer = self
                .http
                .post(format!("{}/api/v1/tx/{}/{verb}", self.url, v.tx_id))
                .bearer_auth(&self.token)
                .json(&serde_json::json!({ "reason": "chaos" }))
                .send()
                .await;
            match answer {
                Ok(a) if a.status().is_success() => {}
                Ok(a) => eprintln!(
                    "chaos: {verb} {}: the gateway answered {}: {}",
                    v.tx_id,
                    a.status(),
                    a.text().await.unwrap_or_default()
                ),
                Err(e) => eprintln!("chaos: {verb} {}: {e}", v.tx_id),
            }
        }
    }
}

async fn apply(
    step: &Step,
    s: &mut System,
    client: &mut Client,
    w: &mut Workload,
    db: &sqlx::PgPool,
    broker_loss: &mut BrokerLoss,
) -> anyhow::Result<()> {
    let slot =
        |role: &str, index: usize| s.slots.iter().find(|x| x.role == role && x.index == index);
    match step.fault.clone() {
        Fault::KillRole {
            role,
            index,
            restart_ms,
        }
        | Fault::KillTransferRole {
            role,
            index,
            restart_ms,
        } => {
            if let Some(x) = slot(role, index) {
                x.kill(restart_ms);
            }
        }
        Fault::PauseRole { role, index, ms } => {
            if let Some(x) = slot(role, index) {
                x.pause(ms);
            }
        }
        Fault::KillBroker { down_ms } => {
            broker_loss.before_kill(db, client).await?;
            client.close();
            s.broker.kill().await;
            // What was recorded before this may be gone with the broker; what is recorded from
            // now on must reach the new one (the outbox relays it).
            let now: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
                .fetch_one(db)
                .await?;
            broker_loss.at = Some(now);
            tokio::time::sleep(Duration::from_millis(down_ms)).await;
            // The roles' idempotent producers do not recover from a broker that lost every
            // producer id (tansu answers UnknownProducerId for ever): the fleet is restarted,
            // as after any broker disaster (docs/chaos.md, "What it found"). The processes that
            // lived through the outage die before the new broker starts: one that joined a
            // group of the new broker and was then killed would stay that forming group's
            // leader on tansu and wedge it for good (the spot ledger, alone in its group, never
            // got a partition again in a soak). They come back once it answers.
            for x in &s.slots {
                x.kill(BROKER_RESTART_MS);
            }
            s.broker.start().await?;
            s.setup().await?;
            client.reopen().await?;
        }
        Fault::PauseBroker { ms } => pause_broker(s, client, w, db, ms).await?,
        Fault::PauseCoordinator { index, ms } => {
            if let Some(x) = slot("transfer-coordinator", index) {
                x.pause(ms);
            }
        }
        Fault::AssetRules {
            change,
            ms,
            ledger_down,
        } => {
            // With the ledger down, the rules change only once calls made meanwhile have timed
            // out (their outcomes unknown, retried), and the ledger comes back while they stand.
            let lead = match (ledger_down, slot("spot-ledger", 0)) {
                (true, Some(x)) => {
                    x.kill(RULES_LEAD_MS + ms / 2);
                    RULES_LEAD_MS
                }
                _ => 0,
            };
            let db = db.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(lead)).await;
                if let Err(e) = transfers::set_rules(&db, Some(change)).await {
                    eprintln!("chaos: {e:#}");
                    return;
                }
                tokio::time::sleep(Duration::from_millis(ms)).await;
                if let Err(e) = transfers::restore_rules(&db).await {
                    eprintln!("chaos: {e:#}");
                }
            });
        }
        Fault::KillPostgres { down_ms } => {
            s.postgres.kill().await;
            tokio::time::sleep(Duration::from_millis(down_ms)).await;
            s.postgres.start().await?;
        }
        Fault::Reorg { depth, reinclude } => {
            let again = if reinclude { Again::Spread } else { Again::No };
            reorg(s, w, depth, again).await?
        }
        Fault::ForeignNonce { hold_ms } => foreign_nonce(s, client, w, hold_ms).await?,
        Fault::ReorgWhileDown {
            role,
            depth,
            down_ms,
        } => reorg_while_down(s, client, w, db, role, depth, down_ms).await?,
        Fault::RpcErrors { ms } => rpc_for(s, ms, vec![Rule::all(3, RpcFault::Status(503))]),
        Fault::RpcTimeouts { ms } => rpc_for(
            s,
            ms,
            vec![Rule::all(4, RpcFault::Delay(Duration::from_secs(3)))],
        ),
        Fault::LostSendAnswers { ms } => rpc_for(
            s,
            ms,
            vec![Rule::on(
                "eth_sendRawTransaction",
                2,
                RpcFault::ForwardThenLose,
            )],
        ),
        Fault::LaggingHead { ms, behind } => {
            let head = s.provider.get_block_number().await?;
            s.proxy.lag_at(Some(head.saturating_sub(behind)));
            let proxy_state = s.proxy.handle();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                proxy_state.lag_at(None);
            });
        }
        Fault::Duplicates { n } => {
            for _ in 0..n {
                if w.requested.is_empty() {
                    break;
                }
                let i = w.rng.below(w.requested.len() as u64) as usize;
                let again = TxRequest {
                    event_id: uuid::Uuid::new_v4().to_string(),
                    ..w.requested[i].clone()
                };
                client.publish(&again).await?;
            }
        }
        Fault::BadRecords { n } => {
            for i in 0..n {
                let junk: Vec<u8> = (0..16 + i).map(|_| w.rng.below(256) as u8).collect();
                let key = format!("{CHAIN_ID}:{}", w.signer(0));
                if let Err(e) = client.producer.publish_raw(&key, &junk).await {
                    eprintln!("chaos: bad record not published: {e}");
                }
            }
        }
        Fault::Chained { n } => {
            let signer = w.rng.below(w.busy() as u64) as usize;
            let mut parent = None;
            for _ in 0..n {
                let r = w.request(1, parent.clone(), Some(signer));
                parent = Some(r.request_id.clone());
                client.publish(&r).await?;
                w.requested.push(r);
            }
        }
        Fault::Approvals { n } => {
            for _ in 0..n {
                let value = APPROVAL_THRESHOLD + w.rng.below(1_000);
                let r = w.request(value, None, None);
                let kind = if w.rng.chance(50) {
                    TxCommandKind::Approve
                } else {
                    TxCommandKind::Cancel
                };
                client.publish(&r).await?;
                w.requested.push(r);
                w.approvals.push((w.requested.len() - 1, kind));
            }
        }
    }
    Ok(())
}

/// A request of the quiet signer (nothing else of it in flight) is taken to CONFIRMED; every
/// process of `role` is killed; a reorg deep enough to remove its block (and at least `depth`)
/// mines it again in the lowest new block; the processes restart after `down_ms`. The
/// confirmation manager then finds its transaction undone with no other block of the signer to
/// follow from.
/// A request on every busy signer, each sent to the chain (up to 20 s), so that receipts,
/// confirmations and their events come due while the broker hangs; then the broker stopped
/// (SIGSTOP) for `ms` and continued. The workload publishes nothing meanwhile (this step holds
/// the loop); the roles live on, and keep every producer id and topic.
async fn pause_broker(
    s: &System,
    client: &Client,
    w: &mut Workload,
    db: &sqlx::PgPool,
    ms: u64,
) -> anyhow::Result<()> {
    let mut ids = Vec::new();
    for signer in 0..w.busy() {
        let value = 1 + w.rng.below(1_000);
        let r = w.request(value, None, Some(signer));
        client.publish(&r).await?;
        ids.push(r.request_id.clone());
        w.requested.push(r);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let sent: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM managed_tx WHERE request_id = ANY($1)
             AND state IN ('SUBMITTED', 'MINED', 'CONFIRMED')",
        )
        .bind(&ids)
        .fetch_one(db)
        .await
        .unwrap_or(0);
        if sent as usize >= ids.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.broker.signal(libc::SIGSTOP);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    s.broker.signal(libc::SIGCONT);
    Ok(())
}

async fn reorg_while_down(
    s: &System,
    client: &Client,
    w: &mut Workload,
    db: &sqlx::PgPool,
    role: &str,
    depth: u64,
    down_ms: u64,
) -> anyhow::Result<()> {
    let quiet = w.keys.len() - 1;
    let value = 1 + w.rng.below(1_000);
    let r = w.request(value, None, Some(quiet));
    client.publish(&r).await?;
    let request_id = r.request_id.clone();
    w.requested.push(r);
    let deadline = Instant::now() + Duration::from_secs(30);
    let block = loop {
        let mined: Option<i64> = sqlx::query_scalar(
            "SELECT mined_block_number FROM managed_tx WHERE request_id = $1 AND state = 'CONFIRMED'",
        )
        .bind(&request_id)
        .fetch_optional(db)
        .await
        .ok()
        .flatten();
        if let Some(b) = mined {
            break Some(b as u64);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for x in s.slots.iter().filter(|x| x.role == role) {
        x.kill(down_ms);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let head = s.provider.get_block_number().await?;
    let depth = match block {
        Some(b) => depth.max(head + 1 - b.min(head)),
        None => {
            eprintln!("chaos: {request_id} not confirmed within 30 s; reorging {depth} blocks");
            depth
        }
    };
    reorg(s, w, depth, Again::Lowest).await
}

/// A transaction from one of our signers that txflow did not send, at the signer's next nonce
/// on the chain, paying enough to displace txflow's own from the pool; mined in one block with
/// the block clock held for `hold_ms` (one confirmation: never final when more are required),
/// then that block is replaced by an empty one. A request for the signer is published at the
/// same time, so that txflow has a transaction at that nonce.
async fn foreign_nonce(
    s: &System,
    client: &Client,
    w: &mut Workload,
    hold_ms: u64,
) -> anyhow::Result<()> {
    use alloy::consensus::{SignableTransaction as _, TxEip1559};
    use alloy::eips::Encodable2718 as _;
    use alloy::network::TxSignerSync as _;
    use alloy::primitives::TxKind;

    let i = w.rng.below(w.busy() as u64) as usize;
    let value = 1 + w.rng.below(1_000);
    let r = w.request(value, None, Some(i));
    client.publish(&r).await?;
    w.requested.push(r);
    let key = w.keys[i].clone();
    let clock = s.miner.hold().await;
    let latest = alloy::eips::BlockId::latest();
    let nonce = s
        .provider
        .get_transaction_count(key.address())
        .block_id(latest)
        .await?;
    let mut tx = TxEip1559 {
        chain_id: CHAIN_ID as u64,
        nonce,
        gas_limit: 21_000,
        max_fee_per_gas: 1_000_000_000_000,
        max_priority_fee_per_gas: 500_000_000_000,
        to: TxKind::Call(SINK.parse()?),
        value: U256::ZERO,
        ..Default::default()
    };
    let signature = key.sign_transaction_sync(&mut tx)?;
    let signed = tx.into_signed(signature);
    let mut raw = Vec::new();
    alloy::consensus::TxEnvelope::from(signed).encode_2718(&mut raw);
    if let Err(e) = s.provider.send_raw_transaction(&raw).await {
        eprintln!("chaos: foreign transaction at nonce {nonce} not taken: {e}");
        return Ok(());
    }
    s.provider.anvil_mine(Some(1), None).await?;
    let used = s
        .provider
        .get_transaction_count(key.address())
        .block_id(latest)
        .await?;
    if used <= nonce {
        eprintln!("chaos: foreign transaction at nonce {nonce} not mined");
        return Ok(());
    }
    tokio::time::sleep(Duration::from_millis(hold_ms)).await;
    s.provider
        .anvil_reorg(ReorgOptions {
            depth: 1,
            tx_block_pairs: vec![],
        })
        .await?;
    drop(clock);
    Ok(())
}

fn rpc_for(s: &System, ms: u64, rules: Vec<Rule>) {
    s.proxy.set_rules(rules);
    let proxy = s.proxy.handle();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        proxy.set_rules(vec![]);
    });
}

/// Where a reorg mines our removed transactions again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Again {
    /// Not at all (they go back to txflow).
    No,
    /// Spread over the new blocks, at other heights than before.
    Spread,
    /// All in the lowest new block: below where they were.
    Lowest,
}

/// Replaces the last `depth` blocks; our transactions from them are mined again as `again` says.
async fn reorg(s: &System, w: &Workload, depth: u64, again_at: Again) -> anyhow::Result<()> {
    let reinclude = again_at != Again::No;
    let _clock = s.miner.hold().await;
    let head = s.provider.get_block_number().await?;
    let depth = depth.min(head.saturating_sub(1)).max(1);
    let ours: Vec<Address> = w.keys.iter().map(|k| k.address()).collect();
    let mut again = Vec::new();
    if reinclude {
        for n in head + 1 - depth..=head {
            for tx in transactions_in(s, n).await? {
                if ours.contains(&tx.inner.signer()) {
                    let raw: Option<Bytes> = s
                        .provider
                        .raw_request("eth_getRawTransactionByHash".into(), (tx.inner.tx_hash(),))
                        .await?;
                    if let Some(raw) = raw {
                        again.push(raw);
                    }
                }
            }
        }
    }
    let pairs = again
        .into_iter()
        .enumerate()
        .map(|(i, raw)| {
            let at = match again_at {
                Again::Lowest => 0,
                _ => (i as u64 + 1) % depth,
            };
            (TransactionData::Raw(raw), at)
        })
        .collect();
    s.provider
        .anvil_reorg(ReorgOptions {
            depth,
            tx_block_pairs: pairs,
        })
        .await?;
    Ok(())
}

/// The transactions of block `n` (none when the node has no such block).
async fn transactions_in(
    s: &System,
    n: u64,
) -> anyhow::Result<Vec<alloy::rpc::types::Transaction>> {
    Ok(s.provider
        .get_block_by_number(BlockNumberOrTag::Number(n))
        .full()
        .await?
        .map(|b| b.transactions.into_transactions().collect())
        .unwrap_or_default())
}

/// The event types txflow announces on `tx.outcomes` (as `tx_events` names them).
const OUTCOME_TYPES: &str =
    "('TxSubmitted', 'TxFailed', 'TxMined', 'TxReverted', 'TxConfirmed', 'TxConfirmationReverted')";

/// What the run knows of the broker's losses, for the oracle's `event_lost` check.
#[derive(Debug, Default)]
struct BrokerLoss {
    /// When the broker last lost its topics, on PostgreSQL's clock (that of
    /// `tx_events.created_at`).
    at: Option<f64>,
    /// Events txflow said the broker had acknowledged before a kill (recorded, their outbox row
    /// gone), and which the downstream reader, caught up with the broker's ends, did not hold:
    /// never delivered, whatever the kill took with it.
    acknowledged_unread: std::collections::BTreeSet<String>,
}

impl BrokerLoss {
    /// Before the broker is killed: every event recorded since the last loss whose outbox row is
    /// gone was acknowledged (the stage deletes the row only then), so it is in the log below
    /// the ends read after this; the reader, caught up with those ends, must hold it. One it
    /// does not hold was never delivered: a loss of txflow's, not the broker's. When the reader
    /// cannot catch up (a broker that does not answer), nothing is decided.
    async fn before_kill(&mut self, db: &sqlx::PgPool, client: &mut Client) -> anyhow::Result<()> {
        let acknowledged: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT e.event_id::text FROM tx_events e
             WHERE e.type IN {OUTCOME_TYPES}
               AND e.created_at > to_timestamp($1)
               AND NOT EXISTS (SELECT 1 FROM tx_outbox o WHERE o.event_id = e.event_id)"
        ))
        .bind(self.at.unwrap_or(0.0))
        .fetch_all(db)
        .await?;
        if !client.catch_up(Duration::from_secs(20)).await {
            eprintln!("chaos: the reader did not catch up with the broker before its kill");
            return Ok(());
        }
        let book = client.book();
        let listed = acknowledged.len();
        let before = self.acknowledged_unread.len();
        self.acknowledged_unread
            .extend(acknowledged.into_iter().filter(|id| !book.has_outcome(id)));
        eprintln!(
            "chaos: before the broker kill: {listed} events acknowledged per the outbox since \
             the last loss, {} of them not on the broker",
            self.acknowledged_unread.len() - before
        );
        Ok(())
    }
}

async fn judge(
    s: &System,
    db: &sqlx::PgPool,
    client: &Client,
    w: &Workload,
    broker_loss: &BrokerLoss,
) -> anyhow::Result<oracle::Verdict> {
    let ours: BTreeMap<Address, String> = w
        .keys
        .iter()
        .map(|k| (k.address(), format!("{:#x}", k.address())))
        .collect();
    let head = s.provider.get_block_number().await?;
    let mut chain = Vec::new();
    for n in 0..=head {
        for tx in transactions_in(s, n).await? {
            let Some(signer) = ours.get(&tx.inner.signer()) else {
                continue;
            };
            let input = tx.input().to_vec();
            let text = String::from_utf8_lossy(&input);
            let request_id = text.strip_prefix("txflow:").map(str::to_string);
            let receipt = s
                .provider
                .get_transaction_receipt(*tx.inner.tx_hash())
                .await?;
            chain.push(OnChain {
                signer: signer.clone(),
                nonce: tx.nonce(),
                request_id,
                success: receipt.map(|r| r.status()).unwrap_or(false),
                block: n,
            });
        }
    }
    let rows: Vec<(String, String, String, bool)> = sqlx::query_as(&format!(
        "SELECT signer, request_id, state, {TERMINAL} FROM managed_tx"
    ))
    .fetch_all(db)
    .await?;
    let recorded: Vec<Recorded> = rows
        .into_iter()
        .map(|(signer, request_id, state, terminal)| Recorded {
            signer,
            request_id,
            terminal,
            state,
        })
        .collect();
    let events: Vec<(String, String, f64)> = sqlx::query_as(&format!(
        "SELECT event_id::text, type, extract(epoch FROM created_at)::float8 FROM tx_events
             WHERE type IN {OUTCOME_TYPES}"
    ))
    .fetch_all(db)
    .await?;
    let announced: Vec<Announced> = events
        .into_iter()
        .map(|(event_id, event_type, at)| Announced {
            before_broker_loss: broker_loss.at.is_some_and(|b| at < b),
            acknowledged_unread: broker_loss.acknowledged_unread.contains(&event_id),
            event_id,
            event_type,
        })
        .collect();
    let nonces = nonces(s, db, w, head).await?;
    let requested: Vec<Requested> = w
        .requested
        .iter()
        .map(|r| Requested {
            signer: r.signer.clone(),
            request_id: r.request_id.clone(),
        })
        .collect();
    Ok(oracle::check(
        &requested,
        &chain,
        &recorded,
        &announced,
        &nonces,
        client.book(),
    ))
}
