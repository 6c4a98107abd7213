//! Whose nonce it is, on the chain's proof: the pure decision shared by the broadcaster (after a
//! node answered "nonce too low") and the receipt checker (the signer's nonce passed ours and no
//! receipt came for any of our hashes). A hash or receipt lookup that says "unknown" proves
//! nothing (a lagging, pruned or lying node says so of a mined transaction); only the block where
//! the signer's nonce passed ours does ([`PassSearch`] finds it, [`nonce_too_low`] decides).
//!
//! Pure: no I/O, no async. The stages gather the facts (txflow-core `chain::passed_in` runs the
//! search against a `ChainClient`).

use alloy_primitives::B256;

/// Whose nonce it is, after "nonce too low" (broadcaster) or when the signer's nonce passed ours
/// with no receipt for our hashes (receipt checker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonceTooLow {
    /// The chain knows one of the transaction's hashes (pooled, mined, or in the block where the
    /// signer's nonce passed ours): ours, possibly sent.
    PossiblySent,
    /// Proven used outside txflow: block `block` is where the signer's nonce passed ours, and
    /// none of our hashes is in it, and that block has the required confirmations (it is final:
    /// our transaction can no longer be mined). `chain_nonce` is the signer's latest nonce.
    Replaced { chain_nonce: u64, block: u64 },
    /// Used outside txflow as far as the chain shows now, but in block `block`, which has only
    /// `confirmations` of the `required`: a reorg may still remove it, and then our transaction
    /// can be mined. The transaction keeps its nonce (not re-allocated) until the block is final.
    NotFinal {
        block: u64,
        confirmations: u64,
        required: u32,
    },
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
    /// The head the search started from: `head - block + 1` confirmations of `block`.
    pub head: u64,
}

/// What the chain said about one nonce ("nonce too low", or passed with no receipt), gathered
/// by the handler. Facts not asked (a lookup that was not needed, or failed) are `false` /
/// `None`.
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
    /// The confirmations (its own block counted) that make the block where the nonce passed
    /// final: [`NonceTooLow::Replaced`] only then. 0 and 1 both mean at once.
    pub required: u32,
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
    let confirmations = (passed.head + 1).saturating_sub(passed.block);
    if confirmations < u64::from(facts.required) {
        return NonceTooLow::NotFinal {
            block: passed.block,
            confirmations,
            required: facts.required,
        };
    }
    NonceTooLow::Replaced {
        chain_nonce: latest,
        block: passed.block,
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

#[cfg(test)]
mod tests {
    use super::*;

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
                head: block,
            }),
            required: 1,
        }
    }

    #[test]
    fn replaced_only_once_the_block_that_used_the_nonce_is_final() {
        use NonceTooLow::*;
        let at = |head: u64, required: u32| NonceFacts {
            passed_in: Some(PassedIn {
                block: 7,
                transactions: vec![h(5)],
                head,
            }),
            required,
            ..facts(&[1], false, Some(4), None)
        };
        // (head, required) → decision
        for (head, required, want) in [
            (
                7,
                3,
                NotFinal {
                    block: 7,
                    confirmations: 1,
                    required: 3,
                },
            ),
            (
                8,
                3,
                NotFinal {
                    block: 7,
                    confirmations: 2,
                    required: 3,
                },
            ),
            (
                9,
                3,
                Replaced {
                    chain_nonce: 4,
                    block: 7,
                },
            ),
            (
                20,
                3,
                Replaced {
                    chain_nonce: 4,
                    block: 7,
                },
            ),
            (
                7,
                1,
                Replaced {
                    chain_nonce: 4,
                    block: 7,
                },
            ),
            (
                7,
                0,
                Replaced {
                    chain_nonce: 4,
                    block: 7,
                },
            ),
        ] {
            assert_eq!(
                nonce_too_low(3, &at(head, required)),
                want,
                "head {head}, {required}"
            );
        }
        // Ours in that block: ours, final or not.
        let mut ours = at(7, 3);
        if let Some(p) = ours.passed_in.as_mut() {
            p.transactions.push(h(1));
        }
        assert_eq!(nonce_too_low(3, &ours), PossiblySent);
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
}
