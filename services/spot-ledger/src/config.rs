//! The spot ledger's settings: the shared [`Config`] (broker, registry, topics, group prefix) plus
//! its own two variables, read from the environment:
//!
//! - `TXFLOW_SPOT_WAL_DIR` — the directory of the write-ahead log (`spot.wal`) and of its lock
//!   file (`LOCK`); default [`DEFAULT_WAL_DIR`];
//! - `TXFLOW_SPOT_ASSETS` — the assets the ledger holds and the decimal places each allows,
//!   `CODE:PLACES,…`; default [`DEFAULT_ASSETS`].

use std::collections::BTreeMap;
use std::path::PathBuf;

use txflow_core::config::Config;
use txflow_core::kafka::KafkaSettings;

/// The default `TXFLOW_SPOT_WAL_DIR`.
pub const DEFAULT_WAL_DIR: &str = "data/spot-ledger";
/// The default `TXFLOW_SPOT_ASSETS`.
pub const DEFAULT_ASSETS: &str = "USDT:6,USDC:6,BTC:8,ETH:8";
/// The most decimal places an asset may have (what an exact decimal of 96 bits can hold).
pub const MAX_PLACES: u32 = 18;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpotConfigError {
    #[error(
        "TXFLOW_SPOT_ASSETS: {entry:?} is not CODE:PLACES (an upper-case code, 0 to {MAX_PLACES} places)"
    )]
    Asset { entry: String },
    #[error("TXFLOW_SPOT_ASSETS: asset {code} is listed twice")]
    DuplicateAsset { code: String },
    #[error("TXFLOW_SPOT_ASSETS lists no asset")]
    NoAsset,
    #[error("TXFLOW_SPOT_WAL_DIR is empty")]
    WalDir,
}

/// The assets and the decimal places each allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assets(BTreeMap<String, u32>);

impl Assets {
    /// Parses `CODE:PLACES,…` (spaces around entries allowed).
    pub fn parse(s: &str) -> Result<Assets, SpotConfigError> {
        let mut map = BTreeMap::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = || SpotConfigError::Asset {
                entry: entry.to_string(),
            };
            let (code, places) = entry.split_once(':').ok_or_else(bad)?;
            let code = code.trim();
            let places: u32 = places.trim().parse().map_err(|_| bad())?;
            let code_ok = !code.is_empty()
                && code.len() <= 16
                && code
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit());
            if !code_ok || places > MAX_PLACES {
                return Err(bad());
            }
            if map.insert(code.to_string(), places).is_some() {
                return Err(SpotConfigError::DuplicateAsset {
                    code: code.to_string(),
                });
            }
        }
        if map.is_empty() {
            return Err(SpotConfigError::NoAsset);
        }
        Ok(Assets(map))
    }

    /// The decimal places `asset` allows; `None` for an asset the ledger does not hold.
    pub fn places(&self, asset: &str) -> Option<u32> {
        self.0.get(asset).copied()
    }
}

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
    /// From the shared configuration and `lookup` (the environment, or a test's map).
    pub fn from_config(
        config: &Config,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<SpotConfig, SpotConfigError> {
        let wal_dir = match lookup("TXFLOW_SPOT_WAL_DIR") {
            Some(d) if d.trim().is_empty() => return Err(SpotConfigError::WalDir),
            Some(d) => PathBuf::from(d),
            None => PathBuf::from(DEFAULT_WAL_DIR),
        };
        let assets =
            Assets::parse(&lookup("TXFLOW_SPOT_ASSETS").unwrap_or_else(|| DEFAULT_ASSETS.into()))?;
        let t = &config.topics;
        Ok(SpotConfig {
            wal_dir,
            assets,
            kafka: config.kafka.clone(),
            registry_url: config.schema_registry_url.clone(),
            group: format!("{}.spot-ledger", config.group_prefix()),
            commands_topic: t.spot_commands(),
            events_topic: t.spot_events(),
            dlq_topic: t.dlq(),
            topics: t.spot(),
            partitions: config.partitions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assets_parse_codes_and_places() {
        let a = Assets::parse(" USDT:6, BTC:8 ,").expect("valid");
        assert_eq!(a.places("USDT"), Some(6));
        assert_eq!(a.places("BTC"), Some(8));
        assert_eq!(a.places("usdt"), None);
        assert_eq!(a.places("ETH"), None);
        assert!(Assets::parse(DEFAULT_ASSETS).is_ok());
    }

    #[test]
    fn bad_asset_lists_are_refused() {
        for bad in ["USDT", "USDT:x", "usdt:6", "USDT:19", ":6", "USDT:-1"] {
            assert!(
                matches!(Assets::parse(bad), Err(SpotConfigError::Asset { .. })),
                "{bad}"
            );
        }
        assert_eq!(
            Assets::parse("BTC:8,BTC:6"),
            Err(SpotConfigError::DuplicateAsset { code: "BTC".into() })
        );
        assert_eq!(Assets::parse(" , "), Err(SpotConfigError::NoAsset));
    }

    #[test]
    fn settings_come_from_the_lookup_with_defaults() {
        let config = Config::default();
        let c = SpotConfig::from_config(&config, |_| None).expect("defaults");
        assert_eq!(c.wal_dir, PathBuf::from(DEFAULT_WAL_DIR));
        assert_eq!(c.commands_topic, "txflow.spot.commands");
        assert_eq!(c.events_topic, "txflow.spot.events");
        let c = SpotConfig::from_config(&config, |k| match k {
            "TXFLOW_SPOT_WAL_DIR" => Some("/tmp/w".into()),
            "TXFLOW_SPOT_ASSETS" => Some("EUR:2".into()),
            _ => None,
        })
        .expect("set");
        assert_eq!(c.wal_dir, PathBuf::from("/tmp/w"));
        assert_eq!(c.assets.places("EUR"), Some(2));
    }
}
