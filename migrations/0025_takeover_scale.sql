-- outboxd migration 0025: a taken row stops costing the poller, a take proves the poller
-- respects ownership first, and outboxd's messages say where the aggregate's numbering starts.
--
-- 1. Rows outboxd owns left `unpublished_when` true for good, so after a take every claim of
--    the poller checked outbox.poller_may_claim() against all of them (linear: ~7 s a poll at a
--    million rows). outbox.poller_tables gets `mark_published`, an SQL assignment over the
--    team's table (e.g. `published_at = now()`) that takes a row out of the poller's
--    unpublished set. The capture trigger applies it to a row in the same call that enqueues
--    the row for outboxd (the producer's transaction), and outbox.enqueue_parked to a parked
--    row when it is enqueued: a row is marked exactly when it becomes outbox.events', never
--    while it may still become the poller's (parked rows go back to the poller on a cancelled
--    handover). The poller's claim then skips taken rows through its own partial index
--    (`WHERE published_at IS NULL`). For attachments made before this migration the
--    assignment is derived when `unpublished_when` is `<column> IS NULL` over a date/time
--    column; `outboxd migrate --poller-table ... ` again sets it (and marks the rows outboxd
--    already owns).
-- 2. `outboxd share take` / `give-back` first insert a canary row into the team's table, a row
--    nobody owns (it is in outbox.poller_canaries: the capture records it nowhere, and
--    poller_may_claim is false for it). poller_may_claim counts each time it is asked about a
--    canary in a sequence (nextval is not rolled back with a poller's empty claim): asked and
--    not claimed means the claim goes through the predicate; claimed (marked, or row-locked)
--    means it does not, and the switch is refused before any owner changes.
-- 3. Header `poller_events_before` on every event enqueued from a poller table: how many rows
--    of the event's aggregate the poller owned (outbox.legacy_events) before it. outboxd's
--    aggregate_version counts outboxd's events of the aggregate only; aggregate_version +
--    poller_events_before is the event's position in the aggregate's whole history since the
--    attach, which a consumer can follow across take and give-back.

ALTER TABLE outbox.poller_tables ADD COLUMN mark_published text;

-- Attachments made before: `"col" IS NULL` over a date/time column is marked `col = now()`.
UPDATE outbox.poller_tables t
SET mark_published = format('%I = now()', a.attname)
FROM pg_attribute a
WHERE a.attrelid = t.source_table AND a.attnum > 0 AND NOT a.attisdropped
  AND t.mark_published IS NULL
  AND t.unpublished_when IN (format('%I IS NULL', a.attname), a.attname || ' IS NULL',
                             '"' || replace(a.attname, '"', '""') || '" IS NULL')
  AND a.atttypid IN ('timestamptz'::regtype, 'timestamp'::regtype, 'date'::regtype);

-- Marks one row of an attached table published (its mark_published assignment), if it is
-- still unpublished and the table has an assignment. Taken rows only: the callers are the
-- capture trigger (a row enqueued for outboxd) and enqueue_parked.
CREATE FUNCTION outbox.mark_taken(p_table regclass, p_id uuid) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t      record;
    v_type text;
BEGIN
    SELECT * INTO t FROM outbox.poller_tables WHERE source_table = p_table;
    IF NOT FOUND OR t.mark_published IS NULL THEN
        RETURN;
    END IF;
    SELECT format_type(a.atttypid, a.atttypmod) INTO v_type FROM pg_attribute a
    WHERE a.attrelid = p_table AND a.attname = t.id_column AND a.attnum > 0 AND NOT a.attisdropped;
    -- outboxd's rows only: whoever calls it, a row the poller owns is never marked.
    IF NOT EXISTS (SELECT 1 FROM outbox.events WHERE event_id = p_id) THEN
        RETURN;
    END IF;
    -- By the id's index: the unpublished check is wrapped in a CASE, so the planner cannot
    -- pick the poller's partial index (WHERE published_at IS NULL), whose statistics say it
    -- is nearly empty while it holds every row inserted since the last vacuum.
    EXECUTE format('UPDATE %s SET %s WHERE %I = $1::text::%s AND CASE WHEN (%s) THEN true ELSE false END',
                   p_table, t.mark_published, t.id_column, v_type, t.unpublished_when)
    USING p_id;
END
$$;

-- How many rows of an aggregate the poller owned, cached per aggregate (counted once per
-- take of the aggregate, not once per event): a new legacy record of the aggregate drops its
-- line (trigger below).
CREATE TABLE outbox.poller_event_counts (
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    events         bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

CREATE FUNCTION outbox.poller_events_of(p_aggregate_type text, p_aggregate_id text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    SELECT events INTO n FROM outbox.poller_event_counts
    WHERE aggregate_type = p_aggregate_type AND aggregate_id = p_aggregate_id;
    IF NOT FOUND THEN
        SELECT count(*) INTO n FROM outbox.legacy_events
        WHERE aggregate_type = p_aggregate_type AND aggregate_id = p_aggregate_id;
        INSERT INTO outbox.poller_event_counts (aggregate_type, aggregate_id, events)
        VALUES (p_aggregate_type, p_aggregate_id, n)
        ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING;
    END IF;
    RETURN n;
END
$$;

CREATE FUNCTION outbox.forget_poller_event_count() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_RELID <> 'outbox.legacy_events'::regclass OR TG_WHEN <> 'AFTER' OR TG_OP <> 'INSERT'
       OR TG_LEVEL <> 'ROW' THEN
        RAISE EXCEPTION 'outbox.forget_poller_event_count fired on %.% (trigger %); it serves outbox.legacy_events only',
            TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_NAME
            USING ERRCODE = '42501',
                  HINT = 'it is the trigger legacy_events_forget_count of outbox.legacy_events (migration 0025); do not attach it elsewhere';
    END IF;
    DELETE FROM outbox.poller_event_counts
    WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id;
    RETURN NULL;
END
$$;
CREATE TRIGGER legacy_events_forget_count AFTER INSERT ON outbox.legacy_events
    FOR EACH ROW EXECUTE FUNCTION outbox.forget_poller_event_count();

-- The headers of an event enqueued from a poller table: the row's, plus poller_events_before.
CREATE FUNCTION outbox.poller_row_headers(p_headers jsonb, p_aggregate_type text, p_aggregate_id text)
RETURNS jsonb
LANGUAGE sql AS $$
    SELECT coalesce(p_headers, '{}'::jsonb)
           || jsonb_build_object('poller_events_before',
                                 outbox.poller_events_of(p_aggregate_type, p_aggregate_id)::text)
$$;

-- Canary rows of `share take` / `give-back`: owned by nobody.
CREATE TABLE outbox.poller_canaries (
    event_id       uuid PRIMARY KEY,
    source_table   regclass NOT NULL,
    aggregate_type text NOT NULL,
    -- outbox.poller_canary_asks after the canary was inserted: a later value means a claim
    -- asked poller_may_claim about a canary.
    asks_before    bigint NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE SEQUENCE outbox.poller_canary_asks;

-- Inserts a canary row of p_aggregate_type into the attached table p_table. Returns its id.
CREATE FUNCTION outbox.poller_canary_start(p_table regclass, p_aggregate_type text) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t    record;
    v_id uuid := gen_random_uuid();
BEGIN
    SELECT * INTO t FROM outbox.poller_tables WHERE source_table = p_table;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox.poller_canary_start: % is not an attached poller table', p_table
            USING ERRCODE = '42P01', HINT = 'attach it with outboxd migrate --poller-table';
    END IF;
    INSERT INTO outbox.poller_canaries (event_id, source_table, aggregate_type, asks_before)
    VALUES (v_id, p_table, p_aggregate_type, nextval('outbox.poller_canary_asks'));
    -- Literals, not parameters: each is read as its column's type (jsonb, json, text, ...).
    EXECUTE format('INSERT INTO %s (%I, %I, %I, %I, %I) VALUES (%L, %L, %L, %L, %L)',
                   p_table, t.id_column, t.aggregatetype_column, t.aggregateid_column,
                   t.type_column, t.payload_column,
                   v_id, p_aggregate_type, 'outboxd-canary-' || v_id, 'outboxd.ownership_canary',
                   '{"outboxd_canary": "a row no relay may publish: outboxd share checks that the poller''s claim skips it"}');
    RETURN v_id;
END
$$;

-- Where a canary stands: 'claimed' (the poller marked it, deleted it or holds its row lock:
-- its claim does not go through poller_may_claim), 'respected' (a claim asked
-- poller_may_claim about a canary since it was inserted and left it), or 'waiting'.
CREATE FUNCTION outbox.poller_canary_state(p_id uuid) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c      record;
    t      record;
    v_type text;
    v_row  record;
    v_asks bigint;
BEGIN
    SELECT * INTO c FROM outbox.poller_canaries WHERE event_id = p_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox.poller_canary_state: no canary %', p_id USING ERRCODE = 'P0002';
    END IF;
    SELECT * INTO t FROM outbox.poller_tables WHERE source_table = c.source_table;
    SELECT format_type(a.atttypid, a.atttypmod) INTO v_type FROM pg_attribute a
    WHERE a.attrelid = c.source_table AND a.attname = t.id_column AND a.attnum > 0;
    SELECT last_value INTO v_asks FROM outbox.poller_canary_asks;
    -- Unlocked rows only: a canary locked by another transaction is being claimed.
    EXECUTE format('SELECT (%s) AS unpublished FROM %s WHERE %I = $1::text::%s FOR UPDATE SKIP LOCKED',
                   t.unpublished_when, c.source_table, t.id_column, v_type)
    INTO v_row USING p_id;
    IF v_row IS NULL OR NOT coalesce(v_row.unpublished, false) THEN
        RETURN 'claimed';
    END IF;
    IF v_asks > c.asks_before THEN
        RETURN 'respected';
    END IF;
    RETURN 'waiting';
END
$$;

-- Removes a canary: its row from the team's table (waiting up to 10 s for a poller that holds
-- it) and its record.
CREATE FUNCTION outbox.poller_canary_end(p_id uuid) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET lock_timeout = '10s' AS $$
DECLARE
    c      record;
    t      record;
    v_type text;
BEGIN
    SELECT * INTO c FROM outbox.poller_canaries WHERE event_id = p_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO t FROM outbox.poller_tables WHERE source_table = c.source_table;
    IF FOUND THEN
        SELECT format_type(a.atttypid, a.atttypmod) INTO v_type FROM pg_attribute a
        WHERE a.attrelid = c.source_table AND a.attname = t.id_column AND a.attnum > 0;
        -- The canary row only (its event type and aggregate id), whatever poller_canaries says.
        EXECUTE format('DELETE FROM %s WHERE %I = $1::text::%s AND %I = $2 AND %I = $3',
                       c.source_table, t.id_column, v_type, t.type_column, t.aggregateid_column)
        USING p_id, 'outboxd.ownership_canary', 'outboxd-canary-' || p_id;
    END IF;
    DELETE FROM outbox.poller_canaries WHERE event_id = p_id;
END
$$;

-- As in migration 0017, and asked about a canary: counts the question, answers false. STABLE,
-- as before: every row of one claim is judged on the claim's snapshot. (VOLATILE would take a
-- new snapshot per row: a receipt committing mid-claim would let row k+1 of an aggregate pass
-- after row k was held back, and the claim would publish k+1 first. nextval needs no
-- VOLATILE: a sequence is not written under the snapshot.)
CREATE OR REPLACE FUNCTION outbox.poller_may_claim(p_id uuid) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox.poller_canaries c WHERE c.event_id = p_id) THEN
        PERFORM nextval('outbox.poller_canary_asks');
        RETURN false;
    END IF;
    RETURN EXISTS (
        SELECT 1 FROM outbox.legacy_events l
        WHERE l.event_id = p_id
          AND outbox.dispatch_owner(l.aggregate_type, l.aggregate_id) IN ('poller', 'handover')
          AND NOT EXISTS (
              SELECT 1 FROM (SELECT e.event_id FROM outbox.events e
                             WHERE e.aggregate_type = l.aggregate_type
                               AND e.aggregate_id = l.aggregate_id
                             ORDER BY e.aggregate_version DESC LIMIT 1) newest
              WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts rc WHERE rc.event_id = newest.event_id)));
END
$$;

-- As in migration 0014, each enqueued row marked taken and told its poller_events_before.
CREATE OR REPLACE FUNCTION outbox.enqueue_parked(p_aggregate_type text, p_aggregate_id text) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    p record;
    n int := 0;
BEGIN
    FOR p IN SELECT * FROM outbox.parked_events
             WHERE aggregate_type = p_aggregate_type AND aggregate_id = p_aggregate_id
             ORDER BY seq FOR UPDATE
    LOOP
        PERFORM outbox.enqueue(p.aggregate_type, p.aggregate_id, p.event_type, p.payload,
                               headers => outbox.poller_row_headers(p.headers, p.aggregate_type, p.aggregate_id),
                               event_id => p.event_id);
        DELETE FROM outbox.parked_events WHERE seq = p.seq;
        PERFORM outbox.mark_taken(p.source_table, p.event_id);
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;

-- As in migration 0021, with canaries captured nowhere, and rows enqueued for outboxd marked
-- taken and told their poller_events_before.
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
    -- The same id inserted again: the first capture stands. A canary of `outboxd share` is
    -- nobody's.
    IF EXISTS (SELECT 1 FROM outbox.events WHERE event_id = v_id)
       OR EXISTS (SELECT 1 FROM outbox.legacy_events WHERE event_id = v_id)
       OR EXISTS (SELECT 1 FROM outbox.parked_events WHERE event_id = v_id)
       OR EXISTS (SELECT 1 FROM outbox.poller_canaries WHERE event_id = v_id) THEN
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
                               headers => outbox.poller_row_headers(v_headers, v_type, v_agg),
                               event_id => v_id);
        -- outboxd's for good: out of the poller's unpublished set (and its claim's scan).
        PERFORM outbox.mark_taken(TG_RELID, v_id);
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

-- Migration 0014's attach, with the assignment that marks a taken row (NULL: none), and rows
-- outboxd already owns (enqueued or parked) and canaries not recorded as the poller's; the
-- unpublished rows outboxd has enqueued are marked.
DROP FUNCTION outbox.install_poller_capture(regclass, text, text, text, text, text, text);
CREATE FUNCTION outbox.install_poller_capture(
    p_table              regclass,
    unpublished_when     text,
    id_column            text DEFAULT 'id',
    aggregatetype_column text DEFAULT 'aggregatetype',
    aggregateid_column   text DEFAULT 'aggregateid',
    type_column          text DEFAULT 'type',
    payload_column       text DEFAULT 'payload',
    mark_published       text DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    c      text;
    n      bigint;
    m      bigint := 0;
    v_type text;
BEGIN
    FOREACH c IN ARRAY ARRAY[id_column, aggregatetype_column, aggregateid_column, type_column, payload_column] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_attribute
                       WHERE attrelid = p_table AND attname = c AND attnum > 0 AND NOT attisdropped) THEN
            RAISE EXCEPTION 'outbox.install_poller_capture: table % has no column %', p_table, c
                USING ERRCODE = '42703',
                      HINT = 'name the columns: --id-column, --aggregatetype-column, --aggregateid-column, --type-column, --payload-column';
        END IF;
    END LOOP;
    BEGIN
        EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %s WHERE (%s) LIMIT 1) x', p_table, unpublished_when);
    EXCEPTION WHEN OTHERS THEN
        RAISE EXCEPTION 'outbox.install_poller_capture: "%" is not a boolean expression over %: %', unpublished_when, p_table, SQLERRM
            USING ERRCODE = '42601', HINT = 'e.g. --published-column published_at, or --unpublished-when "status = ''NEW''"';
    END;
    IF mark_published IS NOT NULL THEN
        BEGIN
            EXECUTE format('UPDATE %s SET %s WHERE false', p_table, mark_published);
        EXCEPTION WHEN OTHERS THEN
            RAISE EXCEPTION 'outbox.install_poller_capture: "%" is not an assignment over % (UPDATE ... SET <it>): %', mark_published, p_table, SQLERRM
                USING ERRCODE = '42601',
                      HINT = 'e.g. --mark-published "published_at = now()" or "status = ''SENT''": what the poller sets when it has published a row';
        END;
    END IF;
    INSERT INTO outbox.poller_tables (source_table, id_column, aggregatetype_column,
                                      aggregateid_column, type_column, payload_column,
                                      unpublished_when, mark_published)
    VALUES (p_table, id_column, aggregatetype_column, aggregateid_column, type_column,
            payload_column, unpublished_when, mark_published)
    ON CONFLICT (source_table) DO UPDATE SET
        id_column = EXCLUDED.id_column, aggregatetype_column = EXCLUDED.aggregatetype_column,
        aggregateid_column = EXCLUDED.aggregateid_column, type_column = EXCLUDED.type_column,
        payload_column = EXCLUDED.payload_column, unpublished_when = EXCLUDED.unpublished_when,
        mark_published = EXCLUDED.mark_published;
    EXECUTE format('DROP TRIGGER IF EXISTS outboxd_poller_capture ON %s', p_table);
    EXECUTE format(
        'CREATE TRIGGER outboxd_poller_capture AFTER INSERT ON %s FOR EACH ROW '
        'EXECUTE FUNCTION outbox.poller_capture(%L, %L, %L, %L, %L)',
        p_table, id_column, aggregatetype_column, aggregateid_column, type_column, payload_column);
    EXECUTE format(
        'INSERT INTO outbox.legacy_events (event_id, source_table, aggregate_type, aggregate_id, '
        '                                  event_type, payload_digest, before_attach) '
        'SELECT o.%I::uuid, $1, o.%I, o.%I, o.%I, outbox.sha256_text(to_jsonb(o.%I)::text), true FROM %s o '
        'WHERE NOT EXISTS (SELECT 1 FROM outbox.events e WHERE e.event_id = o.%I::uuid) '
        '  AND NOT EXISTS (SELECT 1 FROM outbox.parked_events p WHERE p.event_id = o.%I::uuid) '
        '  AND NOT EXISTS (SELECT 1 FROM outbox.poller_canaries k WHERE k.event_id = o.%I::uuid) '
        'ON CONFLICT (event_id) DO NOTHING',
        id_column, aggregatetype_column, aggregateid_column, type_column, payload_column,
        p_table, id_column, id_column, id_column)
    USING p_table;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF mark_published IS NOT NULL THEN
        EXECUTE format(
            'UPDATE %s o SET %s WHERE (%s) AND EXISTS (SELECT 1 FROM outbox.events e WHERE e.event_id = o.%I::uuid)',
            p_table, mark_published, unpublished_when, id_column);
        GET DIAGNOSTICS m = ROW_COUNT;
    END IF;
    RETURN format('attached %s: %s existing row(s) recorded as the poller''s; new rows go to the owner of their aggregate type (outboxd share list); %s',
                  p_table, n,
                  CASE WHEN mark_published IS NULL
                       THEN 'rows outboxd takes stay unpublished in the table (no --mark-published): the poller''s claim keeps checking them'
                       ELSE format('rows outboxd takes are marked with SET %s (%s row(s) it had taken marked now)', mark_published, m) END);
END
$$;

-- As migration 0021 does: no role but the owner may call the new owner's-rights and trigger
-- functions.
REVOKE EXECUTE ON FUNCTION outbox.mark_taken(regclass, uuid) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox.forget_poller_event_count() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox.poller_canary_start(regclass, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox.poller_canary_state(uuid) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox.poller_canary_end(uuid) FROM PUBLIC;
