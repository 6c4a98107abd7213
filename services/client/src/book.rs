//! The downstream contract of docs/events.md ("Booking from tx.outcomes"), pure: events in,
//! a per-transaction final view out. No I/O, so a team can feed it from its own consumer.

use std::collections::{BTreeMap, HashSet};

use txflow_domain::events::{
    ReceiptStatus, TxAccepted, TxConfirmationReverted, TxConfirmationsUpdated, TxConfirmed,
    TxFailed, TxReceiptUpdated, TxSubmitted,
};

/// One decoded event of `tx.outcomes` (or `tx.confirmations`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Accepted(TxAccepted),
    Submitted(TxSubmitted),
    Receipt(TxReceiptUpdated),
    Confirmed(TxConfirmed),
    ConfirmationReverted(TxConfirmationReverted),
    Failed(TxFailed),
    /// From `tx.confirmations`: the confirming blocks, `new_fork` after a reorg.
    Confirmations(TxConfirmationsUpdated),
}

impl Outcome {
    pub fn tx_id(&self) -> &str {
        match self {
            Outcome::Accepted(e) => &e.tx_id,
            Outcome::Submitted(e) => &e.tx_id,
            Outcome::Receipt(e) => &e.tx_id,
            Outcome::Confirmed(e) => &e.tx_id,
            Outcome::ConfirmationReverted(e) => &e.tx_id,
            Outcome::Failed(e) => &e.tx_id,
            Outcome::Confirmations(e) => &e.tx_id,
        }
    }
}

/// How far a transaction has come, in the state machine's order. A late or redelivered event
/// never moves a transaction back; only a confirmation reversal does (to [`Progress::Mined`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Progress {
    Accepted,
    Submitted,
    /// A receipt was seen (mined, reverted on chain, or replaced): not final.
    Mined,
    /// Final: booked ([`TxView::booked`]) or failed ([`TxView::failed`]).
    Final,
}

/// What a TxConfirmed said, as booked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booking {
    pub event_id: String,
    pub generation: i32,
    pub success: bool,
    pub nonce: i64,
    pub tx_hash: String,
    pub block_number: i64,
    pub block_hash: String,
}

/// One transaction as downstream sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TxView {
    pub tx_id: String,
    /// Empty until an event that carries it (TxAccepted, TxConfirmed, TxFailed) is read.
    pub request_id: String,
    pub chain_id: i64,
    pub signer: String,
    pub progress: Option<Progress>,
    /// The standing booking: `Some` exactly while a TxConfirmed stands unreversed.
    pub booked: Option<Booking>,
    /// The TxFailed, if one came: (code, reason).
    pub failed: Option<(String, String)>,
    /// Bookings reversed so far.
    pub reversals: u32,
    /// `new_fork` confirmation lists read (only with `tx.confirmations`).
    pub new_forks: u32,
}

impl TxView {
    /// Executed on the chain as far as downstream knows: a TxConfirmed stands.
    pub fn executed(&self) -> bool {
        self.booked.is_some()
    }
}

/// What was done to the books, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Book { tx_id: String, generation: i32 },
    Reverse { tx_id: String, generation: i32 },
}

/// The per-transaction final view built from events in any order and with any duplicates.
#[derive(Debug, Default, Clone)]
pub struct Book {
    outcomes_seen: HashSet<String>,
    lists_seen: HashSet<String>,
    txs: BTreeMap<String, TxView>,
    /// Generations whose TxConfirmed is reversed: a late copy of it is never booked again.
    reverted: HashSet<(String, i32)>,
    journal: Vec<Entry>,
}

impl Book {
    pub fn new() -> Book {
        Book::default()
    }

    /// Applies one event read with `event_id` (its header). Returns false for a duplicate (an
    /// `event_id` already applied from the same topic), which changes nothing.
    pub fn apply(&mut self, event_id: &str, event: Outcome) -> bool {
        // A reversal and its new_fork list share an event_id, on two topics.
        let seen = match event {
            Outcome::Confirmations(_) => &mut self.lists_seen,
            _ => &mut self.outcomes_seen,
        };
        if !seen.insert(event_id.to_string()) {
            return false;
        }
        let tx_id = event.tx_id().to_string();
        let view = self.txs.entry(tx_id.clone()).or_insert_with(|| TxView {
            tx_id: tx_id.clone(),
            ..TxView::default()
        });
        let advance = |view: &mut TxView, p: Progress| {
            if view.progress.is_none_or(|q| q < p) {
                view.progress = Some(p);
            }
        };
        match event {
            Outcome::Accepted(e) => {
                fill(view, &e.request_id, e.chain_id, &e.signer);
                advance(view, Progress::Accepted);
            }
            Outcome::Submitted(e) => {
                fill(view, "", e.chain_id, &e.signer);
                advance(view, Progress::Submitted);
            }
            Outcome::Receipt(e) => {
                fill(view, "", e.chain_id, &e.signer);
                match e.status {
                    ReceiptStatus::Mined | ReceiptStatus::Reverted | ReceiptStatus::Replaced => {
                        advance(view, Progress::Mined)
                    }
                }
            }
            Outcome::Confirmed(c) => {
                fill(view, &c.request_id, c.chain_id, &c.signer);
                let g = c.reorg_generation;
                if self.reverted.contains(&(tx_id.clone(), g)) {
                    // A late copy of a TxConfirmed already reversed.
                    return true;
                }
                match &view.booked {
                    // A later generation is booked already: this one is history.
                    Some(b) if b.generation > g => return true,
                    // A lower generation stands: its reversal has not been read yet, but a
                    // higher generation implies it.
                    Some(b) if b.generation < g => {
                        let lower = b.generation;
                        self.journal.push(Entry::Reverse {
                            tx_id: tx_id.clone(),
                            generation: lower,
                        });
                        self.reverted.insert((tx_id.clone(), lower));
                        view.reversals += 1;
                    }
                    _ => {}
                }
                view.booked = Some(Booking {
                    event_id: c.event_id.clone(),
                    generation: g,
                    success: c.success,
                    nonce: c.nonce,
                    tx_hash: c.tx_hash.clone(),
                    block_number: c.block_number,
                    block_hash: c.block_hash.clone(),
                });
                view.progress = Some(Progress::Final);
                self.journal.push(Entry::Book {
                    tx_id,
                    generation: g,
                });
            }
            Outcome::ConfirmationReverted(r) => {
                fill(view, &r.request_id, r.chain_id, &r.signer);
                let g = r.reorg_generation;
                if view.booked.as_ref().is_some_and(|b| b.generation == g) {
                    view.booked = None;
                    view.reversals += 1;
                    if view.failed.is_none() {
                        view.progress = Some(Progress::Mined);
                    }
                    self.journal.push(Entry::Reverse {
                        tx_id: tx_id.clone(),
                        generation: g,
                    });
                }
                self.reverted.insert((tx_id, g));
            }
            Outcome::Failed(f) => {
                fill(view, &f.request_id, f.chain_id, &f.signer);
                view.failed = Some((f.code, f.reason));
                view.progress = Some(Progress::Final);
            }
            Outcome::Confirmations(l) => {
                fill(view, "", l.chain_id, &l.signer);
                if l.new_fork {
                    view.new_forks += 1;
                }
            }
        }
        true
    }

    /// Every transaction seen, by `tx_id`.
    pub fn views(&self) -> impl Iterator<Item = &TxView> {
        self.txs.values()
    }

    pub fn get(&self, tx_id: &str) -> Option<&TxView> {
        self.txs.get(tx_id)
    }

    /// The transactions of one request (normally one) of `signer` (any case).
    pub fn by_request(&self, signer: &str, request_id: &str) -> Vec<&TxView> {
        self.txs
            .values()
            .filter(|v| v.request_id == request_id && v.signer.eq_ignore_ascii_case(signer))
            .collect()
    }

    /// Whether an event of `tx.outcomes` with this `event_id` was read.
    pub fn has_outcome(&self, event_id: &str) -> bool {
        self.outcomes_seen.contains(event_id)
    }

    /// Distinct events of `tx.outcomes` read.
    pub fn outcomes_read(&self) -> usize {
        self.outcomes_seen.len()
    }

    /// Bookings and reversals, in the order they were made.
    pub fn journal(&self) -> &[Entry] {
        &self.journal
    }
}

fn fill(view: &mut TxView, request_id: &str, chain_id: i64, signer: &str) {
    if view.request_id.is_empty() && !request_id.is_empty() {
        view.request_id = request_id.to_string();
    }
    if view.signer.is_empty() {
        view.signer = signer.to_ascii_lowercase();
        view.chain_id = chain_id;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn confirmed(tx: &str, g: i32, event_id: &str, success: bool) -> Outcome {
        Outcome::Confirmed(TxConfirmed {
            event_id: event_id.into(),
            tx_id: tx.into(),
            request_id: format!("r-{tx}"),
            chain_id: 1,
            signer: "0xAB".into(),
            nonce: 0,
            tx_hash: format!("0x{g}"),
            block_number: 10 + i64::from(g),
            block_hash: format!("0xb{g}"),
            success,
            confirmations: 3,
            fencing_token: 1,
            reorg_generation: g,
            revert_reason: None,
        })
    }

    fn reversal(tx: &str, g: i32, event_id: &str) -> Outcome {
        Outcome::ConfirmationReverted(TxConfirmationReverted {
            event_id: event_id.into(),
            tx_id: tx.into(),
            request_id: format!("r-{tx}"),
            chain_id: 1,
            signer: "0xab".into(),
            nonce: 0,
            tx_hash: format!("0x{g}"),
            block_number: 10,
            block_hash: "0xb".into(),
            success: true,
            reorg_generation: g,
            reverted_event_id: format!("c{g}"),
            required_confirmations: 3,
            fencing_token: 1,
        })
    }

    fn submitted(tx: &str, event_id: &str) -> (String, Outcome) {
        (
            event_id.into(),
            Outcome::Submitted(TxSubmitted {
                event_id: event_id.into(),
                tx_id: tx.into(),
                chain_id: 1,
                signer: "0xab".into(),
                nonce: 0,
                attempt: 1,
                tx_hash: "0x1".into(),
                outcome: txflow_domain::events::SubmitOutcome::Accepted,
                submitted_at_ms: 0,
                fencing_token: 1,
            }),
        )
    }

    #[test]
    fn a_duplicate_changes_nothing() {
        let mut b = Book::new();
        assert!(b.apply("c0", confirmed("t", 0, "c0", true)));
        assert!(!b.apply("c0", confirmed("t", 0, "c0", true)));
        assert_eq!(b.journal().len(), 1);
        assert_eq!(b.by_request("0xab", "r-t").len(), 1);
    }

    #[test]
    fn a_late_submission_never_moves_a_final_transaction_back() {
        let mut b = Book::new();
        b.apply("c0", confirmed("t", 0, "c0", true));
        let (id, e) = submitted("t", "s1");
        b.apply(&id, e);
        let v = b.get("t").expect("seen");
        assert_eq!(v.progress, Some(Progress::Final));
        assert!(v.executed());
    }

    #[test]
    fn a_reversal_unbooks_and_the_next_generation_books_again() {
        let mut b = Book::new();
        b.apply("c0", confirmed("t", 0, "c0", true));
        b.apply("x0", reversal("t", 0, "x0"));
        assert!(!b.get("t").expect("seen").executed());
        assert_eq!(b.get("t").expect("seen").progress, Some(Progress::Mined));
        b.apply("c1", confirmed("t", 1, "c1", false));
        let v = b.get("t").expect("seen");
        assert_eq!(
            v.booked.as_ref().map(|x| (x.generation, x.success)),
            Some((1, false))
        );
        assert_eq!(v.reversals, 1);
    }

    #[test]
    fn a_reversal_read_before_its_confirmation_keeps_that_generation_unbooked() {
        let mut b = Book::new();
        b.apply("x0", reversal("t", 0, "x0"));
        b.apply("c0", confirmed("t", 0, "c0", true));
        assert!(!b.get("t").expect("seen").executed());
    }

    #[test]
    fn a_higher_generation_read_first_implies_the_lower_ones_reversal() {
        let mut b = Book::new();
        b.apply("c0", confirmed("t", 0, "c0", true));
        b.apply("c1", confirmed("t", 1, "c1", true));
        b.apply("x0", reversal("t", 0, "x0"));
        let v = b.get("t").expect("seen");
        assert_eq!(v.booked.as_ref().map(|x| x.generation), Some(1));
        assert_eq!(v.reversals, 1, "generation 0 reversed once, not twice");
        // A stale copy of generation 0 books nothing.
        b.apply("c0-copy", confirmed("t", 0, "c0", true));
        assert_eq!(
            b.get("t")
                .and_then(|v| v.booked.as_ref())
                .map(|x| x.generation),
            Some(1)
        );
    }

    #[test]
    fn the_new_fork_list_and_its_reversal_share_an_event_id_and_both_count() {
        let mut b = Book::new();
        b.apply("c0", confirmed("t", 0, "c0", true));
        let r = match reversal("t", 0, "x0") {
            Outcome::ConfirmationReverted(r) => r,
            _ => unreachable!(),
        };
        assert!(b.apply("x0", Outcome::Confirmations(r.new_fork())));
        assert!(b.apply("x0", Outcome::ConfirmationReverted(r)));
        let v = b.get("t").expect("seen");
        assert_eq!((v.new_forks, v.reversals, v.executed()), (1, 1, false));
    }
}
