//! The transaction pipeline in this one process, for `txflow bench` and `txflow demo`: the
//! allocator (requests and commands), the signer gateway with generated keys, and the broadcaster,
//! against the configured PostgreSQL, broker, registry and chain.

use std::collections::BTreeMap;
use std::time::Duration;

use alloy::consensus::Transaction as _;
use alloy::eips::BlockNumberOrTag;
use alloy::primitives::{Address, U256};
use alloy::providers::ext::AnvilApi;
use alloy::providers::{DynProvider, Provider, ProviderBuilder};
use alloy::signers::local::PrivateKeySigner;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::config::Config;
use txflow_core::events::{TxCommand, TxRequest};
use txflow_core::kafka::{ensure_topics, signer_key};
use txflow_core::role::Role;

pub const SINK: &str = "0x000000000000000000000000000000000000dead";

pub struct LocalPipeline {
    pub config: Config,
    pub signers: Vec<PrivateKeySigner>,
    pub provider: DynProvider,
    pub start_block: u64,
    codec: RegistryCodec,
    producer: FutureProducer,
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl LocalPipeline {
    /// Migrates, creates the topics, generates and funds `signers` keys on the chain (anvil),
    /// and starts the three stages.
    pub async fn start(config: Config, signers: usize) -> anyhow::Result<LocalPipeline> {
        let pool = txflow_core::db::connect(&config.database_url, 2).await?;
        txflow_core::db::migrate(&pool).await?;
        pool.close().await;
        ensure_topics(&config.kafka, &config.topics.all(), config.partitions).await?;
        let url = config
            .rpc_urls
            .first()
            .ok_or_else(|| anyhow::anyhow!("TXFLOW_RPC_URLS is empty"))?;
        let provider = ProviderBuilder::new().connect_http(url.parse()?).erased();
        let start_block = provider.get_block_number().await?;
        let keys: Vec<PrivateKeySigner> =
            (0..signers).map(|_| PrivateKeySigner::random()).collect();
        for k in &keys {
            provider
                .anvil_set_balance(k.address(), U256::from(10u128.pow(22)))
                .await?;
        }
        // The signer gateway signs with the generated keys (never logged: `Secret`).
        let mut config = config;
        config.signer_keys = txflow_core::config::Secret::new(
            keys.iter()
                .map(|k| format!("0x{}", hex::encode(k.to_bytes())))
                .collect::<Vec<_>>()
                .join(","),
        );
        let stages: u32 = Role::PIPELINE
            .iter()
            .map(|r| crate::roles::stages_of(*r))
            .sum();
        let deps = crate::roles::deps(&config, stages).await?;
        let shutdown = CancellationToken::new();
        let mut tasks = Vec::new();
        for role in Role::PIPELINE {
            let (deps, token) = (deps.clone(), shutdown.child_token());
            tasks.push(tokio::spawn(async move {
                crate::roles::run_role(role, &deps, token).await
            }));
        }
        Ok(LocalPipeline {
            codec: RegistryCodec::new(&config.schema_registry_url),
            producer: config.kafka.producer_config().create()?,
            config,
            signers: keys,
            provider,
            start_block,
            shutdown,
            tasks,
        })
    }

    pub fn signer(&self, i: usize) -> String {
        format!("{:#x}", self.signers[i].address())
    }

    pub fn request(&self, signer: usize, request_id: &str, to: &str, value: &str) -> TxRequest {
        TxRequest {
            event_id: uuid::Uuid::new_v4().to_string(),
            request_id: request_id.to_string(),
            chain_id: self.config.chain_id,
            signer: self.signer(signer),
            to: to.to_string(),
            value: value.to_string(),
            data: marker(request_id),
            gas_limit: None,
            max_fee_per_gas: None,
            max_priority_fee_per_gas: None,
            metadata: Default::default(),
            depends_on_request_id: None,
        }
    }

    pub async fn send(&self, r: &TxRequest) -> anyhow::Result<()> {
        let topic = self.config.topics.tx_requests();
        let bytes = self.codec.encode(&topic, Subjects::TopicName, r).await?;
        self.producer
            .send(
                FutureRecord::to(&topic)
                    .key(&signer_key(r.chain_id, &r.signer))
                    .payload(&bytes),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)?;
        Ok(())
    }

    pub async fn command(&self, c: &TxCommand) -> anyhow::Result<()> {
        let topic = self.config.topics.tx_commands();
        let bytes = self.codec.encode(&topic, Subjects::TopicName, c).await?;
        self.producer
            .send(
                FutureRecord::to(&topic)
                    .key(&signer_key(c.chain_id, &c.signer))
                    .payload(&bytes),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)?;
        Ok(())
    }

    /// Transactions mined from our signers (their latest nonces).
    pub async fn mined(&self) -> anyhow::Result<u64> {
        let mut n = 0;
        for s in &self.signers {
            n += self
                .provider
                .get_transaction_count(s.address())
                .latest()
                .await?;
        }
        Ok(n)
    }

    /// Mined transactions from our signers since the start, per calldata marker.
    pub async fn mined_markers(&self) -> anyhow::Result<BTreeMap<String, usize>> {
        let ours: Vec<Address> = self.signers.iter().map(|s| s.address()).collect();
        let latest = self.provider.get_block_number().await?;
        let mut markers = BTreeMap::new();
        for n in self.start_block..=latest {
            let Some(block) = self
                .provider
                .get_block_by_number(BlockNumberOrTag::Number(n))
                .full()
                .await?
            else {
                continue;
            };
            for tx in block.transactions.into_transactions() {
                if ours.contains(&tx.inner.signer()) {
                    *markers
                        .entry(String::from_utf8_lossy(tx.input()).into_owned())
                        .or_insert(0) += 1;
                }
            }
        }
        Ok(markers)
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        for t in self.tasks {
            t.await??;
        }
        Ok(())
    }
}

pub fn marker(request_id: &str) -> Vec<u8> {
    format!("txflow:{request_id}").into_bytes()
}
