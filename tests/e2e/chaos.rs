//! The chaos suite: real processes and every fault at once, invariants counted at the end.
//!
//! Real PostgreSQL, the real `outboxd` binary, three brokers — librdkafka's mock cluster (one
//! test) and three real Apache Kafka nodes (another) — four
//! concurrent writers with ~10% rolled-back transactions, and an inbox consumer (the effect and
//! the inbox row in one transaction, the offset stored afterwards, so a crash between the two
//! redelivers). At moments drawn from a seeded RNG (as "after the ledger holds k receipts"):
//! SIGKILL of the relay, `pg_terminate_backend` of its walsender; on the mock, produce requests
//! timing out (DISPATCH_UNKNOWN), round trips longer than the message timeout (appended, ACK
//! lost), a broker down and up, a partition leader change; on Apache Kafka, a broker SIGSTOPped
//! past the message timeout and resumed (appended, ACK lost), a broker SIGKILLed and restarted,
//! a partition's leader SIGKILLed (the leader changes) and restarted. The consumer crashes
//! between its commit and its offset store.
//!
//! At the end the same counts as `outbox-sim` are computed from the database and the topic,
//! printed, written to a report file, and asserted to be 0 (late ACKs converged: 100%). The
//! consumer runs outbox-inbox's own transaction (`store::process`, gap policy `report`), so a
//! duplicate effect or a version gap it sees is counted. Each fault is asserted to have had
//! its effect: an UNKNOWN attempt per SIGSTOPped broker (a canary event makes sure a request
//! was in flight), a relay generation per SIGKILL, consumer crashes and redeliveries.
//!
//! * CI: `cargo test -p outboxd --test e2e chaos::` (mock: 2,000 events, 8 faults; Apache
//!   Kafka: 1,000 events, 6 faults).
//! * On demand: `OUTBOXD_CHAOS_EVENTS=100000 OUTBOXD_CHAOS_FAULTS=40` (mock) and
//!   `OUTBOXD_CHAOS_KAFKA_EVENTS` / `OUTBOXD_CHAOS_KAFKA_FAULTS` (Apache Kafka); the report goes
//!   to `OUTBOXD_CHAOS_REPORT` or `target/tmp/chaos-report-<seed>.txt`. `OUTBOXD_TEST_SEED`
//!   replays the same fault schedule.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_testkit::apache_kafka::KafkaCluster;
use outbox_testkit::kafka::TestKafka;
use outbox_testkit::postgres::TestPostgres;
use outbox_testkit::wait::wait_for;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use serde_json::json;
use tokio_postgres::error::SqlState;

use crate::harness::{connect, TestEnv};

const BROKERS: i32 = 3;

/// The mock cluster keeps about 5 MB per partition and drops older messages (librdkafka's
/// mock log limit); one partition per 2,500 events (and enough aggregates to spread them)
/// keeps every copy readable to the end.
fn partitions_for(events: u64) -> i32 {
    (events / 2_500).clamp(3, 128) as i32
}

fn aggregates_for(events: u64) -> u64 {
    (events / 200).max(50)
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The consumer's id in `outbox.inbox`.
const CONSUMER: &str = "chaos";

/// Every effect the consumer's handler ran, one row per run (no unique key, so a second run
/// for one event is counted, not refused).
const DUPLICATE_EFFECTS_SQL: &str = "SELECT count(*) - count(DISTINCT event_id) FROM chaos_effects";

/// The handler: its effect is one row in `chaos_effects`, in the inbox transaction.
fn effect_handler() -> impl outbox_inbox::Handler {
    outbox_inbox::handler_fn(|tx, ev, _key| {
        Box::pin(async move {
            tx.execute(
                "INSERT INTO chaos_effects (event_id) VALUES ($1)",
                &[&ev.event_id.to_string()],
            )
            .await?;
            Ok(None)
        })
    })
}

/// What the consumer went through.
#[derive(Debug, Default)]
struct ConsumerRun {
    crashes: u64,
    stalls: u64,
    /// Messages the inbox recognised as seen before (the handler did not run).
    redeliveries: u64,
}

/// The inbox consumer: reads every partition from its stored offsets; each message goes
/// through outbox-inbox's own transaction (`store::process`: the inbox row, the gap decision
/// and the handler's effect commit together); the offset is stored afterwards. A "crash"
/// drops the consumer between the two: once at the 50th message, then at random.
async fn inbox_consumer(
    url: String,
    bootstrap: String,
    topic: String,
    seed: u64,
    partitions: i32,
    stop: Arc<AtomicBool>,
) -> ConsumerRun {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xc0_115e);
    let mut db = connect(&url).await;
    let handler = effect_handler();
    let mut run = ConsumerRun::default();
    let mut processed = 0u64;
    let mut restarts = 0u64;
    let mut last_message = Instant::now();
    'restart: loop {
        let rows = db
            .query(
                "SELECT partition, next_offset FROM chaos_offsets ORDER BY partition",
                &[],
            )
            .await
            .expect("offsets");
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", format!("chaos-inbox-{seed}"))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            // Never jump: an offset error restarts from the stored offsets instead.
            .set("auto.offset.reset", "error")
            .create()
            .expect("consumer");
        let mut tpl = TopicPartitionList::new();
        for r in &rows {
            tpl.add_partition_offset(&topic, r.get(0), Offset::Offset(r.get(1)))
                .expect("tpl");
        }
        consumer.assign(&tpl).expect("assign");
        // Next offset to read per partition.
        let mut next = vec![0i64; partitions as usize];
        for r in &rows {
            next[r.get::<_, i32>(0) as usize] = r.get(1);
        }
        loop {
            if stop.load(Ordering::Relaxed) {
                return run;
            }
            let m = match tokio::time::timeout(Duration::from_millis(200), consumer.recv()).await {
                Err(_) => {
                    // A watchdog: a fresh consumer of the mock cluster can sit on a stale
                    // leader after broker faults and never fetch. If nothing arrived for a
                    // while although the log is longer than what was stored, start again.
                    if last_message.elapsed() > Duration::from_secs(5) {
                        let behind = (0..partitions).any(|p| {
                            consumer
                                .fetch_watermarks(&topic, p, Duration::from_secs(2))
                                .is_ok_and(|(_, hi)| hi > next[p as usize])
                        });
                        if behind {
                            run.stalls += 1;
                            eprintln!(
                                "chaos consumer: stalled for 5 s behind the log; restarting ({})",
                                run.stalls
                            );
                            last_message = Instant::now();
                            continue 'restart;
                        }
                    }
                    continue;
                }
                // Broker faults reach the consumer too. Transport failures are reported and
                // recovered by librdkafka itself; an offset error restarts from the stored
                // offsets (never a jump).
                Ok(Err(e)) => {
                    if !matches!(
                        e.rdkafka_error_code(),
                        Some(
                            RDKafkaErrorCode::OffsetOutOfRange | RDKafkaErrorCode::AutoOffsetReset
                        )
                    ) {
                        continue;
                    }
                    assert!(
                        restarts < 100,
                        "the inbox consumer's stored offset is no longer on the broker ({e}): \
                         the log was trimmed before it was consumed; use more partitions"
                    );
                    restarts += 1;
                    if restarts.is_power_of_two() {
                        let marks: Vec<String> = (0..partitions)
                            .map(|p| {
                                consumer
                                    .fetch_watermarks(&topic, p, Duration::from_secs(2))
                                    .map(|(lo, hi)| format!("{p}:[{lo},{hi})"))
                                    .unwrap_or_else(|e| format!("{p}:{e}"))
                            })
                            .collect();
                        eprintln!(
                            "chaos consumer: {e} (restart {restarts}; watermarks {})",
                            marks.join(" ")
                        );
                    }
                    continue 'restart;
                }
                Ok(Ok(m)) => m,
            };
            let msg = outbox_inbox::InboxMessage::from_kafka(&m).unwrap_or_else(|e| {
                panic!("the chaos topic holds a message that is not an outbox event: {e}")
            });
            let (partition, offset) = (m.partition(), m.offset());
            last_message = Instant::now();
            next[partition as usize] = offset + 1;
            drop(m);
            // Gap policy `report`: a version gap is applied and recorded in
            // outbox.consumer_gaps, which the end of the run counts.
            let outcome = outbox_inbox::store::process(
                &mut db,
                CONSUMER,
                outbox_inbox::GapPolicy::Report,
                &msg,
                offset + 1,
                &handler,
            )
            .await
            .unwrap_or_else(|e| panic!("inbox transaction of {}: {e}", msg.event_id));
            if matches!(outcome, outbox_inbox::Outcome::Duplicate(_)) {
                run.redeliveries += 1;
            }
            processed += 1;
            if processed == 50 || rng.gen_bool(0.01) {
                // Crash after the commit, before the offset is stored: redelivered.
                run.crashes += 1;
                continue 'restart;
            }
            db.execute(
                "UPDATE chaos_offsets SET next_offset = $2 WHERE partition = $1",
                &[&partition, &(offset + 1)],
            )
            .await
            .expect("store offset");
        }
    }
}

/// Enqueues one event of `aggregate` whose payload carries the business key `key` (what the
/// end-of-run counts group by), as the writers do.
async fn enqueue_keyed(env: &TestEnv, aggregate: &str, key: &str) -> uuid::Uuid {
    env.db
        .query_one(
            "SELECT outbox.enqueue($1, $2, 'chaos.tick', $3)",
            &[&env.aggregate_type, &aggregate, &json!({ "key": key })],
        )
        .await
        .unwrap_or_else(|e| panic!("enqueue {key}: {e}"))
        .get(0)
}

/// Waits until the relay is warm: it streams, has no DISPATCH_UNKNOWN open (a relay still
/// resolving one at start-up sends nothing), and its current generation has had a receipt
/// (its producer has its id and its connections; a fresh producer's first messages time out
/// unsent, NotPersisted, under a stall). A warm-up event on an aggregate of its own makes
/// the receipt happen when the writers are done; it is added to `canaries`. Returns how many
/// attempts the ledger holds.
async fn warm_relay(env: &TestEnv, canaries: &mut Vec<(String, String)>) -> i64 {
    let started = Instant::now();
    loop {
        let key = format!("warm-{}", canaries.len());
        let id = enqueue_keyed(env, &key, &key).await;
        canaries.push((key, id.to_string()));
        env.wait_count(
            "the warm-up event's receipt",
            &format!("SELECT count(*) FROM outbox.receipts WHERE event_id = '{id}'"),
            1,
        )
        .await;
        let warm = env
            .count(&format!(
                "SELECT count(*) FROM outbox.receipts r, outbox.relay_leases l
                 WHERE r.event_id = '{id}' AND l.slot_name = '{slot}'
                   AND r.relay_generation = l.generation
                   AND NOT EXISTS (SELECT 1 FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN')
                   AND EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = '{slot}' AND active)",
                slot = env.slot
            ))
            .await;
        if warm == 1 {
            return env.count("SELECT count(*) FROM outbox.attempts").await;
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "the relay did not stay up long enough to be warm before a fault"
        );
    }
}

/// Enqueues one event (a "canary") on an aggregate of every partition that has receipts
/// (learned from them), so a request to a stalled broker is in flight even when the writers
/// have finished — whichever partitions it leads right now (the leader a test reads from
/// metadata may already have moved: one canary on one partition was delivered by another
/// leader in CI). Returns the ids of this round's canaries; each is added to `canaries` for
/// the end-of-run counts.
async fn send_canaries(
    env: &TestEnv,
    topic: &str,
    canaries: &mut Vec<(String, String)>,
) -> Vec<uuid::Uuid> {
    // An aggregate per partition that nothing holds back (a held aggregate's canary would be
    // recorded as held, never sent: no request to stall).
    let aggregates: Vec<String> = env
        .db
        .query(
            "SELECT DISTINCT ON (r.partition) e.aggregate_id
               FROM outbox.receipts r JOIN outbox.events e USING (event_id)
              WHERE r.topic = $1
                AND NOT EXISTS (SELECT 1 FROM outbox.holds h
                                WHERE h.aggregate_type = e.aggregate_type
                                  AND h.aggregate_id = e.aggregate_id)
              ORDER BY r.partition, r.accepted_at DESC",
            &[&topic],
        )
        .await
        .expect("an aggregate per partition")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut ids = Vec::new();
    for aggregate in aggregates {
        let key = format!("canary-{}", canaries.len());
        let id = enqueue_keyed(env, &aggregate, &key).await;
        canaries.push((key, id.to_string()));
        ids.push(id);
    }
    ids
}

/// How one try of a stalling fault ended.
enum StallTry {
    /// The ledger holds more attempts than before the fault: a send ended possibly persisted.
    Unknown,
    /// Every canary of the try was accepted and no attempt was recorded: no request reached
    /// the stalled broker (it led none of the canaries' partitions, or the relay's producer
    /// had no connection to it and sent after the leadership moved). What was seen.
    Missed(String),
}

/// Waits, while a fault stalls produce requests, until the ledger holds more attempts than
/// `before` (counted before the fault), or until every canary in `ids` has a receipt without
/// one (this try cannot produce an UNKNOWN attempt any more).
async fn until_an_unknown_attempt(env: &TestEnv, before: i64, ids: &[uuid::Uuid]) -> StallTry {
    wait_for(
        "the stalled produce request to become a DISPATCH_UNKNOWN attempt (or every canary accepted)",
        // Generous: the suite runs other tests meanwhile (CI's 2 CPUs once took longer than 30 s).
        Duration::from_secs(90),
        || async {
            let now = env.count("SELECT count(*) FROM outbox.attempts").await;
            if now > before {
                return Ok(StallTry::Unknown);
            }
            // What the relay did with the canaries: a try whose canaries are all accepted
            // ends; a run that times out here prints it.
            let state = env
                .db
                .query_one(
                    "SELECT (SELECT count(*) FROM outbox.receipts WHERE event_id = ANY($2)),
                            (SELECT count(*) FROM outbox.holds),
                            (SELECT count(*) FROM outbox.held_events WHERE released_at IS NULL),
                            (SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND active)",
                    &[&env.slot, &ids],
                )
                .await
                .map_err(|e| e.to_string())?;
            let accepted: i64 = state.get(0);
            let seen = format!(
                "{now} attempts, as before the fault; canaries with a receipt {accepted} of {}, \
                 holds {}, held events {}, slot active {}",
                ids.len(),
                state.get::<_, i64>(1),
                state.get::<_, i64>(2),
                state.get::<_, i64>(3)
            );
            // Counted again after the receipts: an attempt recorded between the two reads
            // is an UNKNOWN, not a miss.
            if accepted == ids.len() as i64
                && env.count("SELECT count(*) FROM outbox.attempts").await == before
            {
                return Ok(StallTry::Missed(seen));
            }
            Err(seen)
        },
    )
    .await
}

/// Which brokers the chaos runs against.
enum Brokers {
    /// librdkafka's mock cluster of three brokers: request errors, exact round trips, leader
    /// moves on demand.
    Mock,
    /// Three real Apache Kafka nodes (replication factor 3, min.insync.replicas 2): SIGSTOP /
    /// SIGCONT, SIGKILL / restart of a broker and of a partition's leader.
    Apache(KafkaCluster),
}

/// Lost events: the committed events that are not on the broker, or have no primary receipt in
/// the ledger, each counted once. A set difference, never a difference of totals: a receipt of
/// something not committed (or a message no row has) cannot cancel a committed event's miss.
fn lost_events(
    committed: &HashSet<&str>,
    on_broker: &HashSet<&str>,
    receipted: &HashSet<String>,
) -> i64 {
    committed
        .iter()
        .filter(|id| !on_broker.contains(*id) || !receipted.contains(**id))
        .count() as i64
}

#[test]
fn lost_counts_each_committed_event_without_a_receipt_whatever_else_has_one() {
    let set = |ids: &[&'static str]| ids.iter().copied().collect::<HashSet<&str>>();
    let owned = |ids: &[&str]| {
        ids.iter()
            .map(|s| s.to_string())
            .collect::<HashSet<String>>()
    };
    let committed = set(&["a", "b", "c"]);
    // Everything delivered: 0.
    assert_eq!(
        lost_events(&committed, &set(&["a", "b", "c"]), &owned(&["a", "b", "c"])),
        0
    );
    // c on the broker but never accepted, while a receipt of x (no committed row) makes the
    // ledger's distinct count 3 again: `n - distinct receipts` said 0.
    assert_eq!(
        lost_events(&committed, &set(&["a", "b", "c"]), &owned(&["a", "b", "x"])),
        1
    );
    // c missing from the broker, and one receipt too many: the old sum was 1 + (3 - 4) = 0.
    assert_eq!(
        lost_events(&committed, &set(&["a", "b"]), &owned(&["a", "b", "c", "x"])),
        1
    );
    // Missing from both: one event, counted once.
    assert_eq!(
        lost_events(&committed, &set(&["a", "b"]), &owned(&["a", "b"])),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_with_every_fault_keeps_every_invariant_count_at_zero() {
    chaos(
        "chaos",
        Brokers::Mock,
        Mode::Cdc,
        env_u64("OUTBOXD_CHAOS_EVENTS", 2_000),
        env_u64("OUTBOXD_CHAOS_FAULTS", 8),
    )
    .await;
}

/// The same chaos with the relay in poll mode: the walsender fault becomes the termination
/// of every backend of the relay, and there is no slot to sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_in_poll_mode_keeps_every_invariant_count_at_zero() {
    chaos(
        "chaos_poll",
        Brokers::Mock,
        Mode::Poll,
        env_u64("OUTBOXD_CHAOS_EVENTS", 2_000),
        env_u64("OUTBOXD_CHAOS_FAULTS", 8),
    )
    .await;
}

/// Where the relay finds new events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Cdc,
    Poll,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_three_apache_kafka_brokers_keeps_every_invariant_count_at_zero() {
    let cluster = KafkaCluster::start(BROKERS as usize)
        .unwrap_or_else(|e| panic!("starting 3 Apache Kafka nodes: {e}"));
    chaos(
        "chaos_kafka",
        Brokers::Apache(cluster),
        Mode::Cdc,
        env_u64("OUTBOXD_CHAOS_KAFKA_EVENTS", 1_000),
        env_u64("OUTBOXD_CHAOS_KAFKA_FAULTS", 6),
    )
    .await;
}

async fn chaos(name: &str, brokers: Brokers, mode: Mode, events: u64, faults: u64) {
    let seed = env_u64("OUTBOXD_TEST_SEED", 0xc4a05);
    let on = match &brokers {
        Brokers::Mock => "librdkafka's mock cluster (3 brokers)",
        Brokers::Apache(_) => "Apache Kafka (3 nodes)",
    };
    println!("{name}: on {on}, {mode:?} mode, events={events} faults={faults} seed={seed} (OUTBOXD_CHAOS_[KAFKA_]EVENTS, OUTBOXD_CHAOS_[KAFKA_]FAULTS, OUTBOXD_TEST_SEED)");
    let started = Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let partitions = partitions_for(events);
    // Three brokers, so a leader can move and a broker can go down.
    let kafka = match &brokers {
        Brokers::Mock => TestKafka::mock(BROKERS).expect("mock cluster"),
        Brokers::Apache(c) => TestKafka::external(c.bootstrap_servers()),
    };
    let env = TestEnv::with_kafka(TestPostgres::shared(), name, kafka).await;
    // The test's own topic has 3 partitions and replication factor 1: route to one sized for
    // the run (and, on Apache Kafka, replicated on all three nodes).
    let topic = format!("{}.chaos", env.topic);
    match &brokers {
        Brokers::Mock => env.kafka.create_topic(&topic, partitions),
        Brokers::Apache(c) => {
            c.create_topic(&topic, partitions, BROKERS, &[("min.insync.replicas", "2")])
        }
    }
    .unwrap_or_else(|e| panic!("creating {topic} with {partitions} partitions: {e}"));
    env.route_to(&topic).await;
    env.db
        .batch_execute(
            "CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, event_id text NOT NULL);
             CREATE TABLE chaos_offsets (partition int PRIMARY KEY, next_offset bigint NOT NULL);",
        )
        .await
        .expect("consumer tables");
    env.db
        .execute(
            "INSERT INTO chaos_offsets SELECT p, 0 FROM generate_series(0, $1 - 1) p",
            &[&partitions],
        )
        .await
        .expect("consumer tables");
    let mut relay_args = vec![
        "--message-timeout-ms",
        "1500",
        "--unknown-settle-ms",
        "2500",
    ];
    match mode {
        Mode::Poll => relay_args.extend(["--mode", "poll", "--poll-interval-ms", "20"]),
        // Explicit, so that the e2e_poll target does not turn this run into a poll run.
        Mode::Cdc => relay_args.extend(["--mode", "cdc"]),
    }
    // Named, so that a fault can find the relay's own backends.
    let relay_url = format!("{}?application_name=outboxd_chaos_relay", env.url);
    let sampler = env.start_sampler();
    let mut relay = env.relay_at(&relay_url, &[], &relay_args);
    env.wait_ready(&relay).await;

    let stop = Arc::new(AtomicBool::new(false));
    let consumer = tokio::spawn(inbox_consumer(
        env.url.clone(),
        env.kafka.bootstrap_servers().to_string(),
        topic.clone(),
        seed,
        partitions,
        stop.clone(),
    ));

    // Writers: transactions of 1-3 events on 50 aggregates, ~10% rolled back. Each holds its
    // last tenth back until the last fault has struck (every fault strikes below 90% of the
    // events), so every fault meets events still to publish: in poll mode the relay used to
    // publish everything before the last faults struck.
    const WRITERS: u64 = 4;
    let aggregates = aggregates_for(events);
    let (faults_done, wait_faults) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let mut wait_faults = wait_faults.clone();
        let url = env.url.clone();
        let agg = env.aggregate_type.clone();
        let target = events / WRITERS + u64::from(w < events % WRITERS);
        let mut wrng = rand::rngs::StdRng::seed_from_u64(seed ^ (w + 1).wrapping_mul(0x9e37));
        writers.push(tokio::spawn(async move {
            let mut c = connect(&url).await;
            let (mut committed, mut rolled_back) = (Vec::new(), Vec::new());
            let mut i = 0u64;
            while (committed.len() as u64) < target {
                if committed.len() as u64 >= target - target / 10 {
                    wait_faults.wait_for(|done| *done).await.unwrap();
                }
                let n = wrng
                    .gen_range(1..=3u64)
                    .min(target - committed.len() as u64);
                let tx = c.transaction().await.unwrap();
                let mut ids = Vec::new();
                let mut deadlocked = false;
                for _ in 0..n {
                    let key = format!("w{w}-{i}");
                    i += 1;
                    let r = tx
                        .query_one(
                            "SELECT outbox.enqueue($1, $2, 'chaos.tick', $3)",
                            &[
                                &agg,
                                &format!("a{}", wrng.gen_range(0..aggregates)),
                                &json!({"key": key}),
                            ],
                        )
                        .await;
                    match r {
                        Ok(row) => ids.push((key, row.get::<_, uuid::Uuid>(0).to_string())),
                        // Two writers locked two aggregates in opposite orders: PostgreSQL
                        // aborts one transaction, and the business retries it.
                        Err(e) if e.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED) => {
                            deadlocked = true;
                            break;
                        }
                        Err(e) => panic!("enqueue: {e}"),
                    }
                }
                if deadlocked {
                    drop(tx);
                    rolled_back.extend(ids);
                    continue;
                }
                if wrng.gen_bool(0.1) {
                    tx.rollback().await.unwrap();
                    rolled_back.extend(ids);
                } else {
                    tx.commit().await.unwrap();
                    committed.extend(ids);
                }
            }
            (committed, rolled_back)
        }));
    }

    // The fault schedule: each fault once the ledger holds a random number of receipts.
    let mut thresholds: Vec<i64> = (0..faults)
        .map(|_| rng.gen_range(events as i64 / 20..events as i64 * 9 / 10))
        .collect();
    thresholds.sort();
    let mock = env.kafka.mock_cluster();
    let mut log = Vec::new();
    // Every kind of fault at least once (when there are enough faults), in a seeded order.
    let kinds = match &brokers {
        Brokers::Mock => 6,
        Brokers::Apache(_) => 5,
    };
    let mut order: Vec<u32> = (0..kinds).collect();
    for k in (1..order.len()).rev() {
        order.swap(k, rng.gen_range(0..=k));
    }
    // Events enqueued by the test while a fault held the broker (key, id).
    let mut canaries: Vec<(String, String)> = Vec::new();
    for (j, t) in thresholds.into_iter().enumerate() {
        env.wait_count(
            "progress before the next fault",
            "SELECT count(*) FROM outbox.receipts",
            t,
        )
        .await;
        // Events are still to be published when the fault strikes (the writers' and the
        // canaries'): a fault after the last receipt would meet nothing.
        env.assert_fault_met_traffic(
            &format!("fault {} (at {t} receipts)", j + 1),
            events as i64 + canaries.len() as i64,
        )
        .await;
        let hold = Duration::from_millis(rng.gen_range(300..1_500));
        // Longer than the message timeout, so sends end possibly persisted (UNKNOWN).
        let unknown_hold = Duration::from_millis(rng.gen_range(2_000..3_000));
        match (order[j % order.len()], &brokers) {
            (0, _) => {
                relay.kill9();
                relay = env.relay_at(&relay_url, &[], &relay_args);
                log.push(format!("{t}: SIGKILL relay"));
            }
            (1, _) if mode == Mode::Poll => {
                env.db
                    .execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                         WHERE application_name = 'outboxd_chaos_relay' AND datname = current_database()",
                        &[],
                    )
                    .await
                    .expect("terminate the relay's backends");
                log.push(format!("{t}: pg_terminate_backend(every relay backend)"));
            }
            (1, _) => {
                env.db
                    .execute(
                        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                         WHERE slot_name = $1 AND active_pid IS NOT NULL",
                        &[&env.slot],
                    )
                    .await
                    .expect("terminate walsender");
                log.push(format!("{t}: pg_terminate_backend(walsender)"));
            }
            (2, Brokers::Mock) => {
                let m = mock.expect("mock");
                m.request_errors(
                    RDKafkaApiKey::Produce,
                    &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT; 400],
                );
                tokio::time::sleep(unknown_hold).await;
                m.clear_request_errors(RDKafkaApiKey::Produce);
                log.push(format!(
                    "{t}: produce requests time out for {unknown_hold:?}"
                ));
            }
            (3, Brokers::Mock) => {
                // Not asserted to leave an UNKNOWN attempt: on the mock, a message queued
                // behind the stalled requests can time out unsent (NotPersisted) and end the
                // run before the possibly persisted ones report (seed 805381).
                env.kafka
                    .set_round_trip(BROKERS, Duration::from_millis(2_500))
                    .expect("rtt");
                tokio::time::sleep(unknown_hold).await;
                env.kafka
                    .set_round_trip(BROKERS, Duration::ZERO)
                    .expect("rtt");
                log.push(format!(
                    "{t}: round trip 2.5 s (> message timeout) for {unknown_hold:?}"
                ));
            }
            (4, Brokers::Mock) => {
                let m = mock.expect("mock");
                let b = rng.gen_range(1..=BROKERS);
                m.broker_down(b).expect("broker down");
                tokio::time::sleep(hold).await;
                m.broker_up(b).expect("broker up");
                log.push(format!("{t}: broker {b} down for {hold:?}"));
            }
            (_, Brokers::Mock) => {
                let m = mock.expect("mock");
                let p = rng.gen_range(0..partitions);
                let b = rng.gen_range(1..=BROKERS);
                m.partition_leader(&topic, p, Some(b))
                    .expect("leader change");
                log.push(format!("{t}: partition {p} leader -> broker {b}"));
            }
            (2, Brokers::Apache(c)) => {
                // Requests in its sockets stay unanswered past the message timeout: sends end
                // possibly persisted, and the broker appends what it had received on SIGCONT.
                // A partition's leader: a stopped follower may only leave the ISR, and then
                // nothing waits for it. A try whose canaries all went elsewhere is undone
                // (SIGCONT) and made again on a fresh leader, a bounded number of times.
                let mut tries = Vec::new();
                loop {
                    let before = warm_relay(&env, &mut canaries).await;
                    let p = rng.gen_range(0..partitions);
                    let b = c
                        .leader_of(&topic, p)
                        .unwrap_or_else(|| rng.gen_range(1..=BROKERS));
                    c.pause(b);
                    let ids = send_canaries(&env, &topic, &mut canaries).await;
                    match until_an_unknown_attempt(&env, before, &ids).await {
                        StallTry::Unknown => {
                            tokio::time::sleep(unknown_hold).await;
                            c.resume(b);
                            log.push(format!(
                                "{t}: broker {b} (leader of partition {p}) SIGSTOP for {unknown_hold:?}, SIGCONT{}",
                                if tries.is_empty() {
                                    String::new()
                                } else {
                                    format!(" (after {} tries without an UNKNOWN send: {})", tries.len(), tries.join("; "))
                                }
                            ));
                            break;
                        }
                        StallTry::Missed(seen) => {
                            c.resume(b);
                            tries.push(format!("broker {b}: {seen}"));
                            assert!(
                                tries.len() < 5,
                                "no try of stalling a partition's leader made a send end \
                                 possibly persisted: {}",
                                tries.join("; ")
                            );
                        }
                    }
                }
            }
            (3, Brokers::Apache(c)) => {
                let b = rng.gen_range(1..=BROKERS);
                c.kill(b);
                tokio::time::sleep(hold).await;
                c.restart(b).expect("restart the broker");
                log.push(format!("{t}: broker {b} SIGKILL, down {hold:?}, restarted"));
            }
            (_, Brokers::Apache(c)) => {
                // A leader change: kill the leader of a partition, wait for the new one.
                let p = rng.gen_range(0..partitions);
                // Only a replica in sync can be elected (unclean election is off): a node
                // restarted by an earlier fault may still be catching up, and killing the
                // leader of a partition whose only in-sync replica it is leaves the partition
                // without a leader until it restarts (seen in CI: "leader None" for 60 s).
                wait_for(
                    "every replica of the partition in sync before its leader is killed",
                    Duration::from_secs(90),
                    || async {
                        let isr = c.isr_of(&topic, p);
                        if isr.len() == BROKERS as usize {
                            Ok(())
                        } else {
                            Err(format!("in-sync replicas of partition {p}: {isr:?}"))
                        }
                    },
                )
                .await;
                let Some(old) = c.leader_of(&topic, p) else {
                    log.push(format!("{t}: partition {p} had no leader to kill"));
                    continue;
                };
                c.kill(old);
                wait_for(
                    "a new partition leader",
                    Duration::from_secs(60),
                    || async {
                        match c.leader_of(&topic, p) {
                            Some(l) if l != old => Ok(()),
                            other => Err(format!("leader {other:?}")),
                        }
                    },
                )
                .await;
                let new = c.leader_of(&topic, p);
                c.restart(old).expect("restart the old leader");
                log.push(format!(
                    "{t}: partition {p} leader {old} SIGKILL -> leader {new:?}; {old} restarted"
                ));
            }
        }
    }
    faults_done.send(true).unwrap();

    let mut committed: HashMap<String, String> = HashMap::new();
    let mut rolled_back = HashSet::new();
    for w in writers {
        let (c, r) = w.await.unwrap();
        committed.extend(c);
        rolled_back.extend(r.into_iter().map(|(_, id)| id));
    }
    committed.extend(canaries);
    let n = committed.len() as i64;
    relay.assert_running();
    let deadline = Duration::from_secs(120 + events / 100);
    let wait_n = |what: &'static str, sql: &'static str| {
        let env = &env;
        async move {
            wait_for(what, deadline, || async {
                let c = env.count(sql).await;
                if c >= n {
                    Ok(())
                } else {
                    Err(format!("{c} < {n}"))
                }
            })
            .await
        }
    };
    wait_n(
        "every committed event accepted",
        "SELECT count(*) FROM outbox.receipts",
    )
    .await;
    wait_for("no DISPATCH_UNKNOWN left open", deadline, || async {
        let open = env
            .count("SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'")
            .await;
        if open == 0 {
            Ok(())
        } else {
            Err(format!("{open} open"))
        }
    })
    .await;
    wait_n(
        "the inbox consumer to see every event",
        "SELECT count(*) FROM outbox.inbox WHERE consumer_id = 'chaos'",
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let consumer_run = consumer.await.unwrap();

    // ---- the invariant counts, from the database and the topic ----
    if env.kafka.mock_cluster().is_some() {
        // The mock trims old messages: every partition must still start at offset 0.
        let c: rdkafka::consumer::BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", env.kafka.bootstrap_servers())
            .create()
            .expect("watermark client");
        for p in 0..partitions {
            let (lo, _) = c
                .fetch_watermarks(&topic, p, Duration::from_secs(10))
                .expect("watermarks");
            assert_eq!(
                lo, 0,
                "the mock cluster trimmed partition {p}; use more partitions"
            );
        }
    }
    let msgs = env.verify_receipts(&[&topic]).await.messages;
    let ids: HashSet<&str> = committed.values().map(String::as_str).collect();
    let on_broker: HashSet<&str> = msgs.iter().map(|m| m.id()).collect();
    let receipted: HashSet<String> = env
        .db
        .query("SELECT DISTINCT event_id::text FROM outbox.receipts", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let lost = lost_events(&ids, &on_broker, &receipted);
    // A business key with more than one id on the broker, or an id no committed row has.
    let mut per_key: HashMap<String, HashSet<String>> = HashMap::new();
    for m in &msgs {
        let key = m
            .payload
            .as_deref()
            .and_then(|p| serde_json::from_str::<serde_json::Value>(p).ok())
            .and_then(|v| v["key"].as_str().map(str::to_string))
            .unwrap_or_default();
        per_key.entry(key).or_default().insert(m.id().to_string());
    }
    let second_ids = per_key.values().filter(|s| s.len() > 1).count() as i64
        + on_broker.difference(&ids).count() as i64;
    let rolled_back_published = rolled_back
        .iter()
        .filter(|id| on_broker.contains(id.as_str()))
        .count();
    let cross = env
        .count(
            "SELECT (SELECT count(*) FROM outbox.receipts r JOIN outbox.events_current e USING (event_id)
                     WHERE r.topic <> e.dest_topic OR r.destination_digest <> e.destination_digest)
                  + (SELECT count(*) FROM outbox.duplicate_receipts d JOIN outbox.events_current e USING (event_id)
                     WHERE d.topic <> e.dest_topic)",
        )
        .await
        + msgs.iter().filter(|m| m.key.is_none()).count() as i64;
    let duplicate_effects = env.count(DUPLICATE_EFFECTS_SQL).await;
    let consumer_gaps = env
        .count("SELECT count(*) FROM outbox.consumer_gaps WHERE consumer_id = 'chaos'")
        .await;
    let late_acks = env
        .count("SELECT count(*) FROM outbox.duplicate_receipts")
        .await;
    let late_converged = env
        .count(
            "SELECT count(*) FROM outbox.duplicate_receipts d
             WHERE EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = d.event_id)",
        )
        .await;
    let convergence = if late_acks == 0 {
        100.0
    } else {
        late_converged as f64 * 100.0 / late_acks as f64
    };
    // UNKNOWN: still open, or FOUND at an offset that does not hold the event.
    let found: Vec<(String, i32, i64)> = env
        .db
        .query(
            "SELECT event_id::text, partition, found_offset FROM outbox.attempts WHERE state = 'FOUND'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let at: HashMap<(i32, i64), &str> = msgs
        .iter()
        .map(|m| ((m.partition, m.offset), m.id()))
        .collect();
    let unknown_untraced = env
        .count("SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'")
        .await
        + found
            .iter()
            .filter(|(id, p, o)| at.get(&(*p, *o)) != Some(&id.as_str()))
            .count() as i64;
    let unknown_attempts = env.count("SELECT count(*) FROM outbox.attempts").await;
    // Wall time from DISPATCH_UNKNOWN to resolved, ms (the seeds' gate: p99 within 15 min).
    let resolution = env
        .db
        .query_one(
            "SELECT coalesce(percentile_disc(0.5) WITHIN GROUP (ORDER BY ms), 0),
                    coalesce(percentile_disc(0.99) WITHIN GROUP (ORDER BY ms), 0),
                    coalesce(max(ms), 0)
             FROM (SELECT (extract(epoch FROM resolved_at - unknown_at) * 1000)::bigint AS ms
                   FROM outbox.attempts WHERE resolved_at IS NOT NULL) t",
            &[],
        )
        .await
        .unwrap();
    let (resolution_p50, resolution_p99, resolution_max): (i64, i64, i64) =
        (resolution.get(0), resolution.get(1), resolution.get(2));
    let relay_generations = env
        .count(&format!(
            "SELECT coalesce(max(generation), 0) FROM outbox.relay_leases WHERE slot_name = '{}'",
            env.slot
        ))
        .await;
    // Order: per aggregate, first occurrences on the broker in version order.
    let mut seen = HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut order_violations = 0;
    let mut sorted: Vec<_> = msgs.iter().collect();
    sorted.sort_by_key(|m| (m.partition, m.offset));
    for m in sorted {
        if !seen.insert(m.id()) {
            continue;
        }
        let v: i64 = m
            .headers
            .get("aggregate_version")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let k = m.key.clone().unwrap_or_default();
        if last.get(&k).is_some_and(|l| *l > v) {
            order_violations += 1;
        }
        last.insert(k, v);
    }
    let (confirmed_past_unaccepted, samples) = sampler.violations(&env).await;

    let summary = format!(
        "traces=1 lost={lost} second_ids={second_ids} cross_destination_retries={cross} duplicate_effects={duplicate_effects} late_ack_convergence={convergence:.2}% unknown_untraced={unknown_untraced}"
    );
    let mut report = String::new();
    report.push_str(&format!(
        "outboxd chaos report ({on})\nseed {seed}\nevents_committed {n}\ntransactions_rolled_back_events {}\nfaults {faults}\nwall_time {:.1} s\n",
        rolled_back.len(),
        started.elapsed().as_secs_f64()
    ));
    for l in &log {
        report.push_str(&format!("fault {l}\n"));
    }
    for (name, v) in [
        ("lost", lost),
        ("second_ids", second_ids),
        ("cross_destination_retries", cross),
        ("duplicate_effects", duplicate_effects),
        ("unknown_untraced", unknown_untraced),
        ("order_violations", order_violations),
        ("confirmed_past_unaccepted", confirmed_past_unaccepted),
        ("rolled_back_published", rolled_back_published as i64),
        ("late_acks", late_acks),
        ("late_acks_converged", late_converged),
        ("unknown_attempts", unknown_attempts),
        ("unknown_resolution_p50_ms", resolution_p50),
        ("unknown_resolution_p99_ms", resolution_p99),
        ("unknown_resolution_max_ms", resolution_max),
        ("relay_generations", relay_generations),
        ("broker_messages", msgs.len() as i64),
        ("consumer_gaps", consumer_gaps),
        ("consumer_crashes", consumer_run.crashes as i64),
        ("consumer_redeliveries", consumer_run.redeliveries as i64),
        ("consumer_stall_restarts", consumer_run.stalls as i64),
        ("invariant5_samples", samples as i64),
    ] {
        report.push_str(&format!("{name:<28} {v}\n"));
    }
    report.push_str(&summary);
    report.push('\n');
    let path = std::env::var("OUTBOXD_CHAOS_REPORT")
        .unwrap_or_else(|_| format!("{}/{name}-report-{seed}.txt", env!("CARGO_TARGET_TMPDIR")));
    std::fs::write(&path, &report).expect("write the chaos report");
    println!("{report}report: {path}");

    assert_eq!(lost, 0, "lost events");
    assert_eq!(second_ids, 0, "second logical event ids");
    assert_eq!(cross, 0, "cross-destination retries");
    assert_eq!(duplicate_effects, 0, "consumer duplicate effects");
    assert_eq!(consumer_gaps, 0, "version gaps seen by the consumer");
    assert_eq!(late_acks, late_converged, "late ACKs not converged");
    assert_eq!(unknown_untraced, 0, "UNKNOWN attempts not traced");
    assert!(
        resolution_p99 <= 15 * 60 * 1000,
        "UNKNOWN resolution p99 {resolution_p99} ms is past 15 minutes"
    );
    assert_eq!(order_violations, 0, "per-aggregate order");
    assert_eq!(rolled_back_published, 0, "rolled-back events published");
    if mode == Mode::Cdc {
        assert!(samples > 0);
    } else {
        assert_eq!(
            env.count(
                "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
            )
            .await,
            0,
            "poll mode made a slot"
        );
    }
    assert_eq!(
        confirmed_past_unaccepted, 0,
        "confirmed LSN passed an unaccepted event"
    );
    // Every scheduled fault was injected, and had its effect: a SIGSTOPped broker left an
    // UNKNOWN attempt (a canary makes sure a request was in flight), a SIGKILL started a new
    // relay generation, the consumer crashed and was handed a message again. (Late ACKs are
    // reported, not asserted: a restart re-sends nothing when the slot was confirmed up to
    // the ledger's checkpoint, as with seed 3 on the mock.)
    assert_eq!(log.len() as u64, faults, "faults injected: {log:?}");
    let stalls = log.iter().filter(|l| l.contains("SIGSTOP")).count();
    if stalls > 0 {
        assert!(
            unknown_attempts > 0,
            "{stalls} stalled-broker fault(s) and no DISPATCH_UNKNOWN attempt"
        );
    }
    let kills = log.iter().filter(|l| l.contains("SIGKILL relay")).count() as i64;
    assert!(
        relay_generations > kills,
        "{kills} relay SIGKILL(s) but lease generation {relay_generations}"
    );
    assert!(consumer_run.crashes > 0, "the consumer never crashed");
    assert!(
        consumer_run.redeliveries > 0,
        "the consumer crashed {} time(s) and was never handed a message again",
        consumer_run.crashes
    );
}

/// The consumer-side counts can fail: an inbox that forgets an event (a planted dedup bug)
/// runs the effect twice, and a version skipped reaches the gap table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_counts_see_a_planted_double_effect_and_a_gap() {
    let env = TestEnv::new("chaos_counts").await;
    env.db
        .batch_execute(
            "CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, event_id text NOT NULL)",
        )
        .await
        .unwrap();
    let mut db = connect(&env.url).await;
    let handler = effect_handler();
    let message = |version: i64, offset: i64| outbox_inbox::InboxMessage {
        event_id: uuid::Uuid::new_v4(),
        aggregate_type: "chaos".into(),
        aggregate_id: "a1".into(),
        aggregate_version: version,
        event_type: "chaos.tick".into(),
        payload: b"{}".to_vec(),
        topic: env.topic.clone(),
        partition: 0,
        offset,
    };
    async fn process(
        db: &mut tokio_postgres::Client,
        m: &outbox_inbox::InboxMessage,
        handler: &dyn outbox_inbox::Handler,
    ) -> outbox_inbox::Outcome {
        outbox_inbox::store::process(
            db,
            CONSUMER,
            outbox_inbox::GapPolicy::Report,
            m,
            m.offset + 1,
            handler,
        )
        .await
        .unwrap()
    }
    let first = message(1, 0);
    process(&mut db, &first, &handler).await;
    // Redelivered as it should be: recognised, no second effect.
    let again = process(&mut db, &first, &handler).await;
    assert!(matches!(again, outbox_inbox::Outcome::Duplicate(_)));
    assert_eq!(env.count(DUPLICATE_EFFECTS_SQL).await, 0);
    // Planted: the inbox forgets the event (its row and the aggregate's watermark, which
    // would otherwise call the redelivery stale), and the redelivery runs the effect again.
    env.db
        .batch_execute(&format!(
            "DELETE FROM outbox.inbox WHERE event_id = '{}';
             DELETE FROM outbox.consumer_aggregate_heads WHERE consumer_id = '{CONSUMER}'",
            first.event_id
        ))
        .await
        .unwrap();
    process(&mut db, &first, &handler).await;
    assert_eq!(env.count(DUPLICATE_EFFECTS_SQL).await, 1);
    // Planted: version 3 after version 1.
    process(&mut db, &message(3, 1), &handler).await;
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.consumer_gaps WHERE consumer_id = 'chaos'")
            .await,
        1
    );
}
