//! The acceptance decisions, as pure functions: what a transport receipt is, how a
//! DISPATCH_UNKNOWN attempt is resolved, and when a destination migration is allowed.
//!
//! These rules used to live only inside SQL and the relay's I/O code. They are here so that
//! one statement of each rule is unit-tested, driven by the deterministic simulator
//! (`outbox-sim`) through millions of fault traces, and used by the I/O code:
//!
//! * [`position_proof`] — when a broker's *success* report is evidence at all: only with a real
//!   position (partition ≥ 0, offset ≥ 0) in the container the event was sent to. librdkafka
//!   reports success without a stored message (an "implicit ack" of a failed batch once a later
//!   batch of the partition succeeds, offset -1001); such a report is DISPATCH_UNKNOWN, resolved
//!   by a scan like any other. Used by both sinks; the ledger's CHECK constraints are the
//!   backstop.
//! * [`classify`] — the single acceptance point (DESIGN invariant 6). `outbox-ledger`'s
//!   acceptance statements (`ACCEPT_SQL`, and the plain `COPY` of `accept_fresh` where only primaries are
//!   possible) implement the same decision set-wise (the publish slot is the primary key of `outbox.receipt_entries`); a
//!   change to one is a change to both.
//! * [`resolve_unknown`] — UNKNOWN stays unknown until proven: found on the broker → that copy is
//!   the primary receipt of the attempt that sent it, no resend; absent over a complete scan after
//!   the producer session closed → retry with attempt generation + 1 to the *same* frozen
//!   destination; anything else → still unknown. Used by `outboxd`'s reconciler.
//! * [`migration_precheck`] / [`migration_after_scan`] — a destination migration needs proof
//!   that the old target did not accept the event, and is refused while the old target's
//!   outcome is unknown. Used by `outboxd migrate-destination`.
//! * [`may_purge`] — retention: nothing is purged while anything can still bring the event
//!   back. The simulator drives it; the purge of issue 5 is meant to call it.

use std::fmt;

pub use crate::lsn::StreamPosition;

/// The two digests a receipt carries (from the send) and a frozen row holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Digests<'a> {
    pub payload: &'a str,
    pub destination: &'a str,
}

/// What the acceptance point does with one transport receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiptClass {
    /// It fills the event's publish slot: the primary receipt.
    Primary,
    /// The publish slot is taken: evidence, kept as a duplicate transport receipt.
    Duplicate,
    /// Never accepted: quarantined with the reason.
    Conflict(Conflict),
}

/// Why a receipt was quarantined instead of accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    /// Its destination digest differs from the one an operator's destination migration froze
    /// for the event (`outbox.destination_migrations`): it is evidence of a copy at the old
    /// destination.
    DigestMismatch,
}

impl Conflict {
    /// The reason code stored in `outbox.quarantine`.
    pub fn reason_code(self) -> &'static str {
        match self {
            Conflict::DigestMismatch => "receipt_digest_mismatch",
        }
    }
}

/// The acceptance decision for one receipt. `migrated` is the destination digest of the
/// event's latest destination migration, if an operator migrated it; `has_primary` whether its
/// publish slot is already filled (a purged event's tombstone fills it too). It does not
/// matter which attempt, relay generation or lease produced the ACK: a late valid ACK of an
/// old attempt competes for the same slot as the newest one.
///
/// Nothing else of the row is compared, and no row is looked up: every receipt is built by a
/// relay from a row it read (decoded, snapshotted or polled), which computed both digests from
/// that row and checked any the row stores (`OutboxEvent::from_text_columns`); the row is
/// immutable (migration 0027), so only an operator's migration can make a receipt's
/// destination stale after that read. What a relay bug could still produce (digests that are
/// not the row's, an event id with no row) is named by the audit (`outbox-ledger`'s
/// `ledger_conflicts`), off the acceptance's path (docs/evidence_batches.md).
///
/// The ledger's acceptance statements are this rule in SQL (their agreement test, both
/// statements, is in `outbox-ledger/tests/ledger.rs`); it is [`AcceptanceRule::default`]'s.
pub fn classify(migrated: Option<&str>, has_primary: bool, receipt: Digests<'_>) -> ReceiptClass {
    AcceptanceRule::default().classify(migrated, has_primary, receipt)
}

rule_with_mutant! {
    /// The acceptance rule, with the simulator's product mutant: `LAST_ACK_WINS` lets every valid
    /// ACK take the publish slot, replacing the primary receipt (the simulator's `last-ack-wins`,
    /// counted by `late_ack_convergence`). The ledger and [`classify`] use
    /// [`AcceptanceRule::default`] (`false`) in every build: no crate feature changes the
    /// daemon's code, so the binary tested is the one shipped.
    pub struct AcceptanceRule<const LAST_ACK_WINS>;
    /// The simulator's mutant `last-ack-wins`.
    pub fn last_ack_wins;
}

impl<const LAST_ACK_WINS: bool> AcceptanceRule<LAST_ACK_WINS> {
    /// See [`classify`].
    pub fn classify(
        &self,
        migrated: Option<&str>,
        has_primary: bool,
        receipt: Digests<'_>,
    ) -> ReceiptClass {
        match migrated {
            Some(d) if d != receipt.destination => ReceiptClass::Conflict(Conflict::DigestMismatch),
            _ if has_primary && !LAST_ACK_WINS => ReceiptClass::Duplicate,
            _ => ReceiptClass::Primary,
        }
    }
}

/// Whether every receipt of a batch is proven new to its slot: each has a stream position,
/// and each is past `accepted_through`, the highest position among the receipts the slot's
/// other runs' acceptances recorded (read under the slot's checkpoint row lock; `None` when
/// there is none; see [`batch_floor`]). A run reads the stream once, in position order,
/// from where the last run's confirmed checkpoint was: a receipt past every other run's
/// positions cannot have been recorded before, so the batch's receipts can only be primary
/// ones, unless another slot accepted the same event (the ledger's key on the publish slot
/// still refuses that). A batch that is not
/// proven new (a replay after a restart, a receipt from a snapshot, a release or a look-up,
/// without a position) is classified receipt by receipt ([`classify`]).
///
/// The ledger's acceptance makes this comparison in its gate statement, under the slot's lock
/// and without a round trip of its own: the batch's [`batch_floor`] against the other runs'
/// highest position (`outbox-ledger`'s `FRESH_BATCH_SQL`; its ledger test holds the boundary:
/// at the position is not new, past it is). The simulator decides by this function and counts
/// the batches it proves new although one of their events already had a primary receipt
/// (`fresh_proofs_wrong`, which must be 0).
pub fn proved_new(
    accepted_through: Option<StreamPosition>,
    positions: impl IntoIterator<Item = Option<StreamPosition>>,
) -> bool {
    FreshnessRule::default().proved_new(accepted_through, positions)
}

/// The relay generation under which receipts without a stream position (a snapshot's, a
/// release's, a look-up's) raise their slot's accepted positions: every run's proof counts it.
pub const UNPOSITIONED_GENERATION: i64 = -1;

/// What a batch is proven new with: the relay generation all of its receipts share and the
/// lowest of their stream positions, when every one has a position; `None` otherwise (a
/// receipt from a snapshot, a release or a look-up, or receipts of two runs: nothing to prove
/// the batch new with). The batch is new when that position is past every *other* run's
/// ([`proved_new`]; the ledger's gate statement compares the two under the slot's lock). A run
/// is not proven against its own positions: it accepts its receipts in the order the broker
/// answers, not the stream's, so its own positions are no prefix of what it read.
pub fn batch_floor(receipts: &[&crate::records::ReceiptRecord]) -> Option<(i64, StreamPosition)> {
    let g = receipts.first()?.relay_generation;
    let mut floor: Option<StreamPosition> = None;
    for r in receipts {
        let p = r.position().filter(|_| r.relay_generation == g)?;
        floor = Some(floor.map_or(p, |f| f.min(p)));
    }
    Some((g, floor?))
}

/// What an acceptance of `receipts` raises (`outbox.accepted_positions`, migration 0034): per
/// relay generation, the highest position among its positioned receipts; under
/// [`UNPOSITIONED_GENERATION`], the highest bound of the others (the end of a receipt's
/// transaction when it knows only its commit LSN), `None` meaning the WAL's insert position
/// now (a receipt that knows nothing of its row's position). A bound too high only sends more
/// batches to be classified; one too low could prove a replay new.
pub fn raises(receipts: &[&crate::records::ReceiptRecord]) -> Vec<(i64, Option<StreamPosition>)> {
    let mut out: Vec<(i64, Option<StreamPosition>)> = Vec::new();
    for r in receipts {
        let (g, p) = match (r.position(), r.position_bound()) {
            (Some(p), _) => (r.relay_generation, Some(p)),
            (None, b) => (UNPOSITIONED_GENERATION, b),
        };
        match out.iter_mut().find(|(k, _)| *k == g) {
            // `None` (the WAL's insert position) is above every position.
            Some((_, at)) => {
                *at = match (*at, p) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                }
            }
            None => out.push((g, p)),
        }
    }
    out
}

rule_with_mutant! {
    /// The freshness rule, with the simulator's product mutant: `COMMIT_ONLY` compares only the
    /// commit LSN, and counts a receipt of the last accepted transaction as new (the
    /// simulator's `fresh-by-commit`, counted by `fresh_proofs_wrong`): a transaction split
    /// over two acceptance batches, read again after a restart, would pass. The ledger uses
    /// [`FreshnessRule::default`] (`false`) in every build.
    pub struct FreshnessRule<const COMMIT_ONLY>;
    /// The simulator's mutant `fresh-by-commit`.
    pub fn commit_only;
}

impl<const COMMIT_ONLY: bool> FreshnessRule<COMMIT_ONLY> {
    /// See [`proved_new`].
    pub fn proved_new(
        &self,
        accepted_through: Option<StreamPosition>,
        positions: impl IntoIterator<Item = Option<StreamPosition>>,
    ) -> bool {
        let mut any = false;
        for p in positions {
            let Some(p) = p else { return false };
            any = true;
            let new = match accepted_through {
                None => true,
                Some(h) if COMMIT_ONLY => p.commit_lsn >= h.commit_lsn,
                Some(h) => p > h,
            };
            if !new {
                return false;
            }
        }
        any
    }
}

/// Why a broker's success report does not prove a stored copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotProof {
    /// No partition (Kafka: -1, the message was never assigned one).
    NoPartition { partition: i32 },
    /// No offset / stream sequence (Kafka: -1001 `RD_KAFKA_OFFSET_INVALID`, the implicit ack
    /// of a failed batch; JetStream: sequence 0).
    NoOffset { offset: i64 },
    /// The report names another topic, subject or stream than the one the event was sent to.
    OtherContainer { sent: String, reported: String },
}

impl fmt::Display for NotProof {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotProof::NoPartition { partition } => write!(
                f,
                "the success report names no partition ({partition}): no position to prove"
            ),
            NotProof::NoOffset { offset } => write!(
                f,
                "the success report carries no offset ({offset}): the client acknowledged a message \
                 the broker may never have stored (librdkafka's implicit ack of a failed batch)"
            ),
            NotProof::OtherContainer { sent, reported } => write!(
                f,
                "the success report is for {reported:?}, but the event was sent to {sent:?}"
            ),
        }
    }
}

/// Whether a broker's success report for a message sent to `sent` proves that the broker holds
/// it at (`reported`, `partition`, `offset`). Only a proof becomes a receipt; anything else is
/// DISPATCH_UNKNOWN, never "published". `partition` is 0 where the broker has none (JetStream).
pub fn position_proof(
    sent: &str,
    reported: &str,
    partition: i32,
    offset: i64,
) -> Result<(), NotProof> {
    if reported != sent {
        return Err(NotProof::OtherContainer {
            sent: sent.to_string(),
            reported: reported.to_string(),
        });
    }
    if partition < 0 {
        return Err(NotProof::NoPartition { partition });
    }
    if offset < 0 {
        return Err(NotProof::NoOffset { offset });
    }
    Ok(())
}

/// The envelope to send for a row read from the WAL (or a snapshot) whose event was migrated:
/// the latest migration's envelope generation and destination replace the ones frozen at
/// enqueue. The WAL keeps the original row forever, so a replay after a migration must not
/// send it to the pre-migration destination (that would be a cross-destination retry).
pub fn apply_migration(
    ev: &mut crate::OutboxEvent,
    envelope_generation: i32,
    destination: crate::Destination,
    destination_digest: String,
) {
    if envelope_generation > ev.envelope_generation {
        ev.envelope_generation = envelope_generation;
        ev.destination = destination;
        // Stored by the migration, not computed here: `verify` checks it.
        ev.destination_digest = destination_digest;
        ev.digests_checked = false;
    }
}

/// What a scan of the frozen partition for the event id showed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// The event id is at this offset.
    Found { offset: i64 },
    /// The whole range was read and the event id is not in it.
    Absent,
    /// The partition could not be read (broker down, leader unknown, timeout).
    Unavailable,
}

/// How an UNKNOWN attempt ends (or does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownResolution {
    /// The broker has it: accept `offset` as the receipt of the attempt that sent it
    /// (`attempt_generation`), and do not send the event again.
    Found {
        offset: i64,
        attempt_generation: i32,
    },
    /// Proven absent: the next send is `attempt_generation`, to the same frozen destination.
    Retry { attempt_generation: i32 },
    /// Not proven either way: stays DISPATCH_UNKNOWN (the checkpoint cannot pass the event).
    StillUnknown,
}

/// The UNKNOWN resolution rule.
///
/// * `attempt_generation` — of the UNKNOWN attempt; `last_generation` — the highest recorded
///   for the event (a retry is always newer than every attempt so far).
/// * `settled` — the producer session that sent the attempt is closed and the settle time (at
///   least the longest round trip a request can still be in flight) has passed. Before that an
///   absence proves nothing: the request may still be appended.
pub fn resolve_unknown(
    attempt_generation: i32,
    last_generation: i32,
    settled: bool,
    scan: Scan,
) -> UnknownResolution {
    match scan {
        // A copy found is proof whenever it is found.
        Scan::Found { offset } => UnknownResolution::Found {
            offset,
            attempt_generation,
        },
        Scan::Absent if settled => UnknownResolution::Retry {
            attempt_generation: last_generation.max(attempt_generation) + 1,
        },
        Scan::Absent | Scan::Unavailable => UnknownResolution::StillUnknown,
    }
}

/// Reason codes of quarantines decided before anything was sent to the broker.
pub const PRE_SEND_CODES: &[&str] = &[
    "destination_not_served",
    "payload_digest_mismatch",
    "destination_digest_mismatch",
    "unsupported_envelope_generation",
    "empty_field",
];

/// The ledger's facts about an event an operator wants to move to another destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationFacts<'a> {
    /// It has a primary receipt.
    pub published: bool,
    /// An attempt of it is DISPATCH_UNKNOWN.
    pub unknown_open: bool,
    /// Reason code of its open quarantine record.
    pub quarantine_code: Option<&'a str>,
    /// Dispatch attempts ever recorded for it.
    pub attempts: i64,
    /// It was migrated before (envelope generation > 1): it may have been sent to its current
    /// destination since, so neither "quarantined before sending" nor "rejected" (possibly a
    /// stale record about the previous destination) proves anything any more.
    pub migrated: bool,
    /// Its transaction is not yet behind the ledger checkpoint: a relay may still replay the
    /// WAL row (with the old destination) or have it queued.
    pub replayable: bool,
}

/// The proof recorded in the migration receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrationProof {
    /// Quarantined before anything was sent.
    NeverSent,
    /// The old target rejected it permanently.
    RejectedByOldTarget,
    /// A scan of the whole old topic did not find it.
    AbsentFromOldTarget,
}

/// Why a migration is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrationRefusal {
    /// Already published: a second destination is a delivery set, not a migration.
    Published,
    /// The old target's outcome is DISPATCH_UNKNOWN: reconcile first.
    Unknown,
    /// The old target has it: it is published there.
    FoundAtOldTarget,
    /// The old target cannot be read, so its absence cannot be proven.
    OldTargetUnavailable,
    /// The relay has not passed the event's transaction yet: it could still send the WAL row
    /// to the old destination. Retry once the checkpoint has passed it.
    Replayable,
}

impl fmt::Display for MigrationRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MigrationRefusal::Published => {
                "already published; a second destination is a delivery set, not a migration"
            }
            MigrationRefusal::Unknown => {
                "its outcome at the old target is DISPATCH_UNKNOWN; run the relay so it reconciles the attempt first"
            }
            MigrationRefusal::FoundAtOldTarget => {
                "the old target has it: it is published there; let the relay record that receipt"
            }
            MigrationRefusal::OldTargetUnavailable => {
                "the old target cannot be queried, so its absence there cannot be proven"
            }
            MigrationRefusal::Replayable => {
                "the relay's checkpoint has not passed the event's transaction yet, so a replay could still send it to the old destination; retry in a moment"
            }
        })
    }
}

/// First half of the migration rule: refusals and the proofs that need no scan.
/// `Ok(None)` means "scan the whole old topic, then call [`migration_after_scan`]".
pub fn migration_precheck(
    f: MigrationFacts<'_>,
) -> Result<Option<MigrationProof>, MigrationRefusal> {
    if f.published {
        return Err(MigrationRefusal::Published);
    }
    if f.unknown_open {
        return Err(MigrationRefusal::Unknown);
    }
    if f.replayable {
        return Err(MigrationRefusal::Replayable);
    }
    if f.migrated {
        // A refusal on record may be a stale one (decided for the previous generation by a
        // relay that paused); only a scan of the current destination proves absence there.
        return Ok(None);
    }
    match f.quarantine_code {
        Some(code) if PRE_SEND_CODES.contains(&code) && f.attempts == 0 => {
            Ok(Some(MigrationProof::NeverSent))
        }
        Some("broker_rejected") => Ok(Some(MigrationProof::RejectedByOldTarget)),
        _ => Ok(None),
    }
}

/// Second half: the scan of every partition of the old topic.
pub fn migration_after_scan(scan: Scan) -> Result<MigrationProof, MigrationRefusal> {
    match scan {
        Scan::Absent => Ok(MigrationProof::AbsentFromOldTarget),
        Scan::Found { .. } => Err(MigrationRefusal::FoundAtOldTarget),
        Scan::Unavailable => Err(MigrationRefusal::OldTargetUnavailable),
    }
}

/// What retention knows about one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeFacts {
    /// It has a primary receipt.
    pub published: bool,
    /// Its transaction is not behind both the ledger checkpoint and the slot's confirmed LSN:
    /// a restart would stream it again.
    pub replayable: bool,
    /// An attempt of it is DISPATCH_UNKNOWN.
    pub unknown_open: bool,
    /// Time since it was last handed to the broker, and the replay window (which must exceed
    /// the longest a request can still be appended after it was sent).
    pub since_last_send_ms: u64,
    pub replay_window_ms: u64,
    /// Every mandatory consumer's watermark is past every copy of it on the broker.
    pub consumed_by_all: bool,
}

/// Why an event may not be purged yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PurgeBlock {
    Unpublished,
    Replayable,
    Unknown,
    WithinReplayWindow,
    NotConsumed,
}

/// The retention rule (DESIGN invariant 9): the row, its receipts and the consumers' inbox rows
/// go only when nothing can bring the event back — no replay from the slot, no append still on
/// the wire, no consumer still to read a copy. Purge keeps a tombstone (event id, digests,
/// publish slot) so a late ACK after it is still recognised as a duplicate.
///
/// The ledger's purge statement (`outbox-ledger`'s `retention`) is this rule in SQL; it is
/// [`PurgeRule::default`]'s.
pub fn may_purge(f: PurgeFacts) -> Result<(), PurgeBlock> {
    PurgeRule::default().may_purge(f)
}

rule_with_mutant! {
    /// The retention rule, with the simulator's product mutant: `IGNORE_READERS` purges without
    /// waiting for the replay window or the consumers' watermarks (the simulator's `purge-early`,
    /// counted by `purged_early`). Retention uses [`PurgeRule::default`] (`false`) in every build.
    pub struct PurgeRule<const IGNORE_READERS>;
    /// The simulator's mutant `purge-early`.
    pub fn ignoring_readers;
}

impl<const IGNORE_READERS: bool> PurgeRule<IGNORE_READERS> {
    /// See [`may_purge`].
    pub fn may_purge(&self, f: PurgeFacts) -> Result<(), PurgeBlock> {
        if !f.published {
            return Err(PurgeBlock::Unpublished);
        }
        if f.replayable {
            return Err(PurgeBlock::Replayable);
        }
        if f.unknown_open {
            return Err(PurgeBlock::Unknown);
        }
        if f.since_last_send_ms < f.replay_window_ms && !IGNORE_READERS {
            return Err(PurgeBlock::WithinReplayWindow);
        }
        if !f.consumed_by_all && !IGNORE_READERS {
            return Err(PurgeBlock::NotConsumed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acceptance_raises_each_runs_position_and_bounds_the_unpositioned() {
        use crate::records::ReceiptRecord;
        use crate::Lsn;
        let r = |g: i64, commit: Option<u64>, change: Option<u64>| ReceiptRecord {
            event_id: uuid::Uuid::nil(),
            aggregate_version: 1,
            payload_digest: String::new(),
            destination_digest: String::new(),
            broker_kind: "kafka".into(),
            broker_cluster: "c".into(),
            topic: "t".into(),
            partition: 0,
            offset: 0,
            timestamp_ms: None,
            attempt: 1,
            relay_generation: g,
            commit_lsn: commit.map(Lsn),
            change_lsn: change.map(Lsn),
            evidence: None,
        };
        let at = |c: u64, l: u64| StreamPosition {
            commit_lsn: Lsn(c),
            change_lsn: Lsn(l),
        };
        let (a, b, c) = (
            r(3, Some(200), Some(150)),
            r(3, Some(100), Some(190)),
            r(2, Some(300), Some(10)),
        );
        assert_eq!(batch_floor(&[&a, &b]), Some((3, at(100, 190))));
        assert_eq!(batch_floor(&[&a, &c]), None, "two runs");
        assert_eq!(batch_floor(&[]), None);
        assert_eq!(
            raises(&[&a, &b, &c]),
            vec![(3, Some(at(200, 150))), (2, Some(at(300, 10)))]
        );
        // A release's receipt (commit LSN only) bounds its whole transaction; one that knows
        // nothing is bounded by the WAL's insert position (None), above everything.
        let release = r(3, Some(400), None);
        assert_eq!(batch_floor(&[&a, &release]), None);
        assert_eq!(
            raises(&[&release]),
            vec![(UNPOSITIONED_GENERATION, Some(at(400, u64::MAX)))]
        );
        let lookup = r(3, None, None);
        assert_eq!(
            raises(&[&release, &lookup, &a]),
            vec![(UNPOSITIONED_GENERATION, None), (3, Some(at(200, 150)))]
        );
    }

    #[test]
    fn a_batch_is_proven_new_only_past_the_slots_last_accepted_position() {
        let at = |c: u64, l: u64| {
            Some(StreamPosition {
                commit_lsn: crate::Lsn(c),
                change_lsn: crate::Lsn(l),
            })
        };
        let h = at(200, 150);
        // Nothing accepted with a position yet: any positioned batch is new.
        assert!(proved_new(None, [at(100, 10), at(200, 5)]));
        // Past H: a later transaction, or a later change of H's own transaction.
        assert!(proved_new(h, [at(300, 10), at(200, 160)]));
        // At or below H: a replay, or the part of H's transaction already accepted.
        assert!(!proved_new(h, [at(300, 10), at(200, 150)]));
        assert!(!proved_new(h, [at(200, 140)]));
        assert!(!proved_new(h, [at(100, 190)]));
        // A receipt without a position (snapshot, release, look-up) proves nothing.
        assert!(!proved_new(None, [at(300, 10), None]));
        assert!(!proved_new(None, std::iter::empty()));
        // The mutant reads H's transaction as new when it is not.
        assert!(FreshnessRule::commit_only().proved_new(h, [at(200, 140)]));
        assert!(!FreshnessRule::commit_only().proved_new(h, [at(100, 190)]));
    }

    #[test]
    fn a_success_report_is_proof_only_with_a_position_in_the_container_sent_to() {
        assert_eq!(position_proof("t", "t", 0, 0), Ok(()));
        assert_eq!(position_proof("t", "t", 2, 41), Ok(()));
        // librdkafka's implicit ack: success, offset RD_KAFKA_OFFSET_INVALID.
        assert_eq!(
            position_proof("t", "t", 0, -1001),
            Err(NotProof::NoOffset { offset: -1001 })
        );
        assert_eq!(
            position_proof("t", "t", -1, 5),
            Err(NotProof::NoPartition { partition: -1 })
        );
        let other = position_proof("t", "u", 0, 5).unwrap_err();
        assert!(other.to_string().contains("\"u\""), "{other}");
        assert!(position_proof("t", "t", 0, -1001)
            .unwrap_err()
            .to_string()
            .contains("implicit ack"));
    }

    const A: Digests<'static> = Digests {
        payload: "sha256:p",
        destination: "sha256:d",
    };

    #[test]
    fn one_publish_slot_and_a_stale_destination_is_never_accepted() {
        assert_eq!(classify(None, false, A), ReceiptClass::Primary);
        assert_eq!(classify(None, true, A), ReceiptClass::Duplicate);
        let other = Digests {
            payload: "sha256:p",
            destination: "sha256:elsewhere",
        };
        // No migration: the relay's digests of the row it read are the row's by construction.
        assert_eq!(classify(None, false, other), ReceiptClass::Primary);
        // A destination migration's digest is compared: a receipt for the old destination is
        // a conflict, whether or not the slot is filled.
        let migrated = Some("sha256:d");
        assert_eq!(classify(migrated, false, A), ReceiptClass::Primary);
        assert_eq!(classify(migrated, true, A), ReceiptClass::Duplicate);
        for has_primary in [false, true] {
            assert_eq!(
                classify(migrated, has_primary, other),
                ReceiptClass::Conflict(Conflict::DigestMismatch)
            );
        }
        assert_eq!(
            Conflict::DigestMismatch.reason_code(),
            "receipt_digest_mismatch"
        );
    }

    #[test]
    fn unknown_is_resolved_only_by_proof() {
        assert_eq!(
            resolve_unknown(1, 1, false, Scan::Found { offset: 7 }),
            UnknownResolution::Found {
                offset: 7,
                attempt_generation: 1
            }
        );
        assert_eq!(
            resolve_unknown(1, 1, false, Scan::Absent),
            UnknownResolution::StillUnknown,
            "an absence before the settle time proves nothing"
        );
        assert_eq!(
            resolve_unknown(1, 3, true, Scan::Absent),
            UnknownResolution::Retry {
                attempt_generation: 4
            }
        );
        assert_eq!(
            resolve_unknown(2, 2, true, Scan::Unavailable),
            UnknownResolution::StillUnknown
        );
    }

    #[test]
    fn purge_waits_for_every_way_back() {
        let ok = PurgeFacts {
            published: true,
            replayable: false,
            unknown_open: false,
            since_last_send_ms: 10_000,
            replay_window_ms: 10_000,
            consumed_by_all: true,
        };
        assert_eq!(may_purge(ok), Ok(()));
        for (f, block) in [
            (
                PurgeFacts {
                    published: false,
                    ..ok
                },
                PurgeBlock::Unpublished,
            ),
            (
                PurgeFacts {
                    replayable: true,
                    ..ok
                },
                PurgeBlock::Replayable,
            ),
            (
                PurgeFacts {
                    unknown_open: true,
                    ..ok
                },
                PurgeBlock::Unknown,
            ),
            (
                PurgeFacts {
                    since_last_send_ms: 9_999,
                    ..ok
                },
                PurgeBlock::WithinReplayWindow,
            ),
            (
                PurgeFacts {
                    consumed_by_all: false,
                    ..ok
                },
                PurgeBlock::NotConsumed,
            ),
        ] {
            assert_eq!(may_purge(f), Err(block));
            // The simulator's `purge-early` waits for neither the replay window nor the
            // consumers, and for everything else.
            let early = PurgeRule::ignoring_readers().may_purge(f);
            match block {
                PurgeBlock::WithinReplayWindow | PurgeBlock::NotConsumed => {
                    assert_eq!(early, Ok(()))
                }
                _ => assert_eq!(early, Err(block)),
            }
        }
    }

    #[test]
    fn the_last_ack_wins_mutant_lets_a_duplicate_take_the_slot() {
        let rule = AcceptanceRule::last_ack_wins();
        assert_eq!(rule.classify(None, true, A), ReceiptClass::Primary);
        assert_eq!(classify(None, true, A), ReceiptClass::Duplicate);
        // A stale destination is a conflict under both.
        assert_eq!(
            rule.classify(Some("sha256:other"), true, A),
            ReceiptClass::Conflict(Conflict::DigestMismatch)
        );
    }

    #[test]
    fn migration_needs_proof_and_waits_for_unknown() {
        let base = MigrationFacts {
            published: false,
            unknown_open: false,
            quarantine_code: Some("destination_not_served"),
            attempts: 0,
            migrated: false,
            replayable: false,
        };
        assert_eq!(
            migration_precheck(base),
            Ok(Some(MigrationProof::NeverSent))
        );
        assert_eq!(
            migration_precheck(MigrationFacts {
                published: true,
                ..base
            }),
            Err(MigrationRefusal::Published)
        );
        assert_eq!(
            migration_precheck(MigrationFacts {
                unknown_open: true,
                ..base
            }),
            Err(MigrationRefusal::Unknown)
        );
        assert_eq!(
            migration_precheck(MigrationFacts {
                replayable: true,
                ..base
            }),
            Err(MigrationRefusal::Replayable)
        );
        assert_eq!(
            migration_precheck(MigrationFacts {
                migrated: true,
                ..base
            }),
            Ok(None),
            "released after an earlier migration: it may have been sent since"
        );
        assert_eq!(
            migration_precheck(MigrationFacts {
                attempts: 1,
                ..base
            }),
            Ok(None),
            "sent before: only a scan proves the old target lacks it"
        );
        assert_eq!(
            migration_precheck(MigrationFacts {
                quarantine_code: Some("broker_rejected"),
                attempts: 1,
                ..base
            }),
            Ok(Some(MigrationProof::RejectedByOldTarget))
        );
        assert_eq!(
            migration_after_scan(Scan::Unavailable),
            Err(MigrationRefusal::OldTargetUnavailable)
        );
        assert_eq!(
            migration_after_scan(Scan::Found { offset: 0 }),
            Err(MigrationRefusal::FoundAtOldTarget)
        );
        assert_eq!(
            migration_after_scan(Scan::Absent),
            Ok(MigrationProof::AbsentFromOldTarget)
        );
    }
}
