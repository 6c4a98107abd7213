//! The signer gateway role: ALLOCATED → SIGNED. Signs with alloy's local signer (keys from
//! `TXFLOW_SIGNER_KEYS` or encrypted keystores, never logged) and persists the raw transaction and
//! its hash as attempt 1 before announcing TxSigned; a persisted attempt is never signed again.
//!
//! What is signed is what PostgreSQL holds for the transaction, never what the TxAllocated event
//! claims: an event that disagrees with the row is dead-lettered. The policy is checked again
//! before signing (the configuration may have tightened since allocation, or the row was written
//! by something other than the allocator); a refused transaction becomes FAILED (POLICY_DENIED)
//! and its nonce is released to `recycled_nonces` for the signer's next request; so is a
//! transaction that cannot be signed at all (no key for its signer, a signing failure).
//!
//! Signing is driven by PostgreSQL as well as by events: the recovery scan signs every ALLOCATED
//! transaction of the signers this instance owns, so a TxAllocated that was never produced (a
//! crash between the allocator's commit and its produce) or that the broker lost delays nothing.
//!
//! Not built yet: bumped attempts (issue #6).

pub mod keys;

pub use keys::{KeyError, Keys};

use alloy::primitives::{Address, Bytes, U256};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use txflow_core::chain::{UnsignedTx, sign};
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::domain::{ChainId, NodeId, Signer, TxPayload};
use txflow_core::events::{TxAllocated, TxFailed, TxSigned};
use txflow_core::fenced::{FENCE_PREDICATE, Fenced};
use txflow_core::kafka::{Topics, signer_key};
use txflow_core::lease::{LeaseConfig, LeaseManager};
use txflow_core::policy::{Policy, Verdict};
use txflow_core::role::{Role, RoleError};
use txflow_core::stage::{
    DriveCtx, Handler, HandlerError, Output, Rejection, StageConfig, StageRuntime,
};

pub struct SignStage {
    pub topics: Topics,
    pub chain_id: ChainId,
    pub keys: Keys,
    pub policy: Policy,
}

fn transient(context: &str, e: impl std::error::Error + Send + Sync + 'static) -> HandlerError {
    HandlerError::transient(context.to_string(), e)
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
        let tx_id = uuid::Uuid::parse_str(&a.tx_id).map_err(|_| {
            HandlerError::Reject(Rejection::new(
                "INVALID_TX_ID",
                format!("{:?} is not a transaction id", a.tx_id),
            ))
        })?;
        self.sign_recorded(w, tx_id, Some(a)).await
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        txflow_core::stage::signers_in_states(pool, self.chain_id, &["ALLOCATED"]).await
    }

    /// On the recovery scan (start, assignment, every few seconds), signs the signer's ALLOCATED
    /// transactions straight from PostgreSQL, in nonce order: what recovers a TxAllocated event
    /// that was never produced (a crash between the allocator's commit and its produce) or that a
    /// broker lost.
    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        // Right after a batch, the rows the allocator committed next are on their way as events:
        // signing them here would only sign ahead of their events and announce each twice.
        if !ctx.recovery {
            return Ok(Vec::new());
        }
        let key = ctx.lease.key();
        let rows: Vec<(uuid::Uuid,)> = sqlx::query_as(
            "SELECT tx_id FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND state = 'ALLOCATED'
             ORDER BY nonce LIMIT 500",
        )
        .bind(key.chain_id.0)
        .bind(key.signer.as_str())
        .fetch_all(ctx.pool)
        .await
        .map_err(|e| transient("list allocated transactions", e))?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let mut outputs = Vec::with_capacity(rows.len());
        for (tx_id,) in rows {
            outputs.extend(self.sign_recorded(&mut tx.writer(), tx_id, None).await?);
        }
        tx.commit().await?;
        Ok(outputs)
    }
}

/// What the signer gateway reads of a transaction.
struct Recorded {
    tx_id: uuid::Uuid,
    request_id: String,
    chain_id: i64,
    state: String,
    nonce: Option<i64>,
    payload: serde_json::Value,
    sub_state: Option<String>,
}

impl SignStage {
    /// Signs transaction `tx_id` as PostgreSQL records it. `claimed` is the event that asked for
    /// it, if any: it must agree with the row.
    async fn sign_recorded(
        &self,
        w: &mut Fenced<'_>,
        tx_id: uuid::Uuid,
        claimed: Option<&TxAllocated>,
    ) -> Result<Vec<Output>, HandlerError> {
        let signer = w.lease().key().signer.clone();
        let chain_id = w.lease().key().chain_id.0;
        let key = signer_key(chain_id, signer.as_str());
        // The row is the truth; the event only says which transaction to sign. Locked, so that
        // the event and the recovery scan never sign the same row at once.
        type Row = (
            String,
            i64,
            String,
            Option<i64>,
            serde_json::Value,
            Option<String>,
            String,
        );
        let row: Vec<Row> = w
            .read(
                "sign",
                sqlx::query_as(
                    "SELECT request_id, chain_id, state, nonce, payload, sub_state, kind FROM managed_tx
                     WHERE tx_id = $1 AND chain_id = $2 AND signer = $3 FOR UPDATE",
                )
                .bind(tx_id)
                .bind(chain_id)
                .bind(signer.as_str().to_string()),
            )
            .await?;
        let Some((request_id, chain_id, state, nonce, payload, sub_state, kind)) =
            row.into_iter().next()
        else {
            return match claimed {
                Some(_) => Err(HandlerError::Reject(Rejection::new(
                    "UNKNOWN_TX",
                    format!("no transaction {tx_id} of {signer} on chain {chain_id}"),
                ))),
                None => Ok(Vec::new()),
            };
        };
        let r = Recorded {
            tx_id,
            request_id,
            chain_id,
            state,
            nonce,
            payload,
            sub_state,
        };
        match r.state.as_str() {
            "ALLOCATED" => {}
            // A persisted attempt is never signed again: re-announce it.
            "SIGNED" | "SUBMITTED" | "MINED" | "CONFIRMED" | "REVERTED" => {
                return self.signed_again(w, tx_id, key).await;
            }
            // FAILED, REPLACED, or not allocated yet: nothing to sign.
            _ => return Ok(Vec::new()),
        }
        let Some(nonce) = r.nonce else {
            return Ok(Vec::new());
        };
        let p: TxPayload =
            serde_json::from_value(r.payload.clone()).map_err(|e| transient("payload", e))?;
        if let Some(a) = claimed
            && let Some(field) = mismatch(a, Some(nonce), &p)
        {
            return Err(HandlerError::Reject(Rejection::new(
                "ALLOCATION_MISMATCH",
                format!("the event's {field} differs from the recorded transaction {tx_id}"),
            )));
        }
        let unsigned = match unsigned_tx(chain_id, nonce, &p) {
            Ok(u) => u,
            Err(field) => {
                let reason = format!("the recorded {field} is not valid");
                return self.fail(w, &r, nonce, "SIGNING_FAILED", &reason).await;
            }
        };
        let signer_address: Address = signer
            .as_str()
            .parse()
            .map_err(|e| transient("signer address", e))?;
        let approved = r
            .sub_state
            .as_deref()
            .is_some_and(|s| s.starts_with("approved by "));
        // A no-op (0-value self-transfer filling a released nonce) is txflow's own and needs no
        // policy.
        let refusal = match self.policy.check(unsigned.to, unsigned.value) {
            _ if kind == "NOOP" && unsigned.value.is_zero() && unsigned.to == signer_address => {
                None
            }
            Verdict::Allow => None,
            Verdict::NeedsApproval if approved => None,
            Verdict::NeedsApproval => Some(format!(
                "value {} wei needs an approval and the transaction has none",
                unsigned.value
            )),
            Verdict::Deny(reason) => Some(reason),
        };
        if let Some(reason) = refusal {
            return self.fail(w, &r, nonce, "POLICY_DENIED", &reason).await;
        }
        let Some(local) = self.keys.get(&signer) else {
            let reason = format!("this signer gateway has no key for {signer}");
            return self.fail(w, &r, nonce, "NO_SIGNING_KEY", &reason).await;
        };
        let signed = match sign(local, &unsigned) {
            Ok(s) => s,
            Err(e) => {
                let reason = e.to_string();
                return self.fail(w, &r, nonce, "SIGNING_FAILED", &reason).await;
            }
        };
        // Attempt 1, or the next one for a transaction re-allocated after REPLACED.
        let previous: Vec<(Option<i32>,)> = w
            .read(
                "sign",
                sqlx::query_as("SELECT max(attempt) FROM tx_attempts WHERE tx_id = $1").bind(tx_id),
            )
            .await?;
        let attempt = previous.first().and_then(|(a,)| *a).unwrap_or(0) + 1;
        let event = TxSigned {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            chain_id,
            signer: signer.as_str().to_string(),
            nonce,
            attempt,
            tx_hash: format!("{:#x}", signed.hash),
            raw_tx: signed.raw.clone(),
            max_fee_per_gas: unsigned.max_fee_per_gas.to_string(),
            max_priority_fee_per_gas: unsigned.max_priority_fee_per_gas.to_string(),
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
                 SELECT tx_id, $14, $8, $9, $10::numeric, $11::numeric FROM upd
                 RETURNING tx_id)
             INSERT INTO tx_events (event_id, tx_id, type, payload)
             SELECT $12, tx_id, 'TxSigned', $13 FROM att RETURNING tx_id"
        );
        w.fetch_one::<(uuid::Uuid,)>("sign", &sql, |q| {
            q.bind(tx_id)
                .bind(nonce)
                .bind(event.tx_hash.clone())
                .bind(signed.raw.clone())
                .bind(event.max_fee_per_gas.clone())
                .bind(event.max_priority_fee_per_gas.clone())
                .bind(event_id)
                .bind(event_json)
                .bind(attempt)
        })
        .await?;
        Ok(vec![Output::new(
            self.topics.tx_signed(),
            Subjects::TopicName,
            key,
            event,
        )])
    }
}

/// The transaction to sign from the recorded payload, or the name of the field that is not valid.
fn unsigned_tx(chain_id: i64, nonce: i64, p: &TxPayload) -> Result<UnsignedTx, &'static str> {
    Ok(UnsignedTx {
        chain_id: u64::try_from(chain_id).map_err(|_| "chain id")?,
        nonce: u64::try_from(nonce).map_err(|_| "nonce")?,
        to: p.to.parse::<Address>().map_err(|_| "to")?,
        value: U256::from_str_radix(&p.value, 10).map_err(|_| "value")?,
        data: Bytes::from(hex::decode(p.data.trim_start_matches("0x")).map_err(|_| "data")?),
        gas_limit: p.gas_limit.ok_or("gas_limit")?,
        max_fee_per_gas: p
            .max_fee_per_gas
            .as_deref()
            .ok_or("max_fee_per_gas")?
            .parse()
            .map_err(|_| "max_fee_per_gas")?,
        max_priority_fee_per_gas: p
            .max_priority_fee_per_gas
            .as_deref()
            .ok_or("max_priority_fee_per_gas")?
            .parse()
            .map_err(|_| "max_priority_fee_per_gas")?,
    })
}

/// The first field in which the event disagrees with the recorded transaction.
fn mismatch(a: &TxAllocated, nonce: Option<i64>, p: &TxPayload) -> Option<&'static str> {
    let data = hex::decode(p.data.trim_start_matches("0x")).ok();
    if nonce != Some(a.nonce) {
        Some("nonce")
    } else if !a.to.eq_ignore_ascii_case(&p.to) {
        Some("to")
    } else if a.value != p.value {
        Some("value")
    } else if data.as_deref() != Some(a.data.as_slice()) {
        Some("data")
    } else if p.gas_limit.and_then(|g| i64::try_from(g).ok()) != Some(a.gas_limit) {
        Some("gas_limit")
    } else if p.max_fee_per_gas.as_deref() != Some(a.max_fee_per_gas.as_str()) {
        Some("max_fee_per_gas")
    } else if p.max_priority_fee_per_gas.as_deref() != Some(a.max_priority_fee_per_gas.as_str()) {
        Some("max_priority_fee_per_gas")
    } else {
        None
    }
}

impl SignStage {
    /// Re-announces the stored TxSigned of a transaction signed before.
    async fn signed_again(
        &self,
        w: &mut Fenced<'_>,
        tx_id: uuid::Uuid,
        key: String,
    ) -> Result<Vec<Output>, HandlerError> {
        let existing: Vec<(serde_json::Value,)> = w
            .read(
                "sign",
                sqlx::query_as(
                    "SELECT e.payload FROM tx_events e WHERE e.tx_id = $1 AND e.type = 'TxSigned'
                     ORDER BY (e.payload->>'attempt')::int DESC LIMIT 1",
                )
                .bind(tx_id),
            )
            .await?;
        let Some((p,)) = existing.into_iter().next() else {
            return Ok(Vec::new());
        };
        let signed: TxSigned =
            serde_json::from_value(p).map_err(|e| transient("stored event", e))?;
        Ok(vec![Output::new(
            self.topics.tx_signed(),
            Subjects::TopicName,
            key,
            signed,
        )])
    }

    /// The transaction cannot be signed (the policy refuses it, no key, a signing failure):
    /// FAILED with `code`, its nonce released for the signer's next request, TxFailed announced.
    async fn fail(
        &self,
        w: &mut Fenced<'_>,
        r: &Recorded,
        nonce: i64,
        code: &str,
        reason: &str,
    ) -> Result<Vec<Output>, HandlerError> {
        let key = signer_key(r.chain_id, w.lease().key().signer.as_str());
        let tx_id = r.tx_id;
        let failed = TxFailed {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            request_id: r.request_id.clone(),
            chain_id: r.chain_id,
            signer: w.lease().key().signer.as_str().to_string(),
            code: code.to_string(),
            reason: reason.chars().take(500).collect(),
            nonce: Some(nonce),
            nonce_released: true,
            fencing_token: w.lease().token().0,
        };
        let event = serde_json::to_value(&failed).map_err(|e| transient("event", e))?;
        let event_id =
            uuid::Uuid::parse_str(&failed.event_id).map_err(|e| transient("event id", e))?;
        let sql = format!(
            "WITH upd AS (
                 UPDATE managed_tx SET state = 'FAILED', failure_code = $11,
                        failure_reason = $8, nonce_released = true, fencing_token = $5,
                        updated_at = now()
                 WHERE tx_id = $6 AND state = 'ALLOCATED' AND nonce = $7 AND {FENCE_PREDICATE}
                 RETURNING tx_id, nonce),
             released AS (
                 INSERT INTO recycled_nonces (chain_id, signer, nonce, released_at)
                 SELECT $2, $3, nonce, clock_timestamp() FROM upd
                 ON CONFLICT (chain_id, signer, nonce) DO NOTHING)
             INSERT INTO tx_events (event_id, tx_id, type, payload)
             SELECT $9, tx_id, 'TxFailed', $10 FROM upd RETURNING tx_id"
        );
        w.fetch_one::<(uuid::Uuid,)>("fail", &sql, |q| {
            q.bind(tx_id)
                .bind(nonce)
                .bind(failed.reason.clone())
                .bind(event_id)
                .bind(event)
                .bind(code.to_string())
        })
        .await?;
        tracing::warn!(tx_id = %tx_id, nonce, code, reason, "the transaction cannot be signed: failed, nonce released");
        Ok(vec![Output::new(
            self.topics.tx_outcomes(),
            Subjects::TopicRecordName,
            key,
            failed,
        )])
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
        chain_id: ChainId(config.chain_id),
        keys,
        policy: txflow_core::policy::from_config(config)?,
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
    let keys = Keys::load(config)?;
    if keys.is_empty() {
        tracing::warn!(
            "no signing keys: set TXFLOW_SIGNER_KEYS or TXFLOW_SIGNER_KEYSTORE; every allocation will be dead-lettered with NO_SIGNING_KEY"
        );
    } else {
        tracing::info!(signers = ?keys.addresses(), "signing keys loaded");
    }
    let rt = runtime(config, keys, config.node(), config.lease()).await?;
    rt.run(shutdown).await?;
    Ok(())
}

/// Runs the role until Ctrl-C.
pub async fn run(config: &Config) -> Result<(), RoleError> {
    run_until(config, txflow_core::stage::ctrl_c_token()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload() -> TxPayload {
        TxPayload {
            to: "0x000000000000000000000000000000000000dead".into(),
            value: "5".into(),
            data: "0x7478".into(),
            gas_limit: Some(25_000),
            max_fee_per_gas: Some("2000000000".into()),
            max_priority_fee_per_gas: Some("1000".into()),
        }
    }

    fn event() -> TxAllocated {
        TxAllocated {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: uuid::Uuid::new_v4().to_string(),
            request_id: "r".into(),
            chain_id: 31337,
            signer: "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into(),
            nonce: 7,
            to: "0x000000000000000000000000000000000000DEAD".into(),
            value: "5".into(),
            data: vec![0x74, 0x78],
            gas_limit: 25_000,
            max_fee_per_gas: "2000000000".into(),
            max_priority_fee_per_gas: "1000".into(),
            fencing_token: 3,
        }
    }

    #[test]
    fn an_event_must_agree_with_the_recorded_transaction_field_by_field() {
        let p = payload();
        assert_eq!(mismatch(&event(), Some(7), &p), None);
        assert_eq!(mismatch(&event(), Some(8), &p), Some("nonce"));
        assert_eq!(mismatch(&event(), None, &p), Some("nonce"));
        type Change = fn(&mut TxAllocated);
        let cases: [(Change, &str); 6] = [
            (
                |a| a.to = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into(),
                "to",
            ),
            (|a| a.value = "6".into(), "value"),
            (|a| a.data = vec![0x74], "data"),
            (|a| a.gas_limit = 21_000, "gas_limit"),
            (|a| a.max_fee_per_gas = "1".into(), "max_fee_per_gas"),
            (
                |a| a.max_priority_fee_per_gas = "2".into(),
                "max_priority_fee_per_gas",
            ),
        ];
        for (change, field) in cases {
            let mut a = event();
            change(&mut a);
            assert_eq!(mismatch(&a, Some(7), &p), Some(field));
        }
    }

    #[test]
    fn the_transaction_is_built_from_the_recorded_payload_or_names_the_bad_field() {
        let u = unsigned_tx(31337, 7, &payload()).expect("valid");
        assert_eq!((u.nonce, u.gas_limit, u.value), (7, 25_000, U256::from(5)));
        assert_eq!(u.data.as_ref(), &[0x74, 0x78]);
        let mut p = payload();
        p.gas_limit = None;
        assert_eq!(unsigned_tx(31337, 7, &p).err(), Some("gas_limit"));
        let mut p = payload();
        p.max_fee_per_gas = Some("-1".into());
        assert_eq!(unsigned_tx(31337, 7, &p).err(), Some("max_fee_per_gas"));
        assert_eq!(unsigned_tx(31337, -1, &payload()).err(), Some("nonce"));
    }
}
