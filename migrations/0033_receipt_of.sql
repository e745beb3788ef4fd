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
