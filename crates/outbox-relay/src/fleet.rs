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
pub const TICK: Duration = Duration::from_millis(500);

/// How long a shard relay told to stop may take to drain, confirm and release its lease
/// before the member aborts it (its lease then goes as a dead holder's does). The member's
/// loop never waits for it: a stop that hangs must not stop the member's heartbeat, or the
/// others would take the member for dead.
pub const STOP_GRACE: Duration = Duration::from_secs(15);

/// How long a shard relay may wait for a lease that a live member holds before it is given
/// up ([`Step::GiveUp`]): past the TTL, by which a paused holder's lease has expired.
pub fn give_up(lease_ttl: Duration) -> Duration {
    lease_ttl + Duration::from_secs(2)
}

/// What one member knows at one tick.
#[derive(Debug, Clone)]
pub struct View<'a> {
    /// Shards in the layout.
    pub count: u16,
    /// This member's relay id (the owner of its leases).
    pub me: &'a str,
    /// The live members, this one included.
    pub members: &'a [String],
    /// Each shard's live lease holder.
    pub holders: &'a BTreeMap<u16, String>,
    /// The shard relays this member runs, with how long ago each was started.
    pub running: &'a BTreeMap<u16, Duration>,
    /// How long a shard relay may wait for a lease another member holds before it stops.
    pub give_up: Duration,
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
    let floor = usize::from(v.count) / v.members.len().max(1);
    let target = if plant.planted(Mutant::FleetShareRoundsDown) {
        floor
    } else {
        fair_share(v.count, v.members.len())
    };
    let mine = |i: &u16| v.holders.get(i).is_some_and(|h| h == v.me);
    // No lease, or one whose holder is no live member.
    let unheld = |i: &u16| v.holders.get(i).map_or(true, |h| !v.members.contains(h));
    // A relay of this member waiting for a lease that another live member holds.
    let blocked = |i: &u16| {
        v.holders
            .get(i)
            .is_some_and(|h| h != v.me && v.members.contains(h))
    };
    let gives_up = |i: &u16, age: &Duration| !mine(i) && *age > v.give_up;
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
        if m == v.me {
            held
        } else {
            v.holders.values().filter(|h| *h == m).count()
        }
    };
    let lacking: usize = v
        .members
        .iter()
        .filter(|m| *m != v.me)
        .map(|m| floor.saturating_sub(held_by(m)))
        .sum();
    let free = (0..v.count).filter(unheld).count();
    let first_at_target = v
        .members
        .iter()
        .filter(|m| held_by(m) >= target)
        .min()
        .is_some_and(|m| m == v.me);
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
        let free = (0..v.count)
            .filter(|i| !v.running.contains_key(i))
            .filter(|i| {
                if waits_for_expiry {
                    !v.holders.contains_key(i)
                } else {
                    unheld(i)
                }
            })
            .take(room);
        steps.extend(free.map(Step::Take));
    }
    steps
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
            count: 8,
            me,
            members: m,
            holders: h,
            running: r,
            give_up: Duration::from_secs(5),
        }
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
        let steps = plan(&View {
            count: 4,
            ..view("a", &m, &h, &r)
        });
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
