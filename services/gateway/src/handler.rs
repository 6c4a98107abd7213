//! The HTTP API (seed 004 §8): `POST /api/v1/internal_transfer`, `GET
//! /api/v1/internal_transfer/{req_id}`, the tx endpoints (`tx.rs`), `/healthz`, `/readyz`,
//! `/openapi.json`, `/metrics`.
//!
//! A transfer request is checked in the order of §1.5.8: (1) authentication, (2) the request's
//! `user_id` against the token's, (3–6) the request's format, account types, asset and amount
//! (the domain's `validate_request`, against the `assets` table), (7) the per-second rate limit,
//! then — unless transfers are halted (an open conservation violation: 503 SERVICE_HALTED,
//! nothing recorded) — in one transaction under the user's advisory lock: (8) `cid` idempotency
//! (a replay is answered before the daily limits, and never counts twice), the daily limits of
//! §1.5.6 (429 DAILY_LIMIT_EXCEEDED, DAILY_AMOUNT_EXCEEDED; see `store::record_within_limits`),
//! and the INIT row; then a TransferRequested is published to the coordinator (keyed by the
//! user). A failed publish does not fail the request:
//! the row is the truth, and the coordinator's recovery scan resumes INIT rows. A `cid` replay
//! publishes nothing. The balance (9) is the FUNDING adapter's check, made when the coordinator
//! executes the transfer.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::SecondsFormat;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use txflow_core::events::TransferRequested;
use txflow_core::kafka::Topics;
use txflow_core::transfer::{
    Rejected, TransferCode, TransferRequest, TransferState, check_id, validate_request,
};
use utoipa::ToSchema;

use crate::auth::Verifier;
use crate::error::{ApiError, ErrorBody};
use crate::publish::{Publisher, traceparent_of, transfer_requested_event_id};
use crate::rate::{Limits, RateLimiter};
use crate::store::{self, NewTransfer, Recorded, TransferRow};

/// How long `/readyz` waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub struct AppState(pub(crate) Arc<Inner>);

pub(crate) struct Inner {
    pub(crate) pool: PgPool,
    pub(crate) verifier: Verifier,
    pub(crate) limiter: RateLimiter,
    /// The transfers a user may create per UTC day (`gateway.daily_count`).
    pub(crate) daily_count: u32,
    pub(crate) body_limit: usize,
    pub(crate) publisher: Arc<Publisher>,
    pub(crate) topics: Topics,
    /// The chain this deployment serves.
    pub(crate) chain_id: i64,
    /// The OpenAPI document served at `/openapi.json` ([`AppState::with_openapi`]).
    pub(crate) openapi: String,
}

impl AppState {
    pub fn new(
        pool: PgPool,
        verifier: Verifier,
        limits: Limits,
        body_limit: usize,
        publisher: Arc<Publisher>,
        topics: Topics,
        chain_id: i64,
    ) -> AppState {
        AppState(Arc::new(Inner {
            pool,
            verifier,
            limiter: limits.rate,
            daily_count: limits.daily_count,
            body_limit,
            publisher,
            topics,
            chain_id,
            openapi: String::new(),
        }))
    }

    /// The document `/openapi.json` serves (`crate::openapi::pretty()`, given by the caller so
    /// that the handlers do not depend on the document that lists them).
    pub fn with_openapi(mut self, document: String) -> AppState {
        if let Some(inner) = Arc::get_mut(&mut self.0) {
            inner.openapi = document;
        }
        self
    }
}

/// The body of §8.1, plus `cid` (the client's idempotency key) and `user_id` (the user the
/// client acts for; the token's when left out).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TransferBody {
    /// The source account type: `FUNDING` or `SPOT`.
    #[schema(example = "FUNDING")]
    pub from: String,
    /// The target account type: `FUNDING` or `SPOT`, not `from`.
    #[schema(example = "SPOT")]
    pub to: String,
    /// The asset's code, as in the `assets` table.
    #[schema(example = "USDT")]
    pub asset: String,
    /// A decimal string; a JSON number is refused (INVALID_AMOUNT), never read as a float.
    #[schema(value_type = String, example = "100.00")]
    pub amount: Value,
    /// The client's idempotency key: the same `cid` again returns the original transfer.
    #[serde(default)]
    pub cid: Option<String>,
    /// The user the client acts for: the token's `sub` when left out, and only that.
    #[serde(default)]
    pub user_id: Option<String>,
}

/// A transfer as §8.1 and §8.2 show it.
#[derive(Debug, Serialize, ToSchema)]
pub struct TransferView {
    pub transfer_id: i64,
    /// Server-generated (a UUID v7).
    pub req_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cid: Option<String>,
    pub user_id: String,
    pub from: String,
    pub to: String,
    pub asset: String,
    /// An exact decimal string, trailing zeros trimmed.
    pub amount: String,
    /// The state's name of seed 004 §2.1 (`INIT` when just recorded).
    #[schema(value_type = String, example = "INIT")]
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// RFC 3339, UTC, milliseconds.
    pub created_at: String,
    pub updated_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
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

/// A request body: readable within `limit` bytes (413), JSON (415), a `what` (400
/// INVALID_REQUEST).
pub(crate) fn json_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    limit: usize,
    what: &str,
) -> Result<T, ApiError> {
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(limit)
        } else {
            ApiError::malformed("the body could not be read")
        }
    })?;
    if !is_json(headers) {
        return Err(ApiError::unsupported_media_type());
    }
    serde_json::from_slice(&body).map_err(|e| {
        if e.is_data() {
            ApiError::malformed(format!("not {what}: {e}"))
        } else {
            ApiError::malformed(format!(
                "the body is not valid JSON (line {}, column {})",
                e.line(),
                e.column()
            ))
        }
    })
}

/// Records a transfer request in INIT and publishes it to the transfer coordinator.
#[utoipa::path(
    post,
    path = "/api/v1/internal_transfer",
    tag = "transfers",
    request_body = TransferBody,
    security(("bearer" = [])),
    responses(
        (status = 202, description = "Recorded in INIT, to be executed", body = TransferView),
        (status = 200, description = "A `cid` already used for the same transfer: the original", body = TransferView),
        (status = 400, description = "An invalid request (INVALID_REQUEST, INVALID_AMOUNT, SAME_ACCOUNT, …)", body = ErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: `user_id` is not the token's", body = ErrorBody),
        (status = 409, description = "DUPLICATE_REQUEST: the `cid` was used for another transfer", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 429, description = "RATE_LIMIT_EXCEEDED (requests per second), DAILY_LIMIT_EXCEEDED (transfers per UTC day) or DAILY_AMOUNT_EXCEEDED (the asset's daily amount)", body = ErrorBody),
        (status = 503, description = "SERVICE_HALTED (a conservation violation is open) or SYSTEM_ERROR", body = ErrorBody),
    )
)]
pub async fn create_transfer(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<TransferView>), ApiError> {
    // 1. Authentication.
    let user = s.0.verifier.transfer_user(&headers)?;
    // The body: bounded, JSON, a transfer request.
    let req: TransferBody = json_body(&headers, body, s.0.body_limit, "a transfer request")?;
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
    // Halted: nothing is recorded while a conservation violation is open.
    if store::halted(&s.0.pool).await? {
        tracing::warn!(user_id = %user, "gateway: transfer refused, transfers are halted");
        return Err(ApiError::halted());
    }
    // 8. Idempotency, the daily limits and the INIT row, in one transaction under the user's lock.
    let new = NewTransfer {
        req_id: uuid::Uuid::now_v7().to_string(),
        cid: cid.map(str::to_string),
        user_id: valid.user_id,
        asset: valid.asset,
        amount: valid.amount.to_string(),
        direction: valid.direction,
    };
    let row = match store::record_within_limits(&s.0.pool, &new, s.0.daily_count).await? {
        Recorded::New(row) => {
            tracing::info!(
                req_id = %row.req_id,
                user_id = %row.user_id,
                asset = %row.asset,
                amount = %row.amount,
                from = %row.source_account,
                "gateway: transfer recorded (INIT)"
            );
            publish_requested(&s, &row, &traceparent_of(&headers)).await;
            return Ok((
                StatusCode::ACCEPTED,
                Json(view(
                    row,
                    Some("accepted: recorded in INIT, to be executed"),
                )?),
            ));
        }
        Recorded::DailyCount { daily_count } => {
            tracing::info!(user_id = %new.user_id, daily_count, "gateway: transfer refused, daily count reached");
            return Err(ApiError::daily_count(daily_count));
        }
        Recorded::DailyAmount { daily_limit } => {
            tracing::info!(user_id = %new.user_id, asset = %new.asset, daily_limit, "gateway: transfer refused, daily amount reached");
            return Err(ApiError::daily_amount(&new.asset, &daily_limit));
        }
        // The cid is taken: the original transfer, if this is the same request.
        Recorded::CidTaken(row) => row,
    };
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

/// Publishes the TransferRequested of a new transfer; a failure is logged, not answered (the
/// coordinator's recovery scan resumes the INIT row).
async fn publish_requested(s: &AppState, row: &TransferRow, traceparent: &str) {
    let event = TransferRequested {
        event_id: transfer_requested_event_id(&row.req_id).to_string(),
        req_id: row.req_id.clone(),
        user_id: row.user_id.clone(),
        asset: row.asset.clone(),
        amount: row.amount.clone(),
        from_account: row.source_account.clone(),
        to_account: row.target_account.clone(),
        created_at_ms: row.created_at.timestamp_millis(),
        traceparent: Some(traceparent.to_string()),
    };
    let topic = s.0.topics.transfer_requests();
    match s
        .0
        .publisher
        .publish(&topic, &row.user_id, &event, traceparent)
        .await
    {
        Ok(()) => {
            tracing::debug!(req_id = %row.req_id, topic, "gateway: TransferRequested published")
        }
        Err(e) => tracing::warn!(
            req_id = %row.req_id,
            error = %e,
            source = ?std::error::Error::source(&e).map(|s| s.to_string()),
            "gateway: publishing TransferRequested failed; the transfer stays in INIT for the coordinator's recovery scan"
        ),
    }
}

/// A transfer of the token's user (another user's is not found, exactly as an unknown one).
#[utoipa::path(
    get,
    path = "/api/v1/internal_transfer/{req_id}",
    tag = "transfers",
    params(("req_id" = String, Path, description = "The transfer's server-generated id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The transfer", body = TransferView),
        (status = 401, description = "UNAUTHORIZED", body = ErrorBody),
        (status = 404, description = "NOT_FOUND: unknown, or another user's", body = ErrorBody),
        (status = 503, description = "SYSTEM_ERROR", body = ErrorBody),
    )
)]
pub async fn get_transfer(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(req_id): Path<String>,
) -> Result<Json<TransferView>, ApiError> {
    let user = s.0.verifier.transfer_user(&headers)?;
    if check_id("req_id", &req_id).is_err() {
        return Err(ApiError::not_found());
    }
    // Another user's transfer is not found, exactly as an unknown one.
    match store::by_req_id(&s.0.pool, &user, &req_id).await? {
        Some(row) => Ok(Json(view(row, None)?)),
        None => Err(ApiError::not_found()),
    }
}

/// Liveness: the process answers.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "`ok`", body = String, content_type = "text/plain"))
)]
pub async fn healthz() -> &'static str {
    "ok\n"
}

/// What `/readyz` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// `ready` or `not ready`.
    pub status: &'static str,
    /// Each dependency: `database` (`ok` or `unreachable`) and `broker` (`ok`, or `unreachable`
    /// until the gateway's topics exist and after a failed publish).
    #[schema(value_type = std::collections::BTreeMap<String, String>)]
    pub checks: std::collections::BTreeMap<&'static str, &'static str>,
    /// The checks that failed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<String>)]
    pub failed: Vec<&'static str>,
}

/// Readiness: the database answers and the broker is usable.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Ready", body = Readiness),
        (status = 503, description = "Not ready", body = Readiness),
    )
)]
pub async fn readyz(State(s): State<AppState>) -> (StatusCode, Json<Readiness>) {
    let (database, broker) = tokio::join!(
        tokio::time::timeout(READY_TIMEOUT, store::ping(&s.0.pool)),
        s.0.publisher.ready(READY_TIMEOUT),
    );
    let mut checks = std::collections::BTreeMap::new();
    let mut failed = Vec::new();
    for (name, ok) in [
        ("database", matches!(database, Ok(Ok(())))),
        ("broker", broker),
    ] {
        checks.insert(name, if ok { "ok" } else { "unreachable" });
        if !ok {
            failed.push(name);
        }
    }
    let (status, word) = if failed.is_empty() {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    };
    (
        status,
        Json(Readiness {
            status: word,
            checks,
            failed,
        }),
    )
}

/// The OpenAPI document of this API (`services/gateway/openapi.json`).
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document", body = Object))
)]
pub async fn openapi(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(CONTENT_TYPE, "application/json")],
        state.0.openapi.clone(),
    )
}

/// The Prometheus text exposition of the process's metrics (`txflow_core::metrics`), among them
/// `gateway_requests_total{route, status}` and `gateway_rejections_total{code}`.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses(
        (status = 200, description = "Prometheus text exposition (version 0.0.4)", body = String, content_type = "text/plain"),
        (status = 500, description = "The exposition could not be encoded", body = String, content_type = "text/plain"),
    )
)]
pub async fn metrics() -> Response {
    const PROMETHEUS: &str = "text/plain; version=0.0.4";
    match txflow_core::metrics::encode_text() {
        Some(Ok(text)) => ([(CONTENT_TYPE, PROMETHEUS)], text).into_response(),
        Some(Err(e)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(CONTENT_TYPE, "text/plain")],
            format!("{e}\n"),
        )
            .into_response(),
        // Not initialised (a test's router): an empty exposition.
        None => ([(CONTENT_TYPE, PROMETHEUS)], String::new()).into_response(),
    }
}
