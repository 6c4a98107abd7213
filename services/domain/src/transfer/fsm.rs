//! The transfer state machine of seed 004 §2: the states with their numeric ids (§2.1), the
//! exhaustive table of transitions (§2.2) and the reversibility rule (§2.3) as one pure function,
//! [`decide`].
//!
//! Architecture invariant: the store changes `transfers.state` only with a [`Transition`] (a CAS
//! `UPDATE … SET state = to WHERE state = from`), and a `Transition` exists only for a pair of
//! [`TRANSITIONS`]: the named ones are checked when the crate compiles, any other pair is a typed
//! [`IllegalTransfer`].

use std::fmt;

use super::code::TransferCode;

/// A transfer's state, with the numeric id stored in `transfers.state` (§2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TransferState {
    Init,
    SourcePending,
    SourceDone,
    TargetPending,
    Committed,
    Failed,
    Compensating,
    RolledBack,
}

/// Where the transfer's money is while the transfer is in a state (§2.1, "Funds Location").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FundsLocation {
    /// In the source account; nothing moved (INIT, FAILED, and ROLLED_BACK after the refund).
    Source,
    /// The source debit was asked for and its outcome is not recorded yet (SOURCE_PENDING): in
    /// the source or in flight. The adapters' operation records tell which.
    Deducting,
    /// Left the source, not in the target (SOURCE_DONE).
    InFlight,
    /// The target credit was asked for (TARGET_PENDING): in flight or in the target.
    Crediting,
    /// The target refused; the source refund was asked for (COMPENSATING): in flight or back.
    Refunding,
    /// In the target account (COMMITTED).
    Target,
}

impl FundsLocation {
    /// Counted as in flight by the conservation check of §7.2 (SOURCE_DONE, TARGET_PENDING,
    /// COMPENSATING).
    pub const fn counts_in_flight(self) -> bool {
        match self {
            FundsLocation::InFlight | FundsLocation::Crediting | FundsLocation::Refunding => true,
            FundsLocation::Source | FundsLocation::Deducting | FundsLocation::Target => false,
        }
    }
}

/// A stored state id that is none of §2.1's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0} is not a transfer state id")]
pub struct UnknownTransferState(pub i16);

impl TransferState {
    pub const ALL: [TransferState; 8] = [
        TransferState::Init,
        TransferState::SourcePending,
        TransferState::SourceDone,
        TransferState::TargetPending,
        TransferState::Committed,
        TransferState::Failed,
        TransferState::Compensating,
        TransferState::RolledBack,
    ];

    /// The states the recovery worker resumes (§6.2), the non-terminal ones.
    pub const OPEN: [TransferState; 5] = [
        TransferState::Init,
        TransferState::SourcePending,
        TransferState::SourceDone,
        TransferState::TargetPending,
        TransferState::Compensating,
    ];

    /// The numeric id of §2.1 (the value of `transfers.state`).
    pub const fn id(self) -> i16 {
        match self {
            TransferState::Init => 0,
            TransferState::SourcePending => 10,
            TransferState::SourceDone => 20,
            TransferState::TargetPending => 30,
            TransferState::Committed => 40,
            TransferState::Failed => -10,
            TransferState::Compensating => -20,
            TransferState::RolledBack => -30,
        }
    }

    pub fn from_id(id: i16) -> Result<TransferState, UnknownTransferState> {
        TransferState::ALL
            .into_iter()
            .find(|s| s.id() == id)
            .ok_or(UnknownTransferState(id))
    }

    /// The name of §2.1, as the API shows it.
    pub const fn as_str(self) -> &'static str {
        match self {
            TransferState::Init => "INIT",
            TransferState::SourcePending => "SOURCE_PENDING",
            TransferState::SourceDone => "SOURCE_DONE",
            TransferState::TargetPending => "TARGET_PENDING",
            TransferState::Committed => "COMMITTED",
            TransferState::Failed => "FAILED",
            TransferState::Compensating => "COMPENSATING",
            TransferState::RolledBack => "ROLLED_BACK",
        }
    }

    pub fn parse(s: &str) -> Option<TransferState> {
        TransferState::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// COMMITTED, FAILED and ROLLED_BACK: nothing leaves them.
    pub const fn is_terminal(self) -> bool {
        match self {
            TransferState::Committed | TransferState::Failed | TransferState::RolledBack => true,
            TransferState::Init
            | TransferState::SourcePending
            | TransferState::SourceDone
            | TransferState::TargetPending
            | TransferState::Compensating => false,
        }
    }

    pub const fn funds(self) -> FundsLocation {
        match self {
            TransferState::Init | TransferState::Failed | TransferState::RolledBack => {
                FundsLocation::Source
            }
            TransferState::SourcePending => FundsLocation::Deducting,
            TransferState::SourceDone => FundsLocation::InFlight,
            TransferState::TargetPending => FundsLocation::Crediting,
            TransferState::Compensating => FundsLocation::Refunding,
            TransferState::Committed => FundsLocation::Target,
        }
    }
}

impl fmt::Display for TransferState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

use TransferState as S;

/// The exhaustive table of §2.2. Nothing else moves a transfer; in particular no state returns
/// to an earlier one, no terminal state is left, and COMPENSATING is entered only from
/// TARGET_PENDING (and only on an explicit failure, see [`decide`]).
pub const TRANSITIONS: [(TransferState, TransferState); 7] = [
    (S::Init, S::SourcePending),
    (S::SourcePending, S::SourceDone),
    (S::SourcePending, S::Failed),
    (S::SourceDone, S::TargetPending),
    (S::TargetPending, S::Committed),
    (S::TargetPending, S::Compensating),
    (S::Compensating, S::RolledBack),
];

/// True when §2.2 allows `from → to`.
pub const fn allowed(from: TransferState, to: TransferState) -> bool {
    let mut i = 0;
    while i < TRANSITIONS.len() {
        let (f, t) = TRANSITIONS[i];
        if f as u8 == from as u8 && t as u8 == to as u8 {
            return true;
        }
        i += 1;
    }
    false
}

/// A move §2.2 does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal transfer transition {from} -> {to}")]
pub struct IllegalTransfer {
    pub from: TransferState,
    pub to: TransferState,
}

/// One allowed move, the only thing the store CASes. Its fields are private: a value exists
/// only for a pair of [`TRANSITIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transition {
    from: TransferState,
    to: TransferState,
}

/// A named transition, checked while the crate compiles (a pair the table does not allow is a
/// compile-time panic in a const).
const fn legal(from: TransferState, to: TransferState) -> Transition {
    assert!(allowed(from, to), "not in the transfer transition table");
    Transition { from, to }
}

impl Transition {
    /// INIT → SOURCE_PENDING: persisted before the source adapter is called.
    pub const START_SOURCE: Transition = legal(S::Init, S::SourcePending);
    /// SOURCE_PENDING → SOURCE_DONE: the source debit succeeded.
    pub const SOURCE_OK: Transition = legal(S::SourcePending, S::SourceDone);
    /// SOURCE_PENDING → FAILED: the source refused explicitly; nothing moved.
    pub const SOURCE_FAILED: Transition = legal(S::SourcePending, S::Failed);
    /// SOURCE_DONE → TARGET_PENDING: persisted before the target adapter is called.
    pub const START_TARGET: Transition = legal(S::SourceDone, S::TargetPending);
    /// TARGET_PENDING → COMMITTED: the target credit succeeded (the atomic commit).
    pub const COMMIT: Transition = legal(S::TargetPending, S::Committed);
    /// TARGET_PENDING → COMPENSATING: the target refused explicitly (§2.3).
    pub const COMPENSATE: Transition = legal(S::TargetPending, S::Compensating);
    /// COMPENSATING → ROLLED_BACK: the source refund succeeded.
    pub const ROLL_BACK: Transition = legal(S::Compensating, S::RolledBack);

    pub const ALL: [Transition; 7] = [
        Transition::START_SOURCE,
        Transition::SOURCE_OK,
        Transition::SOURCE_FAILED,
        Transition::START_TARGET,
        Transition::COMMIT,
        Transition::COMPENSATE,
        Transition::ROLL_BACK,
    ];

    /// The transition `from → to`, or why there is none.
    pub fn new(from: TransferState, to: TransferState) -> Result<Transition, IllegalTransfer> {
        if allowed(from, to) {
            Ok(Transition { from, to })
        } else {
            Err(IllegalTransfer { from, to })
        }
    }

    pub const fn from(self) -> TransferState {
        self.from
    }

    pub const fn to(self) -> TransferState {
        self.to
    }
}

/// What an adapter call answered (§2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterResponse {
    /// Applied (or applied before, for this request: idempotent success).
    Success,
    /// A business refusal with its code: the operation certainly did not apply.
    ExplicitFail(TransferCode),
    /// No answer in time: it may or may not have applied.
    Timeout,
    /// The adapter is still processing.
    Pending,
    /// The call did not get through, or its answer did not come back.
    NetworkError,
    /// Anything else.
    Unknown,
}

impl AdapterResponse {
    /// True when the response proves the operation did not apply (only an explicit failure).
    pub const fn is_explicit_fail(self) -> bool {
        matches!(self, AdapterResponse::ExplicitFail(_))
    }

    /// True when nobody knows whether the operation applied.
    pub const fn is_unknown(self) -> bool {
        match self {
            AdapterResponse::Timeout
            | AdapterResponse::Pending
            | AdapterResponse::NetworkError
            | AdapterResponse::Unknown => true,
            AdapterResponse::Success | AdapterResponse::ExplicitFail(_) => false,
        }
    }
}

/// Why a transfer stays in its state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stay {
    /// The outcome is unknown: retry the same (idempotent) call, forever if need be. In
    /// TARGET_PENDING the money is in flight: alert (§3.2 step 10b), never compensate.
    OutcomeUnknown,
    /// The refund was refused: retry it (§4.3), and alert, since only an operator can help if
    /// the refusal persists (MON-002).
    RefundRefused(TransferCode),
}

/// What to do with an adapter's response in a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// CAS this transition.
    Move(Transition),
    /// Change nothing; retry the call later.
    Stay(Stay),
    /// The state awaits no adapter response (INIT, SOURCE_DONE and the terminal states): a late
    /// or duplicate response changes nothing.
    NotAwaiting,
}

/// The reversibility rule (§2.3), for the response of the adapter call a state makes:
/// SOURCE_PENDING the source debit, TARGET_PENDING the target credit, COMPENSATING the source
/// refund. Only an explicit failure in TARGET_PENDING leads to COMPENSATING; in SOURCE_PENDING an
/// explicit failure ends in FAILED; an unknown outcome never moves anything.
pub const fn decide(state: TransferState, response: AdapterResponse) -> Next {
    use AdapterResponse as R;
    match (state, response) {
        (S::SourcePending, R::Success) => Next::Move(Transition::SOURCE_OK),
        (S::SourcePending, R::ExplicitFail(_)) => Next::Move(Transition::SOURCE_FAILED),
        (S::TargetPending, R::Success) => Next::Move(Transition::COMMIT),
        (S::TargetPending, R::ExplicitFail(_)) => Next::Move(Transition::COMPENSATE),
        (S::Compensating, R::Success) => Next::Move(Transition::ROLL_BACK),
        (S::Compensating, R::ExplicitFail(code)) => Next::Stay(Stay::RefundRefused(code)),
        (
            S::SourcePending | S::TargetPending | S::Compensating,
            R::Timeout | R::Pending | R::NetworkError | R::Unknown,
        ) => Next::Stay(Stay::OutcomeUnknown),
        (
            S::Init | S::SourceDone | S::Committed | S::Failed | S::RolledBack,
            R::Success
            | R::ExplicitFail(_)
            | R::Timeout
            | R::Pending
            | R::NetworkError
            | R::Unknown,
        ) => Next::NotAwaiting,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const FAIL: AdapterResponse = AdapterResponse::ExplicitFail(TransferCode::InsufficientBalance);
    const UNKNOWNS: [AdapterResponse; 4] = [
        AdapterResponse::Timeout,
        AdapterResponse::Pending,
        AdapterResponse::NetworkError,
        AdapterResponse::Unknown,
    ];

    #[test]
    fn ids_names_and_terminal_flags_are_those_of_the_seed() {
        let expected = [
            (S::Init, 0, "INIT", false),
            (S::SourcePending, 10, "SOURCE_PENDING", false),
            (S::SourceDone, 20, "SOURCE_DONE", false),
            (S::TargetPending, 30, "TARGET_PENDING", false),
            (S::Committed, 40, "COMMITTED", true),
            (S::Failed, -10, "FAILED", true),
            (S::Compensating, -20, "COMPENSATING", false),
            (S::RolledBack, -30, "ROLLED_BACK", true),
        ];
        for (s, id, name, terminal) in expected {
            assert_eq!(s.id(), id);
            assert_eq!(TransferState::from_id(id), Ok(s));
            assert_eq!(s.as_str(), name);
            assert_eq!(TransferState::parse(name), Some(s));
            assert_eq!(s.is_terminal(), terminal, "{s}");
            assert_eq!(TransferState::OPEN.contains(&s), !terminal, "{s}");
        }
        assert_eq!(
            TransferState::from_id(5),
            Err(UnknownTransferState(5)),
            "an id outside §2.1 is refused"
        );
    }

    #[test]
    fn in_flight_is_source_done_target_pending_and_compensating() {
        let in_flight: Vec<_> = TransferState::ALL
            .into_iter()
            .filter(|s| s.funds().counts_in_flight())
            .collect();
        assert_eq!(
            in_flight,
            [S::SourceDone, S::TargetPending, S::Compensating]
        );
    }

    #[test]
    fn only_the_seven_pairs_of_the_table_are_transitions() {
        let mut count = 0;
        for from in TransferState::ALL {
            for to in TransferState::ALL {
                match Transition::new(from, to) {
                    Ok(t) => {
                        count += 1;
                        assert!(Transition::ALL.contains(&t));
                        assert_eq!((t.from(), t.to()), (from, to));
                        assert!(!from.is_terminal(), "a terminal state is never left");
                    }
                    Err(e) => assert_eq!(e, IllegalTransfer { from, to }),
                }
            }
        }
        assert_eq!(count, TRANSITIONS.len());
        // The dangerous shortcuts are not in it.
        for (from, to) in [
            (S::SourceDone, S::Compensating),
            (S::SourcePending, S::Compensating),
            (S::SourceDone, S::Committed),
            (S::TargetPending, S::Failed),
            (S::TargetPending, S::RolledBack),
            (S::Compensating, S::Committed),
            (S::Init, S::Failed),
        ] {
            assert!(Transition::new(from, to).is_err(), "{from} -> {to}");
        }
    }

    #[test]
    fn fsm_001_002_happy_path_reaches_committed_through_every_state() {
        // The same flow for FUNDING → SPOT and SPOT → FUNDING: the direction only picks adapters.
        let mut state = S::Init;
        let mut seen = vec![state];
        state = Transition::START_SOURCE.to();
        seen.push(state);
        let Next::Move(t) = decide(state, AdapterResponse::Success) else {
            panic!("a source success moves")
        };
        state = t.to();
        seen.push(state);
        state = Transition::START_TARGET.to();
        seen.push(state);
        let Next::Move(t) = decide(state, AdapterResponse::Success) else {
            panic!("a target success moves")
        };
        seen.push(t.to());
        assert_eq!(
            seen,
            [
                S::Init,
                S::SourcePending,
                S::SourceDone,
                S::TargetPending,
                S::Committed
            ]
        );
    }

    #[test]
    fn fsm_003_source_explicit_failure_fails() {
        assert_eq!(
            decide(S::SourcePending, FAIL),
            Next::Move(Transition::SOURCE_FAILED)
        );
        assert_eq!(Transition::SOURCE_FAILED.to(), S::Failed);
    }

    #[test]
    fn fsm_003_source_unknown_outcome_stays_and_retries() {
        for r in UNKNOWNS {
            assert_eq!(
                decide(S::SourcePending, r),
                Next::Stay(Stay::OutcomeUnknown),
                "{r:?}"
            );
        }
    }

    #[test]
    fn fsm_004_target_explicit_failure_compensates_then_rolls_back() {
        assert_eq!(
            decide(S::TargetPending, FAIL),
            Next::Move(Transition::COMPENSATE)
        );
        assert_eq!(
            decide(S::Compensating, AdapterResponse::Success),
            Next::Move(Transition::ROLL_BACK)
        );
        assert_eq!(Transition::ROLL_BACK.to(), S::RolledBack);
    }

    #[test]
    fn fsm_005_target_timeout_and_every_unknown_stay_in_target_pending() {
        for r in UNKNOWNS {
            assert_eq!(
                decide(S::TargetPending, r),
                Next::Stay(Stay::OutcomeUnknown),
                "{r:?} must never compensate"
            );
        }
    }

    #[test]
    fn fsm_006_compensation_failure_stays_in_compensating() {
        assert_eq!(
            decide(S::Compensating, FAIL),
            Next::Stay(Stay::RefundRefused(TransferCode::InsufficientBalance))
        );
        for r in UNKNOWNS {
            assert_eq!(decide(S::Compensating, r), Next::Stay(Stay::OutcomeUnknown));
        }
    }

    #[test]
    fn states_that_call_no_adapter_ignore_responses() {
        for s in [
            S::Init,
            S::SourceDone,
            S::Committed,
            S::Failed,
            S::RolledBack,
        ] {
            for r in [AdapterResponse::Success, FAIL].into_iter().chain(UNKNOWNS) {
                assert_eq!(decide(s, r), Next::NotAwaiting, "{s} {r:?}");
            }
        }
    }

    #[test]
    fn every_move_decided_leaves_the_state_it_was_decided_in() {
        for s in TransferState::ALL {
            for r in [AdapterResponse::Success, FAIL].into_iter().chain(UNKNOWNS) {
                if let Next::Move(t) = decide(s, r) {
                    assert_eq!(t.from(), s);
                }
            }
        }
    }

    fn response() -> impl Strategy<Value = AdapterResponse> {
        prop_oneof![
            Just(AdapterResponse::Success),
            Just(FAIL),
            Just(AdapterResponse::ExplicitFail(TransferCode::AccountFrozen)),
            Just(AdapterResponse::Timeout),
            Just(AdapterResponse::Pending),
            Just(AdapterResponse::NetworkError),
            Just(AdapterResponse::Unknown),
        ]
    }

    /// The money a transfer moved, as the model counts it.
    #[derive(Debug, Default)]
    struct Moved {
        debits: u32,
        credits: u32,
        refunds: u32,
    }

    proptest! {
        /// Drive a transfer with any sequence of responses (the coordinator's own CASes in INIT
        /// and SOURCE_DONE in between): money moves at most once per leg, a refund only undoes
        /// a debit, credit and refund never both happen, TARGET_PENDING reaches COMPENSATING
        /// only on an explicit failure, and a terminal state's funds are where §2.1 says.
        #[test]
        fn no_sequence_of_responses_moves_money_twice(
            responses in proptest::collection::vec(response(), 0..40)
        ) {
            let mut state = S::Init;
            let mut moved = Moved::default();
            for r in responses {
                // The coordinator's own steps (no adapter answer needed).
                match state {
                    S::Init => state = Transition::START_SOURCE.to(),
                    S::SourceDone => state = Transition::START_TARGET.to(),
                    _ => {}
                }
                match decide(state, r) {
                    Next::Move(t) => {
                        prop_assert_eq!(t.from(), state);
                        prop_assert!(Transition::new(t.from(), t.to()).is_ok());
                        if t == Transition::COMPENSATE {
                            prop_assert!(r.is_explicit_fail(), "compensated on {:?}", r);
                        }
                        if r.is_unknown() {
                            prop_assert!(false, "an unknown outcome moved {:?}", t);
                        }
                        match t.to() {
                            S::SourceDone => moved.debits += 1,
                            S::Committed => moved.credits += 1,
                            S::RolledBack => moved.refunds += 1,
                            _ => {}
                        }
                        state = t.to();
                    }
                    Next::Stay(_) => prop_assert!(!state.is_terminal()),
                    Next::NotAwaiting => prop_assert!(state.is_terminal()),
                }
                prop_assert!(moved.debits <= 1 && moved.credits <= 1 && moved.refunds <= 1);
                prop_assert!(moved.refunds <= moved.debits);
                prop_assert!(moved.credits + moved.refunds <= 1);
            }
            match state.funds() {
                FundsLocation::Source => prop_assert_eq!(moved.debits, moved.refunds),
                FundsLocation::Target => {
                    prop_assert_eq!((moved.debits, moved.credits), (1, 1))
                }
                FundsLocation::InFlight | FundsLocation::Crediting | FundsLocation::Refunding => {
                    prop_assert_eq!((moved.debits, moved.credits, moved.refunds), (1, 0, 0))
                }
                FundsLocation::Deducting => prop_assert_eq!(moved.debits, 0),
            }
        }
    }
}
