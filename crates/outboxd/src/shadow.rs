//! `outboxd shadow`: watch a polling relay before replacing it. The capture trigger of an
//! attached poller table (migration 0014) records every row the poller owns
//! (`outbox.legacy_events`: id, aggregate, type, payload digest, capture time). The shadow
//! reads the poller's topics from where its last read stopped, records every message that
//! carries an event id (`outbox.shadow_observations`), and reports, per event the poller owns:
//! did it reach the broker (found by id), once or several times, under the committed key and
//! payload, how late; and whether any event, the poller's or outboxd's, was published by both
//! relays. A team sees its current relay's real loss, duplicate and latency figures before it
//! switches, and keeps seeing them during the switch.
//!
//! What counts is decided by [`Report::from_events`], pure code over one row per event.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use rdkafka::message::Message;
use serde::Serialize;
use tokio_postgres::Client;

use crate::cli::ShadowArgs;
use crate::connect;

/// Exit status when something is wrong (as `outboxd reconcile`).
const EXIT_FINDINGS: i32 = 2;

/// One event the poller owns, as `outbox.shadow_events()` sees it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LegacyEvent {
    /// In the table before outboxd attached (its messages may predate the topics' retention).
    pub before_attach: bool,
    /// The poller marked it published (or deleted the row).
    pub marked: bool,
    /// Seconds since the row was captured.
    pub age_secs: f64,
    /// Messages carrying its id sent by the poller.
    pub copies: i64,
    /// Messages carrying its id sent by outboxd.
    pub outboxd_copies: i64,
    pub key_mismatches: i64,
    pub payload_mismatches: i64,
    /// First poller copy's broker timestamp minus the capture time, in milliseconds.
    pub latency_ms: Option<f64>,
}

/// What the shadow found. Every count named as a fault must be 0.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// Events the poller owns, captured since the attach.
    pub events: i64,
    /// Rows already in the table at the attach (not judged).
    pub before_attach: i64,
    /// Found on the broker at least once.
    pub published: i64,
    /// Found more than once (the poller's at-least-once duplicates).
    pub duplicated: i64,
    /// Copies beyond the first, summed.
    pub extra_copies: i64,
    /// Neither marked nor found: the poller has not got to them yet.
    pub unpublished: i64,
    /// Marked published, not found yet, younger than the grace.
    pub in_flight: i64,
    /// Fault: marked published by the poller, not on the broker after the grace.
    pub lost: i64,
    /// Fault: found with another key than the committed aggregate id.
    pub key_mismatches: i64,
    /// Fault: found with another payload than the committed one.
    pub payload_mismatches: i64,
    /// Fault: events sent by both relays (an event of one owner published by the other).
    pub both_owners: i64,
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    pub latency_max_ms: Option<f64>,
    /// Messages read that carry no parseable event id (not the poller's, or not an event).
    pub without_id: i64,
}

impl Report {
    /// Classifies the poller's events. `outboxd_events_by_poller`: outboxd's events that a
    /// message without outboxd's headers also carries (the poller published what it does not
    /// own).
    pub fn from_events(
        events: &[LegacyEvent],
        outboxd_events_by_poller: i64,
        grace: Duration,
        without_id: i64,
    ) -> Report {
        let mut r = Report {
            both_owners: outboxd_events_by_poller,
            without_id,
            ..Report::default()
        };
        let mut latencies = Vec::new();
        for e in events {
            if e.outboxd_copies > 0 {
                r.both_owners += 1;
            }
            if e.before_attach {
                r.before_attach += 1;
                continue;
            }
            r.events += 1;
            if e.copies > 0 {
                r.published += 1;
                if e.copies > 1 {
                    r.duplicated += 1;
                    r.extra_copies += e.copies - 1;
                }
            } else if !e.marked {
                r.unpublished += 1;
            } else if e.age_secs > grace.as_secs_f64() {
                r.lost += 1;
            } else {
                r.in_flight += 1;
            }
            if e.key_mismatches > 0 {
                r.key_mismatches += 1;
            }
            if e.payload_mismatches > 0 {
                r.payload_mismatches += 1;
            }
            if let Some(l) = e.latency_ms {
                latencies.push(l);
            }
        }
        latencies.sort_by(f64::total_cmp);
        let q = |p: f64| -> Option<f64> {
            (!latencies.is_empty()).then(|| {
                let i = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len());
                latencies[i - 1]
            })
        };
        r.latency_p50_ms = q(0.50);
        r.latency_p99_ms = q(0.99);
        r.latency_max_ms = latencies.last().copied();
        r
    }

    /// The faults, which must all be 0.
    pub fn faults(&self) -> i64 {
        self.lost + self.key_mismatches + self.payload_mismatches + self.both_owners
    }

    /// The report as Prometheus gauges in the text exposition format, one `outboxd_shadow_*`
    /// gauge per field (latencies in seconds, by quantile; absent until one is measured),
    /// plus the time of the round: what `--metrics-file` writes for node_exporter's textfile
    /// collector, so the team alerts on the poller's loss before and during the switch.
    pub fn prometheus(&self, at_unix_secs: f64) -> String {
        let counts: [(&str, i64, &str); 12] = [
            (
                "events",
                self.events,
                "Poller events captured since the attach.",
            ),
            (
                "before_attach",
                self.before_attach,
                "Rows already in the poller table at the attach (not judged).",
            ),
            (
                "published",
                self.published,
                "Poller events found on the broker by id.",
            ),
            (
                "duplicated",
                self.duplicated,
                "Poller events found more than once.",
            ),
            (
                "extra_copies",
                self.extra_copies,
                "Copies beyond the first, summed.",
            ),
            (
                "unpublished",
                self.unpublished,
                "Poller events neither marked nor found yet.",
            ),
            (
                "in_flight",
                self.in_flight,
                "Marked published, not found yet, younger than the grace.",
            ),
            (
                "lost",
                self.lost,
                "FAULT: marked published by the poller, not on the broker after the grace.",
            ),
            (
                "key_mismatches",
                self.key_mismatches,
                "FAULT: events found under another key than the committed aggregate id.",
            ),
            (
                "payload_mismatches",
                self.payload_mismatches,
                "FAULT: events found with another payload than the committed one.",
            ),
            (
                "both_owners",
                self.both_owners,
                "FAULT: events published by both relays.",
            ),
            (
                "without_id",
                self.without_id,
                "Messages read that carry no event id.",
            ),
        ];
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, samples: &[(String, String)]| {
            out.push_str(&format!(
                "# HELP outboxd_shadow_{name} {help}\n# TYPE outboxd_shadow_{name} gauge\n"
            ));
            for (labels, value) in samples {
                out.push_str(&format!("outboxd_shadow_{name}{labels} {value}\n"));
            }
        };
        for (name, v, help) in counts {
            gauge(name, help, &[(String::new(), v.to_string())]);
        }
        gauge(
            "faults",
            "Sum of the FAULT gauges; must be 0.",
            &[(String::new(), self.faults().to_string())],
        );
        let latencies: Vec<(String, String)> = [
            ("0.5", self.latency_p50_ms),
            ("0.99", self.latency_p99_ms),
            ("1", self.latency_max_ms),
        ]
        .into_iter()
        .filter_map(|(q, ms)| {
            ms.map(|ms| (format!("{{quantile=\"{q}\"}}"), (ms / 1e3).to_string()))
        })
        .collect();
        gauge(
            "latency_seconds",
            "Capture to the first poller copy's broker timestamp, by quantile (1 = max).",
            &latencies,
        );
        gauge(
            "last_round_timestamp_seconds",
            "When the shadow last read the topics and reported.",
            &[(String::new(), format!("{at_unix_secs:.3}"))],
        );
        out
    }

    fn table(&self) -> String {
        let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1} ms"));
        format!(
            "poller events since attach   {}\n\
             published (found by id)      {}\n\
             duplicated                   {} ({} extra copies)\n\
             not published yet            {}\n\
             marked, in flight            {}\n\
             LOST (marked, not on broker) {}\n\
             KEY MISMATCH                 {}\n\
             PAYLOAD MISMATCH             {}\n\
             PUBLISHED BY BOTH RELAYS     {}\n\
             latency p50 / p99 / max      {} / {} / {}\n\
             rows before attach           {} (not judged)\n\
             messages without an id       {}",
            self.events,
            self.published,
            self.duplicated,
            self.extra_copies,
            self.unpublished,
            self.in_flight,
            self.lost,
            self.key_mismatches,
            self.payload_mismatches,
            self.both_owners,
            ms(self.latency_p50_ms),
            ms(self.latency_p99_ms),
            ms(self.latency_max_ms),
            self.before_attach,
            self.without_id
        )
    }
}

/// One message that carries an event id.
struct Observation {
    topic: String,
    partition: i32,
    offset: i64,
    event_id: uuid::Uuid,
    key: Option<String>,
    payload: Option<String>,
    broker_ms: Option<i64>,
    by_outboxd: bool,
}

/// What one read of the topics found.
#[derive(Default)]
struct Read {
    observations: Vec<Observation>,
    /// (topic, partition) -> the next offset to read.
    next: BTreeMap<(String, i32), i64>,
    without_id: i64,
    missing: Vec<String>,
}

pub async fn run(a: ShadowArgs) -> anyhow::Result<()> {
    let client = connect(&a.db.url()?).await?;
    loop {
        let report = round(&client, &a).await?;
        if let Some(path) = &a.metrics_file {
            write_metrics(path, &report)?;
        }
        if a.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            println!("{}", report.table());
        }
        if a.once {
            if report.faults() > 0 {
                std::process::exit(EXIT_FINDINGS);
            }
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(a.interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// Writes the report's gauges to `path` atomically (a temporary file beside it, renamed): a
/// collector never reads half a file.
fn write_metrics(path: &std::path::Path, report: &Report) -> anyhow::Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let tmp = path.with_extension("prom.tmp");
    std::fs::write(&tmp, report.prometheus(now))
        .with_context(|| format!("writing the shadow's metrics to {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("moving the shadow's metrics into {}", path.display()))?;
    Ok(())
}

/// Reads what is new on the topics, records it, and reports on everything recorded.
async fn round(client: &Client, a: &ShadowArgs) -> anyhow::Result<Report> {
    let topics = if a.topics.is_empty() {
        default_topics(client).await?
    } else {
        a.topics.clone()
    };
    if topics.is_empty() {
        anyhow::bail!("no topic to read: no row has been captured yet; pass --topic for each topic the poller publishes to");
    }
    let offsets: BTreeMap<(String, i32), i64> = client
        .query(
            "SELECT topic, partition, next_offset FROM outbox.shadow_offsets",
            &[],
        )
        .await
        .context("reading outbox.shadow_offsets (has `outboxd migrate` run?)")?
        .iter()
        .map(|r| ((r.get(0), r.get(1)), r.get(2)))
        .collect();
    let (bootstrap, props, id_header) = (
        a.bootstrap_servers.clone(),
        a.kafka_properties.clone(),
        a.id_header.clone(),
    );
    let read = tokio::task::spawn_blocking(move || {
        read_blocking(&bootstrap, &props, &topics, &offsets, &id_header)
    })
    .await
    .context("the topic reader panicked")??;
    for t in &read.missing {
        eprintln!("outboxd shadow: topic {t} does not exist (yet)");
    }
    record(client, &read).await?;
    let events = client
        .query(
            "SELECT before_attach, marked,
                    extract(epoch FROM clock_timestamp() - captured_at)::float8,
                    copies, outboxd_copies, key_mismatches, payload_mismatches,
                    (extract(epoch FROM first_broker_time - captured_at) * 1000)::float8
             FROM outbox.shadow_events()",
            &[],
        )
        .await
        .context("reading outbox.shadow_events()")?
        .iter()
        .map(|r| LegacyEvent {
            before_attach: r.get(0),
            marked: r.get(1),
            age_secs: r.get(2),
            copies: r.get(3),
            outboxd_copies: r.get(4),
            key_mismatches: r.get(5),
            payload_mismatches: r.get(6),
            latency_ms: r.get(7),
        })
        .collect::<Vec<_>>();
    let outboxd_by_poller: i64 = client
        .query_one(
            "SELECT count(DISTINCT o.event_id) FROM outbox.shadow_observations o
             JOIN outbox.events e ON e.event_id = o.event_id WHERE NOT o.by_outboxd",
            &[],
        )
        .await
        .context("counting outboxd's events published by the poller")?
        .get(0);
    let without_id: i64 = read.without_id;
    Ok(Report::from_events(
        &events,
        outboxd_by_poller,
        a.grace,
        without_id,
    ))
}

/// The topics outboxd's routes give the captured rows (Debezium naming by default).
async fn default_topics(client: &Client) -> anyhow::Result<Vec<String>> {
    Ok(client
        .query(
            "SELECT DISTINCT replace(r.topic, '{aggregate_id}', '') FROM
               (SELECT DISTINCT aggregate_type, event_type FROM outbox.legacy_events) l,
               LATERAL outbox.resolve_route(l.aggregate_type, l.event_type) r
             WHERE r.kind = 'kafka' ORDER BY 1",
            &[],
        )
        .await
        .context("resolving the poller's topics from outboxd's routes")?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

fn read_blocking(
    bootstrap: &str,
    props: &[(String, String)],
    topics: &[String],
    offsets: &BTreeMap<(String, i32), i64>,
    id_header: &str,
) -> anyhow::Result<Read> {
    let consumer = crate::topics::consumer(bootstrap, props, "shadow")?;
    let mut read = Read::default();
    for topic in topics {
        let marks = crate::topics::read_topic(
            &consumer,
            bootstrap,
            topic,
            &|p, low| offsets.get(&(topic.clone(), p)).copied().unwrap_or(low),
            &mut |m| {
                let id = crate::topics::header(m, id_header)
                    .and_then(|h| uuid::Uuid::parse_str(h.trim()).ok());
                match id {
                    Some(event_id) => read.observations.push(Observation {
                        topic: topic.clone(),
                        partition: m.partition(),
                        offset: m.offset(),
                        event_id,
                        key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                        payload: m.payload().map(|p| String::from_utf8_lossy(p).into_owned()),
                        broker_ms: m.timestamp().to_millis(),
                        // outboxd's envelope headers; a poller does not send them.
                        by_outboxd: crate::topics::header(m, "envelope_generation").is_some(),
                    }),
                    None => read.without_id += 1,
                }
                Ok(())
            },
        )?;
        match marks {
            Some(marks) => {
                for (p, (_, high)) in marks {
                    read.next.insert((topic.clone(), p), high);
                }
            }
            None => read.missing.push(topic.clone()),
        }
    }
    Ok(read)
}

/// Records the observations and the next offsets in one transaction, so a crash re-reads a
/// range rather than skipping it (and re-recording a message is a no-op).
async fn record(client: &Client, read: &Read) -> anyhow::Result<()> {
    client
        .batch_execute("BEGIN")
        .await
        .context("recording observations")?;
    for chunk in read.observations.chunks(1000) {
        let topics: Vec<&str> = chunk.iter().map(|o| o.topic.as_str()).collect();
        let partitions: Vec<i32> = chunk.iter().map(|o| o.partition).collect();
        let offsets: Vec<i64> = chunk.iter().map(|o| o.offset).collect();
        let ids: Vec<uuid::Uuid> = chunk.iter().map(|o| o.event_id).collect();
        let keys: Vec<Option<&str>> = chunk.iter().map(|o| o.key.as_deref()).collect();
        let payloads: Vec<Option<&str>> = chunk.iter().map(|o| o.payload.as_deref()).collect();
        let times: Vec<Option<i64>> = chunk.iter().map(|o| o.broker_ms).collect();
        let by: Vec<bool> = chunk.iter().map(|o| o.by_outboxd).collect();
        client
            .execute(
                "INSERT INTO outbox.shadow_observations
                   (topic, partition, \"offset\", event_id, message_key, payload_digest, broker_time, by_outboxd)
                 SELECT t, p, o, i, k, outbox.json_text_digest(v), to_timestamp(ms / 1000.0), b
                 FROM unnest($1::text[], $2::int[], $3::bigint[], $4::uuid[], $5::text[], $6::text[], $7::bigint[], $8::bool[])
                      AS x(t, p, o, i, k, v, ms, b)
                 ON CONFLICT DO NOTHING",
                &[&topics, &partitions, &offsets, &ids, &keys, &payloads, &times, &by],
            )
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "recording observations: {}",
                    outbox_ledger::describe_db_error(&e)
                )
            })?;
    }
    for ((topic, partition), next) in &read.next {
        client
            .execute(
                "INSERT INTO outbox.shadow_offsets (topic, partition, next_offset) VALUES ($1, $2, $3)
                 ON CONFLICT (topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset",
                &[topic, partition, next],
            )
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "recording shadow offsets: {}",
                    outbox_ledger::describe_db_error(&e)
                )
            })?;
    }
    client
        .batch_execute("COMMIT")
        .await
        .context("recording observations")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(copies: i64, marked: bool, age: f64) -> LegacyEvent {
        LegacyEvent {
            marked,
            age_secs: age,
            copies,
            latency_ms: (copies > 0).then_some(10.0 * copies as f64),
            ..LegacyEvent::default()
        }
    }

    #[test]
    fn the_metrics_file_carries_every_count_and_the_faults() {
        let events = [ev(2, true, 100.0), ev(0, true, 100.0)];
        let r = Report::from_events(&events, 3, Duration::from_secs(60), 7);
        let text = r.prometheus(1_700_000_000.5);
        let value = |series: &str| -> Option<f64> {
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        };
        assert_eq!(value("outboxd_shadow_lost"), Some(1.0), "{text}");
        assert_eq!(value("outboxd_shadow_both_owners"), Some(3.0), "{text}");
        assert_eq!(value("outboxd_shadow_faults"), Some(4.0), "{text}");
        assert_eq!(value("outboxd_shadow_without_id"), Some(7.0), "{text}");
        assert_eq!(value("outboxd_shadow_extra_copies"), Some(1.0), "{text}");
        assert_eq!(
            value("outboxd_shadow_latency_seconds{quantile=\"1\"}"),
            Some(0.02),
            "{text}"
        );
        // Every sample has its HELP and TYPE lines.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap();
            assert!(text.contains(&format!("# TYPE {name} gauge")), "{l}");
        }
    }

    #[test]
    fn each_event_lands_in_exactly_one_bucket() {
        let events = [
            ev(1, true, 100.0),  // published
            ev(3, true, 100.0),  // duplicated, 2 extra
            ev(0, false, 100.0), // not published yet
            ev(0, true, 5.0),    // marked, in flight
            ev(0, true, 100.0),  // lost
        ];
        let r = Report::from_events(&events, 0, Duration::from_secs(60), 0);
        assert_eq!(
            (r.events, r.published, r.duplicated, r.extra_copies),
            (5, 2, 1, 2)
        );
        assert_eq!((r.unpublished, r.in_flight, r.lost), (1, 1, 1));
        assert_eq!(r.published + r.unpublished + r.in_flight + r.lost, r.events);
        assert_eq!(r.faults(), 1);
    }

    #[test]
    fn every_fault_counter_can_become_non_zero() {
        let grace = Duration::from_secs(1);
        let clean = Report::from_events(&[ev(1, true, 9.0)], 0, grace, 0);
        assert_eq!(clean.faults(), 0);
        let lost = Report::from_events(&[ev(0, true, 9.0)], 0, grace, 0);
        assert_eq!(lost.lost, 1);
        let key = LegacyEvent {
            key_mismatches: 1,
            ..ev(1, true, 9.0)
        };
        assert_eq!(Report::from_events(&[key], 0, grace, 0).key_mismatches, 1);
        let payload = LegacyEvent {
            payload_mismatches: 1,
            ..ev(1, true, 9.0)
        };
        assert_eq!(
            Report::from_events(&[payload], 0, grace, 0).payload_mismatches,
            1
        );
        let both = LegacyEvent {
            outboxd_copies: 1,
            ..ev(1, true, 9.0)
        };
        assert_eq!(Report::from_events(&[both], 0, grace, 0).both_owners, 1);
        assert_eq!(
            Report::from_events(&[ev(1, true, 9.0)], 2, grace, 0).both_owners,
            2
        );
    }

    #[test]
    fn rows_from_before_the_attach_are_counted_but_not_judged() {
        let old = LegacyEvent {
            before_attach: true,
            ..ev(0, true, 1e6)
        };
        let r = Report::from_events(&[old], 0, Duration::from_secs(1), 0);
        assert_eq!((r.before_attach, r.events, r.lost), (1, 0, 0));
    }

    #[test]
    fn latency_quantiles_are_nearest_rank() {
        let events: Vec<_> = (1..=100)
            .map(|i| LegacyEvent {
                copies: 1,
                marked: true,
                latency_ms: Some(i as f64),
                ..LegacyEvent::default()
            })
            .collect();
        let r = Report::from_events(&events, 0, Duration::from_secs(1), 0);
        assert_eq!(r.latency_p50_ms, Some(50.0));
        assert_eq!(r.latency_p99_ms, Some(99.0));
        assert_eq!(r.latency_max_ms, Some(100.0));
    }
}
