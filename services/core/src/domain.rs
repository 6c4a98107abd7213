//! The identities of the domain crate, under the path every service uses.

pub use txflow_domain::ids::*;
pub use txflow_domain::role::Role;
