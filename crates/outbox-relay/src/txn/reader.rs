//! Exactly-once mode's framing of the replication stream: what the driver decoded (Begin, a
//! row, Commit, a keepalive) becomes whole stream transactions, which [`super::TxnCore`] takes
//! only whole (a batch holds a stream transaction's events or none of them, and a checkpoint
//! passes a transaction only once all of its events are in accepted batches). The default
//! mode frames in the pipeline core itself (`crate::stream`).

use outbox_core::{Lsn, OutboxEvent};

/// A row of a stream transaction: the event, or why it could not be read as one (the driver
/// quarantines it), and its change LSN.
pub type StreamRow = (Result<OutboxEvent, String>, Lsn);

/// A stream transaction read whole: its rows, its commit LSN and its end.
#[derive(Debug)]
pub struct StreamTxn {
    pub rows: Vec<StreamRow>,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
}

/// The stream as read so far: the transaction being read, those read whole and not yet taken
/// ([`Reader::take`]), and the furthest position the server sent.
#[derive(Debug)]
pub struct Reader {
    received: Lsn,
    open: Option<(Lsn, Vec<StreamRow>)>,
    read: Vec<StreamTxn>,
    read_rows: usize,
}

impl Reader {
    /// Reading from `start`, the checkpoint the slot streams from.
    pub fn new(start: Lsn) -> Self {
        Reader {
            received: start,
            open: None,
            read: Vec::new(),
            read_rows: 0,
        }
    }

    /// The furthest position the server sent: the standby status's `write`.
    pub fn received(&self) -> Lsn {
        self.received
    }

    /// A keepalive at the server's `wal_end`. Outside a transaction nothing is outstanding up
    /// to it: it is read as a transaction without rows, so that an idle relay's checkpoint
    /// follows the server (past heartbeats and other tables' changes), as in the default mode.
    pub fn keepalive(&mut self, wal_end: Lsn) {
        if self.open.is_none() && wal_end > self.received {
            self.read.push(StreamTxn {
                rows: Vec::new(),
                commit_lsn: wal_end,
                end_lsn: wal_end,
            });
        }
        self.received = self.received.max(wal_end);
    }

    /// Any message of the stream's data, starting at `wal_start`.
    pub fn data_at(&mut self, wal_start: Lsn) {
        self.received = self.received.max(wal_start);
    }

    /// A decoded Begin of the transaction that commits at `commit_lsn`.
    pub fn begin(&mut self, commit_lsn: Lsn) {
        self.open = Some((commit_lsn, Vec::new()));
    }

    /// A decoded outbox row of the open transaction (ignored outside one, which pgoutput never
    /// sends).
    pub fn row(&mut self, row: StreamRow) {
        if let Some((_, rows)) = &mut self.open {
            rows.push(row);
        }
    }

    /// A decoded Commit, at `end_lsn`: the open transaction is read whole.
    pub fn commit(&mut self, end_lsn: Lsn) {
        if let Some((commit_lsn, rows)) = self.open.take() {
            self.read_rows += rows.len();
            self.read.push(StreamTxn {
                rows,
                commit_lsn,
                end_lsn,
            });
        }
        self.received = self.received.max(end_lsn);
    }

    /// Whether to stop reading what the server already sent, and give the core what was read:
    /// between transactions, once the events not yet finished (`unfinished`) and those read
    /// make a batch. Reading on up to a batch lets one look-up read the heads of every
    /// aggregate they meet first.
    pub fn full(&self, unfinished: usize, batch_size: usize) -> bool {
        self.open.is_none() && unfinished + self.read_rows >= batch_size
    }

    /// The transactions read whole since the last call, in stream order.
    pub fn take(&mut self) -> Vec<StreamTxn> {
        self.read_rows = 0;
        std::mem::take(&mut self.read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: u64) -> StreamRow {
        (Err(format!("row {n}")), Lsn(n))
    }

    #[test]
    fn transactions_are_read_whole_and_a_keepalive_between_them_is_an_empty_one() {
        let mut r = Reader::new(Lsn(10));
        r.keepalive(Lsn(5));
        assert!(
            r.take().is_empty(),
            "a keepalive behind the start moves nothing"
        );
        r.data_at(Lsn(20));
        r.begin(Lsn(30));
        r.row(row(21));
        r.row(row(22));
        // Inside a transaction a keepalive is only a position.
        r.keepalive(Lsn(25));
        assert!(!r.full(0, 1), "a batch never ends inside a transaction");
        assert!(r.take().is_empty());
        r.commit(Lsn(31));
        assert!(r.full(0, 2) && !r.full(0, 3) && r.full(1, 3));
        r.keepalive(Lsn(40));
        let read = r.take();
        assert_eq!(read.len(), 2);
        assert_eq!(
            (read[0].rows.len(), read[0].commit_lsn, read[0].end_lsn),
            (2, Lsn(30), Lsn(31))
        );
        assert_eq!(
            (read[1].rows.len(), read[1].commit_lsn, read[1].end_lsn),
            (0, Lsn(40), Lsn(40))
        );
        assert_eq!(r.received(), Lsn(40));
        assert!(!r.full(0, 1), "what was taken counts no more");
    }
}
