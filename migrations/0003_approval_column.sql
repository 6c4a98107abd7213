-- Approval is a recorded fact, not a text prefix in sub_state that a later write could overwrite
-- (issue 11): who approved a transaction and when. A transaction re-allocated after REPLACED keeps
-- its approval.

ALTER TABLE managed_tx
    ADD COLUMN approved_by TEXT        NULL,
    ADD COLUMN approved_at TIMESTAMPTZ NULL;

UPDATE managed_tx
   SET approved_by = substr(sub_state, length('approved by ') + 1), approved_at = updated_at
 WHERE sub_state LIKE 'approved by %';
