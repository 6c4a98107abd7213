//! Offset planning, pure: from what became of each message of a batch, which offset to store per
//! partition and where to rewind per partition so that the messages to retry come again.
//!
//! A consumer reads each partition in offset order and a stored offset means "everything up to
//! here is done", so within a partition:
//! - the messages to retry come again from the first of them: the partition is rewound (sought) to
//!   that offset, and every message after it comes again too, done or not (handlers are
//!   idempotent: a done message re-emits the same outputs);
//! - the offset stored is the last done message before the first retry, never one at or past a
//!   message to retry (else a crash or a rebalance would skip it).
//!
//! [`Settled`] covers the one kind of message that must not simply come again: one dead-lettered
//! for a [`HandlerError::Fail`](super::HandlerError::Fail) while an earlier message of its
//! partition is retried. Run again it would fail again; it is remembered and skipped instead.

use std::collections::{BTreeMap, BTreeSet};

/// What became of one message of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Handled, dead-lettered or skipped: it need not come again.
    Done,
    /// It must come again (busy or lost lease, transient failure, behind such a message).
    Retry,
}

/// What to do with the offsets after a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OffsetPlan {
    /// Per partition, the offset of the last message that is done before any message to retry
    /// (the consumer commits the next one).
    pub store: BTreeMap<i32, i64>,
    /// Per partition, the first message to retry: where to rewind.
    pub seek: BTreeMap<i32, i64>,
}

impl OffsetPlan {
    /// Plans from `(partition, offset, outcome)` of every message of a batch, in any order.
    pub fn new(messages: impl IntoIterator<Item = (i32, i64, Outcome)>) -> OffsetPlan {
        let messages: Vec<(i32, i64, Outcome)> = messages.into_iter().collect();
        let mut seek: BTreeMap<i32, i64> = BTreeMap::new();
        for &(p, off, outcome) in &messages {
            if outcome == Outcome::Retry {
                let first = seek.entry(p).or_insert(off);
                *first = (*first).min(off);
            }
        }
        let mut store: BTreeMap<i32, i64> = BTreeMap::new();
        for &(p, off, outcome) in &messages {
            if outcome == Outcome::Done && seek.get(&p).is_none_or(|first| off < *first) {
                let last = store.entry(p).or_insert(off);
                *last = (*last).max(off);
            }
        }
        OffsetPlan { store, seek }
    }

    /// True when some messages must come again.
    pub fn retries(&self) -> bool {
        !self.seek.is_empty()
    }
}

/// Messages dead-lettered out of order (see the module documentation), per partition: skipped
/// when they come again, forgotten once an offset past them is stored or their partition is
/// revoked (another instance taking the partition may run such a message once more; it fails and
/// is dead-lettered again, at most once per hand-over).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    by_partition: BTreeMap<i32, BTreeSet<i64>>,
}

impl Settled {
    pub fn insert(&mut self, partition: i32, offset: i64) {
        self.by_partition
            .entry(partition)
            .or_default()
            .insert(offset);
    }

    pub fn contains(&self, partition: i32, offset: i64) -> bool {
        self.by_partition
            .get(&partition)
            .is_some_and(|s| s.contains(&offset))
    }

    /// The offsets of `plan` were stored: what they cover need not be remembered.
    pub fn stored(&mut self, plan: &OffsetPlan) {
        for (p, last) in &plan.store {
            if let Some(s) = self.by_partition.get_mut(p) {
                s.retain(|off| off > last);
                if s.is_empty() {
                    self.by_partition.remove(p);
                }
            }
        }
    }

    /// The partitions went to another instance.
    pub fn revoked(&mut self, partitions: &[i32]) {
        for p in partitions {
            self.by_partition.remove(p);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_partition.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::Outcome::{Done, Retry};
    use super::*;
    use proptest::prelude::*;

    fn plan(messages: &[(i32, i64, Outcome)]) -> OffsetPlan {
        OffsetPlan::new(messages.iter().copied())
    }

    fn map(entries: &[(i32, i64)]) -> BTreeMap<i32, i64> {
        entries.iter().copied().collect()
    }

    #[test]
    fn all_done_stores_the_last_offset_of_each_partition() {
        let p = plan(&[(0, 10, Done), (1, 3, Done), (0, 11, Done), (0, 12, Done)]);
        assert_eq!(p.store, map(&[(0, 12), (1, 3)]));
        assert!(p.seek.is_empty());
        assert!(!p.retries());
    }

    #[test]
    fn a_retry_rewinds_to_it_and_stores_only_what_precedes_it() {
        let p = plan(&[(0, 10, Done), (0, 11, Retry), (0, 12, Done), (0, 13, Retry)]);
        assert_eq!(p.store, map(&[(0, 10)]));
        assert_eq!(p.seek, map(&[(0, 11)]));
        assert!(p.retries());
    }

    #[test]
    fn a_retry_first_stores_nothing_for_its_partition_only() {
        let p = plan(&[(0, 10, Retry), (0, 11, Done), (1, 5, Done)]);
        assert_eq!(p.store, map(&[(1, 5)]));
        assert_eq!(p.seek, map(&[(0, 10)]));
    }

    #[test]
    fn order_of_the_input_does_not_matter() {
        let p = plan(&[(0, 13, Done), (0, 12, Retry), (0, 11, Done), (0, 14, Retry)]);
        assert_eq!(p.store, map(&[(0, 11)]));
        assert_eq!(p.seek, map(&[(0, 12)]));
    }

    #[test]
    fn an_empty_batch_plans_nothing() {
        assert_eq!(plan(&[]), OffsetPlan::default());
    }

    #[test]
    fn settled_offsets_are_forgotten_once_stored_past_or_revoked() {
        let mut s = Settled::default();
        s.insert(0, 12);
        s.insert(0, 20);
        s.insert(1, 4);
        assert!(s.contains(0, 12) && s.contains(1, 4) && !s.contains(0, 11));
        // The rewind to 11 is done: 11 and 12 came again, 12 was skipped, 13.. are later.
        s.stored(&plan(&[(0, 11, Done), (0, 12, Done), (0, 13, Retry)]));
        assert!(!s.contains(0, 12));
        assert!(s.contains(0, 20));
        s.revoked(&[0]);
        assert!(!s.contains(0, 20));
        assert!(s.contains(1, 4));
        s.stored(&plan(&[(1, 4, Done)]));
        assert!(s.is_empty());
    }

    /// Batches as a consumer sees them: per partition a run of consecutive offsets from some
    /// start (the order across partitions does not matter, see the last property).
    fn batch() -> impl Strategy<Value = Vec<(i32, i64, Outcome)>> {
        let outcome = prop_oneof![3 => Just(Done), 1 => Just(Retry)];
        let run = (0..4i32, 0..1_000i64, prop::collection::vec(outcome, 0..30));
        prop::collection::vec(run, 0..4).prop_map(|runs| {
            let mut seen = BTreeSet::new();
            runs.into_iter()
                .filter(|(p, _, _)| seen.insert(*p))
                .flat_map(|(p, start, outcomes)| {
                    outcomes
                        .into_iter()
                        .enumerate()
                        .map(move |(i, o)| (p, start + i as i64, o))
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn never_stores_at_or_past_a_retried_message(messages in batch()) {
            let plan = OffsetPlan::new(messages.iter().copied());
            for &(p, off, outcome) in &messages {
                if outcome == Retry {
                    prop_assert!(plan.store.get(&p).is_none_or(|s| *s < off),
                        "stored {:?} at or past retried {off} of partition {p}", plan.store.get(&p));
                }
            }
        }

        #[test]
        fn rewinds_to_the_first_retried_message(messages in batch()) {
            let plan = OffsetPlan::new(messages.iter().copied());
            let partitions: BTreeSet<i32> = messages.iter().map(|m| m.0).collect();
            for p in partitions {
                let first = messages.iter().filter(|m| m.0 == p && m.2 == Retry).map(|m| m.1).min();
                prop_assert_eq!(plan.seek.get(&p).copied(), first);
            }
            prop_assert!(plan.seek.keys().all(|p| messages.iter().any(|m| m.0 == *p)));
        }

        #[test]
        fn stores_the_last_done_message_before_the_first_retry(messages in batch()) {
            let plan = OffsetPlan::new(messages.iter().copied());
            let partitions: BTreeSet<i32> = messages.iter().map(|m| m.0).collect();
            for p in partitions {
                let first_retry = plan.seek.get(&p).copied().unwrap_or(i64::MAX);
                let last_done = messages
                    .iter()
                    .filter(|m| m.0 == p && m.2 == Done && m.1 < first_retry)
                    .map(|m| m.1)
                    .max();
                prop_assert_eq!(plan.store.get(&p).copied(), last_done);
                // Everything of the partition up to the stored offset is done.
                if let Some(stored) = plan.store.get(&p) {
                    prop_assert!(messages
                        .iter()
                        .filter(|m| m.0 == p && m.1 <= *stored)
                        .all(|m| m.2 == Done));
                }
            }
            prop_assert!(plan.store.keys().all(|p| messages.iter().any(|m| m.0 == *p)));
        }

        #[test]
        fn a_message_more_to_retry_never_stores_further(messages in batch(), pick in any::<prop::sample::Index>()) {
            let before = OffsetPlan::new(messages.iter().copied());
            let mut worse = messages.clone();
            if !worse.is_empty() {
                let i = pick.index(worse.len());
                worse[i].2 = Retry;
            }
            let after = OffsetPlan::new(worse.iter().copied());
            for (p, stored) in &after.store {
                prop_assert!(before.store.get(p).is_some_and(|b| stored <= b),
                    "partition {p}: {:?} then {stored}", before.store.get(p));
            }
            for (p, first) in &before.seek {
                prop_assert!(after.seek.get(p).is_some_and(|a| a <= first));
            }
        }

        #[test]
        fn the_plan_does_not_depend_on_the_order_of_the_batch(
            (messages, shuffled) in batch().prop_flat_map(|m| (Just(m.clone()), Just(m).prop_shuffle()))
        ) {
            prop_assert_eq!(OffsetPlan::new(messages), OffsetPlan::new(shuffled));
        }
    }
}
