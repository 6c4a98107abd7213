//! The request-to-chain pipeline (allocator → signer gateway → broadcaster) against a chain of the
//! test's own, with helpers that read outcomes where they are true: mined transactions by calldata
//! marker, rows in PostgreSQL. Stages run in this process ([`Pipeline::start_allocator`] and the
//! like) or as `txflow` processes of the test's own, configured by [`Pipeline::env`].

use std::collections::BTreeMap;
use std::time::Duration;

use alloy::consensus::Transaction as _;
use alloy::eips::BlockNumberOrTag;
use alloy::network::{EthereumWallet, TransactionBuilder};
use alloy::primitives::{Address, U256};
use alloy::providers::ext::AnvilApi;
use alloy::providers::{Provider, ProviderBuilder};
use alloy::rpc::types::TransactionRequest;
use alloy::signers::local::PrivateKeySigner;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::deps::Deps;
use txflow_core::domain::NodeId;
use txflow_core::events::{TxCommand, TxCommandKind, TxRequest};
use txflow_core::kafka::{Topics, ensure_topics, signer_key};
use txflow_core::lease::LeaseConfig;
use txflow_core::role::Role;
use txflow_core::stage::StageConfig;
use txflow_signer_gateway::Keys;

use crate::fault_proxy::{FaultProxy, Rule};
use crate::{AnvilNode, TestDb, kafka_settings, producer, registry_url, unique};

/// Where every test request sends its value.
pub const SINK: &str = "0x000000000000000000000000000000000000dead";

/// Who requests the commands of [`Pipeline::command`] (`requested_by`, recorded as the approver).
pub const APPROVER: &str = "ops@example.com";

/// A transaction of one of the pipeline's signers, as mined.
#[derive(Debug, Clone)]
pub struct Mined {
    pub signer: Address,
    pub nonce: u64,
    /// Lowercase 0x-hex.
    pub to: String,
    pub value: U256,
    pub input: Vec<u8>,
    /// The block it is in, and that block's timestamp (Unix seconds).
    pub block: u64,
    pub timestamp: u64,
}

impl Mined {
    /// Its calldata as text: the request's marker.
    pub fn marker(&self) -> String {
        String::from_utf8_lossy(&self.input).into_owned()
    }
}

/// A chain, a database and topics of the test's own, funded signers, and the stages started on it.
pub struct Pipeline {
    pub anvil: AnvilNode,
    pub db: TestDb,
    pub config: Config,
    pub signers: Vec<PrivateKeySigner>,
    pub codec: RegistryCodec,
    producer: Option<FutureProducer>,
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// The calldata marker of a request: how its transactions are found on the chain.
pub fn marker(request_id: &str) -> Vec<u8> {
    format!("txflow:{request_id}").into_bytes()
}

impl Pipeline {
    /// The three stages on `signers` funded signers.
    pub async fn start(signers: usize) -> Pipeline {
        Pipeline::start_with(signers, |_| {}).await
    }

    /// The three stages, all with the configuration as `customize` leaves it.
    pub async fn start_with(signers: usize, customize: impl FnOnce(&mut Config)) -> Pipeline {
        let mut p = Pipeline::prepare(signers, customize).await;
        let config = p.config.clone();
        p.start_stages(&config).await;
        p
    }

    /// The infrastructure and funded signers, no stage yet.
    pub async fn prepare(signers: usize, customize: impl FnOnce(&mut Config)) -> Pipeline {
        Pipeline::prepare_on(AnvilNode::spawn().await, signers, customize).await
    }

    /// [`Pipeline::prepare`] on a chain the test started its own way (say, without mining).
    pub async fn prepare_on(
        anvil: AnvilNode,
        signers: usize,
        customize: impl FnOnce(&mut Config),
    ) -> Pipeline {
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
        Pipeline {
            producer: Some(producer(&config.kafka)),
            codec: RegistryCodec::new(registry_url()),
            anvil,
            db,
            config,
            signers: keys,
            shutdown: CancellationToken::new(),
            tasks: Vec::new(),
        }
    }

    fn lease() -> LeaseConfig {
        LeaseConfig::default()
    }

    /// The clients of a stage started with `config` (each start has its own, like a process).
    async fn deps(config: &Config, stages: u32) -> Deps {
        Deps::connect(config, stages).await.expect("clients")
    }

    /// The stages of [`Role::SUBMISSION`] (request → SUBMITTED) in this process, with `config`
    /// (the allocator as node `alloc-1`); [`Pipeline::start_all_stages`] adds finality.
    pub async fn start_stages(&mut self, config: &Config) {
        for role in Role::SUBMISSION {
            self.start_role(role, config).await;
        }
    }

    /// Every stage of [`Role::PIPELINE`], finality included (the receipt checker and the
    /// confirmation manager), with `config`.
    pub async fn start_all_stages(&mut self, config: &Config) {
        for role in Role::PIPELINE {
            self.start_role(role, config).await;
        }
    }

    async fn start_role(&mut self, role: Role, config: &Config) {
        match role {
            Role::Allocator => self.start_allocator(config, "alloc-1").await,
            Role::SignerGateway => self.start_signer_gateway(config).await,
            Role::Broadcaster => self.start_broadcaster(config).await,
            Role::ReceiptChecker => self.start_receipt_checker(config).await,
            Role::ConfirmationManager => self.start_confirmation_manager(config).await,
            other => panic!("{other} is in Role::PIPELINE but the harness cannot start it"),
        }
    }

    /// Signer `i` spends `nonce` straight on the chain, outside txflow (7 wei to [`SINK`]), and
    /// waits for the receipt: the nonce is then used by a transaction txflow did not send.
    pub async fn spend_nonce_outside(&self, i: usize, nonce: u64) {
        let wallet = ProviderBuilder::new()
            .wallet(EthereumWallet::from(self.signers[i].clone()))
            .connect_http(self.anvil.url.parse().expect("url"));
        let outsider = TransactionRequest::default()
            .with_to(SINK.parse::<Address>().expect("sink"))
            .with_value(U256::from(7))
            .with_nonce(nonce)
            .with_chain_id(31337)
            .with_gas_limit(21_000)
            .with_max_fee_per_gas(10_000_000_000)
            .with_max_priority_fee_per_gas(1_000_000_000);
        let receipt = wallet
            .send_transaction(outsider)
            .await
            .expect("send outside txflow")
            .get_receipt()
            .await
            .expect("outsider mined");
        assert!(receipt.status(), "the outside transaction succeeded");
        // Final: buried at the required depth (its own block counted), so that the nonce is
        // used for good and a transaction of txflow's at it is REPLACED.
        let more = u64::from(self.config.confirmations_required.saturating_sub(1));
        if more > 0 {
            self.provider()
                .anvil_mine(Some(more), None)
                .await
                .expect("anvil_mine");
        }
    }

    /// The allocator (requests and commands) in this process, as node `name`.
    pub async fn start_allocator(&mut self, config: &Config, name: &str) {
        let deps = Self::deps(config, 2).await;
        let (a, c) = txflow_allocator::runtimes(&deps, NodeId::named(name), Self::lease())
            .await
            .expect("allocator");
        let (t1, t2) = (self.shutdown.clone(), self.shutdown.clone());
        self.tasks.push(tokio::spawn(async move {
            c.run(t2).await.expect("allocator commands run")
        }));
        self.tasks.push(tokio::spawn(async move {
            a.run(t1).await.expect("allocator runs")
        }));
    }

    /// The signer gateway in this process, with the keys of [`Pipeline::signers`].
    pub async fn start_signer_gateway(&mut self, config: &Config) {
        let deps = Self::deps(config, 1).await;
        let s = txflow_signer_gateway::runtime(
            &deps,
            Keys::from_signers(self.signers.clone()),
            NodeId::named("sign-1"),
            Self::lease(),
        )
        .await
        .expect("signer gateway");
        let t = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            s.run(t).await.expect("signer gateway runs")
        }));
    }

    /// The broadcaster in this process.
    pub async fn start_broadcaster(&mut self, config: &Config) {
        self.start_broadcaster_with(config, |_| {}).await;
    }

    /// The broadcaster in this process, its stage settings as `customize` leaves them.
    pub async fn start_broadcaster_with(
        &mut self,
        config: &Config,
        customize: impl FnOnce(&mut StageConfig),
    ) {
        let deps = Self::deps(config, 1).await;
        let b = txflow_broadcaster::runtime_with(
            &deps,
            NodeId::named("bcast-1"),
            Self::lease(),
            customize,
        )
        .await
        .expect("broadcaster");
        let t = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            b.run(t).await.expect("broadcaster runs")
        }));
    }

    /// The receipt checker in this process.
    pub async fn start_receipt_checker(&mut self, config: &Config) {
        let deps = Self::deps(config, 1).await;
        let r = txflow_receipt_checker::runtime(&deps, NodeId::named("receipts-1"), Self::lease())
            .await
            .expect("receipt checker");
        let t = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            r.run(t).await.expect("receipt checker runs")
        }));
    }

    /// The confirmation manager in this process.
    pub async fn start_confirmation_manager(&mut self, config: &Config) {
        let deps = Self::deps(config, 1).await;
        let c =
            txflow_confirmation_manager::runtime(&deps, NodeId::named("confirm-1"), Self::lease())
                .await
                .expect("confirmation manager");
        let t = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            c.run(t).await.expect("confirmation manager runs")
        }));
    }

    /// The `TXFLOW_*` environment of a `txflow` process working on this pipeline.
    pub fn env(&self) -> Vec<(String, String)> {
        let c = &self.config;
        vec![
            ("TXFLOW_DATABASE_URL".into(), c.database_url.clone()),
            ("TXFLOW_BROKERS".into(), c.kafka.brokers.clone()),
            (
                "TXFLOW_FETCH_WAIT_MAX_MS".into(),
                c.kafka.fetch_wait_max_ms.to_string(),
            ),
            (
                "TXFLOW_SCHEMA_REGISTRY_URL".into(),
                c.schema_registry_url.clone(),
            ),
            ("TXFLOW_TOPIC_PREFIX".into(), c.topics.prefix.clone()),
            ("TXFLOW_PARTITIONS".into(), c.partitions.to_string()),
            ("TXFLOW_RPC_URLS".into(), c.rpc_urls.join(",")),
            ("TXFLOW_CHAIN_ID".into(), c.chain_id.to_string()),
        ]
    }

    /// `TXFLOW_SIGNER_KEYS` for a `txflow signer-gateway` process holding the keys of
    /// [`Pipeline::signers`] (test keys, made up for this run).
    pub fn signer_keys_env(&self) -> (String, String) {
        let keys: Vec<String> = self
            .signers
            .iter()
            .map(|s| alloy::hex::encode_prefixed(s.to_bytes()))
            .collect();
        ("TXFLOW_SIGNER_KEYS".into(), keys.join(","))
    }

    /// Signer `i`'s address, lowercase 0x-hex.
    pub fn signer(&self, i: usize) -> String {
        format!("{:#x}", self.signers[i].address())
    }

    /// A request of signer `i` sending 1 wei to [`SINK`] with the request's marker as calldata.
    pub fn request(&self, signer: usize, request_id: &str) -> TxRequest {
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
            depends_on_request_id: None,
            depends_on_signer: None,
            submitted_by: None,
        }
    }

    /// Publishes `r` on the requests topic, keyed by its signer.
    pub async fn send(&self, r: &TxRequest) {
        let topic = self.config.topics.tx_requests();
        let bytes = self
            .codec
            .encode(&topic, Subjects::TopicName, r)
            .await
            .expect("encode");
        self.send_raw(&signer_key(r.chain_id, &r.signer), &bytes)
            .await;
    }

    /// Publishes an operator command (approve, cancel) for transaction `tx_id` of signer 0.
    pub async fn command(&self, tx_id: &str, kind: TxCommandKind) {
        self.command_as(0, tx_id, kind).await;
    }

    /// Publishes an operator command for transaction `tx_id`, keyed by (and naming) signer
    /// `signer`, requested by [`APPROVER`]: the transaction need not be that signer's.
    pub async fn command_as(&self, signer: usize, tx_id: &str, kind: TxCommandKind) {
        self.command_by(signer, tx_id, kind, APPROVER).await;
    }

    /// [`Pipeline::command_as`], requested by `principal`.
    pub async fn command_by(
        &self,
        signer: usize,
        tx_id: &str,
        kind: TxCommandKind,
        principal: &str,
    ) {
        let c = TxCommand {
            event_id: uuid::Uuid::new_v4().to_string(),
            tx_id: tx_id.to_string(),
            chain_id: 31337,
            signer: self.signer(signer),
            command: kind,
            requested_by: principal.into(),
            reason: Some("test".into()),
        };
        let topic = self.config.topics.tx_commands();
        let bytes = self
            .codec
            .encode(&topic, Subjects::TopicName, &c)
            .await
            .expect("encode");
        self.send_to(&topic, &signer_key(31337, &self.signer(signer)), &bytes)
            .await;
    }

    /// Publishes raw bytes on the requests topic.
    pub async fn send_raw(&self, key: &str, bytes: &[u8]) {
        let topic = self.config.topics.tx_requests();
        self.send_to(&topic, key, bytes).await;
    }

    /// Closes the test's producer: for tests that restart the broker, which librdkafka clients
    /// may not survive (a metadata update after the broker came back without its topics can
    /// crash the process, librdkafka issue #5280). Sending afterwards panics.
    pub fn close_producer(&mut self) {
        self.producer = None;
    }

    /// Publishes raw bytes on `topic`.
    pub async fn send_to(&self, topic: &str, key: &str, bytes: &[u8]) {
        self.producer
            .as_ref()
            .expect("the producer is open")
            .send(
                FutureRecord::to(topic).key(key).payload(bytes),
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
    }

    /// Puts a [`FaultProxy`] with `rules` in front of the pipeline's anvil and points the
    /// configuration at it (`rpc_urls`): the stages started with it afterwards go through it.
    pub async fn behind_proxy(&mut self, rules: Vec<Rule>) -> FaultProxy {
        let proxy = FaultProxy::start(&self.anvil.url, rules)
            .await
            .expect("start the fault proxy");
        self.config.rpc_urls = vec![proxy.url.clone()];
        proxy
    }

    /// One number from PostgreSQL.
    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.db.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Every transaction of our signers on the chain, in block order.
    pub async fn mined(&self) -> Vec<Mined> {
        let provider = ProviderBuilder::new().connect_http(self.anvil.url.parse().expect("url"));
        let ours: Vec<Address> = self.signers.iter().map(|s| s.address()).collect();
        let latest = provider.get_block_number().await.expect("block number");
        let mut mined = Vec::new();
        for n in 0..=latest {
            let block = provider
                .get_block_by_number(BlockNumberOrTag::Number(n))
                .full()
                .await
                .expect("block")
                .expect("block exists");
            let timestamp = block.header.timestamp;
            for tx in block.transactions.into_transactions() {
                let signer = tx.inner.signer();
                if ours.contains(&signer) {
                    mined.push(Mined {
                        signer,
                        nonce: tx.nonce(),
                        to: tx.to().map(|a| format!("{a:#x}")).unwrap_or_default(),
                        value: tx.value(),
                        input: tx.input().to_vec(),
                        block: n,
                        timestamp,
                    });
                }
            }
        }
        mined
    }

    /// Mined transactions from our signers, per calldata marker.
    pub async fn mined_markers(&self) -> BTreeMap<String, usize> {
        let mut markers = BTreeMap::new();
        for tx in self.mined().await {
            *markers.entry(tx.marker()).or_insert(0) += 1;
        }
        markers
    }

    /// The nonces of our signers' mined transactions, per calldata marker.
    pub async fn mined_nonces(&self) -> BTreeMap<String, Vec<u64>> {
        let mut nonces: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for tx in self.mined().await {
            nonces.entry(tx.marker()).or_default().push(tx.nonce);
        }
        nonces
    }

    /// The state of request `request_id`'s transaction, if it is recorded.
    pub async fn state_of(&self, request_id: &str) -> Option<String> {
        sqlx::query_scalar("SELECT state FROM managed_tx WHERE request_id = $1")
            .bind(request_id)
            .fetch_optional(&self.db.pool)
            .await
            .expect("state")
    }

    /// The announced events recorded in `tx_events` (`txflow_core::outbox::ANNOUNCED`) that are
    /// not on their topic by `event_id` header, waiting up to `timeout` for them to arrive; empty
    /// when every one is there (duplicates on a topic are allowed). Each missing one as
    /// `(type, event_id, tx_id)`.
    pub async fn announced_events_missing_from_topics(
        &self,
        timeout: Duration,
    ) -> Vec<(String, String, String)> {
        use rdkafka::Message;
        use rdkafka::consumer::Consumer;
        use rdkafka::message::Headers;
        use std::collections::{BTreeSet, HashSet};

        let recorded: Vec<(String, uuid::Uuid, uuid::Uuid)> = sqlx::query_as(
            "SELECT type, event_id, tx_id FROM tx_events WHERE type = ANY($1) ORDER BY created_at",
        )
        .bind(txflow_core::outbox::ANNOUNCED)
        .fetch_all(&self.db.pool)
        .await
        .expect("recorded events");
        let topics = &self.config.topics;
        // Written out here rather than taken from the outbox: the test states the contract.
        let topics_of = |t: &str| match t {
            "TxAllocated" => vec![topics.tx_allocated()],
            "TxSigned" => vec![topics.tx_signed()],
            "TxSubmitted" => vec![topics.tx_submitted(), topics.tx_outcomes()],
            "TxFailed" => vec![topics.tx_outcomes()],
            "TxMined" | "TxReverted" => vec![topics.tx_receipts(), topics.tx_outcomes()],
            "TxConfirmationsUpdated" | "TxReorged" => vec![topics.tx_confirmations()],
            "TxConfirmed" => vec![topics.tx_outcomes()],
            "TxConfirmationReverted" => vec![topics.tx_confirmations(), topics.tx_outcomes()],
            other => panic!("{other} is announced but has no topic here"),
        };
        let mut wanted: BTreeSet<(String, String)> = recorded
            .iter()
            .flat_map(|(t, id, _)| {
                topics_of(t)
                    .into_iter()
                    .map(|topic| (topic, id.to_string()))
            })
            .collect();
        let names: BTreeSet<String> = wanted.iter().map(|(t, _)| t.clone()).collect();
        if !names.is_empty() {
            let consumer = crate::group_consumer(&self.config.kafka, &unique("outbox-check"));
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            consumer.subscribe(&names).expect("subscribe");
            let deadline = tokio::time::Instant::now() + timeout;
            let mut seen: HashSet<(String, String)> = HashSet::new();
            while !wanted.is_empty() {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                match tokio::time::timeout(left, consumer.recv()).await {
                    Ok(Ok(m)) => {
                        let id = m.headers().and_then(|h| {
                            h.iter()
                                .find(|h| h.key == "event_id")
                                .and_then(|h| h.value)
                                .map(|v| String::from_utf8_lossy(v).into_owned())
                        });
                        if let Some(id) = id {
                            let k = (m.topic().to_string(), id);
                            wanted.remove(&k);
                            seen.insert(k);
                        }
                    }
                    Ok(Err(e)) => panic!("reading the announced topics: {e}"),
                    Err(_) => break,
                }
            }
        }
        recorded
            .into_iter()
            .filter(|(t, id, _)| {
                topics_of(t)
                    .into_iter()
                    .any(|topic| wanted.contains(&(topic, id.to_string())))
            })
            .map(|(t, id, tx)| (t, id.to_string(), tx.to_string()))
            .collect()
    }

    /// A provider on the test's chain.
    pub fn provider(&self) -> impl Provider + use<> {
        ProviderBuilder::new().connect_http(self.anvil.url.parse().expect("url"))
    }

    /// How many transactions our signers have mined (the sum of their nonces at the latest block).
    pub async fn mined_count(&self) -> u64 {
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

    /// anvil's `txpool_status`: `(pending, queued)`.
    pub async fn pool_status(&self) -> (String, String) {
        let provider = ProviderBuilder::new().connect_http(self.anvil.url.parse().expect("url"));
        let pool: serde_json::Value = provider
            .raw_request("txpool_status".into(), ())
            .await
            .expect("txpool_status");
        (
            pool["pending"].as_str().unwrap_or_default().to_string(),
            pool["queued"].as_str().unwrap_or_default().to_string(),
        )
    }

    /// Stops the in-process stages and waits for them.
    pub async fn stop(self) {
        self.shutdown.cancel();
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(180), t).await;
        }
    }
}
