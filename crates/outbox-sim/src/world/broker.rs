//! The simulated broker: two clusters of partitioned logs that take the relay's sends and
//! decide, with the world's faults, what each delivery report says (persisted, a broker-side
//! duplicate, an ACK lost, a late append, an implicit ack without a position, a refusal).

use super::*;

#[derive(Clone)]
pub(super) struct Msg {
    /// The event id the message carries (header `id`), as sent.
    pub(super) id: Uuid,
    pub(super) row: usize,
    /// The aggregate version it carries (the header), as the relay sent it: for a row written
    /// plainly, the version the relay numbered it with.
    pub(super) version: i64,
    pub(super) dest_digest: String,
    pub(super) relay_gen: i64,
    pub(super) attempt: i32,
    /// When the broker stored it (set by [`World::store`]).
    pub(super) stored_at: u64,
    /// Its place in the order the broker stored messages, over every partition (set by
    /// [`World::store`]): what orders two partitions' appends, which offsets cannot.
    pub(super) seq: u64,
}

/// What the broker will report for one send (decided when it is sent).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Report {
    Persisted(Receipt),
    /// Request timed out or the transport failed after sending: possibly persisted.
    PossiblyPersisted,
    /// Not appended, but the client says "delivered" without a position (librdkafka's implicit
    /// ack, offset -1001).
    ImplicitAck,
    NotPersisted,
    Rejected,
    /// A deeper gate's producer holds it back (`World::broker_send_in_order`): it lands when
    /// due, and its report comes only then, with where it landed; a run that ends first
    /// reports it possibly persisted.
    Pending,
}

impl World {
    /// The broker's side of a send; decides now what the delivery report will say.
    pub(super) fn broker_send(&mut self, topic: usize, partition: usize, msg: Msg) -> Report {
        if topic == REJECTING_TOPIC {
            return Report::Rejected;
        }
        if self.now < self.down_until[topic] {
            if self.rng.chance(500) {
                let due = self.now + self.rng.range(1, self.max_append_delay);
                self.late_appends.push((due, topic, partition, msg));
                return Report::PossiblyPersisted;
            }
            return Report::NotPersisted;
        }
        if !self.faults {
            return Report::Persisted(self.store(topic, partition, msg));
        }
        match self.rng.weighted(&[860, 30, 40, 30, 20, 20]) {
            0 => Report::Persisted(self.store(topic, partition, msg)),
            // A broker-side duplicate (producer retry after a lost response).
            1 => Report::Persisted(self.store_twice(topic, partition, msg)),
            2 => {
                self.store(topic, partition, msg);
                Report::PossiblyPersisted // appended, ACK lost
            }
            3 => {
                let due = self.now + self.rng.range(1, self.max_append_delay);
                self.late_appends.push((due, topic, partition, msg));
                Report::PossiblyPersisted // round trip longer than the message timeout
            }
            // Timed out, never appended; for half of the rows (no draw, so that every trace
            // stays the same) the client reports it delivered anyway, without a position.
            4 if msg.row % 2 == 0 => Report::ImplicitAck,
            4 => Report::PossiblyPersisted,
            _ => Report::NotPersisted, // leader change: not written
        }
    }

    /// The broker's side of a send by a deeper gate's producer (`World::depth` above 1):
    /// idempotent with `enable.gapless.guarantee` and no message timeout, it never lets a
    /// message of a partition through after one it lost. So what it delivers of a partition is
    /// a prefix of what it took, in that order: a message it holds back (a topic down, a slow
    /// round trip) lands later, and what it takes for that partition meanwhile lands after it;
    /// a message the broker refuses or it cannot deliver in order raises its fatal error, and
    /// nothing it takes after that lands at all (the run ends, the next opens a new producer).
    /// The faults' odds are [`World::broker_send`]'s; a timed-out message without a position
    /// cannot happen without a message timeout.
    ///
    /// The report, and from when it may be read (a message held back: when it lands).
    pub(super) fn broker_send_in_order(
        &mut self,
        i: usize,
        topic: usize,
        partition: usize,
        msg: Msg,
    ) -> (Report, u64) {
        let now = self.now;
        let id = msg.id;
        let report = self.in_order_report(i, topic, partition, msg);
        log!(
            self,
            "  gapless producer of gen {}: {id} {}",
            self.relays[i].gen,
            match report {
                Report::Persisted(rc) => format!("stored at {}", rc.offset),
                Report::PossiblyPersisted => "stored, its ACK lost".into(),
                Report::Pending => format!(
                    "held back until {}",
                    self.relays[i].tails[&(topic, partition)]
                ),
                Report::NotPersisted => "not delivered (the producer failed)".into(),
                Report::Rejected => "refused by the broker".into(),
                Report::ImplicitAck => "implicit ack".into(),
            }
        );
        let ready = match report {
            Report::Pending => self.relays[i].tails[&(topic, partition)],
            _ => now,
        };
        (report, ready)
    }

    fn in_order_report(&mut self, i: usize, topic: usize, partition: usize, msg: Msg) -> Report {
        if self.relays[i].producer_fatal {
            return Report::NotPersisted;
        }
        // What is due has landed before this is appended (some of the drain's steps move time
        // on their own).
        self.land_late_appends();
        let fatal = |w: &mut World, report: Report| {
            log!(
                w,
                "the producer of gen {} failed (gapless)",
                w.relays[i].gen
            );
            w.relays[i].producer_fatal = true;
            w.c.producers_failed += 1;
            report
        };
        if topic == REJECTING_TOPIC {
            return fatal(self, Report::Rejected);
        }
        let tail = self.relays[i]
            .tails
            .get(&(topic, partition))
            .copied()
            .filter(|&t| t > self.now);
        let hold_back = |w: &mut World, after: u64| {
            let due = after.max(w.now) + w.rng.range(1, w.max_append_delay);
            w.relays[i].tails.insert((topic, partition), due);
            w.late_appends.push((due, topic, partition, msg.clone()));
            // Unanswered until it lands: no message timeout fails it meanwhile.
            Report::Pending
        };
        if self.now < self.down_until[topic] || tail.is_some() {
            let after = self.down_until[topic].max(tail.unwrap_or(0));
            return hold_back(self, after);
        }
        if !self.faults {
            return Report::Persisted(self.store(topic, partition, msg));
        }
        match self.rng.weighted(&[860, 30, 40, 30, 20, 20]) {
            0 => Report::Persisted(self.store(topic, partition, msg)),
            1 => Report::Persisted(self.store_twice(topic, partition, msg)),
            2 => {
                self.store(topic, partition, msg);
                Report::PossiblyPersisted // appended, ACK lost
            }
            3 => hold_back(self, 0),
            _ => fatal(self, Report::NotPersisted),
        }
    }

    /// A broker-side duplicate: `msg` appended twice (a producer's retry after a lost
    /// response); the first copy's position.
    fn store_twice(&mut self, topic: usize, partition: usize, msg: Msg) -> Receipt {
        let rc = self.store(topic, partition, msg.clone());
        self.store(topic, partition, msg);
        rc
    }

    /// Appends `msg` to the partition, unless the served cluster keeps a duplicate window
    /// ([`World::dedup`]) and stored a message with its event id within it: then nothing is
    /// stored, and the answer names the stored copy (JetStream's duplicate PubAck carries the
    /// original sequence).
    pub(super) fn store(&mut self, topic: usize, partition: usize, mut msg: Msg) -> Receipt {
        if let Some(rc) = self.stored_copy(topic, msg.id) {
            return rc;
        }
        msg.stored_at = self.now;
        msg.seq = self.stored;
        self.stored += 1;
        self.broker[topic][partition].push(msg);
        Receipt {
            topic,
            partition,
            offset: self.broker[topic][partition].len() - 1,
        }
    }

    /// Where the duplicate window holds a copy of event `id` on `topic` (none without a
    /// window).
    pub(super) fn stored_copy(&self, topic: usize, id: Uuid) -> Option<Receipt> {
        if !self.dedup {
            return None;
        }
        self.broker[topic]
            .iter()
            .enumerate()
            .find_map(|(partition, log)| {
                log.iter()
                    .position(|m| m.id == id && m.stored_at + DEDUP_WINDOW > self.now)
                    .map(|offset| Receipt {
                        topic,
                        partition,
                        offset,
                    })
            })
    }

    /// A deeper gate's producer is gone with its run (`gen`): of what it held back, what it
    /// had on the wire may still land within a request's round trip, the rest never does.
    /// Per partition that keeps a prefix of what it took (the tails are in the order taken).
    pub(super) fn producer_gone(&mut self, gen: i64) {
        if self.depth == 1 {
            return;
        }
        let cutoff = self.now + self.max_append_delay;
        self.late_appends
            .retain(|(due, _, _, m)| m.relay_gen != gen || *due <= cutoff);
    }

    /// Where a held-back message of run `gen` landed, if it has.
    pub(super) fn landed(
        &self,
        topic: usize,
        partition: usize,
        row: usize,
        gen: i64,
        attempt: i32,
    ) -> Option<Receipt> {
        self.broker[topic][partition]
            .iter()
            .position(|m| m.row == row && m.relay_gen == gen && m.attempt == attempt)
            .map(|offset| Receipt {
                topic,
                partition,
                offset,
            })
    }

    pub(super) fn land_late_appends(&mut self) {
        let now = self.now;
        if self.depth > 1 {
            // A deeper gate's producer delivers a partition in the order it took it: what is
            // due lands by due time, ties in the order sent.
            let (mut due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.late_appends)
                .into_iter()
                .partition(|(d, ..)| *d <= now);
            self.late_appends = later;
            due.sort_by_key(|(d, ..)| *d);
            for (_, t, p, m) in due {
                self.land(t, p, m);
            }
            return;
        }
        let mut k = 0;
        while k < self.late_appends.len() {
            if self.late_appends[k].0 <= now {
                let (_, t, p, m) = self.late_appends.swap_remove(k);
                self.land(t, p, m);
            } else {
                k += 1;
            }
        }
    }

    /// A late append lands: a copy of a purged event reaching the broker is counted
    /// (`purged_early`) unless the duplicate window keeps it out.
    fn land(&mut self, topic: usize, partition: usize, m: Msg) {
        let deduplicated = self.stored_copy(topic, m.id).is_some();
        if !deduplicated && self.rows[m.row].purged {
            self.c.purged_early += 1;
        }
        self.store(topic, partition, m);
    }
}
