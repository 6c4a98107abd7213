-- A chained request's parent is one request: (chain_id, signer, request_id). Until now it was
-- found by request_id alone, so a request of an unrelated signer that happened to carry the same
-- id released the child when it was confirmed, or failed it when it failed. A request now names
-- the parent's signer when it is another one (TxRequest depends_on_signer, optional; its own
-- signer when absent), and the allocator records it here with the parent's request_id; the
-- parent is on the child's own chain. A row recorded before this column has NULL here: its own
-- signer (the allocator reads COALESCE(depends_on_signer, signer)).
--
-- Operators: the children still waiting, with their parent's state:
--   SELECT c.tx_id, c.request_id, c.depends_on_request_id,
--          COALESCE(c.depends_on_signer, c.signer) AS parent_signer, p.state
--   FROM managed_tx c LEFT JOIN managed_tx p ON p.chain_id = c.chain_id
--        AND p.signer = COALESCE(c.depends_on_signer, c.signer)
--        AND p.request_id = c.depends_on_request_id
--   WHERE c.state = 'RECEIVED' AND c.depends_on_request_id IS NOT NULL;

ALTER TABLE managed_tx
    ADD COLUMN depends_on_signer TEXT NULL
        CHECK (depends_on_signer = lower(depends_on_signer)),
    ADD CONSTRAINT managed_tx_depends_on_signer_ck
        CHECK (depends_on_signer IS NULL OR depends_on_request_id IS NOT NULL);

-- A request may depend on another signer's request with the same request_id; only a request
-- naming itself (its own id, its own signer) would wait forever.
ALTER TABLE managed_tx DROP CONSTRAINT managed_tx_depends_on_other_ck;
ALTER TABLE managed_tx ADD CONSTRAINT managed_tx_depends_on_other_ck
    CHECK (depends_on_request_id <> request_id OR COALESCE(depends_on_signer, signer) <> signer);
