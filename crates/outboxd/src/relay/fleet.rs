//! `outboxd run --fleet`: one of several relay processes, on any hosts, that share the shards
//! of a sharded outbox (`outboxd migrate --shards N`) without a coordinator: PostgreSQL holds
//! the members (`outbox.relay_members`, migration 0019) and the shards' leases. What to take
//! and what to hand over is decided by `outbox_relay::fleet::plan` (pure); this loop reads the
//! members and leases and starts or stops the shard relays it says.
//!
//! Every quarter second a member writes its row and counts the live members; its fair share is
//! the shard count over them, rounded up. Under its share it starts a shard's relay (the same
//! `run` as `--shard I/N`) for free shards: a lease missing, expired, released, or held by a
//! relay that is no live member (SIGKILLed: its lease is taken at once; paused: at expiry). A
//! member is live while its row is fresh *and* its session advisory lock is held: a member
//! whose process died lost the lock when its connection closed, so its shards are taken at
//! once, not when its row ages out.
//! Over its share it stops one of its shards gracefully (drained, confirmed, lease released),
//! which another member then takes; a stop that has not ended after its grace
//! (`--fleet-stop-grace-ms`) is aborted and its lease given back. What to start, stop and
//! abort is `outbox_relay::fleet::Member`'s
//! (pure, also run by the simulator); this loop executes it. The leases alone decide who
//! sends: two members can never both hold a shard, whatever the members' view of each other.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use outbox_relay::fleet::{self, Effect, TICK};
use outbox_source::shard::Shard;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{connect_sql, Progress, RelayError};
use crate::config::RelayConfig;

/// A shard relay this member started (running, or told to stop).
struct Task {
    shard: u16,
    stop: watch::Sender<bool>,
    progress: Arc<Progress>,
    handle: JoinHandle<Result<(), RelayError>>,
}

/// Runs this member until `shutdown`; then stops its shards gracefully.
pub async fn run(base: RelayConfig, mut shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
    let url = base.database_url.expose().to_string();
    let client = connect_sql(&url).await?;
    let count = outbox_source::slot::shard_layout(&client, &base.publication).await?;
    let me = base.relay_id.clone();
    let base_slot = base.slot.clone();
    let base_pub = base.publication.clone();
    let mut locked = false;
    tracing::info!(relay_id = %me, shards = count, "fleet member: sharing {count} shards");
    let shard_slots: Vec<String> = Shard::all(count).map(|s| s.name(&base_slot)).collect();
    // What runs and what is stopping is the core's ([`fleet::Member`]); the tasks are here, by
    // the core's relay id.
    let mut member = fleet::Member::default();
    let mut tasks: BTreeMap<u64, Task> = BTreeMap::new();
    let born = Instant::now();
    loop {
        if *shutdown.borrow() {
            break;
        }
        outbox_ledger::lease::member_seen(&client, &me).await?;
        // The session lock that proves this member alive to the others (a previous process of
        // the same relay id may still hold it for a moment: asked again every tick).
        if !locked {
            locked =
                outbox_ledger::lease::try_lock(&client, &outbox_ledger::lease::member_lock(&me))
                    .await?;
        }
        let members = outbox_ledger::lease::live_members(&client, &me, base.lease_ttl).await?;
        // Each shard's lease: its holder, if live.
        let holders: BTreeMap<u16, String> = outbox_ledger::lease::holders(&client, &shard_slots)
            .await?
            .into_iter()
            .filter_map(|(slot, owner)| Some((Shard::from_name(&slot, &base_slot)?.index, owner)))
            .collect();
        // Finished relays (an error the relay does not retry, or a stop) leave.
        let done: Vec<u64> = tasks
            .iter()
            .filter(|(_, t)| t.handle.is_finished())
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            if let Some(t) = tasks.remove(&id) {
                match t.handle.await {
                    Ok(Err(e)) => tracing::warn!(shard = t.shard, error = %e, "shard relay ended"),
                    Err(e) => tracing::warn!(shard = t.shard, error = %e, "shard relay panicked"),
                    Ok(Ok(())) => {}
                }
                t.progress.metrics.retire();
                member.ended(id);
            }
        }
        let seen = fleet::Seen {
            count,
            me: &me,
            members: &members,
            holders: &holders,
            give_up: fleet::give_up(base.lease_ttl),
            stop_grace: base.fleet_stop_grace,
        };
        for effect in member.tick(born.elapsed(), &seen) {
            match effect {
                Effect::Abort { id, shard, release } => {
                    tracing::warn!(
                        shard,
                        "a stopped shard relay did not end in time; aborting it"
                    );
                    if let Some(t) = tasks.remove(&id) {
                        t.handle.abort();
                        t.progress.metrics.retire();
                    }
                    if release {
                        let slot = Shard {
                            index: shard,
                            count,
                        }
                        .name(&base_slot);
                        outbox_ledger::lease::release_aborted(&client, &slot, &me).await?;
                    }
                }
                Effect::Stop {
                    id,
                    shard,
                    handover,
                } => {
                    if handover {
                        tracing::info!(
                            shard,
                            members = members.len(),
                            "fleet: handing a shard over"
                        );
                    }
                    if let Some(t) = tasks.get(&id) {
                        let _ = t.stop.send(true);
                    }
                }
                Effect::Start { id, shard } => {
                    let shard = Shard {
                        index: shard,
                        count,
                    };
                    let mut cfg = base.clone();
                    cfg.shard = Some(shard);
                    cfg.slot = shard.name(&base_slot);
                    cfg.publication = shard.name(&base_pub);
                    let (stop, rx) = watch::channel(false);
                    tracing::info!(shard = %shard, members = members.len(), "fleet: taking a shard");
                    let progress = Arc::new(Progress::new(&cfg));
                    let handle = tokio::spawn(super::run(cfg, progress.clone(), rx));
                    tasks.insert(
                        id,
                        Task {
                            shard: shard.index,
                            stop,
                            progress,
                            handle,
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
    let deadline = tokio::time::Instant::now() + base.fleet_stop_grace;
    for t in tasks.into_values() {
        let mut handle = t.handle;
        if tokio::time::timeout_at(deadline, &mut handle)
            .await
            .is_err()
        {
            handle.abort();
        }
        t.progress.metrics.retire();
    }
    if let Err(e) = outbox_ledger::lease::member_left(&client, &me).await {
        tracing::warn!(error = %e, "leaving the fleet: the member's row stays until it ages out");
    }
    Ok(())
}
