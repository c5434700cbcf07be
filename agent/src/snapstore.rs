//! The node's snapshot store: the Unix socket the workers save to and load from
//! (`rlaunch::snapshot`'s wire) and the memfds that hold the parts. Every decision (what to
//! keep, free, copy, announce, fetch, which step a round restores, how long to wait) is the
//! pure [`crate::snapshots::core`]'s: this file feeds it what happens and carries its actions
//! out, moving only descriptors and bytes.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rlaunch::contract::{HostPort, Member, SnapshotSet};
use rlaunch::snapshot::{recv_frame, send_frame, Answer, Request, SOCKET_ENV};
use tracing::{info, warn};

use crate::snapshots::core::{Action, Core, Input, RoundMember};
use crate::snapshots::error::SnapError;
use crate::snapshots::holdings::{Have, Key};
use crate::snapshots::NodeId;

/// The Python package (`import rlaunch`), written beside the socket and put on the workers'
/// `PYTHONPATH`, so a job started by an `rlaunch` installed any way finds it.
const PY_PACKAGE: [(&str, &str); 8] = [
    ("__init__.py", include_str!("../../python/rlaunch/__init__.py")),
    ("dcp.py", include_str!("../../python/rlaunch/dcp.py")),
    ("hf.py", include_str!("../../python/rlaunch/hf.py")),
    ("lightning.py", include_str!("../../python/rlaunch/lightning.py")),
    ("snapshot.py", include_str!("../../python/rlaunch/snapshot.py")),
    ("interrupt.py", include_str!("../../python/rlaunch/interrupt.py")),
    ("resilient.py", include_str!("../../python/rlaunch/resilient.py")),
    ("compiled.py", include_str!("../../python/rlaunch/compiled.py")),
];

/// The workers' socket, in the store's directory.
const SOCKET_FILE: &str = "agent.sock";

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
    /// Numbers the workers' connections (a reservation's writer).
    connections: AtomicU64,
    /// Inputs the core was stepped with (a waiting request costs one per change, not a spin).
    steps: AtomicU64,
}

struct State {
    /// Every decision.
    core: Core,
    /// Each part's buffer (whole or being written), as the core's actions made and freed them.
    buffers: BTreeMap<Key, Arc<std::fs::File>>,
    /// The round's members that hold snapshots: how to reach each and its key.
    directory: BTreeMap<NodeId, peers::Peer>,
    /// Every member's key it proves itself with (one without an address may still connect).
    keys: BTreeMap<NodeId, [u8; secure::KEY_LEN]>,
}

/// What a request gets once the core's side actions are carried out.
pub(crate) enum Reply {
    Refused(SnapError),
    Wait(Instant),
    Done,
    Restore {
        step: Option<u64>,
        world: Option<u32>,
    },
    /// Room made: the buffer to write, and the reservation its reports name.
    Buffer {
        file: Arc<std::fs::File>,
        key: Key,
        generation: u64,
    },
    Lend {
        file: Arc<std::fs::File>,
        step: u64,
        world: u32,
        len: u64,
    },
    Read {
        ticket: u64,
        file: Arc<std::fs::File>,
        world: u32,
        len: u64,
    },
    Fetch {
        key: Key,
        from: peers::Peer,
        until: Instant,
        me: peers::Me,
        fetch: u64,
    },
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
        for (name, text) in PY_PACKAGE {
            std::fs::write(py.join(name), text)?;
        }
        let socket = dir.path().join(SOCKET_FILE);
        let listener = UnixListener::bind(&socket)?;
        let (outbox, jobs) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                core: Core::new(cap),
                buffers: BTreeMap::new(),
                directory: BTreeMap::new(),
                keys: BTreeMap::new(),
            }),
            changed: Condvar::new(),
            outbox,
            progress,
            identity: std::sync::OnceLock::new(),
            connections: AtomicU64::new(0),
            steps: AtomicU64::new(0),
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
        let mut st = self.shared.lock();
        st.directory.clear();
        st.keys.clear();
        self.shared.ask_locked(&mut st, Input::LocalRound { tag, world, ranks });
        drop(st);
        self.shared.changed.notify_all();
    }

    /// A round `tag` of several members starts: the plan comes from the parts every member
    /// listed as it joined (the same list on every node, so the same plan), each part is
    /// copied to this node's buddy (the next member), and the members tell each other which
    /// steps are whole on their node and its buddy.
    pub fn begin_peer_round(&self, tag: u64, me: &str, members: &[Member]) {
        let mut directory = BTreeMap::new();
        let mut keys = BTreeMap::new();
        let round: Vec<RoundMember> = members
            .iter()
            .map(|m| {
                // A member without snapshots (`--snapshot-memory 0`, an older agent) has no
                // snapshot address, or no key to prove itself with.
                let key = m.snapshot_key.as_deref().and_then(secure::parse_public);
                if let Some(key) = key {
                    keys.insert(m.node_id.clone(), key);
                }
                if let (Some(addr), Some(key)) = (m.snapshot_addr.clone(), key) {
                    directory.insert(m.node_id.clone(), peers::Peer { id: m.node_id.clone(), addr, key });
                }
                RoundMember {
                    id: m.node_id.clone(),
                    ranks: m.rank_offset..m.rank_offset.saturating_add(m.local_world_size),
                    inventory: from_sets(&m.snapshots),
                    fit: directory.contains_key(&m.node_id),
                }
            })
            .collect();
        let mut st = self.shared.lock();
        st.directory = directory;
        st.keys = keys;
        self.shared.ask_locked(&mut st, Input::PeerRound { tag, me: me.to_owned(), members: round });
        drop(st);
        self.shared.changed.notify_all();
    }

    /// What this node holds, as it joins a round.
    pub fn inventory(&self) -> Vec<SnapshotSet> {
        to_sets(&self.shared.lock().core.inventory())
    }

    /// Serves the other members (copies, fetches, commits) on `bind`; answers the port.
    pub fn serve_peers(&self, bind: &HostPort) -> std::io::Result<u16> {
        self.shared.identity()?;
        let listener = std::net::TcpListener::bind((bind.host(), bind.port()))?;
        let port = listener.local_addr()?.port();
        let s = self.shared.clone();
        std::thread::Builder::new().name("snapshot-peers".into()).spawn(move || peers::accept(listener, s))?;
        Ok(port)
    }

    /// The workers are stopped: nothing is saved until the next round begins.
    pub fn end_round(&self) {
        self.shared.ask(Input::EndRound);
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

    /// Who this node is in the round running, for the connections it opens.
    fn me(&self, st: &State) -> Option<peers::Me> {
        let (round, id) = st.core.running()?;
        let identity = self.identity().ok()?.clone();
        Some(peers::Me { round, id: id.clone(), identity })
    }

    /// Steps the core with `input`, carries out its side actions and answers the request's own.
    pub(crate) fn ask(&self, input: Input) -> Reply {
        let mut st = self.lock();
        let reply = self.ask_locked(&mut st, input);
        drop(st);
        self.changed.notify_all();
        reply
    }

    /// [`Shared::ask`], asked again at each change while the core says to wait (until the
    /// deadline it names).
    pub(crate) fn ask_waiting(&self, input: Input) -> Reply {
        let mut st = self.lock();
        loop {
            match self.ask_locked(&mut st, input.clone()) {
                Reply::Wait(until) => {
                    // A wait changed nothing: nobody else is woken for it.
                    let left = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                    st = self.changed.wait_timeout(st, left).unwrap_or_else(PoisonError::into_inner).0;
                }
                reply => {
                    drop(st);
                    self.changed.notify_all();
                    return reply;
                }
            }
        }
    }

    fn ask_locked(&self, st: &mut State, input: Input) -> Reply {
        self.steps.fetch_add(1, Ordering::Relaxed);
        let acts = st.core.step(input, Instant::now());
        let mut reply = Reply::Done;
        for act in acts {
            match act {
                Action::Free(k) => {
                    st.buffers.remove(&k);
                }
                Action::Seal(k) => {
                    if let Some(Err(e)) = st.buffers.get(&k).map(|f| seal(f)) {
                        warn!(error = %e, "cannot seal a snapshot part");
                    }
                }
                Action::Copy { key, to } => {
                    if let (Some(to), Some(me)) = (st.directory.get(&to).cloned(), self.me(st)) {
                        let _ = self.outbox.send(peers::Job::Copy { key, to, me });
                    }
                }
                Action::Announce { tag, step, to } => {
                    let to: Vec<peers::Peer> = to.iter().filter_map(|id| st.directory.get(id).cloned()).collect();
                    if let Some(me) = self.me(st) {
                        let _ = self.outbox.send(peers::Job::Announce { tag, step, to, me });
                    }
                }
                Action::Saved { rank, step } => self.progress.saved(rank, step),
                Action::Committed { step } => tracing::debug!(step, "snapshot committed"),
                Action::Planned(Some(p)) => info!(
                    step = p.step,
                    saved_in_round = p.tag,
                    from = ?p.from.values().collect::<BTreeSet<_>>(),
                    "this round restores the snapshot of step {}",
                    p.step
                ),
                Action::Planned(None) => tracing::debug!("no snapshot to restore"),
                Action::Unfit(node) => {
                    warn!(node = %node, "a member of this round holds no snapshots: nothing is restored, and no step commits")
                }
                Action::NotAMember => warn!("this node is not among the round's members: snapshots are not restored"),
                Action::Abandoned(k) => {
                    warn!(
                        rank = k.rank,
                        step = k.step,
                        "a worker went while saving its snapshot: that part was never held"
                    )
                }
                Action::Make { key, len, reuse, generation } => {
                    reply = match make_buffer(st, key, len, reuse) {
                        Ok(file) => Reply::Buffer { file, key, generation },
                        Err(e) => {
                            // Nothing is written: the reservation goes.
                            let _ = self.ask_locked(st, Input::Abandon { key, generation });
                            Reply::Refused(SnapError::Buffer(e.to_string()))
                        }
                    }
                }
                Action::Refuse(e) => reply = Reply::Refused(e),
                Action::Wait { until } => reply = Reply::Wait(until),
                Action::Done => reply = Reply::Done,
                Action::Restore { step, world } => reply = Reply::Restore { step, world },
                Action::Lend { key, step, world, len } => {
                    reply = match st.buffers.get(&key) {
                        Some(file) => Reply::Lend { file: file.clone(), step, world, len },
                        None => Reply::Refused(SnapError::NotHere { rank: key.rank, step }),
                    }
                }
                Action::Read { ticket, key, world, len } => {
                    reply = match st.buffers.get(&key) {
                        Some(file) => Reply::Read { ticket, file: file.clone(), world, len },
                        None => {
                            let _ = st.core.step(Input::ReadDone { ticket }, Instant::now());
                            Reply::Refused(SnapError::NotHeld { rank: key.rank, step: key.step, tag: key.tag })
                        }
                    }
                }
                Action::Fetch { key, from, until, fetch } => {
                    reply = match (st.directory.get(&from).cloned(), self.me(st)) {
                        (Some(from), Some(me)) => Reply::Fetch { key, from, until, me, fetch },
                        _ => {
                            let error = "no key to reach other nodes with".to_string();
                            let addr = String::new();
                            let failed =
                                Input::FetchFailed { key, fetch, generation: None, from: from.clone(), addr, error };
                            let _ = self.ask_locked(st, failed);
                            Reply::Refused(SnapError::Unreachable { node: from, rank: key.rank, step: key.step })
                        }
                    }
                }
            }
        }
        reply
    }
}

/// The buffer the core granted `key`: `reuse`'s (its pages are there: a save into it is one
/// copy, no page faults), else a new memfd, sized to `len`.
fn make_buffer(st: &mut State, key: Key, len: u64, reuse: Option<Key>) -> std::io::Result<Arc<std::fs::File>> {
    let file = match reuse.and_then(|k| st.buffers.remove(&k)) {
        Some(f) => f,
        None => Arc::new(memfd()?),
    };
    file.set_len(len)?;
    st.buffers.insert(key, file.clone());
    Ok(file)
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
    let writer = shared.connections.fetch_add(1, Ordering::SeqCst);
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
            Ok(req) => handle(&shared, writer, req),
            Err(e) => refused(SnapError::NotARequest(e.to_string())),
        };
        let body = serde_json::to_vec(&answer).expect("an answer serializes");
        if let Err(e) = send_frame(&sock, &body, fd.as_ref().map(|f| f.as_fd())) {
            tracing::debug!(error = %e, "a worker went before its answer");
            break;
        }
    }
    shared.ask(Input::WriterGone { writer });
}

fn refused(e: SnapError) -> (Answer, Option<OwnedFd>) {
    (Answer { full: e.not_snapshotted(), ..Answer::refused(e.to_string()) }, None)
}

fn handle(shared: &Shared, writer: u64, req: Request) -> (Answer, Option<OwnedFd>) {
    let result = match req {
        Request::Reserve { step, rank, world, len } => {
            reserve(shared, writer, step, rank, world, len).map(|fd| (Answer::default(), Some(fd)))
        }
        Request::Commit { step, rank } => commit(shared, writer, step, rank).map(|()| (Answer::default(), None)),
        Request::Load { rank } => {
            if let Some(rank) = rank {
                shared.progress.asked(rank);
            }
            load(shared, rank).inspect(|(a, _)| {
                if let Some(rank) = rank {
                    shared.progress.loaded(rank, a.step);
                }
            })
        }
    };
    match result {
        Ok((mut a, fd)) => {
            a.ok = true;
            (a, fd)
        }
        Err(e) => refused(e),
    }
}

fn unexpected() -> SnapError {
    SnapError::OutOfTurn
}

pub(crate) fn reserve(
    shared: &Shared,
    writer: u64,
    step: u64,
    rank: u32,
    world: u32,
    len: u64,
) -> Result<OwnedFd, SnapError> {
    let since = Instant::now();
    match shared.ask_waiting(Input::Reserve { writer, step, rank, world, len, since }) {
        Reply::Buffer { file, key, generation } => file.as_fd().try_clone_to_owned().map_err(|e| {
            shared.ask(Input::Abandon { key, generation });
            SnapError::Buffer(e.to_string())
        }),
        Reply::Refused(e) => Err(e),
        _ => Err(unexpected()),
    }
}

pub(crate) fn commit(shared: &Shared, writer: u64, step: u64, rank: u32) -> Result<(), SnapError> {
    match shared.ask(Input::Commit { writer, step, rank }) {
        Reply::Refused(e) => Err(e),
        _ => Ok(()),
    }
}

/// Room under the cap for a fetched part, once its holder said how big it is: the buffer and
/// the reservation's generation.
pub(crate) fn fetch_room(
    shared: &Shared,
    key: Key,
    from: &str,
    world: u32,
    len: u64,
) -> Result<(Arc<std::fs::File>, u64), SnapError> {
    match shared.ask(Input::FetchRoom { key, from: from.to_owned(), world, len }) {
        Reply::Buffer { file, generation, .. } => Ok((file, generation)),
        Reply::Refused(e) => Err(e),
        _ => Err(unexpected()),
    }
}

fn load(shared: &Shared, rank: Option<u32>) -> Result<(Answer, Option<OwnedFd>), SnapError> {
    let since = Instant::now();
    // A part fetched is lent at the next turn; a fetch another load made is waited for.
    for _ in 0..4 {
        match shared.ask_waiting(Input::Load { rank, since }) {
            Reply::Restore { step, world } => return Ok((Answer { step, world, ..Answer::default() }, None)),
            Reply::Lend { file, step, world, len } => {
                // Sealed before it is lent (outside the lock: a sealed copy may be made): no
                // descriptor of it, however reopened, can write it.
                let fd = lend(&file).map_err(|e| SnapError::Lend(e.to_string()))?;
                return Ok((
                    Answer { step: Some(step), world: Some(world), len: Some(len), ..Answer::default() },
                    Some(fd),
                ));
            }
            Reply::Fetch { key, from, until, me, fetch } => {
                // The room of the try in progress: a cut try lets go of exactly that.
                let granted = std::cell::Cell::new(None);
                let fetched = peers::fetch(
                    &from,
                    &me,
                    key,
                    until,
                    |world, len| {
                        let (file, generation) = fetch_room(shared, key, &from.id, world, len)?;
                        granted.set(Some(generation));
                        Ok(file)
                    },
                    || {
                        if let Some(generation) = granted.take() {
                            shared.ask(Input::Abandon { key, generation });
                        }
                    },
                );
                let input = match (fetched, granted.get()) {
                    (Ok((_, len, _)), Some(generation)) => {
                        info!(rank = key.rank, step = key.step, from = %from.id, mib = len >> 20, "fetched a snapshot part from another node");
                        Input::FetchArrived { key, fetch, generation }
                    }
                    (got, generation) => Input::FetchFailed {
                        key,
                        fetch,
                        generation,
                        from: from.id.clone(),
                        addr: from.addr.to_string(),
                        error: got.err().map_or_else(|| "no room was made for it".into(), |e| e.to_string()),
                    },
                };
                if let Reply::Refused(e) = shared.ask(input) {
                    return Err(e);
                }
            }
            Reply::Refused(e) => return Err(e),
            _ => return Err(unexpected()),
        }
    }
    Err(unexpected())
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
    fn the_workers_get_every_module_of_the_python_package() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/rlaunch");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".py"))
            .collect();
        on_disk.sort();
        let mut shipped: Vec<String> = PY_PACKAGE.iter().map(|(n, _)| (*n).to_owned()).collect();
        shipped.sort();
        assert_eq!(shipped, on_disk, "an `import rlaunch` in a worker would miss a module");
    }

    #[test]
    fn requests_waiting_for_a_round_do_not_wake_each_other() {
        // Found reviewing the core: each waiting request woke the others as it went back to
        // waiting, so two saves made before a round began spun on both cores until it did.
        let store = SnapStore::start(1 << 20, Default::default()).unwrap();
        let waiters: Vec<_> = (0..2)
            .map(|rank| {
                let shared = store.shared.clone();
                std::thread::spawn(move || reserve(&shared, rank, 1, rank as u32, 2, 64).is_ok())
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let steps = store.shared.steps.load(Ordering::Relaxed);
        assert!(steps <= 4, "{steps} core steps while two requests waited 300 ms for a round");
        store.begin_local_round(1, 2, 0..2);
        for w in waiters {
            assert!(w.join().unwrap(), "a waiting save is answered once the round begins");
        }
    }

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
