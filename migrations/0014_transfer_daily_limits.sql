-- The gateway's daily limits (issue 18, seed 004 §1.5.6): per user and UTC day, at most
-- `gateway.daily_count` transfers (DAILY_LIMIT_EXCEEDED) and, per asset, at most the asset's
-- `daily_limit` in total (DAILY_AMOUNT_EXCEEDED). Every transfer created that day counts, whatever
-- its state (a failed or refunded one included): the limit bounds what a user may ask for.

-- NULL: no daily amount limit for the asset.
ALTER TABLE assets
    ADD COLUMN daily_limit NUMERIC(38, 18) NULL CHECK (daily_limit IS NULL OR daily_limit > 0);

-- The gateway's check reads one user's transfers of the current day: a range on this index, a few
-- rows at most (the day's count is bounded by `gateway.daily_count`), where `transfers_user_idx
-- (user_id, asset)` would read the user's whole history and `transfers_created_idx (created_at)`
-- every user's transfers of the day.
CREATE INDEX transfers_user_created_idx ON transfers (user_id, created_at);
