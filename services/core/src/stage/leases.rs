//! The held-lease cache: the leases this instance holds for its signers, renewed through
//! `acquire` when older than the renewal interval, forgotten when fenced, released when their
//! partitions are revoked and on shutdown.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::{Handler, StageRuntime, partition};
use crate::domain::{ChainId, Signer};
use crate::lease::{Acquisition, HeldLease};

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
            &crate::kafka::signer_key(chain_id.0, signer.as_str()),
            self.config.partitions,
        )
    }
}
