//! `outbox-embedded bench`: how fast the relay is, measured against PostgreSQL's own decoder and a
//! polling relay, in one run on one machine, on the embedded default (a throwaway PostgreSQL
//! cluster and librdkafka's mock broker in this process) or on real Apache Kafka (`--broker
//! apache`: a node the bench starts; `--bootstrap-servers`: one already running).
//!
//! Phases of the main scenario (every number is from the same run):
//! 1. **Backlog**: N events are enqueued with `outbox.enqueue` while the relay is stopped (its
//!    slot exists). A second slot, created just before, covers the same WAL range.
//! 2. **Decode limit**: `pg_recvlogical` (pgoutput, `proto_version=1`, to `/dev/null`) drains
//!    the second slot up to the backlog's end: the physical limit of logical decoding here.
//! 3. **Drain**: the relay runs as a child process (`outboxd run`, so its RSS and CPU are its
//!    own; [`outboxd_binary`] finds the binary) and is timed from spawn until the slot's
//!    `confirmed_flush_lsn` passes the backlog end — every event published, its receipt
//!    accepted, the LSN confirmed.
//! 4. **Steady**: concurrent writers commit at a constant rate; per event, commit (producer
//!    side, when COMMIT returned) to receipt accepted (`outbox.receipts.accepted_at`).
//! 5. **Crash**: the relay is SIGKILLed under load and restarted; the topic is read from where
//!    the phase began and copies are counted per event id: every committed event must be there,
//!    and every further copy (a second one, or one of an earlier phase's event) is the replay
//!    cost, in milliseconds of traffic.
//! 6. **Polling baseline** ([`poll`]): outboxd's own poll mode (`outboxd run --mode poll`)
//!    drains the same backlog and the same steady rate to the same broker.
//!
//! 7. **Debezium** ([`debezium`]): Debezium's embedded engine (pgoutput, outbox EventRouter)
//!    with a Kafka producer, in a JVM, drains the same backlog and the same steady rate from a
//!    Debezium-style outbox table to the same broker (a real Kafka only, by default).
//!
//! 0. **Producer** ([`producer`]): `outbox.enqueue` against a plain outbox INSERT under
//!    pgbench, same payload and clients, one event per transaction: TPS and PostgreSQL CPU per
//!    event for both.
//!
//! Variants (payload size, aggregate count) repeat phases 1-3 with fewer events. Output: a
//! table, a JSON file, an SVG chart, and a last line that scripts can parse. Nothing here
//! asserts anything about speed; CI runs a tiny configuration to prove the tool works.

mod debezium;
mod kill_loop;
pub(crate) mod poll;
mod procstat;
mod producer;
mod report;
mod statements;
mod warmup;
mod workload;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use outbox_testkit::apache_kafka::KafkaCluster;
use outbox_testkit::kafka::TestKafka;
use outbox_testkit::postgres::TestPostgres;
use tokio_postgres::Client;

use crate::cli::{BenchArgs, BenchBroker};
use procstat::ClusterCpu;
pub(crate) use report::Report;

/// Everything one bench run shares: the cluster, the broker, where logs go.
pub(crate) struct Ctx {
    pg: TestPostgres,
    kafka: TestKafka,
    /// The Apache Kafka node of `--broker apache` (stopped when dropped).
    _apache: Option<KafkaCluster>,
    bootstrap: String,
    bindir: PathBuf,
    /// The cluster's data directory (its WAL is read by `--pg-statements`).
    data: PathBuf,
    postmaster: i32,
    exe: PathBuf,
    dir: tempfile::TempDir,
    args: BenchArgs,
}

/// One workload shape.
#[derive(Debug, Clone)]
pub(crate) struct Scenario {
    pub name: String,
    pub payload: usize,
    pub aggregates: u64,
    pub events: u64,
}

/// A database prepared for one scenario: migrated, the relay's slot created (by a first relay
/// run, so the ledger knows it), a second slot for `pg_recvlogical`, a topic.
pub(crate) struct Db {
    pub url: String,
    pub client: Client,
    pub slot: String,
    pub recv_slot: String,
    pub agg_type: String,
    /// Its writers write plain INSERTs into `outbox.events` (`--writer plain`).
    pub plain_writers: bool,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let ctx = Ctx::start(args).await?;
    let result = run_all(&ctx).await;
    ctx.pg.stop();
    let report = result.map_err(with_db_detail)?;
    report.print_table();
    report.write_json(&ctx.args.json)?;
    if let Some(svg) = &ctx.args.svg {
        report.write_svg(svg)?;
    }
    println!("{}", report.last_line());
    Ok(())
}

async fn run_all(ctx: &Ctx) -> anyhow::Result<Report> {
    let a = &ctx.args;
    let main = Scenario {
        name: format!("p{}_a{}", a.payload, a.aggregates),
        payload: a.payload,
        aggregates: a.aggregates,
        events: a.events,
    };
    let mut report = Report::new(&main, a);
    // A JVM broker warmed before anything is measured on it (`warmup`); the embedded broker
    // is not a JVM.
    if a.broker.is_real(a.bootstrap_servers.is_some()) && a.broker_warmup_events > 0 {
        ctx.kafka
            .create_topic(warmup::TOPIC, a.partitions)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let (bootstrap, n, payload) = (ctx.bootstrap.clone(), a.broker_warmup_events, a.payload);
        let secs =
            tokio::task::spawn_blocking(move || warmup::run(&bootstrap, n, payload)).await??;
        eprintln!("bench: broker warm-up: {n} messages in {secs:.1} s");
        report.broker_warmup = Some((n, secs));
    }
    if a.producer_secs > 0.0 {
        let p = producer::run(ctx, &main).await?;
        eprintln!(
            "bench: producer: outbox.enqueue {:.0} TPS, plain INSERT {:.0} TPS ({:.2}x), outbox.enqueue where the relay numbers {:.0} TPS ({:.2}x), outbox.events INSERT {:.0} TPS ({:.2}x); prepared: {:.2}x, {:.2}x and {:.2}x",
            p.enqueue.tps,
            p.plain.tps,
            p.ratio(),
            p.enqueue_by_relay.tps,
            p.by_relay_ratio(),
            p.fast_path.tps,
            p.fast_path_ratio(),
            p.prepared.ratio(),
            p.prepared.by_relay_ratio(),
            p.prepared.fast_path_ratio()
        );
        report.producer = Some(p);
    }
    let dbz_skipped = debezium::should_run(a.debezium, a.broker, a.bootstrap_servers.is_some())?;
    if dbz_skipped.is_none() {
        // Before the long phases: a missing JDK or Maven fails the run now.
        tokio::task::spawn_blocking(debezium::build)
            .await?
            .context("building the Debezium relay (--debezium off skips the phase)")?;
    }
    eprintln!("bench: main scenario {main:?}");
    let db = ctx.prepare_with(&main, a.ledger_receipts).await?;
    // The fan-out slots must exist before the backlog is written to decode it.
    let fanout: Vec<usize> = a.fanout.iter().copied().filter(|n| *n > 0).collect();
    for n in &fanout {
        ctx.fanout_slots(&db, *n).await?;
    }

    let enqueue_s = workload::enqueue_backlog(&db, &main, a.txn_size).await?;
    let end = workload::backlog_end(&db.client).await?;
    report.enqueue_events_per_s = main.events as f64 / enqueue_s;
    report.wal_backlog_mib = wal_retained(&db.client, &db.slot).await? / MIB;
    eprintln!(
        "bench: backlog of {} events enqueued in {enqueue_s:.1} s",
        main.events
    );

    quiet(&db.client, "outbox.events").await?;
    let load = |phase: &str, r: &mut Report| r.load.push((phase.into(), procstat::loadavg()));
    load("decode", &mut report);
    report.decode = ctx.decode_limit(&db, end.clone(), main.events).await?;
    for n in &fanout {
        let p = ctx.fanout_one_db(&db, *n, &end, main.events).await?;
        eprintln!(
            "bench: {n} row-filtered slots on one database: {:.0} events/s",
            p.rate
        );
        report.fanout.push(("slots_on_one_database".into(), *n, p));
    }
    load("drain", &mut report);
    eprintln!("bench: pg_recvlogical {:.0} events/s", report.decode.rate);
    let wal_start = if a.pg_statements {
        statements::reset(&db.client).await?;
        Some(statements::wal_lsn(&db.client).await?)
    } else {
        None
    };
    let (mut relay, drain) = ctx.drain(&db, end, main.events).await?;
    report.drain = drain;
    if let Some(wal_start) = wal_start {
        let top = statements::top(&db.client, 20).await?;
        statements::print("drain", &top, main.events);
        report.drain_statements = statements::json(&top, main.events);
        let wal_end = statements::wal_lsn(&db.client).await?;
        statements::print_wal(&ctx.bindir, &ctx.data, &wal_start, &wal_end, main.events);
    }
    report.drain_series = workload::receipt_series(&db.client, report.drain.started_epoch).await?;
    eprintln!("bench: relay drain {:.0} events/s", report.drain.rate);

    // The drain's own ledger writes (receipts, aggregate heads, checkpoints) are WAL after the
    // backlog, in the same database: the walsender decodes all of it before anything newer.
    // Measured on its own, so the steady phase starts from a caught-up relay.
    let wal_mib = wal_retained(&db.client, &db.slot).await? / MIB;
    let t = Instant::now();
    let end = workload::backlog_end(&db.client).await?;
    wait_confirmed(
        &db.client,
        &db.slot,
        &end,
        t,
        a.timeout_secs,
        || relay.check_alive(),
        || "the relay did not catch up with the ledger's WAL after the drain".to_string(),
    )
    .await?;
    report.catchup = (wal_mib, t.elapsed().as_secs_f64());
    eprintln!(
        "bench: WAL retained at the drain's end: {wal_mib:.0} MiB; caught up with the ledger's own WAL in {:.1} s",
        report.catchup.1
    );

    load("steady", &mut report);
    report.steady = ctx.steady(&db, &main, &mut relay).await?;
    load("steady end", &mut report);
    eprintln!(
        "bench: steady {:.0} events/s, p99 {:.1} ms",
        report.steady.achieved_rate, report.steady.latency.p99
    );
    report.rss_peak_mib = relay.rss().map(|(_, hwm)| hwm as f64 / MIB).unwrap_or(0.0);
    if a.crash_secs > 0.0 {
        let (r, crash) = ctx.crash(&db, &main, relay).await?;
        relay = r;
        report.crash = Some(crash);
    }
    if a.kill_restarts > 0 {
        load("kill loop", &mut report);
        let (r, k) = ctx.kill_loop(&db, relay).await?;
        relay = r;
        eprintln!(
            "bench: kill loop: {} of {} restarted runs moved the checkpoint; {} extra copies of {} events",
            k.moved(),
            k.advanced.len(),
            k.republished,
            k.produced
        );
        report.kill_loop = Some(k);
    }
    relay.terminate()?;

    if !a.no_poll {
        load("polling", &mut report);
        let (drain, steady, series) = poll::baseline(ctx, &main).await?;
        eprintln!(
            "bench: polling drain {:.0} events/s, steady p99 {:.1} ms",
            drain.rate, steady.latency.p99
        );
        report.poll_drain = Some(drain);
        report.poll_steady = Some(steady);
        report.poll_series = series;
    }

    match dbz_skipped {
        Some(reason) => {
            eprintln!("bench: Debezium phase {reason}");
            report.debezium = Some(debezium::Outcome::NotRun(reason));
        }
        None => {
            load("debezium", &mut report);
            let r = debezium::run(ctx, &main).await?;
            eprintln!(
                "bench: Debezium drain {:.0} events/s (first event on the broker {:.1} s after the JVM's spawn), steady p99 {:.1} ms (commit -> on the broker)",
                r.drain.rate, r.startup_s, r.steady.latency.p99
            );
            report.debezium = Some(debezium::Outcome::Ran(Box::new(r)));
        }
    }

    for n in a.shard_drain.clone() {
        let p = ctx.sharded_drain(&main, n).await?;
        eprintln!("bench: {n} shard relays drained {:.0} events/s", p.rate);
        report.shard_drain.push((n, p));
    }
    for n in &fanout {
        let p = ctx.fanout_databases(&main, *n).await?;
        eprintln!(
            "bench: {n} databases, one slot each: {:.0} events/s",
            p.rate
        );
        report.fanout.push(("databases".into(), *n, p));
    }

    load("variants", &mut report);
    let variants: Vec<&(usize, u64)> = a.variants.iter().filter(|v| v.0 > 0).collect();
    for (i, v) in variants.iter().copied().enumerate() {
        let (payload, aggregates) = *v;
        let budget = (a.variant_mib * MIB) as u64 / payload.max(1) as u64;
        // A variant named again (`--variants 100x10,100x10`: the second on a broker warmed by
        // the first) gets its own database and slot.
        let again = variants[..i].iter().filter(|w| **w == v).count();
        let sc = Scenario {
            name: match again {
                0 => format!("p{payload}_a{aggregates}"),
                n => format!("p{payload}_a{aggregates}_{}", n + 1),
            },
            payload,
            aggregates,
            events: a.variant_events.min(budget.max(1000)),
        };
        eprintln!("bench: variant {sc:?}");
        let db = ctx.prepare(&sc).await?;
        workload::enqueue_backlog(&db, &sc, a.txn_size).await?;
        let end = workload::backlog_end(&db.client).await?;
        let decode = ctx.decode_limit(&db, end.clone(), sc.events).await?;
        let (relay, drain) = ctx.drain(&db, end, sc.events).await?;
        let rss = relay.rss().map(|(_, hwm)| hwm as f64 / MIB).unwrap_or(0.0);
        relay.terminate()?;
        report.variants.push(report::VariantResult {
            scenario: sc,
            decode,
            drain,
            rss_peak_mib: rss,
        });
    }
    Ok(report)
}

pub(crate) const MIB: f64 = 1024.0 * 1024.0;

/// The bench lets database errors through with `?`; say what PostgreSQL said.
fn with_db_detail(e: anyhow::Error) -> anyhow::Error {
    let detail = e
        .chain()
        .find_map(|c| c.downcast_ref::<tokio_postgres::Error>())
        .map(outbox_ledger::describe_db_error);
    match detail {
        Some(d) => e.context(format!("PostgreSQL: {d}")),
        None => e,
    }
}

/// A timed phase: rate, CPU of the relay and of PostgreSQL, per event.
#[derive(Debug, Clone, Default)]
pub(crate) struct Phase {
    pub events: u64,
    pub secs: f64,
    pub rate: f64,
    pub relay_cpu_s: f64,
    pub pg_cpu_s: f64,
    /// `pg_cpu_s` by what the processes are (walsender, client backends, autovacuum, …).
    pub pg_cpu_by_role: Vec<(&'static str, f64)>,
    /// CPU of this process: the embedded broker (librdkafka's mock cluster), the writers and
    /// the polling relay when they run, the sampling.
    pub bench_cpu_s: f64,
    /// Wall-clock start (seconds since the Unix epoch), to align ledger timestamps.
    pub started_epoch: f64,
    pub wal_retained_peak_mib: f64,
    /// The tables an autovacuum worker was seen working on during the phase (sampled with the
    /// CPU): the `autovacuum` share of `pg_cpu_by_role` is theirs. A backlog's own table
    /// vacuumed inside one side's drain and not the other's is the bench's timing, not that
    /// side's cost.
    pub autovacuumed: Vec<String>,
}

impl Phase {
    pub fn relay_us_per_event(&self) -> f64 {
        1e6 * self.relay_cpu_s / self.events.max(1) as f64
    }
    pub fn pg_us_per_event(&self) -> f64 {
        1e6 * self.pg_cpu_s / self.events.max(1) as f64
    }
    pub fn bench_us_per_event(&self) -> f64 {
        1e6 * self.bench_cpu_s / self.events.max(1) as f64
    }
    /// PostgreSQL's CPU per event by what the processes are, e.g. `walsender 5.3, client
    /// backends 4.1, autovacuum 1.0` (those under 0.05 us left out).
    pub fn pg_us_per_event_by_role(&self) -> String {
        self.pg_cpu_by_role
            .iter()
            .map(|(r, s)| (r, 1e6 * s / self.events.max(1) as f64))
            .filter(|(_, us)| *us >= 0.05)
            .map(|(r, us)| format!("{r} {us:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
    /// [`Phase::autovacuumed`] as a list, `none` when empty.
    pub fn autovacuumed_tables(&self) -> String {
        if self.autovacuumed.is_empty() {
            "none".into()
        } else {
            self.autovacuumed.join(", ")
        }
    }
}

/// What every timed phase measures from its start: PostgreSQL's CPU (sampled by the phase as it
/// goes: walsenders come and go), this process's CPU and the wall clock.
pub(crate) struct PhaseMeter {
    pub cpu: ClusterCpu,
    own0: f64,
    /// Wall-clock start (seconds since the Unix epoch).
    pub started_epoch: f64,
    pub started: Instant,
    autovacuumed: std::collections::BTreeSet<String>,
}

impl PhaseMeter {
    pub fn start(postmaster: i32) -> PhaseMeter {
        PhaseMeter {
            cpu: ClusterCpu::start(postmaster),
            own0: own_cpu(),
            started_epoch: epoch_now(),
            started: Instant::now(),
            autovacuumed: Default::default(),
        }
    }

    /// One sample of the cluster's CPU and of the tables autovacuum works on right now
    /// (`pg_stat_progress_vacuum`, every database's: a worker vacuuming another database's
    /// table costs this phase's CPU too).
    pub async fn sample(&mut self, client: &Client) -> anyhow::Result<()> {
        self.cpu.sample();
        let rows = client
            .query(
                "SELECT d.datname || ':' || coalesce(c.relnamespace::regnamespace::text || '.' || c.relname, p.relid::text)
                 FROM pg_stat_progress_vacuum p
                 JOIN pg_stat_activity a ON a.pid = p.pid AND a.backend_type = 'autovacuum worker'
                 JOIN pg_database d ON d.oid = p.datid
                 LEFT JOIN pg_class c ON c.oid = p.relid",
                &[],
            )
            .await
            .context("sampling autovacuum's tables")?;
        self.autovacuumed
            .extend(rows.iter().map(|r| r.get::<_, String>(0)));
        Ok(())
    }

    /// The phase: `events` in `secs`, `relay_cpu_s` of the relay (or its stand-in), PostgreSQL's
    /// CPU as sampled so far and this process's until now.
    pub fn phase(&self, events: u64, secs: f64, relay_cpu_s: f64) -> Phase {
        Phase {
            events,
            secs,
            rate: events as f64 / secs,
            relay_cpu_s,
            pg_cpu_s: self.cpu.secs(),
            pg_cpu_by_role: self.cpu.secs_by_role(),
            bench_cpu_s: own_cpu() - self.own0,
            started_epoch: self.started_epoch,
            wal_retained_peak_mib: 0.0,
            autovacuumed: self.autovacuumed.iter().cloned().collect(),
        }
    }
}

/// Latency percentiles, milliseconds.
#[derive(Debug, Clone, Default)]
pub(crate) struct Latency {
    pub count: usize,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    /// (latency ms, cumulative fraction) points for the chart.
    pub cdf: Vec<(f64, f64)>,
    /// (seconds since the phase started, worst latency ms of events committed in that 250 ms).
    pub worst_by_commit_time: Vec<(f64, f64)>,
}

impl Latency {
    pub fn from_samples(mut v: Vec<f64>) -> Latency {
        if v.is_empty() {
            return Latency::default();
        }
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        let n = v.len();
        let step = (n / 400).max(1);
        let mut cdf: Vec<(f64, f64)> = (0..n)
            .step_by(step)
            .map(|i| (v[i], (i + 1) as f64 / n as f64))
            .collect();
        cdf.push((v[n - 1], 1.0));
        Latency {
            count: n,
            p50: q(0.50),
            p99: q(0.99),
            p999: q(0.999),
            max: v[n - 1],
            cdf,
            worst_by_commit_time: Vec::new(),
        }
    }
}

/// A steady-rate phase.
#[derive(Debug, Clone, Default)]
pub(crate) struct Steady {
    pub target_rate: f64,
    pub achieved_rate: f64,
    pub phase: Phase,
    pub latency: Latency,
    pub rss_steady_mib: f64,
    /// WAL written but not yet sent by the relay's walsender (median, max MiB over 100 ms
    /// samples): how far PostgreSQL's decoding, not the relay, is behind.
    pub walsender_unsent_mib: (f64, f64),
    /// Seconds (0.5 s samples) during which an autovacuum worker ran, and checkpoints started:
    /// background work competing for the CPUs while latency was measured.
    pub autovacuum_s: f64,
    pub checkpoints: i64,
}

/// The SIGKILL phase.
#[derive(Debug, Clone, Default)]
pub(crate) struct Crash {
    pub rate: f64,
    pub produced: u64,
    pub republished: u64,
    pub republished_ms: f64,
    pub recovery_s: f64,
    /// From the SIGKILL to the restarted relay (another relay id) holding the lease, and to
    /// its first accepted receipt (`None`: the writers had finished and the killed relay had
    /// published everything before it died, so the restarted one had nothing to publish; on
    /// a loaded machine the kill can come that late).
    pub takeover_ms: f64,
    pub first_receipt_ms: Option<f64>,
}

/// The broker JVM of `--broker apache`, whose CPU counts with the bench's own.
static BROKER_PID: std::sync::OnceLock<i32> = std::sync::OnceLock::new();

/// CPU seconds used so far by this process (the bench, with the embedded broker) and by the
/// Apache Kafka node it started: the "bench+broker" column. An external broker's CPU is not
/// visible from here and is not counted.
pub(crate) fn own_cpu() -> f64 {
    let own = procstat::cpu_secs(std::process::id() as i32).unwrap_or(0.0);
    own + BROKER_PID
        .get()
        .and_then(|pid| procstat::cpu_secs(*pid))
        .unwrap_or(0.0)
}

fn epoch_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Drops a database a finished phase made (its URL), so nothing of it (autovacuum above all)
/// runs during a later phase.
pub(crate) async fn drop_database(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let cfg: tokio_postgres::Config = url.parse().context("parsing a phase's database URL")?;
    let name = cfg
        .get_dbname()
        .with_context(|| format!("no database name in {url}"))?;
    let admin = outboxd::connect(&ctx.pg.url("postgres")).await?;
    admin
        .batch_execute(&format!(
            "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
            name.replace('"', "\"\"")
        ))
        .await
        .with_context(|| format!("dropping the finished phase's database {name}"))?;
    Ok(())
}

/// Before a phase is measured (a drain, the relay's and Debezium's alike; each producer run):
/// `VACUUM (ANALYZE)` of `tables` (a comma-separated list), as autovacuum
/// does on a server whose backlog grew over time, then no autovacuum worker left running
/// anywhere in the cluster (waited for, at most a minute). A drain's PostgreSQL CPU is then
/// its decoding and its relay's own writes: without this, the insert-triggered vacuum of a
/// backlog written seconds before (or of the producer phase's tables) fell into whichever
/// drain it met (naptime is a minute), on one side and not the other.
pub(crate) async fn quiet(client: &Client, tables: &str) -> anyhow::Result<()> {
    client
        .batch_execute(&format!("VACUUM (ANALYZE) {tables}"))
        .await
        .with_context(|| format!("vacuuming {tables:?} before a measured phase"))?;
    let t = Instant::now();
    loop {
        let running: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'",
                &[],
            )
            .await
            .context("looking for autovacuum workers")?
            .get(0);
        if running == 0 {
            break;
        }
        if t.elapsed() > Duration::from_secs(60) {
            eprintln!("bench: an autovacuum worker still runs after 60 s; the phase starts anyway (its CPU counts as the phase's)");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if t.elapsed() > Duration::from_secs(1) {
        eprintln!(
            "bench: waited {:.1} s for autovacuum to finish before a measured phase",
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// `restart_lsn` of `slot` to the current WAL insert position, bytes.
async fn wal_retained(client: &Client, slot: &str) -> anyhow::Result<f64> {
    let row = client
        .query_one(
            "SELECT coalesce(pg_wal_lsn_diff(pg_current_wal_insert_lsn(), restart_lsn), 0)::float8
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .context("reading WAL retained by the slot")?;
    Ok(row.get(0))
}

/// Checkpoints the cluster has started so far.
async fn checkpoints(client: &Client) -> anyhow::Result<i64> {
    let row = client
        .query_one(
            "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter",
            &[],
        )
        .await
        .context("reading pg_stat_bgwriter")?;
    Ok(row.get(0))
}

/// WAL the walsender serving `slot` has not sent yet, bytes (0 when none serves it).
async fn walsender_unsent(client: &Client, slot: &str) -> anyhow::Result<f64> {
    let row = client
        .query_opt(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), r.sent_lsn)::float8
             FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await
        .context("reading the walsender's position")?;
    Ok(row.and_then(|r| r.get::<_, Option<f64>>(0)).unwrap_or(0.0))
}

/// Whether `slot` has confirmed `lsn` (text form).
/// Waits until `slot` has confirmed past `lsn`, checking every 50 ms that the process that
/// confirms is `alive`; fails with `late()` once `timeout_secs` have passed since `since`.
pub(crate) async fn wait_confirmed(
    client: &Client,
    slot: &str,
    lsn: &str,
    since: Instant,
    timeout_secs: u64,
    mut alive: impl FnMut() -> anyhow::Result<()>,
    late: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    while !confirmed_past(client, slot, lsn).await? {
        alive()?;
        if since.elapsed() > Duration::from_secs(timeout_secs) {
            bail!("{}", late());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn confirmed_past(client: &Client, slot: &str, lsn: &str) -> anyhow::Result<bool> {
    let row = client
        .query_one(
            "SELECT coalesce(confirmed_flush_lsn >= $2::text::pg_lsn, false)
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot, &lsn],
        )
        .await
        .context("reading the slot's confirmed position")?;
    Ok(row.get(0))
}

impl Ctx {
    async fn start(args: BenchArgs) -> anyhow::Result<Ctx> {
        // Before any server starts: a missing relay binary fails at once.
        let exe = outboxd_binary()?;
        eprintln!("bench: starting a throwaway PostgreSQL cluster (wal_level=logical) ...");
        let settings = if args.pg_statements {
            statements::SETTINGS
        } else {
            ""
        };
        let pg =
            tokio::task::spawn_blocking(move || TestPostgres::start_throwaway_configured(settings))
                .await?
                .context("starting the throwaway PostgreSQL")?;
        let bindir = outbox_testkit::postgres::find_bindir()?;
        let (kafka, apache) = match (&args.bootstrap_servers, args.broker) {
            (Some(b), _) => {
                eprintln!("bench: publishing to the Kafka at {b}");
                (TestKafka::external(b.clone()), None)
            }
            (None, BenchBroker::Embedded) => (
                TestKafka::mock(1).map_err(|e| anyhow::anyhow!("embedded broker: {e}"))?,
                None,
            ),
            (None, BenchBroker::Apache) => {
                eprintln!("bench: starting a single-node Apache Kafka (--broker apache) ...");
                let cluster = tokio::task::spawn_blocking(|| KafkaCluster::start(1))
                    .await?
                    .context("starting Apache Kafka for --broker apache")?;
                if let Some(pid) = cluster.node_ids().first().and_then(|id| cluster.pid(*id)) {
                    let _ = BROKER_PID.set(pid as i32);
                }
                (
                    TestKafka::external(cluster.bootstrap_servers()),
                    Some(cluster),
                )
            }
        };
        let bootstrap = kafka.bootstrap_servers().to_string();
        let admin = outboxd::connect(&pg.url("postgres")).await?;
        // The throwaway cluster runs with synchronous_commit=off (fast tests). Then a commit
        // reaches the walsender only when the WAL writer flushes (every wal_writer_delay,
        // 200 ms), which would dominate every latency measured here; PostgreSQL's default
        // flushes at commit. fsync stays off: the disk of this machine is not what we measure.
        for sql in [
            "ALTER SYSTEM SET synchronous_commit = on",
            "SELECT pg_reload_conf()",
        ] {
            admin
                .batch_execute(sql)
                .await
                .with_context(|| format!("setting synchronous_commit = on: {sql}"))?;
        }
        let data: String = admin.query_one("SHOW data_directory", &[]).await?.get(0);
        let data = PathBuf::from(data);
        let pid_file = data.join("postmaster.pid");
        let postmaster = std::fs::read_to_string(&pid_file)
            .with_context(|| format!("reading {}", pid_file.display()))?
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .with_context(|| format!("no pid in {}", pid_file.display()))?;
        let dir = tempfile::Builder::new()
            .prefix("outboxd-bench-")
            .tempdir()
            .context("creating a temporary directory for relay logs")?;
        Ok(Ctx {
            pg,
            kafka,
            _apache: apache,
            bootstrap,
            bindir,
            data,
            postmaster,
            exe,
            dir,
            args,
        })
    }

    async fn prepare(&self, sc: &Scenario) -> anyhow::Result<Db> {
        self.prepare_with(sc, 0).await
    }

    /// [`Self::prepare`] with a ledger that holds `receipts` receipts of earlier events
    /// (`--ledger-receipts`), written before the slots exist, so that no walsender decodes them.
    async fn prepare_with(&self, sc: &Scenario, receipts: u64) -> anyhow::Result<Db> {
        let mut db = self.prepare_layout(sc, None, receipts).await?;
        let recv_slot = format!("{}_recv", db.slot);
        db.client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&recv_slot],
            )
            .await
            .context("creating the pg_recvlogical slot")?;
        db.recv_slot = recv_slot;
        Ok(db)
    }

    /// The relays of `sc`'s database: one, or one per shard of `shards` (`--shard I/N`).
    fn spawn_layout(
        &self,
        url: &str,
        slot: &str,
        shards: Option<u16>,
    ) -> anyhow::Result<Vec<RelayChild>> {
        match shards {
            None => Ok(vec![RelayChild::spawn(self, url, slot)?]),
            Some(n) => (0..n)
                .map(|i| RelayChild::spawn_with(self, url, slot, &["--shard", &format!("{i}/{n}")]))
                .collect(),
        }
    }

    /// The slots of `slot`'s layout: itself, or one per shard.
    fn layout_slots(slot: &str, shards: Option<u16>) -> Vec<String> {
        match shards {
            None => vec![slot.to_string()],
            Some(n) => (0..n).map(|i| format!("{slot}_shard{i}of{n}")).collect(),
        }
    }

    /// A database for `sc`: migrated (laid out in `shards` shards if given), its topic, and its
    /// relays' slots created by a first run of them (with the ledger rows that make them
    /// theirs), so the backlog enqueued after they stop goes through the streams, not the
    /// initial snapshots. No `pg_recvlogical` slot.
    async fn prepare_layout(
        &self,
        sc: &Scenario,
        shards: Option<u16>,
        receipts: u64,
    ) -> anyhow::Result<Db> {
        let url = self
            .pg
            .create_database(&format!("bench_{}", sc.name))
            .await?;
        outboxd::migrate(&url).await?;
        if let Some(n) = shards {
            outboxd::shard_layout::run(&url, "outbox_pub", &n.to_string()).await?;
        }
        let client = outboxd::connect(&url).await?;
        if receipts > 0 {
            let s = workload::prefill_receipts(&client, receipts).await?;
            eprintln!("bench: the ledger holds {receipts} receipts of earlier events ({s:.1} s)");
        }
        let agg_type = format!("bench_{}", sc.name);
        self.kafka
            .create_topic(&format!("outbox.event.{agg_type}"), self.args.partitions)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let slot = format!("bench_{}", sc.name);
        let slots = Self::layout_slots(&slot, shards);
        let relays = self.spawn_layout(&url, &slot, shards)?;
        let t = Instant::now();
        loop {
            let ready: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_replication_slots s
                     JOIN outbox.checkpoints c ON c.slot_name = s.slot_name
                     WHERE s.slot_name = ANY($1) AND s.active AND c.snapshot_done",
                    &[&slots],
                )
                .await?
                .get(0);
            if ready == slots.len() as i64 {
                break;
            }
            for r in &relays {
                r.check_alive()?;
            }
            if t.elapsed() > Duration::from_secs(60) {
                let logs: Vec<String> =
                    relays.iter().map(|r| r.log.display().to_string()).collect();
                bail!(
                    "the relay did not start streaming within 60 s; see {}",
                    logs.join(", ")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for r in relays {
            r.terminate()?;
        }
        let plain_writers = self.args.writer == crate::cli::BenchWriter::Plain;
        if plain_writers {
            client
                .batch_execute("SELECT outbox.allow_plain_inserts(true)")
                .await
                .context("allowing rows without a version (--writer plain)")?;
        }
        Ok(Db {
            url,
            client,
            slot,
            recv_slot: String::new(),
            agg_type,
            plain_writers,
        })
    }

    /// `pg_recvlogical` over the second slot, up to `end`.
    async fn decode_limit(&self, db: &Db, end: String, events: u64) -> anyhow::Result<Phase> {
        self.recvlogical(
            &[(
                db.url.clone(),
                db.recv_slot.clone(),
                "outbox_pub".into(),
                end,
            )],
            events,
        )
        .await
    }

    /// `pg_recvlogical` (pgoutput, to /dev/null) over every `(url, slot, publication, end)` at
    /// once, timed until the last one reaches its end; `events` is what they deliver in all.
    async fn recvlogical(
        &self,
        streams: &[(String, String, String, String)],
        events: u64,
    ) -> anyhow::Result<Phase> {
        let mut m = PhaseMeter::start(self.postmaster);
        let mut children = Vec::new();
        for (url, slot, publication, end) in streams {
            let child = tokio::process::Command::new(self.bindir.join("pg_recvlogical"))
                .args(["-d", url, "--slot", slot, "--start", "--no-loop"])
                .args([
                    "-o",
                    "proto_version=1",
                    "-o",
                    &format!("publication_names={publication}"),
                ])
                .args(["-E", end, "-f", "/dev/null", "-s", "1"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .context("running pg_recvlogical")?;
            children.push(child);
        }
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        for child in &mut children {
            let status = loop {
                tokio::select! {
                    s = child.wait() => break s?,
                    _ = tick.tick() => m.cpu.sample(),
                }
            };
            if !status.success() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use tokio::io::AsyncReadExt;
                    let _ = e.read_to_string(&mut err).await;
                }
                bail!("pg_recvlogical failed ({status}): {err}");
            }
        }
        let secs = m.started.elapsed().as_secs_f64();
        m.cpu.sample();
        Ok(m.phase(events, secs, 0.0))
    }

    /// `n` slots on `db`, each with a publication of the aggregates whose id hashes to it
    /// (`abs(hashtext(aggregate_id)) % n`), as the shards of a sharded outbox would be.
    async fn fanout_slots(&self, db: &Db, n: usize) -> anyhow::Result<()> {
        for i in 0..n {
            // Two statements: a slot cannot be created in a transaction that wrote.
            db.client
                .batch_execute(&format!(
                    "CREATE PUBLICATION bench_fan{n}_{i} FOR TABLE outbox.events
                         WHERE (abs(hashtext(aggregate_id)) % {n} = {i}) WITH (publish = 'insert')"
                ))
                .await
                .with_context(|| format!("creating fan-out publication {i} of {n}"))?;
            db.client
                .execute(
                    "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                    &[&format!("{}_fan{n}_{i}", db.slot)],
                )
                .await
                .with_context(|| format!("creating fan-out slot {i} of {n}"))?;
        }
        Ok(())
    }

    /// The `n` fan-out slots of `db` decoded at once up to `end`.
    async fn fanout_one_db(
        &self,
        db: &Db,
        n: usize,
        end: &str,
        events: u64,
    ) -> anyhow::Result<Phase> {
        let streams: Vec<_> = (0..n)
            .map(|i| {
                (
                    db.url.clone(),
                    format!("{}_fan{n}_{i}", db.slot),
                    format!("bench_fan{n}_{i}"),
                    end.to_string(),
                )
            })
            .collect();
        self.recvlogical(&streams, events).await
    }

    /// `main`'s backlog in a database laid out in `n` shards, drained by `n` shard relays at
    /// once: timed from their spawn until every shard's slot confirmed past the backlog.
    async fn sharded_drain(&self, main: &Scenario, n: u16) -> anyhow::Result<Phase> {
        let sc = Scenario {
            name: format!("shards{n}"),
            ..main.clone()
        };
        let db = self.prepare_layout(&sc, Some(n), 0).await?;
        let slots = Self::layout_slots(&db.slot, Some(n));
        workload::enqueue_backlog(&db, &sc, self.args.txn_size).await?;
        let end = workload::backlog_end(&db.client).await?;
        let mut m = PhaseMeter::start(self.postmaster);
        let relays = self.spawn_layout(&db.url, &db.slot, Some(n))?;
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            m.cpu.sample();
            for r in &relays {
                r.check_alive()?;
            }
            let mut all = true;
            for s in &slots {
                all &= confirmed_past(&db.client, s, &end).await?;
            }
            if all {
                break;
            }
            if m.started.elapsed() > Duration::from_secs(self.args.timeout_secs) {
                bail!("the {n} shard relays did not drain the backlog within --timeout-secs");
            }
        }
        let secs = m.started.elapsed().as_secs_f64();
        let relay_cpu: f64 = relays.iter().map(|r| r.cpu_secs()).sum();
        for r in relays {
            r.terminate()?;
        }
        Ok(m.phase(sc.events, secs, relay_cpu))
    }

    /// `n` databases holding 1/n of `main`'s backlog each, their slots decoded at once.
    async fn fanout_databases(&self, main: &Scenario, n: usize) -> anyhow::Result<Phase> {
        let mut streams = Vec::new();
        let each = Scenario {
            name: String::new(),
            payload: main.payload,
            aggregates: (main.aggregates / n as u64).max(1),
            events: main.events / n as u64,
        };
        for i in 0..n {
            let sc = Scenario {
                name: format!("fan{n}_db{i}"),
                ..each.clone()
            };
            let db = self.prepare(&sc).await?;
            workload::enqueue_backlog(&db, &sc, self.args.txn_size).await?;
            let end = workload::backlog_end(&db.client).await?;
            streams.push((db.url, db.recv_slot, "outbox_pub".to_string(), end));
        }
        self.recvlogical(&streams, each.events * n as u64).await
    }

    /// Starts the relay on the backlog and times it until the slot confirmed `end`.
    async fn drain(
        &self,
        db: &Db,
        end: String,
        events: u64,
    ) -> anyhow::Result<(RelayChild, Phase)> {
        let mut m = PhaseMeter::start(self.postmaster);
        let relay = RelayChild::spawn(self, &db.url, &db.slot)?;
        let mut n = 0u64;
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            n += 1;
            if n % 2 == 0 {
                m.sample(&db.client).await?;
            }
            relay.check_alive()?;
            if confirmed_past(&db.client, &db.slot, &end).await? {
                break;
            }
            if m.started.elapsed() > Duration::from_secs(self.args.timeout_secs) {
                bail!(
                    "the relay did not drain {events} events within {} s; see {}",
                    self.args.timeout_secs,
                    relay.log.display()
                );
            }
        }
        let secs = m.started.elapsed().as_secs_f64();
        m.cpu.sample();
        let relay_cpu_s = relay.cpu_secs();
        // Confirmed past the backlog means every event was resolved; in a bench each must be
        // resolved by a receipt (no poison events), or the rate counts something else.
        let receipts: i64 = db
            .client
            // Not the receipts `--ledger-receipts` wrote before the backlog.
            .query_one(
                "SELECT count(*) FROM outbox.receipts WHERE broker_cluster <> $1",
                &[&workload::PREFILL],
            )
            .await
            .context("counting the drain's receipts")?
            .get(0);
        if receipts != events as i64 {
            bail!(
                "the relay confirmed past the backlog of {events} events with {receipts} receipts; see {}",
                relay.log.display()
            );
        }
        Ok((relay, m.phase(events, secs, relay_cpu_s)))
    }

    /// Constant-rate writers with the relay running; latency per event from the ledger.
    async fn steady(
        &self,
        db: &Db,
        sc: &Scenario,
        relay: &mut RelayChild,
    ) -> anyhow::Result<Steady> {
        let a = &self.args;
        let mut m = PhaseMeter::start(self.postmaster);
        let relay_cpu0 = relay.cpu_secs();
        let writers = workload::Writers::start(
            self,
            &db.url,
            workload::Target::of(db),
            sc,
            a.rate as f64,
            Duration::from_secs_f64(a.steady_secs),
        )
        .await?;
        let checkpoints0 = checkpoints(&db.client).await?;
        let mut autovacuum_samples = 0u64;
        let mut rss = Vec::new();
        let mut unsent = Vec::new();
        let mut wal_peak = 0.0f64;
        let mut i = 0u64;
        while !writers.finished() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            i += 1;
            m.cpu.sample();
            relay.check_alive()?;
            if let Some((r, _)) = relay.rss() {
                rss.push(r as f64 / MIB);
            }
            if i % 5 == 0 {
                wal_peak = wal_peak.max(wal_retained(&db.client, &db.slot).await?);
                let av: i64 = db
                    .client
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'",
                        &[],
                    )
                    .await?
                    .get(0);
                autovacuum_samples += u64::from(av > 0);
            }
            unsent.push(walsender_unsent(&db.client, &db.slot).await? / MIB);
        }
        let committed = writers.join().await?;
        let produced_secs = m.started.elapsed().as_secs_f64();
        let end = workload::backlog_end(&db.client).await?;
        let wait = Instant::now();
        wait_confirmed(
            &db.client,
            &db.slot,
            &end,
            wait,
            a.timeout_secs,
            || relay.check_alive(),
            || {
                format!(
                    "the relay did not catch up after the steady phase; see {}",
                    relay.log.display()
                )
            },
        )
        .await?;
        m.cpu.sample();
        let accepted = workload::accepted_times(
            &db.client,
            &committed,
            workload::Target::Outbox(String::new()),
        )
        .await?;
        workload::all_accepted(&db.client, &committed, &accepted, "steady phase").await?;
        let latency = workload::latencies(&committed, &accepted, m.started_epoch);
        rss.sort_by(f64::total_cmp);
        let n = committed.len() as u64;
        Ok(Steady {
            target_rate: a.rate as f64,
            achieved_rate: n as f64 / produced_secs,
            phase: Phase {
                wal_retained_peak_mib: wal_peak / MIB,
                ..m.phase(n, produced_secs, relay.cpu_secs() - relay_cpu0)
            },
            latency,
            rss_steady_mib: rss.get(rss.len() / 2).copied().unwrap_or(0.0),
            autovacuum_s: autovacuum_samples as f64 * 0.5,
            checkpoints: checkpoints(&db.client).await? - checkpoints0,
            walsender_unsent_mib: {
                unsent.sort_by(f64::total_cmp);
                (
                    unsent.get(unsent.len() / 2).copied().unwrap_or(0.0),
                    unsent.last().copied().unwrap_or(0.0),
                )
            },
        })
    }

    /// SIGKILL under load, immediate restart; what the broker got twice.
    async fn crash(
        &self,
        db: &Db,
        sc: &Scenario,
        relay: RelayChild,
    ) -> anyhow::Result<(RelayChild, Crash)> {
        let a = &self.args;
        let topic = format!("outbox.event.{}", db.agg_type);
        let before = poll::high_watermarks(&self.bootstrap, &topic, a.partitions)?;
        let writers = workload::Writers::start(
            self,
            &db.url,
            workload::Target::of(db),
            sc,
            a.rate as f64,
            Duration::from_secs_f64(a.crash_secs),
        )
        .await?;
        let writers_end = Instant::now() + Duration::from_secs_f64(a.crash_secs);
        tokio::time::sleep(Duration::from_secs_f64(a.crash_secs / 2.0)).await;
        relay.kill9()?;
        let killed = Instant::now();
        // Another relay id, as a restarted process on another host would have: the lease is
        // not ours by name, so this measures the takeover from a dead holder (migration 0018).
        let relay = RelayChild::spawn_with(
            self,
            &db.url,
            &db.slot,
            &["--relay-id", "outboxd-bench-restarted"],
        )?;
        let (takeover_ms, first_receipt_ms) = takeover(
            &db.client,
            &db.slot,
            "outboxd-bench-restarted",
            killed,
            a.timeout_secs,
            writers_end,
        )
        .await?;
        let Aftermath {
            produced,
            republished,
            recovery_s,
        } = self
            .aftermath(
                db,
                writers,
                &relay,
                killed,
                &topic,
                &before,
                "SIGKILL phase",
            )
            .await?;
        let rate = produced as f64 / a.crash_secs;
        Ok((
            relay,
            Crash {
                rate,
                produced,
                republished,
                republished_ms: 1000.0 * republished as f64 / rate.max(1.0),
                recovery_s,
                takeover_ms,
                first_receipt_ms,
            },
        ))
    }
}

/// What a phase that SIGKILLed the relay left on its topic, once the relay that runs now
/// caught up with everything the phase's writers committed.
pub(crate) struct Aftermath {
    /// Events the writers committed.
    pub produced: u64,
    /// Copies beyond the first of each of them, plus copies of earlier phases' events.
    pub republished: u64,
    /// From the last SIGKILL until the relay confirmed past the writers' last commit.
    pub recovery_s: f64,
}

impl Ctx {
    /// Joins the phase's writers, waits for `relay` to confirm past their last commit, and
    /// counts the copies on `topic` since `before` (its high watermarks when the phase began).
    /// A committed event missing from the topic fails the phase (`phase` names it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn aftermath(
        &self,
        db: &Db,
        writers: workload::Writers,
        relay: &RelayChild,
        killed: Instant,
        topic: &str,
        before: &[i64],
        phase: &str,
    ) -> anyhow::Result<Aftermath> {
        let committed = writers.join().await?;
        let end = workload::backlog_end(&db.client).await?;
        wait_confirmed(
            &db.client,
            &db.slot,
            &end,
            killed,
            self.args.timeout_secs,
            || relay.check_alive(),
            || {
                format!(
                    "{phase}: the relay that runs now did not catch up; see {}",
                    relay.log.display()
                )
            },
        )
        .await?;
        let recovery_s = killed.elapsed().as_secs_f64();
        // Copies per event id since the phase began: every committed event at least once;
        // a second copy of one, or any copy of an event of an earlier phase, is re-published.
        let copies = poll::copies_since(&self.bootstrap, topic, before)?;
        let ids: std::collections::HashSet<uuid::Uuid> =
            committed.iter().map(|(id, _)| *id).collect();
        let missing = ids.iter().filter(|id| !copies.contains_key(id)).count();
        if missing > 0 {
            bail!(
                "{phase}: {missing} of {} committed events are not on {topic} after the relay caught up",
                ids.len()
            );
        }
        let republished = copies
            .iter()
            .map(|(id, n)| u64::from(*n) - u64::from(ids.contains(id)))
            .sum();
        Ok(Aftermath {
            produced: committed.len() as u64,
            republished,
            recovery_s,
        })
    }
}

/// The `outboxd` binary the bench runs as its relay: `OUTBOXD_BIN`, else the `outboxd` beside
/// this executable (cargo builds both into the same target directory, e.g. `target/release`).
fn outboxd_binary() -> anyhow::Result<PathBuf> {
    let build = if cfg!(debug_assertions) {
        "cargo build -p outboxd"
    } else {
        "cargo build --release -p outboxd"
    };
    if let Some(p) = std::env::var_os("OUTBOXD_BIN") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!(
                "OUTBOXD_BIN={} is not a file: point it at an outboxd binary (`{build}` builds one)",
                p.display()
            );
        }
        return Ok(p);
    }
    let me = std::env::current_exe().context("locating the outbox-embedded binary")?;
    let sibling = me.with_file_name("outboxd");
    if !sibling.is_file() {
        bail!(
            "the bench runs the relay as `outboxd run`, and there is no {}: build it with `{build}`, or set OUTBOXD_BIN to an outboxd binary",
            sibling.display()
        );
    }
    Ok(sibling)
}

/// Milliseconds from `killed` until `owner` holds the lease of `slot`, and until its generation
/// has a receipt accepted — `None` if the writers (done at `writers_end`) left it nothing to
/// publish: every event already had its receipt.
async fn takeover(
    client: &tokio_postgres::Client,
    slot: &str,
    owner: &str,
    killed: Instant,
    timeout_secs: u64,
    writers_end: Instant,
) -> anyhow::Result<(f64, Option<f64>)> {
    let deadline = killed + Duration::from_secs(timeout_secs);
    let mut lease: Option<(i64, f64)> = None;
    loop {
        if Instant::now() > deadline {
            bail!("the restarted relay did not take the lease of {slot} and publish within {timeout_secs} s");
        }
        match lease {
            None => {
                let row = client
                    .query_opt(
                        "SELECT generation FROM outbox.relay_leases WHERE slot_name = $1 AND owner = $2",
                        &[&slot, &owner],
                    )
                    .await?;
                if let Some(r) = row {
                    lease = Some((r.get(0), killed.elapsed().as_secs_f64() * 1e3));
                }
            }
            Some((generation, taken_ms)) => {
                let n: i64 = client
                    .query_one(
                        "SELECT count(*) FROM (SELECT 1 FROM outbox.receipts
                                               WHERE relay_generation = $1 LIMIT 1) r",
                        &[&generation],
                    )
                    .await?
                    .get(0);
                if n > 0 {
                    return Ok((taken_ms, Some(killed.elapsed().as_secs_f64() * 1e3)));
                }
                if Instant::now() > writers_end + Duration::from_secs(1) {
                    let pending: i64 = client
                        .query_one(
                            "SELECT count(*) FROM outbox.events e
                             WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts r
                                               WHERE r.event_id = e.event_id)",
                            &[],
                        )
                        .await?
                        .get(0);
                    if pending == 0 {
                        return Ok((taken_ms, None));
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `outboxd run` as a child process, logging to a file.
pub(crate) struct RelayChild {
    child: Child,
    pub log: PathBuf,
}

impl RelayChild {
    fn spawn(ctx: &Ctx, url: &str, slot: &str) -> anyhow::Result<RelayChild> {
        Self::spawn_with(ctx, url, slot, &[])
    }

    /// [`RelayChild::spawn`] with more arguments (e.g. `--mode poll`).
    pub(crate) fn spawn_with(
        ctx: &Ctx,
        url: &str,
        slot: &str,
        extra: &[&str],
    ) -> anyhow::Result<RelayChild> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = ctx.args.log_dir.as_deref().unwrap_or(ctx.dir.path());
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = dir.join(format!("relay-{slot}-{n}.log"));
        let file = std::fs::File::create(&log).context("creating the relay log file")?;
        let mut cmd = Command::new(&ctx.exe);
        cmd.args([
            "run",
            "--database-url",
            url,
            "--bootstrap-servers",
            &ctx.bootstrap,
        ])
        .args(["--slot", slot])
        .args(if extra.contains(&"--relay-id") {
            &[][..]
        } else {
            &["--relay-id", "outboxd-bench"][..]
        })
        .args(&ctx.args.relay_args)
        .args(extra)
        .env(
            "OUTBOXD_LOG",
            std::env::var("OUTBOXD_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(file);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting `{} run`", ctx.exe.display()))?;
        Ok(RelayChild { child, log })
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn cpu_secs(&self) -> f64 {
        procstat::cpu_secs(self.pid()).unwrap_or(0.0)
    }

    pub fn rss(&self) -> Option<(u64, u64)> {
        procstat::rss(self.pid())
    }

    fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Fails with the log's tail if the relay exited.
    pub fn check_alive(&self) -> anyhow::Result<()> {
        // `/proc/<pid>/stat` of a zombie still exists; its state field is 'Z'.
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        let state = stat.rfind(')').and_then(|i| stat[i + 2..].chars().next());
        if matches!(state, None | Some('Z') | Some('X')) {
            bail!("the relay exited early:\n{}", self.log_tail());
        }
        Ok(())
    }

    /// SIGTERM and wait (the relay drains, confirms and releases its lease).
    pub fn terminate(mut self) -> anyhow::Result<()> {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            if let Some(status) = self.child.try_wait()? {
                if !status.success() {
                    bail!("the relay exited with {status}:\n{}", self.log_tail());
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        bail!(
            "the relay did not stop within 30 s of SIGTERM; see {}",
            self.log.display()
        )
    }

    pub fn kill9(mut self) -> anyhow::Result<()> {
        self.child.kill().context("SIGKILL of the relay")?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for RelayChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
