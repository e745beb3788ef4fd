//! `outboxd check`: everything a relay needs, verified before it runs. Each problem is named
//! with its fix; the exit code is non-zero when anything would stop the relay.
//!
//! What is checked, in order: the config (file keys, values, Kafka properties, exactly as
//! `outboxd run` would resolve them), the database connection (including TLS), wal_level,
//! free replication slots and WAL senders, the REPLICATION attribute, the schema version, the
//! privileges on the outbox and on each ledger table, the publication, the slot (plugin,
//! database, wal_status, retained WAL against `max_slot_wal_keep_size`), the broker, and the
//! topics the pending events and known aggregate types route to.

use std::time::Duration;

use outbox_sink::{KafkaSink, KafkaSinkConfig};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use crate::cli::{CheckArgs, RunArgs};
use crate::config::{self, redact_url, FileConfig, RelayConfig};

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

/// Stand-in for a missing `--bootstrap-servers` while the rest of the config is validated.
const NO_BOOTSTRAP: &str = "bootstrap-servers-not-given:9092";

pub async fn run(a: CheckArgs) -> anyhow::Result<()> {
    let mut r = Report { lines: Vec::new() };
    let file = match &a.config {
        Some(p) => match FileConfig::load(p) {
            Ok(f) => Some(f),
            Err(e) => {
                r.add(
                    Level::Fail,
                    "config file",
                    format!("{e:#}; fix the key or value it names"),
                );
                None
            }
        },
        None => Some(FileConfig::default()),
    };
    // The config as `outboxd run` would resolve and validate it.
    let cfgs = match &file {
        Some(file) => resolve(&a, file, &mut r),
        None => None,
    };
    let file = file.unwrap_or_default();
    let cfg = cfgs.as_ref().map(|c| c[0].clone());
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
    let (schema, table) = cfg
        .as_ref()
        .map(|c| (c.schema.clone(), c.table.clone()))
        .unwrap_or_else(|| ("outbox".into(), "events".into()));
    let mut db = None;
    let poll = a.mode.or(file.relay.mode) == Some(crate::values::RunMode::Poll);
    let purge = file.retention.purge_interval.is_some();
    match url {
        // `[[databases]]`: each entry, with its own slot, publication and table.
        None if !file.databases.is_empty() => {
            for c in cfgs.iter().flatten() {
                r.add(Level::Ok, "database", format!("[[databases]] entry {}", c.database));
                let client = check_database(
                    &mut r,
                    c.database_url.expose(),
                    &c.slot,
                    &c.publication,
                    &c.schema,
                    &c.table,
                    Uses { poll, purge },
                )
                .await;
                db = db.or(client);
            }
        }
        None => r.add(
            Level::Fail,
            "database",
            "no URL: pass --database-url, set OUTBOXD_DATABASE_URL, or database_url in the config file",
        ),
        Some(url) => {
            db = check_database(
                &mut r,
                &url,
                &slot,
                &publication,
                &schema,
                &table,
                Uses { poll, purge },
            )
            .await;
        }
    }
    let bootstrap = a
        .bootstrap_servers
        .clone()
        .or(file.kafka.bootstrap_servers.clone());
    let nats_url = a.nats_url.clone().or(file.nats.url.clone());
    match (bootstrap, &cfg) {
        (Some(b), Some(cfg)) => {
            let sink = KafkaSinkConfig {
                bootstrap_servers: b,
                ..cfg.sink.clone()
            };
            check_broker(&mut r, &sink, db.as_ref()).await;
            if cfg.delivery == crate::values::Delivery::ExactlyOnce {
                check_transactions(&mut r, &sink, &cfg.positions_topic, &cfg.slot);
            }
        }
        (Some(_), None) => r.add(
            Level::Warn,
            "kafka",
            "not checked: fix the configuration first",
        ),
        (None, Some(cfg)) if !cfg.http.is_empty() => {
            for h in &cfg.http {
                check_http_endpoint(&mut r, h);
            }
        }
        (None, _) if nats_url.is_none() => r.add(
            Level::Warn,
            "broker",
            "not checked: pass --bootstrap-servers (Kafka) or --nats-url (JetStream) to check the broker and the topics",
        ),
        (None, _) => {}
    }
    if let Some(u) = &nats_url {
        let stream = a
            .nats_stream
            .clone()
            .or(file.nats.stream.clone())
            .unwrap_or_else(|| outbox_sink::JetStreamSinkConfig::default().stream);
        match crate::config::resolve_nats_auth(&a.nats_auth, &file.nats, u) {
            Ok(auth) => check_nats(&mut r, u, &auth, &stream, &file).await,
            Err(e) => r.add(Level::Fail, "nats", e.to_string()),
        }
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

/// Resolves flags + file exactly as `outboxd run` does and reports what `validate` refuses.
/// A missing URL or bootstrap list is reported by its own line, not here.
fn resolve(a: &CheckArgs, file: &FileConfig, r: &mut Report) -> Option<Vec<RelayConfig>> {
    let has_bootstrap = a.bootstrap_servers.is_some() || file.kafka.bootstrap_servers.is_some();
    let has_url =
        a.database_url.is_some() || file.database_url.is_some() || !file.databases.is_empty();
    let args = RunArgs {
        database_url: a
            .database_url
            .clone()
            .or_else(|| (!has_url).then(|| "postgres://placeholder@localhost/db".into())),
        bootstrap_servers: a
            .bootstrap_servers
            .clone()
            .or_else(|| (!has_bootstrap).then(|| NO_BOOTSTRAP.into())),
        slot: a.slot.clone(),
        publication: a.publication.clone(),
        config: a.config.clone(),
        mode: a.mode,
        delivery: a.delivery,
        ..RunArgs::default()
    };
    let what = if a.config.is_some() {
        "config"
    } else {
        "settings"
    };
    let cfgs = match crate::resolve_runs(&args) {
        Ok(cfgs) => cfgs,
        Err(e) => {
            r.add(
                Level::Fail,
                what,
                format!(
                    "{}; fix it in the flags or the config file",
                    crate::one_line(&e)
                ),
            );
            return None;
        }
    };
    // librdkafka validates property names and values when a client is created; nothing is
    // sent until it is used.
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    match KafkaSink::new(cfgs[0].sink.clone(), tx) {
        Ok(_) => r.add(
            Level::Ok,
            what,
            match &a.config {
                Some(p) => format!("{} is valid", p.display()),
                None => "valid".to_string(),
            },
        ),
        Err(e) => {
            r.add(
                Level::Fail,
                "kafka properties",
                format!("{e}; see https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md"),
            );
            return None;
        }
    }
    Some(cfgs)
}

/// What the configuration uses, beyond the relay's basics: each adds what it needs to check.
#[derive(Debug, Clone, Copy)]
struct Uses {
    /// `--mode poll`: no slot, no REPLICATION.
    poll: bool,
    /// `[retention] purge_interval`: the relay purges, so its role needs the purge's grants.
    purge: bool,
}

async fn check_database(
    r: &mut Report,
    url: &str,
    slot: &str,
    publication: &str,
    schema: &str,
    table: &str,
    uses: Uses,
) -> Option<tokio_postgres::Client> {
    let Uses { poll, purge } = uses;
    let client = match crate::connect(url).await {
        Ok(c) => {
            r.add(Level::Ok, "database connection", redact_url(url));
            check_tls(r, &c, url).await;
            c
        }
        Err(e) => {
            r.add(Level::Fail, "database connection", format!("{e:#}"));
            return None;
        }
    };
    let one = |sql: &'static str| {
        let client = &client;
        async move { client.query_one(sql, &[]).await }
    };
    if poll {
        r.add(
            Level::Ok,
            "mode",
            "poll: no slot; wal_level, replication slots, WAL senders, REPLICATION and the publication are not needed",
        );
    } else {
        check_replication(r, &client, slot).await;
    }
    let latest = outbox_ledger::migrate::latest();
    let mut schema_ok = false;
    match one("SELECT coalesce(max(version), 0) FROM outbox.schema_migrations").await {
        Ok(row) if row.get::<_, i32>(0) == latest => {
            schema_ok = true;
            r.add(Level::Ok, "schema outbox", format!("migration {latest}"))
        }
        Ok(row) => r.add(
            Level::Fail,
            "schema outbox",
            format!(
                "at migration {} of {latest}: run outboxd migrate --database-url ... (as the schema owner)",
                row.get::<_, i32>(0)
            ),
        ),
        Err(e) if e.code().map(|c| c.code()) == Some("42501") => r.add(
            Level::Fail,
            "schema outbox",
            "the role may not read it: run docs/least_privilege.sql as a superuser (GRANT USAGE ON SCHEMA outbox, SELECT on the outbox, write on the ledger tables)",
        ),
        Err(_) => r.add(
            Level::Fail,
            "schema outbox",
            "not migrated: run outboxd migrate --database-url ...",
        ),
    }
    if schema_ok {
        check_privileges(r, &client, schema, table, purge).await;
        check_frozen_destinations(r, &client).await;
        check_versions_intact(r, &client, poll).await;
        check_plain_inserts(r, &client, poll).await;
    }
    if !poll {
        check_publication(r, &client, publication, schema, table).await;
        check_route_versions_published(r, &client, publication, "route_versions").await;
        check_route_versions_published(r, &client, publication, "policy_generations").await;
        check_slot(r, &client, slot).await;
    }
    Some(client)
}

/// Whether the outbox takes the writer's plain INSERT (`outbox.allow_plain_inserts`,
/// migration 0039): rows without a version, which only the stream can number. Poll mode
/// refuses such an outbox.
async fn check_plain_inserts(r: &mut Report, client: &tokio_postgres::Client, poll: bool) {
    let what = "plain inserts";
    match outbox_ledger::numbering::plain_inserts_allowed(client, "outbox.events").await {
        Ok(Some(true)) => {
            if poll {
                r.add(
                    Level::Fail,
                    what,
                    "outbox.events takes rows without a version (outbox.allow_plain_inserts(true)), which poll mode cannot find or order: run --mode cdc, or SELECT outbox.allow_plain_inserts(false) if no writer inserts plainly",
                )
            } else {
                r.add(
                    Level::Ok,
                    what,
                    "outbox.events takes plain INSERTs (preview): the relay numbers and routes them from the stream (docs/versions_by_relay.md)",
                )
            }
        }
        Ok(_) => {}
        Err(e) => r.add(Level::Fail, what, e.to_string()),
    }
}

/// `outbox.aggregate_versions` is unlogged (migration 0032): after a crash of the server, a
/// promoted standby or a restored base backup it is empty until a relay run restores it.
/// Writers stay correct meanwhile; poll mode cannot find pending events without it.
async fn check_versions_intact(r: &mut Report, client: &tokio_postgres::Client, poll: bool) {
    let what = "version table";
    let row = client
        .query_opt(
            "SELECT EXISTS (SELECT 1 FROM outbox.aggregate_versions_intact)
             WHERE to_regclass('outbox.aggregate_versions_intact') IS NOT NULL",
            &[],
        )
        .await;
    match row {
        // A database before migration 0032 (reported above).
        Ok(None) => {}
        Ok(Some(row)) if row.get::<_, bool>(0) => r.add(
            Level::Ok,
            what,
            "outbox.aggregate_versions has every aggregate's row",
        ),
        Ok(Some(_)) => r.add(
            if poll { Level::Fail } else { Level::Warn },
            what,
            format!(
                "outbox.aggregate_versions lost its rows (it is unlogged: a crash of the server, a promoted standby or a restored base backup); no version is given twice meanwhile, but {}: a relay restores it when its run starts, or run SELECT outbox.restore_aggregate_versions() as the schema owner",
                if poll {
                    "poll mode cannot find pending events without it"
                } else {
                    "writers of new aggregates read the outbox rows until it is restored"
                }
            ),
        ),
        // A relay's role need not read the mark (its restore runs with the owner's rights).
        Err(e) if e.code().map(|c| c.code()) == Some("42501") => {}
        Err(e) => r.add(Level::Fail, what, e.to_string()),
    }
}

/// Unpublished events whose destination was frozen before migration 0022 from a value its
/// encoding rules now encode differently or refuse (issue 31): named, with the way out.
async fn check_frozen_destinations(r: &mut Report, client: &tokio_postgres::Client) {
    const SHOWN: i32 = 20;
    let rows = match client
        .query(
            "SELECT event_id::text, frozen, rendered, reason FROM outbox.destinations_breaking_rules($1)",
            &[&SHOWN],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => {
            r.add(
                Level::Warn,
                "frozen destinations",
                format!("could not be checked: {}", outbox_ledger::describe_db_error(&e)),
            );
            return;
        }
    };
    if rows.is_empty() {
        r.add(
            Level::Ok,
            "frozen destinations",
            "every unpublished event's destination follows the encoding rules (migration 0022)",
        );
        return;
    }
    let list: Vec<String> = rows
        .iter()
        .map(|row| {
            let (id, frozen, rendered, reason): (String, String, Option<String>, String) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            match rendered {
                Some(now) => format!(
                    "{id} frozen for {} (the rules give {})",
                    redact_url(&frozen),
                    redact_url(&now)
                ),
                None => format!("{id} frozen for {} ({reason})", redact_url(&frozen)),
            }
        })
        .collect();
    r.add(
        Level::Warn,
        "frozen destinations",
        format!(
            "{}{} unpublished event(s) frozen before migration 0022 for a destination its encoding rules would not give them (a value pasted into a URL, subject or topic as it was): {}; a relay sends each where it was frozen unless it is moved first: outboxd migrate-destination --event ID --kind KIND --cluster CLUSTER --topic DESTINATION (it needs proof the old destination never took the event: a scan of the old Kafka cluster, or a quarantine before sending); docs/security.md, \"Destination templates\"",
            if rows.len() as i32 >= SHOWN { "at least " } else { "" },
            rows.len(),
            list.join("; ")
        ),
    );
}

/// CDC mode's server settings: wal_level, a free slot and WAL sender, REPLICATION.
async fn check_replication(r: &mut Report, client: &tokio_postgres::Client, slot: &str) {
    // The same checks `outboxd run` stops on, reported instead of raised.
    match outbox_source::slot::check_wal_level(client).await {
        Ok(()) => r.add(Level::Ok, "wal_level", "logical"),
        Err(e) => r.add(Level::Fail, "wal_level", e.to_string()),
    }
    if let Ok(row) = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int,
                    (SELECT count(*) FROM pg_replication_slots)::int,
                    current_setting('max_wal_senders')::int,
                    (SELECT count(*) FROM pg_stat_replication)::int,
                    EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            &[&slot],
        )
        .await
    {
        let (slots, used, senders, busy, ours): (i32, i32, i32, i32, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        let (level, note) = if ours {
            (Level::Ok, "slot exists")
        } else if used >= slots {
            (Level::Fail, "none free for the new slot")
        } else {
            (Level::Ok, "one is free for the new slot")
        };
        r.add(
            level,
            "max_replication_slots",
            format!("{used} of {slots} in use, {note}{}", if level == Level::Fail {
                "; raise max_replication_slots (ALTER SYSTEM SET max_replication_slots = ...) and restart PostgreSQL, or drop an unused slot (pg_drop_replication_slot)"
            } else { "" }),
        );
        let level = if busy >= senders {
            Level::Fail
        } else {
            Level::Ok
        };
        r.add(
            level,
            "max_wal_senders",
            format!("{busy} of {senders} in use{}", if level == Level::Fail {
                "; the relay needs one: raise max_wal_senders (ALTER SYSTEM SET max_wal_senders = ...) and restart PostgreSQL"
            } else { "" }),
        );
    }
    match outbox_source::slot::check_replication_privilege(client).await {
        Ok(()) => r.add(Level::Ok, "REPLICATION privilege", "granted"),
        Err(e) => r.add(Level::Fail, "REPLICATION privilege", e.to_string()),
    }
}

/// Whether the session is encrypted, and how the server is verified. Plain text to a
/// non-loopback host is a warning: the relay's role has REPLICATION.
async fn check_tls(r: &mut Report, client: &tokio_postgres::Client, url: &str) {
    let Ok(opts) = outbox_source::tls::PgConnectOptions::parse(url) else {
        return;
    };
    let ssl = client
        .query_one(
            "SELECT coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false)",
            &[],
        )
        .await
        .map(|row| row.get::<_, bool>(0))
        .unwrap_or(false);
    let loopback = opts.config.get_hosts().iter().all(|h| match h {
        tokio_postgres::config::Host::Tcp(h) => {
            h == "localhost"
                || h.parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        }
        #[cfg(unix)]
        tokio_postgres::config::Host::Unix(_) => true,
    });
    let mode = opts.tls.mode.as_str();
    match (ssl, opts.tls.mode) {
        (true, outbox_source::tls::SslMode::VerifyFull) => {
            r.add(Level::Ok, "database TLS", "encrypted, server certificate and host name verified")
        }
        (true, _) => r.add(
            Level::Warn,
            "database TLS",
            format!("encrypted, but sslmode={mode} does not verify the server's host name: use sslmode=verify-full&sslrootcert=CA.pem"),
        ),
        (false, _) if loopback => r.add(Level::Ok, "database TLS", "not used (loopback)"),
        (false, _) => r.add(
            Level::Warn,
            "database TLS",
            format!("not used (sslmode={mode}): the password and every event cross the network in plain text; enable ssl on the server and use sslmode=verify-full&sslrootcert=CA.pem (docs/security.md)"),
        ),
    }
}

/// SELECT on the outbox table; SELECT, INSERT, UPDATE, DELETE on each ledger table; USAGE on
/// the ledger sequences. The fix is the exact GRANT.
async fn check_privileges(
    r: &mut Report,
    client: &tokio_postgres::Client,
    schema: &str,
    table: &str,
    purge: bool,
) {
    let quoted = format!(
        "{}.{}",
        outbox_source::slot::quote_ident(schema),
        outbox_source::slot::quote_ident(table)
    );
    let outbox = format!("{schema}.{table}");
    match client
        .query_one(
            "SELECT has_table_privilege($1, 'SELECT'), current_user::text",
            &[&quoted],
        )
        .await
    {
        Ok(row) if row.get::<_, bool>(0) => r.add(
            Level::Ok,
            "outbox privileges",
            format!("SELECT on {outbox}"),
        ),
        Ok(row) => r.add(
            Level::Fail,
            "outbox privileges",
            format!(
                "missing SELECT on {outbox}: GRANT SELECT ON {outbox} TO {}",
                row.get::<_, String>(1)
            ),
        ),
        Err(e) => r.add(
            Level::Fail,
            "outbox privileges",
            format!(
                "{}: is the database migrated (`outboxd migrate --database-url ...` as the schema owner), and is --table right?",
                outbox_ledger::describe_db_error(&e)
            ),
        ),
    }
    use outbox_ledger::privileges::{PURGE, RELAY_LEDGER, RELAY_READS};
    let needs: Vec<_> = RELAY_LEDGER.iter().chain(RELAY_READS).copied().collect();
    report_grants(
        r,
        client,
        "ledger privileges",
        &needs,
        "read and write on every ledger table, read on the routes and versions",
        |missing| format!("the relay cannot write its ledger: {missing}; (or run docs/least_privilege.sql as a superuser; `outboxd run` refuses to start without these)"),
    )
    .await;
    if purge {
        report_grants(
            r,
            client,
            "purge privileges",
            PURGE,
            "[retention] purge_interval: the role may delete what a purge deletes",
            |missing| format!("[retention] purge_interval is set, but this role cannot purge: {missing}; (or leave purging to an operator's `outboxd purge`, as a role granted outboxd_operator: docs/operator_role.sql)"),
        )
        .await;
    }
}

/// One report line: ok, or FAIL with the GRANT statements the role lacks for `needs`.
async fn report_grants(
    r: &mut Report,
    client: &tokio_postgres::Client,
    what: &str,
    needs: &[outbox_ledger::privileges::Need],
    ok: &str,
    fail: impl Fn(&str) -> String,
) {
    match outbox_ledger::privileges::missing(client, needs).await {
        Ok(missing) if missing.is_empty() => r.add(Level::Ok, what, ok),
        Ok(missing) => r.add(Level::Fail, what, fail(&missing.join("; "))),
        Err(e) => r.add(Level::Fail, what, e.to_string()),
    }
}

async fn check_publication(
    r: &mut Report,
    client: &tokio_postgres::Client,
    publication: &str,
    schema: &str,
    table: &str,
) {
    match client
        .query_opt(
            "SELECT p.pubinsert, p.puballtables OR EXISTS (SELECT 1 FROM pg_publication_tables t
                    WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3),
                    p.pubupdate OR p.pubdelete
             FROM pg_publication p WHERE p.pubname = $1",
            &[&publication, &schema, &table],
        )
        .await
    {
        Ok(Some(row)) if row.get::<_, bool>(0) && row.get::<_, bool>(1) => {
            if row.get::<_, bool>(2) {
                r.add(
                    Level::Warn,
                    "publication",
                    format!("{publication} also publishes updates/deletes of {schema}.{table}: the relay ignores them, but a purge then costs WAL decoding; ALTER PUBLICATION {publication} SET (publish = 'insert')"),
                )
            } else {
                r.add(
                    Level::Ok,
                    "publication",
                    format!("{publication} publishes inserts of {schema}.{table}"),
                )
            }
        }
        Ok(Some(_)) => r.add(
            Level::Fail,
            "publication",
            format!("{publication} does not publish inserts of {schema}.{table}: ALTER PUBLICATION {publication} ADD TABLE {schema}.{table}; ALTER PUBLICATION {publication} SET (publish = 'insert')"),
        ),
        Ok(None) => {
            let owner = client
                .query_one(
                    "SELECT pg_has_role(current_user, c.relowner, 'USAGE')
                     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = $1 AND c.relname = $2",
                    &[&schema, &table],
                )
                .await
                .map(|row| row.get::<_, bool>(0))
                .unwrap_or(false);
            if owner {
                r.add(
                    Level::Warn,
                    "publication",
                    format!("{publication} does not exist; the relay creates it (inserts of {schema}.{table})"),
                )
            } else {
                r.add(
                    Level::Fail,
                    "publication",
                    format!("{publication} does not exist and this role cannot create it (it does not own {schema}.{table}): run `outboxd migrate --database-url ...` as the schema owner (it creates the publication), or as the owner CREATE PUBLICATION {publication} FOR TABLE {schema}.{table} WITH (publish = 'insert')"),
                )
            }
        }
        Err(e) => r.add(Level::Fail, "publication", e.to_string()),
    }
}

/// A narrow row names a route version (migration 0031), a row written without a route is
/// routed by the policy generation in force (0038); the relay learns those made after its
/// start from its publication, and adds `outbox.route_versions` and
/// `outbox.policy_generations` (`table`) to it at start when it can.
async fn check_route_versions_published(
    r: &mut Report,
    client: &tokio_postgres::Client,
    publication: &str,
    table: &str,
) {
    let what = format!("{} published", table.replace('_', " "));
    let row = client
        .query_opt(
            "SELECT p.puballtables OR EXISTS (SELECT 1 FROM pg_publication_tables t
                        WHERE t.pubname = p.pubname AND t.schemaname = 'outbox'
                          AND t.tablename = $2),
                    pg_has_role(current_user, p.pubowner, 'USAGE')
             FROM pg_publication p
             WHERE p.pubname = $1 AND to_regclass('outbox.' || $2) IS NOT NULL",
            &[&publication, &table],
        )
        .await;
    match row {
        // No publication yet (reported above), or a database before the table's migration.
        Ok(None) => {}
        Ok(Some(row)) if row.get::<_, bool>(0) => r.add(
            Level::Ok,
            what,
            format!("{publication} carries outbox.{table}"),
        ),
        Ok(Some(row)) if row.get::<_, bool>(1) => r.add(
            Level::Warn,
            what,
            format!("{publication} does not carry outbox.{table}; the relay adds it at start (rows made while it runs reach it through the publication)"),
        ),
        Ok(Some(_)) => r.add(
            Level::Fail,
            what,
            format!("{publication} does not carry outbox.{table} and this role does not own it, so the relay cannot add it: as its owner, ALTER PUBLICATION {publication} ADD TABLE outbox.{table}"),
        ),
        Err(e) => r.add(Level::Fail, what, e.to_string()),
    }
}

async fn check_slot(r: &mut Report, client: &tokio_postgres::Client, slot: &str) {
    let keep = client
        .query_one(
            "SELECT current_setting('max_slot_wal_keep_size'),
                    pg_size_bytes(current_setting('max_slot_wal_keep_size') ||
                        CASE WHEN current_setting('max_slot_wal_keep_size') ~ '^-?[0-9]+$' THEN 'MB' ELSE '' END)",
            &[],
        )
        .await
        .ok()
        .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1)));
    match client
        .query_opt(
            "SELECT s.wal_status, pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::int8,
                    s.plugin, s.slot_type, s.database = current_database(), s.database,
                    s.temporary
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
            let plugin: Option<String> = row.get(2);
            let slot_type: String = row.get(3);
            let here: Option<bool> = row.get(4);
            let database: Option<String> = row.get(5);
            let temporary: bool = row.get(6);
            if slot_type != "logical" || plugin.as_deref() != Some("pgoutput") {
                r.add(
                    Level::Fail,
                    "slot",
                    format!("{slot} is a {slot_type} slot with plugin {}, not a pgoutput logical slot: choose another --slot, or drop it (SELECT pg_drop_replication_slot('{slot}')) if it is unused", plugin.as_deref().unwrap_or("none")),
                );
            } else if here != Some(true) {
                r.add(
                    Level::Fail,
                    "slot",
                    format!("{slot} belongs to database {}, not this one: choose another --slot or connect to that database", database.unwrap_or_default()),
                );
            } else if temporary {
                r.add(
                    Level::Fail,
                    "slot",
                    format!("{slot} is a temporary slot of another session: choose another --slot"),
                );
            } else if status.as_deref() == Some("lost") {
                r.add(
                    Level::Fail,
                    "slot",
                    format!("{slot} is invalidated (wal_status lost, its WAL was removed): run outboxd run --resnapshot (recreates the slot and publishes every outbox row without a receipt)"),
                );
            } else if status.as_deref() == Some("unreserved") {
                r.add(
                    Level::Warn,
                    "slot",
                    format!("{slot} retains {} bytes, past max_slot_wal_keep_size (wal_status unreserved): it is invalidated at the next checkpoint unless the relay catches up now; start the relay or raise max_slot_wal_keep_size", retained.unwrap_or(0)),
                );
            } else {
                let retained = retained.unwrap_or(0);
                match keep {
                    Some((_, limit)) if limit > 0 && retained.saturating_mul(10) >= limit.saturating_mul(8) => r.add(
                        Level::Warn,
                        "slot",
                        format!("{slot} retains {retained} bytes of WAL, {}% of max_slot_wal_keep_size ({limit} bytes): at 100% PostgreSQL invalidates the slot; start the relay or raise the limit", retained.saturating_mul(100) / limit),
                    ),
                    _ => r.add(
                        Level::Ok,
                        "slot",
                        format!(
                            "{slot} wal_status {}, retaining {retained} bytes of WAL",
                            status.unwrap_or_default()
                        ),
                    ),
                }
            }
        }
        Err(e) => r.add(Level::Fail, "slot", e.to_string()),
    }
    match keep {
        Some((text, _)) if text == "-1" => r.add(
            Level::Warn,
            "max_slot_wal_keep_size",
            "unlimited: a stopped relay's slot retains WAL until the disk is full; set a limit (ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'; SELECT pg_reload_conf()) and alert on slot lag (docs/operations.md)",
        ),
        Some((text, limit)) => r.add(
            Level::Ok,
            "max_slot_wal_keep_size",
            format!("{text} ({limit} bytes)"),
        ),
        None => {}
    }
}

/// What can be checked of one HTTP endpoint before sending: its signing secrets (each named
/// by what a receiver verifies it with) and whether it declares an idempotency window.
fn check_http_endpoint(r: &mut Report, h: &outbox_sink::HttpSinkConfig) {
    r.add(
        Level::Ok,
        "http",
        format!(
            "endpoint {}: nothing to probe before sending (an endpoint has no metadata); its answers decide (docs/brokers.md)",
            h.endpoint
        ),
    );
    // Each signing secret: refused with its position, or named by what a receiver
    // verifies it with (the whpk_ public key of a whsk_ secret).
    for (i, secret) in h.signing_secrets.iter().enumerate() {
        match outbox_sink::http::signing_key(secret, i + 1) {
            Ok(k) => r.add(
                Level::Ok,
                "http signing",
                match k.public() {
                    Some(pk) => format!(
                        "endpoint {} secret #{}: v1a (ed25519); receivers verify with {pk}",
                        h.endpoint,
                        i + 1
                    ),
                    None => format!(
                        "endpoint {} secret #{}: v1 (HMAC-SHA256); receivers verify with the same whsec_ secret",
                        h.endpoint,
                        i + 1
                    ),
                },
            ),
            Err(e) => r.add(
                Level::Fail,
                "http signing",
                format!("endpoint {}: {e}", h.endpoint),
            ),
        }
    }
    if h.idempotency_window.is_none() {
        r.add(
            Level::Warn,
            "http idempotency",
            format!("endpoint {} declares no idempotency window (http.idempotency_window_ms): a retry of an UNKNOWN send is no proof of a single effect; make sure the endpoint deduplicates by its {} header", h.endpoint, h.idempotency_header),
        );
    }
}

async fn check_broker(r: &mut Report, sink: &KafkaSinkConfig, db: Option<&tokio_postgres::Client>) {
    let bootstrap = sink.bootstrap_servers.clone();
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    match KafkaSink::new(sink.clone(), tx) {
        Err(e) => r.add(Level::Fail, "kafka configuration", e.to_string()),
        Ok(s) => match tokio::task::block_in_place(|| s.check_reachable(Duration::from_secs(10))) {
            Ok(n) => r.add(Level::Ok, "kafka", format!("{bootstrap}: {n} broker(s)")),
            Err(e) => {
                r.add(Level::Fail, "kafka", e.to_string());
                return;
            }
        },
    }
    let Some(db) = db else { return };
    // The topics the relay will publish to: those of unpublished events for this cluster,
    // and those the routes give the aggregate types seen so far.
    let topics: Vec<String> = match db
        .query(
            "SELECT DISTINCT topic FROM (
                 (SELECT e.dest_topic AS topic FROM outbox.events_frozen e
                  WHERE e.dest_kind = 'kafka' AND e.dest_cluster = $1
                    AND NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)
                  LIMIT 10000)
                 UNION
                 (SELECT rr.topic FROM (SELECT aggregate_type FROM outbox.aggregate_versions
                                        GROUP BY aggregate_type LIMIT 1000) a,
                         LATERAL outbox.resolve_route(a.aggregate_type, '') rr
                  WHERE rr.kind = 'kafka' AND rr.cluster = $1)
             ) t ORDER BY 1 LIMIT 200",
            &[&sink.cluster_name],
        )
        .await
    {
        Ok(rows) => rows.iter().map(|row| row.get(0)).collect(),
        Err(_) => return, // reported by the schema / privilege lines
    };
    if topics.is_empty() {
        r.add(
            Level::Ok,
            "topics",
            "no pending events or known aggregate types yet",
        );
        return;
    }
    let limits = {
        let (sink, topics) = (sink.clone(), topics.clone());
        tokio::task::spawn_blocking(move || topic_size_limits(&sink, &topics)).await
    };
    if let Ok(limits) = limits {
        let producer = producer_max_bytes(sink);
        let below: Vec<&(String, i64)> = limits.iter().filter(|(_, l)| *l < producer).collect();
        if let Some(min) = below.iter().map(|(_, l)| *l).min() {
            let list: Vec<String> = below.iter().map(|(t, l)| format!("{t} ({l})")).collect();
            r.add(
                Level::Warn,
                "message size",
                format!("the producer builds record batches of up to message.max.bytes={producer} bytes, but these topics refuse batches over max.message.bytes: {}; the broker refuses a batch as a whole, so an event batched with a too-large one would be quarantined with it: pass --kafka-property message.max.bytes={min} (the smallest topic limit), so that librdkafka refuses a too-large event alone", list.join(", ")),
            );
        }
    }
    let all_topics = topics.clone();
    let config = sink.clone();
    let result = tokio::task::spawn_blocking(move || {
        missing_topics(&config, &topics).map(|(n, missing)| {
            let auto = if missing.is_empty() {
                None
            } else {
                broker_auto_create(&config)
            };
            (n, missing, auto)
        })
    })
    .await;
    // The topics that exist: whether the relay may read them is checked after.
    let existing: Vec<String> = match &result {
        Ok(Ok((_, missing, _))) => all_topics
            .into_iter()
            .filter(|t| !missing.contains(t))
            .collect(),
        _ => Vec::new(),
    };
    let create = "create them with the partition count you want (kafka-topics.sh --create --topic ... --partitions N)";
    match result {
        Ok(Ok((n, missing, _))) if missing.is_empty() => {
            r.add(Level::Ok, "topics", format!("all {n} exist"))
        }
        Ok(Ok((n, missing, auto))) => {
            let list = missing.join(", ");
            let m = missing.len();
            match auto {
                Some(true) => r.add(
                    Level::Warn,
                    "topics",
                    format!("{m} of {n} do not exist: {list}; the broker auto-creates them with its default partition count; better {create}"),
                ),
                Some(false) => r.add(
                    Level::Fail,
                    "topics",
                    format!("{m} of {n} do not exist and the broker does not auto-create topics (auto.create.topics.enable=false): {list}; {create}"),
                ),
                None => r.add(
                    Level::Warn,
                    "topics",
                    format!("{m} of {n} do not exist: {list}; the broker's auto.create.topics.enable could not be read; {create}, unless you know auto-creation is on"),
                ),
            }
        }
        Ok(Err(e)) => r.add(Level::Fail, "topics", e),
        Err(e) => r.add(Level::Fail, "topics", e.to_string()),
    }
    check_reads(r, sink, existing).await;
}

/// Whether the relay may read the topics it publishes to (a few of them, partition 0): an
/// UNKNOWN outcome is resolved by reading its partition, which needs READ and DESCRIBE on the
/// topic besides WRITE (`outbox_sink::probe_read`).
async fn check_reads(r: &mut Report, sink: &KafkaSinkConfig, topics: Vec<String>) {
    if topics.is_empty() {
        return;
    }
    let sink = sink.clone();
    let probed = tokio::task::spawn_blocking(move || {
        topics
            .into_iter()
            .take(3)
            .map(|t| {
                let read = outbox_sink::probe_read(&sink, &t, 0, Duration::from_secs(10));
                (t, read)
            })
            .collect::<Vec<_>>()
    })
    .await;
    let Ok(probed) = probed else { return };
    let mut read = Vec::new();
    let mut empty = Vec::new();
    for (topic, result) in probed {
        match result {
            Ok(true) => read.push(topic),
            Ok(false) => empty.push(topic),
            Err(e @ outbox_sink::SinkError::LookupDenied { .. }) => {
                r.add(Level::Fail, "reads", e.to_string())
            }
            Err(e) => r.add(
                Level::Warn,
                "reads",
                format!("could not read {topic} to prove that UNKNOWN look-ups can: {e}"),
            ),
        }
    }
    if !read.is_empty() {
        r.add(
            Level::Ok,
            "reads",
            format!(
                "the relay can read {} (UNKNOWN look-ups read the partition)",
                read.join(", ")
            ),
        );
    }
    if !empty.is_empty() {
        r.add(
            Level::Ok,
            "reads",
            format!(
                "{} empty: its offsets can be read; a message will prove READ once one is there",
                empty.join(", ")
            ),
        );
    }
}

/// A metadata/admin client config: the bootstrap list plus the security settings.
/// `--delivery exactly-once`: the brokers run a transaction (a producer opened under a check
/// id, which needs Kafka 2.5+, the transaction state log within its `min.isr` and the
/// TransactionalId ACLs, then a transaction begun and aborted), and the positions topic is
/// there, or the relay will create it at start.
fn check_transactions(r: &mut Report, sink: &KafkaSinkConfig, positions: &str, slot: &str) {
    use outbox_sink::kafka_txn::TxnSink;
    let id = format!("outboxd-check-{}-{slot}", sink.cluster_name);
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let ran = tokio::task::block_in_place(|| {
        let p = TxnSink::open(sink.clone(), &id, positions, tx, Duration::from_secs(15))?;
        p.begin()?;
        p.abort(Duration::from_secs(15))
    });
    match ran {
        Ok(()) => r.add(
            Level::Ok,
            "kafka transactions",
            format!("a transaction under {id} began and aborted"),
        ),
        Err(e) => r.add(Level::Fail, "kafka transactions", e.to_string()),
    }
    // What a failed transaction most often comes from, by name: a transaction state log that
    // needs more brokers than the cluster has up.
    match transaction_log_settings(sink) {
        Some((rf, min_isr, brokers)) => match transaction_log_verdict(rf, min_isr, brokers) {
            Ok(m) => r.add(Level::Ok, "transaction state log", m),
            Err(m) => r.add(Level::Fail, "transaction state log", m),
        },
        None => r.add(
            Level::Warn,
            "transaction state log",
            "cannot read the brokers' transaction.state.log.* settings (DescribeConfigs on a broker needs DESCRIBE_CONFIGS on the cluster); the transaction above is the proof".to_string(),
        ),
    }
    let consumer: Result<BaseConsumer, _> = metadata_config(sink).create();
    let present = consumer.ok().and_then(|c| {
        c.fetch_metadata(Some(positions), Duration::from_secs(10))
            .ok()
            .map(|m| {
                m.topics()
                    .iter()
                    .any(|t| t.error().is_none() && !t.partitions().is_empty())
            })
    });
    match present {
        Some(true) => r.add(Level::Ok, "positions topic", positions.to_string()),
        _ => r.add(
            Level::Warn,
            "positions topic",
            format!("{positions} is missing: the relay creates it at start (one partition), which needs CREATE on the cluster or the topic; or create it yourself"),
        ),
    }
}

fn metadata_config(sink: &KafkaSinkConfig) -> ClientConfig {
    let mut cc = ClientConfig::new();
    for (k, v) in &sink.properties {
        if k.starts_with("security.") || k.starts_with("sasl.") || k.starts_with("ssl.") {
            cc.set(k, v);
        }
    }
    cc.set("bootstrap.servers", &sink.bootstrap_servers);
    cc
}

/// Which of `topics` the cluster does not have. Uses a metadata request that does not
/// auto-create anything (`allow.auto.create.topics=false`).
fn missing_topics(
    sink: &KafkaSinkConfig,
    topics: &[String],
) -> Result<(usize, Vec<String>), String> {
    let consumer: BaseConsumer = metadata_config(sink)
        .set("allow.auto.create.topics", "false")
        .create()
        .map_err(|e| format!("cannot create a metadata client: {e}"))?;
    let mut missing = Vec::new();
    for t in topics {
        let md = consumer
            .fetch_metadata(Some(t), Duration::from_secs(10))
            .map_err(|e| format!("reading metadata of topic {t}: {e}"))?;
        let exists = md
            .topics()
            .iter()
            .any(|mt| mt.name() == t && mt.error().is_none() && !mt.partitions().is_empty());
        if !exists {
            missing.push(t.clone());
        }
    }
    Ok((topics.len(), missing))
}

/// librdkafka's `message.max.bytes` as the relay sets it (its default: 1,000,000).
fn producer_max_bytes(sink: &KafkaSinkConfig) -> i64 {
    sink.properties
        .iter()
        .rev()
        .find(|(k, _)| k == "message.max.bytes")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(1_000_000)
}

/// Each existing topic's `max.message.bytes` (DescribeConfigs); topics it cannot read are left
/// out (their existence is checked separately).
fn topic_size_limits(sink: &KafkaSinkConfig, topics: &[String]) -> Vec<(String, i64)> {
    use rdkafka::admin::ResourceSpecifier;
    let specs: Vec<ResourceSpecifier> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let Some(res) = admin_client(sink).and_then(|a| describe_configs(&a, &specs)) else {
        return Vec::new();
    };
    res.into_iter()
        .zip(topics)
        .filter_map(|(r, t)| {
            let r = r.ok()?;
            let v = r.get("max.message.bytes")?.value.as_deref()?.parse().ok()?;
            Some((t.clone(), v))
        })
        .collect()
}

/// An admin client with the relay's connection settings (`None` if librdkafka refuses them;
/// the producer check reports that).
fn admin_client(
    sink: &KafkaSinkConfig,
) -> Option<rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>> {
    metadata_config(sink).create().ok()
}

/// DescribeConfigs of `specs`, one result per specifier in order (blocking, 10 s timeout);
/// `None` if the request fails as a whole.
fn describe_configs(
    admin: &rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>,
    specs: &[rdkafka::admin::ResourceSpecifier<'_>],
) -> Option<Vec<rdkafka::admin::ConfigResourceResult>> {
    let opts = rdkafka::admin::AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    futures::executor::block_on(admin.describe_configs(specs, &opts)).ok()
}

/// The configuration of the first broker the metadata lists (DescribeConfigs), and how many
/// brokers it lists; `None` if either is unreadable.
fn broker_config(sink: &KafkaSinkConfig) -> Option<(rdkafka::admin::ConfigResource, usize)> {
    use rdkafka::admin::ResourceSpecifier;
    let admin = admin_client(sink)?;
    let md = admin
        .inner()
        .fetch_metadata(None, Duration::from_secs(10))
        .ok()?;
    let broker = md.brokers().first()?.id();
    let res = describe_configs(&admin, &[ResourceSpecifier::Broker(broker)])?;
    Some((res.into_iter().next()?.ok()?, md.brokers().len()))
}

/// A broker's `transaction.state.log.replication.factor` and `transaction.state.log.min.isr`,
/// and how many brokers are up; `None` if unreadable.
fn transaction_log_settings(sink: &KafkaSinkConfig) -> Option<(i64, i64, usize)> {
    let (resource, brokers) = broker_config(sink)?;
    let setting =
        |name: &str| -> Option<i64> { resource.get(name)?.value.as_deref()?.parse().ok() };
    Some((
        setting("transaction.state.log.replication.factor")?,
        setting("transaction.state.log.min.isr")?,
        brokers,
    ))
}

/// Whether the transaction state log can be written with `brokers` up: its replication factor
/// (needed when the log is first created) and its `min.isr` (needed by every commit) must not
/// exceed them. The message names the setting to lower, or says what holds.
fn transaction_log_verdict(rf: i64, min_isr: i64, brokers: usize) -> Result<String, String> {
    let up = brokers as i64;
    if rf > up {
        return Err(format!(
            "transaction.state.log.replication.factor is {rf} and {up} broker(s) are up: the broker cannot create its transaction state log and no transaction can begin; lower it to at most {up} (or start more brokers)"
        ));
    }
    if min_isr > up {
        return Err(format!(
            "transaction.state.log.min.isr is {min_isr} and {up} broker(s) are up: no transaction can commit; lower it to at most {up} (or start more brokers)"
        ));
    }
    Ok(format!(
        "replication factor {rf}, min.isr {min_isr}, {up} broker(s) up (a commit needs {min_isr} in sync)"
    ))
}

/// The broker's `auto.create.topics.enable`, if it can be read (DescribeConfigs).
fn broker_auto_create(sink: &KafkaSinkConfig) -> Option<bool> {
    let (resource, _) = broker_config(sink)?;
    let value = resource
        .get("auto.create.topics.enable")?
        .value
        .as_deref()?;
    Some(value == "true")
}

/// The JetStream part: server identity, JetStream enabled, the stream, and its duplicate window
/// against the relay's retry budget (re-sends later than the window are not deduplicated by
/// the broker; the ledger still records them as duplicates).
async fn check_nats(
    r: &mut Report,
    url: &str,
    auth: &outbox_sink::NatsAuth,
    stream: &str,
    file: &FileConfig,
) {
    let facts = match outbox_sink::jetstream::inspect(url, auth, stream).await {
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

#[cfg(test)]
mod tests {
    use super::transaction_log_verdict;

    #[test]
    fn a_transaction_log_that_needs_more_brokers_than_are_up_is_named() {
        assert!(transaction_log_verdict(1, 1, 1).is_ok());
        assert!(transaction_log_verdict(3, 2, 3).is_ok());
        let e = transaction_log_verdict(3, 2, 1).unwrap_err();
        assert!(
            e.contains("transaction.state.log.replication.factor is 3") && e.contains("at most 1"),
            "{e}"
        );
        let e = transaction_log_verdict(1, 2, 1).unwrap_err();
        assert!(e.contains("transaction.state.log.min.isr is 2"), "{e}");
    }
}
