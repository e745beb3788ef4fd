//! The happy paths and the ones that must not publish.

use std::collections::HashSet;

use serde_json::json;

use crate::harness::{TestEnv, LONG};
use outbox_testkit::wait::wait_for;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_publishes_nothing_and_commit_is_published_with_id_header_and_key() {
    let env = TestEnv::new("commit_rollback").await;
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;

    // A rolled-back transaction: enqueue returns an id, but the row never commits.
    let mut c = crate::harness::connect(&env.url).await;
    let tx = c.transaction().await.unwrap();
    let rolled_back: uuid::Uuid = tx
        .query_one(
            "SELECT outbox.enqueue($1, 'o-1', 'order.created', '{\"total\": 1}')",
            &[&env.aggregate_type],
        )
        .await
        .unwrap()
        .get(0);
    tx.rollback().await.unwrap();

    let committed = env
        .enqueue("o-2", json!({"total": 2, "note": "ünïcode"}))
        .await;
    env.wait_count(
        "the committed event's receipt",
        "SELECT count(*) FROM outbox.receipts",
        1,
    )
    .await;

    let msgs = env.read_topic().await;
    assert_eq!(msgs.len(), 1, "exactly one message on the topic: {msgs:?}");
    let m = &msgs[0];
    assert_eq!(m.id(), committed.to_string());
    assert_eq!(m.key.as_deref(), Some("o-2"));
    assert_eq!(m.headers.get("aggregate_type"), Some(&env.aggregate_type));
    assert_eq!(
        m.headers.get("aggregate_version").map(String::as_str),
        Some("1")
    );
    assert_eq!(
        m.headers.get("event_type").map(String::as_str),
        Some("test.happened")
    );
    assert_eq!(
        m.headers.get("envelope_generation").map(String::as_str),
        Some("1")
    );
    let payload: serde_json::Value = serde_json::from_str(m.payload.as_deref().unwrap()).unwrap();
    assert_eq!(payload, json!({"total": 2, "note": "ünïcode"}));

    let published_rolled_back = msgs
        .iter()
        .filter(|m| m.id() == rolled_back.to_string())
        .count();
    assert_eq!(
        published_rolled_back, 0,
        "rolled-back event reached the broker"
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.events WHERE event_id = '{rolled_back}'"
        ))
        .await,
        0
    );
    // The receipt points at the message that is really there.
    let row = env
        .db
        .query_one(
            "SELECT topic, partition, \"offset\" FROM outbox.receipts",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), env.topic);
    assert_eq!(row.get::<_, i32>(1), m.partition);
    assert_eq!(row.get::<_, i64>(2), m.offset);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_enqueued_before_the_relay_ever_started_are_all_published() {
    let env = TestEnv::new("before_first_start").await;
    let mut ids = HashSet::new();
    for i in 0..50 {
        ids.insert(
            env.enqueue(&format!("a-{}", i % 7), json!({"i": i}))
                .await
                .to_string(),
        );
    }
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            env.slot
        ))
        .await,
        0,
        "no slot exists yet: these events are in no WAL stream the relay will read"
    );
    let _relay = env.relay(&[], &[]);
    env.wait_count(
        "receipts for the pre-slot backlog",
        "SELECT count(*) FROM outbox.receipts",
        50,
    )
    .await;
    // And the stream works after the snapshot.
    let later = env.enqueue("a-1", json!({"i": 50})).await;
    ids.insert(later.to_string());
    env.wait_count(
        "receipt for the streamed event",
        "SELECT count(*) FROM outbox.receipts",
        51,
    )
    .await;

    let msgs = env.read_topic().await;
    let seen: HashSet<String> = msgs.iter().map(|m| m.id().to_string()).collect();
    let lost = ids.difference(&seen).count();
    assert_eq!(lost, 0, "lost events");
    assert_eq!(msgs.len(), 51, "each event exactly once in the normal case");
    if crate::harness::poll_mode() {
        // No snapshot and no stream in poll mode: every round is a read. Said as counts: no
        // receipt has a commit LSN, and the relay made no slot.
        assert_eq!(
            env.count("SELECT count(*) FROM outbox.receipts WHERE commit_lsn IS NULL")
                .await,
            51,
            "poll mode: a receipt with a commit LSN"
        );
        assert_eq!(
            env.count(&format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
                env.slot
            ))
            .await,
            0,
            "poll mode made a slot"
        );
        return;
    }
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.receipts WHERE commit_lsn IS NULL")
            .await,
        50,
        "the backlog came from the snapshot, not the stream"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.checkpoints WHERE snapshot_done")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_row_is_quarantined_with_its_reason_and_other_events_flow() {
    let env = TestEnv::new("malformed").await;
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    let good1 = env.enqueue("g-1", json!({"ok": 1})).await;
    // A row written around outbox.enqueue storing a digest that does not match its payload
    // (good1's: outbox.enqueue stores none since migration 0027, the relay computes it).
    let bad: uuid::Uuid = env
        .db
        .query_one(
            "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_version,
                 event_type, payload, payload_digest, dest_kind, dest_cluster, dest_topic, dest_key,
                 dest_partitioner, dest_route_generation, dest_serializer, dest_acks, destination_digest)
             SELECT gen_random_uuid(), aggregate_type, 'bad-1', 1, event_type, '{\"forged\": true}',
                 outbox.payload_digest_of(payload, payload_digest), dest_kind, dest_cluster, dest_topic, 'bad-1', dest_partitioner,
                 dest_route_generation, dest_serializer, dest_acks, destination_digest
             FROM outbox.events_frozen WHERE event_id = $1
             RETURNING event_id",
            &[&good1],
        )
        .await
        .unwrap()
        .get(0);
    let good2 = env.enqueue("g-2", json!({"ok": 2})).await;
    env.wait_count(
        "receipts of the good events",
        "SELECT count(*) FROM outbox.receipts",
        2,
    )
    .await;
    env.wait_count(
        "the quarantine record",
        "SELECT count(*) FROM outbox.quarantine",
        1,
    )
    .await;

    let row = env
        .db
        .query_one(
            "SELECT event_id, reason_code, reason FROM outbox.quarantine",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, uuid::Uuid>(0), bad);
    assert_eq!(row.get::<_, String>(1), "payload_digest_mismatch");
    let reason: String = row.get(2);
    assert!(
        reason.contains("payload_digest") && reason.contains(&bad.to_string()),
        "{reason}"
    );

    let msgs = env.read_topic().await;
    let ids: HashSet<&str> = msgs.iter().map(|m| m.id()).collect();
    assert!(ids.contains(good1.to_string().as_str()) && ids.contains(good2.to_string().as_str()));
    assert_eq!(
        msgs.iter().filter(|m| m.id() == bad.to_string()).count(),
        0,
        "forged row published"
    );
}

cdc_only! {
    "CDC only: the slot's WAL retention; poll mode has no slot";
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_database_does_not_hold_back_the_slot() {
        let env = TestEnv::new("idle").await;
        let _relay = env.relay(&[], &[]);
        env.wait_streaming().await;
        env.enqueue("i-1", json!({})).await;
        env.wait_count(
            "the only receipt",
            "SELECT count(*) FROM outbox.receipts",
            1,
        )
        .await;
        // From here on no outbox event is written. Everything up to the WAL position now must be
        // confirmed, or the slot would retain WAL forever on an idle database.
        let l0: String = env
            .db
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        let slot = env.slot.clone();
        wait_for(
            "slot confirmed_flush_lsn to pass the idle WAL position",
            LONG,
            || async {
                let row = env
                    .db
                    .query_one(
                        "SELECT confirmed_flush_lsn >= $2::text::pg_lsn, confirmed_flush_lsn::text
                     FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot, &l0],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                if row.get::<_, bool>(0) {
                    Ok(())
                } else {
                    Err(format!("confirmed {} < {l0}", row.get::<_, String>(1)))
                }
            },
        )
        .await;
    }
}
