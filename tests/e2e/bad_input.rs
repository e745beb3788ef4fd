//! Bad input gets one line that names the problem and the fix.

use std::process::Command;

use crate::harness::TestEnv;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .env_remove("OUTBOXD_DATABASE_URL")
        .env_remove("OUTBOXD_BOOTSTRAP_SERVERS")
        .output()
        .expect("run outboxd");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let last = stderr
        .lines()
        .rfind(|l| l.starts_with("outboxd: error:") || l.starts_with("error:"))
        .unwrap_or("")
        .to_string();
    (
        out.status.success(),
        if last.is_empty() { stderr } else { last },
    )
}

#[test]
fn unreachable_database_is_named() {
    let port = outbox_testkit::ports::free_port().unwrap();
    let url = format!("postgres://postgres:secret-pw@127.0.0.1:{port}/app");
    let (ok, err) = run(&[
        "run",
        "--database-url",
        &url,
        "--bootstrap-servers",
        "127.0.0.1:9",
    ]);
    assert!(!ok);
    assert!(
        err.contains("cannot connect to PostgreSQL") && err.contains(&port.to_string()),
        "{err}"
    );
    assert!(!err.contains("secret-pw"), "password leaked: {err}");
}

#[test]
fn missing_settings_and_unknown_config_keys_are_named() {
    let (ok, err) = run(&["run", "--bootstrap-servers", "x:1"]);
    assert!(
        !ok && err.contains("--database-url") && err.contains("OUTBOXD_DATABASE_URL"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("outboxd.toml");
    std::fs::write(
        &cfg,
        "database_url = \"postgres://h/db\"\n[kafka]\nbootstrap = \"x:1\"\n",
    )
    .unwrap();
    let (ok, err) = run(&["run", "--config", cfg.to_str().unwrap()]);
    assert!(
        !ok && err.contains("bootstrap") && err.contains("outboxd.toml"),
        "{err}"
    );

    let (ok, err) = run(&[
        "run",
        "--database-url",
        "postgres://h/db",
        "--bootstrap-servers",
        "x:1",
        "--kafka-property",
        "acks=1",
    ]);
    assert!(!ok && err.contains("acks"), "{err}");

    let (ok, err) = run(&[
        "run",
        "--database-url",
        "postgres://h/db",
        "--bootstrap-servers",
        "x:1",
        "--slot",
        "Bad-Name",
    ]);
    assert!(!ok && err.contains("slot"), "{err}");
}

/// A binary started on a schema older than its own migrations (the operator upgraded the
/// binary and forgot `outboxd migrate`) stops before it sends anything, saying where the schema
/// is, what it needs and the command; an unmigrated database is named the same way.
#[tokio::test]
async fn a_schema_behind_the_binary_is_named_with_the_migrate_command() {
    let env = TestEnv::new("bad_input_schema").await;
    let pg = outbox_testkit::postgres::TestPostgres::shared();
    let latest = outbox_ledger::migrate::latest();
    let behind = pg.create_database("bad_input_behind").await.unwrap();
    let mut c = crate::harness::connect(&behind).await;
    outbox_ledger::migrate::run_through(&mut c, latest - 1)
        .await
        .unwrap();
    let bare = pg.create_database("bad_input_bare").await.unwrap();
    for (url, at) in [
        (&behind, format!("at migration {}", latest - 1)),
        (&bare, "not migrated".to_string()),
    ] {
        // With a deadline: a relay that does not refuse would stream on.
        let mut child = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["run", "--database-url", url, "--bootstrap-servers"])
            .arg(env.kafka.bootstrap_servers())
            .args(["--slot", &env.slot])
            .env_remove("OUTBOXD_DATABASE_URL")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run outboxd");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                panic!("the relay kept running for 60 s on a schema {at}");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "the relay ran on a schema {at}");
        assert!(
            err.contains(&format!("schema outbox is {at}"))
                && err.contains(&format!("needs migration {latest}"))
                && err.contains("outboxd migrate"),
            "{err}"
        );
    }
    // Nothing was created for a slot the relay never started.
    let slots: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&env.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_broker_and_missing_replication_privilege_are_named() {
    let env = TestEnv::new("bad_input").await;
    let port = outbox_testkit::ports::free_port().unwrap();
    let (ok, err) = run(&[
        "run",
        "--database-url",
        &env.url,
        "--bootstrap-servers",
        &format!("127.0.0.1:{port}"),
        "--slot",
        &env.slot,
    ]);
    assert!(!ok);
    assert!(
        err.contains("cannot reach Kafka") && err.contains(&port.to_string()),
        "{err}"
    );

    let role = format!("norepl_{}", std::process::id());
    env.db
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN;
             GRANT USAGE ON SCHEMA outbox TO {role}; GRANT SELECT ON ALL TABLES IN SCHEMA outbox TO {role};"
        ))
        .await
        .unwrap();
    let url = env
        .url
        .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    let (ok, err) = run(&[
        "run",
        "--database-url",
        &url,
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
        "--slot",
        &env.slot,
    ]);
    assert!(!ok);
    assert!(err.contains("REPLICATION"), "{err}");
}

fn replica_only_url() -> String {
    crate::harness::replica_only_cluster().url("postgres")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_wal_level_is_named_with_the_fix() {
    let url = replica_only_url();
    let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    tokio::spawn(conn);
    let level: String = c.query_one("SHOW wal_level", &[]).await.unwrap().get(0);
    assert_eq!(level, "replica", "the cluster this test needs");
    let (ok, err) = run(&[
        "run",
        "--database-url",
        &url,
        "--bootstrap-servers",
        "127.0.0.1:9",
    ]);
    assert!(!ok);
    assert!(
        err.contains("wal_level") && err.contains("ALTER SYSTEM SET wal_level = logical"),
        "{err}"
    );
}

fn check(args: &[&str]) -> (bool, String) {
    crate::harness::outboxd(&[&["check"], args].concat())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_passes_a_ready_setup_and_names_each_problem_with_its_fix() {
    let env = TestEnv::new("check").await;
    let (ok, out) = check(&[
        "--database-url",
        &env.url,
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
        "--slot",
        &env.slot,
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("ok    wal_level") && out.contains("ok    kafka"),
        "{out}"
    );

    let role = format!("nocheck_{}", std::process::id());
    env.db
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN;"
        ))
        .await
        .unwrap();
    let url = env
        .url
        .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    let (ok, out) = check(&["--database-url", &url]);
    assert!(!ok);
    assert!(
        out.contains("FAIL  REPLICATION privilege")
            && out.contains(&format!("ALTER ROLE {role} REPLICATION")),
        "{out}"
    );
    assert!(out.contains("GRANT USAGE ON SCHEMA outbox"), "{out}");

    let (ok, out) = check(&["--database-url", &replica_only_url()]);
    assert!(!ok, "check passed with wal_level = replica: {out}");
    assert!(
        out.contains("FAIL  wal_level") && out.contains("ALTER SYSTEM SET wal_level = logical"),
        "{out}"
    );
}

/// `check` proves the relay may read the topics it publishes to: an UNKNOWN outcome is
/// resolved by reading the event's partition, which needs READ and DESCRIBE besides WRITE. On
/// Apache Kafka with the test's events published it reads them; on a broker that refuses the
/// reads (librdkafka's mock cluster answering TOPIC_AUTHORIZATION_FAILED, as ACLs would: the
/// harness's Apache Kafka runs without authentication) it fails and names the grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_proves_the_relay_may_read_its_topics_and_names_the_grant_when_it_may_not() {
    let env = TestEnv::new("check_reads").await;
    let relay = env.relay(&[], &[]);
    env.wait_ready(&relay).await;
    // Twelve keys: partition 0 of the three gets some of them.
    for a in 0..12 {
        env.enqueue(&format!("a{a}"), serde_json::json!({"n": a}))
            .await;
    }
    env.every_event_published(12).await;
    let bootstrap = ["--bootstrap-servers", env.kafka.bootstrap_servers()];
    let (ok, out) = check(
        &[
            &["--database-url", &env.url, "--slot", &env.slot],
            &bootstrap[..],
        ]
        .concat(),
    );
    assert!(ok, "{out}");
    assert!(
        out.contains("ok    reads") && out.contains("the relay can read"),
        "{out}"
    );

    let env = TestEnv::new_mock(
        "check_reads_denied",
        "a broker whose ACLs refuse the relay's reads (the harness's Apache Kafka has no authentication)",
    )
    .await;
    env.enqueue("a0", serde_json::json!({})).await;
    env.kafka.mock_cluster().expect("mock").request_errors(
        rdkafka::types::RDKafkaApiKey::ListOffsets,
        &[rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 500],
    );
    let bootstrap = ["--bootstrap-servers", env.kafka.bootstrap_servers()];
    let (ok, out) = check(
        &[
            &["--database-url", &env.url, "--slot", &env.slot],
            &bootstrap[..],
        ]
        .concat(),
    );
    assert!(!ok, "check passed with its reads refused: {out}");
    assert!(
        out.contains("FAIL  reads")
            && out.contains(&format!(
                "grant the relay's principal READ and DESCRIBE on topic {}",
                env.topic
            )),
        "{out}"
    );
}

/// The rest of what `check` covers: config values (not only keys), librdkafka properties,
/// ledger privileges of a REPLICATION role without grants (with the exact GRANTs), the
/// publication a non-owner cannot create, and topics that do not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_config_privilege_publication_and_topic_problems() {
    let env = TestEnv::new("check_more").await;
    let dir = tempfile::tempdir().unwrap();
    let bad_value = dir.path().join("bad_value.toml");
    std::fs::write(&bad_value, "[relay]\nbatch_size = 0\n").unwrap();
    let (ok, out) = check(&[
        "--database-url",
        &env.url,
        "--config",
        bad_value.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        out.contains("FAIL  config") && out.contains("relay.batch_size must be at least 1"),
        "{out}"
    );
    let bad_key = dir.path().join("bad_key.toml");
    std::fs::write(&bad_key, "[relay]\nbatch_sise = 10\n").unwrap();
    let (ok, out) = check(&[
        "--database-url",
        &env.url,
        "--config",
        bad_key.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        out.contains("FAIL  config file") && out.contains("batch_sise"),
        "{out}"
    );
    let bad_prop = dir.path().join("bad_prop.toml");
    std::fs::write(
        &bad_prop,
        "[kafka.properties]\n\"no.such.property\" = \"1\"\n",
    )
    .unwrap();
    let (ok, out) = check(&[
        "--database-url",
        &env.url,
        "--config",
        bad_prop.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        out.contains("FAIL  kafka properties") && out.contains("no.such.property"),
        "{out}"
    );

    // REPLICATION, but no grants on the ledger: each missing GRANT is spelled out.
    let role = format!("nogrants_{}", std::process::id());
    env.db
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN REPLICATION;
             GRANT USAGE ON SCHEMA outbox TO {role};
             GRANT SELECT ON outbox.schema_migrations, outbox.events TO {role};
             DROP PUBLICATION outbox_pub;"
        ))
        .await
        .unwrap();
    let url = env
        .url
        .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    let (ok, out) = check(&["--database-url", &url, "--slot", &env.slot]);
    assert!(!ok, "{out}");
    assert!(out.contains("ok    REPLICATION privilege"), "{out}");
    assert!(out.contains("ok    outbox privileges"), "{out}");
    assert!(
        out.contains("FAIL  ledger privileges")
            && out.contains(&format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.receipt_entries TO {role}"
            ))
            && out.contains(&format!("GRANT SELECT ON outbox.receipts TO {role}"))
            && out.contains(&format!(
                "GRANT USAGE ON SEQUENCE outbox.attempts_id_seq TO {role}"
            )),
        "{out}"
    );
    assert!(
        out.contains("FAIL  publication")
            && out.contains("CREATE PUBLICATION outbox_pub FOR TABLE outbox.events"),
        "{out}"
    );

    // A pending event whose topic the broker does not have.
    env.db
        .batch_execute(
            "CREATE PUBLICATION outbox_pub FOR TABLE outbox.events WITH (publish = 'insert')",
        )
        .await
        .unwrap();
    env.enqueue("t-1", serde_json::json!({})).await;
    env.db
        .execute(
            "SELECT outbox.enqueue('never_created_topic', 'x', 'e', '{}'::jsonb)",
            &[],
        )
        .await
        .unwrap();
    let (_, out) = check(&[
        "--database-url",
        &env.url,
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
        "--slot",
        &env.slot,
    ]);
    assert!(
        out.contains("topics")
            && out.contains("1 of 2 do not exist: outbox.event.never_created_topic"),
        "{out}"
    );
    // The publication was made without the route versions (migration 0031): its owner's
    // relay adds them at start; another role is told the statement to run.
    assert!(
        out.contains("WARN  route versions published")
            && out.contains("WARN  policy generations published")
            && out.contains("the relay adds it at start"),
        "{out}"
    );
    let (_, out) = check(&["--database-url", &url, "--slot", &env.slot]);
    assert!(
        out.contains("FAIL  route versions published")
            && out.contains("ALTER PUBLICATION outbox_pub ADD TABLE outbox.route_versions"),
        "{out}"
    );

    // The unlogged version table as a crash of the server leaves it (migration 0032).
    let (_, out) = check(&["--database-url", &env.url, "--slot", &env.slot]);
    assert!(out.contains("ok    version table"), "{out}");
    env.db
        .batch_execute("TRUNCATE outbox.aggregate_versions, outbox.aggregate_versions_intact")
        .await
        .unwrap();
    let (_, out) = check(&["--database-url", &env.url, "--slot", &env.slot]);
    assert!(
        out.contains("WARN  version table")
            && out.contains("SELECT outbox.restore_aggregate_versions()"),
        "{out}"
    );
    let (_, out) = check(&["--database-url", &env.url, "--mode", "poll"]);
    assert!(
        out.contains("FAIL  version table") && out.contains("poll mode cannot find pending events"),
        "{out}"
    );
}
