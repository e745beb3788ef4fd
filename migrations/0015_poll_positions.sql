-- outboxd migration 0015: where poll mode reads from, per aggregate, and what its round saw.
--
-- Poll mode (`outboxd run --mode poll`) reads the pending events of each aggregate above a
-- lower bound. The head (outbox.aggregate_heads: the highest version with a receipt) is not a
-- safe bound: receipts can be accepted out of version order — an UNKNOWN attempt of version 8
-- found on the broker and accepted while version 7's ACK was lost with the run that sent it —
-- and a read above the head would never send version 7 again, so it would never get a
-- receipt (found by outbox-sim in poll-mode traces). The bound here only advances over a
-- contiguous prefix: every version at or below it has a primary receipt (or was purged, which
-- needs one). It is advanced by the polling relay before each read.
CREATE TABLE outbox.poll_positions (
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    -- Every version <= this one has a primary receipt.
    version        bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- Poll mode reads an aggregate's versions by (aggregate type, aggregate id, version). The index
-- on those is partial (migration 0007: members of a delivery set share their version), so the
-- reads go in two branches, one per partial index; this is the members' one. Only producers of
-- delivery sets pay for it.
CREATE INDEX events_delivery_set_aggregate_idx
    ON outbox.events (aggregate_type, aggregate_id, aggregate_version)
    WHERE delivery_set_id IS NOT NULL;

-- Advances each aggregate's position over its receipted prefix (every aggregate, or those of
-- the arrays: the ones a round just published, which is all a busy round needs): to the version before its
-- lowest event without a receipt above the position, or to its last version when there is
-- none. A committed aggregate_versions row means every version up to it is committed too
-- (versions are given under the row's lock, in the inserting transaction). Returns how many
-- positions moved.
CREATE FUNCTION outbox.advance_poll_positions(p_types text[] DEFAULT NULL, p_ids text[] DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    -- EXECUTE: planned anew at every call. A plan cached in the session from the first round
    -- (receipts and positions still empty: sequential scans in the anti-join) made the second
    -- round of a 20,000-event backlog take 10 s instead of 0.3 s.
    EXECUTE $q$
    INSERT INTO outbox.poll_positions AS p (aggregate_type, aggregate_id, version)
    SELECT v.aggregate_type, v.aggregate_id,
           coalesce(least(
               (SELECT min(x.aggregate_version) - 1 FROM outbox.events x
                WHERE x.delivery_set_id IS NULL
                  AND x.aggregate_type = v.aggregate_type AND x.aggregate_id = v.aggregate_id
                  AND x.aggregate_version > coalesce(c.version, 0)
                  AND NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = x.event_id)),
               (SELECT min(x.aggregate_version) - 1 FROM outbox.events x
                WHERE x.delivery_set_id IS NOT NULL
                  AND x.aggregate_type = v.aggregate_type AND x.aggregate_id = v.aggregate_id
                  AND x.aggregate_version > coalesce(c.version, 0)
                  AND NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = x.event_id))),
               v.last_version)
    FROM outbox.aggregate_versions v
    LEFT JOIN outbox.poll_positions c
           ON c.aggregate_type = v.aggregate_type AND c.aggregate_id = v.aggregate_id
    WHERE v.last_version > coalesce(c.version, 0)
      AND ($1 IS NULL OR (v.aggregate_type, v.aggregate_id) IN (SELECT * FROM unnest($1, $2)))
    ON CONFLICT (aggregate_type, aggregate_id)
    DO UPDATE SET version = EXCLUDED.version WHERE EXCLUDED.version > p.version
    $q$ USING p_types, p_ids;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Which quarantines a polling relay's current round may not have seen. A round reads events
-- (at most one round is in progress per lease) and may hold them in memory — queued behind an
-- aggregate's in-flight event, or retried — until it ends. A quarantine recorded meanwhile by
-- another run (a paused relay's salvage) is not in that read: a destination migration of the
-- event must wait until a round that sees the quarantine has begun, or the held copy would go
-- to the old destination (a cross-destination retry; found by outbox-sim, seed 3 trace 7927).
-- The round stores the snapshot of its read; the quarantine, the transaction that recorded it.
CREATE TABLE outbox.poll_rounds (
    slot_name   text PRIMARY KEY,
    generation  bigint NOT NULL,
    snapshot    pg_snapshot NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The same for purge: a receipt accepted after the round's read (a paused relay's salvage) may
-- be of an event the round still holds and sends again; the event's row and receipt stay
-- until a round has seen the receipt (found by outbox-sim, seed 1 trace 608933).
-- Added without a default first and given one after, so that neither table is rewritten;
-- rows from before this migration have none and count as seen.
ALTER TABLE outbox.quarantine ADD COLUMN recorded_xact xid8;
ALTER TABLE outbox.quarantine ALTER COLUMN recorded_xact SET DEFAULT pg_current_xact_id();
ALTER TABLE outbox.receipts ADD COLUMN accepted_xact xid8;
ALTER TABLE outbox.receipts ALTER COLUMN accepted_xact SET DEFAULT pg_current_xact_id();

-- Whether the current round of a live poll lease read before transaction `x` (so it may
-- hold, and send again, what `x` recorded). NULL (before migration 0015): seen.
CREATE FUNCTION outbox.poll_round_missed(x xid8) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT x IS NOT NULL AND EXISTS (
        SELECT 1 FROM outbox.poll_rounds pr
        JOIN outbox.relay_leases l ON l.slot_name = pr.slot_name AND l.generation = pr.generation
        WHERE l.lease_until > clock_timestamp() AND NOT pg_visible_in_snapshot(x, pr.snapshot))
$$;
