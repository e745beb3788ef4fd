//! The read-only admin console over the PostgreSQL wire protocol, asked with the real psql.

use std::process::Command;

use serde_json::json;

use crate::harness::{TestEnv, LONG};
use crate::observability::insert_corrupt_copy;
use outbox_testkit::wait::wait_for;

const PSQL: &str = "/usr/bin/psql";

/// Runs `psql -h 127.0.0.1 -p PORT [extra] -c SQL` (unaligned, tuples only, `|` between
/// fields); returns success and stdout + stderr.
fn psql(port: u16, password: Option<&str>, extra: &[&str], sql: &str) -> (bool, String) {
    let mut cmd = Command::new(PSQL);
    cmd.args([
        "-h",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-X",
        "-At",
        "-F",
        "|",
    ])
    .args(extra)
    .args(["-c", sql])
    .env_remove("PGPASSWORD")
    .env_remove("PGUSER")
    .env_remove("PGDATABASE")
    .env("PGCONNECT_TIMEOUT", "10");
    if let Some(p) = password {
        cmd.env("PGPASSWORD", p);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {PSQL}: {e} (the console tests need psql)"));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn rows(out: &str) -> Vec<Vec<&str>> {
    out.lines().map(|l| l.split('|').collect()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_gets_rows_for_every_show_command_with_a_password() {
    if crate::harness::cdc_only(
        "console::psql_gets_rows_for_every_show_command_with_a_password",
        "expects the slot's rows in SHOW output",
    ) {
        return;
    }
    let env = TestEnv::new("console").await;
    let port = outbox_testkit::postgres::free_port().unwrap();
    let port_arg = port.to_string();
    // A bare port binds 127.0.0.1; the password comes from the environment.
    let _relay = env.relay(
        &[("OUTBOXD_CONSOLE_PASSWORD", "s3cret-console")],
        &["--console-addr", &port_arg, "--sample-interval-ms", "100"],
    );
    env.wait_streaming().await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(env.enqueue("c-1", json!({"i": i})).await);
    }
    env.wait_count("receipts", "SELECT count(*) FROM outbox.receipts", 3)
        .await;
    // Something for SHOW QUARANTINE (a corrupt row: quarantined, its aggregate held) and for
    // SHOW UNKNOWN (an attempt whose outcome nobody knows).
    let corrupt = insert_corrupt_copy(&env, ids[0], 4).await;
    env.wait_count(
        "the quarantine",
        "SELECT count(*) FROM outbox.quarantine",
        1,
    )
    .await;
    let unknown = uuid::Uuid::now_v7();
    env.record_unknown_attempt(unknown).await;

    let user = ["-U", "outboxd", "-d", "outboxd"];
    let pw = Some("s3cret-console");
    let ask = |sql: &str| {
        let (ok, out) = psql(port, pw, &user, sql);
        assert!(ok, "{sql}: {out}");
        out
    };

    let status = ask("SHOW STATUS");
    let kv: std::collections::HashMap<&str, &str> = rows(&status)
        .into_iter()
        .filter(|r| r.len() == 2)
        .map(|r| (r[0], r[1]))
        .collect();
    assert_eq!(kv.get("slot"), Some(&env.slot.as_str()), "{status}");
    assert_eq!(kv.get("published"), Some(&"3"), "{status}");
    assert_eq!(kv.get("quarantined"), Some(&"1"), "{status}");
    assert_eq!(kv.get("unknown_attempts"), Some(&"1"), "{status}");
    assert_eq!(kv.get("streaming"), Some(&"true"), "{status}");

    let lag = ask("show lag;");
    assert!(
        rows(&lag).iter().any(|r| r[0] == env.slot && r.len() == 9),
        "{lag}"
    );

    let q = ask("SHOW QUARANTINE");
    let q_rows = rows(&q);
    assert!(
        q_rows
            .iter()
            .any(|r| r[0] == "quarantined" && r[1] == corrupt.to_string()),
        "{q}"
    );
    assert!(q_rows.iter().any(|r| r[0].starts_with("held")), "{q}");

    let u = ask("SHOW UNKNOWN");
    assert!(
        rows(&u)
            .iter()
            .any(|r| r[0] == unknown.to_string() && r[4] == env.topic),
        "{u}"
    );

    let r = ask(&format!("SHOW RECEIPT '{}'", ids[1]));
    let r_rows = rows(&r);
    assert_eq!(r_rows.len(), 1, "{r}");
    assert_eq!(
        &r_rows[0][..5],
        &[
            ids[1].to_string().as_str(),
            "PUBLISHED",
            "primary",
            "default",
            env.topic.as_str()
        ],
        "{r}"
    );

    // Read-only: anything else is refused, and says what is accepted.
    let (ok, out) = psql(port, pw, &user, "DELETE FROM outbox.receipts");
    assert!(!ok && out.contains("read-only"), "{out}");
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 3);
    // A wrong password or user is refused.
    let (ok, out) = psql(port, Some("wrong"), &user, "SHOW STATUS");
    assert!(!ok, "{out}");
    let (ok, out) = psql(port, pw, &["-U", "someone-else"], "SHOW STATUS");
    assert!(!ok, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_as_typed_by_an_operator_against_a_trusting_console() {
    let env = TestEnv::new("console_trust").await;
    let port = outbox_testkit::postgres::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let _relay = env.relay(&[], &["--console-addr", &addr]);
    env.wait_streaming().await;
    // Exactly `psql -h 127.0.0.1 -p <port> -c 'SHOW STATUS'` (default user and database,
    // sslmode=prefer: the console declines TLS and psql carries on).
    let out = wait_for("the console to answer", LONG, || async {
        let out = Command::new(PSQL)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-c",
                "SHOW STATUS",
            ])
            .env_remove("PGPASSWORD")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(text)
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    })
    .await;
    assert!(
        out.contains("streaming") && out.contains(&env.slot),
        "{out}"
    );
    println!("{out}"); // shown with --nocapture: what an operator sees
    for sql in ["SHOW LAG", "SHOW UNKNOWN", "SHOW QUARANTINE", "SHOW HELP"] {
        let (ok, out) = psql(port, None, &[], sql);
        assert!(ok, "{sql}: {out}");
    }
}
