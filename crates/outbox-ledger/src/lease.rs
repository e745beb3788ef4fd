//! Relay leases: high availability without a coordinator.
//!
//! A relay acquires its slot's lease by compare-and-set: the row is taken only if it is free,
//! expired, or already ours. Each acquisition bumps the generation, so a relay that paused
//! (GC, SIGSTOP, a long network partition) and came back finds its generation stale: the
//! checkpoint update in the acceptance transaction is fenced by `(owner, generation,
//! lease_until > now())`, and the relay stops sending as soon as its own lease deadline has
//! passed by its monotonic clock.
//!
//! A lease is taken before it expires only when its holder is provably gone (migration 0018):
//! the holder keeps a session advisory lock on the connection it renews with, so a free lock
//! means its session ended, and in CDC mode its slot has no walsender either. A SIGKILLed
//! relay's successor streams within a second instead of waiting out the lease; a paused one
//! keeps both and its lease until it expires.

use std::time::Duration;

use tokio_postgres::Client;

use crate::{Context, LedgerError};

/// The relay's identity and generation, for fencing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub owner: String,
    pub generation: i64,
}

/// The outcome of an acquisition attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Acquire {
    /// Ours, with this generation; `early`: taken from a holder that was provably gone before
    /// its lease expired.
    Acquired {
        generation: i64,
        early: bool,
    },
    HeldBy {
        owner: String,
        remaining: Duration,
    },
}

fn ttl_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
}

/// The advisory lock class of lease sessions ("outb"); the key is the hash of the lease name.
/// Two names with the same hash only make an early takeover impossible, never wrong: the
/// second relay cannot take the lock, so its lease is taken only when it expires.
const LOCK_CLASS: i32 = 0x6f75_7462;

/// Takes the session advisory lock of lease `slot` on this connection, if it is free. The
/// relay holds it, on the connection it renews with, for as long as it holds the lease: a
/// free lock means no live session of the holder (migration 0018).
pub async fn try_lock(client: &Client, slot: &str) -> Result<bool, LedgerError> {
    Ok(client
        .query_one(
            "SELECT pg_try_advisory_lock($1, hashtext('outboxd.lease:' || $2))",
            &[&LOCK_CLASS, &slot],
        )
        .await
        .ctx(format!("taking the session lock of lease {slot}"))?
        .get(0))
}

/// The name of fleet member `relay_id`'s session lock (taken with [`try_lock`]): slot names
/// hold no `:`, so it never names a lease.
pub fn member_lock(relay_id: &str) -> String {
    format!("member:{relay_id}")
}

/// The fleet members seen within `ttl` whose session lock (see [`member_lock`]) is held: a
/// member whose process died has lost its lock the moment its connection closed, so it is
/// gone at once, not when its row ages out. `me` is always a member.
pub async fn live_members(
    client: &Client,
    me: &str,
    ttl: Duration,
) -> Result<Vec<String>, LedgerError> {
    let rows = client
        .query(
            "SELECT relay_id FROM outbox.relay_members m
             WHERE m.relay_id = $3
                OR (m.seen_at > clock_timestamp() - $1 * interval '1 millisecond'
                    AND EXISTS (SELECT 1 FROM pg_locks l
                                WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
                                  AND l.classid::int8 = $2::int8
                                  AND l.objid::int8 = (hashtext('outboxd.lease:member:' || m.relay_id)::int8 & 4294967295)))",
            &[&(ttl_ms(ttl) as f64), &i64::from(LOCK_CLASS), &me],
        )
        .await
        .ctx("reading the fleet's live members")?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Fleet member `relay_id` is alive now (its row in `outbox.relay_members`, migration 0019).
pub async fn member_seen(client: &Client, relay_id: &str) -> Result<(), LedgerError> {
    client
        .execute(
            "INSERT INTO outbox.relay_members (relay_id) VALUES ($1)
             ON CONFLICT (relay_id) DO UPDATE SET seen_at = clock_timestamp()",
            &[&relay_id],
        )
        .await
        .ctx(format!("writing fleet member {relay_id}'s row"))?;
    Ok(())
}

/// Fleet member `relay_id` leaves: its row is deleted (its leases are given back by its
/// relays' stops).
pub async fn member_left(client: &Client, relay_id: &str) -> Result<(), LedgerError> {
    client
        .execute(
            "DELETE FROM outbox.relay_members WHERE relay_id = $1",
            &[&relay_id],
        )
        .await
        .ctx(format!("deleting fleet member {relay_id}'s row"))?;
    Ok(())
}

/// Of the leases of `slots`, those not expired: (slot, holder).
pub async fn holders(
    client: &Client,
    slots: &[String],
) -> Result<Vec<(String, String)>, LedgerError> {
    let rows = client
        .query(
            "SELECT slot_name, owner FROM outbox.relay_leases
             WHERE slot_name = ANY($1) AND lease_until > clock_timestamp()",
            &[&slots],
        )
        .await
        .ctx("reading the shards' leases")?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Gives the session lock of lease `slot` back (a standby that could not take the lease).
pub async fn unlock(client: &Client, slot: &str) -> Result<(), LedgerError> {
    client
        .execute(
            "SELECT pg_advisory_unlock($1, hashtext('outboxd.lease:' || $2))",
            &[&LOCK_CLASS, &slot],
        )
        .await
        .ctx(format!("giving back the session lock of lease {slot}"))?;
    Ok(())
}

/// Tries to take the lease of `slot` for `owner`: free, expired, already ours, or — when
/// `locked` (this connection holds the lease's session lock, see [`try_lock`]) — held by a
/// relay that took the lock too and whose slot has no walsender: that holder is gone, and the
/// lease is taken at once instead of at its expiry (migration 0018). The statement is
/// `outbox_core::lease::take` in SQL (the rule the simulator decides with); the test
/// `a_lease_is_taken_as_the_rule_says` holds the two together.
pub async fn try_acquire(
    client: &Client,
    slot: &str,
    owner: &str,
    ttl: Duration,
    locked: bool,
) -> Result<Acquire, LedgerError> {
    let row = client
        .query_opt(
            "WITH before AS (
                 SELECT lease_until > clock_timestamp() AND owner <> $2 AS live
                 FROM outbox.relay_leases WHERE slot_name = $1),
             taken AS (
                 INSERT INTO outbox.relay_leases AS l (slot_name, owner, generation, lease_until, holder_locks)
                 VALUES ($1, $2, 1, clock_timestamp() + $3 * interval '1 millisecond', $4)
                 ON CONFLICT (slot_name) DO UPDATE SET
                     owner = EXCLUDED.owner,
                     generation = l.generation + 1,
                     lease_until = EXCLUDED.lease_until,
                     holder_locks = EXCLUDED.holder_locks,
                     acquired_at = clock_timestamp()
                 WHERE l.lease_until < clock_timestamp() OR l.owner = EXCLUDED.owner
                    OR ($4 AND l.holder_locks
                        AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s
                                        WHERE s.slot_name = $1 AND s.active))
                 RETURNING generation)
             SELECT generation, coalesce((SELECT live FROM before), false) FROM taken",
            &[&slot, &owner, &(ttl_ms(ttl) as f64), &locked],
        )
        .await
        .ctx(format!("acquiring the lease of slot {slot}"))?;
    if let Some(r) = row {
        return Ok(Acquire::Acquired {
            generation: r.get(0),
            early: r.get(1),
        });
    }
    let r = client
        .query_one(
            "SELECT owner, greatest(0, extract(epoch FROM lease_until - clock_timestamp()))::float8
             FROM outbox.relay_leases WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ctx(format!("reading the lease of slot {slot}"))?;
    Ok(Acquire::HeldBy {
        owner: r.get(0),
        remaining: Duration::from_secs_f64(r.get::<_, f64>(1)),
    })
}

/// Gives back `owner`'s lease of `slot`, whatever its generation: for a fleet member whose
/// shard relay it aborted (its stop hung), so that another member takes the shard now rather
/// than when the lease expires. The generation stays: whatever the aborted relay still had in
/// flight is fenced as a paused holder's is (the checkpoint's fence needs an unexpired lease).
pub async fn release_aborted(client: &Client, slot: &str, owner: &str) -> Result<(), LedgerError> {
    client
        .execute(
            "UPDATE outbox.relay_leases SET lease_until = clock_timestamp()
             WHERE slot_name = $1 AND owner = $2 AND lease_until > clock_timestamp()",
            &[&slot, &owner],
        )
        .await
        .ctx(format!(
            "giving back the lease of slot {slot} after aborting its relay"
        ))?;
    Ok(())
}

/// Records that the holder of `fence` took the lease's session lock after it took the lease
/// (the lock was still held by an earlier holder's session then): its lease may now be taken
/// early if it dies.
pub async fn mark_locked(client: &Client, slot: &str, fence: &Fence) -> Result<(), LedgerError> {
    client
        .execute(
            "UPDATE outbox.relay_leases SET holder_locks = true
             WHERE slot_name = $1 AND owner = $2 AND generation = $3",
            &[&slot, &fence.owner, &fence.generation],
        )
        .await
        .ctx(format!("recording the session lock of lease {slot}"))?;
    Ok(())
}

/// Extends our lease. `false`: we no longer hold it (another relay took over).
pub async fn renew(
    client: &Client,
    slot: &str,
    fence: &Fence,
    ttl: Duration,
) -> Result<bool, LedgerError> {
    let n = client
        .execute(
            "UPDATE outbox.relay_leases
             SET lease_until = clock_timestamp() + $4 * interval '1 millisecond'
             WHERE slot_name = $1 AND owner = $2 AND generation = $3
               AND lease_until > clock_timestamp()",
            &[
                &slot,
                &fence.owner,
                &fence.generation,
                &(ttl_ms(ttl) as f64),
            ],
        )
        .await
        .ctx(format!("renewing the lease of slot {slot}"))?;
    Ok(n == 1)
}

/// Gives the lease up at once (graceful stop), so a standby need not wait for expiry.
pub async fn release(client: &Client, slot: &str, fence: &Fence) -> Result<(), LedgerError> {
    client
        .execute(
            "UPDATE outbox.relay_leases SET lease_until = clock_timestamp()
             WHERE slot_name = $1 AND owner = $2 AND generation = $3",
            &[&slot, &fence.owner, &fence.generation],
        )
        .await
        .ctx(format!("releasing the lease of slot {slot}"))?;
    Ok(())
}
