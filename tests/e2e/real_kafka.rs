//! Faults of a real Apache Kafka broker, which librdkafka's mock cluster cannot show: a broker
//! process stopped (SIGSTOP) after it received a produce request, a partition leader killed
//! (SIGKILL) in a 3-node cluster and restarted, and a topic whose `max.message.bytes` refuses
//! an event. Known limit (see docs/operations.md): the broker refuses a whole record batch, so
//! an event librdkafka batched with a too-large one is quarantined with it, unless the
//! producer's `message.max.bytes` is at the topic's limit. Each test that
//! injects faults starts its own brokers (from `outbox_testkit::apache_kafka`), so its
//! faults hit nobody else; every receipt is checked against the topic.

use std::time::Duration;

use outbox_testkit::apache_kafka::KafkaCluster;
use outbox_testkit::kafka::TestKafka;
use outbox_testkit::postgres::TestPostgres;
use outbox_testkit::wait::wait_for;
use serde_json::json;

use crate::harness::{TestEnv, LONG};
use crate::ordering::first_occurrences;

fn cluster(nodes: usize) -> KafkaCluster {
    KafkaCluster::start(nodes)
        .unwrap_or_else(|e| panic!("starting {nodes} Apache Kafka node(s): {e}"))
}

async fn env_on(name: &str, c: &KafkaCluster) -> TestEnv {
    TestEnv::with_kafka(
        TestPostgres::shared(),
        name,
        TestKafka::external(c.bootstrap_servers()),
    )
    .await
}

/// Routes the test's aggregate type to a new one-partition topic whose `max.message.bytes` is
/// `limit`; returns the topic.
async fn route_to_small_topic(env: &TestEnv, limit: u32) -> String {
    let topic = format!("{}.small", env.topic);
    env.kafka
        .create_topic_with(&topic, 1, &[("max.message.bytes", &limit.to_string())])
        .unwrap();
    env.route_to(&topic).await;
    topic
}

/// Written, ACK lost, on a real broker: the broker is stopped while the produce request is in
/// its socket, librdkafka gives up ("possibly persisted"), the relay records DISPATCH_UNKNOWN;
/// the broker resumes and appends the request it had received; the partition scan finds the
/// copy and nothing is sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_stopped_mid_request_appends_it_later_and_the_scan_finds_it_without_a_resend() {
    let c = cluster(1);
    let env = env_on("kafka_sigstop", &c).await;
    let _relay = env.relay(
        &[],
        &["--message-timeout-ms", "3000", "--unknown-settle-ms", "500"],
    );
    env.wait_streaming().await;
    env.warm_up("warm").await;

    c.pause(1);
    let id = env.enqueue("lost-ack", json!({"v": 1})).await;
    env.wait_count(
        "the attempt recorded DISPATCH_UNKNOWN",
        "SELECT count(*) FROM outbox.attempts",
        1,
    )
    .await;
    c.resume(1);
    env.wait_count(
        "the attempt resolved",
        "SELECT count(*) FROM outbox.attempts WHERE state <> 'DISPATCH_UNKNOWN'",
        1,
    )
    .await;
    env.wait_count("both receipts", "SELECT count(*) FROM outbox.receipts", 2)
        .await;
    let row = env
        .db
        .query_one(
            "SELECT a.state, a.error, r.attempt, a.found_offset, r.\"offset\"
             FROM outbox.attempts a JOIN outbox.receipts r USING (event_id) WHERE a.event_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let (state, error, attempt): (String, String, i32) = (row.get(0), row.get(1), row.get(2));
    println!("UNKNOWN after {error:?} -> {state}");
    assert_eq!(
        state, "FOUND",
        "the broker appended the request it had received ({error})"
    );
    assert_eq!(attempt, 1, "the receipt is the original attempt's");
    assert_eq!(row.get::<_, Option<i64>>(3), Some(row.get::<_, i64>(4)));
    let copies = env
        .read_topic()
        .await
        .iter()
        .filter(|m| m.id() == id.to_string())
        .count();
    assert_eq!(copies, 1, "found, never sent again");
}

/// A partition leader SIGKILLed mid-stream in a 3-node cluster (replication factor 3,
/// min.insync.replicas 2), then restarted: nothing is lost, every receipt is a message on
/// the topic, and every aggregate's versions are in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_leader_killed_mid_stream_loses_nothing_and_keeps_each_aggregate_in_order() {
    let c = cluster(3);
    let env = env_on("kafka_failover", &c).await;
    let topic = format!("{}.rf3", env.topic);
    c.create_topic(&topic, 3, 3, &[("min.insync.replicas", "2")])
        .unwrap();
    env.route_to(&topic).await;
    let _relay = env.relay(&[], &["--message-timeout-ms", "30000"]);
    env.wait_streaming().await;

    const AGGREGATES: usize = 20;
    const VERSIONS: usize = 30;
    let url = env.url.clone();
    let aggregate_type = env.aggregate_type.clone();
    let writer = tokio::spawn(async move {
        let db = crate::harness::connect(&url).await;
        for v in 0..VERSIONS {
            for a in 0..AGGREGATES {
                db.query_one(
                    "SELECT outbox.enqueue($1, $2, 'test.happened', $3)",
                    &[&aggregate_type, &format!("agg-{a}"), &json!({"v": v})],
                )
                .await
                .unwrap();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let total = (AGGREGATES * VERSIONS) as i64;
    env.wait_count(
        "a third published",
        "SELECT count(*) FROM outbox.receipts",
        total / 3,
    )
    .await;
    let leader = c.leader_of(&topic, 0).expect("partition 0 has a leader");
    c.kill(leader);
    println!("killed node {leader}, the leader of {topic}/0");
    // What partition 0 had when its leader died: events of it must be published after.
    let on_p0 =
        format!("SELECT count(*) FROM outbox.receipts WHERE topic = '{topic}' AND partition = 0");
    let p0_at_kill = env.count(&on_p0).await;
    env.assert_fault_met_traffic("the leader kill", total).await;
    wait_for("a new leader of partition 0", LONG, || async {
        match c.leader_of(&topic, 0) {
            Some(l) if l != leader => Ok(()),
            other => Err(format!("leader {other:?}")),
        }
    })
    .await;
    scans_find_a_published_event_while_a_node_is_down(&env, &c, &topic).await;
    env.wait_count(
        "two thirds published",
        "SELECT count(*) FROM outbox.receipts",
        2 * total / 3,
    )
    .await;
    c.restart(leader).unwrap();
    writer.await.unwrap();
    env.every_event_published(total).await;
    let p0_total = env.count(&on_p0).await;
    assert!(
        p0_at_kill < p0_total,
        "every event of partition 0 ({p0_total}) was published before its leader was killed: the kill met no traffic"
    );
    let check = env.verify_receipts(&[&topic]).await;
    let order = first_occurrences(&check.messages);
    let expected: Vec<i64> = (1..=VERSIONS as i64).collect();
    let out_of_order: Vec<&String> = order
        .iter()
        .filter(|(_, vs)| **vs != expected)
        .map(|(k, _)| k)
        .collect();
    assert_eq!(order.len(), AGGREGATES);
    assert!(
        out_of_order.is_empty(),
        "aggregates out of order: {out_of_order:?}"
    );
}

/// Issue 27, hot aggregates: with several versions of an aggregate in flight
/// (`--in-flight-per-aggregate 8`, a gapless producer whose messages never time out), the
/// broker stopped (SIGSTOP) while hot aggregates stream: what the producer holds waits for the
/// broker instead of failing, and when it resumes nothing is lost, every receipt names its
/// message, and every aggregate's versions are on the topic in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_aggregates_with_versions_in_flight_keep_their_order_through_a_stopped_broker() {
    const AGGREGATES: usize = 6;
    const VERSIONS: usize = 120;
    let c = cluster(1);
    let env = env_on("deep_sigstop", &c).await;
    let relay = env.relay(
        &[crate::ordering::LOG_PIPELINED],
        &["--in-flight-per-aggregate", "8"],
    );
    env.wait_streaming().await;
    let url = env.url.clone();
    let aggregate_type = env.aggregate_type.clone();
    let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writes = written.clone();
    let writer = tokio::spawn(async move {
        let mut db = crate::harness::connect(&url).await;
        for v in 0..VERSIONS {
            crate::ordering::enqueue_hot_round(&mut db, &aggregate_type, AGGREGATES, v).await;
            writes.fetch_add(AGGREGATES, std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let total = (AGGREGATES * VERSIONS) as i64;
    env.wait_count(
        "a third published",
        "SELECT count(*) FROM outbox.receipts",
        total / 3,
    )
    .await;
    c.pause(1);
    let at_stop = env.assert_fault_met_traffic("the broker stop", total).await;
    // The broker stays stopped while the writers commit a third more behind it.
    let target = at_stop as usize + AGGREGATES * VERSIONS / 3;
    wait_for("writes behind the stopped broker", LONG, || async {
        let w = written.load(std::sync::atomic::Ordering::Relaxed);
        if w >= target.min(AGGREGATES * VERSIONS) {
            Ok(())
        } else {
            Err(format!("{w} written"))
        }
    })
    .await;
    c.resume(1);
    writer.await.unwrap();
    env.every_event_published(total).await;
    let behind = crate::ordering::pipelined_in_order(&env, &relay, AGGREGATES, VERSIONS, 50).await;
    println!("{at_stop} of {total} published at the stop; {behind} sent behind one in flight");
}

/// The partition scan that resolves DISPATCH_UNKNOWN, with one node of the bootstrap list
/// dead: librdkafka reports the refused connection as a consumer error, which must not end
/// the scan (a relay restarted during a broker outage once exited on it in the chaos suite).
/// Several fresh consumers, because each picks its first bootstrap broker at random.
async fn scans_find_a_published_event_while_a_node_is_down(
    env: &TestEnv,
    c: &KafkaCluster,
    topic: &str,
) {
    let row = env
        .db
        .query_one(
            "SELECT event_id::text, partition, \"offset\" FROM outbox.receipts WHERE topic = $1 ORDER BY \"offset\" LIMIT 1",
            &[&topic],
        )
        .await
        .unwrap();
    let (id, partition, offset): (String, i32, i64) = (row.get(0), row.get(1), row.get(2));
    let config = outbox_sink::KafkaSinkConfig {
        bootstrap_servers: c.bootstrap_servers().to_string(),
        ..outbox_sink::KafkaSinkConfig::default()
    };
    for round in 0..16 {
        let (config, topic, id) = (config.clone(), topic.to_string(), id.clone());
        let scan = tokio::task::spawn_blocking(move || {
            outbox_sink::scan_for_event(&config, &topic, partition, 0, &id, LONG)
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("scan {round} with a node down: {e}"));
        assert_eq!(
            scan.found.map(|(o, _)| o),
            Some(offset),
            "scan {round}: the receipt's message"
        );
    }
}

/// A topic whose `max.message.bytes` is smaller than an event: the broker refuses it
/// (MESSAGE_TOO_LARGE), the event is quarantined with the reason and its aggregate held; the
/// relay goes on publishing other aggregates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_broker_refuses_is_quarantined_and_other_aggregates_go_on() {
    let env = TestEnv::new("kafka_poison").await;
    let topic = route_to_small_topic(&env, 2048).await;
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    // In one transaction, so a poll round reads them together and the second one is queued
    // behind the refused one whatever the timing (as in ordering.rs and migration.rs).
    let ids = env
        .enqueue_together(&[
            ("poison", json!({"pad": "x".repeat(8 * 1024)})),
            ("poison", json!({"after": true})),
        ])
        .await;
    let (big, behind) = (ids[0], ids[1]);
    env.wait_count(
        "the quarantine record",
        "SELECT count(*) FROM outbox.quarantine",
        1,
    )
    .await;
    // Enqueued after the refusal: librdkafka would otherwise put it in the refused event's
    // record batch, and the broker refuses a batch as a whole (see the note in the module doc).
    let other = env.enqueue("healthy", json!({"ok": true})).await;
    env.wait_count(
        "the healthy receipt",
        "SELECT count(*) FROM outbox.receipts",
        1,
    )
    .await;
    let reason: String = env
        .db
        .query_one(
            "SELECT reason_code || ': ' || reason FROM outbox.quarantine WHERE event_id = $1",
            &[&big],
        )
        .await
        .unwrap()
        .get(0);
    assert!(reason.starts_with("broker_rejected"), "{reason}");
    assert!(reason.to_lowercase().contains("too large"), "{reason}");
    env.wait_count(
        "the event behind it held",
        &format!("SELECT count(*) FROM outbox.held_events WHERE event_id = '{behind}'"),
        1,
    )
    .await;
    let check = env.verify_receipts(&[&topic]).await;
    let ids: Vec<&str> = check.messages.iter().map(|m| m.id()).collect();
    assert_eq!(
        ids,
        vec![other.to_string().as_str()],
        "only the healthy aggregate's event"
    );
}

/// The broker refuses a record *batch* whose size exceeds the topic's `max.message.bytes`, and
/// librdkafka reports that refusal for every message of the batch: an event batched with a
/// too-large one would be quarantined with it. With the producer's `message.max.bytes` at the
/// smallest topic limit (what `outboxd check` asks for), librdkafka refuses the too-large event
/// alone, at the send, and never builds a batch the broker refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_message_max_bytes_at_the_topic_limit_a_too_large_event_never_takes_its_neighbours_down(
) {
    let env = TestEnv::new("kafka_poison_batch").await;
    let topic = route_to_small_topic(&env, 4096).await;
    // Committed before the relay starts: its initial snapshot sends them back to back.
    let mut ids = Vec::new();
    for (agg, pad) in [("h1", 10), ("poison", 8 * 1024), ("h2", 10), ("h3", 10)] {
        ids.push(env.enqueue(agg, json!({"pad": "x".repeat(pad)})).await);
    }
    let (ok, out) = crate::harness::outboxd(&[
        "check",
        "--database-url",
        &env.url,
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
    ]);
    assert!(
        out.contains("message.max.bytes=4096") && out.contains(&topic),
        "check names the topic whose limit is below the producer's batches ({ok}):\n{out}"
    );
    let _relay = env.relay(&[], &["--kafka-property", "message.max.bytes=4096"]);
    env.wait_count("3 receipts", "SELECT count(*) FROM outbox.receipts", 3)
        .await;
    env.wait_count("1 quarantined", "SELECT count(*) FROM outbox.quarantine", 1)
        .await;
    let quarantined: uuid::Uuid = env
        .db
        .query_one("SELECT event_id FROM outbox.quarantine", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        quarantined, ids[1],
        "only the too-large event is quarantined"
    );
    let check = env.verify_receipts(&[&topic]).await;
    assert_eq!(check.messages.len(), 3);
}
