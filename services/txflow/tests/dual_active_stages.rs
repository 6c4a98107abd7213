//! Dual-active signer gateways and broadcasters (issue 12; the allocator's is `dual_active.rs`):
//! two `txflow <stage>` processes act for one signer, each in a consumer group of its own, so both
//! receive every message. The first holds the lease and freezes (SIGSTOP, from its own fault
//! point) in the middle of its work; the lease is taken from it; the second, waiting for it, takes
//! over; the first is resumed with its work unrecorded and carries on. Only the holder of the
//! current fencing token writes: the old owner's write never lands, nothing is signed twice, every
//! request is mined exactly once. Checked on the chain and in PostgreSQL.
//!
//! Each test resumes the old owner while its stale write could still land: the signer gateway
//! while its transaction is still open, the broadcaster while the new owner is frozen before
//! recording the same sends. The leases are long (30 s), so that nothing lapses by itself: the
//! lease changes hands only when the test takes it, and PostgreSQL does not end the frozen
//! owner's session (it would after twice the lease). What stops the stale write is the fence.

mod common;

use std::time::Duration;

use common::{StageProcess, expire_lease, lease};
use txflow_core::events::TxRequest;
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{unique, wait_until};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(180);
/// The stage processes' lease.
const LEASE: Duration = Duration::from_secs(30);
/// Requests before and while the first process is frozen (the first one alone, to start it).
const FIRST: usize = 100;
/// Requests after it is resumed.
const SECOND: usize = 50;
const TOTAL: usize = FIRST + SECOND;
const SIGNER_GATEWAY: &str = "signer-gateway";
const BROADCASTER: &str = "broadcaster";
/// What a stage process logs when it wants a lease another node holds (`txflow::lease` debug).
const LEASE_BUSY: &str = "lease held by another node";
/// What a stage process logs when the fence refuses one of its writes.
const WRITE_FENCED: &str = "write fenced";
/// What a recovery drive logs when it finds its lease lost (its transaction dropped, rolled back).
const DRIVE_ABANDONED: &str = "lease lost while driving pending work";

/// How many times a stage process's log says it was granted a lease other than by renewal.
fn grants(log: &str) -> usize {
    [
        "\"lease_acquired\"",
        "\"lease_stolen\"",
        "\"lease_retaken\"",
    ]
    .iter()
    .map(|g| log.matches(g).count())
    .sum()
}

/// Events of `types` recorded under the fencing token `token`.
async fn events_under(p: &Pipeline, types: &[&str], token: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM tx_events WHERE type = ANY($1)
           AND (payload->>'fencing_token')::bigint = $2",
    )
    .bind(types)
    .bind(token)
    .fetch_one(&p.db.pool)
    .await
    .expect("count events")
}

/// The events the signer gateway writes.
const SIGNER_EVENTS: &[&str] = &["TxSigned", "TxFailed"];
/// The events the broadcaster writes (its TxFailed are SEND_REJECTED; none is expected here).
const BROADCASTER_EVENTS: &[&str] = &["TxSubmitted", "TxReplaced", "TxResubmitted"];

/// The ALLOCATED transactions whose rows an open transaction holds locked: a frozen signer
/// gateway's signatures, written and not committed (no other process locks ALLOCATED rows here).
async fn locked_allocated(p: &Pipeline) -> Vec<Uuid> {
    sqlx::query_scalar(
        "WITH free AS (
             SELECT tx_id FROM managed_tx WHERE state = 'ALLOCATED' FOR UPDATE SKIP LOCKED)
         SELECT tx_id FROM managed_tx
         WHERE state = 'ALLOCATED' AND tx_id NOT IN (SELECT tx_id FROM free)",
    )
    .fetch_all(&p.db.pool)
    .await
    .expect("locked rows")
}

/// `tx_events` of type `type` for `tx_ids` recorded under `token`.
async fn events_of(p: &Pipeline, r#type: &str, tx_ids: &[Uuid], token: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM tx_events WHERE type = $1 AND tx_id = ANY($2)
           AND (payload->>'fencing_token')::bigint = $3",
    )
    .bind(r#type)
    .bind(tx_ids)
    .bind(token)
    .fetch_one(&p.db.pool)
    .await
    .expect("count events")
}

/// TxSubmitted events of `tx_ids`, under any token.
async fn submissions_of(p: &Pipeline, tx_ids: &[Uuid]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM tx_events WHERE type = 'TxSubmitted' AND tx_id = ANY($1)",
    )
    .bind(tx_ids)
    .fetch_one(&p.db.pool)
    .await
    .expect("count events")
}

/// Every request has exactly one mined transaction, nothing else was mined, one signed attempt
/// per request, `(signer, nonce)` unique and anvil's pool empty.
async fn assert_mined_once(p: &Pipeline, requests: &[String]) {
    let markers = p.mined_markers().await;
    for id in requests {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{id} has exactly one mined transaction"
        );
    }
    assert_eq!(markers.len(), requests.len(), "nothing else was mined");
    let n = requests.len() as i64;
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts").await,
        n,
        "one signed attempt per request: nothing was signed twice"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxSigned'")
            .await,
        n,
        "one signature recorded per request"
    );
    assert_eq!(
        p.count("SELECT count(DISTINCT nonce) FROM managed_tx WHERE nonce IS NOT NULL")
            .await,
        n,
        "(signer, nonce) unique"
    );
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string()),
        "nothing left in anvil's pool"
    );
}

/// Spawns the second process of `role` once the first holds the lease, and waits until it wants
/// the lease too (it has consumed the messages so far and is turned away), so that it takes over
/// as soon as the lease is free.
async fn spawn_contender(
    p: &Pipeline,
    role: &str,
    first: &str,
    name: &str,
    pause_at: Option<&str>,
) -> StageProcess {
    assert!(
        lease(p, role)
            .await
            .is_some_and(|(o, _)| o.starts_with(&format!("{first}/"))),
        "{first} holds the signer's {role} lease"
    );
    let b = StageProcess::spawn_leased(p, role, name, &unique(name), pause_at, LEASE);
    wait_until(
        &format!("{name} wants the lease {first} holds"),
        LONG,
        || async { b.log_text().contains(LEASE_BUSY) },
    )
    .await;
    b
}

/// What differs between the two tests' openings.
struct Duel {
    role: &'static str,
    /// The two processes' names (a lease's owner is `{name}/…`).
    a: &'static str,
    b: &'static str,
    /// Where A freezes (`TXFLOW_PAUSE_AT`), and B, if anywhere.
    a_pause: &'static str,
    b_pause: Option<&'static str>,
    /// A count that reaches n once A has done its work for n requests, and that work in words.
    progress: &'static str,
    work: &'static str,
    /// The request ids' prefix.
    prefix: &'static str,
}

/// Where the opening leaves a test: A frozen holding the lease, B waiting for it.
struct Opened {
    a: StageProcess,
    b: StageProcess,
    /// The requests sent before and while A is frozen: those from `unsent` on are not sent yet.
    first: Vec<TxRequest>,
    unsent: usize,
    /// The requests sent after A is resumed.
    second: Vec<TxRequest>,
}

/// The opening both tests share: A is spawned to freeze at `a_pause`; one request, handled by A,
/// gives A the lease; then B acts for the same signer too and waits for the lease. Ten requests
/// at a time, each chunk handled before the next, so that A runs one transaction after another
/// until it freezes.
async fn open(p: &Pipeline, d: &Duel) -> Opened {
    let a = StageProcess::spawn_leased(p, d.role, d.a, &unique(d.a), Some(d.a_pause), LEASE);
    let request = |i: usize| p.request(0, &format!("{}-{i}", d.prefix));
    let first: Vec<_> = (0..FIRST).map(request).collect();
    let second: Vec<_> = (FIRST..TOTAL).map(request).collect();
    p.send(&first[0]).await;
    wait_until(&format!("A {} the first request", d.work), LONG, || async {
        p.count(d.progress).await >= 1
    })
    .await;
    let b = spawn_contender(p, d.role, d.a, d.b, d.b_pause).await;
    let mut sent = 1;
    while a.state() != Some('T') {
        if sent == FIRST {
            panic!(
                "A never paused at {} (is the fault-injection feature on?):\n{}",
                d.a_pause,
                a.log_tail()
            );
        }
        let chunk = &first[sent..(sent + 10).min(FIRST)];
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
        sent += chunk.len();
        wait_until(
            &format!("A {} the chunk or freezes", d.work),
            LONG,
            || async { a.state() == Some('T') || p.count(d.progress).await >= sent as i64 },
        )
        .await;
    }
    Opened {
        a,
        b,
        first,
        unsent: sent,
        second,
    }
}

#[tokio::test]
async fn only_the_current_lease_holder_signs_while_two_signer_gateways_act_for_one_signer() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let config = p.config.clone();
    p.start_allocator(&config, "alloc-1").await;
    p.start_broadcaster(&config).await;

    // A freezes itself inside its fourth signing transaction: transactions signed, rows moved to
    // SIGNED and attempts written, not yet committed. (One request signs in at most two: its
    // message's and a recovery scan's.)
    let Opened {
        a,
        b,
        first,
        unsent,
        second,
    } = open(
        &p,
        &Duel {
            role: SIGNER_GATEWAY,
            a: "sign-a",
            b: "sign-b",
            a_pause: "signer.before_commit@4",
            b_pause: None,
            progress: "SELECT count(*) FROM tx_attempts",
            work: "signs",
            prefix: "s",
        },
    )
    .await;
    let (owner, token_a) = lease(&p, SIGNER_GATEWAY).await.expect("the lease row");
    assert!(
        owner.starts_with("sign-a/"),
        "frozen A still holds the lease"
    );
    let grants_a = grants(&a.log_text());
    let frozen = locked_allocated(&p).await;
    assert!(
        !frozen.is_empty(),
        "A froze inside a signing transaction holding uncommitted signatures\nA:\n{}",
        a.log_tail()
    );
    let committed_by_a = events_under(&p, SIGNER_EVENTS, token_a).await;
    assert!(committed_by_a > 0, "A signed before it froze");
    // The rest arrives while A is frozen.
    for chunk in first[unsent..].chunks(10) {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
    }

    // Steal the lease from under the frozen owner; B, waiting for it, takes it at once.
    expire_lease(&p, SIGNER_GATEWAY, token_a).await;
    wait_until("B takes the lease", LONG, || async {
        lease(&p, SIGNER_GATEWAY)
            .await
            .is_some_and(|(o, _)| o.starts_with("sign-b/"))
    })
    .await;
    let (_, token_b) = lease(&p, SIGNER_GATEWAY).await.expect("B's lease");
    assert!(token_b > token_a, "a new owner gets a higher token");

    // The old owner wakes up inside its open transaction (PostgreSQL has not ended it: the lease
    // is long), its signatures written, and tries to commit; then goes on acting for the signer,
    // and new requests reach both. (B waits for A's row locks meanwhile.)
    let refusals = a.log_text().matches(WRITE_FENCED).count();
    let abandoned = a.log_text().matches(DRIVE_ABANDONED).count();
    a.signal("-CONT");
    for chunk in second.chunks(10) {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
    }
    // B signs A's rows only once A's transaction has ended, committed or not: once everything is
    // mined, A's frozen commit has been decided.
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= TOTAL as u64
    })
    .await;

    assert_eq!(
        events_under(&p, SIGNER_EVENTS, token_a).await,
        committed_by_a,
        "A signed nothing after it froze: its open transaction never committed\nA:\n{}",
        a.log_tail()
    );
    assert_eq!(
        events_of(&p, "TxSigned", &frozen, token_b).await,
        frozen.len() as i64,
        "B signed the transactions A's frozen transaction held"
    );
    let ids: Vec<String> = first
        .iter()
        .chain(&second)
        .map(|r| r.request_id.clone())
        .collect();
    assert_mined_once(&p, &ids).await;
    assert_eq!(
        events_under(&p, SIGNER_EVENTS, token_a).await
            + events_under(&p, SIGNER_EVENTS, token_b).await,
        TOTAL as i64,
        "every signature is A's from before it froze or B's"
    );
    assert_eq!(
        lease(&p, SIGNER_GATEWAY)
            .await
            .map(|(o, t)| (o.starts_with("sign-b/"), t)),
        Some((true, token_b)),
        "B still holds the lease it took"
    );
    assert_eq!(
        grants(&a.log_text()),
        grants_a,
        "A never held the lease again after it froze"
    );
    // Its frozen transaction ended without a commit: refused by the fence when it tried, or,
    // when it froze in a recovery drive, abandoned once it woke to a lost lease (rolled back,
    // never tried). Either way A signed nothing after it froze (checked above).
    let text = a.log_text();
    assert!(
        text.matches(WRITE_FENCED).count() > refusals
            || text.matches(DRIVE_ABANDONED).count() > abandoned,
        "A's frozen commit was refused by the fence or its drive abandoned\nA:\n{}",
        a.log_tail()
    );
    let mut a = a;
    assert!(a.running(), "A survived being fenced:\n{}", a.log_tail());
    drop(b);
    p.stop().await;
}

#[tokio::test]
async fn only_the_current_lease_holder_records_sends_while_two_broadcasters_act_for_one_signer() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let config = p.config.clone();
    p.start_allocator(&config, "alloc-1").await;
    p.start_signer_gateway(&config).await;

    // A freezes itself after the sends of its fourth drive that sent anything, before recording
    // them. (One request is sent by at most two: its message's and a recovery scan's.) B freezes
    // as well, right after the sends of its first drive, before recording.
    let submitted = "SELECT count(*) FROM managed_tx WHERE state = 'SUBMITTED'";
    let Opened {
        a,
        b,
        first,
        unsent,
        second,
    } = open(
        &p,
        &Duel {
            role: BROADCASTER,
            a: "bcast-a",
            b: "bcast-b",
            a_pause: "stage.after_call@4",
            b_pause: Some("stage.after_call@1"),
            progress: submitted,
            work: "records the sends of",
            prefix: "b",
        },
    )
    .await;
    let (owner, token_a) = lease(&p, BROADCASTER).await.expect("the lease row");
    assert!(
        owner.starts_with("bcast-a/"),
        "frozen A still holds the lease"
    );
    let grants_a = grants(&a.log_text());
    // What A sent and did not record is mined (A is the only sender so far).
    wait_until("A's unrecorded sends are mined", LONG, || async {
        p.mined_count().await as i64 > p.count(submitted).await
    })
    .await;
    let latest = p.mined_count().await as i64;
    let unrecorded: Vec<Uuid> = sqlx::query_scalar(
        "SELECT tx_id FROM managed_tx WHERE state = 'SIGNED' AND nonce < $1 ORDER BY nonce",
    )
    .bind(latest)
    .fetch_all(&p.db.pool)
    .await
    .expect("unrecorded sends");
    assert!(
        !unrecorded.is_empty(),
        "A froze with sends it had not recorded\nA:\n{}",
        a.log_tail()
    );
    let committed_by_a = events_under(&p, BROADCASTER_EVENTS, token_a).await;
    assert!(committed_by_a > 0, "A recorded sends before it froze");
    for chunk in first[unsent..].chunks(10) {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
    }

    // Steal the lease from under the frozen owner. B takes it, sends the signer's SIGNED
    // transactions again (A's among them) and freezes before recording.
    expire_lease(&p, BROADCASTER, token_a).await;
    wait_until("B takes over and freezes after its sends", LONG, || async {
        b.state() == Some('T')
    })
    .await;
    let (owner, token_b) = lease(&p, BROADCASTER).await.expect("B's lease");
    assert!(owner.starts_with("bcast-b/"), "B took the lease");
    assert!(token_b > token_a, "a new owner gets a higher token");
    assert_eq!(
        submissions_of(&p, &unrecorded).await,
        0,
        "nobody has recorded A's sends yet"
    );

    // A wakes up and records its sends while the new owner's record of the same sends is yet to
    // come: only the fence stands between A's stale write and the tables.
    let refusals = a.log_text().matches(WRITE_FENCED).count();
    a.signal("-CONT");
    wait_until("A's record is refused (or lands)", LONG, || async {
        a.log_text().matches(WRITE_FENCED).count() > refusals
            || events_under(&p, BROADCASTER_EVENTS, token_a).await > committed_by_a
    })
    .await;
    b.signal("-CONT");
    for chunk in second.chunks(10) {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
    }
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= TOTAL as u64
    })
    .await;
    wait_until("every request is recorded SUBMITTED", LONG, || async {
        p.count(submitted).await == TOTAL as i64
    })
    .await;

    assert_eq!(
        events_under(&p, BROADCASTER_EVENTS, token_a).await,
        committed_by_a,
        "A recorded nothing after it froze: no TxSubmitted, TxReplaced or TxResubmitted under \
         its old token\nA:\n{}",
        a.log_tail()
    );
    assert_eq!(
        events_of(&p, "TxSubmitted", &unrecorded, token_b).await,
        unrecorded.len() as i64,
        "B recorded the sends A left unrecorded"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxSubmitted'")
            .await,
        TOTAL as i64,
        "one submission recorded per request"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type IN ('TxReplaced', 'TxFailed')")
            .await,
        0,
        "nothing replaced or failed"
    );
    let ids: Vec<String> = first
        .iter()
        .chain(&second)
        .map(|r| r.request_id.clone())
        .collect();
    assert_mined_once(&p, &ids).await;
    assert_eq!(
        lease(&p, BROADCASTER)
            .await
            .map(|(o, t)| (o.starts_with("bcast-b/"), t)),
        Some((true, token_b)),
        "B still holds the lease it took"
    );
    assert_eq!(
        grants(&a.log_text()),
        grants_a,
        "A never held the lease again after it froze"
    );
    let mut a = a;
    assert!(a.running(), "A survived being fenced:\n{}", a.log_tail());
    drop(b);
    p.stop().await;
}
