//! The consumer's decisions, without I/O: deduplication, per-aggregate sequence checks, the
//! buffer that holds events that arrived ahead of a gap, and the contiguous offset watermark.
//!
//! The database path ([`crate::store`]) calls these; [`ConsumerModel`] runs the same rules in
//! memory, and is the consumer of outbox-sim's simulated world.
//!
//! # The rules
//! * **Dedup first.** An event id already in this consumer's inbox is a duplicate, whatever its
//!   version: the original receipt is returned and the handler does not run.
//! * **Then sequence.** For a new event id, compare its aggregate version `v` with the highest
//!   version this consumer applied for that aggregate (`last`, none for an aggregate never
//!   seen, which expects version 1):
//!   - `v == last + 1`: apply.
//!   - `v <= last`: *stale* — an older event under a new id (a replay after its inbox row was
//!     purged, or a producer bug). Recorded, never applied: the aggregate watermark is the
//!     second line of deduplication.
//!   - `v > last + 1`: a *gap*; the policy decides: `reject` (stop, nothing committed, the
//!     message comes back), `buffer` (hold it until the missing versions arrive), or `report`
//!     (apply it and record the gap).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::Hash;
use std::str::FromStr;

/// What to do when an aggregate's next event is not the one expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GapPolicy {
    /// Refuse: the consumer stops with an error and commits nothing; the operator decides.
    #[default]
    Reject,
    /// Hold the event (in memory, not committed) until the missing versions arrive.
    Buffer,
    /// Apply it anyway and record the gap (`outbox.consumer_gaps`).
    Report,
}

impl FromStr for GapPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reject" => Ok(GapPolicy::Reject),
            "buffer" => Ok(GapPolicy::Buffer),
            "report" => Ok(GapPolicy::Report),
            other => Err(format!(
                "unknown gap policy {other:?}: expected reject, buffer or report"
            )),
        }
    }
}

impl fmt::Display for GapPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GapPolicy::Reject => "reject",
            GapPolicy::Buffer => "buffer",
            GapPolicy::Report => "report",
        })
    }
}

/// Whether the inbox insert found the event new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dedup {
    /// `INSERT ... ON CONFLICT DO NOTHING RETURNING` returned a row: first time.
    First,
    /// It returned nothing: this consumer already has the event; return the original receipt.
    Duplicate,
}

impl Dedup {
    /// From "did the insert return a row".
    pub fn from_inserted(inserted: bool) -> Dedup {
        if inserted {
            Dedup::First
        } else {
            Dedup::Duplicate
        }
    }
}

/// What to do with one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run the handler, record the receipt, move the aggregate watermark to this version.
    Apply,
    /// Already applied under this event id: return the original receipt, do not run.
    Duplicate,
    /// A version at or below the aggregate watermark under a new id: record, do not run.
    Stale { last: i64 },
    /// Gap, policy `report`: run the handler and record that `expected` was missing.
    ApplyReportingGap { expected: i64 },
    /// Gap, policy `buffer`: hold it, commit nothing.
    Buffer { expected: i64 },
    /// Gap, policy `reject`: stop, commit nothing.
    Reject { expected: i64 },
}

/// The version expected next after `last` (an aggregate never seen expects 1).
pub fn expected_version(last: Option<i64>) -> i64 {
    last.map_or(1, |l| l + 1)
}

/// The decision for one message: `dedup` from the inbox insert, `last` the aggregate
/// watermark, `version` the message's aggregate version. The consumer's store
/// (`crate::store`) and [`ConsumerModel`] both decide with it.
pub fn decide(dedup: Dedup, policy: GapPolicy, last: Option<i64>, version: i64) -> Action {
    InboxRule::default().decide(dedup, policy, last, version)
}

/// The rule behind [`decide`], with one deliberately broken variant for the simulator:
/// `FORGET_APPLIED` runs the handler for a message the inbox already has or the aggregate
/// watermark has passed (a consumer that does not look at what it applied), so the
/// simulator's `duplicate_effects` must see a redelivered message's effect run twice. Only
/// [`InboxRule::default`] (`false`) is reachable from the store: no crate feature changes
/// the consumer's code, so the binary tested is the one shipped.
#[derive(Debug, Clone, Copy)]
pub struct InboxRule<const FORGET_APPLIED: bool = false> {
    /// Built with `default()` (the product) or the mutant's constructor only.
    _private: (),
}

impl Default for InboxRule {
    fn default() -> Self {
        InboxRule { _private: () }
    }
}

impl InboxRule<true> {
    /// The simulator's mutant `skip-dedup`.
    pub fn forgetting_applied() -> Self {
        InboxRule { _private: () }
    }
}

impl<const FORGET_APPLIED: bool> InboxRule<FORGET_APPLIED> {
    /// See [`decide`].
    pub fn decide(
        &self,
        dedup: Dedup,
        policy: GapPolicy,
        last: Option<i64>,
        version: i64,
    ) -> Action {
        if FORGET_APPLIED {
            return Action::Apply;
        }
        if dedup == Dedup::Duplicate {
            return Action::Duplicate;
        }
        let expected = expected_version(last);
        match (last, version) {
            (Some(l), v) if v <= l => Action::Stale { last: l },
            (_, v) if v == expected => Action::Apply,
            _ => match policy {
                GapPolicy::Reject => Action::Reject { expected },
                GapPolicy::Buffer => Action::Buffer { expected },
                GapPolicy::Report => Action::ApplyReportingGap { expected },
            },
        }
    }
}

/// Events held back by policy `buffer`, per aggregate, by version.
#[derive(Debug)]
pub struct GapBuffer<K, T> {
    held: HashMap<K, BTreeMap<i64, T>>,
    len: usize,
    limit: usize,
}

impl<K: Eq + Hash + Clone, T> GapBuffer<K, T> {
    /// A buffer that refuses more than `limit` events in all.
    pub fn new(limit: usize) -> Self {
        GapBuffer {
            held: HashMap::new(),
            len: 0,
            limit,
        }
    }

    /// Holds `item` (aggregate `key`, `version`). Returns it back if the buffer is full; an
    /// event already held at that version is replaced (a redelivery of the same message).
    pub fn push(&mut self, key: K, version: i64, item: T) -> Result<(), T> {
        let slot = self.held.entry(key).or_default();
        if !slot.contains_key(&version) {
            if self.len >= self.limit {
                return Err(item);
            }
            self.len += 1;
        }
        slot.insert(version, item);
        Ok(())
    }

    /// The held event that comes right after `last` for `key`, if any; it leaves the buffer.
    pub fn take_next(&mut self, key: &K, last: i64) -> Option<T> {
        let slot = self.held.get_mut(key)?;
        // Anything at or below `last` can never apply; drop it (its offset is released by
        // the caller when it is recorded as stale on redelivery).
        let item = slot.remove(&(last + 1));
        if item.is_some() {
            self.len -= 1;
        }
        if slot.is_empty() {
            self.held.remove(key);
        }
        item
    }

    /// Events held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets everything (after a rebalance: the messages come back from the committed
    /// offset, which never passed a held one).
    pub fn clear(&mut self) {
        self.held.clear();
        self.len = 0;
    }
}

/// The contiguous offset watermark of one consumer: per partition, the offset below which
/// every message is finished (applied, duplicate, stale). A buffered message stays open, so
/// neither the Kafka offset commit nor the consumer watermark can pass it.
#[derive(Debug, Default)]
pub struct OffsetTracker<P> {
    parts: HashMap<P, Part>,
}

#[derive(Debug, Default)]
struct Part {
    /// One past the highest offset seen.
    next: i64,
    open: BTreeSet<i64>,
}

impl<P: Eq + Hash + Clone> OffsetTracker<P> {
    pub fn new() -> Self {
        OffsetTracker {
            parts: HashMap::new(),
        }
    }

    /// A message at `offset` arrived. An offset below what was seen means the partition was
    /// rewound (reassigned, or seeked): its state starts over from there.
    pub fn begin(&mut self, partition: P, offset: i64) {
        let p = self.parts.entry(partition).or_default();
        if offset < p.next {
            p.open.retain(|o| *o < offset);
        }
        p.open.insert(offset);
        p.next = offset + 1;
    }

    /// The message at `offset` is finished.
    pub fn finish(&mut self, partition: &P, offset: i64) {
        if let Some(p) = self.parts.get_mut(partition) {
            p.open.remove(&offset);
        }
    }

    /// The offset to commit (the next one to read after a restart): the lowest open offset,
    /// or one past the highest seen. `None` for a partition never seen.
    pub fn committable(&self, partition: &P) -> Option<i64> {
        self.parts
            .get(partition)
            .map(|p| p.open.first().copied().unwrap_or(p.next))
    }

    /// What [`committable`](Self::committable) will be once `offset` finishes: the partition
    /// watermark to record in the transaction that finishes it.
    pub fn committable_if_finished(&self, partition: &P, offset: i64) -> i64 {
        match self.parts.get(partition) {
            Some(p) => p
                .open
                .iter()
                .copied()
                .find(|o| *o != offset)
                .unwrap_or(p.next),
            None => offset + 1,
        }
    }

    /// Forgets every partition.
    pub fn clear(&mut self) {
        self.parts.clear();
    }
}

/// The whole consumer recipe as an in-memory model, meant for a deterministic simulator: the inbox
/// (event ids), the aggregate watermarks and the gap buffer. [`deliver`](Self::deliver) is one
/// message's transaction (atomic, as the database makes it); [`crash`](Self::crash) loses what
/// only lives in memory (the buffer) and keeps what was committed.
#[derive(Debug)]
pub struct ConsumerModel<E, K> {
    policy: GapPolicy,
    inbox: std::collections::HashSet<E>,
    heads: HashMap<K, i64>,
    buffer: GapBuffer<K, E>,
    versions: HashMap<E, (K, i64)>,
    /// Handler runs per event id (the simulator asserts each is 1).
    pub effects: HashMap<E, u32>,
    /// Decides with [`InboxRule::forgetting_applied`] (the simulator's `skip-dedup`).
    forget_applied: bool,
}

impl<E: Eq + Hash + Clone, K: Eq + Hash + Clone> ConsumerModel<E, K> {
    pub fn new(policy: GapPolicy, max_buffered: usize) -> Self {
        ConsumerModel {
            policy,
            inbox: std::collections::HashSet::new(),
            heads: HashMap::new(),
            buffer: GapBuffer::new(max_buffered),
            versions: HashMap::new(),
            effects: HashMap::new(),
            forget_applied: false,
        }
    }

    /// A model whose decisions are [`InboxRule::forgetting_applied`]'s: the simulator's
    /// mutant `skip-dedup`, planted in the rule the store runs.
    pub fn forgetting_applied(policy: GapPolicy, max_buffered: usize) -> Self {
        ConsumerModel {
            forget_applied: true,
            ..ConsumerModel::new(policy, max_buffered)
        }
    }

    /// Delivers one message (`id`, aggregate `key`, `version`). Returns the action taken for it
    /// and for every buffered message it released, in order. A full buffer is reported as
    /// `Reject` (the consumer would stop).
    pub fn deliver(&mut self, id: E, key: K, version: i64) -> Vec<(E, Action)> {
        let mut out = Vec::new();
        let mut next = Some((id, version));
        while let Some((id, version)) = next.take() {
            let dedup = Dedup::from_inserted(!self.inbox.contains(&id));
            let last = self.heads.get(&key).copied();
            let action = if self.forget_applied {
                InboxRule::forgetting_applied().decide(dedup, self.policy, last, version)
            } else {
                decide(dedup, self.policy, last, version)
            };
            match action {
                Action::Apply | Action::ApplyReportingGap { .. } => {
                    self.inbox.insert(id.clone());
                    *self.effects.entry(id.clone()).or_default() += 1;
                    let head = self.heads.entry(key.clone()).or_insert(version);
                    *head = (*head).max(version);
                }
                Action::Stale { .. } => {
                    self.inbox.insert(id.clone());
                }
                Action::Buffer { expected } => {
                    self.versions.insert(id.clone(), (key.clone(), version));
                    if self.buffer.push(key.clone(), version, id.clone()).is_err() {
                        out.push((id, Action::Reject { expected }));
                        return out;
                    }
                }
                Action::Duplicate | Action::Reject { .. } => {}
            }
            let released = matches!(
                action,
                Action::Apply
                    | Action::ApplyReportingGap { .. }
                    | Action::Duplicate
                    | Action::Stale { .. }
            );
            out.push((id, action));
            if released {
                if let Some(last) = self.heads.get(&key).copied() {
                    if let Some(held) = self.buffer.take_next(&key, last) {
                        let v = self.versions.remove(&held).map_or(last + 1, |(_, v)| v);
                        next = Some((held, v));
                    }
                }
            }
        }
        out
    }

    /// The process died: the buffer (memory) is gone; the inbox and watermarks (committed)
    /// stay. Buffered messages were never committed, so the broker delivers them again.
    pub fn crash(&mut self) {
        self.buffer.clear();
        self.versions.clear();
    }

    /// Retention removed the event's inbox row (the aggregate watermark stays): a copy read
    /// again after this is caught only by the watermark, as a stale event.
    pub fn purge(&mut self, id: &E) {
        self.inbox.remove(id);
    }

    /// Events whose effect ran more than once (must be 0).
    pub fn duplicate_effects(&self) -> usize {
        self.effects.values().filter(|n| **n > 1).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The planted rule (the simulator's `skip-dedup`) runs a redelivered message's effect
    /// again where the shipped one does not: the count the simulator asserts is 0 moves.
    #[test]
    fn the_planted_rule_applies_a_redelivered_message_again() {
        let mut shipped: ConsumerModel<u32, &str> = ConsumerModel::new(GapPolicy::Report, 10);
        let mut planted: ConsumerModel<u32, &str> =
            ConsumerModel::forgetting_applied(GapPolicy::Report, 10);
        for m in [&mut shipped, &mut planted] {
            m.deliver(1, "a", 1);
            m.crash();
            m.deliver(1, "a", 1);
        }
        assert_eq!(shipped.duplicate_effects(), 0);
        assert_eq!(planted.duplicate_effects(), 1);
        assert_eq!(
            InboxRule::forgetting_applied().decide(Dedup::Duplicate, GapPolicy::Reject, Some(3), 2),
            Action::Apply
        );
    }

    #[test]
    fn duplicate_wins_over_everything() {
        for last in [None, Some(1), Some(5)] {
            for v in [1, 2, 6, 9] {
                assert_eq!(
                    decide(Dedup::Duplicate, GapPolicy::Report, last, v),
                    Action::Duplicate
                );
            }
        }
    }

    #[test]
    fn sequence_and_policies() {
        assert_eq!(
            decide(Dedup::First, GapPolicy::Reject, None, 1),
            Action::Apply
        );
        assert_eq!(
            decide(Dedup::First, GapPolicy::Reject, Some(3), 4),
            Action::Apply
        );
        assert_eq!(
            decide(Dedup::First, GapPolicy::Reject, Some(3), 3),
            Action::Stale { last: 3 }
        );
        assert_eq!(
            decide(Dedup::First, GapPolicy::Buffer, Some(3), 1),
            Action::Stale { last: 3 }
        );
        assert_eq!(
            decide(Dedup::First, GapPolicy::Reject, Some(3), 5),
            Action::Reject { expected: 4 }
        );
        assert_eq!(
            decide(Dedup::First, GapPolicy::Buffer, None, 2),
            Action::Buffer { expected: 1 }
        );
        assert_eq!(
            decide(Dedup::First, GapPolicy::Report, Some(1), 7),
            Action::ApplyReportingGap { expected: 2 }
        );
        assert_eq!("buffer".parse::<GapPolicy>(), Ok(GapPolicy::Buffer));
        assert!("skip".parse::<GapPolicy>().is_err());
    }

    #[test]
    fn buffer_releases_in_version_order_and_has_a_limit() {
        let mut b: GapBuffer<&str, &str> = GapBuffer::new(2);
        b.push("a", 3, "a3").unwrap();
        b.push("a", 3, "a3 again").unwrap();
        b.push("a", 4, "a4").unwrap();
        assert_eq!(b.push("b", 9, "b9"), Err("b9"));
        assert_eq!(b.take_next(&"a", 1), None);
        assert_eq!(b.take_next(&"a", 2), Some("a3 again"));
        assert_eq!(b.take_next(&"a", 3), Some("a4"));
        assert!(b.is_empty());
    }

    #[test]
    fn tracker_never_passes_an_open_offset() {
        let mut t = OffsetTracker::new();
        assert_eq!(t.committable(&0), None);
        t.begin(0, 10);
        t.begin(0, 11);
        assert_eq!(t.committable_if_finished(&0, 11), 10);
        t.finish(&0, 11);
        assert_eq!(t.committable(&0), Some(10));
        assert_eq!(t.committable_if_finished(&0, 10), 12);
        t.finish(&0, 10);
        assert_eq!(t.committable(&0), Some(12));
        // Rewind (reassignment): state restarts at the rewound offset.
        t.begin(0, 5);
        assert_eq!(t.committable(&0), Some(5));
    }

    #[test]
    fn model_crash_and_redelivery_apply_once() {
        let mut m: ConsumerModel<u32, &str> = ConsumerModel::new(GapPolicy::Buffer, 10);
        assert_eq!(m.deliver(2, "a", 2)[0].1, Action::Buffer { expected: 1 });
        m.crash();
        let acts = m.deliver(1, "a", 1);
        assert_eq!(
            acts,
            vec![(1, Action::Apply)],
            "the buffer died with the process"
        );
        let acts = m.deliver(2, "a", 2);
        assert_eq!(acts, vec![(2, Action::Apply)]);
        assert_eq!(m.deliver(1, "a", 1), vec![(1, Action::Duplicate)]);
        assert_eq!(m.duplicate_effects(), 0);
        // Buffered, then released by the missing version.
        assert_eq!(m.deliver(4, "a", 4)[0].1, Action::Buffer { expected: 3 });
        assert_eq!(
            m.deliver(3, "a", 3),
            vec![(3, Action::Apply), (4, Action::Apply)]
        );
        assert_eq!(m.effects.len(), 4);
    }

    // The model under policy buffer, with duplicates, any arrival order and crashes (after a
    // crash the broker redelivers what was only buffered): every version is applied exactly
    // once, in version order.
    proptest! {
        #[test]
        fn buffer_policy_applies_each_version_once_in_order_across_crashes(
            arrivals in proptest::collection::vec(1..=8i64, 0..6).prop_flat_map(|dups| {
                let mut all: Vec<i64> = (1..=8).collect();
                all.extend(dups);
                Just(all).prop_shuffle()
            }),
            crashes in proptest::collection::btree_set(0..16usize, 0..3),
        ) {
            // Event id = version (one aggregate).
            let mut m: ConsumerModel<i64, ()> = ConsumerModel::new(GapPolicy::Buffer, 100);
            let mut queue: std::collections::VecDeque<i64> = arrivals.into();
            let mut held = Vec::new();
            let mut applied = Vec::new();
            let mut step = 0;
            while let Some(v) = queue.pop_front() {
                if crashes.contains(&step) {
                    m.crash();
                    queue.extend(held.drain(..));
                }
                step += 1;
                for (id, action) in m.deliver(v, (), v) {
                    match action {
                        Action::Apply => {
                            held.retain(|h| *h != id);
                            applied.push(id);
                        }
                        Action::Buffer { .. } => held.push(id),
                        Action::Duplicate | Action::Stale { .. } => {}
                        other => prop_assert!(false, "unexpected {other:?}"),
                    }
                }
            }
            prop_assert_eq!(applied, (1..=8).collect::<Vec<_>>());
            prop_assert_eq!(m.duplicate_effects(), 0);
        }
    }
}
