//! The transaction policy (txflow-domain) from this process's configuration.

pub use txflow_domain::policy::{Policy, PolicyError, Verdict};

use crate::config::Config;

/// The policy of `TXFLOW_POLICY_WHITELIST`, `TXFLOW_POLICY_MAX_VALUE_WEI` and
/// `TXFLOW_POLICY_APPROVAL_THRESHOLD_WEI`.
pub fn from_config(c: &Config) -> Result<Policy, PolicyError> {
    Policy::parse(
        &c.policy_whitelist,
        c.policy_max_value_wei.as_deref(),
        c.policy_approval_threshold_wei.as_deref(),
    )
}
