//! What `outboxd reconcile` reads from the ledger: events the relay should have published by
//! now, attempts still unknown, evidence that one event id carries two payloads or two
//! destinations, and the receipts to audit against the broker ([`receipts_in_scope`]).
//! Read-only; the broker side of the comparison lives in the binary.

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
            "SELECT e.event_id, e.aggregate_type || '/' || e.aggregate_id || '@'
                        || coalesce(e.aggregate_version::text, '(numbered by the relay)'),
                    coalesce(e.dest_topic, '(routed by the relay)'), extract(epoch FROM clock_timestamp() - e.occurred_at)::float8,
                    count(*) OVER ()
             FROM outbox.events_frozen e
             WHERE e.occurred_at < clock_timestamp() - make_interval(secs => $1)
               AND NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
               AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                               WHERE q.event_id = e.event_id AND (q.released_at IS NULL OR q.resolution = 'skipped'))
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

/// Open quarantine records for digest mismatches, duplicate receipts at another cluster or
/// topic than the primary receipt, primary receipts whose digests are not their row's, and
/// primary receipts that name no row.
///
/// The last two are where invariant 6 is checked against the rows: the acceptance does not
/// read the row (`crate::accept`; it compares a receipt only with a destination migration's
/// digest), because the relay computes both digests from the immutable row it read. Here both
/// are computed again from the row's columns, for every receipt (the destination only while no
/// operator migrated the event: a migration stores its own digest, which the acceptance
/// compares), and a receipt whose event id has neither a row nor a purged tombstone is named
/// once it is 10 s old (a row committed in WAL may become visible a moment after the broker's
/// ACK is accepted). A finding means a relay built a receipt that is not its row's: a bug to
/// report.
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
             WHERE (d.broker_cluster, d.topic) IS DISTINCT FROM (r.broker_cluster, r.topic)
             UNION ALL
             SELECT r.event_id, 'receipt',
                    format('primary receipt at %s/%s/%s@%s carries digests %s and %s; the row hashes to %s and %s',
                           r.broker_cluster, r.topic, r.partition, r.\"offset\",
                           r.payload_digest, r.destination_digest, h.payload, h.destination)
             FROM outbox.receipts r
             JOIN outbox.events_current e ON e.event_id = r.event_id
             CROSS JOIN LATERAL (
                 SELECT outbox.payload_digest_of(e.payload, NULL) AS payload,
                        CASE WHEN e.envelope_generation > 1 THEN r.destination_digest
                             ELSE outbox.destination_digest_of(e) END AS destination) h
             WHERE (r.payload_digest, r.destination_digest)
                   IS DISTINCT FROM (h.payload, h.destination)
             UNION ALL
             SELECT r.event_id, 'receipt',
                    format('primary receipt at %s/%s/%s@%s, accepted %s, names an event id with no outbox row and no purged tombstone',
                           r.broker_cluster, r.topic, r.partition, r.\"offset\", r.accepted_at)
             FROM outbox.receipts r
             WHERE r.accepted_at < clock_timestamp() - interval '10 seconds'
               AND NOT EXISTS (SELECT 1 FROM outbox.events e WHERE e.event_id = r.event_id)
               AND NOT EXISTS (SELECT 1 FROM outbox.purged_events p WHERE p.event_id = r.event_id)",
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
                "SELECT event_id, outbox.payload_digest_of(payload, payload_digest), dest_topic,
                        false
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

/// Every topic an event was frozen to or published at (what the bypass scan must read). An
/// HTTP endpoint's URL is no topic: it is left out.
pub async fn outbox_topics(client: &Client) -> Result<Vec<String>, LedgerError> {
    let rows = client
        .query(
            "SELECT dest_topic FROM outbox.events_frozen WHERE dest_kind <> 'http'
             UNION SELECT dest_topic FROM outbox.destination_migrations WHERE dest_kind <> 'http'
             UNION SELECT topic FROM outbox.receipts WHERE broker_kind <> 'http'
             UNION SELECT topic FROM outbox.purged_events WHERE topic !~ '^https?://'
             ORDER BY 1",
            &[],
        )
        .await
        .ctx("listing the outbox's topics")?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Which receipts `outboxd reconcile --audit-receipts` compares with the broker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReceiptScope {
    /// Every receipt in the ledger.
    All,
    /// No receipt (the audit is off).
    None,
    /// This many receipts of the audited cluster, drawn at random from the whole ledger.
    Sample(i64),
    /// Receipts accepted (primary) or received (duplicate) within this many seconds.
    Last(f64),
}

/// Which receipt table a receipt comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReceiptKind {
    /// `outbox.receipts`: the receipt that made the event PUBLISHED.
    Primary,
    /// `outbox.duplicate_receipts`: another copy the broker acknowledged.
    Duplicate,
}

impl ReceiptKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ReceiptKind::Primary => "primary",
            ReceiptKind::Duplicate => "duplicate",
        }
    }
}

/// One receipt to check against the broker (its topic is the key it is filed under).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScopedReceipt {
    pub kind: ReceiptKind,
    pub event_id: uuid::Uuid,
    pub partition: i32,
    pub offset: i64,
    /// The frozen row's payload digest (`outbox.events_current`); a primary receipt without
    /// an event row falls back to the digest it was accepted with; `None` for a duplicate
    /// receipt without an event row.
    pub payload_digest: Option<String>,
}

/// The receipts in one scope: the Kafka receipts of the audited cluster, by topic (each list
/// sorted by partition, offset), and what is in scope but cannot be audited.
#[derive(Debug, Clone, Default)]
pub struct ReceiptsInScope {
    pub by_topic: std::collections::BTreeMap<String, Vec<ScopedReceipt>>,
    /// Receipts in `by_topic`.
    pub kafka: u64,
    /// NATS receipts in scope (for a sample: in the ledger), which a Kafka scan cannot audit.
    pub nats: i64,
    /// HTTP receipts in scope (for a sample: in the ledger): an endpoint has nothing to scan;
    /// the receipt's evidence is the endpoint's answer.
    pub http: i64,
    /// Kafka receipts in scope (or, for a sample, in the ledger) of another broker cluster.
    pub other_cluster: i64,
}

/// Every receipt (primary and duplicate) as one relation: kind, event id, broker kind and
/// cluster, position, when it was recorded, and the frozen payload digest.
const RECEIPTS_UNION: &str = "
    SELECT 'primary' AS kind, r.event_id, r.broker_kind, r.broker_cluster, r.topic, r.partition,
           r.\"offset\", coalesce(outbox.payload_digest_of(ec.payload, ec.payload_digest),
                                 r.payload_digest) AS payload_digest
    FROM outbox.receipts r
    LEFT JOIN outbox.events_current ec ON ec.event_id = r.event_id
    WHERE $1::float8 IS NULL OR r.accepted_at >= clock_timestamp() - make_interval(secs => $1)
    UNION ALL
    SELECT 'duplicate', d.event_id, d.broker_kind, d.broker_cluster, d.topic, d.partition,
           d.\"offset\", outbox.payload_digest_of(ec.payload, ec.payload_digest)
    FROM outbox.duplicate_receipts d
    LEFT JOIN outbox.events_current ec ON ec.event_id = d.event_id
    WHERE $1::float8 IS NULL OR d.received_at >= clock_timestamp() - make_interval(secs => $1)";

/// Rows fetched per round trip: the scope is read through a portal, never as one result set.
const FETCH_ROWS: i32 = 10_000;

/// The receipts in `scope` that a scan of Kafka cluster `cluster` can check (broker kind
/// `kafka`, that cluster), by topic, and the counts of those it cannot. One query for the
/// receipts (read in batches), one for the counts, in one read-only snapshot.
pub async fn receipts_in_scope(
    client: &mut Client,
    scope: ReceiptScope,
    cluster: &str,
) -> Result<ReceiptsInScope, LedgerError> {
    let mut out = ReceiptsInScope::default();
    let (since, limit): (Option<f64>, Option<i64>) = match scope {
        ReceiptScope::None => return Ok(out),
        ReceiptScope::All => (None, None),
        ReceiptScope::Sample(n) => (None, Some(n.max(0))),
        ReceiptScope::Last(secs) => (Some(secs), None),
    };
    let tx = client
        .build_transaction()
        .read_only(true)
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .ctx("starting the receipt audit's read-only transaction")?;
    let select = format!(
        "SELECT kind, event_id, topic, partition, \"offset\", payload_digest
         FROM ({RECEIPTS_UNION}) s
         WHERE broker_kind = 'kafka' AND broker_cluster = $2
         {}",
        if limit.is_some() {
            "ORDER BY random() LIMIT $3"
        } else {
            ""
        }
    );
    let portal = match limit {
        Some(n) => tx.bind(select.as_str(), &[&since, &cluster, &n]).await,
        None => tx.bind(select.as_str(), &[&since, &cluster]).await,
    }
    .ctx("selecting the receipts to audit")?;
    loop {
        let rows = tx
            .query_portal(&portal, FETCH_ROWS)
            .await
            .ctx("reading the receipts to audit")?;
        for r in &rows {
            let kind: &str = r.get(0);
            let topic: String = r.get(2);
            out.by_topic.entry(topic).or_default().push(ScopedReceipt {
                kind: if kind == "primary" {
                    ReceiptKind::Primary
                } else {
                    ReceiptKind::Duplicate
                },
                event_id: r.get(1),
                partition: r.get(3),
                offset: r.get(4),
                payload_digest: r.get(5),
            });
            out.kafka += 1;
        }
        if rows.len() < FETCH_ROWS as usize {
            break;
        }
    }
    for list in out.by_topic.values_mut() {
        list.sort_by_key(|r| (r.partition, r.offset, r.kind.as_str(), r.event_id));
    }
    let counts = tx
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE broker_kind = 'nats'),
                        count(*) FILTER (WHERE broker_kind = 'kafka' AND broker_cluster <> $2),
                        count(*) FILTER (WHERE broker_kind = 'http')
                 FROM ({RECEIPTS_UNION}) s"
            ),
            &[&since, &cluster],
        )
        .await
        .ctx("counting the receipts the audit cannot check")?;
    out.nats = counts.get(0);
    out.other_cluster = counts.get(1);
    out.http = counts.get(2);
    tx.commit()
        .await
        .ctx("ending the receipt audit's transaction")?;
    Ok(out)
}
