//! Which step of the snapshots held in the agents' memory may be restored, pure: the commit rule
//! of issue 28's in-memory snapshots, decided from what each node says it holds. No I/O: the
//! agents that hold the parts (and the transport between them) feed [`Event`]s in; tests drive
//! it with made-up events in every order.
//!
//! Each rank's part of a step is made on its own node (its *home* in the round the step was
//! saved in) and copied to the home's *buddy*, the next member in the round's order
//! ([`buddies`]). A step is **committed** once every rank's part is held on its home and on at
//! least one other node; it stays committed. [`Ledger::restorable`] answers, for every rank
//! alike, the newest committed step of which every part still has a live holder, and where to
//! fetch each part: never a mix of steps, never a step with a part missing.

use std::collections::{BTreeMap, BTreeSet};

pub mod core;
pub mod error;
pub mod holdings;

pub type NodeId = String;

/// Each member's buddy: the next member in the round's order (a ring). With one member there is
/// no other node: nothing is ever committed, and a lost node loses what it held.
pub fn buddies(members: &[NodeId]) -> BTreeMap<NodeId, NodeId> {
    if members.len() < 2 {
        return BTreeMap::new();
    }
    members.iter().enumerate().map(|(i, m)| (m.clone(), members[(i + 1) % members.len()].clone())).collect()
}

/// Most steps the ledger follows at once (the last committed among them). Members save in
/// lockstep (each step's gradients are all-reduced), and a node keeps the steps in progress
/// after the last committed one only within its memory cap: a handful are open at once.
pub const MAX_OPEN_STEPS: usize = 64;

/// What the ledger hears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `node` holds rank `rank`'s part of `step`, whole (its bytes checked).
    Held { step: u64, rank: u32, node: NodeId },
    /// `node` let rank `rank`'s part of `step` go (its memory cap).
    Dropped { step: u64, rank: u32, node: NodeId },
    /// `node` is gone, with everything it held.
    NodeLost(NodeId),
}

/// A restorable step: its number and, per rank, the node to fetch the part from (its home when
/// alive, else a live holder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    pub step: u64,
    pub from: BTreeMap<u32, NodeId>,
}

#[derive(Debug, Clone)]
pub struct Ledger {
    /// Each rank's home when the steps were saved.
    home: BTreeMap<u32, NodeId>,
    /// Step -> rank -> the nodes holding that part.
    held: BTreeMap<u64, BTreeMap<u32, BTreeSet<NodeId>>>,
    committed: BTreeSet<u64>,
    lost: BTreeSet<NodeId>,
}

impl Ledger {
    /// A ledger for steps saved with ranks `0..home.len()` placed as `home` says.
    pub fn new(home: BTreeMap<u32, NodeId>) -> Ledger {
        Ledger { home, held: BTreeMap::new(), committed: BTreeSet::new(), lost: BTreeSet::new() }
    }

    pub fn apply(&mut self, event: Event) {
        match event {
            Event::Held { step, rank, node } => {
                // A part of no rank of this world, or from a node already lost, is no part; a
                // step older than the last committed one is never needed again.
                if !self.home.contains_key(&rank)
                    || self.lost.contains(&node)
                    || self.last_committed().is_some_and(|c| step < c)
                {
                    return;
                }
                self.held.entry(step).or_default().entry(rank).or_default().insert(node);
                // A member announcing steps far ahead (or lying) must not grow this without end:
                // the newest steps go first, so the ones an honest round works on (just after
                // the last committed) stay.
                while self.held.len() > MAX_OPEN_STEPS {
                    self.held.pop_last();
                }
                if self.whole(step) {
                    self.committed.insert(step);
                    // What is older than a committed step may go.
                    self.held.retain(|s, _| *s >= step);
                    self.committed.retain(|s| *s >= step);
                }
            }
            Event::Dropped { step, rank, node } => {
                if let Some(holders) = self.held.get_mut(&step).and_then(|r| r.get_mut(&rank)) {
                    holders.remove(&node);
                }
            }
            Event::NodeLost(node) => {
                for ranks in self.held.values_mut() {
                    for holders in ranks.values_mut() {
                        holders.remove(&node);
                    }
                }
                self.lost.insert(node);
            }
        }
    }

    /// Every rank's part held on its home and on at least one other node (a world of one node
    /// has no other: there, on its home; losing that node loses the job anyway).
    fn whole(&self, step: u64) -> bool {
        let Some(ranks) = self.held.get(&step) else { return false };
        let alone = self.home.values().collect::<BTreeSet<_>>().len() < 2;
        self.home.iter().all(|(rank, home)| {
            ranks.get(rank).is_some_and(|h| h.contains(home) && (alone || h.iter().any(|n| n != home)))
        })
    }

    /// The newest committed step.
    pub fn last_committed(&self) -> Option<u64> {
        self.committed.last().copied()
    }

    /// Steps that may be let go: those older than the newest committed one (the ledger forgets
    /// them as it commits; a holder frees their memory).
    pub fn obsolete(&self, step: u64) -> bool {
        self.last_committed().is_some_and(|c| step < c)
    }

    /// The newest committed step of which every part still has a live holder, and where to
    /// fetch each part; `None` if there is none.
    pub fn restorable(&self) -> Option<Restore> {
        self.committed.iter().rev().find_map(|step| {
            let ranks = self.held.get(step)?;
            let from = self
                .home
                .iter()
                .map(|(rank, home)| {
                    let holders = ranks.get(rank)?;
                    let node = if holders.contains(home) { home } else { holders.iter().next()? };
                    Some((*rank, node.clone()))
                })
                .collect::<Option<BTreeMap<u32, NodeId>>>()?;
            Some(Restore { step: *step, from })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_announcing_endless_future_steps_keeps_the_ledger_bounded_and_the_round_committing() {
        // Issue 34 (Medium): Complete messages for steps far ahead grew the ledger without end.
        let (names, home) = layout(2, 1);
        let buddy = buddies(&names);
        let mut l = Ledger::new(home.clone());
        for e in save(1, &home, &buddy) {
            l.apply(e);
        }
        assert_eq!(l.last_committed(), Some(1));
        for step in 2..100_000u64 {
            l.apply(Event::Held { step: step * 1_000, rank: 1, node: "n1".into() });
            l.apply(Event::Held { step: step * 1_000, rank: 1, node: "n0".into() });
        }
        assert!(l.held.len() <= MAX_OPEN_STEPS, "{} steps followed", l.held.len());
        // The honest next step still commits.
        for e in save(2, &home, &buddy) {
            l.apply(e);
        }
        assert_eq!(l.last_committed(), Some(2));
    }

    /// `nodes` nodes of `per` ranks each: node i holds ranks i*per..(i+1)*per.
    fn layout(nodes: usize, per: u32) -> (Vec<NodeId>, BTreeMap<u32, NodeId>) {
        let names: Vec<NodeId> = (0..nodes).map(|i| format!("n{i}")).collect();
        let home = (0..nodes as u32 * per).map(|r| (r, names[(r / per) as usize].clone())).collect();
        (names, home)
    }

    /// Every part of `step` saved at home and copied to the home's buddy, in order.
    fn save(step: u64, home: &BTreeMap<u32, NodeId>, buddy: &BTreeMap<NodeId, NodeId>) -> Vec<Event> {
        home.iter()
            .flat_map(|(rank, h)| {
                let mut e = vec![Event::Held { step, rank: *rank, node: h.clone() }];
                e.extend(buddy.get(h).map(|b| Event::Held { step, rank: *rank, node: b.clone() }));
                e
            })
            .collect()
    }

    use crate::random::XorShift as Rng;

    #[test]
    fn buddies_form_a_ring_and_a_lone_node_has_none() {
        let b = buddies(&["a".into(), "b".into(), "c".into()]);
        assert_eq!((b["a"].as_str(), b["b"].as_str(), b["c"].as_str()), ("b", "c", "a"));
        assert!(buddies(&["a".into()]).is_empty());
    }

    #[test]
    fn a_step_commits_only_once_every_ranks_part_is_at_home_and_elsewhere_in_any_order() {
        let (names, home) = layout(3, 2);
        let buddy = buddies(&names);
        for seed in 1..200u64 {
            let mut rng = Rng((seed * 0x9E37_79B9) | 1);
            let mut events = save(7, &home, &buddy);
            for i in (1..events.len()).rev() {
                events.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let mut l = Ledger::new(home.clone());
            for (i, e) in events.iter().enumerate() {
                assert_eq!(l.restorable(), None, "seed {seed}: nothing before the last part ({i} of {})", events.len());
                l.apply(e.clone());
            }
            let r = l.restorable().expect("committed");
            assert_eq!(r.step, 7);
            assert!(r.from.iter().all(|(rank, n)| *n == home[rank]), "each part from its home: {r:?}");
        }
    }

    #[test]
    fn a_part_only_at_home_or_only_elsewhere_never_commits() {
        let (_, home) = layout(2, 1);
        let mut l = Ledger::new(home);
        // Rank 0 at home and copied; rank 1 copied but never at home (its node died mid-save).
        for (rank, node) in [(0, "n0"), (0, "n1"), (1, "n0")] {
            l.apply(Event::Held { step: 1, rank, node: node.into() });
        }
        assert_eq!(l.restorable(), None);
        // A lying peer: a rank that does not exist, a node claiming parts after it was lost.
        l.apply(Event::Held { step: 1, rank: 9, node: "n1".into() });
        l.apply(Event::NodeLost("n9".into()));
        l.apply(Event::Held { step: 1, rank: 1, node: "n9".into() });
        assert_eq!(l.restorable(), None);
        l.apply(Event::Held { step: 1, rank: 1, node: "n1".into() });
        assert_eq!(l.restorable().map(|r| r.step), Some(1));
    }

    #[test]
    fn losing_any_one_node_keeps_the_committed_step_and_parts_come_from_the_buddy() {
        for nodes in 2..6 {
            let (names, home) = layout(nodes, 2);
            let buddy = buddies(&names);
            for lost in &names {
                let mut l = Ledger::new(home.clone());
                save(3, &home, &buddy).into_iter().for_each(|e| l.apply(e));
                l.apply(Event::NodeLost(lost.clone()));
                let r = l.restorable().unwrap_or_else(|| panic!("{nodes} nodes, {lost} lost: step 3 kept"));
                assert_eq!(r.step, 3);
                for (rank, from) in &r.from {
                    assert_ne!(from, lost);
                    if &home[rank] == lost {
                        assert_eq!(from, &buddy[lost], "rank {rank}'s part from the lost node's buddy");
                    }
                }
            }
        }
    }

    #[test]
    fn a_node_lost_with_its_buddy_leaves_the_last_whole_step_or_none_never_half_of_one() {
        let (names, home) = layout(4, 1);
        let buddy = buddies(&names);
        let mut l = Ledger::new(home.clone());
        save(10, &home, &buddy).into_iter().for_each(|e| l.apply(e));
        // Step 11 half saved when n1 and its buddy n2 die.
        save(11, &home, &buddy).into_iter().take(3).for_each(|e| l.apply(e));
        assert_eq!(l.restorable().map(|r| r.step), Some(10), "11 is not committed");
        l.apply(Event::NodeLost("n1".into()));
        assert_eq!(l.restorable().map(|r| r.step), Some(10), "n1's parts are on n2");
        l.apply(Event::NodeLost("n2".into()));
        assert_eq!(l.restorable(), None, "rank 1's part of step 10 was only on n1 and n2: nothing whole is left");
        assert_eq!(l.last_committed(), Some(10), "committed it was");
    }

    #[test]
    fn a_newer_committed_step_makes_older_ones_obsolete_and_a_late_part_of_them_is_ignored() {
        let (names, home) = layout(2, 2);
        let buddy = buddies(&names);
        let mut l = Ledger::new(home.clone());
        for step in [1, 2] {
            save(step, &home, &buddy).into_iter().for_each(|e| l.apply(e));
        }
        assert!(l.obsolete(1) && !l.obsolete(2));
        save(1, &home, &buddy).into_iter().for_each(|e| l.apply(e));
        assert_eq!(l.restorable().map(|r| r.step), Some(2));
        // A holder dropping a part (its memory cap) makes the step unrestorable once no one else
        // holds it.
        l.apply(Event::Dropped { step: 2, rank: 0, node: "n0".into() });
        assert_eq!(l.restorable().map(|r| (r.step, r.from[&0].clone())), Some((2, "n1".into())));
        l.apply(Event::Dropped { step: 2, rank: 0, node: "n1".into() });
        assert_eq!(l.restorable(), None);
    }

    #[test]
    fn random_histories_never_restore_a_step_with_a_part_missing() {
        for seed in 1..300u64 {
            let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
            let nodes = 1 + rng.below(4) as usize;
            let (names, home) = layout(nodes, 1 + rng.below(2) as u32);
            let mut l = Ledger::new(home.clone());
            let mut alive: BTreeSet<NodeId> = names.iter().cloned().collect();
            // What each live node really holds.
            let mut truth: BTreeSet<(u64, u32, NodeId)> = BTreeSet::new();
            for _ in 0..200 {
                let step = rng.below(6);
                let rank = rng.below(home.len() as u64) as u32;
                let node = names[rng.below(nodes as u64) as usize].clone();
                match rng.below(10) {
                    0 => {
                        l.apply(Event::NodeLost(node.clone()));
                        alive.remove(&node);
                        truth.retain(|(_, _, n)| *n != node);
                    }
                    1 => {
                        l.apply(Event::Dropped { step, rank, node: node.clone() });
                        truth.remove(&(step, rank, node));
                    }
                    _ => {
                        l.apply(Event::Held { step, rank, node: node.clone() });
                        if alive.contains(&node) {
                            truth.insert((step, rank, node));
                        }
                    }
                }
                if let Some(r) = l.restorable() {
                    assert_eq!(r.from.len(), home.len(), "seed {seed}: every rank");
                    for (rank, from) in &r.from {
                        assert!(
                            truth.contains(&(r.step, *rank, from.clone())),
                            "seed {seed}: {from} holds rank {rank} of {}",
                            r.step
                        );
                    }
                }
            }
        }
    }

    /// Issue 34: random worlds across rounds with the rules production uses end to end: each
    /// member lists what it holds as it joins (a liar lists more), the round believes of it what
    /// [`rlaunch_rendezvous::round::credible_snapshots`] allows, every member plans the restore
    /// with [`holdings::plan`], and each node keeps the planned step and fetches its ranks'
    /// parts. Copies to the buddy get lost (a slow or cut buddy), nodes are lost and join at
    /// random. After every round: an honest holder the plan names really holds the part; a
    /// liar is named only for ranks it ran or was the buddy of when the step was saved; and
    /// while every part of the last committed step still has a live, honest holder, something is
    /// restored.
    #[test]
    fn random_worlds_with_a_liar_restore_only_real_parts_and_never_lose_a_surviving_commit() {
        use super::holdings::{plan, Have, Key};
        use rlaunch::contract::Member;
        use rlaunch_rendezvous::round::credible_snapshots;
        type Part = (u64, u64, u32, u32); // tag, step, rank, world
        const L: u32 = 2;
        for seed in 1..400u64 {
            let mut rng = crate::random::XorShift(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
            let mut next_id = 0;
            let fresh = |next_id: &mut usize| {
                *next_id += 1;
                format!("n{next_id}")
            };
            let mut alive: Vec<NodeId> = (0..3 + rng.below(3)).map(|_| fresh(&mut next_id)).collect();
            let liar =
                if rng.below(2) == 0 { Some(alive[rng.below(alive.len() as u64) as usize].clone()) } else { None };
            let mut truth: BTreeMap<NodeId, BTreeSet<Part>> =
                alive.iter().map(|n| (n.clone(), BTreeSet::new())).collect();
            // Per round: each rank's home and that home's buddy.
            let mut ring_of: BTreeMap<u64, BTreeMap<u32, (NodeId, NodeId)>> = BTreeMap::new();
            let mut last: Vec<Member> = Vec::new();
            let mut step = 0u64;
            let mut committed: Option<(u64, u64, u32)> = None; // tag, step, world
            for tag in 1..12u64 {
                // The round closes: each node's listing, believed as the rendezvous believes it.
                let sets_of = |n: &NodeId,
                               truth: &BTreeMap<NodeId, BTreeSet<Part>>,
                               rng: &mut crate::random::XorShift| {
                    let mut have: Vec<Have> = truth[n]
                        .iter()
                        .map(|&(tag, step, rank, world)| Have { key: Key { tag, step, rank }, world })
                        .collect();
                    if liar.as_ref() == Some(n) {
                        // Every rank of a step nobody saved, and of the real steps it knows of.
                        let world = (alive.len() as u32) * L;
                        let fake = step + 1 + rng.below(5);
                        have.extend((0..world).map(|rank| Have { key: Key { tag: tag - 1, step: fake, rank }, world }));
                        for &(t, s, _, w) in truth[n].iter() {
                            have.extend((0..w).map(|rank| Have { key: Key { tag: t, step: s, rank }, world: w }));
                        }
                        have.sort();
                        have.dedup();
                    }
                    crate::snapstore::to_sets(&have)
                };
                let members: Vec<Member> = alive
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        let node = rlaunch::contract::NodeInfo {
                            node_id: n.clone(),
                            local_world_size: L,
                            store_addr: "127.0.0.1:1".parse().unwrap(),
                            probe_addr: None,
                            fingerprint: None,
                            snapshot_addr: None,
                            snapshot_key: None,
                            snapshots: sets_of(n, &truth, &mut rng),
                        };
                        let snapshots = credible_snapshots(&last, tag - 1, &node);
                        Member {
                            node_id: n.clone(),
                            group_rank: i as u32,
                            local_world_size: L,
                            rank_offset: i as u32 * L,
                            store_addr: node.store_addr,
                            probe_addr: None,
                            snapshot_addr: None,
                            snapshot_key: None,
                            snapshots,
                        }
                    })
                    .collect();
                let world = alive.len() as u32 * L;
                let inventories: BTreeMap<NodeId, Vec<Have>> =
                    members.iter().map(|m| (m.node_id.clone(), crate::snapstore::from_sets(&m.snapshots))).collect();
                let runs: BTreeMap<u32, NodeId> =
                    members.iter().flat_map(|m| m.ranks().map(move |r| (r, m.node_id.clone()))).collect();
                let p = plan(&inventories, &runs, 2);
                if let Some(p) = &p {
                    for (rank, from) in &p.from {
                        let part = (p.tag, p.step, *rank, p.world);
                        if liar.as_ref() == Some(from) {
                            let credible = ring_of
                                .get(&p.tag)
                                .and_then(|r| r.get(rank))
                                .is_some_and(|(h, b)| from == h || from == b);
                            assert!(credible, "seed {seed}: the liar named for rank {rank} of round {}", p.tag);
                        } else {
                            assert!(
                                truth[from].contains(&part),
                                "seed {seed}: {from} named for {part:?} and does not hold it"
                            );
                        }
                    }
                } else if let Some((ct, cs, cw)) = committed {
                    // The last committed step, where every part still has a live, honest holder
                    // that held it since it was saved (home or buddy then).
                    let survives = (0..cw).all(|r| {
                        truth.iter().any(|(n, held)| {
                            liar.as_ref() != Some(n) && held.contains(&(ct, cs, r, cw)) && {
                                let (home, buddy) = &ring_of[&ct][&r];
                                n == home || n == buddy
                            }
                        })
                    });
                    assert!(
                        !survives,
                        "seed {seed}: step {cs} of round {ct} survives on live nodes and nothing is restored"
                    );
                }
                // The round begins: each node keeps only the planned step, then fetches its
                // ranks' parts (a fetch from a node that does not hold the part fails).
                let fetched: Vec<(NodeId, Part)> = p
                    .iter()
                    .flat_map(|p| p.from.iter().map(move |(rank, from)| (p, *rank, from)))
                    .filter(|(p, rank, from)| truth[*from].contains(&(p.tag, p.step, *rank, p.world)))
                    .filter_map(|(p, rank, _)| Some((runs.get(&rank)?.clone(), (p.tag, p.step, rank, p.world))))
                    .collect();
                for held in truth.values_mut() {
                    held.retain(|&(t, s, _, _)| p.as_ref().is_some_and(|p| (t, s) == (p.tag, p.step)));
                }
                for (n, part) in fetched {
                    truth.get_mut(&n).expect("a member").insert(part);
                }
                step = p.as_ref().map_or(0, |p| p.step + 1);
                ring_of.insert(
                    tag,
                    members
                        .iter()
                        .enumerate()
                        .flat_map(|(i, m)| {
                            let buddy = members[(i + 1) % members.len()].node_id.clone();
                            m.ranks().map(move |r| (r, (m.node_id.clone(), buddy.clone())))
                        })
                        .collect(),
                );
                // Saving: a few steps, each copy to the buddy lost now and then.
                for _ in 0..rng.below(4) {
                    let mut whole = true;
                    for (i, m) in members.iter().enumerate() {
                        let buddy = &members[(i + 1) % members.len()].node_id;
                        for r in m.ranks() {
                            truth.get_mut(&m.node_id).unwrap().insert((tag, step, r, world));
                            if rng.below(5) != 0 {
                                truth.get_mut(buddy).unwrap().insert((tag, step, r, world));
                            } else {
                                whole = false;
                            }
                        }
                    }
                    if whole {
                        committed = Some((tag, step, world));
                        // Older steps of this round and before may go (the new base).
                        for held in truth.values_mut() {
                            held.retain(|&(t, s, _, _)| (t, s) >= (tag, step));
                        }
                    }
                    step += 1;
                }
                last = members;
                // A fault ends the round: a node lost, a node joining, or a worker's failure.
                match rng.below(3) {
                    0 if alive.len() > 2 => {
                        let lost = alive.remove(rng.below(alive.len() as u64) as usize);
                        truth.remove(&lost);
                    }
                    1 if alive.len() < 6 => {
                        let n = fresh(&mut next_id);
                        truth.insert(n.clone(), BTreeSet::new());
                        alive.push(n);
                    }
                    _ => {}
                }
            }
        }
    }
}
