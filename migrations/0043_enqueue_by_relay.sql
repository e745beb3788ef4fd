-- outboxd migration 0043: outbox.enqueue leaves the version and the route to the relay where
-- the outbox takes plain INSERTs.
--
-- Why (issue 27, docs/benchmarks.md, "outbox.enqueue where the relay numbers"): a writer's
-- outbox.enqueue ran at 0.42-0.48x of a plain outbox INSERT's TPS; most of it is the version
-- row's upsert (a second row, locked until the transaction ends) and the route's lookup. Where
-- the outbox's owner has allowed plain INSERTs (migration 0039), the relay numbers rows
-- without a version in commit order and routes them by the policy in force at their commit
-- (docs/versions_by_relay.md), so outbox.enqueue there writes what a plain INSERT writes: the
-- envelope, checked, with no version and no route version. Its callers keep their function,
-- its checks and its answer (the event id); what they no longer get is the version and route
-- version in their own transaction (read them from the receipt, `outboxd status --event`), and
-- a destination that cannot be placed is quarantined by the relay instead of refused in the
-- writer's transaction.
--
-- Which way enqueue writes is outbox.writes_by_relay(), a constant that
-- outbox.allow_plain_inserts rewrites: planned into enqueue's cached plan as a constant and
-- invalidated with the function (a session that called enqueue before the switch writes the
-- new way after it), so the choice costs a call no lookup. allow_plain_inserts changes
-- outbox.events under an ACCESS
-- EXCLUSIVE lock, so every transaction that wrote a version commits before the first row
-- without one: an aggregate written through enqueue before the switch continues after its
-- highest version (the relay seeds its numbering from it, outbox_ledger::numbering).

CREATE FUNCTION outbox.writes_by_relay() RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT false $$;

DO $$
BEGIN
    -- An outbox that already takes plain INSERTs (0039) writes by the relay from now on: as
    -- the switch does, after every transaction that wrote to it (outbox.enqueue gave versions
    -- until now), and before any that writes next.
    IF EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = 'outbox.events'::regclass AND attname = 'aggregate_version'
                 AND NOT attnotnull) THEN
        LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
        CREATE OR REPLACE FUNCTION outbox.writes_by_relay() RETURNS boolean
        LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $f$ SELECT true $f$;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    tenant         text  DEFAULT NULL,
    headers        jsonb DEFAULT NULL,
    payload_schema text  DEFAULT NULL,
    event_id       uuid  DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id        uuid := coalesce(enqueue.event_id, outbox.uuid_v7());
    v_version   bigint;
    v_kind      text;
    v_topic     text;
    v_next      bigint;
BEGIN
    IF coalesce(enqueue.aggregate_type, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: aggregate_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF coalesce(enqueue.aggregate_id, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: aggregate_id must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF coalesce(enqueue.event_type, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: event_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox.enqueue: payload must not be NULL (use ''{}''::jsonb for an empty payload)' USING ERRCODE = '22004';
    END IF;
    IF enqueue.headers IS NOT NULL AND jsonb_typeof(enqueue.headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox.enqueue: headers must be a JSON object of strings, got %', jsonb_typeof(enqueue.headers) USING ERRCODE = '22023';
    END IF;

    -- The relay numbers and routes (outbox.allow_plain_inserts(true)): the row a plain INSERT
    -- writes, with enqueue's checks and optional columns.
    IF outbox.writes_by_relay() THEN
        INSERT INTO outbox.events (
            event_id, aggregate_type, aggregate_id, event_type, payload_schema, payload, tenant,
            headers)
        VALUES (
            v_id, enqueue.aggregate_type, enqueue.aggregate_id, enqueue.event_type,
            enqueue.payload_schema, enqueue.payload, enqueue.tenant, enqueue.headers);
        RETURN v_id;
    END IF;

    -- The route: as outbox.route_template chooses it; version 0 without a policy row.
    SELECT rp.route_version, rp.broker_kind, rp.topic
      INTO v_version, v_kind, v_topic
    FROM outbox.route_policy rp
    WHERE rp.active
      AND (rp.aggregate_type IS NULL OR rp.aggregate_type = enqueue.aggregate_type)
      AND (rp.event_type IS NULL OR rp.event_type = enqueue.event_type)
    ORDER BY (rp.aggregate_type IS NOT NULL) DESC, (rp.event_type IS NOT NULL) DESC,
             rp.priority DESC, rp.generation DESC
    LIMIT 1;
    IF NOT FOUND THEN
        v_version := 0; v_kind := 'kafka'; v_topic := 'outbox.event.{aggregate_type}';
    END IF;

    -- The destination is the relay's to render from the version; here it is only checked, so
    -- a value that cannot be placed is refused in the producer's transaction (migration
    -- 0022). The default template with a plain aggregate type needs no check (migration 0023).
    IF NOT (v_kind = 'kafka' AND v_topic = 'outbox.event.{aggregate_type}'
            AND length(enqueue.aggregate_type) <= 236
            AND enqueue.aggregate_type !~ '[^A-Za-z0-9._-]') THEN
        PERFORM outbox.render_destination(v_kind, v_topic, enqueue.aggregate_type, enqueue.aggregate_id);
    END IF;

    -- The next version, under the aggregate's row lock, held until the producing transaction
    -- ends: it serialises the writers of one aggregate (migration 0001). Without a row: 1
    -- while the table is intact, else after the highest version the rows hold
    -- (outbox.next_aggregate_version, inline).
    UPDATE outbox.aggregate_versions av SET last_version = av.last_version + 1
    WHERE av.aggregate_type = enqueue.aggregate_type AND av.aggregate_id = enqueue.aggregate_id
    RETURNING av.last_version INTO v_next;
    IF NOT FOUND THEN
        INSERT INTO outbox.aggregate_versions AS av (aggregate_type, aggregate_id, last_version)
        VALUES (enqueue.aggregate_type, enqueue.aggregate_id,
                CASE WHEN EXISTS (SELECT 1 FROM outbox.aggregate_versions_intact) THEN 1
                     ELSE outbox.last_version_written(enqueue.aggregate_type,
                                                      enqueue.aggregate_id) + 1 END)
        ON CONFLICT ON CONSTRAINT aggregate_versions_pkey
        DO UPDATE SET last_version = av.last_version + 1
        RETURNING av.last_version INTO v_next;
    END IF;

    -- Not a row around outbox.enqueue (trigger events_row_around_enqueue). The digests are the
    -- relay's (migration 0027).
    PERFORM set_config('outbox.enqueuing', v_id::text, true);
    INSERT INTO outbox.events (
        event_id, aggregate_type, aggregate_id, aggregate_version,
        event_type, payload_schema, payload, tenant, headers, route_version)
    VALUES (
        v_id, enqueue.aggregate_type, enqueue.aggregate_id, v_next,
        enqueue.event_type, enqueue.payload_schema, enqueue.payload,
        enqueue.tenant, enqueue.headers, v_version);
    RETURN v_id;
END
$$;

-- As in 0039, and: the outbox is locked first (the switch waits for every transaction that
-- wrote to it, and holds back every writer until it commits), outbox.writes_by_relay() is
-- rewritten, and a switch back rebuilds outbox.aggregate_versions from the rows and the
-- tombstones (0032's restore): the relay numbered past what the table last gave, and the
-- next outbox.enqueue must continue after the relay's versions.
CREATE OR REPLACE FUNCTION outbox.allow_plain_inserts(allow boolean) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
    IF allow THEN
        ALTER TABLE outbox.events ALTER COLUMN aggregate_version DROP NOT NULL;
        DROP TRIGGER IF EXISTS events_row_around_enqueue ON outbox.events;
        -- The rows' key (aggregate, version) holds no row without a version: such a row has
        -- no version to keep unique, and its entry, at a random place in a large index, cost
        -- the fast path a quarter of its throughput (docs/benchmarks.md, "The writer's plain
        -- INSERT, built"). Rebuilt once; writers wait while it is built.
        IF NOT EXISTS (SELECT 1 FROM pg_indexes
                       WHERE schemaname = 'outbox' AND indexname = 'events_aggregate_version_key'
                         AND indexdef LIKE '%(aggregate_version IS NOT NULL)%') THEN
            CREATE UNIQUE INDEX events_aggregate_version_key_versioned
                ON outbox.events (aggregate_type, aggregate_id, aggregate_version)
                WHERE delivery_set_id IS NULL AND aggregate_version IS NOT NULL;
            DROP INDEX outbox.events_aggregate_version_key;
            ALTER INDEX outbox.events_aggregate_version_key_versioned
                RENAME TO events_aggregate_version_key;
        END IF;
        CREATE OR REPLACE FUNCTION outbox.writes_by_relay() RETURNS boolean
        LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $f$ SELECT true $f$;
        RETURN 'outbox.events takes plain INSERTs (aggregate_type, aggregate_id, event_type, payload), and outbox.enqueue writes such rows; a relay in CDC mode numbers and routes them; poll mode refuses this outbox';
    END IF;
    ALTER TABLE outbox.events ALTER COLUMN aggregate_version SET NOT NULL;
    DROP TRIGGER IF EXISTS events_row_around_enqueue ON outbox.events;
    CREATE TRIGGER events_row_around_enqueue
        AFTER INSERT ON outbox.events
        FOR EACH ROW
        WHEN (NEW.aggregate_version IS NOT NULL
              AND NEW.event_id::text IS DISTINCT FROM current_setting('outbox.enqueuing', true))
        EXECUTE FUNCTION outbox.note_row_around_enqueue();
    IF outbox.writes_by_relay() THEN
        DELETE FROM outbox.aggregate_versions_intact;
        TRUNCATE outbox.aggregate_versions;
        PERFORM outbox.restore_aggregate_versions();
    END IF;
    CREATE OR REPLACE FUNCTION outbox.writes_by_relay() RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $f$ SELECT false $f$;
    RETURN 'outbox.events takes events through outbox.enqueue (or rows with a version and a destination) only';
END
$$;
REVOKE EXECUTE ON FUNCTION outbox.allow_plain_inserts(boolean) FROM PUBLIC;
