-- outboxd migration 0034: how far in its slot's stream each relay run's receipts have been
-- accepted, so an acceptance knows from a few rows whether a batch can hold a receipt accepted
-- before.
--
-- Why (issue 27, docs/evidence_batches.md "Built on 2026-12-05"): the plain acceptance
-- (`COPY` of entries) relied on the entries' primary key to find a replay, trying first and
-- rolling back when a publish slot was taken. A receipt read from the stream has a position,
-- (commit LSN of its transaction, LSN of its change record), and a run reads its stream once,
-- in that order; but it accepts its receipts in the order the broker answers, so its own
-- positions are not a prefix. A row here is the highest position among the receipts one run
-- (`relay_generation`) recorded; receipts that know no position (a snapshot's, a look-up's, a
-- release's) raise the row of generation -1 to what bounds them (the WAL's insert position).
-- A batch of run G whose receipts are all past every other row cannot hold a receipt recorded
-- before (`outbox_core::receipt::proved_new`): what was accepted before G's read of the
-- stream, or by another run since, is at or below those rows. Every acceptance locks its
-- slot's checkpoint row first (so the acceptances of one slot, a paused run's salvage
-- included, commit in the order they took it) and raises its row in the same transaction.
-- The entries' key stays the backstop.
CREATE TABLE outbox.accepted_positions (
    slot_name        text NOT NULL,
    relay_generation bigint NOT NULL,
    commit_lsn       pg_lsn NOT NULL,
    change_lsn       pg_lsn NOT NULL,
    PRIMARY KEY (slot_name, relay_generation)
);

COMMENT ON TABLE outbox.accepted_positions IS
    'per slot and relay run (relay_generation; -1: receipts without a stream position), the highest stream position (commit LSN, change LSN) among the receipts recorded; an acceptance proves a batch new against the rows of the other runs';

-- Receipts accepted before this migration carry no change LSN: a slot's newest commit LSN
-- among them, with the highest change LSN, under generation -1, so that every row of that
-- transaction and of every earlier one is at or below it and a replay after the upgrade is
-- never taken for new receipts.
INSERT INTO outbox.accepted_positions (slot_name, relay_generation, commit_lsn, change_lsn)
SELECT b.slot_name, -1, max(e.commit_lsn), 'FFFFFFFF/FFFFFFFF'
FROM outbox.receipt_entries e
JOIN outbox.receipt_batches b ON b.batch_id = e.batch_id
WHERE e.commit_lsn IS NOT NULL AND b.slot_name IS NOT NULL
GROUP BY b.slot_name;

-- Every acceptance writes it: whoever may update the checkpoints (a relay's role,
-- docs/least_privilege.sql) may write it too, so a relay under such a role keeps running
-- across this upgrade.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT quote_ident(ro.rolname) AS grantee
             FROM pg_class c
             CROSS JOIN LATERAL aclexplode(c.relacl) a
             JOIN pg_roles ro ON ro.oid = a.grantee
             WHERE c.oid = 'outbox.checkpoints'::regclass AND a.privilege_type = 'UPDATE'
               AND a.grantee <> c.relowner LOOP
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.accepted_positions TO %s',
                       r.grantee);
    END LOOP;
END
$$;
