-- Recovery scans and table size (issue 15): every query a stage runs periodically (the recovery
-- scan's pending signers, the reads of every drive, the outbox relay) reads an index that holds
-- only the transactions still in flight, so that it costs the same with millions of final rows
-- (CONFIRMED, FAILED, REVERTED settled at depth) as with none. tests/tests/scans.rs runs each of
-- them through its store function before and after loading final rows and checks from the
-- executed plans (no sequential scan, the buffers read) that nothing grows with them.
--
-- managed_tx_signer_state_idx (0001) indexed every row by (chain_id, signer, state). The recovery
-- scans ask "which signers of this chain have rows in these states", which that index could only
-- answer by reading the chain's every entry, final ones included (a 1,000,000-row table: the
-- whole index, ~1,000 pages, on every scan of three stages). Every query by state asks for states
-- before a receipt, so the index is replaced by a partial one of those: its size follows the
-- transactions in flight (a row leaves it when it is mined or fails; vacuum removes the dead
-- entries, as in any index).
--
-- The queries must write the states as SQL literals (txstore::state_in, from TxState::as_str),
-- never as bound parameters: the generic plan of a prepared statement, which PostgreSQL may
-- choose from the sixth execution on, cannot prove a partial index's predicate from an unknown
-- value.
--
-- Which index serves each periodic query:
-- - managed_tx_open_idx (below): txstore::signers_in_states (the pending signers of the
--   allocator, the signer gateway and the broadcaster), txstore::rows_in_states (the allocator's
--   RECEIVED, SIMULATED and REPLACED rows, the signer gateway's ALLOCATED ones), the allocator's
--   has_replaced, the broadcaster's signed_rows and due_resubmissions, the receipt checker's due
--   and pending_signers (or managed_tx_receipt_due_idx, 0006), the confirmation manager's
--   lowest_unmined;
-- - managed_tx_followed_idx (0007): the confirmation manager's followed and pending_signers, the
--   signer gateway's undone transactions (and its pending signers with one), the broadcaster's
--   due cancellations (and its pending signers with one);
-- - managed_tx_waiting_child_idx (0008): the allocator's chained requests still waiting (parents;
--   each parent found by managed_tx_request_id_idx, one lookup);
-- - managed_tx_held_idx (0005): the allocator's request_holds;
-- - tx_events_unpublished_idx (0004): the outbox relay (signers_with_unpublished, unpublished);
-- - tx_attempts_resubmit_idx (0001): the broadcaster's pending signers with a resubmission due.
-- Rows reached from those by key (a transaction's attempts and events, a cancellation's
-- transaction) are read by a key lookup: a few pages however large the table. tx_cancellations
-- (a row per nonce a deep reorg undid) is small and read whole.
--
-- Operators asking for a signer's final rows by state (rare) are served by
-- managed_tx_request_uq's (chain_id, signer) prefix.
--
-- Building the index reads the table once, and writes to managed_tx wait meanwhile. With a large
-- table, run both statements by hand first with CONCURRENTLY (CREATE INDEX CONCURRENTLY
-- managed_tx_open_idx ..., then DROP INDEX CONCURRENTLY managed_tx_signer_state_idx): this
-- migration then finds them done.

DROP INDEX IF EXISTS managed_tx_signer_state_idx;

-- The open states (txflow-core txstore::OPEN): RECEIVED to SUBMITTED, and REPLACED (re-allocated
-- by the allocator). chain_id then state first: a recovery scan reads exactly the entries of the
-- states it asks for; a drive adds its signer to the same descent.
CREATE INDEX IF NOT EXISTS managed_tx_open_idx ON managed_tx (chain_id, state, signer)
    WHERE state IN ('RECEIVED', 'SIMULATED', 'PENDING_APPROVAL', 'ALLOCATED', 'SIGNED',
                    'SUBMITTED', 'REPLACED');
