//! The producer's side: what `outbox.enqueue` costs a writer, against what a team's producer
//! pays without outboxd — a Debezium-style outbox row (uuid id, aggregate type, aggregate id,
//! type, jsonb payload) inserted in its own transaction.
//!
//! A third side is the writer's fast path: a plain INSERT of four columns into
//! `outbox.events`, whose version and route the relay gives (docs/versions_by_relay.md); a
//! fourth, `outbox.enqueue` in an outbox that takes such rows, where it writes the same row
//! (migration 0043). Those two run in a second database whose owner allowed plain INSERTs;
//! `outbox.enqueue` with versions and the Debezium-style INSERT in the first.
//!
//! All run under `pgbench` (from the server's own bin directory), with the same payload, the
//! same number of clients, one event per transaction, aggregate ids drawn from
//! `--producer-aggregates` (10,000 by default), in a database of their own with no replication
//! slot (the cost measured is the producer's, not the decoder's), each with pgbench's default
//! simple protocol and with prepared statements. They alternate (plain, enqueue, enqueue where
//! the relay numbers, fast path, simple then prepared, twice) so that a noisy neighbour hits
//! all; the figures are the means.
//! PostgreSQL CPU per event comes from the cluster's processes (`procstat::ClusterCpu`), and
//! includes the work of every backend the clients use.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};

use super::procstat::ClusterCpu;
use super::{workload, Ctx, Scenario};

/// A Debezium-style outbox table (Debezium's outbox documentation: `id`, `aggregatetype`,
/// `aggregateid`, `type`, `payload`): what the producer phase inserts into, and what the
/// Debezium phase (`debezium`) reads with Debezium's outbox EventRouter.
pub(crate) fn plain_outbox_ddl(table: &str) -> String {
    format!(
        "CREATE TABLE {table} (
             id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
             aggregatetype text  NOT NULL,
             aggregateid   text  NOT NULL,
             type          text  NOT NULL,
             payload       jsonb NOT NULL)"
    )
}

/// One side of the comparison.
#[derive(Debug, Clone, Default)]
pub(crate) struct ProducerSide {
    pub tps: f64,
    pub pg_cpu_us_per_event: f64,
}

/// The producer phase's result.
#[derive(Debug, Clone, Default)]
pub(crate) struct Producer {
    pub clients: u32,
    pub aggregates: u64,
    pub secs: f64,
    pub enqueue: ProducerSide,
    pub plain: ProducerSide,
    /// The writer's plain INSERT into `outbox.events` (no version, no route: the relay
    /// numbers and routes it; docs/versions_by_relay.md).
    pub fast_path: ProducerSide,
    /// `outbox.enqueue` where the outbox takes plain INSERTs: it writes the fast path's row,
    /// checked, and returns its id (migration 0043).
    pub enqueue_by_relay: ProducerSide,
    /// The same four with prepared statements (`pgbench -M prepared`: what JDBC, pgx and
    /// asyncpg send); the fields above use pgbench's default, the simple protocol, where an
    /// INSERT is planned every time.
    pub prepared: PreparedSides,
}

/// [`Producer`]'s sides with prepared statements.
#[derive(Debug, Clone, Default)]
pub(crate) struct PreparedSides {
    pub enqueue: ProducerSide,
    pub plain: ProducerSide,
    pub fast_path: ProducerSide,
    pub enqueue_by_relay: ProducerSide,
}

impl Producer {
    /// `outbox.enqueue` TPS / plain INSERT TPS (the target is at least 0.8).
    pub fn ratio(&self) -> f64 {
        self.enqueue.tps / self.plain.tps.max(f64::MIN_POSITIVE)
    }

    /// The writer's plain INSERT into `outbox.events` TPS / plain INSERT TPS.
    pub fn fast_path_ratio(&self) -> f64 {
        self.fast_path.tps / self.plain.tps.max(f64::MIN_POSITIVE)
    }

    /// `outbox.enqueue` where the relay numbers, TPS / plain INSERT TPS.
    pub fn by_relay_ratio(&self) -> f64 {
        self.enqueue_by_relay.tps / self.plain.tps.max(f64::MIN_POSITIVE)
    }
}

impl PreparedSides {
    pub fn ratio(&self) -> f64 {
        self.enqueue.tps / self.plain.tps.max(f64::MIN_POSITIVE)
    }

    pub fn fast_path_ratio(&self) -> f64 {
        self.fast_path.tps / self.plain.tps.max(f64::MIN_POSITIVE)
    }

    pub fn by_relay_ratio(&self) -> f64 {
        self.enqueue_by_relay.tps / self.plain.tps.max(f64::MIN_POSITIVE)
    }
}

/// Runs the producer phase with `sc`'s payload, over `--producer-aggregates` aggregates.
pub(crate) async fn run(ctx: &Ctx, sc: &Scenario) -> anyhow::Result<Producer> {
    let secs = ctx.args.producer_secs;
    let clients = ctx.args.producer_clients;
    let url = ctx.pg.create_database("bench_producer").await?;
    outboxd::migrate(&url).await?;
    let client = outboxd::connect(&url).await?;
    client
        .batch_execute(&plain_outbox_ddl("public.plain_outbox"))
        .await
        .context("creating the plain outbox table")?;
    let payload = format!(
        r#"{{"i": 0, "pad": "{}"}}"#,
        "x".repeat(workload::pad_len(sc.payload))
    );
    let aggregates = ctx.args.producer_aggregates.max(1);
    // One pgbench script per side: one event per transaction, of an aggregate drawn at random.
    let script = |name: &str, statement: &str| -> anyhow::Result<std::path::PathBuf> {
        let path = ctx.dir.path().join(format!("producer-{name}.sql"));
        std::fs::write(
            &path,
            format!("\\set aid random(1, {aggregates})\n{statement};\n"),
        )?;
        Ok(path)
    };
    let values = format!("'bench_producer', 'a-' || :aid, 'bench.tick', '{payload}'::jsonb");
    let enqueue = script("enqueue", &format!("SELECT outbox.enqueue({values})"))?;
    let plain = script(
        "plain",
        &format!(
            "INSERT INTO public.plain_outbox (aggregatetype, aggregateid, type, payload) VALUES ({values})"
        ),
    )?;
    // The writer's fast path: four columns into outbox.events, id and time by default, and
    // outbox.enqueue writing the same row. This database has no relay either; its outbox
    // allows rows without a version as an operator would.
    let by_relay_url = ctx.pg.create_database("bench_producer_by_relay").await?;
    outboxd::migrate(&by_relay_url).await?;
    outboxd::connect(&by_relay_url)
        .await?
        .batch_execute("SELECT outbox.allow_plain_inserts(true)")
        .await
        .context("allowing rows without a version in the producer's second database")?;
    let fast_path = script(
        "fast-path",
        &format!(
            "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload) VALUES ({values})"
        ),
    )?;
    let mut out = Producer {
        clients,
        aggregates,
        secs,
        ..Producer::default()
    };
    let rounds = 2.0;
    // The tables the runs write, per database (a database-wide VACUUM also analyses every
    // catalog: seconds over the phase's sixteen runs).
    let written = [
        (
            outboxd::connect(&url).await?,
            "public.plain_outbox, outbox.events, outbox.aggregate_versions",
        ),
        (outboxd::connect(&by_relay_url).await?, "outbox.events"),
    ];
    for round in 0..2 {
        let p = &mut out.prepared;
        let mut runs = [
            (&url, &plain, false, &mut out.plain),
            (&url, &enqueue, false, &mut out.enqueue),
            (&by_relay_url, &enqueue, false, &mut out.enqueue_by_relay),
            (&by_relay_url, &fast_path, false, &mut out.fast_path),
            (&url, &plain, true, &mut p.plain),
            (&url, &enqueue, true, &mut p.enqueue),
            (&by_relay_url, &enqueue, true, &mut p.enqueue_by_relay),
            (&by_relay_url, &fast_path, true, &mut p.fast_path),
        ];
        // The second round in the other order: no side always runs right after another.
        if round == 1 {
            runs.reverse();
        }
        for (db, script, prepared, side) in runs {
            // Each run starts with nothing left to vacuum and no autovacuum worker running:
            // the dead rows of the runs before (the version rows outbox.enqueue updates, the
            // tables' inserts) were vacuumed during whichever run came next, so the order of
            // the runs decided which side paid for them (2026-12-07: the outbox.events INSERT
            // at 0.68-0.76x of the plain INSERT here, 0.95x on an idle scratch cluster).
            for (c, tables) in &written {
                super::quiet(c, tables).await?;
            }
            let (tps, us) = pgbench(ctx, db, script, clients, secs, prepared).await?;
            side.tps += tps / rounds;
            side.pg_cpu_us_per_event += us / rounds;
        }
    }
    // The phase's tables took hundreds of thousands of rows each: left in place, their
    // autovacuum would run in whichever drain comes next and count as its CPU (2026-12-07: it
    // fell in the relay's drain, 0.6-1.4 us per drained event, and never in Debezium's).
    drop(written);
    for db in [&url, &by_relay_url] {
        super::drop_database(ctx, db).await?;
    }
    Ok(out)
}

/// One pgbench run of `script`: (transactions per second, PostgreSQL CPU µs per transaction).
async fn pgbench(
    ctx: &Ctx,
    url: &str,
    script: &Path,
    clients: u32,
    secs: f64,
    prepared: bool,
) -> anyhow::Result<(f64, f64)> {
    let exe = ctx.bindir.join("pgbench");
    if !exe.exists() {
        bail!(
            "the producer phase runs {} and it is not there: install the PostgreSQL server package that provides it (Debian: postgresql), or skip the phase with --producer-secs 0",
            exe.display()
        );
    }
    let mut cmd = Command::new(&exe);
    if prepared {
        cmd.args(["-M", "prepared"]);
    }
    cmd.args(["-n", "-c", &clients.to_string(), "-j"])
        .arg(clients.min(2).to_string())
        .args(["-T", &format!("{}", secs.ceil().max(1.0) as u64), "-f"])
        .arg(script)
        .arg(url);
    let mut cpu = ClusterCpu::start(ctx.postmaster);
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let waiting = tokio::task::spawn_blocking(move || child.wait_with_output());
    tokio::pin!(waiting);
    let output = loop {
        tokio::select! {
            done = &mut waiting => break done??,
            _ = tokio::time::sleep(Duration::from_millis(100)) => cpu.sample(),
        }
    };
    cpu.sample();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!(
            "pgbench -f {} failed ({}): {stderr}{stdout}",
            script.display(),
            output.status
        );
    }
    let tps = parse_tps(&stdout).with_context(|| {
        format!(
            "pgbench -f {} printed no tps line:\n{stdout}",
            script.display()
        )
    })?;
    let processed = parse_processed(&stdout).unwrap_or(0);
    if processed == 0 {
        bail!(
            "pgbench -f {} committed no transaction:\n{stdout}{stderr}",
            script.display()
        );
    }
    Ok((tps, cpu.secs() * 1e6 / processed as f64))
}

/// `tps = 1234.5 (without initial connection time)`.
fn parse_tps(out: &str) -> Option<f64> {
    out.lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l["tps = ".len()..].split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// `number of transactions actually processed: 1234`.
fn parse_processed(out: &str) -> Option<u64> {
    out.lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
        .and_then(|v| v.split(['/', ' ']).next())
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_pgbench_output() {
        let out = "transaction type: producer-plain.sql\n\
                   number of transactions actually processed: 452310\n\
                   number of failed transactions: 0 (0.000%)\n\
                   latency average = 0.088 ms\n\
                   tps = 45224.658823 (without initial connection time)\n";
        assert_eq!(parse_tps(out), Some(45224.658823));
        assert_eq!(parse_processed(out), Some(452310));
        assert_eq!(parse_tps("no such line"), None);
    }
}
