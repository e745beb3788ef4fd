//! Webhooks signed the Standard Webhooks way (issue 32, its first part): a receiver that
//! verifies with the specification's reference library (`standardwebhooks` from PyPI,
//! tests/receivers/python/verify_webhooks.py) accepts every request the relay sends, rejects a
//! tampered body, a stale timestamp and another secret; and a secret rotation (old, then old
//! and new, then new) keeps every delivery verifiable by the receiver that holds the secret of
//! its time. An ed25519 secret (`whsk_`) beside an HMAC one adds a `v1a,` signature that
//! the receiver verifies with the `whpk_` public key (the reference library has no `v1a`; the
//! verifier checks it the way the specification writes it).

use std::io::Write;
use std::process::{Command, Stdio};

use outbox_testkit::http_target::{Behavior, TargetSettings};
use serde_json::json;

use crate::http::endpoint_env;

const VERIFY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/receivers/python/verify_webhooks.py"
);
// Test secrets: whsec_ and the base64 of 32 bytes.
const OLD: &str = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
const NEW: &str = "whsec_ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";
// whsk_ and the base64 of a 32-byte ed25519 seed.
const ED: &str = "whsk_QEFCQ0RFRkdISUpLTE1OT1BRUlNUVVZXWFlaW1xdXl8=";

/// The Python interpreter with `standardwebhooks` and `cryptography`, or a failure naming
/// the fix.
fn python() -> String {
    crate::harness::python_with(
        "standardwebhooks, cryptography",
        "standardwebhooks cryptography",
    )
}

/// The reference library's verdicts over `requests`.
fn verify(
    python: &str,
    requests: &[outbox_testkit::http_target::Request],
    accept: &[&str],
    reject: &[&str],
) -> serde_json::Value {
    let job = json!({
        "requests": requests.iter().map(|r| json!({
            "headers": r.headers,
            "body": String::from_utf8_lossy(&r.body),
        })).collect::<Vec<_>>(),
        "accept": accept,
        "reject": reject,
    });
    let mut child = Command::new(python)
        .arg(VERIFY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the Python verifier");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(job.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "verifier: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the verifier's JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standard_webhooks_receiver_verifies_every_request_through_a_secret_rotation() {
    let python = python();
    let (env, target) = endpoint_env("wh_sign", TargetSettings::default()).await;
    let both = format!("{OLD},{NEW}");
    let with_ed = format!("{NEW},{ED}");
    let public = outbox_sink::http::signing_key(ED, 1)
        .unwrap()
        .public()
        .expect("a whpk_ key");
    // The key a receiver would get from someone else's secret: it must not verify.
    let other_public =
        outbox_sink::http::signing_key("whsk_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", 1)
            .unwrap()
            .public()
            .expect("a whpk_ key");
    let phases: Vec<(&str, Vec<&str>, Vec<&str>)> = vec![
        (OLD, vec![OLD], vec![NEW]),
        (&both, vec![OLD, NEW], vec![]),
        (NEW, vec![NEW], vec![OLD]),
        (&with_ed, vec![NEW, &public], vec![OLD, &other_public]),
    ];
    let mut delivered = 0;
    for (phase, (secrets, accept, reject)) in phases.iter().enumerate() {
        let mut relay = env.relay(
            &[("OUTBOXD_HTTP_SIGNING_SECRETS", secrets)],
            &["--sink", "http", "--http-endpoint", "billing-api"],
        );
        env.wait_ready(&relay).await;
        let before = target.requests().len();
        for i in 0..3 {
            env.enqueue(&format!("p{phase}-{i}"), json!({"phase": phase, "i": i}))
                .await;
        }
        delivered += 3;
        env.wait_receipts("the phase's events accepted by the endpoint", delivered)
            .await;
        relay.kill9();
        let requests: Vec<_> = target.requests().split_off(before);
        assert!(
            requests.len() >= 3,
            "phase {phase}: {} requests",
            requests.len()
        );
        for r in &requests {
            assert_eq!(
                r.headers.get("webhook-id"),
                r.headers.get("idempotency-key"),
                "webhook-id is the event id"
            );
            let log = relay.log_text();
            for s in [OLD, NEW, ED] {
                assert!(!log.contains(s), "a signing secret was printed");
            }
        }
        let v = verify(&python, &requests, accept, reject);
        let n = requests.len() as u64;
        for key in [
            "accepted",
            "wrong_secret_rejected",
            "tampered_rejected",
            "stale_rejected",
        ] {
            assert_eq!(v[key].as_u64(), Some(n), "phase {phase}, {key}: {v}");
        }
    }
}

/// Recovery commands (issue 32): `outboxd webhooks list` names, per endpoint, the event it
/// refused, the aggregate held behind it with what waits there, and a send in doubt; `outboxd
/// webhooks resend` sends again what the endpoint acknowledged since a point in time (or one
/// event), in version order, with the event's id and a fresh signature the reference library
/// verifies, and records each answer as a duplicate receipt; it refuses an event the endpoint
/// never acknowledged, and `--dry-run` sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_list_names_what_an_endpoint_refused_holds_or_doubts_and_resend_replays_acknowledged_events(
) {
    let python = python();
    let (env, target) = endpoint_env(
        "wh_recover",
        TargetSettings {
            poison: Some("poison".into()),
            ..TargetSettings::default()
        },
    )
    .await;
    let config = env.write_config(
        format!(
            "sink = \"http\"\ndatabase_url = \"{}\"\n[http]\nendpoint = \"billing-api\"\n\
             request_timeout_ms = 1000\nidempotency_window_ms = 3600000\nsigning_secrets = [\"{OLD}\"]\n\
             [relay]\nunclear_schedule_ms = [0, 200, 400, 800]\n",
            env.url
        ),
    );
    let mut relay = env.relay(&[], &["--config", &config]);
    env.wait_streaming().await;
    // Wave 1: a0 v1..3, and p with a poison event at v2 and one more behind it.
    env.enqueue("p", json!({"n": 1})).await;
    let poison = env.enqueue("p", json!({"poison": true})).await;
    let p3 = env.enqueue("p", json!({"n": 3})).await;
    for v in 1..=3 {
        env.enqueue("a0", json!({"n": v})).await;
    }
    env.wait_receipts("wave 1 but the poison event and the one behind it", 4)
        .await;
    env.wait_count(
        "p held behind its refused event",
        "SELECT count(*) FROM outbox.holds",
        1,
    )
    .await;
    let since: String = env
        .db
        .query_one("SELECT clock_timestamp()::text", &[])
        .await
        .unwrap()
        .get(0);
    // Wave 2: a1 v1..3, acknowledged after `since`.
    let mut wave2 = Vec::new();
    for v in 1..=3 {
        wave2.push(env.enqueue("a1", json!({"n": v})).await);
    }
    env.wait_receipts("wave 2", 7).await;
    // A send in doubt: the endpoint answers 500 until it recovers.
    for _ in 0..10_000 {
        target.then(Behavior::Status {
            status: 500,
            retry_after: None,
        });
    }
    let doubt = env.enqueue("u", json!({"n": 1})).await;
    env.wait_count(
        "the send to the failing endpoint in doubt",
        &format!(
            "SELECT count(*) FROM outbox.attempts WHERE event_id = '{doubt}' AND state = 'DISPATCH_UNKNOWN'"
        ),
        1,
    )
    .await;

    let (ok, out) = crate::harness::outboxd(&[
        "webhooks",
        "list",
        "--config",
        &config,
        "--endpoint",
        "billing-api",
        "--json",
    ]);
    assert!(ok, "{out}");
    let list: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let find = |state: &str| {
        list.as_array()
            .unwrap()
            .iter()
            .filter(|d| d["state"] == state)
            .cloned()
            .collect::<Vec<_>>()
    };
    let refused = find("refused");
    assert_eq!(refused.len(), 1, "{list}");
    assert_eq!(refused[0]["event_id"], poison.to_string());
    assert!(
        refused[0]["reason"].as_str().unwrap().contains("400"),
        "{list}"
    );
    let held = find("held");
    assert_eq!(held.len(), 1, "{list}");
    assert_eq!(
        (&held[0]["aggregate_id"], &held[0]["waiting"]),
        (&json!("p"), &json!(1)),
        "{list}"
    );
    let in_doubt = find("in_doubt");
    assert_eq!(in_doubt.len(), 1, "{list}");
    assert_eq!(in_doubt[0]["event_id"], doubt.to_string());
    let (ok, text) = crate::harness::outboxd(&["webhooks", "list", "--config", &config]);
    assert!(ok, "{text}");
    assert!(
        text.contains("endpoint billing-api: 1 refused, 1 held, 1 in doubt"),
        "{text}"
    );
    target.recover();
    env.wait_receipts("the send in doubt delivered once the endpoint is back", 8)
        .await;
    let (ok, text) = crate::harness::outboxd(&["webhooks", "list", "--config", &config]);
    assert!(
        ok && text.contains("1 refused, 1 held, 0 in doubt"),
        "{text}"
    );

    // Resend: --dry-run sends nothing; an event never acknowledged is refused by name.
    let before = target.requests().len();
    let resend = |extra: &[&str]| {
        let mut args = vec![
            "webhooks",
            "resend",
            "--config",
            &config,
            "--endpoint",
            "billing-api",
            "--by",
            "ops",
        ];
        args.extend(extra);
        crate::harness::outboxd(&args)
    };
    let (ok, out) = resend(&["--since", &since, "--dry-run"]);
    assert!(
        ok && out.contains("3 event(s) of endpoint billing-api match"),
        "{out}"
    );
    let (ok, out) = resend(&["--event", &p3.to_string()]);
    assert!(!ok && out.contains("has no receipt"), "{out}");
    assert_eq!(
        target.requests().len(),
        before,
        "a dry run or a refusal sent something"
    );

    let (ok, out) = resend(&["--since", &since]);
    assert!(ok, "{out}");
    let resent: Vec<_> = target.requests().split_off(before);
    let ids: Vec<String> = resent
        .iter()
        .map(|r| r.headers["webhook-id"].clone())
        .collect();
    assert_eq!(
        ids,
        wave2.iter().map(uuid::Uuid::to_string).collect::<Vec<_>>(),
        "wave 2 again, in version order, with the events' own ids"
    );
    for r in &resent {
        assert_eq!(
            r.headers.get("idempotency-key"),
            r.headers.get("webhook-id")
        );
    }
    let v = verify(&python, &resent, &[OLD], &[NEW]);
    for key in [
        "accepted",
        "wrong_secret_rejected",
        "tampered_rejected",
        "stale_rejected",
    ] {
        assert_eq!(v[key].as_u64(), Some(3), "{key}: {v}");
    }
    let recorded = env
        .count(&format!(
            "SELECT count(*) FROM outbox.duplicate_receipts
             WHERE relay_generation = 0 AND evidence ->> 'resent_by' = 'ops'
               AND event_id IN ({})",
            wave2
                .iter()
                .map(|id| format!("'{id}'"))
                .collect::<Vec<_>>()
                .join(",")
        ))
        .await;
    assert_eq!(recorded, 3, "each resend recorded as a duplicate receipt");
    // One event again: a second resend of it is recorded too.
    let (ok, out) = resend(&["--event", &wave2[0].to_string()]);
    assert!(ok, "{out}");
    let again = env
        .count(&format!(
            "SELECT count(*) FROM outbox.duplicate_receipts
             WHERE evidence ->> 'resent_by' = 'ops' AND event_id = '{}'",
            wave2[0]
        ))
        .await;
    assert_eq!(again, 2);
    relay.assert_running();
}
