//! Command-line interface. Every flag of `run` can also come from an `OUTBOXD_*` variable
//! or the TOML config file; the flag wins, then the variable, then the file.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::parse_kv;

#[derive(Debug, Parser)]
#[command(
    name = "outboxd",
    version,
    about = "CDC relay for the transactional outbox: PostgreSQL logical replication -> Kafka, with a receipt ledger",
    long_about = "outboxd reads INSERTs into the outbox table (outbox.events) from a PostgreSQL logical \
replication slot (pgoutput), publishes each event to Kafka (idempotent producer, acks=all; key = aggregate id, \
header `id` = event id), records the broker's receipt in a ledger in the same database, and only then confirms \
the LSN to the slot. After a crash it resumes from the last confirmed LSN; re-read events are recognised by \
event id and recorded as duplicates, never published as new events.\n\n\
Quick start:\n  outboxd demo                                    # throwaway PostgreSQL + embedded broker\n  \
outboxd migrate --database-url postgres://...   # create schema `outbox`\n  \
outboxd run --database-url postgres://... --bootstrap-servers kafka:9092\n\n\
Producers call `SELECT outbox.enqueue('order', 'o-42', 'order.created', '{...}'::jsonb)` inside their \
business transaction."
)]
pub struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "OUTBOXD_LOG_FORMAT")]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade schema `outbox` (tables, outbox.enqueue(), publication). Idempotent.
    Migrate(MigrateArgs),
    /// Run the relay until SIGINT/SIGTERM.
    Run(Box<RunArgs>),
    /// Show events, receipts, quarantine and each slot's position and lag.
    Status(StatusArgs),
    /// Quarantined events and held aggregates: list them, release or skip one.
    #[command(subcommand)]
    Quarantine(QuarantineCommand),
    /// Move unpublished events to another destination: a new envelope generation, recorded
    /// with the proof that the old target did not accept them. Refused while the old target's
    /// outcome is UNKNOWN and for published events.
    MigrateDestination(MigrateDestinationArgs),
    /// Verify everything a relay needs (wal_level, slots and senders, REPLICATION, schema,
    /// privileges, publication, slot state, broker) and name each problem with its fix.
    /// Exits non-zero when anything would stop the relay.
    Check(CheckArgs),
    /// Run an embedded Kafka-protocol broker (librdkafka's mock cluster) for development.
    /// Prints `bootstrap.servers=HOST:PORT`, then serves until killed. Nothing is persisted.
    DevBroker(DevBrokerArgs),
    /// Benchmark on the embedded default (throwaway PostgreSQL + mock broker), in one run:
    /// pg_recvlogical's decode rate, the relay's backlog drain, commit -> accepted latency at a
    /// steady rate, relay RSS and CPU, PostgreSQL CPU per event, WAL retained, replay after a
    /// SIGKILL, and a polling (FOR UPDATE SKIP LOCKED) relay on the same workload. Prints a
    /// table and, last, `decode_ratio=.. drain_events_per_s=.. p99_ms=.. rss_mib=.. poll_ratio=..`;
    /// writes JSON (--json) and an SVG chart (--svg). See docs/benchmarks.md.
    Bench(BenchArgs),
    /// The embedded default: throwaway PostgreSQL + embedded broker + an order workload,
    /// with live progress. Needs PostgreSQL server binaries installed (initdb, pg_ctl).
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// PostgreSQL URL, e.g. postgres://user:pass@host:5432/app
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// PostgreSQL URL of the database holding the outbox.
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print one event's full history instead: state, attempts, primary receipt, duplicate
    /// receipts, quarantine records.
    #[arg(long)]
    pub event: Option<uuid::Uuid>,
}

#[derive(Debug, Subcommand)]
pub enum QuarantineCommand {
    /// Open quarantine records (with their reasons) and held aggregates (with their held events).
    List {
        #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[arg(long)]
        json: bool,
    },
    /// Publish the event after its cause was fixed (payload repaired, broker limit raised,
    /// relay for its destination running), then its aggregate's held events in version order.
    /// The running relay does the publishing within a second.
    Release {
        #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
        database_url: String,
        /// The quarantined (or gap-blocking) event id.
        #[arg(long)]
        event: uuid::Uuid,
        /// Who releases it (recorded in the ledger). [default: $USER]
        #[arg(long)]
        by: Option<String>,
    },
    /// Never publish the event; publish its aggregate's held events. Needs a reason, which is
    /// recorded in the ledger with the operator's name.
    Skip {
        #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[arg(long)]
        event: uuid::Uuid,
        /// Why the event may be dropped (recorded).
        #[arg(long)]
        reason: String,
        #[arg(long)]
        by: Option<String>,
    },
}

#[derive(Debug, Args)]
pub struct MigrateDestinationArgs {
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Event to migrate; repeat for a batch.
    #[arg(long, required = true)]
    pub event: Vec<uuid::Uuid>,
    /// The new topic.
    #[arg(long)]
    pub topic: String,
    /// The new broker cluster identity.
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// The new broker kind.
    #[arg(long, default_value = "kafka")]
    pub kind: String,
    /// Why (recorded in the migration receipt).
    #[arg(long)]
    pub reason: String,
    /// Bootstrap servers of the OLD cluster, to prove by scanning that it does not have the
    /// event when the ledger alone cannot prove it.
    #[arg(long)]
    pub old_bootstrap_servers: Option<String>,
    /// Who migrates (recorded). [default: $USER]
    #[arg(long)]
    pub by: Option<String>,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    #[arg(long, env = "OUTBOXD_BOOTSTRAP_SERVERS")]
    pub bootstrap_servers: Option<String>,
    #[arg(long, env = "OUTBOXD_SLOT")]
    pub slot: Option<String>,
    #[arg(long, env = "OUTBOXD_PUBLICATION")]
    pub publication: Option<String>,
    /// The relay's TOML config file (its keys are checked too).
    #[arg(long, env = "OUTBOXD_CONFIG")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct DevBrokerArgs {
    /// Number of mock brokers.
    #[arg(long, default_value_t = 1)]
    pub brokers: i32,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Backlog size of the main scenario (drain, decode limit, polling drain).
    #[arg(long, default_value_t = 1_000_000)]
    pub events: u64,
    /// Payload size of the main scenario, bytes (a JSON object padded to about this size).
    #[arg(long, default_value_t = 100)]
    pub payload: usize,
    /// Distinct aggregates of the main scenario. The relay keeps one event per aggregate in
    /// flight, so few aggregates bound throughput by the broker round trip.
    #[arg(long, default_value_t = 100_000)]
    pub aggregates: u64,
    /// Events per producing transaction of the backlog.
    #[arg(long, default_value_t = 100)]
    pub txn_size: u64,
    /// Steady phase: total events per second, over all writers.
    #[arg(long, default_value_t = 10_000)]
    pub rate: u64,
    /// Steady phase: duration, seconds.
    #[arg(long, default_value_t = 20.0)]
    pub steady_secs: f64,
    /// Steady phase: concurrent writers (one connection each).
    #[arg(long, default_value_t = 4)]
    pub writers: u64,
    /// Steady phase: events per business transaction (one autocommit statement).
    #[arg(long, default_value_t = 10)]
    pub events_per_txn: u64,
    /// Crash phase: seconds of steady writes with a SIGKILL of the relay halfway (0: skip).
    #[arg(long, default_value_t = 4.0)]
    pub crash_secs: f64,
    /// Skip the polling baseline.
    #[arg(long)]
    pub no_poll: bool,
    /// Polling baseline: backlog size (at most --events, the same backlog by default).
    #[arg(long, default_value_t = 1_000_000)]
    pub poll_events: u64,
    /// Polling baseline: rows claimed per batch.
    #[arg(long, default_value_t = 500)]
    pub poll_batch: i64,
    /// Polling baseline: sleep when a poll finds nothing, ms.
    #[arg(long, default_value_t = 100)]
    pub poll_interval_ms: u64,
    /// Variants, each PAYLOAD_BYTESxAGGREGATES (decode limit + drain only), comma-separated;
    /// `none` for no variants.
    #[arg(long, value_delimiter = ',', default_value = "1024x100000,16384x100000,100x10", value_parser = parse_variant)]
    pub variants: Vec<(usize, u64)>,
    /// Backlog size of each variant (capped by --variant-mib of payload).
    #[arg(long, default_value_t = 100_000)]
    pub variant_events: u64,
    /// Payload budget of one variant's backlog, MiB.
    #[arg(long, default_value_t = 256.0)]
    pub variant_mib: f64,
    /// Topic partitions on the embedded broker.
    #[arg(long, default_value_t = 3)]
    pub partitions: i32,
    /// Give up on a phase after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    /// Where to write the JSON results.
    #[arg(long, default_value = "bench-results.json")]
    pub json: PathBuf,
    /// Where to write the SVG chart (latency distribution, throughput over time).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Keep the relays' logs in this directory (default: a temporary one, removed at the end).
    /// `OUTBOXD_LOG` sets their filter (default `warn`).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Extra arguments for every `outboxd run` the bench starts (e.g. --batch-size=2000).
    #[arg(long = "relay-arg", allow_hyphen_values = true)]
    pub relay_args: Vec<String>,
}

fn parse_variant(s: &str) -> Result<(usize, u64), String> {
    if s == "none" || s.is_empty() {
        return Ok((0, 0));
    }
    let (p, a) = s.split_once('x').ok_or_else(|| {
        format!("variant `{s}`: expected PAYLOAD_BYTESxAGGREGATES, e.g. 1024x100000")
    })?;
    let p = p
        .parse()
        .map_err(|e| format!("variant `{s}`: payload: {e}"))?;
    let a = a
        .parse()
        .map_err(|e| format!("variant `{s}`: aggregates: {e}"))?;
    Ok((p, a))
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    pub duration_secs: Option<u64>,
    /// Target order events per second.
    #[arg(long, default_value_t = 500)]
    pub rate: u64,
    /// Share of business transactions that roll back (their events must never appear).
    #[arg(long, default_value_t = 0.1)]
    pub rollback_ratio: f64,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// PostgreSQL URL of the database holding the outbox. The role needs REPLICATION (or
    /// superuser), SELECT on the outbox table and write access to the outbox schema.
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Kafka bootstrap servers, e.g. kafka-1:9092,kafka-2:9092.
    #[arg(long, env = "OUTBOXD_BOOTSTRAP_SERVERS")]
    pub bootstrap_servers: Option<String>,
    /// Logical replication slot (created on first run). [default: outboxd]
    #[arg(long, env = "OUTBOXD_SLOT")]
    pub slot: Option<String>,
    /// Publication on the outbox table (created, inserts only, if missing). [default: outbox_pub]
    #[arg(long, env = "OUTBOXD_PUBLICATION")]
    pub publication: Option<String>,
    /// The outbox table. [default: outbox.events]
    #[arg(long, env = "OUTBOXD_TABLE")]
    pub table: Option<String>,
    /// TOML config file (see README "Configuration"). Unknown keys are errors.
    #[arg(long, env = "OUTBOXD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Broker cluster identity this relay serves; events frozen for another cluster are
    /// quarantined. [default: default]
    #[arg(long, env = "OUTBOXD_CLUSTER_NAME")]
    pub cluster_name: Option<String>,
    /// librdkafka property passed through, KEY=VALUE; repeatable (e.g. security.protocol=SSL).
    #[arg(long = "kafka-property", value_parser = parse_kv)]
    pub kafka_properties: Vec<(String, String)>,
    /// Kafka message.timeout.ms: how long librdkafka retries one message. [default: 30000]
    #[arg(long, env = "OUTBOXD_MESSAGE_TIMEOUT_MS")]
    pub message_timeout_ms: Option<u64>,
    /// Events in flight (sent, receipt not yet accepted) before reading pauses. Each costs
    /// about 2 KiB of memory (the event, its librdkafka copy, its receipt). [default: 5000]
    #[arg(long, env = "OUTBOXD_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<u64>,
    /// Receipts per ledger transaction when no acceptance transaction is running; while one
    /// runs, the next batch grows until it is done. [default: 1000]
    #[arg(long, env = "OUTBOXD_BATCH_SIZE")]
    pub batch_size: Option<usize>,
    /// Longest wait for a receipt batch to fill, ms, when no acceptance transaction is
    /// running (a running one already makes the next batch wait). [default: 1]
    #[arg(long, env = "OUTBOXD_BATCH_LINGER_MS")]
    pub batch_linger_ms: Option<u64>,
    /// Standby status update period, ms. [default: 1000]
    #[arg(long, env = "OUTBOXD_STATUS_INTERVAL_MS")]
    pub status_interval_ms: Option<u64>,
    /// Heartbeat (pg_logical_emit_message) period, ms, so an idle database releases WAL. [default: 10000]
    #[arg(long, env = "OUTBOXD_HEARTBEAT_INTERVAL_MS")]
    pub heartbeat_interval_ms: Option<u64>,
    /// How long the slot's lease lasts without renewal. A second `outboxd run` on the same slot
    /// waits as a hot standby and takes over this long after the active relay stops renewing.
    /// [default: 10000]
    #[arg(long, env = "OUTBOXD_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// How long after a send ended without proof (DISPATCH_UNKNOWN) the partition scan may
    /// conclude the broker does not have it and allow a retry. [default: 5000]
    #[arg(long, env = "OUTBOXD_UNKNOWN_SETTLE_MS")]
    pub unknown_settle_ms: Option<u64>,
    /// This relay's name in the lease table. [default: host-pid-random]
    #[arg(long, env = "OUTBOXD_RELAY_ID")]
    pub relay_id: Option<String>,
    /// Drop and recreate the slot, then publish every outbox row that has no receipt. The
    /// recovery for a slot that was lost, recreated or invalidated; duplicates it causes are
    /// recorded as duplicate receipts.
    #[arg(long)]
    pub resnapshot: bool,
}
