//! The single acceptance point.
//!
//! One transaction per batch: every receipt of the batch (`outbox_core::receipt::classify`,
//! which the simulator drives)
//!
//! * becomes the event's **primary receipt** if the event has none (the publish slot is the
//!   primary key of `outbox.receipt_entries`, so two concurrent acceptors cannot both win; a
//!   purged event's tombstone in `outbox.purged_events` keeps its slot filled);
//! * otherwise is kept as a **duplicate transport receipt** (a replay after a crash, a late
//!   ACK of an earlier attempt) — evidence, never a second primary;
//! * is **quarantined** if an operator migrated the event's destination and the receipt is for
//!   another one, and never accepted.
//!
//! The receipt is not matched with its outbox row: the relay built it from a row it read,
//! computed both digests from that row and checked any the row stores, and the row is
//! immutable (migration 0027). Dropping that probe of the row per event took about a ninth off
//! the statement's time (docs/benchmarks.md); what only a relay bug could produce (digests that
//! are not the row's, an event id with no row) is named by the audit
//! (`crate::audit::ledger_conflicts`).
//!
//! The receipt is written as migration 0030 lays it out: an entry per event (position, broker
//! time, attempt, generation, commit LSN, both digests as their 32 bytes, evidence), one
//! `outbox.receipt_batches` row per statement for what its receipts share (slot, time,
//! transaction), destinations by a cached id; readers read the view `outbox.receipts`. That
//! halved the WAL a receipt writes, which the relay's walsender decodes again
//! (docs/benchmarks.md "Receipts as entries of a batch").
//!
//! Two ways do it: [`accept_fresh`] writes a batch whose receipts can only be primary ones
//! with a plain binary `COPY` of its entries (the usual case; a taken publish slot makes it
//! fail, and the transaction is rolled back), `ACCEPT_SQL` classifies each receipt (after a
//! replay, or when a migration or a tombstone may concern the batch). Which one is a proof,
//! not a guess, for receipts read from the stream: every acceptance first locks the slot's
//! checkpoint row and reads how far the receipts of the slot's other relay runs were accepted
//! (`outbox.accepted_positions`, migration 0034); a batch whose receipts are all past that is
//! new to the slot (`outbox_core::receipt::proved_new`), any other is classified, and the
//! transaction raises its run's position. So a replay after a restart costs no failed
//! attempt, and the acceptances of one slot commit in the order they took the lock (the
//! order evidence per batch without a per-event key will rely on;
//! docs/evidence_batches.md).
//!
//! Quarantine records from decoding (malformed rows) ride in the same transaction, and so does
//! the checkpoint. A refusal (quarantine, hold, held event) about an event that is published by
//! then is stale and not recorded (`outbox_core::records::RefusalFilter`). The checkpoint: the LSN stored here covers exactly the events this and earlier batches
//! resolved. Only after COMMIT does the relay tell the slot.

use bytes::{BufMut, BytesMut};
use outbox_core::delivery::RecordPosition;
use outbox_core::envelope::StoredDigest;
use outbox_core::receipt::{self, StreamPosition};
use outbox_core::records::RefusalFilter;
use outbox_core::Lsn;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::{accepts, to_sql_checked, IsNull, PgLsn, ToSql, Type};
use tokio_postgres::{Client, Statement};

use crate::{Context, LedgerError};

pub use outbox_core::records::{
    HeldRecord, HoldRecord, LedgerItem, QuarantineRecord, ReceiptRecord,
};

/// What a batch did. `conflicts` are receipts that did not match their frozen row and were
/// quarantined instead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AcceptOutcome {
    pub primary: u64,
    pub duplicates: u64,
    pub quarantined: u64,
    pub conflicts: u64,
    pub held: u64,
}

/// The receipts as rows: `$1` to `$10`, `$12` and `$13`, one array per column, in the order
/// [`ReceiptColumns::params`] binds them (`$11` is the slot). Both acceptance statements read
/// them through this one definition.
macro_rules! receipt_rows {
    () => {
        r#"unnest($1::uuid[], $2::bytea[], $3::bytea[], $4::int4[], $5::int4[], $6::int8[],
                $7::int8[], $8::int4[], $9::int8[], $10::pg_lsn[], $12::text[], $13::int8[])
        AS t(event_id, payload_digest, destination_digest, destination_id, partition, "offset",
             ts_ms, attempt, relay_generation, commit_lsn, evidence, aggregate_version)"#
    };
}

/// The entries' columns as both acceptance statements insert them.
macro_rules! entry_columns {
    () => {
        r#"outbox.receipt_entries (event_id, batch_id, destination_id, partition, "offset",
                                        broker_timestamp, attempt, relay_generation, commit_lsn,
                                        payload_digest, destination_digest, evidence,
                                        aggregate_version)"#
    };
}

/// Locks the slot `$1`'s checkpoint row, first in every acceptance transaction (migration
/// 0034): the acceptances of one slot commit in the order they took it, a paused run's
/// salvage included. One row, or none when the slot has no checkpoint row.
macro_rules! lock_checkpoint {
    () => {
        "SELECT 1 FROM outbox.checkpoints c WHERE c.slot_name = $1 FOR UPDATE"
    };
}

/// Raises how far the slot `$1`'s relay runs have their receipts accepted, from the rows
/// `$rows` (`r(g, c, l)`: generation, commit LSN, change LSN; `outbox_core::receipt::raises`),
/// never lowering one. Generation -1 holds receipts without a position; a NULL commit LSN: one
/// knows nothing of its row's position (a snapshot's, a look-up's), and the WAL's insert
/// position now, past every committed row, bounds it.
macro_rules! raise_positions {
    ($rows:literal) => {
        concat!(
            "INSERT INTO outbox.accepted_positions AS a (slot_name, relay_generation, commit_lsn, change_lsn)
    SELECT $1, r.g, coalesce(r.c, pg_current_wal_lsn()), coalesce(r.l, 'FFFFFFFF/FFFFFFFF'::pg_lsn)
    FROM ",
            $rows,
            "
    ON CONFLICT (slot_name, relay_generation) DO UPDATE
    SET commit_lsn = EXCLUDED.commit_lsn, change_lsn = EXCLUDED.change_lsn
    WHERE (a.commit_lsn, a.change_lsn) < (EXCLUDED.commit_lsn, EXCLUDED.change_lsn)"
        )
    };
}

/// Closes the held events whose receipt `prim` just accepted. Joined only when an event is
/// held at all (once per statement, by the partial index of open held events): the join cost
/// ~0.7 us per receipt.
macro_rules! unheld {
    () => {
        r#"unheld AS (
    UPDATE outbox.held_events he SET released_at = clock_timestamp()
    FROM prim p WHERE he.event_id = p.event_id AND he.released_at IS NULL
      AND (SELECT EXISTS (SELECT 1 FROM outbox.held_events o WHERE o.released_at IS NULL))
    RETURNING 1
)"#
    };
}

/// The acceptance that lets a receipt find its publish slot taken (a replay after a crash, a
/// late ACK, two acceptors racing), meet a purged event's tombstone or an operator's
/// destination migration: each receipt becomes a primary, a duplicate or a conflict, never an
/// error.
const ACCEPT_SQL: &str = concat!(
    r#"
WITH input AS (
    SELECT * FROM "#,
    receipt_rows!(),
    r#"
),
matched AS (
    -- No match with the outbox row (docs/evidence_batches.md): the relay built every receipt
    -- from a row it read, computed both digests from it and checked any the row stores, and
    -- the row is immutable (0027). Only an operator's destination migration can make the
    -- receipt's destination stale since: compared here, against a table that is usually empty.
    -- The table is probed per receipt only when it has a row at all: the emptiness check is
    -- evaluated once per statement, and the probe cost ~0.7 us per receipt (docs/benchmarks.md
    -- "Receipts as entries of a batch").
    SELECT i.*,
           -- A purged event's tombstone keeps its publish slot: a late ACK is a duplicate.
           -- Event ids are uuid v7 (time-ordered) unless a caller chose its own, and purge
           -- takes only old events, so a receipt for an id above the newest tombstone cannot
           -- name a purged event: the tombstones are probed only below it (their index probe
           -- cost ~1.4 us per receipt once purge had run; docs/benchmarks.md).
           NOT (i.event_id > coalesce((SELECT pe.event_id FROM outbox.purged_events pe
                                       ORDER BY pe.event_id DESC LIMIT 1),
                                      '00000000-0000-0000-0000-000000000000'::uuid)
                OR NOT EXISTS (SELECT 1 FROM outbox.purged_events pe
                               WHERE pe.event_id = i.event_id)) AS purged,
           CASE WHEN (SELECT NOT EXISTS (SELECT 1 FROM outbox.destination_migrations)) THEN true
                ELSE coalesce((SELECT outbox.digest_bytes(dm.destination_digest) = i.destination_digest
                               FROM outbox.destination_migrations dm
                               WHERE dm.event_id = i.event_id
                               ORDER BY dm.envelope_generation DESC LIMIT 1), true)
           END AS ok
    FROM input i
),
-- One row per acceptance statement: what its receipts share (migration 0030). Written even
-- when every receipt turns out a duplicate; purge deletes batches left without entries.
batch AS (
    INSERT INTO outbox.receipt_batches (slot_name) VALUES ($11) RETURNING batch_id
),
prim AS (
    INSERT INTO "#,
    entry_columns!(),
    r#"
    -- ts_ms / 1000.0::float8: the same microseconds as the numeric quotient (3,000,000 values
    -- compared), without numeric arithmetic per row.
    SELECT event_id, (SELECT batch_id FROM batch), destination_id, partition, "offset",
           to_timestamp(ts_ms / 1000.0::float8), attempt, relay_generation, commit_lsn,
           payload_digest, destination_digest, evidence::jsonb, aggregate_version
    FROM matched m WHERE ok
      AND NOT m.purged
    ON CONFLICT (event_id) DO NOTHING
    RETURNING event_id
),
-- Materialized on its own: planned together with the destinations' join, the anti-join with
-- prim became a nested loop over both CTEs (quadratic in the batch: 50 ms per 1,000).
unprim AS MATERIALIZED (
    SELECT m.* FROM matched m
    WHERE m.ok AND NOT EXISTS (SELECT 1 FROM prim p WHERE p.event_id = m.event_id)
),
dup AS (
    INSERT INTO outbox.duplicate_receipts (event_id, broker_kind, broker_cluster, topic, partition,
                                           "offset", broker_timestamp, attempt, relay_generation,
                                           commit_lsn, slot_name, evidence)
    SELECT m.event_id, d.broker_kind, d.broker_cluster, d.topic, m.partition, m."offset",
           to_timestamp(m.ts_ms / 1000.0::float8), m.attempt, m.relay_generation, m.commit_lsn,
           $11, m.evidence::jsonb
    FROM unprim m JOIN outbox.receipt_destinations d ON d.destination_id = m.destination_id
    -- The very ACK that is the primary receipt, recorded again, is no new evidence.
    WHERE NOT EXISTS (SELECT 1 FROM outbox.receipt_entries r
                      JOIN outbox.receipt_destinations rd ON rd.destination_id = r.destination_id
                      WHERE r.event_id = m.event_id AND rd.broker_cluster = d.broker_cluster
                        AND rd.topic = d.topic AND r.partition = m.partition
                        AND r."offset" = m."offset" AND r.attempt = m.attempt
                        AND r.relay_generation = m.relay_generation)
    ON CONFLICT (event_id, broker_cluster, topic, partition, "offset", attempt, relay_generation)
    DO NOTHING
    RETURNING 1
),
conflict AS (
    INSERT INTO outbox.quarantine (quarantine_key, event_id, aggregate_type, aggregate_id,
                                   aggregate_version, reason_code, reason, commit_lsn, slot_name)
    SELECT 'receipt:' || m.event_id::text || ':' || d.topic || ':' || m.partition || ':' || m."offset",
           m.event_id, e.aggregate_type, e.aggregate_id, e.aggregate_version,
           'receipt_digest_mismatch',
           'broker receipt at ' || d.topic || '/' || m.partition || '@' || m."offset"
           || ' is for another destination than the one the event was migrated to',
           m.commit_lsn, $11
    -- A migration exists only while its row does (purge deletes both).
    FROM matched m JOIN outbox.events e ON e.event_id = m.event_id
    JOIN outbox.receipt_destinations d ON d.destination_id = m.destination_id
    WHERE NOT m.ok
    ON CONFLICT (quarantine_key) WHERE released_at IS NULL DO NOTHING
    RETURNING 1
),
"#,
    unheld!(),
    r#"
-- batch and unheld run to completion although nothing but prim reads them (PostgreSQL
-- guarantees it). Heads are not written here: they are read from the receipts (migration 0026).
SELECT (SELECT count(*) FROM prim), (SELECT count(*) FROM dup), (SELECT count(*) FROM conflict)
"#
);

/// The gate and the batch row of the acceptance whose receipts can only be primary ones
/// ([`accept_fresh`]), in one statement with the lock of the slot's checkpoint row, the proof
/// that the batch is new to the slot and the raise of its accepted positions (migration 0034;
/// on the drain's path they cost no statement of their own): the new batch's id, NULL when
/// the gate is shut (nothing written, nothing raised), whether any held event is open, and
/// whether the slot has a checkpoint row (locked). The receipts can only be primary when no operator has migrated any destination
/// (`outbox.destination_migrations` is empty) and every event id of the batch (`$2` is the
/// smallest) is above the newest purged event's tombstone (ids are uuid v7, time-ordered,
/// unless a caller chose its own; purge takes only old events); an event that already has its
/// primary receipt then fails the entries' `COPY` ([`FRESH_ENTRIES_COPY`]) with a unique
/// violation of `receipt_entries_pkey`, and the batch is accepted again with [`ACCEPT_SQL`].
/// Each condition is checked once per statement.
///
/// What it saves against [`ACCEPT_SQL`]: the speculative insertion of `ON CONFLICT DO NOTHING`
/// per row (a probe of the key, a token, a confirmation record in WAL), the materialised
/// classification every row passes through, and the anti-join that finds duplicates
/// (docs/benchmarks.md "The acceptance without speculative insertion").
const FRESH_BATCH_SQL: &str = concat!(
    "WITH locked AS (\n    ",
    lock_checkpoint!(),
    r#"
),
others AS (
    -- How far the slot's other runs' receipts were accepted (`$3` is this batch's run).
    SELECT p.commit_lsn, p.change_lsn FROM outbox.accepted_positions p
    WHERE p.slot_name = $1 AND p.relay_generation <> $3
    ORDER BY p.commit_lsn DESC, p.change_lsn DESC LIMIT 1
),
gate AS (
    SELECT EXISTS (SELECT 1 FROM locked) AS locked,
           NOT EXISTS (SELECT 1 FROM outbox.destination_migrations)
           AND $2::uuid > coalesce((SELECT pe.event_id FROM outbox.purged_events pe
                                    ORDER BY pe.event_id DESC LIMIT 1),
                                   '00000000-0000-0000-0000-000000000000'::uuid)
           -- The proof (`outbox_core::receipt::proved_new`): the batch's lowest position
           -- (`$4`, `$5`) past every other run's; `$4` NULL: no proof asked (receipts
           -- without positions try the plain insert on the relay's guess).
           AND ($4::pg_lsn IS NULL
                OR (EXISTS (SELECT 1 FROM locked)
                    AND NOT EXISTS (SELECT 1 FROM others o
                                    WHERE (o.commit_lsn, o.change_lsn)
                                          >= ($4::pg_lsn, $5::pg_lsn)))) AS go
),
raise AS (
    "#,
    raise_positions!(
        "unnest($6::int8[], $7::pg_lsn[], $8::pg_lsn[]) AS r(g, c, l), gate WHERE gate.go AND gate.locked"
    ),
    r#"
    RETURNING 1
),
batch AS (
    INSERT INTO outbox.receipt_batches (slot_name) SELECT $1 FROM gate WHERE go
    RETURNING batch_id
)
SELECT (SELECT batch_id FROM batch),
       EXISTS (SELECT 1 FROM outbox.held_events o WHERE o.released_at IS NULL),
       (SELECT locked FROM gate)
"#
);

/// The lock every acceptance takes first, for one that classifies its receipts (the plain
/// insert's gate takes it itself: [`FRESH_BATCH_SQL`]).
const LOCK_SQL: &str = lock_checkpoint!();

/// Raises the slot's accepted positions after the classifying statement (`$2`, `$3`, `$4`:
/// generations, commit LSNs, change LSNs); the plain insert's gate raises them itself.
const RAISE_SQL: &str =
    raise_positions!("unnest($2::int8[], $3::pg_lsn[], $4::pg_lsn[]) AS r(g, c, l)");

/// The entries of a batch whose receipts can only be primary ones, by binary `COPY`: half the
/// server's CPU per receipt of an `INSERT ... SELECT FROM unnest(...)` of the same rows
/// (PostgreSQL inserts a `COPY`'s rows in multi-row batches, one WAL record per page instead
/// of one per row, and parses no parameter arrays; docs/benchmarks.md "Receipt entries by
/// COPY"). The columns are [`ENTRY_TYPES`].
const FRESH_ENTRIES_COPY: &str = concat!("COPY ", entry_columns!(), " FROM STDIN (FORMAT binary)");

/// The types of [`FRESH_ENTRIES_COPY`]'s columns, in its order.
const ENTRY_TYPES: [Type; 13] = [
    Type::UUID,
    Type::INT8,
    Type::INT4,
    Type::INT4,
    Type::INT8,
    Type::TIMESTAMPTZ,
    Type::INT4,
    Type::INT8,
    Type::PG_LSN,
    Type::BYTEA,
    Type::BYTEA,
    Type::JSONB,
    Type::INT8,
];

/// Closes the held events of `$1` (event ids just accepted as primary) as the classifying
/// statement does ([`unheld!`]); run only when [`FRESH_BATCH_SQL`] found any held event open.
const FRESH_UNHELD_SQL: &str = concat!(
    "WITH prim AS (SELECT unnest($1::uuid[]) AS event_id),\n",
    unheld!(),
    "\nSELECT count(*) FROM unheld"
);

/// The destinations of `receipts` by their names: ids from `outbox.receipt_destinations`,
/// created on first use. Runs outside the acceptance transaction, so an id in the cache always
/// names a committed row (and rows are never deleted).
const DESTINATIONS_SQL: &str = r#"
WITH want AS (
    SELECT DISTINCT * FROM unnest($1::text[], $2::text[], $3::text[]) AS w(k, c, t)
),
created AS (
    INSERT INTO outbox.receipt_destinations (broker_kind, broker_cluster, topic)
    SELECT k, c, t FROM want
    ON CONFLICT DO NOTHING
    RETURNING destination_id, broker_kind, broker_cluster, topic
)
SELECT destination_id, broker_kind, broker_cluster, topic FROM created
UNION ALL
SELECT d.destination_id, d.broker_kind, d.broker_cluster, d.topic
FROM outbox.receipt_destinations d
JOIN want w ON d.broker_kind = w.k AND d.broker_cluster = w.c AND d.topic = w.t
"#;

const QUARANTINE_SQL: &str = r#"
WITH q AS (
    INSERT INTO outbox.quarantine (quarantine_key, event_id, aggregate_type, aggregate_id,
                                   aggregate_version, reason_code, reason, commit_lsn, slot_name)
    SELECT k, id, at, ai, av, rc, r, nullif(l, '0/0')::pg_lsn, $9
    FROM unnest($1::text[], $2::uuid[], $3::text[], $4::text[], $5::int8[],
                $6::text[], $7::text[], $8::text[]) AS t(k, id, at, ai, av, rc, r, l)
    ON CONFLICT (quarantine_key) WHERE released_at IS NULL DO NOTHING
    RETURNING 1
)
SELECT count(*) FROM q
"#;

/// The acceptance statements prepared on one connection, for [`accept_batch_prepared`]: parsed
/// once, and after a few executions PostgreSQL reuses a generic plan instead of planning the
/// statement for every batch (~0.5 ms of a ~2.5 ms acceptance of 100 receipts). The generic
/// plan stays linear in the batch: its joins are index probes or hashes, and the duplicate
/// branch is planned apart (`unprim AS MATERIALIZED`) because planned with the destinations'
/// join it became quadratic.
#[derive(Debug)]
pub struct Prepared {
    accept: Option<Statement>,
    fresh_batch: Option<Statement>,
    fresh_copy: Option<Statement>,
    fresh_unheld: Option<Statement>,
    lock: Option<Statement>,
    raise: Option<Statement>,
    /// For a batch that its positions cannot prove new (receipts from a snapshot, a release,
    /// a look-up, poll mode; a slot without a checkpoint row): whether it tries the plain
    /// insert ([`accept_fresh`]) first. False after such a batch met an accepted event, until
    /// one meets none.
    expect_fresh: bool,
    /// How many batches tried the plain insert, met an accepted event and were accepted again.
    fallbacks: u64,
    /// `outbox.receipt_destinations` ids by (broker kind, cluster, topic): a relay has a
    /// handful, resolved once per connection and found without allocating per receipt.
    destinations: Vec<(String, String, String, i32)>,
}

impl Default for Prepared {
    fn default() -> Self {
        Prepared {
            accept: None,
            fresh_batch: None,
            fresh_copy: None,
            fresh_unheld: None,
            lock: None,
            raise: None,
            expect_fresh: true,
            fallbacks: 0,
            destinations: Vec::new(),
        }
    }
}

impl Prepared {
    /// Starts with the duplicate-aware statement, as after a batch that met an accepted event
    /// (for a caller that knows its first batch replays, and for the tests of both statements).
    pub fn expecting_duplicates() -> Self {
        Prepared {
            expect_fresh: false,
            ..Prepared::default()
        }
    }

    /// Whether the next batch that its positions cannot prove new tries the plain insert
    /// ([`accept_fresh`]) first.
    pub fn tries_plain_insert_next(&self) -> bool {
        self.expect_fresh
    }

    /// How many batches tried the plain insert first, met an event that already had its
    /// primary receipt, and were accepted again with duplicates classified. A batch proven new
    /// by its positions meets one only if another slot accepted the same event.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks
    }

    /// Fills the cache with the destinations of `receipts` it lacks. A destination another
    /// relay creates at the same moment is not visible to the statement that found it taken,
    /// so the look-up is asked again (at most three times).
    async fn resolve_destinations(
        &mut self,
        client: &Client,
        receipts: &[&ReceiptRecord],
    ) -> Result<(), LedgerError> {
        for _ in 0..3 {
            let missing: Vec<&ReceiptRecord> = receipts
                .iter()
                .copied()
                .filter(|r| self.destination_id(r).is_none())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            let rows = client
                .query(
                    DESTINATIONS_SQL,
                    &[
                        &missing
                            .iter()
                            .map(|r| r.broker_kind.as_str())
                            .collect::<Vec<_>>(),
                        &missing
                            .iter()
                            .map(|r| r.broker_cluster.as_str())
                            .collect::<Vec<_>>(),
                        &missing.iter().map(|r| r.topic.as_str()).collect::<Vec<_>>(),
                    ],
                )
                .await
                .ctx("resolving the receipts' destinations (outbox.receipt_destinations)")?;
            for row in rows {
                self.destinations
                    .push((row.get(1), row.get(2), row.get(3), row.get(0)));
            }
        }
        Err(LedgerError::Invalid(
            "a receipt's destination could not be found in outbox.receipt_destinations after \
             creating it three times; check that nothing deletes its rows"
                .into(),
        ))
    }

    fn destination_id(&self, r: &ReceiptRecord) -> Option<i32> {
        self.destinations
            .iter()
            .find(|(kind, cluster, topic, _)| {
                *kind == r.broker_kind && *cluster == r.broker_cluster && *topic == r.topic
            })
            .map(|d| d.3)
    }
}

/// A digest as the statement's `bytea` parameter, written straight into the message.
#[derive(Debug)]
struct DigestParam<'a>(StoredDigest<'a>);

impl ToSql for DigestParam<'_> {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        self.0.write(out);
        Ok(IsNull::No)
    }

    accepts!(BYTEA);
    to_sql_checked!();
}

/// A broker timestamp in milliseconds since the Unix epoch as `timestamptz`: the microseconds
/// `to_timestamp(ms / 1000.0::float8)` gives (the classifying statement's conversion).
#[derive(Debug)]
struct MillisParam(i64);

impl ToSql for MillisParam {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        // PostgreSQL counts from 2000-01-01, 946,684,800 s after the Unix epoch.
        let micros = self
            .0
            .checked_mul(1000)
            .and_then(|us| us.checked_sub(946_684_800_000_000))
            .ok_or_else(|| format!("broker timestamp {} ms is out of range", self.0))?;
        out.put_i64(micros);
        Ok(IsNull::No)
    }

    accepts!(TIMESTAMPTZ);
    to_sql_checked!();
}

/// A receipt's evidence (JSON text) as `jsonb`, which PostgreSQL parses as `::jsonb` would.
#[derive(Debug)]
struct JsonbParam<'a>(&'a str);

impl ToSql for JsonbParam<'_> {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        // jsonb's binary format: a version byte (1), then the text.
        out.put_u8(1);
        out.put_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }

    accepts!(JSONB);
    to_sql_checked!();
}

/// Accepts `items` and moves the checkpoint of `slot` to `checkpoint` (never backwards), in one
/// transaction. On error nothing is recorded and the caller must replay, not skip.
///
/// With a `fence`, the checkpoint moves only while `(owner, generation)` holds the slot's lease;
/// otherwise the records are still committed (the broker has the messages) and
/// [`LedgerError::LeaseLost`] is returned.
pub async fn accept_batch(
    client: &mut Client,
    slot: &str,
    items: &[LedgerItem],
    checkpoint: Option<Lsn>,
    fence: Option<&crate::lease::Fence>,
) -> Result<AcceptOutcome, LedgerError> {
    accept_batch_prepared(
        client,
        &mut Prepared::default(),
        slot,
        items,
        checkpoint,
        fence,
    )
    .await
}

/// [`accept_batch`] with the statement prepared once per connection in `prepared` (which must
/// belong to `client`'s connection).
///
/// A receipt is accepted whether or not its outbox row is visible to this connection yet
/// (PostgreSQL writes a commit to WAL before the transaction becomes visible to snapshots, and
/// a fast broker can ACK in between): nothing here reads the row.
pub async fn accept_batch_prepared(
    client: &mut Client,
    prepared: &mut Prepared,
    slot: &str,
    items: &[LedgerItem],
    checkpoint: Option<Lsn>,
    fence: Option<&crate::lease::Fence>,
) -> Result<AcceptOutcome, LedgerError> {
    let end = End {
        checkpoint,
        fence,
        record: None,
        numbered: None,
    };
    accept(client, prepared, slot, items, &end).await
}

/// [`accept_batch_prepared`] for a run that numbers rows written without a version
/// (docs/versions_by_relay.md): when the checkpoint moves to `checkpoint`, the same
/// transaction keeps `numbered`, the numbering up to it ([`crate::numbering`]). A fenced run
/// keeps its receipts but neither the checkpoint nor the numbering.
pub async fn accept_numbered_batch(
    client: &mut Client,
    prepared: &mut Prepared,
    slot: &str,
    items: &[LedgerItem],
    checkpoint: Lsn,
    fence: Option<&crate::lease::Fence>,
    numbered: &crate::numbering::Numbered,
) -> Result<AcceptOutcome, LedgerError> {
    let end = End {
        checkpoint: Some(checkpoint),
        fence,
        record: None,
        numbered: Some(numbered),
    };
    accept(client, prepared, slot, items, &end).await
}

/// [`accept_batch_prepared`] for a batch of exactly-once mode (docs/exactly_once.md). One the
/// broker committed as one transaction has its record at `record` in the positions topic: the
/// slot's checkpoint row keeps it (never lowered) in the same transaction as the receipts, so
/// a restart reads only the batches committed after it; kept even when the fence was lost
/// (the receipts are too, and the broker holds the batch). `None`: a batch of stream commits
/// alone, which needed no broker transaction.
pub async fn accept_committed_batch(
    client: &mut Client,
    prepared: &mut Prepared,
    slot: &str,
    items: &[LedgerItem],
    checkpoint: Option<Lsn>,
    fence: Option<&crate::lease::Fence>,
    record: Option<RecordPosition>,
) -> Result<AcceptOutcome, LedgerError> {
    let end = End {
        checkpoint,
        fence,
        record,
        numbered: None,
    };
    accept(client, prepared, slot, items, &end).await
}

/// What an acceptance transaction moves besides its records, just before it commits.
#[derive(Clone, Copy)]
struct End<'f> {
    /// The checkpoint, forward only, while `fence` holds the lease.
    checkpoint: Option<Lsn>,
    fence: Option<&'f crate::lease::Fence>,
    /// The transaction record of a batch the broker committed (exactly-once mode).
    record: Option<RecordPosition>,
    /// The numbering up to `checkpoint`, kept only when the checkpoint moves.
    numbered: Option<&'f crate::numbering::Numbered>,
}

async fn accept(
    client: &mut Client,
    prepared: &mut Prepared,
    slot: &str,
    items: &[LedgerItem],
    end: &End<'_>,
) -> Result<AcceptOutcome, LedgerError> {
    let mut out = AcceptOutcome::default();
    let receipts: Vec<&ReceiptRecord> = items
        .iter()
        .filter_map(|i| match i {
            LedgerItem::Receipt(r) => Some(r),
            _ => None,
        })
        .collect();
    prepared.resolve_destinations(client, &receipts).await?;
    // The same event can occur twice in one batch (snapshot and stream overlap). The first
    // occurrence competes for the publish slot; the rest are duplicates by construction, so
    // they are a second round that runs after the first has inserted.
    let mut seen = std::collections::HashSet::new();
    let (first, rest): (Vec<&ReceiptRecord>, Vec<&ReceiptRecord>) =
        receipts.into_iter().partition(|r| seen.insert(r.event_id));

    // What this batch raises (per relay run, the highest position of its receipts), and what
    // proves it new: its run and lowest position, when every receipt of the first round has
    // a position.
    let all: Vec<&ReceiptRecord> = first.iter().chain(&rest).copied().collect();
    let raises = receipt::raises(&all);
    let floor = receipt::batch_floor(&first);

    // The plain insert of the first round ([`accept_fresh`]) when its gate proves the batch
    // new to the slot (`outbox_core::receipt::proved_new`: its lowest position past every
    // other run's, read under the checkpoint row's lock); when the gate does not, the
    // statement that classifies duplicates, in the same transaction. A batch without
    // positions has no proof: it tries the plain insert on a guess, unless the last such
    // batch met an accepted event. A taken publish slot (another slot accepted the event, or
    // the guess was wrong) rolls the transaction back (nothing else was written in it) and
    // the batch is classified in a new one.
    for attempt in 0..2 {
        let tx = client
            .transaction()
            .await
            .ctx("beginning the receipt acceptance transaction")?;
        let plain = attempt == 0 && !first.is_empty() && (floor.is_some() || prepared.expect_fresh);
        // `Some(locked)` when the plain insert's gate was shut: it took the lock already.
        let mut shut = None;
        if plain {
            match accept_fresh(&tx, prepared, slot, &first, floor, &raises).await {
                Ok(Fresh::Inserted { primary, locked }) => {
                    out.primary += primary;
                    classify_rounds(&tx, prepared, slot, &[&rest], &mut out).await?;
                    return record_refusals_and_commit(tx, items, slot, end, locked, out).await;
                }
                // Not proven new, or a migration or a tombstone may concern the batch, and
                // nothing was written: the classifying statement takes it in the same
                // transaction, which holds the lock already.
                Ok(Fresh::Shut { locked }) => shut = Some(locked),
                Err(e) if e.is_taken_publish_slot() => {
                    tracing::debug!(
                        slot,
                        receipts = first.len(),
                        proven_new = floor.is_some(),
                        "a receipt of the batch found its publish slot taken; accepting the \
                         batch again with duplicates classified"
                    );
                    tx.rollback()
                        .await
                        .ctx("rolling back the optimistic receipt acceptance")?;
                    if floor.is_none() {
                        prepared.expect_fresh = false;
                    }
                    prepared.fallbacks += 1;
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        let locked = match shut {
            Some(locked) => locked,
            None => {
                let lock = prepared_statement(&tx, &mut prepared.lock, LOCK_SQL).await?;
                tx.query_opt(&lock, &[&slot])
                    .await
                    .ctx(format!("locking the checkpoint row of slot {slot}"))?
                    .is_some()
            }
        };
        classify_rounds(&tx, prepared, slot, &[&first, &rest], &mut out).await?;
        if floor.is_none() && shut.is_none() {
            // Only a batch that met no accepted event lets the next one try the plain insert
            // (a shut gate, which met a migration or a tombstone, says nothing about that).
            prepared.expect_fresh = out.duplicates == 0;
        }
        if locked {
            raise_accepted(&tx, prepared, slot, &raises).await?;
        }
        return record_refusals_and_commit(tx, items, slot, end, locked, out).await;
    }
    unreachable!("the second attempt classifies the batch and returns")
}

/// What [`accept_fresh`] did.
enum Fresh {
    /// Every receipt of the round inserted as a primary one; the slot's positions raised.
    Inserted { primary: u64, locked: bool },
    /// The gate was shut: nothing written, nothing raised (the lock is held all the same).
    Shut { locked: bool },
}

/// `raises` as the gate statement's three arrays: generations, commit LSNs, change LSNs
/// (NULL: the WAL's insert position).
type RaiseColumns = (Vec<i64>, Vec<Option<PgLsn>>, Vec<Option<PgLsn>>);

fn raise_columns(raises: &[(i64, Option<StreamPosition>)]) -> RaiseColumns {
    (
        raises.iter().map(|r| r.0).collect(),
        raises
            .iter()
            .map(|r| r.1.map(|p| PgLsn::from(p.commit_lsn.as_u64())))
            .collect(),
        raises
            .iter()
            .map(|r| r.1.map(|p| PgLsn::from(p.change_lsn.as_u64())))
            .collect(),
    )
}

/// Raises the slot's accepted positions by `raises` (`outbox_core::receipt::raises`), in the
/// acceptance transaction, after the classifying statement (the plain insert's gate raises
/// them itself).
async fn raise_accepted(
    tx: &tokio_postgres::Transaction<'_>,
    prepared: &mut Prepared,
    slot: &str,
    raises: &[(i64, Option<StreamPosition>)],
) -> Result<(), LedgerError> {
    if raises.is_empty() {
        return Ok(());
    }
    let stmt = prepared_statement(tx, &mut prepared.raise, RAISE_SQL).await?;
    let (generations, commits, changes) = raise_columns(raises);
    tx.execute(&stmt, &[&slot, &generations, &commits, &changes])
        .await
        .ctx(format!(
            "recording how far slot {slot}'s receipts are accepted (outbox.accepted_positions)"
        ))?;
    Ok(())
}

/// The statement `sql` prepared once per connection in `cached`.
async fn prepared_statement(
    tx: &tokio_postgres::Transaction<'_>,
    cached: &mut Option<Statement>,
    sql: &str,
) -> Result<Statement, LedgerError> {
    if let Some(s) = cached {
        return Ok(s.clone());
    }
    let s = tx
        .prepare(sql)
        .await
        .ctx("preparing the receipt acceptance statement")?;
    *cached = Some(s.clone());
    Ok(s)
}

/// The parameters both acceptance statements take, `$1` to `$13`, one array per column.
struct ReceiptColumns<'a> {
    event_ids: Vec<uuid::Uuid>,
    payload_digests: Vec<DigestParam<'a>>,
    destination_digests: Vec<DigestParam<'a>>,
    destination_ids: Vec<i32>,
    partitions: Vec<i32>,
    offsets: Vec<i64>,
    timestamps_ms: Vec<Option<i64>>,
    attempts: Vec<i32>,
    relay_generations: Vec<i64>,
    commit_lsns: Vec<Option<PgLsn>>,
    evidence: Vec<Option<&'a str>>,
    aggregate_versions: Vec<i64>,
}

impl<'a> ReceiptColumns<'a> {
    fn of(prepared: &Prepared, round: &[&'a ReceiptRecord]) -> Self {
        ReceiptColumns {
            event_ids: round.iter().map(|r| r.event_id).collect(),
            payload_digests: round
                .iter()
                .map(|r| DigestParam(StoredDigest::of(&r.payload_digest)))
                .collect(),
            destination_digests: round
                .iter()
                .map(|r| DigestParam(StoredDigest::of(&r.destination_digest)))
                .collect(),
            destination_ids: round
                .iter()
                .map(|r| {
                    prepared
                        .destination_id(r)
                        .expect("resolve_destinations found every destination of the batch")
                })
                .collect(),
            partitions: round.iter().map(|r| r.partition).collect(),
            offsets: round.iter().map(|r| r.offset).collect(),
            timestamps_ms: round.iter().map(|r| r.timestamp_ms).collect(),
            attempts: round.iter().map(|r| r.attempt).collect(),
            relay_generations: round.iter().map(|r| r.relay_generation).collect(),
            commit_lsns: round
                .iter()
                .map(|r| r.commit_lsn.map(|l| PgLsn::from(l.as_u64())))
                .collect(),
            evidence: round.iter().map(|r| r.evidence.as_deref()).collect(),
            aggregate_versions: round.iter().map(|r| r.aggregate_version).collect(),
        }
    }

    /// `$1` to `$13`, with the slot as `$11`.
    fn params<'p>(&'p self, slot: &'p &'p str) -> [&'p (dyn ToSql + Sync); 13] {
        [
            &self.event_ids,
            &self.payload_digests,
            &self.destination_digests,
            &self.destination_ids,
            &self.partitions,
            &self.offsets,
            &self.timestamps_ms,
            &self.attempts,
            &self.relay_generations,
            &self.commit_lsns,
            slot,
            &self.evidence,
            &self.aggregate_versions,
        ]
    }
}

/// Accepts one round of receipts that can only be primary ones ([`FRESH_BATCH_SQL`], then the
/// entries by [`FRESH_ENTRIES_COPY`]): [`Fresh::Inserted`] when all were inserted as primary
/// receipts, [`Fresh::Shut`] when the gate's conditions do not hold and nothing was written. A taken
/// publish slot is an error ([`LedgerError::is_taken_publish_slot`]), reported when the `COPY`
/// ends.
async fn accept_fresh(
    tx: &tokio_postgres::Transaction<'_>,
    prepared: &mut Prepared,
    slot: &str,
    round: &[&ReceiptRecord],
    floor: Option<(i64, StreamPosition)>,
    raises: &[(i64, Option<StreamPosition>)],
) -> Result<Fresh, LedgerError> {
    let stmt = prepared_statement(tx, &mut prepared.fresh_batch, FRESH_BATCH_SQL).await?;
    let smallest = round.iter().map(|r| r.event_id).min();
    // A batch without a run of its own is compared with no run (-2 is none).
    let generation = floor.map_or(-2, |f| f.0);
    let lowest = floor.map(|f| f.1);
    let (generations, commits, changes) = raise_columns(raises);
    let row = tx
        .query_one(
            &stmt,
            &[
                &slot,
                &smallest,
                &generation,
                &lowest.map(|p| PgLsn::from(p.commit_lsn.as_u64())),
                &lowest.map(|p| PgLsn::from(p.change_lsn.as_u64())),
                &generations,
                &commits,
                &changes,
            ],
        )
        .await
        .ctx("opening a batch of receipts (outbox.receipt_batches)")?;
    let (batch_id, held_open, locked): (Option<i64>, bool, bool) =
        (row.get(0), row.get(1), row.get(2));
    let Some(batch_id) = batch_id else {
        return Ok(Fresh::Shut { locked });
    };
    let copy = prepared_statement(tx, &mut prepared.fresh_copy, FRESH_ENTRIES_COPY).await?;
    let context = || {
        format!(
            "accepting a batch of {} receipts (COPY outbox.receipt_entries)",
            round.len()
        )
    };
    let sink = tx.copy_in(&copy).await.ctx(context())?;
    let writer = BinaryCopyInWriter::new(sink, &ENTRY_TYPES);
    tokio::pin!(writer);
    for r in round {
        let destination_id = prepared
            .destination_id(r)
            .expect("resolve_destinations found every destination of the batch");
        writer
            .as_mut()
            .write(&[
                &r.event_id,
                &batch_id,
                &destination_id,
                &r.partition,
                &r.offset,
                &r.timestamp_ms.map(MillisParam),
                &r.attempt,
                &r.relay_generation,
                &r.commit_lsn.map(|l| PgLsn::from(l.as_u64())),
                &DigestParam(StoredDigest::of(&r.payload_digest)),
                &DigestParam(StoredDigest::of(&r.destination_digest)),
                &r.evidence.as_deref().map(JsonbParam),
                &r.aggregate_version,
            ])
            .await
            .ctx(context())?;
    }
    let inserted = writer.as_mut().finish().await.ctx(context())?;
    if held_open {
        let unheld = prepared_statement(tx, &mut prepared.fresh_unheld, FRESH_UNHELD_SQL).await?;
        let ids: Vec<uuid::Uuid> = round.iter().map(|r| r.event_id).collect();
        tx.query_one(&unheld, &[&ids])
            .await
            .ctx("closing the held events of accepted receipts (outbox.held_events)")?;
    }
    Ok(Fresh::Inserted {
        primary: inserted,
        locked,
    })
}

/// Runs each non-empty round of receipts, in order, through [`ACCEPT_SQL`] and adds what it
/// recorded (primary, duplicates, conflicts) to `out`.
async fn classify_rounds(
    tx: &tokio_postgres::Transaction<'_>,
    prepared: &mut Prepared,
    slot: &str,
    rounds: &[&[&ReceiptRecord]],
    out: &mut AcceptOutcome,
) -> Result<(), LedgerError> {
    for round in rounds.iter().filter(|r| !r.is_empty()) {
        let stmt = prepared_statement(tx, &mut prepared.accept, ACCEPT_SQL).await?;
        let columns = ReceiptColumns::of(prepared, round);
        let row = tx
            .query_one(&stmt, &columns.params(&slot))
            .await
            .ctx(format!("accepting a batch of {} receipts", round.len()))?;
        out.primary += row.get::<_, i64>(0) as u64;
        out.duplicates += row.get::<_, i64>(1) as u64;
        out.conflicts += row.get::<_, i64>(2) as u64;
    }
    Ok(())
}

/// The rest of an acceptance transaction after its receipts: standing refusals, holds, held
/// events, the checkpoint, the commit.
async fn record_refusals_and_commit(
    tx: tokio_postgres::Transaction<'_>,
    items: &[LedgerItem],
    slot: &str,
    end: &End<'_>,
    locked: bool,
    mut out: AcceptOutcome,
) -> Result<AcceptOutcome, LedgerError> {
    let End {
        checkpoint,
        fence,
        record,
        numbered,
    } = *end;
    // Refusals about events that are published by now (this batch's receipts included) are
    // stale and not recorded: the decision is `RefusalFilter::stands`, which the simulator's
    // ledger model runs too.
    let standing = standing_refusals(&tx, items).await?;
    let items: Vec<&LedgerItem> = items
        .iter()
        .zip(standing)
        .filter_map(|(i, stands)| stands.then_some(i))
        .collect();
    let quarantined: Vec<&QuarantineRecord> = items
        .iter()
        .filter_map(|i| match i {
            LedgerItem::Quarantine(q) => Some(q),
            _ => None,
        })
        .collect();
    if !quarantined.is_empty() {
        let q = &quarantined;
        let row = tx
            .query_one(
                QUARANTINE_SQL,
                &[
                    &q.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
                    &q.iter().map(|r| r.event_id).collect::<Vec<_>>(),
                    &q.iter()
                        .map(|r| r.aggregate_type.as_deref())
                        .collect::<Vec<_>>(),
                    &q.iter()
                        .map(|r| r.aggregate_id.as_deref())
                        .collect::<Vec<_>>(),
                    &q.iter().map(|r| r.aggregate_version).collect::<Vec<_>>(),
                    &q.iter().map(|r| r.reason_code.as_str()).collect::<Vec<_>>(),
                    &q.iter().map(|r| r.reason.as_str()).collect::<Vec<_>>(),
                    &q.iter()
                        .map(|r| r.commit_lsn.to_string())
                        .collect::<Vec<_>>(),
                    &slot,
                ],
            )
            .await
            .ctx(format!("quarantining {} events", q.len()))?;
        out.quarantined += row.get::<_, i64>(0) as u64;
    }

    // Holds before held events: a held event always has its hold row.
    for item in &items {
        if let LedgerItem::Hold(h) = item {
            tx.execute(
                "INSERT INTO outbox.holds (aggregate_type, aggregate_id, reason_code, reason,
                                           blocking_event_id, blocking_version,
                                           blocking_route_version)
                 VALUES ($1, $2, $3, $4, $5::uuid, $6::int8, $7::int8)
                 ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET
                     state = 'HELD', reason_code = EXCLUDED.reason_code, reason = EXCLUDED.reason,
                     blocking_event_id = EXCLUDED.blocking_event_id,
                     blocking_version = EXCLUDED.blocking_version,
                     blocking_route_version = EXCLUDED.blocking_route_version,
                     publish_blocking = true,
                     held_at = clock_timestamp(), release_requested_at = NULL
                 WHERE outbox.holds.state = 'RELEASING'",
                &[
                    &h.aggregate_type,
                    &h.aggregate_id,
                    &h.reason_code,
                    &h.reason,
                    &h.blocking_event_id,
                    &h.blocking_version,
                    &h.blocking_by_relay.flatten(),
                ],
            )
            .await
            .ctx(format!(
                "recording the hold of aggregate {}/{}",
                h.aggregate_type, h.aggregate_id
            ))?;
        }
    }
    let held: Vec<&HeldRecord> = items
        .iter()
        .filter_map(|i| match i {
            LedgerItem::Held(h) => Some(h),
            _ => None,
        })
        .collect();
    if !held.is_empty() {
        let n = tx
            .execute(
                "INSERT INTO outbox.held_events (event_id, aggregate_type, aggregate_id,
                                                 aggregate_version, commit_lsn, slot_name,
                                                 relay_route_version)
                 SELECT id, at, ai, av, nullif(l, '0/0')::pg_lsn, $6, rv
                 FROM unnest($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::text[],
                             $7::int8[])
                      AS t(id, at, ai, av, l, rv)
                 ON CONFLICT (event_id) DO NOTHING",
                &[
                    &held.iter().map(|h| h.event_id).collect::<Vec<_>>(),
                    &held
                        .iter()
                        .map(|h| h.aggregate_type.as_str())
                        .collect::<Vec<_>>(),
                    &held
                        .iter()
                        .map(|h| h.aggregate_id.as_str())
                        .collect::<Vec<_>>(),
                    &held.iter().map(|h| h.aggregate_version).collect::<Vec<_>>(),
                    &held
                        .iter()
                        .map(|h| h.commit_lsn.unwrap_or(Lsn::ZERO).to_string())
                        .collect::<Vec<_>>(),
                    &slot,
                    &held
                        .iter()
                        .map(|h| h.by_relay.flatten())
                        .collect::<Vec<_>>(),
                ],
            )
            .await
            .ctx(format!("recording {} held events", held.len()))?;
        out.held += n;
    }

    let mut fenced = false;
    if let Some(lsn) = checkpoint {
        fenced = !crate::checkpoint::advance_in(&tx, slot, lsn, fence, locked).await?;
        if let Some(numbered) = numbered.filter(|_| !fenced) {
            crate::numbering::write_in(&tx, slot, lsn, numbered).await?;
        }
    }
    if let Some(record) = record {
        if !locked {
            return Err(LedgerError::Invalid(format!(
                "slot {slot} has no checkpoint row to keep transaction record {}@{} on; \
                 the relay must create it before streaming",
                record.partition, record.offset
            )));
        }
        crate::checkpoint::raise_txn_record_in(&tx, slot, record).await?;
    }
    crate::hooks::before_accept_commit().await;
    tx.commit()
        .await
        .ctx("committing the receipt acceptance transaction")?;
    if fenced {
        return Err(LedgerError::LeaseLost {
            slot: slot.to_string(),
            generation: fence.map(|f| f.generation).unwrap_or(0),
        });
    }
    Ok(out)
}

/// For each item of the batch, whether it is recorded: receipts always; a refusal only while
/// its event has no primary receipt and the refusal was decided for the event's current
/// envelope generation ([`RefusalFilter::stands`]). Asks the ledger only when the batch holds
/// refusals (rare), inside the acceptance transaction, after its receipts.
async fn standing_refusals(
    tx: &tokio_postgres::Transaction<'_>,
    items: &[LedgerItem],
) -> Result<Vec<bool>, LedgerError> {
    let subjects: Vec<uuid::Uuid> = items
        .iter()
        .filter_map(|i| i.refusal().map(|(_, id)| id))
        .collect();
    // Per subject: published, and its envelope generation now (its latest migration's; none
    // once the row is purged).
    let now: std::collections::HashMap<uuid::Uuid, (bool, Option<i32>)> = if subjects.is_empty() {
        Default::default()
    } else {
        tx.query(
            "SELECT s.id,
                    EXISTS (SELECT 1 FROM outbox.receipt_of(s.id)),
                    (SELECT e.envelope_generation FROM outbox.events_current e
                     WHERE e.event_id = s.id)
             FROM unnest($1::uuid[]) AS s(id)",
            &[&subjects],
        )
        .await
        .ctx("looking up which refused events are published or migrated")?
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
    };
    let filter = RefusalFilter::default();
    Ok(items
        .iter()
        .map(|i| match i.refusal() {
            Some((kind, id)) => {
                let (published, generation) = now.get(&id).copied().unwrap_or((false, None));
                filter.stands(kind, published, i.superseded(generation))
            }
            None => true,
        })
        .collect())
}
