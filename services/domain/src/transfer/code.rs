//! The error codes of an internal transfer (seed 004 §1.5 and §8.1): one typed enum with stable
//! string codes, which the gateway answers as `{code, message}` and the adapters record.

use std::fmt;

/// Why a transfer, or one adapter operation of it, is refused. The string of each code
/// ([`TransferCode::as_str`]) is part of the API and of the stored records: never rename one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TransferCode {
    // §1.5.1 identity and authorisation.
    Unauthorized,
    Forbidden,
    // §1.5.2 account types.
    SameAccount,
    InvalidAccountType,
    UnsupportedAccountType,
    // §1.5.3 amounts.
    InvalidAmount,
    PrecisionOverflow,
    AmountTooSmall,
    AmountTooLarge,
    Overflow,
    // §1.5.4 assets.
    InvalidAsset,
    AssetSuspended,
    TransferNotAllowed,
    // §1.5.5 accounts.
    SourceAccountNotFound,
    TargetAccountNotFound,
    AccountFrozen,
    AccountDisabled,
    InsufficientBalance,
    // §1.5.6 rate limits.
    RateLimitExceeded,
    DailyLimitExceeded,
    DailyAmountExceeded,
    // §1.5.7 idempotency: a `cid`, or an adapter key `(req_id, op)`, seen with other parameters.
    DuplicateRequest,
    // Not in the seed: a malformed identifier (request id, user id), which no check of §1.5 covers.
    InvalidRequest,
    // Not in the seed: the FUNDING adapter's refund preconditions (§5.2; the refund of a
    // transfer is its own WITHDRAW undone, so it needs that WITHDRAW and its amount).
    RefundWithoutWithdraw,
    RefundAmountMismatch,
    // §8.1 an internal failure; advise retry.
    SystemError,
}

impl TransferCode {
    pub const ALL: [TransferCode; 26] = [
        TransferCode::Unauthorized,
        TransferCode::Forbidden,
        TransferCode::SameAccount,
        TransferCode::InvalidAccountType,
        TransferCode::UnsupportedAccountType,
        TransferCode::InvalidAmount,
        TransferCode::PrecisionOverflow,
        TransferCode::AmountTooSmall,
        TransferCode::AmountTooLarge,
        TransferCode::Overflow,
        TransferCode::InvalidAsset,
        TransferCode::AssetSuspended,
        TransferCode::TransferNotAllowed,
        TransferCode::SourceAccountNotFound,
        TransferCode::TargetAccountNotFound,
        TransferCode::AccountFrozen,
        TransferCode::AccountDisabled,
        TransferCode::InsufficientBalance,
        TransferCode::RateLimitExceeded,
        TransferCode::DailyLimitExceeded,
        TransferCode::DailyAmountExceeded,
        TransferCode::DuplicateRequest,
        TransferCode::InvalidRequest,
        TransferCode::RefundWithoutWithdraw,
        TransferCode::RefundAmountMismatch,
        TransferCode::SystemError,
    ];

    /// The stable code.
    pub const fn as_str(self) -> &'static str {
        match self {
            TransferCode::Unauthorized => "UNAUTHORIZED",
            TransferCode::Forbidden => "FORBIDDEN",
            TransferCode::SameAccount => "SAME_ACCOUNT",
            TransferCode::InvalidAccountType => "INVALID_ACCOUNT_TYPE",
            TransferCode::UnsupportedAccountType => "UNSUPPORTED_ACCOUNT_TYPE",
            TransferCode::InvalidAmount => "INVALID_AMOUNT",
            TransferCode::PrecisionOverflow => "PRECISION_OVERFLOW",
            TransferCode::AmountTooSmall => "AMOUNT_TOO_SMALL",
            TransferCode::AmountTooLarge => "AMOUNT_TOO_LARGE",
            TransferCode::Overflow => "OVERFLOW",
            TransferCode::InvalidAsset => "INVALID_ASSET",
            TransferCode::AssetSuspended => "ASSET_SUSPENDED",
            TransferCode::TransferNotAllowed => "TRANSFER_NOT_ALLOWED",
            TransferCode::SourceAccountNotFound => "SOURCE_ACCOUNT_NOT_FOUND",
            TransferCode::TargetAccountNotFound => "TARGET_ACCOUNT_NOT_FOUND",
            TransferCode::AccountFrozen => "ACCOUNT_FROZEN",
            TransferCode::AccountDisabled => "ACCOUNT_DISABLED",
            TransferCode::InsufficientBalance => "INSUFFICIENT_BALANCE",
            TransferCode::RateLimitExceeded => "RATE_LIMIT_EXCEEDED",
            TransferCode::DailyLimitExceeded => "DAILY_LIMIT_EXCEEDED",
            TransferCode::DailyAmountExceeded => "DAILY_AMOUNT_EXCEEDED",
            TransferCode::DuplicateRequest => "DUPLICATE_REQUEST",
            TransferCode::InvalidRequest => "INVALID_REQUEST",
            TransferCode::RefundWithoutWithdraw => "REFUND_WITHOUT_WITHDRAW",
            TransferCode::RefundAmountMismatch => "REFUND_AMOUNT_MISMATCH",
            TransferCode::SystemError => "SYSTEM_ERROR",
        }
    }

    /// The code of a stored string (`None` for a string no code has).
    pub fn parse(s: &str) -> Option<TransferCode> {
        TransferCode::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for TransferCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refusal: its code and a short, bounded explanation (never the raw input at length).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {detail}")]
pub struct Rejected {
    pub code: TransferCode,
    pub detail: String,
}

impl Rejected {
    pub fn new(code: TransferCode, detail: impl Into<String>) -> Rejected {
        Rejected {
            code,
            detail: detail.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_parse_back() {
        let mut seen = std::collections::HashSet::new();
        for c in TransferCode::ALL {
            assert!(seen.insert(c.as_str()), "{c} appears twice");
            assert_eq!(TransferCode::parse(c.as_str()), Some(c));
            assert!(
                c.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b == b'_')
            );
        }
        assert_eq!(TransferCode::parse("insufficient_balance"), None);
    }
}
