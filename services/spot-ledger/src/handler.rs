//! The consume loop: one command at a time, in order — read, decide, append + fsync, reply
//! (waiting for the broker's acknowledgement), then store and commit the offset.
//!
//! A crash anywhere in between is safe: a command whose record reached the log before the crash
//! is consumed again after the restart and answered from the log (`ALREADY_APPLIED`, or the same
//! `REJECTED`); one whose record did not is decided afresh. A reply may be produced twice, an
//! operation is never applied twice.

use std::time::Duration;

use rdkafka::Message;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;
use txflow_core::codec::{CodecError, RegistryCodec, Subjects};
use txflow_core::events::{SpotCommand, SpotReply};
use txflow_core::retry::{Classify, Retry};

use crate::SpotError;
use crate::config::SpotConfig;
use crate::decide::{self, Decision, Ledger, Record};
use crate::store::Wal;

/// Fault points (`TXFLOW_FAULT`, test builds): after the record is on disk, before the reply;
/// after the reply was acknowledged, before the offset is committed.
pub const AFTER_WAL: &str = "spot.after_wal";
pub const AFTER_REPLY: &str = "spot.after_reply";

/// The wait between two attempts at a transient failure (broker, registry).
const BACKOFF: Duration = Duration::from_millis(200);

/// A consumed message's fate.
enum Done {
    /// Answered (or dead-lettered): its offset may be committed.
    Handled,
    /// Shutdown came first: leave the offset, the next process answers it.
    Stopped,
}

pub struct Handler {
    config: SpotConfig,
    codec: RegistryCodec,
    producer: FutureProducer,
    wal: Wal,
    ledger: Ledger,
}

impl Handler {
    pub fn new(config: SpotConfig, producer: FutureProducer, wal: Wal, ledger: Ledger) -> Handler {
        Handler {
            codec: RegistryCodec::new(&config.registry_url),
            config,
            producer,
            wal,
            ledger,
        }
    }

    /// Consumes until `shutdown`; returns an error only for what must stop the ledger (the log
    /// cannot be written).
    pub async fn run(
        &mut self,
        consumer: &StreamConsumer,
        shutdown: &CancellationToken,
    ) -> Result<(), SpotError> {
        loop {
            let m = tokio::select! {
                _ = shutdown.cancelled() => break,
                m = consumer.recv() => m,
            };
            let m = match m {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "spot-ledger: consuming");
                    tokio::time::sleep(BACKOFF).await;
                    continue;
                }
            };
            match self.handle(&m, shutdown).await? {
                Done::Stopped => break,
                Done::Handled => {
                    txflow_core::fault::point(AFTER_REPLY);
                    if let Err(e) = consumer.store_offset_from_message(&m) {
                        tracing::warn!(error = %e, "spot-ledger: storing an offset");
                    } else if let Err(e) = consumer.commit_consumer_state(CommitMode::Async) {
                        tracing::warn!(error = %e, "spot-ledger: committing offsets");
                    }
                }
            }
        }
        final_commit(consumer);
        Ok(())
    }

    async fn handle(
        &mut self,
        m: &BorrowedMessage<'_>,
        shutdown: &CancellationToken,
    ) -> Result<Done, SpotError> {
        let Some(payload) = m.payload() else {
            return Ok(self.dead_letter(m, "EMPTY", "no payload", shutdown).await);
        };
        let cmd = loop {
            match self.codec.decode::<SpotCommand>(payload).await {
                Ok(cmd) => break cmd,
                Err(e) if e.retry() == Retry::Transient => {
                    tracing::warn!(error = %e, "spot-ledger: decoding a command; retrying");
                    if pause(shutdown).await {
                        return Ok(Done::Stopped);
                    }
                }
                Err(e) => {
                    let reason = chain(&e);
                    return Ok(self.dead_letter(m, "UNDECODABLE", &reason, shutdown).await);
                }
            }
        };
        if let Err(e) = decide::check_shape(&cmd, m.key()) {
            return Ok(self
                .dead_letter(m, e.code(), &e.to_string(), shutdown)
                .await);
        }
        let reply = match decide::decide(&self.ledger, &self.config.assets, &cmd) {
            Decision::Record(record) => {
                // On disk before anything else sees it: a failure here stops the ledger.
                self.wal.append(&record)?;
                self.ledger.apply(record.clone())?;
                txflow_core::fault::point(AFTER_WAL);
                tracing::debug!(seq = record.seq, req_id = %record.req_id, op = ?record.op, code = ?record.code, "spot-ledger: recorded");
                reply_of(&cmd, &record, true)
            }
            Decision::Repeat(record) => reply_of(&cmd, &record, false),
            Decision::Conflict(record) => SpotReply {
                code: Some(decide::code::DUPLICATE_REQUEST.into()),
                balance: None,
                wal_seq: Some(record.seq as i64),
                ..base(&cmd, txflow_core::events::SpotOutcome::Rejected)
            },
            Decision::Query(result) => match result {
                Ok(holding) => SpotReply {
                    balance: Some(holding.balance.to_string()),
                    external_net: Some(holding.external_net.to_string()),
                    ..base(&cmd, txflow_core::events::SpotOutcome::Applied)
                },
                Err(code) => SpotReply {
                    code: Some(code.into()),
                    ..base(&cmd, txflow_core::events::SpotOutcome::Rejected)
                },
            },
        };
        Ok(self.reply(m, &reply, shutdown).await)
    }

    /// Produces `reply` (keyed by the user), until the broker acknowledges it.
    async fn reply(
        &self,
        m: &BorrowedMessage<'_>,
        reply: &SpotReply,
        shutdown: &CancellationToken,
    ) -> Done {
        let topic = &self.config.events_topic;
        let parent = header(m, "traceparent");
        let traceparent = txflow_core::stage::child_traceparent(parent.as_deref());
        loop {
            let payload = match self.codec.encode(topic, Subjects::TopicName, reply).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = %chain(&e), "spot-ledger: encoding a reply; retrying");
                    if pause(shutdown).await {
                        return Done::Stopped;
                    }
                    continue;
                }
            };
            let headers = OwnedHeaders::new().insert(Header {
                key: "traceparent",
                value: Some(traceparent.as_bytes()),
            });
            let record = FutureRecord::to(topic)
                .key(reply.user_id.as_bytes())
                .payload(&payload)
                .headers(headers);
            match self.producer.send(record, Duration::from_secs(30)).await {
                Ok(_) => return Done::Handled,
                Err((e, _)) => {
                    tracing::warn!(error = %e, "spot-ledger: producing a reply; retrying");
                    if pause(shutdown).await {
                        return Done::Stopped;
                    }
                }
            }
        }
    }

    /// Sends `m` to the dead-letter topic with the reason in its headers (as the stage runtime
    /// does), until the broker acknowledges it.
    async fn dead_letter(
        &self,
        m: &BorrowedMessage<'_>,
        code: &str,
        reason: &str,
        shutdown: &CancellationToken,
    ) -> Done {
        tracing::warn!(
            code,
            reason,
            topic = m.topic(),
            partition = m.partition(),
            offset = m.offset(),
            "spot-ledger: dead-lettering a command"
        );
        loop {
            let record =
                txflow_core::stage::dead_letter_record(&self.config.dlq_topic, m, code, reason);
            match self.producer.send(record, Duration::from_secs(30)).await {
                Ok(_) => return Done::Handled,
                Err((e, _)) => {
                    tracing::warn!(error = %e, "spot-ledger: dead-lettering; retrying");
                    if pause(shutdown).await {
                        return Done::Stopped;
                    }
                }
            }
        }
    }
}

/// A stopping ledger commits the offsets it stored, so that its successor does not consume the
/// answered commands again (it would answer them from the log anyway).
fn final_commit(consumer: &StreamConsumer) {
    if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
        tracing::info!(error = %e, "spot-ledger: committing offsets at shutdown");
    }
}

/// Waits [`BACKOFF`]; true if shutdown came first.
async fn pause(shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(BACKOFF) => false,
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn base(cmd: &SpotCommand, outcome: txflow_core::events::SpotOutcome) -> SpotReply {
    SpotReply {
        event_id: uuid::Uuid::now_v7().to_string(),
        req_id: cmd.req_id.clone(),
        op: cmd.op,
        user_id: cmd.user_id.clone(),
        asset: cmd.asset.clone(),
        outcome,
        code: None,
        balance: None,
        wal_seq: None,
        replied_at_ms: now_ms(),
        external_net: None,
    }
}

/// The answer for a recorded operation: `fresh` when it was just recorded.
fn reply_of(cmd: &SpotCommand, record: &Record, fresh: bool) -> SpotReply {
    SpotReply {
        code: record.code.clone(),
        balance: record.balance.map(|b| b.normalize().to_string()),
        wal_seq: Some(record.seq as i64),
        ..base(cmd, decide::outcome(record, fresh))
    }
}

fn header(m: &BorrowedMessage<'_>, name: &str) -> Option<String> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// An error and its sources, one line.
fn chain(e: &CodecError) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}
