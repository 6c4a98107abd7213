-- The transfer coordinator (issue 18, seed 004 §6, §7.2).
--
-- Conservation violations: one row per (user, asset) the conservation check found out of balance
-- (funding + spot + in-flight differs from what the ledgers' outside movements put in). While a
-- row is unresolved, transfers are halted: the gateway refuses new ones (503 SERVICE_HALTED) and
-- the coordinator starts none (transfers already in flight are driven to a terminal state, since
-- stopping them would keep the money in flight). An operator resolves a row after investigating
-- (`resolved_at`, `resolved_by`).
CREATE TABLE transfer_conservation_violations (
    violation_id BIGSERIAL PRIMARY KEY,
    user_id      TEXT NOT NULL,
    asset        TEXT NOT NULL,
    -- What the ledgers' outside movements put in, and what funding + spot + in-flight holds.
    expected     NUMERIC(40, 18) NOT NULL,
    actual       NUMERIC(40, 18) NOT NULL,
    detail       TEXT NOT NULL,
    detected_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    resolved_at  TIMESTAMPTZ NULL,
    resolved_by  TEXT NULL
);

-- At most one open violation per (user, asset); the check re-finds it on every run.
CREATE UNIQUE INDEX transfer_conservation_open_idx
    ON transfer_conservation_violations (user_id, asset) WHERE resolved_at IS NULL;

-- The FUNDING ledger's outside movements (deposits from and withdrawals to the world outside the
-- two ledgers: on-chain deposits, payouts, an operator's correction), each applied with its
-- balance change in one transaction by the FUNDING adapter (`FundingAdapter::external_movement`).
-- The conservation check expects funding + spot + in-flight to equal the sum of both ledgers'
-- outside movements; a balance changed any other way is a violation. Idempotent by `movement_id`.
CREATE TABLE funding_external_movements (
    movement_id TEXT PRIMARY KEY CHECK (length(movement_id) BETWEEN 1 AND 64),
    user_id     TEXT NOT NULL CHECK (length(user_id) BETWEEN 1 AND 64),
    asset       TEXT NOT NULL REFERENCES assets (asset),
    -- Positive: money came in; negative: money went out.
    amount      NUMERIC(38, 18) NOT NULL CHECK (amount <> 0),
    reason      TEXT NOT NULL CHECK (length(reason) BETWEEN 1 AND 256),
    applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE INDEX funding_external_movements_user_idx ON funding_external_movements (user_id, asset);

-- The coordinator's sampling of transfers per user in the last minute (MON-004).
CREATE INDEX transfers_created_idx ON transfers (created_at);
