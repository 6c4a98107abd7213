//! The transfer-coordinator role. Moves funds between the funding ledger and the trading core (seed 004).
//!
//! Not built yet: its entry point returns [`NotImplemented`] until its issue lands (none is filed yet).

use txflow_core::config::Config;
use txflow_core::role::{NotImplemented, Role};

/// Runs the role until shutdown.
pub async fn run(_config: &Config) -> Result<(), NotImplemented> {
    Err(NotImplemented {
        role: Role::TransferCoordinator,
        issue: None,
    })
}
