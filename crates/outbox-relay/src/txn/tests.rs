use super::*;
use crate::pipeline::Planted;
use crate::testing::{event, event_for, served};

fn steps<P: Plant>(c: &mut TxnCore<P>) -> Vec<TxnStep> {
    std::iter::from_fn(|| c.poll_step()).collect()
}

fn sends(steps: &[TxnStep]) -> Vec<(u64, i64)> {
    steps
        .iter()
        .filter_map(|s| match s {
            TxnStep::Send { token, event } => Some((*token, event.aggregate_version)),
            _ => None,
        })
        .collect()
}

fn stored(offset: i64) -> TxnReport {
    TxnReport::Stored {
        partition: 0,
        offset,
    }
}

fn at(offset: i64) -> RecordPosition {
    RecordPosition {
        partition: 0,
        offset,
    }
}

/// Three versions of one aggregate in one stream transaction ending at 30.
fn three<P: Plant>(c: &mut TxnCore<P>) -> Vec<OutboxEvent> {
    let evs: Vec<_> = (1..=3).map(|v| event("a", v)).collect();
    for e in &evs {
        c.admit(e.clone(), false);
    }
    c.stream_commit(Lsn(30));
    evs
}

/// Three events in one transaction of `c` whose second send failed: the core asks to abort
/// it.
fn second_of_three_failed<P: Plant>(mut c: TxnCore<P>) -> TxnCore<P> {
    three(&mut c);
    c.flush();
    steps(&mut c);
    c.on_report(0, stored(0));
    c.on_report(1, TxnReport::Failed { permanent: None });
    c.on_report(2, stored(2));
    assert_eq!(steps(&mut c), [TxnStep::Abort { batch: 1 }]);
    c
}

#[test]
fn a_batch_is_one_transaction_with_every_version_in_flight_then_committed_and_accepted() {
    let mut c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    three(&mut c);
    c.flush();
    let s = steps(&mut c);
    assert_eq!(s[0], TxnStep::Begin { batch: 1 });
    assert_eq!(
        sends(&s),
        [(0, 1), (1, 2), (2, 3)],
        "several versions in flight at once"
    );
    for t in 0..3 {
        c.on_report(t, stored(t as i64));
    }
    let s = steps(&mut c);
    assert!(
        matches!(&s[..], [TxnStep::Commit { batch: 1, through: Lsn(30), receipts, kept }] if receipts.len() == 3 && kept.is_empty())
    );
    c.on_committed(CommitOutcome::Committed(at(7)));
    let s = steps(&mut c);
    assert!(
        matches!(&s[..], [TxnStep::Accept { batch: 1, through: Lsn(30), record: Some(r), .. }] if *r == at(7))
    );
    assert_eq!(c.durable(), Lsn(10), "not before the ledger accepted it");
    c.on_accepted(1);
    assert_eq!(c.durable(), Lsn(30));
}

/// A stop (`TxnEnd`) of a core with three events read and no transaction yet (a long
/// linger), answered as the driver answers; returns the end's steps, by name, as it asked
/// for them. With `grace_over_at` the stop's time runs out at that answer.
fn stop_of<P: Plant>(mut c: TxnCore<P>, grace_over_at: Option<usize>) -> Vec<&'static str> {
    three(&mut c);
    let mut end = TxnEnd::new(&mut c);
    let not_begin = |s: &TxnStep| !matches!(s, TxnStep::Begin { .. });
    let mut pending: Vec<TxnStep> = steps(&mut c).into_iter().filter(not_begin).collect();
    let mut asked = Vec::new();
    let mut answers = 0;
    let mut accepting = false;
    loop {
        let step = end.next(&c, accepting);
        asked.push(match step {
            TxnEndStep::AwaitAnswer => "await",
            TxnEndStep::Confirm => "confirm",
            TxnEndStep::Done => "done",
        });
        match step {
            TxnEndStep::Done => return asked,
            TxnEndStep::Confirm => {}
            TxnEndStep::AwaitAnswer if grace_over_at == Some(answers) => end.grace_over(),
            TxnEndStep::AwaitAnswer => {
                answers += 1;
                // The next answer of what the core asked: reports, the commit, the acceptance.
                match pending.first().cloned() {
                    Some(TxnStep::Send { token, .. }) => {
                        pending.remove(0);
                        c.on_report(token, stored(token as i64));
                    }
                    Some(TxnStep::Commit { .. }) => {
                        pending.remove(0);
                        c.on_committed(CommitOutcome::Committed(at(9)));
                    }
                    Some(TxnStep::Accept { batch, .. }) => {
                        pending.remove(0);
                        accepting = false;
                        c.on_accepted(batch);
                    }
                    other => panic!("nothing to answer: {other:?}"),
                }
                pending.extend(steps(&mut c).into_iter().filter(not_begin));
                accepting |= pending.iter().any(|s| matches!(s, TxnStep::Accept { .. }));
            }
        }
    }
}

#[test]
fn a_stop_commits_and_accepts_what_was_read_then_confirms_unless_its_time_runs_out() {
    let c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    let asked = stop_of(c, None);
    assert_eq!(
        asked.iter().filter(|s| **s == "await").count(),
        5,
        "{asked:?}"
    );
    assert_eq!(asked[asked.len() - 2..], ["confirm", "done"]);

    let c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    assert_eq!(
        stop_of(c, Some(1)),
        ["await", "await", "confirm", "done"],
        "the time ran out with the transaction open: left to the next holder"
    );

    let plant = Planted {
        mutant: Some(Mutant::TxnStopWithoutWaiting),
        current_route: None,
    };
    let c = TxnCore::planted(plant, served(), 10, Lsn(10), 0, vec![]);
    assert_eq!(stop_of(c, None), ["confirm", "done"]);
}

#[test]
fn one_failed_send_aborts_the_transaction_and_the_whole_batch_goes_again_in_order() {
    let mut c = second_of_three_failed(TxnCore::new(served(), 10, Lsn(10), 0, vec![]));
    c.on_aborted(false);
    assert!(steps(&mut c).is_empty(), "nothing of it is accepted");
    c.flush();
    let s = steps(&mut c);
    assert_eq!(s[0], TxnStep::Begin { batch: 2 });
    assert_eq!(sends(&s).iter().map(|s| s.1).collect::<Vec<_>>(), [1, 2, 3]);
}

#[test]
fn an_event_refused_for_good_is_quarantined_and_what_follows_of_its_aggregate_is_held() {
    let mut c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    three(&mut c);
    c.flush();
    steps(&mut c);
    c.on_report(0, stored(0));
    c.on_report(
        1,
        TxnReport::Failed {
            permanent: Some("too large".into()),
        },
    );
    c.on_report(2, stored(2));
    steps(&mut c);
    c.on_aborted(false);
    assert!(steps(&mut c).is_empty(), "nothing of it is accepted");
    c.flush();
    let s = steps(&mut c);
    assert_eq!(
        sends(&s).iter().map(|s| s.1).collect::<Vec<_>>(),
        [1],
        "v1 goes again, v3 waits behind the hold"
    );
    c.on_report(sends(&s)[0].0, stored(5));
    let s = steps(&mut c);
    // The quarantine and the held version are in the record, with v1's receipt.
    let [TxnStep::Commit {
        through: Lsn(30),
        receipts,
        kept,
        ..
    }] = &s[..]
    else {
        panic!("{s:?}");
    };
    assert_eq!(receipts.len(), 1);
    let kept: Vec<_> = kept
        .iter()
        .map(|k| (k.version, k.quarantined.is_some()))
        .collect();
    assert_eq!(kept, [(2, true), (3, false)]);
}

#[test]
fn a_batch_that_only_keeps_events_commits_its_record_alone() {
    let mut c = TxnCore::new(
        served(),
        10,
        Lsn(10),
        0,
        vec![(("order".into(), "a".into()), 1)],
    );
    three(&mut c);
    c.flush();
    let s = steps(&mut c);
    assert!(
        matches!(&s[..], [TxnStep::Begin { batch: 1 }, TxnStep::Commit { receipts, kept, through: Lsn(30), .. }]
            if receipts.is_empty() && kept.len() == 3),
        "{s:?}"
    );
    c.on_committed(CommitOutcome::Committed(at(0)));
    assert!(matches!(&steps(&mut c)[..], [TxnStep::Accept { kept, .. }] if kept.len() == 3));
}

#[test]
fn an_abort_that_does_not_answer_is_settled_by_a_new_producer_then_sent_again() {
    let mut c = second_of_three_failed(TxnCore::new(served(), 10, Lsn(10), 0, vec![]));
    c.on_abort_unclear();
    assert_eq!(steps(&mut c), [TxnStep::Settle { batch: 1 }]);
    c.flush();
    assert!(
        steps(&mut c).is_empty(),
        "nothing is sent before it is settled"
    );
    c.on_settled(None);
    c.flush();
    let s = steps(&mut c);
    assert_eq!(s[0], TxnStep::Begin { batch: 2 });
    assert_eq!(sends(&s).iter().map(|s| s.1).collect::<Vec<_>>(), [1, 2, 3]);
}

/// `c` with its first transaction of three events committing: every send reported stored,
/// the commit asked for.
fn committing<P: Plant>(mut c: TxnCore<P>) -> TxnCore<P> {
    three(&mut c);
    c.flush();
    steps(&mut c);
    for t in 0..3 {
        c.on_report(t, stored(t as i64));
    }
    steps(&mut c);
    c
}

#[test]
fn an_unknown_commit_is_settled_by_the_broker_not_sent_again() {
    for committed in [true, false] {
        let mut c = committing(TxnCore::new(served(), 10, Lsn(10), 0, vec![]));
        c.on_committed(CommitOutcome::Unknown);
        assert_eq!(steps(&mut c), [TxnStep::Settle { batch: 1 }]);
        c.flush();
        assert!(
            steps(&mut c).is_empty(),
            "nothing else is sent while it is unknown"
        );
        c.on_settled(committed.then_some(at(3)));
        let s = steps(&mut c);
        if committed {
            assert!(matches!(&s[..], [TxnStep::Accept { batch: 1, .. }]));
        } else {
            assert!(s.is_empty());
            c.flush();
            assert_eq!(sends(&steps(&mut c)).len(), 3, "aborted: sent again");
        }
    }
}

/// What the driver read from the broker, as the core takes it: a commit without its record's
/// position or failed for any reason but a fence is settled, never sent again; a fence stops
/// the core; an abort that failed unfenced is settled by a new producer.
#[test]
fn a_broker_answer_is_read_by_the_core() {
    for unknown in [
        BrokerAnswer::Committed(None),
        BrokerAnswer::CommitFailed { fenced: false },
    ] {
        let mut c = committing(TxnCore::new(served(), 10, Lsn(10), 0, vec![]));
        c.on_broker(unknown);
        assert_eq!(steps(&mut c), [TxnStep::Settle { batch: 1 }], "{unknown:?}");
    }
    let mut c = committing(TxnCore::new(served(), 10, Lsn(10), 0, vec![]));
    c.on_broker(BrokerAnswer::Committed(Some(at(3))));
    assert!(matches!(
        &steps(&mut c)[..],
        [TxnStep::Accept { batch: 1, .. }]
    ));
    let mut c = committing(TxnCore::new(served(), 10, Lsn(10), 0, vec![]));
    c.on_broker(BrokerAnswer::CommitFailed { fenced: true });
    assert!(c.stopped(), "fenced: the core stops");
    assert_eq!(steps(&mut c), [TxnStep::Stop], "fenced: nothing more");

    let mut c = second_of_three_failed(TxnCore::new(served(), 10, Lsn(10), 0, vec![]));
    c.on_broker(BrokerAnswer::AbortFailed { fenced: false });
    assert_eq!(steps(&mut c), [TxnStep::Settle { batch: 1 }]);
    c.on_broker(BrokerAnswer::Settled(None));
    let s = steps(&mut c);
    assert_eq!(
        s[0],
        TxnStep::Begin { batch: 2 },
        "settled aborted: sent again at once"
    );
    let mut c = second_of_three_failed(TxnCore::new(served(), 10, Lsn(10), 0, vec![]));
    c.on_broker(BrokerAnswer::AbortFailed { fenced: true });
    assert!(c.stopped());
    assert_eq!(steps(&mut c), [TxnStep::Stop]);
}

#[test]
fn the_checkpoint_stops_before_a_stream_transaction_the_batch_splits() {
    let mut c = TxnCore::new(served(), 2, Lsn(10), 0, vec![]);
    three(&mut c);
    c.flush();
    steps(&mut c);
    c.on_report(0, stored(0));
    c.on_report(1, stored(1));
    let s = steps(&mut c);
    assert!(
        matches!(
            &s[..],
            [TxnStep::Commit {
                through: Lsn(10),
                ..
            }]
        ),
        "{s:?}"
    );
}

#[test]
fn a_start_accepts_what_the_broker_recorded_and_skips_events_with_receipts() {
    let mut c = TxnCore::new(served(), 10, Lsn(10), 4, vec![]);
    let id = uuid::Uuid::now_v7();
    let recorded = |batch| Recorded {
        batch,
        through: Lsn(50),
        receipts: vec![TxnReceipt {
            event_id: id,
            partition: 0,
            offset: 9,
        }],
        kept: vec![],
        record: at(1),
    };
    c.recover(vec![recorded(4), recorded(5)]);
    let s = steps(&mut c);
    assert!(
        matches!(
            &s[..],
            [TxnStep::Accept {
                batch: 5,
                through: Lsn(50),
                ..
            }]
        ),
        "batch 4 was accepted already: {s:?}"
    );
    c.on_accepted(5);
    assert_eq!(c.durable(), Lsn(50));
    c.admit(event("a", 1), true);
    c.admit(event("a", 2), false);
    c.stream_commit(Lsn(60));
    c.flush();
    let s = steps(&mut c);
    assert_eq!(s[0], TxnStep::Begin { batch: 6 });
    assert_eq!(sends(&s).iter().map(|s| s.1).collect::<Vec<_>>(), [2]);
}

#[test]
fn fenced_stops_everything() {
    let mut c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    three(&mut c);
    c.flush();
    steps(&mut c);
    c.on_report(0, TxnReport::Fenced);
    assert_eq!(steps(&mut c), [TxnStep::Stop]);
    assert!(c.stopped());
    c.on_report(1, stored(1));
    c.flush();
    assert!(steps(&mut c).is_empty());
}

#[test]
fn stream_commits_without_events_move_the_checkpoint_without_a_transaction() {
    let mut c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    c.stream_commit(Lsn(20));
    c.flush();
    let s = steps(&mut c);
    assert!(
        matches!(
            &s[..],
            [TxnStep::Accept {
                through: Lsn(20),
                record: None,
                ..
            }]
        ),
        "{s:?}"
    );
}

#[test]
fn a_transaction_read_again_is_accepted_up_to_its_aggregates_heads_only() {
    let mut c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    c.set_replay_bound(Some(Lsn(30)));
    let evs: Vec<_> = (1..=3).map(|v| event("a", v)).collect();
    // Beyond the bound: read for the first time, nothing to look up.
    assert!(c.heads_needed(Lsn(40), &evs).is_empty());
    assert!(!c.replayed_accepted(&evs[0], Lsn(40)));
    // At the bound: a's head is read once (v1 has its receipt; the batch with v2 and v3 was
    // never accepted), then only v1 counts as accepted. A read of two transactions that both
    // meet it asks for it once; one beyond the bound asks for nothing.
    let txn = |commit: u64, evs: &[OutboxEvent]| StreamTxn {
        rows: evs.iter().map(|e| (Ok(e.clone()), Lsn(commit))).collect(),
        commit_lsn: Lsn(commit),
        end_lsn: Lsn(commit + 1),
    };
    let read = [
        txn(20, &evs[..1]),
        txn(30, &evs[1..]),
        txn(40, &[event("c", 1)]),
    ];
    let needed = c.heads_needed_in(&read);
    assert_eq!(needed, vec![("order".to_string(), "a".to_string())]);
    assert_eq!(needed, c.heads_needed(Lsn(30), &evs));
    c.learn_heads(needed, vec![(("order".into(), "a".into()), 1)]);
    assert!(c.heads_needed(Lsn(30), &evs).is_empty(), "met already");
    let accepted: Vec<bool> = evs
        .iter()
        .map(|e| c.replayed_accepted(e, Lsn(30)))
        .collect();
    assert_eq!(accepted, [true, false, false]);
    // An aggregate without a receipt: head 0.
    let b = event("b", 1);
    let needed = c.heads_needed(Lsn(20), [&b]);
    c.learn_heads(needed, vec![]);
    assert!(!c.replayed_accepted(&b, Lsn(20)));
}

#[test]
fn a_read_transaction_is_admitted_row_by_row_then_committed_and_a_row_without_a_version_refuses_it()
{
    let mut c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    c.set_replay_bound(Some(Lsn(30)));
    let evs: Vec<_> = (1..=3).map(|v| event("a", v)).collect();
    c.learn_heads(
        vec![("order".into(), "a".into())],
        vec![(("order".into(), "a".into()), 1)],
    );
    c.skipped_by_operator([evs[2].event_id]);
    let mut rows: Vec<StreamRow> = evs.iter().map(|e| (Ok(e.clone()), Lsn(25))).collect();
    rows.insert(1, (Err("no aggregate_id".into()), Lsn(26)));
    let got = c
        .admit_txn(StreamTxn {
            rows,
            commit_lsn: Lsn(30),
            end_lsn: Lsn(31),
        })
        .unwrap();
    let kinds: Vec<String> = got
        .iter()
        .map(|r| match r {
            TxnRow::NotSent { accepted } => format!("not sent, accepted {accepted}"),
            TxnRow::Unreadable(q) => format!("quarantined {}", q.key),
            TxnRow::Queued { event, .. } => format!("queued v{}", event.aggregate_version),
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "not sent, accepted true",
            "quarantined lsn:0/1E:1",
            "queued v2",
            "not sent, accepted false",
        ]
    );
    c.flush();
    assert_eq!(sends(&steps(&mut c)), [(0, 2)], "v1 published, v3 skipped");

    let mut plain = event("b", 1);
    plain.version_by_relay = true;
    let refused = c.admit_txn(StreamTxn {
        rows: vec![(Ok(event("c", 1)), Lsn(40)), (Ok(plain.clone()), Lsn(41))],
        commit_lsn: Lsn(42),
        end_lsn: Lsn(43),
    });
    assert_eq!(
        refused.unwrap_err(),
        Unnumbered {
            event_id: plain.event_id
        }
    );
}

#[test]
fn each_mutant_changes_its_decision() {
    // A core with `m` planted, batches of `batch_size`, at checkpoint 10.
    let planted = |m, batch_size| {
        let plant = Planted {
            mutant: Some(m),
            current_route: None,
        };
        TxnCore::planted(plant, served(), batch_size, Lsn(10), 0, vec![])
    };
    let mut c = planted(Mutant::TxnIgnoresRecords, 10);
    c.recover(vec![Recorded {
        batch: 1,
        through: Lsn(20),
        receipts: vec![],
        kept: vec![],
        record: at(0),
    }]);
    assert!(steps(&mut c).is_empty());

    let mut c = planted(Mutant::TxnReplaysAccepted, 10);
    c.admit(event("a", 1), true);
    c.flush();
    assert_eq!(sends(&steps(&mut c)).len(), 1);

    let mut c = planted(Mutant::TxnReplayedIsAccepted, 10);
    c.set_replay_bound(Some(Lsn(30)));
    c.learn_heads(vec![("order".into(), "a".into())], vec![]);
    assert!(c.replayed_accepted(&event("a", 2), Lsn(30)));

    let mut c = planted(Mutant::TxnThroughPastBatch, 2);
    three(&mut c);
    c.flush();
    steps(&mut c);
    c.on_report(0, stored(0));
    c.on_report(1, stored(1));
    assert!(matches!(
        &steps(&mut c)[..],
        [TxnStep::Commit {
            through: Lsn(30),
            ..
        }]
    ));

    let mut c = second_of_three_failed(planted(Mutant::TxnAcceptsAborted, 10));
    c.on_aborted(false);
    assert!(
        matches!(&steps(&mut c)[..], [TxnStep::Accept { receipts, .. }] if receipts.len() == 2)
    );

    let mut c = committing(planted(Mutant::TxnUnknownIsAborted, 10));
    c.on_committed(CommitOutcome::Unknown);
    assert!(steps(&mut c).is_empty());
    c.flush();
    assert_eq!(sends(&steps(&mut c)).len(), 3);
}

#[test]
fn an_event_frozen_for_another_cluster_is_quarantined_in_the_record_never_sent() {
    let mut c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    c.admit(event_for("a", 1, "c1"), false);
    c.admit(event_for("a", 2, "elsewhere"), false);
    c.admit(event_for("a", 3, "c1"), false);
    c.admit(event_for("b", 1, "c1"), false);
    c.stream_commit(Lsn(20));
    c.flush();
    let s = steps(&mut c);
    assert_eq!(sends(&s).len(), 2, "a v1 and b v1: {s:?}");
    for (t, _) in sends(&s) {
        c.on_report(t, stored(t as i64));
    }
    let s = steps(&mut c);
    let [TxnStep::Commit { kept, .. }] = &s[..] else {
        panic!("{s:?}");
    };
    let kept: Vec<_> = kept
        .iter()
        .map(|k| (k.version, k.quarantined.is_some()))
        .collect();
    assert_eq!(kept, [(2, true), (3, false)]);

    let planted = Planted {
        mutant: Some(Mutant::RouteIgnoresCluster),
        current_route: None,
    };
    let mut c = TxnCore::planted(planted, served(), 10, Lsn(10), 0, vec![]);
    c.admit(event_for("a", 1, "elsewhere"), false);
    c.flush();
    assert_eq!(sends(&steps(&mut c)).len(), 1, "the mutant sends it");
}

#[test]
fn a_batch_lingers_from_the_first_read_since_the_last_flush_unless_it_is_full() {
    use std::time::Duration;
    let ms = Duration::from_millis;
    let mut c = TxnCore::new(served(), 3, Lsn(10), 0, vec![]);
    c.read(false, ms(1));
    assert_eq!(c.linger_started(), None, "a read that moved nothing");
    c.admit(event("a", 1), false);
    c.read(true, ms(2));
    c.admit(event("a", 2), false);
    c.read(true, ms(4));
    assert_eq!(c.linger_started(), Some(ms(2)), "from the first read");
    assert!(steps(&mut c).is_empty(), "lingering: no transaction yet");
    c.admit(event("a", 3), false);
    c.stream_commit(Lsn(30));
    c.read(true, ms(5));
    assert_eq!(c.linger_started(), None, "full: due at once");
    assert_eq!(steps(&mut c)[0], TxnStep::Begin { batch: 1 });
    // While the transaction holds a full batch, what is read queues for its end (the driver
    // flushes when the broker is done), with no linger of its own.
    c.admit(event("b", 1), false);
    c.read(true, ms(7));
    assert_eq!(c.linger_started(), None);
    let mut c = TxnCore::new(served(), 3, Lsn(10), 0, vec![]);
    c.admit(event("a", 1), false);
    c.read(true, ms(8));
    c.flush();
    assert_eq!(c.linger_started(), None, "the linger ended by its flush");
    c.admit(event("b", 1), false);
    c.read(true, ms(9));
    assert_eq!(c.linger_started(), Some(ms(9)), "the next batch's linger");
}

#[test]
fn a_report_without_a_position_proves_nothing_stored_and_aborts_the_batch() {
    use outbox_core::delivery::{DeliveryOutcome, FailureClass, Persistence};
    let stored = |offset| DeliveryOutcome::Persisted {
        topic: "t".into(),
        partition: 1,
        offset,
        timestamp_ms: None,
        duplicate: false,
        evidence: None,
    };
    assert_eq!(
        TxnReport::of(stored(5)),
        TxnReport::Stored {
            partition: 1,
            offset: 5
        }
    );
    assert_eq!(
        TxnReport::of(stored(-1001)),
        TxnReport::Failed { permanent: None }
    );
    let failed = |class| DeliveryOutcome::Failed {
        error: "too large".into(),
        persistence: Persistence::NotPersisted,
        class,
        partition: 1,
    };
    assert_eq!(
        TxnReport::of(failed(FailureClass::Permanent)),
        TxnReport::Failed {
            permanent: Some("too large".into())
        }
    );
    assert_eq!(
        TxnReport::of(failed(FailureClass::Transient)),
        TxnReport::Failed { permanent: None }
    );
}

/// What is read while a transaction is open waits for it: when the broker has answered, it
/// goes in the next transaction at once (`broker_answered`), even when a full batch read
/// meanwhile started no linger. Planted, it waits for ever (the simulator's `txn_lost`).
#[test]
fn what_queued_during_a_transaction_goes_in_the_next_once_the_broker_answered() {
    let run = |mut c: TxnCore<Planted>| {
        let first = event("a", 1);
        c.admit(first, false);
        c.stream_commit(Lsn(20));
        c.flush();
        steps(&mut c);
        // A full batch read while the transaction is open: due, but not taken yet.
        for v in 1..=2 {
            c.admit(event("b", v), false);
        }
        c.stream_commit(Lsn(30));
        c.read(true, std::time::Duration::from_millis(5));
        assert!(
            c.linger_started().is_none(),
            "a full batch starts no linger"
        );
        c.on_report(0, stored(0));
        assert!(matches!(
            steps(&mut c)[..],
            [TxnStep::Commit { batch: 1, .. }]
        ));
        c.on_committed(CommitOutcome::Committed(at(1)));
        c.broker_answered();
        steps(&mut c)
    };
    let core = |mutant| {
        let plant = Planted {
            mutant,
            current_route: None,
        };
        TxnCore::planted(plant, served(), 2, Lsn(10), 0, vec![])
    };
    let next = run(core(None));
    assert!(next.contains(&TxnStep::Begin { batch: 2 }), "{next:?}");
    assert_eq!(sends(&next).len(), 2);
    let stuck = run(core(Some(Mutant::TxnAnswerLeavesQueue)));
    assert!(
        !stuck.iter().any(|s| matches!(s, TxnStep::Begin { .. })),
        "{stuck:?}"
    );
}

/// Batches waiting for the ledger are accepted as one, in order: every receipt, the furthest
/// checkpoint and record, and each batch told accepted after.
#[test]
fn waiting_acceptances_merge_into_one_in_order() {
    let c = TxnCore::new(served(), 10, Lsn(10), 0, vec![]);
    assert_eq!(c.merge_accepts(vec![]), None);
    let accept = |batch, through, record: Option<RecordPosition>, id: u64| TxnStep::Accept {
        batch,
        receipts: vec![TxnReceipt {
            event_id: uuid::Uuid::from_u64_pair(0, id),
            partition: 0,
            offset: id as i64,
        }],
        kept: vec![],
        through: Lsn(through),
        record,
    };
    let (batches, merged) = c
        .merge_accepts(vec![accept(3, 40, Some(at(5)), 1), accept(4, 30, None, 2)])
        .expect("two batches");
    assert_eq!(batches, [3, 4]);
    let TxnStep::Accept {
        batch,
        receipts,
        through,
        record,
        ..
    } = merged
    else {
        panic!("{merged:?}")
    };
    assert_eq!((batch, through, record), (4, Lsn(40), Some(at(5))));
    let offsets: Vec<i64> = receipts.iter().map(|r| r.offset).collect();
    assert_eq!(offsets, [1, 2]);
    // Never behind the durable checkpoint.
    let (_, merged) = c.merge_accepts(vec![accept(5, 5, None, 3)]).unwrap();
    assert!(matches!(
        merged,
        TxnStep::Accept {
            through: Lsn(10),
            ..
        }
    ));
}

/// A replay in exactly-once mode that meets an event an operator skipped does not send it;
/// the events around it go. Planted (`StreamSendsSkipped`), it is sent.
#[test]
fn an_event_an_operator_skipped_is_not_sent_by_an_exactly_once_replay() {
    let run = |mutant| {
        let plant = Planted {
            mutant,
            current_route: None,
        };
        let mut c = TxnCore::planted(plant, served(), 10, Lsn(10), 0, vec![]);
        let evs: Vec<_> = (1..=3).map(|v| event("a", v)).collect();
        c.skipped_by_operator([evs[1].event_id]);
        for e in &evs {
            c.admit(e.clone(), false);
        }
        c.stream_commit(Lsn(30));
        c.flush();
        sends(&steps(&mut c))
            .into_iter()
            .map(|(_, version)| version)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(None), [1, 3], "v2 skipped");
    assert_eq!(run(Some(Mutant::StreamSendsSkipped)), [1, 2, 3]);
}
