-- outboxd migration 0032: outbox.aggregate_versions is UNLOGGED, and every writer of a version
-- recovers an aggregate's last version from the rows when the table has lost it.
--
-- outbox.aggregate_versions holds each aggregate's last version; outbox.enqueue updates its
-- row for every event, and that row lock is what serialises the writers of one aggregate. As a
-- logged table, every such update went to the WAL, and the walsender decoded it for every event
-- only for pgoutput to drop it (the table is in no publication): 1.2-1.4 us of the walsender's
-- 5.7-5.8 us per event on a 200,000-event backlog read over the Unix socket (docs/benchmarks.md,
-- "The version row off the WAL"). Unlogged, it writes no WAL, and nothing is decoded for it.
--
-- What an unlogged table gives up: after a crash of the server (not a clean restart), on a
-- promoted standby and in a restored base backup, it is empty. The versions themselves are not
-- lost: they are in the rows (outbox.events) and, for purged events, in their tombstones
-- (outbox.purged_events), which are logged. So:
--
-- * outbox.last_version_written(type, id) is the highest version the rows and tombstones hold
--   for an aggregate: what the table's row said before it was lost, since every version the
--   table ever gave was written into a row in the same transaction (or rolled back with it).
-- * outbox.aggregate_versions_intact, unlogged too, has its one row while the table has a row
--   for every aggregate that has a version (this migration puts it there; the loss takes it
--   with the rest). No row of an aggregate then means a new aggregate: version 1.
-- * outbox.enqueue updates the aggregate's row as before (its lock still serialises the
--   writers); only when there is no row does it insert one: at 1 while the table is intact,
--   after last_version_written once it is not. Two writers that both find no row meet on the
--   primary key: the second waits for the first and then takes the next version, as before.
--   outbox.enqueue_set and the rows written around outbox.enqueue (trigger
--   events_row_around_enqueue) do the same.
-- * outbox.restore_aggregate_versions() gives every aggregate its row back from the rows and
--   tombstones and marks the table intact again; a relay runs it when a run starts (a no-op
--   while the table is intact; a crash of the server ends every run, so a restart follows each
--   loss). Poll mode finds pending events through this table and needs it whole; the stream
--   never reads it.
--
-- A version is never given twice: a lost row is recovered from the rows committed before the
-- writer reads them, and a writer that read them is then serialised by the row it inserts.

-- Producers keep writing through this migration. ALTER TABLE ... SET UNLOGGED rewrites the
-- table under an ACCESS EXCLUSIVE lock; taken while waiting behind a producer that holds a row
-- of it, it could close a cycle (migration 0031 says how), so it is taken without waiting and
-- tried again every 10 ms, for at most 60 s.
DO $$
BEGIN
    FOR attempt IN 1..6000 LOOP
        BEGIN
            LOCK TABLE outbox.aggregate_versions IN ACCESS EXCLUSIVE MODE NOWAIT;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM pg_sleep(0.01);
        END;
    END LOOP;
    RAISE EXCEPTION 'migration 0032 could not lock outbox.aggregate_versions within 60 s: a transaction holds a row of it all along'
        USING ERRCODE = '55P03', HINT = 'find it in pg_locks (a long transaction or an idle-in-transaction session) and run outboxd migrate again';
END
$$;

ALTER TABLE outbox.aggregate_versions SET UNLOGGED;

CREATE UNLOGGED TABLE outbox.aggregate_versions_intact (
    intact boolean PRIMARY KEY DEFAULT true CHECK (intact)
);
INSERT INTO outbox.aggregate_versions_intact VALUES (true);

-- The highest version of the aggregate in outbox.events (both branches of its version index:
-- delivery set members share theirs) and outbox.purged_events, 0 when none; p_except leaves out
-- one event (the row a trigger is checking). SECURITY DEFINER: producers may not read the rows,
-- and what it answers they can read in outbox.aggregate_versions already.
-- PL/pgSQL, not SQL: a SQL function with SET is planned at every call (~100 us).
CREATE FUNCTION outbox.last_version_written(p_type text, p_id text, p_except uuid DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN greatest(
        (SELECT max(e.aggregate_version) FROM outbox.events e
         WHERE e.delivery_set_id IS NULL AND e.aggregate_type = p_type AND e.aggregate_id = p_id
           AND e.event_id IS DISTINCT FROM p_except),
        (SELECT max(e.aggregate_version) FROM outbox.events e
         WHERE e.delivery_set_id IS NOT NULL AND e.aggregate_type = p_type
           AND e.aggregate_id = p_id AND e.event_id IS DISTINCT FROM p_except),
        (SELECT max(p.aggregate_version) FROM outbox.purged_events p
         WHERE p.aggregate_type = p_type AND p.aggregate_id = p_id),
        0);
END
$$;

-- The next version of an aggregate, under its row lock (held until the caller's transaction
-- ends): for outbox.enqueue_set and the rows written around outbox.enqueue. outbox.enqueue has
-- the same two statements inline (a call costs a producer more than they do).
CREATE FUNCTION outbox.next_aggregate_version(p_type text, p_id text) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_next bigint;
BEGIN
    UPDATE outbox.aggregate_versions av SET last_version = av.last_version + 1
    WHERE av.aggregate_type = p_type AND av.aggregate_id = p_id
    RETURNING av.last_version INTO v_next;
    IF NOT FOUND THEN
        INSERT INTO outbox.aggregate_versions AS av (aggregate_type, aggregate_id, last_version)
        VALUES (p_type, p_id,
                CASE WHEN EXISTS (SELECT 1 FROM outbox.aggregate_versions_intact) THEN 1
                     ELSE outbox.last_version_written(p_type, p_id) + 1 END)
        ON CONFLICT ON CONSTRAINT aggregate_versions_pkey
        DO UPDATE SET last_version = av.last_version + 1
        RETURNING av.last_version INTO v_next;
    END IF;
    RETURN v_next;
END
$$;

-- After a loss, every aggregate without a row given one at what its rows and tombstones hold,
-- and the table marked intact in the same transaction; nothing while it is intact. A row that
-- exists was written since the loss by a writer that read the rows already, so it is left as
-- it is. Run by every relay when its run starts. A restore costs one pass over the rows, like
-- a first poll round.
--
-- Writers keep writing meanwhile, and one that enqueues for two aggregates in one transaction
-- could wait for the restore's row of one while the restore waits for its row of the other.
-- The restore must lose that race, never the producer's business transaction: it waits for no
-- lock longer than 100 ms (lock_timeout, far below deadlock_timeout), and the relay tries again.
-- Restores of several relays (shards) run one at a time (the advisory lock).
CREATE FUNCTION outbox.restore_aggregate_versions() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET lock_timeout = '100ms' AS $$
DECLARE
    n bigint;
BEGIN
    IF EXISTS (SELECT 1 FROM outbox.aggregate_versions_intact) THEN
        RETURN 0;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('outbox.restore_aggregate_versions'));
    IF EXISTS (SELECT 1 FROM outbox.aggregate_versions_intact) THEN
        RETURN 0;
    END IF;
    INSERT INTO outbox.aggregate_versions AS av (aggregate_type, aggregate_id, last_version)
    SELECT aggregate_type, aggregate_id, max(aggregate_version)
    FROM (SELECT aggregate_type, aggregate_id, aggregate_version FROM outbox.events
          UNION ALL
          SELECT aggregate_type, aggregate_id, aggregate_version FROM outbox.purged_events) w
    GROUP BY aggregate_type, aggregate_id
    ON CONFLICT ON CONSTRAINT aggregate_versions_pkey DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    INSERT INTO outbox.aggregate_versions_intact VALUES (true) ON CONFLICT DO NOTHING;
    RETURN n;
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

CREATE OR REPLACE FUNCTION outbox.enqueue_set(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    topics         text[],
    clusters       text[] DEFAULT NULL,
    completion     text   DEFAULT 'all-of',
    tenant         text   DEFAULT NULL,
    headers        jsonb  DEFAULT NULL,
    payload_schema text   DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_set     uuid := outbox.uuid_v7();
    v_version bigint;
    v_cluster text;
    v_member  uuid;
    i         int;
BEGIN
    IF coalesce(array_length(enqueue_set.topics, 1), 0) = 0 THEN
        RAISE EXCEPTION 'outbox.enqueue_set: topics must name at least one destination' USING ERRCODE = '22023';
    END IF;
    IF enqueue_set.clusters IS NOT NULL
       AND array_length(enqueue_set.clusters, 1) <> array_length(enqueue_set.topics, 1) THEN
        RAISE EXCEPTION 'outbox.enqueue_set: clusters must have one entry per topic' USING ERRCODE = '22023';
    END IF;
    IF coalesce(enqueue_set.aggregate_type, '') = '' OR coalesce(enqueue_set.aggregate_id, '') = ''
       OR coalesce(enqueue_set.event_type, '') = '' OR enqueue_set.payload IS NULL THEN
        RAISE EXCEPTION 'outbox.enqueue_set: aggregate_type, aggregate_id, event_type and payload are required' USING ERRCODE = '22023';
    END IF;

    v_version := outbox.next_aggregate_version(enqueue_set.aggregate_type, enqueue_set.aggregate_id);

    INSERT INTO outbox.delivery_sets (delivery_set_id, completion, targets)
    VALUES (v_set, enqueue_set.completion, array_length(enqueue_set.topics, 1));

    FOR i IN 1 .. array_length(enqueue_set.topics, 1) LOOP
        v_cluster := coalesce(enqueue_set.clusters[i], 'default');
        v_member := outbox.uuid_v7();
        -- Not a row around outbox.enqueue (trigger events_row_around_enqueue).
        PERFORM set_config('outbox.enqueuing', v_member::text, true);
        INSERT INTO outbox.events (
            event_id, envelope_generation, aggregate_type, aggregate_id, aggregate_version,
            event_type, payload_schema, payload, payload_digest, tenant, headers,
            dest_kind, dest_cluster, dest_topic, dest_key, dest_partitioner,
            dest_route_generation, dest_serializer, dest_acks, destination_digest, delivery_set_id)
        VALUES (
            v_member, 1, enqueue_set.aggregate_type, enqueue_set.aggregate_id, v_version,
            enqueue_set.event_type, enqueue_set.payload_schema, enqueue_set.payload,
            outbox.sha256_text(enqueue_set.payload::text), enqueue_set.tenant, enqueue_set.headers,
            'kafka', v_cluster, enqueue_set.topics[i], enqueue_set.aggregate_id, 'murmur2_random',
            0, 'json', 'all',
            outbox.sha256_text(outbox.destination_canonical(
                'kafka', v_cluster, enqueue_set.topics[i], enqueue_set.aggregate_id,
                'murmur2_random', 0, 'json', 'all')),
            v_set);
    END LOOP;
    RETURN v_set;
END
$$;

-- As in migration 0031, with the aggregate's last version recovered from the rows when the
-- table has no row for it.
CREATE OR REPLACE FUNCTION outbox.note_row_around_enqueue() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_last bigint;
    v_kind text;
    v_template text;
BEGIN
    IF TG_RELID <> 'outbox.events'::regclass OR TG_WHEN <> 'AFTER' OR TG_OP <> 'INSERT'
       OR TG_LEVEL <> 'ROW' THEN
        RAISE EXCEPTION 'outbox.note_row_around_enqueue fired on %.% (trigger %); it serves outbox.events only, and nothing was recorded',
            TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_NAME
            USING ERRCODE = '42501',
                  HINT = 'it is the trigger events_row_around_enqueue of outbox.events (migration 0016); do not attach it elsewhere';
    END IF;
    IF NOT ((NEW.route_version IS NULL
             AND NEW.dest_kind IS NOT NULL AND NEW.dest_cluster IS NOT NULL
             AND NEW.dest_topic IS NOT NULL AND NEW.dest_key IS NOT NULL
             AND NEW.dest_partitioner IS NOT NULL AND NEW.dest_route_generation IS NOT NULL
             AND NEW.dest_serializer IS NOT NULL AND NEW.dest_acks IS NOT NULL)
            OR (NEW.route_version IS NOT NULL
             AND NEW.dest_kind IS NULL AND NEW.dest_cluster IS NULL AND NEW.dest_topic IS NULL
             AND NEW.dest_key IS NULL AND NEW.dest_partitioner IS NULL
             AND NEW.dest_route_generation IS NULL AND NEW.dest_serializer IS NULL
             AND NEW.dest_acks IS NULL AND NEW.destination_digest IS NULL)) THEN
        RAISE EXCEPTION 'outbox.events: event % has neither a whole frozen destination (all eight dest_* columns, no route_version) nor a route version alone (route_version, every dest_* column and destination_digest NULL)',
            NEW.event_id
            USING ERRCODE = '23514',
                  HINT = 'insert events through outbox.enqueue, which writes the route version in force';
    END IF;
    IF NEW.route_version IS NOT NULL THEN
        SELECT kind, topic_template INTO v_kind, v_template
        FROM outbox.route_versions WHERE version_id = NEW.route_version;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'outbox.events: event % names route version %, which does not exist in outbox.route_versions',
                NEW.event_id, NEW.route_version
                USING ERRCODE = '23503';
        END IF;
        PERFORM outbox.render_destination(v_kind, v_template, NEW.aggregate_type, NEW.aggregate_id);
    END IF;
    SELECT last_version INTO v_last FROM outbox.aggregate_versions
    WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id
    FOR UPDATE;
    IF NOT FOUND AND NOT EXISTS (SELECT 1 FROM outbox.aggregate_versions_intact) THEN
        -- The unlogged table was emptied: the last version is in the rows (this one left out)
        -- and tombstones; NULL when there is none, as for a new aggregate.
        v_last := nullif(outbox.last_version_written(NEW.aggregate_type, NEW.aggregate_id,
                                                     NEW.event_id), 0);
    END IF;
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


-- Who may call what (migration 0021: no SECURITY DEFINER function of schema outbox is
-- PUBLIC's): whoever may take versions (producers) the two that give them, and the mark; a
-- relay (whoever keeps poll positions) the restore.
REVOKE EXECUTE ON FUNCTION outbox.last_version_written(text, text, uuid),
                           outbox.next_aggregate_version(text, text),
                           outbox.restore_aggregate_versions() FROM PUBLIC;
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
             WHERE table_schema = 'outbox' AND table_name = 'aggregate_versions'
               AND privilege_type = 'UPDATE' AND grantee <> current_user LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION outbox.last_version_written(text, text, uuid), outbox.next_aggregate_version(text, text) TO %I', g.grantee);
        EXECUTE format('GRANT SELECT ON outbox.aggregate_versions_intact TO %I', g.grantee);
    END LOOP;
    FOR g IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
             WHERE table_schema = 'outbox' AND table_name = 'poll_positions'
               AND privilege_type = 'INSERT' AND grantee <> current_user LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION outbox.restore_aggregate_versions() TO %I', g.grantee);
    END LOOP;
END
$$;
