//! Reading a topic's partitions up to the high watermark they had when the read began: the one
//! broker reader behind `outboxd reconcile` (every message, from the low watermark) and
//! `outboxd shadow` (from where its last read stopped). Blocking (librdkafka's consumer);
//! callers run it on a blocking thread.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const TIMEOUT: Duration = Duration::from_secs(30);

/// A consumer for reading by assignment (no group offsets are committed). Only the
/// connection settings of `properties` apply (security.*, sasl.*, ssl.*): producer-only
/// settings would make the consumer refuse to start.
pub fn consumer(
    bootstrap: &str,
    properties: &[(String, String)],
    purpose: &str,
) -> anyhow::Result<BaseConsumer> {
    let mut cc = ClientConfig::new();
    for (k, v) in properties {
        if k.starts_with("security.") || k.starts_with("sasl.") || k.starts_with("ssl.") {
            cc.set(k, v);
        }
    }
    cc.set("bootstrap.servers", bootstrap)
        .set(
            "group.id",
            format!("outboxd-{purpose}-{}", uuid::Uuid::new_v4()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        // Retention moving the log start during the read: go on from the new start rather
        // than jump to the end (which would stall the read).
        .set("auto.offset.reset", "earliest")
        .create()
        .with_context(|| format!("creating a Kafka consumer for {bootstrap}"))
}

/// Every partition of a topic that was read: (low watermark after the read, high watermark
/// the read went up to).
pub type Watermarks = BTreeMap<i32, (i64, i64)>;

/// Reads every partition of `topic` from `start(partition, low watermark)` (never below the
/// low watermark) up to the high watermark read before the first fetch, calling `visit` for
/// each message in that range. `None`: the broker has no such topic.
pub fn read_topic(
    consumer: &BaseConsumer,
    bootstrap: &str,
    topic: &str,
    start: &dyn Fn(i32, i64) -> i64,
    visit: &mut dyn FnMut(&BorrowedMessage<'_>) -> anyhow::Result<()>,
) -> anyhow::Result<Option<Watermarks>> {
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
        return Ok(None);
    }
    let mut tpl = TopicPartitionList::new();
    let mut todo = HashMap::new();
    let mut marks = BTreeMap::new();
    for p in &partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, *p, TIMEOUT)
            .with_context(|| format!("reading watermarks of {topic}/{p}"))?;
        marks.insert(*p, (low, high));
        let from = start(*p, low).max(low);
        if high > from {
            todo.insert(*p, (from, high));
            tpl.add_partition_offset(topic, *p, Offset::Offset(from))?;
        }
    }
    if todo.is_empty() {
        return Ok(Some(marks));
    }
    consumer
        .assign(&tpl)
        .with_context(|| format!("assigning {topic}"))?;
    let mut next: HashMap<i32, i64> = todo.iter().map(|(p, (from, _))| (*p, *from)).collect();
    let mut last_progress = Instant::now();
    while todo.iter().any(|(p, (_, h))| next[p] < *h) {
        if last_progress.elapsed() > TIMEOUT {
            anyhow::bail!(
                "reading topic {topic} stalled for {}s (positions {next:?}, high watermarks {todo:?}); is the broker healthy?",
                TIMEOUT.as_secs()
            );
        }
        let Some(r) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let m = r.with_context(|| format!("reading topic {topic}"))?;
        last_progress = Instant::now();
        next.insert(m.partition(), m.offset() + 1);
        if m.offset() >= todo.get(&m.partition()).map_or(0, |(_, h)| *h) {
            // Published after the read began: outside what it reports on.
            continue;
        }
        visit(&m)?;
    }
    consumer.unassign().ok();
    // The log start may have moved while the topic was read: an offset below the new one was
    // deleted by retention, not lost.
    for (p, (low, _)) in marks.iter_mut() {
        if let Ok((l, _)) = consumer.fetch_watermarks(topic, *p, TIMEOUT) {
            *low = (*low).max(l);
        }
    }
    Ok(Some(marks))
}

/// A header's value as text (lossy), if the message has it.
pub fn header(m: &BorrowedMessage<'_>, name: &str) -> Option<String> {
    m.headers().and_then(|h| {
        h.iter()
            .find(|hd| hd.key == name)
            .map(|hd| String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned())
    })
}
