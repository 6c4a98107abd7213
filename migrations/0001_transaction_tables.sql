-- Transaction-side tables (ARCHITECTURE.md §4). Append-only: never edit a migration that has
-- landed; add a new numbered file instead.
--
-- Conventions: addresses are stored lowercase 0x-hex (CHECKed); U256 amounts are NUMERIC(78,0);
-- every critical write is fenced against signer_lease in the same transaction.

CREATE TABLE signer_lease (
    role           TEXT        NOT NULL,
    chain_id       BIGINT      NOT NULL,
    signer         TEXT        NOT NULL CHECK (signer = lower(signer)),
    owner_node     TEXT        NOT NULL,
    fencing_token  BIGINT      NOT NULL CHECK (fencing_token > 0),
    expires_at     TIMESTAMPTZ NOT NULL,
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (role, chain_id, signer)
);
CREATE INDEX signer_lease_owner_node_idx ON signer_lease (owner_node);

CREATE TABLE signer_nonce_cursor (
    chain_id       BIGINT      NOT NULL,
    signer         TEXT        NOT NULL CHECK (signer = lower(signer)),
    next_nonce     BIGINT      NOT NULL CHECK (next_nonce >= 0),
    fencing_token  BIGINT      NOT NULL,
    synced_at      TIMESTAMPTZ NULL,      -- last alignment with the chain's pending nonce
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (chain_id, signer)
);

CREATE TABLE managed_tx (
    tx_id                  UUID        PRIMARY KEY,
    chain_id               BIGINT      NOT NULL,
    signer                 TEXT        NOT NULL CHECK (signer = lower(signer)),
    request_id             TEXT        NOT NULL CHECK (length(request_id) BETWEEN 1 AND 128),
    kind                   TEXT        NOT NULL DEFAULT 'REQUEST' CHECK (kind IN ('REQUEST', 'NOOP')),
    nonce                  BIGINT      NULL CHECK (nonce >= 0),
    payload                JSONB       NOT NULL,
    state                  TEXT        NOT NULL CHECK (state IN (
                               'RECEIVED', 'SIMULATED', 'PENDING_APPROVAL', 'ALLOCATED', 'SIGNED',
                               'SUBMITTED', 'MINED', 'CONFIRMED', 'REVERTED', 'REPLACED', 'FAILED')),
    sub_state              TEXT        NULL,
    failure_code           TEXT        NULL,
    failure_reason         TEXT        NULL,
    nonce_released         BOOLEAN     NOT NULL DEFAULT false,
    receipt                JSONB       NULL,
    confirmations          JSONB       NULL,
    required_confirmations INTEGER     NOT NULL DEFAULT 1 CHECK (required_confirmations >= 0),
    fencing_token          BIGINT      NULL,
    confirmed_at           TIMESTAMPTZ NULL,
    created_at             TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at             TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT managed_tx_request_uq UNIQUE (chain_id, signer, request_id)
);
-- A nonce is held by at most one transaction: ALLOCATED through CONFIRMED, and REVERTED
-- (mined with status 0 still consumes it). FAILED with a released nonce and REPLACED do not hold it.
CREATE UNIQUE INDEX managed_tx_nonce_holder_uq ON managed_tx (chain_id, signer, nonce)
    WHERE nonce IS NOT NULL
      AND state IN ('ALLOCATED', 'SIGNED', 'SUBMITTED', 'MINED', 'CONFIRMED', 'REVERTED');
-- The recovery scan and the stages look transactions up by signer and state.
CREATE INDEX managed_tx_signer_state_idx ON managed_tx (chain_id, signer, state);

CREATE TABLE tx_attempts (
    tx_id                    UUID          NOT NULL REFERENCES managed_tx (tx_id),
    attempt                  INTEGER       NOT NULL CHECK (attempt >= 1),
    tx_hash                  TEXT          NOT NULL CHECK (tx_hash = lower(tx_hash)),
    raw_tx                   BYTEA         NOT NULL,
    max_fee_per_gas          NUMERIC(78,0) NOT NULL,
    max_priority_fee_per_gas NUMERIC(78,0) NOT NULL,
    created_at               TIMESTAMPTZ   NOT NULL DEFAULT now(),
    submitted_at             TIMESTAMPTZ   NULL,
    last_submit_at           TIMESTAMPTZ   NULL,
    next_resubmit_at         TIMESTAMPTZ   NULL,
    PRIMARY KEY (tx_id, attempt),
    CONSTRAINT tx_attempts_hash_uq UNIQUE (tx_hash)
);
CREATE INDEX tx_attempts_resubmit_idx ON tx_attempts (next_resubmit_at) WHERE next_resubmit_at IS NOT NULL;

CREATE TABLE tx_events (
    event_id   UUID        PRIMARY KEY,
    tx_id      UUID        NOT NULL REFERENCES managed_tx (tx_id),
    type       TEXT        NOT NULL,
    payload    JSONB       NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX tx_events_tx_idx ON tx_events (tx_id, created_at);

CREATE TABLE recycled_nonces (
    chain_id    BIGINT      NOT NULL,
    signer      TEXT        NOT NULL CHECK (signer = lower(signer)),
    nonce       BIGINT      NOT NULL CHECK (nonce >= 0),
    released_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (chain_id, signer, nonce)
);
