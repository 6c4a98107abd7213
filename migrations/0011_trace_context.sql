-- Traces (issue 17): the W3C trace context of the request a transaction was created for, so that
-- the spans of every later step — most of them drives that read their rows from here, not from a
-- message — join the request's trace (ARCHITECTURE.md, "Observability"). Written once, by the
-- stage runtime, in the batch that creates the row, and only while traces are exported
-- (`otel::enabled`); NULL otherwise. Telemetry, not state: nothing decides on it.
ALTER TABLE managed_tx ADD COLUMN traceparent TEXT NULL
    CHECK (traceparent IS NULL OR length(traceparent) <= 64);
