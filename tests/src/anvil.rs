use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use alloy::primitives::U256;
use alloy::providers::ext::AnvilApi;
use alloy::providers::{Provider, ProviderBuilder};
use alloy::signers::local::PrivateKeySigner;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::{services, spawn_child};

/// An anvil of the test's own on a free port (`--port 0`), killed when dropped or when the test
/// process dies ([`spawn_child`]).
pub struct AnvilNode {
    child: Child,
    pub port: u16,
    pub url: String,
}

impl AnvilNode {
    /// Interval mining every 0.2 s (never plain automine: it stalls under concurrent sends) and no
    /// persisted states (they fill the disk).
    pub async fn spawn() -> AnvilNode {
        AnvilNode::spawn_with(&["--block-time", "0.2"]).await
    }

    /// anvil with `args` in addition to `--port 0 --max-persisted-states 0`.
    pub async fn spawn_with(args: &[&str]) -> AnvilNode {
        spawn_at(&services().anvil_bin, args).await
    }

    /// The anvil process's id.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("anvil is running")
    }

    /// A new key with 1000 ether on this chain.
    pub async fn funded_key(&self) -> PrivateKeySigner {
        let key = PrivateKeySigner::random();
        self.provider()
            .anvil_set_balance(key.address(), U256::from(10u128.pow(21)))
            .await
            .expect("fund");
        key
    }

    /// Mines one block with what the pool holds (for an anvil started with `--no-mining`).
    pub async fn mine_block(&self) {
        self.provider()
            .anvil_mine(Some(1), None)
            .await
            .expect("mine");
    }

    fn provider(&self) -> impl Provider + use<> {
        ProviderBuilder::new().connect_http(self.url.parse().expect("url"))
    }
}

async fn spawn_at(bin: &Path, args: &[&str]) -> AnvilNode {
    let mut cmd = Command::new(bin);
    cmd.args([
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-persisted-states",
        "0",
    ])
    .args(args)
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .kill_on_drop(true);
    // Dies with the test process, even one killed by a timeout.
    let mut child =
        spawn_child(cmd).unwrap_or_else(|e| panic!("start anvil at {}: {e}", bin.display()));
    let stdout = child.stdout.take().expect("anvil stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let port = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(addr) = line.trim().strip_prefix("Listening on ") {
                return addr
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok());
            }
        }
        None
    })
    .await
    .ok()
    .flatten()
    .expect("anvil printed 'Listening on 127.0.0.1:PORT' within 30 s");
    // Keep draining its output so that a full pipe never blocks it.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    AnvilNode {
        child,
        port,
        url: format!("http://127.0.0.1:{port}"),
    }
}

impl Drop for AnvilNode {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}
