//! `outboxd webhooks`: what an operator of webhook endpoints needs without reading the ledger's
//! tables: per endpoint, what it refused, what waits behind that, and what is in doubt
//! (`list`); and sending again what an endpoint already acknowledged (`resend`).
//!
//! An endpoint that is down and comes back needs neither: the relay keeps asking on its
//! schedule and delivers on its own. These are for the two cases the relay cannot decide: an
//! endpoint that refused an event (4xx, 410; quarantined, its aggregate held until an operator
//! releases it) and a receiver that lost what it had acknowledged.
//!
//! A resend is not a publish: the event has its primary receipt already, and the resend's 2xx
//! goes through the one acceptance point as a **duplicate receipt** (relay generation 0: no
//! relay sent it; the attempt numbered after every earlier receipt of the event; the evidence
//! says who asked). The request carries the event's own id as `webhook-id` and idempotency key,
//! so a receiver that still has the event deduplicates it; the timestamp and signature are
//! fresh, as for any retry.

use std::collections::BTreeMap;

use anyhow::Context;
use outbox_core::records::{LedgerItem, ReceiptRecord};
use outbox_core::OutboxEvent;
use outbox_sink::http::Exchange;
use outbox_sink::HttpSink;
use serde::Serialize;

use crate::cli::ResendArgs;
use crate::connect;

/// One line of `webhooks list`.
#[derive(Debug, Serialize)]
pub struct Delivery {
    pub endpoint: String,
    /// `refused` (quarantined), `held` (an aggregate waiting behind a refused event), or
    /// `in_doubt` (an unclear answer the relay keeps asking about).
    pub state: &'static str,
    pub event_id: Option<uuid::Uuid>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<i64>,
    /// Events waiting behind a held aggregate's blocking event.
    pub waiting: Option<i64>,
    pub since: String,
    pub reason: String,
}

const LIST_SQL: &str = r#"
SELECT e.dest_cluster, 'refused', q.event_id, q.aggregate_type, q.aggregate_id,
       q.aggregate_version, NULL::int8, q.quarantined_at, q.reason
FROM outbox.quarantine q
JOIN outbox.events_current e ON e.event_id = q.event_id
WHERE q.released_at IS NULL AND e.dest_kind = 'http'
UNION ALL
SELECT e.dest_cluster, 'held', h.blocking_event_id, h.aggregate_type, h.aggregate_id,
       h.blocking_version,
       (SELECT count(*) FROM outbox.held_events he
        WHERE he.aggregate_type = h.aggregate_type AND he.aggregate_id = h.aggregate_id
          AND he.released_at IS NULL),
       h.held_at, h.reason
FROM outbox.holds h
JOIN outbox.events_current e ON e.event_id = h.blocking_event_id
WHERE e.dest_kind = 'http'
UNION ALL
SELECT e.dest_cluster, 'in_doubt', a.event_id, e.aggregate_type, e.aggregate_id,
       e.aggregate_version, NULL::int8, min(a.unknown_at),
       count(*) || ' unclear answer(s), the last: ' || (array_agg(a.error ORDER BY a.id DESC))[1]
FROM outbox.attempts a
JOIN outbox.events_current e ON e.event_id = a.event_id
WHERE a.state = 'DISPATCH_UNKNOWN' AND e.dest_kind = 'http'
  AND NOT EXISTS (SELECT 1 FROM outbox.receipt_of(a.event_id))
GROUP BY e.dest_cluster, a.event_id, e.aggregate_type, e.aggregate_id, e.aggregate_version
"#;

/// `outboxd webhooks list`.
pub async fn list(url: &str, endpoint: Option<&str>, json: bool) -> anyhow::Result<()> {
    let client = connect(url).await?;
    let rows = client
        .query(
            &format!(
                "SELECT endpoint, state, event_id, aggregate_type, aggregate_id, aggregate_version,
                        waiting, to_char(since AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                        reason
                 FROM ({LIST_SQL}) d(endpoint, state, event_id, aggregate_type, aggregate_id,
                                              aggregate_version, waiting, since, reason)
                 WHERE $1::text IS NULL OR d.endpoint = $1
                 ORDER BY d.endpoint, d.since"
            ),
            &[&endpoint],
        )
        .await
        .context("reading quarantine, holds and attempts of HTTP endpoints")?;
    let list: Vec<Delivery> = rows
        .iter()
        .map(|r| Delivery {
            endpoint: r.get(0),
            state: match r.get::<_, &str>(1) {
                "refused" => "refused",
                "held" => "held",
                _ => "in_doubt",
            },
            event_id: r.get(2),
            aggregate_type: r.get(3),
            aggregate_id: r.get(4),
            aggregate_version: r.get(5),
            waiting: r.get(6),
            since: r.get(7),
            reason: r.get(8),
        })
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    if list.is_empty() {
        println!(
            "nothing refused, held or in doubt at {}",
            endpoint.map_or("any HTTP endpoint".to_string(), |e| format!("endpoint {e}"))
        );
        return Ok(());
    }
    let mut per: BTreeMap<&str, Vec<&Delivery>> = BTreeMap::new();
    for d in &list {
        per.entry(d.endpoint.as_str()).or_default().push(d);
    }
    for (endpoint, ds) in per {
        let n = |s: &str| ds.iter().filter(|d| d.state == s).count();
        println!(
            "endpoint {endpoint}: {} refused, {} held, {} in doubt",
            n("refused"),
            n("held"),
            n("in_doubt")
        );
        for d in ds {
            let id = d.event_id.map(|i| i.to_string()).unwrap_or_default();
            let agg = format!(
                "{}/{}@{}",
                d.aggregate_type.as_deref().unwrap_or("?"),
                d.aggregate_id.as_deref().unwrap_or("?"),
                d.aggregate_version.map_or("?".into(), |v| v.to_string())
            );
            let waiting = d
                .waiting
                .map(|w| format!(" ({w} waiting behind it)"))
                .unwrap_or_default();
            println!(
                "  {:<8} {id} {agg} since {}{waiting}: {}",
                d.state, d.since, d.reason
            );
        }
    }
    println!(
        "refused: fix the endpoint or the event, then `outboxd quarantine release --event ID` (it sends the event and what waits behind it); in doubt: nothing to do, the relay asks again on its schedule"
    );
    Ok(())
}

/// `outboxd webhooks resend`.
pub async fn resend(a: ResendArgs) -> anyhow::Result<()> {
    let path = a.db.config.as_ref().with_context(|| {
        "webhooks resend needs --config (or OUTBOXD_CONFIG): the endpoint's secrets and headers are read from it"
    })?;
    let file = crate::config::FileConfig::load(path)?;
    let endpoints = crate::http_endpoints(&crate::HttpFlags::default(), &file.http)
        .with_context(|| format!("the [http] settings of {}", path.display()))?;
    let names: Vec<&str> = endpoints.iter().map(|e| e.endpoint.as_str()).collect();
    let Some(cfg) = endpoints.iter().find(|e| e.endpoint == a.endpoint).cloned() else {
        anyhow::bail!(
            "{} configures no endpoint {:?} (it has: {}); name one of them with --endpoint",
            path.display(),
            a.endpoint,
            names.join(", ")
        );
    };
    crate::config::validate_http(&cfg)?;
    let by = crate::operator::operator_name(a.by.clone());
    let mut client = connect(&a.db.url()?).await?;
    let cols = outbox_source::snapshot::text_columns();
    let rows = client
        .query(
            &format!(
                "SELECT {cols} FROM outbox.events_current e
                 JOIN outbox.receipts r ON r.event_id = e.event_id
                 WHERE e.dest_kind = 'http' AND e.dest_cluster = $1
                   AND (r.broker_timestamp >= $2::text::timestamptz OR e.event_id = ANY($3))
                 ORDER BY e.aggregate_type, e.aggregate_id, e.aggregate_version"
            ),
            &[&a.endpoint, &a.since, &a.event],
        )
        .await
        .context("reading the events the endpoint acknowledged")?;
    let events = rows
        .iter()
        .map(outbox_source::snapshot::event_from_row)
        .collect::<Result<Vec<OutboxEvent>, _>>()
        .context("reading a frozen outbox row")?;
    for id in &a.event {
        if !events.iter().any(|e| e.event_id == *id) {
            anyhow::bail!(
                "event {id} has no receipt from endpoint {:?}: nothing to resend (an event the endpoint has not acknowledged is the relay's: see `outboxd webhooks list` and `outboxd status --event {id}`)",
                a.endpoint
            );
        }
    }
    if a.dry_run || events.is_empty() {
        for ev in &events {
            println!(
                "would resend {} {}/{}@{} to {}",
                ev.event_id,
                ev.aggregate_type,
                ev.aggregate_id,
                ev.aggregate_version,
                ev.destination.topic
            );
        }
        println!(
            "{} event(s) of endpoint {} match; {}",
            events.len(),
            a.endpoint,
            if a.dry_run {
                "nothing sent (--dry-run)"
            } else {
                "nothing to send"
            }
        );
        return Ok(());
    }
    // Delivery reports are for the relay's pipeline; the command reads each exchange itself.
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let sink = HttpSink::new(cfg, tx)?;
    let slot = file.slot.clone().unwrap_or_else(|| "resend".into());
    let (mut sent, mut failed, mut skipped) = (0u64, Vec::new(), 0u64);
    let mut failed_aggregate: Option<(String, String)> = None;
    for ev in &events {
        let agg = (ev.aggregate_type.clone(), ev.aggregate_id.clone());
        if failed_aggregate.as_ref() == Some(&agg) {
            // Order per aggregate: nothing after a version that did not go through.
            skipped += 1;
            continue;
        }
        match sink.exchange(ev).await {
            Exchange::Receipt(r) => {
                let attempt: i32 = client
                    .query_one(
                        "SELECT coalesce(max(attempt), 0) + 1 FROM (
                             SELECT attempt FROM outbox.receipt_of($1)
                             UNION ALL
                             SELECT attempt FROM outbox.duplicate_receipts WHERE event_id = $1) a",
                        &[&ev.event_id],
                    )
                    .await?
                    .get(0);
                let mut evidence: serde_json::Value = serde_json::from_str(&r.evidence())?;
                evidence["resent_by"] = by.clone().into();
                let item = LedgerItem::Receipt(ReceiptRecord {
                    event_id: ev.event_id,
                    aggregate_version: ev.aggregate_version,
                    payload_digest: ev.payload_digest.clone(),
                    destination_digest: ev.destination_digest.clone(),
                    broker_kind: "http".into(),
                    broker_cluster: ev.destination.cluster.clone(),
                    topic: ev.destination.topic.clone(),
                    partition: 0,
                    offset: 0,
                    timestamp_ms: outbox_sink::http::answered_at_ms(),
                    attempt,
                    relay_generation: 0,
                    commit_lsn: None,
                    change_lsn: None,
                    evidence: Some(evidence.to_string()),
                });
                let out =
                    outbox_ledger::accept::accept_batch(&mut client, &slot, &[item], None, None)
                        .await
                        .with_context(|| {
                            format!("recording the resend of event {}", ev.event_id)
                        })?;
                if out.duplicates != 1 {
                    anyhow::bail!(
                        "the endpoint answered {} to the resend of event {}, but the ledger did not record it as a duplicate receipt ({out:?})",
                        r.status,
                        ev.event_id
                    );
                }
                sent += 1;
                println!(
                    "resent {} {}/{}@{}: {}",
                    ev.event_id, ev.aggregate_type, ev.aggregate_id, ev.aggregate_version, r.status
                );
            }
            Exchange::Refused { status, body } => {
                failed.push(format!("{}: refused with {status}: {body}", ev.event_id));
                failed_aggregate = Some(agg);
            }
            Exchange::NotPersisted(why) | Exchange::Unknown(why) => {
                failed.push(format!("{}: {why}", ev.event_id));
                failed_aggregate = Some(agg);
            }
        }
    }
    println!(
        "endpoint {}: {sent} of {} event(s) resent and recorded as duplicate receipts",
        a.endpoint,
        events.len()
    );
    if !failed.is_empty() {
        anyhow::bail!(
            "{} event(s) not taken by endpoint {} ({skipped} later version(s) of their aggregates not sent, to keep order); run the command again for them once the endpoint answers:\n  {}",
            failed.len(),
            a.endpoint,
            failed.join("\n  ")
        );
    }
    Ok(())
}
