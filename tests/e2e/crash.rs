//! Crashes at the durable boundaries: before the send, after the broker's ACK but before the
//! ledger, after the ledger but before the slot is told, and at random moments under load.

use std::time::Duration;

use serde_json::json;

use crate::harness::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_broker_ack_before_acceptance_gets_one_primary_receipt() {
    let env = TestEnv::new("kill_after_ack").await;
    let sampler = env.start_sampler();
    let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "after-broker-ack=abort")], &[]);
    env.wait_streaming().await;
    let id = env.enqueue("k-1", json!({"v": 1})).await;
    let status = relay.wait_exit(Duration::from_secs(60)).await;
    assert!(!status.success(), "the failpoint aborts the relay");
    assert!(relay.log_text().contains("failpoint after-broker-ack"));
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 0);
    assert_eq!(
        env.read_topic().await.len(),
        1,
        "the broker has the message, the ledger does not"
    );

    let _relay = env.restart_until_receipts(1).await;
    let msgs = env.read_topic().await;
    assert!(
        msgs.len() >= 2,
        "replayed after restart: {} copies",
        msgs.len()
    );
    assert!(
        msgs.iter().all(|m| m.id() == id.to_string()),
        "one logical event id"
    );
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 1);
    sampler.assert_never_confirmed_past_unaccepted(&env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_acceptance_before_confirming_resumes_from_the_ledger_checkpoint() {
    let env = TestEnv::new("kill_after_accept").await;
    let sampler = env.start_sampler();
    let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "after-accept=abort")], &[]);
    env.wait_streaming().await;
    let id = env.enqueue("d-1", json!({"v": 1})).await;
    relay.wait_exit(Duration::from_secs(60)).await;
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 1);

    // The slot was never told; the ledger checkpoint written with the receipt was. The restart
    // resumes from the checkpoint, so the accepted event is normally not sent again; if its
    // transaction was not yet covered, the replay is recorded as a duplicate, never a primary.
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    let later = env.enqueue("d-1", json!({"v": 2})).await;
    env.wait_count("the next event", "SELECT count(*) FROM outbox.receipts", 2)
        .await;
    let copies = env
        .read_topic()
        .await
        .iter()
        .filter(|m| m.id() == id.to_string())
        .count() as i64;
    let dups = env
        .count(&format!(
            "SELECT count(*) FROM outbox.duplicate_receipts WHERE event_id = '{id}'"
        ))
        .await;
    assert_eq!(copies, 1 + dups, "every extra copy is a recorded duplicate");
    assert!(dups <= 1);
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.receipts WHERE event_id IN ('{id}', '{later}')"
        ))
        .await,
        2,
        "one primary receipt each"
    );
    sampler.assert_never_confirmed_past_unaccepted(&env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_sending_publishes_after_restart() {
    let env = TestEnv::new("kill_before_send").await;
    let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "before-send=abort")], &[]);
    env.wait_streaming().await;
    let id = env.enqueue("s-1", json!({"v": 1})).await;
    relay.wait_exit(Duration::from_secs(60)).await;
    assert_eq!(
        env.read_topic().await.len(),
        0,
        "nothing was sent before the crash"
    );

    let _relay = env.restart_until_receipts(1).await;
    let msgs = env.read_topic().await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0].id(), id.to_string());
}

// The load test with concurrent writers, rollbacks and SIGKILLs at seeded moments grew into
// `chaos.rs`, which adds walsender termination, broker faults and an inbox consumer.
