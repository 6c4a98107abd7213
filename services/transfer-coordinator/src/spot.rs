//! The SPOT adapter (seed 004 §5.3, §9.3): the coordinator's side of the spot ledger's
//! command/reply contract. A call produces one `SpotCommand` on `{prefix}.spot.commands` (Avro
//! through the schema registry, keyed by the user) and waits for the `SpotReply` with the same
//! `(req_id, op)` on `{prefix}.spot.events`, at most [`SpotAdapterConfig::timeout`].
//!
//! - One reply reader per adapter: a consumer outside any group, assigned to every partition of
//!   the replies topic at its high watermark when the adapter starts (so no rebalance, and no
//!   reply to a command of this adapter is missed). It routes each reply to the calls waiting on
//!   its `(req_id, op)` and drops their registration, so a later reply to the same key (a
//!   repeat's ALREADY_APPLIED, a redelivered reply: each has its own `event_id`) finds nobody and
//!   is ignored, as is a reply for a key nobody waits on.
//! - Idempotency is the ledger's, by `(req_id, op)`: a repeated call produces the same command
//!   again and gets the ledger's recorded decision for the first one. So the coordinator's retry
//!   after a TIMEOUT is the same call, and calls with one key made at once all get that answer.
//! - Inputs are re-validated before anything is produced (defence in depth: the domain's
//!   `check_id`, `parse_amount`, and for a transfer — not a compensation — the asset's status
//!   (`check_asset`) and `check_amount`); a refusal there produces nothing and is an explicit
//!   failure.
//!
//! Outside movements ([`SpotAdapter::external`]): a CREDIT or DEBIT with `external` set, money
//! entering or leaving the trading core from outside the two ledgers (not a transfer leg); the
//! ledger keeps their net per (user, asset), which [`SpotAdapter::read_balance`] returns with the
//! balance, for the transfer conservation check (seed 004 §7.2).
//!
//! What a call answers ([`AdapterResponse`]): APPLIED and ALREADY_APPLIED → SUCCESS; REJECTED
//! with a code of §1.5 → EXPLICIT_FAIL(code); no reply in time → TIMEOUT (never a failure: the
//! command may be in the log and be applied later); the produce failed, or the registry did not
//! answer → NETWORK_ERROR; anything else (a reply without a known code, a reply for another user)
//! → UNKNOWN. Only EXPLICIT_FAIL proves the operation did not apply.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};
use rust_decimal::Decimal;
use tokio::sync::oneshot;
use tokio::time::Instant;
use txflow_core::codec::{CodecError, RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::events::{SpotCommand, SpotOp, SpotOutcome, SpotReply};
use txflow_core::kafka::KafkaSettings;
use txflow_core::retry::{Classify, Retry};
use txflow_core::transfer::{
    AdapterResponse, AssetTable, Rejected, TransferCode, check_amount, check_asset,
    check_asset_code, check_id, parse_amount,
};

/// The default [`SpotAdapterConfig::timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the adapter waits for the broker's metadata and watermarks when it starts.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The adapter's settings: the shared [`Config`]'s broker, registry, topics and
/// `spot.timeout_ms` (`TXFLOW_SPOT_TIMEOUT_MS`, default [`DEFAULT_TIMEOUT`]).
#[derive(Debug, Clone)]
pub struct SpotAdapterConfig {
    pub kafka: KafkaSettings,
    pub registry_url: String,
    pub commands_topic: String,
    pub events_topic: String,
    /// How long a call waits for its reply (the produce included) before it answers TIMEOUT.
    pub timeout: Duration,
}

impl SpotAdapterConfig {
    /// From the shared configuration (which checked the timeout when it was loaded).
    pub fn from_config(config: &Config) -> SpotAdapterConfig {
        let timeout = Duration::from_millis(config.spot_timeout_ms);
        SpotAdapterConfig {
            kafka: config.kafka.clone(),
            registry_url: config.schema_registry_url.clone(),
            commands_topic: config.topics.spot_commands(),
            events_topic: config.topics.spot_events(),
            timeout,
        }
    }
}

/// Why the adapter could not start (a call itself never fails: it answers a response).
#[derive(Debug, thiserror::Error)]
pub enum SpotAdapterError {
    #[error("spot adapter: creating a Kafka client")]
    Kafka(#[source] KafkaError),
    #[error("spot adapter: reading the partitions of {topic}")]
    Metadata {
        topic: String,
        #[source]
        source: KafkaError,
    },
    #[error("spot adapter: the replies topic {topic} does not exist or has no partition")]
    NoTopic { topic: String },
    #[error("spot adapter: the start-up task failed")]
    Join(#[source] tokio::task::JoinError),
}

impl Classify for SpotAdapterError {
    fn retry(&self) -> Retry {
        match self {
            SpotAdapterError::Metadata { .. } | SpotAdapterError::NoTopic { .. } => {
                Retry::Transient
            }
            SpotAdapterError::Kafka(_) | SpotAdapterError::Join(_) => Retry::Permanent,
        }
    }
}

/// One call's parameters, as strings: the adapter trusts nothing its caller checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpotCall<'a> {
    pub req_id: &'a str,
    pub user_id: &'a str,
    pub asset: &'a str,
    pub amount: &'a str,
}

/// A call's response and, when one came, the ledger's reply (its balance after the operation).
#[derive(Debug, Clone, PartialEq)]
pub struct SpotAnswer {
    pub response: AdapterResponse,
    pub reply: Option<SpotReply>,
}

impl SpotAnswer {
    fn without_reply(response: AdapterResponse) -> SpotAnswer {
        SpotAnswer {
            response,
            reply: None,
        }
    }
}

/// What the spot ledger holds for (user, asset): its balance and the net of its outside
/// movements (external CREDITs − external DEBITs; may be negative).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpotBalance {
    pub balance: Decimal,
    pub external_net: Decimal,
}

impl SpotBalance {
    /// Reads a BALANCE reply's two figures.
    pub fn from_reply(reply: &SpotReply) -> Result<SpotBalance, SpotReadError> {
        let field = |what: &'static str, value: &Option<String>| {
            value
                .as_deref()
                .and_then(|v| Decimal::from_str_exact(v).ok())
                .ok_or_else(|| SpotReadError::Unreadable {
                    what,
                    value: value.as_deref().map(|v| v.chars().take(64).collect()),
                })
        };
        Ok(SpotBalance {
            balance: field("balance", &reply.balance)?,
            external_net: field("external_net", &reply.external_net)?,
        })
    }
}

/// Why [`SpotAdapter::read_balance`] has no balance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpotReadError {
    /// The ledger (or the adapter's own checks) refused the read, e.g. `INVALID_ASSET`.
    #[error("spot ledger refused the balance read: {0}")]
    Refused(TransferCode),
    /// No answer (timeout, the broker or the registry unreachable, or an answer that does not fit
    /// the request).
    #[error("spot ledger did not answer the balance read ({0:?})")]
    NoAnswer(AdapterResponse),
    /// A reply without a readable figure (e.g. a ledger older than `external_net`).
    #[error("spot ledger's balance reply has no readable {what}: {value:?}")]
    Unreadable {
        what: &'static str,
        value: Option<String>,
    },
}

impl Classify for SpotReadError {
    fn retry(&self) -> Retry {
        match self {
            SpotReadError::NoAnswer(_) => Retry::Transient,
            SpotReadError::Refused(_) | SpotReadError::Unreadable { .. } => Retry::Permanent,
        }
    }
}

type Key = (String, SpotOp);
type Waiters = HashMap<Key, Vec<oneshot::Sender<SpotReply>>>;

struct Inner {
    config: SpotAdapterConfig,
    /// The asset rules the calls are re-validated against ([`SpotAdapter::set_assets`]).
    assets: std::sync::RwLock<AssetTable>,
    codec: RegistryCodec,
    producer: FutureProducer,
    waiters: Mutex<Waiters>,
}

impl Inner {
    fn waiters(&self) -> MutexGuard<'_, Waiters> {
        // A panic while holding the lock leaves a map that is still consistent.
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The SPOT adapter. Share one per process (`Arc` or `&`): calls run concurrently.
pub struct SpotAdapter {
    inner: Arc<Inner>,
    /// The reply reader; taken by [`SpotAdapter::close`].
    reader: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl SpotAdapter {
    /// Stops the reply reader and waits until its consumer is dropped. Call it before the
    /// process ends: a librdkafka consumer still being torn down on a runtime thread while the
    /// process exits can crash it (`txflow demo` ended with SIGSEGV about one run in four when the
    /// adapter was only dropped). Calls made afterwards get no reply (UNKNOWN); a second close
    /// does nothing.
    pub async fn close(&self) {
        let reader = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(reader) = reader {
            reader.abort();
            let _ = reader.await;
        }
    }
}

impl Drop for SpotAdapter {
    fn drop(&mut self) {
        let reader = self
            .reader
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(reader) = reader {
            reader.abort();
        }
    }
}

/// Drops a call's registration when the call ends without its reply (timeout, produce error,
/// cancellation): its closed sender is removed, the key too once nobody waits on it.
struct Registration<'a> {
    inner: &'a Inner,
    key: Key,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let mut waiters = self.inner.waiters();
        if let Some(list) = waiters.get_mut(&self.key) {
            list.retain(|tx| !tx.is_closed());
            if list.is_empty() {
                waiters.remove(&self.key);
            }
        }
    }
}

impl SpotAdapter {
    /// Creates the producer and the reply reader (assigned to the replies topic's partitions at
    /// their high watermarks). The topics must exist (`txflow up` creates them).
    pub async fn start(
        config: SpotAdapterConfig,
        assets: AssetTable,
    ) -> Result<SpotAdapter, SpotAdapterError> {
        let mut producer_config = config.kafka.producer_config();
        // An undelivered command fails within the call's time, not after the default 30 s.
        producer_config.set(
            "message.timeout.ms",
            config.timeout.as_millis().max(1).to_string(),
        );
        let producer: FutureProducer = producer_config.create().map_err(SpotAdapterError::Kafka)?;
        let topic = config.events_topic.clone();
        let kafka = config.kafka.clone();
        let assignment = tokio::task::spawn_blocking(move || reply_assignment(&kafka, &topic))
            .await
            .map_err(SpotAdapterError::Join)??;
        let consumer: StreamConsumer = config
            .kafka
            .assign_config()
            .create()
            .map_err(SpotAdapterError::Kafka)?;
        consumer
            .assign(&assignment)
            .map_err(SpotAdapterError::Kafka)?;
        let inner = Arc::new(Inner {
            codec: RegistryCodec::new(&config.registry_url),
            config,
            assets: std::sync::RwLock::new(assets),
            producer,
            waiters: Mutex::new(HashMap::new()),
        });
        let reader = tokio::spawn(read_replies(consumer, inner.clone()));
        Ok(SpotAdapter {
            inner,
            reader: std::sync::Mutex::new(Some(reader)),
        })
    }

    /// The asset rules in force (a copy).
    fn assets(&self) -> AssetTable {
        self.inner
            .assets
            .read()
            .map(|a| a.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }

    /// True when the rules in force list `asset`.
    pub fn knows(&self, asset: &str) -> bool {
        self.assets().rule(asset).is_ok()
    }

    /// Replaces the asset rules the calls are checked against (the coordinator re-reads the
    /// `assets` table periodically, so that an asset added or changed needs no restart).
    pub fn set_assets(&self, assets: AssetTable) {
        match self.inner.assets.write() {
            Ok(mut a) => *a = assets,
            Err(poisoned) => *poisoned.into_inner() = assets,
        }
    }

    /// The configured call timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.config.timeout
    }

    /// CREDIT: a transfer into spot, or (`compensation`) the refund of this transfer's own spot
    /// DEBIT, which the ledger applies even to a frozen account.
    pub async fn credit(&self, call: &SpotCall<'_>, compensation: bool) -> SpotAnswer {
        self.transfer(call, SpotOp::Credit, compensation, compensation)
            .await
    }

    /// DEBIT: a transfer out of spot.
    pub async fn debit(&self, call: &SpotCall<'_>) -> SpotAnswer {
        self.transfer(call, SpotOp::Debit, false, false).await
    }

    /// A CREDIT or DEBIT checked for its shape only (ids, amount, asset code), not against the
    /// asset's transfer rules: a source leg that may have been sent before (a retry after an
    /// unknown outcome, a leg resumed after a restart), or the target leg of a transfer under
    /// way. The ledger answers a key it decided with that decision, so the outcome is asked
    /// before any rule: asset rules changed since (a lowered `max_amount`, a delisted asset) must
    /// never turn a command the ledger applied into a local refusal — the saga would compensate
    /// money that moved, or fail a transfer whose source was taken.
    pub async fn shape_checked(
        &self,
        call: &SpotCall<'_>,
        op: SpotOp,
        compensation: bool,
    ) -> SpotAnswer {
        if !matches!(op, SpotOp::Credit | SpotOp::Debit) {
            return SpotAnswer::without_reply(AdapterResponse::ExplicitFail(
                TransferCode::InvalidRequest,
            ));
        }
        self.transfer(call, op, compensation, true).await
    }

    /// BALANCE: the ledger's balance of (user, asset) in the reply; `req_id` should be fresh (a
    /// read records nothing, but its reply is routed by its key).
    pub async fn balance(&self, req_id: &str, user_id: &str, asset: &str) -> SpotAnswer {
        if let Err(r) = check_id("request id", req_id)
            .and_then(|_| check_id("user id", user_id))
            .and_then(|_| check_asset_code(asset))
        {
            return SpotAnswer::without_reply(AdapterResponse::ExplicitFail(r.code));
        }
        self.request(command(req_id, SpotOp::Balance, user_id, asset, "", false))
            .await
    }

    /// BALANCE under a fresh request id, read: the balance of (user, asset) and the net of its
    /// outside movements. An asset the ledger does not list is `Refused(INVALID_ASSET)`; an
    /// account never credited holds zero.
    pub async fn read_balance(
        &self,
        user_id: &str,
        asset: &str,
    ) -> Result<SpotBalance, SpotReadError> {
        let req_id = format!("balance-{}", uuid::Uuid::new_v4().simple());
        let answer = self.balance(&req_id, user_id, asset).await;
        match (answer.response, &answer.reply) {
            (AdapterResponse::Success, Some(reply)) => SpotBalance::from_reply(reply),
            (AdapterResponse::ExplicitFail(code), _) => Err(SpotReadError::Refused(code)),
            (response, _) => Err(SpotReadError::NoAnswer(response)),
        }
    }

    /// An outside movement: `op` CREDIT (money deposited into the trading core from outside the
    /// two ledgers) or DEBIT (withdrawn from it to the outside), not a transfer leg; the ledger
    /// counts it in the account's `external_net`. `req_id` is the movement's own id (idempotency
    /// by `(req_id, op)`, like every call; use ids that no transfer uses). Checked before
    /// producing: the ids, the amount's shape, a listed asset and its places — not the asset's
    /// transfer limits or status, which govern transfers. Any other `op` is
    /// `EXPLICIT_FAIL(INVALID_REQUEST)`. The ledger refuses it like a transfer leg
    /// (`INSUFFICIENT_BALANCE`, `ACCOUNT_FROZEN`, …).
    pub async fn external(&self, call: &SpotCall<'_>, op: SpotOp) -> SpotAnswer {
        match validate_external(&self.assets(), call, op) {
            Ok(amount) => {
                let cmd = SpotCommand {
                    external: true,
                    ..command(call.req_id, op, call.user_id, call.asset, &amount, false)
                };
                self.request(cmd).await
            }
            Err(r) => {
                tracing::debug!(req_id = call.req_id, code = %r.code, "spot adapter: outside movement refused before producing");
                SpotAnswer::without_reply(AdapterResponse::ExplicitFail(r.code))
            }
        }
    }

    /// FREEZE / UNFREEZE (the admin path: a frozen account refuses transfers into it).
    pub async fn set_frozen(&self, req_id: &str, user_id: &str, frozen: bool) -> SpotAnswer {
        if let Err(r) = check_id("request id", req_id).and_then(|_| check_id("user id", user_id)) {
            return SpotAnswer::without_reply(AdapterResponse::ExplicitFail(r.code));
        }
        let op = if frozen {
            SpotOp::Freeze
        } else {
            SpotOp::Unfreeze
        };
        self.request(command(req_id, op, user_id, "", "", false))
            .await
    }

    /// A CREDIT or DEBIT re-validated (`shape_only`: without the asset's transfer rules), then
    /// produced and answered.
    async fn transfer(
        &self,
        call: &SpotCall<'_>,
        op: SpotOp,
        compensation: bool,
        shape_only: bool,
    ) -> SpotAnswer {
        match validate(&self.assets(), call, shape_only) {
            Ok(amount) => {
                self.request(command(
                    call.req_id,
                    op,
                    call.user_id,
                    call.asset,
                    &amount,
                    compensation,
                ))
                .await
            }
            Err(r) => {
                tracing::debug!(req_id = call.req_id, code = %r.code, "spot adapter: input refused before producing");
                SpotAnswer::without_reply(AdapterResponse::ExplicitFail(r.code))
            }
        }
    }

    /// Registers the waiter, produces the command, waits for the reply; all within the timeout.
    async fn request(&self, cmd: SpotCommand) -> SpotAnswer {
        let inner = &*self.inner;
        let deadline = Instant::now() + inner.config.timeout;
        let key = (cmd.req_id.clone(), cmd.op);
        let (tx, rx) = oneshot::channel();
        inner.waiters().entry(key.clone()).or_default().push(tx);
        let _registration = Registration { inner, key };

        let topic = &inner.config.commands_topic;
        let payload = match tokio::time::timeout_at(
            deadline,
            inner.codec.encode(topic, Subjects::TopicName, &cmd),
        )
        .await
        {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return SpotAnswer::without_reply(codec_response(&e)),
            Err(_) => return SpotAnswer::without_reply(AdapterResponse::Timeout),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let record = FutureRecord::to(topic)
            .key(cmd.user_id.as_bytes())
            .payload(&payload);
        match tokio::time::timeout_at(deadline, inner.producer.send(record, Timeout::After(left)))
            .await
        {
            Ok(Ok(_)) => {}
            Ok(Err((e, _))) => {
                tracing::warn!(req_id = %cmd.req_id, op = ?cmd.op, error = %e, "spot adapter: producing the command failed");
                return SpotAnswer::without_reply(AdapterResponse::NetworkError);
            }
            Err(_) => return SpotAnswer::without_reply(AdapterResponse::Timeout),
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(reply)) => SpotAnswer {
                response: reply_response(&cmd, &reply),
                reply: Some(reply),
            },
            // The reader is gone (the adapter is being dropped): nobody knows.
            Ok(Err(_)) => SpotAnswer::without_reply(AdapterResponse::Unknown),
            Err(_) => SpotAnswer::without_reply(AdapterResponse::Timeout),
        }
    }
}

/// The partitions of the replies topic at their high watermarks (blocking calls).
fn reply_assignment(
    kafka: &KafkaSettings,
    topic: &str,
) -> Result<TopicPartitionList, SpotAdapterError> {
    let meta_err = |source| SpotAdapterError::Metadata {
        topic: topic.to_string(),
        source,
    };
    let consumer: BaseConsumer = kafka
        .assign_config()
        .create()
        .map_err(SpotAdapterError::Kafka)?;
    let metadata = consumer
        .fetch_metadata(Some(topic), START_TIMEOUT)
        .map_err(meta_err)?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        return Err(SpotAdapterError::NoTopic {
            topic: topic.to_string(),
        });
    }
    let mut list = TopicPartitionList::new();
    for p in partitions {
        let (_, high) = consumer
            .fetch_watermarks(topic, p, START_TIMEOUT)
            .map_err(meta_err)?;
        list.add_partition_offset(topic, p, Offset::Offset(high))
            .map_err(meta_err)?;
    }
    Ok(list)
}

/// Routes every reply to the calls waiting on its key; a reply nobody waits on is dropped.
async fn read_replies(consumer: StreamConsumer, inner: Arc<Inner>) {
    loop {
        let message = match consumer.recv().await {
            Ok(m) => m.detach(),
            Err(e) => {
                tracing::warn!(error = %e, "spot adapter: reading the replies");
                // librdkafka retries by itself; do not spin on a down broker.
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let reply: SpotReply = match inner
            .codec
            .decode(message.payload().unwrap_or_default())
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, offset = message.offset(), partition = message.partition(), "spot adapter: a reply that does not decode, skipped");
                continue;
            }
        };
        let waiting = inner.waiters().remove(&(reply.req_id.clone(), reply.op));
        for tx in waiting.into_iter().flatten() {
            // A call that has just timed out has dropped its receiver: nothing to do.
            let _ = tx.send(reply.clone());
        }
    }
}

/// The re-validation of a CREDIT or DEBIT; the amount to send, normalised (so that every repeat
/// of a key carries the same string). `shape_only`: a compensation (the refund of an amount the
/// ledger took) or a command that may have been sent before — the asset's transfer limits and
/// status (which may have changed since) do not apply, the ledger decides (and checks the
/// places).
fn validate(
    assets: &AssetTable,
    call: &SpotCall<'_>,
    shape_only: bool,
) -> Result<String, Rejected> {
    check_id("request id", call.req_id)?;
    check_id("user id", call.user_id)?;
    let amount = parse_amount(call.amount)?;
    if shape_only {
        check_asset_code(call.asset)?;
    } else {
        // A command never sent: the asset's status and its limits, as the FUNDING adapter
        // checks them for its source.
        let rule = assets.rule(call.asset)?;
        check_asset(rule)?;
        check_amount(amount, rule)?;
    }
    Ok(amount.to_string())
}

/// The re-validation of an outside movement; the amount to send, normalised.
fn validate_external(
    assets: &AssetTable,
    call: &SpotCall<'_>,
    op: SpotOp,
) -> Result<String, Rejected> {
    if !matches!(op, SpotOp::Credit | SpotOp::Debit) {
        return Err(Rejected::new(
            TransferCode::InvalidRequest,
            "an outside movement is a CREDIT or a DEBIT",
        ));
    }
    check_id("request id", call.req_id)?;
    check_id("user id", call.user_id)?;
    let amount = parse_amount(call.amount)?;
    let rule = assets.rule(call.asset)?;
    if amount.places() > rule.places {
        return Err(Rejected::new(
            TransferCode::PrecisionOverflow,
            format!("{} allows {} decimal places", rule.asset, rule.places),
        ));
    }
    Ok(amount.to_string())
}

fn command(
    req_id: &str,
    op: SpotOp,
    user_id: &str,
    asset: &str,
    amount: &str,
    compensation: bool,
) -> SpotCommand {
    SpotCommand {
        event_id: uuid::Uuid::new_v4().to_string(),
        req_id: req_id.to_string(),
        user_id: user_id.to_string(),
        asset: asset.to_string(),
        amount: amount.to_string(),
        op,
        compensation,
        external: false,
    }
}

/// An encoding failure: an unreachable registry is a network error; anything else (a schema the
/// registry refuses) is unknown — nothing was produced, but it will not heal by itself.
fn codec_response(e: &CodecError) -> AdapterResponse {
    tracing::warn!(error = %e, "spot adapter: encoding the command failed");
    match e.retry() {
        Retry::Transient => AdapterResponse::NetworkError,
        Retry::Permanent => AdapterResponse::Unknown,
    }
}

/// The ledger's reply as a response of §2.3.
pub fn reply_response(cmd: &SpotCommand, reply: &SpotReply) -> AdapterResponse {
    if reply.req_id != cmd.req_id || reply.op != cmd.op || reply.user_id != cmd.user_id {
        return AdapterResponse::Unknown;
    }
    match reply.outcome {
        SpotOutcome::Applied | SpotOutcome::AlreadyApplied => AdapterResponse::Success,
        SpotOutcome::Rejected => match reply.code.as_deref().and_then(TransferCode::parse) {
            Some(code) => AdapterResponse::ExplicitFail(code),
            None => AdapterResponse::Unknown,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use txflow_core::transfer::{AssetRule, AssetStatus};

    fn assets() -> AssetTable {
        AssetTable::new([AssetRule {
            asset: "USDT".into(),
            places: 6,
            min_amount: Decimal::new(1, 6),
            max_amount: Decimal::new(1_000_000, 0),
            status: AssetStatus::Active,
            internal_transfer_enabled: true,
        }])
        .expect("a valid rule")
    }

    fn reply(outcome: SpotOutcome, code: Option<&str>) -> SpotReply {
        SpotReply {
            event_id: "e".into(),
            req_id: "r1".into(),
            op: SpotOp::Debit,
            user_id: "u1".into(),
            asset: "USDT".into(),
            outcome,
            code: code.map(str::to_string),
            balance: None,
            wal_seq: None,
            replied_at_ms: 0,
            external_net: None,
        }
    }

    #[test]
    fn replies_map_onto_adapter_responses() {
        let cmd = command("r1", SpotOp::Debit, "u1", "USDT", "1", false);
        use AdapterResponse as R;
        for (outcome, code, want) in [
            (SpotOutcome::Applied, None, R::Success),
            (SpotOutcome::AlreadyApplied, None, R::Success),
            (
                SpotOutcome::Rejected,
                Some("INSUFFICIENT_BALANCE"),
                R::ExplicitFail(TransferCode::InsufficientBalance),
            ),
            (
                SpotOutcome::Rejected,
                Some("ACCOUNT_FROZEN"),
                R::ExplicitFail(TransferCode::AccountFrozen),
            ),
            (
                SpotOutcome::Rejected,
                Some("PRECISION_OVERFLOW"),
                R::ExplicitFail(TransferCode::PrecisionOverflow),
            ),
            (SpotOutcome::Rejected, Some("SOMETHING_NEW"), R::Unknown),
            (SpotOutcome::Rejected, None, R::Unknown),
        ] {
            assert_eq!(
                reply_response(&cmd, &reply(outcome, code)),
                want,
                "{outcome:?} {code:?}"
            );
        }
        let mut other = reply(SpotOutcome::Applied, None);
        other.user_id = "u2".into();
        assert_eq!(reply_response(&cmd, &other), R::Unknown);
    }

    #[test]
    fn outside_movements_are_revalidated_without_the_transfer_limits() {
        let a = assets();
        let call = |amount, asset| SpotCall {
            req_id: "dep-1",
            user_id: "u1",
            asset,
            amount,
        };
        // Above the asset's transfer maximum: an outside movement is not a transfer.
        assert_eq!(
            validate_external(&a, &call("2000000.50", "USDT"), SpotOp::Credit),
            Ok("2000000.5".into())
        );
        for (amount, asset, op, code) in [
            ("-1", "USDT", SpotOp::Credit, TransferCode::InvalidAmount),
            ("0", "USDT", SpotOp::Debit, TransferCode::InvalidAmount),
            ("1e3", "USDT", SpotOp::Credit, TransferCode::InvalidAmount),
            (
                "0.0000000001",
                "USDT",
                SpotOp::Credit,
                TransferCode::PrecisionOverflow,
            ),
            ("1", "DOGE", SpotOp::Credit, TransferCode::InvalidAsset),
            ("1", "USDT", SpotOp::Balance, TransferCode::InvalidRequest),
            ("1", "USDT", SpotOp::Freeze, TransferCode::InvalidRequest),
        ] {
            let got = validate_external(&a, &call(amount, asset), op).map_err(|r| r.code);
            assert_eq!(got, Err(code), "{amount} {asset} {op:?}");
        }
    }

    #[test]
    fn a_balance_reply_is_read_exactly_and_needs_both_figures() {
        let mut r = reply(SpotOutcome::Applied, None);
        r.op = SpotOp::Balance;
        r.balance = Some("12.5".into());
        r.external_net = Some("-3.000000000000000001".into());
        assert_eq!(
            SpotBalance::from_reply(&r),
            Ok(SpotBalance {
                balance: Decimal::new(125, 1),
                external_net: Decimal::from_str_exact("-3.000000000000000001").expect("decimal"),
            })
        );
        let mut old = r.clone();
        old.external_net = None;
        assert!(matches!(
            SpotBalance::from_reply(&old),
            Err(SpotReadError::Unreadable {
                what: "external_net",
                ..
            })
        ));
        let mut bad = r;
        bad.balance = Some("1e3".into());
        assert!(matches!(
            SpotBalance::from_reply(&bad),
            Err(SpotReadError::Unreadable {
                what: "balance",
                ..
            })
        ));
    }

    #[test]
    fn the_timeout_is_configured_and_checked() {
        let config = Config::default();
        let c = SpotAdapterConfig::from_config(&config);
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        assert_eq!(c.commands_topic, config.topics.spot_commands());
        assert_eq!(c.events_topic, config.topics.spot_events());
        let env = |k: &str| (k == "TXFLOW_SPOT_TIMEOUT_MS").then(|| "1500".to_string());
        let config = Config::load(None, env).expect("a timeout");
        let c = SpotAdapterConfig::from_config(&config);
        assert_eq!(c.timeout, Duration::from_millis(1500));
        for bad in ["0", "-1", "5s", ""] {
            let got = Config::load(None, |k: &str| {
                (k == "TXFLOW_SPOT_TIMEOUT_MS").then(|| bad.to_string())
            });
            assert!(got.is_err(), "{bad:?}");
        }
    }

    #[test]
    fn inputs_are_revalidated() {
        let a = assets();
        let call = |amount, asset| SpotCall {
            req_id: "r1",
            user_id: "u1",
            asset,
            amount,
        };
        assert_eq!(
            validate(&a, &call("1.500", "USDT"), false),
            Ok("1.5".into())
        );
        for (amount, asset, code) in [
            ("-1", "USDT", TransferCode::InvalidAmount),
            ("0", "USDT", TransferCode::InvalidAmount),
            ("1e3", "USDT", TransferCode::InvalidAmount),
            ("0.0000001", "USDT", TransferCode::PrecisionOverflow),
            ("2000000", "USDT", TransferCode::AmountTooLarge),
            ("1", "DOGE", TransferCode::InvalidAsset),
            ("1", "usdt", TransferCode::InvalidAsset),
        ] {
            let got = validate(&a, &call(amount, asset), false).map_err(|r| r.code);
            assert_eq!(got, Err(code), "{amount} {asset}");
        }
        // A compensation skips the asset's limits, never the amount's shape.
        assert_eq!(
            validate(&a, &call("2000000", "USDT"), true),
            Ok("2000000".into())
        );
        let bad_id = SpotCall {
            req_id: "has space",
            ..call("1", "USDT")
        };
        assert_eq!(
            validate(&a, &bad_id, false).map_err(|r| r.code),
            Err(TransferCode::InvalidRequest)
        );
        assert_eq!(
            validate(&a, &call("-1", "USDT"), true).map_err(|r| r.code),
            Err(TransferCode::InvalidAmount)
        );
    }
}
