//! Rows held back until their aggregates' heads are known (migration 0026).
//!
//! The ordering gate needs each aggregate's last accepted version before it admits the
//! aggregate's first event of a run. The ledger no longer keeps every head ready (that cost
//! the primary an upsert per event); it answers for many aggregates in one query
//! (`outbox.aggregate_heads_of`). So a decoded row of an aggregate the core does not know is
//! not handed to the core at once: it is staged, and everything decoded after it (Begin, rows,
//! Commit, keepalives keep their order), up to [`STAGE_ROWS`] rows or [`STAGE_BYTES`] of
//! payload; then the driver reads the heads of [`PipelineCore::unknown_aggregates`] of
//! [`Stage::events`] in one look-up, raises them ([`PipelineCore::raise_heads`]), and hands the
//! staged messages to the core in the order they came. A relay that knows its aggregates
//! stages nothing.
//!
//! When to look up is the driver's: the daemon's stream loop stages while more messages are
//! already waiting on the socket (one query per burst, not per row); the simulator looks up at
//! the end of each transaction it decodes. Either way [`Stage::offer`] decides what is held.

use outbox_core::{Lsn, OutboxEvent};

use crate::pipeline::{Command, CoreError, Now, PipelineCore, Plant};

/// Rows staged before a look-up at most: one query per this many rows in a drain over many
/// new aggregates.
pub const STAGE_ROWS: usize = 2_000;

/// Payload bytes staged before a look-up at most (the relay's memory stays bounded whatever
/// the payloads).
pub const STAGE_BYTES: usize = 4 << 20;

/// A decoded message of the stream, as the core takes it.
#[derive(Debug)]
pub enum Staged {
    Begin(Lsn),
    /// A row (boxed: a row is rare next to the other messages' size) and the LSN of its
    /// change record, the `XLogData` start the walsender sent it with: with the Begin's
    /// commit LSN its stream position (`outbox_core::receipt::StreamPosition`).
    Row(Box<Result<OutboxEvent, String>>, Lsn),
    Commit(Lsn),
    /// A route policy generation of the open transaction (migration 0038).
    PolicyGeneration(i64),
    Keepalive {
        wal_end: Lsn,
        reply_requested: bool,
    },
}

/// What the core made of one message ([`PipelineCore::take`]).
#[derive(Debug, Default)]
pub struct Taken {
    /// What to send (a row admitted, or what it freed).
    pub commands: Vec<Command>,
    /// The server asked for a reply (a keepalive with `reply_requested`): the loop sends a
    /// standby status at once (`crate::schedule::Schedule::status_requested`).
    pub reply_requested: bool,
}

impl<P: Plant> PipelineCore<P> {
    /// One message of the stream, in the order it came (after the stage, if it was held), to
    /// the part of the core it is for: the framing (`crate::stream`), the route policy's
    /// generations, or the pipeline for a row.
    pub fn take(&mut self, m: Staged, now: Now) -> Result<Taken, CoreError> {
        let mut taken = Taken::default();
        match m {
            Staged::Begin(lsn) => self.on_begin(lsn)?,
            Staged::Row(row, change_lsn) => taken.commands = self.on_row(*row, change_lsn, now)?,
            Staged::Commit(lsn) => self.on_commit(lsn)?,
            Staged::PolicyGeneration(id) => self.on_policy_generation(id)?,
            Staged::Keepalive {
                wal_end,
                reply_requested,
            } => {
                self.on_keepalive(wal_end);
                taken.reply_requested = reply_requested;
            }
        }
        Ok(taken)
    }
}

/// The messages staged in order, and how much they hold.
#[derive(Debug, Default)]
pub struct Stage {
    messages: Vec<Staged>,
    rows: usize,
    bytes: usize,
}

impl Stage {
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// `m`, if the core may take it now; `None` if it is held back: something is staged
    /// already (messages reach the core in the order they came), or it is a row of an
    /// aggregate whose head the core does not know yet.
    pub fn offer<P: Plant>(&mut self, core: &PipelineCore<P>, m: Staged) -> Option<Staged> {
        let hold = !self.is_empty()
            || matches!(&m, Staged::Row(row, _) if row.as_ref().as_ref().is_ok_and(|ev| !core.knows_aggregate_of(ev)));
        if !hold {
            return Some(m);
        }
        if let Staged::Row(row, _) = &m {
            self.rows += 1;
            self.bytes += row.as_ref().as_ref().map_or(0, |ev| ev.payload.len());
        }
        self.messages.push(m);
        None
    }

    /// Whether the stage holds enough that the look-up should run now.
    pub fn full(&self) -> bool {
        self.rows >= STAGE_ROWS || self.bytes >= STAGE_BYTES
    }

    /// The staged events (whose aggregates to look up).
    pub fn events(&self) -> impl Iterator<Item = &OutboxEvent> + Clone {
        self.messages.iter().filter_map(|m| match m {
            Staged::Row(row, _) => row.as_ref().as_ref().ok(),
            _ => None,
        })
    }

    /// Empties the stage, in order: hand each to the core once the heads are raised.
    pub fn take(&mut self) -> Vec<Staged> {
        self.rows = 0;
        self.bytes = 0;
        std::mem::take(&mut self.messages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::key_of;
    use crate::testing::*;

    fn row(ev: &OutboxEvent) -> Staged {
        Staged::Row(Box::new(Ok(ev.clone())), Lsn(ev.aggregate_version as u64))
    }

    /// A row of an aggregate the core does not know is held, and so is everything after it,
    /// known or not, until the driver has raised the heads and taken the stage in order.
    #[test]
    fn an_unknown_aggregate_holds_what_follows_it_in_order() {
        let mut c = core();
        let mut stage = Stage::default();
        let (a1, b1) = (event("a", 1), event("b", 1));
        c.raise_heads(vec![(key_of(&a1), 0)]);
        assert!(stage.offer(&c, Staged::Begin(Lsn(10))).is_some());
        assert!(
            stage.offer(&c, row(&a1)).is_some(),
            "a known aggregate goes"
        );
        assert!(stage.offer(&c, row(&b1)).is_none(), "b's head is unknown");
        let a2 = event("a", 2);
        assert!(stage.offer(&c, row(&a2)).is_none(), "behind b's row");
        assert!(stage.offer(&c, Staged::Commit(Lsn(20))).is_none());
        let unknown = c.unknown_aggregates(stage.events());
        assert_eq!(unknown, vec![(key_of(&b1), 1)]);
        let order: Vec<String> = stage
            .take()
            .iter()
            .map(|m| match m {
                Staged::Row(r, _) => r.as_ref().as_ref().unwrap().aggregate_id.clone(),
                Staged::Commit(_) => "commit".into(),
                _ => "other".into(),
            })
            .collect();
        assert_eq!(order, ["b", "a", "commit"]);
        assert!(stage.is_empty());
    }

    #[test]
    fn each_message_goes_to_the_part_of_the_core_it_is_for() {
        let mut c = core();
        let a1 = event("a", 1);
        c.raise_heads(vec![(key_of(&a1), 0)]);
        c.start_streaming(Lsn(5));
        assert!(c
            .take(Staged::Begin(Lsn(10)), now(0))
            .unwrap()
            .commands
            .is_empty());
        let sent = c.take(row(&a1), now(0)).unwrap();
        assert_eq!(sent.commands.len(), 1, "the row is admitted and sent");
        c.take(Staged::Commit(Lsn(20)), now(0)).unwrap();
        assert!(matches!(
            c.take(Staged::Commit(Lsn(21)), now(0)),
            Err(CoreError::Protocol(_))
        ));
        let k = Staged::Keepalive {
            wal_end: Lsn(30),
            reply_requested: true,
        };
        assert!(c.take(k, now(0)).unwrap().reply_requested);
        assert_eq!(c.standby_status().write, Lsn(30));
    }

    #[test]
    fn the_stage_is_full_at_its_row_bound() {
        let c = core();
        let mut stage = Stage::default();
        for v in 1..=STAGE_ROWS as i64 {
            assert!(!stage.full());
            assert!(stage.offer(&c, row(&event("a", v))).is_none());
        }
        assert!(stage.full());
        stage.take();
        assert!(!stage.full());
    }
}
