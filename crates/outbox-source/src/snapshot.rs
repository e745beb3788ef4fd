//! The initial snapshot: outbox rows that no slot will ever stream.
//!
//! A new slot streams only transactions that commit after its consistent point. Rows
//! committed before it (enqueued after `outboxd migrate` but before the relay first ran) are
//! read here, from the snapshot the slot exported at creation, so the set "snapshot ∪ stream"
//! is exactly every committed row, with no gap and no overlap. When that exported snapshot is
//! no longer available (the relay crashed during the snapshot, or adopted an existing slot),
//! any later snapshot works too: it is a superset, and the overlap with the stream is made
//! harmless by the receipt ledger (a second ACK becomes a duplicate transport receipt).
//!
//! Only rows without a primary receipt and without an open quarantine record are read.

use outbox_core::{OutboxEvent, RouteVersions, RowError, EVENT_COLUMNS};
use tokio_postgres::Row;
use uuid::Uuid;

/// The query that lists unpublished rows, oldest version first per aggregate.
/// `e.<column>::text, ...` for every envelope column, in [`EVENT_COLUMNS`] order.
pub fn text_columns() -> String {
    EVENT_COLUMNS
        .iter()
        .map(|c| format!("e.{c}::text"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// An event no relay may offer (`e` its row): one with an open quarantine record (an operator
/// decides its fate), or one an operator skipped (`outboxd quarantine skip`: never to be
/// published, not even by a snapshot or a poll round that reads it again). With the receipt
/// (and, for a poll round, the aggregate's hold) it is `outbox_core::records::OfferRule` in SQL;
/// `tests/reads.rs` holds the two together.
pub const QUARANTINED_OR_SKIPPED: &str = "EXISTS (SELECT 1 FROM outbox.quarantine q
    WHERE q.event_id = e.event_id AND (q.released_at IS NULL OR q.resolution = 'skipped'))";

/// Opens the initial snapshot's read on `client`: a read-only REPEATABLE READ transaction, in
/// the slot's exported snapshot `exported` when there is one (exactly the rows the slot will
/// not stream), else in a fresh one (a superset: what both carry is published twice, and
/// recorded as a duplicate). Its rows: [`pending_rows`].
pub async fn begin_read<'a>(
    client: &'a mut tokio_postgres::Client,
    exported: Option<&str>,
) -> Result<tokio_postgres::Transaction<'a>, crate::SourceError> {
    use crate::slot::db_err;
    let tx = repeatable_read(client, true, "starting the snapshot transaction").await?;
    if let Some(name) = exported {
        tx.batch_execute(&format!(
            "SET TRANSACTION SNAPSHOT '{}'",
            name.replace('\'', "")
        ))
        .await
        .map_err(|e| db_err("importing the slot's exported snapshot", e))?;
    }
    Ok(tx)
}

/// A REPEATABLE READ transaction on `client` (`read_only` or not); `starting` names it in an
/// error. The snapshot's read and a poll round's read are each one.
pub(crate) async fn repeatable_read<'a>(
    client: &'a mut tokio_postgres::Client,
    read_only: bool,
    starting: &str,
) -> Result<tokio_postgres::Transaction<'a>, crate::SourceError> {
    client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(read_only)
        .start()
        .await
        .map_err(|e| crate::slot::db_err(starting, e))
}

/// The rows of a snapshot's read ([`begin_read`]): [`pending_rows_sql`]'s, streamed.
pub async fn pending_rows(
    tx: &tokio_postgres::Transaction<'_>,
    qualified_table: &str,
    shard: Option<crate::shard::Shard>,
) -> Result<tokio_postgres::RowStream, crate::SourceError> {
    tx.query_raw(
        &pending_rows_sql(qualified_table, shard),
        Vec::<String>::new(),
    )
    .await
    .map_err(|e| crate::slot::db_err("reading unpublished outbox rows", e))
}

/// Every row without a receipt that a relay may offer, in aggregate and version order; only
/// `shard`'s aggregates for the relay of one shard.
pub fn pending_rows_sql(qualified_table: &str, shard: Option<crate::shard::Shard>) -> String {
    let cols = text_columns();
    let of_shard = shard
        .map(|s| format!("AND {}", s.filter_sql("e.aggregate_id")))
        .unwrap_or_default();
    format!(
        "SELECT {cols} FROM {qualified_table} e
         WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
           AND NOT {QUARANTINED_OR_SKIPPED}
           {of_shard}
         ORDER BY e.aggregate_type, e.aggregate_id, e.aggregate_version"
    )
}

/// Reads one row of [`pending_rows_sql`].
pub fn event_from_row(row: &Row) -> Result<OutboxEvent, RowError> {
    OutboxEvent::from_text_columns(
        |name| column_of(row, name),
        None,
        // The view renders a narrow row's destination (migration 0031).
        &RouteVersions::new(),
        // A row written without a route is routed from the stream only.
        None,
    )
}

/// Column `name` of a row read with [`text_columns`] (as [`rows_by_id_sql`] and
/// [`pending_rows_sql`] read them).
pub fn column_of<'r>(row: &'r Row, name: &str) -> Result<Option<&'r str>, RowError> {
    let idx = EVENT_COLUMNS
        .iter()
        .position(|c| *c == name)
        .ok_or_else(|| RowError {
            column: name.to_string(),
            problem: "unknown column".into(),
        })?;
    row.try_get::<_, Option<&str>>(idx).map_err(|e| RowError {
        column: name.to_string(),
        problem: e.to_string(),
    })
}

/// A row written without a version (docs/versions_by_relay.md) as the relay published it from
/// the stream: with the `version` the relay's numbering gave it and, for a row that names no
/// route and stores no destination, the `route` version the policy in force at its commit
/// chose (`routes` renders it), as an unclear attempt or a held record kept them. Read from
/// SQL the row has neither, and only the stream can number and route it again.
pub fn event_from_row_numbered(
    row: &Row,
    version: i64,
    route: Option<i64>,
    routes: &RouteVersions,
) -> Result<OutboxEvent, RowError> {
    let version = version.to_string();
    let route = route.map(|r| r.to_string());
    // The view renders a row that names its route version; one written without (no
    // destination) renders from the relay's.
    let stores_destination = column_of(row, "dest_kind")?.is_some();
    let mut ev = OutboxEvent::from_text_columns(
        |name| match name {
            "aggregate_version" => Ok(Some(version.as_str())),
            "route_version" if route.is_some() && !stores_destination => Ok(route.as_deref()),
            _ => column_of(row, name),
        },
        None,
        routes,
        None,
    )?;
    ev.version_by_relay = true;
    Ok(ev)
}

/// The query that loads given events (`$1::uuid[]`) in version order, for republishing a
/// released aggregate.
pub fn rows_by_id_sql(qualified_table: &str) -> String {
    let cols = text_columns();
    format!(
        "SELECT {cols} FROM {qualified_table} e WHERE e.event_id = ANY($1::uuid[])
         ORDER BY e.aggregate_version"
    )
}

/// How the relay publishes an event it reads again by id ([`events_by_id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Numbering {
    /// As its row says (a row with its own version).
    Row,
    /// A row written without a version: with the version, and the route version, the relay
    /// gave it when it first sent it (an unclear attempt or a held record kept both).
    ByRelay { version: i64, route: Option<i64> },
}

/// Events read again by id for a release or a reconciliation's look-up, in version order, each
/// as the relay must publish it now. `None` for a row written without a version that `wanted`
/// gives no numbering for: only the stream can number and route it. Ids without a row are
/// missing from the result; a row that cannot be read is an error naming it.
pub async fn events_by_id(
    client: &impl tokio_postgres::GenericClient,
    qualified_table: &str,
    wanted: &[(Uuid, Numbering)],
) -> Result<Vec<(Uuid, Option<OutboxEvent>)>, crate::SourceError> {
    let ids: Vec<Uuid> = wanted.iter().map(|(id, _)| *id).collect();
    let rows = client
        .query(&rows_by_id_sql(qualified_table), &[&ids])
        .await
        .map_err(|e| {
            crate::slot::db_err(
                format!("reading events {ids:?} of {qualified_table} again"),
                e,
            )
        })?;
    let routes = if wanted.iter().any(|(_, n)| *n != Numbering::Row) {
        crate::slot::route_versions(client).await?
    } else {
        RouteVersions::new()
    };
    let unreadable = |event: String, problem: RowError| crate::SourceError::UnreadableRow {
        table: qualified_table.to_string(),
        event,
        problem,
    };
    let mut events = Vec::with_capacity(rows.len());
    for row in &rows {
        let id: Uuid = column_of(row, "event_id")
            .ok()
            .flatten()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                let problem = RowError {
                    column: "event_id".into(),
                    problem: "missing or not a UUID".into(),
                };
                unreadable("without an id".into(), problem)
            })?;
        let numbering = wanted
            .iter()
            .find(|(w, _)| *w == id)
            .map_or(Numbering::Row, |(_, n)| *n);
        let ev = match numbering {
            Numbering::ByRelay { version, route } => {
                Some(event_from_row_numbered(row, version, route, &routes))
            }
            Numbering::Row if column_of(row, "aggregate_version").ok().flatten().is_none() => None,
            Numbering::Row => Some(event_from_row(row)),
        };
        events.push((
            id,
            ev.transpose().map_err(|e| unreadable(id.to_string(), e))?,
        ));
    }
    Ok(events)
}
