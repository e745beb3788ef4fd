//! Command-line interface. Every flag of `run` can also come from an `OUTBOXD_*` variable
//! or the TOML config file; the flag wins, then the variable, then the file.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::values::{parse_kv, LogFormat, SinkKind};

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
Quick start:\n  \
cargo run --release -p outbox-embedded -- demo  # try it: throwaway PostgreSQL + embedded broker\n  \
outboxd migrate --database-url postgres://...   # create schema `outbox`\n  \
outboxd run --database-url postgres://... --bootstrap-servers kafka:9092\n\n\
Producers call `SELECT outbox.enqueue('order', 'o-42', 'order.created', '{...}'::jsonb)` inside their \
business transaction."
)]
pub struct Cli {
    /// Log format: `text`, or `json` (one object per line; the relay's span fields slot, db and
    /// generation, and event ids and LSNs where a line has them, are JSON fields).
    /// [default: text, or log_format in the `run` config file]
    #[arg(long, global = true, value_enum, env = "OUTBOXD_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    #[command(subcommand)]
    pub command: Command,
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
    /// Where is every event? Compares outbox rows, receipts, consumer inboxes/watermarks and
    /// the broker's topics; reports aged PENDING, aged UNKNOWN, events no mandatory consumer
    /// applied, bypass publishes and id conflicts. Read-only.
    /// Exit status: 0 all is well, 2 something was found, 1 the check itself failed.
    Reconcile(ReconcileArgs),
    /// Retention: mark covered published events RETAINED, then delete events, receipts and
    /// inbox rows past the replay window in batches. Never deletes what a mandatory consumer
    /// has not covered, nor anything inside the window. Try --dry-run first.
    Purge(PurgeArgs),
    /// The consumer registry: which consumers retention waits for (mandatory) and which it
    /// does not (optional).
    #[command(subcommand)]
    Consumers(ConsumersCommand),
    /// Replacing a polling relay: who dispatches each aggregate type (or each hash bucket of a
    /// type's aggregates, `--buckets`) of an attached poller table (`migrate --poller-table`),
    /// and the switches between the poller and outboxd. See docs/migrating.md.
    #[command(subcommand)]
    Share(ShareCommand),
    /// Webhook endpoints (--sink http): what each endpoint refused, holds or leaves in doubt,
    /// and sending again what an endpoint already acknowledged (a partner that lost data),
    /// with the same id and a fresh signature.
    #[command(subcommand)]
    Webhooks(WebhooksCommand),
    /// Watch a polling relay before replacing it: read its topics, find each of its events by
    /// id, and report what it really does (published or not, duplicates, key and payload as
    /// committed, latency, events published by both relays). Changes nothing on the broker.
    /// Exit status: 0 all is well, 2 a lost, mismatched or doubly-owned event was found,
    /// 1 the check itself failed.
    Shadow(ShadowArgs),
}

/// Where the database is, for every command that connects: `--database-url` (or
/// `OUTBOXD_DATABASE_URL`), else `database_url` of the `--config` file (or `OUTBOXD_CONFIG`),
/// the same file `outboxd run` reads.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// PostgreSQL URL of the database holding the outbox, e.g.
    /// postgres://user:pass@host:5432/app. [default: database_url of --config]
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// TOML config file (see README "Configuration"); its `database_url` is used when
    /// --database-url is not given.
    #[arg(long, env = "OUTBOXD_CONFIG")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Debezium-compatible mode: capture inserts into this Debezium-style outbox table
    /// (`schema.table` with columns id uuid, aggregatetype, aggregateid, type, payload) as
    /// outbox events with event id = the row's id, published to outbox.event.<aggregatetype>
    /// with key aggregateid and header `id`. Producers and consumers stay as they are
    /// (insert-then-delete keeps working). Repeatable. Other column names: call
    /// outbox.install_debezium_capture(...) in SQL; see docs/debezium.md.
    #[arg(long, value_name = "SCHEMA.TABLE")]
    pub debezium_table: Vec<String>,
    /// Attach a polling relay's own outbox table (`schema.table`), to replace the poller
    /// without a flag day: outboxd captures each new row in the producer's transaction (event
    /// id = the row's id) and the row's owner, the poller or outboxd, is decided by its
    /// aggregate type (`outboxd share`). Rows already there stay the poller's. Needs
    /// --published-column or --unpublished-when. See docs/migrating.md.
    #[arg(long, value_name = "SCHEMA.TABLE")]
    pub poller_table: Option<String>,
    #[command(flatten)]
    pub poller: PollerTableArgs,
    /// Lay outbox.events out in N shards (a power of two, 1-256; needs PostgreSQL 15+): one
    /// publication per shard (`<publication>_shard<I>of<N>`, a row filter on the hash of the
    /// aggregate id), one `outboxd run --shard I/N` per shard. Changing N (4 -> 8) is refused
    /// while a relay of the old layout runs; stop them (SIGTERM), migrate, start the new ones:
    /// what the old ones did not publish, the new ones do, in order. See docs/scaling.md.
    #[arg(long, value_name = "N")]
    pub shards: Option<String>,
    /// The base publication name the shards' publications are named after.
    #[arg(long, default_value = "outbox_pub", requires = "shards")]
    pub publication: String,
}

/// How to read an attached poller table (`migrate --poller-table`). The column defaults are
/// Debezium's outbox names.
#[derive(Debug, Args)]
pub struct PollerTableArgs {
    /// The column the poller sets when it has published a row; the row is unpublished while
    /// it is NULL.
    #[arg(long, requires = "poller_table")]
    pub published_column: Option<String>,
    /// Or: a boolean SQL expression over the table's columns, true while the poller has not
    /// published the row (e.g. "status = 'NEW'").
    #[arg(long, requires = "poller_table", conflicts_with = "published_column")]
    pub unpublished_when: Option<String>,
    /// The event id column (uuid, or text holding a uuid).
    #[arg(long, default_value = "id", requires = "poller_table")]
    pub id_column: String,
    #[arg(long, default_value = "aggregatetype", requires = "poller_table")]
    pub aggregatetype_column: String,
    #[arg(long, default_value = "aggregateid", requires = "poller_table")]
    pub aggregateid_column: String,
    /// The event type column.
    #[arg(long, default_value = "type", requires = "poller_table")]
    pub type_column: String,
    /// The payload column (jsonb, json, or text holding JSON).
    #[arg(long, default_value = "payload", requires = "poller_table")]
    pub payload_column: String,
    /// What marks a row published, as an SQL assignment (`UPDATE ... SET <it>`): outboxd sets
    /// it on a row when it takes the row (in the producer's transaction), so the poller's
    /// claim skips the rows outboxd owns through its own partial index instead of checking
    /// `outbox.poller_may_claim` against each of them on every poll. Also applied now to the
    /// rows outboxd already took. [default with --published-column C: `C = now()`; none with
    /// --unpublished-when]
    #[arg(long, value_name = "ASSIGNMENT", requires = "poller_table")]
    pub mark_published: Option<String>,
    /// Leave the rows outboxd takes unpublished in the team's table (each poll then checks
    /// them all: its cost grows with every row outboxd publishes).
    #[arg(long, requires = "poller_table", conflicts_with = "mark_published")]
    pub no_mark_published: bool,
}

#[derive(Debug, Subcommand)]
pub enum ShareCommand {
    /// Every share: aggregate type (`*` = every type without its own row), bucket (`all`, or
    /// one of the type's 16 hash buckets), owner (poller, handover, outboxd, handback), rows
    /// parked for outboxd.
    List {
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        json: bool,
    },
    /// Hand aggregate types, or hash buckets of a type's aggregates, from the poller to
    /// outboxd. First checks with a canary row that the poller's claim respects ownership
    /// (`AND outbox.poller_may_claim(id)`), and refuses otherwise. New rows are then parked
    /// until the poller has published every row it owns of them, then outboxd publishes them
    /// in order. Waits for that; interrupted, it loses nothing (run it again, or give-back).
    Take(ShareArgs),
    /// Hand aggregate types, or hash buckets, back to the poller (rollback). First checks with
    /// a canary row that the poller's claim respects ownership, and refuses otherwise. New
    /// rows are the poller's; events outboxd captured stay outboxd's, and the poller's claim
    /// waits for their aggregates until they have receipts.
    GiveBack(ShareArgs),
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["aggregate_type", "all"])))]
pub struct ShareArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The aggregate type to switch.
    #[arg(long)]
    pub aggregate_type: Option<String>,
    /// Only these of the type's 16 hash buckets of aggregates (`outbox.share_bucket(id)`):
    /// e.g. `0-3` for a quarter of its aggregates, `0-3,8`. Each aggregate stays in one bucket,
    /// so it has one owner at a time and its order holds. [default: the whole type, and every
    /// bucket of it with a share of its own]
    #[arg(long, requires = "aggregate_type", conflicts_with = "all", value_parser = crate::values::parse_buckets)]
    pub buckets: Option<crate::values::Buckets>,
    /// Every aggregate type.
    #[arg(long)]
    pub all: bool,
    /// How long to wait for the poller and for open producer transactions.
    #[arg(long, value_parser = crate::values::parse_duration, default_value = "5m")]
    pub wait: std::time::Duration,
    /// Before any owner changes, a canary row (event type `outboxd.ownership_canary`, owned by
    /// nobody) is inserted into the poller's table: the switch goes on once the poller's claim
    /// has asked `outbox.poller_may_claim` about it and left it, and is refused if the poller
    /// claims it (its claim lacks the predicate) or no claim asks within this long.
    #[arg(long, value_parser = crate::values::parse_duration, default_value = "60s")]
    pub canary_wait: std::time::Duration,
    /// Skip the canary: the poller is stopped, and starts again only with the predicate in
    /// its claim (a poller without it would publish outboxd's rows too).
    #[arg(long)]
    pub poller_stopped: bool,
}

#[derive(Debug, Args)]
pub struct ShadowArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[arg(long, env = "OUTBOXD_BOOTSTRAP_SERVERS")]
    pub bootstrap_servers: String,
    /// A topic the poller publishes to; repeatable. [default: the topics outboxd's routes give
    /// the captured rows' aggregate and event types]
    #[arg(long = "topic")]
    pub topics: Vec<String>,
    /// The header carrying the event id in the poller's messages.
    #[arg(long, default_value = "id")]
    pub id_header: String,
    /// A row the poller marked published but that is not on the broker is lost only after
    /// this long (its message may still be in flight).
    #[arg(long, value_parser = crate::values::parse_duration, default_value = "1m")]
    pub grace: std::time::Duration,
    /// Read once up to the high watermarks, report and exit; otherwise read and report every
    /// --interval until SIGINT/SIGTERM.
    #[arg(long)]
    pub once: bool,
    #[arg(long, value_parser = crate::values::parse_duration, default_value = "30s")]
    pub interval: std::time::Duration,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// After every report, also write it as Prometheus gauges (`outboxd_shadow_*`, the text
    /// format) to this file, replaced atomically: point node_exporter's textfile collector at
    /// its directory (name it `*.prom`) and alert on `outboxd_shadow_faults > 0`.
    #[arg(long, value_name = "PATH")]
    pub metrics_file: Option<std::path::PathBuf>,
    /// librdkafka property for the consumer, KEY=VALUE (security.*, sasl.*, ssl.*).
    #[arg(long = "kafka-property", value_parser = parse_kv)]
    pub kafka_properties: Vec<(String, String)>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub db: DbArgs,
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
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        json: bool,
    },
    /// Publish the event after its cause was fixed (payload repaired, broker limit raised,
    /// relay for its destination running), then its aggregate's held events in version order.
    /// The running relay does the publishing within a second.
    ///
    /// One event (`--event`), or every open quarantine record of one reason
    /// (`--reason-code`, e.g. `broker_rejected` after the broker's limit was raised, or
    /// `destination_not_served` after the relay for that destination started): one cause
    /// fixed may have refused events of thousands of aggregates. `quarantine list` shows the
    /// codes and their counts; `--dry-run` shows what would be released.
    Release {
        #[command(flatten)]
        db: DbArgs,
        /// The quarantined (or gap-blocking) event id.
        #[arg(
            long,
            required_unless_present = "reason_code",
            conflicts_with = "reason_code"
        )]
        event: Option<uuid::Uuid>,
        /// Release every open quarantine record with this reason code, in one transaction.
        #[arg(long)]
        reason_code: Option<String>,
        /// With --reason-code: print what would be released and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Who releases it (recorded in the ledger). [default: $USER]
        #[arg(long)]
        by: Option<String>,
    },
    /// Never publish the event; publish its aggregate's held events. Needs a reason, which is
    /// recorded in the ledger with the operator's name. A skip is for good: no relay sends a
    /// skipped event again, even one that replays it.
    ///
    /// One event (`--event`), or every open quarantine record of one reason
    /// (`--reason-code`): a kind of event the consumers will never take, refused by the
    /// thousand. `--dry-run` shows what would be skipped.
    Skip {
        #[command(flatten)]
        db: DbArgs,
        /// The quarantined (or gap-blocking) event id.
        #[arg(
            long,
            required_unless_present = "reason_code",
            conflicts_with = "reason_code"
        )]
        event: Option<uuid::Uuid>,
        /// Skip every open quarantine record with this reason code, in one transaction.
        #[arg(long)]
        reason_code: Option<String>,
        /// With --reason-code: print what would be skipped and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Why the event may be dropped (recorded).
        #[arg(long)]
        reason: String,
        /// Who skips it (recorded in the ledger). [default: $USER]
        #[arg(long)]
        by: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum WebhooksCommand {
    /// Per endpoint: events it refused (quarantined, with its answer), aggregates held behind
    /// them with the number of events waiting, and sends in doubt (an unclear answer the relay
    /// keeps asking about on its schedule), oldest first. Read-only. Once the endpoint is
    /// fixed, `outboxd quarantine release --event ID` sends a refused event and what waits
    /// behind it; sends in doubt need nothing: the relay delivers them when the endpoint
    /// answers again.
    List {
        #[command(flatten)]
        db: DbArgs,
        /// Only this endpoint (the name its routes give it). [default: every endpoint]
        #[arg(long)]
        endpoint: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Send again events the endpoint already acknowledged (a receiver that lost data, or
    /// asks for a replay): in version order per aggregate, each with its own event id as
    /// webhook-id and idempotency key, a fresh timestamp and signature, the endpoint's
    /// settings from --config. Each 2xx is recorded as a duplicate receipt of the event (who
    /// asked, when); an aggregate whose resend fails stops there, and the command says which.
    /// Events without a receipt are the relay's, not this command's.
    #[command(after_help = "Examples:\n  \
        outboxd webhooks resend --config outboxd.toml --endpoint partner-a --since 2026-12-03T10:00:00Z --dry-run\n  \
        outboxd webhooks resend --config outboxd.toml --endpoint partner-a --event 0193...")]
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["since", "event"])))]
    Resend(ResendArgs),
}

#[derive(Debug, Args)]
pub struct ResendArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The endpoint to send to: an [[http.endpoints]] entry of --config, or its [http]
    /// endpoint.
    #[arg(long)]
    pub endpoint: String,
    /// Every event the endpoint acknowledged at or after this time (an RFC 3339 timestamp,
    /// e.g. 2026-12-03T10:00:00Z, or anything PostgreSQL reads as timestamptz).
    #[arg(long)]
    pub since: Option<String>,
    /// This event (repeatable).
    #[arg(long)]
    pub event: Vec<uuid::Uuid>,
    /// Who asks (recorded with each answer). [default: $USER]
    #[arg(long)]
    pub by: Option<String>,
    /// Print what would be sent; send nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, Args)]
pub struct MigrateDestinationArgs {
    #[command(flatten)]
    pub db: DbArgs,
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

/// How the relay authenticates to NATS (`[nats]` in the config file). Credentials never go in
/// the URL: a URL with `user:password@` is refused, naming these settings.
#[derive(Debug, Default, Args)]
pub struct NatsAuthArgs {
    /// NATS user name (with --nats-password / OUTBOXD_NATS_PASSWORD), for a server with
    /// `authorization { user, password }` or `--user/--pass`.
    #[arg(long, env = "OUTBOXD_NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password. Prefer the environment variable or `nats.password` in a file only the
    /// service user can read: flags are visible in `ps`.
    #[arg(long, env = "OUTBOXD_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
    /// NATS token, for a server with `authorization { token }` or `--auth`. Prefer the
    /// environment variable.
    #[arg(long, env = "OUTBOXD_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// File holding a user NKey seed (`SU...`), for a server whose authorization block lists
    /// the user's public NKey (`users = [{ nkey: U... }]`). The seed is never printed.
    #[arg(long, env = "OUTBOXD_NATS_NKEY_SEED_FILE")]
    pub nats_nkey_seed_file: Option<PathBuf>,
    /// PEM file of CA certificates that verify the NATS server's TLS certificate; implies
    /// --nats-require-tls.
    #[arg(long, env = "OUTBOXD_NATS_CA_FILE")]
    pub nats_ca_file: Option<PathBuf>,
    /// Refuse a NATS server that does not offer TLS.
    #[arg(long, env = "OUTBOXD_NATS_REQUIRE_TLS")]
    pub nats_require_tls: bool,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    #[arg(long, env = "OUTBOXD_BOOTSTRAP_SERVERS")]
    pub bootstrap_servers: Option<String>,
    /// NATS server URL: check the server identity, JetStream, the stream and its duplicate
    /// window (warned about when shorter than the relay's retry budget).
    #[arg(long, env = "OUTBOXD_NATS_URL")]
    pub nats_url: Option<String>,
    /// The JetStream stream to check. [default: OUTBOX]
    #[arg(long, env = "OUTBOXD_NATS_STREAM")]
    pub nats_stream: Option<String>,
    #[command(flatten)]
    pub nats_auth: NatsAuthArgs,
    #[arg(long, env = "OUTBOXD_SLOT")]
    pub slot: Option<String>,
    #[arg(long, env = "OUTBOXD_PUBLICATION")]
    pub publication: Option<String>,
    /// The relay's TOML config file (its keys are checked too).
    #[arg(long, env = "OUTBOXD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Check for `outboxd run --mode poll`: no slot, wal_level or REPLICATION needed.
    /// [default: cdc, or mode in the `[relay]` section of the config file]
    #[arg(long, value_enum, env = "OUTBOXD_MODE")]
    pub mode: Option<crate::values::RunMode>,
    /// Check for `outboxd run --delivery exactly-once`: the brokers run a transaction under a
    /// check id (`outboxd-check-<cluster>-<slot>`, opened and aborted), and the positions topic
    /// is there or may be created. [default: delivery in the `[kafka]` section of the config
    /// file, else at-least-once]
    #[arg(long, value_enum, env = "OUTBOXD_DELIVERY")]
    pub delivery: Option<crate::values::Delivery>,
}

#[derive(Debug, Default, Args)]
pub struct RunArgs {
    /// PostgreSQL URL of the database holding the outbox. The role needs REPLICATION (or
    /// superuser), SELECT on the outbox table and write access to the outbox schema.
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Kafka bootstrap servers, e.g. kafka-1:9092,kafka-2:9092.
    #[arg(long, env = "OUTBOXD_BOOTSTRAP_SERVERS")]
    pub bootstrap_servers: Option<String>,
    /// The broker to publish to. `nats` publishes to a NATS JetStream stream (subject = the
    /// frozen topic, header Nats-Msg-Id = event id); route those events with
    /// `SELECT outbox.set_nats_route('order', NULL, '<cluster name>')`. `http` sends one
    /// request per event to an HTTP endpoint (URL = the frozen topic, header Idempotency-Key =
    /// event id, settings in the config file's [http]); route those events with
    /// `SELECT outbox.set_http_route('order', NULL, '<endpoint>', 'https://host/hooks')`.
    /// [default: kafka]
    #[arg(long, env = "OUTBOXD_SINK", value_enum)]
    pub sink: Option<SinkKind>,
    /// The HTTP endpoint this relay serves, for --sink http: the name its routes give it
    /// (events frozen for another endpoint are quarantined). Several endpoints: list them in
    /// the config file's [[http.endpoints]] instead. [default: http.endpoint in the config
    /// file, else default]
    #[arg(long, env = "OUTBOXD_HTTP_ENDPOINT")]
    pub http_endpoint: Option<String>,
    /// Standard Webhooks signing secrets (`whsec_...` for HMAC, `whsk_...` for ed25519;
    /// comma-separated), for --sink http: every request is signed with each (`webhook-id`,
    /// `webhook-timestamp`, `webhook-signature`), so a secret is rotated by listing the new one
    /// beside the old for a while; `outboxd check` prints the whpk_ public key of a whsk_ one. Prefer the environment variable or http.signing_secrets in a file only the
    /// service user can read. [default: http.signing_secrets, else unsigned]
    #[arg(
        long,
        env = "OUTBOXD_HTTP_SIGNING_SECRETS",
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub http_signing_secrets: Vec<String>,
    /// NATS server URL(s) for --sink nats, e.g. nats://nats-1:4222. The server's cluster name
    /// (its server name, `-n`, when unclustered) must equal --cluster-name.
    #[arg(long, env = "OUTBOXD_NATS_URL")]
    pub nats_url: Option<String>,
    /// JetStream stream that captures the events' subjects. It is verified at start; a missing
    /// stream stops the relay unless --nats-create-stream. [default: OUTBOX]
    #[arg(long, env = "OUTBOXD_NATS_STREAM")]
    pub nats_stream: Option<String>,
    /// Create the stream at start when it is missing (file storage, the subjects of
    /// --nats-stream-subject, the duplicate window of --nats-duplicate-window-ms).
    #[arg(long)]
    pub nats_create_stream: bool,
    /// Subject filter of a stream the relay creates; repeatable. [default: outbox.>]
    #[arg(long = "nats-stream-subject")]
    pub nats_stream_subjects: Vec<String>,
    /// Duplicate window of a stream the relay creates, ms: how long JetStream remembers an
    /// event id and answers a re-send with the original sequence. Keep it longer than the
    /// retry budget (`outboxd check` warns). [default: 120000]
    #[arg(long, env = "OUTBOXD_NATS_DUPLICATE_WINDOW_MS")]
    pub nats_duplicate_window_ms: Option<u64>,
    #[command(flatten)]
    pub nats_auth: NatsAuthArgs,
    /// Logical replication slot (created on first run). [default: outboxd]
    #[arg(long, env = "OUTBOXD_SLOT")]
    pub slot: Option<String>,
    /// Publication on the outbox table. `outboxd migrate` creates it (inserts only); a relay whose role owns the table creates it if missing, the least-privilege role cannot. [default: outbox_pub]
    #[arg(long, env = "OUTBOXD_PUBLICATION")]
    pub publication: Option<String>,
    /// The outbox table. [default: outbox.events]
    #[arg(long, env = "OUTBOXD_TABLE")]
    pub table: Option<String>,
    /// TOML config file (see README "Configuration"). Unknown keys are errors. Its
    /// `[[databases]]` entries (name, database_url, slot, publication, table) make this process
    /// relay several databases, one relay each, the other settings shared; a database that is
    /// down stops only its own relay (docs/scaling.md).
    #[arg(long, env = "OUTBOXD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Broker cluster identity this relay serves; events frozen for another cluster are
    /// quarantined. [default: default]
    #[arg(long, env = "OUTBOXD_CLUSTER_NAME")]
    pub cluster_name: Option<String>,
    /// librdkafka property passed through, KEY=VALUE; repeatable (e.g. security.protocol=SASL_SSL,
    /// sasl.mechanism=SCRAM-SHA-512, ssl.ca.location=/etc/kafka/ca.pem). Put secret values
    /// (sasl.password) in the config file's [kafka.properties] instead: command lines are
    /// visible to other users. See docs/security.md.
    #[arg(long = "kafka-property", value_parser = parse_kv)]
    pub kafka_properties: Vec<(String, String)>,
    /// Add the CloudEvents 1.0 Kafka binary-mode headers (ce_specversion, ce_id, ce_type,
    /// ce_source, ce_time, ce_subject, content-type); the value stays the payload.
    #[arg(long, env = "OUTBOXD_CLOUDEVENTS")]
    pub cloudevents: bool,
    /// CloudEvents `source` ({aggregate_type} is replaced). Implies --cloudevents.
    /// [default: /outboxd/{aggregate_type}]
    #[arg(long, env = "OUTBOXD_CLOUDEVENTS_SOURCE")]
    pub cloudevents_source: Option<String>,
    /// How long one send may wait for the broker's ACK before its outcome is UNKNOWN (Kafka:
    /// message.timeout.ms, how long librdkafka retries one message). [default: 30000 for
    /// Kafka, 5000 for NATS]
    #[arg(long, env = "OUTBOXD_MESSAGE_TIMEOUT_MS")]
    pub message_timeout_ms: Option<u64>,
    /// Kafka: how many events of one aggregate may be in flight at once (1-64). Above 1, a
    /// few very hot aggregates drain faster: the producer is then gapless (a failure that
    /// could reorder an aggregate is its fatal error: the run ends and the next looks up what
    /// was outstanding) and its messages never time out (an unanswered send waits for its
    /// answer; --message-timeout-ms still bounds a stop's wait), the express lane is off, and
    /// the relay places keys itself by the partition count it first saw for a topic (a raised
    /// count is adopted when nothing is in flight; needs a key partitioner, not `random`).
    /// docs/ordering.md, "Hot aggregates". [default: 1]
    #[arg(long, env = "OUTBOXD_IN_FLIGHT_PER_AGGREGATE", value_parser = clap::value_parser!(u8).range(1..=64))]
    pub in_flight_per_aggregate: Option<u8>,
    /// Events in flight (sent, receipt not yet accepted) before reading pauses. Each costs
    /// about 2 KiB of memory (the event, its librdkafka copy, its receipt); the acceptance
    /// transaction's batch grows with it too. [default: 3000]
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
    /// waits as a hot standby and takes over this long after the active relay stops renewing
    /// (a paused or partitioned relay), or within 200 ms when the active relay is provably gone
    /// (its process died: its lease session and walsender are gone; see docs/scaling.md).
    /// [default: 10000]
    #[arg(long, env = "OUTBOXD_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// How long after a send ended without proof (DISPATCH_UNKNOWN) the partition scan may
    /// conclude the broker does not have it and allow a retry. [default: 5000]
    #[arg(long, env = "OUTBOXD_UNKNOWN_SETTLE_MS")]
    pub unknown_settle_ms: Option<u64>,
    /// Tries (sends and look-ups of one event that end without a clear answer: a timeout, a
    /// dropped connection, a 5xx, a possibly persisted Kafka request) before the relay logs an
    /// error about it. Only that event's aggregate waits, never the relay; the waits double
    /// from 200 ms up to 10 s (30 tries is about 4 minutes), and past the budget it keeps
    /// asking every 10 s (the outcome is unknown, not refused: it is never skipped).
    /// Watch `outboxd_unclear_events`. [default: 30]
    #[arg(long, env = "OUTBOXD_UNCLEAR_BUDGET")]
    pub unclear_budget: Option<u32>,
    /// Events waiting on unclear outcomes (each parked event, each send unanswered for 5 s,
    /// and those of their aggregates queued behind them) before the relay stops reading the
    /// slot. They hold only their
    /// aggregates and do not count against --max-in-flight, so one aggregate whose events
    /// keep coming while its destination is down does not stop the others; each is kept in
    /// memory (about 1.2 KiB plus its payload) until its aggregate moves. Past the bound (or
    /// past 64 MiB of their payloads) every aggregate waits, and the relay logs why.
    /// [default: 20000]
    #[arg(long, env = "OUTBOXD_UNCLEAR_MAX_WAITING")]
    pub unclear_max_waiting: Option<u64>,
    /// A retry schedule for unclear outcomes instead of the doubling from 200 ms to 10 s: the
    /// waits after the first, second, ... unclear outcome of one event, ms, comma-separated
    /// (1 to 16 steps; the last repeats), each moved by up to a tenth either way. Webhook
    /// senders' convention, to spare an endpoint that is down: `0,5000,300000,1800000,7200000`
    /// (immediately, 5 s, 5 min, 30 min, then every 2 h). The cost: an endpoint that is back
    /// gets the events of a waiting aggregate only at its next step. Sets the default of
    /// --unclear-budget to the number of steps. [default: the doubling]
    #[arg(long, env = "OUTBOXD_UNCLEAR_SCHEDULE_MS", value_delimiter = ',')]
    pub unclear_schedule_ms: Vec<u64>,
    /// This relay's name in the lease table. [default: host-pid-random]
    #[arg(long, env = "OUTBOXD_RELAY_ID")]
    pub relay_id: Option<String>,
    /// Drop and recreate the slot, then publish every outbox row that has no receipt. The
    /// recovery for a slot that was lost, recreated or invalidated; duplicates it causes are
    /// recorded as duplicate receipts.
    #[arg(long)]
    pub resnapshot: bool,
    /// Where new events come from: `cdc` (logical replication, the default) or `poll` (short
    /// queries for events without a receipt, for databases where logical replication is not
    /// allowed; no slot, no REPLICATION privilege). See docs/operations.md, "Poll mode".
    /// [default: cdc, or mode in the `[relay]` section of the config file]
    #[arg(long, value_enum, env = "OUTBOXD_MODE")]
    pub mode: Option<crate::values::RunMode>,
    /// Poll mode: the pause after a round that found nothing new. [default: 100]
    #[arg(long, env = "OUTBOXD_POLL_INTERVAL_MS")]
    pub poll_interval_ms: Option<u64>,
    /// Kafka only: `at-least-once` (the default: after a crash some events reach the broker
    /// twice, recorded as duplicate receipts; consumers deduplicate) or `exactly-once` (each
    /// batch one Kafka transaction: a `read_committed` consumer sees every event once; needs
    /// the positions topic and rows with their own version; docs/exactly_once.md).
    /// [default: at-least-once, or delivery in the `[kafka]` section of the config file]
    #[arg(long, value_enum, env = "OUTBOXD_DELIVERY")]
    pub delivery: Option<crate::values::Delivery>,
    /// Exactly-once mode: the topic of the committed batches' records (one partition; created
    /// at start when the brokers lack it). [default: outboxd.positions]
    #[arg(long, env = "OUTBOXD_POSITIONS_TOPIC")]
    pub positions_topic: Option<String>,
    /// Publish one shard of a sharded outbox (`outboxd migrate --shards N` first): INDEX/COUNT,
    /// e.g. 3/8. The relay's slot and publication are `<slot>_shard3of8` and
    /// `<publication>_shard3of8`, and it publishes, snapshots and releases only the aggregates
    /// of that shard. Run one relay (and standbys) per shard. CDC mode only. See
    /// docs/scaling.md.
    #[arg(long, env = "OUTBOXD_SHARD", value_parser = outbox_source::shard::Shard::parse)]
    pub shard: Option<outbox_source::shard::Shard>,
    /// Be one member of a relay fleet sharing every shard of the sharded outbox (`outboxd
    /// migrate --shards N` first): start as many `outboxd run --fleet` as you like, on any
    /// hosts, each with its own --relay-id. Each holds its fair share of the shards (the shard
    /// count over the live members, rounded up), takes the shards of a member that died (at
    /// once) or paused (when its lease expires), and hands shards over when members join.
    /// `outboxd status` shows which relay holds which shard. CDC mode only. See
    /// docs/scaling.md.
    #[arg(long, env = "OUTBOXD_FLEET", conflicts_with = "shard")]
    pub fleet: bool,
    /// With --fleet: how long a shard relay told to stop (its shard handed to a member that
    /// joined, or the member stopping) may take to drain, confirm and release its lease before
    /// the member aborts it and gives the lease back. An aborted relay's unconfirmed events are
    /// sent again by the shard's next holder (duplicates the ledger records, never a loss).
    /// Keep it above a stop's own drain (up to 10 s). [default: 15000]
    #[arg(long, env = "OUTBOXD_FLEET_STOP_GRACE_MS")]
    pub fleet_stop_grace_ms: Option<u64>,
    // Last: a flattened group's help heading also applies to the flags declared after it.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// Observability and the admin console (see docs/operations.md). Everything is off unless an
/// address is given; a bare port binds 127.0.0.1.
#[derive(Debug, Default, Args)]
#[command(next_help_heading = "Metrics, health and admin console")]
pub struct AdminArgs {
    /// Serve Prometheus `/metrics`, `/healthz` (the process answers) and `/readyz` (streaming
    /// from the slot and the broker reachable; 503 with the reason otherwise) over HTTP on
    /// HOST:PORT, e.g. 127.0.0.1:9187. A bare port binds 127.0.0.1.
    #[arg(long, env = "OUTBOXD_ADMIN_ADDR", value_name = "HOST:PORT")]
    pub admin_addr: Option<String>,
    /// Serve the read-only admin console (PostgreSQL wire protocol) on HOST:PORT, e.g.
    /// `--console-addr 6433` then `psql -h 127.0.0.1 -p 6433 -U outboxd -c 'SHOW STATUS'`.
    /// Commands: SHOW STATUS | LAG | UNKNOWN | QUARANTINE | RECEIPT '<event id>' | HELP.
    /// A bare port binds 127.0.0.1; other addresses need a console password.
    #[arg(long, env = "OUTBOXD_CONSOLE_ADDR", value_name = "HOST:PORT")]
    pub console_addr: Option<String>,
    /// User name the console accepts. [default: outboxd]
    #[arg(long, env = "OUTBOXD_CONSOLE_USER")]
    pub console_user: Option<String>,
    /// Console password (md5 authentication). Without one, the console trusts every
    /// connection to its (loopback) address. Prefer the environment variable: flags are
    /// visible in `ps`.
    #[arg(long, env = "OUTBOXD_CONSOLE_PASSWORD", hide_env_values = true)]
    pub console_password: Option<String>,
    /// Console connections open at once; one more is refused at once ("too many
    /// connections") and logged. [default: 16]
    #[arg(long, env = "OUTBOXD_CONSOLE_MAX_CONNECTIONS")]
    pub console_max_connections: Option<usize>,
    /// A console connection that has not authenticated within this is closed, ms.
    /// [default: 10000]
    #[arg(long, env = "OUTBOXD_CONSOLE_LOGIN_TIMEOUT_MS")]
    pub console_login_timeout_ms: Option<u64>,
    /// A console connection that sends nothing for this long is closed, ms. [default: 600000]
    #[arg(long, env = "OUTBOXD_CONSOLE_IDLE_TIMEOUT_MS")]
    pub console_idle_timeout_ms: Option<u64>,
    /// How often gauges read from PostgreSQL (slot lag, retained WAL, pending, UNKNOWN,
    /// quarantine, holds) and the broker probe behind /readyz are refreshed, ms. [default: 5000]
    #[arg(long, env = "OUTBOXD_SAMPLE_INTERVAL_MS")]
    pub sample_interval_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ReconcileFormat {
    /// A summary table and one line per finding.
    Table,
    Json,
    /// Prometheus text exposition format, for node_exporter's textfile collector.
    Prometheus,
}

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
outboxd reconcile --database-url postgres://... --bootstrap-servers kafka:9092\n  \
outboxd reconcile --format prometheus > /var/lib/node_exporter/outboxd.prom.tmp; \
mv /var/lib/node_exporter/outboxd.prom.tmp /var/lib/node_exporter/outboxd.prom\n  \
outboxd reconcile --audit-receipts all    # audit every receipt, not only the last 24h")]
pub struct ReconcileArgs {
    /// PostgreSQL URL of the database holding the outbox (and the inboxes of consumers that
    /// share it).
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Kafka bootstrap servers, for the bypass and conflict scan of the outbox's topics.
    #[arg(long, env = "OUTBOXD_BOOTSTRAP_SERVERS")]
    pub bootstrap_servers: Option<String>,
    /// TOML config file (`database_url`, `[kafka]`, `[reconcile]`).
    #[arg(long, env = "OUTBOXD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Report PENDING events older than this (30s, 5m, 2h, 1d). [default: 5m]
    #[arg(long, env = "OUTBOXD_RECONCILE_PENDING_AFTER", value_parser = crate::values::parse_duration)]
    pub pending_after: Option<std::time::Duration>,
    /// Report attempts DISPATCH_UNKNOWN for longer than this. [default: 15m]
    #[arg(long, env = "OUTBOXD_RECONCILE_UNKNOWN_AFTER", value_parser = crate::values::parse_duration)]
    pub unknown_after: Option<std::time::Duration>,
    /// Report events published longer ago than this that a mandatory consumer has not
    /// applied. [default: 1h]
    #[arg(long, env = "OUTBOXD_RECONCILE_UNCONSUMED_AFTER", value_parser = crate::values::parse_duration)]
    pub unconsumed_after: Option<std::time::Duration>,
    /// Also scan this topic for bypass publishes (the outbox's topics are always scanned);
    /// repeatable.
    #[arg(long = "topic")]
    pub topics: Vec<String>,
    /// Skip the broker scan (no bypass or broker-side conflict detection, no receipt audit).
    #[arg(long)]
    pub no_broker: bool,
    /// Which receipts to audit against the broker (each must point at a message carrying its
    /// event id and the frozen payload): all, none, sample=N (N receipts at random),
    /// last=DURATION (receipts recorded within DURATION, e.g. last=24h). Only Kafka receipts
    /// of --cluster-name are audited. [default: last=24h]
    #[arg(long, env = "OUTBOXD_RECONCILE_AUDIT_RECEIPTS", value_name = "SCOPE")]
    pub audit_receipts: Option<String>,
    /// The Kafka cluster identity --bootstrap-servers reaches (the relay's --cluster-name):
    /// only receipts recorded for it are audited. [default: kafka.cluster_name in the config
    /// file, else default]
    #[arg(long, env = "OUTBOXD_CLUSTER_NAME")]
    pub cluster_name: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ReconcileFormat::Table)]
    pub format: ReconcileFormat,
    /// Same as --format json.
    #[arg(long)]
    pub json: bool,
    /// Findings listed per kind (the counts are always complete).
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
    /// librdkafka property for the scan consumer, KEY=VALUE (security.*, sasl.*, ssl.*).
    #[arg(long = "kafka-property", value_parser = parse_kv)]
    pub kafka_properties: Vec<(String, String)>,
}

#[derive(Debug, Args)]
#[command(
    after_help = "An event is deleted only when its receipt is older than the replay window, every \
mandatory consumer reading its topic covers it (watermark past its offset, or in its inbox), and it has no \
open quarantine, hold or UNKNOWN attempt. A tombstone (id, digests, receipt position) stays in \
outbox.purged_events. Schedule it with cron or a systemd timer; concurrent runs are safe."
)]
pub struct PurgeArgs {
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// TOML config file (`database_url`, `[retention]`).
    #[arg(long, env = "OUTBOXD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Keep events published within this window (30s, 12h, 7d; 0s = no window). [default: 7d]
    #[arg(long, env = "OUTBOXD_REPLAY_WINDOW", value_parser = crate::values::parse_duration)]
    pub replay_window: Option<std::time::Duration>,
    /// Keep inbox rows consumed within this window. At least the replay window; make it
    /// cover the broker's retention of the topics, since a replay from the broker is
    /// deduplicated only while the row exists. [default: the replay window]
    #[arg(long, env = "OUTBOXD_INBOX_RETENTION", value_parser = crate::values::parse_duration)]
    pub inbox_retention: Option<std::time::Duration>,
    /// Rows per delete transaction. [default: 1000]
    #[arg(long)]
    pub batch_size: Option<i64>,
    /// Stop after this many event batches.
    #[arg(long)]
    pub max_batches: Option<u64>,
    /// Count what would be marked and deleted; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ConsumersCommand {
    /// Registered consumers and their progress.
    List {
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        json: bool,
    },
    /// Declare (or re-declare) a consumer. Mandatory: purge waits for its watermark and
    /// reconcile reports what it has not applied. Optional: neither.
    Register {
        #[command(flatten)]
        db: DbArgs,
        /// The consumer id it uses in its inbox (InboxConfig::consumer_id).
        #[arg(long)]
        id: String,
        /// Mandatory (true) or optional (false).
        #[arg(long, action = clap::ArgAction::Set)]
        mandatory: bool,
        /// A topic it reads; repeatable. [default: every topic]
        #[arg(long = "topic")]
        topics: Vec<String>,
        #[arg(long)]
        description: Option<String>,
    },
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn share_buckets_parse_into_one_value() {
        let cli = Cli::try_parse_from([
            "outboxd",
            "share",
            "take",
            "--database-url",
            "postgres://x",
            "--aggregate-type",
            "order",
            "--buckets",
            "0-3,8",
        ])
        .unwrap();
        let Command::Share(ShareCommand::Take(a)) = cli.command else {
            panic!("not share take")
        };
        assert_eq!(a.buckets.unwrap().0, vec![0, 1, 2, 3, 8]);
        let err = Cli::try_parse_from([
            "outboxd",
            "share",
            "take",
            "--database-url",
            "postgres://x",
            "--all",
            "--buckets",
            "1",
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("--all"), "{err}");
    }
}
