//! `/metrics`, `/healthz`, `/readyz` on `--admin-addr`, and `--log-format json`.

use std::io::{Read, Write};
use std::time::Duration;

use serde_json::json;

use crate::harness::{TestEnv, LONG};
use outbox_testkit::wait::wait_for;

/// The families docs/operations.md promises.
const FAMILIES: &[&str] = &[
    "outboxd_replication_lag_bytes",
    "outboxd_slot_retained_wal_bytes",
    "outboxd_oldest_pending_age_seconds",
    "outboxd_events_accepted_total",
    "outboxd_commit_to_receipt_seconds",
    "outboxd_in_flight_events",
    "outboxd_unknown_attempts",
    "outboxd_oldest_unknown_age_seconds",
    "outboxd_quarantined_events",
    "outboxd_held_aggregates",
    "outboxd_held_events",
    "outboxd_duplicate_receipts_total",
    "outboxd_reconnects_total",
    "outboxd_lease_generation",
];

/// GET `path` on 127.0.0.1:`port`: status and body, or `None` if nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// The sum of the samples of `series` in `text`: a name, optionally with labels
/// (`name{k="v"}`) that a sample must carry among its own (it may have more, such as
/// `database`).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    let (name, want) = match series.split_once('{') {
        Some((n, l)) => (n, l.trim_end_matches('}')),
        None => (series, ""),
    };
    let want: Vec<&str> = want.split(',').filter(|l| !l.is_empty()).collect();
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (head, value) = l.rsplit_once(' ')?;
            let (n, labels) = match head.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}')),
                None => (head, ""),
            };
            let have: Vec<&str> = labels.split(',').collect();
            (n == name && want.iter().all(|w| have.contains(w)))
                .then(|| value.trim().parse().ok())
                .flatten()
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

pub(crate) async fn scrape(port: u16) -> String {
    let (status, body) = tokio::task::spawn_blocking(move || http_get(port, "/metrics"))
        .await
        .unwrap()
        .expect("/metrics answers");
    assert_eq!(status, 200, "{body}");
    body
}

/// Waits until `/readyz` answers `want` (200 or 503); returns its body.
async fn wait_ready(port: u16, want: u16, what: &str) -> String {
    wait_ready_with(port, want, what, |_| true).await
}

/// Waits until `/readyz` answers `want` with a body that `body_ok` accepts; returns the body.
pub(crate) async fn wait_ready_with(
    port: u16,
    want: u16,
    what: &str,
    body_ok: impl Fn(&str) -> bool,
) -> String {
    let body_ok = &body_ok;
    wait_for(what, LONG, || async move {
        match tokio::task::spawn_blocking(move || http_get(port, "/readyz"))
            .await
            .unwrap()
        {
            Some((s, body)) if s == want && body_ok(&body) => Ok(body),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

fn admin_args(port: &str) -> Vec<&str> {
    vec!["--admin-addr", port, "--sample-interval-ms", "100"]
}

/// Inserts a copy of `of`'s row as version `version` of its aggregate with a payload digest
/// that does not match: the relay quarantines it and holds the aggregate.
pub async fn insert_corrupt_copy(env: &TestEnv, of: uuid::Uuid, version: i64) -> uuid::Uuid {
    env.insert_copy(of, version, true)
        .await
        .expect("insert a corrupt copy")
}

cdc_only! {
    "CDC only: asserts the slot's metrics (lag, retained WAL)";
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn metrics_move_with_the_workload_and_logs_are_json_with_the_slot() {
        let env = TestEnv::new("metrics").await;
        let port = outbox_testkit::ports::free_port().unwrap();
        let addr = format!("127.0.0.1:{port}");
        let mut args = admin_args(&addr);
        args.extend(["--log-format", "json"]);
        let mut relay = env.relay(&[], &args);
        wait_ready(port, 200, "/readyz to report ready").await;
        assert_eq!(
            tokio::task::spawn_blocking(move || http_get(port, "/healthz"))
                .await
                .unwrap()
                .map(|r| r.0),
            Some(200)
        );

        let lag_series = format!("outboxd_replication_lag_bytes{{slot=\"{}\"}}", env.slot);
        // The slot gauges exist once the sampler has seen the slot.
        let before = wait_for("the first slot sample", LONG, || async {
            let text = scrape(port).await;
            match sample(&text, &lag_series) {
                Some(_) => Ok(text),
                None => Err("no lag sample yet".into()),
            }
        })
        .await;
        for f in FAMILIES {
            assert!(
                before.contains(&format!("# TYPE {f} ")),
                "{f} missing:\n{before}"
            );
        }
        let retained_series = format!("outboxd_slot_retained_wal_bytes{{slot=\"{}\"}}", env.slot);
        assert!(sample(&before, &retained_series).is_some(), "{before}");
        let generation = format!("outboxd_lease_generation{{slot=\"{}\"}}", env.slot);
        assert!(
            sample(&before, &generation).is_some_and(|g| g >= 1.0),
            "{before}"
        );
        let accepted0 = sample(&before, "outboxd_events_accepted_total").unwrap();
        let latency0 = sample(&before, "outboxd_commit_to_receipt_seconds_count").unwrap();
        let checkpoint0 = sample(&before, "outboxd_checkpoint_lsn").unwrap();

        const N: usize = 25;
        let mut first = None;
        for i in 0..N {
            let id = env.enqueue(&format!("m-{}", i % 5), json!({"i": i})).await;
            first.get_or_insert(id);
        }
        env.wait_count(
            "the receipts",
            "SELECT count(*) FROM outbox.receipts",
            N as i64,
        )
        .await;
        // The counter moves when the acceptance transaction has committed; wait for it to get
        // there, then it must be exactly there (no double counting).
        let after = wait_for("the accepted counter", LONG, || async {
            let text = scrape(port).await;
            let a = sample(&text, "outboxd_events_accepted_total").unwrap();
            if a >= accepted0 + N as f64 {
                Ok(text)
            } else {
                Err(format!("{a}"))
            }
        })
        .await;
        assert_eq!(
            sample(&after, "outboxd_events_accepted_total").unwrap() - accepted0,
            N as f64,
            "accepted counter moved by exactly the number of events"
        );
        assert!(
            sample(&after, "outboxd_commit_to_receipt_seconds_count").unwrap() - latency0 >= N as f64,
            "every streamed receipt observed a latency:\n{after}"
        );
        assert!(sample(&after, "outboxd_checkpoint_lsn").unwrap() > checkpoint0);
        assert!(sample(&after, "outboxd_duplicate_receipts_total").is_some());

        // Sampled gauges move too: a quarantined event and its held aggregate.
        // Version 6 follows the aggregate's 5 events, so the copy reaches the head of its aggregate,
        // where the digest is checked (a gap would hold it before any check).
        let corrupt = insert_corrupt_copy(&env, first.unwrap(), 6).await;
        wait_for("the quarantine and hold gauges", LONG, || async {
            let text = scrape(port).await;
            match (
                sample(&text, "outboxd_quarantined_events"),
                sample(&text, "outboxd_held_aggregates"),
            ) {
                (Some(q), Some(h)) if q == 1.0 && h == 1.0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
        relay.assert_running();

        // --log-format json: every line is a JSON object; the relay's lines carry the slot.
        let log = relay.log_text();
        let mut with_slot = 0;
        let mut quarantine_line = None;
        for line in log.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
            if v["span"]["slot"] == env.slot.as_str() {
                with_slot += 1;
            }
            if v["fields"]["event_id"] == corrupt.to_string().as_str() {
                quarantine_line = Some(v);
            }
        }
        assert!(with_slot > 0, "no log line carries the slot span:\n{log}");
        // The quarantine is logged with the event id, inside the relay span (slot, resume LSN).
        let q = quarantine_line.unwrap_or_else(|| panic!("no line names event {corrupt}:\n{log}"));
        assert_eq!(q["span"]["slot"], env.slot.as_str(), "{q}");
        assert!(
            q["span"]["start_lsn"]
                .as_str()
                .is_some_and(|l| l.contains('/')),
            "{q}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_flips_when_the_broker_or_the_database_goes_away_and_back() {
    let env = TestEnv::new_mock("readyz", "take the only broker down and up on demand").await;
    let mock = env.kafka.mock_cluster().expect("mock cluster");
    let port = outbox_testkit::ports::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut relay = env.relay(&[], &admin_args(&addr));
    wait_ready(port, 200, "/readyz to report ready").await;

    // The broker goes away, and comes back.
    mock.broker_down(1).unwrap();
    let body = wait_ready(port, 503, "/readyz to report the broker away").await;
    assert!(body.contains("broker not reachable"), "{body}");
    mock.broker_up(1).unwrap();
    wait_ready(port, 200, "/readyz to recover with the broker").await;

    // The database goes away: it refuses connections and the relay's sessions (walsender
    // included) are terminated. Done from another database (PostgreSQL refuses to disallow
    // connections to the current one).
    let me = env
        .db
        .query_one("SELECT current_database(), pg_backend_pid()", &[])
        .await
        .unwrap();
    let (db, test_pid): (String, i32) = (me.get(0), me.get(1));
    let admin =
        crate::harness::connect(&outbox_testkit::postgres::TestPostgres::shared().url("postgres"))
            .await;
    admin
        .batch_execute(&format!("ALTER DATABASE \"{db}\" ALLOW_CONNECTIONS false"))
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = $1 AND pid <> $2",
            &[&db, &test_pid],
        )
        .await
        .unwrap();
    let body = wait_ready(port, 503, "/readyz to report the database away").await;
    assert!(body.contains("not streaming"), "{body}");
    relay.assert_running();

    admin
        .batch_execute(&format!("ALTER DATABASE \"{db}\" ALLOW_CONNECTIONS true"))
        .await
        .unwrap();
    wait_ready(port, 200, "/readyz to recover with the database").await;
    // And it relays again.
    let c = crate::harness::connect(&env.url).await;
    c.query_one(
        "SELECT outbox.enqueue($1, 'r-1', 'test.happened', '{}')",
        &[&env.aggregate_type],
    )
    .await
    .unwrap();
    env.wait_count(
        "the receipt after the outage",
        "SELECT count(*) FROM outbox.receipts",
        1,
    )
    .await;
    let text = scrape(port).await;
    assert!(
        sample(&text, "outboxd_reconnects_total").unwrap() >= 1.0,
        "{text}"
    );
    relay.assert_running();
}

#[test]
fn admin_settings_that_cannot_work_are_refused_with_the_fix() {
    let base = [
        "run",
        "--database-url",
        "postgres://u:pw@127.0.0.1:1/db",
        "--bootstrap-servers",
        "127.0.0.1:9",
    ];
    // A console reachable from other hosts without a password.
    let mut args = base.to_vec();
    args.extend(["--console-addr", "0.0.0.0:6433"]);
    let (ok, out) = crate::harness::outboxd(&args);
    assert!(!ok && out.contains("OUTBOXD_CONSOLE_PASSWORD"), "{out}");
    // A taken port is named, before the relay starts.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let mut args = base.to_vec();
    args.extend(["--admin-addr", &addr]);
    let (ok, out) = crate::harness::outboxd(&args);
    assert!(
        !ok && out.contains("cannot listen on") && out.contains(&addr),
        "{out}"
    );
    // A misspelt key in [admin] is named.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("outboxd.toml");
    std::fs::write(&cfg, "[admin]\nport = 9187\n").unwrap();
    let mut args = base.to_vec();
    args.extend(["--config", cfg.to_str().unwrap()]);
    let (ok, out) = crate::harness::outboxd(&args);
    assert!(!ok && out.contains("port"), "{out}");
}
