//! Request to chain: allocator → signer gateway → broadcaster on the stage runtime, against real
//! PostgreSQL, broker, Schema Registry and an anvil of the test's own. Outcomes are checked where
//! they are true: on the chain (one mined transaction per request marker), in PostgreSQL, on the
//! topics.

use std::collections::BTreeMap;
use std::time::Duration;

use alloy::consensus::Transaction as _;
use alloy::eips::BlockNumberOrTag;
use alloy::primitives::{Address, U256};
use alloy::providers::ext::AnvilApi;
use alloy::providers::{Provider, ProviderBuilder};
use alloy::signers::local::PrivateKeySigner;
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::message::Headers;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::domain::NodeId;
use txflow_core::events::TxRequest;
use txflow_core::kafka::{Topics, ensure_topics, signer_key};
use txflow_core::lease::LeaseConfig;
use txflow_signer_gateway::Keys;
use txflow_tests::{
    AnvilNode, TestDb, group_consumer, kafka_settings, producer, registry_url, unique, wait_until,
};

const LONG: Duration = Duration::from_secs(180);
const SINK: &str = "0x000000000000000000000000000000000000dead";

/// The pipeline's three stages running in this process against a chain of the test's own.
struct Pipeline {
    anvil: AnvilNode,
    db: TestDb,
    config: Config,
    signers: Vec<PrivateKeySigner>,
    codec: RegistryCodec,
    producer: FutureProducer,
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Pipeline {
    async fn start(signers: usize) -> Pipeline {
        Pipeline::start_with(signers, |_| {}).await
    }

    async fn start_with(signers: usize, customize: impl FnOnce(&mut Config)) -> Pipeline {
        let anvil = AnvilNode::spawn().await;
        let db = TestDb::new().await;
        let mut config = Config {
            database_url: db.url.clone(),
            kafka: kafka_settings(),
            schema_registry_url: registry_url().to_string(),
            topics: Topics::new(unique("pipe")),
            partitions: 4,
            rpc_urls: vec![anvil.url.clone()],
            ..Config::default()
        };
        customize(&mut config);
        ensure_topics(&config.kafka, &config.topics.all(), config.partitions)
            .await
            .expect("topics");

        let provider = ProviderBuilder::new().connect_http(anvil.url.parse().expect("url"));
        let keys: Vec<PrivateKeySigner> =
            (0..signers).map(|_| PrivateKeySigner::random()).collect();
        for k in &keys {
            provider
                .anvil_set_balance(k.address(), U256::from(10u128.pow(21)))
                .await
                .expect("fund");
        }
        let lease = LeaseConfig::default();
        let shutdown = CancellationToken::new();
        let mut tasks = Vec::new();
        let (a, c) = txflow_allocator::runtimes(&config, NodeId::named("alloc-1"), lease)
            .await
            .expect("allocator");
        let s = txflow_signer_gateway::runtime(
            &config,
            Keys::from_signers(keys.clone()),
            NodeId::named("sign-1"),
            lease,
        )
        .await
        .expect("signer gateway");
        let b = txflow_broadcaster::runtime(&config, NodeId::named("bcast-1"), lease)
            .await
            .expect("broadcaster");
        let (t1, t2, t3, t4) = (
            shutdown.clone(),
            shutdown.clone(),
            shutdown.clone(),
            shutdown.clone(),
        );
        tasks.push(tokio::spawn(async move {
            c.run(t4).await.expect("allocator commands run")
        }));
        tasks.push(tokio::spawn(async move {
            a.run(t1).await.expect("allocator runs")
        }));
        tasks.push(tokio::spawn(async move {
            s.run(t2).await.expect("signer gateway runs")
        }));
        tasks.push(tokio::spawn(async move {
            b.run(t3).await.expect("broadcaster runs")
        }));
        Pipeline {
            producer: producer(&config.kafka),
            codec: RegistryCodec::new(registry_url()),
            anvil,
            db,
            config,
            signers: keys,
            shutdown,
            tasks,
        }
    }

    fn signer(&self, i: usize) -> String {
        format!("{:#x}", self.signers[i].address())
    }

    fn request(&self, signer: usize, request_id: &str) -> TxRequest {
        TxRequest {
            event_id: uuid::Uuid::new_v4().to_string(),
            request_id: request_id.to_string(),
            chain_id: 31337,
            signer: self.signer(signer),
            to: SINK.into(),
            value: "1".into(),
            data: marker(request_id),
            gas_limit: None,
            max_fee_per_gas: None,
            max_priority_fee_per_gas: None,
            metadata: Default::default(),
        }
    }

    async fn send(&self, r: &TxRequest) {
        let topic = self.config.topics.tx_requests();
        let bytes = self
            .codec
            .encode(&topic, Subjects::TopicName, r)
            .await
            .expect("encode");
        self.send_raw(&signer_key(r.chain_id, &r.signer), &bytes)
            .await;
    }

    async fn send_raw(&self, key: &str, bytes: &[u8]) {
        let topic = self.config.topics.tx_requests();
        self.producer
            .send(
                FutureRecord::to(&topic).key(key).payload(bytes),
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
    }

    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.db.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Mined transactions from our signers, per calldata marker.
    async fn mined_markers(&self) -> BTreeMap<String, usize> {
        let provider = ProviderBuilder::new().connect_http(self.anvil.url.parse().expect("url"));
        let ours: Vec<Address> = self.signers.iter().map(|s| s.address()).collect();
        let latest = provider.get_block_number().await.expect("block number");
        let mut markers = BTreeMap::new();
        for n in 0..=latest {
            let block = provider
                .get_block_by_number(BlockNumberOrTag::Number(n))
                .full()
                .await
                .expect("block")
                .expect("block exists");
            for tx in block.transactions.into_transactions() {
                if ours.contains(&tx.inner.signer()) {
                    let m = String::from_utf8_lossy(tx.input()).into_owned();
                    *markers.entry(m).or_insert(0) += 1;
                }
            }
        }
        markers
    }

    async fn mined_count(&self) -> u64 {
        let provider = ProviderBuilder::new().connect_http(self.anvil.url.parse().expect("url"));
        let mut n = 0;
        for s in &self.signers {
            n += provider
                .get_transaction_count(s.address())
                .latest()
                .await
                .expect("nonce");
        }
        n
    }

    async fn stop(self) {
        self.shutdown.cancel();
        for t in self.tasks {
            let _ = tokio::time::timeout(LONG, t).await;
        }
    }
}

fn marker(request_id: &str) -> Vec<u8> {
    format!("txflow:{request_id}").into_bytes()
}

#[tokio::test]
async fn a_thousand_requests_of_one_signer_become_a_thousand_mined_transactions() {
    let p = Pipeline::start(1).await;
    let n = 1000;
    let requests: Vec<TxRequest> = (0..n).map(|i| p.request(0, &format!("r-{i}"))).collect();
    for chunk in requests.chunks(100) {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
    }
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= n as u64
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.len(), n, "one mined transaction per request marker");
    assert!(markers.values().all(|c| *c == 1), "no marker mined twice");
    for r in &requests {
        assert_eq!(
            markers.get(&format!("txflow:{}", r.request_id)),
            Some(&1),
            "{}",
            r.request_id
        );
    }
    let distinct: i64 = p
        .count("SELECT count(DISTINCT (signer, nonce)) FROM managed_tx WHERE nonce IS NOT NULL")
        .await;
    assert_eq!(distinct, n as i64, "(signer, nonce) unique in PostgreSQL");
    let provider = ProviderBuilder::new().connect_http(p.anvil.url.parse().expect("url"));
    let pool: serde_json::Value = provider
        .raw_request("txpool_status".into(), ())
        .await
        .expect("txpool_status");
    assert_eq!(
        pool["pending"], "0x0",
        "nothing left pending in anvil's pool: {pool}"
    );
    assert_eq!(
        pool["queued"], "0x0",
        "nothing left queued in anvil's pool: {pool}"
    );
    p.stop().await;
}

#[tokio::test]
async fn the_same_request_sent_a_hundred_times_at_once_is_one_transaction() {
    let p = Pipeline::start(1).await;
    let r = p.request(0, "dup-1");
    futures::future::join_all((0..100).map(|_| p.send(&r))).await;
    let after = p.request(0, "after-dup");
    p.send(&after).await;
    wait_until("both distinct requests are mined", LONG, || async {
        p.mined_count().await >= 2
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:dup-1"), Some(&1), "{markers:?}");
    assert_eq!(markers.get("txflow:after-dup"), Some(&1), "{markers:?}");
    assert_eq!(markers.len(), 2);
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx").await,
        2,
        "one managed transaction per request id"
    );
    p.stop().await;
}

#[tokio::test]
async fn bad_requests_are_dead_lettered_with_their_reason_and_nothing_else_is_affected() {
    let p = Pipeline::start(1).await;
    let key = signer_key(31337, &p.signer(0));
    p.send_raw(&key, b"\x00\x00\x00\x00\x01garbage").await;
    let mut bad_address = p.request(0, "bad-to");
    bad_address.to = "0x1234".into();
    let mut negative = p.request(0, "negative");
    negative.value = "-5".into();
    let topic = p.config.topics.tx_requests();
    for r in [&bad_address, &negative] {
        let bytes = p
            .codec
            .encode(&topic, Subjects::TopicName, r)
            .await
            .expect("encode");
        p.send_raw(&key, &bytes).await;
    }
    p.send(&p.request(0, "fine")).await;
    wait_until("the valid request is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;

    let dlq = group_consumer(&p.config.kafka, &unique("dlq"));
    dlq.subscribe(&[&p.config.topics.dlq()]).expect("subscribe");
    let dead = txflow_tests::collect(&dlq, 3, LONG).await;
    let codes: Vec<String> = dead
        .iter()
        .map(|m| {
            m.headers()
                .and_then(|h| {
                    h.iter()
                        .find(|x| x.key == "error.code")
                        .and_then(|x| x.value)
                })
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(codes, ["UNDECODABLE", "INVALID_TO", "INVALID_VALUE"]);
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx").await,
        1,
        "only the valid request is recorded"
    );
    assert_eq!(
        p.mined_markers().await.keys().collect::<Vec<_>>(),
        ["txflow:fine"]
    );
    p.stop().await;
}

/// Deploys a contract whose code always reverts (PUSH1 0 PUSH1 0 REVERT) and returns its address.
async fn deploy_reverter(anvil: &AnvilNode) -> Address {
    use alloy::network::TransactionBuilder;
    let provider = ProviderBuilder::new().connect_http(anvil.url.parse().expect("url"));
    let accounts = provider.get_accounts().await.expect("anvil's dev accounts");
    let init = hex::decode("6460006000fd6000526005601bf3").expect("hex");
    let tx = alloy::rpc::types::TransactionRequest::default()
        .from(accounts[0])
        .with_deploy_code(init);
    let receipt = provider
        .send_transaction(tx)
        .await
        .expect("deploy")
        .get_receipt()
        .await
        .expect("receipt");
    receipt.contract_address.expect("a contract was created")
}

#[tokio::test]
async fn a_reverting_call_fails_with_its_reason_holds_no_nonce_and_later_requests_mine() {
    let p = Pipeline::start(1).await;
    let reverter = deploy_reverter(&p.anvil).await;
    let mut bad = p.request(0, "reverts");
    bad.to = format!("{reverter:#x}");
    p.send(&bad).await;
    for i in 0..3 {
        p.send(&p.request(0, &format!("after-{i}"))).await;
    }
    wait_until("the later requests are mined", LONG, || async {
        p.mined_count().await >= 3
    })
    .await;
    let (state, code, reason, nonce): (String, Option<String>, Option<String>, Option<i64>) = sqlx::query_as(
        "SELECT state, failure_code, failure_reason, nonce FROM managed_tx WHERE request_id = 'reverts'",
    )
    .fetch_one(&p.db.pool)
    .await
    .expect("row");
    assert_eq!(state, "FAILED");
    assert_eq!(code.as_deref(), Some("SIMULATION_REVERTED"));
    assert!(
        reason.unwrap_or_default().contains("revert"),
        "the node's revert reason is kept"
    );
    assert_eq!(nonce, None, "a failed simulation never holds a nonce");
    let markers = p.mined_markers().await;
    assert!(!markers.contains_key("txflow:reverts"));
    assert_eq!(markers.len(), 3);
    let nonces: Vec<i64> =
        sqlx::query_scalar("SELECT nonce FROM managed_tx WHERE nonce IS NOT NULL ORDER BY nonce")
            .fetch_all(&p.db.pool)
            .await
            .expect("nonces");
    assert_eq!(nonces, vec![0, 1, 2], "no gap where the failed request was");

    // The failure is announced on the outcomes topic.
    let c = group_consumer(&p.config.kafka, &unique("outcomes"));
    c.subscribe(&[&p.config.topics.tx_outcomes()])
        .expect("subscribe");
    let mut failed = None;
    let deadline = tokio::time::Instant::now() + LONG;
    while failed.is_none() {
        let m = tokio::time::timeout_at(deadline, c.recv())
            .await
            .expect("an outcome in time")
            .expect("consume");
        if let Ok(f) = p
            .codec
            .decode::<txflow_core::events::TxFailed>(m.payload().expect("payload"))
            .await
        {
            failed = Some(f);
        }
    }
    let failed = failed.expect("TxFailed");
    assert_eq!(
        (failed.request_id.as_str(), failed.code.as_str()),
        ("reverts", "SIMULATION_REVERTED")
    );
    p.stop().await;
}

async fn state_of(p: &Pipeline, request_id: &str) -> Option<(String, String)> {
    sqlx::query_as("SELECT state, tx_id::text FROM managed_tx WHERE request_id = $1")
        .bind(request_id)
        .fetch_optional(&p.db.pool)
        .await
        .expect("query")
}

async fn command(p: &Pipeline, tx_id: &str, kind: txflow_core::events::TxCommandKind) {
    let c = txflow_core::events::TxCommand {
        event_id: uuid::Uuid::new_v4().to_string(),
        tx_id: tx_id.to_string(),
        chain_id: 31337,
        signer: p.signer(0),
        command: kind,
        requested_by: "ops@example.com".into(),
        reason: None,
    };
    let topic = p.config.topics.tx_commands();
    let bytes = p
        .codec
        .encode(&topic, Subjects::TopicName, &c)
        .await
        .expect("encode");
    p.producer
        .send(
            FutureRecord::to(&topic)
                .key(&signer_key(31337, &p.signer(0)))
                .payload(&bytes),
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
}

#[tokio::test]
async fn above_the_threshold_a_request_waits_for_approval_without_blocking_later_ones() {
    use txflow_core::events::TxCommandKind;
    let p =
        Pipeline::start_with(1, |c| c.policy_approval_threshold_wei = Some("1000".into())).await;
    let mut big = p.request(0, "big");
    big.value = "5000".into();
    p.send(&big).await;
    let mut other_big = p.request(0, "big-cancelled");
    other_big.value = "7000".into();
    p.send(&other_big).await;
    for i in 0..3 {
        p.send(&p.request(0, &format!("small-{i}"))).await;
    }
    wait_until(
        "the small requests mine while the big ones wait",
        LONG,
        || async { p.mined_count().await >= 3 },
    )
    .await;
    let (state, big_id) = state_of(&p, "big").await.expect("big is recorded");
    assert_eq!(state, "PENDING_APPROVAL");
    let (state, cancelled_id) = state_of(&p, "big-cancelled").await.expect("recorded");
    assert_eq!(state, "PENDING_APPROVAL");
    assert_eq!(
        p.count(
            "SELECT count(*) FROM managed_tx WHERE state = 'PENDING_APPROVAL' AND nonce IS NOT NULL"
        )
        .await,
        0,
        "a waiting request holds no nonce"
    );

    command(&p, &big_id, TxCommandKind::Approve).await;
    command(&p, &cancelled_id, TxCommandKind::Cancel).await;
    wait_until("the approved request is mined", LONG, || async {
        p.mined_count().await >= 4
    })
    .await;
    wait_until("the cancelled request is failed", LONG, || async {
        state_of(&p, "big-cancelled")
            .await
            .is_some_and(|(s, _)| s == "FAILED")
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:big"), Some(&1));
    assert!(!markers.contains_key("txflow:big-cancelled"));
    let code: Option<String> = sqlx::query_scalar(
        "SELECT failure_code FROM managed_tx WHERE request_id = 'big-cancelled'",
    )
    .fetch_one(&p.db.pool)
    .await
    .expect("code");
    assert_eq!(code.as_deref(), Some("CANCELLED"));
    p.stop().await;
}

#[tokio::test]
async fn policy_refuses_destinations_off_the_whitelist_and_values_above_the_limit() {
    let p = Pipeline::start_with(1, |c| {
        c.policy_whitelist = vec![SINK.into()];
        c.policy_max_value_wei = Some("100".into());
    })
    .await;
    let mut elsewhere = p.request(0, "elsewhere");
    elsewhere.to = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into();
    p.send(&elsewhere).await;
    let mut too_much = p.request(0, "too-much");
    too_much.value = "101".into();
    p.send(&too_much).await;
    p.send(&p.request(0, "fine")).await;
    wait_until("the allowed request is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;
    wait_until("both refused requests are failed", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED' AND failure_code = 'POLICY_DENIED' AND nonce IS NULL").await == 2
    })
    .await;
    assert_eq!(
        p.mined_markers().await.keys().collect::<Vec<_>>(),
        ["txflow:fine"]
    );
    p.stop().await;
}
