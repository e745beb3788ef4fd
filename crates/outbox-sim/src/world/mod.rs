//! One simulated world: producers, PostgreSQL (outbox rows, WAL, slot, ledger tables), relay
//! incarnations, a broker with two clusters, consumers with an inbox, an operator — and the
//! invariant counters computed at the end of the trace from the world's ground truth.
//!
//! Each relay incarnation runs the product's relay core, `outbox_relay::PipelineCore`
//! (transaction framing, admit → route check → gate → send → delivery report → batch and its
//! checkpoint, the standby status, releases, UNKNOWN resolution) and executes its commands
//! against the simulated broker and ledger, as the daemon's driver (`outboxd/src/relay`) does
//! against the real ones. The start plan is `outbox_source::slot::plan`, receipt classes and
//! retention are `outbox_core::receipt`, consumers are `outbox_inbox::gap::ConsumerModel`.
//!
//! By role: this module holds the world, its clock, producers, relay incarnations (the
//! driver's side of the core) and the operator; [`broker`] the simulated broker; [`ledger`] the
//! model of the ledger's SQL; [`consumer`] the consumers; [`judge`] the invariant counters.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use outbox_core::delivery::{Delivery, DeliveryOutcome, FailureClass, Persistence, Served};
use outbox_core::lease::{self, LeaseFacts, Take, TakeoverRule};
use outbox_core::receipt::{self, Digests, ReceiptClass, Scan, StreamPosition};
use outbox_core::records::{LedgerItem, OfferFacts, OfferRule, QuarantineState, ReceiptRecord};
use outbox_core::{Destination, Lsn, OutboxEvent};
use outbox_inbox::gap::{ConsumerModel, GapPolicy};
use outbox_relay::lifecycle::{
    CdcStart, CdcStep, EndStep, Ending, LeaseKeeper, Renewal, RunEnd, RunStart, StartStep,
};
use outbox_relay::pace::{Drain, Pace};
use outbox_relay::poll::{PollRun, RoundStep};
use outbox_relay::read::{Chunks, Read, ReadAdmitted};
use outbox_relay::release::{PollStep, ReleasePoll, Released};
use outbox_relay::schedule::{Bounds, Load, Schedule, Settings, TurnStep, Waiting};
use outbox_relay::stage::{Stage, Staged};
use outbox_relay::unknown::{self, Reconcile, Resolved, When};
use outbox_relay::{
    AcceptanceEnd, Command, LookupFor, LookupOutcome, Now, OpenAttempt, ParkedInput, ParkedLookup,
    ParkedStep, PipelineCore, Planted, Reported, UnclearStep,
};
use outbox_source::slot::{self, LedgerView, SlotInfo, StartPlan};
use uuid::Uuid;

use crate::rng::SplitMix64;

/// A deliberately broken variant, to prove the simulator can see each class of bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutant {
    /// Confirms the LSN to the slot when the broker ACKs, before the receipt is accepted.
    ConfirmBeforeAccept,
    /// The consumer applies effects without looking at its inbox or the aggregate watermark.
    /// A product mutant in `outbox_inbox::gap::InboxRule` (`forgetting_applied`), the rule
    /// the consumer's store runs.
    SkipDedup,
    /// A retry re-resolves the route policy instead of using the frozen destination.
    RetryReresolvesRoute,
    /// The decode renders a narrow row's destination from the route version in force now
    /// instead of the one the row names (migration 0031).
    RenderCurrentRoute,
    /// The run knows only the route versions it read at start, not those the stream brings
    /// (`outbox.route_versions` left out of the publication).
    VersionsOnlyAtStart,
    /// Reconciliation scans without waiting for the settle time (UNKNOWN racing the retry).
    /// A product mutant in `outbox_relay::PipelineCore` (`IgnoresSettle`).
    NoSettle,
    /// A late ACK replaces the primary receipt ("last ACK wins"). A product mutant in
    /// `outbox_core::receipt::AcceptanceRule` (`last_ack_wins`), the rule the ledger's
    /// acceptance statement runs.
    LastAckWins,
    /// Destination migration does not wait for an UNKNOWN attempt to be reconciled.
    MigrateWhileUnknown,
    /// Purge ignores the consumers' watermarks and the replay window. A product mutant in
    /// `outbox_core::receipt::PurgeRule` (`ignoring_readers`), the retention rule.
    PurgeEarly,
    /// A producer retry after a lost commit ACK enqueues the event again (a second id).
    ProducerNewId,
    /// Product bug found by the simulator (seed 1, trace 143): the route check poisons an
    /// event while an earlier event of its aggregate is in flight; when that one is rejected
    /// too, the hold names only the later one and the earlier is never republished.
    BugPoisonBeforeGate,
    /// Product bug found by the simulator (seed 1, trace 44): an UNKNOWN attempt a zombie
    /// recorded after its successor started stays open until the next relay start. A product
    /// mutant in `outbox_relay::PipelineCore::reconcile` (`UnknownOnlyAtStart`).
    BugUnknownOnlyAtStart,
    /// Product bug found by the simulator (seed 1, trace 195): a zombie's salvaged batch
    /// quarantines and holds an event that a migration published meanwhile (a stale refusal
    /// blocks the aggregate). A product mutant in `outbox_core::records::RefusalFilter`, the
    /// rule the ledger's acceptance transaction applies.
    BugStaleQuarantine,
    /// Product bug found by the simulator (seed 1, trace 189388): a paused relay's salvaged
    /// batch recorded a quarantine decided for an event's old envelope generation (its
    /// destination before a migration) while the live relay sent the migrated event; the stale
    /// quarantine let a second migration prove absence by a scan that ran while the live
    /// relay's copy was still on its way: a copy at a destination the event no longer has.
    /// Fix: `RefusalFilter` drops refusals decided for a replaced generation.
    BugSupersededRefusal,
    /// Product bug found by the simulator (seed 1, traces 114, 60 and 3522): a migration
    /// recorded while the event's WAL row was still ahead of the ledger checkpoint. A replay
    /// (after a crash, or by a run that had it queued) decodes the row as frozen at enqueue and
    /// sends it to the pre-migration destination (a cross-destination retry), or quarantines
    /// and holds it again although the migration published it.
    BugMigrateReplayable,
    /// Two events of one aggregate in flight (the ordering gate bypassed): a product mutant
    /// in `outbox_relay::PipelineCore`.
    SecondInFlight,
    /// A deeper gate (more than one event of an aggregate in flight) over a producer whose
    /// outcomes are independent per message, as every producer's are without
    /// `enable.gapless.guarantee` and an infinite `message.timeout.ms`: what the deeper gate
    /// must never be configured for (docs/ordering.md, "Hot aggregates").
    DeepWithoutGapless,
    /// The executor tells the core a send was handed over before the producer took it, so a
    /// send the producer refused can be overtaken by the next version.
    DeepBeforeHandOver,
    /// A deeper gate's producer places keys by the partition count it sees now, as
    /// librdkafka's partitioner does, not by the pinned one: a product mutant in
    /// `outbox_core::placement::Placement` (`unpinned`).
    DeepUnpinned,
    /// A success report without a position (an implicit ack) becomes a receipt: a product
    /// mutant in `outbox_relay::PipelineCore`.
    OkWithoutOffsetIsProof,
    /// Product bugs found by the simulator (seed 1, trace 1380) once it lost slots and
    /// recreated them with `--resnapshot`: the gate's aggregate heads were loaded before
    /// start-up reconciliation accepted the receipt of an event it found, so the snapshot
    /// (which skips published rows) saw a version gap where the found event was; and that
    /// gap hold left the event queued behind the in-flight one in the gate, where nothing sent
    /// it: the snapshot would wait for it forever, and the checkpoint passed it.
    BugSnapshotGap,
    /// Product bug found by the simulator (seed 2, trace 40186; seed 3, trace 25240):
    /// "quarantined before sending" or "rejected by the old target" was accepted as migration
    /// proof for an event that an earlier migration had released and the relay had sent since
    /// (a paused relay's stale refusal, decided for the previous destination, re-quarantined it).
    BugProofAfterMigration,
    /// Bug found by the simulator in poll mode's first design (seed 1, traces 0 and 870): the
    /// poll read events above each aggregate's head, but receipts can be accepted out of
    /// version order (a later version's UNKNOWN attempt found and accepted while the earlier
    /// version's ACK was lost with its run), so the earlier one was never sent again and never
    /// got a receipt. Fixed by the poll positions of migration 0015.
    PollAboveHead,
    /// Bug found by the simulator in poll mode's first design (seed 3, trace 7927): a
    /// destination migration was allowed for a quarantined event that the current poll round
    /// had read before the quarantine was recorded (by a paused relay's salvage) and still
    /// held queued; it was then sent to the old destination. Fixed by the round snapshots of
    /// migration 0015.
    PollMigrateHeld,
    /// Bug found by the simulator in poll mode's first design (seed 1, trace 17022): a round
    /// admitted an aggregate's first pending version while the gate still expected an earlier
    /// one, whose receipt a paused relay's salvage had accepted after this run loaded the
    /// heads; the gate took the skipped (published) version for a gap and held the aggregate,
    /// and the ledger dropped that hold as stale, so nothing ever released it. A product
    /// mutant since the round's decisions are the core's (`outbox_relay::poll`).
    PollStaleHead,
    /// Bug found by the simulator (seed 1, trace 608933, the first million traces with poll
    /// mode): purge deleted an event whose receipt a paused relay's salvage had accepted after
    /// the current poll round read the event; the round sent it again, and consumers read a copy
    /// of a purged event. Fixed by `outbox.poll_round_missed` in purge's rule (migration 0015).
    PollPurgeHeld,
    /// Bug found by the poll-mode end-to-end tests (the skip test of `tests/e2e/ordering.rs`):
    /// a poll round read an event the operator had skipped (its quarantine was closed, so
    /// the read no longer excluded it) and sent it again. Fixed by
    /// `outbox_source::snapshot::QUARANTINED_OR_SKIPPED` (and migration 0016's poll positions).
    /// A product mutant in `outbox_core::records::OfferRule` (`ignoring_skips`), the rule the
    /// reads' SQL runs.
    PollOffersSkipped,
    /// The early takeover of a lease without the proof that its holder is gone (its lease
    /// session's advisory lock is free and the slot has no walsender): a paused holder loses
    /// its lease before it expires, and resumed before its own deadline it still sends. A
    /// product mutant in `outbox_core::lease::TakeoverRule` (`without_proof`), the rule
    /// `lease::try_acquire`'s statement runs.
    EarlyTakeoverOfLiveHolder,
    /// A lease renewal's answer counts from when it was read, not from when the renewal was
    /// asked (a product mutant in `outbox_relay::lifecycle::LeaseKeeper::answered`,
    /// `LeaseFromAnswer`): a relay paused between the question and the answer resumes
    /// believing in a lease that expired meanwhile, and sends beside its successor
    /// (`stale_sends`).
    LeaseFromAnswer,
    /// A CDC run streams from the slot it holds without reading its position again (a
    /// product mutant in `outbox_relay::lifecycle::CdcStart::check_held`,
    /// `HeldSlotUnchecked`): a slot replaced between the plan and `START_REPLICATION`
    /// streams from its own, later position, and what was committed in between is never
    /// published (`lost`).
    HeldSlotUnchecked,
    /// The relay loop never writes an idle checkpoint (a product mutant in
    /// `outbox_relay::schedule::Schedule::due`, `IdleCheckpointNeverDue`): what the stream
    /// resolved without a batch is never written nor confirmed (`checkpoint_not_written`).
    IdleCheckpointNeverDue,
    /// Product bug found by the simulator (seed 1, trace 890786, the first million traces
    /// with the loop's timing by the product's schedule): a release started while an event of
    /// its aggregate was parked (its attempt open at start, parked by an earlier release that
    /// stopped there), sent it, and its look-up sent it again when it came due
    /// (`resent_after_proof`). Fixed in `outbox_relay::PipelineCore::may_release`
    /// (`ReleaseBesideParked` plants the old rule).
    BugReleaseBesideParked,
    /// Product bug found by the simulator once its operator skipped refused events (seed 1,
    /// trace 27): an event held behind another one, then released, refused and skipped kept
    /// its held record, so every later release of its aggregate sent it again (and the hold
    /// never closed). Fixed in `holds::republish_set` and `holds::close`.
    BugRepublishSkipped,
    /// A parked event never comes due (a product mutant in `outbox_relay::PipelineCore`,
    /// `pipeline/unclear.rs`): no look-up or resend resolves an unclear outcome, and its
    /// aggregate never progresses (`stalls`).
    UnclearNeverDue,
    /// The relay as it was before issue 25: an unclear delivery report (possibly persisted or
    /// not persisted) ends the run, and every aggregate waits for the restart
    /// (`unclear_restarts`). A product mutant in `outbox_relay::PipelineCore::on_report`
    /// (`EndsRunOnUnclear`).
    BugEndRunOnUnclear,
    /// What waits behind an unclear outcome counts against `max_in_flight` (a product mutant
    /// in `outbox_relay::PipelineCore::waiting_on_unclear`, `UnclearWaitCountsAsInFlight`):
    /// an aggregate whose events keep coming behind its unclear one stops the slot being read
    /// for every other (`reading_stopped_by_unclear`).
    BugUnclearWaitCountsAsInFlight,
    /// The relay's route check ignores the frozen cluster (a product mutant in
    /// `outbox_relay::PipelineCore::send_one`): an event frozen for cluster B reaches the
    /// served cluster's topic of the same name (`cross_destination_retries`).
    RouteIgnoresCluster,
    /// Product bug found by the simulator (seed 1, trace 26811) when heads became read when
    /// the relay first meets an aggregate (migration 0026): a copy found by reconciliation
    /// made its aggregate known to the gate at the found version, below the published head;
    /// the next version looked like a gap and was lost. A product mutant in
    /// `outbox_relay::PipelineCore::raise_known_heads`.
    BugFoundRaisesUnknownHead,
    /// Bug found by the simulator in the same change (seed 1, trace 19152): a poll round
    /// without the head read from the ledger below its own floor (the version before an
    /// aggregate's first pending one) took a version above a found copy for a gap.
    PollNoHeadFloor,
    /// Product mutant (`outbox_relay::fleet`): a member takes a shard only once no unexpired
    /// lease names a holder, so a SIGKILLed member's shards wait for expiry.
    FleetWaitsForExpiry,
    /// Product mutant: a fleet member's share rounded down (some shards are nobody's).
    FleetShareRoundsDown,
    /// Product mutant: a member over its share never hands a shard over.
    FleetNeverHandsOver,
    /// Product bug found by the fleet simulation (seed 1, trace 10; trace 2 since members take free shards from their own place among them): relays waiting for live
    /// members' leases filled the share, and a handed-over shard stayed unserved.
    BugFleetWaitingFillsShare,
    /// Product bug found by the fleet simulation (seed 1, trace 54): a member that joined under
    /// the floor got nothing while the others held the rounded-up share.
    BugFleetNoEvening,
    /// Product bug found by the simulator's `resent_after_proof` (seed 1, trace 27): an event
    /// reconciliation found on the broker while it waited in the gate behind its aggregate's
    /// unclear event was sent again when that one resolved (the found check ran only when an
    /// event was decoded). Under an HTTP endpoint, a key sent again after its clear answer.
    BugSendsFoundEvent,
    /// Product mutant (`outbox_relay::fleet::Member`): a member that aborts a shard relay whose
    /// stop hung keeps its lease, so no other member takes the shard until the lease expires
    /// (the member loop before 2026-12-03's fix; the simulator's bound then allowed for it).
    FleetAbortKeepsLease,
    /// Product mutant (`outbox_relay::PipelineCore::reconcile`): the running reconciliation
    /// looks up a published event's open attempt by sending the event again under its key
    /// instead of closing the attempt by the event's receipt (`resent_published`).
    ResendsAnsweredEvent,
    /// Product bug found by the simulator once reconciliation's look-ups answered at a later
    /// step, as the daemon's do on their own task (2026-12-04, seed 1, trace 1668; 526 now): a parked
    /// event whose attempt that look-up resolved meanwhile asked the ledger for an open
    /// attempt forever, and its aggregate stalled (`PipelineCore::resolved_meanwhile`).
    BugIgnoresResolvedMeanwhile,
    /// Ledger-model mutant (migration 0028's heads rule without `outbox.purged_events`): an
    /// aggregate whose predecessor was purged looks like a gap.
    HeadsWithoutPurged,
    /// Product bug found by the simulator once its poll rounds wait between rows as the
    /// daemon's do (2026-12-04, seed 1, trace 34; the CI failure of the e2e misbehaving-endpoint
    /// test in poll mode): an aggregate parked when a round began, resolved while the round
    /// went on, was sent again from the round's read (`resent_after_proof`). A product mutant
    /// in `outbox_relay::PipelineCore::begin_poll_round` (`RoundForgetsParked`).
    BugRoundForgetsParked,
    /// Product bug found by the simulator's `concurrent_lookups` (2026-12-04, seed 1, trace 4;
    /// the same CI failure): the running reconciliation looked up an attempt left open at
    /// start before the run reached its event, and the run then parked the event and looked
    /// it up too. A product mutant in `outbox_relay::PipelineCore::due_unclear`
    /// (`LookUpBesideReconciliation`).
    BugLookUpBesideReconciliation,
    /// The acceptance's freshness proof compares commit LSNs only (a receipt of the slot's
    /// last accepted transaction counts as new): a product mutant in
    /// `outbox_core::receipt::FreshnessRule` (`commit_only`), counted by `fresh_proofs_wrong`.
    FreshByCommit,
    /// The acceptance that moves the checkpoint keeps no numbering of the rows written
    /// without a version (`outbox.stream_versions` never written): a restart numbers them
    /// again from 0, so receipts and copies carry versions below their commit rank
    /// (`plain_version_wrong`). A product mutant in
    /// `outbox_relay::PipelineCore::numbered_through` (`NumberingNotKept`).
    NumberingNotKept,
    /// A release republishes held rows written without a version as SQL reads them, without
    /// the version their held records kept (before migration 0042): the core quarantines them
    /// as `unnumbered_row` and holds the aggregate again, which no release can end: the
    /// events behind them are never published (`lost`).
    BugReleaseReadsPlainRows,
    /// A run starts without folding the numbering log into the map it reads: a product
    /// mutant (`outbox_relay::Mutant::NumberingLogNotFolded`, `CdcStart` skips the fold): the
    /// numbering the last runs logged since the last fold is missed, and rows are numbered
    /// again from older versions (`plain_version_wrong`).
    BugNumberingLogNotFolded,
    /// A snapshot or poll round goes on after a send was refused because the lease was not
    /// certainly held, and waits for events queued behind it that nothing sends: a product
    /// mutant (`outbox_relay::Mutant::ReadIgnoresLease`, `outbox_relay::pace`; the product
    /// before seed 1, trace 15929 found it, once the simulator's reads paced as the daemon's
    /// do) (`read_stalls`).
    BugReadIgnoresLease,
    /// The stream sends an event the operator skipped when it meets it after its hold is gone
    /// (a run replaying from before it): a product mutant
    /// (`outbox_relay::Mutant::StreamSendsSkipped`, `PipelineCore::skipped_by_operator`; the
    /// product before seed 1, trace 53667 found it, once the simulator's reads were held back
    /// as the daemon's are) (`skipped_offered`).
    BugStreamSendsSkipped,
    /// A poll round reads before what was sent since the last round is reported and its
    /// receipt accepted: a product mutant (`outbox_relay::Mutant::RoundReadsBeforeDrain`,
    /// `PollRun` skips `RoundStep::DrainBefore`; in the traces that run the product's poll
    /// loop): an answered event whose receipt is still in the batch is read as pending and
    /// sent again.
    RoundReadsBeforeDrain,
    /// A run seeds the numbering of an aggregate it meets first at a row without a version from
    /// what the checkpoint kept only, not from the versions its rows were written with: an
    /// aggregate written through `outbox.enqueue` before its outbox took plain INSERTs
    /// (migration 0043) is numbered from 1 again (`plain_version_wrong`). A model mutant of
    /// `outbox_ledger::numbering::versions_of`'s SQL.
    NumberingWithoutWrittenVersions,
    /// Product mutant (`outbox_relay::txn`): the start of an exactly-once run accepts none of
    /// the batches the broker recorded (`txn_seen_twice`).
    TxnIgnoresRecords,
    /// Product mutant: an unknown commit outcome is taken for aborted (`txn_seen_twice`).
    TxnUnknownIsAborted,
    /// Product mutant: a batch's checkpoint passes events it does not hold (`txn_lost`).
    TxnThroughPastBatch,
    /// Product mutant: an aborted transaction's events are accepted (`txn_receipt_mismatch`).
    TxnAcceptsAborted,
    /// Product mutant: an event read again with its receipt accepted is sent again
    /// (`txn_seen_twice`).
    TxnReplaysAccepted,
    /// Product mutant: the start skips the first batch the broker recorded after the
    /// ledger's last (`txn_unaccepted`).
    TxnSkipsFirstRecord,
    /// Product mutant: an aborted transaction's events are queued behind later ones
    /// (`txn_order_violations`).
    TxnRequeuesAtBack,
    /// Product mutant: every event of a stream transaction read again after a crash is taken
    /// for accepted by its commit position alone (`txn_lost`).
    TxnReplayedIsAccepted,
    /// Product mutant: what queued during a transaction is not flushed when the broker
    /// answers; a batch filled meanwhile waits for ever (`txn_lost`).
    TxnAnswerLeavesQueue,
    /// Product mutant: an exactly-once stop gives the lease back without waiting for its
    /// transaction (`txn_stops_left_open`).
    TxnStopWithoutWaiting,
}

impl Mutant {
    pub const ALL: &'static [(&'static str, Mutant)] = &[
        ("confirm-before-accept", Mutant::ConfirmBeforeAccept),
        ("skip-dedup", Mutant::SkipDedup),
        ("retry-reresolves-route", Mutant::RetryReresolvesRoute),
        ("render-current-route", Mutant::RenderCurrentRoute),
        ("versions-only-at-start", Mutant::VersionsOnlyAtStart),
        ("no-settle", Mutant::NoSettle),
        ("last-ack-wins", Mutant::LastAckWins),
        ("migrate-while-unknown", Mutant::MigrateWhileUnknown),
        ("purge-early", Mutant::PurgeEarly),
        ("producer-new-id", Mutant::ProducerNewId),
        ("second-in-flight", Mutant::SecondInFlight),
        ("deep-without-gapless", Mutant::DeepWithoutGapless),
        ("deep-before-hand-over", Mutant::DeepBeforeHandOver),
        ("deep-unpinned", Mutant::DeepUnpinned),
        ("ok-without-offset-is-proof", Mutant::OkWithoutOffsetIsProof),
        ("bug-poison-before-gate", Mutant::BugPoisonBeforeGate),
        ("bug-unknown-only-at-start", Mutant::BugUnknownOnlyAtStart),
        ("bug-stale-quarantine", Mutant::BugStaleQuarantine),
        ("bug-superseded-refusal", Mutant::BugSupersededRefusal),
        ("bug-migrate-replayable", Mutant::BugMigrateReplayable),
        ("bug-proof-after-migration", Mutant::BugProofAfterMigration),
        ("bug-snapshot-gap", Mutant::BugSnapshotGap),
        ("poll-above-head", Mutant::PollAboveHead),
        ("poll-migrate-held", Mutant::PollMigrateHeld),
        ("poll-stale-head", Mutant::PollStaleHead),
        ("poll-purge-held", Mutant::PollPurgeHeld),
        ("poll-offers-skipped", Mutant::PollOffersSkipped),
        (
            "early-takeover-of-live-holder",
            Mutant::EarlyTakeoverOfLiveHolder,
        ),
        ("lease-from-answer", Mutant::LeaseFromAnswer),
        ("idle-checkpoint-never-due", Mutant::IdleCheckpointNeverDue),
        ("held-slot-unchecked", Mutant::HeldSlotUnchecked),
        ("bug-release-beside-parked", Mutant::BugReleaseBesideParked),
        ("bug-republish-skipped", Mutant::BugRepublishSkipped),
        ("unclear-never-due", Mutant::UnclearNeverDue),
        ("bug-end-run-on-unclear", Mutant::BugEndRunOnUnclear),
        (
            "bug-unclear-wait-counts-as-in-flight",
            Mutant::BugUnclearWaitCountsAsInFlight,
        ),
        ("route-ignores-cluster", Mutant::RouteIgnoresCluster),
        (
            "bug-found-raises-unknown-head",
            Mutant::BugFoundRaisesUnknownHead,
        ),
        ("poll-no-head-floor", Mutant::PollNoHeadFloor),
        ("fleet-waits-for-expiry", Mutant::FleetWaitsForExpiry),
        ("fleet-share-rounds-down", Mutant::FleetShareRoundsDown),
        ("fleet-never-hands-over", Mutant::FleetNeverHandsOver),
        (
            "bug-fleet-waiting-fills-share",
            Mutant::BugFleetWaitingFillsShare,
        ),
        ("bug-fleet-no-evening", Mutant::BugFleetNoEvening),
        ("bug-sends-found-event", Mutant::BugSendsFoundEvent),
        ("fleet-abort-keeps-lease", Mutant::FleetAbortKeepsLease),
        ("resends-answered-event", Mutant::ResendsAnsweredEvent),
        (
            "bug-ignores-resolved-meanwhile",
            Mutant::BugIgnoresResolvedMeanwhile,
        ),
        ("heads-without-purged", Mutant::HeadsWithoutPurged),
        ("fresh-by-commit", Mutant::FreshByCommit),
        ("bug-round-forgets-parked", Mutant::BugRoundForgetsParked),
        (
            "bug-look-up-beside-reconciliation",
            Mutant::BugLookUpBesideReconciliation,
        ),
        ("numbering-not-kept", Mutant::NumberingNotKept),
        (
            "bug-numbering-log-not-folded",
            Mutant::BugNumberingLogNotFolded,
        ),
        ("bug-read-ignores-lease", Mutant::BugReadIgnoresLease),
        ("bug-stream-sends-skipped", Mutant::BugStreamSendsSkipped),
        ("round-reads-before-drain", Mutant::RoundReadsBeforeDrain),
        (
            "bug-release-reads-plain-rows",
            Mutant::BugReleaseReadsPlainRows,
        ),
        (
            "numbering-without-written-versions",
            Mutant::NumberingWithoutWrittenVersions,
        ),
        ("txn-ignores-records", Mutant::TxnIgnoresRecords),
        ("txn-unknown-is-aborted", Mutant::TxnUnknownIsAborted),
        ("txn-through-past-batch", Mutant::TxnThroughPastBatch),
        ("txn-accepts-aborted", Mutant::TxnAcceptsAborted),
        ("txn-replays-accepted", Mutant::TxnReplaysAccepted),
        ("txn-skips-first-record", Mutant::TxnSkipsFirstRecord),
        ("txn-requeues-at-back", Mutant::TxnRequeuesAtBack),
        ("txn-replayed-is-accepted", Mutant::TxnReplayedIsAccepted),
        ("txn-answer-leaves-queue", Mutant::TxnAnswerLeavesQueue),
        ("txn-stop-without-waiting", Mutant::TxnStopWithoutWaiting),
    ];

    pub fn parse(name: &str) -> Option<Mutant> {
        Mutant::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, m)| *m)
    }
}

/// One trace's counts, and its event log when asked for.
#[derive(Debug, Clone)]
pub struct TraceResult {
    pub counts: Counts,
    pub log: Vec<String>,
}

// ---------------------------------------------------------------------------------------------
// Constants of the simulated world (milliseconds of simulated time).

const LEASE_TTL: u64 = 3_000;

/// The longest a produce request can still be appended after it was sent.
const MAX_RTT: u64 = 1_500;
/// `--unknown-settle-ms`: at least MAX_RTT.
const SETTLE: u64 = 2_000;
/// The served cluster's duplicate window, in the traces where it keeps one (JetStream's
/// `Nats-Msg-Id` window, an HTTP endpoint's idempotency keys): a message whose event id it
/// stored less than this long ago is not stored again, and the answer names the stored copy.
const DEDUP_WINDOW: u64 = 8_000;
/// How far inside the window a look-up still re-sends (`outbox_sink::jetstream::WINDOW_MARGIN`
/// scaled to the simulated window): outside it, a look-up reads the partition.
const DEDUP_MARGIN: u64 = 1_000;
/// A release or a snapshot still waiting for a parked event after this much simulated time
/// would wait forever (the event keeps coming due and nothing resolves it): counted as a stall
/// instead of simulated forever. Far above any resolution the traces see (UNKNOWN resolution
/// max ~40 s; past the budget a parked event is asked every 10 s).
const WAITS_FOREVER_AFTER: u64 = 30 * 60 * 1000;
/// How a run ends whose send was refused because its lease was not certainly held.
const LEASE_LOST: End = End::Error("lease expired: a stale generation may not send");
/// `relay.unclear_max_waiting` of the traces with backpressure: beyond what a trace waits.
const MAX_WAITING_ON_UNCLEAR: u64 = 10_000;
/// Retention: nothing is purged before this long after its last send.
const REPLAY_WINDOW: u64 = 10_000;
/// Drain iterations (half a second each) with nothing to do and nothing due after which the
/// drain stops: longer than [`judge::STALL_AFTER_MS`], so that what never progresses counts.
const IDLE_LIMIT: u64 = 200;
/// `--poll-interval-ms`'s default: a poll round that read little waits this long (ms).
const POLL_INTERVAL: u64 = 100;
const AGGREGATES: u32 = 3;
/// A topic's partitions at the start of a trace.
const PARTITIONS: usize = 2;
/// After the operator raised them (`World::partitions_raised_at`): the broker keeps a log for
/// each from the start, empty until written.
const MAX_PARTITIONS: usize = 3;
const CONSUMERS: usize = 2;
const SERVED_CLUSTER: &str = "A";

/// Topics: 0 and 1 on cluster A (served), 2 on cluster A but it rejects every message
/// (unauthorised), 3 on cluster B (not served by this relay). Cluster B's topic has the name of
/// one of A's, as two clusters of one company often do: the relay's producer is connected to
/// cluster A only, so a send of an event frozen for B/t1 would land on A/t1 (what the route
/// check is there to prevent).
const TOPICS: [(&str, &str); 4] = [("A", "t1"), ("A", "t2"), ("A", "t3"), ("B", "t1")];
const REJECTING_TOPIC: usize = 2;

/// Where a key partitioner puts aggregate `agg` on a topic of `count` partitions. Any fixed
/// function of the two would do; this one moves two of the three aggregates when the count is
/// raised, as a hash modulo a new count moves most keys.
fn partition_of(agg: Agg, count: usize) -> usize {
    if count == PARTITIONS {
        agg as usize % PARTITIONS
    } else {
        (agg as usize * 7 + 1) % count
    }
}

fn topic_index(d: &Destination) -> usize {
    TOPICS
        .iter()
        .position(|(c, t)| *c == d.cluster && *t == d.topic)
        .expect("destinations only name simulated topics")
}

type Agg = u32;

/// Simulated milliseconds as a duration.
fn ms(n: u64) -> std::time::Duration {
    std::time::Duration::from_millis(n)
}

/// The product's key of a simulated aggregate (`order` / `o-N`).
fn agg_key(agg: Agg) -> outbox_relay::AggKey {
    ("order".into(), format!("o-{agg}"))
}

/// The simulated aggregate of an aggregate id `o-N`.
fn agg_of(aggregate_id: &str) -> Agg {
    aggregate_id
        .strip_prefix("o-")
        .and_then(|n| n.parse().ok())
        .expect("simulated aggregate ids are o-N")
}

/// What the simulated relay serves: Kafka cluster A.
fn served() -> Served {
    Served {
        kind: "kafka",
        clusters: vec![SERVED_CLUSTER.into()],
        partitioner: Some("murmur2_random".into()),
    }
}

/// A committed outbox row.
struct Row {
    /// The row as the WAL carries it (generation 1, the destination frozen at enqueue). A row
    /// written plainly (`plain`) carries no version: `version_by_relay`, version 0, as the
    /// decoder gives it; the relay core numbers it from the stream.
    ev: OutboxEvent,
    /// The truth: the row's version, which is its rank among its aggregate's committed rows
    /// (1-based, in commit order). A row written through `outbox.enqueue` carries it (taken
    /// under the aggregate's lock, so committed transactions take them in commit order); a
    /// plain row must be published with it, by the relay's numbering
    /// (`plain_version_wrong` counts every receipt or copy that says otherwise).
    version: i64,
    /// Written plainly, without a version (docs/versions_by_relay.md): its aggregate is one
    /// of [`World::plain`]'s, at or past its [`World::plain_from`].
    plain: bool,
    agg: Agg,
    commit_end: Lsn,
    business: u64,
    /// The route version the row names (`World::route_versions`): a narrow row stores it
    /// instead of the rendered destination, which the relay renders when it decodes the row.
    route_version: usize,
    /// Destination migrations (envelope generation 2, 3, …), latest last.
    migrations: Vec<(Destination, String)>,
    purged: bool,
    last_send: u64,
}

impl Row {
    /// `outbox.events_current`: the row with its latest migration applied.
    fn current(&self) -> OutboxEvent {
        let mut ev = self.ev.clone();
        if let Some((d, digest)) = self.migrations.last() {
            ev.destination = d.clone();
            ev.destination_digest = digest.clone();
            ev.digests_checked = false;
            ev.envelope_generation += self.migrations.len() as i32;
        }
        ev
    }
    /// The destination digest the latest destination migration stored, if any.
    fn migrated_digest(&self) -> Option<&str> {
        self.migrations.last().map(|(_, d)| d.as_str())
    }
    fn current_digest(&self) -> &str {
        self.migrated_digest()
            .unwrap_or(&self.ev.destination_digest)
    }
}

/// A send the core commanded, as the simulated broker took it: what its delivery report
/// will say was decided when it was sent.
struct Flight {
    token: u64,
    row: usize,
    topic: usize,
    partition: usize,
    sent_at: u64,
    attempt: i32,
    report: Report,
    /// Not reported before this (a message a deeper gate's producer holds back).
    ready_at: u64,
}

/// One relay run (`outboxd run` between two errors), with everything it keeps in memory.
struct Relay {
    gen: i64,
    /// Since when (simulated time) its reading is held while all it holds waits on unclear
    /// outcomes (`reading_stopped_by_unclear` past the count's sample life).
    held_by_unclear_since: Option<u64>,
    /// SIGKILLed: removed at the end of the step (indices stay valid within a step).
    killed: bool,
    /// The product's lease keeper (`outbox_relay::lifecycle::LeaseKeeper`): until when this
    /// run's lease is certainly its own, by its own clock.
    keeper: LeaseKeeper<Planted>,
    /// A renewal asked and not yet answered: what the ledger answered (it stamped the lease
    /// when asked; the answer is read at a later step, possibly after a pause).
    renewal: Option<Renewal>,
    /// The loop's timers, where the product's schedule times the loop (`World::loop_timing`).
    schedule: Option<Schedule<Planted>>,
    /// A pipelined acceptance running on its own task (`Pipeline::flush_pipelined`; loop
    /// timing only): it answers at a later step, or is settled before the next acceptance.
    accepting: Option<outbox_relay::Acceptance>,
    paused: bool,
    /// The new lease holder terminated this run's walsender.
    stream_cut: bool,
    salvaging: bool,
    /// A salvaging run's end, in the core's order (`lifecycle::RunEnd`).
    end: Option<RunEnd>,
    /// The product's decisions: gate, ack tracker, in-flight bookkeeping, batch.
    core: PipelineCore<Planted>,
    /// Next WAL transaction to stream.
    cursor: usize,
    /// The simulated sink's side of the core's sends, in send order.
    in_flight: Vec<Flight>,
    /// Receipts that were late when their report arrived (a salvaging or superseded run, or
    /// the event already published), by (event, partition, offset): the judge's late ACKs.
    late: HashSet<(Uuid, i32, i64)>,
    /// Rows this run has seen proven on the broker: a delivery report with a position, or a
    /// look-up that found its copy. Sending one again is the judge's `resent_after_proof`
    /// (unless the run read the row again since: a replay is sent again by design).
    proven: HashSet<usize>,
    /// When the run started (the judge's `stalls` count only runs that had time).
    started: u64,
    /// Route versions committed before the run started: the ones it read at start.
    versions_at_start: usize,
    /// Look-ups of parked events running on their own task (`Pipeline::run_due_unclear`):
    /// each answers at a later step (`Pipeline::on_lookup`).
    lookups: Vec<PendingLookup>,
    /// A poll-mode run's loop, where it is the product's (`World::poll_loop`).
    poll_run: Option<PollRun>,
    /// A deeper gate's producer (`World::depth` above 1) raised its fatal error: it delivers
    /// nothing it had not delivered, refuses every message after, and the run ends at the
    /// next failed report or send (`Pipeline::on_live_report`, `Pipeline::execute`).
    producer_fatal: bool,
    /// A deeper gate's producer: per (topic, partition), until when the messages it holds
    /// back (a topic down, a slow round trip) land; what it takes for that partition meanwhile
    /// lands after them, in the order taken.
    tails: HashMap<(usize, usize), u64>,
    /// A deeper gate's producer: the partition count it places keys by, per topic (the sink's
    /// `Placer` over `outbox_core::placement::Placement`); new with each run's producer.
    placement: Placement,
    /// Until when (simulated ms) that loop waits after a round that read little
    /// ([`RoundStep::Idle`]): reports, look-ups and due resends go on meanwhile.
    idle_until: Option<u64>,
}

/// A deeper gate's placement: the product's, or its mutant `deep-unpinned`.
enum Placement {
    Product(outbox_core::placement::Placement),
    Unpinned(outbox_core::placement::Placement<true>),
}

impl Placement {
    fn admit(
        &mut self,
        in_flight: usize,
        now: std::time::Duration,
    ) -> outbox_core::placement::Admit {
        match self {
            Placement::Product(p) => p.admit(in_flight, now),
            Placement::Unpinned(p) => p.admit(in_flight, now),
        }
    }

    fn drain_gave_up(&mut self, now: std::time::Duration) {
        match self {
            Placement::Product(p) => p.drain_gave_up(now),
            Placement::Unpinned(p) => p.drain_gave_up(now),
        }
    }

    fn count(&mut self, topic: &str, live: u32, now: std::time::Duration) -> u32 {
        match self {
            Placement::Product(p) => p.count(topic, live, now),
            Placement::Unpinned(p) => p.count(topic, live, now),
        }
    }
}

/// A look-up of a parked event's open DISPATCH_UNKNOWN attempt, started and not yet answered.
struct PendingLookup {
    /// The event as the core parked it (its digests go into a found copy's receipt).
    event: OutboxEvent,
    /// The attempt (`attempts::open_unknown_of`: the event's latest open one), by index.
    attempt: usize,
    /// What the look-ups of the event's later attempts proved, in this round.
    prior: Option<LookupOutcome>,
    /// The event had its primary receipt when the look-up started (when the daemon's task
    /// makes its request; the simulated answer comes at a later step).
    published: bool,
    /// Started by the running reconciliation for another generation's attempt
    /// (`Pipeline::start_reconcile_lookup`): its answer is recorded and the core told
    /// `reconciled`, nothing is sent; otherwise a parked event's.
    reconciling: bool,
}

/// A run's acceptance committed its records but the ledger refused its checkpoint: the
/// lease is another run's.
const FENCED: &str = "lease lost: checkpoint fenced";

/// Why a relay run ended.
#[derive(Debug)]
enum End {
    Error(&'static str),
    /// An unclear outcome ended the run: what issue 25 forbids (`unclear_restarts`; only the
    /// mutant `bug-end-run-on-unclear` takes this path).
    Unclear(&'static str),
}

struct World {
    rng: SplitMix64,
    mutant: Option<Mutant>,
    verbose: bool,
    /// The longest a request can still be appended after it was sent: [`MAX_RTT`], which the
    /// settle time covers. A test raises it past the settle time to show that
    /// `unknown_untraced` sees an absence proven too early.
    max_append_delay: u64,
    log: Vec<String>,
    now: u64,
    faults: bool,
    c: Counts,

    rows: Vec<Row>,
    by_id: HashMap<Uuid, usize>,
    /// Committed transactions: (commit end LSN, rows).
    wal: Vec<(Lsn, Vec<usize>)>,
    next_lsn: u64,
    agg_version: Vec<i64>,
    business_next: u64,
    /// `outbox.route_versions`: (topic, route generation, commit LSN), immutable, one per
    /// route change; the last is the route policy in force (`World::route`).
    route_versions: Vec<(usize, i64, Lsn)>,

    slot_confirmed: Option<Lsn>,
    ledger: Ledger,

    /// `[topic][partition]` → messages in offset order.
    broker: Vec<Vec<Vec<Msg>>>,
    /// Messages the broker stored so far (the next one's `Msg::seq`).
    stored: u64,
    /// Every topic's partition count now: [`PARTITIONS`], or [`MAX_PARTITIONS`] once the
    /// operator raised it.
    partitions: usize,
    /// The step at which the operator raises every topic's partitions to [`MAX_PARTITIONS`]:
    /// half of the deeper gate's traces (streams 6236 and 6237, generators of their own drawn
    /// only in those traces, so that every other trace keeps its draws).
    partitions_raised_at: Option<u64>,
    /// Appends still on the wire: (due time, topic, partition, message).
    late_appends: Vec<(u64, usize, usize, Msg)>,
    /// A topic's partitions cannot be read or written until this time.
    down_until: [u64; 4],

    relays: Vec<Relay>,
    /// The lease holder was SIGKILLed: a successor waits for the lease to expire.
    holder_killed: bool,
    /// The step at which this trace loses its replication slot (5 % of traces), drawn from a
    /// generator of its own so that the other traces keep every draw.
    slot_loss_at: Option<u64>,
    /// The slot is gone and the ledger still names it; the operator has (or has not yet)
    /// asked for `--resnapshot`.
    slot_lost: bool,
    /// Draws when the slot is dropped and recreated behind the relay's back, between a run's
    /// plan and its `START_REPLICATION` (half of the traces that lose their slot).
    slot_replacer: Option<SplitMix64>,
    /// The slot's position is the one an interloper's creation gave it, not one a relay
    /// confirmed (what `check_confirmed` judges), until a relay creates or moves it.
    slot_by_interloper: bool,
    resnapshot: bool,
    /// The relay runs in poll mode (`outboxd run --mode poll`): no slot; each run reads the
    /// pending events above each aggregate's head in rounds (`relay/poll.rs`). Drawn from a
    /// generator of its own, like the slot loss, so CDC traces keep every draw.
    poll: bool,
    /// A poll-mode run's loop is the product's (`outbox_relay::poll::PollRun`, as the
    /// daemon's `relay/poll.rs` runs it): each poll step is the run's next [`RoundStep`] (a
    /// round drains, reads, drains; releases and waits come when the core says), and the
    /// batch is accepted and releases polled only within those steps; otherwise a round is
    /// one step drawn whenever it can admit something, and accepting and releases are steps
    /// of their own. Half of the poll traces (`World::poll_step`).
    poll_loop: bool,
    consumers: Vec<Consumer>,
    /// Truth: the send of every (row, relay gen, attempt) proven ABSENT.
    absent_attempts: HashSet<(usize, i64, i32)>,
    /// Events sent to a destination that is not their current one.
    cross_sends: HashSet<usize>,
    /// `--unclear-budget`: tries of one unclear event before its aggregate is held. A quarter
    /// of the traces (drawn from a generator of their own) use 3 instead of the daemon's
    /// default, so that the hold and its release are exercised.
    unclear_budget: u32,
    /// `--unclear-schedule-ms`: a quarter of the traces (a generator of their own) wait by an
    /// operator's schedule (at once, 100 ms, 1 s, then every 3 s, jittered) instead of the
    /// doubling.
    unclear_schedule: Option<outbox_relay::UnclearSchedule>,
    /// The producer refuses a share of the sends without taking them (queue full, a
    /// transient client error): a quarter of the traces, drawn from a generator of their own,
    /// as are the refusals, so that the other traces keep every draw.
    producer_refuses: Option<SplitMix64>,
    /// Its own stream: whether a poll round waits between two rows (`World::round_waits`), so
    /// that the traces without anything to wait for stay as they were.
    round_waits: SplitMix64,
    /// The served cluster keeps a duplicate window ([`DEDUP_WINDOW`]) and a look-up inside it
    /// is a re-send under the event's key (`Sink::lookup_resends`), as JetStream and an HTTP
    /// endpoint with idempotency keys do: a quarter of the traces, drawn from a generator of
    /// their own.
    dedup: bool,
    /// How many events of one aggregate the relay may have in flight (`PipelineCore::
    /// set_aggregate_depth`): 1, or 2-4 in a quarter of the CDC traces without a duplicate
    /// window (stream 6234), whose producer is then a gapless one ([`World::broker_send_in_order`]).
    depth: u8,
    /// The relay's bounds: `max_in_flight` (`u64::MAX`: no backpressure); what waits on
    /// unclear outcomes has [`MAX_WAITING_ON_UNCLEAR`]; the batch a read outside the stream
    /// (a snapshot, a poll round) accepts before it goes on (`usize::MAX`: at its end only).
    bounds: Bounds,
    /// Lease renewals are asked when the product's keeper says one is due and answered at a
    /// later step, a pause possibly between (`World::ask_renewal`, `World::answer_renewal`),
    /// and a run whose lease was taken learns it from its keeper only; otherwise a renewal is
    /// asked and answered in one step drawn at random, and a superseded run learns at a
    /// random step (`World::end_stale_runs`).
    keeper_timing: bool,
    /// An operator stops the running relay now and then (SIGTERM: `outboxd`'s graceful stop),
    /// and a new one starts: a CDC run ends as `lifecycle::RunEnd` with `Ending::Stop` says
    /// (reports awaited within the grace, the batch accepted with its checkpoint, the slot
    /// confirmed), a poll run at its loop's next round (`RoundStep::Stop`); then the lease is
    /// released and the next relay takes it at once. A quarter of the CDC traces and of those
    /// that run the product's poll loop (`World::stop_relay`).
    stops: bool,
    /// Releases under faults: topics go down, routes change, the operator migrates and the
    /// relay polls for releases four times as often, so that releases meet events parked
    /// after unclear outcomes (bug 24 was 1 in a million traces without it).
    release_heavy: bool,
    /// The relay loop's timing is the product's (`outbox_relay::schedule::Schedule`, with
    /// these settings): when a CDC run accepts its batch or writes an idle checkpoint, polls
    /// releases and sends a standby status is `Schedule::due` after every step, and the drain
    /// waits for its next wake-up; otherwise each is a step drawn at random (and the drain
    /// does them at once). A quarter of the CDC traces (`World::loop_tick`).
    loop_timing: Option<Settings>,
    /// The aggregates written plainly (`INSERT INTO outbox.events` without a version or a
    /// route; docs/versions_by_relay.md), each of them only so from its [`World::plain_from`]
    /// on (an aggregate is written one way at a time: the documented rule). A quarter of the CDC traces whose slot is never lost,
    /// drawn from generators of their own (so that the other traces keep every draw), write
    /// one to all of the aggregates plainly. Never in poll mode (it refuses an outbox that
    /// allows such rows: it cannot see commit order) nor where the slot is lost (a new slot
    /// starts with no numbering, and the product refuses it over plain rows: "Not built yet").
    plain: [bool; AGGREGATES as usize],
    /// The version from which each of [`World::plain`]'s aggregates is written plainly: 1 for
    /// half of them; the others' first rows go through `outbox.enqueue`, and the outbox's
    /// owner allows plain INSERTs between (migration 0043: `outbox.enqueue` itself then writes
    /// plain rows). The switch waits for every writer of the outbox, so the aggregate's
    /// versioned rows all commit before its first plain one, and the relay must number that
    /// one after them.
    plain_from: [i64; AGGREGATES as usize],
    /// How the running reconciliation gets the event of a plain row's open attempt (one of
    /// another generation, or of an event published before the run started: the run does
    /// not replay it into a parked event of its own). The daemon loaded it from SQL
    /// (`unknown::load`), where a plain row has neither a version nor a route:
    /// `event_from_row` failed, the error was not transient, and the process stopped — every
    /// restart again, while the attempt was open (found by this model, 2026-12-05). `true`
    /// models that daemon (`plain_rows_unreadable` counts the runs it ends); `false`, the
    /// default, the fix: the attempt keeps the version and route version the relay gave the
    /// row, and the look-up uses them (`plain_reconcile_lookups` counts these).
    plain_lookups_as_daemon: bool,
    /// Accepted receipts of plain rows whose version is not the row's commit rank (with the
    /// copies on the broker that carry one, the judge's `plain_version_wrong`).
    plain_receipts_wrong: u64,
}

macro_rules! log {
    ($w:expr, $($arg:tt)*) => {
        if $w.verbose {
            let line = format!("t={:>6} {}", $w.now, format!($($arg)*));
            $w.log.push(line);
        }
    };
}

// By role; declared after `log!` so that they can use it.
mod broker;
mod consumer;
mod fleet;
mod judge;
mod ledger;
mod txn;

use broker::{Msg, Report};
use consumer::Consumer;
pub use judge::Counts;
use ledger::{Attempt, AttemptState, HoldState, Item, Ledger, Receipt};

/// Runs trace `trace` of `seed`.
pub fn run_trace(seed: u64, trace: u64, mutant: Option<Mutant>, verbose: bool) -> TraceResult {
    let mut w = World::new(SplitMix64::for_trace(seed, trace), mutant, verbose);
    w.run();
    w.c.traces = 1;
    // A fleet over several shards, on a stream of its own (the event world's draws, and so
    // its regression traces, stay as they were).
    let log = verbose.then_some(&mut w.log);
    fleet::run(
        SplitMix64::for_trace(seed, trace).fork(7),
        mutant,
        &mut w.c,
        log,
    );
    // Exactly-once mode, on a stream of its own as well.
    let log = verbose.then_some(&mut w.log);
    txn::run(
        SplitMix64::for_trace(seed, trace).fork(8),
        mutant,
        &mut w.c,
        log,
    );
    TraceResult {
        counts: w.c,
        log: w.log,
    }
}

impl World {
    fn new(rng: SplitMix64, mutant: Option<Mutant>, verbose: bool) -> World {
        let mut side = rng.fork(1);
        let slot_loss_at = side.chance(50).then(|| side.range(20, 200));
        // A quarter of the traces run the relay in poll mode, where there is no slot to lose.
        let poll = rng.fork(2).chance(250);
        let slot_loss_at = slot_loss_at.filter(|_| !poll);
        let unclear_budget = if rng.fork(3).chance(250) {
            3
        } else {
            outbox_relay::UnclearPolicy::default().budget
        };
        let producer_refuses = rng.fork(4).chance(250).then(|| rng.fork(5));
        let round_waits = rng.fork(9);
        let unclear_schedule = rng.fork(6).chance(250).then(|| {
            let ms = std::time::Duration::from_millis;
            outbox_relay::UnclearSchedule::new(&[ms(0), ms(100), ms(1_000), ms(3_000)])
                .expect("a valid schedule")
        });
        let dedup = rng.fork(8).chance(250);
        // Half of the traces that lose their slot also see it replaced between a run's plan
        // and its START_REPLICATION, at times (stream 1284; 1285 draws when). No trace of
        // `the_traces_that_found_bugs_stay_fixed` loses its slot: they replay as they were.
        let slot_replacer =
            (slot_loss_at.is_some() && rng.fork(1284).chance(500)).then(|| rng.fork(1285));
        // A quarter of the traces read the slot under the product's backpressure with a
        // `max_in_flight` of 2 to 5, which what waits behind an unclear outcome reaches; the
        // rest with none, so that their draws stay as they were. (Stream 225 is the first
        // above 20 whose draw leaves every trace of `the_traces_that_found_bugs_stay_fixed`
        // without backpressure, so they replay as docs/simulation.md lists them.)
        let backpressure = rng.fork(225).chance(250);
        let bounds = Bounds {
            max_in_flight: if backpressure {
                rng.fork(226).range(2, 6)
            } else {
                u64::MAX
            },
            max_waiting: Waiting {
                events: MAX_WAITING_ON_UNCLEAR,
                bytes: u64::MAX,
            },
            // The same quarter accepts a snapshot's or poll round's batch of 1 to 7 as it
            // reads (`outbox_relay::pace`); the rest at the read's end, as before.
            batch_size: if backpressure {
                rng.fork(227).range(1, 8) as usize
            } else {
                usize::MAX
            },
            max_in_flight_bytes: usize::MAX,
        };
        // A quarter of the traces renew leases when the product's keeper says so and read
        // each answer at a later step, possibly after a pause (stream 320: the first above 226
        // whose draw leaves every trace of `the_traces_that_found_bugs_stay_fixed` out); the
        // rest ask and read in one step drawn at random, so that their draws stay as they were.
        let keeper_timing = rng.fork(320).chance(250);
        // A quarter of the traces release under faults (stream 2573: the first above 1285
        // whose draw leaves every regression trace out).
        let release_heavy = rng.fork(2573).chance(250);
        // A quarter of the CDC traces time their relay loop by the product's schedule, with
        // settings of their own (stream 1282: the first above 320 whose draw leaves every
        // regression trace out; 1283 draws the settings).
        // Half of the poll traces run the product's poll loop (stream 4528: the first above
        // 4096 whose draw leaves every regression trace out).
        let poll_loop = poll && rng.fork(4528).chance(500);
        // Stream 5134: the first above 5119 whose draw leaves every regression trace out.
        let stops = (!poll || poll_loop) && rng.fork(5134).chance(250);
        let loop_timing = (!poll && rng.fork(1282).chance(250)).then(|| {
            let mut draw = rng.fork(1283);
            Settings {
                status_interval: ms(draw.range(100, 2_000)),
                batch_linger: ms(draw.range(0, 100)),
                bounds: Bounds {
                    batch_size: draw.range(1, 8) as usize,
                    max_in_flight: u64::MAX,
                    max_waiting: Waiting {
                        events: u64::MAX,
                        bytes: u64::MAX,
                    },
                    max_in_flight_bytes: usize::MAX,
                },
                release_poll: ms(draw.range(100, 2_000)),
            }
        });
        // Aggregates written plainly: a quarter of the CDC traces whose slot is never lost
        // (`World::plain` says why only those), one to all of the aggregates. (Stream 13's
        // draw leaves every trace of `the_traces_that_found_bugs_stay_fixed` written through
        // `outbox.enqueue` only, so they replay as docs/simulation.md lists them: routes are
        // narrower where rows are plain, and stream 10's took four of them.)
        let mut plain = [false; AGGREGATES as usize];
        if !poll && slot_loss_at.is_none() && rng.fork(13).chance(250) {
            let mask = rng.fork(14).range(1, 1 << AGGREGATES);
            for (a, p) in plain.iter_mut().enumerate() {
                *p = mask & (1 << a) != 0;
            }
        }
        // Drawn from a generator of its own, only in traces with plain aggregates, so that
        // every other trace keeps its draws.
        let mut plain_from = [1; AGGREGATES as usize];
        if plain.contains(&true) {
            let mut draw = rng.fork(15);
            for (from, p) in plain_from.iter_mut().zip(plain) {
                if p && draw.chance(500) {
                    *from = draw.range(2, 6) as i64;
                }
            }
        }
        // A quarter of the Kafka CDC traces let 2-4 events of an aggregate be in flight (stream
        // 6234, a generator of its own: every other trace keeps its draws; the first above 6203
        // whose draw leaves every trace of `the_traces_that_found_bugs_stay_fixed` at depth 1,
        // so that they replay as docs/simulation.md lists them).
        let depth = if !poll && !dedup && rng.fork(6234).chance(250) {
            rng.fork(6235).range(2, 5) as u8
        } else {
            1
        };
        let partitions_raised_at =
            (depth > 1 && rng.fork(6236).chance(500)).then(|| rng.fork(6237).range(10, 150));
        World {
            dedup,
            depth,
            stored: 0,
            partitions: PARTITIONS,
            partitions_raised_at,
            bounds,
            keeper_timing,
            release_heavy,
            stops,
            loop_timing,
            poll_loop,
            plain,
            plain_from,
            plain_lookups_as_daemon: false,
            plain_receipts_wrong: 0,
            unclear_budget,
            unclear_schedule,
            producer_refuses,
            round_waits,
            slot_loss_at,
            poll,
            slot_lost: false,
            slot_replacer,
            slot_by_interloper: false,
            resnapshot: false,
            rng,
            mutant,
            verbose,
            max_append_delay: MAX_RTT,
            log: Vec::new(),
            now: 0,
            faults: true,
            c: Counts::default(),
            rows: Vec::new(),
            by_id: HashMap::new(),
            wal: Vec::new(),
            next_lsn: 0x100,
            agg_version: vec![0; AGGREGATES as usize],
            business_next: 0,
            route_versions: vec![(0, 1, Lsn(0))],
            slot_confirmed: None,
            ledger: Ledger::default(),
            broker: (0..TOPICS.len())
                .map(|_| (0..MAX_PARTITIONS).map(|_| Vec::new()).collect())
                .collect(),
            late_appends: Vec::new(),
            down_until: [0; 4],
            relays: Vec::new(),
            holder_killed: false,
            consumers: (0..CONSUMERS)
                .map(|_| Consumer {
                    committed: vec![0; TOPICS.len() * MAX_PARTITIONS],
                    pos: vec![0; TOPICS.len() * MAX_PARTITIONS],
                    model: if mutant == Some(Mutant::SkipDedup) {
                        ConsumerModel::forgetting_applied(GapPolicy::Report, 1_000)
                    } else {
                        ConsumerModel::new(GapPolicy::Report, 1_000)
                    },
                })
                .collect(),
            absent_attempts: HashSet::new(),
            cross_sends: HashSet::new(),
        }
    }

    fn is(&self, m: Mutant) -> bool {
        self.mutant == Some(m)
    }

    fn run(&mut self) {
        let steps = self.rng.range(60, 260);
        let max_events = self.rng.range(4, 30);
        if self.stops {
            log!(self, "the operator stops relays now and then");
        }
        if self.plain.contains(&true) {
            let plain: Vec<String> = (0..AGGREGATES)
                .filter(|a| self.plain[*a as usize])
                .map(|a| match self.plain_from[a as usize] {
                    1 => format!("o-{a}"),
                    v => format!("o-{a} (from v{v})"),
                })
                .collect();
            log!(self, "written plainly (no version): {}", plain.join(", "));
        }
        // The first start creates the slot, before anything is committed (its snapshot is
        // empty); a lost slot later is recreated with --resnapshot and a snapshot of the table.
        self.start_relay();
        for step in 0..steps {
            if self.slot_loss_at == Some(step) {
                self.lose_slot();
            }
            if self.partitions_raised_at == Some(step) {
                self.partitions = MAX_PARTITIONS;
                self.c.partitions_raised += 1;
                log!(
                    self,
                    "the operator raises every topic's partitions from {PARTITIONS} to {MAX_PARTITIONS}"
                );
            }
            self.step(max_events);
        }
        self.drain();
        self.c.loop_traces = u64::from(self.loop_timing.is_some());
        if self.loop_timing.is_some() {
            // What the running relay resolved is written as its checkpoint, and the slot told.
            if let Some(i) = self.active() {
                let core = &self.relays[i].core;
                let unconfirmed = self.slot_confirmed.is_some_and(|s| s < core.durable());
                if !self.relays[i].stream_cut
                    && (core.tracker.watermark() > core.durable() || unconfirmed)
                {
                    log!(
                        self,
                        "CHECKPOINT NOT WRITTEN: resolved through {}, checkpoint {}, slot {:?}",
                        core.tracker.watermark(),
                        core.durable(),
                        self.slot_confirmed
                    );
                    self.c.checkpoint_not_written += 1;
                }
            }
        }
        self.c.poll_traces = u64::from(self.poll);
        self.c.poll_loop_traces = u64::from(self.poll_loop);
        self.c.plain_traces = u64::from(self.plain.contains(&true));
        self.c.plain_switched = self.plain_from.iter().filter(|v| **v > 1).count() as u64;
        self.c.dedup_traces = u64::from(self.dedup);
        self.c.deep_traces = u64::from(self.depth > 1);
        self.judge();
    }

    // ----------------------------------------------------------------------------- the loop

    /// The running relay that holds the lease.
    fn active(&self) -> Option<usize> {
        self.relays
            .iter()
            .position(|r| !r.paused && !r.salvaging && !r.killed && r.gen == self.ledger.lease_gen)
    }

    /// Runs whose lease was taken over stop by their own clock once their deadline has passed,
    /// else find out at their next renewal (a quarter of the steps) and end; until then they
    /// still act. No run is ever in that window unless a lease is taken from a live holder
    /// before its deadline (the mutant `early-takeover-of-live-holder`): leases are taken
    /// only once expired, or from a SIGKILLed holder.
    fn end_stale_runs(&mut self) {
        for i in 0..self.relays.len() {
            let r = &self.relays[i];
            if !r.paused && !r.salvaging && !r.killed && r.gen != self.ledger.lease_gen {
                if r.keeper.valid(ms(self.now)) && (self.keeper_timing || self.rng.below(4) != 0) {
                    continue;
                }
                self.end_run(i, End::Error("lease taken by a newer generation"));
            }
        }
    }

    fn step(&mut self, max_events: u64) {
        self.land_late_appends();
        self.end_stale_runs();
        let active = self.active();
        // The slot has more for the CDC relay, and whether backpressure lets it read.
        let slot_has_more = active.filter(|&i| {
            let r = &self.relays[i];
            !self.poll && !r.stream_cut && r.cursor < self.wal.len()
        });
        let can_read = slot_has_more.is_some_and(|i| self.can_read(i));
        let has_next = active.is_some_and(|i| {
            if self.poll_loop {
                self.relays[i].idle_until.map_or(true, |t| self.now >= t)
            } else if self.poll {
                self.round_due(i)
            } else {
                can_read
            }
        });
        if let Some(i) = slot_has_more.filter(|_| !can_read) {
            let r = &self.relays[i];
            // Not read, with more in the slot, while all the relay holds unresolved waits on
            // unclear outcomes: nothing to accept, and no send answered within
            // `UNANSWERED_AFTER` still unanswered (a send older than that is an outcome
            // becoming unclear). For longer than the loop's count of them may lag
            // (`WAITING_SAMPLE`: the bounds see a park at once, what queues behind it and a
            // send becoming unanswered at the next count).
            let unanswered = outbox_relay::pipeline::UNANSWERED_AFTER.as_millis() as u64;
            self.c.reads_held_back += 1;
            let held = r
                .in_flight
                .iter()
                .all(|f| self.now >= f.sent_at + unanswered)
                && r.core.batch_len() == 0;
            let now = self.now;
            let since = &mut self.relays[i].held_by_unclear_since;
            if !held {
                *since = None;
            } else if now
                > *since.get_or_insert(now)
                    + outbox_relay::schedule::WAITING_SAMPLE.as_millis() as u64
            {
                self.c.reading_stopped_by_unclear += 1;
            }
        } else if let Some(i) = active {
            self.relays[i].held_by_unclear_since = None;
        }
        let now_ms = self.now;
        let ready = |r: &Relay| !r.paused && r.in_flight.iter().any(|f| f.ready_at <= now_ms);
        let reports = self.relays.iter().any(ready);
        let unclear_due = active.is_some_and(|i| self.unclear_due(i));
        let answering = |r: &Relay| !r.paused && !r.salvaging && !r.killed && !r.lookups.is_empty();
        // Where the keeper's timing is the product's: a run asks when its keeper says a
        // renewal is due, and reads the answer at a later step (not while paused).
        let now = ms(self.now);
        let may_ask = |r: &Relay| !r.paused && !r.killed && r.keeper.renewal_due(now);
        let may_read = |r: &Relay| !r.paused && !r.killed && r.renewal.is_some();
        let renewing = if self.keeper_timing {
            self.relays.iter().any(may_ask)
        } else {
            active.is_some()
        };
        let renew_weight = if renewing { 4 } else { 0 };
        let settling = |r: &Relay| !r.paused && !r.killed && !r.salvaging && r.accepting.is_some();
        let settle_weight = if self.relays.iter().any(settling) {
            10
        } else {
            0
        };
        let read_weight = if self.keeper_timing && self.relays.iter().any(may_read) {
            6
        } else {
            0
        };
        let lookups = self.relays.iter().any(answering);
        // Accepting, standby status and release polls are steps of their own unless the
        // product's schedule times them (`World::loop_tick`).
        let timed = self.loop_timing.is_none() && !self.poll_loop;
        let heavy = if self.release_heavy { 4 } else { 1 };
        let weights = [
            if (self.rows.len() as u64) < max_events {
                14
            } else {
                0
            }, // 0 producer txn
            if has_next { 14 } else { 0 },                 // 1 decode
            if reports { 16 } else { 0 },                  // 2 delivery report
            if active.is_some() && timed { 6 } else { 0 }, // 3 accept batch
            if active.is_some() && timed { 3 } else { 0 }, // 4 standby status
            if active.is_some() && timed {
                2 * heavy
            } else {
                0
            }, // 5 releases
            renew_weight,                                  // 6 renew lease
            6,                                             // 7 time passes
            if active.is_some() { 1 } else { 0 },          // 8 SIGKILL relay
            if active.is_some() { 1 } else { 0 },          // 9 pause relay
            if self.relays.iter().any(|r| r.paused) {
                2
            } else {
                0
            }, // 10 resume zombie
            if active.is_none() { 6 } else { 0 },          // 11 start relay
            heavy,                                         // 12 broker topic down
            heavy,                                         // 13 route policy change
            2 * heavy,                                     // 14 operator migration
            8,                                             // 15 consumer
            1,                                             // 16 consumer crash
            1,                                             // 17 purge
            1,                                             // 18 producer retry
            if self.relays.iter().any(|r| r.salvaging) {
                6
            } else {
                0
            }, // 19 salvage
            if unclear_due { 8 } else { 0 },               // 20 a parked event is due
            if lookups { 8 } else { 0 },                   // 21 a look-up answers
            read_weight,                                   // 22 a renewal's answer is read
            settle_weight,                                 // 23 a pipelined acceptance answers
            if self.stops && active.is_some() { 1 } else { 0 }, // 24 the operator stops the relay
        ];
        match self.rng.weighted(&weights) {
            0 => self.producer_txn(),
            1 if self.poll_loop => self.relay_call(active, Self::poll_round_of_steps),
            1 if self.poll => self.relay_call(active, Self::poll_round),
            1 => self.relay_call(active, Self::decode_next),
            2 => {
                let cands: Vec<usize> = (0..self.relays.len())
                    .filter(|i| ready(&self.relays[*i]))
                    .collect();
                let i = cands[self.rng.below(cands.len() as u64) as usize];
                let ready: Vec<usize> = (0..self.relays[i].in_flight.len())
                    .filter(|k| self.relays[i].in_flight[*k].ready_at <= now_ms)
                    .collect();
                let k = ready[self.rng.below(ready.len() as u64) as usize];
                let token = self.relays[i].in_flight[k].token;
                self.relay_call(Some(i), |w, i| w.on_report(i, token));
            }
            3 => self.relay_call(active, |w, i| w.flush(i, !w.poll)),
            4 => self.relay_call(active, |w, i| {
                w.status_update(i);
                Ok(())
            }),
            5 => self.relay_call(active, Self::process_releases),
            6 if self.keeper_timing => {
                let i = self.relays.iter().position(may_ask).expect("weighted");
                self.ask_renewal(i);
            }
            6 => self.relay_call(active, |w, i| {
                w.renew(i);
                Ok(())
            }),
            7 => self.now += self.rng.range(1, 400),
            8 => self.sigkill(active.expect("weighted")),
            9 => {
                let i = active.expect("weighted");
                log!(
                    self,
                    "relay gen {} paused (SIGSTOP / GC)",
                    self.relays[i].gen
                );
                self.relays[i].paused = true;
                self.c.relay_pauses += 1;
            }
            10 => {
                let i = self.relays.iter().position(|r| r.paused).expect("weighted");
                log!(self, "relay gen {} resumes", self.relays[i].gen);
                self.relays[i].paused = false;
                // The keeper's task may read a renewal's answer that waited in its socket
                // before the run looks at its deadline.
                if self.relays[i].renewal.is_some() && self.rng.below(2) == 0 {
                    self.answer_renewal(i);
                }
                if !self.relays[i].keeper.valid(ms(self.now)) {
                    // Its own monotonic clock says the lease is gone: it sends nothing more.
                    self.end_run(i, End::Error("lease deadline passed while paused"));
                }
            }
            11 => self.start_relay(),
            12 => {
                let t = self.rng.below(2) as usize;
                self.down_until[t] = self.now + self.rng.range(200, 5_000);
                log!(
                    self,
                    "topic {} unavailable until {}",
                    TOPICS[t].1,
                    self.down_until[t]
                );
            }
            13 => self.route_change(),
            14 => self.operator_migrate(false),
            15 => {
                let c = self.rng.below(CONSUMERS as u64) as usize;
                self.consume(c);
            }
            16 => {
                let c = self.rng.below(CONSUMERS as u64) as usize;
                self.consumer_crash(c);
            }
            17 => self.purge(),
            18 => self.producer_retry(),
            19 => {
                let i = self
                    .relays
                    .iter()
                    .position(|r| r.salvaging)
                    .expect("weighted");
                self.salvage(i);
            }
            20 => self.relay_call(active, Self::run_due_unclear),
            21 => {
                let i = self.relays.iter().position(answering).expect("weighted");
                let k = self.rng.below(self.relays[i].lookups.len() as u64) as usize;
                self.relay_call(Some(i), |w, i| w.on_lookup(i, k));
            }
            22 => {
                let i = self.relays.iter().position(may_read).expect("weighted");
                self.answer_renewal(i);
            }
            23 => {
                let i = self.relays.iter().position(settling).expect("weighted");
                self.relay_call(Some(i), Self::settle);
            }
            24 => self.stop_relay(active.expect("weighted")),
            _ => unreachable!(),
        }
        if let Some(i) = self.active() {
            self.loop_tick(i);
        }
        self.relays.retain(|r| !r.killed);
    }

    /// What the daemon's loop does after anything happened (`relay/mod.rs`, after its
    /// `select!`), where the product's schedule times it: `Schedule::due` says whether to
    /// accept the batch (or write the idle checkpoint), poll releases, send a standby status,
    /// and `Due::steps` in which order.
    fn loop_tick(&mut self, i: usize) {
        if self.poll || self.relays[i].stream_cut {
            return;
        }
        let Some(mut schedule) = self.relays[i].schedule.take() else {
            return;
        };
        let load = self.load_of(i);
        let due = schedule.due(ms(self.now), &load);
        let alive = |w: &World| {
            let r = &w.relays[i];
            !r.killed && !r.salvaging
        };
        for step in due.steps() {
            // A step that ends the run ends the turn.
            if !alive(self) {
                break;
            }
            match step {
                TurnStep::Accept => self.relay_call(Some(i), Self::flush_pipelined),
                // `relay_call` ends the run on a lapsed lease after every step already.
                TurnStep::CheckLease => {}
                TurnStep::Releases => self.relay_call(Some(i), Self::process_releases),
                TurnStep::Status => self.status_update(i),
            }
        }
        self.relays[i].schedule = Some(schedule);
    }

    /// The loop's view of run `i` (`relay/mod.rs`'s `load_of`): the simulator's acceptance
    /// runs within its step, so none is ever running when the loop looks.
    fn load_of(&mut self, i: usize) -> Load {
        let (now, wall) = (ms(self.now), self.now_for(i).wall);
        let r = &mut self.relays[i];
        r.core
            .load_for(self.bounds, r.accepting.is_some(), now, wall)
    }

    /// The daemon's backpressure, as its loop decides it: the bounds (`Bounds::can_read`, which
    /// its `Schedule::can_read` asks) over the loop's view (`World::load_of`, the daemon's
    /// `load_of`: what waits on unclear outcomes sampled, and counted where it matters).
    fn can_read(&mut self, i: usize) -> bool {
        let load = self.load_of(i);
        self.bounds.can_read(&load)
    }

    /// Runs a relay operation; an error ends that run (salvage, then a new run may start).
    fn relay_call(
        &mut self,
        i: Option<usize>,
        f: impl FnOnce(&mut World, usize) -> Result<(), End>,
    ) {
        let Some(i) = i else { return };
        match f(self, i) {
            Err(e) => self.end_run(i, e),
            Ok(()) if self.relays[i].core.lease_expired => self.end_run(i, LEASE_LOST),
            Ok(()) => {}
        }
    }

    fn end_run(&mut self, i: usize, why: End) {
        let r = &mut self.relays[i];
        if r.salvaging || r.killed {
            return;
        }
        let why = match why {
            End::Error(why) => why,
            End::Unclear(why) => {
                self.c.unclear_restarts += 1;
                why
            }
        };
        log!(
            self,
            "relay gen {} run ends: {why}; salvaging",
            self.relays[i].gen
        );
        self.relays[i].salvaging = true;
        // Its producer is closed: what it held back lands now or never (a salvage reports it
        // possibly persisted).
        self.producer_gone(self.relays[i].gen);
        let end = RunEnd::new(Ending::Salvage, &mut self.relays[i].core);
        self.relays[i].end = Some(end);
        // Salvage waits for delivery reports only: the answers of running look-ups are lost
        // with the run (their attempts stay open for the next start).
        self.relays[i].lookups.clear();
    }

    /// `Pipeline::end_run` for a salvage, in the core's order (`lifecycle::RunEnd`): record
    /// what the broker already confirmed, send nothing, do not move the checkpoint.
    /// Outstanding reports arrive within the grace period, or not at all. A paused run goes on
    /// when it resumes.
    fn salvage(&mut self, i: usize) {
        while !self.relays[i].paused {
            let r = &mut self.relays[i];
            let end = r.end.as_mut().expect("a salvaging run has its end");
            match end.next(&r.core) {
                EndStep::AwaitReport if r.in_flight.is_empty() => end.grace_over(),
                EndStep::AwaitReport => {
                    if self.faults && self.rng.chance(150) {
                        // The grace period is over.
                        let end = self.relays[i].end.as_mut().expect("checked");
                        end.grace_over();
                        continue;
                    }
                    let token = self.relays[i].in_flight[0].token;
                    if self.on_report(i, token).is_err() {
                        log!(self, "salvage stopped by an error");
                        self.relays.remove(i);
                        return;
                    }
                    if self.relays[i].killed {
                        self.relays.remove(i);
                        return;
                    }
                }
                EndStep::Accept { track } => {
                    let _ = self.flush(i, track);
                }
                // A salvage confirms nothing.
                EndStep::Confirm => {}
                EndStep::Done => {
                    log!(self, "relay gen {} ended", self.relays[i].gen);
                    self.relays.remove(i);
                    return;
                }
            }
        }
    }

    fn sigkill(&mut self, i: usize) {
        log!(
            self,
            "SIGKILL relay gen {} ({} in flight)",
            self.relays[i].gen,
            self.relays[i].in_flight.len()
        );
        self.relays[i].killed = true;
        self.producer_gone(self.relays[i].gen);
        if self.relays[i].gen == self.ledger.lease_gen {
            self.holder_killed = true;
        }
        self.c.relay_crashes += 1;
    }

    /// The operator stops relay `i` (SIGTERM). A CDC run ends as the product's `RunEnd` with
    /// `Ending::Stop` says (the daemon's `drain_and_stop`): outstanding reports awaited until
    /// the grace is over, the batch accepted with its checkpoint, the slot confirmed up to it.
    /// A poll run stops at its loop's next round (`PollRun` says `Stop` between rounds, and a
    /// round is one step here). Then the run gives the lease back (`lease::release`) and its
    /// process exits; an error on the way ends the run as any error does (salvage).
    fn stop_relay(&mut self, i: usize) {
        let r = &self.relays[i];
        if r.paused || r.salvaging || r.killed {
            return;
        }
        log!(self, "relay gen {} told to stop", r.gen);
        self.c.relay_stops += 1;
        let ended = if self.poll {
            let r = &mut self.relays[i];
            let now = ms(self.now.saturating_sub(r.started));
            let run = r
                .poll_run
                .as_mut()
                .expect("stops run in the product's poll loop");
            match run.next(&mut r.core, now, true) {
                RoundStep::Stop => Ok(()),
                _ => Err(End::Error("a poll run asked to stop inside a round")),
            }
        } else {
            self.stop_stream(i)
        };
        if let Err(e) = ended {
            return self.end_run(i, e);
        }
        if self.relays[i].killed || self.relays[i].salvaging {
            return;
        }
        let gen = self.relays[i].gen;
        if self.ledger.lease_gen == gen && self.now <= self.ledger.lease_until {
            self.ledger.lease_until = self.now.saturating_sub(1);
        }
        log!(self, "relay gen {gen} stopped: lease released");
        // Its process exits: removed at the end of the step, as a SIGKILLed one is (its lease
        // is already free, so nobody takes it early).
        self.relays[i].killed = true;
        self.producer_gone(gen);
    }

    /// `drain_and_stop`: a CDC run's end by `RunEnd` with `Ending::Stop`.
    fn stop_stream(&mut self, i: usize) -> Result<(), End> {
        let mut end = RunEnd::new(Ending::Stop, &mut self.relays[i].core);
        loop {
            match end.next(&self.relays[i].core) {
                EndStep::AwaitReport if self.relays[i].in_flight.is_empty() => end.grace_over(),
                EndStep::AwaitReport => {
                    if self.faults && self.rng.chance(150) {
                        // The grace is over: what is still at the broker is sent again by
                        // the next run.
                        end.grace_over();
                        continue;
                    }
                    let token = self.relays[i].in_flight[0].token;
                    self.on_report(i, token)?;
                }
                EndStep::Accept { track } => self.flush(i, track)?,
                EndStep::Confirm => self.status_update(i),
                EndStep::Done => return Ok(()),
            }
            if self.relays[i].core.lease_expired {
                return Err(LEASE_LOST);
            }
        }
    }

    // -------------------------------------------------------------------------- producers

    fn destination(&self, agg: Agg, topic: usize, route_gen: i64) -> Destination {
        Destination {
            kind: "kafka".into(),
            cluster: TOPICS[topic].0.into(),
            topic: TOPICS[topic].1.into(),
            key: format!("o-{agg}"),
            partitioner: "murmur2_random".into(),
            route_generation: route_gen,
            serializer: "json".into(),
            acks: "all".into(),
        }
    }

    fn new_id(&mut self) -> Uuid {
        uuid::Builder::from_random_bytes(
            (u128::from(self.rng.next_u64()) << 64 | u128::from(self.rng.next_u64())).to_be_bytes(),
        )
        .into_uuid()
    }

    /// The row a writer inserts for `agg`: through `outbox.enqueue` with `version`, or, for a
    /// plain aggregate, plainly: no version (`version_by_relay`, 0 as decoded), which the
    /// relay gives it in commit order.
    fn enqueue(&mut self, agg: Agg, business: u64, version: i64) -> OutboxEvent {
        let (topic, gen) = self.route();
        let destination = self.destination(agg, topic, gen);
        let payload = Bytes::from(format!("{{\"business\": {business}}}"));
        let plain = self.plain[agg as usize] && version >= self.plain_from[agg as usize];
        OutboxEvent {
            version_by_relay: plain,
            ..OutboxEvent::frozen(
                self.new_id(),
                (
                    "order",
                    &format!("o-{agg}"),
                    if plain { 0 } else { version },
                ),
                "order.changed",
                payload,
                destination,
            )
        }
    }

    /// One business transaction: 1–3 events, committed or rolled back (a crash before COMMIT
    /// is a rollback). Versions are allocated under the aggregate's lock, so only committed
    /// transactions consume them. For a plain aggregate nothing is allocated in the writer's
    /// transaction, but the count kept here is the same: each committed row's rank among its
    /// aggregate's committed rows (transactions commit one at a time, in this order), the
    /// version the relay must give it.
    fn producer_txn(&mut self) {
        let n = self.rng.range(1, 4);
        let mut versions = self.agg_version.clone();
        let mut evs = Vec::new();
        for _ in 0..n {
            let agg = self.rng.below(u64::from(AGGREGATES)) as Agg;
            versions[agg as usize] += 1;
            let business = self.business_next;
            self.business_next += 1;
            let ev = self.enqueue(agg, business, versions[agg as usize]);
            evs.push((agg, business, ev, versions[agg as usize]));
        }
        self.next_lsn += self.rng.range(16, 200);
        if self.faults && self.rng.chance(120) {
            log!(self, "producer txn of {n} events rolled back");
            self.c.rolled_back += 1;
            return;
        }
        self.agg_version = versions;
        let end = Lsn(self.next_lsn);
        let mut ids = Vec::new();
        for (agg, business, ev, version) in evs {
            log!(
                self,
                "commit {} o-{agg} v{version}{} -> {}/{} at {end}",
                ev.event_id,
                if ev.version_by_relay { " (plain)" } else { "" },
                ev.destination.cluster,
                ev.destination.topic
            );
            ids.push(self.commit_row(ev, version, agg, business, end));
        }
        self.wal.push((end, ids));
        self.next_lsn += 8;
    }

    /// A committed outbox row, `version` its rank among its aggregate's; returns its index.
    fn commit_row(
        &mut self,
        ev: OutboxEvent,
        version: i64,
        agg: Agg,
        business: u64,
        end: Lsn,
    ) -> usize {
        let row = self.rows.len();
        self.by_id.insert(ev.event_id, row);
        // The version in force when the row was enqueued (in the same step).
        let route_version = self.route_versions.len() - 1;
        let plain = ev.version_by_relay;
        self.c.plain_events += u64::from(plain);
        self.rows.push(Row {
            ev,
            version,
            plain,
            agg,
            commit_end: end,
            business,
            route_version,
            migrations: Vec::new(),
            purged: false,
            last_send: 0,
        });
        self.c.events += 1;
        row
    }

    /// The commit ACK was lost; the business command is retried with the same business key.
    /// The business row exists, so nothing is enqueued again (the mutant enqueues anew).
    fn producer_retry(&mut self) {
        if self.rows.is_empty() {
            return;
        }
        let r = self.rng.below(self.rows.len() as u64) as usize;
        if !self.is(Mutant::ProducerNewId) {
            return;
        }
        let agg = self.rows[r].agg;
        let business = self.rows[r].business;
        self.agg_version[agg as usize] += 1;
        let version = self.agg_version[agg as usize];
        let ev = self.enqueue(agg, business, version);
        self.next_lsn += 64;
        let end = Lsn(self.next_lsn);
        let row = self.commit_row(ev, version, agg, business, end);
        self.wal.push((end, vec![row]));
    }

    /// The route policy in force: (topic index, route generation).
    fn route(&self) -> (usize, i64) {
        let (topic, gen, _) = *self.route_versions.last().expect("version 0 always exists");
        (topic, gen)
    }

    fn route_change(&mut self) {
        let gen = self.route().1 + 1;
        let topic = if self.faults {
            [0, 1, 1, 2, 3][self.rng.below(5) as usize]
        } else {
            0
        };
        // Aggregates written plainly go to refusing topics too since a release publishes a
        // held plain row with the version its held record kept (migration 0042).
        log!(
            self,
            "route policy generation {gen} -> {}/{}",
            TOPICS[topic].0,
            TOPICS[topic].1
        );
        self.route_versions.push((topic, gen, Lsn(self.next_lsn)));
        let route = self.current_route();
        for r in &mut self.relays {
            r.core.plant.current_route = Some(route.clone());
        }
    }

    /// The decode of row `r` by run `i` (`outbox_source::decode`): a narrow row's destination
    /// rendered from the route version it names, the digest computed from it, as the relay
    /// does. The run knows every version committed before its start (read at start) and, from
    /// the stream, every one committed before the row (a version precedes the rows naming it).
    fn decoded(&mut self, i: usize, r: usize) -> OutboxEvent {
        let row = &self.rows[r];
        let v = if self.is(Mutant::RenderCurrentRoute) {
            self.route_versions.len() - 1
        } else {
            row.route_version
        };
        let (topic, gen, committed) = self.route_versions[v];
        let streamed = !self.is(Mutant::VersionsOnlyAtStart) && committed <= row.commit_end;
        if v >= self.relays[i].versions_at_start && !streamed {
            self.c.unknown_route_versions += 1;
            log!(
                self,
                "UNKNOWN ROUTE VERSION {v} for {} (run {})",
                row.ev.event_id,
                self.relays[i].gen
            );
        }
        let mut ev = row.ev.clone();
        ev.destination = self.destination(row.agg, topic, gen);
        ev.destination_digest = ev.destination.digest();
        ev
    }

    // ---------------------------------------------------------------------------- the relay

    fn start_relay(&mut self) {
        if self.active().is_some() {
            return;
        }
        // Take the lease by CAS: free, expired, or our own (a new run of the process whose run
        // ended). A paused holder keeps it until it expires: standbys wait. A SIGKILLed
        // holder's lease session (its advisory lock) and walsender went with its process: the
        // lease is taken at once (`lease::try_acquire`'s early takeover, migration 0018).
        let holder_alive = self.relays.iter().any(|r| r.gen == self.ledger.lease_gen);
        let live = self.now <= self.ledger.lease_until;
        // The product's rule (`outbox_core::lease`, `lease::try_acquire`'s statement): a live
        // holder's session lock is not the taker's, and its walsender streams the slot.
        let facts = LeaseFacts {
            free: self.ledger.lease_gen == 0,
            expired: !live,
            ours: false,
            taker_locked: !holder_alive,
            holder_locks: true,
            slot_active: holder_alive,
        };
        let take = if self.is(Mutant::EarlyTakeoverOfLiveHolder) {
            TakeoverRule::without_proof().take(facts)
        } else {
            lease::take(facts)
        };
        if take == Take::Held {
            self.now = self.ledger.lease_until + 1;
            self.land_late_appends();
        } else if live && (self.holder_killed || holder_alive) {
            log!(
                self,
                "lease taken over early from gen {}",
                self.ledger.lease_gen
            );
            self.c.early_takeovers += 1;
        }
        self.holder_killed = false;
        self.ledger.lease_gen += 1;
        self.ledger.lease_until = self.now + LEASE_TTL;
        let gen = self.ledger.lease_gen;
        // The new holder terminates any walsender still attached to the slot.
        for r in &mut self.relays {
            r.stream_cut = true;
        }
        if self.poll {
            return self.start_poll_relay(gen);
        }
        let slot_info = self.slot_confirmed.map(|c| SlotInfo {
            plugin: "pgoutput".into(),
            database: "sim".into(),
            active_pid: None,
            wal_status: Some("reserved".into()),
            confirmed_flush: Some(c),
        });
        let ledger_view = self.ledger.checkpoint.map(|c| LedgerView {
            checkpoint: c,
            snapshot_done: self.ledger.snapshot_done,
            system_identifier: Some("sim".into()),
        });
        let plan = match slot::plan(
            "sim_slot",
            "sim",
            "sim",
            slot_info.as_ref(),
            ledger_view.as_ref(),
            self.resnapshot,
        ) {
            Ok(plan) => plan,
            Err(e) if self.slot_lost => {
                // The correct refusal: the ledger names a slot that is gone. The operator
                // reads the error and restarts with --resnapshot.
                log!(
                    self,
                    "relay refused to start: {e}; the operator runs --resnapshot"
                );
                self.resnapshot = true;
                return;
            }
            Err(e) => {
                log!(self, "relay refused to start: {e}");
                self.c.start_refused = 1;
                return;
            }
        };
        // As the daemon's `run_once`: the plan's decision, then `CdcStart`'s steps in order. A
        // new slot's consistent point is the next WAL position: everything committed before
        // it is read from the table's snapshot, everything after it from the slot.
        // A slot created now has its position at the end of the WAL.
        let (slot_start, start) = (
            plan.slot_start(),
            plan.start().unwrap_or(Lsn(self.next_lsn)),
        );
        let cursor = self.wal_after(start);
        log!(
            self,
            "relay gen {gen} starts at {start} (WAL txn #{cursor})"
        );
        let i = self.push_run(gen, Some(start), cursor);
        let mut steps = CdcStart::new(slot_start);
        loop {
            let done = match steps.next(&self.relays[i].core) {
                // `refuse_new_slot_over_plain_rows`: the outbox holds a row written without a
                // version (not purged: purge deletes it).
                CdcStep::RefusePlainRows => {
                    if self.rows.iter().any(|r| r.plain && !r.purged) {
                        log!(
                            self,
                            "relay refused to start: a new slot, an adopted one or an unfinished snapshot over rows written without a version"
                        );
                        self.c.start_refused = 1;
                        // As a refused plan: no run (nothing was done in its name yet).
                        self.relays.pop();
                        return;
                    }
                    Ok(())
                }
                CdcStep::DropSlot => {
                    self.slot_confirmed = None;
                    self.slot_by_interloper = false;
                    Ok(())
                }
                CdcStep::CreateSlot => {
                    self.slot_confirmed = Some(start);
                    self.slot_by_interloper = false;
                    self.ledger.snapshot_done = false;
                    if matches!(plan, StartPlan::Recreate { .. }) {
                        log!(self, "--resnapshot: slot recreated at {start}");
                        self.slot_lost = false;
                        self.c.resnapshots += 1;
                    }
                    Ok(())
                }
                CdcStep::RecordSlot => {
                    self.ledger.checkpoint = Some(start);
                    // As the daemon: `--resnapshot` stays asked until the new slot is recorded.
                    self.resnapshot = false;
                    Ok(())
                }
                CdcStep::Start(StartStep::Snapshot) => match self.snapshot(i) {
                    Ok(()) if self.relays[i].core.lease_expired => {
                        Err(End::Error("lease expired during the snapshot"))
                    }
                    done => done,
                },
                CdcStep::Start(step) => self.start_step(i, step),
                // The simulated lease cut every other run's stream when it was taken.
                CdcStep::TakeOverSlot => Ok(()),
                // `numbering::fold_at_start`: what earlier runs logged, into the map this run
                // reads.
                CdcStep::FoldNumbering => {
                    self.ledger.fold_numbering_log();
                    Ok(())
                }
                CdcStep::Stream => return self.start_streaming(i, &steps, start),
            };
            if let Err(e) = done {
                return self.end_run(i, e);
            }
        }
    }

    /// The first WAL transaction a stream from `lsn` delivers (every one committed after it).
    fn wal_after(&self, lsn: Lsn) -> usize {
        self.wal
            .iter()
            .position(|(end, _)| *end > lsn)
            .unwrap_or(self.wal.len())
    }

    /// `START_REPLICATION` at `start`, then the slot, now held, read again and checked by
    /// the product (`CdcStart::check_held`). At times the slot was dropped and recreated
    /// behind the relay's back after its plan read it: PostgreSQL streams from the later of
    /// the requested position and the slot's own, so a run that did not refuse it would
    /// skip what was committed in between (`held-slot-unchecked`: `lost`).
    fn start_streaming(&mut self, i: usize, steps: &CdcStart, start: Lsn) {
        if self.slot_replacer.as_mut().is_some_and(|d| d.chance(250)) {
            log!(
                self,
                "the slot is dropped and recreated behind the relay's back at {} before START_REPLICATION",
                Lsn(self.next_lsn)
            );
            self.slot_confirmed = Some(Lsn(self.next_lsn));
            self.slot_by_interloper = true;
        }
        match steps.check_held(&self.relays[i].core, start, self.slot_confirmed) {
            Err(at) => {
                log!(
                    self,
                    "relay refused to stream: the slot is at {at}, ahead of {start}; the operator runs --resnapshot"
                );
                self.c.slots_replaced += 1;
                // As after a lost slot: the next plan refuses the slot ahead of the ledger's
                // checkpoint, and the operator restarts with --resnapshot.
                self.slot_lost = true;
                self.end_run(i, End::Error("the slot was replaced before streaming"));
            }
            Ok(()) => {
                let from = self.slot_confirmed.map_or(start, |s| s.max(start));
                self.relays[i].cursor = self.wal_after(from);
            }
        }
    }

    /// `reconcile_at_start` of a poll-mode run: what `RunStart` asks, in its order.
    fn start_run(&mut self, i: usize) {
        let mut start = RunStart::new(false);
        loop {
            let done = match start.next(&self.relays[i].core) {
                StartStep::Snapshot | StartStep::Run => return,
                step => self.start_step(i, step),
            };
            if let Err(e) = done {
                return self.end_run(i, e);
            }
        }
    }

    /// `start_step`: one of `RunStart`'s steps before the snapshot.
    fn start_step(&mut self, i: usize, step: StartStep) -> Result<(), End> {
        match step {
            StartStep::RetryGenerations => {
                self.load_retry_generations(i);
                Ok(())
            }
            StartStep::ReconcileOpen => self.reconcile_attempts(i, When::Start),
            StartStep::RaiseHeads(known) => {
                self.raise_heads(i, known);
                Ok(())
            }
            StartStep::Snapshot | StartStep::Run => Err(End::Error("a start step the caller's")),
        }
    }

    /// A poll-mode run (`relay/poll.rs`): no slot plan, no snapshot (every round reads what
    /// has no receipt); reconciliation at start, then the heads as they are now.
    fn start_poll_relay(&mut self, gen: i64) {
        log!(self, "relay gen {gen} starts polling");
        let i = self.push_run(gen, None, self.wal.len());
        // Poll mode keeps the aggregates parked since the last round began (`run_once`).
        self.relays[i].core.unclear_touched = Some(Default::default());
        self.start_run(i);
    }

    /// `reconcile_at_start`: the heads of the aggregates `known` (the held ones the gate
    /// knows), read again after reconciliation.
    fn raise_heads(&mut self, i: usize, known: Vec<outbox_relay::AggKey>) {
        let heads = known
            .into_iter()
            .map(|k| {
                let head = self
                    .aggs_by_key(&k)
                    .map_or(0, |agg| self.head_of(agg, None));
                (k, head)
            })
            .collect();
        self.relays[i].core.raise_heads(heads);
    }

    /// The aggregate whose key is `k`, if any row has it.
    fn aggs_by_key(&self, k: &outbox_relay::AggKey) -> Option<Agg> {
        self.rows.iter().map(|r| r.agg).find(|a| agg_key(*a) == *k)
    }

    /// `outbox.aggregate_heads_of`: an aggregate's head as the ledger reads it, or an operator's
    /// move, whatever its version.
    ///
    /// * Whole (`below` absent: a snapshot, a release, the start's second read): the highest
    ///   version with a primary receipt, purged or not (migration 0026).
    /// * For the stream (`below`: the version met first), migration 0028's rule: the highest
    ///   version below it that exists, purged or not. Every event committed before the run's
    ///   start is resolved and one aggregate's versions commit in order, so what exists below
    ///   the version met is accepted or refused (and then held); no receipt is read.
    ///
    /// A head read too high is harmless to order (the gate keeps one event of an aggregate in
    /// flight whatever the head, and the stream brings versions in order); one read too low
    /// takes the version met for a gap: the mutant `heads-without-purged` forgets the purged
    /// rows, and events are lost or stall.
    fn head_of(&self, agg: Agg, below: Option<i64>) -> i64 {
        let existing = |below: i64| {
            self.rows
                .iter()
                .filter(|row| row.agg == agg && row.version < below)
                .filter(|row| !(row.purged && self.is(Mutant::HeadsWithoutPurged)))
                .map(|row| row.version)
                .max()
                .unwrap_or(0)
        };
        match below {
            Some(below) => existing(below).max(self.moved_head(agg)),
            None => self.published_head(agg, i64::MAX),
        }
    }

    /// Migration 0026's head: the highest version of `agg` below `below` with a primary
    /// receipt, purged or not, or an operator's move, whatever its version.
    fn published_head(&self, agg: Agg, below: i64) -> i64 {
        self.ledger
            .primary
            .keys()
            .map(|r| &self.rows[*r])
            .filter(|row| row.agg == agg && row.version < below)
            .map(|row| row.version)
            .max()
            .unwrap_or(0)
            .max(self.moved_head(agg))
    }

    /// `outbox.aggregate_heads`: the head an operator moved `agg` to (0 if none).
    fn moved_head(&self, agg: Agg) -> i64 {
        self.ledger.moved.get(&agg).copied().unwrap_or(0)
    }

    /// `Pipeline::learn_heads`: before the core meets row `row`'s aggregate for the first time,
    /// its head read from the ledger; from the stream (`below`: the version met bounds what is
    /// read) or from a snapshot (the whole head).
    fn learn_head(&mut self, i: usize, row: usize, stream: bool) {
        let ev = &self.rows[row].ev;
        if self.relays[i].core.knows_aggregate_of(ev) {
            return;
        }
        let below = stream.then_some(self.rows[row].version);
        let head = self.head_of(self.rows[row].agg, below);
        log!(
            self,
            "head of {} read: {head} (met v{}{})",
            agg_key(self.rows[row].agg).1,
            self.rows[row].version,
            if stream { ", below it" } else { "" }
        );
        let key = agg_key(self.rows[row].agg);
        self.relays[i].core.raise_heads(vec![(key, head)]);
    }

    /// A new run of generation `gen`: its core with the gate as the ledger left it (streaming
    /// from `start` in CDC mode); its start (`World::start_run`) follows. Returns its index.
    fn push_run(&mut self, gen: i64, start: Option<Lsn>, cursor: usize) -> usize {
        let held = self.ledger.holds.keys().map(|k| agg_key(*k)).collect();
        // Heads are read when the run first meets an aggregate (`learn_head`).
        let gate = PipelineCore::gate_from(Vec::new(), held);
        let plant = Planted {
            mutant: self.core_mutant(),
            current_route: Some(self.current_route()),
        };
        let mut core = PipelineCore::with_plant(served(), gen, gate, plant);
        core.set_aggregate_depth(self.depth);
        // `holds::skipped_events`, as `open_pipeline` loads them.
        core.skipped_by_operator(
            self.ledger
                .quarantine
                .iter()
                .filter(|q| q.skipped)
                .map(|q| self.rows[q.row].ev.event_id),
        );
        if let Some(start) = start {
            core.start_streaming(start);
        }
        // As `open_pipeline`: a Kafka scan waits out the settle time; where a look-up is itself
        // a re-send under the key (a duplicate window) it needs none (outside the window it is
        // a scan of an attempt sent longer ago than any request can still land).
        core.unclear_policy.settle = if self.dedup {
            std::time::Duration::ZERO
        } else {
            ms(SETTLE)
        };
        core.unclear_policy.budget = self.unclear_budget;
        // `--unknown-settle-ms`, as the daemon sets it.
        core.reconcile_settle = ms(SETTLE);
        core.unclear_policy.schedule = self.unclear_schedule;
        // The lease keeper's and the loop's plant: the mutant only.
        let timing_plant = Planted {
            mutant: self.core_mutant(),
            current_route: None,
        };
        self.relays.push(Relay {
            held_by_unclear_since: None,
            gen,
            killed: false,
            keeper: LeaseKeeper::planted(
                ms(LEASE_TTL),
                ms(self.now),
                ms(self.now),
                true,
                timing_plant.clone(),
            ),
            renewal: None,
            schedule: self
                .loop_timing
                .map(|settings| Schedule::planted(settings, ms(self.now), timing_plant)),
            accepting: None,
            paused: false,
            stream_cut: false,
            salvaging: false,
            end: None,
            core,
            cursor,
            in_flight: Vec::new(),
            late: HashSet::new(),
            proven: HashSet::new(),
            started: self.now,
            versions_at_start: self.route_versions.len(),
            lookups: Vec::new(),
            // The daemon's defaults: `--poll-interval-ms` 100, releases every second (four
            // times as often where releases meet faults).
            poll_run: self.poll_loop.then(|| {
                let releases = if self.release_heavy { 250 } else { 1_000 };
                PollRun::new(ms(POLL_INTERVAL), ms(releases))
            }),
            idle_until: None,
            producer_fatal: false,
            tails: HashMap::new(),
            placement: if self.is(Mutant::DeepUnpinned) {
                Placement::Unpinned(outbox_core::placement::Placement::unpinned())
            } else {
                Placement::Product(Default::default())
            },
        });
        self.relays.len() - 1
    }

    /// What a read of unpublished rows knows about `row` (`OfferRule`'s facts).
    fn offer_facts(&self, row: usize) -> OfferFacts {
        // An open record blocks under any rule; a skip only under the product's.
        let quarantine = if self.ledger.open_quarantine(row).is_some() {
            Some(QuarantineState::Open)
        } else if self.ledger.skipped(row) {
            Some(QuarantineState::Skipped)
        } else {
            None
        };
        OfferFacts {
            published: self.ledger.primary.contains_key(&row),
            quarantine,
            aggregate_held: self.ledger.holds.contains_key(&self.rows[row].agg),
        }
    }

    /// `outbox_source::poll::pending_sql`: rows without a primary receipt or an open
    /// quarantine, of aggregates without a hold, in aggregate and version order, as
    /// `outbox.events_current` shows them. (The daemon reads them above each aggregate's poll
    /// position, which only passes receipted versions, so it reads exactly these. A read above
    /// the head instead lost events whose receipt was overtaken by a later version's: the
    /// mutant `poll-above-head`.)
    fn poll_pending(&self) -> Vec<usize> {
        let above_head = self.is(Mutant::PollAboveHead);
        let mut pending: Vec<usize> = (0..self.rows.len())
            .filter(|r| {
                let row = &self.rows[*r];
                let facts = self.offer_facts(*r);
                let offered = if self.is(Mutant::PollOffersSkipped) {
                    OfferRule::ignoring_skips().by_poll_round(facts)
                } else {
                    OfferRule::default().by_poll_round(facts)
                };
                !row.purged
                    && offered
                    && (!above_head
                        || row.version > self.ledger.heads.get(&row.agg).copied().unwrap_or(0))
            })
            .collect();
        pending.sort_by_key(|r| (self.rows[*r].agg, self.rows[*r].version));
        pending
    }

    /// A round starts only when nothing is at the broker and nothing is left to accept (the
    /// daemon's round drains and accepts before it reads: `drain_all(.., parked_may_stay)`); a
    /// parked event, and what waits behind it, may stay — the round skips its aggregate. The
    /// daemon also runs idle rounds every poll interval; of those, the simulator runs the ones
    /// that change something: a row of an aggregate the round would not skip
    /// (`PipelineCore::round_would_skip`: at the broker or parked; before 2026-12-07 parked
    /// ones counted, and a drain ran empty rounds instead of the parked event's due look-up
    /// until its iterations ran out: seed 2, traces 101870 and 916704), or a read newer
    /// than an open quarantine (which lets its migration go ahead).
    fn round_due(&self, i: usize) -> bool {
        let core = &self.relays[i].core;
        let read = self.ledger.poll_round.map(|(_, r)| r);
        core.in_flight() == 0
            && core.batch_len() == 0
            && (self
                .poll_pending()
                .iter()
                .any(|r| !core.round_would_skip(&agg_key(self.rows[*r].agg)))
                || self
                    .ledger
                    .quarantine
                    .iter()
                    .any(|q| !q.released && read.map_or(true, |r| r < q.recorded)))
    }

    /// `MigrationFacts::replayable` in poll mode: the round of the live lease read the events
    /// before `row`'s open quarantine was recorded, so it may still hold the row.
    fn poll_round_may_hold(&self, row: usize) -> bool {
        self.ledger
            .open_quarantine(row)
            .is_some_and(|q| self.poll_round_missed(q.recorded))
    }

    /// `outbox.poll_round_missed`: the current round of the live lease read before `tick`.
    fn poll_round_missed(&self, tick: u64) -> bool {
        self.ledger.poll_round.is_some_and(|(gen, read)| {
            gen == self.ledger.lease_gen && self.now <= self.ledger.lease_until && read < tick
        })
    }

    /// One poll round's reads and sends; its reports and acceptance are later steps.
    fn poll_round(&mut self, i: usize) -> Result<(), End> {
        if !self.round_due(i) {
            return Ok(());
        }
        // Which poll positions to advance is the core's; the model reads by the ledger's
        // receipts, which is what an advance over the receipted prefix reads.
        let _advance = self.relays[i].core.begin_poll_round(ms(self.now));
        self.poll_read(i, false).map(|_| ())
    }

    /// The next step of a poll-mode run's loop, the product's (`PollRun`, as the daemon's
    /// `relay/poll.rs` executes it; `World::poll_loop`); nothing while it waits.
    fn poll_step(&mut self, i: usize) -> Result<(), End> {
        let r = &mut self.relays[i];
        if r.idle_until.is_some_and(|t| self.now < t) {
            return Ok(());
        }
        r.idle_until = None;
        let now = ms(self.now.saturating_sub(r.started));
        let mut run = r.poll_run.take().expect("a poll loop's run");
        let step = run.next(&mut r.core, now, false);
        log!(self, "poll loop: {step:?}");
        let done = match step {
            // The simulated relay is never asked to stop; a run ends by error or SIGKILL.
            RoundStep::Stop => Ok(()),
            RoundStep::DrainBefore | RoundStep::DrainAfter => match self.drain_read(i, true) {
                Ok(false) => self.read_stalled(i, "POLL ROUND"),
                other => other.map(|_| ()),
            },
            // The model reads by the ledger's receipts, which is what an advance over the
            // receipted prefix reads.
            RoundStep::Advance(_) => Ok(()),
            RoundStep::Read => self.poll_read(i, true).map(|n| run.read(n)),
            // `relay_call` ends the run on a lapsed lease after every step already.
            RoundStep::CheckLease | RoundStep::Status => Ok(()),
            RoundStep::Releases => self.process_releases(i),
            RoundStep::Idle { until } => {
                let r = &mut self.relays[i];
                r.idle_until = Some(r.started + until.as_millis() as u64);
                Ok(())
            }
        };
        self.relays[i].poll_run = Some(run);
        done
    }

    /// A round of the product's poll loop, whole: its steps until the loop waits or the next
    /// round would begin. Nothing else of this run happens between them, as in the daemon,
    /// whose round handles reports, look-ups and due resends only where it waits (its drains
    /// and the pace after each row); between rounds, while the loop waits, the world's steps
    /// deliver them.
    fn poll_round_of_steps(&mut self, i: usize) -> Result<(), End> {
        self.relays[i].idle_until = None;
        for _ in 0..8 {
            self.poll_step(i)?;
            let r = &self.relays[i];
            if r.killed || r.salvaging || r.core.lease_expired || r.idle_until.is_some() {
                break;
            }
        }
        Ok(())
    }

    /// `Pipeline::admit_rows`: the rows of a read (`rows`, in the read's order) to the core as
    /// the product cuts them (`outbox_relay::read::Chunks`): the heads of a chunk's aggregates
    /// the gate does not know read first (not under `poll-no-head-floor` in a poll round), then
    /// each row admitted by the read's rules (`PipelineCore::admit_read`), `admitted` told, its
    /// commands executed, and the pace kept after it. Between two rows of a poll round the
    /// daemon's pace may wait for what resolves an aggregate the round read as pending
    /// (`World::round_waits`). `false`: the pace waited for something nothing will move.
    fn admit_read_rows(
        &mut self,
        i: usize,
        read: Read,
        rows: Vec<usize>,
        mut admitted: impl FnMut(&mut World, usize, usize, &ReadAdmitted),
    ) -> Result<bool, End> {
        let mut chunks = Chunks::default();
        // The rows a chunk holds, in the order offered.
        let mut queue = rows.clone().into_iter();
        for next in rows.into_iter().map(Some).chain(std::iter::once(None)) {
            let chunk = match next {
                Some(row) => match chunks.offer(Ok(self.rows[row].current())) {
                    Some(chunk) => chunk,
                    None => continue,
                },
                None => chunks.end(),
            };
            let in_chunk: Vec<usize> = queue.by_ref().take(chunk.len()).collect();
            if read == Read::Snapshot || !self.is(Mutant::PollNoHeadFloor) {
                for &row in &in_chunk {
                    self.learn_head(i, row, false);
                }
            }
            for (row, ev) in in_chunk.into_iter().zip(chunk) {
                if read == Read::PollRound && !self.round_may_wait(i)? {
                    return Ok(true);
                }
                let now = self.now_for(i);
                let a = self.relays[i]
                    .core
                    .admit_read(read, ev, now)
                    .map_err(|_| End::Error("relay core: admit_read"))?;
                admitted(self, i, row, &a);
                if let ReadAdmitted::Admitted(commands) = a {
                    self.execute(i, commands)?;
                }
                if !self.keep_pace(i)? {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// A poll round's read (the round has begun: `begin_poll_round`): the pending rows read
    /// and recorded, each admitted as the core decides, pacing after each. `chunked`: the
    /// heads of the rows' aggregates the gate does not know are read before any row is
    /// admitted, as the daemon's `admit_rows` reads them per chunk (a round here is never
    /// longer than one); otherwise each just before its row. Returns how many rows it read.
    fn poll_read(&mut self, i: usize, chunked: bool) -> Result<u64, End> {
        // `poll::RECORD_ROUND_SQL`: the round's read, as the ledger records it.
        let read = self.ledger.tick();
        self.ledger.poll_round = Some((self.relays[i].gen, read));
        let pending = self.poll_pending();
        log!(self, "poll round: {} pending rows", pending.len());
        // What this run had seen on the broker when the round read: a row read as pending
        // after that is read again by design (not `resent_after_proof`: its receipt did not
        // make it a published row, e.g. a destination migrated since); one proven while the
        // round goes on is not, nor one whose receipt the run still held unaccepted (the read
        // came before the round's drain).
        let unaccepted: HashSet<Uuid> = self.relays[i]
            .core
            .batched_receipts()
            .map(|r| r.event_id)
            .collect();
        let proven_at_read: HashSet<usize> = self.relays[i]
            .proven
            .iter()
            .copied()
            .filter(|r| !unaccepted.contains(&self.rows[*r].ev.event_id))
            .collect();
        // What was sent since the last round is reported and accepted before the read (the
        // round is due only then, or the product's loop drained first:
        // `RoundStep::DrainBefore`); which rows are admitted, and the head each raises, is
        // the core's (`outbox_relay::poll`).
        let n = pending.len() as u64;
        if chunked {
            // The daemon's `admit_rows`: heads per chunk first, pace after every row.
            let settled =
                self.admit_read_rows(i, Read::PollRound, pending, |w, i, row, admitted| {
                    if matches!(admitted, ReadAdmitted::Admitted(_)) {
                        // Read again by this round: as a replay (`decode_next`), not
                        // `resent_after_proof`, unless proven after the read.
                        if proven_at_read.contains(&row) {
                            w.relays[i].proven.remove(&row);
                        }
                        w.c.poll_events += 1;
                    }
                })?;
            if !settled {
                self.read_stalled(i, "POLL ROUND")?;
            }
            return Ok(n);
        }
        for row in pending {
            // `keep_pace`: between rows the daemon's round waits at times (`wait_one`), and
            // what it waits for may resolve an aggregate the round read as pending: a parked
            // event coming due and sent again, its report, a look-up's answer.
            if !self.round_may_wait(i)? {
                return Ok(n);
            }
            let ev = self.rows[row].current();
            // `learn_heads`, per chunk in the daemon: the ledger's head of an aggregate the
            // gate does not know, below the round's own floor.
            if !self.is(Mutant::PollNoHeadFloor) {
                self.learn_head(i, row, false);
            }
            let now = self.now_for(i);
            let polled = self.relays[i]
                .core
                .admit_polled(ev, now)
                .map_err(|_| End::Error("relay core: admit_polled"))?;
            if let outbox_relay::poll::Polled::Admitted { commands, .. } = polled {
                // Read again by this round: as a replay (`decode_next`), not
                // `resent_after_proof`, unless proven after the read.
                if proven_at_read.contains(&row) {
                    self.relays[i].proven.remove(&row);
                }
                self.c.poll_events += 1;
                self.execute(i, commands)?;
                if !self.keep_pace(i)? {
                    return self.read_stalled(i, "POLL ROUND").map(|()| n);
                }
            }
        }
        Ok(n)
    }

    /// A look-up starts (on its own task in the daemon; it answers at a later step): counted
    /// in `concurrent_lookups` if this run is already looking the event up (two look-ups of
    /// one event race: under a key, two re-sends of it).
    fn push_lookup(&mut self, i: usize, lookup: PendingLookup) {
        let id = lookup.event.event_id;
        if self.relays[i]
            .lookups
            .iter()
            .any(|l| l.event.event_id == id)
        {
            log!(self, "SECOND look-up of {id} while one is outstanding");
            self.c.concurrent_lookups += 1;
        }
        self.relays[i].lookups.push(lookup);
    }

    /// Between two rows of a poll round: under faults, while something can resolve an
    /// aggregate the round read as pending (a parked event, a look-up), the round may wait
    /// for one thing first (`World::round_waits`, on its own stream). `false`: the run ended.
    fn round_may_wait(&mut self, i: usize) -> Result<bool, End> {
        if self.faults
            && (self.relays[i].core.parked() > 0 || !self.relays[i].lookups.is_empty())
            && self.round_waits.chance(250)
        {
            self.round_waits(i)?;
            return Ok(!self.relays[i].killed && !self.relays[i].core.lease_expired);
        }
        Ok(true)
    }

    /// `Pipeline::wait_one` inside a poll round: one delivery report, a parked event that is
    /// due, or a look-up's answer, whichever there is (drawn).
    fn round_waits(&mut self, i: usize) -> Result<(), End> {
        let mut choices = Vec::new();
        if !self.relays[i].in_flight.is_empty() {
            choices.push(0);
        }
        if self.unclear_due(i) {
            choices.push(1);
        }
        if !self.relays[i].lookups.is_empty() {
            choices.push(2);
        }
        if choices.is_empty() {
            return Ok(());
        }
        let r = &mut self.round_waits;
        match choices[r.below(choices.len() as u64) as usize] {
            0 => {
                let k = r.below(self.relays[i].in_flight.len() as u64) as usize;
                let token = self.relays[i].in_flight[k].token;
                self.on_report(i, token)
            }
            1 => self.run_due_unclear(i),
            _ => {
                let k = r.below(self.relays[i].lookups.len() as u64) as usize;
                self.on_lookup(i, k)
            }
        }
    }

    /// `publish_snapshot`: every row of the outbox table without a primary receipt, an open
    /// quarantine or a skip, in aggregate and version order, admitted without an ack token (the slot
    /// will not stream them); every report awaited; the batch accepted without a checkpoint;
    /// then the ledger marks the snapshot done. The rows are read as `outbox.events_current`
    /// shows them: with their latest destination migration.
    fn snapshot(&mut self, i: usize) -> Result<(), End> {
        let mut pending: Vec<usize> = (0..self.rows.len())
            .filter(|r| {
                !self.rows[*r].purged && OfferRule::default().by_snapshot(self.offer_facts(*r))
            })
            .collect();
        pending.sort_by_key(|r| (self.rows[*r].agg, self.rows[*r].version));
        log!(self, "snapshot: {} unpublished rows", pending.len());
        let settled = self.admit_read_rows(i, Read::Snapshot, pending, |w, _, _, admitted| {
            if matches!(admitted, ReadAdmitted::Admitted(_)) {
                w.c.snapshot_events += 1;
            }
        })?;
        // `drain_all`: every admitted event resolved — reported on, or parked and then looked
        // up or sent again.
        if !settled || !self.drain_read(i, false)? {
            self.read_stalled(i, "SNAPSHOT")?;
        }
        self.ledger.snapshot_done = true;
        Ok(())
    }

    /// `wait_one` inside a wait that began at `since`: `false` when nothing can arrive, or once
    /// the wait is past [`WAITS_FOREVER_AFTER`] (the daemon's would never end).
    fn waited(&mut self, i: usize, since: u64) -> Result<bool, End> {
        Ok(self.wait_one(i)? && self.now <= since + WAITS_FOREVER_AFTER)
    }

    /// `Pipeline::keep_pace`: after a row of a read outside the stream, waits and accepts as
    /// the core's pace says (`PipelineCore::pace`, under this world's bounds). `false`: it
    /// waited for something nothing will ever move.
    fn keep_pace(&mut self, i: usize) -> Result<bool, End> {
        let waiting_since = self.now;
        loop {
            let wall = self.now_for(i).wall;
            match self.relays[i].core.pace(self.bounds, wall) {
                Pace::Go => return Ok(true),
                Pace::LeaseLost => return Err(LEASE_LOST),
                Pace::Accept => self.flush(i, false)?,
                Pace::Wait => {
                    if !self.waited(i, waiting_since)? {
                        return Ok(false);
                    }
                }
            }
        }
    }

    /// `Pipeline::drain_all`: at a read's end, waits and accepts as the core says
    /// (`PipelineCore::draining`) until nothing is left to wait for, then accepts the rest.
    /// `false`: it waited for something nothing will ever move.
    fn drain_read(&mut self, i: usize, parked_may_stay: bool) -> Result<bool, End> {
        let waiting_since = self.now;
        loop {
            let core = &self.relays[i].core;
            match core.draining(self.bounds.batch_size, parked_may_stay) {
                Drain::Accept => self.flush(i, false)?,
                Drain::Wait => {
                    if !self.waited(i, waiting_since)? {
                        return Ok(false);
                    }
                }
                Drain::Done => {
                    self.flush(i, false)?;
                    return Ok(true);
                }
                Drain::LeaseLost => return Err(LEASE_LOST),
            }
        }
    }

    /// A read that waits for what nothing will move: the daemon's would never end. Counted
    /// (`read_stalls`); what its batch holds is accepted, and the world goes on.
    fn read_stalled(&mut self, i: usize, read: &str) -> Result<(), End> {
        log!(
            self,
            "{read} STALLED: {} events never sent",
            self.relays[i].core.outstanding()
        );
        self.c.read_stalls += 1;
        self.flush(i, false)
    }

    /// The replication slot is gone (dropped by hand, or invalidated by
    /// `max_slot_wal_keep_size`) while the ledger still names it: the walsender's stream ends.
    fn lose_slot(&mut self) {
        if self.slot_confirmed.is_none() {
            return;
        }
        log!(self, "replication slot lost");
        self.slot_confirmed = None;
        self.slot_by_interloper = false;
        self.slot_lost = true;
        self.c.slot_losses += 1;
        // Every walsender streaming from it ends; a paused relay finds its stream ended when
        // it resumes.
        for i in 0..self.relays.len() {
            self.relays[i].stream_cut = true;
            self.end_run(i, End::Error("the replication stream ended: slot lost"));
        }
    }

    /// A renewal asked and answered in one step (the daemon's `spawn_lease_keeper`, with the
    /// product's keeper deciding what the answer means).
    fn renew(&mut self, i: usize) {
        self.ask_renewal(i);
        self.answer_renewal(i);
    }

    /// The keeper asks for a renewal: the ledger's `lease::renew` stamps it now (the lease is
    /// extended only if it is still this run's and unexpired); the answer is read later.
    fn ask_renewal(&mut self, i: usize) {
        let now = ms(self.now);
        let r = &mut self.relays[i];
        r.keeper.asking(now);
        let renewed = self.ledger.lease_gen == r.gen && self.now <= self.ledger.lease_until;
        if renewed {
            self.ledger.lease_until = self.now + LEASE_TTL;
        }
        r.renewal = Some(if renewed {
            Renewal::Renewed
        } else {
            Renewal::Refused
        });
    }

    /// The keeper reads the answer to its renewal.
    fn answer_renewal(&mut self, i: usize) {
        let now = ms(self.now);
        let r = &mut self.relays[i];
        if let Some(answer) = r.renewal.take() {
            r.keeper.answered(answer, now);
        }
    }

    /// `LeaseState::valid`: by the run's own keeper. That another generation took the lease
    /// is learned only at a renewal, as in the daemon.
    fn lease_valid(&self, i: usize) -> bool {
        self.relays[i].keeper.valid(ms(self.now))
    }

    /// `relay/unknown.rs`, while running: UNKNOWN attempts another generation recorded after
    /// this run started (a zombie's late report), once their settle time has passed; not those
    /// of events this run holds itself (parked, or left open at start): their own look-up
    /// resolves them.
    fn reconcile_settled(&mut self, i: usize) -> Result<(), End> {
        self.reconcile_attempts(i, When::Running)
    }

    /// `attempts::retry_generations`: the retry generations of events whose every attempt was
    /// proven absent (no receipt, every attempt ABSENT; the next send is the generation above
    /// them).
    fn load_retry_generations(&mut self, i: usize) {
        let mut retries: HashMap<usize, (bool, i32)> = HashMap::new();
        for at in &self.ledger.attempts {
            let e = retries.entry(at.row).or_insert((true, 0));
            e.0 &= at.state == AttemptState::Absent;
            e.1 = e.1.max(at.attempt);
        }
        for (row, (all_absent, last)) in retries {
            if all_absent && !self.ledger.primary.contains_key(&row) {
                let id = self.rows[row].ev.event_id;
                self.relays[i].core.retry_generation.insert(id, last + 1);
            }
        }
    }

    /// `unknown::reconcile_unknown`. At start nothing is looked up in line: every open
    /// attempt is handed to the run (`open_at_start`, due after what is left of its settle
    /// time): the replay parks its event when it reaches it, and its look-up runs beside
    /// everything else. While running, each settled attempt of another generation is looked
    /// up and what it proved recorded ([`World::record_lookup`]); a failed look-up is asked
    /// again at the next poll. Which is which is the core's (`PipelineCore::reconcile`).
    fn reconcile_attempts(&mut self, i: usize, when: When) -> Result<(), End> {
        // `attempts::open_unknown`: every open attempt, as the ledger has them now.
        let open: Vec<usize> = (0..self.ledger.attempts.len())
            .filter(|a| self.ledger.attempts[*a].state == AttemptState::Unknown)
            .collect();
        for a in open {
            let (row, relay_gen, unknown_at, sent_at) = {
                let at = &self.ledger.attempts[a];
                (at.row, at.relay_gen, at.unknown_at, at.sent_at)
            };
            let id = self.rows[row].ev.event_id;
            let open = unknown::Open {
                event_id: id,
                relay_generation: relay_gen,
                unknown_for: ms(self.now.saturating_sub(unknown_at)),
                has_receipt: self.ledger.primary.contains_key(&row),
                lookup_resends: self.lookup_resends(sent_at),
            };
            let gen = self.relays[i].gen;
            let now = std::time::SystemTime::UNIX_EPOCH + ms(self.now);
            // The settle time of `when` is the core's (the mutant no-settle too).
            match self.relays[i].core.reconcile(when, gen, &open, now) {
                Reconcile::Skip => continue,
                Reconcile::HandedToRun => {
                    log!(self, "UNKNOWN {id} open at start: the replay parks it");
                    self.c.open_at_start += 1;
                    continue;
                }
                Reconcile::LookUp => {}
                Reconcile::ClosedByReceipt => {
                    let (attempt, offset) = self.close_by_receipt(a);
                    self.relays[i].core.closed_by_receipt(id, attempt, offset);
                    continue;
                }
            }
            let mut event = self.rows[row].current();
            if self.rows[row].plain {
                if self.plain_lookups_as_daemon {
                    // The daemon before the fix: `unknown::load` read the row from SQL, which
                    // has no version and no route, `event_from_row` failed, the error was not
                    // transient, and the relay stopped (`World::plain_lookups_as_daemon`).
                    log!(
                        self,
                        "PLAIN ROW UNREADABLE: reconciliation cannot load {id} from SQL; the relay stops"
                    );
                    self.c.plain_rows_unreadable += 1;
                    return Err(End::Error("a plain row's event loaded from SQL"));
                }
                // `unknown::load` now: the row with the version (and route version) the relay
                // gave it, which the attempt kept (`outbox.attempts.relay_version`, 0039).
                event.aggregate_version = self.rows[row].version;
                self.c.plain_reconcile_lookups += 1;
            }
            // On a task of its own in the daemon: it answers at a later step
            // (`World::on_reconcile_lookup`), and the core skips the event's attempts until then.
            log!(self, "reconciliation's look-up of {id} started");
            self.push_lookup(
                i,
                PendingLookup {
                    event,
                    attempt: a,
                    prior: None,
                    published: self.ledger.primary.contains_key(&row),
                    reconciling: true,
                },
            );
        }
        Ok(())
    }

    /// `Sink::lookup_resends`: whether a look-up of an attempt sent at `sent_at` re-sends the
    /// event under its key (inside the served cluster's duplicate window, with a margin).
    fn lookup_resends(&self, sent_at: u64) -> bool {
        self.dedup && self.now.saturating_sub(sent_at) + DEDUP_MARGIN < DEDUP_WINDOW
    }

    /// `Sink::lookup` on the simulated broker for attempt `a` of `ev`, by run `i` (`published`:
    /// the event had its primary receipt when the look-up was decided): the scan of
    /// its frozen partition for a copy, or inside the duplicate window the re-send under its
    /// key (the answer names the stored copy, or the re-send was stored and is the retry: its
    /// position comes back as the probe's). `None`: the look-up failed (the topic cannot be
    /// read, or — a share of look-ups while faults last — it timed out); that proves nothing.
    fn look_up(
        &mut self,
        i: usize,
        a: usize,
        ev: &OutboxEvent,
        published: bool,
    ) -> Option<(Scan, Option<i64>, bool)> {
        // The broker holds what is due by now (some of the drain's steps move time on their
        // own).
        self.land_late_appends();
        let (row, topic, partition, sent_at) = {
            let at = &self.ledger.attempts[a];
            (at.row, at.topic, at.partition, at.sent_at)
        };
        if self.now < self.down_until[topic] || (self.faults && self.rng.chance(100)) {
            self.c.lookups_failed += 1;
            return None;
        }
        if self.lookup_resends(sent_at) {
            self.c.lookup_resends += 1;
            if published {
                // The destination had answered this key when the look-up was decided (the
                // receipt is its answer).
                log!(
                    self,
                    "RESENT {} by a look-up after its receipt",
                    ev.event_id
                );
                self.c.resent_published += 1;
            }
            if let Some(rc) = self.stored_copy(topic, ev.event_id) {
                return Some((
                    Scan::Found {
                        offset: rc.offset as i64,
                    },
                    None,
                    true,
                ));
            }
            let last = self.last_attempt(row);
            let probe = Msg {
                id: ev.event_id,
                row,
                version: ev.aggregate_version,
                dest_digest: ev.destination_digest.clone(),
                relay_gen: self.relays[i].gen,
                attempt: last + 1,
                stored_at: 0,
                seq: 0,
            };
            self.rows[row].last_send = self.now;
            let rc = self.store(topic, partition, probe);
            return Some((Scan::Absent, Some(rc.offset as i64), true));
        }
        Some((
            match self.broker[topic][partition]
                .iter()
                .position(|m| m.row == row)
            {
                Some(o) => Scan::Found { offset: o as i64 },
                None => Scan::Absent,
            },
            None,
            false,
        ))
    }

    /// `unknown::record_lookup`: what the look-up of attempt `a` of `ev` proved, by the rule
    /// (`outbox_relay::unknown::resolve`), recorded in the ledger before the caller tells the
    /// core: a found copy's receipt is accepted and the attempt resolved FOUND; an absence
    /// resolves it ABSENT (the next send is attempt generation + 1). Shared by reconciliation
    /// at start, while running, and the look-ups of parked events.
    fn record_lookup(
        &mut self,
        i: usize,
        a: usize,
        ev: &OutboxEvent,
        scan: Scan,
        probe: Option<i64>,
    ) -> Result<Resolved, End> {
        let (row, topic, partition, attempt, relay_gen) = {
            let at = &self.ledger.attempts[a];
            (at.row, at.topic, at.partition, at.attempt, at.relay_gen)
        };
        let last = self.last_attempt(row);
        let resolved = unknown::resolve(attempt, last, scan, probe);
        // What to write, and in which order: `outbox_relay::unknown::record`, as the daemon's
        // `unknown::record_lookup` (the simulated receipt carries no generations).
        let record = unknown::record(resolved, relay_gen, self.relays[i].gen);
        for write in record.writes() {
            let r = match write {
                unknown::Write::Resolve(found) => {
                    let state = match found {
                        Some(_) => AttemptState::Found,
                        None => AttemptState::Absent,
                    };
                    self.resolve_attempt(a, state);
                    continue;
                }
                unknown::Write::Receipt(r) => r,
            };
            let rc = Receipt {
                topic,
                partition,
                offset: r.offset as usize,
            };
            let items = vec![Item::Receipt {
                row,
                rc,
                version: ev.aggregate_version,
                payload_digest: ev.payload_digest.clone(),
                dest_digest: ev.destination_digest.clone(),
                late: false,
                position: None,
            }];
            // The look-up's receipt knows nothing of its row's position (the daemon's
            // `unknown::record_lookup` builds it without LSNs): what `receipt::raises` gives it.
            let raises = vec![(receipt::UNPOSITIONED_GENERATION, None)];
            self.accept(i, items, raises, None, Vec::new(), false)?;
            self.relays[i].proven.insert(row);
        }
        log!(
            self,
            "UNKNOWN {} (attempt {attempt}) at {}/{partition}: {resolved:?}",
            ev.event_id,
            TOPICS[topic].1
        );
        Ok(resolved)
    }

    /// One WAL transaction through the core's framing: Begin, each row, Commit (and a
    /// keepalive after the last one), through the stream's stage (`outbox_relay::stage`) as
    /// the daemon's stream loop does: a row of an aggregate the core does not know waits, with
    /// what follows it, for one look-up of the heads at the end of the transaction.
    fn decode_next(&mut self, i: usize) -> Result<(), End> {
        let (end, rows) = self.wal[self.relays[i].cursor].clone();
        self.relays[i].cursor += 1;
        // pgoutput's Begin names the commit record's LSN, the Commit the end of that record
        // (the position a checkpoint names): the commit record lies just before its end, so
        // a checkpoint at this transaction's end is past its commit LSN, and the numbering it
        // keeps covers this transaction (`outbox_core::numbering`: rows committed before C),
        // while a restart from it streams only the transactions ending after it.
        let commit = Lsn(end.0 - 1);
        let mut messages = vec![Staged::Begin(commit)];
        // Each row's change record lies before its commit record, in the order of the rows
        // (the same on every read of the transaction, as the WAL's are).
        let first_change = commit.0 - rows.len() as u64;
        for (k, r) in rows.into_iter().enumerate() {
            let ev = self.decoded(i, r);
            messages.push(Staged::Row(Box::new(Ok(ev)), Lsn(first_change + k as u64)));
        }
        messages.push(Staged::Commit(end));
        if self.relays[i].cursor == self.wal.len() {
            // A keepalive: nothing committed after the last transaction.
            // Where the loop is timed by the schedule, every other one asks for a reply (as
            // `wal_sender_timeout` makes the server do), without a draw from the trace's
            // generator.
            let reply_requested = self.loop_timing.is_some() && self.wal.len() % 2 == 0;
            messages.push(Staged::Keepalive {
                wal_end: Lsn(self.next_lsn),
                reply_requested,
            });
        }
        let mut stage = Stage::default();
        for m in messages {
            if let Some(m) = stage.offer(&self.relays[i].core, m) {
                self.take_message(i, m)?;
            }
        }
        if !stage.is_empty() {
            self.learn_heads(i, &stage);
            for m in stage.take() {
                self.take_message(i, m)?;
            }
        }
        Ok(())
    }

    /// `Pipeline::learn_heads` for the stream: the numbering of the staged plain rows'
    /// aggregates the core does not number yet (`numbering::versions_of`: what the slot's
    /// checkpoint kept, 0 for none), then the heads of the staged rows' aggregates the core
    /// does not know, each read below the version met first.
    fn learn_heads(&mut self, i: usize, stage: &Stage) {
        let unnumbered = self.relays[i].core.unnumbered_aggregates(stage.events());
        if !unnumbered.is_empty() {
            let seeds: Vec<_> = unnumbered
                .into_iter()
                .map(|key| {
                    let agg = self.aggs_by_key(&key).expect("a staged row's aggregate");
                    let mut kept = self.ledger.stream_versions.get(&agg).copied().unwrap_or(0);
                    // Or, where higher, the highest version a row of the aggregate was written
                    // with (kept or purged): its rows before the switch to plain INSERTs.
                    let written = self.rows.iter().filter(|r| r.agg == agg && !r.plain);
                    let written = written.map(|r| r.version).max().unwrap_or(0);
                    if written > kept && !self.is(Mutant::NumberingWithoutWrittenVersions) {
                        kept = written;
                        self.c.numberings_after_written += 1;
                    }
                    log!(self, "numbering of {} read: {kept}", key.1);
                    self.c.numberings_read += 1;
                    self.c.numberings_read_above_0 += u64::from(kept > 0);
                    (key, kept)
                })
                .collect();
            self.relays[i].core.seed_numbering(seeds);
        }
        let unknown = self.relays[i].core.unknown_aggregates(stage.events());
        let heads: Vec<_> = unknown
            .into_iter()
            .map(|(key, met)| {
                let agg = self.aggs_by_key(&key).expect("a staged row's aggregate");
                let head = self.head_of(agg, Some(met));
                log!(
                    self,
                    "head of {} read: {head} (met v{met}, below it)",
                    key.1
                );
                // Where the stream's rule (existence, migration 0028) reads above the receipts'
                // (0026): a version below the one met that is resolved without a receipt
                // (refused and held). Measured, not an invariant: the gate knows such an
                // aggregate's hold, and a wrong head shows as `lost` or `order_violations`.
                self.c.stream_heads_read += 1;
                let published = self.published_head(agg, met);
                if head > published {
                    self.c.stream_heads_above_receipts += 1;
                    log!(
                        self,
                        "head of {} read above its receipts' {published}: {head}",
                        key.1
                    );
                }
                (key, head)
            })
            .collect();
        self.relays[i].core.raise_heads(heads);
    }

    /// `Pipeline::take_message`: one message of the stream, in order, to the core
    /// (`PipelineCore::take`).
    fn take_message(&mut self, i: usize, m: Staged) -> Result<(), End> {
        if let Staged::Row(row, _) = &m {
            let ev = row
                .as_ref()
                .as_ref()
                .expect("the simulated WAL holds readable rows");
            // Read again (a replay, or the stream's overlap with a snapshot or a release):
            // sent again by design, recorded as a duplicate; not `resent_after_proof`.
            let r = self.by_id[&ev.event_id];
            self.relays[i].proven.remove(&r);
        }
        let now = self.now_for(i);
        let taken = self.relays[i]
            .core
            .take(m, now)
            .map_err(|_| End::Error("relay core: a stream message"))?;
        if taken.reply_requested {
            if let Some(s) = self.relays[i].schedule.as_mut() {
                s.status_requested();
            }
        }
        self.execute(i, taken.commands)
    }

    /// What the core may know about now: simulated time, and the lease as this run sees it.
    fn now_for(&self, i: usize) -> Now {
        Now {
            wall: std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(self.now),
            lease_valid: self.lease_valid(i),
        }
    }

    /// The planted product mutant, for the mutants that live in `outbox-relay`.
    fn core_mutant(&self) -> Option<outbox_relay::Mutant> {
        match self.mutant? {
            Mutant::LeaseFromAnswer => Some(outbox_relay::Mutant::LeaseFromAnswer),
            Mutant::IdleCheckpointNeverDue => Some(outbox_relay::Mutant::IdleCheckpointNeverDue),
            Mutant::HeldSlotUnchecked => Some(outbox_relay::Mutant::HeldSlotUnchecked),
            Mutant::BugReleaseBesideParked => Some(outbox_relay::Mutant::ReleaseBesideParked),
            Mutant::ConfirmBeforeAccept => Some(outbox_relay::Mutant::ConfirmBeforeAccept),
            Mutant::RetryReresolvesRoute => Some(outbox_relay::Mutant::RetryReresolvesRoute),
            Mutant::BugPoisonBeforeGate => Some(outbox_relay::Mutant::PoisonBeforeGate),
            Mutant::SecondInFlight => Some(outbox_relay::Mutant::SecondInFlight),
            Mutant::OkWithoutOffsetIsProof => Some(outbox_relay::Mutant::OkWithoutOffsetIsProof),
            Mutant::BugSnapshotGap => Some(outbox_relay::Mutant::GapHoldStrandsQueue),
            Mutant::UnclearNeverDue => Some(outbox_relay::Mutant::UnclearNeverDue),
            Mutant::RouteIgnoresCluster => Some(outbox_relay::Mutant::RouteIgnoresCluster),
            Mutant::BugFoundRaisesUnknownHead => Some(outbox_relay::Mutant::FoundRaisesUnknownHead),
            Mutant::BugSendsFoundEvent => Some(outbox_relay::Mutant::SendsFoundEvent),
            Mutant::ResendsAnsweredEvent => Some(outbox_relay::Mutant::ResendsAnsweredEvent),
            Mutant::BugIgnoresResolvedMeanwhile => {
                Some(outbox_relay::Mutant::IgnoresResolvedMeanwhile)
            }
            Mutant::PollStaleHead => Some(outbox_relay::Mutant::PollStaleHead),
            Mutant::NoSettle => Some(outbox_relay::Mutant::IgnoresSettle),
            Mutant::BugUnknownOnlyAtStart => Some(outbox_relay::Mutant::UnknownOnlyAtStart),
            Mutant::BugEndRunOnUnclear => Some(outbox_relay::Mutant::EndsRunOnUnclear),
            Mutant::BugUnclearWaitCountsAsInFlight => {
                Some(outbox_relay::Mutant::UnclearWaitCountsAsInFlight)
            }
            Mutant::BugRoundForgetsParked => Some(outbox_relay::Mutant::RoundForgetsParked),
            Mutant::BugLookUpBesideReconciliation => {
                Some(outbox_relay::Mutant::LookUpBesideReconciliation)
            }
            Mutant::NumberingNotKept => Some(outbox_relay::Mutant::NumberingNotKept),
            Mutant::BugNumberingLogNotFolded => Some(outbox_relay::Mutant::NumberingLogNotFolded),
            Mutant::BugReadIgnoresLease => Some(outbox_relay::Mutant::ReadIgnoresLease),
            Mutant::BugStreamSendsSkipped => Some(outbox_relay::Mutant::StreamSendsSkipped),
            Mutant::RoundReadsBeforeDrain => Some(outbox_relay::Mutant::RoundReadsBeforeDrain),
            _ => None,
        }
    }

    /// The route policy now: (cluster, topic, route generation).
    fn current_route(&self) -> outbox_relay::CurrentRoute {
        let (topic, gen) = self.route();
        (TOPICS[topic].0.into(), TOPICS[topic].1.into(), gen)
    }

    /// Where relay `i`'s producer puts `row`'s message on `topic`: by the aggregate, over the
    /// live partition count at depth 1 (librdkafka's partitioner), over the count its
    /// placement pins under a deeper gate (the sink's `KafkaSink::admit` and `Placer`). The
    /// sink's bounded wait for a drain is not modelled: a change the producer cannot adopt at
    /// once keeps its pins, as after a wait that timed out.
    fn place(&mut self, i: usize, topic: usize, row: usize) -> usize {
        let live = self.partitions;
        let count = if self.depth == 1 {
            live
        } else {
            let now = ms(self.now);
            let in_flight = self.relays[i]
                .in_flight
                .iter()
                .filter(|f| f.ready_at > self.now)
                .count();
            let admit = self.relays[i].placement.admit(in_flight, now);
            match admit {
                outbox_core::placement::Admit::Send => {}
                outbox_core::placement::Admit::Repinned(c) => {
                    self.c.repins += 1;
                    log!(
                        self,
                        "  gen {}'s producer adopts {}'s {} partitions (was {}): nothing in flight",
                        self.relays[i].gen,
                        c.topic,
                        c.to,
                        c.from
                    )
                }
                outbox_core::placement::Admit::DrainFirst(_) => {
                    self.relays[i].placement.drain_gave_up(now)
                }
            }
            self.relays[i]
                .placement
                .count(TOPICS[topic].1, live as u32, now) as usize
        };
        partition_of(self.rows[row].agg, count)
    }

    /// The driver's side of `Command::Send`: the simulated broker takes the message.
    fn execute(&mut self, i: usize, commands: Vec<Command>) -> Result<(), End> {
        let mut work: std::collections::VecDeque<Command> = commands.into();
        // Set when a deeper gate's producer failed for good: this send and the rest are
        // refused unsent and the run ends (`Pipeline::execute`).
        let mut producer_failed = false;
        while let Some(c) = work.pop_front() {
            let Command::Send {
                token,
                attempt,
                event: ev,
            } = c;
            if producer_failed || self.relays[i].producer_fatal {
                let now = self.now_for(i);
                self.relays[i]
                    .core
                    .send_refused(token, None, "the producer failed", now)
                    .map_err(|_| End::Error("relay core: send_refused"))?;
                producer_failed = true;
                continue;
            }
            let row = self.by_id[&ev.event_id];
            // `Pipeline::execute`: an aggregate that waited behind an unclear outcome may be
            // held in the ledger by now (a predecessor's late refusal): the release sends it.
            let agg = self.rows[row].agg;
            if self.relays[i].core.needs_hold_check(&agg_key(agg))
                && self.ledger.holds.contains_key(&agg)
            {
                log!(
                    self,
                    "o-{agg} held in the ledger meanwhile: {} not sent, recorded held",
                    ev.event_id
                );
                self.relays[i]
                    .core
                    .hold_unsent(token)
                    .map_err(|_| End::Error("relay core: hold_unsent"))?;
                continue;
            }
            // The producer reaches the served cluster only: the topic of that name there.
            let Some(topic) = TOPICS
                .iter()
                .position(|(c, t)| *c == SERVED_CLUSTER && *t == ev.destination.topic)
            else {
                // No such topic on the served cluster: the broker refuses it permanently.
                let now = self.now_for(i);
                self.relays[i]
                    .core
                    .send_refused(token, Some("unknown topic".into()), "unknown topic", now)
                    .map_err(|_| End::Error("relay core: send_refused"))?;
                continue;
            };
            let partition = self.place(i, topic, row);
            if ev.destination.cluster != SERVED_CLUSTER {
                log!(
                    self,
                    "CROSS-CLUSTER send of {} frozen for {}/{} to {SERVED_CLUSTER}/{}",
                    ev.event_id,
                    ev.destination.cluster,
                    ev.destination.topic,
                    ev.destination.topic
                );
                self.cross_sends.insert(row);
            }
            if ev.destination_digest != self.rows[row].current_digest() {
                log!(
                    self,
                    "CROSS-DESTINATION send of {} to {}/{}",
                    ev.event_id,
                    ev.destination.cluster,
                    ev.destination.topic
                );
                self.cross_sends.insert(row);
            }
            if self.rows[row].purged {
                self.c.purged_early += 1;
            }
            if self.ledger.skipped(row) {
                log!(self, "SKIPPED {} sent again", ev.event_id);
                self.c.skipped_offered += 1;
            }
            if self.relays[i].proven.contains(&row) {
                log!(
                    self,
                    "RESENT {} after this run saw it on the broker",
                    ev.event_id
                );
                self.c.resent_after_proof += 1;
            }
            if self.relays[i].gen < self.ledger.lease_gen {
                log!(
                    self,
                    "STALE send of {} by gen {} while gen {} holds the lease",
                    ev.event_id,
                    self.relays[i].gen,
                    self.ledger.lease_gen
                );
                self.c.stale_sends += 1;
            }
            if self.depth > 1 && self.is(Mutant::DeepBeforeHandOver) {
                work.extend(self.handed_over(i, token)?);
            }
            // The producer did not take it (not a permanent refusal): nothing was handed over;
            // the core parks the event to be sent again (`Pipeline::execute`).
            let refused =
                self.faults && self.producer_refuses.as_mut().is_some_and(|r| r.chance(30));
            if refused {
                log!(
                    self,
                    "the producer did not take {} (queue full)",
                    ev.event_id
                );
                self.c.producer_refusals += 1;
                let now = self.now_for(i);
                self.relays[i]
                    .core
                    .send_refused(token, None, "queue full", now)
                    .map_err(|_| End::Error("relay core: send_refused"))?;
                continue;
            }
            self.rows[row].last_send = self.now;
            let msg = Msg {
                id: ev.event_id,
                row,
                version: ev.aggregate_version,
                dest_digest: ev.destination_digest.clone(),
                relay_gen: self.relays[i].gen,
                attempt,
                stored_at: 0,
                seq: 0,
            };
            let (report, ready_at) = if self.depth > 1 && !self.is(Mutant::DeepWithoutGapless) {
                self.broker_send_in_order(i, topic, partition, msg)
            } else {
                (self.broker_send(topic, partition, msg), self.now)
            };
            log!(
                self,
                "send {} v{}{} attempt {attempt} gen {} -> {}/{partition}",
                ev.event_id,
                ev.aggregate_version,
                if ev.version_by_relay {
                    " (numbered)"
                } else {
                    ""
                },
                self.relays[i].gen,
                TOPICS[topic].1
            );
            self.relays[i].in_flight.push(Flight {
                token,
                row,
                topic,
                partition,
                sent_at: self.now,
                attempt,
                report,
                ready_at,
            });
            // The producer took it: under a deeper gate the next version may follow it now
            // (`Pipeline::execute`).
            if self.depth > 1 && !self.is(Mutant::DeepBeforeHandOver) {
                work.extend(self.handed_over(i, token)?);
            }
        }
        if producer_failed {
            return Err(End::Error("the producer failed"));
        }
        Ok(())
    }

    /// `PipelineCore::handed_over`: the producer took `token`'s message; what follows it now.
    fn handed_over(&mut self, i: usize, token: u64) -> Result<Vec<Command>, End> {
        let now = self.now_for(i);
        let next = self.relays[i]
            .core
            .handed_over(token, now)
            .map_err(|_| End::Error("relay core: handed_over"))?;
        self.c.deep_followers += next.len() as u64;
        Ok(next)
    }

    /// `Pipeline::on_live_report`: one report ([`World::report_one`]); when it is a failure
    /// and a deeper gate's producer failed for good, the run ends after it (a salvage reads
    /// its reports whatever became of the producer).
    fn on_report(&mut self, i: usize, token: u64) -> Result<(), End> {
        let failed = self.relays[i]
            .in_flight
            .iter()
            .find(|f| f.token == token)
            .is_some_and(|f| {
                !matches!(
                    f.report,
                    Report::Persisted(_) | Report::ImplicitAck | Report::Pending
                )
            });
        self.report_one(i, token)?;
        let r = &self.relays[i];
        if failed && r.producer_fatal && !r.salvaging && !r.killed {
            return Err(End::Error("the producer failed"));
        }
        Ok(())
    }

    /// `Pipeline::on_report`: the simulated broker's report, decided by the core.
    fn report_one(&mut self, i: usize, token: u64) -> Result<(), End> {
        let k = self.relays[i]
            .in_flight
            .iter()
            .position(|f| f.token == token)
            .expect("in flight");
        let f = self.relays[i].in_flight.remove(k);
        let failed = |persistence, class| DeliveryOutcome::Failed {
            error: "simulated".into(),
            persistence,
            class,
            partition: f.partition as i32,
        };
        // Held back by a deeper gate's producer: reported where it landed, or (the run ended
        // before it did) possibly persisted.
        let report = match f.report {
            Report::Pending => {
                // What is due has landed (some of the drain's steps move time on their own).
                self.land_late_appends();
                let gen = self.relays[i].gen;
                match self.landed(f.topic, f.partition, f.row, gen, f.attempt) {
                    Some(rc) => Report::Persisted(rc),
                    None => Report::PossiblyPersisted,
                }
            }
            r => r,
        };
        let outcome = match report {
            Report::Persisted(rc) => {
                self.relays[i].proven.insert(f.row);
                let late = self.relays[i].salvaging
                    || self.relays[i].gen != self.ledger.lease_gen
                    || self.ledger.primary.contains_key(&f.row);
                if late {
                    let id = self.rows[f.row].ev.event_id;
                    self.relays[i]
                        .late
                        .insert((id, rc.partition as i32, rc.offset as i64));
                }
                DeliveryOutcome::Persisted {
                    topic: TOPICS[rc.topic].1.into(),
                    partition: rc.partition as i32,
                    offset: rc.offset as i64,
                    timestamp_ms: None,
                    duplicate: false,
                    evidence: None,
                }
            }
            Report::ImplicitAck => DeliveryOutcome::Persisted {
                topic: TOPICS[f.topic].1.into(),
                partition: f.partition as i32,
                offset: -1001,
                timestamp_ms: None,
                duplicate: false,
                evidence: None,
            },
            Report::Rejected => failed(Persistence::NotPersisted, FailureClass::Permanent),
            Report::PossiblyPersisted => {
                failed(Persistence::PossiblyPersisted, FailureClass::Transient)
            }
            Report::NotPersisted => failed(Persistence::NotPersisted, FailureClass::Transient),
            Report::Pending => unreachable!("read where it landed above"),
        };
        let now = self.now_for(i);
        let reported = self.relays[i]
            .core
            .on_report(Delivery { token, outcome }, now)
            .map_err(|e| match e {
                // The daemon's loop ends the run with the error (bug-end-run-on-unclear).
                outbox_relay::CoreError::UnclearEndsRun(_) => {
                    End::Unclear("an unclear delivery report")
                }
                _ => End::Error("relay core: report"),
            })?;
        if self.is(Mutant::ConfirmBeforeAccept) {
            // The driver's half of the mutant: confirm what the tracker says, at once.
            let wm = self.relays[i].core.tracker.watermark();
            self.slot_confirmed = self.slot_confirmed.max(Some(wm));
            self.check_confirmed();
        }
        match reported {
            Reported::Continue(commands) => self.execute(i, commands),
            // Only its aggregate waits: record the attempt (if possibly persisted) and go on;
            // the core asks for the look-up or the resend when it is due.
            Reported::Unclear(failure) => {
                self.c.unclear_outcomes += 1;
                let Some(u) = failure.unknown else {
                    log!(
                        self,
                        "not persisted: {} parked for a resend",
                        self.rows[f.row].ev.event_id
                    );
                    return Ok(());
                };
                if self.faults && self.rng.chance(30) {
                    // The process dies before the attempt is durable: the same boundary as a
                    // SIGKILL with the send in flight (nothing learned, nothing recorded).
                    self.sigkill(i);
                    return Err(End::Error("killed"));
                }
                log!(
                    self,
                    "DISPATCH_UNKNOWN {} (gen {} attempt {}): only o-{} waits",
                    self.rows[f.row].ev.event_id,
                    self.relays[i].gen,
                    u.attempt,
                    self.rows[f.row].agg
                );
                self.ledger.attempts.push(Attempt {
                    row: f.row,
                    relay_gen: self.relays[i].gen,
                    attempt: u.attempt,
                    topic: f.topic,
                    partition: f.partition,
                    unknown_at: self.now.max(f.sent_at),
                    sent_at: f.sent_at,
                    state: AttemptState::Unknown,
                });
                self.c.unknown_attempts += 1;
                Ok(())
            }
        }
    }

    /// `Pipeline::run_due_unclear`: what the core says is due for parked events now — a
    /// look-up (started here, answered at a later step: it runs on its own task) or a resend.
    fn run_due_unclear(&mut self, i: usize) -> Result<(), End> {
        let now = self.now_for(i);
        let steps = self.relays[i]
            .core
            .due_unclear(now)
            .map_err(|_| End::Error("relay core: due_unclear"))?;
        for step in steps {
            match step {
                UnclearStep::Send(send) => {
                    self.c.unclear_resends += 1;
                    self.execute(i, vec![send])?;
                }
                UnclearStep::Lookup { event } => self.drive_lookup(i, ParkedLookup::due(event))?,
            }
        }
        Ok(())
    }

    /// `Pipeline::drive_lookup`: does what a parked event's look-ups ask ([`ParkedLookup`]):
    /// reads its latest open attempt (`attempts::open_unknown_of`), closes one at its receipt,
    /// starts the look-up (it answers at a later step), or hands what was proven to the core.
    fn drive_lookup(&mut self, i: usize, mut lookup: ParkedLookup<usize>) -> Result<(), End> {
        let id = lookup.event_id();
        let row = self.by_id[&id];
        let mut input = ParkedInput::Begin;
        loop {
            input = match lookup.next(&mut self.relays[i].core, input) {
                ParkedStep::ReadOpenAttempt => {
                    let open = (0..self.ledger.attempts.len()).rev().find(|a| {
                        let at = &self.ledger.attempts[*a];
                        at.row == row && at.state == AttemptState::Unknown
                    });
                    ParkedInput::Open(open.map(|a| OpenAttempt {
                        attempt: a,
                        attempt_generation: self.ledger.attempts[a].attempt,
                        has_receipt: self.ledger.primary.contains_key(&row),
                        lookup_resends: self.lookup_resends(self.ledger.attempts[a].sent_at),
                        unknown_for: ms(
                            self.now.saturating_sub(self.ledger.attempts[a].unknown_at),
                        ),
                    }))
                }
                ParkedStep::CloseByReceipt(a) => {
                    ParkedInput::ClosedAt(Some(self.close_by_receipt(a).1))
                }
                ParkedStep::LookUp {
                    event,
                    attempt,
                    prior,
                } => {
                    log!(self, "look-up of {id} started");
                    let published = self.ledger.primary.contains_key(&row);
                    self.push_lookup(
                        i,
                        PendingLookup {
                            event,
                            attempt,
                            prior,
                            published,
                            reconciling: false,
                        },
                    );
                    return Ok(());
                }
                ParkedStep::Done { event_id, outcome } => {
                    log!(self, "{event_id}: every open attempt traced: {outcome:?}");
                    return self.lookup_done(i, event_id, outcome);
                }
            };
        }
    }

    /// `unknown::close_answered`: after a look-up of one of `row`'s attempts that re-sent it
    /// under its key (`resent`) was answered (`resolved`), every other open attempt whose own
    /// look-up would be the same re-send is settled by that answer
    /// (`outbox_relay::unknown::answered_already`): FOUND where the destination named its
    /// copy, ABSENT where it stored the re-send (the window would have named an earlier copy).
    fn close_answered(&mut self, row: usize, resent: bool, resolved: &Resolved) {
        for a in 0..self.ledger.attempts.len() {
            let at = &self.ledger.attempts[a];
            if at.row != row || at.state != AttemptState::Unknown {
                continue;
            }
            if !unknown::answered_already(resent, resolved, self.lookup_resends(at.sent_at)) {
                continue;
            }
            let (relay_gen, attempt) = (at.relay_gen, at.attempt);
            let state = match unknown::settled_at(resolved) {
                Some(_) => AttemptState::Found,
                None => AttemptState::Absent,
            };
            self.resolve_attempt(a, state);
            log!(
                self,
                "UNKNOWN {} (gen {relay_gen} attempt {attempt}) settled by the answer to the same key",
                self.rows[row].ev.event_id
            );
        }
    }

    /// `attempts::last_generation`: the highest attempt generation recorded for `row`.
    fn last_attempt(&self, row: usize) -> i32 {
        self.ledger
            .attempts
            .iter()
            .filter(|x| x.row == row)
            .map(|x| x.attempt)
            .max()
            .unwrap_or(0)
    }

    /// `attempts::resolve`: attempt `a` takes `state` if it is still DISPATCH_UNKNOWN (an
    /// absence is the judge's truth to check later appends against); its resolution time is
    /// recorded.
    fn resolve_attempt(&mut self, a: usize, state: AttemptState) {
        let at = &self.ledger.attempts[a];
        if at.state != AttemptState::Unknown {
            return;
        }
        let (row, relay_gen, attempt, unknown_at) =
            (at.row, at.relay_gen, at.attempt, at.unknown_at);
        if state == AttemptState::Absent {
            self.absent_attempts.insert((row, relay_gen, attempt));
        }
        self.ledger.attempts[a].state = state;
        self.c
            .unknown_resolution
            .record(self.now.saturating_sub(unknown_at));
    }

    /// `attempts::resolve_by_receipt`: open attempt `a` closed FOUND at its event's primary
    /// receipt (the destination's answer under the event's key); nothing is sent. Returns the
    /// attempt's generation and the receipt's offset.
    fn close_by_receipt(&mut self, a: usize) -> (i32, i64) {
        let (row, attempt) = (self.ledger.attempts[a].row, self.ledger.attempts[a].attempt);
        let offset = self.ledger.primary[&row].offset as i64;
        self.resolve_attempt(a, AttemptState::Found);
        self.c.closed_by_receipt += 1;
        log!(
            self,
            "UNKNOWN {} closed by its receipt (offset {offset})",
            self.rows[row].ev.event_id
        );
        (attempt, offset)
    }

    /// `Pipeline::on_lookup`: look-up `k` of run `i` answers (a parked event's, or one the
    /// running reconciliation started); what it proved is recorded as reconciliation at start
    /// records it ([`World::record_lookup`]) and the attempts the same answer settles are
    /// closed; then the core learns it (`PipelineCore::lookup_answered`) and a parked event's
    /// round goes on.
    fn on_lookup(&mut self, i: usize, k: usize) -> Result<(), End> {
        let PendingLookup {
            event,
            attempt,
            prior,
            published,
            reconciling,
        } = self.relays[i].lookups.remove(k);
        if !reconciling {
            self.c.unclear_lookups += 1;
        }
        let id = event.event_id;
        let row = self.ledger.attempts[attempt].row;
        let answer = match self.look_up(i, attempt, &event, published) {
            Some((scan, probe, resent)) => {
                let resolved = self.record_lookup(i, attempt, &event, scan, probe)?;
                self.close_answered(row, resent, &resolved);
                Ok(resolved)
            }
            None => {
                log!(self, "look-up of {id} failed; asking again");
                Err("simulated look-up failure".to_string())
            }
        };
        let whose = if reconciling {
            LookupFor::Reconciling
        } else {
            LookupFor::Parked { prior }
        };
        match self.relays[i].core.lookup_answered(event, whose, answer) {
            Some(round) => self.drive_lookup(i, round),
            None => Ok(()),
        }
    }

    /// `PipelineCore::lookup_done`, and the sends that follow (the retry, or the aggregate's
    /// next event).
    fn lookup_done(&mut self, i: usize, id: Uuid, outcome: LookupOutcome) -> Result<(), End> {
        let now = self.now_for(i);
        let before = self.relays[i].core.past_budget();
        let commands = self.relays[i]
            .core
            .lookup_done(id, outcome, now)
            .map_err(|_| End::Error("relay core: lookup_done"))?;
        let after = self.relays[i].core.past_budget();
        if after > before {
            log!(self, "{id} is past the unclear budget: it keeps waiting");
            self.c.unclear_past_budget += (after - before) as u64;
        }
        self.execute(i, commands)
    }

    /// `Pipeline::wait_one`: the next thing that moves run `i` on — a delivery report, a
    /// look-up's answer, or a parked event falling due (time passes until then, the lease
    /// keeper renewing the lease meanwhile). `false`: nothing can ever arrive (the daemon
    /// would wait forever).
    fn wait_one(&mut self, i: usize) -> Result<bool, End> {
        if let Some((token, _)) = self.first_report(i) {
            self.await_report(i, token)?;
            return Ok(true);
        }
        if !self.relays[i].lookups.is_empty() {
            self.on_lookup(i, 0)?;
            return Ok(true);
        }
        let Some(due) = self.relays[i].core.next_unclear_due() else {
            return Ok(false);
        };
        // Rounded up: a due time a fraction of a millisecond past `now` would otherwise never
        // be reached (the core's waits are whole milliseconds; this keeps a driver that is
        // one step coarser from spinning).
        let due = due
            .duration_since(std::time::SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos().div_ceil(1_000_000) as u64);
        while self.now < due {
            self.now = due.min(self.now + 500);
            self.renew(i);
            self.land_late_appends();
        }
        if !self.lease_valid(i) {
            self.renew(i);
            if !self.lease_valid(i) {
                return Err(End::Error("lease not certainly held while waiting"));
            }
        }
        self.run_due_unclear(i)?;
        Ok(true)
    }

    /// Run `i` waits for the report of `token`: a message a deeper gate's producer holds back
    /// answers when it lands (the lease renewed meanwhile, as the daemon's keeper does).
    fn await_report(&mut self, i: usize, token: u64) -> Result<(), End> {
        let ready_at = self.relays[i]
            .in_flight
            .iter()
            .find(|f| f.token == token)
            .map_or(0, |f| f.ready_at);
        while self.now < ready_at {
            self.now = ready_at.min(self.now + 500);
            self.renew(i);
            self.land_late_appends();
            if !self.lease_valid(i) {
                return Err(End::Error("lease not certainly held while waiting"));
            }
        }
        self.on_report(i, token)
    }

    /// The report run `i` gets first when it waits for one, and from when it can: the first
    /// send's, unless a deeper gate's producer holds it back (then the one that can be read
    /// soonest).
    fn first_report(&self, i: usize) -> Option<(u64, u64)> {
        self.relays[i]
            .in_flight
            .iter()
            .min_by_key(|f| f.ready_at.max(self.now))
            .map(|f| (f.token, f.ready_at))
    }

    /// Whether run `i` has a parked event due now.
    fn unclear_due(&self, i: usize) -> bool {
        let now = std::time::SystemTime::UNIX_EPOCH + ms(self.now);
        self.relays[i]
            .core
            .next_unclear_due()
            .is_some_and(|d| d <= now)
    }

    /// `Pipeline::flush`: the core resolves the batch in the tracker and says which
    /// checkpoint it allows; one acceptance transaction. A failed one puts the batch back
    /// (`keep_for_salvage`).
    fn flush(&mut self, i: usize, track: bool) -> Result<(), End> {
        // `Pipeline::flush`: a pipelined acceptance still running is settled first, so that
        // acceptance transactions commit in the order they were built. One that was fenced
        // committed its records: the batch is still recorded, and the fence is the error.
        let fenced = match self.settle(i) {
            Ok(()) => None,
            Err(End::Error(FENCED)) => Some(End::Error(FENCED)),
            Err(e) => return Err(e),
        };
        let Some(a) = self.relays[i]
            .core
            .begin_acceptance(track)
            .map_err(|_| End::Error("tracker resolve"))?
        else {
            return fenced.map_or(Ok(()), Err);
        };
        self.commit_acceptance(i, a)?;
        fenced.map_or(Ok(()), Err)
    }

    /// `Pipeline::flush_pipelined`: the batch's acceptance starts on a task of its own and
    /// answers at a later step (`World::settle`); nothing starts while one runs (the batch
    /// grows meanwhile).
    fn flush_pipelined(&mut self, i: usize) -> Result<(), End> {
        if self.relays[i].accepting.is_some() {
            return Ok(());
        }
        self.relays[i].accepting = self.relays[i]
            .core
            .begin_acceptance(true)
            .map_err(|_| End::Error("tracker resolve"))?;
        Ok(())
    }

    /// `Pipeline::settle` / `finish_accept`: the pipelined acceptance, if one runs, commits
    /// (or fails) and the core learns how it ended; the loop's schedule hears of it.
    fn settle(&mut self, i: usize) -> Result<(), End> {
        let Some(a) = self.relays[i].accepting.take() else {
            return Ok(());
        };
        self.c.pipelined_acceptances += 1;
        let before = self.relays[i].core.durable();
        let ended = self.commit_acceptance(i, a);
        let moved = self.relays[i].core.durable() > before;
        let now = ms(self.now);
        if let Some(s) = self.relays[i].schedule.as_mut() {
            s.accepted(now, moved);
        }
        ended
    }

    /// One acceptance transaction against the ledger model, and how it ended for the core
    /// (`PipelineCore::acceptance_ended`).
    fn commit_acceptance(&mut self, i: usize, a: outbox_relay::Acceptance) -> Result<(), End> {
        let sim_items = self.sim_items(i, &a.items);
        let receipts: Vec<&ReceiptRecord> = a
            .items
            .iter()
            .filter_map(|it| match it {
                LedgerItem::Receipt(r) => Some(r),
                _ => None,
            })
            .collect();
        let raises = receipt::raises(&receipts);
        // `PipelineCore::numbered_through`, taken with the batch: what the transaction that
        // moves the checkpoint keeps for the rows written without a version or route (per
        // aggregate, the version of its last row committed before the checkpoint); if it
        // fails, the run ends. (The simulator does not model policy generations: its plain
        // rows are routed by the route version in force at their commit, rendered as a
        // narrow row's.) The ledger may fold its log at any acceptance, not only when the
        // core asks (its limits are millions of entries, beyond a trace): a fold is never to
        // change a number.
        let numbered = a
            .numbered
            .as_ref()
            .map_or(Vec::new(), |n| n.versions.clone());
        let fold = a.folds() || (!numbered.is_empty() && self.rng.chance(250));
        let end = match self.accept(i, sim_items, raises, a.checkpoint, numbered, fold) {
            Ok(false) => AcceptanceEnd::Committed,
            Ok(true) => AcceptanceEnd::Fenced,
            Err(e) => {
                self.relays[i]
                    .core
                    .acceptance_ended(a, AcceptanceEnd::Failed);
                return Err(e);
            }
        };
        self.relays[i].core.acceptance_ended(a, end);
        if end == AcceptanceEnd::Fenced {
            return Err(End::Error(FENCED));
        }
        if self.faults && self.rng.chance(20) {
            self.sigkill(i); // after the ledger, before the slot is told
            return Err(End::Error("killed"));
        }
        Ok(())
    }

    /// The standby status update: `flush` = the committed checkpoint.
    fn status_update(&mut self, i: usize) {
        let r = &self.relays[i];
        if r.stream_cut || self.poll {
            return;
        }
        let d = r.core.standby_status().flush;
        if self.slot_confirmed.is_some_and(|s| d > s) {
            self.slot_confirmed = Some(d);
            self.slot_by_interloper = false;
            self.check_confirmed();
        }
    }

    /// `Pipeline::release_poll`: one release poll, executed as the core's
    /// [`ReleasePoll`] asks.
    fn process_releases(&mut self, i: usize) -> Result<(), End> {
        let mut poll = ReleasePoll::new();
        let waiting_since = self.now;
        loop {
            let now = self.now_for(i);
            match poll.next(&mut self.relays[i].core, now) {
                PollStep::ReconcileSettled => self.reconcile_settled(i)?,
                // `holds::releasing`: the aggregates operators released, in key order.
                PollStep::ReadReleasing => {
                    let mut aggs: Vec<Agg> = self
                        .ledger
                        .holds
                        .iter()
                        .filter(|(_, h)| h.state == HoldState::Releasing)
                        .map(|(a, _)| *a)
                        .collect();
                    aggs.sort();
                    let released = aggs
                        .into_iter()
                        .map(|agg| {
                            let h = &self.ledger.holds[&agg];
                            Released {
                                key: agg_key(agg),
                                blocking_version: h.blocking.map(|b| self.rows[b].version),
                                blocking_event_id: h.blocking.map(|b| self.rows[b].ev.event_id),
                                publish_blocking: h.publish_blocking,
                            }
                        })
                        .collect::<Vec<Released>>();
                    // The case of bug 24: a released aggregate with nothing at the broker but
                    // an event parked after an unclear outcome (the release waits for it).
                    let core = &self.relays[i].core;
                    self.c.releases_beside_parked += released
                        .iter()
                        .filter(|r| {
                            !core.aggregate_in_flight(&r.key) && core.aggregate_busy(&r.key)
                        })
                        .count() as u64;
                    poll.releasing(released);
                }
                PollStep::Flush => self.flush(i, true)?,
                PollStep::LoadSet(r) => {
                    let agg = agg_of(&r.key.1);
                    let Some(h) = self.ledger.holds.get(&agg) else {
                        poll.skip();
                        continue;
                    };
                    let (blocking, publish_blocking) = (h.blocking, h.publish_blocking);
                    // `holds::republish_set`: the blocking event (unless skipped) and every held
                    // event without a receipt or an open quarantine; a row written without a
                    // version with the version its held record kept (the blocking one: the
                    // hold's), and the route the relay gave it (the simulated row holds it
                    // already).
                    let set: Vec<(OutboxEvent, Option<Lsn>)> = (0..self.rows.len())
                        .filter(|r| {
                            self.rows[*r].agg == agg
                                && !self.rows[*r].purged
                                && !self.ledger.primary.contains_key(r)
                                && self.ledger.open_quarantine(*r).is_none()
                                && (self.is(Mutant::BugRepublishSkipped)
                                    || !self.ledger.skipped(*r))
                                && (self.ledger.held.get(r) == Some(&false)
                                    || (publish_blocking && blocking == Some(*r)))
                        })
                        .map(|row| {
                            let mut ev = self.rows[row].current();
                            if ev.version_by_relay {
                                let kept = if blocking == Some(row) {
                                    r.blocking_version
                                } else {
                                    self.ledger.held_versions.get(&row).copied()
                                };
                                if !self.is(Mutant::BugReleaseReadsPlainRows) {
                                    ev.aggregate_version = kept.unwrap_or(0);
                                }
                            }
                            (ev, None)
                        })
                        .collect();
                    log!(self, "republishing released o-{agg}: {} events", set.len());
                    self.c.plain_released +=
                        set.iter().filter(|(ev, _)| ev.version_by_relay).count() as u64;
                    poll.loaded(&self.relays[i].core, set);
                }
                PollStep::Send(send) => self.execute(i, vec![send])?,
                PollStep::Await(token)
                    if self.relays[i].in_flight.iter().any(|f| f.token == token) =>
                {
                    self.await_report(i, token)?
                }
                // Parked after an unclear outcome: `wait_one` until it is resolved.
                PollStep::Await(_) => {
                    if !self.waited(i, waiting_since)? {
                        log!(
                            self,
                            "RELAY HUNG: a release waits for a parked event that never comes due"
                        );
                        self.c.stalls += 1;
                        return Err(End::Error("release waits forever"));
                    }
                }
                PollStep::CloseHold { key, last } => {
                    let agg = agg_of(&key.1);
                    if self.close_hold(agg, last) {
                        let head = self.ledger.heads.get(&agg).copied().unwrap_or(0);
                        let next = self.relays[i].core.release_closed(&key, head, last);
                        log!(self, "hold of o-{agg} released; next version {next}");
                    }
                }
                PollStep::Done => return Ok(()),
            }
        }
    }

    // ----------------------------------------------------------------------------- operator

    /// `outboxd migrate-destination` on a quarantined event (or, with `any`, on any
    /// unpublished one), to the served cluster's current topic.
    fn operator_migrate(&mut self, drain: bool) {
        let cands: Vec<usize> = (0..self.rows.len())
            .filter(|r| {
                !self.rows[*r].purged
                    && !self.ledger.primary.contains_key(r)
                    && (self.ledger.open_quarantine(*r).is_some() || self.ledger.unknown_open(*r))
            })
            .collect();
        if cands.is_empty() {
            return;
        }
        let picks: Vec<usize> = if drain {
            cands
        } else {
            vec![cands[self.rng.below(cands.len() as u64) as usize]]
        };
        for row in picks {
            self.migrate_one(row);
        }
    }

    fn migrate_one(&mut self, row: usize) {
        let q = self.ledger.open_quarantine(row).map(|q| q.code.clone());
        let attempts = self.ledger.attempts.iter().filter(|a| a.row == row).count() as i64;
        let facts = receipt::MigrationFacts {
            published: self.ledger.primary.contains_key(&row),
            unknown_open: self.ledger.unknown_open(row) && !self.is(Mutant::MigrateWhileUnknown),
            quarantine_code: q.as_deref(),
            attempts,
            migrated: !self.rows[row].migrations.is_empty()
                && !self.is(Mutant::BugProofAfterMigration),
            // Poll mode has no WAL row to replay, but the live lease's current round may hold
            // the event if its read did not see the quarantine (destination.rs, migration 0015).
            replayable: if self.poll {
                self.poll_round_may_hold(row) && !self.is(Mutant::PollMigrateHeld)
            } else {
                self.ledger
                    .checkpoint
                    .map_or(true, |c| self.rows[row].commit_end > c)
                    && !self.is(Mutant::BugMigrateReplayable)
            },
        };
        let cur = self.rows[row].current();
        let old = topic_index(&cur.destination);
        let proof = match receipt::migration_precheck(facts) {
            Ok(Some(p)) => Ok(p),
            Ok(None) => {
                let scan = if self.now < self.down_until[old] {
                    if self.is(Mutant::MigrateWhileUnknown) {
                        Scan::Absent // "cannot read it, so it is not there"
                    } else {
                        Scan::Unavailable
                    }
                } else if self.broker[old]
                    .iter()
                    .any(|p| p.iter().any(|m| m.row == row))
                {
                    Scan::Found { offset: 0 }
                } else {
                    Scan::Absent
                };
                receipt::migration_after_scan(scan)
            }
            Err(e) => Err(e),
        };
        match proof {
            Err(e) => {
                log!(self, "migration of {} refused: {e}", cur.event_id);
                self.c.migrations_refused += 1;
            }
            Ok(p) => {
                let to = if old == 0 { 1 } else { 0 };
                let d = self.destination(self.rows[row].agg, to, self.route().1);
                let digest = d.digest();
                log!(
                    self,
                    "migrated {} {}/{} -> A/{} ({p:?})",
                    cur.event_id,
                    cur.destination.cluster,
                    cur.destination.topic,
                    TOPICS[to].1
                );
                self.rows[row].migrations.push((d, digest));
                self.c.migrations += 1;
                if self.is(Mutant::MigrateWhileUnknown) {
                    for a in self.ledger.attempts.iter_mut().filter(|a| a.row == row) {
                        if a.state == AttemptState::Unknown {
                            a.state = AttemptState::Absent;
                        }
                    }
                }
                self.release(row, true);
            }
        }
    }

    /// `holds::resolve(Skip)`: close the quarantine as skipped, mark the hold RELEASING
    /// without its blocking event. The event is never to be published.
    fn skip(&mut self, row: usize) {
        log!(self, "operator skips {}", self.rows[row].ev.event_id);
        for q in self
            .ledger
            .quarantine
            .iter_mut()
            .filter(|q| q.row == row && !q.released)
        {
            q.skipped = true;
        }
        self.c.skips += 1;
        self.release(row, false);
    }

    /// `holds::resolve(Release)`: close the quarantine, mark the hold RELEASING.
    fn release(&mut self, row: usize, publish: bool) {
        for q in self
            .ledger
            .quarantine
            .iter_mut()
            .filter(|q| q.row == row && !q.released)
        {
            q.released = true;
        }
        for h in self.ledger.holds.values_mut() {
            if h.blocking == Some(row) {
                h.state = HoldState::Releasing;
                h.publish_blocking = publish;
            }
        }
    }

    // ---------------------------------------------------------------------------- consumers

    // -------------------------------------------------------------------------------- purge

    // -------------------------------------------------------------------------------- drain

    /// The world heals: no new faults, every paused relay resumes, every late append lands,
    /// the operator migrates or releases every quarantined event; then the relay and the
    /// consumers run until everything committed is published and consumed.
    fn drain(&mut self) {
        self.faults = false;
        self.down_until = [0; 4];
        self.now += self.max_append_delay + 1;
        self.land_late_appends();
        if self.route().0 != 0 {
            self.route_change();
        }
        for r in &mut self.relays {
            r.paused = false;
        }
        // Consecutive iterations in which nothing happened but time passing.
        let (mut idle, mut was_idle) = (0, false);
        for _ in 0..5_000 {
            if !was_idle {
                idle = 0;
            }
            was_idle = false;
            self.relays.retain(|r| !r.killed);
            self.end_stale_runs();
            self.now += 1;
            if let Some(i) = self.relays.iter().position(|r| r.salvaging) {
                self.salvage(i);
                continue;
            }
            if let Some(i) = self
                .relays
                .iter()
                .position(|r| !r.keeper.valid(ms(self.now)) && !r.salvaging && !r.killed)
            {
                self.end_run(i, End::Error("lease deadline passed while paused"));
                continue;
            }
            let Some(i) = self.active() else {
                if self.ledger.checkpoint.is_some() && self.c.start_refused > 0 {
                    break; // the relay cannot start: whatever is unpublished is lost
                }
                self.start_relay();
                continue;
            };
            self.renew(i);
            if self.poll && self.round_due(i) {
                if self.poll_loop {
                    self.relay_call(Some(i), Self::poll_round_of_steps);
                } else {
                    self.relay_call(Some(i), Self::poll_round);
                }
                continue;
            }
            // Under the product's backpressure, as while faults last: a relay with too much
            // unresolved answers, accepts and looks up before it reads on.
            let more =
                !self.poll && !self.relays[i].stream_cut && self.relays[i].cursor < self.wal.len();
            let can_read = more && self.can_read(i);
            if more && !can_read {
                self.c.reads_held_back += 1;
            }
            if can_read {
                self.relay_call(Some(i), Self::decode_next);
                continue;
            }
            if let Some((token, ready_at)) = self.first_report(i) {
                if self.now < ready_at {
                    self.now = ready_at;
                    self.land_late_appends();
                }
                self.relay_call(Some(i), |w, i| w.on_report(i, token));
                continue;
            }
            if !self.relays[i].lookups.is_empty() {
                self.relay_call(Some(i), |w, i| w.on_lookup(i, 0));
                continue;
            }
            if self.unclear_due(i) {
                self.relay_call(Some(i), Self::run_due_unclear);
                continue;
            }
            if self.relays[i].accepting.is_some() {
                self.relay_call(Some(i), Self::settle);
                continue;
            }
            let unconfirmed = self.loop_timing.is_some()
                && self
                    .slot_confirmed
                    .is_some_and(|s| s < self.relays[i].core.durable());
            if self.relays[i].core.batch_len() > 0
                || self.relays[i].core.tracker.watermark() > self.relays[i].core.durable()
                || unconfirmed
            {
                if self.loop_timing.is_some() {
                    // The daemon's loop: what is due now, and a sleep until its next wake-up
                    // while nothing moves.
                    let at = |w: &World| {
                        let core = &w.relays[i].core;
                        (core.durable(), core.batch_len(), w.slot_confirmed)
                    };
                    let before = at(self);
                    self.loop_tick(i);
                    let ended = self.relays[i].killed || self.relays[i].salvaging;
                    if !ended && at(self) == before {
                        let load = self.load_of(i);
                        if let Some(s) = &self.relays[i].schedule {
                            let wake = s.next_wakeup(&load).as_millis() as u64;
                            self.now = self.now.max(wake);
                        }
                        was_idle = true;
                        idle += 1;
                        if idle > IDLE_LIMIT {
                            break;
                        }
                    }
                    continue;
                }
                self.relay_call(Some(i), |w, i| w.flush(i, !w.poll));
                self.relay_call(Some(i), |w, i| {
                    w.status_update(i);
                    Ok(())
                });
                continue;
            }
            // Operator: every open quarantine is migrated (unpublished) or released (published).
            let open: Vec<usize> = self
                .ledger
                .quarantine
                .iter()
                .filter(|q| !q.released)
                .map(|q| q.row)
                .collect();
            let open_before = open.len();
            if !open.is_empty() {
                for row in open {
                    if self.ledger.primary.contains_key(&row) {
                        self.release(row, false);
                    } else {
                        let cur = self.rows[row].current();
                        let routable = outbox_relay::route::check(&cur, &served()).is_ok();
                        if routable && topic_index(&cur.destination) != REJECTING_TOPIC {
                            self.release(row, true);
                        } else if routable && cur.event_id.as_u128() % 3 == 0 {
                            // A third of the refused events (by id, no draw from the trace's
                            // generator) are skipped instead of migrated.
                            self.skip(row);
                        } else {
                            self.migrate_one(row);
                        }
                    }
                }
                // Every migration refused (the checkpoint has not passed an event, whose
                // aggregate waits for a parked event's look-up): the operator tries again
                // later, and time passes as below. Before, each refused try took a
                // millisecond and the drain's iterations ran out before the parked event came
                // due (its events counted lost: seed 2, trace 805876; a model artifact).
                let still_open = self
                    .ledger
                    .quarantine
                    .iter()
                    .filter(|q| !q.released)
                    .count();
                if still_open < open_before {
                    continue;
                }
            }
            // The relay's periodic poll: releases, and UNKNOWN attempts of other generations.
            let before = (self.ledger.holds.len(), self.open_unknown());
            self.relay_call(Some(i), Self::process_releases);
            if (self.ledger.holds.len(), self.open_unknown()) != before {
                continue;
            }
            // Held aggregates whose blocking event has no open quarantine (published, or
            // its quarantine resolved without closing the hold): release them. A blocking
            // event with an open quarantine is the operator's above, who resolves the
            // quarantine and the hold together (`holds::resolve`), as the product lets them:
            // the release poll just above may have recorded one since `open` was read (a
            // release refused again), and releasing its hold here, with the quarantine still
            // open, republished the events behind it without it (an order violation of this
            // model, not of the product: seed 1, trace 467231, 2026-12-06).
            let stuck: Vec<usize> = self
                .ledger
                .holds
                .values()
                .filter(|h| h.state == HoldState::Held)
                .filter_map(|h| h.blocking)
                .filter(|b| self.ledger.open_quarantine(*b).is_none())
                .collect();
            if !stuck.is_empty() {
                for b in stuck {
                    let published = self.ledger.primary.contains_key(&b);
                    for h in self.ledger.holds.values_mut() {
                        if h.blocking == Some(b) {
                            h.state = HoldState::Releasing;
                            h.publish_blocking = !published;
                        }
                    }
                }
                continue;
            }
            let all_published = (0..self.rows.len()).all(|r| {
                self.rows[r].purged
                    || self.ledger.primary.contains_key(&r)
                    || self.ledger.skipped(r)
            });
            if all_published && self.open_unknown() == 0 {
                break;
            }
            // Something is still unresolved without anything to do: let time pass, to the
            // next parked event's due time if one waits. Past IDLE_LIMIT with nothing due,
            // nothing will ever happen: the judge sees what never progressed.
            let due = self.relays[i].core.next_unclear_due().map(|d| {
                d.duration_since(std::time::SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64)
            });
            // The run's lease keeper renews meanwhile, as it does on its own task in the
            // daemon (before 2026-12-07 the drain jumped to the due time at once, and a run
            // whose parked event was due past its lease ended for a lease it had kept).
            let until = (self.now + 500).max(due.unwrap_or(0));
            while self.now < until {
                self.now = until.min(self.now + 500);
                self.renew(i);
            }
            if due.is_none() {
                was_idle = true;
                idle += 1;
                if idle > IDLE_LIMIT {
                    break;
                }
            }
        }
        for c in 0..CONSUMERS {
            loop {
                let before: usize = self.consumers[c].pos.iter().sum();
                self.consume(c);
                if self.consumers[c].pos.iter().sum::<usize>() == before {
                    break;
                }
            }
        }
    }

    // ------------------------------------------------------------------------------ judging
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A finished, clean trace whose broker and ledger hold published events.
    fn clean_world() -> World {
        for trace in 0..50 {
            let mut w = World::new(SplitMix64::for_trace(1, trace), None, false);
            w.run();
            if w.c.violations() == 0 && !w.ledger.primary.is_empty() {
                return w;
            }
        }
        panic!("no clean trace with a published event in 50");
    }

    #[test]
    fn a_broker_copy_under_an_id_no_committed_row_has_is_a_second_id() {
        let mut w = clean_world();
        assert_eq!(w.c.second_ids, 0);
        let (t, p) = (0..TOPICS.len())
            .flat_map(|t| (0..MAX_PARTITIONS).map(move |p| (t, p)))
            .find(|(t, p)| !w.broker[*t][*p].is_empty())
            .expect("a message");
        let mut copy = w.broker[t][p][0].clone();
        copy.id = Uuid::from_u128(0xdead);
        w.broker[t][p].push(copy);
        w.judge();
        assert_eq!(w.c.second_ids, 1);
    }

    /// The settle time is the product's assumption that nothing sent is appended later than
    /// that. A broker that breaks it makes a scan prove an absence too early: the retry and
    /// the late copy both land, and the judge names the attempt wrongly resolved ABSENT.
    #[test]
    fn an_append_later_than_the_settle_time_is_an_untraced_unknown() {
        let untraced: u64 = (0..200)
            .map(|trace| {
                let mut w = World::new(SplitMix64::for_trace(1, trace), None, false);
                w.max_append_delay = 3 * SETTLE;
                w.run();
                w.c.unknown_untraced
            })
            .sum();
        assert!(
            untraced > 0,
            "no attempt resolved ABSENT before its late append in 200 traces"
        );
    }

    /// A product bug found by giving the model plain rows (2026-12-05): the running
    /// reconciliation looked up an open DISPATCH_UNKNOWN attempt of a row written plainly
    /// (an attempt of an event published before the run started, which the run does not hand
    /// to its replay, or one another generation recorded after it started) and loaded its
    /// event from SQL (`outboxd`'s `unknown::load`), where the row has neither version nor
    /// route: `event_from_row` failed, the error was not transient, and the daemon stopped,
    /// again at every restart while the attempt was open. Modelled as that daemon
    /// (`World::plain_lookups_as_daemon`), `plain_rows_unreadable` counts the runs it ends;
    /// as the product is now (the attempt keeps the relay's version and route version), no
    /// run ends and the look-ups run.
    #[test]
    fn a_plain_rows_attempt_is_looked_up_with_what_the_relay_gave_it_not_fatal() {
        let run = |as_daemon: bool| {
            (0..300)
                .map(|trace| {
                    let mut w = World::new(SplitMix64::for_trace(1, trace), None, false);
                    w.plain_lookups_as_daemon = as_daemon;
                    w.run();
                    (w.c.plain_rows_unreadable, w.c.plain_reconcile_lookups)
                })
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
        };
        let (unreadable, _) = run(true);
        assert!(
            unreadable > 0,
            "no running reconciliation looked up a plain row's attempt in 300 traces"
        );
        let (unreadable, looked_up) = run(false);
        assert_eq!(unreadable, 0);
        assert!(looked_up > 0, "no look-up of a plain row's attempt ran");
    }

    #[test]
    fn a_primary_receipt_at_a_position_without_its_event_is_lost() {
        let mut w = clean_world();
        assert_eq!(w.c.lost, 0);
        let (row, rc) = w
            .ledger
            .primary
            .iter()
            .map(|(r, rc)| (*r, *rc))
            .min_by_key(|(r, _)| *r)
            .expect("a primary receipt");
        let end = w.broker[rc.topic][rc.partition].len();
        // The event stays on the broker; only the receipt points past the log's end.
        w.ledger.primary.insert(row, Receipt { offset: end, ..rc });
        w.judge();
        assert_eq!(w.c.lost, 1);
    }
}
