//! The receipt-checker role. Follows submitted transactions to a receipt (SUBMITTED → MINED / REVERTED / REPLACED).
//!
//! Not built yet: its entry point returns [`NotImplemented`] until its issue lands (none is filed yet).

use txflow_core::config::Config;
use txflow_core::role::{NotImplemented, Role};

/// Runs the role until shutdown.
pub async fn run(_config: &Config) -> Result<(), NotImplemented> {
    Err(NotImplemented {
        role: Role::ReceiptChecker,
        issue: None,
    })
}
