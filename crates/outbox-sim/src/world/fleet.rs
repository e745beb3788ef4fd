//! Fleets of relays: the members of `outboxd run --fleet` sharing the shards of a sharded
//! outbox, joining, dying (SIGKILL) and pausing (SIGSTOP, shorter or longer than their lease),
//! on simulated time.
//!
//! Product code decides: what a member starts, stops and aborts (`outbox_relay::fleet::Member`,
//! every [`fleet::TICK`], which asks `fleet::plan_planted` what to take, hand over and give up,
//! with [`fleet::STOP_GRACE`] and [`fleet::give_up`]), how often a standby asks for a lease
//! (`outbox_relay::lifecycle::RunLoop`, which waits `standby_poll`), when a streaming relay
//! renews (`lifecycle::renew_every`), and whether and when a shard relay whose lease was lost
//! runs again (`RunLoop::ended`, the daemon's `relay::run`). Modelled: the ledger's leases (`outbox_ledger::lease`: free,
//! expired, the member's own, or taken at once from a holder whose session is gone), the
//! members' rows and session locks (`lease::live_members`: a fresh row *and* a held lock), and
//! how long a shard relay takes to connect, attach its slot and drain when told to stop (now
//! and then it hangs, and the member aborts it).
//!
//! This world judges availability, not events (one slot's events are the event world's, in
//! `mod.rs`; a shard is such a slot, and its lease fences it the same way):
//! * `fleet_unserved` — a shard that no relay streams past a bound: 2 s after its holder was
//!   SIGKILLed (issue 26's bound; `fleet_takeover` measures it), 3 s after its holder handed it
//!   over (one member tick more: members race for free shards), the lease TTL plus 3 s after
//!   a member paused, [`fleet::STOP_GRACE`] plus 3 s after a stop that hangs (the member
//!   aborts it and gives its lease back);
//! * `fleet_share_not_returned` — a member that resumed or joined and does not stream at least
//!   the shard count over the live members (rounded down) 10 s later.
//!
//! Each has a product mutant in `outbox_relay::fleet` that makes it non-zero (the gate).

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_relay::fleet::{self, Effect};
use outbox_relay::lifecycle::{self, LeaseAnswer, LoopStep, RunError, RunLoop};
use outbox_relay::Planted;

use super::{Counts, Mutant};
use crate::rng::SplitMix64;

/// The simulation's resolution, in milliseconds.
const STEP: u64 = 50;
/// The lease TTL (the end-to-end fleet test's).
const TTL: u64 = 3_000;
/// A shard whose holder was SIGKILLed or handed it over streams again within this.
const TAKEOVER_BOUND: u64 = 2_000;
/// A shard handed over streams again within this: the SIGKILL bound plus one member tick lost
/// to a race (members choose free shards without a coordinator; two may go for the same one,
/// and the loser takes another at its next tick).
const HANDOVER_BOUND: u64 = TAKEOVER_BOUND + 2 * 500;
/// A member that resumed or joined streams its share within this.
const SHARE_BOUND: u64 = 10_000;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn ms_of(d: Duration) -> u64 {
    d.as_millis() as u64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Alive,
    Paused,
    Dead,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Connecting (the process's run begins).
    Starting {
        until: u64,
    },
    /// Waiting for the lease (asks at `next_try`).
    Standby {
        next_try: u64,
    },
    /// Lease taken, attaching the slot.
    Attaching {
        until: u64,
    },
    /// Streaming: the shard is served while the lease is still this task's.
    Streaming {
        next_renew: u64,
    },
    /// The run ended (lease lost); the next one begins at `until`.
    Backoff {
        until: u64,
    },
    /// Told to stop: drains, confirms and releases at `until` (`u64::MAX`: hangs, renewing).
    Draining {
        until: u64,
    },
    Ended,
}

#[derive(Debug)]
struct Task {
    id: u64,
    shard: u16,
    state: State,
    stop: bool,
    /// Told to stop, it hangs (until the member aborts it).
    hangs: bool,
    /// The product's loop of its runs: stand by, run, retry or stop (`lifecycle::RunLoop`).
    life: RunLoop,
}

#[derive(Debug)]
struct Member {
    name: String,
    life: Life,
    seen_at: Option<u64>,
    next_tick: u64,
    /// The product's bookkeeping of this member's shard relays: what runs, what was told to
    /// stop and when it is aborted (`outbox_relay::fleet::Member`).
    core: fleet::Member,
    /// Its shard relays, running or told to stop, by the core's relay id.
    tasks: BTreeMap<u64, Task>,
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    member: usize,
    task: u64,
    until: u64,
    released: bool,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Join,
    Kill { restart_after: Option<u64> },
    Pause { for_ms: u64 },
}

struct Fleet<'a> {
    rng: SplitMix64,
    plant: Planted,
    now: u64,
    count: u16,
    members: Vec<Member>,
    leases: Vec<Option<Lease>>,
    next_task: u64,
    /// Per shard: until when being unserved is excused, whether this unserved stretch was
    /// counted, and since when a SIGKILL left it unserved.
    excused_until: Vec<u64>,
    counted: Vec<bool>,
    killed_at: Vec<Option<u64>>,
    /// (member, due): share checks.
    share_checks: Vec<(usize, u64)>,
    /// Until when a stop that hung keeps its shard from anyone (until the member aborts it and
    /// gives its lease back): a member waiting for its share may wait that long.
    hung_until: u64,
    c: &'a mut Counts,
    log: Option<&'a mut Vec<String>>,
}

/// Runs a fleet scenario for trace `rng` (a quarter of the traces), adding to `c`.
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
    let count = [2u16, 4, 8, 8, 8][rng.below(5) as usize];
    let first = 2 + rng.below(3) as usize;
    let mut f = Fleet {
        plant: Planted {
            mutant: mutant.and_then(product_mutant),
            current_route: None,
        },
        now: 0,
        count,
        members: Vec::new(),
        leases: vec![None; usize::from(count)],
        next_task: 0,
        excused_until: vec![0; usize::from(count)],
        counted: vec![false; usize::from(count)],
        killed_at: vec![None; usize::from(count)],
        share_checks: Vec::new(),
        hung_until: 0,
        c,
        log,
        rng,
    };
    f.c.fleet_traces += 1;
    f.say(format!("fleet: {count} shards, {first} members"));
    for _ in 0..first {
        let at = f.rng.below(1_000);
        f.join(at);
    }
    // The first members settle before the first fault: every shard is served by then.
    f.excused_until.iter_mut().for_each(|e| *e = 3_000);
    let faults = 1 + f.rng.below(3);
    let mut at = 15_000 + f.rng.below(5_000);
    let mut plan: Vec<(u64, Fault)> = Vec::new();
    for _ in 0..faults {
        let fault = match f.rng.below(3) {
            0 => Fault::Join,
            1 => Fault::Kill {
                restart_after: f.rng.chance(500).then(|| 1_000 + f.rng.below(4_000)),
            },
            _ => Fault::Pause {
                for_ms: 500 + f.rng.below(TTL + 8_000),
            },
        };
        plan.push((at, fault));
        let lasts = match fault {
            Fault::Join => 0,
            Fault::Kill { restart_after } => restart_after.unwrap_or(0),
            Fault::Pause { for_ms } => for_ms,
        };
        at += lasts + SHARE_BOUND + 10_000 + f.rng.below(10_000);
    }
    let end = at + 20_000;
    let mut resumes: Vec<(u64, usize)> = Vec::new();
    let mut restarts: Vec<u64> = Vec::new();
    while f.now < end {
        f.now += STEP;
        if let Some(i) = plan.iter().position(|(t, _)| *t <= f.now) {
            let (_, fault) = plan.remove(i);
            match fault {
                Fault::Join => f.join(f.now),
                Fault::Kill { restart_after } => {
                    if let Some(m) = f.victim() {
                        f.kill(m);
                        if let Some(after) = restart_after {
                            restarts.push(f.now + after);
                        }
                    }
                }
                Fault::Pause { for_ms } => {
                    if let Some(m) = f.victim() {
                        f.pause(m);
                        resumes.push((f.now + for_ms, m));
                    }
                }
            }
        }
        for (_, m) in resumes
            .iter()
            .filter(|(t, _)| *t <= f.now)
            .copied()
            .collect::<Vec<_>>()
        {
            f.resume(m);
        }
        resumes.retain(|(t, _)| *t > f.now);
        // A SIGKILLed member comes back under another relay id, as a restarted process does
        // in the end-to-end test.
        let due = restarts.iter().filter(|t| **t <= f.now).count();
        restarts.retain(|t| *t > f.now);
        for _ in 0..due {
            f.join(f.now);
        }
        f.step();
        f.judge();
    }
}

/// The simulator's fleet mutants, planted in the product's `fleet::plan_planted`.
fn product_mutant(m: Mutant) -> Option<outbox_relay::Mutant> {
    match m {
        Mutant::FleetWaitsForExpiry => Some(outbox_relay::Mutant::FleetWaitsForExpiry),
        Mutant::FleetShareRoundsDown => Some(outbox_relay::Mutant::FleetShareRoundsDown),
        Mutant::FleetNeverHandsOver => Some(outbox_relay::Mutant::FleetNeverHandsOver),
        Mutant::BugFleetWaitingFillsShare => Some(outbox_relay::Mutant::FleetWaitingFillsShare),
        Mutant::BugFleetNoEvening => Some(outbox_relay::Mutant::FleetNoEvening),
        Mutant::FleetAbortKeepsLease => Some(outbox_relay::Mutant::FleetAbortKeepsLease),
        _ => None,
    }
}

impl Fleet<'_> {
    fn say(&mut self, line: String) {
        if let Some(log) = self.log.as_deref_mut() {
            log.push(format!("[{:>8} ms] {line}", self.now));
        }
    }

    /// Judges no member's share before `until` (a fault changes every member's share; a stop
    /// that hung keeps its shard from anyone).
    fn delay_share_checks(&mut self, until: u64) {
        for (_, due) in self.share_checks.iter_mut() {
            *due = (*due).max(until);
        }
    }

    /// A fault: what is due is judged a full bound later.
    fn rearm_share_checks(&mut self) {
        self.delay_share_checks(self.now + SHARE_BOUND);
    }

    /// Shard `s` may be unserved until `until`.
    fn excuse(&mut self, s: usize, until: u64) {
        self.excused_until[s] = self.excused_until[s].max(until);
    }

    fn join(&mut self, at: u64) {
        self.c.fleet_joins += 1;
        self.rearm_share_checks();
        let m = self.members.len();
        self.members.push(Member {
            name: format!("m{m}"),
            life: Life::Alive,
            seen_at: None,
            next_tick: at + self.rng.below(500),
            core: fleet::Member::default(),
            tasks: BTreeMap::new(),
        });
        self.say(format!("m{m} joins"));
        // Its share, 10 s after it joined (the first members settle before anything is judged).
        if at > 1_000 {
            self.share_checks
                .push((m, (at + SHARE_BOUND).max(self.hung_until)));
        }
    }

    /// A member to kill or pause: never the last one alive.
    fn victim(&mut self) -> Option<usize> {
        let alive: Vec<usize> = (0..self.members.len())
            .filter(|m| self.members[*m].life == Life::Alive)
            .collect();
        (alive.len() >= 2).then(|| alive[self.rng.below(alive.len() as u64) as usize])
    }

    /// The shards member `m` streams now.
    fn served_by(&self, m: usize) -> Vec<u16> {
        (0..self.count)
            .filter(|s| self.server(*s) == Some(m))
            .collect()
    }

    fn kill(&mut self, m: usize) {
        self.c.fleet_kills += 1;
        self.rearm_share_checks();
        self.say(format!("SIGKILL {}", self.members[m].name));
        for s in self.served_by(m) {
            self.killed_at[usize::from(s)] = Some(self.now);
        }
        for s in self.leased_by(m) {
            self.excuse(s, self.now + TAKEOVER_BOUND);
        }
        self.members[m].life = Life::Dead;
        self.share_checks.retain(|(x, _)| *x != m);
    }

    fn pause(&mut self, m: usize) {
        self.c.fleet_pauses += 1;
        self.rearm_share_checks();
        self.say(format!("SIGSTOP {}", self.members[m].name));
        // Its leases expire at most a TTL from now; then a standby takes each. Until its row
        // is stale (a TTL) it still counts as a live member, with its share: a shard nobody
        // streams now may be waiting for its room.
        let leased = self.leased_by(m);
        for s in 0..self.count {
            if leased.contains(&usize::from(s)) || self.server(s).is_none() {
                self.excuse(usize::from(s), self.now + TTL + HANDOVER_BOUND);
            }
        }
        self.members[m].life = Life::Paused;
        self.share_checks.retain(|(x, _)| *x != m);
    }

    fn resume(&mut self, m: usize) {
        if self.members[m].life != Life::Paused {
            return;
        }
        self.say(format!("SIGCONT {}", self.members[m].name));
        self.members[m].life = Life::Alive;
        // Its loop's sleep is over: it ticks at once.
        self.members[m].next_tick = self.now;
        self.share_checks
            .push((m, (self.now + SHARE_BOUND).max(self.hung_until)));
    }

    /// Whether task `id` still has a session: its process runs or is paused, and it was not
    /// aborted or ended. A lease whose holder has none is taken at once (early takeover).
    fn task_has_session(&self, id: u64) -> bool {
        self.members.iter().any(|m| {
            m.life != Life::Dead
                && m.tasks
                    .values()
                    .any(|t| t.id == id && t.state != State::Ended)
        })
    }

    /// The member whose task streams shard `s` with the lease still its own.
    fn server(&self, s: u16) -> Option<usize> {
        let l = self.leases[usize::from(s)]?;
        if l.released || l.until < self.now {
            return None;
        }
        let m = &self.members[l.member];
        (m.life == Life::Alive
            && m.tasks.values().any(|t| {
                t.shard == s && t.id == l.task && matches!(t.state, State::Streaming { .. })
            }))
        .then_some(l.member)
    }

    /// `lease::try_acquire`: free, expired, the member's own, or its holder's session gone.
    /// `Err(remaining)` while another holds it.
    fn try_acquire(&mut self, m: usize, s: u16, task: u64) -> Result<(), u64> {
        let now = self.now;
        if let Some(l) = self.leases[usize::from(s)] {
            let free =
                l.released || l.until < now || l.member == m || !self.task_has_session(l.task);
            if !free {
                return Err(l.until - now);
            }
        }
        self.leases[usize::from(s)] = Some(Lease {
            member: m,
            task,
            until: now + TTL,
            released: false,
        });
        Ok(())
    }

    /// Whether the lease is still `t`'s (`lease::renew` checks the holder's generation, not
    /// the expiry: a lease that expired and that nobody took is renewed).
    fn holds(&self, t: &Task) -> bool {
        self.leases[usize::from(t.shard)].is_some_and(|l| l.task == t.id && !l.released)
    }

    /// The shards whose lease member `m` holds (streaming or not yet).
    fn leased_by(&self, m: usize) -> Vec<usize> {
        (0..usize::from(self.count))
            .filter(|s| self.leases[*s].is_some_and(|l| l.member == m && !l.released))
            .collect()
    }

    fn release(&mut self, t: &Task) {
        if let Some(l) = self.leases[usize::from(t.shard)].as_mut() {
            if l.task == t.id {
                l.released = true;
            }
        }
    }

    /// One shard relay's run loop, as `outboxd/src/relay/mod.rs` runs it.
    fn step_task(&mut self, m: usize, t: &mut Task) {
        let now = self.now;
        t.state = match t.state {
            // Connected, or its backoff over: the run asks for the lease.
            State::Starting { until } | State::Backoff { until } if now >= until => {
                if t.stop {
                    State::Ended
                } else {
                    t.life.begin();
                    State::Standby { next_try: now }
                }
            }
            State::Standby { next_try } if now >= next_try => {
                if t.stop {
                    State::Ended
                } else {
                    let answer = match self.try_acquire(m, t.shard, t.id) {
                        Ok(()) => LeaseAnswer::Acquired,
                        Err(remaining) => LeaseAnswer::HeldBy {
                            remaining: ms(remaining),
                        },
                    };
                    match t.life.lease_answer(answer) {
                        LoopStep::Standby { wait, .. } => State::Standby {
                            next_try: now + ms_of(wait),
                        },
                        _ => State::Attaching {
                            until: now + 100 + self.rng.below(400),
                        },
                    }
                }
            }
            State::Attaching { until } if now >= until => {
                if t.stop {
                    self.release(t);
                    State::Ended
                } else {
                    t.life.streaming(ms(now));
                    State::Streaming {
                        next_renew: now + ms_of(lifecycle::renew_every(ms(TTL))),
                    }
                }
            }
            State::Streaming { .. } if t.stop => State::Draining {
                until: if t.hangs {
                    u64::MAX
                } else {
                    now + 50 + self.rng.below(450)
                },
            },
            State::Streaming { next_renew } if now >= next_renew => {
                if self.holds(t) {
                    if let Some(l) = self.leases[usize::from(t.shard)].as_mut() {
                        l.until = now + TTL;
                    }
                    State::Streaming {
                        next_renew: now + ms_of(lifecycle::renew_every(ms(TTL))),
                    }
                } else {
                    // The lease was lost (taken while this member was paused): the run ends
                    // with a transient error.
                    let lost = RunError {
                        transient: true,
                        lease_lost: true,
                    };
                    match t.life.ended(ms(now), lost) {
                        LoopStep::Retry { after } => State::Backoff {
                            until: now + ms_of(after),
                        },
                        _ => State::Ended,
                    }
                }
            }
            State::Draining { until } if until == u64::MAX => {
                // A hung stop: its lease keeper still renews, until the member aborts it.
                if self.holds(t) {
                    if let Some(l) = self.leases[usize::from(t.shard)].as_mut() {
                        l.until = now + TTL;
                    }
                }
                t.state
            }
            State::Draining { until } if now >= until => {
                self.release(t);
                State::Ended
            }
            s => s,
        };
    }

    /// One member's loop iteration, as `outboxd/src/relay/fleet.rs` runs it.
    fn tick(&mut self, m: usize) {
        let now = self.now;
        self.members[m].seen_at = Some(now);
        self.members[m].next_tick = now + ms_of(fleet::TICK);
        let names: Vec<String> = self
            .members
            .iter()
            .filter(|x| {
                x.life != Life::Dead && x.seen_at.is_some_and(|at| now.saturating_sub(at) <= TTL)
            })
            .map(|x| x.name.clone())
            .collect();
        let holders: BTreeMap<u16, String> = (0..self.count)
            .filter_map(|s| {
                let l = self.leases[usize::from(s)]?;
                (!l.released && l.until > now).then(|| (s, self.members[l.member].name.clone()))
            })
            .collect();
        let member = &mut self.members[m];
        let ended: Vec<u64> = member
            .tasks
            .iter()
            .filter(|(_, t)| t.state == State::Ended)
            .map(|(id, _)| *id)
            .collect();
        for id in ended {
            member.tasks.remove(&id);
            member.core.ended(id);
        }
        let me = member.name.clone();
        let seen = fleet::Seen {
            count: self.count,
            me: &me,
            members: &names,
            holders: &holders,
            give_up: fleet::give_up(ms(TTL)),
            stop_grace: fleet::STOP_GRACE,
        };
        let effects = self.members[m]
            .core
            .tick_planted(ms(now), &seen, &self.plant);
        for effect in effects {
            match effect {
                Effect::Abort { id, shard, release } => {
                    self.say(format!("{me} aborts its stopped relay of shard {shard}"));
                    // Aborted: its session closes (its lease may be taken early by a relay
                    // that asks); given back, the other members see the shard free at once.
                    if let Some(mut t) = self.members[m].tasks.remove(&id) {
                        t.state = State::Ended;
                        if release {
                            self.release(&t);
                        }
                    }
                }
                Effect::Stop {
                    id,
                    shard,
                    handover,
                } => {
                    if handover {
                        self.c.fleet_handovers += 1;
                        self.say(format!("{me} hands shard {shard} over"));
                    }
                    let hangs = self.rng.chance(50);
                    // The next holder takes the shard once it is released, or, if the stop
                    // hangs, once the member aborts it and gives its lease back.
                    let until = now
                        + if hangs {
                            ms_of(fleet::STOP_GRACE) + HANDOVER_BOUND
                        } else {
                            HANDOVER_BOUND
                        };
                    if hangs {
                        // A member waiting for its share waits that long too.
                        self.hung_until = self.hung_until.max(until);
                        self.delay_share_checks(until);
                    }
                    let held = self.members[m]
                        .tasks
                        .get(&id)
                        .is_some_and(|t| self.holds(t));
                    if held {
                        self.excuse(usize::from(shard), until);
                    }
                    if let Some(t) = self.members[m].tasks.get_mut(&id) {
                        t.hangs = hangs;
                        t.stop = true;
                    }
                }
                Effect::Start { id, shard } => {
                    self.say(format!("{me} takes shard {shard}"));
                    self.next_task += 1;
                    let until = now + 50 + self.rng.below(250);
                    self.members[m].tasks.insert(
                        id,
                        Task {
                            id: self.next_task,
                            shard,
                            state: State::Starting { until },
                            stop: false,
                            hangs: false,
                            life: RunLoop::relay(ms(TTL)),
                        },
                    );
                }
            }
        }
    }

    /// Everything due at `now`: members' ticks, then their shard relays.
    fn step(&mut self) {
        for m in 0..self.members.len() {
            if self.members[m].life != Life::Alive {
                continue;
            }
            if self.now >= self.members[m].next_tick {
                self.tick(m);
            }
            // Taken out while they step: `task_has_session` then does not see them, which
            // only matters for a lease of this member's, and that one is free to it anyway.
            let mut tasks = std::mem::take(&mut self.members[m].tasks);
            for t in tasks.values_mut() {
                self.step_task(m, t);
            }
            self.members[m].tasks = tasks;
        }
    }

    /// The counters, at `now`.
    fn judge(&mut self) {
        let now = self.now;
        let anyone = self.members.iter().any(|m| m.life == Life::Alive);
        for s in 0..self.count {
            let i = usize::from(s);
            if self.server(s).is_some() {
                if let Some(at) = self.killed_at[i].take() {
                    self.c.fleet_takeover.record(now - at);
                }
                self.counted[i] = false;
                continue;
            }
            if anyone && now > self.excused_until[i] && !self.counted[i] {
                self.counted[i] = true;
                self.c.fleet_unserved += 1;
                self.say(format!("UNSERVED shard {s} past its bound"));
            }
        }
        let due: Vec<usize> = self
            .share_checks
            .iter()
            .filter(|(_, at)| *at <= now)
            .map(|(m, _)| *m)
            .collect();
        self.share_checks.retain(|(_, at)| *at > now);
        for m in due {
            let live = self
                .members
                .iter()
                .filter(|x| x.life == Life::Alive)
                .count();
            let share = usize::from(self.count) / live.max(1);
            let held = self.served_by(m).len();
            if held < share {
                self.c.fleet_share_not_returned += 1;
                let name = self.members[m].name.clone();
                self.say(format!(
                    "SHARE NOT RETURNED: {name} streams {held} shards, its share is {share}"
                ));
            }
        }
    }
}
