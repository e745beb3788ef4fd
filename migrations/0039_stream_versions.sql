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
