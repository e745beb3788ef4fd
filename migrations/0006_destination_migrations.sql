-- outboxd migration 0006: explicit destination migration.
--
-- A frozen destination is never edited and never re-resolved. When an event must go somewhere
-- else (its cluster was retired, its topic can never accept it), an operator migrates it:
-- only after proving the old target did not accept it, and never while the old target's
-- outcome is UNKNOWN. The migration is a new envelope generation with its own destination and
-- digest; this row is its migration receipt (who, why, and the proof).
CREATE TABLE outbox.destination_migrations (
    id                       bigserial PRIMARY KEY,
    event_id                 uuid NOT NULL,
    envelope_generation      integer NOT NULL,
    from_destination_digest  text NOT NULL,
    dest_kind                text NOT NULL,
    dest_cluster             text NOT NULL,
    dest_topic               text NOT NULL,
    dest_key                 text NOT NULL,
    dest_partitioner         text NOT NULL,
    dest_route_generation    bigint NOT NULL,
    dest_serializer          text NOT NULL,
    dest_acks                text NOT NULL,
    destination_digest       text NOT NULL,
    proof                    text NOT NULL,
    reason                   text NOT NULL,
    migrated_by              text NOT NULL,
    migrated_at              timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (event_id, envelope_generation)
);

-- Events as the relay publishes them: the row as frozen, with its latest destination migration.
CREATE VIEW outbox.events_current AS
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
       coalesce(m.destination_digest, e.destination_digest) AS destination_digest
FROM outbox.events e
LEFT JOIN LATERAL (
    SELECT * FROM outbox.destination_migrations dm
    WHERE dm.event_id = e.event_id
    ORDER BY dm.envelope_generation DESC
    LIMIT 1
) m ON true;
