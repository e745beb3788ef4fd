-- outboxd migration 0037: where the broker stores the last transaction record a slot's
-- acceptance took in (exactly-once into Kafka, docs/exactly_once.md, step 2).
--
-- In exactly-once mode every batch of events is one Kafka transaction, committed with a
-- record of its receipts in the positions topic (outbox_sink::kafka_txn). A relay that
-- crashed between the broker's commit and the ledger's acceptance must not send that batch
-- again: at start it reads the batches committed after the last record the ledger accepted
-- and accepts them from their records. That record's position (partition, offset) is kept on
-- the slot's checkpoint row, written in the acceptance transaction that takes the batch's
-- receipts in, under the row lock every acceptance takes first (migration 0034), and only
-- ever raised. A slot's records are keyed by the slot, so they are in one partition; NULL: no
-- record accepted (the mode never ran, or not yet). Adding nullable columns without a default
-- rewrites nothing, and the relay's role may write them already (it updates the row).

-- Every acceptance locks a row of outbox.checkpoints; the table's lock is taken without
-- waiting in the queue behind them (and without holding the acceptances up behind a long
-- transaction meanwhile): NOWAIT, retried 10 ms later for at most 60 s (as in 0031).
DO $$
BEGIN
    FOR attempt IN 1..6000 LOOP
        BEGIN
            LOCK TABLE outbox.checkpoints IN ACCESS EXCLUSIVE MODE NOWAIT;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM pg_sleep(0.01);
        END;
    END LOOP;
    RAISE EXCEPTION 'migration 0037 could not lock outbox.checkpoints within 60 s: a transaction holds it all along'
        USING ERRCODE = '55P03', HINT = 'find it in pg_locks (a long transaction or an idle-in-transaction session) and run outboxd migrate again';
END
$$;

ALTER TABLE outbox.checkpoints
    ADD COLUMN txn_record_partition integer,
    ADD COLUMN txn_record_offset bigint,
    ADD CONSTRAINT checkpoints_txn_record_check CHECK (
        (txn_record_partition IS NULL) = (txn_record_offset IS NULL)
        AND coalesce(txn_record_partition, 0) >= 0 AND coalesce(txn_record_offset, 0) >= 0);

COMMENT ON COLUMN outbox.checkpoints.txn_record_offset IS
    'exactly-once mode: the positions-topic offset (in partition txn_record_partition) of the last transaction record whose batch this slot accepted; a restart accepts the batches committed after it from their records instead of sending them again';
