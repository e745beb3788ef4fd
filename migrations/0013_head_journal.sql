-- outboxd migration 0013: aggregate heads kept per batch, folded in the background.
--
-- Until now every acceptance upserted one outbox.aggregate_heads row per aggregate it
-- published: ~40 % of the acceptance statement's time, and WAL that the relay's own walsender
-- decodes again. An acceptance now appends ONE journal row per batch holding the batch's
-- (aggregate, version) pairs as arrays; the relay folds committed journal rows into
-- outbox.aggregate_heads in the background and at start.
--
-- A head is GREATEST(aggregate_heads.last_version, every version in the journal for that
-- aggregate): outbox.fold_heads() moves journal rows into the heads in one statement, deleting
-- exactly the rows it folds, so a row committed while a fold runs stays for the next fold and
-- nothing is counted twice or lost (GREATEST makes a repeat harmless anyway).

CREATE TABLE outbox.head_journal (
    id               bigserial PRIMARY KEY,
    slot_name        text,
    aggregate_types  text[] NOT NULL,
    aggregate_ids    text[] NOT NULL,
    versions         int8[] NOT NULL,
    recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Folds every committed journal row into outbox.aggregate_heads; returns how many aggregates
-- it moved.
CREATE FUNCTION outbox.fold_heads() RETURNS bigint
LANGUAGE sql AS $$
    WITH j AS (
        DELETE FROM outbox.head_journal RETURNING aggregate_types, aggregate_ids, versions
    ),
    pairs AS (
        SELECT t.at, t.ai, max(t.v) AS v
        FROM j, unnest(j.aggregate_types, j.aggregate_ids, j.versions) AS t(at, ai, v)
        GROUP BY t.at, t.ai
    ),
    up AS (
        INSERT INTO outbox.aggregate_heads AS h (aggregate_type, aggregate_id, last_version)
        SELECT at, ai, v FROM pairs
        ON CONFLICT (aggregate_type, aggregate_id)
        DO UPDATE SET last_version = GREATEST(h.last_version, EXCLUDED.last_version),
                      updated_at = clock_timestamp()
        WHERE h.last_version < EXCLUDED.last_version
        RETURNING 1
    )
    SELECT count(*) FROM up
$$;
