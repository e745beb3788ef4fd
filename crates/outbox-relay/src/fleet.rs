//! A fleet member's decisions (`outboxd run --fleet`): which shards to try to take, which to
//! hand over, which waits to give up, and its timing ([`TICK`], [`STOP_GRACE`],
//! [`give_up`]). Pure: the member's loop (`crates/outboxd/src/relay/fleet.rs`) reads the
//! members and the leases, asks [`plan`], and starts or stops shard relays accordingly; the
//! simulator (`outbox-sim`, `fleet.rs`) runs the same plan for members that join, die and
//! pause, with the fleet mutants planted through [`plan_planted`]. None of this decides who
//! sends — the shards' leases do — so a wrong view here can cost balance or time, never an
//! event or its order.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::pipeline::{Mutant, Plant, Shipped};

/// How often a member writes its row, reads the members and leases, and asks [`plan`].
pub const TICK: Duration = Duration::from_millis(250);

/// How long a shard relay told to stop may take to drain, confirm and release its lease
/// before the member aborts it and gives its lease back ([`Effect::Abort`]), by default
/// (`relay.fleet_stop_grace_ms`; [`Seen::stop_grace`]). The member's loop never waits for it:
/// a stop that hangs must not stop the member's heartbeat, or the others would take the
/// member for dead. Longer than a stop's own drain (`lifecycle::STOP_DRAIN_MAX`), so a stop
/// that drains slowly ends by itself.
pub const STOP_GRACE: Duration = Duration::from_secs(15);

/// How long a shard relay may wait for a lease that a live member holds before it is given
/// up ([`Step::GiveUp`]): past the TTL, by which a paused holder's lease has expired.
pub fn give_up(lease_ttl: Duration) -> Duration {
    lease_ttl + Duration::from_secs(2)
}

/// What one member knows at one tick: what it read ([`Seen`]) and its own relays.
#[derive(Debug, Clone)]
pub struct View<'a> {
    pub seen: Seen<'a>,
    /// The shard relays this member runs, with how long ago each was started.
    pub running: &'a BTreeMap<u16, Duration>,
}

/// One thing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Start the relay of this shard (it takes the lease when it is free, at once if its
    /// holder is gone).
    Take(u16),
    /// Stop this shard's relay gracefully (drain, confirm, release the lease) for another
    /// member to take: this member holds more than its share.
    HandOver(u16),
    /// Stop this shard's relay: it has waited too long for a lease a live member holds.
    GiveUp(u16),
}

/// A member's fair share: the shard count over the live members, rounded up.
pub fn fair_share(count: u16, members: usize) -> usize {
    usize::from(count).div_ceil(members.max(1))
}

/// What to do now. Hands over at most one shard per tick (the others rebalance meanwhile),
/// and takes free shards — no lease, or a holder that is no live member — up to the share.
pub fn plan(v: &View) -> Vec<Step> {
    plan_planted(v, &Shipped)
}

/// [`plan`], with what `plant` plants (the simulator's fleet mutants; the daemon plants
/// nothing).
pub fn plan_planted<P: Plant>(v: &View, plant: &P) -> Vec<Step> {
    // The floor: the count over the members, rounded down.
    let floor = usize::from(v.seen.count) / v.seen.members.len().max(1);
    let target = if plant.planted(Mutant::FleetShareRoundsDown) {
        floor
    } else {
        fair_share(v.seen.count, v.seen.members.len())
    };
    let mine = |i: &u16| v.seen.holders.get(i).is_some_and(|h| h == v.seen.me);
    // No lease, or one whose holder is no live member.
    let unheld = |i: &u16| {
        v.seen
            .holders
            .get(i)
            .map_or(true, |h| !v.seen.members.contains(h))
    };
    // A relay of this member waiting for a lease that another live member holds.
    let blocked = |i: &u16| {
        v.seen
            .holders
            .get(i)
            .is_some_and(|h| h != v.seen.me && v.seen.members.contains(h))
    };
    let gives_up = |i: &u16, age: &Duration| !mine(i) && *age > v.seen.give_up;
    let mut steps: Vec<Step> = v
        .running
        .iter()
        .filter(|(i, age)| gives_up(i, age))
        .map(|(i, _)| Step::GiveUp(*i))
        .collect();
    // What this member holds *and runs*: a shard it is already stopping still holds its
    // lease until it is released (or, if the stop hangs, until the member aborts it); counting
    // it made a member over its share hand over shard after shard, down to none, and take
    // and hand over again (seen in the simulator's fleet: 11 % more hand-overs in 20,000
    // traces, up to every shard of a member whose stops hung).
    let held = v.running.keys().filter(|i| mine(i)).count();
    // Members under the floor (the count over the members, rounded down): one that joined or
    // resumed while every other held the rounded-up share (8 shards over 5 members: 2, 2, 2,
    // 2 and 0) got nothing. When the free shards are fewer than the others lack, the first
    // member by id of those at the rounded-up share hands one over, and members at the floor
    // leave the free shards to the needy (found by the simulator's fleet,
    // `fleet_share_not_returned`).
    let held_by = |m: &String| {
        if m == v.seen.me {
            held
        } else {
            v.seen.holders.values().filter(|h| *h == m).count()
        }
    };
    let lacking: usize = v
        .seen
        .members
        .iter()
        .filter(|m| *m != v.seen.me)
        .map(|m| floor.saturating_sub(held_by(m)))
        .sum();
    let free = (0..v.seen.count).filter(unheld).count();
    let first_at_target = v
        .seen
        .members
        .iter()
        .filter(|m| held_by(m) >= target)
        .min()
        .is_some_and(|m| m == v.seen.me);
    let evening = !plant.planted(Mutant::FleetNoEvening);
    let evens_out =
        evening && lacking > free && target > floor && held >= target && first_at_target;
    if held > target || evens_out {
        if let Some(i) = v.running.keys().rev().find(|i| mine(i)) {
            if !plant.planted(Mutant::FleetNeverHandsOver) {
                steps.push(Step::HandOver(*i));
            }
        }
        return steps;
    }
    // The share this member's relays already fill: a relay waiting for a live member's lease
    // fills none until it gets the lease, so free shards are taken meanwhile (counting it left
    // a shard handed over at start-up unserved until the waiting relays were given up, 4.5 s
    // in the simulator's fleet; then the member may hold one more than its share for a while,
    // and hands it over).
    let waiting_fills = plant.planted(Mutant::FleetWaitingFillsShare);
    let running = v
        .running
        .iter()
        .filter(|(i, age)| !gives_up(i, age) && (waiting_fills || !blocked(i)))
        .count();
    let mut room = target.saturating_sub(running);
    if evening && held >= floor {
        room = room.min(free.saturating_sub(lacking));
    }
    if room > 0 {
        let waits_for_expiry = plant.planted(Mutant::FleetWaitsForExpiry);
        let free: Vec<u16> = (0..v.seen.count)
            .filter(|i| !v.running.contains_key(i))
            .filter(|i| {
                if waits_for_expiry {
                    !v.seen.holders.contains_key(i)
                } else {
                    unheld(i)
                }
            })
            .collect();
        // Each member takes free shards from its own place among them (its rank among the
        // live members, spread over the free shards): members that look at once — after a
        // member dies, every other one — go for different shards rather than all for the
        // lowest free ones, losing the race for some at every tick (the simulator's fleets:
        // a SIGKILLed member's last shard streamed again after 2.05 s in one of 250,000
        // fleet traces).
        let rank = v
            .seen
            .members
            .iter()
            .filter(|m| m.as_str() < v.seen.me)
            .count();
        let start = rank * free.len() / v.seen.members.len().max(1);
        let free = free
            .iter()
            .cycle()
            .skip(start)
            .take(free.len().min(room))
            .copied();
        steps.extend(free.map(Step::Take));
    }
    steps
}

/// What a member's loop does with its shard relays at one tick ([`Member::tick`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Start relay `id` of `shard` (it takes the lease when it is free, at once if its holder
    /// is gone).
    Start { id: u64, shard: u16 },
    /// Tell relay `id` to stop gracefully (drain, confirm, release its lease); `handover`:
    /// another member is to take the shard ([`Step::HandOver`]), else it waited too long
    /// ([`Step::GiveUp`]).
    Stop { id: u64, shard: u16, handover: bool },
    /// Relay `id` was told to stop [`Seen::stop_grace`] ago and has not ended: abort it, and when
    /// `release`, give back its lease of `shard`. The lease names this member, which is
    /// live, so no other member would take the shard before the lease expired (a lease TTL
    /// more unserved); the lease's generation fences whatever the aborted relay still had
    /// in flight, as it fences a paused holder's.
    Abort { id: u64, shard: u16, release: bool },
}

/// A fleet member's shard relays, as its loop knows them: which run since when, which were
/// told to stop and when they are aborted. Pure, with no clock of its own (`now` is the
/// caller's, any monotonic origin): the daemon's member loop (`outboxd/src/relay/fleet.rs`)
/// and the simulator's members run it, execute its [`Effect`]s, and report each relay that
/// ended ([`Member::ended`]). The loop never waits for a relay: a stop that hangs must not stop
/// the member's heartbeat.
#[derive(Debug, Default)]
pub struct Member {
    next_id: u64,
    /// Relay id -> (shard, started at).
    running: BTreeMap<u64, (u16, Duration)>,
    /// Relay id -> (shard, aborted at).
    stopping: BTreeMap<u64, (u16, Duration)>,
}

/// What a member reads at one tick (the members, the leases) and its settings.
#[derive(Debug, Clone)]
pub struct Seen<'a> {
    /// Shards in the layout.
    pub count: u16,
    /// This member's relay id (the owner of its leases).
    pub me: &'a str,
    /// The live members, this one included.
    pub members: &'a [String],
    /// Each shard's live lease holder.
    pub holders: &'a BTreeMap<u16, String>,
    /// How long a shard relay may wait for a lease another member holds before it stops.
    pub give_up: Duration,
    /// How long a relay told to stop may take before it is aborted ([`STOP_GRACE`] by default).
    pub stop_grace: Duration,
}

impl Member {
    /// Relay `id` ended (an error it does not retry, its stop, or its abort): forgotten.
    pub fn ended(&mut self, id: u64) {
        self.running.remove(&id);
        self.stopping.remove(&id);
    }

    /// The shard relays running and not told to stop: (id, shard).
    #[cfg(test)]
    fn running(&self) -> impl Iterator<Item = (u64, u16)> + '_ {
        self.running.iter().map(|(id, (shard, _))| (*id, *shard))
    }

    /// The relays told to stop that have not ended: (id, shard).
    #[cfg(test)]
    fn stopping(&self) -> impl Iterator<Item = (u64, u16)> + '_ {
        self.stopping.iter().map(|(id, (shard, _))| (*id, *shard))
    }

    /// One tick at `now`: the stops past their grace ([`Seen::stop_grace`]) are aborted, then
    /// [`plan`]'s steps.
    pub fn tick(&mut self, now: Duration, seen: &Seen) -> Vec<Effect> {
        self.tick_planted(now, seen, &Shipped)
    }

    /// [`Member::tick`], with what `plant` plants.
    pub fn tick_planted<P: Plant>(&mut self, now: Duration, seen: &Seen, plant: &P) -> Vec<Effect> {
        let release = !plant.planted(Mutant::FleetAbortKeepsLease);
        let due: Vec<(u64, u16)> = self
            .stopping
            .iter()
            .filter(|(_, (_, at))| now >= *at)
            .map(|(id, (shard, _))| (*id, *shard))
            .collect();
        let mut effects: Vec<Effect> = due
            .into_iter()
            .map(|(id, shard)| {
                self.stopping.remove(&id);
                Effect::Abort { id, shard, release }
            })
            .collect();
        let running: BTreeMap<u16, Duration> = self
            .running
            .values()
            .map(|(shard, at)| (*shard, now.saturating_sub(*at)))
            .collect();
        let view = View {
            seen: seen.clone(),
            running: &running,
        };
        for step in plan_planted(&view, plant) {
            match step {
                Step::Take(shard) => {
                    self.next_id += 1;
                    let id = self.next_id;
                    self.running.insert(id, (shard, now));
                    effects.push(Effect::Start { id, shard });
                }
                Step::HandOver(shard) | Step::GiveUp(shard) => {
                    let Some(id) = self
                        .running
                        .iter()
                        .find(|(_, (s, _))| *s == shard)
                        .map(|(id, _)| *id)
                    else {
                        continue;
                    };
                    self.running.remove(&id);
                    self.stopping.insert(id, (shard, now + seen.stop_grace));
                    effects.push(Effect::Stop {
                        id,
                        shard,
                        handover: matches!(step, Step::HandOver(_)),
                    });
                }
            }
        }
        effects
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn holders(pairs: &[(u16, &str)]) -> BTreeMap<u16, String> {
        pairs.iter().map(|(i, h)| (*i, h.to_string())).collect()
    }

    fn running(pairs: &[(u16, u64)]) -> BTreeMap<u16, Duration> {
        pairs
            .iter()
            .map(|(i, s)| (*i, Duration::from_secs(*s)))
            .collect()
    }

    fn view<'a>(
        me: &'a str,
        m: &'a [String],
        h: &'a BTreeMap<u16, String>,
        r: &'a BTreeMap<u16, Duration>,
    ) -> View<'a> {
        View {
            seen: Seen {
                count: 8,
                me,
                members: m,
                holders: h,
                give_up: Duration::from_secs(5),
                stop_grace: STOP_GRACE,
            },
            running: r,
        }
    }

    /// After a member died, the two left each hold 2 of 8 shards and see the same 4 free: each
    /// takes from its own place among them, not both the lowest two.
    #[test]
    fn members_looking_at_once_take_different_free_shards() {
        let m = members(&["a", "b"]);
        let h = holders(&[(0, "a"), (1, "a"), (2, "b"), (3, "b")]);
        let (ra, rb) = (running(&[(0, 9), (1, 9)]), running(&[(2, 9), (3, 9)]));
        assert_eq!(
            plan(&view("a", &m, &h, &ra)),
            vec![Step::Take(4), Step::Take(5)]
        );
        assert_eq!(
            plan(&view("b", &m, &h, &rb)),
            vec![Step::Take(6), Step::Take(7)]
        );
    }

    #[test]
    fn a_lone_member_takes_every_free_shard() {
        let (m, h, r) = (members(&["a"]), holders(&[]), running(&[]));
        assert_eq!(
            plan(&view("a", &m, &h, &r)),
            (0..8).map(Step::Take).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_member_takes_only_up_to_its_share_and_never_a_live_members_shard() {
        let m = members(&["a", "b", "c"]);
        let h = holders(&[(0, "b"), (1, "b"), (2, "b"), (3, "c")]);
        let r = running(&[]);
        // Share 3: shards 4, 5, 6 are free; 0-3 belong to live members.
        assert_eq!(
            plan(&view("a", &m, &h, &r)),
            vec![Step::Take(4), Step::Take(5), Step::Take(6)]
        );
    }

    #[test]
    fn a_dead_or_paused_members_shards_are_free() {
        // c is no longer a live member (its row is stale): its shards are free to take.
        let m = members(&["a", "b"]);
        let h = holders(&[
            (0, "a"),
            (1, "a"),
            (2, "a"),
            (3, "b"),
            (4, "b"),
            (5, "b"),
            (6, "c"),
            (7, "c"),
        ]);
        let r = running(&[(0, 60), (1, 60), (2, 60)]);
        assert_eq!(plan(&view("a", &m, &h, &r)), vec![Step::Take(6)]);
    }

    #[test]
    fn a_member_over_its_share_hands_one_shard_over() {
        // A third member joined: the share drops to 3, a holds 4.
        let m = members(&["a", "b", "c"]);
        let h = holders(&[
            (0, "a"),
            (1, "a"),
            (2, "a"),
            (3, "a"),
            (4, "b"),
            (5, "b"),
            (6, "b"),
            (7, "b"),
        ]);
        let r = running(&[(0, 60), (1, 60), (2, 60), (3, 60)]);
        assert_eq!(plan(&view("a", &m, &h, &r)), vec![Step::HandOver(3)]);
        // The newcomer takes nothing until a lease is free.
        let none = running(&[]);
        assert_eq!(plan(&view("c", &m, &h, &none)), vec![]);
    }

    #[test]
    fn relays_waiting_for_live_members_leases_do_not_keep_a_member_from_free_shards() {
        // a's relays of 0 and 1 lost the race at start-up to b; shard 2 is free.
        let m = members(&["a", "b", "c", "d"]);
        let h = holders(&[(0, "b"), (1, "b"), (3, "c")]);
        let r = running(&[(0, 1), (1, 1)]);
        let mut v = view("a", &m, &h, &r);
        v.seen.count = 4;
        let steps = plan(&v);
        assert_eq!(steps, vec![Step::Take(2)]);
    }

    #[test]
    fn a_shard_being_stopped_does_not_count_as_held() {
        // a stops shard 3 (its lease is not released yet): a runs 0-2, its share; nothing
        // more is handed over.
        let m = members(&["a", "b", "c"]);
        let h = holders(&[(0, "a"), (1, "a"), (2, "a"), (3, "a")]);
        let r = running(&[(0, 60), (1, 60), (2, 60)]);
        assert_eq!(plan(&view("a", &m, &h, &r)), vec![]);
    }

    #[test]
    fn a_member_under_the_floor_gets_a_shard_from_the_first_member_at_the_share() {
        // 8 shards over 5 members: share 2, floor 1; e joined with nothing.
        let m = members(&["a", "b", "c", "d", "e"]);
        let h = holders(&[
            (0, "a"),
            (1, "a"),
            (2, "b"),
            (3, "b"),
            (4, "c"),
            (5, "c"),
            (6, "d"),
            (7, "d"),
        ]);
        let a_runs = running(&[(0, 60), (1, 60)]);
        let b_runs = running(&[(2, 60), (3, 60)]);
        let none = running(&[]);
        assert_eq!(plan(&view("a", &m, &h, &a_runs)), vec![Step::HandOver(1)]);
        assert_eq!(plan(&view("b", &m, &h, &b_runs)), vec![], "only the first");
        // Shard 1 released: a (at the floor) does not take it back; e does.
        let h1: BTreeMap<u16, String> = h.clone().into_iter().filter(|(i, _)| *i != 1).collect();
        let a_runs = running(&[(0, 60)]);
        assert_eq!(plan(&view("a", &m, &h1, &a_runs)), vec![]);
        assert_eq!(plan(&view("e", &m, &h1, &none)), vec![Step::Take(1)]);
        // Settled (2, 2, 2, 1, 1): nobody is under the floor, nothing moves.
        let mut h2 = h.clone();
        h2.insert(1, "e".into());
        let b_runs = running(&[(2, 60), (3, 60)]);
        assert_eq!(plan(&view("b", &m, &h2, &b_runs)), vec![]);
    }

    #[test]
    fn a_wait_for_a_live_members_shard_is_given_up() {
        let m = members(&["a", "b"]);
        let h = holders(&[(5, "b")]);
        let r = running(&[(5, 60), (6, 1)]);
        let steps = plan(&view("a", &m, &h, &r));
        assert!(steps.contains(&Step::GiveUp(5)), "{steps:?}");
        assert!(!steps.contains(&Step::GiveUp(6)), "{steps:?}");
    }

    #[test]
    fn shares_cover_every_shard_and_differ_by_at_most_one_when_settled() {
        for count in [1u16, 2, 4, 8, 16] {
            for n in 1..=5usize {
                let share = fair_share(count, n);
                assert!(
                    share * n >= usize::from(count),
                    "{count} shards, {n} members"
                );
                assert!((share - 1) * n < usize::from(count) || share == 1);
            }
        }
    }
}

#[cfg(test)]
mod member_tests {
    use super::*;

    fn at(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// A member alone over 2 shards takes both; when a second member joins, it hands one over
    /// and, if that stop hangs, aborts it after [`STOP_GRACE`] and gives its lease back; a
    /// stop that ends in time is never aborted.
    #[test]
    fn a_member_starts_stops_and_aborts_a_stop_that_hangs_giving_its_lease_back() {
        let mut m = Member::default();
        let (alone, two) = (
            vec!["a".to_string()],
            vec!["a".to_string(), "b".to_string()],
        );
        let none = BTreeMap::new();
        let seen = |members, holders| Seen {
            count: 2,
            me: "a",
            members,
            holders,
            give_up: Duration::from_secs(12),
            stop_grace: STOP_GRACE,
        };
        let started = m.tick(at(0), &seen(&alone, &none));
        assert_eq!(
            started,
            [
                Effect::Start { id: 1, shard: 0 },
                Effect::Start { id: 2, shard: 1 }
            ]
        );
        let mine: BTreeMap<u16, String> = [(0, "a".into()), (1, "a".into())].into();
        assert!(m.tick(at(500), &seen(&alone, &mine)).is_empty());
        let stop = m.tick(at(1_000), &seen(&two, &mine));
        assert_eq!(
            stop,
            [Effect::Stop {
                id: 2,
                shard: 1,
                handover: true
            }]
        );
        assert_eq!(m.stopping().collect::<Vec<_>>(), [(2, 1)]);
        // Its lease is still held by this member while it drains: nothing more to do.
        assert!(m.tick(at(1_500), &seen(&two, &mine)).is_empty());
        let grace = u64::try_from(STOP_GRACE.as_millis()).unwrap();
        assert!(m.tick(at(1_000 + grace - 1), &seen(&two, &mine)).is_empty());
        assert_eq!(
            m.tick(at(1_000 + grace), &seen(&two, &mine)),
            [Effect::Abort {
                id: 2,
                shard: 1,
                release: true
            }]
        );
        assert_eq!(m.stopping().count(), 0);
        assert_eq!(m.running().collect::<Vec<_>>(), [(1, 0)]);

        // A stop that ends in time is forgotten, never aborted.
        let mut m = Member::default();
        m.tick(at(0), &seen(&alone, &none));
        m.tick(at(1_000), &seen(&two, &mine));
        m.ended(2);
        assert!(m.tick(at(1_000 + grace), &seen(&two, &mine)).is_empty());
    }

    #[test]
    fn with_the_mutant_planted_an_aborted_relay_keeps_its_lease() {
        #[derive(Debug)]
        struct Keeps;
        impl Plant for Keeps {
            fn planted(&self, m: Mutant) -> bool {
                m == Mutant::FleetAbortKeepsLease
            }
            fn current_route(&self) -> Option<crate::pipeline::CurrentRoute> {
                None
            }
        }
        let mut m = Member::default();
        let two = vec!["a".to_string(), "b".to_string()];
        let mine: BTreeMap<u16, String> = [(0, "a".into()), (1, "a".into())].into();
        let seen = Seen {
            count: 2,
            me: "a",
            members: &two,
            holders: &mine,
            give_up: Duration::from_secs(12),
            stop_grace: STOP_GRACE,
        };
        m.running.insert(7, (1, at(0)));
        m.running.insert(8, (0, at(0)));
        m.tick_planted(at(0), &seen, &Keeps);
        let aborted = m.tick_planted(at(0) + STOP_GRACE, &seen, &Keeps);
        assert!(
            matches!(aborted[..], [Effect::Abort { release: false, .. }]),
            "{aborted:?}"
        );
    }
}
