//! The broadcaster role. Sends signed transactions and classifies the node's answer (SIGNED → SUBMITTED).
//!
//! Not built yet: its entry point returns [`NotImplemented`] until issue #5 lands.

use txflow_core::config::Config;
use txflow_core::role::{NotImplemented, Role};

/// Runs the role until shutdown.
pub async fn run(_config: &Config) -> Result<(), NotImplemented> {
    Err(NotImplemented {
        role: Role::Broadcaster,
        issue: Some(5),
    })
}
