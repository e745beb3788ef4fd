//! `outboxd purge`: nothing inside the replay window goes, nothing a mandatory consumer has not
//! covered goes, `--dry-run` changes nothing, and a replay of a purged event from the broker is
//! still deduplicated by the consumer's inbox while its inbox row is retained.

use std::collections::HashSet;
use std::process::Command;

use outbox_inbox::Outcome;
use serde_json::json;

use crate::harness::TestEnv;
use crate::inbox::{consumer, create_effects_table, effect_handler, effect_violations, next};
use crate::reconcile::reconcile_json;

fn purge(env: &TestEnv, extra: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["purge", "--database-url", &env.url, "--json"])
        .args(extra)
        .env_remove("OUTBOXD_DATABASE_URL")
        .env_remove("OUTBOXD_REPLAY_WINDOW")
        .env_remove("OUTBOXD_INBOX_RETENTION")
        .env_remove("OUTBOXD_CONFIG")
        .output()
        .expect("run outboxd purge");
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn report(text: &str) -> serde_json::Value {
    serde_json::from_str::<serde_json::Value>(text).unwrap_or_else(|e| panic!("{e}: {text}"))
        ["report"]
        .clone()
}

/// Purged events a mandatory consumer had not covered (must be 0).
async fn purged_uncovered(env: &TestEnv) -> i64 {
    env.count(
        "SELECT count(*) FROM outbox.purged_events p
         WHERE NOT outbox.covered_by_mandatory(p.event_id, p.topic, p.partition, p.\"offset\")",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_respects_window_and_mandatory_watermark_and_replay_stays_deduplicated() {
    let env = TestEnv::new("purge").await;
    create_effects_table(&env).await;
    env.db
        .execute(
            "SELECT outbox.register_consumer('billing', true, ARRAY[$1])",
            &[&env.topic],
        )
        .await
        .unwrap();
    let _relay = env.relay(&[], &[]);
    let mut all = HashSet::new();
    for i in 0..4 {
        all.insert(env.enqueue(&format!("o-{i}"), json!({"i": i})).await);
    }
    env.wait_count("receipts", "SELECT count(*) FROM outbox.receipts", 4)
        .await;
    // What the consumer will read is what the ledger says was published (before any purge).
    let check = env.verify_receipts(&[&env.topic]).await;
    assert!(check.checked >= 4, "{check:?}");

    // billing applies 3 of the 4 events.
    let h = effect_handler();
    let mut covered = HashSet::new();
    {
        let mut c = consumer(&env, "billing", None).await;
        while covered.len() < 3 {
            let p = next(&mut c, &h).await;
            for o in &p.outcomes {
                covered.insert(o.receipt().unwrap().event_id);
            }
            c.commit(&p).unwrap();
        }
    }
    let uncovered = *all.difference(&covered).next().unwrap();
    // The watermark of the uncovered event's partition may still be below it only if billing
    // never read it; make sure it did not (else it would count as covered).
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.receipts r WHERE r.event_id = '{uncovered}'
               AND outbox.covered_by_mandatory(r.event_id, r.topic, r.partition, r.\"offset\")"
        ))
        .await,
        0
    );

    // Inside the replay window nothing goes, but covered events become RETAINED.
    let (code, text) = purge(&env, &["--replay-window", "1h"]);
    assert_eq!(code, 0, "{text}");
    let r = report(&text);
    assert_eq!(r["events"], 0, "{text}");
    assert_eq!(r["marked_retained"], 3, "{text}");
    assert_eq!(r["kept_inside_window"], 3, "{text}");
    assert_eq!(r["kept_awaiting_consumers"], 1, "{text}");
    assert_eq!(env.count("SELECT count(*) FROM outbox.events").await, 4);
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.event_status WHERE state = 'RETAINED'")
            .await,
        3
    );

    // An inbox retention shorter than the window is refused.
    let (code, text) = purge(&env, &["--replay-window", "2h", "--inbox-retention", "1h"]);
    assert_ne!(code, 0, "{text}");
    assert!(text.contains("--inbox-retention"), "{text}");

    // Dry run past the window: says 3 would go, deletes nothing.
    let (code, text) = purge(
        &env,
        &[
            "--replay-window",
            "0s",
            "--inbox-retention",
            "1h",
            "--dry-run",
        ],
    );
    assert_eq!(code, 0, "{text}");
    let r = report(&text);
    assert_eq!(r["dry_run"], true);
    assert_eq!(r["events"], 3, "{text}");
    assert_eq!(r["inbox_rows"], 0, "{text}");
    assert_eq!(env.count("SELECT count(*) FROM outbox.events").await, 4);
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 4);

    // The uncovered event's receipt in an acceptance of its own (through the view's trigger,
    // migration 0030), so that the covered ones' acceptances are left without receipts.
    env.db
        .execute(
            "UPDATE outbox.receipts SET accepted_at = accepted_at - interval '1 millisecond'
             WHERE event_id = $1",
            &[&uncovered],
        )
        .await
        .unwrap();
    // For real, in batches of 2: the 3 covered events go, the uncovered one stays.
    let (code, text) = purge(
        &env,
        &[
            "--replay-window",
            "0s",
            "--inbox-retention",
            "1h",
            "--batch-size",
            "2",
        ],
    );
    assert_eq!(code, 0, "{text}");
    let r = report(&text);
    assert_eq!(r["events"], 3, "{text}");
    assert_eq!(r["receipts"], 3, "{text}");
    assert_eq!(r["batches"], 2, "{text}");
    assert_eq!(
        r["inbox_rows"], 0,
        "inbox rows are inside their retention: {text}"
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.events WHERE event_id = '{uncovered}'"
        ))
        .await,
        1,
        "the event billing has not covered was purged"
    );
    assert_eq!(env.count("SELECT count(*) FROM outbox.events").await, 1);
    // Acceptances' rows go with their last receipt, never before it (migration 0030).
    assert!(r["receipt_batches"].as_i64().unwrap() >= 1, "{text}");
    assert_eq!(
        env.count(
            "SELECT count(*) FROM outbox.receipt_batches b WHERE NOT EXISTS
                 (SELECT 1 FROM outbox.receipt_entries r WHERE r.batch_id = b.batch_id)"
        )
        .await,
        0,
        "an acceptance batch without receipts outlived a purge past its window"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.receipts WHERE accepted_at IS NULL")
            .await,
        0,
        "a receipt lost its acceptance batch"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.purged_events").await,
        3
    );
    assert_eq!(purged_uncovered(&env).await, 0);
    assert_eq!(env.count("SELECT count(*) FROM outbox.inbox").await, 3);
    // A purged event still answers `status --event` from its purge record.
    let gone = covered.iter().next().unwrap().to_string();
    let (ok, text) =
        crate::harness::outboxd(&["status", "--database-url", &env.url, "--event", &gone]);
    assert!(
        ok && text.contains("PURGED") && text.contains(&env.topic),
        "{text}"
    );

    // Replay: billing re-reads the whole topic (a new group, i.e. offsets reset). The purged
    // events are deduplicated by their retained inbox rows; the fourth is applied once.
    let mut c = consumer(&env, "billing", Some("billing-replay")).await;
    let (mut dups, mut applied) = (HashSet::new(), HashSet::new());
    while dups.len() + applied.len() < 4 {
        let p = next(&mut c, &h).await;
        for o in &p.outcomes {
            match o {
                Outcome::Duplicate(r) => {
                    dups.insert(r.event_id);
                }
                Outcome::Applied(r) => {
                    applied.insert(r.event_id);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        c.commit(&p).unwrap();
    }
    assert_eq!(
        dups, covered,
        "replayed purged events were not deduplicated"
    );
    assert_eq!(applied, HashSet::from([uncovered]));
    let violations = env
        .count(
            "SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING count(*) <> 1) v",
        )
        .await;
    assert_eq!(violations, 0, "an effect happened twice");
    assert_eq!(effect_violations(&env).await, 0);
    assert_eq!(env.count("SELECT count(*) FROM effects").await, 4);

    // The broker still has the purged events' messages: the tombstones keep them from being
    // reported as bypasses, and everything is consumed now.
    let (code, rep) = reconcile_json(&env, &["--unconsumed-after", "0s"]);
    assert_eq!(code, 0, "{rep:#}");
    assert_eq!(rep["broker"]["messages"], 4);

    // Now the last one is covered: a second purge takes it (and still not the inbox rows).
    let (code, text) = purge(&env, &["--replay-window", "0s", "--inbox-retention", "1h"]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(report(&text)["events"], 1, "{text}");
    assert_eq!(env.count("SELECT count(*) FROM outbox.events").await, 0);
    assert_eq!(purged_uncovered(&env).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_purges_in_the_background_when_configured() {
    let env = TestEnv::new("purge_bg").await;
    env.db
        .execute(
            "SELECT outbox.register_consumer('billing', true, ARRAY[$1])",
            &[&env.topic],
        )
        .await
        .unwrap();
    let config = env.write_config(
        "[retention]\nreplay_window = \"0s\"\ninbox_retention = \"1h\"\npurge_interval = \"200ms\"\n",
    );
    let mut relay = env.relay(&[], &["--config", &config]);
    let a = env.enqueue("o-1", json!({"n": 1})).await;
    let b = env.enqueue("o-2", json!({"n": 2})).await;
    env.wait_count("receipts", "SELECT count(*) FROM outbox.receipts", 2)
        .await;
    // billing covers `a` only (its inbox has it); the schedule purges `a` and keeps `b`.
    env.db
        .execute(
            "INSERT INTO outbox.inbox (consumer_id, event_id, topic, partition, \"offset\")
             SELECT 'billing', event_id, topic, partition, \"offset\" FROM outbox.receipts
             WHERE event_id = $1",
            &[&a],
        )
        .await
        .unwrap();
    env.wait_count(
        "the background purge of the covered event",
        &format!("SELECT count(*) FROM outbox.purged_events WHERE event_id = '{a}'"),
        1,
    )
    .await;
    relay.assert_running();
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.events WHERE event_id = '{b}'"
        ))
        .await,
        1,
        "an event the mandatory consumer has not covered was purged"
    );
    assert_eq!(purged_uncovered(&env).await, 0);
}

cdc_only! {
    "CDC only: purge waiting for the slot's checkpoint; poll mode's rule (the round's snapshot) is modelled in outbox-sim";
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purge_waits_for_the_relay_checkpoint_to_pass_the_event() {
        let env = TestEnv::new("purge_ckpt").await;
        let mut relay = env.relay(&[], &[]);
        env.wait_streaming().await; // through the slot, so its receipt has a commit LSN
        let id = env.enqueue("o-1", json!({"n": 1})).await;
        env.wait_count(
            "the receipt, with its commit LSN",
            "SELECT count(*) FROM outbox.receipts WHERE commit_lsn IS NOT NULL",
            1,
        )
        .await;
        relay.signal(libc::SIGTERM);
        let status = relay.wait_exit(crate::harness::LONG).await;
        assert!(status.success(), "{}", relay.log_text());
        // As if the checkpoint had not moved past the event yet: a restart would replay it.
        let saved: String = env
            .db
            .query_one(
                "SELECT confirmed_lsn::text FROM outbox.checkpoints WHERE slot_name = $1",
                &[&env.slot],
            )
            .await
            .unwrap()
            .get(0);
        env.db
            .execute(
                "UPDATE outbox.checkpoints SET confirmed_lsn = r.commit_lsn
                 FROM outbox.receipts r WHERE r.event_id = $1 AND checkpoints.slot_name = $2",
                &[&id, &env.slot],
            )
            .await
            .unwrap();
        let (code, text) = purge(&env, &["--replay-window", "0s"]);
        assert_eq!(code, 0, "{text}");
        let r = report(&text);
        assert_eq!(r["events"], 0, "{text}");
        assert_eq!(r["kept_relay_may_replay"], 1, "{text}");
        assert_eq!(env.count("SELECT count(*) FROM outbox.events").await, 1);

        env.db
            .execute(
                "UPDATE outbox.checkpoints SET confirmed_lsn = $1::text::pg_lsn WHERE slot_name = $2",
                &[&saved, &env.slot],
            )
            .await
            .unwrap();
        let (code, text) = purge(&env, &["--replay-window", "0s"]);
        assert_eq!(code, 0, "{text}");
        assert_eq!(report(&text)["events"], 1, "{text}");
        assert_eq!(env.count("SELECT count(*) FROM outbox.events").await, 0);
    }
}
