//! Versions from commit order: how a relay numbers the rows a writer inserted without one.
//!
//! # Why
//! `outbox.enqueue` takes each event's aggregate version under the aggregate's row lock, in
//! the writer's transaction, and that is most of what makes it cost twice a plain INSERT
//! (docs/benchmarks.md, "What a writer's event costs, bottom up"). The stream already
//! delivers an aggregate's rows in commit order, which is the order that lock gave, so the
//! relay can number them instead: a row's version is its aggregate's last version + 1
//! (docs/versions_by_relay.md).
//!
//! # The rule that makes it survive restarts
//! A run streams from the slot's checkpoint C, and the slot sends again exactly the
//! transactions whose commit record is at or past C (`commit_lsn >= C`). So the numbering a
//! restart needs is, per aggregate, the version of its last row committed before C. The relay
//! writes that, for the aggregates it numbered since the last checkpoint, in the transaction
//! that moves the checkpoint to C ([`Numbering::checkpoint`]); a restart seeds each aggregate
//! it meets from it ([`Numbering::set_head`]) and numbers the rows from C again, in the same
//! order, to the same versions, whatever the previous run sent, accepted or lost. Reading an
//! aggregate's highest recorded version instead would be wrong: a paused run's salvage can
//! accept k+1 while k's receipt was lost, and k would be numbered k+2.
//!
//! Pure: the caller supplies the heads it reads and writes what [`Numbering::checkpoint`]
//! returns, in the checkpoint's own transaction: one row of `outbox.stream_version_log` per
//! checkpoint (migration 0040), folded into the map `outbox.stream_versions` at a run's start
//! and every [`FOLD_ENTRIES`] entries or [`FOLD_ROWS`] rows ([`Numbering::logged`]). A run
//! reads only the folded map, and that is enough: what the log holds beyond it was written by
//! the run itself, for aggregates it keeps. [`Generations`] does the same for the route
//! policy generation in force at the checkpoint.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::Hash;

use crate::Lsn;

/// The version a row gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Number {
    Version(i64),
    /// The run has not met this aggregate: read its numbering at the run's checkpoint, call
    /// [`Numbering::set_head`], and ask again.
    NeedHead,
}

#[derive(Debug, Default)]
struct Agg {
    /// The version of the last row numbered.
    last: i64,
    /// Rows numbered past the last checkpoint written: (commit LSN, version of the
    /// transaction's last row of this aggregate), in commit order. The run keeps an entry for
    /// every aggregate it numbered, and few have pending rows at any moment: boxed, an entry
    /// is 24 bytes smaller (as the ordering gate's queues are).
    #[allow(clippy::box_collection)] // the box is the point: 8 bytes inline instead of 32
    pending: Option<Box<VecDeque<(Lsn, i64)>>>,
}

/// A run folds the numbering's log into its map once it has written this many entries
/// (aggregate, version) since the last fold. The fold costs an upsert per distinct aggregate,
/// what writing the map directly cost per aggregate per checkpoint: the larger the window,
/// the more checkpoints of one aggregate it folds into one upsert. Two million entries of
/// three short strings and a number are ~100 MB of log at most between folds.
pub const FOLD_ENTRIES: u64 = 2_000_000;

/// ... or this many log rows (checkpoints), whatever their size: a relay of few hot
/// aggregates writes small rows often.
pub const FOLD_ROWS: u64 = 20_000;

/// Per-aggregate numbering for one relay run.
#[derive(Debug)]
pub struct Numbering<K> {
    aggs: HashMap<K, Agg, foldhash::fast::RandomState>,
    /// Every aggregate with pending rows, once, by the commit LSN of its oldest: a checkpoint
    /// takes those before it from the top, so it costs what it moves past, not a look at every
    /// aggregate with pending rows (which was a scan of up to the whole backlog's aggregates
    /// per acceptance: 4.5 % of the relay's CPU in a wide drain, docs/benchmarks.md "The
    /// relay's CPU per drained event"). One entry per aggregate, not per row: a checkpoint
    /// held back by one unclear event while the stream goes on costs no more memory than
    /// the aggregates' own pending rows.
    dirty: BinaryHeap<Reverse<(Lsn, K)>>,
    /// Entries and rows this run wrote to the log since its last fold.
    logged_entries: u64,
    logged_rows: u64,
    /// When the log is due: [`FOLD_ENTRIES`] and [`FOLD_ROWS`] unless a test asked for
    /// sooner ([`Numbering::fold_every`]).
    fold_entries: u64,
    fold_rows: u64,
}

impl<K: Hash + Ord + Clone> Default for Numbering<K> {
    fn default() -> Self {
        Numbering {
            aggs: HashMap::default(),
            dirty: BinaryHeap::new(),
            logged_entries: 0,
            logged_rows: 0,
            fold_entries: FOLD_ENTRIES,
            fold_rows: FOLD_ROWS,
        }
    }
}

impl<K: Hash + Ord + Clone> Numbering<K> {
    /// The version of the next row of `key` the stream delivers, committed at `commit_lsn`.
    /// Rows must be offered in stream order (commit order, and within a transaction the order
    /// of its changes).
    pub fn number(&mut self, key: &K, commit_lsn: Lsn) -> Number {
        let Some(agg) = self.aggs.get_mut(key) else {
            return Number::NeedHead;
        };
        agg.last += 1;
        let pending = agg.pending.get_or_insert_with(Box::default);
        match pending.back_mut() {
            Some((lsn, v)) if *lsn == commit_lsn => *v = agg.last,
            _ => {
                if pending.is_empty() {
                    self.dirty.push(Reverse((commit_lsn, key.clone())));
                }
                pending.push_back((commit_lsn, agg.last));
            }
        }
        Number::Version(agg.last)
    }

    /// The last version numbered before the run's checkpoint for `key` (0 for an aggregate
    /// never numbered). Ignored when the run already numbers `key`.
    pub fn set_head(&mut self, key: K, last: i64) {
        self.aggs.entry(key).or_insert(Agg {
            last,
            pending: None,
        });
    }

    /// The checkpoint moves to `through`: for every aggregate with rows committed before it
    /// numbered since the last checkpoint, the version of its last such row. The caller writes
    /// them in the transaction that moves the checkpoint (if that transaction fails, the
    /// restart streams from the old checkpoint, whose numbering is still written). Rows at or
    /// past `through` stay pending for a later checkpoint.
    pub fn checkpoint(&mut self, through: Lsn) -> Vec<(K, i64)> {
        let mut out = Vec::new();
        while self
            .dirty
            .peek()
            .is_some_and(|Reverse((oldest, _))| *oldest < through)
        {
            let Reverse((_, key)) = self.dirty.pop().expect("the top was just seen");
            let agg = self.aggs.get_mut(&key).expect("a dirty aggregate is known");
            let pending = agg
                .pending
                .as_mut()
                .expect("a dirty aggregate has pending rows");
            let mut reached = None;
            while let Some(&(lsn, v)) = pending.front() {
                if lsn >= through {
                    break;
                }
                reached = Some(v);
                pending.pop_front();
            }
            match pending.front() {
                // Its oldest row left is at or past the checkpoint: it waits for a later one.
                Some(&(oldest, _)) => self.dirty.push(Reverse((oldest, key.clone()))),
                // Its buffer back: most aggregates have nothing pending most of the time.
                None => agg.pending = None,
            }
            out.push((
                key,
                reached.expect("its oldest pending row is before the checkpoint"),
            ));
        }
        out
    }

    /// A checkpoint's transaction writes `entries` (what [`Numbering::checkpoint`] gave) as
    /// one log row: whether that transaction also folds the log into the map. A failed
    /// transaction ends the run, and the next run folds at its start, so the count is not
    /// restored.
    pub fn logged(&mut self, entries: usize) -> bool {
        if entries == 0 {
            return false;
        }
        self.logged_entries += entries as u64;
        self.logged_rows += 1;
        if self.logged_entries >= self.fold_entries || self.logged_rows >= self.fold_rows {
            self.logged_entries = 0;
            self.logged_rows = 0;
            return true;
        }
        false
    }

    /// The log is due for a fold after `entries` entries or `rows` rows instead of the
    /// defaults (a test's way to see folds during a run).
    pub fn fold_every(&mut self, entries: u64, rows: u64) {
        self.fold_entries = entries.max(1);
        self.fold_rows = rows.max(1);
    }

    /// Aggregates with rows numbered past the last checkpoint written.
    pub fn pending(&self) -> usize {
        self.dirty.len()
    }

    /// Whether the run numbers `key` (its head was given, or it numbered a row of it).
    pub fn knows(&self, key: &K) -> bool {
        self.aggs.contains_key(key)
    }
}

/// What the transaction that moves a checkpoint keeps besides it, for rows written without a
/// version or a route: the relay core computes it ([`Numbering::checkpoint`],
/// [`Generations::checkpoint`]) and the ledger writes it (`outbox_ledger::numbering`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumberedThrough<K> {
    /// Per aggregate, the version of its last row committed before the checkpoint (each once).
    pub versions: Vec<(K, i64)>,
    /// The route policy generation in force at the checkpoint, when the ledger does not
    /// hold it yet.
    pub policy_generation: Option<i64>,
    /// Whether the transaction folds the slot's numbering log into its map after writing
    /// `versions` to it ([`Numbering::logged`]).
    pub fold: bool,
}

impl<K> Default for NumberedThrough<K> {
    fn default() -> Self {
        NumberedThrough {
            versions: Vec::new(),
            policy_generation: None,
            fold: false,
        }
    }
}

impl<K> NumberedThrough<K> {
    pub fn is_empty(&self) -> bool {
        self.versions.is_empty() && self.policy_generation.is_none()
    }
}

/// The route policy generations of a run (migration 0038): the one in force at its
/// checkpoint, and those the stream delivered since, at their commit positions. A row written
/// without a route is routed by the generation in force at its commit (the decoder applies
/// them in stream order); a restart needs the one in force at its checkpoint, so the
/// transaction that moves the checkpoint writes it ([`Generations::checkpoint`]) with the
/// numbering, under the same rule: a generation committed before the checkpoint C is in force
/// at C.
#[derive(Debug, Default)]
pub struct Generations {
    /// In force at the last checkpoint this run computed.
    at_checkpoint: Option<i64>,
    /// What the ledger holds with the checkpoint (not written again).
    written: Option<i64>,
    /// (commit LSN, generation) delivered by the stream past the last checkpoint computed.
    since: VecDeque<(Lsn, i64)>,
}

impl Generations {
    /// A run that starts with `in_force` (read by id from the checkpoint's `written`, or the
    /// newest when the checkpoint has none).
    pub fn starting(in_force: Option<i64>, written: Option<i64>) -> Self {
        Generations {
            at_checkpoint: in_force,
            written,
            since: VecDeque::new(),
        }
    }

    /// The stream delivered generation `id` in the transaction committed at `commit_lsn`.
    pub fn note(&mut self, commit_lsn: Lsn, id: i64) {
        self.since.push_back((commit_lsn, id));
    }

    /// The checkpoint moves to `through`: the generation in force there, if the ledger does
    /// not hold it with the checkpoint yet (then the caller writes it in the same
    /// transaction). Like [`Numbering::checkpoint`], taken once per checkpoint, before its
    /// transaction; if that fails, the run ends.
    pub fn checkpoint(&mut self, through: Lsn) -> Option<i64> {
        while let Some(&(lsn, id)) = self.since.front() {
            if lsn >= through {
                break;
            }
            self.at_checkpoint = Some(id);
            self.since.pop_front();
        }
        if self.at_checkpoint == self.written {
            return None;
        }
        self.written = self.at_checkpoint;
        self.written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The log is folded once enough entries or enough rows were written since the last
    /// fold, and a checkpoint that numbered nothing writes no row and counts for nothing.
    #[test]
    fn the_log_is_folded_after_enough_entries_or_rows() {
        let mut n = Numbering::<u32>::default();
        assert!(!n.logged(0));
        assert!(!n.logged((FOLD_ENTRIES - 1) as usize));
        assert!(n.logged(1), "the entry that reaches the limit folds");
        assert!(!n.logged(1), "the count starts again after a fold");
        for _ in 1..FOLD_ROWS - 1 {
            assert!(!n.logged(1));
        }
        for _ in 0..5 {
            assert!(!n.logged(0), "no row, nothing counted");
        }
        assert!(n.logged(1), "the row that reaches the limit folds");
    }

    /// A generation committed before the checkpoint is in force at it, one at or past it is
    /// not yet; the ledger is asked to write a generation only when it changes.
    #[test]
    fn the_generation_in_force_at_a_checkpoint_is_the_last_committed_before_it() {
        let mut g = Generations::starting(Some(1), None);
        assert_eq!(
            g.checkpoint(Lsn(10)),
            Some(1),
            "the start's, not yet written"
        );
        assert_eq!(g.checkpoint(Lsn(20)), None, "written already");
        g.note(Lsn(25), 2);
        g.note(Lsn(30), 3);
        assert_eq!(
            g.checkpoint(Lsn(25)),
            None,
            "committed at the checkpoint: not before it"
        );
        assert_eq!(g.checkpoint(Lsn(26)), Some(2));
        assert_eq!(g.checkpoint(Lsn(40)), Some(3));
        let mut kept = Generations::starting(Some(7), Some(7));
        assert_eq!(kept.checkpoint(Lsn(5)), None, "the checkpoint holds it");
    }

    /// The version `n` gives the next row of `key`, seeding an aggregate it has not met with
    /// `head` (what the ledger holds for it).
    fn numbered(n: &mut Numbering<u8>, key: u8, commit: u64, head: i64) -> i64 {
        match n.number(&key, Lsn(commit)) {
            Number::Version(v) => v,
            Number::NeedHead => {
                n.set_head(key, head);
                numbered(n, key, commit, head)
            }
        }
    }

    #[test]
    fn a_checkpoint_writes_the_last_version_committed_before_it() {
        let mut n = Numbering::default();
        assert_eq!(n.number(&1, Lsn(10)), Number::NeedHead);
        n.set_head(1, 4);
        assert_eq!(n.number(&1, Lsn(10)), Number::Version(5));
        assert_eq!(n.number(&1, Lsn(10)), Number::Version(6));
        assert_eq!(numbered(&mut n, 2, 20, 0), 1);
        assert_eq!(n.number(&1, Lsn(30)), Number::Version(7));
        assert_eq!(n.checkpoint(Lsn(10)), vec![], "nothing committed before 10");
        let mut at_25 = n.checkpoint(Lsn(25));
        at_25.sort();
        assert_eq!(at_25, vec![(1, 6), (2, 1)], "not the row committed at 30");
        assert_eq!(n.pending(), 1);
        assert_eq!(n.checkpoint(Lsn(31)), vec![(1, 7)]);
        assert_eq!(n.checkpoint(Lsn(40)), vec![], "written once");
        assert_eq!(n.pending(), 0);
        n.set_head(1, 99);
        assert_eq!(
            n.number(&1, Lsn(50)),
            Number::Version(8),
            "a known head stays"
        );
    }

    /// A stream of transactions: (commit LSN, the aggregates of its rows in change order).
    fn stream() -> impl Strategy<Value = Vec<(u64, Vec<u8>)>> {
        prop::collection::vec(prop::collection::vec(0u8..6, 1..5), 1..40).prop_map(|txns| {
            txns.into_iter()
                .enumerate()
                .map(|(i, rows)| (10 * (i as u64 + 1), rows))
                .collect()
        })
    }

    proptest! {
        /// Runs that crash anywhere and restart from their last written checkpoint give every
        /// row the version one uninterrupted run gives it: dense per aggregate, in commit order.
        #[test]
        fn restarts_number_every_row_as_one_run_does(
            txns in stream(),
            runs in prop::collection::vec(
                (0usize..50, prop::collection::vec((0usize..50, 0usize..4), 0..4)),
                0..5,
            ),
        ) {
            let mut reference = Numbering::default();
            let want: Vec<Vec<i64>> = txns
                .iter()
                .map(|(lsn, rows)| rows.iter().map(|&k| numbered(&mut reference, k, *lsn, 0)).collect())
                .collect();

            // What the ledger holds: the checkpoint (an index into txns: everything before it is
            // committed before it) and the numbering written with it.
            let (mut checkpoint, mut table) = (0usize, HashMap::<u8, i64>::new());
            // The last run crashes nowhere: every row is numbered at least once.
            let last = (usize::MAX, vec![]);
            let mut rows_checked = 0;
            for (crash_after, checkpoints_at) in runs.iter().chain([&last]) {
                let mut n = Numbering::default();
                let mut checkpoints_at = checkpoints_at.clone();
                checkpoints_at.sort();
                let start = checkpoint;
                for (i, (lsn, rows)) in txns.iter().enumerate().skip(start) {
                    if i - start >= *crash_after {
                        break;
                    }
                    for (j, &k) in rows.iter().enumerate() {
                        let v = numbered(&mut n, k, *lsn, table.get(&k).copied().unwrap_or(0));
                        prop_assert_eq!(v, want[i][j], "txn {} row {} (aggregate {})", i, j, k);
                        rows_checked += 1;
                    }
                    // A checkpoint may move to any transaction the run has streamed through,
                    // and usually lags behind what it streamed (`lag` transactions).
                    while let Some(&(_, lag)) = checkpoints_at.first().filter(|c| c.0 <= i - start) {
                        let to = (i + 1).saturating_sub(lag).max(checkpoint);
                        let through = txns.get(to).map_or(Lsn(u64::MAX), |t| Lsn(t.0));
                        let written = n.checkpoint(through);
                        let mut keys: Vec<u8> = written.iter().map(|(k, _)| *k).collect();
                        keys.sort();
                        keys.dedup();
                        prop_assert_eq!(keys.len(), written.len(), "each aggregate once: {:?}", written);
                        table.extend(written);
                        checkpoint = to;
                        checkpoints_at.remove(0);
                    }
                }
            }
            let total: usize = txns.iter().map(|t| t.1.len()).sum();
            prop_assert!(rows_checked >= total, "{} of {} rows numbered", rows_checked, total);
        }
    }
}
