//! Which partition count a deeper gate's producer places keys by.
//!
//! With several versions of an aggregate in flight (`--in-flight-per-aggregate` above 1,
//! docs/ordering.md, "Hot aggregates"), version k+1 is handed to the producer before the
//! broker answered k. The producer keeps one partition's messages in order, not two
//! partitions': if a topic's partition count is raised between k and k+1, librdkafka's
//! partitioner would place k+1 by the new count, possibly on another partition, and k+1
//! could land there before k lands on its own. So a deeper gate's producer places every key
//! by a *pinned* count: the count it first saw for the topic. A raised count is noticed when
//! the partitioner next sees it, and adopted only when nothing the producer took is still
//! unanswered (then no version of any aggregate can be split across the old and the new
//! placement). A relay that always has something in flight drains once, briefly, to adopt it
//! (the sink's side: `outbox_sink::kafka`).
//!
//! Pure: no clock of its own (the caller passes the time as a `Duration` since any fixed
//! origin), no I/O; the sink's partitioner and the simulator's producer both drive it.

use std::collections::HashMap;
use std::time::Duration;

/// A topic whose live partition count differs from the count keys are placed by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountChange {
    pub topic: String,
    /// The count keys are placed by now.
    pub from: u32,
    /// The count the producer last saw.
    pub to: u32,
    /// When it was first seen.
    pub since: Duration,
}

/// What the sink does before it hands the next message to the producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Send it: keys are placed by the pinned counts.
    Send,
    /// Nothing was in flight: every pin was dropped, and from this message on keys are
    /// placed by the counts the producer sees now (the change is the one noticed first).
    Repinned(CountChange),
    /// A change has waited [`Placement::DRAIN_AFTER`] for a moment with nothing in flight:
    /// wait (bounded) for the producer to drain, then [`Placement::admit`] again; if it does
    /// not drain, [`Placement::drain_gave_up`] and send by the pinned counts.
    DrainFirst(CountChange),
}

/// Per topic, the partition count keys are placed by (see the module docs). `UNPINNED` is the
/// simulator's product mutant `deep-unpinned` (every key placed by the live count, as
/// librdkafka's own partitioner does); the sink uses [`Placement::default`] (`false`) in every
/// build.
#[derive(Debug)]
pub struct Placement<const UNPINNED: bool = false> {
    pinned: HashMap<String, u32>,
    change: Option<CountChange>,
}

impl Default for Placement {
    fn default() -> Self {
        Placement {
            pinned: HashMap::new(),
            change: None,
        }
    }
}

impl Placement<true> {
    /// The simulator's mutant `deep-unpinned`.
    pub fn unpinned() -> Self {
        Placement {
            pinned: HashMap::new(),
            change: None,
        }
    }
}

impl<const UNPINNED: bool> Placement<UNPINNED> {
    /// How long a noticed change waits for a moment with nothing in flight before the sink
    /// drains the producer for it.
    pub const DRAIN_AFTER: Duration = Duration::from_secs(5);

    /// The partition count to place a key of `topic` by, when the producer sees `live`
    /// partitions. The first count seen for a topic is pinned; a larger one is noted and not
    /// used ([`Placement::admit`] adopts it). A smaller one (the topic was deleted and made
    /// again with fewer partitions) is used at once: the pinned partitions may not exist, and
    /// the old topic's order is gone with it.
    pub fn count(&mut self, topic: &str, live: u32, now: Duration) -> u32 {
        let live = live.max(1);
        if UNPINNED {
            return live;
        }
        match self.pinned.get(topic).copied() {
            None => {
                self.pinned.insert(topic.to_string(), live);
                live
            }
            Some(p) if p > live => {
                self.pinned.insert(topic.to_string(), live);
                live
            }
            Some(p) if p < live => {
                if self.change.is_none() {
                    self.change = Some(CountChange {
                        topic: topic.to_string(),
                        from: p,
                        to: live,
                        since: now,
                    });
                }
                p
            }
            Some(p) => p,
        }
    }

    /// Before a send, with `in_flight` messages taken by the producer and not yet answered.
    pub fn admit(&mut self, in_flight: usize, now: Duration) -> Admit {
        let Some(c) = &self.change else {
            return Admit::Send;
        };
        if in_flight == 0 {
            let c = c.clone();
            self.change = None;
            self.pinned.clear();
            return Admit::Repinned(c);
        }
        if now.saturating_sub(c.since) >= Self::DRAIN_AFTER {
            return Admit::DrainFirst(c.clone());
        }
        Admit::Send
    }

    /// The producer did not drain within the sink's bound (a partition without a leader holds
    /// its messages): keep the pinned counts and wait another [`Placement::DRAIN_AFTER`]
    /// before trying again.
    pub fn drain_gave_up(&mut self, now: Duration) {
        if let Some(c) = &mut self.change {
            c.since = now;
        }
    }

    /// The change noticed and not yet adopted, if any.
    pub fn pending(&self) -> Option<&CountChange> {
        self.change.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Duration = Duration::ZERO;

    #[test]
    fn the_first_count_is_pinned_and_a_raised_one_waits_for_nothing_in_flight() {
        let mut p = Placement::default();
        assert_eq!(p.count("t", 3, T0), 3);
        assert_eq!(p.count("t", 6, T0), 3, "raised: still placed by 3");
        assert_eq!(p.count("u", 6, T0), 6, "another topic pins its own");
        assert_eq!(p.admit(2, Duration::from_secs(1)), Admit::Send);
        assert_eq!(p.count("t", 6, T0), 3, "still in flight: still 3");
        match p.admit(0, Duration::from_secs(1)) {
            Admit::Repinned(c) => assert_eq!((c.topic.as_str(), c.from, c.to), ("t", 3, 6)),
            other => panic!("expected a repin, got {other:?}"),
        }
        assert_eq!(p.count("t", 6, T0), 6, "adopted");
        assert_eq!(p.admit(0, Duration::from_secs(1)), Admit::Send);
    }

    #[test]
    fn a_change_that_never_meets_an_empty_producer_asks_for_a_drain_then_backs_off() {
        let mut p = Placement::default();
        p.count("t", 2, T0);
        p.count("t", 4, Duration::from_secs(10));
        assert_eq!(p.admit(5, Duration::from_secs(14)), Admit::Send);
        let at = Duration::from_secs(15);
        assert!(matches!(p.admit(5, at), Admit::DrainFirst(_)));
        p.drain_gave_up(at);
        assert_eq!(p.admit(5, Duration::from_secs(16)), Admit::Send);
        assert_eq!(p.count("t", 4, at), 2, "still pinned after giving up");
        assert!(matches!(
            p.admit(5, Duration::from_secs(20)),
            Admit::DrainFirst(_)
        ));
    }

    #[test]
    fn a_smaller_count_is_used_at_once() {
        let mut p = Placement::default();
        p.count("t", 4, T0);
        assert_eq!(p.count("t", 2, T0), 2);
        assert!(p.pending().is_none());
        assert_eq!(p.count("t", 0, T0), 1, "never a count of zero");
    }
}
