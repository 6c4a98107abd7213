//! A scripted, in-memory chain for the middle test tier: a stage's handler against a real
//! PostgreSQL with [`FakeChain`] in place of an RPC node (`txflow_core::chain::ChainClient`).
//!
//! The model: per-address mined (`latest`) nonces, a pool of sent transactions (decoded from their
//! EIP-2718 bytes: sender, nonce, hash), blocks made by [`FakeChain::mine`] from the pool's
//! executable transactions (consecutive nonces from each sender's latest), and receipts for what
//! was mined; each block keeps its transactions' hashes and every sender's nonce after it, so that
//! the chain's history ([`ChainClient::nonce_at`], [`ChainClient::block_transaction_hashes`])
//! tells the truth. A nonce used outside txflow ([`FakeChain::use_nonce_elsewhere`]) is a mined
//! transaction of its own, in a block of its own. Sends are answered the way a node answers them ("already known", "nonce too low",
//! "replacement transaction underpriced"), unless a test scripted the next answers
//! ([`FakeChain::script_send`]). Simulations answer `Ok { gas: 21000 }` unless set per destination;
//! any method can be made to fail as an unavailable node ([`FakeChain::fail_next`]). Every call
//! is counted per method ([`FakeChain::calls`]), and every raw transaction received is kept
//! ([`FakeChain::sent`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use alloy::consensus::{Transaction as _, TxEnvelope};
use alloy::eips::eip2718::Decodable2718;
use alloy::primitives::{Address, B256, Bytes, U256, keccak256};
use alloy::transports::TransportErrorKind;
use txflow_core::chain::{
    BlockHeader, ChainClient, ChainError, ChainFuture, Receipt, SendOutcome, Simulation,
};

/// The names [`FakeChain::calls`] counts, one per [`ChainClient`] method.
pub const METHODS: [&str; 13] = [
    "balance",
    "revert_data",
    "pending_nonce",
    "latest_nonce",
    "knows_transaction",
    "simulate",
    "fees",
    "send_raw",
    "receipt",
    "block",
    "block_number",
    "nonce_at",
    "block_transaction_hashes",
];

/// A transaction in the fake node's pool or mined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeTx {
    pub hash: B256,
    pub from: Address,
    pub nonce: u64,
    pub raw: Vec<u8>,
}

/// A mined block: its header, its transactions and every sender's nonce after it.
#[derive(Debug, Clone)]
struct FakeBlock {
    header: BlockHeader,
    transactions: Vec<B256>,
    nonces: HashMap<Address, u64>,
}

#[derive(Debug)]
struct State {
    /// Mined transactions per sender (the `latest` nonce).
    latest: HashMap<Address, u64>,
    /// Sent, not mined: by (sender, nonce).
    pool: BTreeMap<(Address, u64), FakeTx>,
    /// Mined: by hash, with the receipt.
    mined: HashMap<B256, (FakeTx, Receipt)>,
    blocks: Vec<FakeBlock>,
    /// Every raw transaction received by `send_raw`, in order (duplicates included).
    sent: Vec<Vec<u8>>,
    send_script: VecDeque<SendOutcome>,
    failures: HashMap<&'static str, usize>,
    simulations: HashMap<Address, Simulation>,
    default_simulation: Simulation,
    /// Destinations whose mined transactions revert (status 0).
    reverting: Vec<Address>,
    fees: (u128, u128),
    gas_price: u128,
    calls: HashMap<&'static str, u64>,
    /// Reorgs so far: part of every block hash, so that a block replaced at a height is another.
    forks: u64,
}

/// The scripted chain. Cheap to share: hold it in an `Arc` and give the stage an
/// `Arc<dyn ChainClient>` of the same value.
#[derive(Debug)]
pub struct FakeChain {
    state: Mutex<State>,
}

impl Default for FakeChain {
    fn default() -> Self {
        FakeChain::new()
    }
}

fn genesis() -> FakeBlock {
    FakeBlock {
        header: BlockHeader {
            number: 0,
            hash: keccak256(b"fake genesis"),
            parent_hash: B256::ZERO,
        },
        transactions: Vec::new(),
        nonces: HashMap::new(),
    }
}

impl FakeChain {
    /// An empty chain at block 0: every nonce 0, fees 2 gwei / 1 gwei, simulations succeed.
    pub fn new() -> FakeChain {
        FakeChain {
            state: Mutex::new(State {
                latest: HashMap::new(),
                pool: BTreeMap::new(),
                mined: HashMap::new(),
                blocks: vec![genesis()],
                sent: Vec::new(),
                send_script: VecDeque::new(),
                failures: HashMap::new(),
                simulations: HashMap::new(),
                default_simulation: Simulation::Ok { gas: 21_000 },
                reverting: Vec::new(),
                fees: (2_000_000_000, 1_000_000_000),
                gas_price: 1_500_000_000,
                calls: HashMap::new(),
                forks: 0,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ---- scripting ----

    /// The next `send_raw` answers, in order, before the modelled node answers again.
    pub fn script_send(&self, outcome: SendOutcome) {
        self.state().send_script.push_back(outcome);
    }

    /// What `simulate` answers for calls to `to`.
    pub fn set_simulation(&self, to: Address, simulation: Simulation) {
        self.state().simulations.insert(to, simulation);
    }

    /// What `simulate` answers for destinations without their own answer.
    pub fn set_default_simulation(&self, simulation: Simulation) {
        self.state().default_simulation = simulation;
    }

    /// What `fees` answers: (max fee, max priority fee).
    pub fn set_fees(&self, max_fee: u128, priority_fee: u128) {
        self.state().fees = (max_fee, priority_fee);
    }

    /// The next `times` calls of `method` (one of [`METHODS`]) fail as an unavailable node
    /// (transient).
    pub fn fail_next(&self, method: &'static str, times: usize) {
        assert!(METHODS.contains(&method), "no method {method}");
        *self.state().failures.entry(method).or_default() += times;
    }

    /// Transactions to `to` mined from now on revert (receipt status 0).
    pub fn revert_calls_to(&self, to: Address) {
        self.state().reverting.push(to);
    }

    /// The signer used `nonce` outside txflow: transactions txflow did not send take its nonces
    /// up to `nonce` (a block of their own, mined now), and pooled transactions below its new
    /// latest nonce are dropped (as a node does). Nothing happens if `nonce` is already used.
    pub fn use_nonce_elsewhere(&self, from: Address, nonce: u64) {
        let mut s = self.state();
        let latest = s.latest.get(&from).copied().unwrap_or(0);
        if nonce < latest {
            return;
        }
        let outsiders: Vec<FakeTx> = (latest..=nonce)
            .map(|n| FakeTx {
                hash: keccak256(format!("outsider {from} {n}")),
                from,
                nonce: n,
                raw: Vec::new(),
            })
            .collect();
        s.latest.insert(from, nonce + 1);
        s.pool.retain(|(a, n), _| *a != from || *n > nonce);
        FakeChain::seal(&mut s, outsiders);
    }

    /// Replaces the last `depth` blocks (never the genesis) with as many new empty ones: their
    /// transactions are no longer mined (no receipt), and, as anvil does, not put back in the
    /// pool; every sender's nonce is what it was below them.
    pub fn reorg(&self, depth: u64) {
        let mut s = self.state();
        let keep = s
            .blocks
            .len()
            .saturating_sub(usize::try_from(depth).unwrap_or(usize::MAX))
            .max(1);
        let removed: Vec<FakeBlock> = s.blocks.drain(keep..).collect();
        for b in &removed {
            for h in &b.transactions {
                s.mined.remove(h);
            }
        }
        s.latest = s.blocks.last().expect("genesis").nonces.clone();
        s.forks += 1;
        for _ in 0..removed.len() {
            FakeChain::seal(&mut s, Vec::new());
        }
    }

    /// Mines one block with every executable pooled transaction (consecutive nonces from each
    /// sender's latest); returns the block's number.
    pub fn mine(&self) -> u64 {
        let mut s = self.state();
        let mut included = Vec::new();
        loop {
            let next = s
                .pool
                .keys()
                .find(|(a, n)| s.latest.get(a).copied().unwrap_or(0) == *n)
                .copied();
            let Some(k) = next else { break };
            let tx = s.pool.remove(&k).expect("pooled");
            *s.latest.entry(k.0).or_default() += 1;
            included.push(tx);
        }
        FakeChain::seal(&mut s, included)
    }

    /// Appends a block of `included` (whose senders' nonces `latest` already counts), with their
    /// receipts; returns its number.
    fn seal(s: &mut State, included: Vec<FakeTx>) -> u64 {
        let parent = s.blocks.last().expect("genesis").header;
        let number = parent.number + 1;
        let hash = if s.forks == 0 {
            keccak256(format!("fake block {number} after {}", parent.hash))
        } else {
            keccak256(format!(
                "fake block {number} after {} on fork {}",
                parent.hash, s.forks
            ))
        };
        let transactions: Vec<B256> = included.iter().map(|t| t.hash).collect();
        for tx in included {
            let status = match TxEnvelope::decode_2718(&mut tx.raw.as_slice()) {
                Ok(e) => !e.to().is_some_and(|to| s.reverting.contains(&to)),
                Err(_) => true,
            };
            let receipt = Receipt {
                tx_hash: tx.hash,
                block_number: number,
                block_hash: hash,
                status,
                gas_used: 21_000,
                effective_gas_price: s.gas_price,
            };
            s.mined.insert(tx.hash, (tx, receipt));
        }
        let nonces = s.latest.clone();
        s.blocks.push(FakeBlock {
            header: BlockHeader {
                number,
                hash,
                parent_hash: parent.hash,
            },
            transactions,
            nonces,
        });
        number
    }

    // ---- inspection ----

    /// How many times `method` (one of [`METHODS`]) was called.
    pub fn calls(&self, method: &str) -> u64 {
        assert!(METHODS.contains(&method), "no method {method}");
        self.state().calls.get(method).copied().unwrap_or(0)
    }

    /// Every raw transaction received, in order, duplicates included.
    pub fn sent(&self) -> Vec<Vec<u8>> {
        self.state().sent.clone()
    }

    /// The pool: sent, not mined, by (sender, nonce).
    pub fn pooled(&self) -> Vec<FakeTx> {
        self.state().pool.values().cloned().collect()
    }

    /// Whether a transaction with this hash was mined.
    pub fn is_mined(&self, hash: B256) -> bool {
        self.state().mined.contains_key(&hash)
    }

    // ---- the node ----

    /// Counts the call; the scripted failure, if one is due.
    fn enter(&self, method: &'static str) -> Result<MutexGuard<'_, State>, ChainError> {
        let mut s = self.state();
        *s.calls.entry(method).or_default() += 1;
        if let Some(n) = s.failures.get_mut(method)
            && *n > 0
        {
            *n -= 1;
            return Err(ChainError::Unavailable {
                method,
                source: TransportErrorKind::custom_str("fake chain: scripted failure"),
            });
        }
        Ok(s)
    }

    fn block_at(s: &State, number: u64) -> Option<&FakeBlock> {
        s.blocks.get(usize::try_from(number).ok()?)
    }

    fn pending_of(s: &State, from: Address) -> u64 {
        let mut n = s.latest.get(&from).copied().unwrap_or(0);
        while s.pool.contains_key(&(from, n)) {
            n += 1;
        }
        n
    }

    fn send(&self, raw: &[u8]) -> Result<SendOutcome, ChainError> {
        let mut s = self.enter("send_raw")?;
        s.sent.push(raw.to_vec());
        if let Some(o) = s.send_script.pop_front() {
            return Ok(o);
        }
        let decoded = TxEnvelope::decode_2718(&mut &raw[..]).map_err(|e| e.to_string());
        let (envelope, from) = match decoded.and_then(|e| {
            let from = e
                .signature()
                .recover_address_from_prehash(&e.signature_hash())
                .map_err(|e| e.to_string())?;
            Ok((e, from))
        }) {
            Ok(v) => v,
            Err(reason) => {
                return Ok(SendOutcome::Rejected {
                    retryable: false,
                    reason: format!("-32602: failed to decode transaction: {reason}"),
                });
            }
        };
        let tx = FakeTx {
            hash: *envelope.tx_hash(),
            from,
            nonce: envelope.nonce(),
            raw: raw.to_vec(),
        };
        // As a node checks: the nonce against the state first (a mined transaction sent again is
        // "nonce too low"), then the pool.
        if tx.nonce < s.latest.get(&from).copied().unwrap_or(0) {
            return Ok(SendOutcome::NonceTooLow {
                reason: "-32003: nonce too low".into(),
            });
        }
        if s.pool.values().any(|p| p.hash == tx.hash) {
            return Ok(SendOutcome::PossiblySent {
                reason: "-32000: already known".into(),
            });
        }
        if s.pool.contains_key(&(from, tx.nonce)) {
            return Ok(SendOutcome::Rejected {
                retryable: true,
                reason: "-32603: replacement transaction underpriced".into(),
            });
        }
        s.pool.insert((from, tx.nonce), tx);
        Ok(SendOutcome::Accepted)
    }
}

fn ready<'a, T: Send + 'a>(r: Result<T, ChainError>) -> ChainFuture<'a, T> {
    Box::pin(std::future::ready(r))
}

impl ChainClient for FakeChain {
    fn pending_nonce(&self, address: Address) -> ChainFuture<'_, u64> {
        ready(
            self.enter("pending_nonce")
                .map(|s| FakeChain::pending_of(&s, address)),
        )
    }

    fn latest_nonce(&self, address: Address) -> ChainFuture<'_, u64> {
        ready(
            self.enter("latest_nonce")
                .map(|s| s.latest.get(&address).copied().unwrap_or(0)),
        )
    }

    fn knows_transaction(&self, hash: B256) -> ChainFuture<'_, bool> {
        ready(
            self.enter("knows_transaction")
                .map(|s| s.mined.contains_key(&hash) || s.pool.values().any(|p| p.hash == hash)),
        )
    }

    fn simulate(
        &self,
        _from: Address,
        to: Address,
        _value: U256,
        _data: Bytes,
    ) -> ChainFuture<'_, Simulation> {
        ready(self.enter("simulate").map(|s| {
            s.simulations
                .get(&to)
                .cloned()
                .unwrap_or_else(|| s.default_simulation.clone())
        }))
    }

    fn fees(&self) -> ChainFuture<'_, (u128, u128)> {
        ready(self.enter("fees").map(|s| s.fees))
    }

    fn send_raw<'a>(&'a self, raw: &'a [u8]) -> ChainFuture<'a, SendOutcome> {
        ready(self.send(raw))
    }

    fn receipt(&self, hash: B256) -> ChainFuture<'_, Option<Receipt>> {
        ready(
            self.enter("receipt")
                .map(|s| s.mined.get(&hash).map(|(_, r)| r.clone())),
        )
    }

    fn block(&self, number: u64) -> ChainFuture<'_, Option<BlockHeader>> {
        ready(
            self.enter("block")
                .map(|s| FakeChain::block_at(&s, number).map(|b| b.header)),
        )
    }

    fn block_number(&self) -> ChainFuture<'_, u64> {
        ready(
            self.enter("block_number")
                .map(|s| s.blocks.last().map(|b| b.header.number).unwrap_or(0)),
        )
    }

    fn nonce_at(&self, address: Address, block: u64) -> ChainFuture<'_, u64> {
        ready(self.enter("nonce_at").and_then(|s| {
            // As a node answers for a block it does not have.
            FakeChain::block_at(&s, block)
                .map(|b| b.nonces.get(&address).copied().unwrap_or(0))
                .ok_or(ChainError::Rpc {
                    method: "eth_getTransactionCount",
                    code: -32000,
                    message: "header not found".into(),
                    data: None,
                })
        }))
    }

    fn block_transaction_hashes(&self, number: u64) -> ChainFuture<'_, Option<Vec<B256>>> {
        ready(
            self.enter("block_transaction_hashes")
                .map(|s| FakeChain::block_at(&s, number).map(|b| b.transactions.clone())),
        )
    }

    /// Every account is rich on the fake chain: it models nonces, not balances.
    fn balance(&self, _address: Address) -> ChainFuture<'_, U256> {
        ready(self.enter("balance").map(|_| U256::MAX))
    }

    /// A call to a reverting destination reverts with `Error("reverted by the fake chain")`.
    fn revert_data(
        &self,
        _from: Address,
        to: Address,
        _value: U256,
        _data: Bytes,
        _block: u64,
    ) -> ChainFuture<'_, Option<Bytes>> {
        ready(self.enter("revert_data").map(|s| {
            s.reverting
                .contains(&to)
                .then(|| Bytes::from(fake_revert_data()))
        }))
    }
}

/// A signed 1-wei EIP-1559 transfer on chain 31337 with `fees` (max fee, tip): what the tests
/// send to a chain, fake or real.
pub fn signed_transfer(
    key: &alloy::signers::local::PrivateKeySigner,
    nonce: u64,
    to: Address,
    fees: (u128, u128),
) -> txflow_core::chain::SignedTx {
    txflow_core::chain::sign(
        key,
        &txflow_core::chain::UnsignedTx {
            chain_id: 31337,
            nonce,
            to,
            value: U256::from(1),
            data: Bytes::new(),
            gas_limit: 21_000,
            max_fee_per_gas: fees.0,
            max_priority_fee_per_gas: fees.1,
        },
    )
    .expect("a local key signs")
}

/// The revert data of the fake chain's reverting calls: `Error("reverted by the fake chain")`.
pub fn fake_revert_data() -> Vec<u8> {
    let text = b"reverted by the fake chain";
    let mut d = vec![0x08, 0xc3, 0x79, 0xa0];
    let mut offset = [0u8; 32];
    offset[31] = 0x20;
    d.extend_from_slice(&offset);
    let mut len = [0u8; 32];
    len[31] = text.len() as u8;
    d.extend_from_slice(&len);
    let mut t = text.to_vec();
    t.resize(32, 0);
    d.extend_from_slice(&t);
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloy::signers::local::PrivateKeySigner;
    use txflow_core::retry::Classify;

    fn tx(key: &PrivateKeySigner, nonce: u64, to: Address) -> txflow_core::chain::SignedTx {
        signed_transfer(key, nonce, to, (2_000_000_000, 1_000_000_000))
    }

    fn client(c: &FakeChain) -> &dyn ChainClient {
        c
    }

    #[tokio::test]
    async fn sends_are_pooled_then_mined_with_receipts_and_blocks() {
        let chain = FakeChain::new();
        let c = client(&chain);
        let key = PrivateKeySigner::random();
        let me = key.address();
        let sink = Address::repeat_byte(0xde);
        let t0 = tx(&key, 0, sink);
        let t1 = tx(&key, 1, sink);
        let t3 = tx(&key, 3, sink);

        assert_eq!(c.send_raw(&t0.raw).await.unwrap(), SendOutcome::Accepted);
        assert!(matches!(
            c.send_raw(&t0.raw).await.unwrap(),
            SendOutcome::PossiblySent { .. }
        ));
        assert_eq!(c.send_raw(&t1.raw).await.unwrap(), SendOutcome::Accepted);
        assert_eq!(c.send_raw(&t3.raw).await.unwrap(), SendOutcome::Accepted);
        assert_eq!(
            c.pending_nonce(me).await.unwrap(),
            2,
            "3 waits behind a gap"
        );
        assert_eq!(c.latest_nonce(me).await.unwrap(), 0);
        assert!(c.knows_transaction(t1.hash).await.unwrap());
        assert_eq!(c.receipt(t0.hash).await.unwrap(), None);

        assert_eq!(chain.mine(), 1);
        assert_eq!(c.block_number().await.unwrap(), 1);
        assert_eq!(c.latest_nonce(me).await.unwrap(), 2);
        let r = c.receipt(t1.hash).await.unwrap().expect("mined");
        assert!(r.status);
        assert_eq!(r.block_number, 1);
        let b1 = c.block(1).await.unwrap().expect("block 1");
        let b0 = c.block(0).await.unwrap().expect("genesis");
        assert_eq!(r.block_hash, b1.hash);
        assert_eq!(b1.parent_hash, b0.hash);
        assert_eq!(c.block(2).await.unwrap(), None);
        assert_eq!(chain.pooled().len(), 1, "nonce 3 still waits");
        assert!(!chain.is_mined(t3.hash));

        // Mined: the same bytes, or another transaction at a used nonce, are too low; only
        // `knows_transaction` tells them apart.
        assert!(matches!(
            c.send_raw(&t0.raw).await.unwrap(),
            SendOutcome::NonceTooLow { .. }
        ));
        assert!(c.knows_transaction(t0.hash).await.unwrap());
        let other0 = tx(&key, 0, Address::repeat_byte(1));
        assert!(matches!(
            c.send_raw(&other0.raw).await.unwrap(),
            SendOutcome::NonceTooLow { .. }
        ));
        assert!(!c.knows_transaction(other0.hash).await.unwrap());
        // Same nonce as a pooled one, different transaction: underpriced replacement.
        let other3 = tx(&key, 3, Address::repeat_byte(1));
        assert!(matches!(
            c.send_raw(&other3.raw).await.unwrap(),
            SendOutcome::Rejected {
                retryable: true,
                ..
            }
        ));
        assert!(matches!(
            c.send_raw(b"garbage").await.unwrap(),
            SendOutcome::Rejected {
                retryable: false,
                ..
            }
        ));
        assert_eq!(chain.sent().len(), 8);
        assert_eq!(chain.calls("send_raw"), 8);
        assert_eq!(chain.calls("receipt"), 2);
    }

    #[tokio::test]
    async fn the_history_of_nonces_and_blocks_is_true() {
        let chain = FakeChain::new();
        let c = client(&chain);
        let key = PrivateKeySigner::random();
        let me = key.address();
        let sink = Address::repeat_byte(0xde);
        let t0 = tx(&key, 0, sink);
        let t1 = tx(&key, 1, sink);
        c.send_raw(&t0.raw).await.unwrap();
        c.send_raw(&t1.raw).await.unwrap();
        assert_eq!(chain.mine(), 1);
        assert_eq!(chain.mine(), 2, "an empty block");

        assert_eq!(c.nonce_at(me, 0).await.unwrap(), 0);
        assert_eq!(c.nonce_at(me, 1).await.unwrap(), 2);
        assert_eq!(c.nonce_at(me, 2).await.unwrap(), 2);
        assert_eq!(
            c.nonce_at(Address::repeat_byte(1), 2).await.unwrap(),
            0,
            "no transaction, nonce 0"
        );
        let e = c.nonce_at(me, 3).await.expect_err("past the head");
        assert!(!e.is_transient(), "a node's answer: {e}");
        assert_eq!(
            c.block_transaction_hashes(1).await.unwrap(),
            Some(vec![t0.hash, t1.hash])
        );
        assert_eq!(c.block_transaction_hashes(0).await.unwrap(), Some(vec![]));
        assert_eq!(c.block_transaction_hashes(2).await.unwrap(), Some(vec![]));
        assert_eq!(c.block_transaction_hashes(3).await.unwrap(), None);

        // Nonces 2 and 3 used outside txflow: a block of their own, which holds none of ours.
        let t2 = tx(&key, 2, sink);
        c.send_raw(&t2.raw).await.unwrap();
        chain.use_nonce_elsewhere(me, 3);
        assert!(chain.pooled().is_empty(), "the pooled nonce 2 is dropped");
        assert_eq!(c.block_number().await.unwrap(), 3);
        assert_eq!(c.latest_nonce(me).await.unwrap(), 4);
        assert_eq!(c.nonce_at(me, 2).await.unwrap(), 2);
        assert_eq!(c.nonce_at(me, 3).await.unwrap(), 4);
        let outsiders = c
            .block_transaction_hashes(3)
            .await
            .unwrap()
            .expect("block 3");
        assert_eq!(outsiders.len(), 2);
        assert!(!outsiders.contains(&t2.hash));
        for h in &outsiders {
            assert!(c.knows_transaction(*h).await.unwrap());
            assert_eq!(c.receipt(*h).await.unwrap().expect("mined").block_number, 3);
        }
        // An already used nonce: nothing happens.
        chain.use_nonce_elsewhere(me, 1);
        assert_eq!(c.block_number().await.unwrap(), 3);
        assert_eq!(chain.calls("nonce_at"), 7);
        assert_eq!(chain.calls("block_transaction_hashes"), 5);
    }

    #[tokio::test]
    async fn answers_are_scripted_and_failures_injected() {
        let chain = FakeChain::new();
        let c = client(&chain);
        let key = PrivateKeySigner::random();
        let to = Address::repeat_byte(7);

        chain.script_send(SendOutcome::InsufficientFunds {
            reason: "insufficient funds".into(),
        });
        let t0 = tx(&key, 0, to);
        assert!(matches!(
            c.send_raw(&t0.raw).await.unwrap(),
            SendOutcome::InsufficientFunds { .. }
        ));
        assert!(chain.pooled().is_empty(), "a scripted answer takes nothing");
        assert_eq!(c.send_raw(&t0.raw).await.unwrap(), SendOutcome::Accepted);

        assert_eq!(
            c.simulate(key.address(), to, U256::ZERO, Bytes::new())
                .await
                .unwrap(),
            Simulation::Ok { gas: 21_000 }
        );
        chain.set_simulation(
            to,
            Simulation::Reverts {
                reason: "nope".into(),
            },
        );
        assert!(matches!(
            c.simulate(key.address(), to, U256::ZERO, Bytes::new())
                .await
                .unwrap(),
            Simulation::Reverts { .. }
        ));

        chain.set_fees(10, 3);
        assert_eq!(c.fees().await.unwrap(), (10, 3));

        chain.fail_next("fees", 2);
        for _ in 0..2 {
            let e = c.fees().await.expect_err("scripted failure");
            assert!(e.is_transient(), "{e}");
        }
        assert_eq!(c.fees().await.unwrap(), (10, 3));
        assert_eq!(chain.calls("fees"), 4);

        // Used outside txflow: the pooled transaction at that nonce is gone, the nonce passed.
        chain.use_nonce_elsewhere(key.address(), 0);
        assert!(chain.pooled().is_empty());
        assert_eq!(c.latest_nonce(key.address()).await.unwrap(), 1);

        chain.revert_calls_to(to);
        let t1 = tx(&key, 1, to);
        assert_eq!(c.send_raw(&t1.raw).await.unwrap(), SendOutcome::Accepted);
        chain.mine();
        assert!(!c.receipt(t1.hash).await.unwrap().expect("mined").status);
    }
}
