//! Recovery scans and table size (issue 15): every query a stage runs periodically — the recovery
//! scan's pending signers, the reads of a drive, the outbox relay — costs the same with a table
//! full of final rows (CONFIRMED, FAILED, REVERTED settled) as with none, because it reads a
//! partial index of the transactions still in flight (migration 0010 and those before it).
//!
//! The test writes a handful of live rows (work for every stage), runs each periodic query
//! through its store function — the real SQL, so that a changed query is checked as it now is —
//! on a connection with a stage process's settings (`db::STAGE_SESSION`: generic plans, made
//! without the parameters' values; sequential scans off) where `auto_explain` reports the
//! executed plan of every statement (ANALYZE, BUFFERS, JSON) as a NOTICE, then loads [`FINAL_ROWS`] final rows over 1,000 signers (the live
//! signers among them) with their published `tx_events` and their attempts, and runs the same
//! again. Each query runs [`CALLS`] times on one connection: the generic plan made at the first
//! execution, on tables with no final rows, is the one checked after the load too unless the
//! statistics changed. Asserted from the plans, never from timings: no sequential scan of
//! `managed_tx`, `tx_events` or `tx_attempts`; the buffers a call touches stay within a few of
//! what it touched with no final rows (a b-tree a level or two deeper on a key lookup), far below
//! the table's size; no statement JIT-compiled or run by parallel workers, even with both made
//! free (`jit_above_cost`, `parallel_setup_cost` 0: a generic plan's estimate grows with the
//! table, and at 1,000,000 final rows two scans got a parallel, JIT-compiled plan, ~28 ms per
//! call for 2 to 25 buffers); the results are the live rows, before and after. The timings are
//! printed (`--no-capture`) for docs/performance.md.
//!
//! `TXFLOW_SCANS_FINAL_ROWS` overrides the number of final rows (ARCHITECTURE.md's figures are
//! from 1,000,000).

use std::collections::BTreeSet;
use std::time::Instant;
use txflow_tests::notices::Notices;

use serde_json::Value;
use sqlx::Executor;
use sqlx::postgres::{PgPool, PgPoolOptions};
use txflow_core::domain::{ChainId, Role, Signer};
use txflow_core::lease::LeaseKey;
use txflow_core::outbox;
use txflow_core::state::TxState;
use txflow_tests::TestDb;
use uuid::Uuid;

/// Final rows loaded by default: enough that a query reading a signer's history or a chain's
/// index reads hundreds of pages, loaded in 10-15 s on a 2-core machine (1,000,000: about 60 s).
const FINAL_ROWS: i64 = 200_000;
/// How many signers the final rows are spread over (the live ones among them).
const SIGNERS: i64 = 1_000;
/// Calls of each query on one connection: the sixth execution of a prepared statement may use a
/// generic plan.
const CALLS: usize = 6;
/// Buffers a call may touch beyond what it touched with no final rows: a key lookup in a b-tree
/// that grew a level or two, a few times per call. A query that reads a signer's history or the
/// chain's final rows touches hundreds.
const SLACK: i64 = 24;
/// Buffers no periodic call may exceed, whatever it touched before.
const BOUND: i64 = 150;

const CHAIN: i64 = 31337;

/// The signer with this number, as the final rows are spread (`i % SIGNERS + 1`).
fn signer(n: i64) -> String {
    format!("0x{n:040x}")
}

fn key(role: Role, n: i64) -> LeaseKey {
    LeaseKey {
        role,
        chain_id: ChainId(CHAIN),
        signer: Signer::parse(&signer(n)).expect("a signer address"),
    }
}

// The live signers, one per kind of work (all of them also have final rows).
const ALLOCATOR: i64 = 1;
const GATEWAY: i64 = 2;
const BROADCASTER: i64 = 3;
const CONFIRMING: i64 = 4;
const PARENTS: i64 = 5;
const RECYCLED: i64 = 6;
const UNDONE: i64 = 7;
const CANCELLING: i64 = 8;

/// Live nonces start here, above every final row's (`i / SIGNERS`).
const LIVE_NONCE: i64 = 5_000_000;

/// The live rows: work for every stage.
struct Live {
    received: Uuid,
    chained: Uuid,
    held: Uuid,
    parent: Uuid,
    simulated: Uuid,
    replaced: Uuid,
    allocated: Uuid,
    signed: Uuid,
    submitted: Uuid,
    mined: Uuid,
    undone: Uuid,
    cancelled: Uuid,
    unpublished: Uuid,
    approval: Uuid,
}

async fn insert_tx(
    pool: &PgPool,
    n: i64,
    request_id: &str,
    state: TxState,
    nonce: Option<i64>,
) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state, fencing_token)
         VALUES ($1, $2, $3, $4, $5, '{}'::jsonb, $6, 1)",
    )
    .bind(id)
    .bind(CHAIN)
    .bind(signer(n))
    .bind(request_id)
    .bind(nonce)
    .bind(state.as_str())
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("insert {request_id}: {e}"));
    id
}

async fn exec(pool: &PgPool, sql: &str, id: Uuid) {
    sqlx::query(sql)
        .bind(id)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Attempt 1 of `id`, due for resubmission when `due`.
async fn attempt(pool: &PgPool, id: Uuid, due: bool) {
    sqlx::query(
        "INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas,
                                  max_priority_fee_per_gas, submitted_at, next_resubmit_at)
         VALUES ($1, 1, $2, '\\x02'::bytea, 2000000000, 1000000000, now(),
                 CASE WHEN $3 THEN now() - interval '1 minute' END)",
    )
    .bind(id)
    .bind(format!("0x{}{}", id.simple(), id.simple()))
    .bind(due)
    .execute(pool)
    .await
    .expect("attempt");
}

async fn live_rows(pool: &PgPool) -> Live {
    use TxState::*;
    // The allocator's: requests to simulate (one plain, one held alone, one chained to a
    // confirmed parent), to allocate, awaiting approval, the signer held; a released nonce of
    // another signer.
    let received = insert_tx(pool, ALLOCATOR, "live-received", Received, None).await;
    let parent = insert_tx(pool, PARENTS, "live-parent", Confirmed, Some(LIVE_NONCE)).await;
    exec(
        pool,
        "UPDATE managed_tx SET receipt = '{}'::jsonb, mined_block_number = 1,
                mined_block_hash = '0x' || repeat('0', 64), confirmed_at = now()
         WHERE tx_id = $1",
        parent,
    )
    .await;
    let chained = insert_tx(pool, ALLOCATOR, "live-child", Received, None).await;
    // The parent is another signer's: named with its signer.
    exec(
        pool,
        &format!(
            "UPDATE managed_tx SET depends_on_request_id = 'live-parent',
                    depends_on_signer = '{}' WHERE tx_id = $1",
            signer(PARENTS)
        ),
        chained,
    )
    .await;
    let held = insert_tx(pool, ALLOCATOR, "live-held", Received, None).await;
    exec(
        pool,
        "UPDATE managed_tx SET hold_reason = 'insufficient funds', held_since = now(),
                hold_attempts = 1, hold_retry_at = now() + interval '1 hour'
         WHERE tx_id = $1",
        held,
    )
    .await;
    let simulated = insert_tx(pool, ALLOCATOR, "live-simulated", Simulated, None).await;
    let replaced = insert_tx(pool, ALLOCATOR, "live-replaced", Replaced, None).await;
    // Waiting for approval for an hour: past the approval timeout the probes use.
    let approval = insert_tx(pool, ALLOCATOR, "live-approval", PendingApproval, None).await;
    exec(
        pool,
        "UPDATE managed_tx SET updated_at = now() - interval '1 hour' WHERE tx_id = $1",
        approval,
    )
    .await;
    sqlx::query("INSERT INTO recycled_nonces (chain_id, signer, nonce) VALUES ($1, $2, 3)")
        .bind(CHAIN)
        .bind(signer(RECYCLED))
        .execute(pool)
        .await
        .expect("recycled nonce");
    // The allocator holds the signer whose requests it simulates (it could pay for none).
    sqlx::query(
        "INSERT INTO signer_holds (role, chain_id, signer, reason) VALUES ('allocator', $1, $2, 'insufficient funds')",
    )
    .bind(CHAIN)
    .bind(signer(ALLOCATOR))
    .execute(pool)
    .await
    .expect("signer hold");

    // The signer gateway's: a transaction to sign, its TxAllocated left unpublished (the outbox).
    let allocated = insert_tx(pool, GATEWAY, "live-allocated", Allocated, Some(LIVE_NONCE)).await;
    let unpublished = Uuid::new_v4();
    sqlx::query(
        "WITH e AS (INSERT INTO tx_events (event_id, tx_id, type, payload, created_at)
                    VALUES ($1, $2, 'TxAllocated', '{}'::jsonb, now() - interval '1 hour'))
         INSERT INTO tx_outbox (event_id, tx_id, chain_id, signer, type, created_at)
         VALUES ($1, $2, $3, $4, 'TxAllocated', now() - interval '1 hour')",
    )
    .bind(unpublished)
    .bind(allocated)
    .bind(CHAIN)
    .bind(signer(GATEWAY))
    .execute(pool)
    .await
    .expect("unpublished event");

    // The broadcaster's and the receipt checker's: one to send, one sent whose resubmission and
    // receipt lookup are due.
    let signed = insert_tx(
        pool,
        BROADCASTER,
        "live-signed",
        Signed,
        Some(LIVE_NONCE + 1),
    )
    .await;
    attempt(pool, signed, false).await;
    let submitted = insert_tx(
        pool,
        BROADCASTER,
        "live-submitted",
        Submitted,
        Some(LIVE_NONCE),
    )
    .await;
    attempt(pool, submitted, true).await;

    // The confirmation manager's: one mined, not final yet.
    let mined = insert_tx(pool, CONFIRMING, "live-mined", Mined, Some(LIVE_NONCE)).await;
    exec(
        pool,
        "UPDATE managed_tx SET receipt = '{}'::jsonb, mined_block_number = 1,
                mined_block_hash = '0x' || repeat('1', 64)
         WHERE tx_id = $1",
        mined,
    )
    .await;
    attempt(pool, mined, false).await;

    // Undone by a deep reorg: one without its defensive cancellation (the signer gateway signs
    // it), one with it due (the broadcaster sends it); both re-evaluated by the confirmation
    // manager.
    let undone = insert_tx(pool, UNDONE, "live-undone", Confirmed, Some(LIVE_NONCE)).await;
    let cancelled = insert_tx(
        pool,
        CANCELLING,
        "live-cancelled",
        Confirmed,
        Some(LIVE_NONCE),
    )
    .await;
    for id in [undone, cancelled] {
        exec(
            pool,
            "UPDATE managed_tx SET confirmed_at = now(), reorged_at = now(), reorg_generation = 1
             WHERE tx_id = $1",
            id,
        )
        .await;
        attempt(pool, id, false).await;
    }
    sqlx::query(
        "INSERT INTO tx_cancellations (chain_id, signer, nonce, tx_id, reorg_generation, tx_hash,
                                       raw_tx, max_fee_per_gas, max_priority_fee_per_gas, fencing_token)
         VALUES ($1, $2, $3, $4, 1, '0x' || repeat('c', 64), '\\x02'::bytea, 4, 2, 1)",
    )
    .bind(CHAIN)
    .bind(signer(CANCELLING))
    .bind(LIVE_NONCE)
    .bind(cancelled)
    .execute(pool)
    .await
    .expect("cancellation");

    Live {
        received,
        chained,
        held,
        parent,
        simulated,
        replaced,
        allocated,
        signed,
        submitted,
        mined,
        undone,
        cancelled,
        unpublished,
        approval,
    }
}

/// Loads `n` final rows in three set-based statements: spread over [`SIGNERS`] signers
/// (`i % SIGNERS + 1`, nonce `i / SIGNERS`), 90% CONFIRMED, 9% FAILED (no nonce), 1% REVERTED and
/// settled, each with two published `tx_events` rows and, when mined, its attempt; time-ordered
/// ids, as `Uuid::now_v7` makes them. Then VACUUM ANALYZE, as autovacuum leaves a table.
async fn load_final_rows(pool: &PgPool, n: i64) {
    let statements = [
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, kind, nonce, payload, state,
                                 failure_code, failure_reason, receipt, mined_block_number,
                                 mined_block_hash, required_confirmations, fencing_token,
                                 confirmed_at, created_at, updated_at)
         SELECT lpad(to_hex(i), 32, '0')::uuid, $2, '0x' || lpad(to_hex(i % $3 + 1), 40, '0'),
                'final-' || i, 'REQUEST', CASE WHEN s <> 'FAILED' THEN i / $3 END,
                '{\"to\": \"0x000000000000000000000000000000000000dead\", \"value\": \"1000000000000000\",
                  \"data\": \"0x\", \"gas_limit\": 21000, \"max_fee_per_gas\": \"2000000000\",
                  \"max_priority_fee_per_gas\": \"1000000000\"}'::jsonb,
                s, CASE WHEN s = 'FAILED' THEN 'SIMULATION_REVERTED' END,
                CASE WHEN s = 'FAILED' THEN 'execution reverted' END,
                CASE WHEN s <> 'FAILED' THEN jsonb_build_object('attempt', 1, 'status', 1) END,
                CASE WHEN s <> 'FAILED' THEN i / $3 + 1 END,
                CASE WHEN s <> 'FAILED' THEN '0x' || lpad(to_hex(i), 64, '0') END,
                12, 1, CASE WHEN s <> 'FAILED' THEN now() END,
                now() - ($1 - i) * interval '1 second', now() - ($1 - i) * interval '1 second'
         FROM generate_series(1, $1) AS i,
              LATERAL (SELECT CASE WHEN i % 100 < 9 THEN 'FAILED'
                                   WHEN i % 100 = 9 THEN 'REVERTED'
                                   ELSE 'CONFIRMED' END AS s) st",
        "INSERT INTO tx_events (event_id, tx_id, type, payload, created_at)
         SELECT lpad(to_hex(2 * substr(m.request_id, 7)::bigint + k), 32, '0')::uuid, m.tx_id,
                CASE WHEN k = 0 THEN 'TxAccepted' WHEN m.state = 'FAILED' THEN 'TxFailed'
                     ELSE 'TxConfirmed' END,
                '{\"fencing_token\": 1, \"chain_id\": 31337}'::jsonb, m.created_at
         FROM managed_tx m, generate_series(0, 1) AS k
         WHERE m.request_id LIKE 'final-%'",
        "INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas,
                                  max_priority_fee_per_gas, created_at, submitted_at, last_submit_at)
         SELECT tx_id, 1, mined_block_hash, decode(repeat('ab', 110), 'hex'), 2000000000,
                1000000000, created_at, created_at, created_at
         FROM managed_tx WHERE request_id LIKE 'final-%' AND state <> 'FAILED'",
    ];
    for (k, sql) in statements.into_iter().enumerate() {
        let mut q = sqlx::query(sql);
        if k == 0 {
            q = q.bind(n).bind(CHAIN).bind(SIGNERS);
        }
        q.execute(pool)
            .await
            .unwrap_or_else(|e| panic!("load final rows ({k}): {e}"));
    }
    analyze(pool).await;
}

async fn analyze(pool: &PgPool) {
    pool.execute("VACUUM (ANALYZE) managed_tx, tx_events, tx_attempts, tx_cancellations")
        .await
        .expect("vacuum analyze");
}

/// One executed statement, as `auto_explain` reported it.
#[derive(Debug, Clone)]
struct Explained {
    ms: f64,
    query: String,
    plan: Value,
    /// The statement was JIT-compiled (`auto_explain` reports a `JIT` section).
    jit: bool,
}

impl Explained {
    /// `duration: 0.166 ms  plan:\n{json}`.
    fn parse(notice: &str) -> Option<Explained> {
        let ms = notice
            .strip_prefix("duration: ")?
            .split_once(" ms")?
            .0
            .parse()
            .ok()?;
        let json: Value = serde_json::from_str(&notice[notice.find('{')?..]).ok()?;
        Some(Explained {
            ms,
            query: json["Query Text"].as_str().unwrap_or_default().to_string(),
            plan: json["Plan"].clone(),
            jit: json.get("JIT").is_some(),
        })
    }

    /// Shared buffers hit and read by the whole statement (a node's counts include its
    /// children's, subplans' and CTEs').
    fn buffers(&self) -> i64 {
        let n = |k: &str| self.plan[k].as_i64().unwrap_or(0);
        n("Shared Hit Blocks") + n("Shared Read Blocks")
    }

    /// Every node as `Node Type on relation using index`.
    fn nodes(&self) -> Vec<String> {
        fn walk(p: &Value, out: &mut Vec<String>) {
            let mut s = p["Node Type"].as_str().unwrap_or("?").to_string();
            if let Some(r) = p["Relation Name"].as_str() {
                s += &format!(" on {r}");
            }
            if let Some(i) = p["Index Name"].as_str() {
                s += &format!(" using {i}");
            }
            out.push(s);
            if let Some(children) = p["Plans"].as_array() {
                for c in children {
                    walk(c, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.plan, &mut out);
        out
    }
}

/// One periodic query, called [`CALLS`] times: its result (as comparable text) and the
/// statements each call executed.
struct Probe {
    name: String,
    result: Vec<String>,
    calls: Vec<Vec<Explained>>,
}

impl Probe {
    /// The most buffers one call touched.
    fn buffers(&self) -> i64 {
        self.calls
            .iter()
            .map(|c| c.iter().map(Explained::buffers).sum())
            .max()
            .unwrap_or(0)
    }

    /// The last call's execution time (its statements', summed).
    fn ms(&self) -> f64 {
        self.calls
            .last()
            .map(|c| c.iter().map(|e| e.ms).sum())
            .unwrap_or(0.0)
    }

    fn seq_scans(&self, tables: &[&str]) -> Vec<String> {
        let mut found = Vec::new();
        for e in self.calls.iter().flatten() {
            for n in e.nodes() {
                if tables.iter().any(|t| n == format!("Seq Scan on {t}")) {
                    found.push(format!("{n} in {}", e.query.trim()));
                }
            }
        }
        found
    }

    /// The indexes the last call read.
    fn indexes(&self) -> BTreeSet<String> {
        self.calls
            .last()
            .into_iter()
            .flatten()
            .flat_map(|e| e.nodes())
            .filter_map(|n| n.split_once(" using ").map(|(_, i)| i.to_string()))
            .collect()
    }
}

fn signers(v: Vec<(ChainId, Signer)>) -> Vec<String> {
    let mut s: Vec<String> = v.iter().map(|(c, s)| format!("{}:{s}", c.0)).collect();
    s.sort();
    s
}

fn ids(v: impl IntoIterator<Item = Uuid>) -> Vec<String> {
    let mut s: Vec<String> = v.into_iter().map(|u| u.to_string()).collect();
    s.sort();
    s
}

/// Calls `$call` [`CALLS`] times, each call's plans captured, and records the last result as
/// `$show` writes it.
macro_rules! probe {
    ($out:ident, $notices:expr, $name:expr, $call:expr, $show:expr) => {{
        let mut calls = Vec::new();
        let mut result = Vec::new();
        for _ in 0..CALLS {
            $notices.take();
            let r = $call.await.unwrap_or_else(|e| panic!("{}: {e}", $name));
            calls.push(
                $notices
                    .take()
                    .iter()
                    .filter_map(|n| Explained::parse(n))
                    .collect(),
            );
            result = $show(r);
        }
        $out.push(Probe {
            name: $name.to_string(),
            result,
            calls,
        });
    }};
}

/// Every periodic read of every stage, through its store function.
async fn probes(pool: &PgPool, notices: &Notices) -> Vec<Probe> {
    use txflow_allocator::store as allocator;
    use txflow_broadcaster::store as broadcaster;
    use txflow_confirmation_manager::store as confirmations;
    use txflow_receipt_checker::store as receipts;
    use txflow_signer_gateway::store as gateway;
    let chain = ChainId(CHAIN);
    let mut out = Vec::new();

    // Recovery scans: each stage's pending signers, and the outbox relay's.
    probe!(
        out,
        notices,
        "allocator pending_signers",
        allocator::pending_signers(pool, chain),
        signers
    );
    probe!(
        out,
        notices,
        "signer gateway pending_signers",
        gateway::pending_signers(pool, chain),
        signers
    );
    probe!(
        out,
        notices,
        "broadcaster pending_signers",
        broadcaster::pending_signers(pool, chain),
        signers
    );
    probe!(
        out,
        notices,
        "receipt checker pending_signers",
        receipts::pending_signers(pool, chain),
        signers
    );
    probe!(
        out,
        notices,
        "confirmation manager pending_signers",
        confirmations::pending_signers(pool, chain),
        signers
    );
    for role in Role::PIPELINE {
        probe!(
            out,
            notices,
            format!("outbox signers_with_unpublished ({role})"),
            outbox::signers_with_unpublished(pool, outbox::relayed_by(role)),
            signers
        );
    }

    // What each drive reads for its signer.
    let a = key(Role::Allocator, ALLOCATOR);
    probe!(
        out,
        notices,
        "outbox unpublished",
        outbox::unpublished(
            pool,
            &key(Role::Allocator, GATEWAY),
            outbox::relayed_by(Role::Allocator)
        ),
        |r: Vec<outbox::Unpublished>| ids(r.iter().map(|u| u.event_id))
    );
    probe!(
        out,
        notices,
        "allocator received",
        allocator::received(pool, &a),
        |r: Vec<allocator::ReceivedRow>| ids(r.iter().map(|t| t.row.tx_id))
    );
    probe!(
        out,
        notices,
        "allocator received, held and chained",
        allocator::received(pool, &a),
        |r: Vec<allocator::ReceivedRow>| {
            let mut v: Vec<String> = r
                .iter()
                .filter(|t| t.hold.is_some() || t.chained)
                .map(|t| {
                    format!(
                        "{} held={} chained={}",
                        t.row.tx_id,
                        t.hold.is_some(),
                        t.chained
                    )
                })
                .collect();
            v.sort();
            v
        }
    );
    probe!(
        out,
        notices,
        "allocator parents",
        allocator::parents(pool, &a),
        |r: Vec<allocator::ParentRow>| r
            .iter()
            .map(|p| format!("{} <- {:?}", p.child, p.tx_id))
            .collect::<Vec<_>>()
    );
    probe!(
        out,
        notices,
        "allocator rows_limited SIMULATED, REPLACED",
        allocator::rows_limited(
            pool,
            &a,
            &[TxState::Simulated, TxState::Replaced],
            txflow_allocator::decide::MAX_ALLOCATIONS_PER_DRIVE
        ),
        |r: Vec<txflow_core::txstore::TxRow>| ids(r.iter().map(|t| t.tx_id))
    );
    // The drive's snapshot, of the signers with something for each of its answers.
    let snapshot = |s: allocator::DriveSnapshot| {
        vec![format!(
            "in_flight={} waiting={} replaced={} released={} held={}",
            s.in_flight, s.waiting, s.replaced, s.released, s.held
        )]
    };
    let timeout = std::time::Duration::from_secs(60);
    probe!(
        out,
        notices,
        "allocator drive_snapshot (allocator's signer)",
        allocator::drive_snapshot(pool, &a, timeout),
        snapshot
    );
    probe!(
        out,
        notices,
        "allocator drive_snapshot (broadcaster's signer)",
        allocator::drive_snapshot(pool, &key(Role::Allocator, BROADCASTER), timeout),
        snapshot
    );
    probe!(
        out,
        notices,
        "allocator drive_snapshot (released nonce)",
        allocator::drive_snapshot(pool, &key(Role::Allocator, RECYCLED), timeout),
        snapshot
    );
    probe!(
        out,
        notices,
        "allocator expired_approvals",
        allocator::expired_approvals(pool, &a, std::time::Duration::from_secs(1)),
        ids
    );
    probe!(
        out,
        notices,
        "allocator signers_with_expired_approvals",
        allocator::signers_with_expired_approvals(pool, chain, std::time::Duration::from_secs(1)),
        signers
    );
    probe!(
        out,
        notices,
        "allocator ready_signers",
        allocator::ready_signers(pool, chain, 64),
        signers
    );
    probe!(
        out,
        notices,
        "allocator released_nonces",
        allocator::released_nonces(pool, &key(Role::Allocator, RECYCLED)),
        |r: i64| vec![r.to_string()]
    );
    let g = key(Role::SignerGateway, GATEWAY);
    probe!(
        out,
        notices,
        "signer gateway allocated",
        gateway::allocated(pool, &g),
        |r: Vec<txflow_core::txstore::TxRow>| ids(r.iter().map(|t| t.tx_id))
    );
    probe!(
        out,
        notices,
        "signer gateway undone",
        gateway::undone(pool, &key(Role::SignerGateway, UNDONE)),
        |r: Vec<gateway::UndoneRow>| ids(r.iter().map(|u| u.tx_id))
    );
    probe!(
        out,
        notices,
        "signer gateway bump_candidates",
        gateway::bump_candidates(pool, &key(Role::SignerGateway, BROADCASTER)),
        |r: Vec<gateway::BumpRow>| ids(r.iter().map(|b| b.tx_id))
    );
    let b = key(Role::Broadcaster, BROADCASTER);
    probe!(
        out,
        notices,
        "broadcaster signed_rows",
        broadcaster::signed_rows(pool, &b),
        |r: Vec<broadcaster::SignedRow>| ids(r.iter().map(|s| s.tx_id))
    );
    probe!(
        out,
        notices,
        "broadcaster due_resubmissions",
        broadcaster::due_resubmissions(pool, &b),
        |r: Vec<broadcaster::DueRow>| ids(r.iter().map(|s| s.tx_id))
    );
    probe!(
        out,
        notices,
        "broadcaster due_cancellations",
        broadcaster::due_cancellations(pool, &key(Role::Broadcaster, CANCELLING)),
        |r: Vec<broadcaster::DueCancellation>| ids(r.iter().map(|c| c.tx_id))
    );
    probe!(
        out,
        notices,
        "receipt checker due",
        receipts::due(pool, &key(Role::ReceiptChecker, BROADCASTER)),
        |r: Vec<receipts::DueRow>| ids(r.iter().map(|d| d.tx_id))
    );
    let c = key(Role::ConfirmationManager, CONFIRMING);
    probe!(
        out,
        notices,
        "confirmation manager followed",
        confirmations::followed(pool, &c),
        |r: Vec<confirmations::Followed>| {
            let mut v: Vec<String> = r
                .iter()
                .map(|f| format!("{} lowest_unmined={:?}", f.tx_id, f.lowest_unmined))
                .collect();
            v.sort();
            v
        }
    );
    out
}

/// What each probe must answer: the live rows only.
fn expected(live: &Live) -> Vec<(String, Vec<String>)> {
    let s = |ns: &[i64]| {
        let mut v: Vec<String> = ns
            .iter()
            .map(|n| format!("{CHAIN}:{}", signer(*n)))
            .collect();
        v.sort();
        v
    };
    let unpublished = Role::PIPELINE.map(|role| {
        // The allocator relays TxAllocated.
        let relaying: &[i64] = if role == Role::Allocator {
            &[GATEWAY]
        } else {
            &[]
        };
        (
            format!("outbox signers_with_unpublished ({role})"),
            s(relaying),
        )
    });
    let pending = [
        ("allocator pending_signers", s(&[ALLOCATOR, RECYCLED])),
        (
            "signer gateway pending_signers",
            s(&[GATEWAY, UNDONE, BROADCASTER]),
        ),
        ("broadcaster pending_signers", s(&[BROADCASTER, CANCELLING])),
        ("receipt checker pending_signers", s(&[BROADCASTER])),
        (
            "confirmation manager pending_signers",
            s(&[CONFIRMING, UNDONE, CANCELLING]),
        ),
    ];
    let drives = [
        ("outbox unpublished", ids([live.unpublished])),
        (
            "allocator received",
            ids([live.received, live.chained, live.held]),
        ),
        ("allocator received, held and chained", {
            let mut v = vec![
                format!("{} held=true chained=false", live.held),
                format!("{} held=false chained=true", live.chained),
            ];
            v.sort();
            v
        }),
        (
            "allocator parents",
            vec![format!("{} <- {:?}", live.chained, Some(live.parent))],
        ),
        (
            "allocator rows_limited SIMULATED, REPLACED",
            ids([live.simulated, live.replaced]),
        ),
        (
            "allocator drive_snapshot (allocator's signer)",
            vec!["in_flight=0 waiting=true replaced=true released=0 held=true".to_string()],
        ),
        // The broadcaster's signer: one SIGNED, one SUBMITTED.
        (
            "allocator drive_snapshot (broadcaster's signer)",
            vec!["in_flight=2 waiting=false replaced=false released=0 held=false".to_string()],
        ),
        (
            "allocator drive_snapshot (released nonce)",
            vec!["in_flight=0 waiting=false replaced=false released=1 held=false".to_string()],
        ),
        ("allocator expired_approvals", ids([live.approval])),
        ("allocator signers_with_expired_approvals", s(&[ALLOCATOR])),
        ("allocator ready_signers", s(&[ALLOCATOR])),
        ("allocator released_nonces", vec!["1".to_string()]),
        ("signer gateway allocated", ids([live.allocated])),
        ("signer gateway undone", ids([live.undone])),
        ("signer gateway bump_candidates", ids([live.submitted])),
        ("broadcaster signed_rows", ids([live.signed])),
        ("broadcaster due_resubmissions", ids([live.submitted])),
        ("broadcaster due_cancellations", ids([live.cancelled])),
        ("receipt checker due", ids([live.submitted])),
        // Its signer has nothing unmined: the lowest unmined nonce read with the rows is none.
        (
            "confirmation manager followed",
            vec![format!("{} lowest_unmined=None", live.mined)],
        ),
    ];
    let named = |(n, v): (&str, Vec<String>)| (n.to_string(), v);
    pending
        .into_iter()
        .map(named)
        .chain(unpublished)
        .chain(drives.into_iter().map(named))
        .collect()
}

/// A pool of one connection on which `auto_explain` reports every statement's executed plan as
/// a NOTICE (`LOAD` needs a superuser: the harness connects as one).
async fn explaining_pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(
                    "LOAD 'auto_explain';
                     SET auto_explain.log_min_duration = 0;
                     SET auto_explain.log_analyze = on;
                     SET auto_explain.log_buffers = on;
                     SET auto_explain.log_format = 'json';
                     SET auto_explain.log_level = 'notice';
                     SET client_min_messages = 'notice';",
                )
                .await?;
                // Every statement costly enough for JIT compilation and parallel workers
                // cheap, unless the session turns both off: a generic plan's estimate grows
                // with the table (at 1,000,000 final rows the followed-rows scans got a
                // parallel plan, JIT-compiled: ~28 ms a call for 2 to 25 buffers), so a
                // stage's statements must never be compiled or run in parallel.
                conn.execute(
                    "SET jit_above_cost = 0;
                     SET parallel_setup_cost = 0;
                     SET parallel_tuple_cost = 0;
                     SET min_parallel_table_scan_size = 0;
                     SET min_parallel_index_scan_size = 0;",
                )
                .await?;
                // The settings of a stage process's connections (generic plans, no
                // sequential scans, no JIT, no parallel workers), so that the plans read are
                // the ones production runs.
                conn.execute(txflow_core::db::STAGE_SESSION.as_str())
                    .await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .expect("a connection with auto_explain")
}

async fn size_pages(pool: &PgPool, relation: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT pg_relation_size($1::regclass) / current_setting('block_size')::bigint",
    )
    .bind(relation)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("size of {relation}: {e}"))
}

#[tokio::test]
async fn periodic_queries_read_no_more_with_many_final_rows_than_with_none() {
    use tracing_subscriber::layer::SubscriberExt;
    let notices = Notices::default();
    // This thread's only: the test runs on a current-thread runtime.
    let _subscriber =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(notices.clone()));
    let final_rows: i64 = std::env::var("TXFLOW_SCANS_FINAL_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(FINAL_ROWS);

    let db = TestDb::new().await;
    let live = live_rows(&db.pool).await;
    analyze(&db.pool).await;
    let pool = explaining_pool(&db.url).await;
    let before = probes(&pool, &notices).await;

    let started = Instant::now();
    load_final_rows(&db.pool, final_rows).await;
    let load = started.elapsed();
    let after = probes(&pool, &notices).await;

    // The answers: the live rows only, with or without the final rows.
    let want = expected(&live);
    assert_eq!(before.len(), want.len());
    for ((b, a), (name, w)) in before.iter().zip(&after).zip(&want) {
        assert_eq!(&b.name, name);
        assert_eq!(&b.result, w, "{name}, before the final rows");
        assert_eq!(&a.result, w, "{name}, with {final_rows} final rows");
    }

    let table = size_pages(&db.pool, "managed_tx").await;
    let events = size_pages(&db.pool, "tx_events").await;
    eprintln!(
        "{final_rows} final rows loaded in {:.1} s (with VACUUM ANALYZE); managed_tx {table} pages, \
         tx_events {events} pages, managed_tx_open_idx {} pages, managed_tx_pkey {} pages",
        load.as_secs_f64(),
        size_pages(&db.pool, "managed_tx_open_idx").await,
        size_pages(&db.pool, "managed_tx_pkey").await,
    );
    eprintln!(
        "| query | ms, no final rows | ms, {final_rows} final rows | buffers, none | buffers, {final_rows} | indexes |"
    );
    eprintln!("|---|---|---|---|---|---|");
    let mut failures = Vec::new();
    for (b, a) in before.iter().zip(&after) {
        eprintln!(
            "| {} | {:.3} | {:.3} | {} | {} | {} |",
            a.name,
            b.ms(),
            a.ms(),
            b.buffers(),
            a.buffers(),
            a.indexes().into_iter().collect::<Vec<_>>().join(", ")
        );
        if a.calls.iter().any(|c| c.is_empty()) {
            failures.push(format!("{}: no plan reported (auto_explain)", a.name));
        }
        for s in a.seq_scans(&["managed_tx", "tx_events", "tx_attempts"]) {
            failures.push(format!("{}: {s}", a.name));
        }
        for e in b.calls.iter().chain(&a.calls).flatten() {
            if e.jit {
                failures.push(format!("{}: JIT-compiled: {}", a.name, e.query.trim()));
            }
            if e.nodes().iter().any(|n| n.starts_with("Gather")) {
                failures.push(format!("{}: parallel workers: {}", a.name, e.query.trim()));
            }
        }
        if a.buffers() > b.buffers() + SLACK || a.buffers() > BOUND {
            failures.push(format!(
                "{}: {} buffers with {final_rows} final rows, {} with none (table: {table} pages): {:#?}",
                a.name,
                a.buffers(),
                b.buffers(),
                a.calls.last().map(|c| c.iter().map(|e| (e.query.clone(), e.nodes())).collect::<Vec<_>>())
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    pool.close().await;
}
