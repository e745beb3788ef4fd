//! An UNKNOWN look-up the broker's ACLs refuse, on librdkafka's mock cluster: the test
//! harness's Apache Kafka runs without authentication, so no principal can be denied there,
//! and the mock answers a request with TOPIC_AUTHORIZATION_FAILED as a broker whose ACLs
//! deny the relay's principal READ/DESCRIBE on the topic does.
//!
//! What must hold: the scan fails at once (not after asking again for its whole timeout)
//! with an error that names the grant to make, not "cannot reach Kafka"; and the same scan
//! without the refusal reads the partition.

use std::time::{Duration, Instant};

use bytes::Bytes;
use outbox_core::{Destination, OutboxEvent};
use outbox_sink::{scan_for_event, DeliveryOutcome, KafkaSink, KafkaSinkConfig, SinkError};
use outbox_testkit::kafka::TestKafka;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_up_the_acls_refuse_names_the_grant_and_fails_at_once() {
    let kafka = TestKafka::mock(1).expect("mock cluster");
    let topic = "lookup_denied";
    kafka.create_topic(topic, 1).expect("topic");
    let config = KafkaSinkConfig {
        bootstrap_servers: kafka.bootstrap_servers().to_string(),
        ..KafkaSinkConfig::default()
    };
    // One message on the partition, so that a scan has a range to read.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let sink = KafkaSink::new(config.clone(), tx).expect("sink");
    let ev = OutboxEvent::frozen(
        uuid::Uuid::now_v7(),
        ("order", "o-1", 1),
        "order.created",
        Bytes::from_static(b"{}"),
        Destination::kafka("default", topic, "o-1"),
    );
    sink.send(&ev, 0).await.expect("send");
    let d = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("a delivery report within 30 s")
        .expect("channel open");
    assert!(
        matches!(d.outcome, DeliveryOutcome::Persisted { offset: 0, .. }),
        "{d:?}"
    );
    let id = ev.event_id.to_string();
    let scan = |config: KafkaSinkConfig, id: String| {
        tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            let r = scan_for_event(&config, topic, 0, 0, &id, Duration::from_secs(20));
            (r, t0.elapsed())
        })
    };

    // Without a refusal the scan reads the partition and finds the event.
    let (found, _) = scan(config.clone(), id.clone()).await.expect("scan");
    assert_eq!(found.expect("scan").found.map(|(o, _)| o), Some(0));

    // The broker now refuses the partition's offsets as its ACLs would, for longer than the
    // scan's timeout (a denial lasts until a grant).
    let mock = kafka.mock_cluster().expect("the mock cluster");
    mock.request_errors(
        RDKafkaApiKey::ListOffsets,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 500],
    );
    let (denied, took) = scan(config, id).await.expect("scan");
    let e = denied.expect_err("the refused scan must fail");
    assert!(
        matches!(e, SinkError::LookupDenied { partition: 0, .. }),
        "not named a refusal: {e}"
    );
    let message = e.to_string();
    assert!(
        message.contains("grant the relay's principal READ and DESCRIBE on topic lookup_denied"),
        "{message}"
    );
    assert!(
        took < Duration::from_secs(10),
        "a refusal must not be asked again for the scan's whole timeout: {took:?}"
    );
}
