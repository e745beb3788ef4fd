//! The receipt check of the harness ([`crate::harness::TestEnv::verify_receipts`]), shown able
//! to fail: every test that reads a topic relies on it to prove each receipt is a message on
//! the broker, so a wrong receipt planted here must make it fail, naming the receipt.

use serde_json::json;

use crate::harness::TestEnv;

/// Three events published and accepted; the relay stopped, so nothing repairs a planted row.
async fn published(name: &str) -> TestEnv {
    let env = TestEnv::new(name).await;
    let mut relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    for k in ["k1", "k2", "k3"] {
        env.enqueue(k, json!({"k": k})).await;
    }
    env.wait_count("3 receipts", "SELECT count(*) FROM outbox.receipts", 3)
        .await;
    relay.kill9();
    let check = env.verify_receipts(&[&env.topic]).await;
    assert_eq!(check.checked, 3, "the unplanted receipts check out");
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "the broker has no message there")]
async fn a_receipt_at_a_position_without_a_message_fails_the_check() {
    let env = published("planted_missing").await;
    env.db
        .execute(
            "UPDATE outbox.receipts SET \"offset\" = \"offset\" + 1000
             WHERE event_id = (SELECT event_id FROM outbox.receipts ORDER BY event_id LIMIT 1)",
            &[],
        )
        .await
        .unwrap();
    env.read_topic().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "the message there has id")]
async fn a_duplicate_receipt_at_another_events_message_fails_the_check() {
    let env = published("planted_other").await;
    // A duplicate receipt of one event pointing at another event's message.
    let n = env
        .db
        .execute(
            "INSERT INTO outbox.duplicate_receipts (event_id, broker_kind, broker_cluster, topic,
                                                    partition, \"offset\")
             SELECT a.event_id, a.broker_kind, a.broker_cluster, b.topic, b.partition, b.\"offset\"
             FROM outbox.receipts a, outbox.receipts b
             WHERE a.event_id <> b.event_id LIMIT 1",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
    env.read_topic().await;
}
