//! An unclear outcome holds one aggregate: the decisions of `unclear.rs`, driven with plain
//! values.

use std::time::Duration;

use outbox_core::delivery::Persistence;
use outbox_core::Lsn;

use super::unclear::{OpenAttempt, ParkedInput, ParkedLookup, ParkedStep};
use super::*;
use crate::testing::*;

fn lookups(steps: &[UnclearStep]) -> Vec<(String, i64)> {
    steps
        .iter()
        .filter_map(|s| match s {
            UnclearStep::Lookup { event } => {
                Some((event.aggregate_id.clone(), event.aggregate_version))
            }
            UnclearStep::Send(_) => None,
        })
        .collect()
}

#[test]
fn an_unclear_outcome_holds_its_aggregate_and_every_other_aggregate_flows() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("a", 2), event("b", 1)], 100);
    assert_eq!(cmds.len(), 2, "a/1 and b/1 out");
    let f = unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted);
    assert!(f.unknown.is_some());
    assert_eq!(c.parked(), 1);
    assert_eq!(
        c.outstanding(),
        3,
        "a/1 parked, a/2 queued behind it, b/1 in flight"
    );
    // b flows: its receipt is accepted; the checkpoint stays behind a/1 (same transaction).
    let next = continued(
        c.on_report(persisted(token(&cmds[1]), 5), now(1600))
            .unwrap(),
    );
    assert!(next.is_empty(), "a/2 is not sent while a/1 is unclear");
    let (items, checkpoint) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(
        checkpoint, None,
        "the checkpoint never passes the unclear event"
    );
    // b's next event goes out at once, a's does not.
    let more = admit_txn(&mut c, &[event("b", 2), event("a", 3)], 200);
    assert_eq!(more.len(), 1);
    let Command::Send { event: sent, .. } = &more[0];
    assert_eq!(sent.aggregate_id, "b");
    // What waits on a/1 (a/1, a/2, a/3) is counted apart from b/2 in flight: the schedule
    // does not let it stop the slot being read for b.
    let waiting = c.waiting_on_unclear(now(1600).wall);
    assert_eq!(waiting.events, 3);
    let payloads: u64 = [event("a", 1), event("a", 2), event("a", 3)]
        .iter()
        .map(|e| e.payload.len() as u64)
        .sum();
    assert_eq!(waiting.bytes, payloads);
    assert_eq!(c.outstanding(), 4);
}

#[test]
fn a_send_unanswered_for_five_seconds_counts_with_what_waits_behind_it() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("a", 2), event("b", 1)], 100);
    assert_eq!(cmds.len(), 2, "a/1 and b/1 out");
    let sent = now(0).wall;
    let waiting = |c: &PipelineCore, after_ms: u64| {
        c.waiting_on_unclear(sent + Duration::from_millis(after_ms))
            .events
    };
    assert_eq!(waiting(&c, 0), 0, "just sent: in flight, not waiting");
    // b answers; a/1 does not (a partition without a leader): past UNANSWERED_AFTER a/1 and
    // a/2 behind it wait on an outcome becoming unclear.
    continued(
        c.on_report(persisted(token(&cmds[1]), 5), now(1600))
            .unwrap(),
    );
    let later = UNANSWERED_AFTER.as_millis() as u64 + 2_000;
    assert_eq!(waiting(&c, later), 2);
    assert_eq!(waiting(&c, 1_000), 0);
}

#[test]
fn the_look_up_is_due_after_the_backoff_and_settle_and_a_recorded_copy_frees_the_aggregate() {
    let mut c = core();
    c.unclear_policy.settle = Duration::from_millis(5_000);
    let cmds = admit_txn(&mut c, &[event("a", 1), event("a", 2)], 100);
    unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted);
    // Reported at 1500 ms: the settle (5 s from the report) outlasts the backoff.
    assert_eq!(
        c.next_unclear_due(),
        Some(now(6_500).wall),
        "first look-up after the settle time"
    );
    assert!(c.due_unclear(now(6_499)).unwrap().is_empty());
    let steps = c.due_unclear(now(6_500)).unwrap();
    assert_eq!(lookups(&steps), [("a".to_string(), 1)]);
    assert!(
        c.due_unclear(now(9_000)).unwrap().is_empty(),
        "one look-up at a time"
    );
    assert_eq!(c.next_unclear_due(), None, "nothing waits while it runs");
    let UnclearStep::Lookup { event } = &steps[0] else {
        unreachable!()
    };
    let next = c
        .lookup_done(event.event_id, LookupOutcome::Recorded, now(5_100))
        .unwrap();
    let Command::Send { event: a2, .. } = &next[0];
    assert_eq!(
        a2.aggregate_version, 2,
        "the aggregate's next event follows"
    );
    assert_eq!(c.parked(), 0);
    // The recorded copy resolved a/1 in the tracker: once a/2's receipt is in, the checkpoint
    // passes the transaction.
    continued(
        c.on_report(persisted(token(&next[0]), 9), now(5_200))
            .unwrap(),
    );
    let (_, checkpoint) = c.take_batch(true).unwrap().unwrap();
    assert_eq!(checkpoint, Some(Lsn(100)));
}

#[test]
fn a_proven_absent_copy_is_sent_again_with_the_next_attempt_to_the_same_destination() {
    let mut c = core();
    let ev = event("a", 1);
    let cmds = admit_txn(&mut c, std::slice::from_ref(&ev), 100);
    unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted);
    let steps = c.due_unclear(now(60_000)).unwrap();
    assert_eq!(steps.len(), 1);
    let sends = c
        .lookup_done(
            ev.event_id,
            LookupOutcome::Retry {
                attempt_generation: 2,
            },
            now(60_001),
        )
        .unwrap();
    let Command::Send { event, attempt, .. } = &sends[0];
    assert_eq!(*attempt, 2);
    assert_eq!(event.destination_digest, ev.destination_digest);
}

#[test]
fn a_message_not_stored_is_sent_again_as_it_is_after_the_backoff() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1)], 100);
    let f = unclear(&mut c, token(&cmds[0]), Persistence::NotPersisted);
    assert_eq!(f.unknown, None, "nothing to look up");
    let due = c.next_unclear_due().unwrap();
    assert_eq!(due, now(1_700).wall, "200 ms after the report");
    let steps = c.due_unclear(now(1_700)).unwrap();
    let [UnclearStep::Send(Command::Send { attempt, .. })] = steps.as_slice() else {
        panic!("{steps:?}")
    };
    assert_eq!(*attempt, 1, "nothing was stored: the same attempt");
    assert_eq!(c.parked(), 0);
    assert_eq!(c.in_flight(), 1);
}

#[test]
fn unresolved_look_ups_back_off_honour_retry_after_and_past_the_budget_keep_waiting_loudly() {
    let mut c = core();
    c.unclear_policy.budget = 4;
    let cmds = admit_txn(&mut c, &[event("a", 1), event("a", 2)], 100);
    let id = match &cmds[0] {
        Command::Send { event, .. } => event.event_id,
    };
    unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted); // try 1
    let mut t = 1_500;
    let mut waits = Vec::new();
    for tries in 2..=4 {
        let at = c.next_unclear_due().unwrap();
        t = at.duration_since(now(0).wall).unwrap().as_millis() as u64;
        assert_eq!(c.due_unclear(now(t)).unwrap().len(), 1);
        let after = (tries == 3).then_some(Duration::from_secs(7));
        c.lookup_done(
            id,
            LookupOutcome::Unresolved {
                error: "503".into(),
                after,
            },
            now(t),
        )
        .unwrap();
        waits.push(
            c.next_unclear_due()
                .unwrap()
                .duration_since(now(t).wall)
                .unwrap(),
        );
    }
    assert_eq!(
        waits,
        [
            Duration::from_millis(400),
            Duration::from_secs(7),
            Duration::from_millis(1_600)
        ],
        "doubling, and never sooner than Retry-After"
    );
    assert!(
        c.take_batch(true).unwrap().is_none(),
        "nothing resolved yet"
    );
    assert_eq!(c.past_budget(), 0);
    assert_eq!(c.due_unclear(now(t + 1_600)).unwrap().len(), 1);
    let sends = c
        .lookup_done(
            id,
            LookupOutcome::Unresolved {
                error: "timeout".into(),
                after: None,
            },
            now(t + 1_600),
        )
        .unwrap();
    // Past the budget: still parked, never held (a hold could go stale), asked again at the
    // longest wait; a/2 still waits behind it.
    assert!(sends.is_empty());
    assert_eq!((c.parked(), c.past_budget()), (1, 1));
    assert!(
        c.take_batch(true).unwrap().is_none(),
        "no quarantine, no hold"
    );
    assert_eq!(
        c.next_unclear_due().unwrap(),
        now(t + 1_600).wall + Duration::from_millis(3_200)
    );
    assert_eq!(c.outstanding(), 2);
}

#[test]
fn nothing_is_looked_up_or_resent_without_the_lease_or_while_the_run_ends() {
    let mut c = core();
    let cmds = admit_txn(&mut c, &[event("a", 1), event("b", 1)], 100);
    unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted);
    let mut stale = now(60_000);
    stale.lease_valid = false;
    assert!(c.due_unclear(stale).unwrap().is_empty());
    c.begin_salvage();
    assert!(c.due_unclear(now(60_000)).unwrap().is_empty());
}

#[test]
fn an_attempt_left_open_at_start_parks_its_event_for_a_look_up_instead_of_sending_it() {
    let mut c = core();
    let ev = event("a", 1);
    c.open_at_start.insert(ev.event_id, now(3_000).wall);
    let cmds = admit_txn(&mut c, &[ev.clone(), event("a", 2), event("b", 1)], 100);
    assert_eq!(cmds.len(), 1, "only b/1 is sent");
    assert_eq!(c.parked(), 1);
    assert!(c.is_parked(ev.event_id));
    assert!(
        c.due_unclear(now(2_999)).unwrap().is_empty(),
        "after its settle time"
    );
    let steps = c.due_unclear(now(3_000)).unwrap();
    assert_eq!(lookups(&steps), [("a".to_string(), 1)]);
}

/// One look-up of an event at a time: an attempt left open at start that the running
/// reconciliation looks up before the run reaches the event is not looked up a second time by
/// the parked event; its look-up waits until reconciliation has said what it proved.
#[test]
fn a_parked_event_is_not_looked_up_while_reconciliation_looks_it_up() {
    use crate::unknown::{Open, Reconcile, Resolved, When};
    let mut c = core();
    c.reconcile_settle = Duration::from_secs(1);
    let ev = event("a", 1);
    let at = now(10_000);
    let open = Open {
        event_id: ev.event_id,
        relay_generation: 6,
        unknown_for: Duration::from_secs(5),
        has_receipt: false,
        lookup_resends: true,
    };
    assert_eq!(
        c.reconcile(When::Start, 7, &open, at.wall),
        Reconcile::HandedToRun
    );
    // Before the replay reaches it, the running reconciliation looks the attempt up.
    assert_eq!(
        c.reconcile(When::Running, 7, &open, at.wall),
        Reconcile::LookUp
    );
    // The replay reaches it: parked for a look-up, which does not start while that one runs.
    let cmds = admit_txn(&mut c, std::slice::from_ref(&ev), 100);
    assert!(cmds.is_empty(), "parked, not sent");
    assert!(c.is_parked(ev.event_id));
    assert!(
        lookups(&c.due_unclear(now(10_000)).unwrap()).is_empty(),
        "no second look-up beside reconciliation's"
    );
    assert!(lookups(&c.due_unclear(now(10_500)).unwrap()).is_empty());
    // Reconciliation's answer: the parked event's look-up may go (it finds the attempt
    // closed, and takes what the run learned).
    c.reconciled(&ev, &Resolved::StillUnknown);
    assert_eq!(
        lookups(&c.due_unclear(now(11_000)).unwrap()),
        [("a".to_string(), 1)]
    );
}

#[test]
fn poll_mode_forgets_what_waits_behind_a_parked_event_and_a_version_published_meanwhile_leaves_no_gap(
) {
    let mut c = core();
    c.unclear_touched = Some(Default::default());
    let (a1, a2, a3) = (event("a", 1), event("a", 2), event("a", 3));
    let cmds = admit_txn(&mut c, &[a1.clone(), a2, a3.clone()], 100);
    assert_eq!(cmds.len(), 1);
    unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted);
    assert_eq!(
        c.outstanding(),
        1,
        "a/2 and a/3 forgotten: a later round reads them again"
    );
    c.due_unclear(now(60_000)).unwrap();
    let next = c
        .lookup_done(a1.event_id, LookupOutcome::Recorded, now(60_001))
        .unwrap();
    assert!(next.is_empty(), "nothing queued any more");
    // The next round: a/2 was published meanwhile (skipped by the read), a/3 is pending.
    let again = c.admit(a3, None, None, None, now(60_002)).unwrap();
    assert_eq!(again.len(), 1, "a/3 is sent, not taken for a gap");
    assert!(c.take_batch(true).unwrap().is_none(), "no hold");
}

/// An operator's schedule: each try waits its step (the last repeats), within a tenth either
/// way, the same for the same event and try, not the same for every event.
#[test]
fn a_retry_schedule_gives_each_try_its_step_with_a_tenth_of_jitter() {
    let ms = Duration::from_millis;
    let steps = [ms(0), ms(5_000), ms(300_000), ms(7_200_000)];
    let s = crate::parked::Schedule::new(&steps).unwrap();
    let ev = event("a", 1).event_id;
    for (tries, step) in [
        (1, 0),
        (2, 5_000),
        (3, 300_000),
        (4, 7_200_000),
        (9, 7_200_000),
    ] {
        let w = s.wait(tries, ev).as_millis() as u64;
        assert!(
            w * 10 >= step * 9 && w * 10 <= step * 11,
            "try {tries}: {w} ms for a {step} ms step"
        );
        assert_eq!(s.wait(tries, ev), s.wait(tries, ev), "the same wait again");
    }
    let waits: std::collections::HashSet<Duration> =
        (0..20).map(|i| s.wait(3, event("b", i).event_id)).collect();
    assert!(waits.len() > 10, "events spread out: {waits:?}");
    assert!(crate::parked::Schedule::new(&[]).is_err());
    assert!(crate::parked::Schedule::new(&[ms(1); 17]).is_err());

    // The core parks by it: the first unclear send is tried again at once.
    let mut c = core();
    c.unclear_policy.schedule = Some(s);
    let cmds = admit_txn(&mut c, &[event("a", 1)], 100);
    unclear(&mut c, token(&cmds[0]), Persistence::NotPersisted);
    assert_eq!(c.unclear_policy.repeat_wait(), ms(7_200_000));
    let due = c.next_unclear_due().unwrap();
    assert_eq!(due, now(1_500).wall, "step 0: at once after the report");
}

/// A destination's own policy (a webhook endpoint's schedule) governs the events frozen for it;
/// the others keep the relay's.
#[test]
fn each_destination_is_retried_on_its_own_schedule() {
    let ms = Duration::from_millis;
    let mut served = served();
    served.clusters.push("hooks-b".into());
    let mut c = PipelineCore::new(served, 7, PipelineCore::gate_from(Vec::new(), Vec::new()));
    c.unclear_policies.insert(
        "hooks-b".into(),
        crate::parked::Policy {
            schedule: Some(crate::parked::Schedule::new(&[ms(0), ms(50)]).unwrap()),
            budget: 2,
            ..Default::default()
        },
    );
    let cmds = admit_txn(&mut c, &[event("a", 1), event_for("b", 1, "hooks-b")], 100);
    assert_eq!(cmds.len(), 2);
    for cmd in &cmds {
        unclear(&mut c, token(cmd), Persistence::NotPersisted);
    }
    // b's schedule says at once; a waits the relay's doubling from 200 ms.
    let due = c.due_unclear(now(1_500)).unwrap();
    let sent: Vec<String> = due
        .iter()
        .filter_map(|s| match s {
            UnclearStep::Send(Command::Send { event, .. }) => Some(event.aggregate_id.clone()),
            UnclearStep::Lookup { .. } => None,
        })
        .collect();
    assert_eq!(sent, vec!["b".to_string()]);
    assert_eq!(c.next_unclear_due(), Some(now(1_700).wall), "a: 200 ms");
    let a = event("a", 1);
    let b = event_for("b", 1, "hooks-b");
    assert_eq!(c.unclear_policy_for(&a).budget, c.unclear_policy.budget);
    assert_eq!(c.unclear_policy_for(&b).repeat_wait(), ms(50));
}

/// An endpoint's own schedule: one unclear outcome per step before the relay says so, and no
/// settle time before its look-up (a resend).
#[test]
fn an_endpoint_policy_budgets_one_try_per_step_and_does_not_settle() {
    let steps = [0, 10, 20].map(Duration::from_millis);
    let s = crate::parked::Schedule::new(&steps).unwrap();
    assert_eq!(s.budget(), 3);
    let p = UnclearPolicy::for_endpoint(s);
    assert_eq!(
        (p.budget, p.settle, p.schedule),
        (3, Duration::ZERO, Some(s))
    );
    assert_eq!(
        (p.first, p.max),
        (UnclearPolicy::default().first, UnclearPolicy::default().max)
    );
}

/// Reconciliation finds a queued event on the broker (an earlier run's attempt, looked up
/// while this run's gate held the event behind its aggregate's unclear one): when the unclear
/// one resolves, the found event is not sent again, the one after it is, and the found one
/// is resolved (its receipt is recorded). Found by `outbox-sim` (seed 1, trace
/// 27, `resent_after_proof`).
#[test]
fn an_event_found_while_queued_behind_an_unclear_one_is_not_sent_again() {
    let mut c = core();
    let (a1, a2, a3) = (event("a", 1), event("a", 2), event("a", 3));
    let cmds = admit_txn(&mut c, &[a1.clone(), a2.clone()], 100);
    assert!(admit_txn(&mut c, std::slice::from_ref(&a3), 200).is_empty());
    assert_eq!(cmds.len(), 1, "a/1 out, a/2 and a/3 queued");
    unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted);
    c.reconciled(
        &a2,
        &crate::unknown::Resolved::Found {
            offset: 7,
            attempt_generation: 1,
        },
    );
    c.due_unclear(now(60_000)).unwrap();
    let next = c
        .lookup_done(a1.event_id, LookupOutcome::Recorded, now(60_001))
        .unwrap();
    assert_eq!(next.len(), 1);
    let Command::Send { event: sent, .. } = &next[0];
    assert_eq!(sent.event_id, a3.event_id, "a/2 skipped, a/3 sent");
    assert_eq!(c.outstanding(), 1, "only a/3 is outstanding");
    // a/2 is resolved at once, not with a later batch: none may come while the stream is
    // idle, and the checkpoint would wait for it (found by the simulator's million traces,
    // as events lost behind a checkpoint that never moved).
    assert!(
        c.tracker.watermark() >= Lsn(100),
        "the checkpoint may pass a/1 and a/2's transaction: {:?}",
        c.tracker.watermark()
    );
}

/// The same, for an event waiting to be sent again after an answer that said "not stored":
/// reconciliation of an earlier run's attempt found it meanwhile (seed 1, trace 1788). When
/// it falls due, it is not sent again; the next event of its aggregate is, and the found one
/// is resolved.
#[test]
fn an_event_found_while_it_waits_to_be_sent_again_is_not_sent_again() {
    let mut c = core();
    let (a1, a2) = (event("a", 1), event("a", 2));
    let cmds = admit_txn(&mut c, std::slice::from_ref(&a1), 100);
    assert!(admit_txn(&mut c, std::slice::from_ref(&a2), 200).is_empty());
    unclear(&mut c, token(&cmds[0]), Persistence::NotPersisted);
    c.reconciled(
        &a1,
        &crate::unknown::Resolved::Found {
            offset: 3,
            attempt_generation: 1,
        },
    );
    let steps = c.due_unclear(now(60_000)).unwrap();
    let sent: Vec<Uuid> = steps
        .iter()
        .filter_map(|s| match s {
            UnclearStep::Send(Command::Send { event, .. }) => Some(event.event_id),
            UnclearStep::Lookup { .. } => None,
        })
        .collect();
    assert_eq!(sent, [a2.event_id], "a/1 not sent again, a/2 sent");
    assert!(c.tracker.watermark() >= Lsn(100), "a/1 resolved");
}

/// Reconciliation's decisions: at start an open attempt is handed to the run (due after what
/// is left of its settle time) unless its event is published; while running only a settled
/// attempt of another generation is looked up; never one of an event this run has parked.
#[test]
fn reconciliation_hands_open_attempts_to_the_run_at_start_and_looks_up_settled_ones_later() {
    use crate::unknown::{Open, Reconcile, Resolved, When};
    let mut c = core();
    // The sink's settle time at start, `--unknown-settle-ms` while running.
    c.unclear_policy.settle = Duration::from_secs(3);
    c.reconcile_settle = Duration::from_secs(5);
    let at = now(10_000).wall;
    let open = |id, gen, unknown_s, has_receipt| Open {
        event_id: id,
        relay_generation: gen,
        unknown_for: Duration::from_secs(unknown_s),
        has_receipt,
        lookup_resends: false,
    };
    let (e1, e2) = (event("a", 1), event("b", 1));
    assert_eq!(
        c.reconcile(When::Start, 5, &open(e1.event_id, 4, 1, false), at),
        Reconcile::HandedToRun
    );
    assert_eq!(
        c.open_at_start.get(&e1.event_id),
        Some(&(at + Duration::from_secs(2)))
    );
    assert_eq!(
        c.reconcile(When::Start, 5, &open(e2.event_id, 4, 1, true), at),
        Reconcile::Skip,
        "published: the running reconciliation traces it"
    );
    assert!(!c.open_at_start.contains_key(&e2.event_id));
    let run = |c: &mut PipelineCore, gen, unknown_s| {
        c.reconcile(
            When::Running,
            5,
            &open(e2.event_id, gen, unknown_s, true),
            at,
        )
    };
    assert_eq!(run(&mut c, 5, 9), Reconcile::Skip, "this run's own");
    assert_eq!(run(&mut c, 4, 1), Reconcile::Skip, "not settled");
    assert_eq!(
        run(&mut c, 4, 4),
        Reconcile::Skip,
        "past the sink's 3 s, not past --unknown-settle-ms's 5 s"
    );
    assert_eq!(run(&mut c, 4, 9), Reconcile::LookUp);
    // Its look-up runs beside the loop: the next poll finds the attempt still open and does
    // not look it up a second time; once told what it proved (nothing, here) it may.
    assert_eq!(run(&mut c, 4, 9), Reconcile::Skip, "its look-up is running");
    c.reconciled(&e2, &Resolved::StillUnknown);
    assert_eq!(run(&mut c, 4, 9), Reconcile::LookUp);
    c.reconciled(&e2, &Resolved::StillUnknown);
    // An attempt whose event the driver cannot load (a row written without a version, from
    // an attempt that did not keep the relay's): deferred, not asked about again this run.
    assert_eq!(run(&mut c, 4, 9), Reconcile::LookUp);
    c.reconcile_deferred(e2.event_id);
    assert_eq!(run(&mut c, 4, 9), Reconcile::Skip, "deferred to a replay");
    c.deferred.clear();
    // A look-up that would send the published event again under its key: its receipt is the
    // answer (an HTTP endpoint); one that reads the broker still runs (each attempt may have
    // left a copy of its own).
    let resends = Open {
        lookup_resends: true,
        ..open(e2.event_id, 4, 9, true)
    };
    assert_eq!(
        c.reconcile(When::Running, 5, &resends, at),
        Reconcile::ClosedByReceipt
    );
    let unpublished = Open {
        has_receipt: false,
        ..resends
    };
    assert_eq!(
        c.reconcile(When::Running, 5, &unpublished, at),
        Reconcile::LookUp
    );
    c.reconciled(&e2, &Resolved::StillUnknown);
    // Parked: its own look-up resolves every open attempt.
    let cmds = admit_txn(&mut c, std::slice::from_ref(&e2), 100);
    unclear(&mut c, token(&cmds[0]), Persistence::PossiblyPersisted);
    assert_eq!(run(&mut c, 4, 9), Reconcile::Skip);
}

/// An open attempt as a driver reads it, for `ParkedLookup`.
fn open_attempt(
    attempt: u32,
    generation: i32,
    has_receipt: bool,
    resends: bool,
) -> OpenAttempt<u32> {
    OpenAttempt {
        attempt,
        attempt_generation: generation,
        has_receipt,
        lookup_resends: resends,
        unknown_for: Duration::from_secs(3600),
    }
}

#[test]
fn a_parked_events_look_ups_close_answered_attempts_by_receipt_and_look_up_the_rest() {
    let mut c = core();
    let e = event("a", 1);
    // Due: the latest open attempt (generation 2) would be re-sent under the key of an event
    // that has its receipt by now: closed by that receipt, then the next one is read.
    let mut lk = ParkedLookup::due(e.clone());
    assert!(matches!(
        lk.next(&mut c, ParkedInput::Begin),
        ParkedStep::ReadOpenAttempt
    ));
    assert!(matches!(
        lk.next(
            &mut c,
            ParkedInput::Open(Some(open_attempt(7, 2, true, true)))
        ),
        ParkedStep::CloseByReceipt(7)
    ));
    assert!(matches!(
        lk.next(&mut c, ParkedInput::ClosedAt(Some(40))),
        ParkedStep::ReadOpenAttempt
    ));
    // The earlier attempt reads the broker (a scan): it is looked up, carrying what the
    // closed one proved.
    match lk.next(
        &mut c,
        ParkedInput::Open(Some(open_attempt(6, 1, true, false))),
    ) {
        ParkedStep::LookUp {
            event,
            attempt,
            prior,
        } => {
            assert_eq!((event.event_id, attempt), (e.event_id, 6));
            assert_eq!(prior, Some(LookupOutcome::Recorded));
        }
        other => panic!("expected the look-up of attempt 6, got {other:?}"),
    }
    // Its answer (absent) merged with the found copy: recorded, nothing sent again; no
    // attempt is left open.
    let mut lk = ParkedLookup::<u32>::answered(
        e.clone(),
        Some(LookupOutcome::Recorded),
        LookupOutcome::Retry {
            attempt_generation: 2,
        },
    );
    assert!(matches!(
        lk.next(&mut c, ParkedInput::Begin),
        ParkedStep::ReadOpenAttempt
    ));
    assert!(matches!(
        lk.next(&mut c, ParkedInput::Open(None)),
        ParkedStep::Done {
            outcome: LookupOutcome::Recorded,
            ..
        }
    ));
}

#[test]
fn a_look_up_that_proved_nothing_ends_the_round_and_a_closed_receipt_that_is_gone_is_looked_up() {
    let mut c = core();
    let e = event("a", 1);
    let mut lk = ParkedLookup::<u32>::answered(
        e.clone(),
        None,
        LookupOutcome::Unresolved {
            error: "timeout".into(),
            after: None,
        },
    );
    assert!(matches!(
        lk.next(&mut c, ParkedInput::Begin),
        ParkedStep::Done {
            outcome: LookupOutcome::Unresolved { .. },
            ..
        }
    ));
    // The receipt that was to close the attempt is gone (purged) or it was resolved
    // meanwhile: it is looked up, never taken as found.
    let mut lk = ParkedLookup::due(e.clone());
    lk.next(&mut c, ParkedInput::Begin);
    lk.next(
        &mut c,
        ParkedInput::Open(Some(open_attempt(3, 1, true, true))),
    );
    assert!(matches!(
        lk.next(&mut c, ParkedInput::ClosedAt(None)),
        ParkedStep::LookUp {
            attempt: 3,
            prior: None,
            ..
        }
    ));
    // Due with nothing open and nothing learned: nothing proven, asked again later.
    let mut lk = ParkedLookup::<u32>::due(e);
    lk.next(&mut c, ParkedInput::Begin);
    assert!(matches!(
        lk.next(&mut c, ParkedInput::Open(None)),
        ParkedStep::Done {
            outcome: LookupOutcome::Unresolved { .. },
            ..
        }
    ));
}

/// The bounds' count of what waits on unclear outcomes serves for `WAITING_SAMPLE`, so a
/// wide drain at its bound does not walk the in-flight table at every turn; a clock that went
/// back counts again.
#[test]
fn the_count_waiting_on_unclear_outcomes_serves_for_its_sample_life() {
    let mut c = core();
    let b = c.admit(event("b", 1), None, None, None, now(0)).unwrap();
    assert_eq!(c.waiting_sampled(now(1500).wall).events, 0);
    unclear(&mut c, token(&b[0]), Persistence::NotPersisted);
    assert_eq!(
        c.waiting_sampled(now(1519).wall).events,
        1,
        "a park is counted at once"
    );
    // What queues behind the parked event waits for the next count.
    let queued = c.admit(event("b", 2), None, None, None, now(1519)).unwrap();
    assert!(queued.is_empty(), "queued behind the parked event");
    assert_eq!(
        c.waiting_sampled(now(1538).wall).events,
        1,
        "within its life"
    );
    assert_eq!(c.waiting_sampled(now(1539).wall).events, 2, "counted again");
    assert_eq!(
        c.waiting_sampled(now(1000).wall).events,
        2,
        "the clock went back"
    );
    let bounds = crate::schedule::Bounds {
        max_in_flight: 2,
        max_waiting: crate::schedule::Waiting {
            events: 10,
            bytes: u64::MAX,
        },
        batch_size: 1,
        max_in_flight_bytes: usize::MAX,
    };
    // Below both bounds the count cannot change what they decide: it is not taken.
    assert_eq!(
        c.waiting_where_it_matters(bounds, 1, now(5000).wall),
        crate::schedule::Waiting::default()
    );
    assert_eq!(
        c.waiting_where_it_matters(bounds, 2, now(5000).wall).events,
        2
    );
}

/// A look-up's answer, as the core learns it: a parked event's round goes on with what it
/// proved (nothing proven ends it, asked again after the backoff); a reconciliation's look-up
/// that proved nothing leaves the event to the next poll, and one that found the copy settles
/// it (not parked again when the replay reaches it).
#[test]
fn a_look_ups_answer_goes_on_with_a_parked_round_or_ends_a_reconciliation() {
    use super::unclear::LookupFor;
    use crate::unknown::Resolved;
    let mut c = core();
    let e = event("a", 1);
    let mut round = c
        .lookup_answered::<u32>(
            e.clone(),
            LookupFor::Parked { prior: None },
            Err("timeout".into()),
        )
        .expect("a parked event's round goes on");
    assert!(matches!(
        round.next(&mut c, ParkedInput::Begin),
        ParkedStep::Done {
            outcome: LookupOutcome::Unresolved { .. },
            ..
        }
    ));
    let found = Resolved::Found {
        offset: 4,
        attempt_generation: 1,
    };
    let mut round = c
        .lookup_answered::<u32>(e.clone(), LookupFor::Parked { prior: None }, Ok(found))
        .expect("a parked event's round goes on");
    round.next(&mut c, ParkedInput::Begin);
    assert!(matches!(
        round.next(&mut c, ParkedInput::Open(None)),
        ParkedStep::Done {
            outcome: LookupOutcome::Recorded,
            ..
        }
    ));
    assert!(c
        .lookup_answered::<u32>(e.clone(), LookupFor::Reconciling, Err("timeout".into()))
        .is_none());
}

/// An event an operator skipped is never sent when the stream meets it again (a run replaying
/// from before it, its aggregate's hold gone): it is resolved at once and the next version
/// goes. Planted (`StreamSendsSkipped`), it is sent (seed 1, trace 53667).
#[test]
fn an_event_an_operator_skipped_is_not_sent_when_the_stream_meets_it_again() {
    fn stream<P: crate::Plant>(c: &mut PipelineCore<P>, events: &[OutboxEvent]) -> Vec<Uuid> {
        c.start_streaming(Lsn(10));
        c.on_begin(Lsn(99)).unwrap();
        let mut sent = Vec::new();
        for (n, ev) in events.iter().enumerate() {
            let cmds = c
                .on_row(Ok(ev.clone()), Lsn(20 + n as u64), now(0))
                .unwrap();
            sent.extend(
                cmds.iter()
                    .map(|Command::Send { event, .. }| event.event_id),
            );
        }
        c.on_commit(Lsn(100)).unwrap();
        sent
    }
    let (a1, a2) = (event("a", 1), event("a", 2));
    let mut c = core();
    c.skipped_by_operator([a1.event_id]);
    assert_eq!(
        stream(&mut c, &[a1.clone(), a2.clone()]),
        [a2.event_id],
        "a/1 skipped, a/2 sent"
    );
    assert_eq!(c.outstanding(), 1, "only a/2 is outstanding");

    let mut planted = PipelineCore::with_plant(
        served(),
        7,
        PipelineCore::gate_from(Vec::new(), Vec::new()),
        crate::Planted {
            mutant: Some(Mutant::StreamSendsSkipped),
            current_route: None,
        },
    );
    planted.skipped_by_operator([a1.event_id]);
    assert_eq!(
        stream(&mut planted, &[a1.clone(), a2]),
        [a1.event_id],
        "planted: the skipped event is sent"
    );
}

#[test]
fn under_a_deeper_gate_a_later_version_proven_absent_waits_for_the_earlier_one() {
    let mut c = core();
    c.set_aggregate_depth(3);
    let evs: Vec<_> = (1..=3).map(|v| event("a", v)).collect();
    let cmds = admit_txn(&mut c, &evs, 100);
    let next = continued(c.on_report(persisted(token(&cmds[0]), 0), now(1)).unwrap());
    let more = c.handed_over(token(&next[0]), now(2)).unwrap();
    let (v2, v3) = (token(&next[0]), token(&more[0]));
    // Both answered unclearly; both looked up; v3 is proven absent first.
    unclear(&mut c, v3, Persistence::PossiblyPersisted);
    unclear(&mut c, v2, Persistence::PossiblyPersisted);
    assert_eq!(lookups(&c.due_unclear(now(60_000)).unwrap()).len(), 2);
    let retry = |generation| LookupOutcome::Retry {
        attempt_generation: generation,
    };
    let sends = c
        .lookup_done(evs[2].event_id, retry(2), now(60_001))
        .unwrap();
    assert!(
        sends.is_empty(),
        "v3 is not sent again before v2 is settled"
    );
    assert!(
        c.due_unclear(now(60_002)).unwrap().is_empty(),
        "nor when it comes due"
    );
    // v2 proven absent too: v2 goes first, then v3 when due.
    let sends = c
        .lookup_done(evs[1].event_id, retry(2), now(60_003))
        .unwrap();
    let versions = |cmds: &[Command]| -> Vec<i64> {
        cmds.iter()
            .map(|Command::Send { event, .. }| event.aggregate_version)
            .collect()
    };
    assert_eq!(versions(&sends), [2]);
    let steps = c.due_unclear(now(70_000)).unwrap();
    let resent: Vec<i64> = steps
        .iter()
        .filter_map(|s| match s {
            UnclearStep::Send(Command::Send { event, attempt, .. }) => {
                assert_eq!(*attempt, 2);
                Some(event.aggregate_version)
            }
            UnclearStep::Lookup { .. } => None,
        })
        .collect();
    assert_eq!(resent, [3]);
}

#[test]
fn a_parked_events_round_does_not_scan_for_an_attempt_recorded_within_the_settle_time() {
    let mut c = core();
    c.unclear_policy.settle = Duration::from_secs(2);
    let e = event("a", 1);
    // The round's first look-up proved its attempt absent; the next open attempt is another
    // run's, recorded 300 ms ago (a resumed zombie's salvage): its request may still land.
    let mut lk = ParkedLookup::<u32>::answered(
        e.clone(),
        None,
        LookupOutcome::Retry {
            attempt_generation: 2,
        },
    );
    assert!(matches!(
        lk.next(&mut c, ParkedInput::Begin),
        ParkedStep::ReadOpenAttempt
    ));
    let mut fresh = open_attempt(9, 1, false, false);
    fresh.unknown_for = Duration::from_millis(300);
    match lk.next(&mut c, ParkedInput::Open(Some(fresh.clone()))) {
        ParkedStep::Done { event_id, outcome } => {
            assert_eq!(event_id, e.event_id);
            assert!(
                matches!(outcome, LookupOutcome::Unresolved { after: Some(a), .. } if a == Duration::from_millis(1700)),
                "{outcome:?}"
            );
        }
        other => panic!("expected the round to end unresolved, got {other:?}"),
    }
    // Settled: looked up. A look-up under the event's key (no scan) needs no settle time.
    let mut lk = ParkedLookup::<u32>::due(e.clone());
    lk.next(&mut c, ParkedInput::Begin);
    fresh.unknown_for = Duration::from_secs(2);
    assert!(matches!(
        lk.next(&mut c, ParkedInput::Open(Some(fresh.clone()))),
        ParkedStep::LookUp { attempt: 9, .. }
    ));
    let mut lk = ParkedLookup::<u32>::due(e);
    lk.next(&mut c, ParkedInput::Begin);
    let mut keyed = open_attempt(9, 1, false, true);
    keyed.unknown_for = Duration::from_millis(300);
    assert!(matches!(
        lk.next(&mut c, ParkedInput::Open(Some(keyed))),
        ParkedStep::LookUp { attempt: 9, .. }
    ));
}
