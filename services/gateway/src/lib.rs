//! The gateway role. The HTTP API: submits requests and commands, reads transaction and transfer state.
//!
//! Not built yet: its entry point returns [`NotImplemented`] until its issue lands (none is filed yet).

use txflow_core::config::Config;
use txflow_core::role::{NotImplemented, Role};

/// Runs the role until shutdown.
pub async fn run(_config: &Config) -> Result<(), NotImplemented> {
    Err(NotImplemented {
        role: Role::Gateway,
        issue: None,
    })
}
