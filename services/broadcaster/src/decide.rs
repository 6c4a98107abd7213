//! The broadcaster's decisions. Pure: no I/O, no async, no SQL — the handler gathers what the
//! node and PostgreSQL say and these functions say what it means.
//!
//! - [`classify_send`]: the node's answer to the send of a SIGNED transaction;
//! - [`nonce_too_low`] (with [`PassSearch`]): whose nonce it is when the node answers "nonce too
//!   low", on the chain's proof;
//! - [`split_due`] and [`classify_resend`]: the resubmission of submitted, unmined transactions.

use alloy::primitives::B256;
use txflow_core::chain::SendOutcome;
use txflow_core::events::SubmitOutcome;

/// What became of one SIGNED transaction's send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// A node accepted it, or may have (already known, or "nonce too low" for one of its own
    /// hashes): SIGNED → SUBMITTED.
    Submitted(SubmitOutcome),
    /// Its nonce was used by a transaction txflow did not send: SIGNED → REPLACED, and the
    /// allocator re-allocates a fresh nonce.
    Replaced { chain_nonce: u64, reason: String },
    /// The node refuses it for good: SIGNED → FAILED, its nonce released.
    Refused(String),
    /// The signer cannot pay: hold the signer (nothing fails) and stop.
    Hold(String),
    /// The node refuses it for now, or its answer is unknown (it may have taken it): stop, the
    /// transaction stays SIGNED with its nonce and the recovery scan sends it again.
    Wait(String),
    /// "nonce too low" and whose nonce it is cannot be told yet: stop, try again later.
    Undecided,
}

/// A [`Sent`] that is recorded (a state change).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Submitted(SubmitOutcome),
    Replaced { chain_nonce: u64, reason: String },
    Refused(String),
}

/// A [`Sent`] that stops the signer's sends: later nonces would only queue behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    Hold(String),
    Wait(String),
    Undecided,
}

impl Sent {
    /// What to record, or why to stop sending.
    pub fn split(self) -> Result<Record, Stop> {
        match self {
            Sent::Submitted(outcome) => Ok(Record::Submitted(outcome)),
            Sent::Replaced {
                chain_nonce,
                reason,
            } => Ok(Record::Replaced {
                chain_nonce,
                reason,
            }),
            Sent::Refused(reason) => Ok(Record::Refused(reason)),
            Sent::Hold(reason) => Err(Stop::Hold(reason)),
            Sent::Wait(reason) => Err(Stop::Wait(reason)),
            Sent::Undecided => Err(Stop::Undecided),
        }
    }
}

/// The node's answer to a send, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Decided(Sent),
    /// "nonce too low": the chain's view decides ([`nonce_too_low`]).
    NonceTooLow {
        reason: String,
    },
}

/// Classifies the node's answer to the send of a SIGNED transaction.
pub fn classify_send(outcome: SendOutcome) -> Answer {
    let sent = match outcome {
        SendOutcome::Accepted => Sent::Submitted(SubmitOutcome::Accepted),
        SendOutcome::PossiblySent { .. } => Sent::Submitted(SubmitOutcome::PossiblySent),
        SendOutcome::NonceTooLow { reason } => return Answer::NonceTooLow { reason },
        SendOutcome::InsufficientFunds { reason } => Sent::Hold(reason),
        SendOutcome::Rejected {
            retryable: true,
            reason,
        } => Sent::Wait(reason),
        SendOutcome::Rejected {
            retryable: false,
            reason,
        } => Sent::Refused(reason),
        // The node may have taken it: never a refusal (which would release its nonce while it
        // may still be mined). The same bytes sent again are answered "already known" or
        // "nonce too low", which settle it.
        SendOutcome::Unknown { reason } => Sent::Wait(reason),
    };
    Answer::Decided(sent)
}

/// Whose nonce it is, after "nonce too low".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonceTooLow {
    /// The chain knows one of the transaction's hashes (pooled, mined, or in the block where the
    /// signer's nonce passed ours): ours, possibly sent.
    PossiblySent,
    /// Proven used outside txflow: block `block` is where the signer's nonce passed ours, and
    /// none of our hashes is in it. `chain_nonce` is the signer's latest nonce.
    Replaced { chain_nonce: u64, block: u64 },
    /// Neither can be told yet: no hash recorded, the chain's nonce not past ours, a lookup that
    /// failed, or an answer that does not add up. The transaction stays as it is.
    Undecided,
}

/// The block in which the signer's nonce passed ours, as the chain shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassedIn {
    /// The first block at which the signer's nonce is past ours (the one before is not).
    pub block: u64,
    /// That block's transaction hashes.
    pub transactions: Vec<B256>,
}

/// What the chain said about one "nonce too low", gathered by the handler. Facts not asked
/// (a lookup that was not needed, or failed) are `false` / `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NonceFacts {
    /// The hashes of the transaction's attempts.
    pub ours: Vec<B256>,
    /// The node knows one of them by hash (`eth_getTransactionByHash`) or has its receipt.
    pub known: bool,
    /// The signer's latest (mined) nonce.
    pub latest: Option<u64>,
    /// Where the signer's nonce passed ours ([`PassSearch`]), and that block's transactions.
    pub passed_in: Option<PassedIn>,
}

/// Whether the chain's blocks must be searched for the one where the signer's nonce passed
/// `nonce`: no hash of ours is known, and the signer's latest nonce is past ours.
pub fn needs_search(nonce: i64, facts: &NonceFacts) -> bool {
    !facts.known
        && !facts.ours.is_empty()
        && u64::try_from(nonce).is_ok_and(|n| facts.latest.is_some_and(|l| l > n))
}

/// "nonce too low" for our `nonce`: whose it is, on the chain's proof. A hash lookup that says
/// "unknown" proves nothing (a lagging, pruned or lying node says so of a mined transaction);
/// only the block where the signer's nonce passed ours does: ours if one of our hashes is in
/// it, another transaction's if none is.
pub fn nonce_too_low(nonce: i64, facts: &NonceFacts) -> NonceTooLow {
    if facts.known {
        return NonceTooLow::PossiblySent;
    }
    if !needs_search(nonce, facts) {
        return NonceTooLow::Undecided;
    }
    let (Some(latest), Some(passed)) = (facts.latest, &facts.passed_in) else {
        return NonceTooLow::Undecided;
    };
    if passed.transactions.iter().any(|h| facts.ours.contains(h)) {
        return NonceTooLow::PossiblySent;
    }
    // A nonce passes in a block only by a transaction of that block (the genesis state aside):
    // an empty block after the genesis is an answer that does not add up.
    if passed.block > 0 && passed.transactions.is_empty() {
        return NonceTooLow::Undecided;
    }
    NonceTooLow::Replaced {
        chain_nonce: latest,
        block: passed.block,
    }
}

impl NonceTooLow {
    /// The send's outcome; `reason` is the node's answer.
    pub fn into_sent(self, nonce: i64, reason: &str) -> Sent {
        match self {
            NonceTooLow::PossiblySent => Sent::Submitted(SubmitOutcome::PossiblySent),
            NonceTooLow::Replaced { chain_nonce, block } => Sent::Replaced {
                chain_nonce,
                reason: format!(
                    "nonce {nonce} was used by a transaction txflow did not send (in block {block}, which holds none of its hashes; chain nonce {chain_nonce}; {reason})"
                ),
            },
            NonceTooLow::Undecided => Sent::Undecided,
        }
    }
}

/// The search for the first block at which the signer's nonce is past ours (`nonce_at(B) >
/// nonce` and `nonce_at(B - 1) <= nonce`): the head first (it must be past), then back from it
/// in doubling steps (the block is most often recent, and a node without archive state still
/// answers for recent blocks), then a binary search between the last block not past and the
/// first past. Pure: [`PassSearch::next`] says which block's nonce to ask,
/// [`PassSearch::answer`] takes the answer. At most [`PassSearch::MAX_PROBES`] questions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassSearch {
    nonce: u64,
    head: u64,
    /// The lowest block known past our nonce (`None`: the head not asked yet).
    past: Option<u64>,
    /// The highest block known not past it (`None`: still stepping back).
    before: Option<u64>,
    /// The next step back from `past`.
    step: u64,
    probes: u32,
    failed: Option<&'static str>,
}

/// What to do next in a [`PassSearch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Search {
    /// Ask the signer's nonce at this block.
    Ask(u64),
    /// The first block past our nonce.
    Found(u64),
    /// The answers do not add up (or there were too many): undecided.
    Failed(&'static str),
}

impl PassSearch {
    /// Two searches' worth over a 64-bit chain: stepping back and the binary search each take
    /// at most 64 questions, after the head.
    pub const MAX_PROBES: u32 = 130;

    /// The search for our `nonce` below the `head` block.
    pub fn new(nonce: u64, head: u64) -> PassSearch {
        PassSearch {
            nonce,
            head,
            past: None,
            before: None,
            step: 1,
            probes: 0,
            failed: None,
        }
    }

    /// The block to ask about, or the search's end.
    fn probe(&self) -> Result<u64, Search> {
        if let Some(why) = self.failed {
            return Err(Search::Failed(why));
        }
        match (self.past, self.before) {
            (None, _) => Ok(self.head),
            (Some(0), _) => Err(Search::Found(0)),
            (Some(past), None) => Ok(past - self.step.min(past)),
            (Some(past), Some(before)) if before.saturating_add(1) >= past => {
                Err(Search::Found(past))
            }
            (Some(past), Some(before)) => Ok(before + 1 + (past - before - 1) / 2),
        }
    }

    /// What to do next.
    pub fn next(&self) -> Search {
        match self.probe() {
            Ok(_) if self.probes >= Self::MAX_PROBES => {
                Search::Failed("too many questions to find the block")
            }
            Ok(block) => Search::Ask(block),
            Err(end) => end,
        }
    }

    /// The signer's nonce at the block [`PassSearch::next`] asked about.
    pub fn answer(&mut self, count: u64) {
        let Ok(block) = self.probe() else { return };
        self.probes = self.probes.saturating_add(1);
        let is_past = count > self.nonce;
        match self.past {
            None if is_past => self.past = Some(block),
            None => self.failed = Some("the signer's nonce at the head is not past ours"),
            Some(_) if is_past => {
                self.past = Some(block);
                if self.before.is_none() {
                    self.step = self.step.saturating_mul(2);
                }
            }
            Some(_) => self.before = Some(block),
        }
    }
}

/// Due resubmissions, split by the chain's latest nonce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due<T> {
    /// Their nonce is below the chain's: mined (by them or another transaction), no longer
    /// tracked for resubmission.
    pub passed: Vec<T>,
    /// To send again, in the given (nonce) order.
    pub resend: Vec<T>,
}

/// Splits due resubmissions by `chain_nonce`, the signer's latest (mined) nonce: the ones below
/// it have been passed, the others are sent again.
pub fn split_due<T>(due: Vec<T>, chain_nonce: u64, nonce: impl Fn(&T) -> i64) -> Due<T> {
    // A nonce is never negative (the column's check); one that were would be passed, not sent.
    let (passed, resend) = due
        .into_iter()
        .partition(|d| u64::try_from(nonce(d)).map_or(true, |n| n < chain_nonce));
    Due { passed, resend }
}

/// What became of a resubmission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resent {
    /// Sent again (accepted, already known, or its nonce already used): recorded.
    Sent,
    /// The node refused it, or its answer is unknown: recorded all the same (still SUBMITTED,
    /// its nonce kept), sent again at the next interval.
    Refused(String),
    /// The signer cannot pay: hold the signer and stop.
    Hold(String),
}

/// Classifies the node's answer to a resubmission.
pub fn classify_resend(outcome: SendOutcome) -> Resent {
    match outcome {
        SendOutcome::Accepted
        | SendOutcome::PossiblySent { .. }
        | SendOutcome::NonceTooLow { .. } => Resent::Sent,
        SendOutcome::InsufficientFunds { reason } => Resent::Hold(reason),
        SendOutcome::Rejected { reason, .. } | SendOutcome::Unknown { reason } => {
            Resent::Refused(reason)
        }
    }
}

/// What a drive's sends say about the signer's funds, for its hold (`txflow_core::holds`): the
/// hold clears only when a node took a send, never on an RPC error, a refusal, a replaced nonce
/// or an undecided answer, which say nothing about the account (the `signer_held` alert would
/// come and go on every transient error).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Funds {
    /// No send said anything about the funds: the hold stays as it is.
    #[default]
    Untold,
    /// A node took a send (accepted, already known, or "nonce too low" for one of its own
    /// hashes): the hold clears.
    Paid,
    /// A send was refused for insufficient funds: the signer is held.
    Short,
}

impl Funds {
    /// The verdict of two sends of one drive: a refusal for funds wins over a send taken (the
    /// hold neither clears nor is set again within a drive), a send taken over nothing said.
    pub fn and(self, other: Funds) -> Funds {
        self.max(other)
    }
}

impl Record {
    /// What a recorded send says about the funds: submitted means a node took it; a permanent
    /// refusal or a nonce used outside txflow say nothing.
    pub fn funds(&self) -> Funds {
        match self {
            Record::Submitted(_) => Funds::Paid,
            Record::Replaced { .. } | Record::Refused(_) => Funds::Untold,
        }
    }
}

impl Stop {
    /// What a stopped send says about the funds: short when held, nothing otherwise.
    pub fn funds(&self) -> Funds {
        match self {
            Stop::Hold(_) => Funds::Short,
            Stop::Wait(_) | Stop::Undecided => Funds::Untold,
        }
    }
}

/// What the node's answer to a resubmission says about the funds: accepted or already known is a
/// send taken; "insufficient funds" is short; every other answer ("nonce too low", recorded all
/// the same, or a refusal) says nothing.
pub fn resend_funds(outcome: &SendOutcome) -> Funds {
    match outcome {
        SendOutcome::Accepted | SendOutcome::PossiblySent { .. } => Funds::Paid,
        SendOutcome::InsufficientFunds { .. } => Funds::Short,
        _ => Funds::Untold,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> String {
        s.to_string()
    }

    #[test]
    fn each_send_answer_has_its_outcome() {
        let cases: Vec<(SendOutcome, Answer)> = vec![
            (
                SendOutcome::Accepted,
                Answer::Decided(Sent::Submitted(SubmitOutcome::Accepted)),
            ),
            (
                SendOutcome::PossiblySent {
                    reason: r("already known"),
                },
                Answer::Decided(Sent::Submitted(SubmitOutcome::PossiblySent)),
            ),
            (
                SendOutcome::NonceTooLow {
                    reason: r("nonce too low"),
                },
                Answer::NonceTooLow {
                    reason: r("nonce too low"),
                },
            ),
            (
                SendOutcome::InsufficientFunds {
                    reason: r("insufficient funds"),
                },
                Answer::Decided(Sent::Hold(r("insufficient funds"))),
            ),
            (
                SendOutcome::Rejected {
                    retryable: true,
                    reason: r("underpriced"),
                },
                Answer::Decided(Sent::Wait(r("underpriced"))),
            ),
            (
                SendOutcome::Rejected {
                    retryable: false,
                    reason: r("invalid sender"),
                },
                Answer::Decided(Sent::Refused(r("invalid sender"))),
            ),
            // An answer no one knows: the node may have taken it, so wait, never refuse.
            (
                SendOutcome::Unknown {
                    reason: r("-32000: something went wrong"),
                },
                Answer::Decided(Sent::Wait(r("-32000: something went wrong"))),
            ),
        ];
        for (outcome, want) in cases {
            assert_eq!(classify_send(outcome.clone()), want, "{outcome:?}");
        }
    }

    #[test]
    fn an_unknown_send_error_stops_the_sends_and_records_nothing() {
        let outcome = txflow_core::chain::classify_send_error(-32000, "upstream said: 0xdeadbeef");
        assert!(
            matches!(outcome, SendOutcome::Unknown { .. }),
            "{outcome:?}"
        );
        let Answer::Decided(sent) = classify_send(outcome.clone()) else {
            panic!("decided without the chain");
        };
        assert_eq!(
            sent.split(),
            Err(Stop::Wait(r("-32000: upstream said: 0xdeadbeef")))
        );
        assert_eq!(
            classify_resend(outcome),
            Resent::Refused(r("-32000: upstream said: 0xdeadbeef"))
        );
    }

    #[test]
    fn holds_waits_and_undecided_sends_stop_the_others_are_recorded() {
        let cases: Vec<(Sent, Result<Record, Stop>)> = vec![
            (
                Sent::Submitted(SubmitOutcome::Accepted),
                Ok(Record::Submitted(SubmitOutcome::Accepted)),
            ),
            (
                Sent::Replaced {
                    chain_nonce: 5,
                    reason: r("x"),
                },
                Ok(Record::Replaced {
                    chain_nonce: 5,
                    reason: r("x"),
                }),
            ),
            (Sent::Refused(r("no")), Ok(Record::Refused(r("no")))),
            (Sent::Hold(r("poor")), Err(Stop::Hold(r("poor")))),
            (Sent::Wait(r("later")), Err(Stop::Wait(r("later")))),
            (Sent::Undecided, Err(Stop::Undecided)),
        ];
        for (sent, want) in cases {
            assert_eq!(sent.clone().split(), want, "{sent:?}");
        }
    }

    fn h(n: u8) -> B256 {
        B256::repeat_byte(n)
    }

    /// Facts: our hashes, known by lookup, latest nonce, where the nonce passed (block, hashes).
    fn facts(
        ours: &[u8],
        known: bool,
        latest: Option<u64>,
        passed_in: Option<(u64, &[u8])>,
    ) -> NonceFacts {
        NonceFacts {
            ours: ours.iter().map(|n| h(*n)).collect(),
            known,
            latest,
            passed_in: passed_in.map(|(block, txs)| PassedIn {
                block,
                transactions: txs.iter().map(|n| h(*n)).collect(),
            }),
        }
    }

    #[test]
    fn nonce_too_low_is_replaced_only_on_the_chains_proof() {
        use NonceTooLow::*;
        // (our nonce, facts) → (search needed, decision)
        type Case = (i64, NonceFacts, bool, NonceTooLow);
        let cases: Vec<Case> = vec![
            // A lookup by hash or by receipt found one of ours: ours, whatever else is said.
            (3, facts(&[1], true, None, None), false, PossiblySent),
            (
                3,
                facts(&[1], true, Some(9), Some((7, &[2]))),
                false,
                PossiblySent,
            ),
            (3, facts(&[1, 2], true, Some(0), None), false, PossiblySent),
            // Unknown by hash, the chain past ours, and our hash is in the block where the
            // nonce passed: ours (a lagging or lying lookup), never replaced.
            (
                3,
                facts(&[1], false, Some(4), Some((7, &[5, 1, 6]))),
                true,
                PossiblySent,
            ),
            (
                3,
                facts(&[1, 2], false, Some(9), Some((7, &[2]))),
                true,
                PossiblySent,
            ),
            // Unknown by hash, and the block where the nonce passed holds none of ours: proven
            // used outside txflow.
            (
                3,
                facts(&[1], false, Some(4), Some((7, &[5, 6]))),
                true,
                Replaced {
                    chain_nonce: 4,
                    block: 7,
                },
            ),
            (
                0,
                facts(&[1, 2], false, Some(100), Some((1, &[9]))),
                true,
                Replaced {
                    chain_nonce: 100,
                    block: 1,
                },
            ),
            // Passed in the genesis state: no transaction at all, still not ours.
            (
                0,
                facts(&[1], false, Some(1), Some((0, &[]))),
                true,
                Replaced {
                    chain_nonce: 1,
                    block: 0,
                },
            ),
            // Unknown by hash, the chain past ours, but where it passed is not known (a lookup
            // failed, historical state missing, an inconsistent answer, no such block): the
            // hash lookup alone is no proof.
            (3, facts(&[1], false, Some(4), None), true, Undecided),
            (0, facts(&[1], false, Some(100), None), true, Undecided),
            // A block after the genesis that passed the nonce without a transaction: does not
            // add up.
            (
                3,
                facts(&[1], false, Some(4), Some((7, &[]))),
                true,
                Undecided,
            ),
            // The chain is not past our nonce (yet): cannot tell.
            (
                3,
                facts(&[1], false, Some(3), Some((7, &[5]))),
                false,
                Undecided,
            ),
            (3, facts(&[1], false, Some(2), None), false, Undecided),
            // No hash recorded: cannot tell whose it is.
            (
                3,
                facts(&[], false, Some(9), Some((7, &[5]))),
                false,
                Undecided,
            ),
            // The chain's nonce is not known.
            (
                3,
                facts(&[1], false, None, Some((7, &[5]))),
                false,
                Undecided,
            ),
            // A nonce that cannot be (negative): undecided, never replaced.
            (
                -1,
                facts(&[1], false, Some(9), Some((7, &[5]))),
                false,
                Undecided,
            ),
        ];
        for (nonce, f, search, want) in cases {
            assert_eq!(needs_search(nonce, &f), search, "nonce {nonce}, {f:?}");
            assert_eq!(nonce_too_low(nonce, &f), want, "nonce {nonce}, {f:?}");
        }
    }

    #[test]
    fn a_nonce_too_low_decision_becomes_a_send_outcome() {
        let cases: Vec<(NonceTooLow, Sent)> = vec![
            (
                NonceTooLow::PossiblySent,
                Sent::Submitted(SubmitOutcome::PossiblySent),
            ),
            (
                NonceTooLow::Replaced {
                    chain_nonce: 8,
                    block: 41,
                },
                Sent::Replaced {
                    chain_nonce: 8,
                    reason: r(
                        "nonce 3 was used by a transaction txflow did not send (in block 41, which holds none of its hashes; chain nonce 8; -32003: nonce too low)",
                    ),
                },
            ),
            (NonceTooLow::Undecided, Sent::Undecided),
        ];
        for (decision, want) in cases {
            assert_eq!(
                decision.into_sent(3, "-32003: nonce too low"),
                want,
                "{decision:?}"
            );
        }
    }

    /// Runs a search against `count` (the signer's nonce at a block); the end and the blocks
    /// asked, in order.
    fn search(nonce: u64, head: u64, count: impl Fn(u64) -> u64) -> (Search, Vec<u64>) {
        let mut s = PassSearch::new(nonce, head);
        let mut asked = Vec::new();
        loop {
            match s.next() {
                Search::Ask(block) => {
                    assert!(block <= head, "asked past the head: {block} > {head}");
                    asked.push(block);
                    s.answer(count(block));
                }
                end => return (end, asked),
            }
        }
    }

    #[test]
    fn the_search_finds_the_first_block_past_our_nonce() {
        // (our nonce, head, the first block whose nonce is past ours) → found there.
        let cases: Vec<(u64, u64, u64)> = vec![
            (0, 0, 0),
            (0, 1, 1),
            (0, 1, 0),
            (0, 5, 3),
            (4, 5, 5),
            (4, 1_000_000, 999_990),
            (4, 1_000_000, 1),
            (4, 1_000_000, 0),
            (7, u64::MAX, 0),
            (7, u64::MAX, u64::MAX),
            (7, u64::MAX, u64::MAX / 3),
            (7, u64::MAX, u64::MAX - 1),
        ];
        for (nonce, head, at) in cases {
            // One transaction of the signer per block from `at` on: its nonce passes ours there.
            let count = |b: u64| {
                if b >= at {
                    nonce + 1 + (b - at).min(9)
                } else {
                    nonce
                }
            };
            let (end, asked) = search(nonce, head, count);
            assert_eq!(
                end,
                Search::Found(at),
                "nonce {nonce}, head {head}, at {at}"
            );
            assert!(
                asked.len() as u32 <= PassSearch::MAX_PROBES,
                "{} questions",
                asked.len()
            );
            // Within twice the binary logarithm of the distance from the head, plus a few.
            let distance = head - at;
            let bound = 2 * (64 - distance.leading_zeros()) + 3;
            assert!(
                asked.len() as u32 <= bound,
                "nonce {nonce}, head {head}, at {at}: {} questions, bound {bound}",
                asked.len()
            );
        }
        // Every placement on a short chain, and a recent block is found by recent questions
        // only (a node without archive state answers those).
        for head in 0..40u64 {
            for at in 0..=head {
                let (end, _) = search(0, head, |b| u64::from(b >= at));
                assert_eq!(end, Search::Found(at), "head {head}, at {at}");
            }
        }
        let (_, asked) = search(4, 20_000_000, |b| if b >= 19_999_995 { 5 } else { 4 });
        assert!(
            asked.iter().all(|b| *b >= 19_999_995 - 16),
            "stepped back no further than needed: {asked:?}"
        );
    }

    #[test]
    fn a_search_whose_answers_do_not_add_up_fails_or_finds_a_true_passing_point() {
        // The head is not past our nonce (a node behind the one that said "nonce too low").
        assert_eq!(
            search(3, 10, |_| 3).0,
            Search::Failed("the signer's nonce at the head is not past ours")
        );
        assert_eq!(search(3, 0, |_| 0).0, search(3, 10, |_| 2).0);
        // Answers that go up and down (a reorg, endpoints that disagree): the search still ends,
        // and what it finds passes our nonce where the block before it did not, as answered.
        let weird: Vec<Box<dyn Fn(u64) -> u64>> = vec![
            Box::new(|b| if b % 2 == 0 { 5 } else { 3 }),
            Box::new(|b| if b % 3 == 0 { 3 } else { 5 }),
            Box::new(|b| 9 - (b % 10)),
            Box::new(|b| if b > 50 && b < 60 { 3 } else { 4 }),
        ];
        for (i, count) in weird.iter().enumerate() {
            for head in [10u64, 99, 1_000, u64::MAX - 1] {
                if count(head) <= 3 {
                    continue;
                }
                let (end, asked) = search(3, head, count);
                let Search::Found(at) = end else {
                    panic!("case {i}, head {head}: {end:?}");
                };
                assert!(count(at) > 3, "case {i}, head {head}: found {at}");
                assert!(
                    at == 0 || (asked.contains(&(at - 1)) && count(at - 1) <= 3),
                    "case {i}, head {head}: the block before {at} was asked and not past"
                );
            }
        }
        // Asked no more once ended; an answer without a question changes nothing.
        let mut s = PassSearch::new(0, 1);
        s.answer(0);
        let failed = s.clone();
        s.answer(5);
        assert_eq!(s, failed);
    }

    #[test]
    fn due_resubmissions_below_the_chain_nonce_are_passed_the_others_resent() {
        // (nonces in order, chain nonce) → (passed, resent)
        type Case = (Vec<i64>, u64, Vec<i64>, Vec<i64>);
        let cases: Vec<Case> = vec![
            (vec![], 5, vec![], vec![]),
            (vec![1, 2, 3], 0, vec![], vec![1, 2, 3]),
            (vec![1, 2, 3], 2, vec![1], vec![2, 3]),
            (vec![1, 2, 3], 3, vec![1, 2], vec![3]),
            (vec![1, 2, 3], 4, vec![1, 2, 3], vec![]),
            (vec![7], 7, vec![], vec![7]),
        ];
        for (due, chain, passed, resend) in cases {
            let got = split_due(due.clone(), chain, |n| *n);
            assert_eq!(
                got,
                Due { passed, resend },
                "{due:?} at chain nonce {chain}"
            );
        }
    }

    #[test]
    fn each_resubmission_answer_has_its_outcome() {
        let cases: Vec<(SendOutcome, Resent)> = vec![
            (SendOutcome::Accepted, Resent::Sent),
            (
                SendOutcome::PossiblySent {
                    reason: r("already known"),
                },
                Resent::Sent,
            ),
            (
                SendOutcome::NonceTooLow {
                    reason: r("nonce too low"),
                },
                Resent::Sent,
            ),
            (
                SendOutcome::InsufficientFunds {
                    reason: r("insufficient funds"),
                },
                Resent::Hold(r("insufficient funds")),
            ),
            (
                SendOutcome::Rejected {
                    retryable: true,
                    reason: r("underpriced"),
                },
                Resent::Refused(r("underpriced")),
            ),
            (
                SendOutcome::Rejected {
                    retryable: false,
                    reason: r("invalid"),
                },
                Resent::Refused(r("invalid")),
            ),
            // Unknown: still SUBMITTED with its nonce, sent again at the next interval.
            (
                SendOutcome::Unknown {
                    reason: r("-32000: something went wrong"),
                },
                Resent::Refused(r("-32000: something went wrong")),
            ),
        ];
        for (outcome, want) in cases {
            assert_eq!(classify_resend(outcome.clone()), want, "{outcome:?}");
        }
    }

    #[test]
    fn only_a_send_taken_clears_the_hold_and_a_refusal_for_funds_wins() {
        use Funds::*;
        let records: Vec<(Record, Funds)> = vec![
            (Record::Submitted(SubmitOutcome::Accepted), Paid),
            (Record::Submitted(SubmitOutcome::PossiblySent), Paid),
            (
                Record::Replaced {
                    chain_nonce: 5,
                    reason: r("x"),
                },
                Untold,
            ),
            (Record::Refused(r("no")), Untold),
        ];
        for (record, want) in records {
            assert_eq!(record.funds(), want, "{record:?}");
        }
        let stops: Vec<(Stop, Funds)> = vec![
            (Stop::Hold(r("poor")), Short),
            (Stop::Wait(r("later")), Untold),
            (Stop::Undecided, Untold),
        ];
        for (stop, want) in stops {
            assert_eq!(stop.funds(), want, "{stop:?}");
        }
        let resends: Vec<(SendOutcome, Funds)> = vec![
            (SendOutcome::Accepted, Paid),
            (
                SendOutcome::PossiblySent {
                    reason: r("already known"),
                },
                Paid,
            ),
            (
                SendOutcome::NonceTooLow {
                    reason: r("nonce too low"),
                },
                Untold,
            ),
            (
                SendOutcome::InsufficientFunds {
                    reason: r("insufficient funds"),
                },
                Short,
            ),
            (
                SendOutcome::Rejected {
                    retryable: true,
                    reason: r("underpriced"),
                },
                Untold,
            ),
            (
                SendOutcome::Rejected {
                    retryable: false,
                    reason: r("invalid"),
                },
                Untold,
            ),
        ];
        for (outcome, want) in resends {
            assert_eq!(resend_funds(&outcome), want, "{outcome:?}");
        }
        // (first, second) → the drive's verdict, in either order.
        let pairs = [
            (Untold, Untold, Untold),
            (Untold, Paid, Paid),
            (Untold, Short, Short),
            (Paid, Paid, Paid),
            (Paid, Short, Short),
            (Short, Short, Short),
        ];
        for (a, b, want) in pairs {
            assert_eq!(a.and(b), want, "{a:?} and {b:?}");
            assert_eq!(b.and(a), want, "{b:?} and {a:?}");
        }
        assert_eq!(Funds::default(), Untold);
    }
}
