-- outboxd migration 0029: outbox.aggregate_heads_of reads the stream's heads and whole heads in
-- two branches of one statement, so the stream's look-up is the plain key probes it asks for.
--
-- Same rules as migration 0028: with `below` (the version the stream met first), the highest
-- version below it that exists, in outbox.events or outbox.purged_events; without it (a
-- snapshot, a hold's release, the start's second read), the highest version with a receipt.
-- 0028 wrote both in one SELECT, choosing per key with a CASE inside every sub-select; that
-- form cost the stream's look-up ~4 us more per aggregate than the same probes without it
-- (11.8-13.9 vs 8.5 us per head over 1,000,000 rows, docs/benchmarks.md). Each key now goes to
-- the branch of its kind (`below` NULL or not), and a branch's sub-selects hold only its own
-- conditions. The heads read are the same (crates/outbox-ledger/tests/ledger.rs, both kinds).

CREATE OR REPLACE FUNCTION outbox.aggregate_heads_of(types text[], ids text[], below bigint[] DEFAULT NULL)
RETURNS TABLE (aggregate_type text, aggregate_id text, last_version bigint)
LANGUAGE sql STABLE AS $$
    -- The stream's heads: every version below the one met is resolved (migration 0028).
    SELECT k.t, k.i, GREATEST(
        (SELECT h.last_version FROM outbox.aggregate_heads h
         WHERE h.aggregate_type = k.t AND h.aggregate_id = k.i),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NULL
           AND e.aggregate_version < k.b
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NOT NULL
           AND e.aggregate_version < k.b
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT p.aggregate_version FROM outbox.purged_events p
         WHERE p.aggregate_type = k.t AND p.aggregate_id = k.i AND p.aggregate_version < k.b
         ORDER BY p.aggregate_version DESC LIMIT 1),
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
           AND EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NOT NULL
           AND EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT p.aggregate_version FROM outbox.purged_events p
         WHERE p.aggregate_type = k.t AND p.aggregate_id = k.i
         ORDER BY p.aggregate_version DESC LIMIT 1),
        0)
    FROM unnest(types, ids, below) AS k(t, i, b)
    WHERE k.b IS NULL
$$;
