-- outboxd migration 0005: dispatch attempts that ended without proof, and the event status view.
--
-- An attempt whose outcome is unknown (librdkafka: possibly persisted) is recorded here before
-- anything else happens to its event. It stays DISPATCH_UNKNOWN until the reconciler proves the
-- outcome by scanning the frozen partition: FOUND (the broker has it: the scan's offset becomes
-- the receipt, no resend) or ABSENT (the range was fully scanned after the producer session
-- closed: the event may be sent again, attempt generation + 1, to the same frozen destination).
CREATE TABLE outbox.attempts (
    id                  bigserial PRIMARY KEY,
    event_id            uuid NOT NULL,
    relay_generation    bigint NOT NULL,
    attempt_generation  integer NOT NULL,
    slot_name           text NOT NULL,
    topic               text NOT NULL,
    partition           integer NOT NULL,
    sent_at             timestamptz NOT NULL,
    error               text NOT NULL,
    state               text NOT NULL DEFAULT 'DISPATCH_UNKNOWN'
                        CHECK (state IN ('DISPATCH_UNKNOWN', 'FOUND', 'ABSENT')),
    unknown_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    resolved_at         timestamptz,
    found_offset        bigint,
    scanned_from        bigint,
    scanned_to          bigint,
    UNIQUE (event_id, relay_generation, attempt_generation)
);
CREATE INDEX attempts_open_idx ON outbox.attempts (slot_name) WHERE state = 'DISPATCH_UNKNOWN';

-- Where every event is, derived from the ledger.
CREATE VIEW outbox.event_status AS
SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type,
       CASE
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
