//! Poll mode's source (`outboxd run --mode poll`): the next outbox events without a receipt,
//! read with short queries instead of a replication slot, for databases where logical
//! replication is not allowed.
//!
//! What is pending is found per aggregate, not per event: `outbox.aggregate_versions` holds
//! the last version each aggregate was given (by `outbox.enqueue`, under the aggregate's row
//! lock, so an aggregate's versions become visible in order) and `outbox.poll_positions` a
//! version at or below which every event has a receipt (advanced over the receipted prefix by
//! [`ADVANCE_SQL`] before each read; migration 0015 says why the head is not that bound). An
//! aggregate whose last version is above its position has pending events: those above the
//! position without a receipt, read through the (aggregate type, aggregate id, version) indexes
//! (two partial ones, so two branches: members of a delivery set share their version).
//! So a round costs one pass over the aggregates (narrow rows) plus the pending events
//! themselves, however many published events the table holds, and never skips one: there is no
//! cursor over commit order to get wrong. Held aggregates (a quarantined event, a gap) are left
//! to `outboxd quarantine release`.
//!
//! Rows come back in [`crate::snapshot::event_from_row`]'s column order, oldest version first
//! per aggregate.

/// The next pending events, at most `$1` (bigint), oldest version first per aggregate.
/// `events` is the table (or `outbox.events_current`) events are read from.
pub fn pending_sql(events: &str) -> String {
    let cols = crate::snapshot::text_columns();
    let quarantined_or_skipped = crate::snapshot::QUARANTINED_OR_SKIPPED;
    format!(
        "SELECT {cols}
         FROM outbox.aggregate_versions v
         LEFT JOIN outbox.poll_positions p
                ON p.aggregate_type = v.aggregate_type AND p.aggregate_id = v.aggregate_id
         CROSS JOIN LATERAL (
             SELECT * FROM {events} x
             WHERE x.delivery_set_id IS NULL
               AND x.aggregate_type = v.aggregate_type AND x.aggregate_id = v.aggregate_id
               AND x.aggregate_version > coalesce(p.version, 0)
             UNION ALL
             SELECT * FROM {events} x
             WHERE x.delivery_set_id IS NOT NULL
               AND x.aggregate_type = v.aggregate_type AND x.aggregate_id = v.aggregate_id
               AND x.aggregate_version > coalesce(p.version, 0)
         ) e
         WHERE v.last_version > coalesce(p.version, 0)
           AND NOT EXISTS (SELECT 1 FROM outbox.holds ho
                           WHERE ho.aggregate_type = v.aggregate_type AND ho.aggregate_id = v.aggregate_id)
           AND NOT EXISTS (SELECT 1 FROM outbox.receipt_of(e.event_id))
           AND NOT {quarantined_or_skipped}
         ORDER BY v.aggregate_type, v.aggregate_id, e.aggregate_version
         LIMIT $1"
    )
}

/// Moves every aggregate's poll position over its receipted prefix (migration 0015). Its cost
/// grows with the number of aggregates with unpublished versions; [`ADVANCE_SOME_SQL`] is for
/// the aggregates one round published (`$1` types, `$2` ids).
pub const ADVANCE_SQL: &str = "SELECT outbox.advance_poll_positions()";

/// [`ADVANCE_SQL`] for some aggregates only.
pub const ADVANCE_SOME_SQL: &str = "SELECT outbox.advance_poll_positions($1::text[], $2::text[])";

/// Records the snapshot of this round's read for the lease (`$1` its name, `$2` the
/// generation); the first statement of the round's REPEATABLE READ transaction, so the
/// snapshot is the read's (migration 0015).
pub const RECORD_ROUND_SQL: &str = "INSERT INTO outbox.poll_rounds (slot_name, generation, snapshot)
     VALUES ($1, $2, pg_current_snapshot())
     ON CONFLICT (slot_name) DO UPDATE
     SET generation = EXCLUDED.generation, snapshot = EXCLUDED.snapshot, started_at = clock_timestamp()";

/// Moves the poll positions over the receipted prefix before a round reads what lies above
/// them: every aggregate's ([`ADVANCE_SQL`]) when `only` is `None`, else those of `only`
/// (types, ids: [`ADVANCE_SOME_SQL`]). Which: `outbox_relay::poll::Advance`.
pub async fn advance_positions(
    sql: &tokio_postgres::Client,
    only: Option<(&[String], &[String])>,
) -> Result<u64, crate::SourceError> {
    let advanced = match only {
        None => sql.execute(ADVANCE_SQL, &[]).await,
        Some((types, ids)) => sql.execute(ADVANCE_SOME_SQL, &[&types, &ids]).await,
    };
    advanced.map_err(|e| crate::slot::db_err("advancing the poll positions", e))
}

/// Opens a round's read on `sql`: a REPEATABLE READ transaction whose first statement records
/// its snapshot for the lease `slot` of `generation` ([`RECORD_ROUND_SQL`]: a destination
/// migration waits while a quarantine is newer than the round's read, migration 0015). Its
/// rows: [`pending_rows`]; committed once every row is admitted.
pub async fn begin_round<'a>(
    sql: &'a mut tokio_postgres::Client,
    slot: &str,
    generation: i64,
) -> Result<tokio_postgres::Transaction<'a>, crate::SourceError> {
    let tx = crate::snapshot::repeatable_read(sql, false, "starting the poll round").await?;
    tx.execute(RECORD_ROUND_SQL, &[&slot, &generation])
        .await
        .map_err(|e| crate::slot::db_err("recording the poll round", e))?;
    Ok(tx)
}

/// The next pending events of a round ([`begin_round`]), at most `limit`, streamed:
/// `pending` is [`pending_sql`]'s statement (planned at every round, not prepared).
pub async fn pending_rows(
    tx: &tokio_postgres::Transaction<'_>,
    pending: &str,
    limit: i64,
) -> Result<tokio_postgres::RowStream, crate::SourceError> {
    tx.query_raw(pending, [limit])
        .await
        .map_err(|e| crate::slot::db_err("reading pending outbox events", e))
}
