//! Running a role: its errors, and the typed error of a role whose issue has not landed yet.

use crate::retry::{Classify, Retry};

pub use crate::domain::Role;

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
    #[error("configuration: {0}")]
    Policy(#[from] crate::policy::PolicyError),
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
            RoleError::Policy(e) => e.retry(),
        }
    }
}
