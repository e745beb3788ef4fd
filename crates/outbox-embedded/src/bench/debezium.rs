//! The Debezium phase: what a team would run instead of outboxd, measured beside it on the same
//! workload, the same PostgreSQL and the same broker (docs/benchmarks.md, "Debezium beside it").
//!
//! Why this shape: the issue asks for outboxd to be ahead of Debezium side by side, and the fair
//! Debezium is the one its documentation describes for the transactional outbox: the PostgreSQL
//! connector with pgoutput and the outbox EventRouter SMT, producing with `acks=all` and
//! idempotence, moving the slot only after the broker has the events. Kafka Connect would add a
//! cluster and its own topics; the embedded engine with a Kafka producer is the same pipeline in
//! one process, like outboxd.
//!
//! How:
//! * `debezium/` beside this crate holds a `pom.xml` (Debezium [`DEBEZIUM_VERSION`] from Maven
//!   Central) and one Java main, `DebeziumRelay.java` (see its class comment). Both are compiled
//!   into this binary; [`build`] writes them to `~/.cache/outboxd/debezium-<hash>/` (the hash is
//!   of the two files), resolves the jars with `mvn dependency:copy-dependencies` and compiles
//!   the class with `javac`. A complete directory is reused; concurrent builds serialise on a
//!   lock file and publish by an atomic rename, as the Apache Kafka jar cache does.
//! * Its own database in the bench's cluster: the Debezium-style outbox table of the producer
//!   phase (`public.outbox`), a publication of it, and a pgoutput slot created *before* the
//!   backlog (with `snapshot.mode=no_data` Debezium streams from the slot, so the backlog is
//!   read from the WAL, as outboxd reads its own).
//! * Drain: the same number of events, payloads, keys and transactions as the relay's backlog,
//!   inserted with plain INSERTs; the JVM is timed from spawn until the slot's
//!   `confirmed_flush_lsn` passes the backlog's end, as the relay's drain is. Then the topic is
//!   read: every row of the table must be there (by the EventRouter's `id` header), or the bench
//!   fails.
//! * Steady: the same writers at the same rate into the table; latency per event is commit (when
//!   the writer's statement returned) to the broker's `LogAppendTime` (the topic is created with
//!   `message.timestamp.type=LogAppendTime`), read back from the topic: when the broker stored
//!   it. A committed event missing from the topic fails the bench.
//! * Resources: the JVM's CPU (`/proc/<pid>/stat`) and peak RSS (`VmHWM`), PostgreSQL's CPU as
//!   for the relay.
//!
//! A missing `java`, `javac` or (with a cold cache) `mvn` is an error naming the fix; the phase is
//! never skipped silently: when it does not run, the report says why. It needs a real Kafka:
//! Debezium's Java client cannot talk to librdkafka's mock cluster (the embedded default).

use std::collections::{HashMap, HashSet};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use outbox_testkit::apache_kafka::{spawn_jvm, tail};
use uuid::Uuid;

use super::procstat;
use super::workload::{self, Target};
use super::{
    confirmed_past, poll, producer, wait_confirmed, walsender_unsent, Ctx, Latency, Phase,
    PhaseMeter, Scenario, Steady, MIB,
};
use crate::cli::{BenchBroker, DebeziumMode};

/// Every Debezium artifact (`debezium-embedded`, `debezium-connector-postgres`); the pom says
/// the same (a unit test checks).
pub(crate) const DEBEZIUM_VERSION: &str = "3.6.1.Final";
const POM: &str = include_str!("../../debezium/pom.xml");
const JAVA_PATH: &str = "src/main/java/outboxd/bench/DebeziumRelay.java";
const JAVA: &str = include_str!("../../debezium/src/main/java/outboxd/bench/DebeziumRelay.java");
/// Pinned so that the plugin, too, comes from the local repository once resolved.
const DEPENDENCY_PLUGIN: &str = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1";
/// The Debezium-style outbox table, in a database of its own.
const TABLE: &str = "public.outbox";
/// The JVM's heap cap: the same as the Apache Kafka node the bench starts.
const JAVA_HEAP: &str = "-Xmx512m";

/// The Debezium phase's result, or why it did not run.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    Ran(Box<Results>),
    NotRun(String),
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Results {
    /// `relay_cpu_s` is the JVM's CPU.
    pub drain: Phase,
    /// Spawn to the first event's `LogAppendTime`: the JVM's start and Debezium's connection.
    pub startup_s: f64,
    /// Events that reached the topic more than once in the drain.
    pub drain_duplicates: u64,
    /// Latency is commit -> `LogAppendTime` ([`Self::latency_source`]).
    pub steady: Steady,
    /// What the latency's end is: the broker's append time, or (a broker that ignores
    /// `message.timestamp.type`) the producer's create time.
    pub latency_source: String,
    /// The JVM's `VmHWM` over drain and steady.
    pub rss_peak_mib: f64,
    /// The engine's and the producer's settings that differ from their defaults.
    pub settings: Vec<(String, String)>,
}

/// Why the embedded broker cannot serve the phase (tried with Debezium 3.6.1.Final's
/// kafka-clients 4.3.0 against librdkafka's mock cluster: the producer never got usable
/// metadata and re-bootstrapped until it was stopped).
const MOCK_REASON: &str =
    "needs a real Kafka (--broker apache or --bootstrap-servers): Debezium's \
     Java Kafka client (kafka-clients 4.3) gets no usable metadata from librdkafka's mock cluster";

/// `Ok(None)` when the phase runs with these arguments, `Ok(Some(why not))` when it reports
/// itself as not run, `Err` when `--debezium on` asks for what cannot run.
pub(crate) fn should_run(
    mode: DebeziumMode,
    broker: BenchBroker,
    external: bool,
) -> anyhow::Result<Option<String>> {
    let real = broker.is_real(external);
    match mode {
        DebeziumMode::Off => Ok(Some("not run: --debezium off".into())),
        DebeziumMode::Auto | DebeziumMode::On if real => Ok(None),
        DebeziumMode::Auto => Ok(Some(format!("not run: {MOCK_REASON}"))),
        DebeziumMode::On => bail!("--debezium on: the Debezium phase {MOCK_REASON}"),
    }
}

/// Drain of the scenario's backlog, then the steady rate, with Debezium.
pub(crate) async fn run(ctx: &Ctx, sc: &Scenario) -> anyhow::Result<Results> {
    let a = &ctx.args;
    let classpath = tokio::task::spawn_blocking(build)
        .await?
        .context("building the Debezium relay (--debezium off skips the phase)")?;

    let url = ctx
        .pg
        .create_database(&format!("bench_dbz_{}", sc.name))
        .await?;
    let client = outboxd::connect(&url).await?;
    let slot = format!("dbz_{}", sc.name);
    let publication = "dbz_outbox_pub";
    client
        .batch_execute(&format!(
            "{};
             CREATE PUBLICATION {publication} FOR TABLE {TABLE} WITH (publish = 'insert')",
            producer::plain_outbox_ddl(TABLE)
        ))
        .await
        .context("creating the Debezium outbox table and its publication")?;
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .context("creating Debezium's slot")?;
    let agg_type = format!("dbz_{}", sc.name);
    let topic = format!("outbox.event.{agg_type}");
    ctx.kafka
        .create_topic_with(
            &topic,
            a.partitions,
            &[("message.timestamp.type", "LogAppendTime")],
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    let enqueue_s = workload::insert_plain_backlog(&url, &agg_type, TABLE, sc, a.txn_size).await?;
    let end = workload::backlog_end(&client).await?;
    super::quiet(&client, TABLE).await?;
    eprintln!(
        "bench: Debezium: backlog of {} events inserted in {enqueue_s:.1} s",
        sc.events
    );

    let pg: tokio_postgres::Config = url.parse().context("parsing the database URL")?;
    let settings = settings(ctx, &pg, &slot, publication);
    let props = ctx
        .dir
        .path()
        .join(format!("debezium-{}.properties", sc.name));
    write_properties(&props, &settings, ctx.dir.path(), &sc.name)?;

    // Drain.
    let before = poll::high_watermarks(&ctx.bootstrap, &topic, a.partitions)?;
    let mut m = PhaseMeter::start(ctx.postmaster);
    let jvm = Jvm::spawn(ctx, &classpath, &props, &sc.name)?;
    let mut n = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        n += 1;
        if n % 2 == 0 {
            m.sample(&client).await?;
        }
        jvm.check_alive()?;
        if confirmed_past(&client, &slot, &end).await? {
            break;
        }
        if m.started.elapsed() > Duration::from_secs(a.timeout_secs) {
            bail!(
                "Debezium did not drain {} events within {} s; see {}",
                sc.events,
                a.timeout_secs,
                jvm.log.display()
            );
        }
    }
    let secs = m.started.elapsed().as_secs_f64();
    m.cpu.sample();
    let drain = m.phase(sc.events, secs, jvm.cpu_secs());
    // Confirmed past the backlog must mean every row is on the topic.
    let messages = poll::messages_since(&ctx.bootstrap, &topic, &before)?;
    let on_topic: HashSet<Uuid> = messages.iter().map(|m| m.id).collect();
    let rows: Vec<Uuid> = client
        .query(&format!("SELECT id FROM {TABLE}"), &[])
        .await
        .context("reading the backlog's ids")?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let missing = rows.iter().filter(|id| !on_topic.contains(id)).count();
    if missing > 0 || rows.len() as u64 != sc.events {
        bail!(
            "Debezium confirmed past the backlog of {} events ({} rows) and {missing} of them are not on {topic}; see {}",
            sc.events,
            rows.len(),
            jvm.log.display()
        );
    }
    let first_ms = messages.iter().map(|m| m.timestamp_ms).min().unwrap_or(0);
    let startup_s = (first_ms as f64 / 1000.0 - m.started_epoch).max(0.0);
    let drain_duplicates = (messages.len() - on_topic.len()) as u64;

    // Steady, with the same JVM.
    let before = poll::high_watermarks(&ctx.bootstrap, &topic, a.partitions)?;
    let mut m = PhaseMeter::start(ctx.postmaster);
    let jvm_cpu0 = jvm.cpu_secs();
    let writers = workload::Writers::start(
        ctx,
        &url,
        Target::Plain(agg_type.clone(), TABLE.into()),
        sc,
        a.rate as f64,
        Duration::from_secs_f64(a.steady_secs),
    )
    .await?;
    let mut rss = Vec::new();
    let mut unsent = Vec::new();
    while !writers.finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        m.cpu.sample();
        jvm.check_alive()?;
        if let Some((r, _)) = jvm.rss() {
            rss.push(r as f64 / MIB);
        }
        unsent.push(walsender_unsent(&client, &slot).await? / MIB);
    }
    let committed = writers.join().await?;
    let produced_secs = m.started.elapsed().as_secs_f64();
    let end = workload::backlog_end(&client).await?;
    let wait = Instant::now();
    wait_confirmed(
        &client,
        &slot,
        &end,
        wait,
        a.timeout_secs,
        || jvm.check_alive(),
        || {
            format!(
                "Debezium did not catch up after the steady phase; see {}",
                jvm.log.display()
            )
        },
    )
    .await?;
    m.cpu.sample();
    let jvm_cpu = jvm.cpu_secs() - jvm_cpu0;
    let rss_peak_mib = jvm.rss().map(|(_, hwm)| hwm as f64 / MIB).unwrap_or(0.0);
    let messages = poll::messages_since(&ctx.bootstrap, &topic, &before)?;
    let latency_source = if messages.iter().all(|m| m.log_append_time) {
        "commit -> LogAppendTime (the broker's append, millisecond resolution)".to_string()
    } else {
        "commit -> CreateTime (the broker ignored message.timestamp.type=LogAppendTime: the \
         producer's send, not the broker)"
            .to_string()
    };
    let mut on_broker: HashMap<Uuid, f64> = HashMap::with_capacity(messages.len());
    for m in &messages {
        let ts = m.timestamp_ms as f64 / 1000.0;
        on_broker
            .entry(m.id)
            .and_modify(|t| *t = f64::min(*t, ts))
            .or_insert(ts);
    }
    let unique: HashSet<Uuid> = committed.iter().map(|(id, _)| *id).collect();
    let missing = unique
        .iter()
        .filter(|id| !on_broker.contains_key(id))
        .count();
    if missing > 0 {
        bail!(
            "Debezium steady phase: {missing} of {} committed events are not on {topic} after Debezium confirmed past their commits; see {}",
            unique.len(),
            jvm.log.display()
        );
    }
    let latency: Latency = workload::latencies(&committed, &on_broker, m.started_epoch);
    let n = committed.len() as u64;
    rss.sort_by(f64::total_cmp);
    unsent.sort_by(f64::total_cmp);
    let steady = Steady {
        target_rate: a.rate as f64,
        achieved_rate: n as f64 / produced_secs,
        phase: m.phase(n, produced_secs, jvm_cpu),
        latency,
        rss_steady_mib: rss.get(rss.len() / 2).copied().unwrap_or(0.0),
        walsender_unsent_mib: (
            unsent.get(unsent.len() / 2).copied().unwrap_or(0.0),
            unsent.last().copied().unwrap_or(0.0),
        ),
        autovacuum_s: 0.0,
        checkpoints: 0,
    };
    jvm.terminate();
    // An inactive slot would hold WAL back through the phases after this one.
    drop_slot(&client, &slot).await;
    Ok(Results {
        drain,
        startup_s,
        drain_duplicates,
        steady,
        latency_source,
        rss_peak_mib,
        settings: settings
            .into_iter()
            .filter(|(k, _)| !k.contains("database.") && !k.contains("file.filename"))
            .collect(),
    })
}

/// The engine's (`engine.`) and the producer's (`producer.`) settings; see docs/benchmarks.md
/// for why each differs from its default.
fn settings(
    ctx: &Ctx,
    pg: &tokio_postgres::Config,
    slot: &str,
    publication: &str,
) -> Vec<(String, String)> {
    let host = match pg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".into(),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    let user = pg.get_user().unwrap_or("postgres").to_string();
    let password = pg
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let dbname = pg.get_dbname().unwrap_or("postgres").to_string();
    let e = |k: &str, v: &str| (format!("engine.{k}"), v.to_string());
    let p = |k: &str, v: &str| (format!("producer.{k}"), v.to_string());
    vec![
        e("name", "outboxd-bench-debezium"),
        e(
            "connector.class",
            "io.debezium.connector.postgresql.PostgresConnector",
        ),
        e("database.hostname", &host),
        e("database.port", &port.to_string()),
        e("database.user", &user),
        e("database.password", &password),
        e("database.dbname", &dbname),
        e("topic.prefix", "dbz"),
        e("plugin.name", "pgoutput"),
        e("slot.name", slot),
        e("publication.name", publication),
        e("publication.autocreate.mode", "disabled"),
        e("table.include.list", TABLE),
        e("snapshot.mode", "no_data"),
        e(
            "offset.storage",
            "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        ),
        e("offset.flush.interval.ms", "0"),
        e("poll.interval.ms", "1"),
        e("max.batch.size", "5000"),
        e("max.queue.size", "20000"),
        e("heartbeat.interval.ms", "100"),
        e("transforms", "outbox"),
        e(
            "transforms.outbox.type",
            "io.debezium.transforms.outbox.EventRouter",
        ),
        e("transforms.outbox.table.field.event.id", "id"),
        e("transforms.outbox.table.field.event.key", "aggregateid"),
        e("transforms.outbox.table.field.event.payload", "payload"),
        e("transforms.outbox.route.by.field", "aggregatetype"),
        e(
            "transforms.outbox.route.topic.replacement",
            "outbox.event.${routedByValue}",
        ),
        p("bootstrap.servers", &ctx.bootstrap),
        p("acks", "all"),
        p("enable.idempotence", "true"),
        p("linger.ms", "2"),
        ("bench.send-topic-prefix".into(), "outbox.event.".into()),
    ]
}

/// A Java properties file (`key=value`, `\`, `:`, `=` and leading spaces escaped).
fn write_properties(
    path: &Path,
    settings: &[(String, String)],
    dir: &Path,
    name: &str,
) -> anyhow::Result<()> {
    let esc = |s: &str| {
        s.chars()
            .flat_map(|c| match c {
                '\\' | ':' | '=' | '#' | '!' => vec!['\\', c],
                '\n' => vec!['\\', 'n'],
                _ => vec![c],
            })
            .collect::<String>()
    };
    let mut text = String::from("# Written by outbox-embedded bench (the Debezium phase).\n");
    for (k, v) in settings {
        text.push_str(&format!("{}={}\n", esc(k), esc(v)));
    }
    let offsets = dir.join(format!("debezium-{name}.offsets"));
    text.push_str(&format!(
        "engine.offset.storage.file.filename={}\n",
        esc(&offsets.to_string_lossy())
    ));
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Drops `slot` once its walsender has gone (the JVM just exited); a failure is only reported.
async fn drop_slot(client: &tokio_postgres::Client, slot: &str) {
    let t = Instant::now();
    loop {
        match client
            .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
        {
            Ok(_) => return,
            Err(e) if t.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => {
                eprintln!(
                    "bench: Debezium: could not drop the slot {slot} ({}); it holds WAL until the cluster is thrown away",
                    outbox_ledger::describe_db_error(&e)
                );
                return;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Building the Java main
// ---------------------------------------------------------------------------------------------

/// FNV-1a, 64 bits: a stable name for a build of these sources (std's hasher is not promised to
/// be stable across Rust versions).
fn fnv64(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The classpath of a complete build directory (`classes/` and the jars its `classpath` file
/// lists under `libs/`), `None` if anything is missing.
fn cached_classpath(dir: &Path) -> Option<String> {
    let list = std::fs::read_to_string(dir.join("classpath")).ok()?;
    let class = dir.join("classes/outboxd/bench/DebeziumRelay.class");
    if !class.is_file() {
        return None;
    }
    let mut parts = vec![dir.join("classes")];
    parts.extend(
        list.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| dir.join("libs").join(l.trim())),
    );
    if parts.len() < 2 || !parts[1..].iter().all(|j| j.is_file()) {
        return None;
    }
    Some(
        parts
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(":"),
    )
}

/// An exclusive `flock`, released when dropped.
struct FileLock {
    _file: std::fs::File,
}

impl FileLock {
    fn acquire(path: &Path) -> anyhow::Result<FileLock> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .with_context(|| format!("opening the lock file {}", path.display()))?;
        loop {
            // SAFETY: flock on a file descriptor that `f` owns and keeps open.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(FileLock { _file: f });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e).with_context(|| format!("locking {}", path.display()));
            }
        }
    }
}

/// `java -version` says 17 or later, and `javac` runs.
fn check_jdk() -> anyhow::Result<()> {
    let fix = "the Debezium phase needs a JDK 17+ (`java` and `javac`; Debian: apt-get install \
               openjdk-17-jdk-headless), or --debezium off";
    let out = Command::new("java")
        .arg("-version")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running `java -version`: {fix}"))?;
    let text = String::from_utf8_lossy(&out.stderr);
    let major = text
        .split('"')
        .nth(1)
        .and_then(|v| v.split(['.', '-', '+']).next())
        .and_then(|m| m.parse::<u32>().ok());
    if !matches!(major, Some(m) if m >= 17) {
        bail!(
            "`java -version` says {:?}: {fix}",
            text.lines().next().unwrap_or("")
        );
    }
    let out = Command::new("javac")
        .arg("-version")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running `javac -version`: {fix}"))?;
    if !out.status.success() {
        bail!("`javac -version` failed ({}): {fix}", out.status);
    }
    Ok(())
}

/// The Java main's classpath, building it into the cache first if needed. Blocking.
pub(crate) fn build() -> anyhow::Result<String> {
    check_jdk()?;
    let root = outbox_testkit::apache_kafka::cache_root();
    let name = format!("debezium-{:016x}", fnv64(&[POM, JAVA]));
    let dir = root.join(&name);
    if let Some(cp) = cached_classpath(&dir) {
        return Ok(cp);
    }
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let _lock = FileLock::acquire(&root.join(format!("{name}.lock")))?;
    if let Some(cp) = cached_classpath(&dir) {
        return Ok(cp);
    }
    eprintln!(
        "bench: building the Debezium {DEBEZIUM_VERSION} relay into {} (Maven resolves its jars once) ...",
        dir.display()
    );
    let partial = format!("{name}.partial-");
    if let Ok(entries) = std::fs::read_dir(&root) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&partial) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let staging = root.join(format!("{partial}{}", std::process::id()));
    let result = build_in(&staging);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    if dir.exists() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    std::fs::rename(&staging, &dir).with_context(|| format!("publishing {}", dir.display()))?;
    cached_classpath(&dir).with_context(|| format!("{} is incomplete", dir.display()))
}

fn build_in(staging: &Path) -> anyhow::Result<()> {
    let java_file = staging.join(JAVA_PATH);
    std::fs::create_dir_all(java_file.parent().unwrap_or(staging))
        .with_context(|| format!("creating {}", staging.display()))?;
    std::fs::write(staging.join("pom.xml"), POM).context("writing pom.xml")?;
    std::fs::write(&java_file, JAVA).context("writing DebeziumRelay.java")?;
    let libs = staging.join("libs");
    let described = format!(
        "mvn dependency:copy-dependencies (Debezium {DEBEZIUM_VERSION}) in {}",
        staging.display()
    );
    let out = Command::new("mvn")
        .current_dir(staging)
        .args(["-B", "-q", "-Dstyle.color=never", "-f", "pom.xml"])
        .arg(format!("{DEPENDENCY_PLUGIN}:copy-dependencies"))
        .arg(format!("-DoutputDirectory={}", libs.display()))
        .arg("-DincludeScope=runtime")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                anyhow::anyhow!(
                    "mvn is not on the PATH: the Debezium phase resolves Debezium's jars from Maven Central once with it (Debian: apt-get install maven), or --debezium off"
                )
            } else {
                anyhow::Error::new(e).context(format!("running {described}"))
            }
        })?;
    if !out.status.success() {
        bail!(
            "{described} failed ({}):\n{}{}\n(the first run needs Maven Central)",
            out.status,
            tail(&String::from_utf8_lossy(&out.stdout), 40),
            tail(&String::from_utf8_lossy(&out.stderr), 40)
        );
    }
    let mut jars: Vec<String> = std::fs::read_dir(&libs)
        .with_context(|| format!("listing {}", libs.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".jar"))
        .collect();
    jars.sort();
    if !jars.iter().any(|j| j.starts_with("debezium-embedded-")) {
        bail!("{described} succeeded but copied no debezium-embedded jar");
    }
    let out = Command::new("javac")
        .current_dir(staging)
        .args(["--release", "17", "-nowarn", "-d", "classes", "-cp"])
        .arg(format!("{}/*", libs.display()))
        .arg(JAVA_PATH)
        .stdin(Stdio::null())
        .output()
        .context("running javac")?;
    if !out.status.success() {
        bail!(
            "javac {JAVA_PATH} failed ({}):\n{}{}",
            out.status,
            tail(&String::from_utf8_lossy(&out.stdout), 40),
            tail(&String::from_utf8_lossy(&out.stderr), 40)
        );
    }
    std::fs::write(staging.join("classpath"), jars.join("\n") + "\n")
        .context("writing the classpath file")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The JVM
// ---------------------------------------------------------------------------------------------

/// The Debezium relay's JVM, logging (stdout and stderr) to a file.
struct Jvm {
    child: Child,
    log: PathBuf,
}

impl Jvm {
    fn spawn(ctx: &Ctx, classpath: &str, props: &Path, name: &str) -> anyhow::Result<Jvm> {
        let dir = ctx.args.log_dir.as_deref().unwrap_or(ctx.dir.path());
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = dir.join(format!("debezium-{name}.log"));
        let file = std::fs::File::create(&log).context("creating the Debezium log file")?;
        let mut cmd = Command::new("java");
        cmd.arg(JAVA_HEAP)
            .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
            .arg("-Dorg.slf4j.simpleLogger.showDateTime=true")
            .args(["-cp", classpath, "outboxd.bench.DebeziumRelay"])
            .arg(props)
            .stdin(Stdio::null())
            .stdout(file.try_clone().context("opening the Debezium log file")?)
            .stderr(file);
        let child = spawn_jvm(cmd).context("starting the Debezium relay (java)")?;
        Ok(Jvm { child, log })
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn cpu_secs(&self) -> f64 {
        procstat::cpu_secs(self.pid()).unwrap_or(0.0)
    }

    fn rss(&self) -> Option<(u64, u64)> {
        procstat::rss(self.pid())
    }

    fn check_alive(&self) -> anyhow::Result<()> {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        let state = stat.rfind(')').and_then(|i| stat[i + 2..].chars().next());
        if matches!(state, None | Some('Z') | Some('X')) {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            bail!(
                "the Debezium relay exited early; {} ends with:\n{}",
                self.log.display(),
                tail(&text, 30)
            );
        }
        Ok(())
    }

    /// SIGTERM (the engine stops and commits its offsets), SIGKILL after 30 s.
    fn terminate(mut self) {
        // SAFETY: kill(2) on our own unreaped child.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("bench: Debezium: the JVM did not stop within 30 s of SIGTERM; killed");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Jvm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pom_pins_the_documented_debezium_version() {
        assert!(
            POM.contains(&format!(
                "<debezium.version>{DEBEZIUM_VERSION}</debezium.version>"
            )),
            "debezium/pom.xml and DEBEZIUM_VERSION disagree"
        );
    }

    #[test]
    fn build_names_change_with_the_sources() {
        assert_eq!(fnv64(&["a", "b"]), fnv64(&["a", "b"]));
        assert_ne!(fnv64(&["a", "b"]), fnv64(&["ab", ""]));
        assert_ne!(fnv64(&[POM, JAVA]), fnv64(&[POM, ""]));
    }

    #[test]
    fn auto_runs_only_on_a_real_kafka() {
        let run = |m, b, e| should_run(m, b, e).map_err(|e| e.to_string());
        assert!(run(DebeziumMode::Auto, BenchBroker::Embedded, false)
            .is_ok_and(|r| r.is_some_and(|r| r.contains("--broker apache"))));
        assert!(run(DebeziumMode::Auto, BenchBroker::Apache, false).is_ok_and(|r| r.is_none()));
        assert!(run(DebeziumMode::Auto, BenchBroker::Embedded, true).is_ok_and(|r| r.is_none()));
        assert!(run(DebeziumMode::On, BenchBroker::Embedded, false)
            .is_err_and(|e| e.contains("--broker apache")));
        assert!(run(DebeziumMode::Off, BenchBroker::Apache, false).is_ok_and(|r| r.is_some()));
    }
}
