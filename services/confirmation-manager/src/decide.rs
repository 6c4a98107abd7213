//! The confirmation manager's decisions. Pure: no I/O, no async, no SQL — the handler gathers
//! what PostgreSQL holds and what the chain shows ([`View`]), and these functions say what it
//! means.
//!
//! - [`track`]: for one transaction with a block, whether its confirmation list is announced
//!   (seed 001 §6.5: `new_fork = false` when the list extends what was announced, `true` when the
//!   announced blocks are no longer all canonical — the list then replaces them), whether it is
//!   final, and what a reorg did to it;
//! - [`reevaluate`]: a final transaction undone by a reorg deeper than the required depth, after
//!   the chain was asked again;
//! - [`confirmed_event_id`]: the one `event_id` of a transaction's TxConfirmed.
//!
//! The list of a transaction is the canonical blocks from its own up to the head, at most the
//! required depth of them: a transaction in block `b` has `head - b + 1` confirmations (its own
//! block counts), and is final when it has the required number.

use std::collections::BTreeMap;

use alloy::primitives::keccak256;
use txflow_core::chain::BlockHeader;
use txflow_core::events::BlockRef;
use txflow_core::state::TxState;
use uuid::Uuid;

/// A block header as the events and `managed_tx.confirmations` carry it.
pub fn block_ref(h: &BlockHeader) -> BlockRef {
    BlockRef {
        number: i64::try_from(h.number).unwrap_or(i64::MAX),
        hash: format!("{:#x}", h.hash),
        parent_hash: format!("{:#x}", h.parent_hash),
    }
}

/// The canonical chain as one linked segment of blocks, from its lowest up to the head.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    head: u64,
    blocks: BTreeMap<u64, BlockRef>,
}

impl View {
    /// A view of `blocks` (the head's and consecutive ones below it, each the parent of the next;
    /// the heads follower checks that) with `head` the highest.
    pub fn new(head: u64, blocks: impl IntoIterator<Item = BlockRef>) -> View {
        View {
            head,
            blocks: blocks
                .into_iter()
                .filter_map(|b| u64::try_from(b.number).ok().map(|n| (n, b)))
                .filter(|(n, _)| *n <= head)
                .collect(),
        }
    }

    /// The number of the head block.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// The lowest block the view holds.
    pub fn lowest(&self) -> Option<u64> {
        self.blocks.keys().next().copied()
    }

    /// Whether block `hash` is the canonical one at `number`: `Some(false)` only when another
    /// block is, at a height the view holds; `None` when the view does not reach down to it, or
    /// when `number` is past the head. A head below a block seen before is an endpoint that has
    /// not seen that block yet (a lagging node after a failover), never proof that it is gone:
    /// a reorg is decided from a hash that differs at a height the endpoint has reached.
    pub fn holds(&self, number: u64, hash: &str) -> Option<bool> {
        if number > self.head {
            return None;
        }
        self.blocks
            .get(&number)
            .map(|b| b.hash.eq_ignore_ascii_case(hash))
    }

    /// The canonical blocks from `from` up to the head, at most `max` of them; `None` when the
    /// view does not hold `from`.
    pub fn list(&self, from: u64, max: u32) -> Option<Vec<BlockRef>> {
        self.blocks.get(&from)?;
        Some(
            self.blocks
                .range(from..)
                .take(usize::try_from(max).unwrap_or(usize::MAX))
                .map(|(_, b)| b.clone())
                .collect(),
        )
    }
}

/// Where a transaction the confirmation manager follows stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// MINED: counted toward CONFIRMED.
    Mined,
    /// REVERTED, not settled at depth yet.
    Reverted,
    /// Final (CONFIRMED, or REVERTED settled at depth), watched for a reorg deeper than the
    /// required depth.
    Final { reverted: bool },
    /// Final, then undone by a reorg deeper than the required depth: its outcome is re-evaluated
    /// (`managed_tx.reorged_at`).
    Reorged { reverted: bool },
}

impl Phase {
    /// The phase of a row: its state, whether it was settled at depth (`confirmed_at`), and
    /// whether a deep reorg undid it (`reorged_at`). `None` for a state it does not follow.
    pub fn of(state: TxState, settled: bool, reorged: bool) -> Option<Phase> {
        match state {
            TxState::Mined => Some(Phase::Mined),
            TxState::Reverted if reorged => Some(Phase::Reorged { reverted: true }),
            TxState::Reverted if settled => Some(Phase::Final { reverted: true }),
            TxState::Reverted => Some(Phase::Reverted),
            TxState::Confirmed if reorged => Some(Phase::Reorged { reverted: false }),
            TxState::Confirmed => Some(Phase::Final { reverted: false }),
            TxState::Received
            | TxState::Simulated
            | TxState::PendingApproval
            | TxState::Allocated
            | TxState::Signed
            | TxState::Submitted
            | TxState::Replaced
            | TxState::Failed => None,
        }
    }

    /// Whether the transaction succeeded (status 1) as far as its state says.
    pub fn success(self) -> bool {
        match self {
            Phase::Mined => true,
            Phase::Reverted => false,
            Phase::Final { reverted } | Phase::Reorged { reverted } => !reverted,
        }
    }
}

/// One followed transaction, as the decision needs it.
#[derive(Debug, Clone, Copy)]
pub struct Tracked<'a> {
    pub nonce: i64,
    pub phase: Phase,
    /// The block of its receipt (`mined_block_number`, `mined_block_hash`), if it has one.
    pub block: Option<(u64, &'a str)>,
    /// The list last announced (`managed_tx.confirmations`).
    pub announced: &'a [BlockRef],
    /// A final transaction is watched until the head reaches this block.
    pub watch_until: Option<u64>,
}

/// What the decision depends on besides the transaction and the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// Blocks (the transaction's own included) that make it final.
    pub required: u32,
    /// The lowest nonce of the signer's transactions not mined yet (ALLOCATED, SIGNED,
    /// SUBMITTED): a transaction at or above it is not made final before it, so that the
    /// signer's outcomes come in nonce order.
    pub lowest_unmined: Option<i64>,
}

/// A confirmation list to announce (a TxConfirmationsUpdated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    pub list: Vec<BlockRef>,
    pub new_fork: bool,
}

/// The move that makes a transaction final.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// MINED → CONFIRMED (CONFIRM).
    Confirm,
    /// REVERTED settled (SETTLE_REVERTED).
    Settle,
    /// CONFIRMED again after a deep reorg (RECONFIRM).
    Reconfirm,
}

/// What to do with one followed transaction now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing (no change, or its block is below what the view reaches yet).
    Idle,
    /// Announce its list, make it final, or both (the announcement first).
    Progress {
        announce: Option<Announcement>,
        finish: Option<Finish>,
    },
    /// Its block is gone before it was final: back to SUBMITTED (REORG), its receipt cleared,
    /// its signed bytes sent again; announced with `new_fork = true` and an empty list.
    Reorg,
    /// Its block is gone after it was final: a reorg deeper than the required depth. The
    /// critical alert; announced with `new_fork = true` and an empty list; its outcome is
    /// re-evaluated from now on.
    DeepReorg,
    /// Being re-evaluated after a deep reorg, the block it was mined in again is gone too:
    /// announced with `new_fork = true` and an empty list, still re-evaluated.
    LostAgain,
    /// Final and past its watch: no longer followed.
    Unwatch,
    /// Being re-evaluated after a deep reorg, with no block: what the chain says now decides
    /// ([`reevaluate`]).
    Reevaluate,
}

/// The announcement `list` makes after `announced`: none if it is the same list, or a part of
/// it that stops at a lower head (the endpoint has not seen the later blocks yet: nothing is
/// known to have changed); `new_fork = false` if it extends it; `true` if a block announced
/// before is replaced by another at a height the list reaches.
pub fn announcement(announced: &[BlockRef], list: &[BlockRef]) -> Option<Announcement> {
    if announced == list || (!list.is_empty() && announced.starts_with(list)) {
        return None;
    }
    Some(Announcement {
        list: list.to_vec(),
        new_fork: !list.starts_with(announced),
    })
}

/// What to do with `t` given the canonical chain `view`.
pub fn track(t: &Tracked<'_>, view: &View, rules: &Rules) -> Step {
    let Some((number, hash)) = t.block else {
        return match t.phase {
            Phase::Reorged { .. } => Step::Reevaluate,
            // Final with no block (a settled revert whose nonce another transaction consumed
            // after a deep reorg): nothing to watch, no longer followed.
            Phase::Final { .. } => Step::Unwatch,
            // A followed transaction without a block is not one a receipt moved here (a row
            // written by hand): nothing to count.
            Phase::Mined | Phase::Reverted => Step::Idle,
        };
    };
    match view.holds(number, hash) {
        None => Step::Idle,
        Some(false) => match t.phase {
            Phase::Mined | Phase::Reverted => Step::Reorg,
            Phase::Final { .. } => Step::DeepReorg,
            Phase::Reorged { .. } => Step::LostAgain,
        },
        Some(true) => {
            let Some(list) = view.list(number, rules.required) else {
                return Step::Idle;
            };
            let announce = announcement(t.announced, &list);
            let finish = match t.phase {
                Phase::Final { .. } => None,
                Phase::Mined => Some(Finish::Confirm),
                Phase::Reverted | Phase::Reorged { reverted: true } => Some(Finish::Settle),
                Phase::Reorged { reverted: false } => Some(Finish::Reconfirm),
            }
            .filter(|_| {
                list.len() >= usize::try_from(rules.required).unwrap_or(usize::MAX)
                    && rules.lowest_unmined.is_none_or(|l| t.nonce < l)
            });
            match (announce, finish) {
                (None, None) => match t.phase {
                    Phase::Final { .. } if t.watch_until.is_some_and(|w| view.head() >= w) => {
                        Step::Unwatch
                    }
                    _ => Step::Idle,
                },
                (announce, finish) => Step::Progress { announce, finish },
            }
        }
    }
}

/// The block up to which a final transaction is watched: `watch_blocks` past its own.
pub fn watch_until(block: u64, watch_blocks: u32) -> u64 {
    block.saturating_add(u64::from(watch_blocks))
}

/// The highest block that has the required depth at `head` (the one whose list from it up to
/// the head holds `required` blocks): where a nonce consumed is consumed for good. `None` while
/// the chain is shorter than the depth.
pub fn depth_block(head: u64, required: u32) -> Option<u64> {
    (head + 1).checked_sub(u64::from(required.max(1)))
}

/// What the chain shows of a transaction undone by a deep reorg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rechecked {
    /// One of its own attempts has a receipt in a canonical block: whether it succeeded.
    pub mined_success: Option<bool>,
    /// The signer's nonce at [`depth_block`] is past the transaction's: a transaction that is
    /// none of its own attempts (the defensive cancellation, or one sent outside txflow)
    /// consumed it, at the required depth.
    pub consumed_at_depth: bool,
}

/// The outcome of a transaction undone by a deep reorg, re-evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reevaluation {
    /// Its own attempt is mined again with the same outcome: followed again from that block
    /// (final again at the required depth, a TxConfirmed of the next generation).
    Remined,
    /// Its own attempt is mined again with the other outcome (it succeeded where it had
    /// reverted, or the reverse): left for an operator (ERROR), still re-evaluated.
    OutcomeChanged,
    /// Another transaction consumed its nonce at depth: a CONFIRMED one goes back to RECEIVED
    /// (re-evaluated, a fresh nonce); a REVERTED one keeps its outcome (it had no effect and
    /// has none).
    Undone,
    /// Neither yet: the defensive cancellation (or its own attempt) is still to be mined.
    Wait,
}

/// Re-evaluates a transaction undone by a deep reorg (`reverted`: its outcome was a revert).
/// Its own attempt mined is checked first: a receipt proves it, whatever the nonce says.
pub fn reevaluate(reverted: bool, facts: &Rechecked) -> Reevaluation {
    match facts.mined_success {
        Some(success) if success != reverted => Reevaluation::Remined,
        Some(_) => Reevaluation::OutcomeChanged,
        None if facts.consumed_at_depth => Reevaluation::Undone,
        None => Reevaluation::Wait,
    }
}

/// The `event_id` of a transaction's TxConfirmed: derived from its id and its deep-reorg
/// generation (`managed_tx.reorg_generation`), so that a re-emission after a crash or a replay
/// carries the same id, and only a reorg deeper than the required depth (announced with
/// `new_fork = true` first) ever gives a transaction a second one. A UUID of version 8 (custom):
/// the first 16 bytes of `keccak256("txflow/TxConfirmed/{tx_id}/{generation}")`.
pub fn confirmed_event_id(tx_id: Uuid, generation: i32) -> Uuid {
    let digest = keccak256(format!("txflow/TxConfirmed/{tx_id}/{generation}"));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// The `event_id` of the TxConfirmationReverted that reverts a transaction's TxConfirmed of
/// `generation`: one per transaction and generation, the same on a re-emission (the first 16
/// bytes of `keccak256("txflow/TxConfirmationReverted/{tx_id}/{generation}")`, a UUID of
/// version 8).
pub fn reversal_event_id(tx_id: Uuid, generation: i32) -> Uuid {
    let digest = keccak256(format!(
        "txflow/TxConfirmationReverted/{tx_id}/{generation}"
    ));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(number: u64, fork: u8) -> BlockRef {
        let parent_fork = if number == 0 { 0 } else { fork };
        let parent = number.saturating_sub(1);
        BlockRef {
            number: number as i64,
            hash: format!("0x{fork:02x}{number:062x}"),
            parent_hash: format!("0x{parent_fork:02x}{parent:062x}"),
        }
    }

    /// Blocks `0..=head`, the ones from `fork_at` on in fork `fork` (else fork 0).
    fn chain(head: u64, fork_at: u64, fork: u8) -> View {
        View::new(
            head,
            (0..=head).map(|n| block(n, if n >= fork_at { fork } else { 0 })),
        )
    }

    fn list(from: u64, to: u64, fork_at: u64, fork: u8) -> Vec<BlockRef> {
        (from..=to)
            .map(|n| block(n, if n >= fork_at { fork } else { 0 }))
            .collect()
    }

    const RULES: Rules = Rules {
        required: 3,
        lowest_unmined: None,
    };

    #[test]
    fn the_view_says_which_blocks_are_canonical_and_lists_them_up_to_the_depth() {
        let v = chain(10, 99, 0);
        let b5 = block(5, 0);
        assert_eq!(v.holds(5, &b5.hash), Some(true));
        assert_eq!(
            v.holds(5, &b5.hash.to_uppercase().replace("0X", "0x")),
            Some(true)
        );
        assert_eq!(v.holds(5, &block(5, 1).hash), Some(false));
        assert_eq!(
            v.holds(11, &block(11, 0).hash),
            None,
            "past the head: not known yet (a lagging endpoint), never gone"
        );
        let partial = View::new(10, (8..=10).map(|n| block(n, 0)));
        assert_eq!(partial.holds(5, &b5.hash), None, "below the view");
        assert_eq!(partial.lowest(), Some(8));
        assert_eq!(v.list(5, 3), Some(list(5, 7, 99, 0)));
        assert_eq!(v.list(9, 3), Some(list(9, 10, 99, 0)), "up to the head");
        assert_eq!(partial.list(5, 3), None);
    }

    #[test]
    fn announcements_extend_or_replace_what_was_announced() {
        let a = list(5, 6, 99, 0);
        type Case = (&'static str, Vec<BlockRef>, Vec<BlockRef>, Option<bool>);
        let cases: Vec<Case> = vec![
            ("first", vec![], list(5, 5, 99, 0), Some(false)),
            ("same", a.clone(), a.clone(), None),
            ("grown", a.clone(), list(5, 7, 99, 0), Some(false)),
            (
                "a later block replaced",
                a.clone(),
                list(5, 7, 6, 1),
                Some(true),
            ),
            (
                "the head went back (a lagging endpoint): nothing known to have changed",
                a.clone(),
                list(5, 5, 99, 0),
                None,
            ),
            (
                "the head went back, and the block it holds is another",
                a.clone(),
                list(5, 5, 5, 1),
                Some(true),
            ),
            (
                "its own block replaced",
                a.clone(),
                list(5, 7, 5, 1),
                Some(true),
            ),
        ];
        for (what, announced, now, expected) in cases {
            let got = announcement(&announced, &now);
            assert_eq!(got.as_ref().map(|a| a.new_fork), expected, "{what}");
            if let Some(a) = got {
                assert_eq!(a.list, now, "{what}: the complete list");
            }
        }
    }

    #[test]
    fn each_phase_on_each_chain_takes_its_step() {
        let b5 = block(5, 0);
        let announced2 = list(5, 6, 99, 0);
        let announced3 = list(5, 7, 99, 0);
        let t = |phase, announced: &'static [BlockRef], watch_until| Tracked {
            nonce: 4,
            phase,
            block: Some((5, Box::leak(b5.hash.clone().into_boxed_str()))),
            announced,
            watch_until,
        };
        let leak = |v: Vec<BlockRef>| -> &'static [BlockRef] { Box::leak(v.into_boxed_slice()) };
        let (none, two, three) = (leak(vec![]), leak(announced2), leak(announced3.clone()));
        let progress = |new_fork: Option<bool>, to: u64, finish| Step::Progress {
            announce: new_fork.map(|new_fork| Announcement {
                list: list(5, to, 99, 0),
                new_fork,
            }),
            finish,
        };
        let final_ok = Phase::Final { reverted: false };
        let reorged = Phase::Reorged { reverted: false };
        let cases: Vec<(&str, Tracked<'static>, View, Rules, Step)> = vec![
            (
                "mined, first block",
                t(Phase::Mined, none, None),
                chain(5, 99, 0),
                RULES,
                progress(Some(false), 5, None),
            ),
            (
                "mined, one more block",
                t(Phase::Mined, leak(list(5, 5, 99, 0)), None),
                chain(6, 99, 0),
                RULES,
                progress(Some(false), 6, None),
            ),
            (
                "mined, no new block",
                t(Phase::Mined, two, None),
                chain(6, 99, 0),
                RULES,
                Step::Idle,
            ),
            (
                "mined, at the depth: announced and confirmed",
                t(Phase::Mined, two, None),
                chain(7, 99, 0),
                RULES,
                progress(Some(false), 7, Some(Finish::Confirm)),
            ),
            (
                "mined, past the depth at once: the list stops at the depth",
                t(Phase::Mined, none, None),
                chain(20, 99, 0),
                RULES,
                progress(Some(false), 7, Some(Finish::Confirm)),
            ),
            (
                "mined at the depth, a lower nonce not mined yet: announced, not final",
                t(Phase::Mined, two, None),
                chain(7, 99, 0),
                Rules {
                    lowest_unmined: Some(3),
                    ..RULES
                },
                progress(Some(false), 7, None),
            ),
            (
                "then the lower nonce mined: final, nothing new to announce",
                t(Phase::Mined, three, None),
                chain(9, 99, 0),
                Rules {
                    lowest_unmined: Some(9),
                    ..RULES
                },
                progress(None, 7, Some(Finish::Confirm)),
            ),
            (
                "reverted at the depth: settled",
                t(Phase::Reverted, two, None),
                chain(7, 99, 0),
                RULES,
                progress(Some(false), 7, Some(Finish::Settle)),
            ),
            (
                "a later block replaced: new fork, complete list",
                t(Phase::Mined, two, None),
                chain(7, 6, 1),
                RULES,
                Step::Progress {
                    announce: Some(Announcement {
                        list: list(5, 7, 6, 1),
                        new_fork: true,
                    }),
                    finish: Some(Finish::Confirm),
                },
            ),
            (
                "its block replaced before the depth: reorg",
                t(Phase::Mined, two, None),
                chain(7, 5, 1),
                RULES,
                Step::Reorg,
            ),
            (
                "reverted, its block replaced: reorg",
                t(Phase::Reverted, two, None),
                chain(7, 5, 1),
                RULES,
                Step::Reorg,
            ),
            (
                "its block past a shorter head (a lagging endpoint): not known yet",
                t(Phase::Mined, two, None),
                chain(4, 99, 0),
                RULES,
                Step::Idle,
            ),
            (
                "final, its block past a shorter head: no deep reorg",
                t(final_ok, three, Some(12)),
                chain(4, 99, 0),
                RULES,
                Step::Idle,
            ),
            (
                "final, the head below its last announced block: nothing to announce",
                t(final_ok, three, Some(12)),
                chain(6, 99, 0),
                RULES,
                Step::Idle,
            ),
            (
                "mined, the head back at its own block: nothing to announce",
                t(Phase::Mined, two, None),
                chain(5, 99, 0),
                RULES,
                Step::Idle,
            ),
            (
                "below the view: nothing yet",
                t(Phase::Mined, two, None),
                View::new(9, (7..=9).map(|n| block(n, 0))),
                RULES,
                Step::Idle,
            ),
            (
                "final, unchanged, watched",
                t(final_ok, three, Some(12)),
                chain(9, 99, 0),
                RULES,
                Step::Idle,
            ),
            (
                "final, past the watch",
                t(final_ok, three, Some(12)),
                chain(12, 99, 0),
                RULES,
                Step::Unwatch,
            ),
            (
                "final, a block of its list replaced: new fork, still final",
                t(final_ok, three, Some(12)),
                chain(9, 7, 1),
                RULES,
                Step::Progress {
                    announce: Some(Announcement {
                        list: list(5, 7, 7, 1),
                        new_fork: true,
                    }),
                    finish: None,
                },
            ),
            (
                "final, its block replaced: deep reorg",
                t(final_ok, three, Some(12)),
                chain(9, 5, 1),
                RULES,
                Step::DeepReorg,
            ),
            (
                "settled revert, its block replaced: deep reorg",
                t(Phase::Final { reverted: true }, three, Some(12)),
                chain(9, 4, 1),
                RULES,
                Step::DeepReorg,
            ),
            (
                "re-mined after a deep reorg, at the depth: confirmed again",
                t(reorged, none, None),
                chain(7, 99, 0),
                RULES,
                progress(Some(false), 7, Some(Finish::Reconfirm)),
            ),
            (
                "re-mined after a deep reorg, lost again",
                t(reorged, two, None),
                chain(7, 5, 1),
                RULES,
                Step::LostAgain,
            ),
        ];
        for (what, tracked, view, rules, expected) in cases {
            assert_eq!(track(&tracked, &view, &rules), expected, "{what}");
        }
        let unmined = Tracked {
            block: None,
            ..t(reorged, none, None)
        };
        assert_eq!(track(&unmined, &chain(9, 99, 0), &RULES), Step::Reevaluate);
        let odd = Tracked {
            block: None,
            ..t(Phase::Mined, none, None)
        };
        assert_eq!(track(&odd, &chain(9, 99, 0), &RULES), Step::Idle);
        let blockless = Tracked {
            block: None,
            ..t(Phase::Final { reverted: true }, three, Some(12))
        };
        assert_eq!(
            track(&blockless, &chain(9, 99, 0), &RULES),
            Step::Unwatch,
            "final with no block to watch: no longer followed"
        );
    }

    #[test]
    fn phases_follow_state_and_marks() {
        use TxState::*;
        let cases = [
            (Mined, false, false, Some(Phase::Mined)),
            (Reverted, false, false, Some(Phase::Reverted)),
            (Reverted, true, false, Some(Phase::Final { reverted: true })),
            (
                Reverted,
                true,
                true,
                Some(Phase::Reorged { reverted: true }),
            ),
            (
                Confirmed,
                true,
                false,
                Some(Phase::Final { reverted: false }),
            ),
            (
                Confirmed,
                true,
                true,
                Some(Phase::Reorged { reverted: false }),
            ),
            (Submitted, false, false, None),
            (Simulated, false, true, None),
        ];
        for (state, settled, reorged, expected) in cases {
            assert_eq!(Phase::of(state, settled, reorged), expected, "{state}");
        }
        assert!(Phase::Mined.success() && !Phase::Reverted.success());
        assert!(!Phase::Reorged { reverted: true }.success());
    }

    #[test]
    fn a_deep_reorg_is_re_evaluated_on_the_chains_proof() {
        let cases = [
            (
                "its own attempt mined again",
                false,
                Some(true),
                false,
                Reevaluation::Remined,
            ),
            (
                "mined again, and the nonce is past too",
                false,
                Some(true),
                true,
                Reevaluation::Remined,
            ),
            (
                "mined again but reverted now",
                false,
                Some(false),
                false,
                Reevaluation::OutcomeChanged,
            ),
            (
                "a revert mined again reverting",
                true,
                Some(false),
                false,
                Reevaluation::Remined,
            ),
            (
                "a revert now succeeding",
                true,
                Some(true),
                false,
                Reevaluation::OutcomeChanged,
            ),
            (
                "the nonce consumed by another at depth",
                false,
                None,
                true,
                Reevaluation::Undone,
            ),
            ("nothing yet", false, None, false, Reevaluation::Wait),
        ];
        for (what, reverted, mined_success, consumed_at_depth, expected) in cases {
            let facts = Rechecked {
                mined_success,
                consumed_at_depth,
            };
            assert_eq!(reevaluate(reverted, &facts), expected, "{what}");
        }
    }

    #[test]
    fn the_depth_block_and_the_watch() {
        assert_eq!(depth_block(10, 3), Some(8));
        assert_eq!(depth_block(2, 3), Some(0));
        assert_eq!(depth_block(1, 3), None);
        assert_eq!(depth_block(5, 0), Some(5));
        assert_eq!(watch_until(5, 64), 69);
        assert_eq!(watch_until(u64::MAX, 64), u64::MAX);
    }

    #[test]
    fn the_confirmed_event_id_is_one_per_transaction_and_generation() {
        let a = Uuid::now_v7();
        let b = Uuid::now_v7();
        assert_eq!(confirmed_event_id(a, 0), confirmed_event_id(a, 0));
        assert_ne!(confirmed_event_id(a, 0), confirmed_event_id(a, 1));
        assert_ne!(confirmed_event_id(a, 0), confirmed_event_id(b, 0));
        assert_eq!(confirmed_event_id(a, 0).get_version_num(), 8);
        assert_eq!(reversal_event_id(a, 0), reversal_event_id(a, 0));
        assert_ne!(reversal_event_id(a, 0), reversal_event_id(a, 1));
        assert_ne!(reversal_event_id(a, 0), confirmed_event_id(a, 0));
    }
}
