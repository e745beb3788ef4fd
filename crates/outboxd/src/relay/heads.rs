//! Heads looked up when the relay first meets an aggregate (migration 0026).
//!
//! The ordering gate needs each aggregate's last accepted version before it admits the
//! aggregate's first event of a run. The ledger no longer keeps every head ready (that cost
//! the primary an upsert per event); it answers for many aggregates in one query
//! (`outbox.aggregate_heads_of`). So the stream loop does not hand a decoded row of an unknown
//! aggregate to the core at once: it stages it, and everything decoded after it (Begin, rows,
//! Commit, keepalives keep their order), while more messages are already waiting, up to
//! [`STAGE_ROWS`] rows or [`STAGE_BYTES`] of payload; then one look-up, and the staged
//! messages go to the core in the order they came. A relay that knows its aggregates stages
//! nothing.

use outbox_core::{Lsn, OutboxEvent};

/// Rows staged before a look-up at most: one query per this many rows in a drain over many
/// new aggregates.
pub const STAGE_ROWS: usize = 2_000;

/// Payload bytes staged before a look-up at most (the relay's memory stays bounded whatever
/// the payloads).
pub const STAGE_BYTES: usize = 4 << 20;

/// A decoded message held back until the heads of its aggregates are known.
#[derive(Debug)]
pub enum Staged {
    Begin(Lsn),
    /// Boxed: a staged row is rare next to the other messages' size.
    Row(Box<Result<OutboxEvent, String>>),
    Commit(Lsn),
    Keepalive {
        wal_end: Lsn,
        reply_requested: bool,
    },
}

/// The messages staged in order, and how much they hold.
#[derive(Debug, Default)]
pub struct Stage {
    pub messages: Vec<Staged>,
    rows: usize,
    bytes: usize,
}

impl Stage {
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Holds `m` back behind what is staged.
    pub fn push(&mut self, m: Staged) {
        if let Staged::Row(row) = &m {
            self.rows += 1;
            self.bytes += row.as_ref().as_ref().map_or(0, |ev| ev.payload.len());
        }
        self.messages.push(m);
    }

    /// Whether the stage holds enough that the look-up should run now.
    pub fn full(&self) -> bool {
        self.rows >= STAGE_ROWS || self.bytes >= STAGE_BYTES
    }

    /// The staged events (what to look up).
    pub fn events(&self) -> impl Iterator<Item = &OutboxEvent> {
        self.messages.iter().filter_map(|m| match m {
            Staged::Row(row) => row.as_ref().as_ref().ok(),
            _ => None,
        })
    }

    /// Empties the stage, in order.
    pub fn take(&mut self) -> Vec<Staged> {
        self.rows = 0;
        self.bytes = 0;
        std::mem::take(&mut self.messages)
    }
}
