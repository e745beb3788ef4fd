//! What `outboxd reconcile` reads from the ledger: events the relay should have published by
//! now, attempts still unknown, and evidence that one event id carries two payloads or two
//! destinations. Read-only; the broker side of the comparison lives in the binary.

use std::collections::HashMap;

use serde::Serialize;
use tokio_postgres::Client;

use crate::{Context, LedgerError};

/// A committed event without a primary receipt, quarantine, hold or open UNKNOWN attempt,
/// older than the threshold: the relay is not publishing it.
#[derive(Debug, Clone, Serialize)]
pub struct AgedPending {
    pub event_id: uuid::Uuid,
    pub aggregate: String,
    pub topic: String,
    pub age_seconds: f64,
}

/// Pending events older than `older_than_secs`: at most `limit`, and the total.
pub async fn aged_pending(
    client: &Client,
    older_than_secs: f64,
    limit: i64,
) -> Result<(Vec<AgedPending>, i64), LedgerError> {
    let rows = client
        .query(
            "SELECT e.event_id, e.aggregate_type || '/' || e.aggregate_id || '@' || e.aggregate_version,
                    e.dest_topic, extract(epoch FROM clock_timestamp() - e.occurred_at)::float8,
                    count(*) OVER ()
             FROM outbox.events e
             WHERE e.occurred_at < clock_timestamp() - make_interval(secs => $1)
               AND NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
               AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                               WHERE q.event_id = e.event_id AND q.released_at IS NULL)
               AND NOT EXISTS (SELECT 1 FROM outbox.held_events h
                               WHERE h.event_id = e.event_id AND h.released_at IS NULL)
               AND NOT EXISTS (SELECT 1 FROM outbox.attempts a
                               WHERE a.event_id = e.event_id AND a.state = 'DISPATCH_UNKNOWN')
             ORDER BY e.occurred_at
             LIMIT $2",
            &[&older_than_secs, &limit],
        )
        .await
        .ctx("finding aged PENDING events")?;
    let total = rows.first().map(|r| r.get::<_, i64>(4)).unwrap_or(0);
    Ok((
        rows.iter()
            .map(|r| AgedPending {
                event_id: r.get(0),
                aggregate: r.get(1),
                topic: r.get(2),
                age_seconds: r.get(3),
            })
            .collect(),
        total,
    ))
}

/// An attempt whose outcome is still DISPATCH_UNKNOWN after the threshold.
#[derive(Debug, Clone, Serialize)]
pub struct AgedUnknown {
    pub event_id: uuid::Uuid,
    pub relay_generation: i64,
    pub attempt_generation: i32,
    pub topic: String,
    pub partition: i32,
    pub age_seconds: f64,
}

/// Attempts UNKNOWN for longer than `older_than_secs`: at most `limit`, and the total.
pub async fn aged_unknown(
    client: &Client,
    older_than_secs: f64,
    limit: i64,
) -> Result<(Vec<AgedUnknown>, i64), LedgerError> {
    let rows = client
        .query(
            "SELECT event_id, relay_generation, attempt_generation, topic, partition,
                    extract(epoch FROM clock_timestamp() - unknown_at)::float8, count(*) OVER ()
             FROM outbox.attempts
             WHERE state = 'DISPATCH_UNKNOWN'
               AND unknown_at < clock_timestamp() - make_interval(secs => $1)
             ORDER BY unknown_at
             LIMIT $2",
            &[&older_than_secs, &limit],
        )
        .await
        .ctx("finding aged DISPATCH_UNKNOWN attempts")?;
    let total = rows.first().map(|r| r.get::<_, i64>(6)).unwrap_or(0);
    Ok((
        rows.iter()
            .map(|r| AgedUnknown {
                event_id: r.get(0),
                relay_generation: r.get(1),
                attempt_generation: r.get(2),
                topic: r.get(3),
                partition: r.get(4),
                age_seconds: r.get(5),
            })
            .collect(),
        total,
    ))
}

/// Evidence in the ledger that one event id was seen with another payload or destination.
#[derive(Debug, Clone, Serialize)]
pub struct LedgerConflict {
    pub event_id: Option<uuid::Uuid>,
    pub source: String,
    pub detail: String,
}

/// Open quarantine records for digest mismatches, and duplicate receipts at another cluster or
/// topic than the primary receipt.
pub async fn ledger_conflicts(client: &Client) -> Result<Vec<LedgerConflict>, LedgerError> {
    let rows = client
        .query(
            "SELECT q.event_id, 'quarantine', q.reason_code || ': ' || q.reason
             FROM outbox.quarantine q
             WHERE q.released_at IS NULL
               AND q.reason_code IN ('receipt_digest_mismatch', 'payload_digest_mismatch',
                                     'destination_digest_mismatch')
             UNION ALL
             SELECT d.event_id, 'duplicate_receipt',
                    format('primary receipt at %s/%s/%s@%s, another copy at %s/%s/%s@%s',
                           r.broker_cluster, r.topic, r.partition, r.\"offset\",
                           d.broker_cluster, d.topic, d.partition, d.\"offset\")
             FROM outbox.duplicate_receipts d
             JOIN outbox.receipts r ON r.event_id = d.event_id
             WHERE (d.broker_cluster, d.topic) IS DISTINCT FROM (r.broker_cluster, r.topic)",
            &[],
        )
        .await
        .ctx("finding payload/destination conflicts in the ledger")?;
    Ok(rows
        .iter()
        .map(|r| LedgerConflict {
            event_id: r.get(0),
            source: r.get(1),
            detail: r.get(2),
        })
        .collect())
}

/// What the ledger knows about an event id seen on the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownEvent {
    pub payload_digest: String,
    /// The topic it is frozen to now (after any destination migration), or, for a purged
    /// event, the topic of its primary receipt.
    pub topic: String,
    pub purged: bool,
}

/// Looks up event ids in the outbox and among purged events' tombstones.
pub async fn known_events(
    client: &Client,
    ids: &[uuid::Uuid],
) -> Result<HashMap<uuid::Uuid, KnownEvent>, LedgerError> {
    let mut out = HashMap::new();
    for chunk in ids.chunks(5000) {
        let rows = client
            .query(
                "SELECT event_id, payload_digest, dest_topic, false
                 FROM outbox.events_current WHERE event_id = ANY ($1)
                 UNION ALL
                 SELECT event_id, payload_digest, topic, true
                 FROM outbox.purged_events WHERE event_id = ANY ($1)",
                &[&chunk],
            )
            .await
            .ctx("looking up broker event ids in the outbox")?;
        for r in rows {
            out.insert(
                r.get(0),
                KnownEvent {
                    payload_digest: r.get(1),
                    topic: r.get(2),
                    purged: r.get(3),
                },
            );
        }
    }
    Ok(out)
}

/// Every topic an event was frozen to or published at (what the bypass scan must read).
pub async fn outbox_topics(client: &Client) -> Result<Vec<String>, LedgerError> {
    let rows = client
        .query(
            "SELECT dest_topic FROM outbox.events
             UNION SELECT dest_topic FROM outbox.destination_migrations
             UNION SELECT topic FROM outbox.receipts
             UNION SELECT topic FROM outbox.purged_events
             ORDER BY 1",
            &[],
        )
        .await
        .ctx("listing the outbox's topics")?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}
