//! Retention: PUBLISHED -> RETAINED -> PURGED, without ever deleting evidence still needed.
//!
//! An event may go only when all of these hold, checked in the statement that deletes it:
//! * it has a primary receipt accepted longer ago than the replay window (a relay replay or a
//!   consumer re-read inside the window still finds the event and its receipt);
//! * every mandatory consumer that reads its topic covers it (partition watermark past its
//!   offset, or the event in that consumer's inbox) — `outbox.covered_by_mandatory`;
//! * it has no open quarantine record, no open held-event record and no DISPATCH_UNKNOWN
//!   attempt (those are open questions, not history);
//! * if it belongs to a delivery set, every member satisfies the above;
//! * the relay's ledger checkpoint of the slot that published it is past its commit LSN, so no
//!   relay restart can replay it (a replayed event without its row and receipt would get a
//!   second primary receipt). Receipts without a commit LSN (initial snapshot, poll mode) need
//!   no such proof: a snapshot only publishes rows that exist;
//! * in poll mode, the current round of a live poll lease saw the receipt's transaction (a
//!   round that read the event before a paused relay's salvage accepted the receipt may still
//!   send it; migration 0015, `outbox.poll_round_missed`).
//!
//! Marking comes first: every published event its mandatory consumers cover becomes RETAINED
//! (`receipts.retained_at`). Deleting removes the row, its receipts, attempts, migrations and
//! closed quarantine/hold records in one transaction per batch, and leaves a tombstone in
//! `outbox.purged_events` (ids, digests, receipt position), so the reconciler still recognises
//! the broker's copy. Deleting only outbox rows never publishes anything: the publication
//! carries inserts only.
//!
//! Inbox rows (`outbox.inbox` in this database) have their own, longer retention: they are
//! what deduplicates a replay from the broker, and the broker keeps messages for its own
//! retention period, not ours. An inbox row whose event is still in the outbox is never
//! deleted (it may be the evidence that a mandatory consumer covers it).

use std::time::Duration;

use serde::Serialize;
use tokio_postgres::Client;

use crate::{Context, LedgerError};

/// What to purge and how.
#[derive(Debug, Clone)]
pub struct PurgeSettings {
    /// Events published more recently than this are kept.
    pub replay_window: Duration,
    /// Inbox rows consumed more recently than this are kept. At least `replay_window`.
    pub inbox_retention: Duration,
    /// Rows per delete transaction.
    pub batch_size: i64,
    /// Stop after this many event batches (None: until nothing is left).
    pub max_batches: Option<u64>,
    /// Count, change nothing.
    pub dry_run: bool,
}

impl PurgeSettings {
    /// Names the setting and the rule it breaks.
    pub fn validate(&self) -> Result<(), LedgerError> {
        if self.batch_size < 1 {
            return Err(LedgerError::Invalid(
                "purge batch size must be at least 1".into(),
            ));
        }
        if self.inbox_retention < self.replay_window {
            return Err(LedgerError::Invalid(format!(
                "inbox retention ({}s) is shorter than the replay window ({}s): a replay inside the window would no longer be deduplicated by the inbox; raise --inbox-retention",
                self.inbox_retention.as_secs(),
                self.replay_window.as_secs()
            )));
        }
        Ok(())
    }
}

/// What a purge did (or, with `dry_run`, would do), and why the rest stays.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PurgeReport {
    pub dry_run: bool,
    /// Published events moved to RETAINED in this run (would be, in a dry run).
    pub marked_retained: i64,
    /// Events deleted (would be), each leaving a tombstone.
    pub events: i64,
    pub receipts: i64,
    pub duplicate_receipts: i64,
    pub attempts: i64,
    /// Inbox rows deleted (would be).
    pub inbox_rows: i64,
    /// Acceptance batches (`outbox.receipt_batches`) deleted once no receipt named them; not
    /// counted in a dry run.
    pub receipt_batches: i64,
    pub batches: u64,
    /// Published, covered, still inside the replay window.
    pub kept_inside_window: i64,
    /// Published, not yet covered by every mandatory consumer (whatever their age).
    pub kept_awaiting_consumers: i64,
    /// Published, past the window, but the relay's checkpoint is not past them yet (a relay
    /// restart could replay them).
    pub kept_relay_may_replay: i64,
    /// True when `max_batches` stopped the run with more to do.
    pub stopped_early: bool,
}

/// `r` (receipts) and `e` (events) are purgeable: window passed, covered, no open question.
/// `$1` is the replay window in seconds.
const ELIGIBLE: &str = "
    r.accepted_at < clock_timestamp() - make_interval(secs => $1)
    AND (r.commit_lsn IS NULL OR EXISTS (
            SELECT 1 FROM outbox.checkpoints c
            WHERE c.slot_name = r.slot_name AND c.confirmed_lsn > r.commit_lsn))
    AND NOT outbox.poll_round_missed(r.accepted_xact)
    AND outbox.covered_by_mandatory(r.event_id, r.topic, r.partition, r.\"offset\")
    AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                    WHERE q.event_id = e.event_id AND q.released_at IS NULL)
    AND NOT EXISTS (SELECT 1 FROM outbox.held_events h
                    WHERE h.event_id = e.event_id AND h.released_at IS NULL)
    AND NOT EXISTS (SELECT 1 FROM outbox.attempts a
                    WHERE a.event_id = e.event_id AND a.state = 'DISPATCH_UNKNOWN')
    AND (e.delivery_set_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM outbox.events m
            LEFT JOIN outbox.receipts mr ON mr.event_id = m.event_id
            WHERE m.delivery_set_id = e.delivery_set_id
              AND (mr.event_id IS NULL
                   OR mr.accepted_at >= clock_timestamp() - make_interval(secs => $1)
                   OR NOT outbox.covered_by_mandatory(mr.event_id, mr.topic, mr.partition, mr.\"offset\"))))";

const INBOX_ELIGIBLE: &str = "
    i.consumed_at < clock_timestamp() - make_interval(secs => $1)
    AND NOT EXISTS (SELECT 1 FROM outbox.events e WHERE e.event_id = i.event_id)";

/// Marks, then purges in batches (or counts, with `dry_run`).
pub async fn purge(client: &Client, s: &PurgeSettings) -> Result<PurgeReport, LedgerError> {
    s.validate()?;
    let window = s.replay_window.as_secs_f64();
    let inbox_window = s.inbox_retention.as_secs_f64();
    let mut report = PurgeReport {
        dry_run: s.dry_run,
        ..PurgeReport::default()
    };

    if s.dry_run {
        let row = client
            .query_one(
                &format!(
                    "SELECT (SELECT count(*) FROM outbox.receipts r
                             WHERE r.retained_at IS NULL
                               AND outbox.covered_by_mandatory(r.event_id, r.topic, r.partition, r.\"offset\")),
                            (SELECT count(*) FROM outbox.events e
                             JOIN outbox.receipts r ON r.event_id = e.event_id WHERE {ELIGIBLE}),
                            (SELECT count(*) FROM outbox.duplicate_receipts d
                             WHERE d.event_id IN (SELECT e.event_id FROM outbox.events e
                                                  JOIN outbox.receipts r ON r.event_id = e.event_id
                                                  WHERE {ELIGIBLE})),
                            (SELECT count(*) FROM outbox.attempts a
                             WHERE a.event_id IN (SELECT e.event_id FROM outbox.events e
                                                  JOIN outbox.receipts r ON r.event_id = e.event_id
                                                  WHERE {ELIGIBLE}))"
                ),
                &[&window],
            )
            .await
            .ctx("counting what purge would delete")?;
        report.marked_retained = row.get(0);
        report.events = row.get(1);
        report.receipts = report.events;
        report.duplicate_receipts = row.get(2);
        report.attempts = row.get(3);
        report.inbox_rows = client
            .query_one(
                &format!("SELECT count(*) FROM outbox.inbox i WHERE {INBOX_ELIGIBLE}"),
                &[&inbox_window],
            )
            .await
            .ctx("counting inbox rows purge would delete")?
            .get(0);
    } else {
        loop {
            let n = client
                .execute(
                    // The tables under outbox.receipts (migration 0030): a view's outer
                    // joins cannot be locked.
                    "WITH m AS (
                         SELECT r.event_id FROM outbox.receipt_entries r
                         JOIN outbox.receipt_destinations d ON d.destination_id = r.destination_id
                         WHERE r.retained_at IS NULL
                           AND outbox.covered_by_mandatory(r.event_id, d.topic, r.partition, r.\"offset\")
                         LIMIT $1
                         FOR UPDATE OF r SKIP LOCKED)
                     UPDATE outbox.receipt_entries r SET retained_at = clock_timestamp()
                     FROM m WHERE r.event_id = m.event_id",
                    &[&s.batch_size],
                )
                .await
                .ctx("marking covered events RETAINED")?;
            report.marked_retained += n as i64;
            if (n as i64) < s.batch_size {
                break;
            }
        }
        let delete = format!(
            "WITH v AS (
                 SELECT e.event_id FROM outbox.events e
                 JOIN outbox.receipts r ON r.event_id = e.event_id
                 JOIN outbox.receipt_entries re ON re.event_id = e.event_id
                 WHERE {ELIGIBLE}
                 ORDER BY r.accepted_at
                 LIMIT $2
                 -- The receipt entry's lock is the event's: one receipt per event, and nothing
                 -- updates an outbox row. Locking the outbox row too would need UPDATE on
                 -- outbox.events, which no role but the owner has (docs/operator_role.sql).
                 FOR UPDATE OF re SKIP LOCKED),
             t AS (
                 INSERT INTO outbox.purged_events (event_id, aggregate_type, aggregate_id,
                     aggregate_version, payload_digest, destination_digest, topic, partition,
                     \"offset\", occurred_at, accepted_at)
                 SELECT e.event_id, e.aggregate_type, e.aggregate_id,
                        coalesce(e.aggregate_version, r.aggregate_version),
                        coalesce(e.payload_digest, r.payload_digest), r.destination_digest,
                        r.topic, r.partition, r.\"offset\", e.occurred_at, r.accepted_at
                 FROM v JOIN outbox.events e ON e.event_id = v.event_id
                 JOIN outbox.receipts r ON r.event_id = v.event_id
                 ON CONFLICT (event_id) DO NOTHING
                 RETURNING 1),
             dd AS (DELETE FROM outbox.duplicate_receipts d USING v WHERE d.event_id = v.event_id RETURNING 1),
             da AS (DELETE FROM outbox.attempts a USING v WHERE a.event_id = v.event_id RETURNING 1),
             dh AS (DELETE FROM outbox.held_events h USING v WHERE h.event_id = v.event_id RETURNING 1),
             dq AS (DELETE FROM outbox.quarantine q USING v WHERE q.event_id = v.event_id RETURNING 1),
             dm AS (DELETE FROM outbox.destination_migrations m USING v WHERE m.event_id = v.event_id RETURNING 1),
             dr AS (DELETE FROM outbox.receipt_entries r USING v WHERE r.event_id = v.event_id RETURNING 1),
             de AS (DELETE FROM outbox.events e USING v WHERE e.event_id = v.event_id RETURNING 1)
             SELECT (SELECT count(*) FROM de), (SELECT count(*) FROM dr), (SELECT count(*) FROM dd),
                    (SELECT count(*) FROM da), (SELECT count(*) FROM t),
                    (SELECT count(*) FROM dh), (SELECT count(*) FROM dq), (SELECT count(*) FROM dm)"
        );
        loop {
            if s.max_batches.is_some_and(|m| report.batches >= m) {
                report.stopped_early = true;
                break;
            }
            let row = client
                .query_one(&delete, &[&window, &s.batch_size])
                .await
                .ctx("purging a batch of events (one transaction)")?;
            let events: i64 = row.get(0);
            report.events += events;
            report.receipts += row.get::<_, i64>(1);
            report.duplicate_receipts += row.get::<_, i64>(2);
            report.attempts += row.get::<_, i64>(3);
            if events > 0 {
                report.batches += 1;
            }
            if events < s.batch_size {
                break;
            }
        }
        // Acceptance batches left without entries (their receipts purged, or every receipt
        // of the acceptance a duplicate), once past the replay window. One pass over the
        // entries per purge: they have no index on their batch, which would cost every
        // acceptance a key per event (migration 0030).
        report.receipt_batches = client
            .execute(
                "DELETE FROM outbox.receipt_batches b
                 WHERE b.accepted_at < clock_timestamp() - make_interval(secs => $1)
                   AND NOT EXISTS (SELECT 1 FROM outbox.receipt_entries r
                                   WHERE r.batch_id = b.batch_id)",
                &[&window],
            )
            .await
            .ctx("deleting acceptance batches left without receipts")?
            as i64;
        loop {
            let n = client
                .execute(
                    &format!(
                        "WITH v AS (
                             SELECT i.consumer_id, i.event_id FROM outbox.inbox i
                             WHERE {INBOX_ELIGIBLE}
                             ORDER BY i.consumed_at
                             LIMIT $2
                             FOR UPDATE SKIP LOCKED)
                         DELETE FROM outbox.inbox i USING v
                         WHERE i.consumer_id = v.consumer_id AND i.event_id = v.event_id"
                    ),
                    &[&inbox_window, &s.batch_size],
                )
                .await
                .ctx("purging a batch of inbox rows")?;
            report.inbox_rows += n as i64;
            if (n as i64) < s.batch_size {
                break;
            }
        }
    }

    let kept = client
        .query_one(
            "SELECT count(*) FILTER (WHERE r.accepted_at >= clock_timestamp() - make_interval(secs => $1)
                                       AND outbox.covered_by_mandatory(r.event_id, r.topic, r.partition, r.\"offset\")),
                    count(*) FILTER (WHERE NOT outbox.covered_by_mandatory(r.event_id, r.topic, r.partition, r.\"offset\")),
                    count(*) FILTER (WHERE r.accepted_at < clock_timestamp() - make_interval(secs => $1)
                                       AND r.commit_lsn IS NOT NULL
                                       AND NOT EXISTS (SELECT 1 FROM outbox.checkpoints c
                                                       WHERE c.slot_name = r.slot_name
                                                         AND c.confirmed_lsn > r.commit_lsn))
             FROM outbox.receipts r",
            &[&window],
        )
        .await
        .ctx("counting retained events")?;
    report.kept_inside_window = kept.get(0);
    report.kept_awaiting_consumers = kept.get(1);
    report.kept_relay_may_replay = kept.get(2);
    Ok(report)
}
