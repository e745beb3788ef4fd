//! `outbox-embedded demo`: the embedded default. A throwaway PostgreSQL cluster (from the installed
//! server binaries), librdkafka's mock cluster as the broker, an order workload with
//! rollbacks, the real relay, and live progress. At the end it checks the invariants it can
//! see: every committed event has exactly one primary receipt, no rolled-back event was
//! published.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use outbox_sink::KafkaSinkConfig;
use outbox_testkit::kafka::TestKafka;
use outbox_testkit::postgres::TestPostgres;
use outboxd::config::{RelayConfig, Secret};
use outboxd::relay::{self, Progress};
use rand::Rng;
use tokio::sync::watch;

use crate::cli::DemoArgs;

const WRITERS: u64 = 4;

/// A throwaway PostgreSQL cluster with a migrated database, and the embedded broker.
pub(crate) struct Embedded {
    pub pg: TestPostgres,
    pub url: String,
    pub kafka: TestKafka,
}

pub(crate) async fn embedded(db: &str) -> anyhow::Result<Embedded> {
    println!("starting a throwaway PostgreSQL cluster (wal_level=logical) ...");
    let pg = tokio::task::spawn_blocking(|| TestPostgres::start_throwaway(None))
        .await?
        .context("starting the throwaway PostgreSQL")?;
    let url = pg.create_database(db).await?;
    outboxd::migrate(&url).await?;
    let kafka = TestKafka::mock(1).map_err(|e| anyhow::anyhow!("embedded broker: {e}"))?;
    Ok(Embedded { pg, url, kafka })
}

/// The relay settings the embedded runs use.
pub(crate) fn relay_config(url: &str, bootstrap: &str, slot: &str) -> RelayConfig {
    RelayConfig {
        database: outboxd::config::database_name(url),
        database_url: Secret::new(url),
        slot: slot.into(),
        publication: outboxd::config::DEFAULT_PUBLICATION.into(),
        schema: "outbox".into(),
        table: "events".into(),
        sink: KafkaSinkConfig {
            bootstrap_servers: bootstrap.into(),
            ..KafkaSinkConfig::default()
        },
        nats: None,
        http: None,
        max_in_flight: 5_000,
        batch_size: 1000,
        batch_linger: Duration::from_millis(1),
        status_interval: Duration::from_millis(500),
        heartbeat_interval: Duration::from_secs(2),
        resnapshot: false,
        relay_id: outboxd::config::default_relay_id(),
        lease_ttl: Duration::from_secs(10),
        unknown_settle: Duration::from_secs(5),
        unclear_budget: 30,
        mode: outboxd::values::RunMode::Cdc,
        poll_interval: Duration::from_millis(100),
        shard: None,
    }
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let Embedded { pg, url, kafka } = embedded("outboxd_demo").await?;
    let client = outboxd::connect(&url).await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS public.orders (id text PRIMARY KEY, total numeric NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;

    kafka
        .create_topic("outbox.event.order", 3)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let bootstrap = kafka.bootstrap_servers().to_string();
    println!("embedded broker: bootstrap.servers={bootstrap}");
    println!("watch the topic:  kcat -b {bootstrap} -C -t outbox.event.order -f 'key=%k headers=%h value=%s\\n'");
    println!("database:         psql {url}   (try: SELECT * FROM outbox.receipts LIMIT 5)");

    let cfg = relay_config(&url, &bootstrap, "outboxd_demo");
    cfg.validate()?;
    let progress = Arc::new(Progress::new(&cfg));
    let (stop_relay, relay_rx) = watch::channel(false);
    let relay_task = tokio::spawn(relay::run(cfg, progress.clone(), relay_rx));

    let committed = Arc::new(AtomicU64::new(0));
    let rolled_back = Arc::new(AtomicU64::new(0));
    let stop_writers = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let client = outboxd::connect(&url).await?;
        let (committed, rolled_back, stop) =
            (committed.clone(), rolled_back.clone(), stop_writers.clone());
        let period = Duration::from_secs_f64(WRITERS as f64 / args.rate.max(1) as f64);
        let ratio = args.rollback_ratio.clamp(0.0, 1.0);
        writers.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            let mut i: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                i += 1;
                let order = format!("o-{w}-{}", i % 200);
                let rollback = rand::thread_rng().gen_bool(ratio);
                let sql = format!(
                    "BEGIN;
                     INSERT INTO public.orders (id, total) VALUES ('{order}-{i}', {total})
                         ON CONFLICT DO NOTHING;
                     SELECT outbox.enqueue('order', '{order}', 'order.created',
                         jsonb_build_object('order', '{order}', 'n', {i}, 'total', {total}));
                     {end};",
                    total = i % 97 + 3,
                    end = if rollback { "ROLLBACK" } else { "COMMIT" }
                );
                if client.batch_execute(&sql).await.is_ok() {
                    if rollback {
                        rolled_back.fetch_add(1, Ordering::Relaxed);
                    } else {
                        committed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }

    let started = Instant::now();
    let mut last = (Instant::now(), 0u64);
    let until = args.duration_secs.map(|s| started + Duration::from_secs(s));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => break,
        }
        let published = progress.published.load(Ordering::Relaxed);
        let c = committed.load(Ordering::Relaxed);
        let rate = (published - last.1) as f64 / last.0.elapsed().as_secs_f64();
        last = (Instant::now(), published);
        println!(
            "[{:>4}s] enqueued={c:<8} rolled_back={:<6} published={published:<8} lag={:<6} events/s={rate:<8.0} checkpoint={} duplicates={} quarantined={}",
            started.elapsed().as_secs(),
            rolled_back.load(Ordering::Relaxed),
            c.saturating_sub(published),
            outbox_core::Lsn(progress.checkpoint.load(Ordering::Relaxed)),
            progress.duplicates.load(Ordering::Relaxed),
            progress.quarantined.load(Ordering::Relaxed),
        );
        if relay_task.is_finished() {
            break;
        }
        if until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
    }
    stop_writers.store(true, Ordering::Relaxed);
    for w in writers {
        let _ = w.await;
    }
    // Let the relay catch up with the last commits, then stop it gracefully.
    let total = committed.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(30);
    while progress.published.load(Ordering::Relaxed) < total
        && Instant::now() < deadline
        && !relay_task.is_finished()
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_relay.send(true);
    match relay_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(anyhow::Error::from(e).context("relay")),
        Err(e) => anyhow::bail!("relay task: {e}"),
    }
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM outbox.events),
                    (SELECT count(*) FROM outbox.receipts),
                    (SELECT count(*) FROM outbox.events e WHERE NOT EXISTS
                        (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id))",
            &[],
        )
        .await?;
    let (events, receipts, unpublished): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    println!(
        "done: committed events={events} primary receipts={receipts} unpublished={unpublished} rolled back (never in the outbox)={}",
        rolled_back.load(Ordering::Relaxed)
    );
    drop(kafka);
    pg.stop();
    if unpublished != 0 {
        anyhow::bail!("{unpublished} committed events were not published");
    }
    Ok(())
}
