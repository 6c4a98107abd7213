//! Plans of the batch writes (issue 15). The fenced, set-based statements of `txstore` join
//! `unnest`ed arrays to `managed_tx`. sqlx prepares every statement, and PostgreSQL may plan a
//! prepared statement once for any parameters (a generic plan), assuming 10 elements for every
//! array and the table as it was then. For one hot signer such a plan once joined each row of a
//! 500-row move to a rescan of the whole array and read the signer's history through its request
//! index (`txflow bench --scenario allocate` fell from 5,771 to 2,278 nonces/s over three runs of
//! 20,000), and a plan made on the empty table scanned all of it for every row later.
//!
//! Now a batch transaction (`BatchTx`, where the allocator's `create` runs) plans every execution
//! for its own batch, and a fenced transaction (a drive, where the moves run) uses generic plans
//! made once, whose statements are written to have one good shape whatever the table
//! (`fenced::BEGIN_FENCED`). Asserted from the plans `auto_explain` reports for each execution
//! on one connection, from a table that starts empty, never from timings: `create`, the sixth and
//! later executions too, was planned with its real number of rows; the drive's move was planned
//! once, generically, and reaches `managed_tx` by primary key only; and no node over a batch's
//! array ran more than once (the quadratic shape).

use txflow_tests::notices::Notices;

use serde_json::{Value, json};
use sqlx::Executor;
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::time::Duration;

use txflow_core::domain::{ChainId, NodeId, Role, Signer};
use txflow_core::fenced::BatchTx;
use txflow_core::lease::{Acquisition, LeaseConfig, LeaseManager};
use txflow_core::state::SIMULATE;
use txflow_core::txstore::{self, Audit, Kind, MoveRow, NewTx};
use txflow_tests::TestDb;
use uuid::Uuid;

/// Rows per batch: far from the 10 elements a generic plan assumes.
const BATCH: usize = 120;
/// Batches on one connection: past the fifth execution, where a generic plan may start.
const BATCHES: usize = 8;

/// `(query text, plan)` of an `auto_explain` notice in JSON (`duration: … ms  plan:\n{json}`).
fn explained(notice: &str) -> Option<(String, Value)> {
    let json: Value = serde_json::from_str(&notice[notice.find('{')?..]).ok()?;
    Some((
        json["Query Text"].as_str().unwrap_or_default().to_string(),
        json["Plan"].clone(),
    ))
}

/// Every node of a plan, depth first.
fn nodes(plan: &Value) -> Vec<&Value> {
    let mut out = vec![plan];
    if let Some(children) = plan["Plans"].as_array() {
        for c in children {
            out.extend(nodes(c));
        }
    }
    out
}

/// A pool of one connection on which `auto_explain` reports every statement's executed plan as a
/// NOTICE (`LOAD` needs a superuser: the harness connects as one).
async fn explaining_pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(
                    "LOAD 'auto_explain';
                     SET auto_explain.log_min_duration = 0;
                     SET auto_explain.log_analyze = on;
                     SET auto_explain.log_timing = off;
                     SET auto_explain.log_format = 'json';
                     SET auto_explain.log_level = 'notice';
                     SET client_min_messages = 'notice';",
                )
                .await?;
                // The settings of a stage process's connections (generic plans, no
                // sequential scans), so that the plans read are the ones production runs.
                conn.execute(txflow_core::db::STAGE_SESSION.as_str())
                    .await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .expect("a connection with auto_explain")
}

#[tokio::test]
async fn batch_writes_keep_one_good_plan_shape_from_an_empty_table_on() {
    use tracing_subscriber::layer::SubscriberExt;
    let notices = Notices::default();
    // This thread's only: the test runs on a current-thread runtime.
    let _subscriber =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(notices.clone()));
    let db = TestDb::new().await;
    let pool = explaining_pool(&db.url).await;
    let signer = Signer::parse("0x00000000000000000000000000000000000000b1").expect("signer");
    let leases = LeaseManager::new(
        db.pool.clone(),
        Role::Allocator,
        NodeId::generate(),
        LeaseConfig::default(),
    )
    .expect("lease manager");
    let lease = match leases
        .acquire(ChainId(31337), &signer)
        .await
        .expect("acquire")
    {
        Acquisition::Held(l, _) => l,
        busy => panic!("the lease is not free: {busy:?}"),
    };

    for b in 0..BATCHES {
        let rows: Vec<NewTx> = (0..BATCH)
            .map(|i| NewTx {
                tx_id: Uuid::now_v7(),
                request_id: format!("plan-{b}-{i}"),
                kind: Kind::Request,
                nonce: None,
                payload: json!({"to": "0x70997970c51812dc3a010c7d01b50e0d17dc79c8", "value": "0", "data": "0x"}),
                audit: Audit {
                    event_id: Uuid::new_v4(),
                    event_type: "TxAccepted",
                    payload: json!({}),
                },
            })
            .collect();
        // As the allocator records a batch: a batch transaction, a savepoint for the signer.
        let mut batch = BatchTx::begin(&pool, Duration::from_secs(30))
            .await
            .expect("begin batch");
        let mut scope = batch.signer(&lease).await.expect("signer scope");
        let created = txstore::create(&mut scope.writer(), &rows)
            .await
            .expect("create");
        scope.keep().await.expect("keep");
        batch.commit().await.expect("commit batch");
        assert_eq!(created.len(), BATCH);
        let moves: Vec<MoveRow> = created
            .iter()
            .map(|id| MoveRow::new(*id, Uuid::new_v4(), json!({})))
            .collect();
        // As a drive moves them: a fenced transaction.
        let mut tx = lease.begin(&pool).await.expect("begin");
        let landed = txstore::apply_all(&mut tx.writer(), SIMULATE, &moves)
            .await
            .expect("simulate");
        tx.commit().await.expect("commit");
        assert_eq!(landed.len(), BATCH);
    }

    let plans: Vec<(String, Value)> = notices.take().iter().filter_map(|n| explained(n)).collect();
    // (what, the statement's marker, the rows a plan of it assumes for the array)
    for (what, marker, planned_rows) in [
        // Custom plans: each for its own batch.
        ("create", "INSERT INTO managed_tx", BATCH as u64),
        // A generic plan: 10 elements, whatever the batch.
        ("apply", "UPDATE managed_tx m SET", 10),
    ] {
        let executions: Vec<&Value> = plans
            .iter()
            .filter(|(q, _)| q.contains(marker))
            .map(|(_, p)| p)
            .collect();
        assert_eq!(executions.len(), BATCHES, "{what}: one plan per batch");
        for (n, plan) in executions.iter().enumerate() {
            let arrays: Vec<&Value> = nodes(plan)
                .into_iter()
                .filter(|node| node["Node Type"] == "Function Scan" && node["Alias"] == "u")
                .collect();
            assert!(
                !arrays.is_empty(),
                "{what} #{}: no array `u` in {plan}",
                n + 1
            );
            for a in arrays {
                assert_eq!(
                    a["Plan Rows"].as_u64(),
                    Some(planned_rows),
                    "{what} execution #{} was not planned for {planned_rows} rows: {plan}",
                    n + 1
                );
            }
            if what == "apply" {
                // The rows are found by primary key from the array, whatever the plan assumed:
                // never a scan of the table, never the signer's rows through another index.
                for node in nodes(plan) {
                    if node["Relation Name"] == "managed_tx" && node["Node Type"] != "ModifyTable" {
                        assert!(
                            node["Node Type"] == "Index Scan"
                                && node["Index Name"] == "managed_tx_pkey",
                            "apply execution #{} reads managed_tx other than by primary key: {node}",
                            n + 1
                        );
                    }
                }
            }
            // The batch's array is read once, never once per joined row.
            for node in nodes(plan) {
                let over_array = (node["Node Type"] == "Function Scan" && node["Alias"] == "u")
                    || (node["Node Type"] == "CTE Scan" && node["CTE Name"] == "u");
                assert!(
                    !over_array || node["Actual Loops"].as_u64() == Some(1),
                    "{what} execution #{} rescans the batch: {node}",
                    n + 1
                );
            }
        }
    }
}
