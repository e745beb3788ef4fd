//! Relay leases: high availability without a coordinator.
//!
//! A relay acquires its slot's lease by compare-and-set: the row is taken only if it is free,
//! expired, or already ours. Each acquisition bumps the generation, so a relay that paused
//! (GC, SIGSTOP, a long network partition) and came back finds its generation stale: the
//! checkpoint update in the acceptance transaction is fenced by `(owner, generation,
//! lease_until > now())`, and the relay stops sending as soon as its own lease deadline has
//! passed by its monotonic clock.

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
    Acquired { generation: i64 },
    HeldBy { owner: String, remaining: Duration },
}

fn ttl_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
}

/// Tries to take the lease of `slot` for `owner`.
pub async fn try_acquire(
    client: &Client,
    slot: &str,
    owner: &str,
    ttl: Duration,
) -> Result<Acquire, LedgerError> {
    let row = client
        .query_opt(
            "INSERT INTO outbox.relay_leases AS l (slot_name, owner, generation, lease_until)
             VALUES ($1, $2, 1, clock_timestamp() + $3 * interval '1 millisecond')
             ON CONFLICT (slot_name) DO UPDATE SET
                 owner = EXCLUDED.owner,
                 generation = l.generation + 1,
                 lease_until = EXCLUDED.lease_until,
                 acquired_at = clock_timestamp()
             WHERE l.lease_until < clock_timestamp() OR l.owner = EXCLUDED.owner
             RETURNING generation",
            &[&slot, &owner, &(ttl_ms(ttl) as f64)],
        )
        .await
        .ctx(format!("acquiring the lease of slot {slot}"))?;
    if let Some(r) = row {
        return Ok(Acquire::Acquired {
            generation: r.get(0),
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
