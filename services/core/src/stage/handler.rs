//! The handler API: what a stage plugs into the runtime ([`Handler`]), what it returns
//! ([`Output`], [`Rejection`]) and how it says what to do when a message cannot be applied
//! ([`HandlerError`]).
//!
//! API boundary: the role crates see this module (re-exported by `stage`), never the runtime's
//! internals.

use std::error::Error;
use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use alloy::primitives::Address;
use sqlx::PgPool;
use txflow_domain::state::Move;

use crate::domain::{ChainId, Role, Signer};
use crate::events::Event;
use crate::fenced::{FenceError, Fenced};
use crate::lease::{HeldLease, LeaseKey};
use crate::retry::{Classify, Retry};

pub use crate::output::Output;

/// A message the handler refuses for good: it goes to the dead-letter topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Stable machine-readable code (`error.code` header).
    pub code: String,
    /// Human-readable reason (`error.message` header).
    pub message: String,
}

impl Rejection {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Rejection {
        Rejection {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// What the runtime does with a message (in [`Handler::handle`]) or a signer's pending work (in
/// [`Handler::drive`]) that could not be applied. Every variant is a decision; none of them loops
/// on a deterministic failure.
///
/// | variant     | `handle` (a message of a batch)                    | `drive` (a signer's work)           |
/// |-------------|----------------------------------------------------|-------------------------------------|
/// | `Reject`    | dead-lettered; the signer's other messages go on   | signer held with an alert           |
/// | `LeaseLost` | signer rolled back, lease forgotten, messages retried after re-acquiring | lease forgotten |
/// | `Retry`     | signer rolled back, its messages retried after `after` | recovery scan retries            |
/// | `Fail`      | signer rolled back, the message dead-lettered with `code`, the signer's other messages retried | signer held with an alert, the recovery scan tries again |
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Dead-letter the message. Return this before writing anything for it.
    #[error("rejected: {}: {}", .0.code, .0.message)]
    Reject(Rejection),
    /// The signer's lease is lost: its work in this batch is rolled back, the lease forgotten, and
    /// its messages come again once the lease is re-acquired.
    #[error(transparent)]
    LeaseLost(FenceError),
    /// Try again later (an RPC node or a dependency is unavailable); nothing is lost. The runtime
    /// waits at least `after` (`Duration::ZERO`: the stage's `retry_backoff`).
    #[error("transient failure: {context}")]
    Retry {
        after: Duration,
        context: String,
        #[source]
        source: Box<dyn Error + Send + Sync>,
    },
    /// A deterministic failure: retrying would fail the same way, so it must not pin the
    /// partition. A message is dead-lettered with `error.code = code`; a drive holds the signer.
    #[error("failed: {code}: {reason}")]
    Fail { code: String, reason: String },
}

impl HandlerError {
    /// A transient failure, retried after the stage's `retry_backoff`.
    pub fn transient(
        context: impl Into<String>,
        source: impl Error + Send + Sync + 'static,
    ) -> Self {
        Self::retry_after(Duration::ZERO, context, source)
    }

    /// A transient failure, retried after at least `after`.
    pub fn retry_after(
        after: Duration,
        context: impl Into<String>,
        source: impl Error + Send + Sync + 'static,
    ) -> Self {
        HandlerError::Retry {
            after,
            context: context.into(),
            source: Box::new(source),
        }
    }

    /// A deterministic failure with a stable code.
    pub fn fail(code: impl Into<String>, reason: impl Into<String>) -> Self {
        HandlerError::Fail {
            code: code.into(),
            reason: reason.into(),
        }
    }

    /// `e` as its classification says: [`Retry::Transient`] → [`HandlerError::Retry`],
    /// [`Retry::Permanent`] → [`HandlerError::Fail`] with code `PERMANENT` and the error chain as
    /// the reason.
    pub fn classified(
        context: impl Into<String>,
        e: impl Classify + Error + Send + Sync + 'static,
    ) -> Self {
        let context = context.into();
        match e.retry() {
            Retry::Transient => Self::transient(context, e),
            Retry::Permanent => Self::fail("PERMANENT", format!("{context}: {}", error_chain(&e))),
        }
    }
}

/// A fenced write refused because the lease moved on is [`HandlerError::LeaseLost`]; a write
/// offered without the fence is a bug that retrying cannot fix ([`HandlerError::Fail`],
/// `UNFENCED_WRITE`); a database error is transient.
impl From<FenceError> for HandlerError {
    fn from(e: FenceError) -> Self {
        match e {
            FenceError::Fenced { .. } => HandlerError::LeaseLost(e),
            FenceError::Unfenced { .. } => HandlerError::fail("UNFENCED_WRITE", e.to_string()),
            FenceError::Db { .. } => HandlerError::transient("fenced write", e),
            FenceError::Moved { .. } => HandlerError::transient("compare-and-set", e),
        }
    }
}

impl Classify for HandlerError {
    fn retry(&self) -> Retry {
        match self {
            HandlerError::Reject(_) | HandlerError::Fail { .. } => Retry::Permanent,
            HandlerError::LeaseLost(_) | HandlerError::Retry { .. } => Retry::Transient,
        }
    }
}

/// Deterministic failures a stage meets in its own data: retrying would fail the same way.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("the signer {signer} is not an address")]
    SignerAddress {
        signer: String,
        #[source]
        source: <Address as FromStr>::Err,
    },
    #[error("encoding the {event} audit payload")]
    Audit {
        event: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl Classify for DataError {
    fn retry(&self) -> Retry {
        match self {
            DataError::SignerAddress { .. } | DataError::Audit { .. } => Retry::Permanent,
        }
    }
}

/// The routing of a message that names its chain and signer: a signer that is not an address is
/// rejected (`INVALID_SIGNER`).
pub fn route_signer(chain_id: i64, signer: &str) -> Result<(ChainId, Signer), Rejection> {
    let signer =
        Signer::parse(signer).map_err(|e| Rejection::new("INVALID_SIGNER", e.to_string()))?;
    Ok((ChainId(chain_id), signer))
}

/// The signer of `key` as an address, for the chain's questions about it.
pub fn signer_address(key: &LeaseKey) -> Result<Address, DataError> {
    key.signer
        .as_str()
        .parse()
        .map_err(|source| DataError::SignerAddress {
            signer: key.signer.as_str().to_string(),
            source,
        })
}

/// `event` as the payload of the audit row (`tx_events`) of move `m`; one that does not encode is
/// a deterministic failure ([`DataError::Audit`]).
pub fn audit_json<E: serde::Serialize>(
    m: Move,
    event: &E,
) -> Result<serde_json::Value, HandlerError> {
    serde_json::to_value(event).map_err(|source| {
        HandlerError::classified(
            "audit",
            DataError::Audit {
                event: m.event,
                source,
            },
        )
    })
}

/// For `map_err` on a query outside the fenced writes (a drive's reads): a transient failure,
/// with what was being done.
pub fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> HandlerError {
    move |e| HandlerError::transient(context, e)
}

/// `e` and its sources, `": "`-separated.
pub(super) fn error_chain(e: &dyn Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// What [`Handler::drive`] works with: the signer's lease and the pool to open fenced
/// transactions from.
pub struct DriveCtx<'a> {
    pub lease: &'a HeldLease,
    pub pool: &'a PgPool,
    /// True when called by the recovery scan (start, assignment, periodic), false right after a
    /// batch committed work for this signer.
    pub recovery: bool,
}

/// What [`Handler::handle_batch`] answers: one result per message, or one error for the call.
pub type BatchResults = Result<Vec<Result<Vec<Output>, HandlerError>>, HandlerError>;

/// A stage's logic, plugged into the runtime.
pub trait Handler: Send + Sync + 'static {
    type Input: Event;

    /// The role whose leases the stage takes.
    fn role(&self) -> Role;

    /// The topic the stage consumes.
    fn input_topic(&self) -> String;

    /// The signer a message belongs to, or a permanent rejection (invalid input).
    fn route(&self, input: &Self::Input) -> Result<(ChainId, Signer), Rejection>;

    /// The Kafka key of a signer's messages on the input topic, which tells the partition its
    /// work belongs to (the recovery scan drives only the signers of this instance's
    /// partitions). Default: `{chain_id}:{signer}` ([`crate::kafka::signer_key`]); the transfer
    /// coordinator's topics are keyed by user id.
    fn partition_key(&self, chain_id: ChainId, signer: &Signer) -> String {
        crate::kafka::signer_key(chain_id.0, signer.as_str())
    }

    /// Applies one message inside its signer's savepoint. Idempotent: a message seen before must
    /// re-emit the same outputs (same `event_id`) and change nothing.
    fn handle(
        &self,
        w: &mut Fenced<'_>,
        input: &Self::Input,
    ) -> impl Future<Output = Result<Vec<Output>, HandlerError>> + Send;

    /// Applies all of one signer's messages of a batch, in offset order, inside its savepoint:
    /// what the runtime calls. Returns one result per message, in order; a result list shorter
    /// than `inputs` means the messages after the last result were not applied (they are retried
    /// with the rest of the signer's messages when a result is an error other than `Reject`). An
    /// `Err` for the whole call stands for the first message (and, unless it is a `Fail`, for all
    /// of them). The default calls [`Handler::handle`] for each message, stopping at the first
    /// error that is not a rejection; a stage overrides it to write all of them with set-based
    /// statements.
    fn handle_batch(
        &self,
        w: &mut Fenced<'_>,
        inputs: &[&Self::Input],
    ) -> impl Future<Output = BatchResults> + Send {
        async move {
            let mut results = Vec::with_capacity(inputs.len());
            for input in inputs {
                match self.handle(w, input).await {
                    Err(e) if !matches!(e, HandlerError::Reject(_)) => {
                        results.push(Err(e));
                        break;
                    }
                    r => results.push(r),
                }
            }
            Ok(results)
        }
    }

    /// Whether [`Handler::handle_batch`] writes anything. A stage whose messages only wake its
    /// drive (the receipt checker: a TxSubmitted says "look for this receipt"; the row it names
    /// is already there) answers false: its batches then open no transaction and call no
    /// `handle_batch`; the runtime takes the signers' leases and drives them, as after a commit.
    /// Default: true.
    fn writes_on_input(&self) -> bool {
        true
    }

    /// Signers with work in this stage's input states in PostgreSQL (the recovery scan).
    fn pending_signers(
        &self,
        pool: &PgPool,
    ) -> impl Future<Output = Result<Vec<(ChainId, Signer)>, sqlx::Error>> + Send;

    /// Signers whose waiting work a condition without a message has unblocked, driven every
    /// [`StageConfig::ready_interval`](super::StageConfig::ready_interval) rather than at the next
    /// recovery scan: the allocator's signers with requests waiting for the in-flight budget and
    /// room in it again (mining freed it). Only signers that can make progress, so that this is
    /// never a loop over work that cannot move. Default: none (the recovery scan alone).
    fn ready_signers(
        &self,
        _pool: &PgPool,
    ) -> impl Future<Output = Result<Vec<(ChainId, Signer)>, sqlx::Error>> + Send {
        async { Ok(Vec::new()) }
    }

    /// Drives one signer's pending work from PostgreSQL, outside any transaction: external calls
    /// (intent → commit → call → record), and re-emission of what the broker may have lost.
    fn drive(
        &self,
        ctx: DriveCtx<'_>,
    ) -> impl Future<Output = Result<Vec<Output>, HandlerError>> + Send;
}

/// A shared handler (e.g. one stage state used by two runtimes) is a handler.
impl<H: Handler> Handler for Arc<H> {
    type Input = H::Input;
    fn role(&self) -> Role {
        (**self).role()
    }
    fn input_topic(&self) -> String {
        (**self).input_topic()
    }
    fn route(&self, input: &Self::Input) -> Result<(ChainId, Signer), Rejection> {
        (**self).route(input)
    }
    fn partition_key(&self, chain_id: ChainId, signer: &Signer) -> String {
        (**self).partition_key(chain_id, signer)
    }
    fn handle(
        &self,
        w: &mut Fenced<'_>,
        input: &Self::Input,
    ) -> impl Future<Output = Result<Vec<Output>, HandlerError>> + Send {
        (**self).handle(w, input)
    }
    fn handle_batch(
        &self,
        w: &mut Fenced<'_>,
        inputs: &[&Self::Input],
    ) -> impl Future<Output = BatchResults> + Send {
        (**self).handle_batch(w, inputs)
    }
    fn writes_on_input(&self) -> bool {
        (**self).writes_on_input()
    }
    fn pending_signers(
        &self,
        pool: &PgPool,
    ) -> impl Future<Output = Result<Vec<(ChainId, Signer)>, sqlx::Error>> + Send {
        (**self).pending_signers(pool)
    }
    fn ready_signers(
        &self,
        pool: &PgPool,
    ) -> impl Future<Output = Result<Vec<(ChainId, Signer)>, sqlx::Error>> + Send {
        (**self).ready_signers(pool)
    }
    fn drive(
        &self,
        ctx: DriveCtx<'_>,
    ) -> impl Future<Output = Result<Vec<Output>, HandlerError>> + Send {
        (**self).drive(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer {
        #[source]
        inner: Inner,
        retry: Retry,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("inner")]
    struct Inner;

    impl Classify for Outer {
        fn retry(&self) -> Retry {
            self.retry
        }
    }

    #[test]
    fn classified_errors_keep_their_classification() {
        let transient = HandlerError::classified(
            "call",
            Outer {
                inner: Inner,
                retry: Retry::Transient,
            },
        );
        assert!(
            matches!(&transient, HandlerError::Retry { after, context, .. } if after.is_zero() && context == "call"),
            "{transient:?}"
        );
        assert!(transient.is_transient());
        let permanent = HandlerError::classified(
            "call",
            Outer {
                inner: Inner,
                retry: Retry::Permanent,
            },
        );
        match &permanent {
            HandlerError::Fail { code, reason } => {
                assert_eq!(code, "PERMANENT");
                assert_eq!(reason, "call: outer: inner");
            }
            other => panic!("{other:?}"),
        }
        assert!(!permanent.is_transient());
    }

    #[test]
    fn fence_errors_become_decisions() {
        let fenced = FenceError::Fenced {
            operation: "op",
            role: "allocator".into(),
            chain_id: 1,
            signer: "0xabc".into(),
            node: "n".into(),
            token: 2,
        };
        assert!(matches!(
            HandlerError::from(fenced),
            HandlerError::LeaseLost(_)
        ));
        let unfenced = HandlerError::from(FenceError::Unfenced { operation: "op" });
        assert!(
            matches!(&unfenced, HandlerError::Fail { code, .. } if code == "UNFENCED_WRITE"),
            "{unfenced:?}"
        );
        let db = HandlerError::from(FenceError::Db {
            operation: "op",
            source: sqlx::Error::PoolTimedOut,
        });
        assert!(
            matches!(&db, HandlerError::Retry { after, .. } if after.is_zero()),
            "{db:?}"
        );
    }
}
