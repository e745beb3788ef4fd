//! Attempts that ended without proof (DISPATCH_UNKNOWN) and their reconciliation records.
//!
//! Unknown stays unknown until proven: an attempt moves to FOUND only with the broker offset
//! the scan found, and to ABSENT only after the whole range was scanned with the producer
//! session that sent it closed. Every resolution records when it happened, so the time from
//! UNKNOWN to resolution is measurable per attempt.

use std::time::SystemTime;

use tokio_postgres::Client;
use uuid::Uuid;

use crate::{Context, LedgerError};

/// An attempt the broker may or may not have.
#[derive(Debug, Clone, PartialEq)]
pub struct UnknownAttempt {
    pub id: i64,
    pub event_id: Uuid,
    pub relay_generation: i64,
    pub attempt_generation: i32,
    pub topic: String,
    pub partition: i32,
    /// Seconds the attempt has been unknown.
    pub unknown_for_s: f64,
    /// A lower bound for its offset: the highest offset of that partition accepted (with a
    /// clock-skew margin) before the attempt was sent; -1 if none.
    pub scan_from: i64,
    /// Whether its event has its primary receipt (a late report, or another attempt, was
    /// recorded).
    pub has_receipt: bool,
    /// Seconds since it was sent, by the database clock (what a broker's duplicate window
    /// counts from, give or take clock skew, which the sink's margin covers).
    pub sent_ago_s: f64,
    /// For a row written without a version: the version and route version the relay gave it
    /// when it sent this attempt (migration 0039).
    pub by_relay: Option<(i64, Option<i64>)>,
}

/// Records an attempt that ended without proof. Durable before the relay does anything else.
#[allow(clippy::too_many_arguments)]
pub async fn record_unknown(
    client: &Client,
    slot: &str,
    event_id: Uuid,
    relay_generation: i64,
    attempt_generation: i32,
    topic: &str,
    partition: i32,
    sent_at: SystemTime,
    error: &str,
    by_relay: Option<(i64, Option<i64>)>,
) -> Result<(), LedgerError> {
    let (version, route) = match by_relay {
        Some((v, r)) => (Some(v), r),
        None => (None, None),
    };
    client
        .execute(
            "INSERT INTO outbox.attempts (event_id, relay_generation, attempt_generation, slot_name,
                                          topic, partition, sent_at, error, relay_version,
                                          relay_route_version)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
             ON CONFLICT (event_id, relay_generation, attempt_generation) DO NOTHING",
            &[
                &event_id,
                &relay_generation,
                &attempt_generation,
                &slot,
                &topic,
                &partition,
                &sent_at,
                &error,
                &version,
                &route,
            ],
        )
        .await
        .ctx(format!("recording DISPATCH_UNKNOWN for event {event_id}"))?;
    Ok(())
}

/// Open UNKNOWN attempts of `slot`, oldest first, with their scan lower bounds.
pub async fn open_unknown(client: &Client, slot: &str) -> Result<Vec<UnknownAttempt>, LedgerError> {
    open_attempts(client, slot, None).await
}

/// The open UNKNOWN attempt of `event_id` (the latest, if several), with its scan lower bound.
pub async fn open_unknown_of(
    client: &Client,
    slot: &str,
    event_id: Uuid,
) -> Result<Option<UnknownAttempt>, LedgerError> {
    Ok(open_attempts(client, slot, Some(event_id)).await?.pop())
}

/// Every open UNKNOWN attempt of `event_id`, oldest first.
pub async fn all_open_unknown_of(
    client: &Client,
    slot: &str,
    event_id: Uuid,
) -> Result<Vec<UnknownAttempt>, LedgerError> {
    open_attempts(client, slot, Some(event_id)).await
}

async fn open_attempts(
    client: &Client,
    slot: &str,
    event: Option<Uuid>,
) -> Result<Vec<UnknownAttempt>, LedgerError> {
    let rows = client
        .query(
            "SELECT a.id, a.event_id, a.relay_generation, a.attempt_generation, a.topic, a.partition,
                    extract(epoch FROM clock_timestamp() - a.unknown_at)::float8,
                    coalesce((SELECT max(r.\"offset\") FROM outbox.receipts r
                              WHERE r.topic = a.topic AND r.partition = a.partition
                                AND r.accepted_at < a.sent_at - interval '60 seconds'), -1),
                    EXISTS (SELECT 1 FROM outbox.receipt_of(a.event_id)),
                    extract(epoch FROM clock_timestamp() - a.sent_at)::float8,
                    a.relay_version, a.relay_route_version
             FROM outbox.attempts a
             WHERE a.slot_name = $1 AND a.state = 'DISPATCH_UNKNOWN'
               AND ($2::uuid IS NULL OR a.event_id = $2)
             ORDER BY a.id",
            &[&slot, &event],
        )
        .await
        .ctx("reading DISPATCH_UNKNOWN attempts")?;
    Ok(rows
        .iter()
        .map(|r| UnknownAttempt {
            id: r.get(0),
            event_id: r.get(1),
            relay_generation: r.get(2),
            attempt_generation: r.get(3),
            topic: r.get(4),
            partition: r.get(5),
            unknown_for_s: r.get(6),
            scan_from: r.get(7),
            has_receipt: r.get(8),
            sent_ago_s: r.get(9),
            by_relay: r
                .get::<_, Option<i64>>(10)
                .map(|v| (v, r.get::<_, Option<i64>>(11))),
        })
        .collect())
}

/// Closes attempt `id` as found at its event's primary receipt (the receipt is the
/// destination's answer under the event's key: `outbox_relay::unknown::Reconcile::ClosedByReceipt`).
/// Returns the receipt's offset, or `None` if the attempt was no longer open.
pub async fn resolve_by_receipt(client: &Client, id: i64) -> Result<Option<i64>, LedgerError> {
    Ok(client
        .query_opt(
            "UPDATE outbox.attempts a
             SET state = 'FOUND', found_offset = r.\"offset\", scanned_from = r.\"offset\",
                 scanned_to = r.\"offset\", resolved_at = clock_timestamp()
             FROM (SELECT x.id, p.\"offset\" FROM outbox.attempts x
                   CROSS JOIN LATERAL outbox.receipt_of(x.event_id) p WHERE x.id = $1) r
             WHERE a.id = r.id AND a.state = 'DISPATCH_UNKNOWN'
             RETURNING r.\"offset\"",
            &[&id],
        )
        .await
        .ctx(format!("resolving attempt {id} by its event's receipt"))?
        .map(|r| r.get(0)))
}

/// The scan proved the outcome.
pub async fn resolve(
    client: &Client,
    id: i64,
    found_offset: Option<i64>,
    scanned_from: i64,
    scanned_to: i64,
) -> Result<(), LedgerError> {
    client
        .execute(
            "UPDATE outbox.attempts
             SET state = CASE WHEN $2::int8 IS NULL THEN 'ABSENT' ELSE 'FOUND' END,
                 found_offset = $2, scanned_from = $3, scanned_to = $4,
                 resolved_at = clock_timestamp()
             WHERE id = $1 AND state = 'DISPATCH_UNKNOWN'",
            &[&id, &found_offset, &scanned_from, &scanned_to],
        )
        .await
        .ctx(format!("resolving attempt {id}"))?;
    Ok(())
}

/// The highest attempt generation recorded for `event_id` (0 if none).
pub async fn last_generation(client: &Client, event_id: Uuid) -> Result<i32, LedgerError> {
    let r = client
        .query_one(
            "SELECT coalesce(max(attempt_generation), 0) FROM outbox.attempts WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .ctx("reading attempt generations")?;
    Ok(r.get(0))
}

/// The attempt generation of the next send of every event of `slot` whose latest UNKNOWN
/// attempt was proven absent and that has no primary receipt yet: one above the highest
/// generation recorded for it. The relay loads this at start, so a resend after a restart is
/// attempt n + 1, not attempt 1 again (the generation is evidence: a late ACK of attempt n must
/// never be mistaken for the retry's).
pub async fn retry_generations(
    client: &Client,
    slot: &str,
) -> Result<Vec<(Uuid, i32)>, LedgerError> {
    let rows = client
        .query(
            "SELECT a.event_id, max(a.attempt_generation) + 1
             FROM outbox.attempts a
             WHERE a.slot_name = $1
               AND NOT EXISTS (SELECT 1 FROM outbox.receipt_of(a.event_id))
             GROUP BY a.event_id
             HAVING bool_and(a.state = 'ABSENT')",
            &[&slot],
        )
        .await
        .ctx("reading the attempt generations of retries")?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}
