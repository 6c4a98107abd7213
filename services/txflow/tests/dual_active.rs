//! Dual-active allocators (issue 5): two `txflow allocator` processes both act for one signer —
//! each in a consumer group of its own, so both receive every request. The first holds the
//! lease and is frozen (SIGSTOP, from its own fault point) inside an allocation transaction; the
//! lease is taken from it; the second takes over; the first is resumed and keeps acting. Only the
//! holder of the current fencing token allocates, and every request has exactly one mined
//! transaction. Checked on the chain and in PostgreSQL.

mod common;

use std::time::Duration;

use common::{StageProcess, expire_lease};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{unique, wait_until};

const LONG: Duration = Duration::from_secs(240);

/// The allocator lease of the signer: `(owner_node, fencing_token)`.
async fn lease(p: &Pipeline) -> Option<(String, i64)> {
    common::lease(p, "allocator").await
}

/// TxAllocated events recorded under `token`.
async fn allocations_under(p: &Pipeline, token: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM tx_events WHERE type = 'TxAllocated'
           AND (payload->>'fencing_token')::bigint = $1",
    )
    .bind(token)
    .fetch_one(&p.db.pool)
    .await
    .expect("count")
}

#[tokio::test]
async fn only_the_current_lease_holder_allocates_while_two_allocators_act_for_one_signer() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let config = p.config.clone();
    p.start_signer_gateway(&config).await;
    p.start_broadcaster(&config).await;

    // A freezes itself inside its third allocation transaction: nonces taken and rows written,
    // not yet committed.
    let a = StageProcess::spawn(
        &p,
        "allocator",
        "alloc-a",
        &unique("group-a"),
        Some("allocator.before_commit@3"),
    );
    let first: Vec<_> = (0..200).map(|i| p.request(0, &format!("r-{i}"))).collect();
    let second: Vec<_> = (200..300)
        .map(|i| p.request(0, &format!("r-{i}")))
        .collect();
    // Ten requests at a time, each chunk allocated before the next is sent, so that A runs one
    // allocation transaction after another until it freezes in its third.
    let mut b = None;
    let mut sent = 0;
    while a.state() != Some('T') {
        assert!(
            sent < first.len(),
            "A never paused at allocator.before_commit@3 (is the fault-injection feature on?):\n{}",
            a.log_tail()
        );
        let chunk = &first[sent..sent + 10];
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
        sent += 10;
        wait_until("A allocates the chunk or freezes", LONG, || async {
            a.state() == Some('T')
                || p.count("SELECT count(*) FROM managed_tx WHERE nonce IS NOT NULL")
                    .await
                    >= sent as i64
        })
        .await;
        if b.is_none() {
            assert!(
                lease(&p)
                    .await
                    .is_some_and(|(o, _)| o.starts_with("alloc-a/")),
                "A holds the signer's lease"
            );
            // B acts for the same signer from now on: it sees every request too, in its own
            // consumer group, and wants the lease.
            b = Some(StageProcess::spawn(
                &p,
                "allocator",
                "alloc-b",
                &unique("group-b"),
                None,
            ));
        }
    }
    // The rest arrives while A is frozen.
    for chunk in first[sent..].chunks(10) {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
    }
    // Every allocation so far is A's (B never held the lease): its token is theirs.
    let token_a: i64 = sqlx::query_scalar(
        "SELECT max((payload->>'fencing_token')::bigint) FROM tx_events WHERE type = 'TxAllocated'",
    )
    .fetch_one(&p.db.pool)
    .await
    .expect("A's allocations");
    let committed_by_a = allocations_under(&p, token_a).await;
    // How many transactions A's first two commits held depends on how the requests were batched.
    assert!(committed_by_a > 0, "A allocated before it froze");

    // Steal the lease from under the frozen owner.
    expire_lease(&p, "allocator", token_a).await;
    wait_until("B takes the lease", LONG, || async {
        lease(&p)
            .await
            .is_some_and(|(o, _)| o.starts_with("alloc-b/"))
    })
    .await;
    let (_, token_b) = lease(&p).await.expect("B's lease");
    assert!(token_b > token_a, "a new owner gets a higher token");
    // B allocates once PostgreSQL has ended the frozen owner's session (its row locks go with it).
    wait_until("B allocates", LONG, || async {
        allocations_under(&p, token_b).await > 0
    })
    .await;

    // The old owner wakes up inside its transaction and goes on acting for the signer, and new
    // requests reach both.
    a.signal("-CONT");
    for chunk in second.chunks(10) {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
    }
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= 300
    })
    .await;

    let markers = p.mined_markers().await;
    for r in first.iter().chain(&second) {
        assert_eq!(
            markers.get(&format!("txflow:{}", r.request_id)),
            Some(&1),
            "{} has exactly one mined transaction",
            r.request_id
        );
    }
    assert_eq!(markers.len(), 300, "nothing else was mined");
    assert_eq!(
        allocations_under(&p, token_a).await,
        committed_by_a,
        "A allocated nothing after it froze: its open transaction never landed\nA:\n{}",
        a.log_tail()
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxAllocated'")
            .await,
        300,
        "one allocation per request, all under A's or B's token"
    );
    // Every other allocation under B's token or a later one (an allocator takes the lease anew,
    // with a higher token, after it lapsed while the signer waited for its in-flight budget).
    let later: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tx_events WHERE type = 'TxAllocated'
           AND (payload->>'fencing_token')::bigint >= $1",
    )
    .bind(token_b)
    .fetch_one(&p.db.pool)
    .await
    .expect("count");
    assert_eq!(allocations_under(&p, token_a).await + later, 300);
    assert_eq!(
        p.count("SELECT count(DISTINCT nonce) FROM managed_tx WHERE nonce IS NOT NULL")
            .await,
        300,
        "(signer, nonce) unique"
    );
    // The lease B took, or one taken anew after it lapsed while the signer waited for its
    // in-flight budget — by B, or by A after it woke up (a new lease, a new token: its stale
    // transaction never landed, asserted above).
    let (_, token_now) = lease(&p).await.expect("the allocator lease");
    assert!(
        token_now >= token_b,
        "the lease's token {token_now} < B's {token_b}"
    );
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string()),
        "nothing left in anvil's pool"
    );
    let mut a = a;
    assert!(a.running(), "A survived being fenced:\n{}", a.log_tail());
    drop(b);
    p.stop().await;
}
