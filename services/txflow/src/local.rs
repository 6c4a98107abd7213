//! The transaction pipeline in this one process, for `txflow bench` and `txflow demo`: the
//! allocator (requests and commands), the signer gateway with generated keys, and the broadcaster,
//! against the configured PostgreSQL, broker, registry and chain.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use alloy::consensus::Transaction as _;
use alloy::eips::BlockNumberOrTag;
use alloy::primitives::{Address, U256};
use alloy::providers::ext::AnvilApi;
use alloy::providers::{DynProvider, Provider, ProviderBuilder};
use alloy::signers::local::PrivateKeySigner;
use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use txflow_core::config::Config;
use txflow_core::events::{TxCommand, TxRequest};
use txflow_core::kafka::ensure_topics;
use txflow_core::role::Role;

pub const SINK: &str = "0x000000000000000000000000000000000000dead";

pub struct LocalPipeline {
    pub config: Config,
    pub signers: Vec<PrivateKeySigner>,
    pub provider: DynProvider,
    pub start_block: u64,
    requests: RequestSender,
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
        let producer = txflow_client::Producer::new(&client_settings(&config))?;
        Ok(LocalPipeline {
            requests: RequestSender { producer },
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
            depends_on_signer: None,
            submitted_by: None,
        }
    }

    pub async fn send(&self, r: &TxRequest) -> anyhow::Result<()> {
        self.requests.send(r).await
    }

    /// A handle on [`LocalPipeline::send`] for other tasks.
    pub fn sender(&self) -> RequestSender {
        self.requests.clone()
    }

    pub async fn command(&self, c: &TxCommand) -> anyhow::Result<()> {
        self.requests.producer.command(c).await?;
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
        Ok(self.chain_view().await?.markers())
    }

    /// What the chain holds from our signers: every transaction mined since the start (the keys
    /// are fresh, so that is all of them) and each signer's nonce as of the last block read.
    /// The nonces are read at that block, not at the head, so that every transaction they count
    /// is in `txs`.
    pub async fn chain_view(&self) -> anyhow::Result<ChainView> {
        let ours: Vec<Address> = self.signers.iter().map(|s| s.address()).collect();
        let latest = self.provider.get_block_number().await?;
        let mut txs = Vec::new();
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
                if let Some(signer) = ours.iter().position(|a| *a == tx.inner.signer()) {
                    txs.push(MinedTx {
                        signer,
                        nonce: tx.nonce(),
                        input: tx.input().to_vec(),
                    });
                }
            }
        }
        let mut next_nonces = Vec::with_capacity(ours.len());
        for a in &ours {
            next_nonces.push(
                self.provider
                    .get_transaction_count(*a)
                    .number(latest)
                    .await?,
            );
        }
        Ok(ChainView { txs, next_nonces })
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        for t in self.tasks {
            t.await??;
        }
        Ok(())
    }
}

/// Produces requests to the pipeline's requests topic from any task (cheap to clone): the
/// open-loop bench sends each request from a task of its own, so that a slow acknowledgement
/// never holds up the next request's send.
#[derive(Clone)]
pub struct RequestSender {
    producer: txflow_client::Producer,
}

impl RequestSender {
    /// Validates `r`, encodes it through the registry and produces it keyed by its signer
    /// (txflow-client's [`txflow_client::Producer`]); returns once the broker acknowledged it.
    pub async fn send(&self, r: &TxRequest) -> anyhow::Result<()> {
        self.producer.publish(r).await?;
        Ok(())
    }
}

/// txflow-client's settings for this configuration.
pub fn client_settings(config: &Config) -> txflow_client::Settings {
    txflow_client::Settings {
        brokers: config.kafka.brokers.clone(),
        schema_registry_url: config.schema_registry_url.clone(),
        topic_prefix: config.topics.prefix.clone(),
        chain_id: config.chain_id,
    }
}

/// Blocks for the confirmation manager to count, while `bench` or `demo` waits for CONFIRMED.
/// anvil with `--block-time` (deploy/local, the test harness) makes them on its own; plain
/// automine makes one per transaction and none after the last, so that a run would wait for
/// confirmations until its deadline. A head that has not moved for [`BlockNudge::STALL`] gets one
/// block mined here (`anvil_mine`; the local pipeline needs anvil anyway, to fund its keys):
/// never while the chain mines on its own.
pub struct BlockNudge {
    head: Option<u64>,
    moved_at: Instant,
    /// Blocks mined here.
    pub mined: u64,
}

impl BlockNudge {
    const STALL: Duration = Duration::from_secs(1);

    pub fn new() -> BlockNudge {
        BlockNudge {
            head: None,
            moved_at: Instant::now(),
            mined: 0,
        }
    }

    /// Reads the head; mines a block if it has not moved for [`BlockNudge::STALL`].
    pub async fn tick(&mut self, provider: &DynProvider) -> anyhow::Result<()> {
        let head = provider.get_block_number().await?;
        if self.head != Some(head) {
            self.head = Some(head);
            self.moved_at = Instant::now();
        } else if self.moved_at.elapsed() >= Self::STALL {
            provider
                .anvil_mine(Some(1), None)
                .await
                .with_context(|| {
                    format!(
                        "the chain made no block for {} s and anvil_mine failed (bench and demo need anvil)",
                        Self::STALL.as_secs()
                    )
                })?;
            self.mined += 1;
            self.moved_at = Instant::now();
        }
        Ok(())
    }
}

/// One mined transaction of one of the pipeline's signers.
pub struct MinedTx {
    /// The signer's index in [`LocalPipeline::signers`].
    pub signer: usize,
    pub nonce: u64,
    pub input: Vec<u8>,
}

/// The pipeline's signers as the chain saw them up to one block ([`LocalPipeline::chain_view`]).
pub struct ChainView {
    pub txs: Vec<MinedTx>,
    /// Per signer (by index): its transaction count at that block, the next nonce it would use.
    pub next_nonces: Vec<u64>,
}

impl ChainView {
    /// Mined transactions per calldata marker (a count above 1 is a request mined twice).
    pub fn markers(&self) -> BTreeMap<String, usize> {
        let mut markers = BTreeMap::new();
        for tx in &self.txs {
            *markers
                .entry(String::from_utf8_lossy(&tx.input).into_owned())
                .or_insert(0) += 1;
        }
        markers
    }
}

pub fn marker(request_id: &str) -> Vec<u8> {
    format!("txflow:{request_id}").into_bytes()
}
