//! Replacing a polling relay without a flag day (docs/migrating.md): a team's own outbox table
//! and poller (`legacy-poller`, plain SQL), four writers that never change, and outboxd
//! attaching, shadowing, taking over two aggregate types and then all, and handing one back,
//! with both relays SIGKILLed along the way. Asserted from the broker's contents and the
//! writers' own records, never from outboxd's word alone.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::{connect, outboxd, RelayProcess, TestEnv, TopicMessage};

const TABLE_DDL: &str = "CREATE SCHEMA app;
     CREATE TABLE app.outbox (
         seq           bigserial,
         id            uuid PRIMARY KEY,
         aggregatetype text NOT NULL,
         aggregateid   text NOT NULL,
         type          text NOT NULL,
         payload       jsonb NOT NULL,
         created_at    timestamptz NOT NULL DEFAULT now(),
         published_at  timestamptz
     );
     CREATE INDEX outbox_unpublished ON app.outbox (seq) WHERE published_at IS NULL;";

const INSERT: &str =
    "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) VALUES ($1, $2, $3, $4, $5)";

/// The testkit's `legacy-poller` binary, next to this test binary's directory.
fn poller_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = dir.join("legacy-poller");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p outbox-testkit --bin legacy-poller` (`cargo test --workspace` builds it)",
        bin.display()
    );
    bin
}

/// `outboxd migrate --poller-table app.outbox --published-column published_at` and `extra`:
/// attaches the test's poller table; what it printed.
fn attach(env: &TestEnv, extra: &[&str]) -> String {
    let mut args = vec![
        "migrate",
        "--database-url",
        &env.url,
        "--poller-table",
        "app.outbox",
        "--published-column",
        "published_at",
    ];
    args.extend(extra);
    let (ok, out) = outboxd(&args);
    assert!(ok, "attaching app.outbox: {out}");
    out
}

fn start_poller(env: &TestEnv, extra: &[&str]) -> RelayProcess {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut cmd = Command::new(poller_binary());
    cmd.args([
        "--database-url",
        &env.url,
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
    ])
    .args(extra);
    RelayProcess::spawn(cmd, env.dir.path().join(format!("poller-{n}.log")))
}

/// SIGKILLs the poller and waits until its backend (and the row locks of its open claim) is
/// gone, as a team's supervisor restarting it would find it. A restart before that would skip
/// the locked rows and could publish an aggregate's later row first: a property of
/// SKIP LOCKED pollers, not of the switch under test.
async fn kill_poller(env: &TestEnv, p: &mut RelayProcess) {
    p.kill9();
    env.wait_zero(
        "the killed poller's backend to end",
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'legacy-poller' AND datname = current_database()",
    )
    .await;
}

/// `outboxd share CMD --database-url URL SELECTION... --wait 60s` as arguments for
/// [`outboxd_async`]; `selection` is `--aggregate-type T` (with `--buckets ...`) or `--all`.
fn share_args(env: &TestEnv, cmd: &str, selection: &[&str]) -> Vec<String> {
    let mut args = vec![
        "share".to_string(),
        cmd.to_string(),
        "--database-url".into(),
        env.url.clone(),
    ];
    args.extend(selection.iter().map(|s| s.to_string()));
    args.extend(["--wait".to_string(), "60s".to_string()]);
    args
}

async fn outboxd_async(args: Vec<String>) -> (bool, String) {
    tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        outboxd(&a)
    })
    .await
    .unwrap()
}

/// `outboxd shadow --once --json`: its exit status and report. The report's Prometheus file
/// (`--metrics-file`) is checked against the JSON, field by field.
fn shadow_report(env: &TestEnv, topics: &[String], grace: &str) -> (i32, Value) {
    let metrics = env.dir.path().join("shadow.prom");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outboxd"));
    cmd.args([
        "shadow",
        "--once",
        "--json",
        "--grace",
        grace,
        "--database-url",
        &env.url,
        "--bootstrap-servers",
        env.kafka.bootstrap_servers(),
        "--metrics-file",
        metrics.to_str().unwrap(),
    ]);
    for t in topics {
        cmd.args(["--topic", t]);
    }
    let out = cmd.output().expect("run outboxd shadow");
    let text = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "shadow printed no JSON ({e}): {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let prom = std::fs::read_to_string(&metrics).expect("the shadow's metrics file");
    let mut faults = 0;
    for (field, value) in report.as_object().unwrap() {
        let Some(v) = value.as_i64() else { continue };
        let series = format!("outboxd_shadow_{field} {v}");
        assert!(
            prom.lines().any(|l| l == series),
            "{series} missing:\n{prom}"
        );
        if [
            "lost",
            "key_mismatches",
            "payload_mismatches",
            "both_owners",
        ]
        .contains(&field.as_str())
        {
            faults += v;
        }
    }
    assert!(
        prom.lines()
            .any(|l| l == format!("outboxd_shadow_faults {faults}")),
        "{prom}"
    );
    (out.status.code().unwrap_or(-1), report)
}

fn by_outboxd(m: &TopicMessage) -> bool {
    m.headers.contains_key("envelope_generation")
}

/// One committed row, as its writer recorded it.
#[derive(Debug, Clone)]
struct Written {
    aggregate: String,
    n: i64,
}

#[derive(Default)]
struct Log {
    committed: HashMap<uuid::Uuid, Written>,
    rolled_back: Vec<uuid::Uuid>,
}

/// `share take --buckets` of about half the hash buckets of `ty`'s aggregates (the writers'
/// aggregates `w{w}-a{j}` with `(w + j) % 4 == k`), with the writers running; then checks that
/// rows of the type captured since go to outboxd exactly when their aggregate's bucket was
/// taken.
async fn take_half_of_the_buckets(
    env: &TestEnv,
    ty: &str,
    k: usize,
    writers: &mut [tokio::task::JoinHandle<()>],
    committed: impl Fn() -> usize,
) {
    let aggregates: Vec<String> = (0..4usize)
        .flat_map(|w| {
            (0..6usize)
                .filter(move |j| (w + j) % 4 == k)
                .map(move |j| format!("w{w}-a{j}"))
        })
        .collect();
    let mut buckets: Vec<i32> = env
        .db
        .query(
            "SELECT DISTINCT outbox.share_bucket(a) FROM unnest($1::text[]) a ORDER BY 1",
            &[&aggregates],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(buckets.len() > 1, "{aggregates:?} fall in one bucket");
    buckets.truncate(buckets.len() / 2);
    let bucket_list = buckets
        .iter()
        .map(i32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let (ok, out) = outboxd_async(share_args(
        env,
        "take",
        &["--aggregate-type", ty, "--buckets", &bucket_list],
    ))
    .await;
    assert!(
        ok && out.contains(&format!(
            "outboxd owns aggregate type {ty} buckets {bucket_list} of 16"
        )),
        "{out}"
    );
    crate::harness::wait_for_writers(
        "60 rows after outboxd took buckets",
        crate::harness::LONG,
        writers,
        committed,
        60,
    )
    .await;
    // Rows of the type captured since: outboxd's exactly when their aggregate is in a bucket
    // it took (checked before the rest of the type is taken).
    let split = env
        .db
        .query_one(
            "WITH since AS (SELECT max(changed_at) AS t FROM outbox.dispatch_shares
                            WHERE aggregate_type = $1 AND bucket >= 0)
             SELECT (SELECT count(*) FROM outbox.events
                     WHERE aggregate_type = $1 AND outbox.share_bucket(aggregate_id) = ANY ($2)),
                    (SELECT count(*) FROM outbox.events
                     WHERE aggregate_type = $1 AND outbox.share_bucket(aggregate_id) <> ALL ($2)),
                    (SELECT count(*) FROM outbox.legacy_events, since
                     WHERE aggregate_type = $1 AND captured_at > since.t
                       AND outbox.share_bucket(aggregate_id) <> ALL ($2)),
                    (SELECT count(*) FROM outbox.legacy_events, since
                     WHERE aggregate_type = $1 AND captured_at > since.t
                       AND outbox.share_bucket(aggregate_id) = ANY ($2))",
            &[&ty, &buckets],
        )
        .await
        .unwrap();
    let split: Vec<i64> = (0..4).map(|i| split.get(i)).collect();
    println!("buckets {bucket_list} of {ty}: outboxd events in / out of them {} / {}, poller rows since out / in {} / {}", split[0], split[1], split[2], split[3]);
    assert!(
        split[0] > 0 && split[1] == 0 && split[2] > 0 && split[3] == 0,
        "a bucket share's rows go to outboxd, the rest of the type's to the poller: {split:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_relay_is_replaced_share_by_share_and_one_share_is_handed_back() {
    let env = TestEnv::new("takeover").await;
    let types: Vec<String> = (0..4)
        .map(|k| format!("{}_{k}", env.aggregate_type))
        .collect();
    let topics: Vec<String> = types.iter().map(|t| format!("outbox.event.{t}")).collect();
    for t in &topics {
        env.kafka.create_topic(t, 3).expect("create topic");
    }
    env.db.batch_execute(TABLE_DDL).await.unwrap();

    // Before outboxd: four rows the poller already published, three it has not.
    let mut pre_marked = Vec::new();
    let log = Arc::new(Mutex::new(Log::default()));
    for i in 0..7 {
        let id = uuid::Uuid::new_v4();
        let agg = format!("pre-{i}");
        env.db
            .execute(
                INSERT,
                &[&id, &types[i % 4], &agg, &"Created", &json!({"n": 1})],
            )
            .await
            .unwrap();
        if i < 4 {
            env.db
                .execute(
                    "UPDATE app.outbox SET published_at = now() WHERE id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            pre_marked.push(id);
        } else {
            log.lock().unwrap().committed.insert(
                id,
                Written {
                    aggregate: agg,
                    n: 1,
                },
            );
        }
    }

    // 1. Attach.
    let out = attach(&env, &[]);
    assert!(out.contains("7 existing row(s)"), "{out}");
    let mut poller = start_poller(&env, &[]);
    let mut relay = env.relay(&[], &[]);
    env.wait_streaming().await;

    // Four writers, each with its own aggregates (one type each), one in ten transactions
    // rolled back.
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4usize {
        let (url, types, stop, log) = (env.url.clone(), types.clone(), stop.clone(), log.clone());
        writers.push(tokio::spawn(async move {
            let mut c = connect(&url).await;
            let mut next: BTreeMap<usize, i64> = BTreeMap::new();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let j = i % 6;
                let agg = format!("w{w}-a{j}");
                let ty = &types[(w + j) % 4];
                let n = next.get(&j).copied().unwrap_or(1);
                let id = uuid::Uuid::new_v4();
                let tx = c.transaction().await.unwrap();
                tx.execute(
                    INSERT,
                    &[
                        &id,
                        ty,
                        &agg,
                        &"Changed",
                        &json!({"w": w, "agg": agg, "n": n}),
                    ],
                )
                .await
                .unwrap();
                if i % 10 == 7 {
                    tx.rollback().await.unwrap();
                    log.lock().unwrap().rolled_back.push(id);
                } else {
                    tx.commit().await.unwrap();
                    next.insert(j, n + 1);
                    log.lock()
                        .unwrap()
                        .committed
                        .insert(id, Written { aggregate: agg, n });
                }
                i += 1;
                // ~400 rows/s in all: enough to keep every switch busy, light on a shared CI box.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    let committed = || log.lock().unwrap().committed.len();
    // Until `n` more rows are committed (`what`); a writer that fails, or the harness's
    // deadline passing, fails the test.
    macro_rules! wait_more {
        ($what:expr, $n:expr) => {
            crate::harness::wait_for_writers(
                $what,
                crate::harness::LONG,
                &mut writers,
                committed,
                $n,
            )
            .await
        };
    }

    // 2. Shadow: the poller owns everything; the shadow sees it publish, with no fault. The
    // poller's first rounds may come late on a loaded machine (a CI run once saw 0 of 214
    // published after 150 commits): the report is read until it shows the poller publishing.
    wait_more!("150 rows before the shadow report", 150);
    let mut seen = (0, Value::Null);
    outbox_testkit::wait::wait_for(
        "the shadow to see the poller publish",
        crate::harness::LONG,
        || {
            seen = shadow_report(&env, &topics, "1h");
            let published = seen.1["published"].as_i64().unwrap_or(0);
            let r = if published > 0 {
                Ok(())
            } else {
                Err(format!("{}", seen.1))
            };
            std::future::ready(r)
        },
    )
    .await;
    let (code, report) = seen;
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["both_owners"], 0, "{report}");
    assert!(report["published"].as_i64().unwrap() > 0, "{report}");
    kill_poller(&env, &mut poller).await;
    wait_more!("50 rows after the poller was killed", 50);
    poller = start_poller(&env, &[]);

    // 3a. Shares of two types' aggregates first: the hash buckets of about half of each
    // type's aggregates.
    for k in [1usize, 2] {
        take_half_of_the_buckets(&env, &types[k], k, &mut writers, committed).await;
    }

    // 3. Take over two types (the rest of the second), with the poller and the writers running.
    // The poller is paused during each switch, so the handover has both kinds of rows at
    // once: the poller's unpublished ones and outboxd's parked ones, of the same aggregates.
    // The take first proves with its canary that the poller respects ownership (the poller
    // must run for that): the poller is paused once its claim has asked about the canary
    // (the sequence moves once when the canary is inserted and once per question).
    for t in &types[..2] {
        let asks = env
            .count("SELECT last_value FROM outbox.poller_canary_asks")
            .await;
        let take = tokio::spawn(outboxd_async(share_args(
            &env,
            "take",
            &["--aggregate-type", t],
        )));
        env.wait_count(
            "the poller's claim to ask about the canary",
            &format!("SELECT last_value - {asks} FROM outbox.poller_canary_asks"),
            2,
        )
        .await;
        poller.signal(libc::SIGSTOP);
        env.wait_count(
            "rows parked for outboxd while the poller is paused",
            &format!("SELECT count(*) FROM outbox.parked_events WHERE aggregate_type = '{t}'"),
            5,
        )
        .await;
        let behind = env
            .count(&format!(
            "SELECT count(*) FROM app.outbox WHERE aggregatetype = '{t}' AND published_at IS NULL
               AND id IN (SELECT event_id FROM outbox.legacy_events)"
        ))
            .await;
        poller.signal(libc::SIGCONT);
        let (ok, out) = take.await.unwrap();
        println!("take {t}: the poller had {behind} row(s) of it to publish when paused");
        assert!(
            ok && out.contains(&format!("outboxd owns aggregate type {t}")),
            "{out}"
        );
    }
    wait_more!("100 rows after every take", 100);
    relay.kill9();
    wait_more!("50 rows while the relay is dead", 50);
    relay = env.relay(&[], &[]);

    // 4. Then all of them.
    let (ok, out) = outboxd_async(share_args(&env, "take", &["--all"])).await;
    assert!(
        ok && out.contains("outboxd owns every aggregate type"),
        "{out}"
    );
    wait_more!("100 rows after outboxd took every type", 100);
    kill_poller(&env, &mut poller).await;
    poller = start_poller(&env, &[]);

    // 5. Hand one back (rollback), relay SIGKILLed right after.
    let (ok, out) = outboxd_async(share_args(
        &env,
        "give-back",
        &["--aggregate-type", &types[1]],
    ))
    .await;
    assert!(
        ok && out.contains(&format!("the poller owns aggregate type {}", types[1])),
        "{out}"
    );
    let handed_back_at = committed();
    relay.kill9();
    wait_more!("100 rows after the give-back and the relay's SIGKILL", 100);
    relay = env.relay(&[], &[]);
    wait_more!("50 rows after the relay restarted", 50);
    // The handed-back type went back to the poller: rows written after the give-back.
    let after_handback: i64 = env
        .count(&format!(
            "SELECT count(*) FROM outbox.legacy_events WHERE aggregate_type = '{}' AND NOT before_attach
               AND captured_at > (SELECT changed_at FROM outbox.dispatch_shares WHERE aggregate_type = '{}' AND bucket = -1)",
            types[1], types[1]
        ))
        .await;
    assert!(
        after_handback > 0,
        "no row of {} went to the poller after the give-back ({handed_back_at} committed then)",
        types[1]
    );

    // 6. Taken again: outboxd's numbering of its aggregates goes on from the poller's rows
    // (header poller_events_before, checked per message below).
    let (ok, out) = outboxd_async(share_args(&env, "take", &["--aggregate-type", &types[1]])).await;
    assert!(
        ok && out.contains(&format!("outboxd owns aggregate type {}", types[1])),
        "{out}"
    );
    wait_more!("50 rows after the second take", 50);
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }

    // Everything committed is published by its owner.
    env.wait_zero(
        "every captured row published (poller rows marked, outboxd events with a receipt, nothing parked)",
        "SELECT (SELECT count(*) FROM app.outbox o JOIN outbox.legacy_events l ON l.event_id = o.id
                 WHERE o.published_at IS NULL)
              + (SELECT count(*) FROM outbox.events e
                 WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id))
              + (SELECT count(*) FROM outbox.parked_events)",
    )
    .await;
    relay.assert_running();
    poller.assert_running();

    let topic_refs: Vec<&str> = topics.iter().map(String::as_str).collect();
    let check = env.verify_receipts(&topic_refs).await;
    let msgs = check.messages;
    let log = std::mem::take(&mut *log.lock().unwrap());
    let mut by_id: HashMap<uuid::Uuid, Vec<&TopicMessage>> = HashMap::new();
    for m in &msgs {
        let id = uuid::Uuid::parse_str(m.id()).expect("every message carries an id");
        by_id.entry(id).or_default().push(m);
    }
    // Every committed row published; rolled-back and already-published rows never.
    let unpublished: Vec<uuid::Uuid> = log
        .committed
        .keys()
        .filter(|id| !by_id.contains_key(id))
        .copied()
        .collect();
    if !unpublished.is_empty() {
        let rows = env
            .db
            .query(
                "SELECT concat_ws(' ', i::text, 'legacy=' || (l.event_id IS NOT NULL), 'outbox=' || e.dest_topic,
                                  'receipt=' || r.topic || '/' || r.partition || '@' || r.\"offset\")
                 FROM unnest($1::uuid[]) i
                 LEFT JOIN outbox.legacy_events l ON l.event_id = i
                 LEFT JOIN outbox.events_frozen e ON e.event_id = i
                 LEFT JOIN outbox.receipts r ON r.event_id = i LIMIT 5",
                &[&unpublished],
            )
            .await
            .unwrap();
        let rows: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        panic!(
            "{} committed rows never published, e.g. (id, legacy, outbox topic, receipt): {rows:?}",
            unpublished.len()
        );
    }
    let rolled: Vec<_> = log
        .rolled_back
        .iter()
        .filter(|id| by_id.contains_key(id))
        .collect();
    assert_eq!(rolled.len(), 0, "rolled-back rows published: {rolled:?}");
    let republished: Vec<_> = pre_marked
        .iter()
        .filter(|id| by_id.contains_key(id))
        .collect();
    assert_eq!(
        republished.len(),
        0,
        "rows published before the attach, again: {republished:?}"
    );
    let strays: Vec<_> = by_id
        .keys()
        .filter(|id| !log.committed.contains_key(id))
        .collect();
    assert_eq!(
        strays.len(),
        0,
        "messages for ids no writer committed: {strays:?}"
    );

    // No event owned by both: each id's messages all come from one relay.
    let both: Vec<_> = by_id
        .iter()
        .filter(|(_, ms)| ms.iter().any(|m| by_outboxd(m)) && ms.iter().any(|m| !by_outboxd(m)))
        .map(|(id, _)| id)
        .collect();
    assert_eq!(both.len(), 0, "events published by both relays: {both:?}");
    let outboxd_ids: HashSet<_> = by_id
        .iter()
        .filter(|(_, ms)| by_outboxd(ms[0]))
        .map(|(id, _)| *id)
        .collect();
    let poller_ids: HashSet<_> = by_id
        .keys()
        .filter(|id| !outboxd_ids.contains(id))
        .copied()
        .collect();
    assert!(
        outboxd_ids.len() > 100 && poller_ids.len() > 100,
        "both relays published: outboxd {}, poller {}",
        outboxd_ids.len(),
        poller_ids.len()
    );
    // Versions a consumer can follow across the hand-overs: on each of outboxd's messages,
    // aggregate_version + poller_events_before is the event's place in its aggregate's
    // history (the writer's own count), whoever published the rows before it.
    let mut version_checked = 0;
    let mut after_poller_rows = 0;
    let mut version_breaks = Vec::new();
    for m in msgs.iter().filter(|m| by_outboxd(m)) {
        let w = &log.committed[&uuid::Uuid::parse_str(m.id()).unwrap()];
        let header = |h: &str| -> i64 {
            m.headers
                .get(h)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| {
                    panic!(
                        "outboxd's message {} has no header {h}: {:?}",
                        m.id(),
                        m.headers
                    )
                })
        };
        let (version, before) = (header("aggregate_version"), header("poller_events_before"));
        version_checked += 1;
        if before > 0 {
            after_poller_rows += 1;
        }
        if version + before != w.n {
            version_breaks.push(format!(
                "{} #{}: aggregate_version {version} + poller_events_before {before}",
                w.aggregate, w.n
            ));
        }
    }
    assert_eq!(
        version_breaks.len(),
        0,
        "outboxd messages whose place in the aggregate does not follow: {version_breaks:?}"
    );
    assert!(
        version_checked > 100 && after_poller_rows > 0,
        "versions checked on {version_checked} outboxd messages, {after_poller_rows} after poller rows"
    );
    // Rows outboxd took are marked in the team's table (out of the poller's claim).
    let unmarked = env
        .count(
            "SELECT count(*) FROM app.outbox o JOIN outbox.events e ON e.event_id = o.id
             WHERE o.published_at IS NULL",
        )
        .await;
    assert_eq!(
        unmarked, 0,
        "rows outboxd took, still unpublished in app.outbox"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM outbox.poller_canaries")
            .await
            + env
                .count("SELECT count(*) FROM app.outbox WHERE type = 'outboxd.ownership_canary'")
                .await,
        0,
        "canaries left behind"
    );

    // Per aggregate: one partition, first occurrences in the writer's order, nothing missing.
    let mut per_agg: HashMap<&str, Vec<&TopicMessage>> = HashMap::new();
    for m in &msgs {
        let id = uuid::Uuid::parse_str(m.id()).unwrap();
        per_agg
            .entry(log.committed[&id].aggregate.as_str())
            .or_default()
            .push(m);
    }
    for (agg, mut ms) in per_agg {
        let parts: HashSet<_> = ms.iter().map(|m| (m.key.clone(), m.partition)).collect();
        assert_eq!(
            parts.len(),
            1,
            "{agg}: messages under several keys/partitions: {parts:?}"
        );
        ms.sort_by_key(|m| m.offset);
        let mut seen = HashSet::new();
        let firsts: Vec<i64> = ms
            .iter()
            .map(|m| log.committed[&uuid::Uuid::parse_str(m.id()).unwrap()].n)
            .filter(|n| seen.insert(*n))
            .collect();
        let expected: Vec<i64> = (1..=firsts.len() as i64).collect();
        assert_eq!(firsts, expected, "{agg}: first occurrences out of order");
    }

    // The shadow's figures are the ones counted here from the broker.
    let (code, report) = shadow_report(&env, &topics, "0s");
    assert_eq!(code, 0, "{report}");
    let poller_copies: HashMap<_, usize> = poller_ids
        .iter()
        .filter(|id| !log.committed[id].aggregate.starts_with("pre-"))
        .map(|id| (*id, by_id[id].len()))
        .collect();
    let duplicated = poller_copies.values().filter(|c| **c > 1).count();
    let extra: usize = poller_copies.values().map(|c| c - 1).sum();
    println!(
        "takeover: {} committed, outboxd {} events, poller {} ({} duplicated, {} extra copies); shadow {report}",
        log.committed.len(),
        outboxd_ids.len(),
        poller_ids.len(),
        duplicated,
        extra
    );
    assert_eq!(report["events"], json!(poller_copies.len()), "{report}");
    assert_eq!(report["published"], json!(poller_copies.len()), "{report}");
    assert_eq!(report["duplicated"], json!(duplicated), "{report}");
    assert_eq!(report["extra_copies"], json!(extra), "{report}");
    assert_eq!(report["before_attach"], json!(7), "{report}");
    for fault in [
        "lost",
        "key_mismatches",
        "payload_mismatches",
        "both_owners",
        "unpublished",
        "in_flight",
    ] {
        assert_eq!(report[fault], 0, "{fault}: {report}");
    }
}

/// Every fault counter of the shadow report becomes non-zero when its bug is planted: a row
/// marked published but never sent (lost), a message under the wrong key and payload, and a
/// poller without the ownership predicate (both relays publish outboxd's events).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shadow_counts_loss_mismatches_and_double_owners_when_they_are_planted() {
    let env = TestEnv::new("takeover_faults").await;
    let ty = env.aggregate_type.clone();
    let topic = env.topic.clone();
    env.db.batch_execute(TABLE_DDL).await.unwrap();
    // Rows outboxd takes stay unpublished in the table, so the planted poller below (no
    // predicate) claims them too.
    attach(&env, &["--no-mark-published"]);

    // A poller that marks a row without publishing it.
    let lost = uuid::Uuid::new_v4();
    env.db
        .execute(INSERT, &[&lost, &ty, &"a-1", &"Created", &json!({"n": 1})])
        .await
        .unwrap();
    // A poller that publishes under another key and payload.
    let bent = uuid::Uuid::new_v4();
    env.db
        .execute(INSERT, &[&bent, &ty, &"a-2", &"Created", &json!({"n": 1})])
        .await
        .unwrap();
    crate::harness::produce_raw(
        env.kafka.bootstrap_servers(),
        &topic,
        "not-a-2",
        Some(&bent.to_string()),
        r#"{"n": 2}"#,
    );
    env.db
        .execute(
            "UPDATE app.outbox SET published_at = now() WHERE id = ANY($1)",
            &[&vec![lost, bent]],
        )
        .await
        .unwrap();

    // outboxd takes everything over; the poller leaves out the ownership predicate.
    let (ok, out) = outboxd(&[
        "share",
        "take",
        "--database-url",
        &env.url,
        "--all",
        "--wait",
        "30s",
        // No poller runs yet: no canary (the poller started below lacks the predicate).
        "--poller-stopped",
    ]);
    assert!(ok, "{out}");
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    let _poller = start_poller(&env, &["--no-ownership-predicate"]);
    let ids: Vec<uuid::Uuid> = (0..10).map(|_| uuid::Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        env.db
            .execute(
                INSERT,
                &[id, &ty, &format!("b-{i}"), &"Created", &json!({"i": i})],
            )
            .await
            .unwrap();
    }
    env.wait_count(
        "outboxd's receipts",
        "SELECT count(*) FROM outbox.receipts",
        10,
    )
    .await;
    env.wait_count(
        "the bad poller's marks",
        "SELECT count(*) FROM app.outbox WHERE published_at IS NOT NULL",
        12,
    )
    .await;

    let (code, report) = shadow_report(&env, &[topic], "0s");
    assert_eq!(code, 2, "faults found: exit status 2; {report}");
    assert_eq!(report["lost"], 1, "{report}");
    assert_eq!(report["key_mismatches"], 1, "{report}");
    assert_eq!(report["payload_mismatches"], 1, "{report}");
    assert_eq!(report["both_owners"], 10, "{report}");
}

/// `share take` and `share give-back` prove with a canary row that the poller's claim goes
/// through `outbox.poller_may_claim` before any owner changes: a poller without the predicate
/// makes both refuse, naming the fix, and leaves every owner as it was; a stopped poller makes
/// the take refuse too (no claim asked); nothing is published by both relays on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poller_without_the_predicate_makes_take_and_give_back_refuse() {
    let env = TestEnv::new("takeover_canary").await;
    let ty = env.aggregate_type.clone();
    let topic = env.topic.clone();
    env.db.batch_execute(TABLE_DDL).await.unwrap();
    attach(&env, &[]);
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    let mut poller = start_poller(&env, &["--no-ownership-predicate"]);

    // One writer all along, five aggregates of the type.
    let stop = Arc::new(AtomicBool::new(false));
    let committed: Arc<Mutex<HashMap<uuid::Uuid, Written>>> = Arc::default();
    let mut writers = vec![{
        let (url, ty, stop, committed) =
            (env.url.clone(), ty.clone(), stop.clone(), committed.clone());
        tokio::spawn(async move {
            let c = connect(&url).await;
            let mut next = [1i64; 5];
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let j = i % 5;
                let agg = format!("c-{j}");
                let id = uuid::Uuid::new_v4();
                c.execute(
                    INSERT,
                    &[
                        &id,
                        &ty,
                        &agg,
                        &"Changed",
                        &json!({"agg": agg, "n": next[j]}),
                    ],
                )
                .await
                .unwrap();
                committed.lock().unwrap().insert(
                    id,
                    Written {
                        aggregate: agg,
                        n: next[j],
                    },
                );
                next[j] += 1;
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    }];
    let share = |cmd: &str, extra: &[&str]| {
        let mut a: Vec<String> = [
            "share",
            cmd,
            "--database-url",
            &env.url,
            "--aggregate-type",
            &ty,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(["--wait".to_string(), "30s".to_string()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        outboxd_async(a)
    };
    let owners = || async {
        let rows = env
            .db
            .query(
                "SELECT aggregate_type || '=' || owner FROM outbox.dispatch_shares ORDER BY 1",
                &[],
            )
            .await
            .unwrap();
        rows.iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<Vec<_>>()
    };
    let leftovers = "SELECT (SELECT count(*) FROM outbox.poller_canaries)
                          + (SELECT count(*) FROM app.outbox WHERE type = 'outboxd.ownership_canary')";
    env.wait_count(
        "rows the poller published",
        "SELECT count(*) FROM app.outbox WHERE published_at IS NOT NULL",
        5,
    )
    .await;

    // 1. The take is refused, with the fix; nothing changed owner.
    let (ok, out) = share("take", &["--canary-wait", "30s"]).await;
    assert!(!ok, "a take past a poller without the predicate: {out}");
    assert!(
        out.contains("the poller claimed the ownership canary")
            && out.contains("add `AND outbox.poller_may_claim(id)` to the poller's claim"),
        "{out}"
    );
    assert_eq!(owners().await, vec!["*=poller".to_string()], "{out}");
    assert_eq!(
        env.count("SELECT (SELECT count(*) FROM outbox.events) + (SELECT count(*) FROM outbox.parked_events)")
            .await,
        0,
        "rows given to outboxd by a refused take"
    );
    assert_eq!(env.count(leftovers).await, 0, "canaries left behind");

    // 2. A stopped poller asks nothing: refused too, unless --poller-stopped says so.
    kill_poller(&env, &mut poller).await;
    let (ok, out) = share("take", &["--canary-wait", "2s"]).await;
    assert!(!ok && out.contains("no claim of the poller asked"), "{out}");
    assert_eq!(owners().await, vec!["*=poller".to_string()], "{out}");
    assert_eq!(env.count(leftovers).await, 0, "canaries left behind");

    // 3. Fixed, the take goes through.
    poller = start_poller(&env, &[]);
    let (ok, out) = share("take", &[]).await;
    assert!(
        ok && out.contains(&format!("outboxd owns aggregate type {ty}")),
        "{out}"
    );
    let taken_at = committed.lock().unwrap().len();
    env.wait_count(
        "rows outboxd published after the take",
        "SELECT count(*) FROM outbox.receipts",
        10,
    )
    .await;

    // 4. The predicate dropped again: the give-back is refused, the type stays outboxd's (and
    // the rows outboxd takes, marked published in the producer's transaction, stay out of
    // that poller's claim).
    kill_poller(&env, &mut poller).await;
    poller = start_poller(&env, &["--no-ownership-predicate"]);
    let (ok, out) = share("give-back", &["--canary-wait", "30s"]).await;
    assert!(
        !ok && out.contains("the poller claimed the ownership canary")
            && out.contains("add `AND outbox.poller_may_claim(id)` to the poller's claim"),
        "{out}"
    );
    assert!(owners().await.contains(&format!("{ty}=outboxd")), "{out}");
    assert_eq!(env.count(leftovers).await, 0, "canaries left behind");
    crate::harness::wait_for_writers(
        "rows written past the bad poller",
        crate::harness::LONG,
        &mut writers,
        || committed.lock().unwrap().len(),
        20,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    kill_poller(&env, &mut poller).await;
    let _poller = start_poller(&env, &[]);
    env.wait_zero(
        "every captured row published",
        "SELECT (SELECT count(*) FROM app.outbox o JOIN outbox.legacy_events l ON l.event_id = o.id
                 WHERE o.published_at IS NULL)
              + (SELECT count(*) FROM outbox.events e
                 WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id))",
    )
    .await;

    // From the broker: every committed row published, none by both relays; the canaries the
    // bad poller published (one per refusal) are the only other messages.
    let msgs = env.read_topic_of(&topic).await;
    let committed = std::mem::take(&mut *committed.lock().unwrap());
    let mut by_id: HashMap<uuid::Uuid, Vec<&TopicMessage>> = HashMap::new();
    for m in &msgs {
        by_id
            .entry(uuid::Uuid::parse_str(m.id()).expect("an id header"))
            .or_default()
            .push(m);
    }
    let missing = committed
        .keys()
        .filter(|id| !by_id.contains_key(id))
        .count();
    assert_eq!(missing, 0, "committed rows never published");
    let both = by_id
        .values()
        .filter(|ms| ms.iter().any(|m| by_outboxd(m)) && ms.iter().any(|m| !by_outboxd(m)))
        .count();
    assert_eq!(both, 0, "events published by both relays");
    let canaries: HashSet<_> = by_id
        .iter()
        .filter(|(id, _)| !committed.contains_key(id))
        .map(|(id, ms)| {
            assert!(
                ms.iter().all(|m| !by_outboxd(m)
                    && m.key.as_deref() == Some(&format!("outboxd-canary-{id}"))),
                "a message for an id nobody committed that is not a canary the bad poller sent: {:?}",
                ms[0]
            );
            *id
        })
        .collect();
    assert_eq!(
        canaries.len(),
        2,
        "one canary published per refusal to the bad poller"
    );
    let by_outboxd_n = by_id.values().filter(|ms| by_outboxd(ms[0])).count();
    assert!(
        by_outboxd_n > 0 && by_outboxd_n < committed.len(),
        "outboxd published {by_outboxd_n} of {} ({taken_at} committed at the take)",
        committed.len()
    );
}

e2e_only! {
    /// A database attached before migration 0025, with producers writing through the migration:
    /// the migration derives the mark from `published_at IS NULL`, rows outboxd takes afterwards
    /// are marked in the producer's transaction, attaching again marks the ones it took before, and
    /// the poller's rows are never marked by outboxd.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_attachment_made_before_migration_0025_is_upgraded_under_writers() {
        let pg = outbox_testkit::postgres::TestPostgres::shared();
        let url = pg.create_database("takeover_upgrade").await.unwrap();
        let mut old = connect(&url).await;
        outbox_ledger::migrate::run_through(&mut old, 24)
            .await
            .unwrap_or_else(|e| panic!("migrating to 0024: {e}"));
        old.batch_execute(TABLE_DDL).await.unwrap();
        old.batch_execute(
            "SELECT outbox.install_poller_capture('app.outbox', '\"published_at\" IS NULL');
             SELECT outbox.set_dispatch_owner('taken', 'outboxd');",
        )
        .await
        .unwrap();

        // One writer of each owner's type all through the migration.
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = ["taken", "kept"]
            .into_iter()
            .map(|ty| {
                let (url, stop) = (url.clone(), stop.clone());
                tokio::spawn(async move {
                    let c = connect(&url).await;
                    let mut n = 0u32;
                    while !stop.load(Ordering::Relaxed) || n < 20 {
                        c.execute(
                            INSERT,
                            &[
                                &uuid::Uuid::new_v4(),
                                &ty,
                                &format!("{ty}-{}", n % 3),
                                &"Changed",
                                &json!({"n": n}),
                            ],
                        )
                        .await
                        .unwrap_or_else(|e| panic!("a producer of {ty} during the migration: {e:?}"));
                        n += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    n
                })
            })
            .collect();
        let count = |sql: &'static str| {
            let old = &old;
            async move { old.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
        };
        const TAKEN_UNMARKED: &str =
            "SELECT count(*) FROM app.outbox o JOIN outbox.events e ON e.event_id = o.id
                                      WHERE o.published_at IS NULL";
        const KEPT_MARKED: &str =
            "SELECT count(*) FROM app.outbox WHERE aggregatetype = 'kept' AND published_at IS NOT NULL";
        outbox_testkit::wait::wait_for(
            "rows before the migration",
            crate::harness::LONG,
            || async {
                let n = count(TAKEN_UNMARKED).await;
                if n >= 10 {
                    Ok(())
                } else {
                    Err(format!("{n}"))
                }
            },
        )
        .await;
        let (ok, out) =
            outboxd_async(vec!["migrate".into(), "--database-url".into(), url.clone()]).await;
        assert!(ok, "{out}");
        let mark: Option<String> = old
            .query_one("SELECT mark_published FROM outbox.poller_tables", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(mark.as_deref(), Some("published_at = now()"));
        // Rows taken after the migration are marked as they are inserted: those whose insert began
        // after `migrate` returned (a seq drawn since; a producer blocked by the migration finishes
        // the trigger call it had begun).
        let bound: i64 = old
            .query_one("SELECT last_value FROM app.outbox_seq_seq", &[])
            .await
            .unwrap()
            .get(0);
        let since = |unmarked: bool| {
            let old = &old;
            async move {
                old.query_one(
                    "SELECT count(*) FROM app.outbox o JOIN outbox.events e ON e.event_id = o.id
                     WHERE o.seq > $1 AND (NOT $2 OR o.published_at IS NULL)",
                    &[&bound, &unmarked],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
            }
        };
        outbox_testkit::wait::wait_for(
            "rows taken after the migration",
            crate::harness::LONG,
            || async {
                let n = since(false).await;
                if n >= 20 {
                    Ok(())
                } else {
                    Err(format!("{n}"))
                }
            },
        )
        .await;
        assert_eq!(
            since(true).await,
            0,
            "rows taken after the migration left unmarked"
        );
        assert!(
            count(TAKEN_UNMARKED).await >= 10,
            "rows taken before the migration were marked by it"
        );
        let headers =
            count("SELECT count(*) FROM outbox.events WHERE headers ? 'poller_events_before'").await;
        assert!(headers >= 20, "{headers} events with poller_events_before");
        // Attaching again marks what outboxd took before.
        let (ok, out) = outboxd_async(vec![
            "migrate".into(),
            "--database-url".into(),
            url.clone(),
            "--poller-table".into(),
            "app.outbox".into(),
            "--published-column".into(),
            "published_at".into(),
        ])
        .await;
        assert!(ok && out.contains("it had taken marked now"), "{out}");
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            assert!(w.await.unwrap() >= 20);
        }
        assert_eq!(
            count(TAKEN_UNMARKED).await,
            0,
            "rows outboxd took, still unpublished in app.outbox"
        );
        assert_eq!(
            count(KEPT_MARKED).await,
            0,
            "the poller's rows marked by outboxd"
        );
        assert!(count("SELECT count(*) FROM app.outbox WHERE aggregatetype = 'kept'").await >= 20);
    }
}

e2e_only! {
    /// `outbox.poller_may_claim` judges every row of one claim on the claim's snapshot (STABLE): an
    /// owner switch (or a receipt) committing while a claim runs cannot let an aggregate's later row
    /// pass after its earlier one was held back. Planted: the function made VOLATILE, the same
    /// claim takes the later row alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_judges_every_row_on_one_snapshot() {
        let env = TestEnv::new("takeover_snapshot").await;
        env.db.batch_execute(TABLE_DDL).await.unwrap();
        attach(&env, &[]);
        // Two rows of one aggregate held back from the poller (its type being handed back).
        env.db
            .execute("SELECT outbox.set_dispatch_owner('order', 'handback')", &[])
            .await
            .unwrap();
        for n in 1..=2 {
            env.db
                .execute(
                    INSERT,
                    &[
                        &uuid::Uuid::new_v4(),
                        &"order",
                        &"a-1",
                        &"Changed",
                        &json!({"n": n}),
                    ],
                )
                .await
                .unwrap();
        }
        // The claim, with a pause between its two rows (a nested loop: row 1 judged, then the
        // pause, then row 2), while the type goes to the poller. The pause is an advisory lock
        // the test holds until the switch has committed, not a sleep: however slow the machine,
        // the switch lands inside it. The seqs claimed.
        const PAUSE: i64 = 0x000c_1a1b;
        let holder = connect(&env.url).await;
        let claim = |env: &TestEnv| {
            let url = env.url.clone();
            async move {
                let c = connect(&url).await;
                let pid: i32 = c
                    .query_one("SELECT pg_backend_pid()", &[])
                    .await
                    .unwrap()
                    .get(0);
                let task = tokio::spawn(async move {
                    c.query_one(
                        "SELECT coalesce(string_agg(o.seq::text, ',' ORDER BY o.seq), '')
                         FROM app.outbox o,
                              LATERAL (SELECT CASE WHEN o.seq = 2 THEN pg_advisory_lock($1)::text ELSE '' END AS x) z
                         WHERE o.published_at IS NULL
                           AND outbox.poller_may_claim(CASE WHEN z.x IS NULL THEN o.id ELSE o.id END)",
                        &[&PAUSE],
                    )
                    .await
                    .unwrap()
                    .get::<_, String>(0)
                });
                (pid, task)
            }
        };
        let sleeping = |pid: i32| {
            format!(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid} AND wait_event = 'advisory'"
            )
        };
        for (planted, expected) in [(false, ""), (true, "2")] {
            if planted {
                env.db
                    .batch_execute(
                        "SELECT outbox.set_dispatch_owner('order', 'handback');
                         ALTER FUNCTION outbox.poller_may_claim(uuid) VOLATILE;",
                    )
                    .await
                    .unwrap();
            }
            holder
                .execute("SELECT pg_advisory_lock($1)", &[&PAUSE])
                .await
                .unwrap();
            let (pid, task) = claim(&env).await;
            env.wait_count("the claim in its pause, past row 1", &sleeping(pid), 1)
                .await;
            env.db
                .execute("SELECT outbox.set_dispatch_owner('order', 'poller')", &[])
                .await
                .unwrap();
            assert_eq!(
                env.count(&sleeping(pid)).await,
                1,
                "the switch committed after the claim's pause: the window was missed, nothing tested"
            );
            holder
                .execute("SELECT pg_advisory_unlock($1)", &[&PAUSE])
                .await
                .unwrap();
            let claimed = task.await.unwrap();
            assert_eq!(
                claimed, expected,
                "planted VOLATILE: {planted}; rows the claim took after the switch (row 2 alone is out of order)"
            );
        }
    }
}
