//! CPU seconds per process over a bench phase, read from `/proc` (issue 15): how much of the
//! machine txflow (this process), the broker (tansu), the node (anvil) and PostgreSQL used while a
//! figure was measured, so that a throughput comes with the resource that bounds it. A process at
//! CPU seconds ≈ wall seconds × its threads' reach is saturated; a machine whose busy seconds reach
//! wall seconds × cores is saturated as a whole, whoever uses it.
//!
//! Linux only. A service that cannot be found (another machine, another name, `/proc` unreadable)
//! reports `null` rather than a guess.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// `/proc` counts CPU time in USER_HZ ticks, which Linux fixes at 100 per second for user space on
/// every architecture it supports today, whatever the kernel's own HZ (`getconf CLK_TCK` prints
/// it). A constant rather than `sysconf`, which would need `unsafe` for one number.
const TICKS_PER_S: f64 = 100.0;

/// One process as `/proc/<pid>/stat` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    pub comm: String,
    /// utime + stime + cutime + cstime, in ticks: the process's own CPU time plus that of the
    /// children it has reaped. What a fixed process (this one, the broker, the node) used,
    /// helpers it ran and reaped included.
    pub ticks: u64,
    /// utime + stime: the process's own CPU time. What a member of a group whose members come
    /// and go (PostgreSQL's processes) counts: `/proc` is read one process at a time, so a
    /// backend that ends between two reads may be missing from the listing while its parent's
    /// cutime was read before it was reaped. Own time never counts a process twice; a member
    /// that ends during the phase loses its time in it (a lower bound, never a failure).
    pub own: u64,
}

/// Parses a `/proc/<pid>/stat` line. The command name is in parentheses and may itself hold spaces
/// and parentheses, so fields are counted after the last `)`.
pub fn parse_stat(line: &str) -> Option<ProcStat> {
    let open = line.find('(')?;
    let close = line.rfind(')')?;
    let comm = line.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = line.get(close + 1..)?.split_whitespace().collect();
    // `rest[0]` is field 3 (the state); utime, stime, cutime, cstime are fields 14 to 17 (cutime
    // and cstime are signed in the kernel's format, never negative in practice).
    let field = |n: usize| -> Option<u64> {
        let v: i64 = rest.get(n - 3)?.parse().ok()?;
        Some(v.max(0) as u64)
    };
    let own = field(14)? + field(15)?;
    Some(ProcStat {
        comm,
        ticks: own + field(16)? + field(17)?,
        own,
    })
}

/// The machine's busy ticks, all cores together, and its number of cores, from `/proc/stat`: the
/// first line `cpu  user nice system idle iowait irq softirq steal guest guest_nice` minus idle
/// and iowait (guest time is already inside user), and one `cpuN` line per core.
pub fn parse_machine(stat: &str) -> Option<(u64, usize)> {
    let mut lines = stat.lines();
    let total: Vec<u64> = lines
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    let [user, nice, system, _idle, _iowait, irq, softirq, rest @ ..] = total.as_slice() else {
        return None;
    };
    let steal = rest.first().copied().unwrap_or(0);
    let cores = lines
        .filter(|l| {
            l.strip_prefix("cpu")
                .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count();
    Some((user + nice + system + irq + softirq + steal, cores))
}

/// Inodes of the TCP sockets listening on `port` in a `/proc/net/tcp` or `/proc/net/tcp6` table
/// (`sl local_address rem_address st … inode`, the address `HEXIP:HEXPORT`, state `0A` = LISTEN).
pub fn listening_inodes(table: &str, port: u16) -> BTreeSet<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = u16::from_str_radix(f.get(1)?.rsplit_once(':')?.1, 16).ok()?;
            if local_port != port || *f.get(3)? != "0A" {
                return None;
            }
            f.get(9)?.parse().ok()
        })
        .collect()
}

/// The port of `host:port`, `scheme://host:port/path` or, for a list of brokers, the first one
/// (`a:9092,b:9092`).
pub fn port_of(address: &str) -> Option<u16> {
    let first = address.split(',').next()?.trim();
    let authority = first.split_once("://").map_or(first, |(_, rest)| rest);
    let authority = authority.split('/').next()?;
    authority.rsplit_once(':')?.1.parse().ok()
}

/// CPU seconds between two sums of ticks; `None` when either is unknown or the sum went down (a
/// process of a fixed group was replaced: its figure would be meaningless).
pub fn seconds_between(start: Option<u64>, end: Option<u64>) -> Option<f64> {
    match (start, end) {
        (Some(s), Some(e)) if e >= s => Some((e - s) as f64 / TICKS_PER_S),
        _ => None,
    }
}

/// CPU seconds used by processes seen at two samples, from each one's ticks by pid: a process
/// first seen at the end started during the phase and counts whole; one gone by the end is lost
/// (for PostgreSQL backends of the bench's database, which live as long as its pools, rare). A
/// pid whose ticks went down is a new process under a reused pid: it counts whole.
pub fn seconds_per_process(start: &BTreeMap<u32, u64>, end: &BTreeMap<u32, u64>) -> f64 {
    let ticks: u64 = end
        .iter()
        .map(|(pid, e)| match start.get(pid) {
            Some(s) if s <= e => e - s,
            _ => *e,
        })
        .sum();
    ticks as f64 / TICKS_PER_S
}

/// The database a PostgreSQL URL names: its path, without the query.
pub fn database_of(url: &str) -> Option<&str> {
    let (_, rest) = url.split_once("://")?;
    let (_, path) = rest.split_once('/')?;
    let db = path.split(['?', '#']).next()?;
    (!db.is_empty()).then_some(db)
}

/// Whether a PostgreSQL process's title (its `/proc/<pid>/cmdline`, rewritten by PostgreSQL to
/// `postgres: [cluster:] user database host(port) activity`) says it serves `database`.
pub fn serves_database(title: &str, database: &str) -> bool {
    title.starts_with("postgres:") && title.split_whitespace().any(|word| word == database)
}

/// The processes one figure covers.
#[derive(Debug)]
enum Group {
    /// Processes fixed when the probe was made: this one; the one listening on the node's or the
    /// broker's port (several anvils and brokers may run on a test machine).
    Pids(Vec<u32>),
    /// Every process of this name at each sample: PostgreSQL's postmaster and its backends, which
    /// come and go with connections.
    Named(&'static str),
    /// The PostgreSQL backends serving one database at each sample: the bench's own share of a
    /// server that other work (other databases) may be using at the same time.
    Backends(String),
    /// Nothing to measure (a database URL without a database).
    Unknown,
}

/// What a sample read of one group.
#[derive(Debug, Clone)]
enum Reading {
    /// The group's ticks together (`None`: a process of a fixed group could not be read).
    Total(Option<u64>),
    /// Each process's ticks, for a group whose members come and go.
    PerProcess(BTreeMap<u32, u64>),
    Unknown,
}

/// The figures a bench reports, in this order.
pub const WHO: [&str; 5] = ["txflow", "broker", "anvil", "postgres", "postgres_db"];

/// Finds the processes once; [`CpuProbe::sample`] then reads their CPU time.
#[derive(Debug)]
pub struct CpuProbe {
    groups: [Group; 5],
}

impl CpuProbe {
    /// txflow is this process; the broker a `tansu` process listening on the first broker's port;
    /// the node an `anvil` process listening on the RPC endpoint's port; PostgreSQL every
    /// `postgres` process (the machine's one cluster: other databases' work on it counts too), and
    /// apart from that the backends serving `database_url`'s database.
    pub fn new(rpc_url: &str, brokers: &str, database_url: &str) -> CpuProbe {
        CpuProbe {
            groups: [
                Group::Pids(vec![std::process::id()]),
                Group::Pids(port_of(brokers).map_or_else(Vec::new, |p| listeners("tansu", p))),
                Group::Pids(port_of(rpc_url).map_or_else(Vec::new, |p| listeners("anvil", p))),
                Group::Named("postgres"),
                database_of(database_url)
                    .map_or(Group::Unknown, |db| Group::Backends(db.to_string())),
            ],
        }
    }

    pub fn sample(&self) -> CpuSample {
        let all = read_all();
        let title = |pid: u32| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .ok()
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        };
        let readings = self.groups.each_ref().map(|g| read_group(g, &all, title));
        let machine = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| parse_machine(&s));
        CpuSample {
            at: Instant::now(),
            readings,
            machine,
        }
    }
}

/// What one group holds in a listing of `/proc` (`all`; `title` reads a process's title). A fixed
/// process is read again by its pid; the members of a named group or of a database's backends
/// are taken from the listing, each with its own time.
fn read_group(
    group: &Group,
    all: &[(u32, ProcStat)],
    title: impl Fn(u32) -> Option<String>,
) -> Reading {
    match group {
        Group::Pids(pids) if pids.is_empty() => Reading::Unknown,
        Group::Pids(pids) => Reading::Total(
            pids.iter()
                .map(|pid| read_stat(*pid).map(|s| s.ticks))
                .sum::<Option<u64>>(),
        ),
        Group::Named(name) => Reading::PerProcess(
            all.iter()
                .filter(|(_, s)| s.comm == *name)
                .map(|(pid, s)| (*pid, s.own))
                .collect(),
        ),
        Group::Backends(db) => Reading::PerProcess(
            all.iter()
                .filter(|(pid, s)| {
                    s.comm == "postgres" && title(*pid).is_some_and(|t| serves_database(&t, db))
                })
                .map(|(pid, s)| (*pid, s.own))
                .collect(),
        ),
        Group::Unknown => Reading::Unknown,
    }
}

/// CPU time of each group and of the machine at one moment.
#[derive(Debug, Clone)]
pub struct CpuSample {
    at: Instant,
    readings: [Reading; 5],
    machine: Option<(u64, usize)>,
}

impl CpuSample {
    /// What was used from this sample to `end`.
    pub fn until(&self, end: &CpuSample) -> CpuUse {
        CpuUse {
            wall_s: end.at.saturating_duration_since(self.at).as_secs_f64(),
            seconds: std::array::from_fn(|i| match (&self.readings[i], &end.readings[i]) {
                (Reading::Total(s), Reading::Total(e)) => seconds_between(*s, *e),
                (Reading::PerProcess(s), Reading::PerProcess(e)) => Some(seconds_per_process(s, e)),
                _ => None,
            }),
            machine: seconds_between(self.machine.map(|m| m.0), end.machine.map(|m| m.0)),
            cores: end.machine.map_or(0, |m| m.1),
        }
    }
}

/// CPU seconds over one phase: per group (in [`WHO`] order) and the machine's busy seconds over
/// all of its `cores`.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuUse {
    pub wall_s: f64,
    pub seconds: [Option<f64>; 5],
    pub machine: Option<f64>,
    pub cores: usize,
}

impl CpuUse {
    /// `{"txflow": s, "broker": s, "anvil": s, "postgres": s, "postgres_db": s, "machine": s}`,
    /// `null` for what was not found.
    pub fn json(&self) -> serde_json::Value {
        self.each(|s| s)
    }

    /// Each group's and the machine's seconds through `f`, named as in [`Self::json`].
    fn each(&self, f: impl Fn(Option<f64>) -> Option<f64>) -> serde_json::Value {
        let mut fields: serde_json::Map<String, serde_json::Value> = WHO
            .iter()
            .zip(self.seconds)
            .map(|(who, s)| (who.to_string(), f(s).into()))
            .collect();
        fields.insert("machine".into(), f(self.machine).into());
        fields.into()
    }

    /// The CPU seconds of the group named `who` (one of [`WHO`]).
    pub fn of(&self, who: &str) -> Option<f64> {
        WHO.iter()
            .position(|w| *w == who)
            .and_then(|i| self.seconds[i])
    }

    /// Each group's CPU milliseconds per transaction (`txs` of them in the phase), in the shape
    /// of [`Self::json`]: what one request cost each process, and the machine. `null` for what
    /// was not found, and everything `null` without a transaction.
    pub fn ms_per_tx(&self, txs: usize) -> serde_json::Value {
        self.each(|s| ms_per_tx(s, txs))
    }

    /// The transactions per second the machine would carry at this CPU cost per transaction
    /// with every core busy: `cores` ÷ machine CPU seconds per transaction. What the phase's
    /// work costs, as a rate: a run that kept the machine busy is near it, and no rate above it
    /// is possible for the same work on this machine. NaN (`null`) without a machine figure.
    pub fn capacity_per_s(&self, txs: usize) -> f64 {
        match self.machine {
            Some(s) if s > 0.0 && txs > 0 && self.cores > 0 => self.cores as f64 * txs as f64 / s,
            _ => f64::NAN,
        }
    }

    /// One line: each group's seconds and the cores it kept busy on average.
    pub fn line(&self) -> String {
        let share = |s: Option<f64>| match s {
            Some(s) if self.wall_s > 0.0 => format!("{s:.2} s ({:.2} cores)", s / self.wall_s),
            Some(s) => format!("{s:.2} s"),
            None => "not found".to_string(),
        };
        let mut parts: Vec<String> = WHO
            .iter()
            .zip(self.seconds)
            .map(|(who, s)| format!("{who} {}", share(s)))
            .collect();
        parts.push(format!(
            "machine {} of {} cores",
            share(self.machine),
            self.cores
        ));
        format!("CPU over {:.1} s: {}", self.wall_s, parts.join(", "))
    }
}

/// CPU `seconds` as milliseconds per transaction, `txs` of them; `None` when unknown or without a
/// transaction.
pub fn ms_per_tx(seconds: Option<f64>, txs: usize) -> Option<f64> {
    match seconds {
        Some(s) if txs > 0 => Some(s * 1000.0 / txs as f64),
        _ => None,
    }
}

fn read_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Every process's stat line that could be read, by pid (processes end while they are listed).
fn read_all() -> Vec<(u32, ProcStat)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, read_stat(pid)?)))
        .collect()
}

/// The processes named `comm` that hold a socket listening on `port`.
fn listeners(comm: &str, port: u16) -> Vec<u32> {
    let inodes: BTreeSet<u64> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|t| std::fs::read_to_string(t).ok())
        .flat_map(|t| listening_inodes(&t, port))
        .collect();
    if inodes.is_empty() {
        return Vec::new();
    }
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| read_stat(*pid).is_some_and(|s| s.comm == comm))
        .filter(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                fds.flatten().any(|fd| {
                    std::fs::read_link(fd.path()).is_ok_and(|target| {
                        target
                            .to_str()
                            .and_then(|t| t.strip_prefix("socket:[")?.strip_suffix(']'))
                            .and_then(|n| n.parse::<u64>().ok())
                            .is_some_and(|n| inodes.contains(&n))
                    })
                })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_the_name_and_the_cpu_ticks_with_reaped_children() {
        // Fields 14-17 (utime stime cutime cstime) are 1234 56 7 8.
        let line = "4242 (postgres) S 1 4242 4242 0 -1 4194560 100 0 0 0 1234 56 7 8 20 0 1 0 \
                    100 200000 300 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(ProcStat {
                comm: "postgres".into(),
                ticks: 1234 + 56 + 7 + 8,
                own: 1234 + 56,
            })
        );
        // A name with spaces and parentheses: fields are counted after the last ')'.
        let odd = "7 (tokio (rt) 1) R 1 7 7 0 -1 0 0 0 0 0 10 20 0 0 20 0 4 0 1 1 1";
        assert_eq!(
            parse_stat(odd),
            Some(ProcStat {
                comm: "tokio (rt) 1".into(),
                ticks: 30,
                own: 30,
            })
        );
        // A negative cutime (never seen, but signed in the format) counts as zero.
        let negative = "7 (x) R 1 7 7 0 -1 0 0 0 0 0 10 20 -5 1 20 0 4 0 1 1 1";
        assert_eq!(parse_stat(negative).map(|s| s.ticks), Some(31));
        for bad in [
            "",
            "7 x R 1",
            "7 (x) R 1 7 7",
            "7 (x) R 1 7 7 0 -1 0 0 0 0 0 a 20 0 0",
        ] {
            assert_eq!(parse_stat(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_machine_is_busy_for_everything_but_idle_and_iowait() {
        let stat = "cpu  100 5 50 1000 30 2 3 4 0 0\ncpu0 50 2 25 500 15 1 1 2 0 0\n\
                    cpu1 50 3 25 500 15 1 2 2 0 0\nintr 1 2 3\nctxt 99\n";
        assert_eq!(parse_machine(stat), Some((100 + 5 + 50 + 2 + 3 + 4, 2)));
        // An old kernel without steal.
        assert_eq!(
            parse_machine("cpu  1 2 3 4 5 6 7\ncpu0 1 2 3 4 5 6 7\n"),
            Some((19, 1))
        );
        assert_eq!(parse_machine("intr 1\n"), None);
        assert_eq!(parse_machine("cpu  1 2 3\n"), None);
    }

    #[test]
    fn only_listening_sockets_on_the_port_are_taken() {
        // 0x4A38 = 19000; 0x4A39 = 19001.
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:4A38 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0\n\
   1: 0100007F:4A38 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0 20 4 30 10 -1\n\
   2: 0100007F:4A39 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1 0 100 0 0 10 0\n";
        assert_eq!(listening_inodes(table, 19000), BTreeSet::from([111]));
        assert_eq!(listening_inodes(table, 19001), BTreeSet::from([333]));
        assert!(listening_inodes(table, 80).is_empty());
    }

    #[test]
    fn ports_come_from_urls_and_broker_lists() {
        let cases: &[(&str, Option<u16>)] = &[
            ("http://127.0.0.1:18545", Some(18545)),
            ("http://127.0.0.1:18545/", Some(18545)),
            ("https://node.example:8443/v1/key", Some(8443)),
            ("127.0.0.1:19092", Some(19092)),
            ("127.0.0.1:19092,127.0.0.1:19093", Some(19092)),
            ("http://node.example/rpc", None),
            ("", None),
        ];
        for (address, want) in cases {
            assert_eq!(port_of(address), *want, "{address}");
        }
    }

    #[test]
    fn seconds_are_the_ticks_used_and_unknown_when_a_sum_is_missing_or_went_down() {
        assert_eq!(seconds_between(Some(100), Some(350)), Some(2.5));
        assert_eq!(seconds_between(Some(7), Some(7)), Some(0.0));
        assert_eq!(seconds_between(None, Some(7)), None);
        assert_eq!(seconds_between(Some(7), None), None);
        assert_eq!(seconds_between(Some(8), Some(7)), None);
    }

    #[test]
    fn per_process_seconds_count_new_processes_whole_and_lose_the_ones_gone() {
        let start = BTreeMap::from([(10, 100), (11, 50), (12, 70)]);
        // 10 used 20 ticks, 11 ended, 12 is a new process under a reused pid (its ticks went
        // down), 13 started during the phase.
        let end = BTreeMap::from([(10, 120), (12, 5), (13, 30)]);
        assert_eq!(
            seconds_per_process(&start, &end),
            (20 + 5 + 30) as f64 / 100.0
        );
        assert_eq!(seconds_per_process(&BTreeMap::new(), &BTreeMap::new()), 0.0);
    }

    #[test]
    fn backends_are_told_apart_by_the_database_in_their_title() {
        let cases: &[(&str, Option<&str>)] = &[
            ("postgres://postgres@127.0.0.1:5432/txflow", Some("txflow")),
            ("postgres://u:p@h/bench_1?sslmode=disable", Some("bench_1")),
            ("postgresql://h:5432/db#x", Some("db")),
            ("postgres://h:5432/", None),
            ("postgres://h:5432", None),
            ("not a url", None),
        ];
        for (url, want) in cases {
            assert_eq!(database_of(url), *want, "{url}");
        }
        let ours = "postgres: 15/main: postgres txflow_i15 127.0.0.1(52048) INSERT";
        assert!(serves_database(ours, "txflow_i15"));
        assert!(
            !serves_database(ours, "txflow"),
            "a prefix is another database"
        );
        assert!(serves_database(
            "postgres: app bench 10.0.0.1(5) idle",
            "bench"
        ));
        assert!(!serves_database(
            "postgres: 15/main: checkpointer",
            "txflow_i15"
        ));
        assert!(!serves_database(
            "/usr/lib/postgresql/15/bin/postgres -D txflow_i15",
            "txflow_i15"
        ));
    }

    fn stat(comm: &str, own: u64, children: u64) -> ProcStat {
        ProcStat {
            comm: comm.into(),
            ticks: own + children,
            own,
        }
    }

    /// `/proc` is listed one process at a time: a backend that ends between the postmaster's
    /// read and its own is in neither the listing nor (yet) the postmaster's cutime. The group's
    /// figure is then what its members still there used, never unknown (it was `null`, and the
    /// allocation bench's report with it, when other databases' backends ended during a phase).
    #[test]
    fn a_named_group_whose_member_ended_between_reads_is_still_measured() {
        let group = Group::Named("postgres");
        let no_title = |_| None;
        let start = [
            (100, stat("postgres", 40, 500)),
            (200, stat("postgres", 300, 0)),
            (300, stat("postgres", 10, 0)),
            (400, stat("tansu", 9, 0)),
        ];
        // 100 (the postmaster) used 5, 200 ended unreaped, 300 used 20, 500 is new.
        let end = [
            (100, stat("postgres", 45, 500)),
            (300, stat("postgres", 30, 0)),
            (400, stat("tansu", 99, 0)),
            (500, stat("postgres", 7, 0)),
        ];
        let sample = |all: &[(u32, ProcStat)]| CpuSample {
            at: Instant::now(),
            readings: std::array::from_fn(|i| {
                if i == 3 {
                    read_group(&group, all, no_title)
                } else {
                    Reading::Unknown
                }
            }),
            machine: None,
        };
        let used = sample(&start).until(&sample(&end));
        assert_eq!(used.seconds[3], Some((5 + 20 + 7) as f64 / 100.0));
        // Reaped later, the ended one's whole life lands in the postmaster's cutime: own time
        // does not count it again.
        let reaped = [
            (100, stat("postgres", 45, 800)),
            (300, stat("postgres", 30, 0)),
        ];
        let used = sample(&start).until(&sample(&reaped));
        assert_eq!(used.seconds[3], Some((5 + 20) as f64 / 100.0));
    }

    #[test]
    fn backends_are_taken_by_their_title_with_their_own_time() {
        let group = Group::Backends("bench_1".into());
        let title = |pid: u32| {
            Some(match pid {
                1 => "postgres: postgres bench_1 127.0.0.1(5) idle".to_string(),
                _ => "postgres: postgres other 127.0.0.1(6) idle".to_string(),
            })
        };
        let all = [(1, stat("postgres", 12, 3)), (2, stat("postgres", 50, 0))];
        match read_group(&group, &all, title) {
            Reading::PerProcess(m) => assert_eq!(m, BTreeMap::from([(1, 12)])),
            other => panic!("{other:?}"),
        }
    }

    /// 2 s of wall time on 2 cores; no broker found.
    fn two_seconds_on_two_cores() -> CpuUse {
        CpuUse {
            wall_s: 2.0,
            seconds: [Some(1.5), None, Some(0.5), Some(1.0), Some(0.25)],
            machine: Some(3.5),
            cores: 2,
        }
    }

    #[test]
    fn a_use_reports_each_group_and_null_for_what_was_not_found() {
        let used = two_seconds_on_two_cores();
        assert_eq!(
            used.json(),
            serde_json::json!({
                "txflow": 1.5, "broker": null, "anvil": 0.5, "postgres": 1.0,
                "postgres_db": 0.25, "machine": 3.5
            })
        );
        assert_eq!(
            used.line(),
            "CPU over 2.0 s: txflow 1.50 s (0.75 cores), broker not found, \
             anvil 0.50 s (0.25 cores), postgres 1.00 s (0.50 cores), \
             postgres_db 0.25 s (0.12 cores), machine 3.50 s (1.75 cores) of 2 cores"
        );
    }

    #[test]
    fn per_transaction_costs_divide_each_group_and_the_capacity_is_the_cores_over_the_machines() {
        let used = two_seconds_on_two_cores();
        assert_eq!(
            used.ms_per_tx(500),
            serde_json::json!({
                "txflow": 3.0, "broker": null, "anvil": 1.0, "postgres": 2.0,
                "postgres_db": 0.5, "machine": 7.0
            })
        );
        // 7 ms of the machine per transaction: two cores carry 2 / 0.007 ≈ 285.7 per second.
        assert!((used.capacity_per_s(500) - 2000.0 / 7.0).abs() < 1e-9);
        assert_eq!((used.of("anvil"), used.of("broker")), (Some(0.5), None));
        // Nothing to divide by, or no machine figure: unknown, never a number.
        assert!(
            used.ms_per_tx(0)
                .as_object()
                .is_some_and(|o| o.values().all(serde_json::Value::is_null))
        );
        assert!(used.capacity_per_s(0).is_nan());
        let blind = CpuUse {
            machine: None,
            ..used
        };
        assert!(blind.capacity_per_s(500).is_nan());
        assert_eq!(blind.ms_per_tx(500)["machine"], serde_json::Value::Null);
    }

    /// This process is always found; a port nothing listens on finds nothing.
    #[test]
    fn this_process_is_sampled() {
        let probe = CpuProbe::new(
            "http://127.0.0.1:1",
            "127.0.0.1:1",
            "postgres://h/no_such_db",
        );
        let start = probe.sample();
        let used = start.until(&probe.sample());
        assert!(used.seconds[0].is_some_and(|s| s >= 0.0), "{used:?}");
        // Nothing listens on port 1: no broker, no node.
        assert_eq!((used.seconds[1], used.seconds[2]), (None, None), "{used:?}");
        // No backend serves that database: nothing used.
        assert_eq!(used.seconds[4], Some(0.0), "{used:?}");
        assert!(used.cores >= 1, "{used:?}");
    }
}
