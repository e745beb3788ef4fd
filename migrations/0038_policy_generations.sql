-- outboxd migration 0038: policy generations, the route policy as an immutable row per change.
--
-- Why (issue 27, docs/versions_by_relay.md): for the writer's plain INSERT, the relay is to
-- give a row without a route version the route the policy in force at its commit gives it.
-- `outbox.route_versions` (in the publication since 0031) holds routes, not the policy: which
-- version an (aggregate type, event type) gets depends on every active rule, and
-- `outbox.route_policy` is updated in place. So every statement that changes the policy now
-- writes, in its own transaction, one row of `outbox.policy_generations` holding the active
-- rules as they then stand. The table is in the relay's publication, so the stream delivers
-- each generation at its position, before any row written after it; immutable, so a restart
-- can read the generation in force at its checkpoint by id. Nothing reads it yet.
--
-- `rules`: a JSON array of the active rules, each
-- {"aggregate_type", "event_type" (null: every type), "priority", "generation",
--  "route_version"}, in generation order; what `outbox_core::route::choose_route_version`
-- reads (`outbox_core::route::policy_rules_from_json`), held to `outbox.enqueue`'s choice by
-- the ledger's agreement test.

CREATE TABLE outbox.policy_generations (
    generation_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rules         jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE outbox.policy_generations IS
    'the active route rules after each change of outbox.route_policy, one immutable row per changing statement; a relay routes a row written without a route version by the generation in force at its commit';

CREATE FUNCTION outbox.refuse_policy_generation_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox.policy_generations is immutable (% refused): rows already written were routed by its rows', TG_OP
        USING ERRCODE = '55000',
              HINT = 'change the route policy (outbox.set_route or outbox.route_policy): that writes a new generation';
END
$$;
REVOKE EXECUTE ON FUNCTION outbox.refuse_policy_generation_change() FROM PUBLIC;

CREATE TRIGGER policy_generations_immutable
    BEFORE UPDATE OR DELETE ON outbox.policy_generations
    FOR EACH ROW EXECUTE FUNCTION outbox.refuse_policy_generation_change();
CREATE TRIGGER policy_generations_not_truncated
    BEFORE TRUNCATE ON outbox.policy_generations
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.refuse_policy_generation_change();

-- The active rules as they stand, as a generation holds them.
CREATE FUNCTION outbox.policy_rules() RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'aggregate_type', rp.aggregate_type, 'event_type', rp.event_type,
               'priority', rp.priority, 'generation', rp.generation,
               'route_version', rp.route_version) ORDER BY rp.generation), '[]'::jsonb)
    FROM outbox.route_policy rp
    WHERE rp.active
$$;

-- A new generation after every statement that changes the policy. SECURITY DEFINER: whoever
-- may change the route policy makes generations, without any right on the table itself; it
-- refuses to serve any other table, so it cannot be attached elsewhere to write rows.
CREATE FUNCTION outbox.note_policy_generation() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_RELID <> 'outbox.route_policy'::regclass OR TG_WHEN <> 'AFTER' OR TG_LEVEL <> 'STATEMENT' THEN
        RAISE EXCEPTION 'outbox.note_policy_generation fired on %.% (trigger %); it serves outbox.route_policy only',
            TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_NAME
            USING ERRCODE = '42501';
    END IF;
    INSERT INTO outbox.policy_generations (rules) VALUES (outbox.policy_rules());
    RETURN NULL;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox.note_policy_generation() FROM PUBLIC;

CREATE TRIGGER route_policy_generation
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.route_policy
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.note_policy_generation();

-- The policy as it stands when this migration runs: the first generation.
INSERT INTO outbox.policy_generations (rules) VALUES (outbox.policy_rules());

-- The relay's default publication carries the generations, as it carries the route versions
-- (0031); current relays ignore inserts of tables they do not read.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_pub' AND NOT puballtables)
       AND NOT EXISTS (SELECT 1 FROM pg_publication_tables
                       WHERE pubname = 'outbox_pub' AND schemaname = 'outbox'
                         AND tablename = 'policy_generations') THEN
        ALTER PUBLICATION outbox_pub ADD TABLE outbox.policy_generations;
    END IF;
END
$$;
