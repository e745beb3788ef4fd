-- outboxd migration 0040: the relay's numbering kept as a log, one row per checkpoint.
--
-- Why (issue 27, docs/versions_by_relay.md, "The numbering log"): migration 0039 kept the
-- numbering of rows written without a version as one upsert per aggregate per checkpoint
-- into outbox.stream_versions. In a drain over many aggregates that is about one upsert per
-- event, ~4 us of the primary's CPU per drained event in the bench beside Debezium, and WAL
-- the walsender decodes again. Now the transaction that moves the checkpoint inserts one row
-- here instead: the aggregates it moved and their versions, as three arrays (one insert per
-- checkpoint, whatever its size). outbox.stream_versions stays as the folded map: a run folds
-- the log into it at start (after it holds the lease and the checkpoint row's lock, so no run
-- that lost the lease can add to the log behind the fold), and during a long run every few
-- million entries, in the acceptance transaction that writes the entry that crosses the
-- line. A run reads only the folded map when it first meets an aggregate: everything the log
-- holds beyond it was written by the run itself, which keeps those aggregates in memory.
--
-- Nothing is converted: outbox.stream_versions keeps what 0039 wrote, and a relay of 0039's
-- build that keeps running against this schema still upserts there, which the fold raises
-- but never lowers (GREATEST).

CREATE TABLE outbox.stream_version_log (
    slot_name       text     NOT NULL,
    checkpoint_lsn  pg_lsn   NOT NULL,
    aggregate_types text[]   NOT NULL,
    aggregate_ids   text[]   NOT NULL,
    versions        bigint[] NOT NULL,
    CHECK (cardinality(aggregate_types) = cardinality(versions)
           AND cardinality(aggregate_ids) = cardinality(versions))
);

-- The arrays are read whole by the fold and never compressed well (ids, versions): storing
-- them out of line uncompressed costs the insert least (docs/evidence_batches.md, "Priced
-- with the relay's parameters").
ALTER TABLE outbox.stream_version_log
    ALTER COLUMN aggregate_types SET STORAGE EXTERNAL,
    ALTER COLUMN aggregate_ids SET STORAGE EXTERNAL,
    ALTER COLUMN versions SET STORAGE EXTERNAL;

COMMENT ON TABLE outbox.stream_version_log IS
    'per checkpoint a relay moved, the version it gave the last row committed before it of each aggregate it numbered since the last (rows written without a version); folded into outbox.stream_versions by the relay';

-- What a slot's numbering is, log and folded map together (for operators and tests; the relay
-- reads the folded map after folding).
CREATE VIEW outbox.stream_numbering AS
SELECT slot_name, aggregate_type, aggregate_id, max(version) AS version
FROM (
    SELECT slot_name, aggregate_type, aggregate_id, version FROM outbox.stream_versions
    UNION ALL
    SELECT l.slot_name, u.t, u.i, u.v
    FROM outbox.stream_version_log l,
         unnest(l.aggregate_types, l.aggregate_ids, l.versions) AS u(t, i, v)
) n
GROUP BY slot_name, aggregate_type, aggregate_id;

-- Whoever may keep the numbering (0039's grant) may keep its log and read the view.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT quote_ident(ro.rolname) AS grantee
             FROM pg_class c
             CROSS JOIN LATERAL aclexplode(c.relacl) a
             JOIN pg_roles ro ON ro.oid = a.grantee
             WHERE c.oid = 'outbox.stream_versions'::regclass AND a.privilege_type = 'INSERT'
               AND a.grantee <> c.relowner LOOP
        EXECUTE format('GRANT SELECT, INSERT, DELETE ON outbox.stream_version_log TO %s',
                       r.grantee);
        EXECUTE format('GRANT SELECT ON outbox.stream_numbering TO %s', r.grantee);
    END LOOP;
END
$$;
