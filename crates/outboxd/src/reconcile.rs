//! `outboxd reconcile`: where is every event? Compares three sets — committed outbox rows,
//! accepted receipts, and what consumers applied — and the broker's topics, and reports what
//! does not add up:
//!
//! | finding | meaning |
//! | --- | --- |
//! | `aged_pending` | committed, no receipt after `--pending-after`: the relay is not publishing it |
//! | `aged_unknown` | an attempt DISPATCH_UNKNOWN after `--unknown-after`: reconciliation is stuck |
//! | `unconsumed` | published, a mandatory consumer has not applied it after `--unconsumed-after`: routing or consumer fault |
//! | `bypass` | a message on an outbox topic whose header `id` is missing or not an outbox event: someone publishes around the outbox |
//! | `conflict` | one event id with two payloads or two destinations (broker copy vs frozen row, or ledger evidence) |
//!
//! Not to be confused with `relay/reconcile.rs`, which resolves the relay's own UNKNOWN
//! attempts at start-up. This command only reads; it changes nothing.
//!
//! Exit status: 0 when nothing is found, 2 when anything is (so it can drive an alert), 1 when
//! the check itself failed. `--format prometheus` prints the text exposition format for
//! node_exporter's textfile collector (all metric names start with `outboxd_reconcile_`).
//!
//! The broker scan reads every partition of every outbox topic from its low to its high
//! watermark, keeping only (id, payload digest) per message: its cost grows with the topics'
//! retention. `--no-broker` skips it.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use outbox_ledger::audit::{self, AgedPending, AgedUnknown, LedgerConflict};
use outbox_ledger::consumers::{self, ConsumerInfo, Unconsumed};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use serde::Serialize;

use crate::cli::{ReconcileArgs, ReconcileFormat};
use crate::config::FileConfig;
use crate::purge::{parse_duration, show_duration};

/// Exit status when anything was found.
pub const EXIT_FINDINGS: i32 = 2;

/// A broker message that is not (exactly) an outbox event.
#[derive(Debug, Clone, Serialize)]
pub struct BrokerFinding {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// Header `id` as found (None: no such header).
    pub id: Option<String>,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Listed<T> {
    /// How many there are (the list may be shorter: `--limit`).
    pub total: i64,
    pub items: Vec<T>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Conflicts {
    pub total: i64,
    pub ledger: Vec<LedgerConflict>,
    pub broker: Vec<BrokerFinding>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BrokerScan {
    pub scanned: bool,
    pub topics: Vec<String>,
    /// Outbox topics the broker does not have (nothing published there yet, or deleted).
    pub topics_missing: Vec<String>,
    pub messages: u64,
    pub seconds: f64,
}

/// Everything one run found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub pending_after: String,
    pub unknown_after: String,
    pub unconsumed_after: String,
    pub aged_pending: Listed<AgedPending>,
    pub aged_unknown: Listed<AgedUnknown>,
    pub unconsumed: Listed<Unconsumed>,
    pub bypass: Listed<BrokerFinding>,
    pub conflicts: Conflicts,
    pub broker: BrokerScan,
    pub consumers: Vec<ConsumerInfo>,
}

impl Report {
    pub fn findings(&self) -> i64 {
        self.aged_pending.total
            + self.aged_unknown.total
            + self.unconsumed.total
            + self.bypass.total
            + self.conflicts.total
    }
}

struct Settings {
    url: String,
    bootstrap: Option<String>,
    pending_after: Duration,
    unknown_after: Duration,
    unconsumed_after: Duration,
    topics: Vec<String>,
    properties: Vec<(String, String)>,
}

fn resolve(a: &ReconcileArgs) -> anyhow::Result<Settings> {
    let file = match &a.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let dur = |flag: Option<Duration>, key: &str, v: &Option<String>, default: u64| match flag {
        Some(d) => Ok(d),
        None => v
            .as_deref()
            .map(parse_duration)
            .transpose()
            .map_err(|e| anyhow::anyhow!("config file reconcile.{key}: {e}"))
            .map(|d| d.unwrap_or(Duration::from_secs(default))),
    };
    let mut topics = file.reconcile.topics.clone();
    topics.extend(a.topics.iter().cloned());
    let mut properties: Vec<(String, String)> = file.kafka.properties.clone().into_iter().collect();
    properties.extend(a.kafka_properties.iter().cloned());
    let s = Settings {
        url: a
            .database_url
            .clone()
            .or_else(|| file.database_url.as_ref().map(|s| s.expose().to_string()))
            .context("database URL is missing: pass --database-url, set OUTBOXD_DATABASE_URL, or set database_url in the config file")?,
        bootstrap: a
            .bootstrap_servers
            .clone()
            .or(file.kafka.bootstrap_servers.clone()),
        pending_after: dur(a.pending_after, "pending_after", &file.reconcile.pending_after, 300)?,
        unknown_after: dur(a.unknown_after, "unknown_after", &file.reconcile.unknown_after, 900)?,
        unconsumed_after: dur(
            a.unconsumed_after,
            "unconsumed_after",
            &file.reconcile.unconsumed_after,
            3600,
        )?,
        topics,
        properties,
    };
    if s.bootstrap.is_none() && !a.no_broker {
        anyhow::bail!("Kafka bootstrap servers are missing: pass --bootstrap-servers, set OUTBOXD_BOOTSTRAP_SERVERS, or kafka.bootstrap_servers in the config file (or --no-broker to skip the bypass scan)");
    }
    Ok(s)
}

pub async fn run(a: ReconcileArgs) -> anyhow::Result<()> {
    let s = resolve(&a)?;
    let format = if a.json {
        ReconcileFormat::Json
    } else {
        a.format
    };
    let client = crate::connect(&s.url).await?;
    let report = reconcile(&client, &s, a.limit, a.no_broker).await?;
    let out = match format {
        ReconcileFormat::Table => table(&report),
        ReconcileFormat::Json => serde_json::to_string_pretty(&report)? + "\n",
        ReconcileFormat::Prometheus => prometheus(&report),
    };
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()?;
    if report.findings() > 0 {
        std::process::exit(EXIT_FINDINGS);
    }
    Ok(())
}

async fn reconcile(
    client: &tokio_postgres::Client,
    s: &Settings,
    limit: i64,
    no_broker: bool,
) -> anyhow::Result<Report> {
    let (pending, pending_total) =
        audit::aged_pending(client, s.pending_after.as_secs_f64(), limit).await?;
    let (unknown, unknown_total) =
        audit::aged_unknown(client, s.unknown_after.as_secs_f64(), limit).await?;
    let (unconsumed, unconsumed_total) =
        consumers::unconsumed(client, s.unconsumed_after.as_secs_f64(), limit).await?;
    let ledger_conflicts = audit::ledger_conflicts(client).await?;
    let consumer_list = consumers::list(client).await?;

    let mut bypass = Vec::new();
    let mut broker_conflicts = Vec::new();
    let mut scan = BrokerScan {
        scanned: false,
        topics: Vec::new(),
        topics_missing: Vec::new(),
        messages: 0,
        seconds: 0.0,
    };
    if !no_broker {
        let mut topics = audit::outbox_topics(client).await?;
        for t in &s.topics {
            if !topics.contains(t) {
                topics.push(t.clone());
            }
        }
        let bootstrap = s.bootstrap.clone().unwrap_or_default();
        let properties = s.properties.clone();
        let scan_topics = topics.clone();
        let started = Instant::now();
        let (messages, missing) = tokio::task::spawn_blocking(move || {
            scan_topics_blocking(&bootstrap, &properties, &scan_topics)
        })
        .await
        .context("the broker scan task panicked")??;
        scan = BrokerScan {
            scanned: true,
            topics,
            topics_missing: missing,
            messages: messages.len() as u64,
            seconds: started.elapsed().as_secs_f64(),
        };
        let ids: Vec<uuid::Uuid> = messages
            .iter()
            .filter_map(|m| m.id.as_deref().and_then(|i| i.parse().ok()))
            .collect();
        let known = audit::known_events(client, &ids).await?;
        for m in messages {
            let parsed: Option<uuid::Uuid> = m.id.as_deref().and_then(|i| i.parse().ok());
            let finding = |detail: String| BrokerFinding {
                topic: m.topic.clone(),
                partition: m.partition,
                offset: m.offset,
                id: m.id.clone(),
                detail,
            };
            match (m.id.as_deref(), parsed.and_then(|p| known.get(&p))) {
                (None, _) => bypass.push(finding("no `id` header".into())),
                (Some(_), None) if parsed.is_none() => {
                    bypass.push(finding("header `id` is not a UUID".into()))
                }
                (Some(_), None) => {
                    bypass.push(finding("event id not in the outbox (nor purged)".into()))
                }
                (Some(_), Some(k)) => {
                    if k.payload_digest != m.digest {
                        broker_conflicts.push(finding(format!(
                            "payload differs from the outbox row: broker copy {}, frozen {}",
                            m.digest, k.payload_digest
                        )));
                    }
                    if k.topic != m.topic {
                        broker_conflicts.push(finding(format!(
                            "copy on topic {} but the event is frozen to {}",
                            m.topic, k.topic
                        )));
                    }
                }
            }
        }
    }
    let bypass_total = bypass.len() as i64;
    bypass.truncate(limit.max(0) as usize);
    let conflicts_total = (ledger_conflicts.len() + broker_conflicts.len()) as i64;
    broker_conflicts.truncate(limit.max(0) as usize);
    Ok(Report {
        pending_after: show_duration(s.pending_after),
        unknown_after: show_duration(s.unknown_after),
        unconsumed_after: show_duration(s.unconsumed_after),
        aged_pending: Listed {
            total: pending_total,
            items: pending,
        },
        aged_unknown: Listed {
            total: unknown_total,
            items: unknown,
        },
        unconsumed: Listed {
            total: unconsumed_total,
            items: unconsumed,
        },
        bypass: Listed {
            total: bypass_total,
            items: bypass,
        },
        conflicts: Conflicts {
            total: conflicts_total,
            ledger: ledger_conflicts,
            broker: broker_conflicts,
        },
        broker: scan,
        consumers: consumer_list,
    })
}

struct ScannedMessage {
    topic: String,
    partition: i32,
    offset: i64,
    id: Option<String>,
    digest: String,
}

/// Reads every partition of `topics` from low to high watermark (as of the start).
fn scan_topics_blocking(
    bootstrap: &str,
    properties: &[(String, String)],
    topics: &[String],
) -> anyhow::Result<(Vec<ScannedMessage>, Vec<String>)> {
    const TIMEOUT: Duration = Duration::from_secs(30);
    let mut cc = ClientConfig::new();
    for (k, v) in properties {
        // Producer-only settings would make the consumer refuse to start.
        if k.starts_with("security.") || k.starts_with("sasl.") || k.starts_with("ssl.") {
            cc.set(k, v);
        }
    }
    let consumer: BaseConsumer = cc
        .set("bootstrap.servers", bootstrap)
        .set(
            "group.id",
            format!("outboxd-reconcile-{}", uuid::Uuid::new_v4()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .with_context(|| format!("creating a Kafka consumer for {bootstrap}"))?;
    let mut out = Vec::new();
    let mut missing = Vec::new();
    for topic in topics {
        let md = consumer
            .fetch_metadata(Some(topic), TIMEOUT)
            .with_context(|| format!("reading metadata of topic {topic} from {bootstrap}; check --bootstrap-servers and that the broker is up"))?;
        let partitions: Vec<i32> = md
            .topics()
            .iter()
            .filter(|t| t.name() == topic && t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        if partitions.is_empty() {
            missing.push(topic.clone());
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        let mut high = HashMap::new();
        for p in &partitions {
            let (low, h) = consumer
                .fetch_watermarks(topic, *p, TIMEOUT)
                .with_context(|| format!("reading watermarks of {topic}/{p}"))?;
            if h > low {
                high.insert(*p, (low, h));
                tpl.add_partition_offset(topic, *p, Offset::Offset(low))?;
            }
        }
        if high.is_empty() {
            continue;
        }
        consumer
            .assign(&tpl)
            .with_context(|| format!("assigning {topic}"))?;
        let mut next: HashMap<i32, i64> = high.iter().map(|(p, (low, _))| (*p, *low)).collect();
        let mut last_progress = Instant::now();
        while high.iter().any(|(p, (_, h))| next[p] < *h) {
            if last_progress.elapsed() > TIMEOUT {
                anyhow::bail!(
                    "reading topic {topic} stalled for {}s (positions {next:?}, high watermarks {high:?}); is the broker healthy?",
                    TIMEOUT.as_secs()
                );
            }
            let Some(r) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let m = r.with_context(|| format!("reading topic {topic}"))?;
            last_progress = Instant::now();
            next.insert(m.partition(), m.offset() + 1);
            let id = m.headers().and_then(|h| {
                h.iter()
                    .find(|hd| hd.key == "id")
                    .map(|hd| String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned())
            });
            out.push(ScannedMessage {
                topic: topic.clone(),
                partition: m.partition(),
                offset: m.offset(),
                id,
                digest: outbox_core::envelope::sha256_digest(m.payload().unwrap_or_default()),
            });
        }
        consumer.unassign().ok();
    }
    Ok((out, missing))
}

fn table(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{:<14} {:>7}  MEANING (threshold)", "FINDING", "COUNT");
    let rows = [
        (
            "aged_pending",
            r.aged_pending.total,
            format!(
                "PENDING longer than {}: the relay is not publishing it",
                r.pending_after
            ),
        ),
        (
            "aged_unknown",
            r.aged_unknown.total,
            format!("DISPATCH_UNKNOWN longer than {}", r.unknown_after),
        ),
        (
            "unconsumed",
            r.unconsumed.total,
            format!(
                "published over {} ago, a mandatory consumer has not applied it",
                r.unconsumed_after
            ),
        ),
        (
            "bypass",
            r.bypass.total,
            "on an outbox topic, but not an outbox event".to_string(),
        ),
        (
            "conflict",
            r.conflicts.total,
            "one event id, two payloads or destinations".to_string(),
        ),
    ];
    for (k, n, m) in rows {
        let _ = writeln!(s, "{k:<14} {n:>7}  {m}");
    }
    let _ = writeln!(s);
    for p in &r.aged_pending.items {
        let _ = writeln!(
            s,
            "aged_pending  {}  {}  topic {}  age {:.0}s",
            p.event_id, p.aggregate, p.topic, p.age_seconds
        );
    }
    for u in &r.aged_unknown.items {
        let _ = writeln!(
            s,
            "aged_unknown  {}  relay generation {} attempt {}  {}/{}  age {:.0}s",
            u.event_id,
            u.relay_generation,
            u.attempt_generation,
            u.topic,
            u.partition,
            u.age_seconds
        );
    }
    for u in &r.unconsumed.items {
        let _ = writeln!(
            s,
            "unconsumed    {}  consumer {}  at {}/{}@{}  published {:.0}s ago",
            u.event_id, u.consumer_id, u.topic, u.partition, u.offset, u.published_age_seconds
        );
    }
    for b in &r.bypass.items {
        let _ = writeln!(
            s,
            "bypass        {}/{}@{}  id {}  {}",
            b.topic,
            b.partition,
            b.offset,
            b.id.as_deref().unwrap_or("-"),
            b.detail
        );
    }
    for c in &r.conflicts.ledger {
        let _ = writeln!(
            s,
            "conflict      {}  {}: {}",
            c.event_id
                .map(|i| i.to_string())
                .unwrap_or_else(|| "-".into()),
            c.source,
            c.detail
        );
    }
    for c in &r.conflicts.broker {
        let _ = writeln!(
            s,
            "conflict      {}  {}/{}@{}: {}",
            c.id.as_deref().unwrap_or("-"),
            c.topic,
            c.partition,
            c.offset,
            c.detail
        );
    }
    if r.broker.scanned {
        let _ = writeln!(
            s,
            "broker: {} messages in {} topic(s) scanned in {:.1}s{}",
            r.broker.messages,
            r.broker.topics.len(),
            r.broker.seconds,
            if r.broker.topics_missing.is_empty() {
                String::new()
            } else {
                format!(
                    "; not on the broker: {}",
                    r.broker.topics_missing.join(", ")
                )
            }
        );
    } else {
        let _ = writeln!(s, "broker: not scanned (--no-broker)");
    }
    for c in &r.consumers {
        let _ = writeln!(
            s,
            "consumer {} ({}): {} partition watermark(s), {} inbox row(s) here{}",
            c.consumer_id,
            if c.mandatory { "mandatory" } else { "optional" },
            c.partitions,
            c.inbox_rows,
            c.idle_seconds
                .map(|i| format!(", last progress {i:.0}s ago"))
                .unwrap_or_else(|| ", never recorded progress".into())
        );
    }
    let _ = writeln!(
        s,
        "{}",
        if r.findings() == 0 {
            "all is well".to_string()
        } else {
            format!("{} finding(s); exit status {EXIT_FINDINGS}", r.findings())
        }
    );
    s
}

/// Prometheus text exposition format (node_exporter textfile collector). Write it to a
/// temporary file and rename it into the collector's directory, so a scrape never reads half.
fn prometheus(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# HELP outboxd_reconcile_findings Findings of the last outboxd reconcile run, by kind; 0 when all is well."
    );
    let _ = writeln!(s, "# TYPE outboxd_reconcile_findings gauge");
    for (k, n) in [
        ("aged_pending", r.aged_pending.total),
        ("aged_unknown", r.aged_unknown.total),
        ("unconsumed", r.unconsumed.total),
        ("bypass", r.bypass.total),
        ("conflict", r.conflicts.total),
    ] {
        let _ = writeln!(s, "outboxd_reconcile_findings{{kind=\"{k}\"}} {n}");
    }
    let oldest = r
        .aged_pending
        .items
        .first()
        .map(|p| p.age_seconds)
        .unwrap_or(0.0);
    let _ = writeln!(
        s,
        "# HELP outboxd_reconcile_oldest_aged_pending_seconds Age of the oldest aged PENDING event (0 if none)."
    );
    let _ = writeln!(
        s,
        "# TYPE outboxd_reconcile_oldest_aged_pending_seconds gauge"
    );
    let _ = writeln!(
        s,
        "outboxd_reconcile_oldest_aged_pending_seconds {oldest:.3}"
    );
    let _ = writeln!(
        s,
        "# HELP outboxd_reconcile_broker_messages_scanned Broker messages read by the bypass scan."
    );
    let _ = writeln!(s, "# TYPE outboxd_reconcile_broker_messages_scanned gauge");
    let _ = writeln!(
        s,
        "outboxd_reconcile_broker_messages_scanned {}",
        r.broker.messages
    );
    let _ = writeln!(
        s,
        "# HELP outboxd_reconcile_consumer_idle_seconds Seconds since a registered consumer last moved a watermark."
    );
    let _ = writeln!(s, "# TYPE outboxd_reconcile_consumer_idle_seconds gauge");
    for c in &r.consumers {
        if let Some(i) = c.idle_seconds {
            let _ = writeln!(
                s,
                "outboxd_reconcile_consumer_idle_seconds{{consumer=\"{}\",mandatory=\"{}\"}} {i:.3}",
                escape_label(&c.consumer_id),
                c.mandatory
            );
        }
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let _ = writeln!(
        s,
        "# HELP outboxd_reconcile_last_run_timestamp_seconds When this report was made (Unix time)."
    );
    let _ = writeln!(
        s,
        "# TYPE outboxd_reconcile_last_run_timestamp_seconds gauge"
    );
    let _ = writeln!(s, "outboxd_reconcile_last_run_timestamp_seconds {now:.3}");
    s
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
