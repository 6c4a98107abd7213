//! Leases and fenced writes against real PostgreSQL (seed 001 §4 and §7.1, seed 002 §5 and §8.2).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use txflow_core::domain::{ChainId, FencingToken, NodeId, Signer};
use txflow_core::fenced::FenceError;
use txflow_core::lease::{AcquireKind, Acquisition, HeldLease, LeaseConfig, LeaseManager};
use txflow_core::role::Role;
use txflow_tests::{TestDb, wait_for, wait_until};

const CHAIN: ChainId = ChainId(31337);
const LONG: Duration = Duration::from_secs(30);

fn signer(i: u32) -> Signer {
    Signer::parse(&format!("0x{i:040x}")).expect("valid address")
}

fn config(duration_ms: u64, skew_ms: u64) -> LeaseConfig {
    LeaseConfig {
        duration: Duration::from_millis(duration_ms),
        renew_interval: Duration::from_millis(duration_ms / 4),
        clock_skew: Duration::from_millis(skew_ms),
    }
}

fn manager(pool: &PgPool, node: &str, config: LeaseConfig) -> LeaseManager {
    LeaseManager::new(pool.clone(), Role::Allocator, NodeId::named(node), config)
        .expect("valid config")
}

fn held(a: Acquisition) -> (HeldLease, AcquireKind) {
    match a {
        Acquisition::Held(l, k) => (l, k),
        Acquisition::Busy { owner, .. } => panic!("expected to hold the lease, but {owner:?} does"),
    }
}

/// Polls until `m` holds the lease (it must wait for the current holder's expiry).
async fn take_over(m: &LeaseManager, s: &Signer) -> (HeldLease, AcquireKind) {
    wait_for(&format!("{} takes the lease", m.node()), LONG, || async {
        match m.acquire(CHAIN, s).await.expect("acquire") {
            Acquisition::Held(l, k) => Some((l, k)),
            Acquisition::Busy { .. } => None,
        }
    })
    .await
}

async fn cursor(pool: &PgPool, s: &Signer) -> Option<(i64, i64)> {
    sqlx::query_as("SELECT next_nonce, fencing_token FROM signer_nonce_cursor WHERE chain_id = $1 AND signer = $2")
        .bind(CHAIN.0)
        .bind(s.as_str())
        .fetch_optional(pool)
        .await
        .expect("read cursor")
}

/// `l`'s lease (held by `a`) is taken by `b` after `l`'s work was kept in `batch`, before the
/// batch commits: the commit is fenced, naming `l`, and applies nothing.
async fn stolen_before_commit(
    batch: txflow_core::fenced::BatchTx,
    a: &LeaseManager,
    b: &LeaseManager,
    l: &HeldLease,
) {
    use txflow_core::fenced::BatchCommitError;
    assert!(a.release(l).await.expect("release"));
    held(b.acquire(CHAIN, &l.key().signer).await.expect("b takes it"));
    match batch.commit().await {
        Err(BatchCommitError::Fenced(lost)) => assert_eq!(lost, vec![l.clone()]),
        other => panic!("expected the commit to be fenced, got {other:?}"),
    }
}

#[tokio::test]
async fn a_paused_owner_resuming_after_a_steal_is_fenced_and_the_new_owner_is_intact() {
    let db = TestDb::new().await;
    let s = signer(1);
    let a = manager(&db.pool, "node-a", config(600, 100));
    let b = manager(&db.pool, "node-b", config(600, 100));
    let (la, kind) = held(a.acquire(CHAIN, &s).await.expect("acquire"));
    assert_eq!((la.token(), kind), (FencingToken(1), AcquireKind::First));

    // A is in the middle of a critical write: one statement done, transaction open, then paused.
    let mut txa = la.begin(&db.pool).await.expect("begin");
    assert_eq!(txa.allocate_nonces(1).await.expect("first write"), vec![0]);

    // B steals once A's lease has expired past the skew, and writes.
    let (lb, kind) = take_over(&b, &s).await;
    assert_eq!(lb.token(), FencingToken(2));
    assert_eq!(
        kind,
        AcquireKind::Stolen {
            from: "node-a".into()
        }
    );
    let pool = db.pool.clone();
    let lb2 = lb.clone();
    let b_write = tokio::spawn(async move {
        let mut tx = lb2.begin(&pool).await?;
        let nonces = tx.allocate_nonces(1).await?;
        tx.commit().await?;
        Ok::<_, FenceError>(nonces)
    });

    // A resumes: its next write affects no row and surfaces Fenced.
    let err = txa
        .allocate_nonces(1)
        .await
        .expect_err("a stale owner's write");
    assert!(err.is_fenced(), "{err:?}");
    drop(txa);

    let b_nonces = b_write.await.expect("join").expect("B's write commits");
    assert_eq!(
        b_nonces,
        vec![0],
        "A's uncommitted allocation did not consume nonce 0"
    );
    assert_eq!(
        cursor(&db.pool, &s).await,
        Some((1, 2)),
        "the cursor is B's: next 1, token 2"
    );
}

#[tokio::test]
async fn a_late_commit_of_an_old_owner_applies_nothing() {
    let db = TestDb::new().await;
    let s = signer(2);
    let a = manager(&db.pool, "node-a", config(600, 100));
    let b = manager(&db.pool, "node-b", config(600, 100));
    let (la, _) = held(a.acquire(CHAIN, &s).await.expect("acquire"));
    let mut setup = la.begin(&db.pool).await.expect("begin");
    assert_eq!(
        setup.allocate_nonces(5).await.expect("allocate"),
        vec![0, 1, 2, 3, 4]
    );
    setup.commit().await.expect("commit");

    // A's whole write succeeds while its lease is current...
    let mut txa = la.begin(&db.pool).await.expect("begin");
    assert_eq!(txa.allocate_nonces(3).await.expect("write"), vec![5, 6, 7]);
    // ...then A pauses before committing, and B steals.
    let (lb, _) = take_over(&b, &s).await;
    assert_eq!(lb.token(), FencingToken(2));

    let err = txa.commit().await.expect_err("the late commit");
    assert!(err.is_fenced(), "{err:?}");
    assert_eq!(
        cursor(&db.pool, &s).await,
        Some((5, 1)),
        "nothing of A's late transaction was applied"
    );

    let mut txb = lb.begin(&db.pool).await.expect("B begins");
    assert_eq!(txb.allocate_nonces(1).await.expect("B writes"), vec![5]);
    txb.commit().await.expect("B commits");
    assert_eq!(cursor(&db.pool, &s).await, Some((6, 2)));
}

#[tokio::test]
async fn renewal_keeps_the_token_and_retaking_after_expiry_raises_it() {
    let db = TestDb::new().await;
    let s = signer(3);
    let cfg = config(500, 100);
    let a = manager(&db.pool, "node-a", cfg);
    let b = manager(&db.pool, "node-b", cfg);

    let (l1, k1) = held(a.acquire(CHAIN, &s).await.expect("acquire"));
    assert_eq!((l1.token(), k1), (FencingToken(1), AcquireKind::First));
    let (l2, k2) = held(a.acquire(CHAIN, &s).await.expect("acquire again"));
    assert_eq!((l2.token(), k2), (FencingToken(1), AcquireKind::Renewed));
    assert!(l2.expires_at() >= l1.expires_at());
    let r = a.renew(std::slice::from_ref(&l2)).await.expect("renew");
    assert_eq!(r.renewed.len(), 1);
    assert_eq!(
        r.renewed[0].token(),
        FencingToken(1),
        "a renewal never changes the token"
    );
    match b.acquire(CHAIN, &s).await.expect("b tries") {
        Acquisition::Busy { owner, .. } => assert_eq!(owner.as_deref(), Some("node-a")),
        other => panic!("a live lease must not be stolen: {other:?}"),
    }

    // Let it expire past the skew (database clock).
    wait_until("the lease expired past the skew", LONG, || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT expires_at <= clock_timestamp() - interval '100 milliseconds' FROM signer_lease WHERE signer = $1",
        )
        .bind(s.as_str())
        .fetch_one(&db.pool)
        .await
        .expect("query")
    })
    .await;
    let r = a.renew(std::slice::from_ref(&l2)).await.expect("renew");
    assert_eq!(
        (r.renewed.len(), r.lost.len()),
        (0, 1),
        "an expired lease cannot be renewed"
    );
    let (l3, k3) = held(a.acquire(CHAIN, &s).await.expect("re-take"));
    assert_eq!((l3.token(), k3), (FencingToken(2), AcquireKind::Retaken));
    let err = l2
        .begin(&db.pool)
        .await
        .expect_err("the old token is fenced");
    assert!(err.is_fenced());

    // Released: another node takes it at once, with the next token.
    assert!(a.release(&l3).await.expect("release"));
    let (l4, k4) = held(b.acquire(CHAIN, &s).await.expect("b takes"));
    assert_eq!(
        (l4.token(), k4),
        (
            FencingToken(3),
            AcquireKind::Stolen {
                from: "node-a".into()
            }
        )
    );
}

#[tokio::test]
async fn many_signers_are_acquired_and_renewed_in_one_statement_each() {
    let db = TestDb::new().await;
    let a = manager(&db.pool, "node-a", config(2_000, 200));
    let b = manager(&db.pool, "node-b", config(2_000, 200));
    let signers: Vec<Signer> = (10..30).map(signer).collect();
    let (first, rest) = signers.split_at(5);
    for acq in b.acquire_many(CHAIN, first).await.expect("b takes 5") {
        assert!(acq.held().is_some());
    }
    let got = a
        .acquire_many(CHAIN, &signers)
        .await
        .expect("a takes the rest");
    assert_eq!(got.len(), 20);
    let held_by_a: Vec<HeldLease> = got.iter().filter_map(|a| a.held().cloned()).collect();
    assert_eq!(
        held_by_a.len(),
        rest.len(),
        "the 5 live leases of b are busy for a"
    );
    let renewal = a.renew(&held_by_a).await.expect("renew 15 at once");
    assert_eq!((renewal.renewed.len(), renewal.lost.len()), (15, 0));
    assert!(renewal.renewed.iter().all(|l| l.token() == FencingToken(1)));
}

/// One grant the acquirers saw: token, node, granted at, expires at (database clock).
type Grant = (i64, String, DateTime<Utc>, DateTime<Utc>);

/// One owner's tenure of one token, from the history the acquirers record.
#[derive(Debug, Clone)]
struct Tenure {
    node: String,
    first_grant: DateTime<Utc>,
    last_expiry: DateTime<Utc>,
}

#[tokio::test]
async fn fifty_concurrent_acquirers_never_overlap_and_tokens_increase() {
    let db = TestDb::new().await;
    let s = signer(4);
    let cfg = config(200, 50);
    let history: Arc<Mutex<Vec<Grant>>> = Arc::default();
    let run_until = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut tasks = Vec::new();
    for i in 0..50 {
        let pool = db.pool(1).await; // a connection of its own
        let m = manager(&pool, &format!("node-{i:02}"), cfg);
        let history = history.clone();
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut renewals_left = 0;
            while tokio::time::Instant::now() < run_until {
                match m.acquire(CHAIN, &s).await.expect("acquire") {
                    Acquisition::Held(l, _) => {
                        history.lock().expect("lock").push((
                            l.token().0,
                            m.node().to_string(),
                            l.granted_at(),
                            l.expires_at(),
                        ));
                        // Hold it for a few renewals, then let it lapse.
                        if renewals_left == 0 {
                            renewals_left = 3;
                        }
                        renewals_left -= 1;
                        let pause = if renewals_left == 0 { 400 } else { 40 };
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                    Acquisition::Busy { .. } => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("acquirer");
    }

    let history = history.lock().expect("lock").clone();
    let mut tenures: BTreeMap<i64, Tenure> = BTreeMap::new();
    for (token, node, granted, expires) in history {
        let t = tenures.entry(token).or_insert(Tenure {
            node: node.clone(),
            first_grant: granted,
            last_expiry: expires,
        });
        assert_eq!(t.node, node, "token {token} was granted to two nodes");
        t.first_grant = t.first_grant.min(granted);
        t.last_expiry = t.last_expiry.max(expires);
    }
    assert!(
        tenures.len() >= 5,
        "the run must include several takeovers, got {}",
        tenures.len()
    );
    let owners: std::collections::BTreeSet<&str> =
        tenures.values().map(|t| t.node.as_str()).collect();
    assert!(
        owners.len() >= 3,
        "several nodes must have owned the lease, got {owners:?}"
    );
    let ordered: Vec<(&i64, &Tenure)> = tenures.iter().collect();
    for pair in ordered.windows(2) {
        let ((t1, a), (t2, b)) = (pair[0], pair[1]);
        assert!(
            b.first_grant >= a.last_expiry,
            "two owners at once: token {t1} ({}) held until {} but token {t2} ({}) granted at {}",
            a.node,
            a.last_expiry,
            b.node,
            b.first_grant
        );
    }
}

#[tokio::test]
async fn a_thousand_concurrent_allocations_take_each_nonce_once_and_a_stale_holder_is_fenced() {
    let db = TestDb::new().await;
    let pool = db.pool(8).await;
    let s = signer(5);
    let cfg = config(2_000, 200);
    let a = manager(&pool, "node-a", cfg);
    let (lease, _) = held(a.acquire(CHAIN, &s).await.expect("acquire"));

    let stop = tokio_util::sync::CancellationToken::new();
    let renewer = {
        let (a, lease, stop) = (a.clone(), lease.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(a.config().renew_interval) => {}
                }
                let r = a.renew(std::slice::from_ref(&lease)).await.expect("renew");
                assert!(r.lost.is_empty(), "the holder kept its lease");
            }
        })
    };

    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (lease, pool) = (lease.clone(), pool.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for _ in 0..125 {
                let mut tx = lease.begin(&pool).await.expect("begin");
                mine.extend(tx.allocate_nonces(1).await.expect("allocate"));
                tx.commit().await.expect("commit");
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("allocator task"));
    }
    stop.cancel();
    renewer.await.expect("renewer");
    all.sort_unstable();
    assert_eq!(
        all,
        (0..1000).collect::<Vec<i64>>(),
        "nonces 0..999, each exactly once"
    );
    assert_eq!(cursor(&pool, &s).await, Some((1000, 1)));

    // A stale holder: its transaction was open when another node took over.
    let mut stale = lease.begin(&pool).await.expect("begin");
    assert!(a.release(&lease).await.expect("release"));
    let b = manager(&pool, "node-b", cfg);
    let (lb, _) = held(b.acquire(CHAIN, &s).await.expect("b takes over"));
    assert_eq!(lb.token(), FencingToken(2));
    let err = stale
        .allocate_nonces(1)
        .await
        .expect_err("stale allocation");
    assert!(err.is_fenced(), "{err:?}");
    drop(stale);
    let err = lease.begin(&pool).await.expect_err("stale begin");
    assert!(err.is_fenced());
    assert_eq!(
        cursor(&pool, &s).await,
        Some((1000, 1)),
        "the stale holder allocated nothing"
    );
}

#[tokio::test]
async fn released_nonces_are_reused_lowest_first_and_alignment_follows_the_chain() {
    let db = TestDb::new().await;
    let s = signer(6);
    let a = manager(&db.pool, "node-a", config(5_000, 500));
    let (lease, _) = held(a.acquire(CHAIN, &s).await.expect("acquire"));
    let mut tx = lease.begin(&db.pool).await.expect("begin");
    assert_eq!(
        tx.allocate_nonces(10).await.expect("allocate"),
        (0..10).collect::<Vec<_>>()
    );
    tx.release_nonce(7).await.expect("release 7");
    tx.release_nonce(3).await.expect("release 3");
    tx.commit().await.expect("commit");

    let mut tx = lease.begin(&db.pool).await.expect("begin");
    assert_eq!(
        tx.allocate_nonces(1).await.expect("allocate"),
        vec![3],
        "lowest recycled first"
    );
    assert_eq!(
        tx.allocate_nonces(2).await.expect("allocate"),
        vec![7, 10],
        "then the cursor"
    );
    tx.release_nonce(4).await.expect("release 4");
    tx.release_nonce(9).await.expect("release 9");
    // The chain's pending nonce is 6: nonce 4 was consumed on chain after all, 9 was not.
    assert_eq!(tx.align_cursor(6).await.expect("align"), 11, "never back");
    assert_eq!(tx.allocate_nonces(2).await.expect("allocate"), vec![9, 11]);
    // The signer was used outside txflow up to nonce 19: the cursor jumps to the chain's.
    assert_eq!(tx.align_cursor(20).await.expect("align"), 20);
    assert_eq!(tx.allocate_nonces(1).await.expect("allocate"), vec![20]);
    tx.release_nonce(20).await.expect("release 20");
    let (next, synced) = tx.cursor().await.expect("cursor").expect("exists");
    assert_eq!(next, 21);
    assert!(synced.is_some(), "alignment records when it last synced");
    tx.commit().await.expect("commit");
    let recycled: Vec<i64> =
        sqlx::query_scalar("SELECT nonce FROM recycled_nonces WHERE signer = $1 ORDER BY nonce")
            .bind(s.as_str())
            .fetch_all(&db.pool)
            .await
            .expect("recycled");
    assert_eq!(
        recycled,
        vec![20],
        "recycled nonces below the chain's were dropped; 20 waits for reuse"
    );
}

#[tokio::test]
async fn a_critical_write_without_the_fencing_predicate_is_refused() {
    let db = TestDb::new().await;
    let s = signer(7);
    let a = manager(&db.pool, "node-a", config(5_000, 500));
    let (lease, _) = held(a.acquire(CHAIN, &s).await.expect("acquire"));
    let mut tx = lease.begin(&db.pool).await.expect("begin");
    let err = tx
        .execute(
            "sneaky",
            "UPDATE signer_nonce_cursor SET next_nonce = 0",
            |q| q,
        )
        .await
        .expect_err("unfenced SQL");
    assert!(matches!(err, FenceError::Unfenced { .. }), "{err:?}");
}

#[tokio::test]
async fn in_a_batch_a_fenced_signer_rolls_back_alone_and_a_lease_lost_before_commit_undoes_the_batch()
 {
    use txflow_core::fenced::BatchTx;
    let db = TestDb::new().await;
    let (s1, s2) = (signer(8), signer(9));
    let cfg = config(5_000, 500);
    let a = manager(&db.pool, "node-a", cfg);
    let b = manager(&db.pool, "node-b", cfg);
    let (l1, _) = held(a.acquire(CHAIN, &s1).await.expect("acquire"));
    let (l2, _) = held(a.acquire(CHAIN, &s2).await.expect("acquire"));

    // s2's lease is taken by node-b before the batch reaches it.
    assert!(a.release(&l2).await.expect("release"));
    held(b.acquire(CHAIN, &s2).await.expect("b takes s2"));
    let mut batch = BatchTx::begin(&db.pool, Duration::from_secs(10))
        .await
        .expect("begin");
    let mut scope = batch.signer(&l1).await.expect("s1 is ours");
    assert_eq!(
        scope.writer().allocate_nonces(2).await.expect("s1 writes"),
        vec![0, 1]
    );
    scope.keep().await.expect("keep s1");
    let err = batch.signer(&l2).await.err().expect("s2 is fenced");
    assert!(err.is_fenced(), "{err:?}");
    batch.commit().await.expect("s1's work commits without s2");
    assert_eq!(cursor(&db.pool, &s1).await, Some((2, 1)));
    assert_eq!(
        cursor(&db.pool, &s2).await,
        None,
        "nothing for the fenced signer"
    );

    // s1's lease is lost after its work was kept but before the commit: nothing is applied.
    let mut batch = BatchTx::begin(&db.pool, Duration::from_secs(10))
        .await
        .expect("begin");
    let mut scope = batch.signer(&l1).await.expect("s1 is ours");
    assert_eq!(
        scope.writer().allocate_nonces(1).await.expect("s1 writes"),
        vec![2]
    );
    scope.keep().await.expect("keep s1");
    stolen_before_commit(batch, &a, &b, &l1).await;
    assert_eq!(
        cursor(&db.pool, &s1).await,
        Some((2, 1)),
        "the batch was rolled back"
    );
}

/// An optimistic batch (no savepoint per signer, the stage runtime's first run of a batch): a
/// fenced signer's write is refused by its fence, and since its work cannot be undone alone,
/// discarding it abandons the batch: nothing of it commits, not even the current signer's work.
/// Without a discard both signers' work commits, and a lease lost before the commit undoes the
/// batch as in a guarded one.
#[tokio::test]
async fn an_optimistic_batch_is_abandoned_whole_when_a_signer_is_discarded_and_fenced_at_commit() {
    use txflow_core::fenced::{BatchCommitError, BatchTx};
    let db = TestDb::new().await;
    let (s1, s2) = (signer(10), signer(11));
    let cfg = config(5_000, 500);
    let a = manager(&db.pool, "node-a", cfg);
    let b = manager(&db.pool, "node-b", cfg);
    let (l1, _) = held(a.acquire(CHAIN, &s1).await.expect("acquire"));
    let (l2, _) = held(a.acquire(CHAIN, &s2).await.expect("acquire"));

    // Both current: both signers' work commits, and no savepoint was taken.
    let mut batch = BatchTx::begin_optimistic(&db.pool, Duration::from_secs(10))
        .await
        .expect("begin");
    assert!(!batch.guarded());
    for (l, n) in [(&l1, 2), (&l2, 3)] {
        let mut scope = batch.signer(l).await.expect("no check to fail");
        scope.writer().allocate_nonces(n).await.expect("writes");
        scope.keep().await.expect("keep");
    }
    batch.commit().await.expect("commits");
    assert_eq!(cursor(&db.pool, &s1).await, Some((2, 1)));
    assert_eq!(cursor(&db.pool, &s2).await, Some((3, 1)));

    // s2's lease is taken by node-b: opening its scope does not check, its write is fenced, and
    // discarding it abandons the batch with s1's work in it.
    assert!(a.release(&l2).await.expect("release"));
    held(b.acquire(CHAIN, &s2).await.expect("b takes s2"));
    let mut batch = BatchTx::begin_optimistic(&db.pool, Duration::from_secs(10))
        .await
        .expect("begin");
    let mut scope = batch.signer(&l1).await.expect("s1");
    assert_eq!(
        scope.writer().allocate_nonces(1).await.expect("s1 writes"),
        vec![2]
    );
    scope.keep().await.expect("keep s1");
    let mut scope = batch.signer(&l2).await.expect("not checked when opened");
    let err = scope
        .writer()
        .allocate_nonces(1)
        .await
        .expect_err("s2's write is fenced");
    assert!(err.is_fenced(), "{err:?}");
    scope.discard().await.expect("discard");
    match batch.commit().await {
        Err(BatchCommitError::Abandoned) => {}
        other => panic!("expected the batch to be abandoned, got {other:?}"),
    }
    assert_eq!(
        cursor(&db.pool, &s1).await,
        Some((2, 1)),
        "s1's work in the abandoned batch was rolled back"
    );
    assert_eq!(cursor(&db.pool, &s2).await, Some((3, 1)));

    // s1's lease is lost after its work was kept, before the commit: nothing is applied.
    let mut batch = BatchTx::begin_optimistic(&db.pool, Duration::from_secs(10))
        .await
        .expect("begin");
    let mut scope = batch.signer(&l1).await.expect("s1");
    scope.writer().allocate_nonces(1).await.expect("s1 writes");
    scope.keep().await.expect("keep s1");
    stolen_before_commit(batch, &a, &b, &l1).await;
    assert_eq!(cursor(&db.pool, &s1).await, Some((2, 1)), "rolled back");
}

/// Lease rows are locked in one order everywhere (issue 12 point 6): a node committing batches
/// and renewing its leases (share and row locks on many lease rows, its signers in any order)
/// while another node tries to take the same leases (`acquire_many`, rows locked in address
/// order) never deadlocks; PostgreSQL would abort one of them with 40P01 otherwise.
#[tokio::test]
async fn batch_commits_renewals_and_acquisitions_of_one_signer_set_never_deadlock() {
    use txflow_core::fenced::BatchTx;
    let db = TestDb::new().await;
    let cfg = config(60_000, 500);
    let a = manager(&db.pool, "node-a", cfg);
    let b = manager(&db.pool, "node-b", cfg);
    let signers: Vec<Signer> = (0..40).map(|i| signer(1000 + i)).collect();
    let leases: Vec<HeldLease> = a
        .acquire_many(CHAIN, &signers)
        .await
        .expect("acquire")
        .into_iter()
        .map(|acq| held(acq).0)
        .collect();
    // node-a works on its signers in descending order, the opposite of the address order.
    let mut reversed = leases.clone();
    reversed.reverse();

    let rounds = 150;
    let committer = {
        let pool = db.pool.clone();
        let reversed = reversed.clone();
        tokio::spawn(async move {
            for _ in 0..rounds {
                let mut batch = BatchTx::begin(&pool, Duration::from_secs(10))
                    .await
                    .expect("begin");
                for l in &reversed {
                    let scope = batch.signer(l).await.expect("ours");
                    scope.keep().await.expect("keep");
                }
                batch
                    .commit()
                    .await
                    .expect("a batch commit never deadlocks");
            }
        })
    };
    let renewer = {
        let reversed = reversed.clone();
        let a = a.clone();
        tokio::spawn(async move {
            for _ in 0..rounds {
                let renewal = a.renew(&reversed).await.expect("a renewal never deadlocks");
                assert!(renewal.lost.is_empty(), "nothing lost: {:?}", renewal.lost);
            }
        })
    };
    let thief = {
        let signers = signers.clone();
        tokio::spawn(async move {
            for _ in 0..rounds {
                let got = b
                    .acquire_many(CHAIN, &signers)
                    .await
                    .expect("an acquisition never deadlocks");
                assert!(
                    got.iter().all(|g| matches!(g, Acquisition::Busy { .. })),
                    "node-a holds them all"
                );
            }
        })
    };
    for (what, task) in [
        ("committer", committer),
        ("renewer", renewer),
        ("thief", thief),
    ] {
        task.await.unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

/// A compare-and-set miss is not a lost lease (issue 12 point 6): a move every row must make
/// (`txstore::apply_all`) on a row another task already moved answers `Moved` — transient,
/// retried after reading again — never `Fenced`, which would make the stage forget a lease it
/// still holds and raise the fenced-write alert. The lease is still usable afterwards.
#[tokio::test]
async fn a_compare_and_set_miss_is_reported_as_moved_not_as_fenced() {
    use txflow_core::retry::{Classify, Retry};
    use txflow_core::state::{FAIL_UNALLOCATED, SIMULATE};
    use txflow_core::txstore::{self, Audit, Kind, MoveRow, NewTx};
    use uuid::Uuid;

    let db = TestDb::new().await;
    let a = manager(&db.pool, "node-a", config(30_000, 500));
    let s = signer(77);
    let (lease, _) = held(a.acquire(CHAIN, &s).await.expect("acquire"));
    let tx_id = Uuid::now_v7();
    let mut tx = lease.begin(&db.pool).await.expect("begin");
    txstore::create(
        &mut tx.writer(),
        &[NewTx {
            tx_id,
            request_id: "cas-1".into(),
            kind: Kind::Request,
            nonce: None,
            payload: serde_json::json!({}),
            audit: Audit {
                event_id: Uuid::now_v7(),
                event_type: "TxAccepted",
                payload: serde_json::json!({}),
            },
        }],
    )
    .await
    .expect("create");
    tx.commit().await.expect("commit");

    // Another task fails it first (RECEIVED → FAILED)...
    let mut tx = lease.begin(&db.pool).await.expect("begin");
    let row = MoveRow::new(tx_id, Uuid::now_v7(), serde_json::json!({}));
    txstore::apply(&mut tx.writer(), FAIL_UNALLOCATED, &[row])
        .await
        .expect("fail it");
    tx.commit().await.expect("commit");

    // ...then this one, having read it RECEIVED, simulates it: every row must move.
    let mut tx = lease.begin(&db.pool).await.expect("begin");
    let row = MoveRow::new(tx_id, Uuid::now_v7(), serde_json::json!({}));
    let err = txstore::apply_all(&mut tx.writer(), SIMULATE, &[row])
        .await
        .expect_err("the row had moved on");
    assert!(!err.is_fenced(), "a CAS miss reported as fenced: {err:?}");
    assert!(
        matches!(
            err,
            FenceError::Moved {
                expected: 1,
                moved: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.retry(), Retry::Transient, "{err:?}");
    drop(tx);
    let again = lease
        .begin(&db.pool)
        .await
        .expect("the lease is still ours");
    drop(again);
}
