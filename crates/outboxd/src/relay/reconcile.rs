//! Reconciling DISPATCH_UNKNOWN attempts, at start, before anything is streamed.
//!
//! An attempt whose delivery report said "possibly persisted" ended the previous run (or
//! process). Its producer session is gone now, so nothing more of it can reach the broker after
//! a short settle time. The frozen partition is then scanned from a lower bound (the highest
//! offset of that partition accepted before the attempt was sent, minus a clock margin) to the
//! high watermark, looking for header `id` = the event id:
//!
//! * found — the broker has it: that offset becomes the primary receipt (attempt generation of
//!   the attempt that sent it), and the replay will not send it again;
//! * absent over the whole range — the next send is a retry with attempt generation + 1, to the
//!   same frozen destination (the relay never re-resolves a destination).
//!
//! The checkpoint cannot pass the event meanwhile: it is unresolved until one of the two.
//! The rule itself is `outbox_core::receipt::resolve_unknown` (driven by the simulator).
//!
//! While running, the relay also reconciles, at every release poll, the settled UNKNOWN
//! attempts that *another* generation recorded after this run started: a paused relay (a
//! zombie) that resumes salvages its delivery reports and may record one then. Reconciling
//! only at start left such an attempt open until the next restart (found by `outbox-sim`).

use std::time::{Duration, Instant};

use outbox_core::receipt::{self, Scan, UnknownResolution};
use outbox_ledger::{accept, attempts, LedgerError, LedgerItem, ReceiptRecord};
use tokio_postgres::Client;

use super::pipeline::Pipeline;
use super::RelayError;
use crate::config::RelayConfig;
use outbox_ledger::lease::Fence;

/// Which open attempts to reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum When {
    /// At start, before streaming: every open attempt, sleeping out its settle time.
    Start,
    /// While running: settled attempts of other generations; a failed scan is retried at the
    /// next poll instead of ending the run.
    Running,
}

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
        let settle = cfg.unknown_settle.as_secs_f64() - a.unknown_for_s;
        if when == When::Running {
            if a.relay_generation == fence.generation || settle > 0.0 {
                continue;
            }
        } else if settle > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(settle)).await;
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
        let sink_cfg = cfg.sink.clone();
        let (topic, partition, from, id) = (
            a.topic.clone(),
            a.partition,
            a.scan_from + 1,
            a.event_id.to_string(),
        );
        let scan = tokio::task::spawn_blocking(move || {
            outbox_sink::scan_for_event(
                &sink_cfg,
                &topic,
                partition,
                from,
                &id,
                Duration::from_secs(30),
            )
        })
        .await
        .map_err(|e| RelayError::Internal(format!("scan task: {e}")))?;
        let scan = match scan {
            Ok(s) => s,
            Err(e) if when == When::Running => {
                tracing::warn!(event_id = %a.event_id, topic = %a.topic, partition = a.partition, error = %e,
                    "DISPATCH_UNKNOWN scan failed; retrying at the next poll");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let unknown_ms = (a.unknown_for_s * 1000.0) as u64 + started.elapsed().as_millis() as u64;
        let last = attempts::last_generation(sql, a.event_id).await?;
        let proof = match scan.found {
            Some((offset, _)) => Scan::Found { offset },
            None => Scan::Absent,
        };
        // Settled: the settle time has passed (slept out at start, filtered while running).
        match receipt::resolve_unknown(a.attempt_generation, last, true, proof) {
            UnknownResolution::StillUnknown => continue,
            UnknownResolution::Found {
                offset,
                attempt_generation,
            } => {
                let timestamp_ms = scan.found.and_then(|(_, ts)| ts);
                accept::accept_batch(
                    &mut pipeline.client,
                    &cfg.slot,
                    &[LedgerItem::Receipt(ReceiptRecord {
                        event_id: ev.event_id,
                        payload_digest: ev.payload_digest.clone(),
                        destination_digest: ev.destination_digest.clone(),
                        broker_kind: "kafka".into(),
                        broker_cluster: cfg.sink.cluster_name.clone(),
                        topic: a.topic.clone(),
                        partition: a.partition,
                        offset,
                        timestamp_ms,
                        attempt: attempt_generation,
                        relay_generation: a.relay_generation,
                        commit_lsn: None,
                    })],
                    None,
                    Some(fence),
                )
                .await?;
                attempts::resolve(sql, a.id, Some(offset), scan.scanned_from, scan.scanned_to)
                    .await?;
                pipeline.found.insert(a.event_id);
                tracing::info!(event_id = %a.event_id, topic = %a.topic, partition = a.partition, offset,
                    unknown_to_resolved_ms = unknown_ms, "DISPATCH_UNKNOWN resolved: found on the broker, no resend");
            }
            UnknownResolution::Retry {
                attempt_generation: next,
            } => {
                attempts::resolve(sql, a.id, None, scan.scanned_from, scan.scanned_to).await?;
                pipeline.retry_generation.insert(a.event_id, next);
                tracing::info!(event_id = %a.event_id, topic = %a.topic, partition = a.partition,
                    scanned_from = scan.scanned_from, scanned_to = scan.scanned_to, next_attempt = next,
                    unknown_to_resolved_ms = unknown_ms, "DISPATCH_UNKNOWN resolved: absent, retrying to the same destination");
            }
        }
    }
    Ok(())
}
