//! A read outside the stream — the initial snapshot, or a poll round — handed to the core.
//!
//! Such a read yields rows of many aggregates the gate may not know yet. As in the stream
//! ([`crate::stage`]), their heads are read from the ledger in one query per chunk of
//! [`STAGE_ROWS`] rows, before any row of the chunk is admitted ([`Chunks`]), and then each
//! row is admitted by the read's rules ([`PipelineCore::admit_read`]): a snapshot's as the
//! stream's are, a poll round's by the round's ([`crate::poll`]), a row that cannot be read as
//! an event quarantined under a key of the read. After each row the driver keeps within the
//! relay's bounds ([`crate::pace`]). The daemon (`Pipeline::admit_rows`) and the simulator's
//! snapshots and poll rounds both run it, so both read heads at the same moments.

use outbox_core::{Lsn, OutboxEvent};

use crate::pipeline::{Command, CoreError, Now, PipelineCore, Plant};
use crate::poll::Polled;
use crate::stage::STAGE_ROWS;

/// What a read outside the stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// The initial snapshot (or a `--resnapshot`): every row admitted as the stream's are.
    Snapshot,
    /// A poll round: by the round's rules ([`PipelineCore::admit_polled`]).
    PollRound,
}

/// A row that cannot be read as an event: the key it is quarantined under (the driver's,
/// from the read) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub key: String,
    pub error: String,
}

/// A row of a read.
pub type ReadRow = Result<OutboxEvent, Unreadable>;

/// The rows of a read, gathered into chunks: the driver reads the heads of a chunk's
/// aggregates ([`PipelineCore::unknown_aggregates`] of [`events`]) before it admits the
/// chunk's rows.
#[derive(Debug, Default)]
pub struct Chunks {
    rows: Vec<ReadRow>,
}

impl Chunks {
    /// The next row of the read; the chunk, when it is full.
    pub fn offer(&mut self, row: ReadRow) -> Option<Vec<ReadRow>> {
        self.rows.push(row);
        (self.rows.len() >= STAGE_ROWS).then(|| std::mem::take(&mut self.rows))
    }

    /// The read ended: its last chunk (possibly empty).
    pub fn end(&mut self) -> Vec<ReadRow> {
        std::mem::take(&mut self.rows)
    }
}

/// The events of a chunk (not its unreadable rows): whose heads to read.
pub fn events(chunk: &[ReadRow]) -> impl Iterator<Item = &OutboxEvent> + Clone {
    chunk.iter().filter_map(|r| r.as_ref().ok())
}

/// What became of one row of a read.
#[derive(Debug)]
pub enum ReadAdmitted {
    /// Admitted: the commands that send it (none while it waits behind its aggregate).
    Admitted(Vec<Command>),
    /// A poll round skipped its aggregate ([`Polled::Skipped`]).
    Skipped,
    /// Unreadable: quarantined under its key.
    Quarantined,
}

impl<P: Plant> PipelineCore<P> {
    /// One row of a read, in the read's order, after the heads of its chunk were raised.
    pub fn admit_read(
        &mut self,
        read: Read,
        row: ReadRow,
        now: Now,
    ) -> Result<ReadAdmitted, CoreError> {
        match (row, read) {
            (Ok(ev), Read::Snapshot) => self
                .admit(ev, None, None, None, now)
                .map(ReadAdmitted::Admitted),
            (Ok(ev), Read::PollRound) => Ok(match self.admit_polled(ev, now)? {
                Polled::Skipped => ReadAdmitted::Skipped,
                Polled::Admitted { commands } => ReadAdmitted::Admitted(commands),
            }),
            (Err(u), _) => {
                self.quarantine_unreadable(u.key, u.error, Lsn::ZERO, None);
                Ok(ReadAdmitted::Quarantined)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{core, event, now};

    #[test]
    fn a_read_is_cut_into_chunks_of_stage_rows_and_its_rest_at_the_end() {
        let mut c = Chunks::default();
        let mut full = Vec::new();
        for v in 1..=(2 * STAGE_ROWS as i64 + 3) {
            if let Some(chunk) = c.offer(Ok(event("a", v))) {
                full.push(chunk.len());
            }
        }
        assert_eq!(full, vec![STAGE_ROWS, STAGE_ROWS]);
        assert_eq!(c.end().len(), 3);
        assert!(c.end().is_empty());
    }

    #[test]
    fn a_snapshot_row_is_sent_an_unreadable_one_quarantined_and_a_poll_round_skips_an_aggregate_at_the_broker(
    ) {
        let mut c = core();
        c.raise_heads(vec![(("order".to_string(), "a".to_string()), 0)]);
        let sent = c
            .admit_read(Read::Snapshot, Ok(event("a", 1)), now(1))
            .unwrap();
        assert!(
            matches!(&sent, ReadAdmitted::Admitted(cmds) if cmds.len() == 1),
            "{sent:?}"
        );
        let bad = Unreadable {
            key: "snapshot:2".into(),
            error: "no aggregate_id".into(),
        };
        let q = c.admit_read(Read::Snapshot, Err(bad), now(2)).unwrap();
        assert!(matches!(q, ReadAdmitted::Quarantined));
        assert_eq!(c.batch_len(), 1, "the quarantine record waits in the batch");
        // a/1 is at the broker: a poll round skips the aggregate.
        c.begin_poll_round(std::time::Duration::ZERO);
        let polled = c
            .admit_read(Read::PollRound, Ok(event("a", 2)), now(3))
            .unwrap();
        assert!(matches!(polled, ReadAdmitted::Skipped), "{polled:?}");
    }
}
