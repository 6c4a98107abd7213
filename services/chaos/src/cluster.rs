//! The system under test, all of it the run's own: a private PostgreSQL cluster, the broker, the
//! registry, anvil, and N supervised `txflow` processes per role. Every process is started in a
//! process group of its own and dies with this one (PR_SET_PDEATHSIG), so killing one never
//! touches anything else on the machine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use tokio::process::{Child, Command};

/// The executables a run needs.
#[derive(Debug, Clone)]
pub struct Tools {
    pub txflow: PathBuf,
    pub tansu: PathBuf,
    pub registry: PathBuf,
    pub anvil: PathBuf,
    /// The directory of `initdb` and `postgres` (PostgreSQL 15's server binaries).
    pub pg_bin: PathBuf,
}

/// A free TCP port on 127.0.0.1 (free when asked; the caller binds it soon after).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub async fn port_open(port: u16) -> bool {
    tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_ok()
}

/// Waits until `port` accepts connections, failing after `secs`.
pub async fn wait_port(name: &str, port: u16, secs: u64, log: &Path) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !port_open(port).await {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{name} did not listen on 127.0.0.1:{port} within {secs} s (log: {})",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Waits until `port` is closed (a killed daemon's port, before restarting on it).
async fn wait_closed(port: u16) {
    for _ in 0..200 {
        if !port_open(port).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `cmd` with its output appended to `log`, in a process group of its own, killed when this
/// process dies.
pub fn spawn_logged(mut cmd: Command, log: &Path) -> anyhow::Result<Child> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let err = file.try_clone()?;
    cmd.stdin(std::process::Stdio::null())
        .stdout(file)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: runs in the forked child before exec and makes only async-signal-safe calls.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
        .with_context(|| format!("starting a process logging to {}", log.display()))
}

/// Sends `signal` to a process group (negative pid); a gone group is not an error.
pub fn signal_group(pid: u32, signal: i32) {
    if pid > 0 {
        // SAFETY: kill(2) with a process group id; no memory is touched.
        unsafe {
            libc::kill(-(pid as i32), signal);
        }
    }
}

/// `txflow <args>` with exactly `env` as its `TXFLOW_*` settings: none inherited from the shell
/// that started `txflow chaos` (which may point at the shared local services).
pub fn txflow_command(txflow: &Path, args: &[&str], env: &[(String, String)]) -> Command {
    let mut cmd = Command::new(txflow);
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("TXFLOW_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().cloned());
    cmd
}

/// A daemon (broker, registry, PostgreSQL, anvil) that can be killed and started again on the
/// same port.
pub struct Daemon {
    pub name: &'static str,
    pub port: u16,
    pub log: PathBuf,
    make: Box<dyn Fn() -> Command + Send + Sync>,
    child: Option<Child>,
}

impl Daemon {
    pub fn new(
        name: &'static str,
        port: u16,
        log: PathBuf,
        make: impl Fn() -> Command + Send + Sync + 'static,
    ) -> Daemon {
        Daemon {
            name,
            port,
            log,
            make: Box::new(make),
            child: None,
        }
    }

    /// A daemon that is `bin args...`, listening on `port`, logging to `<logs>/<name>.log`.
    pub fn program(
        name: &'static str,
        port: u16,
        logs: &Path,
        bin: PathBuf,
        args: Vec<String>,
    ) -> Daemon {
        Daemon::new(name, port, logs.join(format!("{name}.log")), move || {
            let mut c = Command::new(&bin);
            c.args(&args);
            c
        })
    }

    pub async fn start(&mut self) -> anyhow::Result<()> {
        wait_closed(self.port).await;
        self.child = Some(spawn_logged((self.make)(), &self.log)?);
        wait_port(self.name, self.port, 60, &self.log).await
    }

    /// Sends `signal` to its process group (SIGSTOP, SIGCONT); nothing when it is not running.
    pub fn signal(&self, signal: i32) {
        if let Some(pid) = self.child.as_ref().and_then(|c| c.id()) {
            signal_group(pid, signal);
        }
    }

    /// `kill -9` of its whole process group, waited for.
    pub async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Some(pid) = c.id() {
                signal_group(pid, libc::SIGKILL);
            }
            let _ = c.wait().await;
        }
        wait_closed(self.port).await;
    }
}

/// A private PostgreSQL cluster in `dir`, owned by the `postgres` user when this process runs
/// as root (PostgreSQL refuses root).
pub async fn postgres(tools: &Tools, dir: &Path, logs: &Path) -> anyhow::Result<Daemon> {
    let data = dir.join("pgdata");
    std::fs::create_dir_all(&data)?;
    let ids = owner()?;
    if let Some((uid, gid)) = ids {
        for p in [dir, data.as_path()] {
            std::os::unix::fs::chown(p, Some(uid), Some(gid))
                .with_context(|| format!("chown {} to postgres", p.display()))?;
        }
    }
    let as_owner = move |cmd: &mut Command| {
        if let Some((uid, gid)) = ids {
            cmd.uid(uid).gid(gid);
        }
    };
    let log = logs.join("postgres.log");
    let mut init = Command::new(tools.pg_bin.join("initdb"));
    init.args(["-D"])
        .arg(&data)
        .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"]);
    as_owner(&mut init);
    let status = spawn_logged(init, &log)?.wait().await?;
    anyhow::ensure!(status.success(), "initdb failed (log: {})", log.display());
    let port = free_port()?;
    let bin = tools.pg_bin.join("postgres");
    let sockets = dir.to_path_buf();
    let mut d = Daemon::new("postgres", port, log, move || {
        let mut c = Command::new(&bin);
        c.arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", sockets.display()))
            .args(["-c", "max_connections=400", "-c", "fsync=off"])
            .args(["-c", "full_page_writes=off", "-c", "shared_buffers=64MB"]);
        as_owner(&mut c);
        c
    });
    d.start().await?;
    Ok(d)
}

/// The `postgres` user's ids when running as root; `None` otherwise (run as this user).
fn owner() -> anyhow::Result<Option<(u32, u32)>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    let line = passwd
        .lines()
        .find(|l| l.starts_with("postgres:"))
        .ok_or_else(|| anyhow::anyhow!("running as root needs a `postgres` user for PostgreSQL"))?;
    let f: Vec<&str> = line.split(':').collect();
    let uid = f.get(2).and_then(|v| v.parse().ok());
    let gid = f.get(3).and_then(|v| v.parse().ok());
    match (uid, gid) {
        (Some(u), Some(g)) => Ok(Some((u, g))),
        _ => anyhow::bail!("cannot read the postgres user's ids from /etc/passwd"),
    }
}

/// One supervised `txflow <role>` process: restarted whenever it dies, until stopped.
pub struct Slot {
    pub role: &'static str,
    pub index: usize,
    pid: Arc<AtomicU32>,
    /// How long the supervisor waits before the next restart (set by a kill).
    restart_ms: Arc<AtomicU64>,
    pub starts: Arc<AtomicU32>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Slot {
    pub fn start(
        txflow: PathBuf,
        role: &'static str,
        index: usize,
        env: Vec<(String, String)>,
        log: PathBuf,
    ) -> Slot {
        let pid = Arc::new(AtomicU32::new(0));
        let restart_ms = Arc::new(AtomicU64::new(1_000));
        let starts = Arc::new(AtomicU32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, r, s, st) = (
            pid.clone(),
            restart_ms.clone(),
            starts.clone(),
            stop.clone(),
        );
        let task = tokio::spawn(async move {
            while !st.load(Ordering::SeqCst) {
                let run = s.fetch_add(1, Ordering::SeqCst);
                let mut cmd = txflow_command(&txflow, &[role], &env);
                cmd.env("TXFLOW_NODE_NAME", format!("{role}-{index}-{run}"));
                match spawn_logged(cmd, &log) {
                    Ok(mut child) => {
                        p.store(child.id().unwrap_or(0), Ordering::SeqCst);
                        let _ = child.wait().await;
                        p.store(0, Ordering::SeqCst);
                    }
                    Err(e) => eprintln!("chaos: cannot start {role}-{index}: {e:#}"),
                }
                let wait = r.swap(1_000, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(wait)).await;
            }
        });
        Slot {
            role,
            index,
            pid,
            restart_ms,
            starts,
            stop,
            task,
        }
    }

    /// `kill -9`; the supervisor starts it again after `restart_ms`.
    pub fn kill(&self, restart_ms: u64) {
        self.restart_ms.store(restart_ms, Ordering::SeqCst);
        signal_group(self.pid.load(Ordering::SeqCst), libc::SIGKILL);
    }

    /// SIGSTOP now, SIGCONT after `ms` (to the same process: a restarted one is not touched).
    pub fn pause(&self, ms: u64) {
        let pid = self.pid.load(Ordering::SeqCst);
        signal_group(pid, libc::SIGSTOP);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            signal_group(pid, libc::SIGCONT);
        });
    }

    /// Wakes a paused process at once.
    pub fn resume(&self) {
        signal_group(self.pid.load(Ordering::SeqCst), libc::SIGCONT);
    }

    /// Stops supervising and terminates the process (SIGTERM, then SIGKILL).
    pub async fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let pid = self.pid.load(Ordering::SeqCst);
        signal_group(pid, libc::SIGCONT);
        signal_group(pid, libc::SIGTERM);
        let task = self.task;
        tokio::pin!(task);
        if tokio::time::timeout(Duration::from_secs(10), &mut task)
            .await
            .is_err()
        {
            signal_group(self.pid.load(Ordering::SeqCst), libc::SIGKILL);
            let _ = task.await;
        }
    }
}
