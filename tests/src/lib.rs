//! The txflow test harness: each test gets real infrastructure of its own where it matters.
//!
//! - [`TestDb`]: a fresh PostgreSQL database with the migrations applied, dropped afterwards.
//! - [`TestTopics`]: uniquely named topics created through the admin API on the shared broker,
//!   deleted afterwards; [`unique`] names groups the same way.
//! - [`registry_url`]: the shared Schema Registry (subjects are per topic, so unique topics keep
//!   tests apart).
//! - [`AnvilNode`]: an anvil of the test's own on a free port, killed on drop.
//! - [`OwnBroker`]: a tansu broker of the test's own, for tests that restart or kill it (a restart
//!   wipes the memory engine's topics), killed on drop.
//! - [`pipeline::Pipeline`]: allocator, signer gateway and broadcaster on a chain of the test's
//!   own, with outcome readers (mined markers, PostgreSQL counts, anvil's pool).
//! - [`fake_chain::FakeChain`]: a scripted in-memory chain (`ChainClient`) for the middle tier: a
//!   stage against real PostgreSQL and broker with no node.
//! - [`fault_proxy::FaultProxy`]: a JSON-RPC proxy in front of anvil that injects HTTP errors,
//!   delays, dropped connections, JSON-RPC errors and lost responses, per method.
//! - [`otlp::OtlpReceiver`]: an in-process OTLP gRPC trace receiver that keeps each span with its
//!   resource's `service.name`.
//! - [`otlp_metrics::OtlpMetricsReceiver`]: an in-process OTLP gRPC metrics receiver that keeps
//!   each metric's name with its resource's `service.name`.
//! - [`wait_until`]: poll a condition until it holds, or fail with a message after a deadline.
//! - [`show_logs`]: the stages' warnings in the test's output.
//! - [`spawn_child`]: start a process that dies with the test process, however that ends (a
//!   timeout's SIGKILL runs no destructor, so `kill_on_drop` alone is not enough).
//!
//! A test binary that is killed leaves nothing behind: its anvils, brokers and `txflow` processes
//! die with it ([`spawn_child`]), and the databases of killed runs are dropped by the first
//! [`TestDb`] of a later run once they are two hours old.
//!
//! The shared services (PostgreSQL, broker, registry) come from the environment that
//! `deploy/local/start.sh` prints; when it is not set (a plain `cargo test`), the harness runs that
//! script itself, which starts whatever is not running.

mod anvil;
mod broker;
mod db;
pub mod fake_chain;
/// The JSON-RPC fault proxy (in txflow-chaos, which `txflow chaos` runs).
pub use txflow_chaos::fault_proxy;
mod kafka;
pub mod notices;
pub mod otlp;
pub mod otlp_metrics;
pub mod pipeline;
pub mod test_stage;
mod wait;

pub use anvil::AnvilNode;
pub use broker::OwnBroker;
pub use db::TestDb;
pub use kafka::{TestTopics, collect, group_consumer, producer, text};
pub use wait::{wait_for, wait_until};

use std::path::PathBuf;
use std::process::Command;
use std::sync::{OnceLock, mpsc};

/// Where the shared services are, and where the tools are.
#[derive(Debug, Clone)]
pub struct Services {
    /// An admin connection URL (`…/postgres`) used to create and drop test databases.
    pub pg_admin_url: String,
    pub brokers: String,
    pub registry_url: String,
    pub tansu_bin: PathBuf,
    pub anvil_bin: PathBuf,
    /// The schema registry's executable (`txflow chaos` starts one of its own).
    pub registry_bin: PathBuf,
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read_env() -> Option<Services> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    Some(Services {
        pg_admin_url: var("TXFLOW_PG_ADMIN_URL")?,
        brokers: var("TXFLOW_BROKERS")?,
        registry_url: var("TXFLOW_SCHEMA_REGISTRY_URL")?,
        tansu_bin: var("TXFLOW_TANSU_BIN")?.into(),
        anvil_bin: var("TXFLOW_ANVIL_BIN")?.into(),
        registry_bin: var("TXFLOW_REGISTRY_BIN")?.into(),
    })
}

fn start_services() -> Services {
    let script = repo_root().join("deploy/local/start.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let get = |k: &str| {
        text.lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .find(|(name, _)| *name == k)
            .map(|(_, v)| v.to_string())
            .unwrap_or_else(|| panic!("{} printed no {k}", script.display()))
    };
    Services {
        pg_admin_url: get("TXFLOW_PG_ADMIN_URL"),
        brokers: get("TXFLOW_BROKERS"),
        registry_url: get("TXFLOW_SCHEMA_REGISTRY_URL"),
        tansu_bin: get("TXFLOW_TANSU_BIN").into(),
        anvil_bin: get("TXFLOW_ANVIL_BIN").into(),
        registry_bin: get("TXFLOW_REGISTRY_BIN").into(),
    }
}

/// The shared services, started on first use if the environment does not name them.
pub fn services() -> &'static Services {
    static SERVICES: OnceLock<Services> = OnceLock::new();
    SERVICES.get_or_init(|| read_env().unwrap_or_else(start_services))
}

/// The shared Schema Registry.
pub fn registry_url() -> &'static str {
    &services().registry_url
}

/// Kafka settings for the shared broker, with the pipeline's tuning.
pub fn kafka_settings() -> txflow_core::kafka::KafkaSettings {
    txflow_core::kafka::KafkaSettings::new(services().brokers.clone())
}

/// A name no other test (or run) uses: `{prefix}-{random}`.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// The stages' logs in the test's output, shown when it fails: `TXFLOW_LOG`, by default the
/// warnings. The first call of a test binary installs it; later ones change nothing.
pub fn show_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TXFLOW_LOG")
                .unwrap_or_else(|_| "warn,librdkafka=error".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A free TCP port on 127.0.0.1 (bound and released; the caller binds it next).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local address").port()
}

/// A spawn for the spawner thread: the command, the caller's runtime (the child is registered
/// with its process driver) and where to send the result.
type SpawnRequest = (
    tokio::process::Command,
    tokio::runtime::Handle,
    mpsc::SyncSender<std::io::Result<tokio::process::Child>>,
);

/// Starts `cmd` (from within a tokio runtime) so that the child is killed (SIGKILL) when this process dies, however it dies:
/// `kill_on_drop` covers a test that ends or panics, but a test binary killed by a timeout runs
/// no destructor, and its anvil, broker or `txflow` processes would run on.
///
/// Linux `PR_SET_PDEATHSIG`, set in the child between fork and exec. The kernel sends the signal
/// when the *thread* that forked the child exits, not the process. A test's threads come and go:
/// a `#[tokio::test]` runs on a libtest thread that ends with the test, a multi-thread runtime's
/// workers are replaced when a task calls `block_in_place`, and blocking-pool threads exit after
/// 10 s idle; a child forked from one of them could be killed while the test still uses it. So
/// every child is forked by one dedicated thread that lives as long as the process and does
/// nothing else: its death is the process's death. The caller's tokio runtime is entered there
/// so that the returned [`tokio::process::Child`] belongs to the caller's runtime as usual.
///
/// Should the process die between the fork and the `prctl`, the child sees that its parent
/// changed and does not exec.
pub fn spawn_child(mut cmd: tokio::process::Command) -> std::io::Result<tokio::process::Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("txflow-tests-spawner".into())
            .spawn(move || {
                // The sender is in a static: this loop ends only with the process.
                for (mut cmd, runtime, reply) in rx {
                    let _entered = runtime.enter();
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the spawner thread");
        tx
    });
    let parent = std::process::id();
    // SAFETY: the hook runs in the forked child before exec; it only makes async-signal-safe
    // system calls (prctl, getppid) and builds errors without allocating.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died before the prctl (the child was reparented): do not run at all.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let (reply, result) = mpsc::sync_channel(1);
    // tokio's spawn needs a runtime (it would panic the spawner thread without one).
    let runtime = tokio::runtime::Handle::try_current().map_err(std::io::Error::other)?;
    spawner
        .send((cmd, runtime, reply))
        .expect("the spawner thread runs as long as the process");
    result
        .recv()
        .expect("the spawner thread answers every spawn")
}
