//! Transaction policy (ARCHITECTURE §6): destination whitelist, per-transaction value limit, and
//! the approval threshold above which a request waits in PENDING_APPROVAL.

use std::collections::BTreeSet;

use crate::config::Config;
use crate::role::RoleError;
use alloy::primitives::{Address, U256};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    /// Allowed destinations; `None` allows any.
    pub whitelist: Option<BTreeSet<Address>>,
    pub max_value: Option<U256>,
    pub approval_threshold: Option<U256>,
}

/// What the policy says about one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    NeedsApproval,
    Deny(String),
}

impl Policy {
    pub fn from_config(c: &Config) -> Result<Policy, RoleError> {
        let amount = |name: &str, v: &Option<String>| -> Result<Option<U256>, RoleError> {
            v.as_deref()
                .map(|s| {
                    U256::from_str_radix(s, 10).map_err(|_| {
                        RoleError::Config(format!("{name}={s:?} is not a decimal amount of wei"))
                    })
                })
                .transpose()
        };
        let whitelist = if c.policy_whitelist.is_empty() {
            None
        } else {
            Some(
                c.policy_whitelist
                    .iter()
                    .map(|a| {
                        a.parse::<Address>().map_err(|_| {
                            RoleError::Config(format!(
                                "TXFLOW_POLICY_WHITELIST: {a:?} is not an address"
                            ))
                        })
                    })
                    .collect::<Result<_, _>>()?,
            )
        };
        Ok(Policy {
            whitelist,
            max_value: amount("TXFLOW_POLICY_MAX_VALUE_WEI", &c.policy_max_value_wei)?,
            approval_threshold: amount(
                "TXFLOW_POLICY_APPROVAL_THRESHOLD_WEI",
                &c.policy_approval_threshold_wei,
            )?,
        })
    }

    pub fn check(&self, to: Address, value: U256) -> Verdict {
        if let Some(list) = &self.whitelist
            && !list.contains(&to)
        {
            return Verdict::Deny(format!("destination {to:#x} is not whitelisted"));
        }
        if let Some(max) = self.max_value
            && value > max
        {
            return Verdict::Deny(format!("value {value} wei is above the limit of {max} wei"));
        }
        match self.approval_threshold {
            Some(t) if value >= t => Verdict::NeedsApproval,
            _ => Verdict::Allow,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whitelist_limit_and_threshold() {
        let a: Address = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8"
            .parse()
            .expect("address");
        let b: Address = "0x000000000000000000000000000000000000dead"
            .parse()
            .expect("address");
        let p = Policy {
            whitelist: Some([a].into_iter().collect()),
            max_value: Some(U256::from(1000)),
            approval_threshold: Some(U256::from(100)),
        };
        assert_eq!(p.check(a, U256::from(5)), Verdict::Allow);
        assert_eq!(p.check(a, U256::from(100)), Verdict::NeedsApproval);
        assert!(matches!(p.check(a, U256::from(1001)), Verdict::Deny(_)));
        assert!(matches!(p.check(b, U256::from(1)), Verdict::Deny(_)));
        assert_eq!(Policy::default().check(b, U256::MAX), Verdict::Allow);
    }
}
