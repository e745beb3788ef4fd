//! `outboxd bench`: drain rate of a backlog on the embedded default (throwaway PostgreSQL +
//! mock broker), for several aggregate counts. Prints figures; asserts nothing about speed.
//!
//! What it measures: N events are committed (in transactions of `--txn-size`) while the relay
//! is stopped; the relay is started and timed until every event has an accepted receipt. With
//! few aggregates the ordering rule (one in-flight event per aggregate) serialises sends, so
//! comparing 10 with 10,000 aggregates shows what the rule costs.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::cli::BenchArgs;
use crate::demo::{embedded, relay_config, Embedded};
use crate::relay::{self, Progress};

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let Embedded { pg, url: _, kafka } = embedded("outboxd_bench_setup").await?;
    let bootstrap = kafka.bootstrap_servers().to_string();
    let mut results = Vec::new();
    for &aggregates in &args.aggregates {
        let url = pg.create_database(&format!("bench_a{aggregates}")).await?;
        crate::migrate(&url).await?;
        let agg_type = format!("bench_a{aggregates}");
        kafka
            .create_topic(&format!("outbox.event.{agg_type}"), 3)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let slot = format!("bench_a{aggregates}");

        // First run: create the slot, then stop, so the backlog goes through the stream.
        run_until(&url, &bootstrap, &slot, 0).await?;

        let client = crate::connect(&url).await?;
        let txns = args.events.div_ceil(args.txn_size);
        let t = Instant::now();
        client
            .batch_execute(&format!(
                "DO $$ BEGIN
                   FOR t IN 0..{last} LOOP
                     PERFORM outbox.enqueue('{agg_type}', 'a' || ((t * {size} + i) % {aggregates}),
                                            'bench.tick', jsonb_build_object('i', t * {size} + i, 'pad', 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'))
                     FROM generate_series(1, {size}) i;
                     COMMIT;
                   END LOOP;
                 END $$;",
                last = txns - 1,
                size = args.txn_size,
            ))
            .await?;
        let enqueue_s = t.elapsed().as_secs_f64();
        let n = txns * args.txn_size;
        let drain = run_until(&url, &bootstrap, &slot, n).await?;
        let rate = n as f64 / drain.as_secs_f64();
        println!(
            "aggregates={aggregates:<7} events={n:<8} enqueue_s={enqueue_s:<7.2} drain_s={:<7.2} drain_events_per_s={rate:.0}",
            drain.as_secs_f64()
        );
        results.push((aggregates, rate));
    }
    if let (Some(first), Some(last)) = (results.first(), results.last()) {
        println!(
            "ordering_cost: {} aggregates drain at {:.0}% of the rate of {} aggregates",
            first.0,
            100.0 * first.1 / last.1,
            last.0
        );
    }
    pg.stop();
    Ok(())
}

/// Runs the relay until `events` receipts were accepted in this run (0: until it streams).
async fn run_until(
    url: &str,
    bootstrap: &str,
    slot: &str,
    events: u64,
) -> anyhow::Result<Duration> {
    let mut cfg = relay_config(url, bootstrap, slot);
    cfg.heartbeat_interval = Duration::from_secs(10);
    let progress = Arc::new(Progress::default());
    let (stop, rx) = watch::channel(false);
    let start = Instant::now();
    let task = tokio::spawn(relay::run(cfg, progress.clone(), rx));
    loop {
        let done = if events == 0 {
            progress.streaming.load(Ordering::Relaxed)
        } else {
            progress.published.load(Ordering::Relaxed) >= events
        };
        if done || task.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    let _ = stop.send(true);
    task.await??;
    Ok(elapsed)
}
