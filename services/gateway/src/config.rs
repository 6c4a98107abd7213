//! The gateway's settings, from the shared `Config` (`gateway.*`): the JWT key is read from its
//! file here, once, at start; a missing or unusable key stops the gateway before it listens.

use std::path::{Path, PathBuf};
use std::time::Duration;

use jsonwebtoken::jwk::{JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey};
use txflow_core::config::{Config, JwtAlg};
use txflow_core::kafka::{KafkaSettings, Topics};
use txflow_core::retry::{Classify, Retry};

use crate::auth::{Key, Verifier};

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
    #[error("the JWKS file {} is not a JSON Web Key Set", path.display())]
    Jwks {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("the JWKS file {}: key {index} {why}", path.display())]
    JwksKey {
        path: PathBuf,
        index: usize,
        why: &'static str,
    },
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
        let keys = match &g.jwt_jwks_file {
            Some(path) => jwks(path)?,
            None => vec![single_key(g)?],
        };
        Ok(GatewayConfig {
            addr: g.addr.clone(),
            database_url: c.database_url.clone(),
            verifier: Verifier::new(
                keys,
                g.jwt_audience.clone(),
                g.jwt_issuer.clone(),
                g.jwt_max_lifetime_secs,
            ),
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

/// The one key of `jwt_secret_file` (HS256) or `jwt_public_key_file` (RS256, ES256), with no
/// `kid`.
fn single_key(g: &txflow_core::config::GatewaySettings) -> Result<Key, GatewayConfigError> {
    let public = |alg: &'static str| {
        g.jwt_public_key_file
            .as_deref()
            .ok_or(GatewayConfigError::MissingKeyFile {
                key: "jwt_public_key_file",
                var: "TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE",
                alg,
            })
    };
    let unusable = |path: &Path| {
        let path = path.to_path_buf();
        move |source| GatewayConfigError::Key {
            what: "the JWT public key file",
            path,
            source,
        }
    };
    let (alg, key) = match g.jwt_alg {
        JwtAlg::Hs256 => {
            let path = g
                .jwt_secret_file
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
            (Algorithm::HS256, DecodingKey::from_secret(&secret))
        }
        JwtAlg::Rs256 => {
            let path = public("RS256")?;
            let pem = read("the JWT public key file", path)?;
            (
                Algorithm::RS256,
                DecodingKey::from_rsa_pem(&pem).map_err(unusable(path))?,
            )
        }
        JwtAlg::Es256 => {
            let path = public("ES256")?;
            let pem = read("the JWT public key file", path)?;
            (
                Algorithm::ES256,
                DecodingKey::from_ec_pem(&pem).map_err(unusable(path))?,
            )
        }
    };
    Ok(Key {
        kid: None,
        alg,
        key,
    })
}

/// The keys of a JSON Web Key Set: each needs its `kid` (unique) and its `alg` (HS256, RS256 or
/// ES256); an HS256 key (`kty: oct`) at least [`MIN_SECRET_LEN`] bytes.
fn jwks(path: &Path) -> Result<Vec<Key>, GatewayConfigError> {
    let text = read("the JWKS file", path)?;
    let set: JwkSet = serde_json::from_slice(&text).map_err(|source| GatewayConfigError::Jwks {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |index: usize, why: &'static str| GatewayConfigError::JwksKey {
        path: path.to_path_buf(),
        index,
        why,
    };
    if set.keys.is_empty() {
        return Err(bad(0, "is missing: the set has no key"));
    }
    let mut keys: Vec<Key> = Vec::with_capacity(set.keys.len());
    for (index, jwk) in set.keys.iter().enumerate() {
        let kid = jwk
            .common
            .key_id
            .clone()
            .filter(|k| !k.is_empty())
            .ok_or_else(|| bad(index, "has no kid"))?;
        if keys.iter().any(|k| k.kid.as_deref() == Some(kid.as_str())) {
            return Err(bad(index, "repeats the kid of an earlier key"));
        }
        let alg = match jwk.common.key_algorithm {
            Some(KeyAlgorithm::HS256) => Algorithm::HS256,
            Some(KeyAlgorithm::RS256) => Algorithm::RS256,
            Some(KeyAlgorithm::ES256) => Algorithm::ES256,
            _ => return Err(bad(index, "has no alg of HS256, RS256 or ES256")),
        };
        if let jsonwebtoken::jwk::AlgorithmParameters::OctetKey(oct) = &jwk.algorithm {
            // base64url without padding: 4 characters per 3 bytes.
            if oct.value.len() * 3 / 4 < MIN_SECRET_LEN {
                return Err(bad(index, "is an HS256 secret shorter than 32 bytes"));
            }
        }
        let key = DecodingKey::from_jwk(jwk).map_err(|source| GatewayConfigError::Key {
            what: "a key of the JWKS file",
            path: path.to_path_buf(),
            source,
        })?;
        keys.push(Key {
            kid: Some(kid),
            alg,
            key,
        });
    }
    Ok(keys)
}
