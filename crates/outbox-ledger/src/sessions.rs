//! A run's database sessions, as the next holder of the slot's lease finds them.
//!
//! A relay run's sessions that can hold the slot's ledger locks (its SQL and acceptance
//! connections) carry an `application_name` naming the slot and the lease generation
//! ([`name_session`]). A run that takes the lease over ends the sessions of earlier
//! generations that are still inside a transaction ([`end_stale_sessions`]), and a walsender
//! that still holds the slot ([`terminate_if_leased`]); each in a statement that checks the
//! lease itself, so that a relay paused past its lease and resumed can never end the sessions
//! of the relay that took over.

use std::time::Duration;

use tokio_postgres::Client;

use crate::lease::Fence;
use crate::LedgerError;

/// The `application_name` of a run's sessions is this SQL expression followed by the
/// generation: `outboxd <12 hex digits of md5(slot)> g<generation>`, short enough for any slot
/// name. `$1` the slot.
const SESSION_PREFIX: &str = "'outboxd ' || left(md5($1::text), 12) || ' g'";

/// How long one of the relay's acceptance sessions may sit idle inside a transaction before
/// the server ends it: the lease TTL, and never less than 10 s. A live relay never comes near
/// it (an acceptance takes milliseconds); a relay stopped between two statements of one (see
/// [`end_stale_sessions`]) has its transaction rolled back within this time even when nobody
/// takes its lease over, so it does not hold up, for as long as it is stopped, the creation of
/// every logical slot on the server (which waits for all running transactions).
pub fn acceptance_session_limit(lease_ttl: Duration) -> Duration {
    lease_ttl.max(Duration::from_secs(10))
}

fn db(context: String) -> impl FnOnce(tokio_postgres::Error) -> LedgerError {
    move |source| LedgerError::Db { context, source }
}

/// Names `client`'s session as one of the run of `slot` under `fence` ([`SESSION_PREFIX`]).
pub async fn name_session(client: &Client, slot: &str, fence: &Fence) -> Result<(), LedgerError> {
    client
        .query_one(
            &format!(
                "SELECT set_config('application_name', {SESSION_PREFIX} || $2::bigint, false)"
            ),
            &[&slot, &fence.generation],
        )
        .await
        .map_err(db(format!("naming a session of slot {slot}'s relay")))?;
    Ok(())
}

/// Makes `client` an acceptance session of the run of `slot` under `fence`: named
/// ([`name_session`]), with [`acceptance_session_limit`] as its
/// `idle_in_transaction_session_timeout`.
pub async fn make_acceptance_session(
    client: &Client,
    lease_ttl: Duration,
    slot: &str,
    fence: &Fence,
) -> Result<(), LedgerError> {
    name_session(client, slot, fence).await?;
    let ms = acceptance_session_limit(lease_ttl).as_millis();
    client
        .batch_execute(&format!("SET idle_in_transaction_session_timeout = {ms}"))
        .await
        .map_err(db(
            "limiting the acceptance session (idle_in_transaction_session_timeout)".into(),
        ))
}

/// At the start of a run that holds the lease: ends every session of an earlier generation of
/// `slot`'s relays ([`SESSION_PREFIX`]) that is inside a transaction, checking the lease in
/// the same statement. Idle ones hold nothing and are left alone: a paused relay that resumes
/// records its late delivery reports through them (as duplicate receipts). Returns how many
/// were ended.
///
/// An acceptance transaction locks the slot's checkpoint row and holds a transaction id until
/// it ends. A relay stopped inside one (SIGSTOP, a frozen VM, a debugger, a fleet member's
/// shard relay aborted mid-way) keeps both for as long as it is stopped, and the server cannot
/// tell a stopped client from a slow one: in the middle of a `COPY` of receipts it waits for
/// the client's data, where neither `statement_timeout` nor the idle limit applies. This run
/// would then wait on that row lock (its start folds the numbering under it, its acceptances
/// take it), and every logical slot created on the server would wait for the transaction.
/// The stale session's lease is gone; ending it rolls its transaction back, and nothing it
/// had not committed was evidence (this run publishes those events again from the checkpoint).
/// Found by the fleet e2e test: a paused member's `COPY` held two shards for 90 s.
pub async fn end_stale_sessions(
    sql: &Client,
    slot: &str,
    fence: &Fence,
) -> Result<i64, LedgerError> {
    let ended: i64 = sql
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid))
                 FROM pg_stat_activity a
                 WHERE a.application_name LIKE {SESSION_PREFIX} || '%'
                   AND a.application_name <> {SESSION_PREFIX} || $2::bigint
                   AND a.xact_start IS NOT NULL
                   AND a.pid <> pg_backend_pid()
                   AND EXISTS (SELECT 1 FROM outbox.relay_leases l
                               WHERE l.slot_name = $1 AND l.generation = $2 AND l.owner = $3
                                 AND l.lease_until > clock_timestamp())"
            ),
            &[&slot, &fence.generation, &fence.owner],
        )
        .await
        .map_err(db(format!(
            "ending the sessions of slot {slot}'s earlier relays"
        )))?
        .get(0);
    Ok(ended)
}

/// Terminates the walsender `pid` that still holds `slot` (a relay's whose lease expired, e.g.
/// one that is paused), if `fence` still holds the slot's lease: the check and the
/// termination are one statement, so a relay paused past its lease and resumed (found by the
/// e2e zombie test) never cuts off the walsender of the relay that took the lease over.
/// `Err(LeaseLost)` when the lease is not ours.
pub async fn terminate_if_leased(
    sql: &Client,
    slot: &str,
    pid: i32,
    fence: &Fence,
) -> Result<(), LedgerError> {
    let leased = sql
        .query_opt(
            "SELECT pg_terminate_backend($1) FROM outbox.relay_leases
             WHERE slot_name = $2 AND owner = $3 AND generation = $4
               AND lease_until > clock_timestamp()",
            &[&pid, &slot, &fence.owner, &fence.generation],
        )
        .await
        .map_err(db(format!("terminating walsender {pid}")))?;
    match leased {
        Some(_) => Ok(()),
        None => Err(LedgerError::LeaseLost {
            slot: slot.to_string(),
            generation: fence.generation,
        }),
    }
}
