-- outboxd migration 0010: routes to NATS JetStream.
--
-- destination.v1 is unchanged (no new envelope generation): for JetStream, kind = 'nats',
-- cluster = the NATS cluster name (the server name when unclustered), topic = the subject.
-- The stream is not frozen in the row: JetStream lets exactly one stream capture a subject,
-- so the subject determines the stream, and the relay verifies its configured stream at start.
-- partitioner = 'none' (a stream has one sequence; order is per subject).
--
-- Topic templates may now name the aggregate id ('{aggregate_id}'), so the default NATS
-- subject is one per aggregate: outbox.<aggregate_type>.<aggregate_id>.

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
    -- '{aggregate_id}' in a topic/subject template names the aggregate itself (one JetStream
    -- subject per aggregate); it is replaced here, before the destination is frozen and hashed.
    r.topic := replace(r.topic, '{aggregate_id}', enqueue.aggregate_id);

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


-- Route (aggregate_type, event_type) to a JetStream cluster; replaces the active policy with a
-- new generation, like outbox.set_route. The subject template defaults to one subject per
-- aggregate.
CREATE FUNCTION outbox.set_nats_route(
    p_aggregate_type text, p_event_type text, p_cluster text,
    p_subject text DEFAULT 'outbox.{aggregate_type}.{aggregate_id}'
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    g bigint;
BEGIN
    IF coalesce(p_cluster, '') = '' THEN
        RAISE EXCEPTION 'outbox.set_nats_route: cluster must name the NATS cluster (or server) the relay serves' USING ERRCODE = '22023';
    END IF;
    UPDATE outbox.route_policy SET active = false
    WHERE active
      AND aggregate_type IS NOT DISTINCT FROM p_aggregate_type
      AND event_type IS NOT DISTINCT FROM p_event_type;
    INSERT INTO outbox.route_policy (aggregate_type, event_type, topic, broker_cluster, broker_kind,
                                     partitioner)
    VALUES (p_aggregate_type, p_event_type, p_subject, p_cluster, 'nats', 'none')
    RETURNING generation INTO g;
    RETURN g;
END
$$;
