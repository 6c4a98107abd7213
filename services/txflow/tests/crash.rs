//! Crash recovery of the pipeline (issues 6 and 14): `txflow allocator`, `signer-gateway`,
//! `broadcaster`, `receipt-checker` and `confirmation-manager` run as processes of the test's own,
//! each under a supervisor that restarts it when it dies. Every run of a stage aborts (as `kill -9`
//! would: no destructors, no flush) at the next fault point of its schedule, and the test also
//! `kill -9`s each stage once from outside. 500 requests over 4 signers; afterwards every request
//! has exactly one mined transaction and is CONFIRMED with one TxConfirmed, nothing is left in
//! anvil's pool, `(signer, nonce)` is unique in PostgreSQL and every announced event recorded in
//! `tx_events` is on its topic (the outbox, issue 12 point 4).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::Supervised;
use txflow_tests::pipeline::Pipeline;
use txflow_tests::wait_until;

const LONG: Duration = Duration::from_secs(600);
const SIGNERS: usize = 4;
const REQUESTS: usize = 500;

#[tokio::test]
async fn every_request_mines_exactly_once_while_each_stage_is_killed_at_each_fault_point() {
    let p = Pipeline::prepare(SIGNERS, |_| {}).await;
    let env = p.env();
    let mut signer_env = env.clone();
    signer_env.push(p.signer_keys_env());

    // The points each stage surely reaches come first; the ones that depend on timing (a batch
    // with several signers, a recovery drive with outputs) last.
    let allocator = Supervised::start(
        "allocator",
        env.clone(),
        &[
            "stage.after_commit@2",
            "allocator.before_commit@2",
            "stage.after_call@3",
            "stage.after_produce@2",
            "stage.mid_batch@2",
            "stage.after_drive@1",
        ],
    );
    let signer = Supervised::start(
        "signer-gateway",
        signer_env,
        &[
            "stage.after_commit@2",
            "stage.after_produce@2",
            "stage.mid_batch@2",
            "stage.after_drive@1",
        ],
    );
    let broadcaster = Supervised::start(
        "broadcaster",
        env.clone(),
        &[
            "stage.after_commit@2",
            "stage.after_call@2",
            "stage.after_produce@2",
            "stage.mid_batch@2",
            "stage.after_drive@1",
        ],
    );

    // Finality (issue 14): the receipt checker and the confirmation manager, killed the same way.
    let receipts = Supervised::start(
        "receipt-checker",
        env.clone(),
        &[
            "stage.after_commit@2",
            "stage.after_produce@2",
            "stage.after_drive@2",
            "stage.mid_batch@2",
        ],
    );
    let confirmations = Supervised::start(
        "confirmation-manager",
        env,
        &[
            "stage.after_commit@2",
            "stage.after_produce@2",
            "stage.after_drive@3",
            "stage.mid_batch@2",
        ],
    );

    // 25 requests at a time, each chunk recorded before the next is sent, so that the run lasts
    // through the crashes and restarts.
    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| p.request(i % SIGNERS, &format!("c-{i}")))
        .collect();
    for (n, chunk) in requests.chunks(25).enumerate() {
        futures::future::join_all(chunk.iter().map(|r| p.send(r))).await;
        let sent = ((n + 1) * 25) as i64;
        wait_until("the chunk is recorded", LONG, || async {
            p.count("SELECT count(*) FROM managed_tx").await >= sent
        })
        .await;
        if n == 10 {
            allocator.kill_9().await;
            signer.kill_9().await;
            broadcaster.kill_9().await;
            receipts.kill_9().await;
            confirmations.kill_9().await;
        }
    }
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= REQUESTS as u64
    })
    .await;

    // Every request followed to finality: the receipt checker records the receipt of each
    // transaction (also one mined while its broadcaster was down), the confirmation manager
    // confirms it after the required confirmations.
    wait_until("every request is recorded CONFIRMED", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state <> 'CONFIRMED'")
            .await
            == 0
    })
    .await;
    assert_eq!(
        p.count("SELECT count(DISTINCT tx_id) FROM tx_events WHERE type = 'TxConfirmed'")
            .await,
        REQUESTS as i64,
        "one TxConfirmed per transaction"
    );
    assert_eq!(
        p.count(
            "SELECT count(*) FROM (SELECT tx_id FROM tx_events WHERE type = 'TxConfirmed'
             GROUP BY tx_id HAVING count(*) > 1) d"
        )
        .await,
        0,
        "no second TxConfirmed event_id for one transaction"
    );
    // The outbox: every announced event recorded in tx_events is on its topic, also those of a
    // drive or a batch whose process died between the commit and the acknowledgement
    // (stage.after_drive, stage.after_commit), relayed by the recovery scan.
    let missing = p
        .announced_events_missing_from_topics(Duration::from_secs(120))
        .await;
    assert!(
        missing.is_empty(),
        "{} recorded events are not on their topic: {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    wait_until("every recorded event is marked published", LONG, || async {
        p.count("SELECT count(*) FROM tx_outbox").await == 0
    })
    .await;
    let mut crashes = BTreeMap::new();
    for s in [allocator, signer, broadcaster, receipts, confirmations] {
        let role = s.role;
        crashes.insert(role, s.finish().await);
    }
    eprintln!("crashes per stage: {crashes:#?}");

    let markers = p.mined_markers().await;
    for r in &requests {
        assert_eq!(
            markers.get(&format!("txflow:{}", r.request_id)),
            Some(&1),
            "{} has exactly one mined transaction",
            r.request_id
        );
    }
    assert_eq!(
        p.count(
            "SELECT count(*) FROM (SELECT signer, nonce FROM managed_tx WHERE nonce IS NOT NULL
             AND state NOT IN ('FAILED', 'REPLACED') GROUP BY signer, nonce HAVING count(*) > 1) d"
        )
        .await,
        0,
        "(signer, nonce) unique"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts").await,
        REQUESTS as i64,
        "one signed attempt per request: a persisted attempt is sent again, never signed again"
    );
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string()),
        "nothing left in anvil's pool"
    );
    for (role, sure) in [
        (
            "allocator",
            &[
                "stage.after_commit@2",
                "allocator.before_commit@2",
                "stage.after_call@3",
                "stage.after_produce@2",
            ][..],
        ),
        (
            "signer-gateway",
            &["stage.after_commit@2", "stage.after_produce@2"][..],
        ),
        (
            "broadcaster",
            &[
                "stage.after_commit@2",
                "stage.after_call@2",
                "stage.after_produce@2",
            ][..],
        ),
        (
            "receipt-checker",
            &[
                "stage.after_commit@2",
                "stage.after_produce@2",
                "stage.after_drive@2",
            ][..],
        ),
        (
            "confirmation-manager",
            &[
                "stage.after_commit@2",
                "stage.after_produce@2",
                "stage.after_drive@3",
            ][..],
        ),
    ] {
        let got = &crashes[role];
        for point in sure {
            assert!(
                got.iter().any(|c| c == point),
                "{role} crashed at {point}: {got:?}"
            );
        }
        assert!(
            !got.iter()
                .any(|c| c.starts_with("signal") || c.starts_with("exit")),
            "{role} died only where the test made it: {got:?}"
        );
        assert!(
            got.iter().any(|c| c == "kill -9"),
            "{role} was killed from outside: {got:?}"
        );
    }
    p.stop().await;
}
