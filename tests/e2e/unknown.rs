//! DISPATCH_UNKNOWN: an ACK lost after the append is found by scanning the frozen partition
//! (no resend); a proven absence allows a retry, to the frozen destination only.

use std::time::Duration;

use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use serde_json::json;

use crate::harness::TestEnv;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::ClientConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_lost_after_the_append_is_found_by_the_partition_scan_and_not_resent() {
    let env = TestEnv::new("unknown_found").await;
    // The state a lost ACK leaves behind: the broker has the message (appended by an earlier
    // relay generation), the ledger has only a DISPATCH_UNKNOWN attempt.
    let id = env.enqueue("u-1", json!({"v": 1})).await;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", env.kafka.bootstrap_servers())
        .create()
        .unwrap();
    let headers = OwnedHeaders::new().insert(Header {
        key: "id",
        value: Some(id.to_string().as_bytes()),
    });
    producer
        .send(
            BaseRecord::to(&env.topic)
                .partition(0)
                .key("u-1")
                .payload("{\"v\": 1}")
                .headers(headers),
        )
        .map_err(|(e, _)| e)
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();
    env.record_unknown_attempt(id).await;

    let _relay = env.relay(&[], &["--unknown-settle-ms", "300"]);
    env.wait_count(
        "the receipt from the scan",
        "SELECT count(*) FROM outbox.receipts",
        1,
    )
    .await;
    let msgs = env.read_topic();
    assert_eq!(msgs.len(), 1, "found by the scan, never sent again");
    let row = env
        .db
        .query_one(
            "SELECT a.state, a.found_offset, r.\"offset\", r.attempt,
                    extract(epoch FROM a.resolved_at - a.unknown_at)::float8 * 1000
             FROM outbox.attempts a JOIN outbox.receipts r USING (event_id)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "FOUND");
    assert_eq!(row.get::<_, Option<i64>>(1), Some(msgs[0].offset));
    assert_eq!(row.get::<_, i64>(2), msgs[0].offset);
    assert_eq!(
        row.get::<_, i32>(3),
        1,
        "the receipt is the original attempt's"
    );
    println!("UNKNOWN -> FOUND in {:.0} ms", row.get::<_, f64>(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_that_ends_without_proof_is_recorded_unknown_then_reconciled() {
    let env = TestEnv::new("unknown_live").await;
    let Some(mock) = env.kafka.mock_cluster() else {
        println!("skipped: needs the mock cluster to inject request timeouts");
        return;
    };
    let _relay = env.relay(
        &[],
        &["--message-timeout-ms", "1500", "--unknown-settle-ms", "300"],
    );
    env.wait_streaming().await;
    env.enqueue("w-0", json!({"warm": true})).await;
    env.wait_count(
        "the warm-up receipt",
        "SELECT count(*) FROM outbox.receipts",
        1,
    )
    .await;
    // Every produce request times out at the broker: the producer cannot tell whether it was
    // written, and gives up when message.timeout.ms expires.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT; 200],
    );
    let id = env.enqueue("w-1", json!({"v": 1})).await;
    env.wait_count(
        "the attempt recorded as DISPATCH_UNKNOWN",
        "SELECT count(*) FROM outbox.attempts",
        1,
    )
    .await;
    mock.clear_request_errors(RDKafkaApiKey::Produce);
    env.wait_count(
        "the event accepted",
        "SELECT count(*) FROM outbox.receipts",
        2,
    )
    .await;
    let copies = env
        .read_topic()
        .iter()
        .filter(|m| m.id() == id.to_string())
        .count();
    let row = env
        .db
        .query_one(
            "SELECT a.state, r.attempt, extract(epoch FROM a.resolved_at - a.unknown_at)::float8 * 1000
             FROM outbox.attempts a JOIN outbox.receipts r USING (event_id) WHERE a.event_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let state: String = row.get(0);
    println!("UNKNOWN -> {state} in {:.0} ms", row.get::<_, f64>(2));
    match state.as_str() {
        "ABSENT" => assert_eq!(row.get::<_, i32>(1), 2, "the retry is attempt generation 2"),
        "FOUND" => assert_eq!(row.get::<_, i32>(1), 1),
        other => panic!("unresolved attempt state {other}"),
    }
    assert_eq!(copies, 1, "exactly one copy on the broker");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "status",
            "--database-url",
            &env.url,
            "--event",
            &id.to_string(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("state      PUBLISHED")
            && text.contains("attempt")
            && text.contains(&state)
            && text.contains("primary:"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_produce_request_error_is_retried_into_exactly_one_copy() {
    let env = TestEnv::new("produce_error").await;
    let Some(mock) = env.kafka.mock_cluster() else {
        println!("skipped: needs the mock cluster to inject request errors");
        return;
    };
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        ],
    );
    let id = env.enqueue("e-1", json!({})).await;
    env.wait_count("the receipt", "SELECT count(*) FROM outbox.receipts", 1)
        .await;
    let msgs = env.read_topic();
    assert_eq!(msgs.len(), 1, "not written, retried: exactly one copy");
    assert_eq!(msgs[0].id(), id.to_string());
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.attempts").await,
        0,
        "nothing was unknown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proven_absence_retries_to_the_frozen_destination_even_after_a_route_change() {
    let env = TestEnv::new("unknown_absent").await;
    // An event frozen to the default topic, whose only attempt ended UNKNOWN (the relay that
    // sent it is gone) and never reached the broker.
    let id = env.enqueue("r-1", json!({"v": 1})).await;
    env.record_unknown_attempt(id).await;
    // The route policy changes while the event is UNKNOWN.
    let moved = format!("{}.moved", env.topic);
    env.kafka.create_topic(&moved, 1).unwrap();
    env.db
        .query_one(
            "SELECT outbox.set_route($1, NULL, $2)",
            &[&env.aggregate_type, &moved],
        )
        .await
        .unwrap();

    let _relay = env.relay(&[], &["--unknown-settle-ms", "300"]);
    env.wait_count(
        "the retry's receipt",
        "SELECT count(*) FROM outbox.receipts",
        1,
    )
    .await;
    let row = env
        .db
        .query_one(
            "SELECT topic, attempt FROM outbox.receipts WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, String>(0),
        env.topic,
        "the retry went to the frozen destination"
    );
    assert_eq!(row.get::<_, i32>(1), 2, "attempt generation + 1");
    let state: String = env
        .db
        .query_one(
            "SELECT state FROM outbox.attempts WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "ABSENT");
    let cross = crate::harness::read_topic(env.kafka.bootstrap_servers(), &moved)
        .iter()
        .filter(|m| m.id() == id.to_string())
        .count();
    assert_eq!(cross, 0, "cross-destination retries");
    assert_eq!(env.read_topic().len(), 1);
    let status: String = env
        .db
        .query_one(
            "SELECT state FROM outbox.event_status WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(status, "PUBLISHED");
}
