//! The polling baseline: outboxd's own poll mode (`outboxd run --mode poll`, the design a CDC
//! relay replaces, made as safe as the CDC mode: the same ledger, receipts, ordering and
//! lease), so the comparison is between two modes of one product.
//!
//! Same workload: its database is migrated like the relay's, the producers call the same
//! `outbox.enqueue`, no slot exists in it, and the relay is the same `outboxd` binary with
//! `--mode poll --poll-interval-ms` (`--poll-interval-ms` of the bench). What is compared is
//! its throughput, its latency and the PostgreSQL CPU it costs per event.

use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use uuid::Uuid;

use super::workload::{self, Target};
use super::{Ctx, Phase, PhaseMeter, RelayChild, Scenario, Steady};

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
        plain_writers: false,
    };
    workload::enqueue_backlog(&db, sc, a.txn_size).await?;
    let client = db.client;
    client.batch_execute("VACUUM ANALYZE outbox.events").await?;

    let receipts = || async {
        let r = client
            .query_one("SELECT count(*) FROM outbox.receipts", &[])
            .await?;
        anyhow::Ok(r.get::<_, i64>(0))
    };
    let interval = a.poll_interval_ms.to_string();
    let mut m = PhaseMeter::start(ctx.postmaster);
    let relay = RelayChild::spawn_with(
        ctx,
        &url,
        "bench_poll",
        &["--mode", "poll", "--poll-interval-ms", &interval],
    )?;
    let mut n = 0u64;
    while receipts().await? < sc.events as i64 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        n += 1;
        if n % 2 == 0 {
            m.cpu.sample();
        }
        relay.check_alive()?;
        if m.started.elapsed() > Duration::from_secs(a.timeout_secs) {
            anyhow::bail!(
                "the poll-mode relay did not drain {} events within {} s; see {}",
                sc.events,
                a.timeout_secs,
                relay.log.display()
            );
        }
    }
    let secs = m.started.elapsed().as_secs_f64();
    m.cpu.sample();
    let drain = m.phase(sc.events, secs, relay.cpu_secs());
    let series = workload::receipt_series(&client, m.started_epoch).await?;

    let mut m = PhaseMeter::start(ctx.postmaster);
    let relay_cpu0 = relay.cpu_secs();
    let writers = workload::Writers::start(
        ctx,
        &url,
        Target::Outbox(agg_type.clone()),
        sc,
        a.rate as f64,
        Duration::from_secs_f64(a.steady_secs),
    )
    .await?;
    while !writers.finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        m.cpu.sample();
        relay.check_alive()?;
    }
    let committed = writers.join().await?;
    let produced_secs = m.started.elapsed().as_secs_f64();
    let wait = Instant::now();
    while receipts().await? < (sc.events as usize + committed.len()) as i64 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        relay.check_alive()?;
        if wait.elapsed() > Duration::from_secs(a.timeout_secs) {
            anyhow::bail!(
                "the poll-mode relay did not catch up after the steady phase; see {}",
                relay.log.display()
            );
        }
    }
    m.cpu.sample();
    let relay_cpu = relay.cpu_secs() - relay_cpu0;
    relay.terminate()?;
    let accepted = workload::accepted_times(&client, &committed, Target::Outbox(agg_type)).await?;
    workload::all_accepted(&client, &committed, &accepted, "poll-mode steady phase").await?;
    let n = committed.len() as u64;
    let steady = Steady {
        target_rate: a.rate as f64,
        achieved_rate: n as f64 / produced_secs,
        phase: m.phase(n, produced_secs, relay_cpu),
        latency: workload::latencies(&committed, &accepted, m.started_epoch),
        rss_steady_mib: 0.0,
        walsender_unsent_mib: (0.0, 0.0),
        autovacuum_s: 0.0,
        checkpoints: 0,
    };
    Ok((drain, steady, series))
}
