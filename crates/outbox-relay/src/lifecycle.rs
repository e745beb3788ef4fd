//! A relay run's life around the pipeline: the lease's timing, and what a run that ended with
//! an error leads to (reconnect after a backoff, or stop the process).
//!
//! # The lease
//! A relay sends only while its lease on the slot is *certainly* its own. The ledger's lease
//! row expires `ttl` after the renewal that the database stamped; the relay cannot know when
//! that stamp was taken, only when it sent the request. So it counts its validity from the
//! moment it *asked*, and for less than the TTL ([`certain_for`]): a renewal that took long to
//! reach the database, or a clock that runs a little slow, still leaves the relay's idea of the
//! deadline before the ledger's. The deadline is measured on a monotonic clock, which keeps
//! counting while the process is paused: a relay resumed after SIGSTOP finds its lease over
//! and sends nothing. Renewals run every third of the TTL ([`renew_every`]), so two can fail
//! in a row before the lease lapses. A standby asks again after at most a third of the TTL
//! ([`standby_wait`]). [`LeaseKeeper`] holds these decisions for one run: the daemon's keeper
//! task executes it, the simulator drives it with a pause possible between a renewal's
//! question and its answer.
//!
//! # After an error
//! One rule decides ([`Restarts::after_error`]): an error that reconnecting cannot fix
//! (`transient == false`: a missing privilege, a slot moved past the ledger, a protocol
//! violation) stops the process with its message and fix; so does any error before the relay
//! ever streamed (misconfiguration fails fast instead of retrying forever), except in a standby
//! that took the lease over: the slot's holder is gone and this process is what keeps it
//! served, so a transient error of its first runs (a broker that answered late while the
//! machine was busy) is retried, up to [`TAKEOVER_TRIES`] times. Otherwise the relay
//! drops its in-memory state, waits, and replays from the last checkpoint. The wait starts
//! small and grows only while restarts fail: it doubles per run that never got going, up to a
//! maximum, and starts over after a run that reached streaming and streamed for
//! [`HEALTHY_RUN`]. An unclear delivery is not a reason for a new run at all: it holds only its
//! aggregate (`crate::pipeline::unclear`).
//!
//! # Before the first event
//! A run does the same things in the same order before it streams or polls ([`RunStart`]):
//! the attempt generations proven necessary by earlier runs are loaded, every open
//! DISPATCH_UNKNOWN attempt is reconciled, the gate's known heads are read again (the
//! reconciliation may have accepted receipts), and only then is the snapshot published. A CDC
//! run wraps that in the slot's own steps ([`CdcStart`]): refuse plain rows a new slot cannot
//! number, drop, create and record the slot, [`RunStart`]'s steps, take the slot over from a
//! walsender without the lease, fold the numbering log, then stream.

use std::time::Duration;

use outbox_core::Lsn;

use crate::pipeline::{AggKey, Mutant, PipelineCore, Plant, Shipped};

/// How long after sending a lease request (acquire or renew) the lease is certainly ours.
pub fn certain_for(ttl: Duration) -> Duration {
    ttl * 4 / 5
}

/// How often the lease keeper renews.
pub fn renew_every(ttl: Duration) -> Duration {
    ttl / 3
}

/// How long a standby waits before asking for the lease again, when its holder's lease has
/// `remaining` left.
pub fn standby_wait(remaining: Duration, ttl: Duration) -> Duration {
    remaining.min(ttl / 3).max(Duration::from_millis(50))
}

/// What a standby really waits: [`standby_wait`], at most [`EARLY_TAKEOVER_POLL`], so that a
/// holder that is provably gone (SIGKILLed: its session lock is free and its walsender has
/// left) is replaced that soon, not at expiry.
pub fn standby_poll(remaining: Duration, ttl: Duration) -> Duration {
    standby_wait(remaining, ttl).min(EARLY_TAKEOVER_POLL)
}

/// How often, at most, a standby asks for a lease that another relay holds.
pub const EARLY_TAKEOVER_POLL: Duration = Duration::from_millis(200);

/// What a lease renewal's answer said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The ledger extended the lease: it is certainly ours until [`certain_for`] after the
    /// renewal was *asked*.
    Renewed,
    /// The lease is not ours any more (another relay took it, or it expired): lost.
    Refused,
    /// The renewal failed (a network error, a timeout): nothing is known, the deadline is not
    /// extended. Two can fail in a row before the lease lapses.
    Failed,
}

/// The lease keeper's decisions for one run: when to renew, until when the lease is
/// certainly ours, and when it is lost. Pure: time is a [`Duration`] on the driver's monotonic
/// clock (the daemon's keeper task, the simulator's relay runs), which keeps counting while
/// the process is paused. The daemon's `spawn_lease_keeper` asks [`LeaseKeeper::renewal_due`]
/// and executes the renewal; the simulator drives the same keeper, with a pause possible
/// between a renewal's question and its answer.
///
/// The one rule that matters: a renewal's answer makes the lease certain from when the
/// renewal was *asked*, never from when its answer was read. A relay paused after the ledger
/// stamped the renewal and before it read the answer resumes with an answer that is as old as
/// the pause: counted from its reading, the relay would think the lease its own for a TTL that
/// ended while it was stopped, and send beside the relay that took the lease over.
#[derive(Debug, Clone)]
pub struct LeaseKeeper<P: Plant = Shipped> {
    ttl: Duration,
    deadline: Duration,
    next_renewal: Duration,
    /// A renewal asked and not yet answered: when it was asked.
    asked: Option<Duration>,
    /// The lease's session holds its advisory lock (migration 0018).
    locked: bool,
    lost: bool,
    plant: P,
}

impl LeaseKeeper<Shipped> {
    /// The keeper of a lease taken by a request sent at `asked` (`now` on the same clock),
    /// whose session holds the lease's lock if `locked`.
    pub fn new(ttl: Duration, asked: Duration, now: Duration, locked: bool) -> Self {
        LeaseKeeper::planted(ttl, asked, now, locked, Shipped)
    }
}

impl<P: Plant> LeaseKeeper<P> {
    /// [`LeaseKeeper::new`] with a mutant planted (the simulator's).
    pub fn planted(ttl: Duration, asked: Duration, now: Duration, locked: bool, plant: P) -> Self {
        LeaseKeeper {
            ttl,
            deadline: asked + certain_for(ttl),
            next_renewal: now + renew_every(ttl),
            asked: None,
            locked,
            lost: false,
            plant,
        }
    }

    /// Whether a renewal is due at `now` (every [`renew_every`], one at a time).
    pub fn renewal_due(&self, now: Duration) -> bool {
        !self.lost && self.asked.is_none() && now >= self.next_renewal
    }

    /// When the next renewal is due.
    pub fn next_renewal(&self) -> Duration {
        self.next_renewal
    }

    /// A renewal is asked at `now`. Returns whether the lease's session lock must be taken
    /// first: it was still held by an earlier holder's session when this relay took the
    /// lease, and once taken a standby may take the lease early if this relay dies.
    pub fn asking(&mut self, now: Duration) -> bool {
        self.asked = Some(now);
        self.next_renewal = now + renew_every(self.ttl);
        !self.locked
    }

    /// The session lock was taken (see [`LeaseKeeper::asking`]).
    pub fn lock_taken(&mut self) {
        self.locked = true;
    }

    /// The renewal asked last was answered, read at `now`.
    pub fn answered(&mut self, renewal: Renewal, now: Duration) {
        let Some(asked) = self.asked.take() else {
            return;
        };
        match renewal {
            Renewal::Renewed => {
                let from = if self.plant.planted(Mutant::LeaseFromAnswer) {
                    now
                } else {
                    asked
                };
                self.deadline = self.deadline.max(from + certain_for(self.ttl));
            }
            Renewal::Refused => self.lost = true,
            Renewal::Failed => {}
        }
    }

    /// The lease's session closed: its lock is free, so a standby may take the lease at once.
    pub fn session_closed(&mut self) {
        self.lost = true;
    }

    /// Whether the lease is certainly ours at `now`.
    pub fn valid(&self, now: Duration) -> bool {
        !self.lost && now < self.deadline
    }

    /// Until when the lease is certainly ours (if not lost).
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Whether the lease is known lost (refused at a renewal, or its session closed).
    pub fn is_lost(&self) -> bool {
        self.lost
    }
}

/// What a run that ended with an error leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterError {
    /// Reconnect after this pause and replay from the last checkpoint.
    Retry { after: Duration },
    /// Stop the process with the error.
    Stop,
}

/// The reconnect backoff across the runs of one process.
#[derive(Debug, Clone)]
pub struct Restarts {
    initial: Duration,
    max: Duration,
    next: Duration,
    streamed: bool,
    /// Transient errors a standby's takeover may still retry before it ever streamed
    /// (`None`: this process never waited as a standby).
    takeover_tries: Option<u32>,
}

/// Transient errors retried after a takeover before the first stream: a standby that took the
/// lease over is what keeps the slot served, and one late answer must not end it; a setting
/// that never works still stops it, after these tries.
pub const TAKEOVER_TRIES: u32 = 5;

/// A run that reached streaming and lasted at least this long was a restart that worked: the
/// next failure starts the backoff over.
pub const HEALTHY_RUN: Duration = Duration::from_secs(1);

/// The relay's longest reconnect backoff.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The relay's first reconnect backoff.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);

impl Restarts {
    /// The backoff of a relay's run loop (`outboxd run`, each shard of a fleet member):
    /// [`FIRST_BACKOFF`] doubling up to [`MAX_BACKOFF`].
    pub fn relay() -> Self {
        Restarts::new(FIRST_BACKOFF, MAX_BACKOFF)
    }

    pub fn new(initial: Duration, max: Duration) -> Self {
        Restarts {
            initial,
            max,
            next: initial,
            streamed: false,
            takeover_tries: None,
        }
    }

    /// This process waited as a standby and took the lease over.
    pub fn took_over(&mut self) {
        self.takeover_tries.get_or_insert(TAKEOVER_TRIES);
    }

    /// A run of this process held the lease and lost it (not renewed in time, or taken): as
    /// after a takeover, the slot's service is this process's to resume, and a renewal that
    /// came late is no misconfiguration to stop for, even before the first stream (a long
    /// initial snapshot). A setting that never works still stops it after
    /// [`TAKEOVER_TRIES`].
    pub fn lost_lease(&mut self) {
        self.takeover_tries.get_or_insert(TAKEOVER_TRIES);
    }

    /// A run started streaming.
    pub fn streaming(&mut self) {
        self.streamed = true;
    }

    /// Whether any run of this process has streamed.
    pub fn has_streamed(&self) -> bool {
        self.streamed
    }

    /// A run ended with an error; `transient` is the error policy's verdict, `streamed_for`
    /// how long this run lasted if it reached streaming (zero if it never did).
    pub fn after_error(&mut self, transient: bool, streamed_for: Duration) -> AfterError {
        if !transient {
            return AfterError::Stop;
        }
        if !self.streamed {
            match &mut self.takeover_tries {
                Some(left) if *left > 0 => *left -= 1,
                _ => return AfterError::Stop,
            }
        }
        AfterError::Retry {
            after: self.backoff(streamed_for),
        }
    }

    /// The pause before the next run, whatever ended this one: it doubles up to the maximum,
    /// and starts over after a run that streamed for [`HEALTHY_RUN`] (`streamed_for`).
    pub fn backoff(&mut self, streamed_for: Duration) -> Duration {
        if streamed_for >= HEALTHY_RUN {
            self.next = self.initial;
        }
        let after = self.next;
        self.next = (self.next * 2).min(self.max);
        after
    }
}

/// What a relay process does next across its runs ([`RunLoop`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopStep {
    /// Ask for the slot's lease.
    AskLease,
    /// Another relay holds the lease: wait this long, then ask again. `first`: the first wait
    /// of this acquisition (the process says once that it stands by).
    Standby { wait: Duration, first: bool },
    /// The lease is this process's: run.
    Run,
    /// The run ended with an error that reconnecting may fix: pause this long, then begin
    /// again ([`RunLoop::begin`]).
    Retry { after: Duration },
    /// Stop the process with the run's error.
    Stop,
}

/// What the lease's holder answered a request for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAnswer {
    Acquired,
    /// Another relay holds it, for `remaining` more if it does not renew.
    HeldBy {
        remaining: Duration,
    },
}

/// How a run that ended with an error ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunError {
    /// The error policy's verdict: reconnecting may fix it.
    pub transient: bool,
    /// The run lost its lease (not renewed in time, or taken).
    pub lease_lost: bool,
}

/// A relay process's runs, one after another (`outboxd run`, each shard relay of a fleet
/// member): ask for the lease, stand by while another relay holds it, run, and after a run
/// that ended with an error, reconnect after a pause or stop ([`Restarts`]). Pure, with no
/// clock of its own (the caller's `now`, any monotonic origin): the daemon's `relay::run` and
/// the simulator's fleet members drive it.
///
/// A run's health is measured from when it began streaming, not from when it asked for the
/// lease: a run that stood by for a minute and failed at once is a failed restart, and the
/// backoff grows.
#[derive(Debug, Clone)]
pub struct RunLoop {
    restarts: Restarts,
    ttl: Duration,
    /// This acquisition waited as a standby: the lease it gets is a takeover.
    waited: bool,
    /// When the current run began streaming.
    streaming_since: Option<Duration>,
}

impl RunLoop {
    /// The run loop of a relay whose lease lasts `ttl`, with the relay's backoff
    /// ([`Restarts::relay`]).
    pub fn relay(ttl: Duration) -> Self {
        RunLoop {
            restarts: Restarts::relay(),
            ttl,
            waited: false,
            streaming_since: None,
        }
    }

    /// A run is to begin (the process started, or a retry's pause is over): ask for the lease.
    pub fn begin(&mut self) -> LoopStep {
        self.waited = false;
        self.streaming_since = None;
        LoopStep::AskLease
    }

    /// The lease's request was answered: run, or stand by and ask again
    /// ([`standby_poll`]). A lease got after waiting is a takeover ([`Restarts::took_over`]).
    pub fn lease_answer(&mut self, answer: LeaseAnswer) -> LoopStep {
        match answer {
            LeaseAnswer::Acquired => {
                if self.waited {
                    self.restarts.took_over();
                }
                LoopStep::Run
            }
            LeaseAnswer::HeldBy { remaining } => {
                let first = !self.waited;
                self.waited = true;
                LoopStep::Standby {
                    wait: standby_poll(remaining, self.ttl),
                    first,
                }
            }
        }
    }

    /// The run began streaming (or polling) at `now`.
    pub fn streaming(&mut self, now: Duration) {
        self.restarts.streaming();
        self.streaming_since = Some(now);
    }

    /// The run ended at `now` with `error`: reconnect after a pause, or stop
    /// ([`Restarts::after_error`], with how long it streamed).
    pub fn ended(&mut self, now: Duration, error: RunError) -> LoopStep {
        if error.lease_lost {
            self.restarts.lost_lease();
        }
        let streamed_for = self
            .streaming_since
            .take()
            .map_or(Duration::ZERO, |since| now.saturating_sub(since));
        match self.restarts.after_error(error.transient, streamed_for) {
            AfterError::Retry { after } => LoopStep::Retry { after },
            AfterError::Stop => LoopStep::Stop,
        }
    }
}

/// What a run does next before its first event ([`RunStart::next`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartStep {
    /// Load the attempt generations of events whose every attempt was proven absent
    /// (`attempts::retry_generations`) into [`PipelineCore::retry_generation`]: their next send
    /// goes above them.
    RetryGenerations,
    /// Reconcile every open DISPATCH_UNKNOWN attempt ([`PipelineCore::reconcile`] with
    /// `When::Start`): nothing is looked up in line, each is handed to the run.
    ReconcileOpen,
    /// Read the ledger's heads of these aggregates (the held ones the gate knows) and raise
    /// the gate's ([`PipelineCore::raise_heads`]). After the reconciliation, which may have
    /// accepted the receipt of an event it found: a snapshot or a poll round skips published
    /// rows and would otherwise take the found event's version for a gap (found by outbox-sim,
    /// seed 1 trace 1380).
    RaiseHeads(Vec<AggKey>),
    /// Publish every outbox row without a receipt (a new or recreated slot, an adopted one).
    Snapshot,
    /// Stream (or poll): the run's start is over.
    Run,
}

/// The steps of a run's start, in order; the daemon's `reconcile_at_start` and the
/// simulator's `World::start_run` execute them.
#[derive(Debug, Clone)]
pub struct RunStart {
    done: u8,
    snapshot: bool,
}

impl RunStart {
    /// `snapshot`: the start-up plan asks for a snapshot (CDC with a backfill).
    pub fn new(snapshot: bool) -> Self {
        RunStart { done: 0, snapshot }
    }

    /// The next step, after the ones returned before were done.
    pub fn next<P: Plant>(&mut self, core: &PipelineCore<P>) -> StartStep {
        loop {
            self.done = self.done.saturating_add(1);
            return match self.done {
                1 => StartStep::RetryGenerations,
                2 => StartStep::ReconcileOpen,
                // The mutant of the bug's first half: heads read before the reconciliation only.
                3 if core.planted(Mutant::GapHoldStrandsQueue) => continue,
                3 => StartStep::RaiseHeads(core.known_aggregates()),
                4 if !self.snapshot => continue,
                4 => StartStep::Snapshot,
                _ => StartStep::Run,
            };
        }
    }
}

/// How to start, as the start-up plan (`outbox_source::slot::plan`, pure, from the slot and
/// the ledger as they are) decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartPlan {
    /// No slot and no history: create the slot with an exported snapshot, publish the
    /// snapshot, then stream from the consistent point.
    Create,
    /// Drop whatever is there (`drop_existing`: a slot of that name exists) and create
    /// afresh, then publish every row without a receipt (operator asked for `--resnapshot`).
    Recreate { drop_existing: bool },
    /// Stream from `start`. `backfill` asks for a snapshot publish first (the initial one
    /// never completed, or the slot was adopted); `adopt`: the ledger has no row for the slot,
    /// which the run writes first.
    Resume {
        start: Lsn,
        backfill: bool,
        adopt: bool,
    },
}

impl StartPlan {
    /// What the plan means for the slot, as a CDC run's start ([`CdcStart`]) executes it.
    pub fn slot_start(&self) -> SlotStart {
        match *self {
            StartPlan::Create => SlotStart::Create {
                drop_existing: false,
            },
            StartPlan::Recreate { drop_existing } => SlotStart::Create { drop_existing },
            StartPlan::Resume {
                backfill, adopt, ..
            } => SlotStart::Resume { adopt, backfill },
        }
    }

    /// Where the stream starts, if the plan knows it already (a slot to create has its
    /// position once created).
    pub fn start(&self) -> Option<Lsn> {
        match *self {
            StartPlan::Resume { start, .. } => Some(start),
            StartPlan::Create | StartPlan::Recreate { .. } => None,
        }
    }
}

/// What the start-up plan (`outbox_source::slot::plan`, pure) decided about the slot, as a CDC
/// run's start needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotStart {
    /// Create the slot and publish a snapshot of what it will not stream: the first run, or
    /// `--resnapshot` (`drop_existing`: a slot of that name is there and goes first).
    Create { drop_existing: bool },
    /// Stream from the slot's position. `adopt`: the ledger has no row for the slot yet (the
    /// slot was made by someone else); `backfill`: publish a snapshot first (the first one
    /// never finished, or the slot is adopted).
    Resume { adopt: bool, backfill: bool },
}

impl SlotStart {
    /// A snapshot is published before streaming.
    pub fn snapshot(self) -> bool {
        match self {
            SlotStart::Create { .. } => true,
            SlotStart::Resume { backfill, .. } => backfill,
        }
    }
}

/// What a CDC run does next before it streams ([`CdcStart::next`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CdcStep {
    /// Refuse to go on when the outbox takes plain INSERTs and already holds such a row: a
    /// new slot, an adopted one or an unfinished snapshot cannot continue their numbering,
    /// and a snapshot cannot read them in commit order (docs/versions_by_relay.md).
    RefusePlainRows,
    /// Drop the slot that is there (`--resnapshot`).
    DropSlot,
    /// Create the slot; its consistent point is where the run streams from, and its exported
    /// snapshot is what the snapshot reads.
    CreateSlot,
    /// Write the ledger's row that makes the slot this relay's, at the run's start position
    /// (a created slot's consistent point, an adopted slot's position).
    RecordSlot,
    /// One of [`RunStart`]'s steps, in its order; [`StartStep::Snapshot`] is published and
    /// then marked done in the ledger. [`StartStep::Run`] is never returned here.
    Start(StartStep),
    /// End any walsender still attached to the slot (a relay without the lease), checking
    /// the lease in the same statement.
    TakeOverSlot,
    /// Fold the numbering log of earlier runs (rows written without a version) into the map
    /// this run reads; refused when the checkpoint moved past the run's start since the plan.
    FoldNumbering,
    /// Start replication at the run's start position, check that the slot, now held, is not
    /// ahead of it, and stream: the start is over.
    Stream,
}

/// The steps of a CDC run's start, in order: the daemon's `run_once` and the simulator's
/// `World::start_relay` execute them (issue 26: the simulator had its own order, and folded
/// the numbering log before the snapshot where the daemon folds after it).
#[derive(Debug, Clone)]
pub struct CdcStart {
    slot: SlotStart,
    done: u8,
    run: RunStart,
}

impl CdcStart {
    pub fn new(slot: SlotStart) -> Self {
        CdcStart {
            slot,
            done: 0,
            run: RunStart::new(slot.snapshot()),
        }
    }

    /// The next step, after the ones returned before were done.
    pub fn next<P: Plant>(&mut self, core: &PipelineCore<P>) -> CdcStep {
        let (creates, drop_existing, adopt, backfill) = match self.slot {
            SlotStart::Create { drop_existing } => (true, drop_existing, false, true),
            SlotStart::Resume { adopt, backfill } => (false, false, adopt, backfill),
        };
        loop {
            self.done = self.done.saturating_add(1);
            return match self.done {
                1 if creates || adopt || backfill => CdcStep::RefusePlainRows,
                2 if drop_existing => CdcStep::DropSlot,
                3 if creates => CdcStep::CreateSlot,
                4 if creates || adopt => CdcStep::RecordSlot,
                5 => match self.run.next(core) {
                    StartStep::Run => continue,
                    step => {
                        // The run's start is not over: ask it again next time.
                        self.done -= 1;
                        CdcStep::Start(step)
                    }
                },
                6 => CdcStep::TakeOverSlot,
                7 if core.planted(Mutant::NumberingLogNotFolded) => continue,
                7 => CdcStep::FoldNumbering,
                1..=4 => continue,
                _ => CdcStep::Stream,
            };
        }
    }
}

impl CdcStart {
    /// After [`CdcStep::Stream`]'s `START_REPLICATION`, the slot's confirmed position read
    /// again (`confirmed`; `None`: not read, or no slot). The plan read the slot before the
    /// run's walsender held it, and PostgreSQL streams from the later of the requested
    /// position and the slot's own: a slot dropped and recreated under the same name in
    /// between (a relay that lost the lease finishing its `--resnapshot`; seen in CI) would
    /// stream from its own, later position and skip what lies between. Now that this run
    /// holds the slot nobody can drop it, and nothing has confirmed anything yet, so a slot
    /// past `start` was replaced: `Err` with its position, which needs an operator
    /// (`--resnapshot`), never a skip.
    pub fn check_held<P: Plant>(
        &self,
        core: &PipelineCore<P>,
        start: Lsn,
        confirmed: Option<Lsn>,
    ) -> Result<(), Lsn> {
        match confirmed {
            Some(slot) if slot > start && !core.planted(Mutant::HeldSlotUnchecked) => Err(slot),
            _ => Ok(()),
        }
    }
}

/// How a run ends ([`RunEnd`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Something ended it (the lease lost, the stream broken, an error): the answers the
    /// broker already gave are evidence worth keeping, so they are recorded, within a grace
    /// period; nothing more is sent and the checkpoint does not move (the run may no longer
    /// hold the lease).
    Salvage,
    /// An operator asked it to stop: outstanding reports are awaited within a bound, the last
    /// batch is accepted with its checkpoint, and the slot is confirmed up to it.
    Stop,
}

/// How long a salvage waits for the reports of what is still at the broker: the run ended
/// for a reason, and a successor may be waiting for its lease.
pub const SALVAGE_GRACE: Duration = Duration::from_secs(2);

/// The most a stop waits for outstanding reports, whatever the sink's own timeout: an
/// operator's stop (or a fleet member's hand-over) must end promptly; what is left is sent
/// again by the next run.
pub const STOP_DRAIN_MAX: Duration = Duration::from_secs(10);

impl Ending {
    /// How long the run waits for outstanding delivery reports (its grace, then
    /// [`RunEnd::grace_over`]): a salvage [`SALVAGE_GRACE`], a stop the sink's timeout for
    /// an answer (`ack_timeout`) up to [`STOP_DRAIN_MAX`].
    pub fn grace(self, ack_timeout: Duration) -> Duration {
        match self {
            Ending::Salvage => SALVAGE_GRACE,
            Ending::Stop => ack_timeout.min(STOP_DRAIN_MAX),
        }
    }
}

/// What an ending run does next ([`RunEnd::next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndStep {
    /// Wait for one delivery report and hand it to the core, unless the grace period is over
    /// (then tell [`RunEnd::grace_over`]).
    AwaitReport,
    /// Accept the batch; with its checkpoint when `track`.
    Accept { track: bool },
    /// Send the standby status that confirms the durable checkpoint to the slot.
    Confirm,
    /// The run is over.
    Done,
}

/// The end of a run, in the order the daemon (`salvage_after`, `drain_and_stop`) and the
/// simulator (`World::salvage`) execute it.
#[derive(Debug, Clone)]
pub struct RunEnd {
    ending: Ending,
    grace_over: bool,
    accepted: bool,
    confirmed: bool,
}

impl RunEnd {
    /// Begins ending a run as `ending` says; a salvage tells the core, which then sends
    /// nothing more.
    pub fn new<P: Plant>(ending: Ending, core: &mut PipelineCore<P>) -> Self {
        if ending == Ending::Salvage {
            core.begin_salvage();
        }
        RunEnd {
            ending,
            grace_over: false,
            accepted: false,
            confirmed: false,
        }
    }

    /// The time allowed for outstanding reports is over (or no report can come any more):
    /// what is still in flight stays unrecorded, and the next run sends it again.
    pub fn grace_over(&mut self) {
        self.grace_over = true;
    }

    /// The next step, after the ones returned before were done.
    pub fn next<P: Plant>(&mut self, core: &PipelineCore<P>) -> EndStep {
        if !self.grace_over && core.in_flight() > 0 {
            return EndStep::AwaitReport;
        }
        if !self.accepted {
            self.accepted = true;
            return EndStep::Accept {
                track: self.ending == Ending::Stop,
            };
        }
        if self.ending == Ending::Stop && !self.confirmed {
            self.confirmed = true;
            return EndStep::Confirm;
        }
        EndStep::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::Planted;
    use crate::testing::served;

    #[test]
    fn a_plan_to_create_has_no_start_until_the_slot_exists_and_a_resume_starts_where_planned() {
        assert_eq!(
            StartPlan::Create.slot_start(),
            SlotStart::Create {
                drop_existing: false
            }
        );
        let again = StartPlan::Recreate {
            drop_existing: true,
        };
        assert_eq!(
            again.slot_start(),
            SlotStart::Create {
                drop_existing: true
            }
        );
        assert_eq!((StartPlan::Create.start(), again.start()), (None, None));
        let resume = StartPlan::Resume {
            start: Lsn(40),
            backfill: true,
            adopt: false,
        };
        assert_eq!(
            resume.slot_start(),
            SlotStart::Resume {
                adopt: false,
                backfill: true
            }
        );
        assert_eq!(resume.start(), Some(Lsn(40)));
    }

    #[test]
    fn a_salvage_waits_its_own_grace_and_a_stop_the_sinks_timeout_up_to_a_bound() {
        assert_eq!(Ending::Salvage.grace(ms(60_000)), SALVAGE_GRACE);
        assert_eq!(Ending::Stop.grace(ms(3_000)), ms(3_000));
        assert_eq!(Ending::Stop.grace(ms(60_000)), STOP_DRAIN_MAX);
    }

    #[test]
    fn the_lease_keeper_renews_every_third_of_the_ttl_and_counts_from_the_question() {
        let ttl = ms(3_000);
        // Taken by a request asked at 0, the keeper started at 10.
        let mut k = LeaseKeeper::new(ttl, ms(0), ms(10), true);
        assert_eq!(k.deadline(), ms(2_400));
        assert!(k.valid(ms(2_399)) && !k.valid(ms(2_400)));
        assert!(!k.renewal_due(ms(1_009)));
        assert!(k.renewal_due(ms(1_010)));
        assert!(!k.asking(ms(1_010)), "the lock is held: nothing to take");
        assert!(!k.renewal_due(ms(5_000)), "one renewal at a time");
        // Answered much later (the process was paused between): certain from the question.
        k.answered(Renewal::Renewed, ms(4_000));
        assert_eq!(k.deadline(), ms(1_010 + 2_400));
        assert!(!k.valid(ms(4_000)));
        assert_eq!(k.next_renewal(), ms(2_010));
        // A failed renewal extends nothing and loses nothing.
        k.asking(ms(4_000));
        k.answered(Renewal::Failed, ms(4_001));
        assert_eq!(k.deadline(), ms(3_410));
        assert!(!k.is_lost());
        // A refused one loses the lease, whatever the deadline says.
        k.asking(ms(5_000));
        k.answered(Renewal::Renewed, ms(5_001));
        assert!(k.valid(ms(5_002)));
        k.asking(ms(6_000));
        k.answered(Renewal::Refused, ms(6_001));
        assert!(k.is_lost() && !k.valid(ms(6_002)));
        assert!(!k.renewal_due(ms(9_000)), "a lost lease is not renewed");
    }

    #[test]
    fn the_lease_keeper_takes_the_lock_it_did_not_get_and_a_closed_session_loses_the_lease() {
        let mut k = LeaseKeeper::new(ms(3_000), ms(0), ms(0), false);
        assert!(k.asking(ms(1_000)), "take the lock first");
        k.lock_taken();
        k.answered(Renewal::Renewed, ms(1_001));
        assert!(!k.asking(ms(2_000)));
        k.session_closed();
        assert!(!k.valid(ms(2_001)));
    }

    #[test]
    fn the_planted_keeper_counts_from_the_answer() {
        let plant = Planted {
            mutant: Some(Mutant::LeaseFromAnswer),
            ..Planted::default()
        };
        let mut k = LeaseKeeper::planted(ms(3_000), ms(0), ms(0), true, plant);
        k.asking(ms(1_000));
        k.answered(Renewal::Renewed, ms(4_000));
        assert!(
            k.valid(ms(6_000)),
            "the mutant's lease outlives the ledger's"
        );
    }

    /// The steps `next` returns, up to and including `last`.
    fn until<S: Clone + PartialEq + std::fmt::Debug>(
        mut next: impl FnMut() -> S,
        last: S,
    ) -> Vec<S> {
        let mut steps = Vec::new();
        loop {
            let step = next();
            steps.push(step.clone());
            if step == last {
                return steps;
            }
            assert!(steps.len() < 20, "the start never ends: {steps:?}");
        }
    }

    fn steps<P: Plant>(core: &PipelineCore<P>, snapshot: bool) -> Vec<StartStep> {
        let mut start = RunStart::new(snapshot);
        until(|| start.next(core), StartStep::Run)
    }

    #[test]
    fn a_run_reads_the_known_heads_after_reconciling_and_before_its_snapshot() {
        let held: AggKey = ("order".into(), "7".into());
        let gate = || PipelineCore::gate_from(Vec::new(), vec![held.clone()]);
        let core = PipelineCore::new(served(), 3, gate());
        use StartStep::*;
        assert_eq!(
            steps(&core, true),
            vec![
                RetryGenerations,
                ReconcileOpen,
                RaiseHeads(vec![held.clone()]),
                Snapshot,
                Run
            ]
        );
        assert_eq!(
            steps(&core, false),
            vec![
                RetryGenerations,
                ReconcileOpen,
                RaiseHeads(vec![held.clone()]),
                Run
            ]
        );
        // The product before outbox-sim found it: no heads read after the reconciliation.
        let planted = Planted {
            mutant: Some(Mutant::GapHoldStrandsQueue),
            current_route: None,
        };
        let bug = PipelineCore::with_plant(served(), 3, gate(), planted);
        assert_eq!(
            steps(&bug, true),
            vec![RetryGenerations, ReconcileOpen, Snapshot, Run]
        );
    }

    fn cdc_steps<P: Plant>(core: &PipelineCore<P>, slot: SlotStart) -> Vec<CdcStep> {
        let mut start = CdcStart::new(slot);
        until(|| start.next(core), CdcStep::Stream)
    }

    #[test]
    fn a_cdc_run_records_its_slot_before_reconciling_and_folds_the_numbering_after_its_snapshot() {
        let core = PipelineCore::new(served(), 3, PipelineCore::gate_from(Vec::new(), Vec::new()));
        use CdcStep::*;
        use StartStep::*;
        let after_slot = |snapshot: bool| {
            let mut v = vec![
                Start(RetryGenerations),
                Start(ReconcileOpen),
                Start(RaiseHeads(Vec::new())),
            ];
            if snapshot {
                v.push(Start(Snapshot));
            }
            v.extend([TakeOverSlot, FoldNumbering, Stream]);
            v
        };
        let with = |head: Vec<CdcStep>, snapshot: bool| {
            let mut v = head;
            v.extend(after_slot(snapshot));
            v
        };
        assert_eq!(
            cdc_steps(
                &core,
                SlotStart::Create {
                    drop_existing: false
                }
            ),
            with(vec![RefusePlainRows, CreateSlot, RecordSlot], true)
        );
        assert_eq!(
            cdc_steps(
                &core,
                SlotStart::Create {
                    drop_existing: true
                }
            ),
            with(
                vec![RefusePlainRows, DropSlot, CreateSlot, RecordSlot],
                true
            )
        );
        assert_eq!(
            cdc_steps(
                &core,
                SlotStart::Resume {
                    adopt: true,
                    backfill: true
                }
            ),
            with(vec![RefusePlainRows, RecordSlot], true)
        );
        assert_eq!(
            cdc_steps(
                &core,
                SlotStart::Resume {
                    adopt: false,
                    backfill: true
                }
            ),
            with(vec![RefusePlainRows], true)
        );
        // An ordinary restart: nothing about the slot, no snapshot.
        assert_eq!(
            cdc_steps(
                &core,
                SlotStart::Resume {
                    adopt: false,
                    backfill: false
                }
            ),
            after_slot(false)
        );
        // The planted bug: no fold of the numbering log.
        let planted = Planted {
            mutant: Some(Mutant::NumberingLogNotFolded),
            current_route: None,
        };
        let bug = PipelineCore::with_plant(
            served(),
            3,
            PipelineCore::gate_from(Vec::new(), Vec::new()),
            planted,
        );
        let steps = cdc_steps(
            &bug,
            SlotStart::Resume {
                adopt: false,
                backfill: false,
            },
        );
        assert!(!steps.contains(&FoldNumbering), "{steps:?}");
    }

    #[test]
    fn a_held_slot_past_the_start_was_replaced_and_is_refused() {
        let gate = || PipelineCore::gate_from(Vec::new(), Vec::new());
        let core = PipelineCore::new(served(), 3, gate());
        let start = CdcStart::new(SlotStart::Resume {
            adopt: false,
            backfill: false,
        });
        let at = Lsn(0x200);
        assert_eq!(start.check_held(&core, at, Some(Lsn(0x100))), Ok(()));
        assert_eq!(start.check_held(&core, at, Some(at)), Ok(()));
        assert_eq!(start.check_held(&core, at, None), Ok(()));
        assert_eq!(
            start.check_held(&core, at, Some(Lsn(0x201))),
            Err(Lsn(0x201))
        );
        let planted = Planted {
            mutant: Some(Mutant::HeldSlotUnchecked),
            current_route: None,
        };
        let bug = PipelineCore::with_plant(served(), 3, gate(), planted);
        assert_eq!(start.check_held(&bug, at, Some(Lsn(0x201))), Ok(()));
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_lease_is_certain_for_less_than_its_ttl_and_renewed_three_times_per_ttl() {
        assert_eq!(certain_for(ms(9_000)), ms(7_200));
        assert_eq!(renew_every(ms(9_000)), ms(3_000));
        assert!(
            renew_every(ms(300)) * 2 < certain_for(ms(300)),
            "two renewals may fail"
        );
    }

    #[test]
    fn a_standby_asks_again_within_a_third_of_the_ttl_but_not_in_a_busy_loop() {
        assert_eq!(standby_wait(ms(8_000), ms(9_000)), ms(3_000));
        assert_eq!(standby_wait(ms(1_000), ms(9_000)), ms(1_000));
        assert_eq!(standby_wait(ms(0), ms(9_000)), ms(50));
    }

    #[test]
    fn a_run_loop_stands_by_takes_over_and_measures_health_from_the_stream() {
        let mut life = RunLoop::relay(ms(9_000));
        assert_eq!(life.begin(), LoopStep::AskLease);
        let held = LeaseAnswer::HeldBy {
            remaining: ms(5_000),
        };
        let wait = EARLY_TAKEOVER_POLL;
        assert_eq!(
            life.lease_answer(held),
            LoopStep::Standby { wait, first: true }
        );
        assert_eq!(
            life.lease_answer(held),
            LoopStep::Standby { wait, first: false }
        );
        assert_eq!(life.lease_answer(LeaseAnswer::Acquired), LoopStep::Run);
        // A takeover: a transient error before the first stream is retried.
        let transient = RunError {
            transient: true,
            lease_lost: false,
        };
        assert_eq!(
            life.ended(ms(60_000), transient),
            LoopStep::Retry {
                after: FIRST_BACKOFF
            }
        );
        // Streamed from 70 s, ended at 70.5 s after standing by since 61 s: not a healthy run
        // (it streamed for half a second), so the backoff grows.
        assert_eq!(life.begin(), LoopStep::AskLease);
        assert_eq!(life.lease_answer(LeaseAnswer::Acquired), LoopStep::Run);
        life.streaming(ms(70_000));
        assert_eq!(
            life.ended(ms(70_500), transient),
            LoopStep::Retry {
                after: FIRST_BACKOFF * 2
            }
        );
        // A run that streamed for HEALTHY_RUN starts the backoff over.
        life.begin();
        life.lease_answer(LeaseAnswer::Acquired);
        life.streaming(ms(80_000));
        assert_eq!(
            life.ended(ms(80_000) + HEALTHY_RUN, transient),
            LoopStep::Retry {
                after: FIRST_BACKOFF
            }
        );
        let fatal = RunError {
            transient: false,
            lease_lost: false,
        };
        assert_eq!(life.ended(ms(90_000), fatal), LoopStep::Stop);
    }

    #[test]
    fn a_first_run_that_never_streamed_stops_unless_it_lost_its_lease() {
        let transient = |lease_lost| RunError {
            transient: true,
            lease_lost,
        };
        let mut life = RunLoop::relay(ms(9_000));
        life.begin();
        life.lease_answer(LeaseAnswer::Acquired);
        assert_eq!(life.ended(ms(10), transient(false)), LoopStep::Stop);
        let mut life = RunLoop::relay(ms(9_000));
        life.begin();
        life.lease_answer(LeaseAnswer::Acquired);
        assert_eq!(
            life.ended(ms(10), transient(true)),
            LoopStep::Retry {
                after: FIRST_BACKOFF
            }
        );
    }

    #[test]
    fn an_error_before_the_first_stream_or_a_fatal_one_stops_the_process() {
        let mut r = Restarts::new(ms(100), ms(5_000));
        assert_eq!(
            r.after_error(true, ms(0)),
            AfterError::Stop,
            "never streamed"
        );
        r.streaming();
        assert_eq!(r.after_error(false, ms(1_000)), AfterError::Stop, "fatal");
    }

    #[test]
    fn transient_errors_back_off_doubling_to_the_maximum_and_a_healthy_run_resets_it() {
        let mut r = Restarts::new(ms(100), ms(500));
        r.streaming();
        let waits: Vec<_> = (0..5).map(|_| r.after_error(true, ms(10))).collect();
        let ms_of = |a: &AfterError| match a {
            AfterError::Retry { after } => after.as_millis(),
            AfterError::Stop => panic!("stopped"),
        };
        assert_eq!(
            waits.iter().map(ms_of).collect::<Vec<_>>(),
            [100, 200, 400, 500, 500]
        );
        assert_eq!(ms_of(&r.after_error(true, HEALTHY_RUN)), 100);
        assert_eq!(
            ms_of(&r.after_error(true, ms(0))),
            200,
            "grows again while restarts fail"
        );
    }

    #[test]
    fn a_takeover_retries_a_few_transient_errors_before_it_streams_a_start_does_not() {
        let mut start = Restarts::new(ms(100), ms(1_000));
        assert_eq!(start.after_error(true, ms(0)), AfterError::Stop);

        let mut standby = Restarts::new(ms(100), ms(1_000));
        standby.took_over();
        let tries: Vec<_> = (0..TAKEOVER_TRIES + 1)
            .map(|_| standby.after_error(true, ms(0)))
            .collect();
        assert!(tries[..TAKEOVER_TRIES as usize]
            .iter()
            .all(|t| matches!(t, AfterError::Retry { .. })));
        assert_eq!(tries[TAKEOVER_TRIES as usize], AfterError::Stop, "bounded");
        // A fatal error stops a takeover at once; a second takeover grants no new tries.
        let mut fatal = Restarts::new(ms(100), ms(1_000));
        fatal.took_over();
        assert_eq!(fatal.after_error(false, ms(0)), AfterError::Stop);
        standby.took_over();
        assert_eq!(standby.after_error(true, ms(0)), AfterError::Stop);
        // A start that lost its lease during its initial snapshot retries as a takeover does.
        let mut lapsed = Restarts::new(ms(100), ms(1_000));
        lapsed.lost_lease();
        assert!(matches!(
            lapsed.after_error(true, ms(0)),
            AfterError::Retry { .. }
        ));
    }

    #[test]
    fn a_salvage_records_reports_within_its_grace_and_never_moves_the_checkpoint() {
        let mut c = crate::testing::core();
        let sent = crate::testing::admit_txn(&mut c, &[crate::testing::event("a", 1)], 10);
        let mut end = RunEnd::new(Ending::Salvage, &mut c);
        assert_eq!(end.next(&c), EndStep::AwaitReport);
        c.on_report(
            crate::testing::persisted(crate::testing::token(&sent[0]), 0),
            crate::testing::now(0),
        )
        .unwrap();
        assert_eq!(end.next(&c), EndStep::Accept { track: false });
        assert_eq!(end.next(&c), EndStep::Done, "a salvage confirms nothing");
    }

    #[test]
    fn a_stop_past_its_grace_accepts_with_the_checkpoint_and_confirms() {
        let mut c = crate::testing::core();
        crate::testing::admit_txn(&mut c, &[crate::testing::event("a", 1)], 10);
        let mut end = RunEnd::new(Ending::Stop, &mut c);
        assert_eq!(end.next(&c), EndStep::AwaitReport);
        end.grace_over();
        assert_eq!(end.next(&c), EndStep::Accept { track: true });
        assert_eq!(end.next(&c), EndStep::Confirm);
        assert_eq!(end.next(&c), EndStep::Done);
    }
}
