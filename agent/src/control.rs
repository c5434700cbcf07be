//! The control socket of workers that keep their process across rounds (`rlaunch.resilient`).
//!
//! A worker that opts in connects to the Unix socket named by `RLAUNCH_CONTROL` and says which
//! local rank it is. When a round ends elsewhere, the agent tells every such worker (`end`,
//! with the hosts of the round that ended); each ends its collective in flight, destroys its
//! process group and answers `parked`. Once the next round closes the agent hands each its new
//! environment (`resume`) and the same processes run the program's function again.
//!
//! Messages are JSON objects, one per line:
//!
//! ```text
//! worker -> agent   {"hello": {"local_rank": 0, "pid": 1234}}
//! agent  -> worker  {"end": {"round": 3, "hosts": ["10.0.0.1", "10.0.0.2"]}}
//! worker -> agent   {"parked": {"round": 3}}
//! agent  -> worker  {"resume": {"round": 4, "env": {"RANK": "0", ...}}}
//! ```
//!
//! Only this agent's own workers are heard: the socket lives in a directory of mode 0700, and a
//! connection's peer (`SO_PEERCRED`) must be a worker process of this node's group or run under
//! one (a launcher script's Python); its local rank is the worker's it runs under, whatever it
//! claims (`--virtual-local-rank` gives every worker `LOCAL_RANK=0`). The first connection of a
//! worker speaks for it while it lasts; the agent answers `{"welcome": {}}` to the one it took. Everything decided from this (whether to park, when to give up on a
//! worker that does not park) is the core's; this file only moves messages.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, warn};

use crate::core::Event;

/// The variable that names the control socket in a worker's environment.
pub const CONTROL_ENV: &str = "RLAUNCH_CONTROL";

/// Longest line a worker may send (a hello or a parked message is under 100 bytes).
const MAX_LINE: u64 = 4096;
/// Longest a message to a worker may take to be written.
const WRITE_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// One worker that opted in.
struct Worker {
    pid: u32,
    stream: UnixStream,
    /// The round it said it parked after.
    parked: Option<u64>,
}

#[derive(Default)]
struct State {
    /// By local rank.
    workers: BTreeMap<u32, Worker>,
    /// The current group's worker pids, by local rank: who may connect.
    pids: BTreeMap<u32, u32>,
    /// The round whose end the workers were told of, until they resume.
    parking: Option<u64>,
}

pub struct Control {
    /// Holds the socket's directory (removed on drop).
    _dir: crate::rundir::RunDir,
    socket: PathBuf,
    state: Arc<Mutex<State>>,
    events: UnboundedSender<Event>,
}

impl Control {
    /// Serves the socket; what the workers say reaches the core on `events`.
    pub fn start(events: UnboundedSender<Event>) -> std::io::Result<Control> {
        let dir = crate::rundir::RunDir::create("rlaunch-control", "control.sock".len())?;
        let socket = dir.path().join("control.sock");
        let listener = UnixListener::bind(&socket)?;
        let state = Arc::new(Mutex::new(State::default()));
        let (shared, to_core) = (state.clone(), events.clone());
        std::thread::Builder::new().name("rlaunch-control".into()).spawn(move || {
            for conn in listener.incoming() {
                let Ok(stream) = conn else { continue };
                let (shared, events) = (shared.clone(), events.clone());
                let _ = std::thread::Builder::new()
                    .name("rlaunch-control-conn".into())
                    .spawn(move || serve(stream, &shared, &events));
            }
        })?;
        Ok(Control { _dir: dir, socket, state, events: to_core })
    }

    /// What every worker's environment gets.
    pub fn worker_env(&self) -> (&'static str, String) {
        (CONTROL_ENV, self.socket.to_string_lossy().into_owned())
    }

    /// A new group of processes: only these may speak; earlier workers are forgotten (and the
    /// core hears the count again, after any word of theirs still on its way).
    pub fn new_group(&self, pids: BTreeMap<u32, u32>) {
        let mut s = lock(&self.state);
        s.workers.retain(|rank, w| pids.get(rank) == Some(&w.pid));
        s.pids = pids;
        s.parking = None;
        let _ = self.events.send(Event::OptedIn(opted(&s)));
    }

    /// A worker started at local index `rank` in place of one that failed: it may speak now.
    pub fn add_worker(&self, rank: u32, pid: u32) {
        let mut s = lock(&self.state);
        s.workers.remove(&rank);
        s.pids.insert(rank, pid);
        let _ = self.events.send(Event::OptedIn(opted(&s)));
    }

    /// Tells every worker that opted in that `round` ended; `hosts` are the round's hosts,
    /// whose connections the workers shut down (gloo's collectives end on that). The workers
    /// at the local indices in `failed` are gone: no longer heard, not waited for.
    pub fn end_round(&self, round: u64, hosts: &[String], failed: &[u32]) {
        let mut s = lock(&self.state);
        for rank in failed {
            s.pids.remove(rank);
            s.workers.remove(rank);
        }
        s.parking = Some(round);
        let msg = json!({"end": {"round": round, "hosts": hosts}});
        for (rank, w) in s.workers.iter_mut() {
            w.parked = None;
            if let Err(e) = send(&mut w.stream, &msg) {
                warn!(local_rank = rank, error = %e, "cannot tell a worker that the round ended");
            }
        }
    }

    /// Hands each parked worker its environment for `round`.
    pub fn resume(&self, round: u64, envs: &BTreeMap<u32, Vec<(String, String)>>) {
        let mut s = lock(&self.state);
        s.parking = None;
        for (rank, w) in s.workers.iter_mut() {
            w.parked = None;
            let Some(env) = envs.get(rank) else { continue };
            let env: serde_json::Map<String, Value> =
                env.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
            if let Err(e) = send(&mut w.stream, &json!({"resume": {"round": round, "env": env}})) {
                warn!(local_rank = rank, error = %e, "cannot hand a worker its next round");
            }
        }
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn send(stream: &mut UnixStream, msg: &Value) -> std::io::Result<()> {
    let mut line = msg.to_string();
    line.push('\n');
    stream.write_all(line.as_bytes())
}

/// The peer's pid, as the kernel says.
fn peer_pid(stream: &UnixStream) -> Option<u32> {
    // SAFETY: ucred is plain old data; all zeroes is a valid value of it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which we own.
    let rc = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid as u32)
}

/// Whether `pid` is `worker` or runs under it (a launcher script's child, a warm interpreter's).
fn descends_from(pid: u32, worker: u32) -> bool {
    let mut p = pid;
    for _ in 0..16 {
        if p == worker {
            return true;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { return false };
        // The parent is the second field after the command's closing parenthesis.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return false };
        match rest.split_whitespace().nth(1).and_then(|s| s.parse::<u32>().ok()) {
            Some(pp) if pp > 1 => p = pp,
            _ => return false,
        }
    }
    false
}

/// The local indices of the workers that opted in.
fn opted(s: &State) -> Vec<u32> {
    s.workers.keys().copied().collect()
}

fn serve(stream: UnixStream, shared: &Arc<Mutex<State>>, events: &UnboundedSender<Event>) {
    let Some(pid) = peer_pid(&stream) else { return };
    let Ok(reader) = stream.try_clone() else { return };
    let mut reader = BufReader::new(reader);
    // The local rank and worker pid this connection speaks for, once it said hello.
    let mut rank: Option<(u32, u32)> = None;
    loop {
        let mut line = String::new();
        let read = (&mut reader).take(MAX_LINE).read_line(&mut line);
        match read {
            Ok(0) | Err(_) => break,
            Ok(_) if !line.ends_with('\n') => {
                warn!(pid, "a worker's control message is too long; closing its connection");
                break;
            }
            Ok(_) => {}
        }
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            warn!(pid, "a worker sent a control message that is not JSON; closing its connection");
            break;
        };
        if let Some(hello) = msg.get("hello") {
            let claimed = hello.get("local_rank").and_then(Value::as_u64).and_then(|r| u32::try_from(r).ok());
            // A warm worker may say hello before the driver learnt the new group's pids: wait
            // for them a little (the lock is not held while waiting).
            let mut waited = 0;
            let mut ok = None;
            while waited < 200 {
                ok = lock(shared).pids.iter().map(|(r, w)| (*r, *w)).find(|(_, w)| descends_from(pid, *w));
                if ok.is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
                waited += 1;
            }
            let Some((r, worker)) = ok else {
                warn!(pid, claimed, "a process that is not one of this node's workers tried to opt in; refused");
                break;
            };
            let mut s = lock(shared);
            if s.workers.get(&r).is_some_and(|w| w.pid == worker) {
                warn!(pid, local_rank = r, "a second connection for a worker that already opted in; refused");
                break;
            }
            let Ok(mut writer) = stream.try_clone() else { break };
            // A worker that stops reading must not hold up the agent (writes happen on its loop).
            let _ = writer.set_write_timeout(Some(WRITE_WITHIN));
            if send(&mut writer, &json!({"welcome": {}})).is_err() {
                break;
            }
            s.workers.insert(r, Worker { pid: worker, stream: writer, parked: None });
            rank = Some((r, worker));
            debug!(local_rank = r, pid, "a worker keeps its process across rounds (rlaunch.resilient)");
            let _ = events.send(Event::OptedIn(opted(&s)));
        } else if let Some(parked) = msg.get("parked") {
            let Some((r, worker)) = rank else { break };
            let round = parked.get("round").and_then(Value::as_u64);
            let mut s = lock(shared);
            // Only for the worker this connection spoke for (not one started since in its place).
            if let (Some(round), Some(w)) = (round, s.workers.get_mut(&r).filter(|w| w.pid == worker)) {
                w.parked = Some(round);
            }
            if s.parking.is_some()
                && s.parking == round
                && s.workers.len() == s.pids.len()
                && s.workers.values().all(|w| w.parked == s.parking)
            {
                let _ = events.send(Event::WorkersParked);
            }
        }
    }
    if let Some((r, worker)) = rank {
        let mut s = lock(shared);
        if s.workers.get(&r).is_some_and(|w| w.pid == worker) {
            s.workers.remove(&r);
            let _ = events.send(Event::OptedIn(opted(&s)));
        }
    }
}
