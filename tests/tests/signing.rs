//! The signer gateway signs with no database transaction open (issue 12, point 6). A remote
//! signer (a KMS or an HSM) takes hundreds of milliseconds per signature; a transaction open
//! meanwhile would hold its connection and the rows' locks for all that time.
//!
//! The key here is alloy's local signer behind a gate ([`GatedKey`], through the gateway's
//! `TxSigner` seam): each signature reports that it started and waits until the test lets it go.
//! While it waits, the test looks from a connection of its own: no connection of the gateway (told
//! apart by its `application_name`) may be `idle in transaction`, and the ALLOCATED rows must be
//! free to lock (`FOR UPDATE NOWAIT`). Then the signatures are let go and the outcome is checked
//! in PostgreSQL and on the chain: one recorded attempt per request, each mined once.
//!
//! Both ways the gateway signs: a TxAllocated message (through the stage runtime) and the recovery
//! scan's drive (PostgreSQL only, no message) — which also signs the defensive cancellation of a
//! transaction undone by a deep reorg.

use std::sync::Arc;
use std::time::Duration;

use alloy::primitives::{Address, Bytes, U256};
use alloy::signers::local::PrivateKeySigner;
use sqlx::PgPool;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use txflow_core::chain::UnsignedTx;
use txflow_core::config::Config;
use txflow_core::deps::Deps;
use txflow_core::domain::{ChainId, NodeId, Signer, TxPayload};
use txflow_core::events::TxAllocated;
use txflow_core::kafka::Topics;
use txflow_core::lease::{Acquisition, LeaseConfig, LeaseManager};
use txflow_core::policy::Policy;
use txflow_core::stage::{DriveCtx, Handler, Output};
use txflow_signer_gateway::keys::{SignFuture, TxSigner};
use txflow_signer_gateway::{Keys, SignStage, SignerConfig};
use txflow_tests::pipeline::{Pipeline, SINK};
use txflow_tests::{TestDb, unique, wait_until};

const LONG: Duration = Duration::from_secs(120);
/// Requests per test.
const REQUESTS: usize = 3;
/// The `application_name` of the gateway's connections: how the test finds them.
const GATEWAY_APP: &str = "txflow-gated-signer-gateway";

/// A local key whose every signature waits for the test: it reports the nonce it is about to sign,
/// then waits for a permit of `gate` (a closed gate lets everything through).
struct GatedKey {
    key: PrivateKeySigner,
    started: mpsc::UnboundedSender<u64>,
    gate: Arc<Semaphore>,
}

impl TxSigner for GatedKey {
    fn address(&self) -> Address {
        self.key.address()
    }

    fn sign<'a>(&'a self, tx: &'a UnsignedTx) -> SignFuture<'a> {
        Box::pin(async move {
            let _ = self.started.send(tx.nonce);
            if let Ok(permit) = self.gate.acquire().await {
                permit.forget();
            }
            TxSigner::sign(&self.key, tx).await
        })
    }
}

/// The test's side of a [`GatedKey`].
struct Gate {
    started: mpsc::UnboundedReceiver<u64>,
    gate: Arc<Semaphore>,
}

impl Gate {
    /// The gateway's keys (only `key`, gated) and the test's side of the gate.
    fn new(key: &PrivateKeySigner) -> (Keys, Gate) {
        let (tx, rx) = mpsc::unbounded_channel();
        let gate = Arc::new(Semaphore::new(0));
        let gated = GatedKey {
            key: key.clone(),
            started: tx,
            gate: gate.clone(),
        };
        let keys = Keys::from_tx_signers([Arc::new(gated) as Arc<dyn TxSigner>]);
        (keys, Gate { started: rx, gate })
    }

    /// For `n` signatures, one at a time: waits until one is in progress, checks from `check`
    /// that the gateway holds no transaction open and no ALLOCATED row locked, lets it go.
    /// Returns the nonces seen signing.
    async fn check_signatures(&mut self, check: &PgPool, n: usize) -> Vec<u64> {
        let mut nonces = Vec::with_capacity(n);
        for _ in 0..n {
            let nonce = self.next_started().await;
            let held = held_while_signing(check).await;
            if !held.is_empty() {
                self.open();
            }
            assert!(
                held.is_empty(),
                "while nonce {nonce} was being signed, the signer gateway held:\n{}",
                held.join("\n")
            );
            nonces.push(nonce);
            self.gate.add_permits(1);
        }
        nonces
    }

    /// The nonce of the next signature that starts.
    async fn next_started(&mut self) -> u64 {
        tokio::time::timeout(LONG, self.started.recv())
            .await
            .unwrap_or_else(|_| panic!("no signature started within {LONG:?}"))
            .expect("the gated key is alive")
    }

    /// Lets every signature through from now on.
    fn open(&self) {
        self.gate.close();
    }
}

/// What the gateway's connections (those named [`GATEWAY_APP`]) hold while a signature is in
/// progress: a connection idle in an open transaction (the gateway waiting for the signer inside
/// it), and the ALLOCATED rows locked by someone. Empty when it signs with no transaction open.
async fn held_while_signing(check: &PgPool) -> Vec<String> {
    let seen: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(GATEWAY_APP)
    .fetch_one(check)
    .await
    .expect("pg_stat_activity");
    assert!(
        seen > 0,
        "the gateway's connections are visible to the check (application_name {GATEWAY_APP})"
    );
    let open: Vec<(i32, String, String, String)> = sqlx::query_as(
        "SELECT pid, state, (clock_timestamp() - xact_start)::text, left(query, 300)
         FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1
           AND xact_start IS NOT NULL AND state LIKE 'idle in transaction%'",
    )
    .bind(GATEWAY_APP)
    .fetch_all(check)
    .await
    .expect("pg_stat_activity");
    let mut held: Vec<String> = open
        .into_iter()
        .map(|(pid, state, age, query)| {
            format!("connection {pid}: {state} for {age}, last statement: {query}")
        })
        .collect();
    let mut tx = check.begin().await.expect("begin");
    let locked =
        sqlx::query("SELECT tx_id FROM managed_tx WHERE state = 'ALLOCATED' FOR UPDATE NOWAIT")
            .fetch_all(&mut *tx)
            .await;
    match locked {
        Ok(_) => {}
        Err(e)
            if e.as_database_error()
                .and_then(|d| d.code())
                .is_some_and(|c| c == "55P03") =>
        {
            held.push(format!("ALLOCATED rows locked: {e}"));
        }
        Err(e) => panic!("locking the ALLOCATED rows: {e}"),
    }
    tx.rollback().await.expect("rollback");
    held
}

/// `url` with the gateway's `application_name`.
fn gateway_url(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={GATEWAY_APP}")
}

/// The gateway's configuration: the pipeline's, its connections named [`GATEWAY_APP`].
fn gateway_config(p: &Pipeline) -> Config {
    Config {
        database_url: gateway_url(&p.config.database_url),
        ..p.config.clone()
    }
}

/// Waits until every request is mined once on the chain, and checks PostgreSQL: each SIGNED or
/// beyond with exactly one attempt and one TxSigned, and nothing else mined.
async fn assert_signed_once_and_mined(p: &Pipeline, requests: &[String]) {
    wait_until("every request is mined", LONG, || async {
        p.mined_count().await >= requests.len() as u64
    })
    .await;
    let markers = p.mined_markers().await;
    for id in requests {
        assert_eq!(
            markers.get(&format!("txflow:{id}")),
            Some(&1),
            "{id} is mined exactly once"
        );
    }
    assert_eq!(markers.len(), requests.len(), "nothing else was mined");
    let n = requests.len() as i64;
    assert_eq!(
        p.count("SELECT count(*) FROM tx_attempts").await,
        n,
        "one attempt per request"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM tx_events WHERE type = 'TxSigned'")
            .await,
        n,
        "one signature recorded per request"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE state IN ('ALLOCATED', 'FAILED')")
            .await,
        0,
        "nothing left unsigned or failed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_is_signed_with_no_transaction_open_and_no_row_locked() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let config = p.config.clone();
    p.start_allocator(&config, "alloc-1").await;
    p.start_broadcaster(&config).await;
    let (keys, mut gate) = Gate::new(&p.signers[0]);
    let deps = Deps::connect(&gateway_config(&p), 1)
        .await
        .expect("the gateway's clients");
    let gateway = txflow_signer_gateway::runtime(
        &deps,
        keys,
        NodeId::named("sign-gated"),
        LeaseConfig::default(),
    )
    .await
    .expect("signer gateway");
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let running = tokio::spawn(async move { gateway.run(stop).await.expect("the gateway runs") });

    let requests: Vec<String> = (0..REQUESTS).map(|i| format!("m-{i}")).collect();
    for id in &requests {
        p.send(&p.request(0, id)).await;
    }
    let mut nonces = gate.check_signatures(&p.db.pool, REQUESTS).await;
    gate.open();
    nonces.sort();
    assert_eq!(nonces, [0, 1, 2], "each request's nonce was signed");
    assert_signed_once_and_mined(&p, &requests).await;

    shutdown.cancel();
    let _ = tokio::time::timeout(LONG, running).await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recovery_scan_signs_with_no_transaction_open_and_no_row_locked() {
    // Allocated transactions whose TxAllocated no gateway reads: only a drive signs them.
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let config = p.config.clone();
    p.start_allocator(&config, "alloc-1").await;
    let requests: Vec<String> = (0..REQUESTS).map(|i| format!("r-{i}")).collect();
    for id in &requests {
        p.send(&p.request(0, id)).await;
    }
    wait_until("every request is allocated", LONG, || async {
        p.count("SELECT count(*) FROM managed_tx WHERE state = 'ALLOCATED'")
            .await
            == REQUESTS as i64
    })
    .await;

    let (keys, mut gate) = Gate::new(&p.signers[0]);
    let stage = SignStage::new(
        SignerConfig::from_config(&config).expect("signer config"),
        keys,
    );
    let pool = txflow_core::db::connect(&gateway_url(&config.database_url), 4)
        .await
        .expect("the gateway's pool");
    let leases = LeaseManager::new(
        pool.clone(),
        stage.role(),
        NodeId::named("sign-recovery"),
        LeaseConfig::default(),
    )
    .expect("lease manager");
    let signer = Signer::parse(&p.signer(0)).expect("signer");
    let lease = match leases
        .acquire(ChainId(config.chain_id), &signer)
        .await
        .expect("acquire")
    {
        Acquisition::Held(l, _) => l,
        busy => panic!("lease not acquired: {busy:?}"),
    };
    let token = lease.token().0;
    let drive = tokio::spawn(async move {
        stage
            .drive(DriveCtx {
                lease: &lease,
                pool: &pool,
                recovery: true,
            })
            .await
            .map(|outputs| outputs.len())
            .map_err(|e| format!("{e:?}"))
    });
    let mut nonces = gate.check_signatures(&p.db.pool, REQUESTS).await;
    gate.open();
    nonces.sort();
    assert_eq!(nonces, [0, 1, 2], "each allocated nonce was signed");
    let announced = tokio::time::timeout(LONG, drive)
        .await
        .expect("the drive ends")
        .expect("the drive did not panic")
        .expect("the drive succeeds");
    assert_eq!(
        announced, REQUESTS,
        "one TxSigned announced per transaction"
    );
    let under_token: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM managed_tx m JOIN tx_attempts a USING (tx_id)
         WHERE m.state = 'SIGNED' AND m.fencing_token = $1",
    )
    .bind(token)
    .fetch_one(&p.db.pool)
    .await
    .expect("count");
    assert_eq!(
        under_token, REQUESTS as i64,
        "every transaction SIGNED with its attempt, under the drive's lease"
    );

    // The recorded attempts are what the chain mines.
    p.start_broadcaster(&config).await;
    assert_signed_once_and_mined(&p, &requests).await;
    p.stop().await;
}

const CHAIN_ID: i64 = 31337;
const MAX_FEE: u128 = 2_000_000_000;
const TIP: u128 = 1_000_000_000;

/// Records an ALLOCATED transaction of `signer` at `nonce` directly (unfenced: test setup), as the
/// allocator leaves it; returns it and the TxAllocated that announces it.
async fn allocated(pool: &PgPool, signer: &str, nonce: i64) -> (uuid::Uuid, TxAllocated) {
    let payload = TxPayload {
        to: SINK.into(),
        value: "1".into(),
        data: "0x".into(),
        gas_limit: Some(21_000),
        max_fee_per_gas: Some(MAX_FEE.to_string()),
        max_priority_fee_per_gas: Some(TIP.to_string()),
    };
    let tx_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state)
         VALUES ($1, $2, $3, $4, $5, $6, 'ALLOCATED')",
    )
    .bind(tx_id)
    .bind(CHAIN_ID)
    .bind(signer)
    .bind(format!("req-{nonce}"))
    .bind(nonce)
    .bind(serde_json::to_value(&payload).expect("payload"))
    .execute(pool)
    .await
    .expect("record an allocated transaction");
    let event = TxAllocated {
        event_id: uuid::Uuid::new_v4().to_string(),
        tx_id: tx_id.to_string(),
        request_id: format!("req-{nonce}"),
        chain_id: CHAIN_ID,
        signer: signer.to_string(),
        nonce,
        to: SINK.into(),
        value: "1".into(),
        data: Vec::new(),
        gas_limit: 21_000,
        max_fee_per_gas: MAX_FEE.to_string(),
        max_priority_fee_per_gas: TIP.to_string(),
        fencing_token: 0,
    };
    (tx_id, event)
}

/// The state of `tx_id` and its recorded attempts (number, raw bytes, max fee).
async fn recorded(pool: &PgPool, tx_id: uuid::Uuid) -> (String, Vec<(i32, Vec<u8>, String)>) {
    let state: String = sqlx::query_scalar("SELECT state FROM managed_tx WHERE tx_id = $1")
        .bind(tx_id)
        .fetch_one(pool)
        .await
        .expect("state");
    let attempts = sqlx::query_as(
        "SELECT attempt, raw_tx, max_fee_per_gas::text FROM tx_attempts WHERE tx_id = $1
         ORDER BY attempt",
    )
    .bind(tx_id)
    .fetch_all(pool)
    .await
    .expect("attempts");
    (state, attempts)
}

fn event_ids(outputs: &[Output]) -> Vec<String> {
    outputs.iter().map(|o| o.event_id.clone()).collect()
}

/// A message writes nothing and signs nothing in its batch's transaction; the drive after the
/// batch signs its transaction once (twice in the batch or not), and the message again later
/// re-announces that signature. A transaction that changes while its signature is in progress
/// is not recorded with the stale signature: the next drive signs what PostgreSQL holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drive_after_a_batch_signs_once_and_a_row_that_moved_meanwhile_is_left_alone() {
    let db = TestDb::new().await;
    let key = PrivateKeySigner::random();
    let signer = format!("{:#x}", key.address());
    let (keys, mut gate) = Gate::new(&key);
    let stage = Arc::new(SignStage::new(
        SignerConfig {
            chain_id: ChainId(CHAIN_ID),
            topics: Topics::new(unique("signing")),
            policy: Policy::default(),
        },
        keys,
    ));
    let pool = txflow_core::db::connect(&gateway_url(&db.url), 4)
        .await
        .expect("the gateway's pool");
    let leases = LeaseManager::new(
        pool.clone(),
        stage.role(),
        NodeId::named("sign-direct"),
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
    let drive = |recovery: bool| {
        let (stage, lease, pool) = (stage.clone(), lease.clone(), pool.clone());
        tokio::spawn(async move {
            stage
                .drive(DriveCtx {
                    lease: &lease,
                    pool: &pool,
                    recovery,
                })
                .await
                .unwrap_or_else(|e| panic!("the drive failed: {e:?}"))
        })
    };

    // The same message twice in one batch: nothing written, nothing announced yet.
    let (first, message) = allocated(&db.pool, &signer, 0).await;
    let mut tx = lease.begin(&pool).await.expect("begin");
    let mut writer = tx.writer();
    let twice = [&message, &message];
    let both = tokio::select! {
        both = stage.handle_batch(&mut writer, &twice) => both.expect("the batch"),
        nonce = gate.next_started() => {
            gate.open();
            panic!("nonce {nonce} is being signed inside the batch's transaction");
        }
    };
    tx.commit().await.expect("commit");
    assert!(
        both.iter()
            .all(|r| r.as_ref().is_ok_and(|outputs| outputs.is_empty())),
        "the batch announces nothing itself: {both:?}"
    );
    assert_eq!(
        recorded(&db.pool, first).await,
        ("ALLOCATED".to_string(), Vec::new()),
        "the batch wrote nothing"
    );

    // The drive after the batch signs it once.
    let running = drive(false);
    assert_eq!(gate.check_signatures(&db.pool, 1).await, [0]);
    let signed = tokio::time::timeout(LONG, running)
        .await
        .expect("the drive ends")
        .expect("the drive did not panic");
    assert_eq!(signed.len(), 1, "one TxSigned");
    let unsigned = UnsignedTx {
        chain_id: CHAIN_ID as u64,
        nonce: 0,
        to: SINK.parse().expect("sink"),
        value: U256::from(1),
        data: Bytes::new(),
        gas_limit: 21_000,
        max_fee_per_gas: MAX_FEE,
        max_priority_fee_per_gas: TIP,
    };
    // The local signer is deterministic: the recorded bytes are the row's transaction signed.
    let expected = txflow_core::chain::sign(&key, &unsigned).expect("sign");
    assert_eq!(
        recorded(&db.pool, first).await,
        (
            "SIGNED".to_string(),
            vec![(1, expected.raw, MAX_FEE.to_string())]
        ),
        "signed once, attempt 1 recorded"
    );
    for recovery in [false, true] {
        let again = tokio::time::timeout(LONG, drive(recovery))
            .await
            .expect("the drive ends")
            .expect("the drive did not panic");
        assert!(
            again.is_empty(),
            "nothing left to sign (recovery {recovery})"
        );
    }
    let mut tx = lease.begin(&pool).await.expect("begin");
    let later = stage
        .handle_batch(&mut tx.writer(), &[&message])
        .await
        .expect("the later batch");
    tx.commit().await.expect("commit");
    assert_eq!(
        later
            .into_iter()
            .map(|r| event_ids(&r.expect("a valid message")))
            .collect::<Vec<_>>(),
        [event_ids(&signed)],
        "a later copy re-announces the recorded signature, same event_id"
    );

    // A row re-priced while its signature is in progress: the signature of the old fees is not
    // recorded; the next scan signs the row as it is now.
    let (second, _) = allocated(&db.pool, &signer, 1).await;
    let running = drive(true);
    assert_eq!(gate.next_started().await, 1);
    let held = held_while_signing(&db.pool).await;
    assert!(held.is_empty(), "while signing: {held:?}");
    sqlx::query(
        "UPDATE managed_tx SET payload = jsonb_set(payload, '{max_fee_per_gas}', '\"3000000000\"')
         WHERE tx_id = $1",
    )
    .bind(second)
    .execute(&db.pool)
    .await
    .expect("re-price the row");
    gate.open();
    let stale = tokio::time::timeout(LONG, running)
        .await
        .expect("the drive ends")
        .expect("the drive did not panic");
    assert!(
        stale.is_empty(),
        "nothing announced for a row that moved: {stale:?}"
    );
    assert_eq!(
        recorded(&db.pool, second).await,
        ("ALLOCATED".to_string(), Vec::new()),
        "the stale signature was not recorded"
    );
    let fresh = tokio::time::timeout(LONG, drive(true))
        .await
        .expect("the drive ends")
        .expect("the drive did not panic");
    assert_eq!(fresh.len(), 1);
    let (state, attempts) = recorded(&db.pool, second).await;
    assert_eq!(state, "SIGNED");
    assert_eq!(
        attempts
            .iter()
            .map(|(n, _, fee)| (*n, fee.as_str()))
            .collect::<Vec<_>>(),
        [(1, "3000000000")],
        "signed as PostgreSQL holds it now"
    );
}

/// Makes `tx_id` (recorded by [`allocated`]) what the confirmation manager leaves after a reorg
/// deeper than the depth undid it: CONFIRMED, `reorged_at` set, generation 1, no block; with its
/// attempt 1 at the test's caps (unfenced: test setup).
async fn undone_by_a_deep_reorg(pool: &PgPool, tx_id: uuid::Uuid) {
    sqlx::query(
        "UPDATE managed_tx SET state = 'CONFIRMED', reorged_at = now(), reorg_generation = 1
         WHERE tx_id = $1",
    )
    .bind(tx_id)
    .execute(pool)
    .await
    .expect("undone by a deep reorg");
    sqlx::query(
        "INSERT INTO tx_attempts (tx_id, attempt, tx_hash, raw_tx, max_fee_per_gas, max_priority_fee_per_gas)
         VALUES ($1, 1, $2, '\\x00', $3::numeric, $4::numeric)",
    )
    .bind(tx_id)
    .bind(format!("0x{:064x}", tx_id.as_u128()))
    .bind(MAX_FEE.to_string())
    .bind(TIP.to_string())
    .execute(pool)
    .await
    .expect("its attempt");
}

/// The defensive cancellation (seed 000 §4.4) is signed by the recovery scan's drive like any
/// signature: with no transaction open, then recorded in one short fenced transaction, once, for
/// a transaction still as it was read. It is a 0-value transfer to the signer at the undone
/// transaction's nonce, priced at twice the higher of the original's and the market's tips, with
/// room for it over twice the market's base fee, within `fees.max_fee_per_gas`. A transaction
/// that moved while its cancellation was being signed (undone meanwhile) gets none; a transaction
/// mined again, or whose nonce has one already, needs none; a second scan signs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recovery_scan_signs_one_defensive_cancellation_per_undone_nonce_with_no_transaction_open()
 {
    const GWEI: u128 = 1_000_000_000;
    let db = TestDb::new().await;
    let key = PrivateKeySigner::random();
    let signer = format!("{:#x}", key.address());
    let (keys, mut gate) = Gate::new(&key);
    let chain = Arc::new(txflow_tests::fake_chain::FakeChain::new());
    // The market: a base fee of 3.5 gwei (the max fee is twice it plus the tip), a tip of 3 gwei.
    chain.set_fees(10 * GWEI, 3 * GWEI);
    let stage = Arc::new(
        SignStage::new(
            SignerConfig {
                chain_id: ChainId(CHAIN_ID),
                topics: Topics::new(unique("signing")),
                policy: Policy::default(),
            },
            keys,
        )
        .with_cancellations(chain.clone(), 15 * GWEI),
    );
    let pool = txflow_core::db::connect(&gateway_url(&db.url), 4)
        .await
        .expect("the gateway's pool");
    let leases = LeaseManager::new(
        pool.clone(),
        stage.role(),
        NodeId::named("sign-cancel"),
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
    let drive = || {
        let (stage, lease, pool) = (stage.clone(), lease.clone(), pool.clone());
        tokio::spawn(async move {
            stage
                .drive(DriveCtx {
                    lease: &lease,
                    pool: &pool,
                    recovery: true,
                })
                .await
                .unwrap_or_else(|e| panic!("the drive failed: {e:?}"))
        })
    };
    let cancellations = || async {
        sqlx::query_as::<_, (i64, uuid::Uuid, i32, Vec<u8>, String, String, i64)>(
            "SELECT nonce, tx_id, reorg_generation, raw_tx, max_fee_per_gas::text,
                    max_priority_fee_per_gas::text, fencing_token
             FROM tx_cancellations ORDER BY nonce",
        )
        .fetch_all(&db.pool)
        .await
        .expect("tx_cancellations")
    };

    // Nonces 0 and 1 undone by a deep reorg; nonce 2 undone too, but mined again since.
    let (first, _) = allocated(&db.pool, &signer, 0).await;
    let (second, _) = allocated(&db.pool, &signer, 1).await;
    let (third, _) = allocated(&db.pool, &signer, 2).await;
    for tx_id in [first, second, third] {
        undone_by_a_deep_reorg(&db.pool, tx_id).await;
    }
    sqlx::query(
        "UPDATE managed_tx SET receipt = '{}'::jsonb, mined_block_number = 9,
                mined_block_hash = '0x0000000000000000000000000000000000000000000000000000000000000009'
         WHERE tx_id = $1",
    )
    .bind(third)
    .execute(&db.pool)
    .await
    .expect("mined again");
    assert_eq!(
        txflow_signer_gateway::store::pending_signers(&db.pool, ChainId(CHAIN_ID))
            .await
            .expect("pending signers"),
        [(ChainId(CHAIN_ID), Signer::parse(&signer).expect("signer"))],
        "the recovery scan looks at the signer"
    );

    // Signed one at a time with no transaction open; the second one's transaction is undone
    // (back to RECEIVED) while its cancellation is being signed.
    let running = drive();
    assert_eq!(gate.check_signatures(&db.pool, 1).await, [0]);
    assert_eq!(gate.next_started().await, 1);
    let held = held_while_signing(&db.pool).await;
    assert!(held.is_empty(), "while signing: {held:?}");
    sqlx::query("UPDATE managed_tx SET state = 'RECEIVED', reorged_at = NULL WHERE tx_id = $1")
        .bind(second)
        .execute(&db.pool)
        .await
        .expect("undone meanwhile");
    gate.open();
    let outputs = tokio::time::timeout(LONG, running)
        .await
        .expect("the drive ends")
        .expect("the drive did not panic");
    assert!(outputs.is_empty(), "nothing announced: {outputs:?}");

    // One recorded: nonce 0's, the self-transfer as the key signs it.
    let expected = txflow_core::chain::sign(
        &key,
        &UnsignedTx {
            chain_id: CHAIN_ID as u64,
            nonce: 0,
            to: key.address(),
            value: U256::ZERO,
            data: Bytes::new(),
            gas_limit: 21_000,
            // Capped at 15 gwei (twice the market's would be 20); a tip of twice the market's.
            max_fee_per_gas: 15 * GWEI,
            max_priority_fee_per_gas: 6 * GWEI,
        },
    )
    .expect("sign");
    assert_eq!(
        cancellations().await,
        [(
            0,
            first,
            1,
            expected.raw,
            (15 * GWEI).to_string(),
            (6 * GWEI).to_string(),
            lease.token().0
        )]
    );
    // Nothing of the transactions moved; no attempt was added.
    for (tx_id, state) in [
        (first, "CONFIRMED"),
        (second, "RECEIVED"),
        (third, "CONFIRMED"),
    ] {
        let (now, attempts) = recorded(&db.pool, tx_id).await;
        assert_eq!((now.as_str(), attempts.len()), (state, 1), "{tx_id}");
    }

    // A second scan: nothing left to sign.
    let again = tokio::time::timeout(LONG, drive())
        .await
        .expect("the drive ends")
        .expect("the drive did not panic");
    assert!(again.is_empty());
    assert!(gate.started.try_recv().is_err(), "nothing signed again");
    assert_eq!(cancellations().await.len(), 1);
    assert!(
        txflow_signer_gateway::store::pending_signers(&db.pool, ChainId(CHAIN_ID))
            .await
            .expect("pending signers")
            .is_empty()
    );
}
