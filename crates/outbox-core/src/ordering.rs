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
    in_flight: bool,
    held: bool,
    /// Events behind the in-flight one; `None` when there are none. The gate keeps an entry
    /// for every aggregate the relay has seen (100,000 in the bench), and few have a queue at
    /// any moment: boxed, an entry is 24 bytes smaller than with an inline `VecDeque`, and a
    /// drained queue gives its buffer back.
    #[allow(clippy::box_collection)] // the box is the point: 8 bytes inline instead of 32
    queue: Option<Box<VecDeque<T>>>,
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
}

impl<K: Hash + Eq + Clone, T> Default for OrderingGate<K, T> {
    fn default() -> Self {
        OrderingGate {
            aggs: HashMap::default(),
            queued: 0,
        }
    }
}

impl<K: Hash + Eq + Clone, T> OrderingGate<K, T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the last accepted version of `key` (0 if none), or marks it held (a durable
    /// hold loaded at start).
    pub fn set_head(&mut self, key: K, last_accepted: i64, held: bool) {
        let a = self.aggs.entry(key).or_insert_with(|| Agg {
            expected: last_accepted + 1,
            in_flight: false,
            held,
            queue: None,
        });
        a.expected = a.expected.max(last_accepted + 1);
        a.held |= held;
    }

    /// Offers event `item` with `version` of aggregate `key`.
    pub fn offer(&mut self, key: &K, version: i64, item: T) -> Admit<T> {
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
        if a.in_flight {
            a.queue.get_or_insert_with(Box::default).push_back(item);
            self.queued += 1;
            Admit::Queued
        } else {
            a.in_flight = true;
            Admit::Send(item)
        }
    }

    /// The broker reported on `key`'s in-flight event. Returns the next event to send, if any
    /// (it is then in flight).
    pub fn done(&mut self, key: &K) -> Option<T> {
        let a = self.aggs.get_mut(key)?;
        if a.held {
            a.in_flight = false;
            return None;
        }
        match a.queue.as_mut().and_then(|q| q.pop_front()) {
            Some(next) => {
                self.queued -= 1;
                if a.queue.as_ref().is_some_and(|q| q.is_empty()) {
                    a.queue = None;
                }
                Some(next)
            }
            None => {
                a.in_flight = false;
                None
            }
        }
    }

    /// Holds `key` (its in-flight event was quarantined). Returns what was queued behind it,
    /// in order, to be recorded as held.
    pub fn hold(&mut self, key: &K) -> Vec<T> {
        match self.aggs.get_mut(key) {
            Some(a) => {
                a.held = true;
                self.queued -= a.queue_len();
                a.queue.take().map_or_else(Vec::new, |q| Vec::from(*q))
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
        self.aggs.get(key).is_some_and(|a| a.in_flight)
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_in_flight_per_aggregate_and_order_kept() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::new();
        assert_eq!(g.offer(&"a", 1, 1), Admit::NeedHead(1));
        g.set_head("a", 0, false);
        g.set_head("b", 0, false);
        assert_eq!(g.offer(&"a", 1, 1), Admit::Send(1));
        assert_eq!(g.offer(&"a", 2, 2), Admit::Queued);
        assert_eq!(
            g.offer(&"b", 1, 10),
            Admit::Send(10),
            "other aggregates flow"
        );
        assert_eq!(g.offer(&"a", 3, 3), Admit::Queued);
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
            g.offer(&"a", 4, 4),
            Admit::Send(4),
            "replay of an accepted version"
        );
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.offer(&"a", 6, 6), Admit::Send(6));
        assert_eq!(
            g.offer(&"a", 8, 8),
            Admit::Hold(
                8,
                HoldReason::Gap {
                    expected: 7,
                    got: 8
                }
            )
        );
        assert_eq!(
            g.offer(&"a", 9, 9),
            Admit::Held(9),
            "never publish past a gap"
        );
        assert_eq!(g.done(&"a"), None);
        g.release(&"a", 10);
        assert_eq!(g.offer(&"a", 10, 10), Admit::Send(10));
    }

    #[test]
    fn poison_holds_what_is_queued_behind_it() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::new();
        g.set_head("a", 0, false);
        assert_eq!(g.offer(&"a", 1, 1), Admit::Send(1));
        assert_eq!(g.offer(&"a", 2, 2), Admit::Queued);
        assert_eq!(g.offer(&"a", 3, 3), Admit::Queued);
        assert_eq!(g.hold(&"a"), vec![2, 3]);
        assert_eq!(g.done(&"a"), None);
        assert_eq!(g.offer(&"a", 4, 4), Admit::Held(4));
        assert_eq!(g.queued(), 0);
    }

    #[test]
    fn an_aggregate_without_a_queue_keeps_no_queue() {
        let mut g: OrderingGate<&str, i64> = OrderingGate::new();
        g.set_head("a", 0, false);
        assert_eq!(g.offer(&"a", 1, 1), Admit::Send(1));
        assert_eq!(g.offer(&"a", 2, 2), Admit::Queued);
        assert!(g.aggs[&"a"].queue.is_some());
        assert_eq!(g.done(&"a"), Some(2));
        assert!(
            g.aggs[&"a"].queue.is_none(),
            "a drained queue is given back"
        );
        assert_eq!(g.offer(&"a", 3, 3), Admit::Queued);
        assert_eq!(g.forget_queue(&"a"), 1);
        assert!(g.aggs[&"a"].queue.is_none());
        assert_eq!(g.queued(), 0);
        // The entry the gate keeps for each aggregate it has seen: an i64, two flags, a pointer.
        assert_eq!(std::mem::size_of::<Agg<[u8; 400]>>(), 24);
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
                    match g.offer(&agg, v, item) {
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
}
