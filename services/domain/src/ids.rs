//! Newtypes for the identities every service passes around (CONVENTIONS 6).

use std::fmt;

use crate::retry::{Classify, Retry};

/// An EVM chain id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChainId(pub i64);

impl fmt::Display for ChainId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A signer's address, validated (`0x` + 40 hex digits) and normalised to lowercase, the form
/// used in keys, leases and tables.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Signer(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not an address: expected 0x followed by 40 hex digits")]
pub struct InvalidAddress {
    pub value: String,
}

impl Classify for InvalidAddress {
    fn retry(&self) -> Retry {
        Retry::Permanent
    }
}

impl Signer {
    pub fn parse(value: &str) -> Result<Signer, InvalidAddress> {
        let hex = value
            .strip_prefix("0x")
            .or_else(|| value.strip_prefix("0X"));
        match hex {
            Some(h) if h.len() == 40 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
                Ok(Signer(format!("0x{}", h.to_ascii_lowercase())))
            }
            _ => Err(InvalidAddress {
                value: value.chars().take(100).collect(),
            }),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A fencing token: increases every time a lease is taken, never on a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FencingToken(pub i64);

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The identity of one process start. A restarted process is a new owner, so it cannot mistake
/// a lease of its previous life for its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(String);

impl NodeId {
    /// `{host}/{pid}/{random}`: readable in `signer_lease.owner_node`, unique per process start.
    pub fn generate() -> NodeId {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "host".to_string());
        let id = uuid::Uuid::new_v4().simple().to_string();
        NodeId(format!("{host}/{}/{}", std::process::id(), &id[..12]))
    }

    /// `{name}/{pid}/{random}`: a chosen readable name, still unique per process start.
    pub fn generate_named(name: &str) -> NodeId {
        let id = uuid::Uuid::new_v4().simple().to_string();
        NodeId(format!("{name}/{}/{}", std::process::id(), &id[..12]))
    }

    /// A node id with a given name (tests, tools).
    pub fn named(name: impl Into<String>) -> NodeId {
        NodeId(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What `managed_tx.payload` holds: the transaction as the allocator recorded it, completed with
/// the gas limit (after simulation) and fees (at allocation). The signer gateway signs this, never
/// what an event claims.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct TxPayload {
    /// Lowercase 0x-hex address.
    pub to: String,
    /// Decimal wei.
    pub value: String,
    /// 0x-hex calldata.
    pub data: String,
    pub gas_limit: Option<u64>,
    /// Decimal wei.
    pub max_fee_per_gas: Option<String>,
    /// Decimal wei.
    pub max_priority_fee_per_gas: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_validated_and_lowercased() {
        let s = Signer::parse("0xF39Fd6e51aad88F6F4ce6aB8827279cffFb92266").expect("valid");
        assert_eq!(s.as_str(), "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266");
        for bad in [
            "",
            "0x",
            "f39fd6e51aad88f6f4ce6ab8827279cfffb92266",
            "0xzz9fd6e51aad88f6f4ce6ab8827279cfffb92266",
            "0xf39fd6e51aad88f6f4ce6ab8827279cfffb9226",
        ] {
            assert!(Signer::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn node_ids_differ_per_start() {
        assert_ne!(NodeId::generate(), NodeId::generate());
    }
}
