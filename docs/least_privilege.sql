-- Least-privilege role for `outboxd run`.
--
-- Run it as a superuser (or the owner of schema outbox), in the database that holds the
-- outbox, AFTER `outboxd migrate` (run migrations as the schema owner, not as this role):
--
--     psql "$ADMIN_URL" -v ON_ERROR_STOP=1 -f docs/least_privilege.sql
--     psql "$ADMIN_URL" -c "ALTER ROLE outboxd_relay PASSWORD 'from-your-secret-store'"
--
-- then run the relay as outboxd_relay. Re-running the script is harmless. Re-run it after a
-- later `outboxd migrate` that adds ledger tables (`outboxd check` names any missing grant).
--
-- What the role can do, and why each grant is needed:
--   * REPLICATION: open the walsender connection, create/drop the logical slot, emit the
--     heartbeat (pg_logical_emit_message). It does not make the role a superuser, but it is
--     much more than "read the publication": table privileges do not apply to logical
--     decoding. With REPLICATION the role can, in every database it may connect to,
--       - create a slot with any output plugin, over SQL or a walsender
--         (SELECT pg_create_logical_replication_slot('spy', 'test_decoding')), and read every
--         change committed after it to EVERY table of that database, with its values
--         (pg_logical_slot_get_changes('spy', NULL, NULL)): card numbers, password hashes;
--       - drop or advance other slots (another consumer's, losing its position);
--       - where pg_hba.conf has a `replication` line that matches it: stream the physical WAL
--         or take a base backup (pg_basebackup) — a copy of the whole cluster, every database.
--     How to restrict it:
--       - pg_hba.conf: no `replication` line for this role (physical replication and base
--         backups refused; outboxd needs none: its walsender is a logical one, matched by the
--         database's own line), and a database line for the outbox's database only, e.g.
--             host  replication  outboxd_relay  all           reject
--             host  app          outboxd_relay  10.0.0.0/24   scram-sha-256
--         (rules are read top-down: put these above any broader `all` line);
--       - or run without REPLICATION at all: poll mode (`outboxd run --mode poll`) reads only
--         the outbox tables granted below. Then `ALTER ROLE outboxd_relay NOREPLICATION`.
--     No grant removes decoding of the outbox database's other tables from a role that keeps
--     REPLICATION: if that is unacceptable, use poll mode.
--   * SELECT on outbox.events (+ the views over it): the initial snapshot, released and
--     reconciled events. No INSERT/UPDATE/DELETE: the relay can never alter an event.
--   * SELECT/INSERT/UPDATE/DELETE on the ledger tables only (receipt entries and batches,
--     duplicate receipts, quarantine, checkpoints, ordering heads, holds, leases, attempts),
--     USAGE on their id sequences; SELECT/INSERT on receipt destinations (created on first
--     use, never changed); SELECT on the view outbox.receipts (migration 0030).
--   * Nothing on route_policy, aggregate_versions, destination_migrations, delivery_sets or
--     schema_migrations beyond reading: routing and enqueueing belong to producers and operators.
--     (Poll mode reads aggregate_versions to find pending events, and writes its own ledger
--     tables poll_positions and poll_rounds; it needs no REPLICATION: `ALTER ROLE
--     outboxd_relay NOREPLICATION` if it only ever polls.)
--   * The publication (outbox_pub) is created by `outboxd migrate`; this role does not own
--     outbox.events, so it could not create one itself.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outboxd_relay') THEN
        CREATE ROLE outboxd_relay LOGIN REPLICATION;
    END IF;
END
$$;
ALTER ROLE outboxd_relay LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS;

DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO outboxd_relay', current_database());
END
$$;

GRANT USAGE ON SCHEMA outbox TO outboxd_relay;

-- Read-only: the outbox and what describes it.
GRANT SELECT ON
    outbox.aggregate_versions,
    outbox.events,
    outbox.events_current,
    outbox.events_frozen,
    outbox.route_versions,
    outbox.event_status,
    outbox.receipts,
    outbox.purged_events,
    outbox.schema_migrations,
    outbox.route_policy,
    outbox.policy_generations,
    outbox.destination_migrations,
    outbox.delivery_sets
TO outboxd_relay;

-- Read-write: the ledger.
GRANT SELECT, INSERT, UPDATE, DELETE ON
    outbox.receipt_entries,
    outbox.receipt_batches,
    outbox.duplicate_receipts,
    outbox.quarantine,
    outbox.checkpoints,
    outbox.accepted_positions,
    outbox.stream_versions,
    outbox.aggregate_heads,
    outbox.head_journal,
    outbox.holds,
    outbox.held_events,
    outbox.relay_leases,
    outbox.attempts,
    outbox.poll_positions,
    outbox.poll_rounds,
    outbox.relay_members
TO outboxd_relay;

-- Destinations are created on first use and never changed or deleted.
GRANT SELECT, INSERT ON outbox.receipt_destinations TO outboxd_relay;

-- The numbering's log (migration 0040) is inserted, folded and deleted, never updated.
GRANT SELECT, INSERT, DELETE ON outbox.stream_version_log TO outboxd_relay;
GRANT SELECT ON outbox.stream_numbering TO outboxd_relay;

-- A run restores outbox.aggregate_versions from the rows when it starts, if the table lost
-- them (it is unlogged, and a crash of the server empties it: migration 0032). Poll mode needs
-- it whole; the stream only warns without it.
GRANT EXECUTE ON FUNCTION outbox.restore_aggregate_versions() TO outboxd_relay;

GRANT USAGE ON SEQUENCE
    outbox.duplicate_receipts_id_seq,
    outbox.quarantine_id_seq,
    outbox.attempts_id_seq,
    outbox.head_journal_id_seq
TO outboxd_relay;

-- Replacing a polling relay (docs/migrating.md): the poller's own role needs only the claim
-- predicate (SECURITY DEFINER), e.g.
--   GRANT USAGE ON SCHEMA outbox TO app_poller;
--   GRANT EXECUTE ON FUNCTION outbox.poller_may_claim(uuid) TO app_poller;
-- The grant is needed (since migration 0021 no role but the owner may execute the outbox's
-- SECURITY DEFINER and trigger functions: none of them is for this role or the relay's).
-- The relay needs nothing more: it publishes outbox.events as always. `outboxd share` and
-- `outboxd shadow` are operator commands; run them as the schema owner.
