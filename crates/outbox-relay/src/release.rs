//! Republishing an aggregate an operator released: in version order, one event at a time,
//! stopping at the first event that is refused again.
//!
//! A hold is durable: the aggregate's quarantined (blocking) event and everything recorded as
//! held behind it wait in the ledger until `outboxd quarantine release`. The driver then loads
//! what the release publishes (the ledger's `republish_set`: the blocking event unless the
//! operator skipped it, and every held event without a receipt) and asks the core, step by
//! step, what to do ([`PipelineCore::release_step`]). Each event is sent only after the
//! broker has reported on the previous one, so the aggregate's order holds across the
//! release. The hold is closed only when every event went out; its next expected version
//! then follows the last one published ([`next_version`]).
//!
//! A release may start only when no event of the aggregate is at the broker
//! ([`PipelineCore::may_release`]), and after the batch holding its held records is accepted.
//! The whole poll — the settled UNKNOWN attempts of other generations first, then each
//! released aggregate, the batch accepted before and after, the hold closed — is
//! [`ReleasePoll`], which the daemon and the simulator execute step by step.

use std::collections::VecDeque;

use outbox_core::{Lsn, OutboxEvent};

use crate::pipeline::{AggKey, Command, Mutant, Now, Pending, PipelineCore};
use crate::route;

/// One release in progress: the events still to publish, in version order.
#[derive(Debug)]
pub struct Release {
    key: AggKey,
    events: VecDeque<Pending>,
    /// The event sent and not yet reported on: (token, version).
    sent: Option<(u64, i64)>,
    /// The last version published by this release (or the skipped blocking event's).
    last: Option<i64>,
}

/// What the driver does next for a [`Release`]. Rare (one per released event), so the
/// size of the send does not matter.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum ReleaseStep {
    /// Execute this send, then ask again.
    Send(Command),
    /// Wait for this token's delivery report, hand it to the core, then ask again.
    Await(u64),
    /// Nothing more to send. Accept the batch; then, when `close` is `Some(last)`, close the
    /// hold in the ledger and tell the core with [`PipelineCore::release_closed`]. `None`: an
    /// event was refused again (quarantined, the hold stays) or the lease is gone.
    Done { close: Option<Option<i64>> },
}

/// The next version an aggregate expects after a release whose last published version is
/// `last`, given its head (the highest version with a receipt) now.
pub fn next_version(head: i64, last: Option<i64>) -> i64 {
    last.unwrap_or(head).max(head) + 1
}

impl<P: crate::pipeline::Plant> PipelineCore<P> {
    /// Whether a release of `key` may start now: no event of the aggregate is at the broker
    /// (a report still due would race the republished events), and none is parked after an
    /// unclear outcome: its own look-up or resend resolves a parked event, and a release that
    /// sent it beside that would send it twice (found by the simulator, seed 1 trace 890786:
    /// an event with an attempt open at start, parked by a first release that then stopped,
    /// was sent by the next release, then again when its look-up came due).
    pub fn may_release(&self, key: &AggKey) -> bool {
        !self.aggregate_in_flight(key)
            && (self.planted(Mutant::ReleaseBesideParked) || !self.aggregate_busy(key))
    }

    /// Starts the release of `key`. `events` is what the release publishes with each event's
    /// commit LSN; `blocking_version` is the hold's blocking event, which counts as published
    /// when the operator skipped it (`publish_blocking == false`).
    pub fn start_release(
        &self,
        key: AggKey,
        blocking_version: Option<i64>,
        publish_blocking: bool,
        events: Vec<(OutboxEvent, Option<Lsn>)>,
    ) -> Release {
        let mut events: Vec<Pending> = events
            .into_iter()
            .map(|(ev, commit_lsn)| Pending {
                ev,
                commit_lsn,
                change_lsn: None,
                ack: None,
            })
            .collect();
        events.sort_by_key(|p| p.ev.aggregate_version);
        Release {
            key,
            events: events.into(),
            sent: None,
            last: if publish_blocking {
                None
            } else {
                blocking_version
            },
        }
    }

    /// The next step of release `r`. While a release runs, its aggregate is `releasing`: its
    /// sends are the release's own, made under the ledger's hold.
    pub fn release_step(&mut self, r: &mut Release, now: Now) -> ReleaseStep {
        self.releasing.insert(r.key.clone());
        let step = self.next_release_step(r, now);
        if matches!(step, ReleaseStep::Done { .. }) {
            self.releasing.remove(&r.key);
        }
        step
    }

    fn next_release_step(&mut self, r: &mut Release, now: Now) -> ReleaseStep {
        if let Some((token, version)) = r.sent {
            // Parked after an unclear outcome, or sent again: still the release's event.
            if self.is_in_flight(token) || self.aggregate_busy(&r.key) {
                return ReleaseStep::Await(token);
            }
            r.sent = None;
            // Reported (or refused by the producer): refused again means a new hold record.
            if self.batch_holds(&r.key) {
                return ReleaseStep::Done { close: None };
            }
            r.last = Some(version);
        }
        let p = loop {
            let Some(p) = r.events.pop_front() else {
                return ReleaseStep::Done {
                    close: Some(r.last),
                };
            };
            // Found on the broker by a look-up that answered while the release ran (its
            // receipt is recorded): published, never sent again (the simulator's
            // `resent_after_proof`, seed 7 trace 33528: the release sent it from the set it
            // had loaded before).
            if self.found.contains(&p.ev.event_id) && !self.planted(Mutant::SendsFoundEvent) {
                r.last = Some(p.ev.aggregate_version);
                continue;
            }
            break p;
        };
        if p.ev.version_by_relay && p.ev.aggregate_version < 1 {
            self.poison_unnumbered(&p.ev, p.commit_lsn, None);
            return ReleaseStep::Done { close: None };
        }
        // The route may have changed while the aggregate was held.
        if let Err(refusal) = route::check(&p.ev, self.served()) {
            self.poison(&p.ev, refusal.code, refusal.reason, p.commit_lsn, None);
            return ReleaseStep::Done { close: None };
        }
        let version = p.ev.aggregate_version;
        match self.send_now(p, now) {
            Some(send @ Command::Send { token, .. }) => {
                r.sent = Some((token, version));
                ReleaseStep::Send(send)
            }
            None => ReleaseStep::Done { close: None },
        }
    }

    /// The ledger closed the hold of `key` (whose head is now `head`) after a release whose
    /// last published version was `last`: the ordering gate lets the aggregate flow again.
    pub fn release_closed(&mut self, key: &AggKey, head: i64, last: Option<i64>) -> i64 {
        let next = next_version(head, last);
        self.release(key, next);
        next
    }
}

/// An aggregate an operator released, as the ledger lists it (`holds::releasing`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub key: AggKey,
    /// The version of the hold's blocking (quarantined) event.
    pub blocking_version: Option<i64>,
    /// The hold's blocking event.
    pub blocking_event_id: Option<uuid::Uuid>,
    /// Whether the release publishes the blocking event (`false`: the operator skipped it).
    pub publish_blocking: bool,
}

/// What the driver does next in a release poll ([`ReleasePoll::next`]).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum PollStep {
    /// Reconcile the settled DISPATCH_UNKNOWN attempts another generation recorded after this
    /// run started ([`PipelineCore::reconcile`] with `When::Running`): a resumed zombie's
    /// late report. First, so that a release never waits behind an attempt nobody looks up.
    ReconcileSettled,
    /// Read the aggregates operators released, and hand them over with
    /// [`ReleasePoll::releasing`].
    ReadReleasing,
    /// Accept the batch, with the checkpoint (a release's held records must be durable before
    /// its events go out, and its own receipts before its hold closes).
    Flush,
    /// Load what the release of this aggregate publishes (`holds::republish_set`, each event
    /// as the relay must publish it now), and hand it over with [`ReleasePoll::loaded`].
    LoadSet(Released),
    /// Execute this send, then ask again.
    Send(Command),
    /// Wait for this token's delivery report (or whatever resolves a parked event), hand it to
    /// the core, then ask again.
    Await(u64),
    /// Close the hold of `key` in the ledger with `last`, the last version the release
    /// published; when the ledger closed it, read the aggregate's head and tell the core
    /// ([`PipelineCore::release_closed`]).
    CloseHold { key: AggKey, last: Option<i64> },
    /// The poll is over.
    Done,
}

/// One release poll, in the order both the daemon (`Pipeline::release_poll`) and the
/// simulator execute: the settled UNKNOWN attempts of other generations, then each released
/// aggregate whose events are all reported on — the batch accepted, its events loaded and
/// republished one at a time ([`Release`]), the batch accepted again, the hold closed.
#[derive(Debug, Default)]
pub struct ReleasePoll {
    phase: PollPhase,
    queue: VecDeque<Released>,
    current: Option<Release>,
}

#[derive(Debug, Default)]
enum PollPhase {
    #[default]
    Reconcile,
    Read,
    /// Waiting for [`ReleasePoll::releasing`].
    Reading,
    /// The next aggregate of the queue.
    Next,
    /// Waiting for [`ReleasePoll::loaded`] of this aggregate.
    Loading(Released),
    /// Republishing [`ReleasePoll::current`].
    Releasing,
    /// The release ended: the batch is accepted, then the hold closed when `close` says so.
    Closing {
        key: AggKey,
        close: Option<Option<i64>>,
        flushed: bool,
    },
}

impl ReleasePoll {
    pub fn new() -> Self {
        Self::default()
    }

    /// The aggregates operators released, in the order the ledger listed them
    /// (the answer to [`PollStep::ReadReleasing`]).
    pub fn releasing(&mut self, released: Vec<Released>) {
        self.queue = released.into();
        self.phase = PollPhase::Next;
    }

    /// What the release of the aggregate [`PollStep::LoadSet`] named publishes, each event with
    /// its commit LSN.
    pub fn loaded<P: crate::pipeline::Plant>(
        &mut self,
        core: &PipelineCore<P>,
        events: Vec<(OutboxEvent, Option<Lsn>)>,
    ) {
        if let PollPhase::Loading(r) = std::mem::take(&mut self.phase) {
            self.current =
                Some(core.start_release(r.key, r.blocking_version, r.publish_blocking, events));
            self.phase = PollPhase::Releasing;
        }
    }

    /// The aggregate [`PollStep::LoadSet`] named is no longer released (its hold is gone):
    /// the poll goes on with the next.
    pub fn skip(&mut self) {
        if matches!(self.phase, PollPhase::Loading(_)) {
            self.phase = PollPhase::Next;
        }
    }

    /// The next step, after the ones returned before were done.
    pub fn next<P: crate::pipeline::Plant>(
        &mut self,
        core: &mut PipelineCore<P>,
        now: Now,
    ) -> PollStep {
        loop {
            match std::mem::take(&mut self.phase) {
                PollPhase::Reconcile => {
                    self.phase = PollPhase::Read;
                    return PollStep::ReconcileSettled;
                }
                PollPhase::Read | PollPhase::Reading => {
                    self.phase = PollPhase::Reading;
                    return PollStep::ReadReleasing;
                }
                PollPhase::Next => {
                    let Some(r) = self.queue.pop_front() else {
                        self.phase = PollPhase::Next;
                        return PollStep::Done;
                    };
                    // Skipped: never to be sent, whenever the stream meets it (a run replaying
                    // from before it would otherwise send it once the hold is gone).
                    if let (false, Some(id)) = (r.publish_blocking, r.blocking_event_id) {
                        core.skipped_by_operator([id]);
                    }
                    if !core.may_release(&r.key) {
                        // An earlier event of it is still at the broker: the next poll.
                        self.phase = PollPhase::Next;
                        continue;
                    }
                    self.phase = PollPhase::Loading(r.clone());
                    return PollStep::Flush;
                }
                PollPhase::Loading(r) => {
                    self.phase = PollPhase::Loading(r.clone());
                    return PollStep::LoadSet(r);
                }
                PollPhase::Releasing => {
                    let Some(release) = self.current.as_mut() else {
                        self.phase = PollPhase::Next;
                        continue;
                    };
                    match core.release_step(release, now) {
                        ReleaseStep::Done { close } => {
                            let key = release.key.clone();
                            self.current = None;
                            self.phase = PollPhase::Closing {
                                key,
                                close,
                                flushed: false,
                            };
                        }
                        step => {
                            self.phase = PollPhase::Releasing;
                            return match step {
                                ReleaseStep::Send(send) => PollStep::Send(send),
                                ReleaseStep::Await(token) => PollStep::Await(token),
                                ReleaseStep::Done { .. } => unreachable!("handled above"),
                            };
                        }
                    }
                }
                PollPhase::Closing {
                    key,
                    close,
                    flushed: false,
                } => {
                    self.phase = PollPhase::Closing {
                        key,
                        close,
                        flushed: true,
                    };
                    return PollStep::Flush;
                }
                PollPhase::Closing {
                    key,
                    close,
                    flushed: true,
                } => {
                    self.phase = PollPhase::Next;
                    if let Some(last) = close {
                        return PollStep::CloseHold { key, last };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use outbox_core::delivery::{Delivery, DeliveryOutcome, FailureClass, Persistence};
    use outbox_core::records::LedgerItem;

    use super::*;
    use crate::testing::{event_for, now as at, persisted, served};

    fn now() -> Now {
        at(0)
    }

    fn key() -> AggKey {
        ("order".into(), "a".into())
    }

    /// The aggregate `order/a`, held.
    fn core() -> PipelineCore {
        PipelineCore::new(served(), 1, PipelineCore::gate_from(vec![], vec![key()]))
    }

    fn event(version: i64, cluster: &str) -> (OutboxEvent, Option<Lsn>) {
        (event_for("a", version, cluster), Some(Lsn(version as u64)))
    }

    fn sent_version(step: ReleaseStep) -> (u64, i64) {
        match step {
            ReleaseStep::Send(Command::Send { token, event, .. }) => {
                (token, event.aggregate_version)
            }
            other => panic!("expected a send, got {other:?}"),
        }
    }

    #[test]
    fn a_release_sends_in_version_order_one_at_a_time_and_closes_at_the_last() {
        let mut c = core();
        let mut r = c.start_release(key(), Some(2), true, vec![event(3, "c1"), event(2, "c1")]);
        let (t2, v) = sent_version(c.release_step(&mut r, now()));
        assert_eq!(v, 2, "the blocking event first");
        assert!(matches!(c.release_step(&mut r, now()), ReleaseStep::Await(t) if t == t2));
        c.on_report(persisted(t2, 0), now()).unwrap();
        let (t3, v) = sent_version(c.release_step(&mut r, now()));
        assert_eq!(v, 3);
        c.on_report(persisted(t3, 1), now()).unwrap();
        assert!(matches!(
            c.release_step(&mut r, now()),
            ReleaseStep::Done {
                close: Some(Some(3))
            }
        ));
        assert_eq!(c.release_closed(&key(), 3, Some(3)), 4);
    }

    #[test]
    fn an_event_found_on_the_broker_while_the_release_runs_is_not_sent_again() {
        let mut c = core();
        let found = event(2, "c1");
        let id = found.0.event_id;
        let mut r = c.start_release(
            key(),
            Some(1),
            true,
            vec![event(1, "c1"), found, event(3, "c1")],
        );
        let (t1, _) = sent_version(c.release_step(&mut r, now()));
        // A look-up answers meanwhile: v2 is on the broker, its receipt recorded.
        c.unknown_resolved(
            id,
            &crate::unknown::Resolved::Found {
                offset: 7,
                attempt_generation: 1,
            },
        );
        c.on_report(persisted(t1, 0), now()).unwrap();
        let (t3, v) = sent_version(c.release_step(&mut r, now()));
        assert_eq!(v, 3, "v2 is published already");
        c.on_report(persisted(t3, 1), now()).unwrap();
        assert!(matches!(
            c.release_step(&mut r, now()),
            ReleaseStep::Done {
                close: Some(Some(3))
            }
        ));
    }

    #[test]
    fn a_skipped_blocking_event_counts_as_the_last_published_version() {
        let mut c = core();
        let mut r = c.start_release(key(), Some(5), false, vec![]);
        assert!(matches!(
            c.release_step(&mut r, now()),
            ReleaseStep::Done {
                close: Some(Some(5))
            }
        ));
        assert_eq!(next_version(2, Some(5)), 6);
        assert_eq!(next_version(7, Some(5)), 8, "never behind the head");
        assert_eq!(next_version(4, None), 5);
    }

    #[test]
    fn an_event_rejected_again_keeps_the_hold_and_stops_the_release() {
        let mut c = core();
        let mut r = c.start_release(key(), Some(1), true, vec![event(1, "c1"), event(2, "c1")]);
        let (t, _) = sent_version(c.release_step(&mut r, now()));
        let rejected = Delivery {
            token: t,
            outcome: DeliveryOutcome::Failed {
                error: "too large".into(),
                persistence: Persistence::NotPersisted,
                class: FailureClass::Permanent,
                partition: 0,
            },
        };
        c.on_report(rejected, now()).unwrap();
        assert!(matches!(
            c.release_step(&mut r, now()),
            ReleaseStep::Done { close: None }
        ));
        let (items, _) = c.take_batch(false).unwrap().unwrap();
        assert!(items.iter().any(|i| matches!(i, LedgerItem::Hold(_))));
    }

    #[test]
    fn an_event_whose_route_is_no_longer_served_is_quarantined_not_sent() {
        let mut c = core();
        let mut r = c.start_release(key(), Some(1), true, vec![event(1, "other")]);
        assert!(matches!(
            c.release_step(&mut r, now()),
            ReleaseStep::Done { close: None }
        ));
        assert_eq!(c.in_flight(), 0);
        assert!(c.batch_holds(&key()));
    }

    #[test]
    fn without_the_lease_nothing_is_sent_and_the_hold_stays() {
        let mut c = core();
        let mut r = c.start_release(key(), Some(1), true, vec![event(1, "c1")]);
        let stale = Now {
            lease_valid: false,
            ..now()
        };
        assert!(matches!(
            c.release_step(&mut r, stale),
            ReleaseStep::Done { close: None }
        ));
        assert!(c.lease_expired);
    }

    fn released(publish_blocking: bool) -> Released {
        Released {
            key: key(),
            blocking_version: Some(1),
            blocking_event_id: None,
            publish_blocking,
        }
    }

    /// Drives a poll of `released` to its end as the daemon does, answering each step; the
    /// broker persists every send at once. Returns the steps by name.
    fn drive(
        c: &mut PipelineCore,
        released: Vec<Released>,
        set: Vec<(OutboxEvent, Option<Lsn>)>,
    ) -> Vec<String> {
        let mut poll = ReleasePoll::new();
        let mut seen = Vec::new();
        let mut released = Some(released);
        let mut set = Some(set);
        let mut offset = 0;
        for _ in 0..100 {
            let step = poll.next(c, now());
            seen.push(match &step {
                PollStep::ReconcileSettled => "reconcile".to_string(),
                PollStep::ReadReleasing => "read".to_string(),
                PollStep::Flush => "flush".to_string(),
                PollStep::LoadSet(r) => format!("load {}", r.key.1),
                PollStep::Send(Command::Send { event, .. }) => {
                    format!("send v{}", event.aggregate_version)
                }
                PollStep::Await(_) => "await".to_string(),
                PollStep::CloseHold { last, .. } => format!("close {last:?}"),
                PollStep::Done => "done".to_string(),
            });
            match step {
                PollStep::ReadReleasing => poll.releasing(released.take().unwrap_or_default()),
                PollStep::LoadSet(_) => poll.loaded(c, set.take().unwrap_or_default()),
                PollStep::Send(Command::Send { token, .. }) => {
                    c.on_report(persisted(token, offset), now()).unwrap();
                    offset += 1;
                }
                PollStep::Done => return seen,
                _ => {}
            }
        }
        panic!("the poll never ended: {seen:?}");
    }

    #[test]
    fn a_poll_reconciles_first_then_accepts_releases_and_closes_each_hold() {
        let mut c = core();
        let steps = drive(
            &mut c,
            vec![released(true)],
            vec![event(2, "c1"), event(1, "c1")],
        );
        assert_eq!(
            steps,
            [
                "reconcile",
                "read",
                "flush",
                "load a",
                "send v1",
                "send v2",
                "flush",
                "close Some(2)",
                "done"
            ]
        );
    }

    #[test]
    fn a_poll_without_releases_reads_and_ends() {
        let mut c = core();
        assert_eq!(drive(&mut c, vec![], vec![]), ["reconcile", "read", "done"]);
    }

    #[test]
    fn an_aggregate_with_an_event_at_the_broker_waits_for_the_next_poll() {
        let mut c = PipelineCore::new(served(), 1, PipelineCore::gate_from(vec![], vec![]));
        let Some(Command::Send { .. }) = c
            .admit(event_for("a", 1, "c1"), Some(Lsn(1)), None, None, now())
            .unwrap()
            .into_iter()
            .next()
        else {
            panic!("the event was not sent");
        };
        assert!(!c.may_release(&key()));
        assert_eq!(
            drive(&mut c, vec![released(true)], vec![]),
            ["reconcile", "read", "done"]
        );
    }

    #[test]
    fn an_aggregate_with_a_parked_event_waits_for_the_next_poll() {
        let mut c = core();
        let (ev, lsn) = event(1, "c1");
        // Its attempt was open at start: the first release parks it for its look-up.
        c.open_at_start
            .insert(ev.event_id, std::time::SystemTime::UNIX_EPOCH);
        let mut r = c.start_release(key(), Some(1), true, vec![(ev.clone(), lsn)]);
        assert!(matches!(
            c.release_step(&mut r, now()),
            ReleaseStep::Done { close: None }
        ));
        assert!(c.is_parked(ev.event_id));
        // Nothing of it is at the broker, but its look-up resolves it: no release beside it.
        assert!(!c.may_release(&key()));
        assert_eq!(
            drive(&mut c, vec![released(true)], vec![(ev, lsn)]),
            ["reconcile", "read", "done"]
        );
    }

    #[test]
    fn a_release_refused_again_is_accepted_and_its_hold_stays() {
        let mut c = core();
        let steps = drive(&mut c, vec![released(true)], vec![event(1, "other")]);
        assert_eq!(
            steps,
            ["reconcile", "read", "flush", "load a", "flush", "done"]
        );
    }

    #[test]
    fn a_hold_gone_before_its_set_is_loaded_is_skipped() {
        let mut c = core();
        let mut poll = ReleasePoll::new();
        assert!(matches!(
            poll.next(&mut c, now()),
            PollStep::ReconcileSettled
        ));
        assert!(matches!(poll.next(&mut c, now()), PollStep::ReadReleasing));
        poll.releasing(vec![released(false)]);
        assert!(matches!(poll.next(&mut c, now()), PollStep::Flush));
        assert!(matches!(poll.next(&mut c, now()), PollStep::LoadSet(_)));
        poll.skip();
        assert!(matches!(poll.next(&mut c, now()), PollStep::Done));
    }
}
