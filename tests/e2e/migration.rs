//! Explicit destination migration: proof first, never while UNKNOWN, a new envelope generation.

use serde_json::json;

use crate::harness::TestEnv;

fn migrate(args: &[&str]) -> (bool, String) {
    crate::harness::migrate_destination(args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undeliverable_event_is_migrated_only_with_proof_and_never_while_unknown() {
    let env = TestEnv::new("dest_migration").await;
    // Events of this aggregate type are frozen to a cluster this relay does not serve.
    env.db
        .query_one(
            "SELECT outbox.set_route($1, NULL, $2, 'legacy')",
            &[&env.aggregate_type, &env.topic],
        )
        .await
        .unwrap();
    let new_topic = format!("{}.new", env.topic);
    env.kafka.create_topic(&new_topic, 1).unwrap();
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    let ids = env
        .enqueue_together(&[("m", json!({"n": 1})), ("m", json!({"n": 2}))])
        .await;
    let (e1, e2) = (ids[0], ids[1]);
    env.wait_count(
        "e1 quarantined",
        "SELECT count(*) FROM outbox.quarantine WHERE reason_code = 'destination_not_served'",
        1,
    )
    .await;
    env.wait_count(
        "e2 held behind it",
        "SELECT count(*) FROM outbox.held_events",
        1,
    )
    .await;
    // e2's last attempt at the old target ended without proof.
    env.record_unknown_attempt(e2).await;

    let (e1s, e2s) = (e1.to_string(), e2.to_string());
    let (ok, out) = migrate(&[
        "--database-url",
        &env.url,
        "--event",
        &e1s,
        "--event",
        &e2s,
        "--topic",
        &new_topic,
        "--reason",
        "legacy cluster retired",
        "--by",
        "test",
    ]);
    assert!(!ok, "one event was refused: {out}");
    assert!(
        out.contains(&format!("migrated {e1s}")) && out.contains("never sent"),
        "{out}"
    );
    assert!(
        out.contains(&format!("refused {e2s}")) && out.contains("DISPATCH_UNKNOWN"),
        "{out}"
    );

    env.wait_count(
        "e1 published at the new destination",
        "SELECT count(*) FROM outbox.receipts",
        1,
    )
    .await;
    // Once reconciled (absent), e2 can move too, with a scan of the old target as proof.
    env.db
        .execute(
            "UPDATE outbox.attempts SET state = 'ABSENT', resolved_at = clock_timestamp()",
            &[],
        )
        .await
        .unwrap();
    let (ok, out) = migrate(&[
        "--database-url",
        &env.url,
        "--event",
        &e2s,
        "--topic",
        &new_topic,
        "--reason",
        "legacy cluster retired",
        "--old-bootstrap-servers",
        env.kafka.bootstrap_servers(),
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("absent from"), "{out}");
    env.wait_count("e2 published", "SELECT count(*) FROM outbox.receipts", 2)
        .await;

    let moved = env.read_topic_of(&new_topic).await;
    let versions: Vec<&str> = moved
        .iter()
        .map(|m| m.headers["aggregate_version"].as_str())
        .collect();
    assert_eq!(versions, vec!["1", "2"], "in version order");
    assert!(moved
        .iter()
        .all(|m| m.headers["envelope_generation"] == "2"));
    assert_eq!(
        env.read_topic().await.len(),
        0,
        "nothing ever reached the old destination"
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.receipts WHERE topic = '{new_topic}'"
        ))
        .await,
        2
    );
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.destination_migrations")
            .await,
        2
    );

    let (ok, out) = migrate(&[
        "--database-url",
        &env.url,
        "--event",
        &e1s,
        "--topic",
        &env.topic,
        "--reason",
        "again",
    ]);
    assert!(!ok && out.contains("already published"), "{out}");
}

e2e_only! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kafka_scan_is_never_taken_as_proof_for_a_nats_destination() {
        let env = TestEnv::new("dest_migration_nats").await;
        env.db
            .query_one(
                "SELECT outbox.set_nats_route($1, NULL, 'nats-old')",
                &[&env.aggregate_type],
            )
            .await
            .unwrap();
        let id = env.enqueue("n", json!({"n": 1})).await.to_string();
        // The old subject does not exist as a Kafka topic, so a Kafka scan would find nothing;
        // that must not count as proof that the NATS stream lacks the event.
        let (ok, out) = migrate(&[
            "--database-url",
            &env.url,
            "--event",
            &id,
            "--topic",
            &env.topic,
            "--reason",
            "leaving nats",
            "--old-bootstrap-servers",
            env.kafka.bootstrap_servers(),
        ]);
        assert!(
            !ok && out.contains("cannot prove") && out.contains("nats"),
            "{out}"
        );
        assert_eq!(
            env.count("SELECT count(*) FROM outbox.destination_migrations")
                .await,
            0,
            "migrated on a Kafka scan of a NATS subject"
        );
    }
}
