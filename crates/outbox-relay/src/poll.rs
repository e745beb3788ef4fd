//! Poll mode's round (`outboxd run --mode poll`): which of the rows a round read are admitted
//! to the pipeline, and what the gate learns first. Pure, as the rest of the core: the daemon
//! (`outboxd/src/relay/poll.rs`) reads the rows and executes the commands; the simulator's poll
//! rounds call the same two functions.
//!
//! A round reads, per aggregate and in version order, the events without a receipt above the
//! aggregate's poll position. Two rules decide what of that is admitted:
//!
//! * An aggregate with an event at the broker, or parked after an unclear outcome since the
//!   round began ([`PipelineCore::unclear_touched`]), is skipped for the whole round: what is
//!   queued behind a parked event is forgotten, and its rows, read again by a later round once
//!   the event is resolved, may by then have receipts.
//! * Every version below an aggregate's first pending one has a receipt (the read skips only
//!   receipted versions; a quarantine holds the whole aggregate), so the gate's head is raised
//!   to just below it: a receipt accepted after this run read the head (a paused relay's
//!   salvage) would otherwise look like a gap, and the gate would hold the aggregate behind a
//!   published event (found by `outbox-sim`: `poll-stale-head`).
//!
//! Before its read, a round advances poll positions over the receipted prefix
//! ([`Advance`]): which ones is decided here too. The read's correctness does not depend on
//! it (a position only ever passes receipted versions, by the SQL), only its cost does.

use std::time::Duration;

use outbox_core::OutboxEvent;

use crate::pipeline::{
    key_of, AggKey, Command, CoreError, Mutant, Now, PipelineCore, Plant, Round,
};

/// What became of one row of a round.
#[derive(Debug)]
pub enum Polled {
    /// Its aggregate is skipped this round (at the broker, or parked).
    Skipped,
    /// Admitted: the commands that send it.
    Admitted { commands: Vec<Command> },
}

/// How often a round advances every aggregate's poll position (the first round always does).
pub const FULL_ADVANCE_EVERY: Duration = Duration::from_secs(10);

/// Which poll positions a round advances over the receipted prefix before its read
/// (`outbox_source::poll::ADVANCE_SQL`, `ADVANCE_SOME_SQL`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advance {
    /// Every aggregate's: at the first round, then every [`FULL_ADVANCE_EVERY`]. Receipts
    /// accepted elsewhere (reconciliation, a paused relay's salvage, releases) wait for it: a
    /// position behind only costs the read a few published rows.
    All,
    /// Those of the aggregates the last round published: types and ids, pairwise.
    These {
        types: Vec<String>,
        ids: Vec<String>,
    },
    /// None: the last round published nothing.
    Nothing,
}

/// Rows a round reads at most: bounds the read's sort and the round's memory. A round that
/// read this many starts the next at once; one that read fewer waits the poll interval.
pub const ROUND_LIMIT: u64 = 10_000;

/// What a poll-mode run does next, in the order [`PollRun`] decides; the daemon's loop
/// (`outboxd/src/relay/poll.rs`) and the simulator's poll relay execute the same steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoundStep {
    /// Asked to stop between rounds: release the lease and end the run.
    Stop,
    /// Wait for the reports of what was sent since the last round (an unclear event resolved
    /// and the one behind it, between rounds) and accept them, as
    /// [`PipelineCore::draining`] says with parked events allowed to stay: the read must not
    /// take an answered event whose receipt is still in the batch for pending.
    DrainBefore,
    /// Advance these poll positions over the receipted prefix
    /// ([`PipelineCore::begin_poll_round`] has begun the round).
    Advance(Advance),
    /// Read up to [`ROUND_LIMIT`] pending rows in one snapshot, record the round's read, and
    /// admit them ([`PipelineCore::admit_polled`], pacing after each); then tell
    /// [`PollRun::read`] how many rows there were.
    Read,
    /// Wait for every report of the round and accept: the next round reads what has no
    /// receipt, so nothing of this one may still be at the broker (a parked event may stay:
    /// the next round skips its aggregate).
    DrainAfter,
    /// End the run if the lease is not certainly held.
    CheckLease,
    /// Poll the releases ([`PipelineCore::poll_releases_due`] said they are due).
    Releases,
    /// Publish the run's gauges.
    Status,
    /// The round read fewer than [`ROUND_LIMIT`] rows: wait until `until` (the driver's
    /// clock, zero when the run began), handling reports, look-ups and due resends meanwhile,
    /// or a request to stop.
    Idle { until: Duration },
}

/// Where a poll-mode run's loop is: rounds of [`RoundStep`]s, one after the other. Pure: the
/// driver passes its clock (zero when the run began) and whether it was asked to stop.
#[derive(Debug)]
pub struct PollRun {
    interval: Duration,
    release_every: Duration,
    next: usize,
    read: u64,
}

/// A round's steps after its [`RoundStep::Stop`] check, in order.
const ROUND: [Phase; 8] = [
    Phase::DrainBefore,
    Phase::Advance,
    Phase::Read,
    Phase::DrainAfter,
    Phase::CheckLease,
    Phase::Releases,
    Phase::Status,
    Phase::Idle,
];

#[derive(Debug, Clone, Copy)]
enum Phase {
    DrainBefore,
    Advance,
    Read,
    DrainAfter,
    CheckLease,
    Releases,
    Status,
    Idle,
}

impl PollRun {
    /// A run that waits `interval` after a round that read fewer than [`ROUND_LIMIT`] rows,
    /// and polls releases every `release_every`.
    pub fn new(interval: Duration, release_every: Duration) -> PollRun {
        PollRun {
            interval,
            release_every,
            next: 0,
            read: 0,
        }
    }

    /// The [`RoundStep::Read`] step read `rows` rows.
    pub fn read(&mut self, rows: u64) {
        self.read = rows;
    }

    /// The next step, at `now`; `stopping`: the run was asked to stop (honoured between
    /// rounds, never inside one: a round's read is admitted and drained whole).
    pub fn next<P: Plant>(
        &mut self,
        core: &mut PipelineCore<P>,
        now: Duration,
        stopping: bool,
    ) -> RoundStep {
        loop {
            if self.next == 0 && stopping {
                return RoundStep::Stop;
            }
            let phase = ROUND[self.next];
            self.next = (self.next + 1) % ROUND.len();
            let step = match phase {
                Phase::DrainBefore if core.planted(Mutant::RoundReadsBeforeDrain) => None,
                Phase::DrainBefore => Some(RoundStep::DrainBefore),
                Phase::Advance => Some(RoundStep::Advance(core.begin_poll_round(now))),
                Phase::Read => {
                    self.read = 0;
                    Some(RoundStep::Read)
                }
                Phase::DrainAfter => Some(RoundStep::DrainAfter),
                Phase::CheckLease => Some(RoundStep::CheckLease),
                Phase::Releases => core
                    .poll_releases_due(now, self.release_every)
                    .then_some(RoundStep::Releases),
                Phase::Status => Some(RoundStep::Status),
                Phase::Idle => (self.read < ROUND_LIMIT).then_some(RoundStep::Idle {
                    until: now + self.interval,
                }),
            };
            if let Some(step) = step {
                return step;
            }
        }
    }
}

impl<P: Plant> PipelineCore<P> {
    /// A round begins (after what was sent since the last one was reported and accepted):
    /// it reads from the first row, and skips the aggregates parked now as well as those
    /// parked while it goes on. One parked now may be resolved before the round reaches its
    /// rows (the driver waits for reports, answers and due resends between rows): its event,
    /// read as pending, is published by then, and sending it would be a second copy after a
    /// clear answer (found by `outbox-sim` once its rounds wait as the daemon's do; the e2e
    /// misbehaving-endpoint test in poll mode saw it as an HTTP request answered 200 and
    /// sent again 924 ms later).
    ///
    /// Returns which poll positions to advance before the round's read, at `now` on the
    /// driver's clock.
    pub fn begin_poll_round(&mut self, now: Duration) -> Advance {
        let parked = if self.planted(Mutant::RoundForgetsParked) {
            Vec::new()
        } else {
            self.parked_aggregates()
        };
        if let Some(t) = self.unclear_touched.as_mut() {
            t.clear();
            t.extend(parked);
        }
        self.round = Round::default();
        let p = &mut self.between_rounds;
        let published = std::mem::take(&mut p.published);
        if p.last_full
            .map_or(true, |t| now.saturating_sub(t) >= FULL_ADVANCE_EVERY)
        {
            p.last_full = Some(now);
            Advance::All
        } else if published.is_empty() {
            Advance::Nothing
        } else {
            let (types, ids) = published.into_iter().unzip();
            Advance::These { types, ids }
        }
    }

    /// Whether a round that began now would skip the rows of `key`: an event of it is at the
    /// broker, or parked ([`Self::begin_poll_round`]). A driver that runs only the rounds
    /// that can admit something asks this (the simulator's).
    pub fn round_would_skip(&self, key: &AggKey) -> bool {
        self.aggregate_in_flight(key)
            || (!self.planted(Mutant::RoundForgetsParked) && self.aggregate_parked(key))
    }

    /// After a round, at `now` on the driver's clock (zero when the run began): whether to
    /// poll releases now, every `every` (as [`crate::schedule::Schedule`] times them in CDC
    /// mode); if so, the next are due `every` from now.
    pub fn poll_releases_due(&mut self, now: Duration, every: Duration) -> bool {
        let p = &mut self.between_rounds;
        let due = now >= p.last_releases + every;
        if due {
            p.last_releases = now;
        }
        due
    }

    /// The next row of the round, in the read's order (aggregate, then version). The driver
    /// has given the gate the ledger's head of its aggregate, if the gate did not know it.
    pub fn admit_polled(&mut self, ev: OutboxEvent, now: Now) -> Result<Polled, CoreError> {
        let key = key_of(&ev);
        let first = self.round.last.as_ref() != Some(&key);
        if first {
            self.round.skipping = self.aggregate_in_flight(&key);
        }
        // Parked meanwhile (during this round too: what was queued behind it is forgotten, so
        // its later rows wait for a later round as well).
        self.round.skipping |= self
            .unclear_touched
            .as_ref()
            .is_some_and(|t| t.contains(&key));
        if first {
            self.round.last = Some(key.clone());
        }
        if self.round.skipping {
            return Ok(Polled::Skipped);
        }
        if first && !self.planted(Mutant::PollStaleHead) {
            self.raise_heads(vec![(key.clone(), ev.aggregate_version - 1)]);
        }
        let commands = self.admit(ev, None, None, None, now)?;
        if first {
            self.between_rounds.published.push(key);
        }
        Ok(Polled::Admitted { commands })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::Planted;
    use crate::testing::{event, now, served};

    /// A core of generation 7 with `mutant` planted, if any.
    fn core_with(mutant: Option<Mutant>) -> PipelineCore<Planted> {
        PipelineCore::with_plant(
            served(),
            7,
            PipelineCore::gate_from(Vec::new(), Vec::new()),
            Planted {
                mutant,
                current_route: None,
            },
        )
    }

    /// The gate knows `a` at head 1 (its v1 published by this run); v2 gets its receipt from a
    /// paused relay's salvage after that, so the next round's first pending row of `a` is v3.
    /// Returns whether v3 is sent (the gate raised to v2) rather than held as a gap.
    fn third_is_sent(mutant: Option<Mutant>) -> bool {
        let mut c = core_with(mutant);
        c.raise_heads(vec![(("order".to_string(), "a".to_string()), 1)]);
        c.begin_poll_round(Duration::ZERO);
        match c.admit_polled(event("a", 3), now(100)).unwrap() {
            Polled::Admitted { commands } => commands.len() == 1,
            Polled::Skipped => panic!("nothing of `a` is at the broker or parked"),
        }
    }

    /// A round skips an aggregate parked when it began, even once the parked event is sent
    /// again and answered while the round goes on: the round read the event as pending before
    /// that and would send it a second time (the e2e misbehaving-endpoint test in poll mode).
    /// Returns whether the round admits the event it read.
    fn resolved_mid_round_is_admitted(mutant: Option<Mutant>) -> bool {
        use crate::pipeline::UnclearStep;
        use crate::testing::{failed, persisted, token};
        use outbox_core::delivery::{FailureClass, Persistence};
        let mut c = core_with(mutant);
        c.unclear_touched = Some(Default::default());
        c.raise_heads(vec![(("order".to_string(), "a".to_string()), 0)]);
        let a1 = event("a", 1);
        c.begin_poll_round(Duration::ZERO);
        let Polled::Admitted { commands, .. } = c.admit_polled(a1.clone(), now(100)).unwrap()
        else {
            panic!("a/1 is pending and nothing of `a` waits")
        };
        let lost = failed(
            token(&commands[0]),
            Persistence::NotPersisted,
            FailureClass::Transient,
        );
        c.on_report(lost, now(200)).unwrap();
        // The next round begins with a/1 parked, and reads it as pending; before the round
        // reaches it, a/1 comes due, is sent again and answered with its position.
        c.begin_poll_round(Duration::ZERO);
        let steps = c.due_unclear(now(60_000)).unwrap();
        let [UnclearStep::Send(resend)] = steps.as_slice() else {
            panic!("{steps:?}")
        };
        c.on_report(persisted(token(resend), 7), now(60_001))
            .unwrap();
        matches!(
            c.admit_polled(a1, now(60_002)).unwrap(),
            Polled::Admitted { .. }
        )
    }

    #[test]
    fn a_round_advances_every_position_at_first_and_every_ten_seconds_else_those_last_published() {
        let s = Duration::from_secs;
        let mut c = core_with(None);
        c.raise_heads(vec![
            (("order".to_string(), "a".to_string()), 0),
            (("order".to_string(), "b".to_string()), 0),
        ]);
        assert_eq!(c.begin_poll_round(s(0)), Advance::All, "the first round");
        for (id, v) in [("a", 1), ("a", 2), ("b", 1)] {
            assert!(matches!(
                c.admit_polled(event(id, v), now(100)).unwrap(),
                Polled::Admitted { .. }
            ));
        }
        // a/1 and b/1 are at the broker: the next round skips both and publishes nothing.
        assert_eq!(
            c.begin_poll_round(s(1)),
            Advance::These {
                types: vec!["order".into(), "order".into()],
                ids: vec!["a".into(), "b".into()],
            },
            "once per aggregate the round published"
        );
        assert!(matches!(
            c.admit_polled(event("a", 3), now(200)).unwrap(),
            Polled::Skipped
        ));
        assert_eq!(c.begin_poll_round(s(2)), Advance::Nothing);
        assert_eq!(
            c.begin_poll_round(s(10)),
            Advance::All,
            "ten seconds after the last"
        );
        assert_eq!(c.begin_poll_round(s(11)), Advance::Nothing);
    }

    /// The steps of a run's rounds, by name, at `now` (ms) and stop requests as given.
    fn steps(run: &mut PollRun, c: &mut PipelineCore<Planted>, at: &[(u64, bool)]) -> Vec<String> {
        at.iter()
            .map(|&(t, stop)| {
                let step = run.next(c, Duration::from_millis(t), stop);
                if step == RoundStep::Read {
                    run.read(if t < 100 { ROUND_LIMIT } else { 3 });
                }
                match step {
                    RoundStep::Advance(_) => "Advance".to_string(),
                    RoundStep::Idle { until } => format!("Idle {}", until.as_millis()),
                    s => format!("{s:?}"),
                }
            })
            .collect()
    }

    #[test]
    fn a_poll_run_drains_reads_drains_and_waits_only_after_a_short_read_and_stops_between_rounds() {
        let mut c = core_with(None);
        let mut run = PollRun::new(Duration::from_millis(500), Duration::from_millis(1_000));
        let at = |t| (t, false);
        // A full read (at 0-99 ms) goes on at once; a short one waits the interval. Releases
        // are polled a second after the run began; a stop asked inside a round waits for it.
        let got = steps(
            &mut run,
            &mut c,
            &[
                at(0),
                at(0),
                at(0),
                at(0),
                at(0),
                at(0),
                (200, true),
                at(200),
                at(200),
                (300, true),
                (1_200, true),
                (1_200, true),
                (1_200, true),
                (1_200, true),
                (1_200, true),
            ],
        );
        let want = [
            "DrainBefore",
            "Advance",
            "Read",
            "DrainAfter",
            "CheckLease",
            "Status",
            "Stop",
            "DrainBefore",
            "Advance",
            "Read",
            "DrainAfter",
            "CheckLease",
            "Releases",
            "Status",
            "Idle 1700",
        ];
        assert_eq!(got, want);
        assert_eq!(
            run.next(&mut c, Duration::from_millis(1_700), true),
            RoundStep::Stop
        );
    }

    #[test]
    fn a_planted_mutant_reads_a_round_before_draining_what_was_sent_since_the_last() {
        let mut c = core_with(Some(Mutant::RoundReadsBeforeDrain));
        let mut run = PollRun::new(Duration::from_millis(500), Duration::from_secs(60));
        let first = run.next(&mut c, Duration::ZERO, false);
        assert!(matches!(first, RoundStep::Advance(_)), "{first:?}");
    }

    #[test]
    fn releases_are_polled_an_interval_after_the_run_began_and_after_each_poll() {
        let ms = Duration::from_millis;
        let mut c = core_with(None);
        let every = ms(1_000);
        assert!(!c.poll_releases_due(ms(999), every));
        assert!(c.poll_releases_due(ms(1_200), every));
        assert!(!c.poll_releases_due(ms(2_100), every), "from the last poll");
        assert!(c.poll_releases_due(ms(2_200), every));
    }

    #[test]
    fn a_round_skips_an_aggregate_parked_when_it_began_though_resolved_meanwhile() {
        assert!(
            !resolved_mid_round_is_admitted(None),
            "skipped: its rows wait for the next round's read"
        );
        assert!(
            resolved_mid_round_is_admitted(Some(Mutant::RoundForgetsParked)),
            "the planted mutant sends a/1 a second time"
        );
    }

    #[test]
    fn a_rounds_first_row_raises_the_head_so_a_version_published_meanwhile_is_no_gap() {
        assert!(third_is_sent(None), "v3 held behind a published v2");
        assert!(
            !third_is_sent(Some(Mutant::PollStaleHead)),
            "the planted stale head takes v3 for a gap"
        );
    }
}
