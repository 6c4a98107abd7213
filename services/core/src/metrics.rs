//! The metrics of txflow (issue 17): every instrument in one place, on the OpenTelemetry metrics
//! API, read by a Prometheus exporter (`/metrics`, see `http.rs`) and, when an OTLP endpoint is
//! configured, pushed by an OTLP gRPC periodic reader too.
//!
//! The catalogue (names, labels, meaning) is in ARCHITECTURE.md, "Observability". Labels are
//! bounded: roles, chain ids, configured signers, states, result codes, the position of an RPC
//! endpoint in `TXFLOW_RPC_URLS` (never its URL); never a transaction, request or hash id.
//!
//! [`get`] is the one accessor: cheap (an atomic load), and backed by no-op instruments until
//! [`init`] installed the real ones, so library code and tests record without any set-up and pay
//! about nothing when metrics are off. Callers call `get()` at each use rather than keeping the
//! reference, so that what they record after `init` reaches the exporter.

use std::sync::{LazyLock, OnceLock};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter, MeterProvider};
use opentelemetry_sdk::metrics::SdkMeterProvider;

use crate::domain::{ChainId, Role, Signer};
use crate::state::TxState;

/// The meter's (instrumentation scope's) name.
pub const METER: &str = "txflow";

/// Bucket bounds of every duration histogram, in seconds (the exporter's default bounds are
/// millisecond-sized: 0, 5, 10 … 10000).
pub const SECONDS_BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Bucket bounds of `stage.batch.size`, in messages.
pub const BATCH_SIZE_BUCKETS: [f64; 10] =
    [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];

/// The JSON-RPC methods `chain.rs` calls: their `rpc_calls_total` series are registered at 0.
pub const RPC_METHODS: [&str; 8] = [
    "eth_blockNumber",
    "eth_getBlockByNumber",
    "eth_getTransactionCount",
    "eth_getTransactionByHash",
    "eth_estimateGas",
    "eth_feeHistory",
    "eth_sendRawTransaction",
    "eth_getTransactionReceipt",
];

/// `lease.acquire` results.
pub mod lease_result {
    pub const ACQUIRED: &str = "acquired";
    pub const RENEWED: &str = "renewed";
    pub const RETAKEN: &str = "retaken";
    pub const STOLEN: &str = "stolen";
    pub const BUSY: &str = "busy";
    pub const ERROR: &str = "error";
    pub const ALL: [&str; 6] = [ACQUIRED, RENEWED, RETAKEN, STOLEN, BUSY, ERROR];
}

/// `tx.create` results (the allocator's intake).
pub mod create_result {
    pub const ACCEPTED: &str = "accepted";
    pub const DUPLICATE: &str = "duplicate";
    pub const INVALID: &str = "invalid";
    pub const HELD: &str = "held";
    pub const ALL: [&str; 4] = [ACCEPTED, DUPLICATE, INVALID, HELD];
}

/// `tx.submit` results (the broadcaster's sends, from `chain::SendOutcome`).
pub mod submit_result {
    pub const ACCEPTED: &str = "accepted";
    pub const KNOWN: &str = "known";
    pub const NONCE_TOO_LOW: &str = "nonce_too_low";
    pub const UNDERPRICED: &str = "underpriced";
    pub const FUNDS: &str = "funds";
    pub const ERROR: &str = "error";
    pub const ALL: [&str; 6] = [ACCEPTED, KNOWN, NONCE_TOO_LOW, UNDERPRICED, FUNDS, ERROR];
}

/// `receipt.check` results.
pub mod receipt_result {
    pub const FOUND: &str = "found";
    pub const NOT_FOUND: &str = "not_found";
    pub const ERROR: &str = "error";
    pub const ALL: [&str; 3] = [FOUND, NOT_FOUND, ERROR];
}

/// The gateway's refusal codes whose `gateway_rejections_total` series are registered at 0
/// ([`Metrics::register_gateway`]): the limits and the authentication failures.
pub const GATEWAY_REJECTION_CODES: [&str; 5] = [
    "RATE_LIMIT_EXCEEDED",
    "DAILY_LIMIT_EXCEEDED",
    "DAILY_AMOUNT_EXCEEDED",
    "UNAUTHORIZED",
    "FORBIDDEN",
];

/// The dead-letter reasons of the runtime itself (a handler's codes come on top, as they occur).
pub const RUNTIME_DLQ_REASONS: [&str; 2] = ["UNDECODABLE", "EMPTY_MESSAGE"];

/// Every instrument of the catalogue.
pub struct Metrics {
    lease_acquire: Counter<u64>,
    lease_fenced: Counter<u64>,
    tx_create: Counter<u64>,
    tx_submit: Counter<u64>,
    receipt_check: Counter<u64>,
    confirmations_newfork: Counter<u64>,
    tx_reverted: Counter<u64>,
    fsm_transition: Counter<u64>,
    tx_resubmit: Counter<u64>,
    tx_gas_bump: Counter<u64>,
    tx_reorg: Counter<u64>,
    tx_defensive_cancellation: Counter<u64>,
    dead_letters: Counter<u64>,
    rpc_calls: Counter<u64>,
    conservation_violations: Counter<u64>,
    transfer_transition: Counter<u64>,
    transfer_attention: Gauge<u64>,
    gateway_requests: Counter<u64>,
    gateway_rejections: Counter<u64>,
    stage_batch_size: Histogram<u64>,
    stage_batch_duration: Histogram<f64>,
    stage_hop_latency: Histogram<f64>,
    rpc_duration: Histogram<f64>,
    tx_open: Gauge<u64>,
    signer_held: Gauge<u64>,
    outbox_backlog: Gauge<u64>,
    consumer_lag: Gauge<u64>,
    rpc_endpoint_up: Gauge<u64>,
    lease_held: Gauge<u64>,
}

fn role(r: Role) -> KeyValue {
    KeyValue::new("role", r.as_str())
}

fn chain(c: ChainId) -> KeyValue {
    KeyValue::new("chain_id", c.0.to_string())
}

fn signer(s: &Signer) -> KeyValue {
    KeyValue::new("signer", s.to_string())
}

fn endpoint(i: usize) -> KeyValue {
    KeyValue::new("endpoint", i.to_string())
}

impl Metrics {
    fn new(meter: &Meter) -> Metrics {
        let counter = |name: &'static str, description: &'static str| {
            meter
                .u64_counter(name)
                .with_description(description)
                .build()
        };
        let seconds = |name: &'static str, description: &'static str| {
            meter
                .f64_histogram(name)
                .with_description(description)
                .with_unit("s")
                .with_boundaries(SECONDS_BUCKETS.to_vec())
                .build()
        };
        let gauge = |name: &'static str, description: &'static str| {
            meter.u64_gauge(name).with_description(description).build()
        };
        Metrics {
            lease_acquire: counter("lease.acquire", "Lease acquisitions and renewals by result"),
            lease_fenced: counter(
                "lease.fenced",
                "Critical writes refused by the fence (0 rows: the lease or token is no longer current)",
            ),
            tx_create: counter("tx.create", "Requests taken in by the allocator, by result"),
            tx_submit: counter(
                "tx.submit",
                "eth_sendRawTransaction answers to the broadcaster's sends, by result",
            ),
            receipt_check: counter("receipt.check", "Receipt lookups by result"),
            confirmations_newfork: counter(
                "confirmations.newfork",
                "TxConfirmationsUpdated announced with new_fork=true",
            ),
            tx_reverted: counter(
                "tx.reverted",
                "Transactions mined with status 0 (REVERTED) whose move landed (receipt checker)",
            ),
            fsm_transition: counter(
                "fsm.transition",
                "managed_tx state changes (from, to as the database spells them)",
            ),
            tx_resubmit: counter(
                "tx.resubmit",
                "Same-bytes re-sends of submitted transactions",
            ),
            tx_gas_bump: counter("tx.gas_bump", "Gas bumps decided, by result"),
            tx_reorg: counter(
                "tx.reorg",
                "Mined or confirmed transactions whose block a reorg removed, by depth",
            ),
            tx_defensive_cancellation: counter(
                "tx.defensive_cancellation",
                "Defensive cancellations after a deep reorg, by step",
            ),
            dead_letters: counter("dead_letters", "Messages sent to the dead-letter topic"),
            rpc_calls: counter(
                "rpc.calls",
                "JSON-RPC calls by method, endpoint (position in TXFLOW_RPC_URLS) and result",
            ),
            conservation_violations: counter(
                "conservation.violations",
                "(user, asset) pairs the transfer conservation check found out of balance, by asset",
            ),
            transfer_transition: counter(
                "transfer.transition",
                "Transfer state changes (seed 004 §2.2), by from and to state",
            ),
            gateway_requests: counter(
                "gateway.requests",
                "HTTP requests the gateway answered, by route (its template) and status",
            ),
            gateway_rejections: counter(
                "gateway.rejections",
                "Error answers of the gateway, by code (rate and daily limits, authentication, validation, …)",
            ),
            stage_batch_size: meter
                .u64_histogram("stage.batch.size")
                .with_description("Messages per stage batch")
                .with_unit("{message}")
                .with_boundaries(BATCH_SIZE_BUCKETS.to_vec())
                .build(),
            stage_batch_duration: seconds(
                "stage.batch.duration",
                "Time to process one stage batch, drives included",
            ),
            stage_hop_latency: seconds(
                "stage.hop.latency",
                "Kafka message timestamp to the stage handling it",
            ),
            rpc_duration: seconds(
                "rpc.duration",
                "JSON-RPC call duration per endpoint attempt",
            ),
            tx_open: gauge(
                "tx.open",
                "managed_tx rows in the open (non-terminal, pre-receipt) states",
            ),
            signer_held: gauge("signer.held", "1 while the signer is held"),
            outbox_backlog: gauge("outbox.backlog", "Unpublished announced tx_events rows"),
            consumer_lag: gauge(
                "consumer.lag",
                "High watermark minus committed offset (wrong on tansu)",
            ),
            rpc_endpoint_up: gauge(
                "rpc.endpoint.up",
                "1 when the last call to the endpoint got an answer",
            ),
            lease_held: gauge("lease.held", "Leases this process holds"),
            transfer_attention: gauge(
                "transfer.attention",
                "Open transfers needing attention, by reason (sampled by the transfer coordinator)",
            ),
        }
    }

    /// A lease acquisition or renewal (`result`: one of [`lease_result`]).
    pub fn lease_acquire(&self, r: Role, result: &'static str) {
        self.lease_acquire
            .add(1, &[role(r), KeyValue::new("result", result)]);
    }

    /// A fenced write refused.
    pub fn lease_fenced(&self, r: Role) {
        self.lease_fenced.add(1, &[role(r)]);
    }

    /// `n` requests taken in by the allocator with `result` (one of [`create_result`]).
    pub fn tx_create(&self, result: &'static str, n: u64) {
        if n > 0 {
            self.tx_create.add(n, &[KeyValue::new("result", result)]);
        }
    }

    /// One send's answer (one of [`submit_result`]).
    pub fn tx_submit(&self, result: &'static str) {
        self.tx_submit.add(1, &[KeyValue::new("result", result)]);
    }

    /// One receipt lookup (one of [`receipt_result`]).
    pub fn receipt_check(&self, result: &'static str) {
        self.receipt_check
            .add(1, &[KeyValue::new("result", result)]);
    }

    /// `n` transactions mined with status 0 (REVERTED) on chain `c`.
    pub fn tx_reverted(&self, c: ChainId, n: u64) {
        if !enabled() || n == 0 {
            return;
        }
        self.tx_reverted.add(n, &[chain(c)]);
    }

    /// `n` confirmation lists announced with `new_fork = true`.
    pub fn confirmations_newfork(&self, c: ChainId, n: u64) {
        // Its labels allocate: nothing to do when the instruments are no-ops.
        if !enabled() {
            return;
        }
        if n > 0 {
            self.confirmations_newfork.add(n, &[chain(c)]);
        }
    }

    /// `n` rows moved from `from` to `to`.
    pub fn fsm_transition(&self, from: TxState, to: TxState, n: u64) {
        if n > 0 {
            self.fsm_transition.add(
                n,
                &[
                    KeyValue::new("from", from.as_str()),
                    KeyValue::new("to", to.as_str()),
                ],
            );
        }
    }

    /// A same-bytes re-send.
    pub fn tx_resubmit(&self, r: Role) {
        self.tx_resubmit.add(1, &[role(r)]);
    }

    /// A gas bump decided: `bumped` (attempt n+1 recorded) or `at_cap` (no room under the cap).
    pub fn tx_gas_bump(&self, result: &'static str, n: u64) {
        if n > 0 {
            self.tx_gas_bump.add(n, &[KeyValue::new("result", result)]);
        }
    }

    /// `n` transactions reorged out: `shallow` (not final yet) or `deep` (CONFIRMED).
    pub fn tx_reorg(&self, depth: &'static str, n: u64) {
        if n > 0 {
            self.tx_reorg.add(n, &[KeyValue::new("depth", depth)]);
        }
    }

    /// A defensive cancellation `signed` or `sent`.
    pub fn tx_defensive_cancellation(&self, step: &'static str, n: u64) {
        if n > 0 {
            self.tx_defensive_cancellation
                .add(n, &[KeyValue::new("step", step)]);
        }
    }

    /// A message dead-lettered with `reason` (its `error.code`, a bounded set of codes).
    pub fn dead_letter(&self, r: Role, reason: &str) {
        // Its labels allocate: nothing to do when the instruments are no-ops.
        if !enabled() {
            return;
        }
        self.dead_letters
            .add(1, &[role(r), KeyValue::new("reason", reason.to_string())]);
    }

    /// One JSON-RPC attempt on endpoint `index`: `answered` when the node answered (a result or
    /// its own JSON-RPC error), not when it timed out, failed in transport or rate-limited.
    pub fn rpc_call(&self, method: &'static str, index: usize, answered: bool, took: Duration) {
        // Its labels allocate: nothing to do when the instruments are no-ops.
        if !enabled() {
            return;
        }
        let result = if answered { "ok" } else { "error" };
        self.rpc_calls.add(
            1,
            &[
                KeyValue::new("method", method),
                endpoint(index),
                KeyValue::new("result", result),
            ],
        );
        self.rpc_duration.record(
            took.as_secs_f64(),
            &[KeyValue::new("method", method), endpoint(index)],
        );
        self.rpc_endpoint_up
            .record(u64::from(answered), &[endpoint(index)]);
    }

    /// A stage batch of `size` messages that took `took`.
    pub fn stage_batch(&self, r: Role, size: usize, took: Duration) {
        let attrs = [role(r)];
        self.stage_batch_size.record(size as u64, &attrs);
        self.stage_batch_duration.record(took.as_secs_f64(), &attrs);
    }

    /// A message handled `latency` after its Kafka timestamp.
    pub fn stage_hop_latency(&self, r: Role, latency: Duration) {
        self.stage_hop_latency
            .record(latency.as_secs_f64(), &[role(r)]);
    }

    /// Sampled: `n` open rows of `(chain, signer)` in `state`.
    pub fn tx_open(&self, c: ChainId, s: &Signer, state: TxState, n: u64) {
        // Its labels allocate: nothing to do when the instruments are no-ops.
        if !enabled() {
            return;
        }
        self.tx_open.record(
            n,
            &[chain(c), signer(s), KeyValue::new("state", state.as_str())],
        );
    }

    /// Sampled: whether the signer is held.
    pub fn signer_held(&self, r: Role, c: ChainId, s: &Signer, held: bool) {
        // Its labels allocate: nothing to do when the instruments are no-ops.
        if !enabled() {
            return;
        }
        self.signer_held
            .record(u64::from(held), &[role(r), chain(c), signer(s)]);
    }

    /// A (user, asset) pair found out of balance by the conservation check (seed 004 §7.2).
    pub fn conservation_violation(&self, asset: &str) {
        self.conservation_violations
            .add(1, &[KeyValue::new("asset", asset.to_string())]);
    }

    /// A transfer moved `from` → `to` (state names of seed 004 §2.1).
    pub fn transfer_transition(&self, from: &'static str, to: &'static str) {
        self.transfer_transition
            .add(1, &[KeyValue::new("from", from), KeyValue::new("to", to)]);
    }

    /// Sampled: open transfers needing attention, by `reason`: `target_pending_1m` (in
    /// TARGET_PENDING for over a minute: the target's outcome unknown, MON-001),
    /// `refund_failed_3` (COMPENSATING with three or more failed refunds, MON-002), `halted`
    /// (1 while a conservation violation is unresolved, MON-003), `user_rate_1m` (users with more
    /// than 60 transfers in the last minute, MON-004).
    pub fn transfer_attention(&self, reason: &'static str, n: u64) {
        self.transfer_attention
            .record(n, &[KeyValue::new("reason", reason)]);
    }

    /// A request the gateway answered: `route` is the matched route's template
    /// (`/api/v1/tx/{tx_id}`, `unmatched` for none), never the path itself.
    pub fn gateway_request(&self, route: &str, status: u16) {
        // Its labels allocate: nothing to do when the instruments are no-ops.
        if !enabled() {
            return;
        }
        self.gateway_requests.add(
            1,
            &[
                KeyValue::new("route", route.to_string()),
                KeyValue::new("status", status.to_string()),
            ],
        );
    }

    /// An error answer of the gateway with `code` (the seed's codes and the gateway's own).
    pub fn gateway_rejection(&self, code: &'static str) {
        self.gateway_rejections
            .add(1, &[KeyValue::new("code", code)]);
    }

    /// Records the gateway's refusal series ([`GATEWAY_REJECTION_CODES`]) with 0, so that they
    /// exist before the first refusal.
    pub fn register_gateway(&self) {
        for code in GATEWAY_REJECTION_CODES {
            self.gateway_rejections
                .add(0, &[KeyValue::new("code", code)]);
        }
    }

    /// Sampled: unpublished announced events.
    pub fn outbox_backlog(&self, n: u64) {
        self.outbox_backlog.record(n, &[]);
    }

    /// Sampled: a partition's lag (high watermark minus committed offset, 0 when negative).
    pub fn consumer_lag(&self, group: &str, topic: &str, partition: i32, lag: u64) {
        // Its labels allocate: nothing to do when the instruments are no-ops.
        if !enabled() {
            return;
        }
        self.consumer_lag.record(
            lag,
            &[
                KeyValue::new("group", group.to_string()),
                KeyValue::new("topic", topic.to_string()),
                KeyValue::new("partition", partition.to_string()),
            ],
        );
    }

    /// Sampled: the leases of `r` this process holds.
    pub fn lease_held(&self, r: Role, n: u64) {
        self.lease_held.record(n, &[role(r)]);
    }

    /// Records every series whose labels are known at start with 0, so that it exists before
    /// its first event (a dashboard query or alert then returns 0, not "no data").
    pub fn register(&self, roles: &[Role], c: ChainId, endpoints: usize) {
        for &r in roles {
            for result in lease_result::ALL {
                self.lease_acquire
                    .add(0, &[role(r), KeyValue::new("result", result)]);
            }
            self.lease_fenced.add(0, &[role(r)]);
            self.tx_resubmit.add(0, &[role(r)]);
            for reason in RUNTIME_DLQ_REASONS {
                self.dead_letters
                    .add(0, &[role(r), KeyValue::new("reason", reason)]);
            }
            self.lease_held.record(0, &[role(r)]);
        }
        for result in create_result::ALL {
            self.tx_create.add(0, &[KeyValue::new("result", result)]);
        }
        for result in submit_result::ALL {
            self.tx_submit.add(0, &[KeyValue::new("result", result)]);
        }
        for result in receipt_result::ALL {
            self.receipt_check
                .add(0, &[KeyValue::new("result", result)]);
        }
        self.confirmations_newfork.add(0, &[chain(c)]);
        self.tx_reverted.add(0, &[chain(c)]);
        for (from, to) in crate::state::TRANSITIONS {
            self.fsm_transition.add(
                0,
                &[
                    KeyValue::new("from", from.as_str()),
                    KeyValue::new("to", to.as_str()),
                ],
            );
        }
        for result in ["bumped", "at_cap"] {
            self.tx_gas_bump.add(0, &[KeyValue::new("result", result)]);
        }
        for depth in ["shallow", "deep"] {
            self.tx_reorg.add(0, &[KeyValue::new("depth", depth)]);
        }
        for step in ["signed", "sent"] {
            self.tx_defensive_cancellation
                .add(0, &[KeyValue::new("step", step)]);
        }
        for i in 0..endpoints {
            for method in RPC_METHODS {
                for result in ["ok", "error"] {
                    self.rpc_calls.add(
                        0,
                        &[
                            KeyValue::new("method", method),
                            endpoint(i),
                            KeyValue::new("result", result),
                        ],
                    );
                }
            }
        }
        // Known at start in every process (an alert's signal exists before its first event); the
        // transfer coordinator's sampling overwrites them in its own process.
        self.conservation_violations.add(0, &[]);
        for reason in [
            "target_pending_1m",
            "refund_failed_3",
            "halted",
            "user_rate_1m",
        ] {
            self.transfer_attention
                .record(0, &[KeyValue::new("reason", reason)]);
        }
        self.outbox_backlog.record(0, &[]);
    }
}

/// What [`init`] installed.
struct Installed {
    metrics: Metrics,
    provider: SdkMeterProvider,
    registry: prometheus::Registry,
}

static INSTALLED: OnceLock<Installed> = OnceLock::new();

static NOOP: LazyLock<Metrics> = LazyLock::new(|| {
    let provider = opentelemetry::metrics::NoopMeterProvider::new();
    Metrics::new(&provider.meter(METER))
});

/// The instruments: the installed ones, or no-op ones before [`init`] (or without it).
pub fn get() -> &'static Metrics {
    match INSTALLED.get() {
        Some(i) => &i.metrics,
        None => &NOOP,
    }
}

/// Whether [`init`] installed the real instruments.
pub fn enabled() -> bool {
    INSTALLED.get().is_some()
}

/// Why the metrics could not be set up or read.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("the Prometheus exporter: {0}")]
    Prometheus(#[source] opentelemetry_sdk::error::OTelSdkError),
    #[error("the OTLP metric exporter: {0}")]
    Otlp(#[source] opentelemetry_otlp::ExporterBuildError),
    #[error("metrics were already initialised in this process")]
    AlreadyInitialised,
    #[error("encoding the Prometheus exposition: {0}")]
    Encode(#[source] prometheus::Error),
}

impl crate::retry::Classify for MetricsError {
    fn retry(&self) -> crate::retry::Retry {
        crate::retry::Retry::Permanent
    }
}

/// How the metrics of a process are exported.
#[derive(Debug, Clone, Default)]
pub struct Setup {
    /// The configured `service.name` (`OTEL_SERVICE_NAME`, `telemetry.service_name`), if any.
    pub service_name: Option<String>,
    /// `service.name` when none is configured, nor given in `OTEL_RESOURCE_ATTRIBUTES`
    /// (`"txflow-<role>"`, `"txflow"` for `up`).
    pub default_service_name: String,
    /// The configured OTLP endpoint (gRPC; `OTEL_EXPORTER_OTLP_ENDPOINT`,
    /// `telemetry.otlp_endpoint`). `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` is above it; with
    /// neither there is no OTLP reader.
    pub otlp_endpoint: Option<String>,
    /// How often the OTLP reader pushes (default: `OTEL_METRIC_EXPORT_INTERVAL` ms, else 10 s).
    pub otlp_interval: Option<Duration>,
}

/// The signal-specific endpoint variable, above the configured endpoint.
pub const METRICS_ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT";

fn env_set(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|s| !s.trim().is_empty())
}

/// Whether the OTLP metric reader is wanted: an endpoint (the metrics variable or the configured
/// one), and neither `OTEL_SDK_DISABLED=true` nor `OTEL_METRICS_EXPORTER=none`.
pub fn otlp_wanted(configured: Option<&str>) -> bool {
    let off =
        |var: &str, value: &str| env_set(var).is_some_and(|v| v.trim().eq_ignore_ascii_case(value));
    if off("OTEL_SDK_DISABLED", "true") || off("OTEL_METRICS_EXPORTER", "none") {
        return false;
    }
    env_set(METRICS_ENDPOINT_VAR).is_some() || configured.is_some_and(|e| !e.trim().is_empty())
}

/// Installs the meter provider (a Prometheus reader, plus an OTLP gRPC periodic reader when an
/// endpoint is configured) and the instruments [`get`] returns from now on. Call once, early,
/// inside the Tokio runtime (the OTLP client needs it).
pub fn init(setup: &Setup) -> Result<(), MetricsError> {
    use opentelemetry_otlp::WithExportConfig;
    if INSTALLED.get().is_some() {
        return Err(MetricsError::AlreadyInitialised);
    }
    let registry = prometheus::Registry::new();
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .build()
        .map_err(MetricsError::Prometheus)?;
    // The SDK's detectors read OTEL_RESOURCE_ATTRIBUTES (and OTEL_SERVICE_NAME).
    let mut resource = opentelemetry_sdk::Resource::builder();
    let in_attributes = env_set("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| {
        a.split(',')
            .any(|kv| kv.trim().starts_with("service.name="))
    });
    match &setup.service_name {
        Some(name) => resource = resource.with_service_name(name.clone()),
        None if !in_attributes => {
            resource = resource.with_service_name(setup.default_service_name.clone())
        }
        None => {}
    }
    let mut builder = SdkMeterProvider::builder()
        .with_resource(resource.build())
        .with_reader(exporter);
    if otlp_wanted(setup.otlp_endpoint.as_deref()) {
        let mut otlp = opentelemetry_otlp::MetricExporter::builder().with_tonic();
        // The signal-specific variable, read by the exporter itself, is above the configured
        // endpoint; a programmatic endpoint would be above both.
        if env_set(METRICS_ENDPOINT_VAR).is_none()
            && let Some(endpoint) = &setup.otlp_endpoint
        {
            otlp = otlp.with_endpoint(endpoint.clone());
        }
        let otlp = otlp.build().map_err(MetricsError::Otlp)?;
        // `OTEL_METRIC_EXPORT_INTERVAL` (ms), read by the SDK, when set; else 10 s (the SDK's own
        // default is 60 s).
        let mut reader = opentelemetry_sdk::metrics::PeriodicReader::builder(otlp);
        if env_set("OTEL_METRIC_EXPORT_INTERVAL").is_none() || setup.otlp_interval.is_some() {
            reader = reader.with_interval(setup.otlp_interval.unwrap_or(Duration::from_secs(10)));
        }
        let reader = reader.build();
        builder = builder.with_reader(reader);
    }
    let provider = builder.build();
    let metrics = Metrics::new(&provider.meter(METER));
    INSTALLED
        .set(Installed {
            metrics,
            provider,
            registry,
        })
        .map_err(|_| MetricsError::AlreadyInitialised)
}

/// The Prometheus text exposition of every metric; `None` when [`init`] was not called.
pub fn encode_text() -> Option<Result<String, MetricsError>> {
    use prometheus::Encoder;
    let installed = INSTALLED.get()?;
    let families = installed.registry.gather();
    let mut out = Vec::new();
    Some(
        prometheus::TextEncoder::new()
            .encode(&families, &mut out)
            .map_err(MetricsError::Encode)
            .map(|()| String::from_utf8_lossy(&out).into_owned()),
    )
}

/// Pushes what the OTLP reader has not pushed yet and stops the readers (at process exit).
/// Blocking: call it from `spawn_blocking` or outside the runtime's worker threads.
pub fn shutdown() {
    if let Some(i) = INSTALLED.get()
        && let Err(e) = i.provider.shutdown()
    {
        tracing::debug!(error = %e, "metrics shutdown");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accessor_works_without_initialisation() {
        // Nothing was installed in this test process: every recording is a no-op, not a panic,
        // and there is no exposition.
        assert!(!enabled());
        let m = get();
        let signer = Signer::parse("0x00000000000000000000000000000000000000aa").expect("signer");
        m.lease_acquire(Role::Allocator, lease_result::ACQUIRED);
        m.lease_fenced(Role::Broadcaster);
        m.tx_create(create_result::ACCEPTED, 3);
        m.tx_submit(submit_result::KNOWN);
        m.fsm_transition(TxState::Submitted, TxState::Mined, 2);
        m.rpc_call("eth_blockNumber", 0, true, Duration::from_millis(3));
        m.stage_batch(Role::Allocator, 10, Duration::from_millis(20));
        m.tx_open(ChainId(1), &signer, TxState::Signed, 4);
        m.signer_held(Role::Broadcaster, ChainId(1), &signer, false);
        m.register(&Role::PIPELINE, ChainId(1), 2);
        assert!(std::ptr::eq(get(), m), "the same no-op instance each time");
        assert!(encode_text().is_none());
    }

    #[test]
    fn the_buckets_are_strictly_increasing() {
        for b in [&SECONDS_BUCKETS[..], &BATCH_SIZE_BUCKETS[..]] {
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
    }
}
