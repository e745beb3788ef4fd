//! The consumer recipe of docs/consumers.md followed in another language (issue 35): a Python
//! consumer (confluent-kafka, psycopg 3; tests/consumers/python/consumer.py) with its own
//! database, where docs/consumer_inbox.sql was installed, reads a topic that holds the relay's
//! duplicates, and is killed again and again inside its transaction and between its COMMIT and
//! its offset commit. Every committed event's effect happens once, in version order, none
//! skipped. With the recipe's order reversed (offset first) or without the inbox, the same
//! counters become non-zero.

use std::process::Command;

use serde_json::json;

use crate::harness::{connect, TestEnv};

const CONSUMER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/consumers/python/consumer.py"
);
const CONSUMER_SQL: &str = include_str!("../../docs/consumer_inbox.sql");

/// The Python interpreter with confluent-kafka and psycopg, or a failure naming the fix.
fn python() -> String {
    crate::harness::python_with(
        "confluent_kafka, psycopg",
        "confluent-kafka 'psycopg[binary]'",
    )
}

/// A topic of `n` committed events over ten aggregates, published by a relay that was killed
/// after a broker acknowledgement it had not accepted, so the replay put copies on the topic;
/// and the consumer's own database with the shipped inbox SQL and an effect table.
async fn published_with_duplicates(name: &str, n: usize) -> (TestEnv, String, usize) {
    let env = TestEnv::new(name).await;
    let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "after-broker-ack=abort@40")], &[]);
    env.wait_streaming().await;
    for chunk in (0..n).collect::<Vec<_>>().chunks(10) {
        let events: Vec<(String, serde_json::Value)> = chunk
            .iter()
            .map(|i| (format!("acct-{}", i % 10), json!({"i": i})))
            .collect();
        let refs: Vec<(&str, serde_json::Value)> = events
            .iter()
            .map(|(a, p)| (a.as_str(), p.clone()))
            .collect();
        env.enqueue_together(&refs).await;
    }
    let status = relay.wait_exit(crate::harness::LONG).await;
    assert!(
        !status.success() && relay.log_text().contains("failpoint after-broker-ack"),
        "the relay was to die at its 40th acknowledgement: {}",
        relay.log_text()
    );
    let _relay = env.restart_until_receipts(n as i64).await;
    let check = env.verify_receipts(&[&env.topic]).await;
    let receipts = env
        .count("SELECT (SELECT count(*) FROM outbox.receipts) + (SELECT count(*) FROM outbox.duplicate_receipts)")
        .await;
    assert_eq!(
        check.checked as i64, receipts,
        "every receipt, primary and duplicate, checked on the broker"
    );
    let copies = check.messages.len();
    assert!(
        copies > n,
        "the relay's replay put no duplicate on the topic ({copies} messages for {n} events): the consumers below would not meet one"
    );

    let pg = outbox_testkit::postgres::TestPostgres::shared();
    let app_url = pg
        .create_database(&format!("{name}_app"))
        .await
        .expect("the consumer's database");
    let app = connect(&app_url).await;
    app.batch_execute(CONSUMER_SQL)
        .await
        .expect("docs/consumer_inbox.sql in a database of its own");
    app.batch_execute(
        "CREATE TABLE effects (event_id uuid NOT NULL, aggregate_id text NOT NULL,
                               version bigint NOT NULL, seq bigserial)",
    )
    .await
    .unwrap();
    (env, app_url, copies)
}

/// One run of the Python consumer; its exit code: 0 (idle, done), 3 and 4 (its crash points),
/// 5 (it stopped at a version gap, policy reject).
fn run_consumer(python: &str, env: &TestEnv, app_url: &str, group: &str, extra: &[&str]) -> i32 {
    let out = Command::new(python)
        .arg(CONSUMER)
        .args([
            "--bootstrap",
            env.kafka.bootstrap_servers(),
            "--topic",
            &env.topic,
            "--group",
            group,
            "--db",
            app_url,
            "--consumer-id",
            "billing",
            "--idle-secs",
            "3",
        ])
        .args(extra)
        .output()
        .expect("run the Python consumer");
    let code = out.status.code().unwrap_or(-1);
    if ![0, 3, 4, 5].contains(&code) {
        panic!(
            "the Python consumer failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    code
}

/// Committed events whose effect did not happen exactly once, and pairs of one aggregate's
/// effects applied out of version order: both must be 0.
async fn violations(env: &TestEnv, app_url: &str) -> (i64, i64) {
    let app = connect(app_url).await;
    let committed: Vec<uuid::Uuid> = env
        .db
        .query("SELECT event_id FROM outbox.events", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let not_once: i64 = app
        .query_one(
            "SELECT count(*) FROM unnest($1::uuid[]) AS c(id)
             WHERE (SELECT count(*) FROM effects f WHERE f.event_id = c.id) <> 1",
            &[&committed],
        )
        .await
        .unwrap()
        .get(0);
    let out_of_order: i64 = app
        .query_one(
            "SELECT count(*) FROM effects a JOIN effects b
               ON a.aggregate_id = b.aggregate_id AND a.seq < b.seq AND a.version >= b.version",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    (not_once, out_of_order)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_consumer_following_the_doc_applies_each_event_once_in_order_through_crashes() {
    let python = python();
    const N: usize = 240;
    let (env, app_url, copies) = published_with_duplicates("py_recipe", N).await;
    let group = "py-recipe";
    // Each crash must meet a message: the run ends with the crash's own exit code, not with
    // an idle exit after the topic ran dry.
    for i in 0..6 {
        let at = (3 + 5 * i).to_string();
        assert_eq!(
            run_consumer(
                &python,
                &env,
                &app_url,
                group,
                &["--crash-after-commit", &at]
            ),
            4,
            "crash {i} after the COMMIT of message {at} did not happen"
        );
        let at = (2 + 4 * i).to_string();
        assert_eq!(
            run_consumer(&python, &env, &app_url, group, &["--crash-in-txn", &at]),
            3,
            "crash {i} inside the transaction of message {at} did not happen"
        );
    }
    assert_eq!(run_consumer(&python, &env, &app_url, group, &[]), 0);
    let (not_once, out_of_order) = violations(&env, &app_url).await;
    assert_eq!(not_once, 0, "committed events applied other than once");
    assert_eq!(out_of_order, 0, "effects applied out of version order");
    // What the consumer met: every copy on the topic is covered by its partition watermarks,
    // and the inbox holds each event once although the topic had more copies.
    let app = connect(&app_url).await;
    let inbox: i64 = app
        .query_one("SELECT count(*) FROM outbox.inbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(inbox, N as i64, "{copies} copies on the topic");
    let covered: i64 = app
        .query_one(
            "SELECT coalesce(sum(next_offset), 0)::int8 FROM outbox.consumer_watermarks",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        covered, copies as i64,
        "the partition watermarks cover every message of the topic"
    );
}

/// The planted bugs: the recipe's order reversed (offset committed before the transaction)
/// loses the event whose transaction dies; no inbox applies redelivered copies again. The
/// counters the test above asserts zero become non-zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counters_see_an_offset_committed_first_and_a_consumer_without_inbox() {
    let python = python();
    const N: usize = 60;
    let (env, app_url, _) = published_with_duplicates("py_recipe_bugs", N).await;
    assert_eq!(
        run_consumer(
            &python,
            &env,
            &app_url,
            "offset-first",
            &["--bug", "offset-first", "--crash-in-txn", "5"]
        ),
        3
    );
    // The event whose transaction died is gone from this consumer's view: its offset was
    // committed. The next of its aggregate meets a version gap (the inbox's second line of
    // defence stops there, exit 5) or, past it, the counter sees an event never applied.
    let code = run_consumer(
        &python,
        &env,
        &app_url,
        "offset-first",
        &["--bug", "offset-first"],
    );
    assert!(code == 0 || code == 5, "exit {code}");
    let (not_once, _) = violations(&env, &app_url).await;
    assert!(
        not_once >= 1,
        "offset committed before the transaction: the event whose transaction died is never applied, yet no violation was counted"
    );

    let (env, app_url, _) = published_with_duplicates("py_recipe_noinbox", N).await;
    assert_eq!(
        run_consumer(
            &python,
            &env,
            &app_url,
            "no-inbox",
            &["--bug", "no-inbox", "--crash-after-commit", "5"]
        ),
        4
    );
    assert_eq!(
        run_consumer(&python, &env, &app_url, "no-inbox", &["--bug", "no-inbox"]),
        0
    );
    let (not_once, _) = violations(&env, &app_url).await;
    assert!(
        not_once >= 1,
        "without the inbox the redelivered and replayed copies are applied again, yet no violation was counted"
    );
}
