//! Why a transaction failed: the stable codes of `TxFailed.code` and `managed_tx.failure_code`.

use std::fmt;

/// A typed failure code. The text form is part of the `TxFailed` contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureCode {
    /// The policy refuses the transaction (whitelist, value limit, missing approval).
    PolicyDenied,
    /// The simulation reverted; the node's reason is kept.
    SimulationReverted,
    /// The simulation failed for another reason the node gave.
    SimulationFailed,
    /// An operator cancelled it.
    Cancelled,
    /// The recorded transaction cannot be signed (an invalid field, a signing failure).
    SigningFailed,
    /// This signer gateway holds no key for the signer.
    NoSigningKey,
    /// The node refuses the signed transaction for good.
    SendRejected,
    /// The request it depends on (`depends_on_request_id`) failed: FAILED, or reverted on chain
    /// and settled. The reason names that request.
    DependencyFailed,
    /// It waited in PENDING_APPROVAL longer than `approval.timeout` without an operator's
    /// decision (seed 000 §4.1). It held no nonce.
    ApprovalTimeout,
}

impl FailureCode {
    pub const ALL: [FailureCode; 9] = [
        FailureCode::PolicyDenied,
        FailureCode::SimulationReverted,
        FailureCode::SimulationFailed,
        FailureCode::Cancelled,
        FailureCode::SigningFailed,
        FailureCode::NoSigningKey,
        FailureCode::SendRejected,
        FailureCode::DependencyFailed,
        FailureCode::ApprovalTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureCode::PolicyDenied => "POLICY_DENIED",
            FailureCode::SimulationReverted => "SIMULATION_REVERTED",
            FailureCode::SimulationFailed => "SIMULATION_FAILED",
            FailureCode::Cancelled => "CANCELLED",
            FailureCode::SigningFailed => "SIGNING_FAILED",
            FailureCode::NoSigningKey => "NO_SIGNING_KEY",
            FailureCode::SendRejected => "SEND_REJECTED",
            FailureCode::DependencyFailed => "DEPENDENCY_FAILED",
            FailureCode::ApprovalTimeout => "APPROVAL_TIMEOUT",
        }
    }
}

impl fmt::Display for FailureCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failure reason as stored and announced: at most 500 characters.
pub fn truncate_reason(reason: &str) -> String {
    reason.chars().take(500).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_screaming_snake_case() {
        let mut seen = std::collections::BTreeSet::new();
        for c in FailureCode::ALL {
            let s = c.as_str();
            assert!(
                s.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'),
                "{s}"
            );
            assert!(seen.insert(s), "{s} twice");
        }
    }

    #[test]
    fn reasons_are_cut_at_500_characters() {
        assert_eq!(truncate_reason(&"é".repeat(600)).chars().count(), 500);
        assert_eq!(truncate_reason("short"), "short");
    }
}
