//! Exactly-once mode (`--delivery exactly-once`, docs/exactly_once.md) on real Apache Kafka:
//! each batch one Kafka transaction with its record in the positions topic. What is checked is
//! what a consumer reading with `isolation.level=read_committed` sees (`Counts`): every
//! committed event once and nothing else, in version order per aggregate, and every receipt
//! at a committed copy of its event. On the suite's node: through a crash between the
//! broker's commit and the ledger's acceptance and a SIGKILL mid-stream. On three nodes of
//! its own (issue 30's chaos test): through relay SIGKILLs, a partition leader's SIGKILL, a
//! broker SIGSTOPped inside a transaction and the relay SIGSTOPped inside one past its lease.

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
fn read_committed(bootstrap: &str, topic: &str) -> Vec<Seen> {
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

/// One message as a `read_committed` consumer sees it: (partition, offset, event id, aggregate
/// id, version).
type Seen = (i32, i64, String, String, i64);

/// A receipt of the ledger: (event id, topic, partition, offset).
type Receipt = (String, String, i32, i64);

async fn receipts_of(env: &TestEnv) -> Vec<Receipt> {
    env.db
        .query(
            "SELECT event_id::text, topic, partition, \"offset\" FROM outbox.receipts",
            &[],
        )
        .await
        .expect("read the receipts")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

/// What a `read_committed` consumer of the test's topic saw, judged against the `events`
/// committed outbox rows and the ledger's receipts ([`Counts`]): every count must be zero.
async fn judge_committed(env: &TestEnv, events: usize) {
    let seen = read_committed(env.kafka.bootstrap_servers(), &env.topic);
    let receipts = receipts_of(env).await;
    let committed: Vec<String> = env
        .db
        .query("SELECT event_id::text FROM outbox.events", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(committed.len(), events);
    let counts = Counts::judge(&committed, &env.topic, &seen, &receipts);
    println!("{counts:?}");
    counts.assert_zero(&seen);
}

/// What exactly once means to a committed reader, as counts that must be zero.
#[derive(Debug, Default, PartialEq)]
struct Counts {
    /// Committed events a committed reader does not see, or that have no receipt.
    lost: usize,
    /// Events a committed reader sees more than once.
    seen_twice: usize,
    /// Messages a committed reader sees that no committed row is (a rolled-back transaction's
    /// event, or an aborted broker transaction's copy made visible).
    not_committed: usize,
    /// Messages of an aggregate at or below a version the reader saw before.
    out_of_order: usize,
    /// Receipts whose topic, partition and offset do not hold a committed copy of their event.
    misplaced_receipts: usize,
}

impl Counts {
    /// `committed`: the event ids of the committed outbox rows; `topic`: the topic `seen` was
    /// read from (in each partition's offset order).
    fn judge(committed: &[String], topic: &str, seen: &[Seen], receipts: &[Receipt]) -> Counts {
        let committed: std::collections::HashSet<&str> =
            committed.iter().map(String::as_str).collect();
        let mut copies: HashMap<&str, usize> = HashMap::new();
        for (_, _, id, _, _) in seen {
            *copies.entry(id.as_str()).or_default() += 1;
        }
        let receipted: std::collections::HashSet<&str> =
            receipts.iter().map(|r| r.0.as_str()).collect();
        let mut last: HashMap<&str, i64> = HashMap::new();
        let mut out_of_order = 0;
        for (_, _, _, agg, version) in seen {
            if last.get(agg.as_str()).is_some_and(|l| *l >= *version) {
                out_of_order += 1;
            }
            last.insert(agg.as_str(), *version);
        }
        let at: HashMap<(i32, i64), &str> = seen
            .iter()
            .map(|(p, o, id, _, _)| ((*p, *o), id.as_str()))
            .collect();
        Counts {
            lost: committed
                .iter()
                .filter(|id| !copies.contains_key(*id) || !receipted.contains(*id))
                .count(),
            seen_twice: copies.values().filter(|n| **n > 1).count(),
            not_committed: copies.keys().filter(|id| !committed.contains(*id)).count(),
            out_of_order,
            misplaced_receipts: receipts
                .iter()
                .filter(|(id, t, p, o)| t != topic || at.get(&(*p, *o)) != Some(&id.as_str()))
                .count(),
        }
    }

    fn assert_zero(&self, seen: &[Seen]) {
        assert_eq!(
            self,
            &Counts::default(),
            "what a read_committed consumer saw breaks exactly once; it saw ({} messages): {seen:?}",
            seen.len()
        );
    }
}

/// Each count becomes non-zero when its bug is planted in what a reader saw.
#[test]
fn each_exactly_once_count_sees_its_planted_bug() {
    let m =
        |p: i32, o: i64, id: &str, agg: &str, v: i64| -> Seen { (p, o, id.into(), agg.into(), v) };
    let r = |id: &str, p: i32, o: i64| -> Receipt { (id.into(), "t".into(), p, o) };
    let committed: Vec<String> = vec!["e1".into(), "e2".into(), "e3".into()];
    let seen = vec![
        m(0, 0, "e1", "a", 1),
        m(0, 1, "e2", "a", 2),
        m(1, 0, "e3", "b", 1),
    ];
    let receipts = vec![r("e1", 0, 0), r("e2", 0, 1), r("e3", 1, 0)];
    assert_eq!(
        Counts::judge(&committed, "t", &seen, &receipts),
        Counts::default()
    );
    let planted =
        |seen: &[Seen], receipts: &[Receipt]| Counts::judge(&committed, "t", seen, receipts);
    // An event lost on the broker; one accepted without a receipt.
    assert_eq!(planted(&seen[..2], &receipts[..2]).lost, 1);
    assert_eq!(planted(&seen, &receipts[1..]).lost, 1);
    // An aborted transaction's copy visible again (a second copy of e2).
    let mut twice = seen.clone();
    twice.push(m(0, 2, "e2", "a", 2));
    let c = planted(&twice, &receipts);
    assert_eq!((c.seen_twice, c.out_of_order), (1, 1));
    // A rolled-back row's event published.
    let mut rolled = seen.clone();
    rolled.push(m(1, 1, "e9", "b", 2));
    assert_eq!(planted(&rolled, &receipts).not_committed, 1);
    // Version 2 before version 1.
    let swapped = vec![
        m(0, 0, "e2", "a", 2),
        m(0, 1, "e1", "a", 1),
        m(1, 0, "e3", "b", 1),
    ];
    assert_eq!(planted(&swapped, &receipts).out_of_order, 1);
    // A receipt at an aborted copy's offset (not visible), or in another topic.
    assert_eq!(
        planted(&seen, &[r("e1", 0, 5), r("e2", 0, 1), r("e3", 1, 0)]).misplaced_receipts,
        1
    );
    let mut other = receipts.clone();
    other[2].1 = "u".into();
    assert_eq!(planted(&seen, &other).misplaced_receipts, 1);
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

    judge_committed(&env, EVENTS).await;
    // (The suite's `verify_receipts` reads without isolation and asserts contiguous offsets,
    // which a transactional topic does not have: its commit markers take offsets too.)
}
}

e2e_only! {
/// A graceful stop (SIGTERM) in exactly-once mode puts what the relay read into a last
/// transaction, commits it, accepts it and confirms it before it gives the lease back. The
/// relay here reads every event but begins no transaction before the stop (a batch linger of
/// ten minutes), so the stop's transaction is the only one: every event has its receipt
/// after the exit, once, at its committed copy. Before 2026-12-07 the stop never read the
/// sends' delivery reports, so its transaction never committed: the relay waited out its 10
/// s and exited with the transaction open (read_committed consumers of its partitions
/// blocked until the next holder aborted it), and no event had a receipt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_commits_and_accepts_a_transaction_of_what_the_relay_read() {
    let env = TestEnv::new("exactly_once_stop").await;
    let positions = format!("{}.positions", env.topic);
    let args = [
        "--delivery",
        "exactly-once",
        "--positions-topic",
        positions.as_str(),
        "--batch-size",
        "1000",
        "--batch-linger-ms",
        "600000",
        "--status-interval-ms",
        "100",
    ];
    let mut relay = env.relay(&[], &args);
    env.wait_streaming().await;
    const EVENTS: usize = 30;
    for i in 0..EVENTS {
        env.enqueue(&format!("s-{}", i % 5), json!({"i": i})).await;
    }
    let end: String = env
        .db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    // Read: the relay's standby status says it received the stream past the last event.
    let read_past = format!(
        "SELECT count(*) FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
         WHERE s.slot_name = '{}' AND r.write_lsn >= '{end}'::pg_lsn",
        env.slot
    );
    env.wait_count("the relay to have read every event", &read_past, 1)
        .await;
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.receipts").await,
        0,
        "a transaction began before the stop: the test's linger did not hold"
    );
    relay.signal(libc::SIGTERM);
    let status = relay.wait_exit(Duration::from_secs(60)).await;
    let log = relay.log_text();
    assert!(status.success(), "a graceful stop exits 0: {log}");
    assert!(
        !log.contains("stopping with a transaction open"),
        "the stop left its transaction open: {log}"
    );
    // Every committed event seen once and with its receipt (`lost` counts one without).
    judge_committed(&env, EVENTS).await;
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
    // The suite's node: its transaction state log's replication factor and min.isr are 1.
    assert!(
        out.contains("ok    transaction state log") && out.contains("1 broker(s) up"),
        "{out}"
    );
    assert!(
        out.contains("WARN  positions topic") && out.contains("the relay creates it at start"),
        "{out}"
    );
    env.kafka.create_topic(&positions, 1).expect("positions topic");
    let (ok, out) = check();
    assert!(ok && out.contains("ok    positions topic"), "{out}");
}
}

/// The relay's log lines that end a transaction, one per transaction (its commit answered,
/// or its abort begun; a settle follows one of them).
const TXN_ENDS: [&str; 2] = ["commit answered", "aborting it"];

e2e_only! {
/// Issue 30's proof on three Apache Kafka nodes (replication factor 3, min.insync.replicas 2,
/// the transaction state log replicated alike): writers commit (and roll back) events on 24
/// aggregates the whole time, while the relay is SIGKILLed twice, a partition's leader is
/// SIGKILLed, a broker is SIGSTOPped past the message timeout while transactions are open,
/// and the relay is SIGSTOPped inside a transaction past its lease (a standby takes the slot
/// and opens the transactional id, which fences the paused producer) and resumed. A
/// `read_committed` consumer then sees every committed event exactly once and nothing else,
/// each aggregate's versions in order, and every receipt is at a committed copy of its event
/// (`Counts`, whose planted bugs are in `each_exactly_once_count_sees_its_planted_bug`). Each
/// fault is shown to have met traffic: receipts grew while it held, and the relay's log names
/// what it did (an aborted or settled transaction, a fenced run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_on_three_kafka_nodes_through_relay_and_broker_faults() {
    use outbox_testkit::apache_kafka::KafkaCluster;
    use outbox_testkit::kafka::TestKafka;
    use outbox_testkit::postgres::TestPostgres;
    use outbox_testkit::wait::wait_for;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    const NODES: i32 = 3;
    const PARTITIONS: i32 = 6;
    let started = Instant::now();
    let cluster =
        KafkaCluster::start(NODES as usize).unwrap_or_else(|e| panic!("starting 3 Apache Kafka nodes: {e}"));
    let mut log = vec![format!("{:.1} s: 3 nodes up", started.elapsed().as_secs_f64())];
    let env = TestEnv::with_kafka(
        TestPostgres::shared(),
        "eos_chaos",
        TestKafka::external(cluster.bootstrap_servers()),
    )
    .await;
    let topic = format!("{}.eos", env.topic);
    let positions = format!("{}.positions", env.topic);
    let isr = [("min.insync.replicas", "2")];
    cluster
        .create_topic(&topic, PARTITIONS, NODES, &isr)
        .unwrap_or_else(|e| panic!("creating {topic}: {e}"));
    cluster
        .create_topic(&positions, 1, NODES, &isr)
        .unwrap_or_else(|e| panic!("creating {positions}: {e}"));
    env.route_to(&topic).await;
    // A message timeout shorter than the broker's pause below, so a stalled send fails and its
    // transaction is aborted; a lease the pause of the relay outlasts.
    let args = |id: &'static str| -> Vec<String> {
        [
            "--relay-id", id,
            "--delivery", "exactly-once",
            "--positions-topic", &positions,
            "--message-timeout-ms", "2000",
            "--lease-ttl-ms", "4000",
            "--batch-size", "200",
            "--max-in-flight", "200",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let start = |id: &'static str| {
        let a = args(id);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        env.relay(&[], &a)
    };

    // The writer: transactions of 1-3 events on 24 aggregates, one in ten rolled back, until
    // told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (url, agg, stop) = (env.url.clone(), env.aggregate_type.clone(), stop.clone());
        tokio::spawn(async move {
            let mut c = crate::harness::connect(&url).await;
            let (mut committed, mut rolled_back) = (Vec::<String>::new(), Vec::<String>::new());
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let tx = c.transaction().await.expect("begin");
                let mut ids = Vec::new();
                for _ in 0..(1 + i % 3) {
                    i += 1;
                    let row = tx
                        .query_one(
                            "SELECT outbox.enqueue($1, $2, 'eos.tick', $3)::text",
                            &[&agg, &format!("a{}", (i * 7) % 24), &json!({ "i": i })],
                        )
                        .await
                        .expect("enqueue");
                    ids.push(row.get::<_, String>(0));
                }
                if i % 10 == 0 {
                    tx.rollback().await.expect("rollback");
                    rolled_back.extend(ids);
                } else {
                    tx.commit().await.expect("commit");
                    committed.extend(ids);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (committed, rolled_back)
        })
    };
    let receipts = || env.count("SELECT count(*) FROM outbox.receipts");
    // Waits until `n` more events have receipts than `from` (traffic flows; a fault met it).
    let more_receipts = |what: &'static str, from: i64, n: i64| {
        let env = &env;
        async move {
            wait_for(what, LONG, || async {
                let now = env.count("SELECT count(*) FROM outbox.receipts").await;
                if now >= from + n {
                    Ok(now)
                } else {
                    Err(format!("{now} receipts, waiting for {}", from + n))
                }
            })
            .await
        }
    };

    let mut relay = start("relay-a");
    env.wait_streaming().await;
    more_receipts("the first receipts", 0, 50).await;

    // 1. The relay SIGKILLed twice, mid-stream.
    for k in 1..=2 {
        let before = receipts().await;
        relay.kill9();
        relay = start("relay-a");
        more_receipts("receipts after the relay's SIGKILL", before, 60).await;
        log.push(format!("{:.1} s: relay SIGKILL {k} at {before} receipts", started.elapsed().as_secs_f64()));
    }

    // 2. A partition's leader SIGKILLed (every replica in sync first: only one in sync can be
    // elected), traffic through the new leader, the old one restarted.
    let p = 1;
    wait_for("every replica of the partition in sync", LONG, || async {
        let isr = cluster.isr_of(&topic, p);
        if isr.len() == NODES as usize { Ok(()) } else { Err(format!("in sync: {isr:?}")) }
    })
    .await;
    let old = cluster.leader_of(&topic, p).expect("a leader");
    let before = receipts().await;
    cluster.kill(old);
    let new = wait_for("a new leader", LONG, || async {
        match cluster.leader_of(&topic, p) {
            Some(l) if l != old => Ok(l),
            other => Err(format!("leader {other:?}")),
        }
    })
    .await;
    more_receipts("receipts while the old leader is down", before, 60).await;
    cluster.restart(old).expect("restart the old leader");
    log.push(format!("{:.1} s: partition {p} leader {old} SIGKILL -> {new} at {before} receipts; restarted", started.elapsed().as_secs_f64()));

    // 3. A broker SIGSTOPped past the message timeout while the writer keeps committing. The
    // pause met the relay when a transaction was aborted meanwhile, or when none ended while
    // the broker was stopped although events were waiting for one (the relay's log has a line
    // for each transaction's end; it ends one every few hundred ms otherwise): the stalled
    // transaction then commits late, is aborted and sent again, or is settled from the
    // broker's records. A try whose broker the relay did not need then (transactions ended
    // meanwhile) is made again on the next broker.
    let ended = |text: &str| TXN_ENDS.iter().map(|w| text.matches(w).count()).sum::<usize>();
    let waiting = || {
        env.count(
            "SELECT count(*) FROM outbox.events e
             WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)",
        )
    };
    let mut tries = Vec::new();
    let (b, before, from) = loop {
        let b = (cluster.leader_of(&topic, 2).expect("a leader") - 1 + tries.len() as i32)
            % NODES
            + 1;
        let before = receipts().await;
        let from = relay.log_text().len();
        cluster.pause(b);
        tokio::time::sleep(Duration::from_millis(4_000)).await;
        let during = relay.log_text()[from..].to_string();
        let waited = waiting().await;
        cluster.resume(b);
        if during.contains("aborting it") || (ended(&during) == 0 && waited > 0) {
            break (b, before, from);
        }
        tries.push(format!(
            "broker {b}: {} transaction(s) ended while it was stopped, {waited} events waiting",
            ended(&during)
        ));
        assert!(
            tries.len() < 4,
            "no broker's SIGSTOP stalled the relay: {tries:?}"
        );
    };
    more_receipts("receipts after the broker's SIGCONT", before, 60).await;
    // What the relay did about it: its warnings (without their span), else a late commit.
    let after = relay.log_text()[from..].to_string();
    let mut met: Vec<&str> = after
        .lines()
        .filter(|l| l.contains(" WARN "))
        .map(|l| l.rsplit_once(": ").map_or(l, |(_, m)| m))
        .collect();
    if met.is_empty() {
        met.push("committed late");
    }
    log.push(format!(
        "{:.1} s: broker {b} SIGSTOP 4 s, the relay stalled, at {before} receipts{}; the relay: {}",
        started.elapsed().as_secs_f64(),
        if tries.is_empty() {
            String::new()
        } else {
            format!(" (after {tries:?})")
        },
        met.join(" | ")
    ));

    // 4. The relay SIGSTOPped inside a transaction (its log has begun one it has not ended)
    // past its lease; a standby takes the slot and the transactional id; the paused relay,
    // resumed, is fenced on the broker and in the ledger, and goes back to standby.
    let standby = start("relay-b");
    crate::ha::wait_log(&standby, "standby").await;
    let open_transaction = |text: &str| text.matches("transaction begins").count() > ended(text);
    let mut tries = 0;
    loop {
        relay.signal(libc::SIGSTOP);
        // The log is written as it goes: what it says now is what the relay was doing.
        if open_transaction(&relay.log_text()) {
            break;
        }
        relay.signal(libc::SIGCONT);
        tries += 1;
        assert!(tries < 1_000, "the relay was never caught inside a transaction in {tries} tries");
        tokio::time::sleep(Duration::from_millis(7)).await;
    }
    let before = receipts().await;
    let gb = crate::ha::wait_owner(&env, "relay-b").await;
    more_receipts("the standby's receipts", before, 60).await;
    relay.signal(libc::SIGCONT);
    wait_for("the resumed relay to stand by", LONG, || async {
        let text = relay.log_text();
        let tail = &text[text.rfind("transaction begins").unwrap_or(0)..];
        if tail.contains("standby") { Ok(()) } else { Err("not back in standby yet".to_string()) }
    })
    .await;
    log.push(format!(
        "{:.1} s: relay SIGSTOP inside a transaction ({tries} tries) at {before} receipts; relay-b took generation {gb}; relay-a resumed and stood by",
        started.elapsed().as_secs_f64()
    ));

    // The end: the writer stops, every committed event is accepted.
    stop.store(true, Ordering::Relaxed);
    let (committed, rolled_back) = writer.await.expect("writer");
    env.wait_receipts("every committed event accepted", committed.len()).await;
    relay.assert_running();
    let mut standby = standby;
    standby.assert_running();

    let seen = read_committed(cluster.bootstrap_servers().as_str(), &topic);
    let counts = Counts::judge(&committed, &topic, &seen, &receipts_of(&env).await);
    println!(
        "exactly-once chaos: {} committed, {} rolled back, {} messages seen, {:.1} s; faults:\n  {}\n{counts:?}",
        committed.len(),
        rolled_back.len(),
        seen.len(),
        started.elapsed().as_secs_f64(),
        log.join("\n  ")
    );
    counts.assert_zero(&seen);
    assert!(!rolled_back.is_empty());
    let generations = env
        .count(&format!(
            "SELECT coalesce(max(generation), 0) FROM outbox.relay_leases WHERE slot_name = '{}'",
            env.slot
        ))
        .await;
    assert!(generations >= 4, "2 SIGKILLs and a takeover, but lease generation {generations}");
}
}
