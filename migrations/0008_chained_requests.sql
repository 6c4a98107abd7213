-- Chained tasks (issue 14 point 5, seed 000 §6): a request may name, in TxRequest
-- depends_on_request_id, the request that must be CONFIRMED before it goes on — a hop of a
-- multi-step task, on the same signer or another, on any chain recorded in this database. The
-- allocator records the name with the request (RECEIVED) and, on every drive of the signer (after
-- a batch, and every recovery scan), reads each RECEIVED child's parents in one statement: the
-- child is simulated only once every request recorded with that request_id is CONFIRMED and not
-- undone by a deep reorg (reorged_at IS NULL); it is FAILED (DEPENDENCY_FAILED, the reason naming
-- the parent) once one of them failed (FAILED, or REVERTED settled at depth); otherwise it waits
-- in RECEIVED, holding no nonce. Once it leaves RECEIVED it is a request like any other.
--
-- Operators: the children still waiting, with their parents' states:
--   SELECT c.tx_id, c.request_id, c.depends_on_request_id, p.chain_id, p.signer, p.state
--   FROM managed_tx c LEFT JOIN managed_tx p ON p.request_id = c.depends_on_request_id
--   WHERE c.state = 'RECEIVED' AND c.depends_on_request_id IS NOT NULL;

ALTER TABLE managed_tx
    ADD COLUMN depends_on_request_id TEXT NULL
        CHECK (length(depends_on_request_id) BETWEEN 1 AND 128),
    -- A request that names itself would wait forever: the allocator dead-letters it at intake.
    ADD CONSTRAINT managed_tx_depends_on_other_ck CHECK (depends_on_request_id <> request_id);

-- A child's parents are found by request_id alone (any chain, any signer); the unique index of
-- 0001 leads with (chain_id, signer), so it cannot serve that lookup.
CREATE INDEX managed_tx_request_id_idx ON managed_tx (request_id);
-- The children still waiting, by signer: what every drive of the allocator reads. A child leaves
-- it when it leaves RECEIVED. The query repeats the predicate as written.
CREATE INDEX managed_tx_waiting_child_idx ON managed_tx (chain_id, signer)
    WHERE depends_on_request_id IS NOT NULL AND state = 'RECEIVED';
