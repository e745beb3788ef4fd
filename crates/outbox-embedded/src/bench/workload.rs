//! The bench's producers: the backlog (enqueued with the relay stopped) and constant-rate
//! writers (one connection each, one autocommit statement per business transaction, so the
//! time the statement returns is the commit time seen by the producer).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::Rng;
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use uuid::Uuid;

use super::{epoch_now, Ctx, Db, Latency, Scenario};

/// Characters of `{"i": 0, "pad": ""}` around the padding, so a payload is about `payload` bytes.
const JSON_OVERHEAD: usize = 24;

pub fn pad_len(payload: usize) -> usize {
    payload.saturating_sub(JSON_OVERHEAD)
}

/// SQL for `len` characters of random hex: a payload TOAST cannot compress to nothing (a
/// 16 KiB run of one character would be stored, logged and decoded as a few bytes).
fn pad_sql(len: usize) -> String {
    if len == 0 {
        return "''".into();
    }
    format!(
        "(SELECT left(string_agg(md5(random()::text || g::text), ''), {len}) FROM generate_series(1, {}) g)",
        len.div_ceil(32)
    )
}

/// Enqueues the scenario's backlog with `outbox.enqueue`, in transactions of `txn_size`, on two
/// connections at once (the machine has two cores). Returns the seconds it took.
pub async fn enqueue_backlog(db: &Db, sc: &Scenario, txn_size: u64) -> anyhow::Result<f64> {
    let rows = if db.plain_writers {
        Rows::OutboxEvents
    } else {
        Rows::Enqueue
    };
    insert_backlog(&db.url, &db.agg_type, rows, sc, txn_size).await
}

/// How a backlog's rows are written.
enum Rows<'a> {
    /// `outbox.enqueue`.
    Enqueue,
    /// A plain INSERT into `outbox.events` (`--writer plain`).
    OutboxEvents,
    /// A plain INSERT into a Debezium-style outbox table.
    Debezium(&'a str),
}

/// The same backlog as [`enqueue_backlog`] (same transactions, keys and payloads), into a
/// Debezium-style outbox `table` (`producer::plain_outbox_ddl`) with plain INSERTs.
pub async fn insert_plain_backlog(
    url: &str,
    agg_type: &str,
    table: &str,
    sc: &Scenario,
    txn_size: u64,
) -> anyhow::Result<f64> {
    insert_backlog(url, agg_type, Rows::Debezium(table), sc, txn_size).await
}

async fn insert_backlog(
    url: &str,
    agg_type: &str,
    rows: Rows<'_>,
    sc: &Scenario,
    txn_size: u64,
) -> anyhow::Result<f64> {
    const CONNS: u64 = 2;
    let txns = sc.events.div_ceil(txn_size);
    let (head, tail) = match rows {
        Rows::Enqueue => ("PERFORM outbox.enqueue(".to_string(), ")"),
        Rows::OutboxEvents => (
            "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload) SELECT "
                .to_string(),
            "",
        ),
        Rows::Debezium(t) => (
            format!("INSERT INTO {t} (aggregatetype, aggregateid, type, payload) SELECT "),
            "",
        ),
    };
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..CONNS {
        let client = outboxd::connect(url).await?;
        let sql = format!(
            "DO $$ BEGIN
               FOR t IN 0..{last} LOOP
                 IF t % {CONNS} = {w} THEN
                   {head}'{agg}', 'a' || ((t * {size} + i) % {aggs}), 'bench.tick',
                       jsonb_build_object('i', t * {size} + i, 'pad', {pad_sql}){tail}
                   FROM generate_series(1, least({size}, {events} - t * {size})) i;
                   COMMIT;
                 END IF;
               END LOOP;
             END $$;",
            last = txns - 1,
            agg = agg_type,
            size = txn_size,
            aggs = sc.aggregates,
            pad_sql = pad_sql(pad_len(sc.payload)),
            events = sc.events,
        );
        tasks.push(tokio::spawn(async move {
            client
                .batch_execute(&sql)
                .await
                .context("enqueuing the backlog")
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// The WAL position after everything committed so far; then a logical message moves the WAL
/// past it, so `pg_recvlogical --endpos` sees a position beyond it and exits.
pub async fn backlog_end(client: &Client) -> anyhow::Result<String> {
    let end: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0);
    client
        .execute(
            "SELECT pg_logical_emit_message(false, 'outboxd.bench', '')",
            &[],
        )
        .await?;
    Ok(end)
}

/// Where the steady writers write, and where acceptance is read back.
#[derive(Debug, Clone)]
pub enum Target {
    /// `outbox.enqueue` with this aggregate type; accepted = `outbox.receipts.accepted_at`.
    Outbox(String),
    /// A plain INSERT into `outbox.events` with this aggregate type (`--writer plain`);
    /// accepted as for [`Target::Outbox`].
    OutboxPlain(String),
    /// A plain INSERT into a Debezium-style outbox table (aggregate type, table); accepted
    /// is read from the topic, not from the database (`debezium`).
    Plain(String, String),
}

impl Target {
    /// Where `db`'s writers write (`--writer`).
    pub fn of(db: &Db) -> Target {
        if db.plain_writers {
            Target::OutboxPlain(db.agg_type.clone())
        } else {
            Target::Outbox(db.agg_type.clone())
        }
    }

    fn insert_sql(&self) -> String {
        match self {
            Target::OutboxPlain(agg) => format!(
                "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload)
                 SELECT '{agg}', a, 'bench.tick', jsonb_build_object('i', 0, 'pad', $1::text)
                 FROM unnest($2::text[]) a RETURNING event_id"
            ),
            Target::Outbox(agg) => format!(
                "SELECT outbox.enqueue('{agg}', a, 'bench.tick', jsonb_build_object('i', 0, 'pad', $1::text))
                 FROM unnest($2::text[]) a"
            ),
            Target::Plain(agg, table) => format!(
                "INSERT INTO {table} (aggregatetype, aggregateid, type, payload)
                 SELECT '{agg}', a, 'bench.tick', jsonb_build_object('i', 0, 'pad', $1::text)
                 FROM unnest($2::text[]) a RETURNING id"
            ),
        }
    }

    fn accepted_sql(&self) -> Option<&'static str> {
        match self {
            Target::Outbox(_) | Target::OutboxPlain(_) => Some(
                "SELECT event_id, extract(epoch FROM accepted_at)::float8 FROM outbox.receipts
                 WHERE event_id = ANY($1)",
            ),
            Target::Plain(..) => None,
        }
    }
}

/// Events a writer committed, each with its commit time (seconds since the epoch).
type Committed = Vec<(Uuid, f64)>;

/// Concurrent writers at a constant total rate until a deadline.
pub struct Writers {
    tasks: Vec<JoinHandle<anyhow::Result<Committed>>>,
    deadline: Instant,
}

impl Writers {
    pub async fn start(
        ctx: &Ctx,
        url: &str,
        target: Target,
        sc: &Scenario,
        rate: f64,
        duration: Duration,
    ) -> anyhow::Result<Writers> {
        let a = &ctx.args;
        let writers = a.writers.max(1);
        let per_txn = a.events_per_txn.max(1);
        let period = Duration::from_secs_f64(writers as f64 * per_txn as f64 / rate.max(1.0));
        let deadline = Instant::now() + duration;
        let pad = "x".repeat(pad_len(sc.payload));
        let aggregates = sc.aggregates.max(1);
        let mut tasks = Vec::new();
        for w in 0..writers {
            let client = outboxd::connect(url).await?;
            let stmt = client
                .prepare(&target.insert_sql())
                .await
                .context("preparing the writers' statement")?;
            let pad = pad.clone();
            tasks.push(tokio::spawn(async move {
                let mut committed = Vec::new();
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                // Writers start out of phase, so commits spread over the period.
                tokio::time::sleep(period * w as u32 / writers as u32).await;
                while Instant::now() < deadline {
                    tick.tick().await;
                    // Sorted: each enqueue locks its aggregate's version row, and writers that
                    // lock in one order cannot deadlock (seen with 500 aggregates).
                    let ids: Vec<String> = {
                        let mut rng = rand::thread_rng();
                        let mut ids: Vec<u64> =
                            (0..per_txn).map(|_| rng.gen_range(0..aggregates)).collect();
                        ids.sort_unstable();
                        ids.into_iter().map(|a| format!("a{a}")).collect()
                    };
                    let rows = client
                        .query(&stmt, &[&pad, &ids])
                        .await
                        .context("a steady-rate writer's transaction")?;
                    let at = epoch_now();
                    committed.extend(rows.iter().map(|r| (r.get::<_, Uuid>(0), at)));
                }
                Ok(committed)
            }));
        }
        Ok(Writers { tasks, deadline })
    }

    pub fn finished(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Every committed event with its commit time (seconds since the epoch).
    pub async fn join(self) -> anyhow::Result<Committed> {
        let mut all = Vec::new();
        for t in self.tasks {
            all.extend(t.await??);
        }
        Ok(all)
    }
}

/// Acceptance time (seconds since the epoch) of each committed event that was accepted.
pub async fn accepted_times(
    client: &Client,
    committed: &[(Uuid, f64)],
    target: Target,
) -> anyhow::Result<HashMap<Uuid, f64>> {
    let sql = target
        .accepted_sql()
        .context("this target's acceptance times are not in the database")?;
    let mut out = HashMap::with_capacity(committed.len());
    for chunk in committed.chunks(20_000) {
        let ids: Vec<Uuid> = chunk.iter().map(|(id, _)| *id).collect();
        for row in client
            .query(sql, &[&ids])
            .await
            .context("reading acceptance times")?
        {
            out.insert(row.get::<_, Uuid>(0), row.get::<_, f64>(1));
        }
    }
    Ok(out)
}

/// Fails when a committed event has no acceptance time although the relay was waited for
/// until it confirmed past the last commit: a latency figure that silently drops events would
/// hide exactly the events that matter. Says what the ledger knows of the missing ones.
pub async fn all_accepted(
    client: &Client,
    committed: &[(Uuid, f64)],
    accepted: &HashMap<Uuid, f64>,
    what: &str,
) -> anyhow::Result<()> {
    let unique: std::collections::HashSet<Uuid> = committed.iter().map(|(id, _)| *id).collect();
    let missing: Vec<Uuid> = unique
        .iter()
        .filter(|id| !accepted.contains_key(id))
        .copied()
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let rows = client
        .query(
            "SELECT coalesce(s.state, 'no outbox row'), count(*)
             FROM unnest($1::uuid[]) m(id) LEFT JOIN outbox.event_status s ON s.event_id = m.id
             GROUP BY 1 ORDER BY 1",
            &[&missing],
        )
        .await
        .context("reading the state of events without an acceptance time")?;
    let mut states: Vec<String> = rows
        .iter()
        .map(|r| format!("{} {}", r.get::<_, i64>(1), r.get::<_, String>(0)))
        .collect();
    for r in client
        .query(
            "SELECT reason_code, left(reason, 300), count(*) FROM outbox.quarantine
             WHERE event_id = ANY($1) GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 5",
            &[&missing],
        )
        .await
        .context("reading quarantine reasons")?
    {
        states.push(format!(
            "{} quarantined as {}: {}",
            r.get::<_, i64>(2),
            r.get::<_, String>(0),
            r.get::<_, String>(1)
        ));
    }
    bail!(
        "{what}: {} of {} committed events ({} ids reported by the writers) have no acceptance time \
         after the relay confirmed past their commits; their states: {}; e.g. {}",
        missing.len(),
        unique.len(),
        committed.len(),
        states.join(", "),
        missing.iter().take(3).map(Uuid::to_string).collect::<Vec<_>>().join(", ")
    )
}

/// Commit -> accepted, milliseconds, of every event that was accepted; plus, per 250 ms of
/// commit time from `start` (epoch seconds), the worst latency (where stalls happened).
pub fn latencies(committed: &[(Uuid, f64)], accepted: &HashMap<Uuid, f64>, start: f64) -> Latency {
    let mut worst: Vec<(f64, f64)> = Vec::new();
    let v: Vec<f64> = committed
        .iter()
        .filter_map(|(id, c)| {
            let ms = ((accepted.get(id)? - c) * 1000.0).max(0.0);
            let bucket = ((c - start) * 4.0).floor().max(0.0) as usize;
            if worst.len() <= bucket {
                worst.resize(bucket + 1, (0.0, 0.0));
            }
            worst[bucket] = (bucket as f64 / 4.0, worst[bucket].1.max(ms));
            Some(ms)
        })
        .collect();
    let mut l = Latency::from_samples(v);
    l.worst_by_commit_time = worst;
    l
}

/// Events accepted per second over time (0.5 s buckets), from `start` (epoch seconds).
pub async fn series(
    client: &Client,
    sql_column: &str,
    start: f64,
) -> anyhow::Result<Vec<(f64, f64)>> {
    let (table, col) = sql_column
        .rsplit_once('.')
        .context("series column must be table.column")?;
    let rows = client
        .query(
            &format!(
                "SELECT floor((extract(epoch FROM {col})::float8 - $1::float8) * 2) / 2 AS t, count(*)
                 FROM {table} WHERE {col} IS NOT NULL GROUP BY 1 ORDER BY 1"
            ),
            &[&start],
        )
        .await
        .map_err(|e| anyhow::anyhow!("reading throughput over time: {}", outbox_ledger::describe_db_error(&e)))?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, f64>(0), 2.0 * r.get::<_, i64>(1) as f64))
        .collect())
}

/// The relay's drain: receipts accepted per second since `start`.
pub async fn receipt_series(client: &Client, start: f64) -> anyhow::Result<Vec<(f64, f64)>> {
    series(client, "outbox.receipts.accepted_at", start).await
}

/// The cluster, topic and slot the receipts of [`prefill_receipts`] name, so that the drain's
/// count can leave them out.
pub const PREFILL: &str = "prefill";

/// Writes `n` receipts of earlier events into the ledger `client` reaches
/// (`--ledger-receipts`): entries of time-ordered ids in batches of 1,000 of a slot of their
/// own ([`PREFILL`]), with no outbox row (as after purge) and no stream position, then
/// vacuumed, analysed and checkpointed. Returns seconds.
pub async fn prefill_receipts(client: &Client, n: u64) -> anyhow::Result<f64> {
    let started = std::time::Instant::now();
    client
        .execute(
            "INSERT INTO outbox.receipt_destinations (broker_kind, broker_cluster, topic)
             VALUES ('kafka', $1, $1) ON CONFLICT DO NOTHING",
            &[&PREFILL],
        )
        .await?;
    // In statements of 100,000: one of millions would hold its whole WAL and memory at once.
    let mut done = 0u64;
    while done < n {
        let k = (n - done).min(100_000) as i64;
        client
            .execute(
                "WITH b AS (
                     INSERT INTO outbox.receipt_batches (slot_name)
                     SELECT $2::text FROM generate_series(1, ($1::bigint + 999) / 1000)
                     RETURNING batch_id),
                 bs AS (SELECT array_agg(batch_id ORDER BY batch_id) AS ids FROM b),
                 d AS (SELECT destination_id FROM outbox.receipt_destinations
                       WHERE broker_cluster = $2 AND topic = $2)
                 INSERT INTO outbox.receipt_entries
                     (event_id, batch_id, destination_id, partition, \"offset\", attempt,
                      relay_generation, payload_digest, destination_digest, aggregate_version)
                 SELECT outbox.uuid_v7(), bs.ids[1 + (g - 1) / 1000], d.destination_id,
                        (g % 16)::int, g, 1, 1,
                        sha256(g::text::bytea), sha256(('d' || g)::bytea), 1
                 FROM generate_series(1, $1::bigint) g, bs, d",
                &[&k, &PREFILL],
            )
            .await?;
        done += k as u64;
    }
    // One statement each: several in one message run as one transaction, which VACUUM refuses.
    for sql in [
        "VACUUM (ANALYZE) outbox.receipt_entries",
        "VACUUM (ANALYZE) outbox.receipt_batches",
        "CHECKPOINT",
    ] {
        client.batch_execute(sql).await?;
    }
    Ok(started.elapsed().as_secs_f64())
}
