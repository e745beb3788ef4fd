//! `outboxd check`: everything a relay needs, verified before it runs. Each problem is named
//! with its fix; the exit code is non-zero when anything would stop the relay.

use std::time::Duration;

use outbox_sink::{KafkaSink, KafkaSinkConfig};

use crate::cli::CheckArgs;
use crate::config::{self, redact_url, FileConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Ok,
    Warn,
    Fail,
}

struct Report {
    lines: Vec<(Level, String, String)>,
}

impl Report {
    fn add(&mut self, level: Level, what: impl Into<String>, detail: impl Into<String>) {
        self.lines.push((level, what.into(), detail.into()));
    }
    fn worst(&self) -> Level {
        self.lines.iter().map(|l| l.0).max().unwrap_or(Level::Ok)
    }
}

pub async fn run(a: CheckArgs) -> anyhow::Result<()> {
    let mut r = Report { lines: Vec::new() };
    let file = match &a.config {
        Some(p) => match FileConfig::load(p) {
            Ok(f) => {
                r.add(Level::Ok, "config file", p.display().to_string());
                f
            }
            Err(e) => {
                r.add(
                    Level::Fail,
                    "config file",
                    format!("{e:#}; fix the key or value it names"),
                );
                FileConfig::default()
            }
        },
        None => FileConfig::default(),
    };
    let url = a
        .database_url
        .clone()
        .or(file.database_url.as_ref().map(|s| s.expose().to_string()));
    let slot = a
        .slot
        .clone()
        .or(file.slot.clone())
        .unwrap_or_else(|| config::DEFAULT_SLOT.into());
    let publication = a
        .publication
        .clone()
        .or(file.publication.clone())
        .unwrap_or_else(|| config::DEFAULT_PUBLICATION.into());
    match url {
        None => r.add(
            Level::Fail,
            "database",
            "no URL: pass --database-url, set OUTBOXD_DATABASE_URL, or database_url in the config file",
        ),
        Some(url) => check_database(&mut r, &url, &slot, &publication).await,
    }
    let bootstrap = a
        .bootstrap_servers
        .clone()
        .or(file.kafka.bootstrap_servers.clone());
    let bootstrap_missing = bootstrap.is_none();
    if let Some(b) = bootstrap {
        check_broker(&mut r, &b, &file).await;
    }
    let nats_url = a.nats_url.clone().or(file.nats.url.clone());
    if let Some(u) = &nats_url {
        let stream = a
            .nats_stream
            .clone()
            .or(file.nats.stream.clone())
            .unwrap_or_else(|| outbox_sink::JetStreamSinkConfig::default().stream);
        check_nats(&mut r, u, &stream, &file).await;
    }
    if bootstrap_missing && nats_url.is_none() {
        r.add(
            Level::Warn,
            "broker",
            "not checked: pass --bootstrap-servers (Kafka) or --nats-url (JetStream) to check the broker",
        );
    }

    for (level, what, detail) in &r.lines {
        let tag = match level {
            Level::Ok => "ok  ",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        };
        println!("{tag}  {what:<28} {detail}");
    }
    match r.worst() {
        Level::Fail => anyhow::bail!(
            "{} problem(s) would stop the relay; see FAIL lines above",
            r.lines.iter().filter(|l| l.0 == Level::Fail).count()
        ),
        _ => Ok(()),
    }
}

async fn check_database(r: &mut Report, url: &str, slot: &str, publication: &str) {
    let client = match crate::connect(url).await {
        Ok(c) => {
            r.add(Level::Ok, "database connection", redact_url(url));
            c
        }
        Err(e) => {
            r.add(Level::Fail, "database connection", format!("{e:#}"));
            return;
        }
    };
    let one = |sql: &'static str| {
        let client = &client;
        async move { client.query_one(sql, &[]).await }
    };
    // The same checks `outboxd run` stops on, reported instead of raised.
    match outbox_source::slot::check_wal_level(&client).await {
        Ok(()) => r.add(Level::Ok, "wal_level", "logical"),
        Err(e) => r.add(Level::Fail, "wal_level", e.to_string()),
    }
    if let Ok(row) = one("SELECT current_setting('max_replication_slots')::int,
                (SELECT count(*) FROM pg_replication_slots)::int,
                current_setting('max_wal_senders')::int,
                (SELECT count(*) FROM pg_stat_replication)::int")
    .await
    {
        let (slots, used, senders, busy): (i32, i32, i32, i32) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let level = if used >= slots {
            Level::Warn
        } else {
            Level::Ok
        };
        r.add(level, "max_replication_slots", format!("{used} of {slots} in use (a new slot needs a free one; raise max_replication_slots and restart)"));
        let level = if busy >= senders {
            Level::Fail
        } else {
            Level::Ok
        };
        r.add(level, "max_wal_senders", format!("{busy} of {senders} in use (the relay needs one; raise max_wal_senders and restart)"));
    }
    match outbox_source::slot::check_replication_privilege(&client).await {
        Ok(()) => r.add(Level::Ok, "REPLICATION privilege", "granted"),
        Err(e) => r.add(Level::Fail, "REPLICATION privilege", e.to_string()),
    }
    let latest = outbox_ledger::migrate::MIGRATIONS
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap_or(0);
    match one("SELECT coalesce(max(version), 0) FROM outbox.schema_migrations").await {
        Ok(row) if row.get::<_, i32>(0) == latest => {
            r.add(Level::Ok, "schema outbox", format!("migration {latest}"))
        }
        Ok(row) => r.add(
            Level::Fail,
            "schema outbox",
            format!(
                "at migration {} of {latest}: run outboxd migrate --database-url ...",
                row.get::<_, i32>(0)
            ),
        ),
        Err(e) if e.code().map(|c| c.code()) == Some("42501") => r.add(
            Level::Fail,
            "schema outbox",
            "the role may not read it: GRANT USAGE ON SCHEMA outbox and the ledger tables to the relay's role",
        ),
        Err(_) => r.add(
            Level::Fail,
            "schema outbox",
            "not migrated: run outboxd migrate --database-url ...",
        ),
    }
    if let Ok(row) = one("SELECT has_table_privilege('outbox.events', 'SELECT'),
                has_table_privilege('outbox.receipts', 'INSERT'),
                has_table_privilege('outbox.checkpoints', 'UPDATE'),
                has_table_privilege('outbox.relay_leases', 'UPDATE')")
    .await
    {
        let missing: Vec<&str> = [
            (0, "SELECT on outbox.events"),
            (1, "INSERT on outbox.receipts"),
            (2, "UPDATE on outbox.checkpoints"),
            (3, "UPDATE on outbox.relay_leases"),
        ]
        .iter()
        .filter(|(i, _)| !row.get::<_, bool>(*i))
        .map(|(_, n)| *n)
        .collect();
        if missing.is_empty() {
            r.add(Level::Ok, "ledger privileges", "read outbox, write ledger");
        } else {
            r.add(
                Level::Fail,
                "ledger privileges",
                format!(
                    "missing {}: GRANT them to the relay's role (see docs)",
                    missing.join(", ")
                ),
            );
        }
    }
    match client
        .query_opt(
            "SELECT pubinsert, puballtables OR EXISTS (SELECT 1 FROM pg_publication_tables t
                    WHERE t.pubname = p.pubname AND t.schemaname = 'outbox' AND t.tablename = 'events')
             FROM pg_publication p WHERE pubname = $1",
            &[&publication],
        )
        .await
    {
        Ok(Some(row)) if row.get::<_, bool>(0) && row.get::<_, bool>(1) => {
            r.add(Level::Ok, "publication", format!("{publication} publishes inserts of outbox.events"))
        }
        Ok(Some(_)) => r.add(
            Level::Fail,
            "publication",
            format!("{publication} does not publish inserts of outbox.events: ALTER PUBLICATION {publication} ADD TABLE outbox.events; SET (publish = 'insert')"),
        ),
        Ok(None) => r.add(
            Level::Warn,
            "publication",
            format!("{publication} does not exist; the relay creates it (needs ownership of outbox.events)"),
        ),
        Err(e) => r.add(Level::Fail, "publication", e.to_string()),
    }
    match client
        .query_opt(
            "SELECT s.wal_status, pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::int8,
                    current_setting('max_slot_wal_keep_size'), s.plugin
             FROM pg_replication_slots s WHERE s.slot_name = $1",
            &[&slot],
        )
        .await
    {
        Ok(None) => r.add(
            Level::Ok,
            "slot",
            format!("{slot} does not exist yet; the relay creates it"),
        ),
        Ok(Some(row)) => {
            let status: Option<String> = row.get(0);
            let retained: Option<i64> = row.get(1);
            let keep: String = row.get(2);
            let plugin: Option<String> = row.get(3);
            if plugin.as_deref() != Some("pgoutput") {
                r.add(
                    Level::Fail,
                    "slot",
                    format!("{slot} uses plugin {plugin:?}, not pgoutput: choose another --slot"),
                );
            } else if status.as_deref() == Some("lost") {
                r.add(
                    Level::Fail,
                    "slot",
                    format!(
                        "{slot} is invalidated (wal_status lost): run outboxd run --resnapshot"
                    ),
                );
            } else {
                r.add(
                    Level::Ok,
                    "slot",
                    format!(
                        "{slot} wal_status {}, retaining {} bytes of WAL",
                        status.unwrap_or_default(),
                        retained.unwrap_or(0)
                    ),
                );
            }
            if keep == "-1" {
                r.add(
                    Level::Warn,
                    "max_slot_wal_keep_size",
                    "unlimited: a stopped relay's slot can fill the disk; set a limit",
                );
            }
        }
        Err(e) => r.add(Level::Fail, "slot", e.to_string()),
    }
}

async fn check_broker(r: &mut Report, bootstrap: &str, file: &FileConfig) {
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let cfg = KafkaSinkConfig {
        bootstrap_servers: bootstrap.to_string(),
        properties: file.kafka.properties.clone().into_iter().collect(),
        ..KafkaSinkConfig::default()
    };
    match KafkaSink::new(cfg, tx) {
        Err(e) => r.add(Level::Fail, "kafka configuration", e.to_string()),
        Ok(sink) => {
            match tokio::task::block_in_place(|| sink.check_reachable(Duration::from_secs(10))) {
                Ok(n) => r.add(Level::Ok, "kafka", format!("{bootstrap}: {n} broker(s)")),
                Err(e) => r.add(Level::Fail, "kafka", e.to_string()),
            }
        }
    }
}

/// The JetStream part: server identity, JetStream enabled, the stream, and its duplicate window
/// against the relay's retry budget (re-sends later than the window are not deduplicated by
/// the broker; the ledger still records them as duplicates).
async fn check_nats(r: &mut Report, url: &str, stream: &str, file: &FileConfig) {
    let facts = match outbox_sink::jetstream::inspect(url, stream).await {
        Ok(f) => f,
        Err(e) => {
            r.add(Level::Fail, "nats", e.to_string());
            return;
        }
    };
    let cluster = file.nats.cluster_name.clone();
    match (&facts.server_identity, cluster) {
        (Some(id), Some(c)) if *id != c => r.add(
            Level::Fail,
            "nats server",
            format!(
                "{url} identifies as {id:?}, but nats.cluster_name is {c:?}: the relay refuses to publish events frozen for {c:?} there"
            ),
        ),
        (Some(id), _) => r.add(
            Level::Ok,
            "nats server",
            format!(
                "{url}: {id} (nats-server {}); the relay's --cluster-name must be {id:?}",
                facts.server_version
            ),
        ),
        (None, _) => r.add(
            Level::Warn,
            "nats server",
            format!(
                "{url} (nats-server {}) has no server or cluster name, so the relay cannot verify which cluster it publishes to: set server_name (-n) or a cluster name",
                facts.server_version
            ),
        ),
    }
    if !facts.jetstream {
        r.add(
            Level::Fail,
            "jetstream",
            "disabled on the server: start nats-server with -js (or a jetstream block in its config)",
        );
        return;
    }
    let Some(s) = facts.stream else {
        let level = if file.nats.create_stream == Some(true) {
            Level::Warn
        } else {
            Level::Fail
        };
        r.add(
            level,
            "jetstream stream",
            format!("{stream} does not exist: create it (nats stream add {stream} --subjects 'outbox.>') or run the relay with --nats-create-stream"),
        );
        return;
    };
    r.add(
        Level::Ok,
        "jetstream stream",
        format!(
            "{stream}: subjects {:?}, {} message(s)",
            s.subjects, s.messages
        ),
    );
    let ms = |v: Option<u64>, d: u64| Duration::from_millis(v.unwrap_or(d));
    let budget = config::retry_budget(
        ms(file.nats.ack_timeout_ms, 5_000),
        ms(file.relay.unknown_settle_ms, 5_000),
        ms(file.relay.lease_ttl_ms, 10_000),
    );
    if s.duplicate_window < budget {
        r.add(
            Level::Warn,
            "duplicate window",
            format!(
                "{} s is shorter than the relay's retry budget of {} s (ack timeout + unknown settle + lease TTL + {} s backoff): later re-sends are stored again (the ledger records them as duplicates, consumers dedupe by event id); raise the stream's duplicate_window (nats stream edit {stream} --dupe-window ...)",
                s.duplicate_window.as_secs_f64(),
                budget.as_secs_f64(),
                config::MAX_BACKOFF.as_secs()
            ),
        );
    } else {
        r.add(
            Level::Ok,
            "duplicate window",
            format!(
                "{} s covers the relay's retry budget of {} s",
                s.duplicate_window.as_secs_f64(),
                budget.as_secs_f64()
            ),
        );
    }
}
