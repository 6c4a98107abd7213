//! The consumer side: the client context that reports rebalances to the runtime loop, polling
//! one batch, and the watch on how long the stage has held no partition.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::BorrowedMessage;
use rdkafka::{ClientContext, TopicPartitionList};
use tokio_util::sync::CancellationToken;

/// A rebalance, as the consumer context saw it.
pub(super) enum RebalanceEvent {
    Assigned(Vec<(String, i32)>),
    Revoked(Vec<(String, i32)>),
}

impl RebalanceEvent {
    /// The partitions of `topic` it concerns.
    pub(super) fn partitions_of(parts: &[(String, i32)], topic: &str) -> Vec<i32> {
        parts
            .iter()
            .filter(|(t, _)| t == topic)
            .map(|(_, p)| *p)
            .collect()
    }
}

/// Forwards rebalances to the runtime loop.
pub struct StageContext {
    events: mpsc::Sender<RebalanceEvent>,
}

impl StageContext {
    /// A context and the receiving end of its rebalance events.
    pub(super) fn new() -> (StageContext, mpsc::Receiver<RebalanceEvent>) {
        let (events, rx) = mpsc::channel();
        (StageContext { events }, rx)
    }
}

impl ClientContext for StageContext {}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<(String, i32)> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_string(), e.partition()))
        .collect()
}

impl ConsumerContext for StageContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Hand over cleanly: commit what was stored before the partitions go.
            let _ = consumer.commit_consumer_state(CommitMode::Sync);
            let _ = self
                .events
                .send(RebalanceEvent::Revoked(partitions_of(tpl)));
        }
    }
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let _ = self
                .events
                .send(RebalanceEvent::Assigned(partitions_of(tpl)));
        }
    }
}

/// How long the stage has held no partition of its input: a group that hands it none (a member the
/// broker still counts as leader although it left, a coordinator that cannot be reached, more
/// members than partitions) is reported, once per `timeout` while it lasts, instead of idling in
/// silence. Pure: the runtime feeds it the rebalances and the clock.
pub(super) struct AssignmentWatch {
    timeout: Duration,
    /// Since when no partition has been held; `None` while some are.
    since: Option<Instant>,
    /// When the next report is due (while `since` is set).
    due: Instant,
    /// Whether the group has answered with an assignment (an empty one) since `since`.
    answered: bool,
    /// Reports made since `since`.
    reports: u32,
}

/// No partition for too long: what to report.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Overdue {
    /// How long no partition has been held.
    pub waited: Duration,
    /// `true`: the group completed a rebalance and gave this member nothing (other members hold
    /// every partition); `false`: no rebalance completed for this member at all.
    pub answered: bool,
}

/// Partitions held again after none.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Regained {
    /// How long none was held (the rebalance, as this member saw it).
    pub waited: Duration,
    /// Whether it had been reported overdue meanwhile.
    pub reported: bool,
}

impl AssignmentWatch {
    /// A consumer that has just subscribed: no partition yet.
    pub(super) fn new(now: Instant, timeout: Duration) -> AssignmentWatch {
        AssignmentWatch {
            timeout,
            since: Some(now),
            due: now + timeout,
            answered: false,
            reports: 0,
        }
    }

    /// After a rebalance event: `held` partitions of the input are held now; `assignment` tells an
    /// assignment (possibly empty) from a revocation. Returns how long none was held when
    /// partitions are held again.
    pub(super) fn rebalanced(
        &mut self,
        now: Instant,
        held: usize,
        assignment: bool,
    ) -> Option<Regained> {
        if held > 0 {
            let since = self.since.take()?;
            let regained = Regained {
                waited: now.saturating_duration_since(since),
                reported: self.reports > 0,
            };
            self.answered = false;
            self.reports = 0;
            return Some(regained);
        }
        if self.since.is_none() {
            self.since = Some(now);
            self.due = now + self.timeout;
            self.answered = false;
            self.reports = 0;
        }
        if assignment {
            self.answered = true;
        }
        None
    }

    /// `Some` when no partition has been held for `timeout` since the start of the wait or the
    /// last report.
    pub(super) fn check(&mut self, now: Instant) -> Option<Overdue> {
        let since = self.since?;
        if now < self.due {
            return None;
        }
        self.due = now + self.timeout;
        self.reports += 1;
        Some(Overdue {
            waited: now.saturating_duration_since(since),
            answered: self.answered,
        })
    }
}

/// What one poll brought.
pub(super) enum Polled<'c> {
    /// Shutdown was requested.
    Shutdown,
    /// Nothing arrived for a while: go round the loop (rebalances, scans).
    Idle,
    /// The consumer reported an error: back off.
    Error,
    /// The first message and whatever else arrived within the linger, up to the maximum.
    Batch(Vec<BorrowedMessage<'c>>),
}

/// Polls a batch: the first message, then whatever else arrives within `linger`, up to `max`.
pub(super) async fn poll_batch<'c>(
    consumer: &'c StreamConsumer<StageContext>,
    shutdown: &CancellationToken,
    max: usize,
    linger: Duration,
) -> Polled<'c> {
    let first = tokio::select! {
        () = shutdown.cancelled() => return Polled::Shutdown,
        m = consumer.recv() => m,
        () = tokio::time::sleep(Duration::from_millis(200)) => return Polled::Idle,
    };
    let first = match first {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "consumer error");
            return Polled::Error;
        }
    };
    let mut batch = vec![first];
    let linger_until = tokio::time::Instant::now() + linger;
    while batch.len() < max {
        match tokio::time::timeout_at(linger_until, consumer.recv()).await {
            Ok(Ok(m)) => batch.push(m),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "consumer error");
                break;
            }
            Err(_) => break,
        }
    }
    Polled::Batch(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(3);

    #[test]
    fn a_stage_that_gets_no_partition_is_reported_once_per_timeout_until_it_gets_one() {
        let t0 = Instant::now();
        let mut w = AssignmentWatch::new(t0, T);
        assert_eq!(w.check(t0 + Duration::from_secs(2)), None);
        assert_eq!(
            w.check(t0 + T),
            Some(Overdue {
                waited: T,
                answered: false
            })
        );
        assert_eq!(
            w.check(t0 + T + Duration::from_secs(1)),
            None,
            "not again at once"
        );
        assert_eq!(
            w.check(t0 + 2 * T),
            Some(Overdue {
                waited: 2 * T,
                answered: false
            }),
            "again after another timeout"
        );
        assert_eq!(
            w.rebalanced(t0 + Duration::from_secs(7), 2, true),
            Some(Regained {
                waited: Duration::from_secs(7),
                reported: true
            })
        );
        assert_eq!(w.check(t0 + 10 * T), None, "holding partitions");
    }

    #[test]
    fn an_empty_assignment_is_told_from_no_answer_and_a_rebalance_restarts_the_wait() {
        let t0 = Instant::now();
        let mut w = AssignmentWatch::new(t0, T);
        assert_eq!(
            w.rebalanced(t0 + Duration::from_secs(1), 0, true),
            None,
            "an empty assignment"
        );
        assert_eq!(
            w.check(t0 + T),
            Some(Overdue {
                waited: T,
                answered: true
            })
        );
        let t1 = t0 + Duration::from_secs(5);
        assert!(w.rebalanced(t1, 1, true).is_some());
        // An eager rebalance: everything revoked, then assigned again soon.
        assert_eq!(w.rebalanced(t1 + Duration::from_secs(1), 0, false), None);
        assert_eq!(
            w.check(t1 + Duration::from_secs(3)),
            None,
            "the wait restarted"
        );
        assert_eq!(
            w.rebalanced(t1 + Duration::from_secs(3), 1, true),
            Some(Regained {
                waited: Duration::from_secs(2),
                reported: false
            })
        );
        assert_eq!(
            w.rebalanced(t1 + Duration::from_secs(4), 2, true),
            None,
            "already held"
        );
    }
}
