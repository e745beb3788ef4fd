//! librdkafka's implicit ack, reproduced through the Kafka sink on librdkafka's mock cluster
//! (the mock is the only way to inject one NOT_LEADER_FOR_PARTITION on one Produce request at
//! an exact round trip; a real broker cannot be made to fail exactly the first batch).
//!
//! An idempotent producer sends A, whose Produce request fails with a retriable error while B
//! (same partition) is already in flight; B succeeds, and librdkafka then reports A as
//! *delivered* at offset -1001 (`rd_kafka_dr_implicit_ack`) although the partition never
//! stored it. The sink must not turn that report into `Persisted`: it is DISPATCH_UNKNOWN.

use std::time::Duration;

use bytes::Bytes;
use outbox_core::{Destination, OutboxEvent};
use outbox_sink::{
    scan_for_event, Delivery, DeliveryOutcome, KafkaSink, KafkaSinkConfig, Persistence,
};
use outbox_testkit::kafka::TestKafka;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn event(topic: &str, aggregate_id: &str) -> OutboxEvent {
    let destination = Destination::kafka("default", topic, "same-key");
    OutboxEvent::frozen(
        uuid::Uuid::now_v7(),
        ("order", aggregate_id, 1),
        "order.created",
        Bytes::from(format!("{{\"a\": \"{aggregate_id}\"}}")),
        destination,
    )
}

async fn next(rx: &mut UnboundedReceiver<Delivery>) -> Delivery {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("a delivery report within 30 s")
        .expect("channel open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_implicitly_acked_message_is_not_reported_persisted() {
    let kafka = TestKafka::mock(1).expect("mock cluster");
    let topic = "implicit_ack";
    kafka.create_topic(topic, 1).expect("topic");
    let config = KafkaSinkConfig {
        bootstrap_servers: kafka.bootstrap_servers().to_string(),
        linger: Duration::from_millis(2),
        message_timeout: Duration::from_secs(20),
        ..KafkaSinkConfig::default()
    };
    let (tx, mut rx) = unbounded_channel();
    let sink = KafkaSink::new(config.clone(), tx).expect("sink");

    // Warm-up: the producer has its id and the partition's leader.
    let warm = event(topic, "warm");
    sink.send(&warm, 0).await.expect("send warm-up");
    let d = next(&mut rx).await;
    assert!(
        matches!(d.outcome, DeliveryOutcome::Persisted { offset: 0, .. }),
        "warm-up: {d:?}"
    );

    // A's request fails once (retriable) and comes back late; B is sent meanwhile and succeeds.
    let mock = kafka.mock_cluster().expect("mock");
    mock.broker_round_trip_time(1, Duration::from_millis(100))
        .expect("rtt");
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION],
    );
    let a = event(topic, "a");
    let b = event(topic, "b");
    sink.send(&a, 1).await.expect("send A");
    tokio::time::sleep(Duration::from_millis(20)).await; // B goes out in its own batch
    sink.send(&b, 2).await.expect("send B");
    let mut reports = [next(&mut rx).await, next(&mut rx).await];
    reports.sort_by_key(|d| d.token);
    mock.broker_round_trip_time(1, Duration::ZERO).expect("rtt");

    // What the partition holds, read from the broker: the only evidence.
    let on_broker = |id: String| {
        let config = config.clone();
        let topic = topic.to_string();
        async move {
            tokio::task::spawn_blocking(move || {
                scan_for_event(&config, &topic, 0, 0, &id, Duration::from_secs(10))
            })
            .await
            .expect("join")
            .expect("scan")
            .found
            .map(|(offset, _)| offset)
        }
    };
    let a_stored = on_broker(a.event_id.to_string()).await;
    let b_stored = on_broker(b.event_id.to_string()).await;

    // Every report that says Persisted must point at the stored copy of its event.
    for (d, stored, name) in [(&reports[0], a_stored, "A"), (&reports[1], b_stored, "B")] {
        if let DeliveryOutcome::Persisted { offset, .. } = d.outcome {
            assert_eq!(
                Some(offset),
                stored,
                "{name} reported Persisted at offset {offset} but the partition holds it at {stored:?}: a receipt for a message the broker does not have ({d:?})"
            );
        }
    }
    // The scenario really happened: A was never stored, B was, and A's report is UNKNOWN.
    assert_eq!(
        a_stored, None,
        "A should have been lost by the injected error"
    );
    assert_eq!(b_stored, Some(1), "B is stored after the warm-up");
    assert!(
        matches!(
            reports[0].outcome,
            DeliveryOutcome::Failed {
                persistence: Persistence::PossiblyPersisted,
                partition: 0,
                ..
            }
        ),
        "A's report must be possibly persisted on partition 0 (DISPATCH_UNKNOWN): {:?}",
        reports[0]
    );
}
