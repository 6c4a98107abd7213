//! The database agrees with the state machine of txflow-domain: the CHECK constraint of
//! `managed_tx.state` accepts exactly the states of `TxState`, and the partial unique index on
//! (chain, signer, nonce) covers exactly the states that hold a nonce (`TxState::holds_nonce`).
//! Checked by behaviour, against real PostgreSQL with the migrations applied.

use txflow_core::state::TxState;
use txflow_tests::TestDb;

const SIGNER: &str = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8";

async fn insert(db: &TestDb, request_id: &str, state: &str, nonce: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO managed_tx (tx_id, chain_id, signer, request_id, nonce, payload, state)
         VALUES ($1, 31337, $2, $3, $4, '{}'::jsonb, $5)",
    )
    .bind(uuid::Uuid::new_v4())
    .bind(SIGNER)
    .bind(request_id)
    .bind(nonce)
    .bind(state)
    .execute(&db.pool)
    .await
    .map(|_| ())
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

#[tokio::test]
async fn the_state_check_constraint_accepts_exactly_the_typed_states() {
    let db = TestDb::new().await;
    for (i, s) in TxState::ALL.into_iter().enumerate() {
        insert(&db, &format!("ok-{i}"), s.as_str(), 1000 + i as i64)
            .await
            .unwrap_or_else(|e| panic!("{s} refused by the CHECK constraint: {e}"));
    }
    for bogus in ["PENDING", "received", "DROPPED", ""] {
        let e = insert(&db, &format!("bad-{bogus}"), bogus, 1)
            .await
            .expect_err("a state outside TxState must be refused");
        assert_eq!(sqlstate(&e).as_deref(), Some("23514"), "{bogus:?}: {e}");
        assert!(TxState::parse(bogus).is_err());
    }
}

#[tokio::test]
async fn the_nonce_holder_index_covers_exactly_the_states_that_hold_a_nonce() {
    let db = TestDb::new().await;
    for (i, s) in TxState::ALL.into_iter().enumerate() {
        let nonce = i as i64;
        insert(&db, &format!("{s}-a"), s.as_str(), nonce)
            .await
            .expect("first row");
        let second = insert(&db, &format!("{s}-b"), s.as_str(), nonce).await;
        if s.holds_nonce() {
            let e = second.expect_err("two holders of one nonce");
            assert_eq!(sqlstate(&e).as_deref(), Some("23505"), "{s}: {e}");
        } else {
            second.unwrap_or_else(|e| panic!("{s} does not hold its nonce, yet: {e}"));
        }
    }
}
