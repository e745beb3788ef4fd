-- outboxd migration 0043: receipts packed into their acceptance batch.
--
-- Why (issue 27, docs/evidence_batches.md step 2): a drained event's receipt was an entry of
-- outbox.receipt_entries, a heap row and a key per event, which cost the primary ~2.5-3 us of
-- a backend's CPU per receipt and a change the walsender decodes again. A batch the relay
-- proves new to its slot (its stream positions past every other run's, under the slot's
-- checkpoint row lock, migration 0034) now keeps its receipts in one value of its batch row,
-- `packed`: 132 bytes per receipt, stored uncompressed out of line. Measured with the relay's
-- parameters on the scratch cluster: 0.5 us per receipt against 2.75-3.0 for the entries'
-- binary COPY (docs/benchmarks.md, "Receipts packed into their batch").
--
-- What keeps one primary receipt per event without a key on the packed ones:
-- * a batch is packed only when proven new to its slot and its run has had no failed or
--   unclear acceptance and accepted no receipt without a position (the relay decides:
--   outbox_core::receipt::Packing); a replay, a salvage, a snapshot's or a look-up's receipts
--   are classified or written as entries;
-- * the classifying statement counts a packed receipt as the event's primary one (the packed
--   batches whose id range holds the batch's ids, unpacked once per statement);
-- * an entries batch written on a guess (no proof) is refused when a packed batch's id range
--   overlaps its ids, and classified instead.
-- Event ids are uuid v7 (time-ordered) unless a caller chose its own; only batches of v7 ids
-- are packed, so a batch's id range is narrow and a probe for one event unpacks a few batches.
--
-- Layout of one receipt in `packed` (big-endian, 132 bytes; outbox-ledger's packed.rs writes
-- it, outbox.packed_receipts reads it):
--   0 event_id (16) | 16 destination_id int4 | 20 partition int4 | 24 offset int8 |
--   32 broker timestamp, ms since the Unix epoch, int8 (-2^63: none) | 40 attempt int4 |
--   44 relay_generation int8 | 52 commit_lsn int8 (0: none) |
--   60 aggregate_version int8 (-2^63: none) | 68 payload digest (32) | 100 destination digest (32)
-- Digests are the 32 bytes of sha256 (outbox.digest_bytes's form); receipts with any other
-- digest or with evidence are written as entries.
--
-- Readers: outbox.receipts unnests the packed batches beside the entries (UNION ALL), and
-- outbox.receipt_of(id) probes the packed batches by their id range (index on last_event).
-- Writes through the view (operators', tests') and purge first unpack a batch into entries
-- (outbox.unpack_receipt_batch): the per-event columns they change (retained_at) live there.

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
    RAISE EXCEPTION 'migration 0043 could not lock outbox.receipts and its tables within 60 s: a transaction holds one of them all along'
        USING ERRCODE = '55P03', HINT = 'find it in pg_locks (a long transaction or an idle-in-transaction session) and run outboxd migrate again';
END
$$;

ALTER TABLE outbox.receipt_batches
    ADD COLUMN first_event uuid,
    ADD COLUMN last_event uuid,
    ADD COLUMN packed bytea;
ALTER TABLE outbox.receipt_batches ALTER COLUMN packed SET STORAGE EXTERNAL;
COMMENT ON COLUMN outbox.receipt_batches.packed IS
    'the batch''s receipts, 132 bytes each (migration 0043); read them through outbox.receipts or outbox.packed_receipts';
CREATE INDEX receipt_batches_packed_range ON outbox.receipt_batches (last_event, first_event)
    WHERE packed IS NOT NULL;

-- The receipts of one packed value, in the order the relay wrote them. PL/pgSQL, and p is a
-- copy made by a concatenation: an assignment alone kept the out-of-line pointer, and every
-- field then fetched its slice of the value from the toast table again (33 us per receipt
-- against 2.6 with the copy, 646 receipts).
CREATE FUNCTION outbox.packed_receipts(packed bytea)
RETURNS TABLE (event_id uuid, destination_id integer, partition integer, "offset" bigint,
               broker_timestamp timestamptz, attempt integer, relay_generation bigint,
               commit_lsn pg_lsn, aggregate_version bigint, payload_digest bytea,
               destination_digest bytea)
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    p bytea := packed || '\x'::bytea;
BEGIN
    RETURN QUERY
    SELECT encode(substr(p, o + 1, 16), 'hex')::uuid,
           ('x' || encode(substr(p, o + 17, 4), 'hex'))::bit(32)::integer,
           ('x' || encode(substr(p, o + 21, 4), 'hex'))::bit(32)::integer,
           ('x' || encode(substr(p, o + 25, 8), 'hex'))::bit(64)::bigint,
           CASE WHEN ts = -9223372036854775808 THEN NULL ELSE to_timestamp(ts / 1000.0::float8) END,
           ('x' || encode(substr(p, o + 41, 4), 'hex'))::bit(32)::integer,
           ('x' || encode(substr(p, o + 45, 8), 'hex'))::bit(64)::bigint,
           CASE WHEN lsn = '0000000000000000' THEN NULL
                ELSE (substr(lsn, 1, 8) || '/' || substr(lsn, 9, 8))::pg_lsn END,
           CASE WHEN v = -9223372036854775808 THEN NULL ELSE v END,
           substr(p, o + 69, 32),
           substr(p, o + 101, 32)
    FROM generate_series(0, length(p) / 132 - 1) k,
         LATERAL (SELECT k * 132 AS o) x,
         LATERAL (SELECT ('x' || encode(substr(p, o + 33, 8), 'hex'))::bit(64)::bigint AS ts,
                         encode(substr(p, o + 53, 8), 'hex') AS lsn,
                         ('x' || encode(substr(p, o + 61, 8), 'hex'))::bit(64)::bigint AS v) f;
END
$$;

-- The view as 0036 left it, with the packed batches' receipts beside the entries. A packed
-- receipt has no evidence and no retained_at (purge unpacks a batch before it marks it).
CREATE OR REPLACE VIEW outbox.receipts AS
SELECT r.event_id, d.broker_kind, d.broker_cluster, d.topic, r.partition, r."offset",
       r.broker_timestamp, r.attempt, r.relay_generation, r.commit_lsn, b.slot_name,
       outbox.digest_text(r.payload_digest) AS payload_digest,
       outbox.digest_text(r.destination_digest) AS destination_digest,
       b.accepted_at, r.retained_at, b.accepted_xact, r.evidence, r.batch_id,
       r.aggregate_version
FROM outbox.receipt_entries r
LEFT JOIN outbox.receipt_batches b ON b.batch_id = r.batch_id
LEFT JOIN outbox.receipt_destinations d ON d.destination_id = r.destination_id
UNION ALL
SELECT u.event_id, d.broker_kind, d.broker_cluster, d.topic, u.partition, u."offset",
       u.broker_timestamp, u.attempt, u.relay_generation, u.commit_lsn, b.slot_name,
       outbox.digest_text(u.payload_digest), outbox.digest_text(u.destination_digest),
       b.accepted_at, NULL::timestamptz, b.accepted_xact, NULL::jsonb, b.batch_id,
       u.aggregate_version
FROM outbox.receipt_batches b
CROSS JOIN LATERAL outbox.packed_receipts(b.packed) u
LEFT JOIN outbox.receipt_destinations d ON d.destination_id = u.destination_id
WHERE b.packed IS NOT NULL;

-- One event's primary receipt: its entry (a key probe), else the packed batches whose id
-- range holds it (an index range scan, then those batches unpacked). The first batch wins
-- should both exist (only two slots publishing one event could do that; the audit counts it).
CREATE OR REPLACE FUNCTION outbox.receipt_of(event_id uuid) RETURNS SETOF outbox.receipts
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT * FROM (
        SELECT r.event_id, d.broker_kind, d.broker_cluster, d.topic, r.partition, r."offset",
               r.broker_timestamp, r.attempt, r.relay_generation, r.commit_lsn, b.slot_name,
               outbox.digest_text(r.payload_digest) AS payload_digest,
               outbox.digest_text(r.destination_digest) AS destination_digest,
               b.accepted_at, r.retained_at, b.accepted_xact, r.evidence, r.batch_id,
               r.aggregate_version
        FROM outbox.receipt_entries r
        LEFT JOIN outbox.receipt_batches b ON b.batch_id = r.batch_id
        LEFT JOIN outbox.receipt_destinations d ON d.destination_id = r.destination_id
        WHERE r.event_id = receipt_of.event_id
        UNION ALL
        SELECT u.event_id, d.broker_kind, d.broker_cluster, d.topic, u.partition, u."offset",
               u.broker_timestamp, u.attempt, u.relay_generation, u.commit_lsn, b.slot_name,
               outbox.digest_text(u.payload_digest), outbox.digest_text(u.destination_digest),
               b.accepted_at, NULL::timestamptz, b.accepted_xact, NULL::jsonb, b.batch_id,
               u.aggregate_version
        FROM outbox.receipt_batches b
        CROSS JOIN LATERAL outbox.packed_receipts(b.packed) u
        LEFT JOIN outbox.receipt_destinations d ON d.destination_id = u.destination_id
        WHERE b.packed IS NOT NULL AND b.last_event >= receipt_of.event_id
          AND b.first_event <= receipt_of.event_id AND u.event_id = receipt_of.event_id
    ) x
    ORDER BY x.batch_id LIMIT 1
$$;

-- The primary receipts of many events at once, as outbox.receipts has them: their entries by
-- the key, and each packed batch whose id range holds one of them unpacked once (a probe of
-- the view for a set of ids would unpack every packed batch).
CREATE FUNCTION outbox.receipts_of(ids uuid[]) RETURNS SETOF outbox.receipts
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT r.event_id, d.broker_kind, d.broker_cluster, d.topic, r.partition, r."offset",
           r.broker_timestamp, r.attempt, r.relay_generation, r.commit_lsn, b.slot_name,
           outbox.digest_text(r.payload_digest), outbox.digest_text(r.destination_digest),
           b.accepted_at, r.retained_at, b.accepted_xact, r.evidence, r.batch_id,
           r.aggregate_version
    FROM outbox.receipt_entries r
    LEFT JOIN outbox.receipt_batches b ON b.batch_id = r.batch_id
    LEFT JOIN outbox.receipt_destinations d ON d.destination_id = r.destination_id
    WHERE r.event_id = ANY(ids)
    UNION ALL
    SELECT u.event_id, d.broker_kind, d.broker_cluster, d.topic, u.partition, u."offset",
           u.broker_timestamp, u.attempt, u.relay_generation, u.commit_lsn, b.slot_name,
           outbox.digest_text(u.payload_digest), outbox.digest_text(u.destination_digest),
           b.accepted_at, NULL::timestamptz, b.accepted_xact, NULL::jsonb, b.batch_id,
           u.aggregate_version
    FROM (SELECT DISTINCT c.batch_id FROM unnest(ids) i(id)
          JOIN outbox.receipt_batches c
            ON c.packed IS NOT NULL AND c.last_event >= i.id AND c.first_event <= i.id) k
    JOIN outbox.receipt_batches b ON b.batch_id = k.batch_id
    CROSS JOIN LATERAL outbox.packed_receipts(b.packed) u
    JOIN (SELECT DISTINCT w.id FROM unnest(ids) w(id)) w ON w.id = u.event_id
    LEFT JOIN outbox.receipt_destinations d ON d.destination_id = u.destination_id
$$;

COMMENT ON FUNCTION outbox.receipts_of(uuid[]) IS
    'The primary receipts of the events ids, as outbox.receipts has them. Ask this, not the view, for a set of events: packed batches are unpacked only where their id range can hold one.';

-- Moves one packed batch's receipts into entries (keeping the batch row, its time and slot),
-- so that what changes one receipt (purge's RETAINED mark, a write through the view) changes
-- an entry. Idempotent: a batch without a packed value is left as it is.
CREATE FUNCTION outbox.unpack_receipt_batch(batch bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    INSERT INTO outbox.receipt_entries (event_id, batch_id, destination_id, partition, "offset",
                                        broker_timestamp, attempt, relay_generation, commit_lsn,
                                        payload_digest, destination_digest, aggregate_version)
    SELECT u.event_id, b.batch_id, u.destination_id, u.partition, u."offset",
           u.broker_timestamp, u.attempt, u.relay_generation, u.commit_lsn,
           u.payload_digest, u.destination_digest, u.aggregate_version
    FROM outbox.receipt_batches b CROSS JOIN LATERAL outbox.packed_receipts(b.packed) u
    WHERE b.batch_id = batch AND b.packed IS NOT NULL
    -- An entry already there is the earlier primary receipt (two slots); the packed one is
    -- dropped with the value, as the view's first-batch rule already ignored it.
    ON CONFLICT (event_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE outbox.receipt_batches SET packed = NULL, first_event = NULL, last_event = NULL
    WHERE batch_id = batch AND packed IS NOT NULL;
    RETURN n;
END
$$;

-- The view's write trigger of 0030, unpacking a packed receipt's batch before it updates or
-- deletes the receipt's entry.
CREATE OR REPLACE FUNCTION outbox.receipts_write() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    b bigint;
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE')
       AND NOT EXISTS (SELECT 1 FROM outbox.receipt_entries e WHERE e.event_id = OLD.event_id) THEN
        PERFORM outbox.unpack_receipt_batch(OLD.batch_id);
    END IF;
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
                                            payload_digest, destination_digest, evidence, retained_at)
        VALUES (NEW.event_id, b, outbox.receipt_destination(NEW.broker_kind, NEW.broker_cluster, NEW.topic),
                NEW.partition, NEW."offset", NEW.broker_timestamp, coalesce(NEW.attempt, 1),
                coalesce(NEW.relay_generation, 0), NEW.commit_lsn,
                outbox.digest_bytes(NEW.payload_digest), outbox.digest_bytes(NEW.destination_digest),
                NEW.evidence, NEW.retained_at);
    ELSE
        UPDATE outbox.receipt_entries SET
            event_id = NEW.event_id, batch_id = b,
            destination_id = outbox.receipt_destination(NEW.broker_kind, NEW.broker_cluster, NEW.topic),
            partition = NEW.partition, "offset" = NEW."offset", broker_timestamp = NEW.broker_timestamp,
            attempt = NEW.attempt, relay_generation = NEW.relay_generation, commit_lsn = NEW.commit_lsn,
            payload_digest = outbox.digest_bytes(NEW.payload_digest),
            destination_digest = outbox.digest_bytes(NEW.destination_digest),
            evidence = NEW.evidence, retained_at = NEW.retained_at
        WHERE event_id = OLD.event_id;
    END IF;
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox.receipts_write() FROM PUBLIC;
