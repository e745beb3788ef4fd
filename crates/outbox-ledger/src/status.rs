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

/// Pending events (no primary receipt, no open quarantine): their count `n` and the age of the
/// oldest in seconds `age`. One definition for `status` and the metrics sampler.
const PENDING: &str = "(SELECT count(*) AS n,
        extract(epoch FROM clock_timestamp() - min(e.occurred_at))::float8 AS age
    FROM outbox.events e
    WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
      AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                      WHERE q.event_id = e.event_id AND (q.released_at IS NULL OR q.resolution = 'skipped')))";

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
    /// Every lease (one per slot, or per poll-mode lease name): the relays and who holds what.
    pub leases: Vec<LeaseStatus>,
    /// The members of a relay fleet (`outboxd run --fleet`) and how long ago each wrote its
    /// row (seconds).
    pub members: Vec<(String, f64)>,
}

/// One lease of `outbox.relay_leases`, as `outboxd status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseStatus {
    pub slot_name: String,
    pub owner: String,
    pub generation: i64,
    /// Seconds until it expires; negative: expired (free for any relay).
    pub expires_in_seconds: f64,
    pub acquired_at: String,
    /// The holder keeps the lease's session lock: its lease is taken at once if it dies
    /// (migration 0018), else only when it expires.
    pub holder_locks: bool,
}

/// Reads the status. Fails with a clear error if the schema is not migrated.
pub async fn read(client: &Client) -> Result<Status, LedgerError> {
    let counts = client
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM outbox.events),
                        (SELECT count(*) FROM outbox.receipts),
                        (SELECT count(*) FROM outbox.duplicate_receipts),
                        (SELECT count(*) FROM outbox.quarantine WHERE released_at IS NULL),
                        p.n, p.age
                 FROM {PENDING} p"
            ),
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
    let leases = client
        .query(
            "SELECT slot_name, owner, generation,
                    extract(epoch FROM lease_until - clock_timestamp())::float8,
                    acquired_at::text, holder_locks
             FROM outbox.relay_leases ORDER BY slot_name",
            &[],
        )
        .await
        .ctx("reading the relay leases")?
        .iter()
        .map(|r| LeaseStatus {
            slot_name: r.get(0),
            owner: r.get(1),
            generation: r.get(2),
            expires_in_seconds: r.get(3),
            acquired_at: r.get(4),
            holder_locks: r.get(5),
        })
        .collect();
    let members = client
        .query(
            "SELECT relay_id, extract(epoch FROM clock_timestamp() - seen_at)::float8
             FROM outbox.relay_members ORDER BY relay_id",
            &[],
        )
        .await
        .ctx("reading the fleet's members")?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    Ok(Status {
        members,
        leases,
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
            // A row written without a version or route (docs/versions_by_relay.md) shows the
            // ones the relay gave it, from its receipt, or says they are still to be given.
            "SELECT s.state, s.aggregate_type || '/' || s.aggregate_id || '@'
                        || coalesce(s.aggregate_version::text, r.aggregate_version::text || ' (numbered by the relay)',
                                    '? (numbered by the relay when it publishes it)'),
                    s.event_type,
                    coalesce(s.dest_topic, r.topic || ' (routed by the relay)',
                             '? (routed by the relay when it publishes it)'),
                    s.occurred_at::text
             FROM outbox.event_status s LEFT JOIN LATERAL outbox.receipt_of(s.event_id) r ON true
             WHERE s.event_id = $1",
            &[&event_id],
        )
        .await
        .ctx("reading the event status")?
    else {
        return purged_history(client, event_id).await;
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
            "SELECT format('primary: %s/%s@%s, relay generation %s, attempt %s, accepted %s%s',
                           topic, partition, \"offset\", relay_generation, attempt, accepted_at,
                           coalesce(', answered ' || (evidence ->> 'status')
                                    || coalesce(' (response id ' || (evidence ->> 'response_id') || ')', ''), ''))
             FROM outbox.receipt_of($1)",
        ),
        (
            "duplicate",
            "SELECT format('%s/%s@%s, relay generation %s, attempt %s, received %s%s',
                           topic, partition, \"offset\", relay_generation, attempt, received_at,
                           coalesce(', answered ' || (evidence ->> 'status'), ''))
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

/// Where one slot stands, for `SHOW LAG` and the lag/retention gauges.
#[derive(Debug, Clone, Serialize)]
pub struct SlotLag {
    pub slot_name: String,
    /// Ledger checkpoint: what the relay has proven and may confirm.
    pub checkpoint_lsn: String,
    /// `confirmed_flush_lsn` of the slot; `None` when the slot is missing.
    pub confirmed_flush_lsn: Option<String>,
    pub current_wal_lsn: String,
    pub active: Option<bool>,
    /// `reserved`, `extended`, `unreserved` or `lost` (invalidated).
    pub wal_status: Option<String>,
    /// WAL written since the slot's confirmed position (what the relay has not confirmed).
    pub lag_bytes: Option<i64>,
    /// WAL the server keeps for the slot (from its `restart_lsn`).
    pub retained_wal_bytes: Option<i64>,
    /// WAL that can still be written before the slot is invalidated by
    /// `max_slot_wal_keep_size`; `None` when that limit is off (-1).
    pub safe_wal_size_bytes: Option<i64>,
}

/// Every slot the ledger knows, with PostgreSQL's view of it.
pub async fn lag(client: &Client) -> Result<Vec<SlotLag>, LedgerError> {
    let rows = client
        .query(
            "SELECT c.slot_name, c.confirmed_lsn::text, s.confirmed_flush_lsn::text,
                    pg_current_wal_lsn()::text, s.active, s.wal_status,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::int8,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::int8,
                    s.safe_wal_size
             FROM outbox.checkpoints c
             LEFT JOIN pg_replication_slots s ON s.slot_name = c.slot_name
             ORDER BY c.slot_name",
            &[],
        )
        .await
        .ctx("reading slot lag (is the database migrated? run `outboxd migrate`)")?;
    Ok(rows
        .iter()
        .map(|r| SlotLag {
            slot_name: r.get(0),
            checkpoint_lsn: r.get(1),
            confirmed_flush_lsn: r.get(2),
            current_wal_lsn: r.get(3),
            active: r.get(4),
            wal_status: r.get(5),
            lag_bytes: r.get(6),
            retained_wal_bytes: r.get(7),
            safe_wal_size_bytes: r.get(8),
        })
        .collect())
}

/// The gauges the metrics sampler reads every few seconds, so the relay's hot path does not
/// have to carry them. One statement, one snapshot.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    /// Events with neither a primary receipt nor an open quarantine record.
    pub pending: i64,
    pub oldest_pending_age_seconds: Option<f64>,
    /// Open quarantine records.
    pub quarantined: i64,
    /// Aggregates held (quarantine or version gap), and the events waiting behind them.
    pub held_aggregates: i64,
    pub held_events: i64,
    /// Attempts still DISPATCH_UNKNOWN, and the age of the oldest.
    pub unknown_attempts: i64,
    pub oldest_unknown_age_seconds: Option<f64>,
}

/// Reads a [`Sample`]. The pending count is an anti-join over `outbox.events`: its cost grows
/// with the table until purge keeps it short (see docs/operations.md, Sizing).
pub async fn sample(client: &Client) -> Result<Sample, LedgerError> {
    let r = client
        .query_one(
            &format!(
                "SELECT p.n, p.age,
                        (SELECT count(*) FROM outbox.quarantine WHERE released_at IS NULL),
                        (SELECT count(*) FROM outbox.holds),
                        (SELECT count(*) FROM outbox.held_events WHERE released_at IS NULL),
                        u.n, u.age
                 FROM {PENDING} p,
                  (SELECT count(*) AS n,
                          extract(epoch FROM clock_timestamp() - min(unknown_at))::float8 AS age
                   FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN') u"
            ),
            &[],
        )
        .await
        .ctx("sampling ledger gauges (is the database migrated? run `outboxd migrate`)")?;
    Ok(Sample {
        pending: r.get(0),
        oldest_pending_age_seconds: r.get(1),
        quarantined: r.get(2),
        held_aggregates: r.get(3),
        held_events: r.get(4),
        unknown_attempts: r.get(5),
        oldest_unknown_age_seconds: r.get(6),
    })
}

/// An attempt whose outcome nobody knows yet (`SHOW UNKNOWN`).
#[derive(Debug, Clone, Serialize)]
pub struct UnknownAttempt {
    pub event_id: uuid::Uuid,
    pub slot_name: String,
    pub relay_generation: i64,
    pub attempt_generation: i32,
    pub topic: String,
    pub partition: i32,
    pub sent_at: String,
    pub unknown_at: String,
    pub age_seconds: f64,
    pub error: String,
}

/// Every attempt still DISPATCH_UNKNOWN, oldest first.
pub async fn unknown_attempts(client: &Client) -> Result<Vec<UnknownAttempt>, LedgerError> {
    let rows = client
        .query(
            "SELECT event_id, slot_name, relay_generation, attempt_generation, topic, partition,
                    sent_at::text, unknown_at::text,
                    extract(epoch FROM clock_timestamp() - unknown_at)::float8, error
             FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN' ORDER BY unknown_at, id",
            &[],
        )
        .await
        .ctx("listing DISPATCH_UNKNOWN attempts")?;
    Ok(rows
        .iter()
        .map(|r| UnknownAttempt {
            event_id: r.get(0),
            slot_name: r.get(1),
            relay_generation: r.get(2),
            attempt_generation: r.get(3),
            topic: r.get(4),
            partition: r.get(5),
            sent_at: r.get(6),
            unknown_at: r.get(7),
            age_seconds: r.get(8),
            error: r.get(9),
        })
        .collect())
}

/// One broker receipt of an event (`SHOW RECEIPT`): the primary one, or a duplicate.
#[derive(Debug, Clone, Serialize)]
pub struct ReceiptRow {
    /// `primary` (the publish slot) or `duplicate` (a transport duplicate, kept as evidence).
    pub kind: String,
    pub broker_cluster: String,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub attempt: i32,
    pub relay_generation: i64,
    pub commit_lsn: Option<String>,
    /// When the ledger accepted (primary) or recorded (duplicate) it.
    pub at: String,
}

/// The event's state and its receipts, primary first; `None` if the event is not in the
/// outbox (never committed, or purged).
pub async fn receipts(
    client: &Client,
    event_id: uuid::Uuid,
) -> Result<Option<(String, Vec<ReceiptRow>)>, LedgerError> {
    let Some(state) = client
        .query_opt(
            "SELECT state FROM outbox.event_status WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .ctx("reading the event status")?
    else {
        return Ok(None);
    };
    let rows = client
        .query(
            "SELECT 'primary', broker_cluster, topic, partition, \"offset\", attempt,
                    relay_generation, commit_lsn::text, accepted_at::text, 0::int8 AS ord
             FROM outbox.receipt_of($1)
             UNION ALL
             SELECT 'duplicate', broker_cluster, topic, partition, \"offset\", attempt,
                    relay_generation, commit_lsn::text, received_at::text, id
             FROM outbox.duplicate_receipts WHERE event_id = $1
             ORDER BY ord",
            &[&event_id],
        )
        .await
        .ctx("reading the event's receipts")?;
    Ok(Some((
        state.get(0),
        rows.iter()
            .map(|r| ReceiptRow {
                kind: r.get(0),
                broker_cluster: r.get(1),
                topic: r.get(2),
                partition: r.get(3),
                offset: r.get(4),
                attempt: r.get(5),
                relay_generation: r.get(6),
                commit_lsn: r.get(7),
                at: r.get(8),
            })
            .collect(),
    )))
}

/// A purged event keeps a small record (`outbox.purged_events`): where its primary receipt put
/// it and when it was purged, so `status --event` still answers after retention ran.
async fn purged_history(
    client: &Client,
    event_id: uuid::Uuid,
) -> Result<Option<Vec<String>>, LedgerError> {
    let row = client
        .query_opt(
            "SELECT aggregate_type || '/' || aggregate_id || '@' || aggregate_version,
                    format('%s/%s@%s, accepted %s', topic, partition, \"offset\", accepted_at),
                    occurred_at::text, purged_at::text, payload_digest
             FROM outbox.purged_events WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .ctx("reading the purge record")?;
    Ok(row.map(|r| {
        vec![
            format!("event      {event_id}"),
            "state      PURGED (published, covered by every mandatory consumer, past the replay window)".to_string(),
            format!("aggregate  {}", r.get::<_, String>(0)),
            format!("receipt    primary: {}", r.get::<_, String>(1)),
            format!("occurred   {}", r.get::<_, String>(2)),
            format!("purged     {}", r.get::<_, String>(3)),
            format!("payload    {}", r.get::<_, String>(4)),
        ]
    }))
}
