//! The JetStream sink against a real `nats-server -js`, started by the harness per test (own
//! port, store and name) so faults can be injected into it: pause (SIGSTOP) longer than the ACK
//! timeout, kill and restart on the same store, and SIGKILL of the relay after a PubAck before
//! its receipt is recorded.
//!
//! Invariants, as counts that must be 0: events without a primary receipt (lost), events with
//! more than one copy in the stream, events missing from the stream, receipts whose sequence is
//! not the stream's copy, and per-subject order violations (a version stored after a later one).

use outbox_testkit::nats::{read_stream, StoredMessage, TestNats};
use outbox_testkit::wait::wait_for;
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;

use crate::harness::{outboxd, RelayProcess, TestEnv, LONG};

const STREAM: &str = "OUTBOX";

struct Js {
    env: TestEnv,
    nats: TestNats,
}

impl Js {
    /// A test environment whose aggregate type is routed to this test's own nats-server.
    async fn new(name: &str) -> Js {
        let env = TestEnv::new(name).await;
        let nats = TestNats::start(&format!("nats_{name}")).expect("start nats-server");
        env.route_to_nats(nats.name()).await;
        Js { env, nats }
    }

    /// Starts the relay with `--sink nats` (and the stream created on first start).
    fn relay(&self, envs: &[(&str, &str)], extra: &[&str]) -> RelayProcess {
        let url = self.nats.url();
        let mut args = vec![
            "--sink",
            "nats",
            "--nats-url",
            &url,
            "--nats-stream",
            STREAM,
            "--nats-create-stream",
            "--cluster-name",
            self.nats.name(),
        ];
        if !extra.contains(&"--message-timeout-ms") {
            args.extend(["--message-timeout-ms", "2000"]);
        }
        args.extend(extra);
        self.env.relay(envs, &args)
    }

    async fn enqueue_round_robin(&self, aggregates: usize, per_aggregate: usize) {
        for v in 0..per_aggregate {
            for a in 0..aggregates {
                self.env
                    .enqueue(&format!("a-{a}"), json!({"a": a, "v": v}))
                    .await;
            }
        }
    }

    async fn stream(&self) -> Vec<StoredMessage> {
        read_stream(&self.nats.url(), STREAM)
            .await
            .unwrap_or_else(|e| panic!("{e}\nserver log:\n{}", self.nats.log_text()))
    }

    /// The invariant counts; every one must be 0.
    async fn invariants(&self) -> Invariants {
        let env = &self.env;
        // The ledger first, then the stream: whatever the ledger holds was acknowledged
        // before, so the stream read after it holds its message (a running relay keeps
        // recording receipts).
        let rows = env
            .db
            .query(
                "SELECT e.event_id::text, 'outbox.' || e.aggregate_type || '.' || e.aggregate_id,
                        r.\"offset\", r.broker_kind, r.partition
                 FROM outbox.events e LEFT JOIN outbox.receipts r USING (event_id)",
                &[],
            )
            .await
            .unwrap();
        let receipts = env
            .db
            .query(
                "SELECT r.event_id::text, r.\"offset\", r.partition, r.broker_kind, outbox.payload_digest_of(e.payload, e.payload_digest)
                 FROM outbox.receipts r JOIN outbox.events e USING (event_id)
                 UNION ALL
                 SELECT d.event_id::text, d.\"offset\", d.partition, d.broker_kind, outbox.payload_digest_of(e.payload, e.payload_digest)
                 FROM outbox.duplicate_receipts d JOIN outbox.events e USING (event_id)",
                &[],
            )
            .await
            .unwrap();
        let msgs = self.stream().await;
        let mut copies: HashMap<String, Vec<&StoredMessage>> = HashMap::new();
        for m in &msgs {
            copies.entry(m.msg_id().to_string()).or_default().push(m);
        }
        let mut inv = Invariants::default();
        for r in &rows {
            let id: String = r.get(0);
            let subject: String = r.get(1);
            let offset: Option<i64> = r.get(2);
            // A receipt is checked against the stream below, with the duplicates.
            if offset.is_none() {
                inv.lost += 1;
            }
            match copies.get(&id) {
                None => inv.missing_in_stream += 1,
                Some(c) => {
                    inv.extra_copies += c.len() as i64 - 1;
                    if c.iter().any(|m| m.subject != subject) {
                        inv.wrong_subject += 1;
                    }
                }
            }
        }
        // Every receipt, primary and duplicate, names the stream's copy of its event: the
        // message at that sequence carries the event id and the frozen payload digest.
        let by_seq: HashMap<i64, &StoredMessage> =
            msgs.iter().map(|m| (m.sequence as i64, m)).collect();
        for r in &receipts {
            let (id, seq, partition, kind, digest): (String, i64, i32, String, String) =
                (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
            let ok = by_seq.get(&seq).is_some_and(|m| {
                m.msg_id() == id
                    && outbox_core::envelope::sha256_digest(m.payload.as_bytes()) == digest
            });
            if !ok || kind != "nats" || partition != 0 {
                println!("receipt of {id} at sequence {seq} ({kind}/{partition}) is not the stream's copy: {:?}", by_seq.get(&seq));
                inv.receipt_mismatches += 1;
            }
        }
        // Per subject, versions in stream order must increase.
        let mut last: HashMap<&str, i64> = HashMap::new();
        for m in &msgs {
            let v: i64 = m.headers["aggregate_version"].parse().unwrap();
            if let Some(prev) = last.insert(m.subject.as_str(), v) {
                if v <= prev {
                    inv.order_violations += 1;
                }
            }
        }
        inv.second_primaries = env
            .count("SELECT count(*) - count(DISTINCT event_id) FROM outbox.receipts")
            .await;
        inv
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Invariants {
    lost: i64,
    missing_in_stream: i64,
    extra_copies: i64,
    wrong_subject: i64,
    receipt_mismatches: i64,
    order_violations: i64,
    second_primaries: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_that_is_not_the_streams_copy_is_counted() {
    // The receipt_mismatches counter, shown able to fail: receipts planted at a sequence with
    // no message, and at another event's message.
    let js = Js::new("js_planted").await;
    let mut relay = js.relay(&[], &[]);
    js.env.wait_streaming().await;
    js.enqueue_round_robin(3, 1).await;
    js.env
        .wait_count("3 receipts", "SELECT count(*) FROM outbox.receipts", 3)
        .await;
    relay.kill9();
    assert_eq!(js.invariants().await, Invariants::default());
    let db = &js.env.db;
    db.execute(
        "UPDATE outbox.receipts SET \"offset\" = \"offset\" + 100
         WHERE event_id = (SELECT event_id FROM outbox.receipts ORDER BY event_id LIMIT 1)",
        &[],
    )
    .await
    .unwrap();
    db.execute(
        "INSERT INTO outbox.duplicate_receipts (event_id, broker_kind, broker_cluster, topic, partition, \"offset\")
         SELECT r.event_id, r.broker_kind, r.broker_cluster, r.topic, 0, o.\"offset\"
         FROM outbox.receipts r, outbox.receipts o
         WHERE r.event_id = (SELECT event_id FROM outbox.receipts ORDER BY event_id DESC LIMIT 1)
           AND o.event_id <> r.event_id AND o.\"offset\" < 100 LIMIT 1",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(
        js.invariants().await,
        Invariants {
            receipt_mismatches: 2,
            ..Invariants::default()
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_the_stream_with_msg_id_and_headers_and_pubacks_become_receipts() {
    let js = Js::new("js_happy").await;
    let _relay = js.relay(&[], &[]);
    js.env.wait_streaming().await;
    js.enqueue_round_robin(3, 10).await;
    js.env
        .wait_count(
            "30 receipts from PubAcks",
            "SELECT count(*) FROM outbox.receipts",
            30,
        )
        .await;
    assert_eq!(js.invariants().await, Invariants::default());
    let msgs = js.stream().await;
    assert_eq!(msgs.len(), 30);
    let m = &msgs[0];
    for h in ["id", "aggregate_type", "aggregate_version", "event_type"] {
        assert!(m.headers.contains_key(h), "header {h} missing: {m:?}");
    }
    assert_eq!(m.headers["id"], m.msg_id(), "Nats-Msg-Id is the event id");
    assert!(
        m.subject
            .starts_with(&format!("outbox.{}.a-", js.env.aggregate_type)),
        "default subject outbox.<aggregate_type>.<aggregate_id>: {}",
        m.subject
    );
    let cluster: String = js
        .env
        .db
        .query_one("SELECT DISTINCT broker_cluster FROM outbox.receipts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(cluster, js.nats.name());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_loses_the_ack_and_the_msg_id_republish_resolves_it_with_one_copy() {
    let js = Js::new("js_sigstop").await;
    let _relay = js.relay(
        &[],
        &["--message-timeout-ms", "1000", "--unknown-settle-ms", "300"],
    );
    js.env.wait_streaming().await;
    js.env.warm_up("w-0").await;
    // SIGSTOP for longer than the ACK timeout: the publish reaches the server's socket, the
    // PubAck cannot come back, the relay records DISPATCH_UNKNOWN.
    js.nats.pause();
    let id = js.env.enqueue("s-1", json!({"v": 1})).await;
    js.env
        .wait_count(
            "the attempt recorded as DISPATCH_UNKNOWN",
            "SELECT count(*) FROM outbox.attempts",
            1,
        )
        .await;
    js.nats.resume();
    js.env
        .wait_count(
            "the UNKNOWN event accepted",
            "SELECT count(*) FROM outbox.receipts",
            2,
        )
        .await;
    // A found copy's receipt is accepted before its attempt is resolved FOUND
    // (`outbox_relay::unknown::record`): wait for both, not for the receipt alone.
    js.env
        .wait_zero(
            "the attempt resolved",
            "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
        )
        .await;
    let row = js
        .env
        .db
        .query_one(
            "SELECT a.state, r.attempt, a.found_offset, r.\"offset\",
                    extract(epoch FROM a.resolved_at - a.unknown_at)::float8 * 1000
             FROM outbox.attempts a JOIN outbox.receipts r USING (event_id) WHERE a.event_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let state: String = row.get(0);
    println!("UNKNOWN -> {state} in {:.0} ms", row.get::<_, f64>(4));
    match state.as_str() {
        // The original publish was stored: the re-publish was answered `duplicate: true` with
        // its sequence.
        "FOUND" => {
            assert_eq!(row.get::<_, i32>(1), 1);
            assert_eq!(row.get::<_, Option<i64>>(2), Some(row.get::<_, i64>(3)));
        }
        // The server took the re-publish first: it is the retry, and the original (same
        // Msg-Id) was then dropped as a duplicate.
        "ABSENT" => assert_eq!(row.get::<_, i32>(1), 2),
        other => panic!("unresolved attempt state {other}"),
    }
    let copies = js
        .stream()
        .await
        .iter()
        .filter(|m| m.msg_id() == id.to_string())
        .count();
    assert_eq!(copies, 1, "exactly one copy in the stream");
    assert_eq!(js.invariants().await, Invariants::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_mid_stream_loses_nothing_and_stores_each_event_once() {
    let mut js = Js::new("js_restart").await;
    let mut relay = js.relay(
        &[],
        &["--message-timeout-ms", "1000", "--unknown-settle-ms", "300"],
    );
    js.env.wait_streaming().await;
    js.enqueue_round_robin(4, 5).await;
    js.env
        .wait_count(
            "the first 20 receipts",
            "SELECT count(*) FROM outbox.receipts",
            20,
        )
        .await;
    // Publishes in flight when the server dies: it is paused first, so they sit unread in its
    // sockets, and the kill discards them. Their ACK never comes (DISPATCH_UNKNOWN).
    js.nats.pause();
    js.enqueue_round_robin(4, 1).await;
    js.env
        .wait_count(
            "an in-flight publish recorded as DISPATCH_UNKNOWN",
            "SELECT count(*) FROM outbox.attempts",
            1,
        )
        .await;
    js.nats
        .restart()
        .expect("restart nats-server on the same store");
    js.enqueue_round_robin(4, 5).await;
    js.env
        .wait_count(
            "all 44 receipts after the restart",
            "SELECT count(*) FROM outbox.receipts",
            44,
        )
        .await;
    relay.assert_running();
    assert_eq!(js.invariants().await, Invariants::default());
    assert_eq!(js.stream().await.len(), 44, "one copy per event");
    // Every UNKNOWN attempt resolved: waited for, since a found copy's receipt is accepted
    // before its attempt is resolved FOUND (`outbox_relay::unknown::record`).
    js.env
        .wait_zero(
            "every UNKNOWN attempt resolved",
            "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
        )
        .await;
    // The killed server never stored the paused publishes: the Msg-Id re-publish was not a
    // duplicate, so the original attempt is proven ABSENT and the re-publish is attempt 2.
    let absent = js
        .env
        .count(
            "SELECT count(*) FROM outbox.attempts a JOIN outbox.receipts r USING (event_id)
             WHERE a.state = 'ABSENT' AND r.attempt = a.attempt_generation + 1",
        )
        .await;
    assert!(absent >= 1, "{}", relay.log_text());
    println!(
        "server restart: {} relay interruption(s), {} UNKNOWN attempt(s), {absent} proven absent and re-published, {} duplicate receipt(s)",
        relay.log_text().matches("replaying from the last checkpoint").count(),
        js.env.count("SELECT count(*) FROM outbox.attempts").await,
        js.env
            .count("SELECT count(*) FROM outbox.duplicate_receipts")
            .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_after_the_puback_before_its_receipt_replays_into_broker_duplicates() {
    let js = Js::new("js_kill").await;
    let mut relay = js.relay(&[("OUTBOXD_FAILPOINTS", "after-broker-ack=abort@12")], &[]);
    js.env.wait_streaming().await;
    js.enqueue_round_robin(4, 5).await;
    let status = relay.wait_exit(LONG).await;
    assert!(!status.success(), "the failpoint aborted the relay");
    let stored_before = js.stream().await.len() as i64;
    let accepted_before = js.env.count("SELECT count(*) FROM outbox.receipts").await;
    assert!(
        stored_before > accepted_before,
        "the 12th PubAck was never recorded: stored {stored_before}, accepted {accepted_before}"
    );
    let _relay = js.relay(&[], &[]);
    js.env
        .wait_count(
            "all 20 receipts after the restart",
            "SELECT count(*) FROM outbox.receipts",
            20,
        )
        .await;
    assert_eq!(js.invariants().await, Invariants::default());
    // The replay re-published what the broker already had (at least the events stored but not
    // accepted); JetStream answered with the original sequence (duplicate: true) instead of
    // storing a second copy.
    assert_eq!(js.stream().await.len(), 20);
    println!(
        "relay SIGKILL: {stored_before} stored, {accepted_before} accepted before the kill; {} duplicate receipt(s) after",
        js.env
            .count("SELECT count(*) FROM outbox.duplicate_receipts")
            .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_the_stream_and_warns_when_its_duplicate_window_is_short() {
    let js = Js::new("js_check").await;
    // The relay creates the stream with a duplicate window of 20 s.
    let _relay = js.relay(&[], &["--nats-duplicate-window-ms", "20000"]);
    let url = js.nats.url();
    let db = js.env.url.as_str();
    wait_for("the stream to exist", LONG, || async {
        let (ok, out) = outboxd(&[
            "check",
            "--database-url",
            db,
            "--nats-url",
            &url,
            "--nats-stream",
            STREAM,
        ]);
        if out.contains(&format!("{STREAM}: subjects")) {
            Ok(())
        } else {
            Err(format!("ok={ok}: {out}"))
        }
    })
    .await;
    let (ok, out) = outboxd(&[
        "check",
        "--database-url",
        db,
        "--nats-url",
        &url,
        "--nats-stream",
        STREAM,
    ]);
    assert!(ok, "warnings only: {out}");
    assert!(out.contains(js.nats.name()), "{out}");
    // 20 s < 5 s ack + 5 s settle + 10 s lease + 5 s backoff.
    let line = out
        .lines()
        .find(|l| l.contains("duplicate window"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.starts_with("WARN"), "{line}");
    assert!(line.contains("retry budget"), "{line}");

    let (ok, out) = outboxd(&[
        "check",
        "--database-url",
        db,
        "--nats-url",
        &url,
        "--nats-stream",
        "NOPE",
    ]);
    assert!(!ok, "a missing stream fails the check: {out}");
    assert!(out.contains("NOPE does not exist"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_or_another_cluster_stops_the_relay_with_the_fix() {
    let js = Js::new("js_nostream").await;
    let url = js.nats.url();
    let base = [
        "--sink",
        "nats",
        "--nats-url",
        &url,
        "--nats-stream",
        "ABSENT",
    ];
    let mut relay = js.env.relay(
        &[],
        &[&base[..], &["--cluster-name", js.nats.name()]].concat(),
    );
    let status = relay.wait_exit(LONG).await;
    assert!(!status.success());
    let log = relay.log_text();
    assert!(
        log.contains("ABSENT does not exist") && log.contains("--nats-create-stream"),
        "{log}"
    );

    let mut relay = js.env.relay(
        &[],
        &[
            &base[..],
            &["--nats-create-stream", "--cluster-name", "other"],
        ]
        .concat(),
    );
    let status = relay.wait_exit(LONG).await;
    assert!(!status.success());
    let log = relay.log_text();
    assert!(
        log.contains("identifies as") && log.contains("\"other\""),
        "{log}"
    );
}

/// Outside the duplicate window the relay cannot ask the broker by Msg-Id: it reads the stream
/// by subject. Found → the stored copy becomes the receipt, nothing is re-sent; absent over the
/// whole range → a retry (attempt 2) to the same subject.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_the_duplicate_window_an_unknown_attempt_is_resolved_by_a_subject_scan() {
    let js = Js::new("js_scan").await;
    let url = js.nats.url();
    // A 1 s window: every UNKNOWN attempt is older than the window minus the safety margin.
    outbox_testkit::nats::create_stream(&url, STREAM, &["outbox.>"], Duration::from_secs(1))
        .await
        .expect("create the stream");
    let stored = js.env.enqueue("x-1", json!({"v": 1})).await;
    let absent = js.env.enqueue("x-2", json!({"v": 1})).await;
    let subject = |agg: &str| format!("outbox.{}.{agg}", js.env.aggregate_type);
    // The state a lost PubAck leaves: one event is in the stream (stored by an earlier relay
    // generation, after an unrelated message on the same subject), the other is not; the
    // ledger has only DISPATCH_UNKNOWN attempts for both.
    outbox_testkit::nats::publish(&url, &subject("x-1"), "unrelated", "{}")
        .await
        .unwrap();
    let seq = outbox_testkit::nats::publish(&url, &subject("x-1"), &stored.to_string(), "{}")
        .await
        .unwrap();
    for (id, agg) in [(stored, "x-1"), (absent, "x-2")] {
        js.env
            .db
            .execute(
                "INSERT INTO outbox.attempts (event_id, relay_generation, attempt_generation, slot_name,
                                              topic, partition, sent_at, error)
                 VALUES ($1, 0, 1, $2, $3, 0, clock_timestamp(), 'timed out: didn''t receive ack in time')",
                &[&id, &js.env.slot, &subject(agg)],
            )
            .await
            .unwrap();
    }
    let _relay = js.relay(&[], &["--unknown-settle-ms", "300"]);
    js.env
        .wait_count("both receipts", "SELECT count(*) FROM outbox.receipts", 2)
        .await;
    // A found copy's receipt is accepted before its attempt is resolved FOUND
    // (`outbox_relay::unknown::record`): wait for both, not for the receipts alone.
    js.env
        .wait_zero(
            "both attempts resolved",
            "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
        )
        .await;
    let rows = js
        .env
        .db
        .query(
            "SELECT a.event_id, a.state, a.found_offset, r.\"offset\", r.attempt
             FROM outbox.attempts a JOIN outbox.receipts r USING (event_id)",
            &[],
        )
        .await
        .unwrap();
    for r in rows {
        let id: uuid::Uuid = r.get(0);
        let state: String = r.get(1);
        if id == stored {
            assert_eq!(state, "FOUND");
            assert_eq!(r.get::<_, Option<i64>>(2), Some(seq as i64));
            assert_eq!(
                r.get::<_, i64>(3),
                seq as i64,
                "the stored copy is the receipt"
            );
            assert_eq!(r.get::<_, i32>(4), 1);
        } else {
            assert_eq!(state, "ABSENT");
            assert_eq!(r.get::<_, i32>(4), 2, "the retry is attempt 2");
        }
    }
    let msgs = js.stream().await;
    for id in [stored, absent] {
        let copies = msgs.iter().filter(|m| m.msg_id() == id.to_string()).count();
        assert_eq!(copies, 1, "one copy of {id}");
    }
}

/// An unclear answer holds its aggregates, never the relay (issue 25): the server stalls
/// (SIGSTOP) longer than the ACK timeout while events flow, so sends end without a PubAck; each
/// such event is parked and resolved by the Msg-Id re-publish while the relay runs; the relay
/// is SIGKILLed once on the way. No run of either relay ends for an unclear answer, every event
/// is stored once, every receipt is the stream's copy, and every subject is in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_holds_the_unclear_events_while_the_run_goes_on_and_stores_each_once() {
    let js = Js::new("js_unclear").await;
    let args = ["--message-timeout-ms", "1000", "--unknown-settle-ms", "300"];
    let mut relay = js.relay(&[], &args);
    js.env.wait_streaming().await;
    js.enqueue_round_robin(8, 3).await;
    js.env
        .wait_count(
            "the first 24 receipts",
            "SELECT count(*) FROM outbox.receipts",
            24,
        )
        .await;
    js.nats.pause();
    js.enqueue_round_robin(8, 2).await;
    js.env
        .wait_count(
            "sends without a PubAck recorded as DISPATCH_UNKNOWN",
            "SELECT count(*) FROM outbox.attempts",
            4,
        )
        .await;
    js.nats.resume();
    js.enqueue_round_robin(8, 2).await;
    js.env
        .wait_count(
            "the stalled events accepted",
            "SELECT count(*) FROM outbox.receipts",
            56,
        )
        .await;
    let first_log = relay.log_text();
    js.enqueue_round_robin(8, 1).await;
    relay.kill9();
    let mut relay = js.relay(&[], &args);
    js.enqueue_round_robin(8, 1).await;
    js.env
        .wait_count(
            "every event accepted",
            "SELECT count(*) FROM outbox.receipts",
            72,
        )
        .await;
    js.env
        .wait_zero(
            "every DISPATCH_UNKNOWN attempt resolved",
            "SELECT count(*) FROM outbox.attempts WHERE state = 'DISPATCH_UNKNOWN'",
        )
        .await;
    relay.assert_running();
    assert_eq!(js.invariants().await, Invariants::default());
    assert_eq!(js.stream().await.len(), 72, "one copy per event");
    for log in [&first_log, &relay.log_text()] {
        assert_eq!(
            log.matches("relay interrupted").count(),
            0,
            "a run ended:\n{log}"
        );
    }
    assert!(first_log.contains("unclear outcome: only this aggregate waits"));
    println!(
        "stalled server: {} DISPATCH_UNKNOWN attempts, all resolved while the relay ran; {} duplicate receipts",
        js.env.count("SELECT count(*) FROM outbox.attempts").await,
        js.env
            .count("SELECT count(*) FROM outbox.duplicate_receipts")
            .await
    );
}

/// Issue 33, finding 6: a NATS server that requires a user and password. The relay publishes
/// with the right ones (`--nats-user` + `OUTBOXD_NATS_PASSWORD`); with a wrong one, none, or
/// credentials in the URL (which async-nats ignores) it stops with an error naming the
/// setting to use, and the password appears in no output, even at trace level, nor in
/// `--help`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_authenticates_to_nats_with_a_user_and_password_that_never_print() {
    const PASSWORD: &str = "N4ts-Pw?s3cr3t";
    const WRONG: &str = "Wr0ng-Pw?s3cr3t";
    let env = TestEnv::new("js_auth_user").await;
    let nats = TestNats::start_with_user("nats_js_auth_user", "outboxd", PASSWORD)
        .expect("start nats-server with --user/--pass");
    env.route_to_nats(nats.name()).await;
    let url = nats.url();
    let port = url.rsplit(':').next().unwrap().to_string();
    let base = |url: &str| -> Vec<String> {
        [
            "--sink",
            "nats",
            "--nats-url",
            url,
            "--nats-stream",
            STREAM,
            "--nats-create-stream",
            "--cluster-name",
            nats.name(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let start = |url: &str, extra: &[&str], envs: &[(&str, &str)]| {
        let mut args = base(url);
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        env.relay(envs, &args)
    };
    let trace = ("OUTBOXD_LOG", "trace");

    // No credentials: the error says which settings the server needs.
    let mut relay = start(&url, &[], &[trace]);
    // The relay's own line, not async-nats's "authorization violation" that comes before it.
    let log = wait_log(&relay.log, "the server requires authentication").await;
    assert!(
        log.contains("the server requires authentication") && log.contains("OUTBOXD_NATS_PASSWORD"),
        "{log}"
    );
    relay.kill9();

    // A wrong password: refused, naming the user and the setting, never the password.
    let mut relay = start(
        &url,
        &["--nats-user", "outboxd"],
        &[trace, ("OUTBOXD_NATS_PASSWORD", WRONG)],
    );
    let log = wait_log(&relay.log, "the server refused user").await;
    assert!(
        log.contains("the server refused user")
            && log.contains("nats.password (OUTBOXD_NATS_PASSWORD)"),
        "{log}"
    );
    relay.kill9();
    let log = std::fs::read_to_string(&relay.log).unwrap();
    assert_eq!(
        log.lines().filter(|l| l.contains(WRONG)).count(),
        0,
        "the wrong password was printed: {log}"
    );

    // Credentials in the URL: refused before connecting, naming the settings, password hidden.
    let with_creds = format!("nats://outboxd:{PASSWORD}@127.0.0.1:{port}");
    let mut relay = start(&with_creds, &[], &[trace]);
    let status = relay.wait_exit(LONG).await;
    let log = std::fs::read_to_string(&relay.log).unwrap();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("holds credentials")
            && log.contains("nats.user + nats.password")
            && log.contains("nats://outboxd@127.0.0.1"),
        "{log}"
    );
    assert!(!log.contains(PASSWORD), "the password was printed: {log}");

    // `--help` with the password in the environment does not show it.
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["run", "--help"])
        .env("OUTBOXD_NATS_PASSWORD", PASSWORD)
        .env("OUTBOXD_NATS_TOKEN", PASSWORD)
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    assert!(help.contains("--nats-password"), "{help}");
    assert!(
        !help.contains(PASSWORD),
        "--help printed the password: {help}"
    );

    // The right password: events are published and their receipts accepted, and no line of
    // the trace-level log holds the password.
    let relay = start(
        &url,
        &["--nats-user", "outboxd"],
        &[trace, ("OUTBOXD_NATS_PASSWORD", PASSWORD)],
    );
    for i in 0..3 {
        env.enqueue("auth-1", json!({"i": i})).await;
    }
    env.wait_count(
        "receipts from the NATS server that requires a password",
        "SELECT count(*) FROM outbox.receipts WHERE broker_kind = 'nats'",
        3,
    )
    .await;
    let log = std::fs::read_to_string(&relay.log).unwrap();
    assert_eq!(
        log.lines().filter(|l| l.contains(PASSWORD)).count(),
        0,
        "the password was printed"
    );

    // `outboxd check` uses the same settings: the stream is seen with the right password, and
    // the wrong one is a FAIL line naming the setting, without the password.
    let check = |password: &str| {
        outboxd(&[
            "check",
            "--database-url",
            &env.url,
            "--nats-url",
            &url,
            "--nats-stream",
            STREAM,
            "--nats-user",
            "outboxd",
            "--nats-password",
            password,
        ])
    };
    let (_, out) = check(PASSWORD);
    assert!(out.contains(&format!("{STREAM}: subjects")), "{out}");
    assert!(!out.contains(PASSWORD), "check printed the password: {out}");
    let (ok, out) = check(WRONG);
    assert!(!ok, "{out}");
    assert!(
        out.contains("authorization violation") && out.contains("OUTBOXD_NATS_PASSWORD"),
        "{out}"
    );
    assert!(!out.contains(WRONG), "check printed the password: {out}");
}

/// Finding 6: a server that requires a token (`--auth`); `OUTBOXD_NATS_TOKEN` is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_authenticates_to_nats_with_a_token() {
    const TOKEN: &str = "t0ken-s3cr3t-for-nats";
    let env = TestEnv::new("js_auth_token").await;
    let nats = TestNats::start_with_token("nats_js_auth_token", TOKEN)
        .expect("start nats-server with --auth");
    env.route_to_nats(nats.name()).await;
    let url = nats.url();
    let args = [
        "--sink",
        "nats",
        "--nats-url",
        &url,
        "--nats-stream",
        STREAM,
        "--nats-create-stream",
        "--cluster-name",
        nats.name(),
    ];
    let mut relay = env.relay(&[("OUTBOXD_NATS_TOKEN", "not-the-token")], &args);
    let log = wait_log(&relay.log, "the server refused nats.token").await;
    assert!(log.contains("nats.token (OUTBOXD_NATS_TOKEN)"), "{log}");
    relay.kill9();
    let relay = env.relay(
        &[("OUTBOXD_LOG", "trace"), ("OUTBOXD_NATS_TOKEN", TOKEN)],
        &args,
    );
    env.enqueue("tok-1", json!({"i": 1})).await;
    env.wait_count(
        "a receipt from the NATS server that requires a token",
        "SELECT count(*) FROM outbox.receipts WHERE broker_kind = 'nats'",
        1,
    )
    .await;
    let log = std::fs::read_to_string(&relay.log).unwrap();
    assert!(!log.contains(TOKEN), "the token was printed");
}

/// Waits (up to LONG) until the log at `path` holds `needle`; returns the log.
async fn wait_log(path: &std::path::Path, needle: &str) -> String {
    wait_for(&format!("{needle:?} in the relay's log"), LONG, || async {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(needle) {
            Ok(text)
        } else {
            Err(text)
        }
    })
    .await
}

/// Finding 6: a server that requires TLS, its certificate signed by a CA of the test's. With
/// `--nats-ca-file` naming that CA the relay publishes; with another CA it is refused with an
/// error naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_verifies_the_nats_servers_certificate_with_its_ca_file() {
    let env = TestEnv::new("js_tls").await;
    let certs = tempfile::tempdir().unwrap();
    let (ca, cert, key) = outbox_testkit::tls::make_ca_and_server_cert(certs.path(), "natsca");
    let (other_ca, _, _) = outbox_testkit::tls::make_ca_and_server_cert(certs.path(), "otherca");
    let nats =
        TestNats::start_with_tls("nats_js_tls", &cert, &key).expect("start nats-server with --tls");
    env.route_to_nats(nats.name()).await;
    let url = nats.url();
    let start = |ca: &std::path::Path| {
        let ca = ca.display().to_string();
        env.relay(
            &[],
            &[
                "--sink",
                "nats",
                "--nats-url",
                &url,
                "--nats-stream",
                STREAM,
                "--nats-create-stream",
                "--cluster-name",
                nats.name(),
                "--nats-ca-file",
                &ca,
            ],
        )
    };
    let mut relay = start(&other_ca);
    let log = wait_log(&relay.log, "nats.ca_file").await;
    assert!(log.contains("connecting"), "{log}");
    relay.kill9();
    let _relay = start(&ca);
    env.enqueue("tls-1", json!({"i": 1})).await;
    env.wait_count(
        "a receipt from the NATS server that requires TLS",
        "SELECT count(*) FROM outbox.receipts WHERE broker_kind = 'nats'",
        1,
    )
    .await;
}
