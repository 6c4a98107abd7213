//! `GET /api/v1/audit`: the gateway's audit log (`gateway_audit`) — every submit, approve and
//! cancel through the gateway, allowed or refused — for a token with scope `audit:read`. Rows
//! are append-only in the database; this endpoint only reads them, oldest first, in pages.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use chrono::SecondsFormat;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::error::{ApiError, ErrorBody};
use crate::handler::AppState;
use crate::store::{self, AuditRow};

/// The most rows one page returns (and its default).
pub const MAX_PAGE: i64 = 500;

/// A page of the audit log.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Rows after this `audit_id` (0, the default: from the first).
    pub after: Option<i64>,
    /// At most this many rows (1 to 500; 500 by default).
    pub limit: Option<i64>,
}

/// One audited action.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditView {
    pub audit_id: i64,
    /// RFC 3339, UTC, milliseconds.
    pub at: String,
    /// The token's `sub`.
    pub principal: String,
    /// `tx.submit`, `tx.approve` or `tx.cancel`.
    pub action: String,
    /// `tx.submit`: `chain_id/signer/request_id`; otherwise the `tx_id` as given.
    pub target: String,
    /// `allowed` (authorized; written before publishing), `refused` (with `code`) or
    /// `unpublished` (after `allowed`: the broker did not take it).
    pub outcome: String,
    pub code: Option<String>,
    pub detail: Option<String>,
}

impl From<AuditRow> for AuditView {
    fn from(r: AuditRow) -> AuditView {
        AuditView {
            audit_id: r.audit_id,
            at: r.at.to_rfc3339_opts(SecondsFormat::Millis, true),
            principal: r.principal,
            action: r.action,
            target: r.target,
            outcome: r.outcome,
            code: r.code,
            detail: r.detail,
        }
    }
}

/// The audit log, oldest first. Needs scope `audit:read`.
#[utoipa::path(
    get,
    path = "/api/v1/audit",
    tag = "audit",
    params(AuditQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Audit rows after `after`, oldest first", body = [AuditView]),
        (status = 400, description = "INVALID_REQUEST: a malformed parameter", body = ErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: the token lacks scope audit:read", body = ErrorBody),
        (status = 503, description = "SYSTEM_ERROR", body = ErrorBody),
    )
)]
pub async fn get_audit(
    State(s): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<AuditQuery>, QueryRejection>,
) -> Result<Json<Vec<AuditView>>, ApiError> {
    let caller = s.0.verifier.caller(&headers)?;
    caller.require_audit()?;
    let Query(q) =
        query.map_err(|e| ApiError::malformed(format!("the query: {}", e.body_text())))?;
    let after = q.after.unwrap_or(0);
    let limit = q.limit.unwrap_or(MAX_PAGE);
    if after < 0 || !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::malformed(format!(
            "after must be 0 or more, limit 1 to {MAX_PAGE}"
        )));
    }
    let rows = store::audit_page(&s.0.pool, after, limit).await?;
    Ok(Json(rows.into_iter().map(AuditView::from).collect()))
}
