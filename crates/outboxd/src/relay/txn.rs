//! Exactly-once mode's stream (`delivery = "exactly-once"`, issue 30, docs/exactly_once.md):
//! once a CDC run's start is over, the stream's events go to Kafka in transactions, one per
//! batch, as `outbox_relay::txn::TxnCore` decides; this module only executes what it asks.
//!
//! * The transactional producer (`outbox_sink::kafka_txn::TxnSink`) is opened under the slot's
//!   transactional id, which fences every earlier holder's producer and settles what it left
//!   open; then the batches the broker recorded after the ledger's last are accepted from
//!   their records, before any event is read (`TxnCore::recover`).
//! * Each event read is given to the core with whether it is published already: the ledger's
//!   head of its aggregate, read when the run first meets it, says so (the stream read again
//!   after a crash, or after a batch accepted from its record, brings such events).
//! * The broker's calls that block (commit, abort, opening the producer, reading the records)
//!   run on the blocking pool, one at a time, as the core orders them; acceptances run on the
//!   acceptance session, one at a time, in batch order.
//! * The slot is confirmed up to `TxnCore::durable`, the checkpoint the ledger holds.
//!
//! Not yet in this mode (docs/exactly_once.md): rows written without a version, releases of
//! held aggregates (a held aggregate's events are recorded held; `quarantine release` takes
//! effect in the default mode), and the initial snapshot, which is published at least once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use outbox_core::delivery::{DeliveryOutcome, FailureClass, RecordPosition};
use outbox_core::records::QuarantineRecord;
use outbox_core::{Lsn, OutboxEvent};
use outbox_ledger::holds;
use outbox_ledger::lease::Fence;
use outbox_ledger::{accept, checkpoint, AcceptOutcome, LedgerError, LedgerItem};
use outbox_relay::txn::{
    BrokerAnswer, Kept, Reader, Recorded, StreamIdentity, StreamTxn, TxnCore, TxnEnd, TxnEndStep,
    TxnReceipt, TxnReport, TxnRow, TxnStep,
};
use outbox_sink::kafka_txn::{
    committed_batches, ensure_positions_topic, BatchKept, BatchReceipt, BatchRecord, TxnFailure,
    TxnSink,
};
use outbox_sink::{Delivery, SinkError};
use outbox_source::snapshot::{events_by_id, Numbering};
use outbox_source::transport::{ReplicationMessage, ReplicationStream};
use outbox_source::{Decoded, Decoder, SourceError};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use uuid::Uuid;

use super::{LeaseState, Progress, RelayError};
use crate::config::RelayConfig;

/// How long a blocking call of the transactional producer may take (commit, abort, opening
/// it, reading the records).
const BROKER_TIMEOUT: Duration = Duration::from_secs(30);

/// An event the run admitted, kept until its batch is accepted: the receipt is built from it.
struct Admitted {
    event: OutboxEvent,
    commit_lsn: Lsn,
    change_lsn: Lsn,
}

/// What a blocking broker call answered.
enum BrokerDone {
    Commit(Result<Option<RecordPosition>, SinkError>),
    Abort(Result<(), SinkError>),
    Settle(Result<(TxnSink, Option<RecordPosition>), SinkError>),
}

/// The acceptance session and its prepared statements.
type Session = (Client, accept::Prepared);

/// An acceptance's answer: the session back, the batches it took in, what the ledger did.
type AcceptDone = (Session, Vec<u64>, Result<AcceptOutcome, LedgerError>);

struct Run<'a> {
    cfg: &'a RelayConfig,
    ident: StreamIdentity,
    /// Where the outbox's rows are read as the relay must publish them (a narrow row's
    /// destination rendered: `outbox.events_current`).
    current_rows: &'a str,
    progress: &'a Progress,
    fence: &'a Fence,
    /// The lease as the keeper knows it: a settle opens the producer again (fencing every
    /// other holder of the id) only while it holds.
    lease: &'a LeaseState,
    core: TxnCore,
    /// The producer; `None` only while a settle replaces it (the old one is destroyed before
    /// the new one opens, so that nothing it still had queued, such as its own epoch bump,
    /// reaches the coordinator after the new one and fences it: seen on three nodes).
    sink: Option<Arc<TxnSink>>,
    reports_tx: mpsc::UnboundedSender<Delivery>,
    /// Admitted events by id, until their batch is accepted.
    admitted: HashMap<Uuid, Admitted>,
    broker: Option<JoinHandle<BrokerDone>>,
    accepts: VecDeque<TxnStep>,
    accepting: Option<JoinHandle<AcceptDone>>,
    ledger: Option<Session>,
    /// The last batch record the broker is known to hold (recovered or committed by this
    /// run): a settle reads the records after it.
    last_record: Option<RecordPosition>,
}

/// Streams in exactly-once mode from `start` until the run ends: a stop (`shutdown`), an
/// error, or another relay taking the slot.
#[allow(clippy::too_many_arguments)]
pub(super) async fn stream(
    cfg: &RelayConfig,
    progress: &Progress,
    shutdown: &mut watch::Receiver<bool>,
    sql: &Client,
    ledger: Client,
    stream: &mut ReplicationStream,
    decoder: &mut Decoder,
    start: Lsn,
    fence: &Fence,
    lease_state: &LeaseState,
    current_rows: &str,
    (system_id, database): (&str, &str),
    skipped: Vec<Uuid>,
) -> Result<(), RelayError> {
    let (reports_tx, mut reports) = mpsc::unbounded_channel();
    let incarnation = checkpoint::load(sql, &cfg.slot)
        .await?
        .and_then(|c| c.consistent_point)
        .unwrap_or(Lsn::ZERO);
    let ident = StreamIdentity::new(
        &cfg.sink.cluster_name,
        system_id,
        database,
        &cfg.slot,
        incarnation,
    );
    let id = ident.transactional_id.clone();
    let sink = open_sink(cfg, &id, reports_tx.clone()).await?;
    let held = holds::load_held(sql)
        .await?
        .into_iter()
        .map(|k| (k, i64::MIN))
        .collect();
    let served = outbox_core::delivery::Served {
        kind: "kafka",
        clusters: vec![cfg.sink.cluster_name.clone()],
        partitioner: Some(cfg.sink.partitioner.clone()),
    };
    // A transaction takes what is queued, up to the events the relay keeps unfinished: a
    // commit costs the same for ten events or thousands (about 100 ms on one Kafka 4.1 node,
    // docs/exactly_once.md), so a backlog is drained in large transactions.
    let batch_size = cfg
        .batch_size
        .max(usize::try_from(cfg.max_in_flight).unwrap_or(usize::MAX));
    let mut run = Run {
        cfg,
        ident,
        current_rows,
        progress,
        fence,
        lease: lease_state,
        core: TxnCore::new(served, batch_size, start, 0, held),
        sink: Some(Arc::new(sink)),
        reports_tx,
        admitted: HashMap::new(),
        broker: None,
        accepts: VecDeque::new(),
        accepting: None,
        ledger: Some((ledger, accept::Prepared::default())),
        last_record: checkpoint::last_txn_record(sql, &cfg.slot).await?,
    };
    run.core.skipped_by_operator(skipped);
    run.recover(sql).await?;
    // Rows with a later commit LSN have no receipt: only rows at or below it are looked up.
    run.core
        .set_replay_bound(checkpoint::accepted_through(sql, &cfg.slot).await?);
    tracing::info!(transactional_id = %id, checkpoint = %run.core.durable(), "streaming in exactly-once mode");
    progress.set_checkpoint(run.core.durable());

    let mut reader = Reader::new(start);
    let mut status = tokio::time::interval(cfg.status_interval);
    status.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let linger = cfg.batch_linger.max(Duration::from_millis(1));
    // The clock the core's linger is kept on.
    let run_started = Instant::now();
    loop {
        super::still_leased(cfg, !lease_state.valid(), lease_state, fence)?;
        if run.core.stopped() {
            return Err(fenced(&id));
        }
        let can_read = run
            .core
            .can_read(usize::try_from(cfg.max_in_flight).unwrap_or(usize::MAX));
        let linger_at = run.core.linger_started().map(|s| run_started + s + linger);
        tokio::select! {
            biased;
            _ = shutdown.changed() => return run.stop(stream, sql, fence, &mut reports).await,
            Some(d) = reports.recv() => {
                run.core.on_report(d.token, TxnReport::of(d.outcome));
            }
            done = broker_done(&mut run.broker) => {
                run.on_broker(done)?;
            }
            done = accept_done(&mut run.accepting) => run.on_accepted(done)?,
            _ = status.tick() => confirm(stream, reader.received(), run.core.durable()).await?,
            _ = sleep_until(linger_at) => run.core.flush(),
            msg = stream.next_message(), if can_read => {
                let mut msg = msg;
                loop {
                    match msg.map_err(SourceError::from)? {
                        None => return Err(RelayError::StreamEnded),
                        Some(ReplicationMessage::Keepalive { wal_end, reply_requested, .. }) => {
                            reader.keepalive(Lsn(wal_end));
                            if reply_requested {
                                confirm(stream, reader.received(), run.core.durable()).await?;
                            }
                        }
                        Some(ReplicationMessage::XLogData { wal_start, data, .. }) => {
                            reader.data_at(Lsn(wal_start));
                            match decoder.decode(data)? {
                                Decoded::Begin { commit_lsn, .. } => reader.begin(commit_lsn),
                                Decoded::Event(res) => reader.row(((*res).map_err(|e| e.to_string()), Lsn(wal_start))),
                                Decoded::Commit { end_lsn, .. } => reader.commit(end_lsn),
                                Decoded::PolicyGeneration(_) | Decoded::Nothing => {}
                            }
                        }
                    }
                    // More already here: read on, up to a batch (`Reader::full`).
                    if reader.full(run.core.unfinished(), batch_size) {
                        break;
                    }
                    match stream.next_message().now_or_never() {
                        Some(next) => msg = next,
                        None => break,
                    }
                }
                let read = reader.take();
                let moved = !read.is_empty();
                run.admit(sql, read).await?;
                run.core.read(moved, run_started.elapsed());
            }
        }
        run.execute().await?;
    }
}

/// Creates the positions topic if the brokers lack it, then opens the transactional
/// producer (which fences every earlier holder's).
async fn open_sink(
    cfg: &RelayConfig,
    id: &str,
    reports: mpsc::UnboundedSender<Delivery>,
) -> Result<TxnSink, RelayError> {
    let (config, id, positions) = (
        cfg.sink.clone(),
        id.to_string(),
        cfg.positions_topic.clone(),
    );
    tokio::task::spawn_blocking(move || {
        ensure_positions_topic(&config, &positions, BROKER_TIMEOUT)?;
        TxnSink::open(config, &id, &positions, reports, BROKER_TIMEOUT)
    })
    .await
    .map_err(|e| RelayError::Internal(format!("opening the transactional producer: {e}")))?
    .map_err(RelayError::from)
}

/// An event id of batch record `r`, which must be a UUID.
fn id_in(r: &BatchRecord, id: &str) -> Result<Uuid, RelayError> {
    id.parse().map_err(|_| {
        RelayError::Internal(format!(
            "batch record {} of {}: event id {id:?} is not a UUID",
            r.batch, r.slot
        ))
    })
}

fn fenced(id: &str) -> RelayError {
    RelayError::Fenced {
        transactional_id: id.to_string(),
    }
}

async fn broker_done(h: &mut Option<JoinHandle<BrokerDone>>) -> Result<BrokerDone, RelayError> {
    let Some(task) = h.as_mut() else {
        return std::future::pending().await;
    };
    let done = task.await;
    *h = None;
    done.map_err(|e| RelayError::Internal(format!("a call of the transactional producer: {e}")))
}

async fn accept_done(h: &mut Option<JoinHandle<AcceptDone>>) -> Result<AcceptDone, RelayError> {
    let Some(task) = h.as_mut() else {
        return std::future::pending().await;
    };
    let done = task.await;
    *h = None;
    done.map_err(|e| RelayError::Internal(format!("an acceptance: {e}")))
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

/// The standby status of this mode: `flush` (what the server may recycle) is `durable`, the
/// `through` of the last batch the ledger accepted, which is never past a stream transaction
/// some of whose events are in a batch not yet accepted (`TxnCore`'s rule; the default mode's
/// argument for why a confirmed LSN is safe is at `outbox_relay::schedule::standby_status`).
async fn confirm(
    stream: &mut ReplicationStream,
    received: Lsn,
    durable: Lsn,
) -> Result<(), RelayError> {
    stream
        .send_standby_status(received.0, durable.0, durable.0, false)
        .await
        .map_err(SourceError::from)?;
    Ok(())
}

impl Run<'_> {
    /// The batches the broker recorded after the ledger's last, accepted from their records
    /// before anything is read.
    async fn recover(&mut self, sql: &Client) -> Result<(), RelayError> {
        // The ledger's last accepted record, read when the run was made.
        let after: Vec<RecordPosition> = self.last_record.into_iter().collect();
        let (servers, positions, slot) = (
            self.cfg.sink.bootstrap_servers.clone(),
            self.cfg.positions_topic.clone(),
            self.ident.record_key.clone(),
        );
        let records = tokio::task::spawn_blocking(move || {
            committed_batches(&servers, &positions, &slot, &after, BROKER_TIMEOUT)
        })
        .await
        .map_err(|e| RelayError::Internal(format!("reading the batch records: {e}")))??;
        let mut recorded = Vec::with_capacity(records.len());
        for (record, r) in records {
            self.last_record = self.last_record.max(Some(record));
            recorded.push(Recorded {
                batch: r.batch,
                through: r.through,
                receipts: r
                    .receipts
                    .iter()
                    .map(|x| {
                        Ok(TxnReceipt {
                            event_id: id_in(&r, &x.event_id)?,
                            partition: x.partition,
                            offset: x.offset,
                        })
                    })
                    .collect::<Result<_, RelayError>>()?,
                kept: r
                    .kept
                    .iter()
                    .map(|k| {
                        Ok(Kept {
                            event_id: id_in(&r, &k.event_id)?,
                            aggregate: (k.aggregate_type.clone(), k.aggregate_id.clone()),
                            version: k.version,
                            quarantined: k.quarantined.clone(),
                        })
                    })
                    .collect::<Result<_, RelayError>>()?,
                record,
            });
        }
        if !recorded.is_empty() {
            tracing::warn!(batches = recorded.len(), "accepting batches the broker committed before the last run's acceptance: not sent again");
        }
        self.core.recover(recorded);
        // Accepted in order, before the stream is read: the heads of their aggregates are
        // read after them.
        while let Some(step) = self.core.poll_step() {
            let TxnStep::Accept { batch, .. } = &step else {
                return Err(RelayError::Internal(format!("recovery asked for {step:?}")));
            };
            let batch = *batch;
            let mut session = self.ledger.take().expect("the acceptance session");
            let items = self.items(sql, &step).await?;
            let result = accept_step(&mut session, &self.cfg.slot, self.fence, &step, &items).await;
            self.ledger = Some(session);
            self.accepted(&[batch], result)?;
        }
        Ok(())
    }

    /// Stream transactions read whole, given to the core in order, each with its commit
    /// (`TxnCore::admit_txn`); the heads of the aggregates they meet first are read in one
    /// look-up before.
    async fn admit(&mut self, sql: &Client, read: Vec<StreamTxn>) -> Result<(), RelayError> {
        if read.is_empty() {
            return Ok(());
        }
        let unknown = self.core.heads_needed_in(&read);
        if !unknown.is_empty() {
            let heads = holds::heads_of(sql, &unknown, None).await?;
            self.core.learn_heads(unknown, heads);
        }
        for t in read {
            let commit_lsn = t.commit_lsn;
            let rows = self.core.admit_txn(t).map_err(|u| {
                RelayError::Unsupported(format!(
                    "event {} was written without a version: exactly-once mode does not number rows yet (docs/exactly_once.md); run the slot in the default mode",
                    u.event_id
                ))
            })?;
            for row in rows {
                match row {
                    TxnRow::Queued { event, change_lsn } => {
                        self.admitted.insert(
                            event.event_id,
                            Admitted {
                                event: *event,
                                commit_lsn,
                                change_lsn,
                            },
                        );
                    }
                    TxnRow::NotSent { .. } => {}
                    TxnRow::Unreadable(record) => self.quarantine_unreadable(record).await?,
                }
            }
        }
        Ok(())
    }

    /// An unreadable row's quarantine record, accepted at once (it has no aggregate to hold).
    async fn quarantine_unreadable(&mut self, record: QuarantineRecord) -> Result<(), RelayError> {
        tracing::warn!(key = %record.key, reason = %record.reason, "unreadable outbox row quarantined");
        self.settle_acceptance().await?;
        let (mut client, mut prepared) = self.ledger.take().expect("the acceptance session");
        let r = accept::accept_batch_prepared(
            &mut client,
            &mut prepared,
            &self.cfg.slot,
            &[LedgerItem::Quarantine(record)],
            None,
            Some(self.fence),
        )
        .await;
        self.ledger = Some((client, prepared));
        r?;
        Ok(())
    }

    /// Waits for the acceptance that runs, if one does.
    async fn settle_acceptance(&mut self) -> Result<(), RelayError> {
        if self.accepting.is_some() {
            let done = accept_done(&mut self.accepting).await;
            self.on_accepted(done)?;
        }
        Ok(())
    }

    /// Executes what the core asks, in order; the broker's blocking calls and the acceptances
    /// start here and answer in the loop.
    async fn execute(&mut self) -> Result<(), RelayError> {
        while let Some(step) = self.core.poll_step() {
            match step {
                TxnStep::Begin { batch } => {
                    tracing::debug!(batch, "transaction begins");
                    if let Err(e) = self.sink()?.begin() {
                        return Err(e.into());
                    }
                }
                TxnStep::Send { token, event } => {
                    if let Err(e) = self.sink()?.send(&event, token).await {
                        let permanent = e.permanent_refusal();
                        let _ = self.reports_tx.send(Delivery {
                            token,
                            outcome: DeliveryOutcome::Failed {
                                error: e.to_string(),
                                persistence: outbox_core::delivery::Persistence::NotPersisted,
                                class: if permanent.is_some() {
                                    FailureClass::Permanent
                                } else {
                                    FailureClass::Transient
                                },
                                partition: -1,
                            },
                        });
                    }
                }
                TxnStep::Commit {
                    batch,
                    through,
                    receipts,
                    kept,
                } => {
                    tracing::debug!(
                        batch,
                        events = receipts.len(),
                        "every send stored: committing"
                    );
                    let record = self.record(batch, through, &receipts, &kept);
                    let sink = self.sink()?.clone();
                    self.broker = Some(tokio::task::spawn_blocking(move || {
                        BrokerDone::Commit(sink.commit(&record, BROKER_TIMEOUT))
                    }));
                }
                TxnStep::Abort { batch } => {
                    tracing::warn!(
                        batch,
                        "a send of the transaction failed: aborting it (nothing of it becomes visible; its events are sent again in the next)"
                    );
                    let sink = self.sink()?.clone();
                    self.broker = Some(tokio::task::spawn_blocking(move || {
                        BrokerDone::Abort(sink.abort(BROKER_TIMEOUT))
                    }));
                }
                TxnStep::Settle { batch } => {
                    // Opening the producer fences whoever holds the id: a run whose lease
                    // lapsed (paused past it) must not fence the relay that took the slot.
                    super::still_leased(self.cfg, !self.lease.valid(), self.lease, self.fence)?;
                    tracing::warn!(batch, "the transaction's outcome is unknown: opening the producer again (which aborts it unless its commit began) and reading the broker's records");
                    let (config, id, positions, reports) = (
                        self.cfg.sink.clone(),
                        self.ident.transactional_id.clone(),
                        self.cfg.positions_topic.clone(),
                        self.reports_tx.clone(),
                    );
                    let slot = self.ident.record_key.clone();
                    let after = self.last_record;
                    let old = self.sink.take();
                    self.broker = Some(tokio::task::spawn_blocking(move || {
                        // The last reference: librdkafka's instance is destroyed here.
                        drop(old);
                        BrokerDone::Settle((|| {
                            let sink = TxnSink::open(
                                config.clone(),
                                &id,
                                &positions,
                                reports,
                                BROKER_TIMEOUT,
                            )?;
                            let after: Vec<RecordPosition> = after.into_iter().collect();
                            let found = committed_batches(
                                &config.bootstrap_servers,
                                &positions,
                                &slot,
                                &after,
                                BROKER_TIMEOUT,
                            )?
                            .into_iter()
                            .find(|(_, r)| r.batch == batch)
                            .map(|(at, _)| at);
                            Ok((sink, found))
                        })())
                    }));
                }
                a @ TxnStep::Accept { .. } => self.accepts.push_back(a),
                TxnStep::Stop => return Err(fenced(&self.ident.transactional_id)),
            }
        }
        self.start_acceptance().await
    }
}

impl Run<'_> {
    /// The producer (there is one except while a settle opens the next).
    fn sink(&self) -> Result<&Arc<TxnSink>, RelayError> {
        self.sink.as_ref().ok_or_else(|| {
            RelayError::Internal("no transactional producer while a settle opens one".into())
        })
    }

    /// The batch record the commit writes into the positions topic.
    fn record(
        &self,
        batch: u64,
        through: Lsn,
        receipts: &[TxnReceipt],
        kept: &[Kept],
    ) -> BatchRecord {
        BatchRecord {
            slot: self.ident.record_key.clone(),
            generation: self.fence.generation,
            batch,
            through,
            receipts: receipts
                .iter()
                .map(|r| BatchReceipt {
                    event_id: r.event_id.to_string(),
                    topic: self
                        .admitted
                        .get(&r.event_id)
                        .map(|a| a.event.destination.topic.clone())
                        .unwrap_or_default(),
                    partition: r.partition,
                    offset: r.offset,
                })
                .collect(),
            kept: kept
                .iter()
                .map(|k| BatchKept {
                    event_id: k.event_id.to_string(),
                    aggregate_type: k.aggregate.0.clone(),
                    aggregate_id: k.aggregate.1.clone(),
                    version: k.version,
                    quarantined: k.quarantined.clone(),
                })
                .collect(),
        }
    }

    /// What a blocking broker call answered, told to the core (`TxnCore::on_broker` decides
    /// what it means and makes what queued meanwhile due), wherever the answer is read (the
    /// stream loop, a stop).
    fn on_broker(&mut self, done: Result<BrokerDone, RelayError>) -> Result<(), RelayError> {
        // Fenced: another producer of the transactional id took over. Any other failure
        // (retriable, abortable, fatal for this producer) leaves the outcome to the core, and
        // is logged: `call` did not answer.
        let fenced = |e: &SinkError, call: &str| {
            let fenced = matches!(
                e,
                SinkError::Transaction {
                    failure: TxnFailure::Fenced,
                    ..
                }
            );
            if !fenced {
                tracing::warn!(error = %e, "the {call} did not answer");
            }
            fenced
        };
        let answer = match done? {
            BrokerDone::Commit(r) => match r {
                Ok(at) => {
                    if let Some(at) = at {
                        // Tests: a crash between the broker's commit and the ledger's
                        // acceptance (the next start accepts the batch from its record).
                        crate::failpoint::hit("txn-after-commit");
                        self.last_record = self.last_record.max(Some(at));
                    }
                    BrokerAnswer::Committed(at)
                }
                Err(e) => BrokerAnswer::CommitFailed {
                    fenced: fenced(&e, "commit"),
                },
            },
            BrokerDone::Abort(r) => match r {
                Ok(()) => BrokerAnswer::Aborted,
                Err(e) => BrokerAnswer::AbortFailed {
                    fenced: fenced(&e, "abort"),
                },
            },
            BrokerDone::Settle(r) => {
                let (sink, found) = r?;
                self.sink = Some(Arc::new(sink));
                self.last_record = self.last_record.max(found);
                tracing::info!(found = ?found, "unknown commit settled");
                BrokerAnswer::Settled(found)
            }
        };
        tracing::debug!(?answer, "the broker answered");
        self.core.on_broker(answer);
        Ok(())
    }

    /// Starts the next acceptance, when none runs.
    async fn start_acceptance(&mut self) -> Result<(), RelayError> {
        if self.accepting.is_some() || self.accepts.is_empty() {
            return Ok(());
        }
        // Every batch waiting, in one ledger transaction (`TxnCore::merge_accepts`).
        let steps: Vec<TxnStep> = self.accepts.drain(..).collect();
        let Some((batches, merged)) = self.core.merge_accepts(steps) else {
            return Ok(());
        };
        let items = self.live_items(&merged)?;
        let mut session = self.ledger.take().expect("the acceptance session");
        let (slot, fence) = (self.cfg.slot.clone(), self.fence.clone());
        self.accepting = Some(tokio::spawn(async move {
            let r = accept_step(&mut session, &slot, &fence, &merged, &items).await;
            (session, batches, r)
        }));
        Ok(())
    }

    fn on_accepted(&mut self, done: Result<AcceptDone, RelayError>) -> Result<(), RelayError> {
        let (session, batches, result) = done?;
        self.ledger = Some(session);
        self.accepted(&batches, result)
    }

    /// The ledger took `batches` in (in order): the core's checkpoint follows.
    fn accepted(
        &mut self,
        batches: &[u64],
        result: Result<AcceptOutcome, LedgerError>,
    ) -> Result<(), RelayError> {
        let out = result?;
        for batch in batches {
            self.core.on_accepted(*batch);
        }
        self.progress.set_checkpoint(self.core.durable());
        self.progress.record(&out);
        Ok(())
    }

    /// The ledger's records of a batch this run sent (its events admitted by it).
    fn live_items(&mut self, step: &TxnStep) -> Result<Vec<LedgerItem>, RelayError> {
        let TxnStep::Accept { receipts, kept, .. } = step else {
            return Ok(Vec::new());
        };
        let mut items = Vec::with_capacity(receipts.len() + kept.len());
        for r in receipts {
            let a = self.admitted.remove(&r.event_id).ok_or_else(|| {
                RelayError::Internal(format!(
                    "a receipt of event {} this run did not admit",
                    r.event_id
                ))
            })?;
            items.push(r.record(
                &a.event,
                self.fence.generation,
                Some(a.commit_lsn),
                Some(a.change_lsn),
            ));
        }
        for k in kept {
            let a = self.admitted.remove(&k.event_id);
            let commit_lsn = a.as_ref().map(|a| a.commit_lsn);
            items.extend(k.records(a.as_ref().map(|a| &a.event), commit_lsn));
        }
        Ok(items)
    }

    /// The ledger's records of a batch accepted from the broker's record: its events read
    /// again by id (the rows are immutable: their digests are the ones the send computed).
    async fn items(&self, sql: &Client, step: &TxnStep) -> Result<Vec<LedgerItem>, RelayError> {
        let TxnStep::Accept { receipts, kept, .. } = step else {
            return Ok(Vec::new());
        };
        let wanted: Vec<(Uuid, Numbering)> = receipts
            .iter()
            .map(|r| r.event_id)
            .chain(kept.iter().map(|k| k.event_id))
            .map(|id| (id, Numbering::Row))
            .collect();
        let events: HashMap<Uuid, OutboxEvent> = events_by_id(sql, self.current_rows, &wanted)
            .await?
            .into_iter()
            .filter_map(|(id, ev)| ev.map(|e| (id, e)))
            .collect();
        let mut items = Vec::new();
        for r in receipts {
            let ev = events.get(&r.event_id).ok_or_else(|| {
                RelayError::Internal(format!(
                    "event {} of a committed batch has no outbox row",
                    r.event_id
                ))
            })?;
            items.push(r.record(ev, self.fence.generation, None, None));
        }
        for k in kept {
            items.extend(k.records(events.get(&k.event_id), None));
        }
        Ok(items)
    }

    /// A graceful stop: nothing more is read; the open transaction and the acceptances finish
    /// (bounded), the slot is confirmed, the lease given back.
    async fn stop(
        &mut self,
        stream: &mut ReplicationStream,
        sql: &Client,
        fence: &Fence,
        reports: &mut mpsc::UnboundedReceiver<Delivery>,
    ) -> Result<(), RelayError> {
        // As long as a stop of the default mode waits at most (`Ending::grace`).
        let deadline = tokio::time::Instant::now() + outbox_relay::lifecycle::STOP_DRAIN_MAX;
        let mut end = TxnEnd::new(&mut self.core);
        self.execute().await?;
        loop {
            let accepting = self.accepting.is_some() || !self.accepts.is_empty();
            match end.next(&self.core, accepting) {
                // The answers the stream loop handles, its sends' reports too: without them
                // the last transaction never commits (before 2026-12-07 a stop waited out its
                // time and left it open, holding read_committed consumers of its partitions
                // until the next holder aborted it).
                TxnEndStep::AwaitAnswer => {
                    tokio::select! {
                        Some(d) = reports.recv() => {
                            self.core.on_report(d.token, TxnReport::of(d.outcome));
                        }
                        done = broker_done(&mut self.broker) => {
                            self.on_broker(done)?;
                        }
                        done = accept_done(&mut self.accepting) => self.on_accepted(done)?,
                        _ = tokio::time::sleep_until(deadline) => {
                            tracing::warn!(
                                "stopping with a transaction open after {} s: the next holder of the slot aborts it and sends its events again",
                                outbox_relay::lifecycle::STOP_DRAIN_MAX.as_secs()
                            );
                            end.grace_over();
                        }
                    }
                    self.execute().await?;
                }
                TxnEndStep::Confirm => {
                    confirm(stream, self.core.durable(), self.core.durable()).await?
                }
                TxnEndStep::Done => break,
            }
        }
        outbox_ledger::lease::release(sql, &self.cfg.slot, fence).await?;
        tracing::info!(checkpoint = %self.core.durable(), "stopped");
        Ok(())
    }
}

/// One acceptance as the core asked it: with the batch record's position when the broker
/// committed it, with the checkpoint `through`.
async fn accept_step(
    (client, prepared): &mut Session,
    slot: &str,
    fence: &Fence,
    step: &TxnStep,
    items: &[LedgerItem],
) -> Result<AcceptOutcome, LedgerError> {
    let TxnStep::Accept {
        through, record, ..
    } = step
    else {
        return Ok(AcceptOutcome::default());
    };
    accept::accept_committed_batch(
        client,
        prepared,
        slot,
        items,
        Some(*through),
        Some(fence),
        *record,
    )
    .await
}
