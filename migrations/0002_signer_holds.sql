-- Signers held by a stage (ARCHITECTURE §6): the signer cannot pay for its transactions, so the
-- stage sends nothing new for it and fails nothing; the row is the standing alert, removed when the
-- stage proceeds again. One row per (role, chain, signer); `since` is when the hold began.

CREATE TABLE signer_holds (
    role        TEXT        NOT NULL,
    chain_id    BIGINT      NOT NULL,
    signer      TEXT        NOT NULL CHECK (signer = lower(signer)),
    reason      TEXT        NOT NULL,
    since       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (role, chain_id, signer)
);
