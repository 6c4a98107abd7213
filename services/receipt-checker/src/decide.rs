//! The receipt checker's decisions. Pure: no I/O, no async, no SQL — the handler gathers what the
//! node and PostgreSQL say and these functions say what it means.
//!
//! - [`looked_up`]: what the lookups of a transaction's hashes found (a receipt, none, or
//!   nothing certain);
//! - [`found`]: a receipt as recorded ([`StoredReceipt`]) and announced ([`TxReceiptUpdated`]),
//!   with its move (MINE or REVERT) and its deterministic `event_id` ([`receipt_event_id`]);
//! - [`staleness`]: whether a transaction without a receipt has had its nonce passed for long
//!   enough to look for the proof that it was REPLACED (the proof itself is
//!   `txflow_core::nonce_proof`, shared with the broadcaster);
//! - [`next_check`]: when a transaction without a receipt is looked up again.

use std::time::Duration;

use alloy::primitives::{B256, keccak256};
use serde::{Deserialize, Serialize};
use txflow_core::chain::Receipt;
use txflow_core::events::{ReceiptStatus, TxReceiptUpdated};
use txflow_core::state::{MINE, Move, REVERT};
use uuid::Uuid;

/// What the node answered for one hash of the transaction: a receipt, none yet, or an error
/// (its text).
pub type Answer = Result<Option<Receipt>, String>;

/// What the lookups of a transaction's hashes found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Looked {
    /// A receipt for one of its attempts.
    Found { attempt: i32, receipt: Receipt },
    /// Every hash was looked up and none has a receipt.
    NotFound,
    /// No receipt, and at least one lookup failed or answered nonsense: nothing is certain (a
    /// receipt may exist). Looked up again after a back-off; never a state change.
    Failed(String),
}

/// Combines the answers for a transaction's `(attempt, hash)`es: the first receipt that is the
/// receipt of the hash asked wins (a node that answers another transaction's receipt is not
/// believed); otherwise a failed lookup makes it [`Looked::Failed`], and only answers "none" for
/// every hash make it [`Looked::NotFound`].
pub fn looked_up(answers: Vec<((i32, B256), Answer)>) -> Looked {
    let mut failed: Option<String> = None;
    for ((attempt, hash), answer) in answers {
        match answer {
            Ok(Some(receipt)) if receipt.tx_hash == hash => {
                return Looked::Found { attempt, receipt };
            }
            Ok(Some(receipt)) => {
                failed.get_or_insert(format!(
                    "asked the receipt of {hash}, the node answered the receipt of {}",
                    receipt.tx_hash
                ));
            }
            Ok(None) => {}
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    match failed {
        Some(why) => Looked::Failed(why),
        None => Looked::NotFound,
    }
}

/// `managed_tx.receipt`: what was found, for the confirmation manager and operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredReceipt {
    /// The attempt that was mined (`tx_attempts.attempt`).
    pub attempt: i32,
    pub tx_hash: String,
    pub block_number: i64,
    pub block_hash: String,
    /// 1: succeeded (MINED), 0: reverted (REVERTED).
    pub status: i32,
    pub gas_used: i64,
    /// Decimal wei.
    pub effective_gas_price: String,
    /// Why it reverted (status 0), read from an `eth_call` of it at its block
    /// (`txflow_core::revert::decode_revert`); absent when it succeeded or the call could not
    /// tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revert_reason: Option<String>,
}

/// A transaction found mined, as the stage records and announces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// MINE (status 1) or REVERT (status 0).
    pub to: Move,
    pub stored: StoredReceipt,
    pub event: TxReceiptUpdated,
}

/// A receipt field a chain cannot hold (a block number or gas beyond `i64`): not believed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("implausible receipt of {tx_hash}: {what}")]
pub struct Implausible {
    pub tx_hash: String,
    pub what: &'static str,
}

/// Who the receipt is for: the transaction and its signer, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Whose<'a> {
    pub tx_id: Uuid,
    pub chain_id: i64,
    pub signer: &'a str,
    pub nonce: i64,
    /// How many receipts were recorded for the transaction before (`TxMined` / `TxReverted`
    /// rows; more than none after a reorg sent it back to SUBMITTED).
    pub receipts_before: i64,
    pub fencing_token: i64,
}

/// The `event_id` of the receipt update: the same for the same transaction, the same receipt
/// (hash and block) and the same number of receipts recorded before, so that a drive that runs
/// again (a crash before the commit, a re-drive) announces it with the same id; another receipt
/// after a reorg gets another id. A UUID of version 8 (custom) from keccak-256.
pub fn receipt_event_id(
    tx_id: Uuid,
    receipts_before: i64,
    tx_hash: &B256,
    block_hash: &B256,
) -> Uuid {
    let digest = keccak256(format!(
        "txflow/receipt/{tx_id}/{receipts_before}/{tx_hash:#x}/{block_hash:#x}"
    ));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// What a receipt makes of the transaction: its move, the recorded receipt and the event.
pub fn found(whose: Whose<'_>, attempt: i32, receipt: &Receipt) -> Result<Found, Implausible> {
    let tx_hash = format!("{:#x}", receipt.tx_hash);
    let implausible = |what| Implausible {
        tx_hash: tx_hash.clone(),
        what,
    };
    let block_number =
        i64::try_from(receipt.block_number).map_err(|_| implausible("block number"))?;
    let gas_used = i64::try_from(receipt.gas_used).map_err(|_| implausible("gas used"))?;
    let block_hash = format!("{:#x}", receipt.block_hash);
    let (to, status) = if receipt.status {
        (MINE, ReceiptStatus::Mined)
    } else {
        (REVERT, ReceiptStatus::Reverted)
    };
    let event_id = receipt_event_id(
        whose.tx_id,
        whose.receipts_before,
        &receipt.tx_hash,
        &receipt.block_hash,
    );
    let price = receipt.effective_gas_price.to_string();
    Ok(Found {
        to,
        stored: StoredReceipt {
            attempt,
            tx_hash: tx_hash.clone(),
            block_number,
            block_hash: block_hash.clone(),
            status: i32::from(receipt.status),
            gas_used,
            effective_gas_price: price.clone(),
            revert_reason: None,
        },
        event: TxReceiptUpdated {
            event_id: event_id.to_string(),
            tx_id: whose.tx_id.to_string(),
            chain_id: whose.chain_id,
            signer: whose.signer.to_string(),
            nonce: whose.nonce,
            status,
            tx_hash: Some(tx_hash),
            block_number: Some(block_number),
            block_hash: Some(block_hash),
            gas_used: Some(gas_used),
            effective_gas_price: Some(price),
            fencing_token: whose.fencing_token,
        },
    })
}

/// Where a transaction without a receipt stands against the signer's latest (mined) nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staleness {
    /// The latest nonce is not known (the lookup failed): nothing changes.
    Unknown,
    /// The signer's nonce is not past ours: the transaction can still be mined (a mark left by
    /// an earlier look, before a reorg, is cleared).
    Pending,
    /// The nonce is past ours, first seen now: the stale timer starts.
    Passed,
    /// The nonce has been past ours for less than the timeout: wait (the receipt of one of our
    /// hashes may come from a lagging endpoint).
    Waiting,
    /// The nonce has been past ours, with no receipt, for the timeout: look for the proof.
    Prove,
}

/// Where a transaction at `nonce` stands, given the signer's `latest` nonce and how long its
/// nonce has been seen past (`passed_for`, `None` when not seen before).
pub fn staleness(
    nonce: i64,
    latest: Option<u64>,
    passed_for: Option<Duration>,
    timeout: Duration,
) -> Staleness {
    let Some(latest) = latest else {
        return Staleness::Unknown;
    };
    // A nonce is never negative (the column's check); one that were is never judged stale.
    let passed = u64::try_from(nonce).is_ok_and(|n| latest > n);
    match (passed, passed_for) {
        (false, _) => Staleness::Pending,
        (true, None) if timeout.is_zero() => Staleness::Prove,
        (true, None) => Staleness::Passed,
        (true, Some(d)) if d >= timeout => Staleness::Prove,
        (true, Some(_)) => Staleness::Waiting,
    }
}

/// What becomes of the stale mark (`managed_tx.receipt_stale_since`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleMark {
    Keep,
    /// Set it now, unless it is set.
    Start,
    Clear,
}

impl Staleness {
    /// The stale mark after this look.
    pub fn mark(self) -> StaleMark {
        match self {
            Staleness::Unknown | Staleness::Waiting => StaleMark::Keep,
            Staleness::Pending => StaleMark::Clear,
            Staleness::Passed | Staleness::Prove => StaleMark::Start,
        }
    }
}

/// When a transaction without a receipt (or whose lookup failed) is looked up again: after a
/// quarter of the time since its last move (submission, resubmission, reorg), within
/// `[min, max]` — often while it is young, seldom once it waits long.
pub fn next_check(since_last_move: Duration, min: Duration, max: Duration) -> Duration {
    (since_last_move / 4).clamp(min, max.max(min))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> B256 {
        B256::repeat_byte(n)
    }

    fn receipt(hash: B256, status: bool) -> Receipt {
        Receipt {
            tx_hash: hash,
            block_number: 7,
            block_hash: h(0xbb),
            status,
            gas_used: 21_000,
            effective_gas_price: 1_500_000_007,
        }
    }

    #[test]
    fn a_receipt_of_one_of_the_hashes_is_found_and_only_none_for_every_hash_is_not_found() {
        let err = || Err::<Option<Receipt>, String>("503".into());
        // (answers in order) → what was found
        type Case = (Vec<((i32, B256), Answer)>, Looked);
        let cases: Vec<Case> = vec![
            (vec![], Looked::NotFound),
            (vec![((1, h(1)), Ok(None))], Looked::NotFound),
            (
                vec![((2, h(2)), Ok(None)), ((1, h(1)), Ok(None))],
                Looked::NotFound,
            ),
            (
                vec![((1, h(1)), Ok(Some(receipt(h(1), true))))],
                Looked::Found {
                    attempt: 1,
                    receipt: receipt(h(1), true),
                },
            ),
            // An older attempt mined: found, whatever the newer one's lookup said.
            (
                vec![
                    ((2, h(2)), err()),
                    ((1, h(1)), Ok(Some(receipt(h(1), false)))),
                ],
                Looked::Found {
                    attempt: 1,
                    receipt: receipt(h(1), false),
                },
            ),
            // A failed lookup and no receipt: nothing certain.
            (
                vec![((2, h(2)), Ok(None)), ((1, h(1)), err())],
                Looked::Failed("503".into()),
            ),
            // The receipt of another transaction: not believed.
            (
                vec![((1, h(1)), Ok(Some(receipt(h(9), true))))],
                Looked::Failed(format!(
                    "asked the receipt of {}, the node answered the receipt of {}",
                    h(1),
                    h(9)
                )),
            ),
        ];
        for (answers, want) in cases {
            let shown = format!("{answers:?}");
            assert_eq!(looked_up(answers), want, "{shown}");
        }
    }

    fn whose(receipts_before: i64) -> Whose<'static> {
        Whose {
            tx_id: Uuid::from_u128(42),
            chain_id: 31337,
            signer: "0x00000000000000000000000000000000000000aa",
            nonce: 3,
            receipts_before,
            fencing_token: 5,
        }
    }

    #[test]
    fn status_one_is_mined_and_zero_reverted_with_the_receipt_recorded_and_announced() {
        let f = found(whose(0), 2, &receipt(h(1), true)).expect("plausible");
        assert_eq!(f.to, MINE);
        assert_eq!(f.event.status, ReceiptStatus::Mined);
        assert_eq!(
            f.stored,
            StoredReceipt {
                attempt: 2,
                tx_hash: format!("{:#x}", h(1)),
                block_number: 7,
                block_hash: format!("{:#x}", h(0xbb)),
                status: 1,
                gas_used: 21_000,
                effective_gas_price: "1500000007".into(),
                revert_reason: None,
            }
        );
        assert_eq!(f.event.tx_hash.as_deref(), Some(f.stored.tx_hash.as_str()));
        assert_eq!(f.event.block_number, Some(7));
        assert_eq!(f.event.block_hash, Some(f.stored.block_hash.clone()));
        assert_eq!(f.event.gas_used, Some(21_000));
        assert_eq!(f.event.effective_gas_price.as_deref(), Some("1500000007"));
        assert_eq!(f.event.nonce, 3);
        assert_eq!(f.event.fencing_token, 5);
        let r = found(whose(0), 1, &receipt(h(1), false)).expect("plausible");
        assert_eq!(r.to, REVERT);
        assert_eq!(r.event.status, ReceiptStatus::Reverted);
        assert_eq!(r.stored.status, 0);
        let mut huge = receipt(h(1), true);
        huge.block_number = u64::MAX;
        assert_eq!(
            found(whose(0), 1, &huge),
            Err(Implausible {
                tx_hash: format!("{:#x}", h(1)),
                what: "block number"
            })
        );
    }

    #[test]
    fn the_event_id_is_the_same_for_the_same_receipt_and_another_for_another() {
        let id = |before, hash, block| receipt_event_id(Uuid::from_u128(1), before, &hash, &block);
        let a = id(0, h(1), h(2));
        assert_eq!(a, id(0, h(1), h(2)), "deterministic");
        assert_eq!(a.get_version_num(), 8);
        assert_ne!(a, id(1, h(1), h(2)), "a receipt after a reorg");
        assert_ne!(a, id(0, h(1), h(3)), "another block");
        assert_ne!(a, id(0, h(4), h(2)), "another attempt");
        assert_ne!(
            a,
            receipt_event_id(Uuid::from_u128(2), 0, &h(1), &h(2)),
            "another transaction"
        );
        // What the stage announces carries it.
        let f = found(whose(0), 1, &receipt(h(1), true)).expect("plausible");
        assert_eq!(
            f.event.event_id,
            receipt_event_id(Uuid::from_u128(42), 0, &h(1), &h(0xbb)).to_string()
        );
    }

    #[test]
    fn a_nonce_passed_without_a_receipt_is_proven_only_after_the_timeout() {
        use Staleness::*;
        let s = Duration::from_secs;
        let t = s(60);
        // (nonce, latest, passed for, timeout) → staleness, mark
        type Case = (
            i64,
            Option<u64>,
            Option<Duration>,
            Duration,
            Staleness,
            StaleMark,
        );
        let cases: Vec<Case> = vec![
            (3, None, None, t, Unknown, StaleMark::Keep),
            (3, None, Some(s(100)), t, Unknown, StaleMark::Keep),
            (3, Some(3), None, t, Pending, StaleMark::Clear),
            (3, Some(0), Some(s(100)), t, Pending, StaleMark::Clear),
            (3, Some(4), None, t, Passed, StaleMark::Start),
            (3, Some(4), Some(s(59)), t, Waiting, StaleMark::Keep),
            (3, Some(4), Some(s(60)), t, Prove, StaleMark::Start),
            (3, Some(9), Some(s(600)), t, Prove, StaleMark::Start),
            // No timeout: proven at the first look.
            (3, Some(4), None, Duration::ZERO, Prove, StaleMark::Start),
            // A negative nonce is never judged stale.
            (-1, Some(4), Some(s(600)), t, Pending, StaleMark::Clear),
        ];
        for (nonce, latest, passed_for, timeout, want, mark) in cases {
            let got = staleness(nonce, latest, passed_for, timeout);
            assert_eq!(got, want, "{nonce} {latest:?} {passed_for:?} {timeout:?}");
            assert_eq!(got.mark(), mark, "{got:?}");
        }
    }

    #[test]
    fn young_transactions_are_looked_up_often_old_ones_seldom() {
        let (min, max) = (Duration::from_secs(1), Duration::from_secs(12));
        let ms = Duration::from_millis;
        for (age, want) in [
            (ms(0), ms(1000)),
            (ms(3000), ms(1000)),
            (ms(8000), ms(2000)),
            (ms(40_000), ms(10_000)),
            (ms(48_000), ms(12_000)),
            (Duration::from_secs(86_400), ms(12_000)),
        ] {
            assert_eq!(next_check(age, min, max), want, "{age:?}");
        }
        // A max below the min is the min.
        assert_eq!(next_check(ms(0), min, ms(10)), min);
    }
}
