//! Typed telemetry events (CONVENTIONS 11): one struct per event, emitting one structured
//! `tracing` event with the domain fields, and the metrics of the same event (`metrics.rs`).

use crate::domain::{ChainId, FencingToken, NodeId, Role, Signer};
use crate::metrics;

/// How a lease was granted, as the events report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant<'a> {
    /// No one held it before: token 1.
    First,
    /// We held it and it had not expired past the skew: same token.
    Renewed,
    /// We held it but it expired past the skew: token + 1.
    Retaken,
    /// Another node held it and it expired past the skew: token + 1.
    Stolen { from: &'a str },
}

/// A lease was granted: first acquisition, renewal through `acquire`, re-take or steal.
pub struct LeaseAcquired<'a> {
    pub role: Role,
    pub chain_id: ChainId,
    pub signer: &'a Signer,
    pub node: &'a NodeId,
    pub fencing_token: FencingToken,
    pub grant: Grant<'a>,
}

impl LeaseAcquired<'_> {
    pub fn emit(&self) {
        let (event, stolen_from) = match self.grant {
            Grant::First => ("lease_acquired", None),
            Grant::Renewed => ("lease_renewed", None),
            Grant::Retaken => ("lease_retaken", None),
            Grant::Stolen { from } => ("lease_stolen", Some(from)),
        };
        let result = match self.grant {
            Grant::First => metrics::lease_result::ACQUIRED,
            Grant::Renewed => metrics::lease_result::RENEWED,
            Grant::Retaken => metrics::lease_result::RETAKEN,
            Grant::Stolen { .. } => metrics::lease_result::STOLEN,
        };
        metrics::get().lease_acquire(self.role, result);
        tracing::debug!(
            target: "txflow::lease",
            event,
            role = %self.role,
            chain_id = self.chain_id.0,
            signer = %self.signer,
            node = %self.node,
            fencing_token = self.fencing_token.0,
            stolen_from,
            "{event}"
        );
    }
}

/// Another node holds a live lease for the signer.
pub struct LeaseBusy<'a> {
    pub role: Role,
    pub chain_id: ChainId,
    pub signer: &'a Signer,
    pub node: &'a NodeId,
    pub owner: Option<&'a str>,
}

impl LeaseBusy<'_> {
    pub fn emit(&self) {
        metrics::get().lease_acquire(self.role, metrics::lease_result::BUSY);
        tracing::debug!(
            target: "txflow::lease",
            event = "lease_busy",
            role = %self.role,
            chain_id = self.chain_id.0,
            signer = %self.signer,
            node = %self.node,
            owner = self.owner,
            "lease held by another node"
        );
    }
}

/// A lease was renewed.
pub struct LeaseRenewed<'a> {
    pub role: Role,
    pub chain_id: ChainId,
    pub signer: &'a Signer,
    pub node: &'a NodeId,
    pub fencing_token: FencingToken,
}

impl LeaseRenewed<'_> {
    pub fn emit(&self) {
        metrics::get().lease_acquire(self.role, metrics::lease_result::RENEWED);
        tracing::trace!(
            target: "txflow::lease",
            event = "lease_renewed",
            role = %self.role,
            chain_id = self.chain_id.0,
            signer = %self.signer,
            node = %self.node,
            fencing_token = self.fencing_token.0,
            "lease renewed"
        );
    }
}

/// A lease could not be renewed: it expired past the skew or another node took it.
pub struct LeaseLost<'a> {
    pub role: Role,
    pub chain_id: ChainId,
    pub signer: &'a Signer,
    pub node: &'a NodeId,
    pub fencing_token: FencingToken,
}

impl LeaseLost<'_> {
    pub fn emit(&self) {
        tracing::warn!(
            target: "txflow::lease",
            event = "lease_lost",
            role = %self.role,
            chain_id = self.chain_id.0,
            signer = %self.signer,
            node = %self.node,
            fencing_token = self.fencing_token.0,
            "lease lost"
        );
    }
}

/// A lease was given up.
pub struct LeaseReleased<'a> {
    pub role: Role,
    pub chain_id: ChainId,
    pub signer: &'a Signer,
    pub node: &'a NodeId,
    pub fencing_token: FencingToken,
}

impl LeaseReleased<'_> {
    pub fn emit(&self) {
        tracing::debug!(
            target: "txflow::lease",
            event = "lease_released",
            role = %self.role,
            chain_id = self.chain_id.0,
            signer = %self.signer,
            node = %self.node,
            fencing_token = self.fencing_token.0,
            "lease released"
        );
    }
}

/// A critical write was refused because the writer's lease or token is no longer current.
pub struct WriteFenced<'a> {
    pub role: Role,
    pub chain_id: ChainId,
    pub signer: &'a Signer,
    pub node: &'a NodeId,
    pub fencing_token: FencingToken,
    pub operation: &'a str,
}

impl WriteFenced<'_> {
    pub fn emit(&self) {
        metrics::get().lease_fenced(self.role);
        tracing::warn!(
            target: "txflow::lease",
            event = "write_fenced",
            role = %self.role,
            chain_id = self.chain_id.0,
            signer = %self.signer,
            node = %self.node,
            fencing_token = self.fencing_token.0,
            operation = self.operation,
            "write fenced: the lease is no longer held with this token"
        );
    }
}

/// A stage committed a batch and produced its outputs.
pub struct BatchCommitted<'a> {
    pub role: Role,
    pub node: &'a NodeId,
    pub messages: usize,
    pub signers: usize,
    pub retried: usize,
    pub elapsed: std::time::Duration,
}

impl BatchCommitted<'_> {
    pub fn emit(&self) {
        metrics::get().stage_batch(self.role, self.messages, self.elapsed);
        tracing::debug!(
            target: "txflow::stage",
            event = "batch_committed",
            role = %self.role,
            node = %self.node,
            messages = self.messages,
            signers = self.signers,
            retried = self.retried,
            elapsed_ms = self.elapsed.as_millis() as u64,
            "batch committed"
        );
    }
}

/// A message went to the dead-letter topic.
pub struct DeadLettered<'a> {
    pub role: Role,
    pub code: &'a str,
    pub reason: &'a str,
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
}

impl DeadLettered<'_> {
    pub fn emit(&self) {
        metrics::get().dead_letter(self.role, self.code);
        tracing::warn!(
            target: "txflow::stage",
            event = "dead_lettered",
            role = %self.role,
            code = self.code,
            reason = self.reason,
            topic = self.topic,
            partition = self.partition,
            offset = self.offset,
            "message dead-lettered"
        );
    }
}

/// The consumer group moved partitions to or from this instance.
pub struct Rebalanced<'a> {
    pub role: Role,
    pub node: &'a NodeId,
    pub assigned: &'a [i32],
    pub revoked: &'a [i32],
}

impl Rebalanced<'_> {
    pub fn emit(&self) {
        tracing::info!(
            target: "txflow::stage",
            event = "rebalance",
            role = %self.role,
            node = %self.node,
            assigned = ?self.assigned,
            revoked = ?self.revoked,
            "partitions rebalanced"
        );
    }
}
