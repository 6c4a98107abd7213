//! The transfer coordinator's settings, taken once from the service [`Config`].

use std::time::Duration;

use txflow_core::config::Config;
use txflow_core::kafka::Topics;

use crate::spot::SpotAdapterConfig;

/// What the coordinator needs to know besides its clients.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    pub topics: Topics,
    /// `transfer.stale_ms` (`TXFLOW_TRANSFER_STALE_MS`, default 60 s; seed 004 §6.2): an open
    /// transfer that has not moved for this long is resumed by the recovery worker. A step with
    /// an unknown outcome touches the row, so this is also the pace of its retries.
    pub stale: Duration,
    /// `transfer.check_interval_ms` (`TXFLOW_TRANSFER_CHECK_INTERVAL_MS`, default 10 s): the
    /// conservation check's period (seed 004 §7.2).
    pub check_interval: Duration,
    /// The SPOT adapter's topics and reply timeout (`spot.timeout_ms`).
    pub spot: SpotAdapterConfig,
}

impl CoordinatorConfig {
    pub fn from_config(config: &Config) -> CoordinatorConfig {
        CoordinatorConfig {
            topics: config.topics.clone(),
            stale: Duration::from_millis(config.transfer_stale_ms),
            check_interval: Duration::from_millis(config.transfer_check_interval_ms),
            spot: SpotAdapterConfig::from_config(config),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_environment() {
        let c = CoordinatorConfig::from_config(&Config::default());
        assert_eq!(c.stale, Duration::from_secs(60));
        assert_eq!(c.check_interval, Duration::from_secs(10));
        let c = CoordinatorConfig::from_config(
            &Config::from_lookup(|k| match k {
                "TXFLOW_TRANSFER_STALE_MS" => Some("1500".into()),
                "TXFLOW_TRANSFER_CHECK_INTERVAL_MS" => Some("250".into()),
                _ => None,
            })
            .expect("valid"),
        );
        assert_eq!(c.stale, Duration::from_millis(1500));
        assert_eq!(c.check_interval, Duration::from_millis(250));
        for (var, value) in [
            ("TXFLOW_TRANSFER_STALE_MS", "0"),
            ("TXFLOW_TRANSFER_CHECK_INTERVAL_MS", "soon"),
        ] {
            let err = Config::from_lookup(|k| (k == var).then(|| value.into()))
                .expect_err("invalid value");
            assert!(err.to_string().contains(var), "{err}");
        }
    }
}
