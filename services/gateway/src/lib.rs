//! The gateway role (`txflow gateway`): txflow's HTTP API (seed 004 §8; shared ARCHITECTURE §8;
//! ARCHITECTURE.md, "Gateway"). It produces and reads; it owns no state transition.
//!
//! - Internal transfers: it authenticates the caller (JWT), validates a transfer request in the
//!   seed's order with the domain's checks, applies the limits of seed 004 §1.5.6 (below),
//!   refuses it while transfers are halted (an open conservation violation: 503
//!   SERVICE_HALTED), records it in INIT in `transfers` and publishes a TransferRequested (keyed
//!   by the user) to `transfer.requests`; the transfer coordinator executes it. A failed publish
//!   leaves the INIT row to the coordinator's recovery scan, and the request still succeeds.
//! - The limits per user (all 429, nothing recorded): requests per second (`gateway.rate_per_sec`
//!   / `rate_burst`, RATE_LIMIT_EXCEEDED), a token bucket in this process's memory; transfers per
//!   UTC day (`gateway.daily_count`, default 100, DAILY_LIMIT_EXCEEDED) and, per asset, the
//!   day's total amount (the asset's `assets.daily_limit`, NULL for none, DAILY_AMOUNT_EXCEEDED),
//!   both counted in PostgreSQL so across every gateway process. The daily limits are checked in
//!   the insert's transaction under `pg_advisory_xact_lock` on a key of the user, so one user's
//!   concurrent requests cannot both pass. Every transfer created since 00:00 UTC counts,
//!   whatever its state (a failed or refunded one used the allowance too). A `cid` already used
//!   is answered (the original, or DUPLICATE_REQUEST) before the daily limits are checked: a
//!   replay never counts twice, and is answered even when the user is at a limit.
//! - The tx endpoints: a TxRequest published to `tx.requests`, reads of `managed_tx`, and
//!   approve / cancel as TxCommands on `tx.commands` (tokens with the scope for the signer), all keyed
//!   `{chain_id}:{signer}`.
//! - `/healthz`, `/readyz` (database and broker), its OpenAPI document at `/openapi.json`
//!   (generated with utoipa, checked in as `services/gateway/openapi.json`), and `/metrics` (the
//!   Prometheus text of `txflow_core::metrics`, which [`run`] initialises as `txflow-gateway`,
//!   OTLP too when configured), with `gateway_requests_total{route, status}` and
//!   `gateway_rejections_total{code}`.
//!
//! Not built: a rate limit on the tx endpoints.
//!
//! - `config.rs`: its settings (`gateway.*`, plus the shared broker, registry, topics and chain)
//!   and the JWT key read at start;
//! - `auth.rs`: the bearer token's verification (keys by `kid`, audience, issuer, lifetime)
//!   and its scopes;
//! - `audit.rs`: the audit log's read endpoint;
//! - `rate.rs`: the per-user token bucket;
//! - `store.rs`: the SQL on `transfers` (the INIT row within the daily limits), `assets`, the
//!   halt flag and the reads of `managed_tx`;
//! - `publish.rs`: the producer (Avro through the registry, `traceparent` header) and the topics'
//!   creation;
//! - `handler.rs`: the routes and the transfer endpoints; `tx.rs`: the tx endpoints;
//! - `openapi.rs`: the OpenAPI document;
//! - `error.rs`: `{code, message}` errors.

pub mod audit;
pub mod auth;
pub mod config;
pub mod error;
pub mod handler;
pub mod openapi;
pub mod publish;
pub mod rate;
pub mod routes;
pub mod store;
pub mod tx;

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;
use txflow_core::config::Config;
use txflow_core::retry::{Classify, Retry};

use crate::config::{GatewayConfig, GatewayConfigError};

/// Why the gateway stopped.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("gateway: configuration")]
    Config(#[from] GatewayConfigError),
    #[error("gateway: the database URL is not usable")]
    DatabaseUrl(#[source] sqlx::Error),
    #[error("gateway: cannot listen on {addr}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("gateway: serving HTTP")]
    Serve(#[source] std::io::Error),
    #[error("gateway: installing the signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("gateway: the Kafka producer")]
    Publisher(#[source] publish::PublishError),
    #[error("gateway: the metrics")]
    Metrics(#[source] txflow_core::metrics::MetricsError),
}

impl Classify for GatewayError {
    fn retry(&self) -> Retry {
        match self {
            GatewayError::Bind { .. } | GatewayError::Serve(_) => Retry::Transient,
            GatewayError::Config(_)
            | GatewayError::DatabaseUrl(_)
            | GatewayError::Signals(_)
            | GatewayError::Metrics(_) => Retry::Permanent,
            GatewayError::Publisher(e) => e.retry(),
        }
    }
}

/// Runs the gateway until SIGINT or SIGTERM, its metrics initialised (`service.name`
/// `txflow-gateway` unless configured; an OTLP reader when an endpoint is configured).
pub async fn run(config: &Config) -> Result<(), GatewayError> {
    let gateway = GatewayConfig::from_config(config)?;
    init_metrics(config)?;
    let shutdown = CancellationToken::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(GatewayError::Signals)?;
    let token = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        token.cancel();
    });
    let served = serve(gateway, shutdown).await;
    // Push what the OTLP reader has not pushed yet.
    let _ = tokio::task::spawn_blocking(txflow_core::metrics::shutdown).await;
    served
}

/// Installs the process's metrics (already installed in this process is fine).
fn init_metrics(config: &Config) -> Result<(), GatewayError> {
    use txflow_core::metrics;
    match metrics::init(&metrics::Setup {
        service_name: config.otel_service_name.clone(),
        default_service_name: "txflow-gateway".to_string(),
        otlp_endpoint: config.otlp_endpoint.clone(),
        otlp_interval: None,
    }) {
        Ok(()) | Err(metrics::MetricsError::AlreadyInitialised) => {}
        Err(e) => return Err(GatewayError::Metrics(e)),
    }
    Ok(())
}

/// Serves the API on `gateway.addr` until `shutdown` is cancelled. The database pool and the
/// producer connect lazily, and the topics are created in the background: the gateway starts
/// (and `/readyz` says 503) while PostgreSQL or the broker is down. `/metrics` serves the
/// process's metrics when they were initialised (by [`run`], or `txflow up`'s set-up).
pub async fn serve(
    gateway: GatewayConfig,
    shutdown: CancellationToken,
) -> Result<(), GatewayError> {
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(&gateway.database_url)
        .map_err(GatewayError::DatabaseUrl)?;
    let topics = vec![
        gateway.topics.transfer_requests(),
        gateway.topics.tx_requests(),
        gateway.topics.tx_commands(),
    ];
    let publisher = Arc::new(
        publish::Publisher::new(
            &gateway.kafka,
            &gateway.registry_url,
            topics,
            gateway.partitions,
        )
        .map_err(GatewayError::Publisher)?,
    );
    publisher.spawn_setup(shutdown.child_token());
    // The refusal series exist (at 0) before the first refusal.
    txflow_core::metrics::get().register_gateway();
    let listener = tokio::net::TcpListener::bind(&gateway.addr)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: gateway.addr.clone(),
            source,
        })?;
    tracing::info!(
        addr = %gateway.addr,
        jwt_algs = ?gateway.verifier.algs(),
        rate_per_sec = gateway.rate_per_sec,
        rate_burst = gateway.rate_burst,
        daily_count = gateway.daily_count,
        brokers = %gateway.kafka.brokers,
        topic_prefix = %gateway.topics.prefix,
        "gateway: listening"
    );
    let state = handler::AppState::new(
        pool,
        gateway.verifier,
        rate::Limits {
            rate: rate::RateLimiter::new(gateway.rate_per_sec, gateway.rate_burst),
            daily_count: gateway.daily_count,
        },
        gateway.body_limit,
        publisher,
        gateway.topics,
        gateway.chain_id,
    )
    .with_openapi(openapi::pretty());
    axum::serve(listener, routes::router(state, gateway.timeout))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(GatewayError::Serve)
}
