//! The broker restarted mid-run (issue 6): tansu's memory engine comes back without a single
//! topic or message, so every event in flight is gone. Every request that had reached RECEIVED in
//! PostgreSQL still ends with exactly one mined transaction, re-driven from PostgreSQL by the
//! stages' recovery scans. The stages run as `txflow` processes under a supervisor that restarts
//! them if they die (librdkafka may crash on the metadata of a broker that came back empty,
//! librdkafka issue #5280). Checked on the chain, by marker.

mod common;

use std::time::Duration;

use common::Supervised;
use txflow_core::kafka::ensure_topics;
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{OwnBroker, wait_until};

const LONG: Duration = Duration::from_secs(300);

#[tokio::test]
async fn every_received_request_mines_once_after_the_broker_lost_every_topic() {
    let mut broker = OwnBroker::spawn().await;
    let settings = broker.settings();
    let mut p = Pipeline::prepare(2, |c| c.kafka = settings).await;
    let env = p.env();
    let mut signer_env = env.clone();
    signer_env.push(p.signer_keys_env());
    let allocator = Supervised::start("allocator", env.clone(), &[]);
    let signer = Supervised::start("signer-gateway", signer_env, &[]);

    let ids: Vec<String> = (0..100).map(|i| format!("b-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        p.send(&p.request(i % 2, id)).await;
    }
    wait_until("every request is RECEIVED", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx").await == ids.len() as i64
    })
    .await;
    p.close_producer();
    let states: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM managed_tx GROUP BY state ORDER BY state")
            .fetch_all(&p.db.pool)
            .await
            .expect("states");
    broker.restart(true).await;
    // The deployment creates the topics again (what `txflow up` does on start).
    let config = p.config.clone();
    ensure_topics(&config.kafka, &config.topics.all(), config.partitions)
        .await
        .expect("topics again");
    // The broadcaster starts only now: every TxSigned produced before the restart is gone, so
    // nothing reaches the chain unless it is re-driven from PostgreSQL.
    let broadcaster = Supervised::start("broadcaster", env, &[]);

    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= ids.len() as u64
    })
    .await;
    let mut deaths = Vec::new();
    for s in [allocator, signer, broadcaster] {
        let role = s.role;
        deaths.push((role, s.finish().await));
    }
    eprintln!("states when the broker lost every topic: {states:?}\nstage deaths: {deaths:?}");
    let markers = p.mined_markers().await;
    for id in &ids {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{id} has exactly one mined transaction"
        );
    }
    assert_eq!(markers.len(), ids.len(), "nothing else was mined");
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string())
    );
    p.stop().await;
}
