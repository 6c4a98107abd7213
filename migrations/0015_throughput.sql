-- Throughput (issue 15). Measured with `txflow bench --compare --signers 50 --txs 40` (release)
-- and pg_stat_statements; see ARCHITECTURE.md, "Performance".
--
-- 1. The audit rows of tx_events lose their foreign key to managed_tx. Every state change writes
--    its audit row in the same statement as the UPDATE it records (txflow-core txstore, the only
--    INSERT INTO tx_events), joined with the rows that UPDATE returned: the code cannot write a
--    row for a transaction that does not exist. The constraint's check (a lookup and a KEY SHARE
--    lock of the managed_tx row, per audit row) was about a fifth of that statement's execution
--    (EXPLAIN ANALYZE: 0.23 ms of 1.02 ms for 9 rows). Nothing deletes from managed_tx; an
--    operator who does should delete the transaction's tx_events rows with it.
ALTER TABLE tx_events DROP CONSTRAINT IF EXISTS tx_events_tx_id_fkey;

-- 2. Room on each managed_tx page for a row's next version. An update that changes no indexed
--    column (the confirmation manager's per-block bookkeeping, a move that keeps the state) can
--    then be a heap-only (HOT) update — no new entry in any of the table's nine indexes — but
--    only if the new version fits on the same page, and rows are about 2 kB (payload, receipt,
--    confirmations): with the default fillfactor of 100 a page of four rows had no room, and 17 %
--    of the updates were HOT. Applies to pages written from now on; a large existing table gets
--    it page by page as rows are written (or at once with VACUUM FULL, which locks the table).
ALTER TABLE managed_tx SET (fillfactor = 70);
