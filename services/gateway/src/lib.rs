//! The gateway role (`txflow gateway`): the HTTP API of internal transfers (seed 004 §8; ARCHITECTURE.md,
//! "Gateway"). It authenticates the caller (JWT), validates a transfer request in the seed's order
//! with the domain's checks, and records it in INIT in `transfers`; the transfer coordinator
//! executes it. Not built yet: publishing the request to the coordinator, the tx endpoints of
//! shared ARCHITECTURE §8, the OpenAPI document.
//!
//! - `config.rs`: its settings (`gateway.*`) and the JWT key read at start;
//! - `auth.rs`: the bearer token's verification;
//! - `rate.rs`: the per-user token bucket;
//! - `store.rs`: the SQL on `transfers` and `assets`;
//! - `handler.rs`: the routes;
//! - `error.rs`: `{code, message}` errors.

pub mod auth;
pub mod config;
pub mod error;
pub mod handler;
pub mod rate;
pub mod store;

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
}

impl Classify for GatewayError {
    fn retry(&self) -> Retry {
        match self {
            GatewayError::Bind { .. } | GatewayError::Serve(_) => Retry::Transient,
            GatewayError::Config(_) | GatewayError::DatabaseUrl(_) | GatewayError::Signals(_) => {
                Retry::Permanent
            }
        }
    }
}

/// Runs the gateway until SIGINT or SIGTERM.
pub async fn run(config: &Config) -> Result<(), GatewayError> {
    let gateway = GatewayConfig::from_config(config)?;
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
    serve(gateway, shutdown).await
}

/// Serves the API on `gateway.addr` until `shutdown` is cancelled. The database pool connects
/// lazily: the gateway starts (and `/readyz` says 503) while PostgreSQL is down.
pub async fn serve(
    gateway: GatewayConfig,
    shutdown: CancellationToken,
) -> Result<(), GatewayError> {
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(&gateway.database_url)
        .map_err(GatewayError::DatabaseUrl)?;
    let listener = tokio::net::TcpListener::bind(&gateway.addr)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: gateway.addr.clone(),
            source,
        })?;
    tracing::info!(
        addr = %gateway.addr,
        jwt_alg = gateway.verifier.alg().as_str(),
        rate_per_sec = gateway.rate_per_sec,
        rate_burst = gateway.rate_burst,
        "gateway: listening"
    );
    let state = handler::AppState::new(
        pool,
        gateway.verifier,
        rate::RateLimiter::new(gateway.rate_per_sec, gateway.rate_burst),
        gateway.body_limit,
    );
    axum::serve(listener, handler::router(state, gateway.timeout))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(GatewayError::Serve)
}
