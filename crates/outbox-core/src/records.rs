//! What the relay records durably, as values: receipts, quarantine and hold records, and the
//! events recorded as held. The relay core builds them, the ledger's acceptance transaction
//! writes them (`outbox_ledger::accept`), and the simulator's ledger model applies them.

use uuid::Uuid;

use crate::Lsn;

/// A broker receipt to accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiptRecord {
    pub event_id: Uuid,
    /// The version of its aggregate the event was published with (its envelope's). Kept with
    /// the receipt (migration 0036) so that a row whose version the relay assigned finds it
    /// again after a restart (docs/versions_by_relay.md).
    pub aggregate_version: i64,
    pub payload_digest: String,
    pub destination_digest: String,
    pub broker_kind: String,
    pub broker_cluster: String,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: Option<i64>,
    pub attempt: i32,
    pub relay_generation: i64,
    /// Commit LSN of the producing transaction; `None` for events published from the
    /// initial snapshot (they predate the slot).
    pub commit_lsn: Option<Lsn>,
    /// The LSN of the row's own change record, as the stream delivered it: with `commit_lsn`
    /// the row's stream position ([`ReceiptRecord::position`]). `None` for rows not read from
    /// the stream (snapshot, release, poll mode, a look-up's receipt).
    pub change_lsn: Option<Lsn>,
    /// What proves it beyond the position, as JSON (an HTTP endpoint's answer); `None` for
    /// brokers.
    pub evidence: Option<String>,
}

impl ReceiptRecord {
    /// Where its row stands in the slot's stream, when it was read from the stream.
    pub fn position(&self) -> Option<crate::lsn::StreamPosition> {
        Some(crate::lsn::StreamPosition {
            commit_lsn: self.commit_lsn?,
            change_lsn: self.change_lsn?,
        })
    }

    /// The highest stream position its row can have: its position, or, for a receipt that
    /// knows only its transaction's commit LSN (a release of a held event), the end of that
    /// transaction. What an acceptance raises the slot's accepted position to: a bound too
    /// high only sends more batches to be classified, never one that holds a replay to the
    /// plain insert.
    pub fn position_bound(&self) -> Option<crate::lsn::StreamPosition> {
        Some(crate::lsn::StreamPosition {
            commit_lsn: self.commit_lsn?,
            change_lsn: self.change_lsn.unwrap_or(Lsn(u64::MAX)),
        })
    }
}

/// An event the relay refuses to publish, with its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantineRecord {
    /// Event id as text, or `lsn:<commit lsn>:<n>` when the id itself is unreadable.
    pub key: String,
    pub event_id: Option<Uuid>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<i64>,
    pub reason_code: String,
    pub reason: String,
    pub commit_lsn: Lsn,
    /// The envelope generation the refusal was decided for (`None`: the row was unreadable).
    /// A refusal decided for a generation an operator's destination migration has replaced is
    /// stale ([`RefusalFilter::stands`]).
    pub envelope_generation: Option<i32>,
}

impl QuarantineRecord {
    /// A row that could not even be read as an envelope (no aggregate to hold), under `key`
    /// (`lsn:<commit lsn>:<n>`), with why.
    pub fn unreadable(key: String, reason: String, commit_lsn: Lsn) -> QuarantineRecord {
        QuarantineRecord {
            key,
            event_id: None,
            aggregate_type: None,
            aggregate_id: None,
            aggregate_version: None,
            reason_code: "unreadable_row".into(),
            reason,
            commit_lsn,
            envelope_generation: None,
        }
    }
}

/// An aggregate that must not publish until an operator releases it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldRecord {
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub reason_code: String,
    pub reason: String,
    pub blocking_event_id: Option<Uuid>,
    pub blocking_version: Option<i64>,
    /// The envelope generation of the blocking event the hold was decided for.
    pub blocking_generation: Option<i32>,
    /// For a blocking row written without a version: the route version the relay routed it
    /// by, if the row names none and stores no destination (`Some(None)`: it does), so that a
    /// release can publish it as the stream would have (as [`HeldRecord::by_relay`]).
    pub blocking_by_relay: Option<Option<i64>>,
}

/// An event of a held aggregate, recorded instead of published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldRecord {
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_version: i64,
    pub commit_lsn: Option<Lsn>,
    /// For a row written without a version (docs/versions_by_relay.md): the route version the
    /// relay routed it by, if the row names none and stores no destination (`Some(None)`: it
    /// does), so that a release publishes it as the stream would have; `None` for a row written
    /// with its version. `aggregate_version` is then the relay's numbering.
    pub by_relay: Option<Option<i64>>,
}

/// One thing to record durably.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerItem {
    Receipt(ReceiptRecord),
    Quarantine(QuarantineRecord),
    Hold(HoldRecord),
    Held(HeldRecord),
}

/// The kinds of refusal record an acceptance batch may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// A quarantine record of an event.
    Quarantine,
    /// A hold of an aggregate, naming its blocking event.
    Hold,
    /// An event recorded as held behind its aggregate's hold.
    Held,
}

impl LedgerItem {
    /// The refusal this item records and the event it is about (for a hold, its blocking
    /// event); `None` for a receipt, and for a refusal about no readable event.
    pub fn refusal(&self) -> Option<(RefusalKind, Uuid)> {
        match self {
            LedgerItem::Receipt(_) => None,
            LedgerItem::Quarantine(q) => q.event_id.map(|id| (RefusalKind::Quarantine, id)),
            LedgerItem::Hold(h) => h.blocking_event_id.map(|id| (RefusalKind::Hold, id)),
            LedgerItem::Held(h) => Some((RefusalKind::Held, h.event_id)),
        }
    }

    /// The envelope generation a quarantine or hold was decided for, if known; `None` for a
    /// receipt and a held record (holding an event behind its aggregate's hold is no decision
    /// about its destination).
    pub fn decided_generation(&self) -> Option<i32> {
        match self {
            LedgerItem::Quarantine(q) => q.envelope_generation,
            LedgerItem::Hold(h) => h.blocking_generation,
            LedgerItem::Receipt(_) | LedgerItem::Held(_) => None,
        }
    }

    /// Whether this refusal was decided for an envelope generation older than `current`, the
    /// event's generation in the ledger now.
    pub fn superseded(&self, current: Option<i32>) -> bool {
        matches!((self.decided_generation(), current), (Some(d), Some(c)) if d < c)
    }
}

/// Which refusal records of an acceptance batch still stand. A refusal is decided when the
/// relay sends (or decodes) an event, and committed later; meanwhile the event may have been
/// published, or moved to another destination:
///
/// * **published**: a paused relay commits a refusal it decided before a destination migration
///   published the event, a replay decodes an event that was published since. Recording it
///   would quarantine a published event and hold its aggregate behind an event that is out
///   (found by outbox-sim, seed 1 trace 195).
/// * **superseded**: the refusal (a quarantine, a hold) was decided for an envelope generation
///   that an operator's destination migration has replaced since. A paused relay salvaging
///   its batch commits a `destination_not_served` decided for the old destination while the
///   live relay is sending the migrated event to the new one; the stale quarantine makes the
///   event a candidate for a second migration whose scan may run while the live relay's copy
///   is still on its way to that destination: a copy at a destination the event no longer has
///   (found by outbox-sim, seed 1 trace 189388). The live relay decides about the current
///   generation; a decision about an old one is no record.
///
/// The ledger's acceptance transaction asks which subjects have a primary receipt (this
/// batch's included) and which envelope generation each has now, and records only what
/// [`RefusalFilter::stands`]; the simulator's ledger model asks the same.
///
/// `HONOUR_STALE` and `HONOUR_SUPERSEDED` are the simulator's product mutants (the ledger as it
/// was before each fix): quarantines and holds recorded although their event is published, or
/// although they were decided for a replaced generation. The ledger's filter is
/// `RefusalFilter` (both `false`) in every build: no crate feature changes the daemon's code,
/// so the binary tested is the one shipped.
#[derive(Debug, Clone, Copy)]
pub struct RefusalFilter<const HONOUR_STALE: bool = false, const HONOUR_SUPERSEDED: bool = false> {
    /// Built with `default()` (the product) or the mutants' constructors only.
    _private: (),
}

impl Default for RefusalFilter {
    fn default() -> Self {
        RefusalFilter { _private: () }
    }
}

impl RefusalFilter<true, false> {
    /// The simulator's mutant `bug-stale-quarantine`.
    pub fn honouring_stale() -> Self {
        RefusalFilter { _private: () }
    }
}

impl RefusalFilter<false, true> {
    /// The simulator's mutant `bug-superseded-refusal`.
    pub fn honouring_superseded() -> Self {
        RefusalFilter { _private: () }
    }
}

impl<const HONOUR_STALE: bool, const HONOUR_SUPERSEDED: bool>
    RefusalFilter<HONOUR_STALE, HONOUR_SUPERSEDED>
{
    /// Whether a refusal of `kind` is recorded when its event is (`published`) or is not
    /// published yet, and was decided for a replaced envelope generation (`superseded`,
    /// [`LedgerItem::superseded`]) or not.
    pub fn stands(&self, kind: RefusalKind, published: bool, superseded: bool) -> bool {
        if HONOUR_STALE && kind != RefusalKind::Held {
            return true;
        }
        if superseded && !HONOUR_SUPERSEDED && kind != RefusalKind::Held {
            return false;
        }
        !published
    }
}

/// An event's quarantine record, as a read of unpublished rows sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuarantineState {
    /// Open: an operator decides the event's fate.
    Open,
    /// Released by an operator (`outboxd quarantine release`): to be published.
    Released,
    /// Skipped by an operator (`outboxd quarantine skip`): never to be published.
    Skipped,
}

/// What a read of unpublished rows (a snapshot, a poll round) knows about one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OfferFacts {
    /// It has a primary receipt.
    pub published: bool,
    /// Its quarantine record, if any. With several, an open one decides (it blocks the row
    /// under any rule), else a skip, else a release.
    pub quarantine: Option<QuarantineState>,
    /// Its aggregate is held (`outbox.holds`): its events wait for the operator's release.
    pub aggregate_held: bool,
}

rule_with_mutant! {
    /// Which rows a relay's reads offer for sending: the rule of `outbox_source`'s
    /// `pending_rows_sql` (a snapshot; a held aggregate's events are held by the gate instead) and
    /// `poll::pending_sql` (a poll round; held aggregates are left to the release), through
    /// `snapshot::QUARANTINED_OR_SKIPPED`; the test `reads_offer_what_the_rule_says` (outbox-source)
    /// holds the SQL and this rule together, and the simulator's reads decide with it.
    ///
    /// `IGNORE_SKIPS` is the simulator's product mutant `poll-offers-skipped` (the read before its
    /// fix excluded only open quarantines, so a skipped event was sent again; counted by
    /// `skipped_offered`). The reads are [`OfferRule::default`]'s in every build.
    pub struct OfferRule<const IGNORE_SKIPS>;
    /// The simulator's mutant `poll-offers-skipped`.
    pub fn ignoring_skips;
}

impl<const IGNORE_SKIPS: bool> OfferRule<IGNORE_SKIPS> {
    /// Whether a snapshot offers the row.
    pub fn by_snapshot(&self, f: OfferFacts) -> bool {
        let blocked = match f.quarantine {
            Some(QuarantineState::Open) => true,
            Some(QuarantineState::Skipped) => !IGNORE_SKIPS,
            Some(QuarantineState::Released) | None => false,
        };
        !f.published && !blocked
    }

    /// Whether a poll round offers the row.
    pub fn by_poll_round(&self, f: OfferFacts) -> bool {
        self.by_snapshot(f) && !f.aggregate_held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_offer_unpublished_rows_no_operator_stopped() {
        let rule = OfferRule::default();
        let pending = OfferFacts {
            published: false,
            quarantine: None,
            aggregate_held: false,
        };
        assert!(rule.by_snapshot(pending) && rule.by_poll_round(pending));
        let released = OfferFacts {
            quarantine: Some(QuarantineState::Released),
            ..pending
        };
        assert!(rule.by_poll_round(released));
        for f in [
            OfferFacts {
                published: true,
                ..pending
            },
            OfferFacts {
                quarantine: Some(QuarantineState::Open),
                ..pending
            },
            OfferFacts {
                quarantine: Some(QuarantineState::Skipped),
                ..pending
            },
        ] {
            assert!(!rule.by_snapshot(f) && !rule.by_poll_round(f), "{f:?}");
        }
        let held = OfferFacts {
            aggregate_held: true,
            ..pending
        };
        assert!(rule.by_snapshot(held) && !rule.by_poll_round(held));
        let skipped = OfferFacts {
            quarantine: Some(QuarantineState::Skipped),
            ..pending
        };
        assert!(OfferRule::ignoring_skips().by_poll_round(skipped));
    }

    #[test]
    fn a_refusal_about_a_published_event_is_stale() {
        let f = RefusalFilter::default();
        for kind in [
            RefusalKind::Quarantine,
            RefusalKind::Hold,
            RefusalKind::Held,
        ] {
            assert!(
                f.stands(kind, false, false),
                "{kind:?} of an unpublished event"
            );
            assert!(
                !f.stands(kind, true, false),
                "{kind:?} of a published event"
            );
        }
    }

    #[test]
    fn a_refusal_decided_for_a_replaced_generation_is_stale() {
        let f = RefusalFilter::default();
        let q = |generation| {
            LedgerItem::Quarantine(QuarantineRecord {
                key: "k".into(),
                event_id: Some(Uuid::from_u128(1)),
                aggregate_type: Some("a".into()),
                aggregate_id: Some("1".into()),
                aggregate_version: Some(1),
                reason_code: "destination_not_served".into(),
                reason: "x".into(),
                commit_lsn: Lsn(1),
                envelope_generation: generation,
            })
        };
        // Decided for generation 1, the event migrated to 2: superseded.
        assert!(q(Some(1)).superseded(Some(2)));
        assert!(!q(Some(2)).superseded(Some(2)));
        assert!(
            !q(None).superseded(Some(2)),
            "an unreadable row's quarantine"
        );
        assert!(
            !q(Some(1)).superseded(None),
            "an event the ledger does not know"
        );
        for kind in [RefusalKind::Quarantine, RefusalKind::Hold] {
            assert!(
                !f.stands(kind, false, true),
                "{kind:?} of a replaced generation"
            );
            assert!(
                RefusalFilter::honouring_superseded().stands(kind, false, true),
                "the mutant records it"
            );
        }
        // Holding an event behind its aggregate's hold decides nothing about its destination.
        assert!(f.stands(RefusalKind::Held, false, true));
    }

    #[test]
    fn a_refusal_names_its_event_and_an_unreadable_row_none() {
        let q = QuarantineRecord {
            key: "lsn:0/1:1".into(),
            event_id: None,
            aggregate_type: None,
            aggregate_id: None,
            aggregate_version: None,
            reason_code: "unreadable_row".into(),
            reason: "x".into(),
            commit_lsn: Lsn(1),
            envelope_generation: None,
        };
        assert_eq!(LedgerItem::Quarantine(q).refusal(), None);
        let id = Uuid::from_u128(7);
        let held = HeldRecord {
            event_id: id,
            aggregate_type: "a".into(),
            aggregate_id: "1".into(),
            aggregate_version: 2,
            commit_lsn: None,
            by_relay: None,
        };
        assert_eq!(
            LedgerItem::Held(held).refusal(),
            Some((RefusalKind::Held, id))
        );
    }
}
