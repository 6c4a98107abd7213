//! An in-process OTLP gRPC trace receiver (the collector's `TraceService`, from
//! `opentelemetry-proto`, on a tonic server at `127.0.0.1:0`) that keeps every span it is sent
//! with its resource's `service.name`: what the trace tests point `OTEL_EXPORTER_OTLP_ENDPOINT`
//! at. (`fake-opentelemetry-collector` drops resource attributes, hence this one.)

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};

/// A span as received, ids in lowercase hex.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// `service.name` of the resource the span came with.
    pub service_name: String,
    /// Every attribute of that resource.
    pub resource: BTreeMap<String, String>,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// OTLP `SpanKind`: 1 internal, 2 server, 3 client, 4 producer, 5 consumer.
    pub kind: i32,
    /// Attributes as text (strings as they are, other values in their debug form).
    pub attributes: BTreeMap<String, String>,
    /// `(trace_id, span_id)` of each link.
    pub links: Vec<(String, String)>,
    /// OTLP status code: 0 unset, 1 ok, 2 error.
    pub status: i32,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// The receiver; stopped when dropped.
pub struct OtlpReceiver {
    /// `http://127.0.0.1:<port>`, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let addr = listener.local_addr().expect("its address");
        let spans: Arc<Mutex<Vec<ReceivedSpan>>> = Arc::default();
        let service = Collector {
            spans: spans.clone(),
        };
        let task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(service))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
            if let Err(e) = served {
                eprintln!("the OTLP receiver stopped: {e}");
            }
        });
        OtlpReceiver {
            endpoint: format!("http://{addr}"),
            spans,
            task,
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Collector {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
}

fn text(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(&kv.value)))
        .collect()
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for rs in request.into_inner().resource_spans {
            let resource = rs
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            let service_name = resource.get("service.name").cloned().unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(ReceivedSpan {
                        service_name: service_name.clone(),
                        resource: resource.clone(),
                        trace_id: hex::encode(&s.trace_id),
                        span_id: hex::encode(&s.span_id),
                        parent_span_id: hex::encode(&s.parent_span_id),
                        name: s.name.clone(),
                        kind: s.kind,
                        attributes: attributes(&s.attributes),
                        links: s
                            .links
                            .iter()
                            .map(|l| (hex::encode(&l.trace_id), hex::encode(&l.span_id)))
                            .collect(),
                        status: s.status.map(|st| st.code).unwrap_or(0),
                    });
                }
            }
        }
        if let Ok(mut spans) = self.spans.lock() {
            spans.extend(got);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}
