//! `outboxd purge`: moves covered published events to RETAINED and deletes what is past the
//! replay window, in batches. The rules (what may never go) live with the SQL in
//! `outbox_ledger::retention`; this is the command around them.
//!
//! Run it from cron or a systemd timer (`outboxd purge --replay-window 7d`), or let
//! `outboxd run` do it: `[retention] purge_interval = "1h"` in its config file starts a
//! background task with the same settings ([`spawn_schedule`]). Several runs at once are safe
//! (`FOR UPDATE SKIP LOCKED`), so a standby relay purging too does no harm.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use outbox_ledger::retention::{self, PurgeReport, PurgeSettings};

use crate::cli::PurgeArgs;
use crate::config::FileConfig;
use crate::values::{parse_duration, show_duration};

/// Default replay window when neither flag, variable nor config file sets one.
pub const DEFAULT_REPLAY_WINDOW: Duration = Duration::from_secs(7 * 86_400);

fn from_file(v: &Option<String>, key: &str) -> anyhow::Result<Option<Duration>> {
    v.as_deref()
        .map(parse_duration)
        .transpose()
        .map_err(|e| anyhow::anyhow!("config file retention.{key}: {e}"))
}

/// Flags over the config file's `[retention]` over the defaults.
fn settings(a: &PurgeArgs, file: &FileConfig) -> anyhow::Result<PurgeSettings> {
    let replay_window = match a.replay_window {
        Some(d) => d,
        None => from_file(&file.retention.replay_window, "replay_window")?
            .unwrap_or(DEFAULT_REPLAY_WINDOW),
    };
    let inbox_retention = match a.inbox_retention {
        Some(d) => d,
        None => {
            from_file(&file.retention.inbox_retention, "inbox_retention")?.unwrap_or(replay_window)
        }
    };
    let settings = PurgeSettings {
        replay_window,
        inbox_retention,
        batch_size: a.batch_size.or(file.retention.batch_size).unwrap_or(1000),
        max_batches: a.max_batches,
        dry_run: a.dry_run,
    };
    settings.validate()?;
    Ok(settings)
}

/// Starts the background purge of `outboxd run` when its config file sets
/// `[retention] purge_interval`; otherwise does nothing. Settings are read (and validated)
/// now, so a bad value stops the relay at start rather than failing silently later. A failed
/// purge is logged and tried again at the next interval; it never stops the relay. A role that
/// cannot purge stops it at start too, with the GRANT statements: otherwise it would log
/// `permission denied` at every interval while `outboxd check` said nothing (issue 34).
pub async fn spawn_schedule(config: Option<&Path>, database_url: &str) -> anyhow::Result<()> {
    let Some(path) = config else {
        return Ok(());
    };
    let file = FileConfig::load(path)?;
    let Some(interval) = from_file(&file.retention.purge_interval, "purge_interval")? else {
        return Ok(());
    };
    if interval < Duration::from_millis(100) {
        anyhow::bail!("config file retention.purge_interval must be at least 100ms");
    }
    let args = PurgeArgs {
        database_url: None,
        config: None,
        replay_window: None,
        inbox_retention: None,
        batch_size: None,
        max_batches: None,
        dry_run: false,
        json: false,
    };
    let settings = settings(&args, &file)?;
    let url = database_url.to_string();
    let missing = outbox_ledger::privileges::missing(
        &crate::connect(&url).await?,
        outbox_ledger::privileges::PURGE,
    )
    .await?;
    if !missing.is_empty() {
        anyhow::bail!(
            "config file retention.purge_interval is set, but the relay's role cannot purge: {}; grant them, or remove purge_interval and let an operator run `outboxd purge` (as a role granted outboxd_operator: docs/operator_role.sql)",
            missing.join("; ")
        );
    }
    tracing::info!(
        interval = %show_duration(interval),
        replay_window = %show_duration(settings.replay_window),
        inbox_retention = %show_duration(settings.inbox_retention),
        "background purge scheduled"
    );
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let result = async {
                let client = crate::connect(&url).await?;
                retention::purge(&client, &settings)
                    .await
                    .map_err(anyhow::Error::from)
            }
            .await;
            match result {
                Ok(r) if r.events > 0 || r.inbox_rows > 0 || r.marked_retained > 0 => {
                    tracing::info!(
                        retained = r.marked_retained,
                        purged_events = r.events,
                        purged_inbox_rows = r.inbox_rows,
                        kept_awaiting_consumers = r.kept_awaiting_consumers,
                        "background purge"
                    )
                }
                Ok(_) => tracing::debug!("background purge: nothing to do"),
                Err(e) => tracing::warn!(
                    error = %crate::one_line(&e),
                    "background purge failed; trying again at the next interval"
                ),
            }
        }
    });
    Ok(())
}

pub async fn run(a: PurgeArgs) -> anyhow::Result<()> {
    let file = match &a.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let url = a
        .database_url
        .clone()
        .or_else(|| file.database_url.as_ref().map(|s| s.expose().to_string()))
        .context("database URL is missing: pass --database-url, set OUTBOXD_DATABASE_URL, or set database_url in the config file")?;
    let settings = settings(&a, &file)?;
    let (replay_window, inbox_retention) = (settings.replay_window, settings.inbox_retention);
    let client = crate::connect(&url).await?;
    let report = retention::purge(&client, &settings)
        .await
        .context("purge")?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "replay_window": show_duration(replay_window),
                "inbox_retention": show_duration(inbox_retention),
                "report": report,
            }))?
        );
    } else {
        print_report(&report, replay_window, inbox_retention);
    }
    Ok(())
}

fn print_report(r: &PurgeReport, window: Duration, inbox: Duration) {
    let verb = if r.dry_run { "would " } else { "" };
    if r.dry_run {
        println!("dry run: nothing was changed");
    }
    println!(
        "replay window {}, inbox retention {}",
        show_duration(window),
        show_duration(inbox)
    );
    println!(
        "{verb}mark RETAINED       {:>10}  (published, covered by every mandatory consumer)",
        r.marked_retained
    );
    println!(
        "{verb}purge events        {:>10}  (tombstones kept in outbox.purged_events)",
        r.events
    );
    println!("{verb}purge receipts      {:>10}", r.receipts);
    println!("{verb}purge duplicates    {:>10}", r.duplicate_receipts);
    println!("{verb}purge attempts      {:>10}", r.attempts);
    println!("{verb}purge inbox rows    {:>10}", r.inbox_rows);
    if !r.dry_run {
        println!(
            "acceptance batches  {:>10}  (outbox.receipt_batches left without receipts)",
            r.receipt_batches
        );
        println!("batches             {:>10}", r.batches);
    }
    println!(
        "kept: inside window {:>10}  awaiting mandatory consumers {}  relay checkpoint not past them {}",
        r.kept_inside_window, r.kept_awaiting_consumers, r.kept_relay_may_replay
    );
    if r.stopped_early {
        println!("stopped after --max-batches; run again to continue");
    }
}
