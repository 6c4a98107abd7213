//! The transactional outbox (issue 12 point 4): every announced event recorded in `tx_events`
//! ([`ANNOUNCED`]) reaches its topic at least once, also when the process dies between the
//! PostgreSQL commit that recorded it and the broker's acknowledgement.
//!
//! - [`crate::txstore`] writes an announced event's `tx_events` row and its `tx_outbox` row
//!   (migration 0016) in the same statement as the state change it announces;
//! - the stage runtime deletes the `tx_outbox` rows of the outputs the broker acknowledged
//!   ([`mark_published`]); `tx_events` is written once and never updated;
//! - the recovery scan relays, for the signers whose lease it holds, the events of the types its
//!   role announces whose `tx_outbox` row is still there after [`GRACE`] ([`unpublished`],
//!   [`outputs`]), reading each one's payload from `tx_events`.
//!
//! Duplicates on a topic are possible (a crash after the acknowledgement, before the mark; a relay
//! racing the producing stage); consumers deduplicate by `event_id`, which a relayed event keeps.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use crate::codec::Subjects;
use crate::domain::{ChainId, Role, Signer};
use crate::events::{
    Event, TxAllocated, TxConfirmationReverted, TxConfirmationsUpdated, TxConfirmed, TxFailed,
    TxReceiptUpdated, TxSigned, TxSubmitted,
};
use crate::kafka::{Topics, signer_key};
use crate::lease::LeaseKey;
use crate::output::Output;
use crate::retry::{Classify, Retry};

pub use txflow_domain::events::ANNOUNCED;

/// How old an unpublished row must be before the relay produces it: the stage that recorded it
/// produces it within milliseconds; the relay is for the ones a crash left behind.
pub const GRACE: Duration = Duration::from_secs(3);

/// How many rows one relay produces for one signer (the next scan takes the rest).
pub const RELAY_LIMIT: i64 = 1000;

/// The announced event types a role records, and so relays: the allocator's allocations and
/// failures (simulation, policy, cancel), the signer gateway's signatures and failures at signing,
/// the broadcaster's submissions and refusals, the receipt checker's receipts (MINED, REVERTED).
pub fn relayed_by(role: Role) -> &'static [&'static str] {
    match role {
        Role::Allocator => &["TxAllocated", "TxFailed"],
        Role::SignerGateway => &["TxSigned", "TxFailed"],
        Role::Broadcaster => &["TxSubmitted", "TxFailed"],
        Role::ReceiptChecker => &["TxMined", "TxReverted"],
        Role::ConfirmationManager => &[
            "TxConfirmationsUpdated",
            "TxReorged",
            "TxConfirmed",
            "TxConfirmationReverted",
        ],
        _ => &[],
    }
}

/// An unpublished `tx_events` row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Unpublished {
    pub event_id: Uuid,
    pub tx_id: Uuid,
    #[sqlx(rename = "type")]
    pub event_type: String,
    pub payload: serde_json::Value,
}

/// A row the relay cannot turn into its event again: written by a version that no longer reads
/// it, or not an announced type. Permanent: the row is left unpublished and reported.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("tx_events row {event_id} of type {event_type} is not an announced event")]
    NotAnnounced { event_id: Uuid, event_type: String },
    #[error("tx_events row {event_id} of type {event_type} does not decode as its event")]
    Payload {
        event_id: Uuid,
        event_type: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("tx_events row {event_id} carries event_id {payload_id} in its payload")]
    EventId { event_id: Uuid, payload_id: String },
}

impl Classify for RelayError {
    fn retry(&self) -> Retry {
        Retry::Permanent
    }
}

/// The outputs of a TxSubmitted: on `tx.submitted` for the receipt checker, and a copy (same
/// `event_id`) on `tx.outcomes`, where downstream follows each transaction in order.
pub fn submitted(topics: &Topics, key: String, e: TxSubmitted) -> Vec<Output> {
    vec![
        Output::new(
            topics.tx_submitted(),
            Subjects::TopicName,
            key.clone(),
            e.clone(),
        ),
        Output::new(topics.tx_outcomes(), Subjects::TopicRecordName, key, e),
    ]
}

/// The outputs of a TxReceiptUpdated: on `tx.receipts` for the confirmation manager, and a copy
/// (same `event_id`) on `tx.outcomes`.
pub fn receipt(topics: &Topics, key: String, e: TxReceiptUpdated) -> Vec<Output> {
    vec![
        Output::new(
            topics.tx_receipts(),
            Subjects::TopicName,
            key.clone(),
            e.clone(),
        ),
        Output::new(topics.tx_outcomes(), Subjects::TopicRecordName, key, e),
    ]
}

/// The outputs of a TxConfirmationReverted: the `new_fork = true` announcement of the empty list
/// on `tx.confirmations`, then the reversal on `tx.outcomes` (both with its `event_id`).
pub fn reversal(topics: &Topics, key: String, e: TxConfirmationReverted) -> Vec<Output> {
    vec![
        Output::new(
            topics.tx_confirmations(),
            Subjects::TopicName,
            key.clone(),
            e.new_fork(),
        ),
        Output::new(topics.tx_outcomes(), Subjects::TopicRecordName, key, e),
    ]
}

/// The outputs that announce `row` again, keyed by its signer, with its own `event_id`: one, or
/// two for the events that also go on `tx.outcomes` ([`submitted`], [`receipt`]).
pub fn outputs(
    topics: &Topics,
    key: &LeaseKey,
    row: &Unpublished,
) -> Result<Vec<Output>, RelayError> {
    fn decode<E: Event>(row: &Unpublished) -> Result<E, RelayError> {
        let event: E =
            serde_json::from_value(row.payload.clone()).map_err(|source| RelayError::Payload {
                event_id: row.event_id,
                event_type: row.event_type.clone(),
                source,
            })?;
        if event.event_id() != row.event_id.to_string() {
            return Err(RelayError::EventId {
                event_id: row.event_id,
                payload_id: event.event_id().to_string(),
            });
        }
        Ok(event)
    }
    let k = signer_key(key.chain_id.0, key.signer.as_str());
    match row.event_type.as_str() {
        "TxAllocated" => {
            let e: TxAllocated = decode(row)?;
            Ok(vec![Output::new(
                topics.tx_allocated(),
                Subjects::TopicName,
                k,
                e,
            )])
        }
        "TxSigned" => {
            let e: TxSigned = decode(row)?;
            Ok(vec![Output::new(
                topics.tx_signed(),
                Subjects::TopicName,
                k,
                e,
            )])
        }
        "TxSubmitted" => Ok(submitted(topics, k, decode(row)?)),
        "TxFailed" => {
            let e: TxFailed = decode(row)?;
            Ok(vec![Output::new(
                topics.tx_outcomes(),
                Subjects::TopicRecordName,
                k,
                e,
            )])
        }
        // The audit rows of MINE and REVERT hold the TxReceiptUpdated they announce.
        "TxMined" | "TxReverted" => Ok(receipt(topics, k, decode(row)?)),
        // The confirmation manager's list announcements; TxReorged (MINED → SUBMITTED) holds the
        // `new_fork = true` announcement of its empty list.
        "TxConfirmationsUpdated" | "TxReorged" => {
            let e: TxConfirmationsUpdated = decode(row)?;
            Ok(vec![Output::new(
                topics.tx_confirmations(),
                Subjects::TopicName,
                k,
                e,
            )])
        }
        "TxConfirmed" => {
            let e: TxConfirmed = decode(row)?;
            Ok(vec![Output::new(
                topics.tx_outcomes(),
                Subjects::TopicRecordName,
                k,
                e,
            )])
        }
        "TxConfirmationReverted" => Ok(reversal(topics, k, decode(row)?)),
        other => Err(RelayError::NotAnnounced {
            event_id: row.event_id,
            event_type: other.to_string(),
        }),
    }
}

/// The signers with rows of `types` unpublished for longer than [`GRACE`].
pub async fn signers_with_unpublished(
    pool: &PgPool,
    types: &[&str],
) -> Result<Vec<(ChainId, Signer)>, sqlx::Error> {
    if types.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT DISTINCT chain_id, signer FROM tx_outbox
         WHERE type = ANY($1) AND created_at < now() - make_interval(secs => $2)",
    )
    .bind(types)
    .bind(GRACE.as_secs_f64())
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(c, s)| Signer::parse(&s).ok().map(|s| (ChainId(c), s)))
        .collect())
}

/// The signer's rows of `types` unpublished for longer than [`GRACE`], oldest first, at most
/// [`RELAY_LIMIT`].
pub async fn unpublished(
    pool: &PgPool,
    key: &LeaseKey,
    types: &[&str],
) -> Result<Vec<Unpublished>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.event_id, e.tx_id, e.type, e.payload
         FROM tx_outbox o JOIN tx_events e USING (event_id)
         WHERE o.chain_id = $3 AND o.signer = $4 AND o.type = ANY($1)
           AND o.created_at < now() - make_interval(secs => $2)
         ORDER BY o.created_at, o.event_id
         LIMIT $5",
    )
    .bind(types)
    .bind(GRACE.as_secs_f64())
    .bind(key.chain_id.0)
    .bind(key.signer.as_str())
    .bind(RELAY_LIMIT)
    .fetch_all(pool)
    .await
}

/// Marks these events published (the broker acknowledged them): their `tx_outbox` rows go. Ids
/// without one (a stage's own outputs, a test stage's, an event relayed twice) change nothing.
/// Unfenced on purpose: the mark records a fact about the broker, true whoever produced the event.
pub async fn mark_published(pool: &PgPool, event_ids: &[Uuid]) -> Result<u64, sqlx::Error> {
    if event_ids.is_empty() {
        return Ok(0);
    }
    // The transfer coordinator's outbox too (migration 0019), in the same statement: its events'
    // ids are in neither table's way (UUIDs), and the second delete of a small table by its
    // primary key costs next to nothing.
    let (done,): (i64,) = sqlx::query_as(
        "WITH tx AS (DELETE FROM tx_outbox WHERE event_id = ANY($1) RETURNING 1), \
              transfer AS (DELETE FROM transfer_outbox WHERE event_id = ANY($1) RETURNING 1) \
         SELECT (SELECT count(*) FROM tx) + (SELECT count(*) FROM transfer)",
    )
    .bind(event_ids)
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(done).unwrap_or(0))
}

/// [`mark_published`], a failure reported and dropped: the relay produces those events again.
async fn mark_or_report(pool: &PgPool, ids: &[Uuid]) {
    if let Err(e) = mark_published(pool, ids).await {
        tracing::warn!(error = %e, events = ids.len(), "could not mark events published; the recovery scan produces them again");
    }
}

/// The most event ids one [`flush_marks`] statement deletes.
const MARKS_PER_STATEMENT: usize = 4096;

/// The acknowledged events of a stage runtime's outputs, on their way to [`mark_published`].
///
/// Each produce (a batch's or a drive's outputs) used to mark its events with a statement of its
/// own, one in fifteen of the pipeline's statements. Now a produce hands its acknowledged ids to
/// this queue and one task ([`MarkQueue::flush`], run by the stage runtime) deletes whatever has
/// queued meanwhile in one statement: under load many drives' marks go together, idle a mark
/// goes at once. Nothing is lost by the delay: an event whose mark has not been written yet is
/// one the broker has, and at worst (a crash first) the relay produces it once more after
/// [`GRACE`], as it did for a mark that failed.
#[derive(Debug)]
pub struct MarkQueue {
    tx: tokio::sync::mpsc::UnboundedSender<Vec<Uuid>>,
    rx: std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Vec<Uuid>>>>,
}

impl Default for MarkQueue {
    fn default() -> Self {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        MarkQueue {
            tx,
            rx: std::sync::Mutex::new(Some(rx)),
        }
    }
}

impl MarkQueue {
    /// Queues `ids` for the flushing task; marks them here and now when no task flushes (the
    /// runtime is not running, so nothing would). A task that stops between the check and the
    /// send leaves those ids queued until the runtime runs again: their events are then relayed
    /// once more after [`GRACE`] (a duplicate, never a loss).
    pub async fn mark(&self, pool: &PgPool, ids: Vec<Uuid>) {
        if ids.is_empty() {
            return;
        }
        let flushing = self.rx.lock().map(|rx| rx.is_none()).unwrap_or(false);
        let ids = if flushing {
            match self.tx.send(ids) {
                Ok(()) => return,
                Err(e) => e.0,
            }
        } else {
            ids
        };
        mark_or_report(pool, &ids).await;
    }

    /// Runs the flushing task until `stop` fires, then writes what is still queued and returns.
    pub async fn flush(&self, pool: PgPool, stop: tokio_util::sync::CancellationToken) {
        let Some(rx) = self.rx.lock().ok().and_then(|mut rx| rx.take()) else {
            return;
        };
        let rx = flush_marks(pool, rx, stop).await;
        if let Ok(mut slot) = self.rx.lock() {
            *slot = Some(rx);
        }
    }
}

/// Deletes the `tx_outbox` rows of the ids queued on `rx`, all that queued while the previous
/// statement ran in one statement (at most [`MARKS_PER_STATEMENT`]), until `stop` fires and the
/// queue is empty. A failed mark is reported and dropped: the relay produces those events again.
async fn flush_marks(
    pool: PgPool,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Vec<Uuid>>,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::sync::mpsc::UnboundedReceiver<Vec<Uuid>> {
    loop {
        let mut ids = tokio::select! {
            biased;
            ids = rx.recv() => match ids {
                Some(ids) => ids,
                None => break,
            },
            () = stop.cancelled() => break,
        };
        while ids.len() < MARKS_PER_STATEMENT {
            match rx.try_recv() {
                Ok(more) => ids.extend(more),
                Err(_) => break,
            }
        }
        mark_or_report(&pool, &ids).await;
    }
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Role, Signer};
    use crate::events::TxSubmitted;

    fn topics_of(out: &[Output]) -> Vec<String> {
        out.iter().map(|o| o.topic.clone()).collect()
    }

    fn key() -> LeaseKey {
        LeaseKey {
            role: Role::Broadcaster,
            chain_id: ChainId(31337),
            signer: Signer::parse("0x00000000000000000000000000000000000000aa").expect("signer"),
        }
    }

    #[test]
    fn every_announced_type_is_relayed_by_a_pipeline_role_and_only_those() {
        // A role relays what it records itself, so the relay runs wherever the rows are written,
        // and every such role is one the binary runs.
        for t in ANNOUNCED {
            assert!(
                Role::PIPELINE.iter().any(|r| relayed_by(*r).contains(t)),
                "{t} is relayed by some role"
            );
        }
        assert_eq!(relayed_by(Role::ReceiptChecker), &["TxMined", "TxReverted"]);
        for r in Role::ALL {
            for t in relayed_by(r) {
                assert!(ANNOUNCED.contains(t), "{r} relays {t}, an announced type");
            }
        }
    }

    #[test]
    fn a_row_becomes_its_event_on_its_topic_with_its_own_id() {
        let id = Uuid::now_v7();
        let event = TxSubmitted {
            event_id: id.to_string(),
            tx_id: Uuid::now_v7().to_string(),
            chain_id: 31337,
            signer: "0x00000000000000000000000000000000000000aa".into(),
            nonce: 7,
            attempt: 1,
            tx_hash: format!("0x{}", "ab".repeat(32)),
            outcome: crate::events::SubmitOutcome::Accepted,
            submitted_at_ms: 1,
            fencing_token: 3,
        };
        let row = Unpublished {
            event_id: id,
            tx_id: Uuid::now_v7(),
            event_type: "TxSubmitted".into(),
            payload: serde_json::to_value(&event).expect("json"),
        };
        let topics = Topics::new("t");
        let out = outputs(&topics, &key(), &row).expect("relayed");
        assert_eq!(
            topics_of(&out),
            [topics.tx_submitted(), topics.tx_outcomes()],
            "for the receipt checker, and a copy for downstream"
        );
        for o in &out {
            assert_eq!(o.event_id, id.to_string());
            assert_eq!(o.key, "31337:0x00000000000000000000000000000000000000aa");
        }

        let other = Unpublished {
            event_id: Uuid::now_v7(),
            ..row.clone()
        };
        assert!(matches!(
            outputs(&topics, &key(), &other),
            Err(RelayError::EventId { .. })
        ));
        let audit = Unpublished {
            event_type: "TxSimulated".into(),
            ..row.clone()
        };
        assert!(matches!(
            outputs(&topics, &key(), &audit),
            Err(RelayError::NotAnnounced { .. })
        ));
        let garbage = Unpublished {
            payload: serde_json::json!({"nope": 1}),
            ..row
        };
        assert!(matches!(
            outputs(&topics, &key(), &garbage),
            Err(RelayError::Payload { .. })
        ));
    }

    #[test]
    fn confirmation_rows_become_their_announcements_on_their_topics() {
        let topics = Topics::new("t");
        let id = Uuid::now_v7();
        let list = TxConfirmationsUpdated {
            event_id: id.to_string(),
            tx_id: Uuid::now_v7().to_string(),
            chain_id: 31337,
            signer: "0x00000000000000000000000000000000000000aa".into(),
            nonce: 7,
            tx_hash: format!("0x{}", "ab".repeat(32)),
            new_fork: true,
            confirmations: Vec::new(),
            required_confirmations: 12,
            fencing_token: 3,
        };
        for event_type in ["TxConfirmationsUpdated", "TxReorged"] {
            let row = Unpublished {
                event_id: id,
                tx_id: Uuid::now_v7(),
                event_type: event_type.into(),
                payload: serde_json::to_value(&list).expect("json"),
            };
            let out = outputs(&topics, &key(), &row).expect("relayed");
            assert_eq!(topics_of(&out), [topics.tx_confirmations()], "{event_type}");
            assert_eq!(out[0].event_id, id.to_string());
        }
        let confirmed = TxConfirmed {
            event_id: id.to_string(),
            tx_id: Uuid::now_v7().to_string(),
            request_id: "r".into(),
            chain_id: 31337,
            signer: "0x00000000000000000000000000000000000000aa".into(),
            nonce: 7,
            tx_hash: format!("0x{}", "ab".repeat(32)),
            block_number: 9,
            block_hash: format!("0x{}", "cd".repeat(32)),
            success: true,
            confirmations: 12,
            fencing_token: 3,
            reorg_generation: 1,
            revert_reason: None,
        };
        let row = Unpublished {
            event_id: id,
            tx_id: Uuid::now_v7(),
            event_type: "TxConfirmed".into(),
            payload: serde_json::to_value(&confirmed).expect("json"),
        };
        let out = outputs(&topics, &key(), &row).expect("relayed");
        assert_eq!(topics_of(&out), [topics.tx_outcomes()]);
        assert_eq!(out[0].event_id, id.to_string());

        // A reversal: the new fork on tx.confirmations first, then the reversal on tx.outcomes,
        // both with its event_id.
        let reversal = TxConfirmationReverted {
            event_id: id.to_string(),
            tx_id: confirmed.tx_id.clone(),
            request_id: "r".into(),
            chain_id: 31337,
            signer: confirmed.signer.clone(),
            nonce: 7,
            tx_hash: confirmed.tx_hash.clone(),
            block_number: 9,
            block_hash: confirmed.block_hash.clone(),
            success: true,
            reorg_generation: 1,
            reverted_event_id: Uuid::now_v7().to_string(),
            required_confirmations: 12,
            fencing_token: 3,
        };
        let row = Unpublished {
            event_id: id,
            tx_id: Uuid::now_v7(),
            event_type: "TxConfirmationReverted".into(),
            payload: serde_json::to_value(&reversal).expect("json"),
        };
        let out = outputs(&topics, &key(), &row).expect("relayed");
        assert_eq!(
            topics_of(&out),
            [topics.tx_confirmations(), topics.tx_outcomes()]
        );
        assert!(out.iter().all(|o| o.event_id == id.to_string()));
        let fork = reversal.new_fork();
        assert!(fork.new_fork && fork.confirmations.is_empty(), "{fork:?}");
        assert_eq!(
            (
                fork.event_id,
                fork.tx_id,
                fork.nonce,
                fork.required_confirmations
            ),
            (reversal.event_id.clone(), reversal.tx_id.clone(), 7, 12)
        );
    }

    #[test]
    fn mined_and_reverted_rows_become_their_receipt_update_on_the_receipts_and_outcomes_topics() {
        let topics = Topics::new("t");
        for (event_type, status) in [
            ("TxMined", crate::events::ReceiptStatus::Mined),
            ("TxReverted", crate::events::ReceiptStatus::Reverted),
        ] {
            let id = Uuid::now_v7();
            let event = TxReceiptUpdated {
                event_id: id.to_string(),
                tx_id: Uuid::now_v7().to_string(),
                chain_id: 31337,
                signer: "0x00000000000000000000000000000000000000aa".into(),
                nonce: 7,
                status,
                tx_hash: Some(format!("0x{}", "ab".repeat(32))),
                block_number: Some(12),
                block_hash: Some(format!("0x{}", "cd".repeat(32))),
                gas_used: Some(21_000),
                effective_gas_price: Some("1000000007".into()),
                fencing_token: 3,
            };
            let row = Unpublished {
                event_id: id,
                tx_id: Uuid::now_v7(),
                event_type: event_type.into(),
                payload: serde_json::to_value(&event).expect("json"),
            };
            let out = outputs(&topics, &key(), &row).expect("relayed");
            assert_eq!(
                topics_of(&out),
                [topics.tx_receipts(), topics.tx_outcomes()],
                "{event_type}"
            );
            for o in &out {
                assert_eq!(o.event_id, id.to_string());
                assert_eq!(o.key, "31337:0x00000000000000000000000000000000000000aa");
            }
            // A receipt row that holds something else stays unpublished, reported.
            let submitted = Unpublished {
                payload: serde_json::json!({"event_id": id.to_string(), "tx_id": "x"}),
                ..row
            };
            assert!(
                matches!(
                    outputs(&topics, &key(), &submitted),
                    Err(RelayError::Payload { .. })
                ),
                "{event_type}"
            );
        }
    }
}
