//! The coordinator's decisions, pure (seed 004 §6.3, §9.2): what to do in each state of a
//! transfer — a CAS, or which adapter operation to call. How a FUNDING result reads as a
//! response is the adapter's (`funding::funding_response`); the reversibility rule itself is the
//! domain's ([`txflow_core::transfer::decide`]).

use txflow_core::transfer::{AccountType, Direction, TransferState, Transition};

/// An adapter operation. The source leg withdraws (and refunds), the target leg deposits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegOp {
    Withdraw,
    Deposit,
    Refund,
}

/// The coordinator's step in a state (the recovery logic of §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Persist this transition before any adapter is called (INIT, SOURCE_DONE).
    Cas(Transition),
    /// Call this adapter operation (idempotent by `req_id`), then apply
    /// [`txflow_core::transfer::decide`] to its response.
    Call { account: AccountType, op: LegOp },
    /// Terminal: nothing to do.
    Done,
}

/// What the coordinator does with a transfer of `direction` found in `state`, whether it just
/// got there or the recovery worker found it: every open state has exactly one step, and a
/// retried step is safe because the CASes expect their `from` state and the calls are
/// idempotent.
pub const fn step(state: TransferState, direction: Direction) -> Step {
    match state {
        TransferState::Init => Step::Cas(Transition::START_SOURCE),
        TransferState::SourcePending => Step::Call {
            account: direction.source(),
            op: LegOp::Withdraw,
        },
        TransferState::SourceDone => Step::Cas(Transition::START_TARGET),
        TransferState::TargetPending => Step::Call {
            account: direction.target(),
            op: LegOp::Deposit,
        },
        TransferState::Compensating => Step::Call {
            account: direction.source(),
            op: LegOp::Refund,
        },
        TransferState::Committed | TransferState::Failed | TransferState::RolledBack => Step::Done,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use txflow_core::transfer::TransferState as S;

    const BOTH: [Direction; 2] = [Direction::FundingToSpot, Direction::SpotToFunding];

    #[test]
    fn every_open_state_has_a_step_and_terminal_states_none() {
        for d in BOTH {
            for s in TransferState::ALL {
                assert_eq!(step(s, d) == Step::Done, s.is_terminal(), "{s} {d:?}");
                if let Step::Cas(t) = step(s, d) {
                    assert_eq!(t.from(), s, "a CAS leaves the state it was planned in");
                }
            }
        }
    }

    #[test]
    fn the_source_leg_withdraws_and_refunds_the_target_leg_deposits() {
        let d = Direction::FundingToSpot;
        assert_eq!(
            step(S::SourcePending, d),
            Step::Call {
                account: AccountType::Funding,
                op: LegOp::Withdraw
            }
        );
        assert_eq!(
            step(S::TargetPending, d),
            Step::Call {
                account: AccountType::Spot,
                op: LegOp::Deposit
            }
        );
        assert_eq!(
            step(S::Compensating, d),
            Step::Call {
                account: AccountType::Funding,
                op: LegOp::Refund
            }
        );
        let d = Direction::SpotToFunding;
        assert_eq!(
            step(S::SourcePending, d),
            Step::Call {
                account: AccountType::Spot,
                op: LegOp::Withdraw
            }
        );
        assert_eq!(
            step(S::TargetPending, d),
            Step::Call {
                account: AccountType::Funding,
                op: LegOp::Deposit
            }
        );
        assert_eq!(
            step(S::Compensating, d),
            Step::Call {
                account: AccountType::Spot,
                op: LegOp::Refund
            }
        );
    }

    #[test]
    fn cra_001_and_cra_004_recovery_persists_before_calling() {
        for d in BOTH {
            assert_eq!(step(S::Init, d), Step::Cas(Transition::START_SOURCE));
            assert_eq!(step(S::SourceDone, d), Step::Cas(Transition::START_TARGET));
        }
    }
}
