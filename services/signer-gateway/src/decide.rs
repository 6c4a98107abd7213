//! What the signer gateway does with one transaction. Pure: no I/O, no database, no clock; the
//! handler loads the inputs and carries the decision out.
//!
//! The row is the truth (a decision to sign or fail is recorded only if the row, locked when the
//! result is written, is still as it was read); the TxAllocated event, when there is one, only
//! says which transaction to sign and must agree with the row. In order:
//! 1. no row: an event about it is dead-lettered (`UNKNOWN_TX`); a scan has nothing to do;
//! 2. the state: ALLOCATED goes on; a state with a persisted attempt re-announces its TxSigned
//!    (an attempt is never signed twice); any other state has nothing to sign;
//! 3. a payload that does not parse, or a field that is not valid: FAILED (`SIGNING_FAILED`);
//! 4. an event that disagrees with the row: dead-lettered (`ALLOCATION_MISMATCH`);
//! 5. the policy again (a no-op filling a released nonce is exempt, an approval recorded in
//!    `approved_by` satisfies the threshold): FAILED (`POLICY_DENIED`);
//! 6. no key for the signer: FAILED (`NO_SIGNING_KEY`);
//! 7. otherwise: sign.
//!
//! Every FAILED here releases the nonce (the move FAIL_ALLOCATED).

use alloy::primitives::{Address, Bytes, U256};
use txflow_core::chain::UnsignedTx;
use txflow_core::domain::{ChainId, Signer, TxPayload};
use txflow_core::events::{TxAllocated, TxSigned};
use txflow_core::failure::FailureCode;
use txflow_core::policy::{Policy, Verdict};
use txflow_core::stage::Rejection;
use txflow_core::state::TxState;
use txflow_core::txstore::{Kind, TxRow};
use uuid::Uuid;

/// Everything a decision about one transaction depends on.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    pub tx_id: Uuid,
    /// The chain and signer of the lease (the row was read for them).
    pub chain_id: ChainId,
    pub signer: &'a Signer,
    /// The row, if the signer has a transaction `tx_id` on the chain.
    pub row: Option<&'a TxRow>,
    /// The TxAllocated that asked for it; `None` on a recovery scan.
    pub claimed: Option<&'a TxAllocated>,
    pub policy: &'a Policy,
    /// Whether this gateway has a key for the signer.
    pub has_key: bool,
}

/// What to do with one transaction.
#[derive(Debug)]
pub enum Decision<'k> {
    /// ALLOCATED → SIGNED: sign `tx` with the signer's key, persist the attempt, announce
    /// TxSigned.
    Sign {
        row: &'k TxRow,
        nonce: i64,
        tx: UnsignedTx,
    },
    /// Signed before: announce the stored TxSigned again (same `event_id`).
    Reannounce,
    /// Nothing to sign, nothing to announce.
    Nothing,
    /// Dead-letter the message; nothing is written.
    Reject(Rejection),
    /// ALLOCATED → FAILED with `code`, the nonce released, TxFailed announced.
    Fail {
        row: &'k TxRow,
        nonce: i64,
        code: FailureCode,
        reason: String,
    },
}

/// The decision for one transaction.
pub fn decide<'a>(i: &Input<'a>) -> Decision<'a> {
    let Some(row) = i.row else {
        return match i.claimed {
            Some(_) => Decision::Reject(Rejection::new(
                "UNKNOWN_TX",
                format!(
                    "no transaction {} of {} on chain {}",
                    i.tx_id, i.signer, i.chain_id.0
                ),
            )),
            None => Decision::Nothing,
        };
    };
    match row.state {
        TxState::Allocated => {}
        // A persisted attempt is never signed again: re-announce it.
        TxState::Signed
        | TxState::Submitted
        | TxState::Mined
        | TxState::Confirmed
        | TxState::Reverted => return Decision::Reannounce,
        // Not allocated yet, failed, or waiting for a new nonce: nothing to sign.
        TxState::Received
        | TxState::Simulated
        | TxState::PendingApproval
        | TxState::Replaced
        | TxState::Failed => return Decision::Nothing,
    }
    let Some(nonce) = row.nonce else {
        return Decision::Nothing;
    };
    let fail = |code, reason: String| Decision::Fail {
        row,
        nonce,
        code,
        reason,
    };
    let payload: TxPayload = match serde_json::from_value(row.payload.clone()) {
        Ok(p) => p,
        Err(e) => {
            return fail(
                FailureCode::SigningFailed,
                format!("the recorded payload is not valid: {e}"),
            );
        }
    };
    if let Some(a) = i.claimed
        && let Some(field) = mismatch(a, Some(nonce), &payload)
    {
        return Decision::Reject(Rejection::new(
            "ALLOCATION_MISMATCH",
            format!(
                "the event's {field} differs from the recorded transaction {}",
                i.tx_id
            ),
        ));
    }
    let tx = match unsigned_tx(i.chain_id.0, nonce, &payload) {
        Ok(tx) => tx,
        Err(field) => {
            return fail(
                FailureCode::SigningFailed,
                format!("the recorded {field} is not valid"),
            );
        }
    };
    if let Some(reason) = refusal(i.policy, row, i.signer, &tx) {
        return fail(FailureCode::PolicyDenied, reason);
    }
    if !i.has_key {
        return fail(
            FailureCode::NoSigningKey,
            format!("this signer gateway has no key for {}", i.signer),
        );
    }
    Decision::Sign { row, nonce, tx }
}

/// Why the policy refuses `tx` now, if it does. A no-op (a 0-value self-transfer filling a
/// released nonce) is txflow's own and needs no policy; an approval recorded on the row satisfies
/// the approval threshold, never the whitelist or the value limit.
pub fn refusal(policy: &Policy, row: &TxRow, signer: &Signer, tx: &UnsignedTx) -> Option<String> {
    let own_noop = row.kind == Kind::Noop
        && tx.value.is_zero()
        && signer.as_str().parse::<Address>().is_ok_and(|a| a == tx.to);
    if own_noop {
        return None;
    }
    match policy.check(tx.to, tx.value) {
        Verdict::Allow => None,
        Verdict::NeedsApproval if row.approved_by.is_some() => None,
        Verdict::NeedsApproval => Some(format!(
            "value {} wei needs an approval and the transaction has none",
            tx.value
        )),
        Verdict::Deny(reason) => Some(reason),
    }
}

/// The highest gas limit signed: the allocator's cap (a block's gas; the allocator never records
/// more, requested or estimated). A recorded limit above it could never be mined.
pub const MAX_GAS_LIMIT: u64 = 30_000_000;

/// The transaction to sign from the recorded payload, or the name of the field that is not valid.
/// Its numbers came from the node (gas estimate, fees) and are checked: a gas limit of 0 or above
/// [`MAX_GAS_LIMIT`] is `"gas_limit"`, and a maximum cost (`gas_limit × max_fee_per_gas + value`)
/// that does not fit 256 bits is `"maximum cost"`.
pub fn unsigned_tx(chain_id: i64, nonce: i64, p: &TxPayload) -> Result<UnsignedTx, &'static str> {
    let tx = UnsignedTx {
        chain_id: u64::try_from(chain_id).map_err(|_| "chain id")?,
        nonce: u64::try_from(nonce).map_err(|_| "nonce")?,
        to: p.to.parse::<Address>().map_err(|_| "to")?,
        value: U256::from_str_radix(&p.value, 10).map_err(|_| "value")?,
        data: Bytes::from(hex::decode(p.data.trim_start_matches("0x")).map_err(|_| "data")?),
        gas_limit: p
            .gas_limit
            .filter(|g| (1..=MAX_GAS_LIMIT).contains(g))
            .ok_or("gas_limit")?,
        max_fee_per_gas: p
            .max_fee_per_gas
            .as_deref()
            .ok_or("max_fee_per_gas")?
            .parse()
            .map_err(|_| "max_fee_per_gas")?,
        max_priority_fee_per_gas: p
            .max_priority_fee_per_gas
            .as_deref()
            .ok_or("max_priority_fee_per_gas")?
            .parse()
            .map_err(|_| "max_priority_fee_per_gas")?,
    };
    max_cost(&tx).ok_or("maximum cost")?;
    Ok(tx)
}

/// The most `tx` can cost its signer, `gas_limit × max_fee_per_gas + value`; `None` when it does
/// not fit 256 bits.
pub fn max_cost(tx: &UnsignedTx) -> Option<U256> {
    U256::from(tx.gas_limit)
        .checked_mul(U256::from(tx.max_fee_per_gas))?
        .checked_add(tx.value)
}

/// The first field in which the event disagrees with the recorded transaction.
pub fn mismatch(a: &TxAllocated, nonce: Option<i64>, p: &TxPayload) -> Option<&'static str> {
    let data = hex::decode(p.data.trim_start_matches("0x")).ok();
    if nonce != Some(a.nonce) {
        Some("nonce")
    } else if !a.to.eq_ignore_ascii_case(&p.to) {
        Some("to")
    } else if a.value != p.value {
        Some("value")
    } else if data.as_deref() != Some(a.data.as_slice()) {
        Some("data")
    } else if p.gas_limit.and_then(|g| i64::try_from(g).ok()) != Some(a.gas_limit) {
        Some("gas_limit")
    } else if p.max_fee_per_gas.as_deref() != Some(a.max_fee_per_gas.as_str()) {
        Some("max_fee_per_gas")
    } else if p.max_priority_fee_per_gas.as_deref() != Some(a.max_priority_fee_per_gas.as_str()) {
        Some("max_priority_fee_per_gas")
    } else {
        None
    }
}

/// The attempt number of a new signature: 1, or the next one after the transaction's highest
/// recorded attempt (a transaction re-allocated after REPLACED).
/// Never overflows: at `i32::MAX` it stays there, and the attempt row (unique per transaction and
/// number) is then refused by the database rather than wrapping to a negative number.
pub fn next_attempt(highest: Option<i32>) -> i32 {
    highest.unwrap_or(0).max(0).saturating_add(1)
}

/// The TxSigned to re-announce among the stored ones: the latest attempt's.
pub fn latest_signed(stored: impl IntoIterator<Item = TxSigned>) -> Option<TxSigned> {
    stored.into_iter().max_by_key(|s| s.attempt)
}

// ---- The defensive cancellation (seed 000 §4.4) ----
//
// A reorg deeper than the required depth undid a final transaction (the confirmation manager set
// `managed_tx.reorged_at`): its original may still sit in some node's pool and be mined at any
// time. Before its outcome is rolled back, its nonce is made to go one way for sure: a 0-value
// transfer to the signer itself at that nonce, priced well above the original, is signed here and
// sent by the broadcaster. Whichever of the two is mined settles the nonce.

/// The gas of a defensive cancellation: a plain transfer, no calldata.
pub const CANCEL_GAS_LIMIT: u64 = 21_000;

/// How much a cancellation raises the fees it is priced from: twice the original attempt's caps
/// (well past the +10% a node asks to replace the original in its pool) and twice the market's.
pub const CANCEL_FEE_FACTOR: u128 = 2;

/// The least priority fee of a cancellation, 1 gwei: on a quiet chain the market's tip, and the
/// original's, can be a few wei, which buys no priority at all.
pub const MIN_CANCEL_TIP: u128 = 1_000_000_000;

/// EIP-1559 fee caps, in wei per gas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub max_fee: u128,
    pub tip: u128,
}

/// A transaction a reorg deeper than the required depth undid, as the recovery scan reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Undone {
    pub tx_id: Uuid,
    pub state: TxState,
    pub nonce: Option<i64>,
    /// `managed_tx.reorged_at` is set: its outcome is being re-evaluated.
    pub reorged: bool,
    /// It has a block again: one of its own attempts was mined again, which consumed the nonce.
    pub mined: bool,
    /// A cancellation is recorded for its nonce already (the broadcaster sends it).
    pub cancelled: bool,
    /// Its deep-reorg generation (`managed_tx.reorg_generation`).
    pub generation: i32,
    /// The highest caps of its signed attempts; `None` when it has none.
    pub original: Option<Caps>,
}

/// The nonce to sign a defensive cancellation for, if `t` needs one now: a final transaction
/// (CONFIRMED, or REVERTED settled — a revert mined again on the new fork may succeed there) that
/// a deep reorg undid and that is being re-evaluated, holding its nonce, not mined again, and with
/// no cancellation recorded for that nonce yet.
pub fn needs_cancellation(t: &Undone) -> Option<i64> {
    let voidable = match t.state {
        TxState::Confirmed | TxState::Reverted => true,
        TxState::Received
        | TxState::Simulated
        | TxState::PendingApproval
        | TxState::Allocated
        | TxState::Signed
        | TxState::Submitted
        | TxState::Mined
        | TxState::Replaced
        | TxState::Failed => false,
    };
    if !voidable || !t.reorged || t.mined || t.cancelled {
        return None;
    }
    t.nonce.filter(|n| *n >= 0)
}

/// The fees of a defensive cancellation and how they came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CancelFees {
    pub caps: Caps,
    /// `fees.max_fee_per_gas` lowered them.
    pub capped: bool,
    /// Both caps are at least the original's plus the 10% a node asks to replace a pending
    /// transaction of the same nonce (geth's default price bump): a node that holds the original
    /// takes the cancellation in its place. False only when the cap kept them lower.
    pub replaces_original: bool,
}

/// `x` raised by a tenth, rounded up: the least replacement price of a pending transaction.
fn bumped(x: u128) -> u128 {
    x.saturating_add(x.div_ceil(10))
}

/// The caps of a defensive cancellation from the original attempt's highest caps and the market's
/// (`eth_feeHistory`: a max fee of twice the base fee plus the tip), never above `cap`
/// (`fees.max_fee_per_gas`): a tip of twice the larger of the two tips, at least
/// [`MIN_CANCEL_TIP`]; a max fee of twice the larger max fee, and at least room for that tip on
/// top of twice the market's base fee. `None` when neither is known (nothing to price it from).
pub fn cancellation_fees(
    original: Option<Caps>,
    market: Option<Caps>,
    cap: u128,
) -> Option<CancelFees> {
    if original.is_none() && market.is_none() {
        return None;
    }
    let twice = |c: Option<Caps>, f: fn(&Caps) -> u128| {
        c.map_or(0, |c| f(&c).saturating_mul(CANCEL_FEE_FACTOR))
    };
    let tip = twice(original, |c| c.tip)
        .max(twice(market, |c| c.tip))
        .max(MIN_CANCEL_TIP);
    let headroom = market.map_or(0, |m| m.max_fee.saturating_sub(m.tip).saturating_add(tip));
    let max_fee = twice(original, |c| c.max_fee)
        .max(twice(market, |c| c.max_fee))
        .max(headroom)
        .max(tip);
    let caps = Caps {
        max_fee: max_fee.min(cap),
        tip: tip.min(max_fee.min(cap)),
    };
    Some(CancelFees {
        caps,
        capped: caps.max_fee < max_fee || caps.tip < tip,
        replaces_original: original
            .is_none_or(|o| caps.max_fee >= bumped(o.max_fee) && caps.tip >= bumped(o.tip)),
    })
}

/// The defensive cancellation of `nonce`: 0 wei from the signer to itself, no calldata,
/// [`CANCEL_GAS_LIMIT`] gas, `caps`. `Err` names what is not valid.
pub fn cancellation_tx(
    chain_id: ChainId,
    signer: &Signer,
    nonce: i64,
    caps: Caps,
) -> Result<UnsignedTx, &'static str> {
    Ok(UnsignedTx {
        chain_id: u64::try_from(chain_id.0).map_err(|_| "chain id")?,
        nonce: u64::try_from(nonce).map_err(|_| "nonce")?,
        to: signer.as_str().parse::<Address>().map_err(|_| "signer")?,
        value: U256::ZERO,
        data: Bytes::new(),
        gas_limit: CANCEL_GAS_LIMIT,
        max_fee_per_gas: caps.max_fee,
        max_priority_fee_per_gas: caps.tip,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIGNER: &str = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8";
    const DEAD: &str = "0x000000000000000000000000000000000000dead";
    const CHAIN: ChainId = ChainId(31337);

    fn payload() -> TxPayload {
        TxPayload {
            to: DEAD.into(),
            value: "5".into(),
            data: "0x7478".into(),
            gas_limit: Some(25_000),
            max_fee_per_gas: Some("2000000000".into()),
            max_priority_fee_per_gas: Some("1000".into()),
        }
    }

    fn row() -> TxRow {
        TxRow {
            tx_id: Uuid::nil(),
            request_id: "r".into(),
            kind: Kind::Request,
            state: TxState::Allocated,
            nonce: Some(7),
            payload: serde_json::to_value(payload()).expect("payload"),
            approved_by: None,
        }
    }

    fn event() -> TxAllocated {
        TxAllocated {
            event_id: Uuid::new_v4().to_string(),
            tx_id: Uuid::nil().to_string(),
            request_id: "r".into(),
            chain_id: CHAIN.0,
            signer: SIGNER.into(),
            nonce: 7,
            to: "0x000000000000000000000000000000000000DEAD".into(),
            value: "5".into(),
            data: vec![0x74, 0x78],
            gas_limit: 25_000,
            max_fee_per_gas: "2000000000".into(),
            max_priority_fee_per_gas: "1000".into(),
            fencing_token: 3,
        }
    }

    fn policy(whitelist: &[&str], max: Option<&str>, threshold: Option<&str>) -> Policy {
        let whitelist: Vec<String> = whitelist.iter().map(|s| s.to_string()).collect();
        Policy::parse(&whitelist, max, threshold).expect("policy")
    }

    /// The inputs of one case, owned; `Case::input` borrows them as [`Input`].
    struct Case {
        row: Option<TxRow>,
        claimed: Option<TxAllocated>,
        policy: Policy,
        has_key: bool,
    }

    impl Case {
        /// An ALLOCATED request asked for by an agreeing event, an open policy, a key.
        fn new() -> Case {
            Case {
                row: Some(row()),
                claimed: Some(event()),
                policy: policy(&[], None, None),
                has_key: true,
            }
        }

        fn decide<'a>(&'a self, signer: &'a Signer) -> Decision<'a> {
            decide(&Input {
                tx_id: Uuid::nil(),
                chain_id: CHAIN,
                signer,
                row: self.row.as_ref(),
                claimed: self.claimed.as_ref(),
                policy: &self.policy,
                has_key: self.has_key,
            })
        }
    }

    /// A decision in comparable form.
    #[derive(Debug, PartialEq, Eq)]
    enum Want {
        Sign,
        Reannounce,
        Nothing,
        Reject(&'static str),
        Fail(FailureCode),
    }

    fn outcome(d: &Decision<'_>) -> Want {
        match d {
            Decision::Sign { .. } => Want::Sign,
            Decision::Reannounce => Want::Reannounce,
            Decision::Nothing => Want::Nothing,
            Decision::Reject(r) => Want::Reject(match r.code.as_str() {
                "UNKNOWN_TX" => "UNKNOWN_TX",
                "ALLOCATION_MISMATCH" => "ALLOCATION_MISMATCH",
                other => panic!("unexpected rejection code {other}"),
            }),
            Decision::Fail { code, .. } => Want::Fail(*code),
        }
    }

    fn set_payload(c: &mut Case, change: impl FnOnce(&mut TxPayload)) {
        let mut p = payload();
        change(&mut p);
        if let Some(r) = c.row.as_mut() {
            r.payload = serde_json::to_value(p).expect("payload");
        }
    }

    #[test]
    fn each_situation_has_its_decision() {
        type Setup = fn(&mut Case);
        let cases: Vec<(&str, Setup, Want)> = vec![
            ("an agreeing event", |_| {}, Want::Sign),
            ("a recovery scan", |c| c.claimed = None, Want::Sign),
            (
                "an event about an unknown transaction",
                |c| c.row = None,
                Want::Reject("UNKNOWN_TX"),
            ),
            (
                "a scan of a row that is gone",
                |c| {
                    c.row = None;
                    c.claimed = None;
                },
                Want::Nothing,
            ),
            (
                "an allocated row without a nonce",
                |c| c.row.as_mut().unwrap().nonce = None,
                Want::Nothing,
            ),
            (
                "a payload that does not parse",
                |c| c.row.as_mut().unwrap().payload = serde_json::json!({"to": 5}),
                Want::Fail(FailureCode::SigningFailed),
            ),
            (
                "a payload that does not parse, on a scan",
                |c| {
                    c.claimed = None;
                    c.row.as_mut().unwrap().payload = serde_json::json!("x");
                },
                Want::Fail(FailureCode::SigningFailed),
            ),
            (
                "an event with another nonce",
                |c| c.claimed.as_mut().unwrap().nonce = 8,
                Want::Reject("ALLOCATION_MISMATCH"),
            ),
            (
                "an event with another value",
                |c| c.claimed.as_mut().unwrap().value = "6".into(),
                Want::Reject("ALLOCATION_MISMATCH"),
            ),
            (
                "a recorded gas limit missing, on a scan",
                |c| {
                    c.claimed = None;
                    set_payload(c, |p| p.gas_limit = None);
                },
                Want::Fail(FailureCode::SigningFailed),
            ),
            (
                "a recorded fee that is not a number, on a scan",
                |c| {
                    c.claimed = None;
                    set_payload(c, |p| p.max_fee_per_gas = Some("-1".into()));
                },
                Want::Fail(FailureCode::SigningFailed),
            ),
            (
                "a destination off the whitelist",
                |c| c.policy = policy(&[SIGNER], None, None),
                Want::Fail(FailureCode::PolicyDenied),
            ),
            (
                "a value above the limit",
                |c| c.policy = policy(&[], Some("4"), None),
                Want::Fail(FailureCode::PolicyDenied),
            ),
            (
                "a value above the limit, approved",
                |c| {
                    c.policy = policy(&[], Some("4"), None);
                    c.row.as_mut().unwrap().approved_by = Some("ops".into());
                },
                Want::Fail(FailureCode::PolicyDenied),
            ),
            (
                "a value above the approval threshold, not approved",
                |c| c.policy = policy(&[], None, Some("5")),
                Want::Fail(FailureCode::PolicyDenied),
            ),
            (
                "a value above the approval threshold, approved",
                |c| {
                    c.policy = policy(&[], None, Some("5"));
                    c.row.as_mut().unwrap().approved_by = Some("ops".into());
                },
                Want::Sign,
            ),
            (
                "a no-op filling a released nonce, whatever the policy",
                |c| {
                    c.claimed = None;
                    c.policy = policy(&[DEAD], Some("0"), Some("0"));
                    let r = c.row.as_mut().unwrap();
                    r.kind = Kind::Noop;
                    set_payload(c, |p| {
                        p.to = SIGNER.into();
                        p.value = "0".into();
                        p.data = "0x".into();
                    });
                },
                Want::Sign,
            ),
            (
                "a no-op with a value is checked",
                |c| {
                    c.claimed = None;
                    c.policy = policy(&[DEAD], None, None);
                    c.row.as_mut().unwrap().kind = Kind::Noop;
                    set_payload(c, |p| p.to = SIGNER.into());
                },
                Want::Fail(FailureCode::PolicyDenied),
            ),
            (
                "a request shaped like a no-op is checked",
                |c| {
                    c.claimed = None;
                    c.policy = policy(&[DEAD], None, None);
                    set_payload(c, |p| {
                        p.to = SIGNER.into();
                        p.value = "0".into();
                    });
                },
                Want::Fail(FailureCode::PolicyDenied),
            ),
            (
                "no key for the signer",
                |c| c.has_key = false,
                Want::Fail(FailureCode::NoSigningKey),
            ),
            (
                "no key, and the policy refuses: the policy is the reason",
                |c| {
                    c.has_key = false;
                    c.policy = policy(&[SIGNER], None, None);
                },
                Want::Fail(FailureCode::PolicyDenied),
            ),
            (
                "no key, and the event disagrees: the event is dead-lettered",
                |c| {
                    c.has_key = false;
                    c.claimed.as_mut().unwrap().gas_limit = 21_000;
                },
                Want::Reject("ALLOCATION_MISMATCH"),
            ),
        ];
        let signer = Signer::parse(SIGNER).expect("signer");
        for (name, setup, want) in cases {
            let mut c = Case::new();
            setup(&mut c);
            assert_eq!(outcome(&c.decide(&signer)), want, "{name}");
        }
    }

    #[test]
    fn only_allocated_rows_are_signed_and_persisted_attempts_are_announced_again() {
        let signer = Signer::parse(SIGNER).expect("signer");
        for state in TxState::ALL {
            let want = match state {
                TxState::Allocated => Want::Sign,
                TxState::Signed
                | TxState::Submitted
                | TxState::Mined
                | TxState::Confirmed
                | TxState::Reverted => Want::Reannounce,
                TxState::Received
                | TxState::Simulated
                | TxState::PendingApproval
                | TxState::Replaced
                | TxState::Failed => Want::Nothing,
            };
            for claimed in [Some(event()), None] {
                let mut c = Case::new();
                c.row.as_mut().unwrap().state = state;
                c.claimed = claimed;
                assert_eq!(outcome(&c.decide(&signer)), want, "{state}");
            }
            // A state with an attempt announces it even if this gateway lost the key.
            let mut c = Case::new();
            c.row.as_mut().unwrap().state = state;
            c.has_key = false;
            if state.holds_nonce() && state != TxState::Allocated {
                assert_eq!(outcome(&c.decide(&signer)), Want::Reannounce, "{state}");
            }
        }
    }

    #[test]
    fn a_decision_to_sign_carries_the_recorded_transaction_and_failures_their_reasons() {
        let signer = Signer::parse(SIGNER).expect("signer");
        let c = Case::new();
        match c.decide(&signer) {
            Decision::Sign { nonce, tx, .. } => {
                assert_eq!(nonce, 7);
                assert_eq!((tx.chain_id, tx.nonce, tx.gas_limit), (31337, 7, 25_000));
                assert_eq!(tx.to, DEAD.parse::<Address>().expect("address"));
            }
            other => panic!("{other:?}"),
        }
        let reason = |c: &Case| match c.decide(&signer) {
            Decision::Fail { nonce, reason, .. } => {
                assert_eq!(nonce, 7);
                reason
            }
            Decision::Reject(r) => r.message,
            other => panic!("{other:?}"),
        };
        let mut c = Case::new();
        c.has_key = false;
        assert_eq!(
            reason(&c),
            format!("this signer gateway has no key for {SIGNER}")
        );
        let mut c = Case::new();
        c.policy = policy(&[], None, Some("1"));
        assert_eq!(
            reason(&c),
            "value 5 wei needs an approval and the transaction has none"
        );
        let mut c = Case::new();
        set_payload(&mut c, |p| p.to = "nowhere".into());
        c.claimed.as_mut().unwrap().to = "nowhere".into();
        assert_eq!(reason(&c), "the recorded to is not valid");
        let mut c = Case::new();
        c.row = None;
        assert_eq!(
            reason(&c),
            format!("no transaction {} of {SIGNER} on chain 31337", Uuid::nil())
        );
        let mut c = Case::new();
        c.claimed.as_mut().unwrap().data = vec![0x74];
        assert_eq!(
            reason(&c),
            format!(
                "the event's data differs from the recorded transaction {}",
                Uuid::nil()
            )
        );
    }

    #[test]
    fn an_event_must_agree_with_the_recorded_transaction_field_by_field() {
        let p = payload();
        assert_eq!(mismatch(&event(), Some(7), &p), None);
        assert_eq!(mismatch(&event(), Some(8), &p), Some("nonce"));
        assert_eq!(mismatch(&event(), None, &p), Some("nonce"));
        type Change = fn(&mut TxAllocated);
        let cases: [(Change, &str); 6] = [
            (|a| a.to = SIGNER.into(), "to"),
            (|a| a.value = "6".into(), "value"),
            (|a| a.data = vec![0x74], "data"),
            (|a| a.gas_limit = 21_000, "gas_limit"),
            (|a| a.max_fee_per_gas = "1".into(), "max_fee_per_gas"),
            (
                |a| a.max_priority_fee_per_gas = "2".into(),
                "max_priority_fee_per_gas",
            ),
        ];
        for (change, field) in cases {
            let mut a = event();
            change(&mut a);
            assert_eq!(mismatch(&a, Some(7), &p), Some(field));
        }
    }

    #[test]
    fn the_transaction_is_built_from_the_recorded_payload_or_names_the_bad_field() {
        let u = unsigned_tx(31337, 7, &payload()).expect("valid");
        assert_eq!((u.nonce, u.gas_limit, u.value), (7, 25_000, U256::from(5)));
        assert_eq!(u.data.as_ref(), &[0x74, 0x78]);
        type Change = fn(&mut TxPayload);
        let cases: [(Change, &str); 7] = [
            (|p| p.to = "0x12".into(), "to"),
            (|p| p.value = "-5".into(), "value"),
            (|p| p.data = "0xzz".into(), "data"),
            (|p| p.gas_limit = None, "gas_limit"),
            (|p| p.max_fee_per_gas = Some("-1".into()), "max_fee_per_gas"),
            (|p| p.max_fee_per_gas = None, "max_fee_per_gas"),
            (
                |p| p.max_priority_fee_per_gas = Some("1.5".into()),
                "max_priority_fee_per_gas",
            ),
        ];
        for (change, field) in cases {
            let mut p = payload();
            change(&mut p);
            assert_eq!(unsigned_tx(31337, 7, &p).err(), Some(field));
        }
        assert_eq!(unsigned_tx(31337, -1, &payload()).err(), Some("nonce"));
        assert_eq!(unsigned_tx(-1, 7, &payload()).err(), Some("chain id"));
    }

    #[test]
    fn numbers_from_the_node_are_checked_before_signing() {
        type Change = fn(&mut TxPayload);
        let cases: [(&str, Change, Result<U256, &str>); 7] = [
            (
                "as recorded",
                |_| {},
                Ok(U256::from(25_000u64 * 2_000_000_000 + 5)),
            ),
            (
                "a gas limit of 0",
                |p| p.gas_limit = Some(0),
                Err("gas_limit"),
            ),
            (
                "a gas limit above the cap",
                |p| p.gas_limit = Some(MAX_GAS_LIMIT + 1),
                Err("gas_limit"),
            ),
            (
                "a gas limit of u64::MAX",
                |p| p.gas_limit = Some(u64::MAX),
                Err("gas_limit"),
            ),
            (
                "the largest gas and fee: fits 256 bits",
                |p| {
                    p.gas_limit = Some(MAX_GAS_LIMIT);
                    p.max_fee_per_gas = Some(u128::MAX.to_string());
                },
                Ok(U256::from(MAX_GAS_LIMIT) * U256::from(u128::MAX) + U256::from(5)),
            ),
            (
                "a value at U256::MAX plus gas: overflows",
                |p| p.value = U256::MAX.to_string(),
                Err("maximum cost"),
            ),
            (
                "a fee beyond u128",
                |p| p.max_fee_per_gas = Some(U256::MAX.to_string()),
                Err("max_fee_per_gas"),
            ),
        ];
        for (name, change, want) in cases {
            let mut p = payload();
            change(&mut p);
            let got = unsigned_tx(31337, 7, &p).map(|tx| max_cost(&tx).expect("checked"));
            assert_eq!(got, want, "{name}");
        }
        // A transaction that cannot be represented fails with the field named, nonce released.
        let mut c = Case::new();
        set_payload(&mut c, |p| p.value = U256::MAX.to_string());
        c.claimed = None;
        match c.decide(&Signer::parse(SIGNER).expect("signer")) {
            Decision::Fail { reason, nonce, .. } => {
                assert_eq!(nonce, 7);
                assert_eq!(reason, "the recorded maximum cost is not valid");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn attempts_count_from_one_and_the_latest_is_announced_again() {
        let cases = [
            (None, 1),
            (Some(1), 2),
            (Some(4), 5),
            (Some(-3), 1),
            (Some(i32::MAX), i32::MAX),
        ];
        for (highest, next) in cases {
            assert_eq!(next_attempt(highest), next, "{highest:?}");
        }
        let signed = |attempt| TxSigned {
            event_id: format!("e{attempt}"),
            tx_id: Uuid::nil().to_string(),
            chain_id: CHAIN.0,
            signer: SIGNER.into(),
            nonce: 7,
            attempt,
            tx_hash: format!("0x{attempt:064x}"),
            raw_tx: vec![attempt as u8],
            max_fee_per_gas: "2".into(),
            max_priority_fee_per_gas: "1".into(),
            fencing_token: 3,
        };
        assert_eq!(latest_signed(Vec::new()), None);
        let latest = latest_signed([signed(2), signed(3), signed(1)]).expect("one");
        assert_eq!(latest.event_id, "e3");
    }
}

#[cfg(test)]
mod cancellation_tests {
    use super::*;

    const SIGNER: &str = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8";
    const GWEI: u128 = 1_000_000_000;

    fn undone() -> Undone {
        Undone {
            tx_id: Uuid::nil(),
            state: TxState::Confirmed,
            nonce: Some(4),
            reorged: true,
            mined: false,
            cancelled: false,
            generation: 1,
            original: Some(Caps {
                max_fee: 3 * GWEI,
                tip: GWEI,
            }),
        }
    }

    #[test]
    fn only_a_final_transaction_undone_and_not_mined_again_needs_a_cancellation_once() {
        type Case = (&'static str, Undone, Option<i64>);
        let cases: Vec<Case> = vec![
            ("confirmed, undone, re-evaluated", undone(), Some(4)),
            (
                "a settled revert: mined again on the new fork it may succeed",
                Undone {
                    state: TxState::Reverted,
                    ..undone()
                },
                Some(4),
            ),
            (
                "its own attempt mined again: the nonce is consumed by itself",
                Undone {
                    mined: true,
                    ..undone()
                },
                None,
            ),
            (
                "one recorded for its nonce already: the broadcaster sends that one",
                Undone {
                    cancelled: true,
                    ..undone()
                },
                None,
            ),
            (
                "not undone by a deep reorg",
                Undone {
                    reorged: false,
                    ..undone()
                },
                None,
            ),
            (
                "no nonce",
                Undone {
                    nonce: None,
                    ..undone()
                },
                None,
            ),
            (
                "a negative nonce",
                Undone {
                    nonce: Some(-1),
                    ..undone()
                },
                None,
            ),
        ];
        for (what, t, want) in cases {
            assert_eq!(needs_cancellation(&t), want, "{what}");
        }
        // Undone back to RECEIVED, or any state but the two final ones: nothing to void.
        for state in TxState::ALL {
            let t = Undone { state, ..undone() };
            let final_state = matches!(state, TxState::Confirmed | TxState::Reverted);
            assert_eq!(needs_cancellation(&t).is_some(), final_state, "{state:?}");
        }
    }

    #[test]
    fn the_cancellation_doubles_the_higher_of_the_original_and_the_market_within_the_cap() {
        let caps = |max_fee: u128, tip: u128| Caps { max_fee, tip };
        let cap = 1_000 * GWEI;
        type Case = (
            &'static str,
            Option<Caps>,
            Option<Caps>,
            u128,
            Option<(Caps, bool, bool)>,
        );
        let cases: Vec<Case> = vec![
            ("nothing to price it from", None, None, cap, None),
            (
                "twice the original's caps",
                Some(caps(30 * GWEI, 2 * GWEI)),
                Some(caps(10 * GWEI, GWEI)),
                cap,
                Some((caps(60 * GWEI, 4 * GWEI), false, true)),
            ),
            (
                "twice the market's when it rose past the original",
                Some(caps(3 * GWEI, GWEI)),
                Some(caps(50 * GWEI, 5 * GWEI)),
                cap,
                Some((caps(100 * GWEI, 10 * GWEI), false, true)),
            ),
            (
                "a tip of a few wei is raised to the floor, with room for it over the base fee",
                Some(caps(2 * GWEI, 1)),
                Some(caps(2 * GWEI + 1, 1)),
                cap,
                Some((caps(4 * GWEI + 2, GWEI), false, true)),
            ),
            (
                "on a quiet chain the max fee leaves room for the floor tip over twice the base fee",
                None,
                Some(caps(3, 1)),
                cap,
                Some((caps(GWEI + 2, GWEI), false, true)),
            ),
            (
                "without the market: the original's alone",
                Some(caps(30 * GWEI, 2 * GWEI)),
                None,
                cap,
                Some((caps(60 * GWEI, 4 * GWEI), false, true)),
            ),
            (
                "without the original: the market's alone",
                None,
                Some(caps(10 * GWEI, 2 * GWEI)),
                cap,
                Some((caps(20 * GWEI, 4 * GWEI), false, true)),
            ),
            (
                "capped but still a replacement",
                Some(caps(30 * GWEI, 2 * GWEI)),
                None,
                40 * GWEI,
                Some((caps(40 * GWEI, 4 * GWEI), true, true)),
            ),
            (
                "capped below the replacement price of the original",
                Some(caps(30 * GWEI, 2 * GWEI)),
                None,
                32 * GWEI,
                Some((caps(32 * GWEI, 4 * GWEI), true, false)),
            ),
            (
                "a cap below the tip lowers the tip too",
                Some(caps(30 * GWEI, 20 * GWEI)),
                None,
                10 * GWEI,
                Some((caps(10 * GWEI, 10 * GWEI), true, false)),
            ),
            (
                "numbers near the top saturate instead of wrapping",
                Some(caps(u128::MAX, u128::MAX / 2 + 1)),
                None,
                u128::MAX,
                Some((caps(u128::MAX, u128::MAX), false, true)),
            ),
        ];
        for (what, original, market, cap, want) in cases {
            let got = cancellation_fees(original, market, cap)
                .map(|f| (f.caps, f.capped, f.replaces_original));
            assert_eq!(got, want, "{what}");
            if let Some(f) = cancellation_fees(original, market, cap) {
                assert!(
                    f.caps.tip <= f.caps.max_fee && f.caps.max_fee <= cap,
                    "{what}"
                );
            }
        }
    }

    #[test]
    fn the_cancellation_is_a_zero_value_self_transfer_at_the_nonce() {
        let signer = Signer::parse(SIGNER).expect("signer");
        let fees = Caps {
            max_fee: 9 * GWEI,
            tip: 2 * GWEI,
        };
        let tx = cancellation_tx(ChainId(31337), &signer, 4, fees).expect("valid");
        assert_eq!(tx.chain_id, 31337);
        assert_eq!(tx.nonce, 4);
        assert_eq!(format!("{:#x}", tx.to), SIGNER);
        assert_eq!(tx.value, U256::ZERO);
        assert!(tx.data.is_empty());
        assert_eq!(tx.gas_limit, CANCEL_GAS_LIMIT);
        assert_eq!(
            (tx.max_fee_per_gas, tx.max_priority_fee_per_gas),
            (9 * GWEI, 2 * GWEI)
        );
        assert_eq!(
            cancellation_tx(ChainId(31337), &signer, -1, fees).err(),
            Some("nonce")
        );
        assert_eq!(
            cancellation_tx(ChainId(-5), &signer, 4, fees).err(),
            Some("chain id")
        );
    }
}

// ---- Gas bumps (issue 16 point 1, seed 003) ----
//
// A SUBMITTED transaction that the chain does not take — its nonce has waited at the head of the
// signer's queue for `resubmit.bump_after_ms`, or the base fee rose above its max fee — is signed
// again at the same nonce with both caps raised (attempt n+1); the broadcaster sends the latest
// attempt, and a receipt for any attempt settles the transaction.

/// A SUBMITTED transaction with its latest attempt, as the recovery scan reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    pub nonce: i64,
    /// The latest attempt's number and caps.
    pub attempt: i32,
    pub caps: Caps,
    /// How long the latest attempt has been recorded, by the database clock.
    pub waited_ms: u64,
}

/// Why a transaction is bumped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BumpReason {
    /// The chain's nonce is the transaction's own (it is the next to be mined) and its latest
    /// attempt has waited `resubmit.bump_after_ms`.
    Stalled,
    /// The base fee is above the latest attempt's max fee: no block can include it.
    BaseFee,
}

impl BumpReason {
    pub fn as_str(self) -> &'static str {
        match self {
            BumpReason::Stalled => "stalled",
            BumpReason::BaseFee => "base_fee",
        }
    }
}

/// Whether `p` is due for a bump, given the signer's chain nonce (mined transactions) and the
/// current base fee, each `None` when the node did not answer. A transaction whose nonce the chain
/// has consumed is never bumped (its receipt settles it); one behind another unmined nonce is not
/// stalled on its own account (the head is bumped), but is bumped when the base fee passes its
/// max fee, since it would not be mined once the head is.
pub fn bump_due(
    p: &Pending,
    chain_nonce: Option<u64>,
    base_fee: Option<u128>,
    bump_after_ms: u64,
) -> Option<BumpReason> {
    let nonce = u64::try_from(p.nonce).ok()?;
    if chain_nonce.is_some_and(|n| n > nonce) {
        return None;
    }
    if base_fee.is_some_and(|b| b > p.caps.max_fee) {
        return Some(BumpReason::BaseFee);
    }
    if chain_nonce == Some(nonce) && p.waited_ms >= bump_after_ms {
        return Some(BumpReason::Stalled);
    }
    None
}

/// The base fee inside the market's estimate of [`txflow_core::chain::ChainClient::fees`], which
/// is alloy's default: a max fee of twice the next block's base fee plus the tip.
pub fn base_fee_of(market: Caps) -> u128 {
    market.max_fee.saturating_sub(market.tip) / 2
}

/// `x` raised by `percent`, rounded up, saturating.
pub fn raised(x: u128, percent: u32) -> u128 {
    let p = u128::from(percent);
    let raise = (x / 100)
        .saturating_mul(p)
        .saturating_add(((x % 100) * p).div_ceil(100));
    x.saturating_add(raise)
}

/// The caps of attempt n+1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BumpFees {
    /// Sign attempt n+1 with `caps`: both at least `percent` above attempt n's. `capped`:
    /// `fees.max_fee_per_gas` kept them below what the market asks.
    Raise { caps: Caps, capped: bool },
    /// `fees.max_fee_per_gas` leaves no room for a replacement a node would take (both caps
    /// `percent` above attempt n's): no new attempt; the latest one is sent again as it is, and
    /// the operator is alerted.
    AtCap,
}

/// The bump rule: both caps of attempt n+1 at least `percent` above attempt n's (rounded up), and
/// the market's (`eth_feeHistory`) where higher; the max fee at least the tip; never above `cap`
/// (`fees.max_fee_per_gas`). When the cap keeps either below the replacement minimum: [`AtCap`].
///
/// [`AtCap`]: BumpFees::AtCap
pub fn bump_fees(prev: Caps, market: Option<Caps>, percent: u32, cap: u128) -> BumpFees {
    let least = Caps {
        max_fee: raised(prev.max_fee, percent),
        tip: raised(prev.tip, percent),
    };
    let tip = least.tip.max(market.map_or(0, |m| m.tip));
    let max_fee = least.max_fee.max(market.map_or(0, |m| m.max_fee)).max(tip);
    let caps = Caps {
        max_fee: max_fee.min(cap),
        tip: tip.min(max_fee.min(cap)),
    };
    if caps.max_fee < least.max_fee || caps.tip < least.tip {
        return BumpFees::AtCap;
    }
    BumpFees::Raise {
        caps,
        capped: caps.max_fee < max_fee || caps.tip < tip,
    }
}

#[cfg(test)]
mod bump_tests {
    use super::*;

    const GWEI: u128 = 1_000_000_000;

    fn caps(max_fee: u128, tip: u128) -> Caps {
        Caps { max_fee, tip }
    }

    #[test]
    fn raised_rounds_up_and_saturates() {
        // (x, percent, x raised)
        let cases = [
            (0, 10, 0),
            (1, 10, 2),
            (9, 10, 10),
            (10, 10, 11),
            (100, 10, 110),
            (101, 10, 112),
            (2 * GWEI, 10, 2_200_000_000),
            (2 * GWEI + 1, 10, 2_200_000_002),
            (1_000, 25, 1_250),
            (u128::MAX, 10, u128::MAX),
            (u128::MAX - 5, 1000, u128::MAX),
        ];
        for (x, p, want) in cases {
            assert_eq!(raised(x, p), want, "{x} + {p}%");
        }
    }

    #[test]
    fn bump_raises_both_caps_by_the_percent_at_least() {
        let cap = 1_000 * GWEI;
        // (attempt n, market, percent) → attempt n+1
        let cases = [
            // A quiet market: +10% each, rounded up.
            (
                caps(2 * GWEI, 1_000),
                Some(caps(GWEI, 1)),
                10,
                caps(2_200_000_000, 1_100),
            ),
            // A market above both: the market's.
            (
                caps(2 * GWEI, 1_000),
                Some(caps(30 * GWEI, 2 * GWEI)),
                10,
                caps(30 * GWEI, 2 * GWEI),
            ),
            // A market whose max fee is higher but whose tip is not: the tip +10%.
            (
                caps(2 * GWEI, GWEI),
                Some(caps(10 * GWEI, 1)),
                10,
                caps(10 * GWEI, 1_100_000_000),
            ),
            // No market answer: +percent from attempt n alone.
            (caps(3, 3), None, 10, caps(4, 4)),
            (caps(1_000, 100), None, 50, caps(1_500, 150)),
            // A tip above the max fee after the raise is kept under it.
            (caps(10, 10), Some(caps(5, 20)), 10, caps(20, 20)),
        ];
        for (prev, market, percent, want) in cases {
            let BumpFees::Raise { caps: got, capped } = bump_fees(prev, market, percent, cap)
            else {
                panic!("{prev:?} {market:?}: at the cap");
            };
            assert_eq!(got, want, "{prev:?} {market:?} {percent}%");
            assert!(!capped);
            // The replacement rule of a node, whatever the market said.
            assert!(got.max_fee * 100 >= prev.max_fee * (100 + u128::from(percent)));
            assert!(got.tip * 100 >= prev.tip * (100 + u128::from(percent)));
            assert!(got.tip <= got.max_fee);
        }
    }

    #[test]
    fn bump_is_clamped_to_the_cap_and_stops_there() {
        let cap = 100 * GWEI;
        // The market asks more than the cap but the +10% fits: raised to the cap, capped.
        assert_eq!(
            bump_fees(caps(50 * GWEI, GWEI), Some(caps(500 * GWEI, GWEI)), 10, cap),
            BumpFees::Raise {
                caps: caps(cap, 1_100_000_000),
                capped: true
            }
        );
        // +10% passes the cap: no raise.
        assert_eq!(
            bump_fees(caps(95 * GWEI, GWEI), None, 10, cap),
            BumpFees::AtCap
        );
        // Already at the cap: no raise, however high the market.
        assert_eq!(
            bump_fees(caps(cap, GWEI), Some(caps(500 * GWEI, 2 * GWEI)), 10, cap),
            BumpFees::AtCap
        );
        // The tip cannot rise 10% under the cap either.
        assert_eq!(
            bump_fees(caps(cap / 2, cap - 1), None, 10, cap),
            BumpFees::AtCap
        );
    }

    #[test]
    fn a_bump_is_due_when_the_head_waits_or_the_base_fee_passes_the_max_fee() {
        let p = |nonce, max_fee, waited_ms| Pending {
            nonce,
            attempt: 1,
            caps: caps(max_fee, 1),
            waited_ms,
        };
        let after = 60_000;
        // (pending, chain nonce, base fee) → due
        let cases = [
            // The head of the queue, waited long enough: stalled.
            (
                p(5, 100, after),
                Some(5),
                Some(10),
                Some(BumpReason::Stalled),
            ),
            (
                p(5, 100, after + 1),
                Some(5),
                None,
                Some(BumpReason::Stalled),
            ),
            // Not yet.
            (p(5, 100, after - 1), Some(5), Some(10), None),
            // Behind another unmined nonce: not stalled on its own account.
            (p(6, 100, 10 * after), Some(5), Some(10), None),
            // The base fee above the max fee: at once, head or not.
            (p(6, 100, 0), Some(5), Some(101), Some(BumpReason::BaseFee)),
            (p(5, 100, 0), Some(5), Some(101), Some(BumpReason::BaseFee)),
            (p(5, 100, 0), None, Some(101), Some(BumpReason::BaseFee)),
            // A base fee equal to the max fee still fits.
            (p(5, 100, 0), Some(5), Some(100), None),
            // Mined (the chain's nonce is past it): never.
            (p(5, 100, 10 * after), Some(6), Some(1_000), None),
            // Unknown chain nonce and base fee: nothing to go on.
            (p(5, 100, 10 * after), None, None, None),
            // A negative nonce is not a transaction to bump.
            (p(-1, 100, 10 * after), Some(0), Some(1_000), None),
        ];
        for (pending, chain_nonce, base_fee, want) in cases {
            assert_eq!(
                bump_due(&pending, chain_nonce, base_fee, after),
                want,
                "{pending:?} chain nonce {chain_nonce:?} base fee {base_fee:?}"
            );
        }
    }

    #[test]
    fn the_base_fee_is_read_back_from_the_estimate() {
        assert_eq!(base_fee_of(caps(2 * 7 + 3, 3)), 7);
        assert_eq!(base_fee_of(caps(3, 5)), 0);
    }
}
