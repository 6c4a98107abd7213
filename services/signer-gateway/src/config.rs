//! The signer gateway's settings, taken once from the service [`Config`]. The keys are not
//! settings: they are loaded apart ([`crate::Keys`]) and never logged.

use txflow_core::config::Config;
use txflow_core::domain::ChainId;
use txflow_core::kafka::Topics;
use txflow_core::policy::Policy;
use txflow_core::role::RoleError;

/// What the signer gateway stage needs to know besides its keys.
#[derive(Debug, Clone)]
pub struct SignerConfig {
    /// The chain served: the recovery scan looks for this chain's signers only.
    pub chain_id: ChainId,
    pub topics: Topics,
    /// Checked again before signing (`TXFLOW_POLICY_*`): the configuration may have tightened
    /// since allocation.
    pub policy: Policy,
}

impl SignerConfig {
    pub fn from_config(config: &Config) -> Result<SignerConfig, RoleError> {
        Ok(SignerConfig {
            chain_id: ChainId(config.chain_id),
            topics: config.topics.clone(),
            policy: txflow_core::policy::from_config(config)?,
        })
    }
}
