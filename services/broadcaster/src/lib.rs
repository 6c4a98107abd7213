//! The broadcaster role: SIGNED → SUBMITTED. The signed payload persisted by the signer gateway is
//! sent outside any transaction (the intent is already committed), the node's answer classified
//! (accepted / possibly sent / rejected retryable / permanent), and the submission recorded,
//! fenced. A transaction still SIGNED is sent again by the recovery scan; sending the same raw
//! transaction twice is harmless (the node answers "already known").
//!
//! "nonce too low" is ours (possibly sent) when the chain knows one of the transaction's hashes,
//! and REPLACED when it does not and the chain's nonce is past ours (the signer was used outside
//! txflow): the allocator then re-allocates a fresh nonce. A signer that cannot pay is held (see
//! `txflow_core::holds`), nothing failed. A transaction the node refuses for good is FAILED with
//! its nonce released. Submitted transactions the chain has not mined are sent again every
//! `resubmit_interval` (`TXFLOW_RESUBMIT_INTERVAL_MS`).
//!
//! Not built yet: stuck detection and fee bumps.

use alloy::primitives::{Address, B256};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use txflow_core::chain::{ChainClient, ChainError, SendOutcome};
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::domain::{ChainId, NodeId, Signer};
use txflow_core::events::{SubmitOutcome, TxFailed, TxSigned, TxSubmitted};
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
    pub chain: std::sync::Arc<dyn ChainClient>,
    pub chain_id: ChainId,
    /// How long a submitted, unmined transaction waits before it is sent again.
    pub resubmit_interval: std::time::Duration,
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
        let mut signers =
            txflow_core::stage::signers_in_states(pool, self.chain_id, &["SIGNED"]).await?;
        let due: Vec<(i64, String)> = sqlx::query_as(
            // Due attempts first (the partial index on next_resubmit_at), then their rows by key:
            // the join order does not depend on the planner's statistics.
            "WITH due AS MATERIALIZED (
                 SELECT DISTINCT tx_id FROM tx_attempts
                 WHERE next_resubmit_at IS NOT NULL AND next_resubmit_at <= now())
             SELECT DISTINCT m.chain_id, m.signer FROM due JOIN managed_tx m ON m.tx_id = due.tx_id
             WHERE m.chain_id = $1 AND m.state = 'SUBMITTED'",
        )
        .bind(self.chain_id.0)
        .fetch_all(pool)
        .await?;
        for (chain_id, signer) in due {
            if let Ok(s) = Signer::parse(&signer) {
                let key = (ChainId(chain_id), s);
                if !signers.contains(&key) {
                    signers.push(key);
                }
            }
        }
        Ok(signers)
    }

    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let outputs = self.send_signed(&ctx).await?;
        // Resubmissions are due every few seconds at most: the recovery scan's drives (which
        // include every signer with one due) are enough, not every batch's.
        if ctx.recovery {
            self.resubmit(&ctx).await?;
        }
        Ok(outputs)
    }
}

/// What became of one SIGNED transaction's send.
enum Sent {
    Submitted(SubmitOutcome),
    /// Its nonce was used by a transaction txflow did not send.
    Replaced(String),
    /// The node refuses it for good: failed, nonce released.
    Refused(String),
}

impl BroadcastStage {
    fn address(ctx: &DriveCtx<'_>) -> Result<Address, HandlerError> {
        ctx.lease
            .key()
            .signer
            .as_str()
            .parse()
            .map_err(|e| transient("signer address", e))
    }

    /// "nonce too low": ours if the chain knows any of our hashes for the transaction; used
    /// elsewhere if not and the chain's nonce is past ours; otherwise undecided (try again later).
    async fn nonce_too_low(
        &self,
        ctx: &DriveCtx<'_>,
        tx_id: uuid::Uuid,
        nonce: i64,
        reason: &str,
    ) -> Result<Option<Sent>, ChainError> {
        let hashes: Vec<(String,)> =
            sqlx::query_as("SELECT tx_hash FROM tx_attempts WHERE tx_id = $1")
                .bind(tx_id)
                .fetch_all(ctx.pool)
                .await
                .unwrap_or_default();
        for (h,) in &hashes {
            if let Ok(hash) = h.parse::<B256>()
                && self.chain.knows_transaction(hash).await?
            {
                return Ok(Some(Sent::Submitted(SubmitOutcome::PossiblySent)));
            }
        }
        let address = ctx.lease.key().signer.as_str().parse::<Address>().ok();
        let Some(address) = address else {
            return Ok(None);
        };
        let latest = self.chain.latest_nonce(address).await?;
        if hashes.is_empty() || latest <= nonce as u64 {
            return Ok(None);
        }
        Ok(Some(Sent::Replaced(format!(
            "nonce {nonce} was used by a transaction txflow did not send (chain nonce {latest}; {reason})"
        ))))
    }

    /// Sends the signer's SIGNED transactions in nonce order and records what the node said.
    async fn send_signed(&self, ctx: &DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
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
        // Send in nonce order, outside any transaction; stop at the first one that must wait
        // (later nonces would only queue behind it).
        let mut sent = Vec::new();
        let mut held = false;
        for (tx_id, nonce, attempt, hash, raw) in signed {
            let what = match self.chain.send_raw(&raw).await {
                Ok(SendOutcome::Accepted) => Sent::Submitted(SubmitOutcome::Accepted),
                Ok(SendOutcome::PossiblySent { .. }) => {
                    Sent::Submitted(SubmitOutcome::PossiblySent)
                }
                Ok(SendOutcome::NonceTooLow { reason }) => {
                    match self.nonce_too_low(ctx, tx_id, nonce, &reason).await {
                        Ok(Some(what)) => what,
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(signer = %key.signer, nonce, error = %e, "cannot tell whose nonce this is yet");
                            break;
                        }
                    }
                }
                Ok(SendOutcome::InsufficientFunds { reason }) => {
                    txflow_core::holds::hold(ctx.pool, key, &reason)
                        .await
                        .map_err(|e| transient("hold", e))?;
                    held = true;
                    break;
                }
                Ok(SendOutcome::Rejected {
                    retryable: true,
                    reason,
                }) => {
                    tracing::warn!(signer = %key.signer, nonce, %reason, "the node refused a transaction for now");
                    break;
                }
                Ok(SendOutcome::Rejected {
                    retryable: false,
                    reason,
                }) => Sent::Refused(reason),
                Err(e) => {
                    tracing::warn!(signer = %key.signer, nonce, error = %e, transient = e.is_transient(), "sending failed");
                    break;
                }
            };
            sent.push((tx_id, nonce, attempt, hash, what));
        }
        if !held {
            txflow_core::holds::resume(ctx.pool, key)
                .await
                .map_err(|e| transient("resume", e))?;
        }
        if sent.is_empty() {
            return Ok(Vec::new());
        }
        txflow_core::fault::point(txflow_core::fault::AFTER_CALL);
        let skey = signer_key(key.chain_id.0, key.signer.as_str());
        let resubmit_ms = self.resubmit_interval.as_millis() as i64;
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let mut outputs = Vec::with_capacity(sent.len());
        for (tx_id, nonce, attempt, hash, what) in sent {
            match what {
                Sent::Submitted(outcome) => {
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
                    let event_id = uuid::Uuid::parse_str(&event.event_id)
                        .map_err(|e| transient("event id", e))?;
                    let sql = format!(
                        "WITH upd AS (
                             UPDATE managed_tx SET state = 'SUBMITTED', fencing_token = $5, updated_at = now()
                             WHERE tx_id = $6 AND state = 'SIGNED' AND {FENCE_PREDICATE}
                             RETURNING tx_id),
                         att AS (
                             UPDATE tx_attempts SET submitted_at = coalesce(submitted_at, now()), last_submit_at = now(),
                                    next_resubmit_at = now() + $10 * interval '1 millisecond'
                             WHERE tx_id IN (SELECT tx_id FROM upd) AND attempt = $7
                             RETURNING tx_id)
                         INSERT INTO tx_events (event_id, tx_id, type, payload)
                         SELECT $8, tx_id, 'TxSubmitted', $9 FROM upd RETURNING tx_id"
                    );
                    let done: Vec<(uuid::Uuid,)> = tx
                        .writer()
                        .fetch_all("submitted", &sql, |q| {
                            q.bind(tx_id)
                                .bind(attempt)
                                .bind(event_id)
                                .bind(json)
                                .bind(resubmit_ms)
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
                Sent::Replaced(reason) => {
                    tracing::warn!(signer = %key.signer, nonce, tx_id = %tx_id, %reason, "replaced: re-allocating a fresh nonce");
                    let event = serde_json::json!({
                        "tx_id": tx_id.to_string(), "nonce": nonce, "reason": reason,
                        "fencing_token": ctx.lease.token().0,
                    });
                    let sql = format!(
                        "WITH upd AS (
                             UPDATE managed_tx SET state = 'REPLACED', sub_state = $7, fencing_token = $5,
                                    updated_at = now()
                             WHERE tx_id = $6 AND state = 'SIGNED' AND {FENCE_PREDICATE}
                             RETURNING tx_id)
                         INSERT INTO tx_events (event_id, tx_id, type, payload)
                         SELECT $8, tx_id, 'TxReplaced', $9 FROM upd RETURNING tx_id"
                    );
                    tx.writer()
                        .fetch_all::<(uuid::Uuid,)>("replaced", &sql, |q| {
                            q.bind(tx_id)
                                .bind(reason.chars().take(300).collect::<String>())
                                .bind(uuid::Uuid::new_v4())
                                .bind(event)
                        })
                        .await?;
                }
                Sent::Refused(reason) => {
                    tracing::error!(signer = %key.signer, nonce, tx_id = %tx_id, %reason, "the node refuses the transaction for good: failed, nonce released");
                    let request_id: Vec<(String,)> = tx
                        .writer()
                        .read(
                            "refused",
                            sqlx::query_as("SELECT request_id FROM managed_tx WHERE tx_id = $1")
                                .bind(tx_id),
                        )
                        .await?;
                    let failed = TxFailed {
                        event_id: uuid::Uuid::new_v4().to_string(),
                        tx_id: tx_id.to_string(),
                        request_id: request_id
                            .into_iter()
                            .next()
                            .map(|r| r.0)
                            .unwrap_or_default(),
                        chain_id: key.chain_id.0,
                        signer: key.signer.as_str().to_string(),
                        code: "SEND_REJECTED".into(),
                        reason: reason.chars().take(500).collect(),
                        nonce: Some(nonce),
                        nonce_released: true,
                        fencing_token: ctx.lease.token().0,
                    };
                    let json = serde_json::to_value(&failed).map_err(|e| transient("event", e))?;
                    let event_id = uuid::Uuid::parse_str(&failed.event_id)
                        .map_err(|e| transient("event id", e))?;
                    let sql = format!(
                        "WITH upd AS (
                             UPDATE managed_tx SET state = 'FAILED', failure_code = 'SEND_REJECTED',
                                    failure_reason = $7, nonce_released = true, fencing_token = $5,
                                    updated_at = now()
                             WHERE tx_id = $6 AND state = 'SIGNED' AND {FENCE_PREDICATE}
                             RETURNING tx_id, nonce),
                         released AS (
                             INSERT INTO recycled_nonces (chain_id, signer, nonce, released_at)
                             SELECT $2, $3, nonce, clock_timestamp() FROM upd
                             ON CONFLICT (chain_id, signer, nonce) DO NOTHING)
                         INSERT INTO tx_events (event_id, tx_id, type, payload)
                         SELECT $8, tx_id, 'TxFailed', $9 FROM upd RETURNING tx_id"
                    );
                    let done: Vec<(uuid::Uuid,)> = tx
                        .writer()
                        .fetch_all("refused", &sql, |q| {
                            q.bind(tx_id)
                                .bind(failed.reason.clone())
                                .bind(event_id)
                                .bind(json)
                        })
                        .await?;
                    if !done.is_empty() {
                        outputs.push(Output::new(
                            self.topics.tx_outcomes(),
                            Subjects::TopicRecordName,
                            skey.clone(),
                            failed,
                        ));
                    }
                }
            }
        }
        tx.commit().await?;
        Ok(outputs)
    }

    /// Sends again, every `resubmit_interval`, the latest attempt of each submitted transaction
    /// the chain has not mined yet (a node may drop what it accepted); stops tracking the ones
    /// whose nonce the chain has passed.
    async fn resubmit(&self, ctx: &DriveCtx<'_>) -> Result<(), HandlerError> {
        let key = ctx.lease.key();
        let due: Vec<(uuid::Uuid, i64, i32, Vec<u8>)> = sqlx::query_as(
            "SELECT m.tx_id, m.nonce, a.attempt, a.raw_tx FROM managed_tx m
             JOIN LATERAL (SELECT attempt, raw_tx, next_resubmit_at FROM tx_attempts WHERE tx_id = m.tx_id
                           ORDER BY attempt DESC LIMIT 1) a ON true
             WHERE m.chain_id = $1 AND m.signer = $2 AND m.state = 'SUBMITTED'
               AND a.next_resubmit_at <= now()
             ORDER BY m.nonce LIMIT 500",
        )
        .bind(key.chain_id.0)
        .bind(key.signer.as_str())
        .fetch_all(ctx.pool)
        .await
        .map_err(|e| transient("list due resubmissions", e))?;
        if due.is_empty() {
            return Ok(());
        }
        let latest = self
            .chain
            .latest_nonce(Self::address(ctx)?)
            .await
            .map_err(|e| transient("latest nonce", e))?;
        let mut passed = Vec::new();
        let mut resent = Vec::new();
        for (tx_id, nonce, attempt, raw) in due {
            if (nonce as u64) < latest {
                passed.push(tx_id);
                continue;
            }
            match self.chain.send_raw(&raw).await {
                Ok(
                    SendOutcome::Accepted
                    | SendOutcome::PossiblySent { .. }
                    | SendOutcome::NonceTooLow { .. },
                ) => {
                    tracing::info!(signer = %key.signer, nonce, attempt, "resubmitted");
                    resent.push(tx_id);
                }
                Ok(SendOutcome::InsufficientFunds { reason }) => {
                    txflow_core::holds::hold(ctx.pool, key, &reason)
                        .await
                        .map_err(|e| transient("hold", e))?;
                    break;
                }
                Ok(SendOutcome::Rejected { reason, .. }) => {
                    tracing::warn!(signer = %key.signer, nonce, %reason, "resubmission refused");
                    resent.push(tx_id);
                }
                Err(e) => {
                    tracing::warn!(signer = %key.signer, nonce, error = %e, "resubmission failed");
                    break;
                }
            }
        }
        if passed.is_empty() && resent.is_empty() {
            return Ok(());
        }
        // Zero rows is `Fenced` for a fenced statement: run each only with rows to touch.
        let resubmit_ms = self.resubmit_interval.as_millis() as i64;
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        if !passed.is_empty() {
            let sql = format!(
                "UPDATE tx_attempts SET next_resubmit_at = NULL
                 WHERE tx_id = ANY($6) AND next_resubmit_at IS NOT NULL AND {FENCE_PREDICATE}"
            );
            tx.writer()
                .execute("resubmit", &sql, |q| q.bind(passed))
                .await?;
        }
        if !resent.is_empty() {
            let sql = format!(
                "UPDATE tx_attempts SET last_submit_at = now(),
                        next_resubmit_at = now() + $7 * interval '1 millisecond'
                 WHERE tx_id = ANY($6) AND next_resubmit_at IS NOT NULL AND {FENCE_PREDICATE}"
            );
            tx.writer()
                .execute("resubmit", &sql, |q| q.bind(resent).bind(resubmit_ms))
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// The broadcaster's stage runtime for `config`.
pub async fn runtime(
    config: &Config,
    node: NodeId,
    lease: LeaseConfig,
) -> Result<StageRuntime<BroadcastStage>, RoleError> {
    let pool = txflow_core::db::connect(&config.database_url, 8).await?;
    let chain = std::sync::Arc::new(config.chain()?);
    let leases = LeaseManager::new(pool.clone(), Role::Broadcaster, node, lease)?;
    let sc = StageConfig::for_pipeline(config, "broadcaster", lease);
    let stage = BroadcastStage {
        topics: config.topics.clone(),
        chain,
        chain_id: ChainId(config.chain_id),
        resubmit_interval: std::time::Duration::from_millis(config.resubmit_interval_ms),
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
    let rt = runtime(config, config.node(), config.lease()).await?;
    rt.run(shutdown).await?;
    Ok(())
}

/// Runs the role until Ctrl-C.
pub async fn run(config: &Config) -> Result<(), RoleError> {
    run_until(config, txflow_core::stage::ctrl_c_token()).await
}
