//! The per-slot checkpoint row.
//!
//! `confirmed_lsn` is the highest LSN below which every event is resolved in this ledger. It
//! only moves forward, only inside the transaction that recorded the receipts it covers, and
//! the relay confirms to the slot only what it read back from here. So at any moment:
//! slot `confirmed_flush_lsn` <= ledger `confirmed_lsn` <= first unresolved event's commit.
//! A slot whose `confirmed_flush_lsn` is *ahead* of the ledger was moved by someone else (or
//! dropped and recreated), and the relay refuses to run on it.

use outbox_core::delivery::RecordPosition;
use outbox_core::Lsn;
use tokio_postgres::{Client, GenericClient};

use crate::{Context, LedgerError};

/// A slot's checkpoint as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub slot_name: String,
    pub publication: String,
    pub system_identifier: Option<String>,
    pub confirmed_lsn: Lsn,
    pub consistent_point: Option<Lsn>,
    pub snapshot_done: bool,
}

fn lsn_of(s: Option<String>) -> Result<Option<Lsn>, LedgerError> {
    s.map(|t| {
        t.parse::<Lsn>()
            .map_err(|e| LedgerError::Invalid(e.to_string()))
    })
    .transpose()
}

/// The checkpoint of `slot`, if the ledger has one.
pub async fn load(client: &Client, slot: &str) -> Result<Option<Checkpoint>, LedgerError> {
    let row = client
        .query_opt(
            "SELECT slot_name, publication, system_identifier, confirmed_lsn::text,
                    consistent_point::text, snapshot_done
             FROM outbox.checkpoints WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ctx(format!("reading the checkpoint of slot {slot}"))?;
    row.map(|r| {
        Ok(Checkpoint {
            slot_name: r.get(0),
            publication: r.get(1),
            system_identifier: r.get(2),
            confirmed_lsn: lsn_of(r.get(3))?.unwrap_or(Lsn::ZERO),
            consistent_point: lsn_of(r.get(4))?,
            snapshot_done: r.get(5),
        })
    })
    .transpose()
}

/// Records a slot the relay just created. Replaces any older row for the same name (the
/// caller has already decided that is safe: it only creates a slot when asked to).
pub async fn create(
    client: &Client,
    slot: &str,
    publication: &str,
    system_identifier: &str,
    timeline: u32,
    consistent_point: Lsn,
) -> Result<(), LedgerError> {
    client
        .execute(
            // The route policy generation in force at the new slot's start: a run that
            // stops before its first checkpoint moves must not route the rows it read by a
            // generation committed after them (the next run would otherwise take the newest;
            // tests/e2e/plain_insert.rs failed so when its failpoint came before the first
            // checkpoint). A generation committed between the slot's creation and this
            // statement is both in the stream and read here: a window of milliseconds.
            "INSERT INTO outbox.checkpoints (slot_name, publication, system_identifier, timeline,
                                             confirmed_lsn, consistent_point, snapshot_done,
                                             policy_generation)
             VALUES ($1, $2, $3, $4, $5::text::pg_lsn, $5::text::pg_lsn, false,
                     (SELECT max(g.generation_id) FROM outbox.policy_generations g))
             ON CONFLICT (slot_name) DO UPDATE SET
                policy_generation = EXCLUDED.policy_generation,
                publication = EXCLUDED.publication,
                system_identifier = EXCLUDED.system_identifier,
                timeline = EXCLUDED.timeline,
                confirmed_lsn = EXCLUDED.confirmed_lsn,
                consistent_point = EXCLUDED.consistent_point,
                snapshot_done = false,
                updated_at = clock_timestamp()",
            &[
                &slot,
                &publication,
                &system_identifier,
                &(timeline as i32),
                &consistent_point.to_string(),
            ],
        )
        .await
        .ctx(format!("recording the new slot {slot}"))?;
    Ok(())
}

/// The initial snapshot of `slot` has been published and accepted.
pub async fn mark_snapshot_done(client: &Client, slot: &str) -> Result<(), LedgerError> {
    client
        .execute(
            "UPDATE outbox.checkpoints SET snapshot_done = true, updated_at = clock_timestamp()
             WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ctx(format!("marking the snapshot of slot {slot} done"))?;
    Ok(())
}

/// Keeps `record` as the last transaction record `slot` accepted (exactly-once mode,
/// migration 0037), inside the caller's acceptance transaction, which holds the checkpoint
/// row's lock; never lowered within its partition (a slot's records share one partition: a
/// new partition means the positions topic was repartitioned, and the newest record wins).
pub(crate) async fn raise_txn_record_in<C: GenericClient>(
    client: &C,
    slot: &str,
    record: RecordPosition,
) -> Result<(), LedgerError> {
    client
        .execute(
            "UPDATE outbox.checkpoints
             SET txn_record_partition = $2, txn_record_offset = $3
             WHERE slot_name = $1
               AND (txn_record_offset IS NULL OR txn_record_partition <> $2
                    OR txn_record_offset < $3)",
            &[&slot, &record.partition, &record.offset],
        )
        .await
        .ctx(format!(
            "keeping transaction record {}@{} on the checkpoint of slot {slot}",
            record.partition, record.offset
        ))?;
    Ok(())
}

/// The highest commit LSN among the stream rows whose receipts `slot` accepted, in any run
/// (`outbox.accepted_positions`, migration 0034; a receipt without a stream position counts as
/// the WAL's position when it was accepted). A row the stream brings with a later commit LSN
/// has no receipt: exactly-once mode looks receipts up only at or below this.
pub async fn accepted_through<C: GenericClient>(
    client: &C,
    slot: &str,
) -> Result<Option<Lsn>, LedgerError> {
    let row = client
        .query_one(
            "SELECT max(commit_lsn)::text FROM outbox.accepted_positions WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ctx(format!(
            "reading how far slot {slot}'s receipts are accepted"
        ))?;
    lsn_of(row.get(0))
}

/// Where the broker stores the last transaction record `slot` accepted (exactly-once mode):
/// a restart accepts the batches committed after it from their records. `None`: none yet, or
/// the slot has no checkpoint row.
pub async fn last_txn_record<C: GenericClient>(
    client: &C,
    slot: &str,
) -> Result<Option<RecordPosition>, LedgerError> {
    let row = client
        .query_opt(
            "SELECT txn_record_partition, txn_record_offset FROM outbox.checkpoints
             WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ctx(format!(
            "reading the last transaction record of slot {slot}"
        ))?;
    Ok(row.and_then(|r| {
        Some(RecordPosition {
            partition: r.get::<_, Option<i32>>(0)?,
            offset: r.get::<_, Option<i64>>(1)?,
        })
    }))
}

/// Moves the checkpoint forward (never back) inside the caller's transaction. With a fence,
/// only while the fence holds the slot's lease; returns `false` when fenced off. `locked`:
/// the transaction has already read and locked the row (the acceptance's lock,
/// `crate::accept`), so it is not looked for again.
pub async fn advance_in<C: GenericClient>(
    client: &C,
    slot: &str,
    lsn: Lsn,
    fence: Option<&crate::lease::Fence>,
    locked: bool,
) -> Result<bool, LedgerError> {
    let exists = locked
        || client
            .query_opt(
                "SELECT 1 FROM outbox.checkpoints WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .ctx(format!("reading the checkpoint of slot {slot}"))?
            .is_some();
    if !exists {
        return Err(LedgerError::Invalid(format!(
            "slot {slot} has no checkpoint row; the relay must create it before streaming"
        )));
    }
    let (owner, generation) = match fence {
        Some(f) => (Some(f.owner.as_str()), Some(f.generation)),
        None => (None, None),
    };
    let n = client
        .execute(
            "UPDATE outbox.checkpoints
             SET confirmed_lsn = GREATEST(confirmed_lsn, $2::text::pg_lsn),
                 relay_generation = coalesce($4, relay_generation),
                 updated_at = clock_timestamp()
             WHERE slot_name = $1
               AND ($3::text IS NULL OR EXISTS (
                   SELECT 1 FROM outbox.relay_leases l
                   WHERE l.slot_name = $1 AND l.owner = $3 AND l.generation = $4
                     AND l.lease_until > clock_timestamp()))",
            &[&slot, &lsn.to_string(), &owner, &generation],
        )
        .await
        .ctx(format!("advancing the checkpoint of slot {slot} to {lsn}"))?;
    Ok(n == 1)
}
