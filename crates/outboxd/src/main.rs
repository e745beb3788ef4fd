//! `outboxd`: the binary edge. CLI parsing, config resolution, logging, signal handling, and
//! wiring of the library crates; `anyhow` lives only here.

mod admin;
mod bench;
mod check;
mod cli;
mod config;
mod demo;
mod failpoint;
mod metrics;
mod migrate_destination;
mod purge;
mod reconcile;
mod relay;
mod values;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use outbox_sink::{JetStreamSinkConfig, KafkaSinkConfig};
use tokio::sync::watch;

use cli::{Cli, Command, QuarantineCommand, RunArgs};
use config::{redact_url, FileConfig, RelayConfig, Secret};
use values::LogFormat;

fn main() {
    let cli = Cli::parse();
    // `check` reports in its own lines; library logs would only repeat them noisily.
    let quiet = matches!(cli.command, Command::Check(_));
    init_logging(log_format(&cli), quiet);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outboxd: error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(dispatch(cli.command)) {
        eprintln!("outboxd: error: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line. Database errors are already rendered in full (with
/// detail and hint) by the error that wraps them, so their own chain is not repeated.
pub(crate) fn one_line(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        if cause.downcast_ref::<tokio_postgres::Error>().is_some()
            || cause
                .downcast_ref::<tokio_postgres::error::DbError>()
                .is_some()
        {
            break;
        }
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg.replace('\n', " ")
}

/// `--log-format`, else `log_format` in the `run` config file, else text. A config file that
/// does not load is reported later, by the command itself.
fn log_format(cli: &Cli) -> LogFormat {
    if let Some(f) = cli.log_format {
        return f;
    }
    match &cli.command {
        Command::Run(a) => a
            .config
            .as_deref()
            .and_then(|p| FileConfig::load(p).ok())
            .and_then(|f| f.log_format)
            .unwrap_or(LogFormat::Text),
        _ => LogFormat::Text,
    }
}

fn init_logging(format: LogFormat, quiet: bool) {
    let default = if quiet {
        "off"
    } else {
        "info,tokio_postgres=warn"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("OUTBOXD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn dispatch(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Migrate(a) => {
            migrate(&a.database_url).await?;
            for t in &a.debezium_table {
                install_debezium(&a.database_url, t).await?;
            }
            Ok(())
        }
        Command::Run(a) => {
            let cfg = resolve_run(&a)?;
            let admin_cfg = resolve_admin(&a)?;
            // Bound before the relay starts, so a taken port fails fast; serves until exit.
            let _admin = admin::start(&admin_cfg, &cfg).await?;
            purge::spawn_schedule(a.config.as_deref(), cfg.database_url.expose())?;
            let (tx, rx) = watch::channel(false);
            spawn_signal_handler(tx);
            relay::run(cfg, Arc::new(relay::Progress::default()), rx)
                .await
                .map_err(anyhow::Error::from)
        }
        Command::Status(a) => match a.event {
            Some(id) => event_status(&a.database_url, id).await,
            None => status(&a.database_url, a.json).await,
        },
        Command::Quarantine(q) => quarantine(q).await,
        Command::DevBroker(a) => dev_broker(a.brokers).await,
        Command::Demo(a) => demo::run(a).await,
        Command::Bench(a) => bench::run(a).await,
        Command::Check(a) => check::run(a).await,
        Command::MigrateDestination(a) => migrate_destination::run(a).await,
        Command::Reconcile(a) => reconcile::run(a).await,
        Command::Purge(a) => purge::run(a).await,
        Command::Consumers(c) => consumers(c).await,
    }
}

async fn consumers(cmd: cli::ConsumersCommand) -> anyhow::Result<()> {
    use outbox_ledger::consumers;
    match cmd {
        cli::ConsumersCommand::List { database_url, json } => {
            let client = connect(&database_url).await?;
            let list = consumers::list(&client).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(());
            }
            println!(
                "{:<24} {:<10} {:>10} {:>10} {:>12}  TOPICS",
                "CONSUMER", "KIND", "PARTITIONS", "INBOX", "IDLE"
            );
            for c in &list {
                println!(
                    "{:<24} {:<10} {:>10} {:>10} {:>12}  {}",
                    c.consumer_id,
                    if c.mandatory { "mandatory" } else { "optional" },
                    c.partitions,
                    c.inbox_rows,
                    c.idle_seconds
                        .map(|i| format!("{i:.0}s"))
                        .unwrap_or_else(|| "never".into()),
                    c.topics
                        .as_ref()
                        .map(|t| t.join(","))
                        .unwrap_or_else(|| "*".into())
                );
            }
            Ok(())
        }
        cli::ConsumersCommand::Register {
            database_url,
            id,
            mandatory,
            topics,
            description,
        } => {
            let client = connect(&database_url).await?;
            let topics = (!topics.is_empty()).then_some(topics);
            consumers::register(
                &client,
                &id,
                mandatory,
                topics.as_deref(),
                description.as_deref(),
            )
            .await?;
            println!(
                "registered consumer {id} as {}",
                if mandatory { "mandatory" } else { "optional" }
            );
            Ok(())
        }
    }
}

fn spawn_signal_handler(tx: watch::Sender<bool>) {
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return,
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutdown requested; finishing in-flight events");
        let _ = tx.send(true);
    });
}

/// Connects for ordinary SQL, with an error that names the server and the fix.
pub(crate) async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let opts = outbox_source::tls::PgConnectOptions::parse(url)
        .map_err(|e| anyhow::anyhow!("database URL {}: {e}", redact_url(url)))?;
    opts.connect_sql().await.map_err(|e| {
        let why = match e {
            outbox_source::tls::ConnectError::Db(e) => outbox_ledger::describe_db_error(&e),
            outbox_source::tls::ConnectError::Tls(e) => e.to_string(),
        };
        anyhow::anyhow!(
            "cannot connect to PostgreSQL at {}: {why}; check the URL, that the server is up, pg_hba.conf, and sslmode/sslrootcert",
            redact_url(url)
        )
    })
}

pub(crate) async fn migrate(url: &str) -> anyhow::Result<()> {
    let mut client = connect(url).await?;
    let applied = outbox_ledger::migrate::run(&mut client)
        .await
        .context("migrate")?;
    if applied.is_empty() {
        println!("schema outbox is up to date");
    } else {
        for v in applied {
            println!("applied migration {v:04}");
        }
    }
    Ok(())
}

/// Installs the Debezium-compatible capture trigger on `table` (migration 0009).
async fn install_debezium(url: &str, table: &str) -> anyhow::Result<()> {
    let (schema, name) = config::split_table(table)?;
    let client = connect(url).await?;
    let qualified = format!(
        "{}.{}",
        outbox_source::slot::quote_ident(&schema),
        outbox_source::slot::quote_ident(&name)
    );
    let row = client
        .query_one(
            "SELECT outbox.install_debezium_capture($1::text::regclass)",
            &[&qualified],
        )
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "installing the Debezium capture on {table}: {}",
                outbox_ledger::describe_db_error(&e)
            )
        })?;
    println!("{}", row.get::<_, String>(0));
    Ok(())
}

fn resolve_run(a: &RunArgs) -> anyhow::Result<RelayConfig> {
    let file = match &a.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let table = a
        .table
        .clone()
        .or(file.table.clone())
        .unwrap_or_else(|| config::DEFAULT_TABLE.into());
    let (schema, table) = config::split_table(&table)?;
    let mut properties: Vec<(String, String)> = file.kafka.properties.clone().into_iter().collect();
    properties.extend(a.kafka_properties.iter().cloned());
    let defaults = KafkaSinkConfig::default();
    let cluster_name = a.cluster_name.clone();
    let nats = match a.sink.or(file.sink).unwrap_or(values::SinkKind::Kafka) {
        values::SinkKind::Kafka => None,
        values::SinkKind::Nats => {
            let d = JetStreamSinkConfig::default();
            let n = &file.nats;
            Some(JetStreamSinkConfig {
                url: a.nats_url.clone().or(n.url.clone()).unwrap_or_default(),
                cluster_name: cluster_name
                    .clone()
                    .or(n.cluster_name.clone())
                    .unwrap_or(d.cluster_name),
                stream: a
                    .nats_stream
                    .clone()
                    .or(n.stream.clone())
                    .unwrap_or(d.stream),
                create_stream: a.nats_create_stream || n.create_stream.unwrap_or(false),
                stream_subjects: if a.nats_stream_subjects.is_empty() {
                    n.stream_subjects.clone().unwrap_or(d.stream_subjects)
                } else {
                    a.nats_stream_subjects.clone()
                },
                duplicate_window: a
                    .nats_duplicate_window_ms
                    .or(n.duplicate_window_ms)
                    .map(Duration::from_millis)
                    .unwrap_or(d.duplicate_window),
                ack_timeout: a
                    .message_timeout_ms
                    .or(n.ack_timeout_ms)
                    .map(Duration::from_millis)
                    .unwrap_or(d.ack_timeout),
                max_in_flight: a
                    .max_in_flight
                    .or(file.relay.max_in_flight)
                    .map(|m| usize::try_from(m).unwrap_or(usize::MAX))
                    .unwrap_or(d.max_in_flight),
            })
        }
    };
    let cfg = RelayConfig {
        database_url: a
            .database_url
            .clone()
            .map(Secret::new)
            .or(file.database_url.clone())
            .unwrap_or_default(),
        slot: a
            .slot
            .clone()
            .or(file.slot.clone())
            .unwrap_or_else(|| config::DEFAULT_SLOT.into()),
        publication: a
            .publication
            .clone()
            .or(file.publication.clone())
            .unwrap_or_else(|| config::DEFAULT_PUBLICATION.into()),
        schema,
        table,
        sink: KafkaSinkConfig {
            bootstrap_servers: a
                .bootstrap_servers
                .clone()
                .or(file.kafka.bootstrap_servers.clone())
                .unwrap_or_default(),
            cluster_name: a
                .cluster_name
                .clone()
                .or(file.kafka.cluster_name.clone())
                .unwrap_or(defaults.cluster_name),
            partitioner: file
                .kafka
                .partitioner
                .clone()
                .unwrap_or(defaults.partitioner),
            message_timeout: a
                .message_timeout_ms
                .or(file.kafka.message_timeout_ms)
                .map(Duration::from_millis)
                .unwrap_or(defaults.message_timeout),
            linger: file
                .kafka
                .linger_ms
                .map(Duration::from_millis)
                .unwrap_or(defaults.linger),
            properties,
            headers: outbox_sink::HeaderOptions {
                cloudevents: cloudevents_source(a, &file),
            },
        },
        nats,
        max_in_flight: a
            .max_in_flight
            .or(file.relay.max_in_flight)
            .unwrap_or(5_000),
        batch_size: a.batch_size.or(file.relay.batch_size).unwrap_or(1000),
        batch_linger: Duration::from_millis(
            a.batch_linger_ms
                .or(file.relay.batch_linger_ms)
                .unwrap_or(1),
        ),
        status_interval: Duration::from_millis(
            a.status_interval_ms
                .or(file.relay.status_interval_ms)
                .unwrap_or(1000),
        ),
        heartbeat_interval: Duration::from_millis(
            a.heartbeat_interval_ms
                .or(file.relay.heartbeat_interval_ms)
                .unwrap_or(10_000),
        ),
        resnapshot: a.resnapshot,
        relay_id: a
            .relay_id
            .clone()
            .or(file.relay.relay_id.clone())
            .unwrap_or_else(config::default_relay_id),
        lease_ttl: Duration::from_millis(
            a.lease_ttl_ms.or(file.relay.lease_ttl_ms).unwrap_or(10_000),
        ),
        unknown_settle: Duration::from_millis(
            a.unknown_settle_ms
                .or(file.relay.unknown_settle_ms)
                .unwrap_or(5_000),
        ),
    };
    cfg.validate()?;
    Ok(cfg)
}

fn resolve_admin(a: &RunArgs) -> anyhow::Result<config::AdminConfig> {
    let file = match &a.config {
        Some(p) => FileConfig::load(p)?.admin,
        None => config::AdminFile::default(),
    };
    let f = &a.admin;
    let addr =
        |what: &str, v: Option<&String>| v.map(|s| config::parse_listen_addr(what, s)).transpose();
    let cfg = config::AdminConfig {
        http_addr: addr(
            "admin address",
            f.admin_addr.as_ref().or(file.addr.as_ref()),
        )?,
        console_addr: addr(
            "console address",
            f.console_addr.as_ref().or(file.console_addr.as_ref()),
        )?,
        console_user: f
            .console_user
            .clone()
            .or(file.console_user)
            .unwrap_or_else(|| config::DEFAULT_CONSOLE_USER.into()),
        console_password: f
            .console_password
            .clone()
            .map(Secret::new)
            .or(file.console_password),
        sample_interval: Duration::from_millis(
            f.sample_interval_ms
                .or(file.sample_interval_ms)
                .unwrap_or(config::DEFAULT_SAMPLE_INTERVAL_MS),
        ),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// `Some(source)` when CloudEvents headers are on (flag, variable or file; a source implies on).
fn cloudevents_source(a: &RunArgs, file: &FileConfig) -> Option<String> {
    let source = a
        .cloudevents_source
        .clone()
        .or(file.kafka.cloudevents_source.clone());
    let on = a.cloudevents || file.kafka.cloudevents.unwrap_or(false) || source.is_some();
    on.then(|| source.unwrap_or_else(|| outbox_sink::headers::DEFAULT_CLOUDEVENTS_SOURCE.into()))
}

async fn event_status(url: &str, id: uuid::Uuid) -> anyhow::Result<()> {
    let client = connect(url).await?;
    match outbox_ledger::status::event_history(&client, id).await? {
        Some(lines) => {
            for l in lines {
                println!("{l}");
            }
            Ok(())
        }
        None => anyhow::bail!("event {id} is not in the outbox (never committed, or purged)"),
    }
}

async fn status(url: &str, json: bool) -> anyhow::Result<()> {
    let client = connect(url).await?;
    let s = outbox_ledger::status::read(&client).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!("events              {}", s.events);
    println!("published           {}", s.published);
    println!("pending             {}", s.pending);
    if let Some(age) = s.oldest_pending_age_seconds {
        println!("oldest pending age  {age:.1}s");
    }
    println!("duplicate receipts  {}", s.duplicate_receipts);
    println!("quarantined         {}", s.quarantined);
    println!();
    println!(
        "{:<24} {:<12} {:<14} {:<14} {:<8} {:<10} {:>12} {:>12}",
        "SLOT", "PUBLICATION", "CHECKPOINT", "SLOT LSN", "ACTIVE", "WAL", "LAG BYTES", "RETAINED"
    );
    for sl in &s.slots {
        println!(
            "{:<24} {:<12} {:<14} {:<14} {:<8} {:<10} {:>12} {:>12}",
            sl.slot_name,
            sl.publication,
            sl.checkpoint_lsn,
            sl.slot_confirmed_lsn.as_deref().unwrap_or("MISSING"),
            sl.active
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            sl.wal_status.as_deref().unwrap_or("-"),
            sl.lag_bytes
                .map(|b| b.to_string())
                .unwrap_or_else(|| "-".into()),
            sl.retained_wal_bytes
                .map(|b| b.to_string())
                .unwrap_or_else(|| "-".into()),
        );
    }
    Ok(())
}

async fn dev_broker(brokers: i32) -> anyhow::Result<()> {
    let kafka = outbox_testkit::kafka::TestKafka::mock(brokers)
        .map_err(|e| anyhow::anyhow!("starting the embedded broker: {e}"))?;
    println!("bootstrap.servers={}", kafka.bootstrap_servers());
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    drop(kafka);
    Ok(())
}

async fn quarantine(cmd: QuarantineCommand) -> anyhow::Result<()> {
    use outbox_ledger::holds::{self, Resolution};
    let operator = |by: Option<String>| {
        by.or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "operator".into())
    };
    match cmd {
        QuarantineCommand::List { database_url, json } => {
            let client = connect(&database_url).await?;
            let (q, h) = holds::list(&client).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &serde_json::json!({"quarantine": q, "holds": h})
                    )?
                );
                return Ok(());
            }
            println!("QUARANTINED ({})", q.len());
            for e in &q {
                println!(
                    "  {}  {}/{}@{}  {}: {}",
                    e.event_id
                        .map(|i| i.to_string())
                        .unwrap_or_else(|| e.quarantine_key.clone()),
                    e.aggregate_type.as_deref().unwrap_or("?"),
                    e.aggregate_id.as_deref().unwrap_or("?"),
                    e.aggregate_version
                        .map(|v| v.to_string())
                        .unwrap_or_else(|| "?".into()),
                    e.reason_code,
                    e.reason
                );
            }
            println!("HELD AGGREGATES ({})", h.len());
            for e in &h {
                println!(
                    "  {}/{}  {}  blocked by {} (version {})  held events: {}  {}: {}",
                    e.aggregate_type,
                    e.aggregate_id,
                    e.state,
                    e.blocking_event_id
                        .map(|i| i.to_string())
                        .unwrap_or_else(|| "-".into()),
                    e.blocking_version
                        .map(|v| v.to_string())
                        .unwrap_or_else(|| "-".into()),
                    e.held_events,
                    e.reason_code,
                    e.reason
                );
            }
            Ok(())
        }
        QuarantineCommand::Release {
            database_url,
            event,
            by,
        } => {
            let mut client = connect(&database_url).await?;
            holds::resolve(&mut client, event, Resolution::Release, &operator(by), None).await?;
            println!("released {event}; the running relay publishes it and its held events in version order");
            Ok(())
        }
        QuarantineCommand::Skip {
            database_url,
            event,
            reason,
            by,
        } => {
            if reason.trim().is_empty() {
                anyhow::bail!("--reason must say why event {event} may be dropped; it is recorded in the ledger");
            }
            let mut client = connect(&database_url).await?;
            holds::resolve(
                &mut client,
                event,
                Resolution::Skip,
                &operator(by),
                Some(&reason),
            )
            .await?;
            println!("skipped {event} (reason recorded); the running relay publishes the held events behind it");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> RunArgs {
        let mut argv = vec!["outboxd", "run", "--database-url", "postgres://h/db"];
        argv.extend(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(a) => *a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_nats_sink_comes_from_the_config_file_and_flags_win() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("outboxd.toml");
        std::fs::write(
            &file,
            "sink = \"nats\"\n[nats]\nurl = \"nats://n:4222\"\ncluster_name = \"nats-a\"\nstream = \"EVENTS\"\nack_timeout_ms = 750\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let cfg = resolve_run(&run_args(&["--config", path])).unwrap();
        let n = cfg.nats.expect("sink = nats");
        assert_eq!(
            (n.url.as_str(), n.cluster_name.as_str(), n.stream.as_str()),
            ("nats://n:4222", "nats-a", "EVENTS")
        );
        assert_eq!(n.ack_timeout, Duration::from_millis(750));
        assert!(!n.create_stream);

        let cfg = resolve_run(&run_args(&[
            "--config",
            path,
            "--nats-stream",
            "OTHER",
            "--nats-create-stream",
            "--cluster-name",
            "nats-b",
        ]))
        .unwrap();
        let n = cfg.nats.unwrap();
        assert_eq!(
            (n.stream.as_str(), n.cluster_name.as_str()),
            ("OTHER", "nats-b")
        );
        assert!(n.create_stream);

        // Kafka stays the default and still needs its bootstrap servers.
        let e = resolve_run(&run_args(&[])).unwrap_err();
        assert!(e.to_string().contains("--sink nats"), "{e}");
        let e = resolve_run(&run_args(&["--sink", "nats"])).unwrap_err();
        assert!(e.to_string().contains("--nats-url"), "{e}");
    }
}
