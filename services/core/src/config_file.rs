//! The configuration file (`txflow --config txflow.toml`, or `TXFLOW_CONFIG`): one more layer of
//! [`Config`], between the built-in defaults and the environment. Precedence, lowest first:
//! defaults < file < `TXFLOW_*` variables < command-line flags.
//!
//! Every key has an environment variable ([`KEYS`]) and the file's values go through the same
//! checks as the variables' ([`Config::apply_env`]), so a key accepts exactly what its variable
//! accepts and the two cannot drift. Unknown keys and values of the wrong type are refused by
//! serde (`deny_unknown_fields` on every section) with the dotted key named
//! (`serde_path_to_error`); values out of range by the variable's own rule, with the key named.
//! `deploy/txflow.example.toml` lists every key with its default and its variable; a test parses
//! it, so it cannot rot.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{Config, ConfigError, redact_database_url};

/// Every key of the file and the environment variable that overrides it.
pub const KEYS: &[(&str, &str)] = &[
    ("database.url", "TXFLOW_DATABASE_URL"),
    ("kafka.brokers", "TXFLOW_BROKERS"),
    ("kafka.fetch_wait_max_ms", "TXFLOW_FETCH_WAIT_MAX_MS"),
    (
        "kafka.replication_factor",
        "TXFLOW_TOPIC_REPLICATION_FACTOR",
    ),
    ("kafka.group_prefix", "TXFLOW_GROUP_PREFIX"),
    (
        "kafka.session_timeout_ms",
        "TXFLOW_GROUP_SESSION_TIMEOUT_MS",
    ),
    ("kafka.heartbeat_interval_ms", "TXFLOW_GROUP_HEARTBEAT_MS"),
    ("kafka.group_instance_id", "TXFLOW_GROUP_INSTANCE_ID"),
    (
        "kafka.assignment_timeout_ms",
        "TXFLOW_ASSIGNMENT_TIMEOUT_MS",
    ),
    ("schema_registry.url", "TXFLOW_SCHEMA_REGISTRY_URL"),
    ("topics.prefix", "TXFLOW_TOPIC_PREFIX"),
    ("topics.partitions", "TXFLOW_PARTITIONS"),
    ("rpc.urls", "TXFLOW_RPC_URLS"),
    ("rpc.timeout_ms", "TXFLOW_RPC_TIMEOUT_MS"),
    ("rpc.attempts", "TXFLOW_RPC_ATTEMPTS"),
    ("chain.id", "TXFLOW_CHAIN_ID"),
    ("signer.keys_file", "TXFLOW_SIGNER_KEYS_FILE"),
    ("signer.keystore", "TXFLOW_SIGNER_KEYSTORE"),
    (
        "signer.keystore_password_file",
        "TXFLOW_SIGNER_KEYSTORE_PASSWORD_FILE",
    ),
    ("policy.whitelist", "TXFLOW_POLICY_WHITELIST"),
    ("policy.max_value_wei", "TXFLOW_POLICY_MAX_VALUE_WEI"),
    (
        "policy.approval_threshold_wei",
        "TXFLOW_POLICY_APPROVAL_THRESHOLD_WEI",
    ),
    ("approval.timeout_ms", "TXFLOW_APPROVAL_TIMEOUT_MS"),
    (
        "approval.after_deep_reorg",
        "TXFLOW_APPROVAL_AFTER_DEEP_REORG",
    ),
    ("node.name", "TXFLOW_NODE_NAME"),
    ("lease.duration_ms", "TXFLOW_LEASE_MS"),
    ("nonce.state_timeout_ms", "TXFLOW_NONCE_STATE_TIMEOUT_MS"),
    ("nonce.max_in_flight", "TXFLOW_MAX_IN_FLIGHT"),
    ("resubmit.interval_ms", "TXFLOW_RESUBMIT_INTERVAL_MS"),
    ("resubmit.bump_after_ms", "TXFLOW_BUMP_AFTER_MS"),
    ("resubmit.bump_percent", "TXFLOW_BUMP_PERCENT"),
    ("confirmations.required", "TXFLOW_CONFIRMATIONS_REQUIRED"),
    ("confirmations.receipt_workers", "TXFLOW_RECEIPT_WORKERS"),
    (
        "confirmations.stale_receipt_timeout_ms",
        "TXFLOW_STALE_RECEIPT_TIMEOUT_MS",
    ),
    ("fees.max_fee_per_gas_wei", "TXFLOW_MAX_FEE_PER_GAS_WEI"),
    ("log.filter", "TXFLOW_LOG"),
    ("log.format", "TXFLOW_LOG_FORMAT"),
    ("metrics.addr", "TXFLOW_METRICS_ADDR"),
    ("metrics.sample_ms", "TXFLOW_METRICS_SAMPLE_MS"),
    ("telemetry.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ("telemetry.service_name", "OTEL_SERVICE_NAME"),
    ("spot.wal_dir", "TXFLOW_SPOT_WAL_DIR"),
    ("spot.assets", "TXFLOW_SPOT_ASSETS"),
    ("spot.timeout_ms", "TXFLOW_SPOT_TIMEOUT_MS"),
    ("transfer.stale_ms", "TXFLOW_TRANSFER_STALE_MS"),
    (
        "transfer.check_interval_ms",
        "TXFLOW_TRANSFER_CHECK_INTERVAL_MS",
    ),
    ("gateway.addr", "TXFLOW_GATEWAY_ADDR"),
    ("gateway.jwt_alg", "TXFLOW_GATEWAY_JWT_ALG"),
    ("gateway.jwt_secret_file", "TXFLOW_GATEWAY_JWT_SECRET_FILE"),
    (
        "gateway.jwt_public_key_file",
        "TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE",
    ),
    ("gateway.jwt_jwks_file", "TXFLOW_GATEWAY_JWT_JWKS_FILE"),
    ("gateway.jwt_audience", "TXFLOW_GATEWAY_JWT_AUDIENCE"),
    ("gateway.jwt_issuer", "TXFLOW_GATEWAY_JWT_ISSUER"),
    (
        "gateway.jwt_max_lifetime_secs",
        "TXFLOW_GATEWAY_JWT_MAX_LIFETIME_SECS",
    ),
    ("gateway.rate_per_sec", "TXFLOW_GATEWAY_RATE_PER_SEC"),
    ("gateway.rate_burst", "TXFLOW_GATEWAY_RATE_BURST"),
    ("gateway.daily_count", "TXFLOW_GATEWAY_DAILY_COUNT"),
    ("gateway.timeout_ms", "TXFLOW_GATEWAY_TIMEOUT_MS"),
];

/// The file's contents, section by section; a key left out keeps the value below it.
/// Serialized, it is also what `txflow config` prints (with [`ConfigFile::effective`]).
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConfigFile {
    pub database: DatabaseSection,
    pub kafka: KafkaSection,
    pub schema_registry: SchemaRegistrySection,
    pub topics: TopicsSection,
    pub rpc: RpcSection,
    pub chain: ChainSection,
    pub signer: SignerSection,
    pub policy: PolicySection,
    pub approval: ApprovalSection,
    pub node: NodeSection,
    pub lease: LeaseSection,
    pub nonce: NonceSection,
    pub resubmit: ResubmitSection,
    pub confirmations: ConfirmationsSection,
    pub fees: FeesSection,
    pub log: LogSection,
    pub metrics: MetricsSection,
    pub telemetry: TelemetrySection,
    pub spot: SpotSection,
    pub transfer: TransferSection,
    pub gateway: GatewaySection,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSection {
    pub url: Option<String>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaSection {
    pub brokers: Option<String>,
    pub fetch_wait_max_ms: Option<u32>,
    pub replication_factor: Option<i32>,
    pub group_prefix: Option<String>,
    pub session_timeout_ms: Option<u32>,
    pub heartbeat_interval_ms: Option<u32>,
    pub group_instance_id: Option<String>,
    pub assignment_timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchemaRegistrySection {
    pub url: Option<String>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopicsSection {
    pub prefix: Option<String>,
    pub partitions: Option<i32>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RpcSection {
    pub urls: Option<Vec<String>>,
    pub timeout_ms: Option<u64>,
    pub attempts: Option<u32>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ChainSection {
    pub id: Option<i64>,
}

/// Keys are given by file reference only: a configuration file is copied, shown and committed
/// more often than a key file, so `signer.keys` is not a key (it is refused as unknown).
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SignerSection {
    pub keys_file: Option<PathBuf>,
    pub keystore: Option<PathBuf>,
    pub keystore_password_file: Option<PathBuf>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicySection {
    pub whitelist: Option<Vec<String>>,
    pub max_value_wei: Option<Wei>,
    pub approval_threshold_wei: Option<Wei>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSection {
    pub name: Option<String>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeaseSection {
    pub duration_ms: Option<u64>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NonceSection {
    pub state_timeout_ms: Option<u64>,
    pub max_in_flight: Option<u32>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApprovalSection {
    pub timeout_ms: Option<u64>,
    pub after_deep_reorg: Option<bool>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResubmitSection {
    pub interval_ms: Option<u64>,
    pub bump_after_ms: Option<u64>,
    pub bump_percent: Option<u32>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConfirmationsSection {
    pub required: Option<u32>,
    pub receipt_workers: Option<usize>,
    pub stale_receipt_timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeesSection {
    pub max_fee_per_gas_wei: Option<u64>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    pub filter: Option<String>,
    pub format: Option<LogFormat>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    pub addr: Option<String>,
    pub sample_ms: Option<u64>,
}

/// OpenTelemetry trace export; its keys are overridden by the standard `OTEL_*` variables.
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySection {
    pub otlp_endpoint: Option<String>,
    pub service_name: Option<String>,
}

/// The spot ledger (`txflow spot-ledger`): its write-ahead log and its assets.
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpotSection {
    pub wal_dir: Option<PathBuf>,
    /// `CODE:PLACES,…`, as `TXFLOW_SPOT_ASSETS`.
    pub assets: Option<String>,
    /// `TXFLOW_SPOT_TIMEOUT_MS`: the SPOT adapter's wait for a reply.
    pub timeout_ms: Option<u64>,
}

/// The transfer coordinator (`txflow transfer-coordinator`).
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransferSection {
    /// `TXFLOW_TRANSFER_STALE_MS`: how long an open transfer stands still before the recovery
    /// worker resumes it.
    pub stale_ms: Option<u64>,
    /// `TXFLOW_TRANSFER_CHECK_INTERVAL_MS`: the conservation check's period.
    pub check_interval_ms: Option<u64>,
}

/// The HTTP gateway (`txflow gateway`). Its JWT keys are given by file reference only.
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewaySection {
    pub addr: Option<String>,
    /// `HS256`, `RS256` or `ES256`.
    pub jwt_alg: Option<String>,
    pub jwt_secret_file: Option<PathBuf>,
    pub jwt_public_key_file: Option<PathBuf>,
    pub jwt_jwks_file: Option<PathBuf>,
    pub jwt_audience: Option<String>,
    pub jwt_issuer: Option<String>,
    pub jwt_max_lifetime_secs: Option<u64>,
    pub rate_per_sec: Option<u32>,
    pub rate_burst: Option<u32>,
    pub daily_count: Option<u32>,
    pub timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// An amount of wei: a TOML integer holds at most 2^63 - 1 (about 9.2 ETH), so a decimal string
/// is accepted as well, and printed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Wei(pub String);

impl<'de> Deserialize<'de> for Wei {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Wei;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an amount of wei: a non-negative integer or a string of digits")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Wei, E> {
                Ok(Wei(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Wei, E> {
                u64::try_from(v)
                    .map(|v| Wei(v.to_string()))
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Wei, E> {
                if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
                    Ok(Wei(v.to_string()))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Str(v), &self))
                }
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl ConfigFile {
    /// Parses a file's text; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<ConfigFile, ConfigError> {
        let de = toml::de::Deserializer::parse(text).map_err(|source| ConfigError::Syntax {
            path: path.to_path_buf(),
            source: Box::new(source),
        })?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let error = e.into_inner();
            let line = error.span().map(|span| {
                1 + text.as_bytes()[..span.start.min(text.len())]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
            });
            ConfigError::Key {
                path: path.to_path_buf(),
                line,
                key,
                error: Box::new(error),
            }
        })
    }

    /// Reads and parses the file at `path`.
    pub fn read(path: &Path) -> Result<ConfigFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            what: "the configuration file",
            path: path.to_path_buf(),
            source,
        })?;
        ConfigFile::parse(path, &text)
    }

    /// The file's values as the environment variables that carry the same settings: what
    /// [`Config::apply_env`] reads, so that a key is checked by its variable's rule.
    fn as_env(&self) -> Vec<(&'static str, String)> {
        fn list(v: &[String]) -> String {
            v.join(",")
        }
        fn path(p: &Path) -> String {
            p.to_string_lossy().into_owned()
        }
        let s = self;
        let values: [(&'static str, Option<String>); 37] = [
            ("TXFLOW_DATABASE_URL", s.database.url.clone()),
            ("TXFLOW_BROKERS", s.kafka.brokers.clone()),
            (
                "TXFLOW_FETCH_WAIT_MAX_MS",
                s.kafka.fetch_wait_max_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_TOPIC_REPLICATION_FACTOR",
                s.kafka.replication_factor.map(|v| v.to_string()),
            ),
            ("TXFLOW_GROUP_PREFIX", s.kafka.group_prefix.clone()),
            (
                "TXFLOW_GROUP_SESSION_TIMEOUT_MS",
                s.kafka.session_timeout_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_GROUP_HEARTBEAT_MS",
                s.kafka.heartbeat_interval_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_GROUP_INSTANCE_ID",
                s.kafka.group_instance_id.clone(),
            ),
            (
                "TXFLOW_ASSIGNMENT_TIMEOUT_MS",
                s.kafka.assignment_timeout_ms.map(|v| v.to_string()),
            ),
            ("TXFLOW_SCHEMA_REGISTRY_URL", s.schema_registry.url.clone()),
            ("TXFLOW_TOPIC_PREFIX", s.topics.prefix.clone()),
            (
                "TXFLOW_PARTITIONS",
                s.topics.partitions.map(|v| v.to_string()),
            ),
            ("TXFLOW_RPC_URLS", s.rpc.urls.as_deref().map(list)),
            (
                "TXFLOW_RPC_TIMEOUT_MS",
                s.rpc.timeout_ms.map(|v| v.to_string()),
            ),
            ("TXFLOW_RPC_ATTEMPTS", s.rpc.attempts.map(|v| v.to_string())),
            ("TXFLOW_CHAIN_ID", s.chain.id.map(|v| v.to_string())),
            (
                "TXFLOW_SIGNER_KEYS_FILE",
                s.signer.keys_file.as_deref().map(path),
            ),
            (
                "TXFLOW_SIGNER_KEYSTORE",
                s.signer.keystore.as_deref().map(path),
            ),
            (
                "TXFLOW_SIGNER_KEYSTORE_PASSWORD_FILE",
                s.signer.keystore_password_file.as_deref().map(path),
            ),
            (
                "TXFLOW_POLICY_WHITELIST",
                s.policy.whitelist.as_deref().map(list),
            ),
            (
                "TXFLOW_POLICY_MAX_VALUE_WEI",
                s.policy.max_value_wei.as_ref().map(|w| w.0.clone()),
            ),
            (
                "TXFLOW_POLICY_APPROVAL_THRESHOLD_WEI",
                s.policy
                    .approval_threshold_wei
                    .as_ref()
                    .map(|w| w.0.clone()),
            ),
            (
                "TXFLOW_APPROVAL_TIMEOUT_MS",
                s.approval.timeout_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_APPROVAL_AFTER_DEEP_REORG",
                s.approval.after_deep_reorg.map(|v| v.to_string()),
            ),
            ("TXFLOW_NODE_NAME", s.node.name.clone()),
            (
                "TXFLOW_LEASE_MS",
                s.lease.duration_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_NONCE_STATE_TIMEOUT_MS",
                s.nonce.state_timeout_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_MAX_IN_FLIGHT",
                s.nonce.max_in_flight.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_RESUBMIT_INTERVAL_MS",
                s.resubmit.interval_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_BUMP_AFTER_MS",
                s.resubmit.bump_after_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_BUMP_PERCENT",
                s.resubmit.bump_percent.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_CONFIRMATIONS_REQUIRED",
                s.confirmations.required.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_RECEIPT_WORKERS",
                s.confirmations.receipt_workers.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_STALE_RECEIPT_TIMEOUT_MS",
                s.confirmations
                    .stale_receipt_timeout_ms
                    .map(|v| v.to_string()),
            ),
            (
                "TXFLOW_MAX_FEE_PER_GAS_WEI",
                s.fees.max_fee_per_gas_wei.map(|v| v.to_string()),
            ),
            ("TXFLOW_LOG", s.log.filter.clone()),
            (
                "TXFLOW_LOG_FORMAT",
                s.log.format.map(|f| {
                    match f {
                        LogFormat::Text => "text",
                        LogFormat::Json => "json",
                    }
                    .to_string()
                }),
            ),
        ];
        let metrics: [(&'static str, Option<String>); 2] = [
            ("TXFLOW_METRICS_ADDR", s.metrics.addr.clone()),
            (
                "TXFLOW_METRICS_SAMPLE_MS",
                s.metrics.sample_ms.map(|v| v.to_string()),
            ),
        ];
        let telemetry: [(&'static str, Option<String>); 2] = [
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                s.telemetry.otlp_endpoint.clone(),
            ),
            ("OTEL_SERVICE_NAME", s.telemetry.service_name.clone()),
        ];
        let spot: [(&'static str, Option<String>); 3] = [
            ("TXFLOW_SPOT_WAL_DIR", s.spot.wal_dir.as_deref().map(path)),
            ("TXFLOW_SPOT_ASSETS", s.spot.assets.clone()),
            (
                "TXFLOW_SPOT_TIMEOUT_MS",
                s.spot.timeout_ms.map(|v| v.to_string()),
            ),
        ];
        let transfer: [(&'static str, Option<String>); 2] = [
            (
                "TXFLOW_TRANSFER_STALE_MS",
                s.transfer.stale_ms.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_TRANSFER_CHECK_INTERVAL_MS",
                s.transfer.check_interval_ms.map(|v| v.to_string()),
            ),
        ];
        let g = &s.gateway;
        let gateway: [(&'static str, Option<String>); 12] = [
            ("TXFLOW_GATEWAY_ADDR", g.addr.clone()),
            ("TXFLOW_GATEWAY_JWT_ALG", g.jwt_alg.clone()),
            (
                "TXFLOW_GATEWAY_JWT_SECRET_FILE",
                g.jwt_secret_file.as_deref().map(path),
            ),
            (
                "TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE",
                g.jwt_public_key_file.as_deref().map(path),
            ),
            (
                "TXFLOW_GATEWAY_JWT_JWKS_FILE",
                g.jwt_jwks_file.as_deref().map(path),
            ),
            ("TXFLOW_GATEWAY_JWT_AUDIENCE", g.jwt_audience.clone()),
            ("TXFLOW_GATEWAY_JWT_ISSUER", g.jwt_issuer.clone()),
            (
                "TXFLOW_GATEWAY_JWT_MAX_LIFETIME_SECS",
                g.jwt_max_lifetime_secs.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_GATEWAY_RATE_PER_SEC",
                g.rate_per_sec.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_GATEWAY_RATE_BURST",
                g.rate_burst.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_GATEWAY_DAILY_COUNT",
                g.daily_count.map(|v| v.to_string()),
            ),
            (
                "TXFLOW_GATEWAY_TIMEOUT_MS",
                g.timeout_ms.map(|v| v.to_string()),
            ),
        ];
        values
            .into_iter()
            .chain(metrics)
            .chain(telemetry)
            .chain(spot)
            .chain(transfer)
            .chain(gateway)
            .filter_map(|(var, v)| v.map(|v| (var, v)))
            .collect()
    }

    /// `config` with this file's values over it. A value its variable would refuse is refused
    /// with the file's key named.
    pub fn apply(&self, config: &mut Config) -> Result<(), ConfigError> {
        let values = self.as_env();
        if let Some(urls) = &self.rpc.urls
            && let Some(bad) = urls.iter().find(|u| u.contains(','))
        {
            return Err(ConfigError::InvalidKey {
                key: "rpc.urls",
                value: crate::chain::redact(bad),
                why: "a URL cannot hold a comma",
            });
        }
        config
            .apply_env(|var| {
                values
                    .iter()
                    .find(|(v, _)| *v == var)
                    .map(|(_, value)| value.clone())
            })
            .map_err(|e| match e {
                ConfigError::Invalid { var, value, why } => ConfigError::InvalidKey {
                    key: key_of(var),
                    value,
                    why,
                },
                other => other,
            })
    }

    /// The configuration `config` as a file, every secret redacted: the database password, the
    /// paths and queries of the RPC and registry URLs (they may hold API keys); the signer keys
    /// are not a key of the file (see [`Config::to_toml_redacted`]).
    pub fn effective(config: &Config) -> ConfigFile {
        // Destructured without `..`: a setting added to `Config` does not compile until it is
        // given a key here.
        let Config {
            database_url,
            kafka,
            schema_registry_url,
            topics,
            partitions,
            rpc_urls,
            chain_id,
            signer_keys: _,
            signer_keys_file,
            policy_whitelist,
            policy_max_value_wei,
            policy_approval_threshold_wei,
            node_name,
            group_prefix,
            lease_ms,
            signer_keystore,
            signer_keystore_password_file,
            resubmit_interval_ms,
            bump_after_ms,
            bump_percent,
            nonce_state_timeout_ms,
            max_in_flight,
            approval_timeout_ms,
            approval_after_deep_reorg,
            rpc_timeout_ms,
            rpc_attempts,
            assignment_timeout_ms,
            receipt_workers,
            stale_receipt_timeout_ms,
            confirmations_required,
            max_fee_per_gas_wei,
            log_filter,
            log_json,
            metrics_addr,
            metrics_sample_ms,
            otlp_endpoint,
            otel_service_name,
            spot_wal_dir,
            spot_assets,
            spot_timeout_ms,
            transfer_stale_ms,
            transfer_check_interval_ms,
            gateway,
        } = config;
        ConfigFile {
            database: DatabaseSection {
                url: Some(redact_database_url(database_url)),
            },
            kafka: KafkaSection {
                brokers: Some(kafka.brokers.clone()),
                fetch_wait_max_ms: Some(kafka.fetch_wait_max_ms),
                replication_factor: Some(kafka.replication_factor),
                group_prefix: group_prefix.clone(),
                session_timeout_ms: Some(kafka.session_timeout_ms),
                heartbeat_interval_ms: Some(kafka.heartbeat_interval_ms),
                group_instance_id: kafka.group_instance_id.clone(),
                assignment_timeout_ms: Some(*assignment_timeout_ms),
            },
            schema_registry: SchemaRegistrySection {
                url: Some(crate::chain::redact(schema_registry_url)),
            },
            topics: TopicsSection {
                prefix: Some(topics.prefix.clone()),
                partitions: Some(*partitions),
            },
            rpc: RpcSection {
                urls: Some(rpc_urls.iter().map(|u| crate::chain::redact(u)).collect()),
                timeout_ms: Some(*rpc_timeout_ms),
                attempts: Some(*rpc_attempts),
            },
            chain: ChainSection {
                id: Some(*chain_id),
            },
            signer: SignerSection {
                keys_file: signer_keys_file.clone(),
                keystore: signer_keystore.clone(),
                keystore_password_file: signer_keystore_password_file.clone(),
            },
            policy: PolicySection {
                whitelist: Some(policy_whitelist.clone()),
                max_value_wei: policy_max_value_wei.clone().map(Wei),
                approval_threshold_wei: policy_approval_threshold_wei.clone().map(Wei),
            },
            approval: ApprovalSection {
                timeout_ms: Some(*approval_timeout_ms),
                after_deep_reorg: Some(*approval_after_deep_reorg),
            },
            node: NodeSection {
                name: node_name.clone(),
            },
            lease: LeaseSection {
                duration_ms: Some(*lease_ms),
            },
            nonce: NonceSection {
                state_timeout_ms: Some(*nonce_state_timeout_ms),
                max_in_flight: Some(*max_in_flight),
            },
            resubmit: ResubmitSection {
                interval_ms: Some(*resubmit_interval_ms),
                bump_after_ms: Some(*bump_after_ms),
                bump_percent: Some(*bump_percent),
            },
            confirmations: ConfirmationsSection {
                required: Some(*confirmations_required),
                receipt_workers: Some(*receipt_workers),
                stale_receipt_timeout_ms: Some(*stale_receipt_timeout_ms),
            },
            fees: FeesSection {
                // Within u64: the setting is at most `chain::MAX_FEE_PER_GAS` (10^18).
                max_fee_per_gas_wei: u64::try_from(*max_fee_per_gas_wei).ok(),
            },
            log: LogSection {
                filter: Some(log_filter.clone()),
                format: Some(if *log_json {
                    LogFormat::Json
                } else {
                    LogFormat::Text
                }),
            },
            metrics: MetricsSection {
                addr: metrics_addr.clone(),
                sample_ms: Some(*metrics_sample_ms),
            },
            telemetry: TelemetrySection {
                otlp_endpoint: otlp_endpoint.as_deref().map(crate::chain::redact),
                service_name: otel_service_name.clone(),
            },
            spot: SpotSection {
                wal_dir: Some(spot_wal_dir.clone()),
                assets: Some(spot_assets.to_string()),
                timeout_ms: Some(*spot_timeout_ms),
            },
            transfer: TransferSection {
                stale_ms: Some(*transfer_stale_ms),
                check_interval_ms: Some(*transfer_check_interval_ms),
            },
            gateway: GatewaySection {
                addr: Some(gateway.addr.clone()),
                jwt_alg: Some(gateway.jwt_alg.as_str().to_string()),
                // Paths, never the keys.
                jwt_secret_file: gateway.jwt_secret_file.clone(),
                jwt_public_key_file: gateway.jwt_public_key_file.clone(),
                jwt_jwks_file: gateway.jwt_jwks_file.clone(),
                jwt_audience: Some(gateway.jwt_audience.clone()),
                jwt_issuer: Some(gateway.jwt_issuer.clone()),
                jwt_max_lifetime_secs: Some(gateway.jwt_max_lifetime_secs),
                rate_per_sec: Some(gateway.rate_per_sec),
                rate_burst: Some(gateway.rate_burst),
                daily_count: Some(gateway.daily_count),
                timeout_ms: Some(gateway.timeout_ms),
            },
        }
    }

    /// This file as TOML text.
    pub fn to_toml(&self) -> Result<String, toml::ser::Error> {
        toml::to_string(self)
    }
}

/// The file key of the setting `var` carries.
fn key_of(var: &'static str) -> &'static str {
    KEYS.iter()
        .find(|(_, v)| *v == var)
        .map_or(var, |(key, _)| key)
}

impl Config {
    /// The layers under the command line: built-in defaults, then the file at `file` (if any),
    /// then the variables `lookup` answers (the environment), then the signer keys file read.
    /// With no file this is exactly [`Config::from_lookup`].
    pub fn load(
        file: Option<&Path>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        if let Some(path) = file {
            ConfigFile::read(path)?
                .apply(&mut c)
                .map_err(|e| ConfigError::File {
                    path: path.to_path_buf(),
                    source: Box::new(e),
                })?;
        }
        c.apply_env(lookup)?;
        c.read_signer_keys_file()?;
        Ok(c)
    }

    /// The effective configuration as TOML, every secret redacted (`txflow config`). Whether
    /// signer keys are set is said in a comment, so that the text stays a file txflow loads.
    pub fn to_toml_redacted(&self) -> Result<String, toml::ser::Error> {
        let text = ConfigFile::effective(self).to_toml()?;
        if self.signer_keys.expose().is_empty() {
            return Ok(text);
        }
        let note = "# keys = \"***\" (signer keys are set: from keys_file or TXFLOW_SIGNER_KEYS)\n";
        Ok(match text.find("[signer]\n") {
            Some(at) => {
                let at = at + "[signer]\n".len();
                format!("{}{note}{}", &text[..at], &text[at..])
            }
            None => format!("{text}\n[signer]\n{note}"),
        })
    }
}

#[cfg(test)]
mod tests {

    /// docs/configuration.md is the reference: every key of [`KEYS`], in backticks, with its
    /// environment variable. A key added without its documentation fails here.
    #[test]
    fn every_key_and_its_variable_is_in_docs_configuration_md() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md");
        let doc = std::fs::read_to_string(path).expect("docs/configuration.md");
        let missing: Vec<&str> = KEYS
            .iter()
            .filter(|(key, var)| !doc.contains(&format!("`{key}`")) || !doc.contains(var))
            .map(|(key, _)| *key)
            .collect();
        assert!(
            missing.is_empty(),
            "docs/configuration.md does not document {missing:?} (the key in backticks and its variable)"
        );
    }

    use std::collections::{BTreeSet, HashMap};

    use super::*;

    const EXAMPLE: &str = include_str!("../../../deploy/txflow.example.toml");

    /// A file of its own under the temporary directory, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(text: &str) -> TempFile {
            let path = std::env::temp_dir().join(format!("txflow-config-{}", uuid::Uuid::new_v4()));
            std::fs::write(&path, text).expect("write a temporary file");
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.get(k).cloned()
    }

    fn parse(text: &str) -> Result<ConfigFile, ConfigError> {
        ConfigFile::parse(Path::new("txflow.toml"), text)
    }

    #[test]
    fn a_file_sets_values_and_the_environment_overrides_them() {
        let file = TempFile::new(
            "[lease]\nduration_ms = 4000\n[confirmations]\nrequired = 3\n\
             [rpc]\nurls = [\"http://a:1\", \"http://b:2\"]\n[policy]\nmax_value_wei = 5\n",
        );
        let c = Config::load(Some(&file.0), env(&[])).expect("valid");
        assert_eq!(c.lease_ms, 4000);
        assert_eq!(c.confirmations_required, 3);
        assert_eq!(c.rpc_urls, ["http://a:1", "http://b:2"]);
        assert_eq!(c.policy_max_value_wei.as_deref(), Some("5"));
        assert_eq!(c.partitions, Config::default().partitions, "a key left out");

        let c = Config::load(Some(&file.0), env(&[("TXFLOW_LEASE_MS", "5000")])).expect("valid");
        assert_eq!(c.lease_ms, 5000, "the environment is above the file");
        assert_eq!(c.confirmations_required, 3);
    }

    #[test]
    fn the_topic_replication_factor_is_a_file_key_under_the_environment() {
        let file = TempFile::new("[kafka]\nreplication_factor = 3\n");
        let c = Config::load(Some(&file.0), env(&[])).expect("valid");
        assert_eq!(c.kafka.replication_factor, 3);
        let c = Config::load(
            Some(&file.0),
            env(&[("TXFLOW_TOPIC_REPLICATION_FACTOR", "2")]),
        )
        .expect("valid");
        assert_eq!(
            c.kafka.replication_factor, 2,
            "the environment is above the file"
        );
        let shown = c.to_toml_redacted().expect("printable");
        assert!(shown.contains("replication_factor = 2"), "{shown}");

        let err = parse("[kafka]\nreplication_factor = 0\n")
            .and_then(|f| f.apply(&mut Config::default()))
            .expect_err("no replica");
        assert!(
            matches!(&err, ConfigError::InvalidKey { key: "kafka.replication_factor", value, .. } if value == "0"),
            "{err:?}"
        );
    }

    #[test]
    fn spot_keys_are_set_by_the_file_and_overridden_by_the_environment() {
        let file = TempFile::new("[spot]\nwal_dir = \"/file/wal\"\nassets = \"EUR:2,BTC:8\"\n");
        let c = Config::load(Some(&file.0), env(&[])).expect("valid");
        assert_eq!(c.spot_wal_dir, PathBuf::from("/file/wal"));
        assert_eq!(c.spot_assets.places("EUR"), Some(2));
        assert_eq!(c.spot_assets.places("USDT"), None);

        let c = Config::load(
            Some(&file.0),
            env(&[
                ("TXFLOW_SPOT_WAL_DIR", "/env/wal"),
                ("TXFLOW_SPOT_ASSETS", "USDT:6"),
            ]),
        )
        .expect("valid");
        assert_eq!(
            c.spot_wal_dir,
            PathBuf::from("/env/wal"),
            "the environment wins"
        );
        assert_eq!(
            c.spot_assets.places("USDT"),
            Some(6),
            "the environment wins"
        );
        assert_eq!(c.spot_assets.places("EUR"), None);

        // One key from each layer.
        let c =
            Config::load(Some(&file.0), env(&[("TXFLOW_SPOT_ASSETS", "USDT:6")])).expect("valid");
        assert_eq!(c.spot_wal_dir, PathBuf::from("/file/wal"));
        assert_eq!(c.spot_assets.places("USDT"), Some(6));

        // Printed by `txflow config`, and read back as itself.
        let printed = TempFile::new(&c.to_toml_redacted().expect("printable"));
        assert_eq!(
            Config::load(Some(&printed.0), env(&[])).expect("reads back"),
            c
        );
    }

    #[test]
    fn without_a_file_loading_is_the_environment_over_the_defaults() {
        let vars = [("TXFLOW_PARTITIONS", "4"), ("TXFLOW_NODE_NAME", "n1")];
        assert_eq!(
            Config::load(None, env(&vars)).expect("valid"),
            Config::from_lookup(env(&vars)).expect("valid")
        );
        assert_eq!(
            Config::load(None, env(&[])).expect("valid"),
            Config::default()
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_the_key_named() {
        for (text, key, why) in [
            (
                "[confirmations]\nrequird = 3\n",
                "confirmations.requird",
                "unknown field",
            ),
            ("[leases]\nduration_ms = 3\n", "leases", "unknown field"),
            (
                "[lease]\nduration_ms = \"abc\"\n",
                "lease.duration_ms",
                "invalid type",
            ),
            (
                "[lease]\nduration_ms = -1\n",
                "lease.duration_ms",
                "invalid value",
            ),
            ("[log]\nformat = \"xml\"\n", "log.format", "unknown variant"),
            (
                "[policy]\nmax_value_wei = \"1e18\"\n",
                "policy.max_value_wei",
                "invalid value",
            ),
            // Keys are given by file reference only.
            (
                "[signer]\nkeys = \"0xac09\"\n",
                "signer.keys",
                "unknown field",
            ),
        ] {
            let err = parse(text).expect_err(text);
            let shown = err.to_string();
            assert!(matches!(err, ConfigError::Key { .. }), "{text}: {err:?}");
            assert!(shown.contains(&format!(": {key}: ")), "{shown}");
            assert!(shown.contains(why), "{shown}");
        }
        // Values of the right type outside the setting's range: the variable's rule, the key's
        // name.
        for (text, key) in [
            ("[lease]\nduration_ms = 10\n", "lease.duration_ms"),
            ("[topics]\npartitions = 0\n", "topics.partitions"),
            (
                "[kafka]\nreplication_factor = 0\n",
                "kafka.replication_factor",
            ),
            ("[topics]\nprefix = \"a b\"\n", "topics.prefix"),
            ("[node]\nname = \"\"\n", "node.name"),
            (
                "[fees]\nmax_fee_per_gas_wei = 0\n",
                "fees.max_fee_per_gas_wei",
            ),
            ("[rpc]\nurls = [\"http://a,b\"]\n", "rpc.urls"),
            ("[nonce]\nmax_in_flight = 0\n", "nonce.max_in_flight"),
            ("[approval]\ntimeout_ms = 10\n", "approval.timeout_ms"),
            ("[spot]\nassets = \"BTC:8,BTC:6\"\n", "spot.assets"),
            ("[spot]\nassets = \"usdt:6\"\n", "spot.assets"),
            ("[spot]\nwal_dir = \"\"\n", "spot.wal_dir"),
        ] {
            let err = parse(text)
                .and_then(|f| f.apply(&mut Config::default()))
                .expect_err(text);
            let shown = err.to_string();
            assert!(
                shown.starts_with(&format!("{key}: invalid value ")) && !shown.contains("TXFLOW_"),
                "{shown}"
            );
        }
        let err = parse("[lease\n").expect_err("not TOML");
        assert!(matches!(err, ConfigError::Syntax { .. }), "{err:?}");
    }

    #[test]
    fn signer_keys_come_from_a_file_unless_the_environment_gives_them() {
        let a = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";
        let b = "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d";
        let keys = TempFile::new(&format!("{a}\n{b}\n"));
        let file = TempFile::new(&format!(
            "[signer]\nkeys_file = {:?}\n",
            keys.0.to_string_lossy()
        ));
        let c = Config::load(Some(&file.0), env(&[])).expect("valid");
        assert_eq!(c.signer_keys.expose(), format!("{a},{b}"));
        let c = Config::load(Some(&file.0), env(&[("TXFLOW_SIGNER_KEYS", b)])).expect("valid");
        assert_eq!(
            c.signer_keys.expose(),
            b,
            "the environment is above the file"
        );
        assert_eq!(c.signer_keys_file, None);
        let err = Config::load(
            None,
            env(&[("TXFLOW_SIGNER_KEYS_FILE", "/nonexistent/keys")]),
        )
        .expect_err("a missing keys file");
        assert!(err.to_string().contains("/nonexistent/keys"), "{err}");
        Config::from_lookup(env(&[
            ("TXFLOW_SIGNER_KEYS", a),
            ("TXFLOW_SIGNER_KEYS_FILE", "/k"),
        ]))
        .expect_err("keys given twice");
    }

    #[test]
    fn the_effective_configuration_shows_no_secret_and_reads_back() {
        let key = "ac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";
        let c = Config::from_lookup(env(&[
            ("TXFLOW_SIGNER_KEYS", key),
            ("TXFLOW_DATABASE_URL", "postgres://u:DBPASSWORD@h:5432/db"),
            (
                "TXFLOW_RPC_URLS",
                "https://rpc.example.com/v3/APIKEY?k=APIKEY2",
            ),
            (
                "TXFLOW_SCHEMA_REGISTRY_URL",
                "https://reg.example.com/REGKEY",
            ),
        ]))
        .expect("valid");
        let shown = c.to_toml_redacted().expect("printable");
        for secret in [&key[..16], "DBPASSWORD", "APIKEY", "REGKEY"] {
            assert!(!shown.contains(secret), "{secret} in\n{shown}");
        }
        assert!(shown.contains("postgres://u:***@h:5432/db"), "{shown}");
        assert!(shown.contains("[signer]\n# keys = \"***\""), "{shown}");
        // The keys are a comment: the text is still a file txflow loads.
        let printed = TempFile::new(&shown);
        Config::load(Some(&printed.0), env(&[])).expect("reads back");

        // With nothing secret in it, the printed configuration is a file that loads as itself.
        let c = Config::from_lookup(env(&[
            ("TXFLOW_NODE_NAME", "n1"),
            ("TXFLOW_LOG_FORMAT", "json"),
        ]))
        .expect("valid");
        let printed = TempFile::new(&c.to_toml_redacted().expect("printable"));
        assert_eq!(
            Config::load(Some(&printed.0), env(&[])).expect("reads back"),
            c
        );
    }

    /// The example with its commented-out keys (`# key = value`) uncommented.
    fn example_uncommented() -> String {
        EXAMPLE
            .lines()
            .map(|line| match line.strip_prefix("# ") {
                Some(rest)
                    if rest.split_once(" = ").is_some_and(|(k, _)| {
                        !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    }) =>
                {
                    rest
                }
                _ => line,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_example_file_holds_the_defaults_and_every_key() {
        let example = Path::new("deploy/txflow.example.toml");
        // The keys it sets are the built-in defaults (the file says "Default" for each).
        let file = parse(EXAMPLE).expect("the example parses");
        let mut c = Config::default();
        file.apply(&mut c).expect("the example's values are valid");
        assert_eq!(
            c,
            Config::default(),
            "{example:?} differs from the defaults"
        );

        // Its commented-out keys are keys too, of the right types.
        let full = parse(&example_uncommented()).expect("the uncommented example parses");
        let vars: BTreeSet<&str> = full.as_env().iter().map(|(var, _)| *var).collect();
        let known: BTreeSet<&str> = KEYS.iter().map(|(_, var)| *var).collect();
        assert_eq!(vars, known, "the example sets every key once uncommented");

        // Every key appears, with its environment variable; the file has no key `KEYS` lacks,
        // nor does `txflow config` print one.
        fn leaves(table: &toml::Table) -> BTreeSet<String> {
            table
                .iter()
                .flat_map(|(section, v)| {
                    v.as_table()
                        .into_iter()
                        .flat_map(move |t| t.keys().map(move |k| format!("{section}.{k}")))
                })
                .collect()
        }
        let keys: BTreeSet<String> = KEYS.iter().map(|(key, _)| key.to_string()).collect();
        let table: toml::Table = example_uncommented().parse().expect("TOML");
        assert_eq!(leaves(&table), keys);
        for (_, var) in KEYS {
            assert!(EXAMPLE.contains(var), "{var} is not in the example");
        }
        let printed: toml::Table = Config::default()
            .to_toml_redacted()
            .expect("printable")
            .parse()
            .expect("TOML");
        assert!(leaves(&printed).is_subset(&keys), "{printed:?}");
    }
}
