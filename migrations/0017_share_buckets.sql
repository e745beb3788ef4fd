-- outboxd migration 0017: a share of an aggregate type's aggregates, by hash.
--
-- Migration 0014 gives each aggregate type one owner (the poller or outboxd). A team whose
-- events are nearly all of one type could then only switch everything at once. A share is now
-- an aggregate type and a bucket: `outbox.share_bucket(aggregate_id)` puts every aggregate in
-- one of 16 buckets (the first byte of the sha256 of its id, modulo 16: the same on every
-- PostgreSQL version and platform, so an aggregate never changes bucket), and
-- `outboxd share take --aggregate-type T --buckets 0-3` hands a quarter of T's aggregates to
-- outboxd. An aggregate still has exactly one owner at a time, so its order holds.
--
-- The owner of a row is the most specific share that exists: (type, its bucket), else
-- (type, whole), else ('*', whole), else the poller. Bucket -1 is the whole type.

ALTER TABLE outbox.dispatch_shares ADD COLUMN bucket int NOT NULL DEFAULT -1
    CHECK (bucket BETWEEN -1 AND 15);
ALTER TABLE outbox.dispatch_shares DROP CONSTRAINT dispatch_shares_pkey;
ALTER TABLE outbox.dispatch_shares ADD PRIMARY KEY (aggregate_type, bucket);

-- The bucket of an aggregate id, 0..15.
CREATE FUNCTION outbox.share_bucket(p_aggregate_id text) RETURNS int
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT get_byte(sha256(convert_to(p_aggregate_id, 'UTF8')), 0) % 16
$$;

-- The owner of a share (type, bucket; -1 = the whole type), as its rows see it.
CREATE FUNCTION outbox.share_owner(p_aggregate_type text, p_bucket int) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT owner FROM outbox.dispatch_shares
         WHERE aggregate_type = p_aggregate_type AND bucket = p_bucket),
        (SELECT owner FROM outbox.dispatch_shares
         WHERE aggregate_type = p_aggregate_type AND bucket = -1),
        (SELECT owner FROM outbox.dispatch_shares WHERE aggregate_type = '*' AND bucket = -1),
        'poller')
$$;

-- The owner of one aggregate's new rows.
CREATE FUNCTION outbox.dispatch_owner(p_aggregate_type text, p_aggregate_id text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT outbox.share_owner(p_aggregate_type, outbox.share_bucket(p_aggregate_id))
$$;

-- Migration 0014's by-type owner: the owner of the whole type.
CREATE OR REPLACE FUNCTION outbox.dispatch_owner(p_aggregate_type text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT outbox.share_owner(p_aggregate_type, -1)
$$;

-- Sets the owner of a share. Returns the previous owner. Moving parked rows is part of the
-- switch: to the poller on a handback.
CREATE FUNCTION outbox.set_dispatch_owner(p_aggregate_type text, p_bucket int, p_owner text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_prev text := outbox.share_owner(p_aggregate_type, p_bucket);
    a record;
BEGIN
    INSERT INTO outbox.dispatch_shares (aggregate_type, bucket, owner)
    VALUES (p_aggregate_type, p_bucket, p_owner)
    ON CONFLICT (aggregate_type, bucket) DO UPDATE SET owner = EXCLUDED.owner, changed_at = now();
    IF p_owner IN ('handback', 'poller') THEN
        FOR a IN SELECT DISTINCT aggregate_type, aggregate_id FROM outbox.parked_events
                 WHERE outbox.dispatch_owner(aggregate_type, aggregate_id) = p_owner LOOP
            PERFORM outbox.unpark_to_poller(a.aggregate_type, a.aggregate_id);
        END LOOP;
    END IF;
    RETURN v_prev;
END
$$;

-- Migration 0014's by-type switch: the whole type.
CREATE OR REPLACE FUNCTION outbox.set_dispatch_owner(p_aggregate_type text, p_owner text) RETURNS text
LANGUAGE sql AS $$
    SELECT outbox.set_dispatch_owner(p_aggregate_type, -1, p_owner)
$$;

-- As in migration 0014, with the owner of the row's aggregate instead of its type.
CREATE OR REPLACE FUNCTION outbox.poller_capture() RETURNS trigger
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

CREATE OR REPLACE FUNCTION outbox.poller_may_claim(p_id uuid) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (
        SELECT 1 FROM outbox.legacy_events l
        WHERE l.event_id = p_id
          AND outbox.dispatch_owner(l.aggregate_type, l.aggregate_id) IN ('poller', 'handover')
          AND NOT EXISTS (
              SELECT 1 FROM (SELECT e.event_id FROM outbox.events e
                             WHERE e.aggregate_type = l.aggregate_type
                               AND e.aggregate_id = l.aggregate_id
                             ORDER BY e.aggregate_version DESC LIMIT 1) newest
              WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts rc WHERE rc.event_id = newest.event_id)))
$$;

CREATE OR REPLACE FUNCTION outbox.legacy_unpublished(p_owner text) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t record;
    n bigint := 0;
    c bigint;
BEGIN
    FOR t IN SELECT * FROM outbox.poller_tables LOOP
        EXECUTE format(
            'SELECT count(*) FROM outbox.legacy_events l JOIN %s o ON o.%I = l.event_id '
            'WHERE l.source_table = $1 AND outbox.dispatch_owner(l.aggregate_type, l.aggregate_id) = $2 AND (%s)',
            t.source_table, t.id_column, t.unpublished_when)
        INTO c USING t.source_table, p_owner;
        n := n + c;
    END LOOP;
    RETURN n;
END
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue_all_parked() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    a record;
    n bigint := 0;
BEGIN
    FOR a IN SELECT aggregate_type, aggregate_id, min(seq) AS first FROM outbox.parked_events
             WHERE outbox.dispatch_owner(aggregate_type, aggregate_id) = 'outboxd'
             GROUP BY 1, 2 ORDER BY 3 LOOP
        n := n + outbox.enqueue_parked(a.aggregate_type, a.aggregate_id);
    END LOOP;
    RETURN n;
END
$$;
