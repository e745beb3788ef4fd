-- outboxd migration 0030: a primary receipt is a narrow entry of an acceptance batch, and
-- outbox.receipts is the view that puts an entry's batch and destination back beside it.
--
-- Why (issue 27, docs/benchmarks.md "Receipts as entries of a batch"): every drained event
-- cost the acceptance a 17-column row of ~450 bytes of WAL (two 71-byte digest strings, the
-- broker kind, cluster, topic and slot name as text, the acceptance time and transaction),
-- all of which the relay's walsender then decodes again. What is the same for every receipt
-- of one acceptance statement (slot, time, transaction) is now one row of
-- outbox.receipt_batches; a (broker kind, cluster, topic) is one row of
-- outbox.receipt_destinations, named by a 4-byte id; the digests are their 32 bytes. The
-- entry keeps what is the event's own: its position, broker time, attempt, generation, commit
-- LSN, digests, evidence, and whether purge retained it.
--
-- Meaning unchanged: one primary receipt per event (the entry's primary key), the same
-- columns under the same names in outbox.receipts (every reader reads the view; only the
-- acceptance and purge write the tables), duplicate receipts as before. Writes through the
-- view (an operator's or a test's INSERT, UPDATE, DELETE) still work, by trigger; an UPDATE of
-- a batch's column (slot, time, transaction) for one event moves that event into a batch of
-- its own, so no other receipt changes with it.
--
-- Upgrading a live database rewrites every receipt once, under this migration's lock
-- (one batch per existing receipt, so no acceptance time or transaction changes).

-- The digest `sha256:<64 hex>` as its 32 bytes; any other text (older fixtures, a future
-- algorithm) as 0x00, its UTF-8 bytes, and one more 0x00 if that would make 32 bytes, so that
-- 32 bytes always mean sha256 and the text comes back unchanged. The relay encodes the same
-- way (outbox_core::envelope::digest_bytes); a ledger test holds both to it.
CREATE FUNCTION outbox.digest_bytes(d text) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE
        WHEN d ~ '^sha256:[0-9a-f]{64}$' THEN decode(substr(d, 8), 'hex')
        WHEN length(convert_to(d, 'UTF8')) = 31 THEN '\x00'::bytea || convert_to(d, 'UTF8') || '\x00'::bytea
        ELSE '\x00'::bytea || convert_to(d, 'UTF8')
    END
$$;

CREATE FUNCTION outbox.digest_text(b bytea) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE
        WHEN length(b) = 32 THEN 'sha256:' || encode(b, 'hex')
        ELSE convert_from(rtrim(substr(b, 2), '\x00'::bytea), 'UTF8')
    END
$$;

-- Rows are never deleted (purge keeps them), so an id stays valid for a relay that cached it.
CREATE TABLE outbox.receipt_destinations (
    destination_id  integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    broker_kind     text NOT NULL,
    broker_cluster  text NOT NULL,
    topic           text NOT NULL,
    UNIQUE (broker_kind, broker_cluster, topic)
);

CREATE TABLE outbox.receipt_batches (
    batch_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    slot_name       text,
    accepted_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    accepted_xact   xid8 DEFAULT pg_current_xact_id()
);

CREATE TABLE outbox.receipt_entries (
    event_id            uuid PRIMARY KEY,
    batch_id            bigint NOT NULL,
    destination_id      integer NOT NULL,
    partition           integer NOT NULL,
    "offset"            bigint NOT NULL,
    broker_timestamp    timestamptz,
    attempt             integer NOT NULL DEFAULT 1,
    relay_generation    bigint NOT NULL DEFAULT 0,
    commit_lsn          pg_lsn,
    payload_digest      bytea NOT NULL,
    destination_digest  bytea NOT NULL,
    evidence            jsonb,
    retained_at         timestamptz,
    CONSTRAINT receipts_position_check CHECK (partition >= 0 AND "offset" >= 0)
);

-- A destination's id by its names, created on first use.
CREATE FUNCTION outbox.receipt_destination(kind text, cluster text, topic text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    id integer;
BEGIN
    INSERT INTO outbox.receipt_destinations (broker_kind, broker_cluster, topic)
    VALUES (kind, cluster, topic) ON CONFLICT DO NOTHING RETURNING destination_id INTO id;
    IF id IS NULL THEN
        SELECT d.destination_id INTO id FROM outbox.receipt_destinations d
        WHERE d.broker_kind = kind AND d.broker_cluster = cluster AND d.topic = receipt_destination.topic;
    END IF;
    RETURN id;
END
$$;

-- Every receipt accepted so far: one batch each (its own time, transaction and slot).
DO $$
DECLARE
    bad bigint;
BEGIN
    SELECT count(*) INTO bad FROM outbox.receipts
    WHERE payload_digest IS NULL OR destination_digest IS NULL;
    IF bad > 0 THEN
        RAISE EXCEPTION 'outbox.receipts holds % receipt(s) without a digest; they cannot be moved to outbox.receipt_entries', bad;
    END IF;
END
$$;

INSERT INTO outbox.receipt_destinations (broker_kind, broker_cluster, topic)
SELECT DISTINCT broker_kind, broker_cluster, topic FROM outbox.receipts;

CREATE TEMPORARY TABLE receipt_moves ON COMMIT DROP AS
SELECT r.*, row_number() OVER (ORDER BY r.accepted_at, r.event_id) AS n FROM outbox.receipts r;

INSERT INTO outbox.receipt_batches (batch_id, slot_name, accepted_at, accepted_xact)
OVERRIDING SYSTEM VALUE
SELECT n, slot_name, accepted_at, accepted_xact FROM receipt_moves;

SELECT setval(pg_get_serial_sequence('outbox.receipt_batches', 'batch_id'),
              greatest((SELECT max(n) FROM receipt_moves), 1),
              (SELECT max(n) FROM receipt_moves) IS NOT NULL);

INSERT INTO outbox.receipt_entries (event_id, batch_id, destination_id, partition, "offset",
                                    broker_timestamp, attempt, relay_generation, commit_lsn,
                                    payload_digest, destination_digest, evidence, retained_at)
SELECT m.event_id, m.n, d.destination_id, m.partition, m."offset", m.broker_timestamp,
       m.attempt, m.relay_generation, m.commit_lsn, outbox.digest_bytes(m.payload_digest),
       outbox.digest_bytes(m.destination_digest), m.evidence, m.retained_at
FROM receipt_moves m
JOIN outbox.receipt_destinations d
  ON d.broker_kind = m.broker_kind AND d.broker_cluster = m.broker_cluster AND d.topic = m.topic;

-- Views over the table (outbox.event_status, outbox.delivery_set_status, and any an operator
-- made) go with it and come back below from their own definitions, which name
-- outbox.receipts and so read the view.
CREATE TEMPORARY TABLE receipt_views ON COMMIT DROP AS
SELECT DISTINCT v.oid, quote_ident(n.nspname) || '.' || quote_ident(v.relname) AS name,
       pg_get_viewdef(v.oid) AS definition
FROM pg_depend d
JOIN pg_rewrite rw ON rw.oid = d.objid
JOIN pg_class v ON v.oid = rw.ev_class
JOIN pg_namespace n ON n.oid = v.relnamespace
WHERE d.classid = 'pg_rewrite'::regclass AND d.refobjid = 'outbox.receipts'::regclass
  AND v.oid <> 'outbox.receipts'::regclass;

-- Grants on the table and those views (docs/least_privilege.sql, docs/operator_role.sql) are
-- kept: on the views, and on the three tables for whoever could read or write receipts.
CREATE TEMPORARY TABLE receipt_grants ON COMMIT DROP AS
SELECT CASE WHEN c.oid = 'outbox.receipts'::regclass THEN 'outbox.receipts'
            ELSE (SELECT name FROM receipt_views rv WHERE rv.oid = c.oid) END AS name,
       CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee,
       a.privilege_type
FROM pg_class c
CROSS JOIN LATERAL aclexplode(c.relacl) a
LEFT JOIN pg_roles r ON r.oid = a.grantee
WHERE (c.oid = 'outbox.receipts'::regclass OR c.oid IN (SELECT oid FROM receipt_views))
  AND a.grantee <> c.relowner
  AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE');

DO $$
DECLARE
    v record;
BEGIN
    FOR v IN SELECT * FROM receipt_views LOOP
        EXECUTE format('DROP VIEW %s', v.name);
    END LOOP;
END
$$;
DROP TABLE outbox.receipts;

-- LEFT JOINs on primary keys: a reader that asks only for the event id (every EXISTS probe)
-- reads the entries' key alone, since PostgreSQL removes a left join whose columns are unused.
CREATE VIEW outbox.receipts AS
SELECT r.event_id, d.broker_kind, d.broker_cluster, d.topic, r.partition, r."offset",
       r.broker_timestamp, r.attempt, r.relay_generation, r.commit_lsn, b.slot_name,
       outbox.digest_text(r.payload_digest) AS payload_digest,
       outbox.digest_text(r.destination_digest) AS destination_digest,
       b.accepted_at, r.retained_at, b.accepted_xact, r.evidence, r.batch_id
FROM outbox.receipt_entries r
LEFT JOIN outbox.receipt_batches b ON b.batch_id = r.batch_id
LEFT JOIN outbox.receipt_destinations d ON d.destination_id = r.destination_id;

CREATE FUNCTION outbox.receipts_write() RETURNS trigger
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

CREATE TRIGGER receipts_write INSTEAD OF INSERT OR UPDATE OR DELETE ON outbox.receipts
FOR EACH ROW EXECUTE FUNCTION outbox.receipts_write();

DO $$
DECLARE
    v record;
BEGIN
    FOR v IN SELECT * FROM receipt_views ORDER BY oid LOOP
        EXECUTE format('CREATE VIEW %s AS %s', v.name, v.definition);
    END LOOP;
END
$$;

DO $$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT * FROM receipt_grants LOOP
        EXECUTE format('GRANT %s ON %s TO %s', g.privilege_type, g.name, g.grantee);
        IF g.name = 'outbox.receipts' THEN
            EXECUTE format('GRANT %s ON outbox.receipt_entries, outbox.receipt_batches, '
                           'outbox.receipt_destinations TO %s', g.privilege_type, g.grantee);
        END IF;
    END LOOP;
END
$$;
