//! The relay's numbering of rows written without a version, kept with the checkpoint
//! (migration 0039, docs/versions_by_relay.md).
//!
//! A row inserted plainly (no `outbox.enqueue`) has no aggregate version; the relay gives it
//! its aggregate's last version + 1 in the stream's (commit) order
//! (`outbox_core::numbering`). A run streams from its slot's checkpoint C, so a restart needs,
//! per aggregate, the version of its last row committed before C: the acceptance transaction
//! that moves the checkpoint writes exactly that ([`Numbered`], through
//! [`crate::accept::accept_numbered_batch`]), and a run reads it for the aggregates it meets
//! ([`versions_of`]). Written only when the checkpoint moves: a fenced run (a paused relay's
//! salvage) keeps its receipts but writes neither, so the numbering and the checkpoint it
//! belongs to never part. Versions only rise, so a write for an older checkpoint cannot lower
//! what a newer one wrote.
//!
//! The policy generation in force at the checkpoint (migration 0038) is written with it, on
//! the checkpoint row: a restart routes rows without a route version by that generation until
//! the stream delivers the next.

use tokio_postgres::{Client, GenericClient};

use crate::{Context, LedgerError};

/// What a checkpoint's acceptance writes besides the checkpoint: the numbering up to it and
/// the policy generation in force there, as the relay core computes it.
pub type Numbered = outbox_core::numbering::NumberedThrough<(String, String)>;

/// Writes `numbered` for `slot`, whose checkpoint this transaction has just moved to
/// `through` (the caller's transaction, after the checkpoint's own update): one row of the
/// numbering's log. `numbered.fold` is for the caller to act on after the commit ([`fold`]):
/// folded inside the acceptance, a log of two million entries held that transaction, and
/// every receipt behind it, for 1.4 s (a steady phase's p99 of 909 ms, docs/benchmarks.md).
pub(crate) async fn write_in<C: GenericClient>(
    client: &C,
    slot: &str,
    through: outbox_core::Lsn,
    numbered: &Numbered,
) -> Result<(), LedgerError> {
    if !numbered.versions.is_empty() {
        let n = numbered.versions.len();
        let (mut types, mut ids, mut versions) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for ((t, i), v) in &numbered.versions {
            types.push(t.as_str());
            ids.push(i.as_str());
            versions.push(*v);
        }
        client
            .execute(
                "INSERT INTO outbox.stream_version_log
                     (slot_name, checkpoint_lsn, aggregate_types, aggregate_ids, versions)
                 VALUES ($1, $2::text::pg_lsn, $3, $4, $5)",
                &[&slot, &through.to_string(), &types, &ids, &versions],
            )
            .await
            .ctx(format!(
                "logging the numbering of {n} aggregates of slot {slot} at checkpoint {through}"
            ))?;
    }
    if let Some(generation) = numbered.policy_generation {
        // Only where the checkpoint stands at `through`: a checkpoint already past it (it
        // never moves back) keeps the generation written with it.
        client
            .execute(
                "UPDATE outbox.checkpoints SET policy_generation = $2
                 WHERE slot_name = $1 AND confirmed_lsn = $3::text::pg_lsn",
                &[&slot, &generation, &through.to_string()],
            )
            .await
            .ctx(format!(
                "keeping policy generation {generation} with checkpoint {through} of slot {slot}"
            ))?;
    }
    Ok(())
}

/// Folds `slot`'s numbering log into its map (`outbox.stream_versions`): per aggregate the
/// highest version logged, raised into the map, never lowered; the log rows folded are
/// deleted. Returns how many aggregates it raised or added. Rows inserted by transactions
/// that commit after this statement's snapshot stay in the log for the next fold.
///
/// A running relay calls it on a connection of its own, beside its acceptances, when the
/// core says the log is due (`outbox_core::numbering::Numbering::logged`); a run's start
/// calls it under the checkpoint row's lock ([`fold_at_start`]). Safe at any moment: the map
/// only rises, and a reader reads it only after the fold at its start.
pub async fn fold<C: GenericClient>(client: &C, slot: &str) -> Result<u64, LedgerError> {
    // In key order, so that two folds of one slot (a run's and the next run's start) take
    // the map's row locks in the same order and cannot deadlock.
    client
        .execute(
            "WITH folded AS (
                 DELETE FROM outbox.stream_version_log WHERE slot_name = $1
                 RETURNING aggregate_types, aggregate_ids, versions
             )
             INSERT INTO outbox.stream_versions AS s
                 (slot_name, aggregate_type, aggregate_id, version)
             SELECT $1, u.t, u.i, max(u.v)
             FROM folded, unnest(aggregate_types, aggregate_ids, versions) AS u(t, i, v)
             GROUP BY u.t, u.i
             ORDER BY u.t, u.i
             ON CONFLICT (slot_name, aggregate_type, aggregate_id)
             DO UPDATE SET version = EXCLUDED.version WHERE s.version < EXCLUDED.version",
            &[&slot],
        )
        .await
        .ctx(format!("folding the numbering log of slot {slot}"))
}

/// A run's start, once it holds `slot`'s lease and before it reads any numbering: locks the
/// slot's checkpoint row (every acceptance that moves the checkpoint locks it first, so an
/// acceptance of a run that lost the lease either committed before this, and its log row is
/// folded, or comes after it and finds itself fenced, writing nothing) and folds the log into
/// the map. Fails with [`LedgerError::CheckpointMoved`] when the checkpoint is past `start`,
/// where the run planned to stream from: a run that lost the lease committed a last
/// acceptance after the plan was read, and the numbering folded now belongs to the later
/// checkpoint; the run restarts from it. Returns the aggregates folded.
pub async fn fold_at_start(
    client: &mut Client,
    slot: &str,
    start: outbox_core::Lsn,
) -> Result<u64, LedgerError> {
    let tx = client
        .transaction()
        .await
        .ctx("beginning the numbering's fold at start")?;
    let row = tx
        .query_opt(
            "SELECT confirmed_lsn::text FROM outbox.checkpoints WHERE slot_name = $1 FOR UPDATE",
            &[&slot],
        )
        .await
        .ctx(format!("locking the checkpoint of slot {slot}"))?;
    if let Some(checkpoint) = row.and_then(|r| r.get::<_, Option<String>>(0)) {
        let checkpoint: outbox_core::Lsn = checkpoint.parse().map_err(|e| {
            LedgerError::Invalid(format!(
                "slot {slot}'s checkpoint {checkpoint:?} is no LSN: {e}"
            ))
        })?;
        if checkpoint > start {
            return Err(LedgerError::CheckpointMoved {
                slot: slot.to_string(),
                start,
                checkpoint,
            });
        }
    }
    let folded = fold(&tx, slot).await?;
    tx.commit()
        .await
        .ctx(format!("committing the numbering's fold of slot {slot}"))?;
    Ok(folded)
}

/// For each of `keys` (aggregate type, aggregate id), the version of its last row the
/// relay numbered before `slot`'s checkpoint, as folded into the map; 0 for an aggregate the
/// slot never numbered. In the order of `keys`. Only the map is read: a run folds the log at
/// its start ([`fold_at_start`]), and what it logs itself is of aggregates it numbers.
///
/// Or, where higher, the highest version written with the rows (kept or purged): an aggregate
/// written through `outbox.enqueue` before its outbox took plain INSERTs continues after its
/// versions (migration 0043). `outbox.allow_plain_inserts(true)` waits for every transaction
/// that wrote to the outbox, so those rows all commit before the first row without a version;
/// an aggregate still written both ways afterwards is not numbered by this rule
/// (docs/versions_by_relay.md). Each table is probed only when it has such a row at all
/// (checked once per statement, in the order of the index that holds them: an `EXISTS`
/// could be planned as a scan of the whole outbox), so an outbox written plainly from the
/// start pays no probe.
pub async fn versions_of(
    client: &Client,
    slot: &str,
    keys: &[(String, String)],
) -> Result<Vec<i64>, LedgerError> {
    let types: Vec<&str> = keys.iter().map(|(t, _)| t.as_str()).collect();
    let ids: Vec<&str> = keys.iter().map(|(_, i)| i.as_str()).collect();
    let rows = client
        .query(
            // One probe of the map's key per aggregate, whatever the planner estimates: as a
            // join, a map without statistics (or a large batch) got a hash join over the
            // slot's whole map for every batch, ~10 us per aggregate asked at 100,000
            // aggregates against ~1.7 for the probes (docs/benchmarks.md, "The numbering's
            // read").
            "SELECT greatest(
                 coalesce((SELECT s.version FROM outbox.stream_versions s
                           WHERE s.slot_name = $1 AND s.aggregate_type = k.t
                             AND s.aggregate_id = k.i), 0),
                 CASE WHEN (SELECT e.aggregate_type FROM outbox.events e
                            WHERE e.delivery_set_id IS NULL AND e.aggregate_version IS NOT NULL
                            ORDER BY e.aggregate_type LIMIT 1) IS NOT NULL
                      THEN (SELECT max(e.aggregate_version) FROM outbox.events e
                            WHERE e.delivery_set_id IS NULL AND e.aggregate_version IS NOT NULL
                              AND e.aggregate_type = k.t AND e.aggregate_id = k.i) END,
                 CASE WHEN (SELECT e.delivery_set_id FROM outbox.events e
                            WHERE e.delivery_set_id IS NOT NULL
                            ORDER BY e.delivery_set_id LIMIT 1) IS NOT NULL
                      THEN (SELECT max(e.aggregate_version) FROM outbox.events e
                            WHERE e.delivery_set_id IS NOT NULL
                              AND e.aggregate_type = k.t AND e.aggregate_id = k.i) END,
                 CASE WHEN (SELECT p.event_id FROM outbox.purged_events p
                            ORDER BY p.event_id LIMIT 1) IS NOT NULL
                      THEN (SELECT max(p.aggregate_version) FROM outbox.purged_events p
                            WHERE p.aggregate_type = k.t AND p.aggregate_id = k.i) END)
             FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS k(t, i, n)
             ORDER BY k.n",
            &[&slot, &types, &ids],
        )
        .await
        .ctx(format!(
            "reading the numbering of {} aggregates of slot {slot}",
            keys.len()
        ))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Whether `table` (a qualified, quoted name; `outbox.events` by default) takes rows written
/// without a version (`outbox.allow_plain_inserts(true)`, migration 0039); `None` when there
/// is no such table. What poll mode, `outboxd check` and a new slot each ask.
pub async fn plain_inserts_allowed<C: GenericClient>(
    client: &C,
    table: &str,
) -> Result<Option<bool>, LedgerError> {
    let row = client
        .query_opt(
            "SELECT NOT attnotnull FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attname = 'aggregate_version'",
            &[&table],
        )
        .await
        .ctx(format!(
            "reading whether {table} takes rows without a version"
        ))?;
    Ok(row.map(|r| r.get(0)))
}

/// Whether `table` (quoted) takes rows without a version ([`plain_inserts_allowed`]) and
/// holds one now: rows a slot new to the ledger cannot number (a new slot's numbering starts
/// empty, and a snapshot reads no commit order).
pub async fn holds_plain_rows<C: GenericClient>(
    client: &C,
    table: &str,
) -> Result<bool, LedgerError> {
    if plain_inserts_allowed(client, table).await? != Some(true) {
        return Ok(false);
    }
    let row = client
        .query_opt(
            &format!("SELECT 1 FROM {table} WHERE aggregate_version IS NULL LIMIT 1"),
            &[],
        )
        .await
        .ctx(format!(
            "reading whether {table} holds rows without a version"
        ))?;
    Ok(row.is_some())
}

/// The route policy generation kept with `slot`'s checkpoint (`None`: no checkpoint row, or
/// none written yet).
pub async fn policy_generation(client: &Client, slot: &str) -> Result<Option<i64>, LedgerError> {
    let row = client
        .query_opt(
            "SELECT policy_generation FROM outbox.checkpoints WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ctx(format!("reading the policy generation of slot {slot}"))?;
    Ok(row.and_then(|r| r.get(0)))
}
