//! The route stage: may this relay publish this event, and where?
//!
//! The destination was resolved and frozen at enqueue; the relay never re-resolves it. It
//! only checks that the frozen destination is one this relay actually serves (same broker
//! kind, cluster identity and, for Kafka, partitioner). Publishing an event frozen for cluster A to
//! cluster B would be a cross-destination delivery (invariant 4), so such an event is
//! quarantined with the reason, not sent.

use outbox_core::delivery::Served;
use outbox_core::OutboxEvent;

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
    if !served.clusters.contains(&d.cluster) {
        return Err(refuse(
            "dest_cluster",
            &d.cluster,
            &served.clusters.join(", "),
        ));
    }
    // A JetStream stream has no partitions (`None`): its partitioner field is not compared.
    if let Some(p) = &served.partitioner {
        if d.partitioner != *p {
            return Err(refuse("dest_partitioner", &d.partitioner, p));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, cluster: &str, partitioner: &str) -> OutboxEvent {
        let destination = outbox_core::Destination {
            kind: kind.into(),
            cluster: cluster.into(),
            topic: "outbox.order.o-42".into(),
            key: "o-42".into(),
            partitioner: partitioner.into(),
            route_generation: 1,
            serializer: "json".into(),
            acks: "all".into(),
        };
        let payload = bytes::Bytes::from_static(b"{}");
        OutboxEvent::frozen(
            uuid::Uuid::now_v7(),
            ("order", "o-42", 1),
            "order.created",
            payload,
            destination,
        )
    }

    #[test]
    fn a_relay_serves_only_its_broker_kind_and_cluster() {
        let nats = Served {
            kind: "nats",
            clusters: vec!["n1".into()],
            partitioner: None,
        };
        let kafka = Served {
            kind: "kafka",
            clusters: vec!["default".into()],
            partitioner: Some("murmur2_random".into()),
        };
        // A stream has no partitions: the frozen partitioner is not compared for NATS.
        assert_eq!(check(&event("nats", "n1", "none"), &nats), Ok(()));
        assert_eq!(check(&event("nats", "n1", "murmur2_random"), &nats), Ok(()));
        for (ev, served) in [
            (event("kafka", "n1", "none"), &nats),
            (event("nats", "n2", "none"), &nats),
            (event("nats", "default", "murmur2_random"), &kafka),
            (event("kafka", "default", "consistent"), &kafka),
        ] {
            let r = check(&ev, served).unwrap_err();
            assert_eq!(r.code, "destination_not_served", "{}", r.reason);
        }
    }

    #[test]
    fn an_http_relay_serves_each_of_its_endpoints_and_no_other() {
        let http = Served {
            kind: "http",
            clusters: vec!["partner-a".into(), "partner-b".into()],
            partitioner: None,
        };
        assert_eq!(check(&event("http", "partner-a", "none"), &http), Ok(()));
        assert_eq!(check(&event("http", "partner-b", "none"), &http), Ok(()));
        let r = check(&event("http", "partner-c", "none"), &http).unwrap_err();
        assert_eq!(r.code, "destination_not_served");
        assert!(
            r.reason.contains("\"partner-c\"") && r.reason.contains("partner-a, partner-b"),
            "{}",
            r.reason
        );
    }
}
