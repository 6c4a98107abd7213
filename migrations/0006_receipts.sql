-- The receipt checker (issue 14 point 1): a SUBMITTED transaction whose receipt is found moves to
-- MINED (status 1) or REVERTED (status 0) with the receipt recorded in the same statement.
--
-- managed_tx.receipt (JSONB, since 0001, never written before) holds what was found: which attempt,
-- its hash, block number and hash, status, gas used, effective gas price (decimal wei). Its block
-- is kept in columns of their own for the confirmation manager: mined_block_number and
-- mined_block_hash. The three are set together (MINE, REVERT) and cleared together (REORG, when the
-- block is gone; REPLACE): txflow-core txstore `ReceiptWrite`.
--
-- The receipt checker's schedule: next_receipt_check_at is when a SUBMITTED transaction is looked
-- up again after "no receipt yet" or an RPC error (NULL: at once); receipt_stale_since is when the
-- checker first saw the signer's nonce past this transaction's with no receipt for any of its
-- hashes (after confirmations.stale_receipt_timeout, the block where the nonce passed decides
-- whether it was REPLACED). A move that writes the receipt columns resets both.

ALTER TABLE managed_tx
    ADD COLUMN mined_block_number    BIGINT      NULL CHECK (mined_block_number >= 0),
    ADD COLUMN mined_block_hash      TEXT        NULL CHECK (mined_block_hash = lower(mined_block_hash)),
    ADD COLUMN next_receipt_check_at TIMESTAMPTZ NULL,
    ADD COLUMN receipt_stale_since   TIMESTAMPTZ NULL,
    ADD CONSTRAINT managed_tx_receipt_ck CHECK (
        (receipt IS NULL) = (mined_block_number IS NULL)
        AND (receipt IS NULL) = (mined_block_hash IS NULL));

-- The receipt checker's scan: the SUBMITTED transactions of a chain that are due to be looked up.
CREATE INDEX managed_tx_receipt_due_idx ON managed_tx (chain_id, next_receipt_check_at)
    WHERE state = 'SUBMITTED';
