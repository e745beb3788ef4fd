//! The operator's commands that read or change the ledger by hand: `status`, `quarantine`,
//! `share`, `consumers`, and the Debezium capture `migrate --debezium-table` installs. Each one
//! prints for a person (or JSON) and records who acted where the ledger keeps it; the rules they
//! apply live in `outbox-ledger` (holds, consumers, status) and `share`.

use crate::cli::{self, QuarantineCommand};
use crate::{config, connect};

pub async fn share(cmd: cli::ShareCommand) -> anyhow::Result<()> {
    use crate::poller_share::{self as share, Target};
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

pub async fn consumers(cmd: cli::ConsumersCommand) -> anyhow::Result<()> {
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

/// Installs the Debezium-compatible capture trigger on `table` (migration 0009).
pub async fn install_debezium(url: &str, table: &str) -> anyhow::Result<()> {
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

pub async fn event_status(url: &str, id: uuid::Uuid) -> anyhow::Result<()> {
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

pub async fn status(url: &str, json: bool) -> anyhow::Result<()> {
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

/// Who acts, as the ledger records it: `--by`, else `$USER`, else `operator`.
pub fn operator_name(by: Option<String>) -> String {
    by.or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "operator".into())
}

pub async fn quarantine(cmd: QuarantineCommand) -> anyhow::Result<()> {
    use outbox_ledger::holds::{self, Resolution};
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
            // By reason first: one cause fixed (a broker limit raised, a relay started) is
            // released with `release --reason-code`.
            let reasons = holds::open_reasons(&client).await?;
            if !reasons.is_empty() {
                let by: Vec<String> = reasons.iter().map(|(c, n)| format!("{c} {n}")).collect();
                println!("  by reason: {}", by.join(", "));
            }
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
            db,
            event: None,
            reason_code: Some(code),
            dry_run,
            by,
        } => {
            let by = operator_name(by);
            by_reason(&db, &code, Resolution::Release, &by, None, dry_run).await
        }
        QuarantineCommand::Release {
            db,
            event: Some(event),
            dry_run,
            by,
            ..
        } => {
            if dry_run {
                anyhow::bail!("--dry-run goes with --reason-code; `outboxd status --event {event}` shows what one event's release would publish");
            }
            let mut client = connect(&db.url()?).await?;
            holds::resolve(
                &mut client,
                event,
                Resolution::Release,
                &operator_name(by),
                None,
            )
            .await?;
            println!("released {event}; the running relay publishes it and its held events in version order");
            Ok(())
        }
        QuarantineCommand::Release { .. } => {
            anyhow::bail!("quarantine release needs --event ID or --reason-code CODE")
        }
        QuarantineCommand::Skip { reason, .. } if reason.trim().is_empty() => {
            anyhow::bail!(
                "--reason must say why the event may be dropped; it is recorded in the ledger"
            )
        }
        QuarantineCommand::Skip {
            db,
            event: None,
            reason_code: Some(code),
            dry_run,
            reason,
            by,
        } => {
            let by = operator_name(by);
            by_reason(&db, &code, Resolution::Skip, &by, Some(&reason), dry_run).await
        }
        QuarantineCommand::Skip {
            db,
            event: Some(event),
            dry_run,
            reason,
            by,
            ..
        } => {
            if dry_run {
                anyhow::bail!("--dry-run goes with --reason-code; `outboxd status --event {event}` shows the event and what waits behind it");
            }
            let mut client = connect(&db.url()?).await?;
            holds::resolve(
                &mut client,
                event,
                Resolution::Skip,
                &operator_name(by),
                Some(&reason),
            )
            .await?;
            println!("skipped {event} (reason recorded); the running relay publishes the held events behind it");
            Ok(())
        }
        QuarantineCommand::Skip { .. } => {
            anyhow::bail!("quarantine skip needs --event ID or --reason-code CODE")
        }
    }
}

/// `quarantine release|skip --reason-code CODE`: every open record of one reason, in one
/// transaction (`outbox_ledger::holds::resolve_by_reason`), or with `dry_run` what would be.
async fn by_reason(
    db: &crate::cli::DbArgs,
    code: &str,
    resolution: outbox_ledger::holds::Resolution,
    by: &str,
    note: Option<&str>,
    dry_run: bool,
) -> anyhow::Result<()> {
    use outbox_ledger::holds::{self, Resolution};
    let mut client = connect(&db.url()?).await?;
    let (ids, held) =
        holds::resolve_by_reason(&mut client, code, resolution, by, note, dry_run).await?;
    if ids.is_empty() {
        let open = holds::open_reasons(&client).await?;
        let open = if open.is_empty() {
            "none is open".to_string()
        } else {
            let codes: Vec<String> = open.iter().map(|(c, n)| format!("{c} ({n})")).collect();
            format!("open ones: {}", codes.join(", "))
        };
        anyhow::bail!(
            "no open quarantine record with an event has reason code {code:?}; {open} (`outboxd quarantine list`)"
        );
    }
    for id in &ids {
        println!("  {id}");
    }
    let (verb, done, after) = match resolution {
        Resolution::Release => (
            "release",
            "released",
            "the running relay publishes each and its aggregate's held events in version order",
        ),
        Resolution::Skip => (
            "skip",
            "skipped",
            "none of them will ever be published (reason recorded); the running relay publishes the events held behind them in version order",
        ),
    };
    let n = ids.len();
    if dry_run {
        println!("would {verb} {n} event(s) of reason {code} and {held} hold(s) they block; nothing changed (run again without --dry-run)");
    } else {
        println!("{done} {n} event(s) of reason {code} and {held} hold(s) they block; {after}");
    }
    Ok(())
}
