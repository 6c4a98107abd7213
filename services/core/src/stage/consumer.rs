//! The consumer side: the client context that reports rebalances to the runtime loop, and polling
//! one batch.

use std::sync::mpsc;
use std::time::Duration;

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
