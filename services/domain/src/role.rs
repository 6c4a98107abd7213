//! The service roles of txflow.

use std::fmt;

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

    /// The stages of the transaction pipeline built so far, in pipeline order: the one list the
    /// binary (`txflow up`, `bench`, `demo`) starts. The first three take a request to SUBMITTED
    /// ([`Role::SUBMISSION`]); the receipt checker and the confirmation manager follow it to
    /// finality.
    pub const PIPELINE: [Role; 5] = [
        Role::Allocator,
        Role::SignerGateway,
        Role::Broadcaster,
        Role::ReceiptChecker,
        Role::ConfirmationManager,
    ];

    /// The stages that take a request to SUBMITTED.
    pub const SUBMISSION: [Role; 3] = [Role::Allocator, Role::SignerGateway, Role::Broadcaster];

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
