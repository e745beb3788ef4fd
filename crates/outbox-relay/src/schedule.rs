//! When the relay's loop does what — read the slot or hold back, take a batch for acceptance,
//! write an idle checkpoint, poll operator releases, send a standby status — and what that
//! standby status says.
//!
//! Pure: time is a [`Duration`] since the run started, given by the driver, so the same
//! decisions run under unit tests and a simulator. The daemon's loop (`relay/mod.rs`) asks
//! [`Schedule::can_read`] and [`Schedule::next_wakeup`] before it waits, and [`Schedule::due`]
//! after anything happened, and does what it is told.

use std::time::Duration;

use outbox_core::Lsn;

use crate::pipeline::PipelineCore;
use crate::plant::{Mutant, Plant, Shipped};

/// The loop's settings (`outboxd run` flags).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// How often a standby status is sent, and an idle checkpoint written, at most.
    pub status_interval: Duration,
    /// How long the first item of a batch waits for company before the batch is accepted.
    pub batch_linger: Duration,
    /// When the slot is not read, and a batch is accepted at once.
    pub bounds: Bounds,
    /// How often operator releases (and UNKNOWN attempts of other generations) are polled.
    pub release_poll: Duration,
}

/// What the relay keeps within, in the stream loop ([`Schedule::can_read`]) and in a read
/// outside it (`crate::pace`): `relay.max_in_flight`, `relay.unclear_max_waiting` with
/// [`crate::MAX_WAITING_BYTES`], `relay.batch_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Events read and not yet resolved, beyond which nothing more is read; those waiting on
    /// an unclear outcome are not counted ([`Load::waiting_on_unclear`]).
    pub max_in_flight: u64,
    /// Events waiting on unclear outcomes, and their payload bytes, beyond which nothing more
    /// is read: they hold only their aggregates, but each is kept in memory until its
    /// aggregate moves again.
    pub max_waiting: Waiting,
    /// A batch this long is accepted at once.
    pub batch_size: usize,
    /// Payload bytes sent and not yet reported on, beyond which the slot is not read.
    pub max_in_flight_bytes: usize,
}

impl Bounds {
    /// Whether the loop may read the slot, given `load`: fewer than `max_in_flight` events
    /// unresolved besides those waiting on unclear outcomes, fewer of those than their own
    /// bound, and less than `max_in_flight_bytes` at the broker ([`Schedule::can_read`]).
    pub fn can_read(&self, load: &Load) -> bool {
        within_bounds(
            self.max_in_flight,
            self.max_waiting,
            load.unresolved,
            load.waiting_on_unclear,
        ) && load.in_flight_bytes < self.max_in_flight_bytes
    }
}

/// What the pipeline looks like now.
#[derive(Debug, Clone, Copy, Default)]
pub struct Load {
    /// An acceptance transaction is running: the next batch waits for it (and grows).
    pub accepting: bool,
    pub batch_len: usize,
    /// When the batch got its first item.
    pub batch_started: Option<Duration>,
    /// The ack tracker's watermark is ahead of the durable checkpoint.
    pub checkpoint_behind: bool,
    /// Events read and not yet resolved (the ack tracker's count).
    pub unresolved: u64,
    /// Of those, the events waiting on unclear outcomes (`PipelineCore::waiting_on_unclear`:
    /// parked, sent and unanswered, and queued behind either). A driver may leave it 0 where
    /// [`waiting_matters`] says it cannot change a decision.
    pub waiting_on_unclear: Waiting,
    /// Payload bytes sent and not yet reported on.
    pub in_flight_bytes: usize,
    /// The stream is inside a transaction (between Begin and Commit).
    pub in_transaction: bool,
}

pub use crate::contract::Waiting;

/// How long a count of the events waiting on unclear outcomes serves the bounds
/// (`PipelineCore::waiting_sampled`): counting walks the in-flight table (3,000 entries at the
/// default `max_in_flight`), which a wide drain at that bound would otherwise do at every turn
/// of the loop.
pub const WAITING_SAMPLE: Duration = Duration::from_millis(20);

/// What is due now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Due {
    /// Take the batch (or the idle checkpoint) for acceptance.
    pub accept: bool,
    /// Poll operator releases and settled UNKNOWN attempts.
    pub releases: bool,
    /// Send a standby status ([`standby_status`]).
    pub status: bool,
}

/// One step of what the loop does after anything happened ([`Due::steps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnStep {
    /// Take the batch (or the idle checkpoint) for acceptance.
    Accept,
    /// End the run if the lease is no longer certainly held: before anything more is read
    /// or republished.
    CheckLease,
    /// Poll operator releases and settled UNKNOWN attempts.
    Releases,
    /// Send a standby status.
    Status,
}

impl Due {
    /// What the loop does after anything happened, in order: the batch first (what it accepts
    /// may let the status confirm further), the lease checked every turn, then the releases
    /// (which send), then the status. A step that ends the run ends the turn.
    pub fn steps(self) -> impl Iterator<Item = TurnStep> {
        [
            (self.accept, TurnStep::Accept),
            (true, TurnStep::CheckLease),
            (self.releases, TurnStep::Releases),
            (self.status, TurnStep::Status),
        ]
        .into_iter()
        .filter_map(|(due, step)| due.then_some(step))
    }
}

/// What the driver says in its log about reading the slot ([`Schedule::held_notice`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldNotice {
    /// The slot is not read because of what waits on unclear outcomes: every aggregate waits
    /// until some move (a warning: fix the destination or raise the bound).
    NotRead,
    /// Reading again, after a [`HeldNotice::NotRead`].
    ReadingAgain,
}

/// At the bound, reading stops and starts again as single events move: the warning is said at
/// most this often.
pub const HELD_WARNING_EVERY: Duration = Duration::from_secs(60);

/// The loop's timers. The daemon's is a `Schedule<Shipped>`; the simulator's relay runs
/// drive a `Schedule<Planted>`, which may plant a mutant.
#[derive(Debug, Clone)]
pub struct Schedule<P: Plant = Shipped> {
    settings: Settings,
    last_status: Duration,
    last_checkpoint_write: Duration,
    last_release_poll: Duration,
    status_now: bool,
    /// Reading is held by what waits on unclear outcomes (as last looked at).
    held: bool,
    /// When [`HeldNotice::NotRead`] was said last, and whether it was said for this episode.
    held_warned: Option<Duration>,
    episode_warned: bool,
    plant: P,
}

/// A standby status is sent right after an acceptance moved the checkpoint, unless one went
/// out less than this long ago (the periodic one follows soon enough).
const STATUS_AFTER_ACCEPT_MIN: Duration = Duration::from_millis(100);

impl Schedule<Shipped> {
    /// A run that starts at `now` sends a standby status at once.
    pub fn new(settings: Settings, now: Duration) -> Self {
        Schedule::planted(settings, now, Shipped)
    }
}

impl<P: Plant> Schedule<P> {
    /// [`Schedule::new`] with a mutant planted (the simulator's).
    pub fn planted(settings: Settings, now: Duration, plant: P) -> Self {
        Schedule {
            settings,
            last_status: now,
            last_checkpoint_write: now,
            last_release_poll: now,
            status_now: true,
            held: false,
            held_warned: None,
            episode_warned: false,
            plant,
        }
    }

    /// What to say in the log about reading the slot at `now`, given the loop's `load`: that
    /// what waits on unclear outcomes stops it ([`Schedule::can_read`] says no, and
    /// [`Schedule::reading_held_by_unclear`] says why; once per [`HELD_WARNING_EVERY`] at
    /// most), and that it reads again after a warning.
    pub fn held_notice(&mut self, now: Duration, load: &Load) -> Option<HeldNotice> {
        let held = !self.can_read(load) && self.reading_held_by_unclear(load);
        let was = std::mem::replace(&mut self.held, held);
        if held && !was {
            self.episode_warned = self
                .held_warned
                .map_or(true, |at| now.saturating_sub(at) >= HELD_WARNING_EVERY);
            if self.episode_warned {
                self.held_warned = Some(now);
                return Some(HeldNotice::NotRead);
            }
        } else if !held && was && self.episode_warned {
            return Some(HeldNotice::ReadingAgain);
        }
        None
    }

    /// Backpressure: stop reading the slot while too much is unresolved or in flight;
    /// reports, acceptance and status updates keep flowing meanwhile. What waits on an
    /// unclear outcome holds only its aggregate, and has a bound of its own: a handler that
    /// is down for one aggregate whose events keep coming must not stop every other
    /// aggregate once `max_in_flight` of them are read (an unclear outcome holds one
    /// aggregate, never the relay).
    pub fn can_read(&self, load: &Load) -> bool {
        self.settings.bounds.can_read(load)
    }

    /// Whether the events waiting on unclear outcomes are what stops the slot being read
    /// (the driver says so in its log: raise the bound, or fix the destination).
    pub fn reading_held_by_unclear(&self, load: &Load) -> bool {
        !waiting_within(
            self.settings.bounds.max_waiting,
            load.unresolved,
            load.waiting_on_unclear,
        )
    }

    /// When the loop must wake up even if nothing arrives: the periodic status, the batch
    /// linger, the idle checkpoint write.
    pub fn next_wakeup(&self, load: &Load) -> Duration {
        let mut at = self.last_status + self.settings.status_interval;
        if let Some(b) = load.batch_started.filter(|_| !load.accepting) {
            at = at.min(b + self.settings.batch_linger);
        }
        if load.checkpoint_behind && !load.accepting {
            at = at.min(self.last_checkpoint_write + self.settings.status_interval);
        }
        at
    }

    /// The server asked for a reply (a keepalive with `reply_requested`).
    pub fn status_requested(&mut self) {
        self.status_now = true;
    }

    /// An acceptance transaction committed; `moved` says whether it moved the checkpoint.
    pub fn accepted(&mut self, now: Duration, moved: bool) {
        if moved && now.saturating_sub(self.last_status) >= STATUS_AFTER_ACCEPT_MIN {
            self.status_now = true;
        }
    }

    /// What is due at `now`; the timers of what is due restart from `now`.
    pub fn due(&mut self, now: Duration, load: &Load) -> Due {
        let batch_due = !load.accepting
            && (load.batch_len >= self.settings.bounds.batch_size
                || load
                    .batch_started
                    .is_some_and(|b| now >= b + self.settings.batch_linger));
        // The idle checkpoint: what the stream resolved without a batch (a keepalive past the
        // last transaction, transactions without outbox rows) is written, so that the slot
        // can be confirmed past it and the server can recycle its WAL while the outbox is
        // quiet and the rest of the database is not.
        let idle_due = !self.plant.planted(Mutant::IdleCheckpointNeverDue)
            && !load.accepting
            && load.batch_len == 0
            && load.checkpoint_behind
            && now >= self.last_checkpoint_write + self.settings.status_interval;
        let due = Due {
            accept: batch_due || idle_due,
            // Releases republish whole aggregates: never in the middle of a transaction.
            releases: !load.in_transaction
                && now >= self.last_release_poll + self.settings.release_poll,
            status: self.status_now || now >= self.last_status + self.settings.status_interval,
        };
        if due.accept {
            self.last_checkpoint_write = now;
        }
        if due.releases {
            self.last_release_poll = now;
        }
        if due.status {
            self.last_status = now;
            self.status_now = false;
        }
        due
    }
}

/// Whether `unresolved` events, `waiting` of which wait on unclear outcomes, leave room to
/// read more: fewer than `max_in_flight` others, fewer waiting than `max_waiting` (events and
/// payload bytes). The rule of [`Schedule::can_read`], for readers outside the stream's loop
/// too (the initial snapshot, a poll round).
pub fn within_bounds(
    max_in_flight: u64,
    max_waiting: Waiting,
    unresolved: u64,
    waiting: Waiting,
) -> bool {
    unresolved - waiting.events.min(unresolved) < max_in_flight
        && waiting_within(max_waiting, unresolved, waiting)
}

/// Whether what waits on unclear outcomes, of `unresolved` events, is within its own bounds.
fn waiting_within(max: Waiting, unresolved: u64, waiting: Waiting) -> bool {
    waiting.events.min(unresolved) < max.events && waiting.bytes < max.bytes
}

/// Whether the count of events waiting on unclear outcomes can change what
/// [`within_bounds`] decides for `unresolved` events: only from the smaller of the two
/// event bounds on. Below it every event may be read whatever waits, as before waiting events
/// had bounds of their own (their bytes among them: below `max_in_flight` the relay never
/// bounded the bytes of events queued behind their aggregates). Counting walks the parked,
/// in-flight and queued events, so a driver counts only then.
pub fn waiting_matters(max_in_flight: u64, max_waiting: Waiting, unresolved: u64) -> bool {
    unresolved >= max_in_flight.min(max_waiting.events)
}

/// A standby status update: the positions the relay reports to the walsender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbyStatus {
    pub write: Lsn,
    pub flush: Lsn,
    pub apply: Lsn,
}

/// The one rule for what the relay confirms to the slot.
///
/// PostgreSQL moves the slot's `confirmed_flush_lsn` to the `flush` position a standby status
/// reports, and from then on never sends a transaction that committed before it again. So
/// `flush` (and `apply`) is `durable`: the checkpoint the ledger has *committed*, which is the
/// ack tracker's contiguous low watermark when a batch was taken, written in the same
/// transaction as the receipts, quarantine and held records of that batch. Every event of every
/// transaction that ended at or before it is resolved durably — an accepted receipt, a
/// quarantine or a held record — by this batch or an earlier one (acceptance transactions
/// commit in the order they were taken). Nothing that is only in flight, only acknowledged by
/// the broker, or only in memory counts. A replay after a crash restarts at or before this
/// position, and the overlap is deduplicated by event id.
///
/// `write` is the furthest position received, which only tells the server how far the relay
/// has read (it moves nothing that a crash could lose); it is never below `flush`.
pub fn standby_status(last_received: Lsn, durable: Lsn) -> StandbyStatus {
    StandbyStatus {
        write: last_received.max(durable),
        flush: durable,
        apply: durable,
    }
}

impl<P: Plant> PipelineCore<P> {
    /// What the loop's schedule looks at ([`Load`]) at `now`, on the schedule's clock, with
    /// what only the driver knows: whether an acceptance transaction runs, and the events
    /// waiting on unclear outcomes where they matter ([`waiting_matters`]; the driver may
    /// sample them). The loop's look times the batch's linger: it starts at the first look
    /// that finds the batch with an item (the loop looks after every step, so within a step
    /// of the item's arrival) and ends when an acceptance takes the batch
    /// ([`PipelineCore::begin_acceptance`]) or the batch is empty.
    pub fn load_at(
        &mut self,
        accepting: bool,
        now: std::time::Duration,
        waiting_on_unclear: Waiting,
    ) -> Load {
        if self.batch_len() == 0 {
            self.batch_started = None;
        } else if self.batch_started.is_none() {
            self.batch_started = Some(now);
        }
        self.load(accepting, waiting_on_unclear)
    }

    /// [`PipelineCore::load_at`] with the events waiting on unclear outcomes counted where they
    /// matter under `bounds` ([`PipelineCore::waiting_where_it_matters`], at `wall`): what the
    /// stream loop looks at before it waits and after each step.
    pub fn load_for(
        &mut self,
        bounds: Bounds,
        accepting: bool,
        now: std::time::Duration,
        wall: std::time::SystemTime,
    ) -> Load {
        let unresolved = self.tracker.in_flight();
        let waiting = self.waiting_where_it_matters(bounds, unresolved, wall);
        self.load_at(accepting, now, waiting)
    }

    /// [`PipelineCore::load_at`] without the loop's look at the time: for a look at the bounds
    /// alone ([`Schedule::can_read`]), which must not start the linger.
    pub fn load(&self, accepting: bool, waiting_on_unclear: Waiting) -> Load {
        Load {
            accepting,
            batch_len: self.batch_len(),
            batch_started: self.batch_started,
            checkpoint_behind: self.tracker.watermark() > self.durable(),
            unresolved: self.tracker.in_flight(),
            waiting_on_unclear,
            in_flight_bytes: self.in_flight_bytes(),
            in_transaction: self.in_transaction(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_accepts_checks_the_lease_then_polls_releases_then_confirms() {
        let all = Due {
            accept: true,
            releases: true,
            status: true,
        };
        assert_eq!(
            all.steps().collect::<Vec<_>>(),
            [
                TurnStep::Accept,
                TurnStep::CheckLease,
                TurnStep::Releases,
                TurnStep::Status
            ]
        );
        let idle = Due::default();
        assert_eq!(idle.steps().collect::<Vec<_>>(), [TurnStep::CheckLease]);
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn settings() -> Settings {
        Settings {
            status_interval: ms(1000),
            batch_linger: ms(5),
            bounds: Bounds {
                batch_size: 100,
                max_in_flight: 10,
                max_waiting: Waiting {
                    events: 50,
                    bytes: 5_000,
                },
                max_in_flight_bytes: 1000,
            },
            release_poll: ms(500),
        }
    }

    #[test]
    fn the_slot_is_not_read_while_too_much_is_unresolved_or_in_flight() {
        let s = Schedule::new(settings(), ms(0));
        let mut load = Load {
            unresolved: 9,
            in_flight_bytes: 999,
            ..Load::default()
        };
        assert!(s.can_read(&load));
        load.unresolved = 10;
        assert!(!s.can_read(&load));
        load.unresolved = 0;
        load.in_flight_bytes = 1000;
        assert!(!s.can_read(&load));
    }

    #[test]
    fn what_waits_on_unclear_outcomes_has_bounds_of_its_own() {
        let s = Schedule::new(settings(), ms(0));
        let waiting = |events, bytes| Waiting { events, bytes };
        // 9 sent and unresolved, 40 parked or queued behind parked events: still read.
        let mut load = Load {
            unresolved: 49,
            waiting_on_unclear: waiting(40, 4_000),
            ..Load::default()
        };
        assert!(s.can_read(&load));
        assert!(!s.reading_held_by_unclear(&load));
        load.unresolved = 50;
        assert!(!s.can_read(&load), "10 others unresolved: max_in_flight");
        assert!(!s.reading_held_by_unclear(&load));
        load.unresolved = 55;
        load.waiting_on_unclear = waiting(50, 4_000);
        assert!(!s.can_read(&load), "the bound of what waits");
        assert!(s.reading_held_by_unclear(&load));
        load.unresolved = 49;
        load.waiting_on_unclear = waiting(40, 5_000);
        assert!(!s.can_read(&load), "the bound of their payloads");
        assert!(s.reading_held_by_unclear(&load));
        // A driver leaves the count 0 where it cannot matter: below both event bounds.
        let max = waiting(50, 5_000);
        assert!(!waiting_matters(10, max, 9));
        assert!(waiting_matters(10, max, 10));
        assert!(
            waiting_matters(100, waiting(10, 5_000), 10),
            "the bound of what waits is the smaller"
        );
        for unresolved in 0..10 {
            let load = Load {
                unresolved,
                ..Load::default()
            };
            let counted = Load {
                waiting_on_unclear: waiting(unresolved, unresolved * 100),
                ..load
            };
            assert_eq!(s.can_read(&load), s.can_read(&counted));
        }
    }

    #[test]
    fn a_batch_is_accepted_when_full_or_after_its_linger_but_never_beside_another() {
        let mut s = Schedule::new(settings(), ms(0));
        assert!(s.due(ms(0), &Load::default()).status, "the first status");
        let mut load = Load {
            batch_len: 1,
            batch_started: Some(ms(10)),
            ..Load::default()
        };
        assert!(!s.due(ms(12), &load).accept, "lingering");
        assert_eq!(s.next_wakeup(&load), ms(15));
        assert!(s.due(ms(15), &load).accept);
        load.batch_len = 100;
        load.batch_started = Some(ms(20));
        assert!(s.due(ms(20), &load).accept, "full");
        load.accepting = true;
        assert!(!s.due(ms(40), &load).accept, "one acceptance at a time");
        assert_eq!(
            s.next_wakeup(&load),
            ms(1000),
            "the linger waits for the running one"
        );
    }

    #[test]
    fn the_linger_runs_from_the_first_look_at_an_item_until_an_acceptance_takes_the_batch() {
        let mut core = crate::testing::core();
        let quiet = Waiting::default();
        assert_eq!(core.load_at(false, ms(5), quiet).batch_started, None);
        let unreadable = |core: &mut PipelineCore, n: u64| {
            core.quarantine_unreadable(format!("row {n}"), "planted".into(), Lsn(n), None)
        };
        unreadable(&mut core, 1);
        assert_eq!(
            core.load(false, quiet).batch_started,
            None,
            "a look at the bounds alone"
        );
        assert_eq!(core.load_at(false, ms(7), quiet).batch_started, Some(ms(7)));
        unreadable(&mut core, 2);
        assert_eq!(
            core.load_at(false, ms(9), quiet).batch_started,
            Some(ms(7)),
            "a second item lingers with the first"
        );
        assert!(core.begin_acceptance(false).unwrap().is_some());
        assert_eq!(core.load(false, quiet).batch_started, None, "taken");
        unreadable(&mut core, 3);
        assert_eq!(
            core.load_at(false, ms(12), quiet).batch_started,
            Some(ms(12))
        );
    }

    #[test]
    fn the_slot_not_read_for_unclear_outcomes_is_said_once_a_minute_and_its_end_after_it() {
        let mut s = Schedule::new(settings(), ms(0));
        let held = Load {
            unresolved: 60,
            waiting_on_unclear: Waiting {
                events: 55,
                bytes: 0,
            },
            ..Load::default()
        };
        let free = Load::default();
        assert!(!s.can_read(&held) && s.reading_held_by_unclear(&held));
        assert_eq!(s.held_notice(ms(0), &held), Some(HeldNotice::NotRead));
        assert_eq!(s.held_notice(ms(10), &held), None, "once per episode");
        assert_eq!(s.held_notice(ms(20), &free), Some(HeldNotice::ReadingAgain));
        // A new episode within the minute: neither said.
        assert_eq!(s.held_notice(ms(30), &held), None);
        assert_eq!(s.held_notice(ms(40), &free), None);
        // After it: said again.
        assert_eq!(s.held_notice(ms(60_000), &held), Some(HeldNotice::NotRead));
        // Not reading for another reason (max_in_flight) is not this.
        let busy = Load {
            unresolved: 60,
            ..Load::default()
        };
        let mut t = Schedule::new(settings(), ms(0));
        assert!(!t.can_read(&busy));
        assert_eq!(t.held_notice(ms(0), &busy), None);
    }

    #[test]
    fn an_idle_checkpoint_is_written_once_per_status_interval() {
        let mut s = Schedule::new(settings(), ms(0));
        assert!(s.due(ms(0), &Load::default()).status, "the first status");
        let load = Load {
            checkpoint_behind: true,
            ..Load::default()
        };
        assert!(!s.due(ms(999), &load).accept);
        assert!(s.due(ms(1000), &load).accept);
        assert!(!s.due(ms(1500), &load).accept, "the timer restarted");
        assert_eq!(s.next_wakeup(&load), ms(2000));
        // The mutant the simulator's `checkpoint_not_written` catches never writes it.
        let plant = crate::pipeline::Planted {
            mutant: Some(Mutant::IdleCheckpointNeverDue),
            ..Default::default()
        };
        let mut planted = Schedule::planted(settings(), ms(0), plant);
        assert!(!planted.due(ms(60_000), &load).accept);
    }

    #[test]
    fn a_status_goes_out_at_start_periodically_on_request_and_after_a_moving_acceptance() {
        let mut s = Schedule::new(settings(), ms(0));
        let load = Load::default();
        assert!(s.due(ms(0), &load).status, "at start");
        assert!(!s.due(ms(500), &load).status);
        assert!(s.due(ms(1000), &load).status, "periodic");
        s.status_requested();
        assert!(s.due(ms(1001), &load).status, "the server asked");
        s.accepted(ms(1050), true);
        assert!(!s.due(ms(1050), &load).status, "one went out 49 ms ago");
        s.accepted(ms(1200), false);
        assert!(
            !s.due(ms(1200), &load).status,
            "the checkpoint did not move"
        );
        s.accepted(ms(1200), true);
        assert!(s.due(ms(1200), &load).status);
    }

    #[test]
    fn releases_are_polled_between_transactions_only() {
        let mut s = Schedule::new(settings(), ms(0));
        let mut load = Load {
            in_transaction: true,
            ..Load::default()
        };
        assert!(!s.due(ms(600), &load).releases);
        load.in_transaction = false;
        assert!(s.due(ms(600), &load).releases);
        assert!(!s.due(ms(700), &load).releases);
    }

    #[test]
    fn the_slot_is_confirmed_at_the_durable_checkpoint_only() {
        let st = standby_status(Lsn(500), Lsn(300));
        assert_eq!(
            (st.write, st.flush, st.apply),
            (Lsn(500), Lsn(300), Lsn(300))
        );
        let st = standby_status(Lsn(100), Lsn(300));
        assert_eq!(st.write, Lsn(300), "write never below flush");
    }
}
