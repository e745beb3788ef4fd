//! What a batch of exactly-once mode writes in the ledger, and under which identity: the
//! receipts and kept events [`super::TxnStep::Accept`] names, as ledger records, and the
//! transactional id and record key of a slot's stream. Pure: the daemon (`relay/txn.rs`)
//! executes the acceptance with them.

use outbox_core::records::{HeldRecord, HoldRecord, LedgerItem, QuarantineRecord, ReceiptRecord};
use outbox_core::{Lsn, OutboxEvent};

use super::{Kept, TxnReceipt};

/// Whose transactions and records these are: one slot of one database.
#[derive(Debug, Clone)]
pub struct StreamIdentity {
    /// The producer's transactional id: `outboxd-<cluster>-<system id>-<database>-<slot>`,
    /// stable across restarts, takeovers and the slot's re-creation, so that the next holder
    /// fences every earlier one; another database's slot of the same name is another id.
    pub transactional_id: String,
    /// The key of the batch records: the same with the slot's incarnation (the consistent
    /// point its ledger row was created at). A start accepts only its incarnation's records:
    /// a slot created again (`--resnapshot`), or a ledger made anew, never takes an earlier
    /// one's batches, whose positions are not its stream's.
    pub record_key: String,
}

impl StreamIdentity {
    pub fn new(
        cluster: &str,
        system_id: &str,
        database: &str,
        slot: &str,
        incarnation: Lsn,
    ) -> Self {
        let transactional_id = format!("outboxd-{cluster}-{system_id}-{database}-{slot}");
        StreamIdentity {
            record_key: format!("{transactional_id}@{incarnation}"),
            transactional_id,
        }
    }
}

impl TxnReceipt {
    /// The receipt of `ev` at this position, by the run of `generation`; `commit_lsn` and
    /// `change_lsn` where the run read the event from the stream (none for a batch accepted
    /// from the broker's record at a start).
    pub fn record(
        &self,
        ev: &OutboxEvent,
        generation: i64,
        commit_lsn: Option<Lsn>,
        change_lsn: Option<Lsn>,
    ) -> LedgerItem {
        let r = self;
        LedgerItem::Receipt(ReceiptRecord {
            event_id: ev.event_id,
            aggregate_version: ev.aggregate_version,
            payload_digest: ev.payload_digest.clone(),
            destination_digest: ev.destination_digest.clone(),
            broker_kind: "kafka".into(),
            broker_cluster: ev.destination.cluster.clone(),
            topic: ev.destination.topic.clone(),
            partition: r.partition,
            offset: r.offset,
            timestamp_ms: None,
            attempt: 1,
            relay_generation: generation,
            commit_lsn,
            change_lsn,
            evidence: None,
        })
    }
}

impl Kept {
    /// The ledger's records of an event a batch kept without sending it: a quarantine and its
    /// aggregate's hold, or a held record (`ev`: its row, where the run has it).
    pub fn records(&self, ev: Option<&OutboxEvent>, commit_lsn: Option<Lsn>) -> Vec<LedgerItem> {
        let k = self;
        let generation = ev.map(|e| e.envelope_generation);
        match &k.quarantined {
            Some((code, reason)) => vec![
                LedgerItem::Quarantine(QuarantineRecord {
                    key: k.event_id.to_string(),
                    event_id: Some(k.event_id),
                    aggregate_type: Some(k.aggregate.0.clone()),
                    aggregate_id: Some(k.aggregate.1.clone()),
                    aggregate_version: Some(k.version),
                    reason_code: code.clone(),
                    reason: reason.clone(),
                    commit_lsn: commit_lsn.unwrap_or(Lsn::ZERO),
                    envelope_generation: generation,
                }),
                LedgerItem::Hold(HoldRecord {
                    aggregate_type: k.aggregate.0.clone(),
                    aggregate_id: k.aggregate.1.clone(),
                    reason_code: code.clone(),
                    reason: reason.clone(),
                    blocking_event_id: Some(k.event_id),
                    blocking_version: Some(k.version),
                    blocking_generation: generation,
                    blocking_by_relay: None,
                }),
            ],
            None => vec![LedgerItem::Held(HeldRecord {
                event_id: k.event_id,
                aggregate_type: k.aggregate.0.clone(),
                aggregate_id: k.aggregate.1.clone(),
                aggregate_version: k.version,
                commit_lsn,
                by_relay: None,
            })],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::Destination;
    use uuid::Uuid;

    #[test]
    fn a_slot_of_another_database_or_incarnation_has_other_transactions_or_records() {
        let at =
            |db: &str, slot: &str, cp: u64| StreamIdentity::new("k", "7301", db, slot, Lsn(cp));
        let a = at("shop", "outboxd", 0x10);
        assert_eq!(a.transactional_id, "outboxd-k-7301-shop-outboxd");
        assert_ne!(
            a.transactional_id,
            at("billing", "outboxd", 0x10).transactional_id
        );
        // The slot created again: the same producer (it fences the earlier), other records.
        let again = at("shop", "outboxd", 0x20);
        assert_eq!(a.transactional_id, again.transactional_id);
        assert_ne!(a.record_key, again.record_key);
    }

    #[test]
    fn a_receipt_is_the_broker_position_with_the_row_and_a_kept_event_its_quarantine_or_held_record(
    ) {
        let ev = OutboxEvent::frozen(
            Uuid::now_v7(),
            ("order", "o-1", 3),
            "order.changed",
            bytes::Bytes::from_static(b"{}"),
            Destination::kafka("c1", "outbox.order", "o-1"),
        );
        let r = TxnReceipt {
            event_id: ev.event_id,
            partition: 2,
            offset: 41,
        };
        let LedgerItem::Receipt(rec) = r.record(&ev, 7, Some(Lsn(9)), None) else {
            panic!("not a receipt");
        };
        assert_eq!(
            (
                rec.partition,
                rec.offset,
                rec.relay_generation,
                rec.aggregate_version
            ),
            (2, 41, 7, 3)
        );
        assert_eq!(
            (rec.topic.as_str(), rec.commit_lsn),
            ("outbox.order", Some(Lsn(9)))
        );
        let refused = Kept::of(&ev, Some(("message_too_large", "too big".into())));
        let items = refused.records(Some(&ev), Some(Lsn(9)));
        assert!(matches!(
            items.as_slice(),
            [LedgerItem::Quarantine(q), LedgerItem::Hold(h)]
                if q.event_id == Some(ev.event_id) && h.blocking_version == Some(3)
        ));
        let held = Kept::of(&ev, None).records(None, None);
        assert!(matches!(held.as_slice(), [LedgerItem::Held(h)] if h.aggregate_version == 3));
    }
}
