//! `outboxd run --fleet`: one of several relay processes, on any hosts, that share the shards
//! of a sharded outbox (`outboxd migrate --shards N`) without a coordinator: PostgreSQL holds
//! the members (`outbox.relay_members`, migration 0019) and the shards' leases. What to take
//! and what to hand over is decided by `outbox_relay::fleet::plan` (pure); this loop reads the
//! members and leases and starts or stops the shard relays it says.
//!
//! Every half second a member writes its row and counts the live members; its fair share is
//! the shard count over them, rounded up. Under its share it starts a shard's relay (the same
//! `run` as `--shard I/N`) for free shards: a lease missing, expired, released, or held by a
//! relay that is no live member (SIGKILLed: its lease is taken at once; paused: at expiry). A
//! member is live while its row is fresh *and* its session advisory lock is held: a member
//! whose process died lost the lock when its connection closed, so its shards are taken at
//! once, not when its row ages out.
//! Over its share it stops one of its shards gracefully (drained, confirmed, lease released),
//! which another member then takes. The leases alone decide who sends: two members can never
//! both hold a shard, whatever the members' view of each other.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_relay::fleet::{self, Step, STOP_GRACE, TICK};
use outbox_source::shard::Shard;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{connect_sql, Progress, RelayError};
use crate::config::RelayConfig;

/// A shard relay this member started.
struct Task {
    stop: watch::Sender<bool>,
    progress: Arc<Progress>,
    handle: JoinHandle<Result<(), RelayError>>,
    started: Instant,
}

/// The shard count of the current layout, from the shards' publications.
async fn layout(client: &tokio_postgres::Client, publication: &str) -> Result<u16, RelayError> {
    let rows = client
        .query(
            "SELECT pubname FROM pg_publication WHERE starts_with(pubname, $1)",
            &[&format!("{publication}_shard")],
        )
        .await
        .map_err(|e| RelayError::Internal(format!("reading the shards' publications: {e}")))?;
    let mut counts: Vec<u16> = rows
        .iter()
        .filter_map(|r| Some(Shard::from_name(r.get(0), publication)?.count))
        .collect();
    counts.sort_unstable();
    counts.dedup();
    match counts.as_slice() {
        [n] => Ok(*n),
        [] => Err(RelayError::Internal(format!(
            "no shard publications {publication}_shard*: run `outboxd migrate --shards N` first (docs/scaling.md)"
        ))),
        many => Err(RelayError::Internal(format!(
            "publications of several shard layouts exist ({many:?} shards): run `outboxd migrate --shards N` for the one you want"
        ))),
    }
}

/// Runs this member until `shutdown`; then stops its shards gracefully.
pub async fn run(base: RelayConfig, mut shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
    let url = base.database_url.expose().to_string();
    let client = connect_sql(&url).await?;
    let count = layout(&client, &base.publication).await?;
    let me = base.relay_id.clone();
    let base_slot = base.slot.clone();
    let base_pub = base.publication.clone();
    let mut locked = false;
    tracing::info!(relay_id = %me, shards = count, "fleet member: sharing {count} shards");
    let shard_slots: Vec<String> = Shard::all(count).map(|s| s.name(&base_slot)).collect();
    let mut tasks: BTreeMap<u16, Task> = BTreeMap::new();
    // Shard relays told to stop, with the deadline after which they are aborted. The member's
    // loop (and its heartbeat) never waits for one: a stop that hangs must not make the others
    // take this member for dead.
    let mut stopping: Vec<(u16, Task, Instant)> = Vec::new();
    let db = |what: &'static str| {
        move |e: tokio_postgres::Error| RelayError::Internal(format!("{what}: {e}"))
    };
    loop {
        if *shutdown.borrow() {
            break;
        }
        client
            .execute(
                "INSERT INTO outbox.relay_members (relay_id) VALUES ($1)
                 ON CONFLICT (relay_id) DO UPDATE SET seen_at = clock_timestamp()",
                &[&me],
            )
            .await
            .map_err(db("writing this fleet member's row"))?;
        // The session lock that proves this member alive to the others (a previous process of
        // the same relay id may still hold it for a moment: asked again every tick).
        if !locked {
            locked =
                outbox_ledger::lease::try_lock(&client, &outbox_ledger::lease::member_lock(&me))
                    .await?;
        }
        let members = outbox_ledger::lease::live_members(&client, &me, base.lease_ttl).await?;
        // Each shard's lease: its holder, if live.
        let holders: BTreeMap<u16, String> = client
            .query(
                "SELECT slot_name, owner FROM outbox.relay_leases
                 WHERE slot_name = ANY($1) AND lease_until > clock_timestamp()",
                &[&shard_slots],
            )
            .await
            .map_err(db("reading the shards' leases"))?
            .iter()
            .filter_map(|r| Some((Shard::from_name(r.get(0), &base_slot)?.index, r.get(1))))
            .collect();
        // Finished tasks (an error the relay does not retry, or a stop) leave.
        let done: Vec<u16> = tasks
            .iter()
            .filter(|(_, t)| t.handle.is_finished())
            .map(|(i, _)| *i)
            .collect();
        for i in done {
            if let Some(t) = tasks.remove(&i) {
                match t.handle.await {
                    Ok(Err(e)) => tracing::warn!(shard = i, error = %e, "shard relay ended"),
                    Err(e) => tracing::warn!(shard = i, error = %e, "shard relay panicked"),
                    Ok(Ok(())) => {}
                }
                t.progress.metrics.retire();
            }
        }
        stopping.retain(|(i, t, deadline)| {
            if t.handle.is_finished() {
                t.progress.metrics.retire();
                return false;
            }
            if Instant::now() >= *deadline {
                tracing::warn!(
                    shard = i,
                    "a stopped shard relay did not end in time; aborting it"
                );
                t.handle.abort();
                t.progress.metrics.retire();
                return false;
            }
            true
        });
        let running: BTreeMap<u16, Duration> = tasks
            .iter()
            .map(|(i, t)| (*i, t.started.elapsed()))
            .collect();
        let steps = fleet::plan(&fleet::View {
            count,
            me: &me,
            members: &members,
            holders: &holders,
            running: &running,
            give_up: fleet::give_up(base.lease_ttl),
        });
        for step in steps {
            match step {
                Step::GiveUp(i) | Step::HandOver(i) => {
                    if matches!(step, Step::HandOver(_)) {
                        tracing::info!(
                            shard = i,
                            members = members.len(),
                            "fleet: handing a shard over"
                        );
                    }
                    if let Some(t) = tasks.remove(&i) {
                        let _ = t.stop.send(true);
                        stopping.push((i, t, Instant::now() + STOP_GRACE));
                    }
                }
                Step::Take(i) => {
                    let shard = Shard { index: i, count };
                    let mut cfg = base.clone();
                    cfg.shard = Some(shard);
                    cfg.slot = shard.name(&base_slot);
                    cfg.publication = shard.name(&base_pub);
                    let (stop, rx) = watch::channel(false);
                    tracing::info!(shard = %shard, members = members.len(), "fleet: taking a shard");
                    let progress = Arc::new(Progress::new(&cfg));
                    let handle = tokio::spawn(super::run(cfg, progress.clone(), rx));
                    tasks.insert(
                        i,
                        Task {
                            stop,
                            progress,
                            handle,
                            started: Instant::now(),
                        },
                    );
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(TICK) => {}
            _ = shutdown.changed() => {}
        }
    }
    for t in tasks.values() {
        let _ = t.stop.send(true);
    }
    let deadline = tokio::time::Instant::now() + STOP_GRACE;
    for t in tasks
        .into_values()
        .chain(stopping.into_iter().map(|(_, t, _)| t))
    {
        let mut handle = t.handle;
        if tokio::time::timeout_at(deadline, &mut handle)
            .await
            .is_err()
        {
            handle.abort();
        }
        t.progress.metrics.retire();
    }
    let _ = client
        .execute(
            "DELETE FROM outbox.relay_members WHERE relay_id = $1",
            &[&me],
        )
        .await;
    Ok(())
}
