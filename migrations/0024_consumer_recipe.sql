-- outboxd migration 0024: the consumer recipe as functions, so every language runs the same
-- decisions (docs/consumers.md).
--
-- A consumer in any language records a message and learns what to do with it in one call, in
-- the transaction that will hold its effect:
--
--   SELECT outbox.inbox_receive(consumer_id, event_id, aggregate_type, aggregate_id,
--                               aggregate_version, event_type, topic, partition, "offset",
--                               gap_policy)
--
-- returns 'apply' (run the effect in this transaction, COMMIT, then commit the offset),
-- 'apply_with_gap' (the same; policy 'report' recorded the gap in outbox.consumer_gaps),
-- 'duplicate' or 'stale' (no effect: COMMIT, then commit the offset), or raises SQLSTATE
-- OX001 for a gap under policy 'reject' (the transaction is aborted: ROLLBACK, do not commit
-- the offset, stop or seek back to this message). The inbox row, the aggregate watermark and
-- the partition watermark move inside the call, exactly as outbox_inbox::store::process moves
-- them (crates/outbox-inbox/tests/store.rs runs both over the same messages). Policy 'buffer'
-- holds events in a consumer's memory; in SQL it is 'reject' with a seek back.
--
-- These statements are also part of what `outbox_inbox::store::install` runs in a consumer's
-- own database (docs/consumer_inbox.sql), so they are idempotent.

CREATE OR REPLACE FUNCTION outbox.inbox_receive(
    p_consumer_id       text,
    p_event_id          uuid,
    p_aggregate_type    text,
    p_aggregate_id      text,
    p_aggregate_version bigint,
    p_event_type        text,
    p_topic             text,
    p_partition         integer,
    p_offset            bigint,
    p_gap_policy        text DEFAULT 'reject'
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_last     bigint;
    v_expected bigint;
    v_result   text := 'duplicate';
BEGIN
    IF p_gap_policy IS NULL OR p_gap_policy NOT IN ('reject', 'report') THEN
        RAISE EXCEPTION 'outbox.inbox_receive: gap policy must be ''reject'' or ''report'', got %', quote_nullable(p_gap_policy)
            USING ERRCODE = '22023',
                  HINT = 'policy buffer holds events in the consumer''s memory; in SQL use reject and read the message again later';
    END IF;
    IF p_consumer_id IS NULL OR p_event_id IS NULL OR p_topic IS NULL OR p_partition IS NULL
       OR p_offset IS NULL THEN
        RAISE EXCEPTION 'outbox.inbox_receive: consumer_id, event_id (header id), topic, partition and offset are required'
            USING ERRCODE = '22004';
    END IF;

    INSERT INTO outbox.inbox (consumer_id, event_id, aggregate_type, aggregate_id,
                              aggregate_version, event_type, topic, partition, "offset")
    VALUES (p_consumer_id, p_event_id, p_aggregate_type, p_aggregate_id, p_aggregate_version,
            p_event_type, p_topic, p_partition, p_offset)
    ON CONFLICT (consumer_id, event_id) DO NOTHING;

    IF FOUND THEN
        SELECT h.last_version INTO v_last FROM outbox.consumer_aggregate_heads h
        WHERE h.consumer_id = p_consumer_id AND h.aggregate_type = p_aggregate_type
          AND h.aggregate_id = p_aggregate_id
        FOR UPDATE;
        v_expected := coalesce(v_last, 0) + 1;
        v_result := 'apply';
        IF v_last IS NOT NULL AND p_aggregate_version <= v_last THEN
            -- A new id for a version already applied: recorded, not applied.
            v_result := 'stale';
            UPDATE outbox.inbox SET outcome = 'STALE'
            WHERE consumer_id = p_consumer_id AND event_id = p_event_id;
        ELSIF p_aggregate_version IS DISTINCT FROM v_expected THEN
            IF p_gap_policy = 'reject' THEN
                RAISE EXCEPTION 'outbox.inbox_receive: version gap in aggregate %/% for consumer %: expected version %, got % (event %); nothing was recorded',
                    p_aggregate_type, p_aggregate_id, p_consumer_id, v_expected,
                    coalesce(p_aggregate_version::text, 'none'), p_event_id
                    USING ERRCODE = 'OX001',
                          HINT = 'ROLLBACK and do not commit the Kafka offset: stop, or seek back to this message and read it again after the missing versions';
            END IF;
            v_result := 'apply_with_gap';
            INSERT INTO outbox.consumer_gaps (consumer_id, aggregate_type, aggregate_id,
                                              expected_version, got_version, event_id)
            VALUES (p_consumer_id, p_aggregate_type, p_aggregate_id, v_expected,
                    p_aggregate_version, p_event_id);
            UPDATE outbox.inbox SET outcome = 'GAP_REPORTED'
            WHERE consumer_id = p_consumer_id AND event_id = p_event_id;
        END IF;
        IF v_result <> 'stale' THEN
            INSERT INTO outbox.consumer_aggregate_heads AS h
                (consumer_id, aggregate_type, aggregate_id, last_version)
            VALUES (p_consumer_id, p_aggregate_type, p_aggregate_id, p_aggregate_version)
            ON CONFLICT (consumer_id, aggregate_type, aggregate_id) DO UPDATE
            SET last_version = greatest(h.last_version, EXCLUDED.last_version),
                updated_at = clock_timestamp();
        END IF;
    END IF;

    -- Every message below next_offset was applied or recognised (duplicate, stale).
    INSERT INTO outbox.consumer_watermarks AS w (consumer_id, topic, partition, next_offset)
    VALUES (p_consumer_id, p_topic, p_partition, p_offset + 1)
    ON CONFLICT (consumer_id, topic, partition) DO UPDATE
    SET next_offset = greatest(w.next_offset, EXCLUDED.next_offset),
        updated_at = clock_timestamp();
    RETURN v_result;
END
$$;

-- A consumer whose database is not the outbox's publishes its partition watermarks to the
-- outbox's database with this (values read from its own outbox.consumer_watermarks), so
-- retention and `outboxd reconcile` see its progress. Only moves forward: a late or repeated
-- call can only under-report.
CREATE OR REPLACE FUNCTION outbox.publish_watermark(
    p_consumer_id text, p_topic text, p_partition integer, p_next_offset bigint
) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO outbox.consumer_watermarks AS w (consumer_id, topic, partition, next_offset)
    VALUES (p_consumer_id, p_topic, p_partition, p_next_offset)
    ON CONFLICT (consumer_id, topic, partition) DO UPDATE
    SET next_offset = greatest(w.next_offset, EXCLUDED.next_offset),
        updated_at = clock_timestamp();
$$;
