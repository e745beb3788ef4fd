//! The consumer inbox end to end: relay -> mock Kafka -> `InboxConsumer` -> the consumer's
//! PostgreSQL transaction. A consumer that dies after its database commit and before its
//! offset commit gets the messages again; each event's effect still happens once.

use std::collections::HashSet;

use outbox_inbox::{handler_fn, Handler, InboxConfig, InboxConsumer, Outcome, Processed};
use serde_json::json;

use crate::harness::{connect, TestEnv, LONG};

/// Inserts one row into `effects` per handler run, in the inbox transaction.
pub fn effect_handler() -> impl Handler {
    handler_fn(|tx, ev, key| {
        let (id, agg, version, key) = (
            ev.event_id,
            ev.aggregate_id.clone(),
            ev.aggregate_version,
            key.as_key(),
        );
        Box::pin(async move {
            tx.execute(
                "INSERT INTO effects (event_id, aggregate_id, version, idempotency_key)
                 VALUES ($1, $2, $3, $4)",
                &[&id, &agg, &version, &key],
            )
            .await?;
            Ok(Some(json!({"effect": "recorded"})))
        })
    })
}

pub async fn create_effects_table(env: &TestEnv) {
    env.db
        .batch_execute(
            "CREATE TABLE effects (event_id uuid NOT NULL, aggregate_id text, version bigint,
                                   idempotency_key text)",
        )
        .await
        .unwrap();
}

/// A consumer of the test topic with its own connection to the test database.
pub async fn consumer(env: &TestEnv, consumer_id: &str, group: Option<&str>) -> InboxConsumer {
    let mut cfg = InboxConfig::new(consumer_id, env.kafka.bootstrap_servers(), &[&env.topic]);
    cfg.group_id = group.map(str::to_string);
    cfg.properties = vec![
        ("session.timeout.ms".into(), "6000".into()),
        ("heartbeat.interval.ms".into(), "500".into()),
    ];
    InboxConsumer::new(cfg, connect(&env.url).await).expect("inbox consumer")
}

/// One `next`, bounded by the test deadline.
pub async fn next(c: &mut InboxConsumer, h: &dyn Handler) -> Processed {
    tokio::time::timeout(LONG, c.next(h))
        .await
        .expect("no message within the test deadline")
        .expect("inbox next")
}

/// Effect count != 1, per committed outbox event (must be 0), and events with effects.
pub async fn effect_violations(env: &TestEnv) -> i64 {
    env.count(
        "SELECT count(*) FROM (
             SELECT e.event_id FROM outbox.events e
             LEFT JOIN effects f ON f.event_id = e.event_id
             GROUP BY e.event_id HAVING count(f.event_id) <> 1) v",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_crash_after_db_commit_before_offset_commit_applies_each_effect_once() {
    let env = TestEnv::new("inbox_crash").await;
    create_effects_table(&env).await;
    let _relay = env.relay(&[], &[]);
    const N: usize = 40;
    for i in 0..N {
        env.enqueue(&format!("o-{}", i % 6), json!({"i": i})).await;
    }
    env.wait_count(
        "every receipt",
        "SELECT count(*) FROM outbox.receipts",
        N as i64,
    )
    .await;
    let h = effect_handler();

    // First instance: commits offsets for the first 5 applied events only, keeps applying
    // (database commits) up to 25, then dies without committing any further offset.
    let mut applied = HashSet::new();
    {
        let mut c1 = consumer(&env, "billing", None).await;
        while applied.len() < 25 {
            let p = next(&mut c1, &h).await;
            for o in &p.outcomes {
                assert!(o.ran_handler(), "first instance saw {o:?}");
                applied.insert(o.receipt().unwrap().event_id);
            }
            if applied.len() <= 5 {
                c1.commit(&p).unwrap();
            }
        }
        // Crash: dropped with 20 applied events whose offsets were never committed.
    }
    assert_eq!(effect_violations(&env).await, (N - applied.len()) as i64);

    // Second instance, same consumer id and group: resumes from the committed offsets.
    let mut c2 = consumer(&env, "billing", None).await;
    let mut duplicates = 0;
    while applied.len() < N {
        let p = next(&mut c2, &h).await;
        for o in &p.outcomes {
            match o {
                Outcome::Applied(r) => assert!(applied.insert(r.event_id), "applied twice: {r:?}"),
                Outcome::Duplicate(r) => {
                    duplicates += 1;
                    assert_eq!(r.outcome, "APPLIED");
                    assert_eq!(r.result, Some(json!({"effect": "recorded"})));
                }
                other => panic!("unexpected outcome {other:?}"),
            }
        }
        c2.commit(&p).unwrap();
    }
    assert!(
        duplicates >= 1,
        "the crash must have caused redeliveries, or this test proved nothing"
    );
    assert_eq!(effect_violations(&env).await, 0, "effect count != 1");
    // Every partition watermark is at the end of its partition; the idempotency key is the
    // same on every delivery (one distinct key per event).
    assert_eq!(
        env.count("SELECT count(DISTINCT idempotency_key) FROM effects")
            .await,
        N as i64
    );
    let behind = env
        .count(
            "SELECT count(*) FROM outbox.receipts r
             WHERE NOT EXISTS (SELECT 1 FROM outbox.consumer_watermarks w
                               WHERE w.consumer_id = 'billing' AND w.topic = r.topic
                                 AND w.partition = r.partition AND w.next_offset > r.\"offset\")",
        )
        .await;
    assert_eq!(behind, 0, "receipts not covered by billing's watermarks");
    // And the receipts those watermarks cover are the broker's messages.
    let check = env.verify_receipts(&[&env.topic]).await;
    assert!(check.checked >= N, "{check:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_effect_keyed_by_the_idempotency_key_happens_once_across_a_crash() {
    let env = TestEnv::new("inbox_remote").await;
    env.db
        .batch_execute(
            "CREATE TABLE remote_calls (idempotency_key text NOT NULL);
             CREATE TABLE remote_effects (idempotency_key text PRIMARY KEY)",
        )
        .await
        .unwrap();
    let _relay = env.relay(&[], &[]);
    let id = env.enqueue("p-1", json!({"amount": 10})).await;
    env.wait_count("the receipt", "SELECT count(*) FROM outbox.receipts", 1)
        .await;

    // The "payment provider" is another connection, outside the inbox transaction: it keeps
    // every call, and applies each idempotency key once.
    let remote = std::sync::Arc::new(connect(&env.url).await);
    let fail_once = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let h = {
        let (remote, fail_once) = (remote.clone(), fail_once.clone());
        handler_fn(move |_tx, _ev, key| {
            let (remote, fail_once, key) = (remote.clone(), fail_once.clone(), key.as_key());
            Box::pin(async move {
                remote
                    .execute("INSERT INTO remote_calls VALUES ($1)", &[&key])
                    .await?;
                remote
                    .execute(
                        "INSERT INTO remote_effects VALUES ($1) ON CONFLICT DO NOTHING",
                        &[&key],
                    )
                    .await?;
                if fail_once.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    // Dies after the remote call, before its own commit.
                    return Err("consumer died after calling the provider".into());
                }
                Ok(None)
            })
        })
    };
    {
        let mut c1 = consumer(&env, "payments", None).await;
        let e = tokio::time::timeout(LONG, c1.next(&h))
            .await
            .expect("a message")
            .unwrap_err();
        assert!(e.to_string().contains("delivered again"), "{e}");
    }
    let mut c2 = consumer(&env, "payments", None).await;
    let p = next(&mut c2, &h).await;
    assert!(p.outcomes[0].ran_handler());
    c2.commit(&p).unwrap();
    assert_eq!(
        env.count("SELECT count(*) FROM remote_calls").await,
        2,
        "the provider was called on both deliveries"
    );
    assert_eq!(
        env.count("SELECT count(DISTINCT idempotency_key) FROM remote_calls")
            .await,
        1,
        "with the same key"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM remote_effects").await,
        1,
        "and applied it once"
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.inbox WHERE consumer_id = 'payments' AND event_id = '{id}'"
        ))
        .await,
        1
    );
    let check = env.verify_receipts(&[&env.topic]).await;
    assert!(check.checked >= 1, "{check:?}");
}
