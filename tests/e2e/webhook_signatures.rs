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

use outbox_testkit::http_target::TargetSettings;
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
