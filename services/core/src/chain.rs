//! Chain access over JSON-RPC (alloy), with the node's answers classified (ARCHITECTURE §6).

use alloy::consensus::{SignableTransaction, TxEip1559, TxEnvelope};
use alloy::eips::eip2718::Encodable2718;
use alloy::network::TxSignerSync;
use alloy::primitives::{Address, B256, Bytes, TxKind, U256};
use alloy::providers::{DynProvider, Provider, ProviderBuilder};
use alloy::rpc::types::TransactionRequest;
use alloy::signers::local::PrivateKeySigner;
use alloy::transports::RpcError;
use alloy::transports::TransportErrorKind;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::retry::{Classify, Retry};

/// A failed RPC call, classified.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// Timeouts, connection failures, 5xx, 429: try again later.
    #[error("{method}: the node is unavailable")]
    Unavailable {
        method: &'static str,
        #[source]
        source: RpcError<TransportErrorKind>,
    },
    /// The node answered with a JSON-RPC error.
    #[error("{method}: node error {code}: {message}")]
    Rpc {
        method: &'static str,
        code: i64,
        message: String,
        data: Option<String>,
    },
    /// The node answered a simulation with an error that no row of [`SIM_ERRORS`] knows (an
    /// internal error, a server error of unknown wording): it says nothing about the call, so
    /// it is retried like a node that did not answer, never taken for a refusal.
    #[error("{method}: node error {code} of unknown meaning: {message}")]
    Unknown {
        method: &'static str,
        code: i64,
        message: String,
    },
    #[error("{0}")]
    InvalidUrl(String),
    /// The node answered something no chain says (a fee past [`MAX_FEE_PER_GAS`], a value that
    /// overflows): not believed; another endpoint, or this one later, may answer sanely.
    #[error("{method}: implausible answer: {what}")]
    Implausible { method: &'static str, what: String },
}

impl Classify for ChainError {
    fn retry(&self) -> Retry {
        match self {
            ChainError::Unavailable { .. }
            | ChainError::Implausible { .. }
            | ChainError::Unknown { .. } => Retry::Transient,
            ChainError::Rpc { code, .. } if rate_limited(*code) => Retry::Transient,
            ChainError::Rpc { .. } | ChainError::InvalidUrl(_) => Retry::Permanent,
        }
    }
}

fn classify(method: &'static str, e: RpcError<TransportErrorKind>) -> ChainError {
    match e {
        RpcError::ErrorResp(p) => ChainError::Rpc {
            method,
            code: p.code,
            message: p.message.to_string(),
            data: p.data.map(|d| d.get().to_string()),
        },
        other => ChainError::Unavailable {
            method,
            source: other,
        },
    }
}

/// The result of a simulation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Simulation {
    /// It would succeed with about this much gas.
    Ok { gas: u64 },
    /// It would revert; the node's reason.
    Reverts { reason: String },
    /// The signer cannot pay for it now: hold, do not fail (funds may arrive).
    InsufficientFunds { reason: String },
}

/// What the node said to `eth_sendRawTransaction`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    Accepted,
    /// The node already has it (already known / imported).
    PossiblySent {
        reason: String,
    },
    /// The nonce is used: by this transaction (possibly sent) if the chain knows one of its
    /// hashes, otherwise by a transaction sent outside txflow (replaced).
    NonceTooLow {
        reason: String,
    },
    /// The signer cannot pay the transaction's maximum cost: hold the signer, do not fail.
    InsufficientFunds {
        reason: String,
    },
    /// The node did not take it: for now (`retryable`: its fees, its load) or for good (the
    /// transaction as signed can never be accepted).
    Rejected {
        retryable: bool,
        reason: String,
    },
    /// An error no row of [`SEND_ERRORS`] knows: the node may have taken the transaction. Never
    /// a refusal: the transaction keeps its state and its nonce and is sent again later (the same
    /// bytes, which the node then answers with "already known" or "nonce too low").
    Unknown {
        reason: String,
    },
}

/// The `tx.submit` result of a send (`metrics::submit_result`): accepted, known (already
/// known/imported), nonce_too_low, underpriced (refused for now: fees, the node's load), funds,
/// or error (refused for good, an unknown answer, no answer).
pub fn submit_result(result: &Result<SendOutcome, ChainError>) -> &'static str {
    use crate::metrics::submit_result as r;
    match result {
        Ok(SendOutcome::Accepted) => r::ACCEPTED,
        Ok(SendOutcome::PossiblySent { .. }) => r::KNOWN,
        Ok(SendOutcome::NonceTooLow { .. }) => r::NONCE_TOO_LOW,
        Ok(SendOutcome::InsufficientFunds { .. }) => r::FUNDS,
        Ok(SendOutcome::Rejected {
            retryable: true, ..
        }) => r::UNDERPRICED,
        Ok(SendOutcome::Rejected {
            retryable: false, ..
        })
        | Ok(SendOutcome::Unknown { .. })
        | Err(_) => r::ERROR,
    }
}

/// What a known `eth_sendRawTransaction` error wording means (a row of [`SEND_ERRORS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendClass {
    /// The node has this very transaction already: [`SendOutcome::PossiblySent`].
    PossiblySent,
    /// [`SendOutcome::NonceTooLow`].
    NonceTooLow,
    /// [`SendOutcome::InsufficientFunds`].
    InsufficientFunds,
    /// Not taken now, may be later (fees, the node's load or state): `Rejected { retryable: true }`.
    Retryable,
    /// Not taken and never will be as signed: `Rejected { retryable: false }`.
    Refused,
}

/// The known error wordings of `eth_sendRawTransaction`: (lowercase substring, class, source).
/// The first row whose substring the lowercased message contains decides; a message no row
/// knows is [`SendOutcome::Unknown`]. Clients give the same codes (-32000, -32003, -32602) to
/// very different answers, so the text is the signal. Sources, as read for this table:
/// - geth (ethereum/go-ethereum): `core/txpool/errors.go`, `core/txpool/legacypool/legacypool.go`,
///   `core/error.go`, `core/types/transaction.go`, `core/types/transaction_signing.go`;
/// - Erigon (erigontech/erigon): `txnprovider/txpool/txpoolcfg/txpoolcfg.go`
///   (`DiscardReason::String`; the RPC answer is `"<IMPORT_RESULT>: <reason>"`);
/// - Nethermind (NethermindEth/nethermind): `src/Nethermind/Nethermind.TxPool/AcceptTxResult.cs`
///   and the phrases it uses, `Nethermind.TxPool/TxPoolErrorMessages.cs`,
///   `Nethermind.Core/Messages/TxErrorMessages.cs`;
/// - Besu (hyperledger/besu): `ethereum/core/.../transaction/TransactionInvalidReason.java` and the
///   JSON-RPC messages it is answered with, `ethereum/api/.../response/RpcErrorType.java`;
/// - anvil (foundry-rs/foundry): `crates/anvil/src/eth/error.rs` (`PoolError`,
///   `InvalidTransactionError`, `BlockchainError` and their JSON-RPC messages).
pub const SEND_ERRORS: [(&str, SendClass, &str); 45] = [
    // The node's trouble, not the transaction's: it may or may not have taken it, so only ever
    // "try again" (checked first, as before this table). Generic wordings of rate limiters and
    // proxies; Nethermind `TxPoolErrorMessages.NodeIsSyncing`; geth legacypool
    // `ErrTxPoolOverflow`; Erigon `PendingPoolOverflow` / `BaseFeePoolOverflow` /
    // `QueuedPoolOverflow`.
    (
        "rate limit",
        SendClass::Retryable,
        "rate limiters (generic)",
    ),
    (
        "too many requests",
        SendClass::Retryable,
        "HTTP 429 wording (generic)",
    ),
    (
        "timeout",
        SendClass::Retryable,
        "proxies, Besu TIMEOUT_ERROR",
    ),
    ("timed out", SendClass::Retryable, "proxies (generic)"),
    (
        "node is syncing",
        SendClass::Retryable,
        "Nethermind TxPoolErrorMessages",
    ),
    (
        "txpool is full",
        SendClass::Retryable,
        "geth legacypool ErrTxPoolOverflow",
    ),
    (
        "sub-pool is full",
        SendClass::Retryable,
        "Erigon DiscardReason *PoolOverflow",
    ),
    // Not accepted as signed, and never will be: a refusal (FAILED, the nonce released). Before
    // the "known transaction" row: anvil's "Unknown transaction type not supported" contains it.
    (
        "transaction type not supported",
        SendClass::Refused,
        "geth types.ErrTxTypeNotSupported, anvil UnknownTransactionType",
    ),
    (
        "unsupported transaction type",
        SendClass::Refused,
        "Nethermind TxPoolErrorMessages.UnsupportedTransactionType",
    ),
    (
        "invalid transaction type",
        SendClass::Refused,
        "Besu RpcErrorType.INVALID_TRANSACTION_TYPE",
    ),
    (
        "transaction type is not activated",
        SendClass::Refused,
        "Erigon DiscardReason TypeNotActivated",
    ),
    (
        "invalid sender",
        SendClass::Refused,
        "geth txpool.ErrInvalidSender, Erigon DiscardReason InvalidSender",
    ),
    (
        "invalid signature",
        SendClass::Refused,
        "Besu RpcErrorType.INVALID_TRANSACTION_SIGNATURE",
    ),
    (
        "signature is invalid",
        SendClass::Refused,
        "Nethermind TxErrorMessages.InvalidTxSignature",
    ),
    (
        "failed to recover sender",
        SendClass::Refused,
        "Nethermind TxPoolErrorMessages.FailedToRecoverSender",
    ),
    (
        "invalid chain id",
        SendClass::Refused,
        "geth types.ErrInvalidChainId, anvil InvalidChainId",
    ),
    (
        "invalidtxchainid",
        SendClass::Refused,
        "Nethermind TxErrorMessages.InvalidTxChainId",
    ),
    (
        "wrong chainid",
        SendClass::Refused,
        "Besu RpcErrorType.WRONG_CHAIN_ID",
    ),
    (
        "signed for another chain",
        SendClass::Refused,
        "anvil IncompatibleEIP155",
    ),
    (
        "intrinsic gas too low",
        SendClass::Refused,
        "geth core.ErrIntrinsicGas, anvil GasTooLow, Nethermind TxErrorMessages.IntrinsicGasTooLow",
    ),
    (
        "intrinsicgas",
        SendClass::Refused,
        "Erigon DiscardReason IntrinsicGas",
    ),
    (
        "intrinsic gas exceeds gas limit",
        SendClass::Refused,
        "Besu RpcErrorType.INTRINSIC_GAS_EXCEEDS_LIMIT",
    ),
    (
        "intrinsic gas too high",
        SendClass::Refused,
        "anvil GasTooHigh",
    ),
    (
        "exceeds block gas limit",
        SendClass::Refused,
        "geth txpool.ErrGasLimit, Besu RpcErrorType.EXCEEDS_BLOCK_GAS_LIMIT",
    ),
    (
        "greater than the block gas limit",
        SendClass::Refused,
        "anvil TxGasLimitGreaterThanCap",
    ),
    (
        "oversized data",
        SendClass::Refused,
        "geth txpool.ErrOversizedData, Erigon DiscardReason OversizedData",
    ),
    (
        "transaction too large",
        SendClass::Refused,
        "Nethermind TxPoolErrorMessages.TransactionTooLarge",
    ),
    (
        "rlptoolong",
        SendClass::Refused,
        "Erigon DiscardReason RLPTooLong",
    ),
    (
        "negative value",
        SendClass::Refused,
        "geth txpool.ErrNegativeValue, Erigon DiscardReason NegativeValue",
    ),
    (
        "max priority fee per gas higher than max fee per gas",
        SendClass::Refused,
        "geth core.ErrTipAboveFeeCap, anvil TipAboveFeeCap",
    ),
    (
        "max priority fee per gas exceeds max fee per gas",
        SendClass::Refused,
        "Besu RpcErrorType.MAX_PRIORITY_FEE_PER_GAS_EXCEEDS_MAX_FEE_PER_GAS",
    ),
    (
        "invalidmaxpriorityfeepergas",
        SendClass::Refused,
        "Nethermind TxErrorMessages.InvalidMaxPriorityFeePerGas",
    ),
    (
        "failed to decode",
        SendClass::Refused,
        "anvil FailedToDecodeTransaction (invalid params)",
    ),
    // The node has this very transaction (pooled or imported): possibly sent.
    (
        "already known",
        SendClass::PossiblySent,
        "geth txpool.ErrAlreadyKnown, Nethermind TxPoolErrorMessages.AlreadyKnown, Erigon DiscardReason AlreadyKnown",
    ),
    (
        "already imported",
        SendClass::PossiblySent,
        "anvil PoolError::AlreadyImported (\"transaction already imported\")",
    ),
    (
        "known transaction",
        SendClass::PossiblySent,
        "Besu RpcErrorType.ETH_SEND_TX_ALREADY_KNOWN",
    ),
    (
        "with same hash",
        SendClass::PossiblySent,
        "Erigon DiscardReason DuplicateHash (\"existing txn with same hash\")",
    ),
    // The nonce is used (by this transaction or another): the chain decides.
    (
        "nonce too low",
        SendClass::NonceTooLow,
        "geth core.ErrNonceTooLow, anvil NonceTooLow, Nethermind TxPoolErrorMessages.NonceTooLow, Erigon DiscardReason NonceTooLow, Besu RpcErrorType.NONCE_TOO_LOW",
    ),
    // The signer cannot pay: hold.
    (
        "insufficient funds",
        SendClass::InsufficientFunds,
        "geth core.ErrInsufficientFunds, anvil InsufficientFunds, Erigon DiscardReason InsufficientFunds, Nethermind AcceptTxResult.InsufficientFunds",
    ),
    (
        "upfront cost exceeds account balance",
        SendClass::InsufficientFunds,
        "Besu RpcErrorType.TRANSACTION_UPFRONT_COST_EXCEEDS_BALANCE",
    ),
    // Its fees are too low for now (the base fee, the pool's minimum, a pooled transaction at
    // its nonce): try again.
    (
        "underpriced",
        SendClass::Retryable,
        "geth txpool.ErrUnderpriced / ErrReplaceUnderpriced, Nethermind, Erigon, anvil ReplacementUnderpriced, Besu ETH_SEND_TX_REPLACEMENT_UNDERPRICED",
    ),
    (
        "fee too low",
        SendClass::Retryable,
        "Erigon DiscardReason FeeTooLow",
    ),
    (
        "max fee per gas less than block base fee",
        SendClass::Retryable,
        "geth core.ErrFeeCapTooLow, anvil FeeCapTooLow",
    ),
    (
        "gas price below",
        SendClass::Retryable,
        "Besu RpcErrorType.GAS_PRICE_TOO_LOW / GAS_PRICE_BELOW_CURRENT_BASE_FEE",
    ),
    (
        "could not replace existing tx",
        SendClass::Retryable,
        "Erigon DiscardReason NotReplaced",
    ),
];

/// The call `from` → `to` (`value`, `data`) that `eth_estimateGas` and `eth_call` are asked.
fn call_request(from: Address, to: Address, value: U256, data: Bytes) -> TransactionRequest {
    TransactionRequest::default()
        .from(from)
        .to(to)
        .value(value)
        .input(data.into())
}

/// What a JSON-RPC error of `eth_estimateGas` says about the simulated call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimErrorClass {
    /// The call reverts: the request fails at simulation (`SIMULATION_REVERTED`).
    Reverts,
    /// The signer cannot pay for it now: held, never failed.
    InsufficientFunds,
    /// Anything else says nothing about the call: retried like a node that did not answer.
    Unknown,
}

/// Codes of `eth_estimateGas` errors that decide alone, whatever the message: (code, class,
/// source).
pub const SIM_ERROR_CODES: &[(i64, SimErrorClass, &str)] = &[
    (
        3,
        SimErrorClass::Reverts,
        "EIP-1474 execution error (geth, anvil, erigon: a revert with its data)",
    ),
    (
        -32603,
        SimErrorClass::Unknown,
        "JSON-RPC internal error: about the node, not the call",
    ),
    (
        -32005,
        SimErrorClass::Unknown,
        "EIP-1474 limit exceeded (rate limit)",
    ),
    (429, SimErrorClass::Unknown, "HTTP-style too many requests"),
];

/// Wordings of `eth_estimateGas` errors for the codes that do not decide alone (-32000 and the
/// others): the first row whose lowercase substring the message contains decides; a message no
/// row knows is [`SimErrorClass::Unknown`]. (substring, class, source).
pub const SIM_ERRORS: &[(&str, SimErrorClass, &str)] = &[
    (
        "execution reverted",
        SimErrorClass::Reverts,
        "geth -32000 (a revert without data), anvil, besu, erigon",
    ),
    (
        "vm exception while processing transaction: revert",
        SimErrorClass::Reverts,
        "ganache, hardhat",
    ),
    (
        "transaction reverted",
        SimErrorClass::Reverts,
        "hardhat (without a reason string)",
    ),
    (
        "insufficient funds",
        SimErrorClass::InsufficientFunds,
        "geth -32000, anvil -32003 (for gas * price + value)",
    ),
];

/// Classifies a JSON-RPC error of `eth_estimateGas`: by code first ([`SIM_ERROR_CODES`]), by
/// message second ([`SIM_ERRORS`], ignoring case); anything else is unknown. Only a classified
/// revert fails a request at simulation.
pub fn classify_simulation_error(code: i64, message: &str) -> SimErrorClass {
    if let Some((_, class, _)) = SIM_ERROR_CODES.iter().find(|(c, _, _)| *c == code) {
        return *class;
    }
    let m = message.to_lowercase();
    SIM_ERRORS
        .iter()
        .find(|(s, _, _)| m.contains(s))
        .map_or(SimErrorClass::Unknown, |(_, class, _)| *class)
}

/// Classifies a JSON-RPC error of `eth_sendRawTransaction`: a rate-limit or internal-error code
/// is "try again"; otherwise the first row of [`SEND_ERRORS`] the message contains (ignoring
/// case) decides; a message no row knows is [`SendOutcome::Unknown`], never a refusal.
pub fn classify_send_error(code: i64, message: &str) -> SendOutcome {
    let m = message.to_lowercase();
    let reason = format!("{code}: {message}");
    if rate_limited(code) || code == -32603 {
        // About the node, not the transaction: it may or may not have taken it.
        return SendOutcome::Rejected {
            retryable: true,
            reason,
        };
    }
    match SEND_ERRORS.iter().find(|(s, _, _)| m.contains(s)) {
        Some((_, SendClass::PossiblySent, _)) => SendOutcome::PossiblySent { reason },
        Some((_, SendClass::NonceTooLow, _)) => SendOutcome::NonceTooLow { reason },
        Some((_, SendClass::InsufficientFunds, _)) => SendOutcome::InsufficientFunds { reason },
        Some((_, SendClass::Retryable, _)) => SendOutcome::Rejected {
            retryable: true,
            reason,
        },
        Some((_, SendClass::Refused, _)) => SendOutcome::Rejected {
            retryable: false,
            reason,
        },
        None => SendOutcome::Unknown { reason },
    }
}

/// A mined transaction's receipt: what the receipt checker needs of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub tx_hash: B256,
    pub block_number: u64,
    pub block_hash: B256,
    /// `true` if it succeeded, `false` if it reverted.
    pub status: bool,
    pub gas_used: u64,
    pub effective_gas_price: u128,
}

/// A block's identity and its link to its parent: what reorg detection needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub number: u64,
    pub hash: B256,
    pub parent_hash: B256,
}

/// The future of a [`ChainClient`] call.
pub type ChainFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ChainError>> + Send + 'a>>;

/// What the stages ask of a chain. [`Chain`] (JSON-RPC) implements it; the tests' middle tier
/// implements it with a scripted in-memory chain (`txflow_tests::fake_chain`). Object-safe, so a
/// stage holds an `Arc<dyn ChainClient>`.
pub trait ChainClient: Send + Sync + std::fmt::Debug {
    /// The next nonce the chain expects, counting contiguous pending transactions.
    fn pending_nonce(&self, address: Address) -> ChainFuture<'_, u64>;
    /// The number of transactions the signer has mined.
    fn latest_nonce(&self, address: Address) -> ChainFuture<'_, u64>;
    /// Whether the node knows a transaction by this hash (pooled or mined).
    fn knows_transaction(&self, hash: B256) -> ChainFuture<'_, bool>;
    /// Simulates a call: would it succeed, revert, or can the signer not pay?
    fn simulate(
        &self,
        from: Address,
        to: Address,
        value: U256,
        data: Bytes,
    ) -> ChainFuture<'_, Simulation>;
    /// EIP-1559 fees: (max fee, max priority fee).
    fn fees(&self) -> ChainFuture<'_, (u128, u128)>;
    /// Sends a signed transaction (EIP-2718 bytes) and classifies the answer.
    fn send_raw<'a>(&'a self, raw: &'a [u8]) -> ChainFuture<'a, SendOutcome>;
    /// The receipt of a mined transaction; `None` while it is not mined.
    fn receipt(&self, hash: B256) -> ChainFuture<'_, Option<Receipt>>;
    /// The header of the canonical block at `number`; `None` past the head.
    fn block(&self, number: u64) -> ChainFuture<'_, Option<BlockHeader>>;
    /// The number of the latest block.
    fn block_number(&self) -> ChainFuture<'_, u64>;
    /// The number of transactions `address` had sent as of (after) block `block`: its nonce
    /// then. An error where the node no longer keeps that block's state.
    fn nonce_at(&self, address: Address, block: u64) -> ChainFuture<'_, u64>;
    /// The hashes of the transactions of the canonical block at `number`, in block order;
    /// `None` past the head.
    fn block_transaction_hashes(&self, number: u64) -> ChainFuture<'_, Option<Vec<B256>>>;
    /// The account's balance at the latest block, in wei.
    fn balance(&self, address: Address) -> ChainFuture<'_, U256>;
    /// The revert data of the call `from` → `to` (`value`, `data`) run at block `block`
    /// (`eth_call`): `Some` when it reverts there, `None` when it succeeds.
    fn revert_data(
        &self,
        from: Address,
        to: Address,
        value: U256,
        data: Bytes,
        block: u64,
    ) -> ChainFuture<'_, Option<Bytes>>;
}

/// Log targets of libraries that record an endpoint's full URL (with any API key in its path or
/// query) and the level they must be held at: the binary adds these after `TXFLOW_LOG`.
pub const URL_LOGGING_TARGETS: [&str; 1] = ["alloy_transport_http=info"];

/// Timeouts and retries of RPC calls (`TXFLOW_RPC_TIMEOUT_MS`, `TXFLOW_RPC_ATTEMPTS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RpcSettings {
    /// A call without an answer after this long has failed (and is tried again).
    pub timeout: Duration,
    /// Rounds over the endpoints before a call fails; backoff doubles between rounds.
    pub attempts: u32,
    /// The pause before the second round.
    pub backoff: Duration,
}

impl Default for RpcSettings {
    fn default() -> Self {
        RpcSettings {
            timeout: Duration::from_secs(10),
            attempts: 4,
            backoff: Duration::from_millis(200),
        }
    }
}

/// How long an endpoint that failed is passed over: doubling per consecutive failure, 1 s to 30 s.
fn down_for(failures: u32) -> Duration {
    Duration::from_millis(1000u64.saturating_mul(1 << failures.saturating_sub(1).min(5)))
        .min(Duration::from_secs(30))
}

/// What was seen of one endpoint lately.
#[derive(Debug, Default)]
struct Health {
    failures: u32,
    down_until: Option<Instant>,
}

/// One JSON-RPC endpoint of the chain.
/// `Debug` by hand: the name only (the provider and `secrets` hold the full URL).
struct Endpoint {
    /// `scheme://host:port` only: a URL's path or query may hold an API key, never logged.
    name: String,
    /// The forms of the full URL (as configured, as parsed, its path and query) that an error
    /// text may quote: replaced by `name` before an error is logged or returned.
    secrets: Vec<String>,
    provider: DynProvider,
    health: Mutex<Health>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// `text` without the endpoint's full URL (nor its path and query).
    fn scrub(&self, text: &str) -> String {
        let mut out = text.to_string();
        for secret in &self.secrets {
            out = out.replace(secret.as_str(), &self.name);
        }
        out
    }

    /// A failed call's error as it may be logged and returned: the node's own JSON-RPC answer as
    /// is; any other error (transport, HTTP, an unreadable answer — whose texts quote the URL)
    /// rewritten as a transport error with the URL scrubbed from its whole source chain. Every
    /// such error was and stays "retry" (`worth_retrying`), so nothing is classified differently.
    fn scrub_error(&self, err: RpcError<TransportErrorKind>) -> RpcError<TransportErrorKind> {
        match err {
            RpcError::ErrorResp(p) => RpcError::ErrorResp(p),
            other => {
                let mut text = other.to_string();
                let mut cur = std::error::Error::source(&other);
                while let Some(c) = cur {
                    text.push_str(": ");
                    text.push_str(&c.to_string());
                    cur = c.source();
                }
                TransportErrorKind::custom_str(&self.scrub(&text))
            }
        }
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether a failed call may succeed if made again (here or on another endpoint): no answer, an
/// HTTP error status (5xx, 429), an unreadable answer, or a JSON-RPC "rate limited" / "limit
/// exceeded" error. Any other JSON-RPC error is the node's answer.
fn worth_retrying(e: &RpcError<TransportErrorKind>) -> bool {
    match e {
        RpcError::ErrorResp(p) => rate_limited(p.code),
        _ => true,
    }
}

/// JSON-RPC codes of "too many requests" (HTTP-style 429, EIP-1474's -32005 "limit exceeded").
fn rate_limited(code: i64) -> bool {
    code == 429 || code == -32005
}

/// The JSON-RPC endpoints of one chain, used in the configured order: an endpoint that fails is
/// passed over (1 s, doubling to 30 s) while another answers; calls without an answer time out
/// and are retried, with backoff, over all endpoints.
#[derive(Clone, Debug)]
pub struct Chain {
    endpoints: Arc<Vec<Endpoint>>,
    settings: RpcSettings,
    pub chain_id: u64,
}

impl Chain {
    /// One endpoint, default settings.
    pub fn connect(url: &str, chain_id: u64) -> Result<Chain, ChainError> {
        Chain::connect_all(&[url.to_string()], chain_id, RpcSettings::default())
    }

    /// Several endpoints of the same chain, tried in this order.
    pub fn connect_all(
        urls: &[String],
        chain_id: u64,
        settings: RpcSettings,
    ) -> Result<Chain, ChainError> {
        if urls.is_empty() {
            return Err(ChainError::InvalidUrl("no RPC endpoint configured".into()));
        }
        let mut endpoints = Vec::with_capacity(urls.len());
        for url in urls {
            let parsed: reqwest::Url = url
                .parse()
                .map_err(|_| ChainError::InvalidUrl(redact(url)))?;
            let name = redact(url);
            let mut secrets = vec![url.clone(), parsed.as_str().to_string()];
            let tail = &parsed.as_str()[parsed.origin().ascii_serialization().len()..];
            if tail.len() > 1 {
                secrets.push(tail.to_string());
            }
            // The longest first, so that a part never spoils the replacement of the whole.
            secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
            secrets.dedup();
            let provider = ProviderBuilder::new()
                .disable_recommended_fillers()
                .connect_http(parsed)
                .erased();
            endpoints.push(Endpoint {
                name,
                secrets,
                provider,
                health: Mutex::new(Health::default()),
            });
        }
        Ok(Chain {
            endpoints: Arc::new(endpoints),
            settings: settings.normalized(),
            chain_id,
        })
    }

    /// The first endpoint's provider, for callers outside the pipeline (bench, tools).
    pub fn provider(&self) -> &DynProvider {
        &self.endpoints[0].provider
    }

    /// Endpoint indexes in the order to try them: those not passed over, in configured order,
    /// then the passed-over ones, the soonest back first. An endpoint whose pause has just ended
    /// is claimed by this call as its probe (others keep passing it over until the probe's
    /// timeout), so that a dead endpoint costs one call per pause, not one per concurrent call.
    fn order(&self) -> Vec<usize> {
        let now = Instant::now();
        let mut up = Vec::new();
        let mut down = Vec::new();
        for (i, e) in self.endpoints.iter().enumerate() {
            let mut h = e.health();
            match h.down_until {
                Some(t) if t > now => down.push((t, i)),
                Some(_) => {
                    // The probe's own timeout (configured; a timeout past what an `Instant`
                    // holds passes the endpoint over for the longest pause instead).
                    h.down_until = Some(
                        now.checked_add(self.settings.timeout)
                            .unwrap_or(now + Duration::from_secs(30)),
                    );
                    up.push(i);
                }
                None => up.push(i),
            }
        }
        down.sort();
        up.extend(down.into_iter().map(|(_, i)| i));
        up
    }

    /// Makes the call on the endpoints until one answers, with timeouts, failover and backoff.
    async fn call<T, F, Fut>(
        &self,
        method: &'static str,
        f: F,
    ) -> Result<T, RpcError<TransportErrorKind>>
    where
        F: Fn(DynProvider) -> Fut,
        Fut: Future<Output = Result<T, RpcError<TransportErrorKind>>>,
    {
        // A child span of the stage's span when traces are exported (never the endpoint's URL).
        let span = crate::otel::rpc_span(method);
        let mut last = None;
        for round in 0..self.settings.attempts {
            if round > 0 {
                let pause = self
                    .settings
                    .backoff
                    .saturating_mul(1 << (round - 1).min(5));
                tokio::time::sleep(pause.min(Duration::from_secs(5))).await;
            }
            for i in self.order() {
                let e = &self.endpoints[i];
                let started = Instant::now();
                let result = match tokio::time::timeout(
                    self.settings.timeout,
                    f(e.provider.clone()),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Err(TransportErrorKind::custom_str(&format!(
                        "no answer within {} ms",
                        self.settings.timeout.as_millis()
                    ))),
                };
                let result = result.map_err(|err| e.scrub_error(err));
                // `answered`: a result or the node's own JSON-RPC error (not a rate limit).
                let answered = !matches!(&result, Err(err) if worth_retrying(err));
                crate::metrics::get().rpc_call(method, i, answered, started.elapsed());
                match result {
                    Err(err) if worth_retrying(&err) => {
                        let mut h = e.health();
                        h.failures = h.failures.saturating_add(1);
                        let pause = down_for(h.failures);
                        h.down_until = Some(Instant::now() + pause);
                        tracing::warn!(endpoint = %e.name, method, failures = h.failures, error = %err, passed_over_ms = pause.as_millis() as u64, "RPC endpoint failed");
                        last = Some(err);
                    }
                    other => {
                        let mut h = e.health();
                        if h.failures > 0 {
                            tracing::info!(endpoint = %e.name, method, "RPC endpoint answers again");
                        }
                        *h = Health::default();
                        if let Err(err) = &other {
                            let class = match err {
                                RpcError::ErrorResp(_) => "jsonrpc_error",
                                _ => "transport",
                            };
                            crate::otel::rpc_failed(&span, class);
                        }
                        return other;
                    }
                }
            }
        }
        crate::otel::rpc_failed(&span, "unavailable");
        Err(last.unwrap_or_else(|| TransportErrorKind::custom_str("no RPC endpoint")))
    }

    /// The next nonce the chain expects, counting contiguous pending transactions.
    pub async fn pending_nonce(&self, address: Address) -> Result<u64, ChainError> {
        self.call("eth_getTransactionCount", |p| async move {
            p.get_transaction_count(address).pending().await
        })
        .await
        .map_err(|e| classify("eth_getTransactionCount", e))
    }

    /// The number of transactions the signer has mined (the `latest` nonce).
    pub async fn latest_nonce(&self, address: Address) -> Result<u64, ChainError> {
        self.call("eth_getTransactionCount", |p| async move {
            p.get_transaction_count(address).latest().await
        })
        .await
        .map_err(|e| classify("eth_getTransactionCount", e))
    }

    /// The revert data of the call `from` → `to` (`value`, `data`) run at block `block`
    /// (`eth_call`): `Some` when it reverts there (the node's revert data, empty when it gave
    /// none), `None` when it succeeds.
    pub async fn revert_data(
        &self,
        from: Address,
        to: Address,
        value: U256,
        data: Bytes,
        block: u64,
    ) -> Result<Option<Bytes>, ChainError> {
        let tx = call_request(from, to, value, data);
        let result = self
            .call("eth_call", |p| {
                let tx = tx.clone();
                async move { p.call(tx).block(alloy::eips::BlockId::number(block)).await }
            })
            .await;
        match result {
            Ok(_) => Ok(None),
            Err(RpcError::ErrorResp(p))
                if classify_simulation_error(p.code, &p.message) == SimErrorClass::Reverts =>
            {
                let data = p
                    .data
                    .as_ref()
                    .and_then(|d| serde_json::from_str::<String>(d.get()).ok())
                    .and_then(|h| alloy::hex::decode(h).ok())
                    .unwrap_or_default();
                Ok(Some(Bytes::from(data)))
            }
            Err(e) => Err(classify("eth_call", e)),
        }
    }

    /// The account's balance at the latest block, in wei.
    pub async fn balance(&self, address: Address) -> Result<U256, ChainError> {
        self.call(
            "eth_getBalance",
            |p| async move { p.get_balance(address).await },
        )
        .await
        .map_err(|e| classify("eth_getBalance", e))
    }

    /// Whether the node knows a transaction by this hash (pooled or mined).
    pub async fn knows_transaction(&self, hash: B256) -> Result<bool, ChainError> {
        self.call("eth_getTransactionByHash", |p| async move {
            p.get_transaction_by_hash(hash).await
        })
        .await
        .map(|t| t.is_some())
        .map_err(|e| classify("eth_getTransactionByHash", e))
    }

    /// Simulates the call with `eth_estimateGas`.
    pub async fn simulate(
        &self,
        from: Address,
        to: Address,
        value: U256,
        data: Bytes,
    ) -> Result<Simulation, ChainError> {
        let tx = call_request(from, to, value, data);
        let result = self
            .call("eth_estimateGas", |p| {
                let tx = tx.clone();
                async move { p.estimate_gas(tx).await }
            })
            .await;
        match result {
            Ok(gas) => Ok(Simulation::Ok { gas }),
            Err(RpcError::ErrorResp(p)) => match classify_simulation_error(p.code, &p.message) {
                SimErrorClass::Reverts => Ok(Simulation::Reverts {
                    reason: p.message.to_string(),
                }),
                SimErrorClass::InsufficientFunds => Ok(Simulation::InsufficientFunds {
                    reason: p.message.to_string(),
                }),
                SimErrorClass::Unknown => Err(ChainError::Unknown {
                    method: "eth_estimateGas",
                    code: p.code,
                    message: p.message.to_string(),
                }),
            },
            Err(e) => Err(classify("eth_estimateGas", e)),
        }
    }

    /// EIP-1559 fees from `eth_feeHistory` (alloy's default estimator, with checked arithmetic):
    /// (max fee, max priority fee). Fees past [`MAX_FEE_PER_GAS`] are an implausible answer.
    pub async fn fees(&self) -> Result<(u128, u128), ChainError> {
        use alloy::providers::utils::{
            EIP1559_FEE_ESTIMATION_PAST_BLOCKS, EIP1559_FEE_ESTIMATION_REWARD_PERCENTILE,
        };
        let history = self
            .call("eth_feeHistory", |p| async move {
                p.get_fee_history(
                    EIP1559_FEE_ESTIMATION_PAST_BLOCKS,
                    alloy::eips::BlockNumberOrTag::Latest,
                    &[EIP1559_FEE_ESTIMATION_REWARD_PERCENTILE],
                )
                .await
            })
            .await
            .map_err(|e| classify("eth_feeHistory", e))?;
        let base_fee = match history.latest_block_base_fee() {
            Some(fee) if fee != 0 => fee,
            // No base fee in the history: the latest block's own.
            _ => {
                let block = self
                    .call("eth_getBlockByNumber", |p| async move {
                        p.get_block_by_number(alloy::eips::BlockNumberOrTag::Latest)
                            .await
                    })
                    .await
                    .map_err(|e| classify("eth_getBlockByNumber", e))?;
                block
                    .and_then(|b| b.header.base_fee_per_gas)
                    .map(u128::from)
                    .ok_or(ChainError::Implausible {
                        method: "eth_getBlockByNumber",
                        what: "the latest block has no base fee".into(),
                    })?
            }
        };
        eip1559_fees(base_fee, &history.reward.unwrap_or_default()).ok_or_else(|| {
            ChainError::Implausible {
                method: "eth_feeHistory",
                what: format!("fees past {MAX_FEE_PER_GAS} wei per gas (base fee {base_fee})"),
            }
        })
    }

    /// Sends a signed transaction and classifies the answer. Sending the same bytes again is
    /// safe (the node answers "already known" or, once mined, "nonce too low"), so a send without
    /// an answer is retried like any other call.
    pub async fn send_raw(&self, raw: &[u8]) -> Result<SendOutcome, ChainError> {
        let result = self
            .call("eth_sendRawTransaction", |p| async move {
                p.send_raw_transaction(raw).await.map(|_| ())
            })
            .await;
        match result {
            Ok(()) => Ok(SendOutcome::Accepted),
            Err(RpcError::ErrorResp(p)) => Ok(classify_send_error(p.code, &p.message)),
            Err(e) => Err(classify("eth_sendRawTransaction", e)),
        }
    }

    /// The receipt of a mined transaction (`eth_getTransactionReceipt`); `None` while pending
    /// or unknown.
    pub async fn receipt(&self, hash: B256) -> Result<Option<Receipt>, ChainError> {
        let r = self
            .call("eth_getTransactionReceipt", |p| async move {
                p.get_transaction_receipt(hash).await
            })
            .await
            .map_err(|e| classify("eth_getTransactionReceipt", e))?;
        Ok(r.and_then(|r| {
            Some(Receipt {
                tx_hash: r.transaction_hash,
                block_number: r.block_number?,
                block_hash: r.block_hash?,
                status: r.status(),
                gas_used: r.gas_used,
                effective_gas_price: r.effective_gas_price,
            })
        }))
    }

    /// The header of the canonical block at `number` (`eth_getBlockByNumber`, without
    /// transactions); `None` past the head.
    pub async fn block(&self, number: u64) -> Result<Option<BlockHeader>, ChainError> {
        let b = self
            .call("eth_getBlockByNumber", |p| async move {
                p.get_block_by_number(number.into()).await
            })
            .await
            .map_err(|e| classify("eth_getBlockByNumber", e))?;
        Ok(b.map(|b| BlockHeader {
            number: b.header.number,
            hash: b.header.hash,
            parent_hash: b.header.parent_hash,
        }))
    }

    /// The number of the latest block (`eth_blockNumber`).
    pub async fn block_number(&self) -> Result<u64, ChainError> {
        self.call(
            "eth_blockNumber",
            |p| async move { p.get_block_number().await },
        )
        .await
        .map_err(|e| classify("eth_blockNumber", e))
    }

    /// The signer's nonce as of block `block` (`eth_getTransactionCount` at that block number):
    /// a node without that block's state answers an error.
    pub async fn nonce_at(&self, address: Address, block: u64) -> Result<u64, ChainError> {
        self.call("eth_getTransactionCount", |p| async move {
            p.get_transaction_count(address).number(block).await
        })
        .await
        .map_err(|e| classify("eth_getTransactionCount", e))
    }

    /// The transaction hashes of the canonical block at `number` (`eth_getBlockByNumber`, hashes
    /// only); `None` past the head.
    pub async fn block_transaction_hashes(
        &self,
        number: u64,
    ) -> Result<Option<Vec<B256>>, ChainError> {
        let b = self
            .call("eth_getBlockByNumber", |p| async move {
                p.get_block_by_number(number.into()).hashes().await
            })
            .await
            .map_err(|e| classify("eth_getBlockByNumber", e))?;
        Ok(b.map(|b| b.transactions.hashes().collect()))
    }
}

/// The highest fee per gas (max fee or tip) txflow takes from a node: 10^18 wei (one native
/// token) per gas, far past any chain's, and low enough that the gas limit (a `u64`) times it
/// stays within a `u128`. A node that answers more is not believed.
pub const MAX_FEE_PER_GAS: u128 = 1_000_000_000_000_000_000;

/// alloy's default EIP-1559 estimate (MetaMask's "medium": twice the base fee plus the median
/// of the first reward percentile, at least 1 wei), with checked arithmetic: `None` when a
/// value would overflow or pass [`MAX_FEE_PER_GAS`]. (max fee, max priority fee).
pub fn eip1559_fees(base_fee: u128, rewards: &[Vec<u128>]) -> Option<(u128, u128)> {
    use alloy::providers::utils::{EIP1559_BASE_FEE_MULTIPLIER, EIP1559_MIN_PRIORITY_FEE};
    let mut firsts: Vec<u128> = rewards
        .iter()
        .filter_map(|r| r.first().copied())
        .filter(|r| *r > 0)
        .collect();
    firsts.sort_unstable();
    let n = firsts.len();
    let median = match n {
        0 => EIP1559_MIN_PRIORITY_FEE,
        // The mean of the two middle values, without adding them (which may overflow).
        _ if n.is_multiple_of(2) => {
            let (a, b) = (firsts[n / 2 - 1], firsts[n / 2]);
            a / 2 + b / 2 + (a % 2 + b % 2) / 2
        }
        _ => firsts[n / 2],
    };
    let tip = median.max(EIP1559_MIN_PRIORITY_FEE);
    let max_fee = base_fee
        .checked_mul(EIP1559_BASE_FEE_MULTIPLIER)?
        .checked_add(tip)?;
    (max_fee <= MAX_FEE_PER_GAS && tip <= MAX_FEE_PER_GAS).then_some((max_fee, tip))
}

impl ChainClient for Chain {
    fn pending_nonce(&self, address: Address) -> ChainFuture<'_, u64> {
        Box::pin(Chain::pending_nonce(self, address))
    }
    fn latest_nonce(&self, address: Address) -> ChainFuture<'_, u64> {
        Box::pin(Chain::latest_nonce(self, address))
    }
    fn knows_transaction(&self, hash: B256) -> ChainFuture<'_, bool> {
        Box::pin(Chain::knows_transaction(self, hash))
    }
    fn simulate(
        &self,
        from: Address,
        to: Address,
        value: U256,
        data: Bytes,
    ) -> ChainFuture<'_, Simulation> {
        Box::pin(Chain::simulate(self, from, to, value, data))
    }
    fn fees(&self) -> ChainFuture<'_, (u128, u128)> {
        Box::pin(Chain::fees(self))
    }
    fn send_raw<'a>(&'a self, raw: &'a [u8]) -> ChainFuture<'a, SendOutcome> {
        Box::pin(Chain::send_raw(self, raw))
    }
    fn receipt(&self, hash: B256) -> ChainFuture<'_, Option<Receipt>> {
        Box::pin(Chain::receipt(self, hash))
    }
    fn block(&self, number: u64) -> ChainFuture<'_, Option<BlockHeader>> {
        Box::pin(Chain::block(self, number))
    }
    fn block_number(&self) -> ChainFuture<'_, u64> {
        Box::pin(Chain::block_number(self))
    }
    fn nonce_at(&self, address: Address, block: u64) -> ChainFuture<'_, u64> {
        Box::pin(Chain::nonce_at(self, address, block))
    }
    fn block_transaction_hashes(&self, number: u64) -> ChainFuture<'_, Option<Vec<B256>>> {
        Box::pin(Chain::block_transaction_hashes(self, number))
    }
    fn balance(&self, address: Address) -> ChainFuture<'_, U256> {
        Box::pin(Chain::balance(self, address))
    }
    fn revert_data(
        &self,
        from: Address,
        to: Address,
        value: U256,
        data: Bytes,
        block: u64,
    ) -> ChainFuture<'_, Option<Bytes>> {
        Box::pin(Chain::revert_data(self, from, to, value, data, block))
    }
}

impl RpcSettings {
    fn normalized(self) -> RpcSettings {
        RpcSettings {
            attempts: self.attempts.max(1),
            ..self
        }
    }
}

/// `scheme://host:port` of a URL: what may be logged of an endpoint.
pub fn redact(url: &str) -> String {
    match url.parse::<reqwest::Url>() {
        Ok(u) => format!(
            "{}://{}{}",
            u.scheme(),
            u.host_str().unwrap_or("?"),
            u.port().map(|p| format!(":{p}")).unwrap_or_default()
        ),
        Err(_) => "<invalid url>".into(),
    }
}

/// The block where `address`'s nonce passed `nonce` (the first block at which its nonce is past
/// ours), and that block's transaction hashes, as `chain` shows them: the search of
/// [`PassSearch`](crate::nonce_proof::PassSearch) run against the node (the head, then doubling
/// back, then bisecting; at most `MAX_PROBES` calls of `nonce_at`). `None` if the chain's answers
/// do not add up or the block is gone; a lookup that fails is an error (undecided, tried again
/// later). Shared by the broadcaster ("nonce too low") and the receipt checker (a stale nonce).
pub async fn passed_in(
    chain: &dyn ChainClient,
    address: Address,
    nonce: u64,
) -> Result<Option<crate::nonce_proof::PassedIn>, ChainError> {
    use crate::nonce_proof::{PassSearch, PassedIn, Search};
    let head = chain.block_number().await?;
    let mut search = PassSearch::new(nonce, head);
    loop {
        match search.next() {
            Search::Ask(block) => search.answer(chain.nonce_at(address, block).await?),
            Search::Found(block) => {
                let transactions = chain.block_transaction_hashes(block).await?;
                if transactions.is_none() {
                    tracing::warn!(%address, nonce, block, "the block where the nonce passed is not found");
                }
                return Ok(transactions.map(|transactions| PassedIn {
                    block,
                    transactions,
                    head,
                }));
            }
            Search::Failed(why) => {
                tracing::warn!(%address, nonce, head, why, "cannot find where the nonce passed");
                return Ok(None);
            }
        }
    }
}

/// An EIP-1559 transaction to sign.
#[derive(Debug, Clone)]
pub struct UnsignedTx {
    pub chain_id: u64,
    pub nonce: u64,
    pub to: Address,
    pub value: U256,
    pub data: Bytes,
    pub gas_limit: u64,
    pub max_fee_per_gas: u128,
    pub max_priority_fee_per_gas: u128,
}

/// A signed transaction: its hash and EIP-2718 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedTx {
    pub hash: B256,
    pub raw: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
#[error("signing failed")]
pub struct SignError(#[source] alloy::signers::Error);

impl Classify for SignError {
    fn retry(&self) -> Retry {
        Retry::Permanent
    }
}

/// Signs with a local key. The key never leaves the signer and is never printed: `Debug` of
/// `PrivateKeySigner` shows only the address.
pub fn sign(signer: &PrivateKeySigner, tx: &UnsignedTx) -> Result<SignedTx, SignError> {
    let mut t = TxEip1559 {
        chain_id: tx.chain_id,
        nonce: tx.nonce,
        gas_limit: tx.gas_limit,
        max_fee_per_gas: tx.max_fee_per_gas,
        max_priority_fee_per_gas: tx.max_priority_fee_per_gas,
        to: TxKind::Call(tx.to),
        value: tx.value,
        access_list: Default::default(),
        input: tx.data.clone(),
    };
    let sig = signer.sign_transaction_sync(&mut t).map_err(SignError)?;
    let envelope: TxEnvelope = t.into_signed(sig).into();
    Ok(SignedTx {
        hash: *envelope.tx_hash(),
        raw: envelope.encoded_2718(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_endpoint_is_passed_over_longer_each_time_up_to_30_s() {
        assert_eq!(down_for(1), Duration::from_secs(1));
        assert_eq!(down_for(2), Duration::from_secs(2));
        assert_eq!(down_for(5), Duration::from_secs(16));
        assert_eq!(down_for(6), Duration::from_secs(30));
        assert_eq!(down_for(60), Duration::from_secs(30));
    }

    #[test]
    fn endpoint_names_never_carry_paths_or_keys() {
        assert_eq!(
            redact("https://user:pw@mainnet.example.com/v3/SECRETKEY?x=1"),
            "https://mainnet.example.com"
        );
        assert_eq!(redact("http://127.0.0.1:8545"), "http://127.0.0.1:8545");
        assert_eq!(redact("not a url"), "<invalid url>");
    }

    #[test]
    fn errors_never_quote_an_endpoint_url_with_its_key() {
        let c = Chain::connect_all(
            &["https://rpc.example.com/v3/SECRETKEY?apikey=SECRET2".into()],
            1,
            RpcSettings::default(),
        )
        .expect("url");
        let e = &c.endpoints[0];
        let leaked = TransportErrorKind::custom_str(
            "error sending request for url (https://rpc.example.com/v3/SECRETKEY?apikey=SECRET2): /v3/SECRETKEY?apikey=SECRET2",
        );
        let text = e.scrub_error(leaked).to_string();
        assert!(!text.contains("SECRET"), "{text}");
        assert!(text.contains("https://rpc.example.com"), "{text}");
        let shown = format!("{c:?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        // The node's own answer is kept as it is (a revert reason, say).
        let answer = RpcError::<TransportErrorKind>::ErrorResp(
            serde_json::from_str(r#"{"code":3,"message":"execution reverted"}"#)
                .expect("an error payload"),
        );
        assert!(matches!(e.scrub_error(answer), RpcError::ErrorResp(p) if p.code == 3));
    }

    #[test]
    fn endpoints_that_failed_are_tried_last() {
        let c = Chain::connect_all(
            &["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
            1,
            RpcSettings::default(),
        )
        .expect("urls");
        assert_eq!(c.order(), vec![0, 1]);
        c.endpoints[0].health().down_until = Some(Instant::now() + Duration::from_secs(5));
        assert_eq!(c.order(), vec![1, 0]);
        // Its pause over, one call probes it; concurrent calls keep passing it over meanwhile.
        c.endpoints[0].health().down_until = Some(Instant::now() - Duration::from_millis(1));
        assert_eq!(c.order(), vec![0, 1]);
        assert_eq!(c.order(), vec![1, 0]);
        assert!(Chain::connect_all(&[], 1, RpcSettings::default()).is_err());
    }

    #[test]
    fn only_answers_that_may_change_are_retried() {
        assert!(worth_retrying(&TransportErrorKind::custom_str("timeout")));
        assert!(rate_limited(429));
        assert!(rate_limited(-32005));
        assert!(!rate_limited(3), "a revert is an answer");
        assert!(!rate_limited(-32000));
    }

    /// One real wording per row of [`SEND_ERRORS`], as the client sends it, and its outcome.
    const SEND_ERROR_EXAMPLES: [(i64, &str, SendClass); 45] = [
        (
            -32000,
            "rate limit reached, retry later",
            SendClass::Retryable,
        ),
        (-32000, "Too Many Requests", SendClass::Retryable),
        (-32000, "Timeout expired", SendClass::Retryable),
        (-32000, "request timed out", SendClass::Retryable),
        (-32000, "node is syncing", SendClass::Retryable),
        (-32000, "txpool is full", SendClass::Retryable),
        (-32000, "queued sub-pool is full", SendClass::Retryable),
        (-32602, "transaction type not supported", SendClass::Refused),
        (-32000, "unsupported transaction type", SendClass::Refused),
        (-32602, "Invalid transaction type", SendClass::Refused),
        (
            -32000,
            "INVALID: fork supporting this transaction type is not activated yet",
            SendClass::Refused,
        ),
        (-32000, "invalid sender", SendClass::Refused),
        (-32002, "Invalid signature", SendClass::Refused),
        (
            -32000,
            "InvalidTxSignature: Signature is invalid.",
            SendClass::Refused,
        ),
        (-32000, "failed to recover sender", SendClass::Refused),
        (-32003, "invalid chain id for signer", SendClass::Refused),
        (
            -32000,
            "InvalidTxChainId: Expected 1, got 5.",
            SendClass::Refused,
        ),
        (-32000, "Wrong chainId", SendClass::Refused),
        (
            -32003,
            "Incompatible EIP-155 transaction, signed for another chain",
            SendClass::Refused,
        ),
        (-32000, "intrinsic gas too low", SendClass::Refused),
        (-32000, "INVALID: IntrinsicGas", SendClass::Refused),
        (
            -32003,
            "Intrinsic gas exceeds gas limit",
            SendClass::Refused,
        ),
        (
            -32000,
            "intrinsic gas too high -- CallerGasLimitMoreThanBlock",
            SendClass::Refused,
        ),
        (-32000, "exceeds block gas limit", SendClass::Refused),
        (
            -32003,
            "Transaction gas limit is greater than the block gas limit, gas_limit: 40000000, cap: 30000000",
            SendClass::Refused,
        ),
        (-32000, "oversized data", SendClass::Refused),
        (-32000, "transaction too large", SendClass::Refused),
        (-32000, "INVALID: RLPTooLong", SendClass::Refused),
        (-32000, "negative value", SendClass::Refused),
        (
            -32003,
            "max priority fee per gas higher than max fee per gas",
            SendClass::Refused,
        ),
        (
            -32000,
            "Max priority fee per gas exceeds max fee per gas",
            SendClass::Refused,
        ),
        (
            -32000,
            "InvalidMaxPriorityFeePerGas: Cannot be higher than maxFeePerGas.",
            SendClass::Refused,
        ),
        (-32602, "Failed to decode transaction", SendClass::Refused),
        (-32000, "already known", SendClass::PossiblySent),
        (
            -32003,
            "transaction already imported",
            SendClass::PossiblySent,
        ),
        (-32000, "Known transaction", SendClass::PossiblySent),
        (
            -32000,
            "INTERNAL_ERROR: existing txn with same hash",
            SendClass::PossiblySent,
        ),
        (-32003, "nonce too low", SendClass::NonceTooLow),
        (
            -32003,
            "Insufficient funds for gas * price + value",
            SendClass::InsufficientFunds,
        ),
        (
            -32004,
            "Upfront cost exceeds account balance",
            SendClass::InsufficientFunds,
        ),
        (
            -32003,
            "replacement transaction underpriced",
            SendClass::Retryable,
        ),
        (-32000, "FEE_TOO_LOW: fee too low", SendClass::Retryable),
        (
            -32003,
            "max fee per gas less than block base fee",
            SendClass::Retryable,
        ),
        (
            -32009,
            "Gas price below current base fee",
            SendClass::Retryable,
        ),
        (
            -32000,
            "NOT_REPLACED: could not replace existing tx",
            SendClass::Retryable,
        ),
    ];

    fn class_of(outcome: &SendOutcome) -> Option<SendClass> {
        match outcome {
            SendOutcome::PossiblySent { .. } => Some(SendClass::PossiblySent),
            SendOutcome::NonceTooLow { .. } => Some(SendClass::NonceTooLow),
            SendOutcome::InsufficientFunds { .. } => Some(SendClass::InsufficientFunds),
            SendOutcome::Rejected {
                retryable: true, ..
            } => Some(SendClass::Retryable),
            SendOutcome::Rejected {
                retryable: false, ..
            } => Some(SendClass::Refused),
            SendOutcome::Accepted | SendOutcome::Unknown { .. } => None,
        }
    }

    #[test]
    fn each_row_of_the_send_error_table_classifies_its_wording() {
        for (i, ((code, message, want), (substring, class, source))) in SEND_ERROR_EXAMPLES
            .iter()
            .zip(SEND_ERRORS.iter())
            .enumerate()
        {
            assert_eq!(
                *substring,
                substring.to_lowercase(),
                "row {i}: substrings are lowercase"
            );
            assert!(!source.is_empty(), "row {i} names its source");
            assert!(
                message.to_lowercase().contains(substring),
                "row {i}: the example {message:?} is of the row {substring:?}"
            );
            // The example is decided by its own row (no earlier row takes it).
            let first = SEND_ERRORS
                .iter()
                .position(|(s, _, _)| message.to_lowercase().contains(s));
            assert_eq!(
                first,
                Some(i),
                "{message:?} is decided by row {i} ({substring:?})"
            );
            assert_eq!(class, want, "row {i} ({substring:?})");
            let outcome = classify_send_error(*code, message);
            assert_eq!(
                class_of(&outcome),
                Some(*want),
                "{code} {message}: {outcome:?}"
            );
            let reason = match &outcome {
                SendOutcome::PossiblySent { reason }
                | SendOutcome::NonceTooLow { reason }
                | SendOutcome::InsufficientFunds { reason }
                | SendOutcome::Rejected { reason, .. }
                | SendOutcome::Unknown { reason } => reason.clone(),
                SendOutcome::Accepted => String::new(),
            };
            assert_eq!(reason, format!("{code}: {message}"));
        }
        assert_eq!(SEND_ERROR_EXAMPLES.len(), SEND_ERRORS.len());
    }

    #[test]
    fn a_send_error_no_row_knows_is_unknown_never_a_refusal() {
        for (code, message) in [
            (-32000, "something went wrong"),
            (-32000, ""),
            (-32003, "transaction rejected"),
            (-32000, "INVALID: spammer"),
            (-32000, "sender not an eoa"),
            (-32010, "custom gateway error 7f3a"),
            (-32602, "invalid argument 0: json: cannot unmarshal"),
            (3, "execution reverted"),
        ] {
            assert_eq!(
                classify_send_error(code, message),
                SendOutcome::Unknown {
                    reason: format!("{code}: {message}")
                },
                "{code} {message:?}"
            );
        }
    }

    #[test]
    fn send_errors_are_classified_whatever_their_case() {
        for (message, want) in [
            ("ALREADY KNOWN", SendClass::PossiblySent),
            ("Already Known", SendClass::PossiblySent),
            ("NONCE TOO LOW", SendClass::NonceTooLow),
            (
                "Nonce Too Low: next nonce 4, tx nonce 3",
                SendClass::NonceTooLow,
            ),
            (
                "INSUFFICIENT FUNDS for gas * price + value",
                SendClass::InsufficientFunds,
            ),
            ("Replacement Transaction Underpriced", SendClass::Retryable),
            ("INVALID SENDER", SendClass::Refused),
            ("invalidtxchainid: expected 1, got 5.", SendClass::Refused),
        ] {
            assert_eq!(
                class_of(&classify_send_error(-32000, message)),
                Some(want),
                "{message}"
            );
        }
    }

    #[test]
    fn simulation_errors_are_classified_by_code_first_then_by_message() {
        use SimErrorClass::*;
        for (code, message, want) in [
            (3, "execution reverted", Reverts),
            (3, "execution reverted: not the owner", Reverts),
            // The code decides alone, whatever the message says.
            (3, "something else", Reverts),
            (-32603, "internal error", Unknown),
            (-32603, "execution reverted", Unknown),
            (
                -32603,
                "insufficient funds for gas * price + value",
                Unknown,
            ),
            (-32005, "limit exceeded", Unknown),
            (429, "too many requests", Unknown),
            // Then the message, for the codes that do not decide alone.
            (-32000, "execution reverted", Reverts),
            (-32000, "Execution Reverted: paused", Reverts),
            (
                -32000,
                "VM Exception while processing transaction: revert nope",
                Reverts,
            ),
            (
                -32000,
                "Transaction reverted without a reason string",
                Reverts,
            ),
            (
                -32000,
                "insufficient funds for gas * price + value",
                InsufficientFunds,
            ),
            (
                -32003,
                "Insufficient funds for gas * price + value",
                InsufficientFunds,
            ),
            // Unknown: retried, never a failure.
            (-32000, "something went wrong", Unknown),
            (-32000, "header not found", Unknown),
            (-32000, "gas required exceeds allowance (0)", Unknown),
            (-32000, "", Unknown),
            (-32015, "VM execution error.", Unknown),
            (-32601, "the method eth_estimateGas does not exist", Unknown),
        ] {
            assert_eq!(
                classify_simulation_error(code, message),
                want,
                "{code} {message:?}"
            );
        }
        for (substring, _, source) in SIM_ERRORS {
            assert_eq!(*substring, substring.to_lowercase(), "lowercase rows");
            assert!(!source.is_empty());
        }
        for (_, _, source) in SIM_ERROR_CODES {
            assert!(!source.is_empty());
        }
        // An unknown error is retried, not a permanent failure.
        let unknown = ChainError::Unknown {
            method: "eth_estimateGas",
            code: -32603,
            message: "internal error".into(),
        };
        assert_eq!(unknown.retry(), Retry::Transient);
    }

    #[test]
    fn rate_limit_and_internal_error_codes_are_retried_whatever_the_message() {
        for (code, message) in [
            (-32005, "limit exceeded"),
            (429, "too many requests"),
            (-32603, "internal error"),
            // A wording of no row, or even of a refusal: the node's trouble decides.
            (-32603, "something went wrong"),
            (-32005, "Transaction gas limit exceeds block gas limit"),
        ] {
            assert_eq!(
                class_of(&classify_send_error(code, message)),
                Some(SendClass::Retryable),
                "{code} {message}: the node's trouble, not the transaction's"
            );
        }
    }

    #[test]
    fn fees_are_alloys_default_estimate_for_ordinary_answers() {
        use alloy::providers::utils::eip1559_default_estimator;
        // (base fee, rewards of the blocks)
        let cases: Vec<(u128, Vec<Vec<u128>>)> = vec![
            (1_000_000_000, vec![]),
            (7, vec![vec![0], vec![0]]),
            (30_000_000_000, vec![vec![2_000_000_000]]),
            (30_000_000_000, vec![vec![1], vec![4], vec![9]]),
            (
                30_000_000_000,
                vec![vec![3], vec![4], vec![], vec![8], vec![0]],
            ),
            (1, vec![vec![5, 100], vec![6, 100]]),
            (0, vec![vec![1_000_000_001], vec![1_000_000_000]]),
        ];
        for (base, rewards) in cases {
            let want = eip1559_default_estimator(base, &rewards);
            assert_eq!(
                eip1559_fees(base, &rewards),
                Some((want.max_fee_per_gas, want.max_priority_fee_per_gas)),
                "base {base}, rewards {rewards:?}"
            );
        }
    }

    #[test]
    fn fees_that_overflow_or_pass_the_cap_are_not_believed() {
        let cap = MAX_FEE_PER_GAS;
        // (base fee, rewards) → the estimate, or `None`: nothing overflows, nothing panics.
        type Case = (u128, Vec<Vec<u128>>, Option<(u128, u128)>);
        let cases: Vec<Case> = vec![
            // Twice the base fee overflows a u128.
            (u128::MAX, vec![], None),
            (u128::MAX / 2 + 1, vec![vec![1]], None),
            // Twice the base fee fits, plus the tip does not.
            (u128::MAX / 2, vec![vec![2]], None),
            // The two middle rewards would overflow if added: their mean, then past the cap.
            (1, vec![vec![u128::MAX], vec![u128::MAX - 2]], None),
            (1, vec![vec![u128::MAX], vec![u128::MAX]], None),
            // At the cap, and one wei past it.
            (cap / 2, vec![], None),
            ((cap - 1) / 2, vec![], Some((cap - 1, 1))),
            (0, vec![vec![cap]], Some((cap, cap))),
            (0, vec![vec![cap + 1]], None),
            // Large even pair under the cap: the exact mean.
            (
                0,
                vec![vec![cap - 1], vec![cap - 3]],
                Some((cap - 2, cap - 2)),
            ),
            (0, vec![vec![3], vec![4]], Some((3, 3))),
        ];
        for (base, rewards, want) in cases {
            assert_eq!(
                eip1559_fees(base, &rewards),
                want,
                "base {base}, rewards {rewards:?}"
            );
        }
        // The cap times the largest gas limit still fits a u128.
        assert!(MAX_FEE_PER_GAS.checked_mul(u128::from(u64::MAX)).is_some());
        let e = ChainError::Implausible {
            method: "eth_feeHistory",
            what: "x".into(),
        };
        assert_eq!(e.retry(), Retry::Transient, "another answer may be sane");
    }

    #[test]
    fn anvils_unknown_transaction_type_is_a_refusal_not_a_known_transaction() {
        assert_eq!(
            class_of(&classify_send_error(
                -32602,
                "Unknown transaction type not supported"
            )),
            Some(SendClass::Refused)
        );
    }
}
