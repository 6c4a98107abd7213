//! Typed telemetry events (CONVENTIONS 11): one struct per event, emitting one structured
//! `tracing` event with the domain fields. Metrics will hang off the same structs.

use crate::domain::NodeId;
use crate::lease::{AcquireKind, HeldLease, LeaseKey};

/// A lease was granted: first acquisition, renewal through `acquire`, re-take or steal.
pub struct LeaseAcquired<'a> {
    pub lease: &'a HeldLease,
    pub kind: &'a AcquireKind,
}

impl LeaseAcquired<'_> {
    pub fn emit(&self) {
        let l = self.lease;
        let (event, stolen_from) = match self.kind {
            AcquireKind::First => ("lease_acquired", None),
            AcquireKind::Renewed => ("lease_renewed", None),
            AcquireKind::Retaken => ("lease_retaken", None),
            AcquireKind::Stolen { from } => ("lease_stolen", Some(from.as_str())),
        };
        tracing::debug!(
            target: "txflow::lease",
            event,
            role = %l.key.role,
            chain_id = l.key.chain_id.0,
            signer = %l.key.signer,
            node = %l.node,
            fencing_token = l.token.0,
            stolen_from,
            "{event}"
        );
    }
}

/// Another node holds a live lease for the signer.
pub struct LeaseBusy<'a> {
    pub key: &'a LeaseKey,
    pub node: &'a NodeId,
    pub owner: Option<&'a str>,
}

impl LeaseBusy<'_> {
    pub fn emit(&self) {
        tracing::debug!(
            target: "txflow::lease",
            event = "lease_busy",
            role = %self.key.role,
            chain_id = self.key.chain_id.0,
            signer = %self.key.signer,
            node = %self.node,
            owner = self.owner,
            "lease held by another node"
        );
    }
}

/// A lease was renewed.
pub struct LeaseRenewed<'a> {
    pub lease: &'a HeldLease,
}

impl LeaseRenewed<'_> {
    pub fn emit(&self) {
        let l = self.lease;
        tracing::trace!(
            target: "txflow::lease",
            event = "lease_renewed",
            role = %l.key.role,
            chain_id = l.key.chain_id.0,
            signer = %l.key.signer,
            node = %l.node,
            fencing_token = l.token.0,
            "lease renewed"
        );
    }
}

/// A lease could not be renewed: it expired past the skew or another node took it.
pub struct LeaseLost<'a> {
    pub lease: &'a HeldLease,
}

impl LeaseLost<'_> {
    pub fn emit(&self) {
        let l = self.lease;
        tracing::warn!(
            target: "txflow::lease",
            event = "lease_lost",
            role = %l.key.role,
            chain_id = l.key.chain_id.0,
            signer = %l.key.signer,
            node = %l.node,
            fencing_token = l.token.0,
            "lease lost"
        );
    }
}

/// A lease was given up.
pub struct LeaseReleased<'a> {
    pub lease: &'a HeldLease,
}

impl LeaseReleased<'_> {
    pub fn emit(&self) {
        let l = self.lease;
        tracing::debug!(
            target: "txflow::lease",
            event = "lease_released",
            role = %l.key.role,
            chain_id = l.key.chain_id.0,
            signer = %l.key.signer,
            node = %l.node,
            fencing_token = l.token.0,
            "lease released"
        );
    }
}

/// A critical write was refused because the writer's lease or token is no longer current.
pub struct WriteFenced<'a> {
    pub lease: &'a HeldLease,
    pub operation: &'a str,
}

impl WriteFenced<'_> {
    pub fn emit(&self) {
        let l = self.lease;
        tracing::warn!(
            target: "txflow::lease",
            event = "write_fenced",
            role = %l.key.role,
            chain_id = l.key.chain_id.0,
            signer = %l.key.signer,
            node = %l.node,
            fencing_token = l.token.0,
            operation = self.operation,
            "write fenced: the lease is no longer held with this token"
        );
    }
}

/// A stage committed a batch and produced its outputs.
pub struct BatchCommitted<'a> {
    pub role: crate::role::Role,
    pub node: &'a NodeId,
    pub messages: usize,
    pub signers: usize,
    pub retried: usize,
    pub elapsed: std::time::Duration,
}

impl BatchCommitted<'_> {
    pub fn emit(&self) {
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
    pub role: crate::role::Role,
    pub code: &'a str,
    pub reason: &'a str,
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
}

impl DeadLettered<'_> {
    pub fn emit(&self) {
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
    pub role: crate::role::Role,
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
