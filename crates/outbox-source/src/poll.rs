//! Poll mode's source (`outboxd run --mode poll`): the next outbox events without a receipt,
//! read with short queries instead of a replication slot, for databases where logical
//! replication is not allowed.
//!
//! What is pending is found per aggregate, not per event: `outbox.aggregate_versions` holds
//! the last version each aggregate was given (by `outbox.enqueue`, under the aggregate's row
//! lock, so an aggregate's versions become visible in order) and `outbox.aggregate_heads` the
//! last version with a receipt (folded from the head journal first). An aggregate whose last
//! version is above its head has pending events: exactly those above the head, read through
//! the (aggregate type, aggregate id, version) index. So a round costs one pass over the
//! aggregates (narrow rows) plus the pending events themselves, however many published events
//! the table holds, and never skips one: there is no cursor over commit order to get wrong.
//! Held aggregates (a quarantined event, a gap) are left to `outboxd quarantine release`.
//!
//! Rows come back in [`crate::snapshot::event_from_row`]'s column order, oldest version first
//! per aggregate.

/// The next pending events, at most `$1` (bigint), oldest version first per aggregate.
/// `events` is the table (or `outbox.events_current`) events are read from.
pub fn pending_sql(events: &str) -> String {
    let cols = crate::snapshot::text_columns();
    format!(
        "SELECT {cols}
         FROM outbox.aggregate_versions v
         LEFT JOIN outbox.aggregate_heads h
                ON h.aggregate_type = v.aggregate_type AND h.aggregate_id = v.aggregate_id
         CROSS JOIN LATERAL (
             SELECT * FROM {events} x
             WHERE x.aggregate_type = v.aggregate_type AND x.aggregate_id = v.aggregate_id
               AND x.aggregate_version > coalesce(h.last_version, 0)
         ) e
         WHERE v.last_version > coalesce(h.last_version, 0)
           AND NOT EXISTS (SELECT 1 FROM outbox.holds ho
                           WHERE ho.aggregate_type = v.aggregate_type AND ho.aggregate_id = v.aggregate_id)
           AND NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
           AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                           WHERE q.event_id = e.event_id AND q.released_at IS NULL)
         ORDER BY v.aggregate_type, v.aggregate_id, e.aggregate_version
         LIMIT $1"
    )
}
