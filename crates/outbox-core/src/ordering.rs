//! The ordering gate: per aggregate, event k+1 never overtakes an unacknowledged event k.
//!
//! # The rule
//! At most one event per aggregate is in flight (sent, no delivery report yet). Other
//! aggregates pipeline freely. The next event of an aggregate is released only when the
//! broker has reported on the previous one, so a retry, a producer epoch bump or a timed-out
//! send of k can never let k+1 reach the broker first. Broker acknowledgement (not ledger
//! acceptance) is enough for broker order: if the relay crashes before accepting k, the replay
//! sends k again before k+1, and the first occurrences on the broker stay in version order.
//!
//! # More than one in flight (a gate built [`OrderingGate::with_depth`] above 1)
//! Only for a sink whose producer keeps what it was given in order on the broker, or
//! nothing after the first it lost (docs/ordering.md, "Hot aggregates"): then k+1 may follow
//! k before k's report, on three conditions the gate enforces per aggregate. The events in
//! flight share one *pipe* (the caller's name for "same producer, same partition": a later
//! version bound elsewhere waits until nothing of its aggregate is in flight); the previous
//! send was *handed over* to the producer ([`OrderingGate::handed_over`]: a send the
//! producer refused must not be overtaken by the next one it takes); and the aggregate had
//! an outcome in this run ([`OrderingGate::done`]), so that after a restart the first event
//! of each aggregate goes alone, and one the broker refuses is refused with nothing behind it.
//!
//! # Gaps and holds
//! Versions are dense per aggregate (`outbox.enqueue` allocates them under the aggregate's
//! lock), so the gate knows the next version it must see. A version beyond it is a gap: the
//! aggregate is *held* (nothing of it is sent until an operator releases it), never skipped.
//! A version below it is a replay of an event already sent or accepted (the outbox has one row
//! per version), which is harmless to send again. A poisoned event (quarantined) also holds
//! its aggregate, and everything queued behind it comes back to the caller to be recorded as
//! held. Other aggregates are unaffected.
//!
//! Pure: the caller supplies the last accepted version of an aggregate the first time the
//! gate sees it ([`Admit::NeedHead`]).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Why an aggregate is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HoldReason {
    /// A version was skipped: `expected` never arrived before `got`.
    Gap { expected: i64, got: i64 },
}

/// What to do with an offered event.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit<T> {
    /// Send it now (it is now the aggregate's one in-flight event).
    Send(T),
    /// Queued behind the in-flight event; it comes back from [`OrderingGate::done`].
    Queued,
    /// The aggregate is held: record the event as held.
    Held(T),
    /// This event opens a hold (a gap): record the hold and the event as held.
    Hold(T, HoldReason),
    /// The gate has never seen this aggregate: look up its last accepted version, call
    /// [`OrderingGate::set_head`], and offer again.
    NeedHead(T),
}

#[derive(Debug)]
struct Agg<T> {
    /// Next version this aggregate must present.
    expected: i64,
    /// Events behind the in-flight ones, each with its pipe; `None` when there are none. The
    /// gate keeps an entry for every aggregate the relay has seen (100,000 in the bench), and
    /// few have a queue at any moment: boxed, an entry is 24 bytes smaller than with an inline
    /// `VecDeque`, and a drained queue gives its buffer back.
    #[allow(clippy::box_collection)] // the box is the point: 8 bytes inline instead of 32
    queue: Option<Box<VecDeque<(u32, T)>>>,
    /// The pipe of the events in flight (meaningful while `in_flight > 0`).
    pipe: u32,
    /// Sent and not yet reported on (or parked by the caller), at most the gate's depth.
    in_flight: u8,
    held: bool,
    /// The last event sent is not yet known to be taken by the producer.
    handing_over: bool,
    /// An event of this aggregate had its outcome in this run: only then may a second one
    /// follow an event in flight.
    proven: bool,
}

impl<T> Agg<T> {
    fn queue_len(&self) -> usize {
        self.queue.as_ref().map_or(0, |q| q.len())
    }
}

/// Per-aggregate ordering state for one relay run.
#[derive(Debug)]
pub struct OrderingGate<K, T> {
    aggs: HashMap<K, Agg<T>, foldhash::fast::RandomState>,
    queued: usize,
    /// How many events of one aggregate may be in flight at once (1: the rule).
    depth: u8,
}

impl<K: Hash + Eq + Clone, T> Default for OrderingGate<K, T> {
    fn default() -> Self {
        OrderingGate {
            aggs: HashMap::default(),
            queued: 0,
            depth: 1,
        }
    }
}

impl<K: Hash + Eq + Clone, T> OrderingGate<K, T> {
    /// A gate with one event per aggregate in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// A gate that lets up to `depth` events of one aggregate be in flight in one pipe (at
    /// least 1; see the module's "More than one in flight" for what the sink must guarantee).
    pub fn with_depth(depth: u8) -> Self {
        OrderingGate {
            depth: depth.max(1),
            ..Self::default()
        }
    }

    /// Sets how many events of one aggregate may be in flight at once (before the first
    /// send of a run: a gate that lowers it with more in flight only waits longer).
    pub fn set_depth(&mut self, depth: u8) {
        self.depth = depth.max(1);
    }

    /// How many events of one aggregate may be in flight at once.
    pub fn depth(&self) -> u8 {
        self.depth
    }

    /// Records the last accepted version of `key` (0 if none), or marks it held (a durable
    /// hold loaded at start).
    pub fn set_head(&mut self, key: K, last_accepted: i64, held: bool) {
        let a = self.aggs.entry(key).or_insert_with(|| Agg {
            expected: last_accepted + 1,
            queue: None,
            pipe: 0,
            in_flight: 0,
            held,
            handing_over: false,
            proven: false,
        });
        a.expected = a.expected.max(last_accepted + 1);
        a.held |= held;
    }

    /// Offers event `item` with `version` of aggregate `key`, to be sent through `pipe` (the
    /// caller's name for the producer and partition it goes to; only the gate's depth above 1
    /// reads it).
    pub fn offer(&mut self, key: &K, version: i64, pipe: u32, item: T) -> Admit<T> {
        let Some(a) = self.aggs.get_mut(key) else {
            return Admit::NeedHead(item);
        };
        if a.held {
            return Admit::Held(item);
        }
        if version > a.expected {
            a.held = true;
            return Admit::Hold(
                item,
                HoldReason::Gap {
                    expected: a.expected,
                    got: version,
                },
            );
        }
        if version == a.expected {
            a.expected += 1;
        }
        if a.queue.is_none() && a.may_send(pipe, self.depth) {
            a.sent(pipe);
            Admit::Send(item)
        } else {
            a.queue
                .get_or_insert_with(Box::default)
                .push_back((pipe, item));
            self.queued += 1;
            Admit::Queued
        }
    }

    /// The broker reported on one of `key`'s in-flight events (or the caller resolved it).
    /// Returns the next event to send, if any (it is then in flight).
    pub fn done(&mut self, key: &K) -> Option<T> {
        let a = self.aggs.get_mut(key)?;
        a.in_flight = a.in_flight.saturating_sub(1);
        a.proven = true;
        if a.in_flight == 0 {
            // Nothing of it is at the producer any more: a send refused before it was taken
            // (parked, then resolved) no longer holds the next one back.
            a.handing_over = false;
        }
        Self::next_of(a, &mut self.queued, self.depth)
    }

    /// The producer took `key`'s last event sent (it is on its way, in the pipe's order).
    /// With a depth above 1, returns the next event to send behind it, if it may go now.
    pub fn handed_over(&mut self, key: &K) -> Option<T> {
        let a = self.aggs.get_mut(key)?;
        a.handing_over = false;
        Self::next_of(a, &mut self.queued, self.depth)
    }

    /// The head of `a`'s queue when it may be sent now (it is then in flight).
    fn next_of(a: &mut Agg<T>, queued: &mut usize, depth: u8) -> Option<T> {
        if a.held {
            return None;
        }
        let pipe = a.queue.as_ref()?.front()?.0;
        if !a.may_send(pipe, depth) {
            return None;
        }
        let (_, next) = a.queue.as_mut()?.pop_front()?;
        *queued -= 1;
        if a.queue.as_ref().is_some_and(|q| q.is_empty()) {
            a.queue = None;
        }
        a.sent(pipe);
        Some(next)
    }

    /// Holds `key` (its in-flight event was quarantined). Returns what was queued behind it,
    /// in order, to be recorded as held.
    pub fn hold(&mut self, key: &K) -> Vec<T> {
        match self.aggs.get_mut(key) {
            Some(a) => {
                a.held = true;
                self.queued -= a.queue_len();
                a.queue
                    .take()
                    .map_or_else(Vec::new, |q| q.into_iter().map(|(_, t)| t).collect())
            }
            None => Vec::new(),
        }
    }

    /// Forgets what waits behind `key`'s in-flight event: a reader that can read those events
    /// again (a poll round) offers them again later, with what the ledger says of them then.
    /// The expected version stays: offered again, they are below it, so they are sent (in
    /// order, one at a time) rather than taken for a gap, and a version the ledger published
    /// meanwhile, which the reader skips, leaves no hole behind.
    pub fn forget_queue(&mut self, key: &K) -> usize {
        match self.aggs.get_mut(key) {
            Some(a) => {
                let n = a.queue_len();
                self.queued -= n;
                a.queue = None;
                n
            }
            None => 0,
        }
    }

    /// Ends a hold after an operator release; `next_version` is the version that must come next.
    pub fn release(&mut self, key: &K, next_version: i64) {
        if let Some(a) = self.aggs.get_mut(key) {
            a.held = false;
            a.expected = next_version;
        }
    }

    /// Records that `version` of `key` was consumed without being sent (quarantined before
    /// the send), so the next version is not mistaken for a gap.
    pub fn consume(&mut self, key: &K, version: i64) {
        if let Some(a) = self.aggs.get_mut(key) {
            if version == a.expected {
                a.expected += 1;
            }
        }
    }

    pub fn is_known(&self, key: &K) -> bool {
        self.aggs.contains_key(key)
    }

    /// Every aggregate the gate knows.
    pub fn known(&self) -> impl Iterator<Item = &K> {
        self.aggs.keys()
    }

    pub fn is_held(&self, key: &K) -> bool {
        self.aggs.get(key).is_some_and(|a| a.held)
    }

    pub fn in_flight(&self, key: &K) -> bool {
        self.aggs.get(key).is_some_and(|a| a.in_flight > 0)
    }

    /// How many events of `key` are in flight (at most the depth).
    pub fn in_flight_count(&self, key: &K) -> u8 {
        self.aggs.get(key).map_or(0, |a| a.in_flight)
    }

    /// Events waiting behind an in-flight event of their aggregate.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// The events of `key` waiting behind its in-flight event, in order.
    pub fn queue_of(&self, key: &K) -> impl Iterator<Item = &T> {
        self.aggs
            .get(key)
            .and_then(|a| a.queue.as_deref())
            .into_iter()
            .flatten()
            .map(|(_, t)| t)
    }
}

impl<T> Agg<T> {
    /// Whether an event bound for `pipe` may be sent now: nothing of the aggregate in flight;
    /// or, under a depth above 1, room in it, the same pipe, the last send taken by the
    /// producer and an outcome already seen in this run.
    fn may_send(&self, pipe: u32, depth: u8) -> bool {
        self.in_flight == 0
            || (self.in_flight < depth && pipe == self.pipe && !self.handing_over && self.proven)
    }

    fn sent(&mut self, pipe: u32) {
        self.in_flight += 1;
        self.pipe = pipe;
        self.handing_over = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_in_flight_per_aggregate_and_order_kept() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::new();
        assert_eq!(g.offer(&"a", 1, 0, 1), Admit::NeedHead(1));
        g.set_head("a", 0, false);
        g.set_head("b", 0, false);
        assert_eq!(g.offer(&"a", 1, 0, 1), Admit::Send(1));
        assert_eq!(g.offer(&"a", 2, 0, 2), Admit::Queued);
        assert_eq!(
            g.offer(&"b", 1, 0, 10),
            Admit::Send(10),
            "other aggregates flow"
        );
        assert_eq!(g.offer(&"a", 3, 0, 3), Admit::Queued);
        assert_eq!(g.done(&"a"), Some(2));
        assert_eq!(g.done(&"a"), Some(3));
        assert_eq!(g.done(&"a"), None);
        assert!(!g.in_flight(&"a"));
    }

    #[test]
    fn a_gap_holds_the_aggregate_and_a_replay_is_not_a_gap() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::new();
        g.set_head("a", 5, false);
        assert_eq!(
            g.offer(&"a", 4, 0, 4),
            Admit::Send(4),
            "replay of an accepted version"
        );
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.offer(&"a", 6, 0, 6), Admit::Send(6));
        assert_eq!(
            g.offer(&"a", 8, 0, 8),
            Admit::Hold(
                8,
                HoldReason::Gap {
                    expected: 7,
                    got: 8
                }
            )
        );
        assert_eq!(
            g.offer(&"a", 9, 0, 9),
            Admit::Held(9),
            "never publish past a gap"
        );
        assert_eq!(g.done(&"a"), None);
        g.release(&"a", 10);
        assert_eq!(g.offer(&"a", 10, 0, 10), Admit::Send(10));
    }

    #[test]
    fn poison_holds_what_is_queued_behind_it() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::new();
        g.set_head("a", 0, false);
        assert_eq!(g.offer(&"a", 1, 0, 1), Admit::Send(1));
        assert_eq!(g.offer(&"a", 2, 0, 2), Admit::Queued);
        assert_eq!(g.offer(&"a", 3, 0, 3), Admit::Queued);
        assert_eq!(g.hold(&"a"), vec![2, 3]);
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.offer(&"a", 4, 0, 4), Admit::Held(4));
        assert_eq!(g.queued(), 0);
    }

    #[test]
    fn an_aggregate_without_a_queue_keeps_no_queue() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::new();
        g.set_head("a", 0, false);
        assert_eq!(g.offer(&"a", 1, 0, 1), Admit::Send(1));
        assert_eq!(g.offer(&"a", 2, 0, 2), Admit::Queued);
        assert!(g.aggs[&"a"].queue.is_some());
        assert_eq!(g.done(&"a"), Some(2));
        assert!(
            g.aggs[&"a"].queue.is_none(),
            "a drained queue is given back"
        );
        assert_eq!(g.offer(&"a", 3, 0, 3), Admit::Queued);
        assert_eq!(g.forget_queue(&"a"), 1);
        assert!(g.aggs[&"a"].queue.is_none());
        assert_eq!(g.queued(), 0);
        // The entry the gate keeps for each aggregate it has seen: an i64, a pointer, the
        // pipe, the count in flight and three flags.
        assert_eq!(std::mem::size_of::<Agg<[u8; 400]>>(), 24);
    }

    #[test]
    fn a_depth_of_one_never_lets_a_handed_over_event_release_the_next() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::new();
        g.set_head("a", 0, false);
        assert_eq!(g.offer(&"a", 1, 0, 1), Admit::Send(1));
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.offer(&"a", 2, 0, 2), Admit::Send(2));
        assert_eq!(g.offer(&"a", 3, 0, 3), Admit::Queued);
        assert_eq!(g.handed_over(&"a"), None, "depth 1: 3 waits for 2's report");
        assert_eq!(g.done(&"a"), Some(3));
    }

    #[test]
    fn a_deeper_gate_sends_behind_an_event_only_in_its_pipe_once_handed_over_and_proven() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::with_depth(3);
        g.set_head("a", 0, false);
        assert_eq!(g.offer(&"a", 1, 7, 1), Admit::Send(1));
        assert_eq!(g.offer(&"a", 2, 7, 2), Admit::Queued);
        assert_eq!(
            g.handed_over(&"a"),
            None,
            "the first event of an aggregate in a run goes alone"
        );
        assert_eq!(g.done(&"a"), Some(2));
        // Proven now: 3 may follow 2 once the producer took 2, and 4 once it took 3.
        assert_eq!(g.offer(&"a", 3, 7, 3), Admit::Queued, "2 not handed over");
        assert_eq!(g.handed_over(&"a"), Some(3));
        assert_eq!(g.handed_over(&"a"), None, "nothing queued");
        assert_eq!(g.offer(&"a", 4, 7, 4), Admit::Send(4));
        assert_eq!(g.handed_over(&"a"), None);
        assert_eq!(g.offer(&"a", 5, 7, 5), Admit::Queued, "three in flight");
        assert_eq!(g.done(&"a"), Some(5));
        // Another pipe (a new destination) waits until nothing is in flight.
        assert_eq!(g.offer(&"a", 6, 8, 6), Admit::Queued);
        assert_eq!(g.handed_over(&"a"), None);
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.done(&"a"), Some(6), "the pipe drained: 6 goes");
        assert_eq!(g.offer(&"a", 7, 8, 7), Admit::Queued, "6 not handed over");
        assert_eq!(g.handed_over(&"a"), Some(7));
    }

    #[test]
    fn a_send_the_producer_refused_is_not_overtaken() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::with_depth(4);
        g.set_head("a", 0, false);
        assert_eq!(g.offer(&"a", 1, 0, 1), Admit::Send(1));
        g.handed_over(&"a");
        assert_eq!(g.offer(&"a", 2, 0, 2), Admit::Queued);
        assert_eq!(g.done(&"a"), Some(2));
        // 2 was refused before the producer took it (the caller parks it): 3 stays queued
        // while 2 is in flight, however long.
        assert_eq!(g.offer(&"a", 3, 0, 3), Admit::Queued);
        assert_eq!(g.queue_of(&"a").count(), 1);
        // Resolved (or sent again and reported on): 3 goes.
        assert_eq!(g.done(&"a"), Some(3));
    }

    #[test]
    fn a_hold_under_a_deeper_gate_sends_nothing_more() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::with_depth(4);
        g.set_head("a", 0, false);
        assert_eq!(g.offer(&"a", 1, 0, 1), Admit::Send(1));
        g.handed_over(&"a");
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.offer(&"a", 2, 0, 2), Admit::Send(2));
        g.handed_over(&"a");
        assert_eq!(g.offer(&"a", 3, 0, 3), Admit::Send(3));
        assert_eq!(g.offer(&"a", 4, 0, 4), Admit::Queued);
        // 2 quarantined while 3 is in flight: 4 is held, 3's report releases nothing.
        assert_eq!(g.hold(&"a"), vec![4]);
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.handed_over(&"a"), None);
        assert_eq!(g.done(&"a"), None);
        assert!(!g.in_flight(&"a"));
        assert_eq!(g.offer(&"a", 5, 0, 5), Admit::Held(5));
    }

    proptest! {
        /// Model: any interleaving of offers (in version order per aggregate, as the WAL
        /// delivers them) and completions never has two events of one aggregate in flight,
        /// and sends each aggregate's events in version order, all of them.
        #[test]
        fn sends_in_version_order_one_at_a_time(
            ops in proptest::collection::vec((0u8..4, any::<bool>()), 1..300)
        ) {
            let mut g: OrderingGate<u8, (u8, i64)> = OrderingGate::new();
            let mut next_v = [1i64; 4];
            let mut in_flight: Vec<Option<i64>> = vec![None; 4];
            let mut sent: Vec<Vec<i64>> = vec![Vec::new(); 4];
            for (agg, complete) in ops {
                let k = agg as usize;
                if complete {
                    if in_flight[k].is_some() {
                        in_flight[k] = None;
                        if let Some((_, v)) = g.done(&agg) {
                            in_flight[k] = Some(v);
                            sent[k].push(v);
                        }
                    }
                    continue;
                }
                let v = next_v[k];
                next_v[k] += 1;
                let mut item = (agg, v);
                loop {
                    match g.offer(&agg, v, 0, item) {
                        Admit::NeedHead(i) => { g.set_head(agg, 0, false); item = i; }
                        Admit::Send((_, v)) => {
                            prop_assert!(in_flight[k].is_none(), "two in flight for {}", agg);
                            in_flight[k] = Some(v);
                            sent[k].push(v);
                            break;
                        }
                        Admit::Queued => break,
                        other => prop_assert!(false, "unexpected {:?}", other),
                    }
                }
            }
            // Drain.
            for agg in 0u8..4 {
                let k = agg as usize;
                while in_flight[k].is_some() {
                    in_flight[k] = None;
                    if let Some((_, v)) = g.done(&agg) {
                        in_flight[k] = Some(v);
                        sent[k].push(v);
                    }
                }
                let expected: Vec<i64> = (1..next_v[k]).collect();
                prop_assert_eq!(&sent[k], &expected);
            }
        }
    }

    proptest! {
        /// Model of a deeper gate: any interleaving of offers (in version order per
        /// aggregate), hand-overs, refusals and reports sends each aggregate's events in
        /// version order, all of them, never more than the depth in flight, never two pipes at
        /// once, never behind an event the producer has not taken, and a second one in flight
        /// only after an outcome of the aggregate in the run.
        #[test]
        fn a_deeper_gate_keeps_order_pipes_and_hand_overs(
            depth in 1u8..5,
            ops in proptest::collection::vec((0u8..3, 0u8..4, 0u32..2), 1..400)
        ) {
            #[derive(Clone, Copy, PartialEq, Debug)]
            struct Sent { v: i64, pipe: u32, taken: bool }
            let mut g: OrderingGate<u8, (i64, u32)> = OrderingGate::with_depth(depth);
            let mut next_v = [1i64; 3];
            let mut flight: Vec<Vec<Sent>> = vec![Vec::new(); 3];
            let mut proven = [false; 3];
            let mut sent: Vec<Vec<i64>> = vec![Vec::new(); 3];
            fn check_send(
                depth: u8, flight: &mut Vec<Sent>, proven: bool, sent: &mut Vec<i64>, v: i64, pipe: u32,
            ) -> Result<(), TestCaseError> {
                if !flight.is_empty() {
                    prop_assert!(proven, "a second in flight before any outcome");
                    prop_assert!(flight.len() < depth as usize, "more than the depth in flight");
                    prop_assert!(flight.iter().all(|f| f.pipe == pipe), "two pipes in flight");
                    prop_assert!(flight.iter().all(|f| f.taken), "sent behind one not taken");
                }
                flight.push(Sent { v, pipe, taken: false });
                sent.push(v);
                Ok(())
            }
            for (agg, op, pipe) in ops {
                let k = agg as usize;
                match op {
                    // A new event, its pipe changing rarely.
                    0 => {
                        let v = next_v[k];
                        next_v[k] += 1;
                        let pipe = pipe * (v as u32 % 5 / 4);
                        let mut item = (v, pipe);
                        loop {
                            match g.offer(&agg, v, pipe, item) {
                                Admit::NeedHead(i) => { g.set_head(agg, 0, false); item = i; }
                                Admit::Send((v, p)) => {
                                    check_send(depth, &mut flight[k], proven[k], &mut sent[k], v, p)?;
                                    break;
                                }
                                Admit::Queued => break,
                                other => prop_assert!(false, "unexpected {:?}", other),
                            }
                        }
                    }
                    // The producer takes the last one sent.
                    1 => {
                        if let Some(last) = flight[k].last_mut() {
                            if !last.taken {
                                last.taken = true;
                                if let Some((v, p)) = g.handed_over(&agg) {
                                    check_send(depth, &mut flight[k], proven[k], &mut sent[k], v, p)?;
                                }
                            }
                        }
                    }
                    // A report on the oldest taken one (reports may come in any order; the
                    // oldest keeps the model simple), or the resolution of a refused one.
                    _ => {
                        if !flight[k].is_empty() {
                            let i = if op == 2 { 0 } else { flight[k].len() - 1 };
                            flight[k].remove(i);
                            proven[k] = true;
                            if let Some((v, p)) = g.done(&agg) {
                                check_send(depth, &mut flight[k], proven[k], &mut sent[k], v, p)?;
                            }
                        }
                    }
                }
            }
            for agg in 0u8..3 {
                let k = agg as usize;
                while !flight[k].is_empty() {
                    if let Some(last) = flight[k].last_mut() {
                        if !last.taken {
                            last.taken = true;
                            if let Some((v, p)) = g.handed_over(&agg) {
                                check_send(depth, &mut flight[k], proven[k], &mut sent[k], v, p)?;
                                continue;
                            }
                        }
                    }
                    flight[k].remove(0);
                    proven[k] = true;
                    if let Some((v, p)) = g.done(&agg) {
                        check_send(depth, &mut flight[k], proven[k], &mut sent[k], v, p)?;
                    }
                }
                let expected: Vec<i64> = (1..next_v[k]).collect();
                prop_assert_eq!(&sent[k], &expected);
                prop_assert_eq!(g.queue_of(&agg).count(), 0);
            }
        }
    }
}
