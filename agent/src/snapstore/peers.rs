//! The snapshot store between agents: copies of parts to the buddy, parts fetched by a node
//! that restores them, and "this step is whole here and on my buddy" announcements, over TCP.
//!
//! A connection opens with a hello naming the round, the node and a proof: a digest of the
//! round's peer key (which the rendezvous answers only to the round's members) and the node's
//! id. A node that is not a member of the round this agent runs, or that cannot prove it, is
//! refused; so is any request about a round other than the current one. Frames are a
//! little-endian `u32` length and JSON; a part's bytes follow its frame raw.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Weak};
use std::time::Duration;

use rlaunch::contract::HostPort;
use rlaunch::snapshot::Answer;
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use super::{NodeId, Shared};
use crate::snapshots::holdings::Key;
use crate::snapshots::Event;

const CONNECT_WITHIN: Duration = Duration::from_secs(3);
/// A peer silent this long on a connection is given up.
const IO_WITHIN: Duration = Duration::from_secs(30);
const MAX_FRAME: usize = 64 * 1024;
const CHUNK: usize = 4 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Msg {
    Hello {
        round: u64,
        node: String,
        proof: String,
    },
    /// A copy of `rank`'s part of `step`: `len` bytes follow.
    Put {
        tag: u64,
        step: u64,
        rank: u32,
        world: u32,
        len: u64,
    },
    /// The answer's `len` bytes follow it.
    Get {
        tag: u64,
        step: u64,
        rank: u32,
    },
    /// Every part the sender's ranks saved for `step` is held on the sender and its buddy.
    Complete {
        tag: u64,
        step: u64,
    },
}

/// How this node introduces itself to the round's other members.
#[derive(Debug, Clone)]
pub(crate) struct Hello {
    round: u64,
    node: String,
    proof: String,
}

impl Hello {
    pub(crate) fn new(round: u64, node: &str, key: &str) -> Hello {
        Hello { round, node: node.to_owned(), proof: proof(key, round, node) }
    }
}

fn proof(key: &str, round: u64, node: &str) -> String {
    rlaunch_rendezvous::identity::digest(&format!("rlaunch-snapshot-peer\n{key}\n{round}\n{node}"))
}

/// Work for the replicator thread.
pub(crate) enum Job {
    Copy { key: Key, world: u32, len: u64, file: Arc<File>, to: (NodeId, HostPort), hello: Hello },
    Announce { tag: u64, step: u64, to: Vec<HostPort>, hello: Hello },
}

fn write_frame(s: &mut TcpStream, v: &impl Serialize) -> io::Result<()> {
    let body = serde_json::to_vec(v).map_err(io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    s.write_all(&frame)
}

fn read_frame<T: for<'de> Deserialize<'de>>(s: &mut TcpStream) -> io::Result<T> {
    let mut head = [0u8; 4];
    s.read_exact(&mut head)?;
    let len = u32::from_le_bytes(head) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn answered(s: &mut TcpStream) -> io::Result<Answer> {
    let a: Answer = read_frame(s)?;
    if !a.ok {
        return Err(io::Error::other(a.error.unwrap_or_else(|| "refused".into())));
    }
    Ok(a)
}

fn connect(addr: &HostPort, hello: &Hello) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address"));
    for a in (addr.host(), addr.port()).to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, CONNECT_WITHIN) {
            Ok(mut s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(IO_WITHIN))?;
                s.set_write_timeout(Some(IO_WITHIN))?;
                write_frame(
                    &mut s,
                    &Msg::Hello { round: hello.round, node: hello.node.clone(), proof: hello.proof.clone() },
                )?;
                answered(&mut s)?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Sends `len` bytes of `file` from its start (the kernel copies them, no user buffer).
fn send_file(s: &TcpStream, file: &File, len: u64) -> io::Result<()> {
    let mut offset: libc::off_t = 0;
    while (offset as u64) < len {
        let count = ((len - offset as u64) as usize).min(1 << 30);
        // SAFETY: both descriptors are open for the call; offset is a valid pointer.
        let n = unsafe { libc::sendfile(s.as_raw_fd(), file.as_raw_fd(), &mut offset, count) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the part is shorter than its length"));
        }
    }
    Ok(())
}

/// Reads `len` bytes from `s` into `file` from its start.
fn receive_into(s: &mut TcpStream, file: &File, len: u64) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK.min(len as usize).max(1)];
    let mut at = 0u64;
    while at < len {
        let want = ((len - at) as usize).min(buf.len());
        let n = s.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed inside a part"));
        }
        std::os::unix::fs::FileExt::write_all_at(file, &buf[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

fn drain(s: &mut TcpStream, len: u64) -> io::Result<()> {
    io::copy(&mut Read::by_ref(s).take(len), &mut io::sink()).map(|_| ())
}

/// Fetches `key`'s part from the member at `addr`: its world, length and a buffer holding it.
pub(crate) fn fetch(addr: &HostPort, hello: &Hello, key: Key) -> io::Result<(u32, u64, File)> {
    // The holder may still be starting this round: its answer "not this round" is waited out.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match fetch_once(addr, hello, key) {
            Ok(got) => return Ok(got),
            Err(e) if std::time::Instant::now() < deadline => {
                debug!(error = %e, "fetching a snapshot part; trying again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

fn fetch_once(addr: &HostPort, hello: &Hello, key: Key) -> io::Result<(u32, u64, File)> {
    let mut s = connect(addr, hello)?;
    write_frame(&mut s, &Msg::Get { tag: key.tag, step: key.step, rank: key.rank })?;
    let a = answered(&mut s)?;
    let (world, len) = (a.world.unwrap_or(0), a.len.unwrap_or(0));
    let file = super::memfd()?;
    file.set_len(len)?;
    receive_into(&mut s, &file, len)?;
    Ok((world, len, file))
}

/// The replicator: sends copies and announcements in order, one connection per member kept
/// open. A copy of a part whose rank already has a newer one waiting is skipped (the newer
/// commits instead).
pub(crate) fn replicate(jobs: Receiver<Job>, shared: Weak<Shared>) {
    let mut conns: HashMap<(String, u64), TcpStream> = HashMap::new();
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
            Job::Copy { key, world, len, file, to, hello } => {
                let newer = queue.iter().any(|j| {
                    matches!(j, Job::Copy { key: k, .. } if k.tag == key.tag && k.rank == key.rank && k.step > key.step)
                });
                if newer {
                    continue;
                }
                let result = with_conn(&mut conns, &to.1, &hello, |s| {
                    let (tag, step, rank) = (key.tag, key.step, key.rank);
                    write_frame(s, &Msg::Put { tag, step, rank, world, len })?;
                    send_file(s, &file, len)?;
                    answered(s).map(|_| ())
                });
                drop(file);
                match result {
                    Ok(()) => {
                        let Some(shared) = shared.upgrade() else { return };
                        acked(&shared, key, to.0);
                    }
                    Err(e) if said.insert((to.0.clone(), key.tag)) => warn!(
                        rank = key.rank,
                        step = key.step,
                        buddy = %to.0,
                        error = %e,
                        "a snapshot part was not copied to the buddy: steps are not committed while it is unreachable (said once per round)"
                    ),
                    Err(e) => debug!(rank = key.rank, step = key.step, error = %e, "a snapshot part was not copied"),
                }
            }
            Job::Announce { tag, step, to, hello } => {
                for addr in to {
                    let r = with_conn(&mut conns, &addr, &hello, |s| {
                        write_frame(s, &Msg::Complete { tag, step })?;
                        answered(s).map(|_| ())
                    });
                    if let Err(e) = r {
                        debug!(%addr, step, error = %e, "announcing a whole step");
                    }
                }
            }
        }
    }
}

/// Runs `f` on the open connection to `addr` for this round, or a new one; a failure on an old
/// connection is tried once more on a new one.
fn with_conn(
    conns: &mut HashMap<(String, u64), TcpStream>,
    addr: &HostPort,
    hello: &Hello,
    mut f: impl FnMut(&mut TcpStream) -> io::Result<()>,
) -> io::Result<()> {
    let id = (addr.to_string(), hello.round);
    conns.retain(|(_, round), _| *round == hello.round);
    if let Some(mut s) = conns.remove(&id) {
        if f(&mut s).is_ok() {
            conns.insert(id, s);
            return Ok(());
        }
    }
    let mut s = connect(addr, hello)?;
    f(&mut s)?;
    conns.insert(id, s);
    Ok(())
}

/// The buddy holds `key`'s copy: the ledger hears it, and once every rank of this node has
/// its part of the step at home and on the buddy, the other members are told.
fn acked(shared: &Shared, key: Key, buddy: NodeId) {
    let mut st = shared.lock();
    st.heard(key.tag, [Event::Held { step: key.step, rank: key.rank, node: buddy }]);
    let Some(round) = st.round.as_mut().filter(|r| r.tag == key.tag) else { return };
    let ranks = round.ranks.clone();
    let done = round.acked.entry(key.step).or_default();
    done.insert(key.rank);
    if !ranks.clone().all(|r| done.contains(&r)) {
        return;
    }
    round.acked.retain(|s, _| *s > key.step);
    let Some(peers) = &round.peers else { return };
    let to: Vec<HostPort> = peers.members.iter().filter(|m| m.id != round.me).filter_map(|m| m.addr.clone()).collect();
    let hello = Hello::new(round.tag, &round.me, &peers.key);
    let _ = shared.outbox.send(Job::Announce { tag: key.tag, step: key.step, to, hello });
}

/// Most peer connections served at once: a member talks to each other member over one
/// connection, plus fetches; anything past this is closed at once.
const MAX_PEER_CONNECTIONS: usize = 512;
/// A connection's hello must come within this.
const HELLO_WITHIN: Duration = Duration::from_secs(5);

pub(crate) fn accept(listener: TcpListener, shared: Arc<Shared>) {
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for conn in listener.incoming() {
        match conn {
            Ok(s) => {
                if open.load(std::sync::atomic::Ordering::SeqCst) >= MAX_PEER_CONNECTIONS {
                    debug!("too many snapshot peer connections: one closed");
                    continue;
                }
                open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (shared, held) = (shared.clone(), open.clone());
                let spawned = std::thread::Builder::new().name("snapshot-peer".into()).spawn(move || {
                    if let Err(e) = serve(s, &shared) {
                        debug!(error = %e, "a snapshot peer connection ended");
                    }
                    held.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
                if let Err(e) = spawned {
                    open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
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

fn refuse(s: &mut TcpStream, why: String) -> io::Result<()> {
    write_frame(s, &Answer::refused(why))
}

fn ok(s: &mut TcpStream, a: Answer) -> io::Result<()> {
    write_frame(s, &Answer { ok: true, ..a })
}

/// Whether two digests are equal, in time independent of where they differ.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn serve(mut s: TcpStream, shared: &Shared) -> io::Result<()> {
    s.set_read_timeout(Some(HELLO_WITHIN))?;
    s.set_write_timeout(Some(IO_WITHIN))?;
    s.set_nodelay(true)?;
    let Msg::Hello { round, node, proof: presented } = read_frame(&mut s)? else {
        return refuse(&mut s, "a connection starts with a hello".into());
    };
    // Who the peer is, checked against the round this agent runs.
    let (ranks, round_world) = {
        let st = shared.lock();
        let member = st.round.as_ref().filter(|r| r.tag == round).and_then(|r| {
            let p = r.peers.as_ref()?;
            let m = p.member(&node).filter(|m| m.id != r.me)?;
            same(&proof(&p.key, round, &node), &presented).then(|| (m.ranks.clone(), r.world))
        });
        match member {
            Some(r) => r,
            None => {
                drop(st);
                return refuse(&mut s, format!("node {node} is not a proven member of round {round} here"));
            }
        }
    };
    ok(&mut s, Answer::default())?;
    // A member's connection stays open between steps: quiet for minutes is fine.
    s.set_read_timeout(Some(IO_WITHIN.saturating_mul(20)))?;
    loop {
        let msg: Msg = match read_frame(&mut s) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        // Every request is about the round the hello named, which must still be this agent's.
        let current = shared.lock().round.as_ref().is_some_and(|r| r.tag == round);
        match msg {
            Msg::Hello { .. } => return refuse(&mut s, "one hello per connection".into()),
            Msg::Put { tag, step, rank, world, len } => {
                let key = Key { tag, step, rank };
                let why = if !current || tag != round {
                    Some(format!("round {tag} is not the one this node runs"))
                } else if !ranks.contains(&rank) {
                    Some(format!("rank {rank} is not node {node}'s"))
                } else if world != round_world {
                    Some(format!("a world of {world}: round {round} has {round_world} ranks"))
                } else {
                    None
                };
                let file = match why {
                    Some(w) => Err(w),
                    None => super::buffer_for(shared, key, world, len),
                };
                match file {
                    Err(why) => {
                        drain(&mut s, len)?;
                        refuse(&mut s, why)?;
                    }
                    Ok(file) => {
                        if let Err(e) = receive_into(&mut s, &file, len) {
                            super::abandon(shared, key);
                            return Err(e);
                        }
                        drop(file);
                        if super::commit_copy(shared, key, &node) {
                            ok(&mut s, Answer::default())?;
                        } else {
                            refuse(&mut s, "the round ended while the copy came".into())?;
                        }
                    }
                }
            }
            Msg::Get { tag, step, rank } => {
                let key = Key { tag, step, rank };
                let found = {
                    let st = shared.lock();
                    let part = st.holdings.get(&key).copied().filter(|p| p.whole);
                    part.and_then(|p| Some((p, st.buffers.get(&key)?.clone())))
                };
                match found.filter(|_| current) {
                    Some((part, file)) => {
                        ok(&mut s, Answer { world: Some(part.world), len: Some(part.len), ..Answer::default() })?;
                        send_file(&s, &file, part.len)?;
                    }
                    None => {
                        refuse(&mut s, format!("rank {rank}'s part of step {step} (round {tag}) is not held here"))?
                    }
                }
            }
            Msg::Complete { tag, step } => {
                let mut st = shared.lock();
                let events = st.round.as_ref().filter(|r| r.tag == tag && tag == round).and_then(|r| {
                    let p = r.peers.as_ref()?;
                    let buddy = p.buddy_of(&node)?.id.clone();
                    Some(
                        ranks
                            .clone()
                            .flat_map(|rank| {
                                [
                                    Event::Held { step, rank, node: node.clone() },
                                    Event::Held { step, rank, node: buddy.clone() },
                                ]
                            })
                            .collect::<Vec<_>>(),
                    )
                });
                if let Some(events) = events {
                    st.heard(tag, events);
                }
                drop(st);
                ok(&mut s, Answer::default())?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapstore::SnapStore;
    use rlaunch::contract::Member;

    fn member(id: &str, offset: u32, addr: Option<HostPort>) -> Member {
        Member {
            node_id: id.into(),
            group_rank: offset / 2,
            local_world_size: 2,
            rank_offset: offset,
            store_addr: "127.0.0.1:1".parse().unwrap(),
            probe_addr: None,
            snapshot_addr: addr,
            snapshots: Vec::new(),
        }
    }

    /// This node (`me`, ranks 0 and 1) in round 7 with a peer `x` (ranks 2 and 3).
    fn store() -> (SnapStore, HostPort) {
        let store = SnapStore::start(1 << 20, Default::default()).unwrap();
        let port = store.serve_peers("127.0.0.1:0").unwrap();
        let addr: HostPort = format!("127.0.0.1:{port}").parse().unwrap();
        store.begin_peer_round(7, "me", &[member("me", 0, Some(addr.clone())), member("x", 2, None)], "key".into());
        (store, addr)
    }

    fn put(s: &mut TcpStream, tag: u64, rank: u32, bytes: &[u8]) -> io::Result<Answer> {
        write_frame(s, &Msg::Put { tag, step: 1, rank, world: 4, len: bytes.len() as u64 })?;
        s.write_all(bytes)?;
        read_frame(s)
    }

    #[test]
    fn only_a_proven_member_of_the_current_round_is_served_and_only_for_its_own_ranks() {
        let (store, addr) = store();
        // Not a member, a wrong key, another round, and this node's own id: refused at the hello.
        for hello in [
            Hello::new(7, "y", "key"),
            Hello::new(7, "x", "guess"),
            Hello::new(6, "x", "key"),
            Hello::new(7, "me", "key"),
        ] {
            let e = connect(&addr, &hello).unwrap_err();
            assert!(e.to_string().contains("not a proven member"), "{hello:?}: {e}");
        }
        let mut s = connect(&addr, &Hello::new(7, "x", "key")).unwrap();
        // A copy of a rank that is not x's, or of another round: refused, and nothing held.
        let a = put(&mut s, 7, 0, b"forged").unwrap();
        assert!(!a.ok && a.error.as_deref().is_some_and(|e| e.contains("not node x's")), "{a:?}");
        let a = put(&mut s, 6, 2, b"stale").unwrap();
        assert!(!a.ok, "{a:?}");
        assert!(store.inventory().is_empty());
        // Its own rank's copy is held, whole, and can be fetched back.
        let a = put(&mut s, 7, 2, b"part of rank 2").unwrap();
        assert!(a.ok, "{a:?}");
        let held = store.inventory();
        assert_eq!(held.len(), 1);
        assert_eq!((held[0].tag, held[0].step, held[0].ranks.clone()), (7, 1, vec![(2, 3)]));
        let (world, len, file) =
            fetch_once(&addr, &Hello::new(7, "x", "key"), Key { tag: 7, step: 1, rank: 2 }).unwrap();
        let mut got = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut got, 0).unwrap();
        assert_eq!((world, got.as_slice()), (4, &b"part of rank 2"[..]));
        // A part nobody holds is refused, not invented.
        assert!(fetch_once(&addr, &Hello::new(7, "x", "key"), Key { tag: 7, step: 2, rank: 2 }).is_err());
    }

    #[test]
    fn a_copy_cut_short_is_never_held() {
        let (store, addr) = store();
        let mut s = connect(&addr, &Hello::new(7, "x", "key")).unwrap();
        write_frame(&mut s, &Msg::Put { tag: 7, step: 1, rank: 3, world: 4, len: 1000 }).unwrap();
        s.write_all(&[1u8; 10]).unwrap();
        drop(s);
        // The server notices the close; the reservation goes, nothing is in the inventory.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let st = store.shared.lock();
            let reserved = st.holdings.get(&Key { tag: 7, step: 1, rank: 3 }).is_some();
            drop(st);
            if !reserved {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the half copy was abandoned");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(store.inventory().is_empty());
    }
}
