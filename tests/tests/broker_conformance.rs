//! What the pipeline relies on from the Kafka-protocol broker, tested against the broker the
//! harness runs (tansu, memory storage). Behaviours the broker gets wrong today are kept as
//! characterization tests (`characterize_*`): they assert what the broker does now and name the
//! correct behaviour, so CI stays green and a change in the broker is noticed. docs/operations.md
//! ("The local broker") records what the design may and may not rely on.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Message, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken as StopFlag;
use txflow_tests::{
    OwnBroker, TestTopics, collect, group_consumer, kafka_settings, producer, text, unique,
    wait_until,
};

const LONG: Duration = Duration::from_secs(60);

/// Sends `payloads` (key, value) concurrently and returns (partition, offset) per message.
async fn send_all(
    p: &FutureProducer,
    topic: &str,
    payloads: &[(String, String)],
) -> Vec<(i32, i64)> {
    let futures = payloads.iter().map(|(k, v)| {
        p.send(
            FutureRecord::to(topic).key(k).payload(v),
            Duration::from_secs(30),
        )
    });
    futures::future::join_all(futures)
        .await
        .into_iter()
        .map(|r| {
            let d = r.unwrap_or_else(|(e, _)| panic!("delivery failed: {e}"));
            (d.partition, d.offset)
        })
        .collect()
}

fn numbered(n: usize) -> Vec<(String, String)> {
    (0..n).map(|i| ("k".to_string(), format!("m{i}"))).collect()
}

#[tokio::test]
async fn keyed_produce_keeps_per_key_order_on_one_partition() {
    let settings = kafka_settings();
    let topics = TestTopics::create(&settings, "order", 1, 8).await;
    let topic = topics.name(0);
    let p = producer(&settings);
    let payloads: Vec<(String, String)> = (0..50)
        .flat_map(|seq| (0..20).map(move |k| (format!("key{k}"), format!("key{k}:{seq}"))))
        .collect();
    send_all(&p, topic, &payloads).await;

    let c = group_consumer(&settings, &unique("order"));
    c.subscribe(&[topic]).expect("subscribe");
    let got = collect(&c, payloads.len(), LONG).await;

    let mut by_key: BTreeMap<String, Vec<(i32, i64, u32)>> = BTreeMap::new();
    for m in &got {
        let key = String::from_utf8_lossy(m.key().expect("keyed")).into_owned();
        let seq: u32 = text(m)
            .rsplit_once(':')
            .and_then(|(_, s)| s.parse().ok())
            .expect("seq");
        by_key
            .entry(key)
            .or_default()
            .push((m.partition(), m.offset(), seq));
    }
    assert_eq!(by_key.len(), 20, "every key arrived");
    let mut partitions_used = BTreeSet::new();
    for (key, mut msgs) in by_key {
        let parts: BTreeSet<i32> = msgs.iter().map(|m| m.0).collect();
        assert_eq!(
            parts.len(),
            1,
            "{key} must live on one partition, found {parts:?}"
        );
        partitions_used.extend(parts);
        msgs.sort_by_key(|m| m.1);
        let seqs: Vec<u32> = msgs.iter().map(|m| m.2).collect();
        assert_eq!(
            seqs,
            (0..50).collect::<Vec<_>>(),
            "{key} must be read in the order it was sent"
        );
    }
    assert!(
        partitions_used.len() > 1,
        "20 keys should spread over several of the 8 partitions"
    );
}

/// Polls a consumer in the background and publishes its current assignment.
/// The consumer is owned by the polling task and dropped (leaving the group) when `stop` fires;
/// awaiting the handle waits for that.
fn poll_in_background(
    c: StreamConsumer,
    stop: StopFlag,
) -> (Arc<Mutex<BTreeSet<i32>>>, tokio::task::JoinHandle<()>) {
    let assigned = Arc::new(Mutex::new(BTreeSet::new()));
    let out = assigned.clone();
    let handle = tokio::spawn(async move {
        while !stop.is_cancelled() {
            let _ = tokio::time::timeout(Duration::from_millis(50), c.recv()).await;
            if let Ok(tpl) = c.assignment() {
                *out.lock().expect("lock") = tpl.elements().iter().map(|e| e.partition()).collect();
            }
        }
        drop(c);
    });
    (assigned, handle)
}

#[tokio::test]
async fn consumer_group_splits_partitions_and_rebalances_when_a_member_leaves() {
    let settings = kafka_settings();
    let topics = TestTopics::create(&settings, "group", 1, 4).await;
    let topic = topics.name(0).to_string();
    let group = unique("group");
    let all: BTreeSet<i32> = (0..4).collect();

    let a = group_consumer(&settings, &group);
    a.subscribe(&[&topic]).expect("subscribe a");
    let stop_a = StopFlag::default();
    let (assigned_a, task_a) = poll_in_background(a, stop_a.clone());
    wait_until("the first member owns every partition", LONG, || {
        let got = assigned_a.lock().expect("lock").clone();
        let all = all.clone();
        async move { got == all }
    })
    .await;

    let b = group_consumer(&settings, &group);
    b.subscribe(&[&topic]).expect("subscribe b");
    let stop_b = StopFlag::default();
    let (assigned_b, task_b) = poll_in_background(b, stop_b.clone());
    wait_until(
        "two members split the 4 partitions between them",
        LONG,
        || {
            let (pa, pb) = (
                assigned_a.lock().expect("lock").clone(),
                assigned_b.lock().expect("lock").clone(),
            );
            let all = all.clone();
            async move {
                !pa.is_empty()
                    && !pb.is_empty()
                    && pa.is_disjoint(&pb)
                    && pa.union(&pb).copied().collect::<BTreeSet<_>>() == all
            }
        },
    )
    .await;

    // The second member leaves the group (close sends LeaveGroup).
    stop_b.cancel();
    task_b.await.expect("second member's poller");
    wait_until(
        "the remaining member owns every partition again",
        LONG,
        || {
            let got = assigned_a.lock().expect("lock").clone();
            let all = all.clone();
            async move { got == all }
        },
    )
    .await;
    stop_a.cancel();
    task_a.await.expect("first member's poller");
}

#[tokio::test]
async fn committed_offsets_survive_a_consumer_restart() {
    let settings = kafka_settings();
    let topics = TestTopics::create(&settings, "commit", 1, 1).await;
    let topic = topics.name(0);
    send_all(&producer(&settings), topic, &numbered(100)).await;
    let group = unique("commit");

    {
        let c = group_consumer(&settings, &group);
        c.subscribe(&[topic]).expect("subscribe");
        let first = collect(&c, 40, LONG).await;
        assert_eq!(text(&first[0]), "m0");
        for m in &first {
            c.store_offset(m.topic(), m.partition(), m.offset())
                .expect("store offset");
        }
        c.commit_consumer_state(CommitMode::Sync).expect("commit");
    }

    let c = group_consumer(&settings, &group);
    c.subscribe(&[topic]).expect("subscribe again");
    let rest = collect(&c, 60, LONG).await;
    let got: Vec<String> = rest.iter().map(text).collect();
    let want: Vec<String> = (40..100).map(|i| format!("m{i}")).collect();
    assert_eq!(
        got, want,
        "a restarted member resumes exactly after the committed offset: nothing lost"
    );
}

#[tokio::test]
async fn assign_and_seek_read_exactly_from_an_explicit_offset() {
    let settings = kafka_settings();
    let topics = TestTopics::create(&settings, "seek", 1, 1).await;
    let topic = topics.name(0);
    send_all(&producer(&settings), topic, &numbered(100)).await;

    let c: StreamConsumer = settings.assign_config().create().expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(37))
        .expect("tpl");
    c.assign(&tpl).expect("assign");
    let got = collect(&c, 10, LONG).await;
    let offsets: Vec<i64> = got.iter().map(|m| m.offset()).collect();
    assert_eq!(offsets, (37..47).collect::<Vec<_>>());
    assert_eq!(text(&got[0]), "m37");

    c.seek(topic, 0, Offset::Offset(5), Duration::from_secs(10))
        .expect("seek");
    let after_seek = collect(&c, 3, LONG).await;
    let texts: Vec<String> = after_seek.iter().map(text).collect();
    assert_eq!(texts, ["m5", "m6", "m7"], "replay from an explicit offset");
}

#[tokio::test]
async fn idempotent_producer_writes_each_message_once_in_order() {
    let settings = kafka_settings();
    let topics = TestTopics::create(&settings, "idem", 1, 1).await;
    let topic = topics.name(0);
    let p = producer(&settings);
    let n = 2000;
    let delivered = send_all(&p, topic, &numbered(n)).await;
    let offsets: BTreeSet<i64> = delivered.iter().map(|d| d.1).collect();
    assert_eq!(offsets.len(), n, "every send got its own offset");
    // A sentinel after the batch: anything duplicated would sit before it.
    send_all(&p, topic, &[("k".into(), "end".into())]).await;
    p.flush(Duration::from_secs(10)).expect("flush");

    let c = group_consumer(&settings, &unique("idem"));
    c.subscribe(&[topic]).expect("subscribe");
    let got = collect(&c, n + 1, LONG).await;
    let texts: Vec<String> = got.iter().map(text).collect();
    let mut want: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
    want.push("end".into());
    assert_eq!(texts, want, "each message exactly once, in send order");
}

// ---- characterization: what tansu does not do (the design must not rely on these) ----

#[tokio::test]
async fn characterize_high_watermark_counts_batches_not_records() {
    let settings = kafka_settings();
    let topics = TestTopics::create(&settings, "wm", 1, 1).await;
    let topic = topics.name(0);
    // One batch of 10 records: a long linger makes the producer send them together.
    let mut config = settings.producer_config();
    config.set("linger.ms", "200");
    let p: FutureProducer = config.create().expect("producer");
    let offsets = send_all(&p, topic, &numbered(10)).await;
    assert_eq!(
        offsets.iter().map(|o| o.1).collect::<Vec<_>>(),
        (0..10).collect::<Vec<_>>()
    );
    let c = group_consumer(&settings, &unique("wm"));
    let (low, high) = c
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .expect("watermarks answer");
    // Correct behaviour (Apache Kafka): (0, 10), the offset after the last record. tansu answers
    // the last batch's base offset + 1. Consumer lag and "read to the end" must not use it.
    assert_eq!(
        (low, high),
        (0, 1),
        "tansu's high watermark changed (a correct broker answers (0, 10)); update docs/operations.md, \"The local broker\""
    );
}

#[tokio::test]
async fn characterize_offsets_for_times_always_answers_the_start() {
    let settings = kafka_settings();
    let topics = TestTopics::create(&settings, "times", 1, 1).await;
    let topic = topics.name(0);
    let p = producer(&settings);
    let t0 = 1_700_000_000_000_i64;
    for i in 0..10_i64 {
        let ts = if i < 5 { t0 } else { t0 + 100_000 };
        let payload = format!("m{i}");
        p.send(
            FutureRecord::to(topic)
                .key("k")
                .payload(&payload)
                .timestamp(ts),
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|(e, _)| panic!("send: {e}"));
    }
    let c = group_consumer(&settings, &unique("times"));
    let mut answers = Vec::new();
    for ts in [t0, t0 + 50_000, t0 + 100_000, t0 + 1_000_000] {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, 0, Offset::Offset(ts))
            .expect("tpl");
        let got = c
            .offsets_for_times(tpl, Duration::from_secs(10))
            .expect("lookup answers");
        answers.push(got.elements()[0].offset());
    }
    // Correct behaviour: [0, 5, 5, End]. tansu answers the first offset for every timestamp, so
    // `txflow replay --to-time` cannot be verified against it.
    assert_eq!(
        answers,
        vec![Offset::Offset(0); 4],
        "tansu's timestamp lookup changed (correct: [0, 5, 5, End]); update docs/operations.md, \"The local broker\""
    );
}

#[tokio::test]
async fn characterize_aborted_transactions_are_visible_to_read_committed() {
    let settings = kafka_settings();
    let topics = TestTopics::create(&settings, "txn", 1, 1).await;
    let topic = topics.name(0);
    send_all(
        &producer(&settings),
        topic,
        &[("k".into(), "before".into())],
    )
    .await;
    let mut config = settings.producer_config();
    config.set("transactional.id", unique("txn"));
    let tp: FutureProducer = config.create().expect("transactional producer");
    tp.init_transactions(Duration::from_secs(10))
        .expect("init_transactions answers");
    tp.begin_transaction().expect("begin");
    send_all(&tp, topic, &[("k".into(), "aborted".into())]).await;
    tp.abort_transaction(Duration::from_secs(10))
        .expect("abort answers");
    send_all(&producer(&settings), topic, &[("k".into(), "after".into())]).await;

    let mut config = settings.consumer_config(&unique("txn"));
    config.set("isolation.level", "read_committed");
    let c: StreamConsumer = config.create().expect("consumer");
    c.subscribe(&[topic]).expect("subscribe");
    let got: Vec<String> = collect(&c, 3, LONG).await.iter().map(text).collect();
    // Correct behaviour: a read_committed consumer never sees "aborted". The pipeline uses no
    // Kafka transactions: Postgres is the authority and every consumer is idempotent.
    assert_eq!(
        got,
        ["before", "aborted", "after"],
        "tansu's transactions changed (correct: the aborted record is invisible); update docs/operations.md, \"The local broker\""
    );
}

#[tokio::test]
async fn characterize_restart_loses_every_topic() {
    let mut broker = OwnBroker::spawn().await;
    let settings = broker.settings();
    let topic = unique("restart");
    txflow_core::kafka::ensure_topics(&settings, std::slice::from_ref(&topic), 1)
        .await
        .expect("create");
    send_all(&producer(&settings), &topic, &numbered(5)).await;
    broker.restart(false).await;

    let c = group_consumer(&settings, &unique("restart"));
    let md = c
        .fetch_metadata(Some(&topic), Duration::from_secs(10))
        .expect("metadata");
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .expect("topic in the answer");
    // Correct behaviour (a durable broker): the topic and its 5 messages survive a restart.
    assert!(
        t.error().is_some() || t.partitions().is_empty(),
        "the memory broker kept {topic} across a restart: a durable broker would; update docs/operations.md, \"The local broker\""
    );
}

/// The replicas of each partition of `topic`, as the broker's metadata lists them.
fn replicas(settings: &txflow_core::kafka::KafkaSettings, topic: &str) -> Vec<Vec<i32>> {
    let c = group_consumer(settings, &unique("replicas"));
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .expect("topic in the answer");
    assert!(t.error().is_none(), "{topic}: {:?}", t.error());
    t.partitions()
        .iter()
        .map(|p| p.replicas().to_vec())
        .collect()
}

#[tokio::test]
async fn characterize_replication_factor_above_the_broker_count_is_accepted() {
    let mut settings = kafka_settings();
    let single = TestTopics::create(&settings, "replicas1", 1, 1).await;
    assert_eq!(
        replicas(&settings, single.name(0))
            .iter()
            .map(Vec::len)
            .collect::<Vec<_>>(),
        [1],
        "the default replication factor is 1"
    );

    settings.replication_factor = 2;
    let topics = TestTopics::create(&settings, "replicas2", 1, 2).await;
    let topic = topics.name(0);
    let got = replicas(&settings, topic);
    // Correct behaviour (Apache Kafka): a single broker refuses two replicas
    // (INVALID_REPLICATION_FACTOR), and `ensure_topics` fails with that code. tansu accepts
    // them and lists its one broker twice: the factor reaches the broker, nothing replicates.
    assert_eq!(got.len(), 2, "{got:?}");
    for r in &got {
        assert!(
            r.len() == 2 && r[0] == r[1],
            "tansu's replica placement changed (correct: the creation is refused): {got:?}; update docs/operations.md, \"The local broker\""
        );
    }

    // A topic that exists keeps its replicas whatever the setting says now.
    settings.replication_factor = 3;
    txflow_core::kafka::ensure_topics(&settings, &topics.names, 2)
        .await
        .expect("an existing topic is left alone");
    assert_eq!(replicas(&settings, topic), got);
}

/// The partitions of `topic` as the broker's metadata lists them (0 when it does not know it).
fn partition_count(settings: &txflow_core::kafka::KafkaSettings, topic: &str) -> usize {
    let c = group_consumer(settings, &unique("partitions"));
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    md.topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map_or(0, |t| t.partitions().len())
}

/// A stage keeps one `TopicAdmin` for its life and ensures its topics on every recovery scan: the
/// same client must create them again after the broker lost them (a memory broker's restart), and
/// leave existing ones alone.
#[tokio::test]
async fn one_topic_admin_creates_the_topics_again_after_the_broker_lost_them() {
    let mut broker = OwnBroker::spawn().await;
    let settings = broker.settings();
    let topics = vec![unique("admin-a"), unique("admin-b")];
    let admin = txflow_core::kafka::TopicAdmin::new(&settings).expect("admin client");
    admin.ensure(&topics, 3).await.expect("create");
    admin
        .ensure(&topics, 5)
        .await
        .expect("existing topics are left alone");
    for t in &topics {
        assert_eq!(partition_count(&settings, t), 3, "{t}");
    }

    broker.restart(true).await;
    for t in &topics {
        assert_eq!(partition_count(&settings, t), 0, "{t} survived the restart");
    }
    // The client reconnects by itself: the next call creates them again.
    wait_until(
        "the same admin client creates the lost topics",
        LONG,
        || async { admin.ensure(&topics, 3).await.is_ok() },
    )
    .await;
    for t in &topics {
        assert_eq!(partition_count(&settings, t), 3, "{t}");
    }
}
