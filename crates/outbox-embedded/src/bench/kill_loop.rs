//! The kill loop: a burst over a few hot aggregates, the relay SIGKILLed every few seconds and
//! started again each time (issue 27). Each run must move the ledger's checkpoint before it is
//! killed, or a relay that keeps crashing (an OOM kill, a crash loop in a bad deploy) would
//! re-read the same WAL forever and the slot would retain it all. The phase reports, per
//! restart, whether that run moved the checkpoint, and how many extra copies the kills cost.
//! Nothing lost is a hard check (the phase fails); the rest are figures.

use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_postgres::Client;

use super::{poll, workload, Ctx, Db, RelayChild, Scenario};

/// What the kill loop measured.
#[derive(Debug, Clone)]
pub(crate) struct KillLoop {
    pub aggregates: u64,
    pub every_s: f64,
    /// Per restarted run: how far it moved the checkpoint (bytes of WAL; 0 = not at all).
    pub advanced: Vec<u64>,
    pub produced: u64,
    /// Copies beyond the first of each event (and copies of earlier phases' events).
    pub republished: u64,
    /// From the last kill until the relay confirmed past everything the writers committed.
    pub recovery_s: f64,
}

impl KillLoop {
    /// Restarted runs that moved the checkpoint.
    pub fn moved(&self) -> usize {
        self.advanced.iter().filter(|b| **b > 0).count()
    }
}

/// The ledger's checkpoint of `slot` (what a restart streams from), as a WAL byte position.
async fn checkpoint(client: &Client, slot: &str) -> anyhow::Result<u64> {
    let row = client
        .query_one(
            "SELECT (confirmed_lsn - '0/0'::pg_lsn)::bigint FROM outbox.checkpoints WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .with_context(|| format!("reading the checkpoint of slot {slot}"))?;
    Ok(row.get::<_, i64>(0).max(0) as u64)
}

impl Ctx {
    /// Runs the kill loop against the main scenario's database, whose relay is `relay`;
    /// returns the relay that runs after the last restart.
    pub(crate) async fn kill_loop(
        &self,
        db: &Db,
        relay: RelayChild,
    ) -> anyhow::Result<(RelayChild, KillLoop)> {
        let a = &self.args;
        let every = Duration::from_secs_f64(a.kill_every_secs);
        let restarts = a.kill_restarts;
        let sc = Scenario {
            name: "kill_loop".into(),
            payload: a.payload,
            aggregates: a.kill_aggregates.max(1),
            events: 0,
        };
        let topic = format!("outbox.event.{}", db.agg_type);
        let before = poll::high_watermarks(&self.bootstrap, &topic, a.partitions)?;
        // The burst lasts the whole loop: every run starts behind.
        let duration = every * (restarts + 1);
        let writers = workload::Writers::start(
            self,
            &db.url,
            workload::Target::of(db),
            &sc,
            a.rate as f64,
            duration,
        )
        .await?;
        tokio::time::sleep(every).await;
        let mut relay = relay;
        let mut last = checkpoint(&db.client, &db.slot).await?;
        let mut advanced = Vec::new();
        let mut killed = Instant::now();
        for i in 0..restarts {
            relay.kill9()?;
            killed = Instant::now();
            let id = format!("outboxd-bench-kill-{i}");
            relay = RelayChild::spawn_with(self, &db.url, &db.slot, &["--relay-id", &id])?;
            tokio::time::sleep(every).await;
            relay.check_alive()?;
            let now = checkpoint(&db.client, &db.slot).await?;
            advanced.push(now.saturating_sub(last));
            eprintln!(
                "bench: kill loop: run {} of {restarts} moved the checkpoint {} bytes",
                i + 1,
                now.saturating_sub(last)
            );
            last = now;
        }
        let after = self
            .aftermath(db, writers, &relay, killed, &topic, &before, "kill loop")
            .await?;
        Ok((
            relay,
            KillLoop {
                aggregates: sc.aggregates,
                every_s: a.kill_every_secs,
                advanced,
                produced: after.produced,
                republished: after.republished,
                recovery_s: after.recovery_s,
            },
        ))
    }
}
