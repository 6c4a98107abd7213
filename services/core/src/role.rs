//! Running a role: its errors.

use crate::retry::{Classify, Retry};

pub use crate::domain::Role;

/// Why a role stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
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
    #[error("configuration: {0}")]
    Policy(#[from] crate::policy::PolicyError),
}

impl Classify for RoleError {
    fn retry(&self) -> Retry {
        match self {
            RoleError::Config(_) | RoleError::ConfigSource { .. } => Retry::Permanent,
            RoleError::Db(e) => e.retry(),
            RoleError::Chain(e) => e.retry(),
            RoleError::Lease(e) => e.retry(),
            RoleError::Stage(e) => e.retry(),
            RoleError::Policy(e) => e.retry(),
        }
    }
}
