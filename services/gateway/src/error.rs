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

/// The longest message sent.
const MAX_MESSAGE: usize = 200;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

#[derive(Serialize)]
struct Body<'a> {
    code: &'a str,
    message: &'a str,
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(Body {
                code: self.code,
                message: &self.message,
            }),
        )
            .into_response()
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
