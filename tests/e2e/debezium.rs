//! Debezium-compatible mode: a producer written for Debezium's outbox event router (its own
//! table `id uuid, aggregatetype, aggregateid, type, payload jsonb`, insert then delete in the
//! business transaction) is relayed without a change, and consumers see what the router
//! would have sent: topic `outbox.event.<aggregatetype>`, key = aggregateid, header `id` = the
//! row's id, value = the payload.

use serde_json::json;

use crate::harness::{outboxd, TestEnv};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_style_table_lands_on_outbox_event_topic_with_id_header() {
    let env = TestEnv::new("debezium").await;
    // Roles are cluster-wide: one per test environment.
    let producer_role = format!("dbz_{}", env.aggregate_type);
    env.db
        .batch_execute(&format!(
            "CREATE SCHEMA app;
             CREATE TABLE app.outboxevent (
                 id            uuid PRIMARY KEY,
                 aggregatetype varchar(255) NOT NULL,
                 aggregateid   varchar(255) NOT NULL,
                 type          varchar(255) NOT NULL,
                 payload       jsonb,
                 traceparent   text
             );
             -- A producer role that may only write its own table, as with Debezium.
             CREATE ROLE {producer_role} LOGIN;
             GRANT USAGE ON SCHEMA app TO {producer_role};
             GRANT SELECT, INSERT, DELETE ON app.outboxevent TO {producer_role};"
        ))
        .await
        .unwrap();
    let (ok, out) = outboxd(&[
        "migrate",
        "--database-url",
        &env.url,
        "--debezium-table",
        "app.outboxevent",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("capturing inserts into app.outboxevent"),
        "{out}"
    );
    // A typo in the table name is an error that names it.
    let (ok, out) = outboxd(&[
        "migrate",
        "--database-url",
        &env.url,
        "--debezium-table",
        "app.no_such_table",
    ]);
    assert!(!ok && out.contains("no_such_table"), "{out}");

    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;

    let producer_url = env
        .url
        .replacen("postgres@", &format!("{producer_role}@"), 1);
    let mut producer = crate::harness::connect(&producer_url).await;
    let ids: Vec<uuid::Uuid> = (0..3).map(|_| uuid::Uuid::new_v4()).collect();
    let agg = &env.aggregate_type;
    let insert =
        "INSERT INTO app.outboxevent (id, aggregatetype, aggregateid, type, payload, traceparent)
                  VALUES ($1, $2, $3, $4, $5, $6)";
    let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    // Debezium's recommended pattern: insert and delete in the same transaction.
    let tx = producer.transaction().await.unwrap();
    for (i, id) in ids[..2].iter().enumerate() {
        let payload = json!({"order": i, "total": 10 * i});
        tx.execute(
            insert,
            &[id, agg, &"order-1", &"OrderCreated", &payload, &Some(trace)],
        )
        .await
        .unwrap();
        tx.execute("DELETE FROM app.outboxevent WHERE id = $1", &[id])
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    // A plain insert, kept in the table.
    producer
        .execute(
            insert,
            &[
                &ids[2],
                agg,
                &"order-2",
                &"OrderShipped",
                &json!({"order": 2}),
                &None::<&str>,
            ],
        )
        .await
        .unwrap();
    // A rolled-back insert: never published.
    let rolled_back = uuid::Uuid::new_v4();
    let tx = producer.transaction().await.unwrap();
    tx.execute(
        insert,
        &[
            &rolled_back,
            agg,
            &"order-3",
            &"OrderCreated",
            &json!({}),
            &None::<&str>,
        ],
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    // The same id inserted again (a retrying producer): still one event.
    producer
        .execute("DELETE FROM app.outboxevent WHERE id = $1", &[&ids[2]])
        .await
        .unwrap();
    producer
        .execute(
            insert,
            &[
                &ids[2],
                agg,
                &"order-2",
                &"OrderShipped",
                &json!({"order": 2}),
                &None::<&str>,
            ],
        )
        .await
        .unwrap();

    env.wait_count(
        "receipts of the captured rows",
        "SELECT count(*) FROM outbox.receipts",
        3,
    )
    .await;
    let msgs = env.read_topic().await;
    assert_eq!(env.topic, format!("outbox.event.{agg}"));
    assert_eq!(msgs.len(), 3, "{msgs:?}");
    for (i, id) in ids.iter().enumerate() {
        let m: Vec<_> = msgs.iter().filter(|m| m.id() == id.to_string()).collect();
        assert_eq!(m.len(), 1, "row {id} published {} times", m.len());
        let m = m[0];
        let (key, ty) = if i < 2 {
            ("order-1", "OrderCreated")
        } else {
            ("order-2", "OrderShipped")
        };
        assert_eq!(m.key.as_deref(), Some(key));
        assert_eq!(m.headers.get("event_type").map(String::as_str), Some(ty));
        let payload: serde_json::Value =
            serde_json::from_str(m.payload.as_deref().unwrap()).unwrap();
        let expected = if i < 2 {
            json!({"order": i, "total": 10 * i})
        } else {
            json!({"order": 2})
        };
        assert_eq!(payload, expected);
        let tp = m.headers.get("traceparent").map(String::as_str);
        assert_eq!(tp, if i < 2 { Some(trace) } else { None });
    }
    assert_eq!(
        msgs.iter()
            .filter(|m| m.id() == rolled_back.to_string())
            .count(),
        0,
        "a rolled-back row was published"
    );
    // Same aggregate, commit order = version order (the ordering guarantees apply).
    let versions: Vec<String> = ids[..2]
        .iter()
        .map(|id| {
            msgs.iter()
                .find(|m| m.id() == id.to_string())
                .unwrap()
                .headers["aggregate_version"]
                .clone()
        })
        .collect();
    assert_eq!(versions, vec!["1".to_string(), "2".to_string()]);
    // The producer's own table behaves as before: deleted rows are gone, the kept one is there.
    assert_eq!(env.count("SELECT count(*) FROM app.outboxevent").await, 1);
}
