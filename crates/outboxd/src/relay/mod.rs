//! The relay: one direction, no back and forth.
//!
//! ```text
//! slot (pgoutput) -> decode -> route (envelope check) -> sink (Kafka | JetStream) -> report
//!      ^                                                                     |
//!      |                                                                     v
//!  LSN feedback <- checkpoint (ack tracker) <- ledger (accept batch, one transaction)
//! ```
//!
//! # Progress tracking: why every LSN we confirm is safe
//! The argument is written once, where the confirmed position is decided:
//! `outbox_relay::schedule::standby_status` (the tracker's side: `outbox_core::ack`). In
//! short: the checkpoint is committed in the same ledger transaction as the receipts that
//! justify it, only a committed checkpoint is ever confirmed to the slot, and a replay's
//! overlap is deduplicated by event id. This module executes it: `pipeline.rs` commits the
//! batches, the stream loop sends the standby status.
//!
//! A delivery without a clear answer ends nothing: its event is parked and holds only its
//! aggregate while it is looked up or sent again (`outbox_relay::pipeline::unclear`).
//! What really needs a new run (the stream broke, the lease was lost, the ledger is
//! unreachable) drops everything in memory, reconnects and replays from the slot. When in
//! doubt, replay.

pub mod databases;
pub mod fleet;
mod pipeline;
mod poll;
mod txn;
mod unknown;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use outbox_core::ack::AckError;
use outbox_core::Lsn;
use outbox_ledger::holds;
use outbox_ledger::lease::{self, Acquire, Fence};
use outbox_ledger::privileges;
use outbox_ledger::sessions;
use outbox_ledger::{checkpoint, AcceptOutcome, LedgerError};
use outbox_relay::stage::{Stage, Staged};
use outbox_sink::{AnySink, HttpEndpoints, JetStreamSink, KafkaSink, Sink, SinkError};
use outbox_source::slot::{self, LedgerView, SourceError};
use outbox_source::snapshot;
use outbox_source::tls::{ConnectError, PgConnectOptions};
use outbox_source::transport::{ReplicationConnection, ReplicationMessage};
use outbox_source::{Decoded, Decoder};
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;
use tracing::Instrument;

use crate::config::{redact_url, RelayConfig};
use outbox_relay::lifecycle::{
    CdcStart, CdcStep, Ending, LeaseAnswer, LeaseKeeper, LoopStep, Renewal, RunError, RunLoop,
    RunStart, SlotStart, StartStep,
};
use outbox_relay::schedule::{self, Bounds, HeldNotice, Schedule, TurnStep};
use pipeline::{Pipeline, Read};

/// Live counters, for `demo` progress and logs, and the relay's metrics (labelled with its
/// database and slot).
#[derive(Debug)]
pub struct Progress {
    pub published: AtomicU64,
    pub duplicates: AtomicU64,
    pub quarantined: AtomicU64,
    pub checkpoint: AtomicU64,
    /// When the current run began streaming (or polling), if it did.
    streaming_since: std::sync::Mutex<Option<Instant>>,
    pub reconnects: AtomicU64,
    pub metrics: crate::metrics::RelayMetrics,
}

impl Progress {
    /// The counters of the relay `cfg` describes, at zero.
    pub fn new(cfg: &RelayConfig) -> Progress {
        Progress {
            published: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            quarantined: AtomicU64::new(0),
            checkpoint: AtomicU64::new(0),
            streaming_since: std::sync::Mutex::new(None),
            reconnects: AtomicU64::new(0),
            metrics: crate::metrics::get().relay(&cfg.database, &cfg.slot),
        }
    }

    fn record(&self, o: &AcceptOutcome) {
        self.metrics.accepted(o);
        self.published.fetch_add(o.primary, Ordering::Relaxed);
        self.duplicates.fetch_add(o.duplicates, Ordering::Relaxed);
        self.quarantined
            .fetch_add(o.quarantined + o.conflicts, Ordering::Relaxed);
    }
    fn set_checkpoint(&self, l: Lsn) {
        self.metrics.checkpoint(l);
        self.checkpoint.store(l.0, Ordering::Relaxed);
    }

    /// The run began streaming (or polling) now.
    fn began_streaming(&self) {
        self.metrics.streaming(true);
        *self.since() = Some(Instant::now());
    }

    /// A run is about to begin: it has not streamed yet.
    fn run_begins(&self) {
        *self.since() = None;
    }

    /// When the last run began streaming, if it did.
    pub fn streaming_since(&self) -> Option<Instant> {
        *self.since()
    }

    fn since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.streaming_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// Why a relay run ended.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("ledger: {0}")]
    Ledger(#[from] LedgerError),
    #[error("broker: {0}")]
    Sink(#[from] SinkError),
    #[error("cannot connect to PostgreSQL at {url}: {message}; check the URL, that the server is up, and pg_hba.conf")]
    Connect { url: String, message: String },
    #[error("ack tracker: {0}")]
    Ack(#[from] AckError),
    #[error("relay core: {0}")]
    Core(#[from] outbox_relay::CoreError),
    #[error("the replication stream ended")]
    StreamEnded,
    #[error("internal error: {0}")]
    Internal(String),
    /// What this relay cannot serve as configured; the message names the fix.
    #[error("{0}")]
    Unsupported(String),
    /// Exactly-once mode: the broker refused this run's producer because a newer producer of
    /// its transactional id exists (another relay took the slot, or an earlier producer of
    /// this one bumped the id's epoch late). Transient: the next run takes the lease again
    /// if it can, and opening the producer fences every other one; otherwise it stands by.
    #[error("the broker fenced the producer of transactional id {transactional_id}: a newer producer of the id exists; this run ends (the next one takes the slot again if its lease allows, or stands by)")]
    Fenced { transactional_id: String },
}

impl RelayError {
    /// Whether reconnecting and replaying can fix it.
    pub fn is_transient(&self) -> bool {
        match self {
            RelayError::Source(e) => e.is_transient(),
            RelayError::Ledger(e) => e.is_transient(),
            RelayError::Sink(e) => e.is_transient(),
            RelayError::Connect { .. } => true,
            RelayError::StreamEnded => true,
            RelayError::Fenced { .. } => true,
            _ => false,
        }
    }
}

/// A slot new to the ledger starts with no numbering (`outbox.stream_versions` is per slot):
/// rows already written without a version would be numbered from 1 again, or read by the
/// initial snapshot in no commit order. Until a new slot can seed its numbering from the
/// receipts (docs/versions_by_relay.md, "Not built yet"), it is refused while such rows exist
/// (`outbox_ledger::numbering::holds_plain_rows`).
async fn refuse_new_slot_over_plain_rows(
    sql: &tokio_postgres::Client,
    cfg: &RelayConfig,
) -> Result<(), RelayError> {
    let table = format!(
        "{}.{}",
        slot::quote_ident(&cfg.schema),
        slot::quote_ident(&cfg.table)
    );
    if outbox_ledger::numbering::holds_plain_rows(sql, &table).await? {
        return Err(RelayError::Unsupported(format!(
            "slot {} is new to the ledger or has not finished its first snapshot, and {table} already holds rows written without an aggregate version: a new slot (first start, --resnapshot, a lost slot, another shard layout) cannot continue their numbering yet, nor can a snapshot read them in commit order (docs/versions_by_relay.md, \"Not built yet\"). Start the relay on its existing slot, or, for a first start, before any writer inserts plainly",
            cfg.slot
        )));
    }
    Ok(())
}

/// Runs the relay until `shutdown` turns true or a definite error. Errors before the first
/// successful start are returned at once (misconfiguration should fail fast, with the fix),
/// except a few transient ones after a standby took the lease over; after that, transient
/// errors reconnect with backoff (`outbox_relay::lifecycle`).
pub async fn run(
    cfg: RelayConfig,
    progress: Arc<Progress>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let poll = cfg.mode == crate::values::RunMode::Poll;
    crate::failpoint::arm_ledger_hooks();
    // Preflight: the settings that no amount of retrying will fix are reported at once.
    let client = match connect_sql(cfg.database_url.expose()).await {
        Ok(client) => Some(client),
        // Poll mode has always waited for its database to come up (the loop below retries).
        Err(e) if poll => {
            tracing::warn!(error = %e, "preflight skipped: the database is not reachable yet");
            None
        }
        Err(e) => return Err(e),
    };
    if let (false, Some(client)) = (poll, &client) {
        slot::check_wal_level(client).await?;
        slot::check_replication_privilege(client).await?;
    }
    // The ledger's grants before anything is sent: a relay that published first and failed on
    // `permission denied for table receipts` afterwards left copies on the broker for nothing.
    let needs: Vec<_> = privileges::RELAY_LEDGER
        .iter()
        .chain(privileges::RELAY_READS)
        .copied()
        .collect();
    let missing = match &client {
        Some(client) => privileges::missing(client, &needs).await?,
        None => Vec::new(),
    };
    if !missing.is_empty() {
        return Err(RelayError::Ledger(LedgerError::Invalid(format!(
            "the relay's role cannot write its ledger, so nothing was sent: {}; run docs/least_privilege.sql as a superuser (or these GRANT statements), then start again (`outboxd check` lists the same)",
            missing.join("; ")
        ))));
    }
    // The schema this build's statements use (e.g. `outbox.receipt_of`, migration 0033): a
    // relay started before `outboxd migrate` would otherwise stream and publish, and stop at
    // the first statement that names what is missing. A newer schema is fine (a rollback).
    if let Some(client) = &client {
        let needed = outbox_ledger::migrate::latest();
        match outbox_ledger::migrate::applied(client).await? {
            Some(at) if at >= needed => {}
            at => {
                let at = at.map_or("not migrated".to_string(), |v| format!("at migration {v}"));
                return Err(RelayError::Ledger(LedgerError::Invalid(format!(
                    "schema outbox is {at}, and this outboxd needs migration {needed}, so nothing was sent: run `outboxd migrate --database-url ...` (as the schema's owner) with this binary, then start it again; relays of the earlier version keep running meanwhile (docs/operations.md, \"Upgrades and rollback\")"
                ))));
            }
        }
    }
    drop(client);
    let mut resnapshot = cfg.resnapshot;
    // Standing by, running, and whether an ended run reconnects or stops the process:
    // `outbox_relay::lifecycle::RunLoop`, on a clock from here.
    let mut life = RunLoop::relay(cfg.lease_ttl);
    let origin = Instant::now();
    let at = |i: Instant| i.saturating_duration_since(origin);
    loop {
        // A stop asked while the last run was ending (its `changed()` consumed by that run) is
        // honoured here, not missed by a standby that waits for the next change.
        if *shutdown.borrow() {
            return Ok(());
        }
        progress.run_begins();
        let outcome = match acquire_lease(&cfg, &mut life, &mut shutdown).await {
            Ok(None) => return Ok(()),
            Ok(Some((fence, held))) => {
                let span = tracing::info_span!("relay", database = %cfg.database, slot = %cfg.slot, generation = fence.generation, db = tracing::field::Empty, start_lsn = tracing::field::Empty);
                if poll {
                    poll::run_once(&cfg, &progress, &mut shutdown, &fence, held)
                        .instrument(span)
                        .await
                } else {
                    run_once(
                        &cfg,
                        &progress,
                        &mut shutdown,
                        &mut resnapshot,
                        &fence,
                        held,
                    )
                    .instrument(span)
                    .await
                }
            }
            Err(e) => Err(e),
        };
        progress.metrics.streaming(false);
        if let Some(since) = progress.streaming_since() {
            life.streaming(at(since));
        }
        let Err(e) = outcome else { return Ok(()) };
        let error = RunError {
            transient: e.is_transient(),
            lease_lost: matches!(e, RelayError::Ledger(LedgerError::LeaseLost { .. })),
        };
        match life.ended(at(Instant::now()), error) {
            LoopStep::Retry { after } => {
                progress.reconnects.fetch_add(1, Ordering::Relaxed);
                progress.metrics.reconnect();
                tracing::warn!(error = %e, retry_in_ms = after.as_millis() as u64, "relay interrupted; replaying from the last checkpoint");
                if *shutdown.borrow() {
                    return Err(e);
                }
                tokio::select! {
                    _ = tokio::time::sleep(after) => {}
                    _ = shutdown.changed() => return Ok(()),
                }
            }
            _ => return Err(e),
        }
    }
}

/// The lease a run holds: when the request that took it was asked (it is certainly ours for
/// `lifecycle::certain_for` from then), and the session that took it, which holds its
/// advisory lock (if `locked`) and renews it for the whole run (migration 0018).
pub(super) struct HeldLease {
    asked: Instant,
    session: Client,
    locked: bool,
}

/// Waits as a hot standby until this relay holds the slot's lease (`life` says when to ask
/// again). Returns the fence and the held lease, or `None` on shutdown.
async fn acquire_lease(
    cfg: &RelayConfig,
    life: &mut RunLoop,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Option<(Fence, HeldLease)>, RelayError> {
    let client = connect_sql(cfg.database_url.expose()).await?;
    let mut step = life.begin();
    loop {
        if *shutdown.borrow() {
            return Ok(None);
        }
        match step {
            LoopStep::AskLease => {}
            LoopStep::Standby { wait, .. } => {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.changed() => return Ok(None),
                }
            }
            other => {
                return Err(RelayError::Internal(format!(
                    "the run loop answered {other:?} to a lease request"
                )))
            }
        }
        let asked = Instant::now();
        let locked = lease::try_lock(&client, &cfg.slot).await?;
        match lease::try_acquire(&client, &cfg.slot, &cfg.relay_id, cfg.lease_ttl, locked).await? {
            Acquire::Acquired { generation, early } => {
                if early {
                    tracing::warn!(slot = %cfg.slot, relay_id = %cfg.relay_id, generation,
                        "lease taken over before it expired: its holder's session and walsender are gone");
                } else {
                    tracing::info!(slot = %cfg.slot, relay_id = %cfg.relay_id, generation, locked, "lease acquired");
                }
                life.lease_answer(LeaseAnswer::Acquired);
                let fence = Fence {
                    owner: cfg.relay_id.clone(),
                    generation,
                };
                let held = HeldLease {
                    asked,
                    session: client,
                    locked,
                };
                return Ok(Some((fence, held)));
            }
            Acquire::HeldBy { owner, remaining } => {
                if locked {
                    lease::unlock(&client, &cfg.slot).await?;
                }
                step = life.lease_answer(LeaseAnswer::HeldBy { remaining });
                if let LoopStep::Standby { first: true, .. } = step {
                    tracing::info!(slot = %cfg.slot, %owner, remaining_ms = remaining.as_millis() as u64,
                        "standby: another relay holds the slot; taking over when its lease expires or its holder is gone");
                }
            }
        }
    }
}

async fn connect_sql(url: &str) -> Result<Client, RelayError> {
    let fail = |message: String| RelayError::Connect {
        url: redact_url(url),
        message,
    };
    let opts = PgConnectOptions::parse(url).map_err(|e| fail(e.to_string()))?;
    opts.connect_sql().await.map_err(|e| match e {
        ConnectError::Db(e) => fail(outbox_ledger::describe_db_error(&e)),
        ConnectError::Tls(e) => fail(e.to_string()),
    })
}

/// A connection for acceptance transactions: [`connect_sql`], made one of this run's
/// acceptance sessions (`outbox_ledger::sessions::make_acceptance_session`: named after the
/// slot and the generation, with an idle-in-transaction limit).
pub(crate) async fn connect_acceptance(
    url: &str,
    lease_ttl: Duration,
    slot: &str,
    fence: &Fence,
) -> Result<Client, RelayError> {
    let client = connect_sql(url).await?;
    sessions::make_acceptance_session(&client, lease_ttl, slot, fence).await?;
    Ok(client)
}

/// At the start of a run that holds the lease: names its SQL session as one of this run's and
/// ends the sessions of earlier holders that are still inside a transaction
/// (`outbox_ledger::sessions::end_stale_sessions` says why).
pub(super) async fn own_sessions(
    sql: &Client,
    slot: &str,
    fence: &Fence,
) -> Result<(), RelayError> {
    sessions::name_session(sql, slot, fence).await?;
    let ended = sessions::end_stale_sessions(sql, slot, fence).await?;
    if ended > 0 {
        tracing::warn!(
            sessions = ended,
            "ended sessions of an earlier holder of the slot (stopped or hung inside a transaction)"
        );
    }
    Ok(())
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Emits the heartbeat (`outbox_source::slot::emit_heartbeat`) every `interval`, so that an
/// idle database still moves WAL through the slot and the relay can confirm past it.
fn spawn_heartbeat(client: Client, interval: Duration) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = slot::emit_heartbeat(&client).await {
                tracing::warn!(error = %e, "heartbeat failed");
            }
        }
    }))
}

/// `outbox.aggregate_versions` lost its rows (an unlogged table, migration 0032): they are
/// given back before the run reads anything (`outbox_ledger::producer::restore_aggregate_versions`).
/// Poll mode finds pending events through the table (`required`); the stream does not, and a
/// failure there only leaves writers of new aggregates a look-up slower, so it is logged with
/// the fix and the run goes on.
pub(super) async fn restore_versions(
    sql: &tokio_postgres::Client,
    required: bool,
) -> Result<(), RelayError> {
    match outbox_ledger::producer::restore_aggregate_versions(sql).await {
        Ok(0) => Ok(()),
        Ok(restored) => {
            tracing::warn!(
                restored,
                "outbox.aggregate_versions had lost its rows (a crash of the server, a promoted standby or a restored base backup: the table is unlogged); restored them from the outbox rows"
            );
            Ok(())
        }
        Err(e) if !required => {
            tracing::warn!(
                error = %e,
                "could not restore outbox.aggregate_versions (the stream does not need it; writers of new aggregates read the rows until it is restored): GRANT EXECUTE ON FUNCTION outbox.restore_aggregate_versions() TO this relay's role"
            );
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

async fn run_once(
    cfg: &RelayConfig,
    progress: &Arc<Progress>,
    shutdown: &mut watch::Receiver<bool>,
    // `--resnapshot`: stays asked until a run recorded its new slot in the ledger. A run that
    // ended before (after dropping the old slot, or creating the new one) left a ledger whose
    // checkpoint names a slot that is gone or behind the new one: its retry must drop and
    // create again, where a plan without it refuses to start.
    resnapshot: &mut bool,
    fence: &Fence,
    held: HeldLease,
) -> Result<(), RelayError> {
    let url = cfg.database_url.expose();
    let (lease_state, _keeper) = keep_lease(cfg, fence, held);
    let ledger_client = connect_acceptance(url, cfg.lease_ttl, &cfg.slot, fence).await?;
    let mut sql = connect_sql(url).await?;
    own_sessions(&sql, &cfg.slot, fence).await?;
    restore_versions(&sql, false).await?;
    // wal_level and the REPLICATION privilege were checked once, before the first run.
    slot::ensure_shard_publication(&sql, &cfg.publication, &cfg.schema, &cfg.table, cfg.shard)
        .await?;
    let qualified = format!(
        "{}.{}",
        slot::quote_ident(&cfg.schema),
        slot::quote_ident(&cfg.table)
    );
    // Released and reconciled events are read as the relay must publish them now: with their
    // latest explicit destination migration, if any.
    let current_rows = if (cfg.schema.as_str(), cfg.table.as_str()) == ("outbox", "events") {
        "outbox.events_current".to_string()
    } else {
        qualified.clone()
    };

    let opts = PgConnectOptions::parse(url).map_err(|e| RelayError::Internal(e.to_string()))?;
    let pg_cfg = &opts.config;
    let mut repl = ReplicationConnection::connect_with_tls(pg_cfg, &opts.tls)
        .await
        .map_err(|e| match e.sqlstate() {
            Some("42501") => SourceError::NoReplicationPrivilege {
                user: pg_cfg.get_user().unwrap_or("?").to_string(),
                message: e.to_string(),
            },
            _ => SourceError::from(e),
        })?;
    let ident = repl.identify_system().await.map_err(SourceError::from)?;
    let dbname = ident
        .dbname
        .clone()
        .ok_or_else(|| RelayError::Internal("IDENTIFY_SYSTEM returned no database".into()))?;

    tracing::Span::current().record("db", dbname.as_str());

    let slot_info = slot::inspect(&sql, &cfg.slot).await?;
    let ledger = checkpoint::load(&sql, &cfg.slot).await?;
    let view = ledger.as_ref().map(|c| LedgerView {
        checkpoint: c.confirmed_lsn,
        snapshot_done: c.snapshot_done,
        system_identifier: c.system_identifier.clone(),
    });
    let plan_for = |slot_info: Option<slot::SlotInfo>| {
        slot::plan(
            &cfg.slot,
            &dbname,
            &ident.system_id,
            slot_info.as_ref(),
            view.as_ref(),
            *resnapshot,
        )
    };
    let plan = match plan_for(slot_info) {
        // The slot is still being created, by a session of a relay that lost this lease while
        // it created the slot (stopped, or a fleet member's shard relay aborted after a
        // hand-over). This run holds the lease: it ends that session, the unfinished slot is
        // dropped with it, and the plan is made again (it creates the slot). (The simulator's
        // slot creation is atomic: it never sees one half made.)
        Err(SourceError::SlotInCreation { .. }) => {
            tracing::warn!("replication slot is still being created by a session without the lease; ending that session");
            take_over_slot(&sql, &cfg.slot, fence).await?;
            plan_for(slot::inspect(&sql, &cfg.slot).await?)?
        }
        plan => plan?,
    };
    tracing::info!(?plan, "start plan");

    let mut pipeline = open_pipeline(cfg, &sql, ledger_client, fence, &lease_state).await?;

    // What the plan decided, run in the core's order (`outbox_relay::lifecycle::CdcStart`,
    // which the simulator runs too).
    let (slot_start, mut start) = (plan.slot_start(), plan.start());
    let mut exported = None;
    let mut steps = CdcStart::new(slot_start);
    let start = loop {
        let at = || {
            start.ok_or_else(|| {
                RelayError::Internal("a start step before the slot had a position".into())
            })
        };
        match steps.next(&pipeline.core) {
            CdcStep::RefusePlainRows => refuse_new_slot_over_plain_rows(&sql, cfg).await?,
            CdcStep::DropSlot => slot::drop_slot(&sql, &cfg.slot).await?,
            CdcStep::CreateSlot => {
                let created = repl
                    .create_logical_slot(&cfg.slot, true)
                    .await
                    .map_err(SourceError::from)?;
                let cp = Lsn(created.consistent_point);
                tracing::info!(consistent_point = %cp, "created replication slot");
                start = Some(cp);
                exported = created.snapshot_name;
            }
            CdcStep::RecordSlot => {
                let lsn = at()?;
                if matches!(slot_start, SlotStart::Resume { adopt: true, .. }) {
                    tracing::warn!(slot_lsn = %lsn, "adopting a slot the ledger does not know; publishing a snapshot of unpublished rows first");
                }
                checkpoint::create(
                    &sql,
                    &cfg.slot,
                    &cfg.publication,
                    &ident.system_id,
                    ident.timeline,
                    lsn,
                )
                .await?;
                *resnapshot = false;
            }
            CdcStep::Start(StartStep::Snapshot) => {
                // As the relay must publish them now: with their latest destination migration.
                let n = publish_snapshot(
                    cfg,
                    &mut sql,
                    &mut pipeline,
                    &current_rows,
                    exported.as_deref(),
                    progress,
                )
                .await?;
                checkpoint::mark_snapshot_done(&sql, &cfg.slot).await?;
                tracing::info!(events = n, "initial snapshot published");
            }
            CdcStep::Start(step) => {
                start_step(cfg, &sql, &mut pipeline, fence, &current_rows, step).await?
            }
            CdcStep::TakeOverSlot => take_over_slot(&sql, &cfg.slot, fence).await?,
            // The numbering of rows written without a version that earlier runs logged,
            // folded into the map this run reads when it first meets an aggregate (migration
            // 0040); refused when the checkpoint moved past `start` since the plan read it.
            CdcStep::FoldNumbering => {
                let folded =
                    outbox_ledger::numbering::fold_at_start(&mut sql, &cfg.slot, at()?).await?;
                if folded > 0 {
                    tracing::info!(aggregates = folded, "folded the numbering log");
                }
            }
            CdcStep::Stream => break at()?,
        }
    };
    crate::failpoint::pause("before-start-replication").await;
    let quoted_pub = cfg.publication.replace('"', "");
    let mut stream = repl
        .start_logical_replication(
            &cfg.slot,
            start.0,
            &[
                ("proto_version", "1"),
                ("publication_names", &format!("\"{quoted_pub}\"")),
            ],
        )
        .await
        .map_err(|e| SourceError::at_start_replication(&cfg.slot, start, e))?;
    // The slot, now held, read again: one replaced since the plan read it is refused
    // (`CdcStart::check_held` says why).
    let held = slot::inspect(&sql, &cfg.slot).await?;
    steps
        .check_held(&pipeline.core, start, held.and_then(|h| h.confirmed_flush))
        .map_err(|slot_lsn| SourceError::SlotAhead {
            slot: cfg.slot.clone(),
            slot_lsn,
            checkpoint: start,
        })?;
    progress.began_streaming();
    progress.set_checkpoint(start);
    tracing::info!(start = %start, "streaming");
    tracing::Span::current().record("start_lsn", tracing::field::display(start));
    let _heartbeat = spawn_heartbeat(connect_sql(url).await?, cfg.heartbeat_interval);

    pipeline.enable_pipelined_accept(
        connect_acceptance(url, cfg.lease_ttl, &cfg.slot, fence).await?,
        url,
    );
    let mut decoder = Decoder::new(&cfg.schema, &cfg.table);
    // After the publication took outbox.route_versions in (ensure_shard_publication above):
    // a version made before that is read here, one made after arrives in the stream.
    decoder.know_route_versions(slot::route_versions(&sql).await?);
    // The route policy generation in force at the checkpoint (kept with it), or the newest
    // when the checkpoint has none yet: rows written without a route are routed by it until
    // the stream delivers the next (docs/versions_by_relay.md).
    let kept = outbox_ledger::numbering::policy_generation(&sql, &cfg.slot).await?;
    if let Some(generation) = slot::policy_generation(&sql, kept).await? {
        pipeline.core.start_generations(Some(generation.id), kept);
        decoder.know_policy(generation);
    }
    if cfg.delivery == crate::values::Delivery::ExactlyOnce {
        // The start (reconciliation, snapshot) ran at least once; from here every batch is
        // a Kafka transaction (`txn`). A transaction left open by an error is aborted by
        // the next holder's producer: there is nothing to salvage.
        let ledger = connect_acceptance(url, cfg.lease_ttl, &cfg.slot, fence).await?;
        return txn::stream(
            cfg,
            progress,
            shutdown,
            &sql,
            ledger,
            &mut stream,
            &mut decoder,
            start,
            fence,
            &lease_state,
            &current_rows,
            (&ident.system_id, &dbname),
            // As `open_pipeline` loaded them: read once per run.
            pipeline.core.skipped_events().collect(),
        )
        .await;
    }
    let mut stage = Stage::default();
    pipeline.core.start_streaming(start);
    // When the loop does what is decided by the core's schedule; time is measured from here.
    let run_started = Instant::now();
    let since = |i: Instant| i.saturating_duration_since(run_started);
    let bounds = bounds(cfg);
    let mut schedule = Schedule::new(
        schedule::Settings {
            status_interval: cfg.status_interval,
            batch_linger: cfg.batch_linger,
            bounds,
            release_poll: RELEASE_POLL,
        },
        Duration::ZERO,
    );

    let result: Result<(), RelayError> = async {
    loop {
        // One look at the clock for the turn's decisions: a turn is short, and the clock read
        // per turn was a visible share of the relay's CPU.
        let turn = Instant::now();
        let load = load_of(&mut pipeline, bounds, since(turn));
        let accepting = load.accepting;
        let wake = run_started + schedule.next_wakeup(&load);
        let sleep = tokio::time::sleep_until(tokio::time::Instant::from_std(wake.max(turn)));
        let can_read = schedule.can_read(&load);
        match schedule.held_notice(since(turn), &load) {
            Some(HeldNotice::NotRead) => tracing::warn!(waiting = load.waiting_on_unclear.events,
                waiting_bytes = load.waiting_on_unclear.bytes, parked = pipeline.core.parked(),
                limit = cfg.unclear_max_waiting, limit_bytes = outbox_relay::MAX_WAITING_BYTES,
                "the slot is not read: this many events wait on unclear outcomes (relay.unclear_max_waiting), so every aggregate waits until some move; see outboxd_waiting_on_unclear_events and outboxd_unclear_events, and fix the destination or raise the bound (each waiting event is kept in memory)"),
            Some(HeldNotice::ReadingAgain) => {
                tracing::info!("reading the slot again: fewer events wait on unclear outcomes")
            }
            None => {}
        }
        tokio::select! {
            biased;
            _ = shutdown.changed() => {
                drain_and_stop(&mut pipeline, &mut stream, progress).await?;
                lease::release(&sql, &cfg.slot, fence).await?;
                return Ok(());
            }
            Some(d) = pipeline.reports.recv() => pipeline.on_reports(d).await?,
            done = pipeline::lookup_finished(&mut pipeline.lookups) => pipeline.on_lookup(done).await?,
            _ = pipeline::unclear_due(&pipeline.core) => pipeline.run_due_unclear().await?,
            joined = pipeline::accept_finished(&mut pipeline.accepting), if accepting => {
                let before = pipeline.core.durable();
                pipeline.finish_accept(joined, progress)?;
                schedule.accepted(since(Instant::now()), pipeline.core.durable() > before);
            }
            msg = stream.next_message(), if can_read => {
                // A row of an aggregate the core does not know is staged with what follows it
                // (`outbox_relay::stage`), while more is waiting, and goes to the core after
                // one look-up of the heads.
                let mut msg = msg;
                loop {
                    let m = match msg.map_err(SourceError::from)? {
                        None => return Err(RelayError::StreamEnded),
                        Some(ReplicationMessage::Keepalive { wal_end, reply_requested, .. }) => {
                            Some(Staged::Keepalive { wal_end: Lsn(wal_end), reply_requested })
                        }
                        Some(ReplicationMessage::XLogData { wal_start, data, .. }) => {
                            pipeline.core.on_received(Lsn(wal_start));
                            match decoder.decode(data)? {
                                Decoded::Begin { commit_lsn, commit_time, .. } => {
                                    progress.metrics.txn_begin(commit_lsn, commit_time);
                                    Some(Staged::Begin(commit_lsn))
                                }
                                Decoded::Event(res) => {
                                    Some(Staged::Row(Box::new((*res).map_err(|e| e.to_string())), Lsn(wal_start)))
                                }
                                Decoded::Commit { end_lsn, .. } => Some(Staged::Commit(end_lsn)),
                                Decoded::PolicyGeneration(id) => Some(Staged::PolicyGeneration(id)),
                                Decoded::Nothing => None,
                            }
                        }
                    };
                    if let Some(m) = m.and_then(|m| stage.offer(&pipeline.core, m)) {
                        pipeline.take_message(m, &mut schedule).await?;
                    }
                    if stage.is_empty() || stage.full() {
                        break;
                    }
                    match stream.next_message().now_or_never() {
                        Some(next) => msg = next,
                        None => break,
                    }
                }
                if !stage.is_empty() {
                    pipeline.learn_heads_and_replay(&mut stage, &mut schedule).await?;
                }
            }
            _ = sleep => {}
        }

        progress.metrics.in_flight(pipeline.core.tracker.in_flight());
        progress.metrics.unclear(pipeline.core.parked());
        let now = since(Instant::now());
        let due = schedule.due(now, &load_of(&mut pipeline, bounds, now));
        for step in due.steps() {
            match step {
                TurnStep::Accept => pipeline.flush_pipelined(progress).await?,
                TurnStep::CheckLease => {
                    still_leased(cfg, pipeline.core.lease_expired, &lease_state, fence)?
                }
                TurnStep::Releases => {
                    pipeline.release_poll(cfg, &sql, &current_rows, progress).await?
                }
                TurnStep::Status => {
                    confirm(&mut stream, &pipeline.core).await?;
                    progress
                        .metrics
                        .waiting_on_unclear(pipeline.waiting_on_unclear().events);
                }
            }
        }
    }
    }
    .await;
    salvage_after(&mut pipeline, progress, result).await
}

/// Ends a run that `result` says ended: whatever ended it, the answers the broker already gave
/// are evidence worth keeping, and every send still outstanding has its outcome recorded
/// (UNKNOWN attempts traced), within the salvage grace.
async fn salvage_after(
    pipeline: &mut Pipeline,
    progress: &Progress,
    result: Result<(), RelayError>,
) -> Result<(), RelayError> {
    if let Err(e) = &result {
        if let Err(secondary) = pipeline.end_run(Ending::Salvage, None, progress).await {
            tracing::debug!(error = %secondary, first = %e, "could not record outstanding receipts");
        }
    }
    result
}

/// An error if this run's lease is lost (taken over, or not renewed in time): it must stop
/// sending and moving its checkpoint.
/// `expired`: the run's own clock says the lease's deadline passed.
fn still_leased(
    cfg: &RelayConfig,
    expired: bool,
    lease_state: &LeaseState,
    fence: &Fence,
) -> Result<(), RelayError> {
    if expired || lease_state.is_lost() {
        return Err(lease_lost(&cfg.slot, fence));
    }
    Ok(())
}

/// The error that ends a run whose lease is lost (or no longer certainly held), said once.
pub(super) fn lease_lost(slot: &str, fence: &Fence) -> RelayError {
    tracing::warn!(
        generation = fence.generation,
        "lease lost to another relay; recording what the broker confirmed and stopping"
    );
    RelayError::Ledger(LedgerError::LeaseLost {
        slot: slot.to_string(),
        generation: fence.generation,
    })
}

/// The lease of this run, renewed in the background from here on (through slow start-ups
/// too) on the session that took it, and what the run knows of it.
fn keep_lease(cfg: &RelayConfig, fence: &Fence, held: HeldLease) -> (Arc<LeaseState>, AbortOnDrop) {
    // The keeper's clock counts from the question that took the lease.
    let keeper = LeaseKeeper::new(
        cfg.lease_ttl,
        Duration::ZERO,
        held.asked.elapsed(),
        held.locked,
    );
    let lease_state = Arc::new(LeaseState {
        keeper: std::sync::Mutex::new(keeper),
        base: held.asked,
    });
    let keeper = spawn_lease_keeper(
        held.session,
        cfg.slot.clone(),
        fence.clone(),
        cfg.lease_ttl,
        lease_state.clone(),
    );
    (lease_state, keeper)
}

/// The broker client and the pipeline of one run, its gate as the ledger left it.
async fn open_pipeline(
    cfg: &RelayConfig,
    sql: &Client,
    ledger_client: Client,
    fence: &Fence,
    lease_state: &Arc<LeaseState>,
) -> Result<Pipeline, RelayError> {
    let (sink, reports) = open_sink(cfg).await?;
    // A Kafka scan proves absence only once the attempt's request can no longer land; a
    // JetStream or HTTP look-up is itself an idempotent resend and needs no settle time.
    let policy = outbox_relay::UnclearPolicy {
        settle: match sink {
            AnySink::Kafka(_) => cfg.unknown_settle,
            _ => Duration::ZERO,
        },
        budget: cfg.unclear_budget,
        schedule: cfg.unclear_schedule,
        ..Default::default()
    };
    // What relays before migration 0026 journaled, folded once; every head is read from the
    // ledger when the relay first meets its aggregate (`outbox_relay::stage`).
    holds::fold_heads(sql, false).await?;
    let held = holds::load_held(sql).await?;
    if !held.is_empty() {
        tracing::warn!(
            aggregates = held.len(),
            "held aggregates loaded; see `outboxd quarantine list`"
        );
    }
    let skipped = holds::skipped_events(sql).await?;
    let mut pipeline = Pipeline::new(
        sink,
        reports,
        ledger_client,
        &cfg.slot,
        fence.clone(),
        lease_state.clone(),
        outbox_relay::PipelineCore::gate_from(Vec::new(), held),
    );
    pipeline.core.skipped_by_operator(skipped);
    // More than one version of an aggregate in flight only where the producer keeps them in
    // order (`kafka.in_flight_per_aggregate`; docs/ordering.md, "Hot aggregates").
    let depth = pipeline.sink().aggregate_depth();
    pipeline.core.set_aggregate_depth(depth);
    pipeline.core.unclear_policy = policy;
    pipeline.core.reconcile_settle = cfg.unknown_settle;
    pipeline.core.unclear_policies = cfg
        .endpoint_schedules
        .iter()
        .map(|(name, s)| (name.clone(), outbox_relay::UnclearPolicy::for_endpoint(*s)))
        .collect();
    pipeline.shard_filter = cfg.shard.map(|s| s.filter_sql("aggregate_id"));
    if let Some(rows) = crate::failpoint::numbering_fold_rows() {
        pipeline
            .core
            .fold_numbering_every(outbox_core::numbering::FOLD_ENTRIES, rows);
    }
    Ok(pipeline)
}

/// Before the first event of a poll-mode run: what `outbox_relay::lifecycle::RunStart` asks,
/// in its order (retry generations, UNKNOWN attempts reconciled, the gate's heads read again
/// after that); a poll run has no snapshot. A CDC run executes the same steps inside its
/// `CdcStart`.
async fn reconcile_at_start(
    cfg: &RelayConfig,
    sql: &Client,
    pipeline: &mut Pipeline,
    fence: &Fence,
    current_rows: &str,
) -> Result<(), RelayError> {
    let mut start = RunStart::new(false);
    loop {
        match start.next(&pipeline.core) {
            StartStep::Run | StartStep::Snapshot => return Ok(()),
            step => start_step(cfg, sql, pipeline, fence, current_rows, step).await?,
        }
    }
}

/// One of `RunStart`'s steps before the snapshot (the snapshot and the run are the caller's).
async fn start_step(
    cfg: &RelayConfig,
    sql: &Client,
    pipeline: &mut Pipeline,
    fence: &Fence,
    current_rows: &str,
    step: StartStep,
) -> Result<(), RelayError> {
    match step {
        StartStep::RetryGenerations => pipeline
            .core
            .retry_generation
            .extend(outbox_ledger::attempts::retry_generations(sql, &cfg.slot).await?),
        StartStep::ReconcileOpen => {
            pipeline
                .reconcile_unknown(
                    cfg,
                    sql,
                    fence,
                    current_rows,
                    outbox_relay::unknown::When::Start,
                )
                .await?
        }
        StartStep::RaiseHeads(known) => pipeline
            .core
            .raise_heads(holds::heads_of(sql, &known, None).await?),
        StartStep::Snapshot | StartStep::Run => {
            return Err(RelayError::Internal(format!(
                "start step {step:?} is the caller's"
            )))
        }
    }
    Ok(())
}

/// The broker client for one run, and the channel its delivery reports arrive on.
async fn open_sink(
    cfg: &RelayConfig,
) -> Result<(AnySink, mpsc::UnboundedReceiver<outbox_sink::Delivery>), RelayError> {
    let (reports_tx, reports) = mpsc::unbounded_channel();
    if !cfg.http.is_empty() {
        return Ok((
            AnySink::Http(HttpEndpoints::new(cfg.http.clone(), reports_tx)?),
            reports,
        ));
    }
    let sink = match &cfg.nats {
        Some(nats) => {
            let sink = JetStreamSink::connect(nats.clone(), reports_tx).await?;
            let budget = cfg.retry_budget(sink.ack_timeout());
            if sink.duplicate_window() < budget {
                tracing::warn!(stream = %nats.stream, duplicate_window_ms = sink.duplicate_window().as_millis() as u64,
                    retry_budget_ms = budget.as_millis() as u64,
                    "the stream's duplicate window is shorter than the relay's retry budget: some re-sends will not be deduplicated by the broker (the ledger still records them as duplicates); raise the stream's duplicate_window");
            }
            AnySink::JetStream(Box::new(sink))
        }
        None => {
            let sink = KafkaSink::new(cfg.sink.clone(), reports_tx)?;
            tokio::task::block_in_place(|| sink.check_reachable(Duration::from_secs(10)))?;
            AnySink::Kafka(sink)
        }
    };
    Ok((sink, reports))
}

/// What the schedule needs to know about the pipeline now.
fn load_of(pipeline: &mut Pipeline, bounds: Bounds, now: Duration) -> schedule::Load {
    let accepting = pipeline.accepting.is_some();
    let wall = std::time::SystemTime::now();
    pipeline.core.load_for(bounds, accepting, now, wall)
}

/// The only place the relay confirms an LSN to the slot. What it confirms is decided by the
/// core ([`outbox_relay::PipelineCore::standby_status`]; the argument why it is safe is at
/// [`outbox_relay::schedule::standby_status`]): `flush` is the checkpoint the ledger
/// committed together with the receipts that justify it, which the core learns only after
/// that transaction's COMMIT ([`outbox_relay::PipelineCore::checkpoint_committed`]).
pub(super) async fn confirm(
    stream: &mut outbox_source::transport::ReplicationStream,
    core: &outbox_relay::PipelineCore,
) -> Result<(), RelayError> {
    let st = core.standby_status();
    stream
        .send_standby_status(st.write.0, st.flush.0, st.apply.0, false)
        .await
        .map_err(SourceError::from)?;
    Ok(())
}

/// The backpressure's bounds: `relay.max_in_flight` unresolved events besides those waiting
/// on unclear outcomes, for those `relay.unclear_max_waiting` events and
/// [`outbox_relay::MAX_WAITING_BYTES`] of their payloads, `relay.batch_size`, and
/// [`pipeline::MAX_IN_FLIGHT_BYTES`] at the broker.
pub(super) fn bounds(cfg: &RelayConfig) -> Bounds {
    Bounds {
        max_in_flight: cfg.max_in_flight,
        max_waiting: schedule::Waiting {
            events: cfg.unclear_max_waiting,
            bytes: outbox_relay::MAX_WAITING_BYTES,
        },
        batch_size: cfg.batch_size,
        max_in_flight_bytes: pipeline::MAX_IN_FLIGHT_BYTES,
    }
}

/// The run's lease as its keeper decides it (`outbox_relay::lifecycle::LeaseKeeper`, on a clock
/// counting from the question that took the lease): the keeper task executes its renewals, the
/// run asks it whether it may still send.
#[derive(Debug)]
pub(crate) struct LeaseState {
    keeper: std::sync::Mutex<LeaseKeeper>,
    base: Instant,
}

impl LeaseState {
    /// The keeper, at its clock's `now` (held only for `f`, never across an await).
    fn with<R>(&self, f: impl FnOnce(&mut LeaseKeeper, Duration) -> R) -> R {
        let now = self.base.elapsed();
        let mut keeper = self.keeper.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut keeper, now)
    }

    /// Whether this relay may still send (`LeaseKeeper::valid`: the lease is ours and its
    /// deadline has not passed by the monotonic clock, which keeps counting while the process
    /// is paused).
    pub(crate) fn valid(&self) -> bool {
        self.with(|k, now| k.valid(now))
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.with(|k, _| k.is_lost())
    }
}

/// How often the keeper looks at its session: a closed one has freed the lease's session lock,
/// so a standby may take the lease at once; the run must stop sending before that.
const SESSION_CHECK: Duration = Duration::from_millis(20);

/// Executes the lease keeper's decisions (`outbox_relay::lifecycle::LeaseKeeper`: renew every
/// third of the TTL, certain from the question, lost when refused) on the session that took
/// the lease. That session holds the lease's advisory lock: when it closes (the server ended
/// it, or the network did), a standby may take the lease early, so the lease is lost here at
/// once.
fn spawn_lease_keeper(
    client: Client,
    slot: String,
    fence: Fence,
    ttl: Duration,
    state: Arc<LeaseState>,
) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
        loop {
            tokio::time::sleep(SESSION_CHECK).await;
            if client.is_closed() {
                tracing::warn!(slot = %slot, generation = fence.generation,
                    "the lease's session closed (its lock is free for a standby): lease lost, sending stops");
                state.with(|k, _| k.session_closed());
                return;
            }
            let Some(lock_first) = state.with(|k, now| k.renewal_due(now).then(|| k.asking(now)))
            else {
                continue;
            };
            if lock_first {
                match lease::try_lock(&client, &slot).await {
                    Ok(true) => {
                        state.with(|k, _| k.lock_taken());
                        if let Err(e) = lease::mark_locked(&client, &slot, &fence).await {
                            tracing::warn!(error = %e, "recording the lease's session lock failed");
                        }
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, "taking the lease's session lock failed"),
                }
            }
            let renewal = match lease::renew(&client, &slot, &fence, ttl).await {
                Ok(true) => Renewal::Renewed,
                Ok(false) => Renewal::Refused,
                Err(e) => {
                    tracing::warn!(error = %e, "lease renewal failed");
                    Renewal::Failed
                }
            };
            if state.with(|k, now| {
                k.answered(renewal, now);
                k.is_lost()
            }) {
                return;
            }
        }
    }))
}

/// A walsender still holds the slot: it belongs to a relay whose lease expired (we hold the
/// lease now), e.g. one that is paused. Terminate it, as long as `fence` holds the lease
/// (`outbox_ledger::sessions::terminate_if_leased`), and wait until the slot is free.
async fn take_over_slot(sql: &Client, slot_name: &str, fence: &Fence) -> Result<(), RelayError> {
    for i in 0..200 {
        let Some(info) = slot::inspect(sql, slot_name).await? else {
            return Ok(());
        };
        let Some(pid) = info.active_pid else {
            return Ok(());
        };
        if i == 0 {
            tracing::warn!(
                pid,
                "slot held by a walsender of a relay without the lease; terminating it"
            );
        }
        sessions::terminate_if_leased(sql, slot_name, pid, fence).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(RelayError::Internal(format!(
        "slot {slot_name} stayed in use for 10 s after its walsender was terminated"
    )))
}

/// How often the relay looks for holds an operator released.
const RELEASE_POLL: Duration = Duration::from_secs(1);

/// Graceful stop: wait (bounded) for outstanding delivery reports, accept them, confirm
/// (`Pipeline::end_run`).
async fn drain_and_stop(
    pipeline: &mut Pipeline,
    stream: &mut outbox_source::transport::ReplicationStream,
    progress: &Progress,
) -> Result<(), RelayError> {
    crate::failpoint::hang("before-stop-drain").await;
    pipeline
        .end_run(Ending::Stop, Some(stream), progress)
        .await?;
    tracing::info!(checkpoint = %pipeline.core.durable(), unresolved = pipeline.outstanding(), "stopped");
    Ok(())
}

/// Publishes every outbox row without a receipt, from the slot's exported snapshot when we
/// have it (exactly the rows the slot will not stream) or from a fresh one (a superset).
async fn publish_snapshot(
    cfg: &RelayConfig,
    sql: &mut Client,
    pipeline: &mut Pipeline,
    qualified: &str,
    exported: Option<&str>,
    progress: &Progress,
) -> Result<u64, RelayError> {
    let tx = snapshot::begin_read(sql, exported).await?;
    let rows = snapshot::pending_rows(&tx, qualified, cfg.shard).await?;
    let n = pipeline
        .admit_rows(rows, Read::Snapshot, bounds(cfg), progress)
        .await?;
    // Everything, parked events too: the snapshot is done only when each row is resolved.
    pipeline.drain_all(cfg.batch_size, progress, false).await?;
    tx.commit().await.map_err(|e| LedgerError::Db {
        context: "closing the snapshot transaction".into(),
        source: e,
    })?;
    Ok(n)
}
