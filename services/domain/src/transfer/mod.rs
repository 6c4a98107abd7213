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
