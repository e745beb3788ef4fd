//! DISPATCH_UNKNOWN reconciliation: which open attempts to look up now, and what a look-up
//! means for the relay.
//!
//! The broker-neutral rule (found / retry / still unknown) is `outbox_core::receipt::
//! resolve_unknown`; this module adds the relay's side: when an attempt is settled enough to be
//! looked up (at start every open attempt, what is left of its settle time becoming its due
//! time in the run, `crate::pipeline::unclear`; while running only the settled attempts
//! another generation recorded), and what the pipeline must remember
//! afterwards ([`crate::PipelineCore::unknown_resolved`]): a found event is never sent again,
//! a proven-absent one is sent again with the next attempt generation. The daemon
//! (`relay/unknown.rs`) does the I/O around it; the simulator calls the same functions.

use std::time::Duration;

use outbox_core::receipt::{self, Scan, UnknownResolution};

/// When the relay reconciles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// At start, before streaming: every open attempt, after its settle time.
    Start,
    /// While running: settled attempts of other generations (a resumed zombie's late report);
    /// a failed look-up is retried at the next poll instead of ending the run.
    Running,
}

/// What to do with one open attempt now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Not now (an attempt of this run, or not settled while running).
    Skip,
    /// Look it up after this long (what is left of the settle time; zero while running).
    WaitThenLookup(Duration),
}

/// Whether and when to look up an attempt that `attempt_relay_generation` recorded
/// `unknown_for` ago, for a run of generation `generation`.
pub fn step(
    when: When,
    generation: i64,
    attempt_relay_generation: i64,
    unknown_for: Duration,
    settle: Duration,
) -> Step {
    let left = settle.saturating_sub(unknown_for);
    match when {
        When::Running if attempt_relay_generation == generation || !left.is_zero() => Step::Skip,
        When::Running => Step::WaitThenLookup(Duration::ZERO),
        When::Start => Step::WaitThenLookup(left),
    }
}

/// An open DISPATCH_UNKNOWN attempt, as reconciliation reads it from the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Open {
    pub event_id: uuid::Uuid,
    /// The generation of the run that recorded it.
    pub relay_generation: i64,
    /// How long it has been unknown.
    pub unknown_for: Duration,
    /// Its event has its primary receipt already.
    pub has_receipt: bool,
    /// Looking it up would send the event again under its key (`Sink::lookup_resends`: an
    /// HTTP endpoint; JetStream inside the duplicate window).
    pub lookup_resends: bool,
}

/// What reconciliation does with one open attempt now ([`crate::PipelineCore::reconcile`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reconcile {
    /// Nothing now: an attempt of an event this run has parked (its own look-up resolves
    /// every open attempt), of this run, not settled yet, or at start one whose event is
    /// published (it may never be replayed; the running reconciliation traces it).
    Skip,
    /// At start: handed to the run, due after what is left of its settle time; the replay
    /// parks its event when it reaches it, and its look-up runs beside everything else.
    HandedToRun,
    /// While running: look it up (beside the relay's loop) and record what it proves, then
    /// tell [`crate::pipeline::PipelineCore::reconciled`]; until then the event's attempts are
    /// skipped.
    LookUp,
    /// While running: its event has its receipt and the look-up would send it again under
    /// its key. The receipt is the destination's answer under that key, so it is the answer
    /// for this attempt too ([`answered_already`]): the attempt is closed as found at the
    /// receipt's position, and nothing is sent (a published event sent again after a
    /// restart, and the relay's loop waiting on the endpoint meanwhile).
    ClosedByReceipt,
}

/// What a look-up of a settled attempt means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// The broker has the attempt's copy at `offset`: record it as the primary receipt of
    /// `attempt_generation`; never send the event again.
    Found {
        offset: i64,
        attempt_generation: i32,
    },
    /// JetStream's duplicate detection stored the re-publish at `offset`: that copy is the
    /// retry (`attempt_generation`); record its receipt; never send the event again.
    StoredByProbe {
        offset: i64,
        attempt_generation: i32,
    },
    /// Proven absent: the next send is a retry with `attempt_generation`, to the same frozen
    /// destination.
    Retry { attempt_generation: i32 },
    /// Nothing proven: the attempt stays open (a relay starting up cannot go on).
    StillUnknown,
}

/// Applies the rule to a settled attempt: `attempt` is its generation, `last` the highest
/// generation of the event, `scan` what the look-up proved, `probe_offset` where a JetStream
/// probe was stored (it proved the original absent and is itself the retry).
pub fn resolve(attempt: i32, last: i32, scan: Scan, probe_offset: Option<i64>) -> Resolved {
    match receipt::resolve_unknown(attempt, last, true, scan) {
        UnknownResolution::StillUnknown => Resolved::StillUnknown,
        UnknownResolution::Found {
            offset,
            attempt_generation,
        } => Resolved::Found {
            offset,
            attempt_generation,
        },
        UnknownResolution::Retry { attempt_generation } => match probe_offset {
            Some(offset) => Resolved::StoredByProbe {
                offset,
                attempt_generation,
            },
            None => Resolved::Retry { attempt_generation },
        },
    }
}

/// What the ledger must record for a look-up that `resolved` an attempt, in this order: the
/// attempt's resolution first where it is `before` the receipt, then the receipt, then the
/// resolution where it is not ([`record`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The copy's primary receipt (accepted like any other: a duplicate if one exists).
    pub receipt: Option<ReceiptAt>,
    /// The attempt's resolution (`attempts::resolve`): FOUND at `Some(offset)`, ABSENT at
    /// `None`.
    pub resolve: Option<Option<i64>>,
    /// The resolution is written before the receipt.
    pub resolve_first: bool,
}

/// One write of a look-up's [`Record`], in the order [`Record::writes`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Resolve the attempt (`attempts::resolve`): FOUND at `Some(offset)`, ABSENT at `None`.
    Resolve(Option<i64>),
    /// Accept the copy's primary receipt.
    Receipt(ReceiptAt),
}

impl Record {
    /// What to write, in order: the resolution first where it comes first, the receipt, the
    /// resolution where it comes last. The daemon's `record_lookup` and the simulator's
    /// execute these.
    pub fn writes(&self) -> Vec<Write> {
        let resolve = self.resolve.map(Write::Resolve);
        let receipt = self.receipt.map(Write::Receipt);
        let order = if self.resolve_first {
            [resolve, receipt]
        } else {
            [receipt, resolve]
        };
        order.into_iter().flatten().collect()
    }
}

/// Where a look-up's copy is, and which send it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiptAt {
    pub offset: i64,
    pub attempt_generation: i32,
    pub relay_generation: i64,
}

/// What a look-up that `resolved` an attempt sent by relay generation `attempt_relay_generation`
/// writes, for a run of generation `generation`:
///
/// * found: the copy is the attempt's own send (its generations); its receipt is accepted
///   before the attempt is resolved FOUND, so a failure in between leaves an open attempt of
///   a published event, which reconciliation closes;
/// * stored by the re-send under the key: the original is not there (the duplicate window
///   would have named it) and the re-send, this run's, is the retry; the attempt is resolved
///   ABSENT, then the re-send's receipt is accepted;
/// * proven absent: the attempt is resolved ABSENT (the next send is the retry);
/// * nothing proven: nothing is written.
pub fn record(resolved: Resolved, attempt_relay_generation: i64, generation: i64) -> Record {
    // (offset, attempt generation, relay generation) of the receipt; the resolution; whether
    // it comes first.
    let (receipt, resolve, resolve_first) = match resolved {
        Resolved::Found {
            offset,
            attempt_generation,
        } => (
            Some((offset, attempt_generation, attempt_relay_generation)),
            Some(Some(offset)),
            false,
        ),
        Resolved::StoredByProbe {
            offset,
            attempt_generation,
        } => (
            Some((offset, attempt_generation, generation)),
            Some(None),
            true,
        ),
        Resolved::Retry { .. } => (None, Some(None), true),
        Resolved::StillUnknown => (None, None, false),
    };
    Record {
        receipt: receipt.map(|(offset, attempt_generation, relay_generation)| ReceiptAt {
            offset,
            attempt_generation,
            relay_generation,
        }),
        resolve,
        resolve_first,
    }
}

/// Whether another open attempt of an event is settled by the answer its look-up just had,
/// without being looked up itself. Only where both look-ups are the same re-send of the event
/// under its key (`resent`: the one answered; `next_resends`: the other's; an HTTP retry with
/// the same idempotency key, a JetStream re-publish inside the duplicate window): the
/// destination answers by key, not by attempt, so the answer it gave is the answer for every
/// attempt under that key, and asking again would send the event again after a clear answer
/// (a destination that deduplicates answers the same; one that does not applies it twice).
/// A look-up that reads what the broker holds (a Kafka scan, a JetStream read outside the
/// window) still runs for every attempt: each may have left a copy of its own. Nothing
/// proven (`StillUnknown`) settles nothing.
pub fn answered_already(resent: bool, resolved: &Resolved, next_resends: bool) -> bool {
    resent
        && next_resends
        && matches!(
            resolved,
            Resolved::Found { .. } | Resolved::StoredByProbe { .. }
        )
}

/// How another open attempt that the same answer settles ([`answered_already`]) is resolved:
/// FOUND at the copy's offset where the answer found it, else ABSENT (the re-send stored under
/// the key is the retry).
pub fn settled_at(resolved: &Resolved) -> Option<i64> {
    match *resolved {
        Resolved::Found { offset, .. } => Some(offset),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_resend_answered_settles_only_the_attempts_a_resend_would_look_up() {
        let stored = Resolved::StoredByProbe {
            offset: 0,
            attempt_generation: 3,
        };
        let found = Resolved::Found {
            offset: 7,
            attempt_generation: 1,
        };
        assert!(answered_already(true, &stored, true), "HTTP: same key");
        assert_eq!(
            settled_at(&stored),
            None,
            "ABSENT: the re-send is the retry"
        );
        assert_eq!(settled_at(&found), Some(7), "FOUND at the copy");
        assert!(answered_already(true, &found, true), "JetStream duplicate");
        assert!(
            !answered_already(true, &stored, false),
            "the other attempt is outside the duplicate window: read the stream"
        );
        assert!(
            !answered_already(false, &found, false),
            "a Kafka scan found one copy; the other attempt may have left another"
        );
        assert!(!answered_already(true, &Resolved::StillUnknown, true));
        assert!(!answered_already(
            true,
            &Resolved::Retry {
                attempt_generation: 2
            },
            true
        ));
    }

    #[test]
    fn at_start_every_attempt_is_looked_up_after_its_settle_time() {
        assert_eq!(
            step(When::Start, 5, 4, s(1), s(3)),
            Step::WaitThenLookup(s(2))
        );
        assert_eq!(
            step(When::Start, 5, 5, s(9), s(3)),
            Step::WaitThenLookup(s(0))
        );
    }

    #[test]
    fn while_running_only_settled_attempts_of_other_generations_are_looked_up() {
        assert_eq!(step(When::Running, 5, 5, s(9), s(3)), Step::Skip, "our own");
        assert_eq!(
            step(When::Running, 5, 4, s(1), s(3)),
            Step::Skip,
            "not settled"
        );
        assert_eq!(
            step(When::Running, 5, 4, s(3), s(3)),
            Step::WaitThenLookup(s(0))
        );
    }

    #[test]
    fn a_found_copy_is_the_attempts_own_send_and_a_stored_re_send_is_this_runs_retry() {
        let found = record(
            Resolved::Found {
                offset: 7,
                attempt_generation: 1,
            },
            3,
            5,
        );
        assert_eq!(
            found.receipt,
            Some(ReceiptAt {
                offset: 7,
                attempt_generation: 1,
                relay_generation: 3
            })
        );
        assert_eq!((found.resolve, found.resolve_first), (Some(Some(7)), false));
        assert!(matches!(
            found.writes()[..],
            [Write::Receipt(_), Write::Resolve(Some(7))]
        ));
        let stored = record(
            Resolved::StoredByProbe {
                offset: 9,
                attempt_generation: 2,
            },
            3,
            5,
        );
        assert_eq!(stored.receipt.map(|r| r.relay_generation), Some(5));
        assert_eq!((stored.resolve, stored.resolve_first), (Some(None), true));
        assert!(matches!(
            stored.writes()[..],
            [Write::Resolve(None), Write::Receipt(_)]
        ));
        let retry = record(
            Resolved::Retry {
                attempt_generation: 2,
            },
            3,
            5,
        );
        assert_eq!((retry.receipt, retry.resolve), (None, Some(None)));
        assert_eq!(retry.writes(), [Write::Resolve(None)]);
        let nothing = record(Resolved::StillUnknown, 3, 5);
        assert_eq!((nothing.receipt, nothing.resolve), (None, None));
        assert!(nothing.writes().is_empty());
    }

    #[test]
    fn a_look_up_is_found_retried_stored_by_the_probe_or_still_unknown() {
        assert_eq!(
            resolve(1, 1, Scan::Found { offset: 7 }, None),
            Resolved::Found {
                offset: 7,
                attempt_generation: 1
            }
        );
        assert_eq!(
            resolve(1, 1, Scan::Absent, None),
            Resolved::Retry {
                attempt_generation: 2
            }
        );
        assert_eq!(
            resolve(1, 1, Scan::Absent, Some(9)),
            Resolved::StoredByProbe {
                offset: 9,
                attempt_generation: 2
            }
        );
        assert_eq!(
            resolve(1, 1, Scan::Unavailable, None),
            Resolved::StillUnknown
        );
    }
}
