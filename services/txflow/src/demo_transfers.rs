//! The internal transfers of `txflow demo` (issue 18): `txflow spot-ledger`,
//! `txflow transfer-coordinator` and `txflow gateway` run as child processes of this executable
//! on the demo's topics; three users get money on both ledgers from outside and send transfers
//! through the gateway's HTTP API with tokens the demo mints:
//!
//! - alice, FUNDING → SPOT 30 and SPOT → FUNDING 10: both COMMITTED;
//! - bob, whose spot account is frozen, FUNDING → SPOT 20: the target refuses it explicitly
//!   (ACCOUNT_FROZEN), the withdrawal is refunded, ROLLED_BACK;
//! - carol, FUNDING → SPOT 15 while the spot ledger is killed (`kill -9`): the deposit's outcome
//!   is unknown, so the transfer stays in TARGET_PENDING and is retried (OUTCOME_UNKNOWN, never
//!   compensated); once the ledger is started again on its write-ahead log, COMMITTED.
//!
//! Then a table of the transfers, each user's balances on both ledgers (FUNDING from PostgreSQL,
//! SPOT from the ledger's BALANCE) and the open conservation violations (none). Every wait has a
//! deadline ([`WAIT`]). The children's logs and the ledger's write-ahead log are in a temporary
//! directory of the run; the JWT secret is a random file there, never printed.

use std::fs::{DirBuilder, OpenOptions};
use std::future::Future;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;
use sqlx::PgPool;
use tokio::process::{Child, Command};
use txflow_core::config::Config;
use txflow_core::events::SpotOp;
use txflow_core::kafka::ensure_topics;
use txflow_core::transfer::{AdapterResponse, TransferState};
use txflow_transfer_coordinator::funding::{FundingAdapter, FundingOutcome, load_assets};
use txflow_transfer_coordinator::spot::{SpotAdapter, SpotAdapterConfig, SpotCall};
use txflow_transfer_coordinator::store::trim_numeric;

/// How long any one wait of the demo may take before it fails.
const WAIT: Duration = Duration::from_secs(120);
/// How long the demo's own calls to the spot ledger wait for a reply.
const SPOT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a child has to stop after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Each user's outside movements: this much on FUNDING and on SPOT.
const FUNDING_START: &str = "100";
const SPOT_START: &str = "50";

/// The demo's temporary directory: the children's logs, the spot ledger's write-ahead log and
/// the JWT secret (the directory is private to this user: 0700).
struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    fn create(run: &str) -> anyhow::Result<WorkDir> {
        let path = std::env::temp_dir().join(format!("txflow-demo-{run}"));
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("create the demo's directory {}", path.display()))?;
        Ok(WorkDir { path })
    }

    fn wal_dir(&self) -> PathBuf {
        self.path.join("spot-wal")
    }

    fn secret_file(&self) -> PathBuf {
        self.path.join("jwt-secret")
    }

    fn log(&self, name: &str) -> PathBuf {
        self.path.join(format!("{name}.log"))
    }

    /// After a failure the logs stay (their paths were printed); the ledger's state and the
    /// secret never do.
    fn clean(&self, keep_logs: bool) {
        if keep_logs {
            let _ = std::fs::remove_dir_all(self.wal_dir());
            let _ = std::fs::remove_file(self.secret_file());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Writes a fresh random HS256 secret (the 128 hex digits of 4 random UUIDs: 488 random bits
/// from the operating system's generator) to a file only this user can read, and returns it.
fn write_secret(path: &Path) -> anyhow::Result<Vec<u8>> {
    let secret: String = (0..4)
        .map(|_| hex::encode(uuid::Uuid::new_v4().as_bytes()))
        .collect();
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create the JWT secret file {}", path.display()))?;
    file.write_all(secret.as_bytes())
        .with_context(|| format!("write the JWT secret file {}", path.display()))?;
    Ok(secret.into_bytes())
}

/// This executable, to run the children with. On Linux an executable replaced while it runs
/// (rebuilt) reads as `<path> (deleted)`: the children run the file now at `<path>`.
fn txflow_exe() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("find the txflow executable")?;
    if !exe.exists()
        && let Some(path) = exe.to_str().and_then(|p| p.strip_suffix(" (deleted)"))
    {
        return Ok(PathBuf::from(path));
    }
    Ok(exe)
}

/// A free port on the loopback interface (asked of the kernel, then released for the child).
fn free_port() -> anyhow::Result<u16> {
    let listener =
        std::net::TcpListener::bind(("127.0.0.1", 0)).context("find a free local port")?;
    Ok(listener.local_addr()?.port())
}

/// Polls `check` every 200 ms until it gives a value; fails after [`WAIT`].
async fn until<T, F, Fut>(what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{what}: not reached within {} s",
            WAIT.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Fails when a child that should be starting has exited (`exited` is its `try_wait`).
fn still_running(
    role: &str,
    exited: std::io::Result<Option<std::process::ExitStatus>>,
    log: &Path,
) -> anyhow::Result<()> {
    match exited.with_context(|| format!("check on txflow {role}"))? {
        Some(status) => anyhow::bail!(
            "txflow {role} exited ({status}) while starting; its log: {}",
            log.display()
        ),
        None => Ok(()),
    }
}

/// A transfer's row, as the table shows it.
struct Row {
    user_id: String,
    from: String,
    to: String,
    amount: String,
    state: TransferState,
    error_code: Option<String>,
    retry_count: i32,
}

/// The child processes and the clients the demo drives them with.
struct Rig<'a> {
    config: &'a Config,
    dir: &'a WorkDir,
    pool: PgPool,
    ledger: Option<Child>,
    others: Vec<(&'static str, Child)>,
    spot: Option<SpotAdapter>,
    gateway_url: String,
    secret: Vec<u8>,
    http: reqwest::Client,
}

impl Rig<'_> {
    /// `txflow <role>` with the demo's settings, its output appended to its log file.
    fn command(&self, role: &str) -> anyhow::Result<Command> {
        let exe = txflow_exe()?;
        let log = self.dir.log(role);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("open the log file {}", log.display()))?;
        let c = self.config;
        let mut cmd = Command::new(exe);
        cmd.arg(role)
            .env("TXFLOW_DATABASE_URL", &c.database_url)
            .env("TXFLOW_BROKERS", &c.kafka.brokers)
            .env("TXFLOW_SCHEMA_REGISTRY_URL", &c.schema_registry_url)
            .env("TXFLOW_TOPIC_PREFIX", &c.topics.prefix)
            .env("TXFLOW_PARTITIONS", c.partitions.to_string())
            .env("TXFLOW_CHAIN_ID", c.chain_id.to_string())
            .env("TXFLOW_SPOT_WAL_DIR", self.dir.wal_dir())
            .env("TXFLOW_SPOT_ASSETS", "USDT:6")
            .env("TXFLOW_TRANSFER_STALE_MS", "1000")
            .env("TXFLOW_SPOT_TIMEOUT_MS", "1500")
            .env("TXFLOW_TRANSFER_CHECK_INTERVAL_MS", "1000")
            // Three processes: none takes the configured metrics port or group instance id.
            .env("TXFLOW_METRICS_ADDR", "")
            .env_remove("TXFLOW_GROUP_INSTANCE_ID")
            .env_remove("TXFLOW_FAULT")
            .stdin(Stdio::null())
            .stdout(file.try_clone().context("share the log file")?)
            .stderr(file)
            .kill_on_drop(true);
        Ok(cmd)
    }

    fn spawn(&self, role: &str) -> anyhow::Result<Child> {
        self.command(role)?
            .spawn()
            .with_context(|| format!("start txflow {role}"))
    }

    fn spot(&self) -> anyhow::Result<&SpotAdapter> {
        self.spot
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the demo's spot adapter is not started"))
    }

    /// Starts `txflow spot-ledger` (on the run's write-ahead log) and waits until it answers.
    async fn start_ledger(&mut self) -> anyhow::Result<()> {
        let mut child = self.spawn("spot-ledger")?;
        let spot = self.spot()?;
        let log = self.dir.log("spot-ledger");
        until("the spot ledger answers", || {
            let exited = child.try_wait();
            let log = &log;
            async move {
                still_running("spot-ledger", exited, log)?;
                let req = format!("demo-ready-{}", uuid::Uuid::new_v4().simple());
                let answer = spot.balance(&req, "demo-nobody", "USDT").await;
                Ok((answer.response == AdapterResponse::Success).then_some(()))
            }
        })
        .await?;
        self.ledger = Some(child);
        Ok(())
    }

    /// `kill -9` of the spot ledger.
    async fn kill_ledger(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.ledger.take() {
            child.kill().await.context("kill -9 the spot ledger")?;
        }
        Ok(())
    }

    /// Starts the coordinator and the gateway (on a free port) and waits for the gateway.
    async fn start_coordinator_and_gateway(&mut self) -> anyhow::Result<()> {
        let coordinator = self.spawn("transfer-coordinator")?;
        self.others.push(("transfer-coordinator", coordinator));
        let addr = format!("127.0.0.1:{}", free_port()?);
        let mut cmd = self.command("gateway")?;
        cmd.env("TXFLOW_GATEWAY_ADDR", &addr)
            .env("TXFLOW_GATEWAY_JWT_ALG", "HS256")
            .env("TXFLOW_GATEWAY_JWT_SECRET_FILE", self.dir.secret_file());
        let mut gateway = cmd.spawn().context("start txflow gateway")?;
        self.gateway_url = format!("http://{addr}");
        let (http, url, log) = (&self.http, &self.gateway_url, self.dir.log("gateway"));
        until("the gateway answers /healthz", || {
            let exited = gateway.try_wait();
            let log = &log;
            async move {
                still_running("gateway", exited, log)?;
                let ok = http
                    .get(format!("{url}/healthz"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == reqwest::StatusCode::OK);
                Ok(ok.then_some(()))
            }
        })
        .await?;
        self.others.push(("gateway", gateway));
        Ok(())
    }

    /// SIGTERM to every child, then SIGKILL to those still running after [`STOP_GRACE`].
    async fn stop(&mut self) {
        let mut children: Vec<(&str, Child)> = self.others.drain(..).collect();
        if let Some(ledger) = self.ledger.take() {
            children.push(("spot-ledger", ledger));
        }
        for (_, child) in &children {
            if let Some(pid) = child.id().and_then(|p| libc::pid_t::try_from(p).ok()) {
                // SAFETY: kill(2) with a pid of our own running child (not yet reaped, so
                // not reused) and a valid signal number; no memory is involved.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
        }
        for (name, mut child) in children {
            if tokio::time::timeout(STOP_GRACE, child.wait())
                .await
                .is_err()
            {
                eprintln!("txflow {name} did not stop within {STOP_GRACE:?} of SIGTERM: killed");
                let _ = child.kill().await;
            }
        }
    }

    /// An end user's HS256 token for `user` (scope `transfer`), valid for 10 minutes.
    fn token(&self, user: &str) -> anyhow::Result<String> {
        txflow_gateway::auth::mint_hs256(
            &self.secret,
            &txflow_gateway::auth::Mint {
                sub: user,
                scope: txflow_gateway::auth::SCOPE_TRANSFER,
                ttl_secs: 600,
                audience: txflow_core::config::DEFAULT_JWT_AUDIENCE,
                issuer: txflow_core::config::DEFAULT_JWT_ISSUER,
                kid: None,
            },
        )
        .context("mint a token")
    }

    /// `user`'s outside movements: money put into both ledgers from outside.
    async fn fund(&self, user: &str, run: &str) -> anyhow::Result<()> {
        let funding = FundingAdapter::new(self.pool.clone());
        let outcome = funding
            .external_movement(
                &format!("demo-{run}-deposit-{user}"),
                user,
                "USDT",
                FUNDING_START,
                "txflow demo deposit",
            )
            .await?;
        anyhow::ensure!(
            matches!(
                outcome,
                FundingOutcome::Applied | FundingOutcome::AlreadyApplied
            ),
            "the FUNDING deposit for {user} was refused: {outcome:?}"
        );
        let req = format!("demo-{run}-credit-{user}");
        let call = SpotCall {
            req_id: &req,
            user_id: user,
            asset: "USDT",
            amount: SPOT_START,
        };
        let answer = self.spot()?.external(&call, SpotOp::Credit).await;
        anyhow::ensure!(
            answer.response == AdapterResponse::Success,
            "the SPOT credit for {user} was not applied: {:?}",
            answer.response
        );
        Ok(())
    }

    /// Freezes `user`'s spot account (the ledger's admin path).
    async fn freeze(&self, user: &str, run: &str) -> anyhow::Result<()> {
        let answer = self
            .spot()?
            .set_frozen(&format!("demo-{run}-freeze-{user}"), user, true)
            .await;
        anyhow::ensure!(
            answer.response == AdapterResponse::Success,
            "freezing {user}'s spot account failed: {:?}",
            answer.response
        );
        Ok(())
    }

    /// POST /api/v1/internal_transfer as `user`; returns the new transfer's req_id.
    async fn submit(
        &self,
        user: &str,
        from: &str,
        to: &str,
        amount: &str,
    ) -> anyhow::Result<String> {
        let response = self
            .http
            .post(format!("{}/api/v1/internal_transfer", self.gateway_url))
            .bearer_auth(self.token(user)?)
            .json(&json!({"from": from, "to": to, "asset": "USDT", "amount": amount}))
            .send()
            .await
            .context("POST /api/v1/internal_transfer")?;
        let status = response.status();
        let body: serde_json::Value = response
            .json()
            .await
            .with_context(|| format!("read the gateway's answer ({status})"))?;
        anyhow::ensure!(
            status == reqwest::StatusCode::ACCEPTED,
            "the gateway answered {status} to {user}'s transfer: {body}"
        );
        body["req_id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("the gateway's answer has no req_id: {body}"))
    }

    async fn row(&self, req_id: &str) -> anyhow::Result<Row> {
        type Columns = (String, String, String, String, i16, Option<String>, i32);
        let (user_id, from, to, amount, state, error_code, retry_count): Columns = sqlx::query_as(
            "SELECT user_id, source_account, target_account, amount::text, state, \
                 error_code, retry_count FROM transfers WHERE req_id = $1",
        )
        .bind(req_id)
        .fetch_one(&self.pool)
        .await
        .with_context(|| format!("read transfer {req_id}"))?;
        Ok(Row {
            user_id,
            from,
            to,
            amount: trim_numeric(&amount).to_string(),
            state: TransferState::from_id(state)
                .map_err(|e| anyhow::anyhow!("transfer {req_id} has an unknown state {}", e.0))?,
            error_code,
            retry_count,
        })
    }

    /// Waits for `req_id` to reach `want`; a transfer that ends elsewhere fails the demo at once.
    async fn reaches(&self, req_id: &str, want: TransferState) -> anyhow::Result<Row> {
        until(&format!("transfer {req_id} reaches {want}"), || async {
            let row = self.row(req_id).await?;
            if row.state == want {
                return Ok(Some(row));
            }
            anyhow::ensure!(
                !row.state.is_terminal(),
                "transfer {req_id} ended in {} ({}) instead of {want}",
                row.state,
                row.error_code.as_deref().unwrap_or("no code")
            );
            Ok(None)
        })
        .await
    }

    async fn funding_balance(&self, user: &str) -> anyhow::Result<String> {
        let balance = FundingAdapter::new(self.pool.clone())
            .balance(user, "USDT")
            .await?
            .ok_or_else(|| anyhow::anyhow!("{user} has no FUNDING account"))?;
        Ok(balance.available.normalize().to_string())
    }

    async fn spot_balance(&self, user: &str) -> anyhow::Result<String> {
        let balance = self
            .spot()?
            .read_balance(user, "USDT")
            .await
            .with_context(|| format!("read {user}'s SPOT balance"))?;
        Ok(balance.balance.normalize().to_string())
    }
}

/// Runs the transfers part of the demo on `config` (the demo's topics and database); `run` is
/// the demo's run id. The children are stopped and the temporary files removed whatever happens.
pub async fn run(config: &Config, run: &str) -> anyhow::Result<()> {
    println!("\ntransfers: spot ledger, transfer coordinator and gateway as child processes");
    let dir = WorkDir::create(run)?;
    let pool = txflow_core::db::connect(&config.database_url, 4).await?;
    let mut rig = Rig {
        config,
        dir: &dir,
        pool,
        ledger: None,
        others: Vec::new(),
        spot: None,
        gateway_url: String::new(),
        secret: Vec::new(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .context("build the HTTP client")?,
    };
    let result = transfers(&mut rig, run).await;
    rig.stop().await;
    if let Some(spot) = rig.spot.take() {
        spot.close().await;
    }
    rig.pool.close().await;
    dir.clean(result.is_err());
    if result.is_err() {
        println!("the children's logs are kept in {}", dir.path.display());
    }
    result
}

async fn transfers(rig: &mut Rig<'_>, run: &str) -> anyhow::Result<()> {
    let config = rig.config;
    sqlx::query(
        "INSERT INTO assets (asset, places, min_amount, max_amount) \
         VALUES ('USDT', 6, 0.000001, 1000000000) ON CONFLICT DO NOTHING",
    )
    .execute(&rig.pool)
    .await
    .context("add the USDT asset")?;
    ensure_topics(&config.kafka, &config.topics.transfers(), config.partitions).await?;
    rig.secret = write_secret(&rig.dir.secret_file())?;
    for role in ["spot-ledger", "transfer-coordinator", "gateway"] {
        println!("  txflow {role}: log in {}", rig.dir.log(role).display());
    }
    let assets = load_assets(&rig.pool).await?;
    let spot_config = SpotAdapterConfig {
        timeout: SPOT_CALL_TIMEOUT,
        ..SpotAdapterConfig::from_config(config)
    };
    rig.spot = Some(SpotAdapter::start(spot_config, assets).await?);
    rig.start_ledger().await?;
    rig.start_coordinator_and_gateway().await?;

    let [alice, bob, carol] = ["alice", "bob", "carol"].map(|n| format!("demo-{run}-{n}"));
    for user in [&alice, &bob, &carol] {
        rig.fund(user, run).await?;
    }
    println!(
        "  each user: {FUNDING_START} USDT on FUNDING, {SPOT_START} USDT on SPOT (outside movements)"
    );

    let mut sent: Vec<String> = Vec::new();
    // Both directions commit.
    let t = rig.submit(&alice, "FUNDING", "SPOT", "30").await?;
    rig.reaches(&t, TransferState::Committed).await?;
    sent.push(t);
    let t = rig.submit(&alice, "SPOT", "FUNDING", "10").await?;
    rig.reaches(&t, TransferState::Committed).await?;
    sent.push(t);

    // An explicit failure at the target: compensated, rolled back.
    rig.freeze(&bob, run).await?;
    println!("  bob's spot account frozen");
    let t = rig.submit(&bob, "FUNDING", "SPOT", "20").await?;
    rig.reaches(&t, TransferState::RolledBack).await?;
    sent.push(t);

    // An unknown outcome at the target: it stays, retried, until the ledger answers.
    rig.kill_ledger().await?;
    println!("  spot ledger killed (kill -9)");
    let t = rig.submit(&carol, "FUNDING", "SPOT", "15").await?;
    let stuck = until(
        &format!("transfer {t} is retried in TARGET_PENDING"),
        || async {
            let row = rig.row(&t).await?;
            anyhow::ensure!(
                matches!(
                    row.state,
                    TransferState::Init
                        | TransferState::SourcePending
                        | TransferState::SourceDone
                        | TransferState::TargetPending
                ),
                "transfer {t} moved to {} while the spot ledger was down",
                row.state
            );
            Ok((row.state == TransferState::TargetPending
                && row.retry_count >= 1
                && row.error_code.as_deref() == Some("OUTCOME_UNKNOWN"))
            .then_some(row))
        },
    )
    .await?;
    println!(
        "  carol's transfer while the ledger is down: {} (retry_count {}, error_code {})",
        stuck.state,
        stuck.retry_count,
        stuck.error_code.as_deref().unwrap_or("-")
    );
    rig.start_ledger().await?;
    println!("  spot ledger started again on its write-ahead log");
    rig.reaches(&t, TransferState::Committed).await?;
    sent.push(t);

    println!(
        "\n{:<10} {:<6} {:<16} {:>6} {:<13} {:<16} {:>7}",
        "req_id", "user", "from → to", "amount", "state", "error code", "retries"
    );
    for req_id in &sent {
        let row = rig.row(req_id).await?;
        // The end of the id: a UUID v7 begins with its timestamp, the same for all of these.
        let short = &req_id[req_id.len().saturating_sub(8)..];
        println!(
            "…{short:<9} {:<6} {:<16} {:>6} {:<13} {:<16} {:>7}",
            short_name(&row.user_id),
            format!("{} → {}", row.from, row.to),
            row.amount,
            row.state.as_str(),
            row.error_code.as_deref().unwrap_or("-"),
            row.retry_count
        );
    }
    println!("\n{:<6} {:>8} {:>8}", "user", "FUNDING", "SPOT");
    for user in [&alice, &bob, &carol] {
        println!(
            "{:<6} {:>8} {:>8}",
            short_name(user),
            rig.funding_balance(user).await?,
            rig.spot_balance(user).await?
        );
    }
    let (open,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM transfer_conservation_violations WHERE resolved_at IS NULL",
    )
    .fetch_one(&rig.pool)
    .await
    .context("count the open conservation violations")?;
    println!("open conservation violations: {open}");
    anyhow::ensure!(
        open == 0,
        "the conservation check found {open} violation(s)"
    );
    Ok(())
}

/// `demo-{run}-alice` → `alice`.
fn short_name(user: &str) -> &str {
    user.rsplit('-').next().unwrap_or(user)
}
