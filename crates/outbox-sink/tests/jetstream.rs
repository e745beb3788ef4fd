//! The JetStream sink against a real `nats-server -js` (one per test, from the testkit):
//! PubAcks become delivery reports, a repeated `Nats-Msg-Id` is answered as a duplicate with
//! the original sequence, and `lookup` resolves UNKNOWN attempts by probe or by subject scan.

use std::time::Duration;

use bytes::Bytes;
use outbox_core::{Destination, OutboxEvent};
use outbox_sink::{
    Delivery, DeliveryOutcome, FailureClass, JetStreamSink, JetStreamSinkConfig, Lookup,
    Persistence, Sink, SinkError, UnknownLookup,
};
use outbox_testkit::nats::TestNats;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn event(subject: &str, aggregate_id: &str, version: i64) -> OutboxEvent {
    let destination = Destination {
        kind: "nats".into(),
        cluster: "sink_test".into(),
        topic: subject.into(),
        key: aggregate_id.into(),
        partitioner: "none".into(),
        route_generation: 1,
        serializer: "json".into(),
        acks: "all".into(),
    };
    let payload = Bytes::from(format!("{{\"v\": {version}}}"));
    OutboxEvent {
        headers: Some(r#"{"trace": "t-1"}"#.into()),
        ..OutboxEvent::frozen(
            uuid::Uuid::now_v7(),
            ("order", aggregate_id, version),
            "order.created",
            payload,
            destination,
        )
    }
}

async fn sink(nats: &TestNats, window: Duration) -> (JetStreamSink, UnboundedReceiver<Delivery>) {
    let (tx, rx) = unbounded_channel();
    let cfg = JetStreamSinkConfig {
        url: nats.url(),
        auth: Default::default(),
        cluster_name: nats.name().to_string(),
        stream: "S".into(),
        create_stream: true,
        stream_subjects: vec!["outbox.>".into()],
        duplicate_window: window,
        ack_timeout: Duration::from_secs(5),
        max_in_flight: 100,
    };
    (JetStreamSink::connect(cfg, tx).await.expect("connect"), rx)
}

async fn report(rx: &mut UnboundedReceiver<Delivery>) -> DeliveryOutcome {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("a delivery report")
        .expect("channel open")
        .outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_msg_id_is_a_duplicate_with_the_original_sequence() {
    let nats = TestNats::start("sink_test").unwrap();
    let (s, mut rx) = sink(&nats, Duration::from_secs(120)).await;
    let ev = event("outbox.order.o-1", "o-1", 1);
    s.send(&ev, 1).await.unwrap();
    let DeliveryOutcome::Persisted {
        topic,
        partition,
        offset,
        duplicate,
        ..
    } = report(&mut rx).await
    else {
        panic!("not persisted");
    };
    assert_eq!(
        (topic.as_str(), partition, duplicate),
        ("outbox.order.o-1", 0, false)
    );
    s.send(&ev, 2).await.unwrap();
    assert!(matches!(
        report(&mut rx).await,
        DeliveryOutcome::Persisted { offset: o, duplicate: true, .. } if o == offset
    ));
    // UNKNOWN inside the window: the probe finds the original.
    let q = UnknownLookup {
        event: &ev,
        topic: "outbox.order.o-1",
        partition: 0,
        from: 0,
        sent_ago: Duration::from_secs(1),
    };
    assert!(matches!(s.lookup(q).await.unwrap(), Lookup::Found { offset: o, .. } if o == offset));
    // Outside the window (as far as the relay can tell): the subject scan finds it too.
    let old = UnknownLookup {
        sent_ago: Duration::from_secs(3600),
        ..q
    };
    assert!(matches!(s.lookup(old).await.unwrap(), Lookup::Found { offset: o, .. } if o == offset));
    let msgs = outbox_testkit::nats::read_stream(&nats.url(), "S")
        .await
        .unwrap();
    assert_eq!(msgs.len(), 1, "one copy");
    assert_eq!(msgs[0].msg_id(), ev.event_id.to_string());
    assert_eq!(
        msgs[0].headers["trace"], "t-1",
        "the row's own headers travel too"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_proves_absence_by_scan_or_stores_the_probe_and_refuses_bad_subjects() {
    let nats = TestNats::start("sink_test").unwrap();
    let (s, mut rx) = sink(&nats, Duration::from_secs(120)).await;
    let other = event("outbox.order.o-2", "o-2", 1);
    s.send(&other, 1).await.unwrap();
    report(&mut rx).await;
    let ev = event("outbox.order.o-2", "o-2", 2);
    let q = UnknownLookup {
        event: &ev,
        topic: "outbox.order.o-2",
        partition: 0,
        from: 0,
        sent_ago: Duration::from_secs(3600),
    };
    assert_eq!(
        s.lookup(q).await.unwrap(),
        Lookup::Absent {
            scanned_from: 1,
            scanned_to: 2
        }
    );
    let probe = UnknownLookup {
        sent_ago: Duration::from_secs(1),
        ..q
    };
    assert!(matches!(
        s.lookup(probe).await.unwrap(),
        Lookup::StoredByProbe { offset: 2, .. }
    ));
    // No stream captures the subject: JetStream can never take it, so it is permanent.
    let outside = event("elsewhere.order.o-3", "o-3", 1);
    s.send(&outside, 4).await.unwrap();
    match report(&mut rx).await {
        DeliveryOutcome::Failed {
            persistence: Persistence::NotPersisted,
            class: FailureClass::Permanent,
            error,
            ..
        } => assert!(error.contains("no JetStream stream captures"), "{error}"),
        other => panic!("expected a permanent refusal, got {other:?}"),
    }
    let bad = event("outbox.order.a b", "a b", 1);
    match s.send(&bad, 3).await {
        Err(e @ SinkError::Publish { .. }) => {
            assert!(e.permanent_refusal().is_some(), "{e}")
        }
        other => panic!("expected a permanent refusal, got {other:?}"),
    }
}
