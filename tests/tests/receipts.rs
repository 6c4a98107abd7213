//! The receipt checker (issue 14 point 1) against real PostgreSQL, broker and anvil: submitted
//! transactions become MINED (or REVERTED) with the receipt the chain has, checked field by field
//! against the chain; receipt lookups through the JSON-RPC fault proxy (5xx, 429, timeouts,
//! dropped connections, rate limits, "unknown" answers for mined transactions) change nothing
//! wrongly and lose nothing; a nonce used outside txflow while our transaction waited in the pool
//! is REPLACED on proof, re-allocated and mined once.

use std::collections::BTreeMap;
use std::time::Duration;

use alloy::network::{EthereumWallet, TransactionBuilder};
use alloy::primitives::{Address, B256, Bytes, U256};
use alloy::providers::ext::AnvilApi;
use alloy::providers::{Provider, ProviderBuilder};
use alloy::rpc::types::TransactionRequest;
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::message::Headers;
use txflow_core::events::{ReceiptStatus, TxReceiptUpdated};
use txflow_tests::fault_proxy::{Fault, FaultProxy, Rule};
use txflow_tests::pipeline::{Pipeline, SINK};
use txflow_tests::{AnvilNode, TestDb, group_consumer, show_logs, unique, wait_until};

const LONG: Duration = Duration::from_secs(240);

/// One transaction as PostgreSQL holds it after the receipt checker.
#[derive(Debug, Clone, sqlx::FromRow)]
struct Recorded {
    tx_id: uuid::Uuid,
    request_id: String,
    state: String,
    nonce: Option<i64>,
    receipt: Option<serde_json::Value>,
    mined_block_number: Option<i64>,
    mined_block_hash: Option<String>,
}

async fn recorded(p: &Pipeline) -> Vec<Recorded> {
    sqlx::query_as(
        "SELECT tx_id, request_id, state, nonce, receipt, mined_block_number, mined_block_hash
         FROM managed_tx ORDER BY request_id",
    )
    .fetch_all(&p.db.pool)
    .await
    .expect("managed_tx")
}

/// Sends a transfer from the pipeline's first signer at nonce 0 straight to the node (not
/// through txflow), and returns its hash; the caller mines it.
async fn send_outside_txflow(p: &Pipeline) -> B256 {
    let wallet = ProviderBuilder::new()
        .wallet(EthereumWallet::from(p.signers[0].clone()))
        .connect_http(p.anvil.url.parse().expect("url"));
    let outsider = TransactionRequest::default()
        .with_to(SINK.parse::<Address>().expect("sink"))
        .with_value(U256::from(7))
        .with_nonce(0)
        .with_chain_id(31337)
        .with_gas_limit(21_000)
        .with_max_fee_per_gas(10_000_000_000)
        .with_max_priority_fee_per_gas(1_000_000_000);
    *wallet
        .send_transaction(outsider)
        .await
        .expect("send outside txflow")
        .tx_hash()
}

async fn count_in(p: &Pipeline, states: &[&str]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM managed_tx WHERE state = ANY($1)")
        .bind(states)
        .fetch_one(&p.db.pool)
        .await
        .expect("count")
}

/// The hash of attempt `attempt` of transaction `tx_id`.
async fn attempt_hash(p: &Pipeline, tx_id: uuid::Uuid, attempt: i32) -> String {
    sqlx::query_scalar("SELECT tx_hash FROM tx_attempts WHERE tx_id = $1 AND attempt = $2")
        .bind(tx_id)
        .bind(attempt)
        .fetch_one(&p.db.pool)
        .await
        .expect("attempt")
}

/// Every recorded receipt is the chain's receipt of the recorded attempt: hash, block number and
/// hash, status (MINED ⇔ 1), gas used, effective gas price; `expect_reverted` names the requests
/// whose transaction must have reverted. Returns the rows by request id.
async fn check_receipts_against_the_chain(
    p: &Pipeline,
    expect_reverted: &[&str],
) -> BTreeMap<String, Recorded> {
    let provider = p.provider();
    let mut by_request = BTreeMap::new();
    for r in recorded(p).await {
        let receipt = r.receipt.clone().expect("a receipt is recorded");
        let attempt = receipt["attempt"].as_i64().expect("attempt") as i32;
        let hash = attempt_hash(p, r.tx_id, attempt).await;
        assert_eq!(receipt["tx_hash"], hash.as_str(), "{}", r.request_id);
        let on_chain = provider
            .get_transaction_receipt(hash.parse::<B256>().expect("hash"))
            .await
            .expect("receipt lookup")
            .unwrap_or_else(|| panic!("{}: the chain has no receipt for {hash}", r.request_id));
        let block_number = on_chain.block_number.expect("mined") as i64;
        let block_hash = format!("{:#x}", on_chain.block_hash.expect("mined"));
        assert_eq!(r.mined_block_number, Some(block_number), "{}", r.request_id);
        assert_eq!(receipt["block_number"], block_number, "{}", r.request_id);
        assert_eq!(r.mined_block_hash.as_deref(), Some(block_hash.as_str()));
        assert_eq!(receipt["block_hash"], block_hash.as_str());
        assert_eq!(receipt["gas_used"], on_chain.gas_used, "{}", r.request_id);
        assert_eq!(
            receipt["effective_gas_price"],
            on_chain.effective_gas_price.to_string(),
            "{}",
            r.request_id
        );
        let reverted = expect_reverted.contains(&r.request_id.as_str());
        assert_eq!(on_chain.status(), !reverted, "{}", r.request_id);
        assert_eq!(receipt["status"], i64::from(on_chain.status()));
        assert_eq!(
            r.state,
            if reverted { "REVERTED" } else { "MINED" },
            "{}",
            r.request_id
        );
        by_request.insert(r.request_id.clone(), r);
    }
    by_request
}

/// Each transaction has exactly one receipt audit row (TxMined or TxReverted), and its
/// TxReceiptUpdated is on the receipts topic with that row's `event_id`, saying what PostgreSQL
/// holds.
async fn check_receipt_events(p: &Pipeline, rows: &BTreeMap<String, Recorded>) {
    let audit: Vec<(uuid::Uuid, uuid::Uuid, String)> = sqlx::query_as(
        "SELECT tx_id, event_id, type FROM tx_events WHERE type IN ('TxMined', 'TxReverted')",
    )
    .fetch_all(&p.db.pool)
    .await
    .expect("receipt events");
    assert_eq!(audit.len(), rows.len(), "one receipt event per transaction");
    let missing = p.announced_events_missing_from_topics(LONG).await;
    assert!(missing.is_empty(), "not on their topic: {missing:?}");

    let consumer = group_consumer(&p.config.kafka, &unique("receipts"));
    consumer
        .subscribe(&[&p.config.topics.tx_receipts()])
        .expect("subscribe");
    let mut seen: BTreeMap<String, TxReceiptUpdated> = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + LONG;
    while seen.len() < audit.len() {
        let m = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("{} of {} receipt events", seen.len(), audit.len()))
            .expect("consume");
        let header = m.headers().and_then(|h| {
            h.iter()
                .find(|h| h.key == "event_id")
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        });
        let event: TxReceiptUpdated = p
            .codec
            .decode(m.payload().expect("payload"))
            .await
            .expect("a TxReceiptUpdated");
        assert_eq!(header.as_deref(), Some(event.event_id.as_str()));
        seen.insert(event.event_id.clone(), event);
    }
    for (tx_id, event_id, kind) in audit {
        let e = seen
            .get(&event_id.to_string())
            .unwrap_or_else(|| panic!("{kind} {event_id} is not on the receipts topic"));
        let r = rows
            .values()
            .find(|r| r.tx_id == tx_id)
            .expect("the event's transaction");
        assert_eq!(e.tx_id, tx_id.to_string());
        assert_eq!(Some(e.nonce), r.nonce);
        let want = match kind.as_str() {
            "TxMined" => ReceiptStatus::Mined,
            _ => ReceiptStatus::Reverted,
        };
        assert_eq!(e.status, want, "{}", r.request_id);
        assert_eq!(e.block_number, r.mined_block_number);
        assert_eq!(e.block_hash, r.mined_block_hash);
        let receipt = r.receipt.as_ref().expect("receipt");
        assert_eq!(e.tx_hash.as_deref(), receipt["tx_hash"].as_str());
        assert_eq!(e.gas_used, receipt["gas_used"].as_i64());
        assert_eq!(
            e.effective_gas_price.as_deref(),
            receipt["effective_gas_price"].as_str()
        );
    }
}

#[tokio::test]
async fn submitted_transactions_are_mined_or_reverted_with_the_receipt_the_chain_has() {
    show_logs();
    // No mining until the test says so: the receipt checker first finds no receipt.
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 2, |_| {}).await;
    let config = p.config.clone();
    p.start_stages(&config).await;
    p.start_receipt_checker(&config).await;

    // A destination without code: the simulation passes. Code that reverts is put there before
    // the block is mined, so its transaction is mined with status 0.
    let target: Address = "0x00000000000000000000000000000000000bad01"
        .parse()
        .expect("address");
    let mut ids: Vec<String> = (0..8).map(|i| format!("mined-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        p.send(&p.request(i % 2, id)).await;
    }
    let mut reverting = p.request(1, "reverts");
    reverting.to = format!("{target:#x}");
    reverting.value = "0".into();
    p.send(&reverting).await;
    ids.push("reverts".into());

    wait_until("every request is SUBMITTED", LONG, || async {
        count_in(&p, &["SUBMITTED"]).await == ids.len() as i64
    })
    .await;
    // The receipt checker looked them up, found no receipt, and scheduled the next lookup.
    wait_until("every submission was looked up", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE next_receipt_check_at IS NOT NULL")
            .await
            == ids.len() as i64
    })
    .await;
    assert_eq!(count_in(&p, &["MINED", "REVERTED", "REPLACED"]).await, 0);

    let provider = p.provider();
    provider
        .anvil_set_code(target, Bytes::from(reverts_with_error("nope")))
        .await
        .expect("anvil_setCode");
    provider.anvil_mine(Some(1), None).await.expect("mine");
    wait_until("every transaction has its receipt", LONG, || async {
        count_in(&p, &["MINED", "REVERTED"]).await == ids.len() as i64
    })
    .await;

    let rows = check_receipts_against_the_chain(&p, &["reverts"]).await;
    assert_eq!(rows.len(), ids.len());
    // Why it reverted, read from the chain: the contract's Error(string).
    for (id, r) in &rows {
        let reason = r
            .receipt
            .as_ref()
            .and_then(|x| x.get("revert_reason").cloned());
        if id == "reverts" {
            assert_eq!(reason, Some(serde_json::json!("Error(\"nope\")")), "{id}");
        } else {
            assert_eq!(reason, None, "{id} succeeded");
        }
    }
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE next_receipt_check_at IS NOT NULL")
            .await,
        0,
        "a recorded receipt ends the lookups"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts WHERE next_resubmit_at IS NOT NULL")
            .await,
        0,
        "and the resubmissions"
    );
    check_receipt_events(&p, &rows).await;
    let markers = p.mined_markers().await;
    for id in &ids {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{markers:?}"
        );
    }
    p.stop().await;
}

#[tokio::test]
async fn receipt_lookups_through_a_failing_endpoint_change_nothing_wrongly_and_lose_nothing() {
    show_logs();
    let mut p = Pipeline::prepare(2, |_| {}).await;
    let config = p.config.clone();
    p.start_stages(&config).await;

    // Only the receipt checker goes through the proxy. Out of every ten receipt lookups: 503,
    // 429, an answer after the client's timeout, a dropped connection, "limit exceeded", "no
    // receipt" (`null`) for a mined transaction, and an answer lost after the node gave it;
    // three get through.
    let delay = Duration::from_millis(1500);
    let method = "eth_getTransactionReceipt";
    let proxy = FaultProxy::start(
        &p.anvil.url,
        vec![
            Rule::on(method, 10, Fault::Status(503)).offset(1),
            Rule::on(method, 10, Fault::Status(429)).offset(2),
            Rule::on(method, 10, Fault::Delay(delay)).offset(3),
            Rule::on(method, 10, Fault::Reset).offset(4),
            Rule::on(
                method,
                10,
                Fault::RpcError {
                    code: -32005,
                    message: "limit exceeded".into(),
                },
            )
            .offset(5),
            Rule::on(method, 10, Fault::Result(serde_json::Value::Null)).offset(6),
            Rule::on(method, 10, Fault::ForwardThenLose).offset(7),
        ],
    )
    .await
    .expect("start the fault proxy");
    let mut receipts = config.clone();
    receipts.rpc_urls = vec![proxy.url.clone()];
    receipts.rpc_timeout_ms = 1000;
    // A mined transaction answered "no receipt" looks stale at once: only the chain's proof (the
    // block where the nonce passed holds our hash) keeps it from being REPLACED.
    receipts.stale_receipt_timeout_ms = 0;
    receipts.receipt_workers = 4;
    p.start_receipt_checker(&receipts).await;

    let ids: Vec<String> = (0..20).map(|i| format!("faulty-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        p.send(&p.request(i % 2, id)).await;
    }
    wait_until("every transaction has its receipt", LONG, || async {
        count_in(&p, &["MINED"]).await == ids.len() as i64
    })
    .await;
    assert_eq!(
        p.count(
            "SELECT count(*) FROM tx_events WHERE type IN ('TxReplaced', 'TxFailed', 'TxReverted')"
        )
        .await,
        0,
        "nothing replaced, failed or reverted"
    );
    let rows = check_receipts_against_the_chain(&p, &[]).await;
    check_receipt_events(&p, &rows).await;
    let markers = p.mined_markers().await;
    for id in &ids {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{markers:?}"
        );
    }

    let faults = proxy.faults();
    eprintln!("calls: {:?}\nfaults: {faults:?}", proxy.calls());
    for kind in [
        "status",
        "delay",
        "reset",
        "rpc_error",
        "result",
        "forward_then_lose",
    ] {
        assert!(
            faults.contains_key(&(method.to_string(), kind)),
            "{kind} was injected on {method}: {faults:?}"
        );
    }
    p.stop().await;
}

#[tokio::test]
async fn a_nonce_used_outside_txflow_while_submitted_is_replaced_then_reallocated_and_mined_once() {
    show_logs();
    // No mining until the test says so; no resubmission within the test (it would put our
    // transaction back into the pool).
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 1, |c| {
        c.stale_receipt_timeout_ms = 1000;
        c.resubmit_interval_ms = 600_000;
        // The block that uses the nonce is final with one more block.
        c.confirmations_required = 2;
    })
    .await;
    let config = p.config.clone();
    p.start_stages(&config).await;
    p.start_receipt_checker(&config).await;

    p.send(&p.request(0, "victim")).await;
    wait_until("the request is SUBMITTED", LONG, || async {
        count_in(&p, &["SUBMITTED"]).await == 1
    })
    .await;
    let victim = recorded(&p).await.remove(0);
    assert_eq!(victim.nonce, Some(0));
    let ours: B256 = attempt_hash(&p, victim.tx_id, 1)
        .await
        .parse()
        .expect("hash");

    // The node forgets our transaction, and someone uses nonce 0 straight on the chain.
    let provider = p.provider();
    provider
        .anvil_drop_transaction(ours)
        .await
        .expect("anvil_dropTransaction");
    let outsider = send_outside_txflow(&p).await;
    provider.anvil_mine(Some(1), None).await.expect("mine");
    assert!(
        provider
            .get_transaction_receipt(outsider)
            .await
            .expect("lookup")
            .is_some(),
        "the outsider is mined"
    );
    // Its block final (two confirmations).
    provider.anvil_mine(Some(1), None).await.expect("mine");

    // No receipt for our hash, the signer's nonce past ours for the stale timeout, and the final
    // block where it passed holds none of our hashes: REPLACED, re-allocated a fresh nonce, signed
    // again and submitted.
    wait_until(
        "the request is replaced and submitted again at a fresh nonce",
        LONG,
        || async {
            p.count(
                "SELECT count(*) FROM managed_tx m WHERE state = 'SUBMITTED' AND nonce = 1
                 AND (SELECT count(*) FROM tx_attempts a WHERE a.tx_id = m.tx_id) = 2",
            )
            .await
                == 1
        },
    )
    .await;
    let reason: String = sqlx::query_scalar(
        "SELECT payload->>'reason' FROM tx_events WHERE type = 'TxReplaced' AND tx_id = $1",
    )
    .bind(victim.tx_id)
    .fetch_one(&p.db.pool)
    .await
    .expect("one TxReplaced row");
    assert!(
        reason.contains("no receipt for any of its hashes"),
        "replaced by the receipt checker: {reason}"
    );

    provider.anvil_mine(Some(1), None).await.expect("mine");
    wait_until("the request is mined at its fresh nonce", LONG, || async {
        count_in(&p, &["MINED"]).await == 1
    })
    .await;
    let rows = check_receipts_against_the_chain(&p, &[]).await;
    let mined = &rows["victim"];
    assert_eq!(mined.nonce, Some(1));
    assert_eq!(
        mined.receipt.as_ref().expect("receipt")["attempt"],
        2,
        "the attempt signed at the fresh nonce"
    );
    assert_eq!(
        p.mined_markers().await.get("txflow:victim"),
        Some(&1),
        "mined once"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxReplaced'")
            .await,
        1
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts WHERE next_resubmit_at IS NOT NULL")
            .await,
        0,
        "neither attempt is sent again"
    );
    check_receipt_events(&p, &rows).await;
    p.stop().await;
}

/// The receipt columns are written by the move's own statement (`txstore::ReceiptWrite`): set
/// with MINE, kept by a move that does not name them, cleared to NULL by one that does (REORG,
/// as the confirmation manager writes it), which also resets the receipt checker's schedule.
#[tokio::test]
async fn a_move_sets_keeps_or_clears_the_receipt_columns_in_its_own_statement() {
    use txflow_core::domain::{ChainId, NodeId, Signer};
    use txflow_core::lease::{Acquisition, LeaseConfig, LeaseManager};
    use txflow_core::role::Role;
    use txflow_core::state::{MINE, Move, REORG, RESUBMIT};
    use txflow_core::txstore::{self, MinedReceipt, MoveRow, ReceiptWrite};

    let db = TestDb::new().await;
    let signer = "0x00000000000000000000000000000000000000aa";
    let tx_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state,
                                 next_receipt_check_at, receipt_stale_since)
         VALUES ($1, 31337, $2, 'r', 0, '{}'::jsonb, 'SUBMITTED', now(), now())",
    )
    .bind(tx_id)
    .bind(signer)
    .execute(&db.pool)
    .await
    .expect("a submitted row");
    let leases = LeaseManager::new(
        db.pool.clone(),
        Role::ReceiptChecker,
        NodeId::named(unique("receipts")),
        LeaseConfig::default(),
    )
    .expect("lease manager");
    let lease = match leases
        .acquire(ChainId(31337), &Signer::parse(signer).expect("signer"))
        .await
        .expect("acquire")
    {
        Acquisition::Held(l, _) => l,
        busy => panic!("{busy:?}"),
    };
    type Columns = (
        String,
        Option<serde_json::Value>,
        Option<i64>,
        Option<String>,
        bool,
        bool,
    );
    let columns = || async {
        sqlx::query_as::<_, Columns>(
            "SELECT state, receipt, mined_block_number, mined_block_hash,
                    next_receipt_check_at IS NULL, receipt_stale_since IS NULL
             FROM managed_tx WHERE tx_id = $1",
        )
        .bind(tx_id)
        .fetch_one(&db.pool)
        .await
        .expect("row")
    };
    let hash = format!("0x{}", "ab".repeat(32));
    // Applies `m` to the row with `receipt`, in a fenced transaction of its own.
    let apply = async |m: Move, receipt: ReceiptWrite| {
        let row = MoveRow {
            receipt,
            ..MoveRow::new(tx_id, uuid::Uuid::new_v4(), serde_json::json!({}))
        };
        let mut tx = lease.begin(&db.pool).await.expect("begin");
        txstore::apply_all(&mut tx.writer(), m, &[row])
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        tx.commit().await.expect("commit");
    };

    // A move that does not name them keeps them (and the schedule).
    apply(RESUBMIT, ReceiptWrite::Keep).await;
    assert_eq!(
        columns().await,
        ("SUBMITTED".into(), None, None, None, false, false)
    );

    let receipt = serde_json::json!({"attempt": 1, "block_number": 9});
    apply(
        MINE,
        ReceiptWrite::Set(MinedReceipt {
            receipt: receipt.clone(),
            block_number: 9,
            block_hash: hash.clone(),
        }),
    )
    .await;
    assert_eq!(
        columns().await,
        (
            "MINED".into(),
            Some(receipt),
            Some(9),
            Some(hash),
            true,
            true
        )
    );

    apply(REORG, ReceiptWrite::Clear).await;
    assert_eq!(
        columns().await,
        ("SUBMITTED".into(), None, None, None, true, true)
    );
}

/// The `tx_id`s of this process's `replacement_not_final` log events.
fn not_final_seen() -> &'static std::sync::Mutex<Vec<String>> {
    use std::sync::{Mutex, OnceLock};
    use tracing_subscriber::layer::SubscriberExt;
    static SEEN: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    SEEN.get_or_init(|| {
        let _ = tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(NotFinalRecorder),
        );
        Mutex::new(Vec::new())
    })
}

struct NotFinalRecorder;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for NotFinalRecorder {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        #[derive(Default)]
        struct Fields {
            event: Option<String>,
            tx_id: Option<String>,
        }
        impl tracing::field::Visit for Fields {
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                if f.name() == "event" {
                    self.event = Some(v.to_string());
                }
            }
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                let v = format!("{v:?}").trim_matches('"').to_string();
                match f.name() {
                    "event" => self.event = Some(v),
                    "tx_id" => self.tx_id = Some(v),
                    _ => {}
                }
            }
        }
        let mut f = Fields::default();
        event.record(&mut f);
        if let (Some(e), Some(tx)) = (f.event, f.tx_id)
            && e == txflow_receipt_checker::handler::REPLACEMENT_NOT_FINAL
        {
            not_final_seen()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(tx);
        }
    }
}

#[tokio::test]
async fn a_nonce_used_outside_txflow_in_a_block_a_reorg_removes_is_not_replaced_and_the_original_mines_once()
 {
    not_final_seen();
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 1, |c| {
        c.stale_receipt_timeout_ms = 1000;
        c.resubmit_interval_ms = 600_000;
        c.confirmations_required = 3;
    })
    .await;
    let config = p.config.clone();
    p.start_all_stages(&config).await;
    let provider = p.provider();
    // Blocks below ours, so that the reorg never reaches the genesis block.
    provider.anvil_mine(Some(2), None).await.expect("mine");

    p.send(&p.request(0, "kept")).await;
    wait_until("the request is SUBMITTED", LONG, || async {
        count_in(&p, &["SUBMITTED"]).await == 1
    })
    .await;
    let kept = recorded(&p).await.remove(0);
    assert_eq!(kept.nonce, Some(0));
    let ours: B256 = attempt_hash(&p, kept.tx_id, 1).await.parse().expect("hash");
    let raw: Vec<u8> =
        sqlx::query_scalar("SELECT raw_tx FROM tx_attempts WHERE tx_id = $1 AND attempt = 1")
            .bind(kept.tx_id)
            .fetch_one(&p.db.pool)
            .await
            .expect("the signed bytes");

    // The node forgets our transaction, and someone uses nonce 0 straight on the chain, in a
    // block that is not final yet (1 of 3 confirmations).
    provider
        .anvil_drop_transaction(ours)
        .await
        .expect("anvil_dropTransaction");
    let outsider = send_outside_txflow(&p).await;
    provider.anvil_mine(Some(1), None).await.expect("mine");
    let used_in = provider
        .get_transaction_receipt(outsider)
        .await
        .expect("lookup")
        .and_then(|r| r.block_number)
        .expect("the outsider is mined");

    // The receipt checker finds the nonce passed with no receipt of ours, searches the chain, and
    // sees the block that used it is not final: the transaction keeps its nonce.
    let tx = kept.tx_id.to_string();
    // Until two proofs found it (or, the defect, it was replaced at once).
    wait_until(
        "two proofs find the nonce used in a block not final yet",
        LONG,
        || async {
            not_final_seen()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter(|t| **t == tx)
                .count()
                >= 2
                || p.count("SELECT count(*) FROM tx_events WHERE type = 'TxReplaced'")
                    .await
                    > 0
        },
    )
    .await;
    assert_eq!(
        recorded(&p).await[0].state,
        "SUBMITTED",
        "not replaced while the block that used its nonce may still be reorged out"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxReplaced'")
            .await,
        0
    );

    // A reorg removes that block; our original is included in its place, then buried.
    provider
        .anvil_reorg(alloy::rpc::types::anvil::ReorgOptions {
            depth: 1,
            tx_block_pairs: vec![(
                alloy::rpc::types::anvil::TransactionData::Raw(raw.into()),
                0,
            )],
        })
        .await
        .expect("anvil_reorg");
    provider.anvil_mine(Some(2), None).await.expect("mine");
    wait_until("the original is confirmed at its nonce", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED' AND nonce = 0")
            .await
            == 1
    })
    .await;
    let mined = recorded(&p).await.remove(0);
    assert_eq!(mined.mined_block_number, Some(used_in as i64));
    assert_eq!(
        mined.receipt.as_ref().map(|r| r["tx_hash"].clone()),
        Some(serde_json::json!(format!("{ours:#x}"))),
        "the receipt of our original"
    );
    assert_eq!(
        p.mined_markers().await.get("txflow:kept"),
        Some(&1),
        "mined once"
    );
    assert!(
        provider
            .get_transaction_receipt(outsider)
            .await
            .expect("lookup")
            .is_none(),
        "the outsider's transaction is gone with its block"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxReplaced'")
            .await,
        0,
        "never replaced"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts").await,
        1,
        "signed once, never re-allocated"
    );
    p.stop().await;
}

/// Found by `txflow chaos` (the `foreign_nonce` fault): a signer's nonce used outside txflow in a
/// block that is not final when txflow first allocates for the signer. The cursor must not be
/// aligned past it: a reorg that removes that block would leave a nonce nobody ever fills, and
/// every transaction of the signer above it waiting for ever. The allocation takes the nonce as
/// the last final block has it; the send finds it used in a block not final, keeps it, and mines
/// there once the block is gone.
#[tokio::test]
async fn a_nonce_used_outside_txflow_before_the_first_allocation_in_a_block_a_reorg_removes_leaves_no_gap()
 {
    show_logs();
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 1, |c| {
        c.stale_receipt_timeout_ms = 1000;
        c.resubmit_interval_ms = 1000;
        c.confirmations_required = 3;
    })
    .await;
    let config = p.config.clone();
    let provider = p.provider();
    // Blocks below, so that the reorg never reaches the genesis block.
    provider.anvil_mine(Some(2), None).await.expect("mine");

    // Someone uses nonce 0 straight on the chain, in a block 1 of 3 confirmations deep.
    let outsider = send_outside_txflow(&p).await;
    provider.anvil_mine(Some(1), None).await.expect("mine");
    assert!(
        provider
            .get_transaction_receipt(outsider)
            .await
            .expect("lookup")
            .is_some(),
        "the outsider is mined"
    );

    // txflow's first request for the signer.
    p.start_all_stages(&config).await;
    p.send(&p.request(0, "first")).await;
    wait_until("the request has a nonce", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE nonce IS NOT NULL")
            .await
            == 1
    })
    .await;

    // The block that used nonce 0 is reorged out before it is final.
    provider
        .anvil_reorg(alloy::rpc::types::anvil::ReorgOptions {
            depth: 1,
            tx_block_pairs: vec![],
        })
        .await
        .expect("anvil_reorg");
    assert_eq!(
        provider
            .get_transaction_count(p.signers[0].address())
            .await
            .expect("nonce"),
        0,
        "nonce 0 is free again"
    );
    wait_until("the request is confirmed", LONG, || async {
        provider.anvil_mine(Some(1), None).await.expect("mine");
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'CONFIRMED'")
            .await
            == 1
    })
    .await;
    assert_eq!(recorded(&p).await[0].nonce, Some(0), "at the free nonce");
    assert_eq!(
        p.mined_markers().await.get("txflow:first"),
        Some(&1),
        "mined once"
    );
    p.stop().await;
}

/// Runtime code that reverts every call with `Error(text)` (ABI-encoded, at most 32 bytes of
/// text): CODECOPY of the revert data appended to the code, then REVERT.
fn reverts_with_error(text: &str) -> Vec<u8> {
    assert!(text.len() <= 32);
    let mut data = vec![0x08, 0xc3, 0x79, 0xa0];
    let mut offset = [0u8; 32];
    offset[31] = 0x20;
    data.extend_from_slice(&offset);
    let mut len = [0u8; 32];
    len[31] = text.len() as u8;
    data.extend_from_slice(&len);
    let mut t = text.as_bytes().to_vec();
    t.resize(32, 0);
    data.extend_from_slice(&t);
    let n = data.len() as u8; // 100
    // PUSH1 n, PUSH1 12 (where the data starts), PUSH1 0, CODECOPY, PUSH1 n, PUSH1 0, REVERT
    let mut code = vec![
        0x60, n, 0x60, 12, 0x60, 0x00, 0x39, 0x60, n, 0x60, 0x00, 0xfd,
    ];
    code.extend_from_slice(&data);
    code
}

#[tokio::test]
async fn a_submitted_transaction_whose_block_a_reorg_took_before_its_receipt_was_read_is_sent_again_and_mined_once()
 {
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 1, |c| c.resubmit_interval_ms = 500).await;
    let config = p.config.clone();
    let provider = p.provider();
    // Blocks below ours, so that the reorg never reaches the genesis block.
    provider.anvil_mine(Some(2), None).await.expect("mine");
    // No receipt checker yet: the transaction stays SUBMITTED whatever the chain does.
    p.start_stages(&config).await;
    p.send(&p.request(0, "gap")).await;
    wait_until("the request is SUBMITTED", LONG, || async {
        count_in(&p, &["SUBMITTED"]).await == 1
    })
    .await;
    let tx = recorded(&p).await.remove(0).tx_id;
    provider.anvil_mine(Some(1), None).await.expect("mine");
    // The broadcaster sees the chain's nonce past it and stops sending it again.
    wait_until(
        "the broadcaster stops resubmitting a mined transaction",
        LONG,
        || async {
            p.count(&format!(
                "SELECT count(*) FROM tx_attempts WHERE tx_id = '{tx}' AND next_resubmit_at IS NULL"
            ))
            .await
                == 1
        },
    )
    .await;
    // A reorg takes its block before anyone read its receipt; the node does not put it back in
    // its pool. The chain's nonce is 0 again, and nothing of ours is pending there: a gap.
    let outsider = TransactionRequest::default()
        .with_from(
            "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266"
                .parse::<Address>()
                .expect("address"),
        )
        .with_to(SINK.parse::<Address>().expect("sink"))
        .with_value(U256::from(1))
        .with_gas_limit(21_000);
    provider
        .anvil_reorg(alloy::rpc::types::anvil::ReorgOptions {
            depth: 1,
            tx_block_pairs: vec![(alloy::rpc::types::anvil::TransactionData::JSON(outsider), 0)],
        })
        .await
        .expect("anvil_reorg");
    assert_eq!(
        provider
            .get_transaction_count(p.signers[0].address())
            .await
            .expect("nonce"),
        0,
        "the chain's nonce is back below ours"
    );
    assert_eq!(p.pool_status().await, ("0x0".into(), "0x0".into()));

    // The receipt checker finds it pending again with nothing sending it: sent again.
    p.start_receipt_checker(&config).await;
    wait_until(
        "its signed bytes are back in the node's pool",
        LONG,
        || async { p.pool_status().await.0 == "0x1" },
    )
    .await;
    provider.anvil_mine(Some(1), None).await.expect("mine");
    wait_until("the transaction is mined", LONG, || async {
        count_in(&p, &["MINED"]).await == 1
    })
    .await;
    assert_eq!(
        p.mined_markers().await.get("txflow:gap"),
        Some(&1),
        "mined once"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts").await,
        1,
        "signed once"
    );
    p.stop().await;
}
