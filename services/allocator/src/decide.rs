//! The allocator's decisions, pure (no I/O): validation of the TxRequest contract (ARCHITECTURE
//! §2; every refusal is a [`Rejection`] with a stable code, dead-lettered), what a simulation
//! result and the policy make of a transaction, whether a signer that cannot pay for a request
//! is held as a whole or only that request is ([`signer_funds`], [`HoldBackoff`]), whether a
//! chained request may go on, waits or fails with its parent ([`dependency`]), what an operator
//! command does in each state, and how an allocation or a no-op is built. Arithmetic on
//! values from the node is checked: what cannot be represented is an [`OutOfRange`], never a
//! wrap or a panic. `handler.rs` loads, calls these, and persists through `store.rs`.

use std::time::Duration;

use alloy::primitives::{Address, Bytes, U256};
use txflow_core::chain::Simulation;
use txflow_core::domain::{ChainId, Signer, TxPayload};
use txflow_core::events::{TxAllocated, TxCommand, TxCommandKind, TxRequest};
use txflow_core::failure::FailureCode;
use txflow_core::policy::{Policy, Verdict};
use txflow_core::stage::Rejection;
use txflow_core::state::TxState;
use uuid::Uuid;

/// The gas of a plain transfer: the floor of a gas limit, and the gas the funds probe prices.
pub const TRANSFER_GAS: u64 = 21_000;
/// At most this many transactions are allocated in one drive (the rest in the next one).
pub const MAX_ALLOCATIONS_PER_DRIVE: i64 = 10_000;
/// At most this many released nonces are filled with no-ops in one drive.
pub const MAX_NOOPS_PER_DRIVE: u32 = 1_000;

/// A value from the node, or computed from one, that txflow cannot represent or that is beyond
/// its cap. Deterministic: the same inputs fail the same way, so it is never retried as if
/// transient.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutOfRange {
    #[error("the node's gas estimate {estimate} is above the gas limit cap of {cap}")]
    GasEstimate { estimate: u64, cap: u64 },
    #[error("gas limit {0} does not fit a signed 64-bit integer")]
    GasLimit(u64),
    #[error("the chain's nonce {0} does not fit a signed 64-bit integer")]
    ChainNonce(u64),
    #[error(
        "the maximum cost of the transaction (gas limit {gas_limit} × max fee {max_fee_per_gas} \
         wei + value {value} wei) does not fit 256 bits"
    )]
    MaxCost {
        gas_limit: u64,
        max_fee_per_gas: u128,
        value: U256,
    },
    #[error("{0} transactions do not fit one allocation")]
    Count(usize),
}

// The TxRequest contract, checked in txflow-domain so that txflow-client applies the same rules
// before a request reaches the broker.
pub use txflow_core::request::{
    MAX_DATA_BYTES, MAX_GAS_LIMIT, MAX_METADATA_ENTRIES, MAX_SUBMITTED_BY, ValidRequest,
};

/// Checks a request for `expected_chain`; a refusal is the [`Rejection`] dead-lettered with its
/// stable code.
pub fn validate(r: &TxRequest, expected_chain: ChainId) -> Result<ValidRequest, Rejection> {
    txflow_core::request::validate(r, expected_chain).map_err(|e| Rejection::new(e.code, e.message))
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
    /// The signer cannot pay for this one now (the node said insufficient funds): it stays
    /// RECEIVED, held alone or with its whole signer as [`signer_funds`] decides; never failed.
    CannotPay { reason: String },
    /// The node could not answer: leave it RECEIVED, try again later.
    Retry { reason: String },
}

/// The gas limit of a transaction whose simulation used `estimate`: the requested one if the
/// request set it (validated at intake), otherwise the estimate plus 20%, at least a plain
/// transfer's gas and at most [`MAX_GAS_LIMIT`]. An estimate above the cap cannot be sent as
/// estimated: [`OutOfRange::GasEstimate`].
pub fn gas_limit(requested: Option<u64>, estimate: u64) -> Result<u64, OutOfRange> {
    if let Some(g) = requested {
        return Ok(g);
    }
    let cap = u64::try_from(MAX_GAS_LIMIT).unwrap_or(u64::MAX);
    if estimate > cap {
        return Err(OutOfRange::GasEstimate { estimate, cap });
    }
    // estimate ≤ cap here, so this cannot saturate; checked all the same.
    let padded = estimate.saturating_add(estimate / 5);
    Ok(padded.clamp(TRANSFER_GAS, cap))
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
        Ok(Simulation::InsufficientFunds { reason }) => AfterSimulation::CannotPay {
            reason: reason.clone(),
        },
        Ok(Simulation::Reverts { reason }) => AfterSimulation::Fail {
            code: FailureCode::SimulationReverted,
            reason: reason.clone(),
        },
        Ok(Simulation::Ok { gas }) => {
            let mut p = payload.clone();
            match gas_limit(p.gas_limit, *gas) {
                Ok(g) => p.gas_limit = Some(g),
                Err(e) => {
                    return AfterSimulation::Fail {
                        code: FailureCode::SimulationFailed,
                        reason: e.to_string(),
                    };
                }
            }
            if verdict == Verdict::NeedsApproval {
                AfterSimulation::AwaitApproval(p)
            } else {
                AfterSimulation::Simulated(p)
            }
        }
    }
}

/// The calldata of the funds probe: one byte, so that every client executes the call (anvil
/// answers a plain transfer to an account without code with 21,000 without looking at the
/// balance).
pub const FUNDS_PROBE_DATA: [u8; 1] = [0];

/// The value of the funds probe, a self-call simulated when some request of a drive cannot be
/// paid: what the gas of a plain transfer costs at `max_fee_per_gas` (at least 1 wei, so that an
/// empty account never passes). A signer that cannot move this much can pay for none of its
/// requests. Cannot overflow (21,000 × a `u128` fits 256 bits); saturates if it ever could.
pub fn funds_probe_value(max_fee_per_gas: u128) -> U256 {
    U256::from(TRANSFER_GAS)
        .saturating_mul(U256::from(max_fee_per_gas))
        .max(U256::from(1))
}

/// What the drive's simulations say about the signer's funds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignerFunds {
    /// No request failed for funds: the signer's hold, if any, clears.
    Enough,
    /// Some requests cannot be paid, but the signer can pay for others (the probe passed): those
    /// are held alone, with a back-off; the others go on; the signer is not held.
    HoldRequests,
    /// The signer cannot even pay the gas of a plain transfer (the probe failed for funds), or
    /// nothing shows that it can pay for anything: the signer is held and nothing moves.
    HoldSigner { reason: String },
    /// The probe could not be answered now: the drive is tried again later.
    Retry { reason: String },
}

/// Whether the funds probe is needed: some request of the drive cannot be paid.
pub fn needs_funds_probe(decisions: &[AfterSimulation]) -> bool {
    decisions
        .iter()
        .any(|d| matches!(d, AfterSimulation::CannotPay { .. }))
}

/// Holds the signer only when it can pay for none of its requests: `probe` is the simulation of
/// a self-call worth [`funds_probe_value`] (`None` when it was not made).
pub fn signer_funds(decisions: &[AfterSimulation], probe: Option<&SimResult>) -> SignerFunds {
    let Some(first) = decisions.iter().find_map(|d| match d {
        AfterSimulation::CannotPay { reason } => Some(reason),
        _ => None,
    }) else {
        return SignerFunds::Enough;
    };
    match probe {
        None => SignerFunds::HoldSigner {
            reason: first.clone(),
        },
        Some(Ok(Simulation::InsufficientFunds { reason })) => SignerFunds::HoldSigner {
            reason: format!("the balance cannot pay the gas of a plain transfer: {reason}"),
        },
        Some(Err(e)) if e.transient => SignerFunds::Retry {
            reason: e.message.clone(),
        },
        // The call ran (it succeeded or reverted), so the balance covers gas: the problem is
        // those requests' own. A node error on the probe says nothing about the funds either;
        // holding the signer for it would make one request's problem everybody's.
        Some(Ok(Simulation::Ok { .. } | Simulation::Reverts { .. }) | Err(_)) => {
            SignerFunds::HoldRequests
        }
    }
}

/// How long a request held alone waits before it is simulated again: `first` after its first
/// hold, doubling with each further one, at most `max` (a request that cannot be paid does not
/// cost the node a call on every recovery scan).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldBackoff {
    pub first: Duration,
    pub max: Duration,
}

impl HoldBackoff {
    pub const DEFAULT: HoldBackoff = HoldBackoff {
        first: Duration::from_secs(10),
        max: Duration::from_secs(120),
    };

    /// The wait after the `attempts`-th hold (1 for the first; 0 is taken as 1).
    pub fn after(&self, attempts: i32) -> Duration {
        let doublings = u32::try_from(attempts.saturating_sub(1))
            .unwrap_or(0)
            .min(31);
        self.first
            .checked_mul(1u32 << doublings)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// [`HoldBackoff::after`] in milliseconds, as bound to SQL.
    pub fn after_ms(&self, attempts: i32) -> i64 {
        i64::try_from(self.after(attempts).as_millis()).unwrap_or(i64::MAX)
    }
}

/// The reason recorded on a request held alone (`managed_tx.hold_reason`).
pub fn request_hold_reason(node_reason: &str) -> String {
    format!("the signer cannot pay for this request now: {node_reason}")
}

/// A recorded request with the `request_id` a chained request depends on (its parent), as the
/// allocator reads it: any chain, any signer. Several requests may carry one `request_id` (it is
/// unique per chain and signer only); every one of them counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    pub tx_id: Uuid,
    pub chain_id: ChainId,
    pub signer: String,
    pub state: TxState,
    /// `confirmed_at` is set: final at the required depth (CONFIRMED, or REVERTED settled).
    pub settled: bool,
    /// `reorged_at` is set: a reorg deeper than the required depth undid it, and its outcome is
    /// being re-evaluated.
    pub reorged: bool,
    /// `failure_code` and `failure_reason`, for a FAILED one.
    pub failure: Option<(String, String)>,
}

/// Whether a chained request may go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dependency {
    /// Every parent is CONFIRMED and not undone by a reorg: the request goes on like any other.
    Met,
    /// Not yet (no parent recorded, or one still on its way): it stays RECEIVED, holding no
    /// nonce, and is looked at again on the signer's next drive (at the latest the next recovery
    /// scan).
    Wait { why: String },
    /// A parent failed: FAILED with [`FailureCode::DependencyFailed`] and this reason.
    Failed { reason: String },
}

/// What one parent's row says about it.
enum ParentOutcome {
    Confirmed,
    Failed(String),
    OnItsWay(String),
}

fn parent_outcome(p: &Parent) -> ParentOutcome {
    let which = format!(
        "transaction {} (signer {}, chain {})",
        p.tx_id, p.signer, p.chain_id
    );
    match p.state {
        TxState::Confirmed if !p.reorged => ParentOutcome::Confirmed,
        TxState::Failed => ParentOutcome::Failed(match &p.failure {
            Some((code, reason)) => format!("{which} is FAILED: {code}: {reason}"),
            None => format!("{which} is FAILED"),
        }),
        // A revert is final once settled at depth; before that a reorg may still send it back.
        TxState::Reverted if p.settled && !p.reorged => {
            ParentOutcome::Failed(format!("{which} reverted on chain"))
        }
        TxState::Confirmed | TxState::Reverted => ParentOutcome::OnItsWay(format!(
            "{which} is {}, undone by a deep reorg or not settled yet",
            p.state
        )),
        TxState::Received
        | TxState::Simulated
        | TxState::PendingApproval
        | TxState::Allocated
        | TxState::Signed
        | TxState::Submitted
        | TxState::Mined
        | TxState::Replaced => ParentOutcome::OnItsWay(format!("{which} is {}", p.state)),
    }
}

/// Whether a request that depends on `parent_request_id` may go on, given every recorded
/// request with that id (`parents`): it fails as soon as one of them failed, goes on once all of
/// them are CONFIRMED (and at least one is recorded), and waits otherwise — a parent not yet
/// received is not a failure (it may still arrive).
pub fn dependency(parent_request_id: &str, parents: &[Parent]) -> Dependency {
    let outcomes: Vec<ParentOutcome> = parents.iter().map(parent_outcome).collect();
    if let Some(why) = outcomes.iter().find_map(|o| match o {
        ParentOutcome::Failed(why) => Some(why),
        ParentOutcome::Confirmed | ParentOutcome::OnItsWay(_) => None,
    }) {
        return Dependency::Failed {
            reason: format!("depends on request {parent_request_id:?}, which failed: {why}"),
        };
    }
    if let Some(why) = outcomes.iter().find_map(|o| match o {
        ParentOutcome::OnItsWay(why) => Some(why),
        ParentOutcome::Confirmed | ParentOutcome::Failed(_) => None,
    }) {
        return Dependency::Wait {
            why: format!("waits for request {parent_request_id:?} to be CONFIRMED: {why}"),
        };
    }
    if outcomes.is_empty() {
        return Dependency::Wait {
            why: format!(
                "waits for request {parent_request_id:?} to be CONFIRMED: it is not recorded yet"
            ),
        };
    }
    Dependency::Met
}

/// Whether an allocation must first align the cursor with the chain's nonce: when the cursor was
/// not synced within `nonce.state_timeout`, or a transaction of the signer was REPLACED (its
/// nonce was used outside txflow, so the cursor is behind the chain).
pub fn needs_chain_nonce(cursor_fresh: bool, replaced: bool) -> bool {
    !cursor_fresh || replaced
}

/// The block whose nonce the cursor is aligned with: the last final one, `required - 1` below
/// the head (the head itself for 0 or 1). A nonce used outside txflow in a later block may be
/// reorged out; aligning past it would leave a nonce nobody fills. Taken as final's, the nonce
/// is sent, found used in a block not final, and kept until that block is final (then
/// REPLACED) or gone (then mined).
pub fn alignment_block(head: u64, required: u32) -> u64 {
    head.saturating_sub(u64::from(required.saturating_sub(1)))
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

/// A chain nonce as the cursor stores it (`BIGINT`): a nonce beyond `i64::MAX`
/// cannot be represented and is never silently capped (aligning to a wrong nonce would send
/// transactions the chain can never mine).
pub fn chain_nonce(n: u64) -> Result<i64, OutOfRange> {
    i64::try_from(n).map_err(|_| OutOfRange::ChainNonce(n))
}

/// How many nonces to ask the cursor for, for `rows` transactions.
pub fn allocation_count(rows: usize) -> Result<u32, OutOfRange> {
    u32::try_from(rows).map_err(|_| OutOfRange::Count(rows))
}

/// How many of `queued` transactions waiting for a nonce to allocate now, when `in_flight` of
/// the signer's nonces are allocated and not mined yet (ALLOCATED, SIGNED, SUBMITTED) and at
/// most `max_in_flight` may be (`nonce.max_in_flight`, seed 003's in-flight budget): the room
/// left, never negative (a reorg can take `in_flight` above the budget: nothing is allocated
/// until mining brings it back under), and at most [`MAX_ALLOCATIONS_PER_DRIVE`]. The others
/// stay queued without a nonce; a later drive allocates them as mining frees the budget.
pub fn within_budget(queued: usize, in_flight: i64, max_in_flight: u32) -> usize {
    let room = i64::from(max_in_flight)
        .saturating_sub(in_flight.max(0))
        .clamp(0, MAX_ALLOCATIONS_PER_DRIVE);
    queued.min(usize::try_from(room).unwrap_or(0))
}

/// The reason of an `APPROVAL_TIMEOUT` failure (seed 000 §4.1), naming the timeout.
pub fn approval_timeout_reason(timeout: std::time::Duration) -> String {
    format!(
        "no operator approved or cancelled it within approval.timeout ({} ms)",
        timeout.as_millis()
    )
}

/// How many released nonces to fill with no-ops in one drive: the count read, never negative,
/// at most [`MAX_NOOPS_PER_DRIVE`] (the rest in the next drive).
pub fn noops_to_fill(released: i64) -> u32 {
    u32::try_from(released.clamp(0, i64::from(MAX_NOOPS_PER_DRIVE))).unwrap_or(0)
}

/// Why a transaction cannot be allocated as recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocationError {
    #[error("the recorded {0} is not valid")]
    Corrupt(&'static str),
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
}

/// The most a transaction can cost its signer: `gas_limit × max_fee_per_gas + value`, checked.
pub fn max_cost(gas_limit: u64, max_fee_per_gas: u128, value: U256) -> Result<U256, OutOfRange> {
    U256::from(gas_limit)
        .checked_mul(U256::from(max_fee_per_gas))
        .and_then(|gas| gas.checked_add(value))
        .ok_or(OutOfRange::MaxCost {
            gas_limit,
            max_fee_per_gas,
            value,
        })
}

/// The numbers of a payload as an allocation announces them, checked to be representable: the
/// gas limit as the event's `long`, the data as bytes, and the maximum cost in 256 bits.
pub fn allocatable(p: &TxPayload) -> Result<(i64, Vec<u8>), AllocationError> {
    let gas = p.gas_limit.unwrap_or(TRANSFER_GAS);
    let gas_limit = i64::try_from(gas).map_err(|_| OutOfRange::GasLimit(gas))?;
    let value =
        U256::from_str_radix(&p.value, 10).map_err(|_| AllocationError::Corrupt("value"))?;
    let fee = |f: &Option<String>, name| -> Result<Option<u128>, AllocationError> {
        f.as_deref()
            .map(|v| {
                v.parse::<u128>()
                    .map_err(|_| AllocationError::Corrupt(name))
            })
            .transpose()
    };
    let max_fee = fee(&p.max_fee_per_gas, "max_fee_per_gas")?;
    fee(&p.max_priority_fee_per_gas, "max_priority_fee_per_gas")?;
    max_cost(gas, max_fee.unwrap_or(0), value)?;
    let data = hex::decode(p.data.trim_start_matches("0x"))
        .map_err(|_| AllocationError::Corrupt("data"))?;
    Ok((gas_limit, data))
}

/// The announcement of an allocation (the row holds the same values), if the payload is
/// [`allocatable`].
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
) -> Result<TxAllocated, AllocationError> {
    let (gas_limit, data) = allocatable(p)?;
    Ok(TxAllocated {
        event_id,
        tx_id,
        request_id,
        chain_id,
        signer: signer.as_str().to_string(),
        nonce,
        to: p.to.clone(),
        value: p.value.clone(),
        data,
        gas_limit,
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
        gas_limit: Some(TRANSFER_GAS),
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
/// Four eyes: an APPROVE by the principal that submitted the transaction is refused
/// (`SELF_APPROVAL`), whatever reached the topic; the gateway refuses it first.
pub fn four_eyes(c: &TxCommand, submitted_by: Option<&str>) -> Option<Rejection> {
    (c.command == TxCommandKind::Approve && submitted_by == Some(c.requested_by.as_str())).then(
        || {
            Rejection::new(
                "SELF_APPROVAL",
                format!(
                    "APPROVE of transaction {} by {}, who submitted it: another principal must approve",
                    c.tx_id, c.requested_by
                ),
            )
        },
    )
}

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
            depends_on_request_id: None,
            depends_on_signer: None,
            submitted_by: None,
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
                "cannot pay: held (alone or with the signer, signer_funds decides)",
                payload(TO, "5"),
                Ok(Simulation::InsufficientFunds {
                    reason: "insufficient funds".into(),
                }),
                AfterSimulation::CannotPay {
                    reason: "insufficient funds".into(),
                },
            ),
            (
                "a node's absurd estimate: failed with its reason, never wrapped",
                payload(TO, "5"),
                ok(u64::MAX),
                AfterSimulation::Fail {
                    code: FailureCode::SimulationFailed,
                    reason: format!(
                        "the node's gas estimate {} is above the gas limit cap of 30000000",
                        u64::MAX
                    ),
                },
            ),
            (
                "an estimate whose 20% would pass the cap: capped",
                payload(TO, "5"),
                ok(29_000_000),
                AfterSimulation::Simulated(with_gas(payload(TO, "5"), 30_000_000)),
            ),
            (
                "an estimate of zero: at least a transfer's gas",
                payload(TO, "5"),
                ok(0),
                AfterSimulation::Simulated(with_gas(payload(TO, "5"), 21_000)),
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
    fn gas_limits_from_the_node_are_checked_and_capped() {
        let cap = 30_000_000;
        type Case = (&'static str, Option<u64>, u64, Result<u64, OutOfRange>);
        let cases: [Case; 7] = [
            ("estimate + 20%", None, 100_000, Ok(120_000)),
            ("requested limit kept", Some(50_000), u64::MAX, Ok(50_000)),
            ("floor", None, 0, Ok(21_000)),
            ("at the cap", None, cap, Ok(cap)),
            ("20% over the cap: capped", None, cap - 1, Ok(cap)),
            (
                "above the cap",
                None,
                cap + 1,
                Err(OutOfRange::GasEstimate {
                    estimate: cap + 1,
                    cap,
                }),
            ),
            (
                "u64::MAX (would overflow + 20%)",
                None,
                u64::MAX,
                Err(OutOfRange::GasEstimate {
                    estimate: u64::MAX,
                    cap,
                }),
            ),
        ];
        for (name, requested, estimate, want) in cases {
            assert_eq!(gas_limit(requested, estimate), want, "{name}");
        }
    }

    #[test]
    fn the_cursor_is_aligned_with_the_last_final_block() {
        assert_eq!(alignment_block(100, 0), 100);
        assert_eq!(alignment_block(100, 1), 100);
        assert_eq!(alignment_block(100, 3), 98, "two blocks above it");
        assert_eq!(alignment_block(1, 12), 0, "never below the genesis block");
    }

    #[test]
    fn numbers_from_the_node_that_cannot_be_represented_are_typed_errors() {
        assert_eq!(chain_nonce(7), Ok(7));
        assert_eq!(chain_nonce(i64::MAX as u64), Ok(i64::MAX));
        assert_eq!(chain_nonce(u64::MAX), Err(OutOfRange::ChainNonce(u64::MAX)));
        assert_eq!(allocation_count(3), Ok(3));
        assert_eq!(
            allocation_count(usize::MAX),
            Err(OutOfRange::Count(usize::MAX))
        );
        type Case = (&'static str, i64, u32);
        let noops: [Case; 4] = [
            ("none", 0, 0),
            ("some", 3, 3),
            ("never negative", -1, 0),
            ("capped per drive", i64::MAX, MAX_NOOPS_PER_DRIVE),
        ];
        for (name, released, want) in noops {
            assert_eq!(noops_to_fill(released), want, "{name}");
        }
        assert_eq!(max_cost(21_000, 2, U256::from(5)), Ok(U256::from(42_005)));
        assert_eq!(
            max_cost(u64::MAX, u128::MAX, U256::ZERO),
            Ok(U256::from(u64::MAX) * U256::from(u128::MAX))
        );
        assert_eq!(
            max_cost(1, 1, U256::MAX),
            Err(OutOfRange::MaxCost {
                gas_limit: 1,
                max_fee_per_gas: 1,
                value: U256::MAX
            })
        );
        // The funds probe's value: the gas of a transfer at the fee, at least 1 wei, even at the
        // largest fee a node could name.
        assert_eq!(funds_probe_value(2), U256::from(42_000));
        assert_eq!(funds_probe_value(0), U256::from(1));
        assert_eq!(
            funds_probe_value(u128::MAX),
            U256::from(21_000) * U256::from(u128::MAX)
        );
    }

    #[test]
    fn an_allocation_checks_the_recorded_numbers() {
        let s = Signer::parse(TO).expect("signer");
        let event =
            |p: &TxPayload| allocated_event("e".into(), "t".into(), "r".into(), 1, &s, 4, p, 3);
        let fine = TxPayload {
            gas_limit: Some(21_000),
            max_fee_per_gas: Some("9".into()),
            max_priority_fee_per_gas: Some("2".into()),
            ..payload(TO, "5")
        };
        type Change = fn(&mut TxPayload);
        let cases: [(&str, Change, Option<AllocationError>); 7] = [
            ("as recorded", |_| {}, None),
            (
                "a gas limit beyond a long",
                |p| p.gas_limit = Some(u64::MAX),
                Some(AllocationError::OutOfRange(OutOfRange::GasLimit(u64::MAX))),
            ),
            (
                "a maximum cost beyond 256 bits",
                |p| p.value = U256::MAX.to_string(),
                Some(AllocationError::OutOfRange(OutOfRange::MaxCost {
                    gas_limit: 21_000,
                    max_fee_per_gas: 9,
                    value: U256::MAX,
                })),
            ),
            (
                "a value that is no number",
                |p| p.value = "lots".into(),
                Some(AllocationError::Corrupt("value")),
            ),
            (
                "a fee beyond u128",
                |p| p.max_fee_per_gas = Some(U256::MAX.to_string()),
                Some(AllocationError::Corrupt("max_fee_per_gas")),
            ),
            (
                "a tip that is no number",
                |p| p.max_priority_fee_per_gas = Some("-1".into()),
                Some(AllocationError::Corrupt("max_priority_fee_per_gas")),
            ),
            (
                "data that is not hex",
                |p| p.data = "0xzz".into(),
                Some(AllocationError::Corrupt("data")),
            ),
        ];
        for (name, change, want) in cases {
            let mut p = fine.clone();
            change(&mut p);
            assert_eq!(event(&p).err(), want, "{name}");
        }
    }

    #[test]
    fn the_signer_is_held_only_when_it_can_pay_for_none_of_its_requests() {
        let cannot = || AfterSimulation::CannotPay {
            reason: "insufficient funds for transfer".into(),
        };
        let fine = AfterSimulation::Simulated(payload(TO, "1"));
        let short = |reason: &str| {
            Ok(Simulation::InsufficientFunds {
                reason: reason.into(),
            })
        };
        let err = |transient| {
            Err(SimError {
                transient,
                message: "probe: boom".into(),
            })
        };
        type Case = (
            &'static str,
            Vec<AfterSimulation>,
            Option<SimResult>,
            SignerFunds,
        );
        let cases: Vec<Case> = vec![
            (
                "nothing short",
                vec![fine.clone()],
                None,
                SignerFunds::Enough,
            ),
            ("no request at all", vec![], None, SignerFunds::Enough),
            (
                "one short among payable ones, the probe passes: that one alone",
                vec![fine.clone(), cannot(), fine.clone()],
                Some(Ok(Simulation::Ok { gas: 21_000 })),
                SignerFunds::HoldRequests,
            ),
            (
                "every one short but gas is payable: each alone (their values are the problem)",
                vec![cannot(), cannot()],
                Some(Ok(Simulation::Ok { gas: 21_000 })),
                SignerFunds::HoldRequests,
            ),
            (
                "the probe reverted: it ran, so gas is payable",
                vec![cannot()],
                Some(Ok(Simulation::Reverts {
                    reason: "execution reverted".into(),
                })),
                SignerFunds::HoldRequests,
            ),
            (
                "a node error on the probe says nothing about funds: requests alone",
                vec![cannot()],
                Some(err(false)),
                SignerFunds::HoldRequests,
            ),
            (
                "the balance cannot pay a transfer's gas: the signer",
                vec![cannot(), cannot(), cannot()],
                Some(short("Insufficient funds for gas * price + value")),
                SignerFunds::HoldSigner {
                    reason: "the balance cannot pay the gas of a plain transfer: \
                             Insufficient funds for gas * price + value"
                        .into(),
                },
            ),
            (
                "the balance cannot pay gas even though others simulated: the signer",
                vec![fine.clone(), cannot()],
                Some(short("insufficient funds")),
                SignerFunds::HoldSigner {
                    reason:
                        "the balance cannot pay the gas of a plain transfer: insufficient funds"
                            .into(),
                },
            ),
            (
                "short and no probe made: the signer (nothing shows it can pay)",
                vec![cannot()],
                None,
                SignerFunds::HoldSigner {
                    reason: "insufficient funds for transfer".into(),
                },
            ),
            (
                "the probe's node unavailable: the drive again later",
                vec![cannot()],
                Some(err(true)),
                SignerFunds::Retry {
                    reason: "probe: boom".into(),
                },
            ),
        ];
        for (name, decisions, probe, want) in cases {
            assert_eq!(
                needs_funds_probe(&decisions),
                decisions.contains(&cannot()),
                "{name}"
            );
            assert_eq!(signer_funds(&decisions, probe.as_ref()), want, "{name}");
        }
    }

    #[test]
    fn a_request_held_alone_backs_off_doubling_up_to_the_maximum() {
        let b = HoldBackoff::DEFAULT;
        let secs = Duration::from_secs;
        let cases: [(i32, Duration); 9] = [
            (i32::MIN, secs(10)),
            (0, secs(10)),
            (1, secs(10)),
            (2, secs(20)),
            (3, secs(40)),
            (4, secs(80)),
            (5, secs(120)),
            (40, secs(120)),
            (i32::MAX, secs(120)),
        ];
        for (attempts, want) in cases {
            assert_eq!(b.after(attempts), want, "after {attempts} holds");
        }
        assert_eq!(b.after_ms(2), 20_000);
        let huge = HoldBackoff {
            first: Duration::MAX,
            max: Duration::MAX,
        };
        assert_eq!(huge.after(3), Duration::MAX, "no overflow");
        assert_eq!(huge.after_ms(3), i64::MAX);
        assert!(
            request_hold_reason("insufficient funds")
                .ends_with("cannot pay for this request now: insufficient funds")
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
            (
                |r| r.depends_on_request_id = Some(r.request_id.clone()),
                "SELF_DEPENDENCY",
            ),
            (
                |r| r.depends_on_request_id = Some(String::new()),
                "INVALID_DEPENDS_ON_REQUEST_ID",
            ),
            (
                |r| r.depends_on_request_id = Some("p".repeat(65)),
                "INVALID_DEPENDS_ON_REQUEST_ID",
            ),
            (
                // Its own signer named: still itself.
                |r| {
                    r.depends_on_request_id = Some(r.request_id.clone());
                    r.depends_on_signer = Some(r.signer.to_uppercase().replace("0X", "0x"));
                },
                "SELF_DEPENDENCY",
            ),
            (
                |r| {
                    r.depends_on_request_id = Some("p".into());
                    r.depends_on_signer = Some("0x1234".into());
                },
                "INVALID_DEPENDS_ON_SIGNER",
            ),
            (
                |r| r.depends_on_signer = Some(r.signer.clone()),
                "INVALID_DEPENDS_ON_SIGNER",
            ),
        ];
        for (mutate, want) in cases {
            let mut r = ok();
            mutate(&mut r);
            assert_eq!(code(r), want);
        }
    }

    fn parent(state: TxState) -> Parent {
        Parent {
            tx_id: Uuid::from_u128(7),
            chain_id: ChainId(10),
            signer: TO.into(),
            state,
            settled: matches!(state, TxState::Confirmed),
            reorged: false,
            failure: None,
        }
    }

    fn verdict(d: &Dependency) -> &'static str {
        match d {
            Dependency::Met => "met",
            Dependency::Wait { .. } => "wait",
            Dependency::Failed { .. } => "failed",
        }
    }

    #[test]
    fn a_chained_request_goes_on_once_its_parent_is_confirmed_and_fails_with_it() {
        // One parent, in every state: only CONFIRMED lets it go on, only FAILED fails it (a
        // revert fails it once settled, below); every other state is a parent on its way.
        for state in TxState::ALL {
            let want = match state {
                TxState::Confirmed => "met",
                TxState::Failed => "failed",
                TxState::Received
                | TxState::Simulated
                | TxState::PendingApproval
                | TxState::Allocated
                | TxState::Signed
                | TxState::Submitted
                | TxState::Mined
                | TxState::Reverted
                | TxState::Replaced => "wait",
            };
            let d = dependency("hop-1", &[parent(state)]);
            assert_eq!(verdict(&d), want, "a parent in {state}: {d:?}");
        }
        let with = |state, settled, reorged| Parent {
            settled,
            reorged,
            ..parent(state)
        };
        type Case = (&'static str, Vec<Parent>, &'static str);
        let cases: Vec<Case> = vec![
            (
                "no parent recorded yet: waits (it may still arrive)",
                vec![],
                "wait",
            ),
            (
                "confirmed, then undone by a deep reorg: waits for the re-evaluation",
                vec![with(TxState::Confirmed, true, true)],
                "wait",
            ),
            (
                "reverted, not settled: a reorg may still send it back",
                vec![with(TxState::Reverted, false, false)],
                "wait",
            ),
            (
                "reverted and settled at depth: failed",
                vec![with(TxState::Reverted, true, false)],
                "failed",
            ),
            (
                "reverted, settled, then undone by a deep reorg: waits",
                vec![with(TxState::Reverted, true, true)],
                "wait",
            ),
            (
                "two requests with the id, one still on its way: waits for both",
                vec![parent(TxState::Confirmed), parent(TxState::Submitted)],
                "wait",
            ),
            (
                "two requests with the id, both confirmed: goes on",
                vec![parent(TxState::Confirmed), parent(TxState::Confirmed)],
                "met",
            ),
            (
                "two requests with the id, one failed: failed, whatever the other",
                vec![parent(TxState::Mined), parent(TxState::Failed)],
                "failed",
            ),
        ];
        for (name, parents, want) in cases {
            let d = dependency("hop-1", &parents);
            assert_eq!(verdict(&d), want, "{name}: {d:?}");
        }
        // The reasons name the parent request, its transaction, signer and chain, and why.
        let failed = Parent {
            failure: Some(("POLICY_DENIED".into(), "value above the limit".into())),
            ..parent(TxState::Failed)
        };
        assert_eq!(
            dependency("hop-1", &[failed]),
            Dependency::Failed {
                reason: format!(
                    "depends on request \"hop-1\", which failed: transaction {} (signer {TO}, \
                     chain 10) is FAILED: POLICY_DENIED: value above the limit",
                    Uuid::from_u128(7)
                )
            }
        );
        let Dependency::Failed { reason } =
            dependency("hop-1", &[with(TxState::Reverted, true, false)])
        else {
            panic!("a settled revert fails the child");
        };
        assert!(reason.ends_with("reverted on chain"), "{reason}");
        assert_eq!(
            dependency("hop-1", &[]),
            Dependency::Wait {
                why: "waits for request \"hop-1\" to be CONFIRMED: it is not recorded yet".into()
            }
        );
        let Dependency::Wait { why } = dependency("hop-1", &[parent(TxState::Mined)]) else {
            panic!("waits");
        };
        assert!(
            why.contains("\"hop-1\"") && why.ends_with("is MINED"),
            "{why}"
        );
    }

    #[test]
    fn the_in_flight_budget_caps_what_one_drive_allocates() {
        type Case = (&'static str, usize, i64, u32, usize);
        let cases: [Case; 9] = [
            ("room for all", 10, 0, 64, 10),
            ("the room left, not more", 200, 0, 16, 16),
            ("part of the budget in flight", 200, 10, 16, 6),
            ("at the budget: waits", 200, 16, 16, 0),
            (
                "above the budget (a reorg): waits, never negative",
                5,
                20,
                16,
                0,
            ),
            ("nothing queued", 0, 0, 16, 0),
            ("a corrupt negative count counts as none", 3, -5, 2, 2),
            ("one nonce", 3, 0, 1, 1),
            (
                "never more than a drive allocates",
                usize::MAX,
                0,
                u32::MAX,
                MAX_ALLOCATIONS_PER_DRIVE as usize,
            ),
        ];
        for (name, queued, in_flight, max, want) in cases {
            assert_eq!(within_budget(queued, in_flight, max), want, "{name}");
        }
        // Budget freed by mining: the next drive allocates exactly what was freed.
        assert_eq!(within_budget(184, 16 - 5, 16), 5);
    }

    #[test]
    fn a_request_names_another_request_as_its_parent() {
        let mut r = ok();
        r.depends_on_request_id = Some("hop-0".into());
        let v = validate(&r, ChainId(31337)).expect("valid");
        assert_eq!(v.depends_on_request_id.as_deref(), Some("hop-0"));
        assert_eq!(
            v.depends_on_signer,
            Some(v.signer.clone()),
            "its own signer's request when it names no signer"
        );
        let none = validate(&ok(), ChainId(31337)).expect("valid");
        assert_eq!(
            (none.depends_on_request_id, none.depends_on_signer),
            (None, None)
        );
        // Another signer's request, named with the signer; the same id as its own is another
        // request then.
        let mut r = ok();
        r.depends_on_request_id = Some(r.request_id.clone());
        r.depends_on_signer = Some("0x70997970C51812dc3A010C7d01b50e0d17dc79C8".into());
        let v = validate(&r, ChainId(31337)).expect("valid");
        assert_eq!(
            v.depends_on_signer.as_ref().map(Signer::as_str),
            Some("0x70997970c51812dc3a010c7d01b50e0d17dc79c8"),
            "normalised to lowercase"
        );
    }

    #[test]
    fn only_another_principal_may_approve() {
        let c = |kind, by: &str| TxCommand {
            event_id: "e".into(),
            tx_id: "t".into(),
            chain_id: 31337,
            signer: "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266".into(),
            command: kind,
            requested_by: by.into(),
            reason: None,
        };
        let refused = four_eyes(&c(TxCommandKind::Approve, "svc-a"), Some("svc-a"));
        assert_eq!(refused.map(|r| r.code), Some("SELF_APPROVAL".to_string()));
        assert_eq!(
            four_eyes(&c(TxCommandKind::Approve, "op-1"), Some("svc-a")),
            None
        );
        assert_eq!(four_eyes(&c(TxCommandKind::Approve, "svc-a"), None), None);
        assert_eq!(
            four_eyes(&c(TxCommandKind::Cancel, "svc-a"), Some("svc-a")),
            None
        );
    }
}
