//! The held-lease cache: the leases this instance holds for its signers, renewed through
//! `acquire` when older than the renewal interval, forgotten when fenced, released when their
//! partitions are revoked and on shutdown.
//!
//! Work that outlives a renewal interval keeps its leases renewed while it runs
//! ([`StageRuntime::while_renewing`], [`StageRuntime::unless_lost`]): a drive waiting on a slow
//! RPC endpoint, or a slow batch, does not let its lease run out, so its fenced writes land and
//! no one repeats the work. A drive whose lease is found lost is abandoned (its writes would be
//! refused anyway).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::time::{Duration, Instant};

use futures::future::Either;

use super::{Handler, StageRuntime, partition};
use crate::domain::{ChainId, Signer};
use crate::lease::{Acquisition, HeldLease, Renewal};

/// What to do when a lease renewed alongside some work is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnLoss {
    /// Stop the work (a drive: everything it would still write is fenced).
    Abandon,
    /// Let the work finish (a batch: the lost signers' writes are fenced or undone at commit,
    /// the others' must not be), renewing the leases still held.
    Continue,
}

/// The held leases, by signer, with when each was granted or renewed (this node's clock).
pub(super) type HeldLeases = HashMap<(ChainId, Signer), (HeldLease, Instant)>;

impl<H: Handler> StageRuntime<H> {
    /// Holds (acquiring or renewing as needed) the leases for `signers`; those held elsewhere are
    /// left out.
    pub(super) async fn leases_for(
        &self,
        signers: Vec<(ChainId, Signer)>,
    ) -> HashMap<(ChainId, Signer), HeldLease> {
        let renew_after = self.config.lease.renew_interval;
        let mut out = HashMap::new();
        let mut need: BTreeMap<ChainId, Vec<Signer>> = BTreeMap::new();
        if let Ok(held) = self.held.lock() {
            for s in signers {
                match held.get(&s) {
                    Some((l, at)) if at.elapsed() < renew_after => {
                        out.insert(s, l.clone());
                    }
                    _ => need.entry(s.0).or_default().push(s.1),
                }
            }
        }
        for (chain, list) in need {
            match self.leases.acquire_many(chain, &list).await {
                Ok(acqs) => {
                    for a in acqs {
                        if let Acquisition::Held(l, _) = a {
                            let key = (l.key().chain_id, l.key().signer.clone());
                            if let Ok(mut held) = self.held.lock() {
                                held.insert(key.clone(), (l.clone(), Instant::now()));
                            }
                            out.insert(key, l);
                        }
                    }
                }
                Err(e) => tracing::warn!(error = ?e, "lease acquisition failed"),
            }
        }
        out
    }

    /// Drops the signer's lease from the cache (it was fenced): the next batch re-acquires it.
    pub(super) fn forget(&self, signer: &(ChainId, Signer)) {
        if let Ok(mut held) = self.held.lock() {
            held.remove(signer);
        }
    }

    /// Drops `lease` from the cache if the cache still holds it with this token (a lease found
    /// lost), leaving a newer grant alone.
    fn forget_lease(&self, lease: &HeldLease) {
        let key = (lease.key().chain_id, lease.key().signer.clone());
        if let Ok(mut held) = self.held.lock()
            && held
                .get(&key)
                .is_some_and(|(l, _)| l.token() == lease.token())
        {
            held.remove(&key);
        }
    }

    /// Records renewed leases in the cache (unless a newer grant is there already).
    fn cache_renewed(&self, renewed: &[HeldLease], at: Instant) {
        if let Ok(mut held) = self.held.lock() {
            for l in renewed {
                let key = (l.key().chain_id, l.key().signer.clone());
                if held.get(&key).is_none_or(|(h, _)| h.token() == l.token()) {
                    held.insert(key, (l.clone(), at));
                }
            }
        }
    }

    /// Runs `work` while keeping `leases` renewed (a batch): every `renew_interval`, the first
    /// renewal when the oldest of them is due by the cache, each renewal recorded in the cache. A
    /// lease found lost, or one that could not be renewed (database errors) for a whole lease
    /// duration, is forgotten and no longer renewed; the work goes on (the lost signers' writes
    /// are refused by the fence or undone at commit, the others' must not be).
    pub(super) async fn while_renewing<T>(
        &self,
        leases: Vec<HeldLease>,
        work: impl Future<Output = T>,
    ) -> T {
        let work = std::pin::pin!(work);
        let renewal = std::pin::pin!(self.keep_renewed(leases, OnLoss::Continue));
        match futures::future::select(work, renewal).await {
            Either::Left((out, _)) => out,
            // Nothing left to renew: the work goes on alone.
            Either::Right(((), work)) => work.await,
        }
    }

    /// Runs `work` (a drive) while keeping `lease` renewed as [`StageRuntime::while_renewing`]
    /// does; if the lease is found lost (or cannot be renewed for a whole lease duration) it is
    /// forgotten and the work dropped: `None`. Everything the work would still write is fenced.
    pub(super) async fn unless_lost<T>(
        &self,
        lease: &HeldLease,
        work: impl Future<Output = T>,
    ) -> Option<T> {
        let work = std::pin::pin!(work);
        let renewal = std::pin::pin!(self.keep_renewed(vec![lease.clone()], OnLoss::Abandon));
        match futures::future::select(work, renewal).await {
            Either::Left((out, _)) => Some(out),
            Either::Right(((), _abandoned)) => None,
        }
    }

    /// Renews `leases` until one is lost ([`OnLoss::Abandon`]) or none is left
    /// ([`OnLoss::Continue`]); pending otherwise.
    async fn keep_renewed(&self, mut leases: Vec<HeldLease>, on_loss: OnLoss) {
        let lease = self.config.lease;
        let every = lease.renew_interval;
        // When each was granted or renewed last, by the cache; one the cache does not know (or
        // knows with another token) is renewed at once.
        let now = Instant::now();
        let last: Vec<Option<Instant>> = match self.held.lock() {
            Ok(held) => leases
                .iter()
                .map(|l| {
                    held.get(&(l.key().chain_id, l.key().signer.clone()))
                        .filter(|(c, _)| c.token() == l.token())
                        .map(|(_, at)| *at)
                })
                .collect(),
            Err(_) => vec![None; leases.len()],
        };
        let mut renewed_at = last.iter().map(|at| at.unwrap_or(now)).min().unwrap_or(now);
        let mut next = last
            .iter()
            .map(|at| at.map_or(now, |at| at + every))
            .min()
            .unwrap_or(now);
        while !leases.is_empty() {
            tokio::time::sleep_until(next.into()).await;
            match self.leases.renew(&leases).await {
                Ok(Renewal { renewed, lost }) => {
                    renewed_at = Instant::now();
                    next = renewed_at + every;
                    self.cache_renewed(&renewed, renewed_at);
                    leases = renewed;
                    if !lost.is_empty() {
                        for l in &lost {
                            self.forget_lease(l);
                        }
                        if on_loss == OnLoss::Abandon {
                            return;
                        }
                    }
                }
                Err(e) => {
                    if renewed_at.elapsed() >= lease.duration {
                        tracing::warn!(error = ?e, leases = leases.len(), "leases not renewed for a whole lease duration: taken as lost");
                        for l in &leases {
                            self.forget_lease(l);
                        }
                        return;
                    }
                    tracing::warn!(error = ?e, "lease renewal failed; trying again");
                    next = Instant::now() + (every / 4).max(Duration::from_millis(50));
                }
            }
        }
    }

    /// Releases the leases of the signers that hash to `partitions` (revoked from this instance).
    pub(super) async fn release_partitions(&self, partitions: &[i32]) {
        let leases: Vec<HeldLease> = match self.held.lock() {
            Ok(mut held) => {
                let keys: Vec<(ChainId, Signer)> = held
                    .keys()
                    .filter(|(c, s)| partitions.contains(&self.partition_of(*c, s)))
                    .cloned()
                    .collect();
                keys.iter()
                    .filter_map(|k| held.remove(k).map(|(l, _)| l))
                    .collect()
            }
            Err(_) => Vec::new(),
        };
        for l in &leases {
            if let Err(e) = self.leases.release(l).await {
                tracing::warn!(error = ?e, "could not release a lease");
            }
        }
    }

    /// Releases every held lease (shutdown).
    pub(super) async fn release_all(&self) {
        let leases: Vec<HeldLease> = self
            .held
            .lock()
            .map(|mut h| h.drain().map(|(_, (l, _))| l).collect())
            .unwrap_or_default();
        for l in &leases {
            let _ = self.leases.release(l).await;
        }
    }

    /// The input partition a signer's messages go to (librdkafka's default partitioner).
    pub(super) fn partition_of(&self, chain_id: ChainId, signer: &Signer) -> i32 {
        partition::partition_for(
            &self.handler.partition_key(chain_id, signer),
            self.config.partitions,
        )
    }
}
