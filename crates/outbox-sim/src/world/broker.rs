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
            1 => {
                // A broker-side duplicate (producer retry after a lost response).
                let rc = self.store(topic, partition, msg.clone());
                self.store(topic, partition, msg);
                Report::Persisted(rc)
            }
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

    /// Appends `msg` to the partition, unless the served cluster keeps a duplicate window
    /// ([`World::dedup`]) and stored a message with its event id within it: then nothing is
    /// stored, and the answer names the stored copy (JetStream's duplicate PubAck carries the
    /// original sequence).
    pub(super) fn store(&mut self, topic: usize, partition: usize, mut msg: Msg) -> Receipt {
        if let Some(rc) = self.stored_copy(topic, msg.id) {
            return rc;
        }
        msg.stored_at = self.now;
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

    pub(super) fn land_late_appends(&mut self) {
        let now = self.now;
        let mut k = 0;
        while k < self.late_appends.len() {
            if self.late_appends[k].0 <= now {
                let (_, t, p, m) = self.late_appends.swap_remove(k);
                let deduplicated = self.stored_copy(t, m.id).is_some();
                if !deduplicated && self.rows[m.row].purged {
                    self.c.purged_early += 1;
                }
                self.store(t, p, m);
            } else {
                k += 1;
            }
        }
    }
}
