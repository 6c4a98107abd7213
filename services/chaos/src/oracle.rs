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
}
