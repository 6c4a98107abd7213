//! The allocator's settings, from the service configuration.

use std::time::Duration;

use txflow_core::config::Config;
use txflow_core::domain::ChainId;
use txflow_core::kafka::Topics;
use txflow_core::policy::Policy;
use txflow_core::role::RoleError;

#[derive(Debug, Clone)]
pub struct AllocatorConfig {
    pub topics: Topics,
    pub policy: Policy,
    /// The chain this deployment serves; requests for another are dead-lettered.
    pub chain_id: ChainId,
    /// `nonce.state_timeout`: align the cursor with the chain's pending nonce when it is older.
    pub nonce_state_timeout: Duration,
}

impl AllocatorConfig {
    pub fn from_config(config: &Config) -> Result<AllocatorConfig, RoleError> {
        Ok(AllocatorConfig {
            topics: config.topics.clone(),
            policy: txflow_core::policy::from_config(config)?,
            chain_id: ChainId(config.chain_id),
            nonce_state_timeout: Duration::from_secs(30),
        })
    }
}
