//! The signer gateway role: ALLOCATED → SIGNED. Signs with alloy's local signer (keys from
//! `TXFLOW_SIGNER_KEYS`, never logged) and persists the raw transaction and its hash as attempt 1
//! before announcing TxSigned; a persisted attempt is never signed again.
//!
//! Not built yet: the policy re-check and bumped attempts (issue #5, #6).

use std::collections::HashMap;

use alloy::primitives::{Address, Bytes, U256};
use alloy::signers::local::PrivateKeySigner;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use txflow_core::chain::{UnsignedTx, sign};
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::domain::{ChainId, NodeId, Signer};
use txflow_core::events::{TxAllocated, TxSigned};
use txflow_core::fenced::{FENCE_PREDICATE, Fenced};
use txflow_core::kafka::{Topics, signer_key};
use txflow_core::lease::{LeaseConfig, LeaseManager};
use txflow_core::role::{Role, RoleError};
use txflow_core::stage::{
    DriveCtx, Handler, HandlerError, Output, Rejection, StageConfig, StageRuntime,
};

/// Local keys by address. `Debug` shows addresses only.
#[derive(Clone, Default)]
pub struct Keys(HashMap<Signer, PrivateKeySigner>);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.keys()).finish()
    }
}

impl Keys {
    /// Parses comma-separated hex private keys. The error names the position, never the key.
    pub fn parse(list: &str) -> Result<Keys, RoleError> {
        let mut keys = HashMap::new();
        for (i, k) in list
            .split(',')
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .enumerate()
        {
            let signer: PrivateKeySigner = k.parse().map_err(|_| {
                RoleError::Config(format!(
                    "TXFLOW_SIGNER_KEYS: key #{} is not a private key",
                    i + 1
                ))
            })?;
            let address = Signer::parse(&format!("{:#x}", signer.address()))
                .map_err(|e| RoleError::Config(e.to_string()))?;
            keys.insert(address, signer);
        }
        Ok(Keys(keys))
    }

    pub fn from_signers(list: impl IntoIterator<Item = PrivateKeySigner>) -> Keys {
        Keys(
            list.into_iter()
                .filter_map(|s| {
                    Signer::parse(&format!("{:#x}", s.address()))
                        .ok()
                        .map(|a| (a, s))
                })
                .collect(),
        )
    }

    pub fn get(&self, s: &Signer) -> Option<&PrivateKeySigner> {
        self.0.get(s)
    }
}

pub struct SignStage {
    pub topics: Topics,
    pub keys: Keys,
}

fn transient(context: &str, e: impl std::error::Error + Send + Sync + 'static) -> HandlerError {
    HandlerError::transient(context.to_string(), e)
}

fn invalid(what: &str) -> HandlerError {
    HandlerError::Reject(Rejection::new(
        "INVALID_ALLOCATION",
        format!("{what} is not valid"),
    ))
}

impl Handler for SignStage {
    type Input = TxAllocated;

    fn role(&self) -> Role {
        Role::SignerGateway
    }

    fn input_topic(&self) -> String {
        self.topics.tx_allocated()
    }

    fn route(&self, a: &TxAllocated) -> Result<(ChainId, Signer), Rejection> {
        let s = Signer::parse(&a.signer)
            .map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))?;
        Ok((ChainId(a.chain_id), s))
    }

    async fn handle(
        &self,
        w: &mut Fenced<'_>,
        a: &TxAllocated,
    ) -> Result<Vec<Output>, HandlerError> {
        let key = signer_key(a.chain_id, &a.signer);
        let tx_id = uuid::Uuid::parse_str(&a.tx_id).map_err(|_| invalid("tx_id"))?;
        // A persisted attempt is never signed again: re-announce it.
        let existing: Vec<(serde_json::Value,)> = w
            .read(
                "sign",
                sqlx::query_as(
                    "SELECT e.payload FROM tx_events e WHERE e.tx_id = $1 AND e.type = 'TxSigned'
                     ORDER BY e.created_at LIMIT 1",
                )
                .bind(tx_id),
            )
            .await?;
        if let Some((p,)) = existing.into_iter().next() {
            let signed: TxSigned =
                serde_json::from_value(p).map_err(|e| transient("stored event", e))?;
            return Ok(vec![Output::new(
                self.topics.tx_signed(),
                Subjects::TopicName,
                key,
                signed,
            )]);
        }
        let signer = w.lease().key().signer.clone();
        let Some(local) = self.keys.get(&signer) else {
            return Err(HandlerError::Reject(Rejection::new(
                "NO_SIGNING_KEY",
                format!("no key for {signer}"),
            )));
        };
        let unsigned = UnsignedTx {
            chain_id: a.chain_id as u64,
            nonce: u64::try_from(a.nonce).map_err(|_| invalid("nonce"))?,
            to: a.to.parse::<Address>().map_err(|_| invalid("to"))?,
            value: U256::from_str_radix(&a.value, 10).map_err(|_| invalid("value"))?,
            data: Bytes::from(a.data.clone()),
            gas_limit: u64::try_from(a.gas_limit).map_err(|_| invalid("gas_limit"))?,
            max_fee_per_gas: a
                .max_fee_per_gas
                .parse()
                .map_err(|_| invalid("max_fee_per_gas"))?,
            max_priority_fee_per_gas: a
                .max_priority_fee_per_gas
                .parse()
                .map_err(|_| invalid("max_priority_fee_per_gas"))?,
        };
        let signed = sign(local, &unsigned)
            .map_err(|e| HandlerError::Reject(Rejection::new("SIGNING_FAILED", e.to_string())))?;
        let event = TxSigned {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: a.tx_id.clone(),
            chain_id: a.chain_id,
            signer: signer.as_str().to_string(),
            nonce: a.nonce,
            attempt: 1,
            tx_hash: format!("{:#x}", signed.hash),
            raw_tx: signed.raw.clone(),
            max_fee_per_gas: a.max_fee_per_gas.clone(),
            max_priority_fee_per_gas: a.max_priority_fee_per_gas.clone(),
            fencing_token: w.lease().token().0,
        };
        let event_json = serde_json::to_value(&event).map_err(|e| transient("event", e))?;
        let event_id =
            uuid::Uuid::parse_str(&event.event_id).map_err(|e| transient("event id", e))?;
        let sql = format!(
            "WITH upd AS (
                 UPDATE managed_tx SET state = 'SIGNED', fencing_token = $5, updated_at = now()
                 WHERE tx_id = $6 AND state = 'ALLOCATED' AND nonce = $7 AND {FENCE_PREDICATE}
                 RETURNING tx_id),
             att AS (
                 INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas, max_priority_fee_per_gas)
                 SELECT tx_id, 1, $8, $9, $10::numeric, $11::numeric FROM upd
                 RETURNING tx_id)
             INSERT INTO tx_events (event_id, tx_id, type, payload)
             SELECT $12, tx_id, 'TxSigned', $13 FROM att RETURNING tx_id"
        );
        w.fetch_one::<(uuid::Uuid,)>("sign", &sql, |q| {
            q.bind(tx_id)
                .bind(a.nonce)
                .bind(event.tx_hash.clone())
                .bind(signed.raw.clone())
                .bind(a.max_fee_per_gas.clone())
                .bind(a.max_priority_fee_per_gas.clone())
                .bind(event_id)
                .bind(event_json)
        })
        .await?;
        Ok(vec![Output::new(
            self.topics.tx_signed(),
            Subjects::TopicName,
            key,
            event,
        )])
    }

    async fn pending_signers(&self, _pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        Ok(Vec::new())
    }

    async fn drive(&self, _ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        Ok(Vec::new())
    }
}

/// The signer gateway's stage runtime for `config` with `keys`.
pub async fn runtime(
    config: &Config,
    keys: Keys,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<SignStage>, RoleError> {
    let pool = txflow_core::db::connect(&config.database_url, 8).await?;
    let leases = LeaseManager::new(pool.clone(), Role::SignerGateway, node, lease)?;
    let sc = StageConfig::for_pipeline(config, "signer-gateway", lease);
    let stage = SignStage {
        topics: config.topics.clone(),
        keys,
    };
    Ok(StageRuntime::new(
        stage,
        pool,
        RegistryCodec::new(&config.schema_registry_url),
        config.kafka.clone(),
        leases,
        sc,
    ))
}

/// Runs the role until `shutdown`.
pub async fn run_until(config: &Config, shutdown: CancellationToken) -> Result<(), RoleError> {
    let keys = Keys::parse(config.signer_keys.expose())?;
    let rt = runtime(config, keys, NodeId::generate(), LeaseConfig::default()).await?;
    rt.run(shutdown).await?;
    Ok(())
}

/// Runs the role until Ctrl-C.
pub async fn run(config: &Config) -> Result<(), RoleError> {
    run_until(config, txflow_core::stage::ctrl_c_token()).await
}
