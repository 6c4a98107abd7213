//! The API's errors: `{code, message}` with the seed's codes (seed 004 §1.5, §8.1) and an HTTP
//! status that fits. A message is short and never repeats a token or a body at length.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use txflow_core::transfer::{Rejected, TransferCode};

use crate::store::StoreError;

/// `NOT_FOUND` is the gateway's own code (the seed has none for a read): an unknown `req_id`, or
/// another user's, which is never told apart.
pub const NOT_FOUND: &str = "NOT_FOUND";

/// Transfers are halted (a conservation violation is open, seed 004 MON-003): the gateway's own
/// code, with 503.
pub const SERVICE_HALTED: &str = "SERVICE_HALTED";

/// An approval by the principal that submitted the transaction (four eyes): the gateway's own
/// code, with 403.
pub const SELF_APPROVAL: &str = "SELF_APPROVAL";

/// The longest message sent.
const MAX_MESSAGE: usize = 200;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

/// Every error's body.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// The seed's code (seed 004 §1.5, §8.1: `UNAUTHORIZED`, `FORBIDDEN`, `INVALID_REQUEST`,
    /// `INVALID_AMOUNT`, `RATE_LIMIT_EXCEEDED`, `DUPLICATE_REQUEST`, `SYSTEM_ERROR`, …) or the
    /// gateway's own (`NOT_FOUND`, `SERVICE_HALTED`, `SELF_APPROVAL`).
    #[schema(example = "INVALID_REQUEST")]
    pub code: String,
    /// A short human-readable explanation.
    pub message: String,
}

/// The status of a refusal with `code`.
pub fn status_of(code: TransferCode) -> StatusCode {
    match code {
        TransferCode::Unauthorized => StatusCode::UNAUTHORIZED,
        TransferCode::Forbidden => StatusCode::FORBIDDEN,
        TransferCode::RateLimitExceeded
        | TransferCode::DailyLimitExceeded
        | TransferCode::DailyAmountExceeded => StatusCode::TOO_MANY_REQUESTS,
        TransferCode::DuplicateRequest => StatusCode::CONFLICT,
        TransferCode::SystemError => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    }
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        let mut message: String = message.into();
        if message.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push('…');
        }
        ApiError {
            status,
            code,
            message,
        }
    }

    /// A refusal of the domain's checks, with its code.
    pub fn rejected(r: Rejected) -> ApiError {
        ApiError::new(status_of(r.code), r.code.as_str(), r.detail)
    }

    fn code(code: TransferCode, message: impl Into<String>) -> ApiError {
        ApiError::new(status_of(code), code.as_str(), message)
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::code(TransferCode::Unauthorized, message)
    }

    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::code(TransferCode::Forbidden, message)
    }

    pub fn rate_limited() -> ApiError {
        ApiError::code(
            TransferCode::RateLimitExceeded,
            "too many transfer requests; retry later",
        )
    }

    /// The user created `daily_count` transfers today (UTC): 429 DAILY_LIMIT_EXCEEDED.
    pub fn daily_count(daily_count: u32) -> ApiError {
        ApiError::code(
            TransferCode::DailyLimitExceeded,
            format!("at most {daily_count} transfers per day (UTC); retry tomorrow"),
        )
    }

    /// Today's transfers of the asset plus this one exceed its `daily_limit`: 429
    /// DAILY_AMOUNT_EXCEEDED.
    pub fn daily_amount(asset: &str, daily_limit: &str) -> ApiError {
        ApiError::code(
            TransferCode::DailyAmountExceeded,
            format!("at most {daily_limit} {asset} per day (UTC) in total"),
        )
    }

    pub fn duplicate(message: impl Into<String>) -> ApiError {
        ApiError::code(TransferCode::DuplicateRequest, message)
    }

    /// An internal failure: 503 SYSTEM_ERROR, advise a retry (§8.1).
    pub fn system(message: impl Into<String>) -> ApiError {
        ApiError::code(TransferCode::SystemError, message)
    }

    /// A malformed request (not JSON, not a transfer request): 400 INVALID_REQUEST.
    pub fn malformed(message: impl Into<String>) -> ApiError {
        ApiError::code(TransferCode::InvalidRequest, message)
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            TransferCode::InvalidRequest.as_str(),
            format!("the body is larger than {limit} bytes"),
        )
    }

    pub fn unsupported_media_type() -> ApiError {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            TransferCode::InvalidRequest.as_str(),
            "the body must be JSON (Content-Type: application/json)",
        )
    }

    pub fn not_found() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, NOT_FOUND, "no such transfer")
    }

    /// The approver submitted the transaction: 403 SELF_APPROVAL.
    pub fn self_approval() -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            SELF_APPROVAL,
            "the submitter of a transaction may not approve it: another principal must",
        )
    }

    pub fn tx_not_found() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, NOT_FOUND, "no such transaction")
    }

    /// Transfers are halted: 503 SERVICE_HALTED, nothing recorded.
    pub fn halted() -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            SERVICE_HALTED,
            "transfers are halted: a fund conservation check failed and awaits an operator",
        )
    }

    /// A message the caller asked for could not be published (nothing else was done): logged
    /// with its cause here, answered as SYSTEM_ERROR.
    pub fn publish(e: crate::publish::PublishError) -> ApiError {
        tracing::warn!(error = %e, source = ?std::error::Error::source(&e).map(|s| s.to_string()), "gateway: publishing failed");
        ApiError::system("the broker is unavailable; retry the request")
    }

    /// The database failed: logged with its cause here, answered as SYSTEM_ERROR.
    pub fn store(e: StoreError) -> ApiError {
        tracing::error!(error = %e, source = ?std::error::Error::source(&e).map(|s| s.to_string()), "gateway: the database failed");
        ApiError::system("the transfer store is unavailable; retry the request (with the same cid)")
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        ApiError::store(e)
    }
}

/// The code of an error answer, in the response's extensions: the metrics middleware counts it
/// (`gateway_rejections_total{code}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(ErrorBody {
                code: self.code.to_string(),
                message: self.message,
            }),
        )
            .into_response();
        response.extensions_mut().insert(ErrorCode(self.code));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_fitting_statuses() {
        for (code, status) in [
            (TransferCode::Unauthorized, 401),
            (TransferCode::Forbidden, 403),
            (TransferCode::InvalidAmount, 400),
            (TransferCode::SameAccount, 400),
            (TransferCode::RateLimitExceeded, 429),
            (TransferCode::DailyLimitExceeded, 429),
            (TransferCode::DailyAmountExceeded, 429),
            (TransferCode::DuplicateRequest, 409),
            (TransferCode::SystemError, 503),
        ] {
            assert_eq!(status_of(code).as_u16(), status, "{code}");
        }
    }

    #[test]
    fn long_messages_are_cut() {
        let e = ApiError::malformed("é".repeat(500));
        assert!(e.message.len() <= MAX_MESSAGE + '…'.len_utf8());
    }
}
