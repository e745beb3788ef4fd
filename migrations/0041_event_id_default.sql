-- outboxd migration 0041: a plain INSERT's event id, computed without a function call.
--
-- Why (issue 27, docs/benchmarks.md, "The event id's default"): migration 0039 gave
-- outbox.events.event_id the default outbox.uuid_v7(), a SQL function. A writer using the
-- simple query protocol (psql, pgbench's default, many drivers' unprepared statements) has
-- every INSERT planned, and the planner inlines a SQL function by parsing and analysing its
-- body each time: in an A/B on an idle scratch cluster (4 clients, the bench's row) the
-- default cost the fast path 8-39% of its TPS against the same expression written into the
-- default itself, which the planner reads already parsed. Prepared statements plan once and
-- saw no difference. Same value: the time-ordered id outbox.uuid_v7() returns (a random v4
-- with the Unix time in milliseconds in its first 48 bits and the version bits 0111).

ALTER TABLE outbox.events ALTER COLUMN event_id SET DEFAULT
    encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid;
