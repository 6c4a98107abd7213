//! Fault points for crash tests (cargo feature `fault-injection`, off in release builds).
//!
//! Compiled in only with the feature and in debug builds.
//!
//! `TXFLOW_FAULT=<point>` aborts the process at that point, as `kill -9` would (no destructors,
//! no flush). `TXFLOW_PAUSE_AT=<point>` stops the process there with SIGSTOP, so that a test can
//! let another instance take over and then resume it with SIGCONT. Without the feature,
//! [`point`] compiles to nothing.

/// After the batch's PostgreSQL commit, before its outputs are produced.
pub const AFTER_COMMIT: &str = "stage.after_commit";
/// After the outputs were acknowledged, before the input offsets are stored.
pub const AFTER_PRODUCE: &str = "stage.after_produce";
/// In the middle of a batch: after the first signer's work, before the commit.
pub const MID_BATCH: &str = "stage.mid_batch";
/// After an external call, before its result is recorded.
pub const AFTER_CALL: &str = "stage.after_call";

#[cfg(all(feature = "fault-injection", debug_assertions))]
pub fn point(name: &str) {
    if std::env::var("TXFLOW_FAULT").is_ok_and(|f| f == name) {
        eprintln!("fault point {name}: aborting");
        std::process::abort();
    }
    if std::env::var("TXFLOW_PAUSE_AT").is_ok_and(|f| f == name) {
        // Only once per process: a resumed process goes on.
        static PAUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !PAUSED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            eprintln!("fault point {name}: pausing (SIGSTOP)");
            let _ = std::process::Command::new("kill")
                .args(["-STOP", &std::process::id().to_string()])
                .status();
        }
    }
}

#[cfg(not(all(feature = "fault-injection", debug_assertions)))]
#[inline(always)]
pub fn point(_name: &str) {}
