//! The broadcaster role: SIGNED → SUBMITTED. The signed payload persisted by the signer gateway is
//! sent outside any transaction (the intent is already committed), the node's answer classified
//! (accepted / possibly sent / rejected retryable / permanent), and the submission recorded,
//! fenced. A transaction still SIGNED is sent again by the recovery scan; sending the same raw
//! transaction twice is harmless (the node answers "already known").
//!
//! Not built yet: resubmission schedule, stuck detection and bumps, noop fill (issue #6).

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use txflow_core::chain::{Chain, SendOutcome};
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::domain::{ChainId, NodeId, Signer};
use txflow_core::events::{SubmitOutcome, TxSigned, TxSubmitted};
use txflow_core::fenced::{FENCE_PREDICATE, Fenced};
use txflow_core::kafka::{Topics, signer_key};
use txflow_core::lease::{LeaseConfig, LeaseManager};
use txflow_core::retry::Classify;
use txflow_core::role::{Role, RoleError};
use txflow_core::stage::{
    DriveCtx, Handler, HandlerError, Output, Rejection, StageConfig, StageRuntime,
};

pub struct BroadcastStage {
    pub topics: Topics,
    pub chain: Chain,
    pub chain_id: ChainId,
}

fn transient(context: &str, e: impl std::error::Error + Send + Sync + 'static) -> HandlerError {
    HandlerError::transient(context.to_string(), e)
}

type Signed = (uuid::Uuid, i64, i32, String, Vec<u8>);

impl Handler for BroadcastStage {
    type Input = TxSigned;

    fn role(&self) -> Role {
        Role::Broadcaster
    }

    fn input_topic(&self) -> String {
        self.topics.tx_signed()
    }

    fn route(&self, s: &TxSigned) -> Result<(ChainId, Signer), Rejection> {
        let signer = Signer::parse(&s.signer)
            .map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))?;
        Ok((ChainId(s.chain_id), signer))
    }

    /// Nothing to write: the attempt was persisted before TxSigned was produced. The send happens
    /// in `drive`, right after the batch commits.
    async fn handle(
        &self,
        _w: &mut Fenced<'_>,
        _s: &TxSigned,
    ) -> Result<Vec<Output>, HandlerError> {
        Ok(Vec::new())
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        txflow_core::stage::signers_in_states(pool, self.chain_id, &["SIGNED"]).await
    }

    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let key = ctx.lease.key();
        let signed: Vec<Signed> = sqlx::query_as(
            "SELECT m.tx_id, m.nonce, a.attempt, a.tx_hash, a.raw_tx FROM managed_tx m
             JOIN LATERAL (SELECT attempt, tx_hash, raw_tx FROM tx_attempts WHERE tx_id = m.tx_id
                           ORDER BY attempt DESC LIMIT 1) a ON true
             WHERE m.chain_id = $1 AND m.signer = $2 AND m.state = 'SIGNED' ORDER BY m.nonce",
        )
        .bind(key.chain_id.0)
        .bind(key.signer.as_str())
        .fetch_all(ctx.pool)
        .await
        .map_err(|e| transient("list signed", e))?;
        if signed.is_empty() {
            return Ok(Vec::new());
        }
        // Send in nonce order, outside any transaction; stop at the first one the node refuses
        // for now (later nonces would only queue behind the gap).
        let mut sent = Vec::new();
        for (tx_id, nonce, attempt, hash, raw) in signed {
            match self.chain.send_raw(&raw).await {
                Ok(SendOutcome::Accepted) => {
                    sent.push((tx_id, nonce, attempt, hash, SubmitOutcome::Accepted))
                }
                Ok(SendOutcome::PossiblySent { .. }) => {
                    sent.push((tx_id, nonce, attempt, hash, SubmitOutcome::PossiblySent))
                }
                Ok(SendOutcome::Rejected { retryable, reason }) => {
                    tracing::warn!(signer = %key.signer, nonce, retryable, %reason, "the node refused a transaction");
                    break;
                }
                Err(e) => {
                    tracing::warn!(signer = %key.signer, nonce, error = %e, transient = e.is_transient(), "sending failed");
                    break;
                }
            }
        }
        if sent.is_empty() {
            return Ok(Vec::new());
        }
        let skey = signer_key(key.chain_id.0, key.signer.as_str());
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let mut outputs = Vec::with_capacity(sent.len());
        for (tx_id, nonce, attempt, hash, outcome) in sent {
            let event = TxSubmitted {
                event_id: uuid::Uuid::new_v4().to_string(),
                tx_id: tx_id.to_string(),
                chain_id: key.chain_id.0,
                signer: key.signer.as_str().to_string(),
                nonce,
                attempt,
                tx_hash: hash,
                outcome,
                submitted_at_ms: chrono::Utc::now().timestamp_millis(),
                fencing_token: ctx.lease.token().0,
            };
            let json = serde_json::to_value(&event).map_err(|e| transient("event", e))?;
            let event_id =
                uuid::Uuid::parse_str(&event.event_id).map_err(|e| transient("event id", e))?;
            let sql = format!(
                "WITH upd AS (
                     UPDATE managed_tx SET state = 'SUBMITTED', fencing_token = $5, updated_at = now()
                     WHERE tx_id = $6 AND state = 'SIGNED' AND {FENCE_PREDICATE}
                     RETURNING tx_id),
                 att AS (
                     UPDATE tx_attempts SET submitted_at = coalesce(submitted_at, now()), last_submit_at = now()
                     WHERE tx_id IN (SELECT tx_id FROM upd) AND attempt = $7
                     RETURNING tx_id)
                 INSERT INTO tx_events (event_id, tx_id, type, payload)
                 SELECT $8, tx_id, 'TxSubmitted', $9 FROM upd RETURNING tx_id"
            );
            let done: Vec<(uuid::Uuid,)> = tx
                .writer()
                .fetch_all("submitted", &sql, |q| {
                    q.bind(tx_id).bind(attempt).bind(event_id).bind(json)
                })
                .await?;
            if !done.is_empty() {
                outputs.push(Output::new(
                    self.topics.tx_submitted(),
                    Subjects::TopicName,
                    skey.clone(),
                    event,
                ));
            }
        }
        tx.commit().await?;
        Ok(outputs)
    }
}

/// The broadcaster's stage runtime for `config`.
pub async fn runtime(
    config: &Config,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<BroadcastStage>, RoleError> {
    let pool = txflow_core::db::connect(&config.database_url, 8).await?;
    let url = config
        .rpc_urls
        .first()
        .ok_or_else(|| RoleError::Config("TXFLOW_RPC_URLS is empty".into()))?;
    let chain = Chain::connect(url, config.chain_id as u64)?;
    let leases = LeaseManager::new(pool.clone(), Role::Broadcaster, node, lease)?;
    let sc = StageConfig::for_pipeline(config, "broadcaster", lease);
    let stage = BroadcastStage {
        topics: config.topics.clone(),
        chain,
        chain_id: ChainId(config.chain_id),
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
    let rt = runtime(config, NodeId::generate(), LeaseConfig::default()).await?;
    rt.run(shutdown).await?;
    Ok(())
}

/// Runs the role until Ctrl-C.
pub async fn run(config: &Config) -> Result<(), RoleError> {
    run_until(config, txflow_core::stage::ctrl_c_token()).await
}
