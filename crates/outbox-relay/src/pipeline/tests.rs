//! One test per decision of the pipeline core, driven with plain values (no broker, no
//! database, no clock).

use outbox_core::delivery::{Delivery, DeliveryOutcome, FailureClass, Persistence};
use outbox_core::records::LedgerItem;
use outbox_core::Lsn;

use super::*;
use crate::testing::*;

fn codes(items: &[LedgerItem]) -> Vec<String> {
    items
        .iter()
        .map(|i| match i {
            LedgerItem::Receipt(r) => format!("receipt:{}", r.offset),
            LedgerItem::Quarantine(q) => format!("quarantine:{}", q.reason_code),
            LedgerItem::Hold(h) => format!("hold:{}", h.reason_code),
            LedgerItem::Held(h) => format!("held:{}", h.aggregate_version),
        })
        .collect()
}

#[test]
fn one_event_per_aggregate_is_in_flight_and_the_report_sends_the_next() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("a", 2), event("b", 1)], 100);
    assert_eq!(cmds.len(), 2, "a/1 and b/1 go out, a/2 waits");
    assert_eq!(c.outstanding(), 3);
    let next = continued(c.on_report(persisted(token(&cmds[0]), 0), now(5)).unwrap());
    assert_eq!(next.len(), 1, "a/2 follows a/1's report");
    let Command::Send { event, attempt, .. } = &next[0];
    assert_eq!((event.aggregate_version, *attempt), (2, 1));
}

#[test]
fn a_deeper_gate_sends_the_next_version_once_the_producer_took_the_last() {
    let versions = |cmds: &[Command]| -> Vec<i64> {
        cmds.iter()
            .map(|Command::Send { event, .. }| event.aggregate_version)
            .collect()
    };
    // Depth 1 (the default): a hand-over releases nothing.
    let mut one = core();
    let cmds = admit_txn(&mut one, &[event("a", 1), event("a", 2)], 100);
    assert_eq!(versions(&cmds), [1]);
    assert!(one.handed_over(token(&cmds[0]), now(1)).unwrap().is_empty());

    let mut c = core();
    c.set_aggregate_depth(3);
    let evs: Vec<_> = (1..=5).map(|v| event("a", v)).collect();
    let cmds = admit_txn(&mut c, &evs, 100);
    assert_eq!(versions(&cmds), [1], "the first of the run goes alone");
    assert!(c.handed_over(token(&cmds[0]), now(1)).unwrap().is_empty());
    let next = continued(c.on_report(persisted(token(&cmds[0]), 0), now(2)).unwrap());
    assert_eq!(versions(&next), [2]);
    let more = c.handed_over(token(&next[0]), now(3)).unwrap();
    assert_eq!(versions(&more), [3], "3 follows 2 before 2's report");
    let more2 = c.handed_over(token(&more[0]), now(4)).unwrap();
    assert_eq!(versions(&more2), [4]);
    assert_eq!(c.in_flight(), 3);
    // A refused hand-over keeps the rest behind it: 4 is parked, 5 waits for its outcome
    // even when room is made.
    c.send_refused(token(&more2[0]), None, "queue full", now(5))
        .unwrap();
    let after = continued(c.on_report(persisted(token(&next[0]), 1), now(6)).unwrap());
    assert!(after.is_empty(), "nothing overtakes the refused 4");
    // A version bound elsewhere waits until nothing of its aggregate is in flight.
    let mut d = core();
    d.set_aggregate_depth(3);
    let moved = {
        let mut e = event("b", 3);
        e.destination.topic = "outbox.elsewhere".into();
        e
    };
    let cmds = admit_txn(&mut d, &[event("b", 1), event("b", 2), moved], 200);
    let next = continued(d.on_report(persisted(token(&cmds[0]), 0), now(2)).unwrap());
    assert_eq!(versions(&next), [2]);
    assert!(d.handed_over(token(&next[0]), now(3)).unwrap().is_empty());
    let last = continued(d.on_report(persisted(token(&next[0]), 1), now(4)).unwrap());
    assert_eq!(versions(&last), [3]);
}

#[test]
fn the_relay_is_round_trip_bound_when_more_events_wait_behind_aggregates_than_are_in_flight() {
    let mut c = core();
    // Two aggregates with one event each: both in flight, nothing waits.
    admit_txn(&mut c, &[event("a", 1), event("b", 1)], 100);
    assert!(!c.round_trip_bound(), "a wide load batches");
    // Two hot aggregates with a backlog: two in flight, four waiting behind them.
    let mut c = core();
    let evs: Vec<_> = (1..=3)
        .flat_map(|v| [event("a", v), event("b", v)])
        .collect();
    let cmds = admit_txn(&mut c, &evs, 100);
    assert_eq!((cmds.len(), c.outstanding()), (2, 6));
    assert!(c.round_trip_bound(), "hot aggregates wait on round trips");
}

#[test]
fn the_checkpoint_passes_a_transaction_only_when_all_its_events_are_resolved() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("b", 1)], 100);
    continued(c.on_report(persisted(token(&cmds[0]), 0), now(1)).unwrap());
    let (items, checkpoint) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(codes(&items), ["receipt:0"]);
    assert_eq!(checkpoint, None, "b/1 is still in flight");
    continued(c.on_report(persisted(token(&cmds[1]), 1), now(2)).unwrap());
    let (_, checkpoint) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(checkpoint, Some(Lsn(100)));
    // Nothing new: no batch, and never a checkpoint at or below the durable one.
    c.checkpoint_committed(Lsn(100));
    assert!(c.take_batch(true).unwrap().is_none());
}

#[test]
fn a_receipt_carries_the_generation_the_attempt_and_the_frozen_digests() {
    let mut c = core();
    let ev = event("a", 1);
    c.retry_generation.insert(ev.event_id, 3);
    let cmds = admit_txn(&mut c, std::slice::from_ref(&ev), 10);
    continued(c.on_report(persisted(token(&cmds[0]), 41), now(1)).unwrap());
    let (items, _) = c.take_batch(true).unwrap().unwrap();
    let LedgerItem::Receipt(r) = &items[0] else {
        panic!("{items:?}")
    };
    assert_eq!((r.attempt, r.relay_generation, r.offset), (3, 7, 41));
    assert_eq!(r.payload_digest, ev.payload_digest);
    assert_eq!(r.destination_digest, ev.destination_digest);
    assert_eq!(
        (r.broker_kind.as_str(), r.broker_cluster.as_str()),
        ("kafka", "c1")
    );
}

#[test]
fn a_possibly_persisted_failure_is_recorded_unknown_and_parks_its_event() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1)], 10);
    let f = unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted);
    let u = f.unknown.expect("an UNKNOWN attempt to record");
    assert_eq!((u.partition, u.attempt), (2, 1));
    assert_eq!(u.sent_at, now(0).wall);
}

#[test]
fn a_not_persisted_failure_parks_its_event_without_an_unknown_record() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1)], 10);
    let f = unclear(&mut c, token(&cmds[0]), Persistence::NotPersisted);
    assert_eq!(f.unknown, None);
    assert!(c.take_batch(true).unwrap().is_none(), "nothing resolved");
}

#[test]
fn a_permanent_rejection_quarantines_the_event_and_holds_what_waits_behind_it() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("a", 2)], 10);
    let next = continued(
        c.on_report(
            failed(
                token(&cmds[0]),
                Persistence::NotPersisted,
                FailureClass::Permanent,
            ),
            now(1),
        )
        .unwrap(),
    );
    assert!(next.is_empty(), "a/2 is held, not sent");
    let (items, checkpoint) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(
        codes(&items),
        [
            "quarantine:broker_rejected",
            "hold:broker_rejected",
            "held:2"
        ]
    );
    assert_eq!(
        checkpoint,
        Some(Lsn(10)),
        "quarantined and held events are resolved"
    );
    // A later event of the held aggregate is recorded as held too.
    let later = admit_txn(&mut c, &[event("a", 3)], 20);
    assert!(later.is_empty());
    c.checkpoint_committed(Lsn(10));
    let (items, _) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(codes(&items), ["held:3"]);
}

#[test]
fn a_refusal_by_the_producer_quarantines_only_when_permanent() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("b", 1)], 10);
    c.send_refused(
        token(&cmds[0]),
        Some("too large".into()),
        "too large",
        now(1),
    )
    .unwrap();
    c.send_refused(token(&cmds[1]), None, "queue full", now(1))
        .unwrap();
    assert_eq!(c.in_flight(), 0);
    assert_eq!(c.parked(), 1, "b/1 waits to be sent again");
    assert_eq!(c.in_flight_bytes(), 0);
    let (items, checkpoint) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(
        codes(&items),
        ["quarantine:broker_rejected", "hold:broker_rejected"]
    );
    assert_eq!(checkpoint, None, "b/1 is not resolved");
    let steps = c.due_unclear(now(201)).unwrap();
    assert!(
        matches!(
            steps.as_slice(),
            [UnclearStep::Send(Command::Send { attempt: 1, .. })]
        ),
        "{steps:?}"
    );
    assert!(matches!(
        c.send_refused(99, None, "?", now(2)),
        Err(CoreError::UnknownToken(99))
    ));
}

#[test]
fn without_the_lease_nothing_is_sent_and_the_event_stays_unresolved() {
    let mut c = core();
    let txn = c.tracker.begin().unwrap();
    let tok = c.tracker.add_event(txn).unwrap();
    c.tracker.commit(txn, Lsn(10)).unwrap();
    let stale = Now {
        lease_valid: false,
        ..now(0)
    };
    let cmds = c
        .admit(event("a", 1), Some(Lsn(10)), Some(Lsn(9)), Some(tok), stale)
        .unwrap();
    assert!(cmds.is_empty());
    assert!(c.lease_expired);
    assert!(c.take_batch(true).unwrap().is_none());
}

#[test]
fn a_salvaging_run_records_reports_but_sends_nothing_more() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("a", 2)], 10);
    c.begin_salvage();
    let next = continued(c.on_report(persisted(token(&cmds[0]), 0), now(1)).unwrap());
    assert!(next.is_empty(), "a/2 is not sent while salvaging");
    let (items, _) = c.take_batch(false).unwrap().unwrap();
    assert_eq!(codes(&items), ["receipt:0"]);
}

#[test]
fn an_event_for_another_cluster_is_quarantined_at_the_head_of_its_aggregate() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event_for("a", 2, "elsewhere")], 10);
    assert_eq!(cmds.len(), 1);
    // a/2 reaches the head only when a/1 is reported on; then it is refused.
    let next = continued(c.on_report(persisted(token(&cmds[0]), 0), now(1)).unwrap());
    assert!(next.is_empty());
    let (items, checkpoint) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(
        codes(&items),
        [
            "receipt:0",
            "quarantine:destination_not_served",
            "hold:destination_not_served"
        ]
    );
    assert_eq!(checkpoint, Some(Lsn(10)));
}

#[test]
fn a_version_gap_holds_the_aggregate_instead_of_publishing_past_it() {
    let mut c = PipelineCore::new(
        served(),
        1,
        PipelineCore::gate_from(vec![(("order".into(), "a".into()), 4)], Vec::new()),
    );
    let cmds = admit_txn(&mut c, &[event("a", 6)], 10);
    assert!(cmds.is_empty());
    let (items, _) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(codes(&items), ["hold:version_gap", "held:6"]);
}

#[test]
fn an_event_reconciliation_found_is_never_sent_again() {
    let mut c = core();
    let ev = event("a", 1);
    c.found.insert(ev.event_id);
    let cmds = admit_txn(&mut c, &[ev, event("a", 2)], 10);
    assert_eq!(cmds.len(), 1);
    let Command::Send { event, .. } = &cmds[0];
    assert_eq!(
        event.aggregate_version, 2,
        "a/1 is skipped as found, a/2 goes"
    );
}

#[test]
fn a_failed_acceptance_puts_its_batch_back_unless_it_was_fenced_after_commit() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("b", 1)], 10);
    continued(c.on_report(persisted(token(&cmds[0]), 0), now(1)).unwrap());
    let (first, _) = c.take_batch(true).unwrap().unwrap();
    continued(c.on_report(persisted(token(&cmds[1]), 1), now(2)).unwrap());
    c.restore_batch(first.clone(), false);
    assert_eq!(
        codes(&c.take_batch(false).unwrap().unwrap().0),
        ["receipt:0", "receipt:1"]
    );
    // Fenced: the transaction committed, so its items are recorded already.
    c.restore_batch(first, true);
    assert!(c.take_batch(false).unwrap().is_none());
}

#[test]
fn in_flight_bytes_follow_sends_and_reports() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("b", 1)], 10);
    let sent: usize = cmds
        .iter()
        .map(|Command::Send { event, .. }| event.payload.len())
        .sum();
    assert_eq!(c.in_flight_bytes(), sent);
    continued(c.on_report(persisted(token(&cmds[0]), 0), now(1)).unwrap());
    continued(c.on_report(persisted(token(&cmds[1]), 1), now(1)).unwrap());
    assert_eq!(c.in_flight_bytes(), 0);
    assert!(matches!(
        c.on_report(persisted(token(&cmds[1]), 1), now(1)),
        Err(CoreError::UnknownToken(_))
    ));
}

#[test]
fn a_success_report_without_a_position_is_unknown_never_a_receipt() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("b", 1)], 10);
    // librdkafka's implicit ack: "delivered", offset -1001, nothing stored.
    let implicit = Delivery {
        token: token(&cmds[0]),
        outcome: DeliveryOutcome::Persisted {
            topic: "outbox.order".into(),
            partition: 0,
            offset: -1001,
            timestamp_ms: None,
            duplicate: false,
            evidence: None,
        },
    };
    let Reported::Unclear(f) = c.on_report(implicit, now(1)).unwrap() else {
        panic!("an implicit ack became a receipt")
    };
    assert_eq!(f.persistence, Persistence::PossiblyPersisted);
    assert!(f.unknown.is_some(), "the attempt is recorded UNKNOWN");
    // A report for another topic than the frozen one proves nothing either.
    let elsewhere = Delivery {
        token: token(&cmds[1]),
        outcome: DeliveryOutcome::Persisted {
            topic: "outbox.other".into(),
            partition: 0,
            offset: 5,
            timestamp_ms: None,
            duplicate: false,
            evidence: None,
        },
    };
    assert!(matches!(
        c.on_report(elsewhere, now(2)).unwrap(),
        Reported::Unclear(_)
    ));
    assert!(c.take_batch(true).unwrap().is_none(), "no receipt");
}

#[test]
fn a_version_gap_holds_what_waits_behind_the_in_flight_event_too() {
    let mut c = core();
    let sent = admit_txn(&mut c, &[event("a", 1), event("a", 2), event("a", 4)], 100);
    assert_eq!(sent.len(), 1, "a/1 goes out, a/2 waits, a/4 is past a gap");
    assert_eq!(
        c.outstanding(),
        1,
        "a/2 is held, not left queued behind a/1"
    );
    assert!(continued(c.on_report(persisted(token(&sent[0]), 0), now(1)).unwrap()).is_empty());
    assert_eq!(c.outstanding(), 0);
    let (items, checkpoint) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(
        codes(&items),
        ["hold:version_gap", "held:4", "held:2", "receipt:0"]
    );
    assert_eq!(checkpoint, Some(Lsn(100)), "every event is resolved");
}

#[test]
fn heads_raised_after_reconciliation_are_no_gap() {
    let mut c = core();
    // Reconciliation found version 3 of `a` on the broker and accepted its receipt.
    c.raise_heads(vec![(("order".into(), "a".into()), 3)]);
    let sent = admit_txn(&mut c, &[event("a", 4)], 100);
    assert_eq!(sent.len(), 1, "version 4 follows the raised head");
    // Raising never lowers.
    c.raise_heads(vec![(("order".into(), "a".into()), 1)]);
    continued(c.on_report(persisted(token(&sent[0]), 0), now(1)).unwrap());
    let sent = admit_txn(&mut c, &[event("a", 5)], 200);
    assert_eq!(sent.len(), 1);
}

/// What the daemon looks up before admitting: each aggregate the gate does not know, once, in
/// the order met; a head given back (0 included) makes it known, and a gap past it holds.
#[test]
fn unknown_aggregates_are_named_once_and_known_once_their_heads_are_given() {
    let mut c = core();
    let evs = [event("a", 4), event("b", 1), event("a", 5)];
    let key = |id: &str| (evs[0].aggregate_type.clone(), id.to_string());
    assert_eq!(
        c.unknown_aggregates(&evs),
        vec![(key("a"), 4), (key("b"), 1)]
    );
    assert!(!c.knows_aggregate_of(&evs[0]));
    // A found copy's version raises only what the gate knows: a stays unknown, its whole head
    // read when met.
    c.raise_known_heads(vec![(key("a"), 2)]);
    assert!(!c.knows_aggregate_of(&evs[0]));
    c.raise_heads(vec![(key("a"), 3), (key("b"), 0)]);
    assert!(c.unknown_aggregates(&evs).is_empty());
    assert!(c.knows_aggregate_of(&evs[1]));
    assert_eq!(c.known_aggregates().len(), 2);
    // a's head 3: v4 and v5 follow it; b's head 0: v1 follows it. A v7 of b would be a gap.
    let sent = admit_txn(&mut c, &evs, 100);
    assert_eq!(
        sent.len(),
        2,
        "a v4 and b v1 in flight, a v5 queued behind a v4"
    );
    assert!(c.take_batch(true).unwrap().is_none(), "nothing held");
    admit_txn(&mut c, &[event("b", 7)], 200);
    let (items, _) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(codes(&items), vec!["hold:version_gap", "held:7"]);
}

/// The numbering's one-allocation key names exactly one aggregate: it gives back the pair it
/// was made of, and pairs that concatenate alike stay apart.
#[test]
fn a_numbering_key_names_one_aggregate() {
    for (t, i) in [("order", "o-1"), ("", "x"), ("a b", ""), ("ünï", "😀/../1")] {
        assert_eq!(
            agg_of_num_key(&num_key(t, i)),
            (t.to_string(), i.to_string())
        );
    }
    assert_ne!(num_key("ab", "c"), num_key("a", "bc"));
}
