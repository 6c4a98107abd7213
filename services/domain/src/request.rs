//! The upstream contract of a [`TxRequest`], checked without I/O: the allocator dead-letters a
//! request that fails it (the code is the dead letter's `error.code`), and txflow-client refuses
//! to publish one, so that a caller learns of a bad address before the broker does.

use alloy_primitives::{Address, Bytes, U256};

use crate::events::TxRequest;
use crate::ids::{ChainId, Signer};

pub const MAX_DATA_BYTES: usize = 128 * 1024;
pub const MAX_GAS_LIMIT: i64 = 30_000_000;
pub const MAX_METADATA_ENTRIES: usize = 32;

/// Why a request breaks the contract: a stable code (`INVALID_TO`, `WRONG_CHAIN`, ...) and a
/// sentence. Permanent: the same request fails the same way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Invalid {
    pub code: String,
    pub message: String,
}

impl Invalid {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Invalid {
        Invalid {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// A request that passed validation, with typed values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidRequest {
    pub chain_id: ChainId,
    pub signer: Signer,
    pub to: Address,
    pub value: U256,
    pub data: Bytes,
    pub gas_limit: Option<u64>,
    pub max_fee_per_gas: Option<u128>,
    pub max_priority_fee_per_gas: Option<u128>,
    /// The request that must be CONFIRMED first (a chained task), never the request itself.
    pub depends_on_request_id: Option<String>,
    /// The signer of that request (the request's own when the message names none): the parent
    /// is `(chain_id, depends_on_signer, depends_on_request_id)`. `Some` exactly when
    /// `depends_on_request_id` is.
    pub depends_on_signer: Option<Signer>,
    /// Who submitted it (the gateway's principal), if it came through the gateway.
    pub submitted_by: Option<String>,
}

/// The longest `submitted_by` accepted.
pub const MAX_SUBMITTED_BY: usize = 128;

fn decimal_u256(field: &str, v: &str) -> Result<U256, Invalid> {
    let bad = |why: &str| {
        Invalid::new(
            format!("INVALID_{}", field.to_ascii_uppercase()),
            format!("{field} {v:?}: {why}"),
        )
    };
    if v.is_empty() || v.len() > 78 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("expected a non-negative decimal integer (wei)"));
    }
    U256::from_str_radix(v, 10).map_err(|_| bad("does not fit 256 bits"))
}

fn decimal_u128(field: &str, v: &str) -> Result<u128, Invalid> {
    let n = decimal_u256(field, v)?;
    u128::try_from(n).map_err(|_| {
        Invalid::new(
            format!("INVALID_{}", field.to_ascii_uppercase()),
            format!("{field} {v:?} is too large"),
        )
    })
}

/// Checks a request for `expected_chain`.
pub fn validate(r: &TxRequest, expected_chain: ChainId) -> Result<ValidRequest, Invalid> {
    if r.request_id.is_empty() || r.request_id.chars().count() > 64 {
        return Err(Invalid::new(
            "INVALID_REQUEST_ID",
            "request_id must have 1 to 64 characters",
        ));
    }
    if let Some(parent) = &r.depends_on_request_id {
        if parent.is_empty() || parent.chars().count() > 64 {
            return Err(Invalid::new(
                "INVALID_DEPENDS_ON_REQUEST_ID",
                "depends_on_request_id must have 1 to 64 characters",
            ));
        }
    } else if r.depends_on_signer.is_some() {
        return Err(Invalid::new(
            "INVALID_DEPENDS_ON_SIGNER",
            "depends_on_signer names the signer of depends_on_request_id, which is absent",
        ));
    }
    if r.submitted_by
        .as_ref()
        .is_some_and(|p| p.is_empty() || p.chars().count() > MAX_SUBMITTED_BY)
    {
        return Err(Invalid::new(
            "INVALID_SUBMITTED_BY",
            format!("submitted_by must have 1 to {MAX_SUBMITTED_BY} characters"),
        ));
    }
    if r.chain_id != expected_chain.0 {
        return Err(Invalid::new(
            "WRONG_CHAIN",
            format!(
                "chain_id {} is not served here ({})",
                r.chain_id, expected_chain
            ),
        ));
    }
    let signer =
        Signer::parse(&r.signer).map_err(|e| Invalid::new("INVALID_SIGNER", e.to_string()))?;
    let depends_on_signer = match (&r.depends_on_request_id, &r.depends_on_signer) {
        (None, _) => None,
        (Some(_), None) => Some(signer.clone()),
        (Some(_), Some(s)) => Some(
            Signer::parse(s)
                .map_err(|e| Invalid::new("INVALID_DEPENDS_ON_SIGNER", e.to_string()))?,
        ),
    };
    // It would wait for itself forever.
    if r.depends_on_request_id.as_deref() == Some(r.request_id.as_str())
        && depends_on_signer.as_ref() == Some(&signer)
    {
        return Err(Invalid::new(
            "SELF_DEPENDENCY",
            format!("request {:?} depends on itself", r.request_id),
        ));
    }
    let to = Signer::parse(&r.to).map_err(|e| Invalid::new("INVALID_TO", e.to_string()))?;
    let to: Address = to
        .as_str()
        .parse()
        .map_err(|_| Invalid::new("INVALID_TO", "not an address"))?;
    let value = decimal_u256("value", &r.value)?;
    if r.data.len() > MAX_DATA_BYTES {
        return Err(Invalid::new(
            "DATA_TOO_LARGE",
            format!("{} bytes of data; at most {MAX_DATA_BYTES}", r.data.len()),
        ));
    }
    let gas_limit = match r.gas_limit {
        None => None,
        Some(g) if g > 0 && g <= MAX_GAS_LIMIT => u64::try_from(g).ok(),
        Some(g) => {
            return Err(Invalid::new(
                "INVALID_GAS_LIMIT",
                format!("gas_limit {g} is outside 1..={MAX_GAS_LIMIT}"),
            ));
        }
    };
    let max_fee_per_gas = r
        .max_fee_per_gas
        .as_deref()
        .map(|v| decimal_u128("max_fee_per_gas", v))
        .transpose()?;
    let max_priority_fee_per_gas = r
        .max_priority_fee_per_gas
        .as_deref()
        .map(|v| decimal_u128("max_priority_fee_per_gas", v))
        .transpose()?;
    if let (Some(max), Some(tip)) = (max_fee_per_gas, max_priority_fee_per_gas)
        && tip > max
    {
        return Err(Invalid::new(
            "INVALID_FEE",
            "max_priority_fee_per_gas is above max_fee_per_gas",
        ));
    }
    if r.metadata.len() > MAX_METADATA_ENTRIES
        || r.metadata
            .iter()
            .any(|(k, v)| k.len() > 64 || v.len() > 256)
    {
        return Err(Invalid::new(
            "METADATA_TOO_LARGE",
            "at most 32 entries, keys up to 64 and values up to 256 bytes",
        ));
    }
    Ok(ValidRequest {
        chain_id: expected_chain,
        signer,
        to,
        value,
        data: Bytes::from(r.data.clone()),
        gas_limit,
        max_fee_per_gas,
        max_priority_fee_per_gas,
        depends_on_request_id: r.depends_on_request_id.clone(),
        depends_on_signer,
        submitted_by: r.submitted_by.clone(),
    })
}
