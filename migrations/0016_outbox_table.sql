-- The outbox as its own small table (issue 15). Until now an announced event's tx_events row was
-- written with published_at NULL and, once the broker acknowledged the event, updated to mark it
-- published: a second version of every announced row (payloads up to 1.3 kB, the confirmation
-- lists), non-HOT since published_at is the predicate of tx_events_unpublished_idx. Those marks
-- were a quarter of the WAL of a pipeline run (17-19 of ~70 MB at 50 x 40, `txflow bench
-- --compare`, pg_stat_statements) and 1.2-1.7 s of its ~8 s of statement time.
--
-- Now tx_events is written once and never updated (the audit log), and every announced event
-- also gets a tx_outbox row, in the same statement (txflow-core txstore): the event's id, its
-- transaction, signer and type. The stage that produced the event deletes the row once the broker
-- acknowledged it; the recovery scan relays the rows still there after a grace period (a crash
-- between the commit and the acknowledgement), reading the payload from tx_events. The table
-- holds only events in flight, so it stays small; its index serves the relay's per-signer read.
CREATE TABLE tx_outbox (
    event_id   UUID PRIMARY KEY,
    tx_id      UUID NOT NULL,
    chain_id   BIGINT NOT NULL,
    signer     TEXT NOT NULL,
    type       TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX tx_outbox_signer_idx ON tx_outbox (chain_id, signer, created_at);

-- What was unpublished is still to be relayed.
INSERT INTO tx_outbox (event_id, tx_id, chain_id, signer, type, created_at)
SELECT e.event_id, e.tx_id, m.chain_id, m.signer, e.type, e.created_at
FROM tx_events e JOIN managed_tx m USING (tx_id)
WHERE e.published_at IS NULL;

DROP INDEX tx_events_unpublished_idx;
ALTER TABLE tx_events DROP COLUMN published_at;
