-- Internal transfers (issue 18, seed 004 §7.1): the asset rules, the FUNDING ledger, the FUNDING
-- adapter's idempotency records and the transfers themselves.
--
-- Amounts are NUMERIC(38, 18), not the seed's DECIMAL(30, 8): an asset may have up to 18 decimal
-- places (the domain's MAX_PLACES), and 20 integer digits leave room for balances that sum many
-- transfers of at most 10^18 (MAX_SAFE_AMOUNT). Rust reads them as text (`::text`) and binds them
-- as text cast `::numeric`; no float is ever involved.

-- §1.5.3 / §1.5.4: what each asset allows. `places` is the seed's `precision`.
CREATE TABLE assets (
    asset                     TEXT PRIMARY KEY CHECK (asset ~ '^[A-Z0-9]{1,16}$'),
    places                    SMALLINT NOT NULL CHECK (places BETWEEN 0 AND 18),
    min_amount                NUMERIC(38, 18) NOT NULL CHECK (min_amount > 0),
    max_amount                NUMERIC(38, 18) NOT NULL
        CHECK (max_amount >= min_amount AND max_amount <= 1000000000000000000),
    status                    TEXT NOT NULL DEFAULT 'ACTIVE' CHECK (status IN ('ACTIVE', 'SUSPENDED')),
    internal_transfer_enabled BOOLEAN NOT NULL DEFAULT true,
    updated_at                TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The FUNDING ledger (seed 004 §1.1, `balances_tb`): one row per user and asset. A row is never
-- deleted. `status` is the account status of §1.5.5 (FROZEN refuses withdrawals, DISABLED every
-- operation but the refund of the account's own withdrawal).
CREATE TABLE funding_balances (
    user_id    TEXT NOT NULL CHECK (length(user_id) BETWEEN 1 AND 64),
    asset      TEXT NOT NULL REFERENCES assets (asset),
    available  NUMERIC(38, 18) NOT NULL DEFAULT 0 CHECK (available >= 0),
    status     TEXT NOT NULL DEFAULT 'ACTIVE' CHECK (status IN ('ACTIVE', 'FROZEN', 'DISABLED')),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, asset)
);

-- The FUNDING adapter's idempotency records (seed 004 §5.2, §9.3): one row per (req_id, op),
-- written in the transaction that applied — or, for a business refusal, refused — the operation.
-- A repeat of the key returns the recorded decision and changes nothing. No foreign key to
-- `transfers`: the adapter is independent of the coordinator's table.
CREATE TABLE transfer_operations (
    req_id     TEXT NOT NULL CHECK (length(req_id) BETWEEN 1 AND 64),
    op         TEXT NOT NULL CHECK (op IN ('WITHDRAW', 'DEPOSIT', 'REFUND')),
    user_id    TEXT NOT NULL,
    asset      TEXT NOT NULL,
    amount     NUMERIC(38, 18) NOT NULL CHECK (amount > 0),
    outcome    TEXT NOT NULL CHECK (outcome IN ('APPLIED', 'REJECTED')),
    code       TEXT NULL CHECK (code IS NULL OR length(code) <= 64),
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (req_id, op),
    CHECK ((outcome = 'APPLIED') = (code IS NULL))
);

-- Seed 004 §7.1. `state` holds the numeric ids of §2.1 (txflow_domain::transfer::TransferState);
-- it changes only by a CAS on one of the transitions of §2.2.
CREATE TABLE transfers (
    transfer_id    BIGSERIAL PRIMARY KEY,
    -- Server-generated.
    req_id         TEXT NOT NULL UNIQUE CHECK (length(req_id) BETWEEN 1 AND 64),
    -- The client's idempotency key, unique per user (not globally, as in the seed: a global key
    -- would answer one user's `cid` with another user's transfer).
    cid            TEXT NULL CHECK (cid IS NULL OR length(cid) BETWEEN 1 AND 64),
    user_id        TEXT NOT NULL CHECK (length(user_id) BETWEEN 1 AND 64),
    asset          TEXT NOT NULL REFERENCES assets (asset),
    amount         NUMERIC(38, 18) NOT NULL CHECK (amount > 0),
    -- 1 = FUNDING -> SPOT, 2 = SPOT -> FUNDING (txflow_domain::transfer::Direction).
    transfer_type  SMALLINT NOT NULL,
    source_account TEXT NOT NULL,
    target_account TEXT NOT NULL,
    state          SMALLINT NOT NULL DEFAULT 0
        CHECK (state IN (0, 10, 20, 30, 40, -10, -20, -30)),
    error_code     TEXT NULL CHECK (error_code IS NULL OR length(error_code) <= 64),
    error_message  TEXT NULL CHECK (error_message IS NULL OR length(error_message) <= 1024),
    retry_count    INTEGER NOT NULL DEFAULT 0 CHECK (retry_count >= 0),
    -- The fencing token of the user's lease under which the last write was made (NULL before the
    -- coordinator first wrote the row).
    fencing_token  BIGINT NULL,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (user_id, cid),
    CHECK (
        (transfer_type = 1 AND source_account = 'FUNDING' AND target_account = 'SPOT')
        OR (transfer_type = 2 AND source_account = 'SPOT' AND target_account = 'FUNDING')
    )
);

-- The recovery worker's scan (§6.2): the open states, oldest update first. Queries name the
-- states as literals so that this partial index serves them.
CREATE INDEX transfers_open_idx ON transfers (updated_at)
    WHERE state IN (0, 10, 20, 30, -20);

-- A user's transfers (the conservation check per user and asset, the API's listings).
CREATE INDEX transfers_user_idx ON transfers (user_id, asset);
