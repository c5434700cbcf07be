//! The node's snapshot store, decided: one pure core, `step(input, now) -> actions`.
//!
//! Everything the store decides is here: which round runs and which step it restores (the
//! [`plan`](super::holdings::plan)), whether a save, a copy from a member or a fetch gets room
//! under the cap and which buffer it reuses ([`Holdings`]), when a step is committed (the
//! [`Ledger`]), who the buddy is ([`buddies`], the one ring), when this node tells the others a
//! step is whole and whom it passes over, which member a part is fetched from and by when, and
//! what every buffer still counts against the cap (parts held or being written, and parts freed
//! while a copy or a fetch still reads them). `snapstore` and `peers` carry the actions out:
//! they move descriptors and bytes and feed back what happened, and wait only until the
//! deadlines the actions name. No I/O, no clock of its own: tests drive it with made-up
//! instants and events in every order.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::time::{Duration, Instant};

use super::error::SnapError;
use super::holdings::{self, Have, Holdings, Key, Plan};
use super::{buddies, Event, Ledger, NodeId};

/// How long a save or load waits for a round to begin before it is refused.
pub const PLAN_WAIT: Duration = Duration::from_secs(120);
/// How long a fetch of the plan's part may take, retries included (the holder may still be
/// starting the round).
pub const FETCH_WITHIN: Duration = Duration::from_secs(20);
/// A member that did not answer an announcement is passed over for this long.
pub const QUIET_AFTER_FAILURE: Duration = Duration::from_secs(5);

/// Who writes a reserved part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// A worker, on its connection (numbered by the I/O).
    Worker(u64),
    /// A member's copy for this node, its bytes arriving.
    Copy,
    /// The plan's part fetched from a member.
    Fetch,
}

/// A member of a round as the core sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundMember {
    pub id: NodeId,
    pub ranks: Range<u32>,
    /// The parts it listed as it joined.
    pub inventory: Vec<Have>,
    /// Whether it can hold snapshots (an address and a key to prove itself with).
    pub fit: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A round (or a fixed attempt) with this node alone in it.
    LocalRound { tag: u64, world: u32, ranks: Range<u32> },
    /// A round of several members, the same list on every node.
    PeerRound { tag: u64, me: NodeId, members: Vec<RoundMember> },
    /// The workers are stopped: nothing is saved until the next round.
    EndRound,
    /// A worker asks room for its rank's part of `step`; asked first at `since`.
    Reserve { writer: u64, step: u64, rank: u32, world: u32, len: u64, since: Instant },
    /// A worker wrote what it reserved.
    Commit { writer: u64, step: u64, rank: u32 },
    /// A worker's connection closed: what it reserved and never committed goes.
    WriterGone { writer: u64 },
    /// A reservation whose bytes will not come (its buffer could not be made, a transfer cut):
    /// the one [`Action::Make`] granted as `generation` (a later reservation of the same key is
    /// never touched by a stale report).
    Abandon { key: Key, generation: u64 },
    /// Bytes of a whole part wanted: by a member (`by`: its id and the round its hello named),
    /// or by this node's copy to the buddy (`None`).
    Read { key: Key, by: Option<(NodeId, u64)> },
    /// A read ([`Action::Read`]) let go of its buffer.
    ReadDone { ticket: u64 },
    /// The buddy holds `key`'s copy.
    CopyAcked { key: Key, by: NodeId },
    /// A member offers a copy for this node (a hello proved it `from`, a member of `round`).
    Offer { from: NodeId, round: u64, key: Key, world: u32, len: u64 },
    /// An offered copy's bytes are in, in the buffer granted as `generation`.
    CopyArrived { key: Key, generation: u64 },
    /// `from` says every part its ranks saved for `step` is held on it and on its buddy.
    Complete { from: NodeId, round: u64, tag: u64, step: u64 },
    /// A worker loads the round's snapshot; asked first at `since`.
    Load { rank: Option<u32>, since: Instant },
    /// A fetch's holder answered: the part is `len` bytes of a world of `world`.
    FetchRoom { key: Key, from: NodeId, world: u32, len: u64 },
    /// Fetch `fetch`'s bytes are in, in the buffer granted as `generation`.
    FetchArrived { key: Key, fetch: u64, generation: u64 },
    /// Fetch `fetch` failed, retries included; `generation`: the room it had been granted.
    FetchFailed { key: Key, fetch: u64, generation: Option<u64>, from: NodeId, addr: String, error: String },
    /// A member did not take an announcement.
    AnnounceFailed { node: NodeId },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The request is refused.
    Refuse(SnapError),
    /// Ask again when something changes, or at `until` at the latest.
    Wait { until: Instant },
    /// The request is done.
    Done,
    /// A load's answer without a part: the step restored and its world (none: nothing is).
    Restore { step: Option<u64>, world: Option<u32> },
    /// Give the request a buffer of `len` bytes for `key`: `reuse`'s, else a new one. Reports
    /// about it name `generation`.
    Make { key: Key, len: u64, reuse: Option<Key>, generation: u64 },
    /// Forget `key`'s buffer.
    Free(Key),
    /// Seal `key`'s buffer: nothing writes it again.
    Seal(Key),
    /// Hand the worker a read-only descriptor of `key`'s part.
    Lend { key: Key, step: u64, world: u32, len: u64 },
    /// Hand `key`'s bytes to the reader; report [`Input::ReadDone`] with `ticket` after.
    Read { ticket: u64, key: Key, world: u32, len: u64 },
    /// Fetch `key` from member `from`, giving up at `until`; its reports name `fetch`.
    Fetch { key: Key, from: NodeId, until: Instant, fetch: u64 },
    /// Copy `key` to the buddy `to` (in the background).
    Copy { key: Key, to: NodeId },
    /// Tell `to` that `step` of round `tag` is whole here and on the buddy.
    Announce { tag: u64, step: u64, to: Vec<NodeId> },
    /// For the accounting: a worker saved its part.
    Saved { rank: u32, step: u64 },
    /// A step of the round is committed.
    Committed { step: u64 },
    /// The round restores this plan (or nothing).
    Planned(Option<Plan>),
    /// A member that cannot hold snapshots: nothing is restored, no step commits.
    Unfit(NodeId),
    /// This node is not among the round's members.
    NotAMember,
    /// A reservation its writer left unwritten.
    Abandoned(Key),
}

#[derive(Debug, Clone)]
struct Round {
    tag: u64,
    world: u32,
    /// This node's ranks.
    ranks: Range<u32>,
    me: NodeId,
    /// Several members (the round's peers known), not a node alone.
    peered: bool,
    ledger: Ledger,
    plan: Option<Plan>,
    members: Vec<RoundMember>,
    buddy: BTreeMap<NodeId, NodeId>,
    /// Per step of this round: this node's ranks whose part the buddy acknowledged.
    acked: BTreeMap<u64, BTreeSet<u32>>,
}

impl Round {
    fn member(&self, id: &str) -> Option<&RoundMember> {
        self.members.iter().find(|m| m.id == id)
    }
}

#[derive(Debug, Clone)]
struct Reading {
    key: Key,
    generation: u64,
    charge: u64,
}

/// The store's state. See the module's notes.
#[derive(Debug, Clone)]
pub struct Core {
    holdings: Holdings,
    round: Option<Round>,
    /// Each part's generation: a new one at each reservation, so a read of a part freed and
    /// reserved again under the same key is still told apart.
    generation: BTreeMap<Key, u64>,
    next: u64,
    writers: BTreeMap<Key, Writer>,
    /// Lent to a worker (it maps them) or sealed: never written again.
    fixed: BTreeSet<Key>,
    reads: BTreeMap<u64, Reading>,
    /// Parts fetched now, and by which fetch.
    fetching: BTreeMap<Key, u64>,
    /// Rooms of fetches of an earlier round, still written by their fetch: counted (by
    /// generation) until it reports, no longer holding their key.
    orphans: BTreeMap<u64, u64>,
    quiet: BTreeMap<NodeId, Instant>,
}

fn charge(len: u64) -> u64 {
    len.max(holdings::MIN_CHARGE)
}

impl Core {
    pub fn new(cap: u64) -> Core {
        Core {
            holdings: Holdings::new(cap),
            round: None,
            generation: BTreeMap::new(),
            next: 0,
            writers: BTreeMap::new(),
            fixed: BTreeSet::new(),
            reads: BTreeMap::new(),
            fetching: BTreeMap::new(),
            orphans: BTreeMap::new(),
            quiet: BTreeMap::new(),
        }
    }

    /// The whole parts held, as this node joins a round.
    pub fn inventory(&self) -> Vec<Have> {
        self.holdings.inventory()
    }

    /// The round running: its tag and this node's id in it.
    pub fn running(&self) -> Option<(u64, &NodeId)> {
        self.round.as_ref().map(|r| (r.tag, &r.me))
    }

    /// Whether `node` is a member of round `tag`, the one this node runs (a peer's hello).
    pub fn admits(&self, tag: u64, node: &str) -> bool {
        self.round.as_ref().is_some_and(|r| r.tag == tag && r.peered && r.member(node).is_some())
    }

    /// Bytes counted against the cap: the parts held or being written, and the parts freed while
    /// someone still reads them.
    pub fn used(&self) -> u64 {
        self.holdings.used() + self.outside()
    }

    pub fn cap(&self) -> u64 {
        self.holdings.cap
    }

    /// The whole part `key`, when held here.
    pub fn holds(&self, key: &Key) -> Option<holdings::Part> {
        self.holdings.get(key).copied().filter(|p| p.whole)
    }

    /// The newest committed step of the round running.
    pub fn last_committed(&self) -> Option<u64> {
        self.round.as_ref()?.ledger.last_committed()
    }

    /// The plan of the round running.
    pub fn plan(&self) -> Option<&Plan> {
        self.round.as_ref()?.plan.as_ref()
    }

    fn current(&self, key: &Key) -> bool {
        self.holdings.get(key).is_some()
    }

    /// Freed parts still read: their bytes stay until the reader lets go.
    pub fn outside(&self) -> u64 {
        let mut seen = BTreeSet::new();
        self.reads
            .values()
            .filter(|r| !(self.current(&r.key) && self.generation.get(&r.key) == Some(&r.generation)))
            .filter(|r| seen.insert((r.key, r.generation)))
            .map(|r| r.charge)
            .sum::<u64>()
            + self.orphans.values().sum::<u64>()
    }

    /// Parts held now that someone reads.
    fn read_now(&self) -> BTreeSet<Key> {
        self.reads
            .values()
            .filter(|r| self.current(&r.key) && self.generation.get(&r.key) == Some(&r.generation))
            .map(|r| r.key)
            .collect()
    }

    fn forget(&mut self, key: &Key, acts: &mut Vec<Action>) {
        self.generation.remove(key);
        self.writers.remove(key);
        self.fixed.remove(key);
        acts.push(Action::Free(*key));
    }

    pub fn step(&mut self, input: Input, now: Instant) -> Vec<Action> {
        let mut acts = Vec::new();
        match input {
            Input::LocalRound { tag, world, ranks } => {
                let me: NodeId = "local".into();
                let member =
                    RoundMember { id: me.clone(), ranks: ranks.clone(), inventory: self.inventory(), fit: false };
                let runs = ranks.clone().map(|r| (r, me.clone())).collect();
                let inventories = BTreeMap::from([(me.clone(), member.inventory.clone())]);
                let plan = holdings::plan(&inventories, &runs, 1);
                let home = (0..world).map(|r| (r, me.clone())).collect();
                self.begin(tag, world, ranks, me, false, home, vec![member], plan, &mut acts);
            }
            Input::PeerRound { tag, me, members } => {
                let Some(mine) = members.iter().find(|m| m.id == me) else {
                    self.round = None;
                    acts.push(Action::NotAMember);
                    return acts;
                };
                let ranks = mine.ranks.clone();
                let mut inventories: BTreeMap<NodeId, Vec<Have>> = BTreeMap::new();
                let mut home: BTreeMap<u32, NodeId> = BTreeMap::new();
                for m in &members {
                    inventories.insert(m.id.clone(), m.inventory.clone());
                    for r in m.ranks.clone() {
                        home.insert(r, m.id.clone());
                    }
                }
                // Every member must hold snapshots, or its ranks would start afresh while the
                // others restore: a mix.
                let plan = match members.iter().find(|m| !m.fit) {
                    Some(m) => {
                        acts.push(Action::Unfit(m.id.clone()));
                        None
                    }
                    None => holdings::plan(&inventories, &home, 2),
                };
                let world = home.len() as u32;
                self.begin(tag, world, ranks, me, true, home, members, plan, &mut acts);
            }
            Input::EndRound => self.round = None,
            Input::Reserve { writer, step, rank, world, len, since } => {
                let Some(round) = &self.round else { return wait(since, now, PLAN_WAIT, SnapError::NoRound) };
                if !round.peered && round.ranks.len() < round.world as usize {
                    acts.push(Action::Refuse(SnapError::CannotAgree {
                        most_nodes: rlaunch::contract::MAX_SNAPSHOT_NODES,
                    }));
                } else if !round.ranks.contains(&rank) || world != round.world {
                    acts.push(Action::Refuse(SnapError::NotThisNodesRank {
                        rank,
                        world,
                        ranks: round.ranks.clone(),
                        round_world: round.world,
                    }));
                } else {
                    let key = Key { tag: round.tag, step, rank };
                    self.make(key, world, len, Writer::Worker(writer), &mut acts);
                }
            }
            Input::Commit { writer, step, rank } => self.commit(writer, step, rank, &mut acts),
            Input::WriterGone { writer } => {
                let left: Vec<Key> =
                    self.writers.iter().filter(|(_, w)| **w == Writer::Worker(writer)).map(|(k, _)| *k).collect();
                for key in left {
                    self.abandon(key, &mut acts);
                    acts.push(Action::Abandoned(key));
                }
            }
            Input::Abandon { key, generation } => {
                self.orphans.remove(&generation);
                if self.is(key, generation) {
                    self.abandon(key, &mut acts);
                }
            }
            Input::Read { key, by } => {
                let allowed = match &by {
                    None => true,
                    // A member reads parts of the round its hello named, or older ones (a
                    // restore), while that round is this node's.
                    Some((_, round)) => self.round.as_ref().is_some_and(|r| r.tag == *round) && key.tag <= *round,
                };
                match self.holds(&key).filter(|_| allowed) {
                    Some(part) => {
                        let ticket = self.next;
                        self.next += 1;
                        let generation = self.generation.get(&key).copied().unwrap_or_default();
                        self.reads.insert(ticket, Reading { key, generation, charge: charge(part.len) });
                        acts.push(Action::Read { ticket, key, world: part.world, len: part.len });
                    }
                    None => {
                        acts.push(Action::Refuse(SnapError::NotHeld { rank: key.rank, step: key.step, tag: key.tag }))
                    }
                }
            }
            Input::ReadDone { ticket } => {
                self.reads.remove(&ticket);
            }
            Input::CopyAcked { key, by } => self.acked(key, by, now, &mut acts),
            Input::Offer { from, round, key, world, len } => {
                let why = match &self.round {
                    Some(r) if r.tag == round && key.tag == round && r.peered => {
                        if r.buddy.get(&from) != Some(&r.me) {
                            Some(SnapError::NotBuddy { node: from.clone() })
                        } else if !r.member(&from).is_some_and(|m| m.ranks.contains(&key.rank)) {
                            Some(SnapError::NotTheirRank { rank: key.rank, node: from.clone() })
                        } else if world != r.world {
                            Some(SnapError::WorldMismatch { world, round, round_world: r.world })
                        } else {
                            None
                        }
                    }
                    _ => Some(SnapError::OtherRound { tag: key.tag }),
                };
                match why {
                    Some(e) => acts.push(Action::Refuse(e)),
                    None => self.make(key, world, len, Writer::Copy, &mut acts),
                }
            }
            Input::CopyArrived { key, generation } => {
                let ours = self.round.as_ref().is_some_and(|r| r.tag == key.tag) && self.is(key, generation);
                if ours && self.writers.get(&key) == Some(&Writer::Copy) && self.holdings.commit(&key) {
                    self.writers.remove(&key);
                    // Written by this agent alone, and never again: sealed.
                    self.fixed.insert(key);
                    acts.push(Action::Seal(key));
                    let me = self.round.as_ref().map(|r| r.me.clone()).expect("checked above");
                    self.heard(key.tag, [Event::Held { step: key.step, rank: key.rank, node: me }], &mut acts);
                    acts.push(Action::Done);
                } else {
                    if self.is(key, generation) {
                        self.abandon(key, &mut acts);
                    }
                    acts.push(Action::Refuse(SnapError::RoundEnded));
                }
            }
            Input::Complete { from, round, tag, step } => {
                let events = self.round.as_ref().filter(|r| r.tag == tag && tag == round).and_then(|r| {
                    let ranks = r.member(&from)?.ranks.clone();
                    let buddy = r.buddy.get(&from)?.clone();
                    Some(
                        ranks
                            .flat_map(|rank| {
                                [
                                    Event::Held { step, rank, node: from.clone() },
                                    Event::Held { step, rank, node: buddy.clone() },
                                ]
                            })
                            .collect::<Vec<_>>(),
                    )
                });
                if let Some(events) = events {
                    self.heard(tag, events, &mut acts);
                }
                acts.push(Action::Done);
            }
            Input::Load { rank, since } => self.load(rank, since, now, &mut acts),
            Input::FetchRoom { key, from, world, len } => {
                let plan = self.plan().filter(|p| p.tag == key.tag && p.step == key.step).cloned();
                match plan {
                    None => acts.push(Action::Refuse(SnapError::RoundEnded)),
                    Some(p) if p.world != world => {
                        acts.push(Action::Refuse(SnapError::OtherWorld { node: from, world, want: p.world }))
                    }
                    Some(_) => self.make(key, world, len, Writer::Fetch, &mut acts),
                }
            }
            Input::FetchArrived { key, fetch, generation } => {
                self.fetched(key, fetch);
                self.orphans.remove(&generation);
                let planned = self.plan().is_some_and(|p| p.tag == key.tag && p.step == key.step);
                let mine = self.is(key, generation) && self.writers.get(&key) == Some(&Writer::Fetch);
                if planned && mine && self.holdings.commit(&key) {
                    self.writers.remove(&key);
                    self.fixed.insert(key);
                    acts.push(Action::Seal(key));
                    acts.push(Action::Done);
                } else {
                    if mine {
                        self.abandon(key, &mut acts);
                    }
                    acts.push(Action::Refuse(SnapError::RoundEnded));
                }
            }
            Input::FetchFailed { key, fetch, generation, from, addr, error } => {
                self.fetched(key, fetch);
                if let Some(g) = generation {
                    self.orphans.remove(&g);
                }
                if generation.is_some_and(|g| self.is(key, g)) && self.writers.get(&key) == Some(&Writer::Fetch) {
                    self.abandon(key, &mut acts);
                }
                // Another load of the same part may have brought it meanwhile.
                if self.holds(&key).is_none() {
                    acts.push(Action::Refuse(SnapError::Fetch {
                        rank: key.rank,
                        step: key.step,
                        node: from,
                        addr,
                        error,
                    }));
                }
            }
            Input::AnnounceFailed { node } => {
                self.quiet.insert(node, now + QUIET_AFTER_FAILURE);
            }
        }
        acts
    }

    #[allow(clippy::too_many_arguments)]
    fn begin(
        &mut self,
        tag: u64,
        world: u32,
        ranks: Range<u32>,
        me: NodeId,
        peered: bool,
        home: BTreeMap<u32, NodeId>,
        members: Vec<RoundMember>,
        plan: Option<Plan>,
        acts: &mut Vec<Action>,
    ) {
        for k in self.holdings.begin_round(tag, plan.as_ref().map(|p| (p.tag, p.step))) {
            self.forget(&k, acts);
        }
        // Fetches of an earlier round are no longer waited for, and the rooms they write stop
        // holding their key (this round's fetch of the same part gets room of its own); their
        // bytes count until each reports.
        self.fetching.clear();
        let stale: Vec<Key> = self.writers.iter().filter(|(_, w)| **w == Writer::Fetch).map(|(k, _)| *k).collect();
        for key in stale {
            let charge = self.holdings.get(&key).map_or(0, |p| charge(p.len));
            if let Some(generation) = self.generation.get(&key).copied() {
                self.orphans.insert(generation, charge);
            }
            self.holdings.abandon(&key);
            self.forget(&key, acts);
        }
        let order: Vec<NodeId> = members.iter().map(|m| m.id.clone()).collect();
        acts.push(Action::Planned(plan.clone()));
        self.round = Some(Round {
            tag,
            world,
            ranks,
            me,
            peered,
            ledger: Ledger::new(home),
            plan,
            members: members.into_iter().map(|m| RoundMember { inventory: Vec::new(), ..m }).collect(),
            buddy: if peered { buddies(&order) } else { BTreeMap::new() },
            acked: BTreeMap::new(),
        });
    }

    /// Room under the cap for `key`, written by `writer`.
    fn make(&mut self, key: Key, world: u32, len: u64, writer: Writer, acts: &mut Vec<Action>) {
        let local = self.round.as_ref().map_or(0..0, |r| r.ranks.clone());
        self.holdings.outside = self.outside();
        let read = self.read_now();
        let no_reuse: BTreeSet<Key> = read.union(&self.fixed).copied().collect();
        match self.holdings.reserve(key, world, len, &local, &read, &no_reuse) {
            Err(e) => acts.push(Action::Refuse(e)),
            Ok(grant) => {
                for k in &grant.free {
                    self.forget(k, acts);
                }
                if let Some(r) = &grant.reuse {
                    self.generation.remove(r);
                    self.writers.remove(r);
                    self.fixed.remove(r);
                }
                let generation = self.next;
                self.next += 1;
                self.generation.insert(key, generation);
                self.writers.insert(key, writer);
                acts.push(Action::Make { key, len, reuse: grant.reuse, generation });
            }
        }
    }

    /// Whether `generation` is `key`'s reservation now.
    fn is(&self, key: Key, generation: u64) -> bool {
        self.generation.get(&key) == Some(&generation)
    }

    /// Fetch `fetch` of `key` is over: a later fetch of the same key stays waited for.
    fn fetched(&mut self, key: Key, fetch: u64) {
        if self.fetching.get(&key) == Some(&fetch) {
            self.fetching.remove(&key);
        }
    }

    fn abandon(&mut self, key: Key, acts: &mut Vec<Action>) {
        self.holdings.abandon(&key);
        self.writers.remove(&key);
        if self.holdings.get(&key).is_none() && self.generation.contains_key(&key) {
            self.forget(&key, acts);
        }
    }

    fn commit(&mut self, writer: u64, step: u64, rank: u32, acts: &mut Vec<Action>) {
        let Some(round) = &self.round else {
            acts.push(Action::Refuse(SnapError::RoundEnded));
            return;
        };
        let (tag, me) = (round.tag, round.me.clone());
        let key = Key { tag, step, rank };
        if self.writers.get(&key) != Some(&Writer::Worker(writer)) || !self.holdings.commit(&key) {
            acts.push(Action::Refuse(SnapError::NotReserved { rank, step }));
            return;
        }
        self.writers.remove(&key);
        acts.push(Action::Saved { rank, step });
        self.heard(tag, [Event::Held { step, rank, node: me.clone() }], acts);
        let round = self.round.as_ref().expect("checked above");
        if let Some(to) = round.buddy.get(&me).filter(|b| round.member(b).is_some_and(|m| m.fit)) {
            acts.push(Action::Copy { key, to: to.clone() });
        }
        acts.push(Action::Done);
    }

    /// Feeds round `tag`'s ledger; a newly committed step becomes the base.
    fn heard(&mut self, tag: u64, events: impl IntoIterator<Item = Event>, acts: &mut Vec<Action>) {
        let Some(round) = self.round.as_mut().filter(|r| r.tag == tag) else { return };
        let before = round.ledger.last_committed();
        for e in events {
            round.ledger.apply(e);
        }
        let after = round.ledger.last_committed();
        if let (Some(c), true) = (after, after != before) {
            self.holdings.committed(tag, c);
            acts.push(Action::Committed { step: c });
        }
    }

    fn acked(&mut self, key: Key, by: NodeId, now: Instant, acts: &mut Vec<Action>) {
        self.heard(key.tag, [Event::Held { step: key.step, rank: key.rank, node: by }], acts);
        let Some(round) = self.round.as_mut().filter(|r| r.tag == key.tag) else { return };
        let done = round.acked.entry(key.step).or_default();
        done.insert(key.rank);
        if !round.ranks.clone().all(|r| done.contains(&r)) {
            return;
        }
        round.acked.retain(|s, _| *s > key.step);
        self.quiet.retain(|_, until| *until > now);
        let to: Vec<NodeId> = round
            .members
            .iter()
            .filter(|m| m.id != round.me && m.fit && !self.quiet.contains_key(&m.id))
            .map(|m| m.id.clone())
            .collect();
        acts.push(Action::Announce { tag: key.tag, step: key.step, to });
    }

    fn load(&mut self, rank: Option<u32>, since: Instant, now: Instant, acts: &mut Vec<Action>) {
        let Some(round) = &self.round else {
            acts.extend(wait(since, now, PLAN_WAIT, SnapError::NoRound));
            return;
        };
        let Some(plan) = round.plan.clone() else {
            acts.push(Action::Restore { step: None, world: None });
            return;
        };
        let Some(rank) = rank else {
            acts.push(Action::Refuse(SnapError::NoRankNamed));
            return;
        };
        let Some(from) = plan.from.get(&rank).cloned() else {
            // A rank the saved world did not have (the world grew): the step, and no part; the
            // program reads the saved ranks' parts to reshard.
            acts.push(Action::Restore { step: Some(plan.step), world: Some(plan.world) });
            return;
        };
        let key = Key { tag: plan.tag, step: plan.step, rank };
        if let Some(part) = self.holds(&key) {
            self.fixed.insert(key);
            acts.push(Action::Lend { key, step: plan.step, world: part.world, len: part.len });
        } else if !round.peered {
            acts.push(Action::Refuse(SnapError::NotHere { rank, step: plan.step }));
        } else if !round.member(&from).is_some_and(|m| m.fit) {
            acts.push(Action::Refuse(SnapError::Unreachable { node: from, rank, step: plan.step }));
        } else if self.fetching.contains_key(&key) {
            // Another load fetches it now: this one takes it when it is here.
            acts.extend(wait(
                since,
                now,
                FETCH_WITHIN,
                SnapError::Fetch {
                    rank,
                    step: plan.step,
                    node: from,
                    addr: String::new(),
                    error: "another load of the same part did not bring it in time".into(),
                },
            ));
        } else {
            let fetch = self.next;
            self.next += 1;
            self.fetching.insert(key, fetch);
            acts.push(Action::Fetch { key, from, until: now + FETCH_WITHIN, fetch });
        }
    }
}

/// Wait for a change until `since + within`; refused with `late` past it.
fn wait(since: Instant, now: Instant, within: Duration, late: SnapError) -> Vec<Action> {
    let until = since + within;
    if now >= until {
        vec![Action::Refuse(late)]
    } else {
        vec![Action::Wait { until }]
    }
}

#[cfg(test)]
mod tests;
