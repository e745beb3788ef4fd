//! The operator-facing commands: status. (dev-broker and demo, the README's first command, are
//! `outbox-embedded`'s: crates/outbox-embedded/tests/e2e.)

use std::process::Command;

use serde_json::json;

use crate::harness::TestEnv;

cdc_only! {
    "CDC only: asserts the slot's position and lag; poll mode has no slot";
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn status_reports_counts_and_the_slot_in_json_and_as_a_table() {
        let env = TestEnv::new("status").await;
        let _relay = env.relay(&[], &[]);
        env.wait_streaming().await;
        for i in 0..3 {
            env.enqueue("s-1", json!({"i": i})).await;
        }
        env.wait_count("receipts", "SELECT count(*) FROM outbox.receipts", 3)
            .await;
        let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["status", "--json", "--database-url", &env.url])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["events"], 3);
        assert_eq!(v["published"], 3);
        assert_eq!(v["pending"], 0);
        let slot = v["slots"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["slot_name"] == env.slot.as_str())
            .expect("our slot is listed");
        assert_eq!(slot["slot_exists"], true);
        assert_eq!(slot["snapshot_done"], true);
        // The relay holding the slot's lease, and that it keeps the session lock (migration 0018).
        let lease = v["leases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["slot_name"] == env.slot.as_str())
            .expect("our lease is listed");
        assert!(lease["generation"].as_i64().unwrap() >= 1, "{lease}");
        assert!(
            lease["expires_in_seconds"].as_f64().unwrap() > 0.0,
            "{lease}"
        );
        assert_eq!(lease["holder_locks"], true, "{lease}");

        let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["status", "--database-url", &env.url])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("published") && text.contains(&env.slot),
            "{text}"
        );
        assert!(
            text.contains("HELD BY") && text.contains("if it dies"),
            "{text}"
        );
    }
}

e2e_only! {
/// Every subcommand that connects finds its database the same ways: `--database-url`, or the
/// `database_url` of `--config FILE` / `OUTBOXD_CONFIG` (issue 34: `status --config` was an
/// unknown argument and `status` ignored `OUTBOXD_CONFIG`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connecting_command_reads_the_database_url_from_the_config_file() {
    let env = TestEnv::new("cli_config").await;
    env.enqueue("c-1", json!({"n": 1})).await;
    let config = env.write_config(format!("database_url = {:?}\n", env.url));
    let config = config.as_str();
    let commands: &[&[&str]] = &[
        &["status"],
        &["status", "--json"],
        &["quarantine", "list"],
        &["consumers", "list"],
        &["share", "list"],
        &["migrate"],
        &["purge", "--dry-run"],
    ];
    for args in commands {
        for via_env in [false, true] {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_outboxd"));
            cmd.args(*args)
                .env_remove("OUTBOXD_DATABASE_URL")
                .env_remove("OUTBOXD_CONFIG");
            if via_env {
                cmd.env("OUTBOXD_CONFIG", config);
            } else {
                cmd.args(["--config", config]);
            }
            let out = cmd.output().expect("run outboxd");
            assert!(
                out.status.success(),
                "`outboxd {}` with the URL in {}: {}{}",
                args.join(" "),
                if via_env {
                    "OUTBOXD_CONFIG"
                } else {
                    "--config"
                },
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    // Without any of them, the error names all three ways.
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["status"])
        .env_remove("OUTBOXD_DATABASE_URL")
        .env_remove("OUTBOXD_CONFIG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--database-url")
            && err.contains("OUTBOXD_DATABASE_URL")
            && err.contains("--config"),
        "{err}"
    );
}
}

/// The harness's wait for a relay to stream gives up at once, with the relay's log, when the
/// relay has already exited (here: a setting it refuses), instead of waiting out its deadline.
#[tokio::test]
#[should_panic(expected = "every relay of this test has exited")]
async fn waiting_for_a_relay_that_exited_fails_at_once_with_its_log() {
    let env = TestEnv::new("relay_exited").await;
    let _relay = env.relay(&[], &["--batch-size", "0"]);
    let started = std::time::Instant::now();
    tokio::time::timeout(std::time::Duration::from_secs(20), env.wait_streaming())
        .await
        .unwrap_or_else(|_| panic!("still waiting after {:?}", started.elapsed()));
}
