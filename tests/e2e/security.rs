//! Least privilege and secrets: the relay runs as the role `docs/least_privilege.sql` creates
//! (REPLICATION, read the outbox, write the ledger — nothing else), and a password given in
//! the database URL never appears in any line the binary prints, with debug logging on, on
//! success and on failure.

use std::process::{Command, Stdio};
use std::time::Duration;

use outbox_testkit::wait::wait_for;
use serde_json::json;

use crate::harness::{outboxd, TestEnv, LONG};

const LEAST_PRIVILEGE_SQL: &str = include_str!("../../docs/least_privilege.sql");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_runs_as_the_least_privilege_role() {
    if crate::harness::cdc_only(
        "security::relay_runs_as_the_least_privilege_role",
        "counts the role's walsenders; poll mode opens none",
    ) {
        return;
    }
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
        .batch_execute("REVOKE INSERT ON outbox.receipts FROM outboxd_relay")
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
