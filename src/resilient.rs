//! Survivors keep their process: the part of a program that runs again, in the same process,
//! when the job re-forms (the Rust side of Python's `rlaunch.resilient`).
//!
//! ```no_run
//! # fn build_model() -> Vec<f32> { vec![0.0; 4] }
//! let mut params = build_model(); // once per process: data, the model, a device context
//! rlaunch::resilient::run(|| -> anyhow::Result<()> {
//!     // each round: the process group from the round's environment, the state
//!     let mut pg = rlaunch::worker::init_from_env()?;
//!     if let Some(snap) = rlaunch::snapshot::load()? {
//!         rlaunch::snapshot::read_f32s(snap.get("params").unwrap(), &mut params)?;
//!     }
//!     for step in 0..100u64 {
//!         pg.all_reduce(&mut params, rlaunch::comm::ReduceOp::Avg)?;
//!         rlaunch::snapshot::save(step, &[("params", rlaunch::snapshot::f32_bytes(&params))])?;
//!     }
//!     Ok(())
//! })
//! # .unwrap();
//! ```
//!
//! Under rlaunch in an elastic job, when the job re-forms because of something elsewhere (a node
//! lost or joining, a worker failing on another node), the agent tells this process over the
//! `RLAUNCH_CONTROL` socket that its round ended. A thread of this module then closes snapshot
//! saves (a save answers `Ok(false)` until the function runs again), ends every collective in
//! flight ([`crate::comm::abort_all`], and the process's TCP connections to the round's hosts
//! shut down, which also ends a bootstrap waiting on the store), the function's error is taken
//! for the round's end, and once the next round closes the environment (`RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`/`PORT`, `TORCHELASTIC_RESTART_COUNT`, ...) is exactly what a fresh worker of that
//! round gets and the function runs again. Its state comes back from `rlaunch::snapshot`.
//!
//! An error that is not the round's (the word did not come, and no collective failed) is the
//! program's own: it is returned, and the worker fails as it would without this module.
//! Outside rlaunch, or when the agent cannot be reached, the function runs once.
//!
//! `rlaunch::gpu`'s NCCL groups end at a round's end too: their bootstrap's store waits stop,
//! their waits and later enqueues abort the communicator (`GpuError::Interrupted`); an
//! `ncclCommInitRank` already blocked ends only when its connections are shut down.
//!
//! The protocol (JSON, one object per line) is the agent's (`agent/src/control.rs`).

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use serde_json::{json, Value};

/// The variable that names the agent's control socket.
pub const CONTROL_ENV: &str = "RLAUNCH_CONTROL";
/// How long a failed collective waits for the agent's word that the round ended (a peer's death
/// breaks a collective before the rendezvous has seen it), in seconds.
pub const WAIT_FOR_WORD_ENV: &str = "RLAUNCH_RESILIENT_WAIT";
const WAIT_FOR_WORD: Duration = Duration::from_secs(30);
/// How long the agent has to take this worker in.
const WELCOME_WITHIN: Duration = Duration::from_secs(10);

/// From the word that a round ended until the function runs again: this process's saves are not
/// its round's.
static SAVES_CLOSED: AtomicBool = AtomicBool::new(false);

/// Whether the current round ended for this process and the function has not run again yet
/// (`rlaunch::snapshot::save` then answers `Ok(false)`).
pub fn saves_closed() -> bool {
    SAVES_CLOSED.load(Ordering::SeqCst)
}

#[derive(Default)]
struct Heard {
    welcome: bool,
    closed: bool,
    /// The round that ended and its hosts, until this process parks.
    ended: Option<u64>,
    rounds_ended: u64,
    /// The next round's environment.
    resume: Option<Vec<(String, String)>>,
}

struct Control {
    sock: UnixStream,
    heard: Mutex<Heard>,
    changed: Condvar,
}

impl Control {
    fn connect(path: &str, local_rank: u32) -> std::io::Result<Arc<Control>> {
        let sock = UnixStream::connect(path)?;
        sock.set_write_timeout(Some(Duration::from_secs(5)))?;
        // TCP connections this process had before the function first ran are never a round's
        // collectives: a round's end leaves them alone.
        let keep: HashSet<u64> = tcp_connections().into_iter().map(|c| c.inode).collect();
        let ctl = Arc::new(Control { sock: sock.try_clone()?, heard: Mutex::default(), changed: Condvar::new() });
        ctl.send(&json!({"hello": {"local_rank": local_rank, "pid": std::process::id()}}))?;
        let reader = ctl.clone();
        std::thread::Builder::new().name("rlaunch-resilient".into()).spawn(move || reader.read(sock, keep))?;
        let heard = ctl.heard.lock().unwrap_or_else(PoisonError::into_inner);
        let (heard, _) = ctl
            .changed
            .wait_timeout_while(heard, WELCOME_WITHIN, |h| !h.welcome && !h.closed)
            .unwrap_or_else(PoisonError::into_inner);
        if !heard.welcome {
            return Err(std::io::Error::other("the agent did not take this worker in"));
        }
        drop(heard);
        Ok(ctl)
    }

    fn send(&self, msg: &Value) -> std::io::Result<()> {
        (&self.sock).write_all(format!("{msg}\n").as_bytes())
    }

    fn read(&self, sock: UnixStream, keep: HashSet<u64>) {
        for line in BufReader::new(sock).lines() {
            let Ok(line) = line else { break };
            let Ok(msg) = serde_json::from_str::<Value>(&line) else { break };
            if msg.get("welcome").is_some() {
                self.update(|h| h.welcome = true);
            } else if let Some(end) = msg.get("end") {
                // Under the lock, so that a round beginning (`begin_round`) sees all of it or
                // none: saves closed, every collective and bootstrap ended (and whatever
                // starts before the next round), the end noted. Then the connections.
                let round = end["round"].as_u64().unwrap_or(0);
                self.update(|h| {
                    SAVES_CLOSED.store(true, Ordering::SeqCst);
                    crate::comm::abort_all();
                    h.ended = Some(round);
                    h.rounds_ended += 1;
                });
                let hosts: Vec<String> = end["hosts"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|h| h.as_str().map(str::to_owned)).collect())
                    .unwrap_or_default();
                let shut = interrupt_connections(&hosts, &keep);
                tracing::debug!(shut, "rlaunch::resilient: the round ended");
            } else if let Some(resume) = msg.get("resume") {
                let env = resume["env"]
                    .as_object()
                    .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned()))).collect())
                    .unwrap_or_default();
                self.update(|h| h.resume = Some(env));
            }
        }
        self.update(|h| h.closed = true);
    }

    fn update(&self, f: impl FnOnce(&mut Heard)) {
        f(&mut self.heard.lock().unwrap_or_else(PoisonError::into_inner));
        self.changed.notify_all();
    }

    fn rounds_ended(&self) -> u64 {
        self.heard.lock().unwrap_or_else(PoisonError::into_inner).rounds_ended
    }

    /// Begins a run of the function: saves and collectives open again, after a round's end
    /// groups named afresh, and the count of ends so far. None when an end was heard since the
    /// last resume (the round about to run is over already: park again without running).
    fn begin_round(&self) -> Option<u64> {
        let heard = self.heard.lock().unwrap_or_else(PoisonError::into_inner);
        if heard.ended.is_some() {
            return None;
        }
        SAVES_CLOSED.store(false, Ordering::SeqCst);
        crate::comm::clear_abort();
        if heard.rounds_ended > 0 {
            // Not before the first run: groups the program made before it are of this round.
            crate::worker::new_round();
        }
        Some(heard.rounds_ended)
    }

    fn wait_for_end(&self, within: Duration) -> bool {
        let heard = self.heard.lock().unwrap_or_else(PoisonError::into_inner);
        let (heard, _) = self
            .changed
            .wait_timeout_while(heard, within, |h| h.ended.is_none() && !h.closed)
            .unwrap_or_else(PoisonError::into_inner);
        heard.ended.is_some()
    }

    /// Says this process ended its round; waits for the next. The next round's environment, or
    /// None when the agent went away.
    fn park(&self) -> Option<Vec<(String, String)>> {
        let round = self.heard.lock().unwrap_or_else(PoisonError::into_inner).ended?;
        self.send(&json!({"parked": {"round": round}})).ok()?;
        let heard = self.heard.lock().unwrap_or_else(PoisonError::into_inner);
        let mut heard =
            self.changed.wait_while(heard, |h| h.resume.is_none() && !h.closed).unwrap_or_else(PoisonError::into_inner);
        let resume = heard.resume.take();
        // An end heard after the resume is the next round's: kept.
        if heard.ended == Some(round) {
            heard.ended = None;
        }
        resume
    }
}

/// The agent's control connection, made once; None outside rlaunch or where it fails.
fn control() -> Option<Arc<Control>> {
    static CONTROL: OnceLock<Option<Arc<Control>>> = OnceLock::new();
    CONTROL
        .get_or_init(|| {
            let path = std::env::var(CONTROL_ENV).ok().filter(|p| !p.is_empty())?;
            let local_rank = std::env::var(crate::env::LOCAL_RANK).ok().and_then(|v| v.parse().ok()).unwrap_or(0);
            match Control::connect(&path, local_rank) {
                Ok(c) => Some(c),
                Err(e) => {
                    eprintln!("rlaunch::resilient: cannot reach the agent ({e}); the function runs once");
                    None
                }
            }
        })
        .clone()
}

/// Runs `f` again in the same process each time the job re-forms (see the module). Returns what
/// the last run returned: its value, or an error that was not a round's end.
pub fn run<T, E: std::fmt::Display>(mut f: impl FnMut() -> Result<T, E>) -> Result<T, E> {
    let Some(ctl) = control() else { return f() };
    loop {
        let Some(seen) = ctl.begin_round() else {
            // Ended before it ran: park again. Should the agent be gone (the job is ending),
            // the function runs as a plain call in the ended round, where its collectives and
            // group bootstraps fail at once and its saves answer Ok(false).
            match ctl.park() {
                Some(env) => set_env(env),
                None => return f(),
            }
            continue;
        };
        let failures = crate::comm::failures();
        let err = match f() {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if ctl.rounds_ended() == seen {
            // No word yet: the round's end only if a collective failed (a peer's death is seen
            // by its connections before the rendezvous sees it), and the word then comes.
            if crate::comm::failures() == failures {
                return Err(err);
            }
            let within = std::env::var(WAIT_FOR_WORD_ENV)
                .ok()
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map_or(WAIT_FOR_WORD, Duration::from_secs_f64);
            if !ctl.wait_for_end(within) {
                return Err(err);
            }
        }
        tracing::debug!("rlaunch::resilient: the round ended ({err}); parked");
        let Some(env) = ctl.park() else { return Err(err) };
        set_env(env);
    }
}

/// The next round's environment, as a fresh worker of it gets it, set while no round runs (this
/// module's reader thread reads no variable; a program's own threads that read the environment
/// through C's `getenv` between rounds race with it, as with any `set_var`).
fn set_env(env: Vec<(String, String)>) {
    for (k, v) in env {
        std::env::set_var(k, v);
    }
}

/// One TCP connection of this process (not a listening socket).
#[derive(Debug, Clone, PartialEq, Eq)]
struct TcpConn {
    fd: i32,
    inode: u64,
    remote: IpAddr,
    /// `/proc/net/tcp`'s state, in hex (`01` established, `06` time-wait, `07` close).
    state: String,
}

/// `0100007F:1F90` (as `/proc/net/tcp` writes it: each 32-bit word in host order) -> the IP.
fn proc_net_ip(hex: &str) -> Option<IpAddr> {
    let (addr, _port) = hex.split_once(':')?;
    let raw: Vec<u8> =
        (0..addr.len()).step_by(2).map(|i| u8::from_str_radix(addr.get(i..i + 2)?, 16).ok()).collect::<Option<_>>()?;
    let mut words: Vec<u8> = Vec::with_capacity(raw.len());
    for w in raw.chunks(4) {
        let word = u32::from_ne_bytes(w.try_into().ok()?);
        words.extend_from_slice(&word.to_be_bytes());
    }
    match words.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(&words[..]).ok()?)),
        16 => {
            let v6 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&words[..]).ok()?);
            Some(v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4))
        }
        _ => None,
    }
}

/// This process's TCP connections, from `/proc/self/net/tcp{,6}` and `/proc/self/fd`.
fn tcp_connections() -> Vec<TcpConn> {
    let mut by_inode = std::collections::HashMap::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] == "0A" {
                continue; // short, or listening
            }
            if let (Some(remote), Ok(inode)) = (proc_net_ip(f[2]), f[9].parse::<u64>()) {
                by_inode.insert(inode, (remote, f[3].to_owned()));
            }
        }
    }
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return out };
    for entry in dir.flatten() {
        let (Ok(fd), Ok(target)) =
            (entry.file_name().to_string_lossy().parse::<i32>(), std::fs::read_link(entry.path()))
        else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        let inode = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')).and_then(|t| t.parse().ok());
        if let Some((remote, state)) =
            inode.and_then(|i| by_inode.get(&i).map(|v| (i, v))).map(|(i, (r, s))| ((i, *r), s.clone()))
        {
            out.push(TcpConn { fd, inode: remote.0, remote: remote.1, state });
        }
    }
    out
}

/// The addresses of `hosts` (literals or names).
fn ips(hosts: &[String]) -> HashSet<IpAddr> {
    use std::net::ToSocketAddrs;
    let mut out = HashSet::new();
    for h in hosts {
        match h.parse::<IpAddr>() {
            Ok(ip) => {
                out.insert(ip);
            }
            Err(_) => out.extend((h.as_str(), 0).to_socket_addrs().into_iter().flatten().map(|a| a.ip())),
        }
    }
    out
}

/// Shuts down (`SHUT_RDWR`; the descriptors stay open and their owners' own) this process's TCP
/// connections to `hosts` (none: every host; a loopback address stands for all of loopback),
/// except those in `keep`; a transfer waiting on any of them fails in its own thread. Answers
/// how many were shut down.
fn interrupt_connections(hosts: &[String], keep: &HashSet<u64>) -> usize {
    to_shut_down(tcp_connections(), &ips(hosts), hosts.is_empty(), keep).iter().filter(|c| shut_down(c)).count()
}

/// Which of `conns` a round's end shuts down: those to `targets` (or to any host), not kept,
/// not already closing.
fn to_shut_down(conns: Vec<TcpConn>, targets: &HashSet<IpAddr>, any_host: bool, keep: &HashSet<u64>) -> Vec<TcpConn> {
    let loopback = targets.iter().any(IpAddr::is_loopback);
    conns
        .into_iter()
        .filter(|c| !keep.contains(&c.inode) && c.state != "06" && c.state != "07")
        .filter(|c| any_host || targets.contains(&c.remote) || (loopback && c.remote.is_loopback()))
        .collect()
}

fn shut_down(c: &TcpConn) -> bool {
    // The number may have been closed and given to another file since the tables were read, or
    // be closed and reused while this runs: a duplicate pins whatever it names now, and only
    // the same socket (by inode) is touched.
    // SAFETY: F_DUPFD_CLOEXEC on a number that may be stale fails or duplicates whatever file it
    // names now; the duplicate is ours alone and closed below.
    let dup = unsafe { libc::fcntl(c.fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return false;
    }
    // SAFETY: `dup` is a descriptor this function owns, opened just above.
    let dup = unsafe { std::os::fd::OwnedFd::from_raw_fd(dup) };
    // SAFETY: fstat into a zeroed struct we own, on our own descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(dup.as_raw_fd(), &mut st) } != 0 || st.st_ino != c.inode {
        return false;
    }
    // SAFETY: shutdown(2) on our duplicate of the socket: it ends the connection for every
    // descriptor of it, and closes none.
    unsafe { libc::shutdown(dup.as_raw_fd(), libc::SHUT_RDWR) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_addresses_read_in_host_order() {
        assert_eq!(proc_net_ip("0100007F:1F90"), Some("127.0.0.1".parse().unwrap()));
        assert_eq!(proc_net_ip("0200000A:0050"), Some("10.0.0.2".parse().unwrap()));
        // An IPv4-mapped IPv6 address (a dual-stack socket) is the IPv4 address.
        assert_eq!(proc_net_ip("0000000000000000FFFF00000100007F:1F90"), Some("127.0.0.1".parse().unwrap()));
        assert_eq!(proc_net_ip("00000000000000000000000001000000:0016"), Some("::1".parse().unwrap()));
        assert_eq!(proc_net_ip("zz:1"), None);
    }

    fn conn(inode: u64, remote: &str, state: &str) -> TcpConn {
        TcpConn { fd: inode as i32, inode, remote: remote.parse().unwrap(), state: state.into() }
    }

    #[test]
    fn a_round_s_end_shuts_down_the_connections_to_its_hosts_only_and_never_the_kept() {
        let conns = vec![
            conn(1, "10.0.0.2", "01"),  // to a host of the round
            conn(2, "10.0.0.9", "01"),  // elsewhere: a data server
            conn(3, "10.0.0.2", "01"),  // to a host of the round, but made before the function
            conn(4, "10.0.0.2", "06"),  // already gone
            conn(5, "127.0.0.5", "01"), // loopback
        ];
        let keep = HashSet::from([3]);
        let inodes = |v: Vec<TcpConn>| v.into_iter().map(|c| c.inode).collect::<Vec<_>>();
        let hosts = ips(&["10.0.0.1".into(), "10.0.0.2".into()]);
        assert_eq!(inodes(to_shut_down(conns.clone(), &hosts, false, &keep)), [1]);
        // A loopback host (a job on one machine) stands for all of loopback.
        let local = ips(&["127.0.0.1".into()]);
        assert_eq!(inodes(to_shut_down(conns.clone(), &local, false, &keep)), [5]);
        // The round's hosts unknown: everything not kept.
        assert_eq!(inodes(to_shut_down(conns, &HashSet::new(), true, &keep)), [1, 2, 5]);
    }

    /// A thread blocked reading a connection to a peer that never answers (as a collective
    /// waiting on a lost host) wakes at once when the connection is shut down from another
    /// thread; the descriptor stays its owner's.
    #[test]
    fn a_reader_blocked_on_a_silent_peer_wakes_when_its_connection_is_shut_down() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut waiting = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let _peer = listener.accept().unwrap(); // open, silent: a frozen peer
        let fd = waiting.as_raw_fd();
        let found = tcp_connections().into_iter().find(|c| c.fd == fd).expect("the connection is listed");
        assert_eq!(found.remote, "127.0.0.1".parse::<IpAddr>().unwrap());
        let reader = std::thread::spawn(move || {
            let t = std::time::Instant::now();
            let mut b = [0u8; 1];
            let r = waiting.read(&mut b).map_err(|e| e.kind());
            (r, t.elapsed(), waiting)
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(shut_down(&found));
        let (r, waited, waiting) = reader.join().unwrap();
        assert_eq!(r, Ok(0), "the blocked read ends (end of stream) once its connection is shut down");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        assert_eq!(waiting.as_raw_fd(), fd, "the descriptor is still the stream's");
        // A stale number (closed since) is not touched.
        let stale = TcpConn { inode: found.inode + 1, ..found };
        assert!(!shut_down(&stale));
    }
}
