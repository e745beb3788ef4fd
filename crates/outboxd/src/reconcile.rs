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
//! | `receipt_missing` | a receipt (primary or duplicate) in the audit scope points at no message: invalid position (e.g. offset -1001, librdkafka's implicit ack), no such topic or partition, at/past the high watermark, or an offset inside [low, high) the scan did not return |
//! | `receipt_mismatch` | the message at a receipt's position carries another `id` header (or none), or a payload whose digest differs from the frozen row's |
//!
//! The receipt audit (`--audit-receipts all|none|sample=N|last=DURATION`, default `last=24h`)
//! proves that the ledger's receipts are messages on the broker. A receipt below its
//! partition's low watermark (deleted by retention) is counted as expired, not a finding.
//! Only Kafka receipts of the audited cluster (`--cluster-name`) are checked; the others in
//! scope are counted. The receipts are read before the scan, so every receipt accepted by then
//! is below the high watermark the scan reads up to.
//!
//! Not to be confused with `relay/unknown.rs`, which resolves the relay's own UNKNOWN
//! attempts at start-up. This command only reads; it changes nothing.
//!
//! Exit status: 0 when nothing is found, 2 when anything is (so it can drive an alert), 1 when
//! the check itself failed. `--format prometheus` prints the text exposition format for
//! node_exporter's textfile collector (all metric names start with `outboxd_reconcile_`).
//!
//! The broker scan reads every partition of every outbox topic (and of every audited receipt's
//! topic) from its low to its high watermark, keeping only (id, payload digest) per message:
//! its cost grows with the topics' retention. `--no-broker` skips it, and with it the audit.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use outbox_ledger::audit::{
    self, AgedPending, AgedUnknown, LedgerConflict, ReceiptKind, ReceiptScope, ReceiptsInScope,
};
use outbox_ledger::consumers::{self, ConsumerInfo, Unconsumed};
use rdkafka::Message;
use serde::Serialize;

use crate::cli::{ReconcileArgs, ReconcileFormat};
use crate::config::{redact_url, FileConfig};
use crate::values::{parse_duration, show_duration};

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
    /// Every partition of the scanned topics, with the watermarks the scan used.
    pub partitions: Vec<PartitionWatermarks>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PartitionWatermarks {
    pub topic: String,
    pub partition: i32,
    /// The log start after the scan (retention may have moved it during the scan).
    pub low: i64,
    /// The high watermark when the scan of the topic began: it read up to here.
    pub high: i64,
}

/// A receipt that the broker does not back.
#[derive(Debug, Clone, Serialize)]
pub struct ReceiptFinding {
    /// `primary` (outbox.receipts) or `duplicate` (outbox.duplicate_receipts).
    pub kind: ReceiptKind,
    pub event_id: uuid::Uuid,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// What is at that position (or why nothing is).
    pub detail: String,
    /// Where the scan found messages carrying this event's id instead (`topic/partition@offset`,
    /// at most 5): empty means no copy on the scanned topics, i.e. not proven published.
    pub copies_elsewhere: Vec<String>,
}

/// The receipt audit's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct ReceiptAudit {
    /// The scope asked for: `all`, `none`, `sample=N`, `last=DURATION`.
    pub scope: String,
    /// Whether receipts were compared with the broker at all (false for scope `none` and
    /// with `--no-broker`).
    pub performed: bool,
    /// Why not, when not performed.
    pub skipped: Option<String>,
    /// The Kafka cluster identity audited.
    pub cluster: String,
    /// Receipts compared with the message at their position (expired ones excluded).
    pub audited: u64,
    /// Receipts below their partition's low watermark: deleted by retention, not checkable.
    pub expired: u64,
    /// NATS receipts in scope (for `sample=N`: in the ledger): a Kafka scan cannot audit them.
    pub not_auditable_nats: i64,
    /// HTTP receipts in scope: an endpoint cannot be scanned (the receipt's evidence is its
    /// answer).
    pub not_auditable_http: i64,
    /// Kafka receipts in scope (for `sample=N`: in the ledger) of another cluster.
    pub other_cluster: i64,
}

/// An unpublished event frozen before migration 0022 for a destination its encoding rules would
/// not give it (issue 31: a value pasted into a URL, subject or topic as it was).
#[derive(Debug, Clone, Serialize)]
pub struct BadDestination {
    pub event_id: uuid::Uuid,
    /// The frozen destination (credentials redacted).
    pub frozen: String,
    /// What the rules give (credentials redacted), or `None` when they refuse the value.
    pub rendered: Option<String>,
    pub reason: String,
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
    pub receipt_missing: Listed<ReceiptFinding>,
    pub receipt_mismatch: Listed<ReceiptFinding>,
    pub bad_destination: Listed<BadDestination>,
    pub receipts: ReceiptAudit,
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
            + self.receipt_missing.total
            + self.receipt_mismatch.total
            + self.bad_destination.total
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
    audit: ReceiptScope,
    cluster: String,
}

/// Parses a receipt audit scope: `all`, `none`, `sample=N`, `last=DURATION`.
pub fn parse_audit_scope(s: &str) -> Result<ReceiptScope, String> {
    const FORMS: &str = "use all, none, sample=N (N receipts at random, N >= 1) or last=DURATION (receipts recorded within DURATION, e.g. last=24h)";
    let t = s.trim();
    match t {
        "all" => return Ok(ReceiptScope::All),
        "none" => return Ok(ReceiptScope::None),
        _ => {}
    }
    if let Some(n) = t.strip_prefix("sample=") {
        return match n.trim().parse::<i64>() {
            Ok(n) if n >= 1 => Ok(ReceiptScope::Sample(n)),
            _ => Err(format!(
                "{s:?}: sample=N needs a whole number N >= 1; {FORMS}"
            )),
        };
    }
    if let Some(d) = t.strip_prefix("last=") {
        return parse_duration(d)
            .map(|d| ReceiptScope::Last(d.as_secs_f64()))
            .map_err(|e| format!("{s:?}: {e}; {FORMS}"));
    }
    Err(format!("{s:?} is not a receipt audit scope; {FORMS}"))
}

/// The scope as the flag spells it.
pub fn show_audit_scope(scope: ReceiptScope) -> String {
    match scope {
        ReceiptScope::All => "all".into(),
        ReceiptScope::None => "none".into(),
        ReceiptScope::Sample(n) => format!("sample={n}"),
        ReceiptScope::Last(secs) => {
            format!("last={}", show_duration(Duration::from_secs_f64(secs)))
        }
    }
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
    let audit = match (&a.audit_receipts, &file.reconcile.audit_receipts) {
        (Some(v), _) => {
            parse_audit_scope(v).map_err(|e| anyhow::anyhow!("--audit-receipts: {e}"))?
        }
        (None, Some(v)) => parse_audit_scope(v)
            .map_err(|e| anyhow::anyhow!("config file reconcile.audit_receipts: {e}"))?,
        (None, None) => ReceiptScope::Last(86_400.0),
    };
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
        audit,
        cluster: a
            .cluster_name
            .clone()
            .or(file.kafka.cluster_name.clone())
            .unwrap_or_else(|| "default".into()),
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
    let mut client = crate::connect(&s.url).await?;
    let report = reconcile(&mut client, &s, a.limit, a.no_broker).await?;
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
    client: &mut tokio_postgres::Client,
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
    let bad_destination = bad_destinations(client, limit).await?;
    let consumer_list = consumers::list(client).await?;

    let mut receipts = ReceiptAudit {
        scope: show_audit_scope(s.audit),
        performed: false,
        skipped: None,
        cluster: s.cluster.clone(),
        audited: 0,
        expired: 0,
        not_auditable_nats: 0,
        not_auditable_http: 0,
        other_cluster: 0,
    };
    let mut missing_receipts = Vec::new();
    let mut mismatched_receipts = Vec::new();
    let mut bypass = Vec::new();
    let mut broker_conflicts = Vec::new();
    let mut scan = BrokerScan {
        scanned: false,
        topics: Vec::new(),
        topics_missing: Vec::new(),
        messages: 0,
        seconds: 0.0,
        partitions: Vec::new(),
    };
    if no_broker {
        receipts.skipped = Some("--no-broker: the broker was not read".into());
    } else if s.audit == ReceiptScope::None {
        receipts.skipped = Some("--audit-receipts none".into());
    }
    if !no_broker {
        // The receipts first: each one accepted before this read is below the high watermark
        // that the scan (which starts after it) reads up to.
        let in_scope = if s.audit == ReceiptScope::None {
            ReceiptsInScope::default()
        } else {
            audit::receipts_in_scope(client, s.audit, &s.cluster).await?
        };
        let mut topics = audit::outbox_topics(client).await?;
        for t in s.topics.iter().chain(in_scope.by_topic.keys()) {
            if !topics.contains(t) {
                topics.push(t.clone());
            }
        }
        let bootstrap = s.bootstrap.clone().unwrap_or_default();
        let properties = s.properties.clone();
        let scan_topics = topics.clone();
        let started = Instant::now();
        let mut result = tokio::task::spawn_blocking(move || {
            scan_topics_blocking(&bootstrap, &properties, &scan_topics)
        })
        .await
        .context("the broker scan task panicked")??;
        result.sort();
        if s.audit != ReceiptScope::None {
            let outcome = audit_receipts(&in_scope, &result);
            receipts.performed = true;
            receipts.audited = outcome.audited;
            receipts.expired = outcome.expired;
            receipts.not_auditable_nats = in_scope.nats;
            receipts.not_auditable_http = in_scope.http;
            receipts.other_cluster = in_scope.other_cluster;
            missing_receipts = outcome.missing;
            mismatched_receipts = outcome.mismatch;
        }
        drop(in_scope);
        scan = BrokerScan {
            scanned: true,
            topics,
            topics_missing: result.missing.clone(),
            messages: result.messages.len() as u64,
            seconds: started.elapsed().as_secs_f64(),
            partitions: result
                .watermarks
                .iter()
                .flat_map(|(t, ps)| {
                    ps.iter().map(|(p, (low, high))| PartitionWatermarks {
                        topic: t.clone(),
                        partition: *p,
                        low: *low,
                        high: *high,
                    })
                })
                .collect(),
        };
        let messages = result.messages;
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
    let listed = |mut items: Vec<ReceiptFinding>| {
        let total = items.len() as i64;
        items.truncate(limit.max(0) as usize);
        Listed { total, items }
    };
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
        receipt_missing: listed(missing_receipts),
        receipt_mismatch: listed(mismatched_receipts),
        bad_destination,
        receipts,
        broker: scan,
        consumers: consumer_list,
    })
}

#[derive(Debug, Clone)]
struct ScannedMessage {
    topic: String,
    partition: i32,
    offset: i64,
    id: Option<String>,
    digest: String,
}

/// What the broker scan saw.
#[derive(Debug, Default)]
struct ScanResult {
    /// Every message read; after [`ScanResult::sort`], ordered by (topic, partition, offset).
    messages: Vec<ScannedMessage>,
    /// Topics the broker does not have.
    missing: Vec<String>,
    /// Every partition of every topic found: (low watermark after the scan, high watermark
    /// the scan read up to).
    watermarks: BTreeMap<String, BTreeMap<i32, (i64, i64)>>,
}

impl ScanResult {
    fn sort(&mut self) {
        self.messages.sort_unstable_by(|a, b| {
            (a.topic.as_str(), a.partition, a.offset).cmp(&(
                b.topic.as_str(),
                b.partition,
                b.offset,
            ))
        });
    }

    /// The message at a position (requires [`ScanResult::sort`]).
    fn at(&self, topic: &str, partition: i32, offset: i64) -> Option<&ScannedMessage> {
        self.messages
            .binary_search_by(|m| {
                (m.topic.as_str(), m.partition, m.offset).cmp(&(topic, partition, offset))
            })
            .ok()
            .map(|i| &self.messages[i])
    }
}

/// What the receipt audit found.
#[derive(Debug, Default)]
struct AuditOutcome {
    audited: u64,
    expired: u64,
    missing: Vec<ReceiptFinding>,
    mismatch: Vec<ReceiptFinding>,
}

/// librdkafka's RD_KAFKA_OFFSET_INVALID: a delivery report that carried no offset.
const OFFSET_INVALID: i64 = -1001;

/// Compares every receipt in scope with the message at its position (`scan` must be sorted).
fn audit_receipts(receipts: &ReceiptsInScope, scan: &ScanResult) -> AuditOutcome {
    let mut out = AuditOutcome::default();
    for (topic, list) in &receipts.by_topic {
        let partitions = scan.watermarks.get(topic);
        for r in list {
            let finding = |detail: String| ReceiptFinding {
                kind: r.kind,
                event_id: r.event_id,
                topic: topic.clone(),
                partition: r.partition,
                offset: r.offset,
                detail,
                copies_elsewhere: Vec::new(),
            };
            if r.partition < 0 || r.offset < 0 {
                out.audited += 1;
                out.missing.push(finding(if r.offset == OFFSET_INVALID {
                    "offset -1001 is no position: the delivery report carried no offset (librdkafka's implicit ack); the broker may never have stored it".into()
                } else {
                    format!(
                        "partition {} offset {} is no position on the broker",
                        r.partition, r.offset
                    )
                }));
                continue;
            }
            let Some(partitions) = partitions else {
                out.audited += 1;
                out.missing.push(finding(format!(
                    "topic {topic} does not exist on the broker"
                )));
                continue;
            };
            let Some(&(low, high)) = partitions.get(&r.partition) else {
                out.audited += 1;
                out.missing.push(finding(format!(
                    "topic {topic} has no partition {} (it has {})",
                    r.partition,
                    partitions.len()
                )));
                continue;
            };
            if r.offset < low {
                out.expired += 1;
                continue;
            }
            out.audited += 1;
            if r.offset >= high {
                out.missing.push(finding(format!(
                    "offset {} is at or past the partition's high watermark {high}: no message there",
                    r.offset
                )));
                continue;
            }
            let Some(m) = scan.at(topic, r.partition, r.offset) else {
                out.missing.push(finding(format!(
                    "no message at this offset, though the scan read [{low}, {high}): never stored, removed by compaction, or part of an aborted transaction"
                )));
                continue;
            };
            let mut wrong = Vec::new();
            let own_id =
                m.id.as_deref()
                    .and_then(|i| i.parse::<uuid::Uuid>().ok())
                    .is_some_and(|i| i == r.event_id);
            if !own_id {
                wrong.push(match &m.id {
                    Some(i) => format!("the message there has id {i}"),
                    None => "the message there has no `id` header".to_string(),
                });
            }
            match &r.payload_digest {
                Some(d) if *d != m.digest => wrong.push(format!(
                    "its payload digest is {}, the frozen row's {d}",
                    m.digest
                )),
                _ => {}
            }
            if !wrong.is_empty() {
                out.mismatch.push(finding(wrong.join("; ")));
            }
        }
    }
    note_copies(&mut out.missing, scan);
    note_copies(&mut out.mismatch, scan);
    out
}

/// Fills in where else the scan saw each finding's event id (one pass over the messages).
fn note_copies(findings: &mut [ReceiptFinding], scan: &ScanResult) {
    const MAX: usize = 5;
    if findings.is_empty() {
        return;
    }
    let wanted: HashSet<uuid::Uuid> = findings.iter().map(|f| f.event_id).collect();
    let mut copies: HashMap<uuid::Uuid, Vec<(&str, i32, i64)>> = HashMap::new();
    for m in &scan.messages {
        let Some(id) = m.id.as_deref().and_then(|i| i.parse::<uuid::Uuid>().ok()) else {
            continue;
        };
        if wanted.contains(&id) {
            copies
                .entry(id)
                .or_default()
                .push((m.topic.as_str(), m.partition, m.offset));
        }
    }
    for f in findings {
        f.copies_elsewhere = copies
            .get(&f.event_id)
            .into_iter()
            .flatten()
            .filter(|(t, p, o)| (*t, *p, *o) != (f.topic.as_str(), f.partition, f.offset))
            .take(MAX)
            .map(|(t, p, o)| format!("{t}/{p}@{o}"))
            .collect();
    }
}

/// Reads every partition of `topics` from low to high watermark (as of the start of each
/// topic's read), and records every partition's watermarks.
fn scan_topics_blocking(
    bootstrap: &str,
    properties: &[(String, String)],
    topics: &[String],
) -> anyhow::Result<ScanResult> {
    let consumer = crate::topics::consumer(bootstrap, properties, "reconcile")?;
    let mut out = ScanResult::default();
    for topic in topics {
        let marks =
            crate::topics::read_topic(&consumer, bootstrap, topic, &|_, low| low, &mut |m| {
                out.messages.push(ScannedMessage {
                    topic: topic.clone(),
                    partition: m.partition(),
                    offset: m.offset(),
                    id: crate::topics::header(m, "id"),
                    digest: outbox_core::envelope::sha256_digest(m.payload().unwrap_or_default()),
                });
                Ok(())
            })?;
        match marks {
            Some(marks) => {
                out.watermarks.insert(topic.clone(), marks);
            }
            None => out.missing.push(topic.clone()),
        }
    }
    Ok(out)
}

/// Unpublished events whose frozen destination the encoding rules of migration 0022 would
/// give differently or refuse (`outbox.destinations_breaking_rules`), the first `limit` listed.
async fn bad_destinations(
    client: &tokio_postgres::Client,
    limit: i64,
) -> anyhow::Result<Listed<BadDestination>> {
    let rows = client
        .query(
            "SELECT event_id, frozen, rendered, reason FROM outbox.destinations_breaking_rules($1)",
            &[&i32::MAX],
        )
        .await
        .context("listing unpublished events whose frozen destination breaks the encoding rules of migration 0022 (outbox.destinations_breaking_rules)")?;
    let total = rows.len() as i64;
    let items = rows
        .iter()
        .take(limit.max(0) as usize)
        .map(|row| BadDestination {
            event_id: row.get(0),
            frozen: redact_url(row.get(1)),
            rendered: row.get::<_, Option<&str>>(2).map(redact_url),
            reason: row.get(3),
        })
        .collect();
    Ok(Listed { total, items })
}

fn table(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{:<16} {:>7}  MEANING (threshold)", "FINDING", "COUNT");
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
        (
            "receipt_missing",
            r.receipt_missing.total,
            "a receipt points at no message on the broker: not proven published".to_string(),
        ),
        (
            "receipt_mismatch",
            r.receipt_mismatch.total,
            "the message at a receipt's position is another event or payload".to_string(),
        ),
        (
            "bad_destination",
            r.bad_destination.total,
            "unpublished, frozen for a destination the encoding rules would not give it"
                .to_string(),
        ),
    ];
    for (k, n, m) in rows {
        let _ = writeln!(s, "{k:<16} {n:>7}  {m}");
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
    for b in &r.bad_destination.items {
        let _ = writeln!(
            s,
            "bad_destination  {}  frozen {}  {}",
            b.event_id,
            b.frozen,
            match &b.rendered {
                Some(to) => format!("the rules give {to}"),
                None => b.reason.clone(),
            }
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
    for (k, list) in [
        ("receipt_missing", &r.receipt_missing),
        ("receipt_mismatch", &r.receipt_mismatch),
    ] {
        for f in &list.items {
            let _ = writeln!(
                s,
                "{k:<16} {} {}  {}/{}@{}: {}; {}",
                f.kind.as_str(),
                f.event_id,
                f.topic,
                f.partition,
                f.offset,
                f.detail,
                if f.copies_elsewhere.is_empty() {
                    "no copy of the event on the scanned topics".to_string()
                } else {
                    format!("the event is at {}", f.copies_elsewhere.join(", "))
                }
            );
        }
    }
    let a = &r.receipts;
    match &a.skipped {
        Some(why) => {
            let _ = writeln!(s, "receipts: not audited ({why})");
        }
        None => {
            let _ = writeln!(
                s,
                "receipts: {} audited (scope {}, cluster {}), {} expired, {} not auditable (nats), {} not auditable (http){}",
                a.audited,
                a.scope,
                a.cluster,
                a.expired,
                a.not_auditable_nats,
                a.not_auditable_http,
                if a.other_cluster > 0 {
                    format!(", {} of other Kafka clusters not audited", a.other_cluster)
                } else {
                    String::new()
                }
            );
        }
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
    gauge_header(
        &mut s,
        "outboxd_reconcile_findings",
        "Findings of the last outboxd reconcile run, by kind; 0 when all is well.",
    );
    for (k, n) in [
        ("aged_pending", r.aged_pending.total),
        ("aged_unknown", r.aged_unknown.total),
        ("unconsumed", r.unconsumed.total),
        ("bypass", r.bypass.total),
        ("conflict", r.conflicts.total),
        ("receipt_missing", r.receipt_missing.total),
        ("receipt_mismatch", r.receipt_mismatch.total),
        ("bad_destination", r.bad_destination.total),
    ] {
        let _ = writeln!(s, "outboxd_reconcile_findings{{kind=\"{k}\"}} {n}");
    }
    let oldest = r
        .aged_pending
        .items
        .first()
        .map(|p| p.age_seconds)
        .unwrap_or(0.0);
    let gauges: [(&str, &str, String); 4] = [
        (
            "outboxd_reconcile_oldest_aged_pending_seconds",
            "Age of the oldest aged PENDING event (0 if none).",
            format!("{oldest:.3}"),
        ),
        (
            "outboxd_reconcile_broker_messages_scanned",
            "Broker messages read by the bypass scan.",
            r.broker.messages.to_string(),
        ),
        (
            "outboxd_reconcile_receipts_audited",
            "Receipts compared with the message at their broker position (0 when the audit is off).",
            r.receipts.audited.to_string(),
        ),
        (
            "outboxd_reconcile_receipts_expired",
            "Receipts in the audit scope below their partition's low watermark (deleted by retention).",
            r.receipts.expired.to_string(),
        ),
    ];
    for (name, help, value) in gauges {
        gauge_header(&mut s, name, help);
        let _ = writeln!(s, "{name} {value}");
    }
    gauge_header(
        &mut s,
        "outboxd_reconcile_consumer_idle_seconds",
        "Seconds since a registered consumer last moved a watermark.",
    );
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
    gauge_header(
        &mut s,
        "outboxd_reconcile_last_run_timestamp_seconds",
        "When this report was made (Unix time).",
    );
    let _ = writeln!(s, "outboxd_reconcile_last_run_timestamp_seconds {now:.3}");
    s
}

fn gauge_header(s: &mut String, name: &str, help: &str) {
    let _ = writeln!(s, "# HELP {name} {help}");
    let _ = writeln!(s, "# TYPE {name} gauge");
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_ledger::audit::ScopedReceipt;

    #[test]
    fn audit_scopes_parse_and_errors_name_the_forms() {
        assert_eq!(parse_audit_scope("all"), Ok(ReceiptScope::All));
        assert_eq!(parse_audit_scope("none"), Ok(ReceiptScope::None));
        assert_eq!(parse_audit_scope("sample=25"), Ok(ReceiptScope::Sample(25)));
        assert_eq!(
            parse_audit_scope("last=24h"),
            Ok(ReceiptScope::Last(86_400.0))
        );
        for bad in ["", "some", "sample=0", "sample=x", "last=", "last=3 weeks"] {
            let e = parse_audit_scope(bad).unwrap_err();
            assert!(e.contains("sample=N") && e.contains("last=DURATION"), "{e}");
        }
        for s in ["all", "none", "sample=3", "last=26h", "last=90m"] {
            assert_eq!(show_audit_scope(parse_audit_scope(s).unwrap()), s);
        }
    }

    fn message(partition: i32, offset: i64, id: Option<&str>, digest: &str) -> ScannedMessage {
        ScannedMessage {
            topic: "t".into(),
            partition,
            offset,
            id: id.map(String::from),
            digest: digest.into(),
        }
    }

    #[test]
    fn each_receipt_is_found_expired_missing_or_mismatched() {
        let a = uuid::Uuid::now_v7();
        let b = uuid::Uuid::now_v7();
        let mut scan = ScanResult {
            // Partition 0 holds [10, 14) with offset 12 not returned; partition 1 is empty.
            messages: vec![
                message(0, 13, Some(&b.to_string()), "db"),
                message(0, 10, Some(&a.to_string()), "da"),
                message(0, 11, None, "dx"),
            ],
            missing: vec!["gone".into()],
            watermarks: [(
                "t".to_string(),
                [(0, (10, 14)), (1, (5, 5))].into_iter().collect(),
            )]
            .into_iter()
            .collect(),
        };
        scan.sort();
        let r = |partition, offset, digest: &str| ScopedReceipt {
            kind: ReceiptKind::Primary,
            event_id: a,
            partition,
            offset,
            payload_digest: Some(digest.into()),
        };
        let mut receipts = ReceiptsInScope::default();
        receipts.by_topic.insert(
            "t".into(),
            vec![
                r(0, 10, "da"),             // found, matches
                r(0, 10, "other"),          // payload differs
                r(0, 13, "da"),             // b's message
                r(0, 11, "dx"),             // no id header
                r(0, 9, "da"),              // expired
                r(0, 12, "da"),             // gap
                r(0, 14, "da"),             // at the high watermark
                r(1, 5, "da"),              // empty partition
                r(2, 0, "da"),              // no such partition
                r(0, OFFSET_INVALID, "da"), // implicit ack
            ],
        );
        receipts.by_topic.insert("gone".into(), vec![r(0, 0, "da")]);
        let o = audit_receipts(&receipts, &scan);
        assert_eq!(o.expired, 1);
        assert_eq!(o.audited, 10);
        let details = |v: &[ReceiptFinding]| -> Vec<(i32, i64, String)> {
            v.iter()
                .map(|f| (f.partition, f.offset, f.detail.clone()))
                .collect()
        };
        let mismatch = details(&o.mismatch);
        assert_eq!(mismatch.len(), 3, "{mismatch:?}");
        assert!(
            mismatch[0].2.contains("payload digest is da"),
            "{mismatch:?}"
        );
        assert!(
            mismatch[1].2.contains(&format!("has id {b}")),
            "{mismatch:?}"
        );
        assert!(mismatch[2].2.contains("no `id` header"), "{mismatch:?}");
        // Where else a's id is: not at its own position, at 0@10 for the others.
        assert!(o.mismatch[0].copies_elsewhere.is_empty());
        assert_eq!(o.mismatch[1].copies_elsewhere, vec!["t/0@10".to_string()]);
        let missing = details(&o.missing);
        assert_eq!(missing.len(), 6, "{missing:?}");
        // Topics in name order: "gone" first.
        assert!(
            missing[0].2.contains("topic gone does not exist"),
            "{missing:?}"
        );
        assert!(
            missing[1].2.contains("though the scan read [10, 14)"),
            "{missing:?}"
        );
        assert!(missing[2].2.contains("high watermark 14"), "{missing:?}");
        assert!(missing[3].2.contains("high watermark 5"), "{missing:?}");
        assert!(missing[4].2.contains("no partition 2"), "{missing:?}");
        assert!(missing[5].2.contains("implicit ack"), "{missing:?}");
    }
}
