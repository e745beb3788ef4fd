//! The ledger against real PostgreSQL: migrations, the producer API, digest parity between
//! SQL and Rust, and the acceptance point.

use outbox_core::{Destination, Lsn, OutboxEvent, EVENT_COLUMNS};
use outbox_ledger::producer::{enqueue, EnqueueOptions};
use outbox_ledger::{
    accept, audit, checkpoint, migrate, LedgerItem, QuarantineRecord, ReceiptRecord,
};
use outbox_testkit::postgres::TestPostgres;
use serde_json::json;
use tokio_postgres::{Client, GenericClient, NoTls};

/// The version event `id`'s row holds (`None`: the relay numbers it).
async fn version_of(c: &impl GenericClient, id: uuid::Uuid) -> Option<i64> {
    c.query_one(
        "SELECT aggregate_version FROM outbox.events WHERE event_id = $1",
        &[&id],
    )
    .await
    .unwrap()
    .get(0)
}

/// A new, empty database `name` on the shared cluster, and a connection to it.
async fn bare(name: &str) -> (Client, String) {
    let url = TestPostgres::shared().create_database(name).await.unwrap();
    let (c, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(conn);
    (c, url)
}

async fn fresh(name: &str) -> (Client, String) {
    let (mut c, url) = bare(name).await;
    let applied = migrate::run(&mut c).await.unwrap();
    let all: Vec<i32> = migrate::MIGRATIONS.iter().map(|m| m.version).collect();
    assert_eq!(
        applied, all,
        "a fresh database gets every embedded migration"
    );
    (c, url)
}

/// Event `id` as the relay reads it (`OutboxEvent::from_text_columns`: digests the row does not
/// store computed, a narrow row's destination rendered from its route version).
async fn event(c: &impl GenericClient, id: uuid::Uuid) -> OutboxEvent {
    let cols = EVENT_COLUMNS
        .iter()
        .map(|c| format!("{c}::text"))
        .collect::<Vec<_>>()
        .join(", ");
    // route_version through to_jsonb: absent before migration 0031.
    let row = c
        .query_one(
            &format!(
                "SELECT {cols}, to_jsonb(e) ->> 'route_version' FROM outbox.events e
                 WHERE event_id = $1"
            ),
            &[&id],
        )
        .await
        .unwrap();
    OutboxEvent::from_text_columns(
        |name| {
            let i = EVENT_COLUMNS
                .iter()
                .chain(["route_version"].iter())
                .position(|c| *c == name)
                .unwrap();
            Ok(row.get::<_, Option<&str>>(i))
        },
        None,
        // As the relay reads them at start (none before migration 0031).
        &outbox_source::slot::route_versions(c).await.unwrap(),
        None,
    )
    .unwrap()
}

/// A copy of event `of` at `version` written around `outbox.enqueue`, storing the digests the
/// relay computes (as a capture trigger or an earlier version wrote them). Its new id.
async fn with_stored_digests(c: &Client, of: uuid::Uuid, version: i64) -> uuid::Uuid {
    c.query_one(
        "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_version,
             event_type, payload, payload_digest, dest_kind, dest_cluster, dest_topic, dest_key,
             dest_partitioner, dest_route_generation, dest_serializer, dest_acks,
             destination_digest)
         SELECT gen_random_uuid(), aggregate_type, aggregate_id, $2, event_type, payload,
             outbox.payload_digest_of(payload, NULL), dest_kind, dest_cluster, dest_topic,
             dest_key, dest_partitioner, dest_route_generation, dest_serializer, dest_acks,
             outbox.destination_digest_of(e)
         FROM outbox.events_current e WHERE event_id = $1 RETURNING event_id",
        &[&of, &version],
    )
    .await
    .unwrap()
    .get(0)
}

/// The single number `sql` selects.
async fn count(c: &Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

/// Enqueues an event of aggregate `order`/`aggregate_id` and records an operator's migration
/// of it to topic `orders.moved`: the row as enqueued and the migrated destination's digest.
async fn enqueue_and_move(c: &Client, aggregate_id: &str) -> (OutboxEvent, String) {
    let id = enqueue(
        c,
        "order",
        aggregate_id,
        "order.created",
        &json!({"moved": true}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let before = event(c, id).await;
    outbox_ledger::destination::record(
        c,
        id,
        "kafka",
        "default",
        "orders.moved",
        "NeverSent",
        "test",
        "test",
    )
    .await
    .unwrap();
    let migrated = c
        .query_one(
            "SELECT destination_digest FROM outbox.events_current WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    (before, migrated)
}

/// Enqueues `n` events of aggregates o-0 .. o-(n-1) and reads their rows.
async fn enqueue_orders(c: &Client, n: usize) -> Vec<OutboxEvent> {
    let mut events = Vec::new();
    for i in 0..n {
        let id = enqueue(
            c,
            "order",
            &format!("o-{i}"),
            "order.created",
            &json!({"i": i}),
            &EnqueueOptions::default(),
        )
        .await
        .unwrap();
        events.push(event(c, id).await);
    }
    events
}

/// Writes the tombstone purge leaves for event `id` (version `version` of aggregate o-gone),
/// with the digests and topic of `r`.
async fn tombstone(c: &Client, id: uuid::Uuid, version: i64, r: &ReceiptRecord) {
    c.execute(
        "INSERT INTO outbox.purged_events (event_id, aggregate_type, aggregate_id,
             aggregate_version, payload_digest, destination_digest, topic, partition, \"offset\",
             occurred_at, accepted_at)
         VALUES ($1, 'order', 'o-gone', $5, $2, $3, $4, 0, $5, now(), now())",
        &[
            &id,
            &r.payload_digest,
            &r.destination_digest,
            &r.topic,
            &version,
        ],
    )
    .await
    .unwrap();
}

fn receipt(ev: &OutboxEvent, offset: i64) -> ReceiptRecord {
    ReceiptRecord {
        event_id: ev.event_id,
        aggregate_version: ev.aggregate_version,
        payload_digest: ev.payload_digest.clone(),
        destination_digest: ev.destination_digest.clone(),
        broker_kind: "kafka".into(),
        broker_cluster: "default".into(),
        topic: ev.destination.topic.clone(),
        partition: 0,
        offset,
        timestamp_ms: Some(1_700_000_000_000),
        attempt: 1,
        relay_generation: 0,
        commit_lsn: Some(Lsn(100)),
        change_lsn: None,
        evidence: None,
    }
}

#[tokio::test]
async fn migrations_are_idempotent_and_checksummed() {
    let (mut c, _) = fresh("ledger_migrate").await;
    assert!(
        migrate::run(&mut c).await.unwrap().is_empty(),
        "second run applies nothing"
    );
    c.execute(
        "UPDATE outbox.schema_migrations SET checksum = 'edited' WHERE version = 1",
        &[],
    )
    .await
    .unwrap();
    let err = migrate::run(&mut c).await.unwrap_err().to_string();
    assert!(
        err.contains("migration 1") && err.contains("changed"),
        "{err}"
    );
}

#[tokio::test]
async fn enqueue_freezes_a_verifiable_envelope_and_rolls_back_with_the_transaction() {
    let (mut c, _) = fresh("ledger_enqueue").await;
    let tx = c.transaction().await.unwrap();
    let gone = enqueue(
        &tx,
        "order",
        "o-1",
        "order.created",
        &json!({"a": 1}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let tx = c.transaction().await.unwrap();
    let opts = EnqueueOptions {
        tenant: Some("t-7".into()),
        headers: Some(json!({"traceparent": "00-abc-def-01"})),
        payload_schema: Some("order.created.v2".into()),
        event_id: None,
    };
    let id = enqueue(
        &tx,
        "order",
        "o-1",
        "order.created",
        &json!({"b": [1, 2], "a": "ü"}),
        &opts,
    )
    .await
    .unwrap();
    let id2 = enqueue(
        &tx,
        "order",
        "o-1",
        "order.paid",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.events WHERE event_id = $1",
            &[&gone],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "a rolled-back enqueue leaves no row");
    assert_eq!(id.get_version_num(), 7, "UUIDv7");

    let ev = event(&c, id).await;
    // Digest parity: what SQL froze, Rust recomputes byte for byte.
    assert_eq!(ev.verify(), Ok(()));
    assert_eq!(
        ev.aggregate_version, 1,
        "the rolled-back enqueue gave its version back"
    );
    assert_eq!(ev.destination.topic, "outbox.event.order");
    assert_eq!(ev.destination.key, "o-1");
    assert_eq!(ev.tenant.as_deref(), Some("t-7"));
    assert_eq!(ev.payload_schema.as_deref(), Some("order.created.v2"));
    assert_eq!(event(&c, id2).await.aggregate_version, 2);
}

#[tokio::test]
async fn route_policy_generations_are_frozen_into_the_row() {
    let (c, _) = fresh("ledger_route").await;
    let g1: i64 = c
        .query_one(
            "SELECT outbox.set_route('invoice', NULL, 'billing.{aggregate_type}s')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let a = enqueue(
        &c,
        "invoice",
        "i-1",
        "invoice.issued",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let g2: i64 = c
        .query_one(
            "SELECT outbox.set_route('invoice', NULL, 'billing.v2')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let b = enqueue(
        &c,
        "invoice",
        "i-1",
        "invoice.paid",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let (ea, eb) = (event(&c, a).await, event(&c, b).await);
    assert_eq!(
        (
            ea.destination.topic.as_str(),
            ea.destination.route_generation
        ),
        ("billing.invoices", g1)
    );
    assert_eq!(
        (
            eb.destination.topic.as_str(),
            eb.destination.route_generation
        ),
        ("billing.v2", g2)
    );
    assert!(g2 > g1);
    assert_eq!(ea.verify(), Ok(()));
    assert_eq!(eb.verify(), Ok(()));
    // A destination that differs in any field has a different digest.
    let moved = Destination {
        topic: "elsewhere".into(),
        ..ea.destination.clone()
    };
    assert_ne!(moved.digest(), ea.destination_digest);
}

#[tokio::test]
async fn a_nats_route_freezes_one_subject_per_aggregate() {
    let (c, _) = fresh("ledger_nats_route").await;
    c.execute("SELECT outbox.set_nats_route('order', NULL, 'nats-a')", &[])
        .await
        .unwrap();
    let id = enqueue(
        &c,
        "order",
        "o-42",
        "order.created",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let ev = event(&c, id).await;
    let d = &ev.destination;
    assert_eq!(
        (
            d.kind.as_str(),
            d.cluster.as_str(),
            d.topic.as_str(),
            d.partitioner.as_str()
        ),
        ("nats", "nats-a", "outbox.order.o-42", "none")
    );
    // The SQL digest of the substituted subject equals the Rust one.
    assert_eq!(ev.verify(), Ok(()));
    let e = c
        .execute("SELECT outbox.set_nats_route('order', NULL, '')", &[])
        .await
        .unwrap_err();
    let msg = e.as_db_error().map(|d| d.message().to_string());
    assert!(msg.as_deref().unwrap_or("").contains("cluster"), "{e:?}");
}

/// Migration 0027: an outbox row is immutable (the relay proves what it publishes from the
/// committed row), whoever asks; DELETE (purge) stays.
#[tokio::test]
async fn an_outbox_row_is_immutable_once_written() {
    let (c, _) = fresh("ledger_immutable").await;
    let id = enqueue(
        &c,
        "order",
        "o-1",
        "order.created",
        &json!({"x": 1}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let stored: Option<String> = c
        .query_one(
            "SELECT payload_digest FROM outbox.events WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        stored, None,
        "outbox.enqueue leaves the digests to the relay"
    );
    for sql in [
        "UPDATE outbox.events SET payload = '{\"x\": 2}'",
        "UPDATE outbox.events SET dest_topic = 'elsewhere'",
        "UPDATE outbox.events SET payload_digest = 'sha256:00'",
    ] {
        let err = c.batch_execute(sql).await.unwrap_err();
        let db = err.as_db_error().expect("a database error");
        assert_eq!(db.code().code(), "55000", "{sql}");
        assert!(
            db.message().contains(&id.to_string()) && db.message().contains("immutable"),
            "{sql}: {}",
            db.message()
        );
    }
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM outbox.events WHERE payload = '{\"x\": 1}'"
        )
        .await,
        1
    );
    c.batch_execute("DELETE FROM outbox.events").await.unwrap();
}

/// The audit checks every primary receipt's digests against its row, computed again from the
/// row's columns: the acceptance matches a row without stored digests by its id only, so a
/// relay that computed a wrong digest would be caught here and nowhere else.
#[tokio::test]
async fn a_receipt_whose_digests_are_not_its_rows_is_named_by_the_audit() {
    let (mut c, _) = fresh("ledger_audit_digests").await;
    let events = enqueue_orders(&c, 3).await;
    checkpoint::create(&c, "s1", "outbox_pub", "sys", 1, Lsn(50))
        .await
        .unwrap();
    let mut wrong_payload = receipt(&events[1], 2);
    wrong_payload.payload_digest = events[0].payload_digest.clone();
    let mut wrong_destination = receipt(&events[2], 3);
    wrong_destination.destination_digest = events[0].destination_digest.clone();
    let out = accept::accept_batch(
        &mut c,
        "s1",
        &[
            LedgerItem::Receipt(receipt(&events[0], 1)),
            LedgerItem::Receipt(wrong_payload),
            LedgerItem::Receipt(wrong_destination),
        ],
        Some(Lsn(100)),
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        out.primary, 3,
        "rows without stored digests are matched by id"
    );
    let found = audit::ledger_conflicts(&c).await.unwrap();
    let named: std::collections::BTreeSet<_> = found
        .iter()
        .filter(|f| f.source == "receipt")
        .filter_map(|f| f.event_id)
        .collect();
    assert_eq!(
        named,
        [events[1].event_id, events[2].event_id]
            .into_iter()
            .collect(),
        "{found:?}"
    );
}

#[tokio::test]
async fn acceptance_keeps_one_primary_records_duplicates_and_quarantines_mismatches() {
    let (mut c, _) = fresh("ledger_accept").await;
    let id = enqueue(
        &c,
        "order",
        "o-9",
        "order.created",
        &json!({"x": 1}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let ev = event(&c, id).await;
    checkpoint::create(&c, "s1", "outbox_pub", "sys", 1, Lsn(50))
        .await
        .unwrap();

    // An operator migrated a second event to another topic: a receipt for its old
    // destination is a conflict, one for the new destination its primary receipt. Nothing
    // else of a row is compared (the relay computed the digests from the immutable row it
    // read): a forged payload digest is accepted, and the audit names it
    // (`a_receipt_whose_digests_are_not_its_rows_is_named_by_the_audit`).
    let (old_destination, migrated) = enqueue_and_move(&c, "o-10").await;
    let moved_id = old_destination.event_id;
    let mut moved = receipt(&old_destination, 6);
    moved.topic = "orders.moved".into();
    moved.destination_digest = migrated;
    let mut forged_dup = receipt(&ev, 10);
    forged_dup.payload_digest = "sha256:00".into();
    let out = accept::accept_batch(
        &mut c,
        "s1",
        &[
            LedgerItem::Receipt(receipt(&ev, 1)),
            LedgerItem::Receipt(receipt(&ev, 2)),
            LedgerItem::Receipt(receipt(&old_destination, 5)),
            LedgerItem::Receipt(moved),
            LedgerItem::Receipt(forged_dup),
        ],
        Some(Lsn(200)),
        None,
    )
    .await
    .unwrap();
    assert_eq!((out.primary, out.duplicates, out.conflicts), (2, 2, 1));
    let moved_topic: String = c
        .query_one(
            "SELECT topic FROM outbox.receipts WHERE event_id = $1",
            &[&moved_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        moved_topic, "orders.moved",
        "the old destination's ACK is not the primary"
    );
    let found = audit::ledger_conflicts(&c).await.unwrap();
    assert!(
        !found.iter().any(|f| f.source == "receipt"),
        "the primary receipts carry their rows' digests: {found:?}"
    );

    // A replay after a crash: a late ACK of the same event.
    let out = accept::accept_batch(
        &mut c,
        "s1",
        &[LedgerItem::Receipt(receipt(&ev, 3))],
        Some(Lsn(150)),
        None,
    )
    .await
    .unwrap();
    assert_eq!((out.primary, out.duplicates), (0, 1));

    let primary_offset: i64 = c
        .query_one(
            "SELECT \"offset\" FROM outbox.receipts WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(primary_offset, 1, "the first ACK holds the publish slot");
    let cp = checkpoint::load(&c, "s1").await.unwrap().unwrap();
    assert_eq!(
        cp.confirmed_lsn,
        Lsn(200),
        "the checkpoint never moves backwards"
    );
    let q: String = c
        .query_one("SELECT reason_code FROM outbox.quarantine", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(q, "receipt_digest_mismatch");

    // Quarantine records are idempotent by key (a replayed malformed row).
    let rec = QuarantineRecord {
        key: "lsn:0/10:1".into(),
        event_id: None,
        aggregate_type: None,
        aggregate_id: None,
        aggregate_version: None,
        reason_code: "unreadable_row".into(),
        reason: "column x".into(),
        commit_lsn: Lsn(16),
        envelope_generation: None,
    };
    for _ in 0..2 {
        accept::accept_batch(
            &mut c,
            "s1",
            &[LedgerItem::Quarantine(rec.clone())],
            None,
            None,
        )
        .await
        .unwrap();
    }
    let n = count(&c, "SELECT count(*) FROM outbox.quarantine").await;
    assert_eq!(n, 2);
}

/// A lease is taken before it expires only from a holder whose session lock is free (its
/// session ended) and who had taken that lock (migration 0018).
#[tokio::test]
async fn a_lease_is_taken_early_only_when_its_holders_session_lock_is_free() {
    use outbox_ledger::lease::{self, Acquire};
    use std::time::Duration;
    let (c, url) = fresh("ledger_early_lease").await;
    let connect = || async {
        let (client, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
        let task = tokio::spawn(conn);
        (client, task)
    };
    let ttl = Duration::from_secs(60);
    // A takes the lock and the lease on its own session.
    let (a, a_conn) = connect().await;
    assert!(lease::try_lock(&a, "s").await.unwrap());
    let Acquire::Acquired {
        generation: g1,
        early,
    } = lease::try_acquire(&a, "s", "A", ttl, true).await.unwrap()
    else {
        panic!("A acquires a free lease");
    };
    assert!(!early);
    // B: the lock is A's while A's session lives, so B waits for the lease to expire.
    let (b, _b_conn) = connect().await;
    assert!(
        !lease::try_lock(&b, "s").await.unwrap(),
        "A's session holds the lock"
    );
    assert!(matches!(
        lease::try_acquire(&b, "s", "B", ttl, false).await.unwrap(),
        Acquire::HeldBy { .. }
    ));
    // A lock without the holder's own (an older holder, or one that found it taken) proves
    // nothing: C holds a lock that A never took under its own name.
    assert!(lease::try_lock(&c, "t").await.unwrap());
    let Acquire::Acquired { .. } = lease::try_acquire(&b, "t", "B", ttl, false).await.unwrap()
    else {
        panic!("B takes lease t without its lock");
    };
    lease::unlock(&c, "t").await.unwrap();
    assert!(lease::try_lock(&c, "t").await.unwrap());
    assert!(
        matches!(
            lease::try_acquire(&c, "t", "C", ttl, true).await.unwrap(),
            Acquire::HeldBy { .. }
        ),
        "B never took the lock of t: its lease is taken only when it expires"
    );
    // A's session ends (its process died): B takes the lock and the lease at once.
    drop(a);
    a_conn.await.unwrap().unwrap();
    let mut locked = false;
    for _ in 0..100 {
        locked = lease::try_lock(&b, "s").await.unwrap();
        if locked {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(locked, "A's lock is freed with its session");
    let Acquire::Acquired {
        generation: g2,
        early,
    } = lease::try_acquire(&b, "s", "B", ttl, true).await.unwrap()
    else {
        panic!("B takes the lease of a holder whose session is gone");
    };
    assert!(early && g2 == g1 + 1, "early {early}, generation {g2}");
}

/// `lease::try_acquire`'s statement and `outbox_core::lease::take` (the rule the simulator
/// decides its takeovers with) agree on every combination of a lease's facts: free or not,
/// expired, the taker's own, the taker holding the session lock, the holder having taken it.
/// (A walsender streaming the slot is the one fact not set here: the slots named do not
/// exist; the e2e takeover tests stream.)
#[tokio::test]
async fn a_lease_is_taken_as_the_rule_says() {
    use outbox_core::lease::{take, LeaseFacts, Take};
    use outbox_ledger::lease::{self, Acquire};
    use std::time::Duration;
    let (c, _) = fresh("ledger_lease_rule").await;
    let mut cases = vec![LeaseFacts {
        free: true,
        expired: false,
        ours: false,
        taker_locked: false,
        holder_locks: false,
        slot_active: false,
    }];
    for bits in 0..16u8 {
        cases.push(LeaseFacts {
            free: false,
            expired: bits & 1 != 0,
            ours: bits & 2 != 0,
            taker_locked: bits & 4 != 0,
            holder_locks: bits & 8 != 0,
            slot_active: false,
        });
    }
    let mut taken = [0, 0];
    for (i, f) in cases.iter().enumerate() {
        let slot = format!("rule_{i}");
        if !f.free {
            c.execute(
                "INSERT INTO outbox.relay_leases (slot_name, owner, generation, lease_until, holder_locks)
                 VALUES ($1, 'H', 7, clock_timestamp() + CASE WHEN $2 THEN interval '-1 minute'
                                                        ELSE interval '1 minute' END, $3)",
                &[&slot, &f.expired, &f.holder_locks],
            )
            .await
            .unwrap();
        }
        let owner = if f.ours { "H" } else { "T" };
        let got = lease::try_acquire(&c, &slot, owner, Duration::from_secs(60), f.taker_locked)
            .await
            .unwrap();
        let got = match got {
            Acquire::Acquired { early, .. } => Take::Taken { early },
            Acquire::HeldBy { .. } => Take::Held,
        };
        assert_eq!(got, take(*f), "{f:?}");
        if let Take::Taken { early } = got {
            taken[usize::from(early)] += 1;
        }
    }
    // Both kinds of takeover and the refusal occur among the cases.
    assert!(
        taken[0] > 0 && taken[1] > 0 && taken[0] + taken[1] < cases.len(),
        "{taken:?}"
    );
}

#[tokio::test]
async fn a_stale_generation_cannot_move_the_checkpoint_but_its_receipts_are_kept() {
    use outbox_ledger::lease::{self, Acquire, Fence};
    use std::time::Duration;
    let (mut c, _) = fresh("ledger_lease").await;
    let ttl = Duration::from_millis(300);
    let Acquire::Acquired { generation: g1, .. } =
        lease::try_acquire(&c, "s", "A", ttl, false).await.unwrap()
    else {
        panic!("A acquires a free lease");
    };
    assert!(matches!(
        lease::try_acquire(&c, "s", "B", ttl, false).await.unwrap(),
        Acquire::HeldBy { .. }
    ));
    let a = Fence {
        owner: "A".into(),
        generation: g1,
    };
    assert!(lease::renew(&c, "s", &a, ttl).await.unwrap());
    checkpoint::create(&c, "s", "outbox_pub", "sys", 1, Lsn(10))
        .await
        .unwrap();

    tokio::time::sleep(Duration::from_millis(400)).await; // A's lease runs out
    let Acquire::Acquired {
        generation: g2,
        early,
    } = lease::try_acquire(&c, "s", "B", ttl, false).await.unwrap()
    else {
        panic!("B takes over an expired lease");
    };
    assert!(g2 > g1 && !early);
    assert!(
        !lease::renew(&c, "s", &a, ttl).await.unwrap(),
        "A cannot renew"
    );

    let id = enqueue(
        &c,
        "order",
        "o-1",
        "x",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let ev = event(&c, id).await;
    let err = accept::accept_batch(
        &mut c,
        "s",
        &[LedgerItem::Receipt(receipt(&ev, 1))],
        Some(Lsn(99)),
        Some(&a),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, outbox_ledger::LedgerError::LeaseLost { .. }),
        "{err}"
    );
    let n = count(&c, "SELECT count(*) FROM outbox.receipts").await;
    assert_eq!(n, 1, "the zombie's receipt is kept");
    // The relay used to keep a fenced batch for salvage although it had committed, and record
    // it again: each receipt became a duplicate of itself. The same ACK is recorded once.
    let again = accept::accept_batch(
        &mut c,
        "s",
        &[LedgerItem::Receipt(receipt(&ev, 1))],
        None,
        Some(&a),
    )
    .await
    .unwrap();
    assert_eq!((again.primary, again.duplicates), (0, 0), "{again:?}");
    let dups = count(&c, "SELECT count(*) FROM outbox.duplicate_receipts").await;
    assert_eq!(
        dups, 0,
        "a fenced batch recorded twice is not a duplicate receipt"
    );
    assert_eq!(
        checkpoint::load(&c, "s")
            .await
            .unwrap()
            .unwrap()
            .confirmed_lsn,
        Lsn(10),
        "not moved"
    );

    let b = Fence {
        owner: "B".into(),
        generation: g2,
    };
    accept::accept_batch(&mut c, "s", &[], Some(Lsn(99)), Some(&b))
        .await
        .unwrap();
    assert_eq!(
        checkpoint::load(&c, "s")
            .await
            .unwrap()
            .unwrap()
            .confirmed_lsn,
        Lsn(99)
    );
}

/// The optimistic acceptance: a batch of fresh receipts is inserted by the plain statement; a
/// batch holding an event that already has its primary receipt is rolled back and accepted
/// again with the duplicate classified (one fallback), and the next batch starts classifying;
/// a tombstone at or above the batch's smallest id, or any destination migration, keeps the
/// plain statement out (nothing written by it) and the receipts are classified as before.
#[tokio::test]
async fn the_optimistic_acceptance_inserts_fresh_batches_and_falls_back_on_a_taken_slot() {
    let (mut c, _) = fresh("ledger_optimistic").await;
    let events = enqueue_orders(&c, 8).await;
    let mut prepared = accept::Prepared::default();
    let counts = |o: outbox_ledger::AcceptOutcome| (o.primary, o.duplicates, o.conflicts);
    let batch =
        |rs: Vec<ReceiptRecord>| rs.into_iter().map(LedgerItem::Receipt).collect::<Vec<_>>();

    // Fresh: inserted by the plain statement.
    let b = batch(events[0..3].iter().map(|e| receipt(e, 1)).collect());
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &b, None, None)
        .await
        .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((3, 0, 0), 0));

    // One of them again (a replay) among two fresh ones: one fallback, one duplicate.
    let mut b = vec![receipt(&events[0], 2)];
    b.extend(events[3..5].iter().map(|e| receipt(e, 1)));
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &batch(b), None, None)
        .await
        .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((2, 1, 0), 1));

    // The next batch starts classifying (no second fallback although it replays too).
    let b = vec![receipt(&events[1], 3), receipt(&events[5], 1)];
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &batch(b), None, None)
        .await
        .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((1, 1, 0), 1));
    let row = c
        .query_one(
            "SELECT (SELECT count(*) FROM outbox.receipt_entries),
                    (SELECT count(*) FROM outbox.duplicate_receipts),
                    (SELECT count(*) FROM outbox.receipt_batches)",
            &[],
        )
        .await
        .unwrap();
    // One batch row per statement that accepted: the rolled-back attempt left none.
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2)
        ),
        (6, 2, 3)
    );

    // A batch that meets no accepted event lets the next one try the plain insert again.
    assert!(!prepared.tries_plain_insert_next());
    let b = vec![receipt(&events[6], 1)];
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &batch(b), None, None)
        .await
        .unwrap();
    assert_eq!(counts(out), (1, 0, 0));
    assert!(prepared.tries_plain_insert_next());

    // A tombstone above the batch's smallest id: the plain statement stays out, the
    // tombstoned event's late ACK is a duplicate.
    let gone = uuid::Uuid::now_v7();
    let mut late = receipt(&events[7], 1);
    late.event_id = gone;
    tombstone(&c, gone, 1, &late).await;
    let out = accept::accept_batch_prepared(
        &mut c,
        &mut prepared,
        "s",
        &batch(vec![late, receipt(&events[7], 1)]),
        None,
        None,
    )
    .await
    .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((1, 1, 0), 1));

    // Any destination migration: a receipt for the migrated event's old destination is a
    // conflict, never a primary.
    let (before_move, _) = enqueue_and_move(&c, "o-moved").await;
    assert!(prepared.tries_plain_insert_next());
    let out = accept::accept_batch_prepared(
        &mut c,
        &mut prepared,
        "s",
        &batch(vec![receipt(&before_move, 1)]),
        None,
        None,
    )
    .await
    .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((0, 0, 1), 1));
}

/// Slot `s`'s accepted positions (migration 0034): (relay generation, commit LSN, change LSN).
async fn through(c: &Client) -> Vec<(i64, String, String)> {
    c.query(
        "SELECT relay_generation, commit_lsn::text, change_lsn::text
         FROM outbox.accepted_positions WHERE slot_name = 's' ORDER BY relay_generation",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// Receipts read from the stream carry their position (commit LSN, change LSN), and each relay
/// run's highest accepted one is kept (migration 0034): a run's batch past the other runs'
/// positions is inserted plainly, even when the run accepts its own receipts out of stream
/// order; a replay by the next run is classified without a failed attempt first; a batch
/// proven new whose event another slot accepted still falls back on the key; a receipt
/// without a position raises generation -1 to the WAL's insert position, which every run's
/// proof counts; and recreating the slot keeps them all.
#[tokio::test]
async fn the_slots_accepted_position_decides_the_plain_insert_without_a_failed_attempt() {
    let (mut c, _) = fresh("ledger_accepted_through").await;
    checkpoint::create(&c, "s", "outbox_pub", "sys", 1, Lsn(0x10))
        .await
        .unwrap();
    let events = enqueue_orders(&c, 8).await;
    let at = |ev: &OutboxEvent, run: i64, commit: u64, change: u64| ReceiptRecord {
        relay_generation: run,
        commit_lsn: Some(Lsn(commit)),
        change_lsn: Some(Lsn(change)),
        ..receipt(ev, 1)
    };
    // A copy sent again (another offset: the same ACK recorded twice is no new evidence).
    let again = |r: ReceiptRecord| ReceiptRecord { offset: 2, ..r };
    let batch =
        |rs: Vec<ReceiptRecord>| rs.into_iter().map(LedgerItem::Receipt).collect::<Vec<_>>();
    let counts = |o: outbox_ledger::AcceptOutcome| (o.primary, o.duplicates, o.conflicts);
    let row = |g: i64, a: &str, b: &str| (g, a.to_string(), b.to_string());
    assert!(through(&c).await.is_empty(), "nothing accepted yet");

    let mut prepared = accept::Prepared::default();
    // Run 1: two rows of the transaction committed at 0/200, then one it read before them
    // (the broker answered it later): still new, no other run has accepted anything.
    let b = batch(vec![
        at(&events[0], 1, 0x200, 0x150),
        at(&events[1], 1, 0x200, 0x160),
    ]);
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &b, None, None)
        .await
        .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((2, 0, 0), 0));
    let b = batch(vec![at(&events[2], 1, 0x200, 0x140)]);
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &b, None, None)
        .await
        .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((1, 0, 0), 0));
    assert_eq!(through(&c).await, vec![row(1, "0/200", "0/160")]);

    // Run 2 (after a restart) reads the transaction again: not past run 1's position, so
    // classified at once, without a failed plain insert first (the guess would have tried
    // one, as the_optimistic_acceptance_... shows).
    let b = batch(vec![
        again(at(&events[1], 2, 0x200, 0x160)),
        at(&events[3], 2, 0x300, 0x10),
    ]);
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &b, None, None)
        .await
        .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((1, 1, 0), 0));
    // Past run 1's: new.
    let b = batch(vec![at(&events[4], 2, 0x300, 0x20)]);
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &b, None, None)
        .await
        .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((1, 0, 0), 0));
    assert_eq!(
        through(&c).await,
        vec![row(1, "0/200", "0/160"), row(2, "0/300", "0/20")]
    );

    // Another slot accepted event 5 (no checkpoint row there: nothing is proven for it);
    // slot s then reads it past its other runs' positions: proven new, the key refuses it,
    // one fallback, a duplicate.
    let out = accept::accept_batch(
        &mut c,
        "t",
        &batch(vec![receipt(&events[5], 9)]),
        None,
        None,
    )
    .await
    .unwrap();
    assert_eq!(counts(out), (1, 0, 0));
    let b = batch(vec![
        at(&events[5], 2, 0x300, 0x30),
        at(&events[6], 2, 0x300, 0x40),
    ]);
    let out = accept::accept_batch_prepared(&mut c, &mut prepared, "s", &b, None, None)
        .await
        .unwrap();
    assert_eq!((counts(out), prepared.fallbacks()), ((1, 1, 0), 1));

    // A receipt that knows nothing of its row's position (a look-up's at start): the WAL's
    // insert position bounds it, under generation -1, and every run's proof counts it.
    let lookup = ReceiptRecord {
        commit_lsn: None,
        ..receipt(&events[7], 1)
    };
    let out =
        accept::accept_batch_prepared(&mut c, &mut prepared, "s", &batch(vec![lookup]), None, None)
            .await
            .unwrap();
    assert_eq!(counts(out), (1, 0, 0));
    let rows = through(&c).await;
    let (g, commit, change) = rows[0].clone();
    let bounded: bool = c
        .query_one(
            "SELECT $1::text::pg_lsn > '0/300' AND $1::text::pg_lsn <= pg_current_wal_lsn()",
            &[&commit],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        bounded && g == -1 && change == "FFFFFFFF/FFFFFFFF",
        "{rows:?}"
    );

    // The slot recreated under the same name keeps them: positions are the cluster's WAL
    // positions, and a paused run of the old slot may still salvage receipts it read there.
    checkpoint::create(&c, "s", "outbox_pub", "sys", 1, Lsn(0x400))
        .await
        .unwrap();
    assert_eq!(through(&c).await, rows);
}

/// The plain acceptance writes its entries by binary `COPY`: every column of a receipt reads
/// back as the classifying statement stores it (broker time, evidence, commit LSN, digests,
/// position, attempt, generation; present and absent), and an open held event of an accepted
/// receipt is closed as the classifying statement closes it.
#[tokio::test]
async fn the_copied_entries_read_back_as_the_classifying_statement_writes_them() {
    let (mut c, _) = fresh("ledger_copy_entries").await;
    let events = enqueue_orders(&c, 4).await;
    let full = |ev: &OutboxEvent| ReceiptRecord {
        partition: 5,
        timestamp_ms: Some(1_700_000_000_123),
        attempt: 3,
        relay_generation: 7,
        commit_lsn: Some(Lsn(0x1_0000_0042)),
        change_lsn: None,
        evidence: Some(r#"{"status": 202, "response_id": "r-1"}"#.into()),
        ..receipt(ev, 41)
    };
    let bare = |ev: &OutboxEvent| ReceiptRecord {
        timestamp_ms: None,
        commit_lsn: None,
        change_lsn: None,
        evidence: None,
        ..receipt(ev, 42)
    };
    for ev in &events[0..2] {
        c.execute(
            "INSERT INTO outbox.held_events (event_id, aggregate_type, aggregate_id,
                                             aggregate_version, commit_lsn, slot_name)
             VALUES ($1, 'order', $2, 1, '0/10', 's')",
            &[&ev.event_id, &ev.aggregate_id],
        )
        .await
        .unwrap();
    }
    let items =
        |rs: [ReceiptRecord; 2]| rs.into_iter().map(LedgerItem::Receipt).collect::<Vec<_>>();

    let mut plain = accept::Prepared::default();
    let out = accept::accept_batch_prepared(
        &mut c,
        &mut plain,
        "s",
        &items([full(&events[0]), bare(&events[2])]),
        None,
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        (out.primary, plain.fallbacks()),
        (2, 0),
        "copied, no fallback"
    );
    let mut classifying = accept::Prepared::expecting_duplicates();
    let out = accept::accept_batch_prepared(
        &mut c,
        &mut classifying,
        "s",
        &items([full(&events[1]), bare(&events[3])]),
        None,
        None,
    )
    .await
    .unwrap();
    assert_eq!(out.primary, 2);

    let read = |id: uuid::Uuid| {
        let c = &c;
        async move {
            let r = c
                .query_one(
                    "SELECT broker_timestamp::text, evidence::text, commit_lsn::text, attempt,
                            relay_generation, partition, \"offset\", broker_kind, broker_cluster,
                            topic, payload_digest, destination_digest, slot_name,
                            (SELECT released_at IS NOT NULL FROM outbox.held_events h
                             WHERE h.event_id = r.event_id)
                     FROM outbox.receipts r WHERE event_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            (
                (
                    r.get::<_, Option<String>>(0),
                    r.get::<_, Option<String>>(1),
                    r.get::<_, Option<String>>(2),
                    r.get::<_, i32>(3),
                    r.get::<_, i64>(4),
                    r.get::<_, i32>(5),
                    r.get::<_, i64>(6),
                ),
                (
                    r.get::<_, String>(7),
                    r.get::<_, String>(8),
                    r.get::<_, String>(9),
                    r.get::<_, String>(10),
                    r.get::<_, String>(11),
                    r.get::<_, String>(12),
                    r.get::<_, Option<bool>>(13),
                ),
            )
        }
    };
    // The same receipt fields on two events of the same topic: the same stored columns, but
    // for the digests, which are each event's own.
    let (copied, classified) = (
        read(events[0].event_id).await,
        read(events[1].event_id).await,
    );
    assert_eq!(copied.0, classified.0);
    assert_eq!(
        copied.0 .0.as_deref(),
        Some("2023-11-14 22:13:20.123+00"),
        "the broker time to the millisecond"
    );
    assert_eq!(
        (copied.1 .3.as_str(), copied.1 .4.as_str()),
        (
            events[0].payload_digest.as_str(),
            events[0].destination_digest.as_str()
        )
    );
    assert_eq!(
        (classified.1 .3.as_str(), classified.1 .4.as_str()),
        (
            events[1].payload_digest.as_str(),
            events[1].destination_digest.as_str()
        )
    );
    assert_eq!(
        (
            &copied.1 .0,
            &copied.1 .1,
            &copied.1 .2,
            &copied.1 .5,
            copied.1 .6
        ),
        (
            &classified.1 .0,
            &classified.1 .1,
            &classified.1 .2,
            &classified.1 .5,
            Some(true)
        ),
        "kind, cluster, topic, slot; the held event closed by either"
    );
    let (copied, classified) = (
        read(events[2].event_id).await,
        read(events[3].event_id).await,
    );
    assert_eq!(copied.0, classified.0);
    assert_eq!((copied.0 .0, copied.0 .1, copied.0 .2), (None, None, None));
    assert_eq!((copied.1 .6, classified.1 .6), (None, None));
}

/// A receipt keeps the version its event was published with (migration 0036), written by both
/// acceptance paths (the plain `COPY` and the classifying statement) from the receipt, not
/// read from the row: a relay that assigns versions (docs/versions_by_relay.md) publishes rows
/// that hold none. Here each receipt names a version its row does not hold (the rows are
/// version 1), so a path that stored the row's version, or none, fails.
#[tokio::test]
async fn a_receipt_keeps_the_version_it_was_published_with() {
    let (mut c, _) = fresh("ledger_receipt_versions").await;
    let events = enqueue_orders(&c, 2).await;
    let published = |ev: &OutboxEvent, version: i64| ReceiptRecord {
        aggregate_version: version,
        ..receipt(ev, version)
    };
    for (path, prepared, ev, version) in [
        ("the plain COPY", accept::Prepared::default(), &events[0], 7),
        (
            "the classifying statement",
            accept::Prepared::expecting_duplicates(),
            &events[1],
            9,
        ),
    ] {
        let mut prepared = prepared;
        let out = accept::accept_batch_prepared(
            &mut c,
            &mut prepared,
            "s",
            &[LedgerItem::Receipt(published(ev, version))],
            None,
            None,
        )
        .await
        .unwrap();
        assert_eq!(out.primary, 1);
        let (stored, row): (Option<i64>, i64) = {
            let r = c
                .query_one(
                    "SELECT r.aggregate_version, e.aggregate_version
                     FROM outbox.receipts r JOIN outbox.events e USING (event_id)
                     WHERE r.event_id = $1",
                    &[&ev.event_id],
                )
                .await
                .unwrap();
            (r.get(0), r.get(1))
        };
        assert_eq!(
            (stored, row),
            (Some(version), 1),
            "accepted by {path}, the receipt holds the version it was published with"
        );
    }
}

/// `outbox.receipt_of(id)` (migration 0033) is how a reader asks about one event: the row the
/// view has for it, none without a receipt, and planned as the probe of the view it replaces
/// (PostgreSQL inlines it: no scan of the function, the entries' key), which is what keeps the
/// readers' plans when the layout behind it changes (docs/evidence_batches.md).
#[tokio::test]
async fn receipt_of_is_the_views_row_and_is_inlined_into_an_index_probe() {
    let (mut c, _) = fresh("ledger_receipt_of").await;
    let events = enqueue_orders(&c, 2).await;
    let items = vec![LedgerItem::Receipt(receipt(&events[0], 7))];
    accept::accept_batch(&mut c, "s", &items, None, None)
        .await
        .unwrap();
    let row = |sql: &'static str, id: uuid::Uuid| {
        let c = &c;
        async move {
            c.query(sql, &[&id])
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r.get::<_, String>(0),
                        r.get::<_, i64>(1),
                        r.get::<_, String>(2),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let via_function = "SELECT topic, \"offset\", payload_digest FROM outbox.receipt_of($1)";
    let via_view =
        "SELECT topic, \"offset\", payload_digest FROM outbox.receipts WHERE event_id = $1";
    let published = row(via_function, events[0].event_id).await;
    assert_eq!(published, row(via_view, events[0].event_id).await);
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].1, 7);
    assert!(row(via_function, events[1].event_id).await.is_empty());

    for probe in [
        "EXPLAIN SELECT EXISTS (SELECT 1 FROM outbox.receipt_of($1::uuid))",
        "EXPLAIN SELECT e.event_id FROM outbox.events e
         WHERE e.event_id = $1::uuid AND NOT EXISTS (SELECT 1 FROM outbox.receipt_of(e.event_id))",
        // The SQL of earlier migrations that migration 0033 redefined to ask it.
        "EXPLAIN SELECT state FROM outbox.event_status WHERE event_id = $1::uuid",
        "EXPLAIN SELECT * FROM outbox.aggregate_heads_of(ARRAY['order'], ARRAY['o-0'])
         WHERE $1::uuid IS NOT NULL",
    ] {
        let plan: Vec<String> = c
            .query(probe, &[&events[0].event_id])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let plan = plan.join("\n");
        assert!(
            !plan.contains("receipt_of") && plan.contains("receipt_entries_pkey"),
            "outbox.receipt_of is not inlined into a probe of the entries' key:\n{plan}"
        );
    }
}

/// The acceptance statements implement `outbox_core::receipt::classify` set-wise (the rule the simulator
/// drives): the same inputs give the same verdicts. And a refusal arriving after the event was
/// published (a paused relay's stale batch) records neither a quarantine nor a hold.
#[tokio::test]
async fn the_acceptance_sql_agrees_with_the_core_rule_and_ignores_stale_refusals() {
    use outbox_core::receipt::{classify, Digests, ReceiptClass};
    use outbox_ledger::HoldRecord;

    // Both ways in: optimistic first (its conditions do not hold, so the classifying statement
    // runs in the same transaction) and duplicate-aware, as a relay after a replayed batch.
    let mut last = None;
    for optimistic in [true, false] {
        let (mut c, _) = fresh(if optimistic {
            "ledger_classify"
        } else {
            "ledger_classify_dup"
        })
        .await;
        let tx = c.transaction().await.unwrap();
        let id = enqueue(
            &tx,
            "order",
            "o-9",
            "order.created",
            &json!({"a": 1}),
            &EnqueueOptions::default(),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let ev = event(&c, id).await;
        // A copy written around outbox.enqueue stores its digests; the acceptance does not read
        // them (the relay checked them when it decoded the row).
        let kept = event(&c, with_stored_digests(&c, id, 2).await).await;
        let mut mismatched = receipt(&kept, 9);
        mismatched.destination_digest = "sha256:elsewhere".into();
        let mut unchecked = receipt(&ev, 11);
        unchecked.destination_digest = "sha256:elsewhere".into();
        let mut orphan = receipt(&ev, 10);
        orphan.event_id = uuid::Uuid::now_v7();
        // A purged event's tombstone keeps its publish slot.
        let mut late = receipt(&ev, 12);
        late.event_id = uuid::Uuid::now_v7();
        tombstone(&c, late.event_id, 1, &late).await;
        // A newer tombstone, so that the late ACK's id is below the newest one and the probe of
        // the tombstones (not the "above every tombstone" shortcut) must find it.
        tombstone(&c, uuid::Uuid::now_v7(), 2, &late).await;
        // An event an operator migrated: receipts are compared with the migration's digest.
        let (before_move, migrated) = enqueue_and_move(&c, "o-10").await;
        let stale_destination = receipt(&before_move, 20);
        let mut moved = receipt(&before_move, 21);
        moved.topic = "orders.moved".into();
        moved.destination_digest = migrated.clone();
        let mut stale_after = receipt(&before_move, 22);
        stale_after.attempt = 2;

        // (receipt, the destination digest of the event's migration, publish slot already taken)
        let m = Some(migrated.as_str());
        let cases = [
            (receipt(&ev, 1), None, false),
            (receipt(&ev, 2), None, true),
            (unchecked.clone(), None, true),
            (mismatched.clone(), None, false),
            (orphan.clone(), None, false),
            (late.clone(), None, true),
            (stale_destination, m, false),
            (moved, m, false),
            (stale_after, m, true),
        ];
        for (r, migrated, has_primary) in cases {
            let expected = classify(
                migrated,
                has_primary,
                Digests {
                    payload: &r.payload_digest,
                    destination: &r.destination_digest,
                },
            );
            let mut prepared = if optimistic {
                accept::Prepared::default()
            } else {
                accept::Prepared::expecting_duplicates()
            };
            let out = accept::accept_batch_prepared(
                &mut c,
                &mut prepared,
                "s",
                &[LedgerItem::Receipt(r.clone())],
                None,
                None,
            )
            .await
            .unwrap();
            let got = match (out.primary, out.duplicates, out.conflicts) {
                (1, 0, 0) => "primary",
                (0, 1, 0) => "duplicate",
                (0, 0, 1) => "conflict",
                other => panic!("unexpected outcome {other:?}"),
            };
            let want = match expected {
                ReceiptClass::Primary => "primary",
                ReceiptClass::Duplicate => "duplicate",
                ReceiptClass::Conflict(_) => "conflict",
            };
            assert_eq!(got, want, "receipt {r:?}");
            // A migration and tombstones exist, so the plain statement's conditions never
            // hold here: it writes nothing and the classifying statement decides (the open
            // gate: the_optimistic_acceptance_inserts_fresh_batches_and_falls_back_on_a_taken_slot).
            assert_eq!(
                prepared.fallbacks(),
                0,
                "optimistic={optimistic}, receipt {r:?}"
            );
        }
        last = Some((c, id));
    }
    let (mut c, id) = last.unwrap();

    let stale = [
        LedgerItem::Quarantine(QuarantineRecord {
            key: id.to_string(),
            event_id: Some(id),
            aggregate_type: Some("order".into()),
            aggregate_id: Some("o-9".into()),
            aggregate_version: Some(1),
            reason_code: "destination_not_served".into(),
            reason: "decided before a migration published it".into(),
            commit_lsn: Lsn(100),
            envelope_generation: Some(1),
        }),
        LedgerItem::Hold(HoldRecord {
            aggregate_type: "order".into(),
            aggregate_id: "o-9".into(),
            reason_code: "destination_not_served".into(),
            reason: "stale".into(),
            blocking_event_id: Some(id),
            blocking_version: Some(1),
            blocking_generation: Some(1),
            blocking_by_relay: None,
        }),
    ];
    accept::accept_batch(&mut c, "s", &stale, None, None)
        .await
        .unwrap();
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM outbox.quarantine WHERE reason_code = 'destination_not_served'"
        )
        .await,
        0,
        "a published event is never quarantined afterwards"
    );
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.holds").await, 0);
}

/// A quarantine and hold decided for an event's first envelope generation, committed after an
/// operator migrated the event to a second one (a paused relay's salvaged batch), are not
/// recorded: they are about a destination the event no longer has (outbox-sim, seed 1 trace
/// 189388). The same refusals for the current generation are.
#[tokio::test]
async fn a_refusal_decided_before_a_migration_is_not_recorded() {
    use outbox_ledger::HoldRecord;

    let (mut c, _) = fresh("ledger_superseded").await;
    let id = enqueue_and_move(&c, "o-7").await.0.event_id;
    let generation: i32 = c
        .query_one(
            "SELECT envelope_generation FROM outbox.events_current WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(generation, 2);
    let refusals = |g: i32| {
        [
            LedgerItem::Quarantine(QuarantineRecord {
                key: id.to_string(),
                event_id: Some(id),
                aggregate_type: Some("order".into()),
                aggregate_id: Some("o-7".into()),
                aggregate_version: Some(1),
                reason_code: "destination_not_served".into(),
                reason: format!("decided for generation {g}"),
                commit_lsn: Lsn(100),
                envelope_generation: Some(g),
            }),
            LedgerItem::Hold(HoldRecord {
                aggregate_type: "order".into(),
                aggregate_id: "o-7".into(),
                reason_code: "destination_not_served".into(),
                reason: format!("decided for generation {g}"),
                blocking_event_id: Some(id),
                blocking_version: Some(1),
                blocking_generation: Some(g),
                blocking_by_relay: None,
            }),
        ]
    };
    let out = accept::accept_batch(&mut c, "s", &refusals(1), None, None)
        .await
        .unwrap();
    assert_eq!(out.quarantined, 0, "{out:?}");
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.quarantine").await, 0);
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.holds").await, 0);
    let out = accept::accept_batch(&mut c, "s", &refusals(2), None, None)
        .await
        .unwrap();
    assert_eq!(out.quarantined, 1, "{out:?}");
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.holds").await, 1);
}

#[tokio::test]
async fn a_receipt_without_a_broker_position_is_refused_by_the_database() {
    let (mut c, _) = fresh("ledger_positions").await;
    let id = enqueue(
        &c,
        "order",
        "o-1",
        "x",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let ev = event(&c, id).await;
    // librdkafka's implicit ack reports offset -1001 (RD_KAFKA_OFFSET_INVALID).
    for (partition, offset) in [(0, -1001), (-1, 5)] {
        let bad = ReceiptRecord {
            partition,
            ..receipt(&ev, offset)
        };
        let err = accept::accept_batch(&mut c, "s", &[LedgerItem::Receipt(bad)], None, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("receipts_position_check"), "{err}");
    }
    // A primary receipt, then duplicates: -1001 is refused there too.
    accept::accept_batch(
        &mut c,
        "s",
        &[LedgerItem::Receipt(receipt(&ev, 3))],
        None,
        None,
    )
    .await
    .unwrap();
    let err = accept::accept_batch(
        &mut c,
        "s",
        &[LedgerItem::Receipt(receipt(&ev, -1001))],
        None,
        None,
    )
    .await
    .unwrap_err()
    .to_string();
    // The statement's primary and duplicate inserts both see the row; which CHECK fires first
    // is the planner's choice (`receipts_position_check` or `duplicate_receipts_position_check`),
    // and either refuses the whole batch.
    assert!(
        err.contains("receipts_position_check") && err.contains("SQLSTATE 23514"),
        "{err}"
    );
    let n = count(&c, "SELECT (SELECT count(*) FROM outbox.receipts) + (SELECT count(*) FROM outbox.duplicate_receipts)").await;
    assert_eq!(n, 1, "only the receipt with a position was recorded");
}

#[tokio::test]
async fn a_retry_keeps_its_attempt_generation_across_restarts() {
    let (mut c, _) = fresh("ledger_retry_generation").await;
    let id = enqueue(
        &c,
        "order",
        "o-1",
        "x",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let sent = std::time::SystemTime::now();
    outbox_ledger::attempts::record_unknown(&c, "s", id, 1, 1, "t", 0, sent, "timed out", None)
        .await
        .unwrap();
    // An attempt of a row written without a version keeps what the relay gave it.
    outbox_ledger::attempts::record_unknown(
        &c,
        "other",
        id,
        2,
        1,
        "t",
        0,
        sent,
        "timed out",
        Some((4, Some(9))),
    )
    .await
    .unwrap();
    let kept = outbox_ledger::attempts::open_unknown(&c, "other")
        .await
        .unwrap();
    assert_eq!(kept[0].by_relay, Some((4, Some(9))));
    assert!(
        outbox_ledger::attempts::retry_generations(&c, "s")
            .await
            .unwrap()
            .is_empty(),
        "an open UNKNOWN attempt is not a retry yet"
    );
    let open = outbox_ledger::attempts::open_unknown(&c, "s")
        .await
        .unwrap();
    outbox_ledger::attempts::resolve(&c, open[0].id, None, 0, 10)
        .await
        .unwrap();
    assert_eq!(
        outbox_ledger::attempts::retry_generations(&c, "s")
            .await
            .unwrap(),
        vec![(id, 2)],
        "proven absent: the next send is attempt 2, whichever process sends it"
    );
    let ev = event(&c, id).await;
    accept::accept_batch(
        &mut c,
        "s",
        &[LedgerItem::Receipt(receipt(&ev, 0))],
        None,
        None,
    )
    .await
    .unwrap();
    assert!(
        outbox_ledger::attempts::retry_generations(&c, "s")
            .await
            .unwrap()
            .is_empty(),
        "published: nothing to retry"
    );
}

/// An event enqueued in a transaction left open on a connection of its own (returned, so the
/// caller commits or rolls back): its row exists for that connection only.
async fn uncommitted_event(url: &str) -> (Client, OutboxEvent) {
    let (w, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    w.batch_execute("BEGIN").await.unwrap();
    let id = enqueue(
        &w,
        "order",
        "o-1",
        "x",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let ev = event(&w, id).await;
    (w, ev)
}

/// Accepts one receipt of `ev` and asserts that it became the primary receipt.
async fn accept_as_primary(c: &mut Client, ev: &OutboxEvent) {
    let out = accept::accept_batch(c, "s", &[LedgerItem::Receipt(receipt(ev, 7))], None, None)
        .await
        .unwrap();
    assert_eq!((out.primary, out.conflicts), (1, 0), "{out:?}");
}

/// PostgreSQL writes a commit to WAL before the transaction is visible to other snapshots, so
/// the relay can hold a broker ACK for an event whose row its ledger connection cannot see yet
/// (an open transaction stands in for that window here). The acceptance does not read the
/// row: the receipt is the primary at once, while the writer's transaction is still open.
#[tokio::test]
async fn a_receipt_is_accepted_while_its_row_is_not_visible_yet() {
    let (mut c, url) = fresh("ledger_visibility").await;
    let (w, ev) = uncommitted_event(&url).await;
    accept_as_primary(&mut c, &ev).await;
    let visible = count(
        &c,
        &format!(
            "SELECT count(*) FROM outbox.events WHERE event_id = '{}'",
            ev.event_id
        ),
    )
    .await;
    assert_eq!(
        visible, 0,
        "the row was not visible to the ledger when it accepted"
    );
    assert_eq!(count(&c, "SELECT count(*) FROM outbox.quarantine").await, 0);
    w.batch_execute("COMMIT").await.unwrap();
    assert!(audit::ledger_conflicts(&c).await.unwrap().is_empty());
}

/// A receipt whose event id has no row and no purged tombstone (its transaction rolled back:
/// only a relay bug could send it) is accepted, since the acceptance reads no row, and the
/// audit names it once it is older than a row can take to become visible.
#[tokio::test]
async fn a_receipt_whose_row_never_appears_is_named_by_the_audit() {
    let (mut c, url) = fresh("ledger_invisible").await;
    let (w, ev) = uncommitted_event(&url).await;
    let id = ev.event_id;
    w.batch_execute("ROLLBACK").await.unwrap();
    accept_as_primary(&mut c, &ev).await;
    let orphans = |found: Vec<audit::LedgerConflict>| {
        found
            .into_iter()
            .filter(|f| f.detail.contains("no outbox row"))
            .map(|f| f.event_id)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        orphans(audit::ledger_conflicts(&c).await.unwrap()),
        vec![],
        "a fresh receipt may name a row that is not visible yet"
    );
    c.execute(
        "UPDATE outbox.receipts SET accepted_at = accepted_at - interval '1 minute'
         WHERE event_id = $1",
        &[&id],
    )
    .await
    .unwrap();
    assert_eq!(
        orphans(audit::ledger_conflicts(&c).await.unwrap()),
        vec![Some(id)]
    );
}

/// The heads of `order` aggregates `ids`, by id.
async fn heads_named(c: &Client, ids: &[&str]) -> Vec<(String, i64)> {
    let keys: Vec<_> = ids
        .iter()
        .map(|i| ("order".to_string(), i.to_string()))
        .collect();
    let mut h: Vec<(String, i64)> = outbox_ledger::holds::heads_of(c, &keys, None)
        .await
        .unwrap()
        .into_iter()
        .map(|((_, a), v)| (a, v))
        .collect();
    h.sort();
    h
}

/// Heads are read from the ledger's facts (migration 0026): an acceptance journals and upserts
/// nothing; a head is the highest version with a primary receipt (a replay's duplicate moves
/// nothing), or higher where an operator moved it, and a purge keeps it; what a relay before
/// 0026 journaled is folded once and counted. For the stream, below the version met first, it
/// is the highest version that exists (migration 0028).
#[tokio::test]
async fn heads_are_read_from_receipts_operator_moves_purges_and_old_journals() {
    use outbox_ledger::holds;
    let (mut c, _) = fresh("ledger_heads").await;
    checkpoint::create(&c, "s1", "outbox_pub", "sys", 1, Lsn(50))
        .await
        .unwrap();
    let mut evs = Vec::new();
    for (agg, n) in [("h-1", 3), ("h-2", 1)] {
        for _ in 0..n {
            let id = enqueue(
                &c,
                "order",
                agg,
                "order.created",
                &json!({"x": 1}),
                &EnqueueOptions::default(),
            )
            .await
            .unwrap();
            evs.push(event(&c, id).await);
        }
    }
    let key = |id: &str| ("order".to_string(), id.to_string());
    // h-1 v1, v2 and h-2 v1 accepted; h-1 v3 not yet.
    let items: Vec<LedgerItem> = [0, 1, 3]
        .iter()
        .map(|&i| LedgerItem::Receipt(receipt(&evs[i], 10 + i as i64)))
        .collect();
    accept::accept_batch(&mut c, "s1", &items, Some(Lsn(200)), None)
        .await
        .unwrap();
    assert_eq!(
        count(&c, "SELECT count(*) FROM outbox.head_journal").await
            + count(&c, "SELECT count(*) FROM outbox.aggregate_heads").await,
        0,
        "an acceptance journals and upserts no head"
    );
    assert_eq!(
        heads_named(&c, &["h-1", "h-2", "h-9"]).await,
        vec![("h-1".into(), 2), ("h-2".into(), 1), ("h-9".into(), 0)],
        "the highest version with a receipt; 0 for an aggregate without one"
    );
    // For the stream (migration 0028), below the version met first: the highest version that
    // exists, receipt or not (every version below the one met is resolved by then).
    assert_eq!(
        holds::heads_of(&c, &[key("h-1"), key("h-9")], Some(&[4, 5]))
            .await
            .unwrap(),
        vec![(key("h-1"), 3), (key("h-9"), 0)],
        "h-1 v3 exists below v4, without a receipt; h-9 has no row"
    );
    // A replay's duplicate of v1 moves nothing; v3's receipt does.
    accept::accept_batch(
        &mut c,
        "s1",
        &[LedgerItem::Receipt(receipt(&evs[0], 999))],
        None,
        None,
    )
    .await
    .unwrap();
    assert_eq!(holds::head(&c, &key("h-1")).await.unwrap(), 2);
    accept::accept_batch(
        &mut c,
        "s1",
        &[LedgerItem::Receipt(receipt(&evs[2], 12))],
        Some(Lsn(300)),
        None,
    )
    .await
    .unwrap();
    assert_eq!(holds::head(&c, &key("h-1")).await.unwrap(), 3);
    // An operator's skip moved h-2 past a version never published.
    c.execute(
        "INSERT INTO outbox.aggregate_heads (aggregate_type, aggregate_id, last_version)
         VALUES ('order', 'h-2', 7)",
        &[],
    )
    .await
    .unwrap();
    // A relay before migration 0026 journaled h-2 v1 and h-3 v4: folded once, counted, and a
    // lower journaled version does not move h-2 back.
    c.execute(
        "INSERT INTO outbox.head_journal (slot_name, aggregate_types, aggregate_ids, versions)
         VALUES ('s1', ARRAY['order','order'], ARRAY['h-2','h-3'], ARRAY[1,4]::int8[])",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(holds::fold_heads(&c, false).await.unwrap(), 1);
    let expected = vec![("h-1".into(), 3), ("h-2".into(), 7), ("h-3".into(), 4)];
    assert_eq!(heads_named(&c, &["h-1", "h-2", "h-3"]).await, expected);
    // Bounded by the version the stream met first: receipts below it count, an operator's
    // move counts whatever its version.
    let bounded = holds::heads_of(&c, &[key("h-1"), key("h-2")], Some(&[2, 1]))
        .await
        .unwrap();
    assert_eq!(bounded, vec![(key("h-1"), 1), (key("h-2"), 7)]);
    // A purge deletes h-1's events and receipts; its head stays.
    let purged = outbox_ledger::retention::purge(
        &c,
        &outbox_ledger::retention::PurgeSettings {
            replay_window: std::time::Duration::ZERO,
            inbox_retention: std::time::Duration::ZERO,
            batch_size: 100,
            max_batches: None,
            dry_run: false,
        },
    )
    .await
    .unwrap();
    assert_eq!(purged.events, 4, "every published event purged: {purged:?}");
    assert_eq!(
        holds::heads_of(&c, &[key("h-1")], Some(&[4]))
            .await
            .unwrap(),
        vec![(key("h-1"), 3)],
        "for the stream, a purged version below the one met counts"
    );
    assert_eq!(
        count(
            &c,
            "SELECT count(*) FROM outbox.events WHERE aggregate_id = 'h-1'"
        )
        .await,
        0
    );
    assert_eq!(heads_named(&c, &["h-1", "h-2", "h-3"]).await, expected);
}

/// The relay of one shard releases only the holds of its own aggregates.
#[tokio::test]
async fn a_shard_relay_sees_only_its_shards_releases() {
    use outbox_ledger::holds;
    let (c, _) = fresh("ledger_shard_releases").await;
    for agg in ["a", "b", "c", "d", "e", "f"] {
        c.execute(
            "INSERT INTO outbox.holds (aggregate_type, aggregate_id, state, reason_code, reason)
             VALUES ('order', $1, 'RELEASING', 'test', 'test')",
            &[&agg],
        )
        .await
        .unwrap();
    }
    let all = holds::releasing(&c, None).await.unwrap();
    assert_eq!(all.len(), 6);
    let mut seen = 0;
    for i in 0..2 {
        let filter = format!("(get_byte(decode(md5(aggregate_id), 'hex'), 0) % 2 = {i})");
        let mine = holds::releasing(&c, Some(&filter)).await.unwrap();
        for r in &mine {
            let key: i32 = c
                .query_one("SELECT get_byte(decode(md5($1), 'hex'), 0)", &[&r.key.1])
                .await
                .unwrap()
                .get(0);
            assert_eq!(key % 2, i, "{} released by shard {i}", r.key.1);
        }
        seen += mine.len();
    }
    assert_eq!(seen, 6, "every hold is some shard's");
}

/// Migration 0023 made `outbox.enqueue` cheaper without changing what it writes: the same row
/// (every column but the insert time and transaction id), the same digests, the same refusals
/// with the same SQLSTATE and message. Since migration 0027 the row stores no digests: the
/// event the relay reads from it (digests computed) is the one it read from 0022's row. Migration 0022's function runs beside it, taken from the
/// migration's own text, over routes of every kind and values that are kept, encoded or refused.
#[tokio::test]
async fn the_cheaper_enqueue_of_migration_0023_writes_what_0022s_wrote() {
    let (mut c, _) = fresh("ledger_enqueue_0023").await;
    let m22 = include_str!("../../../migrations/0022_destination_encoding.sql");
    let start = m22
        .find("CREATE OR REPLACE FUNCTION outbox.enqueue(")
        .expect("migration 0022 defines outbox.enqueue");
    let len = m22[start..]
        .find("\n$$;")
        .expect("outbox.enqueue of migration 0022 ends with $$;");
    let before = m22[start..start + len + 4].replacen("outbox.enqueue(", "before0023.enqueue(", 1);
    c.batch_execute(&format!("CREATE SCHEMA before0023; {before}"))
        .await
        .unwrap();
    for route in [
        "SELECT outbox.set_route('invoice', NULL, 'billing.{aggregate_type}s')",
        "SELECT outbox.set_route('invoice', 'invoice.voided', 'billing.voided', 'west')",
        "SELECT outbox.set_route(NULL, 'audit.note', 'audit.{aggregate_type}.{aggregate_id}')",
        "SELECT outbox.set_nats_route('order', NULL, 'nats-a')",
        "SELECT outbox.set_http_route('hook', NULL, 'hooks', 'https://example.test/in/{aggregate_type}/{aggregate_id}?x=1')",
        "UPDATE outbox.route_policy SET priority = 5 WHERE topic = 'billing.voided'",
    ] {
        c.batch_execute(route).await.unwrap();
    }
    let long = "t".repeat(236);
    let too_long = "t".repeat(237);
    // aggregate type, aggregate id, event type, payload, tenant, headers, payload schema
    type Case<'a> = (
        &'a str,
        &'a str,
        &'a str,
        &'a str,
        Option<&'a str>,
        Option<&'a str>,
        Option<&'a str>,
    );
    let cases: Vec<Case> = vec![
        (
            "customer",
            "c-1",
            "customer.created",
            r#"{"a": 1}"#,
            None,
            None,
            None,
        ),
        (
            "customer",
            "c/1 ü",
            "x",
            r#"{"b": [1, "two"], "a": null}"#,
            Some("t1"),
            Some(r#"{"h": "v"}"#),
            Some("s.v1"),
        ),
        (long.as_str(), "c-1", "x", "{}", None, None, None),
        (too_long.as_str(), "c-1", "x", "{}", None, None, None),
        ("bad type!", "c-1", "x", "{}", None, None, None),
        ("a.b_c-D9", "c-1", "x", "{}", None, None, None),
        ("invoice", "i-1", "invoice.issued", "{}", None, None, None),
        ("invoice", "i-1", "invoice.voided", "{}", None, None, None),
        ("ledger", "l 1", "audit.note", "{}", None, None, None),
        ("ledger", "l.1", "audit.note", "{}", None, None, None),
        ("order", "o-42", "order.created", "{}", None, None, None),
        ("order", "o.42", "order.created", "{}", None, None, None),
        ("order", "o*", "order.created", "{}", None, None, None),
        ("hook", "../../admin", "hook.fired", "{}", None, None, None),
        ("hook", "..", "hook.fired", "{}", None, None, None),
        ("hook", "a?b#c%d", "hook.fired", "{}", None, None, None),
        ("", "c-1", "x", "{}", None, None, None),
        ("customer", "", "x", "{}", None, None, None),
        ("customer", "c-1", "", "{}", None, None, None),
        ("customer", "c-1", "x", "{}", None, Some("[1]"), None),
    ];
    let (mut kept, mut refused) = (0, 0);
    for (i, (at, ai, et, payload, tenant, headers, schema)) in cases.iter().enumerate() {
        let id = uuid::Uuid::from_u128(0x0123_0000 + i as u128);
        let mut outcomes = Vec::new();
        for function in ["before0023.enqueue", "outbox.enqueue"] {
            let tx = c.transaction().await.unwrap();
            let call = tx
                .query_one(
                    &format!(
                        "SELECT {function}($1, $2, $3, $4::text::jsonb, $5, $6::text::jsonb, $7, $8)"
                    ),
                    &[at, ai, et, payload, tenant, headers, schema, &id],
                )
                .await;
            let outcome = match call {
                Ok(_) => {
                    kept += 1;
                    // The event as the relay reads it: since migration 0027 the row stores no
                    // digests and the relay computes them, and they must be the ones 0022's
                    // function stored. Every column but the insert time and transaction id.
                    let mut event = event(&tx, id).await;
                    event.verify().unwrap();
                    event.occurred_at.clear();
                    event.created_xid = None;
                    // Whether the row stored its destination whole (0022) or as a route
                    // version (0031's narrow row) is how it was kept, not what is published.
                    event.route_version = None;
                    format!("event {event:?}")
                }
                Err(e) => {
                    let db = e.as_db_error().expect("a refusal is a database error");
                    refused += 1;
                    format!("refused {} {}", db.code().code(), db.message())
                }
            };
            tx.rollback().await.unwrap();
            outcomes.push(outcome);
        }
        assert_eq!(
            outcomes[0], outcomes[1],
            "case {i} ({at:?}, {ai:?}, {et:?}): migration 0022's enqueue (left) and 0023's (right) differ"
        );
    }
    // Both functions ran every case; the matrix meets rows kept and refusals, or it proves
    // less than it says.
    assert_eq!(kept + refused, 2 * cases.len());
    assert!(
        kept >= 2 * 10 && refused >= 2 * 6,
        "{kept} rows, {refused} refusals"
    );
}

/// Migration 0030 on a live database: receipts accepted before it read back unchanged through
/// the view (every column, the digests' text included), grants on the old table carry over to
/// the view and its tables, and a receipt accepted after it stores its digests as
/// `outbox_core::envelope::digest_bytes` says and reads them back as sent.
#[tokio::test]
async fn receipts_move_to_entries_and_read_back_unchanged() {
    let (mut c, _) = bare("ledger_entries").await;
    // The database as migration 0029 left it.
    assert_eq!(
        migrate::run_through(&mut c, 29).await.unwrap(),
        (1..=29).collect::<Vec<i32>>()
    );
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            enqueue(
                &c,
                "order",
                &format!("o-{i}"),
                "x",
                &json!({"i": i}),
                &EnqueueOptions::default(),
            )
            .await
            .unwrap(),
        );
    }
    // Old receipts: a sha256 digest, text that is not one (31 bytes: the padded case), a
    // retained one with evidence, another topic and kind, no broker time, no commit LSN.
    c.execute(
        "INSERT INTO outbox.receipts (event_id, broker_kind, broker_cluster, topic, partition,
             \"offset\", broker_timestamp, attempt, relay_generation, commit_lsn, slot_name,
             payload_digest, destination_digest, retained_at, evidence)
         SELECT id, CASE WHEN n = 3 THEN 'http' ELSE 'kafka' END, 'default',
                CASE WHEN n = 3 THEN 'hooks' ELSE 'orders' END, n::int, 10 * n,
                CASE WHEN n = 1 THEN NULL ELSE now() END, n::int, 7, CASE WHEN n = 2 THEN NULL ELSE '0/AB' END::pg_lsn,
                's' || n, 'sha256:' || encode(sha256(id::text::bytea), 'hex'),
                CASE WHEN n = 2 THEN repeat('d', 31) ELSE 'not-a-digest' END,
                CASE WHEN n = 3 THEN now() END, CASE WHEN n = 3 THEN '{\"status\": 200}'::jsonb END
         FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, n)",
        &[&ids],
    )
    .await
    .unwrap();
    c.batch_execute(
        "DO $$ BEGIN
             IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'ledger_entries_reader') THEN
                 CREATE ROLE ledger_entries_reader;
             END IF;
         END $$;
         GRANT SELECT ON outbox.receipts, outbox.event_status TO ledger_entries_reader",
    )
    .await
    .unwrap();
    let all = "SELECT event_id, broker_kind, broker_cluster, topic, partition, \"offset\",
                      broker_timestamp, attempt, relay_generation, commit_lsn, slot_name,
                      payload_digest, destination_digest, accepted_at, retained_at,
                      accepted_xact, evidence
               FROM outbox.receipts ORDER BY event_id";
    let before = c
        .query_one(&format!("SELECT json_agg(r)::text FROM ({all}) r"), &[])
        .await
        .unwrap()
        .get::<_, String>(0);
    assert_eq!(migrate::run_through(&mut c, 30).await.unwrap(), vec![30]);
    let after = c
        .query_one(&format!("SELECT json_agg(r)::text FROM ({all}) r"), &[])
        .await
        .unwrap()
        .get::<_, String>(0);
    assert_eq!(
        after, before,
        "receipts read back unchanged through the view"
    );
    let grants = c
        .query_one(
            "SELECT has_table_privilege('ledger_entries_reader', 'outbox.receipts', 'SELECT'),
                    has_table_privilege('ledger_entries_reader', 'outbox.receipt_entries', 'SELECT'),
                    has_table_privilege('ledger_entries_reader', 'outbox.event_status', 'SELECT'),
                    has_table_privilege('ledger_entries_reader', 'outbox.receipt_entries', 'INSERT')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (0..4).map(|i| grants.get::<_, bool>(i)).collect::<Vec<_>>(),
        vec![true, true, true, false]
    );
    // Rust's encoding is SQL's, and the text comes back.
    let texts = [
        outbox_core::envelope::sha256_digest(b"q"),
        "weird".to_string(),
        String::new(),
        "e".repeat(31),
        "f".repeat(32),
        "sha256:ABC".to_string(),
    ];
    for t in &texts {
        let row = c
            .query_one(
                "SELECT outbox.digest_bytes($1) = $2, outbox.digest_text($2)",
                &[t, &outbox_core::envelope::digest_bytes(t)],
            )
            .await
            .unwrap();
        assert!(row.get::<_, bool>(0), "{t:?}");
        assert_eq!(&row.get::<_, String>(1), t);
    }
    // The rest of the migrations, as an upgrade runs them: 0034 takes each slot's accepted
    // position from its newest receipt's commit LSN, and lets whoever may update the
    // checkpoints (a relay's role) write the new table.
    c.batch_execute(
        "DO $$ BEGIN
             IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'ledger_checkpoint_writer') THEN
                 CREATE ROLE ledger_checkpoint_writer;
             END IF;
         END $$;
         GRANT SELECT, UPDATE ON outbox.checkpoints TO ledger_checkpoint_writer",
    )
    .await
    .unwrap();
    migrate::run(&mut c).await.unwrap();
    let writes: bool = c
        .query_one(
            "SELECT has_table_privilege('ledger_checkpoint_writer', 'outbox.accepted_positions',
                                        'INSERT')
                AND has_table_privilege('ledger_checkpoint_writer', 'outbox.accepted_positions',
                                        'UPDATE')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        writes,
        "the checkpoints' writer may write outbox.accepted_positions"
    );
    let upgraded: Vec<(String, i64, String, String)> = c
        .query(
            "SELECT slot_name, relay_generation, commit_lsn::text, change_lsn::text
             FROM outbox.accepted_positions ORDER BY slot_name",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    // s1's and s3's newest receipts have commit LSN 0/AB; s2's has none.
    let row = |s: &str| {
        (
            s.to_string(),
            -1,
            "0/AB".to_string(),
            "FFFFFFFF/FFFFFFFF".to_string(),
        )
    };
    assert_eq!(upgraded, vec![row("s1"), row("s3")]);
    let id = enqueue(
        &c,
        "order",
        "o-new",
        "x",
        &json!({}),
        &EnqueueOptions::default(),
    )
    .await
    .unwrap();
    let ev = event(&c, id).await;
    let r = ReceiptRecord {
        destination_digest: "e".repeat(31),
        ..receipt(&ev, 4)
    };
    let out = accept::accept_batch(&mut c, "s", &[LedgerItem::Receipt(r.clone())], None, None)
        .await
        .unwrap();
    assert_eq!(out.primary, 1, "{out:?}");
    let row = c
        .query_one(
            "SELECT payload_digest, destination_digest, broker_kind, topic, commit_lsn::text,
                    (SELECT count(*) FROM outbox.receipt_destinations)
             FROM outbox.receipts WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), r.payload_digest);
    assert_eq!(row.get::<_, String>(1), r.destination_digest);
    assert_eq!(row.get::<_, String>(2), "kafka");
    assert_eq!(row.get::<_, String>(3), r.topic);
    assert_eq!(row.get::<_, String>(4), "0/64");
    // orders and hooks from the old receipts, the new event's topic.
    assert_eq!(row.get::<_, i64>(5), 3);
}

/// The purge statement is `outbox_core::receipt::PurgeRule::default()` in SQL (the rule the
/// simulator's `purge-early` mutant bends): one event per combination of the rule's facts
/// (published, replayable from the slot, an UNKNOWN attempt open, past the replay window,
/// consumed by the mandatory consumer), one purge, and each event is gone exactly when the rule
/// says it may go.
#[tokio::test]
async fn purge_deletes_what_the_rule_says() {
    use outbox_core::receipt::{PurgeFacts, PurgeRule};
    use outbox_ledger::retention::{purge, PurgeSettings};
    use std::time::Duration;

    let (mut c, _) = fresh("ledger_purge_rule").await;
    c.batch_execute(
        "INSERT INTO outbox.checkpoints (slot_name, publication, confirmed_lsn)
         VALUES ('s', 'outbox_pub', '0/1000');
         SELECT outbox.register_consumer('billing', true)",
    )
    .await
    .unwrap();
    let hour = 3_600_000u64;
    let mut cases = Vec::new();
    for i in 0..32u32 {
        let bit = |b: u32| i & (1 << b) != 0;
        let (published, replayable, unknown, past_window, consumed) =
            (bit(0), bit(1), bit(2), bit(3), bit(4));
        let id = enqueue(
            &c,
            "payment",
            &format!("p-{i}"),
            "x",
            &json!({}),
            &EnqueueOptions::default(),
        )
        .await
        .unwrap();
        let ev = event(&c, id).await;
        // Each event on its own partition, at offset 0: the consumer's watermark per event.
        let partition = i as i32;
        if published {
            let r = ReceiptRecord {
                partition,
                commit_lsn: Some(if replayable { Lsn(0x2000) } else { Lsn(0x10) }),
                change_lsn: None,
                ..receipt(&ev, 0)
            };
            accept::accept_batch(&mut c, "s", &[LedgerItem::Receipt(r)], None, None)
                .await
                .unwrap();
            if past_window {
                c.execute(
                    "UPDATE outbox.receipts SET accepted_at = accepted_at - interval '2 hours'
                     WHERE event_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            }
        }
        if unknown {
            c.execute(
                "INSERT INTO outbox.attempts (event_id, relay_generation, attempt_generation,
                                              slot_name, topic, partition, sent_at, error)
                 VALUES ($1, 0, 1, 's', $2, $3, now(), 'timed out')",
                &[&id, &ev.destination.topic, &partition],
            )
            .await
            .unwrap();
        }
        if consumed {
            c.execute(
                "INSERT INTO outbox.consumer_watermarks (consumer_id, topic, partition, next_offset)
                 VALUES ('billing', $1, $2, 1)",
                &[&ev.destination.topic, &partition],
            )
            .await
            .unwrap();
        }
        let facts = PurgeFacts {
            published,
            replayable,
            unknown_open: unknown,
            since_last_send_ms: if past_window { 2 * hour } else { 0 },
            replay_window_ms: hour,
            consumed_by_all: consumed,
        };
        cases.push((id, facts, PurgeRule::default().may_purge(facts)));
    }
    purge(
        &c,
        &PurgeSettings {
            replay_window: Duration::from_secs(3600),
            inbox_retention: Duration::from_secs(3600),
            batch_size: 7,
            max_batches: None,
            dry_run: false,
        },
    )
    .await
    .unwrap();
    let mut disagree = Vec::new();
    for (id, facts, verdict) in &cases {
        let gone = count(
            &c,
            &format!("SELECT count(*) FROM outbox.purged_events WHERE event_id = '{id}'"),
        )
        .await
            == 1
            && count(
                &c,
                &format!("SELECT count(*) FROM outbox.events WHERE event_id = '{id}'"),
            )
            .await
                == 0;
        if gone != verdict.is_ok() {
            disagree.push(format!("{facts:?}: rule {verdict:?}, purged {gone}"));
        }
    }
    assert!(
        disagree.is_empty(),
        "the purge statement and PurgeRule disagree on {} of 32:\n{}",
        disagree.len(),
        disagree.join("\n")
    );
    assert!(
        cases.iter().any(|(_, _, v)| v.is_ok()),
        "some event may go, or the test proves nothing"
    );
}

/// The relay renders a narrow row's destination with `outbox_core::route::render_destination`;
/// `outbox.events_frozen` (and so every operator query) with `outbox.render_destination`. They
/// must agree on every value enqueue accepts, and the Rust side must refuse whatever the SQL
/// side refuses (except white space beyond ASCII in a NATS token, which only the database's
/// locale may refuse; a NATS value is placed verbatim, so accepting it cannot move it).
#[tokio::test]
async fn route_versions_render_in_rust_as_in_sql() {
    let (c, _) = fresh("ledger_render_agree").await;
    let templates = [
        ("kafka", "outbox.event.{aggregate_type}"),
        ("kafka", "billing.{aggregate_type}s.{aggregate_id}"),
        ("kafka", "fixed"),
        ("nats", "outbox.{aggregate_type}.{aggregate_id}"),
        ("nats", "orders.>"),
        ("nats", "a.{aggregate_id}.b"),
        (
            "http",
            "https://h/pay/{aggregate_id}?t={aggregate_type}#{aggregate_id}",
        ),
        ("http", "https://{aggregate_id}.h/x"),
        ("http", "ftp-less"),
        (
            "http",
            "https://user@h:8080/{aggregate_type}/{aggregate_id}",
        ),
    ];
    let values = [
        "Order",
        "o-1",
        "../../admin",
        "%2e%2e",
        "x?token=steal#frag",
        "a.b",
        "*",
        ">",
        "",
        ".",
        "..",
        "a b",
        "tab\there",
        "\u{a0}nbsp",
        "Ordér",
        "{aggregate_id}",
        "~_-.",
        &"t".repeat(240),
    ];
    let (mut compared, mut refused) = (0, 0);
    for (kind, template) in templates {
        for agg_type in ["Order", "Ord er", "Ordér", &"t".repeat(240)] {
            for id in values {
                let sql = c
                    .query_one(
                        "SELECT outbox.render_destination($1, $2, $3, $4)",
                        &[&kind, &template, &agg_type, &id],
                    )
                    .await
                    .map(|r| r.get::<_, String>(0));
                let rust = outbox_core::route::render_destination(kind, template, agg_type, id);
                let case = format!("{kind} {template:?} type {agg_type:?} id {id:?}");
                match sql {
                    Ok(sql) => {
                        assert_eq!(rust.as_deref(), Ok(sql.as_str()), "{case}");
                        compared += 1;
                    }
                    Err(e) => {
                        let beyond_ascii = kind == "nats" && !id.is_ascii();
                        assert!(
                            rust.is_err() || beyond_ascii,
                            "{case}: SQL refuses ({e}), Rust renders {rust:?}"
                        );
                        refused += 1;
                    }
                }
            }
        }
    }
    assert!(
        compared > 100 && refused > 100,
        "{compared} rendered, {refused} refused"
    );
}

/// A relay that gives a row written by a plain INSERT its route (docs/versions_by_relay.md)
/// chooses it with `outbox_core::route::choose_route_version` over the policy generation in
/// force (migration 0038); `outbox.enqueue` chooses in SQL from `outbox.route_policy`. They
/// must pick the same version for every (aggregate type, event type) under every policy:
/// rules made, deactivated and outranked over several rounds (specific and catch-all rules,
/// priorities, ties broken by generation), each round compared on every pair, with the rules
/// read from the table and from the newest generation, which every changing statement wrote.
#[tokio::test]
async fn routes_are_chosen_in_rust_as_enqueue_chooses_them() {
    use outbox_core::route::{choose_route_version, policy_rules_from_json, PolicyRule};
    let (c, _) = fresh("ledger_route_choice_agree").await;
    let types = [None, Some("order"), Some("user")];
    let events = [None, Some("placed"), Some("paid")];
    // A fixed sequence of rules (an LCG: the same cases on every run), six per round.
    let mut state: u64 = 0x5eed;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let (mut compared, mut chosen) = (0, std::collections::BTreeSet::new());
    for round in 0..8 {
        for k in 0..6 {
            c.execute(
                "INSERT INTO outbox.route_policy (aggregate_type, event_type, priority, topic)
                 VALUES ($1, $2, $3, $4)",
                &[
                    &types[next(3) as usize],
                    &events[next(3) as usize],
                    &(next(3) as i32),
                    &format!("r{round}.{k}"),
                ],
            )
            .await
            .unwrap();
        }
        c.execute(
            "UPDATE outbox.route_policy SET active = false
             WHERE policy_id = (SELECT policy_id FROM outbox.route_policy WHERE active
                                ORDER BY md5(policy_id::text || $1) LIMIT 1)",
            &[&round.to_string()],
        )
        .await
        .unwrap();
        let rules: Vec<PolicyRule> = c
            .query(
                "SELECT aggregate_type, event_type, priority, generation, active, route_version
                 FROM outbox.route_policy",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| PolicyRule {
                aggregate_type: r.get(0),
                event_type: r.get(1),
                priority: r.get(2),
                generation: r.get(3),
                active: r.get(4),
                route_version: r.get(5),
            })
            .collect();
        let row = c
            .query_one(
                "SELECT count(*), (SELECT g.rules::text FROM outbox.policy_generations g
                                   ORDER BY g.generation_id DESC LIMIT 1)
                 FROM outbox.policy_generations",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(
            row.get::<_, i64>(0),
            1 + 7 * (i64::from(round) + 1),
            "one generation per statement that changed the policy, after the migration's own"
        );
        let generation = policy_rules_from_json(&row.get::<_, String>(1)).unwrap();
        for agg_type in ["order", "user", "cart"] {
            for event_type in ["placed", "paid", "shipped"] {
                let id = enqueue(
                    &c,
                    agg_type,
                    "a-1",
                    event_type,
                    &json!({}),
                    &EnqueueOptions::default(),
                )
                .await
                .unwrap();
                let sql: i64 = c
                    .query_one(
                        "SELECT route_version FROM outbox.events WHERE event_id = $1",
                        &[&id],
                    )
                    .await
                    .unwrap()
                    .get(0);
                let rust = choose_route_version(&rules, agg_type, event_type);
                assert_eq!(
                    rust, sql,
                    "round {round}, ({agg_type}, {event_type}) under {rules:#?}"
                );
                assert_eq!(
                    choose_route_version(&generation, agg_type, event_type),
                    sql,
                    "round {round}, ({agg_type}, {event_type}) under the newest generation \
                     {generation:#?}"
                );
                compared += 1;
                chosen.insert(sql);
            }
        }
    }
    assert_eq!(compared, 72);
    assert!(
        chosen.len() >= 10,
        "the rounds reach many routes ({chosen:?}), or the comparison proves little"
    );
}

/// A database migrated while events are in flight: rows enqueued before migration 0031 keep
/// their eight destination columns, rows enqueued after it name a route version, and both
/// read as the same destination (the same digest) for the same route; a route changed after
/// enqueue does not move a narrow row; versions and rows stay immutable.
#[tokio::test]
async fn narrow_rows_keep_the_destination_wide_rows_had() {
    let (mut c, _) = bare("ledger_narrow_upgrade").await;
    assert_eq!(
        migrate::run_through(&mut c, 30).await.unwrap(),
        (1..=30).collect::<Vec<i32>>()
    );
    c.batch_execute(
        "SELECT outbox.set_route('invoice', NULL, 'billing.{aggregate_type}s');
         SELECT outbox.set_http_route('payment', NULL, 'hooks', 'https://h/pay/{aggregate_id}');",
    )
    .await
    .unwrap();
    let kinds = [("invoice", "i/1"), ("payment", "../p 1"), ("order", "o-1")];
    let mut before = Vec::new();
    for (t, id) in kinds {
        before.push(
            enqueue(&c, t, id, "x", &json!({}), &EnqueueOptions::default())
                .await
                .unwrap(),
        );
    }
    assert_eq!(migrate::run_through(&mut c, 31).await.unwrap(), vec![31]);
    let mut after = Vec::new();
    for (t, id) in kinds {
        after.push(
            enqueue(&c, t, id, "x", &json!({}), &EnqueueOptions::default())
                .await
                .unwrap(),
        );
    }
    let narrow = |ids: &[uuid::Uuid]| {
        let ids = ids.to_vec();
        let c = &c;
        async move {
            c.query_one(
                "SELECT count(*) FILTER (WHERE route_version IS NOT NULL AND dest_kind IS NULL)
                 FROM outbox.events WHERE event_id = ANY ($1)",
                &[&ids],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };
    assert_eq!((narrow(&before).await, narrow(&after).await), (0, 3));
    // A route change after enqueue: the narrow rows keep the version they were frozen to.
    c.batch_execute(
        "SELECT outbox.set_route('invoice', NULL, 'billing.v2');
         SELECT outbox.set_http_route('payment', NULL, 'hooks', 'https://elsewhere/{aggregate_id}');",
    )
    .await
    .unwrap();
    for (old, new) in before.iter().zip(&after) {
        let (old, new) = (event(&c, *old).await, event(&c, *new).await);
        assert_eq!(old.destination, new.destination);
        assert_eq!(old.destination_digest, new.destination_digest);
        assert_eq!(new.verify(), Ok(()));
        // The SQL view renders what the relay renders.
        let row = c
            .query_one(
                "SELECT dest_topic, outbox.destination_digest_of(e) FROM outbox.events_current e
                 WHERE event_id = $1",
                &[&new.event_id],
            )
            .await
            .unwrap();
        assert_eq!(
            (row.get::<_, String>(0), row.get::<_, String>(1)),
            (
                new.destination.topic.clone(),
                new.destination_digest.clone()
            )
        );
    }
    assert_eq!(
        event(&c, after[1]).await.destination.topic,
        "https://h/pay/..%2Fp%201"
    );
    for refused in [
        "UPDATE outbox.route_versions SET topic_template = 'x'",
        "DELETE FROM outbox.route_versions",
        "TRUNCATE outbox.route_versions CASCADE",
        "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_version,
             event_type, payload, route_version)
         VALUES (gen_random_uuid(), 'order', 'o-9', 1, 'x', '{}', 424242)",
        "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_version,
             event_type, payload, route_version, dest_kind)
         VALUES (gen_random_uuid(), 'order', 'o-9', 1, 'x', '{}', 0, 'kafka')",
        "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_version,
             event_type, payload)
         VALUES (gen_random_uuid(), 'order', 'o-9', 1, 'x', '{}')",
    ] {
        let e = c.batch_execute(refused).await.unwrap_err();
        assert!(e.as_db_error().is_some(), "{refused}: {e}");
    }
}

/// `outbox.aggregate_versions` is unlogged (migration 0032): a crash of the server, a promoted
/// standby or a restored base backup leaves it empty. No version may be given twice after that:
/// every writer of versions resumes after what the rows and the purged events' tombstones hold,
/// and a row written around `outbox.enqueue` is judged against them.
#[tokio::test]
async fn versions_resume_after_the_rows_when_the_unlogged_version_table_is_emptied() {
    let (c, _) = fresh("ledger_versions_unlogged").await;
    let persistence: String = c
        .query_one(
            "SELECT relpersistence::text FROM pg_class
             WHERE oid = 'outbox.aggregate_versions'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(persistence, "u", "no WAL for the version rows");
    let opts = EnqueueOptions::default();
    let mut first = None;
    for _ in 0..3 {
        let id = enqueue(&c, "order", "o-1", "x", &json!({}), &opts)
            .await
            .unwrap();
        first.get_or_insert(id);
    }
    c.batch_execute(
        "SELECT outbox.enqueue_set('order', 'o-1', 'x', '{}', ARRAY['t1', 't2']);
         INSERT INTO outbox.purged_events (event_id, aggregate_type, aggregate_id,
             aggregate_version, payload_digest, destination_digest, topic, partition, \"offset\",
             occurred_at, accepted_at)
         VALUES (gen_random_uuid(), 'order', 'o-gone', 7, 'sha256:00', 'sha256:00', 't', 0, 0,
                 now(), now());",
    )
    .await
    .unwrap();
    let lose = "TRUNCATE outbox.aggregate_versions, outbox.aggregate_versions_intact";
    let version = |id: uuid::Uuid| {
        let c = &c;
        async move {
            c.query_one(
                "SELECT aggregate_version FROM outbox.events WHERE event_id = $1",
                &[&id],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };

    c.batch_execute(lose).await.unwrap();
    let id = enqueue(&c, "order", "o-1", "x", &json!({}), &opts)
        .await
        .unwrap();
    assert_eq!(version(id).await, 5, "after the delivery set's shared 4");
    c.batch_execute(lose).await.unwrap();
    let set: uuid::Uuid = c
        .query_one(
            "SELECT outbox.enqueue_set('order', 'o-1', 'x', '{}', ARRAY['t1'])",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let set_version: i64 = c
        .query_one(
            "SELECT aggregate_version FROM outbox.events WHERE delivery_set_id = $1",
            &[&set],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(set_version, 6);
    c.batch_execute(lose).await.unwrap();
    let id = enqueue(&c, "order", "o-gone", "x", &json!({}), &opts)
        .await
        .unwrap();
    assert_eq!(version(id).await, 8, "after the purged event's tombstone");

    // A row written around outbox.enqueue: the next version is no gap, a used one is refused.
    c.batch_execute(lose).await.unwrap();
    with_stored_digests(&c, first.unwrap(), 7).await;
    assert_eq!(
        c.query_one("SELECT count(*) FROM outbox.holds", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        0,
        "version 7 follows 6: no gap"
    );
    // A purged version is only in its tombstone (the rows' unique key no longer sees it).
    c.batch_execute(lose).await.unwrap();
    let reused = c
        .batch_execute(
            "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_version,
                 event_type, payload, route_version)
             VALUES (gen_random_uuid(), 'order', 'o-gone', 6, 'x', '{}', 0)",
        )
        .await
        .unwrap_err();
    let why = reused.as_db_error().map(|e| e.message().to_string());
    assert!(
        why.as_deref()
            .is_some_and(|m| m.contains("reuses version 6")),
        "{reused:?}"
    );

    // What a poll relay runs at start: every aggregate's row back, from the rows.
    c.batch_execute(lose).await.unwrap();
    assert_eq!(
        outbox_ledger::producer::restore_aggregate_versions(&c)
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        outbox_ledger::producer::restore_aggregate_versions(&c)
            .await
            .unwrap(),
        0,
        "marked intact again: nothing to restore"
    );
    let rows: Vec<(String, i64)> = c
        .query(
            "SELECT aggregate_id, last_version FROM outbox.aggregate_versions ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, vec![("o-1".into(), 7), ("o-gone".into(), 8)]);
    let id = enqueue(&c, "order", "o-new", "x", &json!({}), &opts)
        .await
        .unwrap();
    assert_eq!(version(id).await, 1, "intact: a new aggregate starts at 1");
}

/// Exactly-once mode (docs/exactly_once.md): an acceptance of a batch the broker committed
/// keeps the batch's transaction record on the slot's checkpoint row, in the transaction that
/// takes its receipts in, so a restart reads only the batches committed after it. Raised,
/// never lowered; kept with the receipts when the lease was lost (the broker holds the batch);
/// not kept when the acceptance fails (nor are the receipts); refused for a slot without a
/// checkpoint row, naming it.
#[tokio::test]
async fn an_accepted_batch_keeps_its_transaction_record_with_its_receipts() {
    use outbox_core::delivery::RecordPosition;
    use outbox_ledger::lease::Fence;
    let (mut c, _) = fresh("ledger_txn_records").await;
    checkpoint::create(&c, "s", "outbox_pub", "sys", 1, Lsn(10))
        .await
        .unwrap();
    let events = enqueue_orders(&c, 5).await;
    let at = |offset| RecordPosition {
        partition: 0,
        offset,
    };
    let mut prepared = accept::Prepared::default();
    assert_eq!(checkpoint::last_txn_record(&c, "s").await.unwrap(), None);

    let mut kept = Vec::new();
    for (ev, offset) in [(&events[0], 41), (&events[1], 57), (&events[2], 50)] {
        accept::accept_committed_batch(
            &mut c,
            &mut prepared,
            "s",
            &[LedgerItem::Receipt(receipt(ev, 1))],
            Some(Lsn(20)),
            None,
            Some(at(offset)),
        )
        .await
        .unwrap();
        kept.push(checkpoint::last_txn_record(&c, "s").await.unwrap());
    }
    assert_eq!(
        kept,
        [Some(at(41)), Some(at(57)), Some(at(57))],
        "raised with each batch, never lowered"
    );

    async fn has_receipt(c: &Client, ev: &OutboxEvent) -> bool {
        c.query_one(
            "SELECT count(*) FROM outbox.receipts WHERE event_id = $1",
            &[&ev.event_id],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
            == 1
    }
    // A receipt the database refuses (no broker position) fails the whole acceptance.
    let refused = ReceiptRecord {
        partition: -1,
        ..receipt(&events[3], 2)
    };
    accept::accept_committed_batch(
        &mut c,
        &mut prepared,
        "s",
        &[LedgerItem::Receipt(refused)],
        Some(Lsn(30)),
        None,
        Some(at(99)),
    )
    .await
    .unwrap_err();
    assert_eq!(
        (
            checkpoint::last_txn_record(&c, "s").await.unwrap(),
            has_receipt(&c, &events[3]).await
        ),
        (Some(at(57)), false),
        "a failed acceptance keeps neither its receipts nor its record"
    );

    // Fenced off (no lease of this generation): the checkpoint stays, receipts and record
    // are kept.
    let stale = Fence {
        owner: "gone".into(),
        generation: 999,
    };
    let err = accept::accept_committed_batch(
        &mut c,
        &mut prepared,
        "s",
        &[LedgerItem::Receipt(receipt(&events[4], 3))],
        Some(Lsn(40)),
        Some(&stale),
        Some(at(70)),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, outbox_ledger::LedgerError::LeaseLost { .. }),
        "{err}"
    );
    let confirmed = checkpoint::load(&c, "s")
        .await
        .unwrap()
        .unwrap()
        .confirmed_lsn;
    assert_eq!(
        (
            checkpoint::last_txn_record(&c, "s").await.unwrap(),
            has_receipt(&c, &events[4]).await,
            confirmed
        ),
        (Some(at(70)), true, Lsn(20)),
        "a fenced acceptance keeps its receipts and its record, not the checkpoint"
    );

    let err = accept::accept_committed_batch(
        &mut c,
        &mut prepared,
        "no-such-slot",
        &[LedgerItem::Receipt(receipt(&events[4], 4))],
        None,
        None,
        Some(at(1)),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("no-such-slot"), "{err}");
}

/// PostgreSQL lets every role EXECUTE a new function and checks EXECUTE on a trigger function
/// only when a trigger is created: a SECURITY DEFINER or trigger function of schema outbox
/// left open to PUBLIC can be put on a role's own table to write as the owner (migration
/// 0021). Every such function, in every migration since, is closed to a role granted nothing;
/// and the policy generations they write cannot be changed afterwards.
#[tokio::test]
async fn definer_and_trigger_functions_are_closed_to_public() {
    let (c, _) = fresh("ledger_definer_closed").await;
    c.batch_execute(
        "DO $$ BEGIN
             IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'ledger_probe_nobody') THEN
                 CREATE ROLE ledger_probe_nobody;
             END IF;
         END $$",
    )
    .await
    .unwrap();
    let rows = c
        .query(
            "SELECT p.oid::regprocedure::text, p.prosecdef,
                    has_function_privilege('ledger_probe_nobody', p.oid, 'EXECUTE')
             FROM pg_proc p
             WHERE p.pronamespace = 'outbox'::regnamespace
               AND (p.prosecdef OR p.prorettype = 'trigger'::regtype)",
            &[],
        )
        .await
        .unwrap();
    let open: Vec<String> = rows
        .iter()
        .filter(|r| r.get::<_, bool>(2))
        .map(|r| r.get(0))
        .collect();
    assert!(
        rows.iter().any(|r| r.get::<_, bool>(1)) && rows.len() >= 5,
        "the functions were found ({} of them)",
        rows.len()
    );
    assert_eq!(open, Vec::<String>::new(), "open to PUBLIC");

    let err = c
        .execute("UPDATE outbox.policy_generations SET rules = '[]'", &[])
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE),
        "{err}"
    );
}

/// Versions by the relay (migrations 0039 and 0040, docs/versions_by_relay.md): the acceptance
/// that moves a slot's checkpoint logs the numbering up to it, and keeps the policy generation
/// in force there, in the same transaction. A run reads the map the log is folded into (at its
/// start, which a checkpoint past its planned start refuses, or by an acceptance that asks),
/// per aggregate in the order asked (0 for one never numbered), per slot; raised, never
/// lowered; neither kept when the acceptance fails, nor when the run was fenced off (its
/// receipts are, as always).
/// The newest route policy generation.
async fn newest_generation(c: &Client) -> i64 {
    c.query_one(
        "SELECT max(generation_id) FROM outbox.policy_generations",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// A new slot's checkpoint row holds the route policy generation in force at its start, so a
/// run that stops before its first checkpoint moves does not leave the next run to route the
/// rows it reads again by a generation committed after them (the newest); recreating the
/// slot starts it again at the generation in force then.
#[tokio::test]
async fn a_new_slots_checkpoint_keeps_the_policy_generation_in_force_at_its_start() {
    let (c, _) = fresh("ledger_policy_at_start").await;
    c.execute(
        "SELECT outbox.set_route('invoice', NULL, 'billing.v1')",
        &[],
    )
    .await
    .unwrap();
    let at_start = newest_generation(&c).await;
    checkpoint::create(&c, "s", "outbox_pub", "sys", 1, Lsn(0x10))
        .await
        .unwrap();
    c.execute(
        "SELECT outbox.set_route('invoice', NULL, 'billing.v2')",
        &[],
    )
    .await
    .unwrap();
    let kept = outbox_ledger::numbering::policy_generation(&c, "s")
        .await
        .unwrap();
    assert_eq!(
        kept,
        Some(at_start),
        "the generation in force at the slot's start"
    );
    let now = newest_generation(&c).await;
    assert!(now > at_start);
    checkpoint::create(&c, "s", "outbox_pub", "sys", 1, Lsn(0x20))
        .await
        .unwrap();
    let kept = outbox_ledger::numbering::policy_generation(&c, "s")
        .await
        .unwrap();
    assert_eq!(kept, Some(now), "a recreated slot starts at the newest");
}

#[tokio::test]
async fn a_moved_checkpoint_keeps_the_numbering_up_to_it() {
    use outbox_ledger::lease::Fence;
    use outbox_ledger::numbering::{fold_at_start, policy_generation, versions_of, Numbered};
    let (mut c, _) = fresh("ledger_stream_versions").await;
    for slot in ["s", "t"] {
        checkpoint::create(&c, slot, "outbox_pub", "sys", 1, Lsn(10))
            .await
            .unwrap();
    }
    let events = enqueue_orders(&c, 4).await;
    let key = |id: &str| ("order".to_string(), id.to_string());
    let numbered = |versions: &[(&str, i64)], generation| Numbered {
        versions: versions.iter().map(|&(id, v)| (key(id), v)).collect(),
        policy_generation: generation,
        fold: false,
    };
    let asked = [key("a"), key("b"), key("never")];
    let mut prepared = accept::Prepared::default();

    accept::accept_numbered_batch(
        &mut c,
        &mut prepared,
        "s",
        &[LedgerItem::Receipt(receipt(&events[0], 1))],
        Lsn(20),
        None,
        &numbered(&[("a", 3), ("b", 1)], Some(5)),
    )
    .await
    .unwrap();
    // Logged (migration 0040), not yet in the map a run reads: a run folds at its start.
    assert_eq!(versions_of(&c, "s", &asked).await.unwrap(), [0, 0, 0]);
    let logged: Vec<(String, i64)> = c
        .query(
            "SELECT aggregate_id, version FROM outbox.stream_numbering
             WHERE slot_name = 's' ORDER BY aggregate_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(logged, [("a".to_string(), 3), ("b".to_string(), 1)]);
    let moved = fold_at_start(&mut c, "s", Lsn(19)).await.unwrap_err();
    assert!(
        matches!(moved, outbox_ledger::LedgerError::CheckpointMoved { .. }) && moved.is_transient(),
        "a run that planned to stream from before the checkpoint starts again: {moved}"
    );
    assert_eq!(
        versions_of(&c, "s", &asked).await.unwrap(),
        [0, 0, 0],
        "a refused start folds nothing"
    );
    assert_eq!(fold_at_start(&mut c, "s", Lsn(20)).await.unwrap(), 2);
    assert_eq!(versions_of(&c, "s", &asked).await.unwrap(), [3, 1, 0]);
    assert_eq!(policy_generation(&c, "s").await.unwrap(), Some(5));
    assert_eq!(
        versions_of(&c, "t", &asked).await.unwrap(),
        [0, 0, 0],
        "another slot's numbering is its own"
    );

    // A later checkpoint raises b; a (stale) lower version of a does not lower it.
    accept::accept_numbered_batch(
        &mut c,
        &mut prepared,
        "s",
        &[LedgerItem::Receipt(receipt(&events[1], 2))],
        Lsn(30),
        None,
        &Numbered {
            fold: true,
            ..numbered(&[("a", 2), ("b", 4)], Some(6))
        },
    )
    .await
    .unwrap();
    assert_eq!(
        versions_of(&c, "s", &asked).await.unwrap(),
        [3, 1, 0],
        "an acceptance never folds (a fold of millions of entries held its receipts): its caller folds after the commit"
    );
    assert_eq!(
        outbox_ledger::numbering::fold(&c, "s").await.unwrap(),
        1,
        "b raised; a's older version kept"
    );
    assert_eq!(versions_of(&c, "s", &asked).await.unwrap(), [3, 4, 0]);
    let log_rows: i64 = c
        .query_one("SELECT count(*) FROM outbox.stream_version_log", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(log_rows, 0, "a fold empties the log");
    assert_eq!(policy_generation(&c, "s").await.unwrap(), Some(6));

    // A receipt the database refuses fails the whole acceptance: no numbering.
    let refused = ReceiptRecord {
        partition: -1,
        ..receipt(&events[2], 3)
    };
    accept::accept_numbered_batch(
        &mut c,
        &mut prepared,
        "s",
        &[LedgerItem::Receipt(refused)],
        Lsn(40),
        None,
        &numbered(&[("a", 9), ("never", 1)], Some(7)),
    )
    .await
    .unwrap_err();
    assert_eq!(fold_at_start(&mut c, "s", Lsn(30)).await.unwrap(), 0);
    assert_eq!(
        (
            versions_of(&c, "s", &asked).await.unwrap(),
            policy_generation(&c, "s").await.unwrap()
        ),
        (vec![3, 4, 0], Some(6)),
        "a failed acceptance keeps no numbering"
    );

    // Fenced off: the receipt is kept, the checkpoint and its numbering are not.
    let stale = Fence {
        owner: "gone".into(),
        generation: 999,
    };
    let err = accept::accept_numbered_batch(
        &mut c,
        &mut prepared,
        "s",
        &[LedgerItem::Receipt(receipt(&events[3], 4))],
        Lsn(50),
        Some(&stale),
        &numbered(&[("a", 9), ("never", 1)], Some(7)),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, outbox_ledger::LedgerError::LeaseLost { .. }),
        "{err}"
    );
    assert_eq!(fold_at_start(&mut c, "s", Lsn(30)).await.unwrap(), 0);
    let receipts: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.receipts WHERE event_id = $1",
            &[&events[3].event_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        (
            receipts,
            versions_of(&c, "s", &asked).await.unwrap(),
            policy_generation(&c, "s").await.unwrap(),
            checkpoint::load(&c, "s")
                .await
                .unwrap()
                .unwrap()
                .confirmed_lsn
        ),
        (1, vec![3, 4, 0], Some(6), Lsn(30)),
        "a fenced run keeps its receipts, not the checkpoint or the numbering"
    );
}

/// Policy generations are written one at a time, in commit order (migration 0039's fix to
/// 0038): two transactions that change the route policy at once under READ COMMITTED give
/// two generations, the later holding both changes; under REPEATABLE READ the second is
/// refused as a serialization failure instead of writing a generation without the first's
/// change. Without the lock, the later generation lacked the other's rule.
#[tokio::test]
async fn concurrent_policy_changes_give_generations_in_commit_order() {
    use std::time::Duration;
    use tokio_postgres::IsolationLevel;
    async fn newest_topics(c: &Client) -> Vec<String> {
        let mut topics: Vec<String> = c
            .query(
                "SELECT v.topic_template
                 FROM (SELECT rules FROM outbox.policy_generations
                       ORDER BY generation_id DESC LIMIT 1) g,
                      jsonb_array_elements(g.rules) r
                 JOIN outbox.route_versions v ON v.version_id = (r ->> 'route_version')::bigint",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        topics.sort();
        topics
    }
    let (c, url) = fresh("ledger_policy_generation_order").await;
    let add = "INSERT INTO outbox.route_policy (aggregate_type, event_type, priority, topic)
               VALUES ($1, NULL, 0, $2)";
    for (isolation, tag) in [
        (IsolationLevel::ReadCommitted, "rc"),
        (IsolationLevel::RepeatableRead, "rr"),
    ] {
        let mut clients = Vec::new();
        for _ in 0..2 {
            let (client, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
            tokio::spawn(conn);
            clients.push(client);
        }
        let (a, b) = clients.split_at_mut(1);
        let ta = a[0]
            .build_transaction()
            .isolation_level(isolation)
            .start()
            .await
            .unwrap();
        let tb = b[0]
            .build_transaction()
            .isolation_level(isolation)
            .start()
            .await
            .unwrap();
        // Both snapshots are taken before either change.
        for t in [&ta, &tb] {
            t.query_one("SELECT count(*) FROM outbox.route_policy", &[])
                .await
                .unwrap();
        }
        let (topic_a, topic_b) = (format!("topic_a_{tag}"), format!("topic_b_{tag}"));
        ta.execute(add, &[&format!("a_{tag}"), &topic_a])
            .await
            .unwrap();
        let b_change = async {
            tb.execute(add, &[&format!("b_{tag}"), &topic_b]).await?;
            tb.commit().await
        };
        tokio::pin!(b_change);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut b_change)
                .await
                .is_err(),
            "{tag}: b's change waits for a's lock"
        );
        ta.commit().await.unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(10), b_change)
            .await
            .expect("b's change finishes once a committed");
        let topics = newest_topics(&c).await;
        if tag == "rc" {
            outcome.unwrap();
            assert!(
                topics.contains(&topic_a) && topics.contains(&topic_b),
                "the later generation holds both changes: {topics:?}"
            );
        } else {
            let err = outcome.unwrap_err();
            assert_eq!(
                err.code(),
                Some(&tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE),
                "{err}"
            );
            assert!(
                topics.contains(&topic_a) && !topics.contains(&topic_b),
                "the refused change wrote no generation: {topics:?}"
            );
        }
    }
}

/// The writer's plain INSERT (migration 0039, docs/versions_by_relay.md): refused while the
/// outbox does not allow rows without a version (the default: poll mode cannot order them),
/// where a row written by hand with a version is still held to what enqueue checks (here: a
/// destination). Once the owner allows them, four columns make an event (id and time by
/// default), the version table is not touched, and the rows-around-enqueue trigger is gone
/// (its cost is a third of the fast path's), and `outbox.enqueue` writes such rows too
/// (migration 0043); disallowing them fails while such a row exists, and afterwards restores
/// both, and `outbox.enqueue` continues each aggregate after the highest version its rows and
/// tombstones hold (the relay numbered past the version table meanwhile).
#[tokio::test]
async fn a_plain_insert_is_an_event_where_the_outbox_allows_it() {
    use tokio_postgres::error::SqlState;
    let (c, _) = fresh("ledger_plain_insert").await;
    let plain = "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'p-1', 'order.placed', '{\"total\": 42}') RETURNING event_id";
    let by_hand = "INSERT INTO outbox.events (aggregate_type, aggregate_id, aggregate_version,
                                              event_type, payload)
                   VALUES ('order', 'p-2', 1, 'order.placed', '{}')";
    let code = |e: tokio_postgres::Error| e.code().cloned();
    let trigger = "SELECT count(*) FROM pg_trigger
                   WHERE tgrelid = 'outbox.events'::regclass AND tgname = 'events_row_around_enqueue'";
    assert_eq!(
        code(c.query_one(plain, &[]).await.unwrap_err()),
        Some(SqlState::NOT_NULL_VIOLATION)
    );
    assert_eq!(
        code(c.execute(by_hand, &[]).await.unwrap_err()),
        Some(SqlState::CHECK_VIOLATION)
    );

    c.batch_execute("SELECT outbox.allow_plain_inserts(true)")
        .await
        .unwrap();
    let id: uuid::Uuid = c.query_one(plain, &[]).await.unwrap().get(0);
    assert_eq!(id.get_version_num(), 7, "a time-ordered id by default");
    assert_eq!(id.get_variant(), uuid::Variant::RFC4122);
    let (secs, _) = id.get_timestamp().expect("a v7 id's time").to_unix();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        secs.abs_diff(now) < 60,
        "the id holds the insert's time: {secs} s against {now} s"
    );
    let r = c
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM outbox.aggregate_versions),
                        (SELECT count(*) FROM outbox.holds),
                        (SELECT envelope_generation FROM outbox.events WHERE event_id = $1),
                        ({trigger})"
            ),
            &[&id],
        )
        .await
        .unwrap();
    let got: (i64, i64, i32, i64) = (r.get(0), r.get(1), r.get(2), r.get(3));
    assert_eq!(got, (0, 0, 1, 0));
    // The rows' key holds versioned rows only, and still refuses a version written twice.
    let key: String = c
        .query_one(
            "SELECT indexdef FROM pg_indexes
             WHERE schemaname = 'outbox' AND indexname = 'events_aggregate_version_key'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(key.contains("(aggregate_version IS NOT NULL)"), "{key}");
    let opts = EnqueueOptions::default();
    let enqueued = enqueue(&c, "order", "p-3", "order.placed", &json!({}), &opts)
        .await
        .unwrap();
    let r = c
        .query_one(
            "SELECT aggregate_version, route_version FROM outbox.events WHERE event_id = $1",
            &[&enqueued],
        )
        .await
        .unwrap();
    let got: (Option<i64>, Option<i64>) = (r.get(0), r.get(1));
    assert_eq!(
        got,
        (None, None),
        "enqueue leaves version and route to the relay"
    );
    let versioned = "INSERT INTO outbox.events (aggregate_type, aggregate_id, aggregate_version,
                                                event_type, payload, route_version)
                     VALUES ('order', 'p-3', 1, 'order.placed', '{}', 0)";
    c.execute(versioned, &[]).await.unwrap();
    assert_eq!(
        code(c.execute(versioned, &[]).await.unwrap_err()),
        Some(SqlState::UNIQUE_VIOLATION)
    );
    c.execute(
        "DELETE FROM outbox.events WHERE event_id = $1",
        &[&enqueued],
    )
    .await
    .unwrap();

    assert_eq!(
        code(
            c.batch_execute("SELECT outbox.allow_plain_inserts(false)")
                .await
                .unwrap_err()
        ),
        Some(SqlState::NOT_NULL_VIOLATION),
        "not while a row without a version exists"
    );
    c.execute("DELETE FROM outbox.events WHERE event_id = $1", &[&id])
        .await
        .unwrap();
    // The relay numbered p-3 up to 7 meanwhile, and those rows were purged: their tombstones
    // keep the versions.
    c.execute(
        "INSERT INTO outbox.purged_events (event_id, aggregate_type, aggregate_id,
             aggregate_version, payload_digest, destination_digest, topic, partition, \"offset\",
             occurred_at, accepted_at)
         VALUES (gen_random_uuid(), 'order', 'p-3', 7, 'd', 'd', 't', 0, 0, now(), now())",
        &[],
    )
    .await
    .unwrap();
    c.batch_execute("SELECT outbox.allow_plain_inserts(false)")
        .await
        .unwrap();
    assert_eq!(c.query_one(trigger, &[]).await.unwrap().get::<_, i64>(0), 1);
    assert_eq!(
        code(c.execute(by_hand, &[]).await.unwrap_err()),
        Some(SqlState::CHECK_VIOLATION),
        "checked at insert again"
    );
    let next = enqueue(&c, "order", "p-3", "order.placed", &json!({}), &opts)
        .await
        .unwrap();
    assert_eq!(
        version_of(&c, next).await,
        Some(8),
        "enqueue continues after the relay's versions"
    );
}

/// Migration 0043 on an outbox that already takes plain INSERTs (0039): `outbox.enqueue`
/// writes plain rows from then on, on a session that called it before the upgrade too, and
/// the migration waits for a transaction that enqueued with a version before it (so that row
/// commits before the first plain one); on an outbox that does not take them, enqueue keeps
/// giving versions.
#[tokio::test]
async fn migration_0043_makes_enqueue_write_plain_rows_where_the_outbox_takes_them() {
    let (mut c, url) = bare("ledger_enqueue_by_relay_upgrade").await;
    migrate::run_through(&mut c, 42).await.unwrap();
    c.batch_execute("SELECT outbox.allow_plain_inserts(true)")
        .await
        .unwrap();
    let opts = EnqueueOptions::default();
    let before = enqueue(&c, "order", "u-1", "x", &json!({}), &opts)
        .await
        .unwrap();
    assert_eq!(
        version_of(&c, before).await,
        Some(1),
        "0042's enqueue gives versions"
    );

    // A writer's transaction that enqueued (with a version) and has not committed yet.
    let (mut w, wconn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(wconn);
    let wtx = w.transaction().await.unwrap();
    let open = enqueue(&wtx, "order", "u-1", "x", &json!({}), &opts)
        .await
        .unwrap();
    let (mut m, mconn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(mconn);
    let migrating = tokio::spawn(async move { migrate::run(&mut m).await });
    // The migration waits for the writer: its lock request is queued behind the writer's.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_locks
                 WHERE relation = 'outbox.events'::regclass AND NOT granted",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the migration never waited for the open writer"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(!migrating.is_finished(), "applied while a writer was open");
    wtx.commit().await.unwrap();
    assert_eq!(migrating.await.unwrap().unwrap(), vec![43]);
    assert_eq!(version_of(&c, open).await, Some(2));

    let after = enqueue(&c, "order", "u-1", "x", &json!({}), &opts)
        .await
        .unwrap();
    assert_eq!(
        version_of(&c, after).await,
        None,
        "the same session's enqueue leaves the version to the relay after the upgrade"
    );

    // An outbox that does not take plain INSERTs: versions as before.
    let (c2, _) = fresh("ledger_enqueue_versions_kept").await;
    let id = enqueue(&c2, "order", "v-1", "x", &json!({}), &opts)
        .await
        .unwrap();
    assert_eq!(version_of(&c2, id).await, Some(1));
}
