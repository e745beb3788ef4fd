//! An unclear answer holds one aggregate, never the relay (issue 25).
//!
//! A real HTTP endpoint that misbehaves on about one request in three, the way webhook
//! receivers do (answers after the client's timeout, connections dropped before or after the
//! request was applied, 500 after applying, 503 with `Retry-After`, 429), with the relay
//! SIGKILLed once on the way. The endpoint keeps idempotency keys, as such receivers do; what
//! it *applied* is counted per key, and every request is recorded with what it met, so a relay
//! that sends again what was already answered cleanly is seen even where the key saves the
//! effect.
//!
//! Counts that must be 0: events not applied exactly once, receipts that are not the
//! endpoint's answer, aggregates applied out of order, runs restarted for an unclear answer,
//! re-sends of requests that were answered cleanly (after the kill's replay), attempts left
//! DISPATCH_UNKNOWN.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use outbox_testkit::http_target::{Behavior, HttpTarget, Misbehave, TargetSettings};
use serde_json::json;

use crate::harness::TestEnv;
use crate::http::check_endpoint;

/// Aggregates and versions of the faulty phase.
const AGGREGATES: usize = 40;
const VERSIONS: i64 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_misbehaving_on_a_third_of_requests_holds_one_aggregate_at_a_time_never_the_relay(
) {
    let env = TestEnv::new("unclear_http").await;
    let target = HttpTarget::start(TargetSettings::default())
        .await
        .expect("start the HTTP endpoint");
    env.db
        .query_one(
            "SELECT outbox.set_http_route($1, NULL, 'billing-api', $2)",
            &[&env.aggregate_type, &target.url("/hooks/{aggregate_type}")],
        )
        .await
        .expect("route the test's events to the endpoint");
    let config = env.dir.path().join("outboxd.toml");
    // A late answer comes after the client's timeout; a clean one well before it.
    std::fs::write(
        &config,
        "sink = \"http\"\n[http]\nendpoint = \"billing-api\"\nrequest_timeout_ms = 1000\n\
         response_id_header = \"X-Response-Id\"\nidempotency_window_ms = 3600000\n",
    )
    .unwrap();
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--message-timeout-ms",
        "3000",
    ];
    let mut relay = env.relay(&[], &args);
    env.wait_streaming().await;

    // Fault-free first: the drain time to compare with.
    let mut committed: HashMap<uuid::Uuid, (String, i64)> = HashMap::new();
    let started = Instant::now();
    enqueue_versions(&env, &mut committed, "clean", 10, 1..=10).await;
    env.wait_count(
        "every fault-free event accepted",
        "SELECT count(*) FROM outbox.receipts",
        committed.len() as i64,
    )
    .await;
    let clean = (committed.len(), started.elapsed());

    // Then one request in three misbehaves, and the relay is killed half-way.
    target.misbehave(Some(Misbehave {
        one_in: 3,
        late: Duration::from_millis(1_500),
        seed: std::env::var("OUTBOXD_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(25),
    }));
    let before = committed.len();
    let started = Instant::now();
    enqueue_versions(&env, &mut committed, "agg", AGGREGATES, 1..=VERSIONS / 2).await;
    env.wait_count(
        "some faulty-phase events accepted before the kill",
        "SELECT count(*) FROM outbox.receipts",
        (before + AGGREGATES) as i64,
    )
    .await;
    relay.kill9();
    let restarted_at = Instant::now();
    let mut relay = env.relay(&[], &args);
    enqueue_versions(
        &env,
        &mut committed,
        "agg",
        AGGREGATES,
        VERSIONS / 2 + 1..=VERSIONS,
    )
    .await;
    env.wait_count(
        "every event accepted despite the misbehaving endpoint",
        "SELECT count(*) FROM outbox.receipts",
        committed.len() as i64,
    )
    .await;
    let faulty = (committed.len() - before, started.elapsed());
    env.wait_zero(
        "every DISPATCH_UNKNOWN attempt resolved",
        "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
    )
    .await;
    relay.assert_running();

    let topic = target.url(&format!("/hooks/{}", env.aggregate_type));
    check_endpoint(&env, &target, &committed, &topic).await;

    // The faults met traffic.
    let requests = target.requests();
    let met = |f: fn(&Behavior) -> bool| requests.iter().filter(|r| f(&r.behavior)).count();
    let ambiguous = met(Behavior::is_ambiguous);
    let not_now = met(|b| {
        matches!(
            b,
            Behavior::Status {
                status: 503 | 429,
                ..
            }
        )
    });
    assert!(
        ambiguous >= 20 && not_now >= 10,
        "too few faults met traffic: {ambiguous} ambiguous, {not_now} 503/429"
    );
    // No run of the restarted relay ended for an unclear answer: each held one aggregate.
    let log = relay.log_text();
    assert_eq!(
        log.matches("relay interrupted").count(),
        0,
        "a run ended:\n{log}"
    );
    assert!(log.contains("unclear outcome: only this aggregate waits"));
    // Nothing answered cleanly after the restart was sent again: only what was unclear (or
    // asked to wait) was.
    let mut by_key: BTreeMap<&str, Vec<&outbox_testkit::http_target::Request>> = BTreeMap::new();
    for r in &requests {
        by_key
            .entry(r.headers["idempotency-key"].as_str())
            .or_default()
            .push(r);
    }
    let mut resent_after_clean = Vec::new();
    for (key, rs) in &mut by_key {
        rs.sort_by_key(|r| r.at);
        for w in rs.windows(2) {
            if w[0].at > restarted_at && w[0].behavior == Behavior::Normal {
                resent_after_clean.push(*key);
            }
        }
    }
    assert!(
        resent_after_clean.is_empty(),
        "sent again after a clean answer: {resent_after_clean:?}"
    );
    // Every ambiguous answer after the restart is a traced attempt, resolved.
    for r in requests
        .iter()
        .filter(|r| r.at > restarted_at && r.behavior.is_ambiguous())
    {
        let key = &r.headers["idempotency-key"];
        assert!(
            env.count(&format!(
                "SELECT count(*) FROM outbox.attempts WHERE event_id = '{key}' AND state <> 'DISPATCH_UNKNOWN'"
            ))
            .await
                >= 1,
            "event {key} met an ambiguous answer without a resolved attempt"
        );
    }
    let per_event = |(n, t): (usize, Duration)| t.as_secs_f64() * 1000.0 / n as f64;
    println!(
        "unclear answers: fault-free {} events in {:.1} s ({:.1} ms/event); one request in three misbehaving and one SIGKILL: {} events in {:.1} s ({:.1} ms/event, {:.1}x); {} requests, {ambiguous} ambiguous, {not_now} 503/429, {} DISPATCH_UNKNOWN attempts",
        clean.0,
        clean.1.as_secs_f64(),
        per_event(clean),
        faulty.0,
        faulty.1.as_secs_f64(),
        per_event(faulty),
        per_event(faulty) / per_event(clean),
        requests.len(),
        env.count("SELECT count(*) FROM outbox.attempts").await,
    );
}

/// Enqueues `versions` of `aggregates` aggregates named `prefix-N`, one transaction per
/// version (each touching every aggregate), and records them in `committed`.
async fn enqueue_versions(
    env: &TestEnv,
    committed: &mut HashMap<uuid::Uuid, (String, i64)>,
    prefix: &str,
    aggregates: usize,
    versions: std::ops::RangeInclusive<i64>,
) {
    for v in versions {
        let names: Vec<String> = (0..aggregates).map(|a| format!("{prefix}-{a}")).collect();
        let events: Vec<(&str, serde_json::Value)> = names
            .iter()
            .map(|n| (n.as_str(), json!({"v": v})))
            .collect();
        for (id, name) in env.enqueue_together(&events).await.into_iter().zip(&names) {
            committed.insert(id, (name.clone(), v));
        }
    }
}
