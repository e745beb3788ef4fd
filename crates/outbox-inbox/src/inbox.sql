-- The inbox tables, for a consumer whose database is not the outbox's (outbox_inbox::install).
-- Identical to their definition in migrations/0008_consumers_retention.sql (a test compares
-- them); every statement is idempotent.
CREATE SCHEMA IF NOT EXISTS outbox;

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
