//! The stage runtime, with the test stage (`txflow_tests::test_stage`), against real PostgreSQL,
//! broker and Schema Registry. Crash tests run the stage as a process of its own
//! (`test-stage`), killed at the runtime's fault points, with kill -9, or paused with SIGSTOP.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use txflow_core::codec::{RegistryCodec, Subjects};
use txflow_core::events::{TxAccepted, TxRequest};
use txflow_core::kafka::{KafkaSettings, signer_key};
use txflow_core::role::Role;
use txflow_core::stage::partition::partition_for;
use txflow_tests::test_stage::{FAIL_CODE, FAIL_DRIVE_CODE};
use txflow_tests::{
    OwnBroker, TestDb, TestTopics, group_consumer, kafka_settings, producer, registry_url, unique,
    wait_for, wait_until,
};

const LONG: Duration = Duration::from_secs(90);
/// The partitions of the test topics (and `TEST_STAGE_PARTITIONS`).
const PARTITIONS: i32 = 4;

fn signer(i: u32) -> String {
    format!("0x{:040x}", 0xabc000 + i)
}

fn request(signer: &str, request_id: &str) -> TxRequest {
    TxRequest {
        event_id: uuid::Uuid::new_v4().to_string(),
        request_id: request_id.to_string(),
        chain_id: 31337,
        signer: signer.to_string(),
        to: "0x70997970c51812dc3a010c7d01b50e0d17dc79c8".into(),
        value: "1".into(),
        data: vec![],
        gas_limit: None,
        max_fee_per_gas: None,
        max_priority_fee_per_gas: None,
        metadata: Default::default(),
        depends_on_request_id: None,
        depends_on_signer: None,
        submitted_by: None,
    }
}

/// Topics, database and settings for one stage under test.
struct Fixture {
    db: TestDb,
    topics: TestTopics,
    group: String,
    kafka: KafkaSettings,
    codec: RegistryCodec,
    producer: FutureProducer,
}

impl Fixture {
    async fn new(kafka: KafkaSettings) -> Fixture {
        let db = TestDb::new().await;
        txflow_tests::test_stage::create_external_system(&db.pool)
            .await
            .expect("external system");
        let topics = TestTopics::create(&kafka, "stage", 3, PARTITIONS).await;
        Fixture {
            db,
            topics,
            group: unique("stage"),
            producer: producer(&kafka),
            kafka,
            codec: RegistryCodec::new(registry_url()),
        }
    }
    fn input(&self) -> &str {
        self.topics.name(0)
    }
    fn outcomes(&self) -> &str {
        self.topics.name(1)
    }
    fn dlq(&self) -> &str {
        self.topics.name(2)
    }

    async fn send(&self, r: &TxRequest) {
        let bytes = self
            .codec
            .encode(self.input(), Subjects::TopicName, r)
            .await
            .expect("encode");
        let key = signer_key(r.chain_id, &r.signer);
        self.send_raw(&key, &bytes).await;
    }

    /// Produces `r` and returns where it landed, `(partition, offset)`, and its bytes.
    async fn send_at(&self, r: &TxRequest) -> (i32, i64, Vec<u8>) {
        let bytes = self
            .codec
            .encode(self.input(), Subjects::TopicName, r)
            .await
            .expect("encode");
        let key = signer_key(r.chain_id, &r.signer);
        let (partition, offset) = self.send_raw(&key, &bytes).await;
        (partition, offset, bytes)
    }

    async fn send_raw(&self, key: &str, bytes: &[u8]) -> (i32, i64) {
        let delivery = self
            .producer
            .send(
                FutureRecord::to(self.input()).key(key).payload(bytes),
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
        (delivery.partition, delivery.offset)
    }

    /// Starts the test stage as a process. `fault` aborts it at that fault point;
    /// `pause` stops it there with SIGSTOP.
    fn spawn(&self, node: &str, fault: Option<&str>, pause: Option<&str>) -> Child {
        self.command(node, fault, pause)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start test-stage")
    }

    /// Like `spawn`, keeping the stage's log lines for the test to wait on.
    fn spawn_logged(&self, node: &str, pause: Option<&str>) -> (Child, Arc<Mutex<Vec<String>>>) {
        logged(self.command(node, None, pause))
    }

    /// Every message of the DLQ topic, all partitions from their beginning. The stage must have
    /// stopped: a marker of the test's own is appended to every partition and each is read up to
    /// it (the broker's high watermark cannot say where a partition ends, see ARCHITECTURE.md).
    async fn whole_dlq(&self) -> Vec<OwnedMessage> {
        let marker = format!("end-of-dlq-{}", uuid::Uuid::new_v4()).into_bytes();
        for p in 0..PARTITIONS {
            self.producer
                .send(
                    FutureRecord::<(), [u8]>::to(self.dlq())
                        .partition(p)
                        .payload(&marker[..]),
                    Duration::from_secs(30),
                )
                .await
                .unwrap_or_else(|(e, _)| panic!("produce the DLQ marker: {e}"));
        }
        let c = group_consumer(&self.kafka, &unique("whole-dlq"));
        let mut list = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            list.add_partition_offset(self.dlq(), p, Offset::Beginning)
                .expect("partition");
        }
        c.assign(&list).expect("assign");
        let mut ended = BTreeSet::new();
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + LONG;
        while ended.len() < PARTITIONS as usize {
            let m = tokio::time::timeout_at(deadline, c.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "the DLQ markers of {} of {PARTITIONS} partitions arrived ({} messages)",
                        ended.len(),
                        out.len()
                    )
                })
                .expect("consume the DLQ")
                .detach();
            if m.payload() == Some(marker.as_slice()) {
                ended.insert(m.partition());
            } else {
                out.push(m);
            }
        }
        out
    }
    fn command(&self, node: &str, fault: Option<&str>, pause: Option<&str>) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_test-stage"));
        cmd.env("TXFLOW_DATABASE_URL", &self.db.url)
            .env("TXFLOW_BROKERS", &self.kafka.brokers)
            .env("TXFLOW_SCHEMA_REGISTRY_URL", registry_url())
            .env("TEST_STAGE_INPUT", self.input())
            .env("TEST_STAGE_OUTCOMES", self.outcomes())
            .env("TEST_STAGE_DLQ", self.dlq())
            .env("TEST_STAGE_GROUP", &self.group)
            .env("TEST_STAGE_NODE", node)
            .env("TEST_STAGE_PARTITIONS", "4")
            .env("TEST_STAGE_LEASE_MS", "2000")
            .env("TEST_STAGE_RECOVERY_MS", "1000")
            .env_remove("TXFLOW_FAULT")
            .env_remove("TXFLOW_PAUSE_AT")
            .stdout(Stdio::null())
            .kill_on_drop(true);
        if let Some(f) = fault {
            cmd.env("TXFLOW_FAULT", f);
        }
        if let Some(p) = pause {
            cmd.env("TXFLOW_PAUSE_AT", p);
        }
        cmd
    }

    /// Every TxAccepted on the outcomes topic so far (a fresh reader from the start), in order.
    async fn accepted(&self, at_least: usize) -> Vec<TxAccepted> {
        let c = group_consumer(&self.kafka, &unique("read"));
        c.subscribe(&[self.outcomes()]).expect("subscribe");
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + LONG;
        while out.len() < at_least {
            let m = tokio::time::timeout_at(deadline, c.recv())
                .await
                .unwrap_or_else(|_| panic!("{} of {at_least} TxAccepted arrived", out.len()))
                .expect("consume");
            let bytes = m.payload().expect("payload");
            out.push(
                self.codec
                    .decode::<TxAccepted>(bytes)
                    .await
                    .expect("a TxAccepted"),
            );
        }
        out
    }

    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.db.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// Starts the stage's `command`, keeping its log lines for the test to wait on.
fn logged(mut command: Command) -> (Child, Arc<Mutex<Vec<String>>>) {
    let mut child = command
        .stderr(Stdio::piped())
        .spawn()
        .expect("start test-stage");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    let stderr = child.stderr.take().expect("piped");
    tokio::spawn(async move {
        let mut reader = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = reader.next_line().await {
            eprintln!("[stage] {line}");
            sink.lock().expect("lock").push(line);
        }
    });
    (child, lines)
}

/// The value of header `key` of `m`.
fn header_of(m: &OwnedMessage, key: &str) -> Option<String> {
    m.headers().and_then(|h| {
        h.iter()
            .find(|x| x.key == key)
            .and_then(|x| x.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    })
}

/// A signer other than `s` whose messages land on the same partition as `s`'s.
fn signer_on_the_partition_of(s: &str) -> String {
    let of = |s: &str| partition_for(&signer_key(31337, s), PARTITIONS);
    (1000..)
        .map(signer)
        .find(|o| o != s && of(o) == of(s))
        .expect("a signer on the same partition")
}

async fn exits(child: &mut Child, what: &str) {
    let status = tokio::time::timeout(LONG, child.wait())
        .await
        .unwrap_or_else(|_| panic!("{what}: the stage did not stop within {LONG:?}"))
        .expect("wait");
    assert!(
        !status.success(),
        "{what}: the stage should have been aborted, got {status}"
    );
}

fn signal(child: &Child, sig: &str) {
    let pid = child.id().expect("running").to_string();
    let ok = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig} {pid}");
}

#[tokio::test]
async fn poison_messages_are_dead_lettered_with_their_reason_and_the_next_is_processed() {
    let f = Fixture::new(kafka_settings()).await;
    let s = signer(1);
    let key = signer_key(31337, &s);
    f.send_raw(&key, b"definitely not avro").await;
    // Same key as the good request: one partition, so the order (and offsets) are known.
    let bad = request("0xnot-an-address", "bad-signer");
    let bytes = f
        .codec
        .encode(f.input(), Subjects::TopicName, &bad)
        .await
        .expect("encode");
    f.send_raw(&key, &bytes).await;
    // The good one carries a W3C trace context: the output continues the same trace.
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let good = f
        .codec
        .encode(f.input(), Subjects::TopicName, &request(&s, "good-1"))
        .await
        .expect("encode");
    let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
        key: "traceparent",
        value: Some(parent),
    });
    f.producer
        .send(
            FutureRecord::to(f.input())
                .key(&key)
                .payload(&good)
                .headers(headers),
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
    let mut stage = f.spawn("node-a", None, None);

    let accepted = f.accepted(1).await;
    assert_eq!(accepted[0].request_id, "good-1");
    let out = group_consumer(&f.kafka, &unique("trace"));
    out.subscribe(&[f.outcomes()]).expect("subscribe");
    let m = &txflow_tests::collect(&out, 1, LONG).await[0];
    let traceparent = m
        .headers()
        .and_then(|h| {
            h.iter()
                .find(|x| x.key == "traceparent")
                .and_then(|x| x.value)
        })
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .expect("the output has a traceparent");
    assert!(
        traceparent.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
        "{traceparent}"
    );
    assert_ne!(traceparent, parent, "a new span of the same trace");

    let dlq = group_consumer(&f.kafka, &unique("dlq"));
    dlq.subscribe(&[f.dlq()]).expect("subscribe");
    let dead = txflow_tests::collect(&dlq, 2, LONG).await;
    let header = |m: &rdkafka::message::OwnedMessage, k: &str| {
        m.headers()
            .and_then(|h| {
                h.iter()
                    .find(|x| x.key == k)
                    .and_then(|x| x.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
            .unwrap_or_else(|| panic!("header {k} missing"))
    };
    let codes: Vec<String> = dead.iter().map(|m| header(m, "error.code")).collect();
    assert_eq!(codes, ["UNDECODABLE", "INVALID_SIGNER"]);
    for (m, offset) in dead.iter().zip([0, 1]) {
        assert_eq!(header(m, "source.topic"), f.input());
        assert_eq!(header(m, "source.offset"), offset.to_string());
        assert!(!header(m, "source.partition").is_empty());
        assert!(!header(m, "error.message").is_empty());
    }
    assert_eq!(
        dead[0].payload(),
        Some(&b"definitely not avro"[..]),
        "the original bytes are kept"
    );
    assert_eq!(f.count("SELECT count(*) FROM managed_tx").await, 1);
    signal(&stage, "-TERM");
    let _ = tokio::time::timeout(LONG, stage.wait()).await;
}

#[tokio::test]
async fn a_crash_after_the_commit_and_before_the_produce_re_emits_the_same_event_once_restarted() {
    let f = Fixture::new(kafka_settings()).await;
    let s = signer(2);
    f.send(&request(&s, "r-1")).await;
    let mut crashing = f.spawn("node-a", Some(txflow_core::fault::AFTER_COMMIT), None);
    exits(&mut crashing, "after commit").await;
    assert_eq!(
        f.count("SELECT count(*) FROM managed_tx").await,
        1,
        "the commit happened before the crash"
    );

    let mut stage = f.spawn("node-b", None, None);
    let accepted = f.accepted(1).await;
    let stored: uuid::Uuid =
        sqlx::query_scalar("SELECT event_id FROM tx_events WHERE type = 'TxAccepted'")
            .fetch_one(&f.db.pool)
            .await
            .expect("event");
    assert_eq!(
        accepted[0].event_id,
        stored.to_string(),
        "the output carries the recorded event_id"
    );
    assert_eq!(
        f.count("SELECT count(*) FROM managed_tx").await,
        1,
        "nothing applied twice"
    );
    assert_eq!(
        f.count("SELECT count(*) FROM tx_events WHERE type = 'TxAccepted'")
            .await,
        1
    );
    signal(&stage, "-TERM");
    let _ = tokio::time::timeout(LONG, stage.wait()).await;
}

#[tokio::test]
async fn a_crash_after_the_produce_and_before_the_offset_store_duplicates_only_the_same_event() {
    let f = Fixture::new(kafka_settings()).await;
    let s = signer(3);
    f.send(&request(&s, "r-1")).await;
    let mut crashing = f.spawn("node-a", Some(txflow_core::fault::AFTER_PRODUCE), None);
    exits(&mut crashing, "after produce").await;

    let mut stage = f.spawn("node-b", None, None);
    // The message is delivered again: the output appears twice, with one event_id.
    let accepted = f.accepted(2).await;
    assert_eq!(
        accepted[0].event_id, accepted[1].event_id,
        "a duplicate carries the same event_id"
    );
    // An idempotent downstream (keyed by event_id) applies it once.
    let applied: BTreeSet<&str> = accepted.iter().map(|a| a.event_id.as_str()).collect();
    assert_eq!(applied.len(), 1);
    assert_eq!(f.count("SELECT count(*) FROM managed_tx").await, 1);
    signal(&stage, "-TERM");
    let _ = tokio::time::timeout(LONG, stage.wait()).await;
}

#[tokio::test]
async fn a_crash_after_an_external_call_repeats_the_call_idempotently_and_records_one_result() {
    let f = Fixture::new(kafka_settings()).await;
    let s = signer(4);
    f.send(&request(&s, "r-1")).await;
    let mut crashing = f.spawn("node-a", Some(txflow_core::fault::AFTER_CALL), None);
    exits(&mut crashing, "after the external call").await;
    assert_eq!(
        f.count("SELECT count(*) FROM managed_tx WHERE state = 'RECEIVED'")
            .await,
        1,
        "the result was not recorded"
    );
    assert_eq!(
        f.count("SELECT coalesce(sum(calls), 0) FROM test_external_calls")
            .await,
        1,
        "the call was made"
    );

    let mut stage = f.spawn("node-b", None, None);
    wait_until(
        "the restarted stage recorded the call's result",
        LONG,
        || async {
            f.count("SELECT count(*) FROM managed_tx WHERE state = 'SIMULATED'")
                .await
                == 1
        },
    )
    .await;
    assert_eq!(
        f.count("SELECT count(*) FROM test_external_calls").await,
        1,
        "one effect"
    );
    assert_eq!(
        f.count("SELECT sum(calls) FROM test_external_calls").await,
        2,
        "the call was repeated"
    );
    assert_eq!(
        f.count("SELECT count(*) FROM tx_events WHERE type = 'TxSimulated'")
            .await,
        1,
        "one result recorded"
    );
    signal(&stage, "-TERM");
    let _ = tokio::time::timeout(LONG, stage.wait()).await;
}

/// Lease owners per signer, from PostgreSQL.
async fn owners(f: &Fixture) -> BTreeMap<String, String> {
    sqlx::query_as::<_, (String, String)>(
        "SELECT signer, owner_node FROM signer_lease WHERE expires_at > clock_timestamp()",
    )
    .fetch_all(&f.db.pool)
    .await
    .expect("leases")
    .into_iter()
    .collect()
}

#[tokio::test]
async fn two_instances_share_the_signers_and_a_killed_one_hands_them_over() {
    let f = Fixture::new(kafka_settings()).await;
    let signers: Vec<String> = (10..22).map(signer).collect();
    let mut a = f.spawn("node-a", None, None);
    let mut b = f.spawn("node-b", None, None);
    let mut round = 0;
    // Keep traffic flowing until both instances hold leases (the group split the partitions).
    wait_until("both instances hold some signers", LONG, || {
        round += 1;
        let r = round;
        let (f, signers) = (&f, &signers);
        async move {
            for s in signers {
                f.send(&request(s, &format!("warm-{r}"))).await;
            }
            let o = owners(f).await;
            let nodes: BTreeSet<&String> = o.values().collect();
            nodes.len() == 2
        }
    })
    .await;

    signal(&a, "-KILL");
    let _ = a.wait().await;
    let mut n = 0;
    wait_until("every signer moved to the surviving instance", LONG, || {
        n += 1;
        let k = n;
        let (f, signers) = (&f, &signers);
        async move {
            for s in signers {
                f.send(&request(s, &format!("after-{k}"))).await;
            }
            let o = owners(f).await;
            signers
                .iter()
                .all(|s| o.get(s).is_some_and(|n| n == "node-b"))
        }
    })
    .await;
    // Everything sent reached PostgreSQL exactly once per request id.
    let sent = signers.len() as i64 * (round + n) as i64;
    wait_until("every request is recorded", LONG, || async {
        f.count("SELECT count(*) FROM managed_tx").await == sent
    })
    .await;
    signal(&b, "-TERM");
    let _ = tokio::time::timeout(LONG, b.wait()).await;
}

#[tokio::test]
async fn a_paused_instance_resumed_after_the_takeover_is_fenced_and_writes_nothing() {
    let f = Fixture::new(kafka_settings()).await;
    // Two signers, so a batch has a second signer to pause before.
    let (s1, s2) = (signer(30), signer(31));
    f.send(&request(&s1, "a-1")).await;
    f.send(&request(&s2, "a-2")).await;
    let sent = std::cell::Cell::new(2i64);
    let (mut a, a_log) = f.spawn_logged("node-a", Some(txflow_core::fault::MID_BATCH));
    // node-a stops itself in the middle of its first two-signer batch. A fetch may bring the two
    // signers' messages in separate batches: then another pair is sent, until one batch holds
    // both.
    wait_for("node-a paused mid-batch", 2 * LONG, || {
        let pid = a.id();
        let (f, sent) = (&f, &sent);
        let (s1, s2) = (s1.clone(), s2.clone());
        async move {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid?)).ok()?;
            if stat.split(' ').nth(2) == Some("T") {
                return Some(());
            }
            let n = sent.get();
            if f.count("SELECT count(*) FROM managed_tx").await >= n {
                f.send(&request(&s1, &format!("a-{}", n + 1))).await;
                f.send(&request(&s2, &format!("a-{}", n + 2))).await;
                sent.set(n + 2);
            }
            None
        }
    })
    .await;

    // node-b joins, gets the partitions once node-a's session times out, and steals the leases
    // once they expire; it processes the interrupted batch (and anything after it).
    let mut b = f.spawn("node-b", None, None);
    let sent = sent.get();
    wait_until("node-b processed the rest", LONG, || async {
        f.count("SELECT count(*) FROM managed_tx").await == sent
            && f.count("SELECT count(*) FROM managed_tx WHERE fencing_token >= 2")
                .await
                >= 2
    })
    .await;
    let before: Vec<(String, i64)> =
        sqlx::query_as("SELECT request_id, fencing_token FROM managed_tx ORDER BY request_id")
            .fetch_all(&f.db.pool)
            .await
            .expect("rows");

    let seen = a_log.lock().expect("lock").len();
    signal(&a, "-CONT");
    // node-a finishes its interrupted batch: its session was ended while it idled, its lease is
    // gone, so the batch is refused (it reports a warning) and retried without success.
    wait_until("node-a reported its resumed batch refused", LONG, || {
        let lines = a_log.lock().expect("lock")[seen..].to_vec();
        async move { lines.iter().any(|l| l.contains("WARN")) }
    })
    .await;
    signal(&a, "-TERM");
    let _ = tokio::time::timeout(LONG, a.wait()).await;
    let after: Vec<(String, i64)> =
        sqlx::query_as("SELECT request_id, fencing_token FROM managed_tx ORDER BY request_id")
            .fetch_all(&f.db.pool)
            .await
            .expect("rows");
    assert_eq!(before, after, "the resumed instance wrote nothing");
    signal(&b, "-TERM");
    let _ = tokio::time::timeout(LONG, b.wait()).await;
}

#[tokio::test]
async fn work_in_postgres_is_completed_by_the_recovery_scan_after_the_broker_lost_every_topic() {
    let mut broker = OwnBroker::spawn().await;
    let f = Fixture::new(broker.settings()).await;
    let s = signer(40);
    f.send(&request(&s, "before")).await;
    let mut stage = f.spawn("node-a", None, None);
    wait_until("the first request is done", LONG, || async {
        f.count("SELECT count(*) FROM managed_tx WHERE state = 'SIMULATED'")
            .await
            == 1
    })
    .await;
    signal(&stage, "-KILL");
    let _ = stage.wait().await;

    // Work that reached PostgreSQL but whose message the broker will forget.
    sqlx::query(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, payload, state)
         SELECT gen_random_uuid(), 31337, $1, 'pg-only-' || i, '{}', 'RECEIVED' FROM generate_series(1, 5) i",
    )
    .bind(&s)
    .execute(&f.db.pool)
    .await
    .expect("insert work");
    broker.restart(true).await;

    let mut stage = f.spawn("node-b", None, None);
    wait_until(
        "the recovery scan completed the work PostgreSQL knew",
        LONG,
        || async {
            f.count("SELECT count(*) FROM managed_tx WHERE state = 'SIMULATED'")
                .await
                == 6
        },
    )
    .await;
    assert_eq!(f.count("SELECT count(*) FROM test_external_calls").await, 6);
    signal(&stage, "-TERM");
    let _ = tokio::time::timeout(LONG, stage.wait()).await;
    drop(f);
}

/// The request ids recorded in managed_tx, with their signer, and how many times each.
async fn recorded(f: &Fixture) -> BTreeMap<(String, String), i64> {
    sqlx::query_as::<_, (String, String, i64)>(
        "SELECT signer, request_id, count(*) FROM managed_tx GROUP BY signer, request_id",
    )
    .fetch_all(&f.db.pool)
    .await
    .expect("managed_tx")
    .into_iter()
    .map(|(s, r, n)| ((s, r), n))
    .collect()
}

/// `HandlerError::Fail` from `handle`: the signer's savepoint is rolled back, the failing message
/// dead-lettered once with its `error.code`, the signer's other messages applied once each, and
/// neither the signer nor the partition is pinned. Another signer's message on the same
/// partition, in the same batch, is unaffected.
#[tokio::test]
async fn a_failed_message_is_dead_lettered_once_and_neither_its_signer_nor_its_partition_is_pinned()
{
    let f = Fixture::new(kafka_settings()).await;
    let s = signer(50);
    let other = signer_on_the_partition_of(&s);
    // Produced before the stage starts, so that its first fetch likely brings them in one batch:
    // ok-1 before fail-2 in the batch means the partition is rewound over fail-2, which must then
    // be skipped, not run (and dead-lettered) again.
    let (p1, _, _) = f.send_at(&request(&s, "ok-1")).await;
    let (p2, failed_offset, failed_bytes) = f.send_at(&request(&s, "fail-2")).await;
    let (po, _, _) = f.send_at(&request(&other, "other-1")).await;
    let (p3, _, _) = f.send_at(&request(&s, "ok-3")).await;
    assert!(
        [p2, po, p3].iter().all(|p| *p == p1),
        "one partition: {p1} {p2} {po} {p3}"
    );
    let mut command = f.command("node-a", None, None);
    command.env(
        "TXFLOW_LOG",
        "info,txflow::stage=debug,txflow_core::stage::batch=debug",
    );
    let (mut stage, log) = logged(command);
    let (p4, last_offset, _) = f.send_at(&request(&s, "ok-4")).await;
    assert_eq!(p4, p1);

    wait_until(
        "ok-1, ok-3, ok-4 and other-1 were recorded and driven",
        LONG,
        || async {
            f.count(
                "SELECT count(*) FROM managed_tx
                 WHERE request_id IN ('ok-1', 'ok-3', 'ok-4', 'other-1') AND state = 'SIMULATED'",
            )
            .await
                == 4
        },
    )
    .await;
    // Stopped: nothing more can be dead-lettered, and the offsets are committed.
    signal(&stage, "-TERM");
    let status = tokio::time::timeout(LONG, stage.wait())
        .await
        .expect("the stage stops")
        .expect("wait");
    assert!(status.success(), "the stage stopped with {status}");

    let expected: BTreeMap<(String, String), i64> = [
        (&s, "ok-1"),
        (&s, "ok-3"),
        (&s, "ok-4"),
        (&other, "other-1"),
    ]
    .into_iter()
    .map(|(signer, r)| ((signer.clone(), r.to_string()), 1))
    .collect();
    assert_eq!(
        recorded(&f).await,
        expected,
        "each applied once, the failed one not at all"
    );
    assert_eq!(
        f.count("SELECT count(*) FROM tx_events WHERE type = 'TxAccepted'")
            .await,
        4,
        "one announcement recorded per applied message"
    );
    assert_eq!(
        f.count("SELECT count(*) FROM test_external_calls").await,
        4,
        "one external effect per applied message"
    );

    let dead = f.whole_dlq().await;
    let failed: Vec<&OwnedMessage> = dead
        .iter()
        .filter(|m| m.payload() == Some(failed_bytes.as_slice()))
        .collect();
    assert_eq!(
        failed.len(),
        1,
        "fail-2 is dead-lettered exactly once ({} dead letters in all)",
        dead.len()
    );
    assert_eq!(dead.len(), 1, "nothing else is dead-lettered");
    let m = failed[0];
    assert_eq!(header_of(m, "error.code").as_deref(), Some(FAIL_CODE));
    assert!(
        header_of(m, "error.message").is_some_and(|r| r.contains("fail-2")),
        "{:?}",
        header_of(m, "error.message")
    );
    assert_eq!(header_of(m, "source.topic").as_deref(), Some(f.input()));
    assert_eq!(header_of(m, "source.partition"), Some(p2.to_string()));
    assert_eq!(
        header_of(m, "source.offset"),
        Some(failed_offset.to_string())
    );

    // The partition moved on past the failed message: its committed offset follows ok-4.
    let group = group_consumer(&f.kafka, &f.group);
    let mut list = TopicPartitionList::new();
    list.add_partition(f.input(), p1);
    let committed = group
        .committed_offsets(list, Duration::from_secs(10))
        .expect("committed offsets");
    let committed = committed.find_partition(f.input(), p1).map(|e| e.offset());
    assert_eq!(committed, Some(Offset::Offset(last_offset + 1)));

    // How the batches went (the test holds either way): with ok-1 and fail-2 in one batch the
    // runtime rewinds over fail-2 and skips it when it comes again.
    let lines = log.lock().expect("lock").clone();
    let count = |needle: &str| lines.iter().filter(|l| l.contains(needle)).count();
    eprintln!(
        "failed for good: {}, skipped as settled: {}, batches: {}",
        count("handler failed for good"),
        count("skipping a message dead-lettered before"),
        count("batch committed"),
    );
}

/// `HandlerError::Fail` from `drive`: the signer is held (a `signer_holds` row with the code, and
/// one alert), the recovery scan tries it again later, and the stage goes on with the others.
#[tokio::test]
async fn a_failed_drive_holds_its_signer_and_the_stage_goes_on_with_the_others() {
    let f = Fixture::new(kafka_settings()).await;
    let (held, other, third) = (signer(60), signer(61), signer(62));
    let (mut stage, log) = f.spawn_logged("node-a", None);
    f.send(&request(&other, "warm-1")).await;
    let driven = |request_id: &'static str| {
        let pool = &f.db.pool;
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM managed_tx WHERE request_id = $1 AND state = 'SIMULATED'",
            )
            .bind(request_id)
            .fetch_one(pool)
            .await
            .expect("count")
                == 1
        }
    };
    wait_until("the stage is running: warm-1 was driven", LONG, || {
        driven("warm-1")
    })
    .await;

    // Work that fails its signer's drive, known to PostgreSQL only: the recovery scan drives it.
    let tx_id: uuid::Uuid = sqlx::query_scalar(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, payload, state)
         VALUES (gen_random_uuid(), 31337, $1, 'faildrive-1', '{}', 'RECEIVED') RETURNING tx_id",
    )
    .bind(&held)
    .fetch_one(&f.db.pool)
    .await
    .expect("insert work");
    // The test stage takes the allocator's leases.
    let role = Role::Allocator.as_str();
    let reason: String = wait_for("the signer is held", LONG, || async {
        sqlx::query_scalar(
            "SELECT reason FROM signer_holds WHERE role = $1 AND chain_id = 31337 AND signer = $2",
        )
        .bind(role)
        .bind(&held)
        .fetch_optional(&f.db.pool)
        .await
        .expect("signer_holds")
    })
    .await;
    assert!(reason.contains(FAIL_DRIVE_CODE), "hold reason: {reason}");

    // The stage goes on with other signers' messages.
    f.send(&request(&other, "after-hold-1")).await;
    f.send(&request(&third, "after-hold-2")).await;
    wait_until("after-hold-1 was driven", LONG, || driven("after-hold-1")).await;
    wait_until("after-hold-2 was driven", LONG, || driven("after-hold-2")).await;
    // The recovery scan tries the held signer again (refreshing its hold), one alert in all.
    wait_until(
        "the recovery scan tried the held signer again",
        LONG,
        || async {
            f.count("SELECT count(*) FROM signer_holds WHERE updated_at > since")
                .await
                == 1
        },
    )
    .await;
    wait_until("the hold raised an alert", LONG, || {
        let lines = log.lock().expect("lock").clone();
        async move { lines.iter().any(|l| l.contains("signer_held")) }
    })
    .await;
    signal(&stage, "-TERM");
    let _ = tokio::time::timeout(LONG, stage.wait()).await;

    assert_eq!(
        f.count("SELECT count(*) FROM signer_holds").await,
        1,
        "only the failing signer is held"
    );
    let state: String = sqlx::query_scalar("SELECT state FROM managed_tx WHERE tx_id = $1")
        .bind(tx_id)
        .fetch_one(&f.db.pool)
        .await
        .expect("state");
    assert_eq!(state, "RECEIVED", "the failing work did not move");
    assert_eq!(
        f.count(&format!(
            "SELECT count(*) FROM test_external_calls WHERE key = '{tx_id}'"
        ))
        .await,
        0,
        "the drive failed before the external call"
    );
    let alerts = log
        .lock()
        .expect("lock")
        .iter()
        .filter(|l| l.contains("signer_held"))
        .count();
    assert_eq!(
        alerts, 1,
        "one alert for a hold, however often it is refreshed"
    );
}
