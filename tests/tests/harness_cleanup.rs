//! The harness cleans up after a test binary that is killed (a timeout's SIGKILL: no destructor
//! runs): its anvils and brokers die with it, and the databases such runs leave are dropped by a
//! later run once they are old.
//!
//! Each test runs this test binary again as a child process (`current_exe`), with [`ROLE`] set so
//! that one helper "test" of this file does the child's part. Without [`ROLE`] the helpers pass
//! without doing anything.

use std::io::Write;
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{Connection, Executor, PgConnection};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;
use txflow_tests::{AnvilNode, OwnBroker, TestDb, services, spawn_child, wait_until};

/// Set in a child test process: which helper does its part.
const ROLE: &str = "TXFLOW_HARNESS_CLEANUP_ROLE";

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// This test binary, running only the helper `test` with `ROLE=role`.
fn child_test(test: &str, role: &str) -> Command {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(ROLE, role)
        .kill_on_drop(true);
    cmd
}

/// A process as seen in /proc: its pid and its start time, so that a reused pid is not taken for
/// it.
#[derive(Debug, Clone, Copy)]
struct Proc {
    pid: u32,
    started: u64,
}

impl Proc {
    /// The state letter and start time (field 22) from /proc/<pid>/stat.
    fn stat(pid: u32) -> Option<(char, u64)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // pid (comm) STATE ...: the comm may hold spaces, so read after the last ')'.
        let rest = stat.rsplit_once(')')?.1;
        let mut fields = rest.split_whitespace();
        let state = fields.next()?.chars().next()?;
        // After the state (field 3), the start time is field 22: the 19th from here.
        let started = fields.nth(18)?.parse().ok()?;
        Some((state, started))
    }

    fn of(pid: u32) -> Proc {
        let (_, started) = Proc::stat(pid).unwrap_or_else(|| panic!("process {pid} exists"));
        Proc { pid, started }
    }

    /// Running (a zombie has died: only its parent's reaping is left).
    fn alive(&self) -> bool {
        matches!(Proc::stat(self.pid), Some((state, started))
            if started == self.started && !matches!(state, 'Z' | 'X'))
    }
}

/// Kills, when dropped, whichever of the processes is still running: a failing test leaves
/// nothing behind either.
struct KillLeftovers(Vec<Proc>);

impl Drop for KillLeftovers {
    fn drop(&mut self) {
        for p in self.0.iter().filter(|p| p.alive()) {
            eprintln!("killing leftover process {}", p.pid);
            let _ = std::process::Command::new("kill")
                .args(["-9", &p.pid.to_string()])
                .status();
        }
    }
}

/// The child's part of `a_killed_test_binary_leaves_no_anvil_or_broker_behind`: an anvil and a
/// broker of its own, their pids on stdout, then a wait that only ends when stdin is closed (the
/// parent kills this process first; should the parent die instead, its end of the pipe closes and
/// this helper ends normally).
#[tokio::test]
async fn helper_holds_an_anvil_and_a_broker() {
    if role().as_deref() != Some("children") {
        return;
    }
    let anvil = AnvilNode::spawn().await;
    let broker = OwnBroker::spawn().await;
    // Straight to stdout (past the test harness's capture).
    let mut out = std::io::stdout();
    writeln!(
        out,
        "children: anvil={} broker={}",
        anvil.pid(),
        broker.pid().expect("the broker is running")
    )
    .expect("write to stdout");
    out.flush().expect("flush stdout");
    tokio::task::spawn_blocking(|| {
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
    })
    .await
    .expect("wait for stdin to close");
}

#[tokio::test]
async fn a_killed_test_binary_leaves_no_anvil_or_broker_behind() {
    if role().is_some() {
        return;
    }
    let mut child = child_test("helper_holds_an_anvil_and_a_broker", "children")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run the test binary again");
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(line) = lines.next_line().await.expect("read the child's stdout") {
            // libtest may have written "test NAME ... " on the same line first.
            if let Some((_, rest)) = line.split_once("children:") {
                return rest.to_string();
            }
        }
        panic!("the child test process ended without naming its anvil and broker")
    })
    .await
    .expect("the child test process names its anvil and broker within 120 s");
    let pid = |key: &str| -> u32 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("no {key}=PID in {line:?}"))
    };
    let (anvil, broker) = (Proc::of(pid("anvil")), Proc::of(pid("broker")));
    eprintln!(
        "the child test process {:?} runs anvil {} and broker {}",
        child.id(),
        anvil.pid,
        broker.pid
    );
    let _leftovers = KillLeftovers(vec![anvil, broker]);
    assert!(
        anvil.alive() && broker.alive(),
        "anvil and broker run while the test process does"
    );

    // What a timeout does to a test binary: SIGKILL, so that no destructor runs.
    child.start_kill().expect("SIGKILL the child test process");
    let status = child.wait().await.expect("reap the child test process");
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(9),
            "the child test process died of SIGKILL"
        );
    }

    wait_until(
        &format!(
            "anvil ({}) and broker ({}) have died with the killed test process",
            anvil.pid, broker.pid
        ),
        Duration::from_secs(30),
        || {
            let gone = !anvil.alive() && !broker.alive();
            async move { gone }
        },
    )
    .await;
}

/// The children are started by a thread of their own (see `spawn_child`): a child started from a
/// thread that has ended since (a libtest or tokio thread) runs on. `PR_SET_PDEATHSIG` fires at
/// the death of the thread that forked the child, so a child forked by the caller's thread would
/// be killed here.
#[tokio::test]
async fn a_child_outlives_the_thread_that_started_it() {
    if role().is_some() {
        return;
    }
    let runtime = tokio::runtime::Handle::current();
    let (mut child, thread) = std::thread::spawn(move || {
        let _entered = runtime.enter();
        let mut cmd = Command::new("cat");
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        let child = spawn_child(cmd).expect("start cat");
        // SAFETY: gettid has no preconditions.
        (child, unsafe { libc::gettid() })
    })
    .join()
    .expect("the starting thread ends");
    wait_until(
        "the starting thread is gone from /proc",
        Duration::from_secs(30),
        || {
            let gone = !std::path::Path::new(&format!("/proc/self/task/{thread}")).exists();
            async move { gone }
        },
    )
    .await;
    // A SIGKILL sent at that thread's exit is pending by now, and cat would never answer.
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
    stdin.write_all(b"alive\n").await.expect("write to cat");
    let echoed = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("cat answers within 30 s")
        .expect("read from cat");
    assert_eq!(
        echoed.as_deref(),
        Some("alive"),
        "cat runs on after the thread that started it"
    );
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is past 1970")
        .as_secs()
}

/// A database name of the harness's pattern, `txflow_test_{created unix secs}_{12 hex}`.
fn test_db_name(created: u64) -> String {
    format!(
        "txflow_test_{created}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

async fn admin() -> PgConnection {
    let url = &services().pg_admin_url;
    PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

async fn exists(conn: &mut PgConnection, name: &str) -> bool {
    sqlx::query_scalar::<_, i32>("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(name)
        .fetch_optional(conn)
        .await
        .expect("query pg_database")
        .is_some()
}

/// The child's part of `the_first_test_db_of_a_run_drops_old_test_databases_only`: a test that
/// creates a database, as any test does.
#[tokio::test]
async fn helper_creates_a_test_db() {
    if role().as_deref() != Some("db") {
        return;
    }
    let db = TestDb::empty().await;
    drop(db);
}

#[tokio::test]
async fn the_first_test_db_of_a_run_drops_old_test_databases_only() {
    if role().is_some() {
        return;
    }
    let mut conn = admin().await;
    // Left by a run killed three hours ago, and by one that is (as far as the sweep can tell)
    // still running.
    let old = test_db_name(now_secs() - 3 * 3600);
    let fresh = test_db_name(now_secs() - 60);
    for name in [&old, &fresh] {
        conn.execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .unwrap_or_else(|e| panic!("create database {name}: {e}"));
    }

    // A new test process: its first TestDb sweeps.
    let out = child_test("helper_creates_a_test_db", "db")
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run the test binary again");
    let (old_left, fresh_left) = (
        exists(&mut conn, &old).await,
        exists(&mut conn, &fresh).await,
    );
    for name in [&old, &fresh] {
        let _ = conn
            .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
            .await;
    }
    assert!(
        out.status.success(),
        "the child test process failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!old_left, "the old test database {old} was dropped");
    assert!(fresh_left, "the fresh test database {fresh} was left alone");
}
