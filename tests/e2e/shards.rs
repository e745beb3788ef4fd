//! A sharded outbox (`outboxd migrate --shards N`, `outboxd run --shard I/N`): every
//! committed event published once by the relay of its aggregate's shard, in order per
//! aggregate, through a SIGKILL and a change from 2 to 4 shards while writers keep writing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::harness::{connect, outboxd, RelayProcess, TestEnv, LONG};
use crate::ordering::first_occurrences;
use outbox_testkit::wait::wait_for;

/// The relay of shard `i` of `n`, in CDC mode (a sharded outbox has no poll mode yet).
fn shard_relay(env: &TestEnv, i: u16, n: u16, id: &str) -> RelayProcess {
    let shard = format!("{i}/{n}");
    env.relay(&[], &["--mode", "cdc", "--shard", &shard, "--relay-id", id])
}

/// Until the `n` shard slots are active and each has its relay's checkpoint with the initial
/// snapshot done: a slot being created is active too (its relay waits there for every
/// transaction running in the cluster to end), and is not streaming yet.
async fn wait_shards_streaming(env: &TestEnv, n: u16) {
    let like = format!("{}_shard%of{n}", env.slot);
    wait_for(&format!("{n} shard slots streaming"), LONG, || async {
        let active = env
            .count(&format!(
                "SELECT count(*) FROM pg_replication_slots s
                 JOIN outbox.checkpoints c ON c.slot_name = s.slot_name AND c.snapshot_done
                 WHERE s.slot_name LIKE '{like}' AND s.active"
            ))
            .await;
        if active == i64::from(n) {
            Ok(())
        } else {
            Err(format!("{active} of {n}"))
        }
    })
    .await;
}

/// Writers enqueueing through `outbox.enqueue`, each over its own aggregates, recording every
/// committed event (id -> aggregate, its n-th event).
struct Writers {
    committed: Arc<Mutex<HashMap<uuid::Uuid, (String, i64)>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    /// `writers` writers over `aggregates` aggregates each, ~150 events/s per writer.
    fn start(env: &TestEnv, writers: usize, aggregates: usize) -> Writers {
        let committed: Arc<Mutex<HashMap<uuid::Uuid, (String, i64)>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..writers)
            .map(|w| {
                let (url, ty, stop, committed) = (
                    env.url.clone(),
                    env.aggregate_type.clone(),
                    stop.clone(),
                    committed.clone(),
                );
                tokio::spawn(async move {
                    let c = connect(&url).await;
                    let mut next: HashMap<String, i64> = HashMap::new();
                    let mut i = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        let agg = format!("w{w}-a{}", i % aggregates);
                        let n = *next.entry(agg.clone()).or_insert(1);
                        let id: uuid::Uuid = c
                            .query_one(
                                "SELECT outbox.enqueue($1, $2, 'test.happened', jsonb_build_object('n', $3::int8))",
                                &[&ty, &agg, &n],
                            )
                            .await
                            .unwrap()
                            .get(0);
                        next.insert(agg.clone(), n + 1);
                        committed.lock().unwrap().insert(id, (agg, n));
                        i += 1;
                        tokio::time::sleep(Duration::from_millis(6)).await;
                    }
                })
            })
            .collect();
        Writers {
            committed,
            stop,
            tasks,
        }
    }

    /// Until `n` more events are committed (`what`); a writer that fails, or the harness's
    /// deadline passing, fails the test.
    async fn wait_more(&mut self, what: &str, n: usize) {
        let committed = self.committed.clone();
        crate::harness::wait_for_writers(
            what,
            LONG,
            &mut self.tasks,
            || committed.lock().unwrap().len(),
            n,
        )
        .await
    }

    /// Stops the writers; what they committed.
    async fn finish(self) -> HashMap<uuid::Uuid, (String, i64)> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        std::mem::take(&mut *self.committed.lock().unwrap())
    }
}

/// Every committed event has a receipt from the slot of its aggregate's shard in one of
/// `layouts` (shard counts), is on the broker where its receipt says, and each aggregate's
/// first occurrences are 1, 2, 3, ...
async fn assert_published_by_their_shards(
    env: &TestEnv,
    committed: &HashMap<uuid::Uuid, (String, i64)>,
    layouts: &[u16],
) {
    env.wait_count(
        "every committed event has a receipt",
        "SELECT count(*) FROM outbox.receipts",
        committed.len() as i64,
    )
    .await;
    let slots: Vec<String> = layouts
        .iter()
        .map(|n| {
            format!(
                "'{}_shard' || get_byte(decode(md5(e.aggregate_id), 'hex'), 0) % {n} || 'of{n}'",
                env.slot
            )
        })
        .collect();
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM outbox.receipts r JOIN outbox.events e USING (event_id)
             WHERE r.slot_name NOT IN ({})",
            slots.join(", ")
        ))
        .await,
        0,
        "an event published by another shard's relay"
    );
    let check = env.verify_receipts(&[&env.topic]).await;
    let on_broker: std::collections::HashSet<String> =
        check.messages.iter().map(|m| m.id().to_string()).collect();
    let missing = committed
        .keys()
        .filter(|id| !on_broker.contains(&id.to_string()))
        .count();
    assert_eq!(missing, 0, "committed events not on the broker");
    let order = first_occurrences(&check.messages);
    let mut per_agg: HashMap<&str, i64> = HashMap::new();
    for (agg, _) in committed.values() {
        *per_agg.entry(agg.as_str()).or_default() += 1;
    }
    for (agg, n) in per_agg {
        let expected: Vec<i64> = (1..=n).collect();
        assert_eq!(
            order[agg], expected,
            "{agg}: first occurrences out of order"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_outbox_publishes_every_event_by_its_shard_in_order_across_a_reshard() {
    let env = TestEnv::new("shards").await;
    let (ok, out) = outboxd(&["migrate", "--database-url", &env.url, "--shards", "2"]);
    assert!(ok && out.contains("2 shard(s)"), "{out}");
    let mut relays: Vec<RelayProcess> = (0..2)
        .map(|i| shard_relay(&env, i, 2, &format!("r2-{i}")))
        .collect();
    wait_shards_streaming(&env, 2).await;

    let mut writers = Writers::start(&env, 2, 8);
    writers
        .wait_more("200 events before a shard's relay is killed", 200)
        .await;
    // A relay dies; its restart (another relay id) takes its shard over at once.
    relays[1].kill9();
    writers
        .wait_more("100 events while shard 1's relay is dead", 100)
        .await;
    relays[1] = shard_relay(&env, 1, 2, "r2-1-restarted");
    wait_shards_streaming(&env, 2).await;
    writers
        .wait_more("150 events after shard 1's relay restarted", 150)
        .await;

    // 2 -> 4 shards: refused while the old layout runs.
    let (ok, out) = outboxd(&["migrate", "--database-url", &env.url, "--shards", "4"]);
    assert!(!ok && out.contains("held by a running relay"), "{out}");
    for r in &relays {
        r.signal(libc::SIGTERM);
    }
    for r in &mut relays {
        assert!(r.wait_exit(LONG).await.success(), "{}", r.log_text());
    }
    // Written while no relay runs: the new shards' first snapshots publish these.
    writers
        .wait_more("100 events while no relay runs", 100)
        .await;
    let (ok, out) = outboxd(&["migrate", "--database-url", &env.url, "--shards", "4"]);
    assert!(
        ok && out.contains("4 shard(s)") && out.contains("dropped slot"),
        "{out}"
    );
    let _new: Vec<RelayProcess> = (0..4)
        .map(|i| shard_relay(&env, i, 4, &format!("r4-{i}")))
        .collect();
    wait_shards_streaming(&env, 4).await;
    writers.wait_more("200 events on 4 shards", 200).await;
    let committed = writers.finish().await;
    // Each receipt from the relay of its aggregate's shard, in the layout of its time.
    assert_published_by_their_shards(&env, &committed, &[2, 4]).await;
    let slots_used = env
        .count("SELECT count(DISTINCT slot_name) FROM outbox.receipts")
        .await;
    println!(
        "shards: {} committed events, published by {slots_used} shard slots (2, then 4)",
        committed.len()
    );
    assert_eq!(slots_used, 6, "every shard of both layouts published");
}

/// A relay still creating its slot (CREATE_REPLICATION_SLOT waits for every transaction
/// running in the cluster) holds its lease and has no checkpoint yet: a layout change then is
/// refused as it is while a relay streams. Found by a fresh-clone CI run (2026-12-07): a shard
/// relay of the old layout sat in slot creation, the test's check of "streaming" counted its
/// slot as active, and `migrate --shards 4` went ahead. The starting relay is staged here as
/// its ledger and server show it: its slot exists, its lease is live, no checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_change_is_refused_while_a_relay_of_the_old_layout_creates_its_slot() {
    let env = TestEnv::new("shards_starting").await;
    let (ok, out) = outboxd(&["migrate", "--database-url", &env.url, "--shards", "2"]);
    assert!(ok && out.contains("2 shard(s)"), "{out}");
    let slot = format!("{}_shard0of2", env.slot);
    env.db
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .expect("the starting relay's slot");
    env.db
        .execute(
            "INSERT INTO outbox.relay_leases (slot_name, owner, generation, lease_until)
             VALUES ($1, 'r-starting', 1, clock_timestamp() + interval '1 hour')",
            &[&slot],
        )
        .await
        .expect("the starting relay's lease");
    let (ok, out) = outboxd(&["migrate", "--database-url", &env.url, "--shards", "4"]);
    assert!(
        !ok && out.contains(&format!("slot {slot} is being started by relay r-starting")),
        "a layout change went ahead while a relay of the old layout was starting: {out}"
    );
    // Its lease lapsed (the relay died before its first checkpoint): nothing holds the layout.
    env.db
        .execute(
            "UPDATE outbox.relay_leases SET lease_until = clock_timestamp() - interval '1 second'
             WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("lapse the lease");
    let (ok, out) = outboxd(&["migrate", "--database-url", &env.url, "--shards", "4"]);
    assert!(ok && out.contains("4 shard(s)"), "{out}");
    env.db
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .expect("drop the staged slot");
}

/// `outboxd run --fleet`: a member of the relay fleet sharing every shard.
fn fleet_member(env: &TestEnv, id: &str) -> RelayProcess {
    env.relay(&[], &["--mode", "cdc", "--fleet", "--relay-id", id])
}

/// Until the live leases of the `n` shards are held as `ok` accepts (owner -> shards), and
/// every shard slot streams.
async fn wait_holdings(
    env: &TestEnv,
    n: u16,
    what: &str,
    ok: impl Fn(&HashMap<String, i64>) -> bool,
) -> HashMap<String, i64> {
    let like = format!("{}_shard%of{n}", env.slot);
    wait_for(what, LONG, || async {
        let rows = env
            .db
            .query(
                "SELECT owner, count(*) FROM outbox.relay_leases
                 WHERE slot_name LIKE $1 AND lease_until > clock_timestamp() GROUP BY owner",
                &[&like],
            )
            .await
            .unwrap();
        let held: HashMap<String, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let active = env
            .count(&format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE '{like}' AND active"
            ))
            .await;
        if active == i64::from(n) && held.values().sum::<i64>() == i64::from(n) && ok(&held) {
            Ok(held)
        } else {
            Err(format!(
                "{active} of {n} slots streaming; leases {held:?}; the server's busy sessions: {}",
                busy_sessions(env).await
            ))
        }
    })
    .await
}

/// What every session of the server that is not idle does, and who blocks it: what a wait
/// that timed out shows (a relay's start waiting on a lock or a transaction elsewhere).
async fn busy_sessions(env: &TestEnv) -> String {
    let rows = env
        .db
        .query(
            "SELECT pid, datname, backend_type, state, wait_event_type, wait_event,
                    pg_blocking_pids(pid)::text, left(regexp_replace(query, '\\s+', ' ', 'g'), 80),
                    extract(epoch FROM clock_timestamp() - coalesce(xact_start, query_start))::int
             FROM pg_stat_activity
             WHERE state IS DISTINCT FROM 'idle' AND pid <> pg_backend_pid()
               AND backend_type IN ('client backend', 'walsender')",
            &[],
        )
        .await;
    match rows {
        Ok(rows) => rows
            .iter()
            .map(|r| {
                format!(
                    "[{} {:?} {} {:?} {:?}/{:?} blocked by {:?} for {:?} s: {:?}]",
                    r.get::<_, i32>(0),
                    r.get::<_, Option<String>>(1),
                    r.get::<_, String>(2),
                    r.get::<_, Option<String>>(3),
                    r.get::<_, Option<String>>(4),
                    r.get::<_, Option<String>>(5),
                    r.get::<_, Option<String>>(6),
                    r.get::<_, Option<i32>>(8),
                    r.get::<_, Option<String>>(7),
                )
            })
            .collect::<Vec<_>>()
            .join(" "),
        Err(e) => format!("(pg_stat_activity: {e})"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_three_relays_shares_eight_shards_through_a_kill_and_a_pause() {
    let env = TestEnv::new("fleet").await;
    let (ok, out) = outboxd(&["migrate", "--database-url", &env.url, "--shards", "8"]);
    assert!(ok, "{out}");
    let a = fleet_member(&env, "fleet-a");
    let b = fleet_member(&env, "fleet-b");
    let mut c = fleet_member(&env, "fleet-c");
    let fair = |h: &HashMap<String, i64>| h.len() == 3 && h.values().all(|n| *n <= 3);
    wait_holdings(&env, 8, "3 members holding 8 shards, at most 3 each", fair).await;

    let mut writers = Writers::start(&env, 2, 16);
    writers
        .wait_more("150 events before a member is killed", 150)
        .await;

    // A member dies: the other two take its shards (at once: its lease sessions are gone).
    c.kill9();
    let killed = std::time::Instant::now();
    wait_holdings(&env, 8, "2 members holding all 8 shards", |h| {
        h.len() == 2 && !h.contains_key("fleet-c")
    })
    .await;
    let taken_after_kill = killed.elapsed();
    writers
        .wait_more(
            "100 events after the killed member's shards were taken",
            100,
        )
        .await;
    // It comes back under another id: the others hand shards over to it.
    let _c2 = fleet_member(&env, "fleet-c2");
    wait_holdings(&env, 8, "3 members again, at most 3 shards each", fair).await;
    writers
        .wait_more("100 events with the member back", 100)
        .await;

    // A member pauses past its lease: its shards move; resumed, it gets its share back.
    b.signal(libc::SIGSTOP);
    wait_holdings(&env, 8, "the paused member's shards taken over", |h| {
        !h.contains_key("fleet-b")
    })
    .await;
    writers
        .wait_more("100 events while a member is paused", 100)
        .await;
    b.signal(libc::SIGCONT);
    let resumed = std::time::Instant::now();
    wait_holdings(&env, 8, "the resumed member holding its share again", |h| {
        fair(h) && h.contains_key("fleet-b")
    })
    .await;
    let share_after_resume = resumed.elapsed();
    writers
        .wait_more("100 events after the paused member resumed", 100)
        .await;
    let committed = writers.finish().await;
    assert_published_by_their_shards(&env, &committed, &[8]).await;
    let (ok, out) = outboxd(&["status", "--database-url", &env.url]);
    assert!(
        ok && out.contains("FLEET MEMBER") && out.contains("fleet-b"),
        "{out}"
    );
    println!(
        "fleet: {} committed events over 8 shards and 3 members (one killed, one paused); the killed member's shards streaming again after {:.1} s, the resumed member's fair share back after {:.1} s",
        committed.len(),
        taken_after_kill.as_secs_f64(),
        share_after_resume.as_secs_f64(),
    );
    drop(a);
}

/// A fleet member hands a shard over, and that shard relay's graceful stop hangs (failpoint
/// `before-stop-drain=hang`): the member aborts it after its grace (`--fleet-stop-grace-ms`,
/// 3 s here) and gives its lease back at once, so the member the shard was handed to streams it
/// then, not a lease TTL later (the TTL here is 30 s). The simulator proves the same with
/// `fleet-abort-keeps-lease`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_relay_whose_stop_hangs_is_aborted_and_its_lease_given_back() {
    const STOP_GRACE: Duration = Duration::from_secs(3);
    let env = TestEnv::new("fleet_hung_stop").await;
    let (ok, out) = outboxd(&["migrate", "--database-url", &env.url, "--shards", "4"]);
    assert!(ok, "{out}");
    let member = |id: &str, envs: &[(&str, &str)]| {
        env.relay(
            envs,
            &[
                "--mode",
                "cdc",
                "--fleet",
                "--relay-id",
                id,
                "--lease-ttl-ms",
                "30000",
                "--fleet-stop-grace-ms",
                "3000",
            ],
        )
    };
    let mut a = member(
        "hung-a",
        &[("OUTBOXD_FAILPOINTS", "before-stop-drain=hang")],
    );
    wait_holdings(&env, 4, "the first member holding all 4 shards", |h| {
        h.get("hung-a") == Some(&4)
    })
    .await;
    // A second member: the first is over its share and stops two shards, whose stops hang.
    let _b = member("hung-b", &[]);
    let joined = std::time::Instant::now();
    wait_holdings(&env, 4, "the second member holding its share", |h| {
        h.get("hung-b") == Some(&2) && h.get("hung-a") == Some(&2)
    })
    .await;
    let took = joined.elapsed();
    let log = a.log_text();
    assert!(
        log.contains("failpoint before-stop-drain reached") && took >= STOP_GRACE,
        "the hand-over's stop did not hang (share moved after {took:?}): {log}"
    );
    assert!(
        log.contains("a stopped shard relay did not end in time; aborting it"),
        "{log}"
    );
    assert!(
        took < STOP_GRACE + Duration::from_secs(10),
        "the second member got its share {took:?} after joining: the aborted relays' leases were not given back (TTL 30 s)"
    );
    a.assert_running();
}
