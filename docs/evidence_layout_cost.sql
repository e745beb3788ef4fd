-- What each receipt layout costs to accept and to decode past (docs/benchmarks.md,
-- "Which evidence layout can meet 1.5x Debezium"). Run in a scratch database at the latest
-- migration with wal_level=logical and the outbox_pub publication, e.g.:
--   psql -d x -f docs/evidence_layout_cost.sql
--   for v in today plain gin keyed; do
--     psql -d x -c "select pg_create_logical_replication_slot('xd', 'pgoutput')"
--     PGOPTIONS='-c synchronous_commit=on' psql -d x -c 'CALL exp.fresh()' -c "CALL exp.run2('$v')"
--     PGOPTIONS='-c synchronous_commit=on' psql -d x -c "select exp.decode_cost('xd')" -c "select pg_drop_replication_slot('xd')"
--   done
-- (the same with run2's tables in another database gives the other-database column).

DROP SCHEMA IF EXISTS exp CASCADE;
CREATE SCHEMA exp;
-- today's row
CREATE TABLE exp.r_today (LIKE outbox.receipts INCLUDING DEFAULTS);
ALTER TABLE exp.r_today ADD PRIMARY KEY (event_id);
-- one row per batch
CREATE TABLE exp.b_plain (batch_id bigserial PRIMARY KEY, broker_kind text, broker_cluster text, topic text,
  relay_generation bigint, slot_name text, accepted_at timestamptz DEFAULT clock_timestamp(),
  accepted_xact xid8 DEFAULT pg_current_xact_id(), max_commit_lsn pg_lsn,
  event_ids uuid[], partitions int4[], offsets int8[], ts_ms int8[], attempts int4[]);
CREATE TABLE exp.b_gin (LIKE exp.b_plain INCLUDING ALL);
CREATE INDEX ON exp.b_gin USING gin (event_ids);
CREATE TABLE exp.b_gin_nofu (LIKE exp.b_plain INCLUDING ALL);
CREATE INDEX ON exp.b_gin_nofu USING gin (event_ids) WITH (fastupdate = off);
-- inputs: 200 batches of 1000
CREATE TABLE exp.input AS SELECT g/1000 AS b, gen_random_uuid() AS id, (g%8)::int4 AS p, g::int8 AS o FROM generate_series(0,199999) g;
CREATE TABLE exp.inputb AS SELECT b, array_agg(id ORDER BY o) ids, array_agg(p ORDER BY o) ps, array_agg(o ORDER BY o) os FROM exp.input GROUP BY b;
CREATE TABLE exp.b_keyed (LIKE exp.b_plain INCLUDING ALL);
CREATE TABLE exp.k_narrow (event_id uuid PRIMARY KEY, batch_id bigint NOT NULL);
CREATE OR REPLACE PROCEDURE exp.fresh() LANGUAGE plpgsql AS $$
BEGIN
  TRUNCATE exp.input; TRUNCATE exp.inputb;
  INSERT INTO exp.input SELECT g/1000, gen_random_uuid(), (g%8)::int4, g::int8 FROM generate_series(0,199999) g;
  INSERT INTO exp.inputb SELECT b, array_agg(id ORDER BY o), array_agg(p ORDER BY o), array_agg(o ORDER BY o) FROM exp.input GROUP BY b;
END $$;
CREATE OR REPLACE PROCEDURE exp.run2(variant text) LANGUAGE plpgsql AS $$
DECLARE r record; t0 timestamptz; l0 pg_lsn; dig text := 'sha256:' || repeat('a', 64); bid bigint; t1 timestamptz; w numeric;
BEGIN
  
  t0 := clock_timestamp(); l0 := pg_current_wal_insert_lsn();
  FOR r IN SELECT * FROM exp.inputb ORDER BY b LOOP
    IF variant = 'today' THEN
      INSERT INTO exp.r_today (event_id, broker_kind, broker_cluster, topic, partition, "offset", broker_timestamp,
         attempt, relay_generation, commit_lsn, slot_name, payload_digest, destination_digest, evidence)
      SELECT i, 'kafka', 'cluster-abc', 'orders.events', p, o, to_timestamp(1e9), 1, 7, '0/16B3748'::pg_lsn, 'outboxd_slot', dig, dig, NULL
      FROM unnest(r.ids, r.ps, r.os) AS u(i, p, o)
      ON CONFLICT (event_id) DO NOTHING;
    ELSIF variant = 'plain' THEN
      INSERT INTO exp.b_plain (broker_kind, broker_cluster, topic, relay_generation, slot_name, max_commit_lsn, event_ids, partitions, offsets, ts_ms, attempts)
      VALUES ('kafka', 'cluster-abc', 'orders.events', 7, 'outboxd_slot', '0/16B3748', r.ids, r.ps, r.os, array_fill(1000000000000::int8, ARRAY[1000]), array_fill(1, ARRAY[1000]));
    ELSIF variant = 'gin' THEN
      INSERT INTO exp.b_gin (broker_kind, broker_cluster, topic, relay_generation, slot_name, max_commit_lsn, event_ids, partitions, offsets, ts_ms, attempts)
      VALUES ('kafka', 'cluster-abc', 'orders.events', 7, 'outboxd_slot', '0/16B3748', r.ids, r.ps, r.os, array_fill(1000000000000::int8, ARRAY[1000]), array_fill(1, ARRAY[1000]));
    ELSIF variant = 'keyed' THEN
      INSERT INTO exp.b_keyed (broker_kind, broker_cluster, topic, relay_generation, slot_name, max_commit_lsn, event_ids, partitions, offsets, ts_ms, attempts)
      VALUES ('kafka', 'cluster-abc', 'orders.events', 7, 'outboxd_slot', '0/16B3748', r.ids, r.ps, r.os, array_fill(1000000000000::int8, ARRAY[1000]), array_fill(1, ARRAY[1000]))
      RETURNING batch_id INTO bid;
      INSERT INTO exp.k_narrow SELECT unnest(r.ids), bid ON CONFLICT DO NOTHING;
    END IF;
    COMMIT;
  END LOOP;
  t1 := clock_timestamp(); w := pg_current_wal_insert_lsn() - l0;
  RAISE NOTICE '% : % us/event to accept, % WAL bytes/event', variant,
    round(extract(epoch FROM t1 - t0) * 1e6 / 200000, 2), round(w / 200000.0, 1);
END $$;
CREATE OR REPLACE FUNCTION exp.decode_cost(slot text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE t timestamptz; n bigint;
BEGIN
  SELECT count(*) INTO n FROM pg_logical_slot_peek_binary_changes(slot, NULL, NULL, 'proto_version', '1', 'publication_names', 'outbox_pub');
  t := clock_timestamp();
  SELECT count(*) INTO n FROM pg_logical_slot_peek_binary_changes(slot, NULL, NULL, 'proto_version', '1', 'publication_names', 'outbox_pub');
  RETURN round(extract(epoch FROM clock_timestamp() - t) * 1e6 / 200000, 3) || ' us/event to decode, messages ' || n;
END $$;
