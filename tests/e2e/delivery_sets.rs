//! Delivery sets: one event at several destinations is a contract declared at enqueue, each
//! target with its own state and receipt and a completion rule — never a retry elsewhere.

use crate::harness::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_set_publishes_each_target_with_its_own_receipt_and_completes() {
    let env = TestEnv::new("delivery_set").await;
    let (a, b) = (format!("{}.a", env.topic), format!("{}.b", env.topic));
    env.kafka.create_topic(&a, 1).unwrap();
    env.kafka.create_topic(&b, 1).unwrap();
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;

    let set: uuid::Uuid = env
        .db
        .query_one(
            "SELECT outbox.enqueue_set($1, 'd-1', 'order.paid', '{\"amount\": 5}', ARRAY[$2, $3])",
            &[&env.aggregate_type, &a, &b],
        )
        .await
        .unwrap()
        .get(0);
    // A second set with one target on a cluster this relay does not serve.
    let partial: uuid::Uuid = env
        .db
        .query_one(
            "SELECT outbox.enqueue_set($1, 'd-2', 'order.paid', '{}', ARRAY[$2, $3], ARRAY['default', 'legacy'])",
            &[&env.aggregate_type, &a, &b],
        )
        .await
        .unwrap()
        .get(0);
    env.wait_count(
        "three member receipts",
        "SELECT count(*) FROM outbox.receipts",
        3,
    )
    .await;
    env.wait_count(
        "the unserved member quarantined",
        "SELECT count(*) FROM outbox.quarantine",
        1,
    )
    .await;

    let state = |id: uuid::Uuid| {
        let db = &env.db;
        async move {
            db.query_one(
                "SELECT state, published FROM outbox.delivery_set_status WHERE delivery_set_id = $1",
                &[&id],
            )
            .await
            .unwrap()
        }
    };
    let s = state(set).await;
    assert_eq!(
        (s.get::<_, String>(0).as_str(), s.get::<_, i64>(1)),
        ("COMPLETE", 2)
    );
    let s = state(partial).await;
    assert_eq!(
        (s.get::<_, String>(0).as_str(), s.get::<_, i64>(1)),
        ("PARTIAL", 1)
    );

    let on_a = env.read_topic_of(&a).await;
    let on_b = env.read_topic_of(&b).await;
    let set_s = set.to_string();
    let members_a: Vec<_> = on_a
        .iter()
        .filter(|m| m.headers.get("delivery_set_id") == Some(&set_s))
        .collect();
    let members_b: Vec<_> = on_b
        .iter()
        .filter(|m| m.headers.get("delivery_set_id") == Some(&set_s))
        .collect();
    assert_eq!(
        (members_a.len(), members_b.len()),
        (1, 1),
        "one copy per target"
    );
    assert_ne!(
        members_a[0].id(),
        members_b[0].id(),
        "each target has its own member event id"
    );
    assert_eq!(
        members_a[0].headers["aggregate_version"],
        members_b[0].headers["aggregate_version"]
    );
    // Each member's receipt names its own frozen target.
    let cross = env
        .count(
            "SELECT count(*) FROM outbox.receipts r JOIN outbox.events_frozen e USING (event_id)
             WHERE r.topic <> e.dest_topic",
        )
        .await;
    assert_eq!(cross, 0, "cross-destination receipts");
}
