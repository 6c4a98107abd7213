//! The gateway's settings, from the shared `Config` (`gateway.*`): the JWT key is read from its
//! file here, once, at start; a missing or unusable key stops the gateway before it listens.

use std::path::{Path, PathBuf};
use std::time::Duration;

use jsonwebtoken::DecodingKey;
use txflow_core::config::{Config, JwtAlg};
use txflow_core::kafka::{KafkaSettings, Topics};
use txflow_core::retry::{Classify, Retry};

use crate::auth::Verifier;

/// The largest request body accepted (a transfer request is a few hundred bytes).
pub const BODY_LIMIT: usize = 16 * 1024;

/// The largest calldata a tx request may carry (the allocator's limit).
pub const MAX_TX_DATA_BYTES: usize = 128 * 1024;

/// The largest tx request body: the calldata as hex, plus room for the other fields.
pub const TX_BODY_LIMIT: usize = 2 * MAX_TX_DATA_BYTES + 16 * 1024;

/// The shortest HS256 secret accepted (RFC 7518 §3.2: at least the hash's size).
pub const MIN_SECRET_LEN: usize = 32;

/// No `Debug`: it holds the database URL (with its password, if any) and the JWT key.
pub struct GatewayConfig {
    pub addr: String,
    pub database_url: String,
    pub verifier: Verifier,
    pub rate_per_sec: u32,
    pub rate_burst: u32,
    /// The transfers a user may create per UTC day (DAILY_LIMIT_EXCEEDED past it).
    pub daily_count: u32,
    pub timeout: Duration,
    pub body_limit: usize,
    /// The broker, the registry and the topics the gateway produces to (and creates at start).
    pub kafka: KafkaSettings,
    pub registry_url: String,
    pub topics: Topics,
    pub partitions: i32,
    /// The chain this deployment serves: a tx request for another chain is refused.
    pub chain_id: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayConfigError {
    #[error("gateway.{key} ({var}) is required with gateway.jwt_alg = {alg}")]
    MissingKeyFile {
        key: &'static str,
        var: &'static str,
        alg: &'static str,
    },
    #[error("cannot read {what} {}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {} is not usable", path.display())]
    Key {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: jsonwebtoken::errors::Error,
    },
    #[error("the HS256 secret in {} is shorter than {MIN_SECRET_LEN} bytes", path.display())]
    WeakSecret { path: PathBuf },
}

impl Classify for GatewayConfigError {
    fn retry(&self) -> Retry {
        Retry::Permanent
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, GatewayConfigError> {
    std::fs::read(path).map_err(|source| GatewayConfigError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

impl GatewayConfig {
    pub fn from_config(c: &Config) -> Result<GatewayConfig, GatewayConfigError> {
        let g = &c.gateway;
        let key = match g.jwt_alg {
            JwtAlg::Hs256 => {
                let path =
                    g.jwt_secret_file
                        .as_deref()
                        .ok_or(GatewayConfigError::MissingKeyFile {
                            key: "jwt_secret_file",
                            var: "TXFLOW_GATEWAY_JWT_SECRET_FILE",
                            alg: "HS256",
                        })?;
                let mut secret = read("the JWT secret file", path)?;
                // A file written by an editor or `echo` ends with a line break: not the secret's.
                while secret.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    secret.pop();
                }
                if secret.len() < MIN_SECRET_LEN {
                    return Err(GatewayConfigError::WeakSecret {
                        path: path.to_path_buf(),
                    });
                }
                DecodingKey::from_secret(&secret)
            }
            JwtAlg::Rs256 => {
                let path =
                    g.jwt_public_key_file
                        .as_deref()
                        .ok_or(GatewayConfigError::MissingKeyFile {
                            key: "jwt_public_key_file",
                            var: "TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE",
                            alg: "RS256",
                        })?;
                let pem = read("the JWT public key file", path)?;
                DecodingKey::from_rsa_pem(&pem).map_err(|source| GatewayConfigError::Key {
                    what: "the JWT public key file",
                    path: path.to_path_buf(),
                    source,
                })?
            }
        };
        Ok(GatewayConfig {
            addr: g.addr.clone(),
            database_url: c.database_url.clone(),
            verifier: Verifier::new(g.jwt_alg, key),
            rate_per_sec: g.rate_per_sec,
            rate_burst: g.rate_burst,
            daily_count: g.daily_count,
            timeout: Duration::from_millis(g.timeout_ms),
            body_limit: BODY_LIMIT,
            kafka: c.kafka.clone(),
            registry_url: c.schema_registry_url.clone(),
            topics: c.topics.clone(),
            partitions: c.partitions,
            chain_id: c.chain_id,
        })
    }
}
