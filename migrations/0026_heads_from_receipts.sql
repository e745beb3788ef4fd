-- outboxd migration 0026: an aggregate's head is read from the receipts when the relay first
-- meets the aggregate, instead of being kept per event.
--
-- Migration 0013 journaled every acceptance's (aggregate, version) pairs and the relay folded
-- them into outbox.aggregate_heads in the background, so that a starting relay could load
-- every head at once. Measured in a 1,000,000-event drain over 100,000 aggregates: the fold
-- alone took 5.0-5.9 s of PostgreSQL time (one upsert per aggregate per fold, ~200 bytes of
-- WAL per event that the relay's own walsender decodes again), the journal row ~0.9 us per
-- event more: about a quarter of what the relay cost the primary (docs/benchmarks.md).
--
-- A head is a fact the ledger already holds: the highest version of the aggregate with a
-- primary receipt (in outbox.events, or in outbox.purged_events once purged), or higher where
-- an operator skipped a version (outbox.aggregate_heads, migration 0003). The relay now asks
-- for the heads of the aggregates it meets for the first time in a run, many in one query
-- (outbox.aggregate_heads_of), before it admits their events; acceptances write no journal.
--
-- outbox.head_journal and outbox.fold_heads() stay: a relay of an earlier version, still
-- running while this migration is applied, journals; a relay of this version folds what is
-- left once when it starts, and reads outbox.aggregate_heads as it reads every head.

-- The purged part of a head: the highest purged version of an aggregate.
CREATE INDEX IF NOT EXISTS purged_events_aggregate_idx
    ON outbox.purged_events (aggregate_type, aggregate_id, aggregate_version);

-- The heads of the aggregates named by (types[i], ids[i]): for each, the highest version with
-- a primary receipt or purged, or moved by an operator; 0 when there is none. With below[i],
-- only versions below it count from the receipts and the purged (the relay met version
-- below[i] first in the stream, and every later version of the aggregate follows it there),
-- so the scan starts at the version before the one met instead of walking down past every
-- unpublished one; an operator's move counts whatever its version. Each part is an index scan
-- from the newest version down that stops at the first published one.
CREATE FUNCTION outbox.aggregate_heads_of(types text[], ids text[], below bigint[] DEFAULT NULL)
RETURNS TABLE (aggregate_type text, aggregate_id text, last_version bigint)
LANGUAGE sql STABLE AS $$
    SELECT k.t, k.i, GREATEST(
        (SELECT h.last_version FROM outbox.aggregate_heads h
         WHERE h.aggregate_type = k.t AND h.aggregate_id = k.i),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NULL
           AND e.aggregate_version < k.b
           AND EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NOT NULL
           AND e.aggregate_version < k.b
           AND EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT p.aggregate_version FROM outbox.purged_events p
         WHERE p.aggregate_type = k.t AND p.aggregate_id = k.i AND p.aggregate_version < k.b
         ORDER BY p.aggregate_version DESC LIMIT 1),
        0)
    FROM (SELECT u.t, u.i, coalesce(u.b, 9223372036854775807) AS b
          FROM unnest(types, ids, below) AS u(t, i, b)) k
$$;
