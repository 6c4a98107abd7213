//! OpenTelemetry traces: the OTLP gRPC export (a batch span processor, `opentelemetry-otlp` over
//! tonic), the `tracing-opentelemetry` layer the binary installs, and the spans of the stage
//! runtime (a span per message processed, per drive, per produced message and per RPC call),
//! linked across processes by the W3C `traceparent` Kafka header.
//!
//! Off unless an endpoint is configured (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` / `telemetry.otlp_endpoint`; see [`decide`]). Off, no layer is
//! installed, [`enabled`] is false and every span constructor here returns [`Span::none`] after
//! one relaxed atomic load: the stage runtime then writes `traceparent` headers exactly as before
//! ([`crate::stage::child_traceparent`]).
//!
//! Architecture invariant: no span records an RPC endpoint's URL (it may hold an API key); the
//! layer exports only spans of txflow's own targets (alloy's transport span, which records the
//! URL, never reaches it).

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

use crate::domain::{ChainId, Role, Signer};
use crate::retry::{Classify, Retry};

/// The signal-specific endpoint variable; above `OTEL_EXPORTER_OTLP_ENDPOINT` and the file.
pub const TRACES_ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";

/// The target of the runtime's spans (the binary keeps it out of the log output).
pub const TARGET: &str = "txflow::trace";

/// Whether spans are made: true from [`start`] until the [`Telemetry`] guard shuts down.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether traces are exported by this process.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// What this process exports, when it exports traces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceExport {
    /// The OTLP gRPC endpoint (`http://collector:4317`).
    pub endpoint: String,
    /// `service.name` of the resource.
    pub service_name: String,
}

/// Whether and where to export traces, from the configuration (`Config::otlp_endpoint` and
/// `Config::otel_service_name`: `telemetry.otlp_endpoint` and `telemetry.service_name`, whose
/// variables `OTEL_EXPORTER_OTLP_ENDPOINT` and `OTEL_SERVICE_NAME` are already above the file
/// there) and the environment `env`:
/// - `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`: off;
/// - the endpoint: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else the configured one; none (or
///   empty): off;
/// - `service.name`: the configured one (`OTEL_SERVICE_NAME` or the file), else a `service.name`
///   in `OTEL_RESOURCE_ATTRIBUTES`, else `default_service` (`txflow-<role>`, `txflow`).
pub fn decide(
    otlp_endpoint: Option<&str>,
    service_name: Option<&str>,
    default_service: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Option<TraceExport> {
    let yes =
        |v: Option<String>, word: &str| v.is_some_and(|v| v.trim().eq_ignore_ascii_case(word));
    if yes(env("OTEL_SDK_DISABLED"), "true") || yes(env("OTEL_TRACES_EXPORTER"), "none") {
        return None;
    }
    let endpoint = env(TRACES_ENDPOINT_VAR)
        .filter(|e| !e.trim().is_empty())
        .or_else(|| otlp_endpoint.map(str::to_string))
        .filter(|e| !e.trim().is_empty())?;
    let from_attributes = env("OTEL_RESOURCE_ATTRIBUTES").and_then(|attrs| {
        attrs.split(',').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k.trim() == "service.name" && !v.trim().is_empty()).then(|| v.trim().to_string())
        })
    });
    let service_name = service_name
        .map(str::to_string)
        .filter(|s| !s.is_empty())
        .or(from_attributes)
        .unwrap_or_else(|| default_service.to_string());
    Some(TraceExport {
        endpoint: endpoint.trim().to_string(),
        service_name,
    })
}

/// The default `service.name` of a process running `role` (`txflow-allocator`, …).
pub fn service_name_of(role: Role) -> String {
    format!("txflow-{}", role.as_str())
}

#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    /// This build has no TLS for OTLP (a second TLS stack is not worth it for a collector that
    /// runs next to the process).
    #[error(
        "an https:// OTLP endpoint needs TLS, which this build does not include: use an http:// endpoint (a collector next to the process)"
    )]
    Tls,
    /// The exporter refused its configuration (an endpoint it cannot use, such as `https://`
    /// without a TLS feature). Its message never carries the endpoint's path or query.
    #[error("the OTLP trace exporter")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
}

impl Classify for OtelError {
    fn retry(&self) -> Retry {
        match self {
            OtelError::Tls | OtelError::Exporter(_) => Retry::Permanent,
        }
    }
}

/// The tracer provider, shut down (its last spans exported) when this guard is dropped or
/// [`Telemetry::shutdown`] is called: keep it for the life of the process, and end it while the
/// tokio runtime still runs (the gRPC channel's tasks live there).
#[derive(Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// No export.
    pub fn off() -> Telemetry {
        Telemetry { provider: None }
    }

    pub fn is_on(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports what is left and stops the exporter (at most 5 s); idempotent.
    pub fn shutdown(&mut self) {
        if let Some(p) = self.provider.take() {
            ENABLED.store(false, Ordering::Relaxed);
            if let Err(e) = p.shutdown() {
                // The subscriber may be the one being shut down: say it on stderr.
                eprintln!("warning: exporting the last spans failed: {e}");
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Builds the exporter and the tracer provider for `export` and turns span making on. Must run
/// inside a tokio runtime (the tonic channel is created there), which must outlive the returned
/// guard. The span processor is the SDK's batch processor (`OTEL_BSP_*` variables honoured);
/// resource attributes come from the SDK's detectors (`OTEL_RESOURCE_ATTRIBUTES`, SDK name and
/// version) with `service.name` from `export`.
pub fn start(export: &TraceExport) -> Result<(SdkTracerProvider, Telemetry), OtelError> {
    use opentelemetry_otlp::WithExportConfig;
    if export
        .endpoint
        .get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
    {
        return Err(OtelError::Tls);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(export.endpoint.clone())
        .build()
        .map_err(OtelError::Exporter)?;
    let resource = Resource::builder()
        .with_service_name(export.service_name.clone())
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    ENABLED.store(true, Ordering::Relaxed);
    Ok((
        provider.clone(),
        Telemetry {
            provider: Some(provider),
        },
    ))
}

/// The `tracing` layer that turns txflow's spans into OpenTelemetry spans of `provider`: only
/// spans of txflow's own targets (and their warnings and errors, as span events), whatever the
/// log filter says.
pub fn layer<S>(provider: &SdkTracerProvider) -> impl Layer<S> + Send + Sync + 'static
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync + 'static,
{
    let tracer = provider.tracer("txflow");
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target().starts_with("txflow") && (m.is_span() || *m.level() <= tracing::Level::WARN)
        }))
}

// ---- W3C trace context ----

struct Carrier<'a>(Option<&'a str>);

impl Extractor for Carrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == "traceparent").then_some(self.0).flatten()
    }
    fn keys(&self) -> Vec<&str> {
        vec!["traceparent"]
    }
}

#[derive(Default)]
struct Out(Option<String>);

impl Injector for Out {
    fn set(&mut self, key: &str, value: String) {
        if key == "traceparent" {
            self.0 = Some(value);
        }
    }
}

/// The remote context of a `traceparent` header, if it is a valid one.
pub fn extract(traceparent: &str) -> Option<Context> {
    let cx = TraceContextPropagator::new().extract(&Carrier(Some(traceparent)));
    cx.span().span_context().is_valid().then_some(cx)
}

/// The `traceparent` of a context's span, if it has a valid one.
pub fn inject(cx: &Context) -> Option<String> {
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut out = Out::default();
    TraceContextPropagator::new().inject_context(cx, &mut out);
    out.0
}

/// The trace context of `span` (an invalid one for a disabled span).
pub fn context_of(span: &Span) -> Context {
    span.context()
}

/// The span context of a context (for links and comparisons).
pub fn span_context(cx: &Context) -> SpanContext {
    cx.span().span_context().clone()
}

// ---- the runtime's spans; each is `Span::none()` when tracing is off ----

/// The span of one consumed message (`"<role> process"`, kind consumer, the OpenTelemetry
/// messaging attributes), child of the message's `traceparent`.
#[allow(clippy::too_many_arguments)]
pub fn process_span(
    role: Role,
    topic: &str,
    group: &str,
    partition: i32,
    offset: i64,
    event_id: &str,
    tx_id: Option<&str>,
    signer: &(ChainId, Signer),
    traceparent: Option<&str>,
) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        "process",
        otel.name = format!("{role} process"),
        otel.kind = "consumer",
        messaging.system = "kafka",
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = topic,
        messaging.consumer.group.name = group,
        messaging.destination.partition.id = partition.to_string(),
        messaging.kafka.offset = offset,
        messaging.message.id = event_id,
        txflow.role = role.as_str(),
        chain_id = signer.0.0,
        signer = signer.1.as_str(),
        tx_id = tx_id,
        fencing_token = tracing::field::Empty,
    );
    if let Some(cx) = traceparent.and_then(extract) {
        let _ = span.set_parent(cx);
    }
    span
}

/// The span of one drive of a signer (`"<role> drive"`): child of the first message whose batch
/// triggered it (linked to the others), a root for a recovery or a ready drive.
pub fn drive_span(
    role: Role,
    chain_id: ChainId,
    signer: &Signer,
    fencing_token: i64,
    recovery: bool,
    causes: &[Context],
) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        "drive",
        otel.name = format!("{role} drive"),
        otel.kind = "internal",
        txflow.role = role.as_str(),
        chain_id = chain_id.0,
        signer = signer.as_str(),
        fencing_token,
        recovery,
        tx_id = tracing::field::Empty,
        txflow.outputs = tracing::field::Empty,
    );
    if let Some((first, rest)) = causes.split_first() {
        let _ = span.set_parent(first.clone());
        for cx in rest {
            span.add_link(span_context(cx));
        }
    } else {
        // Not the current span's child: a drive is work of its own.
        let _ = span.set_parent(Context::new());
    }
    span
}

/// The span of one produced message (`"send <topic>"`, kind producer), child of `parent`; its
/// context is what the message's `traceparent` carries. `link`: the span that produced it when
/// that is not the parent (a drive working on a transaction of another trace).
pub fn send_span(
    topic: &str,
    key: &str,
    event_id: &str,
    tx_id: Option<&str>,
    parent: Context,
    link: Option<SpanContext>,
) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        "send",
        otel.name = format!("send {topic}"),
        otel.kind = "producer",
        messaging.system = "kafka",
        messaging.operation.type = "send",
        messaging.operation.name = "send",
        messaging.destination.name = topic,
        messaging.kafka.message.key = key,
        messaging.message.id = event_id,
        tx_id = tx_id,
    );
    let _ = span.set_parent(parent);
    if let Some(l) = link {
        span.add_link(l);
    }
    span
}

/// The span of one JSON-RPC call (`"rpc <method>"`, kind client), a child of the current span;
/// none outside a stage's span (a head poll is not worth a trace of its own). Never the
/// endpoint's URL.
pub fn rpc_span(method: &'static str) -> Span {
    if !enabled() || Span::current().is_none() {
        return Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        "rpc",
        otel.name = format!("rpc {method}"),
        otel.kind = "client",
        rpc.system = "jsonrpc",
        rpc.method = method,
        rpc.jsonrpc.version = "2.0",
        otel.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// Marks an RPC span failed (`error_type`: a short, URL-free class of the failure).
pub fn rpc_failed(span: &Span, error_type: &'static str) {
    if !span.is_none() {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", error_type);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.get(k).cloned()
    }

    #[test]
    fn without_an_endpoint_nothing_is_exported() {
        let off = crate::config::Config::default();
        assert_eq!(off.otlp_endpoint, None, "off by default");
        assert_eq!(decide(None, None, "txflow-allocator", env(&[])), None);
        // Other OTEL_* variables alone do not turn it on.
        assert_eq!(
            decide(
                None,
                None,
                "txflow-allocator",
                env(&[
                    ("OTEL_SERVICE_NAME", "x"),
                    ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod"),
                    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", " "),
                ])
            ),
            None
        );
        // Turned off explicitly, whatever the endpoint.
        let on = Some("http://collector:4317");
        assert!(decide(on, None, "txflow", env(&[])).is_some());
        for (var, value) in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(
                decide(on, None, "txflow", env(&[(var, value)])),
                None,
                "{var}"
            );
        }
        // Nothing made: span constructors answer `Span::none()` while nothing was started.
        assert!(!enabled());
        assert!(rpc_span("eth_blockNumber").is_none());
    }

    #[test]
    fn an_endpoint_turns_export_on_with_the_role_as_service_name() {
        // The configuration's endpoint is OTEL_EXPORTER_OTLP_ENDPOINT over the file's key.
        let c = crate::config::Config::from_lookup(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://c:4317",
        )]))
        .expect("valid");
        let endpoint = c.otlp_endpoint.as_deref();
        assert_eq!(endpoint, Some("http://c:4317"));
        assert_eq!(
            decide(
                endpoint,
                None,
                &service_name_of(Role::SignerGateway),
                env(&[])
            ),
            Some(TraceExport {
                endpoint: "http://c:4317".into(),
                service_name: "txflow-signer-gateway".into(),
            })
        );
        // The traces endpoint is above the general one.
        let e = decide(
            endpoint,
            None,
            "txflow",
            env(&[(TRACES_ENDPOINT_VAR, "http://traces:4317")]),
        )
        .expect("on");
        assert_eq!(e.endpoint, "http://traces:4317");
        // service.name: OTEL_RESOURCE_ATTRIBUTES over the default, OTEL_SERVICE_NAME over both.
        let attrs = env(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "a=1, service.name=billing-tx ,b=2",
        )]);
        assert_eq!(
            decide(endpoint, None, "txflow", attrs)
                .expect("on")
                .service_name,
            "billing-tx"
        );
        let named = crate::config::Config::from_lookup(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_SERVICE_NAME", "named"),
        ]))
        .expect("valid");
        let attrs = env(&[("OTEL_RESOURCE_ATTRIBUTES", "service.name=billing-tx")]);
        assert_eq!(
            decide(
                named.otlp_endpoint.as_deref(),
                named.otel_service_name.as_deref(),
                "txflow",
                attrs
            )
            .expect("on")
            .service_name,
            "named"
        );
        // An endpoint that is not an http(s) URL is refused with its variable named.
        let err = crate::config::Config::from_lookup(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "collector:4317",
        )]))
        .expect_err("not a URL");
        assert!(
            err.to_string().contains("OTEL_EXPORTER_OTLP_ENDPOINT"),
            "{err}"
        );
    }

    #[test]
    fn traceparents_round_trip_and_garbage_is_no_parent() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let cx = extract(tp).expect("a valid traceparent");
        assert_eq!(inject(&cx).as_deref(), Some(tp));
        for bad in [
            "garbage",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "",
        ] {
            assert!(extract(bad).is_none(), "{bad}");
        }
        assert_eq!(inject(&Context::new()), None);
    }
}
