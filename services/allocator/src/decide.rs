//! The allocator's decisions, pure (no I/O): validation of the TxRequest contract (ARCHITECTURE
//! §2; every refusal is a [`Rejection`] with a stable code, dead-lettered), what a simulation
//! result and the policy make of a transaction, what an operator command does in each state, and
//! how an allocation or a no-op is built. `handler.rs` loads, calls these, and persists through
//! `store.rs`.

use alloy::primitives::{Address, Bytes, U256};
use txflow_core::chain::Simulation;
use txflow_core::domain::{ChainId, Signer, TxPayload};
use txflow_core::events::{TxAllocated, TxCommand, TxCommandKind, TxRequest};
use txflow_core::failure::FailureCode;
use txflow_core::policy::{Policy, Verdict};
use txflow_core::stage::Rejection;
use txflow_core::state::TxState;

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

/// `managed_tx.payload` of a validated request.
pub fn payload_of(v: &ValidRequest) -> TxPayload {
    TxPayload {
        to: format!("{:#x}", v.to),
        value: v.value.to_string(),
        data: format!("0x{}", hex::encode(&v.data)),
        gas_limit: v.gas_limit,
        max_fee_per_gas: v.max_fee_per_gas.map(|f| f.to_string()),
        max_priority_fee_per_gas: v.max_priority_fee_per_gas.map(|f| f.to_string()),
    }
}

/// Whether a request asks for what a recorded one asked: the same destination, value and data
/// (gas and fees are filled in by txflow after recording, so they are not compared).
pub fn same_request(recorded: &TxPayload, asked: &TxPayload) -> bool {
    recorded.to.eq_ignore_ascii_case(&asked.to)
        && recorded.value == asked.value
        && recorded.data.eq_ignore_ascii_case(&asked.data)
}

/// The call a recorded payload asks for, or why it cannot be made (a corrupt row: failing it is
/// the only way forward, retrying would fail the same way).
pub fn call_of(p: &TxPayload) -> Result<(Address, U256, Bytes), String> {
    let to: Address =
        p.to.parse()
            .map_err(|_| format!("recorded to {:?}", p.to))?;
    let value =
        U256::from_str_radix(&p.value, 10).map_err(|_| format!("recorded value {:?}", p.value))?;
    let data = hex::decode(p.data.trim_start_matches("0x"))
        .map_err(|_| "recorded data is not hex".to_string())?;
    Ok((to, value, Bytes::from(data)))
}

/// A simulation as the allocator sees it: the node's answer, or a failed call (transient: the
/// node is unavailable; otherwise the node's error).
pub type SimResult = Result<Simulation, SimError>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimError {
    pub transient: bool,
    pub message: String,
}

/// What becomes of a RECEIVED transaction after its simulation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterSimulation {
    /// RECEIVED → SIMULATED, with the gas limit filled in.
    Simulated(TxPayload),
    /// RECEIVED → PENDING_APPROVAL (no nonce held), with the gas limit filled in.
    AwaitApproval(TxPayload),
    /// RECEIVED → FAILED.
    Fail { code: FailureCode, reason: String },
    /// The signer cannot pay: leave it RECEIVED and hold the signer.
    Hold { reason: String },
    /// The node could not answer: leave it RECEIVED, try again later.
    Retry { reason: String },
}

/// The policy first (a refusal stands whatever the node said), then the simulation.
pub fn after_simulation(policy: &Policy, payload: &TxPayload, sim: &SimResult) -> AfterSimulation {
    let (to, value, _) = match call_of(payload) {
        Ok(c) => c,
        Err(why) => {
            return AfterSimulation::Fail {
                code: FailureCode::SimulationFailed,
                reason: format!("the recorded transaction is not valid: {why}"),
            };
        }
    };
    let verdict = policy.check(to, value);
    if let Verdict::Deny(reason) = verdict {
        return AfterSimulation::Fail {
            code: FailureCode::PolicyDenied,
            reason,
        };
    }
    match sim {
        Err(e) if e.transient => AfterSimulation::Retry {
            reason: e.message.clone(),
        },
        Err(e) => AfterSimulation::Fail {
            code: FailureCode::SimulationFailed,
            reason: e.message.clone(),
        },
        Ok(Simulation::InsufficientFunds { reason }) => AfterSimulation::Hold {
            reason: reason.clone(),
        },
        Ok(Simulation::Reverts { reason }) => AfterSimulation::Fail {
            code: FailureCode::SimulationReverted,
            reason: reason.clone(),
        },
        Ok(Simulation::Ok { gas }) => {
            let mut p = payload.clone();
            // Keep the requested limit; otherwise the estimate plus 20%.
            p.gas_limit = Some(p.gas_limit.unwrap_or(gas + gas / 5));
            if verdict == Verdict::NeedsApproval {
                AfterSimulation::AwaitApproval(p)
            } else {
                AfterSimulation::Simulated(p)
            }
        }
    }
}

/// Whether an allocation must first align the cursor with the chain's pending nonce: when the
/// cursor was not synced within `nonce.state_timeout`, or a transaction of the signer was
/// REPLACED (its nonce was used outside txflow, so the cursor is behind the chain).
pub fn needs_chain_nonce(cursor_fresh: bool, replaced: bool) -> bool {
    !cursor_fresh || replaced
}

/// Whether any payload leaves its fees to txflow (priced from `eth_feeHistory`).
pub fn needs_fees(payloads: &[TxPayload]) -> bool {
    payloads
        .iter()
        .any(|p| p.max_fee_per_gas.is_none() || p.max_priority_fee_per_gas.is_none())
}

/// The payload as allocated: fees the request left open are filled from the chain's.
pub fn with_fees(mut p: TxPayload, fees: Option<(u128, u128)>) -> TxPayload {
    if let Some((max, tip)) = fees {
        p.max_fee_per_gas.get_or_insert(max.to_string());
        p.max_priority_fee_per_gas.get_or_insert(tip.to_string());
    }
    p
}

/// The announcement of an allocation (the row holds the same values).
#[allow(clippy::too_many_arguments)]
pub fn allocated_event(
    event_id: String,
    tx_id: String,
    request_id: String,
    chain_id: i64,
    signer: &Signer,
    nonce: i64,
    p: &TxPayload,
    fencing_token: i64,
) -> Result<TxAllocated, String> {
    Ok(TxAllocated {
        event_id,
        tx_id,
        request_id,
        chain_id,
        signer: signer.as_str().to_string(),
        nonce,
        to: p.to.clone(),
        value: p.value.clone(),
        data: hex::decode(p.data.trim_start_matches("0x"))
            .map_err(|_| "recorded data is not hex".to_string())?,
        gas_limit: p.gas_limit.unwrap_or(21_000) as i64,
        max_fee_per_gas: p.max_fee_per_gas.clone().unwrap_or_default(),
        max_priority_fee_per_gas: p.max_priority_fee_per_gas.clone().unwrap_or_default(),
        fencing_token,
    })
}

/// A 0-value self-transfer filling a released nonce.
pub fn noop_payload(signer: &Signer, fees: (u128, u128)) -> TxPayload {
    TxPayload {
        to: signer.as_str().to_string(),
        value: "0".into(),
        data: "0x".into(),
        gas_limit: Some(21_000),
        max_fee_per_gas: Some(fees.0.to_string()),
        max_priority_fee_per_gas: Some(fees.1.to_string()),
    }
}

/// Where the transaction a command names was found. The command's own signer is read under its
/// lease (the row locked); a transaction of any other (chain, signer) is only looked up, never
/// touched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandTarget {
    /// A transaction of the command's signer on the command's chain, in this state.
    Own(TxState),
    /// A transaction of another signer or chain (where it is).
    Foreign { chain_id: ChainId, signer: String },
    /// No transaction has this id.
    Unknown,
}

/// What an operator command does to the transaction it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandDecision {
    /// PENDING_APPROVAL → SIMULATED, approver recorded.
    Approve,
    /// Not allocated yet → FAILED (CANCELLED).
    CancelUnallocated,
    /// ALLOCATED (not signed yet) → FAILED (CANCELLED), nonce released.
    CancelAllocated,
    /// The signer's transaction, in a state where the command does nothing (said why): a no-op,
    /// so that a redelivered or repeated command is never dead-lettered.
    Ignore(&'static str),
    /// Not a transaction of the signer the command is keyed by (`TX_NOT_OF_SIGNER`), or no
    /// transaction at all (`UNKNOWN_TX`): dead-lettered, nothing changes.
    Reject(Rejection),
}

fn command_name(kind: TxCommandKind) -> &'static str {
    match kind {
        TxCommandKind::Approve => "APPROVE",
        TxCommandKind::Cancel => "CANCEL",
        TxCommandKind::Bump => "BUMP",
    }
}

/// What command `c` does to its target. Approve and cancel act only on a transaction of the
/// signer (and chain) the command is keyed by; a bump is the signer gateway's, ignored here
/// whatever it names.
pub fn decide_command(c: &TxCommand, target: &CommandTarget) -> CommandDecision {
    let kind = c.command;
    if kind == TxCommandKind::Bump {
        return CommandDecision::Ignore("bumps are the signer gateway's");
    }
    let state = match target {
        CommandTarget::Own(state) => *state,
        CommandTarget::Foreign { chain_id, signer } => {
            return CommandDecision::Reject(Rejection::new(
                "TX_NOT_OF_SIGNER",
                format!(
                    "{} of transaction {} keyed by signer {} on chain {}: it is a transaction \
                     of signer {signer} on chain {chain_id}",
                    command_name(kind),
                    c.tx_id,
                    c.signer,
                    c.chain_id
                ),
            ));
        }
        CommandTarget::Unknown => {
            return CommandDecision::Reject(Rejection::new(
                "UNKNOWN_TX",
                format!(
                    "{} of transaction {} keyed by signer {} on chain {}: no such transaction",
                    command_name(kind),
                    c.tx_id,
                    c.signer,
                    c.chain_id
                ),
            ));
        }
    };
    match kind {
        TxCommandKind::Bump => CommandDecision::Ignore("bumps are the signer gateway's"),
        TxCommandKind::Approve => match state {
            TxState::PendingApproval => CommandDecision::Approve,
            TxState::Received
            | TxState::Simulated
            | TxState::Allocated
            | TxState::Signed
            | TxState::Submitted
            | TxState::Mined
            | TxState::Confirmed
            | TxState::Reverted
            | TxState::Replaced
            | TxState::Failed => CommandDecision::Ignore("not waiting for an approval"),
        },
        TxCommandKind::Cancel => match state {
            TxState::Received | TxState::Simulated | TxState::PendingApproval => {
                CommandDecision::CancelUnallocated
            }
            TxState::Allocated => CommandDecision::CancelAllocated,
            TxState::Signed
            | TxState::Submitted
            | TxState::Mined
            | TxState::Confirmed
            | TxState::Reverted
            | TxState::Replaced
            | TxState::Failed => CommandDecision::Ignore("already signed or final"),
        },
    }
}

/// The reason recorded for a cancel.
pub fn cancel_reason(requested_by: &str, reason: Option<&str>) -> String {
    format!(
        "cancelled by {requested_by}{}",
        reason.map(|r| format!(": {r}")).unwrap_or_default()
    )
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

    fn payload(to: &str, value: &str) -> TxPayload {
        TxPayload {
            to: to.into(),
            value: value.into(),
            data: "0x7478".into(),
            gas_limit: None,
            max_fee_per_gas: None,
            max_priority_fee_per_gas: None,
        }
    }

    const TO: &str = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8";

    #[test]
    fn a_simulation_and_the_policy_decide_the_next_state() {
        let policy = Policy {
            whitelist: None,
            max_value: Some(U256::from(1000)),
            approval_threshold: Some(U256::from(100)),
        };
        let ok = |gas| Ok(Simulation::Ok { gas });
        let err = |transient| {
            Err(SimError {
                transient,
                message: "boom".into(),
            })
        };
        let with_gas = |p: TxPayload, g| TxPayload {
            gas_limit: Some(g),
            ..p
        };
        type Case = (&'static str, TxPayload, SimResult, AfterSimulation);
        let cases: Vec<Case> = vec![
            (
                "ok: estimate + 20%",
                payload(TO, "5"),
                ok(100_000),
                AfterSimulation::Simulated(with_gas(payload(TO, "5"), 120_000)),
            ),
            (
                "a requested gas limit is kept",
                with_gas(payload(TO, "5"), 50_000),
                ok(100_000),
                AfterSimulation::Simulated(with_gas(payload(TO, "5"), 50_000)),
            ),
            (
                "at the threshold: approval, no nonce",
                payload(TO, "100"),
                ok(21_000),
                AfterSimulation::AwaitApproval(with_gas(payload(TO, "100"), 25_200)),
            ),
            (
                "above the limit: denied whatever the node says",
                payload(TO, "1001"),
                err(true),
                AfterSimulation::Fail {
                    code: FailureCode::PolicyDenied,
                    reason: "value 1001 wei is above the limit of 1000 wei".into(),
                },
            ),
            (
                "revert",
                payload(TO, "5"),
                Ok(Simulation::Reverts {
                    reason: "execution reverted: no".into(),
                }),
                AfterSimulation::Fail {
                    code: FailureCode::SimulationReverted,
                    reason: "execution reverted: no".into(),
                },
            ),
            (
                "cannot pay: hold",
                payload(TO, "5"),
                Ok(Simulation::InsufficientFunds {
                    reason: "insufficient funds".into(),
                }),
                AfterSimulation::Hold {
                    reason: "insufficient funds".into(),
                },
            ),
            (
                "node unavailable: retry",
                payload(TO, "5"),
                err(true),
                AfterSimulation::Retry {
                    reason: "boom".into(),
                },
            ),
            (
                "node error: failed",
                payload(TO, "5"),
                err(false),
                AfterSimulation::Fail {
                    code: FailureCode::SimulationFailed,
                    reason: "boom".into(),
                },
            ),
        ];
        for (name, p, sim, want) in cases {
            assert_eq!(after_simulation(&policy, &p, &sim), want, "{name}");
        }
        let corrupt = payload("nope", "5");
        assert!(matches!(
            after_simulation(&policy, &corrupt, &ok(1)),
            AfterSimulation::Fail {
                code: FailureCode::SimulationFailed,
                ..
            }
        ));
    }

    fn command(kind: TxCommandKind) -> TxCommand {
        TxCommand {
            event_id: "e".into(),
            tx_id: "0190f0e0-0000-7000-8000-000000000001".into(),
            chain_id: 31337,
            signer: TO.into(),
            command: kind,
            requested_by: "ops".into(),
            reason: None,
        }
    }

    fn rejected(d: &CommandDecision) -> Option<&str> {
        match d {
            CommandDecision::Reject(r) => Some(r.code.as_str()),
            _ => None,
        }
    }

    #[test]
    fn commands_act_only_on_their_signers_transactions_in_their_states() {
        use CommandDecision::*;
        let (approve, cancel, bump) = (
            command(TxCommandKind::Approve),
            command(TxCommandKind::Cancel),
            command(TxCommandKind::Bump),
        );
        // The signer's own transaction: a move in the states where the command acts, otherwise a
        // no-op, never a dead letter (a redelivered or repeated command finds the state moved on).
        for s in TxState::ALL {
            let own = CommandTarget::Own(s);
            let a = decide_command(&approve, &own);
            assert_eq!(
                a == Approve,
                s == TxState::PendingApproval,
                "approve in {s}"
            );
            assert!(matches!(a, Approve | Ignore(_)), "approve in {s}: {a:?}");
            let c = decide_command(&cancel, &own);
            let expected = match s {
                TxState::Received | TxState::Simulated | TxState::PendingApproval => {
                    Some(CancelUnallocated)
                }
                TxState::Allocated => Some(CancelAllocated),
                TxState::Signed
                | TxState::Submitted
                | TxState::Mined
                | TxState::Confirmed
                | TxState::Reverted
                | TxState::Replaced
                | TxState::Failed => None,
            };
            match expected {
                Some(want) => assert_eq!(c, want, "cancel in {s}"),
                None => assert!(matches!(c, Ignore(_)), "cancel in {s}: {c:?}"),
            }
            assert!(matches!(decide_command(&bump, &own), Ignore(_)));
        }
        // Not the signer's transaction: a typed rejection, whatever the command; a bump is not
        // the allocator's to judge.
        let foreign = CommandTarget::Foreign {
            chain_id: ChainId(31337),
            signer: "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266".into(),
        };
        let other_chain = CommandTarget::Foreign {
            chain_id: ChainId(1),
            signer: TO.into(),
        };
        type Case<'a> = (&'a str, &'a TxCommand, CommandTarget, Option<&'a str>);
        let cases: Vec<Case> = vec![
            (
                "approve, another signer's",
                &approve,
                foreign.clone(),
                Some("TX_NOT_OF_SIGNER"),
            ),
            (
                "cancel, another signer's",
                &cancel,
                foreign.clone(),
                Some("TX_NOT_OF_SIGNER"),
            ),
            (
                "cancel, another chain's",
                &cancel,
                other_chain.clone(),
                Some("TX_NOT_OF_SIGNER"),
            ),
            (
                "approve, another chain's",
                &approve,
                other_chain,
                Some("TX_NOT_OF_SIGNER"),
            ),
            (
                "approve, unknown",
                &approve,
                CommandTarget::Unknown,
                Some("UNKNOWN_TX"),
            ),
            (
                "cancel, unknown",
                &cancel,
                CommandTarget::Unknown,
                Some("UNKNOWN_TX"),
            ),
            ("bump, another signer's", &bump, foreign, None),
            ("bump, unknown", &bump, CommandTarget::Unknown, None),
        ];
        for (name, c, target, want) in cases {
            let d = decide_command(c, &target);
            assert_eq!(rejected(&d), want, "{name}: {d:?}");
            if want.is_none() {
                assert!(matches!(d, Ignore(_)), "{name}: {d:?}");
            }
        }
        // The dead letter says which transaction, which signer keyed it and whose it is.
        let CommandDecision::Reject(r) = decide_command(
            &cancel,
            &CommandTarget::Foreign {
                chain_id: ChainId(31337),
                signer: "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266".into(),
            },
        ) else {
            panic!("rejected");
        };
        assert_eq!(
            r.message,
            "CANCEL of transaction 0190f0e0-0000-7000-8000-000000000001 keyed by signer \
             0x70997970c51812dc3a010c7d01b50e0d17dc79c8 on chain 31337: it is a transaction of \
             signer 0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266 on chain 31337"
        );
    }

    #[test]
    fn allocation_aligns_with_the_chain_when_stale_or_replaced_and_fills_open_fees() {
        assert!(!needs_chain_nonce(true, false));
        assert!(needs_chain_nonce(false, false));
        assert!(needs_chain_nonce(true, true));
        let open = payload(TO, "1");
        let mut fixed = payload(TO, "1");
        fixed.max_fee_per_gas = Some("7".into());
        fixed.max_priority_fee_per_gas = Some("1".into());
        assert!(needs_fees(&[fixed.clone(), open.clone()]));
        assert!(!needs_fees(std::slice::from_ref(&fixed)));
        let filled = with_fees(open, Some((9, 2)));
        assert_eq!(filled.max_fee_per_gas.as_deref(), Some("9"));
        assert_eq!(with_fees(fixed.clone(), Some((9, 2))), fixed);
        let s = Signer::parse(TO).expect("signer");
        let noop = noop_payload(&s, (9, 2));
        assert_eq!((noop.to.as_str(), noop.value.as_str()), (TO, "0"));
        let e = allocated_event("e".into(), "t".into(), "r".into(), 1, &s, 4, &filled, 3)
            .expect("event");
        assert_eq!(
            (e.nonce, e.data.clone(), e.gas_limit),
            (4, vec![0x74, 0x78], 21_000)
        );
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
    fn a_reused_request_id_is_the_same_request_only_with_the_same_call() {
        let recorded = TxPayload {
            gas_limit: Some(25_200),
            max_fee_per_gas: Some("9".into()),
            max_priority_fee_per_gas: Some("2".into()),
            ..payload(TO, "5")
        };
        type Change = fn(&mut TxPayload);
        let cases: [(&str, Change, bool); 5] = [
            ("as asked", |_| {}, true),
            (
                "upper-case address",
                |p| p.to = p.to.to_ascii_uppercase().replace("0X", "0x"),
                true,
            ),
            ("another value", |p| p.value = "6".into(), false),
            (
                "another destination",
                |p| p.to = "0x000000000000000000000000000000000000dead".into(),
                false,
            ),
            ("other data", |p| p.data = "0x00".into(), false),
        ];
        for (name, change, same) in cases {
            let mut asked = payload(TO, "5");
            change(&mut asked);
            assert_eq!(same_request(&recorded, &asked), same, "{name}");
        }
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
