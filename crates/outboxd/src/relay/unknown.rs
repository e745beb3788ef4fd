//! Reconciling DISPATCH_UNKNOWN attempts: at start (handed to the run), and while running.
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
//! * stored by the probe (JetStream; an HTTP endpoint's answer to the retry with the same
//!   key) — the broker's duplicate detection proved the original absent by storing the
//!   re-publish: that is the retry (generation + 1), recorded with its receipt; nothing is
//!   sent again.
//!
//! Where the look-up is itself a re-send under the event's key (HTTP; JetStream inside the
//! duplicate window: `Sink::lookup_resends`), its answer is the answer for every attempt of
//! the event whose look-up would be the same re-send: those are closed with it
//! ([`Pipeline::close_answered`]), never sent again after a clear answer. For the same reason an open
//! attempt of another generation whose event already has its receipt is closed, while running,
//! as found at that receipt (`Reconcile::ClosedByReceipt`): the receipt is the destination's
//! answer under the key, and looking it up would send a published event again and hold the
//! relay's loop on the endpoint meanwhile.
//!
//! The checkpoint cannot pass the event meanwhile: it is unresolved until one of these.
//! The decisions — which attempt to look up when (`PipelineCore::reconcile`), what a look-up
//! proves, what the pipeline remembers — are `outbox_relay::unknown` and
//! `PipelineCore::unknown_resolved`, which the simulator runs too; this module does the I/O
//! around them.
//!
//! While running, an attempt of this run is resolved without ending it: its event is parked
//! (`outbox_relay::pipeline::unclear`) and the same look-up and the same recording
//! ([`Pipeline::record_lookup`]) run when the core says it is due (`Pipeline::on_lookup`). Every attempt
//! open at start is handed to that machinery too, with its settle time as its due time: the
//! replay parks its event instead of sending it, and its look-up runs beside everything else,
//! so a restart after many unclear sends neither waits for them one by one nor stops on one
//! that proves nothing.
//!
//! While running, the relay also reconciles, at every release poll, the settled UNKNOWN
//! attempts that *another* generation recorded after this run started: a paused relay (a
//! zombie) that resumes salvages its delivery reports and may record one then. Reconciling
//! only at start left such an attempt open until the next restart (found by `outbox-sim`).
//! Its look-up runs on a task of its own, like a parked event's (`Pipeline::on_lookup`
//! records it): a partition scan or an endpoint that answers late holds that event only, not
//! the loop (e2e `http::a_slow_look_up_of_a_late_attempt_holds_its_event_only_never_the_relay`).

use std::time::Instant;

use outbox_core::receipt::Scan;
use outbox_core::OutboxEvent;
use outbox_ledger::{accept, attempts, LedgerItem, ReceiptRecord};
use outbox_sink::{Lookup, Sink};
use outbox_source::snapshot::{events_by_id, Numbering};
use tokio_postgres::Client;

use super::pipeline::{sent_ago, unknown_for, Pipeline};
use super::RelayError;
use crate::config::RelayConfig;
use outbox_ledger::lease::Fence;

pub(crate) use outbox_relay::unknown::When;
use outbox_relay::unknown::{self, Reconcile, Resolved, Write};

impl Pipeline {
    /// Every open DISPATCH_UNKNOWN attempt of the slot, as the core decides `when` (at a run's
    /// start, or at a release poll while it runs): skipped, handed to the run, closed by the
    /// event's receipt, or looked up on a task of its own.
    pub(crate) async fn reconcile_unknown(
        &mut self,
        cfg: &RelayConfig,
        sql: &Client,
        fence: &Fence,
        qualified_table: &str,
        when: When,
    ) -> Result<(), RelayError> {
        let open = attempts::open_unknown(sql, &cfg.slot).await?;
        for a in open {
            // What to do with it now is the core's: at start nothing is looked up in line (the
            // replay parks the event when it reaches it, and the look-up runs beside everything
            // else: a restart with many open attempts does not wait for them one by one).
            let open = unknown::Open {
                event_id: a.event_id,
                relay_generation: a.relay_generation,
                unknown_for: unknown_for(&a),
                has_receipt: a.has_receipt,
                lookup_resends: self.sink().lookup_resends(sent_ago(&a)),
            };
            let now = std::time::SystemTime::now();
            match self.core.reconcile(when, fence.generation, &open, now) {
                Reconcile::Skip | Reconcile::HandedToRun => {}
                Reconcile::ClosedByReceipt => {
                    if let Some(offset) = attempts::resolve_by_receipt(&self.client, a.id).await? {
                        tracing::info!(event_id = %a.event_id, relay_generation = a.relay_generation,
                        offset, "DISPATCH_UNKNOWN resolved by the event's receipt (the destination's answer under its key): not sent again");
                        self.core
                            .closed_by_receipt(a.event_id, a.attempt_generation, offset);
                    }
                }
                // On a task of its own, as a parked event's: a broker scan or an endpoint that
                // takes its time holds this event only, never the relay's loop
                // (`Pipeline::on_lookup` records it and tells `PipelineCore::reconciled`).
                Reconcile::LookUp => match load(sql, qualified_table, &a).await? {
                    Some(ev) => self.start_reconcile_lookup(ev, a),
                    None => {
                        tracing::info!(event_id = %a.event_id, relay_generation = a.relay_generation,
                        "DISPATCH_UNKNOWN of a row written without a version or route: looked up when a run's replay brings the event, numbered; it stays open until then");
                        self.core.reconcile_deferred(a.event_id);
                    }
                },
            }
        }
        Ok(())
    }
}

/// Attempt `a`'s event as the relay must publish it now; `None` for a row written without a
/// version (docs/versions_by_relay.md) whose attempt kept no numbering: only the stream
/// numbers and routes it (`PipelineCore::reconcile_deferred`).
async fn load(
    sql: &Client,
    qualified_table: &str,
    a: &attempts::UnknownAttempt,
) -> Result<Option<OutboxEvent>, RelayError> {
    // Written without a version: the version and route the relay gave it when it sent the
    // attempt, as the attempt kept them.
    let numbering = match a.by_relay {
        Some((version, route)) => Numbering::ByRelay { version, route },
        None => Numbering::Row,
    };
    let read = events_by_id(sql, qualified_table, &[(a.event_id, numbering)]).await?;
    match read.into_iter().next() {
        Some((_, ev)) => Ok(ev),
        None => Err(RelayError::Internal(format!(
            "DISPATCH_UNKNOWN event {} has no outbox row",
            a.event_id
        ))),
    }
}

/// After a look-up of one of `ev`'s attempts that re-sent it under its key (`resent`) was
/// answered as `lookup` (`resolved` by the rule), closes every other open attempt of `ev`
/// whose own look-up would be the same re-send, with the same answer, instead of sending the
/// event again (`outbox_relay::unknown::answered_already`; a second send after a clear
/// answer is what an endpoint's idempotency key store would have to absorb). Returns how many.
impl Pipeline {
    pub(crate) async fn close_answered(
        &self,
        slot: &str,
        ev: &OutboxEvent,
        resent: bool,
        lookup: &Lookup,
        resolved: &Resolved,
    ) -> Result<usize, RelayError> {
        if !unknown::answered_already(resent, resolved, true) {
            return Ok(0);
        }
        let found_offset = unknown::settled_at(resolved);
        let (scanned_from, scanned_to) = match *lookup {
            Lookup::Found {
                scanned_from,
                scanned_to,
                ..
            }
            | Lookup::Absent {
                scanned_from,
                scanned_to,
            } => (scanned_from, scanned_to),
            Lookup::StoredByProbe { offset, .. } => (offset, offset),
        };
        let mut closed = 0;
        for other in attempts::all_open_unknown_of(&self.client, slot, ev.event_id).await? {
            if !unknown::answered_already(
                resent,
                resolved,
                self.sink().lookup_resends(sent_ago(&other)),
            ) {
                continue;
            }
            attempts::resolve(
                &self.client,
                other.id,
                found_offset,
                scanned_from,
                scanned_to,
            )
            .await?;
            tracing::info!(event_id = %ev.event_id, attempt = other.attempt_generation,
            relay_generation = other.relay_generation,
            "DISPATCH_UNKNOWN resolved by the answer to the same key: not sent again");
            closed += 1;
        }
        Ok(closed)
    }

    /// Records what a look-up of attempt `a` proved (the rule: `outbox_relay::unknown::resolve`):
    /// the copy's receipt and the attempt's resolution, committed before the caller tells the
    /// core. Returns the rule's verdict.
    pub(crate) async fn record_lookup(
        &mut self,
        slot: &str,
        fence: &Fence,
        a: &attempts::UnknownAttempt,
        ev: &OutboxEvent,
        lookup: Lookup,
        started: Instant,
    ) -> Result<Resolved, RelayError> {
        let unknown_ms = (a.unknown_for_s * 1000.0) as u64 + started.elapsed().as_millis() as u64;
        let kind = self.served().kind;
        // What the broker proved, for the rule in outbox_core::receipt::resolve_unknown. A
        // JetStream probe (or an HTTP retry with the same key) that was *stored* proves the
        // original absent or deduplicated, and is itself the retry.
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
        let last = attempts::last_generation(&self.client, a.event_id).await?;
        // Settled: the settle time has passed (slept out at start, filtered while running, and
        // counted by the core for an in-run look-up).
        let resolved = unknown::resolve(a.attempt_generation, last, proof, probe_offset);
        // What to write, and in which order, is the core's (`outbox_relay::unknown::record`).
        let record = unknown::record(resolved, a.relay_generation, fence.generation);
        let mut evidence = evidence;
        for write in record.writes() {
            let r = match write {
                Write::Resolve(found) => {
                    attempts::resolve(&self.client, a.id, found, scanned_from, scanned_to).await?;
                    continue;
                }
                Write::Receipt(r) => r,
            };
            let receipt = LedgerItem::Receipt(ReceiptRecord {
                event_id: ev.event_id,
                aggregate_version: ev.aggregate_version,
                payload_digest: ev.payload_digest.clone(),
                destination_digest: ev.destination_digest.clone(),
                broker_kind: kind.into(),
                broker_cluster: ev.destination.cluster.clone(),
                topic: a.topic.clone(),
                partition: a.partition,
                offset: r.offset,
                timestamp_ms,
                attempt: r.attempt_generation,
                relay_generation: r.relay_generation,
                commit_lsn: None,
                change_lsn: None,
                evidence: evidence.take(),
            });
            accept::accept_batch(&mut self.client, slot, &[receipt], None, Some(fence)).await?;
        }
        match resolved {
            Resolved::StillUnknown => {}
            Resolved::Found { offset, .. } => {
                tracing::info!(event_id = %a.event_id, topic = %a.topic, partition = a.partition, offset,
                unknown_to_resolved_ms = unknown_ms, "DISPATCH_UNKNOWN resolved: found on the broker, no resend");
            }
            Resolved::StoredByProbe {
                offset,
                attempt_generation: next,
            } => {
                tracing::info!(event_id = %a.event_id, topic = %a.topic, offset, attempt = next,
                unknown_to_resolved_ms = unknown_ms, "{}", stored_by_probe_words(kind));
            }
            Resolved::Retry {
                attempt_generation: next,
            } => {
                tracing::info!(event_id = %a.event_id, topic = %a.topic, partition = a.partition,
                scanned_from, scanned_to, next_attempt = next,
                unknown_to_resolved_ms = unknown_ms, "DISPATCH_UNKNOWN resolved: absent, retrying to the same destination");
            }
        }
        Ok(resolved)
    }
}

/// How a resolution by re-sending is told, in the sink's own terms.
fn stored_by_probe_words(kind: &str) -> &'static str {
    match kind {
        "http" => "DISPATCH_UNKNOWN resolved: the endpoint answered the retry with the same idempotency key; its answer is the receipt",
        "nats" => "DISPATCH_UNKNOWN resolved: absent (broker dedup), the Msg-Id re-publish is the retry",
        _ => "DISPATCH_UNKNOWN resolved: the re-publish is the retry",
    }
}
