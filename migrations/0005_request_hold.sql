-- One request's problem stays its own (issue 12 point 5): a request the signer cannot pay for
-- (its value exceeds the balance) while it can pay for others is held alone. It stays RECEIVED
-- (no nonce taken, nobody behind it blocked); these columns say why and when the allocator
-- simulates it again, with a back-off so that a hold does not cost the node a call on every
-- recovery scan. The allocator clears them in the transaction that moves the request out of
-- RECEIVED (simulated, awaiting approval, failed, cancelled).
--
-- Operators: SELECT tx_id, request_id, hold_reason, held_since, hold_attempts, hold_retry_at
--            FROM managed_tx WHERE hold_reason IS NOT NULL;
-- A whole signer that cannot pay at all is held in signer_holds instead (0002).

ALTER TABLE managed_tx
    ADD COLUMN hold_reason   TEXT        NULL,
    ADD COLUMN held_since    TIMESTAMPTZ NULL,
    ADD COLUMN hold_attempts INTEGER     NOT NULL DEFAULT 0 CHECK (hold_attempts >= 0),
    ADD COLUMN hold_retry_at TIMESTAMPTZ NULL,
    ADD CONSTRAINT managed_tx_hold_ck CHECK (
        (hold_reason IS NULL AND held_since IS NULL AND hold_retry_at IS NULL)
        OR (hold_reason IS NOT NULL AND held_since IS NOT NULL AND hold_retry_at IS NOT NULL));

-- The held requests of a signer (operators, and the allocator's "not before" filter).
CREATE INDEX managed_tx_held_idx ON managed_tx (chain_id, signer, hold_retry_at)
    WHERE hold_reason IS NOT NULL;
