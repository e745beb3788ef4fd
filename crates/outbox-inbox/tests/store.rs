//! The inbox transaction against real PostgreSQL: dedup returns the original receipt without
//! running the handler, the gap policies, rollback on handler failure, and the schema shared
//! with migration 0008.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_inbox::store::{self, find_receipt, process};
use outbox_inbox::{handler_fn, GapPolicy, Handler, InboxError, InboxMessage, Outcome};
use outbox_testkit::postgres::TestPostgres;
use tokio_postgres::{Client, NoTls};

async fn db(name: &str, migrate: bool) -> Client {
    let url = TestPostgres::shared().create_database(name).await.unwrap();
    let (mut c, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(conn);
    if migrate {
        outbox_ledger::migrate::run(&mut c).await.unwrap();
    } else {
        store::install(&c).await.unwrap();
    }
    c.batch_execute("CREATE TABLE effects (event_id uuid NOT NULL, note text)")
        .await
        .unwrap();
    c
}

fn msg(agg: &str, version: i64, offset: i64) -> InboxMessage {
    InboxMessage {
        event_id: uuid::Uuid::new_v4(),
        aggregate_type: "order".into(),
        aggregate_id: agg.into(),
        aggregate_version: version,
        event_type: "order.changed".into(),
        payload: b"{}".to_vec(),
        topic: "t".into(),
        partition: 0,
        offset,
    }
}

/// Inserts one effect row per run and counts runs.
fn counting(runs: Arc<AtomicUsize>) -> impl Handler {
    handler_fn(move |tx, ev, key| {
        let runs = runs.clone();
        let (id, k) = (ev.event_id, key.as_key());
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            tx.execute("INSERT INTO effects VALUES ($1, $2)", &[&id, &k])
                .await?;
            Ok(Some(serde_json::json!({"charged": id.to_string()})))
        })
    })
}

async fn effects(c: &Client, id: uuid::Uuid) -> i64 {
    c.query_one("SELECT count(*) FROM effects WHERE event_id = $1", &[&id])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn duplicate_returns_the_original_receipt_and_does_not_run_the_handler() {
    let mut c = db("inbox_dup", false).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let h = counting(runs.clone());
    let m = msg("o-1", 1, 7);
    let first = process(&mut c, "billing", GapPolicy::Reject, &m, 8, &h)
        .await
        .unwrap();
    let Outcome::Applied(r1) = first else {
        panic!("first delivery: {first:?}")
    };
    assert_eq!(
        r1.result,
        Some(serde_json::json!({"charged": m.event_id.to_string()}))
    );
    // Redelivered at another offset (a relay replay): same receipt, handler not run.
    let mut again = m.clone();
    again.offset = 12;
    let second = process(&mut c, "billing", GapPolicy::Reject, &again, 13, &h)
        .await
        .unwrap();
    assert_eq!(second, Outcome::Duplicate(r1.clone()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(effects(&c, m.event_id).await, 1);
    // Another consumer has its own inbox.
    let other = process(&mut c, "mailer", GapPolicy::Reject, &m, 8, &h)
        .await
        .unwrap();
    assert!(other.ran_handler());
    let wm: i64 = c
        .query_one(
            "SELECT next_offset FROM outbox.consumer_watermarks WHERE consumer_id = 'billing'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(wm, 13, "the duplicate moved the partition watermark too");
}

#[tokio::test]
async fn handler_failure_rolls_back_the_inbox_row_with_the_effect() {
    let mut c = db("inbox_fail", false).await;
    let failing = handler_fn(|tx, ev, _key| {
        let id = ev.event_id;
        Box::pin(async move {
            tx.execute("INSERT INTO effects VALUES ($1, 'half')", &[&id])
                .await?;
            Err("payment provider said no".into())
        })
    });
    let m = msg("o-1", 1, 0);
    let e = process(&mut c, "billing", GapPolicy::Reject, &m, 1, &failing)
        .await
        .unwrap_err();
    assert!(matches!(e, InboxError::Handler { .. }), "{e}");
    assert!(e.to_string().contains("delivered again"), "{e}");
    assert_eq!(effects(&c, m.event_id).await, 0);
    assert!(find_receipt(&c, "billing", m.event_id)
        .await
        .unwrap()
        .is_none());
    // The redelivery applies it.
    let runs = Arc::new(AtomicUsize::new(0));
    let ok = process(
        &mut c,
        "billing",
        GapPolicy::Reject,
        &m,
        1,
        &counting(runs.clone()),
    )
    .await
    .unwrap();
    assert!(ok.ran_handler());
    assert_eq!(effects(&c, m.event_id).await, 1);
}

#[tokio::test]
async fn gap_policies_reject_buffer_report_and_stale_versions() {
    let mut c = db("inbox_gap", false).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let h = counting(runs.clone());
    let v1 = msg("o-1", 1, 0);
    let v3 = msg("o-1", 3, 1);
    process(&mut c, "c", GapPolicy::Reject, &v1, 1, &h)
        .await
        .unwrap();

    let e = process(&mut c, "c", GapPolicy::Reject, &v3, 2, &h)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            InboxError::Gap {
                expected: 2,
                got: 3,
                ..
            }
        ),
        "{e}"
    );
    assert!(find_receipt(&c, "c", v3.event_id).await.unwrap().is_none());

    let b = process(&mut c, "c", GapPolicy::Buffer, &v3, 2, &h)
        .await
        .unwrap();
    assert_eq!(
        b,
        Outcome::Buffered {
            event_id: v3.event_id,
            expected: 2
        }
    );
    assert!(find_receipt(&c, "c", v3.event_id).await.unwrap().is_none());

    let r = process(&mut c, "c", GapPolicy::Report, &v3, 2, &h)
        .await
        .unwrap();
    assert!(
        matches!(r, Outcome::AppliedWithGap { expected: 2, .. }),
        "{r:?}"
    );
    let gaps: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.consumer_gaps WHERE expected_version = 2 AND got_version = 3",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(gaps, 1);

    // The missing v2 arrives late under its own id: behind the watermark, never applied.
    let v2 = msg("o-1", 2, 2);
    let s = process(&mut c, "c", GapPolicy::Report, &v2, 3, &h)
        .await
        .unwrap();
    assert!(matches!(s, Outcome::Stale(_)), "{s:?}");
    assert_eq!(effects(&c, v2.event_id).await, 0);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn inbox_schema_is_the_same_from_the_migration_and_from_install() {
    let migrated = db("inbox_schema_m", true).await;
    let installed = db("inbox_schema_i", false).await;
    // Installing over a migrated database is a no-op.
    store::install(&migrated).await.unwrap();
    let q = "SELECT table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable
                    || ' ' || coalesce(column_default, '')
             FROM information_schema.columns
             WHERE table_schema = 'outbox'
               AND table_name IN ('inbox', 'consumer_watermarks', 'consumer_aggregate_heads', 'consumer_gaps')
             ORDER BY table_name, ordinal_position";
    let mut cols = Vec::new();
    for c in [&migrated, &installed] {
        cols.push(
            c.query(q, &[])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>(),
        );
    }
    let (a, b) = (&cols[0], &cols[1]);
    assert!(a.len() >= 25, "{a:?}");
    assert_eq!(a, b);
}

#[tokio::test]
async fn purge_inbox_keeps_recent_rows() {
    let mut c = db("inbox_purge", false).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let h = counting(runs);
    let old = msg("o-1", 1, 0);
    let new = msg("o-2", 1, 1);
    process(&mut c, "c", GapPolicy::Reject, &old, 1, &h)
        .await
        .unwrap();
    process(&mut c, "c", GapPolicy::Reject, &new, 2, &h)
        .await
        .unwrap();
    c.execute(
        "UPDATE outbox.inbox SET consumed_at = consumed_at - interval '2 days' WHERE event_id = $1",
        &[&old.event_id],
    )
    .await
    .unwrap();
    let n = store::purge_inbox(&c, "c", Duration::from_secs(86_400), 1)
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert!(find_receipt(&c, "c", new.event_id).await.unwrap().is_some());
    // After its inbox row is gone, a replay of the old event is still refused by the
    // aggregate watermark.
    let again = process(&mut c, "c", GapPolicy::Reject, &old, 1, &h)
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Stale(_)), "{again:?}");
    assert_eq!(effects(&c, old.event_id).await, 1);
}

/// docs/consumer_inbox.sql, the file a consumer in another language installs, is what
/// `store::install` runs.
#[test]
fn the_shipped_consumer_sql_is_what_install_runs() {
    let shipped = include_str!("../../../docs/consumer_inbox.sql");
    assert_eq!(
        shipped,
        store::INBOX_SQL,
        "docs/consumer_inbox.sql differs from outbox_inbox::store::INBOX_SQL: regenerate it (inbox.sql, a newline, migrations/0024_consumer_recipe.sql)"
    );
}

/// `outbox.inbox_receive` (the recipe in SQL, for every language) decides as
/// `store::process` does: the same messages through both leave the same inbox outcomes,
/// aggregate and partition watermarks and gap records, and the same refusals.
#[tokio::test]
async fn the_sql_recipe_decides_as_the_rust_library_does() {
    for (policy, name) in [(GapPolicy::Reject, "reject"), (GapPolicy::Report, "report")] {
        let mut lib = db(&format!("inbox_parity_lib_{name}"), false).await;
        let sql = db(&format!("inbox_parity_sql_{name}"), true).await;
        let h = counting(Arc::new(AtomicUsize::new(0)));
        let first_a1 = msg("a", 1, 0);
        let mut dup_a1 = first_a1.clone();
        dup_a1.offset = 1;
        let seq = vec![
            first_a1,
            dup_a1,
            msg("a", 2, 2),
            msg("a", 4, 3),
            msg("a", 3, 4),
            msg("a", 3, 5),
            msg("b", 2, 6),
            msg("b", 1, 7),
            msg("c", 1, 8),
        ];
        let mut outcomes = (Vec::new(), Vec::new());
        for m in &seq {
            let got = process(&mut lib, "c", policy, m, m.offset + 1, &h).await;
            outcomes.0.push(match got {
                Ok(Outcome::Applied(_)) => "apply".to_string(),
                Ok(Outcome::AppliedWithGap { .. }) => "apply_with_gap".to_string(),
                Ok(Outcome::Duplicate(_)) => "duplicate".to_string(),
                Ok(Outcome::Stale(_)) => "stale".to_string(),
                Ok(other) => format!("{other:?}"),
                Err(InboxError::Gap { .. }) => "gap refused".to_string(),
                Err(e) => panic!("{e}"),
            });
            let got = sql
                .query_one(
                    "SELECT outbox.inbox_receive('c', $1, $2, $3, $4, $5, $6, $7, $8, $9)",
                    &[
                        &m.event_id,
                        &m.aggregate_type,
                        &m.aggregate_id,
                        &m.aggregate_version,
                        &m.event_type,
                        &m.topic,
                        &m.partition,
                        &m.offset,
                        &name,
                    ],
                )
                .await;
            outcomes.1.push(match got {
                Ok(row) => row.get::<_, String>(0),
                Err(e) if e.code().map(|c| c.code()) == Some("OX001") => "gap refused".to_string(),
                Err(e) => panic!("{e}"),
            });
        }
        assert_eq!(
            outcomes.0, outcomes.1,
            "policy {name}: library (left), SQL (right)"
        );
        assert!(
            outcomes.0.contains(&"stale".to_string()),
            "{:?}",
            outcomes.0
        );
        assert!(
            outcomes.0.contains(&"duplicate".to_string()),
            "{:?}",
            outcomes.0
        );
        let state = "SELECT 'inbox ' || event_id || ' ' || outcome FROM outbox.inbox WHERE consumer_id = 'c'
                     UNION ALL SELECT 'head ' || aggregate_id || ' ' || last_version FROM outbox.consumer_aggregate_heads
                     UNION ALL SELECT 'mark ' || topic || '/' || partition || ' ' || next_offset FROM outbox.consumer_watermarks
                     UNION ALL SELECT 'gap ' || aggregate_id || ' ' || expected_version || ' ' || got_version || ' ' || event_id FROM outbox.consumer_gaps
                     ORDER BY 1";
        let (a, b) = (state_rows(&lib, state).await, state_rows(&sql, state).await);
        assert_eq!(
            a, b,
            "policy {name}: the library's tables (left), the SQL function's (right)"
        );
        assert!(a.len() >= 8, "{a:?}");
    }
}

async fn state_rows(c: &Client, sql: &str) -> Vec<String> {
    c.query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect()
}
