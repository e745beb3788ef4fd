//! Poll mode (`outboxd run --mode poll`): the same pipeline, ledger, ordering gate, UNKNOWN
//! reconciliation, releases and lease as CDC mode, fed by short queries instead of a
//! replication slot, for databases where logical replication is not allowed.
//!
//! Each round reads the next pending events ([`outbox_source::poll::pending_sql`]: per
//! aggregate, the events without a receipt above its poll position, oldest first), admits them to the pipeline, waits
//! for every delivery report, and accepts the receipts in ledger transactions; the next round
//! starts only when nothing is outstanding, so a round never offers an event that is still at
//! the broker. Nothing is confirmed anywhere: the receipts are the only progress, and a relay
//! that dies mid-round leaves the rest pending for the next holder of the lease, which sends
//! them again (the broker copies of a SIGKILLed round become duplicate receipts, as after a CDC
//! replay). `--slot` names the lease: one poll relay per name is active, the others stand by.
//! The order of a round's steps, when releases are polled and when the loop waits are the
//! core's ([`outbox_relay::poll::PollRun`]); this file executes them.

use std::sync::Arc;
use std::time::Instant;

use outbox_ledger::lease::{self, Fence};
use outbox_ledger::LedgerError;
use outbox_relay::poll::{Advance, PollRun, RoundStep, ROUND_LIMIT};
use outbox_source::poll;
use tokio::sync::watch;
use tokio_postgres::Client;

use super::pipeline::{Pipeline, Read};
use super::{
    connect_acceptance, connect_sql, keep_lease, open_pipeline, own_sessions, reconcile_at_start,
    restore_versions, Progress, RelayError, RELEASE_POLL,
};
use crate::config::RelayConfig;

/// One poll-mode run, while this relay holds the lease.
/// Poll mode finds pending rows through `outbox.aggregate_versions`, in version order: a row
/// written by a plain INSERT (no version: docs/versions_by_relay.md) would never be found, so
/// an outbox that allows them is refused, at start and while the relay runs, never served
/// with those rows silently left behind.
async fn refuse_rows_without_versions(sql: &tokio_postgres::Client) -> Result<(), RelayError> {
    if outbox_ledger::numbering::plain_inserts_allowed(sql, "outbox.events").await? == Some(true) {
        return Err(RelayError::Unsupported(
            "outbox.events allows rows without an aggregate version (the writer's plain INSERT), which poll mode cannot find or order: only the replication stream numbers them, in commit order. Run the relay with --mode cdc, or, if no writer inserts plainly, SELECT outbox.allow_plain_inserts(false) as the outbox's owner".into(),
        ));
    }
    Ok(())
}

pub(super) async fn run_once(
    cfg: &RelayConfig,
    progress: &Arc<Progress>,
    shutdown: &mut watch::Receiver<bool>,
    fence: &Fence,
    held: super::HeldLease,
) -> Result<(), RelayError> {
    let url = cfg.database_url.expose();
    if (cfg.schema.as_str(), cfg.table.as_str()) != ("outbox", "events") {
        return Err(RelayError::Internal(format!(
            "poll mode reads outbox.events (the versions outbox.enqueue gives); {}.{} is not supported: use --mode cdc, or enqueue through outbox.enqueue",
            cfg.schema, cfg.table
        )));
    }
    let (lease_state, _keeper) = keep_lease(cfg, fence, held);
    let ledger_client = connect_acceptance(url, cfg.lease_ttl, &cfg.slot, fence).await?;
    let mut sql = connect_sql(url).await?;
    own_sessions(&sql, &cfg.slot, fence).await?;
    refuse_rows_without_versions(&sql).await?;
    // Pending events are found through outbox.aggregate_versions: it must be whole.
    restore_versions(&sql, true).await?;
    // As the relay must publish them now: with their latest destination migration.
    let current_rows = "outbox.events_current";
    let mut pipeline = open_pipeline(cfg, &sql, ledger_client, fence, &lease_state).await?;
    pipeline.core.unclear_touched = Some(Default::default());
    // No snapshot in poll mode: every round reads what has no receipt.
    reconcile_at_start(cfg, &sql, &mut pipeline, fence, current_rows).await?;
    // Not prepared: planned at every round with the statistics of the moment (receipts and
    // positions grow from nothing; a plan made for empty tables does not scale).
    let pending = poll::pending_sql(current_rows);
    progress.began_streaming();
    tracing::info!(lease = %cfg.slot, interval_ms = cfg.poll_interval.as_millis() as u64, "polling");

    // The clock the core's round decisions are kept on; the loop runs the core's steps
    // (`outbox_relay::poll::PollRun`, which the simulator's poll relay runs too).
    let run_started = Instant::now();
    let since = || run_started.elapsed();
    let mut run = PollRun::new(cfg.poll_interval, RELEASE_POLL);
    let result: Result<(), RelayError> = async {
        loop {
            let stopping = *shutdown.borrow();
            match run.next(&mut pipeline.core, since(), stopping) {
                RoundStep::Stop => {
                    lease::release(&sql, &cfg.slot, fence).await?;
                    tracing::info!("stopped");
                    return Ok(());
                }
                // What was sent since the last round (an unclear event resolved and the one
                // behind it, between rounds) is reported and its receipt accepted before the
                // read; after it, nothing of the round may still be at the broker.
                RoundStep::DrainBefore | RoundStep::DrainAfter => {
                    pipeline.drain_all(cfg.batch_size, progress, true).await?
                }
                RoundStep::Advance(Advance::All) => {
                    poll::advance_positions(&sql, None).await?;
                }
                RoundStep::Advance(Advance::These { types, ids }) => {
                    poll::advance_positions(&sql, Some((&types, &ids))).await?;
                }
                RoundStep::Advance(Advance::Nothing) => {}
                RoundStep::Read => {
                    let n = read(cfg, &mut sql, &pending, fence, &mut pipeline, progress).await?;
                    run.read(n);
                }
                RoundStep::CheckLease => {
                    super::still_leased(cfg, pipeline.core.lease_expired, &lease_state, fence)?
                }
                RoundStep::Releases => {
                    refuse_rows_without_versions(&sql).await?;
                    pipeline
                        .release_poll(cfg, &sql, current_rows, progress)
                        .await?;
                }
                RoundStep::Status => {
                    progress.metrics.unclear(pipeline.core.parked());
                    progress
                        .metrics
                        .waiting_on_unclear(pipeline.waiting_on_unclear().events);
                }
                RoundStep::Idle { until } => {
                    // Parked events are looked up (or sent again) meanwhile.
                    let until = tokio::time::Instant::from_std(run_started + until);
                    if pipeline.outstanding() == 0 {
                        // A running reconciliation's look-up may still finish meanwhile.
                        tokio::select! {
                            _ = tokio::time::sleep_until(until) => {}
                            _ = shutdown.changed() => {}
                            done = super::pipeline::lookup_finished(&mut pipeline.lookups) => pipeline.on_lookup(done).await?,
                        }
                    } else {
                        while tokio::time::Instant::now() < until && !*shutdown.borrow() {
                            pipeline.wait_one(Some(until)).await?;
                        }
                    }
                }
            }
        }
    }
    .await;
    super::salvage_after(&mut pipeline, progress, result).await
}

/// A round's read: the next pending events, read and recorded in one transaction
/// (`poll::begin_round`), committed once every row is admitted. Returns how many it read.
async fn read(
    cfg: &RelayConfig,
    sql: &mut Client,
    pending: &str,
    fence: &Fence,
    pipeline: &mut Pipeline,
    progress: &Progress,
) -> Result<u64, RelayError> {
    let started = Instant::now();
    let tx = poll::begin_round(sql, &cfg.slot, fence.generation).await?;
    let rows = poll::pending_rows(&tx, pending, ROUND_LIMIT as i64).await?;
    let n = pipeline
        .admit_rows(rows, Read::PollRound, super::bounds(cfg), progress)
        .await?;
    tx.commit().await.map_err(|e| LedgerError::Db {
        context: "ending the poll round's read".into(),
        source: e,
    })?;
    if n > 0 {
        tracing::debug!(
            events = n,
            read_ms = started.elapsed().as_secs_f64() * 1e3,
            "poll round read"
        );
    }
    Ok(n)
}
