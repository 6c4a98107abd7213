//! An in-process OTLP gRPC metrics receiver (the collector's `MetricsService`, from
//! `opentelemetry-proto`, on a tonic server at `127.0.0.1:0`) that keeps, per export, the
//! resource's `service.name` and the names of the metrics sent: what the metrics test points
//! `OTEL_EXPORTER_OTLP_ENDPOINT` at.

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value;

/// One metric as received: the `service.name` of its resource and its OTLP name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedMetric {
    pub service_name: String,
    pub name: String,
}

/// The receiver; stopped when dropped.
pub struct OtlpMetricsReceiver {
    /// `http://127.0.0.1:<port>`, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    metrics: Arc<Mutex<Vec<ReceivedMetric>>>,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpMetricsReceiver {
    pub async fn start() -> OtlpMetricsReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP metrics receiver");
        let addr = listener.local_addr().expect("its address");
        let metrics: Arc<Mutex<Vec<ReceivedMetric>>> = Arc::default();
        let service = Collector {
            metrics: metrics.clone(),
        };
        let task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(MetricsServiceServer::new(service))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
            if let Err(e) = served {
                eprintln!("the OTLP metrics receiver stopped: {e}");
            }
        });
        OtlpMetricsReceiver {
            endpoint: format!("http://{addr}"),
            metrics,
            task,
        }
    }

    /// Every metric received so far (one entry per metric per export).
    pub fn metrics(&self) -> Vec<ReceivedMetric> {
        self.metrics.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

impl Drop for OtlpMetricsReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Collector {
    metrics: Arc<Mutex<Vec<ReceivedMetric>>>,
}

#[tonic::async_trait]
impl MetricsService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for rm in request.into_inner().resource_metrics {
            let service_name = rm
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
                .and_then(|kv| kv.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(any_value::Value::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for sm in rm.scope_metrics {
                for m in sm.metrics {
                    got.push(ReceivedMetric {
                        service_name: service_name.clone(),
                        name: m.name,
                    });
                }
            }
        }
        if let Ok(mut all) = self.metrics.lock() {
            all.extend(got);
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}
