//! The middle of the relay: route → ordering gate → send → delivery report → ledger batch.
//!
//! An event leaves this state machine in exactly one of these ways, and only the first three
//! resolve it (let the checkpoint pass it): an accepted receipt, a quarantine record, a
//! held-event record — or a relay error, which drops all in-memory state and replays from the
//! slot. Nothing times out into "done".
//!
//! Ordering: at most one event per aggregate is in flight ([`OrderingGate`]); the next one is
//! sent when the broker has reported on the previous. A quarantined event or a version gap
//! holds its aggregate durably; its later events are recorded as held, not sent, and are
//! republished in version order when an operator releases the hold.
//!
//! The driver's side of the contract:
//! * every [`Command::Send`] is handed to the sink with its token, and a refusal is reported
//!   back with [`PipelineCore::send_refused`] (every token gets exactly one delivery report or
//!   one refusal);
//! * a [`Reported::Unclear`] holds only its aggregate: the driver records its
//!   [`UnknownAttempt`] (if any) and goes on; the core asks for the look-up or the resend when
//!   it is due ([`PipelineCore::due_unclear`], module `unclear`), and every other aggregate
//!   keeps flowing;
//! * a batch from [`PipelineCore::begin_acceptance`] is accepted in one transaction, in the
//!   order the batches were taken, and the core learns how it ended with
//!   [`PipelineCore::acceptance_ended`] (the checkpoint only once it committed; a batch
//!   whose transaction failed goes back in front for the run's salvage).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

use outbox_core::delivery::{Delivery, DeliveryOutcome, FailureClass, Persistence, Served};
use outbox_core::receipt;
use outbox_core::records::{HeldRecord, HoldRecord, LedgerItem, QuarantineRecord, ReceiptRecord};
use outbox_core::{
    AckTracker, Admit, EventToken, HoldReason, Lsn, OrderingGate, OutboxEvent, TxnSeq,
};
use uuid::Uuid;

pub(crate) use crate::contract::{agg_of_num_key, key_of, num_key, NumKey};
pub use crate::contract::{
    AggKey, Command, CoreError, DeliveryFailure, Now, Pending, Reported, UnknownAttempt,
    MAX_IN_FLIGHT_BYTES, MAX_WAITING_BYTES,
};
pub use crate::parked::{
    merge_lookups, LookupOutcome, Policy as UnclearPolicy, Schedule as UnclearSchedule,
    UnclearStep, UNANSWERED_AFTER,
};
pub use crate::plant::{CurrentRoute, Mutant, Plant, Planted, Shipped};
use crate::route;

#[derive(Debug)]
struct InFlight {
    key: AggKey,
    sent_at: SystemTime,
    attempt: i32,
    /// The event as sent, shared with the send's command (the driver drops its reference
    /// once the sink has taken the message, so a report finds it unshared): an unclear
    /// outcome parks it, and its look-up or resend needs it whole. Behind an `Arc`, an
    /// in-flight record is ~130 bytes instead of ~680: the in-flight table was 5 MiB of the
    /// relay's peak heap at 5,000 in flight (heaptrack, docs/benchmarks.md).
    ev: Arc<OutboxEvent>,
    commit_lsn: Option<Lsn>,
    change_lsn: Option<Lsn>,
    ack: Option<EventToken>,
    /// Payload bytes, counted in [`PipelineCore::in_flight_bytes`].
    bytes: usize,
}

/// A batch taken for acceptance, with the checkpoint it justifies.
pub type TakenBatch = (Vec<LedgerItem>, Option<Lsn>);

/// One acceptance transaction, as the core hands it to the driver
/// ([`PipelineCore::begin_acceptance`]) and takes it back with how it ended
/// ([`PipelineCore::acceptance_ended`]). The daemon runs it inline or on a task of its own
/// (pipelined, while the stream goes on), the simulator in one step or over two.
#[derive(Debug)]
pub struct Acceptance {
    /// The receipts, quarantines, holds and held records it records.
    pub items: Vec<LedgerItem>,
    /// The checkpoint it moves (the ack tracker's watermark once the batch is resolved).
    pub checkpoint: Option<Lsn>,
    /// What it keeps with the checkpoint for rows written without a version or route
    /// (`None`: nothing, the plain acceptance).
    pub numbered: Option<NumberedThrough>,
}

impl Acceptance {
    /// Whether the numbering log is to be folded after its commit.
    pub fn folds(&self) -> bool {
        self.numbered.as_ref().is_some_and(|n| n.fold)
    }
}

/// How an acceptance transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptanceEnd {
    /// Committed: its checkpoint is durable.
    Committed,
    /// Committed, but the checkpoint's update was fenced (the lease is another run's now):
    /// every item is recorded, the checkpoint did not move, and the run ends.
    Fenced,
    /// Not committed: nothing is recorded, and the run ends.
    Failed,
}

/// The transaction being decoded: its tracker sequence, its commit LSN (from Begin) and how
/// many rows it has had so far (an unreadable row is named by its position).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpenTxn {
    pub(crate) seq: TxnSeq,
    pub(crate) commit_lsn: Lsn,
    pub(crate) rows: u32,
}

/// Where a round is: the aggregate of the last row, and whether that aggregate is skipped.
#[derive(Debug, Default)]
pub(crate) struct Round {
    pub(crate) last: Option<AggKey>,
    pub(crate) skipping: bool,
}

/// Poll mode's memory between rounds, on the driver's clock: the aggregates published since
/// the last advance of positions and when every position was last advanced
/// ([`crate::poll::Advance`]), and when releases were last polled.
#[derive(Debug, Default)]
pub(crate) struct BetweenRounds {
    pub(crate) published: Vec<AggKey>,
    pub(crate) last_full: Option<std::time::Duration>,
    pub(crate) last_releases: std::time::Duration,
}

/// The pipeline's state and decisions. See the module documentation for the contract. `P`:
/// what it plants ([`Shipped`] in the daemon: nothing).
#[derive(Debug)]
pub struct PipelineCore<P = Shipped> {
    /// What the sink serves (kind, cluster, partitioner): checked against every frozen
    /// destination, and written into every receipt.
    served: Served,
    /// This relay's lease generation, written into every receipt.
    generation: i64,
    /// The checkpoint's source: the contiguous low watermark of resolved events.
    pub tracker: AckTracker,
    gate: OrderingGate<AggKey, Pending>,
    next_token: u64,
    in_flight: HashMap<u64, InFlight, foldhash::fast::RandomState>,
    batch: Vec<LedgerItem>,
    /// When the loop first saw the batch with an item, on the schedule's clock: its linger
    /// runs from there ([`PipelineCore::load_at`]); an acceptance that takes the batch ends it.
    pub(crate) batch_started: Option<std::time::Duration>,
    /// The last count of the events waiting on unclear outcomes, and when it was taken
    /// ([`PipelineCore::waiting_sampled`]).
    waiting_sample: Option<(SystemTime, crate::contract::Waiting)>,
    batch_acks: Vec<EventToken>,
    /// A send was refused because the lease was not certainly held.
    pub lease_expired: bool,
    /// The run is ending: record reports, send nothing.
    salvaging: bool,
    /// Events whose UNKNOWN attempt reconciliation found on the broker: never sent again.
    pub found: HashSet<Uuid>,
    /// Events an operator skipped (`outboxd quarantine skip`): never sent, when the stream
    /// meets them again ([`PipelineCore::skipped_by_operator`]).
    skipped: HashSet<Uuid>,
    /// Events whose UNKNOWN attempt was proven absent: the next send's attempt generation.
    pub retry_generation: HashMap<Uuid, i32>,
    in_flight_bytes: usize,
    /// Events whose send ended unclear, holding their aggregates (module `unclear`).
    parked: BTreeMap<Uuid, crate::parked::Parked>,
    /// Look-ups and resends of an event since its last clear answer.
    unclear_tries: HashMap<Uuid, u32, foldhash::fast::RandomState>,
    /// Events with a DISPATCH_UNKNOWN attempt open at start, and when its look-up is due (its
    /// settle time): parked, not sent, when the replay admits them, and looked up while the
    /// run goes on, concurrently with everything else.
    pub open_at_start: HashMap<Uuid, SystemTime>,
    /// Events whose open attempt of another generation the running reconciliation is looking
    /// up (on a task of its own: the relay's loop does not wait on a broker scan or an
    /// endpoint): not looked up again until [`PipelineCore::reconciled`] says what it proved.
    reconciling: HashSet<Uuid>,
    /// Events whose open attempt of another generation the running reconciliation cannot look
    /// up (a row written without a version or route: read from SQL it has neither;
    /// [`PipelineCore::reconcile_deferred`]): not asked about again in this run.
    pub(crate) deferred: HashSet<Uuid>,
    /// How unclear outcomes are retried, and for how long.
    pub unclear_policy: crate::parked::Policy,
    /// How long the running reconciliation leaves another run's open attempt before it looks
    /// the attempt up (`--unknown-settle-ms`, whatever the sink: that run's request may still
    /// land while its producer lives). At start, the policy's settle time decides instead
    /// ([`PipelineCore::reconcile`]).
    pub reconcile_settle: std::time::Duration,
    /// A destination's own policy, by its cluster (a webhook endpoint's retry schedule), over
    /// [`Self::unclear_policy`] for the events frozen for it.
    pub unclear_policies: BTreeMap<String, crate::parked::Policy>,
    /// Aggregates parked in this run that have not been idle since ([`Self::needs_hold_check`]).
    pub(crate) unclear_seen: HashSet<AggKey>,
    /// Aggregates an operator's release is republishing now ([`crate::release`]).
    pub(crate) releasing: HashSet<AggKey>,
    /// Poll mode only (`Some`): the aggregates parked since the driver last cleared it. A
    /// round skips them: one resolved after the round's read began has rows that read as
    /// pending but are published.
    pub unclear_touched: Option<HashSet<AggKey>>,
    /// Poll mode: where the current round is ([`crate::poll`]).
    pub(crate) round: Round,
    /// Poll mode: what a round leaves the next (positions to advance, releases' timer).
    pub(crate) between_rounds: BetweenRounds,
    /// The transaction being decoded ([`crate::stream`]).
    pub(crate) txn: Option<OpenTxn>,
    /// The highest WAL position received from the slot (the standby status's `write`).
    pub(crate) last_received: Lsn,
    /// The checkpoint the ledger has committed: the only position ever confirmed to the slot.
    pub(crate) durable: Lsn,
    /// Send -> delivery report times since [`Self::take_report_times`] (count, sum ms, max ms).
    report_ms: (u64, f64, f64),
    /// Versions for rows written without one, in commit order (docs/versions_by_relay.md),
    /// by [`NumKey`].
    pub(crate) numbering: outbox_core::numbering::Numbering<NumKey>,
    /// The route policy generations of the run, for the checkpoint to keep.
    pub(crate) generations: outbox_core::numbering::Generations,
    /// What it plants ([`Plant`]).
    pub plant: P,
}

/// What the transaction that moves the checkpoint keeps besides it, for rows written without
/// a version or a route ([`PipelineCore::numbered_through`]).
pub type NumberedThrough = outbox_core::numbering::NumberedThrough<AggKey>;

impl PipelineCore<Shipped> {
    /// The ordering gate as the ledger left it: every aggregate's last accepted version, and
    /// the aggregates held durably.
    pub fn gate_from(
        heads: Vec<(AggKey, i64)>,
        held: Vec<AggKey>,
    ) -> OrderingGate<AggKey, Pending> {
        let mut gate = OrderingGate::new();
        for (k, v) in heads {
            gate.set_head(k, v, false);
        }
        for k in held {
            gate.set_head(k, 0, true);
        }
        gate
    }

    pub fn new(served: Served, generation: i64, gate: OrderingGate<AggKey, Pending>) -> Self {
        PipelineCore::with_plant(served, generation, gate, Shipped)
    }
}

impl<P: Plant> PipelineCore<P> {
    /// Whether a transaction is being decoded (a Begin without its Commit yet).
    pub fn in_transaction(&self) -> bool {
        self.txn.is_some()
    }

    /// The highest WAL position received from the slot.
    pub fn last_received(&self) -> Lsn {
        self.last_received
    }

    /// [`PipelineCore::new`] with what it plants.
    pub fn with_plant(
        served: Served,
        generation: i64,
        gate: OrderingGate<AggKey, Pending>,
        plant: P,
    ) -> Self {
        PipelineCore {
            served,
            generation,
            tracker: AckTracker::new(Lsn::ZERO),
            gate,
            next_token: 0,
            in_flight: HashMap::default(),
            batch: Vec::new(),
            batch_started: None,
            waiting_sample: None,
            batch_acks: Vec::new(),
            lease_expired: false,
            salvaging: false,
            found: HashSet::new(),
            skipped: HashSet::new(),
            retry_generation: HashMap::new(),
            in_flight_bytes: 0,
            parked: BTreeMap::new(),
            unclear_tries: HashMap::default(),
            open_at_start: HashMap::new(),
            reconciling: HashSet::new(),
            deferred: HashSet::new(),
            unclear_policy: crate::parked::Policy::default(),
            reconcile_settle: crate::parked::Policy::default().settle,
            unclear_policies: BTreeMap::new(),
            unclear_touched: None,
            round: Default::default(),
            between_rounds: Default::default(),
            unclear_seen: HashSet::new(),
            releasing: HashSet::new(),
            txn: None,
            last_received: Lsn::ZERO,
            durable: Lsn::ZERO,
            report_ms: (0, 0.0, 0.0),
            numbering: Default::default(),
            generations: Default::default(),
            plant,
        }
    }

    /// Whether the mutant `m` is planted (never in the daemon's [`Shipped`] core).
    pub(crate) fn planted(&self, m: Mutant) -> bool {
        self.plant.planted(m)
    }

    pub fn served(&self) -> &Served {
        &self.served
    }

    /// Sent, parked after an unclear outcome, or waiting behind an aggregate's in-flight event.
    pub fn outstanding(&self) -> usize {
        self.in_flight.len() + self.parked.len() + self.gate.queued()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether sending sooner, not in bigger batches, is what would move the relay faster:
    /// more events wait behind their aggregates' in-flight events than are at the broker (a
    /// backlog of a few hot aggregates, each sending its next version only after the report
    /// on the one before). The Kafka sink then skips its linger for as long as little is
    /// outstanding (`outbox_sink::KafkaSink::pace`).
    pub fn round_trip_bound(&self) -> bool {
        self.gate.queued() > self.in_flight.len()
    }

    /// Whether `token` was sent and not yet reported on (or refused).
    pub fn is_in_flight(&self, token: u64) -> bool {
        self.in_flight.contains_key(&token)
    }

    /// Whether an event of the aggregate is at the broker.
    pub fn aggregate_in_flight(&self, key: &AggKey) -> bool {
        self.gate.in_flight(key)
    }

    /// Payload bytes of the events sent and not yet reported on.
    pub fn in_flight_bytes(&self) -> usize {
        self.in_flight_bytes
    }

    pub fn batch_len(&self) -> usize {
        self.batch.len()
    }

    /// The receipts the batch holds, not yet accepted.
    pub fn batched_receipts(&self) -> impl Iterator<Item = &ReceiptRecord> {
        self.batch.iter().filter_map(|i| match i {
            LedgerItem::Receipt(r) => Some(r),
            _ => None,
        })
    }

    /// Whether the batch holds a hold record for the aggregate (it was poisoned again).
    pub fn batch_holds(&self, key: &AggKey) -> bool {
        self.batch.iter().any(|i| {
            matches!(i, LedgerItem::Hold(h) if h.aggregate_type == key.0 && h.aggregate_id == key.1)
        })
    }

    /// Send -> delivery report times since the last call: (count, sum ms, max ms).
    pub fn take_report_times(&mut self) -> (u64, f64, f64) {
        std::mem::take(&mut self.report_ms)
    }

    fn push(&mut self, item: LedgerItem, ack: Option<EventToken>) {
        self.batch.push(item);
        if let Some(a) = ack {
            self.batch_acks.push(a);
        }
    }

    /// The driver gives the gate the head of every aggregate before its first event is admitted
    /// (the daemon looks them up when it first meets them, [`PipelineCore::unknown_aggregates`];
    /// the simulator loads them all at start), and this relay is the only writer of heads for
    /// its events since; an aggregate the gate still does not know has none.
    fn ensure_known(&mut self, key: &AggKey) {
        if !self.gate.is_known(key) {
            self.gate.set_head(key.clone(), 0, false);
        }
    }

    /// The route stage and the ordering gate for one decoded event.
    pub fn admit(
        &mut self,
        ev: OutboxEvent,
        commit_lsn: Option<Lsn>,
        change_lsn: Option<Lsn>,
        ack: Option<EventToken>,
        now: Now,
    ) -> Result<Vec<Command>, CoreError> {
        let key = key_of(&ev);
        self.ensure_known(&key);
        if ev.version_by_relay && ev.aggregate_version < 1 {
            self.poison_unnumbered(&ev, commit_lsn, ack);
            return Ok(Vec::new());
        }
        if self.found.contains(&ev.event_id) {
            // Reconciliation proved the broker has it and recorded the receipt: no resend.
            self.gate.consume(&key, ev.aggregate_version);
            if let Some(a) = ack {
                self.tracker.resolve(a)?;
            }
            return Ok(Vec::new());
        }
        // The route check runs at the head of the aggregate (in `send_one`), not here: an
        // event refused while an earlier one of its aggregate is still in flight would
        // otherwise open a hold naming itself, and if the earlier one is then rejected too,
        // nothing would ever republish that earlier one (found by `outbox-sim`).
        if self.planted(Mutant::PoisonBeforeGate) {
            if let Err(r) = route::check(&ev, &self.served) {
                let p = Pending {
                    ev,
                    commit_lsn,
                    change_lsn,
                    ack,
                };
                if self.gate.is_held(&key) {
                    self.record_held(p);
                } else {
                    self.gate.consume(&key, p.ev.aggregate_version);
                    self.poison(&p.ev, r.code, r.reason, p.commit_lsn, p.ack);
                }
                return Ok(Vec::new());
            }
        }
        let version = ev.aggregate_version;
        let copy = self.planted(Mutant::SecondInFlight).then(|| ev.clone());
        let pipe = self.pipe_of(&ev);
        let behind = self.gate.depth() > 1 && self.gate.in_flight(&key);
        match self.gate.offer(
            &key,
            version,
            pipe,
            Pending {
                ev,
                commit_lsn,
                change_lsn,
                ack,
            },
        ) {
            Admit::Send(p) => {
                if behind {
                    sent_behind(&p.ev);
                }
                Ok(self.send_one(p, now)?.into_iter().collect())
            }
            Admit::Queued => Ok(copy
                .and_then(|ev| {
                    let p = Pending {
                        ev,
                        commit_lsn,
                        change_lsn,
                        ack: None,
                    };
                    self.send_now(p, now)
                })
                .into_iter()
                .collect()),
            Admit::Held(p) => {
                self.record_held(p);
                Ok(Vec::new())
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
                        blocking_generation: Some(p.ev.envelope_generation),
                        blocking_by_relay: p.ev.version_by_relay.then_some(p.ev.route_version),
                    }),
                    None,
                );
                self.record_held(p);
                // What waits behind the aggregate's in-flight event is held too: nothing would
                // ever send it now (found by outbox-sim: a snapshot after --resnapshot left it
                // queued forever, and the snapshot waited for it forever).
                if !self.planted(Mutant::GapHoldStrandsQueue) {
                    for queued in self.gate.hold(&key) {
                        self.record_held(queued);
                    }
                }
                Ok(Vec::new())
            }
            Admit::NeedHead(_) => Err(CoreError::NeedHead),
        }
    }

    pub(crate) fn record_held(&mut self, p: Pending) {
        tracing::debug!(event_id = %p.ev.event_id, version = p.ev.aggregate_version, "event held");
        let by_relay = p.ev.version_by_relay.then_some(p.ev.route_version);
        self.push(
            LedgerItem::Held(HeldRecord {
                event_id: p.ev.event_id,
                aggregate_type: p.ev.aggregate_type,
                aggregate_id: p.ev.aggregate_id,
                aggregate_version: p.ev.aggregate_version,
                commit_lsn: p.commit_lsn,
                by_relay,
            }),
            p.ack,
        );
    }

    /// Only the stream numbers rows written without a version ([`Self::on_row`]); a snapshot or
    /// a poll round reads them in no commit order, and a release must publish the version the
    /// held record kept. Such a row met anywhere else without a version is quarantined.
    pub(crate) fn poison_unnumbered(
        &mut self,
        ev: &OutboxEvent,
        commit_lsn: Option<Lsn>,
        ack: Option<EventToken>,
    ) {
        let reason = format!(
            "event {} was written without an aggregate version, and only the replication stream numbers such rows (in commit order); it was read by a snapshot, a poll round or a release without the version the stream gave it (docs/versions_by_relay.md)",
            ev.event_id
        );
        self.poison(ev, "unnumbered_row", reason, commit_lsn, ack);
    }

    /// Quarantines `ev` with its reason and holds its aggregate; what waited behind it is held.
    pub fn poison(
        &mut self,
        ev: &OutboxEvent,
        code: &str,
        reason: String,
        commit_lsn: Option<Lsn>,
        ack: Option<EventToken>,
    ) {
        self.poison_key(&key_of(ev), ev, (commit_lsn, ack), code, reason);
    }

    /// [`Self::poison`] for an event whose aggregate's key is known, with its commit LSN and
    /// ack token. The refusal is decided for its envelope generation.
    fn poison_key(
        &mut self,
        key: &AggKey,
        ev: &OutboxEvent,
        (commit_lsn, ack): (Option<Lsn>, Option<EventToken>),
        code: &str,
        reason: String,
    ) {
        let (event_id, version, generation) =
            (ev.event_id, ev.aggregate_version, ev.envelope_generation);
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
                envelope_generation: Some(generation),
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
                blocking_generation: Some(generation),
                blocking_by_relay: ev.version_by_relay.then_some(ev.route_version),
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
            LedgerItem::Quarantine(QuarantineRecord::unreadable(key, reason, commit_lsn)),
            ack,
        );
    }

    /// Lets up to `depth` events of one aggregate be in flight at once, in one pipe
    /// ([`outbox_core::OrderingGate`]'s "More than one in flight"): only for a sink whose
    /// producer keeps what it took in order on the broker, or nothing after the first it lost,
    /// and whose executor reports each hand-over ([`Self::handed_over`]). Set before the run's
    /// first send; 1 (the default) is the one-in-flight rule.
    pub fn set_aggregate_depth(&mut self, depth: u8) {
        self.gate.set_depth(depth);
    }

    /// How many events of one aggregate may be in flight at once ([`Self::set_aggregate_depth`]).
    pub fn aggregate_depth(&self) -> u8 {
        self.gate.depth()
    }

    /// The pipe an event goes through, for a gate deeper than 1: its destination as the
    /// producer places it (cluster, topic, key, partitioner), so that a later version bound
    /// elsewhere (a migration, a route change) waits for the versions in flight. 0 at depth 1,
    /// where the gate does not read it.
    fn pipe_of(&self, ev: &OutboxEvent) -> u32 {
        if self.aggregate_depth() == 1 {
            return 0;
        }
        use std::hash::{Hash, Hasher};
        let d = &ev.destination;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&d.cluster, &d.topic, &d.key, &d.partitioner).hash(&mut h);
        h.finish() as u32
    }

    /// The producer took the message of `token` (the executor's enqueue succeeded). Under a
    /// gate deeper than 1 the next event of its aggregate may follow it now (the commands to
    /// execute); at depth 1 nothing does, and the executor need not call it.
    pub fn handed_over(&mut self, token: u64, now: Now) -> Result<Vec<Command>, CoreError> {
        if self.aggregate_depth() == 1 {
            return Ok(Vec::new());
        }
        let Some(key) = self.in_flight.get(&token).map(|f| f.key.clone()) else {
            return Ok(Vec::new());
        };
        match self.gate.handed_over(&key) {
            Some(next) => {
                sent_behind(&next.ev);
                Ok(self.send_one(next, now)?.into_iter().collect())
            }
            None => Ok(Vec::new()),
        }
    }

    /// Sends the event at the head of its aggregate ([`Self::send_now`]) — unless
    /// reconciliation found it on the broker meanwhile (and recorded its receipt): after the
    /// gate had queued it behind an earlier event of its aggregate, or while it waited to be
    /// sent again after an unclear answer. As when decoded after that ([`Self::admit`]), it is
    /// not sent again; it is resolved at once (a batch to resolve it with may never come while
    /// nothing else happens) and the next event of its aggregate goes. Found by `outbox-sim`
    /// (`resent_after_proof`): the check ran only when an event was decoded.
    pub fn send_one(&mut self, p: Pending, now: Now) -> Result<Option<Command>, CoreError> {
        if !self.found.contains(&p.ev.event_id) || self.planted(Mutant::SendsFoundEvent) {
            return Ok(self.send_now(p, now));
        }
        if let Some(a) = p.ack {
            self.tracker.resolve(a)?;
        }
        Ok(self.send_next(&key_of(&p.ev), now)?.pop())
    }

    /// Sends the event at the head of its aggregate: the lease and the route are checked
    /// here, then the event is in flight under a new token. `None` when it was not sent (no
    /// lease: it stays unresolved and the run ends; refused route: quarantined and held).
    pub fn send_now(&mut self, p: Pending, now: Now) -> Option<Command> {
        if self.salvaging || !now.lease_valid {
            // A stale generation may not send. The event stays unresolved; the run ends.
            self.lease_expired = true;
            return None;
        }
        let p = self.park_open_at_start(p, now)?;
        let checked = if self.planted(Mutant::PoisonBeforeGate) {
            Ok(())
        } else if self.planted(Mutant::RouteIgnoresCluster) {
            let mut any = self.served.clone();
            any.clusters.push(p.ev.destination.cluster.clone());
            route::check(&p.ev, &any)
        } else {
            route::check(&p.ev, &self.served)
        };
        if let Err(r) = checked {
            // Refused at the head of its aggregate: nothing of it is in flight, and what is
            // queued behind it is held.
            let key = key_of(&p.ev);
            self.poison(&p.ev, r.code, r.reason, p.commit_lsn, p.ack);
            self.gate.done(&key);
            return None;
        }
        let token = self.next_token;
        self.next_token += 1;
        let mut ev = p.ev;
        if self.planted(Mutant::RetryReresolvesRoute)
            && self.retry_generation.contains_key(&ev.event_id)
        {
            if let Some((cluster, topic, generation)) = self.plant.current_route() {
                ev.destination.cluster = cluster;
                ev.destination.topic = topic;
                ev.destination.route_generation = generation;
                ev.destination_digest = ev.destination.digest();
            }
        }
        let bytes = ev.payload.len();
        self.in_flight_bytes += bytes;
        let ev = Arc::new(ev);
        let attempt = self
            .retry_generation
            .get(&ev.event_id)
            .copied()
            .unwrap_or(1);
        self.in_flight.insert(
            token,
            InFlight {
                key: key_of(&ev),
                sent_at: now.wall,
                attempt,
                ev: Arc::clone(&ev),
                commit_lsn: p.commit_lsn,
                change_lsn: p.change_lsn,
                ack: p.ack,
                bytes,
            },
        );
        Some(Command::Send {
            token,
            attempt,
            event: ev,
        })
    }

    /// The sink did not take the message of `token` (`why`). With a permanent reason (too
    /// large, an invalid topic) the event is quarantined and its aggregate held; otherwise
    /// nothing was handed over: the event is parked, to be sent again after the backoff, and
    /// only its aggregate waits.
    pub fn send_refused(
        &mut self,
        token: u64,
        permanent: Option<String>,
        why: &str,
        now: Now,
    ) -> Result<(), CoreError> {
        let f = self
            .in_flight
            .remove(&token)
            .ok_or(CoreError::UnknownToken(token))?;
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(f.bytes);
        if let Some(why) = permanent {
            self.poison_key(
                &f.key,
                &f.ev,
                (f.commit_lsn, f.ack),
                "broker_rejected",
                format!("the producer refused the message permanently: {why}"),
            );
            self.gate.done(&f.key);
            return Ok(());
        }
        let failure = DeliveryFailure {
            event_id: f.ev.event_id,
            error: format!("the producer did not take it: {why}"),
            persistence: Persistence::NotPersisted,
            unknown: None,
        };
        self.park(f, &failure, now);
        Ok(())
    }

    /// One delivery report: a receipt, a quarantine, or an unclear outcome that parks the event.
    pub fn on_report(&mut self, d: Delivery, now: Now) -> Result<Reported, CoreError> {
        let f = self
            .in_flight
            .remove(&d.token)
            .ok_or(CoreError::UnknownToken(d.token))?;
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(f.bytes);
        // Only a position is proof. The sinks already turn a success report without one into
        // PossiblyPersisted; the core checks again, so that no sink can hand it a receipt
        // that is not evidence.
        let mut outcome = d.outcome;
        let no_proof = match &outcome {
            DeliveryOutcome::Persisted {
                topic,
                partition,
                offset,
                ..
            } => receipt::position_proof(&f.ev.destination.topic, topic, *partition, *offset)
                .err()
                .map(|why| (why, *partition)),
            DeliveryOutcome::Failed { .. } => None,
        };
        if let Some((why, partition)) =
            no_proof.filter(|_| !self.planted(Mutant::OkWithoutOffsetIsProof))
        {
            outcome = DeliveryOutcome::Failed {
                error: format!("success report is no proof of publication: {why}"),
                persistence: Persistence::PossiblyPersisted,
                class: FailureClass::Transient,
                partition,
            };
        }
        match outcome {
            DeliveryOutcome::Persisted {
                topic,
                partition,
                offset,
                timestamp_ms,
                duplicate,
                evidence,
            } => {
                if let Ok(d) = now.wall.duration_since(f.sent_at) {
                    let ms = d.as_secs_f64() * 1000.0;
                    let r = &mut self.report_ms;
                    *r = (r.0 + 1, r.1 + ms, r.2.max(ms));
                }
                // A broker-side duplicate (JetStream answered a repeated Nats-Msg-Id with the
                // original sequence) is the same copy, not a new one: the acceptance point
                // keeps it as a duplicate transport receipt when the event has its primary.
                self.unclear_tries.remove(&f.ev.event_id);
                tracing::trace!(event_id = %f.ev.event_id, %topic, partition, offset, duplicate, "broker ack");
                let mut ack = f.ack;
                if self.planted(Mutant::ConfirmBeforeAccept) {
                    if let Some(a) = ack.take() {
                        self.tracker.resolve(a)?;
                    }
                }
                let ev = Arc::unwrap_or_clone(f.ev);
                self.push(
                    LedgerItem::Receipt(ReceiptRecord {
                        event_id: ev.event_id,
                        aggregate_version: ev.aggregate_version,
                        payload_digest: ev.payload_digest,
                        destination_digest: ev.destination_digest,
                        broker_kind: self.served.kind.into(),
                        broker_cluster: ev.destination.cluster,
                        topic,
                        partition,
                        offset,
                        timestamp_ms,
                        attempt: f.attempt,
                        relay_generation: self.generation,
                        commit_lsn: f.commit_lsn,
                        change_lsn: f.change_lsn,
                        evidence,
                    }),
                    ack,
                );
            }
            DeliveryOutcome::Failed {
                error,
                class: FailureClass::Permanent,
                ..
            } => {
                self.poison_key(
                    &f.key,
                    &f.ev,
                    (f.commit_lsn, f.ack),
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
                let unknown =
                    (persistence != Persistence::NotPersisted && partition >= 0).then(|| {
                        UnknownAttempt {
                            event_id: f.ev.event_id,
                            attempt: f.attempt,
                            topic: f.ev.destination.topic.clone(),
                            partition,
                            sent_at: f.sent_at,
                            error: error.clone(),
                            by_relay: f
                                .ev
                                .version_by_relay
                                .then_some((f.ev.aggregate_version, f.ev.route_version)),
                        }
                    });
                let failure = DeliveryFailure {
                    event_id: f.ev.event_id,
                    error,
                    persistence,
                    unknown,
                };
                if self.planted(Mutant::EndsRunOnUnclear) {
                    return Err(CoreError::UnclearEndsRun(failure.error));
                }
                self.park(f, &failure, now);
                return Ok(Reported::Unclear(failure));
            }
        }
        Ok(Reported::Continue(self.send_next(&f.key, now)?))
    }

    /// `key`'s event is reported on or resolved: the next event waiting behind it is sent.
    /// With none, nothing of the aggregate waits any more, and a later send of it needs no
    /// look at the ledger's holds ([`Self::needs_hold_check`]): only what waited does.
    fn send_next(&mut self, key: &AggKey, now: Now) -> Result<Vec<Command>, CoreError> {
        match self.gate.done(key) {
            Some(next) => {
                if self.gate.in_flight_count(key) > 1 {
                    sent_behind(&next.ev);
                }
                Ok(self.send_one(next, now)?.into_iter().collect())
            }
            None => {
                if !self.unclear_seen.is_empty() {
                    self.unclear_seen.remove(key);
                }
                Ok(Vec::new())
            }
        }
    }

    /// Resolves the batch's events (when `track`) and takes the batch with the checkpoint the
    /// tracker then allows (only past [`Self::durable`], the checkpoint already committed);
    /// `None` when there is nothing to record.
    pub fn take_batch(&mut self, track: bool) -> Result<Option<TakenBatch>, CoreError> {
        let durable = self.durable;
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
        // The next batch starts with the room this one needed, instead of growing to it one
        // doubling (and one copy of every item) at a time.
        let room = self.batch.len();
        Ok(Some((
            std::mem::replace(&mut self.batch, Vec::with_capacity(room)),
            checkpoint,
        )))
    }

    /// Takes the batch for an acceptance transaction ([`Self::take_batch`]) with what it keeps
    /// for rows written without a version ([`Self::numbered_through`]); `None` when there is
    /// nothing to record. The checkpoint is not the core's until [`Self::acceptance_ended`]
    /// says the transaction committed.
    pub fn begin_acceptance(&mut self, track: bool) -> Result<Option<Acceptance>, CoreError> {
        let Some((items, checkpoint)) = self.take_batch(track)? else {
            return Ok(None);
        };
        self.batch_started = None;
        let numbered = checkpoint
            .map(|c| self.numbered_through(c))
            .filter(|n| !n.is_empty());
        Ok(Some(Acceptance {
            items,
            checkpoint,
            numbered,
        }))
    }

    /// How the transaction of `acceptance` ended: committed, its checkpoint is durable
    /// ([`Self::checkpoint_committed`]); fenced, every item is recorded and nothing moves;
    /// failed, its items go back in front of the batch for the run's salvage
    /// ([`Self::restore_batch`]).
    pub fn acceptance_ended(&mut self, acceptance: Acceptance, end: AcceptanceEnd) {
        match end {
            AcceptanceEnd::Committed => {
                if let Some(c) = acceptance.checkpoint {
                    self.checkpoint_committed(c);
                }
            }
            AcceptanceEnd::Fenced => self.restore_batch(acceptance.items, true),
            AcceptanceEnd::Failed => self.restore_batch(acceptance.items, false),
        }
    }

    /// After a failed acceptance transaction: the batch goes back in front of the pending
    /// items, for salvage (its receipts are still evidence worth recording) — unless the
    /// transaction *committed* and only the checkpoint was fenced (`fenced`): then every
    /// item is recorded already, and recording it again would store each receipt a second
    /// time as a duplicate of itself.
    pub fn restore_batch(&mut self, items: Vec<LedgerItem>, fenced: bool) {
        if fenced {
            return;
        }
        let rest = std::mem::replace(&mut self.batch, items);
        self.batch.extend(rest);
    }

    /// The run is ending: reports are still recorded, nothing more is sent.
    pub fn begin_salvage(&mut self) {
        self.salvaging = true;
    }

    /// What reconciling an UNKNOWN attempt of `event_id` proved: a found (or probe-stored)
    /// event is never sent again when the replay decodes it; a proven-absent one is sent with
    /// the next attempt generation.
    pub fn unknown_resolved(&mut self, event_id: Uuid, resolved: &crate::unknown::Resolved) {
        use crate::unknown::Resolved;
        match *resolved {
            Resolved::Found { .. } | Resolved::StoredByProbe { .. } => {
                self.found.insert(event_id);
            }
            Resolved::Retry { attempt_generation } => {
                self.retry_generation.insert(event_id, attempt_generation);
            }
            Resolved::StillUnknown => {}
        }
    }

    /// An open UNKNOWN attempt (of `attempt_generation`) of `event_id` was closed FOUND at its
    /// event's primary receipt, at `offset` (`Reconcile::ClosedByReceipt`, or a parked event's
    /// look-up, [`crate::pipeline::ParkedLookup`]): the event is published, what that proves is
    /// remembered ([`PipelineCore::unknown_resolved`]) and returned.
    pub fn closed_by_receipt(
        &mut self,
        event_id: Uuid,
        attempt_generation: i32,
        offset: i64,
    ) -> crate::unknown::Resolved {
        let found = crate::unknown::Resolved::Found {
            offset,
            attempt_generation,
        };
        self.unknown_resolved(event_id, &found);
        found
    }

    /// Reconciliation's decision for open attempt `a` ([`crate::unknown::Reconcile`]), by
    /// [`crate::unknown::step`] with this run's `generation` and the settle time of `when`: at
    /// start the policy's (the sink's: none where a look-up is itself an idempotent resend),
    /// while running [`Self::reconcile_settle`]. An attempt handed to the run is due at `now`
    /// plus what is left of its settle time. An event whose
    /// attempt is to be looked up is not looked up again (`Skip`) until
    /// [`PipelineCore::reconciled`] is told what the look-up proved: the driver runs it beside
    /// the loop, and the next poll finds the attempt still open meanwhile.
    pub fn reconcile(
        &mut self,
        when: crate::unknown::When,
        generation: i64,
        a: &crate::unknown::Open,
        now: SystemTime,
    ) -> crate::unknown::Reconcile {
        use crate::unknown::{step, Reconcile, Step, When};
        if self.is_parked(a.event_id)
            || self.reconciling.contains(&a.event_id)
            || self.deferred.contains(&a.event_id)
        {
            return Reconcile::Skip;
        }
        if when == When::Running && self.planted(Mutant::UnknownOnlyAtStart) {
            return Reconcile::Skip;
        }
        let settle = match when {
            _ if self.planted(Mutant::IgnoresSettle) => std::time::Duration::ZERO,
            When::Start => self.unclear_policy.settle,
            When::Running => self.reconcile_settle,
        };
        match step(when, generation, a.relay_generation, a.unknown_for, settle) {
            Step::Skip => Reconcile::Skip,
            Step::WaitThenLookup(_) if when == When::Start && a.has_receipt => Reconcile::Skip,
            Step::WaitThenLookup(wait) if when == When::Start => {
                self.open_at_start.insert(a.event_id, now + wait);
                Reconcile::HandedToRun
            }
            // While running, only settled attempts come here: no wait.
            Step::WaitThenLookup(_) if self.closes_by_receipt(a.has_receipt, a.lookup_resends) => {
                Reconcile::ClosedByReceipt
            }
            Step::WaitThenLookup(_) => {
                self.reconciling.insert(a.event_id);
                Reconcile::LookUp
            }
        }
    }

    /// What a parked event's due look-up means when the ledger has no open DISPATCH_UNKNOWN
    /// attempt of it left: what this run learned about it meanwhile. The running
    /// reconciliation looks an attempt up beside the loop, and the replay (or a release) can
    /// park the event in the meantime, waiting for a look-up of its own; when reconciliation's
    /// answer is recorded, nothing is left for that look-up to ask. A copy found (or stored by
    /// the re-send) is `Recorded`; a proven absence is the retry with the generation it
    /// proved; otherwise nothing is proven and it is asked again after the backoff (a
    /// parked event that kept asking found nothing forever, and its aggregate waited until
    /// the next restart: found by the simulator once reconciliation's look-ups answered
    /// later, as the daemon's do).
    pub fn resolved_meanwhile(&self, event_id: Uuid) -> LookupOutcome {
        let heeded = !self.planted(Mutant::IgnoresResolvedMeanwhile);
        if heeded && self.found.contains(&event_id) {
            LookupOutcome::Recorded
        } else if let Some(g) = self.retry_generation.get(&event_id).filter(|_| heeded) {
            LookupOutcome::Retry {
                attempt_generation: *g,
            }
        } else {
            LookupOutcome::Unresolved {
                error: "no open DISPATCH_UNKNOWN attempt in the ledger".into(),
                after: None,
            }
        }
    }

    /// Whether an open UNKNOWN attempt is closed by its event's primary receipt instead of
    /// looked up: where the look-up would send the event again under its key
    /// (`lookup_resends`: an HTTP endpoint's idempotency key, JetStream's `Nats-Msg-Id` inside
    /// the duplicate window), the receipt is the destination's answer under that key, so it
    /// answers this attempt too; asking again would send a published event after its clear
    /// answer. Both the running reconciliation and a parked event's look-up ask this (the
    /// receipt may have come meanwhile from another path: a predecessor's salvage, a copy
    /// reconciliation found). A look-up that reads what the broker holds still runs.
    pub fn closes_by_receipt(&self, has_receipt: bool, lookup_resends: bool) -> bool {
        has_receipt && lookup_resends && !self.planted(Mutant::ResendsAnsweredEvent)
    }

    /// The driver cannot load the event of an attempt [`Self::reconcile`] said to look up:
    /// a row written without a version or route (docs/versions_by_relay.md) has neither when
    /// read from SQL, and the version and destination the relay gave it live in the stream's
    /// order. Its look-up waits for a run whose replay parks the event, numbered, and looks it
    /// up then (an attempt open at start is handed to the run); meanwhile the attempt stays
    /// open, and nothing is sent or recorded on a guess.
    pub fn reconcile_deferred(&mut self, event_id: Uuid) {
        self.reconciling.remove(&event_id);
        self.deferred.insert(event_id);
    }

    /// What reconciling an open UNKNOWN attempt of `ev` proved (at start, or while running
    /// for another generation's attempt), once the driver has recorded it: settled, the event
    /// is no longer open at start (the replay finds it or retries it with the next generation,
    /// never parks it again); a found copy raises its aggregate's head where the gate knows the
    /// aggregate (a poll round, which skips published rows, would otherwise take the next
    /// version for a gap); then [`PipelineCore::unknown_resolved`].
    pub fn reconciled(&mut self, ev: &OutboxEvent, resolved: &crate::unknown::Resolved) {
        use crate::unknown::Resolved;
        self.reconciling.remove(&ev.event_id);
        if *resolved != Resolved::StillUnknown {
            self.open_at_start.remove(&ev.event_id);
        }
        if matches!(
            resolved,
            Resolved::Found { .. } | Resolved::StoredByProbe { .. }
        ) {
            self.raise_known_heads(vec![(key_of(ev), ev.aggregate_version)]);
        }
        self.unknown_resolved(ev.event_id, resolved);
    }

    /// The ledger's aggregate heads as they are now (after reconciliation at start accepted
    /// receipts of events it found): the gate expects no version at or below a head. Only
    /// raises; call it while nothing is in flight.
    pub fn raise_heads(&mut self, heads: Vec<(AggKey, i64)>) {
        for (k, v) in heads {
            self.gate.set_head(k, v, false);
        }
    }

    /// [`PipelineCore::raise_heads`] for the aggregates the gate knows; an aggregate it does
    /// not know stays unknown, and its whole head is read when the run meets it (which then
    /// counts this version). Making it known at this one version would take it for its head:
    /// a found copy of v2 while v4 was published made v4 a gap and lost v5 (outbox-sim, seed 1
    /// trace 26811, once heads were read when first met).
    pub fn raise_known_heads(&mut self, heads: Vec<(AggKey, i64)>) {
        if self.planted(Mutant::FoundRaisesUnknownHead) {
            return self.raise_heads(heads);
        }
        let known: Vec<_> = heads
            .into_iter()
            .filter(|(k, _)| self.gate.is_known(k))
            .collect();
        self.raise_heads(known);
    }

    /// The aggregates of `events` whose heads the gate does not know yet, each once, in the
    /// order met, with the version met first: what the driver looks up
    /// ([`PipelineCore::raise_heads`] with the answers) before it admits them.
    pub fn unknown_aggregates<'a>(
        &self,
        events: impl IntoIterator<Item = &'a OutboxEvent>,
    ) -> Vec<(AggKey, i64)> {
        let mut seen = HashSet::new();
        events
            .into_iter()
            .filter(|ev| !ev.version_by_relay)
            .map(|ev| (key_of(ev), ev.aggregate_version))
            .filter(|(k, _)| !self.gate.is_known(k) && seen.insert(k.clone()))
            .collect()
    }

    /// The aggregates of rows among `events` written without a version whose numbering the
    /// run does not know yet, each once, in the order met: the driver reads what the
    /// checkpoint kept for them (`outbox.stream_versions`) and gives it to
    /// [`PipelineCore::seed_numbering`] before it hands the rows over.
    pub fn unnumbered_aggregates<'a>(
        &self,
        events: impl IntoIterator<Item = &'a OutboxEvent>,
    ) -> Vec<AggKey> {
        let mut seen = HashSet::new();
        events
            .into_iter()
            .filter(|ev| ev.version_by_relay)
            .filter(|ev| {
                !self
                    .numbering
                    .knows(&num_key(&ev.aggregate_type, &ev.aggregate_id))
            })
            .map(key_of)
            .filter(|k| seen.insert(k.clone()))
            .collect()
    }

    /// The numbering the checkpoint kept for `heads` (aggregate, version of its last row
    /// committed before the run's checkpoint, or the highest version its rows were written
    /// with where that is higher; 0 for none: `outbox_ledger::numbering::versions_of`). It is
    /// also the aggregate's head
    /// for the gate: every row committed before the checkpoint is resolved, and the rows the
    /// run meets continue from it. A gate that already knows the aggregate (rows of it written
    /// with versions met first in this run) keeps its head.
    pub fn seed_numbering(&mut self, heads: Vec<(AggKey, i64)>) {
        for (k, v) in heads {
            if !self.gate.is_known(&k) {
                self.gate.set_head(k.clone(), v, false);
            }
            self.numbering.set_head(num_key(&k.0, &k.1), v);
        }
    }

    /// The numbering log is due for a fold after `entries` entries or `rows` rows logged
    /// instead of `outbox_core::numbering::FOLD_ENTRIES` / `FOLD_ROWS` (a test's knob).
    pub fn fold_numbering_every(&mut self, entries: u64, rows: u64) {
        self.numbering.fold_every(entries, rows);
    }

    /// The route policy generation in force where the run starts, and the one the checkpoint
    /// holds (`None`: none yet).
    pub fn start_generations(&mut self, in_force: Option<i64>, written: Option<i64>) {
        self.generations = outbox_core::numbering::Generations::starting(in_force, written);
    }

    /// What the acceptance transaction that moves the checkpoint to `checkpoint` keeps with
    /// it (empty when the run numbered nothing and the policy generation is unchanged). Taken
    /// once per checkpoint, just before its transaction; a run whose acceptance fails ends.
    pub fn numbered_through(&mut self, checkpoint: Lsn) -> NumberedThrough {
        if self.planted(Mutant::NumberingNotKept) {
            return NumberedThrough::default();
        }
        let versions: Vec<(AggKey, i64)> = self
            .numbering
            .checkpoint(checkpoint)
            .into_iter()
            .map(|(k, v)| (agg_of_num_key(&k), v))
            .collect();
        NumberedThrough {
            fold: self.numbering.logged(versions.len()),
            versions,
            policy_generation: self.generations.checkpoint(checkpoint),
        }
    }

    /// Whether the core knows what it needs to take `ev` in: the head of its aggregate, or,
    /// for a row written without a version, its aggregate's numbering.
    pub fn knows_aggregate_of(&self, ev: &OutboxEvent) -> bool {
        if ev.version_by_relay {
            self.numbering
                .knows(&num_key(&ev.aggregate_type, &ev.aggregate_id))
        } else {
            self.gate.is_known(&key_of(ev))
        }
    }

    /// Every aggregate the gate knows (after reconciliation at start: whose heads to read).
    pub fn known_aggregates(&self) -> Vec<AggKey> {
        self.gate.known().cloned().collect()
    }

    /// Events an operator skipped (`outboxd quarantine skip`: their quarantine closed as
    /// skipped): never to be published. The stream may meet one again after its aggregate's
    /// hold is gone — a run that replays from a checkpoint before it (the checkpoint passed
    /// it once its quarantine was recorded, but a later run may start from an older one), or
    /// one whose stream reaches it after a release poll closed the hold — and the gate would
    /// take it for a replay to send: the driver tells the core every skipped event at start
    /// (`outbox_ledger::holds::skipped_events`) and the release poll each skip it meets
    /// ([`crate::release::ReleasePoll`]). Found by the simulator (seed 1, trace 53667).
    pub fn skipped_by_operator(&mut self, ids: impl IntoIterator<Item = Uuid>) {
        self.skipped.extend(ids);
    }

    /// The events an operator skipped that this core knows of
    /// ([`PipelineCore::skipped_by_operator`]): what a run hands on when it goes on in
    /// exactly-once mode (`TxnCore::skipped_by_operator`).
    pub fn skipped_events(&self) -> impl Iterator<Item = Uuid> + '_ {
        self.skipped.iter().copied()
    }

    /// A stream row the operator skipped ([`PipelineCore::skipped_by_operator`]): resolved at
    /// once (its quarantine, closed as skipped, is its record), never sent. The reads outside
    /// the stream (a snapshot, a poll round) never offer one: their SQL leaves it out.
    pub(crate) fn drop_skipped(
        &mut self,
        ev: &OutboxEvent,
        ack: EventToken,
    ) -> Result<bool, CoreError> {
        if !self.skipped.contains(&ev.event_id) || self.planted(Mutant::StreamSendsSkipped) {
            return Ok(false);
        }
        tracing::info!(event_id = %ev.event_id, aggregate_id = %ev.aggregate_id,
            version = ev.aggregate_version, "an event an operator skipped was read again from the slot: not sent");
        let key = key_of(ev);
        self.ensure_known(&key);
        self.gate.consume(&key, ev.aggregate_version);
        self.tracker.resolve(ack)?;
        Ok(true)
    }

    /// An operator released the aggregate: its next event to publish is `next_version`.
    pub fn release(&mut self, key: &AggKey, next_version: i64) {
        self.gate.release(key, next_version);
    }
}

// How the core acts on an unclear outcome: its methods, and the parked event's look-ups
// (`ParkedLookup`, re-exported at the crate's root).
pub(crate) mod unclear;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod unclear_tests;

/// A deeper gate sends `ev` while an earlier version of its aggregate is in flight (at debug
/// level: what shows that versions pipeline).
fn sent_behind(ev: &OutboxEvent) {
    tracing::debug!(event_id = %ev.event_id, version = ev.aggregate_version,
        aggregate = %format!("{}/{}", ev.aggregate_type, ev.aggregate_id),
        "sent behind a version of its aggregate still in flight");
}
