//! `txflow demo`: the pipeline end to end on the local infrastructure. A few hundred requests from
//! several signers; one above the approval threshold (approved by the demo once the rest is
//! mined), one that reverts in simulation. Ends with a table of outcomes per signer.
//!
//! Then internal transfers ([`crate::demo_transfers`]): the spot ledger, the transfer coordinator
//! and the gateway as child processes, three users' transfers over the HTTP API — two COMMITTED,
//! one into a frozen spot account ROLLED_BACK, one that waits in TARGET_PENDING while the spot
//! ledger is killed and commits once it is back — and a table of them with the balances.

use std::time::{Duration, Instant};

use alloy::network::TransactionBuilder;
use alloy::providers::Provider;
use txflow_core::config::Config;
use txflow_core::events::{TxCommand, TxCommandKind};
use txflow_core::kafka::{Topics, delete_topics};
use txflow_core::state::TxState;

use crate::local::{BlockNudge, LocalPipeline, SINK};

const SIGNERS: usize = 5;
const PER_SIGNER: usize = 60;
const ONE_ETH: &str = "1000000000000000000";

pub async fn run(config: &Config) -> anyhow::Result<()> {
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let mut config = config.clone();
    config.topics = Topics::new(format!("{}.demo-{run}", config.topics.prefix));
    config.policy_approval_threshold_wei = Some(ONE_ETH.into());
    println!(
        "txflow demo: {SIGNERS} signers x {PER_SIGNER} requests, approval threshold 1 ETH, topics {}.*",
        config.topics.prefix
    );
    let p = LocalPipeline::start(config.clone(), SIGNERS).await?;

    // A contract that always reverts (PUSH1 0 PUSH1 0 REVERT), to show a failed simulation.
    let accounts = p.provider.get_accounts().await?;
    let deployer = accounts
        .first()
        .ok_or_else(|| anyhow::anyhow!("the chain has no unlocked account to deploy with"))?;
    let init = hex::decode("6460006000fd6000526005601bf3")?;
    let deploy = alloy::rpc::types::TransactionRequest::default()
        .from(*deployer)
        .with_deploy_code(init);
    let receipt = p
        .provider
        .send_transaction(deploy)
        .await?
        .get_receipt()
        .await?;
    let reverter = receipt
        .contract_address
        .ok_or_else(|| anyhow::anyhow!("the reverting contract was not created"))?;

    let mut requests = Vec::new();
    for i in 0..SIGNERS {
        for j in 0..PER_SIGNER {
            requests.push(p.request(i, &format!("demo-{run}-{i}-{j}"), SINK, "1000"));
        }
    }
    let big = p.request(0, &format!("demo-{run}-big"), SINK, "2000000000000000000");
    let reverting = p.request(
        1,
        &format!("demo-{run}-reverts"),
        &format!("{reverter:#x}"),
        "0",
    );
    requests.insert(10, big.clone());
    requests.insert(20, reverting.clone());
    let started = Instant::now();
    for chunk in requests.chunks(100) {
        for r in futures::future::join_all(chunk.iter().map(|r| p.send(r))).await {
            r?;
        }
    }
    let expected_mined = (SIGNERS * PER_SIGNER) as u64;
    let bar = indicatif::ProgressBar::new(expected_mined + 1);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} mined {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let deadline = started + Duration::from_secs(300);
    bar.set_message("(the 2 ETH request waits for approval)");
    while p.mined().await? < expected_mined {
        anyhow::ensure!(
            Instant::now() < deadline,
            "not everything was mined within 300 s"
        );
        bar.set_position(p.mined().await?);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bar.set_position(expected_mined);

    // Approve the big one, as an operator would.
    let pool = txflow_core::db::connect(&config.database_url, 2).await?;
    let (tx_id,): (String,) =
        sqlx::query_as("SELECT tx_id::text FROM managed_tx WHERE request_id = $1")
            .bind(&big.request_id)
            .fetch_one(&pool)
            .await?;
    bar.set_message(format!("(approving {tx_id})"));
    p.command(&TxCommand {
        event_id: uuid::Uuid::new_v4().to_string(),
        tx_id,
        chain_id: config.chain_id,
        signer: p.signer(0),
        command: TxCommandKind::Approve,
        requested_by: "txflow demo".into(),
        reason: Some("demonstration".into()),
    })
    .await?;
    while p.mined().await? < expected_mined + 1 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the approved request was not mined within 300 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bar.set_position(expected_mined + 1);
    bar.finish_with_message(format!("in {:.1} s", started.elapsed().as_secs_f64()));

    // Followed to finality: every mined request CONFIRMED after its required confirmations.
    let confirmed = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM managed_tx WHERE request_id LIKE $1 AND state = $2",
        )
        .bind(format!("demo-{run}-%"))
        .bind(TxState::Confirmed.as_str())
        .fetch_one(&pool)
        .await
    };
    // The confirmations need blocks after the last transaction (see `BlockNudge`).
    let wait_started = Instant::now();
    let mut blocks = BlockNudge::new();
    while (confirmed().await? as u64) < expected_mined + 1 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "not everything was confirmed within 300 s"
        );
        blocks.tick(&p.provider).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "confirmed ({} confirmations each) {:.1} s after the last was mined{}",
        config.confirmations_required,
        wait_started.elapsed().as_secs_f64(),
        match blocks.mined {
            0 => String::new(),
            n => format!(" ({n} block(s) mined by the demo)"),
        }
    );

    // What a downstream team books from tx.outcomes (txflow-client's OutcomeReader, the documented
    // contract): every confirmed request booked once.
    let mut reader = txflow_client::OutcomeReader::open(
        &crate::local::client_settings(&config),
        txflow_client::ReadOptions::default(),
    )
    .await?;
    let booked_of = |reader: &txflow_client::OutcomeReader, signer: &str| {
        reader
            .book()
            .views()
            .filter(|v| v.signer.eq_ignore_ascii_case(signer) && v.booked.is_some())
            .count() as u64
    };
    let booked_total = |reader: &txflow_client::OutcomeReader| {
        reader.book().views().filter(|v| v.booked.is_some()).count() as u64
    };
    while booked_total(&reader) < expected_mined + 1 {
        anyhow::ensure!(
            Instant::now() < deadline + Duration::from_secs(60),
            "tx.outcomes did not book every confirmed request: {} of {}",
            booked_total(&reader),
            expected_mined + 1
        );
        reader.poll(Duration::from_millis(500)).await?;
    }

    // Outcomes per signer, from PostgreSQL, next to what downstream booked and what the chain
    // says.
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT signer, state, count(*) FROM managed_tx WHERE request_id LIKE $1 GROUP BY signer, state ORDER BY signer, state",
    )
    .bind(format!("demo-{run}-%"))
    .fetch_all(&pool)
    .await?;
    println!(
        "\n{:<44} {:>9} {:>9} {:>7} {:>7} {:>11}",
        "signer", "in flight", "confirmed", "booked", "failed", "on chain"
    );
    for i in 0..SIGNERS {
        let s = p.signer(i);
        let count = |state: TxState| {
            rows.iter()
                .filter(|r| r.0 == s && r.1 == state.as_str())
                .map(|r| r.2)
                .sum::<i64>()
        };
        let on_chain = p
            .provider
            .get_transaction_count(p.signers[i].address())
            .latest()
            .await?;
        println!(
            "{s:<44} {:>9} {:>9} {:>7} {:>7} {:>11}",
            count(TxState::Submitted) + count(TxState::Mined),
            count(TxState::Confirmed),
            booked_of(&reader, &s),
            count(TxState::Failed),
            on_chain
        );
    }
    // Closed before the topics go: a consumer whose topics are deleted under it can crash
    // librdkafka (issue #5280).
    drop(reader);
    let failures: Vec<(String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT request_id, failure_code, failure_reason FROM managed_tx WHERE request_id LIKE $1 AND state = $2",
    )
    .bind(format!("demo-{run}-%"))
    .bind(TxState::Failed.as_str())
    .fetch_all(&pool)
    .await?;
    for (id, code, reason) in failures {
        println!(
            "failed: {id}: {} ({})",
            code.unwrap_or_default(),
            reason.unwrap_or_default()
        );
    }
    let markers = p.mined_markers().await?;
    let duplicates: usize = markers.values().map(|c| c - 1).sum();
    println!(
        "\nmined transactions per request marker: {} markers, {duplicates} duplicates",
        markers.len()
    );
    p.stop().await?;
    let transfers = crate::demo_transfers::run(&config, &run).await;
    if transfers.is_ok() {
        println!(
            "\nwhere to look next:\n  psql {} -c \"SELECT state, count(*) FROM managed_tx GROUP BY state\"\n  topics {}.tx.* and {}.dlq on {}\n  txflow bench --signers 50 --txs 40   (throughput and latency)",
            txflow_core::config::redact_database_url(&config.database_url),
            config.topics.prefix,
            config.topics.prefix,
            config.kafka.brokers
        );
    }
    let mut topics = config.topics.all();
    topics.extend(config.topics.transfers());
    topics.sort();
    topics.dedup();
    delete_topics(&config.kafka, &topics).await?;
    transfers
}
