//! The HTTP sink against a real HTTP server (`outbox_testkit::http_target`): what each answer
//! of an endpoint becomes, and that an UNKNOWN send resolved by a retry with the same key is
//! applied once by an endpoint that keeps keys.

use std::time::Duration;

use bytes::Bytes;
use outbox_core::{Destination, OutboxEvent};
use outbox_sink::http::Exchange;
use outbox_sink::{
    Delivery, DeliveryOutcome, FailureClass, HttpSink, HttpSinkConfig, Lookup, Persistence, Sink,
    UnknownLookup,
};
use outbox_testkit::http_target::{Behavior, HttpTarget, TargetSettings};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn event(url: &str, aggregate_id: &str, version: i64, body: &str) -> OutboxEvent {
    let destination = Destination {
        kind: "http".into(),
        cluster: "billing-api".into(),
        topic: url.into(),
        key: aggregate_id.into(),
        partitioner: "none".into(),
        route_generation: 1,
        serializer: "json".into(),
        acks: "all".into(),
    };
    OutboxEvent::frozen(
        uuid::Uuid::now_v7(),
        ("invoice", aggregate_id, version),
        "invoice.issued",
        Bytes::from(body.to_string()),
        destination,
    )
}

fn sink(config: HttpSinkConfig) -> (HttpSink, UnboundedReceiver<Delivery>) {
    let (tx, rx) = unbounded_channel();
    (HttpSink::new(config, tx).expect("sink"), rx)
}

fn config() -> HttpSinkConfig {
    HttpSinkConfig {
        endpoint: "billing-api".into(),
        headers: vec![("Authorization".into(), "Bearer t0ken".into())],
        response_id_header: Some("X-Response-Id".into()),
        request_timeout: Duration::from_millis(500),
        deadline: Duration::from_secs(5),
        idempotency_window: Some(Duration::from_secs(3600)),
        ..HttpSinkConfig::default()
    }
}

async fn target() -> HttpTarget {
    HttpTarget::start(TargetSettings {
        poison: Some("poison".into()),
        ..TargetSettings::default()
    })
    .await
    .expect("start the HTTP target")
}

#[tokio::test]
async fn a_2xx_is_the_receipt_and_the_request_carries_key_envelope_auth_and_payload() {
    let t = target().await;
    let (s, mut rx) = sink(config());
    let ev = event(&t.url("/hooks/invoice"), "inv-1", 1, r#"{"amount":12}"#);
    s.send(&ev, 7).await.unwrap();
    let d = rx.recv().await.unwrap();
    assert_eq!(d.token, 7);
    assert!(
        matches!(&d.outcome, DeliveryOutcome::Persisted { topic, .. } if topic == &ev.destination.topic),
        "{:?}",
        d.outcome
    );
    let key = ev.event_id.to_string();
    assert_eq!(t.applied(&key), 1);
    let reqs = t.requests();
    let r = &reqs[0];
    assert_eq!(
        (r.method.as_str(), r.path.as_str()),
        ("POST", "/hooks/invoice")
    );
    assert_eq!(r.body, br#"{"amount":12}"#);
    for (h, v) in [
        ("idempotency-key", key.as_str()),
        ("outbox-id", key.as_str()),
        ("outbox-aggregate-type", "invoice"),
        ("outbox-aggregate-id", "inv-1"),
        ("outbox-aggregate-version", "1"),
        ("outbox-event-type", "invoice.issued"),
        ("outbox-payload-digest", ev.payload_digest.as_str()),
        ("authorization", "Bearer t0ken"),
        ("content-type", "application/json"),
    ] {
        assert_eq!(r.headers.get(h).map(String::as_str), Some(v), "header {h}");
    }
    // The receipt names the endpoint's answer.
    let Exchange::Receipt(receipt) = s.exchange(&ev).await else {
        panic!("a repeat of an applied key is answered 200");
    };
    assert_eq!(receipt.status, 200);
    assert_eq!(receipt.response_id.as_deref(), Some("r1"));
    assert_eq!(
        t.applied(&key),
        1,
        "the endpoint keeps keys: not applied again"
    );
}

#[tokio::test]
async fn a_4xx_is_a_refusal_and_429_or_503_are_asked_again_after_retry_after() {
    let t = target().await;
    let (s, mut rx) = sink(config());
    let poison = event(&t.url("/hooks"), "inv-2", 1, r#"{"poison":true}"#);
    s.send(&poison, 1).await.unwrap();
    match rx.recv().await.unwrap().outcome {
        DeliveryOutcome::Failed {
            persistence: Persistence::NotPersisted,
            class: FailureClass::Permanent,
            error,
            ..
        } => assert!(error.contains("400"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(t.applied(&poison.event_id.to_string()), 0);

    t.then(Behavior::Status {
        status: 429,
        retry_after: Some("1".into()),
    });
    t.then(Behavior::Status {
        status: 503,
        retry_after: None,
    });
    let ev = event(&t.url("/hooks"), "inv-3", 1, "{}");
    s.send(&ev, 2).await.unwrap();
    assert!(matches!(
        rx.recv().await.unwrap().outcome,
        DeliveryOutcome::Persisted { .. }
    ));
    let reqs: Vec<_> = t
        .requests()
        .into_iter()
        .filter(|r| r.headers["idempotency-key"] == ev.event_id.to_string())
        .collect();
    assert_eq!(reqs.len(), 3, "429, 503, then applied");
    assert!(
        reqs[1].at - reqs[0].at >= Duration::from_secs(1),
        "Retry-After: 1 was not honoured: {:?}",
        reqs[1].at - reqs[0].at
    );
    assert_eq!(t.applied(&ev.event_id.to_string()), 1);

    // Past the deadline, 503s leave the event not persisted: the relay replays it.
    let (s, mut rx) = sink(HttpSinkConfig {
        deadline: Duration::from_millis(600),
        ..config()
    });
    for _ in 0..10 {
        t.then(Behavior::Status {
            status: 503,
            retry_after: None,
        });
    }
    let ev = event(&t.url("/hooks"), "inv-4", 1, "{}");
    s.send(&ev, 3).await.unwrap();
    match rx.recv().await.unwrap().outcome {
        DeliveryOutcome::Failed {
            persistence: Persistence::NotPersisted,
            class: FailureClass::Transient,
            ..
        } => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(t.applied(&ev.event_id.to_string()), 0);
}

/// Late answers, dropped connections and 500s leave the outcome unknown; the retry with the
/// same key resolves it, and the endpoint applied each event exactly once.
#[tokio::test]
async fn an_unknown_send_is_resolved_by_a_retry_with_the_same_key_applied_once() {
    let t = target().await;
    let (s, mut rx) = sink(config());
    for (i, b) in [
        Behavior::Late(Duration::from_millis(1_500)),
        Behavior::Drop { applied: true },
        Behavior::Drop { applied: false },
        Behavior::Status {
            status: 500,
            retry_after: None,
        },
    ]
    .into_iter()
    .enumerate()
    {
        t.then(b.clone());
        let ev = event(&t.url("/hooks"), &format!("inv-u{i}"), 1, "{}");
        s.send(&ev, i as u64).await.unwrap();
        match rx.recv().await.unwrap().outcome {
            DeliveryOutcome::Failed {
                persistence: Persistence::PossiblyPersisted,
                ..
            } => {}
            other => panic!("{b:?}: {other:?}"),
        }
        let lookup = s
            .lookup(UnknownLookup {
                event: &ev,
                topic: &ev.destination.topic,
                partition: 0,
                from: 0,
                sent_ago: Duration::from_secs(1),
            })
            .await
            .unwrap_or_else(|e| panic!("{b:?}: {e}"));
        assert!(
            matches!(lookup, Lookup::StoredByProbe { .. }),
            "{b:?}: {lookup:?}"
        );
        assert_eq!(t.applied(&ev.event_id.to_string()), 1, "{b:?}");
    }
}

#[tokio::test]
async fn a_refused_connection_is_not_persisted() {
    // A port nothing listens on.
    let port = outbox_testkit::ports::free_port().unwrap();
    let (s, mut rx) = sink(HttpSinkConfig {
        deadline: Duration::from_millis(400),
        ..config()
    });
    let ev = event(&format!("http://127.0.0.1:{port}/hooks"), "inv-5", 1, "{}");
    s.send(&ev, 1).await.unwrap();
    match rx.recv().await.unwrap().outcome {
        DeliveryOutcome::Failed {
            persistence: Persistence::NotPersisted,
            class: FailureClass::Transient,
            error,
            ..
        } => assert!(error.contains("connection failed"), "{error}"),
        other => panic!("{other:?}"),
    }
}

/// HTTPS: an endpoint whose certificate chains to `ca_file` is served; without it, the
/// certificate is refused before any request is written (not persisted, nothing applied).
#[tokio::test]
async fn https_trusts_the_configured_ca_and_refuses_an_unknown_one() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = outbox_testkit::tls::make_ca_and_server_cert(dir.path(), "hooks-ca");
    let t = HttpTarget::start(TargetSettings {
        tls: Some((cert, key)),
        ..TargetSettings::default()
    })
    .await
    .expect("start the HTTPS target");
    assert!(t.url("/").starts_with("https://127.0.0.1:"));

    let (s, mut rx) = sink(HttpSinkConfig {
        ca_file: Some(ca),
        ..config()
    });
    let ev = event(&t.url("/hooks"), "inv-tls", 1, "{}");
    s.send(&ev, 1).await.unwrap();
    assert!(
        matches!(
            rx.recv().await.unwrap().outcome,
            DeliveryOutcome::Persisted { .. }
        ),
        "served over TLS with the CA"
    );
    assert_eq!(t.applied(&ev.event_id.to_string()), 1);

    let (s, mut rx) = sink(HttpSinkConfig {
        deadline: Duration::from_millis(400),
        ..config()
    });
    let ev = event(&t.url("/hooks"), "inv-untrusted", 1, "{}");
    s.send(&ev, 2).await.unwrap();
    match rx.recv().await.unwrap().outcome {
        DeliveryOutcome::Failed {
            persistence: Persistence::NotPersisted,
            error,
            ..
        } => assert!(error.contains("connection failed"), "{error}"),
        other => panic!("an untrusted certificate was accepted: {other:?}"),
    }
    assert_eq!(t.applied(&ev.event_id.to_string()), 0);
    assert_eq!(
        t.request_count(),
        1,
        "no request crossed an untrusted connection"
    );
}

/// A retry of an UNKNOWN send that is not answered either leaves the attempt UNKNOWN with a
/// transient error (the relay restarts and tries again), not a fatal one.
#[tokio::test]
async fn an_unanswered_retry_is_transient_and_a_later_one_resolves() {
    let t = target().await;
    let (s, _rx) = sink(config());
    let ev = event(&t.url("/hooks"), "inv-r", 1, "{}");
    let q = UnknownLookup {
        event: &ev,
        topic: &ev.destination.topic,
        partition: 0,
        from: 0,
        sent_ago: Duration::from_secs(1),
    };
    t.then(Behavior::Drop { applied: false });
    let e = s.lookup(q).await.unwrap_err();
    assert!(e.is_transient(), "{e}");
    assert!(matches!(
        s.lookup(q).await,
        Ok(Lookup::StoredByProbe { .. })
    ));
    assert_eq!(t.applied(&ev.event_id.to_string()), 1);
}

/// Issue 33, finding 4: an endpoint answering a redirect to another server got the payload
/// and the configured `x-api-key` sent there (reqwest's default policy drops only
/// `Authorization`). No redirect is followed: a 3xx is a refusal naming the redirect's target,
/// and the other server receives nothing.
#[tokio::test]
async fn a_redirect_is_a_refusal_naming_its_target_and_is_never_followed() {
    let (t, elsewhere) = (target().await, target().await);
    let (s, mut rx) = sink(HttpSinkConfig {
        headers: vec![("x-api-key".into(), "k3y-s3cret".into())],
        ..config()
    });
    for status in [301, 302, 303, 307, 308] {
        t.then(Behavior::Redirect {
            status,
            location: elsewhere.url("/collect?token=abc"),
        });
        let ev = event(&t.url("/hooks"), "inv-r", 1, r#"{"amount":1}"#);
        s.send(&ev, status as u64).await.unwrap();
        match rx.recv().await.unwrap().outcome {
            DeliveryOutcome::Failed {
                persistence: Persistence::NotPersisted,
                class: FailureClass::Permanent,
                error,
                ..
            } => assert!(
                error.contains(&status.to_string())
                    && error.contains(&elsewhere.url("/collect"))
                    && error.contains("not followed")
                    && !error.contains("token=abc"),
                "{status}: {error}"
            ),
            other => panic!("{status}: {other:?}"),
        }
        assert_eq!(t.applied(&ev.event_id.to_string()), 0);
    }
    assert_eq!(
        elsewhere.request_count(),
        0,
        "a redirect was followed: {:?}",
        elsewhere.requests()
    );
    assert_eq!(t.request_count(), 5, "one request per redirect, no retry");
}
