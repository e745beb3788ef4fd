//! Per-aggregate order, gap/poison holds, and payload evolution (invariant 7).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::Command;

use rand::{Rng, SeedableRng};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use serde_json::json;

use crate::harness::{connect, TestEnv, TopicMessage};
use outbox_testkit::wait::wait_for;

/// For each message key, the aggregate versions in broker (offset) order, first occurrences only.
pub(crate) fn first_occurrences(msgs: &[TopicMessage]) -> HashMap<String, Vec<i64>> {
    let mut by_partition: BTreeMap<i32, Vec<&TopicMessage>> = BTreeMap::new();
    for m in msgs {
        by_partition.entry(m.partition).or_default().push(m);
    }
    let mut seen = HashSet::new();
    let mut out: HashMap<String, Vec<i64>> = HashMap::new();
    for (_, mut ms) in by_partition {
        ms.sort_by_key(|m| m.offset);
        for m in ms {
            if seen.insert(m.id().to_string()) {
                let v: i64 = m.headers["aggregate_version"].parse().unwrap();
                out.entry(m.key.clone().unwrap_or_default())
                    .or_default()
                    .push(v);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_writers_on_one_aggregate_get_dense_versions_in_broker_order() {
    let env = TestEnv::new("eight_writers").await;
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    let mut writers = Vec::new();
    for w in 0..8 {
        let url = env.url.clone();
        let agg = env.aggregate_type.clone();
        writers.push(tokio::spawn(async move {
            let mut c = connect(&url).await;
            for i in 0..125 {
                let tx = c.transaction().await.unwrap();
                tx.query_one(
                    "SELECT outbox.enqueue($1, 'hot', 'tick', $2)",
                    &[&agg, &json!({"w": w, "i": i})],
                )
                .await
                .unwrap();
                tx.commit().await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let dense = env
        .count("SELECT count(DISTINCT aggregate_version) FILTER (WHERE aggregate_version BETWEEN 1 AND 1000) FROM outbox.events WHERE aggregate_id = 'hot'")
        .await;
    assert_eq!(dense, 1000, "versions are exactly 1..1000");
    env.wait_count("all receipts", "SELECT count(*) FROM outbox.receipts", 1000)
        .await;
    let order = first_occurrences(&env.read_topic().await);
    let expected: Vec<i64> = (1..=1000).collect();
    assert_eq!(order["hot"], expected, "broker order = version order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_aggregates_keep_their_order_through_sigkills_and_broker_faults() {
    let env = TestEnv::new_mock(
        "fifty_aggs",
        "inject NOT_LEADER_FOR_PARTITION / NOT_ENOUGH_REPLICAS at start-up, the librdkafka implicit-ack path (real-broker leader kills: real_kafka::)",
    )
    .await;
    let seed: u64 = std::env::var("OUTBOXD_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x0de2);
    println!("seed={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut relay = env.relay(&[], &[]);
    env.wait_streaming().await;

    // The last 4 rounds (200 events) are committed only after the last SIGKILL, so that every
    // kill meets traffic: a kill after the relay had published all 2000 would prove nothing
    // (in poll mode the third one did, at seed 3554).
    let (kills_done, wait_kills) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    for w in 0..4usize {
        let url = env.url.clone();
        let agg = env.aggregate_type.clone();
        let mut wait_kills = wait_kills.clone();
        writers.push(tokio::spawn(async move {
            let c = connect(&url).await;
            for round in 0..40 {
                if round == 36 {
                    wait_kills.wait_for(|done| *done).await.unwrap();
                }
                for a in (0..50).filter(|a| a % 4 == w) {
                    c.query_one(
                        "SELECT outbox.enqueue($1, $2, 'step', '{}')",
                        &[&agg, &format!("a{a}")],
                    )
                    .await
                    .unwrap();
                }
            }
        }));
    }
    let mut thresholds: Vec<i64> = (0..3).map(|_| rng.gen_range(100..1800)).collect();
    thresholds.sort();
    for (i, t) in thresholds.into_iter().enumerate() {
        let m = env.kafka.mock_cluster().expect("mock cluster");
        // Retriable produce errors: librdkafka retries them inside the idempotent session.
        let errs = [
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        ];
        m.request_errors(RDKafkaApiKey::Produce, &errs[..(i % 2 + 1)].repeat(3));
        env.wait_count(
            "progress before the next kill",
            "SELECT count(*) FROM outbox.receipts",
            t,
        )
        .await;
        relay.assert_running();
        relay.kill9();
        env.assert_fault_met_traffic(&format!("SIGKILL {} (at {t} receipts)", i + 1), 2000)
            .await;
        relay = env.relay(&[], &[]);
    }
    kills_done.send(true).unwrap();
    for w in writers {
        w.await.unwrap();
    }
    env.wait_count(
        "all 2000 receipts",
        "SELECT count(*) FROM outbox.receipts",
        2000,
    )
    .await;
    let order = first_occurrences(&env.read_topic().await);
    let expected: Vec<i64> = (1..=40).collect();
    let mut out_of_order = 0;
    for a in 0..50 {
        if order.get(&format!("a{a}")) != Some(&expected) {
            out_of_order += 1;
            println!("a{a}: {:?}", order.get(&format!("a{a}")));
            // Where the ledger says each version went, to tell a broker that lost an
            // acknowledged message from a receipt that points at nothing.
            for r in env
                .db
                .query(
                    "SELECT e.aggregate_version, r.partition, r.\"offset\", r.attempt, r.relay_generation
                     FROM outbox.events e JOIN outbox.receipts r USING (event_id)
                     WHERE e.aggregate_id = $1 AND e.aggregate_version <= 2 ORDER BY 1",
                    &[&format!("a{a}")],
                )
                .await
                .unwrap()
            {
                println!(
                    "  v{} receipt {}@{} attempt {} generation {}",
                    r.get::<_, i64>(0),
                    r.get::<_, i32>(1),
                    r.get::<_, i64>(2),
                    r.get::<_, i32>(3),
                    r.get::<_, i64>(4)
                );
            }
        }
    }
    if out_of_order > 0 {
        let msgs = env.read_topic().await;
        for p in 0..3 {
            let offs: Vec<i64> = msgs
                .iter()
                .filter(|m| m.partition == p)
                .map(|m| m.offset)
                .take(3)
                .collect();
            println!("partition {p}: first offsets read {offs:?}");
        }
    }
    assert_eq!(
        out_of_order, 0,
        "aggregates whose first occurrences are not 1..40"
    );
}

fn outboxd(args: &[&str]) -> String {
    let (ok, out) = crate::harness::outboxd(args);
    assert!(ok, "outboxd {args:?}: {out}");
    out
}

/// `outboxd quarantine skip --event ID --reason REASON`, which must succeed.
fn skip(env: &TestEnv, event: uuid::Uuid, reason: &str) -> String {
    outboxd(&[
        "quarantine",
        "skip",
        "--database-url",
        &env.url,
        "--event",
        &event.to_string(),
        "--reason",
        reason,
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_payload_holds_only_its_aggregate_until_released_then_publishes_in_order() {
    let env = TestEnv::new("poison").await;
    oversized_payload_holds_only_its_aggregate(&env, &[]).await;
}

/// The poison scenario, in CDC mode or (`mode` = `--mode poll ...`) in poll mode.
pub async fn oversized_payload_holds_only_its_aggregate(env: &TestEnv, mode: &[&str]) {
    let small = [&["--kafka-property", "message.max.bytes=2000"], mode].concat();
    let mut relay = env.relay(&[], &small);
    env.wait_ready(&relay).await;

    env.enqueue("p", json!({"n": 1})).await;
    let big = env.enqueue("p", json!({"blob": "x".repeat(5000)})).await;
    env.enqueue("p", json!({"n": 3})).await;
    env.enqueue("q", json!({"n": 1})).await;
    env.enqueue("p", json!({"n": 4})).await;
    env.enqueue("q", json!({"n": 2})).await;

    env.wait_count(
        "receipts of p1, q1, q2",
        "SELECT count(*) FROM outbox.receipts",
        3,
    )
    .await;
    // Poll mode records as held only what its round read behind the refused event; p3 and
    // p4 may be enqueued after that read and then simply wait, unread, behind the hold.
    let held_before = if relay.poll {
        env.wait_count("p held", "SELECT count(*) FROM outbox.holds", 1)
            .await;
        env.count("SELECT count(*) FROM outbox.held_events").await
    } else {
        env.wait_count(
            "p3 and p4 held",
            "SELECT count(*) FROM outbox.held_events",
            2,
        )
        .await;
        2
    };
    let reason: String = env
        .db
        .query_one(
            "SELECT reason_code || ': ' || reason FROM outbox.quarantine WHERE event_id = $1",
            &[&big],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        reason.starts_with("broker_rejected") && reason.to_lowercase().contains("too large"),
        "{reason}"
    );
    let listed = outboxd(&["quarantine", "list", "--database-url", &env.url]);
    assert!(
        listed.contains(&big.to_string())
            && listed.contains(&format!("held events: {held_before}")),
        "{listed}"
    );

    // Restart with the broker limit raised: the hold survives, new p events are held too,
    // and other aggregates keep flowing.
    relay.kill9();
    let relay = env.relay(&[], mode);
    env.wait_ready(&relay).await;
    env.enqueue("p", json!({"n": 5})).await;
    env.enqueue("q", json!({"n": 3})).await;
    env.wait_count("q3 published", "SELECT count(*) FROM outbox.receipts", 4)
        .await;
    if relay.poll {
        // Poll mode reads nothing of a held aggregate: p5 waits in the outbox, unrecorded,
        // until the release has published what the hold recorded.
        assert_eq!(
            env.count("SELECT count(*) FROM outbox.held_events").await,
            held_before
        );
    } else {
        env.wait_count(
            "p5 held after restart",
            "SELECT count(*) FROM outbox.held_events",
            3,
        )
        .await;
    }
    let order = first_occurrences(&env.read_topic().await);
    assert_eq!(
        order["p"],
        vec![1],
        "nothing of p passed the poisoned event"
    );
    assert_eq!(order["q"], vec![1, 2, 3]);

    outboxd(&[
        "quarantine",
        "release",
        "--database-url",
        &env.url,
        "--event",
        &big.to_string(),
        "--by",
        "test",
    ]);
    env.wait_count(
        "p2..p5 published",
        "SELECT count(*) FROM outbox.receipts",
        8,
    )
    .await;
    env.wait_count(
        "the hold closed",
        "SELECT 1 - count(*) FROM outbox.holds",
        1,
    )
    .await;
    let order = first_occurrences(&env.read_topic().await);
    assert_eq!(
        order["p"],
        vec![1, 2, 3, 4, 5],
        "released events publish in version order"
    );
    // And the aggregate flows normally again.
    env.enqueue("p", json!({"n": 6})).await;
    env.wait_count("p6 published", "SELECT count(*) FROM outbox.receipts", 9)
        .await;
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.held_events WHERE released_at IS NULL")
            .await,
        0
    );
}

/// One cause fixed, many events released: a producer limit too low refused the large events
/// of six aggregates (each with an event held behind it); once the limit is right,
/// `quarantine release --reason-code broker_rejected` releases all six in one command, after a
/// `--dry-run` that changes nothing, and each aggregate publishes in version order. A record
/// of another reason (an event routed to a cluster this relay does not serve) stays open, and
/// a code with nothing open is an error that names the codes that are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_by_reason_code_publishes_every_event_that_cause_refused() {
    let env = TestEnv::new("release_by_reason").await;
    let mut relay = env.relay(&[], &["--kafka-property", "message.max.bytes=2000"]);
    env.wait_ready(&relay).await;
    let aggregates = 6;
    for a in 0..aggregates {
        env.enqueue(&format!("r{a}"), json!({"blob": "x".repeat(5000)}))
            .await;
        env.enqueue(&format!("r{a}"), json!({"n": 2})).await;
    }
    env.enqueue("ok", json!({"n": 1})).await;
    env.wait_count(
        "the six large events quarantined",
        "SELECT count(*) FROM outbox.quarantine WHERE reason_code = 'broker_rejected'",
        aggregates,
    )
    .await;
    env.route_to_nats("elsewhere").await;
    env.enqueue("n", json!({"n": 1})).await;
    env.wait_count(
        "the event for a cluster this relay does not serve quarantined",
        "SELECT count(*) FROM outbox.quarantine WHERE reason_code <> 'broker_rejected'",
        1,
    )
    .await;
    let other: String = env
        .db
        .query_one(
            "SELECT reason_code FROM outbox.quarantine WHERE reason_code <> 'broker_rejected'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    relay.kill9();
    let relay = env.relay(&[], &[]);
    env.wait_ready(&relay).await;

    let listed = outboxd(&["quarantine", "list", "--database-url", &env.url]);
    assert!(
        listed.contains(&format!("by reason: broker_rejected 6, {other} 1")),
        "{listed}"
    );
    let open = "SELECT count(*) FROM outbox.quarantine WHERE released_at IS NULL";
    let release = |more: &[&str]| {
        let args = ["quarantine", "release", "--database-url", &env.url];
        crate::harness::outboxd(&[&args[..], &["--reason-code", "broker_rejected"], more].concat())
    };
    let (ok, dry) = release(&["--dry-run"]);
    assert!(ok && dry.contains("would release 6 event(s)"), "{dry}");
    assert_eq!(env.count(open).await, 7, "the dry run changed nothing");
    let (ok, released) = release(&["--by", "test"]);
    assert!(ok, "{released}");
    assert!(released.contains("released 6 event(s)"), "{released}");
    env.wait_count(
        "every event of the six aggregates and ok published",
        "SELECT count(*) FROM outbox.receipts",
        2 * aggregates + 1,
    )
    .await;
    let check = env.verify_receipts(&[&env.topic]).await;
    let order = first_occurrences(&check.messages);
    for a in 0..aggregates {
        assert_eq!(
            order.get(&format!("r{a}")),
            Some(&vec![1, 2]),
            "r{a} publishes in version order after the release"
        );
    }
    assert_eq!(
        env.count(open).await,
        1,
        "the other reason's record stays open"
    );
    let (ok, none) = release(&[]);
    assert!(
        !ok && none.contains(&format!("open ones: {other} (1)")),
        "a code with nothing open must fail and name the open codes: {none}"
    );
}

/// One kind of event dropped by the thousand: `quarantine skip --reason-code broker_rejected
/// --reason ...` skips every open record of that reason in one command, after a `--dry-run`
/// that changes nothing; the events held behind them publish, the skipped ones never reach
/// the topic, and each record says who skipped it and why. An empty reason is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_by_reason_code_drops_every_event_of_that_cause_and_publishes_what_waited() {
    let env = TestEnv::new("skip_by_reason").await;
    let relay = env.relay(&[], &["--kafka-property", "message.max.bytes=2000"]);
    env.wait_ready(&relay).await;
    let aggregates = 3;
    let mut large = Vec::new();
    for a in 0..aggregates {
        large.push(
            env.enqueue(&format!("k{a}"), json!({"blob": "x".repeat(5000)}))
                .await,
        );
        env.enqueue(&format!("k{a}"), json!({"n": 2})).await;
    }
    env.wait_count(
        "the large events quarantined",
        "SELECT count(*) FROM outbox.quarantine WHERE reason_code = 'broker_rejected'",
        aggregates,
    )
    .await;
    let skip = |more: &[&str]| {
        let args = ["quarantine", "skip", "--database-url", &env.url];
        crate::harness::outboxd(&[&args[..], more].concat())
    };
    let (ok, empty) = skip(&["--reason-code", "broker_rejected", "--reason", " "]);
    assert!(!ok && empty.contains("--reason must say why"), "{empty}");
    let why = [
        "--reason-code",
        "broker_rejected",
        "--reason",
        "replaced by v2 events",
    ];
    let (ok, dry) = skip(&[&why[..], &["--dry-run"]].concat());
    assert!(ok && dry.contains("would skip 3 event(s)"), "{dry}");
    let open = "SELECT count(*) FROM outbox.quarantine WHERE released_at IS NULL";
    assert_eq!(env.count(open).await, 3, "the dry run changed nothing");
    let (ok, skipped) = skip(&[&why[..], &["--by", "test"]].concat());
    assert!(ok && skipped.contains("skipped 3 event(s)"), "{skipped}");
    env.wait_count(
        "the events held behind the skipped ones published",
        "SELECT count(*) FROM outbox.receipts",
        aggregates,
    )
    .await;
    let check = env.verify_receipts(&[&env.topic]).await;
    let order = first_occurrences(&check.messages);
    for a in 0..aggregates {
        assert_eq!(order.get(&format!("k{a}")), Some(&vec![2]), "k{a}");
    }
    for id in &large {
        let id = id.to_string();
        assert!(
            check.messages.iter().all(|m| m.id() != id),
            "skipped {id} reached the topic"
        );
    }
    assert_eq!(
        env.count(
            "SELECT count(*) FROM outbox.quarantine WHERE resolution = 'skipped' \
             AND released_by = 'test' AND release_note = 'replaced by v2 events'"
        )
        .await,
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_needs_a_reason_and_publishes_what_was_held_behind() {
    let env = TestEnv::new("skip").await;
    let relay = env.relay(&[], &["--kafka-property", "message.max.bytes=2000"]);
    env.wait_streaming().await;
    let ids = env
        .enqueue_together(&[
            ("s", json!({"blob": "y".repeat(5000)})),
            ("s", json!({"n": 2})),
        ])
        .await;
    let big = ids[0];
    env.wait_count("s2 held", "SELECT count(*) FROM outbox.held_events", 1)
        .await;
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "quarantine",
            "skip",
            "--database-url",
            &env.url,
            "--event",
            &big.to_string(),
            "--reason",
            " ",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "an empty reason is refused");
    skip(&env, big, "test payload, never needed");
    env.wait_count("s2 published", "SELECT count(*) FROM outbox.receipts", 1)
        .await;
    let order = first_occurrences(&env.read_topic().await);
    assert_eq!(order["s"], vec![2], "the skipped event is never published");
    // Nor offered again: a poll round read it again and retried it until migration 0016.
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.quarantine WHERE event_id = '{big}'"
        ))
        .await,
        1,
        "the skipped event was offered again"
    );
    let note: String = env
        .db
        .query_one(
            "SELECT resolution || ': ' || release_note FROM outbox.quarantine WHERE event_id = $1",
            &[&big],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(note, "skipped: test payload, never needed");

    // Skipping the only event of an aggregate moves its head: after a restart, version 2 is
    // the next one, not a gap.
    let only = env.enqueue("t", json!({"blob": "z".repeat(5000)})).await;
    env.wait_count("t1 quarantined", "SELECT count(*) FROM outbox.holds", 1)
        .await;
    skip(&env, only, "obsolete");
    env.wait_count(
        "the hold closed",
        "SELECT 1 - count(*) FROM outbox.holds",
        1,
    )
    .await;
    drop(relay);
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    env.enqueue("t", json!({"n": 2})).await;
    env.wait_count(
        "t2 published after the restart",
        "SELECT count(*) FROM outbox.receipts",
        2,
    )
    .await;
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.holds").await,
        0,
        "no false gap"
    );
}

/// What a relay with several versions of an aggregate in flight logs for each one it sends
/// behind another (`PipelineCore::handed_over`, at debug level).
pub(crate) const SENT_BEHIND: &str = "sent behind a version of its aggregate still in flight";

/// The relay's log levels with the core's pipelined sends.
pub(crate) const LOG_PIPELINED: (&str, &str) = (
    "OUTBOXD_LOG",
    "info,outboxd=debug,outbox_relay::pipeline=debug,tokio_postgres=warn",
);

/// After a relay with several versions of an aggregate in flight (`relay`, logging
/// [`LOG_PIPELINED`]) published `aggregates` x `versions` events: more than `at_least` were
/// sent behind a version of their aggregate in flight, every receipt names its message on the
/// test's topic, and every aggregate's first occurrences are its versions in order. Returns how
/// many were sent behind.
pub(crate) async fn pipelined_in_order(
    env: &TestEnv,
    relay: &crate::harness::RelayProcess,
    aggregates: usize,
    versions: usize,
    at_least: usize,
) -> usize {
    let behind = relay.log_text().matches(SENT_BEHIND).count();
    assert!(
        behind > at_least,
        "only {behind} versions were sent behind one in flight: the deeper gate did not pipeline"
    );
    let check = env.verify_receipts(&[&env.topic]).await;
    let order = first_occurrences(&check.messages);
    let expected: Vec<i64> = (1..=versions as i64).collect();
    assert_eq!(order.len(), aggregates);
    for (key, got) in &order {
        assert_eq!(got, &expected, "{key}: broker order = version order");
    }
    behind
}

/// One version of each of `aggregates` hot aggregates (`hot-0`, `hot-1`, ...) of
/// `aggregate_type`, in one committed transaction; `v` goes into each payload.
pub(crate) async fn enqueue_hot_round(
    db: &mut tokio_postgres::Client,
    aggregate_type: &str,
    aggregates: usize,
    v: usize,
) {
    let tx = db.transaction().await.unwrap();
    for a in 0..aggregates {
        tx.query_one(
            "SELECT outbox.enqueue($1, $2, 'tick', $3)",
            &[&aggregate_type, &format!("hot-{a}"), &json!({"v": v})],
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
}

cdc_only! {
    "CDC only: --in-flight-per-aggregate is refused in poll mode (a poll round sends one version of an aggregate at a time)";
    /// Issue 27, hot aggregates: with `--in-flight-per-aggregate 8` a backlog of eight
    /// aggregates drains with later versions sent before the broker answered the earlier
    /// ones, and still every aggregate's versions are on the broker in order, every event has
    /// a receipt, and every receipt names its message on the topic.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hot_aggregates_with_versions_in_flight_keep_broker_order_and_every_receipt() {
        const AGGREGATES: usize = 8;
        const VERSIONS: usize = 150;
        let env = TestEnv::new("deep_gate").await;
        // The backlog first: the relay finds every aggregate with many versions waiting.
        let mut db = connect(&env.url).await;
        for v in 0..VERSIONS {
            enqueue_hot_round(&mut db, &env.aggregate_type, AGGREGATES, v).await;
        }
        let relay = env.relay(&[LOG_PIPELINED], &["--in-flight-per-aggregate", "8"]);
        let total = (AGGREGATES * VERSIONS) as i64;
        env.every_event_published(total).await;
        let behind = pipelined_in_order(&env, &relay, AGGREGATES, VERSIONS, 100).await;
        println!("{behind} of {total} versions sent behind one of their aggregate in flight");
    }

    /// Issue 27, hot aggregates: the operator raises the topic's partitions from 3 to 6 while
    /// a relay with 8 versions of an aggregate in flight streams eight hot aggregates. The
    /// producer places keys by the count it pinned until nothing is in flight, then adopts the
    /// new one (the race it closes, a version placed by the new count landing before one still
    /// in flight by the old, is the simulator's: mutant `deep-unpinned`). Here: the change is
    /// adopted, so keys reach the new partitions; every aggregate moves at most once; each
    /// partition holds its aggregates' versions in order; every receipt names its message.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_partition_count_raised_mid_stream_moves_each_hot_aggregate_once_and_in_order() {
        const AGGREGATES: usize = 8;
        // What the relay logs when it adopts a raised count (`KafkaSink::admit`).
        const ADOPTED: &str = "adopted with nothing in flight";
        let env = TestEnv::new("deep_repartition").await;
        let relay = env.relay(
            &[LOG_PIPELINED],
            &[
                "--in-flight-per-aggregate",
                "8",
                // librdkafka sees a new partition count at its next metadata refresh (5 min by
                // default).
                "--kafka-property",
                "topic.metadata.refresh.interval.ms=300",
            ],
        );
        env.wait_streaming().await;
        // A writer of one version of each aggregate every 15 ms, until told to stop.
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        use std::sync::Arc;
        let (rounds, stop) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let writer = {
            let (url, aggregate_type) = (env.url.clone(), env.aggregate_type.clone());
            let (rounds, stop) = (rounds.clone(), stop.clone());
            tokio::spawn(async move {
                let mut db = connect(&url).await;
                while !stop.load(Relaxed) {
                    let v = rounds.load(Relaxed);
                    enqueue_hot_round(&mut db, &aggregate_type, AGGREGATES, v).await;
                    rounds.store(v + 1, Relaxed);
                    tokio::time::sleep(std::time::Duration::from_millis(15)).await;
                }
            })
        };
        let wrote = |n: usize| {
            let rounds = rounds.clone();
            async move {
                let at = rounds.load(Relaxed);
                if at >= n {
                    Ok(at)
                } else {
                    Err(format!("{at} rounds written"))
                }
            }
        };
        let deadline = std::time::Duration::from_secs(60);
        wait_for("the writer's first rounds", deadline, || wrote(40)).await;
        // Raised while the writer goes on (the other worker thread runs it).
        tokio::task::block_in_place(|| env.kafka.add_partitions(&env.topic, 6))
            .expect("raise the topic's partitions");
        let adopted = wait_for("the relay to adopt the raised count", deadline, || {
            let log = relay.log_text();
            let at = rounds.load(Relaxed);
            async move {
                if log.contains(ADOPTED) {
                    Ok(at)
                } else {
                    Err(format!("not adopted after {at} rounds written"))
                }
            }
        })
        .await;
        // Versions placed by the new count, then the writer stops.
        wait_for("rounds after the adoption", deadline, || wrote(adopted + 20)).await;
        stop.store(true, Relaxed);
        writer.await.expect("writer");
        let written = rounds.load(Relaxed);
        env.every_event_published((AGGREGATES * written) as i64)
            .await;
        let check = env.verify_receipts_after_repartition(&[&env.topic]).await;
        // Per aggregate: its first occurrences by version, with where each is.
        let mut seen = HashSet::new();
        let mut by_key: HashMap<String, Vec<(i64, i32, i64)>> = HashMap::new();
        for m in &check.messages {
            if seen.insert(m.id().to_string()) {
                let v: i64 = m.headers["aggregate_version"].parse().unwrap();
                by_key
                    .entry(m.key.clone().unwrap_or_default())
                    .or_default()
                    .push((v, m.partition, m.offset));
            }
        }
        assert_eq!(by_key.len(), AGGREGATES);
        let mut moved = 0;
        for (key, mut versions) in by_key {
            versions.sort_unstable();
            let got: Vec<i64> = versions.iter().map(|(v, ..)| *v).collect();
            assert_eq!(got, (1..=written as i64).collect::<Vec<_>>(), "{key}");
            let mut partitions: Vec<i32> = versions.iter().map(|(_, p, _)| *p).collect();
            partitions.dedup();
            assert!(
                partitions.len() <= 2,
                "{key} moved more than once: {partitions:?}"
            );
            if partitions.iter().any(|p| *p >= 3) {
                moved += 1;
            }
            for w in versions.windows(2) {
                if w[0].1 == w[1].1 {
                    assert!(w[0].2 < w[1].2, "{key}: v{} after v{} on its partition", w[0].0, w[1].0);
                }
            }
        }
        assert!(moved > 0, "no aggregate reached the new partitions");
        println!("{moved} of {AGGREGATES} aggregates moved to the new partitions");
    }
}

cdc_only! {
    "CDC only: a replay from a checkpoint; poll mode has no checkpoint, and its rounds' read leaves skipped events out (skip_needs_a_reason_and_publishes_what_was_held_behind)";
    /// A relay that replays an event an operator skipped (it starts from a checkpoint before the
    /// event: here an earlier event of another aggregate waits on a handler that is down, so the
    /// checkpoint cannot pass it, and the relay is SIGKILLed after the skip) does not send it:
    /// the skip is for good, whoever meets the event again. Before 2026-12-07 the hold was gone by
    /// then and the replay published the skipped event (found by the simulator, bug 26 of
    /// docs/simulation.md).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_event_an_operator_skipped_is_not_sent_when_a_restarted_relay_replays_it() {
        use outbox_testkit::http_target::TargetSettings;
        const DOWN: &str = "handler-down-for-this-tenant";
        let (env, target) = crate::http::endpoint_env(
            "skip_replay",
            TargetSettings {
                poison: Some("refused-by-the-endpoint".into()),
                ..TargetSettings::default()
            },
        )
        .await;
        let config = env.write_config(
            "sink = \"http\"\n[http]\nendpoint = \"billing-api\"\nrequest_timeout_ms = 2500\n\
             idempotency_window_ms = 3600000\n",
        );
        let args = ["--config", config.as_str(), "--unclear-schedule-ms", "300"];
        target.unavailable_for(Some(DOWN));
        let mut relay = env.relay(&[], &args);
        env.wait_streaming().await;
        // Committed first: its answers are 503 until the handler is back, so every checkpoint
        // stays before it, and before the skipped event committed after it.
        let waiting = env.enqueue("w", json!({"tenant": DOWN})).await;
        let skipped = env
            .enqueue("s", json!({"payload": "refused-by-the-endpoint"}))
            .await;
        env.wait_count(
            "the refused event quarantined, its aggregate held",
            &format!(
                "SELECT count(*) FROM outbox.quarantine WHERE event_id = '{skipped}' AND released_at IS NULL"
            ),
            1,
        )
        .await;
        skip(&env, skipped, "refused by the endpoint, not needed");
        let after = env.enqueue("s", json!({"n": 2})).await;
        env.wait_count(
            "the event after the skipped one published",
            &format!("SELECT count(*) FROM outbox.receipts WHERE event_id = '{after}'"),
            1,
        )
        .await;
        env.wait_zero("the hold closed", "SELECT count(*) FROM outbox.holds")
            .await;
        assert!(
            target.requests_with_key(&waiting.to_string()) >= 1,
            "the waiting event met the handler that is down"
        );
        assert_eq!(
            env.count(&format!(
                "SELECT count(*) FROM outbox.receipts WHERE event_id = '{waiting}'"
            ))
            .await,
            0,
            "nothing answered the waiting event yet: the checkpoint is before it"
        );
        let refused = target.requests_with_key(&skipped.to_string());
        assert!(
            refused >= 1,
            "the skipped event was refused by the endpoint first"
        );
        relay.kill9();

        // The next relay streams from the checkpoint: the waiting event, the skipped one and the
        // one after it come again.
        target.unavailable_for(None);
        let relay = env.relay(&[], &args);
        env.wait_count(
            "the waiting event published once the handler is back",
            &format!("SELECT count(*) FROM outbox.receipts WHERE event_id = '{waiting}'"),
            1,
        )
        .await;
        // The fault met traffic: the replay read the skipped event.
        crate::ha::wait_log(&relay, "an event an operator skipped was read again").await;
        assert!(
            relay.log_text().contains(&skipped.to_string()),
            "the replay's log names another event"
        );
        assert_eq!(
            target.requests_with_key(&skipped.to_string()),
            refused,
            "the skipped event was sent again by the relay that replayed it"
        );
        assert_eq!(
            env.count(&format!(
                "SELECT count(*) FROM outbox.receipts WHERE event_id = '{skipped}'"
            ))
            .await,
            0,
            "the skipped event has a receipt"
        );
    }
}

/// An event held behind a refused one, then refused itself and skipped, is never sent again
/// and the hold closes (found by outbox-sim, seed 1 trace 27: it kept its held record, so every
/// release of the aggregate republished it and was refused again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_event_refused_in_its_turn_and_skipped_is_not_sent_again() {
    let env = TestEnv::new("skip_held").await;
    let _relay = env.relay(&[], &["--kafka-property", "message.max.bytes=2000"]);
    env.wait_streaming().await;
    let ids = env
        .enqueue_together(&[
            ("k", json!({"blob": "a".repeat(5000)})),
            ("k", json!({"blob": "b".repeat(5000)})),
            ("k", json!({"n": 3})),
        ])
        .await;
    env.wait_count(
        "k2 and k3 held behind k1",
        "SELECT count(*) FROM outbox.held_events",
        2,
    )
    .await;
    for (i, id) in ids[..2].iter().enumerate() {
        env.wait_count(
            "the event quarantined",
            &format!("SELECT count(*) FROM outbox.quarantine WHERE event_id = '{id}' AND released_at IS NULL"),
            1,
        )
        .await;
        skip(&env, *id, &format!("test payload {i}, never needed"));
    }
    env.wait_count("k3 published", "SELECT count(*) FROM outbox.receipts", 1)
        .await;
    env.wait_zero("the hold closed", "SELECT count(*) FROM outbox.holds")
        .await;
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.quarantine WHERE event_id = '{}'",
            ids[1]
        ))
        .await,
        1,
        "the skipped held event was sent again"
    );
    let order = first_occurrences(&env.read_topic().await);
    assert_eq!(order["k"], vec![3], "only k3 is published");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_gap_holds_the_aggregate_instead_of_publishing_past_it() {
    let env = TestEnv::new("gap").await;
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    let first = env.enqueue("g", json!({"n": 1})).await;
    env.wait_count("g1", "SELECT count(*) FROM outbox.receipts", 1)
        .await;
    // A row written around outbox.enqueue with version 3: version 2 never existed.
    let gap = env.insert_copy(first, 3, false).await.unwrap();
    env.enqueue("h", json!({"other": true})).await;
    env.wait_count("h1 published", "SELECT count(*) FROM outbox.receipts", 2)
        .await;
    env.wait_count(
        "the gap hold",
        "SELECT count(*) FROM outbox.holds WHERE reason_code = 'version_gap'",
        1,
    )
    .await;
    let blocking: uuid::Uuid = env
        .db
        .query_one("SELECT blocking_event_id FROM outbox.holds", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(blocking, gap);
    let order = first_occurrences(&env.read_topic().await);
    assert_eq!(order["g"], vec![1], "nothing published past the gap");
    // Filling the gap around outbox.enqueue is refused by name: version 2 is below the
    // aggregate's last version now, and would be published out of order (migration 0016).
    let err = env
        .insert_copy(first, 2, false)
        .await
        .expect_err("a reused version is refused");
    let msg = err
        .as_db_error()
        .map(|e| e.message().to_string())
        .unwrap_or_default();
    assert!(
        msg.contains("reuses version 2") && msg.contains("outbox.enqueue"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_published_as_frozen_across_schema_and_route_changes() {
    let env = TestEnv::new("evolution").await;
    // Frozen while no relay runs: schema v1, default route.
    let v1 = env
        .db
        .query_one(
            "SELECT outbox.enqueue($1, 'e-1', 'thing.made', '{\"old\": 1}', payload_schema => 'thing.v1')",
            &[&env.aggregate_type],
        )
        .await
        .unwrap()
        .get::<_, uuid::Uuid>(0);
    // "Upgrade": a new route policy and a new payload schema.
    let new_topic = format!("{}.v2", env.topic);
    env.kafka.create_topic(&new_topic, 1).unwrap();
    env.route_to(&new_topic).await;
    let v2 = env
        .db
        .query_one(
            "SELECT outbox.enqueue($1, 'e-1', 'thing.made', '{\"new\": {\"shape\": 2}}', payload_schema => 'thing.v2')",
            &[&env.aggregate_type],
        )
        .await
        .unwrap()
        .get::<_, uuid::Uuid>(0);
    let _relay = env.relay(&[], &[]);
    env.wait_count("both published", "SELECT count(*) FROM outbox.receipts", 2)
        .await;
    let old = env.read_topic().await;
    assert_eq!(
        old.len(),
        1,
        "the old event went to the destination frozen at its commit"
    );
    assert_eq!(old[0].id(), v1.to_string());
    assert_eq!(old[0].headers["payload_schema"], "thing.v1");
    assert_eq!(old[0].payload.as_deref(), Some("{\"old\": 1}"));
    let new = env.read_topic_of(&new_topic).await;
    assert_eq!(new.len(), 1);
    assert_eq!(new[0].id(), v2.to_string());
    assert_eq!(new[0].headers["payload_schema"], "thing.v2");
    assert_eq!(new[0].payload.as_deref(), Some("{\"new\": {\"shape\": 2}}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_side_rejection_never_lets_the_next_version_overtake() {
    let env = TestEnv::new_mock(
        "overtake",
        "inject a broker-side rejection (MSG_SIZE_TOO_LARGE) on exactly one Produce request",
    )
    .await;
    let mock = env.kafka.mock_cluster().expect("mock cluster");
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    // The broker rejects the next produce request permanently; versions 1 and 2 of the
    // aggregate are committed together, so both are decoded back to back.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    env.db
        .batch_execute(&format!(
            "BEGIN; SELECT outbox.enqueue('{a}', 'o', 'x', '{{\"v\": 1}}');
                    SELECT outbox.enqueue('{a}', 'o', 'x', '{{\"v\": 2}}'); COMMIT;",
            a = env.aggregate_type
        ))
        .await
        .unwrap();
    env.wait_count(
        "version 1 quarantined",
        "SELECT count(*) FROM outbox.quarantine WHERE aggregate_version = 1",
        1,
    )
    .await;
    env.wait_count(
        "version 2 held behind it",
        "SELECT count(*) FROM outbox.held_events WHERE aggregate_version = 2",
        1,
    )
    .await;
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.quarantine").await,
        1,
        "version 2 was never sent, so it cannot have been rejected too"
    );
    let order = first_occurrences(&env.read_topic().await);
    assert_eq!(
        order.get("o"),
        None,
        "version 2 must not overtake version 1"
    );
}
