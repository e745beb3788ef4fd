//! `outboxd reconcile`: each kind of finding it must report, its exit status (2 when anything
//! is found, 0 when all is well), and its JSON and Prometheus outputs.

use std::process::Command;

use serde_json::json;

use crate::harness::TestEnv;
use crate::inbox::{consumer, create_effects_table, effect_handler, next};

/// Runs `outboxd reconcile` against the test's database and broker with `extra` flags;
/// returns the exit code and stdout (stderr is appended when the run failed outright).
pub fn reconcile(env: &TestEnv, extra: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "reconcile",
            "--database-url",
            &env.url,
            "--bootstrap-servers",
            env.kafka.bootstrap_servers(),
        ])
        .args(extra)
        .env_remove("OUTBOXD_DATABASE_URL")
        .env_remove("OUTBOXD_BOOTSTRAP_SERVERS")
        .env_remove("OUTBOXD_CONFIG")
        .output()
        .expect("run outboxd reconcile");
    let code = out.status.code().unwrap_or(-1);
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    if code == 1 {
        text.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    (code, text)
}

/// `reconcile --json`: exit code and the parsed report.
pub fn reconcile_json(env: &TestEnv, extra: &[&str]) -> (i32, serde_json::Value) {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    let (code, text) = reconcile(env, &args);
    assert_ne!(code, 1, "reconcile failed: {text}");
    (
        code,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

fn produce_raw(env: &TestEnv, id: Option<&str>, payload: &str) {
    crate::harness::produce_raw(
        env.kafka.bootstrap_servers(),
        &env.topic,
        "rogue",
        id,
        payload,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_is_well_exits_zero_and_a_bypass_publish_is_reported() {
    let env = TestEnv::new("rec_bypass").await;
    create_effects_table(&env).await;
    env.db
        .execute(
            "SELECT outbox.register_consumer('ledger', true, ARRAY[$1])",
            &[&env.topic],
        )
        .await
        .unwrap();
    let _relay = env.relay(&[], &[]);
    for i in 0..3 {
        env.enqueue(&format!("o-{i}"), json!({"i": i})).await;
    }
    env.wait_count("receipts", "SELECT count(*) FROM outbox.receipts", 3)
        .await;
    let h = effect_handler();
    let mut c = consumer(&env, "ledger", None).await;
    let mut applied = 0;
    while applied < 3 {
        let p = next(&mut c, &h).await;
        applied += p.outcomes.iter().filter(|o| o.ran_handler()).count();
        c.commit(&p).unwrap();
    }

    let (code, text) = reconcile(&env, &["--pending-after", "0s", "--unconsumed-after", "0s"]);
    assert_eq!(code, 0, "all is well, yet: {text}");
    assert!(text.contains("all is well"), "{text}");

    // Someone publishes around the outbox: an unknown id, and no id at all.
    let rogue = uuid::Uuid::new_v4().to_string();
    produce_raw(&env, Some(&rogue), "{\"fake\": true}");
    produce_raw(&env, None, "{}");
    let (code, report) = reconcile_json(&env, &["--unconsumed-after", "0s"]);
    assert_eq!(code, 2, "{report:#}");
    assert_eq!(report["bypass"]["total"], 2, "{report:#}");
    let ids: Vec<&serde_json::Value> = report["bypass"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| &b["id"])
        .collect();
    assert!(ids.contains(&&json!(rogue)), "{report:#}");
    assert!(ids.contains(&&serde_json::Value::Null), "{report:#}");
    // The relay's own messages are not bypasses, and nothing else is reported.
    assert_eq!(report["broker"]["messages"], 5);
    for kind in ["aged_pending", "aged_unknown", "unconsumed", "conflicts"] {
        assert_eq!(report[kind]["total"], 0, "{kind}: {report:#}");
    }

    let (code, prom) = reconcile(&env, &["--format", "prometheus"]);
    assert_eq!(code, 2);
    assert!(
        prom.contains("outboxd_reconcile_findings{kind=\"bypass\"} 2"),
        "{prom}"
    );
    assert!(
        prom.contains("outboxd_reconcile_findings{kind=\"aged_pending\"} 0"),
        "{prom}"
    );
    assert!(prom.contains("# TYPE outboxd_reconcile_findings gauge"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_enqueued_while_the_relay_is_stopped_is_reported_as_aged_pending() {
    let env = TestEnv::new("rec_pending").await;
    let id = env.enqueue("o-1", json!({"late": true})).await;
    env.wait_count(
        "the event to be older than the threshold",
        "SELECT count(*) FROM outbox.events WHERE occurred_at < clock_timestamp() - interval '1 second'",
        1,
    )
    .await;
    let (code, report) = reconcile_json(&env, &["--pending-after", "1s"]);
    assert_eq!(code, 2, "{report:#}");
    assert_eq!(report["aged_pending"]["total"], 1);
    assert_eq!(
        report["aged_pending"]["items"][0]["event_id"],
        json!(id.to_string())
    );
    let (code, text) = reconcile(&env, &["--pending-after", "1s"]);
    assert_eq!(code, 2);
    assert!(text.contains(&id.to_string()), "{text}");

    // The relay publishes it: all is well again.
    let _relay = env.relay(&[], &[]);
    env.wait_count("the receipt", "SELECT count(*) FROM outbox.receipts", 1)
        .await;
    let (code, report) = reconcile_json(&env, &["--pending-after", "1s"]);
    assert_eq!(code, 0, "{report:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_no_mandatory_consumer_applied_is_reported() {
    let env = TestEnv::new("rec_unconsumed").await;
    create_effects_table(&env).await;
    env.db
        .batch_execute(&format!(
            "SELECT outbox.register_consumer('ledger', true, ARRAY['{t}']);
             SELECT outbox.register_consumer('analytics', false);
             SELECT outbox.register_consumer('elsewhere', true, ARRAY['some.other.topic']);",
            t = env.topic
        ))
        .await
        .unwrap();
    let _relay = env.relay(&[], &[]);
    let a = env.enqueue("o-1", json!({"n": 1})).await;
    let b = env.enqueue("o-2", json!({"n": 2})).await;
    env.wait_count("receipts", "SELECT count(*) FROM outbox.receipts", 2)
        .await;

    // `ledger` applies one of the two.
    let h = effect_handler();
    let mut c = consumer(&env, "ledger", None).await;
    let p = next(&mut c, &h).await;
    c.commit(&p).unwrap();
    let first = p.outcomes[0].receipt().unwrap().event_id;
    let missing = if first == a { b } else { a };

    let (code, report) = reconcile_json(&env, &["--unconsumed-after", "0s"]);
    assert_eq!(code, 2, "{report:#}");
    assert_eq!(report["unconsumed"]["total"], 1, "{report:#}");
    let item = &report["unconsumed"]["items"][0];
    assert_eq!(item["event_id"], json!(missing.to_string()));
    assert_eq!(item["consumer_id"], "ledger");
    // Within the threshold it is not a finding yet.
    let (code, report) = reconcile_json(&env, &["--unconsumed-after", "1h"]);
    assert_eq!(code, 0, "{report:#}");

    let p = next(&mut c, &h).await;
    c.commit(&p).unwrap();
    let (code, report) = reconcile_json(&env, &["--unconsumed-after", "0s"]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["consumers"].as_array().unwrap().len(), 3);
}

e2e_only! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn aged_unknown_and_a_second_payload_under_one_id_are_reported() {
        let env = TestEnv::new("rec_conflict").await;
        let id = env.enqueue("o-1", json!({"total": 1})).await;
        env.record_unknown_attempt(id).await;
        // Another copy of the same id with a different payload reaches the topic.
        produce_raw(&env, Some(&id.to_string()), "{\"total\": 1000}");
        env.wait_count(
            "the attempt to be older than the threshold",
            "SELECT count(*) FROM outbox.attempts WHERE unknown_at < clock_timestamp() - interval '1 second'",
            1,
        )
        .await;
        let (code, report) = reconcile_json(&env, &["--unknown-after", "1s"]);
        assert_eq!(code, 2, "{report:#}");
        assert_eq!(report["aged_unknown"]["total"], 1, "{report:#}");
        assert_eq!(
            report["aged_unknown"]["items"][0]["event_id"],
            json!(id.to_string())
        );
        assert_eq!(report["conflicts"]["total"], 1, "{report:#}");
        let c = &report["conflicts"]["broker"][0];
        assert_eq!(c["id"], json!(id.to_string()));
        assert!(
            c["detail"].as_str().unwrap().contains("payload differs"),
            "{report:#}"
        );
        assert_eq!(report["bypass"]["total"], 0, "{report:#}");
        // UNKNOWN is not PENDING: it is not reported twice.
        let (_, report) = reconcile_json(&env, &["--unknown-after", "1h", "--pending-after", "0s"]);
        assert_eq!(report["aged_pending"]["total"], 0, "{report:#}");
    }
}

/// The receipt audit: a clean ledger is proven against the topic; then a receipt moved past
/// the high watermark (what an implicit ack leaves: the ledger says published, the broker has
/// nothing there) is `receipt_missing`, and a receipt pointing at another event's message is
/// `receipt_mismatch`. The scopes audit all, a sample, or nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_audit_reports_a_missing_and_a_mismatched_receipt() {
    let env = TestEnv::new("rec_audit").await;
    let mut relay = env.relay(&[], &[]);
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(env.enqueue(&format!("o-{i}"), json!({"i": i})).await);
    }
    env.wait_count("receipts", "SELECT count(*) FROM outbox.receipts", 4)
        .await;

    let (code, report) = reconcile_json(&env, &["--audit-receipts", "all"]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["receipts"]["audited"], 4, "{report:#}");
    assert_eq!(report["receipts"]["performed"], true, "{report:#}");
    assert_eq!(report["receipt_missing"]["total"], 0, "{report:#}");
    assert_eq!(report["receipt_mismatch"]["total"], 0, "{report:#}");
    assert_eq!(report["broker"]["partitions"].as_array().unwrap().len(), 3);
    let (code, text) = reconcile(&env, &["--audit-receipts", "all"]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains(
            "receipts: 4 audited (scope all, cluster default), 0 expired, 0 not auditable (nats), 0 not auditable (http)"
        ),
        "{text}"
    );

    // Stop the relay, so that nothing but the planted rows changes.
    relay.signal(libc::SIGTERM);
    relay.wait_exit(crate::harness::LONG).await;

    let position = |id: uuid::Uuid| {
        let db = &env.db;
        async move {
            let r = db
                .query_one(
                    "SELECT partition, \"offset\" FROM outbox.receipts WHERE event_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            (r.get::<_, i32>(0), r.get::<_, i64>(1))
        }
    };
    let (missing, victim, other) = (ids[0], ids[1], ids[2]);
    let (missing_partition, missing_offset) = position(missing).await;
    let (victim_partition, victim_offset) = position(victim).await;
    let (other_partition, other_offset) = position(other).await;
    let high = env
        .read_topic()
        .await
        .iter()
        .filter(|m| m.partition == missing_partition)
        .map(|m| m.offset + 1)
        .max()
        .unwrap();
    // (a) A receipt at an offset where the partition has no message.
    env.db
        .execute(
            "UPDATE outbox.receipts SET \"offset\" = $2 WHERE event_id = $1",
            &[&missing, &(high + 100)],
        )
        .await
        .unwrap();
    // (b) A receipt at another event's message.
    env.db
        .execute(
            "UPDATE outbox.receipts SET partition = $2, \"offset\" = $3 WHERE event_id = $1",
            &[&victim, &other_partition, &other_offset],
        )
        .await
        .unwrap();
    // A correct duplicate receipt is audited too, and a NATS receipt is only counted.
    env.db
        .execute(
            "INSERT INTO outbox.duplicate_receipts (event_id, broker_kind, broker_cluster, topic,
                                                    partition, \"offset\")
             VALUES ($1, 'kafka', 'default', $2, $3, $4), ($1, 'nats', 'default', $2, 0, 1)",
            &[&other, &env.topic, &other_partition, &other_offset],
        )
        .await
        .unwrap();

    let (code, report) = reconcile_json(&env, &["--audit-receipts", "all"]);
    assert_eq!(code, 2, "{report:#}");
    assert_eq!(report["receipts"]["audited"], 5, "{report:#}");
    assert_eq!(report["receipts"]["not_auditable_nats"], 1, "{report:#}");
    assert_eq!(report["receipt_missing"]["total"], 1, "{report:#}");
    let m = &report["receipt_missing"]["items"][0];
    assert_eq!(m["event_id"], json!(missing.to_string()), "{report:#}");
    assert_eq!(m["kind"], "primary");
    assert_eq!(m["offset"], json!(high + 100));
    assert!(
        m["detail"].as_str().unwrap().contains("high watermark"),
        "{report:#}"
    );
    // Its message is still where the relay put it: the scan says so.
    assert_eq!(
        m["copies_elsewhere"],
        json!([format!(
            "{}/{missing_partition}@{missing_offset}",
            env.topic
        )]),
        "{report:#}"
    );
    assert_eq!(report["receipt_mismatch"]["total"], 1, "{report:#}");
    let m = &report["receipt_mismatch"]["items"][0];
    assert_eq!(m["event_id"], json!(victim.to_string()), "{report:#}");
    assert_eq!(m["kind"], "primary");
    assert!(
        m["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("has id {other}")),
        "{report:#}"
    );
    assert_eq!(
        m["copies_elsewhere"],
        json!([format!("{}/{victim_partition}@{victim_offset}", env.topic)]),
        "{report:#}"
    );
    // Nothing else is reported: the messages themselves are all the outbox's.
    for kind in [
        "aged_pending",
        "aged_unknown",
        "unconsumed",
        "bypass",
        "conflicts",
    ] {
        assert_eq!(report[kind]["total"], 0, "{kind}: {report:#}");
    }

    let (code, text) = reconcile(&env, &["--audit-receipts", "all"]);
    assert_eq!(code, 2, "{text}");
    let line = |kind: &str, id: uuid::Uuid| {
        text.lines()
            .any(|l| l.starts_with(kind) && l.contains(&format!("primary {id}")))
    };
    assert!(line("receipt_missing", missing), "{text}");
    assert!(line("receipt_mismatch", victim), "{text}");
    assert!(
        text.contains(
            "receipts: 5 audited (scope all, cluster default), 0 expired, 1 not auditable (nats), 0 not auditable (http)"
        ),
        "{text}"
    );

    // The default scope (receipts of the last 24h) sees them too.
    let (code, prom) = reconcile(&env, &["--format", "prometheus"]);
    assert_eq!(code, 2, "{prom}");
    for line in [
        "outboxd_reconcile_findings{kind=\"receipt_missing\"} 1",
        "outboxd_reconcile_findings{kind=\"receipt_mismatch\"} 1",
        "outboxd_reconcile_receipts_audited 5",
        "# TYPE outboxd_reconcile_receipts_audited gauge",
    ] {
        assert!(prom.contains(line), "{line}: {prom}");
    }

    let (_, report) = reconcile_json(&env, &["--audit-receipts", "sample=1"]);
    assert_eq!(report["receipts"]["audited"], 1, "{report:#}");
    assert_eq!(report["receipts"]["scope"], "sample=1", "{report:#}");
    let (code, report) = reconcile_json(&env, &["--audit-receipts", "none"]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["receipts"]["audited"], 0, "{report:#}");
    assert_eq!(report["receipts"]["performed"], false, "{report:#}");
    let (code, text) = reconcile(&env, &["--no-broker"]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("receipts: not audited (--no-broker"),
        "{text}"
    );

    let (code, text) = reconcile(&env, &["--audit-receipts", "every"]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("--audit-receipts") && text.contains("sample=N"),
        "{text}"
    );
}
