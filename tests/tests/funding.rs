//! The FUNDING adapter against real PostgreSQL (seed 004 §5.2, §9.3, and the adapter's share of
//! §10.3 BAL, §10.6 CON, §10.7 IDP and §10.8 FND): every outcome, idempotency by
//! `(req_id, op)` under real concurrency, and defence in depth (the adapter refuses what a
//! careless caller did not validate).

use std::sync::Arc;

use rust_decimal::Decimal;
use sqlx::PgPool;
use tokio::sync::Barrier;
use txflow_core::transfer::TransferCode;
use txflow_tests::TestDb;
use txflow_transfer_coordinator::funding::{
    AccountStatus, FundingAdapter, FundingCall, FundingError, FundingOutcome, load_assets,
};

const USER: &str = "user-1";

fn d(s: &str) -> Decimal {
    Decimal::from_str_exact(s).expect("test decimal")
}

/// USDT (8 places, 0.01 to 1 000 000), OLD (suspended), LOCK (no internal transfers).
async fn assets(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO assets (asset, places, min_amount, max_amount, status, internal_transfer_enabled) VALUES \
         ('USDT', 8, 0.01, 1000000, 'ACTIVE', true), \
         ('OLD', 8, 0.01, 1000000, 'SUSPENDED', true), \
         ('LOCK', 8, 0.01, 1000000, 'ACTIVE', false), \
         ('BIG', 0, 1, 1000000000000000000, 'ACTIVE', true)",
    )
    .execute(pool)
    .await
    .expect("insert assets");
}

async fn account(pool: &PgPool, user: &str, asset: &str, available: &str, status: &str) {
    sqlx::query(
        "INSERT INTO funding_balances (user_id, asset, available, status) \
         VALUES ($1, $2, $3::numeric, $4)",
    )
    .bind(user)
    .bind(asset)
    .bind(available)
    .bind(status)
    .execute(pool)
    .await
    .expect("insert account");
}

/// A database with the assets and USER's USDT account holding `available`.
async fn ledger(available: &str) -> (TestDb, FundingAdapter) {
    let db = TestDb::new().await;
    assets(&db.pool).await;
    account(&db.pool, USER, "USDT", available, "ACTIVE").await;
    let adapter = FundingAdapter::new(db.pool.clone());
    (db, adapter)
}

fn call<'a>(req_id: &'a str, amount: &'a str) -> FundingCall<'a> {
    FundingCall {
        req_id,
        user_id: USER,
        asset: "USDT",
        amount,
    }
}

async fn balance(adapter: &FundingAdapter) -> Decimal {
    adapter
        .balance(USER, "USDT")
        .await
        .expect("read balance")
        .expect("the account exists")
        .available
}

async fn operations(pool: &PgPool) -> Vec<(String, String, String, Option<String>)> {
    sqlx::query_as("SELECT req_id, op, outcome, code FROM transfer_operations ORDER BY req_id, op")
        .fetch_all(pool)
        .await
        .expect("read operations")
}

fn rejected(outcome: Result<FundingOutcome, FundingError>) -> TransferCode {
    match outcome.expect("the adapter answers") {
        FundingOutcome::Rejected(r) => r.code,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn applied(outcome: Result<FundingOutcome, FundingError>) {
    assert_eq!(
        outcome.expect("the adapter answers"),
        FundingOutcome::Applied
    );
}

#[tokio::test]
async fn withdraw_deposit_and_refund_apply_and_are_recorded() {
    let (db, adapter) = ledger("100").await;
    applied(adapter.withdraw(&call("t-1", "30.5")).await);
    assert_eq!(balance(&adapter).await, d("69.5"));
    applied(adapter.refund(&call("t-1", "30.5")).await);
    assert_eq!(balance(&adapter).await, d("100"));
    applied(adapter.deposit(&call("t-2", "0.01000001")).await);
    assert_eq!(balance(&adapter).await, d("100.01000001"));
    let ops = operations(&db.pool).await;
    let ops: Vec<(&str, &str, &str)> = ops
        .iter()
        .map(|(r, o, out, _)| (r.as_str(), o.as_str(), out.as_str()))
        .collect();
    assert_eq!(
        ops,
        [
            ("t-1", "REFUND", "APPLIED"),
            ("t-1", "WITHDRAW", "APPLIED"),
            ("t-2", "DEPOSIT", "APPLIED"),
        ]
    );
}

#[tokio::test]
async fn bal_001_amount_above_available_is_insufficient_balance_and_changes_nothing() {
    let (db, adapter) = ledger("10").await;
    assert_eq!(
        rejected(adapter.withdraw(&call("t-1", "10.00000001")).await),
        TransferCode::InsufficientBalance
    );
    assert_eq!(balance(&adapter).await, d("10"));
    // The refusal is recorded: the key is decided once.
    assert_eq!(
        operations(&db.pool).await,
        [(
            "t-1".to_string(),
            "WITHDRAW".to_string(),
            "REJECTED".to_string(),
            Some("INSUFFICIENT_BALANCE".to_string())
        )]
    );
}

#[tokio::test]
async fn bal_002_amount_equal_to_available_empties_the_balance() {
    let (_db, adapter) = ledger("25.5").await;
    applied(adapter.withdraw(&call("t-1", "25.50")).await);
    assert_eq!(balance(&adapter).await, Decimal::ZERO);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bal_003_concurrent_withdrawals_totalling_more_than_the_balance_one_succeeds() {
    let (db, _) = ledger("100").await;
    let adapter = FundingAdapter::new(db.pool(4).await);
    let barrier = Arc::new(Barrier::new(2));
    let mut tasks = Vec::new();
    for req in ["t-a", "t-b"] {
        let (adapter, barrier) = (adapter.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            adapter.withdraw(&call(req, "60")).await
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.expect("task").expect("the adapter answers"));
    }
    let applied = outcomes
        .iter()
        .filter(|o| **o == FundingOutcome::Applied)
        .count();
    let insufficient = outcomes
        .iter()
        .filter(|o| {
            matches!(o, FundingOutcome::Rejected(r) if r.code == TransferCode::InsufficientBalance)
        })
        .count();
    assert_eq!((applied, insufficient), (1, 1), "{outcomes:?}");
    assert_eq!(balance(&adapter).await, d("40"));
}

#[tokio::test]
async fn bal_004_frozen_account_refuses_withdrawal_but_receives_deposits() {
    let db = TestDb::new().await;
    assets(&db.pool).await;
    account(&db.pool, USER, "USDT", "50", "FROZEN").await;
    let adapter = FundingAdapter::new(db.pool.clone());
    assert_eq!(
        rejected(adapter.withdraw(&call("t-1", "1")).await),
        TransferCode::AccountFrozen
    );
    applied(adapter.deposit(&call("t-2", "1")).await);
    let b = adapter
        .balance(USER, "USDT")
        .await
        .expect("read")
        .expect("exists");
    assert_eq!((b.available, b.status), (d("51"), AccountStatus::Frozen));
}

#[tokio::test]
async fn bal_005_disabled_account_refuses_withdrawal_and_deposit() {
    let db = TestDb::new().await;
    assets(&db.pool).await;
    account(&db.pool, USER, "USDT", "50", "DISABLED").await;
    let adapter = FundingAdapter::new(db.pool.clone());
    assert_eq!(
        rejected(adapter.withdraw(&call("t-1", "1")).await),
        TransferCode::AccountDisabled
    );
    assert_eq!(
        rejected(adapter.deposit(&call("t-2", "1")).await),
        TransferCode::AccountDisabled
    );
    assert_eq!(balance(&adapter).await, d("50"));
}

#[tokio::test]
async fn missing_accounts_are_source_and_target_account_not_found() {
    let (_db, adapter) = ledger("1").await;
    let other = FundingCall {
        user_id: "user-2",
        ..call("t-1", "1")
    };
    assert_eq!(
        rejected(adapter.withdraw(&other).await),
        TransferCode::SourceAccountNotFound
    );
    let other = FundingCall {
        user_id: "user-2",
        ..call("t-2", "1")
    };
    assert_eq!(
        rejected(adapter.deposit(&other).await),
        TransferCode::TargetAccountNotFound
    );
    assert_eq!(
        adapter.balance("user-2", "USDT").await.expect("read"),
        None,
        "a deposit creates no FUNDING account (§1.5.5)"
    );
}

#[tokio::test]
async fn atk_009_and_asset_rules_are_enforced_by_the_adapter() {
    let (db, adapter) = ledger("100").await;
    account(&db.pool, USER, "OLD", "100", "ACTIVE").await;
    account(&db.pool, USER, "LOCK", "100", "ACTIVE").await;
    let on = |req_id, asset| FundingCall {
        asset,
        ..call(req_id, "1")
    };
    assert_eq!(
        rejected(adapter.withdraw(&on("t-1", "NOPE")).await),
        TransferCode::InvalidAsset
    );
    assert_eq!(
        rejected(adapter.withdraw(&on("t-2", "OLD")).await),
        TransferCode::AssetSuspended
    );
    assert_eq!(
        rejected(adapter.deposit(&on("t-3", "LOCK")).await),
        TransferCode::TransferNotAllowed
    );
    assert_eq!(
        rejected(adapter.withdraw(&call("t-4", "0.009")).await),
        TransferCode::AmountTooSmall
    );
    assert_eq!(
        rejected(adapter.deposit(&call("t-5", "1000000.00000001")).await),
        TransferCode::AmountTooLarge
    );
    assert_eq!(balance(&adapter).await, d("100"));
}

#[tokio::test]
async fn atk_003_004_005_006_malformed_amounts_are_refused_at_the_adapter_and_write_nothing() {
    // A caller that skipped validation: the adapter checks again (defence in depth, §1.5).
    let (db, adapter) = ledger("100").await;
    for (i, (amount, code)) in [
        ("-100", TransferCode::InvalidAmount),
        ("0", TransferCode::InvalidAmount),
        ("0.000000001", TransferCode::PrecisionOverflow),
        ("18446744073709551616", TransferCode::Overflow),
        ("1e2", TransferCode::InvalidAmount),
        ("NaN", TransferCode::InvalidAmount),
        ("1.5 ", TransferCode::InvalidAmount),
    ]
    .into_iter()
    .enumerate()
    {
        let req = format!("t-{i}");
        assert_eq!(
            rejected(adapter.withdraw(&call(&req, amount)).await),
            code,
            "withdraw {amount:?}"
        );
        assert_eq!(
            rejected(adapter.deposit(&call(&req, amount)).await),
            code,
            "deposit {amount:?}"
        );
        // A refund checks the amount's shape, not the asset's rules (they may have changed
        // since the withdrawal it undoes); an over-precise amount matches no withdrawal.
        let refund_code = match code {
            TransferCode::PrecisionOverflow => TransferCode::RefundWithoutWithdraw,
            other => other,
        };
        assert_eq!(
            rejected(adapter.refund(&call(&req, amount)).await),
            refund_code,
            "refund {amount:?}"
        );
    }
    for (req_id, user_id) in [("", USER), ("t 1", USER), ("t-1", ""), ("t-1", "a'; --")] {
        let bad = FundingCall {
            req_id,
            user_id,
            asset: "USDT",
            amount: "1",
        };
        assert_eq!(
            rejected(adapter.withdraw(&bad).await),
            TransferCode::InvalidRequest
        );
    }
    assert_eq!(balance(&adapter).await, d("100"));
    // Malformed input is refused before the transaction; the asset's precision is checked in
    // it, and that refusal is recorded (the key is decided), never an applied operation.
    for (req, op, outcome, code) in operations(&db.pool).await {
        assert_eq!(
            (outcome.as_str(), code.as_deref()),
            ("REJECTED", Some("PRECISION_OVERFLOW")),
            "{req} {op}"
        );
    }
}

#[tokio::test]
async fn idp_001_fnd_001_withdraw_twice_debits_once() {
    let (_db, adapter) = ledger("100").await;
    applied(adapter.withdraw(&call("t-1", "40")).await);
    assert_eq!(
        adapter.withdraw(&call("t-1", "40")).await.expect("answers"),
        FundingOutcome::AlreadyApplied
    );
    assert_eq!(balance(&adapter).await, d("60"));
}

#[tokio::test]
async fn idp_002_fnd_003_deposit_twice_credits_once() {
    let (_db, adapter) = ledger("0").await;
    applied(adapter.deposit(&call("t-1", "7.25")).await);
    assert_eq!(
        adapter
            .deposit(&call("t-1", "7.250"))
            .await
            .expect("answers"),
        FundingOutcome::AlreadyApplied,
        "the same amount written differently is the same request"
    );
    assert_eq!(balance(&adapter).await, d("7.25"));
}

#[tokio::test]
async fn idp_003_refund_twice_credits_once() {
    let (_db, adapter) = ledger("10").await;
    applied(adapter.withdraw(&call("t-1", "10")).await);
    applied(adapter.refund(&call("t-1", "10")).await);
    assert_eq!(
        adapter.refund(&call("t-1", "10")).await.expect("answers"),
        FundingOutcome::AlreadyApplied
    );
    assert_eq!(balance(&adapter).await, d("10"));
}

#[tokio::test]
async fn a_recorded_refusal_is_the_answer_to_every_repeat() {
    let (db, adapter) = ledger("5").await;
    assert_eq!(
        rejected(adapter.withdraw(&call("t-1", "10")).await),
        TransferCode::InsufficientBalance
    );
    // The money arrives later; the request was decided already (a transfer that went FAILED
    // on this answer must never see its withdrawal applied by a late retry).
    applied(adapter.deposit(&call("t-0", "100")).await);
    assert_eq!(
        rejected(adapter.withdraw(&call("t-1", "10")).await),
        TransferCode::InsufficientBalance
    );
    assert_eq!(balance(&adapter).await, d("105"));
    assert_eq!(operations(&db.pool).await.len(), 2);
}

#[tokio::test]
async fn a_repeat_with_other_parameters_is_duplicate_request() {
    let (db, adapter) = ledger("100").await;
    account(&db.pool, "user-2", "USDT", "100", "ACTIVE").await;
    applied(adapter.withdraw(&call("t-1", "10")).await);
    assert_eq!(
        rejected(adapter.withdraw(&call("t-1", "11")).await),
        TransferCode::DuplicateRequest
    );
    let other_user = FundingCall {
        user_id: "user-2",
        ..call("t-1", "10")
    };
    assert_eq!(
        rejected(adapter.withdraw(&other_user).await),
        TransferCode::DuplicateRequest
    );
    assert_eq!(balance(&adapter).await, d("90"));
    assert_eq!(
        adapter
            .balance("user-2", "USDT")
            .await
            .expect("read")
            .expect("exists")
            .available,
        d("100")
    );
}

#[tokio::test]
async fn a_refund_needs_its_applied_withdrawal_for_the_same_amount() {
    let (db, adapter) = ledger("10").await;
    // No withdrawal yet: refused, not recorded, so the real refund can come later.
    assert_eq!(
        rejected(adapter.refund(&call("t-1", "5")).await),
        TransferCode::RefundWithoutWithdraw
    );
    assert_eq!(balance(&adapter).await, d("10"));
    assert!(operations(&db.pool).await.is_empty());
    // A refused withdrawal is nothing to refund.
    assert_eq!(
        rejected(adapter.withdraw(&call("t-2", "50")).await),
        TransferCode::InsufficientBalance
    );
    assert_eq!(
        rejected(adapter.refund(&call("t-2", "50")).await),
        TransferCode::RefundWithoutWithdraw
    );
    // A deposit is nothing to refund either.
    applied(adapter.deposit(&call("t-3", "1")).await);
    assert_eq!(
        rejected(adapter.refund(&call("t-3", "1")).await),
        TransferCode::RefundWithoutWithdraw
    );
    // Another amount, or another user, than the withdrawal's.
    applied(adapter.withdraw(&call("t-1", "5")).await);
    assert_eq!(
        rejected(adapter.refund(&call("t-1", "4.99")).await),
        TransferCode::RefundAmountMismatch
    );
    account(&db.pool, "user-2", "USDT", "0", "ACTIVE").await;
    let other_user = FundingCall {
        user_id: "user-2",
        ..call("t-1", "5")
    };
    assert_eq!(
        rejected(adapter.refund(&other_user).await),
        TransferCode::RefundWithoutWithdraw
    );
    assert_eq!(balance(&adapter).await, d("6"));
    // The right refund still goes through.
    applied(adapter.refund(&call("t-1", "5")).await);
    assert_eq!(balance(&adapter).await, d("11"));
}

#[tokio::test]
async fn a_refund_returns_the_money_to_a_frozen_account_and_a_suspended_asset() {
    let (db, adapter) = ledger("10").await;
    applied(adapter.withdraw(&call("t-1", "4")).await);
    sqlx::query("UPDATE funding_balances SET status = 'FROZEN'")
        .execute(&db.pool)
        .await
        .expect("freeze");
    sqlx::query("UPDATE assets SET status = 'SUSPENDED' WHERE asset = 'USDT'")
        .execute(&db.pool)
        .await
        .expect("suspend");
    applied(adapter.refund(&call("t-1", "4")).await);
    assert_eq!(balance(&adapter).await, d("10"));
}

#[tokio::test]
async fn a_deposit_that_would_overflow_the_ledger_is_overflow() {
    let db = TestDb::new().await;
    assets(&db.pool).await;
    account(&db.pool, USER, "BIG", "99999999999999999999", "ACTIVE").await;
    let adapter = FundingAdapter::new(db.pool.clone());
    let big = FundingCall {
        asset: "BIG",
        ..call("t-1", "1")
    };
    assert_eq!(
        rejected(adapter.deposit(&big).await),
        TransferCode::Overflow
    );
    let b = adapter
        .balance(USER, "BIG")
        .await
        .expect("read")
        .expect("exists");
    assert_eq!(b.available, d("99999999999999999999"));
}

/// `n` tasks released together, each running `op` on its own clone of an adapter over a pool of
/// `connections`; their outcomes.
async fn at_once<F, Fut>(db: &TestDb, n: usize, connections: u32, op: F) -> Vec<FundingOutcome>
where
    F: Fn(FundingAdapter, usize) -> Fut,
    Fut: std::future::Future<Output = Result<FundingOutcome, FundingError>> + Send + 'static,
{
    let adapter = FundingAdapter::new(db.pool(connections).await);
    let barrier = Arc::new(Barrier::new(n));
    let mut tasks = Vec::new();
    for i in 0..n {
        let barrier = barrier.clone();
        let fut = op(adapter.clone(), i);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            fut.await
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.expect("task").expect("the adapter answers"));
    }
    outcomes
}

fn count(outcomes: &[FundingOutcome], want: &FundingOutcome) -> usize {
    outcomes.iter().filter(|o| *o == want).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idp_001_fnd_001_fifty_concurrent_withdrawals_of_one_request_apply_once() {
    let (db, adapter) = ledger("100").await;
    let outcomes = at_once(&db, 50, 20, |a, _| async move {
        a.withdraw(&call("t-1", "30")).await
    })
    .await;
    assert_eq!(
        count(&outcomes, &FundingOutcome::Applied),
        1,
        "{outcomes:?}"
    );
    assert_eq!(count(&outcomes, &FundingOutcome::AlreadyApplied), 49);
    assert_eq!(balance(&adapter).await, d("70"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idp_002_fnd_003_fifty_concurrent_deposits_of_one_request_credit_once() {
    let (db, adapter) = ledger("0").await;
    let outcomes = at_once(&db, 50, 20, |a, _| async move {
        a.deposit(&call("t-1", "2.5")).await
    })
    .await;
    assert_eq!(
        count(&outcomes, &FundingOutcome::Applied),
        1,
        "{outcomes:?}"
    );
    assert_eq!(count(&outcomes, &FundingOutcome::AlreadyApplied), 49);
    assert_eq!(balance(&adapter).await, d("2.5"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idp_003_twenty_concurrent_refunds_of_one_request_credit_once() {
    let (db, adapter) = ledger("10").await;
    applied(adapter.withdraw(&call("t-1", "10")).await);
    let outcomes = at_once(&db, 20, 20, |a, _| async move {
        a.refund(&call("t-1", "10")).await
    })
    .await;
    assert_eq!(
        count(&outcomes, &FundingOutcome::Applied),
        1,
        "{outcomes:?}"
    );
    assert_eq!(count(&outcomes, &FundingOutcome::AlreadyApplied), 19);
    assert_eq!(balance(&adapter).await, d("10"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn con_004_hundred_concurrent_withdrawals_never_overdraw() {
    // 100 requests of 1 against 50: exactly 50 apply, 50 are refused, the balance ends at 0
    // and never went below it (the CHECK would have failed a statement).
    let (db, adapter) = ledger("50").await;
    let outcomes = at_once(&db, 100, 20, |a, i| async move {
        let req = format!("t-{i}");
        a.withdraw(&call(&req, "1")).await
    })
    .await;
    let insufficient = outcomes
        .iter()
        .filter(|o| {
            matches!(o, FundingOutcome::Rejected(r) if r.code == TransferCode::InsufficientBalance)
        })
        .count();
    assert_eq!(
        count(&outcomes, &FundingOutcome::Applied),
        50,
        "{outcomes:?}"
    );
    assert_eq!(insufficient, 50);
    assert_eq!(balance(&adapter).await, Decimal::ZERO);
    let applied: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM transfer_operations WHERE op = 'WITHDRAW' AND outcome = 'APPLIED'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("count");
    assert_eq!(applied, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn con_002_concurrent_same_amount_requests_with_their_own_ids_both_apply() {
    let (db, adapter) = ledger("100").await;
    let outcomes = at_once(&db, 2, 2, |a, i| async move {
        let req = format!("same-{i}");
        a.withdraw(&call(&req, "25")).await
    })
    .await;
    assert_eq!(
        count(&outcomes, &FundingOutcome::Applied),
        2,
        "{outcomes:?}"
    );
    assert_eq!(balance(&adapter).await, d("50"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn withdrawals_and_deposits_interleaved_keep_the_sum() {
    // Transfers out and external credits at once on one balance: the result is the sum of
    // what was applied, exactly.
    let (db, adapter) = ledger("10").await;
    let outcomes = at_once(&db, 60, 20, |a, i| async move {
        let req = format!("t-{i}");
        if i % 2 == 0 {
            a.withdraw(&call(&req, "3")).await
        } else {
            a.deposit(&call(&req, "1")).await
        }
    })
    .await;
    let withdrawn = outcomes
        .iter()
        .step_by(2)
        .filter(|o| **o == FundingOutcome::Applied)
        .count();
    let deposited = outcomes
        .iter()
        .skip(1)
        .step_by(2)
        .filter(|o| **o == FundingOutcome::Applied)
        .count();
    assert_eq!(deposited, 30);
    let expected = d("10") + Decimal::from(deposited) - Decimal::from(3 * withdrawn);
    assert_eq!(balance(&adapter).await, expected);
    assert!(expected >= Decimal::ZERO);
}

#[tokio::test]
async fn the_asset_table_loads_from_the_assets_rows() {
    let db = TestDb::new().await;
    assets(&db.pool).await;
    let table = load_assets(&db.pool).await.expect("load");
    let usdt = table.rule("USDT").expect("USDT");
    assert_eq!((usdt.places, usdt.min_amount), (8, d("0.01")));
    assert_eq!(
        table.rule("NOPE").err().map(|r| r.code),
        Some(TransferCode::InvalidAsset)
    );
}

#[tokio::test]
async fn the_transfers_state_check_accepts_exactly_the_transfer_states() {
    use txflow_core::transfer::{Direction, TransferState};
    let db = TestDb::new().await;
    assets(&db.pool).await;
    for id in -40i16..=50 {
        let ok = sqlx::query(
            "INSERT INTO transfers (req_id, user_id, asset, amount, transfer_type, \
             source_account, target_account, state) \
             VALUES ($1, $2, 'USDT', 1, $3, 'FUNDING', 'SPOT', $4)",
        )
        .bind(format!("r{id}"))
        .bind(USER)
        .bind(Direction::FundingToSpot.transfer_type())
        .bind(id)
        .execute(&db.pool)
        .await
        .is_ok();
        assert_eq!(ok, TransferState::from_id(id).is_ok(), "state id {id}");
    }
    // The direction columns agree with each other.
    for (t, source, target, ok) in [
        (1i16, "FUNDING", "SPOT", true),
        (2, "SPOT", "FUNDING", true),
        (1, "SPOT", "FUNDING", false),
        (2, "SPOT", "SPOT", false),
    ] {
        let inserted = sqlx::query(
            "INSERT INTO transfers (req_id, user_id, asset, amount, transfer_type, \
             source_account, target_account) VALUES ($1, $2, 'USDT', 1, $3, $4, $5)",
        )
        .bind(format!("d-{t}-{source}-{target}"))
        .bind(USER)
        .bind(t)
        .bind(source)
        .bind(target)
        .execute(&db.pool)
        .await
        .is_ok();
        assert_eq!(inserted, ok, "{t} {source} -> {target}");
    }
    // A cid is unique per user, not across users.
    for (req, user, ok) in [
        ("c-1", "u-a", true),
        ("c-2", "u-b", true),
        ("c-3", "u-a", false),
    ] {
        let inserted = sqlx::query(
            "INSERT INTO transfers (req_id, cid, user_id, asset, amount, transfer_type, \
             source_account, target_account) VALUES ($1, 'cid-1', $2, 'USDT', 1, 1, 'FUNDING', 'SPOT')",
        )
        .bind(req)
        .bind(user)
        .execute(&db.pool)
        .await
        .is_ok();
        assert_eq!(inserted, ok, "{req} {user}");
    }
}

async fn movements(pool: &PgPool) -> Vec<(String, String, String, String)> {
    sqlx::query_as(
        "SELECT movement_id, user_id, amount::text, reason FROM funding_external_movements \
         ORDER BY movement_id",
    )
    .fetch_all(pool)
    .await
    .expect("read movements")
}

#[tokio::test]
async fn an_outside_movement_creates_the_account_and_credits_once() {
    let db = TestDb::new().await;
    assets(&db.pool).await;
    let adapter = FundingAdapter::new(db.pool.clone());
    assert_eq!(adapter.balance("user-9", "USDT").await.expect("read"), None);
    assert_eq!(
        adapter.external_sum("user-9", "USDT").await.expect("sum"),
        Decimal::ZERO
    );
    applied(
        adapter
            .external_movement("dep-1", "user-9", "USDT", "100.50", "on-chain deposit")
            .await,
    );
    let b = adapter
        .balance("user-9", "USDT")
        .await
        .expect("read")
        .expect("created by the movement");
    assert_eq!((b.available, b.status), (d("100.5"), AccountStatus::Active));
    // The same movement again: recognised, nothing moves.
    assert_eq!(
        adapter
            .external_movement("dep-1", "user-9", "USDT", "100.5", "on-chain deposit")
            .await
            .expect("answers"),
        FundingOutcome::AlreadyApplied
    );
    // The same id for another movement: refused.
    for (user, amount, reason) in [
        ("user-9", "100.6", "on-chain deposit"),
        ("user-8", "100.5", "on-chain deposit"),
        ("user-9", "-100.5", "on-chain deposit"),
        ("user-9", "100.5", "another reason"),
    ] {
        assert_eq!(
            rejected(
                adapter
                    .external_movement("dep-1", user, "USDT", amount, reason)
                    .await
            ),
            TransferCode::DuplicateRequest,
            "{user} {amount} {reason}"
        );
    }
    assert_eq!(
        adapter
            .balance("user-9", "USDT")
            .await
            .expect("read")
            .map(|b| b.available),
        Some(d("100.5"))
    );
    assert_eq!(adapter.balance("user-8", "USDT").await.expect("read"), None);
    assert_eq!(
        adapter.external_sum("user-9", "USDT").await.expect("sum"),
        d("100.5")
    );
    assert_eq!(movements(&db.pool).await.len(), 1);
}

#[tokio::test]
async fn an_outgoing_movement_beyond_the_balance_is_refused_and_recorded_nowhere() {
    let (db, adapter) = ledger("10").await;
    assert_eq!(
        rejected(
            adapter
                .external_movement("wd-1", USER, "USDT", "-10.00000001", "payout")
                .await
        ),
        TransferCode::InsufficientBalance
    );
    assert_eq!(balance(&adapter).await, d("10"));
    assert!(movements(&db.pool).await.is_empty(), "recorded nowhere");
    // Outgoing from an account that does not exist: nothing to take.
    assert_eq!(
        rejected(
            adapter
                .external_movement("wd-2", "user-7", "USDT", "-1", "payout")
                .await
        ),
        TransferCode::InsufficientBalance
    );
    assert_eq!(adapter.balance("user-7", "USDT").await.expect("read"), None);
    // The refused id is free: the same movement applies once the money is there.
    applied(
        adapter
            .external_movement("dep-1", USER, "USDT", "5", "deposit")
            .await,
    );
    applied(
        adapter
            .external_movement("wd-1", USER, "USDT", "-10.00000001", "payout")
            .await,
    );
    assert_eq!(balance(&adapter).await, d("4.99999999"));
    assert_eq!(
        adapter.external_sum(USER, "USDT").await.expect("sum"),
        d("-5.00000001"),
        "the seeded 10 came from no recorded movement"
    );
    assert_eq!(
        movements(&db.pool).await,
        [
            (
                "dep-1".to_string(),
                USER.to_string(),
                "5.000000000000000000".to_string(),
                "deposit".to_string()
            ),
            (
                "wd-1".to_string(),
                USER.to_string(),
                "-10.000000010000000000".to_string(),
                "payout".to_string()
            ),
        ]
    );
}

#[tokio::test]
async fn an_outside_movement_is_checked_against_its_asset_but_not_the_transfer_rules() {
    let (db, adapter) = ledger("0").await;
    account(&db.pool, USER, "OLD", "0", "FROZEN").await;
    for (id, asset, amount, want) in [
        ("m-1", "DOGE", "1", TransferCode::InvalidAsset),
        ("m-2", "usdt", "1", TransferCode::InvalidAsset),
        (
            "m-3",
            "USDT",
            "0.000000001",
            TransferCode::PrecisionOverflow,
        ),
        ("m-4", "USDT", "0", TransferCode::InvalidAmount),
        ("m-5", "USDT", "1e2", TransferCode::InvalidAmount),
        ("m 6", "USDT", "1", TransferCode::InvalidRequest),
        ("m-7", "BIG", "0.5", TransferCode::PrecisionOverflow),
    ] {
        assert_eq!(
            rejected(
                adapter
                    .external_movement(id, USER, asset, amount, "test")
                    .await
            ),
            want,
            "{id} {asset} {amount}"
        );
    }
    assert!(movements(&db.pool).await.is_empty());
    // Below the transfer minimum, on a suspended asset, into a frozen account: a movement, not
    // a transfer.
    applied(
        adapter
            .external_movement("m-8", USER, "USDT", "0.00000001", "dust")
            .await,
    );
    applied(
        adapter
            .external_movement("m-9", USER, "OLD", "3", "correction")
            .await,
    );
    applied(
        adapter
            .external_movement("m-10", USER, "OLD", "-1", "correction")
            .await,
    );
    assert_eq!(balance(&adapter).await, d("0.00000001"));
    let old = adapter
        .balance(USER, "OLD")
        .await
        .expect("read")
        .expect("exists");
    assert_eq!((old.available, old.status), (d("2"), AccountStatus::Frozen));
    assert_eq!(
        adapter.external_sum(USER, "OLD").await.expect("sum"),
        d("2")
    );
}

#[tokio::test]
async fn an_incoming_movement_that_would_overflow_the_ledger_is_refused() {
    let db = TestDb::new().await;
    assets(&db.pool).await;
    account(&db.pool, USER, "BIG", "99999999999999999999", "ACTIVE").await;
    let adapter = FundingAdapter::new(db.pool.clone());
    assert_eq!(
        rejected(
            adapter
                .external_movement("m-1", USER, "BIG", "1", "deposit")
                .await
        ),
        TransferCode::Overflow
    );
    assert!(movements(&db.pool).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_repeats_of_one_movement_apply_it_once() {
    let db = TestDb::new().await;
    assets(&db.pool).await;
    let outcomes = at_once(&db, 50, 20, |a, _| async move {
        a.external_movement("dep-1", USER, "USDT", "7.25", "deposit")
            .await
    })
    .await;
    assert_eq!(count(&outcomes, &FundingOutcome::Applied), 1);
    assert_eq!(count(&outcomes, &FundingOutcome::AlreadyApplied), 49);
    let adapter = FundingAdapter::new(db.pool.clone());
    assert_eq!(balance(&adapter).await, d("7.25"));
    assert_eq!(
        adapter.external_sum(USER, "USDT").await.expect("sum"),
        d("7.25")
    );
}

#[tokio::test]
async fn fnd_006_a_withdrawal_whose_commit_fails_leaves_neither_its_debit_nor_its_record() {
    let (db, adapter) = ledger("100").await;
    // A failure injected at COMMIT, after every statement of the withdrawal ran: a deferred
    // constraint trigger on its operation record.
    sqlx::raw_sql(
        "CREATE FUNCTION fail_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN RAISE EXCEPTION 'injected: the commit fails'; END $$; \
         CREATE CONSTRAINT TRIGGER fail_at_commit AFTER INSERT ON transfer_operations \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
         WHEN (NEW.req_id = 'partial-1') EXECUTE FUNCTION fail_at_commit();",
    )
    .execute(&db.pool)
    .await
    .expect("inject the commit failure");
    let failed = adapter.withdraw(&call("partial-1", "40")).await;
    assert!(
        matches!(failed, Err(FundingError::Db { .. })),
        "an error, never a refusal: {failed:?}"
    );
    // All or nothing: no debit and no record of a decision.
    assert_eq!(balance(&adapter).await, d("100"));
    assert_eq!(operations(&db.pool).await, Vec::new());
    // The caller retries the same key once the fault is gone: applied once.
    sqlx::raw_sql("DROP TRIGGER fail_at_commit ON transfer_operations")
        .execute(&db.pool)
        .await
        .expect("remove the fault");
    applied(adapter.withdraw(&call("partial-1", "40")).await);
    assert_eq!(
        adapter
            .withdraw(&call("partial-1", "40"))
            .await
            .expect("a repeat answers"),
        FundingOutcome::AlreadyApplied
    );
    assert_eq!(balance(&adapter).await, d("60"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn con_001_two_cas_racing_on_one_transfer_move_it_once_and_the_other_is_skipped() {
    use txflow_core::domain::{ChainId, NodeId};
    use txflow_core::lease::{Acquisition, LeaseConfig, LeaseManager};
    use txflow_core::role::Role;
    use txflow_core::transfer::{TransferState, Transition, lease_subject};
    use txflow_transfer_coordinator::store::{self, Announcement, Cas};

    let db = TestDb::new().await;
    assets(&db.pool).await;
    sqlx::query(
        "INSERT INTO transfers (req_id, user_id, asset, amount, transfer_type, source_account, \
                                target_account, state) \
         VALUES ('race-1', $1, 'USDT', 5, 1, 'FUNDING', 'SPOT', 10)",
    )
    .bind(USER)
    .execute(&db.pool)
    .await
    .expect("a transfer in SOURCE_PENDING");
    let leases = LeaseManager::new(
        db.pool.clone(),
        Role::TransferCoordinator,
        NodeId::named(format!("con-001-{}", uuid::Uuid::new_v4())),
        LeaseConfig::default(),
    )
    .expect("lease manager");
    let lease = match leases
        .acquire(ChainId(0), &lease_subject(USER))
        .await
        .expect("acquire")
    {
        Acquisition::Held(lease, _) => lease,
        busy => panic!("lease not acquired: {busy:?}"),
    };
    // Two workers at once, each in its own transaction, CAS the same transition: the second
    // waits on the first's row lock, then finds the state gone.
    let t = Transition::SOURCE_OK;
    let race = |n: u8| {
        let (pool, lease) = (db.pool.clone(), lease.clone());
        async move {
            let announcement = Announcement {
                event_id: uuid::Uuid::new_v4(),
                payload: serde_json::json!({"worker": n}),
            };
            let mut tx = lease.begin(&pool).await.expect("begin");
            let done = store::cas(&mut tx.writer(), "race-1", t, None, &announcement)
                .await
                .expect("a CAS answers");
            tx.commit().await.expect("commit");
            done
        }
    };
    let (a, b) = tokio::join!(race(1), race(2));
    let mut outcomes = [a, b];
    outcomes.sort_by_key(|c| matches!(c, Cas::Skipped(_)));
    assert_eq!(
        outcomes,
        [Cas::Moved, Cas::Skipped(TransferState::SourceDone)]
    );
    let (state, announced): (i16, i64) = sqlx::query_as(
        "SELECT (SELECT state FROM transfers WHERE req_id = 'race-1'), \
                (SELECT count(*) FROM transfer_outbox WHERE req_id = 'race-1')",
    )
    .fetch_one(&db.pool)
    .await
    .expect("read back");
    assert_eq!(state, TransferState::SourceDone.id());
    assert_eq!(announced, 1, "only the move that happened is announced");
}
