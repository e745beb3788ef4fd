-- outboxd migration 0033: outbox.receipt_of(event_id), the one way to ask for one event's
-- primary receipt.
--
-- Why (issue 27, docs/evidence_batches.md "What was settled on 2026-12-05"): evidence per
-- acceptance batch will keep a batch's receipts as arrays in one row, with no per-event key.
-- A probe of the view outbox.receipts for one event (`WHERE r.event_id = ...`) cannot then
-- use an index: PostgreSQL cannot turn a condition on an unnested element into a condition on
-- the batch rows. So every reader that asks about one event (or a few: status --event, SHOW
-- RECEIPT, refusals, holds, UNKNOWN attempts, poll offers, destination migrations) asks this
-- function, and the layout change replaces its body (a probe of the batches whose id range
-- and acceptance time can hold the event) without touching those readers, including the
-- relays of this version still running during that upgrade. Readers of whole sets (the
-- audit, purge, the snapshot's and status's counts) keep reading the view.
--
-- Today it reads the view: a SQL function that PostgreSQL inlines into the calling query
-- (LANGUAGE sql, STABLE, not STRICT, no SET, not SECURITY DEFINER), so
-- `EXISTS (SELECT 1 FROM outbox.receipt_of(e.event_id))` is planned exactly as the probe of
-- the view was (a ledger test checks the plan has no function scan). It runs with the
-- caller's rights: whoever may read outbox.receipts may call it.
CREATE FUNCTION outbox.receipt_of(event_id uuid) RETURNS SETOF outbox.receipts
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT * FROM outbox.receipts r WHERE r.event_id = receipt_of.event_id
$$;

COMMENT ON FUNCTION outbox.receipt_of(uuid) IS
    'The primary receipt of one event (no row if it has none), as outbox.receipts has it. Ask this, not the view, for one event: it stays an index probe whatever layout the receipts have.';

-- The SQL of earlier migrations that asks about one event (or one aggregate's events) asks it
-- too; each definition below is its latest one, unchanged but for that probe (the plans stay:
-- the function is inlined) and, in the stream's heads, the probes of empty tables. Set readers (outbox.destinations_breaking_rules, the audit) keep
-- the view.

-- outbox.aggregate_heads_of, as 0029_heads_in_two_branches.sql left it, and its stream branch
-- probes only the tables that have rows.
CREATE OR REPLACE FUNCTION outbox.aggregate_heads_of(types text[], ids text[], below bigint[] DEFAULT NULL)
RETURNS TABLE (aggregate_type text, aggregate_id text, last_version bigint)
LANGUAGE sql STABLE AS $$
    -- The stream's heads: every version below the one met is resolved (migration 0028).
    -- A table with no row at all (no head an operator moved, no delivery set, nothing purged:
    -- checked once per statement) is not probed per aggregate; its probe could only give
    -- NULL, which GREATEST ignores. 0.44-0.45 -> 0.28-0.30 us per streamed event
    -- (docs/benchmarks.md, "Receipt entries by COPY").
    SELECT k.t, k.i, GREATEST(
        CASE WHEN (SELECT EXISTS (SELECT 1 FROM outbox.aggregate_heads)) THEN
            (SELECT h.last_version FROM outbox.aggregate_heads h
             WHERE h.aggregate_type = k.t AND h.aggregate_id = k.i) END,
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NULL
           AND e.aggregate_version < k.b
         ORDER BY e.aggregate_version DESC LIMIT 1),
        CASE WHEN (SELECT EXISTS (SELECT 1 FROM outbox.delivery_sets)) THEN
            (SELECT e.aggregate_version FROM outbox.events e
             WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NOT NULL
               AND e.aggregate_version < k.b
             ORDER BY e.aggregate_version DESC LIMIT 1) END,
        CASE WHEN (SELECT EXISTS (SELECT 1 FROM outbox.purged_events)) THEN
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

-- outbox.advance_poll_positions, as 0016_rows_around_enqueue.sql left it.
CREATE OR REPLACE FUNCTION outbox.advance_poll_positions(p_types text[] DEFAULT NULL, p_ids text[] DEFAULT NULL)
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
                  AND NOT EXISTS (SELECT 1 FROM outbox.receipt_of(x.event_id))
                  AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                                  WHERE q.event_id = x.event_id AND q.resolution = 'skipped')),
               (SELECT min(x.aggregate_version) - 1 FROM outbox.events x
                WHERE x.delivery_set_id IS NOT NULL
                  AND x.aggregate_type = v.aggregate_type AND x.aggregate_id = v.aggregate_id
                  AND x.aggregate_version > coalesce(c.version, 0)
                  AND NOT EXISTS (SELECT 1 FROM outbox.receipt_of(x.event_id))
                  AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                                  WHERE q.event_id = x.event_id AND q.resolution = 'skipped'))),
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

-- outbox.poller_may_claim, as 0025_takeover_scale.sql left it.
CREATE OR REPLACE FUNCTION outbox.poller_may_claim(p_id uuid) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox.poller_canaries c WHERE c.event_id = p_id) THEN
        PERFORM nextval('outbox.poller_canary_asks');
        RETURN false;
    END IF;
    RETURN EXISTS (
        SELECT 1 FROM outbox.legacy_events l
        WHERE l.event_id = p_id
          AND outbox.dispatch_owner(l.aggregate_type, l.aggregate_id) IN ('poller', 'handover')
          AND NOT EXISTS (
              SELECT 1 FROM (SELECT e.event_id FROM outbox.events e
                             WHERE e.aggregate_type = l.aggregate_type
                               AND e.aggregate_id = l.aggregate_id
                             ORDER BY e.aggregate_version DESC LIMIT 1) newest
              WHERE NOT EXISTS (SELECT 1 FROM outbox.receipt_of(newest.event_id))));
END
$$;

-- outbox.event_status, as 0031_narrow_row.sql left it.
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
FROM outbox.events_frozen e
LEFT JOIN LATERAL outbox.receipt_of(e.event_id) r ON true;

-- outbox.delivery_set_status, as 0007_delivery_sets.sql left it.
CREATE OR REPLACE VIEW outbox.delivery_set_status AS
SELECT s.delivery_set_id, s.completion, s.targets,
       count(r.event_id) AS published,
       CASE
           WHEN s.completion = 'all-of' AND count(r.event_id) = s.targets THEN 'COMPLETE'
           WHEN s.completion = 'any-of' AND count(r.event_id) > 0 THEN 'COMPLETE'
           WHEN count(r.event_id) > 0 THEN 'PARTIAL'
           ELSE 'PENDING'
       END AS state
FROM outbox.delivery_sets s
JOIN outbox.events e ON e.delivery_set_id = s.delivery_set_id
LEFT JOIN LATERAL outbox.receipt_of(e.event_id) r ON true
GROUP BY s.delivery_set_id, s.completion, s.targets;
