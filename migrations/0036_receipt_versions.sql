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
-- written through outbox.receipts without one (an operator's, a test's): their row's
-- aggregate_version is the version. Adding a nullable column without a default rewrites
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

-- As in 0030, carrying the version through writes to the view.
CREATE OR REPLACE FUNCTION outbox.receipts_write() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    b bigint;
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM outbox.receipt_entries WHERE event_id = OLD.event_id;
        RETURN OLD;
    END IF;
    IF TG_OP = 'UPDATE' AND (NEW.slot_name, NEW.accepted_at, NEW.accepted_xact)
                            IS NOT DISTINCT FROM (OLD.slot_name, OLD.accepted_at, OLD.accepted_xact) THEN
        b := OLD.batch_id;
    ELSE
        INSERT INTO outbox.receipt_batches (slot_name, accepted_at, accepted_xact)
        VALUES (NEW.slot_name, coalesce(NEW.accepted_at, clock_timestamp()),
                coalesce(NEW.accepted_xact, pg_current_xact_id()))
        RETURNING batch_id INTO b;
    END IF;
    IF TG_OP = 'INSERT' THEN
        INSERT INTO outbox.receipt_entries (event_id, batch_id, destination_id, partition, "offset",
                                            broker_timestamp, attempt, relay_generation, commit_lsn,
                                            payload_digest, destination_digest, evidence, retained_at,
                                            aggregate_version)
        VALUES (NEW.event_id, b, outbox.receipt_destination(NEW.broker_kind, NEW.broker_cluster, NEW.topic),
                NEW.partition, NEW."offset", NEW.broker_timestamp, coalesce(NEW.attempt, 1),
                coalesce(NEW.relay_generation, 0), NEW.commit_lsn,
                outbox.digest_bytes(NEW.payload_digest), outbox.digest_bytes(NEW.destination_digest),
                NEW.evidence, NEW.retained_at, NEW.aggregate_version);
    ELSE
        UPDATE outbox.receipt_entries SET
            event_id = NEW.event_id, batch_id = b,
            destination_id = outbox.receipt_destination(NEW.broker_kind, NEW.broker_cluster, NEW.topic),
            partition = NEW.partition, "offset" = NEW."offset", broker_timestamp = NEW.broker_timestamp,
            attempt = NEW.attempt, relay_generation = NEW.relay_generation, commit_lsn = NEW.commit_lsn,
            payload_digest = outbox.digest_bytes(NEW.payload_digest),
            destination_digest = outbox.digest_bytes(NEW.destination_digest),
            evidence = NEW.evidence, retained_at = NEW.retained_at,
            aggregate_version = NEW.aggregate_version
        WHERE event_id = OLD.event_id;
    END IF;
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox.receipts_write() FROM PUBLIC;
