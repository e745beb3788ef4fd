-- outboxd migration 0008: consumers, their inboxes and watermarks; retention and purge.
--
-- The relay proves an event reached the broker; only consumers can prove it was applied. They
-- say so here: a consumer using the inbox library records (consumer_id, event_id) in its inbox
-- in the same transaction as its effect, and moves its watermarks forward in that transaction
-- too. The reconciler compares these with the ledger, and purge deletes nothing a mandatory
-- consumer has not covered yet, nor anything inside the replay window.
--
-- The inbox tables are `IF NOT EXISTS` because the inbox library installs the same tables in a
-- consumer's own database (outbox_inbox::install); a consumer sharing this database gets them
-- from here. Keep the two definitions identical (crates/outbox-inbox/src/inbox.sql; a test
-- compares them).

-- Who consumes, and whether retention must wait for them. A mandatory consumer's watermark
-- gates purge and the reconciler reports events it has not consumed; an optional one is only
-- shown. topics NULL means every topic.
CREATE TABLE outbox.consumers (
    consumer_id    text PRIMARY KEY CHECK (consumer_id <> ''),
    mandatory      boolean NOT NULL,
    topics         text[],
    description    text,
    registered_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE FUNCTION outbox.register_consumer(
    consumer_id  text,
    mandatory    boolean,
    topics       text[] DEFAULT NULL,
    description  text   DEFAULT NULL
) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO outbox.consumers AS c (consumer_id, mandatory, topics, description)
    VALUES (register_consumer.consumer_id, register_consumer.mandatory,
            register_consumer.topics, register_consumer.description)
    ON CONFLICT ON CONSTRAINT consumers_pkey DO UPDATE
    SET mandatory = EXCLUDED.mandatory, topics = EXCLUDED.topics,
        description = coalesce(EXCLUDED.description, c.description),
        updated_at = clock_timestamp()
$$;

-- The consumer's receipt of one event: written with ON CONFLICT DO NOTHING RETURNING in the
-- transaction of the handler's effect. A duplicate finds the row and returns it unchanged.
CREATE TABLE IF NOT EXISTS outbox.inbox (
    consumer_id        text NOT NULL,
    event_id           uuid NOT NULL,
    aggregate_type     text,
    aggregate_id       text,
    aggregate_version  bigint,
    event_type         text,
    topic              text NOT NULL,
    partition          integer NOT NULL,
    "offset"           bigint NOT NULL,
    outcome            text NOT NULL DEFAULT 'APPLIED' CHECK (outcome IN ('APPLIED', 'STALE', 'GAP_REPORTED')),
    result             jsonb,
    consumed_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer_id, event_id)
);
CREATE INDEX IF NOT EXISTS inbox_consumed_at_idx ON outbox.inbox (consumed_at);

-- Partition watermark: every message of (topic, partition) below next_offset was applied or
-- recognised as a duplicate by this consumer. Only moves forward.
CREATE TABLE IF NOT EXISTS outbox.consumer_watermarks (
    consumer_id  text NOT NULL,
    topic        text NOT NULL,
    partition    integer NOT NULL,
    next_offset  bigint NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer_id, topic, partition)
);

-- Aggregate watermark: the highest version of each aggregate this consumer applied. The base
-- of consumer-side gap detection, and a second line of dedup once inbox rows are purged.
CREATE TABLE IF NOT EXISTS outbox.consumer_aggregate_heads (
    consumer_id     text NOT NULL,
    aggregate_type  text NOT NULL,
    aggregate_id    text NOT NULL,
    last_version    bigint NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer_id, aggregate_type, aggregate_id)
);

-- Version gaps a consumer saw (policy `report` applies the event anyway and records it here).
CREATE TABLE IF NOT EXISTS outbox.consumer_gaps (
    id                bigserial PRIMARY KEY,
    consumer_id       text NOT NULL,
    aggregate_type    text NOT NULL,
    aggregate_id      text NOT NULL,
    expected_version  bigint NOT NULL,
    got_version       bigint NOT NULL,
    event_id          uuid NOT NULL,
    detected_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Whether every mandatory consumer that reads `topic` has applied the event at
-- (topic, partition, offset): its partition watermark is past the offset, or its inbox has the
-- event (it consumed another copy, e.g. a duplicate at a later offset).
CREATE FUNCTION outbox.covered_by_mandatory(p_event_id uuid, p_topic text, p_partition integer, p_offset bigint)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT NOT EXISTS (
        SELECT 1 FROM outbox.consumers c
        WHERE c.mandatory
          AND (c.topics IS NULL OR p_topic = ANY (c.topics))
          AND NOT EXISTS (SELECT 1 FROM outbox.consumer_watermarks w
                          WHERE w.consumer_id = c.consumer_id AND w.topic = p_topic
                            AND w.partition = p_partition AND w.next_offset > p_offset)
          AND NOT EXISTS (SELECT 1 FROM outbox.inbox i
                          WHERE i.consumer_id = c.consumer_id AND i.event_id = p_event_id))
$$;

-- RETAINED: published, and every mandatory consumer has it. The row is kept only as replay
-- evidence until the replay window passes; `outboxd purge` marks and then deletes.
ALTER TABLE outbox.receipts ADD COLUMN retained_at timestamptz;

-- What is left of a purged event: its identity, digests and primary receipt position. Small,
-- and kept so that the reconciler does not report the broker's copy as a bypass publish, and
-- a payload or destination conflict on a purged id is still detected.
CREATE TABLE outbox.purged_events (
    event_id            uuid PRIMARY KEY,
    aggregate_type      text NOT NULL,
    aggregate_id        text NOT NULL,
    aggregate_version   bigint NOT NULL,
    payload_digest      text NOT NULL,
    destination_digest  text NOT NULL,
    topic               text NOT NULL,
    partition           integer NOT NULL,
    "offset"            bigint NOT NULL,
    occurred_at         timestamptz NOT NULL,
    accepted_at         timestamptz NOT NULL,
    purged_at           timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The event status view gains RETAINED (same columns, same order).
CREATE OR REPLACE VIEW outbox.event_status AS
SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type,
       CASE
           WHEN r.event_id IS NOT NULL AND r.retained_at IS NOT NULL THEN 'RETAINED'
           WHEN r.event_id IS NOT NULL THEN 'PUBLISHED'
           WHEN EXISTS (SELECT 1 FROM outbox.quarantine q
                        WHERE q.event_id = e.event_id AND q.released_at IS NULL) THEN 'QUARANTINED'
           WHEN EXISTS (SELECT 1 FROM outbox.held_events h
                        WHERE h.event_id = e.event_id AND h.released_at IS NULL) THEN 'HELD'
           WHEN EXISTS (SELECT 1 FROM outbox.attempts a
                        WHERE a.event_id = e.event_id AND a.state = 'DISPATCH_UNKNOWN') THEN 'DISPATCH_UNKNOWN'
           ELSE 'PENDING'
       END AS state,
       r.topic, r.partition, r."offset", r.accepted_at, r.relay_generation, r.attempt,
       e.dest_topic, e.destination_digest, e.occurred_at
FROM outbox.events e
LEFT JOIN outbox.receipts r ON r.event_id = e.event_id;
