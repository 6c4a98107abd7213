//! The confirmation manager's settings, taken once from the service [`Config`].

use std::time::Duration;

use txflow_core::config::Config;
use txflow_core::domain::ChainId;
use txflow_core::kafka::Topics;

/// How often the chain's head is followed when nothing else drives a signer: the stage's recovery
/// scan interval.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// The fewest blocks a final transaction is watched for a reorg deeper than the required depth.
pub const MIN_WATCH_BLOCKS: u32 = 64;

/// What the confirmation manager needs to know besides its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfirmationConfig {
    /// The chain served: the recovery scan looks for this chain's signers only.
    pub chain_id: ChainId,
    pub topics: Topics,
    /// `confirmations.required` (`TXFLOW_CONFIRMATIONS_REQUIRED`): how many blocks, the
    /// transaction's own included, make it final.
    pub required: u32,
    /// How many blocks past its own a final transaction is still watched for a deeper reorg:
    /// twice the required depth, at least [`MIN_WATCH_BLOCKS`].
    pub watch_blocks: u32,
    /// How often the heads are followed ([`POLL_INTERVAL`]).
    pub poll_interval: Duration,
    /// When a transaction sent back to SUBMITTED by a reorg is due for the broadcaster's
    /// resubmission (`TXFLOW_RESUBMIT_INTERVAL_MS`); the confirmation manager sends it once
    /// itself right away.
    pub resubmit_interval: Duration,
}

impl ConfirmationConfig {
    pub fn from_config(config: &Config) -> ConfirmationConfig {
        let required = config.confirmations_required.max(1);
        ConfirmationConfig {
            chain_id: ChainId(config.chain_id),
            topics: config.topics.clone(),
            required,
            watch_blocks: required.saturating_mul(2).max(MIN_WATCH_BLOCKS),
            poll_interval: POLL_INTERVAL,
            resubmit_interval: Duration::from_millis(config.resubmit_interval_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watch_is_twice_the_depth_and_at_least_the_minimum() {
        let mut c = Config {
            confirmations_required: 12,
            ..Config::default()
        };
        let cc = ConfirmationConfig::from_config(&c);
        assert_eq!((cc.required, cc.watch_blocks), (12, 64));
        c.confirmations_required = 50;
        assert_eq!(ConfirmationConfig::from_config(&c).watch_blocks, 100);
        c.confirmations_required = 0;
        assert_eq!(ConfirmationConfig::from_config(&c).required, 1);
    }
}
