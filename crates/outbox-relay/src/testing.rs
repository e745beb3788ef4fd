//! Values the relay core's unit tests share: what the sink serves, events, the time, and
//! delivery reports.

use std::time::{Duration, SystemTime};

use outbox_core::delivery::{Delivery, DeliveryOutcome, FailureClass, Persistence, Served};
use outbox_core::{Destination, EventToken, Lsn, OutboxEvent, TxnSeq};

use crate::pipeline::{Command, DeliveryFailure, Now, PipelineCore, Reported};

pub(crate) fn served() -> Served {
    Served {
        kind: "kafka",
        clusters: vec!["c1".into()],
        partitioner: Some("murmur2_random".into()),
    }
}

pub(crate) fn event(aggregate: &str, version: i64) -> OutboxEvent {
    event_for(aggregate, version, "c1")
}

pub(crate) fn event_for(aggregate: &str, version: i64, cluster: &str) -> OutboxEvent {
    let destination = Destination::kafka(cluster, "outbox.order", aggregate);
    OutboxEvent::frozen(
        uuid::Uuid::now_v7(),
        ("order", aggregate, version),
        "order.changed",
        bytes::Bytes::from(format!("{{\"v\":{version}}}")),
        destination,
    )
}

pub(crate) fn now(ms: u64) -> Now {
    Now {
        wall: SystemTime::UNIX_EPOCH + Duration::from_millis(ms),
        lease_valid: true,
    }
}

pub(crate) fn core() -> PipelineCore {
    PipelineCore::new(served(), 7, PipelineCore::gate_from(Vec::new(), Vec::new()))
}

/// One transaction of `events.len()` events: admits each, returns the commands.
pub(crate) fn admit_txn(c: &mut PipelineCore, events: &[OutboxEvent], end: u64) -> Vec<Command> {
    let txn: TxnSeq = c.tracker.begin().unwrap();
    let tokens: Vec<EventToken> = events
        .iter()
        .map(|_| c.tracker.add_event(txn).unwrap())
        .collect();
    c.tracker.commit(txn, Lsn(end)).unwrap();
    let mut cmds = Vec::new();
    for (ev, tok) in events.iter().zip(tokens) {
        cmds.extend(
            c.admit(
                ev.clone(),
                Some(Lsn(end)),
                Some(Lsn(end - 1)),
                Some(tok),
                now(0),
            )
            .unwrap(),
        );
    }
    cmds
}

pub(crate) fn token(c: &Command) -> u64 {
    match c {
        Command::Send { token, .. } => *token,
    }
}

pub(crate) fn persisted(token: u64, offset: i64) -> Delivery {
    Delivery {
        token,
        outcome: DeliveryOutcome::Persisted {
            topic: "outbox.order".into(),
            partition: 0,
            offset,
            timestamp_ms: None,
            duplicate: false,
            evidence: None,
        },
    }
}

pub(crate) fn failed(token: u64, persistence: Persistence, class: FailureClass) -> Delivery {
    Delivery {
        token,
        outcome: DeliveryOutcome::Failed {
            error: "boom".into(),
            persistence,
            class,
            partition: 2,
        },
    }
}

/// Reports a transient failure of the only event in flight; it must park, not be accepted.
pub(crate) fn unclear(
    c: &mut PipelineCore,
    token: u64,
    persistence: Persistence,
) -> DeliveryFailure {
    match c
        .on_report(
            failed(token, persistence, FailureClass::Transient),
            now(1500),
        )
        .unwrap()
    {
        Reported::Unclear(f) => f,
        Reported::Continue(_) => panic!("an unclear outcome was taken as clear"),
    }
}

pub(crate) fn continued(r: Reported) -> Vec<Command> {
    match r {
        Reported::Continue(c) => c,
        Reported::Unclear(f) => panic!("failed: {f:?}"),
    }
}
