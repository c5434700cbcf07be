//! The snapshot store between agents: copies of parts to the buddy, parts fetched by a node
//! that restores them, and "this step is whole here and on my buddy" announcements, over TCP.
//!
//! A connection opens with [`secure`]'s challenge-response: each end proves the private half of
//! the public key the round's member list gives for it, bound to this connection and to both
//! ends, and from then on every frame, a part's bytes included, is sealed. A node that is not a
//! member of the round this agent runs, or that cannot prove it, is refused; so is any request
//! about a round other than the current one. Frames are JSON; a part's bytes follow its frame.
//!
//! Connections are bounded: at most [`MAX_HANDSHAKES`] strangers in their handshake at once and
//! [`MAX_HANDSHAKES_PER_ADDRESS`] from one address (the oldest of the busiest address is
//! dropped for a newer one, and each has [`HELLO_WITHIN`] for the whole handshake, not per
//! read), and [`MAX_PEER_CONNECTIONS`] proven members.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use rlaunch::contract::HostPort;
use rlaunch::snapshot::Answer;
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use super::secure::{self, Channel, Identity, KEY_LEN};
use super::{NodeId, Reply, Shared};
use crate::snapshots::core::Input;
use crate::snapshots::error::SnapError;
use crate::snapshots::holdings::Key;

const CONNECT_WITHIN: Duration = Duration::from_secs(3);
/// A peer silent this long on a connection is given up.
const IO_WITHIN: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Msg {
    /// A copy of `rank`'s part of `step`: `len` bytes follow.
    Put { tag: u64, step: u64, rank: u32, world: u32, len: u64 },
    /// The answer's `len` bytes follow it.
    Get { tag: u64, step: u64, rank: u32 },
    /// Every part the sender's ranks saved for `step` is held on the sender and its buddy.
    Complete { tag: u64, step: u64 },
}

/// A member this node talks to: its id, where it is, its public key.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    pub id: NodeId,
    pub addr: HostPort,
    pub key: [u8; KEY_LEN],
}

/// Who this node is in a round, for the connections it opens.
#[derive(Clone)]
pub(crate) struct Me {
    pub round: u64,
    pub id: NodeId,
    pub identity: Arc<Identity>,
}

/// Work for the replicator thread. A copy names its part; the buffer is looked up when the copy
/// is sent (a part freed meanwhile is not sent, and no queued copy keeps a buffer alive).
pub(crate) enum Job {
    Copy { key: Key, to: Peer, me: Me },
    Announce { tag: u64, step: u64, to: Vec<Peer>, me: Me },
}

fn answered(ch: &mut Channel) -> io::Result<Answer> {
    let a: Answer = ch.recv()?;
    if !a.ok {
        return Err(io::Error::other(a.error.unwrap_or_else(|| "refused".into())));
    }
    Ok(a)
}

fn connect(peer: &Peer, me: &Me) -> io::Result<Channel> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{} resolves to no address", peer.addr));
    for a in (peer.addr.host(), peer.addr.port()).to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, CONNECT_WITHIN) {
            Ok(s) => {
                s.set_nodelay(true)?;
                s.set_write_timeout(Some(IO_WITHIN))?;
                let deadline = Instant::now() + HELLO_WITHIN;
                let mut ch = secure::client(s, &me.identity, me.round, &me.id, &peer.id, &peer.key, deadline)?;
                ch.stream().set_read_timeout(Some(IO_WITHIN))?;
                answered(&mut ch)?;
                return Ok(ch);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Fetches `key`'s part from `peer`: its world, length and the buffer `room(world, len)` gave
/// for it (room is made under the node's cap before a byte is received).
pub(crate) fn fetch(
    peer: &Peer,
    me: &Me,
    key: Key,
    until: Instant,
    mut room: impl FnMut(u32, u64) -> Result<Arc<File>, SnapError>,
    mut let_go: impl FnMut(),
) -> io::Result<(u32, u64, Arc<File>)> {
    // The holder may still be starting this round: its answer "not this round" is waited out,
    // until the deadline the core set.
    loop {
        let mut made_room = false;
        let mut room_once = |world: u32, len: u64| {
            let got = room(world, len);
            // Only room this try was given is let go (a refusal names another's reservation).
            made_room = got.is_ok();
            got
        };
        let got = fetch_once(peer, me, key, &mut room_once);
        if got.is_err() && made_room {
            // The transfer was cut after room was made: that reservation goes, or the next try
            // would find it in its own way ("being saved by another request").
            let_go();
        }
        match got {
            Ok(got) => return Ok(got),
            Err(e) if e.kind() != io::ErrorKind::OutOfMemory && Instant::now() < until => {
                debug!(error = %e, "fetching a snapshot part; trying again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

fn fetch_once(
    peer: &Peer,
    me: &Me,
    key: Key,
    room: &mut impl FnMut(u32, u64) -> Result<Arc<File>, SnapError>,
) -> io::Result<(u32, u64, Arc<File>)> {
    let mut ch = connect(peer, me)?;
    ch.send(&Msg::Get { tag: key.tag, step: key.step, rank: key.rank })?;
    let a = answered(&mut ch)?;
    let (world, len) = (a.world.unwrap_or(0), a.len.unwrap_or(0));
    let file = room(world, len).map_err(|why| io::Error::new(io::ErrorKind::OutOfMemory, why))?;
    ch.receive_into(&file, len)?;
    Ok((world, len, file))
}

/// The replicator: sends copies to the buddy in order, one connection kept open; announcements
/// go to a thread of their own ([`announce`]), so a slow or silent member never holds up the
/// copies every commit waits for. A copy of a part whose rank already has a newer one waiting is
/// skipped (the newer commits instead).
pub(crate) fn replicate(jobs: Receiver<Job>, shared: Weak<Shared>) {
    let (announcements, heard) = std::sync::mpsc::channel();
    let told = shared.clone();
    if let Err(e) = std::thread::Builder::new().name("snapshot-announce".into()).spawn(move || announce(heard, told)) {
        warn!(error = %e, "cannot start the snapshot announcer: steps will not commit");
    }
    let mut conns: HashMap<(NodeId, u64), Channel> = HashMap::new();
    let mut queue: VecDeque<Job> = VecDeque::new();
    // Buddies already said unreachable in a round: said once, then quietly.
    let mut said: std::collections::HashSet<(NodeId, u64)> = std::collections::HashSet::new();
    loop {
        if queue.is_empty() {
            match jobs.recv() {
                Ok(j) => queue.push_back(j),
                Err(_) => return,
            }
        }
        queue.extend(jobs.try_iter());
        let Some(job) = queue.pop_front() else { continue };
        match job {
            Job::Copy { key, to, me } => {
                let newer = queue.iter().any(|j| {
                    matches!(j, Job::Copy { key: k, .. } if k.tag == key.tag && k.rank == key.rank && k.step > key.step)
                });
                if newer {
                    continue;
                }
                let Some(strong) = shared.upgrade() else { return };
                let Reply::Read { ticket, file, world, len } = strong.ask(Input::Read { key, by: None }) else {
                    continue; // freed meanwhile: a newer part commits instead
                };
                drop(strong);
                let result = with_conn(&mut conns, &to, &me, |ch| {
                    let (tag, step, rank) = (key.tag, key.step, key.rank);
                    ch.send(&Msg::Put { tag, step, rank, world, len })?;
                    ch.send_file(&file, len)?;
                    answered(ch).map(|_| ())
                });
                drop(file);
                let Some(shared) = shared.upgrade() else { return };
                shared.ask(Input::ReadDone { ticket });
                match result {
                    Ok(()) => {
                        shared.ask(Input::CopyAcked { key, by: to.id });
                    }
                    Err(e) if said.insert((to.id.clone(), key.tag)) => warn!(
                        rank = key.rank,
                        step = key.step,
                        buddy = %to.id,
                        error = %e,
                        "a snapshot part was not copied to the buddy: steps are not committed while it is unreachable (said once per round)"
                    ),
                    Err(e) => debug!(rank = key.rank, step = key.step, error = %e, "a snapshot part was not copied"),
                }
            }
            announcement @ Job::Announce { .. } => {
                let _ = announcements.send(announcement);
            }
        }
    }
}

/// Members told at once: one slow member holds up only its share.
const ANNOUNCERS: usize = 8;

/// Tells the members that a step is whole here and on the buddy. Only the newest step of a
/// round waiting is told (it supersedes the older); members are told in parallel, and one that
/// failed is reported to the core, which passes it over for a while.
fn announce(jobs: Receiver<Job>, shared: Weak<Shared>) {
    let mut conns: HashMap<(NodeId, u64), Channel> = HashMap::new();
    while let Ok(first) = jobs.recv() {
        let mut newest = first;
        for j in jobs.try_iter() {
            if let (Job::Announce { tag: t, step: s, .. }, Job::Announce { tag: nt, step: ns, .. }) = (&j, &newest) {
                if (*t, *s) >= (*nt, *ns) {
                    newest = j;
                }
            }
        }
        let Job::Announce { tag, step, to: due, me } = newest else { continue };
        conns.retain(|(_, round), _| *round == me.round);
        let chunk = due.len().div_ceil(ANNOUNCERS).max(1);
        let failed: Vec<NodeId> = std::thread::scope(|sc| {
            let handles: Vec<_> = due
                .chunks(chunk)
                .map(|peers| {
                    let mut mine: HashMap<(NodeId, u64), Channel> =
                        peers.iter().filter_map(|p| conns.remove_entry(&(p.id.clone(), me.round))).collect();
                    let me = &me;
                    sc.spawn(move || {
                        let mut failed = Vec::new();
                        for peer in peers {
                            let r = with_conn(&mut mine, peer, me, |ch| {
                                ch.send(&Msg::Complete { tag, step })?;
                                answered(ch).map(|_| ())
                            });
                            if let Err(e) = r {
                                debug!(node = %peer.id, step, error = %e, "announcing a whole step");
                                failed.push(peer.id.clone());
                            }
                        }
                        (mine, failed)
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().ok())
                .flat_map(|(mine, failed)| {
                    conns.extend(mine);
                    failed
                })
                .collect()
        });
        let Some(shared) = shared.upgrade() else { return };
        for node in failed {
            shared.ask(Input::AnnounceFailed { node });
        }
    }
}

/// Runs `f` on the open connection to `peer` for this round, or a new one; a failure on an old
/// connection is tried once more on a new one.
fn with_conn(
    conns: &mut HashMap<(NodeId, u64), Channel>,
    peer: &Peer,
    me: &Me,
    mut f: impl FnMut(&mut Channel) -> io::Result<()>,
) -> io::Result<()> {
    let id = (peer.id.clone(), me.round);
    conns.retain(|(_, round), _| *round == me.round);
    if let Some(mut ch) = conns.remove(&id) {
        if f(&mut ch).is_ok() {
            conns.insert(id, ch);
            return Ok(());
        }
    }
    let mut ch = connect(peer, me)?;
    f(&mut ch)?;
    conns.insert(id, ch);
    Ok(())
}

/// Most proven members' connections served at once: a member talks to each other member over
/// one connection, plus fetches; anything past this is closed at once.
const MAX_PEER_CONNECTIONS: usize = rlaunch::contract::MAX_SNAPSHOT_NODES;
/// Most connections in their handshake at once; a newer one drops the oldest.
pub(crate) const MAX_HANDSHAKES: usize = 64;
/// A connection's whole handshake must come within this.
pub(crate) const HELLO_WITHIN: Duration = Duration::from_secs(2);

/// Most handshakes from one address at once: a flood from one host cuts only its own.
pub(crate) const MAX_HANDSHAKES_PER_ADDRESS: usize = 8;

/// The connections in their handshake, oldest first, to drop one when a newer comes.
#[derive(Default)]
struct Handshaking {
    next: AtomicU64,
    open: Mutex<VecDeque<(u64, std::net::IpAddr, TcpStream)>>,
}

impl Handshaking {
    /// Registers `s`. Past [`MAX_HANDSHAKES_PER_ADDRESS`] from its address, that address's
    /// oldest handshake is cut; past [`MAX_HANDSHAKES`] in all, the oldest of the address that
    /// has the most: strangers flooding from a few hosts never cut a member's handshake.
    fn enter(&self, s: &TcpStream) -> Option<u64> {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let clone = s.try_clone().ok()?;
        let ip = s.peer_addr().ok()?.ip();
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let from = |open: &VecDeque<(u64, std::net::IpAddr, TcpStream)>, ip: std::net::IpAddr| {
            open.iter().filter(|(_, a, _)| *a == ip).count()
        };
        let victim = if from(&open, ip) >= MAX_HANDSHAKES_PER_ADDRESS {
            Some(ip)
        } else if open.len() >= MAX_HANDSHAKES {
            open.iter().map(|(_, a, _)| *a).max_by_key(|a| from(&open, *a))
        } else {
            None
        };
        if let Some(victim) = victim {
            if let Some(i) = open.iter().position(|(_, a, _)| *a == victim) {
                if let Some((_, _, oldest)) = open.remove(i) {
                    debug!(from = %victim, "too many snapshot peer handshakes at once: the oldest is cut");
                    let _ = oldest.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        open.push_back((id, ip, clone));
        Some(id)
    }

    fn leave(&self, id: u64) {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).retain(|(i, _, _)| *i != id);
    }
}

pub(crate) fn accept(listener: TcpListener, shared: Arc<Shared>) {
    let proven = Arc::new(AtomicUsize::new(0));
    let handshaking = Arc::new(Handshaking::default());
    for conn in listener.incoming() {
        match conn {
            Ok(s) => {
                let Some(ticket) = handshaking.enter(&s) else { continue };
                let (shared, proven, handshaking) = (shared.clone(), proven.clone(), handshaking.clone());
                let spawned = std::thread::Builder::new().name("snapshot-peer".into()).spawn(move || {
                    let opened = open(s, &shared);
                    handshaking.leave(ticket);
                    let (ch, round, node) = match opened {
                        Ok(o) => o,
                        Err(e) => return debug!(error = %e, "a snapshot peer's handshake failed"),
                    };
                    if proven.fetch_add(1, Ordering::SeqCst) >= MAX_PEER_CONNECTIONS {
                        proven.fetch_sub(1, Ordering::SeqCst);
                        return debug!("too many snapshot peer connections: one closed");
                    }
                    if let Err(e) = serve(ch, round, node, &shared) {
                        debug!(error = %e, "a snapshot peer connection ended");
                    }
                    proven.fetch_sub(1, Ordering::SeqCst);
                });
                if let Err(e) = spawned {
                    warn!(error = %e, "cannot serve a snapshot peer");
                }
            }
            Err(e) => {
                warn!(error = %e, "snapshot peer listener");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// The handshake: the peer proven a member of the round this agent runs.
fn open(s: TcpStream, shared: &Shared) -> io::Result<(Channel, u64, NodeId)> {
    s.set_write_timeout(Some(HELLO_WITHIN))?;
    s.set_nodelay(true)?;
    let deadline = Instant::now() + HELLO_WITHIN;
    let (mut ch, round, node) = secure::server(s, shared.identity()?, deadline, |round, node| {
        let st = shared.lock();
        st.core
            .admits(round, node)
            .then(|| {
                let key = *st.keys.get(node)?;
                Some((st.core.running()?.1.clone(), key))
            })
            .flatten()
            .ok_or_else(|| {
                format!("node {} is not a member of round {round} here", node.chars().take(200).collect::<String>())
            })
    })?;
    ch.stream().set_write_timeout(Some(IO_WITHIN))?;
    ch.send(&Answer { ok: true, ..Answer::default() })?;
    // A member's connection stays open between steps: quiet for minutes is fine.
    ch.stream().set_read_timeout(Some(IO_WITHIN.saturating_mul(20)))?;
    Ok((ch, round, node))
}

fn refuse(ch: &mut Channel, why: String) -> io::Result<()> {
    ch.send(&Answer::refused(why))
}

fn ok(ch: &mut Channel, a: Answer) -> io::Result<()> {
    ch.send(&Answer { ok: true, ..a })
}

fn serve(mut ch: Channel, round: u64, node: NodeId, shared: &Shared) -> io::Result<()> {
    loop {
        let msg: Msg = match ch.recv() {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        // Every request is judged by the core against the round the hello named.
        match msg {
            Msg::Put { tag, step, rank, world, len } => {
                let key = Key { tag, step, rank };
                match shared.ask(Input::Offer { from: node.clone(), round, key, world, len }) {
                    Reply::Buffer { file, generation, .. } => {
                        if let Err(e) = ch.receive_into(&file, len) {
                            drop(file);
                            shared.ask(Input::Abandon { key, generation });
                            return Err(e);
                        }
                        drop(file);
                        match shared.ask(Input::CopyArrived { key, generation }) {
                            Reply::Refused(why) => refuse(&mut ch, why.to_string())?,
                            _ => ok(&mut ch, Answer::default())?,
                        }
                    }
                    Reply::Refused(why) => {
                        ch.drain(len)?;
                        refuse(&mut ch, why.to_string())?;
                    }
                    _ => {
                        ch.drain(len)?;
                        refuse(&mut ch, "the snapshot store answered out of turn".into())?;
                    }
                }
            }
            Msg::Get { tag, step, rank } => {
                let key = Key { tag, step, rank };
                match shared.ask(Input::Read { key, by: Some((node.clone(), round)) }) {
                    Reply::Read { ticket, file, world, len } => {
                        let sent = ok(&mut ch, Answer { world: Some(world), len: Some(len), ..Answer::default() })
                            .and_then(|()| ch.send_file(&file, len));
                        drop(file);
                        shared.ask(Input::ReadDone { ticket });
                        sent?;
                    }
                    Reply::Refused(why) => refuse(&mut ch, why.to_string())?,
                    _ => refuse(&mut ch, "the snapshot store answered out of turn".into())?,
                }
            }
            Msg::Complete { tag, step } => {
                shared.ask(Input::Complete { from: node.clone(), round, tag, step });
                ok(&mut ch, Answer::default())?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapstore::SnapStore;
    use rlaunch::contract::{Member, SnapshotSet};
    use std::io::{Read, Write};

    fn member(id: &str, offset: u32, addr: Option<HostPort>, key: &Identity) -> Member {
        Member {
            node_id: id.into(),
            group_rank: offset / 2,
            local_world_size: 2,
            rank_offset: offset,
            store_addr: "127.0.0.1:1".parse().unwrap(),
            probe_addr: None,
            snapshot_addr: addr,
            snapshot_key: Some(key.public_hex()),
            snapshots: Vec::new(),
        }
    }

    /// This node (`me`, ranks 0 and 1) in round 7 with a peer `x` (ranks 2 and 3), whose
    /// identity is answered.
    fn store() -> (SnapStore, Peer, Arc<Identity>) {
        let store = SnapStore::start(1 << 20, Default::default()).unwrap();
        let port = store.serve_peers(&HostPort::new("127.0.0.1", 0).unwrap()).unwrap();
        let addr: HostPort = format!("127.0.0.1:{port}").parse().unwrap();
        let x = Arc::new(Identity::generate().unwrap());
        let members = [member("me", 0, Some(addr.clone()), store.shared.identity().unwrap()), member("x", 2, None, &x)];
        store.begin_peer_round(7, "me", &members);
        let me = Peer {
            id: "me".into(),
            addr,
            key: secure::parse_public(&store.shared.identity().unwrap().public_hex()).unwrap(),
        };
        (store, me, x)
    }

    fn as_(id: &str, round: u64, identity: &Arc<Identity>) -> Me {
        Me { round, id: id.into(), identity: identity.clone() }
    }

    fn put(ch: &mut Channel, tag: u64, rank: u32, bytes: &[u8]) -> io::Result<Answer> {
        ch.send(&Msg::Put { tag, step: 1, rank, world: 4, len: bytes.len() as u64 })?;
        let file = super::super::memfd()?;
        std::os::unix::fs::FileExt::write_all_at(&file, bytes, 0)?;
        ch.send_file(&file, bytes.len() as u64)?;
        ch.recv()
    }

    fn no_room(_: u32, _: u64) -> Result<Arc<File>, SnapError> {
        Err(SnapError::Buffer("no room".into()))
    }

    #[test]
    fn only_a_proven_member_of_the_current_round_is_served_and_only_for_its_own_ranks() {
        let (store, me, x) = store();
        // Whoever read the round's public keys (a process reading etcd, `rlaunch status`) and
        // makes its own key, names another round, or names this node itself: refused.
        let stranger = Arc::new(Identity::generate().unwrap());
        for (who, round, identity) in [("x", 7, &stranger), ("y", 7, &x), ("x", 6, &x), ("me", 7, &x)] {
            let e = connect(&me, &as_(who, round, identity)).err().expect("refused");
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{who} {round}: {e}");
        }
        // A hello meant for another node (as one replayed from elsewhere would be): refused.
        let elsewhere = Peer { id: "z".into(), ..me.clone() };
        assert!(connect(&elsewhere, &as_("x", 7, &x)).is_err());
        let mut ch = connect(&me, &as_("x", 7, &x)).unwrap();
        // A copy of a rank that is not x's, or of another round: refused, and nothing held.
        let a = put(&mut ch, 7, 0, b"forged").unwrap();
        assert!(!a.ok && a.error.as_deref().is_some_and(|e| e.contains("not node x's")), "{a:?}");
        let a = put(&mut ch, 6, 2, b"stale").unwrap();
        assert!(!a.ok, "{a:?}");
        assert!(store.inventory().is_empty());
        // Its own rank's copy is held, whole, and can be fetched back; a second copy of it is
        // refused (a step is saved once).
        let a = put(&mut ch, 7, 2, b"part of rank 2").unwrap();
        assert!(a.ok, "{a:?}");
        let a = put(&mut ch, 7, 2, b"rewritten").unwrap();
        assert!(!a.ok, "{a:?}");
        let held = store.inventory();
        assert_eq!(held.len(), 1);
        assert_eq!((held[0].tag, held[0].step, held[0].ranks.clone()), (7, 1, vec![(2, 3)]));
        let room = |_: u32, len: u64| -> Result<Arc<File>, SnapError> {
            let f = super::super::memfd().map_err(|e| SnapError::Buffer(e.to_string()))?;
            f.set_len(len).map_err(|e| SnapError::Buffer(e.to_string()))?;
            Ok(Arc::new(f))
        };
        let (world, len, file) =
            fetch_once(&me, &as_("x", 7, &x), Key { tag: 7, step: 1, rank: 2 }, &mut { room }).unwrap();
        let mut got = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&*file, &mut got, 0).unwrap();
        assert_eq!((world, got.as_slice()), (4, &b"part of rank 2"[..]));
        // A part nobody holds is refused, not invented; a fetch the cap has no room for makes
        // no buffer and is not tried again.
        assert!(fetch_once(&me, &as_("x", 7, &x), Key { tag: 7, step: 2, rank: 2 }, &mut { room }).is_err());
        let until = Instant::now() + Duration::from_secs(20);
        let e = fetch(&me, &as_("x", 7, &x), Key { tag: 7, step: 1, rank: 2 }, until, no_room, || {}).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::OutOfMemory);
    }

    /// The handshake's own clear frames, read within 5 s.
    fn read_clear(s: &mut TcpStream) -> secure::Handshake {
        secure::read_clear(s, Instant::now() + Duration::from_secs(5)).unwrap()
    }

    fn write_clear(s: &mut TcpStream, h: &secure::Handshake) {
        secure::write_clear(s, h).unwrap();
    }

    #[test]
    fn a_proof_recorded_on_one_connection_is_refused_on_another() {
        let (_store, me, x) = store();
        let addr = format!("127.0.0.1:{}", me.addr.port());
        // A genuine member's handshake, recorded as someone on the path would.
        let (hello, proof) = {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let nonce = "11".repeat(32);
            let hello = secure::Handshake::Hello { round: 7, node: "x".into(), to: "me".into(), nonce: nonce.clone() };
            write_clear(&mut s, &hello);
            let secure::Handshake::Challenge { nonce: server_nonce, .. } = read_clear(&mut s) else {
                panic!("a challenge")
            };
            let (cn, sn) = (secure::parse_public(&nonce).unwrap(), secure::parse_public(&server_nonce).unwrap());
            let xk = secure::parse_public(&x.public_hex()).unwrap();
            let keys = secure::session(
                &x.shared_with(&me.key).unwrap(),
                &secure::Transcript {
                    round: 7,
                    client: "x",
                    server: "me",
                    client_key: &xk,
                    server_key: &me.key,
                    client_nonce: &cn,
                    server_nonce: &sn,
                },
            );
            let proof = secure::Handshake::Proof { proof: rlaunch_rendezvous::identity::hex(&keys.client_proof) };
            write_clear(&mut s, &proof);
            let mut head = [0u8; 4];
            s.read_exact(&mut head).unwrap(); // the sealed welcome: accepted
            (hello, proof)
        };
        // The same hello and proof replayed by a process without x's key: the server's nonce is
        // new, so the proof no longer holds.
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write_clear(&mut s, &hello);
        assert!(matches!(read_clear(&mut s), secure::Handshake::Challenge { .. }));
        write_clear(&mut s, &proof);
        assert!(matches!(read_clear(&mut s), secure::Handshake::Refused { .. }));
    }

    #[test]
    fn strangers_sending_a_byte_now_and_then_do_not_keep_members_out() {
        let (_store, me, x) = store();
        let addr = format!("127.0.0.1:{}", me.addr.port());
        // Twice as many slow connections as handshakes are allowed, each trickling bytes.
        let mut slow: Vec<TcpStream> = (0..2 * MAX_HANDSHAKES).map(|_| TcpStream::connect(&addr).unwrap()).collect();
        for s in &mut slow {
            let _ = s.write_all(&[1]);
        }
        std::thread::sleep(Duration::from_millis(200));
        for s in &mut slow {
            let _ = s.write_all(&[0]);
        }
        // A member still gets in at once.
        let t0 = Instant::now();
        connect(&me, &as_("x", 7, &x)).expect("a member connects past the slow strangers");
        assert!(t0.elapsed() < HELLO_WITHIN, "{:?}", t0.elapsed());
        // And a slow stranger is cut at the handshake's deadline, however it trickles.
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t0 = Instant::now();
        let mut cut = false;
        while t0.elapsed() < Duration::from_secs(8) {
            if s.write_all(&[1]).is_err() {
                cut = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        assert!(cut, "a trickling handshake is cut");
        assert!(t0.elapsed() < HELLO_WITHIN + Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_flood_of_handshakes_from_one_address_never_cuts_a_members_handshake_from_another() {
        // Issue 34 (Medium): strangers opening handshakes faster than members evicted a member's
        // handshake in progress (the oldest was cut for any newer one).
        let (_store, me, x) = store();
        let (port, me_key) = (me.addr.port(), me.key);
        // The member, from 127.0.0.2, starts its handshake and waits in it.
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.bind(&"127.0.0.2:0".parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
        sock.connect(&format!("127.0.0.1:{port}").parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
        let mut s: TcpStream = sock.into();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let nonce = "22".repeat(32);
        write_clear(
            &mut s,
            &secure::Handshake::Hello { round: 7, node: "x".into(), to: "me".into(), nonce: nonce.clone() },
        );
        let secure::Handshake::Challenge { nonce: server_nonce, .. } = read_clear(&mut s) else {
            panic!("a challenge")
        };
        // Strangers from 127.0.0.1: twice the whole bound, each registered (a byte sent).
        let addr = format!("127.0.0.1:{port}");
        let mut flood: Vec<TcpStream> = (0..2 * MAX_HANDSHAKES).map(|_| TcpStream::connect(&addr).unwrap()).collect();
        for f in &mut flood {
            let _ = f.write_all(&[1]);
        }
        std::thread::sleep(Duration::from_millis(300));
        // The member's handshake is still open: its proof is taken.
        let (cn, sn) = (secure::parse_public(&nonce).unwrap(), secure::parse_public(&server_nonce).unwrap());
        let xk = secure::parse_public(&x.public_hex()).unwrap();
        let keys = secure::session(
            &x.shared_with(&me_key).unwrap(),
            &secure::Transcript {
                round: 7,
                client: "x",
                server: "me",
                client_key: &xk,
                server_key: &me_key,
                client_nonce: &cn,
                server_nonce: &sn,
            },
        );
        write_clear(&mut s, &secure::Handshake::Proof { proof: rlaunch_rendezvous::identity::hex(&keys.client_proof) });
        let mut head = [0u8; 4];
        s.read_exact(&mut head).expect("the member's handshake survived the flood: the sealed welcome came");
        drop(flood);
    }

    #[test]
    fn copies_are_taken_only_from_the_node_this_one_is_the_buddy_of() {
        // Ring me -> x -> y -> me: y's copies come here, x's go to y.
        let store = SnapStore::start(1 << 20, Default::default()).unwrap();
        let port = store.serve_peers(&HostPort::new("127.0.0.1", 0).unwrap()).unwrap();
        let addr: HostPort = format!("127.0.0.1:{port}").parse().unwrap();
        let (x, y) = (Arc::new(Identity::generate().unwrap()), Arc::new(Identity::generate().unwrap()));
        let members = [
            member("me", 0, Some(addr.clone()), store.shared.identity().unwrap()),
            member("x", 2, None, &x),
            member("y", 4, None, &y),
        ];
        store.begin_peer_round(7, "me", &members);
        let me = Peer {
            id: "me".into(),
            addr,
            key: secure::parse_public(&store.shared.identity().unwrap().public_hex()).unwrap(),
        };
        let put6 = |ch: &mut Channel, rank: u32| -> Answer {
            ch.send(&Msg::Put { tag: 7, step: 1, rank, world: 6, len: 1 }).unwrap();
            let file = super::super::memfd().unwrap();
            std::os::unix::fs::FileExt::write_all_at(&file, b"p", 0).unwrap();
            ch.send_file(&file, 1).unwrap();
            ch.recv().unwrap()
        };
        let a = put6(&mut connect(&me, &as_("x", 7, &x)).unwrap(), 2);
        assert!(!a.ok && a.error.as_deref().is_some_and(|e| e.contains("not node x's buddy")), "{a:?}");
        assert!(store.inventory().is_empty());
        let a = put6(&mut connect(&me, &as_("y", 7, &y)).unwrap(), 4);
        assert!(a.ok, "{a:?}");
    }

    #[test]
    fn a_fetch_cut_off_mid_part_is_tried_again_and_its_first_reservation_does_not_stand_in_its_way() {
        // Issue 34 (Low): a fetch whose transfer was cut after it reserved room tried again and
        // was refused by its own leftover reservation ("being saved by another request").
        let (holder, me, x) = store();
        let part = vec![7u8; 1 << 20];
        put(&mut connect(&me, &as_("x", 7, &x)).unwrap(), 7, 2, &part).unwrap();
        // A relay that cuts its first connection after 64 kB from the holder, then relays whole.
        let relay = TcpListener::bind("127.0.0.1:0").unwrap();
        let via: HostPort = format!("127.0.0.1:{}", relay.local_addr().unwrap().port()).parse().unwrap();
        let target = format!("127.0.0.1:{}", me.addr.port());
        std::thread::spawn(move || {
            for (n, client) in relay.incoming().enumerate() {
                let Ok(client) = client else { return };
                let server = TcpStream::connect(&target).unwrap();
                let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c_in, &mut s_out);
                });
                let (mut s_in, mut c_out) = (server, client);
                std::thread::spawn(move || {
                    let limit = if n == 0 { 64 << 10 } else { u64::MAX };
                    let _ = std::io::copy(&mut (&mut s_in).take(limit), &mut c_out);
                    let _ = c_out.shutdown(std::net::Shutdown::Both);
                    let _ = s_in.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        // The fetching node: x, in a round whose plan restores that part from `me`, its store
        // reserving room as a load does.
        let fetcher = SnapStore::start(1 << 30, Default::default()).unwrap();
        let key = Key { tag: 7, step: 1, rank: 2 };
        let mut holder_listing = member("me", 0, Some(me.addr.clone()), holder.shared.identity().unwrap());
        holder_listing.snapshots = vec![SnapshotSet { tag: 7, step: 1, world: 4, ranks: vec![(0, 4)] }];
        let fetching = member("x", 2, Some(via.clone()), &x);
        fetcher.begin_peer_round(8, "x", &[holder_listing, fetching]);
        let shared = &fetcher.shared;
        let granted = std::cell::Cell::new(None);
        let peer = Peer { addr: via, ..me.clone() };
        let (world, len, file) = fetch(
            &peer,
            &as_("x", 7, &x),
            key,
            Instant::now() + Duration::from_secs(20),
            |world, len| {
                let (file, generation) = super::super::fetch_room(shared, key, "me", world, len)?;
                granted.set(Some(generation));
                Ok(file)
            },
            || {
                if let Some(generation) = granted.take() {
                    shared.ask(Input::Abandon { key, generation });
                }
            },
        )
        .expect("the second try fetches the part");
        let mut got = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&*file, &mut got, 0).unwrap();
        assert_eq!((world, got == part), (4, true));
        drop(holder);
    }

    #[test]
    fn a_member_that_never_answers_holds_up_no_copy_to_the_buddy() {
        // Issue 34 (Medium): one replicator thread sent copies and announcements in order, so a
        // member that accepted connections and never answered stalled every later copy to the
        // buddy (and with it every commit) for the handshake's deadline, again at each step.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let silent_addr: HostPort = format!("127.0.0.1:{}", silent.local_addr().unwrap().port()).parse().unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for c in silent.incoming() {
                held.extend(c.ok()); // accepted, never read or written
            }
        });
        let me = SnapStore::start(1 << 20, Default::default()).unwrap();
        let me_addr: HostPort =
            format!("127.0.0.1:{}", me.serve_peers(&HostPort::new("127.0.0.1", 0).unwrap()).unwrap()).parse().unwrap();
        let buddy = SnapStore::start(1 << 20, Default::default()).unwrap();
        let buddy_addr: HostPort =
            format!("127.0.0.1:{}", buddy.serve_peers(&HostPort::new("127.0.0.1", 0).unwrap()).unwrap())
                .parse()
                .unwrap();
        let s = Identity::generate().unwrap();
        let members = [
            member("me", 0, Some(me_addr), me.shared.identity().unwrap()),
            member("buddy", 2, Some(buddy_addr), buddy.shared.identity().unwrap()),
            member("silent", 4, Some(silent_addr), &s),
        ];
        me.begin_peer_round(7, "me", &members);
        buddy.begin_peer_round(7, "buddy", &members);
        let save = |step: u64| {
            for rank in 0..2 {
                super::super::reserve(&me.shared, 1, step, rank, 6, 64).unwrap();
                super::super::commit(&me.shared, 1, step, rank).unwrap();
            }
        };
        let on_buddy = |step: u64| buddy.inventory().iter().any(|set| set.step == step && set.ranks == [(0, 2)]);
        let wait = |step: u64| {
            let t = Instant::now();
            while !on_buddy(step) {
                assert!(t.elapsed() < Duration::from_secs(10), "step {step} never reached the buddy");
                std::thread::sleep(Duration::from_millis(5));
            }
            t.elapsed()
        };
        save(1);
        wait(1);
        // Step 1 is whole here and on the buddy: its announcement now waits on the silent member.
        std::thread::sleep(Duration::from_millis(100));
        for step in 2..=4 {
            save(step);
            let took = wait(step);
            assert!(took < Duration::from_secs(1), "step {step}'s copy waited {took:?} behind the silent member");
        }
    }

    #[test]
    fn a_copy_cut_short_is_never_held() {
        let (store, me, x) = store();
        let mut ch = connect(&me, &as_("x", 7, &x)).unwrap();
        ch.send(&Msg::Put { tag: 7, step: 1, rank: 3, world: 4, len: 1000 }).unwrap();
        drop(ch);
        // The server notices the close; the reservation goes, nothing is in the inventory.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let reserved = store.shared.lock().core.used() > 0;
            if !reserved {
                break;
            }
            assert!(Instant::now() < deadline, "the half copy was abandoned");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(store.inventory().is_empty());
    }
}
