//! The signer gateway stage: route → load (the rows, locked) → decide ([`crate::decide`]) →
//! persist ([`crate::store`]) → outputs (TxSigned on `tx.signed`, TxFailed on `tx.outcomes`).
//!
//! A TxAllocated message and the recovery scan run the same path: the message for its one
//! transaction, the scan for the signer's ALLOCATED transactions in nonce order, set-based.

use std::collections::HashMap;

use sqlx::PgPool;
use txflow_core::chain::{SignedTx, UnsignedTx, sign};
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{TxAllocated, TxFailed, TxSigned};
use txflow_core::failure::{FailureCode, truncate_reason};
use txflow_core::fenced::Fenced;
use txflow_core::kafka::signer_key;
use txflow_core::role::Role;
use txflow_core::stage::{BatchResults, DriveCtx, Handler, HandlerError, Output, Rejection};
use txflow_core::txstore::TxRow;
use uuid::Uuid;

use crate::config::SignerConfig;
use crate::decide::{self, Decision, Input};
use crate::keys::Keys;
use crate::store::{self, Failing, Signing};

/// The signer gateway's stage: its settings and its keys.
pub struct SignStage {
    pub config: SignerConfig,
    pub keys: Keys,
}

impl SignStage {
    pub fn new(config: SignerConfig, keys: Keys) -> SignStage {
        SignStage { config, keys }
    }
}

impl Handler for SignStage {
    type Input = TxAllocated;

    fn role(&self) -> Role {
        Role::SignerGateway
    }

    fn input_topic(&self) -> String {
        self.config.topics.tx_allocated()
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
        match self.handle_batch(w, &[a]).await?.pop() {
            Some(result) => result,
            None => Ok(Vec::new()),
        }
    }

    /// All of a signer's TxAllocated of a batch: their rows locked and decided together, the
    /// signatures and failures written with one statement each.
    async fn handle_batch(&self, w: &mut Fenced<'_>, inputs: &[&TxAllocated]) -> BatchResults {
        let mut requests = Vec::with_capacity(inputs.len());
        let mut invalid = Vec::new();
        for (k, a) in inputs.iter().enumerate() {
            match Uuid::parse_str(&a.tx_id) {
                Ok(tx_id) => requests.push((tx_id, Some(*a))),
                Err(_) => invalid.push(k),
            }
        }
        let mut answered = self.sign_recorded(w, &requests).await?.into_iter();
        Ok((0..inputs.len())
            .map(|k| {
                if invalid.contains(&k) {
                    Err(HandlerError::Reject(Rejection::new(
                        "INVALID_TX_ID",
                        format!("{:?} is not a transaction id", inputs[k].tx_id),
                    )))
                } else {
                    answered.next().unwrap_or_else(|| Ok(Vec::new()))
                }
            })
            .collect())
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        store::pending_signers(pool, self.config.chain_id).await
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
        let rows = store::allocated(ctx.pool, ctx.lease.key()).await?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let requests: Vec<(Uuid, Option<&TxAllocated>)> =
            rows.iter().map(|r| (r.tx_id, None)).collect();
        let mut tx = ctx.lease.begin(ctx.pool).await?;
        let answered = self.sign_recorded(&mut tx.writer(), &requests).await?;
        tx.commit().await?;
        // No event claims anything here, so nothing is rejected.
        let mut outputs = Vec::new();
        for a in answered {
            outputs.extend(a?);
        }
        Ok(outputs)
    }
}

/// What became of one requested transaction, in request order.
enum Step {
    Signed(Signing),
    Failed(Failing),
    Reannounce(Uuid),
    Nothing,
    Rejected(Rejection),
    /// The same transaction as an earlier request of the batch (an event delivered twice): the
    /// same announcement as that one's.
    Same(usize),
}

impl SignStage {
    /// Signs the requested transactions as PostgreSQL records them. Each request names a
    /// transaction and, for a message, the event that asked for it (which must agree with the
    /// row). Outputs come in request order.
    async fn sign_recorded(
        &self,
        w: &mut Fenced<'_>,
        requests: &[(Uuid, Option<&TxAllocated>)],
    ) -> Result<Vec<Result<Vec<Output>, HandlerError>>, HandlerError> {
        let lease_key = w.lease().key().clone();
        let token = w.lease().token().0;
        let ids: Vec<Uuid> = requests.iter().map(|(id, _)| *id).collect();

        // Load: the row is the truth, locked so that the event and the scan never sign it twice.
        let rows = store::lock(w, &ids).await?;
        let by_id: HashMap<Uuid, &TxRow> = rows.iter().map(|r| (r.tx_id, r)).collect();
        let key = self.keys.get(&lease_key.signer);

        // Decide, and sign what is to be signed (local keys: no I/O).
        let at = At {
            chain_id: lease_key.chain_id,
            signer: &lease_key.signer,
            token,
        };
        let mut steps = Vec::with_capacity(requests.len());
        let mut decided: HashMap<Uuid, usize> = HashMap::new();
        for (k, &(tx_id, claimed)) in requests.iter().enumerate() {
            if let Some(&first) = decided.get(&tx_id) {
                steps.push(Step::Same(first));
                continue;
            }
            decided.insert(tx_id, k);
            let row = by_id.get(&tx_id).copied();
            let decision = decide::decide(&Input {
                tx_id,
                chain_id: lease_key.chain_id,
                signer: &lease_key.signer,
                row,
                claimed,
                policy: &self.config.policy,
                key,
            });
            steps.push(match decision {
                Decision::Reject(r) => Step::Rejected(r),
                Decision::Nothing => Step::Nothing,
                Decision::Reannounce => Step::Reannounce(tx_id),
                Decision::Sign {
                    row,
                    nonce,
                    tx,
                    key,
                } => match sign(key, &tx) {
                    Ok(signed) => Step::Signed(at.signing(row, nonce, &tx, signed)),
                    Err(e) => Step::Failed(at.failing(
                        row,
                        nonce,
                        FailureCode::SigningFailed,
                        &e.to_string(),
                    )),
                },
                Decision::Fail {
                    row,
                    nonce,
                    code,
                    reason,
                } => Step::Failed(at.failing(row, nonce, code, &reason)),
            });
        }

        // Persist: the attempts' numbers, then one statement per transition.
        let to_sign: Vec<Uuid> = steps
            .iter()
            .filter_map(|s| match s {
                Step::Signed(s) => Some(s.tx_id),
                _ => None,
            })
            .collect();
        let highest = store::highest_attempts(w, &to_sign).await?;
        let mut signings = Vec::new();
        let mut failings = Vec::new();
        for step in &mut steps {
            match step {
                Step::Signed(s) => {
                    s.event.attempt = decide::next_attempt(highest.get(&s.tx_id).copied());
                    signings.push(s.clone());
                }
                Step::Failed(f) => failings.push(f.clone()),
                Step::Reannounce(_) | Step::Nothing | Step::Rejected(_) | Step::Same(_) => {}
            }
        }
        store::sign(w, &signings).await?;
        store::fail_allocated(w, &failings).await?;
        for f in &failings {
            tracing::warn!(
                tx_id = %f.tx_id,
                nonce = f.event.nonce,
                code = f.code.as_str(),
                reason = %f.event.reason,
                "the transaction cannot be signed: failed, nonce released"
            );
        }
        let to_reannounce: Vec<Uuid> = steps
            .iter()
            .filter_map(|s| match s {
                Step::Reannounce(id) => Some(*id),
                _ => None,
            })
            .collect();
        let mut stored: HashMap<Uuid, Vec<TxSigned>> = HashMap::new();
        for (tx_id, e) in store::signed_events(w, &to_reannounce).await? {
            stored.entry(tx_id).or_default().push(e);
        }

        // Outputs, one list per request.
        let key = signer_key(lease_key.chain_id.0, lease_key.signer.as_str());
        let topics = &self.config.topics;
        let signed =
            |e: TxSigned| Output::new(topics.tx_signed(), Subjects::TopicName, key.clone(), e);
        let failed = |e: TxFailed| {
            Output::new(
                topics.tx_outcomes(),
                Subjects::TopicRecordName,
                key.clone(),
                e,
            )
        };
        let event_of = |step: &Step| -> Option<Result<TxSigned, TxFailed>> {
            match step {
                Step::Signed(s) => Some(Ok(s.event.clone())),
                Step::Failed(f) => Some(Err(f.event.clone())),
                Step::Reannounce(tx_id) => stored
                    .get(tx_id)
                    .cloned()
                    .and_then(decide::latest_signed)
                    .map(Ok),
                Step::Nothing | Step::Rejected(_) | Step::Same(_) => None,
            }
        };
        let mut results = Vec::with_capacity(steps.len());
        for step in &steps {
            let event = match step {
                Step::Rejected(r) => {
                    results.push(Err(HandlerError::Reject(r.clone())));
                    continue;
                }
                Step::Same(first) => event_of(&steps[*first]),
                other => event_of(other),
            };
            results.push(Ok(match event {
                Some(Ok(e)) => vec![signed(e)],
                Some(Err(e)) => vec![failed(e)],
                None => Vec::new(),
            }));
        }
        txflow_core::fault::point(txflow_core::fault::SIGNER_BEFORE_COMMIT);
        Ok(results)
    }
}

/// The signer and lease the events are written for.
struct At<'a> {
    chain_id: ChainId,
    signer: &'a Signer,
    token: i64,
}

impl At<'_> {
    /// The signature of `row` to record (its attempt number is set once the highest recorded
    /// one is read).
    fn signing(&self, row: &TxRow, nonce: i64, tx: &UnsignedTx, signed: SignedTx) -> Signing {
        let event_id = Uuid::new_v4();
        Signing {
            tx_id: row.tx_id,
            event_id,
            event: TxSigned {
                event_id: event_id.to_string(),
                tx_id: row.tx_id.to_string(),
                chain_id: self.chain_id.0,
                signer: self.signer.as_str().to_string(),
                nonce,
                attempt: 1,
                tx_hash: format!("{:#x}", signed.hash),
                raw_tx: signed.raw,
                max_fee_per_gas: tx.max_fee_per_gas.to_string(),
                max_priority_fee_per_gas: tx.max_priority_fee_per_gas.to_string(),
                fencing_token: self.token,
            },
        }
    }

    /// The failure of `row` to record: FAILED with `code`, its nonce released.
    fn failing(&self, row: &TxRow, nonce: i64, code: FailureCode, reason: &str) -> Failing {
        let event_id = Uuid::new_v4();
        Failing {
            tx_id: row.tx_id,
            event_id,
            code,
            event: TxFailed {
                event_id: event_id.to_string(),
                tx_id: row.tx_id.to_string(),
                request_id: row.request_id.clone(),
                chain_id: self.chain_id.0,
                signer: self.signer.as_str().to_string(),
                code: code.as_str().to_string(),
                reason: truncate_reason(reason),
                nonce: Some(nonce),
                nonce_released: true,
                fencing_token: self.token,
            },
        }
    }
}
