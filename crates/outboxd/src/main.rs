//! `outboxd`: the binary edge. CLI parsing, logging, signal handling and dispatch to the
//! commands of the library (`lib.rs`). The tools that start throwaway servers (demo, bench,
//! dev-broker) are the `outbox-embedded` binary, so this one links neither the test harness
//! nor the plotting library.

use std::sync::Arc;

/// mimalloc instead of glibc malloc for the relay's own allocations: glibc's (one arena,
/// `tune_malloc`) took ~30 % of the relay's CPU in a drain on Apache Kafka (`perf`: `_int_malloc`,
/// `_int_free`, `malloc_consolidate`, arena lock waits). A/B in docs/benchmarks.md ("mimalloc
/// shipped"): relay CPU per drained event 15 -> 11 us, the drain +36 %, the same peak RSS (~50
/// MiB) and a steady p99 within 2-3 ms of glibc's. librdkafka's C code still uses glibc malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use tokio::sync::watch;

use outboxd::cli::{self, Cli, Command};
use outboxd::config::FileConfig;
use outboxd::values::LogFormat;
use outboxd::{
    admin, check, init_logging, migrate, migrate_destination, one_line, purge, reconcile, relay,
    resolve_admin, resolve_runs,
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

/// The allocators, tuned for a small peak RSS (docs/benchmarks.md, "Relay RSS under 64 MiB",
/// "The relay's allocator" and "mimalloc shipped").
///
/// mimalloc (the relay's own allocations) is built without transparent huge pages (the
/// `no_thp` feature of `libmimalloc-sys`: with them its peak RSS was 82-116 MiB) and gives
/// freed memory back at once (`purge_delay` 0, by default 1 s) without committing its arenas
/// ahead (`arena_eager_commit` 0): its peak RSS is then glibc's (a longer purge delay costs
/// RSS: 66 MiB at 1 s, and bought no measurable p99). The two options are set through the
/// option numbers of `mimalloc.h`'s `mi_option_e`, which mimalloc keeps stable
/// across versions (v2 and v3 alike); `MIMALLOC_PURGE_DELAY` and `MIMALLOC_ARENA_EAGER_COMMIT`
/// in the environment win.
///
/// glibc malloc (librdkafka's C allocations):
/// - one arena: by default every thread (librdkafka's threads of two producers) gets an arena
///   of its own, up to 8 per core, each keeping freed memory the others cannot reuse;
/// - a fixed mmap threshold of 1 MiB: by default it rises to the size of any mapped block
///   freed, after which blocks that large come from the heap and their space stays there when
///   they are freed.
///
/// Set before the first thread starts; `GLIBC_TUNABLES`, `MALLOC_ARENA_MAX` or
/// `MALLOC_MMAP_THRESHOLD_` in the environment win.
fn tune_malloc() {
    let unset = |v: &str| std::env::var_os(v).is_none();
    const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: mi_option_set only stores an option value.
    unsafe {
        if unset("MIMALLOC_PURGE_DELAY") {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0);
        }
        if unset("MIMALLOC_ARENA_EAGER_COMMIT") {
            libmimalloc_sys::mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0);
        }
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
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
                outboxd::operator::install_debezium(&database_url, t).await?;
            }
            if let Some(t) = &a.poller_table {
                outboxd::poller_share::attach(&database_url, &a.poller, t).await?;
            }
            if let Some(n) = &a.shards {
                outboxd::shard_layout::run(&database_url, &a.publication, n).await?;
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
            Some(id) => outboxd::operator::event_status(&a.db.url()?, id).await,
            None => outboxd::operator::status(&a.db.url()?, a.json).await,
        },
        Command::Quarantine(q) => outboxd::operator::quarantine(q).await,
        Command::Check(a) => check::run(a).await,
        Command::MigrateDestination(a) => migrate_destination::run(a).await,
        Command::Reconcile(a) => reconcile::run(a).await,
        Command::Purge(a) => purge::run(a).await,
        Command::Consumers(c) => outboxd::operator::consumers(c).await,
        Command::Share(c) => outboxd::operator::share(c).await,
        Command::Shadow(a) => outboxd::shadow::run(a).await,
        Command::Webhooks(cli::WebhooksCommand::List { db, endpoint, json }) => {
            outboxd::webhooks::list(&db.url()?, endpoint.as_deref(), json).await
        }
        Command::Webhooks(cli::WebhooksCommand::Resend(a)) => outboxd::webhooks::resend(a).await,
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
