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
    #[error("{0}")]
    InvalidUrl(String),
}

impl Classify for ChainError {
    fn retry(&self) -> Retry {
        match self {
            ChainError::Unavailable { .. } => Retry::Transient,
            ChainError::Rpc { code, .. } if *code == -32005 || *code == 429 => Retry::Transient,
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
    Rejected {
        retryable: bool,
        reason: String,
    },
}

/// Classifies a JSON-RPC error of `eth_sendRawTransaction` (by message: anvil and geth share
/// code -32003/-32000 for all of these, so the text is the only signal).
pub fn classify_send_error(code: i64, message: &str) -> SendOutcome {
    let m = message.to_ascii_lowercase();
    let reason = format!("{code}: {message}");
    if m.contains("already known") || m.contains("already imported") {
        SendOutcome::PossiblySent { reason }
    } else if m.contains("nonce too low") {
        SendOutcome::NonceTooLow { reason }
    } else if m.contains("insufficient funds") {
        SendOutcome::InsufficientFunds { reason }
    } else if m.contains("underpriced") || m.contains("less than block base fee") {
        SendOutcome::Rejected {
            retryable: true,
            reason,
        }
    } else {
        SendOutcome::Rejected {
            retryable: false,
            reason,
        }
    }
}

/// A JSON-RPC endpoint of one chain.
#[derive(Clone, Debug)]
pub struct Chain {
    provider: DynProvider,
    pub chain_id: u64,
}

impl Chain {
    pub fn connect(url: &str, chain_id: u64) -> Result<Chain, ChainError> {
        let url = url
            .parse()
            .map_err(|_| ChainError::InvalidUrl(url.to_string()))?;
        let provider = ProviderBuilder::new()
            .disable_recommended_fillers()
            .connect_http(url)
            .erased();
        Ok(Chain { provider, chain_id })
    }

    pub fn provider(&self) -> &DynProvider {
        &self.provider
    }

    /// The next nonce the chain expects, counting contiguous pending transactions.
    pub async fn pending_nonce(&self, address: Address) -> Result<u64, ChainError> {
        self.provider
            .get_transaction_count(address)
            .pending()
            .await
            .map_err(|e| classify("eth_getTransactionCount", e))
    }

    /// The number of transactions the signer has mined (the `latest` nonce).
    pub async fn latest_nonce(&self, address: Address) -> Result<u64, ChainError> {
        self.provider
            .get_transaction_count(address)
            .latest()
            .await
            .map_err(|e| classify("eth_getTransactionCount", e))
    }

    /// Whether the node knows a transaction by this hash (pooled or mined).
    pub async fn knows_transaction(&self, hash: B256) -> Result<bool, ChainError> {
        self.provider
            .get_transaction_by_hash(hash)
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
        let tx = TransactionRequest::default()
            .from(from)
            .to(to)
            .value(value)
            .input(data.into());
        match self.provider.estimate_gas(tx).await {
            Ok(gas) => Ok(Simulation::Ok { gas }),
            Err(RpcError::ErrorResp(p)) if p.code == 3 || p.message.contains("revert") => {
                Ok(Simulation::Reverts {
                    reason: p.message.to_string(),
                })
            }
            Err(RpcError::ErrorResp(p))
                if p.message
                    .to_ascii_lowercase()
                    .contains("insufficient funds") =>
            {
                Ok(Simulation::InsufficientFunds {
                    reason: p.message.to_string(),
                })
            }
            Err(e) => Err(classify("eth_estimateGas", e)),
        }
    }

    /// EIP-1559 fees from `eth_feeHistory`: (max fee, max priority fee).
    pub async fn fees(&self) -> Result<(u128, u128), ChainError> {
        let est = self
            .provider
            .estimate_eip1559_fees()
            .await
            .map_err(|e| classify("eth_feeHistory", e))?;
        Ok((est.max_fee_per_gas, est.max_priority_fee_per_gas))
    }

    /// Sends a signed transaction and classifies the answer.
    pub async fn send_raw(&self, raw: &[u8]) -> Result<SendOutcome, ChainError> {
        match self.provider.send_raw_transaction(raw).await {
            Ok(_) => Ok(SendOutcome::Accepted),
            Err(RpcError::ErrorResp(p)) => Ok(classify_send_error(p.code, &p.message)),
            Err(e) => Err(classify("eth_sendRawTransaction", e)),
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
    fn send_errors_are_classified_by_message() {
        assert!(matches!(
            classify_send_error(-32003, "transaction already imported"),
            SendOutcome::PossiblySent { .. }
        ));
        assert!(matches!(
            classify_send_error(-32000, "already known"),
            SendOutcome::PossiblySent { .. }
        ));
        assert!(matches!(
            classify_send_error(-32003, "nonce too low"),
            SendOutcome::NonceTooLow { .. }
        ));
        assert!(matches!(
            classify_send_error(-32003, "Insufficient funds for gas * price + value"),
            SendOutcome::InsufficientFunds { .. }
        ));
        assert!(matches!(
            classify_send_error(-32003, "replacement transaction underpriced"),
            SendOutcome::Rejected {
                retryable: true,
                ..
            }
        ));
        assert!(matches!(
            classify_send_error(-32602, "Failed to decode transaction"),
            SendOutcome::Rejected {
                retryable: false,
                ..
            }
        ));
    }
}
