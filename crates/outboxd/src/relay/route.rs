//! The route stage: may this relay publish this event, and where?
//!
//! The destination was resolved and frozen at enqueue; the relay never re-resolves it. It
//! only checks that the frozen destination is one this relay actually serves (same broker
//! kind, cluster identity and, for Kafka, partitioner). Publishing an event frozen for cluster A to
//! cluster B would be a cross-destination delivery (invariant 4), so such an event is
//! quarantined with the reason, not sent.

use outbox_core::OutboxEvent;
use outbox_sink::Served;

/// Why an event was refused: a stable code and a sentence naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub reason: String,
}

/// Verifies the envelope (digests, generation) and that the destination is served here.
pub fn check(ev: &OutboxEvent, served: &Served) -> Result<(), Refusal> {
    ev.verify().map_err(|e| Refusal {
        code: e.reason_code(),
        reason: e.to_string(),
    })?;
    let d = &ev.destination;
    let refuse = |field: &str, frozen: &str, here: &str| {
        Refusal {
        code: "destination_not_served",
        reason: format!(
            "event {} is frozen for {field} {frozen:?}, but this relay serves {here:?}; run a relay for that destination and release the event (retries never change the destination)",
            ev.event_id
        ),
    }
    };
    if d.kind != served.kind {
        return Err(refuse("broker kind", &d.kind, served.kind));
    }
    if d.cluster != served.cluster {
        return Err(refuse("dest_cluster", &d.cluster, &served.cluster));
    }
    // A JetStream stream has no partitions (`None`): its partitioner field is not compared.
    if let Some(p) = &served.partitioner {
        if d.partitioner != *p {
            return Err(refuse("dest_partitioner", &d.partitioner, p));
        }
    }
    Ok(())
}
