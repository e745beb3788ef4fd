//! The planted mutants: deliberately broken variants of the relay's decisions, so that the
//! simulator proves its gate catches bugs in the product's code, not only in a model of it.
//! Every core of this crate takes a [`Plant`]; the daemon's is [`Shipped`] (nothing planted,
//! in every build), the simulator's [`Planted`]. A leaf of the crate: every decision module
//! reads it, and it reads none of them.

/// A deliberately broken variant of one decision, so that the simulator can prove its gate
/// catches bugs in the product's code, not only in a model of it. Only a [`Plant`] other than
/// [`Shipped`] (the simulator's [`Planted`]) plants one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutant {
    /// Resolves an event in the ack tracker when the broker reports it, before its receipt is
    /// accepted: a driver that confirms the tracker's watermark confirms unaccepted events.
    ConfirmBeforeAccept,
    /// A retry (an attempt generation above 1) is sent to the current route instead of the
    /// frozen destination ([`crate::pipeline::PipelineCore::current_route`]).
    RetryReresolvesRoute,
    /// The route check runs when an event is decoded, not at the head of its aggregate (the
    /// bug the simulator found at seed 1, trace 143).
    PoisonBeforeGate,
    /// An event that must wait behind its aggregate's in-flight event is sent at once as
    /// well: two events of one aggregate in flight, so a failed earlier one lands after it.
    SecondInFlight,
    /// A success report is taken as a receipt without checking that it names a position
    /// (librdkafka's implicit ack reports offset -1001 for a message the broker never stored).
    OkWithoutOffsetIsProof,
    /// The product before the simulator found it (seed 1, trace 1380): a run's start reads
    /// the gate's heads before start-up reconciliation only ([`crate::lifecycle::RunStart`]
    /// skips `RaiseHeads`), and a version-gap hold leaves the events queued behind the
    /// aggregate's in-flight event in the gate, where nothing sends them.
    GapHoldStrandsQueue,
    /// A parked event never comes due: no look-up or resend ever resolves an unclear
    /// outcome, so its aggregate waits forever (the simulator's `stalls`).
    UnclearNeverDue,
    /// The route check no longer compares the frozen destination's cluster with the clusters
    /// this relay serves: an event frozen for another cluster goes to the served cluster's
    /// topic of the same name (the simulator's `cross_destination_retries`).
    RouteIgnoresCluster,
    /// A found copy raises the head of an aggregate the gate does not know yet to its version
    /// (the gate then takes that version for the head, and a later published one for a gap:
    /// the bug the simulator found at seed 1, trace 26811, once heads were read when first
    /// met).
    FoundRaisesUnknownHead,
    /// A fleet member takes a shard only when no unexpired lease names a holder, live member
    /// or not ([`crate::fleet::plan_planted`]): a SIGKILLed member's shards wait for its
    /// leases to expire instead of being taken at once (the simulator's `fleet_unserved`).
    FleetWaitsForExpiry,
    /// A fleet member's fair share is the shard count over the members rounded *down*: with
    /// a count the members do not divide, some shards are nobody's (`fleet_unserved`).
    FleetShareRoundsDown,
    /// A fleet member over its share never hands a shard over: a member that joins, or
    /// resumes after its shards moved, gets nothing back (`fleet_share_not_returned`).
    FleetNeverHandsOver,
    /// The fleet plan before the simulator: relays waiting for a live member's lease fill the
    /// member's share (a shard handed over at start-up stayed unserved until they were given
    /// up).
    FleetWaitingFillsShare,
    /// The fleet plan before the simulator: nobody hands a shard over to a member under the
    /// floor while every other member holds the rounded-up share (8 over 5: 2, 2, 2, 2, 0).
    FleetNoEvening,
    /// A fleet member that aborts a shard relay whose stop hung keeps its lease: the shard is
    /// nobody's until the lease expires, a lease TTL after the abort (the simulator's
    /// `fleet_unserved`; the member loop before issue 26's fix).
    FleetAbortKeepsLease,
    /// A poll round does not raise an aggregate's head to just below its first pending
    /// version ([`crate::poll`]): a receipt a paused relay's salvage accepted after this run
    /// read the head looks like a gap, and the aggregate is held behind a published event
    /// (the simulator's `stalls`; found by it in poll mode's first design).
    PollStaleHead,
    /// An event that reconciliation found on the broker while it waited in the gate behind
    /// its aggregate's unclear event is sent anyway when that one resolves (the product
    /// before the simulator's `resent_after_proof` found it: the found check ran only when an
    /// event was decoded).
    SendsFoundEvent,
    /// An open attempt of a published event is looked up by sending the event again under
    /// its key (JetStream's `Nats-Msg-Id`, HTTP's idempotency key), instead of being closed by
    /// the receipt the destination already gave for that key
    /// ([`crate::pipeline::PipelineCore::closes_by_receipt`]; the simulator's `resent_published`).
    ResendsAnsweredEvent,
    /// A parked event whose open attempt the running reconciliation resolved while it waited
    /// for its own look-up keeps asking a ledger that has no open attempt left, and its
    /// aggregate waits until the next restart ([`crate::pipeline::PipelineCore::resolved_meanwhile`]; the
    /// simulator's `stalls`, once reconciliation's look-ups answered later, as the daemon's do).
    IgnoresResolvedMeanwhile,
    /// DISPATCH_UNKNOWN attempts are looked up without waiting out the settle time, in
    /// reconciliation and for a parked event: a Kafka request that was still on its way lands
    /// after the scan proved it absent, and the retry makes a second copy (the simulator's
    /// `unknown_untraced`, wrongly absent).
    IgnoresSettle,
    /// The running reconciliation looks nothing up: an UNKNOWN attempt a paused predecessor
    /// recorded after this run started stays open until the next start (the product before
    /// the simulator found it, seed 1 trace 44; its `unknown_untraced`).
    UnknownOnlyAtStart,
    /// A parked event's look-up starts while the running reconciliation is looking the same
    /// event up (an attempt left open at start, looked up before the run reached and parked
    /// its event): two look-ups of one event at once (the simulator's `concurrent_lookups`).
    LookUpBesideReconciliation,
    /// A poll round skips only the aggregates parked while it goes on, not those parked when
    /// it began: one resolved before the round reaches its rows is sent again from the
    /// round's stale read (the simulator's `resent_after_proof`).
    RoundForgetsParked,
    /// A poll round reads before what was sent since the last round is reported and accepted
    /// ([`crate::poll::PollRun`] skips [`crate::poll::RoundStep::DrainBefore`]): an event the
    /// broker answered, whose receipt is still in the batch, is read as pending and sent
    /// again after a clear answer (the simulator's `resent_after_proof`).
    RoundReadsBeforeDrain,
    /// Events that wait on an unclear outcome count against `max_in_flight`
    /// ([`crate::pipeline::PipelineCore::waiting_on_unclear`] says none do): an aggregate whose events keep
    /// coming behind its unclear one stops the slot being read for every aggregate (the
    /// simulator's `reading_stopped_by_unclear`).
    UnclearWaitCountsAsInFlight,
    /// An unclear delivery report ends the run ([`crate::CoreError::UnclearEndsRun`]) instead of
    /// parking its event: every aggregate waits for the restart (the relay before issue 25;
    /// the simulator's `unclear_restarts`).
    EndsRunOnUnclear,
    /// The acceptance that moves the checkpoint keeps no numbering
    /// ([`crate::pipeline::PipelineCore::numbered_through`] gives nothing): a restart seeds the aggregates of
    /// rows written without a version from what an older checkpoint kept, or 0, and numbers
    /// them again from there (the simulator's `plain_version_wrong`; the e2e test
    /// `plain_insert` planted the same by hand and saw receipts restart at 1).
    NumberingNotKept,
    /// A CDC run starts without folding the numbering log into the map it reads
    /// ([`crate::lifecycle::CdcStart`] skips [`crate::lifecycle::CdcStep::FoldNumbering`]):
    /// what the last runs logged since the last fold is missed, and rows written without a
    /// version are numbered again from older versions (the simulator's `plain_version_wrong`).
    NumberingLogNotFolded,
    /// A read outside the stream (a snapshot, a poll round) goes on after a send was refused
    /// because the lease was not certainly held ([`crate::pace`] without its lease check):
    /// it waits for events queued behind the refused one, which nothing sends (the
    /// simulator's `read_stalls`; the product before the simulator's reads paced as the
    /// daemon's do).
    ReadIgnoresLease,
    /// The stream sends an event the operator skipped when it meets it after the hold is gone
    /// ([`crate::PipelineCore::skipped_by_operator`] and `TxnCore`'s are ignored): a run
    /// replaying from a
    /// checkpoint before the skipped event (`skipped_offered`; the product before seed 1,
    /// trace 53667 found it, once the simulator's reads were held back as the daemon's are).
    StreamSendsSkipped,
    /// A CDC run streams from a slot it holds without reading the slot's position again
    /// ([`crate::lifecycle::CdcStart::check_held`] accepts any): a slot dropped and recreated
    /// under the same name between the plan and `START_REPLICATION` streams from its own,
    /// later position, and what was committed in between is never read (the simulator's
    /// `lost` and `confirmed_past_unaccepted`).
    HeldSlotUnchecked,
    /// A lease renewal's answer makes the lease certain from when the answer was read, not
    /// from when the renewal was asked ([`crate::lifecycle::LeaseKeeper::answered`]): a relay
    /// paused between the two resumes believing in a lease that expired while it was stopped,
    /// and sends beside the relay that took it over (the simulator's `stale_sends`).
    LeaseFromAnswer,
    /// The loop never writes an idle checkpoint ([`crate::schedule::Schedule::due`]): what
    /// the stream resolved without a batch (a keepalive past the last transaction) is never
    /// written nor confirmed, and a slot whose outbox is quiet retains the server's WAL for
    /// good (the simulator's `checkpoint_not_written`).
    IdleCheckpointNeverDue,
    /// A release starts while an event of its aggregate is parked after an unclear outcome
    /// ([`crate::pipeline::PipelineCore::may_release`] looks at the broker only): it sends the parked event,
    /// and the event's own look-up sends it again when it comes due (the product before the
    /// simulator found it, seed 1 trace 890786; its `resent_after_proof`).
    ReleaseBesideParked,
    /// Exactly-once mode ([`crate::txn`]): the start accepts none of the batches the broker
    /// recorded after the ledger's last, and the stream sends them again (the simulator's
    /// `txn_seen_twice`).
    TxnIgnoresRecords,
    /// Exactly-once mode: a commit whose outcome is unknown is taken for aborted and its
    /// batch sent again in the next transaction (`txn_seen_twice` when the broker had
    /// committed it).
    TxnUnknownIsAborted,
    /// Exactly-once mode: a batch's checkpoint is the last stream commit admitted, not the
    /// last one the batch covers: accepted, it passes events still queued, which a crash then
    /// skips (`txn_lost`).
    TxnThroughPastBatch,
    /// Exactly-once mode: an aborted transaction's stored events are accepted as receipts
    /// (`txn_receipt_mismatch`: the broker holds them in an aborted transaction).
    TxnAcceptsAborted,
    /// Exactly-once mode: every event of a stream transaction read again after a crash is
    /// taken for accepted, by its commit position alone
    /// ([`crate::txn::TxnCore::replayed_accepted`] ignores the heads): the events of a
    /// transaction split over two batches whose second batch was never accepted are skipped
    /// (`txn_lost`).
    TxnReplayedIsAccepted,
    /// Exactly-once mode: what queued while a transaction was open waits for the next linger
    /// once the broker answered ([`crate::txn::TxnCore::broker_answered`] flushes nothing): a
    /// batch filled during the transaction started no linger, so it waits for ever
    /// (`txn_lost`: the simulator's drain finds nothing that moves it).
    TxnAnswerLeavesQueue,
    /// An exactly-once run told to stop confirms and gives the lease back at once
    /// ([`crate::txn::TxnEnd`] waits for nothing): the transaction it began for what it read
    /// is left open, to be aborted by the next holder, and its events are sent again (the
    /// simulator's `txn_stops_left_open`; the daemon's stop before 2026-12-07 never read its
    /// sends' reports, with the same effect).
    TxnStopWithoutWaiting,
    /// Exactly-once mode: an event read again whose receipt the ledger holds is sent again
    /// (`txn_seen_twice`: a stream transaction split over two batches, after a crash).
    TxnReplaysAccepted,
    /// Exactly-once mode: the start skips the first batch the broker recorded after the
    /// ledger's last (an off-by-one in the batch numbers): its events are sent again and its
    /// record never accepted (`txn_unaccepted`, `txn_seen_twice`).
    TxnSkipsFirstRecord,
    /// Exactly-once mode: an aborted transaction's events are queued again behind what was
    /// admitted meanwhile, not in front of it (`txn_order_violations`).
    TxnRequeuesAtBack,
}

/// The route a re-resolving mutant sends retries to: (cluster, topic, route generation).
pub type CurrentRoute = (String, String, i64);

/// What a [`crate::pipeline::PipelineCore`] plants. The daemon's core is a `PipelineCore<Shipped>`: it plants
/// nothing, and since no crate feature switches that, every build of the daemon (the one the
/// end-to-end suite runs under `cargo test --workspace` included) is the one shipped. The
/// simulator drives a `PipelineCore<Planted>`, a second instance of the same code.
pub trait Plant: std::fmt::Debug {
    /// Whether the mutant `m` is planted.
    fn planted(&self, m: Mutant) -> bool;
    /// Where [`Mutant::RetryReresolvesRoute`] sends retries.
    fn current_route(&self) -> Option<CurrentRoute>;
}

/// The product: no mutant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shipped;

impl Plant for Shipped {
    #[inline(always)]
    fn planted(&self, _: Mutant) -> bool {
        false
    }

    #[inline(always)]
    fn current_route(&self) -> Option<CurrentRoute> {
        None
    }
}

/// The simulator's plant: `mutant`, and the route policy now (for
/// [`Mutant::RetryReresolvesRoute`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Planted {
    pub mutant: Option<Mutant>,
    pub current_route: Option<CurrentRoute>,
}

impl Plant for Planted {
    fn planted(&self, m: Mutant) -> bool {
        self.mutant == Some(m)
    }

    fn current_route(&self) -> Option<CurrentRoute> {
        self.current_route.clone()
    }
}
