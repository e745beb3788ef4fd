//! The polling baseline: the relay design a CDC relay replaces (seed 001). A worker claims a
//! small batch in a short transaction (`FOR UPDATE SKIP LOCKED`, setting a claim lease),
//! publishes outside any lock, waits for the broker's acknowledgements, then marks the rows
//! `published_at`.
//!
//! Same workload: its database is migrated like the relay's, the producers call the same
//! `outbox.enqueue`, and the poller reads `outbox.events` itself, with the columns a polling
//! design adds (`seq`, claim lease, `published_at`) and its partial index of pending rows. It
//! publishes to the same broker with the relay's producer settings (idempotent, `acks=all`,
//! key = aggregate id, the same envelope headers), one worker so each aggregate keeps one
//! ordered lane. It runs inside the bench process; what is compared is its throughput, its
//! latency and the PostgreSQL CPU it costs per event.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

use super::workload::{self, Target};
use super::{Ctx, Phase, PhaseMeter, Scenario, Steady};

/// What a polling design adds to the outbox table (no slot exists in this database, so the
/// publication costs nothing here).
const SCHEMA: &str = "
ALTER TABLE outbox.events ADD COLUMN seq bigserial, ADD COLUMN claimed_by text,
    ADD COLUMN claim_until timestamptz, ADD COLUMN published_at timestamptz;
CREATE INDEX events_pending_idx ON outbox.events (seq) WHERE published_at IS NULL;
";

/// The claim: a short transaction of its own (autocommit). The batch is chosen through the
/// partial index of pending rows; the rows are updated through the primary key.
const CLAIM: &str = "
UPDATE outbox.events SET claimed_by = 'bench', claim_until = clock_timestamp() + interval '30 seconds'
WHERE event_id = ANY(ARRAY(
    SELECT event_id FROM outbox.events
    WHERE published_at IS NULL AND (claim_until IS NULL OR claim_until < clock_timestamp())
    ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED))
RETURNING seq, event_id, dest_topic, dest_key, payload::text, aggregate_type, aggregate_id,
          aggregate_version::text, event_type, envelope_generation::text, payload_digest,
          occurred_at::text";

const MARK: &str =
    "UPDATE outbox.events SET published_at = clock_timestamp() WHERE event_id = ANY($1)";

/// The high watermark of each partition of `topic`, in partition order.
pub fn high_watermarks(bootstrap: &str, topic: &str, partitions: i32) -> anyhow::Result<Vec<i64>> {
    Ok(watermarks(bootstrap, topic, partitions)?
        .into_iter()
        .map(|(_, high)| high)
        .collect())
}

/// (log start, high watermark) of each partition of `topic`.
fn watermarks(bootstrap: &str, topic: &str, partitions: i32) -> anyhow::Result<Vec<(i64, i64)>> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "outboxd-bench-watermarks")
        .create()
        .context("creating a watermark client")?;
    (0..partitions)
        .map(|p| {
            c.fetch_watermarks(topic, p, Duration::from_secs(10))
                .with_context(|| format!("watermarks of {topic}/{p}"))
        })
        .collect()
}

/// Copies of each event id (header `id`) in `topic` from the offsets `from` (one per
/// partition) up to the high watermarks of now. A message without an `id` header is an error:
/// the bench's topics hold only the relay's messages.
pub fn copies_since(
    bootstrap: &str,
    topic: &str,
    from: &[i64],
) -> anyhow::Result<std::collections::HashMap<Uuid, u32>> {
    let mut copies = std::collections::HashMap::new();
    for m in messages_since(bootstrap, topic, from)? {
        *copies.entry(m.id).or_insert(0) += 1;
    }
    Ok(copies)
}

/// One message of a bench topic: its event id (header `id`) and its timestamp.
#[derive(Debug, Clone, Copy)]
pub struct TopicMessage {
    pub id: Uuid,
    /// Milliseconds since the epoch.
    pub timestamp_ms: i64,
    /// Whether the broker set the timestamp when it appended the message
    /// (`message.timestamp.type=LogAppendTime`), rather than the producer.
    pub log_append_time: bool,
}

/// Every message of `topic` from the offsets `from` (one per partition) up to the high
/// watermarks of now, in no particular order. A message without an `id` header is an error.
pub fn messages_since(
    bootstrap: &str,
    topic: &str,
    from: &[i64],
) -> anyhow::Result<Vec<TopicMessage>> {
    use rdkafka::message::{Headers, Message, Timestamp};
    use rdkafka::{Offset, TopicPartitionList};
    let marks = watermarks(bootstrap, topic, from.len() as i32)?;
    // A broker that deleted part of what is to be counted cannot answer: say so, not "missing".
    for (p, (&f, &(low, _))) in from.iter().zip(&marks).enumerate() {
        if low > f {
            anyhow::bail!(
                "{topic}/{p}: the messages from offset {f} on are needed and the broker's log starts at {low}: they were deleted. librdkafka's mock cluster (--broker embedded) keeps the last 100,000 messages or 5 MiB per partition; use fewer --crash-secs, more --partitions, or --broker apache"
            );
        }
    }
    let until: Vec<i64> = marks.iter().map(|(_, high)| *high).collect();
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "outboxd-bench-copies")
        .set("enable.auto.commit", "false")
        .create()
        .context("creating a topic reader")?;
    let mut tpl = TopicPartitionList::new();
    let mut left = 0i64;
    for (p, (&f, &u)) in from.iter().zip(&until).enumerate() {
        if u > f {
            tpl.add_partition_offset(topic, p as i32, Offset::Offset(f))
                .context("assigning a partition")?;
            left += u - f;
        }
    }
    let mut out = Vec::with_capacity(left.max(0) as usize);
    if left == 0 {
        return Ok(out);
    }
    c.assign(&tpl).context("assigning the topic's partitions")?;
    // About 100,000 messages a second are read; a 1,000,000-event backlog takes ~10 s.
    let budget = Duration::from_secs(120 + left as u64 / 10_000);
    let deadline = Instant::now() + budget;
    while left > 0 {
        if Instant::now() > deadline {
            anyhow::bail!(
                "reading {topic}: {left} messages not read within {} s",
                budget.as_secs()
            );
        }
        let Some(m) = c.poll(Duration::from_millis(500)) else {
            continue;
        };
        let m = m.with_context(|| format!("reading {topic}"))?;
        if m.offset() >= until[m.partition() as usize] {
            continue;
        }
        left -= 1;
        let id = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "id"))
            .and_then(|h| h.value)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.parse::<Uuid>().ok())
            .with_context(|| {
                format!(
                    "{topic}/{}@{}: a message without an event id header",
                    m.partition(),
                    m.offset()
                )
            })?;
        let (timestamp_ms, log_append_time) = match m.timestamp() {
            Timestamp::LogAppendTime(t) => (t, true),
            Timestamp::CreateTime(t) => (t, false),
            Timestamp::NotAvailable => (0, false),
        };
        out.push(TopicMessage {
            id,
            timestamp_ms,
            log_append_time,
        });
    }
    Ok(out)
}

/// Drain of the same backlog, then the same steady rate; returns (drain, steady, drain series).
pub async fn baseline(
    ctx: &Ctx,
    sc: &Scenario,
) -> anyhow::Result<(Phase, Steady, Vec<(f64, f64)>)> {
    let a = &ctx.args;
    let sc = &Scenario {
        events: sc.events.min(a.poll_events.max(1)),
        ..sc.clone()
    };
    let url = ctx
        .pg
        .create_database(&format!("bench_poll_{}", sc.name))
        .await?;
    outboxd::migrate(&url).await?;
    let client = outboxd::connect(&url).await?;
    client
        .batch_execute(SCHEMA)
        .await
        .context("adding the polling columns")?;
    let agg_type = format!("poll_{}", sc.name);
    ctx.kafka
        .create_topic(&format!("outbox.event.{agg_type}"), a.partitions)
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    // The same backlog, enqueued the same way.
    let db = super::Db {
        url: url.clone(),
        client,
        slot: String::new(),
        recv_slot: String::new(),
        agg_type: agg_type.clone(),
    };
    workload::enqueue_backlog(&db, sc, a.txn_size).await?;
    let client = db.client;
    client.batch_execute("VACUUM ANALYZE outbox.events").await?;

    let stop = Arc::new(AtomicBool::new(false));
    let mut m = PhaseMeter::start(ctx.postmaster);
    let poller = tokio::spawn(run_poller(
        outboxd::connect(&url).await?,
        ctx.bootstrap.clone(),
        a.poll_batch,
        Duration::from_millis(a.poll_interval_ms),
        stop.clone(),
    ));
    let pending = || async {
        let r = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM outbox.events WHERE published_at IS NULL)",
                &[],
            )
            .await?;
        anyhow::Ok(r.get::<_, bool>(0))
    };
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        m.cpu.sample();
        if poller.is_finished() {
            break;
        }
        if !pending().await? {
            break;
        }
        if m.started.elapsed() > Duration::from_secs(a.timeout_secs) {
            anyhow::bail!("the polling relay did not drain its backlog in time");
        }
    }
    let secs = m.started.elapsed().as_secs_f64();
    m.cpu.sample();
    let drain = m.phase(sc.events, secs, 0.0);
    let series = workload::series(&client, "outbox.events.published_at", m.started_epoch).await?;

    let mut m = PhaseMeter::start(ctx.postmaster);
    let writers = workload::Writers::start(
        ctx,
        &url,
        Target::Poll(agg_type.clone()),
        sc,
        a.rate as f64,
        Duration::from_secs_f64(a.steady_secs),
    )
    .await?;
    while !writers.finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        m.cpu.sample();
    }
    let committed = writers.join().await?;
    let produced_secs = m.started.elapsed().as_secs_f64();
    while pending().await? && !poller.is_finished() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    m.cpu.sample();
    stop.store(true, Ordering::Relaxed);
    poller.await??;
    let accepted = workload::accepted_times(&client, &committed, Target::Poll(agg_type)).await?;
    workload::all_accepted(&client, &committed, &accepted, "polling steady phase").await?;
    let n = committed.len() as u64;
    let steady = Steady {
        target_rate: a.rate as f64,
        achieved_rate: n as f64 / produced_secs,
        phase: m.phase(n, produced_secs, 0.0),
        latency: workload::latencies(&committed, &accepted, m.started_epoch),
        rss_steady_mib: 0.0,
        walsender_unsent_mib: (0.0, 0.0),
        autovacuum_s: 0.0,
        checkpoints: 0,
    };
    Ok((drain, steady, series))
}

async fn run_poller(
    client: tokio_postgres::Client,
    bootstrap: String,
    batch: i64,
    interval: Duration,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("linger.ms", "2")
        .set("queue.buffering.max.messages", "200000")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .context("creating the polling relay's producer")?;
    let claim = client.prepare(CLAIM).await?;
    let mark = client.prepare(MARK).await?;
    while !stop.load(Ordering::Relaxed) {
        let mut rows = client
            .query(&claim, &[&batch])
            .await
            .context("claiming a batch")?;
        if rows.is_empty() {
            tokio::time::sleep(interval).await;
            continue;
        }
        rows.sort_by_key(|r| r.get::<_, i64>(0));
        let mut acks = Vec::with_capacity(rows.len());
        for r in &rows {
            let id = r.get::<_, Uuid>(1).to_string();
            let topic: &str = r.get(2);
            let key: &str = r.get(3);
            let payload: &str = r.get(4);
            // The relay's envelope headers (outbox_sink::event_headers), from the row.
            let mut headers = OwnedHeaders::new_with_capacity(8).insert(Header {
                key: "id",
                value: Some(&id),
            });
            for (i, name) in [
                "aggregate_type",
                "aggregate_id",
                "aggregate_version",
                "event_type",
                "envelope_generation",
                "payload_digest",
                "occurred_at",
            ]
            .into_iter()
            .enumerate()
            {
                let v: &str = r.get(5 + i);
                headers = headers.insert(Header {
                    key: name,
                    value: Some(v),
                });
            }
            loop {
                let rec = FutureRecord::to(topic)
                    .key(key)
                    .payload(payload)
                    .headers(headers.clone());
                match producer.send_result(rec) {
                    Ok(f) => {
                        acks.push(f);
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    Err((e, _)) => return Err(e).context("polling relay: enqueue"),
                }
            }
        }
        for f in acks {
            match f.await {
                Ok(Ok(_)) => {}
                Ok(Err((e, _))) => return Err(e).context("polling relay: delivery"),
                Err(_) => anyhow::bail!("polling relay: delivery report lost"),
            }
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.get(1)).collect();
        client
            .execute(&mark, &[&ids])
            .await
            .context("marking published")?;
    }
    Ok(())
}
