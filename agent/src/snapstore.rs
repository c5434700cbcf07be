//! The node's snapshot store: the Unix socket the workers save to and load from
//! (`rlaunch::snapshot`'s wire), the memfds that hold the parts, and the round's plan. What to
//! keep, what to free and which step a round restores are decided by the pure
//! [`crate::snapshots`]; this file only carries those decisions out.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rlaunch::contract::{HostPort, Member, SnapshotSet};
use rlaunch::snapshot::{recv_frame, send_frame, Answer, Request, SOCKET_ENV};
use tracing::{info, warn};

use crate::snapshots::holdings::{self, Have, Holdings, Key, Plan};
use crate::snapshots::{Event, Ledger, NodeId};

/// The Python package (`import rlaunch`), written beside the socket and put on the workers'
/// `PYTHONPATH`, so a job started by an `rlaunch` installed any way finds it.
const PY_INIT: &str = include_str!("../../python/rlaunch/__init__.py");
const PY_SNAPSHOT: &str = include_str!("../../python/rlaunch/snapshot.py");

/// The workers' socket, in the store's directory.
const SOCKET_FILE: &str = "agent.sock";

/// How long a save or load waits for the round's plan before it is refused.
const PLAN_WAIT: Duration = Duration::from_secs(120);

/// The node's default cap: a quarter of its memory.
pub fn default_cap() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        })
        .unwrap_or(4 << 20);
    total * 1024 / 4
}

mod peers;
mod secure;

pub struct SnapStore {
    /// `--snapshot-memory 0`: only the package is offered (so `import rlaunch` works), no socket.
    enabled: bool,
    shared: Arc<Shared>,
    dir: crate::rundir::RunDir,
    socket: PathBuf,
}

pub(crate) struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    /// Copies to send and commits to announce, in order (the replicator thread).
    outbox: std::sync::mpsc::Sender<peers::Job>,
    /// The round's progress (steps saved and restored), for the recovery accounting.
    progress: Arc<crate::progress::Tracker>,
    /// This agent's key pair: the other members' agents know its public half from the round.
    /// Made when first needed (serving peers): the crypto library's first use costs about 30 ms,
    /// which a one-node job never pays.
    identity: std::sync::OnceLock<Arc<secure::Identity>>,
}

struct State {
    holdings: Holdings,
    /// Each part's buffer (whole or being written).
    buffers: BTreeMap<Key, Arc<std::fs::File>>,
    /// Parts handed to a worker by `load`: it maps them, so their buffers are never written again.
    lent: BTreeSet<Key>,
    /// Buffers no longer held but still read (a copy being sent, a fetch): counted against the
    /// cap until the last reader lets go.
    draining: Vec<(Arc<std::fs::File>, u64)>,
    round: Option<Round>,
}

struct Round {
    tag: u64,
    world: u32,
    ranks: std::ops::Range<u32>,
    me: NodeId,
    ledger: Ledger,
    /// `None` while the members' inventories are gathered.
    plan: Option<Option<Plan>>,
    /// The other members, when the round has any.
    peers: Option<Peers>,
    /// Per step of this round: this node's ranks whose part the buddy acknowledged.
    acked: BTreeMap<u64, BTreeSet<u32>>,
}

/// A round's members as the snapshot store sees them.
#[derive(Clone)]
pub(crate) struct Peers {
    pub members: Vec<PeerMember>,
    /// Index of this node's buddy in `members`.
    pub buddy: usize,
}

#[derive(Clone)]
pub(crate) struct PeerMember {
    pub id: NodeId,
    pub addr: Option<HostPort>,
    /// Its public key (`Member::snapshot_key`), which it proves itself with.
    pub key: Option<[u8; secure::KEY_LEN]>,
    pub ranks: std::ops::Range<u32>,
}

impl PeerMember {
    /// How to reach and recognise it; `None` when it cannot hold snapshots.
    pub(crate) fn peer(&self) -> Option<peers::Peer> {
        Some(peers::Peer { id: self.id.clone(), addr: self.addr.clone()?, key: self.key? })
    }
}

impl Peers {
    fn member(&self, id: &str) -> Option<&PeerMember> {
        self.members.iter().find(|m| m.id == id)
    }

    /// Whose parts a member's copies are: the member before it in the ring.
    fn buddy_of(&self, id: &str) -> Option<&PeerMember> {
        let i = self.members.iter().position(|m| m.id == id)?;
        self.members.get((i + 1) % self.members.len())
    }
}

impl SnapStore {
    /// A store holding at most `cap` bytes (0: none, only the package), its socket in a new
    /// directory only this user enters.
    pub fn start(cap: u64, progress: Arc<crate::progress::Tracker>) -> std::io::Result<SnapStore> {
        // In a directory no other user may swap (the package runs in every worker), short
        // enough for the socket.
        let dir = crate::rundir::RunDir::create("rlaunch-snap", SOCKET_FILE.len())?;
        let py = dir.path().join("python").join("rlaunch");
        std::fs::create_dir_all(&py)?;
        std::fs::write(py.join("__init__.py"), PY_INIT)?;
        std::fs::write(py.join("snapshot.py"), PY_SNAPSHOT)?;
        let socket = dir.path().join(SOCKET_FILE);
        let listener = UnixListener::bind(&socket)?;
        let (outbox, jobs) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                holdings: Holdings::new(cap),
                buffers: BTreeMap::new(),
                lent: BTreeSet::new(),
                draining: Vec::new(),
                round: None,
            }),
            changed: Condvar::new(),
            outbox,
            progress,
            identity: std::sync::OnceLock::new(),
        });
        let s = shared.clone();
        std::thread::Builder::new().name("snapshots".into()).spawn(move || accept(listener, s))?;
        let s = Arc::downgrade(&shared);
        std::thread::Builder::new().name("snapshot-copies".into()).spawn(move || peers::replicate(jobs, s))?;
        Ok(SnapStore { enabled: cap > 0, shared, dir, socket })
    }

    /// What every worker's environment gets: the socket, and the package on `PYTHONPATH` (after
    /// what the agent's environment has there).
    pub fn worker_env(&self, agent_env: &BTreeMap<String, String>) -> Vec<(&'static str, String)> {
        let py = self.dir.path().join("python").to_string_lossy().into_owned();
        let path = match agent_env.get("PYTHONPATH").filter(|p| !p.is_empty()) {
            Some(p) => format!("{p}:{py}"),
            None => py,
        };
        let mut env = vec![("PYTHONPATH", path)];
        if self.enabled {
            env.push((SOCKET_ENV, self.socket.to_string_lossy().into_owned()));
        }
        env
    }

    /// The public half of this agent's key, as its join carries it (`NodeInfo::snapshot_key`).
    pub fn public_key(&self) -> std::io::Result<String> {
        Ok(self.shared.identity()?.public_hex())
    }

    /// Whether snapshots are held (`--snapshot-memory` above 0).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// A round (or fixed attempt) `tag` starts with `world` ranks, `ranks` of them here, this node
    /// alone in it: the plan comes from what this node holds.
    pub fn begin_local_round(&self, tag: u64, world: u32, ranks: std::ops::Range<u32>) {
        let me: NodeId = "local".into();
        let mut st = self.shared.lock();
        let runs: BTreeMap<u32, NodeId> = ranks.clone().map(|r| (r, me.clone())).collect();
        let inventories = BTreeMap::from([(me.clone(), st.holdings.inventory())]);
        let plan = holdings::plan(&inventories, &runs, 1);
        let free = st.holdings.begin_round(tag, plan.as_ref().map(|p| (p.tag, p.step)));
        st.release(&free);
        match &plan {
            Some(p) => {
                info!(step = p.step, saved_in_round = p.tag, "this round restores the snapshot of step {}", p.step)
            }
            None => tracing::debug!("no snapshot to restore"),
        }
        let home = (0..world).map(|r| (r, me.clone())).collect();
        st.round = Some(Round {
            tag,
            world,
            ranks,
            me,
            ledger: Ledger::new(home),
            plan: Some(plan),
            peers: None,
            acked: BTreeMap::new(),
        });
        drop(st);
        self.shared.changed.notify_all();
    }

    /// A round `tag` of several members starts: the plan comes from the parts every member
    /// listed as it joined (the same list on every node, so the same plan), each part is
    /// copied to this node's buddy (the next member), and the members tell each other which
    /// steps are whole on their node and its buddy.
    pub fn begin_peer_round(&self, tag: u64, me: &str, members: &[Member]) {
        let mut inventories: BTreeMap<NodeId, Vec<Have>> = BTreeMap::new();
        let mut runs: BTreeMap<u32, NodeId> = BTreeMap::new();
        let mut home: BTreeMap<u32, NodeId> = BTreeMap::new();
        for m in members {
            inventories.insert(m.node_id.clone(), from_sets(&m.snapshots));
            for r in m.rank_offset..m.rank_offset.saturating_add(m.local_world_size) {
                runs.insert(r, m.node_id.clone());
                home.insert(r, m.node_id.clone());
            }
        }
        // Every member must hold snapshots, or its ranks would start afresh while the others
        // restore: a mix. A member without them (`--snapshot-memory 0`, an older agent) has no
        // snapshot address, or no key to prove itself with.
        let unfit = |m: &&Member| {
            m.snapshot_addr.is_none() || m.snapshot_key.as_deref().and_then(secure::parse_public).is_none()
        };
        let plan = match members.iter().find(unfit) {
            Some(m) => {
                warn!(node = %m.node_id, "a member of this round holds no snapshots: nothing is restored, and no step commits");
                None
            }
            None => holdings::plan(&inventories, &runs, 2),
        };
        let peer_members: Vec<PeerMember> = members
            .iter()
            .map(|m| PeerMember {
                id: m.node_id.clone(),
                addr: m.snapshot_addr.clone(),
                key: m.snapshot_key.as_deref().and_then(secure::parse_public),
                ranks: m.rank_offset..m.rank_offset.saturating_add(m.local_world_size),
            })
            .collect();
        let Some(i) = peer_members.iter().position(|m| m.id == me) else {
            warn!("this node is not among the round's members: snapshots are not restored");
            return;
        };
        let world = home.len() as u32;
        let ranks = peer_members[i].ranks.clone();
        let buddy = (i + 1) % peer_members.len();
        let mut st = self.shared.lock();
        let free = st.holdings.begin_round(tag, plan.as_ref().map(|p| (p.tag, p.step)));
        st.release(&free);
        match &plan {
            Some(p) => info!(
                step = p.step,
                saved_in_round = p.tag,
                from = ?p.from.values().collect::<BTreeSet<_>>(),
                "this round restores the snapshot of step {}",
                p.step
            ),
            None => tracing::debug!("no snapshot to restore"),
        }
        st.round = Some(Round {
            tag,
            world,
            ranks,
            me: me.to_owned(),
            ledger: Ledger::new(home),
            plan: Some(plan),
            peers: Some(Peers { members: peer_members, buddy }),
            acked: BTreeMap::new(),
        });
        drop(st);
        self.shared.changed.notify_all();
    }

    /// What this node holds, as it joins a round.
    pub fn inventory(&self) -> Vec<SnapshotSet> {
        to_sets(&self.shared.lock().holdings.inventory())
    }

    /// Serves the other members (copies, fetches, commits) on `bind`; answers the port.
    pub fn serve_peers(&self, bind: &str) -> std::io::Result<u16> {
        self.shared.identity()?;
        let listener = std::net::TcpListener::bind(bind)?;
        let port = listener.local_addr()?.port();
        let s = self.shared.clone();
        std::thread::Builder::new().name("snapshot-peers".into()).spawn(move || peers::accept(listener, s))?;
        Ok(port)
    }

    /// The workers are stopped: nothing is saved until the next round begins.
    pub fn end_round(&self) {
        self.shared.lock().round = None;
    }
}

impl Shared {
    /// This agent's key pair, made on first use.
    pub(crate) fn identity(&self) -> std::io::Result<&Arc<secure::Identity>> {
        if let Some(id) = self.identity.get() {
            return Ok(id);
        }
        let made = Arc::new(secure::Identity::generate()?);
        Ok(self.identity.get_or_init(|| made))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits (bounded) for a round whose plan is known.
    fn planned(&self) -> Result<std::sync::MutexGuard<'_, State>, String> {
        let deadline = Instant::now() + PLAN_WAIT;
        let mut st = self.lock();
        loop {
            if st.round.as_ref().is_some_and(|r| r.plan.is_some()) {
                return Ok(st);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("no round is running on this node (the workers are being stopped or started)".into());
            }
            st = self.changed.wait_timeout(st, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl State {
    fn release(&mut self, keys: &[Key]) {
        for k in keys {
            if let Some(buf) = self.buffers.remove(k) {
                self.drain(buf);
            }
            self.lent.remove(k);
        }
    }

    /// A buffer no longer held: still counted while anyone else reads it.
    fn drain(&mut self, buf: Arc<std::fs::File>) {
        if Arc::strong_count(&buf) > 1 {
            let len = buf.metadata().map(|m| m.len()).unwrap_or(0);
            self.draining.push((buf, len));
        }
    }

    /// The bytes of buffers no longer held that are still read; those let go are forgotten.
    fn outside(&mut self) -> u64 {
        self.draining.retain(|(b, _)| Arc::strong_count(b) > 1);
        self.draining.iter().map(|(_, len)| len).sum()
    }

    /// Feeds round `tag`'s ledger; a newly committed step becomes the base and frees what
    /// it makes obsolete.
    fn heard(&mut self, tag: u64, events: impl IntoIterator<Item = Event>) {
        let Some(round) = self.round.as_mut().filter(|r| r.tag == tag) else { return };
        let before = round.ledger.last_committed();
        for e in events {
            round.ledger.apply(e);
        }
        let after = round.ledger.last_committed();
        if let (Some(c), true) = (after, after != before) {
            tracing::debug!(step = c, "snapshot committed");
            self.holdings.committed(tag, c);
        }
    }
}

/// An inventory in the wire's compact form: ranks as ranges, per (tag, step, world).
pub(crate) fn to_sets(haves: &[Have]) -> Vec<SnapshotSet> {
    let mut sets: BTreeMap<(u64, u64, u32), Vec<u32>> = BTreeMap::new();
    for h in haves {
        sets.entry((h.key.tag, h.key.step, h.world)).or_default().push(h.key.rank);
    }
    sets.into_iter()
        .map(|((tag, step, world), mut ranks)| {
            ranks.sort_unstable();
            let mut ranges: Vec<(u32, u32)> = Vec::new();
            for r in ranks {
                match ranges.last_mut() {
                    Some((_, hi)) if *hi == r => *hi = r + 1,
                    _ => ranges.push((r, r + 1)),
                }
            }
            SnapshotSet { tag, step, world, ranks: ranges }
        })
        // A set too scattered to list is left out (its step is not restored from here) rather
        // than the node refused at its join.
        .filter(|s| s.ranks.len() <= rlaunch::contract::MAX_SNAPSHOT_RANGES)
        .rev() // the newest sets, where there are too many
        .take(rlaunch::contract::MAX_SNAPSHOT_SETS)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect()
}

pub(crate) fn from_sets(sets: &[SnapshotSet]) -> Vec<Have> {
    sets.iter()
        .flat_map(|s| {
            s.ranks.iter().flat_map(move |(lo, hi)| {
                (*lo..(*hi).min(s.world))
                    .map(move |rank| Have { key: Key { tag: s.tag, step: s.step, rank }, world: s.world })
            })
        })
        .collect()
}

fn accept(listener: UnixListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        match conn {
            Ok(sock) => {
                let s = shared.clone();
                if let Err(e) = std::thread::Builder::new().name("snapshot-conn".into()).spawn(move || serve(sock, s)) {
                    warn!(error = %e, "cannot serve a worker's snapshot connection");
                }
            }
            Err(e) => {
                warn!(error = %e, "snapshot socket");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// One worker's connection: requests in order; reservations it leaves unwritten are abandoned
/// when it goes.
fn serve(sock: UnixStream, shared: Arc<Shared>) {
    let mut reserved: BTreeSet<Key> = BTreeSet::new();
    loop {
        let (body, fd) = match recv_frame(&sock) {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(e) => {
                warn!(error = %e, "a worker's snapshot connection");
                break;
            }
        };
        drop(fd); // a worker never passes one
        let (answer, fd) = match serde_json::from_slice::<Request>(&body) {
            Ok(req) => handle(&shared, req, &mut reserved),
            Err(e) => (Answer::refused(format!("not a snapshot request: {e}")), None),
        };
        let body = serde_json::to_vec(&answer).expect("an answer serializes");
        if let Err(e) = send_frame(&sock, &body, fd.as_ref().map(|f| f.as_fd())) {
            tracing::debug!(error = %e, "a worker went before its answer");
            break;
        }
    }
    for k in reserved {
        abandon(&shared, k);
        warn!(rank = k.rank, step = k.step, "a worker went while saving its snapshot: that part was never held");
    }
}

fn handle(shared: &Shared, req: Request, reserved: &mut BTreeSet<Key>) -> (Answer, Option<OwnedFd>) {
    let result = match req {
        Request::Reserve { step, rank, world, len } => reserve(shared, step, rank, world, len, reserved),
        Request::Commit { step, rank } => commit(shared, step, rank, reserved).map(|()| {
            shared.progress.saved(rank, step);
            (Answer::default(), None)
        }),
        Request::Load { rank } => {
            if let Some(rank) = rank {
                shared.progress.asked(rank);
            }
            load(shared, rank)
        }
        .inspect(|(a, _)| {
            if let Some(rank) = rank {
                shared.progress.loaded(rank, a.step);
            }
        }),
    };
    match result {
        Ok((mut a, fd)) => {
            a.ok = true;
            (a, fd)
        }
        Err(why) => {
            let full = why.starts_with(holdings::NOT_SNAPSHOTTED);
            (Answer { full, ..Answer::refused(why) }, None)
        }
    }
}

type Reply = Result<(Answer, Option<OwnedFd>), String>;

fn reserve(shared: &Shared, step: u64, rank: u32, world: u32, len: u64, reserved: &mut BTreeSet<Key>) -> Reply {
    let key = {
        let st = shared.planned()?;
        let round = st.round.as_ref().expect("planned");
        if round.peers.is_none() && round.ranks.len() < round.world as usize {
            return Err(format!(
                "{}this round's nodes cannot agree on a step (a static job of several nodes, a \
                 round of more than {} nodes, or a rendezvous that answers no member list): \
                 snapshots are off",
                holdings::NOT_SNAPSHOTTED,
                rlaunch::contract::MAX_SNAPSHOT_NODES
            ));
        }
        if !round.ranks.contains(&rank) || world != round.world {
            return Err(format!(
                "rank {rank} of a world of {world}: this node runs ranks {}..{} of {} in this round",
                round.ranks.start, round.ranks.end, round.world
            ));
        }
        Key { tag: round.tag, step, rank }
    };
    let file = buffer_for(shared, key, world, len)?;
    let fd = file.as_fd().try_clone_to_owned().map_err(|e| e.to_string())?;
    reserved.insert(key);
    Ok((Answer::default(), Some(fd)))
}

/// Room and a buffer of `len` bytes for `key`'s part, reserved (not held until committed):
/// the buffer of a part that may go is reused when nobody maps or reads it.
pub(crate) fn buffer_for(shared: &Shared, key: Key, world: u32, len: u64) -> Result<Arc<std::fs::File>, String> {
    let mut st = shared.lock();
    let local = st.round.as_ref().map_or(0..0, |r| r.ranks.clone());
    st.holdings.outside = st.outside();
    let grant = st.holdings.reserve(key, world, len, &local)?;
    let reused = grant.reuse.and_then(|k| {
        let lent = st.lent.remove(&k);
        let buf = st.buffers.remove(&k)?;
        // A lent buffer is mapped by a worker (and sealed), one being copied elsewhere is read:
        // never rewrite.
        if !lent && Arc::strong_count(&buf) == 1 && !sealed(&buf) {
            Some(buf)
        } else {
            st.drain(buf);
            None
        }
    });
    st.release(&grant.free);
    let file = match reused {
        Some(f) => f,
        None => match memfd() {
            Ok(f) => Arc::new(f),
            Err(e) => {
                st.holdings.abandon(&key);
                return Err(format!("cannot make a buffer for the snapshot: {e}"));
            }
        },
    };
    if let Err(e) = file.set_len(len) {
        st.holdings.abandon(&key);
        return Err(format!("cannot size the snapshot buffer to {len} bytes: {e}"));
    }
    st.buffers.insert(key, file.clone());
    Ok(file)
}

/// A reservation whose writer went: nothing of it is held.
pub(crate) fn abandon(shared: &Shared, key: Key) {
    let mut st = shared.lock();
    st.holdings.abandon(&key);
    if st.holdings.get(&key).is_none() {
        st.release(&[key]);
    }
}

/// A copy for another node arrived whole: held here, and the ledger hears it.
pub(crate) fn commit_copy(shared: &Shared, key: Key, _from: &str) -> bool {
    let mut st = shared.lock();
    let Some(me) = st.round.as_ref().filter(|r| r.tag == key.tag).map(|r| r.me.clone()) else {
        drop(st);
        abandon(shared, key);
        return false;
    };
    if !st.holdings.commit(&key) {
        return false;
    }
    // Written by this agent alone, and never again: sealed, so nothing can change it.
    if let Some(file) = st.buffers.get(&key) {
        if let Err(e) = seal(file) {
            warn!(error = %e, "cannot seal a snapshot copy");
        }
    }
    st.heard(key.tag, [Event::Held { step: key.step, rank: key.rank, node: me }]);
    true
}

/// `key`'s part when it is held whole here: its world, length and buffer.
pub(crate) fn whole_part(shared: &Shared, key: Key) -> Option<(u32, u64, Arc<std::fs::File>)> {
    let st = shared.lock();
    let part = st.holdings.get(&key).copied().filter(|p| p.whole)?;
    Some((part.world, part.len, st.buffers.get(&key)?.clone()))
}

fn commit(shared: &Shared, step: u64, rank: u32, reserved: &mut BTreeSet<Key>) -> Result<(), String> {
    let mut st = shared.lock();
    let Some(round) = st.round.as_ref() else {
        return Err("the round ended while the snapshot was written: it is not held".into());
    };
    let (tag, me) = (round.tag, round.me.clone());
    let key = Key { tag, step, rank };
    if !reserved.remove(&key) || !st.holdings.commit(&key) {
        return Err(format!("rank {rank}'s part of step {step} was never reserved in this round"));
    }
    st.heard(tag, [Event::Held { step, rank, node: me }]);
    // A copy for the buddy, sent in the background.
    let round = st.round.as_ref().expect("checked above");
    let to = round.peers.as_ref().and_then(|p| p.members[p.buddy].peer());
    if let (Some(to), Ok(identity)) = (to, shared.identity()) {
        let me = peers::Me { round: round.tag, id: round.me.clone(), identity: identity.clone() };
        let _ = shared.outbox.send(peers::Job::Copy { key, to, me });
    }
    Ok(())
}

fn load(shared: &Shared, rank: Option<u32>) -> Reply {
    let mut st = shared.planned()?;
    let round = st.round.as_ref().expect("planned");
    let Some(plan) = round.plan.clone().flatten() else { return Ok((Answer::default(), None)) };
    let rank = rank.ok_or("a load names the rank whose part it wants")?;
    let Some(from) = plan.from.get(&rank).cloned() else {
        // A rank the saved world did not have (the world grew): the step, and no part; the
        // program reads the saved ranks' parts to reshard.
        return Ok((Answer { step: Some(plan.step), world: Some(plan.world), ..Answer::default() }, None));
    };
    let key = Key { tag: plan.tag, step: plan.step, rank };
    let held = st.holdings.get(&key).is_some_and(|p| p.whole) && st.buffers.contains_key(&key);
    if !held {
        // On another member: fetched (without the lock), then held here like a copy.
        let peers =
            round.peers.clone().ok_or_else(|| format!("rank {rank}'s part of step {} is not here", plan.step))?;
        let peer = peers.member(&from).and_then(PeerMember::peer).ok_or_else(|| {
            format!("node {from}, which holds rank {rank}'s part of step {}, cannot be reached", plan.step)
        })?;
        let identity = shared.identity().map_err(|e| format!("no key to reach other nodes with: {e}"))?;
        let me = peers::Me { round: round.tag, id: round.me.clone(), identity: identity.clone() };
        drop(st);
        // Room for the part under the cap before a byte comes, of the plan's world only.
        let room = |world: u32, len: u64| {
            if world != plan.world {
                return Err(format!("node {from} holds that part for a world of {world}, not {}", plan.world));
            }
            buffer_for(shared, key, world, len)
        };
        let fetched = peers::fetch(&peer, &me, key, room, || abandon(shared, key));
        st = shared.lock();
        let held_now = |st: &State| st.holdings.get(&key).is_some_and(|p| p.whole) && st.buffers.contains_key(&key);
        match fetched {
            Ok((_, len, file)) => {
                info!(rank, step = plan.step, from = %from, mib = len >> 20, "fetched a snapshot part from another node");
                if !st.round.as_ref().is_some_and(|r| r.plan.as_ref().is_some_and(|p| p.as_ref() == Some(&plan))) {
                    drop(st);
                    abandon(shared, key);
                    return Err("the round ended while the part was fetched".into());
                }
                if !held_now(&st) {
                    st.holdings.commit(&key);
                    let _ = seal(&file);
                }
            }
            // Another load of the same part fetched it meanwhile.
            Err(_) if held_now(&st) => {}
            Err(e) => {
                drop(st);
                abandon(shared, key);
                return Err(format!(
                    "fetching rank {rank}'s part of step {} from node {from} ({}): {e}",
                    plan.step, peer.addr
                ));
            }
        }
    }
    let (Some(file), Some(part)) = (st.buffers.get(&key).cloned(), st.holdings.get(&key).copied()) else {
        return Err(format!("rank {rank}'s part of step {} is no longer held here", plan.step));
    };
    // Sealed before it is lent: no descriptor of it, however reopened, can write it.
    let fd = lend(&file).map_err(|e| format!("cannot lend the snapshot buffer: {e}"))?;
    st.lent.insert(key);
    Ok((Answer { step: Some(plan.step), world: Some(part.world), len: Some(part.len), ..Answer::default() }, Some(fd)))
}

pub(crate) fn memfd() -> std::io::Result<std::fs::File> {
    // SAFETY: a C string literal; the returned descriptor is new and owned by the File.
    let fd = unsafe { libc::memfd_create(c"rlaunch-snapshot".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Seals a whole part: from now on no descriptor of it, whoever holds it (root included), can
/// write, grow or shrink it. Fails while a writable shared mapping of it exists.
fn seal(file: &std::fs::File) -> std::io::Result<()> {
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor the File keeps open; F_ADD_SEALS takes an int.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    // Already sealed (F_SEAL_SEAL refuses more seals): fine when it is write-sealed.
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if !sealed(file) {
            return Err(e);
        }
    }
    Ok(())
}

/// Whether a buffer is sealed against writes (a copy from another node, a part lent).
fn sealed(file: &std::fs::File) -> bool {
    // SAFETY: fcntl on a descriptor the File keeps open; F_GET_SEALS takes no argument.
    let got = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    got >= 0 && got & libc::F_SEAL_WRITE != 0
}

/// A read-only descriptor of a sealed part for a worker. Where the part cannot be sealed (its
/// writer maps it still, when a worker loads a step it saved in the same attempt), a sealed copy.
fn lend(file: &std::fs::File) -> std::io::Result<OwnedFd> {
    let sealed = match seal(file) {
        Ok(()) => None,
        Err(_) => {
            let copy = memfd()?;
            let len = file.metadata()?.len();
            copy.set_len(len)?;
            let mut buf = vec![0u8; (len as usize).min(4 << 20)];
            let mut at = 0u64;
            while at < len {
                let n = ((len - at) as usize).min(buf.len());
                std::os::unix::fs::FileExt::read_exact_at(file, &mut buf[..n], at)?;
                std::os::unix::fs::FileExt::write_all_at(&copy, &buf[..n], at)?;
                at += n as u64;
            }
            seal(&copy)?;
            Some(copy)
        }
    };
    let path = Path::new("/proc/self/fd").join(sealed.as_ref().unwrap_or(file).as_raw_fd().to_string());
    Ok(OwnedFd::from(std::fs::File::open(path)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lent_part_cannot_be_written_through_any_reopening_of_its_descriptor() {
        let part = memfd().unwrap();
        std::os::unix::fs::FileExt::write_all_at(&part, b"committed state", 0).unwrap();
        let lent = lend(&part).unwrap();
        // What a worker does with the descriptor it was handed: reopen it read-write.
        let path = Path::new("/proc/self/fd").join(lent.as_raw_fd().to_string());
        let reopened = std::fs::OpenOptions::new().read(true).write(true).open(&path);
        let wrote = reopened.and_then(|f| std::os::unix::fs::FileExt::write_all_at(&f, b"forged", 0));
        assert!(wrote.is_err(), "a lent part was written");
        let mut got = vec![0u8; 15];
        std::os::unix::fs::FileExt::read_exact_at(&part, &mut got, 0).unwrap();
        assert_eq!(got, b"committed state");
        // A part its writer still maps writable cannot be sealed: a sealed copy is lent instead,
        // and the part itself is untouched.
        let mapped = memfd().unwrap();
        mapped.set_len(4096).unwrap();
        // SAFETY: a fresh shared mapping of a memfd this test owns, unmapped below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                mapped.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        let copy = lend(&mapped).unwrap();
        let path = Path::new("/proc/self/fd").join(copy.as_raw_fd().to_string());
        let wrote = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| std::os::unix::fs::FileExt::write_all_at(&f, b"x", 0));
        assert!(wrote.is_err(), "the lent copy was written");
        assert!(!sealed(&mapped), "the mapped part itself stays as it was");
        // SAFETY: the mapping made above, of 4096 bytes.
        unsafe { libc::munmap(map, 4096) };
    }
}
