//! `outboxd`: the binary edge. CLI parsing, logging, signal handling and dispatch to the
//! commands of the library (`lib.rs`). The tools that start throwaway servers (demo, bench,
//! dev-broker) are the `outbox-embedded` binary, so this one links neither the test harness
//! nor the plotting library.

use std::sync::Arc;

use clap::Parser;
use tokio::sync::watch;

use outboxd::cli::{self, Cli, Command, QuarantineCommand};
use outboxd::config::FileConfig;
use outboxd::values::LogFormat;
use outboxd::{
    admin, check, config, connect, init_logging, migrate, migrate_destination, one_line, purge,
    reconcile, relay, resolve_admin, resolve_runs,
};

fn main() {
    tune_malloc();
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

/// glibc malloc, tuned for a small peak RSS (docs/benchmarks.md, "Relay RSS under 64 MiB"):
/// - one arena: by default every thread (the runtime's workers, librdkafka's threads of two
///   producers) gets an arena of its own, up to 8 per core, each keeping freed memory the
///   others cannot reuse;
/// - a fixed mmap threshold of 1 MiB: by default it rises to the size of any mapped block
///   freed (the gate's table of every aggregate seen grows to 9 MiB), after which blocks that
///   large come from the heap and their space stays there when they are freed. 1 MiB rather
///   than glibc's initial 128 KiB keeps the buffers of a batch in the heap.
///
/// Together with the gate's smaller entries they took the relay's peak RSS in
/// `outbox-embedded bench` on Apache Kafka from 64-70 to 56-61 MiB at the same drain rate. Set
/// before the first thread starts; `GLIBC_TUNABLES`, `MALLOC_ARENA_MAX` or
/// `MALLOC_MMAP_THRESHOLD_` in the environment win.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let unset = |v: &str| std::env::var_os(v).is_none();
        if unset("GLIBC_TUNABLES") {
            // SAFETY: mallopt only sets a malloc parameter; no other thread exists yet.
            unsafe {
                if unset("MALLOC_ARENA_MAX") {
                    libc::mallopt(libc::M_ARENA_MAX, 1);
                }
                if unset("MALLOC_MMAP_THRESHOLD_") {
                    libc::mallopt(libc::M_MMAP_THRESHOLD, 1024 * 1024);
                }
            }
        }
    }
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

async fn dispatch(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Migrate(a) => {
            let database_url = a.db.url()?;
            migrate(&database_url).await?;
            for t in &a.debezium_table {
                install_debezium(&database_url, t).await?;
            }
            if let Some(t) = &a.poller_table {
                outboxd::share::attach(&database_url, &a.poller, t).await?;
            }
            if let Some(n) = &a.shards {
                outboxd::shards::run(&database_url, &a.publication, n).await?;
            }
            Ok(())
        }
        Command::Run(a) => {
            let cfgs = resolve_runs(&a)?;
            let admin_cfg = resolve_admin(&a)?;
            // Bound before the relays start, so a taken port fails fast; serves until exit.
            let _admin = admin::start(&admin_cfg, &cfgs).await?;
            for cfg in &cfgs {
                purge::spawn_schedule(a.config.as_deref(), cfg.database_url.expose()).await?;
            }
            let (tx, rx) = watch::channel(false);
            spawn_signal_handler(tx);
            if cfgs.len() > 1 {
                // Several databases: one failing never stops the others (relay::databases).
                relay::databases::run(cfgs, a.fleet, rx).await;
                return Ok(());
            }
            let cfg = cfgs
                .into_iter()
                .next()
                .expect("resolve_runs returns one or more");
            if a.fleet {
                return relay::fleet::run(cfg, rx)
                    .await
                    .map_err(anyhow::Error::from);
            }
            let progress = Arc::new(relay::Progress::new(&cfg));
            relay::run(cfg, progress, rx)
                .await
                .map_err(anyhow::Error::from)
        }
        Command::Status(a) => match a.event {
            Some(id) => event_status(&a.db.url()?, id).await,
            None => status(&a.db.url()?, a.json).await,
        },
        Command::Quarantine(q) => quarantine(q).await,
        Command::Check(a) => check::run(a).await,
        Command::MigrateDestination(a) => migrate_destination::run(a).await,
        Command::Reconcile(a) => reconcile::run(a).await,
        Command::Purge(a) => purge::run(a).await,
        Command::Consumers(c) => consumers(c).await,
        Command::Share(c) => share(c).await,
        Command::Shadow(a) => outboxd::shadow::run(a).await,
    }
}

async fn share(cmd: cli::ShareCommand) -> anyhow::Result<()> {
    use outboxd::share::{self, Target};
    let target = |a: &cli::ShareArgs| match (&a.aggregate_type, &a.buckets) {
        (Some(t), Some(b)) => Target::Buckets(t.clone(), b.0.clone()),
        (Some(t), None) => Target::Type(t.clone()),
        (None, _) => Target::All,
    };
    let opts = |a: &cli::ShareArgs| share::SwitchOptions {
        wait: a.wait,
        canary_wait: a.canary_wait,
        poller_stopped: a.poller_stopped,
    };
    match cmd {
        cli::ShareCommand::List { db, json } => share::list(&db.url()?, json).await,
        cli::ShareCommand::Take(a) => share::take(&a.db.url()?, &target(&a), &opts(&a)).await,
        cli::ShareCommand::GiveBack(a) => {
            share::give_back(&a.db.url()?, &target(&a), &opts(&a)).await
        }
    }
}

async fn consumers(cmd: cli::ConsumersCommand) -> anyhow::Result<()> {
    use outbox_ledger::consumers;
    match cmd {
        cli::ConsumersCommand::List { db, json } => {
            let client = connect(&db.url()?).await?;
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
            db,
            id,
            mandatory,
            topics,
            description,
        } => {
            let client = connect(&db.url()?).await?;
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
    if !s.leases.is_empty() {
        println!();
        println!(
            "{:<24} {:<32} {:>10} {:<22} {:<14}",
            "LEASE", "HELD BY", "GENERATION", "STATE", "EARLY TAKEOVER"
        );
        for l in &s.leases {
            let state = if l.expires_in_seconds > 0.0 {
                format!("held, {:.1}s left", l.expires_in_seconds)
            } else {
                "expired (free)".to_string()
            };
            println!(
                "{:<24} {:<32} {:>10} {:<22} {:<14}",
                l.slot_name,
                l.owner,
                l.generation,
                state,
                if l.holder_locks {
                    "if it dies"
                } else {
                    "at expiry"
                }
            );
        }
    }
    if !s.members.is_empty() {
        println!();
        println!("{:<32} {:>14}  LEASES", "FLEET MEMBER", "SEEN (S AGO)");
        for (id, ago) in &s.members {
            let held = s
                .leases
                .iter()
                .filter(|l| &l.owner == id && l.expires_in_seconds > 0.0)
                .count();
            println!("{id:<32} {ago:>14.1}  {held}");
        }
    }
    Ok(())
}

async fn quarantine(cmd: QuarantineCommand) -> anyhow::Result<()> {
    use outbox_ledger::holds::{self, Resolution};
    let operator = |by: Option<String>| {
        by.or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "operator".into())
    };
    match cmd {
        QuarantineCommand::List { db, json } => {
            let client = connect(&db.url()?).await?;
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
        QuarantineCommand::Release { db, event, by } => {
            let mut client = connect(&db.url()?).await?;
            holds::resolve(&mut client, event, Resolution::Release, &operator(by), None).await?;
            println!("released {event}; the running relay publishes it and its held events in version order");
            Ok(())
        }
        QuarantineCommand::Skip {
            db,
            event,
            reason,
            by,
        } => {
            if reason.trim().is_empty() {
                anyhow::bail!("--reason must say why event {event} may be dropped; it is recorded in the ledger");
            }
            let mut client = connect(&db.url()?).await?;
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
