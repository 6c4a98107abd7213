//! The typed configuration shared by every role: built-in defaults, overridden by a TOML file
//! (`txflow --config`, see `config_file`), then by `TXFLOW_*` environment variables, then by
//! command-line flags in the binary. Loaded once in `main` and passed down; there is no global
//! configuration.

use std::env;

use crate::kafka::{KafkaSettings, Topics};
use crate::retry::{Classify, Retry};

/// `Debug` is written by hand: it shows the database URL without its password and the RPC
/// endpoints as `scheme://host:port` (their paths and queries may hold API keys).
#[derive(Clone, PartialEq, Eq)]
pub struct Config {
    /// `TXFLOW_DATABASE_URL`
    pub database_url: String,
    /// `TXFLOW_BROKERS`, `TXFLOW_FETCH_WAIT_MAX_MS`, `TXFLOW_TOPIC_REPLICATION_FACTOR` and the
    /// consumer group settings `TXFLOW_GROUP_SESSION_TIMEOUT_MS`, `TXFLOW_GROUP_HEARTBEAT_MS`,
    /// `TXFLOW_GROUP_INSTANCE_ID` (see [`KafkaSettings`]).
    pub kafka: KafkaSettings,
    /// `TXFLOW_SCHEMA_REGISTRY_URL`
    pub schema_registry_url: String,
    /// `TXFLOW_TOPIC_PREFIX`
    pub topics: Topics,
    /// `TXFLOW_PARTITIONS`: partitions per topic when txflow creates them.
    pub partitions: i32,
    /// `TXFLOW_RPC_URLS`: comma-separated JSON-RPC endpoints of the chain.
    pub rpc_urls: Vec<String>,
    /// `TXFLOW_CHAIN_ID`: the chain this deployment serves.
    pub chain_id: i64,
    /// `TXFLOW_SIGNER_KEYS`: comma-separated hex private keys for the local signer. A secret:
    /// never printed (its `Debug` is redacted).
    pub signer_keys: Secret,
    /// `TXFLOW_SIGNER_KEYS_FILE` (`signer.keys_file`): a file holding the signer keys in the
    /// format of `TXFLOW_SIGNER_KEYS` (commas or line breaks between keys), read when the
    /// configuration is loaded, so that a key never has to be written into a configuration file or
    /// a process's environment. Setting one of the two clears the other.
    pub signer_keys_file: Option<std::path::PathBuf>,
    /// `TXFLOW_POLICY_WHITELIST`: comma-separated destination addresses; empty allows any.
    pub policy_whitelist: Vec<String>,
    /// `TXFLOW_POLICY_MAX_VALUE_WEI`: refuse transactions above this value (decimal wei).
    pub policy_max_value_wei: Option<String>,
    /// `TXFLOW_POLICY_APPROVAL_THRESHOLD_WEI`: at or above this value, wait for an approval.
    pub policy_approval_threshold_wei: Option<String>,
    /// `TXFLOW_NODE_NAME`: a readable name for this process in `signer_lease.owner_node`. The
    /// node id is always `{name}/{pid}/{random}`, unique per process start, so that a restarted
    /// process never inherits the fencing token of its previous life. Defaults to the host name.
    pub node_name: Option<String>,
    /// `TXFLOW_GROUP_PREFIX`: consumer groups are `{group prefix}.{stage}`; defaults to the topic
    /// prefix. Two deployments reading the same topics need different group prefixes.
    pub group_prefix: Option<String>,
    /// `TXFLOW_LEASE_MS`: how long a signer lease lasts without renewal. Renewal runs every third
    /// of it; a process paused for twice as long has its PostgreSQL session ended.
    pub lease_ms: u64,
    /// `TXFLOW_SIGNER_KEYSTORE`: an encrypted JSON keystore file (Web3 Secret Storage), or a
    /// directory of them, for the signer gateway's local keys.
    pub signer_keystore: Option<std::path::PathBuf>,
    /// `TXFLOW_SIGNER_KEYSTORE_PASSWORD_FILE`: the file holding the keystores' password. A secret
    /// path's content is never printed.
    pub signer_keystore_password_file: Option<std::path::PathBuf>,
    /// `TXFLOW_RESUBMIT_INTERVAL_MS`: a submitted transaction not mined after this long is sent
    /// again (the node may have dropped it).
    pub resubmit_interval_ms: u64,
    /// `resubmit.bump_after_ms` (`TXFLOW_BUMP_AFTER_MS`, default 60000): a submitted transaction
    /// at the head of its signer's queue (the chain's nonce is its own) whose latest attempt has
    /// waited this long is signed again at the same nonce with higher fees (a gas bump).
    pub bump_after_ms: u64,
    /// `resubmit.bump_percent` (`TXFLOW_BUMP_PERCENT`, default 10, at least 10): by how much a gas
    /// bump raises both EIP-1559 caps at least; 10 is geth's replacement minimum, below it a
    /// node refuses the replacement as underpriced.
    pub bump_percent: u32,
    /// `nonce.state_timeout_ms` (`TXFLOW_NONCE_STATE_TIMEOUT_MS`, default 30000): the allocator
    /// aligns a signer's nonce cursor with the chain's nonce at its last final block when the
    /// cursor was last aligned longer ago than this.
    pub nonce_state_timeout_ms: u64,
    /// `nonce.max_in_flight` (`TXFLOW_MAX_IN_FLIGHT`, default 64): at most this many nonces of
    /// a signer are allocated and not yet mined (ALLOCATED, SIGNED, SUBMITTED); above it the
    /// allocator leaves requests waiting without a nonce, so that a stalled chain does not turn
    /// into thousands of queued nonces.
    pub max_in_flight: u32,
    /// `approval.timeout_ms` (`TXFLOW_APPROVAL_TIMEOUT_MS`, default 86400000, a day): a transaction
    /// in PENDING_APPROVAL longer than this fails with `APPROVAL_TIMEOUT`.
    pub approval_timeout_ms: u64,
    /// `approval.after_deep_reorg` (`TXFLOW_APPROVAL_AFTER_DEEP_REORG`, default false): a
    /// request whose confirmed transaction a reorg deeper than the required confirmations undid
    /// (its nonce taken by another transaction) is simulated and checked against the policy
    /// again before it gets a new nonce (seed 000 §4.4); with this set it then waits for an
    /// approval (PENDING_APPROVAL, the reason in its audit row) instead of being sent again.
    pub approval_after_deep_reorg: bool,
    /// An RPC call without an answer after this long has failed and is retried
    /// (`TXFLOW_RPC_TIMEOUT_MS`, default 10000).
    pub rpc_timeout_ms: u64,
    /// Rounds over the RPC endpoints before a call fails (`TXFLOW_RPC_ATTEMPTS`, default 4).
    pub rpc_attempts: u32,
    /// `TXFLOW_ASSIGNMENT_TIMEOUT_MS`: a stage that has held no partition of its input for this
    /// long logs an ERROR naming its consumer group (again every such period while it lasts) and
    /// keeps trying. Default 60000.
    pub assignment_timeout_ms: u64,
    /// `confirmations.receipt_workers` (`TXFLOW_RECEIPT_WORKERS`, default 10): how many
    /// `eth_getTransactionReceipt` lookups the receipt checker runs at once.
    pub receipt_workers: usize,
    /// `confirmations.stale_receipt_timeout_ms` (`TXFLOW_STALE_RECEIPT_TIMEOUT_MS`, default 60000):
    /// how long the signer's nonce must be past a submitted transaction's, with no receipt for any
    /// of its hashes, before the receipt checker looks for the proof that it was REPLACED.
    pub stale_receipt_timeout_ms: u64,
    /// `confirmations.required` (`TXFLOW_CONFIRMATIONS_REQUIRED`, default 12): how many blocks,
    /// the transaction's own included, make it final (CONFIRMED, TxConfirmed).
    pub confirmations_required: u32,
    /// `fees.max_fee_per_gas_wei` (`TXFLOW_MAX_FEE_PER_GAS_WEI`, default 10^12 = 1,000 gwei): the most
    /// txflow offers per gas (both EIP-1559 caps) for a transaction it prices on its own — the
    /// defensive cancellation after a deep reorg, whose fees are raised well above the original's
    /// and the market's, and the gas bumps of stuck transactions (at it: the critical alert
    /// `gas_bump_at_cap`, and the latest attempt resent unraised).
    pub max_fee_per_gas_wei: u128,
    /// `TXFLOW_LOG` (`log.filter`, default `info`): a `tracing` filter (`info`,
    /// `txflow_core=debug,info`, …); one that does not parse falls back to `info`.
    pub log_filter: String,
    /// `TXFLOW_LOG_FORMAT` (`log.format`): `json` for one JSON object per line, anything else text.
    pub log_json: bool,
    /// `TXFLOW_METRICS_ADDR` (`metrics.addr`, default unset: no server): the address of the HTTP
    /// server of `/metrics`, `/healthz` and `/readyz` (e.g. `0.0.0.0:9464`) every role process
    /// and `txflow up` start.
    pub metrics_addr: Option<String>,
    /// `TXFLOW_METRICS_SAMPLE_MS` (`metrics.sample_ms`, default 5000): how often a role process
    /// samples its gauges (transactions by state, signer holds, outbox backlog, consumer lag,
    /// leases held).
    pub metrics_sample_ms: u64,
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (`telemetry.otlp_endpoint`, default unset: no trace export):
    /// the OTLP gRPC endpoint traces are exported to (e.g. `http://otel-collector:4317`);
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, read by [`crate::otel::decide`], is above it.
    pub otlp_endpoint: Option<String>,
    /// `OTEL_SERVICE_NAME` (`telemetry.service_name`, default unset: `txflow-<role>`, `txflow`
    /// for `up` and the tools): the `service.name` of exported traces.
    pub otel_service_name: Option<String>,
    /// `spot.wal_dir` (`TXFLOW_SPOT_WAL_DIR`, default [`DEFAULT_SPOT_WAL_DIR`]): the spot
    /// ledger's directory of its write-ahead log (`spot.wal`) and lock file (`LOCK`).
    pub spot_wal_dir: std::path::PathBuf,
    /// `spot.assets` (`TXFLOW_SPOT_ASSETS`, `CODE:PLACES,…`, default [`DEFAULT_SPOT_ASSETS`]):
    /// the assets the spot ledger holds and the decimal places each allows.
    pub spot_assets: SpotAssets,
    /// `spot.timeout_ms` (`TXFLOW_SPOT_TIMEOUT_MS`, default 5000): how long the transfer
    /// coordinator's SPOT adapter waits for the spot ledger's reply (the produce included)
    /// before it answers TIMEOUT — outcome unknown, retried, never compensated.
    pub spot_timeout_ms: u64,
    /// `transfer.stale_ms` (`TXFLOW_TRANSFER_STALE_MS`, default 60000; seed 004 §6.2): how long
    /// an open transfer must have stood still before the coordinator's recovery worker resumes
    /// it, and so how often an unknown outcome (TIMEOUT, NETWORK_ERROR, UNKNOWN) is retried.
    pub transfer_stale_ms: u64,
    /// `transfer.check_interval_ms` (`TXFLOW_TRANSFER_CHECK_INTERVAL_MS`, default 10000; seed 004
    /// §7.2): how often the coordinator runs the conservation check.
    pub transfer_check_interval_ms: u64,
    /// `gateway.*` (`TXFLOW_GATEWAY_*`): the HTTP gateway's address, JWT verification and rate
    /// limit (see [`GatewaySettings`]).
    pub gateway: GatewaySettings,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rpc: Vec<String> = self
            .rpc_urls
            .iter()
            .map(|u| crate::chain::redact(u))
            .collect();
        f.debug_struct("Config")
            .field("database_url", &redact_database_url(&self.database_url))
            .field("kafka", &self.kafka)
            .field(
                "schema_registry_url",
                &crate::chain::redact(&self.schema_registry_url),
            )
            .field("topics", &self.topics)
            .field("partitions", &self.partitions)
            .field("rpc_urls", &rpc)
            .field("chain_id", &self.chain_id)
            .field("signer_keys", &self.signer_keys)
            .field("signer_keys_file", &self.signer_keys_file)
            .field("policy_whitelist", &self.policy_whitelist)
            .field("policy_max_value_wei", &self.policy_max_value_wei)
            .field(
                "policy_approval_threshold_wei",
                &self.policy_approval_threshold_wei,
            )
            .field("node_name", &self.node_name)
            .field("group_prefix", &self.group_prefix)
            .field("lease_ms", &self.lease_ms)
            .field("signer_keystore", &self.signer_keystore)
            .field(
                "signer_keystore_password_file",
                &self.signer_keystore_password_file,
            )
            .field("resubmit_interval_ms", &self.resubmit_interval_ms)
            .field("bump_after_ms", &self.bump_after_ms)
            .field("bump_percent", &self.bump_percent)
            .field("nonce_state_timeout_ms", &self.nonce_state_timeout_ms)
            .field("max_in_flight", &self.max_in_flight)
            .field("approval_timeout_ms", &self.approval_timeout_ms)
            .field("approval_after_deep_reorg", &self.approval_after_deep_reorg)
            .field("rpc_timeout_ms", &self.rpc_timeout_ms)
            .field("rpc_attempts", &self.rpc_attempts)
            .field("assignment_timeout_ms", &self.assignment_timeout_ms)
            .field("receipt_workers", &self.receipt_workers)
            .field("stale_receipt_timeout_ms", &self.stale_receipt_timeout_ms)
            .field("confirmations_required", &self.confirmations_required)
            .field("max_fee_per_gas_wei", &self.max_fee_per_gas_wei)
            .field("log_filter", &self.log_filter)
            .field("log_json", &self.log_json)
            .field("metrics_addr", &self.metrics_addr)
            .field("metrics_sample_ms", &self.metrics_sample_ms)
            .field(
                "otlp_endpoint",
                &self.otlp_endpoint.as_deref().map(crate::chain::redact),
            )
            .field("otel_service_name", &self.otel_service_name)
            .field("spot_wal_dir", &self.spot_wal_dir)
            .field("spot_assets", &self.spot_assets)
            .field("spot_timeout_ms", &self.spot_timeout_ms)
            .field("transfer_stale_ms", &self.transfer_stale_ms)
            .field(
                "transfer_check_interval_ms",
                &self.transfer_check_interval_ms,
            )
            .field("gateway", &self.gateway)
            .finish()
    }
}

/// A database URL as it may be printed: the password (if any) replaced by `***`, in the user
/// information and in a `password=` query parameter (which libpq and sqlx accept too).
pub fn redact_database_url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let base = match (base.find("://"), base.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &base[scheme + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &base[..scheme + 3], &base[at..]),
                None => base.to_string(),
            }
        }
        _ => base.to_string(),
    };
    match query {
        None => base,
        Some(query) => {
            let params: Vec<&str> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => "password=***",
                    _ => p,
                })
                .collect();
            format!("{base}?{}", params.join("&"))
        }
    }
}

/// A secret value whose `Debug` never shows it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }
    /// The value, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() {
            "Secret(empty)"
        } else {
            "Secret(***)"
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{var}={value:?} is not valid: {why}")]
    Invalid {
        var: &'static str,
        value: String,
        why: &'static str,
    },
    /// A value of the configuration file that its type accepts but the setting does not (the
    /// same rule as its environment variable's).
    #[error("{key}: invalid value {value:?}: {why}")]
    InvalidKey {
        key: &'static str,
        value: String,
        why: &'static str,
    },
    /// A key the file does not know, or a value of the wrong type, at `key` (dotted path). The
    /// TOML error is kept, but not as the source: its message is this one's, and the chain of
    /// sources would print it twice.
    #[error("{}: {key}: {}", at_line(path, *line), error.message())]
    Key {
        path: std::path::PathBuf,
        line: Option<usize>,
        key: String,
        error: Box<toml::de::Error>,
    },
    /// An error of the file at `path` (a value refused by its setting's rule).
    #[error("{}", path.display())]
    File {
        path: std::path::PathBuf,
        #[source]
        source: Box<ConfigError>,
    },
    #[error("{}: not valid TOML", path.display())]
    Syntax {
        path: std::path::PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("cannot read {what} {}", path.display())]
    Read {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `path:line`, or `path` when the line is not known.
fn at_line(path: &std::path::Path, line: Option<usize>) -> String {
    match line {
        Some(line) => format!("{}:{line}", path.display()),
        None => path.display().to_string(),
    }
}

impl Classify for ConfigError {
    fn retry(&self) -> Retry {
        Retry::Permanent
    }
}

/// The default of `fees.max_fee_per_gas_wei`: 1,000 gwei per gas (a 21,000-gas cancellation costs at
/// most 0.021 ETH).
pub const DEFAULT_MAX_FEE_PER_GAS_WEI: u128 = 1_000_000_000_000;

/// The default of `resubmit.bump_after_ms`: a minute at the head of the queue.
pub const DEFAULT_BUMP_AFTER_MS: u64 = 60_000;

/// The default, and the least, of `resubmit.bump_percent`: geth's replacement minimum.
pub const DEFAULT_BUMP_PERCENT: u32 = 10;

/// The default of `nonce.max_in_flight`: 64 unmined nonces per signer, a few blocks' worth of a
/// busy signer, which a stalled chain does not grow past (seed 003's `max_inflight`).
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 64;
/// The largest `nonce.max_in_flight` accepted: the most one allocator drive allocates.
pub const MAX_IN_FLIGHT_LIMIT: u32 = 10_000;
/// The default of `approval.timeout_ms`: a day, long enough for an operator on another time zone to
/// answer, short enough that a forgotten request does not wait for ever.
pub const DEFAULT_APPROVAL_TIMEOUT_MS: u64 = 86_400_000;
/// The longest `approval.timeout_ms` accepted: 30 days.
pub const MAX_APPROVAL_TIMEOUT_MS: u64 = 2_592_000_000;

/// The default of `metrics.sample_ms`: the gauges are sampled every 5 s.
pub const DEFAULT_METRICS_SAMPLE_MS: u64 = 5_000;

impl Default for Config {
    fn default() -> Self {
        Config {
            database_url: "postgres://postgres@127.0.0.1:5432/txflow".into(),
            kafka: KafkaSettings::new("127.0.0.1:19092"),
            schema_registry_url: "http://127.0.0.1:18081".into(),
            topics: Topics::new("txflow"),
            partitions: 16,
            rpc_urls: vec!["http://127.0.0.1:8545".into()],
            chain_id: 31337,
            signer_keys: Secret::default(),
            signer_keys_file: None,
            policy_whitelist: Vec::new(),
            policy_max_value_wei: None,
            policy_approval_threshold_wei: None,
            node_name: None,
            group_prefix: None,
            lease_ms: 10_000,
            signer_keystore: None,
            signer_keystore_password_file: None,
            resubmit_interval_ms: 15_000,
            bump_after_ms: DEFAULT_BUMP_AFTER_MS,
            bump_percent: DEFAULT_BUMP_PERCENT,
            nonce_state_timeout_ms: 30_000,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            approval_timeout_ms: DEFAULT_APPROVAL_TIMEOUT_MS,
            approval_after_deep_reorg: false,
            rpc_timeout_ms: 10_000,
            rpc_attempts: 4,
            assignment_timeout_ms: 60_000,
            receipt_workers: 10,
            stale_receipt_timeout_ms: 60_000,
            confirmations_required: 12,
            max_fee_per_gas_wei: DEFAULT_MAX_FEE_PER_GAS_WEI,
            log_filter: "info".into(),
            log_json: false,
            metrics_addr: None,
            metrics_sample_ms: DEFAULT_METRICS_SAMPLE_MS,
            otlp_endpoint: None,
            otel_service_name: None,
            spot_wal_dir: DEFAULT_SPOT_WAL_DIR.into(),
            spot_assets: SpotAssets::default(),
            spot_timeout_ms: 5_000,
            transfer_stale_ms: 60_000,
            transfer_check_interval_ms: 10_000,
            gateway: GatewaySettings::default(),
        }
    }
}

impl Config {
    /// A node id for this process start: `{TXFLOW_NODE_NAME or host}/{pid}/{random}`.
    pub fn node(&self) -> crate::domain::NodeId {
        match &self.node_name {
            Some(name) => crate::domain::NodeId::generate_named(name),
            None => crate::domain::NodeId::generate(),
        }
    }

    /// The chain's JSON-RPC endpoints (`TXFLOW_RPC_URLS`, in order) with the RPC timeouts and
    /// retries of this configuration.
    pub fn chain(&self) -> Result<crate::chain::Chain, crate::chain::ChainError> {
        crate::chain::Chain::connect_all(
            &self.rpc_urls,
            self.chain_id as u64,
            crate::chain::RpcSettings {
                timeout: std::time::Duration::from_millis(self.rpc_timeout_ms),
                attempts: self.rpc_attempts,
                ..Default::default()
            },
        )
    }

    /// The lease timings from `TXFLOW_LEASE_MS`: renewal every third, clock skew a tenth (at most
    /// one second).
    pub fn lease(&self) -> crate::lease::LeaseConfig {
        let duration = std::time::Duration::from_millis(self.lease_ms);
        crate::lease::LeaseConfig {
            duration,
            renew_interval: duration / 3,
            clock_skew: (duration / 10).min(std::time::Duration::from_secs(1)),
        }
    }

    /// How long a stage may hold no partition before it says so (`TXFLOW_ASSIGNMENT_TIMEOUT_MS`).
    pub fn assignment_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.assignment_timeout_ms)
    }

    /// The consumer group prefix: `TXFLOW_GROUP_PREFIX`, or the topic prefix.
    pub fn group_prefix(&self) -> &str {
        self.group_prefix.as_deref().unwrap_or(&self.topics.prefix)
    }
}

impl Config {
    /// Defaults overridden by the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|k| env::var(k).ok())
    }

    /// Defaults overridden by `lookup` (the environment, or a map in tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut c = Config::default();
        c.apply_env(lookup)?;
        c.read_signer_keys_file()?;
        Ok(c)
    }

    /// One layer of settings over `self`: each `TXFLOW_*` variable `lookup` answers replaces its
    /// setting, checked as the environment's value (the configuration file goes through here too,
    /// so a key and its variable accept the same values).
    pub fn apply_env(
        &mut self,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        let c = self;
        if let Some(v) = lookup("TXFLOW_DATABASE_URL") {
            c.database_url = v;
        }
        if let Some(v) = lookup("TXFLOW_BROKERS") {
            c.kafka.brokers = v;
        }
        if let Some(v) = lookup("TXFLOW_FETCH_WAIT_MAX_MS") {
            c.kafka.fetch_wait_max_ms = v.parse().map_err(|_| ConfigError::Invalid {
                var: "TXFLOW_FETCH_WAIT_MAX_MS",
                value: v.clone(),
                why: "expected milliseconds as a whole number",
            })?;
        }
        if let Some(v) = lookup("TXFLOW_TOPIC_REPLICATION_FACTOR") {
            c.kafka.replication_factor = match v.parse::<i32>() {
                Ok(n) if n >= 1 => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_TOPIC_REPLICATION_FACTOR",
                        value: v,
                        why: "expected a whole number of replicas, at least 1",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_SCHEMA_REGISTRY_URL") {
            c.schema_registry_url = v;
        }
        if let Some(v) = lookup("TXFLOW_TOPIC_PREFIX") {
            if v.is_empty()
                || v.contains(|ch: char| !(ch.is_ascii_alphanumeric() || "._-".contains(ch)))
            {
                return Err(ConfigError::Invalid {
                    var: "TXFLOW_TOPIC_PREFIX",
                    value: v,
                    why: "use letters, digits, '.', '_' or '-'",
                });
            }
            c.topics = Topics::new(v);
        }
        if let Some(v) = lookup("TXFLOW_PARTITIONS") {
            c.partitions = match v.parse::<i32>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_PARTITIONS",
                        value: v,
                        why: "expected a positive whole number",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_RPC_URLS") {
            c.rpc_urls = v
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
        }
        if let Some(v) = lookup("TXFLOW_CHAIN_ID") {
            c.chain_id = match v.parse::<i64>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_CHAIN_ID",
                        value: v,
                        why: "expected a positive whole number",
                    });
                }
            };
        }
        match (
            lookup("TXFLOW_SIGNER_KEYS"),
            lookup("TXFLOW_SIGNER_KEYS_FILE"),
        ) {
            (Some(_), Some(path)) => {
                return Err(ConfigError::Invalid {
                    var: "TXFLOW_SIGNER_KEYS_FILE",
                    value: path,
                    why: "set TXFLOW_SIGNER_KEYS or TXFLOW_SIGNER_KEYS_FILE, not both",
                });
            }
            (Some(keys), None) => {
                c.signer_keys = Secret::new(keys);
                c.signer_keys_file = None;
            }
            (None, Some(path)) => {
                c.signer_keys = Secret::default();
                c.signer_keys_file = Some(path.into());
            }
            (None, None) => {}
        }
        if let Some(v) = lookup("TXFLOW_POLICY_WHITELIST") {
            c.policy_whitelist = v
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
        }
        let name = |var: &'static str, v: String| -> Result<String, ConfigError> {
            if v.is_empty()
                || v.len() > 64
                || v.contains(|ch: char| !(ch.is_ascii_alphanumeric() || "._-".contains(ch)))
            {
                return Err(ConfigError::Invalid {
                    var,
                    value: v,
                    why: "use 1 to 64 letters, digits, '.', '_' or '-'",
                });
            }
            Ok(v)
        };
        if let Some(v) = lookup("TXFLOW_NODE_NAME") {
            c.node_name = Some(name("TXFLOW_NODE_NAME", v)?);
        }
        if let Some(v) = lookup("TXFLOW_GROUP_PREFIX") {
            c.group_prefix = Some(name("TXFLOW_GROUP_PREFIX", v)?);
        }
        if let Some(v) = lookup("TXFLOW_GROUP_INSTANCE_ID") {
            c.kafka.group_instance_id = Some(name("TXFLOW_GROUP_INSTANCE_ID", v)?);
        }
        if let Some(v) = lookup("TXFLOW_GROUP_SESSION_TIMEOUT_MS") {
            c.kafka.session_timeout_ms = match v.parse::<u32>() {
                Ok(n) if (1_000..=1_800_000).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_GROUP_SESSION_TIMEOUT_MS",
                        value: v,
                        why: "expected milliseconds between 1000 and 1800000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_GROUP_HEARTBEAT_MS") {
            c.kafka.heartbeat_interval_ms = match v.parse::<u32>() {
                Ok(n) if (100..=600_000).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_GROUP_HEARTBEAT_MS",
                        value: v,
                        why: "expected milliseconds between 100 and 600000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_ASSIGNMENT_TIMEOUT_MS") {
            c.assignment_timeout_ms = match v.parse::<u64>() {
                Ok(n) if (500..=86_400_000).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_ASSIGNMENT_TIMEOUT_MS",
                        value: v,
                        why: "expected milliseconds between 500 and 86400000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_LEASE_MS") {
            c.lease_ms = match v.parse::<u64>() {
                Ok(n) if (300..=3_600_000).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_LEASE_MS",
                        value: v,
                        why: "expected milliseconds between 300 and 3600000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_RESUBMIT_INTERVAL_MS") {
            c.resubmit_interval_ms = match v.parse::<u64>() {
                Ok(n) if n >= 100 => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_RESUBMIT_INTERVAL_MS",
                        value: v,
                        why: "expected milliseconds, at least 100",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_BUMP_AFTER_MS") {
            c.bump_after_ms = match v.parse::<u64>() {
                Ok(n) if n >= 100 => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_BUMP_AFTER_MS",
                        value: v,
                        why: "expected milliseconds, at least 100",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_BUMP_PERCENT") {
            c.bump_percent = match v.parse::<u32>() {
                Ok(n) if (DEFAULT_BUMP_PERCENT..=1000).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_BUMP_PERCENT",
                        value: v,
                        why: "expected a percentage between 10 (the replacement minimum) and 1000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_NONCE_STATE_TIMEOUT_MS") {
            c.nonce_state_timeout_ms = match v.parse::<u64>() {
                Ok(n) if n <= 86_400_000 => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_NONCE_STATE_TIMEOUT_MS",
                        value: v,
                        why: "expected milliseconds, at most 86400000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_MAX_IN_FLIGHT") {
            c.max_in_flight = match v.parse::<u32>() {
                Ok(n) if (1..=MAX_IN_FLIGHT_LIMIT).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_MAX_IN_FLIGHT",
                        value: v,
                        why: "expected a whole number between 1 and 10000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_APPROVAL_TIMEOUT_MS") {
            c.approval_timeout_ms = match v.parse::<u64>() {
                Ok(n) if (1_000..=MAX_APPROVAL_TIMEOUT_MS).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_APPROVAL_TIMEOUT_MS",
                        value: v,
                        why: "expected milliseconds between 1000 and 2592000000 (30 days)",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_APPROVAL_AFTER_DEEP_REORG") {
            c.approval_after_deep_reorg = match v.as_str() {
                "true" => true,
                "false" => false,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_APPROVAL_AFTER_DEEP_REORG",
                        value: v,
                        why: "expected true or false",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_RPC_TIMEOUT_MS") {
            c.rpc_timeout_ms = match v.parse::<u64>() {
                Ok(n) if (50..=600_000).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_RPC_TIMEOUT_MS",
                        value: v,
                        why: "expected milliseconds between 50 and 600000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_RPC_ATTEMPTS") {
            c.rpc_attempts = match v.parse::<u32>() {
                Ok(n) if (1..=20).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_RPC_ATTEMPTS",
                        value: v,
                        why: "expected a whole number between 1 and 20",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_RECEIPT_WORKERS") {
            c.receipt_workers = match v.parse::<usize>() {
                Ok(n) if (1..=1000).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_RECEIPT_WORKERS",
                        value: v,
                        why: "expected a whole number between 1 and 1000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_CONFIRMATIONS_REQUIRED") {
            c.confirmations_required = match v.parse::<u32>() {
                Ok(n) if (1..=10_000).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_CONFIRMATIONS_REQUIRED",
                        value: v,
                        why: "expected a whole number of blocks between 1 and 10000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_STALE_RECEIPT_TIMEOUT_MS") {
            c.stale_receipt_timeout_ms = match v.parse::<u64>() {
                Ok(n) if n <= 86_400_000 => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_STALE_RECEIPT_TIMEOUT_MS",
                        value: v,
                        why: "expected milliseconds, at most 86400000",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_MAX_FEE_PER_GAS_WEI") {
            c.max_fee_per_gas_wei = match v.parse::<u128>() {
                Ok(n) if (1..=crate::chain::MAX_FEE_PER_GAS).contains(&n) => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_MAX_FEE_PER_GAS_WEI",
                        value: v,
                        why: "expected wei per gas, a whole number between 1 and 10^18",
                    });
                }
            };
        }
        if let Some(v) = lookup("TXFLOW_SIGNER_KEYSTORE") {
            c.signer_keystore = Some(v.into());
        }
        if let Some(v) = lookup("TXFLOW_SIGNER_KEYSTORE_PASSWORD_FILE") {
            c.signer_keystore_password_file = Some(v.into());
        }
        c.policy_max_value_wei =
            lookup("TXFLOW_POLICY_MAX_VALUE_WEI").or(c.policy_max_value_wei.take());
        c.policy_approval_threshold_wei = lookup("TXFLOW_POLICY_APPROVAL_THRESHOLD_WEI")
            .or(c.policy_approval_threshold_wei.take());
        if let Some(v) = lookup("TXFLOW_LOG") {
            c.log_filter = v;
        }
        if let Some(v) = lookup("TXFLOW_LOG_FORMAT") {
            c.log_json = v == "json";
        }
        if let Some(v) = lookup("TXFLOW_METRICS_ADDR") {
            if v.is_empty() {
                c.metrics_addr = None;
            } else if v.parse::<std::net::SocketAddr>().is_err() {
                return Err(ConfigError::Invalid {
                    var: "TXFLOW_METRICS_ADDR",
                    value: v,
                    why: "expected an address and port, e.g. 0.0.0.0:9464",
                });
            } else {
                c.metrics_addr = Some(v);
            }
        }
        if let Some(v) = lookup("TXFLOW_METRICS_SAMPLE_MS") {
            c.metrics_sample_ms = match v.parse::<u64>() {
                Ok(ms) if ms >= 100 => ms,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_METRICS_SAMPLE_MS",
                        value: v,
                        why: "expected milliseconds, at least 100",
                    });
                }
            };
        }
        // The OpenTelemetry variables by their standard names; empty means unset.
        if let Some(v) = lookup("OTEL_EXPORTER_OTLP_ENDPOINT") {
            let v = v.trim().to_string();
            if v.is_empty() {
                c.otlp_endpoint = None;
            } else if !(v.starts_with("http://") || v.starts_with("https://"))
                || v.parse::<reqwest::Url>().is_err()
            {
                return Err(ConfigError::Invalid {
                    var: "OTEL_EXPORTER_OTLP_ENDPOINT",
                    value: crate::chain::redact(&v),
                    why: "expected an http:// URL of an OTLP gRPC receiver, e.g. http://otel-collector:4317",
                });
            } else {
                c.otlp_endpoint = Some(v);
            }
        }
        if let Some(v) = lookup("OTEL_SERVICE_NAME") {
            let v = v.trim().to_string();
            c.otel_service_name = (!v.is_empty()).then_some(v);
        }
        if let Some(v) = lookup("TXFLOW_SPOT_WAL_DIR") {
            if v.trim().is_empty() {
                return Err(ConfigError::Invalid {
                    var: "TXFLOW_SPOT_WAL_DIR",
                    value: v,
                    why: "expected a directory",
                });
            }
            c.spot_wal_dir = v.into();
        }
        if let Some(v) = lookup("TXFLOW_SPOT_TIMEOUT_MS") {
            c.spot_timeout_ms = match v.trim().parse::<u64>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_SPOT_TIMEOUT_MS",
                        value: v,
                        why: "expected a positive number of milliseconds",
                    });
                }
            };
        }
        for (var, field) in [
            ("TXFLOW_TRANSFER_STALE_MS", &mut c.transfer_stale_ms),
            (
                "TXFLOW_TRANSFER_CHECK_INTERVAL_MS",
                &mut c.transfer_check_interval_ms,
            ),
        ] {
            if let Some(v) = lookup(var) {
                *field = match v.trim().parse::<u64>() {
                    Ok(n) if n > 0 => n,
                    _ => {
                        return Err(ConfigError::Invalid {
                            var,
                            value: v,
                            why: "expected a positive number of milliseconds",
                        });
                    }
                };
            }
        }
        if let Some(v) = lookup("TXFLOW_SPOT_ASSETS") {
            c.spot_assets = match SpotAssets::parse(&v) {
                Ok(assets) => assets,
                Err(e) => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_SPOT_ASSETS",
                        value: v,
                        why: e.why(),
                    });
                }
            };
        }
        c.gateway.apply_env(&lookup)?;
        Ok(())
    }

    /// Reads `signer_keys_file`, if set, into `signer_keys` (the last step of loading).
    pub fn read_signer_keys_file(&mut self) -> Result<(), ConfigError> {
        let Some(path) = &self.signer_keys_file else {
            return Ok(());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            what: "the signer keys file",
            path: path.clone(),
            source,
        })?;
        let keys: Vec<&str> = text
            .split(|ch: char| ch == ',' || ch.is_whitespace())
            .filter(|k| !k.is_empty())
            .collect();
        self.signer_keys = Secret::new(keys.join(","));
        Ok(())
    }
}

/// The default of `gateway.addr`.
pub const DEFAULT_GATEWAY_ADDR: &str = "127.0.0.1:8080";

/// The HTTP gateway's settings (`txflow gateway`). Only paths to the JWT keys are held: the key
/// files are read when the gateway starts, and no key is ever printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewaySettings {
    /// `gateway.addr` (`TXFLOW_GATEWAY_ADDR`, default [`DEFAULT_GATEWAY_ADDR`]).
    pub addr: String,
    /// `gateway.jwt_alg` (`TXFLOW_GATEWAY_JWT_ALG`, `HS256` by default, `RS256` or `ES256`): the
    /// algorithm of the one key in `jwt_secret_file` / `jwt_public_key_file`.
    pub jwt_alg: JwtAlg,
    /// `gateway.jwt_secret_file` (`TXFLOW_GATEWAY_JWT_SECRET_FILE`): the HS256 shared secret.
    pub jwt_secret_file: Option<std::path::PathBuf>,
    /// `gateway.jwt_public_key_file` (`TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE`): the RS256 public key
    /// (PEM), or the ES256 one (a P-256 public key, PEM).
    pub jwt_public_key_file: Option<std::path::PathBuf>,
    /// `gateway.jwt_jwks_file` (`TXFLOW_GATEWAY_JWT_JWKS_FILE`): a JSON Web Key Set of the keys
    /// tokens may be signed with, each chosen by its `kid` (several at once, for rotation). When
    /// set, it replaces `jwt_alg` and the key files.
    pub jwt_jwks_file: Option<std::path::PathBuf>,
    /// `gateway.jwt_audience` (`TXFLOW_GATEWAY_JWT_AUDIENCE`, default [`DEFAULT_JWT_AUDIENCE`]):
    /// a token's `aud` must name it.
    pub jwt_audience: String,
    /// `gateway.jwt_issuer` (`TXFLOW_GATEWAY_JWT_ISSUER`, default [`DEFAULT_JWT_ISSUER`]): a
    /// token's `iss` must be it.
    pub jwt_issuer: String,
    /// `gateway.jwt_max_lifetime_secs` (`TXFLOW_GATEWAY_JWT_MAX_LIFETIME_SECS`, default 3600): a
    /// token whose `exp - iat` is longer is refused.
    pub jwt_max_lifetime_secs: u64,
    /// `gateway.rate_per_sec` (`TXFLOW_GATEWAY_RATE_PER_SEC`, default 10, seed 004 §1.5.6):
    /// transfer requests per second per user, per gateway process.
    pub rate_per_sec: u32,
    /// `gateway.rate_burst` (`TXFLOW_GATEWAY_RATE_BURST`, default 10): the bucket's size.
    pub rate_burst: u32,
    /// `gateway.daily_count` (`TXFLOW_GATEWAY_DAILY_COUNT`, default 100, seed 004 §1.5.6): the
    /// transfers a user may create per UTC day (DAILY_LIMIT_EXCEEDED past it), counted in the
    /// database, so across every gateway process.
    pub daily_count: u32,
    /// `gateway.timeout_ms` (`TXFLOW_GATEWAY_TIMEOUT_MS`, default 10000): a request not answered
    /// by then gets 503 SYSTEM_ERROR.
    pub timeout_ms: u64,
}

/// The JWT signature algorithms the gateway verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JwtAlg {
    Hs256,
    Rs256,
    Es256,
}

impl JwtAlg {
    pub const fn as_str(self) -> &'static str {
        match self {
            JwtAlg::Hs256 => "HS256",
            JwtAlg::Rs256 => "RS256",
            JwtAlg::Es256 => "ES256",
        }
    }
}

/// The default of `gateway.jwt_audience`.
pub const DEFAULT_JWT_AUDIENCE: &str = "txflow";

/// The default of `gateway.jwt_issuer`.
pub const DEFAULT_JWT_ISSUER: &str = "txflow";

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            addr: DEFAULT_GATEWAY_ADDR.into(),
            jwt_alg: JwtAlg::Hs256,
            jwt_secret_file: None,
            jwt_public_key_file: None,
            jwt_jwks_file: None,
            jwt_audience: DEFAULT_JWT_AUDIENCE.into(),
            jwt_issuer: DEFAULT_JWT_ISSUER.into(),
            jwt_max_lifetime_secs: 3600,
            rate_per_sec: 10,
            rate_burst: 10,
            daily_count: 100,
            timeout_ms: 10_000,
        }
    }
}

impl GatewaySettings {
    fn apply_env(&mut self, lookup: &impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        if let Some(v) = lookup("TXFLOW_GATEWAY_ADDR") {
            if v.parse::<std::net::SocketAddr>().is_err() {
                return Err(ConfigError::Invalid {
                    var: "TXFLOW_GATEWAY_ADDR",
                    value: v,
                    why: "expected an address and port, e.g. 0.0.0.0:8080",
                });
            }
            self.addr = v;
        }
        if let Some(v) = lookup("TXFLOW_GATEWAY_JWT_ALG") {
            self.jwt_alg = match v.as_str() {
                "HS256" => JwtAlg::Hs256,
                "RS256" => JwtAlg::Rs256,
                "ES256" => JwtAlg::Es256,
                _ => {
                    return Err(ConfigError::Invalid {
                        var: "TXFLOW_GATEWAY_JWT_ALG",
                        value: v,
                        why: "expected HS256, RS256 or ES256",
                    });
                }
            };
        }
        let path = |var: &'static str, v: String| {
            if v.trim().is_empty() {
                Err(ConfigError::Invalid {
                    var,
                    value: v,
                    why: "expected a file",
                })
            } else {
                Ok(Some(std::path::PathBuf::from(v)))
            }
        };
        if let Some(v) = lookup("TXFLOW_GATEWAY_JWT_SECRET_FILE") {
            self.jwt_secret_file = path("TXFLOW_GATEWAY_JWT_SECRET_FILE", v)?;
        }
        if let Some(v) = lookup("TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE") {
            self.jwt_public_key_file = path("TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE", v)?;
        }
        if let Some(v) = lookup("TXFLOW_GATEWAY_JWT_JWKS_FILE") {
            self.jwt_jwks_file = path("TXFLOW_GATEWAY_JWT_JWKS_FILE", v)?;
        }
        let name = |var: &'static str, v: String| {
            if v.trim().is_empty() || v.trim() != v {
                Err(ConfigError::Invalid {
                    var,
                    value: v,
                    why: "expected a name, without surrounding spaces",
                })
            } else {
                Ok(v)
            }
        };
        if let Some(v) = lookup("TXFLOW_GATEWAY_JWT_AUDIENCE") {
            self.jwt_audience = name("TXFLOW_GATEWAY_JWT_AUDIENCE", v)?;
        }
        if let Some(v) = lookup("TXFLOW_GATEWAY_JWT_ISSUER") {
            self.jwt_issuer = name("TXFLOW_GATEWAY_JWT_ISSUER", v)?;
        }
        let whole = |var: &'static str, v: String, max: u64| match v.trim().parse::<u64>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(ConfigError::Invalid {
                var,
                value: v,
                why: "expected a positive whole number (within its limit)",
            }),
        };
        if let Some(v) = lookup("TXFLOW_GATEWAY_RATE_PER_SEC") {
            self.rate_per_sec = whole("TXFLOW_GATEWAY_RATE_PER_SEC", v, 1_000_000)? as u32;
        }
        if let Some(v) = lookup("TXFLOW_GATEWAY_RATE_BURST") {
            self.rate_burst = whole("TXFLOW_GATEWAY_RATE_BURST", v, 1_000_000)? as u32;
        }
        if let Some(v) = lookup("TXFLOW_GATEWAY_DAILY_COUNT") {
            self.daily_count = whole("TXFLOW_GATEWAY_DAILY_COUNT", v, 1_000_000)? as u32;
        }
        if let Some(v) = lookup("TXFLOW_GATEWAY_TIMEOUT_MS") {
            self.timeout_ms = whole("TXFLOW_GATEWAY_TIMEOUT_MS", v, 600_000)?;
        }
        if let Some(v) = lookup("TXFLOW_GATEWAY_JWT_MAX_LIFETIME_SECS") {
            self.jwt_max_lifetime_secs = whole("TXFLOW_GATEWAY_JWT_MAX_LIFETIME_SECS", v, 86_400)?;
        }
        Ok(())
    }
}

/// The default of `spot.wal_dir`.
pub const DEFAULT_SPOT_WAL_DIR: &str = "data/spot-ledger";
/// The default of `spot.assets`.
pub const DEFAULT_SPOT_ASSETS: &str = "USDT:6,USDC:6,BTC:8,ETH:8";
/// The most decimal places a spot asset may have (what an exact decimal of 96 bits can hold).
pub const MAX_SPOT_PLACES: u32 = 18;

/// Why a `spot.assets` list (`TXFLOW_SPOT_ASSETS`) is refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SpotAssetsError {
    #[error("{entry:?} is not CODE:PLACES (an upper-case code, 0 to {MAX_SPOT_PLACES} places)")]
    Asset { entry: String },
    #[error("asset {code} is listed twice")]
    DuplicateAsset { code: String },
    #[error("no asset is listed")]
    NoAsset,
}

impl SpotAssetsError {
    /// The rule broken, for [`ConfigError::Invalid`] (which shows the value itself).
    pub fn why(&self) -> &'static str {
        match self {
            SpotAssetsError::Asset { .. } => {
                "expected CODE:PLACES,… with upper-case codes (letters and digits, at most 16) and 0 to 18 places"
            }
            SpotAssetsError::DuplicateAsset { .. } => "an asset is listed twice",
            SpotAssetsError::NoAsset => "no asset is listed",
        }
    }
}

/// The spot ledger's assets and the decimal places each allows (`spot.assets`,
/// `TXFLOW_SPOT_ASSETS`): parsed and checked here only. Printed (`Display`, `Debug`) as
/// `CODE:PLACES,…` in code order, which parses back to the same value.
#[derive(Clone, PartialEq, Eq)]
pub struct SpotAssets(std::collections::BTreeMap<String, u32>);

impl SpotAssets {
    /// Parses `CODE:PLACES,…` (spaces around entries allowed).
    pub fn parse(s: &str) -> Result<SpotAssets, SpotAssetsError> {
        let mut map = std::collections::BTreeMap::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = || SpotAssetsError::Asset {
                entry: entry.to_string(),
            };
            let (code, places) = entry.split_once(':').ok_or_else(bad)?;
            let code = code.trim();
            let places: u32 = places.trim().parse().map_err(|_| bad())?;
            let code_ok = !code.is_empty()
                && code.len() <= 16
                && code
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit());
            if !code_ok || places > MAX_SPOT_PLACES {
                return Err(bad());
            }
            if map.insert(code.to_string(), places).is_some() {
                return Err(SpotAssetsError::DuplicateAsset {
                    code: code.to_string(),
                });
            }
        }
        if map.is_empty() {
            return Err(SpotAssetsError::NoAsset);
        }
        Ok(SpotAssets(map))
    }

    /// The decimal places `asset` allows; `None` for an asset the ledger does not hold.
    pub fn places(&self, asset: &str) -> Option<u32> {
        self.0.get(asset).copied()
    }
}

impl Default for SpotAssets {
    fn default() -> Self {
        // The constant is a valid list (a test parses it); built by hand so that no `expect`
        // stands on the path.
        SpotAssets(
            [("BTC", 8), ("ETH", 8), ("USDC", 6), ("USDT", 6)]
                .into_iter()
                .map(|(code, places)| (code.to_string(), places))
                .collect(),
        )
    }
}

impl std::fmt::Display for SpotAssets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (code, places)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{code}:{places}")?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for SpotAssets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spot_settings_follow_the_environment_and_a_bad_asset_list_is_refused() {
        let d = Config::default();
        assert_eq!(
            d.spot_wal_dir,
            std::path::PathBuf::from(DEFAULT_SPOT_WAL_DIR)
        );
        assert_eq!(
            d.spot_assets,
            SpotAssets::parse(DEFAULT_SPOT_ASSETS).expect("the default parses")
        );
        let c = Config::from_lookup(|k| match k {
            "TXFLOW_SPOT_WAL_DIR" => Some("/tmp/w".into()),
            "TXFLOW_SPOT_ASSETS" => Some("EUR:2, BTC:8".into()),
            _ => None,
        })
        .expect("valid");
        assert_eq!(c.spot_wal_dir, std::path::PathBuf::from("/tmp/w"));
        assert_eq!(c.spot_assets.places("EUR"), Some(2));
        assert_eq!(
            c.spot_assets.places("USDT"),
            None,
            "the list replaces the default"
        );
        assert_eq!(c.spot_assets.to_string(), "BTC:8,EUR:2");
        let shown = format!("{c:?}");
        assert!(shown.contains("spot_assets: \"BTC:8,EUR:2\""), "{shown}");
        for (var, bad) in [
            ("TXFLOW_SPOT_ASSETS", "USDT"),
            ("TXFLOW_SPOT_ASSETS", "usdt:6"),
            ("TXFLOW_SPOT_ASSETS", "USDT:19"),
            ("TXFLOW_SPOT_ASSETS", "BTC:8,BTC:6"),
            ("TXFLOW_SPOT_ASSETS", " , "),
            ("TXFLOW_SPOT_WAL_DIR", ""),
        ] {
            let err = Config::from_lookup(|k| (k == var).then(|| bad.into()))
                .expect_err("an invalid value");
            assert!(
                matches!(err, ConfigError::Invalid { var: v, .. } if v == var),
                "{var}={bad}: {err:?}"
            );
        }
    }

    #[test]
    fn spot_asset_lists_parse_codes_and_places() {
        let a = SpotAssets::parse(" USDT:6, BTC:8 ,").expect("valid");
        assert_eq!(a.places("USDT"), Some(6));
        assert_eq!(a.places("BTC"), Some(8));
        assert_eq!(a.places("usdt"), None);
        assert_eq!(a.places("ETH"), None);
        assert_eq!(SpotAssets::parse(&a.to_string()), Ok(a));
        for bad in ["USDT", "USDT:x", "usdt:6", "USDT:19", ":6", "USDT:-1"] {
            assert!(
                matches!(SpotAssets::parse(bad), Err(SpotAssetsError::Asset { .. })),
                "{bad}"
            );
        }
        assert_eq!(
            SpotAssets::parse("BTC:8,BTC:6"),
            Err(SpotAssetsError::DuplicateAsset { code: "BTC".into() })
        );
        assert_eq!(SpotAssets::parse(" , "), Err(SpotAssetsError::NoAsset));
    }

    #[test]
    fn gateway_settings_follow_the_environment_and_hold_no_key() {
        let d = Config::default().gateway;
        assert_eq!(
            (d.addr.as_str(), d.jwt_alg, d.rate_per_sec, d.daily_count),
            (DEFAULT_GATEWAY_ADDR, JwtAlg::Hs256, 10, 100)
        );
        let c = Config::from_lookup(|k| match k {
            "TXFLOW_GATEWAY_ADDR" => Some("0.0.0.0:9000".into()),
            "TXFLOW_GATEWAY_JWT_ALG" => Some("RS256".into()),
            "TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE" => Some("/etc/jwt.pem".into()),
            "TXFLOW_GATEWAY_RATE_PER_SEC" => Some("5".into()),
            "TXFLOW_GATEWAY_DAILY_COUNT" => Some("3".into()),
            _ => None,
        })
        .expect("valid");
        assert_eq!(c.gateway.addr, "0.0.0.0:9000");
        assert_eq!(c.gateway.jwt_alg, JwtAlg::Rs256);
        assert_eq!(
            c.gateway.jwt_public_key_file,
            Some(std::path::PathBuf::from("/etc/jwt.pem"))
        );
        assert_eq!(c.gateway.rate_per_sec, 5);
        assert_eq!(c.gateway.daily_count, 3);
        for (var, bad) in [
            ("TXFLOW_GATEWAY_ADDR", "localhost"),
            ("TXFLOW_GATEWAY_JWT_ALG", "none"),
            ("TXFLOW_GATEWAY_JWT_ALG", "hs256"),
            ("TXFLOW_GATEWAY_JWT_SECRET_FILE", ""),
            ("TXFLOW_GATEWAY_RATE_PER_SEC", "0"),
            ("TXFLOW_GATEWAY_RATE_BURST", "x"),
            ("TXFLOW_GATEWAY_DAILY_COUNT", "0"),
            ("TXFLOW_GATEWAY_TIMEOUT_MS", "600001"),
        ] {
            let err = Config::from_lookup(|k| (k == var).then(|| bad.into()))
                .expect_err("an invalid value");
            assert!(err.to_string().contains(var), "{var}={bad}: {err}");
        }
    }

    #[test]
    fn environment_overrides_defaults() {
        let c = Config::from_lookup(|k| match k {
            "TXFLOW_BROKERS" => Some("b:1".into()),
            "TXFLOW_PARTITIONS" => Some("4".into()),
            "TXFLOW_TOPIC_PREFIX" => Some("t1".into()),
            _ => None,
        })
        .expect("valid");
        assert_eq!(c.kafka.brokers, "b:1");
        assert_eq!(c.partitions, 4);
        assert_eq!(c.topics.tx_requests(), "t1.tx.requests");
    }

    #[test]
    fn the_fee_cap_is_wei_per_gas_within_what_a_chain_can_ask() {
        let cap = |v: &str| {
            Config::from_lookup(|k| (k == "TXFLOW_MAX_FEE_PER_GAS_WEI").then(|| v.to_string()))
                .map(|c| c.max_fee_per_gas_wei)
                .ok()
        };
        assert_eq!(
            Config::default().max_fee_per_gas_wei,
            DEFAULT_MAX_FEE_PER_GAS_WEI
        );
        assert_eq!(cap("50000000000"), Some(50_000_000_000));
        for bad in ["0", "-1", "1.5", "1000000000000000001", "lots"] {
            assert!(cap(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn gas_bumps_follow_the_environment_and_never_go_below_the_replacement_minimum() {
        let d = Config::default();
        assert_eq!((d.bump_after_ms, d.bump_percent), (60_000, 10));
        let c = Config::from_lookup(|k| match k {
            "TXFLOW_BUMP_AFTER_MS" => Some("5000".into()),
            "TXFLOW_BUMP_PERCENT" => Some("25".into()),
            _ => None,
        })
        .expect("valid");
        assert_eq!((c.bump_after_ms, c.bump_percent), (5000, 25));
        for (var, bad) in [
            ("TXFLOW_BUMP_AFTER_MS", "99"),
            ("TXFLOW_BUMP_AFTER_MS", "soon"),
            ("TXFLOW_BUMP_PERCENT", "9"),
            ("TXFLOW_BUMP_PERCENT", "0"),
            ("TXFLOW_BUMP_PERCENT", "1001"),
            ("TXFLOW_BUMP_PERCENT", "10.5"),
        ] {
            let err =
                Config::from_lookup(|k| (k == var).then(|| bad.to_string())).expect_err("refused");
            assert!(err.to_string().contains(var), "{var}={bad}: {err}");
        }
    }

    #[test]
    fn the_in_flight_budget_and_the_approval_timeout_follow_the_environment() {
        let d = Config::default();
        assert_eq!(d.max_in_flight, 64);
        assert_eq!(d.approval_timeout_ms, 24 * 3600 * 1000);
        let c = Config::from_lookup(|k| match k {
            "TXFLOW_MAX_IN_FLIGHT" => Some("16".into()),
            "TXFLOW_APPROVAL_TIMEOUT_MS" => Some("2000".into()),
            _ => None,
        })
        .expect("valid");
        assert_eq!((c.max_in_flight, c.approval_timeout_ms), (16, 2000));
        for (var, bad) in [
            ("TXFLOW_MAX_IN_FLIGHT", "0"),
            ("TXFLOW_MAX_IN_FLIGHT", "10001"),
            ("TXFLOW_MAX_IN_FLIGHT", "-1"),
            ("TXFLOW_MAX_IN_FLIGHT", "many"),
            ("TXFLOW_APPROVAL_TIMEOUT_MS", "999"),
            ("TXFLOW_APPROVAL_TIMEOUT_MS", "2592000001"),
            ("TXFLOW_APPROVAL_TIMEOUT_MS", "1h"),
        ] {
            let err = Config::from_lookup(|k| (k == var).then(|| bad.into()))
                .expect_err("an invalid value");
            assert!(err.to_string().contains(var), "{var}={bad}: {err}");
        }
    }

    #[test]
    fn database_passwords_and_rpc_keys_never_show_in_debug_output() {
        let c = Config::from_lookup(|k| match k {
            "TXFLOW_DATABASE_URL" => Some("postgres://u:DBPASSWORD@h:5432/db".into()),
            "TXFLOW_RPC_URLS" => Some("https://rpc.example.com/v3/APIKEY?key=APIKEY2".into()),
            _ => None,
        })
        .expect("valid");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("DBPASSWORD") && !shown.contains("APIKEY"),
            "{shown}"
        );
        assert!(shown.contains("postgres://u:***@h:5432/db"), "{shown}");
        assert!(shown.contains("https://rpc.example.com"), "{shown}");
        assert_eq!(
            redact_database_url("postgres://u@h/db"),
            "postgres://u@h/db"
        );
        assert_eq!(
            redact_database_url("postgres://u:PW@h/db?sslmode=require&password=PW2"),
            "postgres://u:***@h/db?sslmode=require&password=***"
        );
    }

    #[test]
    fn signer_keys_never_show_in_debug_output() {
        let key = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";
        let c = Config::from_lookup(|k| (k == "TXFLOW_SIGNER_KEYS").then(|| key.into()))
            .expect("valid");
        assert_eq!(c.signer_keys.expose(), key);
        let shown = format!("{c:?}");
        assert!(!shown.contains("ac0974"), "{shown}");
    }

    #[test]
    fn invalid_values_are_refused_with_the_variable_named() {
        let err = Config::from_lookup(|k| (k == "TXFLOW_PARTITIONS").then(|| "-3".into()))
            .expect_err("negative partitions");
        assert!(err.to_string().contains("TXFLOW_PARTITIONS"));
        let err = Config::from_lookup(|k| (k == "TXFLOW_LEASE_MS").then(|| "10".into()))
            .expect_err("a 10 ms lease");
        assert!(err.to_string().contains("TXFLOW_LEASE_MS"));
        let err = Config::from_lookup(|k| (k == "TXFLOW_NODE_NAME").then(|| "a b".into()))
            .expect_err("a space in a node name");
        assert!(err.to_string().contains("TXFLOW_NODE_NAME"));
    }

    #[test]
    fn consumer_group_settings_and_the_assignment_timeout_follow_the_environment() {
        let d = Config::default();
        assert_eq!(d.assignment_timeout().as_secs(), 60);
        assert_eq!(
            d.kafka.group_instance_id, None,
            "static membership is opt-in"
        );
        let c = Config::from_lookup(|k| match k {
            "TXFLOW_ASSIGNMENT_TIMEOUT_MS" => Some("3000".into()),
            "TXFLOW_GROUP_SESSION_TIMEOUT_MS" => Some("4500".into()),
            "TXFLOW_GROUP_HEARTBEAT_MS" => Some("300".into()),
            "TXFLOW_GROUP_INSTANCE_ID" => Some("bcast-a".into()),
            _ => None,
        })
        .expect("valid");
        assert_eq!(c.assignment_timeout().as_millis(), 3000);
        assert_eq!(c.kafka.session_timeout_ms, 4500);
        assert_eq!(c.kafka.heartbeat_interval_ms, 300);
        assert_eq!(c.kafka.group_instance_id.as_deref(), Some("bcast-a"));
        let shown = format!("{c:?}");
        assert!(
            shown.contains("assignment_timeout_ms: 3000") && shown.contains("bcast-a"),
            "{shown}"
        );
        for (var, bad) in [
            ("TXFLOW_ASSIGNMENT_TIMEOUT_MS", "0"),
            ("TXFLOW_GROUP_SESSION_TIMEOUT_MS", "10"),
            ("TXFLOW_GROUP_HEARTBEAT_MS", "x"),
            ("TXFLOW_GROUP_INSTANCE_ID", "a b"),
        ] {
            let err = Config::from_lookup(|k| (k == var).then(|| bad.into()))
                .expect_err("an invalid value");
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn the_topic_replication_factor_follows_the_environment_and_is_at_least_one() {
        assert_eq!(Config::default().kafka.replication_factor, 1);
        let c =
            Config::from_lookup(|k| (k == "TXFLOW_TOPIC_REPLICATION_FACTOR").then(|| "3".into()))
                .expect("valid");
        assert_eq!(c.kafka.replication_factor, 3);
        for bad in ["0", "-1", "x"] {
            let err = Config::from_lookup(|k| {
                (k == "TXFLOW_TOPIC_REPLICATION_FACTOR").then(|| bad.into())
            })
            .expect_err("an invalid replication factor");
            assert!(
                matches!(&err, ConfigError::Invalid { var: "TXFLOW_TOPIC_REPLICATION_FACTOR", value, .. } if value == bad),
                "{bad}: {err:?}"
            );
        }
    }

    #[test]
    fn node_ids_lease_timings_and_group_prefix_follow_the_settings() {
        let c = Config::from_lookup(|k| match k {
            "TXFLOW_NODE_NAME" => Some("alloc-a".into()),
            "TXFLOW_LEASE_MS" => Some("3000".into()),
            "TXFLOW_TOPIC_PREFIX" => Some("t1".into()),
            _ => None,
        })
        .expect("valid");
        let (a, b) = (c.node(), c.node());
        assert!(a.as_str().starts_with("alloc-a/"), "{a:?}");
        assert_ne!(a, b, "every start gets a node id of its own");
        let lease = c.lease();
        lease
            .validate()
            .expect("derived lease timings are consistent");
        assert_eq!(lease.duration.as_millis(), 3000);
        assert_eq!(c.group_prefix(), "t1");
        Config::default()
            .lease()
            .validate()
            .expect("default lease timings are consistent");
    }
}
