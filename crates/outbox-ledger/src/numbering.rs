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
/// `through` (the caller's transaction, after the checkpoint's own update).
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
                "INSERT INTO outbox.stream_versions AS s
                     (slot_name, aggregate_type, aggregate_id, version)
                 SELECT $1, t, i, v FROM unnest($2::text[], $3::text[], $4::int8[]) AS u(t, i, v)
                 ON CONFLICT (slot_name, aggregate_type, aggregate_id)
                 DO UPDATE SET version = GREATEST(s.version, EXCLUDED.version)",
                &[&slot, &types, &ids, &versions],
            )
            .await
            .ctx(format!(
                "writing the numbering of {n} aggregates of slot {slot} at checkpoint {through}"
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

/// For each of `keys` (aggregate type, aggregate id), the version of its last row the
/// relay numbered before `slot`'s checkpoint; 0 for an aggregate the slot never numbered.
/// In the order of `keys`.
pub async fn versions_of(
    client: &Client,
    slot: &str,
    keys: &[(String, String)],
) -> Result<Vec<i64>, LedgerError> {
    let types: Vec<&str> = keys.iter().map(|(t, _)| t.as_str()).collect();
    let ids: Vec<&str> = keys.iter().map(|(_, i)| i.as_str()).collect();
    let rows = client
        .query(
            "SELECT coalesce(s.version, 0)
             FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS k(t, i, n)
             LEFT JOIN outbox.stream_versions s
               ON s.slot_name = $1 AND s.aggregate_type = k.t AND s.aggregate_id = k.i
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
