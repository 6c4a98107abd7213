//! Validation of the TxRequest contract (ARCHITECTURE §2). Pure: every refusal is a
//! [`Rejection`] with a stable code, and the message goes to the dead-letter topic.

use alloy::primitives::{Address, Bytes, U256};
use txflow_core::domain::{ChainId, Signer};
use txflow_core::events::TxRequest;
use txflow_core::stage::Rejection;

pub const MAX_DATA_BYTES: usize = 128 * 1024;
pub const MAX_GAS_LIMIT: i64 = 30_000_000;
pub const MAX_METADATA_ENTRIES: usize = 32;

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
}

fn decimal_u256(field: &str, v: &str) -> Result<U256, Rejection> {
    let bad = |why: &str| {
        Rejection::new(
            format!("INVALID_{}", field.to_ascii_uppercase()),
            format!("{field} {v:?}: {why}"),
        )
    };
    if v.is_empty() || v.len() > 78 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("expected a non-negative decimal integer (wei)"));
    }
    U256::from_str_radix(v, 10).map_err(|_| bad("does not fit 256 bits"))
}

fn decimal_u128(field: &str, v: &str) -> Result<u128, Rejection> {
    let n = decimal_u256(field, v)?;
    u128::try_from(n).map_err(|_| {
        Rejection::new(
            format!("INVALID_{}", field.to_ascii_uppercase()),
            format!("{field} {v:?} is too large"),
        )
    })
}

/// Checks a request for `expected_chain`.
pub fn validate(r: &TxRequest, expected_chain: ChainId) -> Result<ValidRequest, Rejection> {
    if r.request_id.is_empty() || r.request_id.chars().count() > 64 {
        return Err(Rejection::new(
            "INVALID_REQUEST_ID",
            "request_id must have 1 to 64 characters",
        ));
    }
    if r.chain_id != expected_chain.0 {
        return Err(Rejection::new(
            "WRONG_CHAIN",
            format!(
                "chain_id {} is not served here ({})",
                r.chain_id, expected_chain
            ),
        ));
    }
    let signer =
        Signer::parse(&r.signer).map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))?;
    let to = Signer::parse(&r.to).map_err(|e| Rejection::new("INVALID_TO", e.to_string()))?;
    let to: Address = to
        .as_str()
        .parse()
        .map_err(|_| Rejection::new("INVALID_TO", "not an address"))?;
    let value = decimal_u256("value", &r.value)?;
    if r.data.len() > MAX_DATA_BYTES {
        return Err(Rejection::new(
            "DATA_TOO_LARGE",
            format!("{} bytes of data; at most {MAX_DATA_BYTES}", r.data.len()),
        ));
    }
    let gas_limit = match r.gas_limit {
        None => None,
        Some(g) if g > 0 && g <= MAX_GAS_LIMIT => Some(g as u64),
        Some(g) => {
            return Err(Rejection::new(
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
        return Err(Rejection::new(
            "INVALID_FEE",
            "max_priority_fee_per_gas is above max_fee_per_gas",
        ));
    }
    if r.metadata.len() > MAX_METADATA_ENTRIES
        || r.metadata
            .iter()
            .any(|(k, v)| k.len() > 64 || v.len() > 256)
    {
        return Err(Rejection::new(
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> TxRequest {
        TxRequest {
            event_id: "e".into(),
            request_id: "r1".into(),
            chain_id: 31337,
            signer: "0xF39Fd6e51aad88F6F4ce6aB8827279cffFb92266".into(),
            to: "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into(),
            value: "1000".into(),
            data: vec![1, 2],
            gas_limit: None,
            max_fee_per_gas: None,
            max_priority_fee_per_gas: None,
            metadata: Default::default(),
        }
    }

    fn code(r: TxRequest) -> String {
        validate(&r, ChainId(31337)).expect_err("invalid").code
    }

    #[test]
    fn a_valid_request_is_typed_and_normalised() {
        let v = validate(&ok(), ChainId(31337)).expect("valid");
        assert_eq!(
            v.signer.as_str(),
            "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266"
        );
        assert_eq!(v.value, U256::from(1000));
    }

    #[test]
    fn each_invalid_field_has_its_code() {
        type Mutation = fn(&mut TxRequest);
        let cases: Vec<(Mutation, &str)> = vec![
            (|r| r.request_id = String::new(), "INVALID_REQUEST_ID"),
            (|r| r.request_id = "x".repeat(65), "INVALID_REQUEST_ID"),
            (|r| r.chain_id = 1, "WRONG_CHAIN"),
            (|r| r.signer = "0x123".into(), "INVALID_SIGNER"),
            (|r| r.to = "not an address".into(), "INVALID_TO"),
            (|r| r.value = "-1".into(), "INVALID_VALUE"),
            (|r| r.value = "1.5".into(), "INVALID_VALUE"),
            (|r| r.value = "ten".into(), "INVALID_VALUE"),
            (|r| r.value = "9".repeat(79), "INVALID_VALUE"),
            (|r| r.data = vec![0; MAX_DATA_BYTES + 1], "DATA_TOO_LARGE"),
            (|r| r.gas_limit = Some(0), "INVALID_GAS_LIMIT"),
            (
                |r| r.max_fee_per_gas = Some("-5".into()),
                "INVALID_MAX_FEE_PER_GAS",
            ),
            (
                |r| {
                    r.max_fee_per_gas = Some("1".into());
                    r.max_priority_fee_per_gas = Some("2".into());
                },
                "INVALID_FEE",
            ),
        ];
        for (mutate, want) in cases {
            let mut r = ok();
            mutate(&mut r);
            assert_eq!(code(r), want);
        }
    }
}
