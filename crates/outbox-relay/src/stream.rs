//! The replication stream as the relay core sees it: transaction framing, the positions it
//! has received and committed, and what the standby status may confirm.
//!
//! The driver reads the slot and decodes pgoutput; it hands each decoded message to the core
//! here ([`PipelineCore::on_begin`], [`PipelineCore::on_row`], [`PipelineCore::on_commit`],
//! [`PipelineCore::on_keepalive`]) and, after an acceptance transaction committed, the
//! checkpoint it wrote ([`PipelineCore::checkpoint_committed`]). Two positions live here:
//! * `last_received` — how far the slot has sent us; reported as the standby status's
//!   `write`, which confirms nothing;
//! * `durable` — the checkpoint the ledger committed together with the receipts that justify
//!   it; the only position ever reported as `flush` ([`PipelineCore::standby_status`]).
//!
//! Every event is registered in the ack tracker under its transaction *before* it is admitted,
//! and a transaction's end LSN is known only at its Commit: so the tracker's watermark can
//! never pass a transaction whose events the relay has not all seen.

use outbox_core::numbering::Number;
use outbox_core::{AckTracker, Lsn, OutboxEvent};

use crate::pipeline::{Command, CoreError, Now, OpenTxn, PipelineCore};
use crate::schedule::{standby_status, StandbyStatus};

impl<P: crate::pipeline::Plant> PipelineCore<P> {
    /// Streaming starts at `start` (the position the slot resumes from): nothing before it is
    /// outstanding, and it is both the last position received and the durable checkpoint.
    pub fn start_streaming(&mut self, start: Lsn) {
        self.tracker = AckTracker::new(start);
        self.txn = None;
        self.last_received = start;
        self.durable = start;
    }

    /// A decoded Begin.
    pub fn on_begin(&mut self, commit_lsn: Lsn) -> Result<(), CoreError> {
        if self.txn.is_some() {
            return Err(CoreError::Protocol("Begin inside an open transaction"));
        }
        let seq = self.tracker.begin()?;
        self.txn = Some(OpenTxn {
            seq,
            commit_lsn,
            rows: 0,
        });
        Ok(())
    }

    /// A decoded outbox row of the open transaction: admitted (route, ordering gate, send),
    /// or, when it could not be read as an envelope (`Err(why)`), quarantined as
    /// `unreadable_row` under the key `lsn:<commit LSN>:<row number>`. `change_lsn` is the
    /// row's change record's LSN (its `XLogData` start): its receipt carries it.
    pub fn on_row(
        &mut self,
        mut row: Result<OutboxEvent, String>,
        change_lsn: Lsn,
        now: Now,
    ) -> Result<Vec<Command>, CoreError> {
        let txn = self
            .txn
            .as_mut()
            .ok_or(CoreError::Protocol("a row outside a transaction"))?;
        txn.rows += 1;
        let OpenTxn {
            seq,
            commit_lsn,
            rows,
        } = *txn;
        if let Ok(ev) = &mut row {
            if ev.version_by_relay {
                // Written without a version: the next of its aggregate, in commit order.
                match self.numbering.number(
                    &crate::pipeline::num_key(&ev.aggregate_type, &ev.aggregate_id),
                    commit_lsn,
                ) {
                    Number::Version(v) => ev.aggregate_version = v,
                    Number::NeedHead => return Err(CoreError::NeedHead),
                }
            }
        }
        let ack = self.tracker.add_event(seq)?;
        match row {
            Ok(ev) if self.drop_skipped(&ev, ack)? => Ok(Vec::new()),
            Ok(ev) => self.admit(ev, Some(commit_lsn), Some(change_lsn), Some(ack), now),
            Err(why) => {
                self.quarantine_unreadable(
                    format!("lsn:{commit_lsn}:{rows}"),
                    why,
                    commit_lsn,
                    Some(ack),
                );
                Ok(Vec::new())
            }
        }
    }

    /// A route policy generation (migration 0038) in the open transaction: in force for the
    /// rows committed after it, so at every checkpoint past this transaction's commit.
    pub fn on_policy_generation(&mut self, id: i64) -> Result<(), CoreError> {
        let txn = self.txn.as_ref().ok_or(CoreError::Protocol(
            "a policy generation outside a transaction",
        ))?;
        self.generations.note(txn.commit_lsn, id);
        Ok(())
    }

    /// A decoded Commit: the transaction's end LSN, which the checkpoint may pass once all of
    /// its events are resolved.
    pub fn on_commit(&mut self, end_lsn: Lsn) -> Result<(), CoreError> {
        let txn = self
            .txn
            .take()
            .ok_or(CoreError::Protocol("Commit without Begin"))?;
        self.tracker.commit(txn.seq, end_lsn)?;
        self.on_received(end_lsn);
        Ok(())
    }

    /// A message from the slot starting at `wal_start` (any XLogData).
    pub fn on_received(&mut self, wal_start: Lsn) {
        self.last_received = self.last_received.max(wal_start);
    }

    /// A keepalive: the server's WAL end. Outside a transaction nothing is outstanding up to
    /// it, so an idle relay's checkpoint may follow it (past heartbeats and other tables).
    pub fn on_keepalive(&mut self, wal_end: Lsn) {
        self.on_received(wal_end);
        if self.txn.is_none() {
            self.tracker.idle_position(wal_end);
        }
    }

    /// The acceptance transaction that carried checkpoint `c` has committed.
    pub fn checkpoint_committed(&mut self, c: Lsn) {
        self.durable = self.durable.max(c);
    }

    /// The checkpoint the ledger has committed.
    pub fn durable(&self) -> Lsn {
        self.durable
    }

    /// The standby status to send now ([`standby_status`]: `flush` is the durable checkpoint).
    pub fn standby_status(&self) -> StandbyStatus {
        standby_status(self.last_received, self.durable)
    }
}

#[cfg(test)]
mod tests {
    use outbox_core::records::LedgerItem;

    use super::*;
    use crate::testing::{core as bare, event, now};

    fn core() -> PipelineCore {
        let mut c = bare();
        c.start_streaming(Lsn(10));
        c
    }

    #[test]
    fn rows_and_commits_need_a_begin() {
        let mut c = core();
        assert!(matches!(
            c.on_row(Ok(event("a", 1)), Lsn(11), now(0)),
            Err(CoreError::Protocol(_))
        ));
        assert!(matches!(c.on_commit(Lsn(20)), Err(CoreError::Protocol(_))));
        c.on_begin(Lsn(20)).unwrap();
        assert!(matches!(c.on_begin(Lsn(30)), Err(CoreError::Protocol(_))));
    }

    #[test]
    fn a_transaction_holds_the_watermark_until_its_commit_and_its_events_resolve() {
        let mut c = core();
        c.on_begin(Lsn(20)).unwrap();
        let sent = c.on_row(Ok(event("a", 1)), Lsn(11), now(0)).unwrap();
        assert_eq!(sent.len(), 1);
        // A keepalive inside the transaction does not move the idle position past it.
        c.on_keepalive(Lsn(50));
        assert_eq!(c.tracker.watermark(), Lsn(10));
        c.on_commit(Lsn(21)).unwrap();
        assert_eq!(c.tracker.watermark(), Lsn(10), "the event is in flight");
        assert_eq!(c.last_received(), Lsn(50));
        assert!(!c.in_transaction());
    }

    #[test]
    fn an_unreadable_row_is_quarantined_by_its_position_and_resolves_its_transaction() {
        let mut c = core();
        c.on_begin(Lsn(20)).unwrap();
        assert!(c
            .on_row(Err("no payload".into()), Lsn(12), now(0))
            .unwrap()
            .is_empty());
        c.on_commit(Lsn(21)).unwrap();
        let (items, checkpoint) = c.take_batch(true).unwrap().unwrap();
        let LedgerItem::Quarantine(q) = &items[0] else {
            panic!("{items:?}")
        };
        assert_eq!(
            (q.key.as_str(), q.reason_code.as_str()),
            ("lsn:0/14:1", "unreadable_row")
        );
        assert_eq!(checkpoint, Some(Lsn(21)));
    }

    #[test]
    fn an_idle_keepalive_moves_the_watermark_but_only_a_committed_checkpoint_is_confirmed() {
        let mut c = core();
        c.on_keepalive(Lsn(40));
        assert_eq!(c.tracker.watermark(), Lsn(40));
        let st = c.standby_status();
        assert_eq!((st.write, st.flush), (Lsn(40), Lsn(10)));
        let (_, checkpoint) = c.take_batch(true).unwrap().unwrap();
        assert_eq!(checkpoint, Some(Lsn(40)));
        // Not confirmed until the acceptance transaction that wrote it commits.
        assert_eq!(c.standby_status().flush, Lsn(10));
        c.checkpoint_committed(Lsn(40));
        assert_eq!(c.standby_status().flush, Lsn(40));
        assert!(c.take_batch(true).unwrap().is_none(), "nothing past it");
    }

    /// A row written without a version (`version_by_relay`, version 0 as decoded).
    fn plain(aggregate: &str) -> OutboxEvent {
        OutboxEvent {
            version_by_relay: true,
            ..event(aggregate, 0)
        }
    }

    fn versions_sent(cmds: &[crate::pipeline::Command]) -> Vec<(String, i64)> {
        cmds.iter()
            .map(|crate::pipeline::Command::Send { event, .. }| {
                (event.aggregate_id.clone(), event.aggregate_version)
            })
            .collect()
    }

    /// The writer's plain INSERT (docs/versions_by_relay.md): rows without a version wait for
    /// their aggregate's numbering (the driver stages them), then take the next versions in
    /// stream order, from what the checkpoint kept; the acceptance that moves the checkpoint
    /// keeps, per aggregate, the version of its last row committed before it, and the route
    /// policy generation in force there.
    #[test]
    fn rows_without_a_version_are_numbered_in_stream_order_from_what_the_checkpoint_kept() {
        let mut c = core();
        c.start_generations(Some(1), Some(1));
        let (a, b) = (
            ("order".to_string(), "a".to_string()),
            ("order".to_string(), "b".to_string()),
        );
        assert!(
            !c.knows_aggregate_of(&plain("a")),
            "staged until its numbering is read"
        );
        assert_eq!(
            c.unnumbered_aggregates(&[plain("a"), plain("b"), plain("a"), event("c", 1)]),
            vec![a.clone(), b.clone()],
            "each once; a versioned row needs a head, not a numbering"
        );
        c.on_begin(Lsn(20)).unwrap();
        assert!(matches!(
            c.on_row(Ok(plain("a")), Lsn(11), now(0)),
            Err(CoreError::NeedHead)
        ));
        c.seed_numbering(vec![(a.clone(), 4), (b.clone(), 0)]);
        assert!(c.knows_aggregate_of(&plain("a")));
        let first = c.on_row(Ok(plain("a")), Lsn(11), now(0)).unwrap();
        let queued = c.on_row(Ok(plain("a")), Lsn(12), now(0)).unwrap();
        let other = c.on_row(Ok(plain("b")), Lsn(13), now(0)).unwrap();
        c.on_commit(Lsn(21)).unwrap();
        assert_eq!(
            versions_sent(&first),
            [("a".to_string(), 5)],
            "after the 4 kept"
        );
        assert!(queued.is_empty(), "version 6 waits behind 5");
        assert_eq!(versions_sent(&other), [("b".to_string(), 1)]);
        c.on_begin(Lsn(30)).unwrap();
        c.on_policy_generation(2).unwrap();
        c.on_row(Ok(plain("b")), Lsn(22), now(0)).unwrap();
        c.on_commit(Lsn(31)).unwrap();

        // A checkpoint between the two transactions keeps the first's last versions, and
        // the generation still in force there (unchanged: nothing to write).
        let mut through = c.numbered_through(Lsn(21));
        through.versions.sort();
        assert_eq!(
            through,
            crate::pipeline::NumberedThrough {
                versions: vec![(a.clone(), 6), (b.clone(), 1)],
                policy_generation: None,
                fold: false,
            }
        );
        assert_eq!(
            c.numbered_through(Lsn(31)),
            crate::pipeline::NumberedThrough {
                versions: vec![(b, 2)],
                policy_generation: Some(2),
                fold: false,
            }
        );
        assert!(c.numbered_through(Lsn(40)).is_empty());
    }

    /// A row without a version read outside the stream (a snapshot, a poll round, a release)
    /// has no commit order to be numbered by: quarantined with the reason, its aggregate
    /// held, never published as version 0.
    #[test]
    fn a_row_without_a_version_read_outside_the_stream_is_quarantined() {
        let mut c = core();
        let cmds = c.admit(plain("a"), None, None, None, now(0)).unwrap();
        assert!(cmds.is_empty(), "nothing sent");
        let (items, _) = c.take_batch(false).unwrap().unwrap();
        let codes: Vec<&str> = items
            .iter()
            .filter_map(|i| match i {
                LedgerItem::Quarantine(q) => Some(q.reason_code.as_str()),
                LedgerItem::Hold(h) => Some(h.reason_code.as_str()),
                _ => None,
            })
            .collect();
        assert!(codes.contains(&"unnumbered_row"), "{items:?}");
    }
}
