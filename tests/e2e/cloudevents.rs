//! CloudEvents Kafka binary binding (`--cloudevents`) and W3C trace context propagation:
//! the `ce_*` attributes describe the outbox event, the value stays the payload, and
//! `traceparent` / `tracestate` from the outbox row's headers arrive as Kafka headers.

use serde_json::json;

use crate::harness::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_headers_and_traceparent_reach_the_topic() {
    let env = TestEnv::new("cloudevents").await;
    let _relay = env.relay(&[], &["--cloudevents-source", "/shop/{aggregate_type}"]);
    env.wait_streaming().await;

    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let tracestate = "congo=t61rcWkgMzE";
    let headers = json!({"traceparent": traceparent, "tracestate": tracestate});
    let payload = json!({"total": 42});
    let id: uuid::Uuid = env
        .db
        .query_one(
            "SELECT outbox.enqueue($1, 'o-7', 'order.created', $2, headers => $3)",
            &[&env.aggregate_type, &payload, &headers],
        )
        .await
        .unwrap()
        .get(0);
    env.wait_count("the receipt", "SELECT count(*) FROM outbox.receipts", 1)
        .await;

    let msgs = env.read_topic().await;
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    let m = &msgs[0];
    let h = |k: &str| m.headers.get(k).map(String::as_str);
    assert_eq!(h("ce_specversion"), Some("1.0"));
    assert_eq!(h("ce_id"), Some(id.to_string().as_str()));
    assert_eq!(h("id"), Some(id.to_string().as_str()));
    assert_eq!(h("ce_type"), Some("order.created"));
    let source = format!("/shop/{}", env.aggregate_type);
    assert_eq!(h("ce_source"), Some(source.as_str()));
    assert_eq!(h("ce_subject"), Some("o-7"));
    assert_eq!(h("content-type"), Some("application/json"));
    // RFC 3339 (`T`, numeric offset with a colon), and the same instant as occurred_at.
    let time = h("ce_time").unwrap_or_default().to_string();
    assert_eq!(time.as_bytes().get(10), Some(&b'T'), "ce_time {time:?}");
    let offset = time
        .rfind(['+', '-', 'Z'])
        .map(|i| &time[i..])
        .unwrap_or("");
    assert!(
        offset == "Z" || (offset.len() == 6 && offset.as_bytes()[3] == b':'),
        "ce_time {time:?} has no RFC 3339 offset"
    );
    let same: bool = env
        .db
        .query_one(
            "SELECT occurred_at = $2::text::timestamptz FROM outbox.events WHERE event_id = $1",
            &[&id, &time],
        )
        .await
        .unwrap()
        .get(0);
    assert!(same, "ce_time {time:?} is not the event's occurred_at");
    assert_eq!(h("traceparent"), Some(traceparent));
    assert_eq!(h("tracestate"), Some(tracestate));
    let value: serde_json::Value = serde_json::from_str(m.payload.as_deref().unwrap()).unwrap();
    assert_eq!(
        value, payload,
        "binary mode: the value is the payload itself"
    );
}
