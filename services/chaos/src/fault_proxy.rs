//! A JSON-RPC fault proxy (in-process, hyper): forwards every request to an upstream node, except
//! where a [`Rule`] says to fail it — an HTTP status (5xx, 429), a delay (past the client's timeout),
//! a dropped connection, a JSON-RPC error, a JSON-RPC result of the test's choosing (a lagging or
//! lying node: `null`, "unknown", for a transaction it has), "forward, then lose the response"
//! (the node acts, the client never hears), or "forward, then answer an error" (the node acts, the
//! client hears it failed). It counts what it saw and what it did, so that a test can check the faults
//! really happened.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// What to do instead of (or around) forwarding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this HTTP status and no JSON-RPC body (502, 503, 429, …).
    Status(u16),
    /// Wait this long, then forward.
    Delay(Duration),
    /// Close the connection without answering.
    Reset,
    /// Answer with this JSON-RPC error, without forwarding.
    RpcError { code: i64, message: String },
    /// Answer with this JSON-RPC result, without forwarding: `Value::Null` is a node's "unknown"
    /// (no such transaction, no receipt) whatever the chain holds.
    Result(serde_json::Value),
    /// Forward, then close the connection without passing the answer on.
    ForwardThenLose,
    /// Forward, then answer with this JSON-RPC error instead of the node's answer: the node
    /// acted (took the transaction, say), the client is told it failed.
    ForwardThenError { code: i64, message: String },
}

impl Fault {
    fn label(&self) -> &'static str {
        match self {
            Fault::Status(_) => "status",
            Fault::Delay(_) => "delay",
            Fault::Reset => "reset",
            Fault::RpcError { .. } => "rpc_error",
            Fault::Result(_) => "result",
            Fault::ForwardThenLose => "forward_then_lose",
            Fault::ForwardThenError { .. } => "forward_then_error",
        }
    }
}

/// Applies `fault` to the calls of `method` (`None`: of every method) whose 1-based number `n`
/// (counted per method) has `n % every == offset`: by default calls `every`, `2·every`, …
/// Rules with one `every` and distinct offsets never fire on the same call, and leave the calls
/// between them alone. The first rule that fires wins.
#[derive(Debug, Clone)]
pub struct Rule {
    pub method: Option<String>,
    pub every: u64,
    pub offset: u64,
    pub fault: Fault,
}

impl Rule {
    pub fn on(method: &str, every: u64, fault: Fault) -> Rule {
        Rule {
            method: Some(method.to_string()),
            every: every.max(1),
            offset: 0,
            fault,
        }
    }

    pub fn all(every: u64, fault: Fault) -> Rule {
        Rule {
            method: None,
            every: every.max(1),
            offset: 0,
            fault,
        }
    }

    /// The same rule on the calls with `n % every == offset` instead.
    pub fn offset(self, offset: u64) -> Rule {
        Rule {
            offset: offset % self.every,
            ..self
        }
    }
}

#[derive(Default)]
struct Counts {
    /// Calls seen per method.
    calls: BTreeMap<String, u64>,
    /// Faults applied per (method, fault kind).
    faults: BTreeMap<(String, &'static str), u64>,
}

struct State {
    upstream: String,
    client: reqwest::Client,
    rules: Mutex<Vec<Rule>>,
    counts: Mutex<Counts>,
    /// A lagging node: the chain as it stood at this block ([`FaultProxy::lag_at`]).
    frozen: Mutex<Option<u64>>,
}

/// A running proxy, stopped when dropped.
pub struct FaultProxy {
    pub url: String,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy on a free port in front of `upstream`, with `rules`.
    pub async fn start(upstream: &str, rules: Vec<Rule>) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(State {
            upstream: upstream.to_string(),
            client: reqwest::Client::new(),
            rules: Mutex::new(rules),
            counts: Mutex::new(Counts::default()),
            frozen: Mutex::new(None),
        });
        let s = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let s = s.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| handle(s.clone(), req));
                    // A connection ends with an error when a fault drops it: expected.
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(FaultProxy {
            url: format!("http://127.0.0.1:{port}"),
            state,
            task,
        })
    }

    /// Replaces the rules (an empty list: forward everything).
    pub fn set_rules(&self, rules: Vec<Rule>) {
        *self.state.rules.lock().unwrap_or_else(|p| p.into_inner()) = rules;
    }

    /// Makes the proxy a node that lags at block `head` (`None`: follows the upstream again):
    /// its head is `head`, a block above it is unknown (`null`), a transaction or receipt in a
    /// block above it is unknown, and an account's nonce is the one at `head`. Everything else
    /// is forwarded (a lagging node still takes transactions). The rules apply first.
    pub fn lag_at(&self, head: Option<u64>) {
        *self.state.frozen.lock().unwrap_or_else(|p| p.into_inner()) = head;
    }

    /// A handle for another task.
    pub fn handle(&self) -> ProxyHandle {
        ProxyHandle(self.state.clone())
    }

    /// Calls seen, per method.
    pub fn calls(&self) -> BTreeMap<String, u64> {
        self.state
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .calls
            .clone()
    }

    /// All calls seen.
    pub fn total_calls(&self) -> u64 {
        self.calls().values().sum()
    }

    /// Faults applied, per (method, kind: `status`, `delay`, `reset`, `rpc_error`, `result`,
    /// `forward_then_lose`, `forward_then_error`).
    pub fn faults(&self) -> BTreeMap<(String, &'static str), u64> {
        self.state
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .faults
            .clone()
    }
}

/// A handle that changes a running proxy's faults from another task.
#[derive(Clone)]
pub struct ProxyHandle(Arc<State>);

impl ProxyHandle {
    /// [`FaultProxy::set_rules`].
    pub fn set_rules(&self, rules: Vec<Rule>) {
        *self.0.rules.lock().unwrap_or_else(|p| p.into_inner()) = rules;
    }

    /// [`FaultProxy::lag_at`].
    pub fn lag_at(&self, head: Option<u64>) {
        *self.0.frozen.lock().unwrap_or_else(|p| p.into_inner()) = head;
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The dropped connection of [`Fault::Reset`] and [`Fault::ForwardThenLose`]: hyper closes the
/// connection without a response when the service fails.
#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by the fault proxy")
    }
}

impl std::error::Error for Dropped {}

fn respond(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// A JSON-RPC result answer to the call with this `id`.
fn rpc_result(id: &serde_json::Value, result: &serde_json::Value) -> Response<Full<Bytes>> {
    let answer = serde_json::json!({"jsonrpc": "2.0", "id": id, "result": result});
    respond(StatusCode::OK, Bytes::from(answer.to_string()))
}

/// A JSON-RPC error answer to the call with this `id`.
fn rpc_error(id: &serde_json::Value, code: i64, message: &str) -> Response<Full<Bytes>> {
    let answer = serde_json::json!({
        "jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}
    });
    respond(StatusCode::OK, Bytes::from(answer.to_string()))
}

async fn forward(s: &State, body: Bytes) -> Response<Full<Bytes>> {
    let sent = s
        .client
        .post(&s.upstream)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    match sent {
        Ok(r) => {
            let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::OK);
            let bytes = r.bytes().await.unwrap_or_default();
            respond(status, bytes)
        }
        Err(_) => respond(StatusCode::BAD_GATEWAY, Bytes::new()),
    }
}

async fn handle(
    s: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Box<dyn std::error::Error + Send + Sync>> {
    let body = req.into_body().collect().await?.to_bytes();
    let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let first = if parsed.is_array() {
        parsed[0].clone()
    } else {
        parsed
    };
    let method = first["method"].as_str().unwrap_or("?").to_string();
    let id = first["id"].clone();
    let fault = {
        let rules = s.rules.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut counts = s.counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = {
            let c = counts.calls.entry(method.clone()).or_insert(0);
            *c += 1;
            *c
        };
        let fault = rules
            .into_iter()
            .find(|r| r.method.as_deref().is_none_or(|m| m == method) && n % r.every == r.offset)
            .map(|r| r.fault);
        if let Some(f) = &fault {
            *counts
                .faults
                .entry((method.clone(), f.label()))
                .or_insert(0) += 1;
        }
        fault
    };
    let frozen = *s.frozen.lock().unwrap_or_else(|p| p.into_inner());
    match fault {
        None => match frozen {
            Some(head) if !parsed_is_batch(&body) => Ok(lagging(&s, head, &first, body).await),
            _ => Ok(forward(&s, body).await),
        },
        Some(Fault::Status(code)) => Ok(respond(
            StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY),
            Bytes::from_static(b"injected failure"),
        )),
        Some(Fault::Delay(d)) => {
            tokio::time::sleep(d).await;
            Ok(forward(&s, body).await)
        }
        Some(Fault::Reset) => Err(Box::new(Dropped)),
        Some(Fault::RpcError { code, message }) => Ok(rpc_error(&id, code, &message)),
        Some(Fault::Result(result)) => Ok(rpc_result(&id, &result)),
        Some(Fault::ForwardThenLose) => {
            let _ = forward(&s, body).await;
            Err(Box::new(Dropped))
        }
        Some(Fault::ForwardThenError { code, message }) => {
            let _ = forward(&s, body).await;
            Ok(rpc_error(&id, code, &message))
        }
    }
}

fn parsed_is_batch(body: &Bytes) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[')
}

/// A block number of a JSON-RPC answer or parameter (`0x…`), if it is one.
fn number(v: &serde_json::Value) -> Option<u64> {
    v.as_str()
        .and_then(|h| h.strip_prefix("0x"))
        .and_then(|h| u64::from_str_radix(h, 16).ok())
}

/// One call answered as a node whose head is `head` would ([`FaultProxy::lag_at`]).
async fn lagging(
    s: &State,
    head: u64,
    call: &serde_json::Value,
    body: Bytes,
) -> Response<Full<Bytes>> {
    let id = &call["id"];
    let method = call["method"].as_str().unwrap_or("?");
    let params = call["params"].as_array().cloned().unwrap_or_default();
    let tag = format!("{head:#x}");
    // A call whose block parameter (at `at`) is rewritten to at most `head`.
    let at_most_head = |at: usize| {
        let mut call = call.clone();
        let past = match params.get(at) {
            Some(p) => number(p).is_none_or(|n| n > head),
            None => true,
        };
        if past && let Some(list) = call["params"].as_array_mut() {
            while list.len() <= at {
                list.push(serde_json::Value::Null);
            }
            list[at] = serde_json::Value::String(tag.clone());
        }
        Bytes::from(call.to_string())
    };
    match method {
        "eth_blockNumber" => rpc_result(id, &serde_json::Value::String(tag.clone())),
        "eth_getBlockByNumber" => {
            if params.first().and_then(number).is_some_and(|n| n > head) {
                return rpc_result(id, &serde_json::Value::Null);
            }
            forward(s, at_most_head(0)).await
        }
        "eth_getTransactionCount" | "eth_getBalance" | "eth_getCode" => {
            forward(s, at_most_head(1)).await
        }
        "eth_getTransactionReceipt" | "eth_getTransactionByHash" => {
            let answer = forward(s, body).await;
            let bytes = answer.into_body().collect().await.map(|b| b.to_bytes());
            let bytes = bytes.unwrap_or_default();
            let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            match parsed["result"].get("blockNumber").and_then(number) {
                // In a block above its head: a lagging node does not know it yet.
                Some(n) if n > head => rpc_result(id, &serde_json::Value::Null),
                _ => respond(StatusCode::OK, bytes),
            }
        }
        _ => forward(s, body).await,
    }
}
