//! The allocator's stage: TxRequest → RECEIVED (idempotent on (chain, signer, request_id)) →
//! SIMULATED (eth_estimateGas; a revert is FAILED and never holds a nonce) → ALLOCATED (nonce
//! from the fenced cursor, aligned with the chain's pending nonce when the cursor is stale; fees
//! from eth_feeHistory when the request has none).

use std::time::Duration;

use alloy::primitives::{Address, Bytes, U256};
use sqlx::PgPool;
use txflow_core::chain::{ChainClient, Simulation};
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer, TxPayload as Payload};
use txflow_core::events::{TxAccepted, TxAllocated, TxFailed, TxRequest};
use txflow_core::fenced::{FENCE_PREDICATE, Fenced};
use txflow_core::kafka::{Topics, signer_key};
use txflow_core::retry::Classify;
use txflow_core::role::Role;
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output, Rejection};

use crate::validate::{ValidRequest, validate};
use txflow_core::policy::{Policy, Verdict};

/// `managed_tx.payload` of a validated request.
fn payload_of(v: &ValidRequest) -> Payload {
    Payload {
        to: format!("{:#x}", v.to),
        value: v.value.to_string(),
        data: format!("0x{}", hex::encode(&v.data)),
        gas_limit: v.gas_limit,
        max_fee_per_gas: v.max_fee_per_gas.map(|f| f.to_string()),
        max_priority_fee_per_gas: v.max_priority_fee_per_gas.map(|f| f.to_string()),
    }
}

pub struct RequestStage {
    pub topics: Topics,
    pub policy: Policy,
    pub chain: std::sync::Arc<dyn ChainClient>,
    pub chain_id: ChainId,
    /// `nonce.state_timeout`: align with the chain's pending nonce when the cursor is older.
    pub nonce_state_timeout: Duration,
}

fn transient(context: &str, e: impl std::error::Error + Send + Sync + 'static) -> HandlerError {
    HandlerError::transient(context.to_string(), e)
}

fn event_uuid(s: &str) -> Result<uuid::Uuid, HandlerError> {
    uuid::Uuid::parse_str(s).map_err(|e| transient("event id", e))
}

impl RequestStage {
    fn failed(&self, key: &str, f: TxFailed) -> Output {
        Output::new(
            self.topics.tx_outcomes(),
            Subjects::TopicRecordName,
            key.to_string(),
            f,
        )
    }
}

impl Handler for RequestStage {
    type Input = TxRequest;

    fn role(&self) -> Role {
        Role::Allocator
    }

    fn input_topic(&self) -> String {
        self.topics.tx_requests()
    }

    fn route(&self, r: &TxRequest) -> Result<(ChainId, Signer), Rejection> {
        validate(r, self.chain_id).map(|v| (v.chain_id, v.signer))
    }

    async fn handle(&self, w: &mut Fenced<'_>, r: &TxRequest) -> Result<Vec<Output>, HandlerError> {
        let v = validate(r, self.chain_id).map_err(HandlerError::Reject)?;
        let key = signer_key(v.chain_id.0, v.signer.as_str());
        let tx_id = uuid::Uuid::now_v7();
        let accepted = TxAccepted {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            request_id: r.request_id.clone(),
            chain_id: v.chain_id.0,
            signer: v.signer.as_str().to_string(),
            fencing_token: w.lease().token().0,
            accepted_at_ms: chrono::Utc::now().timestamp_millis(),
        };
        let payload = serde_json::to_value(payload_of(&v)).map_err(|e| transient("payload", e))?;
        let event = serde_json::to_value(&accepted).map_err(|e| transient("event", e))?;
        let sql = format!(
            "WITH ins AS (
                 INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, payload, state, fencing_token)
                 SELECT $6, $2, $3, $7, $8, 'RECEIVED', $5 WHERE {FENCE_PREDICATE}
                 ON CONFLICT (chain_id, signer, request_id) DO NOTHING
                 RETURNING tx_id)
             INSERT INTO tx_events (event_id, tx_id, type, payload)
             SELECT $9, tx_id, 'TxAccepted', $10 FROM ins
             RETURNING tx_id"
        );
        let event_id = event_uuid(&accepted.event_id)?;
        let inserted: Vec<(uuid::Uuid,)> = w
            .fetch_all("accept request", &sql, |q| {
                q.bind(tx_id)
                    .bind(r.request_id.clone())
                    .bind(payload.clone())
                    .bind(event_id)
                    .bind(event.clone())
            })
            .await?;
        let accepted = if inserted.is_empty() {
            // A duplicate: re-emit the original announcement (same event_id). Or fenced.
            let original: Vec<(serde_json::Value,)> = w
                .read(
                    "accept request",
                    sqlx::query_as(
                        "SELECT e.payload FROM managed_tx m
                         JOIN tx_events e ON e.tx_id = m.tx_id AND e.type = 'TxAccepted'
                         WHERE m.chain_id = $1 AND m.signer = $2 AND m.request_id = $3",
                    )
                    .bind(v.chain_id.0)
                    .bind(v.signer.as_str().to_string())
                    .bind(r.request_id.clone()),
                )
                .await?;
            match original.into_iter().next() {
                Some((p,)) => {
                    serde_json::from_value(p).map_err(|e| transient("stored event", e))?
                }
                None => return Err(w.fenced("accept request").into()),
            }
        } else {
            accepted
        };
        Ok(vec![Output::new(
            self.topics.tx_outcomes(),
            Subjects::TopicRecordName,
            key,
            accepted,
        )])
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        let mut signers = txflow_core::stage::signers_in_states(
            pool,
            self.chain_id,
            &["RECEIVED", "SIMULATED", "REPLACED"],
        )
        .await?;
        // Released nonces nobody has taken yet: filled by a no-op.
        let released: Vec<(i64, String)> = sqlx::query_as(
            "SELECT DISTINCT chain_id, signer FROM recycled_nonces WHERE chain_id = $1",
        )
        .bind(self.chain_id.0)
        .fetch_all(pool)
        .await?;
        for (chain_id, signer) in released {
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
        let mut outputs = self.simulate(&ctx).await?;
        outputs.extend(self.allocate(&ctx).await?);
        outputs.extend(self.fill_released(&ctx).await?);
        Ok(outputs)
    }
}

type Row = (uuid::Uuid, String, serde_json::Value);

impl RequestStage {
    async fn rows(&self, ctx: &DriveCtx<'_>, states: &[&str]) -> Result<Vec<Row>, HandlerError> {
        let key = ctx.lease.key();
        sqlx::query_as(
            "SELECT tx_id, request_id, payload FROM managed_tx
             WHERE chain_id = $1 AND signer = $2 AND state = ANY($3) ORDER BY created_at, tx_id",
        )
        .bind(key.chain_id.0)
        .bind(key.signer.as_str())
        .bind(states)
        .fetch_all(ctx.pool)
        .await
        .map_err(|e| transient("list transactions", e))
    }

    /// RECEIVED → SIMULATED, or FAILED when the call would revert.
    async fn simulate(&self, ctx: &DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let rows = self.rows(ctx, &["RECEIVED"]).await?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let from: Address = ctx
            .lease
            .key()
            .signer
            .as_str()
            .parse()
            .map_err(|e| transient("signer address", e))?;
        // The calls run outside any transaction, several at a time.
        let mut results = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(32) {
            let calls = chunk.iter().map(|(_, _, p)| async move {
                let p: Payload =
                    serde_json::from_value(p.clone()).map_err(|e| transient("payload", e))?;
                let to: Address = p.to.parse().map_err(|e| transient("to", e))?;
                let value =
                    U256::from_str_radix(&p.value, 10).map_err(|e| transient("value", e))?;
                let data = Bytes::from(
                    hex::decode(p.data.trim_start_matches("0x"))
                        .map_err(|e| transient("data", e))?,
                );
                let sim = self.chain.simulate(from, to, value, data).await;
                Ok::<_, HandlerError>((p, sim))
            });
            results.extend(futures::future::join_all(calls).await);
        }
        txflow_core::fault::point(txflow_core::fault::AFTER_CALL);
        // A signer that cannot pay is held: its requests wait in RECEIVED (the recovery scan
        // simulates them again), none fails, and the hold is the alert.
        let broke = results.iter().find_map(|r| match r {
            Ok((_, Ok(Simulation::InsufficientFunds { reason }))) => Some(reason.clone()),
            _ => None,
        });
        if let Some(reason) = broke {
            txflow_core::holds::hold(ctx.pool, ctx.lease.key(), &reason)
                .await
                .map_err(|e| transient("hold", e))?;
            return Ok(Vec::new());
        }
        txflow_core::holds::resume(ctx.pool, ctx.lease.key())
            .await
            .map_err(|e| transient("resume", e))?;
        let key = signer_key(ctx.lease.key().chain_id.0, ctx.lease.key().signer.as_str());
        let mut outputs = Vec::new();
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        for ((tx_id, request_id, _), result) in rows.iter().zip(results) {
            let (mut p, sim) = result?;
            let to: Address = p.to.parse().map_err(|e| transient("to", e))?;
            let value = U256::from_str_radix(&p.value, 10).map_err(|e| transient("value", e))?;
            let verdict = self.policy.check(to, value);
            if let Verdict::Deny(reason) = &verdict {
                outputs.extend(
                    self.fail(
                        &mut tx.writer(),
                        &key,
                        *tx_id,
                        request_id,
                        "POLICY_DENIED",
                        reason,
                    )
                    .await?,
                );
                continue;
            }
            let next_state = if verdict == Verdict::NeedsApproval {
                "PENDING_APPROVAL"
            } else {
                "SIMULATED"
            };
            match sim {
                Err(e) if e.is_transient() => return Err(transient("eth_estimateGas", e)),
                Err(e) => {
                    let reason = e.to_string();
                    outputs.extend(
                        self.fail(
                            &mut tx.writer(),
                            &key,
                            *tx_id,
                            request_id,
                            "SIMULATION_FAILED",
                            &reason,
                        )
                        .await?,
                    );
                }
                Ok(Simulation::InsufficientFunds { .. }) => {} // held above
                Ok(Simulation::Reverts { reason }) => {
                    outputs.extend(
                        self.fail(
                            &mut tx.writer(),
                            &key,
                            *tx_id,
                            request_id,
                            "SIMULATION_REVERTED",
                            &reason,
                        )
                        .await?,
                    );
                }
                Ok(Simulation::Ok { gas }) => {
                    // Keep the requested limit; otherwise the estimate plus 20%.
                    p.gas_limit = Some(p.gas_limit.unwrap_or(gas + gas / 5));
                    let payload = serde_json::to_value(&p).map_err(|e| transient("payload", e))?;
                    // A request that needs approval waits without a nonce, so it blocks nobody.
                    let sql = format!(
                        "UPDATE managed_tx SET state = $8, payload = $7, fencing_token = $5, updated_at = now()
                         WHERE tx_id = $6 AND state = 'RECEIVED' AND {FENCE_PREDICATE} RETURNING tx_id"
                    );
                    tx.writer()
                        .fetch_all::<(uuid::Uuid,)>("simulated", &sql, |q| {
                            q.bind(*tx_id).bind(payload).bind(next_state)
                        })
                        .await?;
                }
            }
        }
        tx.commit().await?;
        Ok(outputs)
    }

    pub(crate) async fn fail(
        &self,
        w: &mut Fenced<'_>,
        key: &str,
        tx_id: uuid::Uuid,
        request_id: &str,
        code: &str,
        reason: &str,
    ) -> Result<Vec<Output>, HandlerError> {
        let lease = w.lease().clone();
        let failed = TxFailed {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            request_id: request_id.to_string(),
            chain_id: lease.key().chain_id.0,
            signer: lease.key().signer.as_str().to_string(),
            code: code.to_string(),
            reason: reason.chars().take(500).collect(),
            nonce: None,
            nonce_released: false,
            fencing_token: lease.token().0,
        };
        let event = serde_json::to_value(&failed).map_err(|e| transient("event", e))?;
        let sql = format!(
            "WITH upd AS (
                 UPDATE managed_tx SET state = 'FAILED', failure_code = $7, failure_reason = $8,
                        fencing_token = $5, updated_at = now()
                 WHERE tx_id = $6 AND state IN ('RECEIVED', 'SIMULATED', 'PENDING_APPROVAL') AND {FENCE_PREDICATE}
                 RETURNING tx_id)
             INSERT INTO tx_events (event_id, tx_id, type, payload)
             SELECT $9, tx_id, 'TxFailed', $10 FROM upd RETURNING tx_id"
        );
        let event_id = event_uuid(&failed.event_id)?;
        let done: Vec<(uuid::Uuid,)> = w
            .fetch_all("fail", &sql, |q| {
                q.bind(tx_id)
                    .bind(code.to_string())
                    .bind(failed.reason.clone())
                    .bind(event_id)
                    .bind(event)
            })
            .await?;
        Ok(if done.is_empty() {
            Vec::new()
        } else {
            vec![self.failed(key, failed)]
        })
    }

    /// Released nonces that no waiting request took (allocation runs first and takes them) are
    /// filled with a 0-value self-transfer each, so that the signer's later nonces are not stuck
    /// behind a gap.
    async fn fill_released(&self, ctx: &DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let lease = ctx.lease;
        let released: Vec<(i64,)> = sqlx::query_as(
            "SELECT nonce FROM recycled_nonces WHERE chain_id = $1 AND signer = $2 ORDER BY nonce",
        )
        .bind(lease.key().chain_id.0)
        .bind(lease.key().signer.as_str())
        .fetch_all(ctx.pool)
        .await
        .map_err(|e| transient("released nonces", e))?;
        if released.is_empty() {
            return Ok(Vec::new());
        }
        let (max_fee, tip) = self.chain.fees().await.map_err(|e| transient("fees", e))?;
        let signer = lease.key().signer.as_str().to_string();
        let key = signer_key(lease.key().chain_id.0, &signer);
        let mut tx = lease.begin(ctx.pool).await?;
        let nonces = tx.allocate_nonces(released.len() as u32).await?;
        let mut outputs = Vec::with_capacity(nonces.len());
        for nonce in nonces {
            let tx_id = uuid::Uuid::now_v7();
            let request_id = format!("noop-{nonce}-{}", &tx_id.simple().to_string()[20..]);
            let payload = Payload {
                to: signer.clone(),
                value: "0".into(),
                data: "0x".into(),
                gas_limit: Some(21_000),
                max_fee_per_gas: Some(max_fee.to_string()),
                max_priority_fee_per_gas: Some(tip.to_string()),
            };
            let allocated = TxAllocated {
                event_id: uuid::Uuid::new_v4().to_string(),
                tx_id: tx_id.to_string(),
                request_id: request_id.clone(),
                chain_id: lease.key().chain_id.0,
                signer: signer.clone(),
                nonce,
                to: signer.clone(),
                value: "0".into(),
                data: Vec::new(),
                gas_limit: 21_000,
                max_fee_per_gas: max_fee.to_string(),
                max_priority_fee_per_gas: tip.to_string(),
                fencing_token: lease.token().0,
            };
            let payload = serde_json::to_value(&payload).map_err(|e| transient("payload", e))?;
            let event = serde_json::to_value(&allocated).map_err(|e| transient("event", e))?;
            let event_id = event_uuid(&allocated.event_id)?;
            let sql = format!(
                "WITH ins AS (
                     INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, kind, nonce, payload, state, fencing_token)
                     SELECT $6, $2, $3, $7, 'NOOP', $8, $9, 'ALLOCATED', $5 WHERE {FENCE_PREDICATE}
                     RETURNING tx_id)
                 INSERT INTO tx_events (event_id, tx_id, type, payload)
                 SELECT $10, tx_id, 'TxAllocated', $11 FROM ins RETURNING tx_id"
            );
            tx.writer()
                .fetch_one::<(uuid::Uuid,)>("fill released nonce", &sql, |q| {
                    q.bind(tx_id)
                        .bind(request_id)
                        .bind(nonce)
                        .bind(payload)
                        .bind(event_id)
                        .bind(event)
                })
                .await?;
            tracing::info!(signer = %signer, nonce, tx_id = %tx_id, "released nonce filled with a no-op");
            outputs.push(Output::new(
                self.topics.tx_allocated(),
                Subjects::TopicName,
                key.clone(),
                allocated,
            ));
        }
        tx.commit().await?;
        Ok(outputs)
    }

    /// SIMULATED → ALLOCATED: nonces from the fenced cursor, in request order.
    async fn allocate(&self, ctx: &DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let rows = self.rows(ctx, &["SIMULATED", "REPLACED"]).await?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        // A transaction whose nonce was used outside txflow: the cursor is behind the chain.
        let replaced: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND state = 'REPLACED'",
        )
        .bind(ctx.lease.key().chain_id.0)
        .bind(ctx.lease.key().signer.as_str())
        .fetch_one(ctx.pool)
        .await
        .map_err(|e| transient("replaced", e))?;
        let lease = ctx.lease;
        let address: Address = lease
            .key()
            .signer
            .as_str()
            .parse()
            .map_err(|e| transient("signer address", e))?;
        // External calls first, outside the transaction.
        let stale: Option<(i64,)> = sqlx::query_as(
            "SELECT next_nonce FROM signer_nonce_cursor WHERE chain_id = $1 AND signer = $2
               AND synced_at > clock_timestamp() - $3 * interval '1 millisecond'",
        )
        .bind(lease.key().chain_id.0)
        .bind(lease.key().signer.as_str())
        .bind(self.nonce_state_timeout.as_millis() as i64)
        .fetch_optional(ctx.pool)
        .await
        .map_err(|e| transient("cursor", e))?;
        let chain_nonce = match stale {
            Some(_) if replaced == 0 => None,
            _ => Some(
                self.chain
                    .pending_nonce(address)
                    .await
                    .map_err(|e| transient("pending nonce", e))?,
            ),
        };
        let payloads: Vec<Payload> = rows
            .iter()
            .map(|(_, _, p)| serde_json::from_value(p.clone()).map_err(|e| transient("payload", e)))
            .collect::<Result<_, _>>()?;
        let fees = if payloads
            .iter()
            .any(|p| p.max_fee_per_gas.is_none() || p.max_priority_fee_per_gas.is_none())
        {
            Some(self.chain.fees().await.map_err(|e| transient("fees", e))?)
        } else {
            None
        };

        let key = signer_key(lease.key().chain_id.0, lease.key().signer.as_str());
        let mut tx = lease.begin(ctx.pool).await?;
        if let Some(n) = chain_nonce {
            tx.align_cursor(n as i64).await?;
        }
        let nonces = tx.allocate_nonces(rows.len() as u32).await?;
        let mut outputs = Vec::with_capacity(rows.len());
        for (((tx_id, request_id, _), mut p), nonce) in rows.into_iter().zip(payloads).zip(nonces) {
            if let Some((max, tip)) = fees {
                p.max_fee_per_gas.get_or_insert(max.to_string());
                p.max_priority_fee_per_gas.get_or_insert(tip.to_string());
            }
            let allocated = TxAllocated {
                event_id: uuid::Uuid::new_v4().to_string(),
                tx_id: tx_id.to_string(),
                request_id,
                chain_id: lease.key().chain_id.0,
                signer: lease.key().signer.as_str().to_string(),
                nonce,
                to: p.to.clone(),
                value: p.value.clone(),
                data: hex::decode(p.data.trim_start_matches("0x"))
                    .map_err(|e| transient("data", e))?,
                gas_limit: p.gas_limit.unwrap_or(21_000) as i64,
                max_fee_per_gas: p.max_fee_per_gas.clone().unwrap_or_default(),
                max_priority_fee_per_gas: p.max_priority_fee_per_gas.clone().unwrap_or_default(),
                fencing_token: lease.token().0,
            };
            let payload = serde_json::to_value(&p).map_err(|e| transient("payload", e))?;
            let event = serde_json::to_value(&allocated).map_err(|e| transient("event", e))?;
            let event_id = event_uuid(&allocated.event_id)?;
            let sql = format!(
                "WITH upd AS (
                     UPDATE managed_tx SET state = 'ALLOCATED', nonce = $7, payload = $8, fencing_token = $5,
                            updated_at = now()
                     WHERE tx_id = $6 AND state IN ('SIMULATED', 'REPLACED') AND {FENCE_PREDICATE}
                     RETURNING tx_id)
                 INSERT INTO tx_events (event_id, tx_id, type, payload)
                 SELECT $9, tx_id, 'TxAllocated', $10 FROM upd RETURNING tx_id"
            );
            tx.writer()
                .fetch_one::<(uuid::Uuid,)>("allocate", &sql, |q| {
                    q.bind(tx_id)
                        .bind(nonce)
                        .bind(payload)
                        .bind(event_id)
                        .bind(event)
                })
                .await?;
            outputs.push(Output::new(
                self.topics.tx_allocated(),
                Subjects::TopicName,
                key.clone(),
                allocated,
            ));
        }
        txflow_core::fault::point(txflow_core::fault::ALLOCATOR_BEFORE_COMMIT);
        tx.commit().await?;
        Ok(outputs)
    }
}
