//! A fleet member's decisions (`outboxd run --fleet`): which shards to try to take, which to
//! hand over, which waits to give up. Pure: the member's loop (`crates/outboxd/src/relay/
//! fleet.rs`) reads the members and the leases, asks [`plan`], and starts or stops shard
//! relays accordingly. None of this decides who sends — the shards' leases do — so a wrong
//! view here can cost balance or time, never an event or its order.

use std::collections::BTreeMap;
use std::time::Duration;

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
    let target = fair_share(v.count, v.members.len());
    let mine = |i: &u16| v.holders.get(i).is_some_and(|h| h == v.me);
    let mut steps: Vec<Step> = v
        .running
        .iter()
        .filter(|(i, age)| !mine(i) && **age > v.give_up)
        .map(|(i, _)| Step::GiveUp(*i))
        .collect();
    let held = v.holders.values().filter(|h| *h == v.me).count();
    if held > target {
        if let Some(i) = v.running.keys().rev().find(|i| mine(i)) {
            steps.push(Step::HandOver(*i));
        }
        return steps;
    }
    let running = v.running.len() - steps.len();
    if running < target {
        let free = (0..v.count)
            .filter(|i| !v.running.contains_key(i))
            .filter(|i| v.holders.get(i).map_or(true, |h| !v.members.contains(h)))
            .take(target - running);
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
