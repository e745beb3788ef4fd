//! The relay publishing to an HTTP endpoint (`--sink http`): a real HTTP/1.1 server
//! (`outbox_testkit::http_target`) that stores what it applies by idempotency key, answers
//! late, drops connections, bursts 429/503 and refuses one poison payload with 400.

use std::collections::HashMap;
use std::time::Duration;

use outbox_testkit::http_target::{Behavior, HttpTarget, TargetSettings};
use serde_json::json;

use crate::harness::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_reaches_the_endpoint_once_by_key_in_order_and_the_poison_one_is_held() {
    let (env, target) = endpoint_env(
        "http_sink",
        TargetSettings {
            poison: Some("poison".into()),
            ..TargetSettings::default()
        },
    )
    .await;
    // What the first requests meet, in order (a retry of an UNKNOWN send is a request too).
    // The client's timeout leaves a clean answer 1 s, the late one comes 1.5 s after it: a
    // clean answer read after the client gave up would be sent again, and the at-most-once
    // check would count it (with 400 ms, a CI run with both CPUs busy could get there).
    for b in [
        Behavior::Late(Duration::from_millis(2_500)),
        Behavior::Status {
            status: 429,
            retry_after: Some("1".into()),
        },
        Behavior::Drop { applied: true },
        Behavior::Status {
            status: 503,
            retry_after: None,
        },
        Behavior::Drop { applied: false },
        Behavior::Status {
            status: 500,
            retry_after: None,
        },
    ] {
        target.then(b);
    }
    let config = env.write_config(
        "sink = \"http\"\n[http]\nendpoint = \"billing-api\"\nrequest_timeout_ms = 1000\n\
         response_id_header = \"X-Response-Id\"\nidempotency_window_ms = 3600000\n\
         [http.headers]\nAuthorization = \"Bearer t0ken\"\n",
    );
    let mut relay = env.relay(
        &[],
        &[
            "--config",
            &config,
            "--message-timeout-ms",
            "4000",
            "--unknown-settle-ms",
            "200",
        ],
    );
    env.wait_streaming().await;

    // Six aggregates of five events each; aggregate "p" has a poison event at version 2 and
    // one more behind it.
    let mut committed: HashMap<uuid::Uuid, (String, i64)> = HashMap::new();
    for v in 1..=5i64 {
        for a in 0..6 {
            let agg = format!("a{a}");
            let id = env.enqueue(&agg, json!({"n": v})).await;
            committed.insert(id, (agg, v));
        }
    }
    let p1 = env.enqueue("p", json!({"n": 1})).await;
    let poison = env.enqueue("p", json!({"poison": true})).await;
    let p3 = env.enqueue("p", json!({"n": 3})).await;
    committed.insert(p1, ("p".into(), 1));

    env.wait_count(
        "a receipt for every event but the poison one and the one behind it",
        "SELECT count(*) FROM outbox.receipts",
        committed.len() as i64,
    )
    .await;
    env.wait_count(
        "the poison event quarantined, its aggregate held",
        &format!(
            "SELECT count(*) FROM outbox.quarantine q JOIN outbox.holds h
               ON h.aggregate_type = q.aggregate_type AND h.aggregate_id = q.aggregate_id
             WHERE q.event_id = '{poison}' AND q.released_at IS NULL AND q.reason LIKE '%400%'"
        ),
        1,
    )
    .await;
    env.wait_zero(
        "every DISPATCH_UNKNOWN attempt resolved",
        "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
    )
    .await;
    relay.assert_running();

    // Applied exactly once by key, in order per aggregate, every receipt the endpoint's answer;
    // nothing of the held aggregate past the poison event.
    let topic = target.url(&format!("/hooks/{}", env.aggregate_type));
    check_endpoint(&env, &target, &committed, &topic).await;
    assert_eq!(target.applied(&poison.to_string()), 0);
    assert_eq!(
        target.applied(&p3.to_string()),
        0,
        "sent past a held aggregate"
    );
    // Every event that met an ambiguous answer has a traced attempt, resolved by a retry with
    // the same key (a retry that meets one too stays the same attempt).
    let requests = target.requests();
    let ambiguous: std::collections::BTreeSet<String> = requests
        .iter()
        .filter(|r| r.behavior.is_ambiguous())
        .map(|r| r.headers["idempotency-key"].clone())
        .collect();
    assert!(!ambiguous.is_empty(), "no request met an ambiguous answer");
    for key in &ambiguous {
        assert_eq!(
            env.count(&format!(
                "SELECT count(*) FROM outbox.attempts WHERE event_id = '{key}' AND state <> 'DISPATCH_UNKNOWN'"
            ))
            .await,
            1,
            "event {key} met an ambiguous answer: one resolved attempt"
        );
    }
    // Reconcile counts the HTTP receipts as not auditable against a broker, by name.
    let (_, out) = crate::harness::outboxd(&[
        "reconcile",
        "--database-url",
        &env.url,
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
        "--audit-receipts",
        "all",
    ]);
    let http_receipts = env
        .count(
            "SELECT (SELECT count(*) FROM outbox.receipts WHERE broker_kind = 'http')
                  + (SELECT count(*) FROM outbox.duplicate_receipts WHERE broker_kind = 'http')",
        )
        .await;
    assert!(
        out.contains(&format!(
            "0 not auditable (nats), {http_receipts} not auditable (http)"
        )) && !out.contains("not on the broker"),
        "{out}"
    );
    // The harness's receipt check names them too (the endpoint's own check is above).
    let check = env.verify_receipts(&[]).await;
    assert_eq!(check.checked, 0, "{check:?}");
    assert_eq!(
        check.not_auditable,
        vec![("http".to_string(), http_receipts)]
    );
    // `outboxd check` knows the HTTP sink: nothing to probe, and the declared window.
    let (_, out) = crate::harness::outboxd(&[
        "check",
        "--database-url",
        &env.url,
        "--config",
        &config,
        "--slot",
        &env.slot,
    ]);
    assert!(
        out.contains("endpoint billing-api: nothing to probe") && !out.contains("http idempotency"),
        "{out}"
    );
    // `outboxd status --event` shows what the endpoint answered.
    let (ok, out) = crate::harness::outboxd(&[
        "status",
        "--database-url",
        &env.url,
        "--event",
        &p1.to_string(),
    ]);
    assert!(
        ok && out.contains("answered 20")
            && out.contains(&format!(
                "(response id {})",
                target.response_id(&p1.to_string()).unwrap()
            )),
        "{out}"
    );
    // The requests carried the key, the envelope and the configured auth header.
    let first = &requests[0];
    assert!(first.headers.contains_key("idempotency-key"));
    assert!(first.headers.contains_key("outbox-aggregate-version"));
    assert_eq!(
        first.headers.get("authorization").map(String::as_str),
        Some("Bearer t0ken")
    );
}

/// What every HTTP test checks of the endpoint after the relay drained `committed` (event id →
/// aggregate, version): each committed event applied once by key; no event applied twice,
/// counted by event id and without the endpoint's key store's help (a key sent again after a
/// clear answer is a second application); nothing applied that is not committed; each
/// aggregate's events first applied in version order; every receipt the endpoint's answer for
/// that event (kind `http`, cluster `billing-api`, the route's URL, a 2xx, the response id of
/// the key's application, the sha256 of the body the endpoint answered), and only for events
/// the endpoint applied.
/// An endpoint down for longer than the first retries of a (compressed) retry schedule: it
/// answers 500 to its first 36 requests, then recovers. Every event reaches it once, in order
/// per aggregate, with no operator step (nothing quarantined or held), and past the schedule
/// the relay keeps asking at its last step, not at the default doubling's 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_down_past_the_first_retries_gets_every_event_once_it_is_back_with_no_operator_step(
) {
    let (env, target) = endpoint_env("http_down", TargetSettings::default()).await;
    const DOWN: usize = 36;
    for _ in 0..DOWN {
        target.then(Behavior::Status {
            status: 500,
            retry_after: None,
        });
    }
    let config = env.write_config(
        "sink = \"http\"\n[http]\nendpoint = \"billing-api\"\nrequest_timeout_ms = 1000\n\
         response_id_header = \"X-Response-Id\"\nidempotency_window_ms = 3600000\n[relay]\nunclear_schedule_ms = [0, 100, 300, 600]\n",
    );
    let mut relay = env.relay(&[], &["--config", &config]);
    env.wait_streaming().await;
    let mut committed: HashMap<uuid::Uuid, (String, i64)> = HashMap::new();
    for v in 1..=4i64 {
        for a in 0..3 {
            let agg = format!("d{a}");
            let id = env.enqueue(&agg, json!({"n": v})).await;
            committed.insert(id, (agg, v));
        }
    }
    env.wait_count(
        "a receipt for every event once the endpoint is back",
        "SELECT count(*) FROM outbox.receipts",
        committed.len() as i64,
    )
    .await;
    relay.assert_running();
    let requests = target.requests();
    let failed = requests
        .iter()
        .filter(|r| r.answer.as_ref().is_some_and(|(s, _)| *s == 500))
        .count();
    assert_eq!(failed, DOWN, "the outage met traffic");
    // Past the schedule: some event met more 500s than the schedule has steps, so the relay
    // went past its budget (4, the number of steps) and said it keeps asking at the
    // schedule's last step, 600 ms (the default doubling would ask every 10 s).
    let mut failed_tries: HashMap<String, usize> = HashMap::new();
    for r in requests
        .iter()
        .filter(|r| r.answer.as_ref().is_some_and(|(s, _)| *s == 500))
    {
        *failed_tries
            .entry(r.headers["idempotency-key"].clone())
            .or_default() += 1;
    }
    let most = failed_tries.values().copied().max().unwrap_or(0);
    assert!(
        most > 4,
        "no event outlived the schedule's 4 steps: {failed_tries:?}"
    );
    let log = relay.log_text();
    assert!(
        log.contains("keeps asking every 600ms"),
        "the relay did not wait by the schedule past its budget"
    );
    // No operator step: nothing quarantined, held or left unknown.
    env.wait_zero(
        "every DISPATCH_UNKNOWN attempt resolved",
        "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
    )
    .await;
    for (what, sql) in [
        ("quarantined", "SELECT count(*) FROM outbox.quarantine"),
        ("held", "SELECT count(*) FROM outbox.holds"),
    ] {
        let n: i64 = env.db.query_one(sql, &[]).await.unwrap().get(0);
        assert_eq!(n, 0, "events {what} during an outage");
    }
    let topic = target.url(&format!("/hooks/{}", env.aggregate_type));
    check_endpoint(&env, &target, &committed, &topic).await;
    target.assert_at_most_once();
}

/// An endpoint answering `410 Gone` is disabled for the rest of the run: no request after
/// it (one request at a time, so none can have started before the answer arrived), every
/// aggregate held behind a quarantined event (nothing lost, nothing applied), the relay
/// still running and saying so. After the endpoint is fixed and the relay started again, the
/// operator's releases deliver everything once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_answering_410_is_disabled_and_its_events_are_held_until_released() {
    let (env, target) = endpoint_env("http_gone", TargetSettings::default()).await;
    target.then(Behavior::Status {
        status: 410,
        retry_after: None,
    });
    let config = env.write_config(
        "sink = \"http\"\n[http]\nendpoint = \"billing-api\"\nmax_concurrency = 1\n\
         response_id_header = \"X-Response-Id\"\nidempotency_window_ms = 3600000\n",
    );
    let args = ["--config", &config];
    let mut relay = env.relay(&[], &args);
    env.wait_streaming().await;
    let mut committed: HashMap<uuid::Uuid, (String, i64)> = HashMap::new();
    for v in 1..=3i64 {
        for a in 0..4 {
            let agg = format!("g{a}");
            let id = env.enqueue(&agg, json!({"n": v})).await;
            committed.insert(id, (agg, v));
        }
    }
    // Every aggregate held behind a quarantined event (what waits behind it is recorded as
    // held in CDC mode; poll mode leaves it unread until the release).
    env.wait_count(
        "every aggregate held behind its quarantined first event",
        "SELECT count(*) FROM outbox.holds h JOIN outbox.quarantine q
           ON q.event_id = h.blocking_event_id AND q.released_at IS NULL",
        4,
    )
    .await;
    relay.assert_running();
    let requests = target.requests();
    assert_eq!(
        requests.len(),
        1,
        "requests after the 410: {:?}",
        requests.iter().map(|r| &r.answer).collect::<Vec<_>>()
    );
    for id in committed.keys() {
        assert_eq!(target.applied(&id.to_string()), 0, "{id} applied");
    }
    assert!(
        relay.log_text().contains("answered 410 Gone"),
        "the relay did not say the endpoint is disabled"
    );
    let receipts: i64 = env
        .db
        .query_one("SELECT count(*) FROM outbox.receipts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(receipts, 0);

    // Fixed: a new run, then the operator releases each held aggregate (a release sends the
    // refused event again: called for, not a second delivery).
    relay.kill9();
    target.client_restarted();
    let mut relay = env.relay(&[], &args);
    env.wait_streaming().await;
    let blocking: Vec<uuid::Uuid> = env
        .db
        .query(
            "SELECT event_id FROM outbox.quarantine WHERE released_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(blocking.len(), 4, "one quarantined event per aggregate");
    for id in blocking {
        let (ok, out) = crate::harness::outboxd(&[
            "quarantine",
            "release",
            "--database-url",
            &env.url,
            "--event",
            &id.to_string(),
            "--by",
            "test",
        ]);
        assert!(ok, "release {id}: {out}");
    }
    env.wait_count(
        "every event delivered after the releases",
        "SELECT count(*) FROM outbox.receipts",
        committed.len() as i64,
    )
    .await;
    relay.assert_running();
    let topic = target.url(&format!("/hooks/{}", env.aggregate_type));
    check_endpoint(&env, &target, &committed, &topic).await;
    target.assert_at_most_once();
}

/// One relay serving two endpoints (`[[http.endpoints]]`), each with its own headers, secrets
/// and retry schedule over settings they share from `[http]`. Partner A answers 500 to every request for
/// a while: its aggregates wait on their unclear answers, and partner B gets every one of its
/// events meanwhile, in order, signed with its own secret. Once A recovers, A gets all of its
/// events once, in order, with no operator step; every receipt names its own endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_endpoints_served_by_one_relay_one_failing_the_other_unaffected() {
    let env = TestEnv::new("http_two").await;
    let a = HttpTarget::start(TargetSettings::default()).await.unwrap();
    let b = HttpTarget::start(TargetSettings::default()).await.unwrap();
    let type_a = env.aggregate_type.clone();
    let type_b = format!("{}_b", env.aggregate_type);
    for (t, name, target) in [(&type_a, "partner-a", &a), (&type_b, "partner-b", &b)] {
        env.db
            .query_one(
                "SELECT outbox.set_http_route($1, NULL, $2, $3)",
                &[t, &name, &target.url("/hooks/{aggregate_type}")],
            )
            .await
            .expect("route the aggregate type to its endpoint");
    }
    for _ in 0..10_000 {
        a.then(Behavior::Status {
            status: 500,
            retry_after: None,
        });
    }
    let config = env.write_config(
        r#"sink = "http"
[http]
request_timeout_ms = 1000
response_id_header = "X-Response-Id"
idempotency_window_ms = 3600000
[http.headers]
X-Shared = "shared"
X-Partner = "overridden by each endpoint"
[[http.endpoints]]
endpoint = "partner-a"
headers = { X-Partner = "a" }
unclear_schedule_ms = [0, 50, 100, 150]
[[http.endpoints]]
endpoint = "partner-b"
max_concurrency = 4
signing_secrets = ["whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="]
headers = { X-Partner = "b" }
[relay]
unclear_schedule_ms = [0, 100, 300, 600]
"#,
    );
    let mut relay = env.relay(&[], &["--config", &config]);
    env.wait_streaming().await;
    let mut committed_a: HashMap<uuid::Uuid, (String, i64)> = HashMap::new();
    let mut committed_b: HashMap<uuid::Uuid, (String, i64)> = HashMap::new();
    for v in 1..=4i64 {
        for i in 0..3 {
            for (t, committed) in [(&type_a, &mut committed_a), (&type_b, &mut committed_b)] {
                let agg = format!("x{i}");
                let id: uuid::Uuid = env
                    .db
                    .query_one(
                        "SELECT outbox.enqueue($1, $2, 'test.happened', $3)",
                        &[t, &agg, &json!({"n": v})],
                    )
                    .await
                    .unwrap()
                    .get(0);
                committed.insert(id, (agg, v));
            }
        }
    }
    let ids_b: Vec<uuid::Uuid> = committed_b.keys().copied().collect();
    env.wait_count(
        "partner B has every event while partner A fails",
        &format!(
            "SELECT count(*) FROM outbox.receipts WHERE event_id IN ({})",
            ids_b
                .iter()
                .map(|id| format!("'{id}'"))
                .collect::<Vec<_>>()
                .join(",")
        ),
        ids_b.len() as i64,
    )
    .await;
    relay.assert_running();
    // A was failing all along: it answered only 500s, and more than one per event it was
    // asked for (the fault met traffic, and the relay kept asking).
    let a_requests = a.requests();
    assert!(
        a_requests.len() > 3
            && a_requests
                .iter()
                .all(|r| r.answer.as_ref().is_some_and(|(s, _)| *s == 500)),
        "partner A's answers while failing: {:?}",
        a_requests.iter().map(|r| &r.answer).collect::<Vec<_>>()
    );
    // Partner A's own retry schedule: past its four steps the relay keeps asking at its last
    // step, 150 ms (the relay's schedule, which B would use, ends at 600 ms).
    outbox_testkit::wait::wait_for(
        "partner A asked past its own schedule's four steps",
        crate::harness::LONG,
        || async {
            if relay.log_text().contains("keeps asking every 150ms") {
                Ok(())
            } else {
                Err(format!("{} requests to A so far", a.requests().len()))
            }
        },
    )
    .await;
    assert!(
        !relay.log_text().contains("keeps asking every 600ms"),
        "an event was retried on the relay's schedule, not its endpoint's"
    );
    let ids_a: Vec<uuid::Uuid> = committed_a.keys().copied().collect();
    let a_receipts: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM outbox.receipts WHERE event_id = ANY($1)",
            &[&ids_a],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(a_receipts, 0, "receipts of partner A while it only failed");
    let topic_b = b.url(&format!("/hooks/{type_b}"));
    check_named_endpoint(&env, &b, &committed_b, &topic_b, "partner-b").await;

    a.recover();
    env.wait_count(
        "partner A has every event once it is back",
        "SELECT count(*) FROM outbox.receipts",
        (committed_a.len() + committed_b.len()) as i64,
    )
    .await;
    relay.assert_running();
    let topic_a = a.url(&format!("/hooks/{type_a}"));
    check_named_endpoint(&env, &a, &committed_a, &topic_a, "partner-a").await;
    for (what, sql) in [
        ("quarantined", "SELECT count(*) FROM outbox.quarantine"),
        ("held", "SELECT count(*) FROM outbox.holds"),
    ] {
        let n: i64 = env.db.query_one(sql, &[]).await.unwrap().get(0);
        assert_eq!(n, 0, "events {what} while an endpoint failed");
    }
    // Each endpoint's own settings over the shared ones: its headers, its secret (or none).
    for (target, partner, signed) in [(&a, "a", false), (&b, "b", true)] {
        for r in target.requests() {
            assert_eq!(
                r.headers.get("x-partner").map(String::as_str),
                Some(partner)
            );
            assert_eq!(
                r.headers.get("x-shared").map(String::as_str),
                Some("shared")
            );
            assert_eq!(
                r.headers
                    .get("webhook-signature")
                    .is_some_and(|s| s.starts_with("v1,")),
                signed,
                "partner {partner}: {:?}",
                r.headers
            );
        }
    }
}

pub(crate) async fn check_endpoint(
    env: &TestEnv,
    target: &HttpTarget,
    committed: &HashMap<uuid::Uuid, (String, i64)>,
    topic: &str,
) {
    check_named_endpoint(env, target, committed, topic, "billing-api").await
}

/// [`check_endpoint`] for the endpoint named `endpoint`, which `committed` was routed to.
pub(crate) async fn check_named_endpoint(
    env: &TestEnv,
    target: &HttpTarget,
    committed: &HashMap<uuid::Uuid, (String, i64)>,
    topic: &str,
    endpoint: &str,
) {
    let not_once: Vec<_> = committed
        .keys()
        .filter(|id| target.applied(&id.to_string()) != 1)
        .map(|id| (id, target.applied(&id.to_string())))
        .collect();
    assert!(
        not_once.is_empty(),
        "not applied exactly once: {not_once:?}"
    );
    target.assert_at_most_once();
    let committed_ids: Vec<String> = committed.keys().map(uuid::Uuid::to_string).collect();
    target.assert_applied_within(committed_ids.iter().map(String::as_str));
    let ids: Vec<uuid::Uuid> = committed.keys().copied().collect();
    let receipts = env
        .db
        .query(
            "SELECT event_id, broker_kind, broker_cluster, topic, (evidence ->> 'status')::int,
                    evidence ->> 'response_id', evidence ->> 'body_sha256'
             FROM outbox.receipts WHERE event_id = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap();
    assert_eq!(receipts.len(), committed.len(), "a receipt per event");
    for r in &receipts {
        let id: uuid::Uuid = r.get(0);
        assert_eq!(
            (r.get::<_, &str>(1), r.get::<_, &str>(2)),
            ("http", endpoint)
        );
        assert_eq!(r.get::<_, String>(3), topic);
        assert!(
            target.applied(&id.to_string()) >= 1,
            "receipt of {id}, which the endpoint never applied"
        );
        // The endpoint's answer is kept: a 2xx, its response id for that key, a body digest.
        let status: Option<i32> = r.get(4);
        assert!(
            status.is_some_and(|s| (200..300).contains(&s)),
            "{id}: {status:?}"
        );
        assert_eq!(
            r.get::<_, Option<String>>(5),
            target.response_id(&id.to_string()),
            "{id}"
        );
        let digest: Option<String> = r.get(6);
        let digest = digest.unwrap_or_else(|| panic!("{id}: a receipt without a body digest"));
        target.assert_body_digest(&id.to_string(), &digest);
    }
    // Order per aggregate: the endpoint's first applications are versions 1, 2, 3, ...
    let mut per_agg: HashMap<&str, Vec<i64>> = HashMap::new();
    for key in target.applied_order() {
        let id: uuid::Uuid = key.parse().unwrap();
        if let Some((agg, v)) = committed.get(&id) {
            per_agg.entry(agg).or_default().push(*v);
        }
    }
    for (agg, versions) in &per_agg {
        let n = committed.values().filter(|(a, _)| a == agg).count() as i64;
        assert_eq!(
            versions,
            &(1..=n).collect::<Vec<_>>(),
            "{agg}: out of order"
        );
    }
}

/// A test environment whose aggregate type is routed to a new endpoint `billing-api` at
/// `/hooks/{aggregate_type}` of a test HTTP server started with `settings`.
pub(crate) async fn endpoint_env(name: &str, settings: TargetSettings) -> (TestEnv, HttpTarget) {
    let env = TestEnv::new(name).await;
    let target = HttpTarget::start(settings)
        .await
        .expect("start the HTTP endpoint");
    env.db
        .query_one(
            "SELECT outbox.set_http_route($1, NULL, 'billing-api', $2)",
            &[&env.aggregate_type, &target.url("/hooks/{aggregate_type}")],
        )
        .await
        .expect("route the test's events to the endpoint");
    (env, target)
}

/// A DISPATCH_UNKNOWN attempt of another relay generation (a paused predecessor's salvage
/// recorded it late) for an event the endpoint has already answered: the running relay closes
/// it with the event's receipt, which is the endpoint's answer under the event's key, instead
/// of looking it up, which for an endpoint means sending the event again (and waiting on the
/// endpoint in the relay's loop meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_attempt_of_an_answered_event_is_closed_by_its_receipt_not_sent_again() {
    let (env, target) = endpoint_env("http_late_attempt", TargetSettings::default()).await;
    let config = keyed_endpoint_config(&env, 2000);
    let mut relay = env.relay(&[], &["--config", &config, "--unknown-settle-ms", "200"]);
    env.wait_streaming().await;
    let id = env.enqueue("late", json!({"n": 1})).await;
    env.wait_receipts("the event answered", 1).await;
    let sent = |id: uuid::Uuid| target.requests_with_key(&id.to_string());
    assert_eq!(sent(id), 1);
    plant_predecessor_attempt(&env, id).await;
    env.wait_zero(
        "the planted attempt resolved",
        "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
    )
    .await;
    let (state, offset): (String, Option<i64>) = {
        let r = env
            .db
            .query_one(
                "SELECT state, found_offset FROM outbox.attempts WHERE event_id = $1",
                &[&id],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (state.as_str(), offset),
        ("FOUND", Some(0)),
        "closed at the receipt"
    );
    assert_eq!(
        sent(id),
        1,
        "the answered event was sent again to trace the attempt"
    );
    assert!(relay
        .log_text()
        .contains("DISPATCH_UNKNOWN resolved by the event's receipt"));
    relay.assert_running();
}

/// A parked event (its request to the endpoint got no answer: DISPATCH_UNKNOWN, only its
/// aggregate waits) whose receipt the ledger holds by the time its look-up comes due (a
/// predecessor's salvage accepted the endpoint's answer meanwhile; planted here): the look-up
/// closes the attempt by that receipt, the endpoint's answer under the event's key, instead
/// of sending the event again, and the aggregate's next event follows. Before, the parked
/// event's look-up re-sent it (found by the simulator's `resent_published`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_event_answered_meanwhile_is_closed_by_its_receipt_not_sent_again() {
    let (env, target) = endpoint_env("http_parked_answered", TargetSettings::default()).await;
    let config = keyed_endpoint_config(&env, 1000);
    // The parked event's look-up comes 4 s after its unclear outcome: time to plant the receipt.
    let relay = env.relay(&[], &["--config", &config, "--unclear-schedule-ms", "4000"]);
    env.wait_ready(&relay).await;
    // Its first request is applied and never answered.
    target.then(Behavior::Drop { applied: true });
    let id = env.enqueue("parked", json!({"n": 1})).await;
    let next = env.enqueue("parked", json!({"n": 2})).await;
    let unknown = format!(
        "SELECT count(*) FROM outbox.attempts WHERE event_id = '{id}' AND state = 'DISPATCH_UNKNOWN'"
    );
    env.wait_count(
        "the unanswered request recorded DISPATCH_UNKNOWN",
        &unknown,
        1,
    )
    .await;
    let sent = |id: uuid::Uuid| target.requests_with_key(&id.to_string());
    assert_eq!(sent(id), 1, "the fault met the event's request");
    env.db
        .execute(
            "INSERT INTO outbox.receipts (event_id, broker_kind, broker_cluster, topic, partition,
                                          \"offset\", attempt, relay_generation, payload_digest,
                                          destination_digest)
             SELECT event_id, 'http', dest_cluster, dest_topic, 0, 0, 1, 0,
                    outbox.payload_digest_of(payload, payload_digest),
                    outbox.destination_digest_of(e)
             FROM outbox.events_current e WHERE event_id = $1",
            &[&id],
        )
        .await
        .expect("plant the receipt a predecessor's salvage would have accepted");
    env.wait_zero("the parked event's attempt resolved", &unknown)
        .await;
    env.wait_receipts("the aggregate's next event published", 2)
        .await;
    assert_eq!(
        env.attempt_state(id).await,
        "FOUND",
        "closed at the receipt"
    );
    assert_eq!(
        sent(id),
        1,
        "the answered event was sent again to look it up"
    );
    assert_eq!(sent(next), 1);
    assert!(relay
        .log_text()
        .contains("DISPATCH_UNKNOWN of a parked event resolved by its receipt"));
}

e2e_only! {
    /// A DISPATCH_UNKNOWN attempt of another relay generation for an event that has no receipt yet
    /// (its own send is outstanding), whose look-up — for an endpoint, the event sent again under
    /// its key — is answered late: the look-up runs beside the relay's loop, so another
    /// aggregate's event is published while it waits. Before, the running reconciliation waited
    /// for the endpoint in the loop, and every aggregate waited with it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_look_up_of_a_late_attempt_holds_its_event_only_never_the_relay() {
        use outbox_testkit::wait::wait_for;
        // Well past the few hundred milliseconds another aggregate's event takes to publish
        // on a loaded machine; every second of it is a second of the suite.
        const LATE: Duration = Duration::from_secs(8);
        let (env, target) = endpoint_env("http_slow_lookup", TargetSettings::default()).await;
        let config = keyed_endpoint_config(&env, 40000);
        // CDC mode (so the test runs once, here): a poll round waits for its sends, so there
        // the event's own slow send holds the next round whatever the look-up does.
        let mut relay = env.relay(
            &[],
            &[
                "--mode",
                "cdc",
                "--config",
                &config,
                "--unknown-settle-ms",
                "200",
                "--message-timeout-ms",
                "60000",
            ],
        );
        env.wait_ready(&relay).await;
        let sent = |id: uuid::Uuid| target.requests_with_key(&id.to_string());
        // The event's own send, then the look-up's re-send, are answered after LATE (inside the
        // client's timeout: neither is unclear, both are merely slow).
        target.then(Behavior::Late(LATE));
        target.then(Behavior::Late(LATE));
        let id = env.enqueue("slow", json!({"n": 1})).await;
        // Until the endpoint has read `n` requests under the event's key.
        let sent_n = |what: &'static str, n: usize| {
            wait_for(what, LATE, move || async move {
                if sent(id) == n {
                    Ok(())
                } else {
                    Err(format!("{} requests", sent(id)))
                }
            })
        };
        sent_n("the event's own send reached the endpoint", 1).await;
        plant_predecessor_attempt(&env, id).await;
        // The fault meets traffic: the look-up's re-send arrives (and is answered only after LATE).
        sent_n("the attempt's look-up reached the endpoint", 2).await;
        let looking_since = std::time::Instant::now();
        let other = env.enqueue("other", json!({"n": 2})).await;
        wait_for(
            "another aggregate's event published while the look-up waits",
            LATE,
            || async {
                let n = env
                    .count(&format!(
                        "SELECT count(*) FROM outbox.receipts WHERE event_id = '{other}'"
                    ))
                    .await;
                if n == 1 {
                    Ok(())
                } else {
                    Err("no receipt yet".to_string())
                }
            },
        )
        .await;
        assert!(
            looking_since.elapsed() < LATE,
            "published only after the look-up was answered ({:?}): the look-up held the relay's loop",
            looking_since.elapsed()
        );
        // And the look-up is recorded when its answer comes.
        env.wait_zero(
            "the planted attempt resolved",
            "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
        )
        .await;
        env.wait_count(
            "the slow event's receipt",
            &format!("SELECT count(*) FROM outbox.receipts WHERE event_id = '{id}'"),
            1,
        )
        .await;
        relay.assert_running();
    }
}

/// Plants a predecessor's open DISPATCH_UNKNOWN attempt of `id` to `billing-api`: recorded an
/// hour ago (settled), relay generation 0 (no run of the test has it), attempt generation 1.
async fn plant_predecessor_attempt(env: &TestEnv, id: uuid::Uuid) {
    env.db
        .execute(
            "INSERT INTO outbox.attempts (event_id, relay_generation, attempt_generation, slot_name,
                                          topic, partition, sent_at, error, unknown_at)
             VALUES ($1, 0, 1, $2, 'billing-api', 0, now() - interval '1 hour', 'planted',
                     now() - interval '1 hour')",
            &[&id, &env.slot],
        )
        .await
        .expect("plant a predecessor's DISPATCH_UNKNOWN attempt");
}

/// `outboxd.toml` for the endpoint `billing-api` that keeps idempotency keys for an hour (so a
/// look-up of a recent attempt is the event sent again under its key), with this request
/// timeout; its path.
fn keyed_endpoint_config(env: &TestEnv, request_timeout_ms: u32) -> String {
    env.write_config(format!(
        "sink = \"http\"\n[http]\nendpoint = \"billing-api\"\nrequest_timeout_ms = {request_timeout_ms}\n\
         idempotency_window_ms = 3600000\n"
    ))
}
