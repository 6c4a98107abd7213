//! The HTTP gateway (issue 18, seed 004 §8) as a client sees it: `txflow gateway` runs as a
//! process on a database of the test's own, and a real HTTP client sends it forged, expired and
//! wrong-user tokens, malformed and oversized bodies, and every invalid amount of §10.2; each gets
//! its status and code, and nothing is written to `transfers`. A valid request is one INIT row
//! that GET returns to its owner only; the same `cid` twice is one transfer; a user above the
//! rate gets 429. Test names carry the seed's ids (§10.2 ATK-xxx).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use txflow_tests::{TestDb, free_port, spawn_child, unique, wait_for};

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

/// An HS256 token for `sub` expiring `ttl` seconds from now (negative: expired).
fn hs256(secret: &[u8], sub: &str, ttl: i64) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &json!({"sub": sub, "exp": now() + ttl}),
        &EncodingKey::from_secret(secret),
    )
    .expect("encode a token")
}

/// A `txflow gateway` process on `db`, its log in a file shown when something fails.
struct Gateway {
    url: String,
    log: PathBuf,
    client: reqwest::Client,
    _child: Child,
}

impl Gateway {
    async fn start(db: &TestDb, env: &[(&str, String)]) -> Gateway {
        let addr = format!("127.0.0.1:{}", free_port());
        let log = std::env::temp_dir().join(format!("{}.log", unique("gateway")));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
        cmd.arg("gateway")
            .env_remove("TXFLOW_CONFIG")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env("TXFLOW_DATABASE_URL", &db.url)
            .env("TXFLOW_GATEWAY_ADDR", &addr)
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
    let no_exp = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &json!({"sub": "alice"}),
        &EncodingKey::from_secret(&key),
    )
    .expect("encode");
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

/// `openssl` makes an RSA key pair (PKCS#1 private key, SPKI public key) in `dir`.
fn rsa_pair(dir: &Dir) -> (Vec<u8>, PathBuf) {
    let private = dir.0.join("jwt-private.pem");
    let public = dir.0.join("jwt-public.pem");
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let path = |p: &Path| p.to_string_lossy().into_owned();
    run(&["genrsa", "-traditional", "-out", &path(&private), "2048"]);
    run(&[
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
    let claims = json!({"sub": "alice", "exp": now() + 300});
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
