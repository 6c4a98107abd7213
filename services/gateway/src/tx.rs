//! The tx endpoints (shared ARCHITECTURE §8): the transaction pipeline's upstream contract over
//! HTTP. Each needs its scope for the transaction's signer (`tx:submit:<signer>`, `tx:read:…`,
//! `tx:approve:…`, `tx:cancel:…`; see `auth`): 403 FORBIDDEN without it. A transaction of a
//! signer the token may not read is 404 NOT_FOUND, as one that does not exist: its existence
//! does not leak. Every submit, approve and cancel, allowed or refused, is a `gateway_audit`
//! row; an approval by the transaction's submitter is 403 SELF_APPROVAL (four eyes).
//!
//! - `POST /api/v1/tx`: a TxRequest (ARCHITECTURE §2) as JSON, checked here as the allocator
//!   checks it (the allocator stays the authority), published to `tx.requests` keyed
//!   `{chain_id}:{signer}`; 202 once the broker acknowledged it. Idempotency is the allocator's,
//!   by `(chain_id, signer, request_id)`: the same request again is one transaction.
//! - `GET /api/v1/tx/{tx_id}`, `GET /api/v1/tx/by-request?chain_id=&signer=&request_id=`: the
//!   `managed_tx` row (404 NOT_FOUND until the allocator recorded it).
//! - `POST /api/v1/tx/{tx_id}/approve|cancel`: a TxCommand on `tx.commands` keyed
//!   `{chain_id}:{signer}`, `requested_by` the token's `sub`; 202 once acknowledged. Whether it
//!   applies (a transaction awaiting approval, one not yet signed) is the allocator's decision.

use std::collections::BTreeMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use txflow_core::domain::Signer;
use txflow_core::events::{TxCommand, TxCommandKind, TxRequest};
use txflow_core::kafka::signer_key;
use utoipa::{IntoParams, ToSchema};

use crate::auth::{Caller, TxAction};
use crate::config::{MAX_TX_DATA_BYTES, TX_BODY_LIMIT};
use crate::error::{ApiError, ErrorBody};
use crate::handler::{AppState, json_body};
use crate::publish::traceparent_of;
use crate::store::{self, AuditAction, AuditEntry, AuditOutcome, TxRow};

/// The longest `request_id` (ARCHITECTURE §2).
pub const MAX_REQUEST_ID: usize = 64;
/// The largest gas limit accepted (the allocator's).
pub use txflow_core::request::MAX_GAS_LIMIT;
/// At most this many metadata entries, keys up to 64 bytes, values up to 256 (the allocator's).
pub use txflow_core::request::MAX_METADATA_ENTRIES;
/// 2^256 − 1, the largest wei amount.
const U256_MAX: &str =
    "115792089237316195423570985008687907853269984665640564039457584007913129639935";

/// A transaction request (the TxRequest of ARCHITECTURE §2, without `event_id`).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TxBody {
    /// The caller's id of the request, 1 to 64 characters: the same request again (same chain,
    /// signer and `request_id`) is one transaction.
    #[schema(example = "order-42")]
    pub request_id: String,
    /// The chain, which must be the one this deployment serves.
    #[schema(example = 31337)]
    pub chain_id: i64,
    /// The sending address (one of the signer gateway's keys), 0x + 40 hex digits.
    #[schema(example = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266")]
    pub signer: String,
    /// The destination address, 0x + 40 hex digits.
    #[schema(example = "0x000000000000000000000000000000000000dead")]
    pub to: String,
    /// Decimal wei, as a string.
    #[schema(example = "1000")]
    pub value: String,
    /// Calldata as 0x-hex (`0x` when left out), at most 128 KiB.
    #[serde(default)]
    #[schema(example = "0x")]
    pub data: Option<String>,
    /// Left out: estimated by simulation.
    #[serde(default)]
    pub gas_limit: Option<i64>,
    /// Decimal wei; left out: priced from `eth_feeHistory`.
    #[serde(default)]
    pub max_fee_per_gas: Option<String>,
    /// Decimal wei, at most `max_fee_per_gas`.
    #[serde(default)]
    pub max_priority_fee_per_gas: Option<String>,
    /// Free-form strings carried along (at most 32 entries).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// A chained request: the `request_id` that must be CONFIRMED first, of this chain and of
    /// the signer `depends_on_signer` names (this request's own when absent).
    #[serde(default)]
    pub depends_on_request_id: Option<String>,
    /// The signer of the request `depends_on_request_id` names, when it is another signer's.
    #[serde(default)]
    pub depends_on_signer: Option<String>,
}

/// A published tx request.
#[derive(Debug, Serialize, ToSchema)]
pub struct TxAccepted {
    pub request_id: String,
    pub chain_id: i64,
    /// Lowercase.
    pub signer: String,
    /// The published TxRequest's `event_id`.
    pub event_id: String,
}

/// A transaction (`managed_tx`) as the tx endpoints show it. Timestamps are RFC 3339, UTC,
/// milliseconds.
#[derive(Debug, Serialize, ToSchema)]
pub struct TxView {
    pub tx_id: String,
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    /// `REQUEST`, or `NOOP` (a filler for a nonce gap).
    pub kind: String,
    /// Set at allocation.
    pub nonce: Option<i64>,
    /// RECEIVED, SIMULATED, PENDING_APPROVAL, ALLOCATED, SIGNED, SUBMITTED, MINED, CONFIRMED,
    /// REVERTED, REPLACED or FAILED.
    pub state: String,
    pub sub_state: Option<String>,
    pub failure_code: Option<String>,
    pub failure_reason: Option<String>,
    pub to: Option<String>,
    /// Decimal wei.
    pub value: Option<String>,
    /// The mined attempt's hash, or else the latest attempt's; none before signing.
    pub tx_hash: Option<String>,
    /// How many signed attempts (fee bumps included).
    pub attempts: i64,
    pub required_confirmations: i32,
    pub mined_block_number: Option<i64>,
    pub mined_block_hash: Option<String>,
    pub approved_by: Option<String>,
    pub approved_at: Option<String>,
    /// Why the request waits (a dependency, a hold) when it does.
    pub hold_reason: Option<String>,
    pub depends_on_request_id: Option<String>,
    /// The signer of the request it depends on.
    pub depends_on_signer: Option<String>,
    /// Who submitted it through the gateway (its token's `sub`); none for a request produced
    /// to `tx.requests` directly.
    pub submitted_by: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    pub confirmed_at: Option<String>,
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

impl From<TxRow> for TxView {
    fn from(r: TxRow) -> TxView {
        let depends_on_signer = r.depends_on_request_id.as_ref().map(|_| {
            r.depends_on_signer
                .clone()
                .unwrap_or_else(|| r.signer.clone())
        });
        TxView {
            tx_id: r.tx_id.to_string(),
            request_id: r.request_id,
            chain_id: r.chain_id,
            signer: r.signer,
            kind: r.kind,
            nonce: r.nonce,
            state: r.state,
            sub_state: r.sub_state,
            failure_code: r.failure_code,
            failure_reason: r.failure_reason,
            to: r.to_address,
            value: r.value,
            tx_hash: r.tx_hash,
            attempts: r.attempts,
            required_confirmations: r.required_confirmations,
            mined_block_number: r.mined_block_number,
            mined_block_hash: r.mined_block_hash,
            approved_by: r.approved_by,
            approved_at: r.approved_at.map(time),
            hold_reason: r.hold_reason,
            depends_on_signer,
            depends_on_request_id: r.depends_on_request_id,
            submitted_by: r.submitted_by,
            created_at: time(r.created_at),
            updated_at: time(r.updated_at),
            confirmed_at: r.confirmed_at.map(time),
        }
    }
}

/// The query of `GET /api/v1/tx/by-request`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ByRequest {
    /// The request's chain.
    pub chain_id: i64,
    /// The request's signer (any case).
    pub signer: String,
    /// The request's `request_id`.
    pub request_id: String,
}

/// The optional body of approve and cancel.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommandBody {
    /// Why, for the audit trail (`tx_events`).
    #[serde(default)]
    pub reason: Option<String>,
}

/// A published command.
#[derive(Debug, Serialize, ToSchema)]
pub struct CommandAccepted {
    pub tx_id: String,
    /// `APPROVE` or `CANCEL`.
    pub command: String,
    /// The transaction's state when the command was published (the allocator decides whether
    /// the command applies).
    pub state: String,
    /// The published TxCommand's `event_id`.
    pub event_id: String,
}

/// The longest `reason` of a command.
const MAX_REASON: usize = 256;

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::malformed(message)
}

/// A decimal wei amount: digits only, at most 2^256 − 1.
fn check_wei(field: &str, v: &str) -> Result<(), ApiError> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(format!(
            "{field} must be a non-negative decimal integer (wei) as a string"
        )));
    }
    let digits = v.trim_start_matches('0');
    if digits.len() > U256_MAX.len() || (digits.len() == U256_MAX.len() && digits > U256_MAX) {
        return Err(invalid(format!("{field} does not fit 256 bits")));
    }
    Ok(())
}

/// A fee: decimal wei that fits 128 bits (as the allocator reads it).
fn check_fee(field: &str, v: &str) -> Result<u128, ApiError> {
    check_wei(field, v)?;
    v.parse::<u128>()
        .map_err(|_| invalid(format!("{field} is too large")))
}

fn check_request_id(field: &str, v: &str) -> Result<(), ApiError> {
    let n = v.chars().count();
    if n == 0 || n > MAX_REQUEST_ID || v.chars().any(char::is_control) {
        return Err(invalid(format!(
            "{field} must have 1 to {MAX_REQUEST_ID} characters, none a control character"
        )));
    }
    Ok(())
}

/// Checks a tx request for `chain_id` and builds its TxRequest (addresses lowercased, calldata
/// decoded); the same checks as the allocator's, so that a bad request is refused with a reason
/// here rather than failed later. Every refusal is 400 INVALID_REQUEST naming the field.
pub fn validate_tx(b: &TxBody, chain_id: i64, event_id: String) -> Result<TxRequest, ApiError> {
    check_request_id("request_id", &b.request_id)?;
    if let Some(parent) = &b.depends_on_request_id {
        check_request_id("depends_on_request_id", parent)?;
    } else if b.depends_on_signer.is_some() {
        return Err(invalid(
            "depends_on_signer names the signer of depends_on_request_id, which is absent",
        ));
    }
    if b.chain_id != chain_id {
        return Err(invalid(format!(
            "chain_id {} is not served here ({chain_id})",
            b.chain_id
        )));
    }
    let signer = Signer::parse(&b.signer).map_err(|e| invalid(format!("signer: {e}")))?;
    let depends_on_signer = b
        .depends_on_signer
        .as_deref()
        .map(|s| Signer::parse(s).map_err(|e| invalid(format!("depends_on_signer: {e}"))))
        .transpose()?;
    if b.depends_on_request_id.as_deref() == Some(b.request_id.as_str())
        && depends_on_signer.as_ref().is_none_or(|s| *s == signer)
    {
        return Err(invalid("depends_on_request_id is the request itself"));
    }
    let to = Signer::parse(&b.to).map_err(|e| invalid(format!("to: {e}")))?;
    check_wei("value", &b.value)?;
    let data = match b.data.as_deref() {
        None => Vec::new(),
        Some(d) => {
            let hex = d
                .strip_prefix("0x")
                .or_else(|| d.strip_prefix("0X"))
                .ok_or_else(|| invalid("data must be 0x-prefixed hex"))?;
            let bytes = hex::decode(hex).map_err(|_| {
                invalid("data must be 0x-prefixed hex with an even number of digits")
            })?;
            if bytes.len() > MAX_TX_DATA_BYTES {
                return Err(invalid(format!(
                    "data has {} bytes; at most {MAX_TX_DATA_BYTES}",
                    bytes.len()
                )));
            }
            bytes
        }
    };
    if let Some(g) = b.gas_limit
        && !(1..=MAX_GAS_LIMIT).contains(&g)
    {
        return Err(invalid(format!(
            "gas_limit {g} is outside 1..={MAX_GAS_LIMIT}"
        )));
    }
    let max_fee = b
        .max_fee_per_gas
        .as_deref()
        .map(|v| check_fee("max_fee_per_gas", v))
        .transpose()?;
    let tip = b
        .max_priority_fee_per_gas
        .as_deref()
        .map(|v| check_fee("max_priority_fee_per_gas", v))
        .transpose()?;
    if let (Some(max), Some(tip)) = (max_fee, tip)
        && tip > max
    {
        return Err(invalid("max_priority_fee_per_gas is above max_fee_per_gas"));
    }
    if b.metadata.len() > MAX_METADATA_ENTRIES
        || b.metadata
            .iter()
            .any(|(k, v)| k.len() > 64 || v.len() > 256)
    {
        return Err(invalid(
            "metadata: at most 32 entries, keys up to 64 and values up to 256 bytes",
        ));
    }
    Ok(TxRequest {
        event_id,
        request_id: b.request_id.clone(),
        chain_id,
        signer: signer.as_str().to_string(),
        to: to.as_str().to_string(),
        value: b.value.clone(),
        data,
        gas_limit: b.gas_limit,
        max_fee_per_gas: b.max_fee_per_gas.clone(),
        max_priority_fee_per_gas: b.max_priority_fee_per_gas.clone(),
        metadata: b.metadata.clone(),
        depends_on_request_id: b.depends_on_request_id.clone(),
        depends_on_signer: depends_on_signer.map(|s| s.as_str().to_string()),
        submitted_by: None,
    })
}

/// Submits a transaction request to the pipeline.
#[utoipa::path(
    post,
    path = "/api/v1/tx",
    tag = "tx",
    request_body = TxBody,
    security(("bearer" = [])),
    responses(
        (status = 202, description = "Published to tx.requests", body = TxAccepted),
        (status = 400, description = "INVALID_REQUEST", body = ErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: the token lacks tx:submit for the signer", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 503, description = "SYSTEM_ERROR: the broker did not acknowledge; retry (the same request_id is one transaction)", body = ErrorBody),
    )
)]
pub async fn create_tx(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<TxAccepted>), ApiError> {
    let caller = s.0.verifier.caller(&headers)?;
    let b: TxBody = json_body(&headers, body, TX_BODY_LIMIT, "a tx request")?;
    let mut event = validate_tx(&b, s.0.chain_id, uuid::Uuid::new_v4().to_string())?;
    let target = format!("{}/{}/{}", event.chain_id, event.signer, event.request_id);
    if let Err(e) = caller.require_tx(TxAction::Submit, &event.signer) {
        return Err(refuse(&s, &caller, AuditAction::Submit, &target, e).await);
    }
    event.submitted_by = Some(caller.user.clone());
    let key = signer_key(event.chain_id, &event.signer);
    audited(&s, &caller, AuditAction::Submit, &target, async {
        s.0.publisher
            .publish(
                &s.0.topics.tx_requests(),
                &key,
                &event,
                &traceparent_of(&headers),
            )
            .await
    })
    .await?;
    tracing::info!(
        request_id = %event.request_id,
        chain_id = event.chain_id,
        signer = %event.signer,
        event_id = %event.event_id,
        by = %caller.user,
        "gateway: tx request published"
    );
    Ok((
        StatusCode::ACCEPTED,
        Json(TxAccepted {
            request_id: event.request_id,
            chain_id: event.chain_id,
            signer: event.signer,
            event_id: event.event_id,
        }),
    ))
}

/// Records a refusal in the audit log and returns it. A failed audit write does not turn the
/// refusal into anything else (nothing was done); it is logged.
async fn refuse(
    s: &AppState,
    caller: &Caller,
    action: AuditAction,
    target: &str,
    e: ApiError,
) -> ApiError {
    let entry = AuditEntry {
        principal: &caller.user,
        action,
        target,
        outcome: AuditOutcome::Refused,
        code: Some(e.code),
        detail: Some(&e.message),
    };
    if let Err(w) = store::audit(&s.0.pool, &entry).await {
        tracing::error!(error = %w, principal = %caller.user, action = action.as_str(), target, "gateway: a refusal could not be audited");
    }
    e
}

/// Audits an authorized action, then publishes it: nothing is published without its `allowed`
/// row (no row, no publish: 503), and a publish the broker refused adds an `unpublished` row.
async fn audited<F>(
    s: &AppState,
    caller: &Caller,
    action: AuditAction,
    target: &str,
    publish: F,
) -> Result<(), ApiError>
where
    F: std::future::Future<Output = Result<(), crate::publish::PublishError>>,
{
    let mut entry = AuditEntry {
        principal: &caller.user,
        action,
        target,
        outcome: AuditOutcome::Allowed,
        code: None,
        detail: None,
    };
    store::audit(&s.0.pool, &entry).await?;
    if let Err(e) = publish.await {
        let answer = ApiError::publish(e);
        entry.outcome = AuditOutcome::Unpublished;
        entry.code = Some(answer.code);
        if let Err(w) = store::audit(&s.0.pool, &entry).await {
            tracing::error!(error = %w, principal = %caller.user, action = action.as_str(), target, "gateway: an unpublished action could not be audited");
        }
        return Err(answer);
    }
    Ok(())
}

/// A path's `tx_id`: a UUID, or not found.
fn tx_id(raw: &str) -> Result<uuid::Uuid, ApiError> {
    uuid::Uuid::parse_str(raw).map_err(|_| ApiError::tx_not_found())
}

/// A transaction by its id.
#[utoipa::path(
    get,
    path = "/api/v1/tx/{tx_id}",
    tag = "tx",
    params(("tx_id" = String, Path, description = "The transaction's id (a UUID)")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The transaction", body = TxView),
        (status = 401, description = "UNAUTHORIZED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: the token has no tx:read scope at all (a transaction of a signer it may not read is 404)", body = ErrorBody),
        (status = 404, description = "NOT_FOUND", body = ErrorBody),
        (status = 503, description = "SYSTEM_ERROR", body = ErrorBody),
    )
)]
pub async fn get_tx(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(raw): Path<String>,
) -> Result<Json<TxView>, ApiError> {
    let caller = s.0.verifier.caller(&headers)?;
    caller.require_some(TxAction::Read)?;
    let id = tx_id(&raw)?;
    store::tx_by_id(&s.0.pool, id)
        .await?
        // Another signer's transaction is not found, as one that does not exist.
        .filter(|r| caller.scopes.may(TxAction::Read, &r.signer))
        .map(|r| Json(r.into()))
        .ok_or_else(ApiError::tx_not_found)
}

/// The transaction of a request.
#[utoipa::path(
    get,
    path = "/api/v1/tx/by-request",
    tag = "tx",
    params(ByRequest),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The transaction", body = TxView),
        (status = 400, description = "INVALID_REQUEST: a missing or malformed parameter", body = ErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: the token lacks tx:read for the signer named", body = ErrorBody),
        (status = 404, description = "NOT_FOUND (also while the request is not recorded yet)", body = ErrorBody),
        (status = 503, description = "SYSTEM_ERROR", body = ErrorBody),
    )
)]
pub async fn get_tx_by_request(
    State(s): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<ByRequest>, QueryRejection>,
) -> Result<Json<TxView>, ApiError> {
    let caller = s.0.verifier.caller(&headers)?;
    let Query(q) = query.map_err(|e| invalid(format!("the query: {}", e.body_text())))?;
    let signer = Signer::parse(&q.signer).map_err(|e| invalid(format!("signer: {e}")))?;
    check_request_id("request_id", &q.request_id)?;
    // The caller names the signer: refusing it tells nothing of any transaction.
    caller.require_tx(TxAction::Read, signer.as_str())?;
    store::tx_by_request(&s.0.pool, q.chain_id, signer.as_str(), &q.request_id)
        .await?
        .map(|r| Json(r.into()))
        .ok_or_else(ApiError::tx_not_found)
}

/// Approves a transaction awaiting approval (PENDING_APPROVAL). Needs scope
/// `tx:approve:<signer>`; the principal that submitted it may not approve it.
#[utoipa::path(
    post,
    path = "/api/v1/tx/{tx_id}/approve",
    tag = "tx",
    params(("tx_id" = String, Path, description = "The transaction's id (a UUID)")),
    request_body(content = Option<CommandBody>, description = "Optional: the reason"),
    security(("bearer" = [])),
    responses(
        (status = 202, description = "An APPROVE command published to tx.commands", body = CommandAccepted),
        (status = 400, description = "INVALID_REQUEST: a malformed body", body = ErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: no tx:approve scope for the transaction's signer (which the token may read); SELF_APPROVAL: the token's principal submitted it", body = ErrorBody),
        (status = 404, description = "NOT_FOUND (also a transaction of a signer the token may not read)", body = ErrorBody),
        (status = 503, description = "SYSTEM_ERROR", body = ErrorBody),
    )
)]
pub async fn approve_tx(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(raw): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<CommandAccepted>), ApiError> {
    command(s, headers, raw, body, TxCommandKind::Approve).await
}

/// Cancels a transaction not yet signed (the allocator decides). Needs scope
/// `tx:cancel:<signer>`.
#[utoipa::path(
    post,
    path = "/api/v1/tx/{tx_id}/cancel",
    tag = "tx",
    params(("tx_id" = String, Path, description = "The transaction's id (a UUID)")),
    request_body(content = Option<CommandBody>, description = "Optional: the reason"),
    security(("bearer" = [])),
    responses(
        (status = 202, description = "A CANCEL command published to tx.commands", body = CommandAccepted),
        (status = 400, description = "INVALID_REQUEST: a malformed body", body = ErrorBody),
        (status = 401, description = "UNAUTHORIZED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: no tx:cancel scope for the transaction's signer (which the token may read)", body = ErrorBody),
        (status = 404, description = "NOT_FOUND (also a transaction of a signer the token may not read)", body = ErrorBody),
        (status = 503, description = "SYSTEM_ERROR", body = ErrorBody),
    )
)]
pub async fn cancel_tx(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(raw): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<CommandAccepted>), ApiError> {
    command(s, headers, raw, body, TxCommandKind::Cancel).await
}

fn kind_name(kind: TxCommandKind) -> &'static str {
    match kind {
        TxCommandKind::Approve => "APPROVE",
        TxCommandKind::Cancel => "CANCEL",
        TxCommandKind::Bump => "BUMP",
    }
}

async fn command(
    s: AppState,
    headers: HeaderMap,
    raw: String,
    body: Result<Bytes, BytesRejection>,
    kind: TxCommandKind,
) -> Result<(StatusCode, Json<CommandAccepted>), ApiError> {
    let caller = s.0.verifier.caller(&headers)?;
    let (action, audit) = match kind {
        TxCommandKind::Approve => (TxAction::Approve, AuditAction::Approve),
        TxCommandKind::Cancel | TxCommandKind::Bump => (TxAction::Cancel, AuditAction::Cancel),
    };
    if let Err(e) = caller.require_some(action) {
        return Err(refuse(&s, &caller, audit, &raw, e).await);
    }
    let id = tx_id(&raw)?;
    let empty = body.as_ref().is_ok_and(|b| b.is_empty());
    let b: CommandBody = if empty {
        CommandBody::default()
    } else {
        json_body(&headers, body, s.0.body_limit, "a command body")?
    };
    if b.reason.as_ref().is_some_and(|r| r.len() > MAX_REASON) {
        return Err(invalid(format!("reason: at most {MAX_REASON} bytes")));
    }
    let target = id.to_string();
    let row = match store::tx_by_id(&s.0.pool, id).await? {
        Some(row) if caller.scopes.may(action, &row.signer) => row,
        // A transaction the caller may see but not act on: 403; one it may not see: 404.
        Some(row) if caller.scopes.may(TxAction::Read, &row.signer) => {
            let e = crate::auth::lacks(action, &row.signer);
            return Err(refuse(&s, &caller, audit, &target, e).await);
        }
        _ => {
            return Err(refuse(&s, &caller, audit, &target, ApiError::tx_not_found()).await);
        }
    };
    if kind == TxCommandKind::Approve && row.submitted_by.as_deref() == Some(caller.user.as_str()) {
        return Err(refuse(&s, &caller, audit, &target, ApiError::self_approval()).await);
    }
    let c = TxCommand {
        event_id: uuid::Uuid::new_v4().to_string(),
        tx_id: row.tx_id.to_string(),
        chain_id: row.chain_id,
        signer: row.signer.clone(),
        command: kind,
        requested_by: caller.user.clone(),
        reason: b.reason,
    };
    audited(&s, &caller, audit, &target, async {
        s.0.publisher
            .publish(
                &s.0.topics.tx_commands(),
                &signer_key(c.chain_id, &c.signer),
                &c,
                &traceparent_of(&headers),
            )
            .await
    })
    .await?;
    tracing::info!(
        tx_id = %c.tx_id,
        command = kind_name(kind),
        by = %caller.user,
        state = %row.state,
        event_id = %c.event_id,
        "gateway: tx command published"
    );
    Ok((
        StatusCode::ACCEPTED,
        Json(CommandAccepted {
            tx_id: c.tx_id,
            command: kind_name(kind).to_string(),
            state: row.state,
            event_id: c.event_id,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const SIGNER: &str = "0xF39Fd6e51aad88F6F4ce6aB8827279cffFb92266";
    const TO: &str = "0x000000000000000000000000000000000000dEaD";

    fn body(patch: serde_json::Value) -> TxBody {
        let mut v = json!({
            "request_id": "r-1", "chain_id": 31337, "signer": SIGNER, "to": TO,
            "value": "1000", "data": "0xabCD",
        });
        for (k, x) in patch.as_object().expect("an object") {
            v[k] = x.clone();
        }
        serde_json::from_value(v).expect("a tx body")
    }

    #[test]
    fn a_valid_request_is_normalised() {
        let r = validate_tx(
            &body(json!({"max_fee_per_gas": "20", "max_priority_fee_per_gas": "2"})),
            31337,
            "e".into(),
        )
        .expect("valid");
        assert_eq!(r.signer, SIGNER.to_ascii_lowercase());
        assert_eq!(r.to, TO.to_ascii_lowercase());
        assert_eq!(r.data, vec![0xab, 0xcd]);
        assert_eq!(r.value, "1000");
        let bare: TxBody = serde_json::from_value(json!({
            "request_id": "r", "chain_id": 1, "signer": SIGNER, "to": TO, "value": "0"
        }))
        .expect("a tx body");
        assert_eq!(
            validate_tx(&bare, 1, "e".into()).expect("valid").data,
            Vec::<u8>::new()
        );
        let max = validate_tx(&body(json!({"value": U256_MAX})), 31337, "e".into());
        assert!(max.is_ok(), "{max:?}");
    }

    #[test]
    fn invalid_requests_name_their_field() {
        let too_big = format!("{U256_MAX}0");
        let over = "115792089237316195423570985008687907853269984665640564039457584007913129639936";
        for (what, patch, expected) in [
            ("empty request_id", json!({"request_id": ""}), "request_id"),
            (
                "long request_id",
                json!({"request_id": "x".repeat(65)}),
                "request_id",
            ),
            ("another chain", json!({"chain_id": 1}), "chain_id"),
            ("bad signer", json!({"signer": "0x12"}), "signer"),
            ("bad to", json!({"to": "dead"}), "to"),
            ("negative value", json!({"value": "-1"}), "value"),
            ("float value", json!({"value": "1.5"}), "value"),
            ("empty value", json!({"value": ""}), "value"),
            ("79 digits", json!({"value": too_big}), "value"),
            ("2^256", json!({"value": over}), "value"),
            ("no 0x", json!({"data": "abcd"}), "data"),
            ("odd hex", json!({"data": "0xabc"}), "data"),
            ("not hex", json!({"data": "0xzz"}), "data"),
            ("zero gas", json!({"gas_limit": 0}), "gas_limit"),
            ("huge gas", json!({"gas_limit": 30_000_001}), "gas_limit"),
            (
                "fee over 128 bits",
                json!({"max_fee_per_gas": "340282366920938463463374607431768211456"}),
                "max_fee_per_gas",
            ),
            (
                "tip above max",
                json!({"max_fee_per_gas": "1", "max_priority_fee_per_gas": "2"}),
                "max_priority_fee_per_gas",
            ),
            (
                "self dependency",
                json!({"depends_on_request_id": "r-1"}),
                "depends_on_request_id",
            ),
            (
                "self dependency, its own signer named",
                json!({"depends_on_request_id": "r-1", "depends_on_signer": SIGNER}),
                "depends_on_request_id",
            ),
            (
                "a parent's signer without a parent",
                json!({"depends_on_signer": SIGNER}),
                "depends_on_signer",
            ),
            (
                "a bad parent's signer",
                json!({"depends_on_request_id": "r-0", "depends_on_signer": "0x12"}),
                "depends_on_signer",
            ),
            (
                "big metadata",
                json!({"metadata": {"k": "v".repeat(257)}}),
                "metadata",
            ),
        ] {
            let e = validate_tx(&body(patch), 31337, "e".into()).expect_err(what);
            assert_eq!(
                (e.status.as_u16(), e.code),
                (400, "INVALID_REQUEST"),
                "{what}"
            );
            assert!(e.message.contains(expected), "{what}: {}", e.message);
        }
    }

    #[test]
    fn command_kinds_have_their_schema_names() {
        for kind in [
            TxCommandKind::Approve,
            TxCommandKind::Cancel,
            TxCommandKind::Bump,
        ] {
            assert_eq!(
                serde_json::to_value(kind).expect("serialises"),
                json!(kind_name(kind))
            );
        }
    }
}
