-- outboxd migration 0039: the relay's numbering of rows written without a version, kept
-- with the checkpoint.
--
-- Why (issue 27, docs/versions_by_relay.md): for the writer's plain INSERT the relay gives a
-- row without an aggregate version its aggregate's last version + 1, in commit order (the
-- stream's order). A run streams from its slot's checkpoint C, so what a restart needs is,
-- per aggregate, the version of its last row committed before C. The acceptance transaction
-- that moves the checkpoint to C writes exactly that for the aggregates the run numbered
-- since its last checkpoint (`outbox_core::numbering::Numbering::checkpoint`), and a run
-- reads it when it first meets an aggregate. One row per (slot, aggregate): an upsert per
-- aggregate per checkpoint, cheap for hot aggregates and about one per event for a drain over
-- many; a cheaper store is to be priced against this one (the numbering log of
-- docs/versions_by_relay.md). Rows only rise (`GREATEST`), so a late write for an older
-- checkpoint cannot lower what a newer one wrote.
--
-- `outbox.checkpoints.policy_generation`: the route policy generation (migration 0038) in
-- force at the checkpoint, written with it, from which a restart follows the stream's
-- generations; NULL until a relay that routes by generation has written one.
--
-- Nothing writes either yet (the relay does not number rows in this build); the relay's role
-- gets the rights now so that an upgrade to the build that does needs no new grant.

CREATE TABLE outbox.stream_versions (
    slot_name      text   NOT NULL,
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    version        bigint NOT NULL CHECK (version >= 1),
    PRIMARY KEY (slot_name, aggregate_type, aggregate_id)
);

COMMENT ON TABLE outbox.stream_versions IS
    'per slot and aggregate, the version the relay gave its last row committed before the slot''s checkpoint (rows written without a version; written in the transaction that moves the checkpoint)';

ALTER TABLE outbox.checkpoints ADD COLUMN policy_generation bigint;

COMMENT ON COLUMN outbox.checkpoints.policy_generation IS
    'the outbox.policy_generations row in force at confirmed_lsn, written with it';

-- Whoever may update the checkpoints (a relay's role, docs/least_privilege.sql) may keep the
-- numbering and read the generations too.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT quote_ident(ro.rolname) AS grantee
             FROM pg_class c
             CROSS JOIN LATERAL aclexplode(c.relacl) a
             JOIN pg_roles ro ON ro.oid = a.grantee
             WHERE c.oid = 'outbox.checkpoints'::regclass AND a.privilege_type = 'UPDATE'
               AND a.grantee <> c.relowner LOOP
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.stream_versions TO %s',
                       r.grantee);
        EXECUTE format('GRANT SELECT ON outbox.policy_generations TO %s', r.grantee);
    END LOOP;
END
$$;

-- Policy generations in commit order (a fix to migration 0038). Two transactions that changed
-- the route policy at once each wrote the rules their own snapshot saw, so the later
-- generation lacked the other's change: a relay routing by generations would have routed by
-- a policy that never stood. Now the trigger takes a lock held to the end of the changing
-- transaction before it reads the rules: generations commit one at a time, in id order, and
-- under READ COMMITTED each reads every change committed before it. Under REPEATABLE READ
-- or SERIALIZABLE the snapshot predates the lock; when a generation id was handed out that
-- the snapshot does not see, the change is refused as a serialization failure (retry it).
CREATE OR REPLACE FUNCTION outbox.note_policy_generation() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_seen bigint;
    v_issued bigint;
BEGIN
    IF TG_RELID <> 'outbox.route_policy'::regclass OR TG_WHEN <> 'AFTER' OR TG_LEVEL <> 'STATEMENT' THEN
        RAISE EXCEPTION 'outbox.note_policy_generation fired on %.% (trigger %); it serves outbox.route_policy only',
            TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_NAME
            USING ERRCODE = '42501';
    END IF;
    LOCK TABLE outbox.policy_generations IN SHARE ROW EXCLUSIVE MODE;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        SELECT max(generation_id) INTO v_seen FROM outbox.policy_generations;
        SELECT CASE WHEN is_called THEN last_value END INTO v_issued
        FROM outbox.policy_generations_generation_id_seq;
        IF v_issued IS DISTINCT FROM v_seen THEN
            RAISE EXCEPTION 'outbox.route_policy changed by another transaction since this one''s snapshot (policy generation % is not visible to it)',
                v_issued
                USING ERRCODE = '40001',
                      HINT = 'retry the transaction; its new snapshot includes the other change';
        END IF;
    END IF;
    INSERT INTO outbox.policy_generations (rules) VALUES (outbox.policy_rules());
    RETURN NULL;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox.note_policy_generation() FROM PUBLIC;

-- The writer's plain INSERT (docs/versions_by_relay.md) is a row without an aggregate version:
-- the rows-around-enqueue trigger (0016) is not for it (its WHEN now tests the version first).
DROP TRIGGER events_row_around_enqueue ON outbox.events;
CREATE TRIGGER events_row_around_enqueue
    AFTER INSERT ON outbox.events
    FOR EACH ROW
    WHEN (NEW.aggregate_version IS NOT NULL
          AND NEW.event_id::text IS DISTINCT FROM current_setting('outbox.enqueuing', true))
    EXECUTE FUNCTION outbox.note_row_around_enqueue();

-- Rows without a version exist only where the outbox's owner allows them. Allowing them also
-- drops that trigger: even with a false WHEN, an AFTER ROW trigger costs every INSERT
-- statement the compilation of its condition, ~30% of a plain row's insert (docs/benchmarks.md,
-- "The writer's plain INSERT, built"). A row written by hand with a version is then checked by
-- the relay instead of at insert (a gap holds its aggregate, a malformed destination is
-- quarantined, a reused version is refused by the rows' key, which no longer holds rows
-- without a version). Disallowing them again restores the trigger and NOT NULL, and fails while
-- rows without a version exist (the key stays as it is: without such rows it is the same key).
CREATE FUNCTION outbox.allow_plain_inserts(allow boolean) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF allow THEN
        ALTER TABLE outbox.events ALTER COLUMN aggregate_version DROP NOT NULL;
        DROP TRIGGER IF EXISTS events_row_around_enqueue ON outbox.events;
        -- The rows' key (aggregate, version) holds no row without a version: such a row has
        -- no version to keep unique, and its entry, at a random place in a large index, cost
        -- the fast path a quarter of its throughput (docs/benchmarks.md, "The writer's plain
        -- INSERT, built"). Rebuilt once; writers wait while it is built.
        IF NOT EXISTS (SELECT 1 FROM pg_indexes
                       WHERE schemaname = 'outbox' AND indexname = 'events_aggregate_version_key'
                         AND indexdef LIKE '%(aggregate_version IS NOT NULL)%') THEN
            CREATE UNIQUE INDEX events_aggregate_version_key_versioned
                ON outbox.events (aggregate_type, aggregate_id, aggregate_version)
                WHERE delivery_set_id IS NULL AND aggregate_version IS NOT NULL;
            DROP INDEX outbox.events_aggregate_version_key;
            ALTER INDEX outbox.events_aggregate_version_key_versioned
                RENAME TO events_aggregate_version_key;
        END IF;
        RETURN 'outbox.events takes plain INSERTs (aggregate_type, aggregate_id, event_type, payload); a relay in CDC mode numbers and routes them; poll mode refuses this outbox';
    END IF;
    ALTER TABLE outbox.events ALTER COLUMN aggregate_version SET NOT NULL;
    DROP TRIGGER IF EXISTS events_row_around_enqueue ON outbox.events;
    CREATE TRIGGER events_row_around_enqueue
        AFTER INSERT ON outbox.events
        FOR EACH ROW
        WHEN (NEW.aggregate_version IS NOT NULL
              AND NEW.event_id::text IS DISTINCT FROM current_setting('outbox.enqueuing', true))
        EXECUTE FUNCTION outbox.note_row_around_enqueue();
    RETURN 'outbox.events takes events through outbox.enqueue (or rows with a version and a destination) only';
END
$$;
REVOKE EXECUTE ON FUNCTION outbox.allow_plain_inserts(boolean) FROM PUBLIC;

-- An unclear attempt of a row written without a version keeps the version and route version
-- the relay gave it: read from SQL the row has neither, and its look-up must publish it as
-- the relay did (the simulator found a relay stopping on such a row otherwise).
ALTER TABLE outbox.attempts ADD COLUMN relay_version bigint, ADD COLUMN relay_route_version bigint;

-- A plain INSERT names no event id: it gets a time-ordered one, as outbox.enqueue gives.
ALTER TABLE outbox.events ALTER COLUMN event_id SET DEFAULT outbox.uuid_v7();
