//! Shared by the tests that run `txflow` stage processes: a supervisor that restarts a stage
//! process whenever it dies, as a deployment's process manager would ([`Supervised`]), and a
//! single stage process that a test pauses and resumes ([`StageProcess`], the dual-active tests).

// Each test binary uses part of it.
#![allow(dead_code)]

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;
use txflow_tests::pipeline::Pipeline;
use txflow_tests::{kafka_settings, registry_url, spawn_child, unique, wait_until};

const LONG: Duration = Duration::from_secs(600);

/// A stage process restarted whenever it dies, with the next fault of its schedule each time
/// (`TXFLOW_FAULT`; a run that aborts there moves on to the next). What ended each run is
/// returned by [`Supervised::finish`]: the fault point, `kill -9`, `signal N` or `exit N`.
pub struct Supervised {
    pub role: &'static str,
    pid: Arc<AtomicU32>,
    killed: Arc<AtomicU32>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<Vec<String>, String>>,
}

fn tail(log: &PathBuf) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

impl Supervised {
    pub fn start(
        role: &'static str,
        env: Vec<(String, String)>,
        schedule: &[&'static str],
    ) -> Supervised {
        let pid = Arc::new(AtomicU32::new(0));
        let stop = CancellationToken::new();
        let schedule: Vec<&'static str> = schedule.to_vec();
        let killed = Arc::new(AtomicU32::new(0));
        let (pid2, killed2, stop2) = (pid.clone(), killed.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut crashes = Vec::new();
            let mut next = 0;
            for run in 0.. {
                let fault = schedule.get(next).copied();
                let log = std::env::temp_dir().join(format!("{}.log", unique(role)));
                let file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
                let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
                cmd.arg(role)
                    .envs(env.iter().cloned())
                    .env("TXFLOW_NODE_NAME", format!("{role}-{run}"))
                    // A short lease, so that a dead owner's signers are taken over soon.
                    .env("TXFLOW_LEASE_MS", "3000")
                    .env("TXFLOW_LOG", "info")
                    .env_remove("TXFLOW_PAUSE_AT")
                    .stdout(Stdio::null())
                    .stderr(file)
                    .kill_on_drop(true);
                match fault {
                    Some(f) => cmd.env("TXFLOW_FAULT", f),
                    None => cmd.env_remove("TXFLOW_FAULT"),
                };
                // Dies with the test process, even one killed by a timeout.
                let mut child = spawn_child(cmd).map_err(|e| format!("spawn {role}: {e}"))?;
                pid2.store(child.id().unwrap_or(0), Ordering::SeqCst);
                tokio::select! {
                    status = child.wait() => {
                        let status = status.map_err(|e| e.to_string())?;
                        match status.signal() {
                            // SIGABRT: the fault point fired.
                            Some(6) => {
                                crashes.push(fault.unwrap_or("abort").to_string());
                                next += 1;
                            }
                            // SIGKILL: the test's own kill -9.
                            Some(9) => {
                                crashes.push("kill -9".to_string());
                                killed2.fetch_add(1, Ordering::SeqCst);
                            }
                            // Anything else (a crash of its own, an exit on an error): a
                            // process manager restarts it; the test decides what is allowed.
                            Some(sig) => {
                                eprintln!("{role} run {run} died of signal {sig}:\n{}", tail(&log));
                                crashes.push(format!("signal {sig}"));
                            }
                            None => {
                                eprintln!("{role} run {run} ended by itself ({status}):\n{}", tail(&log));
                                crashes.push(format!("exit {}", status.code().unwrap_or(-1)));
                            }
                        }
                        if !matches!(status.signal(), Some(6 | 9)) {
                            // A process manager's restart delay: a process that cannot start
                            // does not spin.
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                    _ = stop2.cancelled() => {
                        let _ = child.kill().await;
                        return Ok(crashes);
                    }
                }
            }
            Ok(crashes)
        });
        Supervised {
            role,
            pid,
            killed,
            stop,
            task,
        }
    }

    /// `kill -9` of the running process; sent again until one has died of it (the process may be
    /// between runs when the first is sent).
    pub async fn kill_9(&self) {
        let before = self.killed.load(Ordering::SeqCst);
        wait_until("the stage dies of kill -9", LONG, || async {
            if self.killed.load(Ordering::SeqCst) > before {
                return true;
            }
            let pid = self.pid.load(Ordering::SeqCst);
            if pid > 0 {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status();
            }
            false
        })
        .await;
    }

    pub async fn finish(self) -> Vec<String> {
        self.stop.cancel();
        match self.task.await {
            Ok(Ok(crashes)) => crashes,
            Ok(Err(e)) => panic!("{e}"),
            Err(e) => panic!("{} supervisor: {e}", self.role),
        }
    }
}

/// A `txflow <role>` process of the test's own on `p`, killed on drop; its log kept for failures.
/// A signer gateway gets the keys of [`Pipeline::signers`].
pub struct StageProcess {
    pub child: Child,
    log: PathBuf,
}

impl StageProcess {
    /// `txflow <role>` as node `name` in consumer groups under `group_prefix` (a prefix of its
    /// own: the process receives every message of its input topic, whatever the others get),
    /// paused (SIGSTOP, by its own fault point) at `pause_at` if given. A short lease (3 s), so
    /// that a frozen owner's session is ended (after twice the lease) without a long wait.
    pub fn spawn(
        p: &Pipeline,
        role: &str,
        name: &str,
        group_prefix: &str,
        pause_at: Option<&str>,
    ) -> StageProcess {
        Self::spawn_leased(
            p,
            role,
            name,
            group_prefix,
            pause_at,
            Duration::from_secs(3),
        )
    }

    /// [`StageProcess::spawn`] with leases of `lease` (`TXFLOW_LEASE_MS`).
    pub fn spawn_leased(
        p: &Pipeline,
        role: &str,
        name: &str,
        group_prefix: &str,
        pause_at: Option<&str>,
        lease: Duration,
    ) -> StageProcess {
        let log = std::env::temp_dir().join(format!("{}.log", unique(name)));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_txflow"));
        cmd.arg(role)
            .envs(p.env())
            .env("TXFLOW_NODE_NAME", name)
            .env("TXFLOW_GROUP_PREFIX", group_prefix)
            .env("TXFLOW_LEASE_MS", lease.as_millis().to_string())
            // The lease events too (lease_busy: the process wants a lease another one holds).
            .env("TXFLOW_LOG", "info,txflow_core=debug,txflow::lease=debug")
            .env_remove("TXFLOW_FAULT")
            .env_remove("TXFLOW_PAUSE_AT")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        if role == "signer-gateway" {
            let (k, v) = p.signer_keys_env();
            cmd.env(k, v);
        }
        if let Some(point) = pause_at {
            cmd.env("TXFLOW_PAUSE_AT", point);
        }
        StageProcess {
            // Dies with the test process, even one killed by a timeout.
            child: spawn_child(cmd).unwrap_or_else(|e| panic!("spawn txflow {role}: {e}")),
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("the stage process is running")
    }

    /// The process state letter from /proc (`T` when stopped).
    pub fn state(&self) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        // pid (comm) STATE ...: the comm may hold spaces, so read after the last ')'.
        stat.rsplit_once(')')?.1.trim_start().chars().next()
    }

    pub fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill {sig} {}", self.pid());
    }

    /// Everything the process logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Whether the process is still running (it was not ended by what the test did to it).
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("the process status").is_none()
    }
}

/// The `role` lease of signer 0 of `p`: `(owner_node, fencing_token)`.
pub async fn lease(p: &Pipeline, role: &str) -> Option<(String, i64)> {
    sqlx::query_as(
        "SELECT owner_node, fencing_token FROM signer_lease WHERE role = $1 AND signer = $2",
    )
    .bind(role)
    .bind(p.signer(0))
    .fetch_optional(&p.db.pool)
    .await
    .expect("lease row")
}

/// Takes the `role` lease of signer 0 from its owner as a lost session would, if it is still held
/// with `token`: its expiry is set in the past, so that the next acquisition by another node
/// raises the fencing token. (A frozen owner's lease also lapses by itself; then a waiting node
/// may have taken it already, and its lease is left alone.)
pub async fn expire_lease(p: &Pipeline, role: &str, token: i64) {
    sqlx::query(
        "UPDATE signer_lease SET expires_at = clock_timestamp() - interval '1 millisecond'
         WHERE role = $1 AND signer = $2 AND fencing_token = $3",
    )
    .bind(role)
    .bind(p.signer(0))
    .bind(token)
    .execute(&p.db.pool)
    .await
    .expect("steal the lease");
}

/// The environment of a `txflow spot-ledger` process (and of the roles that talk to it) on
/// topics under `prefix` with 2 partitions, its write-ahead log in `wal_dir`, assets USDT (6
/// places) and BTC (8), and a short group session so that a killed member's partitions come back
/// soon on the local broker.
pub fn spot_ledger_env(prefix: &str, wal_dir: &Path) -> Vec<(String, String)> {
    [
        ("TXFLOW_BROKERS", kafka_settings().brokers),
        ("TXFLOW_SCHEMA_REGISTRY_URL", registry_url().to_string()),
        ("TXFLOW_TOPIC_PREFIX", prefix.to_string()),
        ("TXFLOW_PARTITIONS", "2".to_string()),
        ("TXFLOW_SPOT_WAL_DIR", wal_dir.display().to_string()),
        ("TXFLOW_SPOT_ASSETS", "USDT:6,BTC:8".to_string()),
        ("TXFLOW_GROUP_SESSION_TIMEOUT_MS", "2000".to_string()),
        ("TXFLOW_GROUP_HEARTBEAT_MS", "400".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}
