-- outboxd migration 0014: replacing a polling relay without a flag day.
--
-- A team has its own outbox table and its own poller (claim unpublished rows with
-- FOR UPDATE SKIP LOCKED, publish, mark them). Producers must not change. outboxd attaches to
-- that table with an AFTER INSERT trigger (as in the Debezium mode, migration 0009) and
-- decides, in the producer's own transaction, who owns each new row:
--
--   owner of the row's aggregate type   the row becomes
--   poller                              an outbox.legacy_events record: the poller publishes
--                                       it; outboxd only watches (`outboxd shadow`)
--   handover (poller -> outboxd)        an outbox.parked_events row: nobody publishes it yet;
--                                       the poller finishes the rows it owns first
--   outboxd                             an outbox.events row (outbox.enqueue, event id = the
--                                       row's id): the relay publishes it with every ledger
--                                       guarantee
--   handback (outboxd -> poller)        an outbox.legacy_events record the poller may not
--                                       claim yet
--
-- Ownership is frozen per row when the row is inserted, so no row is ever owned by both: the
-- poller's claim query adds `AND outbox.poller_may_claim(id)` (true only for legacy records),
-- and outboxd publishes only outbox.events. Ownership is per aggregate type (or '*' for every
-- type without a row of its own), never per event type: per-aggregate order needs one owner
-- per aggregate at a time. The two transitional states keep that order across a switch:
--   * handover parks new rows until the poller has marked every row of the type it owns
--     (`outboxd share take` waits for it), then enqueues the parked rows in insertion order;
--   * handback keeps new rows from the poller until every producer transaction that may still
--     enqueue under the old owner has ended, and poller_may_claim holds an aggregate back
--     while its newest outboxd event has no receipt.
-- Switches wait for in-flight producer transactions by their xids (pg_current_snapshot), never
-- by locking producers out. docs/migrating.md walks through it.

-- The attached tables and how to read them.
CREATE TABLE outbox.poller_tables (
    source_table         regclass PRIMARY KEY,
    id_column            text NOT NULL,
    aggregatetype_column text NOT NULL,
    aggregateid_column   text NOT NULL,
    type_column          text NOT NULL,
    payload_column       text NOT NULL,
    -- A boolean SQL expression over the table's columns that is true while the poller has
    -- not published the row, e.g. "published_at IS NULL" or "status = 'NEW'".
    unpublished_when     text NOT NULL,
    attached_at          timestamptz NOT NULL DEFAULT now()
);

-- Who dispatches each aggregate type. '*' covers every type without a row of its own.
CREATE TABLE outbox.dispatch_shares (
    aggregate_type text PRIMARY KEY,
    owner          text NOT NULL CHECK (owner IN ('poller', 'handover', 'outboxd', 'handback')),
    changed_at     timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox.dispatch_shares (aggregate_type, owner) VALUES ('*', 'poller');

-- Rows the poller owns: what the shadow reconciles against the broker.
CREATE TABLE outbox.legacy_events (
    event_id       uuid PRIMARY KEY,
    source_table   regclass NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    event_type     text NOT NULL,
    -- sha256 of the payload's jsonb text, as outbox.enqueue computes payload_digest.
    payload_digest text NOT NULL,
    captured_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Already in the table when outboxd attached (published or not, the poller's).
    before_attach  boolean NOT NULL DEFAULT false
);
CREATE INDEX legacy_events_aggregate_idx ON outbox.legacy_events (aggregate_type, aggregate_id);

-- Rows captured during a handover: outboxd's, enqueued when the poller has drained the type.
CREATE TABLE outbox.parked_events (
    seq            bigserial PRIMARY KEY,
    event_id       uuid NOT NULL UNIQUE,
    source_table   regclass NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    event_type     text NOT NULL,
    payload        jsonb NOT NULL,
    headers        jsonb,
    parked_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX parked_events_aggregate_idx ON outbox.parked_events (aggregate_type, aggregate_id, seq);

-- What `outboxd shadow` found on the broker: one row per message carrying an event id.
CREATE TABLE outbox.shadow_observations (
    topic          text NOT NULL,
    partition      int NOT NULL,
    "offset"       bigint NOT NULL,
    event_id       uuid NOT NULL,
    message_key    text,
    -- sha256 of the value parsed as JSON and printed as jsonb text; NULL when not JSON.
    payload_digest text,
    broker_time    timestamptz,
    -- The message carries outboxd's envelope headers (sent by the relay, not the poller).
    by_outboxd     boolean NOT NULL,
    observed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition, "offset")
);
CREATE INDEX shadow_observations_event_idx ON outbox.shadow_observations (event_id);

-- Where the shadow goes on reading.
CREATE TABLE outbox.shadow_offsets (
    topic       text NOT NULL,
    partition   int NOT NULL,
    next_offset bigint NOT NULL,
    PRIMARY KEY (topic, partition)
);

CREATE FUNCTION outbox.dispatch_owner(p_aggregate_type text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT owner FROM outbox.dispatch_shares WHERE aggregate_type = p_aggregate_type),
        (SELECT owner FROM outbox.dispatch_shares WHERE aggregate_type = '*'),
        'poller')
$$;

-- sha256 of a message value read as JSON, printed as jsonb text; NULL when it is not JSON.
CREATE FUNCTION outbox.json_text_digest(t text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN outbox.sha256_text(t::jsonb::text);
EXCEPTION WHEN OTHERS THEN
    RETURN NULL;
END
$$;

-- Enqueues the parked rows of one aggregate (all of them, in insertion order) under their row
-- locks: a concurrent sweep of the same rows waits, then finds them gone.
CREATE FUNCTION outbox.enqueue_parked(p_aggregate_type text, p_aggregate_id text) RETURNS int
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
                               headers => p.headers, event_id => p.event_id);
        DELETE FROM outbox.parked_events WHERE seq = p.seq;
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;

-- Hands the parked rows of one aggregate to the poller (a handback during a handover).
CREATE FUNCTION outbox.unpark_to_poller(p_aggregate_type text, p_aggregate_id text) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    n int;
BEGIN
    WITH gone AS (
        DELETE FROM outbox.parked_events
        WHERE aggregate_type = p_aggregate_type AND aggregate_id = p_aggregate_id
        RETURNING *
    )
    INSERT INTO outbox.legacy_events (event_id, source_table, aggregate_type, aggregate_id,
                                      event_type, payload_digest, captured_at)
    SELECT event_id, source_table, aggregate_type, aggregate_id, event_type,
           outbox.sha256_text(payload::text), parked_at
    FROM gone
    ON CONFLICT (event_id) DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- The capture trigger. Arguments: the id, aggregate type, aggregate id, event type and payload
-- column names. SECURITY DEFINER: producers need no privilege on schema outbox.
CREATE FUNCTION outbox.poller_capture() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r         jsonb := to_jsonb(NEW);
    v_id      uuid;
    v_type    text := r ->> TG_ARGV[1];
    v_agg     text := r ->> TG_ARGV[2];
    v_event   text := r ->> TG_ARGV[3];
    v_payload jsonb;
    v_headers jsonb;
    v_owner   text;
BEGIN
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

    v_owner := outbox.dispatch_owner(v_type);
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

-- The predicate for the poller's claim query: `... WHERE <unpublished> AND
-- outbox.poller_may_claim(id) ... FOR UPDATE SKIP LOCKED`. True only for a row the poller
-- owns, whose aggregate type is not being handed back, and whose aggregate has nothing of
-- outboxd's still to publish (its newest outbox event has a receipt). Parked rows of the
-- aggregate are newer than its legacy rows (a handback turns parked rows into legacy ones),
-- so they do not hold the poller back: during a handover it must drain exactly these rows.
CREATE FUNCTION outbox.poller_may_claim(p_id uuid) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (
        SELECT 1 FROM outbox.legacy_events l
        WHERE l.event_id = p_id
          AND outbox.dispatch_owner(l.aggregate_type) IN ('poller', 'handover')
          AND NOT EXISTS (
              SELECT 1 FROM (SELECT e.event_id FROM outbox.events e
                             WHERE e.aggregate_type = l.aggregate_type
                               AND e.aggregate_id = l.aggregate_id
                             ORDER BY e.aggregate_version DESC LIMIT 1) newest
              WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts rc WHERE rc.event_id = newest.event_id)))
$$;

-- Legacy rows the poller has not published yet, of aggregate types whose owner is p_owner
-- (a row deleted from the team's table counts as published).
CREATE FUNCTION outbox.legacy_unpublished(p_owner text) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t record;
    n bigint := 0;
    c bigint;
BEGIN
    FOR t IN SELECT * FROM outbox.poller_tables LOOP
        EXECUTE format(
            'SELECT count(*) FROM outbox.legacy_events l JOIN %s o ON o.%I = l.event_id '
            'WHERE l.source_table = $1 AND outbox.dispatch_owner(l.aggregate_type) = $2 AND (%s)',
            t.source_table, t.id_column, t.unpublished_when)
        INTO c USING t.source_table, p_owner;
        n := n + c;
    END LOOP;
    RETURN n;
END
$$;

-- Per legacy record: has the poller marked it published (or deleted the row)?
CREATE FUNCTION outbox.legacy_marked() RETURNS TABLE (event_id uuid, marked boolean)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT * FROM outbox.poller_tables LOOP
        RETURN QUERY EXECUTE format(
            'SELECT l.event_id, NOT coalesce((SELECT (%s) FROM %s o WHERE o.%I = l.event_id), false) '
            'FROM outbox.legacy_events l WHERE l.source_table = $1',
            t.unpublished_when, t.source_table, t.id_column)
        USING t.source_table;
    END LOOP;
END
$$;

-- Attaches a poller's outbox table: checks the columns, records it, records the rows already
-- there as the poller's (published or not), and installs the capture trigger, all in one
-- transaction (CREATE TRIGGER blocks inserts meanwhile, so no row is missed or seen twice).
CREATE FUNCTION outbox.install_poller_capture(
    p_table              regclass,
    unpublished_when     text,
    id_column            text DEFAULT 'id',
    aggregatetype_column text DEFAULT 'aggregatetype',
    aggregateid_column   text DEFAULT 'aggregateid',
    type_column          text DEFAULT 'type',
    payload_column       text DEFAULT 'payload'
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    c text;
    n bigint;
BEGIN
    FOREACH c IN ARRAY ARRAY[id_column, aggregatetype_column, aggregateid_column, type_column, payload_column] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_attribute
                       WHERE attrelid = p_table AND attname = c AND attnum > 0 AND NOT attisdropped) THEN
            RAISE EXCEPTION 'outbox.install_poller_capture: table % has no column %', p_table, c
                USING ERRCODE = '42703',
                      HINT = 'name the columns: --id-column, --aggregatetype-column, --aggregateid-column, --type-column, --payload-column';
        END IF;
    END LOOP;
    -- The unpublished predicate must be valid SQL over the table.
    BEGIN
        EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %s WHERE (%s) LIMIT 1) x', p_table, unpublished_when);
    EXCEPTION WHEN OTHERS THEN
        RAISE EXCEPTION 'outbox.install_poller_capture: "%" is not a boolean expression over %: %', unpublished_when, p_table, SQLERRM
            USING ERRCODE = '42601', HINT = 'e.g. --published-column published_at, or --unpublished-when "status = ''NEW''"';
    END;
    INSERT INTO outbox.poller_tables (source_table, id_column, aggregatetype_column,
                                      aggregateid_column, type_column, payload_column, unpublished_when)
    VALUES (p_table, id_column, aggregatetype_column, aggregateid_column, type_column,
            payload_column, unpublished_when)
    ON CONFLICT (source_table) DO UPDATE SET
        id_column = EXCLUDED.id_column, aggregatetype_column = EXCLUDED.aggregatetype_column,
        aggregateid_column = EXCLUDED.aggregateid_column, type_column = EXCLUDED.type_column,
        payload_column = EXCLUDED.payload_column, unpublished_when = EXCLUDED.unpublished_when;
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
        'ON CONFLICT (event_id) DO NOTHING',
        id_column, aggregatetype_column, aggregateid_column, type_column, payload_column,
        p_table, id_column)
    USING p_table;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN format('attached %s: %s existing row(s) recorded as the poller''s; new rows go to the owner of their aggregate type (outboxd share list)',
                  p_table, n);
END
$$;

-- Sets the owner of an aggregate type ('*' = every type without its own row). Returns the
-- previous owner. Moving parked rows is part of the switch: to the poller on a handback.
CREATE FUNCTION outbox.set_dispatch_owner(p_aggregate_type text, p_owner text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_prev text := outbox.dispatch_owner(p_aggregate_type);
    a record;
BEGIN
    INSERT INTO outbox.dispatch_shares (aggregate_type, owner) VALUES (p_aggregate_type, p_owner)
    ON CONFLICT (aggregate_type) DO UPDATE SET owner = EXCLUDED.owner, changed_at = now();
    IF p_owner IN ('handback', 'poller') THEN
        FOR a IN SELECT DISTINCT aggregate_type, aggregate_id FROM outbox.parked_events
                 WHERE outbox.dispatch_owner(aggregate_type) = p_owner LOOP
            PERFORM outbox.unpark_to_poller(a.aggregate_type, a.aggregate_id);
        END LOOP;
    END IF;
    RETURN v_prev;
END
$$;

-- Enqueues every parked row whose type outboxd now owns, aggregate by aggregate.
CREATE FUNCTION outbox.enqueue_all_parked() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    a record;
    n bigint := 0;
BEGIN
    FOR a IN SELECT aggregate_type, aggregate_id, min(seq) AS first FROM outbox.parked_events
             WHERE outbox.dispatch_owner(aggregate_type) = 'outboxd'
             GROUP BY 1, 2 ORDER BY 3 LOOP
        n := n + outbox.enqueue_parked(a.aggregate_type, a.aggregate_id);
    END LOOP;
    RETURN n;
END
$$;

-- Whether every transaction in progress when `snap` was taken has ended: after a switch, no
-- producer can still capture a row under the previous owner.
CREATE FUNCTION outbox.snapshot_settled(snap pg_snapshot) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(bool_and(pg_xact_status(x) IS DISTINCT FROM 'in progress'), true)
    FROM pg_snapshot_xip(snap) x
$$;

-- The shadow's per-event view of the legacy records: what the broker holds for each.
CREATE FUNCTION outbox.shadow_events() RETURNS TABLE (
    event_id uuid, before_attach boolean, marked boolean, captured_at timestamptz,
    copies bigint, outboxd_copies bigint, key_mismatches bigint, payload_mismatches bigint,
    first_broker_time timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT l.event_id, l.before_attach, m.marked, l.captured_at,
           count(o.event_id) FILTER (WHERE NOT o.by_outboxd),
           count(o.event_id) FILTER (WHERE o.by_outboxd),
           count(o.event_id) FILTER (WHERE o.message_key IS DISTINCT FROM l.aggregate_id),
           count(o.event_id) FILTER (WHERE o.payload_digest IS DISTINCT FROM l.payload_digest),
           min(o.broker_time) FILTER (WHERE NOT o.by_outboxd)
    FROM outbox.legacy_events l
    JOIN outbox.legacy_marked() m ON m.event_id = l.event_id
    LEFT JOIN outbox.shadow_observations o ON o.event_id = l.event_id
    GROUP BY l.event_id, l.before_attach, m.marked, l.captured_at
$$;
