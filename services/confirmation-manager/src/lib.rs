//! The confirmation-manager role. Counts confirmations, follows reorgs and announces newFork (MINED → CONFIRMED).
//!
//! Not built yet: its entry point returns [`NotImplemented`] until its issue lands (none is filed yet).

use txflow_core::config::Config;
use txflow_core::role::{NotImplemented, Role};

/// Runs the role until shutdown.
pub async fn run(_config: &Config) -> Result<(), NotImplemented> {
    Err(NotImplemented {
        role: Role::ConfirmationManager,
        issue: None,
    })
}
