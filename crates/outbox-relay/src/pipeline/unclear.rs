//! An unclear outcome holds one aggregate, never the relay.
//!
//! A send that ends without a receipt and without a refusal — a timeout, a dropped
//! connection, a 5xx, a Kafka request that may have been appended (DISPATCH_UNKNOWN), or a
//! message the broker certainly did not store — *parks* its event. The event keeps its
//! aggregate's place in the ordering gate, so that aggregate's next event waits behind it;
//! it stays unresolved in the ack tracker, so the checkpoint stays behind it; every other
//! aggregate keeps flowing. The run goes on.
//!
//! The core then says when to act ([`PipelineCore::due_unclear`]):
//! * a possibly persisted attempt (the driver recorded it as DISPATCH_UNKNOWN) is looked up
//!   — Kafka: the partition scan, after the settle time in which its request may still land;
//!   JetStream: the re-publish with the same `Nats-Msg-Id`; HTTP: the retry with the same
//!   idempotency key. What the look-up proved comes back through
//!   [`PipelineCore::lookup_done`]: the copy's receipt was recorded (the aggregate moves on),
//!   the copy is proven absent (sent again, attempt generation + 1, to the same frozen
//!   destination), or nothing is proven (asked again later);
//! * a message certainly not stored is sent again as it is.
//!
//! Each try waits longer than the one before ([`Policy::backoff`]), at least as long as the
//! endpoint asked (Retry-After). Past [`Policy::budget`] tries the event stays parked, asked
//! again every [`Policy::repeat_wait`], and the relay says so (an error log line, the
//! `outboxd_unclear_events` gauge and its alert). It is deliberately *not* held durably like a
//! poison event: the outcome is unknown, not refused, and a copy may be at the destination. A
//! hold recorded for an event that another path then proves published (a paused predecessor's
//! late report, a look-up of an earlier generation's attempt) is stale and dropped by the
//! ledger, while this run's gate would keep the aggregate held and record every later event as
//! held behind a hold that does not exist: lost events (found by `outbox-sim`). Waiting costs
//! one aggregate; holding could cost its events.

use std::time::SystemTime;

use outbox_core::OutboxEvent;
use uuid::Uuid;

use super::PipelineCore;
use super::{key_of, AggKey, Command, CoreError, DeliveryFailure, InFlight, Mutant, Now, Pending};
use crate::parked::{merge_lookups, LookupOutcome, Parked, Policy, UnclearStep, UNANSWERED_AFTER};
use crate::schedule::{waiting_matters, Bounds, Waiting, WAITING_SAMPLE};

/// A parked event's look-ups, from the moment one is due ([`ParkedLookup::due`]) or one has
/// answered ([`ParkedLookup::answered`]) until its next look-up runs or every attempt of it is
/// traced. The driver executes what [`ParkedLookup::next`] asks and answers with what it found:
///
/// * read the event's latest open DISPATCH_UNKNOWN attempt; none left: what the look-ups proved
///   is done ([`PipelineCore::lookup_done`]), or, where none ran here, what this run learned
///   meanwhile ([`PipelineCore::resolved_meanwhile`]);
/// * an attempt whose look-up would send the event again under its key while the event has its
///   primary receipt is closed by that receipt ([`PipelineCore::closes_by_receipt`]); the next
///   open attempt is read again, so every attempt is traced;
/// * otherwise the attempt is looked up on its own task, carrying what the look-ups of the
///   event's later attempts proved; its answer starts a new `ParkedLookup`.
///
/// The daemon's `Pipeline` and the simulator both drive it: neither decides this sequence.
#[derive(Debug)]
pub struct ParkedLookup<A> {
    event: OutboxEvent,
    /// What the look-ups of the event's later attempts proved (nothing proven: the round
    /// ends at once).
    prior: Option<LookupOutcome>,
    /// The attempt being closed at its receipt, and its attempt generation.
    closing: Option<(A, i32)>,
}

/// An open attempt as the driver read it for [`ParkedLookup::next`].
#[derive(Debug, Clone)]
pub struct OpenAttempt<A> {
    /// The driver's handle of the attempt (a ledger row, an index).
    pub attempt: A,
    pub attempt_generation: i32,
    /// The event has its primary receipt in the ledger.
    pub has_receipt: bool,
    /// The attempt's look-up would send the event again under its key.
    pub lookup_resends: bool,
    /// How long it has been unknown (recorded DISPATCH_UNKNOWN).
    pub unknown_for: std::time::Duration,
}

/// What the driver answers [`ParkedLookup::next`] with.
#[derive(Debug)]
pub enum ParkedInput<A> {
    /// The first call.
    Begin,
    /// The event's latest open DISPATCH_UNKNOWN attempt, if any.
    Open(Option<OpenAttempt<A>>),
    /// Closing the attempt at its receipt gave this offset; `None`: it was resolved meanwhile
    /// or its receipt is gone (purged), so it is looked up instead.
    ClosedAt(Option<i64>),
}

/// What [`ParkedLookup::next`] asks the driver to do.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum ParkedStep<A> {
    /// Read the event's latest open DISPATCH_UNKNOWN attempt: answer [`ParkedInput::Open`].
    ReadOpenAttempt,
    /// Close this attempt at its event's primary receipt: answer [`ParkedInput::ClosedAt`].
    CloseByReceipt(A),
    /// Look the attempt up on its own task; its answer goes to [`ParkedLookup::answered`]
    /// with `prior`. This `ParkedLookup` is over.
    LookUp {
        event: OutboxEvent,
        attempt: A,
        prior: Option<LookupOutcome>,
    },
    /// Every attempt is traced: hand `outcome` to [`PipelineCore::lookup_done`]. Over.
    Done {
        event_id: Uuid,
        outcome: LookupOutcome,
    },
}

impl<A: Clone> ParkedLookup<A> {
    /// The core said `event`'s look-up is due ([`UnclearStep::Lookup`]).
    pub fn due(event: OutboxEvent) -> Self {
        ParkedLookup {
            event,
            prior: None,
            closing: None,
        }
    }

    /// The look-up of one of `event`'s attempts answered `outcome`, after the look-ups of its
    /// later attempts proved `prior`. Nothing proven ends the round at once (asked again after
    /// the backoff); otherwise the event's other open attempts are traced too.
    pub fn answered(
        event: OutboxEvent,
        prior: Option<LookupOutcome>,
        outcome: LookupOutcome,
    ) -> Self {
        ParkedLookup {
            event,
            prior: Some(merge_lookups(prior, outcome)),
            closing: None,
        }
    }

    /// The event whose look-ups these are.
    pub fn event_id(&self) -> Uuid {
        self.event.event_id
    }

    /// The next thing for the driver to do, given what it did last (`Begin` at first).
    pub fn next<P: crate::pipeline::Plant>(
        &mut self,
        core: &mut PipelineCore<P>,
        input: ParkedInput<A>,
    ) -> ParkedStep<A> {
        let event_id = self.event.event_id;
        match input {
            ParkedInput::Begin if matches!(self.prior, Some(LookupOutcome::Unresolved { .. })) => {
                ParkedStep::Done {
                    event_id,
                    outcome: self.outcome(core),
                }
            }
            ParkedInput::Begin => ParkedStep::ReadOpenAttempt,
            ParkedInput::Open(None) => ParkedStep::Done {
                event_id,
                outcome: self.outcome(core),
            },
            ParkedInput::Open(Some(open)) => {
                let settle = core.unclear_policy_for(&self.event).settle;
                if core.closes_by_receipt(open.has_receipt, open.lookup_resends) {
                    self.closing = Some((open.attempt.clone(), open.attempt_generation));
                    ParkedStep::CloseByReceipt(open.attempt)
                } else if !open.lookup_resends && open.unknown_for < settle {
                    // Another run's attempt recorded moments ago (a resumed zombie's salvage):
                    // its request may still land, so a scan now would prove nothing. The round
                    // ends; the event is asked again when the attempt has settled. Found by
                    // `outbox-sim` where a closed producer's held-back messages land within a
                    // round trip of its close.
                    self.prior = Some(merge_lookups(
                        self.prior.take(),
                        LookupOutcome::Unresolved {
                            after: Some(settle - open.unknown_for),
                            error: "another run's attempt of it is not settled yet".into(),
                        },
                    ));
                    ParkedStep::Done {
                        event_id,
                        outcome: self.outcome(core),
                    }
                } else {
                    self.look_up(open.attempt)
                }
            }
            ParkedInput::ClosedAt(closed_at) => match (self.closing.take(), closed_at) {
                (Some((_, attempt_generation)), Some(offset)) => {
                    let found = core.closed_by_receipt(event_id, attempt_generation, offset);
                    self.prior = Some(merge_lookups(self.prior.take(), found.into()));
                    ParkedStep::ReadOpenAttempt
                }
                (Some((attempt, _)), None) => self.look_up(attempt),
                // Not an answer to `CloseByReceipt`: reading the open attempts again is safe.
                (None, _) => ParkedStep::ReadOpenAttempt,
            },
        }
    }

    fn look_up(&mut self, attempt: A) -> ParkedStep<A> {
        ParkedStep::LookUp {
            event: self.event.clone(),
            attempt,
            prior: self.prior.take(),
        }
    }

    /// No attempt left to look up: what the look-ups here proved, else what this run
    /// learned meanwhile.
    fn outcome<P: crate::pipeline::Plant>(&mut self, core: &PipelineCore<P>) -> LookupOutcome {
        self.prior
            .take()
            .unwrap_or_else(|| core.resolved_meanwhile(self.event.event_id))
    }
}

/// Whose look-up answered ([`PipelineCore::lookup_answered`]).
#[derive(Debug)]
pub enum LookupFor {
    /// A parked event's, with what the look-ups of its later attempts proved.
    Parked { prior: Option<LookupOutcome> },
    /// One the running reconciliation started, of another generation's open attempt.
    Reconciling,
}

impl<P: crate::pipeline::Plant> PipelineCore<P> {
    /// A look-up of one of `event`'s attempts answered, and the driver recorded what it
    /// proved (`Ok`: the rule's verdict, `crate::unknown::resolve`, with the attempts the same
    /// answer settles closed) or it proved nothing (`Err`: why). A parked event's round goes
    /// on with the returned [`ParkedLookup`] (nothing proven: it is asked again after the
    /// backoff; otherwise its other open attempts are traced too); a look-up of the running
    /// reconciliation is done ([`PipelineCore::reconciled`]; nothing proven: the next release
    /// poll asks again).
    pub fn lookup_answered<A: Clone>(
        &mut self,
        event: OutboxEvent,
        whose: LookupFor,
        answer: Result<crate::unknown::Resolved, String>,
    ) -> Option<ParkedLookup<A>> {
        match whose {
            LookupFor::Reconciling => {
                let resolved = answer.unwrap_or(crate::unknown::Resolved::StillUnknown);
                self.reconciled(&event, &resolved);
                None
            }
            LookupFor::Parked { prior } => {
                let outcome = match answer {
                    Ok(resolved) => {
                        self.unknown_resolved(event.event_id, &resolved);
                        LookupOutcome::from(resolved)
                    }
                    Err(error) => LookupOutcome::Unresolved { after: None, error },
                };
                Some(ParkedLookup::answered(event, prior, outcome))
            }
        }
    }

    /// The policy for events frozen for `ev`'s destination: its cluster's own (a webhook
    /// endpoint's schedule), else the relay's.
    pub fn unclear_policy_for(&self, ev: &OutboxEvent) -> &Policy {
        self.unclear_policies
            .get(&ev.destination.cluster)
            .unwrap_or(&self.unclear_policy)
    }

    /// A send of `f` ended unclear: its event holds the aggregate until resolved.
    pub(super) fn park(&mut self, f: InFlight, failure: &DeliveryFailure, now: Now) {
        let id = f.ev.event_id;
        let tries = self.bump_tries(id);
        // A possibly persisted Kafka request may still land for a while after its report (the
        // producer session is alive): the scan waits the settle time from the report.
        let policy = *self.unclear_policy_for(&f.ev);
        let mut wait = policy.backoff(tries, id);
        if failure.unknown.is_some() && !self.planted(Mutant::IgnoresSettle) {
            wait = wait.max(policy.settle);
        }
        let due = now.wall + wait;
        tracing::warn!(event_id = %id, aggregate = %format!("{}/{}", f.key.0, f.key.1),
            attempt = f.attempt, tries, persistence = ?failure.persistence, error = %failure.error,
            "unclear outcome: only this aggregate waits");
        self.unclear_seen.insert(f.key.clone());
        if let Some(t) = self.unclear_touched.as_mut() {
            t.insert(f.key.clone());
            // Poll mode: what waits behind it was read by an earlier round and may be stale
            // by the time it is resolved (a destination migrated, a quarantine skipped); a
            // later round reads it again, as the ledger has it then (found by `outbox-sim`).
            self.gate.forget_queue(&f.key);
        }
        let parked = Parked {
            key: f.key,
            lookup: failure.unknown.is_some(),
            due,
            running: false,
            error: failure.error.clone(),
            p: Pending {
                ev: std::sync::Arc::unwrap_or_clone(f.ev),
                commit_lsn: f.commit_lsn,
                change_lsn: f.change_lsn,
                ack: f.ack,
            },
        };
        self.park_or_hold(parked, tries);
    }

    /// Parks `parked`. Past the budget it stays parked — asked again every
    /// [`Policy::repeat_wait`] —
    /// and says so once, loudly: see the module documentation for why it is not held.
    fn park_or_hold(&mut self, parked: Parked, tries: u32) {
        let policy = self.unclear_policy_for(&parked.p.ev);
        if tries == policy.budget + 1 {
            tracing::error!(event_id = %parked.p.ev.event_id,
                aggregate = %format!("{}/{}", parked.key.0, parked.key.1),
                destination = %parked.p.ev.destination.cluster,
                tries, last_error = %parked.error,
                "unclear outcome past --unclear-budget: the aggregate keeps waiting and the relay keeps asking every {:?}; check the destination",
                policy.repeat_wait());
        }
        self.parked.insert(parked.p.ev.event_id, parked);
        // A park changes what waits at once: the next look at the bounds counts again.
        self.waiting_sample = None;
    }

    /// Parked events whose tries are past the budget.
    pub fn past_budget(&self) -> usize {
        self.parked
            .iter()
            .filter(|(id, p)| {
                self.unclear_tries
                    .get(id)
                    .is_some_and(|t| *t > self.unclear_policy_for(&p.p.ev).budget)
            })
            .count()
    }

    fn bump_tries(&mut self, id: Uuid) -> u32 {
        let t = self.unclear_tries.entry(id).or_insert(0);
        *t += 1;
        *t
    }

    /// An event with an attempt open at start reached the head of its aggregate: it is parked
    /// for a look-up instead of being sent. `None` if it was not one of them.
    pub(super) fn park_open_at_start(&mut self, p: Pending, now: Now) -> Option<Pending> {
        let Some(due) = self.open_at_start.remove(&p.ev.event_id) else {
            return Some(p);
        };
        let tries = self.bump_tries(p.ev.event_id);
        self.unclear_seen.insert(key_of(&p.ev));
        if let Some(t) = self.unclear_touched.as_mut() {
            t.insert(key_of(&p.ev));
        }
        let parked = Parked {
            key: key_of(&p.ev),
            lookup: true,
            due: due.max(now.wall),
            running: false,
            error: "DISPATCH_UNKNOWN attempt open at start".into(),
            p,
        };
        self.park_or_hold(parked, tries);
        None
    }

    /// Whether `event_id` is parked (its look-up, running or due, resolves it).
    pub fn is_parked(&self, event_id: Uuid) -> bool {
        self.parked.contains_key(&event_id)
    }

    /// Events parked after an unclear outcome (each holds its aggregate).
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// [`Self::waiting_on_unclear`], counted at most every [`WAITING_SAMPLE`] (the clock going
    /// back counts again): the bounds may lag that much behind what queues behind a parked
    /// event, a report, or a send becoming unanswered. A park, and a parked event leaving,
    /// count again at once (they are rare, and a park is what most changes the count).
    pub fn waiting_sampled(&mut self, now: SystemTime) -> Waiting {
        match self.waiting_sample {
            Some((at, n)) if now.duration_since(at).is_ok_and(|d| d < WAITING_SAMPLE) => n,
            _ => {
                let n = self.waiting_on_unclear(now);
                self.waiting_sample = Some((now, n));
                n
            }
        }
    }

    /// Of `unresolved` events, those waiting on unclear outcomes ([`Self::waiting_sampled`]),
    /// counted only where they can change what `bounds` decide
    /// ([`crate::schedule::waiting_matters`]); none elsewhere.
    pub fn waiting_where_it_matters(
        &mut self,
        bounds: Bounds,
        unresolved: u64,
        now: SystemTime,
    ) -> Waiting {
        if waiting_matters(bounds.max_in_flight, bounds.max_waiting, unresolved) {
            self.waiting_sampled(now)
        } else {
            Waiting::default()
        }
    }

    /// Events that wait on an unclear outcome: each parked event, each send unanswered for
    /// [`UNANSWERED_AFTER`] at `now` (an outcome becoming unclear: a partition without a
    /// leader keeps its sends until the message timeout parks them), and what their
    /// aggregates have queued behind them. They stay unresolved (the checkpoint stays behind
    /// them) but hold only their aggregates, so the schedule counts them apart from
    /// `max_in_flight` ([`crate::schedule::Load::waiting_on_unclear`]): an aggregate whose
    /// events keep coming while its destination is down must not stop the slot being read
    /// for every other one. Linear in the parked, in-flight and queued events; the driver
    /// asks only where [`crate::schedule::waiting_matters`] says the count can matter.
    pub fn waiting_on_unclear(&self, now: SystemTime) -> Waiting {
        if self.planted(Mutant::UnclearWaitCountsAsInFlight) {
            return Waiting::default();
        }
        let payload = |ev: &OutboxEvent| ev.payload.len() as u64;
        let mut w = Waiting::default();
        let mut keys: Vec<&AggKey> = Vec::new();
        for p in self.parked.values() {
            w.events += 1;
            w.bytes += payload(&p.p.ev);
            keys.push(&p.key);
        }
        let unanswered = self.in_flight.values().filter(|f| {
            now.duration_since(f.sent_at)
                .is_ok_and(|age| age >= UNANSWERED_AFTER)
        });
        for f in unanswered {
            w.events += 1;
            w.bytes += payload(&f.ev);
            keys.push(&f.key);
        }
        // Each parked or unanswered event is the head of its aggregate: one per aggregate.
        keys.sort_unstable();
        keys.dedup();
        for p in keys.iter().flat_map(|k| self.gate.queue_of(k)) {
            w.events += 1;
            w.bytes += payload(&p.ev);
        }
        w
    }

    /// Whether an event of `key` is parked.
    pub fn aggregate_parked(&self, key: &AggKey) -> bool {
        self.parked.values().any(|p| &p.key == key)
    }

    /// The aggregates of the parked events.
    pub(crate) fn parked_aggregates(&self) -> Vec<AggKey> {
        self.parked.values().map(|p| p.key.clone()).collect()
    }

    /// When the next parked event is due (the driver wakes up then), if any is waiting.
    pub fn next_unclear_due(&self) -> Option<SystemTime> {
        if self.planted(Mutant::UnclearNeverDue) {
            return None;
        }
        self.parked
            .values()
            .filter(|p| !p.running)
            .map(|p| p.due)
            .min()
    }

    /// The look-ups and resends due at `now`, in event-id order. Nothing while the run is
    /// ending or the lease is not certainly held (an HTTP look-up is itself a send).
    pub fn due_unclear(&mut self, now: Now) -> Result<Vec<UnclearStep>, CoreError> {
        if self.salvaging || !now.lease_valid || self.planted(Mutant::UnclearNeverDue) {
            return Ok(Vec::new());
        }
        let due: Vec<Uuid> = self
            .parked
            .iter()
            .filter(|(_, p)| !p.running && p.due <= now.wall)
            .map(|(id, _)| *id)
            .collect();
        let mut steps = Vec::new();
        for id in due {
            // The running reconciliation is looking this event up (an attempt left open at
            // start, looked up before the run reached and parked the event): one look-up of an
            // event at a time (under a key, two would be two re-sends, the second perhaps
            // after the first was answered: the e2e misbehaving-endpoint test in poll mode).
            // Asked again shortly; by then the ledger says what reconciliation proved, and
            // `ParkedLookup` finds no open attempt and takes what the run learned.
            let beside_reconciliation =
                self.reconciling.contains(&id) && !self.planted(Mutant::LookUpBesideReconciliation);
            let first = self.unclear_policy.first;
            let p = self.parked.get_mut(&id).expect("listed above");
            if beside_reconciliation {
                p.due = now.wall + first;
            } else if p.lookup {
                p.running = true;
                steps.push(UnclearStep::Lookup {
                    event: p.p.ev.clone(),
                });
            } else if self.earlier_parked(id) {
                // A deeper gate's rule: resent only after every earlier version of its
                // aggregate parked is resolved or resent ([`Self::earlier_parked`]).
                let p = self.parked.get_mut(&id).expect("listed above");
                p.due = now.wall + first;
            } else {
                let p = self.parked.remove(&id).expect("listed above");
                self.waiting_sample = None;
                steps.extend(self.send_one(p.p, now)?.map(UnclearStep::Send));
            }
        }
        Ok(steps)
    }

    /// Whether an earlier version of parked `event_id`'s aggregate is parked too (only under a
    /// deeper gate, where several of an aggregate can be). A resend goes behind what its
    /// producer already took, so k+1 sent again before k is resolved could reach the broker
    /// before k's own resend, if k's first copy never lands: k+1 waits until k is found or
    /// sent again (found by `outbox-sim` with its gapless producer: two look-ups of one
    /// aggregate answered "absent" and the later version went first).
    fn earlier_parked(&self, event_id: Uuid) -> bool {
        if self.gate.depth() == 1 {
            return false;
        }
        let Some(me) = self.parked.get(&event_id) else {
            return false;
        };
        self.parked
            .values()
            .any(|p| p.key == me.key && p.p.ev.aggregate_version < me.p.ev.aggregate_version)
    }

    /// What the look-up of parked `event_id` proved. Returns the sends that follow: the retry,
    /// or the aggregate's next event.
    pub fn lookup_done(
        &mut self,
        event_id: Uuid,
        outcome: LookupOutcome,
        now: Now,
    ) -> Result<Vec<Command>, CoreError> {
        self.waiting_sample = None;
        let Some(mut parked) = self.parked.remove(&event_id) else {
            return Ok(Vec::new());
        };
        match outcome {
            LookupOutcome::Recorded => {
                // The receipt is committed already: resolving now cannot run ahead of it.
                self.unclear_tries.remove(&event_id);
                if let Some(a) = parked.p.ack {
                    self.tracker.resolve(a)?;
                }
                tracing::info!(%event_id, "unclear outcome resolved: the destination holds it; the aggregate moves on");
                self.send_next(&parked.key, now)
            }
            LookupOutcome::Retry { attempt_generation } => {
                self.retry_generation.insert(event_id, attempt_generation);
                if self.gate.depth() > 1 {
                    // Sent again when no earlier version of its aggregate is parked
                    // ([`Self::earlier_parked`]): as a message certainly not stored, now or
                    // at the next due round.
                    parked.lookup = false;
                    parked.running = false;
                    parked.due = now.wall;
                    self.parked.insert(event_id, parked);
                    if self.earlier_parked(event_id) {
                        return Ok(Vec::new());
                    }
                    let parked = self.parked.remove(&event_id).expect("just parked");
                    return Ok(self.send_one(parked.p, now)?.into_iter().collect());
                }
                Ok(self.send_one(parked.p, now)?.into_iter().collect())
            }
            LookupOutcome::Unresolved { error, after } => {
                let tries = self.bump_tries(event_id);
                let wait = self
                    .unclear_policy_for(&parked.p.ev)
                    .backoff(tries, event_id)
                    .max(after.unwrap_or_default());
                parked.running = false;
                parked.due = now.wall + wait;
                parked.error = error;
                self.park_or_hold(parked, tries);
                Ok(Vec::new())
            }
        }
    }

    /// Whether a send of `key`'s next event must first ask the ledger whether the aggregate
    /// is held there: it waited behind an unclear outcome in this run, and the aggregate has
    /// not been idle since. The wait (a backoff, a look-up) is long enough for a paused
    /// predecessor's salvage to record a refusal of it after this run loaded its gate, and for
    /// an operator to skip that event. Not while this run's gate holds it already (a release
    /// in progress sends under the hold).
    pub fn needs_hold_check(&self, key: &AggKey) -> bool {
        self.unclear_seen.contains(key) && !self.gate.is_held(key) && !self.releasing.contains(key)
    }

    /// The ledger holds the aggregate of the send `token`, which was not executed: the event
    /// and everything queued behind it are recorded as held, for the operator's release to
    /// republish in order, without what it skips (found by `outbox-sim`: a skipped event was
    /// sent when the unclear one before it resolved).
    pub fn hold_unsent(&mut self, token: u64) -> Result<(), CoreError> {
        let f = self
            .in_flight
            .remove(&token)
            .ok_or(CoreError::UnknownToken(token))?;
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(f.bytes);
        tracing::warn!(event_id = %f.ev.event_id, aggregate = %format!("{}/{}", f.key.0, f.key.1),
            "the aggregate was held in the ledger meanwhile: its events wait for the operator's release");
        let key = f.key.clone();
        self.record_held(Pending {
            ev: std::sync::Arc::unwrap_or_clone(f.ev),
            commit_lsn: f.commit_lsn,
            change_lsn: f.change_lsn,
            ack: f.ack,
        });
        for queued in self.gate.hold(&key) {
            self.record_held(queued);
        }
        self.gate.done(&key);
        Ok(())
    }

    /// Whether an event of `key` is sent and not reported on, or parked.
    pub fn aggregate_busy(&self, key: &AggKey) -> bool {
        self.aggregate_parked(key) || self.in_flight.values().any(|f| &f.key == key)
    }
}
