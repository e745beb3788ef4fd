//! `outbox-embedded demo`: the embedded default. A throwaway PostgreSQL cluster (from the installed
//! server binaries), librdkafka's mock cluster as the broker, an order workload with
//! rollbacks, the real relay (a process of its own: `outbox-embedded demo-relay`), and live
//! progress. Midway the relay is SIGKILLed and started again at once: the point of the product
//! is that this loses nothing. At the end it checks what it can see: every committed event has
//! exactly one primary receipt and is on the topic, no rolled-back event was published, and
//! the copies the replay put on the topic are counted. `--keep` leaves it all running and
//! prints the commands that look at it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::unix::process::CommandExt;

use anyhow::Context;
use outbox_sink::KafkaSinkConfig;
use outbox_testkit::kafka::TestKafka;
use outbox_testkit::postgres::TestPostgres;
use outboxd::config::{RelayConfig, Secret};
use outboxd::relay::{self, Progress};
use rand::Rng;
use tokio::sync::watch;

use crate::cli::{DemoArgs, DemoRelayArgs};

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
    let mut client = outboxd::connect(&url).await?;
    let applied = outbox_ledger::migrate::run(&mut client)
        .await
        .context("migrate")?;
    println!(
        "schema outbox created ({} migrations, `outboxd migrate` does the same on your database)",
        applied.len()
    );
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
        http: Vec::new(),
        endpoint_schedules: Default::default(),
        max_in_flight: outboxd::config::DEFAULT_MAX_IN_FLIGHT,
        batch_size: 1000,
        batch_linger: Duration::from_millis(1),
        status_interval: Duration::from_millis(500),
        heartbeat_interval: Duration::from_secs(2),
        resnapshot: false,
        relay_id: outboxd::config::default_relay_id(),
        lease_ttl: Duration::from_secs(10),
        fleet_stop_grace: outboxd::config::FLEET_STOP_GRACE,
        unknown_settle: Duration::from_secs(5),
        unclear_budget: 30,
        unclear_max_waiting: outboxd::config::DEFAULT_UNCLEAR_MAX_WAITING,
        unclear_schedule: None,
        mode: outboxd::values::RunMode::Cdc,
        poll_interval: Duration::from_millis(100),
        shard: None,
        delivery: outboxd::values::Delivery::AtLeastOnce,
        positions_topic: outboxd::config::DEFAULT_POSITIONS_TOPIC.into(),
    }
}

/// The topic of the demo's order events.
const TOPIC: &str = "outbox.event.order";
const PARTITIONS: i32 = 3;

/// `outbox-embedded demo-relay`: the demo's relay with its console, until SIGTERM/SIGINT.
pub async fn relay_child(a: DemoRelayArgs) -> anyhow::Result<()> {
    let cfg = relay_config(&a.database_url, &a.bootstrap_servers, &a.slot);
    cfg.validate()?;
    let admin = outboxd::config::AdminConfig {
        http_addr: None,
        console_addr: Some(std::net::SocketAddr::from(([127, 0, 0, 1], a.console_port))),
        console_user: outboxd::config::DEFAULT_CONSOLE_USER.into(),
        console_password: None,
        console_max_connections: outboxd::config::DEFAULT_CONSOLE_MAX_CONNECTIONS,
        console_login_timeout: Duration::from_millis(
            outboxd::config::DEFAULT_CONSOLE_LOGIN_TIMEOUT_MS,
        ),
        console_idle_timeout: Duration::from_millis(
            outboxd::config::DEFAULT_CONSOLE_IDLE_TIMEOUT_MS,
        ),
        sample_interval: Duration::from_millis(outboxd::config::DEFAULT_SAMPLE_INTERVAL_MS),
    };
    let _admin = outboxd::admin::start(&admin, std::slice::from_ref(&cfg)).await?;
    let progress = Arc::new(Progress::new(&cfg));
    let (stop, rx) = watch::channel(false);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        let _ = stop.send(true);
    });
    relay::run(cfg, progress, rx).await?;
    Ok(())
}

/// The relay as a child process (this binary's `demo-relay`), its log in `log`.
struct RelayProcess {
    child: std::process::Child,
}

impl RelayProcess {
    fn spawn(
        url: &str,
        bootstrap: &str,
        console_port: u16,
        log: &std::path::Path,
    ) -> anyhow::Result<RelayProcess> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening the relay's log {}", log.display()))?;
        let child = std::process::Command::new(std::env::current_exe()?)
            .args([
                "demo-relay",
                "--database-url",
                url,
                "--bootstrap-servers",
                bootstrap,
                "--slot",
                "outboxd_demo",
                "--console-port",
                &console_port.to_string(),
            ])
            .stdout(out.try_clone()?)
            .stderr(out)
            // Its own process group: a Ctrl-C in the terminal reaches the demo, which stops
            // the relay after its checks, not the relay in the middle of them.
            .process_group(0)
            .spawn()
            .context("starting the demo's relay (outbox-embedded demo-relay)")?;
        Ok(RelayProcess { child })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits (SIGKILL after 15 s).
    fn stop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory is touched.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill9();
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.kill9();
        }
    }
}

/// What the ledger says now.
struct Ledger {
    published: i64,
    duplicates: i64,
    quarantined: i64,
    checkpoint: String,
}

async fn ledger(client: &tokio_postgres::Client) -> anyhow::Result<Ledger> {
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM outbox.receipts),
                    (SELECT count(*) FROM outbox.duplicate_receipts),
                    (SELECT count(*) FROM outbox.quarantine WHERE released_at IS NULL),
                    coalesce((SELECT confirmed_lsn::text FROM outbox.checkpoints
                              WHERE slot_name = 'outboxd_demo'), '-')",
            &[],
        )
        .await
        .context("reading the ledger")?;
    Ok(Ledger {
        published: row.get(0),
        duplicates: row.get(1),
        quarantined: row.get(2),
        checkpoint: row.get(3),
    })
}

/// A free port on 127.0.0.1 (the kernel's choice, released for the relay to bind).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
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
        .create_topic(TOPIC, PARTITIONS)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let bootstrap = kafka.bootstrap_servers().to_string();
    let console_port = free_port()?;
    let log = std::env::temp_dir().join(format!("outboxd-demo-{}.log", std::process::id()));
    println!("embedded broker: bootstrap.servers={bootstrap}");
    println!("relay log:       {}", log.display());

    let mut relay = RelayProcess::spawn(&url, &bootstrap, console_port, &log)?;

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

    let crash_at = args.crash_at_secs.unwrap_or(match args.duration_secs {
        Some(d) if d < 10 => d / 2,
        _ => 5,
    });
    let started = Instant::now();
    let mut last = (Instant::now(), 0i64);
    let until = args.duration_secs.map(|s| started + Duration::from_secs(s));
    let mut crash: Option<(u64, i64)> = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut interrupted = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => { interrupted = true; break }
        }
        let l = ledger(&client).await?;
        let c = committed.load(Ordering::Relaxed) as i64;
        let rate = (l.published - last.1) as f64 / last.0.elapsed().as_secs_f64();
        last = (Instant::now(), l.published);
        let secs = started.elapsed().as_secs();
        println!(
            "[{secs:>4}s] committed={c:<7} rolled_back={:<5} published={:<7} behind={:<5} events/s={rate:<6.0} duplicates={:<4} quarantined={} checkpoint={}",
            rolled_back.load(Ordering::Relaxed),
            l.published,
            (c - l.published).max(0),
            l.duplicates,
            l.quarantined,
            l.checkpoint,
        );
        if let Some(status) = relay.exited() {
            anyhow::bail!("the relay exited ({status}); its log: {}", log.display());
        }
        if crash.is_none() && crash_at > 0 && secs >= crash_at {
            let behind = (c - l.published).max(0);
            println!(
                "[{secs:>4}s] SIGKILL the relay (pid {}), {behind} committed events not yet accepted in its ledger; starting it again at once: it resumes from the last LSN it confirmed, and what it re-reads is recorded as duplicates",
                relay.pid()
            );
            relay.kill9();
            relay = RelayProcess::spawn(&url, &bootstrap, console_port, &log)?;
            crash = Some((secs, l.duplicates));
        }
        if until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
    }
    stop_writers.store(true, Ordering::Relaxed);
    for w in writers {
        let _ = w.await;
    }
    // Let the relay catch up with the last commits.
    let total = committed.load(Ordering::Relaxed) as i64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while ledger(&client).await?.published < total && Instant::now() < deadline {
        if relay.exited().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM outbox.events),
                    (SELECT count(*) FROM outbox.receipts),
                    (SELECT count(*) FROM outbox.events e WHERE NOT EXISTS
                        (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)),
                    (SELECT count(*) FROM outbox.duplicate_receipts)",
            &[],
        )
        .await?;
    let (events, receipts, unpublished, duplicates): (i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    println!(
        "done: {events} committed events, {receipts} primary receipts, {unpublished} unpublished; {} rolled back (never in the outbox)",
        rolled_back.load(Ordering::Relaxed)
    );
    // The topic, read back: every committed event is there; copies beyond the first came
    // from the replay after the SIGKILL.
    let ids: Vec<uuid::Uuid> = client
        .query("SELECT event_id FROM outbox.events", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let b = bootstrap.clone();
    let copies = tokio::task::spawn_blocking(move || {
        crate::bench::poll::copies_since(&b, TOPIC, &[0; PARTITIONS as usize])
    })
    .await?;
    let mut missing = 0;
    match copies {
        Ok(copies) => {
            missing = ids.iter().filter(|id| !copies.contains_key(id)).count();
            let extra: u32 = copies.values().map(|n| n - 1).sum();
            println!(
                "topic {TOPIC}: {} of {} committed events on it, {missing} missing; {extra} extra copies (a replay re-publishes what was sent but not yet accepted; consumers drop them by event id), {duplicates} recorded as duplicate receipts",
                ids.len() - missing,
                ids.len()
            );
        }
        Err(e) => println!(
            "topic {TOPIC}: not read back ({}); the ledger's count above stands",
            outboxd::one_line(&e)
        ),
    }
    if let Some((at, _)) = crash {
        println!(
            "the SIGKILL at {at}s lost nothing: {} unpublished, {missing} missing on the topic",
            unpublished
        );
    }
    if args.keep && !interrupted {
        println!();
        println!("kept running (Ctrl-C stops everything). Look at it:");
        println!("  psql '{url}' -c 'SELECT event_id, topic, partition, \"offset\", accepted_at FROM outbox.receipts ORDER BY accepted_at DESC LIMIT 5'");
        println!("  cargo run -p outboxd -- status --database-url '{url}'");
        if let Some(id) = ids.first() {
            println!("  cargo run -p outboxd -- status --database-url '{url}' --event {id}");
            println!("  psql -h 127.0.0.1 -p {console_port} -U outboxd -c \"SHOW RECEIPT '{id}'\"   # the relay's console");
        }
        println!("  psql -h 127.0.0.1 -p {console_port} -U outboxd -c 'SHOW STATUS'");
        println!("  kcat -b {bootstrap} -C -t {TOPIC} -f 'key=%k headers=%h value=%s\\n'");
        let _ = tokio::signal::ctrl_c().await;
    }
    relay.stop();
    drop(kafka);
    pg.stop();
    if unpublished != 0 || missing != 0 {
        anyhow::bail!(
            "{unpublished} committed events were not published, {missing} are not on the topic"
        );
    }
    Ok(())
}
