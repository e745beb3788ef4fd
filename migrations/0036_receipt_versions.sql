-- outboxd migration 0036: a receipt says which version of its aggregate it published.
--
-- Why (issue 27, docs/versions_by_relay.md, step 1): the writer's fast path is to be a plain
-- INSERT of the narrow row, whose aggregate version the relay assigns from commit order; such
-- a row holds no version, so the version an event was published with must be kept with its
-- receipt, where a restart finds it again (a row read twice gets the version its receipt
-- holds) and where status, the audit and the consumer's questions read it. Until the relay
-- assigns versions, every receipt's version is its row's own, and readers keep reading the
-- row's.
--
-- outbox.receipt_entries.aggregate_version: the version the relay published, written by
-- every acceptance from now on. NULL for receipts accepted before this migration and for rows
-- written through outbox.receipts (an operator's, a test's: the view's write trigger of 0030
-- is kept, and does not carry it): their row's aggregate_version is the version. Adding a nullable column without a default rewrites
-- nothing.

-- Acceptances write the entries while status readers read outbox.receipts; the view is
-- locked first (LOCK on a view locks the tables of its query after it, in that order), all at
-- once and never waited for, so no reader that holds the view and waits for an entry can close
-- a cycle with this migration: NOWAIT, retried 10 ms later for at most 60 s (as in 0031).
DO $$
BEGIN
    FOR attempt IN 1..6000 LOOP
        BEGIN
            LOCK TABLE outbox.receipts IN ACCESS EXCLUSIVE MODE NOWAIT;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM pg_sleep(0.01);
        END;
    END LOOP;
    RAISE EXCEPTION 'migration 0036 could not lock outbox.receipts and its tables within 60 s: a transaction holds one of them all along'
        USING ERRCODE = '55P03', HINT = 'find it in pg_locks (a long transaction or an idle-in-transaction session) and run outboxd migrate again';
END
$$;

ALTER TABLE outbox.receipt_entries ADD COLUMN aggregate_version bigint;
COMMENT ON COLUMN outbox.receipt_entries.aggregate_version IS
    'the aggregate version the relay published the event with; NULL: the row''s own (receipts accepted before migration 0036, or written by hand)';

-- As in 0030, with the version last (CREATE OR REPLACE VIEW may only add columns at the end).
CREATE OR REPLACE VIEW outbox.receipts AS
SELECT r.event_id, d.broker_kind, d.broker_cluster, d.topic, r.partition, r."offset",
       r.broker_timestamp, r.attempt, r.relay_generation, r.commit_lsn, b.slot_name,
       outbox.digest_text(r.payload_digest) AS payload_digest,
       outbox.digest_text(r.destination_digest) AS destination_digest,
       b.accepted_at, r.retained_at, b.accepted_xact, r.evidence, r.batch_id,
       r.aggregate_version
FROM outbox.receipt_entries r
LEFT JOIN outbox.receipt_batches b ON b.batch_id = r.batch_id
LEFT JOIN outbox.receipt_destinations d ON d.destination_id = r.destination_id;
