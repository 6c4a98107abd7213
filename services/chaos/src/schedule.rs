//! The faults of a run, drawn from its seed. Pure: [`Schedule::draw`] with the same inputs gives
//! the same steps, so a seed that found a violation replays the same adversary.

use serde::Serialize;

use crate::rng::Rng;

/// The roles `txflow chaos` runs N processes of.
pub const ROLES: [&str; 5] = [
    "allocator",
    "signer-gateway",
    "broadcaster",
    "receipt-checker",
    "confirmation-manager",
];

/// The transfer roles `txflow chaos --transfers` runs: N coordinators and one spot ledger (a
/// single writer: its index is always 0).
pub const TRANSFER_ROLES: [&str; 2] = ["transfer-coordinator", "spot-ledger"];

/// How an operator changes the asset's rules while transfers are under way (restored after the
/// step's time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleChange {
    /// `max_amount` lowered below most transfers' amounts.
    LowerMax,
    /// The asset SUSPENDED.
    Suspend,
    /// `internal_transfer_enabled` false.
    DisableTransfers,
}

/// One fault (or one burst of adversarial upstream input).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// `kill -9` one process of a role; its supervisor restarts it after `restart_ms`.
    KillRole {
        role: &'static str,
        index: usize,
        restart_ms: u64,
    },
    /// SIGSTOP one process of a role, SIGCONT after `ms` (long enough for its leases to expire
    /// and be stolen, when `ms` is above the lease).
    PauseRole {
        role: &'static str,
        index: usize,
        ms: u64,
    },
    /// `kill -9` the broker, restart it after `down_ms` (every topic is lost; the topics are
    /// created again, PostgreSQL re-drives).
    KillBroker { down_ms: u64 },
    /// `kill -9` PostgreSQL (the whole process group), restart it after `down_ms`.
    KillPostgres { down_ms: u64 },
    /// Replace the last `depth` blocks; with `reinclude`, our removed transactions are mined
    /// again in the new blocks (`anvil_reorg` with a transaction list).
    Reorg { depth: u64, reinclude: bool },
    /// Every 3rd JSON-RPC call answers 503 for `ms`.
    RpcErrors { ms: u64 },
    /// Every 4th JSON-RPC call waits past the client's timeout for `ms`.
    RpcTimeouts { ms: u64 },
    /// Every 2nd `eth_sendRawTransaction` is forwarded and its answer lost, for `ms`.
    LostSendAnswers { ms: u64 },
    /// The endpoint's head stays `behind` blocks back for `ms`.
    LaggingHead { ms: u64, behind: u64 },
    /// `n` requests already published are published again (new event ids).
    Duplicates { n: u64 },
    /// `n` records on `tx.requests` that are no TxRequest at all.
    BadRecords { n: u64 },
    /// `n` requests, each depending on the one before (a chain of `n`).
    Chained { n: u64 },
    /// `n` requests above the approval threshold; each is approved or cancelled by an operator
    /// command while it waits.
    Approvals { n: u64 },
    /// A transaction txflow did not send, from one of its signers, at the nonce txflow uses
    /// next (it displaces txflow's own from the pool), mined with the block clock held for
    /// `hold_ms` (the block stays short of final), then removed by a one-block reorg: the nonce
    /// was never proven used by someone else, and stays txflow's.
    ForeignNonce { hold_ms: u64 },
    /// SIGSTOP the broker, SIGCONT after `ms`: every connection stays open and nothing answers,
    /// so each process lives on through produces that fail after the delivery timeout (30 s)
    /// when `ms` is above it; the broker keeps every record and every topic.
    PauseBroker { ms: u64 },
    /// Every process of `role` killed; while they are down, a reorg `depth` blocks deep (deeper
    /// than the confirmations) mines our removed transactions again in its lowest new block;
    /// the processes restart after `down_ms`.
    ReorgWhileDown {
        role: &'static str,
        depth: u64,
        down_ms: u64,
    },
    /// `kill -9` one transfer coordinator or the spot ledger; restarted after `restart_ms` (the
    /// ledger on its write-ahead log). Only with `--transfers`.
    KillTransferRole {
        role: &'static str,
        index: usize,
        restart_ms: u64,
    },
    /// SIGSTOP one transfer coordinator, SIGCONT after `ms` (half of them past the lease: the
    /// paused owner resumes after another took its users). Only with `--transfers`.
    PauseCoordinator { index: usize, ms: u64 },
    /// The operator changes the asset's rules for `ms`, then restores them: transfers admitted
    /// before and not yet sent are refused, those already sent must finish as they began. With
    /// `ledger_down`, the spot ledger is killed 2.5 s before the change and started again
    /// halfway through it: the calls made to it meanwhile have unknown outcomes when the rules
    /// change, are retried under the changed rules, and the ledger applies them when it is back. Only with `--transfers`.
    AssetRules {
        change: RuleChange,
        ms: u64,
        ledger_down: bool,
    },
}

impl Fault {
    pub fn name(&self) -> &'static str {
        match self {
            Fault::KillRole { .. } => "kill_role",
            Fault::PauseRole { .. } => "pause_role",
            Fault::KillBroker { .. } => "kill_broker",
            Fault::KillPostgres { .. } => "kill_postgres",
            Fault::Reorg { .. } => "reorg",
            Fault::RpcErrors { .. } => "rpc_errors",
            Fault::RpcTimeouts { .. } => "rpc_timeouts",
            Fault::LostSendAnswers { .. } => "lost_send_answers",
            Fault::LaggingHead { .. } => "lagging_head",
            Fault::Duplicates { .. } => "duplicates",
            Fault::BadRecords { .. } => "bad_records",
            Fault::Chained { .. } => "chained",
            Fault::Approvals { .. } => "approvals",
            Fault::ForeignNonce { .. } => "foreign_nonce",
            Fault::ReorgWhileDown { .. } => "reorg_while_down",
            Fault::PauseBroker { .. } => "pause_broker",
            Fault::KillTransferRole { .. } => "kill_transfer_role",
            Fault::PauseCoordinator { .. } => "pause_coordinator",
            Fault::AssetRules { .. } => "asset_rules",
        }
    }
}

/// Every kind of fault, by name: the first steps of a schedule cover each once.
pub const KINDS: usize = 19;

/// The kinds that need no transfers: the first [`PIPELINE_KINDS`] of [`NAMES`].
pub const PIPELINE_KINDS: usize = 16;

/// The name of each kind of fault, by the index the schedule draws ([`Fault::name`]).
pub const NAMES: [&str; KINDS] = [
    "kill_role",
    "pause_role",
    "kill_broker",
    "kill_postgres",
    "reorg",
    "rpc_errors",
    "rpc_timeouts",
    "lost_send_answers",
    "lagging_head",
    "duplicates",
    "bad_records",
    "chained",
    "approvals",
    "foreign_nonce",
    "reorg_while_down",
    "pause_broker",
    "kill_transfer_role",
    "pause_coordinator",
    "asset_rules",
];

/// The kinds of fault a schedule draws from (every kind by default; `--faults` narrows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kinds(u32);

impl Kinds {
    pub const ALL: Kinds = Kinds((1 << KINDS) - 1);
    /// The kinds a run without transfers draws from by default.
    pub const PIPELINE: Kinds = Kinds((1 << PIPELINE_KINDS) - 1);
    /// The kinds that act on transfers.
    pub const TRANSFERS: Kinds = Kinds(Kinds::ALL.0 & !Kinds::PIPELINE.0);

    /// Both sets of kinds.
    pub const fn with(self, other: Kinds) -> Kinds {
        Kinds(self.0 | other.0)
    }

    /// Some kind of this set acts on transfers.
    pub const fn has_transfer_kinds(self) -> bool {
        self.0 & Kinds::TRANSFERS.0 != 0
    }

    /// A comma-separated list of names ([`NAMES`]); an unknown name or an empty list is an error
    /// that lists the names.
    pub fn parse(list: &str) -> Result<Kinds, String> {
        let mut bits = 0u32;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let Some(i) = NAMES.iter().position(|k| *k == name) else {
                return Err(format!(
                    "no fault kind {name:?}; the kinds are {}",
                    NAMES.join(", ")
                ));
            };
            bits |= 1 << i;
        }
        if bits == 0 {
            return Err(format!(
                "no fault kind given; the kinds are {}",
                NAMES.join(", ")
            ));
        }
        Ok(Kinds(bits))
    }

    /// The kinds' indexes, in order.
    fn list(self) -> Vec<usize> {
        (0..KINDS).filter(|i| self.0 & (1 << i) != 0).collect()
    }
}

/// A fault and when it starts, in milliseconds from the start of the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Step {
    pub number: usize,
    pub at_ms: u64,
    pub fault: Fault,
}

/// What a schedule is drawn for.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub steps: usize,
    /// The time over which the steps are spread.
    pub span_ms: u64,
    /// Processes per role.
    pub processes: usize,
    pub required_confirmations: u64,
    /// The lease: a pause longer than it lets another process steal the signer.
    pub lease_ms: u64,
    /// The kinds the steps are drawn from.
    pub kinds: Kinds,
    /// The deepest a `reorg` deeper than the confirmations goes (at least
    /// `required_confirmations + 1`); [`Shape::default_max_reorg_depth`] by default.
    pub max_reorg_depth: u64,
}

impl Shape {
    /// Three times the confirmations, and two more.
    pub fn default_max_reorg_depth(required_confirmations: u64) -> u64 {
        required_confirmations * 3 + 2
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Schedule {
    pub seed: u64,
    pub steps: Vec<Step>,
}

impl Schedule {
    /// The steps for `seed`: the first are every kind of the shape once, in an order drawn from
    /// the seed; the rest are drawn at random among those kinds. Spread evenly over the span,
    /// each with a jitter.
    pub fn draw(seed: u64, shape: Shape) -> Schedule {
        let mut rng = Rng::new(seed);
        let allowed = shape.kinds.list();
        let mut kinds = allowed.clone();
        // Fisher-Yates, from the seed.
        for i in (1..kinds.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            kinds.swap(i, j);
        }
        let gap = shape.span_ms / (shape.steps as u64 + 1);
        let steps = (0..shape.steps)
            .map(|number| {
                let kind = match kinds.get(number) {
                    Some(k) => *k,
                    None => allowed[rng.below(allowed.len() as u64) as usize],
                };
                let at_ms = gap * (number as u64 + 1) + rng.below(gap / 2 + 1);
                Step {
                    number,
                    at_ms,
                    fault: fault_of(kind, &mut rng, shape),
                }
            })
            .collect();
        Schedule { seed, steps }
    }
}

fn fault_of(kind: usize, rng: &mut Rng, shape: Shape) -> Fault {
    let role = ROLES[rng.below(ROLES.len() as u64) as usize];
    let index = rng.below(shape.processes.max(1) as u64) as usize;
    let c = shape.required_confirmations;
    match kind {
        0 => Fault::KillRole {
            role,
            index,
            restart_ms: rng.between(200, 3_000),
        },
        1 => Fault::PauseRole {
            role,
            index,
            // Half of them outlive the lease: the paused owner resumes after a steal.
            ms: if rng.chance(50) {
                rng.between(shape.lease_ms + 500, shape.lease_ms * 2 + 1_000)
            } else {
                rng.between(200, shape.lease_ms / 2 + 200)
            },
        },
        // Half of the outages outlive the producers' delivery timeout (30 s): the produces in
        // flight fail, and only what the outbox relays reaches the new broker.
        2 => Fault::KillBroker {
            down_ms: if rng.chance(50) {
                rng.between(31_000, 35_000)
            } else {
                rng.between(500, 3_000)
            },
        },
        3 => Fault::KillPostgres {
            down_ms: rng.between(500, 3_000),
        },
        // Half of the reorgs are deeper than the required confirmations.
        4 => Fault::Reorg {
            depth: if rng.chance(50) {
                rng.between(c + 1, shape.max_reorg_depth.max(c + 1))
            } else {
                rng.between(1, c.max(1))
            },
            reinclude: rng.chance(50),
        },
        5 => Fault::RpcErrors {
            ms: rng.between(1_000, 5_000),
        },
        6 => Fault::RpcTimeouts {
            ms: rng.between(1_000, 5_000),
        },
        7 => Fault::LostSendAnswers {
            ms: rng.between(1_000, 5_000),
        },
        8 => Fault::LaggingHead {
            ms: rng.between(1_000, 6_000),
            behind: rng.between(1, c * 2 + 1),
        },
        9 => Fault::Duplicates {
            n: rng.between(1, 20),
        },
        10 => Fault::BadRecords {
            n: rng.between(1, 5),
        },
        11 => Fault::Chained {
            n: rng.between(2, 4),
        },
        12 => Fault::Approvals {
            n: rng.between(1, 3),
        },
        13 => Fault::ForeignNonce {
            hold_ms: rng.between(1_500, 5_000),
        },
        14 => Fault::ReorgWhileDown {
            role: if rng.chance(50) {
                "confirmation-manager"
            } else {
                "receipt-checker"
            },
            depth: rng.between(c + 1, c * 2 + 2),
            down_ms: rng.between(2_000, 8_000),
        },
        // Most pauses outlive the delivery timeout: the produces of every stage fail while its
        // process lives on, and only the outbox's unacknowledged events bring them back.
        15 => Fault::PauseBroker {
            ms: if rng.chance(75) {
                rng.between(33_000, 40_000)
            } else {
                rng.between(1_000, 5_000)
            },
        },
        // The ledger as often as a coordinator; some outages outlive the coordinator's call
        // timeout several times over (each retry an unknown outcome).
        16 => {
            let role = TRANSFER_ROLES[rng.below(TRANSFER_ROLES.len() as u64) as usize];
            Fault::KillTransferRole {
                role,
                index: if role == "spot-ledger" { 0 } else { index },
                restart_ms: rng.between(200, 6_000),
            }
        }
        17 => Fault::PauseCoordinator {
            index,
            ms: if rng.chance(50) {
                rng.between(shape.lease_ms + 500, shape.lease_ms * 2 + 1_000)
            } else {
                rng.between(200, shape.lease_ms / 2 + 200)
            },
        },
        _ => Fault::AssetRules {
            change: [
                RuleChange::LowerMax,
                RuleChange::Suspend,
                RuleChange::DisableTransfers,
            ][rng.below(3) as usize],
            ms: rng.between(1_000, 6_000),
            ledger_down: rng.chance(50),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn shape(steps: usize) -> Shape {
        Shape {
            steps,
            span_ms: 60_000,
            processes: 2,
            required_confirmations: 3,
            lease_ms: 3_000,
            kinds: Kinds::PIPELINE,
            max_reorg_depth: Shape::default_max_reorg_depth(3),
        }
    }

    #[test]
    fn each_name_is_the_kind_the_schedule_draws_at_its_index() {
        let mut rng = Rng::new(1);
        for (i, name) in NAMES.iter().enumerate() {
            assert_eq!(fault_of(i, &mut rng, shape(1)).name(), *name);
        }
        assert_eq!(Kinds::parse(&NAMES.join(",")), Ok(Kinds::ALL));
        let e = Kinds::parse("reorg,earthquake").expect_err("an unknown kind");
        assert!(
            e.contains("\"earthquake\"") && e.contains("reorg_while_down"),
            "{e}"
        );
        assert!(Kinds::parse(" , ").is_err());
    }

    #[test]
    fn a_schedule_of_some_kinds_draws_only_those_and_its_reorgs_reach_the_deepest_asked() {
        let only = Shape {
            kinds: Kinds::parse("reorg,reorg_while_down").expect("kinds"),
            max_reorg_depth: 40,
            ..shape(30)
        };
        let steps: Vec<Step> = (0..10)
            .flat_map(|seed| Schedule::draw(seed, only).steps)
            .collect();
        assert!(
            steps
                .iter()
                .all(|s| ["reorg", "reorg_while_down"].contains(&s.fault.name()))
        );
        assert!(
            steps
                .iter()
                .all(|s| !matches!(s.fault, Fault::Reorg { depth, .. } if depth > 40))
        );
        assert!(
            steps
                .iter()
                .any(|s| matches!(s.fault, Fault::Reorg { depth, .. } if depth > 11))
        );
        // Both kinds in the first two steps of every seed.
        for seed in 0..10 {
            let s = Schedule::draw(seed, only);
            let first: BTreeSet<&str> = s.steps[..2].iter().map(|x| x.fault.name()).collect();
            assert_eq!(first.len(), 2, "seed {seed}");
        }
    }

    /// Pinned: the CI seed's schedule (services/txflow/tests/chaos.rs, docs/chaos.md). A change
    /// of the draw changes every recorded seed's adversary; make it on purpose, and say so.
    #[test]
    fn the_ci_seed_draws_the_schedule_its_notes_describe() {
        let s = Schedule::draw(20261130, shape(16));
        let names: Vec<&str> = s.steps.iter().map(|x| x.fault.name()).collect();
        assert_eq!(
            names,
            [
                "reorg",
                "kill_postgres",
                "lost_send_answers",
                "lagging_head",
                "duplicates",
                "bad_records",
                "chained",
                "pause_broker",
                "kill_role",
                "approvals",
                "pause_role",
                "kill_broker",
                "rpc_errors",
                "rpc_timeouts",
                "foreign_nonce",
                "reorg_while_down",
            ]
        );
        assert_eq!(s.steps[7].fault, Fault::PauseBroker { ms: 35_398 });
        assert_eq!(s.steps[11].fault, Fault::KillBroker { down_ms: 34_663 });
    }

    #[test]
    fn a_seed_replays_its_schedule() {
        let a = Schedule::draw(42, shape(30));
        let b = Schedule::draw(42, shape(30));
        let c = Schedule::draw(43, shape(30));
        assert_eq!(a.steps, b.steps);
        assert_ne!(a.steps, c.steps);
    }

    #[test]
    fn the_first_steps_cover_every_kind_once_in_order_of_time() {
        for (set, n) in [(Kinds::PIPELINE, PIPELINE_KINDS), (Kinds::ALL, KINDS)] {
            for seed in 0..50 {
                let s = Schedule::draw(
                    seed,
                    Shape {
                        kinds: set,
                        ..shape(n)
                    },
                );
                let kinds: BTreeSet<&str> = s.steps.iter().map(|x| x.fault.name()).collect();
                assert_eq!(kinds.len(), n, "seed {seed}: {kinds:?}");
                assert!(s.steps.windows(2).all(|w| w[0].at_ms < w[1].at_ms));
                assert!(s.steps.iter().all(|x| x.at_ms < 60_000));
            }
        }
        // Without transfers no transfer fault is drawn, whatever the length.
        let long = Schedule::draw(7, shape(200));
        assert!(
            long.steps
                .iter()
                .all(|x| NAMES[..PIPELINE_KINDS].contains(&x.fault.name()))
        );
        assert!(!Kinds::PIPELINE.has_transfer_kinds());
        assert!(
            Kinds::parse("asset_rules")
                .expect("kind")
                .has_transfer_kinds()
        );
        assert_eq!(Kinds::PIPELINE.with(Kinds::TRANSFERS), Kinds::ALL);
    }

    #[test]
    fn transfer_faults_kill_the_one_ledger_and_pause_coordinators_past_the_lease() {
        let only = Shape {
            kinds: Kinds::TRANSFERS,
            ..shape(60)
        };
        let steps: Vec<Step> = (0..10)
            .flat_map(|seed| Schedule::draw(seed, only).steps)
            .collect();
        let kill = |role: &str| {
            steps
                .iter()
                .any(|s| matches!(s.fault, Fault::KillTransferRole { role: r, .. } if r == role))
        };
        assert!(kill("spot-ledger") && kill("transfer-coordinator"));
        assert!(steps.iter().all(|s| match s.fault {
            Fault::KillTransferRole { role, index, .. } => role != "spot-ledger" || index == 0,
            _ => true,
        }));
        assert!(
            steps
                .iter()
                .any(|s| matches!(s.fault, Fault::PauseCoordinator { ms, .. } if ms > 3_000))
        );
        for change in [
            RuleChange::LowerMax,
            RuleChange::Suspend,
            RuleChange::DisableTransfers,
        ] {
            assert!(
                steps
                    .iter()
                    .any(|s| matches!(s.fault, Fault::AssetRules { change: c, .. } if c == change)),
                "{change:?}"
            );
            for down in [false, true] {
                assert!(steps.iter().any(|s| matches!(
                    s.fault,
                    Fault::AssetRules { ledger_down, .. } if ledger_down == down
                )));
            }
        }
    }

    #[test]
    fn reorgs_go_deeper_than_the_confirmations_and_pauses_outlive_the_lease_in_some_seeds() {
        let steps: Vec<Step> = (0..20)
            .flat_map(|seed| Schedule::draw(seed, shape(40)).steps)
            .collect();
        assert!(
            steps
                .iter()
                .any(|s| matches!(s.fault, Fault::Reorg { depth, .. } if depth > 3))
        );
        assert!(
            steps
                .iter()
                .any(|s| matches!(s.fault, Fault::Reorg { depth, .. } if depth <= 3))
        );
        assert!(steps.iter().any(|s| matches!(
            s.fault,
            Fault::Reorg {
                reinclude: true,
                ..
            }
        )));
        assert!(
            steps
                .iter()
                .any(|s| matches!(s.fault, Fault::PauseRole { ms, .. } if ms > 3_000))
        );
        // A reorg while a role is down is always deeper than the confirmations, and the foreign
        // transaction's block is held short of final (one confirmation of three).
        assert!(steps.iter().all(|s| match s.fault {
            Fault::ReorgWhileDown { depth, role, .. } =>
                depth > 3 && ["confirmation-manager", "receipt-checker"].contains(&role),
            _ => true,
        }));
        assert!(
            steps
                .iter()
                .any(|s| matches!(s.fault, Fault::ForeignNonce { .. }))
        );
        assert!(
            steps
                .iter()
                .any(|s| matches!(s.fault, Fault::KillBroker { down_ms } if down_ms > 30_000))
        );
    }
}
