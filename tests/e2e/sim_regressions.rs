//! Regressions for product bugs the deterministic simulator (`outbox-sim`) found, reproduced
//! against the real binary. docs/simulation.md lists each bug with the seed and trace.

use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use crate::harness::{migrate_destination, TestEnv};

/// outbox-sim `--mutant bug-poison-before-gate` (seed 1, trace 143): version 2 was refused by
/// the route check while version 1 was still in flight; the broker then rejected version 1.
/// The hold named version 2, so migrating version 1 never republished it: lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_behind_an_in_flight_rejection_keeps_the_earlier_event_as_the_blocker() {
    let env = TestEnv::new_mock(
        "sim_poison_gate",
        "inject a broker-side rejection on exactly one Produce request",
    )
    .await;
    let mock = env.kafka.mock_cluster().expect("mock cluster");
    let moved = format!("{}.moved", env.topic);
    env.kafka.create_topic(&moved, 1).unwrap();
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    // One transaction: v1 to the served cluster (the broker will reject it), then a route
    // change to a cluster no relay serves, then v2 (refused by the route check).
    let row = env
        .db
        .query_one(
            &format!(
                "WITH v1 AS (SELECT outbox.enqueue('{a}', 'o', 'x', '{{\"v\": 1}}') AS id),
                      r AS (SELECT outbox.set_route('{a}', NULL, 'elsewhere', 'retired') FROM v1),
                      v2 AS (SELECT outbox.enqueue('{a}', 'o', 'x', '{{\"v\": 2}}') AS id FROM r)
                 SELECT (SELECT id FROM v1)::text, (SELECT id FROM v2)::text",
                a = env.aggregate_type
            ),
            &[],
        )
        .await
        .unwrap();
    let (v1, v2): (String, String) = (row.get(0), row.get(1));
    env.wait_count(
        "version 1 quarantined by the broker's rejection",
        &format!("SELECT count(*) FROM outbox.quarantine WHERE event_id = '{v1}'"),
        1,
    )
    .await;
    env.wait_count(
        "version 2 held behind it",
        &format!("SELECT count(*) FROM outbox.held_events WHERE event_id = '{v2}'"),
        1,
    )
    .await;
    let blocking: String = env
        .db
        .query_one("SELECT blocking_event_id::text FROM outbox.holds", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(blocking, v1, "the hold names the earliest refused version");
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.quarantine WHERE event_id = '{v2}'"
        ))
        .await,
        0,
        "version 2 was never at the head of its aggregate, so it was not judged yet"
    );

    // Migrating version 1 republishes it; version 2 is then judged at the head and refused.
    let (ok, out) = migrate_destination(&[
        "--database-url",
        &env.url,
        "--event",
        &v1,
        "--topic",
        &moved,
        "--reason",
        "the original topic refuses it",
    ]);
    assert!(ok, "{out}");
    env.wait_count(
        "version 1 published after the migration",
        &format!("SELECT count(*) FROM outbox.receipts WHERE event_id = '{v1}'"),
        1,
    )
    .await;
    env.wait_count(
        "version 2 refused at the head",
        &format!(
            "SELECT count(*) FROM outbox.quarantine WHERE event_id = '{v2}'
               AND reason_code = 'destination_not_served' AND released_at IS NULL"
        ),
        1,
    )
    .await;
}

e2e_only! {
    /// outbox-sim `--mutant bug-migrate-replayable` (seed 1, traces 114 and 239): a migration
    /// recorded while the event's transaction was still ahead of the ledger checkpoint; a replay
    /// then sent the WAL row (frozen for the old destination) there — a cross-destination retry.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_migration_waits_until_the_checkpoint_has_passed_the_event() {
        let env = TestEnv::new("sim_replayable").await;
        let id = env.enqueue("m-1", serde_json::json!({"v": 1})).await;
        // The ledger state of a relay that quarantined the event but whose checkpoint is still
        // behind its transaction (an earlier event of the stream is unresolved).
        env.db
            .batch_execute(&format!(
                "INSERT INTO outbox.checkpoints (slot_name, publication, confirmed_lsn)
                     VALUES ('{s}', 'p', '0/1');
                 INSERT INTO outbox.quarantine (quarantine_key, event_id, reason_code, reason,
                                                commit_lsn, slot_name)
                     VALUES ('{id}', '{id}', 'destination_not_served', 'test',
                             pg_current_wal_lsn(), '{s}');",
                s = env.slot
            ))
            .await
            .unwrap();
        let migrate = || {
            crate::harness::outboxd(&[
                "migrate-destination",
                "--database-url",
                &env.url,
                "--event",
                &id.to_string(),
                "--topic",
                "elsewhere",
                "--reason",
                "test",
            ])
        };
        let (ok, out) = migrate();
        assert!(!ok && out.contains("checkpoint has not passed"), "{out}");
        assert_eq!(
            env.count("SELECT count(*) FROM outbox.destination_migrations")
                .await,
            0
        );
        env.db
            .execute(
                "UPDATE outbox.checkpoints SET confirmed_lsn = pg_current_wal_insert_lsn() WHERE slot_name = $1",
                &[&env.slot],
            )
            .await
            .unwrap();
        let (ok, out) = migrate();
        assert!(ok && out.contains("never sent"), "{out}");
    }
}
