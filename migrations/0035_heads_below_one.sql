-- outboxd migration 0035: the stream's heads probe nothing for an aggregate whose first
-- version met is 1.
--
-- Why (issue 27): `outbox.aggregate_heads_of` runs once per aggregate a relay run meets first,
-- and probed the outbox rows' (aggregate, version) key, the delivery sets' and the purged
-- events' for the highest version below the one met: ~0.3 us of PostgreSQL CPU per streamed
-- event on a backlog of 10 events per aggregate (docs/benchmarks.md). A new aggregate's first
-- event is version 1, and below 1 a probe can only find 0 or less, which the function's final
-- 0 already gives: those probes are skipped. The heads an operator moved are still read
-- (a skipped version counts as passed). Otherwise the definition is 0033's.
CREATE OR REPLACE FUNCTION outbox.aggregate_heads_of(types text[], ids text[], below bigint[] DEFAULT NULL)
RETURNS TABLE (aggregate_type text, aggregate_id text, last_version bigint)
LANGUAGE sql STABLE AS $$
    -- The stream's heads: every version below the one met is resolved (migration 0028).
    -- A table with no row at all (no head an operator moved, no delivery set, nothing purged:
    -- checked once per statement) is not probed per aggregate; its probe could only give
    -- NULL, which GREATEST ignores. 0.44-0.45 -> 0.28-0.30 us per streamed event
    -- (docs/benchmarks.md, "Receipt entries by COPY"). Nor is any table probed below a first
    -- version met (`k.b` 1, a new aggregate's first event): a version below 1 can only be
    -- 0 or less, which the final 0 covers (migration 0035).
    SELECT k.t, k.i, GREATEST(
        CASE WHEN (SELECT EXISTS (SELECT 1 FROM outbox.aggregate_heads)) THEN
            (SELECT h.last_version FROM outbox.aggregate_heads h
             WHERE h.aggregate_type = k.t AND h.aggregate_id = k.i) END,
        CASE WHEN k.b > 1 THEN
            (SELECT e.aggregate_version FROM outbox.events e
             WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NULL
               AND e.aggregate_version < k.b
             ORDER BY e.aggregate_version DESC LIMIT 1) END,
        CASE WHEN k.b > 1 AND (SELECT EXISTS (SELECT 1 FROM outbox.delivery_sets)) THEN
            (SELECT e.aggregate_version FROM outbox.events e
             WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NOT NULL
               AND e.aggregate_version < k.b
             ORDER BY e.aggregate_version DESC LIMIT 1) END,
        CASE WHEN k.b > 1 AND (SELECT EXISTS (SELECT 1 FROM outbox.purged_events)) THEN
            (SELECT p.aggregate_version FROM outbox.purged_events p
             WHERE p.aggregate_type = k.t AND p.aggregate_id = k.i AND p.aggregate_version < k.b
             ORDER BY p.aggregate_version DESC LIMIT 1) END,
        0)
    FROM unnest(types, ids, below) AS k(t, i, b)
    WHERE k.b IS NOT NULL
    UNION ALL
    -- Whole heads: unpublished rows exist, so the receipts decide (migration 0026).
    SELECT k.t, k.i, GREATEST(
        (SELECT h.last_version FROM outbox.aggregate_heads h
         WHERE h.aggregate_type = k.t AND h.aggregate_id = k.i),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NULL
           AND EXISTS (SELECT 1 FROM outbox.receipt_of(e.event_id))
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NOT NULL
           AND EXISTS (SELECT 1 FROM outbox.receipt_of(e.event_id))
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT p.aggregate_version FROM outbox.purged_events p
         WHERE p.aggregate_type = k.t AND p.aggregate_id = k.i
         ORDER BY p.aggregate_version DESC LIMIT 1),
        0)
    FROM unnest(types, ids, below) AS k(t, i, b)
    WHERE k.b IS NULL
$$;
