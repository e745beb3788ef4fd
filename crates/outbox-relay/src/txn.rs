//! Exactly-once into Kafka (issue 30, docs/exactly_once.md): a slot's events go to the broker
//! in transactions, one per batch, and the broker's own record of each committed batch is what
//! a restart accepts instead of sending the batch again.
//!
//! [`TxnCore`] decides; [`Reader`] frames the stream into the whole transactions it takes; the
//! driver executes what it asks ([`TxnStep`]) and tells it what
//! happened (`on_*`). Pure: no I/O, no clock. The simulator's transactional world
//! (`crates/outbox-sim/src/world/txn.rs`) drives the same code against a broker with
//! transactions, fencing and unknown commit outcomes; the daemon (`outboxd`'s `relay/txn.rs`)
//! executes it with `outbox_sink::kafka_txn`.
//!
//! The rules, each guarded by a counter of the simulator and a mutant that makes it non-zero:
//! * **One transaction at a time, in batch order.** A batch is the queue's next events, in
//!   stream order; several versions of one aggregate may be in one transaction (a committed
//!   reader sees all of it or nothing, and one partition keeps their order). The next
//!   transaction begins only after this one committed or aborted, so batches commit in order.
//! * **Only what this relay serves is sent**: an event frozen for another destination is
//!   quarantined at its turn in a batch (`crate::route::check`, as in the default mode), and
//!   its aggregate held ([`Mutant::RouteIgnoresCluster`]).
//! * **A failed send aborts the whole transaction**, and its events are queued again in front,
//!   in order, for the next one: nothing of an aborted transaction is ever accepted as a
//!   receipt ([`Mutant::TxnAcceptsAborted`]). An event the broker refuses for good is
//!   quarantined and its aggregate held: what follows of that aggregate is recorded held, not
//!   sent, until an operator releases it.
//! * **The checkpoint moves only with an accepted batch, to `through`**: the end of the last
//!   stream transaction whose events are all in this batch or an earlier one
//!   ([`Mutant::TxnThroughPastBatch`]). A stream transaction split over two batches is read
//!   again after a crash; its events with an accepted receipt are not sent again
//!   ([`TxnCore::admit`], [`Mutant::TxnReplaysAccepted`]).
//! * **A committed batch is accepted, never sent again**: after a crash between the broker's
//!   commit and the ledger's acceptance, the start accepts every batch the broker recorded
//!   after the ledger's last ([`TxnCore::recover`], [`Mutant::TxnIgnoresRecords`]).
//! * **An unknown commit outcome is settled, not guessed** ([`TxnStep::Settle`]): the driver
//!   opens the producer again under the same transactional id (which completes or aborts the
//!   transaction) and reads the broker's records; the batch is committed if its record is
//!   there, aborted otherwise ([`Mutant::TxnUnknownIsAborted`]). Until then nothing else is
//!   sent: this is the one place where an unclear outcome holds the slot (bounded by the
//!   transaction timeout).
//! * **Fenced means stop**: another relay opened the transactional id; nothing more is sent,
//!   committed or accepted by this one.

use std::collections::{HashMap, HashSet, VecDeque};

use outbox_core::delivery::{DeliveryOutcome, FailureClass, RecordPosition, Served};
use outbox_core::records::QuarantineRecord;
use outbox_core::{Lsn, OutboxEvent};
use uuid::Uuid;

use crate::pipeline::{key_of, AggKey, Mutant, Plant, Shipped};
use crate::route;

mod reader;
mod records;
pub use reader::{Reader, StreamRow, StreamTxn};

/// What became of a stream transaction's row ([`TxnCore::admit_txn`]).
#[derive(Debug)]
pub enum TxnRow {
    /// A row that cannot be read as an event: quarantined at once under this record (it has
    /// no aggregate to hold); the driver accepts it before it goes on.
    Unreadable(QuarantineRecord),
    /// Queued to be sent: the driver keeps the event and its change record's LSN until its
    /// batch's receipts are built.
    Queued {
        event: Box<OutboxEvent>,
        change_lsn: Lsn,
    },
    /// Not sent: published already (`accepted`: read again after a crash) or skipped by an
    /// operator.
    NotSent { accepted: bool },
}

/// What a stopping exactly-once run does next ([`TxnEnd::next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnEndStep {
    /// Wait for the next answer — a send's delivery report, the broker's answer to a commit,
    /// abort or settle, an acceptance — and hand it to the core as the stream loop does
    /// (`on_report`; `broker_answered` after the broker's), then execute what the core asks
    /// ([`TxnCore::poll_step`]); or tell [`TxnEnd::grace_over`] when the stop's time is up.
    AwaitAnswer,
    /// Confirm the durable checkpoint to the slot.
    Confirm,
    /// Give the lease back: the run is over.
    Done,
}

/// A graceful stop of an exactly-once run (SIGTERM, a fleet member's hand-over): what the
/// relay has read goes into a last transaction, which is committed and accepted before the
/// slot is confirmed and the lease given back, within the stop's time
/// ([`crate::lifecycle::STOP_DRAIN_MAX`]); a transaction still open then is left to the next
/// holder, whose producer aborts it. The daemon's `relay/txn.rs` and the simulator's
/// exactly-once world execute it.
#[derive(Debug, Default)]
pub struct TxnEnd {
    grace_over: bool,
    confirmed: bool,
}

impl TxnEnd {
    /// Begins the stop: what is queued is due now ([`TxnCore::flush`]).
    pub fn new<P: Plant>(core: &mut TxnCore<P>) -> TxnEnd {
        core.flush();
        TxnEnd::default()
    }

    /// The stop's time is up.
    pub fn grace_over(&mut self) {
        self.grace_over = true;
    }

    /// The next step; `accepting`: an acceptance runs or waits to run (the driver's).
    pub fn next<P: Plant>(&mut self, core: &TxnCore<P>, accepting: bool) -> TxnEndStep {
        let waiting = (core.in_transaction() || accepting)
            && !core.plant.planted(Mutant::TxnStopWithoutWaiting);
        if waiting && !self.grace_over && !core.stopped() {
            TxnEndStep::AwaitAnswer
        } else if !self.confirmed {
            self.confirmed = true;
            TxnEndStep::Confirm
        } else {
            TxnEndStep::Done
        }
    }
}

/// A stream row written without a version (the writer's plain INSERT): exactly-once mode
/// does not number rows yet (docs/exactly_once.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unnumbered {
    pub event_id: Uuid,
}
pub use records::StreamIdentity;

/// One event of a batch where the broker stored it. (The ledger builds the receipt from the
/// event's row: the rows are immutable, so their digests are the ones the send computed.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnReceipt {
    pub event_id: Uuid,
    pub partition: i32,
    pub offset: i64,
}

/// An event a batch records in the ledger without sending it. Written into the batch's
/// record with its receipts, so that a start that accepts the batch from the broker's record
/// keeps it too (without it, the checkpoint would pass an event recorded nowhere: found by the
/// simulator's `txn_lost`, seed 1 trace 431).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    pub event_id: Uuid,
    pub aggregate: AggKey,
    pub version: i64,
    /// `Some((code, reason))`: refused for good (by the broker, or by the route check),
    /// quarantined with the reason, its aggregate held from this version. `None`: of an
    /// aggregate that is held; it waits for the operator's release.
    pub quarantined: Option<(String, String)>,
}

impl Kept {
    fn of(event: &OutboxEvent, quarantined: Option<(&str, String)>) -> Kept {
        Kept {
            event_id: event.event_id,
            aggregate: key_of(event),
            version: event.aggregate_version,
            quarantined: quarantined.map(|(code, reason)| (code.to_string(), reason)),
        }
    }
}

/// A batch the broker recorded as committed, as the start reads it back (the batch record in
/// the positions topic; `outbox_sink::kafka_txn::BatchRecord`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub batch: u64,
    pub through: Lsn,
    /// Every event of the batch where the broker stored it.
    pub receipts: Vec<TxnReceipt>,
    /// What the batch keeps without sending it.
    pub kept: Vec<Kept>,
    /// Where the record is stored.
    pub record: RecordPosition,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)]
pub enum TxnStep {
    /// Begin the transaction of `batch`.
    Begin { batch: u64 },
    /// Send `event` inside the open transaction; its delivery report comes back with `token`.
    Send { token: u64, event: OutboxEvent },
    /// Commit the open transaction with its batch record (written into the positions topic
    /// inside it): `receipts`, `kept` and `through` as given. A batch that sends nothing but
    /// keeps events commits a transaction with its record alone. Answer with
    /// [`TxnCore::on_committed`].
    Commit {
        batch: u64,
        through: Lsn,
        receipts: Vec<TxnReceipt>,
        kept: Vec<Kept>,
    },
    /// Abort the open transaction. Answer with [`TxnCore::on_aborted`], or
    /// [`TxnCore::on_abort_unclear`] when the abort did not answer.
    Abort { batch: u64 },
    /// The commit's outcome is unknown (or the abort did not answer): open the producer again
    /// under the same transactional id and read the broker's records after the ledger's last;
    /// answer with
    /// [`TxnCore::on_settled`].
    Settle { batch: u64 },
    /// Accept in the ledger, in one transaction and in batch order: the receipts, what the
    /// batch keeps without sending, the checkpoint `through`, and where the broker stores the
    /// batch's record (`None` for a batch of stream commits alone, which holds no event and
    /// needs no transaction). Answer with [`TxnCore::on_accepted`].
    Accept {
        batch: u64,
        receipts: Vec<TxnReceipt>,
        kept: Vec<Kept>,
        through: Lsn,
        record: Option<RecordPosition>,
    },
    /// Another relay holds the transactional id: stop, sending and accepting nothing more.
    Stop,
}

/// What a blocking broker call of the open transaction answered, as the driver read it; what
/// it means for the transaction is [`TxnCore::on_broker`]'s to decide, for the daemon and the
/// simulator alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerAnswer {
    /// The commit returned; the batch record's delivery report named this position (`None`:
    /// it named none, so the broker's records must say where it is).
    Committed(Option<RecordPosition>),
    /// The commit failed: another producer of the transactional id fenced this one
    /// (`fenced`), or anything else (retriable, abortable, fatal for this producer), which
    /// leaves its outcome open.
    CommitFailed { fenced: bool },
    /// The abort returned.
    Aborted,
    /// The abort failed: fenced, or the producer is unusable (the transaction stays open on
    /// the broker until a new producer of the id settles it).
    AbortFailed { fenced: bool },
    /// A new producer under the transactional id settled the transaction; the broker's
    /// records hold this position for it, or nothing (it is aborted).
    Settled(Option<RecordPosition>),
}

/// How a commit ended, as the core reads a [`BrokerAnswer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CommitOutcome {
    Committed(RecordPosition),
    /// Nobody knows yet (a timeout): settle it.
    Unknown,
    Fenced,
}

/// A delivery report of a send inside the open transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnReport {
    /// Stored at this position (not visible before the commit).
    Stored {
        partition: i32,
        offset: i64,
    },
    /// Not stored; the transaction must be aborted. `permanent`: the broker will never take
    /// this event (quarantine it), with the reason.
    Failed {
        permanent: Option<String>,
    },
    Fenced,
}

impl TxnReport {
    /// What a delivery report of a transactional send means for its batch. A success that
    /// names no position (librdkafka's implicit ack) proves nothing stored: the transaction is
    /// aborted, as for any failure (the default mode's rule too, `OkWithoutOffsetIsProof`).
    pub fn of(outcome: DeliveryOutcome) -> TxnReport {
        match outcome {
            DeliveryOutcome::Persisted {
                partition, offset, ..
            } if offset >= 0 => TxnReport::Stored { partition, offset },
            DeliveryOutcome::Persisted { .. } => TxnReport::Failed { permanent: None },
            DeliveryOutcome::Failed { error, class, .. } => TxnReport::Failed {
                permanent: (class == FailureClass::Permanent).then_some(error),
            },
        }
    }
}

#[derive(Debug)]
struct Queued {
    /// Events admitted before this one.
    seq: u64,
    event: OutboxEvent,
}

/// A send's report so far: `None` none yet, `Some(None)` not stored, `Some(Some(..))` stored
/// at that partition and offset.
type Report = Option<Option<(i32, i64)>>;

#[derive(Debug)]
struct Open {
    batch: u64,
    /// In send order: (token, event, its report).
    sent: Vec<(u64, Queued, Report)>,
    kept: Vec<Kept>,
    /// The stream commits this batch covers, given back if it aborts.
    covers: Vec<(u64, Lsn)>,
    through: Lsn,
    reported: usize,
    failed: bool,
    /// Refused for good: (token, reason).
    refused: Vec<(u64, String)>,
    phase: OpenPhase,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenPhase {
    Sending,
    Committing,
    Aborting,
    Settling,
}

/// A slot's transactional relay. See the module docs.
#[derive(Debug)]
pub struct TxnCore<P: Plant = Shipped> {
    plant: P,
    served: Served,
    batch_size: usize,
    next_batch: u64,
    next_token: u64,
    /// Events admitted so far (their sequence numbers).
    admitted: u64,
    queue: VecDeque<Queued>,
    /// Stream commits not covered by a batch yet: (events admitted before it, its end LSN).
    commits: VecDeque<(u64, Lsn)>,
    open: Option<Open>,
    /// When the stream first gave the batch something since the last flush (events, or a
    /// position the checkpoint may follow), on the driver's clock: the batch is due a linger
    /// after it ([`TxnCore::read`]).
    linger_started: Option<std::time::Duration>,
    /// Decided to be kept (an aborted transaction's quarantined and held events), for the next
    /// batch's record.
    pending_kept: Vec<Kept>,
    /// Batches whose acceptance was asked and not answered, in order: (batch, through).
    accepting: VecDeque<(u64, Lsn)>,
    durable: Lsn,
    /// Held aggregates, from this version on (their blocking event's: its earlier versions in
    /// the same aborted batch, or read again, are still sent).
    held: HashMap<AggKey, i64>,
    /// Events an operator skipped: never sent when a replay meets them
    /// ([`TxnCore::skipped_by_operator`]).
    skipped: HashSet<Uuid>,
    steps: VecDeque<TxnStep>,
    stopped: bool,
    /// The last stream commit with a receipt in the ledger (read after the recovery): a
    /// stream transaction committed later is read for the first time.
    replay_bound: Option<Lsn>,
    /// The heads of the aggregates met in transactions read again: the highest version with
    /// a receipt, read when first met.
    heads: HashMap<AggKey, i64>,
}

impl TxnCore<Shipped> {
    /// The core of a run that starts at the ledger's checkpoint `durable`, after the ledger's
    /// last accepted batch `last_batch`, with the aggregates the ledger holds and the version
    /// each is held from (its blocking event's).
    pub fn new(
        served: Served,
        batch_size: usize,
        durable: Lsn,
        last_batch: u64,
        held: Vec<(AggKey, i64)>,
    ) -> Self {
        TxnCore::planted(Shipped, served, batch_size, durable, last_batch, held)
    }
}

impl<P: Plant> TxnCore<P> {
    /// [`TxnCore::new`] with `plant` (the simulator's mutants).
    pub fn planted(
        plant: P,
        served: Served,
        batch_size: usize,
        durable: Lsn,
        last_batch: u64,
        held: Vec<(AggKey, i64)>,
    ) -> Self {
        TxnCore {
            plant,
            served,
            batch_size: batch_size.max(1),
            next_batch: last_batch + 1,
            next_token: 0,
            admitted: 0,
            queue: VecDeque::new(),
            commits: VecDeque::new(),
            open: None,
            linger_started: None,
            pending_kept: Vec::new(),
            accepting: VecDeque::new(),
            durable,
            held: held.into_iter().collect(),
            skipped: HashSet::new(),
            steps: VecDeque::new(),
            stopped: false,
            replay_bound: None,
            heads: HashMap::new(),
        }
    }

    /// The last stream commit with a receipt in the ledger (`checkpoint::accepted_through`,
    /// read after the recovery): transactions committed up to it are read again, and what of
    /// them has its receipt is not sent again ([`Self::replayed_accepted`]).
    pub fn set_replay_bound(&mut self, bound: Option<Lsn>) {
        self.replay_bound = bound;
    }

    /// Whether the stream transaction committed at `commit_lsn` is read again (at or below the
    /// replay bound).
    fn replayed(&self, commit_lsn: Lsn) -> bool {
        self.replay_bound.is_some_and(|b| commit_lsn <= b)
    }

    /// The aggregates of `events`, of a stream transaction committed at `commit_lsn`, whose
    /// heads must be read before it is admitted: it is read again, and they were not met yet.
    pub fn heads_needed<'a>(
        &self,
        commit_lsn: Lsn,
        events: impl IntoIterator<Item = &'a OutboxEvent>,
    ) -> Vec<AggKey> {
        if !self.replayed(commit_lsn) {
            return Vec::new();
        }
        events
            .into_iter()
            .map(key_of)
            .filter(|k| !self.heads.contains_key(k))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// [`TxnCore::heads_needed`] for every transaction of a read, once each: the heads of a
    /// read are read in one look-up before any of it is admitted.
    pub fn heads_needed_in(&self, read: &[StreamTxn]) -> Vec<AggKey> {
        read.iter()
            .flat_map(|t| {
                let events = t.rows.iter().filter_map(|(r, _)| r.as_ref().ok());
                self.heads_needed(t.commit_lsn, events)
            })
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// The heads read for `needed` (`read`: the highest version with a receipt of those that
    /// have one; the others have none: 0).
    pub fn learn_heads(&mut self, needed: Vec<AggKey>, read: Vec<(AggKey, i64)>) {
        self.heads.extend(read);
        for k in needed {
            self.heads.entry(k).or_insert(0);
        }
    }

    /// Whether `event`, of the stream transaction committed at `commit_lsn`, has its receipt
    /// already: read again, and its aggregate's head (read when first met) at or above its
    /// version. A transaction split over two batches is read again after a crash: its events
    /// of the first batch are accepted, those of the second are not, and must be sent
    /// ([`Mutant::TxnReplayedIsAccepted`] takes the whole transaction for accepted).
    pub fn replayed_accepted(&self, event: &OutboxEvent, commit_lsn: Lsn) -> bool {
        if !self.replayed(commit_lsn) {
            return false;
        }
        if self.plant.planted(Mutant::TxnReplayedIsAccepted) {
            return true;
        }
        self.heads
            .get(&key_of(event))
            .is_some_and(|h| event.aggregate_version <= *h)
    }

    /// The checkpoint the ledger holds: the slot may be confirmed up to here.
    pub fn durable(&self) -> Lsn {
        self.durable
    }

    /// Whether this core was fenced and stopped.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The driver read the stream at `now` (its clock) and admitted what it read; `moved`:
    /// events, or a position the checkpoint may follow. A full batch is due at once
    /// ([`TxnCore::flush`]); otherwise the first read since the last flush starts its linger.
    pub fn read(&mut self, moved: bool, now: std::time::Duration) {
        if self.unfinished() >= self.batch_size {
            self.flush();
        } else if moved && self.linger_started.is_none() {
            self.linger_started = Some(now);
        }
    }

    /// Whether the driver may read the stream: fewer than `max_in_flight` events unfinished
    /// (`--max-in-flight`; a full batch is flushed by [`TxnCore::read`] before this bounds).
    pub fn can_read(&self, max_in_flight: usize) -> bool {
        self.unfinished() < max_in_flight
    }

    /// The broker answered a commit, an abort or a settle, and the core was told what it said:
    /// once no transaction is open, what queued meanwhile goes in the next one at once, not a
    /// linger later ([`TxnCore::flush`]).
    fn broker_answered(&mut self) {
        if !self.in_transaction() && !self.plant.planted(Mutant::TxnAnswerLeavesQueue) {
            self.flush();
        }
    }

    /// When the batch's linger started, if it runs: the batch is due a linger after it.
    pub fn linger_started(&self) -> Option<std::time::Duration> {
        self.linger_started
    }

    /// Events admitted and not yet in an accepted batch, nor in one being accepted.
    pub fn unfinished(&self) -> usize {
        self.queue.len()
            + self.pending_kept.len()
            + self
                .open
                .as_ref()
                .map_or(0, |o| o.sent.len() + o.kept.len())
    }

    /// Whether a transaction is in progress.
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// At the start, after the producer was opened (which settled the previous holder's
    /// transaction): the batches the broker recorded after the ledger's last accepted one, in
    /// order. Each is accepted from its record and none is sent again; the stream then starts
    /// from [`TxnCore::durable`] once they are accepted.
    pub fn recover(&mut self, recorded: Vec<Recorded>) {
        if self.plant.planted(Mutant::TxnIgnoresRecords) {
            return;
        }
        for r in recorded {
            let skipped =
                self.plant.planted(Mutant::TxnSkipsFirstRecord) && r.batch == self.next_batch;
            if r.batch < self.next_batch || skipped {
                continue; // accepted already
            }
            self.next_batch = r.batch + 1;
            self.accepting.push_back((r.batch, r.through));
            self.steps.push_back(TxnStep::Accept {
                batch: r.batch,
                receipts: r.receipts,
                kept: r.kept,
                through: r.through,
                record: Some(r.record),
            });
        }
    }

    /// Events an operator skipped (`outboxd quarantine skip`), which a replay may meet after
    /// their hold is gone (closed by a run in the default mode): never sent, as
    /// `PipelineCore::skipped_by_operator` in the default mode. The driver loads them at start.
    pub fn skipped_by_operator(&mut self, ids: impl IntoIterator<Item = Uuid>) {
        self.skipped.extend(ids);
    }

    /// An event of the stream, in stream order. `accepted`: the ledger holds its receipt (a
    /// stream transaction split over two batches, read again after a crash): it is not sent
    /// again; nor is an event an operator skipped (its closed quarantine is its record).
    /// Returns whether it was queued to be sent.
    pub fn admit(&mut self, event: OutboxEvent, accepted: bool) -> bool {
        self.admitted += 1;
        if !self.sends(&event, accepted) {
            return false;
        }
        self.queue.push_back(Queued {
            seq: self.admitted - 1,
            event,
        });
        true
    }

    /// Whether [`Self::admit`] queues `event` to be sent.
    fn sends(&self, event: &OutboxEvent, accepted: bool) -> bool {
        let published = accepted && !self.plant.planted(Mutant::TxnReplaysAccepted);
        let skipped = self.skipped.contains(&event.event_id)
            && !self.plant.planted(Mutant::StreamSendsSkipped);
        !published && !skipped
    }

    /// One stream transaction read whole, in stream order, after the heads its aggregates
    /// need were learnt ([`Self::heads_needed_in`], [`Self::learn_heads`]): each row admitted
    /// as [`Self::admit`] says, whether it is published already decided by
    /// [`Self::replayed_accepted`], then its commit ([`Self::stream_commit`]). What became of
    /// each row, in order; refused whole if a row was written without a version (exactly-once
    /// mode does not number rows yet, docs/exactly_once.md).
    pub fn admit_txn(&mut self, t: StreamTxn) -> Result<Vec<TxnRow>, Unnumbered> {
        if let Some(event_id) = t
            .rows
            .iter()
            .find_map(|(r, _)| r.as_ref().ok().filter(|e| e.version_by_relay))
            .map(|e| e.event_id)
        {
            return Err(Unnumbered { event_id });
        }
        let mut out = Vec::with_capacity(t.rows.len());
        for (n, (row, change_lsn)) in t.rows.into_iter().enumerate() {
            out.push(match row {
                // It has no aggregate to hold: quarantined at once.
                Err(reason) => TxnRow::Unreadable(QuarantineRecord::unreadable(
                    format!("lsn:{}:{n}", t.commit_lsn),
                    reason,
                    t.commit_lsn,
                )),
                Ok(event) => {
                    let accepted = self.replayed_accepted(&event, t.commit_lsn);
                    // The driver keeps a copy of what is queued only.
                    let kept = self
                        .sends(&event, accepted)
                        .then(|| Box::new(event.clone()));
                    self.admit(event, accepted);
                    match kept {
                        Some(event) => TxnRow::Queued { event, change_lsn },
                        None => TxnRow::NotSent { accepted },
                    }
                }
            });
        }
        self.stream_commit(t.end_lsn);
        Ok(out)
    }

    /// The stream transaction whose events were admitted last ended at `end`.
    pub fn stream_commit(&mut self, end: Lsn) {
        self.commits.push_back((self.admitted, end));
    }

    /// The batch is due (full, or its linger passed; the driver's schedule decides): begins a
    /// transaction for what is queued, when none is in progress. A batch of nothing but stream
    /// commits moves the checkpoint without a transaction.
    pub fn flush(&mut self) {
        // Due now, taken or not (a transaction in progress takes what queued when it ends):
        // the next read starts the next linger.
        self.linger_started = None;
        if self.stopped || self.open.is_some() {
            return;
        }
        let take = self.queue.len().min(self.batch_size);
        // The events of this batch are those with seq < `upto`.
        let upto = match self.queue.get(take) {
            Some(next) => next.seq,
            None => self.admitted,
        };
        let mut covers = Vec::new();
        while let Some(&(before, end)) = self.commits.front() {
            if before > upto && !self.plant.planted(Mutant::TxnThroughPastBatch) {
                break;
            }
            covers.push((before, end));
            self.commits.pop_front();
        }
        let through = covers.last().map_or(self.last_through(), |c| c.1);
        if take == 0 && covers.is_empty() && self.pending_kept.is_empty() {
            return;
        }
        let batch = self.next_batch;
        self.next_batch += 1;
        let mut open = Open {
            batch,
            sent: Vec::new(),
            kept: std::mem::take(&mut self.pending_kept),
            covers,
            through,
            reported: 0,
            failed: false,
            refused: Vec::new(),
            phase: OpenPhase::Sending,
        };
        let mut sends = Vec::new();
        let batch_events: Vec<Queued> = self.queue.drain(..take).collect();
        for q in batch_events {
            let key = key_of(&q.event);
            let held_from = self.held.get(&key);
            if held_from.is_some_and(|v| q.event.aggregate_version >= *v) {
                open.kept.push(Kept::of(&q.event, None));
                continue;
            }
            // The route check, as the default mode's at its aggregate's turn: an event frozen
            // for a destination this relay does not serve is quarantined in the batch's
            // record, and its aggregate held from it (what follows of it in this batch too).
            if let Err(refusal) = self.route_check(&q.event) {
                let from = self.held.entry(key).or_insert(i64::MAX);
                *from = (*from).min(q.event.aggregate_version);
                open.kept
                    .push(Kept::of(&q.event, Some((refusal.code, refusal.reason))));
                continue;
            }
            let token = self.next_token;
            self.next_token += 1;
            sends.push(TxnStep::Send {
                token,
                event: q.event.clone(),
            });
            open.sent.push((token, q, None));
        }
        if sends.is_empty() && open.kept.is_empty() {
            // Stream commits alone: no event to record, the ledger moves the checkpoint. (Lost
            // in a crash, it is only read again.)
            self.accepting.push_back((batch, through));
            self.steps.push_back(TxnStep::Accept {
                batch,
                receipts: Vec::new(),
                kept: Vec::new(),
                through,
                record: None,
            });
            return;
        }
        self.steps.push_back(TxnStep::Begin { batch });
        if sends.is_empty() {
            // Kept events alone: a transaction with the record only.
            open.phase = OpenPhase::Committing;
            self.steps.push_back(TxnStep::Commit {
                batch,
                through,
                receipts: Vec::new(),
                kept: open.kept.clone(),
            });
        }
        self.steps.extend(sends);
        self.open = Some(open);
    }

    fn route_check(&self, event: &OutboxEvent) -> Result<(), route::Refusal> {
        if self.plant.planted(Mutant::RouteIgnoresCluster) {
            let mut any = self.served.clone();
            any.clusters.push(event.destination.cluster.clone());
            return route::check(event, &any);
        }
        route::check(event, &self.served)
    }

    /// The checkpoint the last batch asked for (accepted or not), or the durable one.
    fn last_through(&self) -> Lsn {
        self.accepting.back().map_or(self.durable, |a| a.1)
    }

    /// A delivery report of the open transaction's send `token`.
    pub fn on_report(&mut self, token: u64, report: TxnReport) {
        if self.stopped {
            return;
        }
        let Some(open) = self.open.as_mut() else {
            return;
        };
        let Some(slot) = open.sent.iter_mut().find(|s| s.0 == token) else {
            return;
        };
        if slot.2.is_some() {
            return;
        }
        match report {
            TxnReport::Stored { partition, offset } => {
                slot.2 = Some(Some((partition, offset)));
            }
            TxnReport::Failed { permanent } => {
                open.failed = true;
                slot.2 = Some(None);
                if let Some(reason) = permanent {
                    open.refused.push((token, reason));
                }
            }
            TxnReport::Fenced => return self.stop(),
        }
        open.reported += 1;
        if open.reported < open.sent.len() {
            return;
        }
        if open.failed {
            open.phase = OpenPhase::Aborting;
            self.steps.push_back(TxnStep::Abort { batch: open.batch });
        } else {
            open.phase = OpenPhase::Committing;
            let receipts = receipts_of(open);
            self.steps.push_back(TxnStep::Commit {
                batch: open.batch,
                through: open.through,
                receipts,
                kept: open.kept.clone(),
            });
        }
    }

    /// What a blocking broker call answered; then what queued meanwhile is due
    /// ([`TxnCore::broker_answered`]). A commit that returned without its record's position,
    /// or failed for any reason but a fence, has an unknown outcome: settled by a new producer
    /// and the broker's records, never by sending the batch again.
    pub fn on_broker(&mut self, answer: BrokerAnswer) {
        match answer {
            BrokerAnswer::Committed(Some(at)) => self.on_committed(CommitOutcome::Committed(at)),
            BrokerAnswer::Committed(None) | BrokerAnswer::CommitFailed { fenced: false } => {
                self.on_committed(CommitOutcome::Unknown)
            }
            BrokerAnswer::CommitFailed { fenced: true } => self.on_committed(CommitOutcome::Fenced),
            BrokerAnswer::Aborted => self.on_aborted(false),
            BrokerAnswer::AbortFailed { fenced: true } => self.on_aborted(true),
            BrokerAnswer::AbortFailed { fenced: false } => self.on_abort_unclear(),
            BrokerAnswer::Settled(found) => self.on_settled(found),
        }
        // The transaction is over or settled: what queued meanwhile goes in the next one.
        self.broker_answered();
    }

    /// How the open transaction's commit ended.
    fn on_committed(&mut self, outcome: CommitOutcome) {
        if self.stopped || !self.open_in(OpenPhase::Committing) {
            return;
        }
        match outcome {
            CommitOutcome::Committed(record) => self.committed(record),
            CommitOutcome::Unknown if self.plant.planted(Mutant::TxnUnknownIsAborted) => {
                self.aborted()
            }
            CommitOutcome::Unknown => {
                let open = self.open.as_mut().expect("checked");
                open.phase = OpenPhase::Settling;
                self.steps.push_back(TxnStep::Settle { batch: open.batch });
            }
            CommitOutcome::Fenced => self.stop(),
        }
    }

    /// The open transaction's abort is done (`fenced`: another relay had opened the id
    /// first, which aborted it as well).
    fn on_aborted(&mut self, fenced: bool) {
        if fenced {
            return self.stop();
        }
        if !self.stopped && self.open_in(OpenPhase::Aborting) {
            self.aborted();
        }
    }

    /// The open transaction's abort did not answer (the producer is unusable): settled as an
    /// unknown commit is, by a new producer under the same id (which aborts the transaction:
    /// its commit never began) and the broker's records.
    fn on_abort_unclear(&mut self) {
        if self.stopped || !self.open_in(OpenPhase::Aborting) {
            return;
        }
        let open = self.open.as_mut().expect("checked");
        open.phase = OpenPhase::Settling;
        self.steps.push_back(TxnStep::Settle { batch: open.batch });
    }

    /// The settled outcome of a commit that was unknown: the batch's record as the broker
    /// holds it, or `None` when the broker has no record of it (aborted).
    fn on_settled(&mut self, record: Option<RecordPosition>) {
        if self.stopped || !self.open_in(OpenPhase::Settling) {
            return;
        }
        match record {
            Some(record) => self.committed(record),
            None => self.aborted(),
        }
    }

    /// The acceptances waiting for the ledger ([`TxnStep::Accept`]s, in the order asked) as
    /// one, which the ledger takes in one transaction, so that acceptances keep up with the
    /// broker's commits (the batches accepted together grow with the ledger's latency). Its
    /// receipts and kept events are every batch's, in order; its checkpoint and record the
    /// furthest, never behind the durable checkpoint; its batch the last. With the batches it
    /// covers, each to be told accepted in order ([`TxnCore::on_accepted`]). `None`: nothing
    /// to accept.
    pub fn merge_accepts(&self, steps: Vec<TxnStep>) -> Option<(Vec<u64>, TxnStep)> {
        let (mut batches, mut all_receipts, mut all_kept) = (Vec::new(), Vec::new(), Vec::new());
        let (mut furthest, mut last_record) = (self.durable, None);
        for step in steps {
            if let TxnStep::Accept {
                batch,
                receipts,
                kept,
                through,
                record,
            } = step
            {
                batches.push(batch);
                all_receipts.extend(receipts);
                all_kept.extend(kept);
                furthest = furthest.max(through);
                last_record = last_record.max(record);
            }
        }
        let merged = TxnStep::Accept {
            batch: *batches.last()?,
            receipts: all_receipts,
            kept: all_kept,
            through: furthest,
            record: last_record,
        };
        Some((batches, merged))
    }

    /// The ledger accepted `batch` (the oldest asked): the checkpoint is its `through`.
    pub fn on_accepted(&mut self, batch: u64) {
        if let Some(&(b, through)) = self.accepting.front() {
            if b == batch {
                self.accepting.pop_front();
                self.durable = self.durable.max(through);
            }
        }
    }

    /// An operator released `key`: its events flow again.
    pub fn release(&mut self, key: &AggKey) {
        self.held.remove(key);
    }

    /// The next thing to do, if any.
    pub fn poll_step(&mut self) -> Option<TxnStep> {
        self.steps.pop_front()
    }

    fn open_in(&self, phase: OpenPhase) -> bool {
        self.open.as_ref().is_some_and(|o| o.phase == phase)
    }

    fn committed(&mut self, record: RecordPosition) {
        let open = self.open.take().expect("an open transaction");
        let receipts = receipts_of(&open);
        self.accepting.push_back((open.batch, open.through));
        self.steps.push_back(TxnStep::Accept {
            batch: open.batch,
            receipts,
            kept: open.kept,
            through: open.through,
            record: Some(record),
        });
    }

    /// Nothing of the transaction is visible: its events go back in front of the queue, in
    /// order, and the stream commits it covered with them; one refused for good is
    /// quarantined instead and its aggregate held from its version. What it kept, and those
    /// quarantines, go into the next batch's record.
    fn aborted(&mut self) {
        let open = self.open.take().expect("an open transaction");
        if self.plant.planted(Mutant::TxnAcceptsAborted) {
            let receipts = receipts_of(&open);
            self.accepting.push_back((open.batch, open.through));
            self.steps.push_back(TxnStep::Accept {
                batch: open.batch,
                receipts,
                kept: open.kept.clone(),
                through: open.through,
                record: None,
            });
        }
        self.pending_kept.extend(open.kept);
        let mut again = Vec::with_capacity(open.sent.len());
        for (token, q, _) in open.sent {
            match open.refused.iter().find(|r| r.0 == token) {
                Some((_, reason)) => {
                    let from = self.held.entry(key_of(&q.event)).or_insert(i64::MAX);
                    *from = (*from).min(q.event.aggregate_version);
                    self.pending_kept.push(Kept::of(
                        &q.event,
                        Some(("broker_rejected", reason.clone())),
                    ));
                }
                None => again.push(q),
            }
        }
        if self.plant.planted(Mutant::TxnRequeuesAtBack) {
            self.queue.extend(again);
        } else {
            for q in again.into_iter().rev() {
                self.queue.push_front(q);
            }
        }
        for c in open.covers.into_iter().rev() {
            self.commits.push_front(c);
        }
    }

    fn stop(&mut self) {
        self.stopped = true;
        self.open = None;
        self.steps.clear();
        self.steps.push_back(TxnStep::Stop);
    }
}

fn receipts_of(open: &Open) -> Vec<TxnReceipt> {
    open.sent
        .iter()
        .filter_map(|(_, q, at)| {
            at.flatten().map(|(partition, offset)| TxnReceipt {
                event_id: q.event.event_id,
                partition,
                offset,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
