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

cdc_only! {
    "CDC only: expects the slot's rows in SHOW output";
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn psql_gets_rows_for_every_show_command_with_a_password() {
        let env = TestEnv::new("console").await;
        let port = outbox_testkit::ports::free_port().unwrap();
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_as_typed_by_an_operator_against_a_trusting_console() {
    let env = TestEnv::new("console_trust").await;
    let port = outbox_testkit::ports::free_port().unwrap();
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

/// The relay's resident set size, bytes (`VmRSS` of `/proc/<pid>/status`).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/status: {e}"));
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status: {status}"));
    kb * 1024
}

/// Waits (up to 10 s) until the relay's log holds `line`.
async fn wait_log(log: &std::path::Path, line: &str) {
    wait_for(
        &format!("{line:?} in the relay's log"),
        std::time::Duration::from_secs(10),
        || async {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            if text.contains(line) {
                Ok(())
            } else {
                Err(text)
            }
        },
    )
    .await;
}

/// Waits (up to LONG) until a trusting console on `port` answers `SHOW HELP`.
async fn wait_console(port: u16) {
    wait_for("the console to answer", LONG, || async {
        let (ok, out) = psql(port, None, &["-U", "outboxd"], "SHOW HELP");
        if ok {
            Ok(())
        } else {
            Err(out)
        }
    })
    .await;
}

/// A startup packet (protocol 3.0) for `user`, as psql sends it.
fn startup_packet(user: &str) -> Vec<u8> {
    let mut body = 196_608u32.to_be_bytes().to_vec();
    for (k, v) in [("user", user), ("database", "outboxd")] {
        body.extend_from_slice(k.as_bytes());
        body.push(0);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut out = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

/// Reads until EOF or an error (a closed connection) or `deadline`; returns what was read and
/// whether the connection was closed by then.
fn read_until_closed(
    s: &mut std::net::TcpStream,
    deadline: std::time::Duration,
) -> (Vec<u8>, bool) {
    use std::io::Read;
    let start = std::time::Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            return (got, false);
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return (got, false)
            }
            Err(_) => return (got, true),
        }
    }
}

/// Issue 33, finding 3: a startup packet declaring 0x7fffffff bytes, followed by 64 MiB, on
/// two connections, made the relay buffer all of it before anyone logged in. Now the console
/// closes such a connection after its 8-byte header and the relay's memory does not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_startup_packet_is_refused_before_it_is_buffered() {
    let env = TestEnv::new("console_guard_size").await;
    let port = outbox_testkit::ports::free_port().unwrap();
    let port_arg = port.to_string();
    let relay = env.relay(&[], &["--console-addr", &port_arg]);
    wait_console(port).await;
    let pid = relay.pid();
    let before = rss_bytes(pid);

    const FLOOD: usize = 64 << 20;
    let floods: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                use std::io::Write;
                let start = std::time::Instant::now();
                let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                // A blocked write fails after this instead of hanging the test.
                s.set_write_timeout(Some(std::time::Duration::from_secs(20)))
                    .unwrap();
                let mut header = 0x7fff_ffffu32.to_be_bytes().to_vec();
                header.extend_from_slice(&196_608u32.to_be_bytes());
                let mut written = 0usize;
                let mut result = s.write_all(&header).map_err(|e| e.to_string());
                let chunk = vec![b'a'; 64 << 10];
                while result.is_ok() && written < FLOOD {
                    result = s.write_all(&chunk).map_err(|e| e.to_string());
                    if result.is_ok() {
                        written += chunk.len();
                    }
                }
                (written, result, start.elapsed())
            })
        })
        .collect();
    for f in floods {
        let (written, result, took) = f.join().unwrap();
        assert!(
            result.is_err() && written < FLOOD / 2,
            "the console took {written} bytes of a startup packet declaring 2 GiB ({result:?}) in {took:?}; it must close the connection after the header"
        );
        assert!(
            took < std::time::Duration::from_secs(15),
            "closed only after {took:?}"
        );
    }
    // Whatever the relay allocated for them would show now.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let after = rss_bytes(pid);
    let grew = after.saturating_sub(before);
    assert!(
        grew < 20 << 20,
        "the relay's RSS grew by {} MiB (from {} MiB to {} MiB) for two unauthenticated connections",
        grew >> 20,
        before >> 20,
        after >> 20
    );
    wait_log(&relay.log, "a startup packet declaring 2147483647 bytes").await;
    // The console still serves operators.
    let (ok, out) = psql(port, None, &["-U", "outboxd"], "SHOW HELP");
    assert!(ok, "{out}");
}

/// Finding 3: a connection limit (one more is told `too many connections` at once), a login
/// timeout (a connection that never authenticates is closed) and an idle timeout (a logged-in
/// connection that sends nothing is closed), each logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_limited_and_must_log_in_and_stay_busy() {
    use std::io::Write;
    use std::time::{Duration, Instant};
    let env = TestEnv::new("console_guard_limits").await;
    let port = outbox_testkit::ports::free_port().unwrap();
    let port_arg = port.to_string();
    let relay = env.relay(
        &[],
        &[
            "--console-addr",
            &port_arg,
            "--console-max-connections",
            "2",
            "--console-login-timeout-ms",
            "2000",
            "--console-idle-timeout-ms",
            "4000",
        ],
    );
    wait_console(port).await;
    // psql's connection gives its slot back once the console has seen it end.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let connect = || std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();

    // Two silent connections take both slots; a third is refused at once.
    let opened = Instant::now();
    let mut silent = [connect(), connect()];
    std::thread::sleep(Duration::from_millis(200)); // both accepted before the third
    let mut third = connect();
    let (got, closed) = read_until_closed(&mut third, Duration::from_secs(1));
    let text = String::from_utf8_lossy(&got);
    assert!(
        closed && text.contains("53300") && text.contains("too many"),
        "a third connection over a limit of 2 was not refused at once: closed={closed}, got {text:?}"
    );
    // The silent ones are closed by the login timeout: not before it, and soon after.
    for s in &mut silent {
        let (_, closed) = read_until_closed(s, Duration::from_secs(8));
        assert!(
            closed,
            "a connection that never authenticated is still open after {:?}",
            opened.elapsed()
        );
    }
    let took = opened.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(6),
        "closed after {took:?}, the login timeout is 2 s"
    );

    // A logged-in connection (trust) outlives the login timeout, and is closed when idle.
    let mut s = connect();
    s.write_all(&startup_packet("outboxd")).unwrap();
    let logged_in = Instant::now();
    let (got, closed) = read_until_closed(&mut s, Duration::from_secs(3));
    assert!(
        !closed && got.contains(&b'Z'),
        "the login did not finish (ReadyForQuery): closed={closed}, got {:?}",
        String::from_utf8_lossy(&got)
    );
    let (_, closed) = read_until_closed(&mut s, Duration::from_secs(8));
    let idle = logged_in.elapsed();
    assert!(
        closed && idle >= Duration::from_millis(3500) && idle < Duration::from_secs(9),
        "an idle session: closed={closed} after {idle:?}, the idle timeout is 4 s"
    );

    // Each is logged (the line follows the close: wait for it).
    for line in [
        "all connection slots are taken",
        "not authenticated within 2000 ms",
        "idle for 4 s",
    ] {
        wait_log(&relay.log, line).await;
    }
    // The slots are free again.
    let (ok, out) = psql(port, None, &["-U", "outboxd"], "SHOW STATUS");
    assert!(ok, "{out}");
}

/// Finding 7: a webhook URL is an HTTP event's topic, and may hold credentials; the console
/// shows it (and an error quoting it) without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_never_shows_credentials_of_a_destination_url() {
    let env = TestEnv::new("console_redact").await;
    let port = outbox_testkit::ports::free_port().unwrap();
    let port_arg = port.to_string();
    let _relay = env.relay(&[], &["--console-addr", &port_arg]);
    wait_console(port).await;
    let url = "https://hook:Hunter2-s3cr3t@hooks.internal/orders?token=tok-s3cr3t&v=1";
    let unknown = uuid::Uuid::now_v7();
    env.db
        .execute(
            "INSERT INTO outbox.attempts (event_id, relay_generation, attempt_generation, slot_name,
                                          topic, partition, sent_at, error)
             VALUES ($1, 0, 1, $2, $3, 0, clock_timestamp(), $4)",
            &[
                &unknown,
                &env.slot,
                &url,
                &format!("POST {url}: operation timed out"),
            ],
        )
        .await
        .expect("record an UNKNOWN attempt for a webhook");
    let (ok, out) = psql(port, None, &["-U", "outboxd"], "SHOW UNKNOWN");
    assert!(ok, "{out}");
    let row = rows(&out)
        .into_iter()
        .find(|r| r[0] == unknown.to_string())
        .unwrap_or_else(|| panic!("the attempt is not shown: {out}"))
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>();
    assert_eq!(row[4], "https://hook@hooks.internal/orders?v=1", "{out}");
    assert!(
        row[9].contains("POST https://hook@hooks.internal/orders?v=1: operation timed out"),
        "{out}"
    );
    assert!(
        !out.contains("Hunter2-s3cr3t") && !out.contains("tok-s3cr3t"),
        "the console printed a credential: {out}"
    );
}
