//! `txflow replay`: a consumer group's committed offsets reset, with the semantics of
//! `kafka-consumer-groups --reset-offsets` (`--to-earliest`, `--to-latest`, `--to-offset`,
//! `--shift-by`, `--to-datetime`; new offsets clamped to the partition's watermarks; refused while
//! the group has live members; `--dry-run`, the default, only prints the plan).
//!
//! Replaying is safe because every stage is idempotent: a message read again changes nothing in
//! PostgreSQL and re-announces its events with the same `event_id`s (the conformance suite's first
//! check). What is not safe is a wrong plan: offsets committed past messages that were never
//! processed lose them. So no answer of the broker is used unchecked. The broker here (tansu)
//! answers some of these questions wrongly (docs/operations.md, "The local broker": its high watermark is
//! the last batch's base offset + 1, its timestamp lookup always the first offset), so every
//! watermark and time lookup a plan depends on is checked against the partition's messages
//! (read back by a consumer outside any group), and one the messages contradict, or that cannot be
//! checked in time, is a typed error naming the partition instead of a plan.
//!
//! The offsets are committed by a consumer that carries the group's id and never subscribes (a
//! standalone commit: it never joins the group, so it cannot leave the ghost member tansu keeps
//! for a member that leaves a forming group).

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use chrono::DateTime;
use clap::{ArgGroup, Args};
use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;
use txflow_core::config::Config;
use txflow_core::kafka::KafkaSettings;
use txflow_core::retry::{Classify, Retry};
use txflow_core::role::Role;

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("target").required(true).args(["group", "role"])))]
#[command(group(
    ArgGroup::new("spec")
        .required(true)
        .args(["to_earliest", "to_latest", "to_offset", "shift_by", "to_datetime"])
))]
pub struct ReplayArgs {
    /// The consumer group whose offsets to reset (with --topic).
    #[arg(long, requires = "topic")]
    group: Option<String>,
    /// A role (allocator, signer-gateway, broadcaster, receipt-checker, confirmation-manager):
    /// each of its consumer groups (`{group prefix}.{stage}`) on its input topic.
    #[arg(long)]
    role: Option<String>,
    /// A topic to reset, by its full name or its name under the topic prefix (`tx.requests`);
    /// repeatable. With --role: only these of the role's input topics.
    #[arg(long)]
    topic: Vec<String>,
    /// To the first offset still on the broker (the low watermark).
    #[arg(long)]
    to_earliest: bool,
    /// To the end (the high watermark): everything before it is skipped.
    #[arg(long)]
    to_latest: bool,
    /// To this offset on every partition (clamped to the watermarks).
    #[arg(long, value_name = "OFFSET", allow_negative_numbers = true)]
    to_offset: Option<i64>,
    /// The committed offset moved by N (negative: back; clamped to the watermarks).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    shift_by: Option<i64>,
    /// To the first message at or after this time (RFC 3339, e.g. 2026-11-24T02:00:00Z).
    #[arg(long, value_name = "RFC3339")]
    to_datetime: Option<String>,
    /// Print the plan and change nothing (the default).
    #[arg(long, conflicts_with = "execute")]
    dry_run: bool,
    /// Commit the plan's offsets for the group.
    #[arg(long)]
    execute: bool,
    /// One JSON object per partition and line instead of the table.
    #[arg(long)]
    json: bool,
    /// How long to wait for each answer of the broker.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    timeout_ms: u64,
}

/// What a reset asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spec {
    Earliest,
    Latest,
    Offset(i64),
    ShiftBy(i64),
    /// Unix milliseconds.
    Datetime(i64),
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Spec::Earliest => write!(f, "--to-earliest"),
            Spec::Latest => write!(f, "--to-latest"),
            Spec::Offset(n) => write!(f, "--to-offset {n}"),
            Spec::ShiftBy(n) => write!(f, "--shift-by {n}"),
            Spec::Datetime(ms) => match DateTime::from_timestamp_millis(*ms) {
                Some(t) => write!(f, "--to-datetime {}", t.to_rfc3339()),
                None => write!(f, "--to-datetime {ms} ms"),
            },
        }
    }
}

/// One consumer group on one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub group: String,
    pub topic: String,
}

/// The consumer groups of `role`'s stages, each on its input topic, named as the stage crates
/// name them (`StageConfig::for_pipeline(config, stage, ..)` and the handler's `input_topic`).
/// A stage that adds a consumer group adds it here.
pub fn role_targets(role: Role, config: &Config) -> Result<Vec<Target>, ReplayError> {
    let t = &config.topics;
    let stages: Vec<(&str, String)> = match role {
        Role::Allocator => vec![
            ("allocator", t.tx_requests()),
            ("allocator.commands", t.tx_commands()),
        ],
        Role::SignerGateway => vec![("signer-gateway", t.tx_allocated())],
        Role::Broadcaster => vec![("broadcaster", t.tx_signed())],
        Role::ReceiptChecker => vec![("receipt-checker", t.tx_submitted())],
        Role::ConfirmationManager => vec![("confirmation-manager", t.tx_receipts())],
        Role::TransferCoordinator | Role::SpotLedger | Role::Gateway => {
            return Err(ReplayError::NoGroup { role });
        }
    };
    Ok(stages
        .into_iter()
        .map(|(stage, topic)| Target {
            group: format!("{}.{stage}", config.group_prefix()),
            topic,
        })
        .collect())
}

/// A topic as the operator wrote it: its full name, or its name under the topic prefix.
fn topic_matches(config: &Config, given: &str, topic: &str) -> bool {
    given == topic || format!("{}.{given}", config.topics.prefix) == topic
}

/// The groups and topics the arguments name.
fn targets(config: &Config, args: &ReplayArgs) -> Result<Vec<Target>, ReplayError> {
    if let Some(group) = &args.group {
        let topics = config.topics.all();
        return Ok(args
            .topic
            .iter()
            .map(|given| Target {
                group: group.clone(),
                // A name under the prefix is completed only when it is one of txflow's topics.
                topic: topics
                    .iter()
                    .find(|t| topic_matches(config, given, t))
                    .cloned()
                    .unwrap_or_else(|| given.clone()),
            })
            .collect());
    }
    let name = args.role.as_deref().unwrap_or_default();
    let role = Role::ALL
        .into_iter()
        .find(|r| r.as_str() == name)
        .ok_or_else(|| ReplayError::UnknownRole(name.to_string()))?;
    let all = role_targets(role, config)?;
    if args.topic.is_empty() {
        return Ok(all);
    }
    let mut chosen = Vec::new();
    for given in &args.topic {
        let found: Vec<Target> = all
            .iter()
            .filter(|t| topic_matches(config, given, &t.topic))
            .cloned()
            .collect();
        if found.is_empty() {
            return Err(ReplayError::NotAnInput {
                role,
                topic: given.clone(),
                inputs: all.iter().map(|t| t.topic.clone()).collect(),
            });
        }
        chosen.extend(found);
    }
    Ok(chosen)
}

fn spec(args: &ReplayArgs) -> Result<Spec, ReplayError> {
    if args.to_earliest {
        return Ok(Spec::Earliest);
    }
    if args.to_latest {
        return Ok(Spec::Latest);
    }
    if let Some(n) = args.to_offset {
        return Ok(Spec::Offset(n));
    }
    if let Some(n) = args.shift_by {
        return Ok(Spec::ShiftBy(n));
    }
    match &args.to_datetime {
        Some(text) => parse_datetime(text),
        // clap requires one of the five.
        None => Err(ReplayError::NoSpec),
    }
}

/// An RFC 3339 time as Unix milliseconds.
pub fn parse_datetime(text: &str) -> Result<Spec, ReplayError> {
    let t = DateTime::parse_from_rfc3339(text).map_err(|source| ReplayError::BadDatetime {
        value: text.to_string(),
        source,
    })?;
    Ok(Spec::Datetime(t.timestamp_millis()))
}

// ---- the plan: pure ----

/// The broker's answer to "the first offset at or after this time", once checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtTime {
    Offset(i64),
    /// No message at or after the time: the end of the partition.
    End,
}

/// What a partition's new offset is computed from. `high` and `at_time` are `None` when the spec
/// does not need them (they are then not read, or not checked, and must not be used).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inputs {
    pub current: Option<i64>,
    pub low: i64,
    pub high: Option<i64>,
    pub at_time: Option<AtTime>,
}

/// Why a new offset cannot be computed from [`Inputs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanGap {
    /// `--shift-by` moves the committed offset, and there is none.
    NoCommittedOffset,
    /// The spec needs the high watermark and it was not given.
    NeedsHigh,
    /// `--to-datetime` without the broker's answer.
    NeedsTimeAnswer,
    /// The watermarks are the wrong way round.
    Inverted { low: i64, high: i64 },
}

/// Whether `spec` needs the high watermark for a partition whose time answer is `at_time`:
/// every spec but `--to-earliest` does, to clamp (or as the target itself), except a time
/// answered with an offset (which is inside the partition when checked).
pub fn needs_high(spec: Spec, at_time: Option<AtTime>) -> bool {
    match spec {
        Spec::Earliest => false,
        Spec::Latest | Spec::Offset(_) | Spec::ShiftBy(_) => true,
        Spec::Datetime(_) => !matches!(at_time, Some(AtTime::Offset(_))),
    }
}

/// The new offset of one partition, as kafka-consumer-groups computes it: `--to-earliest` the
/// low watermark, `--to-latest` the high one, `--to-offset` and `--shift-by` (from the committed
/// offset) clamped to `[low, high]`, `--to-datetime` the broker's answer or the end.
pub fn new_offset(spec: Spec, i: Inputs) -> Result<i64, PlanGap> {
    let high = || -> Result<i64, PlanGap> {
        let high = i.high.ok_or(PlanGap::NeedsHigh)?;
        if high < i.low {
            return Err(PlanGap::Inverted { low: i.low, high });
        }
        Ok(high)
    };
    let clamp = |o: i64| -> Result<i64, PlanGap> { Ok(o.max(i.low).min(high()?)) };
    match spec {
        Spec::Earliest => Ok(i.low),
        Spec::Latest => high(),
        Spec::Offset(n) => clamp(n),
        Spec::ShiftBy(n) => {
            let current = i.current.ok_or(PlanGap::NoCommittedOffset)?;
            clamp(current.saturating_add(n))
        }
        Spec::Datetime(_) => match i.at_time.ok_or(PlanGap::NeedsTimeAnswer)? {
            AtTime::Offset(o) => Ok(o.max(i.low)),
            AtTime::End => high(),
        },
    }
}

// ---- checking the broker's answers against the messages: pure ----

/// What a reader assigned at `start` saw first: up to a few messages (offset, timestamp in ms,
/// `None` when the message has none) and whether it reached the end of the partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Probe {
    pub start: i64,
    pub messages: Vec<(i64, Option<i64>)>,
    pub eof: bool,
}

/// The verdict on one answer of the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    Holds,
    /// The partition's messages say otherwise.
    Contradicted(String),
    /// The messages that would decide it did not come (in time, or without a timestamp).
    Undecided(String),
}

/// A high watermark holds when a reader assigned there reaches the end at once. A message there
/// means the partition goes on past it; a message before it means it was past the end (the
/// reader was reset to the start).
pub fn check_high(high: i64, p: &Probe) -> Check {
    match p.messages.first() {
        Some(&(o, _)) if o >= high => Check::Contradicted(format!(
            "high watermark {high}, but the partition holds a message at offset {o}"
        )),
        Some(&(o, _)) => Check::Contradicted(format!(
            "high watermark {high} is past the end (a read there was reset to offset {o})"
        )),
        None if p.eof => Check::Holds,
        None => Check::Undecided(format!("no end of partition seen at offset {high}")),
    }
}

/// A low watermark above zero holds when a reader assigned just before it gets nothing before it
/// (the reader is reset to the first offset kept, which must not be below `low`).
pub fn check_low(low: i64, p: &Probe) -> Check {
    match p.messages.first() {
        Some(&(o, _)) if o < low => Check::Contradicted(format!(
            "low watermark {low}, but the partition still holds offset {o}"
        )),
        Some(_) => Check::Holds,
        // Nothing before it, and nothing at all: an emptied partition.
        None if p.eof => Check::Holds,
        None => Check::Undecided(format!("no answer for offset {}", low - 1)),
    }
}

/// The broker's answer `o` for time `t` (Kafka: the first offset whose timestamp is at or after
/// `t`) holds when the message at `o` is at or after `t` and the one before it (read from
/// `o - 1`, when `o > low`) is before `t`. `p` starts at `o - 1` when `o > low`, else at `o`.
pub fn check_time(t: i64, o: i64, low: i64, p: &Probe) -> Check {
    let mut seen = p.messages.iter().copied().peekable();
    if o > low {
        match seen.peek().copied() {
            Some((before, _)) if before < o - 1 => {
                return Check::Contradicted(format!(
                    "answered offset {o}, but a read at {} was reset to offset {before}",
                    o - 1
                ));
            }
            // A gap before `o` (compaction, transaction markers): nothing to compare there.
            Some((before, _)) if before >= o => {}
            Some((before, None)) => {
                return Check::Undecided(format!("message {before} has no timestamp"));
            }
            Some((before, Some(ts))) if ts >= t => {
                return Check::Contradicted(format!(
                    "answered offset {o} for {t} ms, but the message before it ({before}) is \
                     already from {ts} ms"
                ));
            }
            Some(_) => {
                seen.next();
            }
            None if p.eof => {
                return Check::Contradicted(format!(
                    "answered offset {o}, but the partition ends at {}",
                    o - 1
                ));
            }
            None => return Check::Undecided(format!("no message at offset {}", o - 1)),
        }
    }
    match seen.next() {
        Some((at, _)) if at < o => Check::Contradicted(format!(
            "answered offset {o}, but a read there was reset to offset {at}"
        )),
        Some((at, None)) => Check::Undecided(format!("message {at} has no timestamp")),
        Some((at, Some(ts))) if ts < t => Check::Contradicted(format!(
            "answered offset {o} for {t} ms, but message {at} is from {ts} ms, before it"
        )),
        Some(_) => Check::Holds,
        // `o` is the end of the partition: nothing at or after `t` (the message before it,
        // checked above, is before `t`).
        None if p.eof => Check::Holds,
        None => Check::Undecided(format!("no message at offset {o}")),
    }
}

/// "No message at or after `t`" (the answer End) holds when the last message (read from
/// `high - 1`; `high` checked) is before `t`, or the partition is empty.
pub fn check_end(t: i64, low: i64, high: i64, p: &Probe) -> Check {
    if high <= low {
        return Check::Holds;
    }
    match p.messages.first() {
        Some(&(o, _)) if o < high - 1 => {
            Check::Contradicted(format!("a read at {} was reset to offset {o}", high - 1))
        }
        Some(&(o, None)) => Check::Undecided(format!("message {o} has no timestamp")),
        Some(&(o, Some(ts))) if ts >= t => Check::Contradicted(format!(
            "answered \"no message at or after {t} ms\", but message {o} is from {ts} ms"
        )),
        Some(_) => Check::Holds,
        None => Check::Undecided(format!("no message at offset {}", high - 1)),
    }
}

// ---- the broker ----

/// One partition's row of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanRow {
    pub group: String,
    pub topic: String,
    pub partition: i32,
    /// The group's committed offset (`None`: none committed).
    pub current: Option<i64>,
    pub new: i64,
    /// The watermarks used (checked against the messages); `high` is `None` when not needed.
    pub low: i64,
    pub high: Option<i64>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("no reset given (--to-earliest, --to-latest, --to-offset, --shift-by, --to-datetime)")]
    NoSpec,
    #[error(
        "unknown role {0:?} (the roles with consumer groups: allocator, signer-gateway, \
         broadcaster, receipt-checker, confirmation-manager)"
    )]
    UnknownRole(String),
    #[error("role {role} has no consumer group (it is not a stage of the pipeline)")]
    NoGroup { role: Role },
    #[error("topic {topic:?} is not an input of role {role} (its inputs: {})", inputs.join(", "))]
    NotAnInput {
        role: Role,
        topic: String,
        inputs: Vec<String>,
    },
    #[error("--to-datetime {value:?} is not an RFC 3339 time")]
    BadDatetime {
        value: String,
        #[source]
        source: chrono::ParseError,
    },
    #[error("creating a Kafka client")]
    Client(#[source] Box<KafkaError>),
    #[error(
        "group {group} has {members} live member(s) (state {state}): stop its processes before \
         resetting its offsets"
    )]
    GroupLive {
        group: String,
        members: usize,
        state: String,
    },
    #[error(
        "the broker did not say whether group {group} has live members, so its offsets are left \
         alone"
    )]
    Membership {
        group: String,
        #[source]
        source: Box<KafkaError>,
    },
    #[error("reading topic {topic}'s partitions")]
    Metadata {
        topic: String,
        #[source]
        source: Box<KafkaError>,
    },
    #[error("topic {topic} does not exist ({code})")]
    NoTopic { topic: String, code: String },
    #[error("reading group {group}'s committed offsets on {topic}")]
    Committed {
        group: String,
        topic: String,
        #[source]
        source: Box<KafkaError>,
    },
    #[error("the broker did not answer {what} of {topic}[{partition}]")]
    Lookup {
        what: &'static str,
        topic: String,
        partition: i32,
        #[source]
        source: Box<KafkaError>,
    },
    #[error(
        "the broker's {what} for {topic}[{partition}] is wrong: {detail} (this broker cannot \
         answer it; no plan is made from it)"
    )]
    Unreliable {
        what: &'static str,
        topic: String,
        partition: i32,
        detail: String,
    },
    #[error("the broker's {what} for {topic}[{partition}] could not be checked: {detail}")]
    Unchecked {
        what: &'static str,
        topic: String,
        partition: i32,
        detail: String,
    },
    #[error("group {group} has no committed offset on {topic}[{partition}]: --shift-by moves one")]
    NoCommittedOffset {
        group: String,
        topic: String,
        partition: i32,
    },
    #[error("cannot plan {topic}[{partition}]: {gap:?}")]
    Plan {
        topic: String,
        partition: i32,
        gap: PlanGap,
    },
    #[error("committing group {group}'s offsets")]
    Commit {
        group: String,
        #[source]
        source: Box<KafkaError>,
    },
    #[error(
        "after the commit, group {group} reads {topic}[{partition}] from {found:?}, not {want}"
    )]
    NotApplied {
        group: String,
        topic: String,
        partition: i32,
        want: i64,
        found: Option<i64>,
    },
}

/// Kafka errors are large (a client configuration error holds three strings): boxed, so that
/// every `Result` of this module stays small.
fn client(e: KafkaError) -> ReplayError {
    ReplayError::Client(Box::new(e))
}

impl Classify for ReplayError {
    fn retry(&self) -> Retry {
        match self {
            // The broker did not answer (in time): asking again may do.
            ReplayError::Client(_)
            | ReplayError::Membership { .. }
            | ReplayError::Metadata { .. }
            | ReplayError::Committed { .. }
            | ReplayError::Lookup { .. }
            | ReplayError::Unchecked { .. }
            | ReplayError::Commit { .. }
            | ReplayError::NotApplied { .. }
            // Live members leave once their processes are stopped.
            | ReplayError::GroupLive { .. } => Retry::Transient,
            // Wrong arguments, or a broker that answers wrongly: the same again.
            ReplayError::NoSpec
            | ReplayError::UnknownRole(_)
            | ReplayError::NoGroup { .. }
            | ReplayError::NotAnInput { .. }
            | ReplayError::BadDatetime { .. }
            | ReplayError::NoTopic { .. }
            | ReplayError::Unreliable { .. }
            | ReplayError::NoCommittedOffset { .. }
            | ReplayError::Plan { .. } => Retry::Permanent,
        }
    }
}

/// The probes' client context. rdkafka's default one logs every error event at ERROR, and the
/// end of a partition, which a probe waits for, arrives as one.
struct ProbeContext;

impl ClientContext for ProbeContext {
    fn error(&self, error: KafkaError, reason: &str) {
        match error {
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF) => {
                tracing::debug!(reason, "replay probe reached the end of a partition");
            }
            error => tracing::warn!(error = %error, reason, "replay probe: librdkafka error"),
        }
    }
}

impl ConsumerContext for ProbeContext {}

/// Talks to the broker for one replay.
pub struct Broker {
    settings: KafkaSettings,
    timeout: Duration,
}

impl Broker {
    pub fn new(settings: KafkaSettings, timeout: Duration) -> Broker {
        Broker { settings, timeout }
    }

    /// A consumer outside any group (never subscribed), with `group` as its id when given: a
    /// commit then goes to that group as a standalone commit.
    fn consumer(&self, group: Option<&str>) -> Result<BaseConsumer, ReplayError> {
        let mut c = self.settings.assign_config();
        if let Some(g) = group {
            c.set("group.id", g);
        }
        c.create().map_err(client)
    }

    /// A reader outside any group that reports the end of each partition it reaches.
    fn reader(&self) -> Result<BaseConsumer<ProbeContext>, ReplayError> {
        let mut c = self.settings.assign_config();
        c.set("enable.partition.eof", "true");
        c.create_with_context(ProbeContext).map_err(client)
    }

    /// Refuses while `group` has members: their commits would overwrite the reset, and Apache
    /// Kafka refuses a standalone commit to a group that is not empty anyway.
    pub fn refuse_if_live(&self, group: &str) -> Result<(), ReplayError> {
        let c = self.consumer(None)?;
        let list = c
            .fetch_group_list(Some(group), self.timeout)
            .map_err(|source| ReplayError::Membership {
                group: group.to_string(),
                source: Box::new(source),
            })?;
        if let Some(g) = list.groups().iter().find(|g| g.name() == group)
            && !g.members().is_empty()
        {
            return Err(ReplayError::GroupLive {
                group: group.to_string(),
                members: g.members().len(),
                state: g.state().to_string(),
            });
        }
        Ok(())
    }

    fn partitions(&self, c: &BaseConsumer, topic: &str) -> Result<Vec<i32>, ReplayError> {
        let md = c
            .fetch_metadata(Some(topic), self.timeout)
            .map_err(|source| ReplayError::Metadata {
                topic: topic.to_string(),
                source: Box::new(source),
            })?;
        let Some(t) = md.topics().iter().find(|t| t.name() == topic) else {
            return Err(ReplayError::NoTopic {
                topic: topic.to_string(),
                code: "not in the metadata".into(),
            });
        };
        if let Some(code) = t.error() {
            return Err(ReplayError::NoTopic {
                topic: topic.to_string(),
                code: format!("{code:?}"),
            });
        }
        let mut ps: Vec<i32> = t.partitions().iter().map(|p| p.id()).collect();
        ps.sort_unstable();
        if ps.is_empty() {
            return Err(ReplayError::NoTopic {
                topic: topic.to_string(),
                code: "no partitions".into(),
            });
        }
        Ok(ps)
    }

    fn committed(
        &self,
        group: &str,
        topic: &str,
        partitions: &[i32],
    ) -> Result<BTreeMap<i32, Option<i64>>, ReplayError> {
        let c = self.consumer(Some(group))?;
        let mut tpl = TopicPartitionList::new();
        for &p in partitions {
            tpl.add_partition(topic, p);
        }
        let got =
            c.committed_offsets(tpl, self.timeout)
                .map_err(|source| ReplayError::Committed {
                    group: group.to_string(),
                    topic: topic.to_string(),
                    source: Box::new(source),
                })?;
        Ok(got
            .elements_for_topic(topic)
            .iter()
            .map(|e| {
                let offset = match e.offset() {
                    Offset::Offset(o) => Some(o),
                    _ => None,
                };
                (e.partition(), offset)
            })
            .collect())
    }

    /// What readers assigned at `starts` (partition → offset) see first: up to `want` messages
    /// each, or the end of the partition, within the timeout.
    fn probe(
        &self,
        topic: &str,
        starts: &BTreeMap<i32, i64>,
        want: usize,
    ) -> Result<BTreeMap<i32, Probe>, ReplayError> {
        let mut out: BTreeMap<i32, Probe> = starts
            .iter()
            .map(|(&p, &start)| {
                (
                    p,
                    Probe {
                        start,
                        ..Probe::default()
                    },
                )
            })
            .collect();
        if starts.is_empty() {
            return Ok(out);
        }
        let c = self.reader()?;
        let mut tpl = TopicPartitionList::new();
        for (&p, &start) in starts {
            tpl.add_partition_offset(topic, p, Offset::Offset(start))
                .map_err(client)?;
        }
        c.assign(&tpl).map_err(client)?;
        let done = |p: &Probe| p.eof || p.messages.len() >= want;
        let deadline = Instant::now() + self.timeout;
        while !out.values().all(done) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match c.poll(left.min(Duration::from_millis(100))) {
                None => {}
                Some(Ok(m)) => {
                    if let Some(p) = out.get_mut(&m.partition())
                        && !done(p)
                    {
                        p.messages.push((m.offset(), m.timestamp().to_millis()));
                    }
                }
                Some(Err(KafkaError::PartitionEOF(partition))) => {
                    if let Some(p) = out.get_mut(&partition) {
                        p.eof = true;
                    }
                }
                // Transient fetch errors are retried by the client itself; the deadline bounds
                // them, and a partition left undecided is reported as such.
                Some(Err(e)) => tracing::debug!(error = %e, topic, "replay probe"),
            }
        }
        Ok(out)
    }

    /// The plan for `target`: each partition's committed and new offset, from answers of the
    /// broker that the partition's messages confirm.
    pub fn plan(&self, target: &Target, spec: Spec) -> Result<Vec<PlanRow>, ReplayError> {
        let topic = target.topic.as_str();
        let c = self.consumer(None)?;
        let partitions = self.partitions(&c, topic)?;
        let current = self.committed(&target.group, topic, &partitions)?;
        let lookup = |what: &'static str, partition: i32| {
            move |source| ReplayError::Lookup {
                what,
                topic: topic.to_string(),
                partition,
                source: Box::new(source),
            }
        };
        let mut marks = BTreeMap::new();
        for &p in &partitions {
            let (low, high) = c
                .fetch_watermarks(topic, p, self.timeout)
                .map_err(lookup("the watermarks", p))?;
            marks.insert(p, (low, high));
        }
        let verdict = |what: &'static str, partition: i32, check: Check| match check {
            Check::Holds => Ok(()),
            Check::Contradicted(detail) => Err(ReplayError::Unreliable {
                what,
                topic: topic.to_string(),
                partition,
                detail,
            }),
            Check::Undecided(detail) => Err(ReplayError::Unchecked {
                what,
                topic: topic.to_string(),
                partition,
                detail,
            }),
        };

        // Every plan stands on the low watermark: one above zero must have nothing before it.
        let lows: BTreeMap<i32, i64> = marks
            .iter()
            .filter(|(_, (low, _))| *low > 0)
            .map(|(&p, &(low, _))| (p, low - 1))
            .collect();
        for (p, probe) in self.probe(topic, &lows, 1)? {
            verdict("low watermark", p, check_low(marks[&p].0, &probe))?;
        }

        // The time lookup, checked at the offset it names and just before it.
        let mut at_time: BTreeMap<i32, AtTime> = BTreeMap::new();
        if let Spec::Datetime(t) = spec {
            let mut tpl = TopicPartitionList::new();
            for &p in &partitions {
                tpl.add_partition_offset(topic, p, Offset::Offset(t))
                    .map_err(client)?;
            }
            let answers = c
                .offsets_for_times(tpl, self.timeout)
                .map_err(lookup("the offset for a time", partitions[0]))?;
            for e in answers.elements_for_topic(topic) {
                let answer = match e.offset() {
                    Offset::Offset(o) => AtTime::Offset(o),
                    Offset::End => AtTime::End,
                    other => {
                        return Err(ReplayError::Unreliable {
                            what: "offset for a time",
                            topic: topic.to_string(),
                            partition: e.partition(),
                            detail: format!("answered {other:?}"),
                        });
                    }
                };
                at_time.insert(e.partition(), answer);
            }
            let starts: BTreeMap<i32, i64> = at_time
                .iter()
                .filter_map(|(&p, a)| match *a {
                    AtTime::Offset(o) => Some((p, if o > marks[&p].0 { o - 1 } else { o })),
                    AtTime::End => None,
                })
                .collect();
            for (p, probe) in self.probe(topic, &starts, 2)? {
                if let AtTime::Offset(o) = at_time[&p] {
                    verdict(
                        "offset for a time",
                        p,
                        check_time(t, o, marks[&p].0, &probe),
                    )?;
                }
            }
        }

        // The high watermark, where the plan uses it.
        let highs: BTreeMap<i32, i64> = partitions
            .iter()
            .filter(|p| needs_high(spec, at_time.get(p).copied()))
            .map(|&p| (p, marks[&p].1))
            .collect();
        for (p, probe) in self.probe(topic, &highs, 1)? {
            verdict("high watermark", p, check_high(marks[&p].1, &probe))?;
        }
        // "Nothing at or after the time": the last message must be before it.
        if let Spec::Datetime(t) = spec {
            let lasts: BTreeMap<i32, i64> = at_time
                .iter()
                .filter(|(p, a)| **a == AtTime::End && marks[p].1 > marks[p].0)
                .map(|(&p, _)| (p, marks[&p].1 - 1))
                .collect();
            for (p, probe) in self.probe(topic, &lasts, 1)? {
                let (low, high) = marks[&p];
                verdict("offset for a time", p, check_end(t, low, high, &probe))?;
            }
        }

        partitions
            .iter()
            .map(|&p| {
                let (low, high) = marks[&p];
                let inputs = Inputs {
                    current: current.get(&p).copied().flatten(),
                    low,
                    high: highs.contains_key(&p).then_some(high),
                    at_time: at_time.get(&p).copied(),
                };
                let new = new_offset(spec, inputs).map_err(|gap| match gap {
                    PlanGap::NoCommittedOffset => ReplayError::NoCommittedOffset {
                        group: target.group.clone(),
                        topic: topic.to_string(),
                        partition: p,
                    },
                    gap => ReplayError::Plan {
                        topic: topic.to_string(),
                        partition: p,
                        gap,
                    },
                })?;
                Ok(PlanRow {
                    group: target.group.clone(),
                    topic: topic.to_string(),
                    partition: p,
                    current: inputs.current,
                    new,
                    low,
                    high: inputs.high,
                })
            })
            .collect()
    }

    /// Commits `rows` (one group's) and reads them back.
    pub fn apply(&self, group: &str, rows: &[PlanRow]) -> Result<(), ReplayError> {
        let c = self.consumer(Some(group))?;
        let mut tpl = TopicPartitionList::new();
        for r in rows {
            tpl.add_partition_offset(&r.topic, r.partition, Offset::Offset(r.new))
                .map_err(client)?;
        }
        c.commit(&tpl, CommitMode::Sync)
            .map_err(|source| ReplayError::Commit {
                group: group.to_string(),
                source: Box::new(source),
            })?;
        let mut topics: Vec<&str> = rows.iter().map(|r| r.topic.as_str()).collect();
        topics.dedup();
        for topic in topics {
            let partitions: Vec<i32> = rows
                .iter()
                .filter(|r| r.topic == topic)
                .map(|r| r.partition)
                .collect();
            let now = self.committed(group, topic, &partitions)?;
            for r in rows.iter().filter(|r| r.topic == topic) {
                let found = now.get(&r.partition).copied().flatten();
                if found != Some(r.new) {
                    return Err(ReplayError::NotApplied {
                        group: group.to_string(),
                        topic: topic.to_string(),
                        partition: r.partition,
                        want: r.new,
                        found,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Plans (and with `execute`, applies) `spec` for `targets`, refusing every group that has live
/// members, before and again right before its commit.
pub fn replay(
    broker: &Broker,
    targets: &[Target],
    spec: Spec,
    execute: bool,
) -> Result<Vec<PlanRow>, ReplayError> {
    let mut groups: Vec<&str> = targets.iter().map(|t| t.group.as_str()).collect();
    groups.sort_unstable();
    groups.dedup();
    for g in &groups {
        broker.refuse_if_live(g)?;
    }
    let mut rows = Vec::new();
    for t in targets {
        rows.extend(broker.plan(t, spec)?);
    }
    if execute {
        for g in groups {
            let mine: Vec<PlanRow> = rows.iter().filter(|r| r.group == g).cloned().collect();
            broker.refuse_if_live(g)?;
            broker.apply(g, &mine)?;
        }
    }
    Ok(rows)
}

fn show(o: Option<i64>) -> String {
    o.map_or_else(|| "-".to_string(), |o| o.to_string())
}

pub async fn run(config: &Config, args: ReplayArgs) -> anyhow::Result<()> {
    let targets = targets(config, &args)?;
    let spec = spec(&args)?;
    let broker = Broker::new(config.kafka.clone(), Duration::from_millis(args.timeout_ms));
    let execute = args.execute;
    let (rows, targets) = tokio::task::spawn_blocking(move || {
        replay(&broker, &targets, spec, execute).map(|rows| (rows, targets))
    })
    .await??;
    if args.json {
        for r in &rows {
            println!(
                "{}",
                json!({
                    "group": r.group,
                    "topic": r.topic,
                    "partition": r.partition,
                    "current": r.current,
                    "new": r.new,
                    "low": r.low,
                    "high": r.high,
                    "executed": execute,
                })
            );
        }
        return Ok(());
    }
    let mut groups: Vec<&str> = targets.iter().map(|t| t.group.as_str()).collect();
    groups.dedup();
    println!("{spec} for {}", groups.join(", "));
    println!(
        "{:<40} {:<40} {:>9} {:>12} {:>12} {:>12} {:>12}",
        "GROUP", "TOPIC", "PARTITION", "CURRENT", "NEW", "LOW", "HIGH"
    );
    for r in &rows {
        println!(
            "{:<40} {:<40} {:>9} {:>12} {:>12} {:>12} {:>12}",
            r.group,
            r.topic,
            r.partition,
            show(r.current),
            r.new,
            r.low,
            show(r.high)
        );
    }
    if execute {
        println!("committed: the groups read from NEW when their processes start");
    } else {
        println!("dry run: nothing committed (--execute applies this plan)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(current: Option<i64>, low: i64, high: Option<i64>) -> Inputs {
        Inputs {
            current,
            low,
            high,
            at_time: None,
        }
    }

    #[test]
    fn new_offsets_follow_kafka_consumer_groups() {
        // (spec, current, low, high, at_time) → new offset
        type Case = (
            Spec,
            Option<i64>,
            i64,
            Option<i64>,
            Option<AtTime>,
            Result<i64, PlanGap>,
        );
        let cases: &[Case] = &[
            (Spec::Earliest, Some(7), 3, None, None, Ok(3)),
            (Spec::Earliest, None, 0, Some(10), None, Ok(0)),
            (Spec::Latest, Some(7), 3, Some(10), None, Ok(10)),
            (Spec::Latest, None, 3, None, None, Err(PlanGap::NeedsHigh)),
            (Spec::Offset(5), Some(9), 3, Some(10), None, Ok(5)),
            // Clamped to [low, high], like kafka-consumer-groups.
            (Spec::Offset(1), None, 3, Some(10), None, Ok(3)),
            (Spec::Offset(-4), None, 0, Some(10), None, Ok(0)),
            (Spec::Offset(50), None, 3, Some(10), None, Ok(10)),
            (Spec::ShiftBy(-2), Some(7), 3, Some(10), None, Ok(5)),
            (Spec::ShiftBy(-20), Some(7), 3, Some(10), None, Ok(3)),
            (Spec::ShiftBy(2), Some(7), 3, Some(10), None, Ok(9)),
            (Spec::ShiftBy(5), Some(7), 3, Some(10), None, Ok(10)),
            (Spec::ShiftBy(i64::MAX), Some(7), 3, Some(10), None, Ok(10)),
            (Spec::ShiftBy(i64::MIN), Some(7), 3, Some(10), None, Ok(3)),
            (
                Spec::ShiftBy(1),
                None,
                3,
                Some(10),
                None,
                Err(PlanGap::NoCommittedOffset),
            ),
            (
                Spec::Datetime(1),
                None,
                3,
                None,
                Some(AtTime::Offset(6)),
                Ok(6),
            ),
            (
                Spec::Datetime(1),
                None,
                3,
                Some(10),
                Some(AtTime::End),
                Ok(10),
            ),
            (
                Spec::Datetime(1),
                None,
                3,
                None,
                Some(AtTime::End),
                Err(PlanGap::NeedsHigh),
            ),
            (
                Spec::Datetime(1),
                None,
                3,
                None,
                None,
                Err(PlanGap::NeedsTimeAnswer),
            ),
            (
                Spec::Offset(5),
                None,
                8,
                Some(4),
                None,
                Err(PlanGap::Inverted { low: 8, high: 4 }),
            ),
            // An empty partition: every spec lands on its one offset.
            (Spec::Offset(5), Some(2), 2, Some(2), None, Ok(2)),
            (Spec::ShiftBy(-1), Some(2), 2, Some(2), None, Ok(2)),
        ];
        for &(spec, current, low, high, at_time, want) in cases {
            let inputs = Inputs {
                at_time,
                ..at(current, low, high)
            };
            assert_eq!(new_offset(spec, inputs), want, "{spec} from {inputs:?}");
        }
    }

    #[test]
    fn only_the_earliest_and_a_time_found_go_without_the_high_watermark() {
        assert!(!needs_high(Spec::Earliest, None));
        assert!(needs_high(Spec::Latest, None));
        assert!(needs_high(Spec::Offset(3), None));
        assert!(needs_high(Spec::ShiftBy(-3), None));
        assert!(!needs_high(Spec::Datetime(5), Some(AtTime::Offset(2))));
        assert!(needs_high(Spec::Datetime(5), Some(AtTime::End)));
    }

    fn probe(start: i64, messages: &[(i64, i64)], eof: bool) -> Probe {
        Probe {
            start,
            messages: messages.iter().map(|&(o, ts)| (o, Some(ts))).collect(),
            eof,
        }
    }

    fn holds(c: &Check) -> bool {
        matches!(c, Check::Holds)
    }
    fn contradicted(c: &Check) -> bool {
        matches!(c, Check::Contradicted(_))
    }
    fn undecided(c: &Check) -> bool {
        matches!(c, Check::Undecided(_))
    }

    #[test]
    fn a_high_watermark_holds_only_where_the_partition_ends() {
        assert!(holds(&check_high(10, &probe(10, &[], true))));
        // tansu: 10 records in one batch, high watermark 1.
        let c = check_high(1, &probe(1, &[(1, 0)], false));
        assert!(contradicted(&c), "{c:?}");
        // Past the end: the reader is reset to the start.
        assert!(contradicted(&check_high(12, &probe(12, &[(0, 0)], false))));
        assert!(undecided(&check_high(10, &probe(10, &[], false))));
    }

    #[test]
    fn a_low_watermark_holds_when_nothing_before_it_is_kept() {
        assert!(holds(&check_low(5, &probe(4, &[(5, 0)], false))));
        assert!(holds(&check_low(5, &probe(4, &[], true))));
        assert!(contradicted(&check_low(5, &probe(4, &[(4, 0)], false))));
        assert!(undecided(&check_low(5, &probe(4, &[], false))));
    }

    #[test]
    fn a_time_answer_holds_when_it_splits_the_messages_at_the_time() {
        // Timestamps 100, 100, 200, 200 at offsets 0..3; t = 150 → offset 2.
        let msgs = [(1, 100), (2, 200)];
        assert!(holds(&check_time(150, 2, 0, &probe(1, &msgs, false))));
        // tansu answers the first offset for every time.
        let c = check_time(150, 0, 0, &probe(0, &[(0, 100), (1, 100)], false));
        assert!(contradicted(&c), "{c:?}");
        // ...which is right for a time before every message.
        assert!(holds(&check_time(50, 0, 0, &probe(0, &[(0, 100)], false))));
        // An answer too late: the message before it is already at or after the time.
        assert!(contradicted(&check_time(
            150,
            3,
            0,
            &probe(2, &[(2, 200), (3, 200)], false)
        )));
        // A gap before the answer (compaction): only the message at it is checked.
        assert!(holds(&check_time(150, 2, 0, &probe(1, &[(2, 200)], false))));
        // The answer is the end: the last message before the time, then the end.
        assert!(holds(&check_time(250, 4, 0, &probe(3, &[(3, 200)], true))));
        // Past the end.
        assert!(contradicted(&check_time(250, 6, 0, &probe(5, &[], true))));
        // A read reset to the start: the answer was out of range.
        assert!(contradicted(&check_time(
            150,
            9,
            0,
            &probe(8, &[(0, 100)], false)
        )));
        assert!(undecided(&check_time(
            150,
            2,
            0,
            &probe(1, &[(1, 100)], false)
        )));
        let no_ts = Probe {
            start: 1,
            messages: vec![(1, None)],
            eof: false,
        };
        assert!(undecided(&check_time(150, 2, 0, &no_ts)));
    }

    #[test]
    fn no_message_after_the_time_holds_when_the_last_one_is_before_it() {
        assert!(holds(&check_end(300, 0, 4, &probe(3, &[(3, 200)], false))));
        assert!(contradicted(&check_end(
            150,
            0,
            4,
            &probe(3, &[(3, 200)], false)
        )));
        assert!(holds(&check_end(150, 4, 4, &Probe::default())));
        assert!(undecided(&check_end(150, 0, 4, &probe(3, &[], false))));
    }

    #[test]
    fn a_role_names_its_stages_groups_and_input_topics() {
        let mut c = Config {
            topics: txflow_core::kafka::Topics::new("t"),
            ..Config::default()
        };
        c.group_prefix = Some("g".into());
        let a = role_targets(Role::Allocator, &c).expect("allocator");
        assert_eq!(
            a,
            vec![
                Target {
                    group: "g.allocator".into(),
                    topic: "t.tx.requests".into()
                },
                Target {
                    group: "g.allocator.commands".into(),
                    topic: "t.tx.commands".into()
                },
            ]
        );
        assert!(matches!(
            role_targets(Role::Gateway, &c),
            Err(ReplayError::NoGroup { .. })
        ));
        // --role allocator --topic tx.commands: one of the two.
        let args = ReplayArgs {
            group: None,
            role: Some("allocator".into()),
            topic: vec!["tx.commands".into()],
            to_earliest: true,
            to_latest: false,
            to_offset: None,
            shift_by: None,
            to_datetime: None,
            dry_run: false,
            execute: false,
            json: false,
            timeout_ms: 1,
        };
        assert_eq!(targets(&c, &args).expect("targets"), a[1..].to_vec());
        let other = ReplayArgs {
            topic: vec!["tx.signed".into()],
            ..args
        };
        let e = targets(&c, &other).expect_err("not an input");
        assert!(
            e.to_string().contains("t.tx.requests, t.tx.commands"),
            "{e}"
        );
        assert_eq!(e.retry(), Retry::Permanent);
    }

    // ---- against librdkafka's mock cluster, which answers what tansu cannot (watermarks) ----

    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

    const T0: i64 = 1_700_000_000_000;

    /// A mock cluster with topic `t`: partition 0 holds 10 records (timestamps T0 + i s, sent
    /// in one batch), partition 1 three, partition 2 none.
    fn mock() -> (
        MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
        Broker,
    ) {
        let cluster = MockCluster::new(1).expect("mock cluster");
        cluster.create_topic("t", 3, 1).expect("topic");
        let settings = KafkaSettings::new(cluster.bootstrap_servers());
        let producer: BaseProducer = settings
            .producer_config()
            .set("linger.ms", "100")
            .create()
            .expect("producer");
        for (partition, n) in [(0, 10), (1, 3)] {
            for i in 0..n {
                let payload = format!("m{i}");
                producer
                    .send(
                        BaseRecord::to("t")
                            .partition(partition)
                            .key("k")
                            .payload(&payload)
                            .timestamp(T0 + i64::from(i) * 1_000),
                    )
                    .map_err(|(e, _)| e)
                    .expect("send");
            }
        }
        producer.flush(Duration::from_secs(10)).expect("flush");
        (cluster, Broker::new(settings, Duration::from_secs(10)))
    }

    fn target() -> Target {
        Target {
            group: "g".into(),
            topic: "t".into(),
        }
    }

    fn news(rows: &[PlanRow]) -> Vec<(i32, Option<i64>, i64)> {
        rows.iter()
            .map(|r| (r.partition, r.current, r.new))
            .collect()
    }

    #[test]
    fn to_latest_on_the_mock_cluster_uses_the_checked_high_watermarks() {
        let (_cluster, broker) = mock();
        let t = target();
        let start = broker.plan(&t, Spec::Offset(2)).expect("plan to offset 2");
        // Clamped: partition 1 ends at 3, partition 2 is empty.
        assert_eq!(news(&start), vec![(0, None, 2), (1, None, 2), (2, None, 0)]);
        broker.apply("g", &start).expect("commit");
        let latest = broker.plan(&t, Spec::Latest).expect("plan to latest");
        assert_eq!(
            news(&latest),
            vec![(0, Some(2), 10), (1, Some(2), 3), (2, Some(0), 0)]
        );
        assert_eq!(latest[0].high, Some(10));
        let back = broker.plan(&t, Spec::ShiftBy(-5)).expect("shift");
        assert_eq!(
            news(&back),
            vec![(0, Some(2), 0), (1, Some(2), 0), (2, Some(0), 0)]
        );
        broker.apply("g", &latest).expect("commit latest");
        assert_eq!(
            news(&broker.plan(&t, Spec::ShiftBy(-4)).expect("shift")),
            vec![(0, Some(10), 6), (1, Some(3), 0), (2, Some(0), 0)]
        );
    }

    #[test]
    fn to_datetime_on_the_mock_cluster_is_checked_against_the_messages() {
        let (_cluster, broker) = mock();
        let t = target();
        // The mock answers "no message at or after" every time: right for a time after the last
        // message, so the plan is the end of each partition...
        let after = broker
            .plan(&t, Spec::Datetime(T0 + 60_000))
            .expect("a time after every message");
        assert_eq!(
            news(&after),
            vec![(0, None, 10), (1, None, 3), (2, None, 0)]
        );
        // ...and wrong for a time inside the partition: a typed error, never a plan.
        let e = broker
            .plan(&t, Spec::Datetime(T0 + 1_500))
            .expect_err("the mock cannot look a time up");
        assert!(
            matches!(
                &e,
                ReplayError::Unreliable {
                    what: "offset for a time",
                    partition: 0,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(e.retry(), Retry::Permanent);
    }

    #[test]
    fn a_shift_needs_a_committed_offset() {
        let (_cluster, broker) = mock();
        let e = broker
            .plan(&target(), Spec::ShiftBy(-1))
            .expect_err("nothing committed");
        assert!(
            matches!(e, ReplayError::NoCommittedOffset { partition: 0, .. }),
            "{e}"
        );
    }

    #[test]
    fn a_broker_that_cannot_list_groups_leaves_the_offsets_alone() {
        // The mock cluster implements neither ListGroups nor DescribeGroups.
        let (_cluster, broker) = mock();
        let broker = Broker {
            timeout: Duration::from_secs(2),
            ..broker
        };
        let e = replay(&broker, &[target()], Spec::Earliest, true).expect_err("membership unknown");
        assert!(matches!(e, ReplayError::Membership { .. }), "{e}");
        assert!(e.to_string().contains("group g"), "{e}");
        assert_eq!(e.retry(), Retry::Transient);
    }

    #[test]
    fn datetimes_are_rfc3339() {
        assert_eq!(
            parse_datetime("2026-11-24T02:00:00Z").expect("parse"),
            Spec::Datetime(1_795_485_600_000)
        );
        assert_eq!(
            parse_datetime("2026-11-24T03:00:00+01:00").expect("parse"),
            Spec::Datetime(1_795_485_600_000)
        );
        assert!(matches!(
            parse_datetime("yesterday"),
            Err(ReplayError::BadDatetime { .. })
        ));
    }
}
