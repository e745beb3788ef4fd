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
    let digest: String = env
        .db
        .query_one(
            "SELECT outbox.payload_digest_of(payload, payload_digest) FROM outbox.events WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "id",
            value: Some(id.to_string().as_bytes()),
        })
        .insert(Header {
            key: "payload_digest",
            value: Some(digest.as_bytes()),
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
    // A found copy's receipt is accepted before its attempt is resolved FOUND
    // (`outbox_relay::unknown::record`): wait for both, not for the receipt alone.
    env.wait_zero(
        "the attempt resolved",
        "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
    )
    .await;
    let msgs = env.read_topic().await;
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
    let env = TestEnv::new_mock(
        "unknown_live",
        "make every Produce request time out at the broker, then stop",
    )
    .await;
    let mock = env.kafka.mock_cluster().expect("mock cluster");
    let _relay = env.relay(
        &[],
        &["--message-timeout-ms", "1500", "--unknown-settle-ms", "300"],
    );
    env.wait_streaming().await;
    env.warm_up("w-0").await;
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
    // A found copy's receipt is accepted before its attempt is resolved FOUND
    // (`outbox_relay::unknown::record`): wait for both, not for the receipt alone.
    env.wait_zero(
        "the attempt resolved",
        "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
    )
    .await;
    let copies = env
        .read_topic()
        .await
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
    let env = TestEnv::new_mock(
        "produce_error",
        "inject NOT_LEADER_FOR_PARTITION / NOT_ENOUGH_REPLICAS on exactly two Produce requests",
    )
    .await;
    let mock = env.kafka.mock_cluster().expect("mock cluster");
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
    let msgs = env.read_topic().await;
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
    env.route_to(&moved).await;

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
    assert_eq!(env.attempt_state(id).await, "ABSENT");
    let cross = env
        .read_topic_of(&moved)
        .await
        .iter()
        .filter(|m| m.id() == id.to_string())
        .count();
    assert_eq!(cross, 0, "cross-destination retries");
    assert_eq!(env.read_topic().await.len(), 1);
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

cdc_only! {
    "CDC only: needs B read and sent while A's Produce request is still at the broker; a poll round waits for every report before it reads again, so rounds never overlap like that (the implicit-ack classification it proves is the Kafka sink's, the same in both modes)";
    /// librdkafka's implicit ack through the relay (the mock cluster is the only way to fail
    /// exactly one Produce request at an exact round trip). A's request fails with a retriable
    /// error while B, on the same partition, is in flight; B succeeds and librdkafka reports A as
    /// delivered at offset -1001 although the partition never stored it. Before the fix the relay
    /// accepted that report as A's receipt and confirmed the slot past A: a silent loss. Now the
    /// report is DISPATCH_UNKNOWN, the scan proves A absent, and A is sent again (attempt 2).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_implicit_ack_without_a_stored_message_is_unknown_and_resent_never_a_receipt() {
        let env = TestEnv::new_mock(
            "implicit_ack",
            "inject one Produce error at an exact round trip (librdkafka implicit ack)",
        )
        .await;
        let mock = env.kafka.mock_cluster().expect("mock cluster");
        // One partition, so that A and B share it whatever their keys hash to.
        let topic = format!("{}.one", env.topic);
        env.kafka.create_topic(&topic, 1).unwrap();
        env.route_to(&topic).await;
        let _relay = env.relay(&[], &["--unknown-settle-ms", "300"]);
        env.wait_streaming().await;
        env.warm_up("warm").await;

        // The test cluster runs with synchronous_commit=off: the walsender would then see A and B
        // only at the WAL writer's next flush, together, and the relay would send them in one batch.
        env.db
            .execute("SET synchronous_commit = on", &[])
            .await
            .unwrap();
        mock.broker_round_trip_time(1, Duration::from_millis(200))
            .unwrap();
        mock.request_errors(
            RDKafkaApiKey::Produce,
            &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION],
        );
        let a = env.enqueue("a", json!({"v": "a"})).await;
        tokio::time::sleep(Duration::from_millis(30)).await; // B in its own, later batch
        let b = env.enqueue("b", json!({"v": "b"})).await;
        env.wait_count(
            "receipts of A and B",
            "SELECT count(*) FROM outbox.receipts",
            3,
        )
        .await;
        mock.broker_round_trip_time(1, Duration::ZERO).unwrap();

        let check = env.verify_receipts(&[&topic]).await;
        let copies = |id: uuid::Uuid| {
            check
                .messages
                .iter()
                .filter(|m| m.id() == id.to_string())
                .count()
        };
        assert_eq!(copies(a), 1, "A: the retry is the one copy on the broker");
        // B's report came while A's failure ended the run: B may be replayed (a duplicate copy,
        // kept as a duplicate transport receipt), never lost.
        assert!(copies(b) >= 1, "B is on the broker");
        // The relay settles everything it sent before its next restart.
        env.wait_count(
            "A's attempt resolved",
            &format!("SELECT count(*) FROM outbox.attempts WHERE event_id = '{a}' AND state <> 'DISPATCH_UNKNOWN'"),
            1,
        )
        .await;
        let row = env
            .db
            .query_one(
                "SELECT a.state, a.error, r.attempt FROM outbox.attempts a
                 JOIN outbox.receipts r USING (event_id) WHERE a.event_id = $1",
                &[&a],
            )
            .await
            .unwrap();
        let (state, error, attempt): (String, String, i32) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(
            state, "ABSENT",
            "the scan proved A was never stored ({error})"
        );
        assert!(error.contains("no proof of publication"), "{error}");
        assert_eq!(attempt, 2, "A's receipt is the retry's");
    }
}

/// A retry that a proven absence allowed keeps its attempt generation when the relay restarts
/// between the proof and the send (it lived only in memory: the resend went out as attempt 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_keeps_its_attempt_generation_when_the_relay_restarts_before_sending_it() {
    let env = TestEnv::new("retry_generation").await;
    let id = env.enqueue("g-1", json!({"v": 1})).await;
    env.record_unknown_attempt(id).await;
    // Run 1 proves the attempt absent, then dies before it sends anything.
    let mut first = env.relay(
        &[("OUTBOXD_FAILPOINTS", "before-send=abort")],
        &["--unknown-settle-ms", "300"],
    );
    let status = first.wait_exit(crate::harness::LONG).await;
    assert!(!status.success(), "run 1 aborts at the failpoint");
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.attempts WHERE state = 'ABSENT'")
            .await,
        1,
        "run 1 proved the attempt absent: {}",
        first.log_text()
    );
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 0);
    // Run 2 sends the retry.
    let _second = env.restart_until_receipts(1).await;
    let attempt: i32 = env
        .db
        .query_one(
            "SELECT attempt FROM outbox.receipts WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(attempt, 2, "the retry after a proven absence is attempt 2");
    env.verify_receipts(&[&env.topic]).await;
}

/// librdkafka's idempotent producer raises a *fatal* error when it can no longer vouch for
/// order or once-ness: here a head-of-line Produce request answered
/// OUT_OF_ORDER_SEQUENCE_NUMBER (the broker lost the producer's sequence state). From then on
/// that producer refuses every message, so a relay that keeps it serves no aggregate again
/// until someone restarts it. The relay must replace the producer (a new run: what was in
/// flight is recorded UNKNOWN and reconciled by the partition scan) and deliver everything,
/// in order, with every receipt where the broker holds the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_producer_error_is_survived_by_a_new_producer() {
    let env = TestEnv::new_mock(
        "producer_fatal",
        "answer one Produce request with OUT_OF_ORDER_SEQUENCE_NUMBER, which librdkafka's idempotent producer makes fatal",
    )
    .await;
    let mock = env.kafka.mock_cluster().expect("mock cluster");
    let mut relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    env.warm_up("f-w").await;
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER],
    );
    let (aggregates, versions) = (5, 4);
    for v in 1..=versions {
        for a in 0..aggregates {
            env.enqueue(&format!("f-{a}"), json!({ "v": v })).await;
        }
    }
    let total = 1 + aggregates * versions;
    env.wait_receipts("every event, after the producer's fatal error", total)
        .await;
    relay.assert_running();
    // The fault met traffic: the producer did fail, and was replaced.
    let log = relay.log_text();
    assert!(
        log.contains("the Kafka producer failed fatally"),
        "the injected OUT_OF_ORDER_SEQUENCE_NUMBER never made the producer fatal; relay log:\n{log}"
    );
    let check = env.verify_receipts(&[&env.topic]).await;
    let order = crate::ordering::first_occurrences(&check.messages);
    let expected: Vec<i64> = (1..=versions as i64).collect();
    let out_of_order = (0..aggregates)
        .filter(|a| order.get(&format!("f-{a}")) != Some(&expected))
        .count();
    assert_eq!(
        out_of_order, 0,
        "aggregates whose first occurrences on the broker are not 1..{versions}: {order:?}"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'")
            .await,
        0,
        "attempts left unresolved"
    );
}
