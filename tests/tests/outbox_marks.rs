//! The outbox marks of a stage runtime (issue 15), against real PostgreSQL: a produce hands the
//! ids the broker acknowledged to the runtime's `MarkQueue`, and one task deletes their
//! `tx_outbox` rows, many produces' at once. Nothing queued may be lost: every mark handed over
//! while the task runs is written, the ones still queued when it is stopped are written before it
//! returns, a mark made while no task runs is written at once, and rows never marked stay (the
//! relay's work).

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use txflow_core::outbox::MarkQueue;
use txflow_tests::TestDb;
use txflow_tests::wait_until;
use uuid::Uuid;

/// Inserts `n` outbox rows of one signer; returns their event ids.
async fn outbox_rows(pool: &PgPool, n: usize) -> Vec<Uuid> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    let txs: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    sqlx::query(
        "INSERT INTO tx_outbox (event_id, tx_id, chain_id, signer, type)
         SELECT e, t, 31337, '0x00000000000000000000000000000000000000aa', 'TxSubmitted'
         FROM unnest($1::uuid[], $2::uuid[]) AS u(e, t)",
    )
    .bind(&ids)
    .bind(&txs)
    .execute(pool)
    .await
    .expect("insert outbox rows");
    ids
}

/// How many of `ids` still have their outbox row.
async fn remaining(pool: &PgPool, ids: &[Uuid]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM tx_outbox WHERE event_id = ANY($1)")
        .bind(ids)
        .fetch_one(pool)
        .await
        .expect("count outbox rows")
}

#[tokio::test]
async fn every_queued_mark_is_written_while_flushing_and_the_rest_when_the_flushing_stops() {
    let db = TestDb::new().await;
    let pool = db.pool.clone();
    let ids = outbox_rows(&pool, 3_000).await;
    let (direct, rest) = ids.split_at(10);
    let (concurrent, rest) = rest.split_at(2_000);
    let (at_stop, never) = rest.split_at(rest.len() - 5);
    let queue = Arc::new(MarkQueue::default());

    // No flushing task: the mark is written before `mark` returns.
    queue.mark(&pool, direct.to_vec()).await;
    assert_eq!(remaining(&pool, direct).await, 0, "marked with no task");
    assert_eq!(
        remaining(&pool, &ids[10..]).await,
        2_990,
        "only the marked rows go"
    );

    // A flushing task, and marks from many producers at once (as the drives of a batch).
    let stop = CancellationToken::new();
    let flushing = tokio::spawn({
        let (queue, pool, stop) = (queue.clone(), pool.clone(), stop.clone());
        async move { queue.flush(pool, stop).await }
    });
    let mut producers = Vec::new();
    for chunk in concurrent.chunks(7) {
        let (queue, pool, chunk) = (queue.clone(), pool.clone(), chunk.to_vec());
        producers.push(tokio::spawn(async move { queue.mark(&pool, chunk).await }));
    }
    for p in producers {
        p.await.expect("a producer");
    }
    wait_until(
        "every concurrent mark written",
        Duration::from_secs(30),
        || async { remaining(&pool, concurrent).await == 0 },
    )
    .await;

    // Marks queued just before the task is told to stop are written before it returns.
    for chunk in at_stop.chunks(50) {
        queue.mark(&pool, chunk.to_vec()).await;
    }
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), flushing)
        .await
        .expect("the flushing task returns once stopped")
        .expect("the flushing task");
    assert_eq!(remaining(&pool, at_stop).await, 0, "queued at the stop");
    assert_eq!(
        remaining(&pool, never).await,
        5,
        "never marked: still to relay"
    );

    // Stopped: a mark is written at once again (the queue can be flushed by a later run).
    let late = outbox_rows(&pool, 3).await;
    queue.mark(&pool, late.clone()).await;
    assert_eq!(remaining(&pool, &late).await, 0, "marked after the stop");
}
