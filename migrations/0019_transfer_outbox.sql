-- The transfer coordinator's transactional outbox: every TransferUpdated is recorded here in the
-- same statement as the CAS that moves its transfer, and deleted once the broker acknowledged it
-- (with the tx stages' marks). The coordinator relays, per user under that user's lease, the rows
-- still here after a grace period: a crash between the commit and the produce, a produce that
-- failed, or outputs dropped when a lease was lost. The payload is the event as JSON, so a
-- relayed event is the one the CAS recorded (same event_id, same updated_at_ms).
CREATE TABLE transfer_outbox (
    event_id   UUID PRIMARY KEY,
    user_id    TEXT NOT NULL,
    req_id     TEXT NOT NULL,
    state      SMALLINT NOT NULL,
    payload    JSONB NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX transfer_outbox_user_idx ON transfer_outbox (user_id, created_at);
