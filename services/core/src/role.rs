//! The service roles of txflow and the typed error of a role whose issue has not landed yet.

use std::fmt;

use crate::retry::{Classify, Retry};

/// One consumer service (or the HTTP gateway). Each has a crate under `services/` and a
/// subcommand of the `txflow` binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Allocator,
    SignerGateway,
    Broadcaster,
    ReceiptChecker,
    ConfirmationManager,
    TransferCoordinator,
    SpotLedger,
    Gateway,
}

impl Role {
    pub const ALL: [Role; 8] = [
        Role::Allocator,
        Role::SignerGateway,
        Role::Broadcaster,
        Role::ReceiptChecker,
        Role::ConfirmationManager,
        Role::TransferCoordinator,
        Role::SpotLedger,
        Role::Gateway,
    ];

    /// The name used in leases (`signer_lease.role`), logs and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Allocator => "allocator",
            Role::SignerGateway => "signer-gateway",
            Role::Broadcaster => "broadcaster",
            Role::ReceiptChecker => "receipt-checker",
            Role::ConfirmationManager => "confirmation-manager",
            Role::TransferCoordinator => "transfer-coordinator",
            Role::SpotLedger => "spot-ledger",
            Role::Gateway => "gateway",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// Returned by the entry point of a role that is not implemented yet.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the {role} role is not implemented yet ({})", tracked(*.issue))]
pub struct NotImplemented {
    pub role: Role,
    /// The issue that builds it, when one is filed.
    pub issue: Option<u32>,
}

fn tracked(issue: Option<u32>) -> String {
    match issue {
        Some(n) => format!("tracked by issue #{n}"),
        None => "no issue filed yet".to_string(),
    }
}

impl Classify for NotImplemented {
    fn retry(&self) -> Retry {
        Retry::Permanent
    }
}

/// Why a role stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    #[error(transparent)]
    NotImplemented(#[from] NotImplemented),
    #[error("configuration: {0}")]
    Config(String),
    /// A configuration problem with an underlying cause (an unreadable file, say).
    #[error("configuration: {message}")]
    ConfigSource {
        message: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(transparent)]
    Db(#[from] crate::db::DbError),
    #[error(transparent)]
    Chain(#[from] crate::chain::ChainError),
    #[error(transparent)]
    Lease(#[from] crate::lease::LeaseError),
    #[error(transparent)]
    Stage(#[from] crate::stage::StageError),
}

impl Classify for RoleError {
    fn retry(&self) -> Retry {
        match self {
            RoleError::NotImplemented(_)
            | RoleError::Config(_)
            | RoleError::ConfigSource { .. } => Retry::Permanent,
            RoleError::Db(e) => e.retry(),
            RoleError::Chain(e) => e.retry(),
            RoleError::Lease(e) => e.retry(),
            RoleError::Stage(e) => e.retry(),
        }
    }
}
