//! The spot ledger's decisions, pure (no I/O): the in-memory [`Ledger`] (balances, frozen
//! accounts, the processed-operation set), what a command does to it ([`decide`]) and how a
//! recorded operation changes it ([`Ledger::apply`], the same on the live path and when the
//! write-ahead log is replayed at start).
//!
//! Idempotency (seed 004 §5.3): every CREDIT, DEBIT, FREEZE and UNFREEZE is decided once under
//! its key `(req_id, op)` and the decision — applied, or rejected with its code — is recorded.
//! A repeat of the key gets the recorded answer and changes nothing, whatever the ledger's state
//! is by then; a repeat with other parameters is refused (`DUPLICATE_REQUEST`) and not recorded.
//!
//! Outside movements (issue 18, the conservation check of seed 004 §7.2): a CREDIT or DEBIT with
//! `external` set is money entering or leaving the trading core from outside the two ledgers, not
//! a transfer leg. It is decided like any CREDIT or DEBIT (same idempotency, same refusals, a
//! frozen account refuses it too), and the ledger keeps, per (user, asset), `external_net` = the
//! applied external CREDITs − the applied external DEBITs ([`Ledger::external_net`]), rebuilt from
//! the log like the balances. So `balance − external_net` is what transfers moved in and out.

use std::collections::{HashMap, HashSet};

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use txflow_core::events::{SpotCommand, SpotOp, SpotOutcome};

use crate::config::Assets;

/// The seed 004 §1.5 codes the ledger answers with.
pub mod code {
    pub const INVALID_AMOUNT: &str = "INVALID_AMOUNT";
    pub const PRECISION_OVERFLOW: &str = "PRECISION_OVERFLOW";
    pub const OVERFLOW: &str = "OVERFLOW";
    pub const INVALID_ASSET: &str = "INVALID_ASSET";
    pub const INSUFFICIENT_BALANCE: &str = "INSUFFICIENT_BALANCE";
    pub const ACCOUNT_FROZEN: &str = "ACCOUNT_FROZEN";
    pub const DUPLICATE_REQUEST: &str = "DUPLICATE_REQUEST";
}

/// The longest id (req_id, user_id) accepted (amounts: the domain's parser's limit).
pub const MAX_ID_LEN: usize = 128;

/// One decided operation: a record of the write-ahead log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// 1, 2, 3, … in log order.
    pub seq: u64,
    pub req_id: String,
    pub op: SpotOp,
    pub user_id: String,
    pub asset: String,
    /// The command's amount, as it came (compared on a repeat).
    pub amount: String,
    pub compensation: bool,
    /// An outside movement (counted in `external_net`), not a transfer leg. Records written
    /// before the field existed read as `false`.
    #[serde(default)]
    pub external: bool,
    /// `None`: applied; `Some(code)`: rejected, with no effect.
    pub code: Option<String>,
    /// The (user, asset) balance after the operation (CREDIT and DEBIT, applied or not).
    pub balance: Option<Decimal>,
}

/// The key of an operation.
pub type OpKey = (String, SpotOp);

/// The ledger in RAM. Built only by replaying records and applying new ones.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Ledger {
    balances: HashMap<(String, String), Decimal>,
    /// Applied external CREDITs − applied external DEBITs, per (user, asset) that had one.
    external_net: HashMap<(String, String), Decimal>,
    frozen: HashSet<String>,
    processed: HashMap<OpKey, Record>,
    last_seq: u64,
}

/// A record the ledger cannot apply: the log does not follow on (a bug or a damaged log).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApplyError {
    #[error("record {found} follows record {last}")]
    OutOfOrder { last: u64, found: u64 },
    #[error("record {seq} repeats operation ({req_id}, {op:?})")]
    Repeated {
        seq: u64,
        req_id: String,
        op: SpotOp,
    },
    #[error("record {seq} is applied but carries no balance")]
    NoBalance { seq: u64 },
    #[error("record {seq} moves the external net of ({user_id}, {asset}) out of range")]
    NetOverflow {
        seq: u64,
        user_id: String,
        asset: String,
    },
}

impl Ledger {
    /// The balance of `(user, asset)`; zero for an account never credited.
    pub fn balance(&self, user: &str, asset: &str) -> Decimal {
        self.balances
            .get(&(user.to_string(), asset.to_string()))
            .copied()
            .unwrap_or(Decimal::ZERO)
    }

    /// The net of the applied outside movements of `(user, asset)` (external CREDITs − external
    /// DEBITs); zero when there was none. May be negative (money that came in by a transfer and
    /// left to the outside).
    pub fn external_net(&self, user: &str, asset: &str) -> Decimal {
        self.external_net
            .get(&(user.to_string(), asset.to_string()))
            .copied()
            .unwrap_or(Decimal::ZERO)
    }

    /// Every (user, asset) that had an applied outside movement, with its net.
    pub fn external_nets(&self) -> impl Iterator<Item = (&(String, String), &Decimal)> {
        self.external_net.iter()
    }

    pub fn is_frozen(&self, user: &str) -> bool {
        self.frozen.contains(user)
    }

    /// The number of the last record applied (0 for an empty log).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The recorded decision of `key`, if it was decided.
    pub fn processed(&self, req_id: &str, op: SpotOp) -> Option<&Record> {
        self.processed.get(&(req_id.to_string(), op))
    }

    /// Every non-zero balance, for checks and the tests.
    pub fn balances(&self) -> impl Iterator<Item = (&(String, String), &Decimal)> {
        self.balances.iter()
    }

    /// Applies a decided operation: records it in the processed set and, if it was applied,
    /// sets the balance it recorded (or the frozen flag) and, for an outside movement, moves the
    /// external net by the balance's change (which is the amount, exactly).
    pub fn apply(&mut self, r: Record) -> Result<(), ApplyError> {
        if r.seq != self.last_seq + 1 {
            return Err(ApplyError::OutOfOrder {
                last: self.last_seq,
                found: r.seq,
            });
        }
        let key = (r.req_id.clone(), r.op);
        if self.processed.contains_key(&key) {
            return Err(ApplyError::Repeated {
                seq: r.seq,
                req_id: r.req_id,
                op: r.op,
            });
        }
        if r.code.is_none() {
            match r.op {
                SpotOp::Credit | SpotOp::Debit => {
                    let b = r.balance.ok_or(ApplyError::NoBalance { seq: r.seq })?;
                    let account = (r.user_id.clone(), r.asset.clone());
                    if r.external {
                        let before = self.balance(&r.user_id, &r.asset);
                        let net = self.external_net(&r.user_id, &r.asset);
                        let after = b
                            .checked_sub(before)
                            .and_then(|change| net.checked_add(change))
                            .ok_or_else(|| ApplyError::NetOverflow {
                                seq: r.seq,
                                user_id: r.user_id.clone(),
                                asset: r.asset.clone(),
                            })?;
                        self.external_net.insert(account.clone(), after.normalize());
                    }
                    self.balances.insert(account, b);
                }
                SpotOp::Freeze => {
                    self.frozen.insert(r.user_id.clone());
                }
                SpotOp::Unfreeze => {
                    self.frozen.remove(&r.user_id);
                }
                SpotOp::Balance => {}
            }
        }
        self.last_seq = r.seq;
        self.processed.insert(key, r);
        Ok(())
    }
}

/// Why a command cannot be answered at all (it goes to the dead-letter topic).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Malformed {
    #[error("req_id is empty or longer than {MAX_ID_LEN} bytes")]
    ReqId,
    #[error("user_id is empty or longer than {MAX_ID_LEN} bytes")]
    UserId,
    #[error("the message key is not the command's user_id")]
    Key,
    #[error("external is set on an operation that is not a CREDIT or DEBIT, or with compensation")]
    External,
}

impl Malformed {
    pub fn code(&self) -> &'static str {
        match self {
            Malformed::ReqId => "INVALID_REQ_ID",
            Malformed::UserId => "INVALID_USER_ID",
            Malformed::Key => "KEY_MISMATCH",
            Malformed::External => "INVALID_EXTERNAL",
        }
    }
}

/// The checks that make a command answerable: ids present, keyed by its user, `external` only
/// on a CREDIT or DEBIT that is not a compensation.
pub fn check_shape(cmd: &SpotCommand, key: Option<&[u8]>) -> Result<(), Malformed> {
    let id_ok = |s: &str| !s.trim().is_empty() && s.len() <= MAX_ID_LEN;
    if !id_ok(&cmd.req_id) {
        return Err(Malformed::ReqId);
    }
    if !id_ok(&cmd.user_id) {
        return Err(Malformed::UserId);
    }
    if key != Some(cmd.user_id.as_bytes()) {
        return Err(Malformed::Key);
    }
    if cmd.external && (cmd.compensation || !matches!(cmd.op, SpotOp::Credit | SpotOp::Debit)) {
        return Err(Malformed::External);
    }
    Ok(())
}

/// Parses an amount for an asset of `places` decimal places: digits, optionally a `.` and
/// digits (no sign but a leading `-`, which is refused as not positive; no exponent, no `_`,
/// no spaces). The places counted are the significant ones (`1.50` has one).
pub fn parse_amount(s: &str, places: u32) -> Result<Decimal, &'static str> {
    // One parser for every module (seed 004 §1.5, defence in depth): the domain's.
    let amount = txflow_core::transfer::validate::parse_amount(s).map_err(|r| r.code.as_str())?;
    if amount.places() > places {
        return Err(code::PRECISION_OVERFLOW);
    }
    Ok(amount.value())
}

/// What a BALANCE read answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    pub balance: Decimal,
    /// [`Ledger::external_net`].
    pub external_net: Decimal,
}

/// What to do with a (well-shaped) command.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// A new operation: append it to the log (fsync), apply it, reply from it.
    Record(Record),
    /// The key was decided before: reply the recorded answer, change nothing.
    Repeat(Record),
    /// The key was decided before for other parameters: refuse, record nothing.
    Conflict(Record),
    /// A balance read: the balance and the external net, or the code that refuses it.
    Query(Result<Holding, &'static str>),
}

/// Decides `cmd` against `ledger`, the asset list and the next record number.
pub fn decide(ledger: &Ledger, assets: &Assets, cmd: &SpotCommand) -> Decision {
    if cmd.op == SpotOp::Balance {
        return Decision::Query(match assets.places(&cmd.asset) {
            Some(_) => Ok(Holding {
                balance: ledger.balance(&cmd.user_id, &cmd.asset).normalize(),
                external_net: ledger.external_net(&cmd.user_id, &cmd.asset).normalize(),
            }),
            None => Err(code::INVALID_ASSET),
        });
    }
    if let Some(done) = ledger.processed(&cmd.req_id, cmd.op) {
        let same = done.user_id == cmd.user_id
            && done.compensation == cmd.compensation
            && done.external == cmd.external
            && (matches!(cmd.op, SpotOp::Freeze | SpotOp::Unfreeze)
                || (done.asset == cmd.asset && done.amount == cmd.amount));
        return if same {
            Decision::Repeat(done.clone())
        } else {
            Decision::Conflict(done.clone())
        };
    }
    let mut record = Record {
        seq: ledger.last_seq() + 1,
        req_id: cmd.req_id.clone(),
        op: cmd.op,
        user_id: cmd.user_id.clone(),
        asset: cmd.asset.clone(),
        amount: cmd.amount.clone(),
        compensation: cmd.compensation,
        external: cmd.external,
        code: None,
        balance: None,
    };
    if matches!(cmd.op, SpotOp::Freeze | SpotOp::Unfreeze) {
        return Decision::Record(record);
    }
    let current = ledger.balance(&cmd.user_id, &cmd.asset);
    let outcome = money(ledger, assets, cmd, current);
    match outcome {
        Ok(after) => record.balance = Some(after.normalize()),
        Err(code) => {
            record.code = Some(code.to_string());
            record.balance = assets.places(&cmd.asset).map(|_| current.normalize());
        }
    }
    Decision::Record(record)
}

/// The balance after a CREDIT or DEBIT, or the code that refuses it.
fn money(
    ledger: &Ledger,
    assets: &Assets,
    cmd: &SpotCommand,
    current: Decimal,
) -> Result<Decimal, &'static str> {
    let places = assets.places(&cmd.asset).ok_or(code::INVALID_ASSET)?;
    let amount = parse_amount(&cmd.amount, places)?;
    // A refund of this transfer's own debit lands even on a frozen account: a rollback must
    // complete (seed 004 §4.3).
    let refund = cmd.op == SpotOp::Credit && cmd.compensation;
    if ledger.is_frozen(&cmd.user_id) && !refund {
        return Err(code::ACCOUNT_FROZEN);
    }
    let after = match cmd.op {
        SpotOp::Credit => current.checked_add(amount).ok_or(code::OVERFLOW)?,
        _ if current < amount => return Err(code::INSUFFICIENT_BALANCE),
        _ => current.checked_sub(amount).ok_or(code::OVERFLOW)?,
    };
    // An outside movement must leave its net representable too (`Ledger::apply` moves it).
    if cmd.external {
        let net = ledger.external_net(&cmd.user_id, &cmd.asset);
        let moved = match cmd.op {
            SpotOp::Credit => net.checked_add(amount),
            _ => net.checked_sub(amount),
        };
        moved.ok_or(code::OVERFLOW)?;
    }
    Ok(after)
}

/// The outcome a decided record is answered with: `fresh` for the first answer.
pub fn outcome(record: &Record, fresh: bool) -> SpotOutcome {
    match (&record.code, fresh) {
        (Some(_), _) => SpotOutcome::Rejected,
        (None, true) => SpotOutcome::Applied,
        (None, false) => SpotOutcome::AlreadyApplied,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assets() -> Assets {
        Assets::parse("USDT:6,BTC:8").expect("assets")
    }

    fn cmd(req: &str, op: SpotOp, asset: &str, amount: &str) -> SpotCommand {
        SpotCommand {
            event_id: format!("e-{req}"),
            req_id: req.into(),
            user_id: "alice".into(),
            asset: asset.into(),
            amount: amount.into(),
            op,
            compensation: false,
            external: false,
        }
    }

    fn d(s: &str) -> Decimal {
        s.parse().expect("decimal")
    }

    /// Decides and applies, as the handler does; returns the decision.
    fn run(l: &mut Ledger, c: &SpotCommand) -> Decision {
        let decision = decide(l, &assets(), c);
        if let Decision::Record(r) = &decision {
            l.apply(r.clone()).expect("apply");
        }
        decision
    }

    fn code_of(dec: &Decision) -> Option<String> {
        match dec {
            Decision::Record(r) | Decision::Repeat(r) => r.code.clone(),
            Decision::Conflict(_) => Some(code::DUPLICATE_REQUEST.into()),
            Decision::Query(q) => q.err().map(str::to_string),
        }
    }

    #[test]
    fn amounts_parse_exactly_or_are_refused_with_their_code() {
        let table: &[(&str, u32, Result<&str, &str>)] = &[
            ("1", 6, Ok("1")),
            ("0.000001", 6, Ok("0.000001")),
            ("1.500000000", 6, Ok("1.5")),
            ("0001.50000000000000000000000000000000", 6, Ok("1.5")),
            (
                "000000000000000000000000000000000000000",
                6,
                Err(code::INVALID_AMOUNT),
            ),
            ("0.0000001", 6, Err(code::PRECISION_OVERFLOW)),
            ("0.1", 0, Err(code::PRECISION_OVERFLOW)),
            ("0", 6, Err(code::INVALID_AMOUNT)),
            ("0.000", 6, Err(code::INVALID_AMOUNT)),
            ("-1", 6, Err(code::INVALID_AMOUNT)),
            ("-0.0000001", 6, Err(code::INVALID_AMOUNT)),
            ("+1", 6, Err(code::INVALID_AMOUNT)),
            ("1e3", 6, Err(code::INVALID_AMOUNT)),
            ("1_000", 6, Err(code::INVALID_AMOUNT)),
            (" 1", 6, Err(code::INVALID_AMOUNT)),
            ("1.", 6, Err(code::INVALID_AMOUNT)),
            (".5", 6, Err(code::INVALID_AMOUNT)),
            ("", 6, Err(code::INVALID_AMOUNT)),
            ("NaN", 6, Err(code::INVALID_AMOUNT)),
            ("1.2.3", 6, Err(code::INVALID_AMOUNT)),
            ("99999999999999999999999999999999", 6, Err(code::OVERFLOW)),
            (&"9".repeat(100), 6, Err(code::OVERFLOW)),
        ];
        for (s, places, want) in table {
            let got = parse_amount(s, *places);
            match want {
                Ok(v) => assert_eq!(got, Ok(d(v)), "{s:?}"),
                Err(c) => assert_eq!(got, Err(*c), "{s:?}"),
            }
        }
    }

    #[test]
    fn credit_then_debit_moves_exact_amounts() {
        let mut l = Ledger::default();
        let r = run(&mut l, &cmd("t1", SpotOp::Credit, "USDT", "10.1"));
        assert!(
            matches!(&r, Decision::Record(r) if r.code.is_none() && r.balance == Some(d("10.1")))
        );
        let r = run(&mut l, &cmd("t2", SpotOp::Debit, "USDT", "0.1"));
        assert!(matches!(&r, Decision::Record(r) if r.balance == Some(d("10")) && r.seq == 2));
        assert_eq!(l.balance("alice", "USDT"), d("10"));
        assert_eq!(l.balance("alice", "BTC"), Decimal::ZERO);
    }

    #[test]
    fn a_repeat_gets_the_recorded_answer_and_changes_nothing() {
        let mut l = Ledger::default();
        run(&mut l, &cmd("t1", SpotOp::Credit, "USDT", "5"));
        run(&mut l, &cmd("t2", SpotOp::Credit, "USDT", "1"));
        let before = l.clone();
        let dup = run(&mut l, &cmd("t1", SpotOp::Credit, "USDT", "5"));
        match &dup {
            Decision::Repeat(r) => {
                assert_eq!(r.seq, 1);
                assert_eq!(r.balance, Some(d("5")), "the balance recorded then");
                assert_eq!(outcome(r, false), SpotOutcome::AlreadyApplied);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(l, before);
        // The same key with other parameters: refused, not recorded.
        let conflict = run(&mut l, &cmd("t1", SpotOp::Credit, "USDT", "6"));
        assert!(matches!(conflict, Decision::Conflict(_)));
        assert_eq!(l, before);
    }

    #[test]
    fn a_debit_and_its_compensating_credit_are_two_operations() {
        let mut l = Ledger::default();
        run(&mut l, &cmd("fund", SpotOp::Credit, "BTC", "1"));
        run(&mut l, &cmd("t9", SpotOp::Debit, "BTC", "0.4"));
        let mut refund = cmd("t9", SpotOp::Credit, "BTC", "0.4");
        refund.compensation = true;
        let r = run(&mut l, &refund);
        assert!(matches!(&r, Decision::Record(r) if r.code.is_none()));
        assert!(matches!(run(&mut l, &refund), Decision::Repeat(_)));
        assert!(matches!(
            run(&mut l, &cmd("t9", SpotOp::Debit, "BTC", "0.4")),
            Decision::Repeat(_)
        ));
        assert_eq!(l.balance("alice", "BTC"), d("1"));
    }

    #[test]
    fn rejections_are_recorded_and_repeat_identically() {
        let mut l = Ledger::default();
        run(&mut l, &cmd("fund", SpotOp::Credit, "USDT", "1"));
        let first = run(&mut l, &cmd("t1", SpotOp::Debit, "USDT", "2"));
        assert_eq!(code_of(&first).as_deref(), Some(code::INSUFFICIENT_BALANCE));
        // Funds arrive; the repeat still gets the recorded rejection and moves nothing.
        run(&mut l, &cmd("fund2", SpotOp::Credit, "USDT", "5"));
        let again = run(&mut l, &cmd("t1", SpotOp::Debit, "USDT", "2"));
        assert!(
            matches!(&again, Decision::Repeat(r) if r.code.as_deref() == Some(code::INSUFFICIENT_BALANCE))
        );
        assert_eq!(l.balance("alice", "USDT"), d("6"));
    }

    #[test]
    fn every_refusal_has_its_code() {
        let mut l = Ledger::default();
        run(&mut l, &cmd("fund", SpotOp::Credit, "USDT", "100"));
        let table = [
            (cmd("a", SpotOp::Credit, "DOGE", "1"), code::INVALID_ASSET),
            (cmd("b", SpotOp::Credit, "USDT", "-1"), code::INVALID_AMOUNT),
            (cmd("c", SpotOp::Credit, "USDT", "0"), code::INVALID_AMOUNT),
            (
                cmd("d", SpotOp::Credit, "USDT", "0.0000001"),
                code::PRECISION_OVERFLOW,
            ),
            (
                cmd("e", SpotOp::Debit, "USDT", "100.000001"),
                code::INSUFFICIENT_BALANCE,
            ),
            (
                cmd("f", SpotOp::Credit, "USDT", "79228162514264337593543950335"),
                code::OVERFLOW,
            ),
            (
                cmd("g", SpotOp::Debit, "BTC", "1"),
                code::INSUFFICIENT_BALANCE,
            ),
            (cmd("h", SpotOp::Balance, "DOGE", ""), code::INVALID_ASSET),
        ];
        for (c, want) in table {
            let got = run(&mut l, &c);
            assert_eq!(code_of(&got).as_deref(), Some(want), "{c:?}");
        }
        assert_eq!(l.balance("alice", "USDT"), d("100"));
        // The largest amount one command may carry (the domain's safe limit) is applied; one
        // unit of the smallest place more overflows.
        let max = txflow_core::transfer::validate::MAX_SAFE_AMOUNT;
        let at = run(&mut l, &cmd("big", SpotOp::Credit, "BTC", &max.to_string()));
        assert_eq!(code_of(&at), None, "the safe maximum is applied");
        let above = format!("{max}.00000001");
        let over = run(&mut l, &cmd("big2", SpotOp::Credit, "BTC", &above));
        assert_eq!(code_of(&over).as_deref(), Some(code::OVERFLOW));
    }

    #[test]
    fn a_frozen_account_refuses_transfers_but_takes_refunds() {
        let mut l = Ledger::default();
        run(&mut l, &cmd("fund", SpotOp::Credit, "USDT", "10"));
        run(&mut l, &cmd("t0", SpotOp::Debit, "USDT", "3"));
        run(&mut l, &cmd("f1", SpotOp::Freeze, "", ""));
        assert!(l.is_frozen("alice"));
        let c = run(&mut l, &cmd("t1", SpotOp::Credit, "USDT", "1"));
        assert_eq!(code_of(&c).as_deref(), Some(code::ACCOUNT_FROZEN));
        let dd = run(&mut l, &cmd("t2", SpotOp::Debit, "USDT", "1"));
        assert_eq!(code_of(&dd).as_deref(), Some(code::ACCOUNT_FROZEN));
        let mut refund = cmd("t0", SpotOp::Credit, "USDT", "3");
        refund.compensation = true;
        assert_eq!(code_of(&run(&mut l, &refund)), None);
        run(&mut l, &cmd("u1", SpotOp::Unfreeze, "", ""));
        // The rejected credit stays rejected after the unfreeze (its transfer was rolled back).
        let again = run(&mut l, &cmd("t1", SpotOp::Credit, "USDT", "1"));
        assert!(
            matches!(&again, Decision::Repeat(r) if r.code.as_deref() == Some(code::ACCOUNT_FROZEN))
        );
        assert_eq!(l.balance("alice", "USDT"), d("10"));
        assert!(!l.is_frozen("alice"));
    }

    #[test]
    fn a_balance_query_reads_and_records_nothing() {
        let mut l = Ledger::default();
        run(&mut l, &cmd("fund", SpotOp::Credit, "USDT", "2.50"));
        let q = run(&mut l, &cmd("q", SpotOp::Balance, "USDT", ""));
        assert_eq!(
            q,
            Decision::Query(Ok(Holding {
                balance: d("2.5"),
                external_net: Decimal::ZERO
            }))
        );
        assert_eq!(l.last_seq(), 1);
    }

    fn external(req: &str, op: SpotOp, asset: &str, amount: &str) -> SpotCommand {
        SpotCommand {
            external: true,
            ..cmd(req, op, asset, amount)
        }
    }

    fn holding(l: &mut Ledger, asset: &str) -> Holding {
        match run(l, &cmd("q", SpotOp::Balance, asset, "")) {
            Decision::Query(Ok(h)) => h,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn outside_movements_are_counted_in_the_external_net_and_transfers_are_not() {
        let mut l = Ledger::default();
        // (command, balance after, external net after)
        let table = [
            (
                external("dep1", SpotOp::Credit, "USDT", "100"),
                "100",
                "100",
            ),
            (cmd("t1", SpotOp::Debit, "USDT", "30.5"), "69.5", "100"),
            (cmd("t2", SpotOp::Credit, "USDT", "0.5"), "70", "100"),
            (external("wd1", SpotOp::Debit, "USDT", "70"), "0", "30"),
            // A transfer in, then out to the outside: the net goes negative.
            (cmd("t3", SpotOp::Credit, "USDT", "50"), "50", "30"),
            (
                external("wd2", SpotOp::Debit, "USDT", "40.25"),
                "9.75",
                "-10.25",
            ),
            // Refused (recorded, no effect): neither moves.
            (
                external("wd3", SpotOp::Debit, "USDT", "9.750001"),
                "9.75",
                "-10.25",
            ),
            (
                external("dep2", SpotOp::Credit, "USDT", "0.0000001"),
                "9.75",
                "-10.25",
            ),
            (
                external("dep3", SpotOp::Credit, "DOGE", "1"),
                "9.75",
                "-10.25",
            ),
            // A repeat changes nothing.
            (
                external("dep1", SpotOp::Credit, "USDT", "100"),
                "9.75",
                "-10.25",
            ),
        ];
        for (c, balance, net) in table {
            run(&mut l, &c);
            assert_eq!(l.balance("alice", "USDT"), d(balance), "{c:?}");
            assert_eq!(l.external_net("alice", "USDT"), d(net), "{c:?}");
            assert_eq!(
                holding(&mut l, "USDT"),
                Holding {
                    balance: d(balance),
                    external_net: d(net)
                }
            );
        }
        // Per asset: BTC never moved.
        assert_eq!(l.external_net("alice", "BTC"), Decimal::ZERO);
        let nets: Vec<_> = l.external_nets().collect();
        assert_eq!(nets.len(), 1);
    }

    #[test]
    fn external_is_part_of_the_key_parameters() {
        let mut l = Ledger::default();
        run(&mut l, &external("m1", SpotOp::Credit, "USDT", "5"));
        let before = l.clone();
        // The same key as a transfer leg: another operation's parameters.
        let conflict = run(&mut l, &cmd("m1", SpotOp::Credit, "USDT", "5"));
        assert!(matches!(conflict, Decision::Conflict(_)));
        let repeat = run(&mut l, &external("m1", SpotOp::Credit, "USDT", "5"));
        assert!(matches!(repeat, Decision::Repeat(r) if r.external && r.seq == 1));
        assert_eq!(l, before);
    }

    #[test]
    fn a_frozen_account_refuses_outside_movements_too() {
        let mut l = Ledger::default();
        run(&mut l, &external("dep", SpotOp::Credit, "USDT", "10"));
        run(&mut l, &cmd("f", SpotOp::Freeze, "", ""));
        for c in [
            external("dep2", SpotOp::Credit, "USDT", "1"),
            external("wd", SpotOp::Debit, "USDT", "1"),
        ] {
            assert_eq!(
                code_of(&run(&mut l, &c)).as_deref(),
                Some(code::ACCOUNT_FROZEN)
            );
        }
        assert_eq!(l.external_net("alice", "USDT"), d("10"));
    }

    #[test]
    fn an_external_net_out_of_range_is_overflow() {
        // Reaching the edge by commands takes ~10^11 of them (each at most the domain's safe
        // amount); set it directly.
        let account = ("alice".to_string(), "BTC".to_string());
        let mut l = Ledger::default();
        run(&mut l, &cmd("t1", SpotOp::Credit, "BTC", "1"));
        l.external_net.insert(account.clone(), Decimal::MAX);
        let dep = run(&mut l, &external("dep", SpotOp::Credit, "BTC", "1"));
        assert_eq!(code_of(&dep).as_deref(), Some(code::OVERFLOW));
        l.external_net.insert(account, Decimal::MIN);
        let wd = run(&mut l, &external("wd", SpotOp::Debit, "BTC", "1"));
        assert_eq!(code_of(&wd).as_deref(), Some(code::OVERFLOW));
        assert_eq!(l.balance("alice", "BTC"), d("1"));
        assert_eq!(l.external_net("alice", "BTC"), Decimal::MIN);
    }

    #[test]
    fn the_external_net_is_rebuilt_from_the_records() {
        let mut l = Ledger::default();
        let mut records = Vec::new();
        for c in [
            external("dep", SpotOp::Credit, "USDT", "12.5"),
            cmd("t1", SpotOp::Debit, "USDT", "2.5"),
            external("wd", SpotOp::Debit, "USDT", "4"),
            external("wd2", SpotOp::Debit, "USDT", "400"),
        ] {
            if let Decision::Record(r) = run(&mut l, &c) {
                records.push(r);
            }
        }
        let mut replayed = Ledger::default();
        for r in records {
            replayed.apply(r).expect("replay");
        }
        assert_eq!(replayed, l);
        assert_eq!(replayed.external_net("alice", "USDT"), d("8.5"));
        assert_eq!(replayed.balance("alice", "USDT"), d("6"));
    }

    #[test]
    fn a_record_written_before_external_existed_reads_as_a_transfer_leg() {
        let old = r#"{"seq":1,"req_id":"t1","op":"CREDIT","user_id":"alice","asset":"USDT","amount":"5","compensation":false,"code":null,"balance":"5"}"#;
        let r: Record = serde_json::from_str(old).expect("an old record decodes");
        assert!(!r.external);
        let mut l = Ledger::default();
        l.apply(r).expect("apply");
        assert_eq!(l.balance("alice", "USDT"), d("5"));
        assert_eq!(l.external_net("alice", "USDT"), Decimal::ZERO);
    }

    #[test]
    fn shape_checks() {
        let c = cmd("t", SpotOp::Credit, "USDT", "1");
        assert_eq!(check_shape(&c, Some(b"alice")), Ok(()));
        assert_eq!(check_shape(&c, Some(b"bob")), Err(Malformed::Key));
        assert_eq!(check_shape(&c, None), Err(Malformed::Key));
        let mut e = c.clone();
        e.req_id = " ".into();
        assert_eq!(check_shape(&e, Some(b"alice")), Err(Malformed::ReqId));
        let mut u = c.clone();
        u.user_id = String::new();
        assert_eq!(check_shape(&u, Some(b"")), Err(Malformed::UserId));
        assert_eq!(
            check_shape(&external("x", SpotOp::Debit, "USDT", "1"), Some(b"alice")),
            Ok(())
        );
        for op in [SpotOp::Balance, SpotOp::Freeze, SpotOp::Unfreeze] {
            let bad = external("x", op, "USDT", "");
            assert_eq!(check_shape(&bad, Some(b"alice")), Err(Malformed::External));
        }
        let mut refund = external("x", SpotOp::Credit, "USDT", "1");
        refund.compensation = true;
        assert_eq!(
            check_shape(&refund, Some(b"alice")),
            Err(Malformed::External)
        );
    }

    #[test]
    fn apply_refuses_a_log_that_does_not_follow_on() {
        let mut l = Ledger::default();
        let Decision::Record(r) = decide(&l, &assets(), &cmd("t", SpotOp::Credit, "USDT", "1"))
        else {
            panic!("a record")
        };
        let mut skipped = r.clone();
        skipped.seq = 2;
        assert!(matches!(
            l.apply(skipped),
            Err(ApplyError::OutOfOrder { .. })
        ));
        l.apply(r.clone()).expect("first");
        let mut again = r;
        again.seq = 2;
        assert!(matches!(l.apply(again), Err(ApplyError::Repeated { .. })));
    }
}
