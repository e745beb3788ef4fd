//! The middle of the relay: route → ordering gate → sink → delivery report → ledger batch.
//!
//! An event leaves this module in exactly one of these ways, and only the first three resolve
//! it (let the checkpoint pass it): an accepted receipt, a quarantine record, a held-event
//! record — or a relay error, which drops all in-memory state and replays from the slot.
//! Nothing times out into "done".
//!
//! Ordering: at most one event per aggregate is in flight ([`OrderingGate`]); the next one is
//! sent when the broker has reported on the previous. A quarantined event or a version gap
//! holds its aggregate durably; its later events are recorded as held, not sent, and are
//! republished in version order when an operator releases the hold.

use std::collections::HashMap;
use std::time::Instant;

use outbox_core::{AckTracker, Admit, EventToken, HoldReason, Lsn, OrderingGate, OutboxEvent};
use outbox_ledger::attempts;
use outbox_ledger::holds::{self, AggKey};
use outbox_ledger::lease::Fence;
use outbox_ledger::{
    accept, AcceptOutcome, HeldRecord, HoldRecord, LedgerItem, QuarantineRecord, ReceiptRecord,
};
use outbox_sink::{AnySink, Delivery, DeliveryOutcome, FailureClass, Persistence, Served, Sink};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_postgres::Client;
use uuid::Uuid;

use super::{route, Progress, RelayError};
use crate::failpoint;

/// An event waiting for, or in, its send.
pub(crate) struct Pending {
    pub ev: OutboxEvent,
    pub commit_lsn: Option<Lsn>,
    pub ack: Option<EventToken>,
}

struct InFlight {
    key: AggKey,
    topic: String,
    sent_at: std::time::SystemTime,
    attempt: i32,
    event_id: Uuid,
    aggregate_version: i64,
    payload_digest: String,
    destination_digest: String,
    commit_lsn: Option<Lsn>,
    ack: Option<EventToken>,
    /// Payload bytes, counted in [`Pipeline::in_flight_bytes`].
    bytes: usize,
}

/// Payload bytes sent and not yet reported on, beyond which the relay stops reading the slot
/// (with `max_in_flight`): librdkafka holds a copy of each, so large payloads would otherwise
/// grow the relay's memory with `max_in_flight` × payload size.
pub(crate) const MAX_IN_FLIGHT_BYTES: usize = 16 * 1024 * 1024;

fn key_of(ev: &OutboxEvent) -> AggKey {
    (ev.aggregate_type.clone(), ev.aggregate_id.clone())
}

pub(crate) struct Pipeline {
    sink: AnySink,
    /// What the sink serves (kind, cluster, partitioner): checked against every frozen
    /// destination, and written into every receipt.
    served: Served,
    pub reports: UnboundedReceiver<Delivery>,
    pub client: Client,
    pub tracker: AckTracker,
    gate: OrderingGate<AggKey, Pending>,
    next_token: u64,
    in_flight: HashMap<u64, InFlight>,
    batch: Vec<LedgerItem>,
    batch_acks: Vec<EventToken>,
    pub batch_started: Option<Instant>,
    fence: Fence,
    /// Our lease, kept by the lease keeper task. Without it, nothing is sent.
    lease: std::sync::Arc<super::LeaseState>,
    /// A send was refused because the lease deadline had passed.
    pub lease_expired: bool,
    /// The run is ending: record reports, send nothing.
    salvaging: bool,
    /// Events whose UNKNOWN attempt reconciliation found on the broker: never sent again.
    pub found: std::collections::HashSet<Uuid>,
    /// Events whose UNKNOWN attempt was proven absent: the next send's attempt generation.
    pub retry_generation: HashMap<Uuid, i32>,
    slot: String,
    /// The connection for pipelined acceptance ([`Self::flush_pipelined`]); `None` while its
    /// transaction runs (the connection is inside [`Self::accepting`]) or when not enabled.
    accept_client: Option<(Client, accept::Prepared)>,
    pub accepting: Option<Accepting>,
    in_flight_bytes: usize,
    /// Send -> delivery report times since the last acceptance (count, sum ms, max ms), for
    /// the acceptance debug line.
    report_ms: (u64, f64, f64),
}

/// An acceptance transaction running on its own task while the relay goes on reading the
/// slot, sending and collecting reports. At most one runs at a time, and no other acceptance
/// starts before it is settled, so acceptance transactions commit in the order they were
/// built: a checkpoint never commits before the receipts of an earlier batch.
pub(crate) struct Accepting {
    task: tokio::task::JoinHandle<AcceptDone>,
    checkpoint: Option<Lsn>,
    started: Instant,
}

/// Completes when the pipelined acceptance transaction in `a` has finished (never, if none
/// runs). Cancel-safe; takes the field, not the pipeline, so it can sit in a `select!` next
/// to `pipeline.reports`. Hand the result to [`Pipeline::finish_accept`].
pub(crate) async fn accept_finished(
    a: &mut Option<Accepting>,
) -> Result<AcceptDone, tokio::task::JoinError> {
    match a {
        Some(a) => (&mut a.task).await,
        None => std::future::pending().await,
    }
}

/// A batch taken for acceptance, with the checkpoint it justifies.
type TakenBatch = (Vec<LedgerItem>, Option<Lsn>);

pub(crate) type AcceptDone = (
    (Client, accept::Prepared),
    Vec<LedgerItem>,
    Result<AcceptOutcome, outbox_ledger::LedgerError>,
);

impl Pipeline {
    /// The ordering gate as the ledger left it: every aggregate's last accepted version, and
    /// the aggregates held durably.
    pub fn gate(heads: Vec<(AggKey, i64)>, held: Vec<AggKey>) -> OrderingGate<AggKey, Pending> {
        let mut gate = OrderingGate::new();
        for (k, v) in heads {
            gate.set_head(k, v, false);
        }
        for k in held {
            gate.set_head(k, 0, true);
        }
        gate
    }

    pub fn new(
        sink: AnySink,
        reports: UnboundedReceiver<Delivery>,
        client: Client,
        slot: &str,
        fence: Fence,
        lease: std::sync::Arc<super::LeaseState>,
        gate: OrderingGate<AggKey, Pending>,
    ) -> Self {
        Pipeline {
            served: sink.served(),
            sink,
            reports,
            client,
            tracker: AckTracker::new(Lsn::ZERO),
            gate,
            next_token: 0,
            in_flight: HashMap::new(),
            batch: Vec::new(),
            batch_acks: Vec::new(),
            batch_started: None,
            fence,
            lease,
            lease_expired: false,
            salvaging: false,
            found: Default::default(),
            retry_generation: HashMap::new(),
            slot: slot.to_string(),
            accept_client: None,
            accepting: None,
            report_ms: (0, 0.0, 0.0),
            in_flight_bytes: 0,
        }
    }

    /// The broker this relay publishes to (reconciliation asks it about UNKNOWN attempts).
    pub fn sink(&self) -> &AnySink {
        &self.sink
    }

    pub fn served(&self) -> &Served {
        &self.served
    }

    /// Gives the pipeline a second ledger connection, so that acceptance transactions run
    /// concurrently with streaming ([`Self::flush_pipelined`]).
    pub fn enable_pipelined_accept(&mut self, client: Client) {
        self.accept_client = Some((client, accept::Prepared::default()));
    }

    /// Sent, or waiting behind an aggregate's in-flight event.
    pub fn outstanding(&self) -> usize {
        self.in_flight.len() + self.gate.queued()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Payload bytes of the events sent and not yet reported on.
    pub fn in_flight_bytes(&self) -> usize {
        self.in_flight_bytes
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

    /// Every aggregate with an accepted event was loaded at start, and this relay is the only
    /// writer of heads for its events since; an aggregate the gate does not know has none.
    fn ensure_known(&mut self, key: &AggKey) {
        if !self.gate.is_known(key) {
            self.gate.set_head(key.clone(), 0, false);
        }
    }

    /// The route stage and the ordering gate for one decoded event.
    pub async fn admit(
        &mut self,
        ev: OutboxEvent,
        commit_lsn: Option<Lsn>,
        ack: Option<EventToken>,
    ) -> Result<(), RelayError> {
        let key = key_of(&ev);
        self.ensure_known(&key);
        if self.found.contains(&ev.event_id) {
            // Reconciliation proved the broker has it and recorded the receipt: no resend.
            self.gate.consume(&key, ev.aggregate_version);
            if let Some(a) = ack {
                self.tracker.resolve(a)?;
            }
            return Ok(());
        }
        // The route check runs at the head of the aggregate (in `send_tracked`), not here: an
        // event refused while an earlier one of its aggregate is still in flight would
        // otherwise open a hold naming itself, and if the earlier one is then rejected too,
        // nothing would ever republish that earlier one (found by `outbox-sim`).
        let version = ev.aggregate_version;
        match self.gate.offer(
            &key,
            version,
            Pending {
                ev,
                commit_lsn,
                ack,
            },
        ) {
            Admit::Send(p) => self.send(p).await,
            Admit::Queued => Ok(()),
            Admit::Held(p) => {
                self.record_held(p);
                Ok(())
            }
            Admit::Hold(p, HoldReason::Gap { expected, got }) => {
                let reason = format!(
                    "version gap in aggregate {}/{}: expected version {expected}, got {got} (event {}); the aggregate is held instead of publishing past the gap",
                    key.0, key.1, p.ev.event_id
                );
                tracing::error!(aggregate = %format!("{}/{}", key.0, key.1), expected, got, event_id = %p.ev.event_id, "version gap: aggregate held");
                self.push(
                    LedgerItem::Hold(HoldRecord {
                        aggregate_type: key.0.clone(),
                        aggregate_id: key.1.clone(),
                        reason_code: "version_gap".into(),
                        reason,
                        blocking_event_id: Some(p.ev.event_id),
                        blocking_version: Some(got),
                    }),
                    None,
                );
                self.record_held(p);
                Ok(())
            }
            Admit::NeedHead(_) => Err(RelayError::Internal(
                "ordering gate asked for a head it was given".into(),
            )),
        }
    }

    fn record_held(&mut self, p: Pending) {
        tracing::debug!(event_id = %p.ev.event_id, version = p.ev.aggregate_version, "event held");
        self.push(
            LedgerItem::Held(HeldRecord {
                event_id: p.ev.event_id,
                aggregate_type: p.ev.aggregate_type,
                aggregate_id: p.ev.aggregate_id,
                aggregate_version: p.ev.aggregate_version,
                commit_lsn: p.commit_lsn,
            }),
            p.ack,
        );
    }

    /// Quarantines `ev` with its reason and holds its aggregate; what waited behind it is held.
    fn poison(
        &mut self,
        ev: &OutboxEvent,
        code: &str,
        reason: String,
        commit_lsn: Option<Lsn>,
        ack: Option<EventToken>,
    ) {
        let blocking = (ev.event_id, ev.aggregate_version, commit_lsn, ack);
        self.poison_key(&key_of(ev), blocking, code, reason);
    }

    /// [`Self::poison`] for an event known by its key, id, version, commit LSN and ack token.
    fn poison_key(
        &mut self,
        key: &AggKey,
        (event_id, version, commit_lsn, ack): (Uuid, i64, Option<Lsn>, Option<EventToken>),
        code: &str,
        reason: String,
    ) {
        tracing::warn!(%event_id, aggregate = %format!("{}/{}", key.0, key.1),
            version, code, %reason, "event quarantined; aggregate held");
        self.push(
            LedgerItem::Quarantine(QuarantineRecord {
                key: event_id.to_string(),
                event_id: Some(event_id),
                aggregate_type: Some(key.0.clone()),
                aggregate_id: Some(key.1.clone()),
                aggregate_version: Some(version),
                reason_code: code.to_string(),
                reason: reason.clone(),
                commit_lsn: commit_lsn.unwrap_or(Lsn::ZERO),
            }),
            ack,
        );
        self.push(
            LedgerItem::Hold(HoldRecord {
                aggregate_type: key.0.clone(),
                aggregate_id: key.1.clone(),
                reason_code: code.to_string(),
                reason,
                blocking_event_id: Some(event_id),
                blocking_version: Some(version),
            }),
            None,
        );
        for p in self.gate.hold(key) {
            self.record_held(p);
        }
    }

    /// Records a row that could not even be read as an envelope (no aggregate to hold).
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

    /// Hands one event to the producer. Returns its token.
    async fn send(&mut self, p: Pending) -> Result<(), RelayError> {
        self.send_tracked(p).await.map(|_| ())
    }

    async fn send_tracked(&mut self, p: Pending) -> Result<Option<u64>, RelayError> {
        if self.salvaging || !self.lease.valid() {
            // A stale generation may not send. The event stays unresolved; the run ends.
            self.lease_expired = true;
            return Ok(None);
        }
        if let Err(r) = route::check(&p.ev, &self.served) {
            // Refused at the head of its aggregate: nothing of it is in flight, and what is
            // queued behind it is held.
            let key = key_of(&p.ev);
            self.poison(&p.ev, r.code, r.reason, p.commit_lsn, p.ack);
            self.gate.done(&key);
            return Ok(None);
        }
        failpoint::hit("before-send");
        let token = self.next_token;
        self.next_token += 1;
        match self.sink.send(&p.ev, token).await {
            Ok(()) => {
                let ev = p.ev;
                let bytes = ev.payload.len();
                self.in_flight_bytes += bytes;
                let attempt = self
                    .retry_generation
                    .get(&ev.event_id)
                    .copied()
                    .unwrap_or(1);
                tracing::trace!(event_id = %ev.event_id, attempt, "handed to the producer");
                self.in_flight.insert(
                    token,
                    InFlight {
                        key: key_of(&ev),
                        topic: ev.destination.topic.clone(),
                        sent_at: std::time::SystemTime::now(),
                        attempt,
                        event_id: ev.event_id,
                        aggregate_version: ev.aggregate_version,
                        payload_digest: ev.payload_digest,
                        destination_digest: ev.destination_digest,
                        commit_lsn: p.commit_lsn,
                        ack: p.ack,
                        bytes,
                    },
                );
                Ok(Some(token))
            }
            Err(e) => match e.permanent_refusal() {
                Some(why) => {
                    let key = key_of(&p.ev);
                    self.poison(
                        &p.ev,
                        "broker_rejected",
                        format!("the producer refused the message permanently: {why}"),
                        p.commit_lsn,
                        p.ack,
                    );
                    self.gate.done(&key);
                    Ok(None)
                }
                None => Err(e.into()),
            },
        }
    }

    /// Handles one delivery report; sends the aggregate's next event when there is one.
    pub async fn on_report(&mut self, d: Delivery) -> Result<(), RelayError> {
        let Some(f) = self.in_flight.remove(&d.token) else {
            return Err(RelayError::Internal(format!(
                "delivery report for unknown token {}",
                d.token
            )));
        };
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(f.bytes);
        match d.outcome {
            DeliveryOutcome::Persisted {
                topic,
                partition,
                offset,
                timestamp_ms,
                duplicate,
            } => {
                failpoint::hit("after-broker-ack");
                if let Ok(d) = f.sent_at.elapsed() {
                    let ms = d.as_secs_f64() * 1000.0;
                    let r = &mut self.report_ms;
                    *r = (r.0 + 1, r.1 + ms, r.2.max(ms));
                }
                // A broker-side duplicate (JetStream answered a repeated Nats-Msg-Id with the
                // original sequence) is the same copy, not a new one: the acceptance point
                // keeps it as a duplicate transport receipt when the event has its primary.
                tracing::trace!(event_id = %f.event_id, %topic, partition, offset, duplicate, "broker ack");
                self.push(
                    LedgerItem::Receipt(ReceiptRecord {
                        event_id: f.event_id,
                        payload_digest: f.payload_digest,
                        destination_digest: f.destination_digest,
                        broker_kind: self.served.kind.into(),
                        broker_cluster: self.served.cluster.clone(),
                        topic,
                        partition,
                        offset,
                        timestamp_ms,
                        attempt: f.attempt,
                        relay_generation: self.fence.generation,
                        commit_lsn: f.commit_lsn,
                    }),
                    f.ack,
                );
            }
            DeliveryOutcome::Failed {
                error,
                class: FailureClass::Permanent,
                ..
            } => {
                self.poison_key(
                    &f.key,
                    (f.event_id, f.aggregate_version, f.commit_lsn, f.ack),
                    "broker_rejected",
                    format!("the broker rejected the message permanently: {error}"),
                );
            }
            DeliveryOutcome::Failed {
                error,
                persistence,
                partition,
                ..
            } => {
                if persistence != Persistence::NotPersisted && partition >= 0 {
                    // The broker may have it. Record that before anything else happens to
                    // the event; the next start reconciles it by scanning the partition.
                    attempts::record_unknown(
                        &self.client,
                        &self.slot,
                        f.event_id,
                        self.fence.generation,
                        f.attempt,
                        &f.topic,
                        partition,
                        f.sent_at,
                        &error,
                    )
                    .await?;
                    tracing::warn!(event_id = %f.event_id, %error, topic = %f.topic, partition, "DISPATCH_UNKNOWN recorded");
                }
                return Err(RelayError::Delivery {
                    event_id: f.event_id,
                    error,
                    persistence: format!("{persistence:?}"),
                });
            }
        }
        if let Some(next) = self.gate.done(&f.key) {
            Box::pin(self.send(next)).await?;
        }
        Ok(())
    }

    /// Waits for one delivery report and handles it.
    pub async fn drain_one(&mut self) -> Result<u64, RelayError> {
        match self.reports.recv().await {
            Some(d) => {
                let token = d.token;
                self.on_report(d).await?;
                Ok(token)
            }
            None => Err(RelayError::Internal("delivery channel closed".into())),
        }
    }

    /// Resolves the batch's events (when `track`) and takes the batch with the checkpoint the
    /// tracker then allows; `None` when there is nothing to record.
    fn take_batch(&mut self, track: bool, durable: Lsn) -> Result<Option<TakenBatch>, RelayError> {
        let mut checkpoint = None;
        if track {
            for a in self.batch_acks.drain(..) {
                self.tracker.resolve(a)?;
            }
            if self.tracker.watermark() > durable {
                checkpoint = Some(self.tracker.watermark());
            }
        }
        if self.batch.is_empty() && checkpoint.is_none() {
            return Ok(None);
        }
        self.batch_started = None;
        Ok(Some((std::mem::take(&mut self.batch), checkpoint)))
    }

    /// After a committed acceptance transaction: failpoint, checkpoint, counters.
    fn accepted(
        &mut self,
        items: &[LedgerItem],
        out: &AcceptOutcome,
        checkpoint: Option<Lsn>,
        durable: &mut Lsn,
        progress: &Progress,
    ) {
        if out.primary + out.duplicates > 0 {
            failpoint::hit("after-accept");
        }
        // Before the checkpoint moves: that drops the commit times these receipts are matched to.
        crate::metrics::receipts_accepted(items);
        if let Some(c) = checkpoint {
            *durable = (*durable).max(c);
            progress.set_checkpoint(c);
        }
        progress.record(out);
    }

    /// One acceptance transaction: the batch, plus (when `track`) the checkpoint the tracker
    /// allows after resolving it. `durable` is updated only after COMMIT. A pipelined
    /// transaction still running is settled first.
    pub async fn flush(
        &mut self,
        track: bool,
        durable: &mut Lsn,
        progress: &Progress,
    ) -> Result<AcceptOutcome, RelayError> {
        self.settle(durable, progress).await?;
        let Some((items, checkpoint)) = self.take_batch(track, *durable)? else {
            return Ok(AcceptOutcome::default());
        };
        match accept::accept_batch(
            &mut self.client,
            &self.slot,
            &items,
            checkpoint,
            Some(&self.fence),
        )
        .await
        {
            Ok(out) => {
                self.accepted(&items, &out, checkpoint, durable, progress);
                Ok(out)
            }
            Err(e) => {
                self.keep_for_salvage(items, &e);
                Err(e.into())
            }
        }
    }

    /// Starts the acceptance transaction of the batch on its own task and returns at once;
    /// [`Self::settle`] collects it. Falls back to [`Self::flush`] without a second ledger
    /// connection. Does nothing while another pipelined transaction runs: the batch keeps
    /// growing meanwhile, so batches grow with the ledger's latency.
    pub async fn flush_pipelined(
        &mut self,
        durable: &mut Lsn,
        progress: &Progress,
    ) -> Result<(), RelayError> {
        if self.accepting.is_some() {
            return Ok(());
        }
        let Some((mut client, mut prepared)) = self.accept_client.take() else {
            return self.flush(true, durable, progress).await.map(|_| ());
        };
        let Some((items, checkpoint)) = self.take_batch(true, *durable)? else {
            self.accept_client = Some((client, prepared));
            return Ok(());
        };
        let (slot, fence) = (self.slot.clone(), self.fence.clone());
        let task = tokio::spawn(async move {
            let r = accept::accept_batch_prepared(
                &mut client,
                &mut prepared,
                &slot,
                &items,
                checkpoint,
                Some(&fence),
            )
            .await;
            ((client, prepared), items, r)
        });
        self.accepting = Some(Accepting {
            task,
            checkpoint,
            started: Instant::now(),
        });
        Ok(())
    }

    /// Waits for the pipelined acceptance transaction, if one runs, and applies its result
    /// (`durable` moves only after its COMMIT).
    pub async fn settle(
        &mut self,
        durable: &mut Lsn,
        progress: &Progress,
    ) -> Result<(), RelayError> {
        if self.accepting.is_none() {
            return Ok(());
        }
        let joined = accept_finished(&mut self.accepting).await;
        self.finish_accept(joined, durable, progress)
    }

    /// Applies the result of the pipelined acceptance transaction that
    /// [`accept_finished`] reported.
    pub fn finish_accept(
        &mut self,
        joined: Result<AcceptDone, tokio::task::JoinError>,
        durable: &mut Lsn,
        progress: &Progress,
    ) -> Result<(), RelayError> {
        let (checkpoint, started) = match self.accepting.take() {
            Some(a) => (a.checkpoint, Some(a.started)),
            None => (None, None),
        };
        let (client, items, result) =
            joined.map_err(|e| RelayError::Internal(format!("acceptance task: {e}")))?;
        tracing::debug!(
            items = items.len(),
            ms = started.map(|s| s.elapsed().as_secs_f64() * 1000.0),
            in_flight = self.in_flight.len(),
            report_avg_ms = self.report_ms.1 / self.report_ms.0.max(1) as f64,
            report_max_ms = self.report_ms.2,
            "acceptance transaction done"
        );
        self.report_ms = (0, 0.0, 0.0);
        self.accept_client = Some(client);
        match result {
            Ok(out) => {
                self.accepted(&items, &out, checkpoint, durable, progress);
                Ok(())
            }
            Err(e) => {
                let rest = std::mem::take(&mut self.batch);
                self.keep_for_salvage(items, &e);
                self.batch.extend(rest);
                Err(e.into())
            }
        }
    }

    /// After a failed acceptance transaction: the batch goes back in front of the pending
    /// items, for salvage (its receipts are still evidence worth recording) — unless the
    /// transaction *committed* and only the checkpoint was fenced (`LeaseLost`): then every
    /// item is recorded already, and recording it again would store each receipt a second
    /// time as a duplicate of itself.
    fn keep_for_salvage(&mut self, items: Vec<LedgerItem>, e: &outbox_ledger::LedgerError) {
        if matches!(e, outbox_ledger::LedgerError::LeaseLost { .. }) {
            return;
        }
        let rest = std::mem::replace(&mut self.batch, items);
        self.batch.extend(rest);
    }

    /// Republishes aggregates an operator released, in version order, one event at a time.
    /// Runs between stream messages; the stream waits meanwhile (releases are rare).
    pub async fn process_releases(
        &mut self,
        sql: &Client,
        qualified_table: &str,
        durable: &mut Lsn,
        progress: &Progress,
    ) -> Result<(), RelayError> {
        let releases = holds::releasing(&self.client).await?;
        for r in releases {
            if self.gate.in_flight(&r.key) {
                continue; // an earlier event of it is still at the broker; next round
            }
            // Held records of this aggregate may sit in the batch: make them durable first.
            self.flush(true, durable, progress).await?;
            let set = holds::republish_set(&self.client, &r).await?;
            let ids: Vec<Uuid> = set.iter().map(|(id, _, _)| *id).collect();
            let lsns: HashMap<Uuid, Option<Lsn>> = set.iter().map(|(id, _, l)| (*id, *l)).collect();
            let rows = sql
                .query(
                    &outbox_source::snapshot::rows_by_id_sql(qualified_table),
                    &[&ids],
                )
                .await
                .map_err(|e| outbox_ledger::LedgerError::Db {
                    context: "loading released events".into(),
                    source: e,
                })?;
            let mut last = if r.publish_blocking {
                None
            } else {
                r.blocking_version
            };
            let mut failed = false;
            tracing::info!(aggregate = %format!("{}/{}", r.key.0, r.key.1), events = rows.len(), "republishing a released aggregate");
            for row in &rows {
                let ev = match outbox_source::snapshot::event_from_row(row) {
                    Ok(ev) => ev,
                    Err(e) => {
                        return Err(RelayError::Internal(format!(
                            "released event unreadable: {e}"
                        )))
                    }
                };
                let version = ev.aggregate_version;
                let commit_lsn = lsns.get(&ev.event_id).copied().flatten();
                if let Err(refusal) = route::check(&ev, &self.served) {
                    self.poison(&ev, refusal.code, refusal.reason, commit_lsn, None);
                    failed = true;
                    break;
                }
                let Some(token) = self
                    .send_tracked(Pending {
                        ev,
                        commit_lsn,
                        ack: None,
                    })
                    .await?
                else {
                    failed = true;
                    break;
                };
                while self.drain_one().await? != token {}
                if self
                    .batch
                    .iter()
                    .any(|i| matches!(i, LedgerItem::Hold(h) if (h.aggregate_type.as_str(), h.aggregate_id.as_str()) == (r.key.0.as_str(), r.key.1.as_str())))
                {
                    failed = true; // poisoned again: the hold stays
                    break;
                }
                last = Some(version);
            }
            self.flush(true, durable, progress).await?;
            if !failed && holds::close(&self.client, &r.key, last).await? {
                let head = holds::head(&self.client, &r.key).await?;
                let next = last.unwrap_or(head).max(head) + 1;
                self.gate.release(&r.key, next);
                tracing::info!(aggregate = %format!("{}/{}", r.key.0, r.key.1), next_version = next, "hold released");
            }
        }
        Ok(())
    }
}

impl Pipeline {
    /// The run is ending (lease lost, stream broken): record what the broker already confirmed
    /// — receipts of requests this generation sent are valid evidence — without sending
    /// anything more and without moving the checkpoint. Waits at most `grace` for outstanding
    /// delivery reports. Returns the error that recording hit, if any.
    pub async fn salvage(
        &mut self,
        progress: &Progress,
        grace: std::time::Duration,
    ) -> Option<RelayError> {
        self.salvaging = true;
        let deadline = tokio::time::Instant::now() + grace;
        while !self.in_flight.is_empty() {
            match tokio::time::timeout_at(deadline, self.reports.recv()).await {
                Ok(Some(d)) => {
                    if let Err(e) = self.on_report(d).await {
                        return Some(e);
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        let mut unmoved = Lsn::ZERO;
        self.flush(false, &mut unmoved, progress).await.err()
    }
}
