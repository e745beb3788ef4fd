//! The relay's reads of unpublished rows (a snapshot's `pending_rows_sql`, a poll round's
//! `poll::pending_sql`) offer exactly what `outbox_core::records::OfferRule` says, the rule the
//! simulator's reads decide with: one aggregate per combination of a row's facts (published
//! or not, its quarantine open, released or skipped, its aggregate held or not).

use outbox_core::records::{OfferFacts, OfferRule, QuarantineState};
use outbox_ledger::migrate;
use outbox_ledger::producer::{enqueue, EnqueueOptions};
use outbox_source::{poll, snapshot};
use outbox_testkit::postgres::TestPostgres;
use serde_json::json;
use tokio_postgres::NoTls;
use uuid::Uuid;

#[tokio::test]
async fn reads_offer_what_the_rule_says() {
    let url = TestPostgres::shared()
        .create_database("source_reads_rule")
        .await
        .unwrap();
    let (mut c, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(conn);
    migrate::run(&mut c).await.unwrap();

    let quarantines = [
        None,
        Some(QuarantineState::Open),
        Some(QuarantineState::Released),
        Some(QuarantineState::Skipped),
    ];
    let mut cases: Vec<(Uuid, OfferFacts)> = Vec::new();
    for published in [false, true] {
        for quarantine in quarantines {
            for aggregate_held in [false, true] {
                let f = OfferFacts {
                    published,
                    quarantine,
                    aggregate_held,
                };
                let agg = format!("a-{}", cases.len());
                let id = enqueue(
                    &c,
                    "order",
                    &agg,
                    "order.created",
                    &json!({"n": cases.len()}),
                    &EnqueueOptions::default(),
                )
                .await
                .unwrap();
                if published {
                    c.execute(
                        "INSERT INTO outbox.receipts (event_id, broker_kind, broker_cluster, topic,
                             partition, \"offset\", payload_digest, destination_digest)
                         VALUES ($1, 'kafka', 'default', 'outbox.event.order', 0, 1, 'p', 'd')",
                        &[&id],
                    )
                    .await
                    .unwrap();
                }
                if let Some(q) = quarantine {
                    let (released, resolution) = match q {
                        QuarantineState::Open => (false, None),
                        QuarantineState::Released => (true, Some("released")),
                        QuarantineState::Skipped => (true, Some("skipped")),
                    };
                    c.execute(
                        "INSERT INTO outbox.quarantine (quarantine_key, event_id, aggregate_type,
                             aggregate_id, aggregate_version, reason_code, reason, released_at,
                             resolution)
                         VALUES ($1::uuid::text, $1, 'order', $2, 1, 'test', 'test',
                                 CASE WHEN $3 THEN clock_timestamp() END, $4)",
                        &[&id, &agg, &released, &resolution],
                    )
                    .await
                    .unwrap();
                }
                if aggregate_held {
                    c.execute(
                        "INSERT INTO outbox.holds (aggregate_type, aggregate_id, reason_code, reason)
                         VALUES ('order', $1, 'test', 'test')",
                        &[&agg],
                    )
                    .await
                    .unwrap();
                }
                cases.push((id, f));
            }
        }
    }

    let ids = |rows: Vec<tokio_postgres::Row>| -> Vec<Uuid> {
        rows.iter()
            .map(|r| snapshot::event_from_row(r).unwrap().event_id)
            .collect()
    };
    let by_snapshot = ids(c
        .query(
            &snapshot::pending_rows_sql("outbox.events_current", None),
            &[],
        )
        .await
        .unwrap());
    let by_poll = ids(c
        .query(&poll::pending_sql("outbox.events_current"), &[&1000i64])
        .await
        .unwrap());
    let rule = OfferRule::default();
    let (mut offered, mut refused) = (0, 0);
    for (id, f) in &cases {
        assert_eq!(
            by_snapshot.contains(id),
            rule.by_snapshot(*f),
            "snapshot, {f:?}"
        );
        assert_eq!(
            by_poll.contains(id),
            rule.by_poll_round(*f),
            "poll round, {f:?}"
        );
        if rule.by_poll_round(*f) {
            offered += 1;
        } else {
            refused += 1;
        }
    }
    assert!(
        offered > 0 && refused > 0,
        "{offered} offered, {refused} not"
    );
}
