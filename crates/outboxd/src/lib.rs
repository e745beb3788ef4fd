//! `outboxd` as a library: the relay, its configuration and every command of the daemon, for
//! the `outboxd` binary (`main.rs`, the CLI edge) and for `outbox-embedded` (demo, bench,
//! dev-broker), which runs the same relay against throwaway servers. Commands report with
//! `anyhow`; the library crates below them have their own error types.

pub mod admin;
pub mod check;
pub mod cli;
pub mod config;
pub mod failpoint;
pub mod metrics;
pub mod migrate_destination;
pub mod operator;
pub mod poller_share;
pub mod purge;
pub mod reconcile;
pub mod relay;
pub mod shadow;
pub mod shard_layout;
pub mod topics;
pub mod values;
pub mod webhooks;

pub use config::resolve::{http_endpoints, resolve_admin, resolve_run, resolve_runs, HttpFlags};

use anyhow::Context;
use config::redact_url;
use values::LogFormat;

/// The error and its causes on one line. Database errors are already rendered in full (with
/// detail and hint) by the error that wraps them, so their own chain is not repeated.
pub fn one_line(e: &anyhow::Error) -> String {
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

/// Logs to stderr; `OUTBOXD_LOG` (an `EnvFilter`) overrides the default filter.
pub fn init_logging(format: LogFormat, quiet: bool) {
    let default = if quiet {
        "off"
    } else {
        "info,tokio_postgres=warn"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("OUTBOXD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only on a terminal: logs written to a file or a pipe get no escape codes (issue
    // 34); NO_COLOR (https://no-color.org) turns it off on a terminal too.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    match format {
        LogFormat::Text => builder.finish().with(no_secret_traces()).init(),
        LogFormat::Json => builder.json().finish().with(no_secret_traces()).init(),
    }
}

/// Drops async-nats's TRACE events whatever `OUTBOXD_LOG` asks for: it traces the CONNECT it
/// writes with the password and token in it (issue 33, finding 6).
fn no_secret_traces() -> tracing_subscriber::filter::FilterFn {
    tracing_subscriber::filter::filter_fn(|meta| {
        !(meta.target().starts_with("async_nats") && *meta.level() == tracing::Level::TRACE)
    })
}

/// Connects for ordinary SQL, with an error that names the server and the fix.
pub async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
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

/// Creates or upgrades schema `outbox` (`outboxd migrate`), printing each migration applied.
pub async fn migrate(url: &str) -> anyhow::Result<()> {
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
