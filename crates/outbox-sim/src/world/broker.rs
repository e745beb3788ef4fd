//! The simulated broker: two clusters of partitioned logs that take the relay's sends and
//! decide, with the world's faults, what each delivery report says (persisted, a broker-side
//! duplicate, an ACK lost, a late append, an implicit ack without a position, a refusal).

use super::*;

#[derive(Clone)]
pub(super) struct Msg {
    /// The event id the message carries (header `id`), as sent.
    pub(super) id: Uuid,
    pub(super) row: usize,
    pub(super) dest_digest: String,
    pub(super) relay_gen: i64,
    pub(super) attempt: i32,
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
        let append = |w: &mut World, m: Msg| {
            w.broker[topic][partition].push(m);
            Receipt {
                topic,
                partition,
                offset: w.broker[topic][partition].len() - 1,
            }
        };
        if self.now < self.down_until[topic] {
            if self.rng.chance(500) {
                let due = self.now + self.rng.range(1, self.max_append_delay);
                self.late_appends.push((due, topic, partition, msg));
                return Report::PossiblyPersisted;
            }
            return Report::NotPersisted;
        }
        if !self.faults {
            return Report::Persisted(append(self, msg));
        }
        match self.rng.weighted(&[860, 30, 40, 30, 20, 20]) {
            0 => Report::Persisted(append(self, msg)),
            1 => {
                // A broker-side duplicate (producer retry after a lost response).
                let rc = append(self, msg.clone());
                append(self, msg);
                Report::Persisted(rc)
            }
            2 => {
                append(self, msg);
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

    pub(super) fn land_late_appends(&mut self) {
        let now = self.now;
        let mut k = 0;
        while k < self.late_appends.len() {
            if self.late_appends[k].0 <= now {
                let (_, t, p, m) = self.late_appends.swap_remove(k);
                if self.rows[m.row].purged {
                    self.c.purged_early += 1;
                }
                self.broker[t][p].push(m);
            } else {
                k += 1;
            }
        }
    }
}
