//! Events and commands of the transaction pipeline (ARCHITECTURE.md §2).
//!
//! The schemas in `schemas/*.avsc` are the contract; the Rust types here mirror them field for
//! field and are checked against them by the golden round-trip tests. Avro mappings:
//!
//! | domain value | Avro type | form |
//! |---|---|---|
//! | address | `string` | `0x` + 40 hex digits, lowercase once validated (TxRequest accepts any case) |
//! | hash (tx, block) | `string` | `0x` + 64 lowercase hex digits |
//! | U256 (wei amounts, fees) | `string` | decimal digits, no sign, no leading zeros |
//! | nonce, chain id, gas, block number | `long` | |
//! | ids (`event_id`, `tx_id`) | `string` | UUID, hyphenated lowercase |
//! | calldata, raw transaction | `bytes` | |
//! | timestamps | `long` | Unix milliseconds (`*_ms` fields) |
//!
//! Kafka keys are not Avro: they are the UTF-8 string `{chain_id}:{signer}` (see
//! `txflow_core::kafka::signer_key`).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use apache_avro::Schema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A type that travels on a topic as Avro.
pub trait Event:
    Serialize + DeserializeOwned + Clone + std::fmt::Debug + PartialEq + Send + Sync
{
    /// The record's full name, e.g. `io.txflow.tx.TxRequest`.
    const FULL_NAME: &'static str;
    /// The schema exactly as written in `schemas/` (registered as is, so defaults and docs survive).
    const SCHEMA_JSON: &'static str;
    /// The schema file name under `schemas/`.
    const SCHEMA_FILE: &'static str;
    /// The schema, parsed once.
    fn schema() -> &'static Schema;
    /// The `event_id` every message carries.
    fn event_id(&self) -> &str;
    /// The transaction the event is about; `None` for a request (it has no transaction yet).
    fn tx_id(&self) -> Option<&str> {
        None
    }
}

macro_rules! event {
    ($ty:ident, $file:literal) => {
        event!(@impl $ty, $file, {});
    };
    // An event about one transaction: its `tx_id` field answers `Event::tx_id`.
    ($ty:ident, $file:literal, tx_id) => {
        event!(@impl $ty, $file, {
            fn tx_id(&self) -> Option<&str> {
                Some(&self.tx_id)
            }
        });
    };
    (@impl $ty:ident, $file:literal, { $($extra:tt)* }) => {
        impl Event for $ty {
            const FULL_NAME: &'static str = concat!("io.txflow.tx.", stringify!($ty));
            const SCHEMA_JSON: &'static str = include_str!(concat!("../../../schemas/", $file));
            const SCHEMA_FILE: &'static str = $file;
            fn schema() -> &'static Schema {
                static SCHEMA: OnceLock<Schema> = OnceLock::new();
                SCHEMA.get_or_init(|| {
                    // The schema text is compiled in and checked by the unit tests below, so a
                    // parse failure here is a build defect, not a run-time condition.
                    Schema::parse_str(Self::SCHEMA_JSON)
                        .unwrap_or_else(|e| panic!("schemas/{} does not parse: {e}", $file))
                })
            }
            fn event_id(&self) -> &str {
                &self.event_id
            }
            $($extra)*
        }
    };
}

/// The `tx_events` types that are announced on a topic (the transactional outbox relays them until
/// the broker acknowledged them); every other type is an audit record only. `TxMined` and
/// `TxReverted` (the receipt checker's moves) carry a [`TxReceiptUpdated`], announced on
/// `tx.receipts`. The confirmation manager's `TxConfirmationsUpdated` and `TxReorged` carry a
/// [`TxConfirmationsUpdated`] (on `tx.confirmations`), its `TxConfirmed` a [`TxConfirmed`] (on
/// `tx.outcomes`).
pub const ANNOUNCED: &[&str] = &[
    "TxAllocated",
    "TxSigned",
    "TxSubmitted",
    "TxFailed",
    "TxMined",
    "TxReverted",
    "TxConfirmationsUpdated",
    "TxReorged",
    "TxConfirmed",
    "TxConfirmationReverted",
];

/// Upstream contract: a request to send one transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxRequest {
    pub event_id: String,
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub to: String,
    pub value: String,
    #[serde(with = "apache_avro::serde::bytes")]
    pub data: Vec<u8>,
    pub gas_limit: Option<i64>,
    pub max_fee_per_gas: Option<String>,
    pub max_priority_fee_per_gas: Option<String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// A chained task (seed 000 §6): the `request_id` that must be CONFIRMED first. Added with
    /// a `null` default, so messages of writers that predate it read as `None`.
    #[serde(default)]
    pub depends_on_request_id: Option<String>,
    /// The signer of the request `depends_on_request_id` names, when it is another signer's;
    /// `None`: the request's own signer. The parent is `(chain_id, signer, request_id)`, never a
    /// `request_id` alone. Added with a `null` default.
    #[serde(default)]
    pub depends_on_signer: Option<String>,
    /// Who submitted it: the gateway's authenticated principal (the token's `sub`), recorded
    /// as `managed_tx.submitted_by`; an approval by the same principal is refused (four eyes).
    /// `None` for a request produced to the topic directly. Added with a `null` default.
    #[serde(default)]
    pub submitted_by: Option<String>,
}
event!(TxRequest, "tx_request.avsc");

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxAccepted {
    pub event_id: String,
    pub tx_id: String,
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub fencing_token: i64,
    pub accepted_at_ms: i64,
}
event!(TxAccepted, "tx_accepted.avsc", tx_id);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxAllocated {
    pub event_id: String,
    pub tx_id: String,
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub nonce: i64,
    pub to: String,
    pub value: String,
    #[serde(with = "apache_avro::serde::bytes")]
    pub data: Vec<u8>,
    pub gas_limit: i64,
    pub max_fee_per_gas: String,
    pub max_priority_fee_per_gas: String,
    pub fencing_token: i64,
}
event!(TxAllocated, "tx_allocated.avsc", tx_id);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxSigned {
    pub event_id: String,
    pub tx_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub nonce: i64,
    pub attempt: i32,
    pub tx_hash: String,
    #[serde(with = "apache_avro::serde::bytes")]
    pub raw_tx: Vec<u8>,
    pub max_fee_per_gas: String,
    pub max_priority_fee_per_gas: String,
    pub fencing_token: i64,
}
event!(TxSigned, "tx_signed.avsc", tx_id);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SubmitOutcome {
    Accepted,
    PossiblySent,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxSubmitted {
    pub event_id: String,
    pub tx_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub nonce: i64,
    pub attempt: i32,
    pub tx_hash: String,
    pub outcome: SubmitOutcome,
    pub submitted_at_ms: i64,
    pub fencing_token: i64,
}
event!(TxSubmitted, "tx_submitted.avsc", tx_id);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReceiptStatus {
    Mined,
    Reverted,
    Replaced,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxReceiptUpdated {
    pub event_id: String,
    pub tx_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub nonce: i64,
    pub status: ReceiptStatus,
    pub tx_hash: Option<String>,
    pub block_number: Option<i64>,
    pub block_hash: Option<String>,
    pub gas_used: Option<i64>,
    pub effective_gas_price: Option<String>,
    pub fencing_token: i64,
}
event!(TxReceiptUpdated, "tx_receipt_updated.avsc", tx_id);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRef {
    pub number: i64,
    pub hash: String,
    pub parent_hash: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxConfirmationsUpdated {
    pub event_id: String,
    pub tx_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub nonce: i64,
    pub tx_hash: String,
    pub new_fork: bool,
    pub confirmations: Vec<BlockRef>,
    pub required_confirmations: i32,
    pub fencing_token: i64,
}
event!(
    TxConfirmationsUpdated,
    "tx_confirmations_updated.avsc",
    tx_id
);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxConfirmed {
    pub event_id: String,
    pub tx_id: String,
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub nonce: i64,
    pub tx_hash: String,
    pub block_number: i64,
    pub block_hash: String,
    pub success: bool,
    pub confirmations: i32,
    pub fencing_token: i64,
    /// 0 for a transaction's first TxConfirmed, one more after each reorg deeper than the
    /// required confirmations reverted the one before (a [`TxConfirmationReverted`] of that
    /// generation comes first). Added with a default of 0 for readers and writers before it.
    #[serde(default)]
    pub reorg_generation: i32,
    /// With `success = false`: why the call reverted (`txflow_domain::revert`), when the chain
    /// told. Added with a `null` default.
    #[serde(default)]
    pub revert_reason: Option<String>,
}
event!(TxConfirmed, "tx_confirmed.avsc", tx_id);

impl TxConfirmed {
    /// Its reversal, under `event_id`: the same transaction, nonce, block and outcome that were
    /// booked on it, naming it in `reverted_event_id` (a reorg deeper than the confirmations
    /// removed its block).
    pub fn reversal(&self, event_id: String) -> TxConfirmationReverted {
        TxConfirmationReverted {
            event_id,
            tx_id: self.tx_id.clone(),
            request_id: self.request_id.clone(),
            chain_id: self.chain_id,
            signer: self.signer.clone(),
            nonce: self.nonce,
            tx_hash: self.tx_hash.clone(),
            block_number: self.block_number,
            block_hash: self.block_hash.clone(),
            success: self.success,
            reorg_generation: self.reorg_generation,
            reverted_event_id: self.event_id.clone(),
            required_confirmations: self.confirmations,
            fencing_token: self.fencing_token,
        }
    }
}

/// Downstream contract: the TxConfirmed of generation `reorg_generation` (`reverted_event_id`)
/// is no longer true — a reorg deeper than the required confirmations removed its block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxConfirmationReverted {
    pub event_id: String,
    pub tx_id: String,
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub nonce: i64,
    pub tx_hash: String,
    pub block_number: i64,
    pub block_hash: String,
    pub success: bool,
    pub reorg_generation: i32,
    pub reverted_event_id: String,
    pub required_confirmations: i32,
    pub fencing_token: i64,
}
event!(
    TxConfirmationReverted,
    "tx_confirmation_reverted.avsc",
    tx_id
);

impl TxConfirmationReverted {
    /// The `new_fork = true` announcement of the empty list on `tx.confirmations` that goes
    /// with it (the same `event_id`): what was final is pending again.
    pub fn new_fork(&self) -> TxConfirmationsUpdated {
        TxConfirmationsUpdated {
            event_id: self.event_id.clone(),
            tx_id: self.tx_id.clone(),
            chain_id: self.chain_id,
            signer: self.signer.clone(),
            nonce: self.nonce,
            tx_hash: self.tx_hash.clone(),
            new_fork: true,
            confirmations: Vec::new(),
            required_confirmations: self.required_confirmations,
            fencing_token: self.fencing_token,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxFailed {
    pub event_id: String,
    pub tx_id: String,
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub code: String,
    pub reason: String,
    pub nonce: Option<i64>,
    #[serde(default)]
    pub nonce_released: bool,
    pub fencing_token: i64,
}
event!(TxFailed, "tx_failed.avsc", tx_id);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TxCommandKind {
    Approve,
    Cancel,
    Bump,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxCommand {
    pub event_id: String,
    pub tx_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub command: TxCommandKind,
    pub requested_by: String,
    pub reason: Option<String>,
}
event!(TxCommand, "tx_command.avsc", tx_id);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxReplaced {
    pub event_id: String,
    pub tx_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub nonce: i64,
    pub chain_nonce: i64,
    pub reason: String,
    pub fencing_token: i64,
}
event!(TxReplaced, "tx_replaced.avsc", tx_id);

/// The operation of a [`SpotCommand`] (seed 004 §5.3, the spot ledger). CREDIT and DEBIT are
/// idempotent by `(req_id, op)`, so a transfer's DEBIT and the CREDIT that compensates it are two
/// operations, each applied at most once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SpotOp {
    Credit,
    Debit,
    Balance,
    Freeze,
    Unfreeze,
}

/// A command to the spot ledger on `spot.commands`, keyed by `user_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpotCommand {
    pub event_id: String,
    pub req_id: String,
    pub user_id: String,
    pub asset: String,
    /// An exact decimal string, never a float.
    pub amount: String,
    pub op: SpotOp,
    /// A CREDIT refunding this transfer's own spot DEBIT (applied even to a frozen account).
    #[serde(default)]
    pub compensation: bool,
    /// A CREDIT or DEBIT that is an outside movement (into or out of the trading core from
    /// outside the two ledgers), not a transfer leg; the ledger keeps their net per (user, asset)
    /// for the conservation check. Never together with `compensation`.
    #[serde(default)]
    pub external: bool,
}
event!(SpotCommand, "spot_command.avsc");

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SpotOutcome {
    Applied,
    AlreadyApplied,
    Rejected,
}

/// The spot ledger's answer on `spot.events`, keyed by `user_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpotReply {
    pub event_id: String,
    pub req_id: String,
    pub op: SpotOp,
    pub user_id: String,
    pub asset: String,
    pub outcome: SpotOutcome,
    #[serde(default)]
    pub code: Option<String>,
    /// An exact decimal string.
    #[serde(default)]
    pub balance: Option<String>,
    #[serde(default)]
    pub wal_seq: Option<i64>,
    pub replied_at_ms: i64,
    /// For BALANCE: the net of the applied outside movements of (user, asset), an exact decimal
    /// string, possibly negative.
    #[serde(default)]
    pub external_net: Option<String>,
}
event!(SpotReply, "spot_reply.avsc");

/// A transfer the gateway recorded in INIT, on `transfer.requests` keyed by `user_id`: the
/// coordinator's input (seed 004 §9.1 → §9.2). The row in `transfers` is the truth; the event
/// carries its fields so that the coordinator re-validates them (defence in depth, layer 2) and
/// can tell a forged or stale event from the row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferRequested {
    pub event_id: String,
    pub req_id: String,
    pub user_id: String,
    pub asset: String,
    /// An exact decimal string, never a float.
    pub amount: String,
    /// `FUNDING` or `SPOT`.
    pub from_account: String,
    pub to_account: String,
    pub created_at_ms: i64,
    #[serde(default)]
    pub traceparent: Option<String>,
}
event!(TransferRequested, "transfer_requested.avsc");

/// A transfer's state change, on `transfer.events` keyed by `user_id`, produced after the CAS
/// that made it committed (seed 004 §2.1 ids and names).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferUpdated {
    pub event_id: String,
    pub req_id: String,
    pub user_id: String,
    pub asset: String,
    pub amount: String,
    pub from_account: String,
    pub to_account: String,
    /// The state's name (`SOURCE_DONE`, `COMMITTED`, …).
    pub state: String,
    /// The state's numeric id of §2.1.
    pub state_id: i32,
    #[serde(default)]
    pub error_code: Option<String>,
    pub fencing_token: i64,
    pub updated_at_ms: i64,
}
event!(TransferUpdated, "transfer_updated.avsc");

/// The schema files of the pipeline, for tools that register or list them.
pub const ALL_SCHEMAS: [(&str, &str); 15] = [
    (TxRequest::FULL_NAME, TxRequest::SCHEMA_JSON),
    (TxAccepted::FULL_NAME, TxAccepted::SCHEMA_JSON),
    (TxAllocated::FULL_NAME, TxAllocated::SCHEMA_JSON),
    (TxSigned::FULL_NAME, TxSigned::SCHEMA_JSON),
    (TxSubmitted::FULL_NAME, TxSubmitted::SCHEMA_JSON),
    (TxReceiptUpdated::FULL_NAME, TxReceiptUpdated::SCHEMA_JSON),
    (
        TxConfirmationsUpdated::FULL_NAME,
        TxConfirmationsUpdated::SCHEMA_JSON,
    ),
    (TxConfirmed::FULL_NAME, TxConfirmed::SCHEMA_JSON),
    (TxFailed::FULL_NAME, TxFailed::SCHEMA_JSON),
    (TxCommand::FULL_NAME, TxCommand::SCHEMA_JSON),
    (TxReplaced::FULL_NAME, TxReplaced::SCHEMA_JSON),
    (SpotCommand::FULL_NAME, SpotCommand::SCHEMA_JSON),
    (SpotReply::FULL_NAME, SpotReply::SCHEMA_JSON),
    (TransferRequested::FULL_NAME, TransferRequested::SCHEMA_JSON),
    (TransferUpdated::FULL_NAME, TransferUpdated::SCHEMA_JSON),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schema_parses_and_names_its_type() {
        for (name, json) in ALL_SCHEMAS {
            let schema = Schema::parse_str(json).unwrap_or_else(|e| panic!("{name}: {e}"));
            let parsed_name = match &schema {
                Schema::Record(r) => r.name.fullname(None),
                other => panic!("{name} is not a record: {other:?}"),
            };
            assert_eq!(parsed_name, name);
        }
    }

    #[test]
    fn a_reversal_reverts_what_was_booked_and_names_it() {
        let booked = TxConfirmed {
            event_id: "c-0".into(),
            tx_id: "t".into(),
            request_id: "r".into(),
            chain_id: 31337,
            signer: "0xabc".into(),
            nonce: 7,
            tx_hash: "0xh".into(),
            block_number: 42,
            block_hash: "0xb".into(),
            success: false,
            confirmations: 3,
            fencing_token: 9,
            reorg_generation: 2,
            revert_reason: Some("Error(no)".into()),
        };
        let r = booked.reversal("rev-2".into());
        assert_eq!(r.event_id, "rev-2");
        assert_eq!(r.reverted_event_id, "c-0");
        assert_eq!(
            (
                r.tx_id.as_str(),
                r.request_id.as_str(),
                r.chain_id,
                r.signer.as_str()
            ),
            ("t", "r", 31337, "0xabc")
        );
        assert_eq!(
            (
                r.nonce,
                r.tx_hash.as_str(),
                r.block_number,
                r.block_hash.as_str()
            ),
            (7, "0xh", 42, "0xb")
        );
        assert!(!r.success);
        assert_eq!(
            (
                r.reorg_generation,
                r.required_confirmations,
                r.fencing_token
            ),
            (2, 3, 9)
        );
    }

    #[test]
    fn every_event_carries_an_event_id_field() {
        for (name, json) in ALL_SCHEMAS {
            let v: serde_json::Value = serde_json::from_str(json).expect("schema is JSON");
            let fields = v["fields"].as_array().expect("record has fields");
            assert_eq!(
                fields[0]["name"], "event_id",
                "{name}: event_id must be the first field"
            );
        }
    }
}
