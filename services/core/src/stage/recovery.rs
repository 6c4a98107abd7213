//! Driving signers' pending work from PostgreSQL, outside any transaction: after a batch for the
//! signers whose work committed, and in the recovery scan (on start, on partition assignment and
//! every `recovery_interval`) for the signers with work in the stage's input states that hash to
//! this instance's partitions.
//!
//! A drive runs alone for its signer in this process ([`LeaseManager::lock_signer`], shared by
//! the runtimes of one role: the allocator's requests and commands), and keeps the signer's lease
//! renewed while it runs, so that an RPC endpoint slower than the lease does not make the owner
//! lose it mid-drive and the next owner repeat the work. A drive whose lease is found lost is
//! abandoned: its further writes would be fenced.
//!
//! [`LeaseManager::lock_signer`]: crate::lease::LeaseManager::lock_signer

use std::collections::BTreeMap;

use futures::StreamExt;
use rdkafka::producer::FutureProducer;
use tracing::Instrument;

use super::produce::Parent;
use super::{DriveCtx, Handler, HandlerError, Output, StageRuntime};
use crate::domain::{ChainId, Signer};
use crate::fault;
use crate::lease::HeldLease;
use crate::otel;
use crate::outbox;

/// The trace contexts a drive continues, per signer: the `process` spans of the signer's messages
/// in the batch that triggered it (empty for the recovery scan's and the ready drives, and
/// whenever traces are off).
pub(super) type Causes = BTreeMap<(ChainId, Signer), Vec<opentelemetry::Context>>;

/// How many signers' `drive` run at once.
const DRIVE_CONCURRENCY: usize = 16;

impl<H: Handler> StageRuntime<H> {
    /// Drives the pending work of the signers on `partitions` from PostgreSQL.
    pub(super) async fn recovery_scan(&self, producer: &FutureProducer, partitions: &[i32]) {
        let mut pending = match self.handler.pending_signers(&self.pool).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "recovery scan could not list pending work");
                return;
            }
        };
        if self.config.outbox.is_some() {
            let types = outbox::relayed_by(self.handler.role());
            match outbox::signers_with_unpublished(&self.pool, types).await {
                Ok(more) => pending.extend(more),
                Err(e) => {
                    tracing::warn!(error = %e, "recovery scan could not list unpublished events")
                }
            }
        }
        self.drive_mine(producer, pending, partitions, true).await;
    }

    /// Drives those of `signers` on `partitions` (each once), under their leases: the recovery
    /// scan's drives (`recovery`) or the ready drives between scans.
    async fn drive_mine(
        &self,
        producer: &FutureProducer,
        signers: Vec<(ChainId, Signer)>,
        partitions: &[i32],
        recovery: bool,
    ) {
        let mut mine: Vec<(ChainId, Signer)> = signers
            .into_iter()
            .filter(|(c, s)| partitions.contains(&self.partition_of(*c, s)))
            .collect();
        mine.sort();
        mine.dedup();
        if mine.is_empty() {
            return;
        }
        if recovery {
            tracing::info!(role = %self.handler.role(), signers = mine.len(), "recovery scan");
        } else {
            tracing::debug!(role = %self.handler.role(), signers = mine.len(), "driving signers ready to go on");
        }
        let leases = self.leases_for(mine).await;
        let to_drive: Vec<&HeldLease> = leases.values().collect();
        self.drive_all(producer, &to_drive, recovery, &Causes::new())
            .await;
    }

    /// Drives the signers on `partitions` whose waiting work was unblocked without a message
    /// ([`Handler::ready_signers`]), between recovery scans.
    pub(super) async fn drive_ready(&self, producer: &FutureProducer, partitions: &[i32]) {
        let ready = match self.handler.ready_signers(&self.pool).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "could not list signers ready to go on");
                return;
            }
        };
        self.drive_mine(producer, ready, partitions, false).await;
    }

    /// Drives several signers at once (each signer's own work stays sequential).
    pub(super) async fn drive_all(
        &self,
        producer: &FutureProducer,
        leases: &[&HeldLease],
        recovery: bool,
        causes: &Causes,
    ) {
        let mut drives = Vec::with_capacity(leases.len());
        for lease in leases {
            let key = (lease.key().chain_id, lease.key().signer.clone());
            let caused_by = causes.get(&key).map(Vec::as_slice).unwrap_or(&[]);
            drives.push(self.drive(producer, lease, recovery, caused_by));
        }
        futures::stream::iter(drives)
            .buffer_unordered(DRIVE_CONCURRENCY)
            .collect::<Vec<()>>()
            .await;
    }

    /// Drives one signer and produces what it returns. A failure is never retried here: the
    /// recovery scan drives the signer again.
    ///
    /// The signer is locked for the whole drive: another drive of it in this process (the other
    /// runtime of the role, or this one's) waits for its turn and then sees what this one did. Two
    /// drives at once would both pass the fence (same node, same token): both simulate the same
    /// requests and both allocate nonces for them, the second's allocation failing on rows the
    /// first moved. The lease is renewed while the drive runs; if it is lost the drive is dropped.
    async fn drive(
        &self,
        producer: &FutureProducer,
        lease: &HeldLease,
        recovery: bool,
        causes: &[opentelemetry::Context],
    ) {
        let key = lease.key();
        let signer = &key.signer;
        let _turn = self.leases.lock_signer(key.chain_id, signer).await;
        let span = otel::drive_span(
            self.handler.role(),
            key.chain_id,
            signer,
            lease.token().0,
            recovery,
            causes,
        );
        let work = async {
            if recovery {
                self.relay(producer, lease).await;
            }
            self.handler
                .drive(DriveCtx {
                    lease,
                    pool: &self.pool,
                    recovery,
                })
                .await
        }
        .instrument(span.clone());
        let Some(result) = self.unless_lost(lease, work).await else {
            tracing::warn!(%signer, fencing_token = lease.token().0,
                "lease lost while driving pending work: the drive is abandoned (its writes would be fenced); the recovery scan retries once the lease is held again");
            return;
        };
        match result {
            Ok(outs) => {
                if !outs.is_empty() {
                    fault::point(fault::AFTER_DRIVE);
                }
                let all = self.drive_parents(&span, &outs).await;
                self.produce(producer, &all).await;
            }
            Err(HandlerError::LeaseLost(e)) => {
                self.forget(&(lease.key().chain_id, signer.clone()));
                tracing::warn!(error = ?e, %signer, "lease lost while driving pending work; the recovery scan retries");
            }
            Err(e @ HandlerError::Retry { .. }) => {
                tracing::warn!(error = ?e, %signer, "driving pending work failed; the recovery scan retries");
            }
            // A deterministic failure would fail again on every scan: the signer is held, which
            // raises the alert (the `signer_holds` row and an ERROR event), and the scan tries
            // again later (the hold is cleared by the handler once it proceeds, or by an
            // operator). A rejection has no message to dead-letter here: it is the same.
            Err(HandlerError::Fail { code, reason }) => {
                self.hold(lease, &format!("{code}: {reason}")).await;
            }
            Err(HandlerError::Reject(r)) => {
                self.hold(lease, &format!("{}: {}", r.code, r.message))
                    .await;
            }
        }
    }

    /// The outbox relay: produces the signer's announced events that a crash left unpublished
    /// (oldest first, with their own `event_id`), under the signer's lease; the acknowledged
    /// ones are marked by `produce`.
    async fn relay(&self, producer: &FutureProducer, lease: &HeldLease) {
        let Some(topics) = &self.config.outbox else {
            return;
        };
        let types = outbox::relayed_by(self.handler.role());
        let rows = match outbox::unpublished(&self.pool, lease.key(), types).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, signer = %lease.key().signer, "could not read unpublished events");
                return;
            }
        };
        if rows.is_empty() {
            return;
        }
        let mut outs = Vec::with_capacity(rows.len());
        for row in &rows {
            match outbox::outputs(topics, lease.key(), row) {
                Ok(o) => outs.extend(o),
                // Left unpublished, reported on every scan: an operator must look at it.
                Err(e) => {
                    tracing::error!(error = ?e, tx_id = %row.tx_id, "an unpublished event cannot be relayed")
                }
            }
        }
        // Inside the drive's span (`drive` instruments the relay).
        let all = self.drive_parents(&tracing::Span::current(), &outs).await;
        let produced = self.produce(producer, &all).await;
        tracing::info!(role = %self.handler.role(), signer = %lease.key().signer, events = rows.len(), outputs = outs.len(), produced, "relayed unpublished events");
    }

    /// The parents of a drive's outputs. Traces off: none (a new trace each, as before). Traces
    /// exported: the drive's span, or, for an output whose transaction belongs to another trace
    /// (the one recorded when its request came, `txstore::record_traces`), a span of that trace
    /// linked to the drive: every step of a request stays in the request's trace, whichever
    /// batch or scan drove it.
    async fn drive_parents<'o>(
        &self,
        span: &tracing::Span,
        outs: &'o [Output],
    ) -> Vec<(&'o Output, Parent<'static>)> {
        if !otel::enabled() || outs.is_empty() {
            return outs.iter().map(|o| (o, Parent::Header(None))).collect();
        }
        let drive = otel::context_of(span);
        let drive_sc = otel::span_context(&drive);
        let mut ids: Vec<uuid::Uuid> = outs
            .iter()
            .filter_map(|o| o.tx_id.as_deref())
            .filter_map(|t| uuid::Uuid::parse_str(t).ok())
            .collect();
        ids.sort();
        ids.dedup();
        span.record("txflow.outputs", outs.len());
        let recorded = match crate::txstore::traceparents(&self.pool, &ids).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!(error = %e, "could not read the recorded trace contexts");
                Vec::new()
            }
        };
        // The drive names its transaction when it worked on one, in that transaction's trace (a
        // span with a `tx_id` is always in the request's trace).
        if let [only] = ids.as_slice() {
            let theirs = recorded
                .iter()
                .find(|(r, _)| r == only)
                .and_then(|(_, tp)| otel::extract(tp));
            if theirs.is_none_or(|cx| otel::span_context(&cx).trace_id() == drive_sc.trace_id()) {
                span.record("tx_id", only.to_string());
            }
        }
        outs.iter()
            .map(|o| {
                let theirs = o
                    .tx_id
                    .as_deref()
                    .and_then(|t| uuid::Uuid::parse_str(t).ok())
                    .and_then(|id| recorded.iter().find(|(r, _)| *r == id))
                    .and_then(|(_, tp)| otel::extract(tp))
                    .filter(|cx| otel::span_context(cx).trace_id() != drive_sc.trace_id());
                let parent = match theirs {
                    Some(cx) => Parent::Span {
                        parent: cx,
                        link: drive_sc.is_valid().then(|| drive_sc.clone()),
                    },
                    None => Parent::Span {
                        parent: drive.clone(),
                        link: None,
                    },
                };
                (o, parent)
            })
            .collect()
    }

    async fn hold(&self, lease: &HeldLease, reason: &str) {
        if let Err(e) = crate::holds::hold(&self.pool, lease.key(), reason).await {
            tracing::warn!(error = ?e, signer = %lease.key().signer, reason, "could not hold the signer after a failure");
        }
    }
}
