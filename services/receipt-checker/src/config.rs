//! The receipt checker's settings, taken once from the service [`Config`].

use std::time::Duration;

use txflow_core::config::Config;
use txflow_core::domain::ChainId;
use txflow_core::kafka::Topics;

/// What the receipt checker needs to know besides its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiptCheckerConfig {
    /// The chain served: the recovery scan looks for this chain's signers only.
    pub chain_id: ChainId,
    pub topics: Topics,
    /// `confirmations.receipt_workers` (`TXFLOW_RECEIPT_WORKERS`, default 10): how many
    /// transactions' receipts are looked up at once, over all the signers this instance drives.
    pub workers: usize,
    /// `confirmations.stale_receipt_timeout` (`TXFLOW_STALE_RECEIPT_TIMEOUT_MS`, default 60 s):
    /// how long the signer's nonce must have been past a transaction's, with no receipt for any of
    /// its hashes, before the chain is searched for the proof that it was REPLACED.
    pub stale_receipt_timeout: Duration,
    /// The back-off of a transaction without a receipt yet (or whose lookup failed): looked up
    /// again after a quarter of the time since its last move, within `[poll_min, poll_max]`
    /// ([`crate::decide::next_check`]). The recovery scan (every 5 s) is what looks again.
    pub poll_min: Duration,
    pub poll_max: Duration,
    /// `confirmations.required`: a nonce used outside txflow makes a transaction REPLACED only
    /// once the block that used it has this many confirmations (a reorg before then may bring
    /// our transaction back).
    pub confirmations_required: u32,
}

impl ReceiptCheckerConfig {
    /// One second; one Ethereum slot.
    pub const POLL_MIN: Duration = Duration::from_secs(1);
    pub const POLL_MAX: Duration = Duration::from_secs(12);

    pub fn from_config(config: &Config) -> ReceiptCheckerConfig {
        ReceiptCheckerConfig {
            chain_id: ChainId(config.chain_id),
            topics: config.topics.clone(),
            workers: config.receipt_workers.max(1),
            stale_receipt_timeout: Duration::from_millis(config.stale_receipt_timeout_ms),
            poll_min: Self::POLL_MIN,
            poll_max: Self::POLL_MAX,
            confirmations_required: config.confirmations_required,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_environment() {
        let c = ReceiptCheckerConfig::from_config(&Config::default());
        assert_eq!(c.workers, 10);
        assert_eq!(c.stale_receipt_timeout, Duration::from_secs(60));
        let c = ReceiptCheckerConfig::from_config(
            &Config::from_lookup(|k| match k {
                "TXFLOW_RECEIPT_WORKERS" => Some("3".into()),
                "TXFLOW_STALE_RECEIPT_TIMEOUT_MS" => Some("1500".into()),
                _ => None,
            })
            .expect("valid"),
        );
        assert_eq!(c.workers, 3);
        assert_eq!(c.stale_receipt_timeout, Duration::from_millis(1500));
        for (var, value) in [
            ("TXFLOW_RECEIPT_WORKERS", "0"),
            ("TXFLOW_RECEIPT_WORKERS", "many"),
            ("TXFLOW_STALE_RECEIPT_TIMEOUT_MS", "-1"),
        ] {
            let err = Config::from_lookup(|k| (k == var).then(|| value.into()))
                .expect_err("invalid value");
            assert!(err.to_string().contains(var), "{err}");
        }
    }
}
