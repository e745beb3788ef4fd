-- The producer's role: what an application needs to call outbox.enqueue and
-- outbox.enqueue_set, and nothing else of the outbox.
--
-- Run it as a superuser (or the owner of schema outbox), in the database that holds the
-- outbox, AFTER `outboxd migrate`; then grant the role to the application's login role:
--
--     psql "$OWNER_URL" -v ON_ERROR_STOP=1 -f docs/producer_role.sql
--     psql "$OWNER_URL" -c "GRANT outboxd_producer TO app"
--
-- Re-running it is harmless. outbox.enqueue runs with its caller's rights (it is not SECURITY
-- DEFINER: a function any role could execute would let any role write events), so the
-- application's role needs what the function itself does:
--   * USAGE on schema outbox;
--   * SELECT on outbox.route_policy: the route an event is frozen to;
--   * SELECT, INSERT, UPDATE on outbox.aggregate_versions: the per-aggregate version upsert,
--     whose row lock orders the writers of one aggregate;
--   * INSERT on outbox.events (and outbox.delivery_sets for outbox.enqueue_set): the event.
-- No SELECT on outbox.events, no UPDATE or DELETE on it, nothing on the ledger: a producer
-- can add events, never read, change or acknowledge them. Rows inserted into outbox.events
-- directly (around outbox.enqueue) are checked by a trigger that runs as the owner.
-- Capture of a Debezium-style or poller's table needs none of this: the capture trigger runs
-- as the owner, and the application keeps writing its own table.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outboxd_producer') THEN
        CREATE ROLE outboxd_producer NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL; -- created by a concurrent run of this script
END
$$;

GRANT USAGE ON SCHEMA outbox TO outboxd_producer;
GRANT SELECT ON outbox.route_policy TO outboxd_producer;
GRANT SELECT, INSERT, UPDATE ON outbox.aggregate_versions TO outboxd_producer;
GRANT INSERT ON outbox.events, outbox.delivery_sets TO outboxd_producer;
-- The next version of an aggregate the version table has no row for is 1 while the table is
-- intact (its mark, outbox.aggregate_versions_intact), else after the highest one the rows
-- hold, which these two read for the producer (the table is unlogged: a crash of the server
-- empties it; migration 0032).
GRANT EXECUTE ON FUNCTION outbox.last_version_written(text, text, uuid),
                          outbox.next_aggregate_version(text, text)
    TO outboxd_producer;
GRANT SELECT ON outbox.aggregate_versions_intact TO outboxd_producer;
