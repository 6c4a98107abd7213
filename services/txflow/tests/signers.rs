//! `txflow signers` and `txflow signers reset-nonce` as an operator runs them, during a run of the
//! pipeline (in this process) against real PostgreSQL, the broker and anvil; the outcomes read
//! where they are true: the chain, and PostgreSQL.

use std::collections::BTreeMap;
use std::time::Duration;

use alloy::primitives::Address;
use alloy::providers::Provider;
use txflow_core::domain::{ChainId, NodeId, Signer};
use txflow_core::lease::{Acquisition, LeaseConfig, LeaseManager};
use txflow_core::role::Role;
use txflow_tests::pipeline::{Pipeline, marker};
use txflow_tests::{AnvilNode, wait_for, wait_until};

const LONG: Duration = Duration::from_secs(120);

/// `txflow <args>` on the pipeline's database, broker and chain.
async fn txflow(p: &Pipeline, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_txflow"))
        .args(args)
        .envs(p.env())
        .env("TXFLOW_LOG", "warn")
        .output()
        .await
        .expect("run txflow")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Signer 0 as `txflow signers --json --signer` shows it: exactly one object.
async fn status(p: &Pipeline) -> serde_json::Value {
    let out = txflow(p, &["signers", "--json", "--signer", &p.signer(0)]).await;
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one object per signer:\n{stdout}");
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn int(v: &serde_json::Value, field: &str) -> i64 {
    v[field]
        .as_i64()
        .unwrap_or_else(|| panic!("{field} is not an integer in {v}"))
}

/// Signer 0's nonce on the chain: `latest` (mined) or `pending` (the pool counted).
async fn chain_nonce(p: &Pipeline, pending: bool) -> u64 {
    let address = p.signers[0].address();
    let provider = p.provider();
    let count = provider.get_transaction_count(address);
    if pending {
        count.pending().await.expect("pending nonce")
    } else {
        count.latest().await.expect("latest nonce")
    }
}

/// How many of signer 0's transactions are in `states`.
async fn in_states(p: &Pipeline, states: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM managed_tx WHERE signer = $1 AND state IN ({states})"
    ))
    .bind(p.signer(0))
    .fetch_one(&p.db.pool)
    .await
    .expect("count")
}

const IN_FLIGHT: &str = "'ALLOCATED', 'SIGNED', 'SUBMITTED'";

async fn cursor(p: &Pipeline) -> i64 {
    sqlx::query_scalar("SELECT next_nonce FROM signer_nonce_cursor WHERE signer = $1")
        .bind(p.signer(0))
        .fetch_one(&p.db.pool)
        .await
        .expect("cursor")
}

async fn released(p: &Pipeline) -> Vec<i64> {
    sqlx::query_scalar("SELECT nonce FROM recycled_nonces WHERE signer = $1 ORDER BY nonce")
        .bind(p.signer(0))
        .fetch_all(&p.db.pool)
        .await
        .expect("released nonces")
}

/// With the chain not mining, three requests of one signer allocated, signed and sent: the
/// status shows the cursor at 3, the chain at 0 mined and 3 pooled, and 3 in flight; a reset is
/// refused (nothing changes), and with `--force` keeps the three nonces and releases nothing.
/// Once a block is mined: nothing in flight, the chain at 3.
#[tokio::test]
async fn signers_reports_the_cursor_the_chain_nonces_and_what_is_in_flight() {
    let anvil = AnvilNode::spawn_with(&["--no-mining"]).await;
    let mut p = Pipeline::prepare_on(anvil, 1, |_| {}).await;
    let config = p.config.clone();
    p.start_allocator(&config, "alloc-1").await;
    p.start_signer_gateway(&config).await;
    p.start_broadcaster(&config).await;
    p.start_receipt_checker(&config).await;
    for i in 0..3 {
        p.send(&p.request(0, &format!("pooled-{i}"))).await;
    }
    wait_until("the three are sent and pooled", LONG, || async {
        in_states(&p, "'SUBMITTED'").await == 3 && chain_nonce(&p, true).await == 3
    })
    .await;

    let s = status(&p).await;
    assert_eq!(s["signer"], p.signer(0), "{s}");
    assert_eq!(int(&s, "chain_id"), 31337, "{s}");
    assert_eq!(int(&s, "cursor"), 3, "{s}");
    assert_eq!(int(&s, "chain_latest_nonce"), 0, "{s}");
    assert_eq!(int(&s, "chain_pending_nonce"), 3, "{s}");
    assert_eq!(int(&s, "in_flight"), 3, "{s}");
    assert_eq!(int(&s, "lowest_in_flight_nonce"), 0, "{s}");
    assert_eq!(int(&s, "highest_in_flight_nonce"), 2, "{s}");
    assert!(s["oldest_in_flight_age_secs"].as_f64().is_some(), "{s}");
    assert_eq!(int(&s, "queued"), 0, "{s}");
    assert!(s["chain_error"].is_null(), "{s}");
    let roles: Vec<&str> = s["leases"]
        .as_array()
        .expect("leases")
        .iter()
        .filter_map(|l| l["role"].as_str())
        .collect();
    for role in ["allocator", "signer-gateway", "broadcaster"] {
        assert!(roles.contains(&role), "{role} lease shown: {s}");
    }

    // The table says the same, one line under its header.
    let out = txflow(&p, &["signers"]).await;
    let table = text(&out.stdout);
    assert!(out.status.success(), "{table}\n{}", text(&out.stderr));
    let line = table
        .lines()
        .find(|l| l.contains(&p.signer(0)))
        .unwrap_or_else(|| panic!("no line for the signer:\n{table}"));
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        &cells[..6],
        &["31337", &p.signer(0), "3", "3", "0", "3"],
        "{table}"
    );

    // In flight: refused, nothing changed.
    let signer = p.signer(0);
    let reset = [
        "signers",
        "reset-nonce",
        "--chain-id",
        "31337",
        "--signer",
        &signer,
    ];
    let out = txflow(&p, &reset).await;
    let err = text(&out.stderr);
    assert!(!out.status.success(), "refused:\n{}", text(&out.stdout));
    assert!(err.contains("3 transaction(s) in flight"), "{err}");
    assert!(err.contains("--force"), "{err}");
    assert_eq!(cursor(&p).await, 3);
    assert!(released(&p).await.is_empty());

    // Forced: the in-flight nonces are kept, there is no gap to release.
    let forced = [&reset[..], &["--force"][..]].concat();
    let out = txflow(&p, &forced).await;
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}\n{}", text(&out.stderr));
    assert!(said.contains("3 transaction(s) in flight kept"), "{said}");
    assert!(said.contains("no gap to release"), "{said}");
    assert_eq!(cursor(&p).await, 3);
    assert!(released(&p).await.is_empty());

    p.anvil.mine_block().await;
    wait_until("the three are mined and followed", LONG, || async {
        in_states(&p, IN_FLIGHT).await == 0
    })
    .await;
    let s = status(&p).await;
    assert_eq!(int(&s, "in_flight"), 0, "{s}");
    assert_eq!(int(&s, "chain_latest_nonce"), 3, "{s}");
    assert_eq!(int(&s, "chain_pending_nonce"), 3, "{s}");
    assert_eq!(int(&s, "cursor"), 3, "{s}");
    assert!(s["oldest_in_flight_age_secs"].is_null(), "{s}");
    assert_eq!(chain_nonce(&p, false).await, 3);
    p.stop().await;
}

/// A cursor past the chain (as after a restored backup that lost what used nonces 2..4): a
/// reset is refused while another node holds the allocator lease, takes it over with --force,
/// keeps the cursor and releases the gap; the allocator fills it with no-ops, and a new request
/// mines with no nonce stuck: every nonce of the signer mined once, on the chain.
#[tokio::test]
async fn reset_nonce_fills_a_gap_left_by_a_cursor_past_the_chain() {
    let mut p = Pipeline::prepare(1, |_| {}).await;
    let config = p.config.clone();
    p.start_all_stages(&config).await;
    for i in 0..2 {
        p.send(&p.request(0, &format!("before-{i}"))).await;
    }
    wait_until("the first two are mined", LONG, || async {
        chain_nonce(&p, false).await == 2 && in_states(&p, IN_FLIGHT).await == 0
    })
    .await;
    // The operator's situation: the cursor names nonces nobody will send.
    sqlx::query("UPDATE signer_nonce_cursor SET next_nonce = 5 WHERE signer = $1")
        .bind(p.signer(0))
        .execute(&p.db.pool)
        .await
        .expect("advance the cursor");
    let s = status(&p).await;
    assert_eq!(
        (int(&s, "cursor"), int(&s, "chain_pending_nonce")),
        (5, 2),
        "{s}"
    );

    // Another node holds the allocator lease (alloc-1's lapses: it has no work for the signer).
    let signer = Signer::parse(&p.signer(0)).expect("signer");
    let other = LeaseManager::new(
        p.db.pool.clone(),
        Role::Allocator,
        NodeId::named("ops-other"),
        LeaseConfig::default(),
    )
    .expect("lease manager");
    let held = wait_for("ops-other holds the allocator lease", LONG, || async {
        match other
            .acquire(ChainId(31337), &signer)
            .await
            .expect("acquire")
        {
            Acquisition::Held(l, _) => Some(l),
            Acquisition::Busy { .. } => None,
        }
    })
    .await;
    let name = p.signer(0);
    let reset = [
        "signers",
        "reset-nonce",
        "--chain-id",
        "31337",
        "--signer",
        &name,
    ];
    let out = txflow(&p, &reset).await;
    let err = text(&out.stderr);
    assert!(!out.status.success(), "refused:\n{}", text(&out.stdout));
    assert!(err.contains("held by node ops-other"), "{err}");
    assert_eq!(cursor(&p).await, 5);
    assert!(released(&p).await.is_empty());

    let forced = [&reset[..], &["--force"][..]].concat();
    let out = txflow(&p, &forced).await;
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}\n{}", text(&out.stderr));
    assert!(said.contains("cursor 5 -> 5"), "{said}");
    assert!(said.contains("released nonces 2..=4"), "{said}");
    assert!(
        !said.contains(&p.anvil.url) && !said.contains(&p.db.url),
        "no endpoint or database URL printed: {said}"
    );
    // Taken over through the lease table (token + 1), and given back.
    let (owner, token, live): (String, i64, bool) = sqlx::query_as(
        "SELECT owner_node, fencing_token, expires_at > clock_timestamp() FROM signer_lease
         WHERE role = 'allocator' AND signer = $1",
    )
    .bind(p.signer(0))
    .fetch_one(&p.db.pool)
    .await
    .expect("lease");
    assert!(owner.starts_with("signers-reset-nonce/"), "{owner}");
    assert!(token > held.token().0 && !live, "{owner} {token} {live}");
    assert!(
        !other.renew(&[held]).await.expect("renew").lost.is_empty(),
        "ops-other lost its lease"
    );

    // The allocator fills the gap with no-ops as it does freed nonces (no request waits).
    wait_until(
        "the released nonces are filled with no-ops",
        LONG,
        || async {
            released(&p).await.is_empty()
                && p.count(&format!(
                    "SELECT count(*) FROM managed_tx WHERE kind = 'NOOP' AND signer = '{}'",
                    p.signer(0)
                ))
                .await
                    == 3
        },
    )
    .await;
    p.send(&p.request(0, "after-reset")).await;
    let after = String::from_utf8_lossy(&marker("after-reset")).into_owned();
    wait_until("every nonce up to the request mined", LONG, || async {
        chain_nonce(&p, false).await == 6 && p.mined_markers().await.contains_key(&after)
    })
    .await;
    let mut per_nonce: BTreeMap<u64, usize> = BTreeMap::new();
    let me: Address = p.signers[0].address();
    let mut noops = 0;
    for tx in p.mined().await.into_iter().filter(|t| t.signer == me) {
        *per_nonce.entry(tx.nonce).or_default() += 1;
        if tx.to == p.signer(0) && tx.value.is_zero() {
            noops += 1;
        }
    }
    assert_eq!(
        per_nonce,
        (0..6).map(|n| (n, 1)).collect::<BTreeMap<_, _>>(),
        "each nonce mined once, none skipped"
    );
    assert_eq!(noops, 3, "the released nonces became no-ops");
    assert_eq!(
        p.mined_markers().await.get(&after),
        Some(&1),
        "the request mined once"
    );
    let s = status(&p).await;
    assert_eq!(int(&s, "released_nonces"), 0, "{s}");
    assert_eq!(int(&s, "cursor"), 6, "{s}");
    p.stop().await;
}

#[test]
fn help_lists_signers_and_its_reset() {
    let help = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_txflow"))
            .args(args)
            .output()
            .expect("run txflow --help");
        assert!(out.status.success());
        text(&out.stdout)
    };
    let top = help(&["--help"]);
    assert!(
        top.lines().any(|l| l.trim_start().starts_with("signers")),
        "{top}"
    );
    let signers = help(&["signers", "--help"]);
    assert!(
        signers.contains("reset-nonce") && signers.contains("--json"),
        "{signers}"
    );
    let reset = help(&["signers", "reset-nonce", "--help"]);
    for flag in ["--chain-id", "--signer", "--force"] {
        assert!(reset.contains(flag), "{flag}: {reset}");
    }
}
