-- outboxd migration 0004: relay leases and generations.
--
-- One row per slot. A relay streams from the slot only while it holds the lease; acquiring
-- it (compare-and-set on an expired lease) bumps the generation. A relay whose generation is
-- no longer current may not send and may not move the checkpoint; what it already sent is
-- still accepted (as primary or duplicate receipts), since the broker did take it.
CREATE TABLE outbox.relay_leases (
    slot_name    text PRIMARY KEY,
    owner        text NOT NULL,
    generation   bigint NOT NULL,
    lease_until  timestamptz NOT NULL,
    acquired_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

ALTER TABLE outbox.checkpoints ADD COLUMN relay_generation bigint;
