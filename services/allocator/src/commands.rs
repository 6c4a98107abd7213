//! Operator commands for the allocator on `tx.commands`: APPROVE moves a PENDING_APPROVAL
//! transaction on to allocation; CANCEL fails a transaction that is not signed yet (releasing its
//! nonce if it had one). Both are
//! idempotent compare-and-sets on the state; a command for a transaction in another state changes
//! nothing. BUMP is the signer gateway's and is ignored here.

use std::sync::Arc;

use sqlx::PgPool;
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{TxCommand, TxCommandKind, TxFailed};
use txflow_core::fenced::{FENCE_PREDICATE, Fenced};
use txflow_core::kafka::signer_key;
use txflow_core::role::Role;
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output, Rejection};

use crate::handler::RequestStage;

pub struct CommandStage {
    pub requests: Arc<RequestStage>,
}

impl CommandStage {
    /// CANCEL of an ALLOCATED transaction (not signed yet): FAILED (CANCELLED) and its nonce
    /// released, to be taken by the signer's next request or filled with a no-op. A transaction
    /// already signed can no longer be cancelled this way.
    async fn cancel_allocated(
        &self,
        w: &mut Fenced<'_>,
        c: &TxCommand,
        tx_id: uuid::Uuid,
    ) -> Result<Vec<Output>, HandlerError> {
        let lease = w.lease().clone();
        let row: Vec<(String, i64)> = w
            .read(
                "cancel",
                sqlx::query_as(
                    "SELECT request_id, nonce FROM managed_tx WHERE tx_id = $1 AND chain_id = $2
                       AND signer = $3 AND state = 'ALLOCATED' AND nonce IS NOT NULL FOR UPDATE",
                )
                .bind(tx_id)
                .bind(lease.key().chain_id.0)
                .bind(lease.key().signer.as_str().to_string()),
            )
            .await?;
        let Some((request_id, nonce)) = row.into_iter().next() else {
            tracing::info!(tx_id = %tx_id, "cancel: nothing to cancel in this state");
            return Ok(Vec::new());
        };
        let reason = format!(
            "cancelled by {}{}",
            c.requested_by,
            c.reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        );
        let failed = TxFailed {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            request_id,
            chain_id: lease.key().chain_id.0,
            signer: lease.key().signer.as_str().to_string(),
            code: "CANCELLED".into(),
            reason: reason.chars().take(500).collect(),
            nonce: Some(nonce),
            nonce_released: true,
            fencing_token: lease.token().0,
        };
        let event = serde_json::to_value(&failed)
            .map_err(|e| HandlerError::transient("event".to_string(), e))?;
        let event_id = uuid::Uuid::parse_str(&failed.event_id)
            .map_err(|e| HandlerError::transient("event id".to_string(), e))?;
        let sql = format!(
            "WITH upd AS (
                 UPDATE managed_tx SET state = 'FAILED', failure_code = 'CANCELLED', failure_reason = $7,
                        nonce_released = true, fencing_token = $5, updated_at = now()
                 WHERE tx_id = $6 AND state = 'ALLOCATED' AND {FENCE_PREDICATE}
                 RETURNING tx_id)
             INSERT INTO tx_events (event_id, tx_id, type, payload)
             SELECT $8, tx_id, 'TxFailed', $9 FROM upd RETURNING tx_id"
        );
        w.fetch_one::<(uuid::Uuid,)>("cancel allocated", &sql, |q| {
            q.bind(tx_id)
                .bind(failed.reason.clone())
                .bind(event_id)
                .bind(event)
        })
        .await?;
        w.release_nonce(nonce).await?;
        tracing::info!(tx_id = %tx_id, nonce, by = %c.requested_by, "cancelled after allocation; nonce released");
        let key = signer_key(c.chain_id, lease.key().signer.as_str());
        Ok(vec![Output::new(
            self.requests.topics.tx_outcomes(),
            Subjects::TopicRecordName,
            key,
            failed,
        )])
    }
}

impl Handler for CommandStage {
    type Input = TxCommand;

    fn role(&self) -> Role {
        Role::Allocator
    }

    fn input_topic(&self) -> String {
        self.requests.topics.tx_commands()
    }

    fn route(&self, c: &TxCommand) -> Result<(ChainId, Signer), Rejection> {
        if uuid::Uuid::parse_str(&c.tx_id).is_err() {
            return Err(Rejection::new(
                "INVALID_TX_ID",
                format!("{:?} is not a transaction id", c.tx_id),
            ));
        }
        let s = Signer::parse(&c.signer)
            .map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))?;
        Ok((ChainId(c.chain_id), s))
    }

    async fn handle(&self, w: &mut Fenced<'_>, c: &TxCommand) -> Result<Vec<Output>, HandlerError> {
        let tx_id = uuid::Uuid::parse_str(&c.tx_id).map_err(|_| {
            HandlerError::Reject(Rejection::new("INVALID_TX_ID", "not a transaction id"))
        })?;
        match c.command {
            TxCommandKind::Approve => {
                let sql = format!(
                    "UPDATE managed_tx SET state = 'SIMULATED', sub_state = 'approved by ' || $7,
                            fencing_token = $5, updated_at = now()
                     WHERE tx_id = $6 AND chain_id = $2 AND signer = $3 AND state = 'PENDING_APPROVAL'
                       AND {FENCE_PREDICATE} RETURNING tx_id"
                );
                let done: Vec<(uuid::Uuid,)> = w
                    .fetch_all("approve", &sql, |q| {
                        q.bind(tx_id).bind(c.requested_by.clone())
                    })
                    .await?;
                tracing::info!(tx_id = %tx_id, by = %c.requested_by, applied = !done.is_empty(), "approve");
                Ok(Vec::new())
            }
            TxCommandKind::Cancel => {
                let row: Vec<(String,)> = w
                    .read(
                        "cancel",
                        sqlx::query_as("SELECT request_id FROM managed_tx WHERE tx_id = $1 AND state IN ('RECEIVED', 'SIMULATED', 'PENDING_APPROVAL')")
                            .bind(tx_id),
                    )
                    .await?;
                let Some((request_id,)) = row.into_iter().next() else {
                    return self.cancel_allocated(w, c, tx_id).await;
                };
                let key = signer_key(c.chain_id, w.lease().key().signer.as_str());
                let reason = format!(
                    "cancelled by {}{}",
                    c.requested_by,
                    c.reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                );
                self.requests
                    .fail(w, &key, tx_id, &request_id, "CANCELLED", &reason)
                    .await
            }
            TxCommandKind::Bump => Ok(Vec::new()),
        }
    }

    async fn pending_signers(&self, _pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        Ok(Vec::new())
    }

    /// Allocates what an approval released.
    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        self.requests.drive(ctx).await
    }
}
