//! The configuration file as an operator uses it: `txflow --config txflow.toml …` (or
//! `TXFLOW_CONFIG`), under the environment and the flags, and `txflow config`, which prints the
//! effective configuration with no secret in it. No infrastructure: `txflow config` connects to
//! nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use txflow_core::config_file::ConfigFile;

/// A directory of its own for one test's files, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        let dir = std::env::temp_dir().join(format!("txflow-config-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        Dir(dir)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write a test file");
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `txflow` with none of the caller's `TXFLOW_*` variables (a shell with the local services'
/// settings exported must not change what these tests see).
fn txflow() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_txflow"));
    c.env_clear();
    c
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `txflow config`'s output, read back as a configuration file.
fn effective(out: &Output) -> ConfigFile {
    assert!(out.status.success(), "txflow config failed:\n{}", text(out));
    ConfigFile::parse(
        Path::new("<txflow config>"),
        &String::from_utf8_lossy(&out.stdout),
    )
    .expect("txflow config prints a configuration file")
}

#[test]
fn a_file_sets_a_value_the_environment_overrides_it_and_a_flag_overrides_both() {
    let dir = Dir::new();
    let file = dir.file(
        "txflow.toml",
        "[kafka]\nbrokers = \"file:9092\"\nsession_timeout_ms = 7000\n\
         [lease]\nduration_ms = 4000\n[confirmations]\nrequired = 3\n",
    );

    let from_file = effective(
        &txflow()
            .arg("--config")
            .arg(&file)
            .arg("config")
            .output()
            .unwrap(),
    );
    assert_eq!(from_file.kafka.brokers.as_deref(), Some("file:9092"));
    assert_eq!(from_file.kafka.session_timeout_ms, Some(7000));
    assert_eq!(from_file.lease.duration_ms, Some(4000));
    assert_eq!(from_file.confirmations.required, Some(3));
    assert_eq!(
        from_file.topics.partitions,
        Some(16),
        "a key left out keeps its default"
    );

    // TXFLOW_CONFIG names the file as well as --config.
    let env_over_file = effective(
        &txflow()
            .env("TXFLOW_CONFIG", &file)
            .env("TXFLOW_BROKERS", "env:9092")
            .env("TXFLOW_LEASE_MS", "5000")
            .arg("config")
            .output()
            .unwrap(),
    );
    assert_eq!(env_over_file.kafka.brokers.as_deref(), Some("env:9092"));
    assert_eq!(env_over_file.lease.duration_ms, Some(5000));
    assert_eq!(
        env_over_file.confirmations.required,
        Some(3),
        "the file still counts"
    );

    let flag_over_both = effective(
        &txflow()
            .env("TXFLOW_BROKERS", "env:9092")
            .args(["config", "--brokers", "flag:9092", "--config"])
            .arg(&file)
            .output()
            .unwrap(),
    );
    assert_eq!(flag_over_both.kafka.brokers.as_deref(), Some("flag:9092"));
    assert_eq!(flag_over_both.kafka.session_timeout_ms, Some(7000));
}

#[test]
fn an_unknown_key_and_a_bad_value_each_fail_with_the_key_named() {
    let dir = Dir::new();
    for (toml, key) in [
        ("[confirmations]\nrequird = 3\n", "confirmations.requird"),
        ("[lease]\nduration_ms = \"abc\"\n", "lease.duration_ms"),
        ("[lease]\nduration_ms = 10\n", "lease.duration_ms"),
    ] {
        let file = dir.file("bad.toml", toml);
        let out = txflow()
            .arg("--config")
            .arg(&file)
            .arg("config")
            .output()
            .expect("run txflow config");
        assert!(
            !out.status.success(),
            "{toml} was accepted:\n{}",
            text(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(key),
            "{toml}: the error does not name {key}:\n{err}"
        );
        assert!(out.stdout.is_empty(), "nothing is printed on an error");
    }
    // A role refuses to start on it just the same, before connecting to anything.
    let file = dir.file("bad.toml", "[confirmations]\nrequird = 3\n");
    let out = txflow()
        .arg("--config")
        .arg(&file)
        .arg("allocator")
        .output()
        .expect("run txflow allocator");
    assert!(!out.status.success());
    assert!(
        text(&out).contains("confirmations.requird"),
        "{}",
        text(&out)
    );
}

#[test]
fn txflow_config_shows_no_secret() {
    let dir = Dir::new();
    // Marker secrets: a private key in a keys file, a keystore password in its file, a database
    // password and RPC API keys in the file and in the environment.
    let key = "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d";
    let keys = dir.file("signer-keys", &format!("{key}\n"));
    let password = dir.file("keystore-password", "KEYSTOREPASSWORD\n");
    let file = dir.file(
        "txflow.toml",
        &format!(
            "[database]\nurl = \"postgres://txflow:DBPASSWORD@db.internal:5432/txflow\"\n\
             [rpc]\nurls = [\"https://mainnet.example.com/v3/FILEAPIKEY\"]\n\
             [signer]\nkeys_file = {:?}\nkeystore_password_file = {:?}\n",
            keys.to_string_lossy(),
            password.to_string_lossy(),
        ),
    );
    let env_key = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";

    let from_file = txflow()
        .arg("--config")
        .arg(&file)
        .arg("config")
        .output()
        .unwrap();
    let from_env = txflow()
        .arg("--config")
        .arg(&file)
        .env("TXFLOW_SIGNER_KEYS", env_key)
        .env(
            "TXFLOW_RPC_URLS",
            "https://rpc.example.com/ENVAPIKEY?token=ENVTOKEN",
        )
        .env(
            "TXFLOW_DATABASE_URL",
            "postgres://u:ENVDBPASSWORD@h/db?password=QUERYPASSWORD",
        )
        .arg("config")
        .output()
        .unwrap();
    for out in [&from_file, &from_env] {
        let shown = text(out);
        for secret in [
            &key[2..18],
            &env_key[2..18],
            "KEYSTOREPASSWORD",
            "DBPASSWORD",
            "FILEAPIKEY",
            "ENVAPIKEY",
            "ENVTOKEN",
            "QUERYPASSWORD",
        ] {
            assert!(!shown.contains(secret), "{secret} is shown:\n{shown}");
        }
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("# keys = \"***\""),
            "{shown}"
        );
    }
    let printed = effective(&from_file);
    assert_eq!(
        printed.database.url.as_deref(),
        Some("postgres://txflow:***@db.internal:5432/txflow")
    );
    assert_eq!(
        printed.rpc.urls,
        Some(vec!["https://mainnet.example.com".to_string()])
    );
    assert_eq!(
        printed.signer.keys_file.as_deref(),
        Some(keys.as_path()),
        "a path is no secret"
    );
}

#[test]
fn the_spot_ledger_settings_come_from_the_file_and_the_environment_overrides_them() {
    let dir = Dir::new();
    let file = dir.file(
        "txflow.toml",
        "[spot]\nwal_dir = \"/file/spot\"\nassets = \"EUR:2,BTC:8\"\n",
    );
    let from_file = effective(
        &txflow()
            .arg("--config")
            .arg(&file)
            .arg("config")
            .output()
            .expect("run txflow config"),
    );
    assert_eq!(
        from_file.spot.wal_dir.as_deref(),
        Some(Path::new("/file/spot"))
    );
    assert_eq!(from_file.spot.assets.as_deref(), Some("BTC:8,EUR:2"));

    let env_over_file = effective(
        &txflow()
            .arg("--config")
            .arg(&file)
            .env("TXFLOW_SPOT_WAL_DIR", "/env/spot")
            .env("TXFLOW_SPOT_ASSETS", "USDT:6")
            .arg("config")
            .output()
            .expect("run txflow config"),
    );
    assert_eq!(
        env_over_file.spot.wal_dir.as_deref(),
        Some(Path::new("/env/spot"))
    );
    assert_eq!(env_over_file.spot.assets.as_deref(), Some("USDT:6"));

    let defaults = effective(&txflow().arg("config").output().expect("run txflow config"));
    assert_eq!(
        defaults.spot.wal_dir.as_deref(),
        Some(Path::new("data/spot-ledger"))
    );
    assert_eq!(
        defaults.spot.assets.as_deref(),
        Some("BTC:8,ETH:8,USDC:6,USDT:6")
    );

    // A malformed list stops txflow (and the spot ledger, before it opens its log) with the
    // variable, or the key, named.
    for (cmd, var) in [
        ("config", "TXFLOW_SPOT_ASSETS"),
        ("spot-ledger", "TXFLOW_SPOT_ASSETS"),
    ] {
        let out = txflow()
            .env("TXFLOW_SPOT_ASSETS", "BTC:8,BTC:6")
            .env("TXFLOW_SPOT_WAL_DIR", dir.0.join("wal"))
            .arg(cmd)
            .output()
            .expect("run txflow");
        assert!(!out.status.success(), "{cmd} accepted it:\n{}", text(&out));
        assert!(text(&out).contains(var), "{cmd}:\n{}", text(&out));
        assert!(!dir.0.join("wal").exists(), "{cmd} opened the log");
    }
    let bad = dir.file("bad.toml", "[spot]\nassets = \"usdt:6\"\n");
    let out = txflow()
        .arg("--config")
        .arg(&bad)
        .arg("config")
        .output()
        .expect("run txflow config");
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("spot.assets"), "{}", text(&out));
}
