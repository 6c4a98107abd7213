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
    /// `nonce.state_timeout`: align the cursor with the chain's nonce (as its last final block
    /// has it) when it is older.
    pub nonce_state_timeout: Duration,
    /// `confirmations.required`: a block with fewer confirmations may still be reorged out, so
    /// a nonce used there is not used for the cursor's alignment.
    pub confirmations_required: u32,
    /// `nonce.max_in_flight`: at most this many nonces of a signer allocated and not mined
    /// (ALLOCATED, SIGNED, SUBMITTED); above it requests wait in SIMULATED without a nonce.
    pub max_in_flight: u32,
    /// `approval.timeout`: a transaction in PENDING_APPROVAL longer than this fails
    /// (`APPROVAL_TIMEOUT`).
    pub approval_timeout: Duration,
    /// `approval.after_deep_reorg`: a request undone by a reorg deeper than the required
    /// confirmations waits for an approval once simulated again, instead of being sent again.
    pub approval_after_deep_reorg: bool,
}

impl AllocatorConfig {
    pub fn from_config(config: &Config) -> Result<AllocatorConfig, RoleError> {
        Ok(AllocatorConfig {
            topics: config.topics.clone(),
            policy: txflow_core::policy::from_config(config)?,
            chain_id: ChainId(config.chain_id),
            nonce_state_timeout: Duration::from_millis(config.nonce_state_timeout_ms),
            confirmations_required: config.confirmations_required,
            max_in_flight: config.max_in_flight,
            approval_timeout: Duration::from_millis(config.approval_timeout_ms),
            approval_after_deep_reorg: config.approval_after_deep_reorg,
        })
    }
}
