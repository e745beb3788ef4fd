-- outboxd migration 0009: Debezium-compatible capture.
--
-- A team coming from Debezium's outbox event router keeps its producers and its consumers.
-- Producers go on inserting (and, as Debezium recommends, often deleting right away) rows of
-- their own outbox table: id, aggregatetype, aggregateid, type, payload. An AFTER INSERT
-- trigger on that table enqueues each row into outbox.events, in the producer's transaction,
-- with event id = the row's id. So:
--   * the event commits or rolls back with the business change, exactly like outbox.enqueue();
--   * every ledger guarantee applies (frozen destination, aggregate version, receipts, dedup by
--     id, the confirmed LSN never passing an unaccepted event);
--   * the producer's DELETE does not touch outbox.events (the publication only reads inserts
--     of outbox.events; the Debezium table is not published at all);
--   * the default route is Debezium's topic naming, outbox.event.<aggregatetype>; the Kafka
--     key is aggregateid and header `id` the row's id, as the Debezium router sends them.
--
-- Install on a table with outbox.install_debezium_capture('app.outbox') (or
-- `outboxd migrate --debezium-table app.outbox`); column names can be overridden, like the
-- router's table.field.event.* options.

-- The trigger. Arguments: id, aggregatetype, aggregateid, type and payload column names.
-- SECURITY DEFINER: producers need no privilege on schema outbox, only on their own table.
CREATE FUNCTION outbox.debezium_capture() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r         jsonb := to_jsonb(NEW);
    v_id      uuid;
    v_payload jsonb;
    v_headers jsonb;
BEGIN
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

-- Installs (or re-installs) the capture trigger on a Debezium-style outbox table. Checks that
-- the named columns exist, so a typo fails here and not in a producer's transaction.
CREATE FUNCTION outbox.install_debezium_capture(
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
    EXECUTE format('DROP TRIGGER IF EXISTS outboxd_debezium_capture ON %s', p_table);
    EXECUTE format(
        'CREATE TRIGGER outboxd_debezium_capture AFTER INSERT ON %s FOR EACH ROW '
        'EXECUTE FUNCTION outbox.debezium_capture(%L, %L, %L, %L, %L)',
        p_table, id_column, aggregatetype_column, aggregateid_column, type_column, payload_column);
    RETURN format('capturing inserts into %s as outbox events (topic outbox.event.<%s>, key %s, header id = %s)',
                  p_table, aggregatetype_column, aggregateid_column, id_column);
END
$$;

CREATE FUNCTION outbox.uninstall_debezium_capture(p_table regclass) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('DROP TRIGGER IF EXISTS outboxd_debezium_capture ON %s', p_table);
END
$$;
