//! Command-line interface of `outbox-embedded`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use outboxd::values::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-embedded",
    version,
    about = "outboxd on throwaway servers: the demo, the benchmark and a development broker",
    long_about = "outbox-embedded runs the outboxd relay against servers it starts itself and throws \
away: a PostgreSQL cluster from the installed server binaries (initdb, pg_ctl), librdkafka's mock Kafka \
cluster, or a single-node Apache Kafka. The daemon (`outboxd`) links none of this.\n\n\
Quick start:\n  \
cargo run --release -p outbox-embedded -- demo\n  \
cargo build --release -p outboxd -p outbox-embedded && target/release/outbox-embedded bench"
)]
pub struct Cli {
    /// Log format of this tool's own lines and of the relay the demo runs: `text`, or `json`.
    #[arg(long, global = true, value_enum, env = "OUTBOXD_LOG_FORMAT", default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run an embedded Kafka-protocol broker (librdkafka's mock cluster) for development.
    /// Prints `bootstrap.servers=HOST:PORT`, then serves until killed. Nothing is persisted.
    DevBroker(DevBrokerArgs),
    /// Benchmark on the embedded default (throwaway PostgreSQL + mock broker), in one run:
    /// pg_recvlogical's decode rate, the relay's backlog drain, commit -> accepted latency at a
    /// steady rate, relay RSS and CPU, PostgreSQL CPU per event, WAL retained, replay after a
    /// SIGKILL, the polling baseline (outboxd run --mode poll) and, on a real Kafka, Debezium's
    /// embedded engine on the same workload. Prints a table and, last,
    /// `decode_ratio=.. drain_events_per_s=.. p99_ms=.. rss_mib=.. poll_ratio=.. producer_ratio=.. debezium_ratio=..`;
    /// writes JSON (--json) and an SVG chart (--svg). The relay runs as `outboxd run` child
    /// processes: the `outboxd` binary beside this one, or `OUTBOXD_BIN`. See docs/benchmarks.md.
    Bench(Box<BenchArgs>),
    /// The embedded default: throwaway PostgreSQL + embedded broker + an order workload,
    /// with live progress. Midway the relay is SIGKILLed and started again, and the end shows
    /// that nothing was lost (every committed event on the topic, the replay's copies recorded
    /// as duplicates). `--keep` leaves everything running and prints the commands to look at
    /// it. Needs PostgreSQL server binaries installed (initdb, pg_ctl).
    Demo(DemoArgs),
    /// The demo's relay, as a process of its own so the demo can SIGKILL it (internal).
    #[command(hide = true)]
    DemoRelay(DemoRelayArgs),
}

#[derive(Debug, Args)]
pub struct DemoRelayArgs {
    #[arg(long)]
    pub database_url: String,
    #[arg(long)]
    pub bootstrap_servers: String,
    #[arg(long)]
    pub slot: String,
    /// The admin console's port on 127.0.0.1.
    #[arg(long)]
    pub console_port: u16,
}

#[derive(Debug, Args)]
pub struct DevBrokerArgs {
    /// Number of mock brokers.
    #[arg(long, default_value_t = 1)]
    pub brokers: i32,
    /// A fixed bootstrap port on 127.0.0.1, for configs and scripts that cannot read the
    /// printed address. librdkafka's mock brokers listen on ports the kernel picks; this port
    /// forwards to the first of them, and clients learn the brokers' own addresses from its
    /// metadata, as with any Kafka bootstrap. [default: the mock's own, printed]
    #[arg(long)]
    pub port: Option<u16>,
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
    /// Steady phase: duration, seconds. A minute by default: the p99 of a 10-20 s phase moved
    /// by 10-25 ms from run to run on 2 CPUs, decided by how many of the relay's and the
    /// server's rare pauses it happened to hold (docs/benchmarks.md, "mimalloc shipped").
    #[arg(long, default_value_t = 60.0)]
    pub steady_secs: f64,
    /// Steady phase: concurrent writers (one connection each).
    #[arg(long, default_value_t = 4)]
    pub writers: u64,
    /// Steady phase: events per business transaction (one autocommit statement).
    #[arg(long, default_value_t = 10)]
    pub events_per_txn: u64,
    /// Crash phase: seconds of steady writes with a SIGKILL of the relay halfway (0: skip).
    /// The phase counts copies on the topic: on the embedded broker (which keeps 5 MiB per
    /// partition) keep `rate x crash-secs / partitions` under about 12,000.
    #[arg(long, default_value_t = 3.0)]
    pub crash_secs: f64,
    /// Kill loop: restarts. A burst over --kill-aggregates hot aggregates at --rate; the relay
    /// is SIGKILLed every --kill-every-secs and started again, this many times; each run must
    /// move the checkpoint (reported per run; a lost event fails the phase). 0 skips it.
    #[arg(long, default_value_t = 6)]
    pub kill_restarts: u32,
    /// Kill loop: seconds between two SIGKILLs (each run's life, its start included).
    #[arg(long, default_value_t = 2.0)]
    pub kill_every_secs: f64,
    /// Kill loop: aggregates the burst is spread over.
    #[arg(long, default_value_t = 50)]
    pub kill_aggregates: u64,
    /// Producer phase: seconds per pgbench run (`outbox.enqueue`, a plain INSERT into
    /// `outbox.events` and a plain outbox INSERT, each with the simple protocol and prepared,
    /// alternating, twice: twelve runs); 0 skips the phase.
    #[arg(long, default_value_t = 10.0)]
    pub producer_secs: f64,
    /// Producer phase: pgbench clients (one event per transaction each).
    #[arg(long, default_value_t = 4)]
    pub producer_clients: u32,
    /// Producer phase: aggregates the events are spread over (each transaction picks one).
    #[arg(long, default_value_t = 10_000)]
    pub producer_aggregates: u64,
    /// Skip the polling baseline (outboxd's poll mode).
    #[arg(long)]
    pub no_poll: bool,
    /// Where the drain's PostgreSQL time goes, by statement: the cluster loads
    /// `pg_stat_statements`, and after the main drain the bench prints the statements of the
    /// drained database by total execution time (calls, rows, us per drained event; in the JSON
    /// too). Execution time, not CPU: the walsender's decoding and autovacuum are not in it.
    /// The extension's hooks cost every statement a little, so compare figures of runs that
    /// both have it, or both not
    #[arg(long)]
    pub pg_statements: bool,
    /// Receipts the ledger already holds when the main drain starts (0: a fresh ledger, as a
    /// first deployment's). A production ledger holds every receipt of its retention window:
    /// this many entries of earlier, time-ordered event ids (as `outbox.uuid_v7()` gives) are
    /// written into the main scenario's database before its backlog, in batches of 1,000 of
    /// another slot, then vacuumed, analysed and checkpointed, so that the drain pays for the
    /// ledger's size (its key's depth, the pages it reads), not for their writing
    #[arg(long, default_value_t = 0)]
    pub ledger_receipts: u64,
    /// Polling baseline: backlog size (at most --events, the same backlog by default).
    #[arg(long, default_value_t = 1_000_000)]
    pub poll_events: u64,
    /// Polling baseline: `outboxd run --mode poll --poll-interval-ms`, the pause after a round
    /// that found nothing, ms.
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
    /// Slot fan-out, for each N of the list (e.g. `2,4`; docs/scaling.md): N slots on the main
    /// database, each with a publication of 1/N of the aggregates (a row filter on the hash of
    /// the aggregate id, as a sharded outbox would have), decoded at once by N pg_recvlogical;
    /// then N databases holding 1/N of the backlog each, one slot each. Every walsender decodes
    /// all of its database's WAL: this measures what that costs. Empty: skipped.
    #[arg(long, value_delimiter = ',')]
    pub fanout: Vec<usize>,
    /// Sharded drain, for each N of the list (e.g. `1,2,4`; docs/scaling.md): the main
    /// backlog in a database laid out in N shards (`outboxd migrate --shards N`), drained by N
    /// relays (`outboxd run --shard I/N`) at once, timed until every shard's slot confirmed
    /// past the backlog. Empty: skipped.
    #[arg(long, value_delimiter = ',')]
    pub shard_drain: Vec<u16>,
    /// Topic partitions (every topic the bench creates).
    #[arg(long, default_value_t = 3)]
    pub partitions: i32,
    /// The Kafka the bench publishes to. `embedded`: librdkafka's mock cluster inside the bench
    /// process (no JVM needed; not Kafka: no disk, no replication). `apache`: a single-node
    /// Apache Kafka 4.1.0 (KRaft) that the bench starts itself and stops at the end; its jars
    /// come from Maven Central once (`java` 17+ and `mvn` needed; cached in
    /// ~/.cache/outboxd). Ignored with --bootstrap-servers.
    #[arg(long, value_enum, default_value_t = BenchBroker::Embedded)]
    pub broker: BenchBroker,
    /// How outboxd's writers write an event (backlog, steady phase, kill loop). `enqueue`:
    /// `outbox.enqueue`, which gives the version and the route in the writer's transaction.
    /// `plain`: a plain INSERT of four columns into `outbox.events`, whose version and route
    /// the relay gives from the stream (docs/versions_by_relay.md); the bench's databases then
    /// allow rows without a version. The poll baseline always enqueues (poll mode cannot
    /// serve plain rows).
    #[arg(long, value_enum, default_value_t = BenchWriter::Enqueue)]
    pub writer: BenchWriter,
    /// Publish to this running Kafka instead (bootstrap servers, plaintext). The bench creates
    /// its topics there (`outbox.event.bench_*`, `outbox.event.poll_*`, replication factor 1)
    /// if missing; give it a broker you can throw away.
    #[arg(long, value_name = "HOST:PORT,...")]
    pub bootstrap_servers: Option<String>,
    /// Messages produced to a topic of their own before the first measured phase, on a JVM
    /// broker (--broker apache, --bootstrap-servers): keyed, with headers like the relay's,
    /// idempotent, acks=all. A fresh broker JIT-compiles its produce path during whatever
    /// runs first, and the relay's drain runs before Debezium's: measured on 2026-12-07, the
    /// same build drained 41,840 events/s on a fresh broker and 59,043-69,733 on a warm one
    /// (docs/benchmarks.md, "A warm broker for both"). Then one round per 100 of them (at
    /// most 2,000) of ten keyed messages, one per key in flight: the small requests of the
    /// ten-aggregate variant (docs/benchmarks.md, "A broker warm for small requests too").
    /// 0 skips it; the embedded broker skips it.
    #[arg(long, default_value_t = 500_000)]
    pub broker_warmup_events: u64,
    /// The Debezium phase (docs/benchmarks.md, "Debezium beside it"): Debezium 3.6.1.Final's
    /// embedded engine (pgoutput, outbox EventRouter) in a Java main the bench builds with Maven
    /// (`java` and `javac` 17+, `mvn`; cached in ~/.cache/outboxd), on the same backlog and
    /// steady rate, to the same broker. It needs a real Kafka: Debezium's Java client cannot
    /// talk to the embedded mock cluster. `auto`: run it on a real Kafka (--broker apache,
    /// --bootstrap-servers), report it as not run on the embedded broker; `on`: the same, but
    /// an embedded broker is an error; `off`: skip it (reported as not run).
    #[arg(long, value_enum, default_value_t = DebeziumMode::Auto)]
    pub debezium: DebeziumMode,
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

/// Which Kafka `outbox-embedded bench` publishes to (see `--broker`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchBroker {
    Embedded,
    Apache,
}

impl BenchBroker {
    /// Whether the bench publishes to a real (JVM) Kafka: this one is `Apache`, or
    /// `--bootstrap-servers` names one (`external`), which wins over `--broker`.
    pub fn is_real(self, external: bool) -> bool {
        external || self == BenchBroker::Apache
    }
}

/// How the bench's outboxd writers write (see `--writer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchWriter {
    Enqueue,
    Plain,
}

/// Whether `outbox-embedded bench` runs the Debezium phase (see `--debezium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DebeziumMode {
    Auto,
    On,
    Off,
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
    /// SIGKILL the relay this many seconds in, and start it again at once (0: never).
    /// [default: 5, or half of --duration-secs when that is shorter than 10]
    #[arg(long)]
    pub crash_at_secs: Option<u64>,
    /// After the run and its checks, keep PostgreSQL, the broker and the relay running and
    /// print the commands that look at them (psql, outboxd status, the console, kcat), until
    /// Ctrl-C.
    #[arg(long)]
    pub keep: bool,
}
