//! Operator commands stay in their signer (issue 12 point 3), against real PostgreSQL, broker and
//! an anvil of the test's own: approve/cancel act only on a transaction of the signer the command
//! is keyed by (a mismatch is a typed dead letter and the other signer's transaction is not
//! touched), and an approval is a recorded fact that survives a REPLACED transaction's
//! re-allocation and the signer gateway's policy re-check.

use std::time::{Duration, Instant};

use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, OwnedMessage};
use txflow_core::events::TxCommandKind;
use txflow_tests::pipeline::{APPROVER, Pipeline};
use txflow_tests::{group_consumer, unique, wait_for, wait_until};

const LONG: Duration = Duration::from_secs(180);

/// What a test compares of a transaction row: everything a command could change.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
struct Row {
    tx_id: String,
    state: String,
    nonce: Option<i64>,
    failure_code: Option<String>,
    failure_reason: Option<String>,
    fencing_token: i64,
    updated_at: chrono::DateTime<chrono::Utc>,
    events: i64,
}

async fn row(p: &Pipeline, request_id: &str) -> Option<Row> {
    sqlx::query_as(
        "SELECT tx_id::text AS tx_id, state, nonce, failure_code, failure_reason, fencing_token,
                updated_at, (SELECT count(*) FROM tx_events e WHERE e.tx_id = m.tx_id) AS events
         FROM managed_tx m WHERE request_id = $1",
    )
    .bind(request_id)
    .fetch_optional(&p.db.pool)
    .await
    .expect("query")
}

async fn approved_by(p: &Pipeline, request_id: &str) -> Option<String> {
    sqlx::query_scalar("SELECT approved_by FROM managed_tx WHERE request_id = $1")
        .bind(request_id)
        .fetch_one(&p.db.pool)
        .await
        .expect("approved_by")
}

async fn events_of(p: &Pipeline, request_id: &str, event_type: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM tx_events e JOIN managed_tx m USING (tx_id)
         WHERE m.request_id = $1 AND e.type = $2",
    )
    .bind(request_id)
    .bind(event_type)
    .fetch_one(&p.db.pool)
    .await
    .expect("events")
}

/// A dead letter as the tests read it: its `error.code`, `error.message` and `source.topic`.
#[derive(Debug, Clone)]
struct DeadLetter {
    code: String,
    message: String,
    source_topic: String,
}

fn dead_letter(m: &OwnedMessage) -> DeadLetter {
    let header = |name: &str| {
        m.headers()
            .and_then(|h| h.iter().find(|x| x.key == name).and_then(|x| x.value))
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default()
    };
    DeadLetter {
        code: header("error.code"),
        message: header("error.message"),
        source_topic: header("source.topic"),
    }
}

/// A consumer of the pipeline's dead-letter topic `{prefix}.dlq`, from its beginning.
fn dlq_consumer(p: &Pipeline) -> StreamConsumer {
    let dlq = group_consumer(&p.config.kafka, &unique("dlq"));
    dlq.subscribe(&[&p.config.topics.dlq()]).expect("subscribe");
    dlq
}

/// Receives dead letters until `done` holds for those received, checking `invariant` between
/// polls (so a broken invariant fails at once, not at the deadline); panics after `LONG`.
async fn dead_letters_until<F, Fut>(
    dlq: &StreamConsumer,
    what: &str,
    done: impl Fn(&[DeadLetter]) -> bool,
    mut invariant: F,
) -> Vec<DeadLetter>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let started = Instant::now();
    let mut dead = Vec::new();
    while !done(&dead) {
        assert!(
            started.elapsed() < LONG,
            "timed out after {:?} waiting until {what}; dead letters so far: {dead:?}",
            started.elapsed()
        );
        match tokio::time::timeout(Duration::from_millis(200), dlq.recv()).await {
            Ok(Ok(m)) => dead.push(dead_letter(&m.detach())),
            Ok(Err(e)) => panic!("dead-letter consumer: {e}"),
            Err(_) => invariant().await,
        }
    }
    invariant().await;
    dead
}

#[tokio::test]
async fn a_command_keyed_by_another_signer_is_dead_lettered_and_leaves_the_transaction_alone() {
    // Signer X = 0 and signer Y = 1; X's request is above the approval threshold and waits.
    let p =
        Pipeline::start_with(2, |c| c.policy_approval_threshold_wei = Some("1000".into())).await;
    let dlq = dlq_consumer(&p);
    let mut big = p.request(0, "big");
    big.value = "5000".into();
    p.send(&big).await;
    let waiting = wait_for("X's request waits for approval", LONG, || async {
        row(&p, "big")
            .await
            .filter(|r| r.state == "PENDING_APPROVAL")
    })
    .await;
    let x_tx = waiting.tx_id.clone();

    // Y cancels and approves X's transaction, and cancels a transaction nobody has.
    p.command_as(1, &x_tx, TxCommandKind::Cancel).await;
    p.command_as(1, &x_tx, TxCommandKind::Approve).await;
    let nobodys = uuid::Uuid::now_v7().to_string();
    p.command_as(1, &nobodys, TxCommandKind::Cancel).await;
    let untouched = || async {
        let now = row(&p, "big").await.expect("X's transaction");
        assert_eq!(
            now, waiting,
            "X's transaction is untouched by commands keyed by signer Y"
        );
    };
    let mut dead = dead_letters_until(
        &dlq,
        "Y's three commands are dead-lettered",
        |d| d.len() >= 3,
        untouched,
    )
    .await;
    dead.sort_by(|a, b| a.code.cmp(&b.code));
    let codes: Vec<&str> = dead.iter().map(|d| d.code.as_str()).collect();
    assert_eq!(
        codes,
        ["TX_NOT_OF_SIGNER", "TX_NOT_OF_SIGNER", "UNKNOWN_TX"],
        "{dead:?}"
    );
    for d in &dead {
        assert_eq!(d.source_topic, p.config.topics.tx_commands(), "{d:?}");
    }
    assert!(
        dead[0].message.contains(&x_tx) && dead[0].message.contains(&p.signer(0)),
        "the dead letter names the transaction and its signer: {:?}",
        dead[0]
    );
    assert!(dead[2].message.contains(&nobodys), "{:?}", dead[2]);
    assert_eq!(events_of(&p, "big", "TxFailed").await, 0, "no TxFailed");
    assert_eq!(approved_by(&p, "big").await, None, "not approved by Y");

    // X approves its own transaction: it is mined, once.
    p.command_as(0, &x_tx, TxCommandKind::Approve).await;
    wait_until("X's approved transaction is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;
    assert_eq!(
        p.mined_markers().await.get("txflow:big"),
        Some(&1),
        "mined once"
    );
    assert_eq!(approved_by(&p, "big").await.as_deref(), Some(APPROVER));

    // X's own commands for its transaction in a state where they do nothing are no-ops, never
    // dead letters: the next dead letter of X's partition is that of a command naming nothing.
    p.command_as(0, &x_tx, TxCommandKind::Approve).await;
    p.command_as(0, &x_tx, TxCommandKind::Cancel).await;
    let nothing = uuid::Uuid::now_v7().to_string();
    p.command_as(0, &nothing, TxCommandKind::Approve).await;
    let later = dead_letters_until(
        &dlq,
        "X's command naming nothing is dead-lettered",
        |d| d.iter().any(|d| d.message.contains(&nothing)),
        || async {},
    )
    .await;
    let codes: Vec<&str> = later.iter().map(|d| d.code.as_str()).collect();
    assert_eq!(codes, ["UNKNOWN_TX"], "{later:?}");
    let after = row(&p, "big").await.expect("X's transaction");
    assert_ne!(after.state, "FAILED", "{after:?}");
    assert_eq!(after.failure_code, None);
    assert_eq!(events_of(&p, "big", "TxFailed").await, 0, "no TxFailed");
    assert_eq!(p.mined_markers().await.get("txflow:big"), Some(&1));
    p.stop().await;
}

#[tokio::test]
async fn an_approval_by_the_principal_that_submitted_the_request_is_dead_lettered_and_another_approves()
 {
    let p =
        Pipeline::start_with(1, |c| c.policy_approval_threshold_wei = Some("1000".into())).await;
    let dlq = dlq_consumer(&p);
    let mut big = p.request(0, "big");
    big.value = "5000".into();
    big.submitted_by = Some("svc-a".into());
    p.send(&big).await;
    let waiting = wait_for("the request waits for approval", LONG, || async {
        row(&p, "big")
            .await
            .filter(|r| r.state == "PENDING_APPROVAL")
    })
    .await;
    let submitted_by: Option<String> =
        sqlx::query_scalar("SELECT submitted_by FROM managed_tx WHERE request_id = 'big'")
            .fetch_one(&p.db.pool)
            .await
            .expect("submitted_by");
    assert_eq!(
        submitted_by.as_deref(),
        Some("svc-a"),
        "who submitted it is recorded"
    );

    // The submitter approves its own request, straight on the topic (past the gateway).
    p.command_by(0, &waiting.tx_id, TxCommandKind::Approve, "svc-a")
        .await;
    let untouched = || async {
        let now = row(&p, "big").await.expect("the transaction");
        assert_eq!(now, waiting, "a self-approval changes nothing");
    };
    let dead = dead_letters_until(
        &dlq,
        "the self-approval is dead-lettered",
        |d| !d.is_empty(),
        untouched,
    )
    .await;
    assert_eq!(dead[0].code, "SELF_APPROVAL", "{dead:?}");
    assert!(dead[0].message.contains("svc-a"), "{dead:?}");
    assert_eq!(approved_by(&p, "big").await, None);

    // Another principal approves: mined once, approved by them.
    p.command(&waiting.tx_id, TxCommandKind::Approve).await;
    wait_until("the approved transaction is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;
    assert_eq!(p.mined_markers().await.get("txflow:big"), Some(&1));
    assert_eq!(approved_by(&p, "big").await.as_deref(), Some(APPROVER));
    p.stop().await;
}

/// How an approved transaction's story ended, as the test waits for it.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Mined,
    Failed {
        code: Option<String>,
        reason: Option<String>,
    },
}

#[tokio::test]
async fn an_approved_transaction_that_is_replaced_is_mined_once_at_a_fresh_nonce_still_approved() {
    let mut p =
        Pipeline::prepare(1, |c| c.policy_approval_threshold_wei = Some("1000".into())).await;
    let config = p.config.clone();
    // Allocator and broadcaster first: the request is approved, takes nonce 0 and waits for its
    // signature.
    p.start_allocator(&config, "alloc-1").await;
    p.start_broadcaster(&config).await;
    let mut big = p.request(0, "approved");
    big.value = "5000".into();
    p.send(&big).await;
    let tx_id = wait_for("the request waits for approval", LONG, || async {
        row(&p, "approved")
            .await
            .filter(|r| r.state == "PENDING_APPROVAL")
            .map(|r| r.tx_id)
    })
    .await;
    p.command(&tx_id, TxCommandKind::Approve).await;
    let allocated = wait_for("the approved request is ALLOCATED", LONG, || async {
        row(&p, "approved").await.filter(|r| r.state == "ALLOCATED")
    })
    .await;
    assert_eq!(allocated.nonce, Some(0));

    // Someone uses the same key straight on the chain, at that nonce.
    p.spend_nonce_outside(0, 0).await;

    // txflow signs nonce 0, the node says "nonce too low", the chain knows none of our hashes:
    // REPLACED, re-allocated at a fresh nonce, signed again (the policy checked again: the
    // recorded approval satisfies the threshold), mined.
    p.start_signer_gateway(&config).await;
    let outcome = wait_for(
        "the approved transaction is mined or failed",
        LONG,
        || async {
            let r = row(&p, "approved").await.expect("recorded");
            if r.state == "FAILED" {
                return Some(Outcome::Failed {
                    code: r.failure_code,
                    reason: r.failure_reason,
                });
            }
            (p.mined_count().await >= 2).then_some(Outcome::Mined)
        },
    )
    .await;
    assert_eq!(
        outcome,
        Outcome::Mined,
        "the re-allocated transaction is signed and mined, not refused at signing"
    );
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:approved"), Some(&1), "{markers:?}");
    let r = row(&p, "approved").await.expect("recorded");
    assert!(r.nonce.is_some_and(|n| n >= 1), "a fresh nonce: {r:?}");
    assert_eq!((r.failure_code, r.failure_reason), (None, None));
    assert_eq!(events_of(&p, "approved", "TxReplaced").await, 1);
    assert_eq!(
        events_of(&p, "approved", "TxFailed").await,
        0,
        "no TxFailed"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE failure_code = 'POLICY_DENIED'")
            .await,
        0,
        "nothing refused by the policy"
    );
    assert_eq!(
        p.count(
            "SELECT count(*) FROM tx_attempts a JOIN managed_tx m USING (tx_id)
             WHERE m.request_id = 'approved'"
        )
        .await,
        2,
        "signed at nonce 0, then at its fresh nonce"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE kind = 'NOOP'")
            .await,
        0,
        "no nonce was released to be filled"
    );
    assert_eq!(
        approved_by(&p, "approved").await.as_deref(),
        Some(APPROVER),
        "still approved by its approver"
    );
    assert_eq!(p.pool_status().await, ("0x0".into(), "0x0".into()));
    p.stop().await;
}

/// A request id used again with another payload (issue 12 point 5) is not silently merged into
/// the original: it is dead-lettered with `DUPLICATE_REQUEST_ID` and a reason naming the original
/// transaction, which is mined once with its own value. The same request sent again (the same
/// payload) stays an idempotent duplicate: no dead letter.
#[tokio::test]
async fn a_request_id_reused_with_another_payload_is_dead_lettered_naming_the_original() {
    let p = Pipeline::start(1).await;
    let dlq = dlq_consumer(&p);
    let original = p.request(0, "dup-1");
    p.send(&original).await;
    wait_until("the original is recorded", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE request_id = 'dup-1'")
            .await
            == 1
    })
    .await;
    let tx_id: String =
        sqlx::query_scalar("SELECT tx_id::text FROM managed_tx WHERE request_id = 'dup-1'")
            .fetch_one(&p.db.pool)
            .await
            .expect("tx id");

    // The same request again: idempotent. Then the same id with another value and destination.
    let mut again = original.clone();
    again.event_id = uuid::Uuid::new_v4().to_string();
    p.send(&again).await;
    let mut other = original.clone();
    other.event_id = uuid::Uuid::new_v4().to_string();
    other.value = "7".into();
    p.send(&other).await;
    // A later request, so that the stage has handled the ones before it on the partition.
    p.send(&p.request(0, "dup-2")).await;

    let dead = dead_letters_until(
        &dlq,
        "the reused request id is dead-lettered",
        |d| !d.is_empty(),
        || async {},
    )
    .await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].code, "DUPLICATE_REQUEST_ID", "{dead:?}");
    assert!(
        dead[0].message.contains(&tx_id),
        "names the original: {dead:?}"
    );
    wait_for("both requests are mined", LONG, || async {
        let m = p.mined_markers().await;
        (m.get("txflow:dup-1") == Some(&1) && m.get("txflow:dup-2") == Some(&1)).then_some(())
    })
    .await;
    let value: String =
        sqlx::query_scalar("SELECT payload->>'value' FROM managed_tx WHERE request_id = 'dup-1'")
            .fetch_one(&p.db.pool)
            .await
            .expect("value");
    assert_eq!(value, "1", "the original keeps its own value");
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE request_id = 'dup-1'")
            .await,
        1
    );
    // Nothing more reached the dead-letter topic (the idempotent duplicate is not one).
    assert!(
        tokio::time::timeout(Duration::from_secs(2), dlq.recv())
            .await
            .is_err(),
        "a second dead letter"
    );
    p.stop().await;
}
