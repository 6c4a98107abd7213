//! Send errors no one recognises (issue 12, point 1): an `eth_sendRawTransaction` that the node
//! took but whose answer, as the client hears it, is an error no row of the classification table
//! knows. The transaction may be mined, so it must never be FAILED nor its nonce released: it
//! stays SIGNED, is sent again (the node then says "nonce too low" for a hash it knows) and is
//! recorded SUBMITTED; it is mined once and the next request takes the next nonce. Real
//! PostgreSQL, broker and anvil, with the JSON-RPC fault proxy in front of anvil.

use std::time::Duration;

use txflow_core::chain::SEND_ERRORS;
use txflow_tests::fault_proxy::{Fault, Rule};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{show_logs, wait_until};

const LONG: Duration = Duration::from_secs(180);

/// The proxy's answer to the first send: a wording of no client, known to no row.
const UNKNOWN_CODE: i64 = -32000;
const UNKNOWN_MESSAGE: &str = "upstream relay hiccup 7f3a, request id 42";

#[tokio::test]
async fn an_unknown_send_error_for_a_transaction_the_node_took_fails_nothing_and_reuses_no_nonce() {
    show_logs();
    // The premise: the proxy's wording is known to no row of the table (nor is its code a
    // rate-limit or internal-error code).
    let lower = UNKNOWN_MESSAGE.to_lowercase();
    assert!(
        !SEND_ERRORS.iter().any(|(s, _, _)| lower.contains(s)),
        "{UNKNOWN_MESSAGE:?} is known to a row"
    );
    assert!(![429, -32005, -32603].contains(&UNKNOWN_CODE));

    let mut p = Pipeline::prepare(1, |_| {}).await;
    // Every nonce ever released, kept even after the allocator takes it back out.
    for sql in [
        "CREATE TABLE released_log (chain_id BIGINT, signer TEXT, nonce BIGINT,
                                    at TIMESTAMPTZ NOT NULL DEFAULT now())",
        "CREATE FUNCTION log_released() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO released_log (chain_id, signer, nonce)
                 VALUES (NEW.chain_id, NEW.signer, NEW.nonce);
             RETURN NEW;
         END $$",
        "CREATE TRIGGER recycled_nonces_log AFTER INSERT ON recycled_nonces
         FOR EACH ROW EXECUTE FUNCTION log_released()",
    ] {
        sqlx::query(sql)
            .execute(&p.db.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    // The first send reaches anvil (which takes and mines it), then the client is told it
    // failed with a wording no one knows; every later call is passed through.
    let proxy = p
        .behind_proxy(vec![
            Rule::on(
                "eth_sendRawTransaction",
                1_000_000,
                Fault::ForwardThenError {
                    code: UNKNOWN_CODE,
                    message: UNKNOWN_MESSAGE.into(),
                },
            )
            .offset(1),
        ])
        .await;
    let config = p.config.clone();
    p.start_stages(&config).await;

    p.send(&p.request(0, "unknown-0")).await;
    wait_until("the first transaction is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;
    assert_eq!(
        proxy
            .faults()
            .get(&("eth_sendRawTransaction".to_string(), "forward_then_error")),
        Some(&1),
        "the first send was answered with the unknown error: {:?}",
        proxy.faults()
    );
    // Its send settles: SUBMITTED (sent again, "nonce too low" for a hash the chain knows), or
    // FAILED on the code as it was.
    wait_until("the first transaction's send is settled", LONG, || async {
        matches!(
            p.state_of("unknown-0").await.as_deref(),
            Some("SUBMITTED" | "MINED" | "CONFIRMED" | "FAILED" | "REPLACED")
        )
    })
    .await;
    let state = p.state_of("unknown-0").await;
    assert!(
        matches!(state.as_deref(), Some("SUBMITTED" | "MINED" | "CONFIRMED")),
        "a transaction the node may have taken is never failed nor replaced: {state:?}"
    );

    // A later request takes the next nonce.
    p.send(&p.request(0, "unknown-1")).await;
    wait_until("the second transaction is mined", LONG, || async {
        p.mined_count().await >= 2
    })
    .await;
    wait_until("the second transaction is recorded", LONG, || async {
        matches!(
            p.state_of("unknown-1").await.as_deref(),
            Some("SUBMITTED" | "MINED" | "CONFIRMED" | "FAILED" | "REPLACED")
        )
    })
    .await;

    let nonces = p.mined_nonces().await;
    assert_eq!(
        nonces.get("txflow:unknown-0"),
        Some(&vec![0]),
        "mined once, at nonce 0: {nonces:?}"
    );
    assert_eq!(
        nonces.get("txflow:unknown-1"),
        Some(&vec![1]),
        "the next request mined once, at the next nonce: {nonces:?}"
    );
    assert_eq!(nonces.len(), 2, "nothing else was mined: {nonces:?}");
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED'")
            .await,
        0,
        "no FAILED row"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxFailed'")
            .await,
        0,
        "no TxFailed"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM released_log").await,
        0,
        "no nonce was ever released to recycled_nonces"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE nonce_released")
            .await,
        0,
        "no transaction gave its nonce up"
    );
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT request_id, nonce FROM managed_tx ORDER BY request_id")
            .fetch_all(&p.db.pool)
            .await
            .expect("rows");
    assert_eq!(
        rows,
        vec![("unknown-0".to_string(), 0), ("unknown-1".to_string(), 1)]
    );
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string())
    );
    p.stop().await;
}
