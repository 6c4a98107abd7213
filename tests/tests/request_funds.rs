//! One request's problem stays its own (issue 12 point 5): a request whose value the signer cannot
//! pay is held alone — RECEIVED, no nonce, its reason on its row, simulated again with a back-off
//! — while the signer's other requests simulate, allocate and mine; once the signer is funded, the
//! held request mines too. Outcomes are read on the chain (anvil) and in PostgreSQL.

use std::time::Duration;

use alloy::primitives::U256;
use alloy::providers::ext::AnvilApi;
use txflow_tests::pipeline::Pipeline;
use txflow_tests::wait_until;

const LONG: Duration = Duration::from_secs(180);

/// The held request's row: (state, nonce, hold_reason, hold_attempts).
type HeldRow = (String, Option<i64>, Option<String>, i32);

async fn row_of(p: &Pipeline, request_id: &str) -> Option<HeldRow> {
    sqlx::query_as(
        "SELECT state, nonce, hold_reason, hold_attempts FROM managed_tx WHERE request_id = $1",
    )
    .bind(request_id)
    .fetch_optional(&p.db.pool)
    .await
    .expect("query")
}

#[tokio::test]
async fn a_request_whose_value_exceeds_the_balance_is_held_alone_and_mines_once_funded() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let me = p.signers[0].address();
    // A modest balance: plenty for the normal requests' gas, not for the big one's value.
    let balance = U256::from(10u128.pow(18));
    p.provider()
        .anvil_set_balance(me, balance)
        .await
        .expect("a modest balance");
    let config = p.config.clone();
    p.start_stages(&config).await;

    let before: Vec<String> = (0..3).map(|i| format!("before-{i}")).collect();
    let after: Vec<String> = (0..3).map(|i| format!("after-{i}")).collect();
    for id in &before {
        p.send(&p.request(0, id)).await;
    }
    let mut big = p.request(0, "big");
    big.value = (balance * U256::from(2)).to_string();
    p.send(&big).await;
    for id in &after {
        p.send(&p.request(0, id)).await;
    }
    let normal: Vec<&String> = before.iter().chain(&after).collect();

    wait_until("the six normal requests mine", LONG, || async {
        let mined = p.mined_markers().await;
        normal
            .iter()
            .all(|id| mined.contains_key(&format!("txflow:{id}")))
    })
    .await;
    wait_until("the big request is held", LONG, || async {
        row_of(&p, "big")
            .await
            .is_some_and(|(_, _, reason, _)| reason.is_some())
    })
    .await;
    let markers = p.mined_markers().await;
    for id in &normal {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{id} mined exactly once: {markers:?}"
        );
    }
    assert_eq!(markers.get("txflow:big"), None, "not mined: {markers:?}");
    let (state, nonce, reason, attempts) = row_of(&p, "big").await.expect("the big request");
    assert_eq!(state, "RECEIVED", "held, not failed, not allocated");
    assert_eq!(nonce, None, "no nonce taken for it");
    let reason = reason.expect("its reason is recorded");
    assert!(
        reason.to_lowercase().contains("insufficient funds"),
        "{reason}"
    );
    assert!(attempts >= 1, "{attempts}");
    assert_eq!(
        p.count("SELECT count(*) FROM signer_holds").await,
        0,
        "the signer is not held"
    );
    // No nonce was consumed for it: the six normal requests took 0..=5, nothing was recycled,
    // and the chain's nonce is 6.
    assert_eq!(
        p.count(
            "SELECT count(*) FROM managed_tx WHERE request_id <> 'big' AND nonce BETWEEN 0 AND 5"
        )
        .await,
        6
    );
    assert_eq!(p.count("SELECT count(*) FROM recycled_nonces").await, 0);
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED'")
            .await,
        0
    );
    assert_eq!(p.mined_count().await, 6);

    // It is simulated again by later scans, with a back-off (not on every 5 s scan).
    wait_until("the big request is simulated again", LONG, || async {
        row_of(&p, "big")
            .await
            .is_some_and(|(_, _, _, attempts)| attempts >= 2)
    })
    .await;
    assert_eq!(
        p.count(
            "SELECT count(*) FROM managed_tx WHERE request_id = 'big' AND state = 'RECEIVED'
               AND hold_retry_at - held_since >= interval '10 seconds'"
        )
        .await,
        1,
        "the next simulation waits out the back-off"
    );
    assert_eq!(p.count("SELECT count(*) FROM signer_holds").await, 0);

    p.provider()
        .anvil_set_balance(me, U256::from(10u128.pow(21)))
        .await
        .expect("fund");
    wait_until("the big request mines", LONG, || async {
        p.mined_markers().await.contains_key("txflow:big")
    })
    .await;
    let markers = p.mined_markers().await;
    assert_eq!(markers.get("txflow:big"), Some(&1), "{markers:?}");
    for id in &normal {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{markers:?}"
        );
    }
    assert_eq!(p.mined_count().await, 7);
    wait_until("the big request's row records it mined", LONG, || async {
        row_of(&p, "big")
            .await
            .is_some_and(|(state, nonce, reason, _)| {
                state != "RECEIVED" && nonce == Some(6) && reason.is_none()
            })
    })
    .await;
    assert_eq!(p.count("SELECT count(*) FROM signer_holds").await, 0);
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED'")
            .await,
        0
    );
    p.stop().await;
}
