//! `txflow chaos --transfers`: internal transfers between the FUNDING ledger (PostgreSQL) and the
//! spot ledger, asked of the HTTP gateway by users with tokens of their own, while the schedule
//! kills the coordinators and the ledger, pauses coordinators past the lease and changes the
//! asset's rules; and what the oracle needs at the end (the rows, each ledger's balances).
//!
//! The users' money comes from outside, as a bank's deposits would: a FUNDING outside movement
//! and a SPOT outside credit per user, through the coordinator's own adapters. Everything else
//! goes through the gateway, as an upstream team's would.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use txflow_domain::transfer::{AdapterResponse, TransferState};
use txflow_transfer_coordinator::funding::{FundingAdapter, FundingOutcome, load_assets};
use txflow_transfer_coordinator::spot::{SpotAdapter, SpotAdapterConfig, SpotCall};

use crate::oracle::{Answer, Ledgers, Micros, Submitted, TransferRecord, micros};
use crate::rng::Rng;
use crate::schedule::RuleChange;

/// The one asset the workload moves, and its rules when no operator has changed them.
pub const ASSET: &str = "USDT";
const MAX_AMOUNT: &str = "1000000000";
/// While a `lower_max` change stands: below most of the workload's amounts.
const LOWERED_MAX: &str = "5";
/// Each user's outside movements.
const FUNDING_START: &str = "100";
const SPOT_START: &str = "50";
/// Users of the workload.
const USERS: usize = 4;

/// The settings every process of a run with transfers gets (the pipeline's roles ignore them).
pub fn env(dir: &std::path::Path) -> Vec<(String, String)> {
    [
        (
            "TXFLOW_SPOT_WAL_DIR",
            dir.join("spot-wal").display().to_string(),
        ),
        ("TXFLOW_SPOT_ASSETS", format!("{ASSET}:6")),
        // An unknown outcome is retried every second, and the conservation check runs as often.
        ("TXFLOW_TRANSFER_STALE_MS", "1000".to_string()),
        ("TXFLOW_SPOT_TIMEOUT_MS", "1500".to_string()),
        ("TXFLOW_TRANSFER_CHECK_INTERVAL_MS", "1000".to_string()),
        // The workload's users are few and busy: no daily or per-second limit gets in the way.
        ("TXFLOW_GATEWAY_DAILY_COUNT", "1000000".to_string()),
        ("TXFLOW_GATEWAY_RATE_PER_SEC", "1000".to_string()),
        ("TXFLOW_GATEWAY_RATE_BURST", "1000".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The asset's rules as an operator sets them (`None`: restored).
pub async fn set_rules(db: &sqlx::PgPool, change: Option<RuleChange>) -> anyhow::Result<()> {
    let (max, status, enabled) = match change {
        None => (MAX_AMOUNT, "ACTIVE", true),
        Some(RuleChange::LowerMax) => (LOWERED_MAX, "ACTIVE", true),
        Some(RuleChange::Suspend) => (MAX_AMOUNT, "SUSPENDED", true),
        Some(RuleChange::DisableTransfers) => (MAX_AMOUNT, "ACTIVE", false),
    };
    sqlx::query(
        "UPDATE assets SET max_amount = $2::numeric, status = $3, \
         internal_transfer_enabled = $4, updated_at = now() WHERE asset = $1",
    )
    .bind(ASSET)
    .bind(max)
    .bind(status)
    .bind(enabled)
    .execute(db)
    .await
    .context("change the asset's rules")?;
    Ok(())
}

/// Restores the rules, retrying (PostgreSQL may be down) for up to a minute.
pub async fn restore_rules(db: &sqlx::PgPool) -> anyhow::Result<()> {
    let mut last = None;
    for _ in 0..120 {
        match set_rules(db, None).await {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("the asset's rules were not restored")))
}

/// txflow's open conservation alarms (while one is open, transfers are halted).
pub async fn open_alarms(db: &sqlx::PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM transfer_conservation_violations WHERE resolved_at IS NULL",
    )
    .fetch_one(db)
    .await?)
}

/// The users, their tokens and the transfers asked so far.
pub struct TransferLoad {
    rng: Rng,
    users: Vec<String>,
    tokens: Vec<String>,
    http: reqwest::Client,
    url: String,
    total: u64,
    asked: Vec<JoinHandle<Submitted>>,
    give_up: Arc<AtomicBool>,
}

impl TransferLoad {
    /// The workload's users, in order.
    pub fn users() -> Vec<String> {
        (0..USERS).map(|i| format!("chaos-user-{i}")).collect()
    }

    /// Lists the asset and puts each user's money in both ledgers (the spot ledger must be
    /// starting: it is waited for). `tokens`: a bearer token (scope `transfer`) per user of
    /// [`TransferLoad::users`].
    pub async fn start(
        seed: u64,
        total: u64,
        db: &sqlx::PgPool,
        spot: SpotAdapterConfig,
        gateway_port: u16,
        tokens: Vec<String>,
    ) -> anyhow::Result<TransferLoad> {
        sqlx::query(
            "INSERT INTO assets (asset, places, min_amount, max_amount) \
             VALUES ($1, 6, 0.000001, $2::numeric) ON CONFLICT DO NOTHING",
        )
        .bind(ASSET)
        .bind(MAX_AMOUNT)
        .execute(db)
        .await
        .context("list the asset")?;
        let users = TransferLoad::users();
        anyhow::ensure!(tokens.len() == users.len(), "a token per user");
        let funding = FundingAdapter::new(db.clone());
        let adapter = SpotAdapter::start(spot, load_assets(db).await?).await?;
        let funded = fund(&users, &funding, &adapter).await;
        adapter.close().await;
        funded?;
        Ok(TransferLoad {
            rng: Rng::new(seed ^ 0x7EA5_F3E5),
            users,
            tokens,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            url: format!("http://127.0.0.1:{gateway_port}"),
            total,
            asked: Vec::new(),
            give_up: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Asks for the transfers due by `fraction` of the run (0 to 1): each from a user drawn
    /// from the seed, in a direction and of an amount drawn too (0.01 to 40: some are more
    /// than the source holds). Each is sent by a task of its own, again with the same `cid`
    /// until the gateway answers for good.
    pub fn ask_due(&mut self, fraction: f64) {
        let due = ((fraction.min(1.0) * self.total as f64) as u64).min(self.total);
        while (self.asked.len() as u64) < due {
            let n = self.asked.len();
            let u = self.rng.below(self.users.len() as u64) as usize;
            let (from, to) = if self.rng.chance(60) {
                ("FUNDING", "SPOT")
            } else {
                ("SPOT", "FUNDING")
            };
            let cents = 1 + self.rng.below(4_000);
            let ask = Ask {
                user: self.users[u].clone(),
                token: self.tokens[u].clone(),
                cid: format!("chaos-t-{n}"),
                body: serde_json::json!({
                    "from": from,
                    "to": to,
                    "asset": ASSET,
                    "amount": format!("{}.{:02}", cents / 100, cents % 100),
                    "cid": format!("chaos-t-{n}"),
                }),
            };
            let (http, url, give_up) = (self.http.clone(), self.url.clone(), self.give_up.clone());
            self.asked.push(tokio::spawn(ask.send(http, url, give_up)));
        }
    }

    /// Every transfer due is asked and answered for good.
    pub fn all_answered(&self) -> bool {
        self.asked.len() as u64 >= self.total && self.asked.iter().all(|h| h.is_finished())
    }

    /// No transfer of the workload's users is still under way in PostgreSQL.
    pub async fn all_ended(&self, db: &sqlx::PgPool) -> anyhow::Result<bool> {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM transfers WHERE user_id = ANY($1) AND state NOT IN ($2, $3, $4)",
        )
        .bind(&self.users)
        .bind(TransferState::Committed.id())
        .bind(TransferState::Failed.id())
        .bind(TransferState::RolledBack.id())
        .fetch_one(db)
        .await?;
        Ok(open == 0)
    }

    /// A line for the progress output.
    pub async fn status(&self, db: &sqlx::PgPool) -> String {
        let rows: Vec<(i16, i64)> = sqlx::query_as(
            "SELECT state, count(*) FROM transfers WHERE user_id = ANY($1) GROUP BY state ORDER BY state",
        )
        .bind(&self.users)
        .fetch_all(db)
        .await
        .unwrap_or_default();
        let states: Vec<String> = rows
            .iter()
            .map(|(s, n)| {
                let name = TransferState::from_id(*s).map_or("?", |s| s.as_str());
                format!("{name} {n}")
            })
            .collect();
        format!(
            "transfers asked {}/{}: {}",
            self.asked.len(),
            self.total,
            states.join(", ")
        )
    }

    /// Stops asking (what is unanswered stays so) and gathers what the oracle needs: the
    /// answers, the rows, each user's balances on both ledgers (the spot ledger's through a
    /// BALANCE command, so it must be running) and txflow's open conservation alarms.
    pub async fn finish(
        self,
        db: &sqlx::PgPool,
        spot: SpotAdapterConfig,
    ) -> anyhow::Result<Finished> {
        self.give_up.store(true, Ordering::SeqCst);
        let mut submitted = Vec::new();
        for h in self.asked {
            submitted.push(h.await.context("a transfer's task")?);
        }
        type Row = (String, String, String, String, String, i16, Option<String>);
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT req_id, user_id, source_account, target_account, amount::text, state, \
             error_code FROM transfers WHERE user_id = ANY($1)",
        )
        .bind(&self.users)
        .fetch_all(db)
        .await
        .context("read the transfers")?;
        let mut records = Vec::new();
        for (req_id, user, from, to, amount, state, error_code) in rows {
            records.push(TransferRecord {
                amount: micros(&amount)
                    .with_context(|| format!("transfer {req_id}'s amount {amount}"))?,
                state: TransferState::from_id(state)
                    .map_err(|e| anyhow::anyhow!("transfer {req_id}: unknown state {}", e.0))?,
                req_id,
                user,
                from,
                to,
                error_code,
            });
        }
        let funding = FundingAdapter::new(db.clone());
        let adapter = SpotAdapter::start(spot, load_assets(db).await?).await?;
        let mut ledgers = Vec::new();
        for user in &self.users {
            let f = funding
                .balance(user, ASSET)
                .await?
                .and_then(|b| micros(&b.available.to_string()));
            let mut s = None;
            for _ in 0..30 {
                match adapter.read_balance(user, ASSET).await {
                    Ok(b) => {
                        s = micros(&b.balance.to_string());
                        break;
                    }
                    Err(e) => {
                        eprintln!("chaos: reading {user}'s SPOT balance: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            ledgers.push(Ledgers {
                user: user.clone(),
                funding: f,
                spot: s,
                outside_funding: start(FUNDING_START),
                outside_spot: start(SPOT_START),
            });
        }
        adapter.close().await;
        let alarms = open_alarms(db)
            .await
            .context("count the open conservation violations")?;
        Ok(Finished {
            submitted,
            records,
            ledgers,
            alarms,
        })
    }
}

/// What the oracle judges the transfers on.
pub struct Finished {
    pub submitted: Vec<Submitted>,
    pub records: Vec<TransferRecord>,
    pub ledgers: Vec<Ledgers>,
    pub alarms: i64,
}

fn start(amount: &str) -> Micros {
    micros(amount).unwrap_or_default()
}

/// Each user's outside movements, retried while the spot ledger starts (each is idempotent by
/// its id).
async fn fund(
    users: &[String],
    funding: &FundingAdapter,
    spot: &SpotAdapter,
) -> anyhow::Result<()> {
    for user in users {
        let outcome = funding
            .external_movement(
                &format!("chaos-deposit-{user}"),
                user,
                ASSET,
                FUNDING_START,
                "chaos deposit",
            )
            .await?;
        anyhow::ensure!(
            matches!(
                outcome,
                FundingOutcome::Applied | FundingOutcome::AlreadyApplied
            ),
            "the FUNDING deposit for {user} was refused: {outcome:?}"
        );
        let req = format!("chaos-credit-{user}");
        let call = SpotCall {
            req_id: &req,
            user_id: user,
            asset: ASSET,
            amount: SPOT_START,
        };
        let mut answered = false;
        for _ in 0..60 {
            let answer = spot
                .external(&call, txflow_domain::events::SpotOp::Credit)
                .await;
            match answer.response {
                AdapterResponse::Success => {
                    answered = true;
                    break;
                }
                AdapterResponse::ExplicitFail(_) => {
                    anyhow::bail!("the SPOT credit for {user} was refused: {answer:?}")
                }
                _ => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
        anyhow::ensure!(
            answered,
            "the spot ledger did not apply {user}'s credit within a minute"
        );
    }
    Ok(())
}

/// One transfer to ask for.
struct Ask {
    user: String,
    token: String,
    cid: String,
    body: serde_json::Value,
}

impl Ask {
    /// POSTs until the gateway answers for good: 2xx (accepted, or the same `cid` answered
    /// again) or a 4xx the request earned; a 429, a 5xx or no answer is tried again a second
    /// later, until `give_up`.
    async fn send(self, http: reqwest::Client, url: String, give_up: Arc<AtomicBool>) -> Submitted {
        let mut last = String::new();
        while !give_up.load(Ordering::SeqCst) {
            let answer = http
                .post(format!("{url}/api/v1/internal_transfer"))
                .bearer_auth(&self.token)
                .json(&self.body)
                .send()
                .await;
            match answer {
                Ok(a) => {
                    let status = a.status();
                    let body: serde_json::Value = a.json().await.unwrap_or_default();
                    let code = body["code"].as_str().unwrap_or_default().to_string();
                    if status.is_success() {
                        let answer = match body["req_id"].as_str() {
                            Some(id) => Answer::Accepted(id.to_string()),
                            None => {
                                Answer::Unanswered(format!("{status} without a req_id: {body}"))
                            }
                        };
                        return self.answered(answer);
                    }
                    if status.is_client_error() && status != reqwest::StatusCode::TOO_MANY_REQUESTS
                    {
                        return self
                            .answered(Answer::Refused(format!("{} {code}", status.as_u16())));
                    }
                    last = format!("{} {code}", status.as_u16());
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        self.answered(Answer::Unanswered(last))
    }

    fn answered(self, answer: Answer) -> Submitted {
        Submitted {
            user: self.user,
            cid: self.cid,
            answer,
        }
    }
}
