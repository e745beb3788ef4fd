//! Read-only status for operators (`outboxd status`): where every event is, and how far each
//! slot is behind.

use serde::Serialize;
use tokio_postgres::Client;

use crate::{Context, LedgerError};

/// One slot as PostgreSQL and the ledger see it.
#[derive(Debug, Clone, Serialize)]
pub struct SlotStatus {
    pub slot_name: String,
    pub publication: String,
    /// Ledger checkpoint (what the relay may confirm).
    pub checkpoint_lsn: String,
    /// `pg_replication_slots.confirmed_flush_lsn`, if the slot exists.
    pub slot_confirmed_lsn: Option<String>,
    pub slot_exists: bool,
    pub active: Option<bool>,
    pub wal_status: Option<String>,
    /// Bytes of WAL between the slot's restart_lsn and the current WAL position.
    pub retained_wal_bytes: Option<i64>,
    /// Bytes of WAL between the slot's confirmed position and the current WAL position.
    pub lag_bytes: Option<i64>,
    pub snapshot_done: bool,
}

/// Whole-ledger counts.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub events: i64,
    pub published: i64,
    pub duplicate_receipts: i64,
    pub quarantined: i64,
    /// Events with neither a primary receipt nor an open quarantine record.
    pub pending: i64,
    pub oldest_pending_age_seconds: Option<f64>,
    pub slots: Vec<SlotStatus>,
}

/// Reads the status. Fails with a clear error if the schema is not migrated.
pub async fn read(client: &Client) -> Result<Status, LedgerError> {
    let counts = client
        .query_one(
            "SELECT (SELECT count(*) FROM outbox.events),
                    (SELECT count(*) FROM outbox.receipts),
                    (SELECT count(*) FROM outbox.duplicate_receipts),
                    (SELECT count(*) FROM outbox.quarantine WHERE released_at IS NULL),
                    p.n, p.age
             FROM (SELECT count(*) AS n,
                          extract(epoch FROM clock_timestamp() - min(e.occurred_at))::float8 AS age
                   FROM outbox.events e
                   WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
                     AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                                     WHERE q.event_id = e.event_id AND q.released_at IS NULL)) p",
            &[],
        )
        .await
        .ctx("reading ledger counts (is the database migrated? run `outboxd migrate`)")?;
    let rows = client
        .query(
            "SELECT c.slot_name, c.publication, c.confirmed_lsn::text,
                    s.confirmed_flush_lsn::text, s.slot_name IS NOT NULL, s.active, s.wal_status,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::int8,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::int8,
                    c.snapshot_done
             FROM outbox.checkpoints c
             LEFT JOIN pg_replication_slots s ON s.slot_name = c.slot_name
             ORDER BY c.slot_name",
            &[],
        )
        .await
        .ctx("reading slot status")?;
    Ok(Status {
        events: counts.get(0),
        published: counts.get(1),
        duplicate_receipts: counts.get(2),
        quarantined: counts.get(3),
        pending: counts.get(4),
        oldest_pending_age_seconds: counts.get(5),
        slots: rows
            .iter()
            .map(|r| SlotStatus {
                slot_name: r.get(0),
                publication: r.get(1),
                checkpoint_lsn: r.get(2),
                slot_confirmed_lsn: r.get(3),
                slot_exists: r.get(4),
                active: r.get(5),
                wal_status: r.get(6),
                retained_wal_bytes: r.get(7),
                lag_bytes: r.get(8),
                snapshot_done: r.get(9),
            })
            .collect(),
    })
}

/// One event's full history: its state, every unresolved or reconciled attempt, the primary
/// receipt, duplicate transport receipts and quarantine records — each as a line of text.
pub async fn event_history(
    client: &Client,
    event_id: uuid::Uuid,
) -> Result<Option<Vec<String>>, LedgerError> {
    let Some(s) = client
        .query_opt(
            "SELECT state, aggregate_type || '/' || aggregate_id || '@' || aggregate_version,
                    event_type, dest_topic, occurred_at::text
             FROM outbox.event_status WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .ctx("reading the event status")?
    else {
        return Ok(None);
    };
    let mut lines = vec![
        format!("event      {event_id}"),
        format!("state      {}", s.get::<_, String>(0)),
        format!("aggregate  {}", s.get::<_, String>(1)),
        format!("type       {}", s.get::<_, String>(2)),
        format!("frozen to  {}", s.get::<_, String>(3)),
        format!("occurred   {}", s.get::<_, String>(4)),
    ];
    let sections: [(&str, &str); 4] = [
        (
            "attempt",
            "SELECT format('relay generation %s, attempt %s: %s at %s (%s/%s), %s%s',
                           relay_generation, attempt_generation, state, unknown_at, topic, partition,
                           error, coalesce(', resolved ' || resolved_at || coalesce(' at offset ' || found_offset, ''), ''))
             FROM outbox.attempts WHERE event_id = $1 ORDER BY id",
        ),
        (
            "receipt",
            "SELECT format('primary: %s/%s@%s, relay generation %s, attempt %s, accepted %s',
                           topic, partition, \"offset\", relay_generation, attempt, accepted_at)
             FROM outbox.receipts WHERE event_id = $1",
        ),
        (
            "duplicate",
            "SELECT format('%s/%s@%s, relay generation %s, attempt %s, received %s',
                           topic, partition, \"offset\", relay_generation, attempt, received_at)
             FROM outbox.duplicate_receipts WHERE event_id = $1 ORDER BY id",
        ),
        (
            "quarantine",
            "SELECT format('%s: %s (%s)%s', reason_code, reason, quarantined_at,
                           coalesce(', ' || resolution || ' by ' || released_by || coalesce(': ' || release_note, ''), ''))
             FROM outbox.quarantine WHERE event_id = $1 ORDER BY id",
        ),
    ];
    for (label, sql) in sections {
        for r in client
            .query(sql, &[&event_id])
            .await
            .ctx(format!("reading the event's {label} records"))?
        {
            lines.push(format!("{label:<10} {}", r.get::<_, String>(0)));
        }
    }
    Ok(Some(lines))
}
