//! The spot ledger's settings, all from the shared [`Config`]: the broker, registry, topics and
//! group prefix, and its own two, `spot.wal_dir` (`TXFLOW_SPOT_WAL_DIR`, the directory of the
//! write-ahead log `spot.wal` and of its lock file `LOCK`) and `spot.assets`
//! (`TXFLOW_SPOT_ASSETS`, `CODE:PLACES,…`). Those two are parsed and checked where every setting
//! is, in `txflow_core::config` (file key or variable, the variable over the file).

use std::path::PathBuf;

use txflow_core::config::Config;
pub use txflow_core::config::{
    DEFAULT_SPOT_ASSETS as DEFAULT_ASSETS, DEFAULT_SPOT_WAL_DIR as DEFAULT_WAL_DIR,
    MAX_SPOT_PLACES as MAX_PLACES, SpotAssets as Assets, SpotAssetsError,
};
use txflow_core::kafka::KafkaSettings;

/// Everything the spot ledger needs to run.
#[derive(Debug, Clone)]
pub struct SpotConfig {
    pub wal_dir: PathBuf,
    pub assets: Assets,
    pub kafka: KafkaSettings,
    pub registry_url: String,
    /// `{group prefix}.spot-ledger`.
    pub group: String,
    pub commands_topic: String,
    pub events_topic: String,
    pub dlq_topic: String,
    pub topics: Vec<String>,
    pub partitions: i32,
}

impl SpotConfig {
    /// From the shared configuration (already checked when it was loaded).
    pub fn from_config(config: &Config) -> SpotConfig {
        let t = &config.topics;
        SpotConfig {
            wal_dir: config.spot_wal_dir.clone(),
            assets: config.spot_assets.clone(),
            kafka: config.kafka.clone(),
            registry_url: config.schema_registry_url.clone(),
            group: format!("{}.spot-ledger", config.group_prefix()),
            commands_topic: t.spot_commands(),
            events_topic: t.spot_events(),
            dlq_topic: t.dlq(),
            topics: t.spot(),
            partitions: config.partitions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_come_from_the_shared_configuration() {
        let config = Config::default();
        let c = SpotConfig::from_config(&config);
        assert_eq!(c.wal_dir, PathBuf::from(DEFAULT_WAL_DIR));
        assert_eq!(
            c.assets,
            Assets::parse(DEFAULT_ASSETS).expect("the default")
        );
        assert_eq!(c.commands_topic, "txflow.spot.commands");
        assert_eq!(c.events_topic, "txflow.spot.events");
        assert_eq!(c.group, "txflow.spot-ledger");
        let config = Config::from_lookup(|k| match k {
            "TXFLOW_SPOT_WAL_DIR" => Some("/tmp/w".into()),
            "TXFLOW_SPOT_ASSETS" => Some("EUR:2".into()),
            _ => None,
        })
        .expect("valid");
        let c = SpotConfig::from_config(&config);
        assert_eq!(c.wal_dir, PathBuf::from("/tmp/w"));
        assert_eq!(c.assets.places("EUR"), Some(2));
        assert_eq!(c.assets.places("USDT"), None);
    }
}
