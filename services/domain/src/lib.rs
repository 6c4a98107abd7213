//! txflow-domain: what txflow is about, with no I/O.
//!
//! - [`ids`]: newtypes for chain ids, signers, fencing tokens, node ids, the recorded payload.
//! - [`role`]: the service roles.
//! - [`state`]: the transaction state machine — [`state::TxState`], the table of legal
//!   transitions (checked by the compiler for every named [`state::Move`]).
//! - [`failure`]: the typed failure codes of `TxFailed`.
//! - [`events`]: the Avro-described events and commands, with their schemas compiled in.
//! - [`policy`]: whitelist, value limit, approval threshold.
//! - [`request`]: the TxRequest contract (validation), shared by the allocator and txflow-client.
//! - [`nonce_proof`]: whose nonce it is, on the chain's proof (REPLACED only when proven).
//! - [`retry`]: the retry classification every error type carries.
//! - [`revert`]: why a call reverted, read from its revert data.
//! - [`transfer`]: internal transfers (seed 004): their state machine, reversibility rule and
//!   validation.
//!
//! Architecture invariant: this crate depends on no sqlx, rdkafka or reqwest (nor anything else
//! that does I/O); `cargo tree -p txflow-domain` shows it.

pub mod events;
pub mod failure;
pub mod ids;
pub mod nonce_proof;
pub mod policy;
pub mod request;
pub mod retry;
pub mod revert;
pub mod role;
pub mod state;
pub mod transfer;

pub use failure::FailureCode;
pub use ids::{ChainId, FencingToken, InvalidAddress, NodeId, Signer, TxPayload};
pub use retry::{Classify, Retry};
pub use role::Role;
pub use state::{Move, TxState};
