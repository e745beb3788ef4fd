//! Least privilege and secrets: the relay runs as the role `docs/least_privilege.sql` creates
//! (REPLICATION, read the outbox, write the ledger — nothing else), and a password given in
//! the database URL never appears in any line the binary prints, with debug logging on, on
//! success and on failure.

use outbox_testkit::wait::wait_for;
use serde_json::json;

use crate::harness::{outboxd, TestEnv, LONG};

const LEAST_PRIVILEGE_SQL: &str = include_str!("../../docs/least_privilege.sql");

cdc_only! {
    "CDC only: counts the role's walsenders; poll mode opens none";
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relay_runs_as_the_least_privilege_role() {
        let mut env = TestEnv::new("least_privilege").await;
        env.db
            .batch_execute(LEAST_PRIVILEGE_SQL)
            .await
            .expect("docs/least_privilege.sql");
        // Idempotent: a second run changes nothing and fails on nothing.
        env.db.batch_execute(LEAST_PRIVILEGE_SQL).await.unwrap();
        let relay_url = env.url.replacen("postgres@", "outboxd_relay@", 1);

        // The role has exactly what it needs: check passes (exit 0) as that role.
        let (ok, out) = outboxd(&[
            "check",
            "--database-url",
            &relay_url,
            "--bootstrap-servers",
            env.kafka.bootstrap_servers(),
            "--slot",
            &env.slot,
        ]);
        assert!(ok, "check as outboxd_relay: {out}");
        assert!(!out.contains("FAIL"), "{out}");

        // Events committed before and after the relay starts (snapshot and stream).
        let before = env.enqueue("a-1", json!({"n": 1})).await;
        env.url = relay_url.clone();
        let _relay = env.relay(&[], &[]);
        env.wait_streaming().await;
        let after = env.enqueue("a-2", json!({"n": 2})).await;
        env.wait_count(
            "receipts written by the least-privilege relay",
            "SELECT count(*) FROM outbox.receipts",
            2,
        )
        .await;
        let ids: Vec<String> = env
            .read_topic()
            .await
            .iter()
            .map(|m| m.id().to_string())
            .collect();
        assert!(ids.contains(&before.to_string()) && ids.contains(&after.to_string()));
        // This database's walsenders only: the role is cluster-wide, and other tests run relays as
        // it in their own databases of the shared cluster at the same time.
        assert_eq!(
            env.count(
                "SELECT count(*) FROM pg_stat_replication r JOIN pg_stat_activity a USING (pid)
                 WHERE r.usename = 'outboxd_relay' AND a.datname = current_database()"
            )
            .await,
            1,
            "the walsender is not the least-privilege role's"
        );
        wait_for("the checkpoint to move", LONG, || async {
            let n = env
                .count("SELECT count(*) FROM outbox.checkpoints WHERE confirmed_lsn > consistent_point")
                .await;
            if n > 0 {
                Ok(())
            } else {
                Err("no checkpoint yet".to_string())
            }
        })
        .await;

        // And nothing more: it cannot alter or invent events, nor reroute them.
        let relay_db = crate::harness::connect(&relay_url).await;
        for sql in [
            "UPDATE outbox.events SET payload = '{}'",
            "DELETE FROM outbox.events",
            "INSERT INTO outbox.route_policy (topic) VALUES ('elsewhere')",
            "UPDATE outbox.aggregate_versions SET last_version = 0",
        ] {
            let err = relay_db.batch_execute(sql).await.unwrap_err();
            assert_eq!(
                err.code().map(|c| c.code()),
                Some("42501"),
                "{sql}: expected permission denied, got {err}"
            );
        }
    }
}

e2e_only! {
    use std::process::{Command, Stdio};
    use std::time::Duration;

    /// `outboxd ARGS` with trace logging of every target, stdout and stderr to files.
    struct Traced {
        child: std::process::Child,
        _dir: tempfile::TempDir,
        out: std::path::PathBuf,
        err: std::path::PathBuf,
    }

    impl Traced {
        fn spawn(args: &[&str]) -> Traced {
            let dir = tempfile::tempdir().unwrap();
            let (out, err) = (dir.path().join("out"), dir.path().join("err"));
            let child = Command::new(env!("CARGO_BIN_EXE_outboxd"))
                .args(args)
                .env_remove("OUTBOXD_DATABASE_URL")
                .env("OUTBOXD_LOG", "trace")
                .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
                .stderr(Stdio::from(std::fs::File::create(&err).unwrap()))
                .spawn()
                .expect("spawn outboxd");
            Traced {
                child,
                _dir: dir,
                out,
                err,
            }
        }

        /// SIGTERM if still running, wait, and return stdout + stderr.
        fn finish(mut self, timeout: Duration) -> String {
            let deadline = std::time::Instant::now() + timeout;
            let mut termed = false;
            while self.child.try_wait().unwrap().is_none() {
                if std::time::Instant::now() > deadline && !termed {
                    // SAFETY: plain kill(2) on our own child's pid.
                    unsafe {
                        libc::kill(self.child.id() as i32, libc::SIGTERM);
                    }
                    termed = true;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            format!(
                "{}{}",
                std::fs::read_to_string(&self.out).unwrap_or_default(),
                std::fs::read_to_string(&self.err).unwrap_or_default()
            )
        }
    }
}

e2e_only! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn database_password_never_appears_in_output() {
        let env = TestEnv::new("secrets").await;
        // The shared cluster authenticates this role with SCRAM (see outbox-testkit), so the
        // password is really used by both the SQL and the replication connections.
        let password = format!("s3cret-{}", uuid::Uuid::new_v4().simple());
        env.db
            .batch_execute(&format!(
                "DO $$ BEGIN
                     IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outboxd_test_scram') THEN
                         CREATE ROLE outboxd_test_scram LOGIN;
                     END IF;
                 END $$;
                 ALTER ROLE outboxd_test_scram LOGIN SUPERUSER PASSWORD '{password}';"
            ))
            .await
            .unwrap();
        let url = env
            .url
            .replacen("postgres@", &format!("outboxd_test_scram:{password}@"), 1);
        let wrong = env
            .url
            .replacen("postgres@", &format!("outboxd_test_scram:{password}x@"), 1);

        // A relay that publishes (SCRAM on both connections), with trace logging, until the
        // receipt is in; then SIGTERM.
        env.enqueue("s-1", json!({"n": 1})).await;
        // A Kafka secret in the config file must not leak either (the mock broker speaks
        // plaintext, so librdkafka holds it without using it).
        let kafka_secret = format!("k4fka-{}", uuid::Uuid::new_v4().simple());
        let config = env.dir.path().join("secrets.toml");
        std::fs::write(
            &config,
            format!(
                "[kafka.properties]\n\"sasl.username\" = \"outboxd\"\n\"sasl.password\" = \"{kafka_secret}\"\n"
            ),
        )
        .unwrap();
        let relay = Traced::spawn(&[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--database-url",
            &url,
            "--bootstrap-servers",
            env.kafka.bootstrap_servers(),
            "--slot",
            &env.slot,
            "--heartbeat-interval-ms",
            "300",
            "--status-interval-ms",
            "100",
        ]);
        env.wait_count("the receipt", "SELECT count(*) FROM outbox.receipts", 1)
            .await;
        let run_output = tokio::task::spawn_blocking(move || relay.finish(Duration::ZERO))
            .await
            .unwrap();
        assert!(
            run_output.contains("streaming"),
            "the relay did not run: {run_output}"
        );

        let mut outputs = vec![("run", run_output)];
        // Failures print URLs in their messages: wrong password, unreachable server, bad option.
        let closed_port = env.url.replacen(
            "postgres@127.0.0.1",
            &format!("outboxd_test_scram:{password}@127.0.0.1"),
            1,
        );
        let closed_port = {
            let port_start = closed_port.rfind(':').unwrap() + 1;
            let port_end = closed_port[port_start..].find('/').unwrap() + port_start;
            format!(
                "{}1{}",
                &closed_port[..port_start],
                &closed_port[port_end..]
            )
        };
        for (name, args) in [
            (
                "run (wrong password)",
                vec![
                    "run",
                    "--database-url",
                    &wrong,
                    "--bootstrap-servers",
                    "127.0.0.1:1",
                ],
            ),
            (
                "run (no server)",
                vec![
                    "run",
                    "--database-url",
                    &closed_port,
                    "--bootstrap-servers",
                    "127.0.0.1:1",
                ],
            ),
            (
                "run (bad option)",
                vec![
                    "run",
                    "--database-url",
                    &format!("{url}?bogus=1"),
                    "--bootstrap-servers",
                    "127.0.0.1:1",
                ],
            ),
            (
                "check",
                vec![
                    "check",
                    "--database-url",
                    &url,
                    "--config",
                    config.to_str().unwrap(),
                ],
            ),
            (
                "check (wrong password)",
                vec!["check", "--database-url", &wrong],
            ),
            ("status", vec!["status", "--database-url", &url]),
            ("migrate", vec!["migrate", "--database-url", &url]),
        ] {
            let out = Traced::spawn(&args).finish(Duration::from_secs(30));
            outputs.push((name, out));
        }
        for (name, out) in &outputs {
            assert!(!out.is_empty(), "{name} printed nothing");
            let leaks = out
                .lines()
                .filter(|l| l.contains(&password) || l.contains(&kafka_secret))
                .count();
            assert_eq!(
                leaks, 0,
                "{name}: a secret appears in {leaks} line(s):\n{out}"
            );
        }
        // The failures did say what failed.
        let wrong_out = &outputs[1].1;
        assert!(
            wrong_out.contains("password authentication failed"),
            "{wrong_out}"
        );
    }
}

/// A privilege revoked while the relay runs is not a transient failure: no reconnect brings
/// it back. The relay stops with the SQLSTATE and the fix instead of replaying forever behind
/// a growing lag (the policy in `outbox_core::policy`), and the event it could not accept is
/// published once the grant is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_privilege_stops_the_relay_with_the_fix_and_loses_nothing() {
    let mut env = TestEnv::new("revoked_privilege").await;
    env.db.batch_execute(LEAST_PRIVILEGE_SQL).await.unwrap();
    env.url = env.url.replacen("postgres@", "outboxd_relay@", 1);
    let mut relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    env.warm_up("warm").await;

    env.db
        .batch_execute("REVOKE INSERT ON outbox.receipt_entries FROM outboxd_relay")
        .await
        .unwrap();
    let id = env.enqueue("after-revoke", json!({"n": 1})).await;
    let status = relay.wait_exit(LONG).await;
    let log = relay.log_text();
    assert!(!status.success(), "the relay exited cleanly: {log}");
    assert!(
        log.contains("SQLSTATE 42501") && log.contains("least_privilege.sql"),
        "the error names neither the SQLSTATE nor the fix:\n{log}"
    );
    assert!(
        !log.contains("replaying from the last checkpoint"),
        "the relay retried a permission error:\n{log}"
    );

    env.db.batch_execute(LEAST_PRIVILEGE_SQL).await.unwrap();
    let _relay = env.relay(&[], &[]);
    env.wait_count(
        "the event held back by the revoked privilege published",
        &format!("SELECT count(*) FROM outbox.receipts WHERE event_id = '{id}'"),
        1,
    )
    .await;
    env.verify_receipts(&[&env.topic]).await;
}

e2e_only! {
    /// The roles docs/least_privilege.sql describes: the relay's, and a poller's (its example
    /// grants), created in the test's database.
    async fn least_privilege_roles(admin: &tokio_postgres::Client) {
        admin.batch_execute(LEAST_PRIVILEGE_SQL).await.unwrap();
        admin
            .batch_execute(
                "DO $$ BEGIN
                     IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'app_poller') THEN
                         CREATE ROLE app_poller LOGIN;
                     END IF;
                 EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
                 END $$;
                 GRANT USAGE ON SCHEMA outbox TO app_poller;
                 GRANT EXECUTE ON FUNCTION outbox.poller_may_claim(uuid) TO app_poller;",
            )
            .await
            .unwrap();
    }

    /// What a forger could have written: rows of every table an event, a receipt, a hold or a
    /// version lives in, and the registrations of capture tables and routes.
    const FORGEABLE: &[&str] = &[
        "outbox.events",
        "outbox.aggregate_versions",
        "outbox.receipts",
        "outbox.duplicate_receipts",
        "outbox.holds",
        "outbox.held_events",
        "outbox.legacy_events",
        "outbox.parked_events",
        "outbox.route_policy",
        "outbox.dispatch_shares",
        "outbox.poller_tables",
        "outbox.debezium_tables",
    ];

    async fn forgeable_counts(admin: &tokio_postgres::Client) -> Vec<(&'static str, i64)> {
        let mut counts = Vec::new();
        for t in FORGEABLE {
            // (outbox.debezium_tables is migration 0021's: absent from a database before it)
            let exists: bool = admin
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[t])
                .await
                .unwrap()
                .get(0);
            if !exists {
                continue;
            }
            let n: i64 = admin
                .query_one(&format!("SELECT count(*) FROM {t}"), &[])
                .await
                .unwrap_or_else(|e| panic!("counting {t}: {e}"))
                .get(0);
            counts.push((*t, n));
        }
        counts
    }

    /// Issue 33, finding 1: a limited role forged events, legacy records, versions and holds by
    /// putting the outbox's SECURITY DEFINER trigger functions on a TEMP table of its own. Each
    /// role of docs/least_privilege.sql now tries every function it can reach, and every try is
    /// refused; the trigger functions themselves refuse to fire on a table nobody registered for
    /// them; and a database migrated before the fix keeps its Debezium capture working.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn limited_roles_cannot_forge_events_receipts_holds_or_versions_through_functions() {
        let pg = outbox_testkit::postgres::TestPostgres::shared();
        let url = pg.create_database("forge").await.expect("create database");
        let (ok, out) = outboxd(&["migrate", "--database-url", &url]);
        assert!(ok, "migrate: {out}");
        let admin = crate::harness::connect(&url).await;
        least_privilege_roles(&admin).await;
        let before = forgeable_counts(&admin).await;

        // 1. As each role: every way through a function, each refused.
        let mut not_refused = Vec::new();
        for role in ["outboxd_relay", "app_poller"] {
            // Only outbox.poller_may_claim (granted to the poller) and the relay's
            // restore_aggregate_versions of all the functions that run with the owner's rights,
            // or as triggers, are executable by a limited role.
            let reachable: Vec<String> = admin
                .query(
                    "SELECT p.oid::regprocedure::text FROM pg_proc p
                     WHERE p.pronamespace = 'outbox'::regnamespace
                       AND (p.prosecdef OR p.prorettype = 'trigger'::regtype)
                       AND has_function_privilege($1, p.oid, 'EXECUTE')
                     ORDER BY 1",
                    &[&role],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            let expected: Vec<String> = match role {
                "app_poller" => vec!["outbox.poller_may_claim(uuid)".into()],
                // Poll mode's restore of the unlogged version table (migration 0032): it only
                // raises an aggregate's last version to what its rows and tombstones hold.
                _ => vec!["outbox.restore_aggregate_versions()".into()],
            };
            if reachable != expected {
                not_refused.push(format!(
                    "{role} may execute the owner's-rights/trigger functions {reachable:?} (expected {expected:?})"
                ));
            }

            let c = crate::harness::connect(&url.replacen("postgres@", &format!("{role}@"), 1)).await;
            c.batch_execute(
                "CREATE TEMP TABLE forge_dbz (id uuid, aggregatetype text, aggregateid text,
                                              type text, payload jsonb);
                 CREATE TEMP TABLE forge_row (event_id uuid, aggregate_type text, aggregate_id text,
                                              aggregate_version bigint, delivery_set_id uuid);",
            )
            .await
            .unwrap_or_else(|e| panic!("{role}: a TEMP table of its own: {e}"));
            // (statement, the SQLSTATEs that refuse it)
            let tries: &[(&str, &[&str])] = &[
                // An event through the Debezium capture trigger (the forge).
                (
                    "CREATE TRIGGER forge AFTER INSERT ON forge_dbz FOR EACH ROW EXECUTE FUNCTION
                     outbox.debezium_capture('id', 'aggregatetype', 'aggregateid', 'type', 'payload')",
                    &["42501"],
                ),
                // A legacy record (or an event, for a type outboxd owns) through the poller capture.
                (
                    "CREATE TRIGGER forge_poll AFTER INSERT ON forge_dbz FOR EACH ROW EXECUTE FUNCTION
                     outbox.poller_capture('id', 'aggregatetype', 'aggregateid', 'type', 'payload')",
                    &["42501"],
                ),
                // A version and a hold through the rows-around-enqueue trigger.
                (
                    "CREATE TRIGGER forge_version AFTER INSERT ON forge_row FOR EACH ROW
                     EXECUTE FUNCTION outbox.note_row_around_enqueue()",
                    &["42501"],
                ),
                // The install functions, on the role's own table.
                (
                    "SELECT outbox.install_debezium_capture('pg_temp.forge_dbz')",
                    &["42501", "42809"],
                ),
                (
                    "SELECT outbox.install_poller_capture('pg_temp.forge_dbz', 'true')",
                    &["42501"],
                ),
                // The producer and operator API, called directly.
                (
                    "SELECT outbox.enqueue('payment', 'p-1', 'payment.refunded', '{\"amount\": 100}')",
                    &["42501"],
                ),
                (
                    "SELECT outbox.enqueue_set('payment', 'p-1', 'payment.refunded', '{}', ARRAY['t'])",
                    &["42501"],
                ),
                ("SELECT outbox.enqueue_parked('payment', 'p-1')", &["42501"]),
                ("SELECT outbox.enqueue_all_parked()", &["42501"]),
                (
                    "SELECT outbox.unpark_to_poller('payment', 'p-1')",
                    &["42501"],
                ),
                (
                    "SELECT outbox.set_dispatch_owner('payment', 'outboxd')",
                    &["42501"],
                ),
                (
                    "SELECT outbox.set_route('payment', NULL, 'elsewhere')",
                    &["42501"],
                ),
                (
                    "SELECT outbox.set_nats_route('payment', NULL, 'nats', 'elsewhere.x')",
                    &["42501"],
                ),
                (
                    "SELECT outbox.set_http_route('payment', NULL, 'hook', 'http://attacker.invalid/')",
                    &["42501"],
                ),
            ];
            for (sql, codes) in tries {
                match c.batch_execute(sql).await {
                    Ok(()) => not_refused.push(format!("{role}: not refused: {sql}")),
                    Err(e) => {
                        let code = e.code().map(|c| c.code()).unwrap_or("none");
                        if !codes.contains(&code) {
                            not_refused.push(format!(
                                "{role}: {sql}: refused with {code} ({e:?}), expected one of {codes:?}"
                            ));
                        }
                    }
                }
            }
            // Rows that would fire whatever trigger a try above put in place.
            let id = uuid::Uuid::new_v4();
            let _ = c
                .batch_execute(&format!(
                    "INSERT INTO forge_dbz VALUES ('{id}', 'payment', 'p-1', 'payment.refunded',
                                                   '{{\"amount\": 100}}');
                     INSERT INTO forge_row VALUES ('{id}', 'payment', 'p-1', 1000000, NULL);"
                ))
                .await;
            // The poller has no ledger grant: not even a receipt or a hold written directly.
            if role == "app_poller" {
                for sql in [
                    format!(
                        "INSERT INTO outbox.receipts (event_id, broker_kind, broker_cluster, topic,
                             partition, \"offset\", payload_digest, destination_digest)
                         VALUES ('{id}', 'kafka', 'default', 't', 0, 0, 'x', 'x')"
                    ),
                    "INSERT INTO outbox.holds (aggregate_type, aggregate_id, reason_code, reason)
                     VALUES ('payment', 'p-1', 'forged', 'forged')"
                        .to_string(),
                ] {
                    match c.batch_execute(&sql).await {
                        Err(e) if e.code().map(|c| c.code()) == Some("42501") => {}
                        other => not_refused.push(format!("{role}: {sql}: {other:?}")),
                    }
                }
            }
        }
        let after = forgeable_counts(&admin).await;
        assert_eq!(
            after, before,
            "a limited role changed the outbox through a function; not refused: {not_refused:#?}"
        );
        assert!(not_refused.is_empty(), "{not_refused:#?}");

        // 2. Put on a table nobody registered for it (only the owner can now), each trigger
        // function refuses to fire; on the table it was registered for, it works.
        admin
            .batch_execute(
                "CREATE TABLE public.app_outbox (id uuid, aggregatetype text, aggregateid text,
                                                 type text, payload jsonb);
                 CREATE TABLE public.legacy_outbox (id uuid, aggregatetype text, aggregateid text,
                                                    type text, payload jsonb, published_at timestamptz);
                 CREATE TABLE public.other (id uuid, aggregatetype text, aggregateid text,
                                            type text, payload jsonb, event_id uuid,
                                            aggregate_type text, aggregate_id text,
                                            aggregate_version bigint, delivery_set_id uuid);
                 SELECT outbox.install_debezium_capture('public.app_outbox');
                 SELECT outbox.install_poller_capture('public.legacy_outbox', 'published_at IS NULL');",
            )
            .await
            .unwrap();
        admin
            .batch_execute(
                "INSERT INTO public.app_outbox VALUES (gen_random_uuid(), 'order', 'o-1', 'order.created', '{}');
                 INSERT INTO public.legacy_outbox VALUES (gen_random_uuid(), 'order', 'o-2', 'order.created', '{}', NULL);",
            )
            .await
            .expect("capture from the registered tables");
        let legit = [
            (
                "public.other",
                "outbox.debezium_capture('id', 'aggregatetype', 'aggregateid', 'type', 'payload')",
            ),
            (
                "public.other",
                "outbox.poller_capture('id', 'aggregatetype', 'aggregateid', 'type', 'payload')",
            ),
            ("public.other", "outbox.note_row_around_enqueue()"),
            // A registered table, other columns than registered: the payload read from the id.
            (
                "public.app_outbox",
                "outbox.debezium_capture('id', 'aggregatetype', 'aggregateid', 'type', 'id')",
            ),
            (
                "public.legacy_outbox",
                "outbox.poller_capture('id', 'aggregatetype', 'aggregateid', 'type', 'id')",
            ),
        ];
        for (table, function) in legit {
            admin
                .batch_execute(&format!(
                    "CREATE TRIGGER unregistered AFTER INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {function}"
                ))
                .await
                .unwrap();
            let columns = if table == "public.other" {
                "(id, aggregatetype, aggregateid, type, payload, event_id, aggregate_type, aggregate_id, aggregate_version)"
            } else {
                "(id, aggregatetype, aggregateid, type, payload)"
            };
            let values = if table == "public.other" {
                "(gen_random_uuid(), 'order', 'o-3', 'order.created', '{}', gen_random_uuid(), 'order', 'o-3', 1000000)"
            } else {
                "(gen_random_uuid(), 'order', 'o-3', 'order.created', '{}')"
            };
            let err = admin
                .batch_execute(&format!("INSERT INTO {table} {columns} VALUES {values}"))
                .await
                .expect_err(&format!("{function} fired on {table}, unregistered"));
            let db = err.as_db_error().expect("a database error");
            assert_eq!(db.code().code(), "42501", "{function} on {table}: {db:?}");
            let name = function.split('(').next().unwrap();
            assert!(
                db.message().contains(name)
                    && db.message().contains(table.trim_start_matches("public."))
                    && db.hint().is_some_and(|h| !h.is_empty()),
                "the refusal names neither the function nor the table, or gives no fix: {db:?}"
            );
            admin
                .batch_execute(&format!("DROP TRIGGER unregistered ON {table}"))
                .await
                .unwrap();
        }
        for (table, n) in [
            ("outbox.events", 1),
            ("outbox.legacy_events", 1),
            ("outbox.aggregate_versions", 1),
            ("outbox.holds", 0),
        ] {
            assert_eq!(
                admin
                    .query_one(&format!("SELECT count(*) FROM {table}"), &[])
                    .await
                    .unwrap()
                    .get::<_, i64>(0),
                n,
                "{table}: the registered captures' rows only"
            );
        }

        // 3. A database migrated before the fix, with a Debezium capture installed: the migration
        // records it, and its producers go on inserting.
        let old_url = pg.create_database("forge_upgrade").await.unwrap();
        let mut old = crate::harness::connect(&old_url).await;
        outbox_ledger::migrate::run_through(&mut old, 20)
            .await
            .unwrap_or_else(|e| panic!("migrating to 0020: {e}"));
        old.batch_execute(
            "CREATE TABLE public.app_outbox (event_id uuid, aggregatetype text, aggregateid text,
                                             type text, payload jsonb);
             SELECT outbox.install_debezium_capture('public.app_outbox', id_column => 'event_id');",
        )
        .await
        .unwrap();
        let (ok, out) = outboxd(&["migrate", "--database-url", &old_url]);
        assert!(ok, "migrate an existing database: {out}");
        old.batch_execute(
            "INSERT INTO public.app_outbox VALUES (gen_random_uuid(), 'order', 'o-1', 'order.created', '{}')",
        )
        .await
        .expect("the capture installed before the fix still captures");
        assert_eq!(
            old.query_one("SELECT count(*) FROM outbox.events", &[])
                .await
                .unwrap()
                .get::<_, i64>(0),
            1
        );
    }
}

e2e_only! {
    /// Issue 33, finding 5: `outboxd check --database-url 'postgres://qq:Leak?Me99@...'` printed
    /// the password (the redaction split at the `?` before finding the `@`). Passwords holding
    /// each URL delimiter, against a closed port: every command that prints the URL keeps them
    /// out, and still says where it could not connect.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn passwords_holding_url_delimiters_never_print() {
        for password in [
            "Leak?Me99",
            "Leak#Me99",
            "Leak/Me99",
            "Le@kMe99",
            "Leak%3FMe99",
        ] {
            let url = format!("postgres://qq:{password}@127.0.0.1:1/app?sslmode=disable");
            for cmd in ["check", "status", "migrate"] {
                let (ok, out) = outboxd(&[cmd, "--database-url", &url]);
                assert!(!ok, "{cmd} against a closed port succeeded: {out}");
                let leaks: Vec<&str> = out
                    .lines()
                    .filter(|l| l.contains(password) || l.contains("Me99"))
                    .collect();
                assert!(leaks.is_empty(), "{cmd} printed {password}: {leaks:#?}");
                assert!(out.contains("127.0.0.1:1"), "{cmd} names no server: {out}");
            }
        }
    }
}
