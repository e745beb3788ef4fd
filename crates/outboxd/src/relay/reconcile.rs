//! Reconciling DISPATCH_UNKNOWN attempts, at start, before anything is streamed.
//!
//! An attempt whose delivery report said "possibly persisted" ended the previous run (or
//! process). Its producer session is gone now, so nothing more of it can reach the broker after
//! a short settle time. The sink then looks the attempt up ([`Sink::lookup`]) from a lower bound
//! (the highest position of that topic/partition accepted before the attempt was sent, minus a
//! clock margin): Kafka scans the frozen partition for header `id` = the event id; JetStream
//! re-publishes with the same `Nats-Msg-Id` inside the stream's duplicate window, or reads the
//! stream by subject outside it. The outcome is one of:
//!
//! * found — the broker has it: that position becomes the primary receipt (attempt generation
//!   of the attempt that sent it), and the replay will not send it again;
//! * absent over the whole range — the next send is a retry with attempt generation + 1, to the
//!   same frozen destination (the relay never re-resolves a destination);
//! * stored by the probe (JetStream only) — the broker's duplicate detection proved the
//!   original absent by storing the re-publish: that is the retry (generation + 1), recorded
//!   with its receipt; nothing is sent again.
//!
//! The checkpoint cannot pass the event meanwhile: it is unresolved until one of these.
//! The decisions — which attempt to look up when, what a look-up proves, what the pipeline
//! remembers — are `outbox_relay::unknown` and `PipelineCore::unknown_resolved`, which the
//! simulator runs too; this module does the I/O around them.
//!
//! While running, the relay also reconciles, at every release poll, the settled UNKNOWN
//! attempts that *another* generation recorded after this run started: a paused relay (a
//! zombie) that resumes salvages its delivery reports and may record one then. Reconciling
//! only at start left such an attempt open until the next restart (found by `outbox-sim`).

use std::time::{Duration, Instant};

use outbox_core::receipt::Scan;
use outbox_ledger::{accept, attempts, LedgerError, LedgerItem, ReceiptRecord};
use outbox_sink::{Lookup, Sink, UnknownLookup};
use tokio_postgres::Client;

use super::pipeline::Pipeline;
use super::RelayError;
use crate::config::RelayConfig;
use outbox_ledger::lease::Fence;

pub(crate) use outbox_relay::unknown::When;
use outbox_relay::unknown::{self, Resolved, Step};

pub(crate) async fn reconcile_unknown(
    cfg: &RelayConfig,
    sql: &Client,
    pipeline: &mut Pipeline,
    fence: &Fence,
    qualified_table: &str,
    when: When,
) -> Result<(), RelayError> {
    let open = attempts::open_unknown(sql, &cfg.slot).await?;
    for a in open {
        let unknown_for = Duration::from_secs_f64(a.unknown_for_s.max(0.0));
        match unknown::step(
            when,
            fence.generation,
            a.relay_generation,
            unknown_for,
            cfg.unknown_settle,
        ) {
            Step::Skip => continue,
            Step::WaitThenLookup(wait) if !wait.is_zero() => tokio::time::sleep(wait).await,
            Step::WaitThenLookup(_) => {}
        }
        let started = Instant::now();
        let rows = sql
            .query(
                &outbox_source::snapshot::rows_by_id_sql(qualified_table),
                &[&vec![a.event_id]],
            )
            .await
            .map_err(|e| LedgerError::Db {
                context: format!("loading event {} for reconciliation", a.event_id),
                source: e,
            })?;
        let Some(row) = rows.first() else {
            return Err(RelayError::Internal(format!(
                "DISPATCH_UNKNOWN event {} has no outbox row",
                a.event_id
            )));
        };
        let ev = outbox_source::snapshot::event_from_row(row)
            .map_err(|e| RelayError::Internal(e.to_string()))?;
        // When it was sent, by the database clock (what the broker's duplicate window counts
        // from, give or take clock skew, which the sink's margin covers).
        let sent_ago: f64 = sql
            .query_one(
                "SELECT extract(epoch FROM clock_timestamp() - sent_at)::float8 FROM outbox.attempts WHERE id = $1",
                &[&a.id],
            )
            .await
            .map_err(|e| LedgerError::Db {
                context: format!("reading attempt {}", a.id),
                source: e,
            })?
            .get(0);
        let lookup = pipeline
            .sink()
            .lookup(UnknownLookup {
                event: &ev,
                topic: &a.topic,
                partition: a.partition,
                from: a.scan_from + 1,
                sent_ago: Duration::from_secs_f64(sent_ago.max(0.0)),
            })
            .await;
        let lookup = match lookup {
            Ok(l) => l,
            Err(e) if when == When::Running => {
                tracing::warn!(event_id = %a.event_id, topic = %a.topic, partition = a.partition, error = %e,
                    "DISPATCH_UNKNOWN look-up failed; retrying at the next poll");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let unknown_ms = (a.unknown_for_s * 1000.0) as u64 + started.elapsed().as_millis() as u64;
        let served = pipeline.served().clone();
        let receipt_of = |attempt: i32,
                          relay_generation: i64,
                          offset: i64,
                          timestamp_ms,
                          evidence: Option<String>| {
            LedgerItem::Receipt(ReceiptRecord {
                event_id: ev.event_id,
                payload_digest: ev.payload_digest.clone(),
                destination_digest: ev.destination_digest.clone(),
                broker_kind: served.kind.into(),
                broker_cluster: served.cluster.clone(),
                topic: a.topic.clone(),
                partition: a.partition,
                offset,
                timestamp_ms,
                attempt,
                relay_generation,
                commit_lsn: None,
                evidence,
            })
        };
        // What the broker proved, for the rule in outbox_core::receipt::resolve_unknown. A
        // JetStream probe that was *stored* proves the original absent and is itself the retry.
        let (proof, (scanned_from, scanned_to), timestamp_ms, probe_offset, evidence) = match lookup
        {
            Lookup::Found {
                offset,
                timestamp_ms,
                scanned_from,
                scanned_to,
                ..
            } => (
                Scan::Found { offset },
                (scanned_from, scanned_to),
                timestamp_ms,
                None,
                None,
            ),
            Lookup::Absent {
                scanned_from,
                scanned_to,
            } => (Scan::Absent, (scanned_from, scanned_to), None, None, None),
            Lookup::StoredByProbe {
                offset,
                timestamp_ms,
                evidence,
                ..
            } => (
                Scan::Absent,
                (offset, offset),
                timestamp_ms,
                Some(offset),
                evidence,
            ),
        };
        let last = attempts::last_generation(sql, a.event_id).await?;
        // Settled: the settle time has passed (slept out at start, filtered while running).
        let resolved = unknown::resolve(a.attempt_generation, last, proof, probe_offset);
        match resolved {
            Resolved::StillUnknown => continue,
            Resolved::Found {
                offset,
                attempt_generation,
            } => {
                accept::accept_batch(
                    &mut pipeline.client,
                    &cfg.slot,
                    &[receipt_of(
                        attempt_generation,
                        a.relay_generation,
                        offset,
                        timestamp_ms,
                        None,
                    )],
                    None,
                    Some(fence),
                )
                .await?;
                attempts::resolve(sql, a.id, Some(offset), scanned_from, scanned_to).await?;
                tracing::info!(event_id = %a.event_id, topic = %a.topic, partition = a.partition, offset,
                    unknown_to_resolved_ms = unknown_ms, "DISPATCH_UNKNOWN resolved: found on the broker, no resend");
            }
            Resolved::StoredByProbe {
                offset,
                attempt_generation: next,
            } => {
                attempts::resolve(sql, a.id, None, scanned_from, scanned_to).await?;
                // The broker's duplicate detection said it had no copy of this Nats-Msg-Id:
                // the probe (the retry) is the one copy; record its receipt.
                accept::accept_batch(
                    &mut pipeline.client,
                    &cfg.slot,
                    &[receipt_of(
                        next,
                        fence.generation,
                        offset,
                        timestamp_ms,
                        evidence,
                    )],
                    None,
                    Some(fence),
                )
                .await?;
                tracing::info!(event_id = %a.event_id, topic = %a.topic, offset, attempt = next,
                    unknown_to_resolved_ms = unknown_ms, "DISPATCH_UNKNOWN resolved: absent (broker dedup), the Msg-Id re-publish is the retry");
            }
            Resolved::Retry {
                attempt_generation: next,
            } => {
                attempts::resolve(sql, a.id, None, scanned_from, scanned_to).await?;
                tracing::info!(event_id = %a.event_id, topic = %a.topic, partition = a.partition,
                    scanned_from, scanned_to, next_attempt = next,
                    unknown_to_resolved_ms = unknown_ms, "DISPATCH_UNKNOWN resolved: absent, retrying to the same destination");
            }
        }
        pipeline.core.unknown_resolved(a.event_id, &resolved);
    }
    Ok(())
}
