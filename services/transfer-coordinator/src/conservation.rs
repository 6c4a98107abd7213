//! The conservation check of seed 004 §7.2, and the transfer alarms (MON-001…003).
//!
//! Per (user, asset) with a transfer: **funding available + spot balance + in flight** must equal
//! **what the ledgers' outside movements put in** (the FUNDING ledger's
//! `funding_external_movements` plus the spot ledger's net of external CREDITs and DEBITs).
//! In flight is the sum of the transfers in SOURCE_DONE. A transfer whose leg has an unknown
//! outcome (SOURCE_PENDING, TARGET_PENDING, COMPENSATING) holds its amount either in flight or
//! already in a balance, not yet known which: the pair is checked with each such amount counted
//! in or out — it balances when some choice of them makes up the difference — so a transfer
//! stuck with an unknown outcome never hides a violation. A pair whose transfers moved while its
//! balances were read is checked at the next run: the transfers are read before and after the
//! balances, and compared. The FUNDING balance and the FUNDING outside movements are read in one
//! statement (one snapshot), so an outside movement committed meanwhile is never half seen.
//!
//! A violation is recorded in `transfer_conservation_violations` (one open row per pair), logged
//! as CRITICAL and counted (`conservation_violations_total{asset}`); while a row is unresolved,
//! transfers are halted: the gateway refuses new ones and the coordinator starts none (those in
//! flight are finished). An operator resolves the row after investigating.

use std::sync::Arc;

use futures::StreamExt;
use rust_decimal::Decimal;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::spot::{SpotAdapter, SpotReadError};
use crate::store::{self, trim_numeric};

/// More transfers than this by one user in a minute is abnormal (MON-004, a WARNING alert).
pub const USER_RATE_PER_MINUTE: i64 = 60;

/// How many (user, asset) pairs one run checks at most (the most recently moved first).
const PAIRS_PER_RUN: i64 = 10_000;

/// How many pairs one run checks at once: each check is a few PostgreSQL reads and one BALANCE
/// round trip to the trading core, so pairs are checked concurrently, not one after another.
const PAIRS_AT_ONCE: usize = 16;

/// Why a pair could not be checked (it is checked again at the next run).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("conservation check: database")]
    Db(#[from] sqlx::Error),
    #[error("conservation check: spot ledger")]
    Spot(#[from] SpotReadError),
    #[error("conservation check: unreadable amount {0:?}")]
    Amount(String),
}

/// The transfers of one pair, as far as the check needs them.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
struct PairState {
    /// Sum of SOURCE_DONE amounts, as text.
    in_flight: String,
    /// The amounts (as text) of the transfers in a state whose leg outcome is unknown.
    unsettled: Vec<String>,
    /// Changes whenever a transfer of the pair moves.
    version: String,
}

/// What one run found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    pub checked: usize,
    pub skipped: usize,
    pub violations: Vec<Violation>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub user_id: String,
    pub asset: String,
    pub expected: Decimal,
    pub actual: Decimal,
}

fn dec(text: &str) -> Result<Decimal, CheckError> {
    Decimal::from_str_exact(trim_numeric(text)).map_err(|_| CheckError::Amount(text.into()))
}

/// Up to this many unknown outcomes in one pair are matched exactly (every subset); past it, the
/// difference is only bounded by their sum.
const EXACT_UNSETTLED: usize = 12;

/// Whether `missing` (expected − actual) is made up by the amounts of the transfers with an
/// unknown outcome, each either still in flight (counted) or already in a balance (not).
fn explained(missing: Decimal, unsettled: &[Decimal]) -> bool {
    if missing == Decimal::ZERO {
        return true;
    }
    let total: Decimal = unsettled.iter().copied().sum();
    if missing < Decimal::ZERO || missing > total {
        return false;
    }
    if unsettled.len() > EXACT_UNSETTLED {
        return true;
    }
    (1u32..(1u32 << unsettled.len())).any(|set| {
        let sum: Decimal = unsettled
            .iter()
            .enumerate()
            .filter(|(i, _)| set & (1 << i) != 0)
            .map(|(_, a)| *a)
            .sum();
        sum == missing
    })
}

/// The conservation check over one pool and the spot ledger.
pub struct Conservation {
    pool: PgPool,
    spot: Arc<SpotAdapter>,
}

impl Conservation {
    pub fn new(pool: PgPool, spot: Arc<SpotAdapter>) -> Conservation {
        Conservation { pool, spot }
    }

    async fn pair_state(&self, user: &str, asset: &str) -> Result<PairState, sqlx::Error> {
        sqlx::query_as(
            "SELECT COALESCE(SUM(amount) FILTER (WHERE state = 20), 0)::text AS in_flight, \
                    COALESCE(array_agg(amount::text ORDER BY req_id) \
                        FILTER (WHERE state IN (10, 30, -20)), '{}') AS unsettled, \
                    count(*)::text || '/' || COALESCE(max(updated_at)::text, '') || '/' || \
                    COALESCE(sum(state)::text, '') AS version \
             FROM transfers WHERE user_id = $1 AND asset = $2",
        )
        .bind(user)
        .bind(asset)
        .fetch_one(&self.pool)
        .await
    }

    /// The FUNDING balance (zero without an account) and the sum of the FUNDING outside
    /// movements of a pair, in one statement: one snapshot.
    async fn funding_side(
        &self,
        user: &str,
        asset: &str,
    ) -> Result<(Decimal, Decimal), CheckError> {
        let (available, outside): (String, String) = sqlx::query_as(
            "SELECT COALESCE((SELECT available FROM funding_balances \
                              WHERE user_id = $1 AND asset = $2), 0)::text, \
                    COALESCE((SELECT SUM(amount) FROM funding_external_movements \
                              WHERE user_id = $1 AND asset = $2), 0)::text",
        )
        .bind(user)
        .bind(asset)
        .fetch_one(&self.pool)
        .await?;
        Ok((dec(&available)?, dec(&outside)?))
    }

    /// Checks one pair: `Ok(None)` when it balances or cannot be judged now.
    async fn check_pair(&self, user: &str, asset: &str) -> Result<Option<Violation>, CheckError> {
        let before = self.pair_state(user, asset).await?;
        let (funding, funding_outside) = self.funding_side(user, asset).await?;
        let spot = self.spot.read_balance(user, asset).await?;
        let after = self.pair_state(user, asset).await?;
        if after != before {
            return Ok(None);
        }
        let in_flight = dec(&before.in_flight)?;
        let unsettled = before
            .unsettled
            .iter()
            .map(|a| dec(a))
            .collect::<Result<Vec<_>, _>>()?;
        let expected = funding_outside + spot.external_net;
        let actual = funding + spot.balance + in_flight;
        Ok(
            (!explained(expected - actual, &unsettled)).then(|| Violation {
                user_id: user.into(),
                asset: asset.into(),
                expected,
                actual,
            }),
        )
    }

    /// One run over the pairs with transfers; records and reports violations.
    pub async fn run_once(&self) -> Result<Report, CheckError> {
        let pairs: Vec<(String, String)> = sqlx::query_as(
            "SELECT user_id, asset FROM transfers GROUP BY user_id, asset \
             ORDER BY max(updated_at) DESC LIMIT $1",
        )
        .bind(PAIRS_PER_RUN)
        .fetch_all(&self.pool)
        .await?;
        let mut report = Report::default();
        let mut checks = futures::stream::iter(pairs)
            .map(|(user, asset)| async move {
                let checked = self.check_pair(&user, &asset).await;
                (user, asset, checked)
            })
            .buffer_unordered(PAIRS_AT_ONCE);
        while let Some((user, asset, checked)) = checks.next().await {
            match checked {
                Ok(Some(v)) => {
                    self.record(&v).await?;
                    report.violations.push(v);
                    report.checked += 1;
                }
                Ok(None) => report.checked += 1,
                Err(e) => {
                    tracing::warn!(%user, %asset, error = %e, "conservation check: pair not checked this time");
                    report.skipped += 1;
                }
            }
        }
        Ok(report)
    }

    async fn record(&self, v: &Violation) -> Result<(), sqlx::Error> {
        let detail = format!(
            "funding + spot + in flight = {}, outside movements = {}",
            v.actual, v.expected
        );
        let inserted = sqlx::query(
            "INSERT INTO transfer_conservation_violations (user_id, asset, expected, actual, detail) \
             VALUES ($1, $2, $3::numeric, $4::numeric, $5) \
             ON CONFLICT (user_id, asset) WHERE resolved_at IS NULL DO NOTHING",
        )
        .bind(&v.user_id)
        .bind(&v.asset)
        .bind(v.expected.to_string())
        .bind(v.actual.to_string())
        .bind(&detail)
        .execute(&self.pool)
        .await?
        .rows_affected();
        if inserted > 0 {
            txflow_core::metrics::get().conservation_violation(&v.asset);
            tracing::error!(
                user_id = %v.user_id, asset = %v.asset, expected = %v.expected, actual = %v.actual,
                "CRITICAL: conservation violated: transfers halted until an operator resolves it"
            );
        }
        Ok(())
    }

    /// Samples the transfer alarms' gauges (MON-001, MON-002, halted, MON-004).
    pub async fn sample(&self) -> Result<(), sqlx::Error> {
        let (stuck, refunds): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state = 30 AND created_at < now() - interval '1 minute'), \
                    count(*) FILTER (WHERE state = -20 AND retry_count >= 3) \
             FROM transfers WHERE state IN (30, -20)",
        )
        .fetch_one(&self.pool)
        .await?;
        let (busy,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM (SELECT user_id FROM transfers \
             WHERE created_at > now() - interval '1 minute' \
             GROUP BY user_id HAVING count(*) > $1) busy",
        )
        .bind(USER_RATE_PER_MINUTE)
        .fetch_one(&self.pool)
        .await?;
        let halted = store::halted(&self.pool).await?;
        let m = txflow_core::metrics::get();
        m.transfer_attention("target_pending_1m", u64::try_from(stuck).unwrap_or(0));
        m.transfer_attention("refund_failed_3", u64::try_from(refunds).unwrap_or(0));
        m.transfer_attention("halted", u64::from(halted));
        m.transfer_attention("user_rate_1m", u64::try_from(busy).unwrap_or(0));
        Ok(())
    }

    /// Every `every` until `shutdown`: re-reads the asset rules for the SPOT adapter, runs the
    /// check and samples the alarms.
    pub async fn run(self, every: std::time::Duration, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            // Asset rules added or changed since the start reach the SPOT adapter's checks.
            match crate::funding::load_assets(&self.pool).await {
                Ok(assets) => self.spot.set_assets(assets),
                Err(e) => {
                    tracing::warn!(error = %e, "asset rules not re-read; keeping the previous ones")
                }
            }
            if let Err(e) = self.run_once().await {
                tracing::warn!(error = %e, "conservation check failed; trying again next period");
            }
            if let Err(e) = self.sample().await {
                tracing::warn!(error = %e, "transfer alarms not sampled");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Decimal {
        Decimal::from_str_exact(s).expect("decimal")
    }

    #[test]
    fn a_difference_is_explained_only_by_some_of_the_unknown_outcomes() {
        assert!(explained(d("0"), &[]));
        assert!(!explained(d("1"), &[]));
        assert!(!explained(d("-1"), &[d("5")]), "money from nowhere");
        assert!(explained(d("5"), &[d("5")]), "the amount still in flight");
        assert!(explained(d("0"), &[d("5")]), "the amount already landed");
        assert!(explained(d("7"), &[d("5"), d("2"), d("10")]));
        assert!(
            !explained(d("6"), &[d("5"), d("2"), d("10")]),
            "no subset sums to 6"
        );
        assert!(
            !explained(d("18"), &[d("5"), d("2"), d("10")]),
            "more than all of them"
        );
    }
}
