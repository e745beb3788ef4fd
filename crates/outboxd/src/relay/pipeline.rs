//! The pipeline's driver: it executes what [`PipelineCore`] decides.
//!
//! Every decision (route check, ordering gate, what a delivery report means, what a batch
//! holds and which checkpoint it justifies) is made by `outbox_relay::PipelineCore`, which
//! does no I/O. This module owns what the core may not touch: the sink, the ledger
//! connections, the pipelined acceptance task, the failpoints, metrics and the clock. Each
//! method feeds one input to the core and carries out the commands it returns.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use outbox_core::{Lsn, OutboxEvent};
use outbox_ledger::attempts;
use outbox_ledger::holds::{self, AggKey};
use outbox_ledger::lease::Fence;
use outbox_ledger::{accept, AcceptOutcome};
use outbox_relay::lifecycle::{EndStep, Ending, RunEnd};
use outbox_relay::release::{PollStep, ReleasePoll, Released};
use outbox_relay::stage::{Stage, Staged};
use outbox_relay::unknown::When;
use outbox_relay::{
    Acceptance, AcceptanceEnd, Command, LookupFor, LookupOutcome, Now, OpenAttempt, ParkedInput,
    ParkedLookup, ParkedStep, Pending, PipelineCore, Reported, UnclearStep,
};
use outbox_sink::{
    AnySink, Delivery, DeliveryOutcome, Lookup, Served, Sink, SinkError, UnknownLookup,
};
use outbox_source::snapshot::{events_by_id, Numbering};
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio_postgres::Client;

use super::{Progress, RelayError};
use crate::config::RelayConfig;
use crate::failpoint;

use outbox_relay::pace::{Drain, Pace};
pub use outbox_relay::read::Read;
use outbox_relay::read::{Chunks, ReadAdmitted, Unreadable};
use outbox_relay::schedule::{Bounds, Waiting};
pub(crate) use outbox_relay::MAX_IN_FLIGHT_BYTES;

/// The most delivery reports one turn of the stream loop handles ([`Pipeline::on_reports`]):
/// a librdkafka produce response answers a batch at once, so reports arrive in bursts.
const REPORTS_PER_TURN: usize = 64;

pub(crate) struct Pipeline {
    /// The decisions.
    pub core: PipelineCore,
    /// Shared with the look-up tasks of parked events.
    sink: Arc<AnySink>,
    pub reports: UnboundedReceiver<Delivery>,
    /// Finished look-ups of parked events ([`Self::on_lookup`]).
    pub lookups: UnboundedReceiver<LookupDone>,
    lookups_tx: UnboundedSender<LookupDone>,
    pub client: Client,
    fence: Fence,
    /// Our lease, kept by the lease keeper task. Without it, nothing is sent.
    lease: std::sync::Arc<super::LeaseState>,
    slot: String,
    /// The connection for pipelined acceptance ([`Self::flush_pipelined`]); `None` while its
    /// transaction runs (the connection is inside [`Self::accepting`]) or when not enabled.
    accept_client: Option<(Client, accept::Prepared)>,
    pub accepting: Option<Accepting>,
    /// Where a due fold of the numbering log runs: a connection of its own, opened per fold
    /// ([`Self::fold_in_background`], set by [`Self::enable_pipelined_accept`]); without it,
    /// on [`Self::client`] after the acceptance's commit.
    fold_url: Option<String>,
    /// The fold running in the background, if one does (one at a time).
    folding: Option<tokio::task::JoinHandle<()>>,
    /// For the relay of one shard: the condition on `aggregate_id` of its aggregates, the only
    /// ones whose releases it publishes.
    pub shard_filter: Option<String>,
}

/// An acceptance transaction running on its own task while the relay goes on reading the
/// slot, sending and collecting reports. At most one runs at a time, and no other acceptance
/// starts before it is settled, so acceptance transactions commit in the order they were
/// built: a checkpoint never commits before the receipts of an earlier batch.
pub(crate) struct Accepting {
    task: tokio::task::JoinHandle<AcceptDone>,
    started: Instant,
}

/// Completes when the pipelined acceptance transaction in `a` has finished (never, if none
/// runs). Cancel-safe; takes the field, not the pipeline, so it can sit in a `select!` next
/// to `pipeline.reports`. Hand the result to [`Pipeline::finish_accept`].
pub(crate) async fn accept_finished(
    a: &mut Option<Accepting>,
) -> Result<AcceptDone, tokio::task::JoinError> {
    match a {
        Some(a) => (&mut a.task).await,
        None => std::future::pending().await,
    }
}

/// A look-up that finished on its task: the event, its open attempt, when the look-up
/// started, and what the sink proved (an error proves nothing). Of a parked event, or of
/// another generation's attempt the running reconciliation found (`reconciling`).
pub(crate) struct LookupDone {
    event: OutboxEvent,
    /// Started by the running reconciliation (`Pipeline::start_reconcile_lookup`), not for a
    /// parked event.
    reconciling: bool,
    attempt: attempts::UnknownAttempt,
    started: Instant,
    result: Result<Lookup, SinkError>,
    /// Whether the look-up re-sent the event under its key (`Sink::lookup_resends`).
    resent: bool,
    /// What the look-ups of the event's later attempts proved, in this round.
    prior: Option<LookupOutcome>,
}

/// Completes with the next finished look-up; never while none can arrive. Cancel-safe.
pub(crate) async fn lookup_finished(rx: &mut UnboundedReceiver<LookupDone>) -> LookupDone {
    match rx.recv().await {
        Some(d) => d,
        None => std::future::pending().await,
    }
}

/// Sleeps until the core's next parked event is due (forever if none waits). Cancel-safe.
pub(crate) async fn unclear_due(core: &PipelineCore) {
    match core.next_unclear_due() {
        Some(at) => {
            let left = at
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO);
            tokio::time::sleep(left).await
        }
        None => std::future::pending().await,
    }
}

/// What a fold of the numbering log did, in the relay's log.
fn log_fold<E: std::fmt::Display>(slot: &str, r: Result<u64, E>) {
    match r {
        Ok(n) => tracing::info!(slot, aggregates = n, "numbering log folded"),
        Err(e) => tracing::warn!(
            slot,
            error = %e,
            "folding the numbering log failed; it stays logged, and the next run folds it at its start"
        ),
    }
}

/// One acceptance transaction, keeping what `a` numbered with the checkpoint when there is
/// any.
async fn run_acceptance(
    client: &mut Client,
    prepared: &mut accept::Prepared,
    slot: &str,
    a: &Acceptance,
    fence: &Fence,
) -> Result<AcceptOutcome, outbox_ledger::LedgerError> {
    let (items, checkpoint, fence) = (&a.items, a.checkpoint, Some(fence));
    match (checkpoint, a.numbered.as_ref()) {
        (Some(c), Some(n)) => {
            accept::accept_numbered_batch(client, prepared, slot, items, c, fence, n).await
        }
        _ => accept::accept_batch_prepared(client, prepared, slot, items, checkpoint, fence).await,
    }
}

/// How a failed acceptance transaction ended for the core: fenced (it committed, only the
/// checkpoint was refused) or not committed at all.
fn ended_by(e: &outbox_ledger::LedgerError) -> AcceptanceEnd {
    if matches!(e, outbox_ledger::LedgerError::LeaseLost { .. }) {
        AcceptanceEnd::Fenced
    } else {
        AcceptanceEnd::Failed
    }
}

pub(crate) type AcceptDone = (
    (Client, accept::Prepared),
    Acceptance,
    Result<AcceptOutcome, outbox_ledger::LedgerError>,
);

impl Pipeline {
    pub fn new(
        sink: AnySink,
        reports: UnboundedReceiver<Delivery>,
        client: Client,
        slot: &str,
        fence: Fence,
        lease: std::sync::Arc<super::LeaseState>,
        gate: outbox_core::OrderingGate<AggKey, Pending>,
    ) -> Self {
        let (lookups_tx, lookups) = mpsc::unbounded_channel();
        Pipeline {
            core: PipelineCore::new(sink.served(), fence.generation, gate),
            sink: Arc::new(sink),
            reports,
            lookups,
            lookups_tx,
            client,
            fence,
            lease,
            slot: slot.to_string(),
            accept_client: None,
            accepting: None,
            fold_url: None,
            folding: None,
            shard_filter: None,
        }
    }

    /// Events waiting on unclear outcomes, counted at most every
    /// [`outbox_relay::schedule::WAITING_SAMPLE`] ([`PipelineCore::waiting_sampled`]).
    pub fn waiting_on_unclear(&mut self) -> Waiting {
        let wall = self.now().wall;
        self.core.waiting_sampled(wall)
    }

    /// The broker this relay publishes to (reconciliation asks it about UNKNOWN attempts).
    pub fn sink(&self) -> &AnySink {
        &self.sink
    }

    pub fn served(&self) -> &Served {
        self.core.served()
    }

    /// Gives the pipeline a second ledger connection, so that acceptance transactions run
    /// concurrently with streaming ([`Self::flush_pipelined`]), and the database's `url`, so
    /// that a due fold of the numbering log runs beside them ([`Self::fold_in_background`]).
    pub fn enable_pipelined_accept(&mut self, client: Client, url: &str) {
        self.accept_client = Some((client, accept::Prepared::default()));
        self.fold_url = Some(url.to_string());
    }

    /// After the commit of an acceptance whose numbering said the log is due: folds it
    /// (`outbox_ledger::numbering::fold`) on a connection of its own, beside the
    /// acceptances, unless a fold runs already (it takes what it sees; the next is due a
    /// few million entries later). Without a URL ([`Self::enable_pipelined_accept`] not
    /// called) it returns `false`, and the caller folds on its own connection. A failed fold
    /// is only logged: the log stays, and every run folds it at its start.
    fn fold_in_background(&mut self) -> bool {
        let Some(url) = self.fold_url.clone() else {
            return false;
        };
        if self.folding.as_ref().is_some_and(|t| !t.is_finished()) {
            return true;
        }
        let slot = self.slot.clone();
        self.folding = Some(tokio::spawn(async move {
            let r = match super::connect_sql(&url).await {
                Ok(c) => outbox_ledger::numbering::fold(&c, &slot)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            log_fold(&slot, r);
        }));
        true
    }

    /// Sent, or waiting behind an aggregate's in-flight event.
    pub fn outstanding(&self) -> usize {
        self.core.outstanding()
    }

    /// What the core needs to know about now: the wall clock and the lease.
    fn now(&self) -> Now {
        Now {
            wall: std::time::SystemTime::now(),
            lease_valid: self.lease.valid(),
        }
    }

    /// Reads the heads of the aggregates of `events` that the gate does not know yet, in one
    /// query, and gives them to the gate (migration 0026: heads are read when first met).
    /// `stream`: the events come from the replication stream, where every later version of an
    /// aggregate follows the one met first, so only what is below it needs reading
    /// ([`holds::heads_of`]); a snapshot, which skips published rows, reads whole heads.
    ///
    /// From the stream, rows written without a version need their aggregates' numbering
    /// instead: what the checkpoint kept for them (`outbox.stream_versions`), read in one
    /// query too.
    pub async fn learn_heads<'a>(
        &mut self,
        events: impl IntoIterator<Item = &'a OutboxEvent> + Clone,
        stream: bool,
    ) -> Result<(), RelayError> {
        if stream {
            let keys = self.core.unnumbered_aggregates(events.clone());
            if !keys.is_empty() {
                let versions =
                    outbox_ledger::numbering::versions_of(&self.client, &self.slot, &keys).await?;
                tracing::debug!(
                    aggregates = keys.len(),
                    "numbering read for aggregates of rows written without a version"
                );
                self.core
                    .seed_numbering(keys.into_iter().zip(versions).collect());
            }
        }
        let (keys, met): (Vec<AggKey>, Vec<i64>) =
            self.core.unknown_aggregates(events).into_iter().unzip();
        if !keys.is_empty() {
            let below = stream.then_some(met.as_slice());
            let heads = holds::heads_of(&self.client, &keys, below).await?;
            tracing::debug!(
                aggregates = keys.len(),
                "heads read for aggregates met for the first time"
            );
            self.core.raise_heads(heads);
        }
        Ok(())
    }

    /// The staged messages of the stream loop (`outbox_relay::stage`): the heads of their
    /// aggregates read, then each given to the core in the order it came.
    pub async fn learn_heads_and_replay(
        &mut self,
        stage: &mut Stage,
        schedule: &mut outbox_relay::schedule::Schedule,
    ) -> Result<(), RelayError> {
        self.learn_heads(stage.events(), true).await?;
        for m in stage.take() {
            self.take_message(m, schedule).await?;
        }
        Ok(())
    }

    /// One message of the stream, in order, to the core ([`PipelineCore::take`]).
    pub async fn take_message(
        &mut self,
        m: Staged,
        schedule: &mut outbox_relay::schedule::Schedule,
    ) -> Result<(), RelayError> {
        let now = self.now();
        let taken = self.core.take(m, now)?;
        if taken.reply_requested {
            schedule.status_requested();
        }
        if taken.commands.is_empty() {
            return Ok(());
        }
        self.execute(taken.commands).await
    }

    /// Hands each event to the producer. A refusal goes back to the core, which quarantines
    /// the event (permanent) or parks it to send it again (only its aggregate waits).
    async fn execute(&mut self, commands: Vec<Command>) -> Result<(), RelayError> {
        if !commands.is_empty() {
            self.sink.pace(self.core.round_trip_bound());
        }
        // Set when the producer failed for good: the rest is refused unsent, as it would be.
        let mut producer_failed: Option<SinkError> = None;
        let mut work: std::collections::VecDeque<Command> = commands.into();
        while let Some(c) = work.pop_front() {
            let Command::Send {
                token,
                attempt,
                event,
            } = c;
            if let Some(e) = &producer_failed {
                let now = self.now();
                self.core.send_refused(token, None, &e.to_string(), now)?;
                continue;
            }
            failpoint::hit("before-send");
            // An aggregate that waited behind an unclear outcome may be held in the ledger by
            // now (a predecessor's late refusal): then the release sends what follows.
            let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
            if self.core.needs_hold_check(&key) && holds::is_held(&self.client, &key).await? {
                self.core.hold_unsent(token)?;
                continue;
            }
            match self.sink.send(&event, token).await {
                Ok(()) => {
                    tracing::trace!(event_id = %event.event_id, attempt, "handed to the producer");
                    // Under a deeper gate the aggregate's next version may follow it now (at
                    // depth 1 nothing does: no clock read on this path per event).
                    if self.core.aggregate_depth() > 1 {
                        let now = self.now();
                        work.extend(self.core.handed_over(token, now)?);
                    }
                }
                Err(e) => {
                    let now = self.now();
                    self.core
                        .send_refused(token, e.permanent_refusal(), &e.to_string(), now)?;
                    // The producer itself is gone (it refuses every message): the run ends
                    // and the next starts a new one. This event and the rest, refused, wait
                    // to be sent again; none was handed over, so none waits for a report.
                    if matches!(e, SinkError::ProducerFailed { .. }) {
                        producer_failed = Some(e);
                    }
                }
            }
        }
        match producer_failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Handles one delivery report; sends the aggregate's next event when there is one.
    pub async fn on_report(&mut self, d: Delivery) -> Result<(), RelayError> {
        if matches!(d.outcome, DeliveryOutcome::Persisted { .. }) {
            failpoint::hit("after-broker-ack");
        }
        let now = self.now();
        let reported = self.core.on_report(d, now)?;
        match reported {
            // Most reports free no queued event: nothing to execute, and no future to build.
            Reported::Continue(commands) if commands.is_empty() => Ok(()),
            Reported::Continue(commands) => self.execute(commands).await,
            Reported::Unclear(f) => {
                if let Some(u) = &f.unknown {
                    // The destination may have it. Record that before anything else happens
                    // to the event: a look-up resolves it while the relay runs, or the next
                    // start does.
                    attempts::record_unknown(
                        &self.client,
                        &self.slot,
                        u.event_id,
                        self.fence.generation,
                        u.attempt,
                        &u.topic,
                        u.partition,
                        u.sent_at,
                        &u.error,
                        u.by_relay,
                    )
                    .await?;
                    tracing::warn!(event_id = %u.event_id, error = %u.error, topic = %u.topic, partition = u.partition,
                        "DISPATCH_UNKNOWN recorded; only its aggregate waits for the look-up");
                }
                Ok(())
            }
        }
    }

    /// A report to a running loop ([`Pipeline::on_reports`], [`Pipeline::wait_one`]): handled,
    /// and then, if it is a failure, whether the producer failed with it (librdkafka fails
    /// what it had queued when it raises a fatal error, and refuses everything after). Then
    /// the run ends with [`SinkError::ProducerFailed`] (transient: the next run starts a new
    /// producer), the outcome already with the core (an unclear one recorded UNKNOWN). The
    /// salvage at a run's end reads its reports with [`Pipeline::on_report`] alone: it
    /// records every outcome whatever became of the producer.
    async fn on_live_report(&mut self, d: Delivery) -> Result<(), RelayError> {
        let failed = matches!(d.outcome, DeliveryOutcome::Failed { .. });
        self.on_report(d).await?;
        match failed.then(|| self.sink.failed()).flatten() {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Handles `d` and the reports that arrived with it, at most [`REPORTS_PER_TURN`] in all:
    /// one turn of the stream loop per report cost more than the report itself (the turn's
    /// clock reads, timer and bounds; docs/benchmarks.md "The relay's CPU per drained event").
    /// The bound keeps a turn short, so the loop still looks at a stop, the stream and the
    /// schedule as often as it needs to; each report is handled as it would be alone.
    pub async fn on_reports(&mut self, d: Delivery) -> Result<(), RelayError> {
        self.on_live_report(d).await?;
        for _ in 1..REPORTS_PER_TURN {
            match self.reports.try_recv() {
                Ok(d) => self.on_live_report(d).await?,
                Err(_) => break,
            }
        }
        Ok(())
    }

    /// Starts what the core says is due for parked events: a look-up on its own task (the
    /// loop goes on), or a resend.
    pub async fn run_due_unclear(&mut self) -> Result<(), RelayError> {
        let steps = self.core.due_unclear(self.now())?;
        for step in steps {
            match step {
                UnclearStep::Send(send) => self.execute(vec![send]).await?,
                UnclearStep::Lookup { event } => {
                    self.drive_lookup(ParkedLookup::due(event)).await?
                }
            }
        }
        Ok(())
    }

    /// Does what a parked event's look-ups ask ([`ParkedLookup`], which decides the sequence):
    /// reads its latest open DISPATCH_UNKNOWN attempt, closes one at its receipt, starts the
    /// look-up on its own task (the loop goes on; [`Self::on_lookup`] gets the answer), or
    /// hands what was proven to the core and sends what follows.
    async fn drive_lookup(
        &mut self,
        mut lookup: ParkedLookup<attempts::UnknownAttempt>,
    ) -> Result<(), RelayError> {
        let id = lookup.event_id();
        let mut input = ParkedInput::Begin;
        loop {
            input = match lookup.next(&mut self.core, input) {
                ParkedStep::ReadOpenAttempt => {
                    let open = attempts::open_unknown_of(&self.client, &self.slot, id).await?;
                    ParkedInput::Open(open.map(|attempt| OpenAttempt {
                        attempt_generation: attempt.attempt_generation,
                        has_receipt: attempt.has_receipt,
                        lookup_resends: self.sink.lookup_resends(sent_ago(&attempt)),
                        unknown_for: unknown_for(&attempt),
                        attempt,
                    }))
                }
                ParkedStep::CloseByReceipt(attempt) => {
                    // None: resolved meanwhile, or the receipt is gone (purged).
                    let closed = attempts::resolve_by_receipt(&self.client, attempt.id).await?;
                    if let Some(offset) = closed {
                        tracing::info!(event_id = %id, relay_generation = attempt.relay_generation, offset,
                            "DISPATCH_UNKNOWN of a parked event resolved by its receipt (the destination's answer under its key): not sent again");
                    }
                    ParkedInput::ClosedAt(closed)
                }
                ParkedStep::LookUp {
                    event,
                    attempt,
                    prior,
                } => {
                    self.spawn_lookup(event, attempt, prior, false);
                    return Ok(());
                }
                ParkedStep::Done { event_id, outcome } => {
                    let commands = self.core.lookup_done(event_id, outcome, self.now())?;
                    return self.execute(commands).await;
                }
            };
        }
    }

    /// Starts the look-up of another generation's open `attempt` of `event`, which the running
    /// reconciliation decided on (`Reconcile::LookUp`), on its own task: [`Self::on_lookup`]
    /// records what it proved.
    pub fn start_reconcile_lookup(
        &mut self,
        event: OutboxEvent,
        attempt: attempts::UnknownAttempt,
    ) {
        self.spawn_lookup(event, attempt, None, true);
    }

    fn spawn_lookup(
        &mut self,
        event: OutboxEvent,
        attempt: attempts::UnknownAttempt,
        prior: Option<LookupOutcome>,
        reconciling: bool,
    ) {
        let started = Instant::now();
        let resent = self.sink.lookup_resends(sent_ago(&attempt));
        let (sink, tx) = (self.sink.clone(), self.lookups_tx.clone());
        tokio::spawn(async move {
            let result = sink.lookup(lookup_of(&event, &attempt)).await;
            let _ = tx.send(LookupDone {
                event,
                reconciling,
                attempt,
                started,
                result,
                resent,
                prior,
            });
        });
    }

    /// A look-up finished (a parked event's, or one the running reconciliation started):
    /// record what it proved and close the event's other open attempts that a re-send under its
    /// key just answered (`Pipeline::close_answered`, in `unknown.rs`: never sent again after a
    /// clear answer); then the core learns it (`PipelineCore::lookup_answered`) and a parked
    /// event's round goes on: while it has another open attempt (an earlier run's, an earlier
    /// try's), that one is looked up too, so every attempt is traced; then what follows is
    /// sent (the retry, or the aggregate's next event).
    pub async fn on_lookup(&mut self, done: LookupDone) -> Result<(), RelayError> {
        let LookupDone {
            event,
            reconciling,
            attempt,
            started,
            result,
            resent,
            prior,
        } = done;
        let answer = match result {
            Ok(lookup) => {
                let answer = lookup.clone();
                let (slot, fence) = (self.slot.clone(), self.fence.clone());
                let resolved = self
                    .record_lookup(&slot, &fence, &attempt, &event, lookup, started)
                    .await?;
                self.close_answered(&slot, &event, resent, &answer, &resolved)
                    .await?;
                Ok(resolved)
            }
            Err(e) => {
                tracing::warn!(event_id = %event.event_id, topic = %attempt.topic, partition = attempt.partition, error = %e, reconciling,
                    "look-up of a DISPATCH_UNKNOWN attempt proved nothing; asking again (a parked event after its backoff, a reconciliation at the next release poll)");
                // The HTTP sink already waited out any Retry-After inside its deadline: the
                // core's own backoff follows.
                Err(e.to_string())
            }
        };
        let whose = if reconciling {
            LookupFor::Reconciling
        } else {
            LookupFor::Parked { prior }
        };
        match self.core.lookup_answered(event, whose, answer) {
            Some(round) => self.drive_lookup(round).await,
            None => Ok(()),
        }
    }

    /// Waits for the next thing that moves the pipeline on — a delivery report, a finished
    /// look-up, a parked event falling due — and handles it; or for `until`, if given.
    /// Returns the report's token, if it was a report. Only the waiting races (cancel-safe
    /// receives); what arrived is handled after, never dropped half-way.
    pub async fn wait_one(
        &mut self,
        until: Option<tokio::time::Instant>,
    ) -> Result<Option<u64>, RelayError> {
        enum Got {
            Report(Option<Delivery>),
            Lookup(Box<LookupDone>),
            Due,
            Until,
        }
        let deadline = async {
            match until {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let got = tokio::select! {
            d = self.reports.recv() => Got::Report(d),
            done = lookup_finished(&mut self.lookups) => Got::Lookup(Box::new(done)),
            _ = unclear_due(&self.core) => Got::Due,
            _ = deadline => Got::Until,
        };
        match got {
            Got::Report(Some(d)) => {
                let token = d.token;
                self.on_live_report(d).await?;
                Ok(Some(token))
            }
            Got::Report(None) => Err(RelayError::Internal("delivery channel closed".into())),
            Got::Lookup(done) => self.on_lookup(*done).await.map(|()| None),
            Got::Due => self.run_due_unclear().await.map(|()| None),
            Got::Until => Ok(None),
        }
    }

    /// After an event admitted outside the stream (a snapshot, a poll round): waits and
    /// accepts as the core's pace says ([`PipelineCore::pace`]).
    pub async fn keep_pace(
        &mut self,
        bounds: Bounds,
        progress: &Progress,
    ) -> Result<(), RelayError> {
        loop {
            let wall = self.now().wall;
            match self.core.pace(bounds, wall) {
                Pace::Wait => {
                    self.wait_one(None).await?;
                }
                Pace::Accept => {
                    self.flush(false, progress).await?;
                }
                Pace::Go => return Ok(()),
                Pace::LeaseLost => return Err(super::lease_lost(&self.slot, &self.fence)),
            }
        }
    }

    /// At the end of a read outside the stream: waits and accepts as the core says
    /// ([`PipelineCore::draining`]) until nothing admitted is outstanding (with
    /// `parked_may_stay`, a poll round's, nothing at the broker), then accepts the rest.
    pub async fn drain_all(
        &mut self,
        batch_size: usize,
        progress: &Progress,
        parked_may_stay: bool,
    ) -> Result<(), RelayError> {
        loop {
            match self.core.draining(batch_size, parked_may_stay) {
                Drain::Accept => {
                    self.flush(false, progress).await?;
                }
                Drain::Wait => {
                    self.wait_one(None).await?;
                }
                Drain::Done => {
                    self.flush(false, progress).await?;
                    return Ok(());
                }
                Drain::LeaseLost => return Err(super::lease_lost(&self.slot, &self.fence)),
            }
        }
    }

    /// The rows of a read (the initial snapshot's, or a poll round's) to the core, in
    /// chunks ([`outbox_relay::read`]): the heads of a chunk's aggregates the gate does not
    /// know are read in one query first (migration 0026; in a poll round the floor below the
    /// round's own "every version below the first pending one has a receipt": a found copy
    /// may be published above an earlier version without one, `outbox-sim` seed 1 trace
    /// 19152), then each row is admitted by the read's rules or, if it cannot be read as an
    /// event, quarantined under a key of the read; after each row the pipeline keeps within
    /// its bounds. Returns how many rows were read.
    pub async fn admit_rows(
        &mut self,
        rows: impl futures::Stream<Item = Result<tokio_postgres::Row, tokio_postgres::Error>>,
        read: Read,
        bounds: Bounds,
        progress: &Progress,
    ) -> Result<u64, RelayError> {
        use futures::StreamExt;
        futures::pin_mut!(rows);
        let mut n: u64 = 0;
        let mut chunks = Chunks::default();
        loop {
            let (chunk, ended) = match rows.next().await {
                Some(row) => {
                    let row = row.map_err(|e| outbox_ledger::LedgerError::Db {
                        context: reading(read).into(),
                        source: e,
                    })?;
                    n += 1;
                    let row =
                        outbox_source::snapshot::event_from_row(&row).map_err(|e| Unreadable {
                            key: unreadable_key(read, &row, n),
                            error: e.to_string(),
                        });
                    match chunks.offer(row) {
                        Some(chunk) => (chunk, false),
                        None => continue,
                    }
                }
                None => (chunks.end(), true),
            };
            self.learn_heads(outbox_relay::read::events(&chunk), false)
                .await?;
            for row in chunk {
                let now = self.now();
                if let ReadAdmitted::Admitted(commands) = self.core.admit_read(read, row, now)? {
                    self.execute(commands).await?;
                    if read == Read::Snapshot {
                        failpoint::hit("after-snapshot-send");
                    }
                }
                self.keep_pace(bounds, progress).await?;
            }
            if ended {
                return Ok(n);
            }
        }
    }

    /// After a committed acceptance transaction: failpoint, counters, then the checkpoint
    /// (the core learns of it only now).
    fn accepted(&mut self, a: Acceptance, out: &AcceptOutcome, progress: &Progress) {
        if out.primary + out.duplicates > 0 {
            failpoint::hit("after-accept");
        }
        // Before the checkpoint moves: that drops the commit times these receipts are matched to.
        progress.metrics.receipts_accepted(&a.items);
        if let Some(c) = a.checkpoint {
            progress.set_checkpoint(c);
        }
        self.core.acceptance_ended(a, AcceptanceEnd::Committed);
        progress.record(out);
    }

    /// One acceptance transaction: the batch, plus (when `track`) the checkpoint the tracker
    /// allows after resolving it. The core learns of the checkpoint only after COMMIT. A
    /// pipelined transaction still running is settled first. If that one was fenced (it
    /// committed its records; only its checkpoint was refused), the batch is still recorded,
    /// and the fence is the error returned: a run that lost its lease while a pipelined
    /// transaction ran records the broker's late answers in its salvage instead of dropping
    /// them (e2e `ha::a_paused_relay_cannot_move_the_checkpoint_or_send_and_its_late_acks_are_recorded`,
    /// 1 fresh-clone CI run in 4 on 2026-12-07: the salvage's flush returned at the settle).
    pub async fn flush(
        &mut self,
        track: bool,
        progress: &Progress,
    ) -> Result<AcceptOutcome, RelayError> {
        // A fenced settle is remembered and this batch recorded anyway; any other error ends
        // the flush here.
        let fenced = match self.settle(progress).await {
            Ok(()) => None,
            Err(e @ RelayError::Ledger(outbox_ledger::LedgerError::LeaseLost { .. })) => Some(e),
            Err(e) => return Err(e),
        };
        let Some(a) = self.core.begin_acceptance(track)? else {
            return fenced.map_or(Ok(AcceptOutcome::default()), Err);
        };
        let mut prepared = accept::Prepared::default();
        match run_acceptance(&mut self.client, &mut prepared, &self.slot, &a, &self.fence).await {
            Ok(out) => {
                let fold = a.folds();
                self.accepted(a, &out, progress);
                if let Some(e) = fenced {
                    return Err(e);
                }
                if fold && !self.fold_in_background() {
                    let folded = outbox_ledger::numbering::fold(&self.client, &self.slot).await;
                    log_fold(&self.slot, folded);
                }
                Ok(out)
            }
            Err(e) => {
                self.core.acceptance_ended(a, ended_by(&e));
                Err(e.into())
            }
        }
    }

    /// Starts the acceptance transaction of the batch on its own task and returns at once;
    /// [`Self::settle`] collects it. Falls back to [`Self::flush`] without a second ledger
    /// connection. Does nothing while another pipelined transaction runs: the batch keeps
    /// growing meanwhile, so batches grow with the ledger's latency.
    pub async fn flush_pipelined(&mut self, progress: &Progress) -> Result<(), RelayError> {
        if self.accepting.is_some() {
            return Ok(());
        }
        let Some((mut client, mut prepared)) = self.accept_client.take() else {
            return self.flush(true, progress).await.map(|_| ());
        };
        let Some(a) = self.core.begin_acceptance(true)? else {
            self.accept_client = Some((client, prepared));
            return Ok(());
        };
        let (slot, fence) = (self.slot.clone(), self.fence.clone());
        let task = tokio::spawn(async move {
            let r = run_acceptance(&mut client, &mut prepared, &slot, &a, &fence).await;
            ((client, prepared), a, r)
        });
        self.accepting = Some(Accepting {
            task,
            started: Instant::now(),
        });
        Ok(())
    }

    /// Waits for the pipelined acceptance transaction, if one runs, and applies its result
    /// (the core learns of its checkpoint only after its COMMIT).
    pub async fn settle(&mut self, progress: &Progress) -> Result<(), RelayError> {
        if self.accepting.is_none() {
            return Ok(());
        }
        let joined = accept_finished(&mut self.accepting).await;
        self.finish_accept(joined, progress)
    }

    /// Applies the result of the pipelined acceptance transaction that
    /// [`accept_finished`] reported.
    pub fn finish_accept(
        &mut self,
        joined: Result<AcceptDone, tokio::task::JoinError>,
        progress: &Progress,
    ) -> Result<(), RelayError> {
        let started = self.accepting.take().map(|a| a.started);
        let (client, a, result) =
            joined.map_err(|e| RelayError::Internal(format!("acceptance task: {e}")))?;
        let (reports, report_sum_ms, report_max_ms) = self.core.take_report_times();
        tracing::debug!(
            items = a.items.len(),
            ms = started.map(|s| s.elapsed().as_secs_f64() * 1000.0),
            in_flight = self.core.in_flight(),
            report_avg_ms = report_sum_ms / reports.max(1) as f64,
            report_max_ms,
            "acceptance transaction done"
        );
        self.accept_client = Some(client);
        match result {
            Ok(out) => {
                let fold = a.folds();
                self.accepted(a, &out, progress);
                if fold {
                    // Pipelined acceptance comes with the URL (enable_pipelined_accept).
                    self.fold_in_background();
                }
                Ok(())
            }
            Err(e) => {
                self.core.acceptance_ended(a, ended_by(&e));
                Err(e.into())
            }
        }
    }

    /// One release poll, executed as the core's [`ReleasePoll`] asks: the settled UNKNOWN
    /// attempts of other generations (a resumed zombie's late report), then what operators
    /// released, one aggregate at a time. Runs between stream messages; the stream waits
    /// meanwhile (releases are rare).
    pub async fn release_poll(
        &mut self,
        cfg: &RelayConfig,
        sql: &Client,
        qualified_table: &str,
        progress: &Progress,
    ) -> Result<(), RelayError> {
        let mut poll = ReleasePoll::new();
        let mut listed: HashMap<AggKey, holds::Release> = HashMap::new();
        loop {
            let now = self.now();
            match poll.next(&mut self.core, now) {
                PollStep::ReconcileSettled => {
                    let fence = self.fence.clone();
                    self.reconcile_unknown(cfg, sql, &fence, qualified_table, When::Running)
                        .await?
                }
                PollStep::ReadReleasing => {
                    let releases =
                        holds::releasing(&self.client, self.shard_filter.as_deref()).await?;
                    poll.releasing(
                        releases
                            .iter()
                            .map(|r| Released {
                                key: r.key.clone(),
                                blocking_version: r.blocking_version,
                                blocking_event_id: r.blocking_event_id,
                                publish_blocking: r.publish_blocking,
                            })
                            .collect(),
                    );
                    listed = releases.into_iter().map(|r| (r.key.clone(), r)).collect();
                }
                PollStep::Flush => {
                    self.flush(true, progress).await?;
                }
                PollStep::LoadSet(r) => {
                    let Some(release) = listed.get(&r.key) else {
                        poll.skip();
                        continue;
                    };
                    let events = self.released_events(sql, qualified_table, release).await?;
                    tracing::info!(aggregate = %format!("{}/{}", r.key.0, r.key.1), events = events.len(), "republishing a released aggregate");
                    poll.loaded(&self.core, events);
                }
                PollStep::Send(send) => self.execute(vec![send]).await?,
                PollStep::Await(_) => {
                    self.wait_one(None).await?;
                }
                PollStep::CloseHold { key, last } => {
                    if holds::close(&self.client, &key, last).await? {
                        let head = holds::head(&self.client, &key).await?;
                        let next = self.core.release_closed(&key, head, last);
                        tracing::info!(aggregate = %format!("{}/{}", key.0, key.1), next_version = next, "hold released");
                    }
                }
                PollStep::Done => return Ok(()),
            }
        }
    }

    /// What the release `r` publishes (`holds::republish_set`), each event as the relay must
    /// publish it now, with its commit LSN. Rows written without a version are published as
    /// the stream numbered and routed them (their held records kept both).
    async fn released_events(
        &self,
        sql: &Client,
        qualified_table: &str,
        r: &holds::Release,
    ) -> Result<Vec<(OutboxEvent, Option<Lsn>)>, RelayError> {
        let set = holds::republish_set(&self.client, r).await?;
        let wanted: Vec<_> = set
            .iter()
            .map(|p| {
                let numbering = match p.by_relay {
                    Some(route) => Numbering::ByRelay {
                        version: p.version,
                        route,
                    },
                    None => Numbering::Row,
                };
                (p.event_id, numbering)
            })
            .collect();
        let mut events = Vec::with_capacity(set.len());
        for (id, ev) in events_by_id(sql, qualified_table, &wanted).await? {
            let ev = ev.ok_or_else(|| {
                RelayError::Internal(format!("released event {id} has no version to publish"))
            })?;
            let commit_lsn = set
                .iter()
                .find(|p| p.event_id == id)
                .and_then(|p| p.commit_lsn);
            events.push((ev, commit_lsn));
        }
        Ok(events)
    }
}

impl Pipeline {
    /// Ends the run as `ending` says, in the core's order (`outbox_relay::lifecycle::RunEnd`):
    /// the outstanding delivery reports recorded within the ending's grace (`Ending::grace`;
    /// an unclear one records its UNKNOWN attempt, so every send outstanding when the run
    /// ended has its outcome traced), the batch accepted (with its checkpoint on a stop only: a salvaging run may have lost
    /// its lease, and sends nothing more), and on a stop the slot confirmed through `stream`.
    pub async fn end_run(
        &mut self,
        ending: Ending,
        mut stream: Option<&mut outbox_source::transport::ReplicationStream>,
        progress: &Progress,
    ) -> Result<(), RelayError> {
        let deadline = tokio::time::Instant::now() + ending.grace(self.sink().ack_timeout());
        let mut end = RunEnd::new(ending, &mut self.core);
        loop {
            match end.next(&self.core) {
                EndStep::AwaitReport => {
                    match tokio::time::timeout_at(deadline, self.reports.recv()).await {
                        Ok(Some(d)) => self.on_report(d).await?,
                        Ok(None) | Err(_) => end.grace_over(),
                    }
                }
                EndStep::Accept { track } => {
                    self.flush(track, progress).await?;
                }
                EndStep::Confirm => {
                    if let Some(stream) = stream.as_deref_mut() {
                        super::confirm(stream, &self.core).await?;
                    }
                }
                EndStep::Done => return Ok(()),
            }
        }
    }
}

/// What a look-up of attempt `a` of `ev` asks the sink: from the first position that may hold
/// its copy, and how long ago it was sent.
pub(crate) fn lookup_of<'a>(
    ev: &'a OutboxEvent,
    a: &'a attempts::UnknownAttempt,
) -> UnknownLookup<'a> {
    UnknownLookup {
        event: ev,
        topic: &a.topic,
        partition: a.partition,
        from: a.scan_from + 1,
        sent_ago: sent_ago(a),
    }
}

/// How long ago attempt `a` was sent, as the ledger read it.
pub(crate) fn sent_ago(a: &attempts::UnknownAttempt) -> Duration {
    Duration::from_secs_f64(a.sent_ago_s.max(0.0))
}

/// How long attempt `a` has been unknown, as the ledger read it.
pub(crate) fn unknown_for(a: &attempts::UnknownAttempt) -> Duration {
    Duration::from_secs_f64(a.unknown_for_s.max(0.0))
}

/// What a read is doing, for its errors.
fn reading(read: Read) -> &'static str {
    match read {
        Read::Snapshot => "reading unpublished outbox rows",
        Read::PollRound => "reading pending outbox events",
    }
}

/// The key an unreadable row is quarantined under: a snapshot's by its place in the read; a
/// poll round's by the row's id when it has one, so that a later round records it once.
fn unreadable_key(read: Read, row: &tokio_postgres::Row, n: u64) -> String {
    match read {
        Read::Snapshot => format!("snapshot:{n}"),
        Read::PollRound => format!(
            "poll:{}",
            row.try_get::<_, Option<&str>>(0)
                .ok()
                .flatten()
                .unwrap_or("?")
        ),
    }
}
