//! The request-to-chain pipeline behind a failing JSON-RPC endpoint (issue 6): HTTP 5xx and 429,
//! answers later than the client's timeout, dropped connections, rate-limit errors on every
//! method, and `eth_sendRawTransaction` answers lost after the node took the transaction; and two
//! endpoints of which one is dead. No request is lost and none is mined twice (checked on the
//! chain, by marker), and the proxy's own counts show the faults really happened.

use std::time::Duration;

use txflow_tests::fault_proxy::{Fault, FaultProxy, Rule};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{show_logs, wait_until};

const LONG: Duration = Duration::from_secs(480);

async fn check_every_request_mined_once(p: &Pipeline, ids: &[String]) {
    let markers = p.mined_markers().await;
    for id in ids {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{id} has exactly one mined transaction: {markers:?}"
        );
    }
    assert_eq!(markers.len(), ids.len(), "nothing else was mined");
    assert_eq!(
        p.count(
            "SELECT count(*) FROM (SELECT signer, nonce FROM managed_tx WHERE nonce IS NOT NULL
             GROUP BY signer, nonce HAVING count(*) > 1) d"
        )
        .await,
        0,
        "(signer, nonce) unique"
    );
    assert_eq!(
        p.pool_status().await,
        ("0x0".to_string(), "0x0".to_string())
    );
}

#[tokio::test]
async fn failures_on_every_rpc_method_and_lost_send_answers_lose_nothing_and_duplicate_nothing() {
    show_logs();
    let mut p = Pipeline::prepare(3, |_| {}).await;
    let delay = Duration::from_millis(1500);
    // Out of every twenty calls of each method: the 1st fails with 503, the 3rd with 429, the 5th
    // gets its answer after the client's timeout, the 7th has its connection dropped, the 9th
    // gets "limit exceeded"; and the 2nd send of every ten reaches the node, whose answer is then
    // lost. Never more than three failures in a row, so a call's four rounds always get through
    // in the end: what is tested is that nothing is lost or duplicated.
    let proxy = p
        .behind_proxy(vec![
            Rule::on("eth_sendRawTransaction", 10, Fault::ForwardThenLose).offset(2),
            Rule::all(20, Fault::Status(503)).offset(1),
            Rule::all(20, Fault::Status(429)).offset(3),
            Rule::all(20, Fault::Delay(delay)).offset(5),
            Rule::all(20, Fault::Reset).offset(7),
            Rule::all(
                20,
                Fault::RpcError {
                    code: -32005,
                    message: "limit exceeded".into(),
                },
            )
            .offset(9),
        ])
        .await;
    // Shorter than the injected delay: a delayed answer is a timeout to the client.
    p.config.rpc_timeout_ms = 1000;
    let config = p.config.clone();
    p.start_stages(&config).await;

    let ids: Vec<String> = (0..30).map(|i| format!("rpc-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        p.send(&p.request(i % 3, id)).await;
    }
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= ids.len() as u64
    })
    .await;
    check_every_request_mined_once(&p, &ids).await;
    // A transaction mined before its send was answered is recorded SUBMITTED by a later send
    // ("nonce too low" for a hash the chain knows); none fails.
    wait_until("every request is recorded SUBMITTED", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state <> 'SUBMITTED'")
            .await
            == 0
    })
    .await;

    let calls = proxy.calls();
    let faults = proxy.faults();
    eprintln!("calls: {calls:?}\nfaults: {faults:?}");
    for (method, n) in &calls {
        if *n >= 10 {
            assert!(
                faults.keys().any(|(m, _)| m == method),
                "{method} ({n} calls) saw faults: {faults:?}"
            );
        }
    }
    for method in [
        "eth_estimateGas",
        "eth_getTransactionCount",
        "eth_sendRawTransaction",
    ] {
        assert!(calls.get(method).is_some_and(|n| *n >= 3), "{calls:?}");
    }
    assert!(
        faults
            .get(&("eth_sendRawTransaction".to_string(), "forward_then_lose"))
            .is_some_and(|n| *n >= 3),
        "sends were lost after the node took them: {faults:?}"
    );
    for kind in ["status", "delay", "reset", "rpc_error"] {
        assert!(
            faults.keys().any(|(_, k)| *k == kind),
            "{kind} was injected: {faults:?}"
        );
    }
    p.stop().await;
}

#[tokio::test]
async fn with_one_of_two_endpoints_dead_the_traffic_goes_to_the_other() {
    let mut p = Pipeline::prepare(2, |_| {}).await;
    // The first endpoint drops every connection; the second is fine.
    let dead = FaultProxy::start(&p.anvil.url, vec![Rule::all(1, Fault::Reset)])
        .await
        .expect("start the fault proxy");
    let good = FaultProxy::start(&p.anvil.url, vec![])
        .await
        .expect("start the fault proxy");
    p.config.rpc_urls = vec![dead.url.clone(), good.url.clone()];
    let config = p.config.clone();
    p.start_stages(&config).await;

    // A first request: every stage's first calls go to the dead endpoint, all at once, before
    // any has failed.
    p.send(&p.request(0, "warm-up")).await;
    wait_until("the first request is mined", LONG, || async {
        p.mined_count().await >= 1
    })
    .await;
    let (dead_before, good_before) = (dead.total_calls(), good.total_calls());

    let ids: Vec<String> = (0..30).map(|i| format!("two-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        p.send(&p.request(i % 2, id)).await;
    }
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await > ids.len() as u64
    })
    .await;
    let mut all = ids.clone();
    all.push("warm-up".into());
    check_every_request_mined_once(&p, &all).await;

    let to_dead = dead.total_calls() - dead_before;
    let to_good = good.total_calls() - good_before;
    eprintln!(
        "before the run: {dead_before} calls to the dead endpoint, {good_before} to the good one; \
         during it: {to_dead} and {to_good}"
    );
    assert!(
        to_good >= 2 * ids.len() as u64,
        "the good endpoint carried the work: {to_good}"
    );
    // Once it has failed, the dead endpoint gets one probe per pause (1, 2, 4, … s) from each of
    // the two stages that call the chain, never the work.
    assert!(
        to_dead <= 10,
        "the dead endpoint is passed over: {to_dead} calls during the run (good: {to_good})"
    );
    p.stop().await;
}

#[tokio::test]
async fn an_unknown_error_of_the_simulation_is_retried_never_a_failure() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    // Every simulation fails with an error that says nothing about the call: an internal error,
    // and a server error of a wording no row of the table knows.
    let proxy = p
        .behind_proxy(vec![
            Rule::on(
                "eth_estimateGas",
                2,
                Fault::RpcError {
                    code: -32603,
                    message: "internal error".into(),
                },
            ),
            Rule::on(
                "eth_estimateGas",
                2,
                Fault::RpcError {
                    code: -32000,
                    message: "header not found".into(),
                },
            )
            .offset(1),
        ])
        .await;
    let config = p.config.clone();
    p.start_stages(&config).await;
    let ids: Vec<String> = (0..2).map(|i| format!("unknown-{i}")).collect();
    for id in &ids {
        p.send(&p.request(0, id)).await;
    }
    let failed = |kind: &'static str| {
        proxy
            .faults()
            .get(&("eth_estimateGas".to_string(), kind))
            .copied()
            .unwrap_or(0)
    };
    // Until the simulations failed several times, or (the defect) a request failed at once.
    wait_until("the simulations failed several times", LONG, || async {
        failed("rpc_error") >= 6
            || p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED'")
                .await
                > 0
    })
    .await;
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'FAILED'")
            .await,
        0,
        "an unknown error fails no request"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'RECEIVED'")
            .await,
        ids.len() as i64,
        "they wait, holding no nonce"
    );
    // The node answers again: each request goes on and is mined once.
    proxy.set_rules(Vec::new());
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= ids.len() as u64
    })
    .await;
    check_every_request_mined_once(&p, &ids).await;
    p.stop().await;
}
