//! The settings of one stage instance, and the pending-work query most stages share.

use std::time::Duration;

use crate::kafka::Topics;
use crate::lease::LeaseConfig;

/// Settings of one stage instance.
#[derive(Debug, Clone)]
pub struct StageConfig {
    pub group_id: String,
    /// Where poison messages go.
    pub dlq_topic: String,
    /// Topics the runtime makes sure exist (its input and outputs, and the DLQ).
    pub topics: Vec<String>,
    pub partitions: i32,
    pub batch_max: usize,
    /// After the first message, how long to wait for more to fill the batch.
    pub batch_linger: Duration,
    pub lease: LeaseConfig,
    /// Pause before retrying messages that could not be processed (at least; a
    /// [`HandlerError::Retry`](super::HandlerError::Retry) may ask for longer).
    pub retry_backoff: Duration,
    /// How often the recovery scan runs (besides on start and on assignment).
    pub recovery_interval: Duration,
    /// How often the runtime asks the handler for signers whose waiting work a condition
    /// without a message has unblocked ([`Handler::ready_signers`](super::Handler::ready_signers)),
    /// so that they do not wait for the recovery scan.
    pub ready_interval: Duration,
    /// The pipeline's topics, when the stage records announced events in `tx_events`: its
    /// recovery scan then relays the ones a crash left unpublished ([`crate::outbox`]).
    pub outbox: Option<Topics>,
    /// Holding no partition of the input for this long is reported as an ERROR naming the group
    /// (and again every such period while it lasts); the consumer keeps trying.
    pub assignment_timeout: Duration,
}

impl StageConfig {
    pub fn new(group_id: impl Into<String>, dlq_topic: impl Into<String>) -> StageConfig {
        StageConfig {
            group_id: group_id.into(),
            dlq_topic: dlq_topic.into(),
            topics: Vec::new(),
            partitions: 16,
            batch_max: 500,
            batch_linger: Duration::from_millis(2),
            lease: LeaseConfig::default(),
            retry_backoff: Duration::from_millis(200),
            recovery_interval: Duration::from_secs(30),
            ready_interval: Duration::from_millis(200),
            outbox: None,
            assignment_timeout: Duration::from_secs(60),
        }
    }

    /// The settings of a pipeline stage from the service configuration: group
    /// `{group prefix}.{group}`, the pipeline's DLQ, partitions and topics.
    pub fn for_pipeline(
        config: &crate::config::Config,
        group: &str,
        lease: LeaseConfig,
    ) -> StageConfig {
        let mut sc = StageConfig::new(
            format!("{}.{group}", config.group_prefix()),
            config.topics.dlq(),
        );
        sc.lease = lease;
        // Work that no message announces (a lost event, a released nonce) waits at most this long.
        sc.recovery_interval = Duration::from_secs(5);
        sc.partitions = config.partitions;
        sc.topics = config.topics.all();
        sc.outbox = Some(config.topics.clone());
        sc.assignment_timeout = config.assignment_timeout();
        sc
    }
}
