//! Internal transfers between the FUNDING ledger (PostgreSQL) and the SPOT ledger (seed 004),
//! pure: the state machine and its reversibility rule ([`fsm`]), the checks of §1.5
//! ([`validate`]) and their error codes ([`code`]). The gateway, the coordinator and the adapters
//! all use these, so a check is written once and run at every layer.

pub mod code;
pub mod fsm;
pub mod validate;

pub use code::{Rejected, TransferCode};
pub use fsm::{
    AdapterResponse, FundsLocation, IllegalTransfer, Next, Stay, TransferState, Transition,
    UnknownTransferState, decide,
};
pub use validate::{
    AccountType, Amount, AssetRule, AssetStatus, AssetTable, Direction, InvalidAssetRule,
    TransferRequest, ValidTransfer, check_accounts, check_amount, check_asset, check_asset_code,
    check_id, parse_amount, validate_request,
};

use crate::ids::Signer;

/// The lease subject of a user's transfers: the transfer coordinator takes one lease per user
/// (role `transfer-coordinator`, chain 0) on the stage runtime, whose lease key is a
/// `(ChainId, Signer)`. A user id is any text of 1–64 characters, so the subject is derived from
/// it: the first 20 bytes of `keccak256("txflow.transfer.user:" ‖ user_id)`, written as an
/// address. Two users sharing a subject (a 160-bit collision) would only share a lease, which
/// serialises them and breaks no rule.
pub fn lease_subject(user_id: &str) -> Signer {
    let hash = alloy_primitives::keccak256(format!("txflow.transfer.user:{user_id}"));
    let hex: String = hash[..20].iter().map(|b| format!("{b:02x}")).collect();
    // 0x + 40 lowercase hex digits is always a valid address.
    Signer::parse(&format!("0x{hex}")).unwrap_or_else(|_| unreachable!("40 hex digits"))
}

/// The `event_id` of a transfer's state change: the same for the same transfer and state, so that
/// a step driven again (a crash before its event was produced, a second instance) announces it
/// with the same id. A UUID of version 8 (custom) from keccak-256.
pub fn transfer_event_id(req_id: &str, state: TransferState) -> String {
    let digest = alloy_primitives::keccak256(format!("txflow/transfer/{req_id}/{}", state.id()));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes)
        .into_uuid()
        .to_string()
}

#[cfg(test)]
mod lease_subject_tests {
    use super::lease_subject;

    #[test]
    fn a_user_always_gets_the_same_subject_and_users_differ() {
        assert_eq!(lease_subject("alice"), lease_subject("alice"));
        assert_ne!(lease_subject("alice"), lease_subject("bob"));
        assert_eq!(lease_subject("alice").as_str().len(), 42);
    }
}
