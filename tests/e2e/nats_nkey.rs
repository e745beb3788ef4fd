//! NATS authentication by NKey (issue 33, finding 6): a server whose authorization block lists
//! only a user's public NKey refuses the relay without the seed, and with a wrong one naming
//! the setting, and takes its events with the right one; the seed is never printed.

use serde_json::json;

use outbox_testkit::nats::TestNats;

use crate::harness::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_authenticates_to_nats_with_an_nkey_seed_that_never_prints() {
    let env = TestEnv::new("js_auth_nkey").await;
    let (nats, seed) = TestNats::start_with_nkey("nats_js_auth_nkey")
        .expect("start nats-server with an NKey user");
    env.route_to_nats(nats.name()).await;
    let url = nats.url();
    let wrong = nkeys::KeyPair::new_user().seed().unwrap();
    let (right_file, wrong_file) = (
        env.dir.path().join("user.nk"),
        env.dir.path().join("other.nk"),
    );
    std::fs::write(&right_file, format!("{seed}\n")).unwrap();
    std::fs::write(&wrong_file, &wrong).unwrap();
    let args = |file: &std::path::Path| {
        vec![
            "--sink".to_string(),
            "nats".into(),
            "--nats-url".into(),
            url.clone(),
            "--nats-stream".into(),
            "OUTBOX_NKEY".into(),
            "--nats-create-stream".into(),
            "--cluster-name".into(),
            nats.name().into(),
            "--nats-nkey-seed-file".into(),
            file.display().to_string(),
        ]
    };

    // Another user's seed: refused, the error names the setting, not the seed.
    let a = args(&wrong_file);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let mut refused = env.relay(&[], &a);
    let status = refused.wait_exit(crate::harness::LONG).await;
    let log = refused.log_text();
    assert!(
        !status.success(),
        "the relay ran with another user's seed:\n{log}"
    );
    assert!(
        log.contains("nats.nkey_seed_file (--nats-nkey-seed-file)"),
        "the refusal does not name the setting:\n{log}"
    );
    assert!(!log.contains(&wrong), "the seed was printed:\n{log}");

    // A file that holds no seed is refused before connecting.
    let junk = env.dir.path().join("junk.nk");
    std::fs::write(&junk, "not a seed").unwrap();
    let (ok, out) = crate::harness::outboxd(&[
        "run",
        "--database-url",
        &env.url,
        "--sink",
        "nats",
        "--nats-url",
        &url,
        "--cluster-name",
        nats.name(),
        "--nats-nkey-seed-file",
        junk.to_str().unwrap(),
    ]);
    assert!(
        !ok && out.contains("does not hold a user NKey seed"),
        "{out}"
    );

    // The user's seed: its events are published, and nothing prints the seed.
    let a = args(&right_file);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let relay = env.relay(&[("OUTBOXD_LOG", "trace")], &a);
    env.enqueue("nk-1", json!({"i": 1})).await;
    env.wait_count(
        "a receipt from the NATS server that requires an NKey",
        "SELECT count(*) FROM outbox.receipts WHERE broker_kind = 'nats'",
        1,
    )
    .await;
    let log = std::fs::read_to_string(&relay.log).unwrap();
    assert!(!log.contains(&seed), "the seed was printed at trace level");
}
