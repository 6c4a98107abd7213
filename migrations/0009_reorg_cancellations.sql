-- The defensive cancellation of seed 000 §4.4 (issue 14 point 3). When a reorg deeper than the
-- required depth undoes a final transaction (the confirmation manager sets managed_tx.reorged_at),
-- its original may still be in some node's pool and be mined again at any time. Before the outcome
-- is rolled back, txflow makes the nonce go one way for sure: the signer gateway signs a 0-value
-- self-transfer at that nonce with a high priority fee and records it here (fenced by its lease);
-- the broadcaster sends it, and again every TXFLOW_RESUBMIT_INTERVAL_MS, while the transaction is
-- being re-evaluated and its own attempt is not mined (fenced by its lease). Whichever of the two
-- is mined settles the nonce: its own attempt → followed to the depth again (RECONFIRM); anything
-- else at the nonce, at the depth → CONFIRMED → SIMULATED (UNDO_CONFIRMED), a fresh nonce.
--
-- Not a tx_attempts row: an attempt is the transaction itself — a receipt for any attempt settles
-- it, and the receipt checker, the broadcaster's "whose nonce" proof and the confirmation manager
-- read tx_attempts so — while a cancellation is another transaction, the one that voids it. One per
-- (chain, signer, nonce): the same signed bytes void any transaction at that nonce, so a later deep
-- reorg of the same nonce sends this one again.
--
-- Operators: SELECT c.nonce, c.tx_hash, c.sends, c.submitted_at, m.state, m.reorged_at
--            FROM tx_cancellations c JOIN managed_tx m USING (tx_id) ORDER BY c.created_at DESC;

CREATE TABLE tx_cancellations (
    chain_id                 BIGINT        NOT NULL,
    signer                   TEXT          NOT NULL CHECK (signer = lower(signer)),
    nonce                    BIGINT        NOT NULL CHECK (nonce >= 0),
    -- The transaction whose nonce it voids, and the deep reorg (its reorg_generation) it answered.
    tx_id                    UUID          NOT NULL REFERENCES managed_tx (tx_id),
    reorg_generation         INTEGER       NOT NULL CHECK (reorg_generation >= 0),
    tx_hash                  TEXT          NOT NULL CHECK (tx_hash = lower(tx_hash)),
    raw_tx                   BYTEA         NOT NULL,
    max_fee_per_gas          NUMERIC(78,0) NOT NULL,
    max_priority_fee_per_gas NUMERIC(78,0) NOT NULL,
    -- The signer gateway's fencing token when it recorded the signature.
    fencing_token            BIGINT        NOT NULL,
    created_at               TIMESTAMPTZ   NOT NULL DEFAULT now(),
    -- The broadcaster's bookkeeping: the first send a node took, the last look at it (a send, or
    -- the chain's nonce already past it), when it is looked at again (NULL: at once), and how many
    -- sends a node took.
    submitted_at             TIMESTAMPTZ   NULL,
    last_submit_at           TIMESTAMPTZ   NULL,
    next_send_at             TIMESTAMPTZ   NULL,
    sends                    INTEGER       NOT NULL DEFAULT 0 CHECK (sends >= 0),
    PRIMARY KEY (chain_id, signer, nonce),
    CONSTRAINT tx_cancellations_hash_uq UNIQUE (tx_hash)
);
CREATE INDEX tx_cancellations_tx_idx ON tx_cancellations (tx_id);
