//! Property: over random interleavings of acquire / renew / release / expire / write by three
//! nodes, a write succeeds only with the current token of a live lease, and the database agrees
//! with a simple model of who holds the lease. Runs against real PostgreSQL. "Expire" moves the
//! lease's expiry into the past (time passing), so no case waits on the clock.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use txflow_core::domain::{ChainId, FencingToken, NodeId, Signer};
use txflow_core::lease::{Acquisition, HeldLease, LeaseConfig, LeaseManager};
use txflow_core::role::Role;
use txflow_tests::TestDb;

const CHAIN: ChainId = ChainId(1);
const NODES: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    Acquire(usize),
    Renew(usize),
    Release(usize),
    Expire,
    Write(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..NODES).prop_map(Op::Acquire),
        2 => (0..NODES).prop_map(Op::Renew),
        1 => (0..NODES).prop_map(Op::Release),
        1 => Just(Op::Expire),
        4 => (0..NODES).prop_map(Op::Write),
    ]
}

/// Who holds the lease, with which token, and whether it is still live.
#[derive(Debug, Default)]
struct Model {
    current: Option<(usize, i64)>,
    live: bool,
    next_nonce: i64,
}

async fn run_case(pool: &sqlx::PgPool, ops: &[Op]) -> Result<(), TestCaseError> {
    sqlx::query("TRUNCATE signer_lease, signer_nonce_cursor, recycled_nonces")
        .execute(pool)
        .await
        .map_err(|e| TestCaseError::fail(format!("truncate: {e}")))?;
    let signer = Signer::parse("0x00000000000000000000000000000000000000aa").expect("address");
    // Long enough that nothing expires on its own during a case.
    let cfg = LeaseConfig {
        duration: Duration::from_secs(60),
        renew_interval: Duration::from_secs(10),
        clock_skew: Duration::from_secs(1),
    };
    let managers: Vec<LeaseManager> = (0..NODES)
        .map(|i| {
            LeaseManager::new(
                pool.clone(),
                Role::Broadcaster,
                NodeId::named(format!("n{i}")),
                cfg,
            )
            .expect("cfg")
        })
        .collect();
    let mut leases: Vec<Option<HeldLease>> = vec![None; NODES];
    let mut m = Model::default();

    for (step, op) in ops.iter().enumerate() {
        let ctx = format!("step {step} {op:?} with model {m:?}");
        match *op {
            Op::Acquire(n) => {
                let got = managers[n]
                    .acquire(CHAIN, &signer)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("{ctx}: {e}")))?;
                let expected = match m.current {
                    None => Some(1),
                    Some((holder, t)) if holder == n => Some(if m.live { t } else { t + 1 }),
                    Some((_, t)) if !m.live => Some(t + 1),
                    Some(_) => None,
                };
                match (got, expected) {
                    (Acquisition::Held(l, _), Some(t)) => {
                        prop_assert_eq!(l.token(), FencingToken(t), "{}", ctx);
                        m.current = Some((n, t));
                        m.live = true;
                        leases[n] = Some(l);
                    }
                    (Acquisition::Busy { .. }, None) => {}
                    (got, expected) => prop_assert!(
                        false,
                        "{ctx}: got {got:?}, model expected token {expected:?}"
                    ),
                }
            }
            Op::Renew(n) => {
                let Some(l) = leases[n].clone() else { continue };
                let r = managers[n]
                    .renew(std::slice::from_ref(&l))
                    .await
                    .map_err(|e| TestCaseError::fail(format!("{ctx}: {e}")))?;
                let should = m.live && m.current == Some((n, l.token().0));
                prop_assert_eq!(r.renewed.len() == 1, should, "{}", ctx);
            }
            Op::Release(n) => {
                let Some(l) = leases[n].clone() else { continue };
                let released = managers[n]
                    .release(&l)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("{ctx}: {e}")))?;
                let should = m.current == Some((n, l.token().0));
                prop_assert_eq!(released, should, "{}", ctx);
                if should {
                    m.live = false;
                }
            }
            Op::Expire => {
                sqlx::query(
                    "UPDATE signer_lease SET expires_at = clock_timestamp() - interval '1 hour'",
                )
                .execute(pool)
                .await
                .map_err(|e| TestCaseError::fail(format!("{ctx}: {e}")))?;
                m.live = false;
            }
            Op::Write(n) => {
                let Some(l) = leases[n].clone() else { continue };
                let current = m.live && m.current == Some((n, l.token().0));
                let result = async {
                    let mut tx = l.begin(pool).await?;
                    let nonces = tx.allocate_nonces(1).await?;
                    tx.commit().await?;
                    Ok::<_, txflow_core::fenced::FenceError>(nonces)
                }
                .await;
                match result {
                    Ok(nonces) => {
                        prop_assert!(
                            current,
                            "{ctx}: a write succeeded without the current token"
                        );
                        prop_assert_eq!(nonces, vec![m.next_nonce], "{}", ctx);
                        m.next_nonce += 1;
                    }
                    Err(e) if e.is_fenced() => {
                        prop_assert!(!current, "{ctx}: the current holder was fenced")
                    }
                    Err(e) => prop_assert!(false, "{ctx}: {e:?}"),
                }
            }
        }
    }
    Ok(())
}

#[test]
fn a_write_succeeds_only_with_the_current_token() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let db = rt.block_on(TestDb::new());
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(op(), 1..40), |ops| {
        rt.block_on(run_case(&db.pool, &ops))
    });
    drop(db);
    if let Err(e) = result {
        panic!("{e}");
    }
}
