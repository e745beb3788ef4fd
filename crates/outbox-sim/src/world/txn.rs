//! Exactly-once into Kafka (issue 30, docs/exactly_once.md): one slot's relay in transactional
//! mode, on a broker with transactions, a transactional id's epochs and a positions topic.
//!
//! Product code decides (`outbox_relay::txn::TxnCore`): what goes into a transaction, when to
//! commit or abort, what is accepted, what a start accepts from the broker's records and what
//! it sends again. Modelled: the broker (a transaction's messages visible to a committed reader
//! only once it commits; `init_transactions` bumps the id's epoch and aborts what an older
//! epoch left open; requests of an older epoch fenced; a commit whose answer is lost, after
//! which it may or may not have happened), the batch records in the positions topic, the ledger
//! (receipts, what a batch keeps, the checkpoint, the last batch and record accepted, fenced by
//! the lease's generation), relays SIGKILLed, paused past their lease and resumed, and
//! acceptances that fail.
//!
//! What it judges, with a product mutant for each (`outbox_relay::Mutant::Txn*`; the gate):
//! * `txn_seen_twice` — copies of an event a `read_committed` consumer sees beyond the first;
//! * `txn_lost` — events neither visible to that consumer nor kept by the ledger (quarantined,
//!   or held behind a quarantined one);
//! * `txn_order_violations` — an aggregate's versions out of order for that consumer;
//! * `txn_receipt_mismatch` — a receipt whose position does not hold its event in a committed
//!   transaction;
//! * `cross_destination_retries` (the event world's counter) — a send of an event frozen for
//!   a cluster this relay does not serve;
//! * `txn_unaccepted` — a batch the broker committed whose receipts (at its positions) and
//!   kept events the ledger does not hold.

use std::collections::{HashMap, HashSet, VecDeque};

use outbox_core::delivery::RecordPosition;
use outbox_core::{Destination, Lsn, OutboxEvent};
use outbox_relay::txn::{
    BrokerAnswer, Kept, Recorded, StreamTxn, TxnCore, TxnEnd, TxnEndStep, TxnReceipt, TxnReport,
    TxnRow, TxnStep,
};
use outbox_relay::Planted;
use uuid::Uuid;

use super::{served, Counts, Mutant, SERVED_CLUSTER};
use crate::rng::SplitMix64;

const AGGREGATES: u64 = 4;
const PARTITIONS: usize = 2;

/// The simulator's mutants that are planted in `outbox_relay::txn`.
fn product_mutant(m: Mutant) -> Option<outbox_relay::Mutant> {
    match m {
        Mutant::TxnIgnoresRecords => Some(outbox_relay::Mutant::TxnIgnoresRecords),
        Mutant::TxnUnknownIsAborted => Some(outbox_relay::Mutant::TxnUnknownIsAborted),
        Mutant::TxnThroughPastBatch => Some(outbox_relay::Mutant::TxnThroughPastBatch),
        Mutant::TxnAcceptsAborted => Some(outbox_relay::Mutant::TxnAcceptsAborted),
        Mutant::TxnReplaysAccepted => Some(outbox_relay::Mutant::TxnReplaysAccepted),
        Mutant::TxnSkipsFirstRecord => Some(outbox_relay::Mutant::TxnSkipsFirstRecord),
        Mutant::TxnRequeuesAtBack => Some(outbox_relay::Mutant::TxnRequeuesAtBack),
        Mutant::TxnReplayedIsAccepted => Some(outbox_relay::Mutant::TxnReplayedIsAccepted),
        Mutant::TxnAnswerLeavesQueue => Some(outbox_relay::Mutant::TxnAnswerLeavesQueue),
        Mutant::TxnStopWithoutWaiting => Some(outbox_relay::Mutant::TxnStopWithoutWaiting),
        Mutant::RouteIgnoresCluster => Some(outbox_relay::Mutant::RouteIgnoresCluster),
        _ => None,
    }
}

/// A row of the simulated stream that cannot be read as an event.
const UNREADABLE: usize = usize::MAX;

struct Event {
    ev: OutboxEvent,
    agg: u64,
    /// The broker refuses it for good (too large).
    poison: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum TxnState {
    Open,
    Committed,
    Aborted,
}

struct Msg {
    event: usize,
    txn: usize,
}

/// The broker: partitions, transactions, the transactional id's epoch, the positions topic.
#[derive(Default)]
struct Broker {
    log: Vec<Vec<Msg>>,
    /// Every transaction: its state and the epoch that began it.
    txns: Vec<(TxnState, u64)>,
    epoch: u64,
    /// The positions topic: (transaction, the batch record).
    records: Vec<(usize, Recorded)>,
}

impl Broker {
    /// `init_transactions`: a new epoch; what an older one left open is aborted.
    fn init(&mut self) -> u64 {
        self.epoch += 1;
        for t in &mut self.txns {
            if t.0 == TxnState::Open {
                t.0 = TxnState::Aborted;
            }
        }
        self.epoch
    }

    fn open(&self, txn: Option<usize>, epoch: u64) -> Option<usize> {
        txn.filter(|t| epoch == self.epoch && self.txns[*t].0 == TxnState::Open)
    }

    /// The committed batch records after `after`, as a `read_committed` reader sees them.
    fn committed_after(&self, after: Option<RecordPosition>) -> Vec<Recorded> {
        self.records
            .iter()
            .filter(|(t, r)| {
                self.txns[*t].0 == TxnState::Committed && after.map_or(true, |a| r.record > a)
            })
            .map(|(_, r)| r.clone())
            .collect()
    }
}

#[derive(Default)]
struct Ledger {
    lease_gen: u64,
    receipts: HashMap<Uuid, (i32, i64)>,
    kept: HashSet<Uuid>,
    /// Held aggregates and the version they are held from.
    holds: HashMap<u64, i64>,
    checkpoint: Lsn,
    last_batch: u64,
    last_record: Option<RecordPosition>,
}

struct Relay {
    core: TxnCore<Planted>,
    gen: u64,
    epoch: u64,
    /// The next stream transaction to read.
    cursor: usize,
    txn: Option<usize>,
    reports: Vec<(u64, TxnReport)>,
    commit: Option<(u64, Lsn, Vec<TxnReceipt>, Vec<Kept>)>,
    abort: bool,
    settle: Option<u64>,
    accepts: VecDeque<TxnStep>,
    paused: bool,
    ended: bool,
    /// Told to stop (`TxnEnd`), and whether the stop's time ran out.
    stopping: Option<(TxnEnd, bool)>,
}

struct Txn<'a> {
    plant: Planted,
    rng: SplitMix64,
    faults: bool,
    batch_size: usize,
    /// An operator stops the running relay now and then (a quarter of the traces).
    stops: bool,
    events: Vec<Event>,
    by_id: HashMap<Uuid, usize>,
    /// The stream: transactions of events, each with its end LSN.
    wal: Vec<(Vec<usize>, Lsn)>,
    broker: Broker,
    ledger: Ledger,
    relays: Vec<Relay>,
    c: &'a mut Counts,
    log: Option<&'a mut Vec<String>>,
}

pub(super) fn run(
    rng: SplitMix64,
    mutant: Option<Mutant>,
    c: &mut Counts,
    log: Option<&mut Vec<String>>,
) {
    let mut rng = rng;
    if !rng.chance(250) {
        return;
    }
    let mut w = Txn {
        plant: Planted {
            mutant: mutant.and_then(product_mutant),
            current_route: None,
        },
        batch_size: 1 + rng.below(4) as usize,
        stops: rng.fork(7).chance(250),
        faults: true,
        events: Vec::new(),
        by_id: HashMap::new(),
        wal: Vec::new(),
        broker: Broker {
            log: (0..PARTITIONS).map(|_| Vec::new()).collect(),
            ..Broker::default()
        },
        ledger: Ledger::default(),
        relays: Vec::new(),
        c,
        log,
        rng,
    };
    w.c.txn_traces += 1;
    w.write_stream();
    let steps = w.rng.range(40, 160);
    for _ in 0..steps {
        w.step();
    }
    w.drain();
    w.judge();
}

impl Txn<'_> {
    fn say(&mut self, line: String) {
        if let Some(log) = self.log.as_deref_mut() {
            log.push(format!("[txn] {line}"));
        }
    }

    fn write_stream(&mut self) {
        let mut versions = [0i64; AGGREGATES as usize];
        // Now and then a row the decoder cannot read as an event (a generator of its own, so
        // the other draws stay).
        let mut unreadable = self.rng.fork(11);
        let txns = self.rng.range(3, 12);
        for t in 0..txns {
            let mut ids = Vec::new();
            for _ in 0..self.rng.range(1, 5) {
                let agg = self.rng.below(AGGREGATES);
                versions[agg as usize] += 1;
                let id = Uuid::from_u64_pair(self.rng.next_u64(), self.rng.next_u64());
                let aggregate_id = format!("t-{agg}");
                // Now and then frozen for a cluster this relay does not serve: quarantined,
                // never sent (the route check).
                let cluster = if self.rng.chance(30) {
                    "B"
                } else {
                    SERVED_CLUSTER
                };
                let ev = OutboxEvent::frozen(
                    id,
                    ("order", &aggregate_id, versions[agg as usize]),
                    "order.changed",
                    bytes::Bytes::from_static(b"{}"),
                    Destination::kafka(cluster, "outbox.order", &aggregate_id),
                );
                self.by_id.insert(id, self.events.len());
                ids.push(self.events.len());
                self.events.push(Event {
                    ev,
                    agg,
                    poison: self.rng.chance(25),
                });
            }
            if unreadable.chance(100) {
                let at = unreadable.below(ids.len() as u64 + 1) as usize;
                ids.insert(at, UNREADABLE);
            }
            self.wal.push((ids, Lsn(10 * (t + 1))));
        }
    }

    /// The daemon's read bound: the stream has more, and fewer events than the relay keeps in
    /// flight are unfinished (`TxnCore::can_read`; a transaction takes up to that many, as the
    /// daemon's batch is at least `--max-in-flight`).
    fn can_read(&self, i: usize) -> bool {
        let r = &self.relays[i];
        r.cursor < self.wal.len() && r.core.can_read(self.batch_size) && r.stopping.is_none()
    }

    fn active(&self) -> Option<usize> {
        self.relays
            .iter()
            .position(|r| !r.paused && !r.ended && r.gen == self.ledger.lease_gen)
    }

    fn step(&mut self) {
        let active = self.active();
        let live = |r: &Relay| !r.paused && !r.ended;
        let has = |f: &dyn Fn(&Relay) -> bool| self.relays.iter().any(|r| live(r) && f(r));
        let weights = [
            u64::from(active.is_some_and(|i| self.can_read(i))) * 10, // 0 read
            u64::from(active.is_some_and(|i| {
                self.relays[i].core.linger_started().is_some() && self.relays[i].stopping.is_none()
            })) * 6, // 1 the linger is over
            u64::from(has(&|r| !r.reports.is_empty())) * 14,          // 2 report
            u64::from(has(&|r| r.commit.is_some())) * 6,              // 3 commit
            u64::from(has(&|r| r.abort)) * 6,                         // 4 abort
            u64::from(has(&|r| r.settle.is_some())) * 6,              // 5 settle
            u64::from(has(&|r| !r.accepts.is_empty())) * 6,           // 6 accept
            u64::from(active.is_some()) * 2,                          // 7 SIGKILL
            u64::from(active.is_some()) * 2,                          // 8 pause
            u64::from(self.relays.iter().any(|r| r.paused)) * 3,      // 9 resume
            u64::from(active.is_none()) * 6,                          // 10 start
            2,                                                        // 11 nothing
            u64::from(self.stops && active.is_some_and(|i| self.relays[i].stopping.is_none())), // 12 stop
        ];
        match self.rng.weighted(&weights) {
            0 => self.read(active.expect("weighted")),
            1 => {
                // The daemon's linger timer: the batch is due.
                let i = active.expect("weighted");
                self.relays[i].core.flush();
                self.execute(i);
            }
            2..=6 => {
                let op = self.rng.weighted(&weights[2..=6]) + 2;
                let cands: Vec<usize> = (0..self.relays.len())
                    .filter(|i| {
                        let r = &self.relays[*i];
                        live(r)
                            && match op {
                                2 => !r.reports.is_empty(),
                                3 => r.commit.is_some(),
                                4 => r.abort,
                                5 => r.settle.is_some(),
                                _ => !r.accepts.is_empty(),
                            }
                    })
                    .collect();
                let i = cands[self.rng.below(cands.len() as u64) as usize];
                match op {
                    2 => self.report(i),
                    3 => self.commit(i),
                    4 => self.abort(i),
                    5 => self.settle(i),
                    _ => self.accept(i),
                }
                self.advance_stop(i);
            }
            7 => {
                let i = active.expect("weighted");
                self.say(format!("SIGKILL relay gen {}", self.relays[i].gen));
                self.relays[i].ended = true;
                self.c.txn_kills += 1;
            }
            8 => {
                let i = active.expect("weighted");
                self.say(format!(
                    "relay gen {} paused past its lease",
                    self.relays[i].gen
                ));
                self.relays[i].paused = true;
            }
            9 => {
                let i = self.relays.iter().position(|r| r.paused).expect("weighted");
                self.say(format!("relay gen {} resumes", self.relays[i].gen));
                self.relays[i].paused = false;
            }
            10 => self.start(),
            12 => {
                // The daemon's `Run::stop`: what was read goes into a last transaction.
                let i = active.expect("weighted");
                self.say(format!("relay gen {} told to stop", self.relays[i].gen));
                self.c.txn_stops += 1;
                let end = TxnEnd::new(&mut self.relays[i].core);
                self.relays[i].stopping = Some((end, false));
                self.execute(i);
                self.advance_stop(i);
            }
            _ => {}
        }
        self.relays.retain(|r| !r.ended);
    }

    /// A stopping run's end, as far as the answers so far take it (`TxnEnd`): it waits
    /// while the core is in a transaction or an acceptance waits, unless nothing can answer
    /// any more or, under faults, its time runs out; then it confirms (the slot is not
    /// modelled) and gives the lease back. A stop that ends with a transaction open before
    /// its time ran out is `txn_stops_left_open`.
    fn advance_stop(&mut self, i: usize) {
        if i >= self.relays.len() || self.relays[i].ended || self.relays[i].paused {
            return;
        }
        let r = &mut self.relays[i];
        let Some((mut end, mut grace_over)) = r.stopping.take() else {
            return;
        };
        loop {
            let r = &mut self.relays[i];
            let answerable = !r.reports.is_empty()
                || r.commit.is_some()
                || r.abort
                || r.settle.is_some()
                || !r.accepts.is_empty();
            match end.next(&r.core, !r.accepts.is_empty()) {
                TxnEndStep::AwaitAnswer if !answerable => {
                    // Nothing will answer: its time runs out.
                    grace_over = true;
                    end.grace_over();
                }
                TxnEndStep::AwaitAnswer if self.faults && self.rng.chance(100) => {
                    grace_over = true;
                    end.grace_over();
                }
                TxnEndStep::AwaitAnswer => {
                    self.relays[i].stopping = Some((end, grace_over));
                    return;
                }
                TxnEndStep::Confirm => {}
                TxnEndStep::Done => {
                    let (open, gen) = (self.relays[i].core.in_transaction(), self.relays[i].gen);
                    self.say(format!(
                        "relay gen {gen} stopped{}",
                        if open {
                            " with its transaction open"
                        } else {
                            ""
                        }
                    ));
                    if open && !grace_over {
                        self.c.txn_stops_left_open += 1;
                    }
                    self.relays[i].ended = true;
                    return;
                }
            }
        }
    }

    /// A run takes the lease, opens the producer (which fences every older one and aborts what
    /// they left open), accepts what the broker recorded after the ledger's last batch, and
    /// streams from the checkpoint.
    fn start(&mut self) {
        self.ledger.lease_gen += 1;
        let gen = self.ledger.lease_gen;
        let epoch = self.broker.init();
        let held = self
            .ledger
            .holds
            .iter()
            .map(|(agg, v)| (("order".to_string(), format!("t-{agg}")), *v))
            .collect();
        let core = TxnCore::planted(
            self.plant.clone(),
            served(),
            self.batch_size,
            self.ledger.checkpoint,
            self.ledger.last_batch,
            held,
        );
        self.relays.push(Relay {
            core,
            gen,
            epoch,
            cursor: 0,
            txn: None,
            reports: Vec::new(),
            commit: None,
            abort: false,
            settle: None,
            accepts: VecDeque::new(),
            paused: false,
            ended: false,
            stopping: None,
        });
        let i = self.relays.len() - 1;
        let recorded = self.broker.committed_after(self.ledger.last_record);
        self.say(format!(
            "relay gen {gen} starts at {} (epoch {epoch}; {} batches recorded after the ledger's last)",
            self.ledger.checkpoint,
            recorded.len()
        ));
        self.relays[i].core.recover(recorded);
        self.execute(i);
        // The recovered batches are accepted before the stream starts.
        while let Some(a) = self.relays[i].accepts.pop_front() {
            self.c.txn_recovered += 1;
            let batch = match &a {
                TxnStep::Accept { batch, .. } => *batch,
                _ => continue,
            };
            if !self.apply(i, a, &[batch]) {
                return;
            }
        }
        // `checkpoint::accepted_through`, read after the recovery: the last stream commit with
        // a receipt in the ledger.
        let bound = self
            .wal
            .iter()
            .filter(|(ids, _)| {
                ids.iter().filter(|e| **e != UNREADABLE).any(|e| {
                    self.ledger
                        .receipts
                        .contains_key(&self.events[*e].ev.event_id)
                })
            })
            .map(|(_, end)| *end)
            .max();
        self.relays[i].core.set_replay_bound(bound);
        let checkpoint = self.ledger.checkpoint;
        self.relays[i].cursor = self
            .wal
            .iter()
            .take_while(|(_, end)| *end <= checkpoint)
            .count();
    }

    fn read(&mut self, i: usize) {
        let (ids, end) = self.wal[self.relays[i].cursor].clone();
        self.relays[i].cursor += 1;
        // The daemon's `Run::admit`: the heads of the aggregates a read meets first, read again
        // (`holds::heads_of`: the highest version with a receipt), then what of it is accepted
        // already is the core's rule. A read here is one stream transaction.
        let rows = ids.iter().map(|e| match *e {
            UNREADABLE => (Err("no aggregate_id".to_string()), end),
            e => (Ok(self.events[e].ev.clone()), end),
        });
        let read = [StreamTxn {
            rows: rows.collect(),
            commit_lsn: end,
            end_lsn: end,
        }];
        let needed = self.relays[i].core.heads_needed_in(&read);
        if !needed.is_empty() {
            let read = needed
                .iter()
                .filter_map(|k| {
                    let head = self
                        .events
                        .iter()
                        .filter(|e| e.ev.aggregate_id == k.1)
                        .filter(|e| self.ledger.receipts.contains_key(&e.ev.event_id))
                        .map(|e| e.ev.aggregate_version)
                        .max()?;
                    Some((k.clone(), head))
                })
                .collect();
            self.relays[i].core.learn_heads(needed, read);
        }
        // What of it is accepted already is the core's rule (`TxnCore::admit_txn`, as the
        // daemon's `Run::admit` gives it each transaction).
        let [t] = read;
        let rows = self.relays[i]
            .core
            .admit_txn(t)
            .expect("the simulated stream's rows carry versions");
        for (e, row) in ids.iter().zip(rows) {
            let accepted = match row {
                TxnRow::NotSent { accepted } => accepted,
                TxnRow::Queued { .. } => false,
                // The daemon accepts its quarantine record at once (`Run::quarantine_unreadable`):
                // it is no event, and nothing of it is sent.
                TxnRow::Unreadable(_) => {
                    self.c.txn_unreadable += 1;
                    continue;
                }
            };
            let ev = &self.events[*e].ev;
            if accepted != self.ledger.receipts.contains_key(&ev.event_id) {
                self.say(format!(
                    "gen {}: {} v{} taken for {} by the replay rule",
                    self.relays[i].gen,
                    ev.aggregate_id,
                    ev.aggregate_version,
                    if accepted { "accepted" } else { "new" }
                ));
            }
        }
        // The daemon's loop after a read: a full batch is due at once, else the linger starts
        // (its time is the linger step's).
        self.relays[i].core.read(true, std::time::Duration::ZERO);
        self.say(format!(
            "gen {} reads stream txn #{} (ends {end})",
            self.relays[i].gen,
            self.relays[i].cursor - 1
        ));
        self.execute(i);
    }

    /// Executes what the core asks; the broker's and the ledger's answers come at later steps.
    fn execute(&mut self, i: usize) {
        while let Some(step) = self.relays[i].core.poll_step() {
            match step {
                TxnStep::Begin { batch } => {
                    let epoch = self.relays[i].epoch;
                    self.relays[i].txn = (epoch == self.broker.epoch).then(|| {
                        self.broker.txns.push((TxnState::Open, epoch));
                        self.broker.txns.len() - 1
                    });
                    self.say(format!("gen {} begins batch {batch}", self.relays[i].gen));
                }
                TxnStep::Send { token, event } => {
                    let e = self.by_id[&event.event_id];
                    let report = self.send(i, e);
                    self.say(format!(
                        "gen {} sends {} v{}: {report:?}",
                        self.relays[i].gen, self.events[e].agg, event.aggregate_version
                    ));
                    self.relays[i].reports.push((token, report));
                }
                TxnStep::Commit {
                    batch,
                    through,
                    receipts,
                    kept,
                } => self.relays[i].commit = Some((batch, through, receipts, kept)),
                TxnStep::Abort { .. } => self.relays[i].abort = true,
                TxnStep::Settle { batch } => self.relays[i].settle = Some(batch),
                a @ TxnStep::Accept { .. } => self.relays[i].accepts.push_back(a),
                TxnStep::Stop => {
                    self.say(format!("gen {} fenced: stops", self.relays[i].gen));
                    self.c.txn_fenced += 1;
                    self.relays[i].ended = true;
                }
            }
        }
    }

    fn send(&mut self, i: usize, e: usize) -> TxnReport {
        let Some(txn) = self.broker.open(self.relays[i].txn, self.relays[i].epoch) else {
            return TxnReport::Fenced;
        };
        if self.events[e].ev.destination.cluster != SERVED_CLUSTER {
            // The producer reaches the served cluster only: a send of an event frozen for
            // another one lands on the served cluster's topic of that name.
            self.say(format!(
                "CROSS-CLUSTER send of {}",
                self.events[e].ev.event_id
            ));
            self.c.cross_destination_retries += 1;
        }
        if self.events[e].poison {
            return TxnReport::Failed {
                permanent: Some("message too large".into()),
            };
        }
        if self.faults && self.rng.chance(40) {
            return TxnReport::Failed { permanent: None };
        }
        let partition = (self.events[e].agg as usize) % PARTITIONS;
        self.broker.log[partition].push(Msg { event: e, txn });
        TxnReport::Stored {
            partition: partition as i32,
            offset: self.broker.log[partition].len() as i64 - 1,
        }
    }

    fn report(&mut self, i: usize) {
        let k = self.rng.below(self.relays[i].reports.len() as u64) as usize;
        let (token, report) = self.relays[i].reports.remove(k);
        self.relays[i].core.on_report(token, report);
        self.execute(i);
    }

    fn commit(&mut self, i: usize) {
        let (batch, through, receipts, kept) = self.relays[i].commit.take().expect("chosen");
        let answer = match self.broker.open(self.relays[i].txn, self.relays[i].epoch) {
            None => BrokerAnswer::CommitFailed { fenced: true },
            Some(txn) => {
                let lost_answer = self.faults && self.rng.chance(80);
                let happens = !lost_answer || self.rng.chance(500);
                let record = RecordPosition {
                    partition: 0,
                    offset: self.broker.records.len() as i64,
                };
                if happens {
                    self.broker.txns[txn].0 = TxnState::Committed;
                    self.broker.records.push((
                        txn,
                        Recorded {
                            batch,
                            through,
                            receipts,
                            kept,
                            record,
                        },
                    ));
                    self.c.txn_commits += 1;
                }
                if lost_answer {
                    self.c.txn_unknown_commits += 1;
                    BrokerAnswer::CommitFailed { fenced: false }
                } else {
                    BrokerAnswer::Committed(Some(record))
                }
            }
        };
        self.say(format!(
            "gen {} commit of batch {batch}: {answer:?}",
            self.relays[i].gen
        ));
        self.relays[i].core.on_broker(answer);
        self.execute(i);
    }

    fn abort(&mut self, i: usize) {
        self.relays[i].abort = false;
        if self.faults && self.rng.chance(20) {
            // The abort does not answer (the producer is unusable): the transaction stays
            // open on the broker until a new producer of the id settles it.
            self.say(format!("gen {} abort unanswered", self.relays[i].gen));
            self.c.txn_unclear_aborts += 1;
            self.relays[i]
                .core
                .on_broker(BrokerAnswer::AbortFailed { fenced: false });
            self.execute(i);
            return;
        }
        let fenced = match self.broker.open(self.relays[i].txn, self.relays[i].epoch) {
            Some(txn) => {
                self.broker.txns[txn].0 = TxnState::Aborted;
                self.c.txn_aborts += 1;
                false
            }
            None => true,
        };
        self.relays[i].core.on_broker(if fenced {
            BrokerAnswer::AbortFailed { fenced: true }
        } else {
            BrokerAnswer::Aborted
        });
        self.execute(i);
    }

    /// The producer is opened again under the same id (settling the transaction: a commit that
    /// happened stays, an open one is aborted), then the broker's records are read.
    fn settle(&mut self, i: usize) {
        let batch = self.relays[i].settle.take().expect("chosen");
        if self.relays[i].gen != self.ledger.lease_gen {
            self.say(format!(
                "gen {} lost its lease while settling",
                self.relays[i].gen
            ));
            self.relays[i].ended = true;
            return;
        }
        self.relays[i].epoch = self.broker.init();
        let found = self
            .broker
            .committed_after(self.ledger.last_record)
            .into_iter()
            .find(|r| r.batch == batch)
            .map(|r| r.record);
        self.say(format!(
            "gen {} settled batch {batch}: {found:?}",
            self.relays[i].gen
        ));
        self.relays[i].core.on_broker(BrokerAnswer::Settled(found));
        self.execute(i);
    }

    /// The daemon's acceptance: every batch waiting, in one ledger transaction
    /// (`TxnCore::merge_accepts`).
    fn accept(&mut self, i: usize) {
        let waiting: Vec<TxnStep> = self.relays[i].accepts.drain(..).collect();
        let Some((batches, a)) = self.relays[i].core.merge_accepts(waiting) else {
            return;
        };
        if self.faults && self.rng.chance(30) {
            // A failed acceptance ends the run; the next one starts from the ledger.
            self.say(format!(
                "gen {}: acceptance failed, run ends",
                self.relays[i].gen
            ));
            self.relays[i].ended = true;
            return;
        }
        self.apply(i, a, &batches);
    }

    /// The ledger's acceptance of `batches` (as one step `a`), fenced by the lease's
    /// generation. Returns whether it applied.
    fn apply(&mut self, i: usize, a: TxnStep, batches: &[u64]) -> bool {
        let TxnStep::Accept {
            batch,
            receipts,
            kept,
            through,
            record,
        } = a
        else {
            return true;
        };
        if self.relays[i].gen != self.ledger.lease_gen {
            self.say(format!(
                "gen {}: lease lost, acceptance refused",
                self.relays[i].gen
            ));
            self.relays[i].ended = true;
            return false;
        }
        for r in &receipts {
            self.ledger
                .receipts
                .entry(r.event_id)
                .or_insert((r.partition, r.offset));
        }
        for k in kept {
            let e = self.by_id[&k.event_id];
            self.ledger.kept.insert(k.event_id);
            if k.quarantined.is_some() {
                let from = self
                    .ledger
                    .holds
                    .entry(self.events[e].agg)
                    .or_insert(i64::MAX);
                *from = (*from).min(k.version);
            }
        }
        self.ledger.checkpoint = self.ledger.checkpoint.max(through);
        self.ledger.last_batch = self.ledger.last_batch.max(batch);
        if record.is_some() {
            self.ledger.last_record = self.ledger.last_record.max(record);
        }
        self.say(format!(
            "gen {} accepted batch {batch}: {} receipts, checkpoint {}",
            self.relays[i].gen,
            receipts.len(),
            self.ledger.checkpoint
        ));
        for b in batches {
            self.relays[i].core.on_accepted(*b);
        }
        true
    }

    /// No more faults: paused relays resume (and find themselves fenced), and a relay runs
    /// until the stream is read and everything accepted.
    fn drain(&mut self) {
        self.faults = false;
        for r in &mut self.relays {
            r.paused = false;
        }
        for _ in 0..2_000 {
            self.relays.retain(|r| !r.ended);
            if let Some(i) = self
                .relays
                .iter()
                .position(|r| r.gen != self.ledger.lease_gen)
            {
                // A stale run finishes what it has pending; every step of it is fenced.
                if !self.pending_step(i) {
                    self.relays[i].ended = true;
                }
                continue;
            }
            let Some(i) = self.active() else {
                self.start();
                continue;
            };
            if self.pending_step(i) {
                continue;
            }
            if self.relays[i].stopping.is_some() {
                // Nothing answers a stopping run any more: it ends.
                self.advance_stop(i);
                continue;
            }
            if self.can_read(i) {
                self.read(i);
                continue;
            }
            // Only the daemon's own reasons move a batch: its linger (or a full batch, or a
            // broker's answer, above). What none of them moves would wait for ever: the judge
            // counts it lost.
            if self.relays[i].core.linger_started().is_some() {
                self.relays[i].core.flush();
                self.execute(i);
                continue;
            }
            if self.relays[i].core.unfinished() > 0 || self.relays[i].cursor < self.wal.len() {
                self.say("DRAIN: nothing moves what is left".into());
            }
            return;
        }
        self.say("DRAIN did not finish".into());
    }

    /// Gives run `i` the next answer it waits for, if any.
    fn pending_step(&mut self, i: usize) -> bool {
        let r = &self.relays[i];
        match () {
            _ if !r.reports.is_empty() => self.report(i),
            _ if r.commit.is_some() => self.commit(i),
            _ if r.abort => self.abort(i),
            _ if r.settle.is_some() => self.settle(i),
            _ if !r.accepts.is_empty() => self.accept(i),
            _ => return false,
        }
        self.advance_stop(i);
        true
    }

    fn judge(&mut self) {
        // What a read_committed consumer sees, partition by partition.
        let mut seen: HashMap<usize, u64> = HashMap::new();
        let mut last: HashMap<u64, i64> = HashMap::new();
        for part in &self.broker.log {
            for m in part {
                if self.broker.txns[m.txn].0 != TxnState::Committed {
                    continue;
                }
                let n = seen.entry(m.event).or_insert(0);
                *n += 1;
                if *n > 1 {
                    self.c.txn_seen_twice += 1;
                    continue;
                }
                let e = &self.events[m.event];
                let v = e.ev.aggregate_version;
                if last.get(&e.agg).is_some_and(|l| *l >= v) {
                    self.c.txn_order_violations += 1;
                }
                last.insert(e.agg, v);
            }
        }
        let lost: Vec<Uuid> = (0..self.events.len())
            .filter(|e| {
                !seen.contains_key(e) && !self.ledger.kept.contains(&self.events[*e].ev.event_id)
            })
            .map(|e| self.events[e].ev.event_id)
            .collect();
        self.c.txn_lost += lost.len() as u64;
        for (id, (p, o)) in &self.ledger.receipts {
            let ok = self
                .broker
                .log
                .get(*p as usize)
                .and_then(|part| part.get(*o as usize))
                .is_some_and(|m| {
                    self.events[m.event].ev.event_id == *id
                        && self.broker.txns[m.txn].0 == TxnState::Committed
                });
            if !ok {
                self.c.txn_receipt_mismatch += 1;
            }
        }
        // A committed batch is accepted when the ledger holds each of its receipts at the
        // record's position and keeps each event it kept.
        let unaccepted = self
            .broker
            .committed_after(None)
            .iter()
            .filter(|r| {
                r.receipts.iter().any(|x| {
                    self.ledger.receipts.get(&x.event_id) != Some(&(x.partition, x.offset))
                }) || r
                    .kept
                    .iter()
                    .any(|k| !self.ledger.kept.contains(&k.event_id))
            })
            .count();
        self.c.txn_unaccepted += unaccepted as u64;
        if !lost.is_empty() || unaccepted > 0 {
            self.say(format!(
                "LOST {lost:?}; {unaccepted} committed batches never accepted"
            ));
        }
    }
}
