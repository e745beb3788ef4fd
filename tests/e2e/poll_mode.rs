//! Poll mode (`outboxd run --mode poll`): the same ledger, receipts, ordering and commands as
//! CDC mode, without a replication slot, on a server where logical replication is not
//! available (`wal_level = replica`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use crate::harness::{connect, replica_only_cluster, TestEnv};
use crate::ordering::first_occurrences;

const POLL: [&str; 4] = ["--mode", "poll", "--poll-interval-ms", "20"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_publishes_every_committed_event_in_order_through_sigkills_without_logical_replication(
) {
    let env = TestEnv::new_on(replica_only_cluster(), "poll_mode").await;
    let level: String = env
        .db
        .query_one("SHOW wal_level", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(level, "replica", "the cluster this test needs");
    let mut relay = env.relay(&[], &POLL);
    env.wait_ready(&relay).await;

    // Four writers, 12 aggregates each shared by all of them, one in eight transactions rolled
    // back.
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(Mutex::new(Vec::<uuid::Uuid>::new()));
    let rolled_back = Arc::new(Mutex::new(Vec::<uuid::Uuid>::new()));
    let mut writers = Vec::new();
    for w in 0..4 {
        let (url, agg, stop) = (env.url.clone(), env.aggregate_type.clone(), stop.clone());
        let (committed, rolled_back) = (committed.clone(), rolled_back.clone());
        writers.push(tokio::spawn(async move {
            let mut c = connect(&url).await;
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let tx = c.transaction().await.unwrap();
                let id: uuid::Uuid = tx
                    .query_one(
                        "SELECT outbox.enqueue($1, $2, 'Changed', $3)",
                        &[&agg, &format!("a{}", i % 12), &json!({"w": w, "i": i})],
                    )
                    .await
                    .unwrap()
                    .get(0);
                if i % 8 == 5 {
                    tx.rollback().await.unwrap();
                    rolled_back.lock().unwrap().push(id);
                } else {
                    tx.commit().await.unwrap();
                    committed.lock().unwrap().push(id);
                }
                i += 1;
                // ~400 events/s in all: enough to overlap the kills, light on a shared CI box.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    for kill in 0..2 {
        env.wait_count(
            "receipts before the SIGKILL",
            "SELECT count(*) FROM outbox.receipts",
            150 * (kill + 1),
        )
        .await;
        relay.kill9();
        relay = env.relay(&[], &POLL);
        env.wait_ready(&relay).await;
    }
    env.wait_count(
        "receipts after the restarts",
        "SELECT count(*) FROM outbox.receipts",
        450,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let committed = std::mem::take(&mut *committed.lock().unwrap());
    env.wait_count(
        "a receipt for every committed event",
        "SELECT count(*) FROM outbox.receipts",
        committed.len() as i64,
    )
    .await;
    relay.assert_running();

    let msgs = env.read_topic().await;
    let mut copies: HashMap<String, usize> = HashMap::new();
    for m in &msgs {
        *copies.entry(m.id().to_string()).or_default() += 1;
    }
    let missing: Vec<_> = committed
        .iter()
        .filter(|id| !copies.contains_key(&id.to_string()))
        .collect();
    assert_eq!(
        missing.len(),
        0,
        "committed events not on the broker: {missing:?}"
    );
    let rolled: Vec<_> = rolled_back
        .lock()
        .unwrap()
        .iter()
        .filter(|id| copies.contains_key(&id.to_string()))
        .copied()
        .collect();
    assert_eq!(rolled.len(), 0, "rolled-back events published: {rolled:?}");
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.receipts").await,
        committed.len() as i64,
        "one primary receipt per committed event"
    );
    for (agg, versions) in first_occurrences(&msgs) {
        let expected: Vec<i64> = (1..=versions.len() as i64).collect();
        assert_eq!(
            versions, expected,
            "{agg}: first occurrences out of version order"
        );
    }
    // No slot, no walsender: poll mode never touched logical replication.
    assert_eq!(
        env.count("SELECT count(*) FROM pg_replication_slots").await,
        0
    );
    println!(
        "poll mode: {} committed, {} messages ({} extra copies after 2 SIGKILLs)",
        committed.len(),
        msgs.len(),
        msgs.len() - committed.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_killed_after_the_broker_ack_records_one_primary_receipt_after_restart() {
    let env = TestEnv::new_on(replica_only_cluster(), "poll_kill_ack").await;
    let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "after-broker-ack=abort")], &POLL);
    env.wait_ready(&relay).await;
    let id = env.enqueue("k-1", json!({"v": 1})).await;
    let status = relay.wait_exit(Duration::from_secs(60)).await;
    assert!(!status.success(), "the failpoint aborts the relay");
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 0);
    assert_eq!(
        env.read_topic().await.len(),
        1,
        "the broker has it, the ledger does not"
    );

    let relay = env.relay(&[], &POLL);
    env.wait_ready(&relay).await;
    env.wait_count("the receipt", "SELECT count(*) FROM outbox.receipts", 1)
        .await;
    let msgs = env.read_topic().await;
    assert!(msgs.len() >= 2, "sent again after the restart");
    assert!(msgs.iter().all(|m| m.id() == id.to_string()));
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 1);
}

/// `outbox.aggregate_versions` is unlogged (migration 0032): a crash of the server empties it,
/// and poll mode finds pending events through it. A poll run restores it from the rows when it
/// starts; without that, these events would wait for their aggregates' next event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_publishes_the_events_a_crash_hid_from_the_unlogged_version_table() {
    let env = TestEnv::new_on(replica_only_cluster(), "poll_versions_lost").await;
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(env.enqueue(&format!("v-{}", i % 3), json!({"i": i})).await);
    }
    // What crash recovery does to an unlogged table (every other test of the process has its
    // own database, so the server itself is not crashed here).
    env.db
        .batch_execute("TRUNCATE outbox.aggregate_versions, outbox.aggregate_versions_intact")
        .await
        .unwrap();
    let relay = env.relay(&[], &POLL);
    env.wait_ready(&relay).await;
    env.wait_receipts("a receipt for every event written before the loss", 6)
        .await;
    let msgs = env.verify_receipts(&[&env.topic]).await.messages;
    let mut sent: Vec<String> = msgs.iter().map(|m| m.id().to_string()).collect();
    sent.sort();
    sent.dedup();
    let mut want: Vec<String> = ids.iter().map(|u| u.to_string()).collect();
    want.sort();
    assert_eq!(sent, want, "every event on the broker, nothing else");
    // The count resumes after the rows' versions: the next event of v-0 is its third.
    let next = env.enqueue("v-0", json!({"i": 6})).await;
    let version: i64 = env
        .db
        .query_one(
            "SELECT aggregate_version FROM outbox.events WHERE event_id = $1",
            &[&next],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, 3);
    env.wait_receipts("the event after the loss", 7).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_holds_only_the_aggregate_of_an_oversized_payload_until_released() {
    let env = TestEnv::new_on(replica_only_cluster(), "poll_poison").await;
    crate::ordering::oversized_payload_holds_only_its_aggregate(&env, &POLL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_passes_poll_mode_where_cdc_mode_fails_on_wal_level() {
    let env = TestEnv::new_on(replica_only_cluster(), "poll_check").await;
    let args = [
        "check",
        "--database-url",
        &env.url,
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
    ];
    let (ok, out) = crate::harness::outboxd(&args);
    assert!(!ok && out.contains("wal_level"), "{out}");
    let (ok, out) = crate::harness::outboxd(&[&args[..], &["--mode", "poll"]].concat());
    assert!(ok && out.contains("poll: no slot"), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
}

/// Poll mode finds pending rows through the version table, so a row written by a plain INSERT
/// (no version, docs/versions_by_relay.md) would never be found. A poll relay refuses an
/// outbox that allows such rows, with the fix, at start and when the outbox is changed under
/// it; the rows written meanwhile stay for a CDC relay, never skipped as published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_relay_refuses_an_outbox_that_allows_rows_without_a_version() {
    let env = TestEnv::new_on(replica_only_cluster(), "poll_plain_refused").await;
    let allow = |yes: bool| format!("SELECT outbox.allow_plain_inserts({yes})");
    env.db.batch_execute(&allow(true)).await.unwrap();
    let mut refused = env.relay(&[], &POLL);
    let status = refused.wait_exit(Duration::from_secs(60)).await;
    assert!(!status.success(), "refused at start");
    let log = refused.log_text();
    assert!(
        log.contains("poll mode cannot find or order") && log.contains("--mode cdc"),
        "names the cause and the fix: {log}"
    );
    let (ok, out) = crate::harness::outboxd(&[
        "check",
        "--database-url",
        &env.url,
        "--mode",
        "poll",
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
    ]);
    assert!(
        !ok && out.contains("FAIL  plain inserts") && out.contains("--mode cdc"),
        "outboxd check says so too: {out}"
    );

    env.db.batch_execute(&allow(false)).await.unwrap();
    let mut relay = env.relay(&[], &POLL);
    env.wait_ready(&relay).await;
    env.enqueue("p-1", json!({"v": 1})).await;
    env.wait_count("the receipt", "SELECT count(*) FROM outbox.receipts", 1)
        .await;
    env.db.batch_execute(&allow(true)).await.unwrap();
    let status = relay.wait_exit(Duration::from_secs(60)).await;
    assert!(!status.success(), "refused once the outbox allows them");
    assert!(relay.log_text().contains("poll mode cannot find or order"));
}
