use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};
use txflow_core::kafka::KafkaSettings;

use crate::{free_port, services, spawn_child, wait_until};

/// A tansu broker of the test's own (memory storage), for tests that restart or kill the broker.
/// Killed when dropped or when the test process dies ([`spawn_child`]).
pub struct OwnBroker {
    child: Option<Child>,
    pub port: u16,
}

impl OwnBroker {
    pub async fn spawn() -> OwnBroker {
        let port = free_port();
        let mut b = OwnBroker { child: None, port };
        b.start().await;
        b
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn settings(&self) -> KafkaSettings {
        KafkaSettings::new(self.brokers())
    }

    /// The broker process's id (None while it is stopped).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    async fn start(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let bin = &services().tansu_bin;
        let mut cmd = Command::new(bin);
        cmd.args([
            "broker",
            "--storage-engine",
            "memory://tansu/",
            "--listener-url",
            &url,
        ])
        .args(["--advertised-listener-url", &url])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
        // Dies with the test process, even one killed by a timeout.
        let child =
            spawn_child(cmd).unwrap_or_else(|e| panic!("start tansu at {}: {e}", bin.display()));
        self.child = Some(child);
        let port = self.port;
        wait_until(
            &format!("tansu accepts connections on {port}"),
            Duration::from_secs(30),
            || async move {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
            },
        )
        .await;
    }

    /// Stops the broker with SIGTERM (or SIGKILL when `kill`), waits for it to exit, and starts it
    /// again on the same port. The memory engine comes back empty.
    pub async fn restart(&mut self, kill: bool) {
        self.stop(kill).await;
        self.start().await;
    }

    /// Stops the broker and waits until it has exited and its port is free.
    pub async fn stop(&mut self, kill: bool) {
        if let Some(mut child) = self.child.take() {
            match (kill, child.id()) {
                (false, Some(pid)) => {
                    let _ = Command::new("kill")
                        .args(["-TERM", &pid.to_string()])
                        .status()
                        .await;
                }
                _ => {
                    let _ = child.start_kill();
                }
            }
            if tokio::time::timeout(Duration::from_secs(15), child.wait())
                .await
                .is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        let port = self.port;
        wait_until(
            &format!("port {port} is free again"),
            Duration::from_secs(30),
            || async move { std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() },
        )
        .await;
    }
}
