//! The HTTP gateway (issue 18, seed 004 §8) as a client sees it: `txflow gateway` runs as a
//! process on a database of the test's own, and a real HTTP client sends it forged, expired and
//! wrong-user tokens, malformed and oversized bodies, and every invalid amount of §10.2; each gets
//! its status and code, and nothing is written to `transfers`. A valid request is one INIT row
//! that GET returns to its owner only; the same `cid` twice is one transfer; a user above the
//! rate gets 429. Test names carry the seed's ids (§10.2 ATK-xxx).
//!
//! Each gateway has topics of its own (a unique prefix) on the shared broker: a new transfer's
//! TransferRequested, a tx request's TxRequest and an approval's TxCommand are read back from them
//! (Avro, through the registry); an open conservation violation halts transfers (503
//! SERVICE_HALTED, nothing recorded); the tx reads answer from `managed_tx`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use txflow_core::codec::RegistryCodec;
use txflow_core::events::{Event, TransferRequested, TxCommand, TxCommandKind, TxRequest};
use txflow_core::kafka::{Topics, signer_key};
use txflow_tests::{TestDb, TestTopics, free_port, spawn_child, unique, wait_for};

/// The chain the test gateways serve, and the partitions of their topics.
const CHAIN_ID: i64 = 31337;
const PARTITIONS: i32 = 2;

/// A directory of the test's own, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        let dir = std::env::temp_dir().join(unique("txflow-gateway-test"));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        Dir(dir)
    }

    fn file(&self, name: &str, content: &[u8]) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, content).expect("write a test file");
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs() as i64
}

/// The audience and issuer the gateway expects by default.
const AUD: &str = "txflow";
const ISS: &str = "txflow";

/// An end user's HS256 token for `sub` (scope `transfer`) expiring `ttl` seconds from now
/// (negative: expired), issued a minute before.
fn hs256(secret: &[u8], sub: &str, ttl: i64) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &json!({"sub": sub, "iat": now() + ttl.min(0) - 60, "exp": now() + ttl,
                "aud": AUD, "iss": ISS, "scope": "transfer"}),
        &EncodingKey::from_secret(secret),
    )
    .expect("encode a token")
}

/// A token with these claims; `iat` (now), `exp` (5 minutes ahead), `aud` and `iss` are added
/// where absent (a `null` removes one).
fn hs256_claims(secret: &[u8], claims: Value) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &with_defaults(claims),
        &EncodingKey::from_secret(secret),
    )
    .expect("encode a token")
}

/// `claims` with `iat`, `exp`, `aud` and `iss` added where absent; a `null` removes one.
fn with_defaults(mut claims: Value) -> Value {
    for (k, v) in [
        ("iat", json!(now())),
        ("exp", json!(now() + 300)),
        ("aud", json!(AUD)),
        ("iss", json!(ISS)),
    ] {
        match claims.get(k) {
            None => claims[k] = v,
            Some(Value::Null) => {
                claims.as_object_mut().expect("an object").remove(k);
            }
            Some(_) => {}
        }
    }
    claims
}

/// The first `n` messages on `topic`, read from the beginning of every partition by a consumer
/// outside any group, within 60 s.
async fn read_topic(topic: &str, n: usize) -> Vec<OwnedMessage> {
    let consumer: StreamConsumer = txflow_tests::kafka_settings()
        .assign_config()
        .create()
        .expect("a consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("a partition");
    }
    consumer.assign(&tpl).expect("assign");
    txflow_tests::collect(&consumer, n, Duration::from_secs(60)).await
}

/// A message's Avro value, through the registry.
async fn decode<E: Event>(m: &OwnedMessage) -> E {
    RegistryCodec::new(txflow_tests::registry_url())
        .decode::<E>(m.payload().unwrap_or_default())
        .await
        .unwrap_or_else(|e| panic!("not a {}: {e:?}", E::FULL_NAME))
}

fn header(m: &OwnedMessage, key: &str) -> Option<String> {
    m.headers().and_then(|h| {
        h.iter()
            .find(|h| h.key == key)
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    })
}

fn key(m: &OwnedMessage) -> String {
    String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned()
}

/// A `txflow gateway` process on `db` and topics of its own, its log in a file shown when
/// something fails. Its topics are deleted on drop.
struct Gateway {
    url: String,
    log: PathBuf,
    client: reqwest::Client,
    topics: Topics,
    _child: Child,
    /// Deletes the gateway's topics when the test ends.
    _topics_cleanup: TestTopics,
}

impl Gateway {
    async fn start(db: &TestDb, env: &[(&str, String)]) -> Gateway {
        let addr = format!("127.0.0.1:{}", free_port());
        let log = std::env::temp_dir().join(format!("{}.log", unique("gateway")));
        let file = std::fs::File::create(&log).expect("log file");
        let services = txflow_tests::services();
        let topics = Topics::new(unique("gw"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
        cmd.arg("gateway")
            .env_remove("TXFLOW_CONFIG")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env("TXFLOW_DATABASE_URL", &db.url)
            .env("TXFLOW_GATEWAY_ADDR", &addr)
            .env("TXFLOW_BROKERS", &services.brokers)
            .env("TXFLOW_SCHEMA_REGISTRY_URL", &services.registry_url)
            .env("TXFLOW_TOPIC_PREFIX", &topics.prefix)
            .env("TXFLOW_PARTITIONS", PARTITIONS.to_string())
            .env("TXFLOW_CHAIN_ID", CHAIN_ID.to_string())
            .env("TXFLOW_LOG", "info")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        let child = spawn_child(cmd).expect("spawn txflow gateway");
        let g = Gateway {
            url: format!("http://{addr}"),
            log,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()
                .expect("http client"),
            _topics_cleanup: TestTopics::delete_on_drop(
                &txflow_tests::kafka_settings(),
                vec![
                    topics.transfer_requests(),
                    topics.tx_requests(),
                    topics.tx_commands(),
                ],
            ),
            topics,
            _child: child,
        };
        wait_for(
            "the gateway answers /healthz",
            Duration::from_secs(60),
            || async {
                let r = g
                    .client
                    .get(format!("{}/healthz", g.url))
                    .send()
                    .await
                    .ok()?;
                (r.status() == 200).then_some(())
            },
        )
        .await;
        g
    }

    /// Waits until `/readyz` answers 200: the database answers and the topics exist.
    async fn ready(&self) {
        wait_for("the gateway is ready", Duration::from_secs(60), || async {
            let r = self
                .client
                .get(format!("{}/readyz", self.url))
                .send()
                .await
                .ok()?;
            (r.status() == 200).then_some(())
        })
        .await;
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    async fn answer(&self, r: reqwest::RequestBuilder) -> (u16, Value) {
        let r = r
            .send()
            .await
            .unwrap_or_else(|e| panic!("the gateway does not answer: {e}\n{}", self.log_tail()));
        let status = r.status().as_u16();
        let text = r.text().await.expect("a body");
        let body = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("status {status}: not JSON: {text:?}"));
        (status, body)
    }

    async fn post(&self, token: Option<&str>, body: &Value) -> (u16, Value) {
        let mut r = self
            .client
            .post(format!("{}/api/v1/internal_transfer", self.url))
            .json(body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        self.answer(r).await
    }

    async fn post_raw(&self, token: &str, content_type: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .client
            .post(format!("{}/api/v1/internal_transfer", self.url))
            .bearer_auth(token)
            .header("content-type", content_type)
            .body(body);
        self.answer(r).await
    }

    /// `method path` with `token` and, when given, a JSON body.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let mut r = self.client.request(method, format!("{}{path}", self.url));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        if let Some(b) = body {
            r = r.json(b);
        }
        self.answer(r).await
    }

    async fn get(&self, token: Option<&str>, req_id: &str) -> (u16, Value) {
        let mut r = self
            .client
            .get(format!("{}/api/v1/internal_transfer/{req_id}", self.url));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        self.answer(r).await
    }
}

/// A database with the asset rules the tests use: USDT with 8 places, 0.01 to 1,000,000.
async fn database() -> TestDb {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO assets (asset, places, min_amount, max_amount) \
         VALUES ('USDT', 8, 0.01, 1000000), ('BTC', 8, 0.0001, 100)",
    )
    .execute(&db.pool)
    .await
    .expect("insert assets");
    db
}

async fn transfers(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM transfers")
        .fetch_one(&db.pool)
        .await
        .expect("count transfers")
}

/// A secret file for HS256 and the secret.
fn secret(dir: &Dir) -> (Vec<u8>, (&'static str, String)) {
    let secret = format!("{}{}", unique("s"), unique("ecret")).into_bytes();
    let mut content = secret.clone();
    content.push(b'\n');
    let path = dir.file("jwt-secret", &content);
    (
        secret,
        (
            "TXFLOW_GATEWAY_JWT_SECRET_FILE",
            path.to_string_lossy().into_owned(),
        ),
    )
}

fn transfer(amount: &str) -> Value {
    json!({"from": "FUNDING", "to": "SPOT", "asset": "USDT", "amount": amount})
}

fn code(body: &Value) -> &str {
    body["code"].as_str().unwrap_or("<no code>")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atk_011_atk_012_atk_013_missing_expired_and_forged_tokens_are_unauthorized() {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    let g = Gateway::start(&db, &[env]).await;
    let body = transfer("10");
    let forged = hs256(
        b"not-the-gateway-secret-not-the-gateway-secret",
        "alice",
        300,
    );
    let expired = hs256(&key, "alice", -3600);
    let no_exp = hs256_claims(
        &key,
        json!({"sub": "alice", "scope": "transfer", "exp": null}),
    );
    // A valid token with one character inside its signature changed (not the last one, whose
    // low bits base64 may ignore).
    let valid = hs256(&key, "alice", 300);
    let at = valid.len() - 10;
    let swapped = if &valid[at..=at] == "A" { "B" } else { "A" };
    let tampered = format!("{}{swapped}{}", &valid[..at], &valid[at + 1..]);
    for (what, token) in [
        ("ATK-011 no token", None),
        ("ATK-012 an expired token", Some(expired.as_str())),
        ("ATK-013 a forged signature", Some(forged.as_str())),
        ("ATK-013 a tampered signature", Some(tampered.as_str())),
        ("a token without exp", Some(no_exp.as_str())),
        ("not a JWT", Some("not.a.jwt")),
    ] {
        let (status, answer) = g.post(token, &body).await;
        assert_eq!(
            (status, code(&answer)),
            (401, "UNAUTHORIZED"),
            "{what}: {answer}"
        );
        let (status, answer) = g.get(token, "any-req-id").await;
        assert_eq!(
            (status, code(&answer)),
            (401, "UNAUTHORIZED"),
            "GET, {what}: {answer}"
        );
    }
    // Malformed bodies without a token are refused by authentication first.
    let (status, _) = g
        .answer(
            g.client
                .post(format!("{}/api/v1/internal_transfer", g.url))
                .header("content-type", "application/json")
                .body("{not json"),
        )
        .await;
    assert_eq!(status, 401);
    assert_eq!(transfers(&db).await, 0, "nothing is recorded");
    // No token reaches the log.
    let log = std::fs::read_to_string(&g.log).unwrap_or_default();
    assert!(
        !log.contains(&forged) && !log.contains(&expired),
        "a token in the log"
    );
    assert!(
        !log.contains(std::str::from_utf8(&key).expect("text")),
        "the secret in the log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atk_001_atk_002_another_users_transfer_is_forbidden_and_never_shown() {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    let g = Gateway::start(&db, &[env]).await;
    let alice = hs256(&key, "alice", 300);
    let bob = hs256(&key, "bob", 300);
    // ATK-001/002: alice's token, bob's user_id in the body.
    let mut body = transfer("10");
    body["user_id"] = json!("bob");
    let (status, answer) = g.post(Some(&alice), &body).await;
    assert_eq!((status, code(&answer)), (403, "FORBIDDEN"), "{answer}");
    assert_eq!(transfers(&db).await, 0);

    // Her own transfer (user_id given or left out) is hers to read; bob gets 404, as for an
    // unknown id.
    body["user_id"] = json!("alice");
    let (status, created) = g.post(Some(&alice), &body).await;
    assert_eq!(status, 202, "{created}");
    let req_id = created["req_id"].as_str().expect("a req_id").to_string();
    let (status, answer) = g.get(Some(&bob), &req_id).await;
    assert_eq!((status, code(&answer)), (404, "NOT_FOUND"), "{answer}");
    assert!(!answer.to_string().contains("alice"), "{answer}");
    let (status, unknown) = g.get(Some(&bob), "no-such-transfer").await;
    assert_eq!((status, &unknown), (404, &answer), "indistinguishable");
    let (status, read) = g.get(Some(&alice), &req_id).await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(read["req_id"], json!(req_id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atk_003_to_atk_009_invalid_requests_get_their_codes_and_record_nothing() {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    let g = Gateway::start(&db, &[env]).await;
    let alice = hs256(&key, "alice", 300);
    let with = |from: &str, to: &str, asset: &str, amount: Value| json!({"from": from, "to": to, "asset": asset, "amount": amount});
    for (what, body, status, expected) in [
        (
            "ATK-003 a negative amount",
            transfer("-100"),
            400,
            "INVALID_AMOUNT",
        ),
        (
            "ATK-004 a zero amount",
            transfer("0"),
            400,
            "INVALID_AMOUNT",
        ),
        (
            "ATK-004 zero with places",
            transfer("0.00000000"),
            400,
            "INVALID_AMOUNT",
        ),
        (
            "ATK-005 nine places for 8",
            transfer("0.000000001"),
            400,
            "PRECISION_OVERFLOW",
        ),
        (
            "ATK-006 u64::MAX + 1",
            transfer("18446744073709551616"),
            400,
            "OVERFLOW",
        ),
        (
            "ATK-006 a huge number",
            transfer(&"9".repeat(80)),
            400,
            "OVERFLOW",
        ),
        (
            "ATK-007 the same account",
            with("SPOT", "SPOT", "USDT", json!("1")),
            400,
            "SAME_ACCOUNT",
        ),
        (
            "ATK-008 an invalid type",
            with("INVALID", "SPOT", "USDT", json!("1")),
            400,
            "INVALID_ACCOUNT_TYPE",
        ),
        (
            "an announced type",
            with("FUNDING", "FUTURE", "USDT", json!("1")),
            400,
            "UNSUPPORTED_ACCOUNT_TYPE",
        ),
        (
            "ATK-009 an unknown asset",
            with("FUNDING", "SPOT", "999999", json!("1")),
            400,
            "INVALID_ASSET",
        ),
        (
            "an amount as a JSON number",
            with("FUNDING", "SPOT", "USDT", json!(1.5)),
            400,
            "INVALID_AMOUNT",
        ),
        ("an exponent", transfer("1e5"), 400, "INVALID_AMOUNT"),
        (
            "below the minimum",
            transfer("0.001"),
            400,
            "AMOUNT_TOO_SMALL",
        ),
        (
            "above the maximum",
            transfer("1000000.01"),
            400,
            "AMOUNT_TOO_LARGE",
        ),
        (
            "a missing field",
            json!({"from": "FUNDING", "to": "SPOT", "amount": "1"}),
            400,
            "INVALID_REQUEST",
        ),
        (
            "an unknown field",
            json!({"from": "FUNDING", "to": "SPOT", "asset": "USDT", "amount": "1", "fee": "0"}),
            400,
            "INVALID_REQUEST",
        ),
        (
            "a malformed cid",
            json!({"from": "FUNDING", "to": "SPOT", "asset": "USDT", "amount": "1", "cid": "a b"}),
            400,
            "INVALID_REQUEST",
        ),
    ] {
        let (got, answer) = g.post(Some(&alice), &body).await;
        assert_eq!((got, code(&answer)), (status, expected), "{what}: {answer}");
        assert!(answer["message"].is_string(), "{what}: {answer}");
    }
    // Malformed JSON, another media type, an oversized body.
    let (status, answer) = g
        .post_raw(
            &alice,
            "application/json",
            b"{\"from\": \"FUNDING\",".to_vec(),
        )
        .await;
    assert_eq!(
        (status, code(&answer)),
        (400, "INVALID_REQUEST"),
        "{answer}"
    );
    let (status, answer) = g
        .post_raw(&alice, "text/plain", transfer("1").to_string().into_bytes())
        .await;
    assert_eq!(
        (status, code(&answer)),
        (415, "INVALID_REQUEST"),
        "{answer}"
    );
    let mut big = transfer("1");
    big["cid"] = json!("x".repeat(64 * 1024));
    let (status, answer) = g
        .post_raw(&alice, "application/json", big.to_string().into_bytes())
        .await;
    assert_eq!(
        (status, code(&answer)),
        (413, "INVALID_REQUEST"),
        "{answer}"
    );
    assert_eq!(transfers(&db).await, 0, "nothing is recorded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_request_is_one_init_transfer_that_get_returns() {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    let g = Gateway::start(&db, &[env]).await;
    let alice = hs256(&key, "alice", 300);
    let (status, created) = g
        .post(
            Some(&alice),
            &json!({"from": "SPOT", "to": "FUNDING", "asset": "USDT", "amount": "100.50"}),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    assert_eq!(created["state"], "INIT", "{created}");
    assert_eq!(created["from"], "SPOT");
    assert_eq!(created["to"], "FUNDING");
    assert_eq!(created["amount"], "100.5", "{created}");
    let req_id = created["req_id"].as_str().expect("a req_id");
    let parsed = uuid::Uuid::parse_str(req_id).expect("a UUID");
    assert_eq!(parsed.get_version_num(), 7, "a time-ordered id");

    let row: (String, String, String, i16, i16, String, String) = sqlx::query_as(
        "SELECT req_id, user_id, amount::text, state, transfer_type, source_account, target_account \
         FROM transfers",
    )
    .fetch_one(&db.pool)
    .await
    .expect("one transfer");
    assert_eq!(row.0, req_id);
    assert_eq!(row.1, "alice", "the token's user");
    assert_eq!(row.2.parse::<f64>().ok(), Some(100.5), "{}", row.2);
    assert_eq!((row.3, row.4), (0, 2), "INIT, SPOT -> FUNDING");
    assert_eq!((row.5.as_str(), row.6.as_str()), ("SPOT", "FUNDING"));
    assert_eq!(transfers(&db).await, 1);

    let (status, read) = g.get(Some(&alice), req_id).await;
    assert_eq!(status, 200, "{read}");
    for field in [
        "transfer_id",
        "req_id",
        "from",
        "to",
        "asset",
        "amount",
        "state",
        "created_at",
    ] {
        assert_eq!(read[field], created[field], "{field}: {read} vs {created}");
    }
    assert!(read["updated_at"].is_string());

    // The readiness check sees the database.
    let (status, ready) = g.answer(g.client.get(format!("{}/readyz", g.url))).await;
    assert_eq!(
        (status, &ready["checks"]["database"]),
        (200, &json!("ok")),
        "{ready}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atk_010_the_same_cid_twice_returns_the_original_transfer_once() {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    // A rate high enough for the concurrent burst below.
    let g = Gateway::start(
        &db,
        &[
            env,
            ("TXFLOW_GATEWAY_RATE_PER_SEC", "1000".into()),
            ("TXFLOW_GATEWAY_RATE_BURST", "1000".into()),
        ],
    )
    .await;
    let alice = hs256(&key, "alice", 300);
    let bob = hs256(&key, "bob", 300);
    let mut body = transfer("25");
    body["cid"] = json!("order-1");
    let (first_status, first) = g.post(Some(&alice), &body).await;
    assert_eq!(first_status, 202, "{first}");
    let (again_status, again) = g.post(Some(&alice), &body).await;
    assert_eq!(again_status, 200, "{again}");
    assert_eq!(again["req_id"], first["req_id"], "the original transfer");
    assert_eq!(transfers(&db).await, 1);

    // The cid with other parameters: DUPLICATE_REQUEST, nothing new.
    let mut other = body.clone();
    other["amount"] = json!("26");
    let (status, answer) = g.post(Some(&alice), &other).await;
    assert_eq!(
        (status, code(&answer)),
        (409, "DUPLICATE_REQUEST"),
        "{answer}"
    );
    // Another user's cid is their own.
    let (status, bobs) = g.post(Some(&bob), &body).await;
    assert_eq!(status, 202, "{bobs}");
    assert_ne!(bobs["req_id"], first["req_id"]);
    assert_eq!(transfers(&db).await, 2);

    // 20 requests with one new cid at once: one transfer, every answer names it.
    let mut burst = transfer("5");
    burst["cid"] = json!("order-2");
    let answers = futures::future::join_all((0..20).map(|_| g.post(Some(&alice), &burst))).await;
    let ids: std::collections::BTreeSet<String> = answers
        .iter()
        .map(|(status, a)| {
            assert!(*status == 200 || *status == 202, "{status}: {a}");
            a["req_id"].as_str().expect("a req_id").to_string()
        })
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(
        answers.iter().filter(|(s, _)| *s == 202).count(),
        1,
        "one request created it"
    );
    assert_eq!(transfers(&db).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_above_the_rate_limit_gets_429_and_others_do_not() {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    let g = Gateway::start(
        &db,
        &[
            env,
            ("TXFLOW_GATEWAY_RATE_PER_SEC", "1".into()),
            ("TXFLOW_GATEWAY_RATE_BURST", "3".into()),
        ],
    )
    .await;
    let alice = hs256(&key, "alice", 300);
    let bob = hs256(&key, "bob", 300);
    let mut statuses = Vec::new();
    for _ in 0..8 {
        let (status, answer) = g.post(Some(&alice), &transfer("1")).await;
        if status == 429 {
            assert_eq!(code(&answer), "RATE_LIMIT_EXCEEDED", "{answer}");
        }
        statuses.push(status);
    }
    assert_eq!(&statuses[..3], &[202, 202, 202], "the burst: {statuses:?}");
    assert!(statuses.contains(&429), "{statuses:?}");
    let accepted = statuses.iter().filter(|s| **s == 202).count() as i64;
    assert_eq!(
        transfers(&db).await,
        accepted,
        "a refused request records nothing"
    );
    let (status, answer) = g.post(Some(&bob), &transfer("1")).await;
    assert_eq!(status, 202, "another user's bucket: {answer}");
}

/// A gateway with a generous per-second rate (the daily limits are under test) and `env`.
async fn generous_gateway(db: &TestDb, env: Vec<(&'static str, String)>) -> Gateway {
    let mut all = vec![
        ("TXFLOW_GATEWAY_RATE_PER_SEC", "1000".to_string()),
        ("TXFLOW_GATEWAY_RATE_BURST", "1000".to_string()),
    ];
    all.extend(env);
    Gateway::start(db, &all).await
}

async fn user_transfers(db: &TestDb, user: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM transfers WHERE user_id = $1")
        .bind(user)
        .fetch_one(&db.pool)
        .await
        .expect("count transfers")
}

/// The value of the series of `metric` whose labels include every one of `labels` (`k="v"`), in
/// the gateway's `/metrics`; `None` when there is no such series.
async fn metric(g: &Gateway, metric: &str, labels: &[&str]) -> Option<f64> {
    let r = g
        .client
        .get(format!("{}/metrics", g.url))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("the exposition");
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daily_count_refuses_a_users_transfer_past_it_but_answers_cid_replays() {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    let g = generous_gateway(&db, vec![env, ("TXFLOW_GATEWAY_DAILY_COUNT", "3".into())]).await;
    let (alice, bob) = (hs256(&key, "alice", 300), hs256(&key, "bob", 300));
    // Registered at 0 before any refusal.
    let daily = ["code=\"DAILY_LIMIT_EXCEEDED\""];
    assert_eq!(
        metric(&g, "gateway_rejections_total", &daily).await,
        Some(0.0)
    );
    let mut first = transfer("1");
    first["cid"] = json!("daily-1");
    let (status, original) = g.post(Some(&alice), &first).await;
    assert_eq!(status, 202, "{original}");
    for n in 2..=3 {
        let (status, answer) = g.post(Some(&alice), &transfer("1")).await;
        assert_eq!(status, 202, "transfer {n}: {answer}");
    }
    let (status, answer) = g.post(Some(&alice), &transfer("1")).await;
    assert_eq!(
        (status, code(&answer)),
        (429, "DAILY_LIMIT_EXCEEDED"),
        "{answer}"
    );
    assert_eq!(user_transfers(&db, "alice").await, 3, "no fourth row");
    // A replay of the first is still answered with the original, and records nothing.
    let (status, replay) = g.post(Some(&alice), &first).await;
    assert_eq!(status, 200, "{replay}");
    assert_eq!(replay["req_id"], original["req_id"]);
    assert_eq!(user_transfers(&db, "alice").await, 3);
    // The count is per user.
    let (status, answer) = g.post(Some(&bob), &transfer("1")).await;
    assert_eq!(status, 202, "{answer}");
    // Transfers of an earlier UTC day do not count, whatever their state.
    sqlx::query(
        "UPDATE transfers SET created_at = date_trunc('day', now(), 'UTC') - interval '1 second' \
         WHERE user_id = 'alice' AND cid = 'daily-1'",
    )
    .execute(&db.pool)
    .await
    .expect("age a transfer");
    let (status, answer) = g.post(Some(&alice), &transfer("1")).await;
    assert_eq!(status, 202, "yesterday's transfer freed a place: {answer}");
    let (status, answer) = g.post(Some(&alice), &transfer("1")).await;
    assert_eq!(
        (status, code(&answer)),
        (429, "DAILY_LIMIT_EXCEEDED"),
        "{answer}"
    );
    assert_eq!(user_transfers(&db, "alice").await, 4);

    // /metrics counts the refusals by code, and the answers by route and status.
    assert_eq!(
        metric(&g, "gateway_rejections_total", &daily).await,
        Some(2.0)
    );
    assert_eq!(
        metric(
            &g,
            "gateway_rejections_total",
            &["code=\"RATE_LIMIT_EXCEEDED\""]
        )
        .await,
        Some(0.0)
    );
    let (status, _) = g.post(None, &transfer("1")).await;
    assert_eq!(status, 401);
    assert_eq!(
        metric(&g, "gateway_rejections_total", &["code=\"UNAUTHORIZED\""]).await,
        Some(1.0)
    );
    assert_eq!(
        metric(
            &g,
            "gateway_requests_total",
            &["route=\"/api/v1/internal_transfer\"", "status=\"429\""]
        )
        .await,
        Some(2.0)
    );
    assert_eq!(
        metric(
            &g,
            "gateway_requests_total",
            &["route=\"/api/v1/internal_transfer\"", "status=\"202\""]
        )
        .await,
        Some(5.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_assets_daily_limit_bounds_a_users_total_of_the_day() {
    let (db, dir) = (database().await, Dir::new());
    sqlx::query("UPDATE assets SET daily_limit = 100 WHERE asset = 'USDT'")
        .execute(&db.pool)
        .await
        .expect("set a daily limit");
    let (key, env) = secret(&dir);
    let g = generous_gateway(&db, vec![env]).await;
    let (alice, bob) = (hs256(&key, "alice", 300), hs256(&key, "bob", 300));
    let (status, answer) = g.post(Some(&alice), &transfer("60")).await;
    assert_eq!(status, 202, "{answer}");
    let (status, answer) = g.post(Some(&alice), &transfer("50")).await;
    assert_eq!(
        (status, code(&answer)),
        (429, "DAILY_AMOUNT_EXCEEDED"),
        "{answer}"
    );
    assert_eq!(user_transfers(&db, "alice").await, 1, "nothing recorded");
    // Up to the limit exactly.
    let (status, answer) = g.post(Some(&alice), &transfer("40")).await;
    assert_eq!(status, 202, "{answer}");
    // A failed transfer still counts.
    sqlx::query("UPDATE transfers SET state = -10 WHERE user_id = 'alice'")
        .execute(&db.pool)
        .await
        .expect("fail the transfers");
    let (status, answer) = g.post(Some(&alice), &transfer("0.01")).await;
    assert_eq!(
        (status, code(&answer)),
        (429, "DAILY_AMOUNT_EXCEEDED"),
        "{answer}"
    );
    // The limit is per asset (BTC has none) and per user.
    let btc = json!({"from": "FUNDING", "to": "SPOT", "asset": "BTC", "amount": "99"});
    let (status, answer) = g.post(Some(&alice), &btc).await;
    assert_eq!(status, 202, "{answer}");
    let (status, answer) = g.post(Some(&bob), &transfer("100")).await;
    assert_eq!(status, 202, "{answer}");
    assert_eq!(user_transfers(&db, "alice").await, 3);
    assert_eq!(
        metric(
            &g,
            "gateway_rejections_total",
            &["code=\"DAILY_AMOUNT_EXCEEDED\""]
        )
        .await,
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_of_one_user_cannot_pass_the_daily_count_together() {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    let g = generous_gateway(&db, vec![env, ("TXFLOW_GATEWAY_DAILY_COUNT", "5".into())]).await;
    let alice = hs256(&key, "alice", 300);
    let body = transfer("1");
    let answers = futures::future::join_all((0..10).map(|_| g.post(Some(&alice), &body))).await;
    let accepted = answers.iter().filter(|(s, _)| *s == 202).count();
    for (status, answer) in answers.iter().filter(|(s, _)| *s != 202) {
        assert_eq!(
            (*status, code(answer)),
            (429, "DAILY_LIMIT_EXCEEDED"),
            "{answer}"
        );
    }
    let statuses: Vec<u16> = answers.iter().map(|(s, _)| *s).collect();
    assert_eq!(accepted, 5, "{statuses:?}");
    assert_eq!(user_transfers(&db, "alice").await, 5, "exactly five rows");
}

/// Runs `openssl` with `args`; its standard output.
fn openssl(args: &[&str]) -> Vec<u8> {
    let out = std::process::Command::new("openssl")
        .args(args)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `openssl` makes an RSA key pair (PKCS#1 private key, SPKI public key) in `dir`.
fn rsa_pair(dir: &Dir) -> (Vec<u8>, PathBuf) {
    let private = dir.0.join("jwt-private.pem");
    let public = dir.0.join("jwt-public.pem");
    let path = |p: &Path| p.to_string_lossy().into_owned();
    openssl(&["genrsa", "-traditional", "-out", &path(&private), "2048"]);
    openssl(&[
        "rsa",
        "-in",
        &path(&private),
        "-pubout",
        "-out",
        &path(&public),
    ]);
    (std::fs::read(&private).expect("private key"), public)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rs256_tokens_are_verified_with_the_public_key_and_no_other_algorithm_passes() {
    let (db, dir) = (database().await, Dir::new());
    let (private, public) = rsa_pair(&dir);
    let g = Gateway::start(
        &db,
        &[
            ("TXFLOW_GATEWAY_JWT_ALG", "RS256".into()),
            (
                "TXFLOW_GATEWAY_JWT_PUBLIC_KEY_FILE",
                public.to_string_lossy().into_owned(),
            ),
        ],
    )
    .await;
    let key = EncodingKey::from_rsa_pem(&private).expect("an RSA key");
    let claims = with_defaults(json!({"sub": "alice", "scope": "transfer"}));
    let good = jsonwebtoken::encode(&Header::new(Algorithm::RS256), &claims, &key).expect("sign");
    let (status, created) = g.post(Some(&good), &transfer("3")).await;
    assert_eq!(status, 202, "{created}");
    // The public key used as an HS256 secret (algorithm confusion), and another RSA key.
    let public_pem = std::fs::read(&public).expect("public key");
    let confused = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(&public_pem),
    )
    .expect("sign");
    let (other_private, _) = rsa_pair(&Dir::new());
    let other = jsonwebtoken::encode(
        &Header::new(Algorithm::RS256),
        &claims,
        &EncodingKey::from_rsa_pem(&other_private).expect("an RSA key"),
    )
    .expect("sign");
    for (what, token) in [
        ("HS256 with the public key", confused),
        ("another key", other),
    ] {
        let (status, answer) = g.post(Some(&token), &transfer("3")).await;
        assert_eq!(
            (status, code(&answer)),
            (401, "UNAUTHORIZED"),
            "{what}: {answer}"
        );
    }
    assert_eq!(transfers(&db).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_its_key_the_gateway_refuses_to_start_and_without_the_database_it_is_not_ready() {
    let db = database().await;
    let out = Command::new(env!("CARGO_BIN_EXE_txflow"))
        .arg("gateway")
        .env_remove("TXFLOW_GATEWAY_JWT_SECRET_FILE")
        .env_remove("TXFLOW_CONFIG")
        .env("TXFLOW_DATABASE_URL", &db.url)
        .env("TXFLOW_GATEWAY_ADDR", format!("127.0.0.1:{}", free_port()))
        .output()
        .await
        .expect("run txflow gateway");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TXFLOW_GATEWAY_JWT_SECRET_FILE"), "{err}");

    // A database nobody listens on: alive, not ready.
    let dir = Dir::new();
    let (_, env) = secret(&dir);
    let nowhere = format!("postgres://postgres@127.0.0.1:{}/none", free_port());
    let g = Gateway::start(&db, &[env, ("TXFLOW_DATABASE_URL", nowhere)]).await;
    let (status, ready) = g.answer(g.client.get(format!("{}/readyz", g.url))).await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["failed"], json!(["database"]), "{ready}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_transfer_is_published_to_the_coordinator_keyed_by_its_user_and_a_replay_is_not() {
    let (db, dir) = (database().await, Dir::new());
    let (key_bytes, env) = secret(&dir);
    let g = Gateway::start(&db, &[env]).await;
    g.ready().await;
    let alice = hs256(&key_bytes, "alice", 300);
    let mut body =
        json!({"from": "SPOT", "to": "FUNDING", "asset": "USDT", "amount": "100.50", "cid": "c-1"});
    let (status, first) = g.post(Some(&alice), &body).await;
    assert_eq!(status, 202, "{first}");
    let (status, again) = g.post(Some(&alice), &body).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["req_id"], first["req_id"]);
    body["cid"] = json!("c-2");
    let (status, second) = g.post(Some(&alice), &body).await;
    assert_eq!(status, 202, "{second}");

    // One key, one partition, in order: the replay published nothing between the two.
    let messages = read_topic(&g.topics.transfer_requests(), 2).await;
    let mut events = Vec::new();
    for m in &messages {
        assert_eq!(key(m), "alice", "keyed by the user");
        let e: TransferRequested = decode(m).await;
        assert_eq!(header(m, "event_id").as_deref(), Some(e.event_id.as_str()));
        let traceparent = header(m, "traceparent").expect("a traceparent header");
        assert_eq!(traceparent.split('-').count(), 4, "{traceparent}");
        assert_eq!(e.traceparent.as_deref(), Some(traceparent.as_str()));
        events.push(e);
    }
    let ids: Vec<&str> = events.iter().map(|e| e.req_id.as_str()).collect();
    assert_eq!(
        ids,
        [
            first["req_id"].as_str().expect("req_id"),
            second["req_id"].as_str().expect("req_id")
        ]
    );
    let e = &events[0];
    assert_eq!(
        (
            e.user_id.as_str(),
            e.asset.as_str(),
            e.amount.as_str(),
            e.from_account.as_str(),
            e.to_account.as_str()
        ),
        ("alice", "USDT", "100.5", "SPOT", "FUNDING")
    );
    let event_id = uuid::Uuid::parse_str(&e.event_id).expect("a UUID");
    assert_eq!(event_id.get_version_num(), 8, "derived from the req_id");
    assert_ne!(events[0].event_id, events[1].event_id);
    let created: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT created_at FROM transfers WHERE req_id = $1")
            .bind(&e.req_id)
            .fetch_one(&db.pool)
            .await
            .expect("the row");
    assert_eq!(e.created_at_ms, created.timestamp_millis());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mon_003_an_open_conservation_violation_halts_transfers_until_it_is_resolved() {
    let (db, dir) = (database().await, Dir::new());
    let (key_bytes, env) = secret(&dir);
    let g = Gateway::start(&db, &[env]).await;
    let alice = hs256(&key_bytes, "alice", 300);
    sqlx::query(
        "INSERT INTO transfer_conservation_violations (user_id, asset, expected, actual, detail) \
         VALUES ('bob', 'USDT', 100, 90, 'a test violation')",
    )
    .execute(&db.pool)
    .await
    .expect("open a violation");
    let (status, answer) = g.post(Some(&alice), &transfer("10")).await;
    assert_eq!((status, code(&answer)), (503, "SERVICE_HALTED"), "{answer}");
    assert!(answer["message"].is_string(), "{answer}");
    // Authentication and validation come first.
    let (status, answer) = g.post(None, &transfer("10")).await;
    assert_eq!((status, code(&answer)), (401, "UNAUTHORIZED"), "{answer}");
    let (status, answer) = g.post(Some(&alice), &transfer("-1")).await;
    assert_eq!((status, code(&answer)), (400, "INVALID_AMOUNT"), "{answer}");
    assert_eq!(transfers(&db).await, 0, "nothing is recorded while halted");

    sqlx::query(
        "UPDATE transfer_conservation_violations SET resolved_at = now(), resolved_by = 'op'",
    )
    .execute(&db.pool)
    .await
    .expect("resolve it");
    let (status, answer) = g.post(Some(&alice), &transfer("10")).await;
    assert_eq!(status, 202, "resolved: {answer}");
    assert_eq!(transfers(&db).await, 1);
}

const SIGNER: &str = "0xF39Fd6e51aad88F6F4ce6aB8827279cffFb92266";
const TO: &str = "0x000000000000000000000000000000000000dEaD";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tx_request_is_published_keyed_by_its_signer_and_a_malformed_one_is_refused() {
    let (db, dir) = (database().await, Dir::new());
    let (key_bytes, env) = secret(&dir);
    let g = Gateway::start(&db, &[env]).await;
    g.ready().await;
    let token = hs256_claims(
        &key_bytes,
        json!({"sub": "upstream", "scope": format!("tx:submit:{SIGNER}")}),
    );
    let post = reqwest::Method::POST;
    let request = |id: &str| {
        json!({
            "request_id": id, "chain_id": CHAIN_ID, "signer": SIGNER, "to": TO,
            "value": "1000", "data": "0xabCD", "gas_limit": 50000,
            "max_fee_per_gas": "2000000000", "max_priority_fee_per_gas": "1000000000",
            "metadata": {"order": "42"},
        })
    };
    let (status, accepted) = g
        .call(
            post.clone(),
            "/api/v1/tx",
            Some(&token),
            Some(&request("order-1")),
        )
        .await;
    assert_eq!(status, 202, "{accepted}");
    let lower = SIGNER.to_ascii_lowercase();
    assert_eq!(accepted["request_id"], "order-1");
    assert_eq!(accepted["chain_id"], CHAIN_ID);
    assert_eq!(accepted["signer"], lower.as_str());

    let (status, answer) = g
        .call(post.clone(), "/api/v1/tx", None, Some(&request("order-x")))
        .await;
    assert_eq!((status, code(&answer)), (401, "UNAUTHORIZED"), "{answer}");
    for (what, field, value) in [
        ("a bad signer", "signer", json!("0x1234")),
        ("a bad destination", "to", json!("dead")),
        ("a fractional value", "value", json!("1.5")),
        ("a numeric value", "value", json!(1000)),
        ("odd hex data", "data", json!("0xabc")),
        ("another chain", "chain_id", json!(1)),
        ("an empty request id", "request_id", json!("")),
        ("an unknown field", "fee", json!("1")),
        (
            "a tip above the max fee",
            "max_priority_fee_per_gas",
            json!("3000000000"),
        ),
    ] {
        let mut body = request("order-x");
        body[field] = value;
        let (status, answer) = g
            .call(post.clone(), "/api/v1/tx", Some(&token), Some(&body))
            .await;
        assert_eq!(
            (status, code(&answer)),
            (400, "INVALID_REQUEST"),
            "{what}: {answer}"
        );
    }
    let (status, answer) = g
        .answer(
            g.client
                .post(format!("{}/api/v1/tx", g.url))
                .bearer_auth(&token)
                .header("content-type", "application/json")
                .body("{\"request_id\":"),
        )
        .await;
    assert_eq!(
        (status, code(&answer)),
        (400, "INVALID_REQUEST"),
        "{answer}"
    );
    // 10,000 bytes of calldata: over the transfers' 16 KiB body limit, within the tx one.
    let mut big = request("order-2");
    big["data"] = json!(format!("0x{}", "ab".repeat(10_000)));
    let (status, second) = g
        .call(post.clone(), "/api/v1/tx", Some(&token), Some(&big))
        .await;
    assert_eq!(status, 202, "{second}");

    // One signer, one partition, in order: nothing refused was published between the two.
    let messages = read_topic(&g.topics.tx_requests(), 2).await;
    let mut requests = Vec::new();
    for m in &messages {
        assert_eq!(key(m), signer_key(CHAIN_ID, SIGNER));
        let r: TxRequest = decode(m).await;
        assert_eq!(header(m, "event_id").as_deref(), Some(r.event_id.as_str()));
        assert!(header(m, "traceparent").is_some());
        requests.push(r);
    }
    assert_eq!(requests[0].request_id, "order-1");
    assert_eq!(requests[1].request_id, "order-2");
    assert_eq!(
        requests[0].submitted_by.as_deref(),
        Some("upstream"),
        "the token's sub travels with the request"
    );
    let r = &requests[0];
    assert_eq!(r.event_id, accepted["event_id"].as_str().expect("event_id"));
    assert_eq!((r.chain_id, r.signer.as_str()), (CHAIN_ID, lower.as_str()));
    assert_eq!(r.to, TO.to_ascii_lowercase());
    assert_eq!(r.value, "1000");
    assert_eq!(r.data, vec![0xab, 0xcd]);
    assert_eq!(r.gas_limit, Some(50000));
    assert_eq!(r.max_fee_per_gas.as_deref(), Some("2000000000"));
    assert_eq!(r.max_priority_fee_per_gas.as_deref(), Some("1000000000"));
    assert_eq!(r.metadata.get("order").map(String::as_str), Some("42"));
    assert_eq!(r.depends_on_request_id, None);
    assert_eq!(requests[1].data, vec![0xab; 10_000]);

    // The OpenAPI document served is the checked-in one.
    let (status, doc) = g
        .call(reqwest::Method::GET, "/openapi.json", None, None)
        .await;
    assert_eq!(status, 200);
    let checked_in: Value = serde_json::from_str(include_str!("../../gateway/openapi.json"))
        .expect("the checked-in document");
    assert_eq!(doc, checked_in);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_reads_answer_from_managed_tx_and_approve_and_cancel_publish_commands() {
    let (db, dir) = (database().await, Dir::new());
    let (key_bytes, env) = secret(&dir);
    let g = Gateway::start(&db, &[env]).await;
    g.ready().await;
    let (get, post) = (reqwest::Method::GET, reqwest::Method::POST);
    let reader = hs256_claims(&key_bytes, json!({"sub": "someone", "scope": "tx:read:*"}));
    let operator = hs256_claims(
        &key_bytes,
        json!({"sub": "op-1", "scope": "tx:read:* tx:approve:* tx:cancel:*"}),
    );
    let lower = SIGNER.to_ascii_lowercase();
    let tx_id = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, payload, state) \
         VALUES ($1, $2, $3, 'order-7', $4, 'PENDING_APPROVAL')",
    )
    .bind(tx_id)
    .bind(CHAIN_ID)
    .bind(&lower)
    .bind(
        json!({"to": TO.to_ascii_lowercase(), "value": "5", "data": "0x",
        "gas_limit": null, "max_fee_per_gas": null, "max_priority_fee_per_gas": null}),
    )
    .execute(&db.pool)
    .await
    .expect("insert a transaction");

    let (status, tx) = g
        .call(
            get.clone(),
            &format!("/api/v1/tx/{tx_id}"),
            Some(&reader),
            None,
        )
        .await;
    assert_eq!(status, 200, "{tx}");
    assert_eq!(tx["tx_id"], tx_id.to_string());
    assert_eq!(tx["request_id"], "order-7");
    assert_eq!(tx["chain_id"], CHAIN_ID);
    assert_eq!(tx["signer"], lower.as_str());
    assert_eq!(tx["state"], "PENDING_APPROVAL");
    assert_eq!(tx["to"], TO.to_ascii_lowercase().as_str());
    assert_eq!(tx["value"], "5");
    assert_eq!((&tx["nonce"], &tx["tx_hash"]), (&Value::Null, &Value::Null));
    assert_eq!(tx["attempts"], 0);
    assert!(tx["created_at"].is_string(), "{tx}");
    let by_request =
        format!("/api/v1/tx/by-request?chain_id={CHAIN_ID}&signer={SIGNER}&request_id=order-7");
    let (status, same) = g.call(get.clone(), &by_request, Some(&reader), None).await;
    assert_eq!((status, &same), (200, &tx));

    for (what, path, status, expected) in [
        (
            "an unknown id",
            format!("/api/v1/tx/{}", uuid::Uuid::new_v4()),
            404,
            "NOT_FOUND",
        ),
        (
            "not an id",
            "/api/v1/tx/not-a-uuid".to_string(),
            404,
            "NOT_FOUND",
        ),
        (
            "an unknown request",
            format!("/api/v1/tx/by-request?chain_id={CHAIN_ID}&signer={SIGNER}&request_id=nope"),
            404,
            "NOT_FOUND",
        ),
        (
            "no request_id",
            format!("/api/v1/tx/by-request?chain_id={CHAIN_ID}&signer={SIGNER}"),
            400,
            "INVALID_REQUEST",
        ),
        (
            "a bad signer",
            format!("/api/v1/tx/by-request?chain_id={CHAIN_ID}&signer=0x1&request_id=order-7"),
            400,
            "INVALID_REQUEST",
        ),
    ] {
        let (got, answer) = g.call(get.clone(), &path, Some(&reader), None).await;
        assert_eq!((got, code(&answer)), (status, expected), "{what}: {answer}");
    }
    let (status, answer) = g
        .call(get.clone(), &format!("/api/v1/tx/{tx_id}"), None, None)
        .await;
    assert_eq!((status, code(&answer)), (401, "UNAUTHORIZED"), "{answer}");

    // Approve and cancel: operators only.
    let approve = format!("/api/v1/tx/{tx_id}/approve");
    let cancel = format!("/api/v1/tx/{tx_id}/cancel");
    let (status, answer) = g.call(post.clone(), &approve, Some(&reader), None).await;
    assert_eq!((status, code(&answer)), (403, "FORBIDDEN"), "{answer}");
    let (status, answer) = g
        .call(
            post.clone(),
            &format!("/api/v1/tx/{}/approve", uuid::Uuid::new_v4()),
            Some(&operator),
            None,
        )
        .await;
    assert_eq!((status, code(&answer)), (404, "NOT_FOUND"), "{answer}");
    let (status, approved) = g.call(post.clone(), &approve, Some(&operator), None).await;
    assert_eq!(status, 202, "{approved}");
    assert_eq!(approved["command"], "APPROVE");
    assert_eq!(approved["state"], "PENDING_APPROVAL");
    let (status, cancelled) = g
        .call(
            post.clone(),
            &cancel,
            Some(&operator),
            Some(&json!({"reason": "not needed"})),
        )
        .await;
    assert_eq!(status, 202, "{cancelled}");
    assert_eq!(cancelled["command"], "CANCEL");

    let messages = read_topic(&g.topics.tx_commands(), 2).await;
    let mut commands = Vec::new();
    for m in &messages {
        assert_eq!(key(m), signer_key(CHAIN_ID, &lower));
        commands.push(decode::<TxCommand>(m).await);
    }
    for c in &commands {
        assert_eq!(c.tx_id, tx_id.to_string());
        assert_eq!((c.chain_id, c.signer.as_str()), (CHAIN_ID, lower.as_str()));
        assert_eq!(c.requested_by, "op-1", "the token's sub");
    }
    assert_eq!(commands[0].command, TxCommandKind::Approve);
    assert_eq!(
        commands[0].event_id,
        approved["event_id"].as_str().expect("id")
    );
    assert_eq!(commands[0].reason, None);
    assert_eq!(commands[1].command, TxCommandKind::Cancel);
    assert_eq!(commands[1].reason.as_deref(), Some("not needed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_broker_a_transfer_is_still_recorded_and_a_tx_request_gets_503() {
    let (db, dir) = (database().await, Dir::new());
    let (key_bytes, env) = secret(&dir);
    // A broker nobody listens on: the gateway starts all the same.
    let nowhere = format!("127.0.0.1:{}", free_port());
    let g = Gateway::start(&db, &[env, ("TXFLOW_BROKERS", nowhere)]).await;
    let alice = hs256(&key_bytes, "alice", 300);
    let (status, ready) = g.answer(g.client.get(format!("{}/readyz", g.url))).await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["failed"], json!(["broker"]), "{ready}");

    // The transfer is recorded and accepted; the coordinator's recovery scan will resume it.
    let (status, created) = g.post(Some(&alice), &transfer("10")).await;
    assert_eq!(status, 202, "{created}");
    assert_eq!(transfers(&db).await, 1);
    let req_id = created["req_id"].as_str().expect("a req_id").to_string();
    wait_for(
        "the failed publish is logged with its req_id",
        Duration::from_secs(30),
        || async {
            let log = std::fs::read_to_string(&g.log).unwrap_or_default();
            log.lines()
                .any(|l| {
                    l.contains("WARN") && l.contains("TransferRequested") && l.contains(&req_id)
                })
                .then_some(())
        },
    )
    .await;

    // A tx request is only published, so its failure is the caller's to retry.
    let body = json!({
        "request_id": "order-1", "chain_id": CHAIN_ID, "signer": SIGNER, "to": TO, "value": "1",
    });
    let submitter = hs256_claims(
        &key_bytes,
        json!({"sub": "svc-a", "scope": format!("tx:submit:{SIGNER}")}),
    );
    let (status, answer) = g
        .call(
            reqwest::Method::POST,
            "/api/v1/tx",
            Some(&submitter),
            Some(&body),
        )
        .await;
    assert_eq!((status, code(&answer)), (503, "SYSTEM_ERROR"), "{answer}");
    // Audited before publishing, and the broker's refusal after it.
    let outcomes: Vec<(String, Option<String>)> = audit_rows(&db)
        .await
        .into_iter()
        .map(|(_, _, _, outcome, code)| (outcome, code))
        .collect();
    assert_eq!(
        outcomes,
        [
            ("allowed".to_string(), None),
            ("unpublished".to_string(), Some("SYSTEM_ERROR".to_string()))
        ]
    );
}

/// The audit rows of the gateway, oldest first: (principal, action, target, outcome, code).
async fn audit_rows(db: &TestDb) -> Vec<(String, String, String, String, Option<String>)> {
    sqlx::query_as(
        "SELECT principal, action, target, outcome, code FROM gateway_audit ORDER BY audit_id",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read gateway_audit")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopes_decide_who_may_submit_read_approve_and_cancel_for_which_signer_and_every_act_is_audited()
 {
    let (db, dir) = (database().await, Dir::new());
    let (key, env) = secret(&dir);
    let g = Gateway::start(&db, std::slice::from_ref(&env)).await;
    g.ready().await;
    let (post, get) = (reqwest::Method::POST, reqwest::Method::GET);
    const OTHER: &str = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8";
    let lower = SIGNER.to_ascii_lowercase();
    let token = |sub: &str, scope: &str| hs256_claims(&key, json!({"sub": sub, "scope": scope}));
    let end_user = hs256(&key, "alice", 300);
    let other_submitter = token("svc-b", &format!("tx:submit:{OTHER} tx:read:{OTHER}"));
    let submitter = token("svc-a", &format!("tx:submit:{SIGNER} tx:read:{SIGNER}"));
    let approver_of_other = token("op-2", &format!("tx:read:{OTHER} tx:approve:{OTHER}"));
    let reader = token("viewer", &format!("tx:read:{SIGNER}"));
    let self_approver = token("svc-a", &format!("tx:read:* tx:approve:{SIGNER}"));
    let approver = token(
        "op-1",
        &format!("tx:read:* tx:approve:{SIGNER} tx:cancel:*"),
    );
    // The auditor's token as an operator mints one: `txflow token` with the gateway's secret.
    let minted = Command::new(env!("CARGO_BIN_EXE_txflow"))
        .args([
            "token",
            "--sub",
            "auditor",
            "--scope",
            "audit:read",
            "--ttl",
            "600",
        ])
        .env_remove("TXFLOW_CONFIG")
        .env(env.0, &env.1)
        .output()
        .await
        .expect("run txflow token");
    assert!(
        minted.status.success(),
        "{}",
        String::from_utf8_lossy(&minted.stderr)
    );
    let auditor = String::from_utf8(minted.stdout)
        .expect("text")
        .trim()
        .to_string();
    let request = json!({"request_id": "order-1", "chain_id": CHAIN_ID, "signer": SIGNER,
                         "to": TO, "value": "1", "data": "0x"});

    // Submit: only with tx:submit for that signer.
    for (what, t) in [
        ("an end user's token", &end_user),
        ("tx:submit for another signer", &other_submitter),
        ("tx:read only", &reader),
    ] {
        let (status, answer) = g
            .call(post.clone(), "/api/v1/tx", Some(t), Some(&request))
            .await;
        assert_eq!(
            (status, code(&answer)),
            (403, "FORBIDDEN"),
            "{what}: {answer}"
        );
    }
    let (status, answer) = g
        .call(post.clone(), "/api/v1/tx", Some(&submitter), Some(&request))
        .await;
    assert_eq!(status, 202, "{answer}");
    let published: Vec<TxRequest> = {
        let mut v = Vec::new();
        for m in &read_topic(&g.topics.tx_requests(), 1).await {
            v.push(decode::<TxRequest>(m).await);
        }
        v
    };
    // One key, one partition: had a refused request been published, it would come first.
    assert_eq!(published[0].submitted_by.as_deref(), Some("svc-a"));

    // A transaction svc-a submitted, awaiting approval (as the allocator records it).
    let tx_id = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, payload, state, submitted_by) \
         VALUES ($1, $2, $3, 'order-1', $4, 'PENDING_APPROVAL', 'svc-a')",
    )
    .bind(tx_id)
    .bind(CHAIN_ID)
    .bind(&lower)
    .bind(json!({"to": TO.to_ascii_lowercase(), "value": "1", "data": "0x",
        "gas_limit": null, "max_fee_per_gas": null, "max_priority_fee_per_gas": null}))
    .execute(&db.pool)
    .await
    .expect("insert a transaction");
    let by_id = format!("/api/v1/tx/{tx_id}");
    let by_request =
        format!("/api/v1/tx/by-request?chain_id={CHAIN_ID}&signer={SIGNER}&request_id=order-1");

    // Read: with tx:read for the signer; another signer's reader does not learn it exists (404);
    // a token with no tx:read at all, or naming the signer it may not read, is 403.
    for (what, t, path, status, expected) in [
        ("tx:read for the signer", &reader, &by_id, 200, ""),
        (
            "tx:read for the signer, by request",
            &reader,
            &by_request,
            200,
            "",
        ),
        (
            "tx:read for another signer",
            &other_submitter,
            &by_id,
            404,
            "NOT_FOUND",
        ),
        (
            "by request, another signer's reader",
            &other_submitter,
            &by_request,
            403,
            "FORBIDDEN",
        ),
        ("an end user's token", &end_user, &by_id, 403, "FORBIDDEN"),
        ("an auditor", &auditor, &by_id, 403, "FORBIDDEN"),
    ] {
        let (got, answer) = g.call(get.clone(), path, Some(t), None).await;
        assert_eq!(got, status, "{what}: {answer}");
        if status == 200 {
            assert_eq!(answer["submitted_by"], "svc-a", "{what}: {answer}");
        } else {
            assert_eq!(code(&answer), expected, "{what}: {answer}");
        }
    }

    // Approve: four eyes, and only for the signer the scope names.
    let approve = format!("/api/v1/tx/{tx_id}/approve");
    let cancel = format!("/api/v1/tx/{tx_id}/cancel");
    for (what, t, status, expected) in [
        ("the submitter", &self_approver, 403, "SELF_APPROVAL"),
        ("a reader", &reader, 403, "FORBIDDEN"),
        (
            "another signer's approver",
            &approver_of_other,
            404,
            "NOT_FOUND",
        ),
        ("an end user", &end_user, 403, "FORBIDDEN"),
    ] {
        let (got, answer) = g.call(post.clone(), &approve, Some(t), None).await;
        assert_eq!((got, code(&answer)), (status, expected), "{what}: {answer}");
    }
    let (status, answer) = g.call(post.clone(), &cancel, Some(&reader), None).await;
    assert_eq!((status, code(&answer)), (403, "FORBIDDEN"), "{answer}");
    let (status, answer) = g.call(post.clone(), &approve, Some(&approver), None).await;
    assert_eq!(status, 202, "{answer}");
    let (status, answer) = g.call(post.clone(), &cancel, Some(&approver), None).await;
    assert_eq!(status, 202, "{answer}");
    // One key, one partition: a refused command published would be among the first two.
    let commands = read_topic(&g.topics.tx_commands(), 2).await;
    for m in &commands {
        let c: TxCommand = decode(m).await;
        assert_eq!(c.requested_by, "op-1");
    }

    // Transfers: an end user's only.
    let (status, answer) = g.post(Some(&submitter), &transfer("1")).await;
    assert_eq!((status, code(&answer)), (403, "FORBIDDEN"), "{answer}");

    // The audit log: every submit, approve and cancel, allowed or refused, in order.
    let target = format!("{CHAIN_ID}/{lower}/order-1");
    let tx = tx_id.to_string();
    let refused = |p: &str, a: &str, t: &str, c: &str| {
        (
            p.to_string(),
            a.to_string(),
            t.to_string(),
            "refused".to_string(),
            Some(c.to_string()),
        )
    };
    let allowed = |p: &str, a: &str, t: &str| {
        (
            p.to_string(),
            a.to_string(),
            t.to_string(),
            "allowed".to_string(),
            None,
        )
    };
    assert_eq!(
        audit_rows(&db).await,
        vec![
            refused("alice", "tx.submit", &target, "FORBIDDEN"),
            refused("svc-b", "tx.submit", &target, "FORBIDDEN"),
            refused("viewer", "tx.submit", &target, "FORBIDDEN"),
            allowed("svc-a", "tx.submit", &target),
            refused("svc-a", "tx.approve", &tx, "SELF_APPROVAL"),
            refused("viewer", "tx.approve", &tx, "FORBIDDEN"),
            refused("op-2", "tx.approve", &tx, "NOT_FOUND"),
            refused("alice", "tx.approve", &tx, "FORBIDDEN"),
            refused("viewer", "tx.cancel", &tx, "FORBIDDEN"),
            allowed("op-1", "tx.approve", &tx),
            allowed("op-1", "tx.cancel", &tx),
        ]
    );
    // Append-only, to the service's own role too.
    for sql in [
        "UPDATE gateway_audit SET outcome = 'allowed'",
        "DELETE FROM gateway_audit",
        "TRUNCATE gateway_audit",
    ] {
        let e = sqlx::query(sql)
            .execute(&db.pool)
            .await
            .expect_err("the audit log is append-only");
        assert!(e.to_string().contains("append-only"), "{sql}: {e}");
    }
    // Readable by an auditor only, in pages.
    let (status, page) = g
        .call(
            get.clone(),
            "/api/v1/audit?after=0&limit=4",
            Some(&auditor),
            None,
        )
        .await;
    assert_eq!(status, 200, "{page}");
    let page = page.as_array().expect("a list");
    assert_eq!(page.len(), 4);
    assert_eq!(
        (page[3]["principal"].as_str(), page[3]["outcome"].as_str()),
        (Some("svc-a"), Some("allowed"))
    );
    let last = page[3]["audit_id"].as_i64().expect("an id");
    let (_, rest) = g
        .call(
            get.clone(),
            &format!("/api/v1/audit?after={last}"),
            Some(&auditor),
            None,
        )
        .await;
    assert_eq!(rest.as_array().map(Vec::len), Some(7), "{rest}");
    for t in [&approver, &end_user] {
        let (status, answer) = g.call(get.clone(), "/api/v1/audit", Some(t), None).await;
        assert_eq!((status, code(&answer)), (403, "FORBIDDEN"), "{answer}");
    }
}

/// base64url without padding (RFC 7515 §2), for the JWKS below.
fn b64url(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// An ES256 (P-256) key pair: the private key as PKCS#8 PEM, and the public point's (x, y).
fn ec_pair(dir: &Dir) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let raw = dir.0.join("ec-raw.pem");
    let raw = raw.to_string_lossy().into_owned();
    openssl(&[
        "ecparam",
        "-name",
        "prime256v1",
        "-genkey",
        "-noout",
        "-out",
        &raw,
    ]);
    let pkcs8 = openssl(&["pkcs8", "-topk8", "-nocrypt", "-in", &raw]);
    let der = openssl(&["ec", "-in", &raw, "-pubout", "-outform", "DER"]);
    // The SubjectPublicKeyInfo ends with the uncompressed point 04 || x || y.
    let point = &der[der.len() - 65..];
    assert_eq!(point[0], 4, "an uncompressed point");
    (pkcs8, point[1..33].to_vec(), point[33..].to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_need_their_audience_issuer_a_bounded_lifetime_and_a_key_of_the_set_by_kid() {
    let (db, dir) = (database().await, Dir::new());
    let (rsa_private, rsa_public) = rsa_pair(&dir);
    let (ec_private, x, y) = ec_pair(&dir);
    let secret = b"a-rotated-in-hs256-secret-of-32-bytes-or-more";
    // The RSA key's modulus and exponent, for its JWK.
    let modulus = openssl(&[
        "rsa",
        "-pubin",
        "-in",
        &rsa_public.to_string_lossy(),
        "-noout",
        "-modulus",
    ]);
    let modulus = String::from_utf8_lossy(&modulus);
    let n = hex::decode(modulus.trim().trim_start_matches("Modulus=")).expect("hex modulus");
    let jwks = json!({"keys": [
        {"kty": "oct", "kid": "hs-2026-11", "alg": "HS256", "k": b64url(secret)},
        {"kty": "EC", "kid": "es-2026-11", "alg": "ES256", "crv": "P-256",
         "x": b64url(&x), "y": b64url(&y)},
        {"kty": "RSA", "kid": "rs-2026-10", "alg": "RS256", "n": b64url(&n), "e": "AQAB"},
    ]});
    let jwks_file = dir.file("jwks.json", jwks.to_string().as_bytes());
    let g = Gateway::start(
        &db,
        &[
            (
                "TXFLOW_GATEWAY_JWT_JWKS_FILE",
                jwks_file.to_string_lossy().into_owned(),
            ),
            ("TXFLOW_GATEWAY_JWT_AUDIENCE", "txflow-prod".into()),
            ("TXFLOW_GATEWAY_JWT_ISSUER", "https://idp.example".into()),
            ("TXFLOW_GATEWAY_JWT_MAX_LIFETIME_SECS", "900".into()),
        ],
    )
    .await;
    let sign = |alg: Algorithm, kid: Option<&str>, claims: Value| {
        let mut h = Header::new(alg);
        h.kid = kid.map(str::to_string);
        let mut c = json!({"sub": "alice", "scope": "transfer", "iat": now(), "exp": now() + 600,
                           "aud": "txflow-prod", "iss": "https://idp.example"});
        for (k, v) in claims.as_object().expect("an object") {
            c[k] = v.clone();
        }
        let key = match alg {
            Algorithm::HS256 => EncodingKey::from_secret(secret),
            Algorithm::ES256 => EncodingKey::from_ec_pem(&ec_private).expect("an EC key"),
            _ => EncodingKey::from_rsa_pem(&rsa_private).expect("an RSA key"),
        };
        jsonwebtoken::encode(&h, &c, &key).expect("sign")
    };
    // Every key of the set, by its kid.
    for (n, (alg, kid)) in [
        (Algorithm::HS256, "hs-2026-11"),
        (Algorithm::ES256, "es-2026-11"),
        (Algorithm::RS256, "rs-2026-10"),
    ]
    .into_iter()
    .enumerate()
    {
        let (status, answer) = g
            .post(
                Some(&sign(alg, Some(kid), json!({}))),
                &transfer(&format!("{}", n + 1)),
            )
            .await;
        assert_eq!(status, 202, "{kid}: {answer}");
    }
    // The RSA public key as an HS256 secret (algorithm confusion), under the RSA key's kid.
    let public_pem = std::fs::read(&rsa_public).expect("public key");
    let mut h = Header::new(Algorithm::HS256);
    h.kid = Some("rs-2026-10".into());
    let confused = jsonwebtoken::encode(
        &h,
        &with_defaults(
            json!({"sub": "alice", "scope": "transfer", "aud": "txflow-prod",
                              "iss": "https://idp.example"}),
        ),
        &EncodingKey::from_secret(&public_pem),
    )
    .expect("sign");
    // alg=none: the claims of a valid token, no signature.
    let valid = sign(Algorithm::HS256, Some("hs-2026-11"), json!({}));
    let none = format!(
        "{}.{}.",
        b64url(br#"{"alg":"none","typ":"JWT","kid":"hs-2026-11"}"#),
        valid.split('.').nth(1).expect("claims")
    );
    for (what, t) in [
        (
            "a wrong audience",
            sign(
                Algorithm::HS256,
                Some("hs-2026-11"),
                json!({"aud": "txflow"}),
            ),
        ),
        (
            "a wrong issuer",
            sign(
                Algorithm::ES256,
                Some("es-2026-11"),
                json!({"iss": "txflow"}),
            ),
        ),
        (
            "a lifetime over 900 s",
            sign(
                Algorithm::HS256,
                Some("hs-2026-11"),
                json!({"exp": now() + 1000}),
            ),
        ),
        (
            "no iat",
            sign(Algorithm::HS256, Some("hs-2026-11"), json!({"iat": null})),
        ),
        (
            "an unknown kid",
            sign(Algorithm::HS256, Some("hs-2026-09"), json!({})),
        ),
        (
            "no kid with several keys",
            sign(Algorithm::HS256, None, json!({})),
        ),
        (
            "an ES256 token under the HS256 kid",
            sign(Algorithm::ES256, Some("hs-2026-11"), json!({})),
        ),
        ("alg=none", none),
        ("the RS256 public key as an HS256 secret", confused),
    ] {
        let (status, answer) = g.post(Some(&t), &transfer("9")).await;
        assert_eq!(
            (status, code(&answer)),
            (401, "UNAUTHORIZED"),
            "{what}: {answer}"
        );
    }
    assert_eq!(
        transfers(&db).await,
        3,
        "only the three valid tokens' transfers"
    );
}
