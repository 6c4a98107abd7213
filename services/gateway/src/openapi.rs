//! The OpenAPI document, generated from the handlers' `#[utoipa::path]` and the types'
//! `ToSchema` (served at `GET /openapi.json`, checked in as `services/gateway/openapi.json`).
//! The test below fails when the checked-in file differs from what the code generates;
//! regenerate it with `TXFLOW_BLESS=1 cargo test -p txflow-gateway openapi`.

use serde_json::Value;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::{audit, error, handler, tx};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "txflow gateway",
        description = "The HTTP API of txflow: internal transfers (seed 004 §8) and the \
            transaction pipeline's tx endpoints (ARCHITECTURE §8). Errors are JSON \
            `{code, message}`. Every /api/v1 endpoint needs `Authorization: Bearer <JWT>` \
            (HS256, RS256 or ES256, chosen by `kid` among the configured keys; `sub`, `iat`, \
            `exp`, `aud` and `iss` required) and grants only what the token's OAuth `scope` \
            claim (space-separated) names: `transfer` (the token's own transfers), \
            `tx:submit:<signer>`, `tx:read:<signer>`, `tx:approve:<signer>`, \
            `tx:cancel:<signer>` (`<signer>` an address or `*`) and `audit:read`. For example \
            `{\"sub\": \"ops-1\", \"scope\": \"tx:read:* tx:approve:0xf39f…2266\", …}`. \
            Default deny.",
        license(name = "MIT OR Apache-2.0"),
    ),
    paths(
        handler::create_transfer,
        handler::get_transfer,
        tx::create_tx,
        tx::get_tx,
        tx::get_tx_by_request,
        tx::approve_tx,
        tx::cancel_tx,
        audit::get_audit,
        handler::healthz,
        handler::readyz,
        handler::openapi,
        handler::metrics,
    ),
    components(schemas(error::ErrorBody)),
    modifiers(&Bearer),
    tags(
        (name = "transfers", description = "Internal transfers between FUNDING and SPOT (seed 004)"),
        (name = "tx", description = "The transaction pipeline: requests, reads, approval and cancellation"),
        (name = "audit", description = "Who submitted, approved and cancelled what"),
        (name = "operations", description = "Liveness, readiness, metrics and this document"),
    )
)]
struct ApiDoc;

/// The `bearer` security scheme the paths name.
struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .build(),
            ),
        );
    }
}

/// The document. Its version is the workspace's.
pub fn api() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    doc
}

/// The document as the checked-in file holds it and `/openapi.json` serves it: pretty JSON (the
/// document's own field order, not a `serde_json::Value`'s, which depends on serde_json's
/// features) and a trailing newline.
pub fn pretty() -> String {
    let mut text = serde_json::to_string_pretty(&api()).unwrap_or_else(|e| {
        // Serialising plain data structures cannot fail; should it, say so rather than panic.
        serde_json::json!({"error": format!("the OpenAPI document does not serialise: {e}")})
            .to_string()
    });
    text.push('\n');
    text
}

/// The document as a JSON value (for inspection).
pub fn document() -> Value {
    serde_json::from_str(&pretty()).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openapi_json_is_up_to_date() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
        let generated = pretty();
        if std::env::var_os("TXFLOW_BLESS").is_some() {
            std::fs::write(&path, &generated).expect("write openapi.json");
            return;
        }
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == generated,
            "{} differs from the document the code generates; regenerate it with \
             `TXFLOW_BLESS=1 cargo test -p txflow-gateway openapi` and review the diff",
            path.display()
        );
    }

    #[test]
    fn every_route_is_documented() {
        let doc = document();
        let paths = doc["paths"].as_object().expect("paths");
        for (path, method) in [
            ("/api/v1/internal_transfer", "post"),
            ("/api/v1/internal_transfer/{req_id}", "get"),
            ("/api/v1/tx", "post"),
            ("/api/v1/tx/{tx_id}", "get"),
            ("/api/v1/tx/by-request", "get"),
            ("/api/v1/tx/{tx_id}/approve", "post"),
            ("/api/v1/tx/{tx_id}/cancel", "post"),
            ("/api/v1/audit", "get"),
            ("/healthz", "get"),
            ("/readyz", "get"),
            ("/openapi.json", "get"),
            ("/metrics", "get"),
        ] {
            assert!(paths[path][method].is_object(), "{method} {path}");
        }
        assert_eq!(paths.len(), 12, "{:?}", paths.keys().collect::<Vec<_>>());
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
    }
}
