//! What one node's agent holds, and which step a new round restores, pure.
//!
//! A part is known by [`Key`]: the round it was saved in (its *tag*), its step and its rank. Two
//! saves of step 10 in two rounds (a step computed again after a restore) are two snapshots,
//! never mixed. [`Holdings`] decides what a node keeps under its memory cap: the **base** (the
//! newest committed step, or the one this round restored) and the steps in progress after it;
//! everything else may go. [`plan`] picks, from every member's inventory, the snapshot a round
//! restores: the newest step whose every rank's part is held, whole, by some member, and for
//! each rank the member to read it from. Every member computes it from the same inventories, so
//! every rank gets the same step.

use std::collections::{BTreeMap, BTreeSet};

use super::error::SnapError;
use super::NodeId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct Key {
    pub tag: u64,
    pub step: u64,
    pub rank: u32,
}

/// One entry of a node's inventory: a whole part it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Have {
    #[serde(flatten)]
    pub key: Key,
    /// The world size the step was saved in.
    pub world: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub world: u32,
    pub len: u64,
    /// Written and committed (a reserved part is being written and is no part yet).
    pub whole: bool,
}

/// A granted reservation: parts to free first, and one whose buffer may be reused (its pages
/// are already there: a save into it costs a copy, not a fault per page).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Grant {
    pub free: Vec<Key>,
    pub reuse: Option<Key>,
}

/// Most steps of one rank in progress at once (saved, not yet committed). Ranks save in
/// lockstep and a step commits once its copies are acknowledged, so an honest rank has one or
/// two; a rank (or the node whose copies these are) running far ahead, or announcing steps it
/// never took, is refused beyond this instead of filling the cap.
pub const MAX_OPEN_PER_RANK: usize = 8;
/// What a part counts against the cap at least: a buffer (and its descriptor) costs a page
/// however few bytes it holds.
pub const MIN_CHARGE: u64 = 4096;

fn charge(len: u64) -> u64 {
    len.max(MIN_CHARGE)
}

#[derive(Debug, Clone, Default)]
pub struct Holdings {
    pub cap: u64,
    /// Bytes of buffers no longer held but still read (a copy being sent): they count against
    /// the cap until they are let go.
    pub outside: u64,
    parts: BTreeMap<Key, Part>,
    /// The snapshot kept whatever else happens: (tag, step).
    base: Option<(u64, u64)>,
    /// The round saving now: its steps after the base are in progress.
    tag: u64,
}

impl Holdings {
    pub fn new(cap: u64) -> Holdings {
        Holdings { cap, ..Holdings::default() }
    }

    /// What the held parts count against the cap (each at least [`MIN_CHARGE`]).
    pub fn used(&self) -> u64 {
        self.parts.values().map(|p| charge(p.len)).sum()
    }

    pub fn get(&self, key: &Key) -> Option<&Part> {
        self.parts.get(key)
    }

    /// The whole parts held, for a round's plan.
    pub fn inventory(&self) -> Vec<Have> {
        self.parts.iter().filter(|(_, p)| p.whole).map(|(k, p)| Have { key: *k, world: p.world }).collect()
    }

    /// A new round saves under `tag`, restoring `base` (or nothing). Returns what may go now:
    /// parts of steps after the base, which the round computes again, and everything that is
    /// neither the base nor the round's.
    pub fn begin_round(&mut self, tag: u64, base: Option<(u64, u64)>) -> Vec<Key> {
        self.tag = tag;
        self.base = base;
        let free = self.droppable();
        for k in &free {
            self.parts.remove(k);
        }
        free
    }

    /// Whether a part may go: not the base's, not a step in progress in this round, and never a
    /// reservation being written (its writer holds the buffer).
    fn may_go(&self, k: &Key) -> bool {
        if self.base.is_some_and(|(t, s)| k.tag == t && k.step == s) {
            return false;
        }
        if self.parts.get(k).is_some_and(|p| !p.whole) {
            return false;
        }
        !(k.tag == self.tag && self.base.is_none_or(|(_, s)| k.step > s))
    }

    fn droppable(&self) -> Vec<Key> {
        self.parts.keys().filter(|k| self.may_go(k)).copied().collect()
    }

    /// Room for `key`'s part of `len` bytes. Frees what may go of the same rank, of earlier
    /// rounds and of ranks not in `local` (copies for another node: no worker here maps them;
    /// another local rank's old buffers stay, its worker may still map them), and refuses,
    /// changing nothing, when the cap is still too small, or when the part is already held or
    /// being written (a step is saved once; a rewrite in place could lose the held one).
    ///
    /// `read`: parts someone reads now (a copy being sent, a part served): freed, their bytes
    /// stay until the reader lets go, so they still count. `no_reuse`: parts whose buffer must
    /// never be written again (read, lent to a worker, sealed).
    pub fn reserve(
        &mut self,
        key: Key,
        world: u32,
        len: u64,
        local: &std::ops::Range<u32>,
        read: &BTreeSet<Key>,
        no_reuse: &BTreeSet<Key>,
    ) -> Result<Grant, SnapError> {
        let (rank, step) = (key.rank, key.step);
        if let Some(p) = self.parts.get(&key) {
            return Err(if p.whole {
                SnapError::AlreadyHeld { rank, step }
            } else {
                SnapError::BeingSaved { rank, step }
            });
        }
        let open = self
            .parts
            .keys()
            .filter(|k| k.rank == key.rank && k.tag == self.tag && self.base.is_none_or(|(_, s)| k.step > s))
            .count();
        if key.tag == self.tag && open >= MAX_OPEN_PER_RANK {
            return Err(SnapError::TooManyOpen { rank, open, most: MAX_OPEN_PER_RANK });
        }
        let free: Vec<Key> = self
            .droppable()
            .into_iter()
            .filter(|k| k.rank == key.rank || k.tag != self.tag || !local.contains(&k.rank))
            .collect();
        let kept: u64 = self
            .parts
            .iter()
            .filter(|(k, _)| !free.contains(k) || read.contains(k))
            .map(|(_, p)| charge(p.len))
            .sum::<u64>()
            + self.outside;
        if kept.saturating_add(charge(len)) > self.cap {
            return Err(SnapError::NoRoom { rank, step, len, cap: self.cap, kept });
        }
        // Reuse the buffer of a part of the same rank (its worker maps it), else any.
        let reusable = || free.iter().filter(|k| !no_reuse.contains(k));
        let reuse = reusable().find(|k| k.rank == key.rank).or(reusable().next()).copied();
        for k in &free {
            self.parts.remove(k);
        }
        self.parts.insert(key, Part { world, len, whole: false });
        Ok(Grant { free: free.into_iter().filter(|k| Some(*k) != reuse).collect(), reuse })
    }

    /// The reserved part is written.
    pub fn commit(&mut self, key: &Key) -> bool {
        match self.parts.get_mut(key) {
            Some(p) => {
                p.whole = true;
                true
            }
            None => false,
        }
    }

    /// A reservation abandoned (its writer gone): nothing of it is held.
    pub fn abandon(&mut self, key: &Key) {
        if self.parts.get(key).is_some_and(|p| !p.whole) {
            self.parts.remove(key);
        }
    }

    /// `step` of this round is committed everywhere: it is the base now. What it makes obsolete
    /// is not freed here but by the next reservation, which reuses its buffer (its pages are
    /// there: a save into it is one copy, no page faults), so a node holds at most the base and
    /// the steps in progress, plus, between a commit and the next save, the step before.
    pub fn committed(&mut self, tag: u64, step: u64) -> bool {
        if tag != self.tag || self.base.is_some_and(|(t, s)| t == tag && s >= step) {
            return false;
        }
        self.base = Some((tag, step));
        true
    }
}

/// The snapshot a round restores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub tag: u64,
    pub step: u64,
    pub world: u32,
    /// Each rank's part: the member to read it from.
    pub from: BTreeMap<u32, NodeId>,
}

/// The newest step whose every rank's part (same tag, same world) some member holds, preferring
/// for each rank the member that runs that rank now (`runs`), else the first holder by node id.
/// Ties between tags of the same step go to the newest round. `None`: nothing is whole.
///
/// With `copies` 2, a step whose every part is held on two members is preferred to a newer one
/// held once (a step restored from one copy, and then lost with its node, would leave nothing:
/// the older, doubly held one is freed once the round begins); only when no step is held twice
/// (after a node loss) is the newest whole one taken.
pub fn plan(inventories: &BTreeMap<NodeId, Vec<Have>>, runs: &BTreeMap<u32, NodeId>, copies: usize) -> Option<Plan> {
    // (tag, step, world) -> rank -> holders
    let mut sets: BTreeMap<(u64, u64, u32), BTreeMap<u32, BTreeSet<&NodeId>>> = BTreeMap::new();
    for (node, haves) in inventories {
        for h in haves {
            if h.key.rank < h.world {
                sets.entry((h.key.tag, h.key.step, h.world)).or_default().entry(h.key.rank).or_default().insert(node);
            }
        }
    }
    let whole = |((_, _, world), ranks): &(&(u64, u64, u32), &BTreeMap<u32, BTreeSet<&NodeId>>)| {
        ranks.len() == *world as usize && *world > 0
    };
    let held_by = |n: usize| {
        move |(_, ranks): &(&(u64, u64, u32), &BTreeMap<u32, BTreeSet<&NodeId>>)| ranks.values().all(|h| h.len() >= n)
    };
    let newest =
        |n: usize| sets.iter().filter(whole).filter(held_by(n)).max_by_key(|((tag, step, _), _)| (*step, *tag));
    newest(copies.max(1)).or_else(|| newest(1)).map(|((tag, step, world), ranks)| Plan {
        tag: *tag,
        step: *step,
        world: *world,
        from: ranks
            .iter()
            .map(|(rank, holders)| {
                let here = runs.get(rank).filter(|n| holders.contains(n));
                let node = here.or_else(|| holders.iter().next().copied()).expect("a set's ranks have holders");
                (*rank, node.clone())
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A part's size in these tests' units: a page, the least a part counts.
    const P: u64 = MIN_CHARGE;
    const NONE: BTreeSet<Key> = BTreeSet::new();

    fn key(tag: u64, step: u64, rank: u32) -> Key {
        Key { tag, step, rank }
    }

    fn have(tag: u64, step: u64, rank: u32, world: u32) -> Have {
        Have { key: key(tag, step, rank), world }
    }

    #[test]
    fn the_base_and_steps_in_progress_stay_and_the_rest_goes_under_the_cap() {
        let mut h = Holdings::new(300 * P);
        assert!(h.begin_round(1, None).is_empty());
        h.reserve(key(1, 1, 0), 1, 100 * P, &(0..2), &NONE, &NONE).unwrap();
        h.commit(&key(1, 1, 0));
        // Step 1 not committed yet: step 2 is in progress beside it.
        let g = h.reserve(key(1, 2, 0), 1, 100 * P, &(0..2), &NONE, &NONE).unwrap();
        assert_eq!(g, Grant::default());
        h.commit(&key(1, 2, 0));
        assert!(h.committed(1, 1));
        assert!(h.committed(1, 2));
        assert!(!h.committed(1, 1), "the base never goes back");
        // Step 3 reuses the buffer of step 1, which may go once 2 is committed.
        let g = h.reserve(key(1, 3, 0), 1, 100 * P, &(0..2), &NONE, &NONE).unwrap();
        assert_eq!(g, Grant { free: vec![], reuse: Some(key(1, 1, 0)) });
        assert_eq!(h.used(), 200 * P);
        // A fourth part that does not fit is refused and changes nothing.
        h.reserve(key(1, 4, 0), 1, 100 * P, &(0..2), &NONE, &NONE).unwrap();
        let e = h.reserve(key(1, 5, 0), 1, 100 * P, &(0..2), &NONE, &NONE).unwrap_err();
        assert!(e.to_string().contains("--snapshot-memory"), "{e}");
        assert_eq!(h.used(), 300 * P);
        assert!(h.get(&key(1, 2, 0)).is_some_and(|p| p.whole), "the last committed step stays");
    }

    #[test]
    fn a_rank_far_ahead_of_its_commits_is_refused_past_a_few_steps_and_tiny_parts_cost_a_page() {
        // Issue 34 (Medium): the node whose copies these are put parts of steps far ahead, and
        // parts of no bytes, each a buffer and a descriptor, until the cap was full and the
        // node's own saves were refused.
        let mut h = Holdings::new(1 << 30);
        h.begin_round(1, None);
        let remote = 0..0; // no local rank: copies for another node
        for step in 1..=MAX_OPEN_PER_RANK as u64 {
            h.reserve(key(1, 1_000_000 + step, 5), 8, 0, &remote, &NONE, &NONE).unwrap();
            h.commit(&key(1, 1_000_000 + step, 5));
        }
        let e = h.reserve(key(1, 2_000_000, 5), 8, 0, &remote, &NONE, &NONE).unwrap_err();
        assert!(
            matches!(e, SnapError::TooManyOpen { .. })
                && e.to_string().starts_with(super::super::error::NOT_SNAPSHOTTED),
            "{e}"
        );
        assert_eq!(h.used(), MAX_OPEN_PER_RANK as u64 * MIN_CHARGE, "each empty part costs a page");
        // Another rank (this node's own) still saves.
        h.reserve(key(1, 1, 0), 8, 100, &(0..1), &NONE, &NONE).unwrap();
        // Once a step commits, the steps before it are no longer in progress: room again.
        h.committed(1, 1_000_000 + MAX_OPEN_PER_RANK as u64);
        h.reserve(key(1, 2_000_000, 5), 8, 0, &remote, &NONE, &NONE).unwrap();
        // And with a small cap, tiny parts fill it by pages, not bytes.
        let mut h = Holdings::new(4 * MIN_CHARGE);
        h.begin_round(1, None);
        for r in 0..4 {
            h.reserve(key(1, 1, r), 8, 1, &remote, &NONE, &NONE).unwrap();
        }
        assert!(h.reserve(key(1, 1, 4), 8, 1, &remote, &NONE, &NONE).is_err(), "4 one-byte parts fill 4 pages");
    }

    #[test]
    fn buffers_still_being_sent_after_they_were_freed_count_against_the_cap() {
        // A slow buddy: two freed parts of 100 bytes each still being copied out.
        let mut h = Holdings::new(300 * P);
        h.begin_round(1, None);
        h.outside = 200 * P;
        h.reserve(key(1, 1, 0), 1, 100 * P, &(0..1), &NONE, &NONE).unwrap();
        let e = h.reserve(key(1, 2, 0), 1, 100 * P, &(0..1), &NONE, &NONE).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        // Once the copies let go, the room is there again.
        h.outside = 0;
        h.reserve(key(1, 2, 0), 1, 100 * P, &(0..1), &NONE, &NONE).unwrap();
    }

    #[test]
    fn a_new_round_lets_go_of_steps_after_its_base_and_of_other_rounds() {
        let mut h = Holdings::new(1000 * P);
        h.begin_round(1, None);
        for step in [5, 6, 7] {
            h.reserve(key(1, step, 0), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
            h.commit(&key(1, step, 0));
        }
        h.committed(1, 6);
        // The round restores step 6 of round 1: step 7 is computed again, under tag 2.
        let gone = h.begin_round(2, Some((1, 6)));
        assert_eq!(gone, vec![key(1, 5, 0), key(1, 7, 0)], "all but the base");
        assert_eq!(h.inventory(), vec![have(1, 6, 0, 2)], "what went is in no inventory");
        let g = h.reserve(key(2, 7, 0), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        assert_eq!(g, Grant::default());
        assert!(h.get(&key(1, 6, 0)).is_some(), "the base stays until a newer step commits");
        h.commit(&key(2, 7, 0));
        assert!(h.committed(2, 7));
        let g = h.reserve(key(2, 8, 0), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        assert_eq!(g.reuse, Some(key(1, 6, 0)), "the old base goes with the next save");
    }

    #[test]
    fn a_reservation_being_written_is_never_reused_and_a_step_is_saved_once() {
        let mut h = Holdings::new(1000 * P);
        h.begin_round(1, None);
        h.reserve(key(1, 1, 0), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        h.commit(&key(1, 1, 0));
        h.reserve(key(1, 1, 1), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        h.commit(&key(1, 1, 1));
        h.committed(1, 1);
        // Restored: the round begins at step 1; a save of step 1 again is refused, not a
        // rewrite of the held part in place.
        h.begin_round(2, Some((1, 1)));
        let e = h.reserve(key(1, 1, 0), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap_err();
        assert!(e.not_snapshotted() && matches!(e, SnapError::AlreadyHeld { .. }), "{e}");
        // Rank 0 writes step 2 (reserved, not whole); rank 1's reservation never takes it.
        h.reserve(key(2, 2, 0), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        h.committed(2, 2);
        let g = h.reserve(key(2, 3, 1), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        assert!(!g.free.contains(&key(2, 2, 0)) && g.reuse != Some(key(2, 2, 0)), "{g:?}");
        assert!(
            h.reserve(key(2, 2, 0), 2, 10 * P, &(0..2), &NONE, &NONE).is_err(),
            "a second writer of the same part is refused"
        );
        // Rank 1's save does not free rank 0's old buffer (its worker may map it); rank 0's does.
        h.commit(&key(2, 2, 0));
        h.commit(&key(2, 3, 1));
        h.reserve(key(2, 3, 0), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        h.commit(&key(2, 3, 0));
        h.committed(2, 3);
        let g = h.reserve(key(2, 4, 1), 2, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        assert!(g.free.iter().chain(g.reuse.iter()).all(|k| k.rank == 1), "{g:?}");
    }

    #[test]
    fn a_step_held_twice_is_restored_before_a_newer_one_held_once() {
        let n = |s: &str| s.to_string();
        let runs: BTreeMap<u32, NodeId> = [(0, n("a")), (1, n("b"))].into();
        // Step 5 copied to the buddy both ways; step 6 saved but its copies not arrived.
        let inv: BTreeMap<NodeId, Vec<Have>> = [
            (n("a"), vec![have(1, 5, 0, 2), have(1, 5, 1, 2), have(1, 6, 0, 2)]),
            (n("b"), vec![have(1, 5, 1, 2), have(1, 5, 0, 2), have(1, 6, 1, 2)]),
        ]
        .into();
        assert_eq!(plan(&inv, &runs, 2).map(|p| p.step), Some(5));
        assert_eq!(plan(&inv, &runs, 1).map(|p| p.step), Some(6));
        // b lost: nothing is held twice, the newest whole step is taken.
        let only_a: BTreeMap<NodeId, Vec<Have>> = [(n("a"), inv[&n("a")].clone())].into();
        assert_eq!(plan(&only_a, &runs, 2).map(|p| p.step), Some(5));
    }

    #[test]
    fn an_abandoned_reservation_is_no_part_and_is_in_no_inventory() {
        let mut h = Holdings::new(100 * P);
        h.begin_round(3, None);
        h.reserve(key(3, 1, 0), 1, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        assert!(h.inventory().is_empty(), "reserved is not held");
        h.abandon(&key(3, 1, 0));
        assert_eq!(h.used(), 0);
        h.reserve(key(3, 1, 0), 1, 10 * P, &(0..2), &NONE, &NONE).unwrap();
        h.commit(&key(3, 1, 0));
        h.abandon(&key(3, 1, 0));
        assert_eq!(h.inventory(), vec![have(3, 1, 0, 1)], "a whole part is never abandoned");
    }

    #[test]
    fn a_plan_takes_the_newest_whole_step_the_same_for_everyone_never_a_mix() {
        let n = |s: &str| s.to_string();
        let mut inv: BTreeMap<NodeId, Vec<Have>> = BTreeMap::new();
        // Step 9 whole (ranks 0..4); step 10 of round 1 half saved; step 10 of round 2 (computed
        // again after a restore) whole on other nodes.
        inv.insert(n("a"), vec![have(1, 9, 0, 4), have(1, 9, 1, 4), have(1, 10, 0, 4), have(1, 9, 3, 4)]);
        inv.insert(n("b"), vec![have(1, 9, 2, 4), have(1, 9, 3, 4), have(1, 10, 2, 4), have(2, 10, 2, 4)]);
        inv.insert(n("c"), vec![have(2, 10, 0, 4), have(2, 10, 1, 4), have(2, 10, 3, 4)]);
        let runs: BTreeMap<u32, NodeId> = [(0, n("a")), (1, n("a")), (2, n("b")), (3, n("b"))].into();
        let p = plan(&inv, &runs, 1).unwrap();
        assert_eq!((p.tag, p.step, p.world), (2, 10, 4));
        assert_eq!(p.from[&2], "b", "the rank's own node when it holds the part");
        assert_eq!(p.from[&0], "c");
        // Without c, round 2's step 10 is not whole and round 1's never was: step 9.
        inv.remove("c");
        let p = plan(&inv, &runs, 1).unwrap();
        assert_eq!((p.tag, p.step), (1, 9));
        assert_eq!(p.from[&3], "b");
        // A part claiming a rank outside its world, or a world of another size, completes nothing.
        let lying: BTreeMap<NodeId, Vec<Have>> =
            [(n("x"), vec![have(1, 20, 0, 2), have(1, 20, 5, 2), have(1, 20, 1, 3)])].into();
        assert_eq!(plan(&lying, &runs, 1), None);
    }

    #[test]
    fn random_inventories_plan_only_steps_whose_every_part_is_held_where_it_says() {
        use crate::random::XorShift as Rng;
        for seed in 1..300u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let mut inv: BTreeMap<NodeId, Vec<Have>> = BTreeMap::new();
            for _ in 0..rng.below(40) {
                let node = format!("n{}", rng.below(4));
                let world = 1 + rng.below(4) as u32;
                inv.entry(node).or_default().push(have(rng.below(3), rng.below(5), rng.below(5) as u32, world));
            }
            if let Some(p) = plan(&inv, &BTreeMap::new(), 1) {
                assert_eq!(p.from.len(), p.world as usize, "seed {seed}");
                for (rank, node) in &p.from {
                    assert!(inv[node].contains(&have(p.tag, p.step, *rank, p.world)), "seed {seed}");
                }
                // No whole set is newer.
                for haves in inv.values() {
                    for h in haves {
                        if h.key.step > p.step {
                            let whole = (0..h.world)
                                .all(|r| inv.values().any(|v| v.contains(&have(h.key.tag, h.key.step, r, h.world))));
                            assert!(!whole, "seed {seed}: {h:?} was whole and newer");
                        }
                    }
                }
            }
        }
    }
}
