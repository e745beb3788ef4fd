//! Crashes at the durable boundaries: before the send, after the broker's ACK but before the
//! ledger, after the ledger but before the slot is told, and at random moments under load.

use std::collections::HashSet;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::harness::{connect, TestEnv};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_broker_ack_before_acceptance_gets_one_primary_receipt() {
    let env = TestEnv::new("kill_after_ack").await;
    let sampler = env.start_sampler();
    let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "after-broker-ack=abort")], &[]);
    env.wait_streaming().await;
    let id = env.enqueue("k-1", json!({"v": 1})).await;
    let status = relay.wait_exit(Duration::from_secs(60)).await;
    assert!(!status.success(), "the failpoint aborts the relay");
    assert!(relay.log_text().contains("failpoint after-broker-ack"));
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 0);
    assert_eq!(
        env.read_topic().len(),
        1,
        "the broker has the message, the ledger does not"
    );

    let _relay = env.restart_until_receipts(1).await;
    let msgs = env.read_topic();
    assert!(
        msgs.len() >= 2,
        "replayed after restart: {} copies",
        msgs.len()
    );
    assert!(
        msgs.iter().all(|m| m.id() == id.to_string()),
        "one logical event id"
    );
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 1);
    let (violations, samples) = sampler.violations(&env).await;
    assert!(samples > 0);
    assert_eq!(
        violations, 0,
        "slot confirmed past an event whose receipt was not accepted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_acceptance_before_confirming_resumes_from_the_ledger_checkpoint() {
    let env = TestEnv::new("kill_after_accept").await;
    let sampler = env.start_sampler();
    let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "after-accept=abort")], &[]);
    env.wait_streaming().await;
    let id = env.enqueue("d-1", json!({"v": 1})).await;
    relay.wait_exit(Duration::from_secs(60)).await;
    assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 1);

    // The slot was never told; the ledger checkpoint written with the receipt was. The restart
    // resumes from the checkpoint, so the accepted event is normally not sent again; if its
    // transaction was not yet covered, the replay is recorded as a duplicate, never a primary.
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    let later = env.enqueue("d-1", json!({"v": 2})).await;
    env.wait_count("the next event", "SELECT count(*) FROM outbox.receipts", 2)
        .await;
    let copies = env
        .read_topic()
        .iter()
        .filter(|m| m.id() == id.to_string())
        .count() as i64;
    let dups = env
        .count(&format!(
            "SELECT count(*) FROM outbox.duplicate_receipts WHERE event_id = '{id}'"
        ))
        .await;
    assert_eq!(copies, 1 + dups, "every extra copy is a recorded duplicate");
    assert!(dups <= 1);
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.receipts WHERE event_id IN ('{id}', '{later}')"
        ))
        .await,
        2,
        "one primary receipt each"
    );
    let (violations, _) = sampler.violations(&env).await;
    assert_eq!(violations, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_sending_publishes_after_restart() {
    let env = TestEnv::new("kill_before_send").await;
    let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "before-send=abort")], &[]);
    env.wait_streaming().await;
    let id = env.enqueue("s-1", json!({"v": 1})).await;
    relay.wait_exit(Duration::from_secs(60)).await;
    assert_eq!(
        env.read_topic().len(),
        0,
        "nothing was sent before the crash"
    );

    let _relay = env.restart_until_receipts(1).await;
    let msgs = env.read_topic();
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0].id(), id.to_string());
}

/// 10,000 transactions from 4 writers, ~10% rolled back, the relay SIGKILLed 5 times at
/// moments drawn from a seeded RNG (as "after the ledger holds k receipts").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_four_writers_rollbacks_and_five_sigkills_lose_nothing() {
    let env = TestEnv::new("chaos_10k").await;
    let seed: u64 = std::env::var("OUTBOXD_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    println!("seed={seed} (set OUTBOXD_TEST_SEED to reproduce)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let sampler = env.start_sampler();
    let mut relay = env.relay(&[], &[]);

    const WRITERS: usize = 4;
    const PER_WRITER: usize = 2_500;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let url = env.url.clone();
        let agg = env.aggregate_type.clone();
        let mut wrng = rand::rngs::StdRng::seed_from_u64(seed ^ (w as u64 + 1));
        writers.push(tokio::spawn(async move {
            let mut c = connect(&url).await;
            let (mut committed, mut rolled_back) = (Vec::new(), Vec::new());
            for i in 0..PER_WRITER {
                let tx = c.transaction().await.unwrap();
                let id: uuid::Uuid = tx
                    .query_one(
                        "SELECT outbox.enqueue($1, $2, 'load.tick', $3)",
                        &[&agg, &format!("w{w}-{}", i % 50), &json!({"w": w, "i": i})],
                    )
                    .await
                    .unwrap()
                    .get(0);
                if wrng.gen_bool(0.1) {
                    tx.rollback().await.unwrap();
                    rolled_back.push(id);
                } else {
                    tx.commit().await.unwrap();
                    committed.push(id);
                }
            }
            (committed, rolled_back)
        }));
    }

    // Five kills, each once the ledger has reached a random number of receipts.
    let mut thresholds: Vec<i64> = (0..5).map(|_| rng.gen_range(200..8_000)).collect();
    thresholds.sort();
    for t in thresholds {
        env.wait_count(
            "progress before the next kill",
            "SELECT count(*) FROM outbox.receipts",
            t,
        )
        .await;
        relay.assert_running();
        relay.kill9();
        relay = env.relay(&[], &[]);
    }

    let mut committed = HashSet::new();
    let mut rolled_back = HashSet::new();
    for w in writers {
        let (c, r) = w.await.unwrap();
        committed.extend(c.into_iter().map(|u| u.to_string()));
        rolled_back.extend(r.into_iter().map(|u| u.to_string()));
    }
    let n = committed.len() as i64;
    env.wait_count(
        "every committed event accepted",
        "SELECT count(*) FROM outbox.receipts",
        n,
    )
    .await;

    let msgs = env.read_topic();
    let on_broker: HashSet<String> = msgs.iter().map(|m| m.id().to_string()).collect();
    let lost = committed.difference(&on_broker).count();
    let rolled_back_published = rolled_back.intersection(&on_broker).count();
    let unknown_on_broker = on_broker.difference(&committed).count();
    let primary = env.count("SELECT count(*) FROM outbox.receipts").await;
    let receipts_without_row = env
        .count("SELECT count(*) FROM outbox.receipts r WHERE NOT EXISTS (SELECT 1 FROM outbox.events e WHERE e.event_id = r.event_id)")
        .await;
    println!(
        "committed={n} rolled_back={} broker_messages={} primary={primary} duplicates={}",
        rolled_back.len(),
        msgs.len(),
        env.count("SELECT count(*) FROM outbox.duplicate_receipts")
            .await
    );
    assert_eq!(lost, 0, "lost events");
    assert_eq!(rolled_back_published, 0, "rolled-back events published");
    assert_eq!(
        unknown_on_broker, 0,
        "events on the broker that were never committed"
    );
    assert_eq!(primary, n, "primary receipts = committed events");
    assert_eq!(receipts_without_row, 0);
    let (violations, samples) = sampler.violations(&env).await;
    assert!(samples > 0);
    assert_eq!(violations, 0, "confirmed LSN passed an unaccepted event");
}
