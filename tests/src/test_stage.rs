//! A test stage for the runtime's tests, in the shape of every stage (decide / store through
//! `txstore`): it consumes `TxRequest`s, records each as a managed transaction in RECEIVED
//! (idempotent on the request id) and announces `TxAccepted`; then, outside the transaction, it
//! makes an "external call" (an idempotent upsert into `test_external_calls`, standing in for an
//! RPC node) and records its result with the move SIMULATE (audited as `TxSimulated`).
//!
//! Deterministic failures, for the runtime's `HandlerError::Fail` decisions (any other request
//! id behaves as above):
//! - a request whose `request_id` starts with [`FAIL_PREFIX`] fails in `handle`, before anything
//!   is written, with code [`FAIL_CODE`];
//! - a RECEIVED row whose `request_id` starts with [`FAIL_DRIVE_PREFIX`] fails its signer's
//!   `drive`, before the row's external call, with code [`FAIL_DRIVE_CODE`].

use sqlx::PgPool;
use txflow_core::codec::Subjects;
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::{TxAccepted, TxRequest};
use txflow_core::fault;
use txflow_core::fenced::Fenced;
use txflow_core::kafka::signer_key;
use txflow_core::role::Role;
use txflow_core::stage::{DriveCtx, Handler, HandlerError, Output, Rejection};
use txflow_core::state::{SIMULATE, TxState};
use txflow_core::txstore::{self, Audit, Kind, MoveRow, NewTx};

/// A request id starting with this fails `handle` with [`FAIL_CODE`].
pub const FAIL_PREFIX: &str = "fail-";
/// The `error.code` of a request that fails in `handle`.
pub const FAIL_CODE: &str = "TEST_FAIL";
/// A RECEIVED row whose request id starts with this fails its signer's `drive` with
/// [`FAIL_DRIVE_CODE`].
pub const FAIL_DRIVE_PREFIX: &str = "faildrive-";
/// The code of a `drive` that fails on a [`FAIL_DRIVE_PREFIX`] row.
pub const FAIL_DRIVE_CODE: &str = "TEST_DRIVE_FAIL";

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

fn stored(p: serde_json::Value) -> Result<TxAccepted, HandlerError> {
    serde_json::from_value(p).map_err(|e| HandlerError::fail("CORRUPT_EVENT", e.to_string()))
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
        if r.request_id.starts_with(FAIL_PREFIX) {
            return Err(HandlerError::fail(
                FAIL_CODE,
                format!("request {} fails by design", r.request_id),
            ));
        }
        let tx_id = uuid::Uuid::new_v4();
        let lease = w.lease().clone();
        let key = signer_key(r.chain_id, lease.key().signer.as_str());
        let accepted = TxAccepted {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            request_id: r.request_id.clone(),
            chain_id: r.chain_id,
            signer: lease.key().signer.as_str().to_string(),
            fencing_token: lease.token().0,
            accepted_at_ms: chrono::Utc::now().timestamp_millis(),
        };
        let payload = serde_json::to_value(&accepted)
            .map_err(|e| HandlerError::fail("ENCODE", e.to_string()))?;
        let event_id = uuid::Uuid::parse_str(&accepted.event_id)
            .map_err(|e| HandlerError::fail("ENCODE", e.to_string()))?;
        let row = NewTx {
            tx_id,
            request_id: r.request_id.clone(),
            kind: Kind::Request,
            nonce: None,
            payload: payload.clone(),
            audit: Audit {
                event_id,
                event_type: "TxAccepted",
                payload,
            },
        };
        let event = if txstore::create(w, &[row]).await?.is_empty() {
            // A duplicate: re-emit the original announcement.
            let original: Vec<(serde_json::Value,)> = w
                .read(
                    "accept",
                    sqlx::query_as(
                        "SELECT e.payload FROM managed_tx m JOIN tx_events e ON e.tx_id = m.tx_id AND e.type = 'TxAccepted'
                         WHERE m.chain_id = $1 AND m.signer = $2 AND m.request_id = $3",
                    )
                    .bind(r.chain_id)
                    .bind(lease.key().signer.as_str().to_string())
                    .bind(r.request_id.clone()),
                )
                .await?;
            match original.into_iter().next() {
                Some((p,)) => stored(p)?,
                None => return Err(HandlerError::fail("CORRUPT_EVENT", "no TxAccepted")),
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
        let rows: Vec<(i64, String)> =
            sqlx::query_as("SELECT DISTINCT chain_id, signer FROM managed_tx WHERE state = $1")
                .bind(TxState::Received.as_str())
                .fetch_all(pool)
                .await?;
        Ok(txstore::signer_keys(rows))
    }

    async fn drive(&self, ctx: DriveCtx<'_>) -> Result<Vec<Output>, HandlerError> {
        let key = ctx.lease.key();
        let pending = txstore::rows_in_states(
            ctx.pool,
            key.chain_id,
            &key.signer,
            &[TxState::Received],
            false,
            i64::MAX,
        )
        .await
        .map_err(|e| HandlerError::classified("list pending", e))?;
        for row in pending {
            if row.request_id.starts_with(FAIL_DRIVE_PREFIX) {
                return Err(HandlerError::fail(
                    FAIL_DRIVE_CODE,
                    format!("row {} ({}) fails by design", row.tx_id, row.request_id),
                ));
            }
            // The external call, outside any transaction; idempotent by its key.
            let (result,): (String,) = sqlx::query_as(
                "INSERT INTO test_external_calls (key, calls, result) VALUES ($1, 1, 'ok:' || $1)
                 ON CONFLICT (key) DO UPDATE SET calls = test_external_calls.calls + 1
                 RETURNING result",
            )
            .bind(row.tx_id.to_string())
            .fetch_one(ctx.pool)
            .await
            .map_err(|e| HandlerError::transient("external call", e))?;
            fault::point(fault::AFTER_CALL);
            // Record the result, fenced, as a compare-and-set on the state.
            let mut tx = ctx.lease.begin(ctx.pool).await?;
            let recorded = MoveRow::new(
                row.tx_id,
                uuid::Uuid::new_v4(),
                serde_json::json!({ "result": result }),
            );
            txstore::apply(&mut tx.writer(), SIMULATE, &[recorded]).await?;
            tx.commit().await?;
        }
        Ok(Vec::new())
    }
}
