-- Who may do what, and a record of who did.
--
-- managed_tx.submitted_by: the principal that submitted the request through the gateway (its
-- token's sub; TxRequest.submitted_by). NULL for a request produced to tx.requests directly.
-- An approval by the same principal is refused, by the gateway and again by the allocator.
--
-- gateway_audit: every submit, approve and cancel through the gateway, allowed or refused, one row
-- each (principal, action, target, time, outcome). Append-only: a trigger refuses UPDATE, DELETE
-- and TRUNCATE to every role, the service's own included. An operator who must prune it drops the
-- trigger deliberately, as the table's owner, and that act is outside the service's rights.

ALTER TABLE managed_tx ADD COLUMN submitted_by TEXT NULL;

CREATE TABLE gateway_audit (
    audit_id  BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    principal TEXT        NOT NULL,
    action    TEXT        NOT NULL CHECK (action IN ('tx.submit', 'tx.approve', 'tx.cancel')),
    -- tx.submit: chain_id/signer/request_id; tx.approve, tx.cancel: the tx_id.
    target    TEXT        NOT NULL,
    -- allowed: authorized (written before it is published: nothing is published unrecorded);
    -- refused: answered with `code`; unpublished: a row after an `allowed` one when the broker
    -- did not take it (the caller got 503 and may retry).
    outcome   TEXT        NOT NULL CHECK (outcome IN ('allowed', 'refused', 'unpublished')),
    code      TEXT        NULL,
    detail    TEXT        NULL
);

CREATE FUNCTION gateway_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'gateway_audit is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;

CREATE TRIGGER gateway_audit_no_update_or_delete
    BEFORE UPDATE OR DELETE ON gateway_audit
    FOR EACH ROW EXECUTE FUNCTION gateway_audit_append_only();

CREATE TRIGGER gateway_audit_no_truncate
    BEFORE TRUNCATE ON gateway_audit
    FOR EACH STATEMENT EXECUTE FUNCTION gateway_audit_append_only();
