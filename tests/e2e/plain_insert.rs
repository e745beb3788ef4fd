//! The writer's plain INSERT (issue 27, docs/versions_by_relay.md): rows written without an
//! aggregate version or a route, numbered and routed by the relay from the stream.

use std::collections::HashMap;
use std::time::Duration;

use crate::harness::TestEnv;

/// Inserts one event of `aggregate_id` the plain way, in its own committed transaction.
async fn insert_plain(env: &TestEnv, aggregate_id: &str, n: i64) -> uuid::Uuid {
    env.db
        .query_one(
            "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ($1, $2, 'test.happened', jsonb_build_object('n', $3::int8))
             RETURNING event_id",
            &[&env.aggregate_type, &aggregate_id, &n],
        )
        .await
        .expect("plain insert")
        .get(0)
}

/// Allows rows without a version in `env`'s outbox, as its owner would.
async fn allow_plain(env: &TestEnv) {
    env.db
        .batch_execute("SELECT outbox.allow_plain_inserts(true)")
        .await
        .expect("allow rows without a version");
}

/// Every primary receipt's version and topic, by event id.
async fn receipts_of(env: &TestEnv) -> HashMap<uuid::Uuid, (i64, String)> {
    env.db
        .query(
            "SELECT event_id, aggregate_version, topic FROM outbox.receipts",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
}

/// The events of `written` (per aggregate, in commit order) whose receipt's version is not
/// their rank 1..n: what must be empty.
fn not_in_commit_order(
    written: &HashMap<&str, Vec<uuid::Uuid>>,
    receipts: &HashMap<uuid::Uuid, (i64, String)>,
) -> Vec<String> {
    let mut wrong = Vec::new();
    for (agg, ids) in written {
        for (k, id) in ids.iter().enumerate() {
            let version = receipts.get(id).map(|r| r.0);
            if version != Some(k as i64 + 1) {
                wrong.push(format!("{agg} #{}: {id} has {version:?}", k + 1));
            }
        }
    }
    wrong
}

/// The copies among `messages` whose `aggregate_version` header is not their receipt's:
/// what must be empty.
fn versions_differ(
    messages: &[crate::harness::TopicMessage],
    receipts: &HashMap<uuid::Uuid, (i64, String)>,
) -> Vec<String> {
    let mut wrong = Vec::new();
    for m in messages {
        let id: uuid::Uuid = m.id().parse().expect("an event id header");
        let version = receipts[&id].0;
        if m.headers.get("aggregate_version") != Some(&version.to_string()) {
            wrong.push(format!(
                "{id} at {}@{}: header {:?}, receipt {version}",
                m.partition,
                m.offset,
                m.headers.get("aggregate_version")
            ));
        }
    }
    wrong
}

cdc_only! {
    "CDC only: poll mode refuses rows written without a version (poll_mode::a_poll_relay_refuses_an_outbox_that_allows_rows_without_a_version)";

    /// Rows written by a plain INSERT get versions 1, 2, 3... per aggregate in commit order,
    /// across a relay killed after a broker ACK and before its acceptance: the restart streams
    /// the overlap again from the checkpoint and numbers it again from what that checkpoint
    /// kept, so every copy on the broker carries its receipt's version. A route change made
    /// while the relay is down routes the rows written after it, and only those (the policy
    /// generation the stream delivers at its position). Counted: receipts whose versions are
    /// not 1..n in commit order, and copies whose version differs from their receipt's; both
    /// must be 0 (a relay that does not keep its numbering with the checkpoint numbers the
    /// overlap from 0 again and fails both).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plain_inserts_are_numbered_in_commit_order_and_renumbered_alike_after_a_crash() {
        let env = TestEnv::new("plain_insert").await;
        allow_plain(&env).await;
        let rerouted = format!("{}.rerouted", env.topic);
        env.kafka.create_topic(&rerouted, 3).expect("create topic");
        let aggregates = ["a0", "a1", "a2", "a3"];
        // Per aggregate, its events in commit order (one transaction each, one writer).
        let mut written: HashMap<&str, Vec<uuid::Uuid>> = HashMap::new();
        let mut routed_later = Vec::new();
        // The next `count` events to write: (aggregate, sequence number), round robin.
        let mut n = 0;
        let mut next = |count: usize| -> Vec<(&str, i64)> {
            (0..count)
                .map(|_| {
                    n += 1;
                    (aggregates[(n - 1) % aggregates.len()], n as i64)
                })
                .collect()
        };

        let mut relay = env.relay(&[("OUTBOXD_FAILPOINTS", "after-broker-ack=abort@25")], &[]);
        env.wait_streaming().await;
        for (agg, i) in next(40) {
            written.entry(agg).or_default().push(insert_plain(&env, agg, i).await);
        }
        let status = relay.wait_exit(Duration::from_secs(60)).await;
        assert!(!status.success(), "the failpoint aborts the relay");

        // While it is down: more rows, a route change, more rows.
        for (agg, i) in next(10) {
            written.entry(agg).or_default().push(insert_plain(&env, agg, i).await);
        }
        env.route_to(&rerouted).await;
        for (agg, i) in next(10) {
            let id = insert_plain(&env, agg, i).await;
            written.entry(agg).or_default().push(id);
            routed_later.push(id);
        }

        let _relay = env.restart_until_receipts(60).await;
        let receipts = receipts_of(&env).await;
        assert_eq!(not_in_commit_order(&written, &receipts), Vec::<String>::new(), "receipts not 1..n in commit order");

        let mut messages = env.read_topic().await;
        let first_topic = messages.len();
        messages.extend(env.read_topic_of(&rerouted).await);
        assert!(messages.len() > 60, "the crash left copies to replay: {} messages", messages.len());
        for (k, m) in messages.iter().enumerate() {
            let id: uuid::Uuid = m.id().parse().expect("an event id header");
            let topic = &receipts[&id].1;
            let expected = if routed_later.contains(&id) { &rerouted } else { &env.topic };
            assert_eq!(topic, expected, "{id}: routed by the policy in force at its commit");
            assert_eq!(k >= first_topic, topic == &rerouted, "{id}: read from its own topic");
        }
        assert_eq!(versions_differ(&messages, &receipts), Vec::<String>::new(), "copies whose version is not their receipt's");
        env.wait_count(
            "the numbering kept with the checkpoint past the last row",
            &format!(
                "SELECT count(*) FROM outbox.stream_numbering
                 WHERE slot_name = '{}' AND version = 15",
                env.slot
            ),
            4,
        )
        .await;
        assert_eq!(env.count("SELECT count(*) FROM outbox.quarantine").await, 0);

        // `status --event` reads what the relay gave a row that has neither itself.
        let later = routed_later[0];
        let (ok, out) = crate::harness::outboxd(&[
            "status",
            "--database-url",
            &env.url,
            "--event",
            &later.to_string(),
        ]);
        let version = receipts[&later].0;
        assert!(
            ok && out.contains(&format!("@{version} (numbered by the relay)"))
                && out.contains(&format!("{rerouted} (routed by the relay)")),
            "{out}"
        );
    }

    /// A slot new to the ledger has no numbering to continue: over rows already written
    /// without a version, the first start is refused with the reason and what to do, and
    /// nothing is published (a snapshot would number them in no commit order).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_slot_over_rows_without_a_version_is_refused() {
        let env = TestEnv::new("plain_new_slot").await;
        allow_plain(&env).await;
        insert_plain(&env, "n-1", 1).await;
        let mut relay = env.relay(&[], &[]);
        let status = relay.wait_exit(Duration::from_secs(60)).await;
        assert!(!status.success(), "refused");
        let log = relay.log_text();
        assert!(
            log.contains("cannot continue their numbering") && log.contains("before any writer inserts plainly"),
            "names the cause and the way out: {log}"
        );
        assert_eq!(env.count("SELECT count(*) FROM outbox.receipts").await, 0);
        assert_eq!(env.count("SELECT count(*) FROM outbox.quarantine").await, 0);
    }

    /// An unclear attempt of a plain row recorded by another relay generation (a paused
    /// relay's salvage) while this one runs: the running reconciliation looks it up with the
    /// version and route version the attempt kept (the row itself has neither) and closes it
    /// at the copy it finds. Found by the simulator: the relay loaded the row from SQL, could
    /// not read it, and stopped, again at every restart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unclear_attempt_of_a_plain_row_is_looked_up_as_the_relay_published_it() {
        let env = TestEnv::new("plain_unknown").await;
        allow_plain(&env).await;
        let mut relay = env.relay(&[], &["--unknown-settle-ms", "300"]);
        env.wait_streaming().await;
        for n in 1..=3 {
            insert_plain(&env, "u-1", n).await;
        }
        env.wait_receipts("the plain rows' receipts", 3).await;
        let (id, version, partition): (uuid::Uuid, i64, i32) = {
            let r = env
                .db
                .query_one(
                    "SELECT event_id, aggregate_version, partition FROM outbox.receipts
                     ORDER BY aggregate_version DESC LIMIT 1",
                    &[],
                )
                .await
                .unwrap();
            (r.get(0), r.get(1), r.get(2))
        };
        // What a paused relay of generation 0 records for it, as the relay records it.
        env.db
            .execute(
                "INSERT INTO outbox.attempts (event_id, relay_generation, attempt_generation, slot_name,
                                              topic, partition, sent_at, error, relay_version,
                                              relay_route_version)
                 VALUES ($1, 0, 1, $2, $3, $4, clock_timestamp(), 'Local: Message timed out',
                         $5, 0)",
                &[&id, &env.slot, &env.topic, &partition, &version],
            )
            .await
            .unwrap();
        env.wait_zero(
            "the plain row's unclear attempt, looked up",
            &format!(
                "SELECT count(*) FROM outbox.attempts
                 WHERE event_id = '{id}' AND state = 'DISPATCH_UNKNOWN'"
            ),
        )
        .await;
        relay.assert_running();
        assert_eq!(version, 3);
        let copies = env
            .read_topic()
            .await
            .into_iter()
            .filter(|m| m.id() == id.to_string())
            .count();
        assert!(copies >= 1);
    }

    /// A plain row the broker refuses (too large for the producer's limit) holds its
    /// aggregate, and the rows behind it are held with the versions the stream gave them.
    /// After a restart with the limit raised, an operator's release publishes the refused row
    /// and the held ones from SQL, where they have neither version nor route, as the stream
    /// numbered and routed them (the hold and the held records keep both, migration 0042):
    /// versions 1..n on the broker in order, every copy with its receipt's version, and the
    /// aggregate flows again. Without what the records keep, the release quarantined the
    /// held rows as `unnumbered_row` and held the aggregate for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_released_plain_aggregate_publishes_its_held_rows_as_the_stream_numbered_them() {
        let env = TestEnv::new("plain_release").await;
        allow_plain(&env).await;
        let mut relay = env.relay(&[], &["--kafka-property", "message.max.bytes=2000"]);
        env.wait_streaming().await;
        let mut ids = vec![insert_plain(&env, "r-1", 1).await];
        let big: uuid::Uuid = env
            .db
            .query_one(
                "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ($1, 'r-1', 'test.happened', jsonb_build_object('blob', repeat('y', 5000)))
                 RETURNING event_id",
                &[&env.aggregate_type],
            )
            .await
            .unwrap()
            .get(0);
        ids.push(big);
        for n in 3..=4 {
            ids.push(insert_plain(&env, "r-1", n).await);
        }
        env.wait_count(
            "the large row refused and the two behind it held",
            "SELECT count(*) FROM outbox.held_events",
            2,
        )
        .await;
        let (code, held_route): (String, Option<i64>) = {
            let r = env
                .db
                .query_one(
                    "SELECT q.reason_code, h.blocking_route_version
                     FROM outbox.quarantine q JOIN outbox.holds h ON h.blocking_event_id = q.event_id
                     WHERE q.event_id = $1",
                    &[&big],
                )
                .await
                .unwrap();
            (r.get(0), r.get(1))
        };
        assert_eq!(code, "broker_rejected");
        assert!(held_route.is_some(), "the hold keeps the route the relay gave the row");

        relay.kill9();
        let relay = env.relay(&[], &[]);
        env.wait_ready(&relay).await;
        ids.push(insert_plain(&env, "r-1", 5).await);
        env.wait_count("r-1 #5 held too", "SELECT count(*) FROM outbox.held_events", 3)
            .await;
        let (released, out) = crate::harness::outboxd(&[
            "quarantine",
            "release",
            "--database-url",
            &env.url,
            "--event",
            &big.to_string(),
            "--by",
            "test",
        ]);
        assert!(released, "{out}");
        env.wait_receipts("the released rows published", 5).await;
        env.wait_zero("the hold closed", "SELECT count(*) FROM outbox.holds").await;
        ids.push(insert_plain(&env, "r-1", 6).await);
        env.wait_receipts("the aggregate flowing again", 6).await;

        let receipts: HashMap<uuid::Uuid, i64> = env
            .db
            .query("SELECT event_id, aggregate_version FROM outbox.receipts", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let not_in_commit_order: Vec<String> = ids
            .iter()
            .enumerate()
            .filter(|(k, id)| receipts.get(*id) != Some(&(*k as i64 + 1)))
            .map(|(k, id)| format!("#{}: {id} has {:?}", k + 1, receipts.get(id)))
            .collect();
        assert_eq!(not_in_commit_order, Vec::<String>::new(), "receipts not 1..n in commit order");
        let messages = env.read_topic().await;
        let differs: Vec<String> = messages
            .iter()
            .filter_map(|m| {
                let id: uuid::Uuid = m.id().parse().ok()?;
                let header = m.headers.get("aggregate_version")?;
                (receipts.get(&id).map(|v| v.to_string()).as_ref() != Some(header))
                    .then(|| format!("{id}: header {header}"))
            })
            .collect();
        assert_eq!(differs, Vec::<String>::new(), "copies whose version is not their receipt's");
        assert_eq!(
            crate::ordering::first_occurrences(&messages)["r-1"],
            vec![1, 2, 3, 4, 5, 6],
            "published in version order"
        );
        assert_eq!(
            env.count("SELECT count(*) FROM outbox.quarantine WHERE released_at IS NULL").await,
            0,
            "nothing quarantined again"
        );
    }

    /// An outbox written through `outbox.enqueue` and then switched to plain INSERTs
    /// (`outbox.allow_plain_inserts(true)`, migration 0043): `outbox.enqueue` itself writes rows
    /// without a version from the switch on (a session that called it before the switch
    /// included), and the relay numbers each aggregate's first plain row after the versions its
    /// rows were written with, whether the row came from `outbox.enqueue` or a plain INSERT.
    /// Counted: receipts whose versions are not 1..n in commit order, and copies whose version
    /// differs from their receipt's; both must be 0 (a relay that seeds its numbering from the
    /// checkpoint alone numbers the first plain row 1 again and fails both).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_outbox_switched_to_plain_inserts_continues_each_aggregate_after_its_versions() {
        let env = TestEnv::new("plain_switch").await;
        let _relay = env.relay(&[], &[]);
        env.wait_streaming().await;
        let enqueue = |aggregate_id: &'static str, n: i64| {
            let db = &env.db;
            let aggregate_type = env.aggregate_type.clone();
            async move {
                let id: uuid::Uuid = db
                    .query_one(
                        "SELECT outbox.enqueue($1, $2, 'test.happened', jsonb_build_object('n', $3::int8))",
                        &[&aggregate_type, &aggregate_id, &n],
                    )
                    .await
                    .expect("enqueue")
                    .get(0);
                id
            }
        };
        // Per aggregate, its events in commit order (one transaction each, one writer).
        let mut written: HashMap<&str, Vec<uuid::Uuid>> = HashMap::new();
        for (agg, n) in [("s-1", 1), ("s-2", 2), ("s-1", 3), ("s-1", 4), ("s-2", 5)] {
            written.entry(agg).or_default().push(enqueue(agg, n).await);
        }
        allow_plain(&env).await;
        for (agg, n, plain) in [
            ("s-1", 6, false),
            ("s-2", 7, true),
            ("s-3", 8, false),
            ("s-1", 9, true),
            ("s-2", 10, false),
        ] {
            let id = if plain { insert_plain(&env, agg, n).await } else { enqueue(agg, n).await };
            written.entry(agg).or_default().push(id);
        }
        let unversioned = env
            .count("SELECT count(*) FROM outbox.events WHERE aggregate_version IS NULL")
            .await;
        assert_eq!(unversioned, 5, "outbox.enqueue writes rows without a version after the switch");
        env.wait_receipts("every event's receipt", 10).await;

        let receipts = receipts_of(&env).await;
        assert_eq!(not_in_commit_order(&written, &receipts), Vec::<String>::new(), "receipts not 1..n in commit order");
        let messages = env.read_topic().await;
        assert_eq!(messages.len(), 10, "one copy per event");
        assert_eq!(versions_differ(&messages, &receipts), Vec::<String>::new(), "copies whose version is not their receipt's");
        assert_eq!(env.count("SELECT count(*) FROM outbox.quarantine").await, 0);
    }

    /// A due fold of the numbering log runs beside the acceptances while the relay streams
    /// (`outbox_ledger::numbering::fold` on a connection of its own, after the acceptance that
    /// found it due committed): folded inside that acceptance, a log of two million entries
    /// held it, and every receipt behind it, for 1.4 s. With a fold due after every second
    /// log row (`OUTBOXD_NUMBERING_FOLD_ROWS=2`), the map holds the numbering while the run
    /// goes on (the run's start folded an empty log: only a fold during the run writes the
    /// map), and the versions stay 1..n. A relay that never folds during a run fails it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_numbering_log_is_folded_while_the_relay_runs() {
        let env = TestEnv::new("plain_fold").await;
        allow_plain(&env).await;
        let relay = env.relay(&[("OUTBOXD_NUMBERING_FOLD_ROWS", "2")], &[]);
        env.wait_streaming().await;
        let mut written: HashMap<&str, Vec<uuid::Uuid>> = HashMap::new();
        // One acceptance, and one checkpoint with its log row, per round.
        for round in 0..6 {
            for agg in ["f-1", "f-2"] {
                written
                    .entry(agg)
                    .or_default()
                    .push(insert_plain(&env, agg, round).await);
            }
            env.wait_receipts("this round's receipts", 2 * (round as usize + 1))
                .await;
        }
        env.wait_count(
            "the map written by a fold during the run",
            &format!(
                "SELECT count(*) FROM outbox.stream_versions WHERE slot_name = '{}' AND version >= 2",
                env.slot
            ),
            2,
        )
        .await;
        // The fold's task writes its line just after its statement commits.
        outbox_testkit::wait::wait_for(
            "the fold in the relay's log",
            Duration::from_secs(30),
            || async {
                if relay.log_text().contains("numbering log folded") {
                    Ok(())
                } else {
                    Err("not yet".to_string())
                }
            },
        )
        .await;
        let receipts = receipts_of(&env).await;
        assert_eq!(not_in_commit_order(&written, &receipts), Vec::<String>::new(), "receipts not 1..n in commit order");
        let messages = env.read_topic().await;
        assert_eq!(versions_differ(&messages, &receipts), Vec::<String>::new(), "copies whose version is not their receipt's");
    }
}
