//! The gateway's routes: each handler on its path, with the body limits, the per-request timeout
//! and the request counters (`gateway_requests_total{route, status}`,
//! `gateway_rejections_total{code}`). The handlers are in `handler.rs` (transfers, operations)
//! and `tx.rs` (the tx endpoints).

use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};

use crate::config::TX_BODY_LIMIT;
use crate::error::{ApiError, ErrorCode};
use crate::handler::{self, AppState};
use crate::{audit, tx};

/// The API's routes, with the body limits, the per-request timeout and the request counters.
pub fn router(state: AppState, timeout: Duration) -> Router {
    let body_limit = state.0.body_limit;
    let routes: [(&'static str, MethodRouter<AppState>); 12] = [
        ("/api/v1/internal_transfer", post(handler::create_transfer)),
        (
            "/api/v1/internal_transfer/{req_id}",
            get(handler::get_transfer),
        ),
        (
            "/api/v1/tx",
            post(tx::create_tx).layer(DefaultBodyLimit::max(TX_BODY_LIMIT)),
        ),
        ("/api/v1/tx/by-request", get(tx::get_tx_by_request)),
        ("/api/v1/tx/{tx_id}", get(tx::get_tx)),
        ("/api/v1/tx/{tx_id}/approve", post(tx::approve_tx)),
        ("/api/v1/tx/{tx_id}/cancel", post(tx::cancel_tx)),
        ("/api/v1/audit", get(audit::get_audit)),
        ("/healthz", get(handler::healthz)),
        ("/readyz", get(handler::readyz)),
        ("/openapi.json", get(handler::openapi)),
        ("/metrics", get(handler::metrics)),
    ];
    let mut router = Router::new();
    for (path, methods) in routes {
        // The label outside the timeout, so that a timed-out answer carries its route too.
        router = router.route(
            path,
            methods
                .layer(middleware::from_fn_with_state(timeout, with_timeout))
                .layer(middleware::map_response_with_state(path, label)),
        );
    }
    router
        .fallback(|| async { ApiError::not_found() })
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn(count))
        .with_state(state)
}

/// The route (its template) that answered, in the response's extensions, for [`count`].
#[derive(Debug, Clone, Copy)]
struct RouteLabel(&'static str);

async fn label(State(route): State<&'static str>, mut response: Response) -> Response {
    response.extensions_mut().insert(RouteLabel(route));
    response
}

/// Counts every answer (`gateway_requests_total{route, status}`, `unmatched` for a path no route
/// serves) and every error answer by its code (`gateway_rejections_total{code}`), timeouts
/// included.
async fn count(req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    let m = txflow_core::metrics::get();
    let route = response
        .extensions()
        .get::<RouteLabel>()
        .map_or("unmatched", |r| r.0);
    m.gateway_request(route, response.status().as_u16());
    if let Some(ErrorCode(code)) = response.extensions().get::<ErrorCode>() {
        m.gateway_rejection(code);
    }
    response
}

/// A request not answered within `timeout` gets 503 SYSTEM_ERROR. Its work is dropped; a
/// transfer it recorded stays recorded, and a retry with the same `cid` returns it.
async fn with_timeout(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(
                timeout_ms = timeout.as_millis() as u64,
                "gateway: a request timed out"
            );
            ApiError::system("the request timed out; retry it (with the same cid)").into_response()
        }
    }
}
