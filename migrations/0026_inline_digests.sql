-- outboxd migration 0026: outbox.enqueue computes its two digests inline (issue 27).
--
-- Migration 0023 made outbox.sha256_text PL/pgSQL so that PostgreSQL prepares it once per
-- session instead of parsing it at every call; each call still costs a PL/pgSQL function call
-- (a new frame, its own expression evaluation) for a few microseconds of hashing. outbox.enqueue
-- called it twice per event. Here the same expressions are written inside enqueue's insert:
-- the same text hashed the same way ('sha256:' || hex of SHA-256 of the UTF-8 bytes), the same
-- canonical destination text as outbox.destination_canonical, the same row. Nothing else
-- changes; outbox.sha256_text and outbox.destination_canonical stay for every other caller.
-- The test the_cheaper_enqueues_of_migrations_0023_and_0026_write_what_0022s_wrote
-- (crates/outbox-ledger/tests/ledger.rs) runs migration 0022's function beside this one and
-- compares rows, digests and errors.

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
        -- outbox.sha256_text(payload::text), inline.
        'sha256:' || encode(sha256(convert_to(enqueue.payload::text, 'UTF8')), 'hex'),
        enqueue.tenant, enqueue.headers,
        v_kind, v_cluster, v_topic, enqueue.aggregate_id, v_part,
        v_gen, v_ser, v_acks,
        -- outbox.sha256_text(outbox.destination_canonical(...)), inline.
        'sha256:' || encode(sha256(convert_to(
            'destination.v1'
            || E'\nkind=' || v_kind
            || E'\ncluster=' || v_cluster
            || E'\ntopic=' || v_topic
            || E'\nkey=' || enqueue.aggregate_id
            || E'\npartitioner=' || v_part
            || E'\nroute_generation=' || v_gen::text
            || E'\nserializer=' || v_ser
            || E'\nacks=' || v_acks, 'UTF8')), 'hex')
    FROM v;
    RETURN v_id;
END
$$;
