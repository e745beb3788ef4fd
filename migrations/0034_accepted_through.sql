-- outboxd migration 0034: each slot's checkpoint row keeps how far in the slot's stream its
-- receipts have been accepted, so an acceptance knows from one locked row whether a batch can
-- hold a receipt the slot recorded before.
--
-- Why (issue 27, docs/evidence_batches.md "What was settled on 2026-12-05"): the plain
-- acceptance (`COPY` of entries) relied on the entries' primary key to find a replay, trying
-- first and rolling back when a publish slot was taken. A receipt read from the stream has a
-- position, (commit LSN of its transaction, LSN of its change record), and the stream
-- delivers in that order; `accepted_commit_lsn`/`accepted_change_lsn` is the highest position
-- among the receipts this slot's acceptances recorded. Every acceptance locks the row first
-- (so acceptances of one slot, a paused relay's salvage included, commit in the order they
-- took it) and raises it in the same transaction. A batch whose receipts are all past it can
-- only hold receipts new to the slot (`outbox_core::receipt::proved_new`); the others are
-- classified. The key stays the backstop; evidence per batch without a per-event key is the
-- next step, and needs this rule.
ALTER TABLE outbox.checkpoints
    ADD COLUMN accepted_commit_lsn pg_lsn,
    ADD COLUMN accepted_change_lsn pg_lsn,
    ADD CONSTRAINT checkpoints_accepted_position_check
        CHECK ((accepted_commit_lsn IS NULL) = (accepted_change_lsn IS NULL));

COMMENT ON COLUMN outbox.checkpoints.accepted_commit_lsn IS
    'with accepted_change_lsn: the highest stream position (commit LSN, change LSN) among the receipts this slot''s acceptances recorded; NULL before the first';

-- Receipts accepted before this migration carry no change LSN: a slot's newest commit LSN
-- among them is taken with the highest change LSN, so that every row of that transaction and
-- of every earlier one is at or below it, and a replay after the upgrade is never taken for
-- new receipts.
UPDATE outbox.checkpoints c
SET accepted_commit_lsn = m.lsn, accepted_change_lsn = 'FFFFFFFF/FFFFFFFF'
FROM (SELECT b.slot_name, max(e.commit_lsn) AS lsn
      FROM outbox.receipt_entries e
      JOIN outbox.receipt_batches b ON b.batch_id = e.batch_id
      WHERE e.commit_lsn IS NOT NULL AND b.slot_name IS NOT NULL
      GROUP BY b.slot_name) m
WHERE m.slot_name = c.slot_name;
