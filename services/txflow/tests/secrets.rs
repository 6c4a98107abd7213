//! No secret in a log (issue 12, point 7): the three stages run as `txflow` processes at debug
//! level with a marker secret in the RPC endpoint's path and query (where providers put API keys),
//! in the database password, and with the signing key; one endpoint is dead so its errors are
//! logged. Nothing any process writes may contain a marker or the key. Also the errors of a
//! command that cannot reach its database or endpoint.

use std::path::PathBuf;
use std::time::Duration;

use tokio::process::{Child, Command};
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{unique, wait_until};

const RPC_SECRET: &str = "RPCSECRETMARKER7f3a";
const DB_SECRET: &str = "DBSECRETMARKER91c2";

/// A `txflow <role>` process whose stdout and stderr go to a file.
fn spawn(role: &str, env: &[(String, String)], log: &PathBuf) -> Child {
    let file = std::fs::File::create(log).expect("log file");
    let out = file.try_clone().expect("log file");
    Command::new(env!("CARGO_BIN_EXE_txflow"))
        .arg(role)
        .envs(env.iter().cloned())
        .env("TXFLOW_LOG", "debug")
        .env("TXFLOW_NODE_NAME", role)
        .stdout(out)
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn txflow")
}

/// The secrets a text must not hold.
fn leaks(text: &str, key_hex: &str) -> Vec<&'static str> {
    let mut found = Vec::new();
    if text.contains(RPC_SECRET) {
        found.push("the RPC URL's path or query");
    }
    if text.contains(DB_SECRET) {
        found.push("the database password");
    }
    if text.to_ascii_lowercase().contains(key_hex) {
        found.push("the signing key");
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_of_a_run_holds_an_rpc_key_a_database_password_or_a_signing_key() {
    let p = Pipeline::prepare(1, |_| {}).await;
    let (keys_var, keys) = p.signer_keys_env();
    let key_hex = keys.trim_start_matches("0x").to_ascii_lowercase();
    let anvil = p.config.rpc_urls[0].clone();
    let mut env: Vec<(String, String)> = p
        .env()
        .into_iter()
        .filter(|(k, _)| k != "TXFLOW_RPC_URLS" && k != "TXFLOW_DATABASE_URL")
        .collect();
    // A dead endpoint with a key in its path and query first (its failures are logged), then the
    // chain.
    env.push((
        "TXFLOW_RPC_URLS".into(),
        format!("http://127.0.0.1:1/v3/{RPC_SECRET}?apikey={RPC_SECRET},{anvil}"),
    ));
    // PostgreSQL trusts local connections: the password is carried, not checked.
    let db_url = p.config.database_url.replacen(
        "postgres://postgres@",
        &format!("postgres://postgres:{DB_SECRET}@"),
        1,
    );
    assert!(db_url.contains(DB_SECRET), "{db_url}");
    env.push(("TXFLOW_DATABASE_URL".into(), db_url));
    env.push((keys_var, keys.clone()));
    // A short RPC timeout and few rounds, so that the dead endpoint's errors come quickly.
    env.push(("TXFLOW_RPC_TIMEOUT_MS".into(), "500".into()));

    let dir = std::env::temp_dir();
    let logs: Vec<(String, PathBuf)> = ["allocator", "signer-gateway", "broadcaster"]
        .into_iter()
        .map(|role| (role.to_string(), dir.join(format!("{}.log", unique(role)))))
        .collect();
    let mut children: Vec<Child> = logs.iter().map(|(r, l)| spawn(r, &env, l)).collect();

    for i in 0..3 {
        p.send(&p.request(0, &format!("secret-{i}"))).await;
    }
    wait_until(
        "the three requests are submitted",
        Duration::from_secs(180),
        || async {
            p.count("SELECT count(*) FROM managed_tx WHERE state = 'SUBMITTED'")
                .await
                == 3
        },
    )
    .await;
    // The dead endpoint was tried, and its failure logged.
    wait_until(
        "a failure of the dead endpoint is logged",
        Duration::from_secs(60),
        || async {
            logs.iter().any(|(_, l)| {
                std::fs::read_to_string(l).is_ok_and(|t| t.contains("RPC endpoint failed"))
            })
        },
    )
    .await;
    for c in &mut children {
        let _ = c.kill().await;
    }
    for (role, log) in &logs {
        let text = std::fs::read_to_string(log).expect("log");
        assert!(
            text.lines().count() > 5,
            "{role} logged next to nothing:\n{text}"
        );
        let found = leaks(&text, &key_hex);
        assert!(
            found.is_empty(),
            "{role}'s log holds {found:?}:\n{}",
            text.lines()
                .filter(|l| !leaks(l, &key_hex).is_empty())
                .take(5)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    // Commands that fail: their error names the endpoint and the database, not their secrets.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_txflow"))
        .args([
            "migrate",
            "--database-url",
            &format!("postgres://postgres:{DB_SECRET}@127.0.0.1:1/nowhere"),
        ])
        .output()
        .expect("run txflow migrate");
    assert!(!out.status.success());
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(leaks(&text, &key_hex).is_empty(), "{text}");
    p.stop().await;
}
