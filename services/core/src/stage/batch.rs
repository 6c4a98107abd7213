//! Processing one batch: decode and route → acquire or renew the leases → one `BatchTx`
//! (optimistic: no savepoint per signer; run again with a savepoint per signer if a signer's work
//! fails) → commit → dead letters and outputs, acknowledged → only then the
//! offsets ([`OffsetPlan`]) → drive the signers whose work committed.
//!
//! What becomes of a message the handler could not apply ([`HandlerError`]):
//! - `Reject`: dead-lettered after the commit; the signer's other messages go on.
//! - `LeaseLost`: the signer's savepoint is rolled back, its lease forgotten (the next batch
//!   re-acquires it) and its messages retried.
//! - `Retry { after }`: the signer's savepoint is rolled back and its messages retried, after at
//!   least `after`.
//! - `Fail { code }`: the signer's savepoint is rolled back, the failing message is dead-lettered
//!   with `error.code = code` and counts as done; the signer's other messages of the batch are
//!   retried (they were rolled back with it). See "Offsets of a failed message" below.
//!
//! Offsets of a failed message. A partition is rewound to its first message to retry and
//! everything after it comes again. A failed message F of signer S at offset `f`, with S's other
//! messages of the batch at offsets `a < f < b` (all on one partition, since a signer's key picks
//! its partition):
//! - if nothing before `f` on the partition is retried (S had no message before F, and no other
//!   signer's message before `f` is retried), the stored offset covers `f` and F never comes
//!   again;
//! - otherwise the partition is rewound to some offset before `f` and F comes again. Run again it
//!   would fail again, and S's messages before it would be rolled back again: a loop that pins the
//!   partition. So F is remembered as settled ([`Settled`]) once its dead letter is acknowledged,
//!   and skipped (done, not handled, not dead-lettered again) when it comes again: S's message at
//!   `a` is applied, F skipped, `b` applied — the order the partition gives. The memory goes once
//!   a stored offset covers `f`, or when the partition is revoked (the next owner may run F once
//!   more and dead-letter it again).
//!
//! If the batch does not commit, nothing of it was applied and nothing is dead-lettered by the
//! handler's decisions: every routed message comes again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rdkafka::Message;
use rdkafka::Offset;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::BorrowedMessage;
use rdkafka::producer::FutureProducer;
use tracing::Instrument;

use super::consumer::StageContext;
use super::handler::error_chain;
use super::offsets::{OffsetPlan, Outcome};
use super::produce::{Parent, header};
use super::{Handler, HandlerError, Output, Rejection, StageRuntime};
use crate::domain::{ChainId, Signer};
use crate::events::Event;
use crate::fault;
use crate::fenced::{BatchCommitError, BatchTx};
use crate::lease::HeldLease;
use crate::otel;
use crate::retry::Classify;
use crate::telemetry;

/// `stage.hop.latency`: from each message's Kafka timestamp (its producer's create time) to now,
/// when the batch holding it is picked up. A message that comes again (a retry) counts again.
fn record_hop_latency(role: crate::domain::Role, batch: &[BorrowedMessage<'_>]) {
    if !crate::metrics::enabled() {
        return;
    }
    let metrics = crate::metrics::get();
    let now_ms = chrono::Utc::now().timestamp_millis();
    for m in batch {
        if let Some(ts) = m.timestamp().to_millis() {
            let ms = u64::try_from(now_ms.saturating_sub(ts)).unwrap_or(0);
            metrics.stage_hop_latency(role, Duration::from_millis(ms));
        }
    }
}

/// One consumed message, decoded and routed.
struct Item<I> {
    /// Its index in the batch.
    at: usize,
    partition: i32,
    offset: i64,
    input: I,
    signer: (ChainId, Signer),
    traceparent: Option<String>,
    /// Its `process` span (`Span::none()` when traces are off), child of `traceparent`.
    span: tracing::Span,
}

impl<I> Item<I> {
    /// Where the `traceparent` of an output made from this message comes from: the message's
    /// span when traces are exported, else (as before) the message's own header.
    fn parent(&self) -> Parent<'_> {
        if otel::enabled() {
            Parent::Span {
                parent: otel::context_of(&self.span),
                link: None,
            }
        } else {
            Parent::Header(self.traceparent.as_deref())
        }
    }
}

/// What the batch transaction made of the routed messages (indices into the items).
#[derive(Default)]
struct Applied {
    committed: bool,
    outputs: Vec<(usize, Vec<Output>)>,
    /// Rejected by the handler, in kept signers: dead-lettered after the commit.
    rejected: Vec<(usize, Rejection)>,
    /// Failed (`HandlerError::Fail`): dead-lettered after the commit, then settled.
    failed: Vec<(usize, Rejection)>,
    /// To come again.
    retry: BTreeSet<usize>,
    /// The longest `after` of a `HandlerError::Retry`.
    after: Duration,
    kept_signers: Vec<(ChainId, Signer)>,
}

/// A batch of a handler that writes nothing on input ([`Handler::writes_on_input`]): committed
/// without a transaction; the signers whose lease is held are kept (and driven), the others'
/// messages come again.
fn nothing_to_write(
    by_signer: &BTreeMap<(ChainId, Signer), Vec<usize>>,
    held: impl Fn(&(ChainId, Signer)) -> bool,
) -> Applied {
    let mut applied = Applied {
        committed: true,
        ..Applied::default()
    };
    for (signer, idxs) in by_signer {
        if held(signer) {
            applied.kept_signers.push(signer.clone());
        } else {
            applied.retry.extend(idxs);
        }
    }
    applied
}

/// `(tx_id, traceparent of the message's span)` of the transactions that messages without one (a
/// request) made: the outputs that name a transaction.
fn new_traces<I: Event>(
    items: &[Item<I>],
    outputs: &[(usize, Vec<Output>)],
) -> Vec<(uuid::Uuid, String)> {
    let mut traces = Vec::new();
    for (i, outs) in outputs {
        let item = &items[*i];
        if item.input.tx_id().is_some() {
            continue;
        }
        let Some(tp) = otel::inject(&otel::context_of(&item.span)) else {
            continue;
        };
        for o in outs {
            if let Some(id) = o
                .tx_id
                .as_deref()
                .and_then(|t| uuid::Uuid::parse_str(t).ok())
                && !traces.iter().any(|(t, _)| *t == id)
            {
                traces.push((id, tp.clone()));
            }
        }
    }
    traces
}

impl<H: Handler> StageRuntime<H> {
    /// Processes one batch; returns how long to pause before the messages to retry come again
    /// (`None`: nothing to retry).
    pub(super) async fn process_batch(
        &self,
        consumer: &StreamConsumer<StageContext>,
        producer: &FutureProducer,
        batch: Vec<BorrowedMessage<'_>>,
    ) -> Option<Duration> {
        let started = Instant::now();
        record_hop_latency(self.handler.role(), &batch);
        let topic = self.handler.input_topic();
        let mut outcomes = vec![Outcome::Done; batch.len()];
        let items = self.decode(producer, &batch, &mut outcomes).await;

        // Group by signer, in offset order (one signer's messages share a partition).
        let mut by_signer: BTreeMap<(ChainId, Signer), Vec<usize>> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            by_signer.entry(item.signer.clone()).or_default().push(i);
        }
        let leases = self.leases_for(by_signer.keys().cloned().collect()).await;

        // A batch slower than a renewal interval keeps its leases renewed, so that its commit's
        // lease check finds them current; a lost one is forgotten, and its signer's work is
        // refused by the fence (or the commit), the others' go on.
        let mut applied = if self.handler.writes_on_input() {
            let renewed: Vec<HeldLease> = leases.values().cloned().collect();
            let apply = self.apply(&items, &by_signer, &leases);
            self.while_renewing(renewed, apply).await
        } else {
            // Nothing to write: no transaction; the signers held are driven below. Each
            // message's span still names the fencing token its signer's work runs under.
            if otel::enabled() {
                for (s, idxs) in &by_signer {
                    if let Some(lease) = leases.get(s) {
                        for &i in idxs {
                            items[i].span.record("fencing_token", lease.token().0);
                        }
                    }
                }
            }
            nothing_to_write(&by_signer, |s| leases.contains_key(s))
        };
        if !applied.committed {
            // Nothing of the batch was applied: everything comes again.
            applied.outputs.clear();
            applied.rejected.clear();
            applied.failed.clear();
            applied.retry.extend(0..items.len());
        }
        fault::point(fault::AFTER_COMMIT);

        // Dead letters and outputs, acknowledged before any offset moves.
        let find = |i: usize| &batch[items[i].at];
        for (i, r) in &applied.rejected {
            if !self.dead_letter(producer, find(*i), r).await {
                applied.retry.insert(*i);
            }
        }
        let mut settled = Vec::new();
        for (i, r) in &applied.failed {
            if self.dead_letter(producer, find(*i), r).await {
                settled.push((items[*i].partition, items[*i].offset));
            } else {
                applied.retry.insert(*i);
            }
        }
        let all: Vec<(&Output, Parent<'_>)> = applied
            .outputs
            .iter()
            .flat_map(|(i, outs)| outs.iter().map(|o| (o, items[*i].parent())))
            .collect();
        if !self.produce(producer, &all).await {
            // The state is committed; the outputs are re-emitted when the messages come again.
            applied
                .retry
                .extend(applied.outputs.iter().map(|(i, _)| *i));
        }
        fault::point(fault::AFTER_PRODUCE);

        // Only now the offsets.
        for i in &applied.retry {
            outcomes[items[*i].at] = Outcome::Retry;
        }
        let plan = OffsetPlan::new(
            batch
                .iter()
                .zip(&outcomes)
                .map(|(m, o)| (m.partition(), m.offset(), *o)),
        );
        for (p, off) in &plan.store {
            if let Err(e) = consumer.store_offset(&topic, *p, *off) {
                tracing::warn!(error = %e, partition = p, "could not store the offset");
            }
        }
        if !plan.store.is_empty()
            && let Err(e) = consumer.commit_consumer_state(CommitMode::Async)
        {
            tracing::debug!(error = %e, "offset commit");
        }
        for (p, off) in &plan.seek {
            if let Err(e) = consumer.seek(&topic, *p, Offset::Offset(*off), Duration::from_secs(5))
            {
                tracing::warn!(error = %e, partition = p, offset = off, "could not rewind for a retry");
            }
        }
        if let Ok(mut s) = self.settled.lock() {
            for (p, off) in settled {
                s.insert(p, off);
            }
            s.stored(&plan);
        }

        // External calls and follow-ups for the signers whose work committed.
        if applied.committed {
            let to_drive: Vec<&HeldLease> = applied
                .kept_signers
                .iter()
                .filter_map(|s| leases.get(s))
                .collect();
            // Each drive continues the trace of its signer's first message of the batch.
            let mut causes = super::recovery::Causes::new();
            if otel::enabled() {
                for s in &applied.kept_signers {
                    if let Some(idxs) = by_signer.get(s) {
                        causes.insert(
                            s.clone(),
                            idxs.iter()
                                .map(|&i| otel::context_of(&items[i].span))
                                .collect(),
                        );
                    }
                }
            }
            self.drive_all(producer, &to_drive, false, &causes).await;
        }
        telemetry::BatchCommitted {
            role: self.handler.role(),
            node: self.leases.node(),
            messages: batch.len(),
            signers: by_signer.len(),
            retried: outcomes.iter().filter(|o| **o == Outcome::Retry).count(),
            elapsed: started.elapsed(),
        }
        .emit();
        plan.retries()
            .then(|| self.config.retry_backoff.max(applied.after))
    }

    /// Decodes and routes the batch's messages. Undecodable or unroutable ones are dead-lettered
    /// (done); those that cannot be decoded now (the registry is unavailable), or whose dead letter
    /// is not acknowledged, are retried, and so is everything after them on their partition
    /// (`outcomes`); settled ones are skipped (done).
    async fn decode(
        &self,
        producer: &FutureProducer,
        batch: &[BorrowedMessage<'_>],
        outcomes: &mut [Outcome],
    ) -> Vec<Item<H::Input>> {
        let mut items = Vec::with_capacity(batch.len());
        let mut blocked: BTreeSet<i32> = BTreeSet::new();
        for (at, m) in batch.iter().enumerate() {
            if blocked.contains(&m.partition()) {
                // Behind a message that must be retried: keep the partition's order.
                outcomes[at] = Outcome::Retry;
                continue;
            }
            if self
                .settled
                .lock()
                .is_ok_and(|s| s.contains(m.partition(), m.offset()))
            {
                tracing::debug!(
                    partition = m.partition(),
                    offset = m.offset(),
                    "skipping a message dead-lettered before"
                );
                continue;
            }
            let decoded = match m.payload() {
                None => Err(Rejection::new("EMPTY_MESSAGE", "the message has no value")),
                Some(bytes) => match self.codec.decode::<H::Input>(bytes).await {
                    Ok(v) => self.handler.route(&v).map(|signer| (v, signer)),
                    Err(e) if e.is_transient() => {
                        tracing::warn!(error = ?e, "decoding needs the registry; retrying later");
                        outcomes[at] = Outcome::Retry;
                        blocked.insert(m.partition());
                        continue;
                    }
                    Err(e) => Err(Rejection::new("UNDECODABLE", error_chain(&e))),
                },
            };
            match decoded {
                Ok((input, signer)) => {
                    let traceparent = header(m, "traceparent");
                    let span = otel::process_span(
                        self.handler.role(),
                        m.topic(),
                        &self.config.group_id,
                        m.partition(),
                        m.offset(),
                        input.event_id(),
                        input.tx_id(),
                        &signer,
                        traceparent.as_deref(),
                    );
                    items.push(Item {
                        at,
                        partition: m.partition(),
                        offset: m.offset(),
                        input,
                        signer,
                        traceparent,
                        span,
                    })
                }
                Err(rejection) => {
                    if !self.dead_letter(producer, m, &rejection).await {
                        outcomes[at] = Outcome::Retry;
                        blocked.insert(m.partition());
                    }
                }
            }
        }
        items
    }

    /// Runs the handler for every signer of the batch in one `BatchTx` and commits it. First
    /// optimistically, without a savepoint per signer ([`BatchTx::begin_optimistic`]); if a
    /// signer's work fails there, that run is rolled back and the batch runs again guarded, a
    /// savepoint per signer, so that the failing signer is rolled back alone and the others
    /// commit. Handlers are idempotent and nothing of the first run was committed, so running
    /// them twice changes nothing.
    async fn apply(
        &self,
        items: &[Item<H::Input>],
        by_signer: &BTreeMap<(ChainId, Signer), Vec<usize>>,
        leases: &std::collections::HashMap<(ChainId, Signer), HeldLease>,
    ) -> Applied {
        if let Some(applied) = self.apply_in(items, by_signer, leases, false).await {
            return applied;
        }
        tracing::debug!(
            role = %self.handler.role(),
            "a signer's work failed in the optimistic batch: running the batch again with a savepoint per signer"
        );
        self.apply_in(items, by_signer, leases, true)
            .await
            .unwrap_or_default()
    }

    /// One run of [`Self::apply`]: `guarded`, a savepoint per signer; otherwise none, and `None`
    /// (everything rolled back) as soon as a signer's work fails.
    async fn apply_in(
        &self,
        items: &[Item<H::Input>],
        by_signer: &BTreeMap<(ChainId, Signer), Vec<usize>>,
        leases: &std::collections::HashMap<(ChainId, Signer), HeldLease>,
        guarded: bool,
    ) -> Option<Applied> {
        let mut applied = Applied::default();
        let idle = self.config.lease.duration * 2;
        let mut tx = match BatchTx::begin_with(&self.pool, idle, guarded).await {
            Ok(tx) => tx,
            Err(e) => {
                tracing::warn!(error = ?e, "cannot begin the batch transaction");
                return Some(applied); // not committed: everything comes again
            }
        };
        let mut first_signer = true;
        for (signer, idxs) in by_signer {
            let Some(lease) = leases.get(signer) else {
                // Held by another node (or acquisition failed): later.
                applied.retry.extend(idxs);
                continue;
            };
            if !first_signer {
                fault::point(fault::MID_BATCH);
            }
            first_signer = false;
            let mut scope = match tx.signer(lease).await {
                Ok(s) => s,
                Err(e) => {
                    if e.is_fenced() {
                        self.forget(signer);
                    }
                    applied.retry.extend(idxs);
                    continue;
                }
            };
            let mut signer_outputs = Vec::new();
            let mut signer_rejected = Vec::new();
            let mut failed: Option<(usize, HandlerError)> = None;
            if otel::enabled() {
                for &i in idxs {
                    items[i].span.record("fencing_token", lease.token().0);
                }
            }
            let span = tracing::debug_span!(
                parent: &items[idxs[0]].span,
                "handle",
                role = %self.handler.role(),
                signer = %signer.1,
                chain_id = signer.0.0,
                fencing_token = lease.token().0,
                messages = idxs.len(),
                first_offset = idxs.first().map(|&i| items[i].offset),
            );
            let inputs: Vec<&H::Input> = idxs.iter().map(|&i| &items[i].input).collect();
            match self
                .handler
                .handle_batch(&mut scope.writer(), &inputs)
                .instrument(span)
                .await
            {
                // For the whole call: it stands for the signer's first message.
                Err(e) => failed = Some((idxs[0], e)),
                Ok(results) => {
                    if results.len() < idxs.len()
                        && !results.iter().any(|r| {
                            r.as_ref()
                                .is_err_and(|e| !matches!(e, HandlerError::Reject(_)))
                        })
                    {
                        // A handler that answered for fewer messages than it was given, without
                        // an error: never let the others' offsets move on unapplied.
                        tracing::error!(signer = %signer.1, given = idxs.len(), answered = results.len(),
                            "handle_batch answered for fewer messages than given; retrying them");
                        failed = Some((
                            idxs[results.len()],
                            HandlerError::retry_after(
                                Duration::ZERO,
                                "handle_batch",
                                std::io::Error::other("fewer results than messages"),
                            ),
                        ));
                    }
                    for (&i, result) in idxs.iter().zip(results) {
                        if failed.is_some() {
                            break;
                        }
                        match result {
                            Ok(outs) => signer_outputs.push((i, outs)),
                            Err(HandlerError::Reject(r)) => signer_rejected.push((i, r)),
                            Err(e) => {
                                failed = Some((i, e));
                                break;
                            }
                        }
                    }
                }
            }
            let Some((at, e)) = failed else {
                if otel::enabled() {
                    // The trace of a request goes on in PostgreSQL: its later steps are drives
                    // over rows, not messages (`txstore::record_traces`).
                    let traces = new_traces(items, &signer_outputs);
                    if let Err(e) =
                        crate::txstore::record_traces(&mut scope.writer(), &traces).await
                    {
                        tracing::warn!(error = ?e, signer = %signer.1, "could not record the trace context");
                        if !guarded {
                            // The transaction may be aborted: run the batch again, guarded.
                            let _ = scope.discard().await;
                            return abandon(tx).await;
                        }
                    }
                }
                match scope.keep().await {
                    Ok(()) => {
                        applied.kept_signers.push(signer.clone());
                        applied.outputs.extend(signer_outputs);
                        applied.rejected.extend(signer_rejected);
                    }
                    Err(e) => {
                        tracing::warn!(error = ?e, signer = %signer.1, "could not keep the signer's work");
                        applied.retry.extend(idxs);
                    }
                }
                continue;
            };
            let _ = scope.discard().await;
            if !guarded {
                // Discarded, the optimistic batch cannot commit: run it again, guarded.
                return abandon(tx).await;
            }
            applied.retry.extend(idxs);
            let dead_letter = match e {
                HandlerError::LeaseLost(_) => {
                    tracing::warn!(signer = %signer.1, "fenced: rolling the signer back");
                    self.forget(signer);
                    None
                }
                HandlerError::Retry { after, .. } => {
                    tracing::warn!(error = ?e, signer = %signer.1, "handler failed; retrying later");
                    applied.after = applied.after.max(after);
                    None
                }
                HandlerError::Fail { code, reason } => Some(Rejection::new(code, reason)),
                // A rejection does not stop the signer (above); were one here, it would go the
                // way of a failure.
                HandlerError::Reject(r) => Some(r),
            };
            if let Some(r) = dead_letter {
                tracing::warn!(code = %r.code, reason = %r.message, signer = %signer.1, offset = items[at].offset,
                    "handler failed for good: dead-lettering the message, retrying the signer's others");
                applied.retry.remove(&at);
                applied.failed.push((at, r));
            }
        }
        applied.committed = match tx.commit().await {
            Ok(()) => true,
            Err(BatchCommitError::Fenced(lost)) => {
                for l in &lost {
                    self.forget(&(l.key().chain_id, l.key().signer.clone()));
                }
                false
            }
            Err(e) => {
                tracing::warn!(error = ?e, "batch commit failed");
                false
            }
        };
        Some(applied)
    }
}

/// An optimistic batch abandoned by a discarded signer ([`crate::fenced::SignerScope::discard`]):
/// everything is rolled back (`None`), and the batch runs again guarded.
async fn abandon(tx: BatchTx) -> Option<Applied> {
    if let Err(e) = tx.rollback().await {
        // The connection goes back to the pool either way: sqlx rolls back a dropped
        // transaction.
        tracing::debug!(error = ?e, "rolling back the optimistic batch");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer(n: u8) -> (ChainId, Signer) {
        let s = Signer::parse(&format!("0x{:040x}", n)).expect("an address");
        (ChainId(1), s)
    }

    /// Without writes, a batch commits nothing and is "committed": the held signers are kept (to
    /// be driven), the others' messages come again, and nothing is produced.
    #[test]
    fn a_batch_without_writes_keeps_the_held_signers_and_retries_the_others() {
        let by_signer = BTreeMap::from([
            (signer(1), vec![0, 2]),
            (signer(2), vec![1]),
            (signer(3), vec![3, 4]),
        ]);
        let held = [signer(1), signer(3)];
        let applied = nothing_to_write(&by_signer, |s| held.contains(s));
        assert!(applied.committed);
        assert_eq!(applied.kept_signers, vec![signer(1), signer(3)]);
        assert_eq!(applied.retry, BTreeSet::from([1]));
        assert!(applied.outputs.is_empty() && applied.rejected.is_empty());
        assert!(applied.failed.is_empty());
    }
}
