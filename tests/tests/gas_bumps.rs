//! Gas bumps (issue 16 point 1, seed 003), the whole pipeline against real PostgreSQL and broker
//! and an anvil of the test's own that mines only when the test says so:
//!
//! - a transaction is sent, then the base fee is raised far above its max fee
//!   (`anvil_setNextBlockBaseFeePerGas` and one empty block): the signer gateway's recovery scan
//!   signs attempt 2 at the same nonce with both caps at least 110% of attempt 1's (read from
//!   `tx_attempts`), the broadcaster sends it, and once blocks are mined again attempt 2 is the
//!   transaction on the chain at that nonce while attempt 1's hash has no receipt; the
//!   transaction is settled (MINED or further) from attempt 2's receipt;
//! - with `fees.max_fee_per_gas` below any replacement, the same raise gives the critical alert
//!   `gas_bump_at_cap` (seen by a tracing layer of the test) on two scans, no attempt 2, and the
//!   broadcaster still sending attempt 1 after the alert;
//! - against PostgreSQL and the fake chain, the stall rule: the head of the queue, waiting past
//!   `resubmit.bump_after_ms`, is bumped once; a transaction behind it is not.
//!
//! The rule itself (110% rounded up, the market's price when higher, the cap) is unit-tested in
//! `txflow-signer-gateway`'s `decide`, since anvil takes a replacement at +1 wei.

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use alloy::primitives::B256;
use alloy::providers::Provider;
use alloy::providers::ext::AnvilApi;
use tracing_subscriber::layer::SubscriberExt;
use txflow_signer_gateway::handler::{GAS_BUMP_AT_CAP, GAS_BUMP_HELD, GAS_BUMPED};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{AnvilNode, wait_until};

const LONG: Duration = Duration::from_secs(180);
const GWEI: u128 = 1_000_000_000;
/// The base fee the test raises the chain to: far above what a quiet anvil prices (~2 gwei).
const HIGH_BASE_FEE: u128 = 200 * GWEI;

/// The `(event, signer)` of every gas-bump log event of this process.
fn seen() -> &'static Mutex<Vec<(String, String)>> {
    static SEEN: OnceLock<Mutex<Vec<(String, String)>>> = OnceLock::new();
    SEEN.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(Recorder);
        // Another test of this binary installed it first: that one records as well.
        let _ = tracing::subscriber::set_global_default(subscriber);
        Mutex::new(Vec::new())
    })
}

/// How many `event` log events named `signer`.
fn count(event: &str, signer: &str) -> usize {
    seen()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(e, s)| e == event && s == signer)
        .count()
}

/// A tracing layer that records the gas-bump events.
struct Recorder;

#[derive(Default)]
struct Fields {
    event: Option<String>,
    signer: Option<String>,
}

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "event" => self.event = Some(value.to_string()),
            "signer" => self.signer = Some(value.to_string()),
            _ => {}
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "event" => self.event = Some(format!("{value:?}").trim_matches('"').to_string()),
            "signer" => self.signer = Some(format!("{value:?}").trim_matches('"').to_string()),
            _ => {}
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Recorder {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut f = Fields::default();
        event.record(&mut f);
        if let (Some(e), Some(s)) = (f.event, f.signer)
            && (e == GAS_BUMPED || e == GAS_BUMP_AT_CAP || e == GAS_BUMP_HELD)
        {
            seen()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((e, s));
        }
    }
}

/// One attempt as recorded: number, hash, caps, and whether the broadcaster sent it (a bumped
/// attempt is sent by the resubmission, which records `last_submit_at`).
type Attempt = (i32, String, String, String, bool);

async fn attempts(p: &Pipeline, request_id: &str) -> Vec<Attempt> {
    sqlx::query_as(
        "SELECT a.attempt, a.tx_hash, a.max_fee_per_gas::text, a.max_priority_fee_per_gas::text,
                a.last_submit_at IS NOT NULL
         FROM tx_attempts a JOIN managed_tx m USING (tx_id)
         WHERE m.request_id = $1 ORDER BY a.attempt",
    )
    .bind(request_id)
    .fetch_all(&p.db.pool)
    .await
    .expect("attempts")
}

/// Raises the base fee far above a quiet anvil's prices: the next block's base fee set, then that
/// block mined (empty of our transaction, which cannot pay it).
async fn raise_base_fee(p: &Pipeline) {
    let provider = p.provider();
    provider
        .anvil_set_next_block_base_fee_per_gas(HIGH_BASE_FEE)
        .await
        .expect("set the next base fee");
    provider.anvil_mine(Some(1), None).await.expect("mine");
}

/// Starts the pipeline on a chain that mines only when told, sends request `id` of signer 0 and
/// waits until a node holds its first attempt.
async fn submitted(id: &str, customize: impl FnOnce(&mut txflow_core::config::Config)) -> Pipeline {
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 1, |c| {
        // Only the base fee decides a bump here.
        c.bump_after_ms = 3_600_000;
        c.resubmit_interval_ms = 500;
        customize(c);
    })
    .await;
    let config = p.config.clone();
    p.start_all_stages(&config).await;
    p.send(&p.request(0, id)).await;
    wait_until("attempt 1 is submitted", LONG, || async {
        p.state_of(id).await.as_deref() == Some("SUBMITTED")
            && attempts(&p, id).await.first().is_some_and(|a| a.4)
    })
    .await;
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_under_the_base_fee_is_bumped_and_the_replacement_is_mined() {
    seen();
    let p = submitted("bump-1", |_| {}).await;
    let signer = p.signer(0);
    raise_base_fee(&p).await;

    wait_until("attempt 2 is signed and sent", LONG, || async {
        attempts(&p, "bump-1").await.get(1).is_some_and(|a| a.4)
    })
    .await;
    assert!(count(GAS_BUMPED, &signer) >= 1, "gas_bumped logged");
    let recorded = attempts(&p, "bump-1").await;
    let (first, second) = (&recorded[0], &recorded[1]);
    for (what, n, n1) in [
        ("max fee", &first.2, &second.2),
        ("priority fee", &first.3, &second.3),
    ] {
        let (n, n1): (u128, u128) = (n.parse().expect("cap"), n1.parse().expect("cap"));
        assert!(
            n1 * 100 >= n * 110,
            "attempt 2's {what} {n1} is not 110% of attempt 1's {n}"
        );
    }
    let max_fee: u128 = second.2.parse().expect("cap");
    assert!(
        max_fee > HIGH_BASE_FEE * 7 / 8,
        "attempt 2 ({max_fee}) is priced from the current fees"
    );

    // Blocks again: attempt 2 is mined, and the transaction settles from its receipt.
    let provider = p.provider();
    wait_until("the transaction is mined", LONG, || async {
        provider.anvil_mine(Some(1), None).await.expect("mine");
        matches!(
            p.state_of("bump-1").await.as_deref(),
            Some("MINED" | "CONFIRMED")
        )
    })
    .await;
    let recorded = attempts(&p, "bump-1").await;
    let mut with_receipt = Vec::new();
    for a in &recorded {
        let hash: B256 = a.1.parse().expect("hash");
        if provider
            .get_transaction_receipt(hash)
            .await
            .expect("receipt")
            .is_some()
        {
            with_receipt.push(a.0);
        }
    }
    assert_eq!(with_receipt, vec![2], "only attempt 2 has a receipt");
    assert_eq!(
        p.mined_markers().await.get("txflow:bump-1").copied(),
        Some(1),
        "one transaction of the request on the chain"
    );
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_a_stuck_transaction_raises_an_alert_and_is_resent_unraised() {
    seen();
    // A cap below any replacement of what the allocator priced.
    let p = submitted("cap-1", |c| c.max_fee_per_gas_wei = 1_000_000).await;
    let signer = p.signer(0);
    raise_base_fee(&p).await;

    wait_until("two recovery scans raise the alert", LONG, || async {
        count(GAS_BUMP_AT_CAP, &signer) >= 2
    })
    .await;
    let sent_after_alert: db_clock::Mark = db_clock::mark(&p).await;
    wait_until("attempt 1 is sent again after the alert", LONG, || async {
        db_clock::sent_since(&p, "cap-1", &sent_after_alert).await
    })
    .await;
    let recorded = attempts(&p, "cap-1").await;
    assert_eq!(
        recorded.len(),
        1,
        "no further attempt at the cap: {recorded:?}"
    );
    assert_eq!(count(GAS_BUMPED, &signer), 0);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signer_without_the_funds_for_a_bump_is_not_bumped_until_funds_arrive() {
    seen();
    let p = submitted("held-1", |_| {}).await;
    let signer = p.signer(0);
    let address = p.signers[0].address();
    let provider = p.provider();
    // The signer's funds are gone: its next request cannot be paid, nor a plain transfer's gas,
    // and the allocator holds the signer.
    provider
        .anvil_set_balance(address, alloy::primitives::U256::from(1))
        .await
        .expect("drain");
    p.send(&p.request(0, "held-2")).await;
    wait_until("the allocator holds the signer", LONG, || async {
        p.count(&format!(
            "SELECT count(*) FROM signer_holds WHERE signer = '{signer}'"
        ))
        .await
            == 1
    })
    .await;
    // Stuck under the base fee: a bump is due, but the signer cannot pay for one.
    raise_base_fee(&p).await;
    wait_until(
        "two recovery scans find the bump due and the signer without the funds for it",
        LONG,
        || async { count(GAS_BUMP_HELD, &signer) >= 2 },
    )
    .await;
    assert_eq!(
        attempts(&p, "held-1").await.len(),
        1,
        "no attempt 2 while the signer is held"
    );
    assert_eq!(count(GAS_BUMPED, &signer), 0);

    // Funds again: the stuck transaction is bumped (whatever hold still waits to be cleared:
    // a broadcaster's clears only when a node takes a send, which this bump is), then every
    // hold clears.
    provider
        .anvil_set_balance(address, alloy::primitives::U256::from(10u128.pow(21)))
        .await
        .expect("fund");
    wait_until("attempt 2 is signed and sent", LONG, || async {
        attempts(&p, "held-1").await.get(1).is_some_and(|a| a.4)
    })
    .await;
    assert!(count(GAS_BUMPED, &signer) >= 1);
    wait_until("the holds clear", LONG, || async {
        p.count(&format!(
            "SELECT count(*) FROM signer_holds WHERE signer = '{signer}'"
        ))
        .await
            == 0
    })
    .await;
    p.stop().await;
}

/// Times by the database clock, as the broadcaster records them.
mod db_clock {
    use txflow_tests::pipeline::Pipeline;

    /// The database clock now, in microseconds since the epoch.
    pub type Mark = i64;

    pub async fn mark(p: &Pipeline) -> Mark {
        sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
            .fetch_one(&p.db.pool)
            .await
            .expect("clock")
    }

    /// The latest attempt of `request_id` was sent after `mark`.
    pub async fn sent_since(p: &Pipeline, request_id: &str, mark: &Mark) -> bool {
        let last: Option<i64> = sqlx::query_scalar(
            "SELECT (extract(epoch FROM max(a.last_submit_at)) * 1000000)::bigint
             FROM tx_attempts a JOIN managed_tx m USING (tx_id) WHERE m.request_id = $1",
        )
        .bind(request_id)
        .fetch_one(&p.db.pool)
        .await
        .expect("last submit");
        last.is_some_and(|l| l > *mark)
    }
}

/// The stall rule and the fenced record, against PostgreSQL and the fake chain (no node to wait
/// for): two SUBMITTED transactions whose attempts waited an hour, the chain's nonce at the first
/// one's, the base fee under both max fees. The recovery scan's drive bumps the head of the queue
/// only (the second waits behind it): attempt 2 at the same nonce, both caps at least 110% of
/// attempt 1's and the market's max fee where higher, recorded fenced, due to be sent at once,
/// signed as the key signs that transaction. A second scan finds the new attempt fresh and bumps
/// nothing; no state moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recovery_scan_bumps_the_stalled_head_of_the_queue_once() {
    use std::sync::Arc;

    use alloy::primitives::{Bytes, U256};
    use alloy::signers::local::PrivateKeySigner;
    use txflow_core::chain::UnsignedTx;
    use txflow_core::domain::{ChainId, NodeId, Signer, TxPayload};
    use txflow_core::kafka::Topics;
    use txflow_core::lease::{Acquisition, LeaseConfig, LeaseManager};
    use txflow_core::policy::Policy;
    use txflow_core::stage::{DriveCtx, Handler};
    use txflow_signer_gateway::{BumpSettings, Keys, SignStage, SignerConfig};
    use txflow_tests::pipeline::SINK;
    use txflow_tests::{TestDb, unique};

    const CHAIN_ID: i64 = 31337;
    seen();
    let db = TestDb::new().await;
    let key = PrivateKeySigner::random();
    let signer = format!("{:#x}", key.address());
    let chain = Arc::new(txflow_tests::fake_chain::FakeChain::new());
    // A base fee of 1.5 gwei (the max fee is twice it plus the tip) under both max fees.
    chain.set_fees(3 * GWEI + 1, 1);
    let stage = Arc::new(
        SignStage::new(
            SignerConfig {
                chain_id: ChainId(CHAIN_ID),
                topics: Topics::new(unique("bumps")),
                policy: Policy::default(),
            },
            Keys::from_signers(vec![key.clone()]),
        )
        .with_cancellations(chain.clone(), 1_000 * GWEI)
        .with_bumps(BumpSettings {
            after_ms: 60_000,
            percent: 10,
        }),
    );
    let payload = TxPayload {
        to: SINK.into(),
        value: "1".into(),
        data: "0x".into(),
        gas_limit: Some(21_000),
        max_fee_per_gas: Some((2 * GWEI).to_string()),
        max_priority_fee_per_gas: Some(GWEI.to_string()),
    };
    let mut ids = Vec::new();
    for nonce in [0_i64, 1] {
        let tx_id = uuid::Uuid::now_v7();
        sqlx::query(
            "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state)
             VALUES ($1, $2, $3, $4, $5, $6, 'SUBMITTED')",
        )
        .bind(tx_id)
        .bind(CHAIN_ID)
        .bind(&signer)
        .bind(format!("req-{nonce}"))
        .bind(nonce)
        .bind(serde_json::to_value(&payload).expect("payload"))
        .execute(&db.pool)
        .await
        .expect("a submitted transaction");
        sqlx::query(
            "INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas,
                                      max_priority_fee_per_gas, created_at, submitted_at,
                                      last_submit_at, next_resubmit_at)
             VALUES ($1, 1, $2, '\\x00', $3::numeric, $4::numeric, now() - interval '1 hour',
                     now() - interval '1 hour', now(), now() + interval '1 hour')",
        )
        .bind(tx_id)
        .bind(format!("0x{:064x}", tx_id.as_u128()))
        .bind((2 * GWEI).to_string())
        .bind(GWEI.to_string())
        .execute(&db.pool)
        .await
        .expect("its attempt");
        ids.push(tx_id);
    }
    assert_eq!(
        txflow_signer_gateway::store::pending_signers(&db.pool, ChainId(CHAIN_ID))
            .await
            .expect("pending signers"),
        [(ChainId(CHAIN_ID), Signer::parse(&signer).expect("signer"))],
        "the recovery scan looks at a signer with sent transactions"
    );
    let leases = LeaseManager::new(
        db.pool.clone(),
        stage.role(),
        NodeId::named("sign-bump"),
        LeaseConfig::default(),
    )
    .expect("lease manager");
    let lease = match leases
        .acquire(ChainId(CHAIN_ID), &Signer::parse(&signer).expect("signer"))
        .await
        .expect("acquire")
    {
        Acquisition::Held(l, _) => l,
        busy => panic!("lease not acquired: {busy:?}"),
    };
    let drive = || async {
        stage
            .drive(DriveCtx {
                lease: &lease,
                pool: &db.pool,
                recovery: true,
            })
            .await
            .unwrap_or_else(|e| panic!("the drive failed: {e:?}"))
    };
    type Row = (uuid::Uuid, i32, Vec<u8>, String, String, bool);
    let attempts = || async {
        sqlx::query_as::<_, Row>(
            "SELECT tx_id, attempt, raw_tx, max_fee_per_gas::text,
                    max_priority_fee_per_gas::text, next_resubmit_at <= now()
             FROM tx_attempts ORDER BY tx_id, attempt",
        )
        .fetch_all(&db.pool)
        .await
        .expect("attempts")
    };

    assert!(drive().await.is_empty(), "a bump announces nothing");
    // Both caps +10% (2.2 and 1.1 gwei), the max fee raised to the market's 3 gwei.
    let expected = txflow_core::chain::sign(
        &key,
        &UnsignedTx {
            chain_id: CHAIN_ID as u64,
            nonce: 0,
            to: SINK.parse().expect("sink"),
            value: U256::from(1),
            data: Bytes::new(),
            gas_limit: 21_000,
            max_fee_per_gas: 3 * GWEI + 1,
            max_priority_fee_per_gas: 1_100_000_000,
        },
    )
    .expect("sign");
    let after = attempts().await;
    assert_eq!(after.len(), 3, "one new attempt: {after:?}");
    assert_eq!(
        after[1],
        (
            ids[0],
            2,
            expected.raw,
            (3 * GWEI + 1).to_string(),
            "1100000000".to_string(),
            true
        ),
        "attempt 2 of the head of the queue, due at once"
    );
    assert_eq!(after[2].0, ids[1], "the second waits behind the head");
    assert_eq!(after[2].1, 1);
    assert_eq!(count(GAS_BUMPED, &signer), 1);

    // The new attempt has not waited: nothing more.
    assert!(drive().await.is_empty());
    assert_eq!(attempts().await.len(), 3);
    let states: Vec<String> = sqlx::query_scalar("SELECT state FROM managed_tx ORDER BY nonce")
        .fetch_all(&db.pool)
        .await
        .expect("states");
    assert_eq!(states, ["SUBMITTED", "SUBMITTED"], "a bump moves no state");
}
