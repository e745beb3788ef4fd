-- outboxd migration 0007: delivery sets.
--
-- When the business really needs one event at several destinations, that is a contract of its
-- own, declared at enqueue: outbox.enqueue_set(...) freezes every target as a member event
-- (its own event id, destination, state and receipt; all members share the aggregate version
-- and the delivery set id), with a completion rule. It is never a retry to another target.

CREATE TABLE outbox.delivery_sets (
    delivery_set_id  uuid PRIMARY KEY,
    completion       text NOT NULL DEFAULT 'all-of' CHECK (completion IN ('all-of', 'any-of')),
    targets          integer NOT NULL CHECK (targets > 0),
    created_at       timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE outbox.events ADD COLUMN delivery_set_id uuid;
-- One row per aggregate version, except that the members of one delivery set share theirs.
ALTER TABLE outbox.events DROP CONSTRAINT events_aggregate_type_aggregate_id_aggregate_version_key;
CREATE UNIQUE INDEX events_aggregate_version_key ON outbox.events (aggregate_type, aggregate_id, aggregate_version)
    WHERE delivery_set_id IS NULL;
CREATE UNIQUE INDEX events_delivery_set_member_key ON outbox.events (delivery_set_id, dest_cluster, dest_topic)
    WHERE delivery_set_id IS NOT NULL;

CREATE FUNCTION outbox.enqueue_set(
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

    INSERT INTO outbox.aggregate_versions AS v (aggregate_type, aggregate_id, last_version)
    VALUES (enqueue_set.aggregate_type, enqueue_set.aggregate_id, 1)
    ON CONFLICT ON CONSTRAINT aggregate_versions_pkey
    DO UPDATE SET last_version = v.last_version + 1
    RETURNING v.last_version INTO v_version;

    INSERT INTO outbox.delivery_sets (delivery_set_id, completion, targets)
    VALUES (v_set, enqueue_set.completion, array_length(enqueue_set.topics, 1));

    FOR i IN 1 .. array_length(enqueue_set.topics, 1) LOOP
        v_cluster := coalesce(enqueue_set.clusters[i], 'default');
        INSERT INTO outbox.events (
            event_id, envelope_generation, aggregate_type, aggregate_id, aggregate_version,
            event_type, payload_schema, payload, payload_digest, tenant, headers,
            dest_kind, dest_cluster, dest_topic, dest_key, dest_partitioner,
            dest_route_generation, dest_serializer, dest_acks, destination_digest, delivery_set_id)
        VALUES (
            outbox.uuid_v7(), 1, enqueue_set.aggregate_type, enqueue_set.aggregate_id, v_version,
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

-- Each set's members and whether its completion rule is met.
CREATE VIEW outbox.delivery_set_status AS
SELECT s.delivery_set_id, s.completion, s.targets,
       count(r.event_id) AS published,
       CASE
           WHEN s.completion = 'all-of' AND count(r.event_id) = s.targets THEN 'COMPLETE'
           WHEN s.completion = 'any-of' AND count(r.event_id) > 0 THEN 'COMPLETE'
           WHEN count(r.event_id) > 0 THEN 'PARTIAL'
           ELSE 'PENDING'
       END AS state
FROM outbox.delivery_sets s
JOIN outbox.events e ON e.delivery_set_id = s.delivery_set_id
LEFT JOIN outbox.receipts r ON r.event_id = e.event_id
GROUP BY s.delivery_set_id, s.completion, s.targets;

-- The relay's view of events gains the delivery set id (added as the last column).
CREATE OR REPLACE VIEW outbox.events_current AS
SELECT e.event_id,
       coalesce(m.envelope_generation, e.envelope_generation) AS envelope_generation,
       e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type, e.payload_schema,
       e.payload, e.payload_digest, e.tenant, e.headers, e.occurred_at, e.created_xid,
       coalesce(m.dest_kind, e.dest_kind) AS dest_kind,
       coalesce(m.dest_cluster, e.dest_cluster) AS dest_cluster,
       coalesce(m.dest_topic, e.dest_topic) AS dest_topic,
       coalesce(m.dest_key, e.dest_key) AS dest_key,
       coalesce(m.dest_partitioner, e.dest_partitioner) AS dest_partitioner,
       coalesce(m.dest_route_generation, e.dest_route_generation) AS dest_route_generation,
       coalesce(m.dest_serializer, e.dest_serializer) AS dest_serializer,
       coalesce(m.dest_acks, e.dest_acks) AS dest_acks,
       coalesce(m.destination_digest, e.destination_digest) AS destination_digest,
       e.delivery_set_id
FROM outbox.events e
LEFT JOIN LATERAL (
    SELECT * FROM outbox.destination_migrations dm
    WHERE dm.event_id = e.event_id
    ORDER BY dm.envelope_generation DESC
    LIMIT 1
) m ON true;
