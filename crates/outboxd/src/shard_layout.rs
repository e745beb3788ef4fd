//! `outboxd migrate --shards N`: lays the outbox out in N shards, or changes their number.
//!
//! A shard is a publication of `outbox.events` with a row filter (`outbox_source::shard`) and
//! the slot of the relay that runs `--shard I/N`. Changing the layout (none → N, N → 2N, ...)
//! never runs two layouts at once: it is refused while a relay of the old layout holds its
//! lease (also one still creating its slot, which has no checkpoint yet) or has a send whose
//! outcome is unknown; then the old slots and publications are
//! dropped and the new publications created. Nothing is lost and no aggregate is reordered:
//! an event the old relays did not publish has no receipt, and the first start of its new
//! shard's relay publishes every such row of the shard, in version order per aggregate, from
//! its initial snapshot. (The old layout's checkpoints stay in the ledger: purge still needs
//! them for the receipts of those slots.)

use anyhow::{bail, Context};
use outbox_source::shard::{self, Shard};

use crate::connect;

/// The layout a publication name belongs to, from the base publication name: `Some(None)`
/// unsharded (the base itself), `Some(Some(n))` a shard of `n`, `None` not this outbox's.
fn layout_of(publication: &str, base: &str) -> Option<Option<u16>> {
    if publication == base {
        return Some(None);
    }
    Some(Some(Shard::from_name(publication, base)?.count))
}

/// Lays the outbox out in `count` shards (publications `<publication>_shard<I>of<N>`).
pub async fn run(url: &str, publication: &str, count: &str) -> anyhow::Result<()> {
    let count = shard::parse_count(count).map_err(|e| anyhow::anyhow!("--shards: {e}"))?;
    let client = connect(url).await?;
    // The slots of other layouts, from the ledger (every relay's checkpoint names its
    // publication).
    let rows = client
        .query(
            "SELECT c.slot_name, c.publication,
                    coalesce(l.lease_until > clock_timestamp(), false),
                    (SELECT count(*) FROM outbox.attempts a
                     WHERE a.slot_name = c.slot_name AND a.state = 'DISPATCH_UNKNOWN')
             FROM outbox.checkpoints c
             LEFT JOIN outbox.relay_leases l ON l.slot_name = c.slot_name
             ORDER BY c.slot_name",
            &[],
        )
        .await
        .context("reading the relays' checkpoints and leases")?;
    // A relay still creating its slot holds its lease but has no checkpoint yet, so the
    // ledger does not say which layout it runs: creating a slot waits for every transaction
    // running in the cluster to end, which can take long (CI, 2026-12-07: a shard relay of the
    // old layout sat in it while the layout changed, and the change went ahead). Such a relay
    // is refused like a running one. (One that holds its lease and has not begun creating its
    // slot is not seen here: stopping the old layout's relays first is what the refusal asks.)
    let starting = client
        .query(
            "SELECT l.slot_name, l.owner FROM outbox.relay_leases l
             JOIN pg_replication_slots s
               ON s.slot_name = l.slot_name AND s.database = current_database()
             WHERE l.lease_until > clock_timestamp()
               AND NOT EXISTS (SELECT 1 FROM outbox.checkpoints c WHERE c.slot_name = l.slot_name)
             ORDER BY l.slot_name",
            &[],
        )
        .await
        .context("reading the leases of relays that are starting")?;
    if let Some(r) = starting.first() {
        let (slot, owner): (String, String) = (r.get(0), r.get(1));
        bail!(
            "slot {slot} is being started by relay {owner} (its lease is live and it has no checkpoint yet, so its layout is not known): stop every relay of the old layout first (SIGTERM), then run this again"
        );
    }
    let mut old = Vec::new();
    for r in &rows {
        let (slot, publication_of_slot): (String, String) = (r.get(0), r.get(1));
        let Some(layout) = layout_of(&publication_of_slot, publication) else {
            continue;
        };
        if layout == Some(count) {
            continue;
        }
        if r.get::<_, bool>(2) {
            bail!(
                "slot {slot} (publication {publication_of_slot}) is held by a running relay: stop every relay of the old layout first (SIGTERM: it drains and confirms), then run this again. Whatever they have not published is published by the new shards' relays"
            );
        }
        let unknown: i64 = r.get(3);
        if unknown > 0 {
            bail!(
                "slot {slot} has {unknown} send(s) whose outcome is unknown (DISPATCH_UNKNOWN): start its relay once more so that it reconciles them (outboxd status --json lists them), stop it, then run this again"
            );
        }
        old.push((slot, publication_of_slot));
    }
    for s in Shard::all(count) {
        outbox_source::slot::ensure_shard_publication(
            &client,
            &s.name(publication),
            "outbox",
            "events",
            Some(s),
        )
        .await
        .with_context(|| format!("creating the publication of shard {s}"))?;
    }
    for (slot, publication_of_slot) in &old {
        outbox_source::slot::drop_slot(&client, slot)
            .await
            .with_context(|| format!("dropping slot {slot} of the old layout"))?;
        client
            .batch_execute(&format!(
                "DROP PUBLICATION IF EXISTS {}",
                outbox_source::slot::quote_ident(publication_of_slot)
            ))
            .await
            .with_context(|| format!("dropping publication {publication_of_slot}"))?;
        println!("dropped slot {slot} and publication {publication_of_slot} of the old layout");
    }
    println!(
        "the outbox is laid out in {count} shard(s): publications {}; run one `outboxd run --shard I/{count}` per shard (I = 0..{})",
        Shard::all(count)
            .map(|s| s.name(publication))
            .collect::<Vec<_>>()
            .join(", "),
        count - 1
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publications_are_placed_in_their_layout() {
        assert_eq!(layout_of("outbox_pub", "outbox_pub"), Some(None));
        assert_eq!(
            layout_of("outbox_pub_shard3of8", "outbox_pub"),
            Some(Some(8))
        );
        assert_eq!(layout_of("outbox_pub_shard8of8", "outbox_pub"), None);
        assert_eq!(layout_of("other_pub", "outbox_pub"), None);
        assert_eq!(layout_of("outbox_pub_shard1of3", "outbox_pub"), None);
    }
}
