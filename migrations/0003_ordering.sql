-- outboxd migration 0003: per-aggregate ordering state, holds and held events.
--
-- An aggregate is HELD when one of its events is quarantined or a version gap is detected:
-- its later events are recorded in outbox.held_events (durably, so the slot may move past
-- them) and published only after an operator releases the hold, in version order.

-- Highest version of each aggregate with an accepted primary receipt (the gap check's base).
CREATE TABLE outbox.aggregate_heads (
    aggregate_type  text NOT NULL,
    aggregate_id    text NOT NULL,
    last_version    bigint NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (aggregate_type, aggregate_id)
);

CREATE TABLE outbox.holds (
    aggregate_type        text NOT NULL,
    aggregate_id          text NOT NULL,
    state                 text NOT NULL DEFAULT 'HELD' CHECK (state IN ('HELD', 'RELEASING')),
    reason_code           text NOT NULL,
    reason                text NOT NULL,
    blocking_event_id     uuid,
    blocking_version      bigint,
    -- On release: publish the blocking event too (release) or never (skip).
    publish_blocking      boolean NOT NULL DEFAULT true,
    held_at               timestamptz NOT NULL DEFAULT clock_timestamp(),
    release_requested_at  timestamptz,
    released_by           text,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

CREATE TABLE outbox.held_events (
    event_id           uuid PRIMARY KEY,
    aggregate_type     text NOT NULL,
    aggregate_id       text NOT NULL,
    aggregate_version  bigint NOT NULL,
    commit_lsn         pg_lsn,
    slot_name          text,
    held_at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    released_at        timestamptz
);
CREATE INDEX held_events_open_idx ON outbox.held_events (aggregate_type, aggregate_id, aggregate_version)
    WHERE released_at IS NULL;

-- A quarantine key is unique among open records only: a released event that fails again is
-- quarantined again, with a new record.
ALTER TABLE outbox.quarantine DROP CONSTRAINT quarantine_quarantine_key_key;
CREATE UNIQUE INDEX quarantine_open_key ON outbox.quarantine (quarantine_key) WHERE released_at IS NULL;
ALTER TABLE outbox.quarantine ADD COLUMN resolution text CHECK (resolution IN ('released', 'skipped'));
