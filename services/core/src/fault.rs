//! Fault points for crash tests (cargo feature `fault-injection`, off in release builds).
//!
//! Compiled in only with the feature and in debug builds.
//!
//! `TXFLOW_FAULT=<point>` aborts the process at that point, as `kill -9` would (no destructors,
//! no flush). `TXFLOW_PAUSE_AT=<point>` stops the process there with SIGSTOP, so that a test can
//! let another instance take over and then resume it with SIGCONT. Either may name the n-th time the
//! point is reached, `<point>@<n>` (the first by default). Without the feature, [`point`] compiles
//! to nothing.

/// After the batch's PostgreSQL commit, before its outputs are produced.
pub const AFTER_COMMIT: &str = "stage.after_commit";
/// After the outputs were acknowledged, before the input offsets are stored.
pub const AFTER_PRODUCE: &str = "stage.after_produce";
/// In the middle of a batch: after the first signer's work, before the commit.
pub const MID_BATCH: &str = "stage.mid_batch";
/// After an external call, before its result is recorded.
pub const AFTER_CALL: &str = "stage.after_call";
/// After a stage's `drive` committed its work, before its outputs are produced.
pub const AFTER_DRIVE: &str = "stage.after_drive";
/// The allocator: nonces allocated and written in the fenced transaction, before its commit.
pub const ALLOCATOR_BEFORE_COMMIT: &str = "allocator.before_commit";
/// The signer gateway: transactions signed and their rows written in the fenced transaction,
/// before its commit.
pub const SIGNER_BEFORE_COMMIT: &str = "signer.before_commit";
/// The transfer coordinator (seed 004 §10.5, the crash points of CRA-001…006):
/// a transfer's TransferRequested is being applied, before its INIT → SOURCE_PENDING CAS.
pub const TRANSFER_BEFORE_START: &str = "transfer.before_start";
/// In SOURCE_PENDING (INIT → SOURCE_PENDING committed, by the batch or a drive), before the source
/// adapter is called.
pub const TRANSFER_AFTER_START: &str = "transfer.after_start";
/// The source adapter answered, before its answer is recorded.
pub const TRANSFER_AFTER_SOURCE_CALL: &str = "transfer.after_source_call";
/// SOURCE_PENDING → SOURCE_DONE committed, before SOURCE_DONE → TARGET_PENDING.
pub const TRANSFER_AFTER_SOURCE_DONE: &str = "transfer.after_source_done";
/// In TARGET_PENDING (SOURCE_DONE → TARGET_PENDING committed), before the target adapter is
/// called.
pub const TRANSFER_AFTER_TARGET_START: &str = "transfer.after_target_start";
/// The target adapter answered, before its answer is recorded.
pub const TRANSFER_AFTER_TARGET_CALL: &str = "transfer.after_target_call";
/// The source refund answered (COMPENSATING), before its answer is recorded.
pub const TRANSFER_AFTER_REFUND_CALL: &str = "transfer.after_refund_call";

#[cfg(all(feature = "fault-injection", debug_assertions))]
pub fn point(name: &str) {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// `<point>@<n>` or `<point>`: the point's name and which hit (1-based) fires.
    fn parse(setting: &str) -> (&str, u64) {
        match setting.split_once('@') {
            Some((p, n)) => (p, n.parse().unwrap_or(1)),
            None => (setting, 1),
        }
    }
    static HITS: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);
    let fault = std::env::var("TXFLOW_FAULT").ok();
    let pause = std::env::var("TXFLOW_PAUSE_AT").ok();
    let wanted = |s: Option<String>| -> Option<u64> {
        let s = s?;
        let (p, n) = parse(&s);
        (p == name).then_some(n)
    };
    let (fault, pause) = (wanted(fault), wanted(pause));
    if fault.is_none() && pause.is_none() {
        return;
    }
    let hit = {
        let mut guard = HITS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let n = guard
            .get_or_insert_with(HashMap::new)
            .entry(name.to_string())
            .or_insert(0);
        *n += 1;
        *n
    };
    if fault == Some(hit) {
        eprintln!("fault point {name} (hit {hit}): aborting");
        std::process::abort();
    }
    // Only once per process: a resumed process goes on.
    static PAUSED: AtomicBool = AtomicBool::new(false);
    if pause == Some(hit) && !PAUSED.swap(true, Ordering::SeqCst) {
        eprintln!("fault point {name} (hit {hit}): pausing (SIGSTOP)");
        let _ = std::process::Command::new("kill")
            .args(["-STOP", &std::process::id().to_string()])
            .status();
    }
}

#[cfg(not(all(feature = "fault-injection", debug_assertions)))]
#[inline(always)]
pub fn point(_name: &str) {}
