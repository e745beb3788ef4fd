//! Consumers: each reads the partitions at its own pace, commits offsets now and then, crashes
//! back to its committed offsets, and lets outbox-inbox's `ConsumerModel` decide whether an
//! effect runs.

use super::*;

/// A consumer group member: its committed and current offsets per (topic, partition), and
/// outbox-inbox's own decision code ([`ConsumerModel`]: inbox dedup, then the aggregate
/// watermark, gap policy `report`) deciding whether each message's effect runs.
pub(super) struct Consumer {
    pub(super) committed: Vec<usize>,
    pub(super) pos: Vec<usize>,
    pub(super) model: ConsumerModel<Uuid, Agg>,
}

impl World {
    /// One message through the inbox: effect and inbox row in one transaction, then the
    /// offset commit (sometimes several messages later).
    pub(super) fn consume(&mut self, c: usize) {
        let parts: Vec<usize> = (0..TOPICS.len() * MAX_PARTITIONS)
            .filter(|tp| {
                self.consumers[c].pos[*tp]
                    < self.broker[tp / MAX_PARTITIONS][tp % MAX_PARTITIONS].len()
            })
            .collect();
        if parts.is_empty() {
            return;
        }
        let tp = parts[self.rng.below(parts.len() as u64) as usize];
        let m = self.broker[tp / MAX_PARTITIONS][tp % MAX_PARTITIONS][self.consumers[c].pos[tp]]
            .clone();
        if self.faults && self.rng.chance(20) {
            self.consumer_crash(c); // before the transaction commits
            return;
        }
        // The version the message carries (its header), which for a plain row is the
        // relay's numbering: what a consumer's aggregate watermark sees.
        let (id, agg, version) = {
            let row = &self.rows[m.row];
            (row.ev.event_id, row.agg, m.version)
        };
        if self.rows[m.row].purged {
            log!(self, "consumer {c} read a copy of purged {id}");
            self.c.purged_early += 1;
        }
        let con = &mut self.consumers[c];
        con.model.deliver(id, agg, version);
        con.pos[tp] += 1;
        if !self.faults || self.rng.chance(600) {
            let con = &mut self.consumers[c];
            con.committed[tp] = con.pos[tp];
        }
    }

    pub(super) fn consumer_crash(&mut self, c: usize) {
        let con = &mut self.consumers[c];
        con.pos = con.committed.clone();
        con.model.crash();
        self.c.consumer_crashes += 1;
    }
}
