//! txflow-chaos: a seeded, replayable adversary against the real system (`txflow chaos`).
//!
//! - [`schedule`]: the faults, drawn from a seed (pure: the same seed gives the same schedule).
//! - [`cluster`]: PostgreSQL (a private cluster, `initdb` into the run's directory), the broker,
//!   the registry, anvil and N `txflow` processes per role, each of which can be killed, paused
//!   and restarted.
//! - [`fault_proxy`]: the JSON-RPC proxy between the roles and anvil (errors, timeouts, lost
//!   answers, a lagging head); the tests use it too.
//! - [`oracle`]: what must be true at the end, checked against the chain, PostgreSQL and
//!   txflow-client's downstream view.
//! - [`run`]: the workload (txflow-client's `Producer`), the schedule, the oracle.
//! - [`transfers`]: with `--transfers`, users' transfers through the HTTP gateway, the spot
//!   ledger and the coordinators, and the ledgers' balances the oracle checks.
//!
//! Replayable: the same seed replays the same schedule of faults and requests at the same
//! offsets from the start; the interleaving of threads, processes and the broker is not
//! reproduced.

pub mod cluster;
pub mod fault_proxy;
pub mod oracle;
pub mod rng;
pub mod run;
pub mod schedule;
pub mod transfers;

pub use run::{Options, run};
