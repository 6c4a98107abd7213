-- The transactional outbox (issue 12 point 4): every event recorded in tx_events that is announced
-- on a topic (TxAllocated, TxSigned, TxSubmitted, TxFailed) is produced at least once. A row is
-- written with published_at NULL in the transaction that records it; the stage that produced it
-- sets published_at once the broker acknowledged it, and the recovery scan relays the rows still
-- NULL (a crash between the commit and the acknowledgement). Audit-only rows (TxSimulated,
-- TxReplaced, ...) are written published.
--
-- Rows recorded before the outbox existed are taken as published: their stage produced them or,
-- for a drive's outputs lost in a crash, nothing can tell now.

ALTER TABLE tx_events ADD COLUMN published_at TIMESTAMPTZ NULL;

UPDATE tx_events SET published_at = created_at;

-- The relay reads only the unpublished rows, oldest first.
CREATE INDEX tx_events_unpublished_idx ON tx_events (created_at) WHERE published_at IS NULL;
