//! The sink → ledger hand-off: events in flight, their delivery reports, and the batch of
//! ledger items waiting for the next acceptance transaction.
//!
//! An event leaves this module in exactly one of three ways, and only the first two resolve
//! it: an accepted receipt, a quarantine record, or a relay error (which drops all in-memory
//! state and replays from the checkpoint). There is no fourth way; in particular no timeout
//! marks anything as done.

use std::collections::HashMap;
use std::time::Instant;

use outbox_core::{AckTracker, EventToken, Lsn, OutboxEvent};
use outbox_ledger::{accept, AcceptOutcome, LedgerItem, QuarantineRecord, ReceiptRecord};
use outbox_sink::{Delivery, DeliveryOutcome, FailureClass, KafkaSink, SinkError};
use tokio_postgres::Client;
use uuid::Uuid;

use super::{Progress, RelayError};
use crate::failpoint;

struct InFlight {
    event_id: Uuid,
    payload_digest: String,
    destination_digest: String,
    aggregate_type: String,
    aggregate_id: String,
    aggregate_version: i64,
    commit_lsn: Option<Lsn>,
    ack: Option<EventToken>,
}

pub(crate) struct Dispatcher {
    pub sink: KafkaSink,
    next_token: u64,
    in_flight: HashMap<u64, InFlight>,
    batch: Vec<LedgerItem>,
    batch_acks: Vec<EventToken>,
    pub batch_started: Option<Instant>,
    relay_generation: i64,
    slot: String,
}

impl Dispatcher {
    pub fn new(sink: KafkaSink, slot: &str, relay_generation: i64) -> Self {
        Dispatcher {
            sink,
            next_token: 0,
            in_flight: HashMap::new(),
            batch: Vec::new(),
            batch_acks: Vec::new(),
            batch_started: None,
            relay_generation,
            slot: slot.to_string(),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    pub fn batch_len(&self) -> usize {
        self.batch.len()
    }

    fn push(&mut self, item: LedgerItem, ack: Option<EventToken>) {
        if self.batch.is_empty() {
            self.batch_started = Some(Instant::now());
        }
        self.batch.push(item);
        if let Some(a) = ack {
            self.batch_acks.push(a);
        }
    }

    /// Sends one verified event.
    pub async fn send(
        &mut self,
        ev: OutboxEvent,
        commit_lsn: Option<Lsn>,
        ack: Option<EventToken>,
    ) -> Result<(), RelayError> {
        failpoint::hit("before-send");
        let token = self.next_token;
        self.next_token += 1;
        match self.sink.send(&ev, token).await {
            Ok(()) => {
                self.in_flight.insert(
                    token,
                    InFlight {
                        event_id: ev.event_id,
                        payload_digest: ev.payload_digest,
                        destination_digest: ev.destination_digest,
                        aggregate_type: ev.aggregate_type,
                        aggregate_id: ev.aggregate_id,
                        aggregate_version: ev.aggregate_version,
                        commit_lsn,
                        ack,
                    },
                );
                Ok(())
            }
            Err(SinkError::Enqueue {
                class: FailureClass::Permanent,
                source,
                ..
            }) => {
                self.quarantine_event(
                    &ev,
                    "broker_rejected",
                    format!("the producer refused the message permanently: {source}"),
                    commit_lsn,
                    ack,
                );
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Records an event that must not be published, with its reason.
    pub fn quarantine_event(
        &mut self,
        ev: &OutboxEvent,
        code: &str,
        reason: String,
        commit_lsn: Option<Lsn>,
        ack: Option<EventToken>,
    ) {
        tracing::warn!(event_id = %ev.event_id, aggregate = %format!("{}/{}", ev.aggregate_type, ev.aggregate_id),
            version = ev.aggregate_version, code, %reason, "event quarantined");
        self.push(
            LedgerItem::Quarantine(QuarantineRecord {
                key: ev.event_id.to_string(),
                event_id: Some(ev.event_id),
                aggregate_type: Some(ev.aggregate_type.clone()),
                aggregate_id: Some(ev.aggregate_id.clone()),
                aggregate_version: Some(ev.aggregate_version),
                reason_code: code.to_string(),
                reason,
                commit_lsn: commit_lsn.unwrap_or(Lsn::ZERO),
            }),
            ack,
        );
    }

    /// Records a row that could not even be read as an envelope.
    pub fn quarantine_unreadable(
        &mut self,
        key: String,
        reason: String,
        commit_lsn: Lsn,
        ack: Option<EventToken>,
    ) {
        tracing::warn!(%key, %reason, lsn = %commit_lsn, "unreadable outbox row quarantined");
        self.push(
            LedgerItem::Quarantine(QuarantineRecord {
                key,
                event_id: None,
                aggregate_type: None,
                aggregate_id: None,
                aggregate_version: None,
                reason_code: "unreadable_row".into(),
                reason,
                commit_lsn,
            }),
            ack,
        );
    }

    /// Handles one delivery report.
    pub fn on_report(&mut self, d: Delivery) -> Result<(), RelayError> {
        let Some(f) = self.in_flight.remove(&d.token) else {
            return Err(RelayError::Internal(format!(
                "delivery report for unknown token {}",
                d.token
            )));
        };
        match d.outcome {
            DeliveryOutcome::Persisted {
                topic,
                partition,
                offset,
                timestamp_ms,
            } => {
                failpoint::hit("after-broker-ack");
                tracing::trace!(event_id = %f.event_id, %topic, partition, offset, "broker ack");
                self.push(
                    LedgerItem::Receipt(ReceiptRecord {
                        event_id: f.event_id,
                        payload_digest: f.payload_digest,
                        destination_digest: f.destination_digest,
                        broker_kind: "kafka".into(),
                        broker_cluster: self.sink.config().cluster_name.clone(),
                        topic,
                        partition,
                        offset,
                        timestamp_ms,
                        attempt: 1,
                        relay_generation: self.relay_generation,
                        commit_lsn: f.commit_lsn,
                    }),
                    f.ack,
                );
                Ok(())
            }
            DeliveryOutcome::Failed {
                error,
                class: FailureClass::Permanent,
                ..
            } => {
                tracing::warn!(event_id = %f.event_id, %error, "broker rejected event permanently; quarantined");
                self.push(
                    LedgerItem::Quarantine(QuarantineRecord {
                        key: f.event_id.to_string(),
                        event_id: Some(f.event_id),
                        aggregate_type: Some(f.aggregate_type),
                        aggregate_id: Some(f.aggregate_id),
                        aggregate_version: Some(f.aggregate_version),
                        reason_code: "broker_rejected".into(),
                        reason: format!("the broker rejected the message permanently: {error}"),
                        commit_lsn: f.commit_lsn.unwrap_or(Lsn::ZERO),
                    }),
                    f.ack,
                );
                Ok(())
            }
            DeliveryOutcome::Failed {
                error, persistence, ..
            } => Err(RelayError::Delivery {
                event_id: f.event_id,
                error,
                persistence: format!("{persistence:?}"),
            }),
        }
    }

    /// One acceptance transaction: the batch, plus the checkpoint the tracker allows after
    /// resolving it. `durable` is updated only after COMMIT.
    pub async fn flush(
        &mut self,
        client: &mut Client,
        tracker: Option<&mut AckTracker>,
        durable: &mut Lsn,
        progress: &Progress,
    ) -> Result<AcceptOutcome, RelayError> {
        let mut checkpoint = None;
        if let Some(t) = tracker {
            for a in self.batch_acks.drain(..) {
                t.resolve(a)?;
            }
            if t.watermark() > *durable {
                checkpoint = Some(t.watermark());
            }
        }
        if self.batch.is_empty() && checkpoint.is_none() {
            return Ok(AcceptOutcome::default());
        }
        let out = accept::accept_batch(client, &self.slot, &self.batch, checkpoint).await?;
        if out.primary + out.duplicates > 0 {
            failpoint::hit("after-accept");
        }
        self.batch.clear();
        self.batch_started = None;
        if let Some(c) = checkpoint {
            *durable = c;
            progress.set_checkpoint(c);
        }
        progress.record(&out);
        Ok(out)
    }
}
