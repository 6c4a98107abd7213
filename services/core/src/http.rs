//! The HTTP server of a role process (and `txflow up`) on `TXFLOW_METRICS_ADDR`
//! (`metrics.addr`; unset: no server): `GET /metrics` (the Prometheus text exposition of
//! `metrics.rs`), `GET /healthz` (200 while the process runs) and `GET /readyz` (200 when the
//! database answers `SELECT 1`, the broker answers a metadata request, at least one RPC endpoint
//! answers `eth_blockNumber`, and the lease table can be read; 503 otherwise, with a JSON body
//! naming each failed check). Each check is bounded by [`CHECK_TIMEOUT`]. hyper 1, HTTP/1.1;
//! stopped by the process's shutdown token.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rdkafka::consumer::{BaseConsumer, Consumer};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::chain::ChainClient;
use crate::domain::Role;
use crate::kafka::KafkaSettings;

/// The longest a readiness check may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("TXFLOW_METRICS_ADDR {addr:?} is not an address and port")]
    Addr { addr: String },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

impl crate::retry::Classify for HttpError {
    fn retry(&self) -> crate::retry::Retry {
        crate::retry::Retry::Permanent
    }
}

/// What `/readyz` checks.
#[derive(Clone)]
pub struct Readiness {
    pub pool: PgPool,
    pub chain: Arc<dyn ChainClient>,
    pub kafka: KafkaSettings,
    /// The roles of the process: the lease rows it reads are theirs.
    pub roles: Vec<Role>,
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("roles", &self.roles)
            .finish_non_exhaustive()
    }
}

/// One check's outcome: `None` when it passed, else why not.
type Check = (&'static str, Option<String>);

async fn bounded<F, E>(name: &'static str, f: F) -> Check
where
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    match tokio::time::timeout(CHECK_TIMEOUT, f).await {
        Ok(Ok(())) => (name, None),
        Ok(Err(e)) => (name, Some(e.to_string())),
        Err(_) => (
            name,
            Some(format!("no answer within {} ms", CHECK_TIMEOUT.as_millis())),
        ),
    }
}

impl Readiness {
    /// Runs every check at once; each named with its failure, if any.
    pub async fn check(&self) -> Vec<Check> {
        let db = bounded("database", async {
            sqlx::query("SELECT 1")
                .execute(&self.pool)
                .await
                .map(|_| ())
        });
        let broker = bounded("broker", async {
            let settings = self.kafka.clone();
            match tokio::task::spawn_blocking(move || broker_metadata(&settings)).await {
                Ok(r) => r,
                Err(e) => Err(e.to_string()),
            }
        });
        let rpc = bounded("rpc", async { self.chain.block_number().await.map(|_| ()) });
        let roles: Vec<&str> = self.roles.iter().map(|r| r.as_str()).collect();
        let leases = bounded("leases", async {
            sqlx::query("SELECT count(*) FROM signer_lease WHERE role = ANY($1)")
                .bind(&roles)
                .execute(&self.pool)
                .await
                .map(|_| ())
        });
        let (a, b, c, d) = tokio::join!(db, broker, rpc, leases);
        vec![a, b, c, d]
    }
}

/// A metadata request to the broker (blocking).
fn broker_metadata(settings: &KafkaSettings) -> Result<(), String> {
    let consumer: BaseConsumer = settings
        .assign_config()
        .create()
        .map_err(|e| e.to_string())?;
    consumer
        .fetch_metadata(None, CHECK_TIMEOUT)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn respond(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

/// The JSON body of `/readyz`: every check with "ok" or its failure, and the failed ones named.
pub fn readiness_body(checks: &[Check]) -> (bool, String) {
    let failed: Vec<&str> = checks
        .iter()
        .filter(|(_, e)| e.is_some())
        .map(|(n, _)| *n)
        .collect();
    let detail: serde_json::Map<String, serde_json::Value> = checks
        .iter()
        .map(|(n, e)| {
            (
                (*n).to_string(),
                serde_json::Value::String(e.clone().unwrap_or_else(|| "ok".to_string())),
            )
        })
        .collect();
    let ready = failed.is_empty();
    let body = serde_json::json!({
        "status": if ready { "ready" } else { "not ready" },
        "failed": failed,
        "checks": detail,
    });
    (ready, body.to_string())
}

async fn route(ready: &Readiness, req: Request<Incoming>) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return respond(StatusCode::METHOD_NOT_ALLOWED, TEXT, "GET only\n".into());
    }
    match req.uri().path() {
        "/healthz" => respond(StatusCode::OK, TEXT, "ok\n".into()),
        "/readyz" => {
            let (ok, body) = readiness_body(&ready.check().await);
            let status = if ok {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            respond(status, "application/json", body)
        }
        "/metrics" => match crate::metrics::encode_text() {
            Some(Ok(text)) => respond(StatusCode::OK, "text/plain; version=0.0.4", text),
            Some(Err(e)) => respond(StatusCode::INTERNAL_SERVER_ERROR, TEXT, format!("{e}\n")),
            None => respond(StatusCode::OK, "text/plain; version=0.0.4", String::new()),
        },
        _ => respond(StatusCode::NOT_FOUND, TEXT, "not found\n".into()),
    }
}

/// Binds `addr` and serves until `shutdown`; returns the bound address (port 0 picks one) once
/// listening. Connections in progress at shutdown are dropped with the task.
pub async fn start(
    addr: &str,
    ready: Readiness,
    shutdown: CancellationToken,
) -> Result<SocketAddr, HttpError> {
    let parsed: SocketAddr = addr.parse().map_err(|_| HttpError::Addr {
        addr: addr.to_string(),
    })?;
    let listener = tokio::net::TcpListener::bind(parsed)
        .await
        .map_err(|source| HttpError::Bind {
            addr: parsed,
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| HttpError::Bind {
        addr: parsed,
        source,
    })?;
    tracing::info!(addr = %bound, "serving /metrics, /healthz and /readyz");
    let ready = Arc::new(ready);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = shutdown.cancelled() => return,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::debug!(error = %e, "metrics server accept");
                    continue;
                }
            };
            let ready = ready.clone();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let ready = ready.clone();
                    async move { Ok::<_, Infallible>(route(&ready, req).await) }
                });
                let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
                tokio::select! {
                    r = conn => {
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "metrics server connection");
                        }
                    }
                    () = stop.cancelled() => {}
                }
            });
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readiness_body_names_each_failed_check() {
        let (ok, body) = readiness_body(&[
            ("database", None),
            ("rpc", Some("no answer within 2000 ms".into())),
        ]);
        assert!(!ok);
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(v["failed"], serde_json::json!(["rpc"]));
        assert_eq!(v["checks"]["database"], "ok");
        assert_eq!(v["status"], "not ready");
        let (ok, _) = readiness_body(&[("database", None)]);
        assert!(ok);
    }
}
