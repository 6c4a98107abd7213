//! Plans of the batch writes (issue 15, one hot signer). The fenced, set-based statements of
//! `txstore` join `unnest`ed arrays to `managed_tx`. sqlx prepares every statement, and from the
//! sixth execution PostgreSQL may use a generic plan, which assumes 10 elements for every array
//! whatever the batch and keeps the statistics of the moment: for one hot signer it joined each
//! row of a 500-row move to a rescan of the whole array and read the signer's history through its
//! request index (`txflow bench --scenario allocate` fell from 5,771 to 2,278 nonces/s over three
//! runs of 20,000). So every fenced transaction runs with `plan_cache_mode = force_custom_plan`
//! (`FencedTx::begin`, `BatchTx::begin`), and every execution is planned for its own batch.
//!
//! Asserted from the plans `auto_explain` reports for each execution on one connection, never
//! from timings: each of the batch moves, the sixth and later ones too, was planned with its real
//! number of rows, and no node over the batch's array ran more than once (the quadratic shape).

use txflow_tests::notices::Notices;

use serde_json::{Value, json};
use sqlx::Executor;
use sqlx::postgres::{PgPool, PgPoolOptions};
use txflow_core::domain::{ChainId, NodeId, Role, Signer};
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
                Ok(())
            })
        })
        .connect(url)
        .await
        .expect("a connection with auto_explain")
}

#[tokio::test]
async fn every_batch_move_is_planned_for_its_own_batch() {
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
        let mut tx = lease.begin(&pool).await.expect("begin");
        let created = txstore::create(&mut tx.writer(), &rows)
            .await
            .expect("create");
        tx.commit().await.expect("commit");
        assert_eq!(created.len(), BATCH);
        let moves: Vec<MoveRow> = created
            .iter()
            .map(|id| MoveRow::new(*id, Uuid::new_v4(), json!({})))
            .collect();
        let mut tx = lease.begin(&pool).await.expect("begin");
        let landed = txstore::apply_all(&mut tx.writer(), SIMULATE, &moves)
            .await
            .expect("simulate");
        tx.commit().await.expect("commit");
        assert_eq!(landed.len(), BATCH);
    }

    let plans: Vec<(String, Value)> = notices.take().iter().filter_map(|n| explained(n)).collect();
    for (what, marker) in [
        ("create", "INSERT INTO managed_tx"),
        ("apply", "UPDATE managed_tx m SET"),
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
                // Planned for the batch it carries: a generic plan says 10.
                assert_eq!(
                    a["Plan Rows"].as_u64(),
                    Some(BATCH as u64),
                    "{what} execution #{} was not planned for its {BATCH} rows: {plan}",
                    n + 1
                );
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
