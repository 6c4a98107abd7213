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
//! - [`wait_until`]: poll a condition until it holds, or fail with a message after a deadline.
//!
//! The shared services (PostgreSQL, broker, registry) come from the environment that
//! `deploy/local/start.sh` prints; when it is not set (a plain `cargo test`), the harness runs that
//! script itself, which starts whatever is not running.

mod anvil;
mod broker;
mod db;
pub mod fake_chain;
pub mod fault_proxy;
mod kafka;
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
use std::sync::OnceLock;

/// Where the shared services are, and where the tools are.
#[derive(Debug, Clone)]
pub struct Services {
    /// An admin connection URL (`…/postgres`) used to create and drop test databases.
    pub pg_admin_url: String,
    pub brokers: String,
    pub registry_url: String,
    pub tansu_bin: PathBuf,
    pub anvil_bin: PathBuf,
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

/// A free TCP port on 127.0.0.1 (bound and released; the caller binds it next).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local address").port()
}
