//! The clients a process shares between its roles, built once in `main` (or by a test harness)
//! and handed to every stage: the PostgreSQL pool, the Schema Registry codec, the chain's RPC
//! client (its endpoint health is then shared too) and the configuration they came from.

use std::sync::Arc;

use sqlx::PgPool;

use crate::chain::ChainClient;
use crate::codec::RegistryCodec;
use crate::config::Config;
use crate::domain::NodeId;
use crate::lease::LeaseManager;
use crate::role::RoleError;
use crate::stage::{Handler, StageConfig, StageRuntime};

/// Connections per stage runtime a process runs (a batch transaction, drives, the recovery scan).
pub const CONNECTIONS_PER_STAGE: u32 = 8;

/// `Debug` by hand: the configuration's own (secrets redacted) and the pool's size, never the
/// pool's connect options (they hold the database password).
#[derive(Clone)]
pub struct Deps {
    pub config: Config,
    pub pool: PgPool,
    pub codec: RegistryCodec,
    pub chain: Arc<dyn ChainClient>,
}

impl std::fmt::Debug for Deps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deps")
            .field("config", &self.config)
            .field("pool_size", &self.pool.size())
            .field("chain", &self.chain)
            .finish_non_exhaustive()
    }
}

impl Deps {
    /// Connects for `stages` stage runtimes (the pool holds [`CONNECTIONS_PER_STAGE`] each).
    pub async fn connect(config: &Config, stages: u32) -> Result<Deps, RoleError> {
        let pool =
            crate::db::connect_stages(&config.database_url, CONNECTIONS_PER_STAGE * stages.max(1))
                .await?;
        Ok(Deps {
            config: config.clone(),
            pool,
            codec: RegistryCodec::new(&config.schema_registry_url),
            chain: Arc::new(config.chain()?),
        })
    }

    /// The same clients with another chain client (a test's scripted chain).
    pub fn with_chain(mut self, chain: Arc<dyn ChainClient>) -> Deps {
        self.chain = chain;
        self
    }

    /// A stage's runtime on these clients: `handler` acting as `node` under its role's leases
    /// (`config.lease`), with `config` (usually [`StageConfig::for_pipeline`], adjusted by the
    /// stage). The wiring every stage's `lib.rs` shares; a role with two runtimes on one lease
    /// manager (the allocator) builds them itself.
    pub fn stage_runtime<H: Handler>(
        &self,
        handler: H,
        node: NodeId,
        config: StageConfig,
    ) -> Result<StageRuntime<H>, RoleError> {
        let leases = LeaseManager::new(self.pool.clone(), handler.role(), node, config.lease)?;
        Ok(StageRuntime::new(
            handler,
            self.pool.clone(),
            self.codec.clone(),
            self.config.kafka.clone(),
            leases,
            config,
        ))
    }
}
