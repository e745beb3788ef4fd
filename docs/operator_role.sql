-- The operator's role: what `outboxd status`, `reconcile`, `purge`, `consumers`, `share`,
-- `shadow`, `migrate-destination`, `release` and `skip` need, and the routes
-- (outbox.set_route and its siblings).
--
-- Run it as a superuser (or the owner of schema outbox), in the database that holds the
-- outbox, AFTER `outboxd migrate` (and again after a later migrate: it grants on every table
-- that exists when it runs); then grant the role to each operator's login role:
--
--     psql "$OWNER_URL" -v ON_ERROR_STOP=1 -f docs/operator_role.sql
--     psql "$OWNER_URL" -c "GRANT outboxd_operator TO alice"
--
-- What it can do, and what it cannot:
--   * read every table and view of schema outbox (status, audits, consumers, shares);
--   * write the ledger and the operator's tables: receipts (reconcile records what it finds on
--     the broker), quarantine and holds (release, skip), destination migrations, consumers and
--     their watermarks, dispatch shares, routes, purge records;
--   * DELETE on outbox.events, for `outboxd purge` only: events whose receipt is older than the
--     replay window and that every mandatory consumer has passed;
--   * not INSERT or UPDATE on outbox.events (an operator neither invents nor rewrites an event:
--     a destination is moved with `outboxd migrate-destination`, which records why), nor write
--     outbox.aggregate_versions or outbox.schema_migrations; no DDL, no REPLICATION.
-- The relay's own role (docs/least_privilege.sql) does not need this; a relay that purges in
-- the background (`[retention] purge_interval`) needs the purge's grants, which `outboxd
-- check` and `outboxd run` name when they are missing.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outboxd_operator') THEN
        CREATE ROLE outboxd_operator NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL; -- created by a concurrent run of this script
END
$$;

GRANT USAGE ON SCHEMA outbox TO outboxd_operator;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA outbox TO outboxd_operator;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA outbox TO outboxd_operator;
REVOKE INSERT, UPDATE ON outbox.events FROM outboxd_operator;
REVOKE INSERT, UPDATE, DELETE ON outbox.aggregate_versions, outbox.aggregate_versions_intact,
                                  outbox.schema_migrations
    FROM outboxd_operator;
-- `share take` / `give-back`: the ownership canary in the poller's table, and marking the rows
-- outboxd takes (migration 0025; each checks its row is a canary, or outboxd's).
GRANT EXECUTE ON FUNCTION outbox.poller_canary_start(regclass, text),
                          outbox.poller_canary_state(uuid),
                          outbox.poller_canary_end(uuid),
                          outbox.mark_taken(regclass, uuid)
    TO outboxd_operator;
