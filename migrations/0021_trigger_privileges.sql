-- outboxd migration 0021: trigger and helper functions only their own triggers can use.
--
-- The capture triggers (migrations 0009, 0014/0017) and the rows-around-enqueue trigger
-- (migration 0016) run with their owner's rights (SECURITY DEFINER), so that a producer needs
-- no privilege on schema outbox. PostgreSQL lets every role EXECUTE a new function, and it
-- checks EXECUTE on a trigger function only when a trigger is created, never when it fires.
-- So any role with USAGE on schema outbox (the relay's, a poller's) could create a TEMP table,
-- put one of these functions on it as a trigger and insert a row: a made-up event in
-- outbox.events, a made-up legacy record, or an aggregate version raised to any value with a
-- hold on it. This migration closes that twice over:
--
-- * EXECUTE is revoked from PUBLIC on every SECURITY DEFINER function and every trigger
--   function of schema outbox. Only the schema owner (and superusers) can create a trigger
--   with them; the triggers the owner installed keep firing (firing checks no privilege).
--   outbox.poller_may_claim stays callable by the roles it was granted to explicitly
--   (docs/least_privilege.sql: GRANT EXECUTE ... TO app_poller).
-- * Each trigger function checks that it fires on a table registered for it, with the
--   arguments it was registered with, as an AFTER INSERT ROW trigger, and raises
--   insufficient_privilege (42501) naming the table and the fix otherwise:
--     outbox.debezium_capture    a table in outbox.debezium_tables (new here, kept by
--                                install/uninstall_debezium_capture; existing installations are
--                                recorded from their triggers below)
--     outbox.poller_capture      a table in outbox.poller_tables (install_poller_capture)
--     outbox.note_row_around_enqueue  outbox.events only

-- The tables outbox.install_debezium_capture attached, and the columns it reads.
CREATE TABLE outbox.debezium_tables (
    source_table         regclass PRIMARY KEY,
    id_column            text NOT NULL,
    aggregatetype_column text NOT NULL,
    aggregateid_column   text NOT NULL,
    type_column          text NOT NULL,
    payload_column       text NOT NULL,
    installed_at         timestamptz NOT NULL DEFAULT now()
);

-- Installations made before this migration: their triggers say which table and columns. Only
-- the trigger install_debezium_capture creates (its name), on a permanent table.
INSERT INTO outbox.debezium_tables (source_table, id_column, aggregatetype_column,
                                    aggregateid_column, type_column, payload_column)
SELECT t.tgrelid, a[1], a[2], a[3], a[4], a[5]
FROM pg_trigger t
JOIN pg_class c ON c.oid = t.tgrelid,
LATERAL (SELECT array_agg(replace(x, '\\', '\') ORDER BY n) AS a
         FROM unnest(string_to_array(encode(t.tgargs, 'escape'), '\000'))
              WITH ORDINALITY AS u(x, n)) args
WHERE t.tgfoid = 'outbox.debezium_capture()'::regprocedure
  AND t.tgname = 'outboxd_debezium_capture'
  AND t.tgnargs = 5
  AND c.relpersistence <> 't'
ON CONFLICT (source_table) DO NOTHING;

CREATE OR REPLACE FUNCTION outbox.install_debezium_capture(
    p_table              regclass,
    id_column            text DEFAULT 'id',
    aggregatetype_column text DEFAULT 'aggregatetype',
    aggregateid_column   text DEFAULT 'aggregateid',
    type_column          text DEFAULT 'type',
    payload_column       text DEFAULT 'payload'
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    c text;
BEGIN
    FOREACH c IN ARRAY ARRAY[id_column, aggregatetype_column, aggregateid_column, type_column, payload_column] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_attribute
                       WHERE attrelid = p_table AND attname = c AND attnum > 0 AND NOT attisdropped) THEN
            RAISE EXCEPTION 'outbox.install_debezium_capture: table % has no column %', p_table, c
                USING ERRCODE = '42703',
                      HINT = 'pass the column names: outbox.install_debezium_capture(''schema.table'', id_column => ..., aggregatetype_column => ..., aggregateid_column => ..., type_column => ..., payload_column => ...)';
        END IF;
    END LOOP;
    IF (SELECT relpersistence FROM pg_class WHERE oid = p_table) = 't' THEN
        RAISE EXCEPTION 'outbox.install_debezium_capture: % is a temporary table; capture only a permanent outbox table', p_table
            USING ERRCODE = '42809';
    END IF;
    INSERT INTO outbox.debezium_tables (source_table, id_column, aggregatetype_column,
                                        aggregateid_column, type_column, payload_column)
    VALUES (p_table, id_column, aggregatetype_column, aggregateid_column, type_column, payload_column)
    ON CONFLICT (source_table) DO UPDATE SET
        id_column = EXCLUDED.id_column, aggregatetype_column = EXCLUDED.aggregatetype_column,
        aggregateid_column = EXCLUDED.aggregateid_column, type_column = EXCLUDED.type_column,
        payload_column = EXCLUDED.payload_column, installed_at = now();
    EXECUTE format('DROP TRIGGER IF EXISTS outboxd_debezium_capture ON %s', p_table);
    EXECUTE format(
        'CREATE TRIGGER outboxd_debezium_capture AFTER INSERT ON %s FOR EACH ROW '
        'EXECUTE FUNCTION outbox.debezium_capture(%L, %L, %L, %L, %L)',
        p_table, id_column, aggregatetype_column, aggregateid_column, type_column, payload_column);
    RETURN format('capturing inserts into %s as outbox events (topic outbox.event.<%s>, key %s, header id = %s)',
                  p_table, aggregatetype_column, aggregateid_column, id_column);
END
$$;

CREATE OR REPLACE FUNCTION outbox.uninstall_debezium_capture(p_table regclass) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('DROP TRIGGER IF EXISTS outboxd_debezium_capture ON %s', p_table);
    DELETE FROM outbox.debezium_tables WHERE source_table = p_table;
END
$$;

-- As in migration 0009, first checking that it fires where install_debezium_capture put it.
CREATE OR REPLACE FUNCTION outbox.debezium_capture() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r         jsonb;
    v_id      uuid;
    v_payload jsonb;
    v_headers jsonb;
BEGIN
    IF TG_WHEN <> 'AFTER' OR TG_OP <> 'INSERT' OR TG_LEVEL <> 'ROW' OR TG_NARGS <> 5
       OR NOT EXISTS (SELECT 1 FROM outbox.debezium_tables d
                      WHERE d.source_table = TG_RELID
                        AND d.id_column = TG_ARGV[0] AND d.aggregatetype_column = TG_ARGV[1]
                        AND d.aggregateid_column = TG_ARGV[2] AND d.type_column = TG_ARGV[3]
                        AND d.payload_column = TG_ARGV[4]) THEN
        RAISE EXCEPTION 'outbox.debezium_capture fired on %.% (trigger %), which is not a table registered for it with these columns; nothing was captured',
            TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_NAME
            USING ERRCODE = '42501',
                  HINT = 'attach an outbox table as the schema owner with outbox.install_debezium_capture(''schema.table'', ...) (or outboxd migrate --debezium-table); it records the table in outbox.debezium_tables';
    END IF;
    r := to_jsonb(NEW);
    IF r ->> TG_ARGV[0] IS NULL THEN
        RAISE EXCEPTION 'outboxd Debezium capture on %: column % (the event id) is NULL', TG_TABLE_NAME, TG_ARGV[0]
            USING ERRCODE = '23502';
    END IF;
    v_id := (r ->> TG_ARGV[0])::uuid;
    -- The same id inserted again (a producer retrying after insert-then-delete): the event
    -- already exists and keeps its first version; consumers deduplicate by id in any case.
    IF EXISTS (SELECT 1 FROM outbox.events WHERE event_id = v_id) THEN
        RETURN NULL;
    END IF;
    -- jsonb/json columns arrive as JSON; a text column holding JSON is parsed; NULL (a
    -- Debezium tombstone) becomes JSON null.
    v_payload := coalesce(r -> TG_ARGV[4], 'null'::jsonb);
    IF jsonb_typeof(v_payload) = 'string' THEN
        BEGIN
            v_payload := (v_payload #>> '{}')::jsonb;
        EXCEPTION WHEN invalid_text_representation THEN
            NULL; -- not JSON text: published as a JSON string
        END;
    END IF;
    -- W3C trace context columns, if the table has them, become Kafka headers.
    v_headers := jsonb_strip_nulls(jsonb_build_object(
        'traceparent', r ->> 'traceparent', 'tracestate', r ->> 'tracestate'));
    PERFORM outbox.enqueue(
        r ->> TG_ARGV[1], r ->> TG_ARGV[2], r ->> TG_ARGV[3], v_payload,
        headers  => nullif(v_headers, '{}'::jsonb),
        event_id => v_id);
    RETURN NULL;
END
$$;

-- As in migration 0017, first checking that it fires where install_poller_capture put it.
CREATE OR REPLACE FUNCTION outbox.poller_capture() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r         jsonb;
    v_id      uuid;
    v_type    text;
    v_agg     text;
    v_event   text;
    v_payload jsonb;
    v_headers jsonb;
    v_owner   text;
BEGIN
    IF TG_WHEN <> 'AFTER' OR TG_OP <> 'INSERT' OR TG_LEVEL <> 'ROW' OR TG_NARGS <> 5
       OR NOT EXISTS (SELECT 1 FROM outbox.poller_tables p
                      WHERE p.source_table = TG_RELID
                        AND p.id_column = TG_ARGV[0] AND p.aggregatetype_column = TG_ARGV[1]
                        AND p.aggregateid_column = TG_ARGV[2] AND p.type_column = TG_ARGV[3]
                        AND p.payload_column = TG_ARGV[4]) THEN
        RAISE EXCEPTION 'outbox.poller_capture fired on %.% (trigger %), which is not a table registered for it with these columns; nothing was captured',
            TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_NAME
            USING ERRCODE = '42501',
                  HINT = 'attach a poller''s outbox table as the schema owner with outboxd migrate --poller-table (outbox.install_poller_capture); it records the table in outbox.poller_tables';
    END IF;
    r := to_jsonb(NEW);
    v_type := r ->> TG_ARGV[1];
    v_agg := r ->> TG_ARGV[2];
    v_event := r ->> TG_ARGV[3];
    IF r ->> TG_ARGV[0] IS NULL THEN
        RAISE EXCEPTION 'outboxd poller-table capture on %: column % (the event id) is NULL', TG_TABLE_NAME, TG_ARGV[0]
            USING ERRCODE = '23502';
    END IF;
    v_id := (r ->> TG_ARGV[0])::uuid;
    IF coalesce(v_type, '') = '' OR coalesce(v_agg, '') = '' OR coalesce(v_event, '') = '' THEN
        RAISE EXCEPTION 'outboxd poller-table capture on %: row % has an empty aggregate type, aggregate id or event type (columns %, %, %)',
            TG_TABLE_NAME, v_id, TG_ARGV[1], TG_ARGV[2], TG_ARGV[3] USING ERRCODE = '23502';
    END IF;
    -- The same id inserted again: the first capture stands.
    IF EXISTS (SELECT 1 FROM outbox.events WHERE event_id = v_id)
       OR EXISTS (SELECT 1 FROM outbox.legacy_events WHERE event_id = v_id)
       OR EXISTS (SELECT 1 FROM outbox.parked_events WHERE event_id = v_id) THEN
        RETURN NULL;
    END IF;
    v_payload := coalesce(r -> TG_ARGV[4], 'null'::jsonb);
    IF jsonb_typeof(v_payload) = 'string' THEN
        BEGIN
            v_payload := (v_payload #>> '{}')::jsonb;
        EXCEPTION WHEN invalid_text_representation THEN
            NULL; -- not JSON text: published as a JSON string
        END;
    END IF;
    v_headers := nullif(jsonb_strip_nulls(jsonb_build_object(
        'traceparent', r ->> 'traceparent', 'tracestate', r ->> 'tracestate')), '{}'::jsonb);

    v_owner := outbox.dispatch_owner(v_type, v_agg);
    IF v_owner = 'outboxd' THEN
        -- Rows parked during the handover go first, then this one: the aggregate's order.
        PERFORM outbox.enqueue_parked(v_type, v_agg);
        PERFORM outbox.enqueue(v_type, v_agg, v_event, v_payload,
                               headers => v_headers, event_id => v_id);
    ELSIF v_owner = 'handover' THEN
        INSERT INTO outbox.parked_events (event_id, source_table, aggregate_type, aggregate_id,
                                          event_type, payload, headers)
        VALUES (v_id, TG_RELID, v_type, v_agg, v_event, v_payload, v_headers);
    ELSE
        IF v_owner = 'handback' THEN
            PERFORM outbox.unpark_to_poller(v_type, v_agg);
        END IF;
        INSERT INTO outbox.legacy_events (event_id, source_table, aggregate_type, aggregate_id,
                                          event_type, payload_digest)
        VALUES (v_id, TG_RELID, v_type, v_agg, v_event, outbox.sha256_text(v_payload::text));
    END IF;
    RETURN NULL;
END
$$;

-- As in migration 0016, first checking that it fires on outbox.events.
CREATE OR REPLACE FUNCTION outbox.note_row_around_enqueue() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_last bigint;
BEGIN
    IF TG_RELID <> 'outbox.events'::regclass OR TG_WHEN <> 'AFTER' OR TG_OP <> 'INSERT'
       OR TG_LEVEL <> 'ROW' THEN
        RAISE EXCEPTION 'outbox.note_row_around_enqueue fired on %.% (trigger %); it serves outbox.events only, and nothing was recorded',
            TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_NAME
            USING ERRCODE = '42501',
                  HINT = 'it is the trigger events_row_around_enqueue of outbox.events (migration 0016); do not attach it elsewhere';
    END IF;
    SELECT last_version INTO v_last FROM outbox.aggregate_versions
    WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id
    FOR UPDATE;
    -- A version at or below the last one, outside a delivery set (whose members share theirs),
    -- can only reuse a purged version: it would be published out of order, or never.
    IF NEW.aggregate_version <= v_last AND NEW.delivery_set_id IS NULL THEN
        RAISE EXCEPTION 'outbox.events: event % reuses version % of aggregate %/% (its last version is %); insert events through outbox.enqueue, which gives the next version',
            NEW.event_id, NEW.aggregate_version, NEW.aggregate_type, NEW.aggregate_id, v_last
            USING ERRCODE = '22023';
    END IF;
    IF NEW.aggregate_version > coalesce(v_last, 0) + 1 THEN
        INSERT INTO outbox.holds (aggregate_type, aggregate_id, reason_code, reason,
                                  blocking_event_id, blocking_version)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 'version_gap',
                format('version gap in aggregate %s/%s: expected version %s, got %s (event %s, written into outbox.events around outbox.enqueue); the aggregate is held instead of publishing past the gap',
                       NEW.aggregate_type, NEW.aggregate_id, coalesce(v_last, 0) + 1,
                       NEW.aggregate_version, NEW.event_id),
                NEW.event_id, NEW.aggregate_version)
        ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING;
    END IF;
    INSERT INTO outbox.aggregate_versions AS v (aggregate_type, aggregate_id, last_version)
    VALUES (NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_version)
    ON CONFLICT ON CONSTRAINT aggregate_versions_pkey
    DO UPDATE SET last_version = EXCLUDED.last_version WHERE v.last_version < EXCLUDED.last_version;
    RETURN NULL;
END
$$;

-- No role but the owner may put these functions on a table, or call them: every SECURITY
-- DEFINER function and every trigger function of schema outbox (today debezium_capture,
-- poller_capture, note_row_around_enqueue and poller_may_claim). Grants made to named roles
-- (GRANT EXECUTE ON FUNCTION outbox.poller_may_claim(uuid) TO app_poller) stay.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_proc p
             WHERE p.pronamespace = 'outbox'::regnamespace
               AND (p.prosecdef OR p.prorettype = 'trigger'::regtype) LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;
