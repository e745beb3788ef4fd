//! A team's three roles (issue 34): the application produces as a role granted
//! `outboxd_producer` (docs/producer_role.sql), the relay runs as `outboxd_relay`
//! (docs/least_privilege.sql), and an operator runs `status`, `reconcile`, `consumers`,
//! `share` and `purge` as a role granted `outboxd_operator` (docs/operator_role.sql), each
//! without a permission error; and a relay whose role cannot write its ledger refuses to start
//! before it sends anything.

use serde_json::json;

use crate::harness::{outboxd, TestEnv, LONG};

const RELAY_SQL: &str = include_str!("../../docs/least_privilege.sql");
const PRODUCER_SQL: &str = include_str!("../../docs/producer_role.sql");
const OPERATOR_SQL: &str = include_str!("../../docs/operator_role.sql");

/// A login role granted `group`; roles are cluster-wide, so a second run finds it.
async fn login_role(env: &TestEnv, name: &str, group: &str) -> String {
    env.db
        .batch_execute(&format!(
            "DO $$ BEGIN
                 IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{name}') THEN
                     CREATE ROLE {name} LOGIN;
                 END IF;
             EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
             END $$;
             GRANT {group} TO {name};"
        ))
        .await
        .unwrap_or_else(|e| panic!("creating role {name}: {e}"));
    env.url.replacen("postgres@", &format!("{name}@"), 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_relay_and_operator_roles_work_from_their_scripts_alone() {
    let mut env = TestEnv::new("three_roles").await;
    for (script, sql) in [
        ("docs/least_privilege.sql", RELAY_SQL),
        ("docs/producer_role.sql", PRODUCER_SQL),
        ("docs/operator_role.sql", OPERATOR_SQL),
    ] {
        // Twice: re-running a script is harmless.
        for _ in 0..2 {
            env.db
                .batch_execute(sql)
                .await
                .unwrap_or_else(|e| panic!("{script}: {e}"));
        }
    }
    let app_url = login_role(&env, "roles_app", "outboxd_producer").await;
    let ops_url = login_role(&env, "roles_ops", "outboxd_operator").await;
    let relay_url = env.url.replacen("postgres@", "outboxd_relay@", 1);

    // The application: events through outbox.enqueue (and a delivery set), nothing else.
    let app = crate::harness::connect(&app_url).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let id: uuid::Uuid = app
            .query_one(
                "SELECT outbox.enqueue($1, $2, 'test.happened', $3)",
                &[&env.aggregate_type, &format!("r-{i}"), &json!({"n": i})],
            )
            .await
            .unwrap_or_else(|e| panic!("enqueue as the producer role: {e}"))
            .get(0);
        ids.push(id);
    }
    for sql in [
        "SELECT count(*) FROM outbox.events",
        "UPDATE outbox.events SET payload = '{}'",
        "DELETE FROM outbox.events",
        "SELECT count(*) FROM outbox.receipts",
        "INSERT INTO outbox.route_policy (topic) VALUES ('elsewhere')",
    ] {
        let err = app.batch_execute(sql).await.unwrap_err();
        assert_eq!(
            err.code().map(|c| c.code()),
            Some("42501"),
            "the producer role may {sql}: {err}"
        );
    }

    // The relay, as its role: publishes all of them.
    env.url = relay_url.clone();
    let relay = env.relay(&[], &[]);
    env.wait_ready(&relay).await;
    env.wait_count(
        "receipts written by the relay's role",
        "SELECT count(*) FROM outbox.receipts",
        ids.len() as i64,
    )
    .await;
    let check = env.verify_receipts(&[&env.topic]).await;
    assert_eq!(
        check.checked,
        ids.len(),
        "every receipt checked on the broker"
    );

    // The operator: every command of the first hour, no permission error.
    let known = ids[0].to_string();
    let commands: Vec<Vec<&str>> = vec![
        vec!["status"],
        vec!["status", "--event", &known],
        vec!["status", "--event", "00000000-0000-0000-0000-000000000001"],
        vec!["consumers", "list"],
        vec!["share", "list"],
        vec!["purge", "--dry-run"],
        vec!["purge"],
        vec![
            "reconcile",
            "--bootstrap-servers",
            env.kafka.bootstrap_servers(),
        ],
    ];
    for args in &commands {
        let mut all = args.clone();
        all.extend(["--database-url", ops_url.as_str()]);
        let (ok, out) = outboxd(&all);
        assert!(
            !out.contains("permission denied") && !out.contains("42501"),
            "`outboxd {}` as the operator role hit a permission error:\n{out}",
            args.join(" ")
        );
        // An unknown event id is an error of its own (exit 1), not a permission one.
        let unknown = args.contains(&"00000000-0000-0000-0000-000000000001");
        assert_eq!(
            ok,
            !unknown,
            "`outboxd {}` as the operator role:\n{out}",
            args.join(" ")
        );
        if unknown {
            assert!(out.contains("not in the outbox"), "{out}");
        }
    }
    drop(relay);

    // A relay role that lost a ledger grant refuses to start, and sends nothing.
    env.db
        .batch_execute("REVOKE INSERT ON outbox.receipt_entries FROM outboxd_relay")
        .await
        .unwrap();
    let late = {
        let id: uuid::Uuid = app
            .query_one(
                "SELECT outbox.enqueue($1, 'r-late', 'test.happened', '{}')",
                &[&env.aggregate_type],
            )
            .await
            .unwrap()
            .get(0);
        id
    };
    let mut refused = env.relay(&[], &[]);
    let status = refused.wait_exit(LONG).await;
    let log = refused.log_text();
    env.db.batch_execute(RELAY_SQL).await.unwrap();
    assert!(
        !status.success(),
        "the relay started without INSERT on receipt entries:\n{log}"
    );
    assert!(
        log.contains("nothing was sent")
            && log.contains("GRANT INSERT ON outbox.receipt_entries TO outboxd_relay"),
        "the refusal does not name the missing grant:\n{log}"
    );
    let on_topic = env.read_topic().await;
    assert_eq!(
        on_topic
            .iter()
            .filter(|m| m.id() == late.to_string())
            .count(),
        0,
        "the refused relay published the late event"
    );
    assert_eq!(
        on_topic.len(),
        ids.len(),
        "the refused relay published something"
    );
}
