-- outboxd migration 0011: a receipt is a position on the broker, or it is nothing.
--
-- librdkafka can report a message as delivered that the broker never stored (the idempotent
-- producer's implicit ack of a failed batch, offset -1001). The relay no longer turns such a
-- report into a receipt (it is DISPATCH_UNKNOWN and resolved by a partition scan); these
-- constraints are the backstop: no primary or duplicate receipt can hold a negative partition
-- or offset.
--
-- A database that already holds such a receipt keeps it (dropping it would let the checkpoint
-- stand past an event nobody can prove was published): the constraints are added NOT VALID
-- (enforced for every new row) and validated only when no old row breaks them. Otherwise a
-- WARNING names the count; `outboxd reconcile --audit-receipts all` lists those receipts as
-- findings, event by event.

ALTER TABLE outbox.receipts
    ADD CONSTRAINT receipts_position_check CHECK (partition >= 0 AND "offset" >= 0) NOT VALID;
ALTER TABLE outbox.duplicate_receipts
    ADD CONSTRAINT duplicate_receipts_position_check CHECK (partition >= 0 AND "offset" >= 0) NOT VALID;

DO $$
DECLARE
    bad bigint;
BEGIN
    SELECT count(*) INTO bad FROM outbox.receipts WHERE partition < 0 OR "offset" < 0;
    IF bad = 0 THEN
        ALTER TABLE outbox.receipts VALIDATE CONSTRAINT receipts_position_check;
    ELSE
        RAISE WARNING 'outbox.receipts holds % primary receipt(s) without a broker position (negative partition or offset): these events are not proven published; run `outboxd reconcile --audit-receipts all`', bad;
    END IF;
    SELECT count(*) INTO bad FROM outbox.duplicate_receipts WHERE partition < 0 OR "offset" < 0;
    IF bad = 0 THEN
        ALTER TABLE outbox.duplicate_receipts VALIDATE CONSTRAINT duplicate_receipts_position_check;
    ELSE
        RAISE WARNING 'outbox.duplicate_receipts holds % receipt(s) without a broker position', bad;
    END IF;
END $$;

-- The same transport receipt is recorded once. A duplicate transport receipt is a *different*
-- ACK (another attempt, another relay generation, another position); the same ACK written
-- twice (a batch replayed after its commit) is not new evidence. Earlier versions could write
-- one when an acceptance was fenced after its commit: those repeats are removed here.
DELETE FROM outbox.duplicate_receipts d
USING outbox.duplicate_receipts k
WHERE d.event_id = k.event_id AND d.broker_cluster = k.broker_cluster AND d.topic = k.topic
  AND d.partition = k.partition AND d."offset" = k."offset" AND d.attempt = k.attempt
  AND d.relay_generation = k.relay_generation AND d.id > k.id;
DELETE FROM outbox.duplicate_receipts d
USING outbox.receipts r
WHERE d.event_id = r.event_id AND d.broker_cluster = r.broker_cluster AND d.topic = r.topic
  AND d.partition = r.partition AND d."offset" = r."offset" AND d.attempt = r.attempt
  AND d.relay_generation = r.relay_generation;
CREATE UNIQUE INDEX duplicate_receipts_ack_key ON outbox.duplicate_receipts
    (event_id, broker_cluster, topic, partition, "offset", attempt, relay_generation);
