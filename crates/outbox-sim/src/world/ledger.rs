//! The ledger model: what `outbox-ledger`'s SQL does with an acceptance batch (receipts in
//! two rounds, quarantines, holds, held events, the fenced checkpoint), closing a hold, and
//! retention. A model of SQL the simulator cannot run; the relay's decisions are not here.

use outbox_core::receipt::{AcceptanceRule, FreshnessRule};
use outbox_core::records::{RefusalFilter, RefusalKind};

use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Receipt {
    pub(super) topic: usize,
    pub(super) partition: usize,
    pub(super) offset: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum AttemptState {
    Unknown,
    Found,
    Absent,
}

pub(super) struct Attempt {
    pub(super) row: usize,
    pub(super) relay_gen: i64,
    pub(super) attempt: i32,
    pub(super) topic: usize,
    pub(super) partition: usize,
    pub(super) unknown_at: u64,
    /// When its send left (how long ago decides whether a look-up re-sends under the key).
    pub(super) sent_at: u64,
    pub(super) state: AttemptState,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum HoldState {
    Held,
    Releasing,
}

pub(super) struct Hold {
    pub(super) state: HoldState,
    pub(super) blocking: Option<usize>,
    pub(super) publish_blocking: bool,
}

pub(super) struct Quarantine {
    pub(super) row: usize,
    pub(super) code: String,
    pub(super) released: bool,
    /// When it was recorded, on the ledger's clock (`recorded_xact`, migration 0015).
    pub(super) recorded: u64,
    /// Resolved by `outboxd quarantine skip` (resolution `skipped`): never to be published.
    pub(super) skipped: bool,
}

/// The ledger tables of `migrations/`.
#[derive(Default)]
pub(super) struct Ledger {
    pub(super) primary: HashMap<usize, Receipt>,
    pub(super) duplicates: Vec<(usize, Receipt)>,
    pub(super) quarantine: Vec<Quarantine>,
    pub(super) holds: HashMap<Agg, Hold>,
    /// The ledger's clock: one tick per quarantine recorded and per poll round read, so a
    /// round's read "sees" exactly the quarantines recorded before it.
    pub(super) seq: u64,
    /// `outbox.poll_rounds`: the lease generation of the last poll round, and its read.
    pub(super) poll_round: Option<(i64, u64)>,
    /// When each primary receipt was accepted, on the ledger's clock (`accepted_xact`).
    pub(super) primary_accepted: HashMap<usize, u64>,
    /// `held_events`: row → released.
    pub(super) held: HashMap<usize, bool>,
    /// `held_events.aggregate_version` of a row written without a version: the version the
    /// relay gave it, which its release publishes (migration 0042).
    pub(super) held_versions: HashMap<usize, i64>,
    pub(super) heads: HashMap<Agg, i64>,
    /// `aggregate_heads`: the heads operators moved (a skipped version counts as passed).
    pub(super) moved: HashMap<Agg, i64>,
    pub(super) attempts: Vec<Attempt>,
    pub(super) checkpoint: Option<Lsn>,
    /// `outbox.accepted_positions` (migration 0034): per relay run (generation; -1 for
    /// receipts without a position), the highest stream position among the receipts it
    /// recorded for the slot (`outbox_core::receipt::raises`). Kept when the slot is
    /// recreated: positions are the cluster's WAL positions, and a paused run of the old slot
    /// may still salvage receipts it read there.
    pub(super) accepted_through: HashMap<i64, StreamPosition>,
    /// `checkpoints.snapshot_done`: the rows the slot will not stream were published.
    pub(super) snapshot_done: bool,
    /// `outbox.stream_versions` (migration 0039) of the slot: per aggregate written plainly,
    /// the version of its last row committed before the slot's checkpoint, as folded from the
    /// log (raised, never lowered; absent: 0). Only the one slot: the traces with plain rows
    /// never recreate it.
    pub(super) stream_versions: HashMap<Agg, i64>,
    /// `outbox.stream_version_log` (migration 0040): one row per checkpoint moved, the
    /// numbering up to it; folded into `stream_versions` at a run's start and whenever an
    /// acceptance folds ([`Ledger::fold_numbering_log`]).
    pub(super) stream_version_log: Vec<Vec<(Agg, i64)>>,
    pub(super) lease_gen: i64,
    pub(super) lease_until: u64,
}

impl Ledger {
    /// `numbering::fold`: the log's versions raised into the map, the log emptied.
    pub(super) fn fold_numbering_log(&mut self) {
        for (agg, v) in self.stream_version_log.drain(..).flatten() {
            let kept = self.stream_versions.entry(agg).or_insert(0);
            *kept = (*kept).max(v);
        }
    }

    /// The next tick of the ledger's clock.
    pub(super) fn tick(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }
    pub(super) fn open_quarantine(&self, row: usize) -> Option<&Quarantine> {
        self.quarantine.iter().find(|q| q.row == row && !q.released)
    }
    /// `outbox_source::snapshot::QUARANTINED_OR_SKIPPED`'s second half.
    pub(super) fn skipped(&self, row: usize) -> bool {
        self.quarantine.iter().any(|q| q.row == row && q.skipped)
    }
    pub(super) fn unknown_open(&self, row: usize) -> bool {
        self.attempts
            .iter()
            .any(|a| a.row == row && a.state == AttemptState::Unknown)
    }
    /// Whether the relay's record for `row` is durable (what lets the checkpoint pass it).
    pub(super) fn resolved(&self, row: usize) -> bool {
        self.primary.contains_key(&row)
            || self.duplicates.iter().any(|(r, _)| *r == row)
            || self.quarantine.iter().any(|q| q.row == row)
            || self.held.contains_key(&row)
    }
}

pub(super) enum Item {
    Receipt {
        row: usize,
        rc: Receipt,
        /// The version it was published with (`ReceiptRecord::aggregate_version`).
        version: i64,
        payload_digest: String,
        dest_digest: String,
        late: bool,
        /// The receipt's stream position (`ReceiptRecord::position`).
        position: Option<StreamPosition>,
    },
    /// `superseded`: decided for an envelope generation a migration has replaced since
    /// (`LedgerItem::superseded`, asked when the batch is accepted).
    Quarantine {
        row: usize,
        code: String,
        superseded: bool,
    },
    Hold {
        agg: Agg,
        blocking: usize,
        superseded: bool,
    },
    Held {
        row: usize,
        /// For a row written without a version: the version the relay gave it.
        by_relay: Option<i64>,
    },
}

impl World {
    /// The core's ledger records, by row index (what the simulated ledger keys on).
    pub(super) fn sim_items(&mut self, i: usize, items: &[LedgerItem]) -> Vec<Item> {
        let row_of = |w: &World, id: &Uuid| w.by_id[id];
        items
            .iter()
            .map(|it| match it {
                LedgerItem::Receipt(r) => Item::Receipt {
                    row: row_of(self, &r.event_id),
                    rc: Receipt {
                        topic: TOPICS
                            .iter()
                            .position(|(_, t)| *t == r.topic)
                            .expect("a simulated topic"),
                        partition: r.partition as usize,
                        offset: r.offset as usize,
                    },
                    version: r.aggregate_version,
                    payload_digest: r.payload_digest.clone(),
                    dest_digest: r.destination_digest.clone(),
                    late: self.relays[i]
                        .late
                        .remove(&(r.event_id, r.partition, r.offset)),
                    position: r.position(),
                },
                LedgerItem::Quarantine(q) => {
                    let row = row_of(self, &q.event_id.expect("simulated rows are readable"));
                    Item::Quarantine {
                        row,
                        code: q.reason_code.clone(),
                        superseded: it
                            .superseded(Some(self.rows[row].current().envelope_generation)),
                    }
                }
                LedgerItem::Hold(h) => {
                    let blocking = row_of(self, &h.blocking_event_id.expect("a blocking event"));
                    Item::Hold {
                        agg: agg_of(&h.aggregate_id),
                        blocking,
                        superseded: it
                            .superseded(Some(self.rows[blocking].current().envelope_generation)),
                    }
                }
                LedgerItem::Held(h) => Item::Held {
                    row: row_of(self, &h.event_id),
                    by_relay: h.by_relay.map(|_| h.aggregate_version),
                },
            })
            .collect()
    }

    /// The product's rule for stale refusals ([`RefusalFilter::stands`]), with the planted
    /// mutant (if it is one of its two).
    fn refusal_stands(&self, kind: RefusalKind, published: bool, superseded: bool) -> bool {
        if self.is(Mutant::BugStaleQuarantine) {
            RefusalFilter::honouring_stale().stands(kind, published, superseded)
        } else if self.is(Mutant::BugSupersededRefusal) {
            RefusalFilter::honouring_superseded().stands(kind, published, superseded)
        } else {
            RefusalFilter::default().stands(kind, published, superseded)
        }
    }

    /// `accept::accept_batch`: one transaction. Returns whether the checkpoint was fenced.
    /// `raises`: what its receipts raise the accepted positions by (`receipt::raises` of the
    /// batch's receipts; `None`, the WAL's insert position, is `next_lsn` here). `numbered`:
    /// with a checkpoint, the numbering up to it (`accept::accept_numbered_batch`), logged in
    /// `outbox.stream_version_log` only if the checkpoint moves (not when fenced), and the log
    /// folded after it when `fold` says so.
    pub(super) fn accept(
        &mut self,
        i: usize,
        items: Vec<Item>,
        raises: Vec<(i64, Option<StreamPosition>)>,
        checkpoint: Option<Lsn>,
        numbered: Vec<(outbox_relay::AggKey, i64)>,
        fold: bool,
    ) -> Result<bool, End> {
        if self.faults && self.rng.chance(15) {
            log!(self, "receipt transaction rolled back");
            self.c.receipt_rollbacks += 1;
            return Err(End::Error("receipt transaction failed"));
        }
        // Receipts in two rounds (first occurrence of an event, then the rest), then
        // quarantines, holds, held events, checkpoint — as the SQL does.
        let mut order: Vec<&Item> = Vec::new();
        let mut seen = HashSet::new();
        let mut rest = Vec::new();
        for it in &items {
            if let Item::Receipt { row, .. } = it {
                if seen.insert(*row) {
                    order.push(it);
                } else {
                    rest.push(it);
                }
            }
        }
        // The acceptance's path (`accept_batch_prepared`): the first round proven new to the
        // slot goes by the plain insert, which the entries' key would refuse for an event
        // with a primary receipt (a fallback, in the product): a proof that was wrong.
        let firsts = order.iter().filter_map(|it| match it {
            Item::Receipt { row, position, .. } => Some((*row, *position)),
            _ => None,
        });
        let gen = self.relays[i].gen;
        let through = self
            .ledger
            .accepted_through
            .iter()
            .filter(|(g, _)| **g != gen)
            .map(|(_, p)| *p)
            .max();
        let proved = if self.is(Mutant::FreshByCommit) {
            FreshnessRule::commit_only().proved_new(through, firsts.clone().map(|f| f.1))
        } else {
            receipt::proved_new(through, firsts.clone().map(|f| f.1))
        };
        if proved {
            let wrong: Vec<usize> = firsts
                .map(|(row, _)| row)
                .filter(|row| self.ledger.primary.contains_key(row))
                .collect();
            for row in wrong {
                log!(
                    self,
                    "batch proven new holds {}, which has its primary receipt",
                    self.rows[row].ev.event_id
                );
                self.c.fresh_proofs_wrong += 1;
            }
        }
        for (key, p) in raises {
            let p = p.unwrap_or(StreamPosition {
                commit_lsn: Lsn(self.next_lsn),
                change_lsn: Lsn(u64::MAX),
            });
            let at = self.ledger.accepted_through.entry(key).or_insert(p);
            *at = (*at).max(p);
        }
        order.extend(rest);
        for it in &items {
            if matches!(it, Item::Quarantine { .. }) {
                order.push(it);
            }
        }
        for it in &items {
            if matches!(it, Item::Hold { .. }) {
                order.push(it);
            }
        }
        for it in &items {
            if matches!(it, Item::Held { .. }) {
                order.push(it);
            }
        }
        for it in order {
            match it {
                Item::Receipt {
                    row,
                    rc,
                    version,
                    payload_digest,
                    dest_digest,
                    late,
                    ..
                } => {
                    let row = *row;
                    // A plain row's receipt keeps the version the relay published it with:
                    // its commit rank, or status, the audit and consumers are told another.
                    if self.rows[row].plain && *version != self.rows[row].version {
                        log!(
                            self,
                            "PLAIN VERSION WRONG: receipt of {} says v{version}, committed as v{}",
                            self.rows[row].ev.event_id,
                            self.rows[row].version
                        );
                        self.plain_receipts_wrong += 1;
                    }
                    // Purge keeps a tombstone (event id, digests, publish slot): a late ACK of
                    // a purged event is still recognised as a duplicate, not a conflict. The
                    // row is not read: only a destination migration's digest is compared.
                    let cur = self.rows[row].current();
                    let before = self.ledger.primary.get(&row).copied();
                    let (migrated, digests) = (
                        self.rows[row].migrated_digest(),
                        Digests {
                            payload: payload_digest,
                            destination: dest_digest,
                        },
                    );
                    let class = if self.is(Mutant::LastAckWins) {
                        AcceptanceRule::last_ack_wins().classify(
                            migrated,
                            before.is_some(),
                            digests,
                        )
                    } else {
                        receipt::classify(migrated, before.is_some(), digests)
                    };
                    match class {
                        ReceiptClass::Primary => {
                            self.ledger.primary.insert(row, *rc);
                            let tick = self.ledger.tick();
                            self.ledger.primary_accepted.insert(row, tick);
                            let agg = self.rows[row].agg;
                            let v = self.rows[row].version;
                            let h = self.ledger.heads.entry(agg).or_insert(0);
                            *h = (*h).max(v);
                            if let Some(released) = self.ledger.held.get_mut(&row) {
                                *released = true;
                            }
                        }
                        ReceiptClass::Duplicate => {
                            self.ledger.duplicates.push((row, *rc));
                            self.c.duplicate_receipts += 1;
                        }
                        ReceiptClass::Conflict(c) => {
                            log!(
                                self,
                                "receipt of {} quarantined: {}",
                                cur.event_id,
                                c.reason_code()
                            );
                            self.c.conflicts += 1;
                            let recorded = self.ledger.tick();
                            self.ledger.quarantine.push(Quarantine {
                                row,
                                code: c.reason_code().to_string(),
                                released: false,
                                recorded,
                                skipped: false,
                            });
                        }
                    }
                    if *late {
                        self.c.late_acks += 1;
                        let after = self.ledger.primary.get(&row).copied();
                        let converged = !matches!(class, ReceiptClass::Conflict(_))
                            && after == Some(before.unwrap_or(*rc));
                        if converged {
                            self.c.late_acks_converged += 1;
                        } else {
                            log!(
                                self,
                                "LATE ACK of {} did not converge ({class:?})",
                                cur.event_id
                            );
                        }
                    }
                }
                Item::Quarantine {
                    row,
                    code,
                    superseded,
                } => {
                    // A published event is never quarantined afterwards (a zombie's batch
                    // may carry a refusal decided before a migration published it), nor for a
                    // generation a migration replaced.
                    let published = self.ledger.primary.contains_key(row);
                    let stands =
                        self.refusal_stands(RefusalKind::Quarantine, published, *superseded);
                    if self.ledger.open_quarantine(*row).is_none() && stands {
                        if self.ledger.primary.contains_key(row) {
                            log!(
                                self,
                                "SPURIOUS quarantine of published {}",
                                self.rows[*row].ev.event_id
                            );
                            self.c.spurious_quarantines += 1;
                        }
                        let recorded = self.ledger.tick();
                        log!(
                            self,
                            "quarantine of {} ({code}) recorded by gen {}{}",
                            self.rows[*row].ev.event_id,
                            self.relays[i].gen,
                            if self.relays[i].salvaging {
                                " (salvaging)"
                            } else {
                                ""
                            }
                        );
                        self.ledger.quarantine.push(Quarantine {
                            row: *row,
                            code: code.clone(),
                            released: false,
                            recorded,
                            skipped: false,
                        });
                    }
                }
                Item::Hold {
                    blocking,
                    superseded,
                    ..
                } if !self.refusal_stands(
                    RefusalKind::Hold,
                    self.ledger.primary.contains_key(blocking),
                    *superseded,
                ) => {}
                Item::Hold { agg, blocking, .. } => match self.ledger.holds.get_mut(agg) {
                    None => {
                        self.ledger.holds.insert(
                            *agg,
                            Hold {
                                state: HoldState::Held,
                                blocking: Some(*blocking),
                                publish_blocking: true,
                            },
                        );
                    }
                    Some(h) if h.state == HoldState::Releasing => {
                        *h = Hold {
                            state: HoldState::Held,
                            blocking: Some(*blocking),
                            publish_blocking: true,
                        };
                    }
                    Some(_) => {}
                },
                Item::Held { row, by_relay } => {
                    let published = self.ledger.primary.contains_key(row);
                    if self.refusal_stands(RefusalKind::Held, published, false) {
                        if !self.ledger.held.contains_key(row) {
                            if let Some(v) = by_relay {
                                self.ledger.held_versions.insert(*row, *v);
                            }
                        }
                        self.ledger.held.entry(*row).or_insert(false);
                    }
                }
            }
        }
        let mut fenced = false;
        if let Some(c) = checkpoint {
            let gen = self.relays[i].gen;
            if self.ledger.lease_gen == gen && self.now <= self.ledger.lease_until {
                let cp = self.ledger.checkpoint.get_or_insert(c);
                *cp = (*cp).max(c);
                if !numbered.is_empty() {
                    let row = numbered.into_iter().map(|(k, v)| (agg_of(&k.1), v));
                    self.ledger.stream_version_log.push(row.collect());
                    if fold {
                        self.ledger.fold_numbering_log();
                    }
                }
            } else {
                fenced = true;
            }
        }
        Ok(fenced)
    }

    /// `holds::close`.
    pub(super) fn close_hold(&mut self, agg: Agg, last: Option<i64>) -> bool {
        if let Some(v) = last {
            let h = self.ledger.heads.entry(agg).or_insert(0);
            *h = (*h).max(v);
            let m = self.ledger.moved.entry(agg).or_insert(0);
            *m = (*m).max(v);
        }
        let rows: Vec<usize> = self
            .ledger
            .held
            .keys()
            .copied()
            .filter(|r| self.rows[*r].agg == agg)
            .collect();
        for r in &rows {
            if self.ledger.primary.contains_key(r)
                || (self.ledger.skipped(*r) && !self.is(Mutant::BugRepublishSkipped))
            {
                self.ledger.held.insert(*r, true);
            }
        }
        let open = rows.iter().any(|r| self.ledger.held.get(r) == Some(&false));
        if !open
            && self
                .ledger
                .holds
                .get(&agg)
                .is_some_and(|h| h.state == HoldState::Releasing)
        {
            self.ledger.holds.remove(&agg);
            true
        } else {
            false
        }
    }

    /// Retention (`outbox_core::receipt::may_purge`): an event's row, receipts and inbox
    /// entries go only when it is published, the checkpoint and slot are past it (no replay
    /// can bring it back), its last send is older than the replay window (no append can still
    /// land), and every consumer's committed offset is past every copy of it.
    pub(super) fn purge(&mut self) {
        let mut purged = Vec::new();
        for r in 0..self.rows.len() {
            let row = &self.rows[r];
            if row.purged || !self.ledger.primary.contains_key(&r) {
                continue;
            }
            // Poll mode has no WAL to replay (its receipts carry no commit LSN), but the live
            // lease's round may hold the event if it read before the receipt (retention.rs).
            let replayable = if self.poll {
                let accepted = self.ledger.primary_accepted.get(&r).copied();
                accepted.is_some_and(|t| self.poll_round_missed(t))
                    && !self.is(Mutant::PollPurgeHeld)
            } else {
                self.ledger.checkpoint.map_or(true, |c| row.commit_end > c)
                    || self.slot_confirmed.map_or(true, |c| row.commit_end > c)
            };
            let consumed_by_all = self.consumers.iter().all(|c| {
                (0..TOPICS.len() * MAX_PARTITIONS).all(|tp| {
                    let msgs = &self.broker[tp / MAX_PARTITIONS][tp % MAX_PARTITIONS];
                    msgs.iter()
                        .enumerate()
                        .filter(|(_, m)| m.row == r)
                        .all(|(o, _)| c.committed[tp] > o)
                })
            });
            let facts = receipt::PurgeFacts {
                published: true,
                replayable,
                unknown_open: self.ledger.unknown_open(r),
                since_last_send_ms: self.now - row.last_send,
                replay_window_ms: REPLAY_WINDOW,
                consumed_by_all,
            };
            let purgeable = if self.is(Mutant::PurgeEarly) {
                receipt::PurgeRule::ignoring_readers().may_purge(facts)
            } else {
                receipt::may_purge(facts)
            };
            if purgeable.is_err() {
                continue;
            }
            purged.push(r);
        }
        for r in purged {
            log!(self, "purge {}", self.rows[r].ev.event_id);
            self.rows[r].purged = true;
            self.c.purges += 1;
            let id = self.rows[r].ev.event_id;
            for c in &mut self.consumers {
                c.model.purge(&id);
            }
        }
    }
}
