//! Per-(role, chain, signer) leases with monotonic fencing tokens, in PostgreSQL (seed 001 §4,
//! seed 002 §5).
//!
//! A lease is taken with one atomic upsert on `signer_lease`:
//! - no row → insert with token 1 (first acquisition);
//! - the row is ours and not expired past the clock skew → extend it, same token (renewal);
//! - the row is ours but expired past the skew → take it again with token + 1 (a restart of our
//!   own ownership: whatever we were writing under the old token must now be fenced);
//! - the row is another node's and expired past the skew → steal it with token + 1;
//! - otherwise → busy, someone else holds it.
//!
//! A lease row is never deleted (a new row would restart the token at 1 and let a stale holder of
//! token 1 write again); releasing sets its expiry in the past.
//!
//! Every time comparison uses the database clock (`clock_timestamp()`), so nodes' clocks do not
//! matter; the skew allowance covers the gap between a holder's view and the database's.
//!
//! A lease keeps other nodes out; it cannot tell two tasks of its own node apart (they share the
//! token, so both pass the fence). [`LeaseManager::lock_signer`] is the local half: one task at a
//! time acts for a signer under the manager's leases, and every clone of a manager shares the
//! locks (the allocator's two runtimes are built on clones of one manager).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::domain::Role;
use crate::domain::{ChainId, FencingToken, NodeId, Signer};
use crate::retry::{Classify, Retry};
use crate::telemetry;

/// `lease.duration`, `lease.renew_interval`, `lease.clock_skew` (seed 001 §4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    pub duration: Duration,
    pub renew_interval: Duration,
    pub clock_skew: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            duration: Duration::from_secs(10),
            renew_interval: Duration::from_secs(3),
            clock_skew: Duration::from_secs(1),
        }
    }
}

impl LeaseConfig {
    /// Checks the relations the algorithm needs: renewal well inside the duration, skew shorter
    /// than the duration.
    pub fn validate(&self) -> Result<(), LeaseError> {
        if self.duration.is_zero()
            || self.renew_interval * 2 > self.duration
            || self.clock_skew >= self.duration
        {
            return Err(LeaseError::InvalidConfig(*self));
        }
        Ok(())
    }
}

/// What a lease is for: one role acting for one signer on one chain.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseKey {
    pub role: Role,
    pub chain_id: ChainId,
    pub signer: Signer,
}

/// A lease this node was granted. Its fields are private: the only way to obtain one is from
/// [`LeaseManager`], and the only way to write critical state is through it
/// ([`HeldLease::begin`](crate::fenced)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLease {
    pub(crate) key: LeaseKey,
    pub(crate) node: NodeId,
    pub(crate) token: FencingToken,
    pub(crate) expires_at: DateTime<Utc>,
    pub(crate) granted_at: DateTime<Utc>,
    pub(crate) config: LeaseConfig,
}

impl HeldLease {
    pub fn key(&self) -> &LeaseKey {
        &self.key
    }
    pub fn node(&self) -> &NodeId {
        &self.node
    }
    pub fn token(&self) -> FencingToken {
        self.token
    }
    /// When the lease runs out unless renewed (database clock).
    pub fn expires_at(&self) -> DateTime<Utc> {
        self.expires_at
    }
    /// When this grant or renewal happened (database clock).
    pub fn granted_at(&self) -> DateTime<Utc> {
        self.granted_at
    }
}

/// How a lease was obtained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcquireKind {
    /// No one held it before: token 1.
    First,
    /// We held it and it had not expired past the skew: same token.
    Renewed,
    /// We held it but it expired past the skew: token + 1.
    Retaken,
    /// Another node held it and it expired past the skew: token + 1.
    Stolen { from: String },
}

impl AcquireKind {
    /// The kind as the telemetry events report it.
    pub fn grant(&self) -> telemetry::Grant<'_> {
        match self {
            AcquireKind::First => telemetry::Grant::First,
            AcquireKind::Renewed => telemetry::Grant::Renewed,
            AcquireKind::Retaken => telemetry::Grant::Retaken,
            AcquireKind::Stolen { from } => telemetry::Grant::Stolen { from },
        }
    }
}

/// The outcome of an acquisition attempt for one signer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquisition {
    Held(HeldLease, AcquireKind),
    /// Another node holds a live lease.
    Busy {
        signer: Signer,
        owner: Option<String>,
        token: Option<FencingToken>,
    },
}

impl Acquisition {
    pub fn held(&self) -> Option<&HeldLease> {
        match self {
            Acquisition::Held(l, _) => Some(l),
            Acquisition::Busy { .. } => None,
        }
    }
}

/// The outcome of renewing several leases at once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Renewal {
    pub renewed: Vec<HeldLease>,
    /// Leases that could not be renewed: expired past the skew or taken by another node.
    pub lost: Vec<HeldLease>,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error(
        "lease configuration {0:?} is invalid: renew_interval must be at most duration/2 and clock_skew below duration"
    )]
    InvalidConfig(LeaseConfig),
    #[error("lease query failed")]
    Db(#[source] sqlx::Error),
}

impl Classify for LeaseError {
    fn retry(&self) -> Retry {
        match self {
            LeaseError::InvalidConfig(_) => Retry::Permanent,
            LeaseError::Db(_) => Retry::Transient,
        }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Acquires, renews and releases the leases of one role for one node. Clones share the signer
/// locks ([`LeaseManager::lock_signer`]).
#[derive(Debug, Clone)]
pub struct LeaseManager {
    pool: PgPool,
    role: Role,
    node: NodeId,
    config: LeaseConfig,
    signers: Arc<SignerLocks>,
}

/// A signer's lock: held by the task acting for the signer, waited for by the others.
type SignerLock = tokio::sync::Mutex<()>;

/// One async lock per signer, created on first use and dropped with its last user.
#[derive(Debug, Default)]
struct SignerLocks {
    locks: Mutex<HashMap<(ChainId, Signer), Weak<SignerLock>>>,
}

impl SignerLocks {
    async fn lock(&self, chain_id: ChainId, signer: &Signer) -> SignerGuard {
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
            let key = (chain_id, signer.clone());
            match locks.get(&key).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    // The locks nobody holds or waits for any more go.
                    locks.retain(|_, l| l.strong_count() > 0);
                    let lock = Arc::new(SignerLock::new(()));
                    locks.insert(key, Arc::downgrade(&lock));
                    lock
                }
            }
        };
        SignerGuard {
            _held: lock.lock_owned().await,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|l| l.strong_count() > 0)
            .count()
    }
}

/// This task's turn to act for a signer ([`LeaseManager::lock_signer`]), until dropped.
#[must_use = "the signer is locked only while the guard lives"]
#[derive(Debug)]
pub struct SignerGuard {
    _held: tokio::sync::OwnedMutexGuard<()>,
}

/// One signer's row of the acquisition statement: the grant (if any) and the previous holder.
#[derive(sqlx::FromRow)]
struct AcquireRow {
    signer: String,
    token: Option<i64>,
    expires_at: Option<DateTime<Utc>>,
    granted_at: Option<DateTime<Utc>>,
    prev_owner: Option<String>,
    prev_token: Option<i64>,
}

/// One renewed lease.
#[derive(sqlx::FromRow)]
struct RenewRow {
    chain_id: i64,
    signer: String,
    fencing_token: i64,
    expires_at: DateTime<Utc>,
    granted_at: DateTime<Utc>,
}

impl LeaseManager {
    pub fn new(
        pool: PgPool,
        role: Role,
        node: NodeId,
        config: LeaseConfig,
    ) -> Result<LeaseManager, LeaseError> {
        config.validate()?;
        Ok(LeaseManager {
            pool,
            role,
            node,
            config,
            signers: Arc::default(),
        })
    }

    /// Waits for this process's turn to act for `signer` under this role's lease, and holds it
    /// until the guard is dropped: a drive takes it for its whole run, so that two drives of one
    /// signer (by two runtimes of the role on clones of this manager, or by one runtime after a
    /// batch and in its recovery scan) never run at once. Local to the process: other nodes are
    /// kept out by the lease itself.
    pub async fn lock_signer(&self, chain_id: ChainId, signer: &Signer) -> SignerGuard {
        self.signers.lock(chain_id, signer).await
    }

    pub fn node(&self) -> &NodeId {
        &self.node
    }
    pub fn role(&self) -> Role {
        self.role
    }
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Acquires or renews the lease for one signer.
    pub async fn acquire(
        &self,
        chain_id: ChainId,
        signer: &Signer,
    ) -> Result<Acquisition, LeaseError> {
        let mut all = self
            .acquire_many(chain_id, std::slice::from_ref(signer))
            .await?;
        Ok(all.remove(0))
    }

    /// Acquires or renews the leases for `signers` in one statement; one outcome per distinct
    /// signer, in address order. Rows are locked in address order, so two nodes acquiring
    /// overlapping sets cannot deadlock.
    pub async fn acquire_many(
        &self,
        chain_id: ChainId,
        signers: &[Signer],
    ) -> Result<Vec<Acquisition>, LeaseError> {
        let by_name: std::collections::BTreeMap<String, &Signer> = signers
            .iter()
            .map(|s| (s.as_str().to_string(), s))
            .collect();
        let names: Vec<&str> = by_name.keys().map(String::as_str).collect();
        let rows: Vec<AcquireRow> = sqlx::query_as(
            r#"
            WITH prev AS (
                SELECT signer, owner_node, fencing_token FROM signer_lease
                WHERE role = $1 AND chain_id = $2 AND signer = ANY($3)
            ), granted AS (
                INSERT INTO signer_lease AS sl (role, chain_id, signer, owner_node, fencing_token, expires_at, updated_at)
                SELECT $1, $2, s, $4, 1, clock_timestamp() + $5 * interval '1 millisecond', clock_timestamp()
                FROM unnest($3::text[]) AS s ORDER BY s COLLATE "C"
                ON CONFLICT (role, chain_id, signer) DO UPDATE SET
                    fencing_token = CASE
                        WHEN sl.owner_node = EXCLUDED.owner_node
                         AND sl.expires_at > clock_timestamp() - $6 * interval '1 millisecond'
                        THEN sl.fencing_token
                        ELSE sl.fencing_token + 1 END,
                    owner_node = EXCLUDED.owner_node,
                    -- the database clock when the row is updated, after any wait for its lock
                    expires_at = clock_timestamp() + $5 * interval '1 millisecond',
                    updated_at = clock_timestamp()
                WHERE sl.owner_node = EXCLUDED.owner_node
                   OR sl.expires_at <= clock_timestamp() - $6 * interval '1 millisecond'
                RETURNING sl.signer, sl.fencing_token, sl.expires_at, sl.updated_at
            )
            SELECT s.signer, g.fencing_token AS token, g.expires_at, g.updated_at AS granted_at,
                   p.owner_node AS prev_owner, p.fencing_token AS prev_token
            FROM unnest($3::text[]) AS s(signer)
            LEFT JOIN granted g ON g.signer = s.signer
            LEFT JOIN prev p ON p.signer = s.signer
            ORDER BY s.signer
            "#,
        )
        .bind(self.role.as_str())
        .bind(chain_id.0)
        .bind(&names)
        .bind(self.node.as_str())
        .bind(millis(self.config.duration))
        .bind(millis(self.config.clock_skew))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| {
            crate::metrics::get().lease_acquire(self.role, crate::metrics::lease_result::ERROR);
            LeaseError::Db(e)
        })?;

        let mut out = Vec::with_capacity(rows.len());
        for AcquireRow {
            signer: name,
            token,
            expires_at,
            granted_at,
            prev_owner,
            prev_token,
        } in rows
        {
            let Some(signer) = by_name.get(&name).map(|s| (*s).clone()) else {
                continue; // every returned name is one we bound
            };
            let key = LeaseKey {
                role: self.role,
                chain_id,
                signer: signer.clone(),
            };
            let acquisition = match (token, expires_at, granted_at) {
                (Some(token), Some(expires_at), Some(granted_at)) => {
                    let kind = match (prev_owner, prev_token) {
                        (Some(owner), Some(prev)) if owner == self.node.as_str() => {
                            if prev == token {
                                AcquireKind::Renewed
                            } else {
                                AcquireKind::Retaken
                            }
                        }
                        (Some(owner), Some(_)) => AcquireKind::Stolen { from: owner },
                        _ if token == 1 => AcquireKind::First,
                        _ => AcquireKind::Stolen {
                            from: "another node".to_string(),
                        },
                    };
                    let lease = HeldLease {
                        key,
                        node: self.node.clone(),
                        token: FencingToken(token),
                        expires_at,
                        granted_at,
                        config: self.config,
                    };
                    telemetry::LeaseAcquired {
                        role: lease.key.role,
                        chain_id: lease.key.chain_id,
                        signer: &lease.key.signer,
                        node: &lease.node,
                        fencing_token: lease.token,
                        grant: kind.grant(),
                    }
                    .emit();
                    Acquisition::Held(lease, kind)
                }
                _ => {
                    telemetry::LeaseBusy {
                        role: key.role,
                        chain_id: key.chain_id,
                        signer: &key.signer,
                        node: &self.node,
                        owner: prev_owner.as_deref(),
                    }
                    .emit();
                    Acquisition::Busy {
                        signer,
                        owner: prev_owner,
                        token: prev_token.map(FencingToken),
                    }
                }
            };
            out.push(acquisition);
        }
        Ok(out)
    }

    /// Renews `leases` (any chains, this role and node) in one statement. A lease is renewed only
    /// if it is still ours with the same token and has not expired past the skew; the others are
    /// reported lost. The rows are locked in (chain, address) order first, like every statement
    /// that locks several lease rows, so that a renewal cannot deadlock with an acquisition or a
    /// batch commit.
    pub async fn renew(&self, leases: &[HeldLease]) -> Result<Renewal, LeaseError> {
        let chains: Vec<i64> = leases.iter().map(|l| l.key.chain_id.0).collect();
        let signers: Vec<&str> = leases.iter().map(|l| l.key.signer.as_str()).collect();
        let tokens: Vec<i64> = leases.iter().map(|l| l.token.0).collect();
        let rows: Vec<RenewRow> = sqlx::query_as(
            r#"
            WITH locked AS (
                SELECT f.role, f.chain_id, f.signer FROM signer_lease f
                JOIN unnest($4::bigint[], $5::text[], $6::bigint[]) AS r(chain_id, signer, token)
                  ON f.role = $1 AND f.chain_id = r.chain_id AND f.signer = r.signer
                 AND f.fencing_token = r.token AND f.owner_node = $3
                ORDER BY f.chain_id, f.signer COLLATE "C"
                FOR UPDATE OF f
            )
            UPDATE signer_lease sl
            SET expires_at = clock_timestamp() + $2 * interval '1 millisecond', updated_at = clock_timestamp()
            FROM locked r
            WHERE sl.role = r.role AND sl.chain_id = r.chain_id AND sl.signer = r.signer
              AND sl.fencing_token = ANY($6) AND sl.owner_node = $3
              AND sl.expires_at > clock_timestamp() - $7 * interval '1 millisecond'
            RETURNING sl.chain_id, sl.signer, sl.fencing_token, sl.expires_at, sl.updated_at AS granted_at
            "#,
        )
        .bind(self.role.as_str())
        .bind(millis(self.config.duration))
        .bind(self.node.as_str())
        .bind(&chains)
        .bind(&signers)
        .bind(&tokens)
        .bind(millis(self.config.clock_skew))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| {
            crate::metrics::get().lease_acquire(self.role, crate::metrics::lease_result::ERROR);
            LeaseError::Db(e)
        })?;

        let mut renewal = Renewal::default();
        for lease in leases {
            let found = rows.iter().find(|r| {
                r.chain_id == lease.key.chain_id.0
                    && r.signer == lease.key.signer.as_str()
                    && r.fencing_token == lease.token.0
            });
            match found {
                Some(row) => {
                    let renewed = HeldLease {
                        expires_at: row.expires_at,
                        granted_at: row.granted_at,
                        ..lease.clone()
                    };
                    telemetry::LeaseRenewed {
                        role: renewed.key.role,
                        chain_id: renewed.key.chain_id,
                        signer: &renewed.key.signer,
                        node: &renewed.node,
                        fencing_token: renewed.token,
                    }
                    .emit();
                    renewal.renewed.push(renewed);
                }
                None => {
                    telemetry::LeaseLost {
                        role: lease.key.role,
                        chain_id: lease.key.chain_id,
                        signer: &lease.key.signer,
                        node: &lease.node,
                        fencing_token: lease.token,
                    }
                    .emit();
                    renewal.lost.push(lease.clone());
                }
            }
        }
        Ok(renewal)
    }

    /// Gives a lease up so that another node can take it at once (with token + 1). Returns false
    /// if it was no longer ours.
    pub async fn release(&self, lease: &HeldLease) -> Result<bool, LeaseError> {
        let done = sqlx::query(
            "UPDATE signer_lease SET expires_at = '-infinity', updated_at = clock_timestamp()
             WHERE role = $1 AND chain_id = $2 AND signer = $3 AND owner_node = $4 AND fencing_token = $5",
        )
        .bind(self.role.as_str())
        .bind(lease.key.chain_id.0)
        .bind(lease.key.signer.as_str())
        .bind(self.node.as_str())
        .bind(lease.token.0)
        .execute(&self.pool)
        .await
        .map_err(LeaseError::Db)?;
        let released = done.rows_affected() == 1;
        if released {
            telemetry::LeaseReleased {
                role: lease.key.role,
                chain_id: lease.key.chain_id,
                signer: &lease.key.signer,
                node: &lease.node,
                fencing_token: lease.token,
            }
            .emit();
        }
        Ok(released)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_signer_is_locked_by_one_task_at_a_time_and_others_are_free() {
        use futures::FutureExt;
        let locks = SignerLocks::default();
        let a = Signer::parse("0x00000000000000000000000000000000000000aa").expect("signer");
        let b = Signer::parse("0x00000000000000000000000000000000000000bb").expect("signer");
        let held = locks.lock(ChainId(1), &a).await;
        assert!(
            locks.lock(ChainId(1), &b).now_or_never().is_some(),
            "another signer is free"
        );
        assert!(
            locks.lock(ChainId(2), &a).now_or_never().is_some(),
            "the same address on another chain is free"
        );
        assert!(
            locks.lock(ChainId(1), &a).now_or_never().is_none(),
            "a second task waits while the first holds the signer"
        );
        drop(held);
        let next = locks.lock(ChainId(1), &a).now_or_never();
        assert!(next.is_some(), "its turn comes once the first lets go");
        drop(next);
        assert_eq!(
            locks.len(),
            0,
            "no lock is kept for signers nobody acts for"
        );
    }

    #[test]
    fn default_config_is_valid_and_bad_ones_are_refused() {
        LeaseConfig::default()
            .validate()
            .expect("defaults are valid");
        let bad = LeaseConfig {
            renew_interval: Duration::from_secs(6),
            ..LeaseConfig::default()
        };
        assert!(bad.validate().is_err());
        let bad = LeaseConfig {
            clock_skew: Duration::from_secs(10),
            ..LeaseConfig::default()
        };
        assert!(bad.validate().is_err());
    }
}
