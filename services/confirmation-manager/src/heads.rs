//! Following the chain's heads: a [`View`] of the canonical chain from a given block up to the
//! head, shared by the drives of every signer.
//!
//! The blocks are read by number (`eth_getBlockByNumber`), from the head down, and kept: a block
//! already kept is trusted again once the block above it names it as its parent (a block's hash
//! commits to its parent's, so to the whole chain below it). A refresh therefore costs two calls
//! when the head has not moved, and one more per new block; a reorg is found where the parent
//! links stop matching what is kept. Each refresh checks that the segment it returns is linked
//! from the head down; a chain that moved under the walk (a parent that is not the block read
//! below it) is an error for this drive (transient), never a mixed view.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use txflow_core::chain::{BlockHeader, ChainClient, ChainError};
use txflow_core::retry::{Classify, Retry};

use crate::decide::{View, block_ref};

/// The most blocks one refresh reads below the head or below what it keeps (a transaction mined
/// long before this process started is reached over several refreshes).
pub const MAX_READS: u64 = 512;

/// How many blocks below the head are kept between refreshes.
pub const KEEP: u64 = 4096;

/// Why a view could not be built now. Transient: the next drive tries again.
#[derive(Debug, thiserror::Error)]
pub enum HeadsError {
    #[error("reading the chain's blocks")]
    Chain(#[from] ChainError),
    #[error("the chain moved while its blocks were read: {0}")]
    Moved(&'static str),
}

impl Classify for HeadsError {
    fn retry(&self) -> Retry {
        match self {
            HeadsError::Chain(e) => e.retry(),
            HeadsError::Moved(_) => Retry::Transient,
        }
    }
}

#[derive(Debug, Default)]
struct Kept {
    /// A linked segment: each block's parent is the block below it.
    blocks: BTreeMap<u64, BlockHeader>,
    head: u64,
    read_at: Option<Instant>,
}

impl Kept {
    fn lowest(&self) -> Option<u64> {
        self.blocks.keys().next().copied()
    }

    /// The kept blocks from `from` (at most the head: the head at least) up to the head.
    fn view(&self, from: u64) -> View {
        View::new(
            self.head,
            self.blocks
                .range(from.min(self.head)..)
                .map(|(_, b)| block_ref(b)),
        )
    }

    /// Whether a view of `from..=to` can be answered without reading: read less than `fresh`
    /// ago, reaching down to `from` and up to `to`. A kept head below `to` is never answered
    /// as is: the block at `to` was seen (a receipt names it) after that head was read, and a
    /// view that ends below it would call it gone.
    fn covers(&self, from: u64, to: u64, fresh: Duration, now: Instant) -> bool {
        self.read_at
            .is_some_and(|t| now.saturating_duration_since(t) < fresh)
            && self.lowest().is_some_and(|l| l <= from)
            && self.head >= to
    }
}

/// The heads follower: the blocks it keeps, behind an async lock (drives of several signers
/// share one refresh).
#[derive(Debug)]
pub struct Heads {
    kept: tokio::sync::Mutex<Kept>,
    /// A view read less than this long ago is answered as is.
    fresh: Duration,
}

impl Heads {
    pub fn new(fresh: Duration) -> Heads {
        Heads {
            kept: tokio::sync::Mutex::new(Kept::default()),
            fresh,
        }
    }

    /// The canonical chain from `from` (or as far down as this refresh reaches; the head alone
    /// when `from` is past it) up to the head. `to` is the highest block the caller asks about
    /// (a receipt's block): a kept view whose head is below it is read again, however fresh.
    pub async fn view(
        &self,
        chain: &dyn ChainClient,
        from: u64,
        to: u64,
    ) -> Result<View, HeadsError> {
        let mut kept = self.kept.lock().await;
        let now = Instant::now();
        if kept.covers(from, to, self.fresh, now) {
            return Ok(kept.view(from));
        }
        let segment = refresh(chain, &kept.blocks, from).await?;
        let head = segment.keys().next_back().copied().unwrap_or(0);
        let floor = head.saturating_sub(KEEP).min(from);
        kept.blocks = segment;
        kept.blocks.retain(|n, _| *n >= floor);
        kept.head = head;
        kept.read_at = Some(now);
        Ok(kept.view(from))
    }
}

/// Reads the head and the blocks below it down to the first one `kept` holds as its parent (the
/// kept blocks from there down are then canonical too), or else down to `from`; then, below what
/// was known, down to `from` (at most [`MAX_READS`] blocks read in all). Returns the new linked
/// segment ending at the head: what is kept and not linked to the head any more is dropped.
async fn refresh(
    chain: &dyn ChainClient,
    kept: &BTreeMap<u64, BlockHeader>,
    from: u64,
) -> Result<BTreeMap<u64, BlockHeader>, HeadsError> {
    let number = chain.block_number().await?;
    let head = chain
        .block(number)
        .await?
        .ok_or(HeadsError::Moved("the head block is not found"))?;
    let mut segment: BTreeMap<u64, BlockHeader> = BTreeMap::new();
    segment.insert(head.number, head);
    let mut reads = 0u64;
    let mut low = head;
    while low.number > 0 && reads < MAX_READS {
        let below = low.number - 1;
        if let Some(k) = kept.get(&below) {
            if k.hash == low.parent_hash {
                // Linked: every kept block from here down is canonical.
                segment.extend(kept.range(..low.number).map(|(n, b)| (*n, *b)));
                break;
            }
        } else if below < from && kept.range(..below).next_back().is_none() {
            // Below `from`, and nothing kept further down to link to.
            break;
        }
        low = read_parent(chain, &low).await?;
        segment.insert(low.number, low);
        reads += 1;
    }
    // Below what is known, down to `from`.
    let mut bottom = segment.values().next().copied().unwrap_or(head);
    while bottom.number > from && reads < MAX_READS {
        bottom = read_parent(chain, &bottom).await?;
        segment.insert(bottom.number, bottom);
        reads += 1;
    }
    Ok(segment)
}

/// The block below `child`, which must be its parent.
async fn read_parent(
    chain: &dyn ChainClient,
    child: &BlockHeader,
) -> Result<BlockHeader, HeadsError> {
    let below = child.number - 1;
    let parent = chain
        .block(below)
        .await?
        .ok_or(HeadsError::Moved("a block below the head is not found"))?;
    if parent.hash != child.parent_hash {
        return Err(HeadsError::Moved(
            "a block is not the parent of the block above it",
        ));
    }
    Ok(parent)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    use alloy::primitives::{Address, B256, Bytes, U256, keccak256};
    use txflow_core::chain::{ChainFuture, Receipt, SendOutcome, Simulation};

    use super::*;

    /// A chain of headers that the test reorganises, counting `block` calls.
    #[derive(Debug, Default)]
    struct Headers {
        blocks: Mutex<Vec<BlockHeader>>,
        reads: AtomicU64,
    }

    impl Headers {
        fn new(head: u64) -> Headers {
            let h = Headers::default();
            h.extend(head, 0);
            h
        }
        /// Replaces the blocks from `from` on with `to - from + 1` blocks of fork `fork`.
        fn reorg(&self, from: u64, to: u64, fork: u8) {
            self.blocks
                .lock()
                .expect("lock")
                .truncate(usize::try_from(from).expect("small"));
            self.extend(to, fork);
        }
        fn extend(&self, to: u64, fork: u8) {
            let mut b = self.blocks.lock().expect("lock");
            while (b.len() as u64) <= to {
                let number = b.len() as u64;
                let parent_hash = b.last().map(|p| p.hash).unwrap_or(B256::ZERO);
                b.push(BlockHeader {
                    number,
                    hash: keccak256(format!("{number}/{fork}/{parent_hash}")),
                    parent_hash,
                });
            }
        }
        fn at(&self, n: u64) -> BlockHeader {
            self.blocks.lock().expect("lock")[n as usize]
        }
        fn reads(&self) -> u64 {
            self.reads.load(Ordering::SeqCst)
        }
    }

    fn unused<'a, T: Send + 'a>() -> ChainFuture<'a, T> {
        Box::pin(async { panic!("not used by the heads follower") })
    }

    impl ChainClient for Headers {
        fn pending_nonce(&self, _: Address) -> ChainFuture<'_, u64> {
            unused()
        }
        fn latest_nonce(&self, _: Address) -> ChainFuture<'_, u64> {
            unused()
        }
        fn knows_transaction(&self, _: B256) -> ChainFuture<'_, bool> {
            unused()
        }
        fn simulate(
            &self,
            _: Address,
            _: Address,
            _: U256,
            _: Bytes,
        ) -> ChainFuture<'_, Simulation> {
            unused()
        }
        fn fees(&self) -> ChainFuture<'_, (u128, u128)> {
            unused()
        }
        fn send_raw<'a>(&'a self, _: &'a [u8]) -> ChainFuture<'a, SendOutcome> {
            unused()
        }
        fn receipt(&self, _: B256) -> ChainFuture<'_, Option<Receipt>> {
            unused()
        }
        fn block(&self, number: u64) -> ChainFuture<'_, Option<BlockHeader>> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            let b = self
                .blocks
                .lock()
                .expect("lock")
                .get(number as usize)
                .copied();
            Box::pin(async move { Ok(b) })
        }
        fn block_number(&self) -> ChainFuture<'_, u64> {
            let n = self.blocks.lock().expect("lock").len() as u64 - 1;
            Box::pin(async move { Ok(n) })
        }
        fn nonce_at(&self, _: Address, _: u64) -> ChainFuture<'_, u64> {
            unused()
        }
        fn block_transaction_hashes(&self, _: u64) -> ChainFuture<'_, Option<Vec<B256>>> {
            unused()
        }
        fn balance(&self, _: Address) -> ChainFuture<'_, U256> {
            unused()
        }
        fn revert_data(
            &self,
            _: Address,
            _: Address,
            _: U256,
            _: Bytes,
            _: u64,
        ) -> ChainFuture<'_, Option<Bytes>> {
            unused()
        }
    }

    fn hash(h: &Headers, n: u64) -> String {
        format!("{:#x}", h.at(n).hash)
    }

    #[tokio::test]
    async fn a_view_reads_new_blocks_only_and_follows_a_reorg() {
        let chain = Headers::new(10);
        let heads = Heads::new(Duration::ZERO);
        let v = heads.view(&chain, 4, 4).await.expect("view");
        assert_eq!((v.head(), v.lowest()), (10, Some(4)));
        assert_eq!(v.holds(5, &hash(&chain, 5)), Some(true));
        assert_eq!(chain.reads(), 7, "blocks 10 down to 4");

        // Nothing new: the head and the kept block below it.
        let before = chain.reads();
        heads.view(&chain, 4, 4).await.expect("view");
        assert_eq!(chain.reads() - before, 1, "only the head is read again");

        // Two new blocks: read down to the kept head.
        chain.extend(12, 0);
        let before = chain.reads();
        let v = heads.view(&chain, 4, 4).await.expect("view");
        assert_eq!(v.head(), 12);
        assert_eq!(chain.reads() - before, 2);

        // A reorg of blocks 8.. (same height): read down to block 7, the kept parent.
        let old8 = hash(&chain, 8);
        chain.reorg(8, 12, 1);
        let before = chain.reads();
        let v = heads.view(&chain, 4, 4).await.expect("view");
        assert_eq!(chain.reads() - before, 5, "blocks 12 down to 8");
        assert_eq!(v.holds(8, &old8), Some(false));
        assert_eq!(v.holds(8, &hash(&chain, 8)), Some(true));
        assert_eq!(v.holds(7, &hash(&chain, 7)), Some(true));
        assert_eq!(v.list(4, 100).map(|l| l.len()), Some(9));

        // A shorter chain: what was above the head is not known (not "gone": an endpoint that
        // lags says the same), and what differs below it is.
        chain.reorg(6, 9, 2);
        let v = heads.view(&chain, 4, 4).await.expect("view");
        assert_eq!(v.head(), 9);
        assert_eq!(v.holds(10, &hash(&chain, 9)), None);
        assert_eq!(v.holds(8, &old8), Some(false));
        assert_eq!(v.list(6, 100).map(|l| l.len()), Some(4));

        // Past the head: the head alone.
        let v = heads.view(&chain, u64::MAX, 0).await.expect("view");
        assert_eq!((v.head(), v.lowest()), (9, Some(9)));

        // Lower than kept: read further down.
        let v = heads.view(&chain, 1, 1).await.expect("view");
        assert_eq!(v.lowest(), Some(1));
        assert_eq!(v.holds(2, &hash(&chain, 2)), Some(true));
    }

    #[tokio::test]
    async fn a_fresh_view_is_answered_without_reading() {
        let chain = Headers::new(5);
        let heads = Heads::new(Duration::from_secs(3600));
        heads.view(&chain, 2, 2).await.expect("view");
        let before = chain.reads();
        chain.extend(7, 0);
        let v = heads.view(&chain, 3, 3).await.expect("view");
        assert_eq!(chain.reads(), before, "fresh: not read");
        assert_eq!(v.head(), 5);
        heads.view(&chain, 0, 0).await.expect("view");
        assert!(chain.reads() > before, "not reaching down far enough: read");
    }

    /// A receipt names block 6 while the kept view, read an instant before, ends at 5: the view
    /// is read again rather than answering "past the head" (which reads as a reorg). Failed on
    /// the code as it was: the fresh view was answered as is and `holds(6, …)` was `Some(false)`.
    #[tokio::test]
    async fn a_fresh_view_that_ends_below_a_block_asked_about_is_read_again() {
        let chain = Headers::new(5);
        let heads = Heads::new(Duration::from_secs(3600));
        heads.view(&chain, 2, 5).await.expect("view");
        chain.extend(6, 0);
        let v = heads.view(&chain, 6, 6).await.expect("view");
        assert_eq!(v.head(), 6);
        assert_eq!(v.holds(6, &hash(&chain, 6)), Some(true));
    }
}
