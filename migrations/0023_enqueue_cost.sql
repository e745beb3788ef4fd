-- outboxd migration 0023: what outbox.enqueue costs a writer, with the same row.
--
-- A profile of outbox.enqueue under pgbench (one event per transaction, the producer phase of
-- `outbox-embedded bench`, docs/benchmarks.md "Producer") found most of its time outside its
-- own statements, in two helper functions that PostgreSQL prepared again in every transaction:
--
--   outbox.sha256_text    a SQL-language function, called twice per event. It is not inlined
--                         (its body calls convert_to, which is STABLE, and the function is
--                         IMMUTABLE), so every call went through the SQL-function executor,
--                         whose parsed body lives only as long as the calling expression's
--                         state: once per transaction, ~8-10 us per call.
--   outbox.route_template a set-returning PL/pgSQL function (RETURN QUERY of a UNION ALL with
--                         a sort): ~11-13 us per call, the call itself most of it.
--
-- Neither changes what an event is. sha256_text becomes PL/pgSQL (its expression is prepared
-- once per session); enqueue reads the route with one query of its own (the same choice as
-- route_template: the most specific active route, then priority, then the newest generation;
-- the built-in default when none matches) and renders the default Kafka topic
-- 'outbox.event.{aggregate_type}' without a call when the aggregate type is a legal topic part
-- (every other template still goes through outbox.render_destination, which checks it), and it
-- takes the version and inserts the row in one statement. The row, its digests, the errors and
-- their codes are the same as migration 0022's; tests in crates/outbox-ledger/tests/ledger.rs
-- compare the two functions event by event.
--
-- Measured (pgbench, 1 client, single-statement transactions; pg_stat_user_functions):
-- ~105-117 us per outbox.enqueue call before, ~55 us after.

CREATE OR REPLACE FUNCTION outbox.sha256_text(t text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT AS $$
BEGIN
    RETURN 'sha256:' || encode(sha256(convert_to(t, 'UTF8')), 'hex');
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
    v_kind      text;
    v_cluster   text;
    v_topic     text;
    v_part      text;
    v_gen       bigint;
    v_ser       text;
    v_acks      text;
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

    -- The route: as outbox.route_template chooses it.
    SELECT rp.broker_kind, rp.broker_cluster, rp.topic, rp.partitioner, rp.generation,
           rp.serializer, rp.required_acks
      INTO v_kind, v_cluster, v_topic, v_part, v_gen, v_ser, v_acks
    FROM outbox.route_policy rp
    WHERE rp.active
      AND (rp.aggregate_type IS NULL OR rp.aggregate_type = enqueue.aggregate_type)
      AND (rp.event_type IS NULL OR rp.event_type = enqueue.event_type)
    ORDER BY (rp.aggregate_type IS NOT NULL) DESC, (rp.event_type IS NOT NULL) DESC,
             rp.priority DESC, rp.generation DESC
    LIMIT 1;
    IF NOT FOUND THEN
        v_kind := 'kafka'; v_cluster := 'default'; v_topic := 'outbox.event.{aggregate_type}';
        v_part := 'murmur2_random'; v_gen := 0; v_ser := 'json'; v_acks := 'all';
    END IF;

    -- The placeholders replaced, each value encoded for its place (or refused), before the
    -- destination is frozen and hashed. The default Kafka template with a legal aggregate type
    -- renders to itself with the type pasted in (13 + 236 = 249 characters at most), exactly
    -- what outbox.render_destination gives it; anything else goes through that function.
    IF v_kind = 'kafka' AND v_topic = 'outbox.event.{aggregate_type}'
       AND length(enqueue.aggregate_type) <= 236
       AND enqueue.aggregate_type !~ '[^A-Za-z0-9._-]' THEN
        v_topic := 'outbox.event.' || enqueue.aggregate_type;
    ELSE
        v_topic := outbox.render_destination(v_kind, v_topic, enqueue.aggregate_type, enqueue.aggregate_id);
    END IF;

    -- Not a row around outbox.enqueue (trigger events_row_around_enqueue).
    PERFORM set_config('outbox.enqueuing', v_id::text, true);
    -- The version upsert's row lock, held until the producing transaction ends, serialises the
    -- writers of one aggregate (migration 0001).
    WITH v AS (
        INSERT INTO outbox.aggregate_versions AS av (aggregate_type, aggregate_id, last_version)
        VALUES (enqueue.aggregate_type, enqueue.aggregate_id, 1)
        ON CONFLICT ON CONSTRAINT aggregate_versions_pkey
        DO UPDATE SET last_version = av.last_version + 1
        RETURNING av.last_version
    )
    INSERT INTO outbox.events (
        event_id, envelope_generation, aggregate_type, aggregate_id, aggregate_version,
        event_type, payload_schema, payload, payload_digest, tenant, headers,
        dest_kind, dest_cluster, dest_topic, dest_key, dest_partitioner,
        dest_route_generation, dest_serializer, dest_acks, destination_digest)
    SELECT
        v_id, 1, enqueue.aggregate_type, enqueue.aggregate_id, v.last_version,
        enqueue.event_type, enqueue.payload_schema, enqueue.payload,
        outbox.sha256_text(enqueue.payload::text), enqueue.tenant, enqueue.headers,
        v_kind, v_cluster, v_topic, enqueue.aggregate_id, v_part,
        v_gen, v_ser, v_acks,
        outbox.sha256_text(outbox.destination_canonical(
            v_kind, v_cluster, v_topic, enqueue.aggregate_id, v_part, v_gen, v_ser, v_acks))
    FROM v;
    RETURN v_id;
END
$$;
