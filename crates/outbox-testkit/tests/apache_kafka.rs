//! Real Apache Kafka brokers from the harness: a single node (produce, consume) and a 3-node
//! cluster surviving a SIGKILLed partition leader. Needs a JDK 17+ and Maven (or a warm jar
//! cache); a missing tool fails the test with the install hint.

use std::time::{Duration, Instant};

use outbox_testkit::apache_kafka::{self, KafkaCluster};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

fn producer(bootstrap: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", "30000")
        .create()
        .expect("producer")
}

/// Polls `check` until it returns `Some`, panicking with `what` and the last observation.
fn poll<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => {
                panic!("timed out after {timeout:?} waiting for {what}; last: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_produce_and_consume() {
    let t0 = Instant::now();
    let kafka = apache_kafka::shared().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("shared node up after {:?}", t0.elapsed());
    assert_eq!(kafka.node_ids(), vec![1]);
    let topic = "testkit-single";
    kafka.create_topic(topic, 1, 1, &[]).unwrap();
    assert_eq!(kafka.leader_of(topic, 0), Some(1));

    let p = producer(&kafka.bootstrap_servers());
    for i in 0..3 {
        let payload = format!("message-{i}");
        let d = p
            .send(
                FutureRecord::to(topic).key("k").payload(&payload),
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("produce {i}: {e}"));
        assert_eq!((d.partition, d.offset), (0, i));
    }

    // A consumer group: also proves __consumer_offsets works on one node.
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap_servers())
        .set("group.id", "testkit-single")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    c.subscribe(&[topic]).unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        let m = tokio::time::timeout(Duration::from_secs(30), c.recv())
            .await
            .expect("a message within 30 s")
            .expect("consume");
        got.push((
            m.offset(),
            String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned(),
        ));
    }
    assert_eq!(
        got,
        vec![
            (0, "message-0".to_string()),
            (1, "message-1".to_string()),
            (2, "message-2".to_string()),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_survive_a_killed_leader() {
    let t0 = Instant::now();
    let kafka = tokio::task::spawn_blocking(|| KafkaCluster::start(3))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(kafka.node_ids(), vec![1, 2, 3]);
    eprintln!("3 nodes up after {:?}", t0.elapsed());
    let topic = "testkit-failover";
    kafka
        .create_topic(topic, 1, 3, &[("min.insync.replicas", "2")])
        .unwrap();
    let leader = kafka.leader_of(topic, 0).expect("a leader");
    let pids: Vec<u32> = kafka
        .node_ids()
        .iter()
        .filter_map(|&id| kafka.pid(id))
        .collect();
    assert_eq!(pids.len(), 3);

    let p = producer(&kafka.bootstrap_servers());
    p.send(
        FutureRecord::to(topic).key("k").payload("before"),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|(e, _)| panic!("produce before the kill: {e}"));

    kafka.kill(leader);
    let killed = Instant::now();
    assert_eq!(kafka.pid(leader), None);
    let new_leader = poll(
        "a new leader after SIGKILL",
        Duration::from_secs(30),
        || match kafka.leader_of(topic, 0) {
            Some(l) if l != leader => Ok(l),
            other => Err(format!("leader {other:?}")),
        },
    );
    assert_ne!(new_leader, leader);
    eprintln!(
        "leader {leader} killed; node {new_leader} leads after {:?}",
        killed.elapsed()
    );

    // acks=all with min.insync.replicas=2: the two survivors are enough.
    let d = p
        .send(
            FutureRecord::to(topic).key("k").payload("after"),
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|(e, _)| panic!("produce after the kill: {e}"));
    assert_eq!(d.offset, 1);

    let restarting = Instant::now();
    kafka.restart(leader).unwrap();
    eprintln!("node {leader} back after {:?}", restarting.elapsed());
    assert!(kafka.pid(leader).is_some());
    // Back in the ISR: it caught up from the new leader.
    poll(
        "the restarted node in the ISR",
        Duration::from_secs(30),
        || {
            let isr = kafka.isr_of(topic, 0);
            if isr.contains(&leader) {
                Ok(())
            } else {
                Err(format!("isr {isr:?}"))
            }
        },
    );
}

/// docker-compose.yml runs the Kafka version these tests run.
#[test]
fn docker_compose_runs_the_kafka_version_the_tests_run() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docker-compose.yml");
    let compose = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let want = format!("image: apache/kafka:{}", apache_kafka::KAFKA_VERSION);
    assert!(
        compose.contains(&want),
        "{path} must use `{want}` (the version of outbox_testkit::apache_kafka)"
    );
}
