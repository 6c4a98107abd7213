//! A test stage for the runtime's tests: it consumes `TxRequest`s, records each as a managed
//! transaction in RECEIVED (idempotent on the request id) and announces `TxAccepted`; then, outside
//! the transaction, it makes an "external call" (an idempotent upsert into `test_external_calls`,
//! standing in for an RPC node) and records its result by moving the transaction to SIMULATED.

use sqlx::PgPool;
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{TxAccepted, TxRequest};
use txflow_core::fault;
use txflow_core::fenced::{FENCE_PREDICATE, Fenced};
use txflow_core::kafka::signer_key;
use txflow_core::role::Role;
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output, Rejection};

pub struct TestStage {
    pub input: String,
    pub outcomes: String,
}

/// The "external system" the test stage calls: one row per idempotency key, counting calls.
pub async fn create_external_system(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS test_external_calls (
             key TEXT PRIMARY KEY, calls INTEGER NOT NULL, result TEXT NOT NULL)",
    )
    .execute(pool)
    .await
    .map(|_| ())
}

impl Handler for TestStage {
    type Input = TxRequest;

    fn role(&self) -> Role {
        Role::Allocator
    }

    fn input_topic(&self) -> String {
        self.input.clone()
    }

    fn route(&self, r: &TxRequest) -> Result<(ChainId, Signer), Rejection> {
        if r.request_id.is_empty() || r.request_id.len() > 64 {
            return Err(Rejection::new(
                "INVALID_REQUEST_ID",
                "request_id must have 1 to 64 characters",
            ));
        }
        let signer = Signer::parse(&r.signer)
            .map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))?;
        Ok((ChainId(r.chain_id), signer))
    }

    async fn handle(&self, w: &mut Fenced<'_>, r: &TxRequest) -> Result<Vec<Output>, HandlerError> {
        let tx_id = uuid::Uuid::new_v4();
        let key = signer_key(r.chain_id, &r.signer);
        let accepted = TxAccepted {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            request_id: r.request_id.clone(),
            chain_id: r.chain_id,
            signer: key
                .split_once(':')
                .map(|(_, s)| s.to_string())
                .unwrap_or_default(),
            fencing_token: w.lease().token().0,
            accepted_at_ms: chrono::Utc::now().timestamp_millis(),
        };
        let payload =
            serde_json::to_value(&accepted).map_err(|e| HandlerError::transient("encode", e))?;
        let sql = format!(
            "WITH ins AS (
                 INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, payload, state, fencing_token)
                 SELECT $6, $2, $3, $7, $8, 'RECEIVED', $5 WHERE {FENCE_PREDICATE}
                 ON CONFLICT (chain_id, signer, request_id) DO NOTHING
                 RETURNING tx_id)
             INSERT INTO tx_events (event_id, tx_id, type, payload)
             SELECT $9, tx_id, 'TxAccepted', $8 FROM ins
             RETURNING tx_id"
        );
        let event_id = uuid::Uuid::parse_str(&accepted.event_id)
            .map_err(|e| HandlerError::transient("uuid", e))?;
        let inserted: Vec<(uuid::Uuid,)> = w
            .fetch_all("accept", &sql, |q| {
                q.bind(tx_id)
                    .bind(r.request_id.clone())
                    .bind(payload.clone())
                    .bind(event_id)
            })
            .await?;
        let event = if inserted.is_empty() {
            // A duplicate (re-emit the original announcement), or fenced.
            let original: Vec<(serde_json::Value,)> = w
                .read(
                    "accept",
                    sqlx::query_as(
                        "SELECT e.payload FROM managed_tx m JOIN tx_events e ON e.tx_id = m.tx_id AND e.type = 'TxAccepted'
                         WHERE m.chain_id = $1 AND m.signer = $2 AND m.request_id = $3",
                    )
                    .bind(r.chain_id)
                    .bind(w.lease().key().signer.as_str().to_string())
                    .bind(r.request_id.clone()),
                )
                .await?;
            match original.into_iter().next() {
                Some((p,)) => serde_json::from_value(p)
                    .map_err(|e| HandlerError::transient("decode stored event", e))?,
                None => return Err(w.fenced("accept").into()),
            }
        } else {
            accepted
        };
        Ok(vec![Output::new(
            self.outcomes.clone(),
            Subjects::TopicRecordName,
            key,
            event,
        )])
    }

    async fn pending_signers(&self, pool: &PgPool) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "SELECT DISTINCT chain_id, signer FROM managed_tx WHERE state = 'RECEIVED'",
        )
        .fetch_all(pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(c, s)| Signer::parse(&s).ok().map(|s| (ChainId(c), s)))
            .collect())
    }

    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let key = ctx.lease.key();
        let pending: Vec<(uuid::Uuid,)> = sqlx::query_as(
            "SELECT tx_id FROM managed_tx WHERE chain_id = $1 AND signer = $2 AND state = 'RECEIVED' ORDER BY created_at",
        )
        .bind(key.chain_id.0)
        .bind(key.signer.as_str())
        .fetch_all(ctx.pool)
        .await
        .map_err(|e| HandlerError::transient("list pending", e))?;
        for (tx_id,) in pending {
            // The external call, outside any transaction; idempotent by its key.
            let (result,): (String,) = sqlx::query_as(
                "INSERT INTO test_external_calls (key, calls, result) VALUES ($1, 1, 'ok:' || $1)
                 ON CONFLICT (key) DO UPDATE SET calls = test_external_calls.calls + 1
                 RETURNING result",
            )
            .bind(tx_id.to_string())
            .fetch_one(ctx.pool)
            .await
            .map_err(|e| HandlerError::transient("external call", e))?;
            fault::point(fault::AFTER_CALL);
            // Record the result, fenced, as a compare-and-set on the state.
            let mut tx = ctx.lease.begin(ctx.pool).await?;
            let sql = format!(
                "UPDATE managed_tx SET state = 'SIMULATED', sub_state = $7, fencing_token = $5, updated_at = now()
                 WHERE tx_id = $6 AND state = 'RECEIVED' AND {FENCE_PREDICATE}
                 RETURNING tx_id"
            );
            let moved: Vec<(uuid::Uuid,)> = tx
                .writer()
                .fetch_all("record call", &sql, |q| q.bind(tx_id).bind(result.clone()))
                .await?;
            if !moved.is_empty() {
                let sql = format!(
                    "INSERT INTO tx_events (event_id, tx_id, type, payload)
                     SELECT $6, $7, 'Called', jsonb_build_object('result', $8::text) WHERE {FENCE_PREDICATE}"
                );
                tx.writer()
                    .execute("record call", &sql, |q| {
                        q.bind(uuid::Uuid::new_v4())
                            .bind(tx_id)
                            .bind(result.clone())
                    })
                    .await?;
            }
            tx.commit().await?;
        }
        Ok(Vec::new())
    }
}
