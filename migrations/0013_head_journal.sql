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

-- Folds committed journal rows with id <= up_to into outbox.aggregate_heads, oldest first, at
-- most about max_pairs (aggregate, version) pairs (whole journal rows; at least one row); returns
-- how many journal rows it folded (0: nothing left up to up_to). The caller loops, one
-- transaction per call: a fold of a whole drain's journal in one transaction would be one
-- burst of WAL that the relay's walsender must decode before the next outbox commit.
CREATE FUNCTION outbox.fold_heads(max_pairs bigint, up_to bigint) RETURNS bigint
LANGUAGE sql AS $$
    WITH pick AS (
        SELECT id FROM (
            SELECT id, sum(cardinality(versions)) OVER (ORDER BY id)
                       - cardinality(versions) AS before
            FROM outbox.head_journal WHERE id <= up_to
        ) r
        WHERE before < max_pairs
    ),
    -- A row another fold deleted meanwhile is skipped here (it waits for that fold's commit).
    j AS (
        DELETE FROM outbox.head_journal WHERE id IN (SELECT id FROM pick)
        RETURNING aggregate_types, aggregate_ids, versions
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
    -- up runs to completion although nothing reads it (PostgreSQL guarantees it).
    SELECT count(*) FROM j
$$;
