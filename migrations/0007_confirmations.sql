-- The confirmation manager (issue 14 points 2 and 3): it follows the chain's heads for every
-- transaction with a block (MINED, REVERTED, and CONFIRMED ones still watched for deep reorgs) and
-- announces each one's confirmation list (seed 001 §6.5, newFork).
--
-- Columns of 0001 it writes, in the fenced transaction of the move that announces them:
-- - confirmations: the list last announced (TxConfirmationsUpdated.confirmations): the blocks
--   from the transaction's own up to the head, at most required_confirmations of them, each
--   {"number", "hash", "parent_hash"}; [] once announced empty (the block is gone). The announced
--   events themselves are tx_events rows (types TxConfirmationsUpdated and TxReorged), relayed by
--   the outbox like every announced event;
-- - required_confirmations: the depth the transaction was counted against;
-- - confirmed_at: when it became final (CONFIRMED, or REVERTED settled at depth).
--
-- New columns:
-- - watch_until_block: a final transaction is watched for a reorg deeper than the required depth
--   until the head reaches this block (NULL: not watched);
-- - reorged_at: a final transaction whose block a deep reorg removed, whose outcome is being
--   re-evaluated (its own attempt mined again, or its nonce consumed by another transaction);
--   NULL otherwise. Such a reorg is a critical alert (ERROR confirmed_tx_reorged);
-- - reorg_generation: how many deep reorgs undid the transaction. TxConfirmed's event_id is
--   derived from (tx_id, reorg_generation): one TxConfirmed per transaction, and one more only
--   after a deep reorg announced with new_fork=true.
--
-- Operators: SELECT tx_id, state, nonce, reorged_at, reorg_generation FROM managed_tx
--            WHERE reorged_at IS NOT NULL;

ALTER TABLE managed_tx
    ADD COLUMN watch_until_block BIGINT      NULL CHECK (watch_until_block >= 0),
    ADD COLUMN reorged_at        TIMESTAMPTZ NULL,
    ADD COLUMN reorg_generation  INTEGER     NOT NULL DEFAULT 0 CHECK (reorg_generation >= 0);

-- The transactions the confirmation manager follows, by signer: mined (a receipt) and not final
-- yet, final ones still watched, and those undone by a deep reorg. No state name in the
-- predicate: the queries repeat it as written, so that the planner uses this index whatever
-- their parameters.
CREATE INDEX managed_tx_followed_idx ON managed_tx (chain_id, signer)
    WHERE (mined_block_number IS NOT NULL AND confirmed_at IS NULL)
       OR watch_until_block IS NOT NULL OR reorged_at IS NOT NULL;
