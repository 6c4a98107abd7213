//! The transfer-coordinator role. Moves funds between the funding ledger and the trading core (seed 004).
//!
//! Built so far (issue 18, in progress): the FUNDING adapter ([`funding`]), the SPOT adapter
//! ([`spot`]) and the coordinator's pure decisions ([`decide`]); the state machine and
//! validation are the domain's (`txflow_core::transfer`). The stage itself is not built yet: its entry point returns
//! [`NotImplemented`].

pub mod decide;
pub mod funding;
pub mod spot;

use txflow_core::config::Config;
use txflow_core::role::{NotImplemented, Role};

/// Runs the role until shutdown.
pub async fn run(_config: &Config) -> Result<(), NotImplemented> {
    Err(NotImplemented {
        role: Role::TransferCoordinator,
        issue: Some(18),
    })
}
