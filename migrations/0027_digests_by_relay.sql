-- outboxd migration 0027: the relay computes an event's digests from its immutable row;
-- outbox.enqueue no longer does.
--
-- An event's two digests (sha256 of the payload's text, sha256 of its frozen destination's
-- canonical text) prove that what reaches the broker is what the business transaction
-- committed. Until now outbox.enqueue computed both in the producer's transaction, and the
-- relay computed both again from the decoded row and quarantined the event when they differed:
-- each writer paid two SHA-256 calls and 142 bytes more of row and WAL per event for a check
-- the relay repeats anyway (docs/benchmarks.md, "Producer").
--
-- What the stored digests guarded against is a row that differs from what was committed:
-- altered afterwards, or written around outbox.enqueue with a wrong digest. This migration
-- makes the first impossible and keeps the second checked:
--
-- * outbox.events is immutable: an UPDATE of any row is refused, by any role, with an error
--   naming the event (a destination is moved with `outboxd migrate-destination`, which writes
--   outbox.destination_migrations, never the row). DELETE stays: it is how purge removes
--   published rows, and the producer roles are not granted it.
-- * the digest columns may be NULL. outbox.enqueue writes NULL; the relay computes both
--   digests from the row it decoded (which, committed and immutable, is the row in the table)
--   and carries them in the receipt, as before. A row that does carry digests (written by
--   outbox.enqueue_set, a capture trigger, an earlier version, or by hand) is checked against
--   them as before and quarantined when they differ.
-- * the acceptance compares a receipt's digests with the row's where the row has them; an
--   event whose row has none is matched by its id (and its destination generation's digest,
--   which outboxd migrate-destination still stores).
--
-- Readers that need a row's digest (the audit, purge's record, the tests' broker checks) take
-- the stored one, else the primary receipt's, else compute it: outbox.payload_digest_of.

ALTER TABLE outbox.events ALTER COLUMN payload_digest DROP NOT NULL;
ALTER TABLE outbox.events ALTER COLUMN destination_digest DROP NOT NULL;

CREATE FUNCTION outbox.refuse_event_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox.events: event % is immutable once written (UPDATE refused); the relay proves what it publishes from the committed row',
        OLD.event_id
        USING ERRCODE = '55000',
              HINT = 'move an event to another destination with `outboxd migrate-destination`; quarantine or skip it with `outboxd quarantine`; to correct an event, enqueue a new one';
END
$$;

-- As every trigger function of schema outbox (migration 0021): no role but the owner may put
-- it on a table.
REVOKE EXECUTE ON FUNCTION outbox.refuse_event_update() FROM PUBLIC;

CREATE TRIGGER events_immutable
    BEFORE UPDATE ON outbox.events
    FOR EACH ROW
    EXECUTE FUNCTION outbox.refuse_event_update();

-- An event's digests as the relay computes them, for readers of rows without stored ones
-- (outbox.events_current keeps the stored values, NULL included: the relay reads it and
-- computes what is missing itself).
CREATE FUNCTION outbox.payload_digest_of(payload jsonb, stored text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(stored, outbox.sha256_text(payload::text))
$$;

CREATE FUNCTION outbox.destination_digest_of(e outbox.events_current) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce(e.destination_digest,
                    outbox.sha256_text(outbox.destination_canonical(
                        e.dest_kind, e.dest_cluster, e.dest_topic, e.dest_key,
                        e.dest_partitioner, e.dest_route_generation, e.dest_serializer,
                        e.dest_acks)))
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    tenant         text  DEFAULT NULL,
    headers        jsonb DEFAULT NULL,
    payload_schema text  DEFAULT NULL,
    event_id       uuid  DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id        uuid := coalesce(enqueue.event_id, outbox.uuid_v7());
    v_kind      text;
    v_cluster   text;
    v_topic     text;
    v_part      text;
    v_gen       bigint;
    v_ser       text;
    v_acks      text;
BEGIN
    IF coalesce(enqueue.aggregate_type, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: aggregate_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF coalesce(enqueue.aggregate_id, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: aggregate_id must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF coalesce(enqueue.event_type, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: event_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox.enqueue: payload must not be NULL (use ''{}''::jsonb for an empty payload)' USING ERRCODE = '22004';
    END IF;
    IF enqueue.headers IS NOT NULL AND jsonb_typeof(enqueue.headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox.enqueue: headers must be a JSON object of strings, got %', jsonb_typeof(enqueue.headers) USING ERRCODE = '22023';
    END IF;

    -- The route: as outbox.route_template chooses it.
    SELECT rp.broker_kind, rp.broker_cluster, rp.topic, rp.partitioner, rp.generation,
           rp.serializer, rp.required_acks
      INTO v_kind, v_cluster, v_topic, v_part, v_gen, v_ser, v_acks
    FROM outbox.route_policy rp
    WHERE rp.active
      AND (rp.aggregate_type IS NULL OR rp.aggregate_type = enqueue.aggregate_type)
      AND (rp.event_type IS NULL OR rp.event_type = enqueue.event_type)
    ORDER BY (rp.aggregate_type IS NOT NULL) DESC, (rp.event_type IS NOT NULL) DESC,
             rp.priority DESC, rp.generation DESC
    LIMIT 1;
    IF NOT FOUND THEN
        v_kind := 'kafka'; v_cluster := 'default'; v_topic := 'outbox.event.{aggregate_type}';
        v_part := 'murmur2_random'; v_gen := 0; v_ser := 'json'; v_acks := 'all';
    END IF;

    -- The placeholders replaced, each value encoded for its place (or refused), before the
    -- destination is frozen (migration 0023).
    IF v_kind = 'kafka' AND v_topic = 'outbox.event.{aggregate_type}'
       AND length(enqueue.aggregate_type) <= 236
       AND enqueue.aggregate_type !~ '[^A-Za-z0-9._-]' THEN
        v_topic := 'outbox.event.' || enqueue.aggregate_type;
    ELSE
        v_topic := outbox.render_destination(v_kind, v_topic, enqueue.aggregate_type, enqueue.aggregate_id);
    END IF;

    -- Not a row around outbox.enqueue (trigger events_row_around_enqueue).
    PERFORM set_config('outbox.enqueuing', v_id::text, true);
    -- The version upsert's row lock, held until the producing transaction ends, serialises the
    -- writers of one aggregate (migration 0001). The digests are the relay's (see above).
    WITH v AS (
        INSERT INTO outbox.aggregate_versions AS av (aggregate_type, aggregate_id, last_version)
        VALUES (enqueue.aggregate_type, enqueue.aggregate_id, 1)
        ON CONFLICT ON CONSTRAINT aggregate_versions_pkey
        DO UPDATE SET last_version = av.last_version + 1
        RETURNING av.last_version
    )
    INSERT INTO outbox.events (
        event_id, envelope_generation, aggregate_type, aggregate_id, aggregate_version,
        event_type, payload_schema, payload, tenant, headers,
        dest_kind, dest_cluster, dest_topic, dest_key, dest_partitioner,
        dest_route_generation, dest_serializer, dest_acks)
    SELECT
        v_id, 1, enqueue.aggregate_type, enqueue.aggregate_id, v.last_version,
        enqueue.event_type, enqueue.payload_schema, enqueue.payload,
        enqueue.tenant, enqueue.headers,
        v_kind, v_cluster, v_topic, enqueue.aggregate_id, v_part,
        v_gen, v_ser, v_acks
    FROM v;
    RETURN v_id;
END
$$;
