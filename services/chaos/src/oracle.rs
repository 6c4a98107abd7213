//! What must be true at the end of a run, checked where it is true: on the final canonical chain
//! (by calldata marker), in PostgreSQL, and in the downstream view txflow-client's
//! `OutcomeReader` built from `tx.outcomes`.

use std::collections::BTreeMap;

use serde::Serialize;
use txflow_client::Book;

/// One request of the workload.
#[derive(Debug, Clone)]
pub struct Requested {
    pub signer: String,
    pub request_id: String,
}

/// One of our transactions on the final canonical chain.
#[derive(Debug, Clone)]
pub struct OnChain {
    pub signer: String,
    pub nonce: u64,
    /// The request its marker names; `None` for a transaction with no marker (a no-op filling
    /// a released nonce, a cancellation's replacement).
    pub request_id: Option<String>,
    pub success: bool,
    pub block: u64,
}

/// What PostgreSQL holds of one request.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub signer: String,
    pub request_id: String,
    pub terminal: bool,
    pub state: String,
}

/// An event txflow recorded in `tx_events` of a type that goes on `tx.outcomes`.
#[derive(Debug, Clone)]
pub struct Announced {
    pub event_id: String,
    pub event_type: String,
    /// Recorded before the broker last lost its topics: it may be gone with them.
    pub before_broker_loss: bool,
    /// Before a kill of the broker, txflow's outbox said the broker had acknowledged it (its
    /// row was gone), and the reader, caught up with the broker's ends, did not hold it: it
    /// never reached the broker, so the kill is no excuse.
    pub acknowledged_unread: bool,
}

/// Per signer: txflow's nonce cursor, the chain's nonce, and how many of its transactions the
/// node's pool still holds.
#[derive(Debug, Clone)]
pub struct Nonces {
    pub signer: String,
    pub cursor: Option<i64>,
    pub chain: u64,
    pub pooled: u64,
}

impl Nonces {
    /// txflow's cursor is not the chain's nonce.
    pub fn gap(&self) -> bool {
        self.cursor.is_some_and(|c| c as u64 != self.chain)
    }

    /// No gap and nothing left in the pool.
    pub fn converged(&self) -> bool {
        !self.gap() && self.pooled == 0
    }
}

#[derive(Debug, Default, Serialize)]
pub struct Verdict {
    pub requests: usize,
    pub executed: usize,
    pub failed: usize,
    pub booked: usize,
    pub reversals: usize,
    pub events_checked: usize,
    /// Events recorded before a broker loss and not read before it: the broker's loss, not
    /// txflow's (a durable Kafka keeps them); their transactions' downstream view is not
    /// compared.
    pub lost_with_broker: usize,
    /// The first few of them (`type event_id`), to look up in `tx_events`.
    pub lost_with_broker_events: Vec<String>,
    /// With transfers: what they came to.
    pub transfers: Option<TransferVerdict>,
    pub violations: Vec<Violation>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Violation {
    pub check: &'static str,
    pub detail: String,
    /// The request it is about (`signer request_id`), if one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<(String, String)>,
    /// The block that shows it (the later execution, the booked one), if one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block: Option<u64>,
    /// The schedule step it followed (set by the run, which knows when each step was applied).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_step: Option<usize>,
    /// The first step its request lived through (set by the run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_step: Option<usize>,
}

/// What a violation is about: a request, and the block that shows it.
#[derive(Default)]
struct About {
    request: Option<(String, String)>,
    block: Option<u64>,
}

impl About {
    fn request(signer: &str, request_id: &str) -> About {
        About {
            request: Some(key(signer, request_id)),
            block: None,
        }
    }
    fn at(mut self, block: u64) -> About {
        self.block = Some(block);
        self
    }
}

fn key(signer: &str, request_id: &str) -> (String, String) {
    (signer.to_ascii_lowercase(), request_id.to_string())
}

/// Checks everything; `Verdict::violations` is empty when the run was correct.
pub fn check(
    requested: &[Requested],
    chain: &[OnChain],
    recorded: &[Recorded],
    announced: &[Announced],
    nonces: &[Nonces],
    book: &Book,
) -> Verdict {
    let mut v = Verdict {
        requests: requested.len(),
        ..Verdict::default()
    };
    let mut violations = Vec::new();
    let mut flag = |check: &'static str, detail: String, about: About| {
        violations.push(Violation {
            check,
            detail,
            request: about.request,
            block: about.block,
            after_step: None,
            since_step: None,
        });
    };

    // At most once on the final chain.
    let mut mined: BTreeMap<(String, String), Vec<&OnChain>> = BTreeMap::new();
    for t in chain {
        if let Some(r) = &t.request_id {
            mined.entry(key(&t.signer, r)).or_default().push(t);
        }
    }
    for ((s, r), txs) in &mined {
        if txs.len() > 1 {
            let nonces: Vec<u64> = txs.iter().map(|t| t.nonce).collect();
            flag(
                "executed_twice",
                format!(
                    "{s} {r} is on the chain {} times (nonces {nonces:?})",
                    txs.len()
                ),
                About::request(s, r).at(txs.iter().map(|t| t.block).max().unwrap_or(0)),
            );
        }
    }

    // Every request recorded and terminal.
    let mut rows: BTreeMap<(String, String), Vec<&Recorded>> = BTreeMap::new();
    for r in recorded {
        rows.entry(key(&r.signer, &r.request_id))
            .or_default()
            .push(r);
    }
    for q in requested {
        match rows.get(&key(&q.signer, &q.request_id)) {
            None => flag(
                "request_lost",
                format!(
                    "{} {} was published and never recorded",
                    q.signer, q.request_id
                ),
                About::request(&q.signer, &q.request_id),
            ),
            Some(rs) if rs.iter().any(|r| !r.terminal) => {
                let states: Vec<&str> = rs.iter().map(|r| r.state.as_str()).collect();
                flag(
                    "not_terminal",
                    format!("{} {} ends in {states:?}", q.signer, q.request_id),
                    About::request(&q.signer, &q.request_id),
                )
            }
            Some(_) => {}
        }
    }

    // No event lost on tx.outcomes.
    for a in announced {
        v.events_checked += 1;
        if book.has_outcome(&a.event_id) {
            continue;
        }
        if a.acknowledged_unread {
            flag(
                "event_lost",
                format!(
                    "{} {} was marked acknowledged in the outbox before the broker was killed \
                     and the broker never held it",
                    a.event_type, a.event_id
                ),
                About::default(),
            );
        } else if a.before_broker_loss {
            v.lost_with_broker += 1;
            if v.lost_with_broker_events.len() < 20 {
                v.lost_with_broker_events
                    .push(format!("{} {}", a.event_type, a.event_id));
            }
        } else {
            flag(
                "event_lost",
                format!(
                    "{} {} is in tx_events and never reached tx.outcomes",
                    a.event_type, a.event_id
                ),
                About::default(),
            );
        }
    }

    // The downstream view equals the chain.
    for q in requested {
        let on_chain = mined.get(&key(&q.signer, &q.request_id));
        let executed = on_chain.is_some();
        let views = book.by_request(&q.signer, &q.request_id);
        let booked: Vec<_> = views.iter().filter_map(|x| x.booked.as_ref()).collect();
        let failed = views.iter().any(|x| x.failed.is_some());
        if executed {
            v.executed += 1;
        }
        if failed {
            v.failed += 1;
        }
        if !booked.is_empty() {
            v.booked += 1;
        }
        v.reversals += views.iter().map(|x| x.reversals as usize).sum::<usize>();
        if executed && failed {
            flag(
                "failed_but_executed",
                format!(
                    "{} {} has a TxFailed and is on the chain",
                    q.signer, q.request_id
                ),
                About::request(&q.signer, &q.request_id)
                    .at(on_chain.and_then(|t| t.first()).map_or(0, |t| t.block)),
            );
        }
        match (on_chain.and_then(|t| t.first()), booked.as_slice()) {
            (Some(t), [b]) => {
                if b.success != t.success
                    || b.nonce as u64 != t.nonce
                    || b.block_number as u64 != t.block
                {
                    flag(
                        "downstream_differs",
                        format!(
                            "{} {}: booked nonce {} block {} success {}, the chain has nonce {} block {} success {}",
                            q.signer,
                            q.request_id,
                            b.nonce,
                            b.block_number,
                            b.success,
                            t.nonce,
                            t.block,
                            t.success
                        ),
                        About::request(&q.signer, &q.request_id).at(t.block),
                    );
                }
            }
            (None, []) => {}
            (Some(_), []) if v.lost_with_broker > 0 => {
                // Its TxConfirmed may have gone with the broker: counted above, not compared.
            }
            (Some(_), []) => flag(
                "downstream_differs",
                format!(
                    "{} {} is on the chain and not booked downstream",
                    q.signer, q.request_id
                ),
                About::request(&q.signer, &q.request_id),
            ),
            (None, [_, ..]) => flag(
                "downstream_differs",
                format!(
                    "{} {} is booked downstream and not on the chain",
                    q.signer, q.request_id
                ),
                About::request(&q.signer, &q.request_id),
            ),
            (Some(_), _) => flag(
                "downstream_differs",
                format!(
                    "{} {} is booked by {} transactions",
                    q.signer,
                    q.request_id,
                    booked.len()
                ),
                About::request(&q.signer, &q.request_id),
            ),
        }
    }

    // Nonces without gaps: what txflow allocated is what the chain used.
    for n in nonces {
        if n.gap() {
            flag(
                "nonce_gap",
                format!(
                    "{}: txflow's cursor is {:?}, the chain's nonce {}",
                    n.signer, n.cursor, n.chain
                ),
                About::default(),
            );
        }
        if n.pooled > 0 {
            flag(
                "pool_not_empty",
                format!(
                    "{}: {} transactions still in the node's pool once every request ended (chain nonce {})",
                    n.signer, n.pooled, n.chain
                ),
                About::default(),
            );
        }
    }
    v.violations = violations;
    v
}

/// Amounts of the transfer workload, in millionths of the asset (USDT has 6 places).
pub type Micros = i128;

/// A decimal string (`"12.5"`, `"100.000000000000000000"`, `"-3"`) in millionths; `None` when it
/// is not a decimal or has a non-zero digit past the sixth place.
pub fn micros(text: &str) -> Option<Micros> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) || frac.bytes().skip(6).any(|b| b != b'0') {
        return None;
    }
    let mut value: Micros = int.parse().ok()?;
    for i in 0..6 {
        let d = frac.as_bytes().get(i).map_or(0, |b| Micros::from(b - b'0'));
        value = value.checked_mul(10)?.checked_add(d)?;
    }
    Some(if negative { -value } else { value })
}

/// How the gateway finally answered one transfer the workload asked for (the same `cid` sent
/// again until it answered for good).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// 202 (or 200 for a `cid` sent again): the transfer's `req_id`.
    Accepted(String),
    /// A refusal the request itself earned (400, 409, …): its code.
    Refused(String),
    /// No answer for good before the run gave up: the last failure.
    Unanswered(String),
}

/// One transfer the workload asked the gateway for.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub user: String,
    pub cid: String,
    pub answer: Answer,
}

/// A row of `transfers`.
#[derive(Debug, Clone)]
pub struct TransferRecord {
    pub req_id: String,
    pub user: String,
    /// `FUNDING` or `SPOT`.
    pub from: String,
    pub to: String,
    pub amount: Micros,
    pub state: txflow_domain::transfer::TransferState,
    pub error_code: Option<String>,
}

/// One user's balances at the end, as each ledger reports them, and the money put into each
/// from outside.
#[derive(Debug, Clone)]
pub struct Ledgers {
    pub user: String,
    pub funding: Option<Micros>,
    pub spot: Option<Micros>,
    pub outside_funding: Micros,
    pub outside_spot: Micros,
}

/// What the transfers came to, beside the verdict's violations.
#[derive(Debug, Default, Serialize)]
pub struct TransferVerdict {
    pub asked: usize,
    pub refused: usize,
    /// The refusals by status and code (`"400 TRANSFER_NOT_ALLOWED"`).
    pub refusals: BTreeMap<String, usize>,
    pub committed: usize,
    pub failed: usize,
    pub rolled_back: usize,
    /// Open rows of txflow's own conservation check at the end.
    pub conservation_alarms: i64,
    /// Users whose balances were not compared: a transfer of theirs was still under way.
    pub users_unchecked: usize,
}

fn show(m: Micros) -> String {
    let sign = if m < 0 { "-" } else { "" };
    let m = m.abs();
    format!("{sign}{}.{:06}", m / 1_000_000, m % 1_000_000)
}

/// Checks the transfers: every one the gateway accepted has its row and ended (COMMITTED,
/// FAILED or ROLLED_BACK); every one asked was answered; each user's balance on each ledger is
/// what the outside movements and the COMMITTED transfers make it (so no money was created or
/// lost, none moved twice, and none moved by a transfer that says it did not); and txflow's
/// own conservation check raised no alarm over ledgers that balance.
pub fn check_transfers(
    submitted: &[Submitted],
    records: &[TransferRecord],
    ledgers: &[Ledgers],
    conservation_alarms: i64,
    verdict: &mut Verdict,
) -> TransferVerdict {
    use txflow_domain::transfer::TransferState;
    let mut out = TransferVerdict {
        asked: submitted.len(),
        conservation_alarms,
        ..TransferVerdict::default()
    };
    let mut found = Vec::new();
    let mut violate = |check: &'static str, detail: String, about: Option<(String, String)>| {
        found.push(Violation {
            check,
            detail,
            request: about,
            block: None,
            after_step: None,
            since_step: None,
        });
    };
    let by_id: BTreeMap<&str, &TransferRecord> =
        records.iter().map(|r| (r.req_id.as_str(), r)).collect();
    for s in submitted {
        match &s.answer {
            Answer::Accepted(req_id) if !by_id.contains_key(req_id.as_str()) => violate(
                "transfer_lost",
                format!(
                    "the gateway accepted {} ({req_id}) and no row holds it",
                    s.cid
                ),
                Some((s.user.clone(), req_id.clone())),
            ),
            Answer::Accepted(_) => {}
            Answer::Refused(code) => {
                out.refused += 1;
                *out.refusals.entry(code.clone()).or_default() += 1;
            }
            Answer::Unanswered(last) => violate(
                "transfer_unanswered",
                format!("{} was never answered for good (last: {last})", s.cid),
                Some((s.user.clone(), s.cid.clone())),
            ),
        }
    }
    let mut moved: BTreeMap<&str, (Micros, Micros)> = BTreeMap::new();
    // Users with a transfer under way: its amount may be in flight, so their balances prove
    // nothing either way (the transfer is a violation of its own).
    let mut under_way: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
    for r in records {
        match r.state {
            TransferState::Committed => {
                out.committed += 1;
                let m = moved.entry(r.user.as_str()).or_default();
                let amount = if r.from == "FUNDING" {
                    r.amount
                } else {
                    -r.amount
                };
                m.0 -= amount;
                m.1 += amount;
            }
            TransferState::Failed => out.failed += 1,
            TransferState::RolledBack => out.rolled_back += 1,
            other => {
                under_way.insert(r.user.as_str());
                violate(
                    "transfer_not_terminal",
                    format!(
                        "{} → {} of {} ended the run in {}",
                        r.from,
                        r.to,
                        show(r.amount),
                        other.as_str()
                    ),
                    Some((r.user.clone(), r.req_id.clone())),
                )
            }
        }
    }
    let mut money_wrong = false;
    for l in ledgers {
        let (Some(funding), Some(spot)) = (l.funding, l.spot) else {
            money_wrong = true;
            violate(
                "ledger_unread",
                format!(
                    "a ledger did not answer for {} (FUNDING {:?}, SPOT {:?})",
                    l.user, l.funding, l.spot
                ),
                None,
            );
            continue;
        };
        if under_way.contains(l.user.as_str()) {
            out.users_unchecked += 1;
            continue;
        }
        let (df, ds) = moved.get(l.user.as_str()).copied().unwrap_or_default();
        let (want_f, want_s) = (l.outside_funding + df, l.outside_spot + ds);
        if funding + spot != l.outside_funding + l.outside_spot {
            money_wrong = true;
            violate(
                "money_not_conserved",
                format!(
                    "{}: FUNDING {} + SPOT {} = {}, but {} came from outside",
                    l.user,
                    show(funding),
                    show(spot),
                    show(funding + spot),
                    show(l.outside_funding + l.outside_spot)
                ),
                None,
            );
        } else if (funding, spot) != (want_f, want_s) {
            money_wrong = true;
            violate(
                "ledger_differs",
                format!(
                    "{}: FUNDING {} and SPOT {}, but its committed transfers make them {} and {}",
                    l.user,
                    show(funding),
                    show(spot),
                    show(want_f),
                    show(want_s)
                ),
                None,
            );
        }
    }
    if conservation_alarms > 0 && !money_wrong {
        violate(
            "false_conservation_alarm",
            format!(
                "txflow holds {conservation_alarms} open conservation violation(s) (transfers \
                 halted) over ledgers that balance"
            ),
            None,
        );
    }
    // The money first: a halt that follows a loss leaves transfers unanswered, and the report
    // shows the first few violations only.
    const ORDER: [&str; 7] = [
        "money_not_conserved",
        "ledger_differs",
        "ledger_unread",
        "false_conservation_alarm",
        "transfer_lost",
        "transfer_not_terminal",
        "transfer_unanswered",
    ];
    found.sort_by_key(|v| ORDER.iter().position(|c| *c == v.check));
    verdict.violations.extend(found);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announced(id: &str, before_broker_loss: bool, acknowledged_unread: bool) -> Announced {
        Announced {
            event_id: id.into(),
            event_type: "TxSubmitted".into(),
            before_broker_loss,
            acknowledged_unread,
        }
    }

    fn checks(v: &Verdict) -> Vec<&'static str> {
        v.violations.iter().map(|x| x.check).collect()
    }

    /// An event missing downstream is the broker's loss only if it may have been in the broker
    /// when it was killed: one recorded after the kill, or one the outbox called acknowledged
    /// while a caught-up reader never saw it, is txflow's.
    #[test]
    fn a_missing_event_is_excused_only_when_the_broker_may_have_taken_it() {
        let book = Book::new();
        let v = check(&[], &[], &[], &[announced("a", true, false)], &[], &book);
        assert_eq!((v.lost_with_broker, checks(&v)), (1, vec![]));
        assert_eq!(v.lost_with_broker_events, vec!["TxSubmitted a".to_string()]);
        let v = check(&[], &[], &[], &[announced("b", false, false)], &[], &book);
        assert_eq!((v.lost_with_broker, checks(&v)), (0, vec!["event_lost"]));
        // Recorded before the loss, and marked acknowledged while the broker never held it.
        let v = check(&[], &[], &[], &[announced("c", true, true)], &[], &book);
        assert_eq!((v.lost_with_broker, checks(&v)), (0, vec!["event_lost"]));
        assert!(
            v.violations[0].detail.contains("marked acknowledged"),
            "{v:?}"
        );
        assert_eq!(v.events_checked, 1);
    }

    #[test]
    fn a_request_on_the_chain_twice_or_never_terminal_is_a_violation() {
        let requested = [Requested {
            signer: "0xAB".into(),
            request_id: "r-1".into(),
        }];
        let tx = |nonce, block| OnChain {
            signer: "0xab".into(),
            nonce,
            request_id: Some("r-1".into()),
            success: true,
            block,
        };
        let recorded = [Recorded {
            signer: "0xab".into(),
            request_id: "r-1".into(),
            terminal: false,
            state: "SUBMITTED".into(),
        }];
        let v = check(
            &requested,
            &[tx(0, 5), tx(1, 9)],
            &recorded,
            &[],
            &[],
            &Book::new(),
        );
        let found = checks(&v);
        assert!(found.contains(&"executed_twice"), "{found:?}");
        assert!(found.contains(&"not_terminal"), "{found:?}");
        // On the chain and not booked downstream, nothing lost with a broker to excuse it.
        assert!(found.contains(&"downstream_differs"), "{found:?}");
        let twice = v
            .violations
            .iter()
            .find(|x| x.check == "executed_twice")
            .expect("executed_twice");
        assert_eq!(twice.block, Some(9), "the later execution names the block");
        assert_eq!(twice.request, Some(("0xab".into(), "r-1".into())));
    }

    #[test]
    fn a_gap_or_a_full_pool_is_a_violation() {
        let n = |cursor, chain, pooled| Nonces {
            signer: "0xab".into(),
            cursor,
            chain,
            pooled,
        };
        assert!(n(Some(3), 3, 0).converged());
        assert!(
            n(None, 3, 0).converged(),
            "no cursor yet: nothing allocated"
        );
        assert!(n(Some(4), 3, 0).gap());
        let v = check(
            &[],
            &[],
            &[],
            &[],
            &[n(Some(4), 3, 0), n(Some(3), 3, 2)],
            &Book::new(),
        );
        assert_eq!(checks(&v), vec!["nonce_gap", "pool_not_empty"]);
    }

    mod transfers {
        use super::super::*;
        use txflow_domain::transfer::TransferState;

        fn record(
            id: &str,
            user: &str,
            from: &str,
            amount: &str,
            state: TransferState,
        ) -> TransferRecord {
            TransferRecord {
                req_id: id.into(),
                user: user.into(),
                from: from.into(),
                to: if from == "FUNDING" { "SPOT" } else { "FUNDING" }.into(),
                amount: micros(amount).expect("amount"),
                state,
                error_code: None,
            }
        }

        fn ledgers(user: &str, funding: &str, spot: &str) -> Ledgers {
            Ledgers {
                user: user.into(),
                funding: micros(funding),
                spot: micros(spot),
                outside_funding: micros("100").expect("100"),
                outside_spot: micros("50").expect("50"),
            }
        }

        fn accepted(user: &str, id: &str) -> Submitted {
            Submitted {
                user: user.into(),
                cid: format!("cid-{id}"),
                answer: Answer::Accepted(id.into()),
            }
        }

        fn checks(
            submitted: &[Submitted],
            records: &[TransferRecord],
            l: &[Ledgers],
            alarms: i64,
        ) -> (Vec<&'static str>, TransferVerdict) {
            let mut v = Verdict::default();
            let t = check_transfers(submitted, records, l, alarms, &mut v);
            (v.violations.iter().map(|x| x.check).collect(), t)
        }

        #[test]
        fn amounts_are_read_in_millionths() {
            assert_eq!(micros("12.5"), Some(12_500_000));
            assert_eq!(micros("100.000000000000000000"), Some(100_000_000));
            assert_eq!(micros("-3"), Some(-3_000_000));
            assert_eq!(micros("0.000001"), Some(1));
            assert_eq!(micros("0.0000001"), None);
            assert_eq!(micros("1e3"), None);
            assert_eq!(micros(""), None);
            assert_eq!(micros(".5"), None);
        }

        #[test]
        fn committed_transfers_explain_the_balances_and_the_others_move_nothing() {
            let records = [
                record("t1", "u", "FUNDING", "30", TransferState::Committed),
                record("t2", "u", "SPOT", "10.5", TransferState::Committed),
                record("t3", "u", "FUNDING", "7", TransferState::RolledBack),
                record("t4", "u", "SPOT", "1", TransferState::Failed),
            ];
            let submitted: Vec<Submitted> = ["t1", "t2", "t3", "t4"]
                .iter()
                .map(|id| accepted("u", id))
                .collect();
            let (found, t) = checks(&submitted, &records, &[ledgers("u", "80.5", "69.5")], 0);
            assert!(found.is_empty(), "{found:?}");
            assert_eq!((t.committed, t.failed, t.rolled_back), (2, 1, 1));
        }

        #[test]
        fn money_created_moved_twice_or_left_unfinished_is_a_violation() {
            let records = [record("t1", "u", "FUNDING", "30", TransferState::Committed)];
            let submitted = [accepted("u", "t1")];
            // Credited twice on SPOT: money created.
            let (found, _) = checks(&submitted, &records, &[ledgers("u", "70", "110")], 0);
            assert_eq!(found, ["money_not_conserved"]);
            // The sum holds but the transfer says it moved 30 where 20 moved.
            let (found, _) = checks(&submitted, &records, &[ledgers("u", "80", "70")], 0);
            assert_eq!(found, ["ledger_differs"]);
            // A transfer still under way, one the gateway accepted but nobody holds, one never
            // answered, and a ledger that did not answer.
            let open = [record(
                "t1",
                "u",
                "FUNDING",
                "30",
                TransferState::TargetPending,
            )];
            let submitted = [
                accepted("u", "t1"),
                accepted("u", "t9"),
                Submitted {
                    user: "u".into(),
                    cid: "c".into(),
                    answer: Answer::Unanswered("503".into()),
                },
            ];
            let mut l = ledgers("u", "70", "80");
            l.spot = None;
            let (found, _) = checks(&submitted, &open, &[l], 0);
            assert_eq!(
                found,
                [
                    "ledger_unread",
                    "transfer_lost",
                    "transfer_not_terminal",
                    "transfer_unanswered",
                ]
            );
            // With a transfer under way the balances prove nothing: 30 may be in flight.
            let (found, t) = checks(&submitted[..1], &open, &[ledgers("u", "70", "50")], 0);
            assert_eq!(found, ["transfer_not_terminal"]);
            assert_eq!(t.users_unchecked, 1);
        }

        #[test]
        fn an_alarm_over_balanced_ledgers_is_false_and_one_over_a_loss_is_not() {
            let records = [record("t1", "u", "FUNDING", "30", TransferState::Committed)];
            let submitted = [accepted("u", "t1")];
            let (found, t) = checks(&submitted, &records, &[ledgers("u", "70", "80")], 1);
            assert_eq!(found, ["false_conservation_alarm"]);
            assert_eq!(t.conservation_alarms, 1);
            let (found, _) = checks(&submitted, &records, &[ledgers("u", "70", "79")], 1);
            assert_eq!(found, ["money_not_conserved"]);
        }
    }
}
