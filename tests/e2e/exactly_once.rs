//! Exactly-once mode (`--delivery exactly-once`, docs/exactly_once.md) on a real Apache Kafka
//! node: each batch one Kafka transaction with its record in the positions topic. What is
//! checked is what a consumer reading with `isolation.level=read_committed` sees: every event
//! once, in version order per aggregate, through a crash between the broker's commit and the
//! ledger's acceptance and a SIGKILL mid-stream; and every receipt is at a committed copy of
//! its event.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;

use crate::harness::{TestEnv, LONG};

/// What a `read_committed` consumer of `topic` sees up to the last stable offset: (partition,
/// offset, event id, aggregate id, version), in partition order.
fn read_committed(bootstrap: &str, topic: &str) -> Vec<(i32, i64, String, String, i64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("committed-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .create()
        .expect("consumer");
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let partitions: Vec<i32> = md.topics()[0].partitions().iter().map(|p| p.id()).collect();
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition_offset(topic, *p, Offset::Beginning)
            .expect("tpl");
    }
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut at_end = std::collections::HashSet::new();
    let mut out = Vec::new();
    while at_end.len() < partitions.len() {
        assert!(
            Instant::now() < deadline,
            "topic {topic} not read to its end in 60 s"
        );
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                let header = |name: &str| {
                    m.headers()
                        .and_then(|h| h.iter().find(|x| x.key == name))
                        .and_then(|x| x.value)
                        .map(|v| String::from_utf8_lossy(v).to_string())
                        .unwrap_or_default()
                };
                out.push((
                    m.partition(),
                    m.offset(),
                    header("id"),
                    header("aggregate_id"),
                    header("aggregate_version").parse().unwrap_or(-1),
                ));
            }
        }
    }
    out
}

e2e_only! {
/// A relay aborted right after the broker committed its third batch (before the ledger
/// accepted it: failpoint `txn-after-commit`), then one SIGKILLed mid-stream, then one that
/// runs to the end: a `read_committed` consumer sees each of the 240 events once, every
/// aggregate's versions in order; the batch committed before the crash was accepted from
/// the broker's record, not sent again; every receipt is at a committed copy of its event.
/// Planted: `txn-ignores-records` and the other mutants of `TxnCore` make the simulator's
/// `txn_seen_twice` and `txn_lost` non-zero (crates/outbox-sim, world/txn.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_committed_consumer_sees_every_event_once_through_a_crash_between_commit_and_acceptance() {
    let env = TestEnv::new("exactly_once").await;
    // Not created here: the relay creates its positions topic when the brokers lack it.
    let positions = format!("{}.positions", env.topic);
    let args = [
        "--delivery",
        "exactly-once",
        "--positions-topic",
        positions.as_str(),
        // Transactions of at most 20 events (a transaction takes up to max_in_flight), so
        // that run 1 commits several before the failpoint's third.
        "--batch-size",
        "20",
        "--max-in-flight",
        "20",
    ];
    const EVENTS: usize = 240;
    let aggregates: Vec<String> = (0..12).map(|a| format!("x-{a}")).collect();
    let mut written = 0;
    let mut write = |n: usize| {
        let from = written;
        written += n;
        (from..from + n).map(|i| aggregates[i % aggregates.len()].clone()).collect::<Vec<_>>()
    };

    // Run 1: aborts at its third commit, after the broker committed it.
    let mut first = env.relay(&[("OUTBOXD_FAILPOINTS", "txn-after-commit=abort@3")], &args);
    env.wait_streaming().await;
    for agg in write(120) {
        env.enqueue(&agg, json!({"n": 1})).await;
    }
    let status = first.wait_exit(LONG).await;
    assert!(!status.success(), "the failpoint did not abort run 1: {status:?}");
    let log = first.log_text();
    assert!(log.contains("failpoint txn-after-commit reached"), "{log}");

    // Run 2: accepts the committed batch from its record, then is SIGKILLed mid-stream.
    let mut second = env.relay(&[], &args);
    env.wait_streaming().await;
    for agg in write(60) {
        env.enqueue(&agg, json!({"n": 2})).await;
    }
    env.wait_receipts("run 2 accepted some", 70).await;
    second.kill9();
    let log = second.log_text();
    assert!(
        log.contains("accepting batches the broker committed before the last run's acceptance"),
        "run 2 did not accept the batch run 1 committed: {log}"
    );

    // Run 3: to the end.
    let third = env.relay(&[], &args);
    env.wait_streaming().await;
    for agg in write(EVENTS - 180) {
        env.enqueue(&agg, json!({"n": 3})).await;
    }
    env.wait_receipts("every event accepted", EVENTS).await;
    drop(third);

    let seen = read_committed(env.kafka.bootstrap_servers(), &env.topic);
    let mut copies: HashMap<&str, usize> = HashMap::new();
    for (_, _, id, _, _) in &seen {
        *copies.entry(id.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = copies.iter().filter(|(_, n)| **n > 1).collect();
    assert_eq!(copies.len(), EVENTS, "events a committed reader sees");
    assert!(twice.is_empty(), "seen more than once by a committed reader: {twice:?}");
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut out_of_order = 0;
    for (_, _, _, agg, version) in &seen {
        if last.get(agg.as_str()).is_some_and(|l| *l >= *version) {
            out_of_order += 1;
        }
        last.insert(agg.as_str(), *version);
    }
    assert_eq!(out_of_order, 0, "versions out of order for a committed reader: {seen:?}");
    // Every receipt at a committed copy of its event.
    let committed: HashMap<(i32, i64), &str> =
        seen.iter().map(|(p, o, id, _, _)| ((*p, *o), id.as_str())).collect();
    let receipts = env
        .db
        .query(
            "SELECT event_id::text, partition, \"offset\" FROM outbox.receipts",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(receipts.len(), EVENTS);
    let misplaced: Vec<String> = receipts
        .iter()
        .filter(|r| committed.get(&(r.get::<_, i32>(1), r.get::<_, i64>(2))) != Some(&r.get::<_, &str>(0)))
        .map(|r| r.get::<_, String>(0))
        .collect();
    assert!(misplaced.is_empty(), "receipts not at a committed copy: {misplaced:?}");
    // (The suite's `verify_receipts` reads without isolation and asserts contiguous offsets,
    // which a transactional topic does not have: its commit markers take offsets too.)
}
}

e2e_only! {
/// `outboxd check --delivery exactly-once`: a transaction runs under the check id, and a
/// missing positions topic is named (the relay creates it at start); once it exists, it is ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_runs_a_transaction_and_names_a_missing_positions_topic() {
    let env = TestEnv::new("exactly_once_check").await;
    let positions = format!("{}.positions", env.topic);
    let check = || {
        crate::harness::outboxd(&[
            "check",
            "--database-url",
            &env.url,
            "--bootstrap-servers",
            env.kafka.bootstrap_servers(),
            "--slot",
            &env.slot,
            "--delivery",
            "exactly-once",
            "--config",
            &env.write_config(format!("[kafka]\npositions_topic = \"{positions}\"\n")),
        ])
    };
    let (ok, out) = check();
    assert!(ok, "{out}");
    assert!(out.contains("ok    kafka transactions"), "{out}");
    assert!(
        out.contains("WARN  positions topic") && out.contains("the relay creates it at start"),
        "{out}"
    );
    env.kafka.create_topic(&positions, 1).expect("positions topic");
    let (ok, out) = check();
    assert!(ok && out.contains("ok    positions topic"), "{out}");
}
}
