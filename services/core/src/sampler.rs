//! The gauges a role process samples every `metrics.sample_ms` (`TXFLOW_METRICS_SAMPLE_MS`,
//! default 5 s) from PostgreSQL and the broker: `tx.open` (open transactions by state per
//! signer), `signer.held`, `outbox.backlog`, `lease.held` and `consumer.lag`.
//!
//! Every query reads a partial index or a small table: `tx.open` is one `GROUP BY` over
//! `managed_tx_open_idx` (the states written as literals, [`txstore::state_in`]), the backlog
//! counts `tx_outbox`, holds and leases are a row per signer. A series seen once
//! is recorded 0 when its rows are gone, so that a drained state or a cleared hold reads 0, not
//! its last value.
//!
//! Consumer lag is the high watermark minus the group's committed offset, per partition of the
//! role's input topics, read with a consumer outside the group (it never joins it). On the local
//! broker (tansu) it is wrong: tansu answers the high watermark as one past the last batch's base
//! offset (docs/operations.md, "The local broker"), so the lag it shows is too low, often 0. A negative
//! difference is reported as 0.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::domain::{ChainId, Role, Signer};
use crate::metrics;
use crate::state::TxState;
use crate::txstore;

/// A consumer group and the topic it reads: one source of `consumer.lag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LagTarget {
    pub group: String,
    pub topic: String,
}

/// What one process samples.
#[derive(Debug, Clone)]
pub struct Sampler {
    pub pool: PgPool,
    pub config: Config,
    /// The roles this process runs (`lease.held`, `signer.held` are per role).
    pub roles: Vec<Role>,
    /// The groups whose lag this process reports (the roles' own).
    pub lag: Vec<LagTarget>,
}

/// The prefix of this process's node ids (`{name or host}/{pid}/`): every lease this process
/// holds has an owner that starts with it.
fn node_prefix(config: &Config) -> String {
    let node = config.node();
    match node.as_str().rsplit_once('/') {
        Some((prefix, _)) => format!("{prefix}/"),
        None => node.as_str().to_string(),
    }
}

/// Series recorded by the previous round, to be zeroed when they are no longer seen.
#[derive(Default)]
struct Seen {
    open: BTreeSet<(Signer, TxState)>,
}

impl Sampler {
    /// Samples every `config.metrics_sample_ms` until `shutdown`; a failing round is logged
    /// (debug) and the next one tried.
    pub async fn run(self, shutdown: CancellationToken) {
        let every = Duration::from_millis(self.config.metrics_sample_ms.max(100));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seen = Seen::default();
        let prefix = node_prefix(&self.config);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.cancelled() => return,
            }
            if let Err(e) = self.sample_db(&prefix, &mut seen).await {
                tracing::debug!(error = %e, "metrics sample (database)");
            }
            let lag = self.lag.clone();
            let settings = self.config.kafka.clone();
            match tokio::task::spawn_blocking(move || consumer_lag(&settings, &lag)).await {
                Ok(Ok(rows)) => {
                    for (group, topic, partition, lag) in rows {
                        metrics::get().consumer_lag(&group, &topic, partition, lag);
                    }
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "metrics sample (consumer lag)"),
                Err(e) => tracing::debug!(error = %e, "metrics sample (consumer lag) panicked"),
            }
        }
    }

    async fn sample_db(&self, prefix: &str, seen: &mut Seen) -> Result<(), sqlx::Error> {
        let m = metrics::get();
        let chain = ChainId(self.config.chain_id);

        // tx.open: one GROUP BY over the partial index of the open states.
        let rows: Vec<(String, String, i64)> = sqlx::query_as(&format!(
            "SELECT signer, state, count(*) FROM managed_tx
             WHERE chain_id = $1 AND {} GROUP BY signer, state",
            txstore::state_in("state", &txstore::OPEN)
        ))
        .bind(chain.0)
        .fetch_all(&self.pool)
        .await?;
        let mut now = BTreeSet::new();
        for (signer, state, n) in rows {
            let (Ok(signer), Ok(state)) = (Signer::parse(&signer), TxState::parse(&state)) else {
                continue;
            };
            m.tx_open(chain, &signer, state, u64::try_from(n).unwrap_or(0));
            now.insert((signer, state));
        }
        for (signer, state) in seen.open.difference(&now) {
            m.tx_open(chain, signer, *state, 0);
        }
        seen.open = now;

        // signer.held: this process's roles, every known signer of the chain (those with a nonce
        // cursor, i.e. that txflow ever allocated for, and those held), 0 without a hold.
        let roles: Vec<&str> = self.roles.iter().map(|r| r.as_str()).collect();
        let holds: Vec<(String, String)> = sqlx::query_as(
            "SELECT role, signer FROM signer_holds WHERE chain_id = $1 AND role = ANY($2)",
        )
        .bind(chain.0)
        .bind(&roles)
        .fetch_all(&self.pool)
        .await?;
        let known: Vec<(String,)> = sqlx::query_as(
            "SELECT signer FROM signer_nonce_cursor WHERE chain_id = $1
             UNION SELECT signer FROM signer_holds WHERE chain_id = $1",
        )
        .bind(chain.0)
        .fetch_all(&self.pool)
        .await?;
        let held: BTreeSet<(&str, &str)> = holds
            .iter()
            .map(|(r, s)| (r.as_str(), s.as_str()))
            .collect();
        for (signer,) in &known {
            let Ok(parsed) = Signer::parse(signer) else {
                continue;
            };
            for role in &self.roles {
                let is_held = held.contains(&(role.as_str(), signer.as_str()));
                m.signer_held(*role, chain, &parsed, is_held);
            }
        }

        // outbox.backlog: the outbox holds only the events not acknowledged yet.
        let (backlog,): (i64,) = sqlx::query_as("SELECT count(*) FROM tx_outbox")
            .fetch_one(&self.pool)
            .await?;
        m.outbox_backlog(u64::try_from(backlog).unwrap_or(0));

        // lease.held: live leases whose owner is a node of this process.
        let leases: Vec<(String, i64)> = sqlx::query_as(
            "SELECT role, count(*) FROM signer_lease
             WHERE left(owner_node, length($1)) = $1 AND expires_at > clock_timestamp()
               AND role = ANY($2)
             GROUP BY role",
        )
        .bind(prefix)
        .bind(&roles)
        .fetch_all(&self.pool)
        .await?;
        let by_role: BTreeMap<&str, i64> = leases.iter().map(|(r, n)| (r.as_str(), *n)).collect();
        for role in &self.roles {
            let n = by_role.get(role.as_str()).copied().unwrap_or(0);
            m.lease_held(*role, u64::try_from(n).unwrap_or(0));
        }
        Ok(())
    }
}

/// Lag per partition of each target: (group, topic, partition, high watermark - committed),
/// 0 when negative or when the group has committed nothing yet on a partition the broker
/// reports empty. Blocking (librdkafka calls).
fn consumer_lag(
    settings: &crate::kafka::KafkaSettings,
    targets: &[LagTarget],
) -> Result<Vec<(String, String, i32, u64)>, rdkafka::error::KafkaError> {
    let timeout = Duration::from_secs(2);
    let mut out = Vec::new();
    for t in targets {
        let mut c = settings.assign_config();
        c.set("group.id", &t.group);
        let consumer: BaseConsumer = c.create()?;
        let md = consumer.fetch_metadata(Some(t.topic.as_str()), timeout)?;
        let Some(topic) = md.topics().iter().find(|x| x.name() == t.topic) else {
            continue;
        };
        let partitions: Vec<i32> = topic.partitions().iter().map(|p| p.id()).collect();
        let mut tpl = TopicPartitionList::new();
        for &p in &partitions {
            tpl.add_partition(&t.topic, p);
        }
        let committed = consumer.committed_offsets(tpl, timeout)?;
        for e in committed.elements_for_topic(&t.topic) {
            let p = e.partition();
            let (low, high) = consumer.fetch_watermarks(&t.topic, p, timeout)?;
            let from = match e.offset() {
                Offset::Offset(o) => o,
                // Nothing committed: the group would start at the beginning.
                _ => low,
            };
            let lag = u64::try_from(high.saturating_sub(from)).unwrap_or(0);
            out.push((t.group.clone(), t.topic.clone(), p, lag));
        }
    }
    Ok(out)
}
