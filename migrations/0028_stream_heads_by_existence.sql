-- outboxd migration 0028: the head of an aggregate the stream meets first is read from the
-- outbox rows' key, not from the receipts.
--
-- Migration 0026 reads a head, for the stream, as the highest version below the one met first
-- that has a primary receipt: an index scan of outbox.events from that version down, with a
-- probe of outbox.receipts' key per version. Below the version met, that probe answers a
-- question the stream has already settled:
--
-- * a run streams from its slot's confirmed LSN, and the checkpoint passes an event only once
--   it is resolved in the ledger (accepted, refused and held, held, or skipped);
-- * an aggregate's versions commit in version order (outbox.enqueue allocates them under the
--   aggregate's row lock), so every version below the one met first committed before the
--   run's start, or earlier in the same transaction (and then the stream met it first).
--
-- So every existing version below the one met is resolved, and the head is the highest of
-- them, in outbox.events or, once purged, in outbox.purged_events. One resolved without a
-- receipt (refused) has opened its aggregate's hold, which the relay knows from
-- outbox.holds, not from the head. A version that does not exist (a gap left by a caller)
-- leaves the head below it, as before. The simulator checks the rule: over a million traces
-- the head it reads is never above the highest version with a receipt below the one met
-- (`stream_heads_above_receipts`, docs/simulation.md), and without the purged rows
-- (`heads-without-purged`) events are lost.
--
-- Whole heads (no `below`: a snapshot, a hold's release, the start's second read) are read
-- from the receipts as before: there, rows that are not yet published exist.
--
-- This takes the last reader of outbox.receipts off the stream's path
-- (docs/evidence_batches.md).

CREATE OR REPLACE FUNCTION outbox.aggregate_heads_of(types text[], ids text[], below bigint[] DEFAULT NULL)
RETURNS TABLE (aggregate_type text, aggregate_id text, last_version bigint)
LANGUAGE sql STABLE AS $$
    SELECT k.t, k.i, GREATEST(
        (SELECT h.last_version FROM outbox.aggregate_heads h
         WHERE h.aggregate_type = k.t AND h.aggregate_id = k.i),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NULL
           AND e.aggregate_version < k.b
           AND CASE WHEN k.bounded THEN true
                    ELSE EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id) END
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT e.aggregate_version FROM outbox.events e
         WHERE e.aggregate_type = k.t AND e.aggregate_id = k.i AND e.delivery_set_id IS NOT NULL
           AND e.aggregate_version < k.b
           AND CASE WHEN k.bounded THEN true
                    ELSE EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id) END
         ORDER BY e.aggregate_version DESC LIMIT 1),
        (SELECT p.aggregate_version FROM outbox.purged_events p
         WHERE p.aggregate_type = k.t AND p.aggregate_id = k.i AND p.aggregate_version < k.b
         ORDER BY p.aggregate_version DESC LIMIT 1),
        0)
    FROM (SELECT u.t, u.i, u.b IS NOT NULL AS bounded,
                 coalesce(u.b, 9223372036854775807) AS b
          FROM unnest(types, ids, below) AS u(t, i, b)) k
$$;
