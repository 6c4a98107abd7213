//! The broadcaster's settings, taken once from the service [`Config`].

use std::time::Duration;

use txflow_core::config::Config;
use txflow_core::domain::ChainId;
use txflow_core::kafka::Topics;

/// What the broadcaster stage needs to know besides its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BroadcasterConfig {
    /// The chain served: the recovery scan looks for this chain's signers only.
    pub chain_id: ChainId,
    pub topics: Topics,
    /// How long a submitted, unmined transaction waits before it is sent again
    /// (`TXFLOW_RESUBMIT_INTERVAL_MS`).
    pub resubmit_interval: Duration,
    /// `confirmations.required`: a nonce used outside txflow makes a transaction REPLACED only
    /// once the block that used it has this many confirmations.
    pub confirmations_required: u32,
}

impl BroadcasterConfig {
    pub fn from_config(config: &Config) -> BroadcasterConfig {
        BroadcasterConfig {
            chain_id: ChainId(config.chain_id),
            topics: config.topics.clone(),
            resubmit_interval: Duration::from_millis(config.resubmit_interval_ms),
            confirmations_required: config.confirmations_required,
        }
    }
}
