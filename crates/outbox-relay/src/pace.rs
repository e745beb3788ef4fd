//! How a read outside the stream keeps pace with the broker: the initial snapshot and a poll
//! round admit rows one after another, not as the slot delivers them, so nothing like the stream
//! loop's backpressure ([`crate::schedule::Schedule::can_read`]) stops them; these two decisions
//! do. After each admitted row the driver asks [`PipelineCore::pace`] (wait for something to be
//! reported, accept a full batch, or admit the next row); at the read's end it asks
//! [`PipelineCore::draining`] until the read is settled. The daemon
//! (`outboxd/src/relay/pipeline.rs`, `keep_pace` and `drain_all`) and the simulator's snapshot
//! and poll rounds run the same steps, so both read under the same bounds.

use std::time::SystemTime;

use crate::pipeline::{Mutant, PipelineCore, Plant};
use crate::schedule::{within_bounds, Bounds};

/// What a read does after admitting a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Too much is outstanding: wait for the next report, look-up or parked event falling
    /// due, then ask again.
    Wait,
    /// The batch is full: accept it, then ask again.
    Accept,
    /// Admit the next row.
    Go,
    /// A send was refused because the lease was not certainly held
    /// ([`PipelineCore::lease_expired`]): the run ends. Nothing else would: the refused
    /// event stays queued with nothing at the broker ahead of it, so a wait would never end.
    LeaseLost,
}

/// What a read does at its end, until it is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drain {
    /// The batch is full: accept it, then ask again.
    Accept,
    /// Something admitted is still outstanding: wait for the next thing that moves it, then
    /// ask again.
    Wait,
    /// Nothing is left to wait for: accept the rest of the batch, and the read is over.
    Done,
    /// As [`Pace::LeaseLost`]: the run ends.
    LeaseLost,
}

impl<P: Plant> PipelineCore<P> {
    /// After a row of a read was admitted, at `now`: end if a send was refused for the lease,
    /// wait while `bounds` are exceeded (those waiting on unclear outcomes counted apart, where
    /// they matter: [`Self::waiting_where_it_matters`]), then accept a full batch, then go on.
    pub fn pace(&mut self, bounds: Bounds, now: SystemTime) -> Pace {
        let outstanding = self.outstanding() as u64;
        let waiting = self.waiting_where_it_matters(bounds, outstanding, now);
        if self.read_must_end() {
            Pace::LeaseLost
        } else if !within_bounds(
            bounds.max_in_flight,
            bounds.max_waiting,
            outstanding,
            waiting,
        ) {
            Pace::Wait
        } else if self.batch_len() >= bounds.batch_size {
            Pace::Accept
        } else {
            Pace::Go
        }
    }

    /// At a read's end: end if a send was refused for the lease, accept full batches, wait
    /// until nothing admitted is outstanding (at the broker, parked after an unclear outcome,
    /// or queued behind either), then accept the rest. With `parked_may_stay` (a poll round:
    /// the next round skips a parked aggregate), only what is at the broker is waited for.
    pub fn draining(&self, batch_size: usize, parked_may_stay: bool) -> Drain {
        let left = if parked_may_stay {
            self.in_flight()
        } else {
            self.outstanding()
        };
        if self.read_must_end() {
            Drain::LeaseLost
        } else if self.batch_len() >= batch_size && left > 0 {
            Drain::Accept
        } else if left > 0 {
            Drain::Wait
        } else {
            Drain::Done
        }
    }

    /// A send was refused because the lease was not certainly held: the read can only end.
    fn read_must_end(&self) -> bool {
        self.lease_expired && !self.planted(Mutant::ReadIgnoresLease)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Waiting;
    use crate::testing::{continued, core, event, now, persisted, token, unclear};
    use outbox_core::delivery::Persistence;

    fn bounds(max_in_flight: u64, batch_size: usize) -> Bounds {
        Bounds {
            max_in_flight,
            max_waiting: Waiting {
                events: 100,
                bytes: u64::MAX,
            },
            batch_size,
            max_in_flight_bytes: usize::MAX,
        }
    }

    #[test]
    fn a_read_waits_at_its_bound_and_accepts_a_full_batch_before_it_goes_on() {
        let mut c = core();
        let at = |ms| now(ms).wall;
        assert_eq!(c.pace(bounds(2, 1), at(0)), Pace::Go);
        let a = c.admit(event("a", 1), None, None, None, now(0)).unwrap();
        assert_eq!(c.pace(bounds(2, 1), at(0)), Pace::Go);
        let b = c.admit(event("b", 1), None, None, None, now(0)).unwrap();
        // Two outstanding at a bound of two: the read waits.
        assert_eq!(c.pace(bounds(2, 1), at(0)), Pace::Wait);
        // b's outcome is unclear: it waits on its own, not counted against `max_in_flight`
        // (counted again: the last count is older than the sample's life) ...
        unclear(&mut c, token(&b[0]), Persistence::NotPersisted);
        assert_eq!(c.pace(bounds(2, 1), at(1500)), Pace::Go);
        // ... but against its own bound.
        let mut tight = bounds(2, 1);
        tight.max_waiting.events = 1;
        assert_eq!(c.pace(tight, at(1500)), Pace::Wait);
        // A report puts a receipt in the batch: full at one, so it is accepted first.
        continued(c.on_report(persisted(token(&a[0]), 7), now(1501)).unwrap());
        assert_eq!(c.pace(bounds(2, 1), at(1501)), Pace::Accept);
        assert_eq!(c.pace(bounds(2, 2), at(1501)), Pace::Go);
    }

    #[test]
    fn a_read_ends_when_nothing_is_outstanding_and_parked_events_may_stay_in_a_poll_round() {
        let mut c = core();
        assert_eq!(c.draining(1, false), Drain::Done);
        let a = c.admit(event("a", 1), None, None, None, now(0)).unwrap();
        c.admit(event("a", 2), None, None, None, now(0)).unwrap();
        // One at the broker, one queued behind it.
        assert_eq!(c.draining(1, false), Drain::Wait);
        assert_eq!(c.draining(1, true), Drain::Wait);
        // Version 1 reported: its receipt fills a batch of one while version 2 is out.
        let b = continued(c.on_report(persisted(token(&a[0]), 7), now(1)).unwrap());
        assert_eq!(c.draining(1, false), Drain::Accept);
        assert_eq!(c.draining(2, false), Drain::Wait);
        continued(c.on_report(persisted(token(&b[0]), 8), now(2)).unwrap());
        // Nothing outstanding: the rest of the batch is accepted and the read is over.
        assert_eq!(c.draining(1, false), Drain::Done);
    }

    /// Found by the simulator once its reads paced as the daemon's do (seed 1, trace 15929 of
    /// 20,000: a poll round waited for events queued behind one whose send the lease had
    /// refused, forever). Worse at a snapshot's end: the refused event is in no count the
    /// drain waited on, so the drain was over, the batch accepted (the lease was still held,
    /// only not certainly) and the snapshot marked done without that event.
    #[test]
    fn a_read_ends_when_a_send_was_refused_for_the_lease() {
        let mut c = core();
        let a = c.admit(event("a", 1), None, None, None, now(0)).unwrap();
        c.admit(event("a", 2), None, None, None, now(0)).unwrap();
        let mut lapsed = now(1);
        lapsed.lease_valid = false;
        // Version 1's report frees version 2, whose send the lapsed lease refuses: it is
        // neither at the broker nor queued.
        let next = continued(c.on_report(persisted(token(&a[0]), 7), lapsed).unwrap());
        assert!(next.is_empty());
        assert_eq!((c.in_flight(), c.outstanding()), (0, 0));
        // Version 3 queues behind the version the gate believes sent.
        c.admit(event("a", 3), None, None, None, now(2)).unwrap();
        assert_eq!((c.in_flight(), c.outstanding()), (0, 1));
        assert_eq!(c.pace(bounds(1, 10), now(2).wall), Pace::LeaseLost);
        assert_eq!(c.draining(10, false), Drain::LeaseLost);
    }
}
