//! Transaction policy (ARCHITECTURE §6): destination whitelist, per-transaction value limit, and
//! the approval threshold above which a request waits in PENDING_APPROVAL.

use std::collections::BTreeSet;

use alloy_primitives::{Address, U256};

use crate::retry::{Classify, Retry};

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

/// A policy setting that is not valid (named by its variable).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}={value:?}: {why}")]
pub struct PolicyError {
    pub setting: &'static str,
    pub value: String,
    pub why: &'static str,
}

impl Classify for PolicyError {
    fn retry(&self) -> Retry {
        Retry::Permanent
    }
}

impl Policy {
    /// A policy from its settings as written: whitelist addresses, and decimal wei amounts.
    pub fn parse(
        whitelist: &[String],
        max_value_wei: Option<&str>,
        approval_threshold_wei: Option<&str>,
    ) -> Result<Policy, PolicyError> {
        let amount =
            |setting: &'static str, v: Option<&str>| -> Result<Option<U256>, PolicyError> {
                v.map(|s| {
                    U256::from_str_radix(s, 10).map_err(|_| PolicyError {
                        setting,
                        value: s.to_string(),
                        why: "not a decimal amount of wei",
                    })
                })
                .transpose()
            };
        let whitelist = if whitelist.is_empty() {
            None
        } else {
            Some(
                whitelist
                    .iter()
                    .map(|a| {
                        a.parse::<Address>().map_err(|_| PolicyError {
                            setting: "TXFLOW_POLICY_WHITELIST",
                            value: a.clone(),
                            why: "not an address",
                        })
                    })
                    .collect::<Result<_, _>>()?,
            )
        };
        Ok(Policy {
            whitelist,
            max_value: amount("TXFLOW_POLICY_MAX_VALUE_WEI", max_value_wei)?,
            approval_threshold: amount(
                "TXFLOW_POLICY_APPROVAL_THRESHOLD_WEI",
                approval_threshold_wei,
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

    #[test]
    fn settings_are_parsed_or_refused_by_name() {
        let p = Policy::parse(
            &["0x000000000000000000000000000000000000dead".into()],
            Some("10"),
            Some("5"),
        )
        .expect("valid");
        assert_eq!(p.max_value, Some(U256::from(10)));
        let e = Policy::parse(&["nope".into()], None, None).expect_err("bad address");
        assert_eq!(e.setting, "TXFLOW_POLICY_WHITELIST");
        let e = Policy::parse(&[], Some("-1"), None).expect_err("negative");
        assert_eq!(e.setting, "TXFLOW_POLICY_MAX_VALUE_WEI");
    }
}
