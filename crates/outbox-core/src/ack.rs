//! The ack tracker: how far the relay may confirm the slot.
//!
//! # The invariant (DESIGN invariant 5)
//! The LSN confirmed to the replication slot never passes an event whose receipt is not
//! accepted into the ledger. PostgreSQL re-sends, after a restart, every transaction whose
//! commit record starts at or after the confirmed LSN; it *never* re-sends a transaction
//! whose commit ends at or before it. So confirming the `end_lsn` of transaction T is a
//! promise that T and every transaction before it are durably done.
//!
//! # How this type keeps it
//! pgoutput (protocol v1, no streaming) delivers whole transactions in commit order. The
//! tracker keeps one slot per received transaction, in that order, counting events that are
//! still unresolved. A transaction is *done* when its Commit has been seen and its count is
//! zero. The watermark is the `end_lsn` of the longest done prefix — a contiguous
//! low-watermark, not "the last callback" and not a timer: a late ack of an early event
//! holds back every later transaction, however many of them are done.
//!
//! When nothing is in flight (no open transaction, no unresolved event), the server's
//! keepalive `wal_end` may be confirmed too: the walsender sends a keepalive only after it
//! has sent every transaction that committed before that position, and we have resolved
//! all of them. This is what lets an idle or unrelated-write-heavy database release WAL.
//!
//! "Resolved" means recorded in the ledger: an accepted primary receipt, a duplicate transport
//! receipt, a quarantine or a held record. The relay resolves a batch's events when it takes
//! the batch (`outbox_relay::PipelineCore::take_batch`), just *before* the acceptance
//! transaction commits: the watermark it then reads is only a candidate, written in that same
//! transaction with the records that justify it, and confirmed to the slot only once the
//! transaction has committed (if it fails, the run ends and replays). The whole argument, in
//! one place: `outbox_relay::schedule::standby_status`.

use std::collections::VecDeque;

use crate::Lsn;

/// Position of a transaction in the order the tracker received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TxnSeq(pub u64);

/// Handle for one event in flight; resolve it exactly once with [`AckTracker::resolve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventToken {
    pub txn: TxnSeq,
}

#[derive(Debug, Clone)]
struct TxnSlot {
    /// `Some(end_lsn)` once the Commit message was received.
    end_lsn: Option<Lsn>,
    unresolved: u64,
}

/// Errors are caller bugs that would otherwise silently corrupt the watermark; the relay
/// treats them as fatal (replay from the last checkpoint), never as "skip".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    #[error("transaction {0:?} is not tracked (already done, or never begun)")]
    UnknownTxn(TxnSeq),
    #[error("event of transaction {0:?} resolved more times than it was added")]
    OverResolved(TxnSeq),
    #[error("Begin received while transaction {0:?} is still open (missing Commit)")]
    NestedBegin(TxnSeq),
    #[error("commit end LSN {got} goes backwards (previous commit ended at {previous})")]
    Backwards { got: Lsn, previous: Lsn },
}

/// Contiguous low-watermark of resolved events over transactions in commit order.
#[derive(Debug, Clone)]
pub struct AckTracker {
    slots: VecDeque<TxnSlot>,
    /// `TxnSeq` of `slots[0]`.
    base: u64,
    next: u64,
    watermark: Lsn,
    last_commit_end: Lsn,
    in_flight: u64,
}

impl AckTracker {
    /// Starts from the position the slot is already confirmed at (or the checkpoint).
    pub fn new(start: Lsn) -> Self {
        AckTracker {
            slots: VecDeque::new(),
            base: 0,
            next: 0,
            watermark: start,
            last_commit_end: start,
            in_flight: 0,
        }
    }

    /// The highest LSN that may be confirmed to the slot.
    pub fn watermark(&self) -> Lsn {
        self.watermark
    }

    /// Events added and not yet resolved.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Transactions received and not yet done (open ones included).
    pub fn pending_txns(&self) -> usize {
        self.slots.len()
    }

    /// A Begin message: opens the next transaction.
    pub fn begin(&mut self) -> Result<TxnSeq, AckError> {
        if let Some(last) = self.slots.back() {
            if last.end_lsn.is_none() {
                return Err(AckError::NestedBegin(TxnSeq(self.next - 1)));
            }
        }
        let seq = TxnSeq(self.next);
        self.next += 1;
        self.slots.push_back(TxnSlot {
            end_lsn: None,
            unresolved: 0,
        });
        Ok(seq)
    }

    /// One event of an open transaction went in flight.
    pub fn add_event(&mut self, txn: TxnSeq) -> Result<EventToken, AckError> {
        let slot = self.slot_mut(txn)?;
        slot.unresolved += 1;
        self.in_flight += 1;
        Ok(EventToken { txn })
    }

    /// The Commit message of `txn`, with its end LSN.
    pub fn commit(&mut self, txn: TxnSeq, end_lsn: Lsn) -> Result<(), AckError> {
        if end_lsn < self.last_commit_end {
            return Err(AckError::Backwards {
                got: end_lsn,
                previous: self.last_commit_end,
            });
        }
        self.last_commit_end = end_lsn;
        self.slot_mut(txn)?.end_lsn = Some(end_lsn);
        self.advance();
        Ok(())
    }

    /// The event is durably resolved in the ledger.
    pub fn resolve(&mut self, token: EventToken) -> Result<(), AckError> {
        let slot = self.slot_mut(token.txn)?;
        if slot.unresolved == 0 {
            return Err(AckError::OverResolved(token.txn));
        }
        slot.unresolved -= 1;
        self.in_flight -= 1;
        self.advance();
        Ok(())
    }

    /// A keepalive (or any message) told us the server has sent everything before `wal_end`.
    /// Moves the watermark there only when nothing at all is outstanding.
    pub fn idle_position(&mut self, wal_end: Lsn) {
        if self.slots.is_empty() && wal_end > self.watermark {
            self.watermark = wal_end;
        }
    }

    fn slot_mut(&mut self, txn: TxnSeq) -> Result<&mut TxnSlot, AckError> {
        let idx = txn
            .0
            .checked_sub(self.base)
            .ok_or(AckError::UnknownTxn(txn))?;
        self.slots
            .get_mut(usize::try_from(idx).map_err(|_| AckError::UnknownTxn(txn))?)
            .ok_or(AckError::UnknownTxn(txn))
    }

    fn advance(&mut self) {
        while let Some(front) = self.slots.front() {
            match front.end_lsn {
                Some(end) if front.unresolved == 0 => {
                    if end > self.watermark {
                        self.watermark = end;
                    }
                    self.slots.pop_front();
                    self.base += 1;
                }
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_late_early_ack_holds_back_later_transactions() {
        let mut t = AckTracker::new(Lsn(100));
        let t1 = t.begin().unwrap();
        let e1 = t.add_event(t1).unwrap();
        t.commit(t1, Lsn(200)).unwrap();
        let t2 = t.begin().unwrap();
        let e2 = t.add_event(t2).unwrap();
        t.commit(t2, Lsn(300)).unwrap();

        t.resolve(e2).unwrap();
        assert_eq!(
            t.watermark(),
            Lsn(100),
            "t2 done but t1 is not: must not move"
        );
        t.idle_position(Lsn(400));
        assert_eq!(
            t.watermark(),
            Lsn(100),
            "keepalive must not jump over pending work"
        );
        t.resolve(e1).unwrap();
        assert_eq!(t.watermark(), Lsn(300));
        t.idle_position(Lsn(400));
        assert_eq!(t.watermark(), Lsn(400));
    }

    #[test]
    fn an_open_transaction_is_never_passed() {
        let mut t = AckTracker::new(Lsn(10));
        let t1 = t.begin().unwrap();
        let e = t.add_event(t1).unwrap();
        t.resolve(e).unwrap();
        assert_eq!(t.watermark(), Lsn(10), "no Commit yet");
        t.idle_position(Lsn(50));
        assert_eq!(t.watermark(), Lsn(10));
        t.commit(t1, Lsn(20)).unwrap();
        assert_eq!(t.watermark(), Lsn(20));
    }

    #[test]
    fn misuse_is_an_error_not_a_skip() {
        let mut t = AckTracker::new(Lsn(0));
        let t1 = t.begin().unwrap();
        assert_eq!(t.begin(), Err(AckError::NestedBegin(t1)));
        let e = t.add_event(t1).unwrap();
        t.resolve(e).unwrap();
        assert_eq!(t.resolve(e), Err(AckError::OverResolved(t1)));
        t.commit(t1, Lsn(5)).unwrap();
        assert_eq!(t.resolve(e), Err(AckError::UnknownTxn(t1)));
    }

    /// A trace step for the model test.
    #[derive(Debug, Clone)]
    enum Step {
        /// A transaction with this many events.
        Txn(u8),
        /// Resolve the in-flight event at this (modulo) index.
        Resolve(usize),
        Keepalive,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..4).prop_map(Step::Txn),
            any::<usize>().prop_map(Step::Resolve),
            Just(Step::Keepalive),
        ]
    }

    proptest! {
        /// Model: the watermark is exactly the end LSN of the longest prefix of transactions
        /// whose events are all resolved (or a keepalive position when nothing is pending),
        /// and it never passes the commit of a transaction with an unresolved event.
        #[test]
        fn watermark_matches_model(steps in proptest::collection::vec(step(), 1..200)) {
            let mut t = AckTracker::new(Lsn(1));
            let mut lsn = 1u64;
            // model: (end_lsn, unresolved count) per transaction, in order
            let mut model: Vec<(u64, u32)> = Vec::new();
            let mut inflight: Vec<(usize, EventToken)> = Vec::new();
            let mut keepalive_floor = 1u64;
            for s in steps {
                match s {
                    Step::Txn(n) => {
                        let seq = t.begin().unwrap();
                        for _ in 0..n {
                            inflight.push((model.len(), t.add_event(seq).unwrap()));
                        }
                        lsn += 10;
                        t.commit(seq, Lsn(lsn)).unwrap();
                        model.push((lsn, u32::from(n)));
                    }
                    Step::Resolve(i) => {
                        if !inflight.is_empty() {
                            let (txn, tok) = inflight.remove(i % inflight.len());
                            model[txn].1 -= 1;
                            t.resolve(tok).unwrap();
                        }
                    }
                    Step::Keepalive => {
                        lsn += 3;
                        if model.iter().all(|(_, n)| *n == 0) {
                            keepalive_floor = lsn;
                        }
                        t.idle_position(Lsn(lsn));
                    }
                }
                let prefix_end = model
                    .iter()
                    .take_while(|(_, n)| *n == 0)
                    .last()
                    .map(|(end, _)| *end)
                    .unwrap_or(1);
                let expected = prefix_end.max(keepalive_floor);
                prop_assert_eq!(t.watermark(), Lsn(expected));
                // Safety: never at or past the commit of a transaction with unresolved events.
                if let Some((end, _)) = model.iter().find(|(_, n)| *n > 0) {
                    prop_assert!(t.watermark().0 < *end);
                }
                prop_assert_eq!(t.in_flight(), inflight.len() as u64);
            }
        }
    }
}
