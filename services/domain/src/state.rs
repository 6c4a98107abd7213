//! The transaction state machine (shared ARCHITECTURE §3), in one place.
//!
//! [`TxState`] is every state a `managed_tx` row can be in. The legal moves are declared once, in
//! the `transitions!` table below, which generates both
//! - the type-level table: `impl TransitionTo<Signed> for Allocated {}` and so on, so that a named
//!   [`Move`] (what a store writes) only compiles when each of its moves is legal; and
//! - the value-level table [`TRANSITIONS`], which [`TxState::can_move_to`] reads and a unit test
//!   walks pair by pair against the design.
//!
//! The stores write a [`Move`] as one fenced compare-and-set on the expected state(s) together
//! with its `tx_events` row (txflow-core `txstore`). State names appear as SQL text only through
//! [`TxState::as_str`] and in the migrations.

use std::fmt;

/// The state of one managed transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TxState {
    /// Validated and recorded; nothing decided yet.
    Received,
    /// Simulated successfully (and approved, if it needed an approval); waits for a nonce.
    Simulated,
    /// Simulated, above the approval threshold: waits for an operator, holding no nonce.
    PendingApproval,
    /// Holds a nonce; the signed payload is not persisted yet.
    Allocated,
    /// The signed attempt is persisted; not yet accepted by a node.
    Signed,
    /// A node accepted (or may have accepted) an attempt.
    Submitted,
    /// An attempt is in a block with status 1; not final yet.
    Mined,
    /// Final with its required confirmations. Only a reorg deeper than the required depth takes it
    /// back (to RECEIVED, once a transaction other than its own consumed its nonce at depth).
    Confirmed,
    /// An attempt is in a block with status 0: the nonce is consumed. Final once settled at the
    /// required depth (`confirmed_at`, TxConfirmed with `success = false`); before that a reorg
    /// may send it back to SUBMITTED.
    Reverted,
    /// Its nonce was consumed by a transaction txflow did not send: to be re-allocated.
    Replaced,
    /// Will never be mined; its nonce (if it had one) was released.
    Failed,
}

/// A state name that is not one of [`TxState`] (a corrupt row or a newer schema).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a transaction state")]
pub struct UnknownState(pub String);

/// A move the table does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal transition {from} → {to}")]
pub struct IllegalTransition {
    pub from: TxState,
    pub to: TxState,
}

impl TxState {
    pub const ALL: [TxState; 11] = [
        TxState::Received,
        TxState::Simulated,
        TxState::PendingApproval,
        TxState::Allocated,
        TxState::Signed,
        TxState::Submitted,
        TxState::Mined,
        TxState::Confirmed,
        TxState::Reverted,
        TxState::Replaced,
        TxState::Failed,
    ];

    /// The name stored in `managed_tx.state`.
    pub const fn as_str(self) -> &'static str {
        match self {
            TxState::Received => "RECEIVED",
            TxState::Simulated => "SIMULATED",
            TxState::PendingApproval => "PENDING_APPROVAL",
            TxState::Allocated => "ALLOCATED",
            TxState::Signed => "SIGNED",
            TxState::Submitted => "SUBMITTED",
            TxState::Mined => "MINED",
            TxState::Confirmed => "CONFIRMED",
            TxState::Reverted => "REVERTED",
            TxState::Replaced => "REPLACED",
            TxState::Failed => "FAILED",
        }
    }

    pub fn parse(s: &str) -> Result<TxState, UnknownState> {
        TxState::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| UnknownState(s.chars().take(40).collect()))
    }

    /// Whether a transaction in this state holds its nonce: no other transaction of the signer
    /// may have it (the partial unique index `managed_tx_nonce_holder_uq`).
    pub const fn holds_nonce(self) -> bool {
        match self {
            TxState::Allocated
            | TxState::Signed
            | TxState::Submitted
            | TxState::Mined
            | TxState::Confirmed
            | TxState::Reverted => true,
            TxState::Received
            | TxState::Simulated
            | TxState::PendingApproval
            | TxState::Replaced
            | TxState::Failed => false,
        }
    }

    /// Whether the state alone says the transaction is final: no transition leaves it for another
    /// state, but for [`DEEP_REORG_EXITS`] (a reorg deeper than the required depth). Its own
    /// announcements (a self-move) may still be recorded. REVERTED is not final by its state: it
    /// is final once settled at the required depth (`managed_tx.confirmed_at`).
    pub const fn is_terminal(self) -> bool {
        match self {
            TxState::Confirmed | TxState::Failed => true,
            TxState::Received
            | TxState::Simulated
            | TxState::PendingApproval
            | TxState::Allocated
            | TxState::Signed
            | TxState::Submitted
            | TxState::Mined
            | TxState::Reverted
            | TxState::Replaced => false,
        }
    }

    /// Whether the table allows `self → to`.
    pub fn can_move_to(self, to: TxState) -> bool {
        TRANSITIONS.iter().any(|&(f, t)| f == self && t == to)
    }

    /// `Ok` if the table allows `self → to`, else a typed error.
    pub fn check_move(self, to: TxState) -> Result<(), IllegalTransition> {
        if self.can_move_to(to) {
            Ok(())
        } else {
            Err(IllegalTransition { from: self, to })
        }
    }

    /// The states that hold a nonce, as stored.
    pub fn nonce_holders() -> Vec<&'static str> {
        TxState::ALL
            .into_iter()
            .filter(|s| s.holds_nonce())
            .map(TxState::as_str)
            .collect()
    }
}

impl fmt::Display for TxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// Type-level states: one marker type per [`TxState`].
pub mod states {
    use super::TxState;

    /// A marker type for one state.
    pub trait State {
        const STATE: TxState;
    }

    /// `Self → T` is a legal move. Implemented only by the `transitions!` table.
    pub trait TransitionTo<T: State>: State {}

    macro_rules! markers {
        ($($name:ident),+ $(,)?) => {
            $(
                #[derive(Debug, Clone, Copy)]
                pub struct $name;
                impl State for $name {
                    const STATE: TxState = TxState::$name;
                }
            )+
        };
    }
    markers!(
        Received,
        Simulated,
        PendingApproval,
        Allocated,
        Signed,
        Submitted,
        Mined,
        Confirmed,
        Reverted,
        Replaced,
        Failed
    );
}

use states::{State, TransitionTo};

macro_rules! transitions {
    ($($from:ident => [$($to:ident),* $(,)?]);+ $(;)?) => {
        $( $( impl TransitionTo<states::$to> for states::$from {} )* )+
        /// Every legal move, `(from, to)`: generated from the same table as the `TransitionTo`
        /// impls.
        pub const TRANSITIONS: &[(TxState, TxState)] = &[
            $( $( (TxState::$from, TxState::$to), )* )+
        ];
    };
}

transitions! {
    Received => [Simulated, PendingApproval, Failed];
    Simulated => [PendingApproval, Allocated, Failed];
    PendingApproval => [Simulated, Failed];
    Allocated => [Signed, Failed];
    // SIGNED → FAILED only with the nonce released (a permanent refusal by the node).
    Signed => [Submitted, Replaced, Failed];
    // SUBMITTED → SUBMITTED: a resubmission (audited, the state stays).
    Submitted => [Submitted, Mined, Reverted, Replaced];
    // MINED → MINED: its confirmation list announced (the state stays). MINED → SUBMITTED: a
    // reorg dropped the block before it was final.
    Mined => [Mined, Confirmed, Submitted];
    // REVERTED → REVERTED: its confirmation list announced, or settled at the required depth.
    // REVERTED → SUBMITTED: a reorg dropped the block before it was settled.
    Reverted => [Reverted, Submitted];
    Replaced => [Allocated];
    // CONFIRMED → CONFIRMED: announcements after a reorg deeper than the required depth, and its
    // confirmation again. CONFIRMED → RECEIVED: that reorg undid it for good (a transaction
    // other than its own consumed its nonce at depth): re-evaluated — simulated and checked
    // against the policy again — before a fresh nonce (seed 000 §4.4).
    Confirmed => [Confirmed, Received];
    Failed => [];
}

/// The moves that leave a final state ([`TxState::is_terminal`]) for another: only a reorg
/// deeper than the required depth does.
pub const DEEP_REORG_EXITS: &[(TxState, TxState)] = &[(TxState::Confirmed, TxState::Received)];

/// Compiles only if `F → T` is in the table.
const fn legal<F: TransitionTo<T>, T: State>() {}

/// A named write of the state machine: from any of `from` to `to`, recorded in `tx_events` as
/// `event`. Declared with [`moves!`](crate::state) only, so every one of its moves is legal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub name: &'static str,
    pub from: &'static [TxState],
    pub to: TxState,
    /// `tx_events.type` of the audit row written with it.
    pub event: &'static str,
}

impl Move {
    /// The expected states, as stored (the compare-and-set's `state = ANY($from)`).
    pub fn from_names(&self) -> Vec<&'static str> {
        self.from.iter().map(|s| s.as_str()).collect()
    }
}

macro_rules! moves {
    ($($(#[$doc:meta])* $name:ident: $($from:ident)|+ => $to:ident, $event:literal;)+) => {
        $(
            $(#[$doc])*
            pub const $name: Move = {
                $( legal::<states::$from, states::$to>(); )+
                Move {
                    name: stringify!($name),
                    from: &[$(TxState::$from),+],
                    to: TxState::$to,
                    event: $event,
                }
            };
        )+
        /// Every named move.
        pub const MOVES: &[Move] = &[$($name),+];
    };
}

moves! {
    /// The simulation succeeded (allocator).
    SIMULATE: Received => Simulated, "TxSimulated";
    /// The simulation succeeded and the value needs an approval: no nonce is held meanwhile.
    AWAIT_APPROVAL: Received => PendingApproval, "TxPendingApproval";
    /// An operator approved it (who is recorded in `managed_tx.approved_by` and the event).
    APPROVE: PendingApproval => Simulated, "TxApproved";
    /// Fails before a nonce is held: simulation, policy, cancel, approval refused.
    FAIL_UNALLOCATED: Received | Simulated | PendingApproval => Failed, "TxFailed";
    /// A nonce from the cursor (a REPLACED one gets a fresh nonce).
    ALLOCATE: Simulated | Replaced => Allocated, "TxAllocated";
    /// Attempt persisted (signer gateway).
    SIGN: Allocated => Signed, "TxSigned";
    /// Cannot be signed or was cancelled after allocation: failed, nonce released.
    FAIL_ALLOCATED: Allocated => Failed, "TxFailed";
    /// A node accepted (or may have accepted) the attempt (broadcaster).
    SUBMIT: Signed => Submitted, "TxSubmitted";
    /// The nonce was consumed by a transaction txflow did not send.
    REPLACE: Signed | Submitted => Replaced, "TxReplaced";
    /// The node refuses the signed transaction for good: failed, nonce released.
    FAIL_SIGNED: Signed => Failed, "TxFailed";
    /// An unmined submission was sent again.
    RESUBMIT: Submitted => Submitted, "TxResubmitted";
    /// A receipt with status 1.
    MINE: Submitted => Mined, "TxMined";
    /// A receipt with status 0.
    REVERT: Submitted => Reverted, "TxReverted";
    /// Enough confirmations (confirmation manager): TxConfirmed (`success = true`).
    CONFIRM: Mined => Confirmed, "TxConfirmed";
    /// A reverted transaction reached the required depth: its final outcome, TxConfirmed with
    /// `success = false` (the state stays; `confirmed_at` records it).
    SETTLE_REVERTED: Reverted => Reverted, "TxConfirmed";
    /// Final again after a reorg deeper than the required depth (its own attempt mined again and
    /// reached the depth): a TxConfirmed of a new generation.
    RECONFIRM: Confirmed => Confirmed, "TxConfirmed";
    /// Its confirmation list grew or changed: a TxConfirmationsUpdated is announced.
    COUNT_MINED: Mined => Mined, "TxConfirmationsUpdated";
    /// The same, for a reverted transaction.
    COUNT_REVERTED: Reverted => Reverted, "TxConfirmationsUpdated";
    /// The same, for a confirmed transaction (a reorg changed its list, deep or not).
    COUNT_CONFIRMED: Confirmed => Confirmed, "TxConfirmationsUpdated";
    /// A reorg deeper than the required depth removed the block it was final in: its TxConfirmed
    /// is reverted (TxConfirmationReverted on `tx.outcomes`, and `new_fork = true` with an empty
    /// list on `tx.confirmations`); it stays CONFIRMED while its outcome is re-evaluated.
    REVERSE_CONFIRMED: Confirmed => Confirmed, "TxConfirmationReverted";
    /// The same, for a reverted transaction settled at depth (its TxConfirmed said
    /// `success = false`).
    REVERSE_SETTLED: Reverted => Reverted, "TxConfirmationReverted";
    /// A reorg dropped its block before it was final: back to SUBMITTED, rebroadcast, receipt
    /// cleared; announces TxConfirmationsUpdated with `new_fork = true` and an empty list.
    REORG: Mined | Reverted => Submitted, "TxReorged";
    /// A reorg deeper than the required depth undid it for good: a transaction other than its own
    /// (the defensive cancellation) consumed its nonce at depth. Back to RECEIVED to be
    /// re-evaluated (seed 000 §4.4: simulated and checked against the policy again, then sent at
    /// a fresh nonce or, with `approval.after_deep_reorg`, held for an approval).
    UNDO_CONFIRMED: Confirmed => Received, "TxReorgUndone";
}

/// Where a newly recorded transaction starts: a request, or a no-op filling a released nonce.
pub const CREATED_REQUEST: TxState = TxState::Received;
/// A no-op is created already holding the released nonce it fills.
pub const CREATED_NOOP: TxState = TxState::Allocated;

#[cfg(test)]
mod tests {
    use super::*;
    use TxState::*;

    /// The design's table (shared ARCHITECTURE §3), written out independently of the macro.
    fn designed(from: TxState, to: TxState) -> bool {
        matches!(
            (from, to),
            (Received, Simulated | PendingApproval | Failed)
                | (Simulated, PendingApproval | Allocated | Failed)
                | (PendingApproval, Simulated | Failed)
                | (Allocated, Signed | Failed)
                | (Signed, Submitted | Replaced | Failed)
                | (Submitted, Submitted | Mined | Reverted | Replaced)
                | (Mined, Mined | Confirmed | Submitted)
                | (Reverted, Reverted | Submitted)
                // The design's "back to SIMULATED for re-evaluation" (seed 000 §4.4) made literal:
                // RECEIVED is where a request is simulated and checked against the policy.
                | (Confirmed, Confirmed | Received)
                | (Replaced, Allocated)
        )
    }

    #[test]
    fn every_pair_of_states_is_legal_exactly_when_the_design_says_so() {
        let mut legal = 0;
        for from in TxState::ALL {
            for to in TxState::ALL {
                assert_eq!(from.can_move_to(to), designed(from, to), "{from} → {to}");
                match from.check_move(to) {
                    Ok(()) => legal += 1,
                    Err(e) => assert_eq!(e, IllegalTransition { from, to }),
                }
            }
        }
        assert_eq!(legal, TRANSITIONS.len());
    }

    #[test]
    fn terminal_states_have_no_way_out_but_a_deep_reorg_and_every_other_state_has_one() {
        for s in TxState::ALL {
            let out = TxState::ALL
                .into_iter()
                .any(|t| t != s && s.can_move_to(t) && !DEEP_REORG_EXITS.contains(&(s, t)));
            assert_eq!(s.is_terminal(), !out, "{s}");
        }
        for &(from, to) in DEEP_REORG_EXITS {
            assert!(from.is_terminal() && from.can_move_to(to), "{from} → {to}");
        }
    }

    #[test]
    fn the_confirmation_moves_keep_or_leave_the_nonce_as_the_chain_does() {
        // Announcements and settling stay where they are.
        for m in [
            COUNT_MINED,
            COUNT_REVERTED,
            COUNT_CONFIRMED,
            SETTLE_REVERTED,
            RECONFIRM,
        ] {
            assert_eq!(m.from, &[m.to], "{}", m.name);
        }
        // A reorg before the depth keeps the nonce (the same signed bytes are sent again); the
        // undo after a deep reorg gives it up (another transaction consumed it).
        assert!(REORG.from.iter().all(|s| s.holds_nonce()) && REORG.to.holds_nonce());
        assert!(!UNDO_CONFIRMED.to.holds_nonce());
        // Every final outcome is announced as TxConfirmed.
        for m in [CONFIRM, SETTLE_REVERTED, RECONFIRM] {
            assert_eq!(m.event, "TxConfirmed", "{}", m.name);
        }
    }

    #[test]
    fn nonce_holders_are_the_allocated_states_up_to_the_chain() {
        assert_eq!(
            TxState::nonce_holders(),
            vec![
                "ALLOCATED",
                "SIGNED",
                "SUBMITTED",
                "MINED",
                "CONFIRMED",
                "REVERTED"
            ]
        );
        // Moving into a nonce-holding state from one that holds none is only an allocation.
        for &(from, to) in TRANSITIONS {
            if to.holds_nonce() && !from.holds_nonce() {
                assert_eq!(to, Allocated, "{from} → {to} would take a nonce");
            }
        }
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_typed_errors() {
        for s in TxState::ALL {
            assert_eq!(TxState::parse(s.as_str()), Ok(s));
        }
        assert_eq!(
            TxState::parse("PENDING"),
            Err(UnknownState("PENDING".into()))
        );
    }

    #[test]
    fn every_named_move_is_in_the_table_and_names_its_event() {
        for m in MOVES {
            assert!(!m.from.is_empty(), "{}", m.name);
            for &f in m.from {
                assert!(f.can_move_to(m.to), "{}: {f} → {}", m.name, m.to);
            }
            assert!(m.event.starts_with("Tx"), "{}", m.name);
        }
        assert!(CREATED_NOOP.holds_nonce() && !CREATED_REQUEST.holds_nonce());
    }
}
