//! The FUNDING adapter (seed 004 §5.2, §9.3): withdraw, deposit and refund on the PostgreSQL
//! funding ledger, each in one transaction, each applied at most once per `(req_id, op)`.
//!
//! One call:
//! 1. re-validates its input with the domain's checks (defence in depth; a refusal here writes
//!    nothing);
//! 2. claims its key: `INSERT INTO transfer_operations … ON CONFLICT DO NOTHING`. A concurrent
//!    call with the same key waits on that row until the first commits, then finds the record:
//!    a repeat returns the recorded decision (`AlreadyApplied`, or the recorded refusal) and
//!    changes nothing; a repeat with other parameters is `DUPLICATE_REQUEST`;
//! 3. locks the balance row (`SELECT … FOR UPDATE`), checks the asset and the account, and
//!    moves the balance with a guarded `UPDATE` (`available >= amount` for a debit), so no
//!    interleaving drives a balance negative (`CHECK (available >= 0)` stands behind it);
//! 4. commits the balance change and the record together, or — for a business refusal —
//!    records the refusal, so the key is decided once.
//!
//! A refund is the transfer's own WITHDRAW undone: it needs that WITHDRAW applied, for the same
//! user, asset and amount. Its refusals are not recorded (a refund refused because the withdraw
//! is not there yet may be retried), and it ignores the asset's status and the account's
//! FROZEN/DISABLED status: compensation must be able to return the money.
//!
//! An outside movement ([`FundingAdapter::external_movement`]) is money entering or leaving the
//! FUNDING ledger from outside the two ledgers (an on-chain deposit, a payout, an operator's
//! correction), not a transfer leg: recorded in `funding_external_movements` with its balance
//! change in one transaction, idempotent by `movement_id`. Their sum per (user, asset)
//! ([`FundingAdapter::external_sum`]) is the FUNDING share of what the conservation check
//! (seed 004 §7.2) expects the user to hold.
//!
//! Errors ([`FundingError`]) never mean "refused": the operation may or may not have committed
//! (a commit whose answer was lost), so the coordinator treats them as an unknown outcome and
//! retries the same key.

use rust_decimal::Decimal;
use sqlx::{PgPool, Postgres, Transaction};
use txflow_core::retry::{Classify, Retry};
use txflow_core::transfer::{
    AdapterResponse, Amount, AssetRule, AssetStatus, AssetTable, InvalidAssetRule, Rejected,
    TransferCode, check_amount, check_asset, check_asset_code, check_id, parse_amount,
};

/// The operations of the adapter, as `transfer_operations.op` stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FundingOp {
    Withdraw,
    Deposit,
    Refund,
}

impl FundingOp {
    pub const fn as_str(self) -> &'static str {
        match self {
            FundingOp::Withdraw => "WITHDRAW",
            FundingOp::Deposit => "DEPOSIT",
            FundingOp::Refund => "REFUND",
        }
    }
}

/// One call's parameters, as strings: the adapter trusts nothing its caller checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FundingCall<'a> {
    pub req_id: &'a str,
    pub user_id: &'a str,
    pub asset: &'a str,
    pub amount: &'a str,
}

/// What a call did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FundingOutcome {
    /// Applied now.
    Applied,
    /// Applied by an earlier call with this key and these parameters; nothing changed now.
    AlreadyApplied,
    /// Refused, certainly without effect: an invalid input, a business rule, or the recorded
    /// refusal of an earlier call with this key.
    Rejected(Rejected),
}

/// The account status of §1.5.5.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccountStatus {
    Active,
    Frozen,
    Disabled,
}

impl AccountStatus {
    pub const fn as_str(self) -> &'static str {
        match self {
            AccountStatus::Active => "ACTIVE",
            AccountStatus::Frozen => "FROZEN",
            AccountStatus::Disabled => "DISABLED",
        }
    }

    fn parse(s: &str) -> Result<AccountStatus, FundingError> {
        match s {
            "ACTIVE" => Ok(AccountStatus::Active),
            "FROZEN" => Ok(AccountStatus::Frozen),
            "DISABLED" => Ok(AccountStatus::Disabled),
            _ => Err(FundingError::Corrupt {
                what: "funding_balances.status",
                detail: bounded(s),
            }),
        }
    }
}

/// A FUNDING balance row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FundingBalance {
    pub available: Decimal,
    pub status: AccountStatus,
}

#[derive(Debug, thiserror::Error)]
pub enum FundingError {
    /// The database did not answer, or refused a statement: the outcome is unknown.
    #[error("funding ledger: {operation} failed")]
    Db {
        operation: &'static str,
        #[source]
        source: sqlx::Error,
    },
    /// A stored value the adapter cannot read: an operator must look.
    #[error("funding ledger: {what} holds an unreadable value {detail:?}")]
    Corrupt { what: &'static str, detail: String },
    /// An `assets` row the domain refuses.
    #[error("funding ledger: bad asset rule")]
    AssetRule(#[source] InvalidAssetRule),
}

impl Classify for FundingError {
    fn retry(&self) -> Retry {
        match self {
            FundingError::Db { .. } => Retry::Transient,
            FundingError::Corrupt { .. } | FundingError::AssetRule(_) => Retry::Permanent,
        }
    }
}

fn db(operation: &'static str) -> impl FnOnce(sqlx::Error) -> FundingError {
    move |source| FundingError::Db { operation, source }
}

fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

/// A stored `NUMERIC(38, 18)` read as text: trailing zeros dropped, then exact.
fn stored_decimal(what: &'static str, text: &str) -> Result<Decimal, FundingError> {
    let trimmed = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        text
    };
    Decimal::from_str_exact(trimmed).map_err(|_| FundingError::Corrupt {
        what,
        detail: bounded(text),
    })
}

type Tx = Transaction<'static, Postgres>;

/// How long one call waits for a row lock (the key's record, the balance row).
const LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '10s'";

/// The FUNDING adapter over one pool. Cheap to clone.
#[derive(Debug, Clone)]
pub struct FundingAdapter {
    pool: PgPool,
}

/// What the stateless checks accepted.
struct Checked<'a> {
    req_id: &'a str,
    user_id: &'a str,
    asset: &'a str,
    amount: Amount,
}

fn check<'a>(call: &FundingCall<'a>) -> Result<Checked<'a>, Rejected> {
    Ok(Checked {
        req_id: check_id("request id", call.req_id)?,
        user_id: check_id("user id", call.user_id)?,
        asset: check_asset_code(call.asset)?,
        amount: parse_amount(call.amount)?,
    })
}

/// The longest reason of an outside movement, in characters (the table's check).
const MAX_REASON: usize = 256;

/// An outside movement the stateless checks accepted: its magnitude in `checked.amount`.
struct Movement<'a> {
    checked: Checked<'a>,
    negative: bool,
    reason: &'a str,
}

fn check_movement<'a>(
    movement_id: &'a str,
    user_id: &'a str,
    asset: &'a str,
    amount: &'a str,
    reason: &'a str,
) -> Result<Movement<'a>, Rejected> {
    let (negative, magnitude) = match amount.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, amount),
    };
    let reason_ok = !reason.trim().is_empty()
        && reason.chars().count() <= MAX_REASON
        && !reason.chars().any(char::is_control);
    let checked = Checked {
        req_id: check_id("movement id", movement_id)?,
        user_id: check_id("user id", user_id)?,
        asset: check_asset_code(asset)?,
        amount: parse_amount(magnitude)?,
    };
    if !reason_ok {
        return Err(Rejected::new(
            TransferCode::InvalidRequest,
            format!("the reason is not 1 to {MAX_REASON} printable characters"),
        ));
    }
    Ok(Movement {
        checked,
        negative,
        reason,
    })
}

/// The asset's rule from `assets`, or INVALID_ASSET when it is not listed.
async fn read_asset(tx: &mut Tx, asset: &str) -> Result<Result<AssetRule, Rejected>, FundingError> {
    let row: Option<(i16, String, String, String, bool)> = sqlx::query_as(
        "SELECT places, min_amount::text, max_amount::text, status, internal_transfer_enabled \
         FROM assets WHERE asset = $1",
    )
    .bind(asset)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db("read asset"))?;
    let Some((places, min, max, status, enabled)) = row else {
        return Ok(Err(Rejected::new(
            TransferCode::InvalidAsset,
            "unknown asset",
        )));
    };
    Ok(Ok(asset_rule(asset, places, &min, &max, &status, enabled)?))
}

/// An outside movement's asset: listed, and the amount within its places.
async fn movement_places(tx: &mut Tx, c: &Checked<'_>) -> Result<Option<Rejected>, FundingError> {
    let rule = match read_asset(tx, c.asset).await? {
        Ok(rule) => rule,
        Err(unknown) => return Ok(Some(unknown)),
    };
    Ok((c.amount.places() > rule.places).then(|| {
        Rejected::new(
            TransferCode::PrecisionOverflow,
            format!("{} allows {} decimal places", rule.asset, rule.places),
        )
    }))
}

/// Records an outside movement under its id, or answers from the earlier record of that id.
async fn record_movement(
    tx: &mut Tx,
    m: &Movement<'_>,
    signed: &str,
) -> Result<Claim, FundingError> {
    let c = &m.checked;
    let inserted = sqlx::query(
        "INSERT INTO funding_external_movements (movement_id, user_id, asset, amount, reason) \
         VALUES ($1, $2, $3, $4::numeric, $5) ON CONFLICT (movement_id) DO NOTHING",
    )
    .bind(c.req_id)
    .bind(c.user_id)
    .bind(c.asset)
    .bind(signed)
    .bind(m.reason)
    .execute(&mut **tx)
    .await
    .map_err(db("record external movement"))?
    .rows_affected();
    if inserted == 1 {
        return Ok(Claim::Claimed);
    }
    let same: Option<(bool,)> = sqlx::query_as(
        "SELECT (user_id = $2 AND asset = $3 AND amount = $4::numeric AND reason = $5) \
         FROM funding_external_movements WHERE movement_id = $1",
    )
    .bind(c.req_id)
    .bind(c.user_id)
    .bind(c.asset)
    .bind(signed)
    .bind(m.reason)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db("read external movement"))?;
    match same {
        Some((true,)) => Ok(Claim::Decided(FundingOutcome::AlreadyApplied)),
        Some((false,)) => Ok(Claim::Decided(FundingOutcome::Rejected(Rejected::new(
            TransferCode::DuplicateRequest,
            "this movement id was applied with other parameters",
        )))),
        // Committed before ON CONFLICT gave up, and never deleted.
        None => Err(FundingError::Corrupt {
            what: "funding_external_movements",
            detail: format!("{} vanished", bounded(c.req_id)),
        }),
    }
}

/// How the key of a call stands.
enum Claim {
    /// This call owns the key: decide and record.
    Claimed,
    /// Decided before: the answer to give.
    Decided(FundingOutcome),
}

impl FundingAdapter {
    pub fn new(pool: PgPool) -> FundingAdapter {
        FundingAdapter { pool }
    }

    /// Debits `amount` from the user's FUNDING balance (the source leg of FUNDING → SPOT, §3.1).
    /// Refusals: the §1.5 input codes, `INVALID_ASSET`, `ASSET_SUSPENDED`,
    /// `TRANSFER_NOT_ALLOWED`, `SOURCE_ACCOUNT_NOT_FOUND`, `ACCOUNT_FROZEN`, `ACCOUNT_DISABLED`,
    /// `INSUFFICIENT_BALANCE`, `DUPLICATE_REQUEST`.
    pub async fn withdraw(&self, call: &FundingCall<'_>) -> Result<FundingOutcome, FundingError> {
        self.apply(FundingOp::Withdraw, call, true).await
    }

    /// Credits `amount` to the user's FUNDING balance (the target leg of SPOT → FUNDING, §3.2).
    /// The account must exist (`TARGET_ACCOUNT_NOT_FOUND`, §1.5.5) and not be DISABLED; a FROZEN
    /// account still receives. `OVERFLOW` when the balance would leave `NUMERIC(38, 18)`.
    pub async fn deposit(&self, call: &FundingCall<'_>) -> Result<FundingOutcome, FundingError> {
        self.apply(FundingOp::Deposit, call, true).await
    }

    /// [`FundingAdapter::deposit`] as the target leg of a transfer already under way (its source
    /// moved money): the asset's transfer rules (limits, status, internal transfers) are not
    /// applied again. They were checked when the transfer was admitted and its source taken, and
    /// a rule an operator changes in between must not roll back a transfer half done. The
    /// account's checks (exists, not DISABLED) and the idempotency of the key stand.
    pub async fn deposit_onward(
        &self,
        call: &FundingCall<'_>,
    ) -> Result<FundingOutcome, FundingError> {
        self.apply(FundingOp::Deposit, call, false).await
    }

    /// Credits back the amount of this `req_id`'s applied WITHDRAW (compensation, §3.1 step
    /// 10'). `REFUND_WITHOUT_WITHDRAW` when there is none for this user and asset,
    /// `REFUND_AMOUNT_MISMATCH` for another amount; neither is recorded.
    pub async fn refund(&self, call: &FundingCall<'_>) -> Result<FundingOutcome, FundingError> {
        self.apply(FundingOp::Refund, call, false).await
    }

    /// Applies an outside movement: `amount` is a signed exact decimal (`"100"`, `"-2.5"`),
    /// positive for money coming in. In one transaction it records the movement under
    /// `movement_id` and moves the balance: a positive movement creates the account if it is
    /// missing (ACTIVE, zero); a negative one needs `available >= -amount`. Neither the asset's
    /// transfer rules (limits, status, internal transfers) nor the account's status apply — they
    /// govern transfers; the caller of a movement owns its policy.
    ///
    /// A repeat of `movement_id` with the same parameters is `AlreadyApplied` and changes
    /// nothing; with others, `DUPLICATE_REQUEST`. Refusals — `INVALID_REQUEST` (ids, reason of 1
    /// to 256 characters), `INVALID_AMOUNT` (zero, malformed), `INVALID_ASSET`,
    /// `PRECISION_OVERFLOW` (more places than the asset), `INSUFFICIENT_BALANCE`, `OVERFLOW` —
    /// are recorded nowhere: the same `movement_id` may be applied later.
    pub async fn external_movement(
        &self,
        movement_id: &str,
        user_id: &str,
        asset: &str,
        amount: &str,
        reason: &str,
    ) -> Result<FundingOutcome, FundingError> {
        let m = match check_movement(movement_id, user_id, asset, amount, reason) {
            Ok(m) => m,
            Err(r) => return Ok(FundingOutcome::Rejected(r)),
        };
        let magnitude = m.checked.amount.to_string();
        let signed = if m.negative {
            format!("-{magnitude}")
        } else {
            magnitude.clone()
        };
        let mut tx = self.pool.begin().await.map_err(db("begin"))?;
        sqlx::query(LOCK_TIMEOUT)
            .execute(&mut *tx)
            .await
            .map_err(db("set lock timeout"))?;
        let refusal = match movement_places(&mut tx, &m.checked).await? {
            Some(r) => Some(r),
            None => match record_movement(&mut tx, &m, &signed).await? {
                Claim::Decided(outcome) => {
                    tx.rollback().await.map_err(db("rollback"))?;
                    return Ok(outcome);
                }
                Claim::Claimed if m.negative => {
                    let found = lock_balance(&mut tx, &m.checked).await?.is_some();
                    (!found || !subtract(&mut tx, &m.checked, &magnitude).await?).then(|| {
                        Rejected::new(
                            TransferCode::InsufficientBalance,
                            "the available balance is below the outgoing movement",
                        )
                    })
                }
                Claim::Claimed => {
                    sqlx::query(
                        "INSERT INTO funding_balances (user_id, asset) VALUES ($1, $2) \
                         ON CONFLICT (user_id, asset) DO NOTHING",
                    )
                    .bind(m.checked.user_id)
                    .bind(m.checked.asset)
                    .execute(&mut *tx)
                    .await
                    .map_err(db("create balance"))?;
                    if lock_balance(&mut tx, &m.checked).await?.is_none() {
                        return Err(FundingError::Corrupt {
                            what: "funding_balances",
                            detail: format!("{} {} vanished", bounded(user_id), bounded(asset)),
                        });
                    }
                    (!add(&mut tx, &m.checked, &magnitude).await?).then(overflow)
                }
            },
        };
        match refusal {
            None => {
                tx.commit().await.map_err(db("commit"))?;
                Ok(FundingOutcome::Applied)
            }
            Some(r) => {
                // Recorded nowhere: the movement's row goes with the rollback.
                tx.rollback().await.map_err(db("rollback"))?;
                Ok(FundingOutcome::Rejected(r))
            }
        }
    }

    /// The sum of the outside movements of a user in an asset (zero when there is none): what
    /// came into the FUNDING ledger from outside, less what left to the outside.
    pub async fn external_sum(&self, user_id: &str, asset: &str) -> Result<Decimal, FundingError> {
        let (sum,): (String,) = sqlx::query_as(
            "SELECT COALESCE(SUM(amount), 0)::text FROM funding_external_movements \
             WHERE user_id = $1 AND asset = $2",
        )
        .bind(user_id)
        .bind(asset)
        .fetch_one(&self.pool)
        .await
        .map_err(db("sum external movements"))?;
        stored_decimal("funding_external_movements.amount", &sum)
    }

    /// The FUNDING balance of a user in an asset, if the account exists.
    pub async fn balance(
        &self,
        user_id: &str,
        asset: &str,
    ) -> Result<Option<FundingBalance>, FundingError> {
        let row: Option<(String, String)> = sqlx::query_as(
            "SELECT available::text, status FROM funding_balances WHERE user_id = $1 AND asset = $2",
        )
        .bind(user_id)
        .bind(asset)
        .fetch_optional(&self.pool)
        .await
        .map_err(db("read balance"))?;
        row.map(|(available, status)| {
            Ok(FundingBalance {
                available: stored_decimal("funding_balances.available", &available)?,
                status: AccountStatus::parse(&status)?,
            })
        })
        .transpose()
    }

    /// One operation; `rules`: whether the asset's transfer rules apply (a refund's never do).
    async fn apply(
        &self,
        op: FundingOp,
        call: &FundingCall<'_>,
        rules: bool,
    ) -> Result<FundingOutcome, FundingError> {
        let c = match check(call) {
            Ok(c) => c,
            Err(r) => return Ok(FundingOutcome::Rejected(r)),
        };
        let amount = c.amount.to_string();
        let mut tx = self.pool.begin().await.map_err(db("begin"))?;
        // A call never waits without bound behind another transaction's locks: past this it
        // fails (transient, outcome known to be nothing) and is retried.
        sqlx::query(LOCK_TIMEOUT)
            .execute(&mut *tx)
            .await
            .map_err(db("set lock timeout"))?;
        match claim(&mut tx, op, &c, &amount).await? {
            Claim::Decided(outcome) => {
                tx.rollback().await.map_err(db("rollback"))?;
                return Ok(outcome);
            }
            Claim::Claimed => {}
        }
        let refusal = match op {
            FundingOp::Withdraw => debit(&mut tx, &c, &amount).await?,
            FundingOp::Deposit => credit(&mut tx, &c, &amount, rules).await?,
            FundingOp::Refund => match refund_check(&mut tx, &c, &amount).await? {
                Some(r) => {
                    // Not recorded: the claim goes with the rollback.
                    tx.rollback().await.map_err(db("rollback"))?;
                    return Ok(FundingOutcome::Rejected(r));
                }
                None => refund_credit(&mut tx, &c, &amount).await?,
            },
        };
        match refusal {
            None => {
                tx.commit().await.map_err(db("commit"))?;
                Ok(FundingOutcome::Applied)
            }
            Some(r) if op == FundingOp::Refund => {
                tx.rollback().await.map_err(db("rollback"))?;
                Ok(FundingOutcome::Rejected(r))
            }
            Some(r) => {
                sqlx::query(
                    "UPDATE transfer_operations SET outcome = 'REJECTED', code = $3 \
                     WHERE req_id = $1 AND op = $2",
                )
                .bind(c.req_id)
                .bind(op.as_str())
                .bind(r.code.as_str())
                .execute(&mut *tx)
                .await
                .map_err(db("record refusal"))?;
                tx.commit().await.map_err(db("commit"))?;
                Ok(FundingOutcome::Rejected(r))
            }
        }
    }
}

/// Claims `(req_id, op)`, or answers from its record.
async fn claim(
    tx: &mut Tx,
    op: FundingOp,
    c: &Checked<'_>,
    amount: &str,
) -> Result<Claim, FundingError> {
    let inserted = sqlx::query(
        "INSERT INTO transfer_operations (req_id, op, user_id, asset, amount, outcome) \
         VALUES ($1, $2, $3, $4, $5::numeric, 'APPLIED') \
         ON CONFLICT (req_id, op) DO NOTHING",
    )
    .bind(c.req_id)
    .bind(op.as_str())
    .bind(c.user_id)
    .bind(c.asset)
    .bind(amount)
    .execute(&mut **tx)
    .await
    .map_err(db("claim operation"))?
    .rows_affected();
    if inserted == 1 {
        return Ok(Claim::Claimed);
    }
    let recorded: Option<(String, Option<String>, bool)> = sqlx::query_as(
        "SELECT outcome, code, (user_id = $3 AND asset = $4 AND amount = $5::numeric) \
         FROM transfer_operations WHERE req_id = $1 AND op = $2",
    )
    .bind(c.req_id)
    .bind(op.as_str())
    .bind(c.user_id)
    .bind(c.asset)
    .bind(amount)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db("read operation"))?;
    let Some((outcome, code, same)) = recorded else {
        // The conflicting row is committed before ON CONFLICT gives up, and records are never
        // deleted; a missing row is a database that lost data.
        return Err(FundingError::Corrupt {
            what: "transfer_operations",
            detail: format!("{} {} vanished", bounded(c.req_id), op.as_str()),
        });
    };
    if !same {
        return Ok(Claim::Decided(FundingOutcome::Rejected(Rejected::new(
            TransferCode::DuplicateRequest,
            format!(
                "{} was decided for this request with other parameters",
                op.as_str()
            ),
        ))));
    }
    match (outcome.as_str(), code) {
        ("APPLIED", None) => Ok(Claim::Decided(FundingOutcome::AlreadyApplied)),
        ("REJECTED", Some(code)) => {
            let code = TransferCode::parse(&code).ok_or_else(|| FundingError::Corrupt {
                what: "transfer_operations.code",
                detail: bounded(&code),
            })?;
            Ok(Claim::Decided(FundingOutcome::Rejected(Rejected::new(
                code,
                format!("{} was refused for this request before", op.as_str()),
            ))))
        }
        (other, _) => Err(FundingError::Corrupt {
            what: "transfer_operations.outcome",
            detail: bounded(other),
        }),
    }
}

/// The asset's rule, checked for status and for the amount (§1.5.3, §1.5.4).
async fn asset_checks(tx: &mut Tx, c: &Checked<'_>) -> Result<Option<Rejected>, FundingError> {
    let rule = match read_asset(tx, c.asset).await? {
        Ok(rule) => rule,
        Err(unknown) => return Ok(Some(unknown)),
    };
    if let Err(r) = check_asset(&rule) {
        return Ok(Some(r));
    }
    Ok(check_amount(c.amount, &rule).err())
}

fn asset_rule(
    asset: &str,
    places: i16,
    min: &str,
    max: &str,
    status: &str,
    enabled: bool,
) -> Result<AssetRule, FundingError> {
    let status = AssetStatus::parse(status).ok_or_else(|| FundingError::Corrupt {
        what: "assets.status",
        detail: bounded(status),
    })?;
    AssetRule {
        asset: asset.to_string(),
        places: u32::try_from(places).map_err(|_| FundingError::Corrupt {
            what: "assets.places",
            detail: places.to_string(),
        })?,
        min_amount: stored_decimal("assets.min_amount", min)?,
        max_amount: stored_decimal("assets.max_amount", max)?,
        status,
        internal_transfer_enabled: enabled,
    }
    .validated()
    .map_err(FundingError::AssetRule)
}

/// Locks the balance row; `None` when the account does not exist.
async fn lock_balance(tx: &mut Tx, c: &Checked<'_>) -> Result<Option<AccountStatus>, FundingError> {
    let row: Option<(String,)> = sqlx::query_as(
        "SELECT status FROM funding_balances WHERE user_id = $1 AND asset = $2 FOR UPDATE",
    )
    .bind(c.user_id)
    .bind(c.asset)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db("lock balance"))?;
    row.map(|(s,)| AccountStatus::parse(&s)).transpose()
}

/// The largest balance `NUMERIC(38, 18)` holds is below 10^20.
const BALANCE_CEILING: &str = "100000000000000000000";

/// WITHDRAW: `None` when debited, or the refusal.
async fn debit(
    tx: &mut Tx,
    c: &Checked<'_>,
    amount: &str,
) -> Result<Option<Rejected>, FundingError> {
    if let Some(r) = asset_checks(tx, c).await? {
        return Ok(Some(r));
    }
    match lock_balance(tx, c).await? {
        None => {
            return Ok(Some(Rejected::new(
                TransferCode::SourceAccountNotFound,
                "no FUNDING account for this user and asset",
            )));
        }
        Some(AccountStatus::Frozen) => {
            return Ok(Some(Rejected::new(
                TransferCode::AccountFrozen,
                "the FUNDING account is frozen",
            )));
        }
        Some(AccountStatus::Disabled) => {
            return Ok(Some(Rejected::new(
                TransferCode::AccountDisabled,
                "the FUNDING account is disabled",
            )));
        }
        Some(AccountStatus::Active) => {}
    }
    Ok((!subtract(tx, c, amount).await?).then(|| {
        Rejected::new(
            TransferCode::InsufficientBalance,
            "the available balance is below the amount",
        )
    }))
}

/// Takes `amount` from a locked, existing balance; `false` when the balance is below it.
async fn subtract(tx: &mut Tx, c: &Checked<'_>, amount: &str) -> Result<bool, FundingError> {
    let debited = sqlx::query(
        "UPDATE funding_balances SET available = available - $3::numeric, updated_at = now() \
         WHERE user_id = $1 AND asset = $2 AND available >= $3::numeric",
    )
    .bind(c.user_id)
    .bind(c.asset)
    .bind(amount)
    .execute(&mut **tx)
    .await
    .map_err(db("debit balance"))?
    .rows_affected();
    Ok(debited == 1)
}

/// Adds `amount` to a locked, existing balance; `false` when the balance would overflow.
async fn add(tx: &mut Tx, c: &Checked<'_>, amount: &str) -> Result<bool, FundingError> {
    let credited = sqlx::query(
        "UPDATE funding_balances SET available = available + $3::numeric, updated_at = now() \
         WHERE user_id = $1 AND asset = $2 AND available + $3::numeric < $4::numeric",
    )
    .bind(c.user_id)
    .bind(c.asset)
    .bind(amount)
    .bind(BALANCE_CEILING)
    .execute(&mut **tx)
    .await
    .map_err(db("credit balance"))?
    .rows_affected();
    Ok(credited == 1)
}

fn overflow() -> Rejected {
    Rejected::new(
        TransferCode::Overflow,
        "the balance would exceed what the ledger holds",
    )
}

/// DEPOSIT: `None` when credited, or the refusal.
async fn credit(
    tx: &mut Tx,
    c: &Checked<'_>,
    amount: &str,
    rules: bool,
) -> Result<Option<Rejected>, FundingError> {
    if rules {
        if let Some(r) = asset_checks(tx, c).await? {
            return Ok(Some(r));
        }
    } else if let Err(unknown) = read_asset(tx, c.asset).await? {
        // A listed asset is still needed: the ledger keeps no balance of an unknown one.
        return Ok(Some(unknown));
    }
    match lock_balance(tx, c).await? {
        None => {
            return Ok(Some(Rejected::new(
                TransferCode::TargetAccountNotFound,
                "no FUNDING account for this user and asset",
            )));
        }
        Some(AccountStatus::Disabled) => {
            return Ok(Some(Rejected::new(
                TransferCode::AccountDisabled,
                "the FUNDING account is disabled",
            )));
        }
        Some(AccountStatus::Active | AccountStatus::Frozen) => {}
    }
    Ok((!add(tx, c, amount).await?).then(overflow))
}

/// The refund's preconditions: this request's WITHDRAW applied, for this user, asset and amount.
async fn refund_check(
    tx: &mut Tx,
    c: &Checked<'_>,
    amount: &str,
) -> Result<Option<Rejected>, FundingError> {
    let withdraw: Option<(bool, bool)> = sqlx::query_as(
        "SELECT (outcome = 'APPLIED' AND user_id = $2 AND asset = $3), amount = $4::numeric \
         FROM transfer_operations WHERE req_id = $1 AND op = 'WITHDRAW'",
    )
    .bind(c.req_id)
    .bind(c.user_id)
    .bind(c.asset)
    .bind(amount)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db("read withdrawal"))?;
    Ok(match withdraw {
        Some((true, true)) => None,
        Some((true, false)) => Some(Rejected::new(
            TransferCode::RefundAmountMismatch,
            "the refund's amount is not the withdrawal's",
        )),
        Some((false, _)) | None => Some(Rejected::new(
            TransferCode::RefundWithoutWithdraw,
            "no applied FUNDING withdrawal for this request, user and asset",
        )),
    })
}

/// REFUND, its preconditions met: `None` when credited back.
async fn refund_credit(
    tx: &mut Tx,
    c: &Checked<'_>,
    amount: &str,
) -> Result<Option<Rejected>, FundingError> {
    if lock_balance(tx, c).await?.is_none() {
        return Ok(Some(Rejected::new(
            TransferCode::SourceAccountNotFound,
            "the FUNDING account of the withdrawal is gone",
        )));
    }
    Ok((!add(tx, c, amount).await?).then(overflow))
}

/// The asset rules, for the gateway's and the coordinator's checks.
pub async fn load_assets(pool: &PgPool) -> Result<AssetTable, FundingError> {
    let rows: Vec<(String, i16, String, String, String, bool)> = sqlx::query_as(
        "SELECT asset, places, min_amount::text, max_amount::text, status, \
         internal_transfer_enabled FROM assets ORDER BY asset",
    )
    .fetch_all(pool)
    .await
    .map_err(db("read assets"))?;
    let rules = rows
        .iter()
        .map(|(asset, places, min, max, status, enabled)| {
            asset_rule(asset, *places, min, max, status, *enabled)
        })
        .collect::<Result<Vec<_>, _>>()?;
    AssetTable::new(rules).map_err(FundingError::AssetRule)
}

/// A FUNDING adapter result as a response of §2.3. An error is never an explicit failure: the
/// transaction may have committed with its answer lost, so its outcome is unknown.
pub fn funding_response(result: &Result<FundingOutcome, FundingError>) -> AdapterResponse {
    match result {
        Ok(FundingOutcome::Applied | FundingOutcome::AlreadyApplied) => AdapterResponse::Success,
        Ok(FundingOutcome::Rejected(r)) => AdapterResponse::ExplicitFail(r.code),
        Err(FundingError::Db { .. }) => AdapterResponse::NetworkError,
        Err(FundingError::Corrupt { .. } | FundingError::AssetRule(_)) => AdapterResponse::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use txflow_core::transfer::{Next, TransferState as S, decide};

    #[test]
    fn funding_results_read_as_responses() {
        let ok: Result<FundingOutcome, FundingError> = Ok(FundingOutcome::Applied);
        assert_eq!(funding_response(&ok), AdapterResponse::Success);
        let again: Result<FundingOutcome, FundingError> = Ok(FundingOutcome::AlreadyApplied);
        assert_eq!(funding_response(&again), AdapterResponse::Success);
        let refused: Result<FundingOutcome, FundingError> = Ok(FundingOutcome::Rejected(
            Rejected::new(TransferCode::InsufficientBalance, "low"),
        ));
        assert_eq!(
            funding_response(&refused),
            AdapterResponse::ExplicitFail(TransferCode::InsufficientBalance)
        );
        let lost: Result<FundingOutcome, FundingError> = Err(FundingError::Db {
            operation: "commit",
            source: sqlx::Error::PoolTimedOut,
        });
        assert_eq!(funding_response(&lost), AdapterResponse::NetworkError);
        let corrupt: Result<FundingOutcome, FundingError> =
            Err(FundingError::AssetRule(InvalidAssetRule {
                asset: "X".into(),
                why: "test",
            }));
        assert_eq!(funding_response(&corrupt), AdapterResponse::Unknown);
    }

    #[test]
    fn fnd_002_a_funding_error_in_target_pending_never_compensates() {
        // SPOT → FUNDING: the FUNDING deposit's commit answer is lost. Compensating now could
        // refund SPOT while FUNDING was credited: money from nothing.
        let lost: Result<FundingOutcome, FundingError> = Err(FundingError::Db {
            operation: "commit",
            source: sqlx::Error::PoolTimedOut,
        });
        assert!(matches!(
            decide(S::TargetPending, funding_response(&lost)),
            Next::Stay(_)
        ));
    }

    #[test]
    fn stored_numerics_read_exactly() {
        for (text, expected) in [
            ("100.000000000000000000", "100"),
            ("0.000000000000000001", "0.000000000000000001"),
            (
                "1000000000000000000.000000000000000000",
                "1000000000000000000",
            ),
            ("0", "0"),
            ("12.50", "12.5"),
        ] {
            assert_eq!(
                stored_decimal("t", text).expect("readable"),
                Decimal::from_str_exact(expected).expect("decimal"),
                "{text}"
            );
        }
        assert!(stored_decimal("t", "NaN").is_err());
    }

    #[test]
    fn malformed_input_is_refused_before_any_io() {
        let call = FundingCall {
            req_id: "r-1",
            user_id: "u-1",
            asset: "USDT",
            amount: "1",
        };
        assert!(check(&call).is_ok());
        for (bad, code) in [
            (
                FundingCall {
                    amount: "-1",
                    ..call
                },
                TransferCode::InvalidAmount,
            ),
            (
                FundingCall {
                    amount: "0",
                    ..call
                },
                TransferCode::InvalidAmount,
            ),
            (
                FundingCall {
                    amount: "1e3",
                    ..call
                },
                TransferCode::InvalidAmount,
            ),
            (
                FundingCall {
                    amount: "0.0000000000000000001",
                    ..call
                },
                TransferCode::PrecisionOverflow,
            ),
            (
                FundingCall { req_id: "", ..call },
                TransferCode::InvalidRequest,
            ),
            (
                FundingCall {
                    user_id: "a b",
                    ..call
                },
                TransferCode::InvalidRequest,
            ),
            (
                FundingCall {
                    asset: "usdt",
                    ..call
                },
                TransferCode::InvalidAsset,
            ),
        ] {
            assert_eq!(check(&bad).err().map(|r| r.code), Some(code), "{bad:?}");
        }
    }

    #[test]
    fn outside_movements_are_signed_and_checked_before_any_io() {
        let ok =
            |amount| check_movement("m-1", "u-1", "USDT", amount, "deposit").map(|m| m.negative);
        assert_eq!(ok("100").ok(), Some(false));
        assert_eq!(ok("-2.50").ok(), Some(true));
        let code = |id: &str, amount: &str, reason: &str| {
            check_movement(id, "u-1", "USDT", amount, reason)
                .err()
                .map(|r| r.code)
        };
        let long_reason = "r".repeat(MAX_REASON + 1);
        for (id, amount, reason, want) in [
            ("m-1", "0", "x", TransferCode::InvalidAmount),
            ("m-1", "-0", "x", TransferCode::InvalidAmount),
            ("m-1", "--1", "x", TransferCode::InvalidAmount),
            ("m-1", "+1", "x", TransferCode::InvalidAmount),
            ("m-1", "-1e3", "x", TransferCode::InvalidAmount),
            ("m-1", "", "x", TransferCode::InvalidAmount),
            ("m 1", "1", "x", TransferCode::InvalidRequest),
            ("m-1", "1", "", TransferCode::InvalidRequest),
            ("m-1", "1", "  ", TransferCode::InvalidRequest),
            ("m-1", "1", "a\nb", TransferCode::InvalidRequest),
            (
                "m-1",
                "1",
                long_reason.as_str(),
                TransferCode::InvalidRequest,
            ),
        ] {
            assert_eq!(
                code(id, amount, reason),
                Some(want),
                "{id:?} {amount:?} {reason:?}"
            );
        }
        assert_eq!(code("m-1", "1", &"r".repeat(MAX_REASON)), None);
    }
}
