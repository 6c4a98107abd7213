//! The broadcaster's decisions. Pure: no I/O, no async, no SQL — the handler gathers what the
//! node and PostgreSQL say and these functions say what it means.
//!
//! - [`classify_send`]: the node's answer to the send of a SIGNED transaction;
//! - [`nonce_too_low`] (with [`PassSearch`], shared with the receipt checker: txflow-domain
//!   `nonce_proof`): whose nonce it is when the node answers "nonce too low", on the chain's
//!   proof, and [`IntoSent`], what that makes of the send;
//! - [`split_due`] and [`classify_resend`]: the resubmission of submitted, unmined transactions;
//! - [`nonce_consumed`] and [`classify_cancellation`]: the defensive cancellation of a nonce after a
//!   deep reorg (seed 000 §4.4);
//! - [`send_again`] and [`send_backoff`]: a send that failed for now, sent again within the
//!   drive after a short bounded backoff.

use std::time::Duration;

use txflow_core::chain::SendOutcome;
use txflow_core::events::SubmitOutcome;
pub use txflow_core::nonce_proof::{
    NonceFacts, NonceTooLow, PassSearch, PassedIn, Search, needs_search, nonce_too_low,
};

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

/// What a [`NonceTooLow`] decision makes of a send.
pub trait IntoSent {
    /// The send's outcome; `reason` is the node's answer.
    fn into_sent(self, nonce: i64, reason: &str) -> Sent;
}

impl IntoSent for NonceTooLow {
    fn into_sent(self, nonce: i64, reason: &str) -> Sent {
        match self {
            NonceTooLow::PossiblySent => Sent::Submitted(SubmitOutcome::PossiblySent),
            NonceTooLow::Replaced { chain_nonce, block } => Sent::Replaced {
                chain_nonce,
                reason: format!(
                    "nonce {nonce} was used by a transaction txflow did not send (in block {block}, which holds none of its hashes; chain nonce {chain_nonce}; {reason})"
                ),
            },
            // Used outside txflow in a block that a reorg may still remove: the nonce stays
            // ours (not re-allocated) until that block is final.
            NonceTooLow::Undecided | NonceTooLow::NotFinal { .. } => Sent::Undecided,
        }
    }
}

/// Fee wordings among the node's "not now" refusals: a send refused for its fees is not sent
/// again within the drive (the fees do not change in a second; a bump does), the others are.
const FEE_REFUSALS: [&str; 5] = [
    "underpriced",
    "fee too low",
    "base fee",
    "gas price below",
    "could not replace",
];

/// Whether a send answered `outcome` is sent again within the drive, after
/// [`send_backoff`]: an answer that says the endpoint is busy or flaky ("rate limit", "timeout",
/// "txpool is full"…) or that is unknown (the node may have taken it: the same bytes sent again
/// are answered "already known" or "nonce too low", which settle it). Never an answer that
/// decides (accepted, already known, refused for good, "nonce too low", "insufficient funds"),
/// nor a refusal for the fees, which waits for the recovery scan and the gas bump as before.
pub fn send_again(outcome: &SendOutcome) -> bool {
    match outcome {
        SendOutcome::Unknown { .. } => true,
        SendOutcome::Rejected {
            retryable: true,
            reason,
        } => {
            let reason = reason.to_lowercase();
            !FEE_REFUSALS.iter().any(|w| reason.contains(w))
        }
        SendOutcome::Accepted
        | SendOutcome::PossiblySent { .. }
        | SendOutcome::NonceTooLow { .. }
        | SendOutcome::InsufficientFunds { .. }
        | SendOutcome::Rejected {
            retryable: false, ..
        } => false,
    }
}

/// The pauses between the sends of one SIGNED transaction within a drive: 100 ms, doubling.
pub const SEND_BACKOFF_FIRST: Duration = Duration::from_millis(100);
/// How many times one transaction is sent again within a drive (the last pause 1.6 s, all of
/// them 3.1 s: well inside a lease, which the runtime renews during the drive anyway).
pub const SEND_RETRIES: u32 = 5;

/// The pause before the next send of a transaction whose `failures` sends (1 or more) of this
/// drive failed for now ([`send_again`], or an RPC error that is transient), or `None`: the drive
/// stops there, the transaction stays SIGNED with its nonce and the recovery scan sends it again.
/// A flaky endpoint (one send in a few failing, after the client's own rounds) then costs a
/// pause, not a recovery interval per failure; a dead one stops the drive after a bounded
/// while, later nonces never sent before this one.
pub fn send_backoff(failures: u32) -> Option<Duration> {
    if failures == 0 || failures > SEND_RETRIES {
        return None;
    }
    Some(SEND_BACKOFF_FIRST.saturating_mul(1 << (failures - 1)))
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

/// Whether the chain's latest nonce `latest` (the signer's mined transactions) is past `nonce`:
/// a defensive cancellation of it is not sent then — the cancellation or the original is mined,
/// and the confirmation manager tells which.
pub fn nonce_consumed(nonce: i64, latest: u64) -> bool {
    // A nonce is never negative (the column's check); one that were could not be sent.
    u64::try_from(nonce).map_or(true, |n| n < latest)
}

/// What became of the send of a defensive cancellation. Nothing here moves a state: its
/// bookkeeping is recorded (sent again every `resubmit_interval` while it is due) and the
/// confirmation manager re-evaluates the transaction from the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelSent {
    /// A node took it (accepted or already known).
    Taken,
    /// "nonce too low": its nonce is used (the cancellation or the original mined, or a
    /// transaction txflow did not send); never a "whose nonce" proof, which is the confirmation
    /// manager's.
    Consumed,
    /// The signer cannot pay: hold the signer and stop.
    Hold(String),
    /// The node refused it, or its answer is unknown: looked at again at the next interval.
    /// `alert` when the refusal is for good: the nonce stays unprotected until an operator acts.
    NotTaken { reason: String, alert: bool },
}

/// Classifies the node's answer to the send of a defensive cancellation.
pub fn classify_cancellation(outcome: SendOutcome) -> CancelSent {
    match outcome {
        SendOutcome::Accepted | SendOutcome::PossiblySent { .. } => CancelSent::Taken,
        SendOutcome::NonceTooLow { .. } => CancelSent::Consumed,
        SendOutcome::InsufficientFunds { reason } => CancelSent::Hold(reason),
        SendOutcome::Rejected {
            retryable: false,
            reason,
        } => CancelSent::NotTaken {
            reason,
            alert: true,
        },
        // Retryable (e.g. "replacement transaction underpriced": a node holds the original at
        // fees the cap kept the cancellation under), or unknown: the next interval tries again.
        SendOutcome::Rejected {
            retryable: true,
            reason,
        }
        | SendOutcome::Unknown { reason } => CancelSent::NotTaken {
            reason,
            alert: false,
        },
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

    #[test]
    fn a_cancellation_is_sent_while_its_nonce_is_free_and_never_proven_whose() {
        type Case = (i64, u64, bool);
        let cases: Vec<Case> = vec![
            (4, 4, false),
            (4, 3, false),
            (4, 5, true),
            (0, 1, true),
            (-1, 0, true),
        ];
        for (nonce, latest, consumed) in cases {
            assert_eq!(
                nonce_consumed(nonce, latest),
                consumed,
                "{nonce} at {latest}"
            );
        }
        let answers: Vec<(SendOutcome, CancelSent)> = vec![
            (SendOutcome::Accepted, CancelSent::Taken),
            (
                SendOutcome::PossiblySent {
                    reason: r("already known"),
                },
                CancelSent::Taken,
            ),
            // Used: by the cancellation, the original or anything else; the confirmation manager
            // re-evaluates from the chain.
            (
                SendOutcome::NonceTooLow {
                    reason: r("nonce too low"),
                },
                CancelSent::Consumed,
            ),
            (
                SendOutcome::InsufficientFunds {
                    reason: r("insufficient funds"),
                },
                CancelSent::Hold(r("insufficient funds")),
            ),
            (
                SendOutcome::Rejected {
                    retryable: true,
                    reason: r("replacement transaction underpriced"),
                },
                CancelSent::NotTaken {
                    reason: r("replacement transaction underpriced"),
                    alert: false,
                },
            ),
            (
                SendOutcome::Rejected {
                    retryable: false,
                    reason: r("invalid sender"),
                },
                CancelSent::NotTaken {
                    reason: r("invalid sender"),
                    alert: true,
                },
            ),
            (
                SendOutcome::Unknown {
                    reason: r("-32000: something"),
                },
                CancelSent::NotTaken {
                    reason: r("-32000: something"),
                    alert: false,
                },
            ),
        ];
        for (outcome, want) in answers {
            assert_eq!(classify_cancellation(outcome.clone()), want, "{outcome:?}");
        }
    }
    #[test]
    fn a_send_that_failed_for_now_is_sent_again_a_few_times_doubling_the_pause() {
        let ms = Duration::from_millis;
        let pauses: Vec<Option<Duration>> = (0..=7).map(send_backoff).collect();
        assert_eq!(
            pauses,
            vec![
                None,
                Some(ms(100)),
                Some(ms(200)),
                Some(ms(400)),
                Some(ms(800)),
                Some(ms(1600)),
                None,
                None
            ]
        );
        assert_eq!(send_backoff(u32::MAX), None);
        // Every pause of one transaction together stays well inside a lease.
        let total: Duration = (1..=SEND_RETRIES).filter_map(send_backoff).sum();
        assert_eq!(total, ms(3100));
        assert!(total * 3 < txflow_core::lease::LeaseConfig::default().duration);
    }

    #[test]
    fn only_answers_about_the_endpoint_or_unknown_ones_are_sent_again_within_the_drive() {
        let again = |retryable: bool, reason: &str| {
            send_again(&SendOutcome::Rejected {
                retryable,
                reason: r(reason),
            })
        };
        for reason in [
            "rate limit reached, retry later",
            "Too Many Requests",
            "request timed out",
            "node is syncing",
            "txpool is full",
        ] {
            assert!(again(true, reason), "{reason}");
        }
        for reason in [
            "replacement transaction underpriced",
            "FEE_TOO_LOW: fee too low",
            "max fee per gas less than block base fee",
            "Gas price below current base fee",
            "NOT_REPLACED: could not replace existing tx",
        ] {
            assert!(
                !again(true, reason),
                "a fee refusal waits for a bump: {reason}"
            );
        }
        assert!(!again(false, "invalid sender"), "refused for good");
        assert!(send_again(&SendOutcome::Unknown {
            reason: r("upstream relay hiccup")
        }));
        for decided in [
            SendOutcome::Accepted,
            SendOutcome::PossiblySent {
                reason: r("already known"),
            },
            SendOutcome::NonceTooLow {
                reason: r("nonce too low"),
            },
            SendOutcome::InsufficientFunds {
                reason: r("insufficient funds"),
            },
        ] {
            assert!(!send_again(&decided), "{decided:?} decides");
        }
    }
}
