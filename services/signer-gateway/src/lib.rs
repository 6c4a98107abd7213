//! The signer-gateway role. Signs allocated transactions and persists every attempt before announcing it (ALLOCATED → SIGNED).
//!
//! Not built yet: its entry point returns [`NotImplemented`] until issue #5 lands.

use txflow_core::config::Config;
use txflow_core::role::{NotImplemented, Role};

/// Runs the role until shutdown.
pub async fn run(_config: &Config) -> Result<(), NotImplemented> {
    Err(NotImplemented {
        role: Role::SignerGateway,
        issue: Some(5),
    })
}
