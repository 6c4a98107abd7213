//! `txflow signers`: what each signer is doing, and `txflow signers reset-nonce`, the operator's
//! manual nonce reset (seed 003).
//!
//! The status is read from PostgreSQL (cursor, open transactions, holds, leases, released
//! nonces) and, for the signers of the configured chain, from the chain (pending and latest
//! nonce). A chain that does not answer leaves its columns empty with the reason: the view is
//! most needed when something is down.
//!
//! `reset-nonce` realigns the allocator's cursor with the chain and releases every nonce between
//! the chain's pending nonce and the cursor that no transaction occupies, into
//! `recycled_nonces`: the allocator then gives those nonces to the next requests and fills the
//! rest with no-ops, exactly as it does for nonces freed by failed transactions
//! (`fill_released`). The cursor never moves back: a nonce above the chain's may have been
//! signed and sent before the state that named it was lost (a restored backup), and handing it
//! out again would race that copy; a no-op spends it for certain. It writes under the
//! allocator's lease for the signer, taken through the [`LeaseManager`] like any allocator (a
//! node of its own), so that no allocator allocates meanwhile and every write is fenced. It is
//! refused while the signer has transactions in flight, or while another node holds that lease,
//! unless `--force`: then the in-flight nonces are kept (only the gaps between them are released)
//! and a live lease is taken over (its holder's next write is fenced).

use std::collections::BTreeMap;

use alloy::primitives::Address;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use futures::StreamExt;
use serde_json::json;
use sqlx::PgPool;
use txflow_allocator::decide::{self, OutOfRange};
use txflow_core::chain::{Chain, ChainError};
use txflow_core::config::Config;
use txflow_core::domain::{ChainId, NodeId, Signer};
use txflow_core::fenced::FenceError;
use txflow_core::lease::{Acquisition, HeldLease, LeaseError, LeaseManager};
use txflow_core::retry::{Classify, Retry};
use txflow_core::role::Role;

use crate::signers_store::{self as store, Filter};

/// The most nonces one reset releases. Each becomes a no-op unless a request takes it; a gap
/// wider than this is more likely a cursor set wrong by hand than nonces lost, and is refused
/// rather than paid for.
pub const MAX_RELEASED: i64 = 1_000;

/// How many signers' chain nonces are asked for at once.
const CHAIN_QUERIES: usize = 8;

#[derive(Args, Debug)]
pub struct SignersArgs {
    #[command(subcommand)]
    action: Option<Action>,
    /// One JSON object per signer and line (stable field names) instead of the table.
    #[arg(long)]
    json: bool,
    /// Only the signers of this chain.
    #[arg(long)]
    chain_id: Option<i64>,
    /// Only this signer (0x-hex).
    #[arg(long)]
    signer: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Action {
    /// Realign the allocator's nonce cursor with the chain and release the nonces between them
    /// that no transaction holds, for the allocator to fill with no-ops. Refused while the
    /// signer has transactions in flight or another node holds its allocator lease, unless
    /// --force.
    ResetNonce(ResetArgs),
}

#[derive(Args, Debug)]
struct ResetArgs {
    /// The signer's chain (the configured RPC endpoints must serve it).
    #[arg(long)]
    chain_id: i64,
    /// The signer (0x-hex).
    #[arg(long)]
    signer: String,
    /// Reset even with transactions in flight (their nonces are kept) and take the allocator
    /// lease over from a live holder (its next write is fenced).
    #[arg(long)]
    force: bool,
}

/// Why `txflow signers` could not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum SignersError {
    #[error("{0:?} is not a signer address (0x and 40 hex digits)")]
    InvalidSigner(String),
    #[error(
        "chain {asked} is not the configured chain {configured}: its nonces cannot be read here \
         (set TXFLOW_CHAIN_ID and TXFLOW_RPC_URLS for chain {asked})"
    )]
    OtherChain { asked: i64, configured: i64 },
    /// The chain error's own message only: the errors under it (the transport's) can carry the
    /// endpoint's URL, API key included, and the binary prints an error's whole chain.
    #[error("{operation}: {error}")]
    Chain {
        operation: &'static str,
        error: ChainError,
    },
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
    #[error(
        "signer {signer} on chain {chain_id} has {count} transaction(s) in flight (allocated, \
         signed or submitted, not mined): wait until they are mined, or pass --force to keep \
         their nonces and release only the gaps around them"
    )]
    InFlight {
        chain_id: i64,
        signer: String,
        count: i64,
    },
    #[error(
        "the allocator lease of signer {signer} on chain {chain_id} is held by node {owner} \
         (fencing token {token}): stop that allocator or wait until its lease lapses (it is \
         renewed only while the signer has work), or pass --force to take it over"
    )]
    LeaseHeld {
        chain_id: i64,
        signer: String,
        owner: String,
        token: String,
    },
    #[error(
        "{gap} nonce(s) lie between the chain's pending nonce {chain} and the cursor {cursor}, \
         more than {MAX_RELEASED} no-ops: check the cursor (signer_nonce_cursor) before paying \
         for them"
    )]
    GapTooLarge { chain: i64, cursor: i64, gap: i64 },
    #[error("the cursor moved to {found} instead of {expected} under the lease: nothing applied")]
    CursorMoved { expected: i64, found: i64 },
    #[error("database error during {operation}")]
    Db {
        operation: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error(transparent)]
    Fence(#[from] FenceError),
}

impl Classify for SignersError {
    fn retry(&self) -> Retry {
        match self {
            SignersError::Chain { error, .. } => error.retry(),
            SignersError::Lease(e) => e.retry(),
            SignersError::Fence(e) => e.retry(),
            // Mined transactions leave the flight, lapsed leases free the signer.
            SignersError::InFlight { .. }
            | SignersError::LeaseHeld { .. }
            | SignersError::CursorMoved { .. }
            | SignersError::Db { .. } => Retry::Transient,
            SignersError::InvalidSigner(_)
            | SignersError::OtherChain { .. }
            | SignersError::OutOfRange(_)
            | SignersError::GapTooLarge { .. } => Retry::Permanent,
        }
    }
}

fn db(operation: &'static str) -> impl FnOnce(sqlx::Error) -> SignersError {
    move |source| SignersError::Db { operation, source }
}

fn parse_signer(s: &str) -> Result<Signer, SignersError> {
    Signer::parse(s).map_err(|_| SignersError::InvalidSigner(s.to_string()))
}

fn address(signer: &Signer) -> Result<Address, SignersError> {
    signer
        .as_str()
        .parse()
        .map_err(|_| SignersError::InvalidSigner(signer.as_str().to_string()))
}

pub async fn run(config: &Config, args: SignersArgs) -> anyhow::Result<()> {
    let pool = txflow_core::db::connect(&config.database_url, 2).await?;
    match args.action {
        Some(Action::ResetNonce(reset)) => {
            // The table's options would be silently ignored: the reset names its signer itself.
            if args.json || args.chain_id.is_some() || args.signer.is_some() {
                anyhow::bail!(
                    "--json, --chain-id and --signer before reset-nonce select the table's \
                     signers; give reset-nonce its own: txflow signers reset-nonce --chain-id C \
                     --signer 0x…"
                );
            }
            let report = reset_nonce(config, &pool, &reset).await?;
            println!("{}", report.render());
        }
        None => {
            let filter = Filter {
                chain_id: args.chain_id,
                signer: args
                    .signer
                    .as_deref()
                    .map(parse_signer)
                    .transpose()?
                    .map(|s| s.as_str().to_string()),
            };
            let statuses = status(config, &pool, &filter).await?;
            if args.json {
                for s in &statuses {
                    println!("{}", s.to_json());
                }
            } else {
                print!("{}", table(&statuses));
            }
        }
    }
    Ok(())
}

// ---- status ----

/// One signer as `txflow signers` shows it.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub chain_id: i64,
    pub signer: String,
    /// The allocator's next nonce (`signer_nonce_cursor.next_nonce`); none before its first
    /// allocation.
    pub cursor: Option<i64>,
    pub cursor_synced_at: Option<DateTime<Utc>>,
    /// The chain's nonces, for the configured chain's signers when the chain answered.
    pub chain_pending: Option<u64>,
    pub chain_latest: Option<u64>,
    pub chain_error: Option<String>,
    pub work: Option<store::WorkRow>,
    pub released: i64,
    pub holds: Vec<store::HoldRow>,
    pub leases: Vec<store::LeaseRow>,
}

impl Status {
    fn in_flight(&self) -> i64 {
        self.work.as_ref().map_or(0, |w| w.in_flight)
    }

    /// The object of `--json`: these names are an interface (scripts and dashboards read them).
    pub fn to_json(&self) -> serde_json::Value {
        let w = self.work.as_ref();
        json!({
            "chain_id": self.chain_id,
            "signer": self.signer,
            "cursor": self.cursor,
            "cursor_synced_at": self.cursor_synced_at,
            "chain_pending_nonce": self.chain_pending,
            "chain_latest_nonce": self.chain_latest,
            "chain_error": self.chain_error,
            "in_flight": self.in_flight(),
            "lowest_in_flight_nonce": w.and_then(|w| w.lowest_in_flight),
            "highest_in_flight_nonce": w.and_then(|w| w.highest_in_flight),
            "oldest_in_flight_age_secs": w.and_then(|w| w.oldest_in_flight_secs),
            "queued": w.map_or(0, |w| w.queued),
            "released_nonces": self.released,
            "held_requests": w.map_or(0, |w| w.held_requests),
            "request_hold_reason": w.and_then(|w| w.request_hold_reason.clone()),
            "holds": self.holds.iter().map(|h| json!({
                "role": h.role,
                "reason": h.reason,
                "since": h.since,
            })).collect::<Vec<_>>(),
            "leases": self.leases.iter().map(|l| json!({
                "role": l.role,
                "owner": l.owner_node,
                "fencing_token": l.fencing_token,
                "expires_at": l.expires_at,
                "live": l.live,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Every signer the filter selects, in (chain, address) order.
pub async fn status(
    config: &Config,
    pool: &PgPool,
    filter: &Filter,
) -> Result<Vec<Status>, SignersError> {
    let mut all: BTreeMap<(i64, String), Status> = store::signers(pool, filter)
        .await
        .map_err(db("list signers"))?
        .into_iter()
        .map(|(chain_id, signer)| {
            let s = Status {
                chain_id,
                signer: signer.clone(),
                ..Status::default()
            };
            ((chain_id, signer), s)
        })
        .collect();
    for c in store::cursors(pool, filter).await.map_err(db("cursors"))? {
        if let Some(s) = all.get_mut(&(c.chain_id, c.signer.clone())) {
            s.cursor = Some(c.next_nonce);
            s.cursor_synced_at = c.synced_at;
        }
    }
    for w in store::work(pool, filter).await.map_err(db("open work"))? {
        if let Some(s) = all.get_mut(&(w.chain_id, w.signer.clone())) {
            s.work = Some(w);
        }
    }
    for (chain_id, signer, n) in store::released(pool, filter)
        .await
        .map_err(db("released nonces"))?
    {
        if let Some(s) = all.get_mut(&(chain_id, signer)) {
            s.released = n;
        }
    }
    for h in store::holds(pool, filter).await.map_err(db("holds"))? {
        if let Some(s) = all.get_mut(&(h.chain_id, h.signer.clone())) {
            s.holds.push(h);
        }
    }
    for l in store::leases(pool, filter).await.map_err(db("leases"))? {
        if let Some(s) = all.get_mut(&(l.chain_id, l.signer.clone())) {
            s.leases.push(l);
        }
    }
    let mut statuses: Vec<Status> = all.into_values().collect();
    chain_nonces(config, &mut statuses).await;
    Ok(statuses)
}

/// Fills the chain's nonces in, for the signers of the configured chain (the others: why not).
async fn chain_nonces(config: &Config, statuses: &mut [Status]) {
    let chain = match config.chain() {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(error = %e, "the chain's nonces are not shown");
            None
        }
    };
    type Answer = (usize, Result<(u64, u64), SignersError>);
    let answers: Vec<Answer> =
        futures::stream::iter(statuses.iter().enumerate().filter_map(|(i, s)| {
            let chain = chain.as_ref()?;
            let ask = async move {
                let answer = async {
                    let a = address(&parse_signer(&s.signer)?)?;
                    nonces(chain, a).await
                };
                (i, answer.await)
            };
            (s.chain_id == config.chain_id).then_some(ask)
        }))
        .buffer_unordered(CHAIN_QUERIES)
        .collect()
        .await;
    for s in statuses.iter_mut() {
        if s.chain_id != config.chain_id {
            s.chain_error = Some(format!(
                "not the configured chain ({}): no RPC endpoint for it",
                config.chain_id
            ));
        } else if chain.is_none() {
            s.chain_error = Some("no usable RPC endpoint configured".into());
        }
    }
    for (i, answer) in answers {
        match answer {
            Ok((pending, latest)) => {
                statuses[i].chain_pending = Some(pending);
                statuses[i].chain_latest = Some(latest);
            }
            Err(e) => statuses[i].chain_error = Some(e.to_string()),
        }
    }
}

/// The chain's `(pending, latest)` nonces of `a`.
async fn nonces(chain: &Chain, a: Address) -> Result<(u64, u64), SignersError> {
    let pending = chain
        .pending_nonce(a)
        .await
        .map_err(|error| SignersError::Chain {
            operation: "pending nonce",
            error,
        })?;
    let latest = chain
        .latest_nonce(a)
        .await
        .map_err(|error| SignersError::Chain {
            operation: "latest nonce",
            error,
        })?;
    Ok((pending, latest))
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// A duration in whole seconds, minutes or hours: what an operator scans for.
fn age(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        _ => format!("{}h", s / 3600),
    }
}

/// The table of `txflow signers`: one line per signer, hold and leases spelled out last.
pub fn table(statuses: &[Status]) -> String {
    let header = [
        "CHAIN",
        "SIGNER",
        "CURSOR",
        "PENDING",
        "LATEST",
        "IN-FLIGHT",
        "OLDEST",
        "QUEUED",
        "RELEASED",
        "LEASES",
        "HOLD",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for s in statuses {
        let w = s.work.as_ref();
        let leases: Vec<String> = s
            .leases
            .iter()
            .map(|l| {
                format!(
                    "{}={}#{}{}",
                    l.role,
                    l.owner_node,
                    l.fencing_token,
                    match (l.live, l.expires_at) {
                        (true, _) => "",
                        (false, Some(_)) => "(lapsed)",
                        (false, None) => "(released)",
                    }
                )
            })
            .collect();
        let mut holds: Vec<String> = s
            .holds
            .iter()
            .map(|h| format!("{}: {}", h.role, h.reason))
            .collect();
        if let Some(w) = w.filter(|w| w.held_requests > 0) {
            holds.push(format!(
                "{} request(s) held: {}",
                w.held_requests,
                w.request_hold_reason.as_deref().unwrap_or("-")
            ));
        }
        let chain = |v: Option<u64>| match (v, &s.chain_error) {
            (Some(v), _) => v.to_string(),
            (None, Some(_)) => "?".to_string(),
            (None, None) => "-".to_string(),
        };
        if let Some(e) = &s.chain_error {
            holds.push(format!("chain: {e}"));
        }
        rows.push(vec![
            s.chain_id.to_string(),
            s.signer.clone(),
            opt(s.cursor),
            chain(s.chain_pending),
            chain(s.chain_latest),
            s.in_flight().to_string(),
            opt(w.and_then(|w| w.oldest_in_flight_secs).map(age)),
            w.map_or(0, |w| w.queued).to_string(),
            s.released.to_string(),
            if leases.is_empty() {
                "-".into()
            } else {
                leases.join(",")
            },
            if holds.is_empty() {
                "-".into()
            } else {
                holds.join("; ")
            },
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, w))| {
                if c == header.len() - 1 {
                    cell.clone()
                } else {
                    format!("{cell:<w$}")
                }
            })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    if statuses.is_empty() {
        out.push_str("(no signer known yet)\n");
    }
    out
}

// ---- reset-nonce ----

/// What a reset does: the cursor it leaves and the nonces it releases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetPlan {
    pub cursor: i64,
    pub release: Vec<i64>,
}

/// The reset of a signer whose chain expects `chain_pending` next, whose cursor is `cursor`
/// (none before its first allocation) and whose transactions occupy `occupied` (ascending, all
/// at or above `chain_pending`): the cursor goes to the highest of the three (past the last
/// occupied nonce; never back), and every nonce from the chain's up to it that nothing occupies
/// is released. More than [`MAX_RELEASED`] is refused.
pub fn plan_reset(
    chain_pending: i64,
    cursor: Option<i64>,
    occupied: &[i64],
) -> Result<ResetPlan, SignersError> {
    let past_occupied = occupied.last().map_or(0, |n| n.saturating_add(1));
    let target = chain_pending.max(cursor.unwrap_or(0)).max(past_occupied);
    let inside = occupied.iter().filter(|n| **n >= chain_pending).count();
    let gap = target - chain_pending - i64::try_from(inside).unwrap_or(i64::MAX);
    if gap > MAX_RELEASED {
        return Err(SignersError::GapTooLarge {
            chain: chain_pending,
            cursor: target,
            gap,
        });
    }
    let release = (chain_pending..target)
        .filter(|n| occupied.binary_search(n).is_err())
        .collect();
    Ok(ResetPlan {
        cursor: target,
        release,
    })
}

/// What `reset-nonce` did.
#[derive(Debug, Clone)]
pub struct ResetReport {
    pub chain_id: i64,
    pub signer: String,
    pub chain_pending: i64,
    pub chain_latest: u64,
    pub cursor_before: Option<i64>,
    pub plan: ResetPlan,
    pub in_flight: i64,
    pub node: String,
    pub token: i64,
}

impl ResetReport {
    pub fn render(&self) -> String {
        let released = match (self.plan.release.first(), self.plan.release.last()) {
            (Some(a), Some(b)) if a == b => format!("released nonce {a}"),
            (Some(a), Some(b)) if b - a + 1 == self.plan.release.len() as i64 => {
                format!("released nonces {a}..={b}")
            }
            (Some(a), Some(b)) => format!(
                "released {} nonce(s) between {a} and {b}",
                self.plan.release.len()
            ),
            _ => "no gap to release".to_string(),
        };
        let after = if self.plan.release.is_empty() {
            String::new()
        } else {
            ": the allocator gives them to the next requests and fills the rest with no-ops"
                .to_string()
        };
        format!(
            "signer {} on chain {}: chain nonce pending {}, latest {}; cursor {} -> {}; {} \
             transaction(s) in flight kept; {released}{after} (allocator lease of node {}, \
             fencing token {})",
            self.signer,
            self.chain_id,
            self.chain_pending,
            self.chain_latest,
            opt(self.cursor_before),
            self.plan.cursor,
            self.in_flight,
            self.node,
            self.token,
        )
    }
}

/// `reset-nonce`: refused early (in flight, another chain, a bad address), then the lease, the
/// chain's nonces and the fenced reset; the lease is given back whatever the outcome.
async fn reset_nonce(
    config: &Config,
    pool: &PgPool,
    args: &ResetArgs,
) -> Result<ResetReport, SignersError> {
    let signer = parse_signer(&args.signer)?;
    if args.chain_id != config.chain_id {
        return Err(SignersError::OtherChain {
            asked: args.chain_id,
            configured: config.chain_id,
        });
    }
    let in_flight = |count| SignersError::InFlight {
        chain_id: args.chain_id,
        signer: signer.as_str().to_string(),
        count,
    };
    // Refused early, before any lease is taken (checked again under it).
    let count = store::in_flight(pool, args.chain_id, signer.as_str())
        .await
        .map_err(db("count in flight"))?;
    if count > 0 && !args.force {
        return Err(in_flight(count));
    }
    let chain = config.chain().map_err(|error| SignersError::Chain {
        operation: "connect",
        error,
    })?;
    let address = address(&signer)?;
    let leases = LeaseManager::new(
        pool.clone(),
        Role::Allocator,
        NodeId::generate_named("signers-reset-nonce"),
        config.lease(),
    )?;
    let lease = take_lease(&leases, pool, ChainId(args.chain_id), &signer, args.force).await?;
    // The chain's nonces once no allocator can send for the signer (under the lease), and outside
    // the database transaction, like every external call.
    let applied = async {
        let (pending, latest) = nonces(&chain, address).await?;
        let pending = decide::chain_nonce(pending).map_err(SignersError::from)?;
        let done = reset_under(&lease, pool, pending, args.force).await?;
        Ok::<_, ResetError>((pending, latest, done))
    }
    .await;
    // Given back at once whatever happened, so that the allocator can go on.
    if let Err(e) = leases.release(&lease).await {
        tracing::warn!(error = %e, "could not release the allocator lease; it lapses by itself");
    }
    let (pending, latest, (cursor_before, plan, in_flight_kept)) =
        applied.map_err(|e| match e {
            ResetError::InFlight(n) => in_flight(n),
            ResetError::Other(e) => e,
        })?;
    tracing::warn!(
        target: "txflow::ops",
        event = "nonce_reset",
        chain_id = args.chain_id,
        signer = %signer,
        chain_pending = pending,
        cursor_before = ?cursor_before,
        cursor = plan.cursor,
        released = plan.release.len(),
        in_flight = in_flight_kept,
        node = %lease.node(),
        fencing_token = lease.token().0,
        "nonce cursor reset by an operator"
    );
    Ok(ResetReport {
        chain_id: args.chain_id,
        signer: signer.as_str().to_string(),
        chain_pending: pending,
        chain_latest: latest,
        cursor_before,
        plan,
        in_flight: in_flight_kept,
        node: lease.node().as_str().to_string(),
        token: lease.token().0,
    })
}

/// The allocator's lease for the signer; a live one of another node only with `force`, taken
/// over (see [`store::revoke_lease`]).
async fn take_lease(
    leases: &LeaseManager,
    pool: &PgPool,
    chain_id: ChainId,
    signer: &Signer,
    force: bool,
) -> Result<HeldLease, SignersError> {
    let busy = |owner: Option<String>, token: Option<i64>| SignersError::LeaseHeld {
        chain_id: chain_id.0,
        signer: signer.as_str().to_string(),
        owner: owner.unwrap_or_else(|| "another node".into()),
        token: opt(token),
    };
    let (owner, token) = match leases.acquire(chain_id, signer).await? {
        Acquisition::Held(lease, _) => return Ok(lease),
        Acquisition::Busy { owner, token, .. } => (owner, token.map(|t| t.0)),
    };
    let (Some(holder), Some(t), true) = (owner.as_deref(), token, force) else {
        return Err(busy(owner, token));
    };
    store::revoke_lease(
        pool,
        Role::Allocator.as_str(),
        chain_id.0,
        signer.as_str(),
        holder,
        t,
    )
    .await
    .map_err(db("take the lease over"))?;
    match leases.acquire(chain_id, signer).await? {
        Acquisition::Held(lease, _) => {
            tracing::warn!(
                target: "txflow::ops",
                event = "lease_taken_over",
                chain_id = chain_id.0,
                signer = %signer,
                from = holder,
                from_token = t,
                fencing_token = lease.token().0,
                "allocator lease taken over by --force"
            );
            Ok(lease)
        }
        Acquisition::Busy { owner, token, .. } => Err(busy(owner, token.map(|t| t.0))),
    }
}

/// Why the fenced part of a reset did not apply.
enum ResetError {
    /// Transactions in flight, found under the lease (no `--force`).
    InFlight(i64),
    Other(SignersError),
}

impl From<SignersError> for ResetError {
    fn from(e: SignersError) -> Self {
        ResetError::Other(e)
    }
}

impl From<FenceError> for ResetError {
    fn from(e: FenceError) -> Self {
        ResetError::Other(e.into())
    }
}

/// The reset in one fenced transaction: read the cursor and the occupied nonces, plan, align
/// the cursor (`Fenced::align_cursor`, which also drops released nonces the chain consumed) and
/// release the gaps (`Fenced::release_nonce`). Returns the cursor before, the plan and how many
/// transactions were in flight.
async fn reset_under(
    lease: &HeldLease,
    pool: &PgPool,
    chain_pending: i64,
    force: bool,
) -> Result<(Option<i64>, ResetPlan, i64), ResetError> {
    let mut tx = lease.begin(pool).await?;
    let before = tx.cursor().await?.map(|(next, _)| next);
    let (in_flight, occupied) = store::occupied(&mut tx.writer(), chain_pending).await?;
    if in_flight > 0 && !force {
        tx.rollback().await?;
        return Err(ResetError::InFlight(in_flight));
    }
    let plan = match plan_reset(chain_pending, before, &occupied) {
        Ok(plan) => plan,
        Err(e) => {
            tx.rollback().await?;
            return Err(e.into());
        }
    };
    let cursor = tx.align_cursor(plan.cursor).await?;
    if cursor != plan.cursor {
        tx.rollback().await?;
        return Err(SignersError::CursorMoved {
            expected: plan.cursor,
            found: cursor,
        }
        .into());
    }
    for nonce in &plan.release {
        tx.release_nonce(*nonce).await?;
    }
    tx.commit().await?;
    Ok((before, plan, in_flight))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_ahead_of_the_chain_keeps_its_place_and_releases_the_gap() {
        let plan = plan_reset(3, Some(6), &[]).expect("plan");
        assert_eq!(
            plan,
            ResetPlan {
                cursor: 6,
                release: vec![3, 4, 5]
            }
        );
    }

    #[test]
    fn a_cursor_behind_the_chain_moves_up_to_it_and_releases_nothing() {
        let plan = plan_reset(9, Some(4), &[]).expect("plan");
        assert_eq!(
            plan,
            ResetPlan {
                cursor: 9,
                release: vec![]
            }
        );
        let fresh = plan_reset(2, None, &[]).expect("plan");
        assert_eq!(
            fresh.cursor, 2,
            "a signer without a cursor starts at the chain's"
        );
    }

    #[test]
    fn occupied_nonces_are_kept_and_only_the_holes_between_them_are_released() {
        let plan = plan_reset(3, Some(8), &[4, 6]).expect("plan");
        assert_eq!(plan.cursor, 8);
        assert_eq!(plan.release, vec![3, 5, 7]);
    }

    #[test]
    fn the_cursor_moves_past_an_occupied_nonce_above_it() {
        let plan = plan_reset(3, Some(4), &[5]).expect("plan");
        assert_eq!(
            plan,
            ResetPlan {
                cursor: 6,
                release: vec![3, 4]
            }
        );
    }

    #[test]
    fn a_gap_wider_than_the_limit_is_refused() {
        let wide = plan_reset(0, Some(MAX_RELEASED + 1), &[]);
        assert!(
            matches!(wide, Err(SignersError::GapTooLarge { gap, .. }) if gap == MAX_RELEASED + 1)
        );
        let at_limit = plan_reset(0, Some(MAX_RELEASED), &[]).expect("at the limit");
        assert_eq!(at_limit.release.len() as i64, MAX_RELEASED);
        // Occupied nonces do not count against the limit.
        let occupied: Vec<i64> = (0..10).collect();
        assert!(plan_reset(0, Some(MAX_RELEASED + 10), &occupied).is_ok());
    }

    #[test]
    fn refusals_say_whether_waiting_helps() {
        let in_flight = SignersError::InFlight {
            chain_id: 1,
            signer: "0x00".into(),
            count: 2,
        };
        assert!(in_flight.is_transient());
        assert!(!SignersError::InvalidSigner("x".into()).is_transient());
        let gap = SignersError::GapTooLarge {
            chain: 0,
            cursor: 5000,
            gap: 5000,
        };
        assert!(!gap.is_transient());
    }

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(5.4), "5s");
        assert_eq!(age(600.0), "10m");
        assert_eq!(age(10_000.0), "2h");
        assert_eq!(age(-1.0), "0s");
    }
}
