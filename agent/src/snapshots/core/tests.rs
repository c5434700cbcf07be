use super::*;
use crate::random::XorShift as Rng;

const P: u64 = holdings::MIN_CHARGE;

fn n(s: &str) -> NodeId {
    s.to_string()
}

fn member(id: &str, ranks: Range<u32>, inventory: Vec<Have>) -> RoundMember {
    RoundMember { id: n(id), ranks, inventory, fit: true }
}

fn made(acts: &[Action]) -> Option<(Key, Option<Key>)> {
    acts.iter().find_map(|a| match a {
        Action::Make { key, reuse, .. } => Some((*key, *reuse)),
        _ => None,
    })
}

/// The reservation granted: its key and generation.
fn granted(acts: &[Action]) -> Option<(Key, u64)> {
    acts.iter().find_map(|a| match a {
        Action::Make { key, generation, .. } => Some((*key, *generation)),
        _ => None,
    })
}

/// The fetch asked for: its id.
fn fetch_of(acts: &[Action]) -> Option<u64> {
    acts.iter().find_map(|a| match a {
        Action::Fetch { fetch, .. } => Some(*fetch),
        _ => None,
    })
}

fn refused(acts: &[Action]) -> Option<&SnapError> {
    acts.iter().find_map(|a| match a {
        Action::Refuse(e) => Some(e),
        _ => None,
    })
}

/// Node `a` (ranks 0..2) in round 1 with `b` (ranks 2..4) and `c` (ranks 4..6): a's buddy is b,
/// and a is c's.
fn three(cap: u64) -> Core {
    let mut core = Core::new(cap);
    let members = vec![member("a", 0..2, vec![]), member("b", 2..4, vec![]), member("c", 4..6, vec![])];
    core.step(Input::PeerRound { tag: 1, me: n("a"), members }, Instant::now());
    core
}

fn save(core: &mut Core, writer: u64, step: u64, rank: u32, len: u64, now: Instant) -> Vec<Action> {
    let mut acts = core.step(Input::Reserve { writer, step, rank, world: 6, len, since: now }, now);
    if made(&acts).is_some() {
        acts.extend(core.step(Input::Commit { writer, step, rank }, now));
    }
    acts
}

#[test]
fn a_save_before_any_round_waits_until_the_deadline_the_core_sets_then_is_refused() {
    let t0 = Instant::now();
    let mut core = Core::new(100 * P);
    let ask = |since| Input::Reserve { writer: 1, step: 1, rank: 0, world: 1, len: P, since };
    assert_eq!(core.step(ask(t0), t0), vec![Action::Wait { until: t0 + PLAN_WAIT }]);
    let later = t0 + PLAN_WAIT - Duration::from_millis(1);
    assert_eq!(core.step(ask(t0), later), vec![Action::Wait { until: t0 + PLAN_WAIT }]);
    assert_eq!(core.step(ask(t0), t0 + PLAN_WAIT), vec![Action::Refuse(SnapError::NoRound)]);
    let load = core.step(Input::Load { rank: Some(0), since: t0 }, t0 + PLAN_WAIT);
    assert_eq!(load, vec![Action::Refuse(SnapError::NoRound)]);
    // Once a round begins, the same request is answered.
    core.step(Input::LocalRound { tag: 1, world: 1, ranks: 0..1 }, t0);
    assert!(made(&core.step(ask(t0), t0 + Duration::from_secs(1))).is_some());
}

#[test]
fn a_commit_copies_to_the_buddy_and_the_step_is_announced_once_every_local_rank_is_acknowledged() {
    let t = Instant::now();
    let mut core = three(100 * P);
    let acts = save(&mut core, 1, 5, 0, P, t);
    assert!(acts.contains(&Action::Saved { rank: 0, step: 5 }));
    assert!(acts.contains(&Action::Copy { key: Key { tag: 1, step: 5, rank: 0 }, to: n("b") }), "{acts:?}");
    save(&mut core, 2, 5, 1, P, t);
    let acks = core.step(Input::CopyAcked { key: Key { tag: 1, step: 5, rank: 0 }, by: n("b") }, t);
    assert!(!acks.iter().any(|a| matches!(a, Action::Announce { .. })), "one of two ranks acknowledged: {acks:?}");
    let acks = core.step(Input::CopyAcked { key: Key { tag: 1, step: 5, rank: 1 }, by: n("b") }, t);
    assert!(acks.contains(&Action::Announce { tag: 1, step: 5, to: vec![n("b"), n("c")] }), "{acks:?}");
    // b failed to take an announcement: passed over for QUIET_AFTER_FAILURE, then told again.
    core.step(Input::AnnounceFailed { node: n("b") }, t);
    save(&mut core, 1, 6, 0, P, t);
    save(&mut core, 2, 6, 1, P, t);
    core.step(Input::CopyAcked { key: Key { tag: 1, step: 6, rank: 0 }, by: n("b") }, t);
    let acks = core.step(Input::CopyAcked { key: Key { tag: 1, step: 6, rank: 1 }, by: n("b") }, t);
    assert!(acks.contains(&Action::Announce { tag: 1, step: 6, to: vec![n("c")] }), "{acks:?}");
    let later = t + QUIET_AFTER_FAILURE;
    save(&mut core, 1, 7, 0, P, later);
    save(&mut core, 2, 7, 1, P, later);
    core.step(Input::CopyAcked { key: Key { tag: 1, step: 7, rank: 0 }, by: n("b") }, later);
    let acks = core.step(Input::CopyAcked { key: Key { tag: 1, step: 7, rank: 1 }, by: n("b") }, later);
    assert!(acks.contains(&Action::Announce { tag: 1, step: 7, to: vec![n("b"), n("c")] }), "{acks:?}");
    // b and c announce theirs: step 7 commits.
    assert_eq!(core.last_committed(), None);
    core.step(Input::Complete { from: n("b"), round: 1, tag: 1, step: 7 }, later);
    let acts = core.step(Input::Complete { from: n("c"), round: 1, tag: 1, step: 7 }, later);
    assert!(acts.contains(&Action::Committed { step: 7 }), "{acts:?}");
}

#[test]
fn copies_are_taken_only_from_the_member_this_node_is_the_buddy_of_for_its_own_ranks_and_world() {
    let t = Instant::now();
    let mut core = three(100 * P);
    let offer = |from: &str, round, tag, rank, world| Input::Offer {
        from: n(from),
        round,
        key: Key { tag, step: 1, rank },
        world,
        len: P,
    };
    let cases = [
        (offer("b", 1, 1, 2, 6), SnapError::NotBuddy { node: n("b") }),
        (offer("c", 1, 1, 2, 6), SnapError::NotTheirRank { rank: 2, node: n("c") }),
        (offer("c", 1, 1, 4, 4), SnapError::WorldMismatch { world: 4, round: 1, round_world: 6 }),
        (offer("c", 0, 1, 4, 6), SnapError::OtherRound { tag: 1 }),
        (offer("c", 1, 0, 4, 6), SnapError::OtherRound { tag: 0 }),
    ];
    for (input, want) in cases {
        assert_eq!(refused(&core.step(input.clone(), t)), Some(&want), "{input:?}");
    }
    let (key, generation) = granted(&core.step(offer("c", 1, 1, 4, 6), t)).expect("c's own rank, to its buddy");
    let acts = core.step(Input::CopyArrived { key, generation }, t);
    assert!(acts.contains(&Action::Seal(key)) && acts.contains(&Action::Done), "{acts:?}");
    assert!(core.holds(&key).is_some());
    // A second copy of the same part is refused: a step is saved once.
    assert_eq!(refused(&core.step(offer("c", 1, 1, 4, 6), t)), Some(&SnapError::AlreadyHeld { rank: 4, step: 1 }));
    // Bytes that arrive after the round ended are no part.
    let (key, generation) = granted(&core.step(offer("c", 1, 1, 5, 6), t)).unwrap();
    core.step(Input::EndRound, t);
    assert_eq!(refused(&core.step(Input::CopyArrived { key, generation }, t)), Some(&SnapError::RoundEnded));
    assert!(core.holds(&key).is_none() && core.inventory().len() == 1);
}

#[test]
fn a_part_freed_while_a_slow_buddy_still_reads_it_counts_until_let_go_and_is_never_reused() {
    // Issue 34 (Medium 8): a part freed while a copy to a slow buddy still read it was not
    // counted when the next save was given room, so the node held more than its cap.
    let t = Instant::now();
    let mut core = Core::new(2 * P);
    let members = vec![member("a", 0..1, vec![]), member("b", 1..2, vec![])];
    core.step(Input::PeerRound { tag: 1, me: n("a"), members }, t);
    let step = |core: &mut Core, s: u64| {
        let acts = core.step(Input::Reserve { writer: 1, step: s, rank: 0, world: 2, len: P, since: t }, t);
        let got = made(&acts);
        if got.is_some() {
            core.step(Input::Commit { writer: 1, step: s, rank: 0 }, t);
            core.step(Input::CopyAcked { key: Key { tag: 1, step: s, rank: 0 }, by: n("b") }, t);
            core.step(Input::Complete { from: n("b"), round: 1, tag: 1, step: s }, t);
        }
        (got, acts)
    };
    step(&mut core, 1);
    let k1 = Key { tag: 1, step: 1, rank: 0 };
    // A member's fetch (or the copy to the buddy) reads step 1, slowly.
    let ticket = match core.step(Input::Read { key: k1, by: Some((n("b"), 1)) }, t).as_slice() {
        [Action::Read { ticket, .. }] => *ticket,
        other => panic!("{other:?}"),
    };
    step(&mut core, 2);
    assert_eq!(core.last_committed(), Some(2));
    // Step 3 would free step 1, whose bytes stay while they are read: no room.
    let (got, acts) = step(&mut core, 3);
    assert!(got.is_none() && matches!(refused(&acts), Some(SnapError::NoRoom { .. })), "{acts:?}");
    assert!(core.used() <= core.cap());
    // Once the reader lets go, step 3 gets room, in a new buffer or step 1's.
    core.step(Input::ReadDone { ticket }, t);
    assert!(step(&mut core, 3).0.is_some());
    assert_eq!(core.used(), 2 * P);
    // And a freed part still read is never handed out to be written.
    let mut core = Core::new(3 * P);
    let members = vec![member("a", 0..1, vec![]), member("b", 1..2, vec![])];
    core.step(Input::PeerRound { tag: 1, me: n("a"), members }, t);
    step(&mut core, 1);
    let ticket = match core.step(Input::Read { key: k1, by: None }, t).as_slice() {
        [Action::Read { ticket, .. }] => *ticket,
        other => panic!("{other:?}"),
    };
    step(&mut core, 2);
    let (got, acts) = step(&mut core, 3);
    assert_eq!(got, Some((Key { tag: 1, step: 3, rank: 0 }, None)), "{acts:?}");
    assert!(acts.contains(&Action::Free(k1)));
    assert_eq!(core.used(), 3 * P, "steps 2 and 3 held, step 1 still read");
    core.step(Input::ReadDone { ticket }, t);
    assert_eq!(core.used(), 2 * P);
}

#[test]
fn a_load_fetches_once_with_a_deadline_and_a_second_load_of_the_part_waits_for_it() {
    let t = Instant::now();
    let mut core = Core::new(100 * P);
    // b held rank 0's part of step 4 (round 1); a runs rank 0 now.
    let have = |rank| Have { key: Key { tag: 1, step: 4, rank }, world: 2 };
    let members = vec![member("a", 0..1, vec![have(1)]), member("b", 1..2, vec![have(0), have(1)])];
    let acts = core.step(Input::PeerRound { tag: 2, me: n("a"), members: members.clone() }, t);
    assert!(matches!(&acts[..], [Action::Planned(Some(p))] if p.step == 4), "{acts:?}");
    let key = Key { tag: 1, step: 4, rank: 0 };
    let acts = core.step(Input::Load { rank: Some(0), since: t }, t);
    let fetch = fetch_of(&acts).unwrap();
    assert_eq!(acts, vec![Action::Fetch { key, from: n("b"), until: t + FETCH_WITHIN, fetch }]);
    let again = core.step(Input::Load { rank: Some(0), since: t }, t);
    assert_eq!(again, vec![Action::Wait { until: t + FETCH_WITHIN }]);
    // The holder answers a part of another world: refused, nothing made.
    let e = core.step(Input::FetchRoom { key, from: n("b"), world: 3, len: P }, t);
    assert_eq!(refused(&e), Some(&SnapError::OtherWorld { node: n("b"), world: 3, want: 2 }));
    let (_, generation) = granted(&core.step(Input::FetchRoom { key, from: n("b"), world: 2, len: P }, t)).unwrap();
    assert!(core.step(Input::FetchArrived { key, fetch, generation }, t).contains(&Action::Seal(key)));
    match core.step(Input::Load { rank: Some(0), since: t }, t).as_slice() {
        [Action::Lend { key: k, step: 4, world: 2, len }] => assert_eq!((*k, *len), (key, P)),
        other => panic!("{other:?}"),
    }
    // A rank the saved world did not have: the step and its world, no part.
    let acts = core.step(Input::Load { rank: Some(7), since: t }, t);
    assert_eq!(acts, vec![Action::Restore { step: Some(4), world: Some(2) }]);
    // A failed fetch whose part nobody brought is refused with the holder's name.
    let mut core = Core::new(100 * P);
    core.step(Input::PeerRound { tag: 2, me: n("a"), members }, t);
    let fetch = fetch_of(&core.step(Input::Load { rank: Some(0), since: t }, t)).unwrap();
    let (_, generation) = granted(&core.step(Input::FetchRoom { key, from: n("b"), world: 2, len: P }, t)).unwrap();
    let failed = |generation| Input::FetchFailed {
        key,
        fetch,
        generation,
        from: n("b"),
        addr: "b:1".into(),
        error: "reset".into(),
    };
    let e = core.step(failed(Some(generation)), t);
    assert!(matches!(refused(&e), Some(SnapError::Fetch { node, .. }) if node == "b"), "{e:?}");
    assert_eq!(core.used(), 0, "the cut fetch's room is given back");
    // A load of the part may try again: a new fetch.
    assert!(matches!(core.step(Input::Load { rank: Some(0), since: t }, t)[..], [Action::Fetch { .. }]));
}

#[test]
fn a_fetch_left_over_from_an_earlier_round_never_touches_the_fetch_of_this_one() {
    // Found reviewing the core: a fetch of round 2 still retrying when round 3 began with the
    // same plan reported its failure by key alone, and took down round 3's reservation of the
    // part mid-transfer (its bytes then went to a buffer nothing counted); a stale arrival could
    // seal another fetch's half-written buffer as whole.
    let t = Instant::now();
    let mut core = Core::new(100 * P);
    let have = |rank| Have { key: Key { tag: 1, step: 4, rank }, world: 2 };
    let members = vec![member("a", 0..1, vec![have(1)]), member("b", 1..2, vec![have(0), have(1)])];
    let key = Key { tag: 1, step: 4, rank: 0 };
    core.step(Input::PeerRound { tag: 2, me: n("a"), members: members.clone() }, t);
    let stale = fetch_of(&core.step(Input::Load { rank: Some(0), since: t }, t)).unwrap();
    let (_, stale_room) = granted(&core.step(Input::FetchRoom { key, from: n("b"), world: 2, len: P }, t)).unwrap();
    // Round 3, the same plan: its load fetches anew and gets room.
    core.step(Input::EndRound, t);
    core.step(Input::PeerRound { tag: 3, me: n("a"), members }, t);
    let fetch = fetch_of(&core.step(Input::Load { rank: Some(0), since: t }, t)).expect("a new fetch");
    assert_ne!(fetch, stale);
    let (_, generation) = granted(&core.step(Input::FetchRoom { key, from: n("b"), world: 2, len: P }, t))
        .expect("the stale room went with its round");
    assert_ne!(generation, stale_room);
    // The stale fetch reports: arrived, failed, its room abandoned. Nothing of this round's moves.
    for stale_report in [
        Input::FetchArrived { key, fetch: stale, generation: stale_room },
        Input::FetchFailed {
            key,
            fetch: stale,
            generation: Some(stale_room),
            from: n("b"),
            addr: String::new(),
            error: "old".into(),
        },
        Input::Abandon { key, generation: stale_room },
    ] {
        let acts = core.step(stale_report.clone(), t);
        assert!(!acts.iter().any(|a| matches!(a, Action::Free(_) | Action::Seal(_))), "{stale_report:?}: {acts:?}");
        assert!(core.holds(&key).is_none(), "a half-written part taken for whole");
        assert_eq!(core.used(), P, "this round's room still counted");
    }
    // A second load still waits for this round's fetch, which then lands.
    assert!(matches!(core.step(Input::Load { rank: Some(0), since: t }, t)[..], [Action::Wait { .. }]));
    assert!(core.step(Input::FetchArrived { key, fetch, generation }, t).contains(&Action::Seal(key)));
    assert!(matches!(core.step(Input::Load { rank: Some(0), since: t }, t)[..], [Action::Lend { .. }]));
}

#[test]
fn a_worker_gone_mid_save_leaves_nothing_and_only_its_writer_commits_a_reservation() {
    let t = Instant::now();
    let mut core = three(100 * P);
    let acts = core.step(Input::Reserve { writer: 1, step: 1, rank: 0, world: 6, len: P, since: t }, t);
    let (key, _) = made(&acts).unwrap();
    // Another connection cannot commit it.
    let e = core.step(Input::Commit { writer: 2, step: 1, rank: 0 }, t);
    assert_eq!(refused(&e), Some(&SnapError::NotReserved { rank: 0, step: 1 }));
    let acts = core.step(Input::WriterGone { writer: 1 }, t);
    assert!(acts.contains(&Action::Abandoned(key)) && acts.contains(&Action::Free(key)), "{acts:?}");
    assert_eq!(core.used(), 0);
    assert!(core.inventory().is_empty());
}

/// A simulated job: every node's core, the messages between them in flight, and the truth.
struct Sim {
    rng: Rng,
    now: Instant,
    cores: BTreeMap<NodeId, Core>,
    alive: Vec<NodeId>,
    per_node: u32,
    tag: u64,
    /// This round: each node's ranks.
    ranks: BTreeMap<NodeId, Range<u32>>,
    world: u32,
    next_step: BTreeMap<u32, u64>,
    msgs: Vec<Msg>,
    liar: Option<NodeId>,
    slow: Option<NodeId>,
    /// Loads still to do this round: (node, rank).
    loads: Vec<(NodeId, u32)>,
    writer: u64,
    seen: Seen,
}

/// What the random worlds went through, so a test that checks nothing cannot pass.
#[derive(Debug, Default)]
struct Seen {
    commits: usize,
    full: usize,
    fetched: usize,
    floors_checked: usize,
    lies_refused: usize,
    freed_while_read: usize,
}

#[derive(Debug, Clone)]
enum Msg {
    Copy { from: NodeId, to: NodeId, key: Key, ticket: u64, world: u32, len: u64 },
    Ack { to: NodeId, key: Key, by: NodeId },
    Complete { from: NodeId, to: NodeId, tag: u64, step: u64 },
}

impl Sim {
    fn step(&mut self, node: &NodeId, input: Input) -> Vec<Action> {
        self.now += Duration::from_millis(self.rng.below(50));
        let core = self.cores.get_mut(node).expect("a node");
        let reads_before = core.outside();
        let acts = core.step(input, self.now);
        assert!(core.used() <= core.cap(), "{node} over its cap: {} > {}", core.used(), core.cap());
        if core.outside() > reads_before {
            self.seen.freed_while_read += 1;
        }
        for a in &acts {
            match a {
                Action::Committed { .. } => self.seen.commits += 1,
                Action::Refuse(SnapError::NoRoom { .. } | SnapError::TooManyOpen { .. }) => self.seen.full += 1,
                _ => {}
            }
        }
        self.carry(node, &acts);
        acts
    }

    /// What the I/O does in the background with a node's actions.
    fn carry(&mut self, node: &NodeId, acts: &[Action]) {
        for a in acts {
            match a {
                Action::Copy { key, to } => {
                    if let [Action::Read { ticket, world, len, .. }] =
                        self.step(node, Input::Read { key: *key, by: None }).as_slice()
                    {
                        self.msgs.push(Msg::Copy {
                            from: node.clone(),
                            to: to.clone(),
                            key: *key,
                            ticket: *ticket,
                            world: *world,
                            len: *len,
                        });
                    }
                }
                Action::Announce { tag, step, to } => {
                    for t in to {
                        self.msgs.push(Msg::Complete { from: node.clone(), to: t.clone(), tag: *tag, step: *step });
                    }
                }
                _ => {}
            }
        }
    }

    fn begin_round(&mut self) {
        self.tag += 1;
        let mut members = Vec::new();
        let mut offset = 0;
        self.ranks.clear();
        for id in &self.alive {
            let r = offset..offset + self.per_node;
            offset += self.per_node;
            self.ranks.insert(id.clone(), r.clone());
            members.push(member(id, r, self.cores[id].inventory()));
        }
        self.world = offset;
        let mut plans = BTreeSet::new();
        for id in self.alive.clone() {
            self.cores.get_mut(&id).unwrap().step(Input::EndRound, self.now);
            let acts = self.step(&id, Input::PeerRound { tag: self.tag, me: id.clone(), members: members.clone() });
            let Some(Action::Planned(plan)) = acts.into_iter().find(|a| matches!(a, Action::Planned(_))) else {
                panic!("no plan")
            };
            plans.insert(format!("{plan:?}"));
            // Never half a step: every part of the plan held, whole, where it says.
            if let Some(p) = &plan {
                assert_eq!(p.from.len(), p.world as usize);
                for (rank, holder) in &p.from {
                    let part = self.cores[holder].holds(&Key { tag: p.tag, step: p.step, rank: *rank });
                    assert!(part.is_some_and(|h| h.world == p.world), "{holder} lacks rank {rank} of {p:?}");
                }
            }
        }
        assert_eq!(plans.len(), 1, "every member computes the same plan: {plans:?}");
        let start = self.cores[&self.alive[0]].plan().map_or(0, |p| p.step);
        self.next_step = (0..self.world).map(|r| (r, start + 1)).collect();
        self.loads = self.ranks.iter().flat_map(|(id, r)| r.clone().map(move |rank| (id.clone(), rank))).collect();
    }

    /// The newest step committed on any live node, with the round it was saved in.
    fn committed(&self) -> Option<(u64, u64)> {
        self.alive.iter().filter_map(|id| self.cores[id].last_committed()).max().map(|s| (self.tag, s))
    }

    /// A committed step is held at each rank's home and at its buddy (the liar's ranks aside:
    /// it lies about its own).
    fn check_replicated(&self) {
        let Some((tag, step)) = self.committed() else { return };
        let buddy = buddies(&self.alive);
        for (home, ranks) in &self.ranks {
            if Some(home) == self.liar.as_ref() {
                continue;
            }
            for rank in ranks.clone() {
                for holder in std::iter::once(home).chain(buddy.get(home)) {
                    // A newer committed step on the holder supersedes this one there.
                    let newer = self.cores[holder].last_committed().is_some_and(|s| s > step);
                    let held = self.cores[holder].holds(&Key { tag, step, rank }).is_some();
                    assert!(held || newer, "committed step {step}: rank {rank} not on {holder}");
                }
            }
        }
    }

    /// A worker saves its next step. Ranks go in lockstep (each step's gradients are
    /// all-reduced): a rank is at most one step ahead of the slowest. A refused save leaves
    /// training going: the step is not snapshotted.
    fn save(&mut self) {
        let Some(id) = self.pick_alive() else { return };
        let ranks = self.ranks[&id].clone();
        let rank = ranks.start + self.rng.below(ranks.len() as u64) as u32;
        let step = self.next_step[&rank];
        if step > self.next_step.values().min().copied().unwrap_or(step) + 1 {
            return;
        }
        self.writer += 1;
        let writer = self.writer;
        let len = P * (1 + self.rng.below(3));
        let acts = self.step(&id, Input::Reserve { writer, step, rank, world: self.world, len, since: self.now });
        if made(&acts).is_none() {
            self.next_step.insert(rank, step + 1);
            return;
        }
        if self.rng.below(10) == 0 {
            // The worker dies while writing.
            self.step(&id, Input::WriterGone { writer });
            return;
        }
        let acts = self.step(&id, Input::Commit { writer, step, rank });
        assert!(acts.contains(&Action::Done), "{acts:?}");
        self.next_step.insert(rank, step + 1);
    }

    fn pick_alive(&mut self) -> Option<NodeId> {
        if self.alive.is_empty() {
            return None;
        }
        Some(self.alive[self.rng.below(self.alive.len() as u64) as usize].clone())
    }

    fn deliver(&mut self) {
        if self.msgs.is_empty() {
            return;
        }
        let i = self.rng.below(self.msgs.len() as u64) as usize;
        let m = self.msgs[i].clone();
        let slow = |id: &NodeId| self.slow.as_ref() == Some(id);
        let involved = match &m {
            Msg::Copy { from, to, .. } | Msg::Complete { from, to, .. } => slow(from) || slow(to),
            Msg::Ack { to, by, .. } => slow(to) || slow(by),
        };
        if involved && self.rng.below(8) != 0 {
            return; // the slow buddy: not yet
        }
        self.msgs.swap_remove(i);
        match m {
            Msg::Copy { from, to, key, ticket, world, len } => {
                let tag = self.tag;
                let acts = self.step(&to, Input::Offer { from: from.clone(), round: tag, key, world, len });
                if let Some((key, generation)) = granted(&acts) {
                    if self.rng.below(6) == 0 {
                        self.step(&to, Input::Abandon { key, generation }); // the connection was cut mid-part
                    } else if self.step(&to, Input::CopyArrived { key, generation }).contains(&Action::Done) {
                        self.msgs.push(Msg::Ack { to: from.clone(), key, by: to });
                    }
                }
                self.step(&from, Input::ReadDone { ticket });
            }
            Msg::Ack { to, key, by } => {
                self.step(&to, Input::CopyAcked { key, by });
            }
            Msg::Complete { from, to, tag, step } => {
                let round = self.tag;
                self.step(&to, Input::Complete { from, round, tag, step });
            }
        }
    }

    fn lie(&mut self) {
        let Some(liar) = self.liar.clone().filter(|l| self.alive.contains(l)) else { return };
        let Some(to) = self.pick_alive().filter(|t| *t != liar) else { return };
        let (tag, world) = (self.tag, self.world);
        if self.rng.below(2) == 0 {
            // A step it never made whole, far ahead or not.
            let step = self.next_step.values().max().copied().unwrap_or(1) + self.rng.below(3);
            self.step(&to, Input::Complete { from: liar, round: tag, tag, step });
        } else {
            // A copy of another node's rank, or to a node it is not the buddy of.
            let rank = self.rng.below(world as u64) as u32;
            let key = Key { tag, step: self.rng.below(20), rank };
            let acts = self.step(&to, Input::Offer { from: liar.clone(), round: tag, key, world, len: P });
            let theirs = self.ranks[&liar].contains(&rank);
            let ward = buddies(&self.alive).get(&liar) == Some(&to);
            if !(theirs && ward) {
                assert!(refused(&acts).is_some(), "a copy the liar may not give was taken: {acts:?}");
                self.seen.lies_refused += 1;
            } else if let Some((key, generation)) = granted(&acts) {
                self.step(&to, Input::Abandon { key, generation });
            }
        }
    }

    fn load(&mut self) {
        if self.loads.is_empty() {
            return;
        }
        let i = self.rng.below(self.loads.len() as u64) as usize;
        let (id, rank) = self.loads.swap_remove(i);
        let since = self.now;
        for _ in 0..3 {
            let acts = self.step(&id, Input::Load { rank: Some(rank), since });
            let Some(Action::Fetch { key, from, fetch, .. }) =
                acts.iter().find(|a| matches!(a, Action::Fetch { .. })).cloned()
            else {
                return;
            };
            let tag = self.tag;
            let read = if self.alive.contains(&from) {
                self.step(&from, Input::Read { key, by: Some((id.clone(), tag)) })
            } else {
                vec![]
            };
            let Some(Action::Read { ticket, world, len, .. }) = read.first().cloned() else {
                let e = Input::FetchFailed {
                    key,
                    fetch,
                    generation: None,
                    from,
                    addr: String::new(),
                    error: "gone".into(),
                };
                self.step(&id, e);
                return;
            };
            let room = self.step(&id, Input::FetchRoom { key, from: from.clone(), world, len });
            if let Some((_, generation)) = granted(&room) {
                if self.step(&id, Input::FetchArrived { key, fetch, generation }).contains(&Action::Done) {
                    self.seen.fetched += 1;
                }
            }
            self.step(&from, Input::ReadDone { ticket });
        }
    }

    /// Loses a node (or, with `lose` false or a single node left, a new one joins); the members
    /// form the next round. What must be restorable then: every part of the newest committed
    /// step (and of the last plan, while a copy of each survives).
    fn reform(&mut self, honest: bool, lose: bool) {
        let floor = self.committed();
        let last_plan = self.cores[&self.alive[0]].plan().map(|p| (p.tag, p.step, p.world));
        if !lose || self.alive.len() < 2 {
            let id = format!("n{}", self.cores.len());
            let cap = self.cores[&self.alive[0]].cap();
            self.cores.insert(id.clone(), Core::new(cap));
            self.alive.push(id);
            self.begin_round();
            return self.check_floor(honest, floor, last_plan);
        }
        let i = self.rng.below(self.alive.len() as u64) as usize;
        let lost = self.alive.remove(i);
        // Its messages go with it; copies it was sent are read no more.
        let (mine, rest): (Vec<Msg>, Vec<Msg>) = self.msgs.drain(..).partition(|m| match m {
            Msg::Copy { from, to, .. } | Msg::Complete { from, to, .. } => *from == lost || *to == lost,
            Msg::Ack { to, by, .. } => *to == lost || *by == lost,
        });
        self.msgs = rest;
        for m in mine {
            if let Msg::Copy { from, ticket, .. } = m {
                if from != lost {
                    self.step(&from, Input::ReadDone { ticket });
                }
            }
        }
        self.begin_round();
        self.check_floor(honest, floor, last_plan);
    }

    fn check_floor(&mut self, honest: bool, floor: Option<(u64, u64)>, last_plan: Option<(u64, u64, u32)>) {
        if !honest {
            return;
        }
        let plan = self.cores[&self.alive[0]].plan().map(|p| (p.tag, p.step));
        let survives = |tag: u64, step: u64, world: u32| {
            (0..world).all(|rank| self.alive.iter().any(|id| self.cores[id].holds(&Key { tag, step, rank }).is_some()))
        };
        if let Some((tag, step)) = floor {
            // One node lost: a committed step keeps a copy of every part.
            self.seen.floors_checked += 1;
            assert!(plan.is_some_and(|(_, s)| s >= step), "committed step {step} (round {tag}) lost: plan {plan:?}");
        }
        if let Some((tag, step, world)) = last_plan {
            if survives(tag, step, world) {
                assert!(plan.is_some_and(|(_, s)| s >= step), "the restored step {step} survives but plan is {plan:?}");
            }
        }
    }
}

#[test]
fn random_worlds_with_liars_slow_buddies_and_losses_in_every_phase_never_pass_the_cap_or_restore_half_a_step() {
    let mut seen = Seen::default();
    for seed in 1..400u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let nodes = 2 + rng.below(4) as usize;
        let per_node = 1 + rng.below(3) as u32;
        let cap = P * if rng.below(2) == 0 { 2 + rng.below(6) } else { 6 + rng.below(60) };
        let alive: Vec<NodeId> = (0..nodes).map(|i| format!("n{i}")).collect();
        let honest = rng.below(3) != 0;
        let liar = (!honest).then(|| alive[rng.below(nodes as u64) as usize].clone());
        let slow = (rng.below(2) == 0).then(|| alive[rng.below(nodes as u64) as usize].clone());
        let mut sim = Sim {
            rng,
            now: Instant::now(),
            cores: alive.iter().map(|id| (id.clone(), Core::new(cap))).collect(),
            alive,
            per_node,
            tag: 0,
            ranks: BTreeMap::new(),
            world: 0,
            next_step: BTreeMap::new(),
            msgs: Vec::new(),
            liar,
            slow,
            loads: Vec::new(),
            writer: 0,
            seen: Seen::default(),
        };
        sim.begin_round();
        for _ in 0..400 {
            match sim.rng.below(100) {
                0..=24 => sim.save(),
                25..=84 => {
                    for _ in 0..1 + sim.rng.below(6) {
                        sim.deliver();
                    }
                }
                85..=87 => sim.lie(),
                88..=94 => {
                    for _ in 0..1 + sim.rng.below(4) {
                        sim.load();
                    }
                }
                95..=97 => sim.reform(honest, true),
                _ => sim.reform(honest, false),
            }
            if honest {
                sim.check_replicated();
            }
        }
        let s = &sim.seen;
        seen.commits += s.commits;
        seen.full += s.full;
        seen.fetched += s.fetched;
        seen.floors_checked += s.floors_checked;
        seen.lies_refused += s.lies_refused;
        seen.freed_while_read += s.freed_while_read;
    }
    // The worlds reached every case the checks are about.
    assert!(
        seen.commits > 500
            && seen.full > 100
            && seen.fetched > 50
            && seen.floors_checked > 100
            && seen.lies_refused > 100
            && seen.freed_while_read > 10,
        "{seen:?}"
    );
}
