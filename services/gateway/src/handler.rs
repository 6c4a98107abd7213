//! The HTTP API (seed 004 §8): `POST /api/v1/internal_transfer`, `GET
//! /api/v1/internal_transfer/{req_id}`, `/healthz`, `/readyz`.
//!
//! A transfer request is checked in the order of §1.5.8: (1) authentication, (2) the request's
//! `user_id` against the token's, (3–6) the request's format, account types, asset and amount
//! (the domain's `validate_request`, against the `assets` table), (7) the rate limit, (8) `cid`
//! idempotency, then the transfer is recorded in INIT. The balance (9) is the FUNDING adapter's
//! check, made when the coordinator executes the transfer.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::SecondsFormat;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use txflow_core::transfer::{
    Rejected, TransferCode, TransferRequest, TransferState, check_id, validate_request,
};

use crate::auth::Verifier;
use crate::error::ApiError;
use crate::rate::RateLimiter;
use crate::store::{self, NewTransfer, TransferRow};

/// How long `/readyz` waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub struct AppState(Arc<Inner>);

struct Inner {
    pool: PgPool,
    verifier: Verifier,
    limiter: RateLimiter,
    body_limit: usize,
}

impl AppState {
    pub fn new(
        pool: PgPool,
        verifier: Verifier,
        limiter: RateLimiter,
        body_limit: usize,
    ) -> AppState {
        AppState(Arc::new(Inner {
            pool,
            verifier,
            limiter,
            body_limit,
        }))
    }
}

/// The API's routes, with the body limit and the per-request timeout.
pub fn router(state: AppState, timeout: Duration) -> Router {
    let body_limit = state.0.body_limit;
    Router::new()
        .route("/api/v1/internal_transfer", post(create_transfer))
        .route("/api/v1/internal_transfer/{req_id}", get(get_transfer))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(|| async { ApiError::not_found() })
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn_with_state(timeout, with_timeout))
        .with_state(state)
}

/// A request not answered within `timeout` gets 503 SYSTEM_ERROR. Its work is dropped; a
/// transfer it recorded stays recorded, and a retry with the same `cid` returns it.
async fn with_timeout(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(
                timeout_ms = timeout.as_millis() as u64,
                "gateway: a request timed out"
            );
            ApiError::system("the request timed out; retry it (with the same cid)").into_response()
        }
    }
}

/// The body of §8.1, plus `cid` (the client's idempotency key) and `user_id` (the user the
/// client acts for; the token's when left out).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TransferBody {
    from: String,
    to: String,
    asset: String,
    /// A decimal string; a JSON number is refused (INVALID_AMOUNT), never read as a float.
    amount: Value,
    #[serde(default)]
    cid: Option<String>,
    #[serde(default)]
    user_id: Option<String>,
}

/// A transfer as §8.1 and §8.2 show it.
#[derive(Debug, Serialize)]
pub struct TransferView {
    pub transfer_id: i64,
    pub req_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cid: Option<String>,
    pub user_id: String,
    pub from: String,
    pub to: String,
    pub asset: String,
    pub amount: String,
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<&'static str>,
}

fn view(row: TransferRow, message: Option<&'static str>) -> Result<TransferView, ApiError> {
    let state = TransferState::from_id(row.state).map_err(|e| {
        tracing::error!(req_id = %row.req_id, error = %e, "gateway: a transfer holds an unknown state");
        ApiError::system("the transfer's state is unreadable")
    })?;
    Ok(TransferView {
        transfer_id: row.transfer_id,
        req_id: row.req_id,
        cid: row.cid,
        user_id: row.user_id,
        from: row.source_account,
        to: row.target_account,
        asset: row.asset,
        amount: row.amount,
        state: state.as_str(),
        error_code: row.error_code,
        created_at: row.created_at.to_rfc3339_opts(SecondsFormat::Millis, true),
        updated_at: row.updated_at.to_rfc3339_opts(SecondsFormat::Millis, true),
        message,
    })
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

async fn create_transfer(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<TransferView>), ApiError> {
    // 1. Authentication.
    let user = s.0.verifier.user(&headers)?;
    // The body: bounded, JSON, a transfer request.
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(s.0.body_limit)
        } else {
            ApiError::malformed("the body could not be read")
        }
    })?;
    if !is_json(&headers) {
        return Err(ApiError::unsupported_media_type());
    }
    let req: TransferBody = serde_json::from_slice(&body).map_err(|e| {
        if e.is_data() {
            ApiError::malformed(format!("not a transfer request: {e}"))
        } else {
            ApiError::malformed(format!(
                "the body is not valid JSON (line {}, column {})",
                e.line(),
                e.column()
            ))
        }
    })?;
    // 2. Authorisation: the request acts for the token's user only.
    if req.user_id.as_deref().is_some_and(|u| u != user) {
        return Err(ApiError::forbidden("user_id is not the authenticated user"));
    }
    // 3–6. Format, account types, asset, amount.
    let cid = req
        .cid
        .as_deref()
        .map(|c| check_id("cid", c))
        .transpose()
        .map_err(ApiError::rejected)?;
    let amount = match &req.amount {
        Value::String(a) => a.as_str(),
        _ => {
            return Err(ApiError::rejected(Rejected::new(
                TransferCode::InvalidAmount,
                "the amount must be a decimal string, e.g. \"100.00\"",
            )));
        }
    };
    let assets = store::asset_table(&s.0.pool, &req.asset).await?;
    let valid = validate_request(
        &TransferRequest {
            user_id: &user,
            from: &req.from,
            to: &req.to,
            asset: &req.asset,
            amount,
        },
        &assets,
    )
    .map_err(ApiError::rejected)?;
    // 7. Rate limit.
    if !s.0.limiter.allow(&user) {
        return Err(ApiError::rate_limited());
    }
    // 8. Idempotency, and the INIT row.
    let new = NewTransfer {
        req_id: uuid::Uuid::now_v7().to_string(),
        cid: cid.map(str::to_string),
        user_id: valid.user_id,
        asset: valid.asset,
        amount: valid.amount.to_string(),
        direction: valid.direction,
    };
    if let Some(row) = store::insert(&s.0.pool, &new).await? {
        tracing::info!(
            req_id = %row.req_id,
            user_id = %row.user_id,
            asset = %row.asset,
            amount = %row.amount,
            from = %row.source_account,
            "gateway: transfer recorded (INIT)"
        );
        return Ok((
            StatusCode::ACCEPTED,
            Json(view(
                row,
                Some("accepted: recorded in INIT, to be executed"),
            )?),
        ));
    }
    // The cid is taken: the original transfer, if this is the same request.
    let Some(cid) = new.cid.as_deref() else {
        return Err(ApiError::store(store::StoreError::CidVanished));
    };
    let row = store::by_cid(&s.0.pool, &new.user_id, cid)
        .await?
        .ok_or(store::StoreError::CidVanished)?;
    let same = row.asset == new.asset
        && row.amount == new.amount
        && row.transfer_type == new.direction.transfer_type();
    if !same {
        return Err(ApiError::duplicate(
            "this cid was used for another transfer (other asset, amount or direction)",
        ));
    }
    Ok((
        StatusCode::OK,
        Json(view(row, Some("duplicate cid: the original transfer"))?),
    ))
}

async fn get_transfer(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(req_id): Path<String>,
) -> Result<Json<TransferView>, ApiError> {
    let user = s.0.verifier.user(&headers)?;
    if check_id("req_id", &req_id).is_err() {
        return Err(ApiError::not_found());
    }
    // Another user's transfer is not found, exactly as an unknown one.
    match store::by_req_id(&s.0.pool, &user, &req_id).await? {
        Some(row) => Ok(Json(view(row, None)?)),
        None => Err(ApiError::not_found()),
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, Json<Value>) {
    let ok = matches!(
        tokio::time::timeout(READY_TIMEOUT, store::ping(&s.0.pool)).await,
        Ok(Ok(()))
    );
    if ok {
        (
            StatusCode::OK,
            Json(serde_json::json!({"status": "ready", "checks": {"database": "ok"}})),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({
                "status": "not ready",
                "checks": {"database": "unreachable"},
                "failed": ["database"],
            })),
        )
    }
}
