-- outboxd migration 0002: the receipt ledger and checkpoints.
--
-- A primary receipt is the publish slot of an event: at most one per event id (primary key),
-- written in the same transaction as the checkpoint that covers it. Every other ACK for the
-- same event (a replay after a crash, a broker duplicate) is evidence, kept as a duplicate
-- transport receipt; it never replaces the primary.

CREATE TABLE outbox.receipts (
    event_id            uuid PRIMARY KEY,
    broker_kind         text NOT NULL,
    broker_cluster      text NOT NULL,
    topic               text NOT NULL,
    partition           integer NOT NULL,
    "offset"            bigint NOT NULL,
    broker_timestamp    timestamptz,
    attempt             integer NOT NULL DEFAULT 1,
    relay_generation    bigint NOT NULL DEFAULT 0,
    commit_lsn          pg_lsn,
    slot_name           text,
    payload_digest      text NOT NULL,
    destination_digest  text NOT NULL,
    accepted_at         timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE outbox.duplicate_receipts (
    id                  bigserial PRIMARY KEY,
    event_id            uuid NOT NULL,
    broker_kind         text NOT NULL,
    broker_cluster      text NOT NULL,
    topic               text NOT NULL,
    partition           integer NOT NULL,
    "offset"            bigint NOT NULL,
    broker_timestamp    timestamptz,
    attempt             integer NOT NULL DEFAULT 1,
    relay_generation    bigint NOT NULL DEFAULT 0,
    commit_lsn          pg_lsn,
    slot_name           text,
    received_at         timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX duplicate_receipts_event_idx ON outbox.duplicate_receipts (event_id);

-- Events the relay refused to publish, with the reason. A quarantined event is durably
-- recorded, which is what allows the slot to move past it; it is released or skipped by an
-- operator (`outboxd quarantine`), never dropped silently.
CREATE TABLE outbox.quarantine (
    id                  bigserial PRIMARY KEY,
    quarantine_key      text NOT NULL UNIQUE,   -- event id, or lsn:<commit lsn>:<n> if the id is unreadable
    event_id            uuid,
    aggregate_type      text,
    aggregate_id        text,
    aggregate_version   bigint,
    reason_code         text NOT NULL,
    reason              text NOT NULL,
    commit_lsn          pg_lsn,
    slot_name           text,
    quarantined_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    released_at         timestamptz,
    released_by         text,
    release_note        text
);

-- One row per slot: the highest LSN below which every event is resolved in this ledger.
-- Written in the same transaction as the receipts it covers; only then sent to the slot.
CREATE TABLE outbox.checkpoints (
    slot_name           text PRIMARY KEY,
    publication         text NOT NULL,
    system_identifier   text,
    timeline            integer,
    confirmed_lsn       pg_lsn NOT NULL,
    consistent_point    pg_lsn,
    snapshot_done       boolean NOT NULL DEFAULT false,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
