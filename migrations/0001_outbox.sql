-- outboxd migration 0001: the outbox table, route policy, and the producer API.
--
-- The outbox table is insert-only for producers: a row is outboxEnvelope.v1 plus the frozen
-- destination.v1, both with digests, written by outbox.enqueue() inside the business
-- transaction. The relay reads it from the WAL (publication below), never by scanning.

CREATE SCHEMA IF NOT EXISTS outbox;

-- Route policy. Rows are never edited: a change is a new row with a new generation (and the old
-- row deactivated), so every event can name the exact policy generation it was routed by.
CREATE SEQUENCE outbox.route_generation_seq;

CREATE TABLE outbox.route_policy (
    policy_id       bigserial PRIMARY KEY,
    generation      bigint NOT NULL DEFAULT nextval('outbox.route_generation_seq') UNIQUE,
    aggregate_type  text,                 -- NULL matches every aggregate type
    event_type      text,                 -- NULL matches every event type
    priority        integer NOT NULL DEFAULT 0,
    broker_kind     text NOT NULL DEFAULT 'kafka',
    broker_cluster  text NOT NULL DEFAULT 'default',
    topic           text NOT NULL CHECK (topic <> ''),  -- '{aggregate_type}' is replaced at enqueue
    partitioner     text NOT NULL DEFAULT 'murmur2_random',
    serializer      text NOT NULL DEFAULT 'json',
    required_acks   text NOT NULL DEFAULT 'all',
    active          boolean NOT NULL DEFAULT true,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- Per-aggregate version counter. Its row lock, taken by enqueue's upsert and held until the
-- producing transaction ends, serialises writers of one aggregate: versions are dense over
-- committed events (a rollback gives its number back) and commit order equals version order.
CREATE TABLE outbox.aggregate_versions (
    aggregate_type  text NOT NULL,
    aggregate_id    text NOT NULL,
    last_version    bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

CREATE TABLE outbox.events (
    -- outboxEnvelope.v1
    event_id              uuid PRIMARY KEY,
    envelope_generation   integer NOT NULL DEFAULT 1,
    aggregate_type        text NOT NULL,
    aggregate_id          text NOT NULL,
    aggregate_version     bigint NOT NULL,
    event_type            text NOT NULL,
    payload_schema        text,
    payload               jsonb NOT NULL,
    payload_digest        text NOT NULL,
    tenant                text,
    headers               jsonb,
    occurred_at           timestamptz NOT NULL DEFAULT now(),
    created_xid           xid8 NOT NULL DEFAULT pg_current_xact_id(),
    -- destination.v1, frozen at enqueue
    dest_kind             text NOT NULL,
    dest_cluster          text NOT NULL,
    dest_topic            text NOT NULL,
    dest_key              text NOT NULL,
    dest_partitioner      text NOT NULL,
    dest_route_generation bigint NOT NULL,
    dest_serializer       text NOT NULL,
    dest_acks             text NOT NULL,
    destination_digest    text NOT NULL,
    UNIQUE (aggregate_type, aggregate_id, aggregate_version)
);

-- UUIDv7 (time-ordered) from a random v4: overwrite the first 48 bits with the Unix time in
-- milliseconds and turn version bits 0100 into 0111. PostgreSQL 15 has no uuidv7().
CREATE FUNCTION outbox.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

-- Canonical text of destination.v1. Must match outbox_core::Destination::canonical byte for byte.
CREATE FUNCTION outbox.destination_canonical(
    kind text, cluster text, topic text, key text, partitioner text,
    route_generation bigint, serializer text, acks text
) RETURNS text
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT 'destination.v1'
        || E'\nkind=' || kind
        || E'\ncluster=' || cluster
        || E'\ntopic=' || topic
        || E'\nkey=' || key
        || E'\npartitioner=' || partitioner
        || E'\nroute_generation=' || route_generation::text
        || E'\nserializer=' || serializer
        || E'\nacks=' || acks
$$;

CREATE FUNCTION outbox.sha256_text(t text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT 'sha256:' || encode(sha256(convert_to(t, 'UTF8')), 'hex')
$$;

-- The route an event of this type goes to now. Most specific active policy wins; without
-- one, Debezium's outbox-router convention: topic outbox.event.<aggregate_type>, generation 0.
CREATE FUNCTION outbox.resolve_route(p_aggregate_type text, p_event_type text)
RETURNS TABLE (kind text, cluster text, topic text, partitioner text,
               generation bigint, serializer text, acks text)
LANGUAGE sql STABLE AS $$
    SELECT kind, cluster, replace(topic, '{aggregate_type}', p_aggregate_type),
           partitioner, generation, serializer, acks
    FROM (
        SELECT rp.broker_kind AS kind, rp.broker_cluster AS cluster, rp.topic, rp.partitioner,
               rp.generation, rp.serializer, rp.required_acks AS acks,
               0 AS fallback,
               (rp.aggregate_type IS NOT NULL)::int AS s1, (rp.event_type IS NOT NULL)::int AS s2,
               rp.priority
        FROM outbox.route_policy rp
        WHERE rp.active
          AND (rp.aggregate_type IS NULL OR rp.aggregate_type = p_aggregate_type)
          AND (rp.event_type IS NULL OR rp.event_type = p_event_type)
        UNION ALL
        SELECT 'kafka', 'default', 'outbox.event.{aggregate_type}', 'murmur2_random',
               0, 'json', 'all', 1, 0, 0, 0
    ) candidates
    ORDER BY fallback, s1 DESC, s2 DESC, priority DESC, generation DESC
    LIMIT 1
$$;

-- Replace the active policy for (aggregate_type, event_type) with a new generation.
CREATE FUNCTION outbox.set_route(
    p_aggregate_type text, p_event_type text, p_topic text,
    p_broker_cluster text DEFAULT 'default', p_broker_kind text DEFAULT 'kafka'
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    g bigint;
BEGIN
    UPDATE outbox.route_policy SET active = false
    WHERE active
      AND aggregate_type IS NOT DISTINCT FROM p_aggregate_type
      AND event_type IS NOT DISTINCT FROM p_event_type;
    INSERT INTO outbox.route_policy (aggregate_type, event_type, topic, broker_cluster, broker_kind)
    VALUES (p_aggregate_type, p_event_type, p_topic, p_broker_cluster, p_broker_kind)
    RETURNING generation INTO g;
    RETURN g;
END
$$;

-- The producer API. Call it inside the business transaction; the event commits or rolls back
-- with the business change. Returns the event id, created here once and never again.
CREATE FUNCTION outbox.enqueue(
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
    v_id      uuid := coalesce(enqueue.event_id, outbox.uuid_v7());
    v_version bigint;
    r         record;
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

    INSERT INTO outbox.aggregate_versions AS v (aggregate_type, aggregate_id, last_version)
    VALUES (enqueue.aggregate_type, enqueue.aggregate_id, 1)
    ON CONFLICT ON CONSTRAINT aggregate_versions_pkey
    DO UPDATE SET last_version = v.last_version + 1
    RETURNING v.last_version INTO v_version;

    SELECT * INTO r FROM outbox.resolve_route(enqueue.aggregate_type, enqueue.event_type);

    INSERT INTO outbox.events (
        event_id, envelope_generation, aggregate_type, aggregate_id, aggregate_version,
        event_type, payload_schema, payload, payload_digest, tenant, headers,
        dest_kind, dest_cluster, dest_topic, dest_key, dest_partitioner,
        dest_route_generation, dest_serializer, dest_acks, destination_digest)
    VALUES (
        v_id, 1, enqueue.aggregate_type, enqueue.aggregate_id, v_version,
        enqueue.event_type, enqueue.payload_schema, enqueue.payload,
        outbox.sha256_text(enqueue.payload::text), enqueue.tenant, enqueue.headers,
        r.kind, r.cluster, r.topic, enqueue.aggregate_id, r.partitioner,
        r.generation, r.serializer, r.acks,
        outbox.sha256_text(outbox.destination_canonical(
            r.kind, r.cluster, r.topic, enqueue.aggregate_id, r.partitioner,
            r.generation, r.serializer, r.acks)));
    RETURN v_id;
END
$$;

-- The relay reads inserts only: producers never update or delete outbox rows, and purge
-- (deletes) must not look like events.
CREATE PUBLICATION outbox_pub FOR TABLE outbox.events WITH (publish = 'insert');
