//! Process groups and collectives on contiguous CPU buffers: shared memory among the ranks of
//! one host (`shm`), a TCP ring between hosts (`tcp`), and both combined hierarchically.
//!
//! Every collective runs under a deadline: a peer that dies or vanishes turns into a
//! [`CommError`] naming its rank, never a hang. Every collective also exchanges a small header
//! (kind, dtype, element count, root, op) so that ranks calling different things fail loudly.

mod elem;
pub mod filestore;
mod rendezvous;
pub mod shm;
pub mod tcp;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use elem::{DType, Element, ReduceOp};
pub use filestore::FileStore;
pub use rendezvous::Rendezvous;

/// Default deadline of one collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How many times [`abort_all`] was called in this process.
static ABORTS: AtomicU64 = AtomicU64::new(0);
/// Set by [`abort_all`], cleared by [`clear_abort`]: while set, whatever starts fails at once.
static ABORTED: AtomicBool = AtomicBool::new(false);
/// How many collectives or group bootstraps failed in this process (any group, any cause but
/// bad arguments): `rlaunch::resilient` tells a failed collective from the program's own error.
static FAILURES: AtomicU64 = AtomicU64::new(0);

/// Ends every collective and bootstrap in this process, from any thread: each one in flight
/// returns [`CommError::Aborted`] within milliseconds (a TCP wait within its 100 ms poll, a
/// shared-memory wait within its 2 ms futex sleep), and every one started afterwards fails at
/// once, until [`clear_abort`]. Every process group made before the call stays unusable, after
/// `clear_abort` too. This is how a survivor ends its round (`rlaunch::resilient`) when its
/// peers will never answer; `rlaunch::resilient::run` clears it when the next round begins.
pub fn abort_all() {
    ABORTS.fetch_add(1, Ordering::SeqCst);
    ABORTED.store(true, Ordering::SeqCst);
}

/// Lets collectives and groups made from now on run again after [`abort_all`] (the groups made
/// before stay unusable).
pub fn clear_abort() {
    ABORTED.store(false, Ordering::SeqCst);
}

/// Whether [`abort_all`] was called and not cleared since.
pub fn aborted() -> bool {
    ABORTED.load(Ordering::SeqCst)
}

/// The count of [`abort_all`] calls so far.
fn aborts() -> u64 {
    ABORTS.load(Ordering::SeqCst)
}

/// What was begun at one moment (a collective, a group, a bootstrap) knows by this whether
/// [`abort_all`] ended it since: one called after, or one in force when it began (aborted for
/// good, even if its first look comes after a clear).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AbortMark(u64);

impl AbortMark {
    pub fn now() -> Self {
        Self(if aborted() { u64::MAX } else { aborts() })
    }
    pub fn ended(&self) -> bool {
        aborted() || aborts() != self.0
    }
}

/// The count of failed collectives and bootstraps (and store connections of `rlaunch::worker`)
/// in this process so far.
pub fn failures() -> u64 {
    FAILURES.load(Ordering::SeqCst)
}

/// Counts one failure (see [`failures`]).
pub(crate) fn note_failure() {
    FAILURES.fetch_add(1, Ordering::SeqCst);
}

/// Why a collective or the bootstrap of a process group failed.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank} did not take part in {op} within {timeout:?} (timed out)")]
    Timeout { op: &'static str, rank: usize, timeout: Duration },
    #[error("rank {rank} died during {op} (process {pid} is gone)")]
    PeerDied { op: &'static str, rank: usize, pid: i32 },
    #[error("connection to rank {rank} failed during {op}")]
    PeerIo {
        op: &'static str,
        rank: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("collective mismatch: this rank {me} called {mine} but rank {rank} called {theirs}")]
    Mismatch { me: usize, rank: usize, mine: String, theirs: String },
    #[error("invalid arguments to {op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },
    #[error("shared memory segment {path}: {what}")]
    Shm {
        path: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("store operation {what} on key {key:?} failed: {reason}")]
    Store { what: &'static str, key: String, reason: String },
    #[error("{op} was aborted: this process's collectives were ended (the job's round ended)")]
    Aborted { op: &'static str },
    #[error("bootstrap of the process group failed: {reason}")]
    Bootstrap { reason: String },
    #[error("the process group failed earlier and cannot be used: {first}")]
    Poisoned { first: String },
    #[error("socket setup for the TCP ring failed: {what}")]
    Socket {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Which transport a process group uses for its collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Decide from the topology: shm on one host, tcp with one rank per host, else hierarchical.
    Auto,
    /// Shared memory; every rank must be on one host.
    Shm,
    /// TCP ring among all ranks, wherever they are.
    Tcp,
    /// Shared memory within each host, a TCP ring among the hosts' local rank 0s.
    Hierarchical,
}

impl std::str::FromStr for BackendKind {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            "tcp" => Ok(Self::Tcp),
            "hier" | "hierarchical" => Ok(Self::Hierarchical),
            other => Err(UnknownBackend(other.to_owned())),
        }
    }
}

/// A backend name that is none of [`BackendKind`]'s (held in lower case).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend {0:?} (auto, shm, tcp, hier)")]
pub struct UnknownBackend(pub String);

/// Tuning knobs and identity of a process group (see [`ProcessGroup::new`]).
#[derive(Debug, Clone)]
pub struct PgOptions {
    pub rank: usize,
    pub world_size: usize,
    /// Which host (agent, torchrun's GROUP_RANK) this rank runs on; ranks of one host share memory.
    pub group_rank: usize,
    /// Prefix of every key this group writes to the store; must be unique per run and restart.
    pub namespace: String,
    pub timeout: Duration,
    pub backend: BackendKind,
    /// Bytes per rank and per phase of the shared-memory staging buffers.
    pub shm_chunk_bytes: usize,
    /// Address other hosts reach this rank at (TCP ring); `None`: the interface towards `master_addr`.
    pub advertise_addr: Option<std::net::IpAddr>,
    /// Used only to pick the interface to advertise when `advertise_addr` is `None`.
    pub master_addr: Option<String>,
    /// Busy-wait this long before sleeping on a futex while waiting for peers.
    pub spin: Duration,
}

impl PgOptions {
    /// Defaults for a rank in a group; namespace defaults to `rlaunch/pg`.
    pub fn new(rank: usize, world_size: usize) -> Self {
        Self {
            rank,
            world_size,
            group_rank: 0,
            namespace: "rlaunch/pg".into(),
            timeout: DEFAULT_TIMEOUT,
            backend: BackendKind::Auto,
            shm_chunk_bytes: shm::DEFAULT_CHUNK_BYTES,
            advertise_addr: None,
            master_addr: None,
            spin: Duration::from_micros(50),
        }
    }
}

/// The collective header every rank compares before moving data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Desc {
    pub kind: u8,
    pub dtype: u8,
    pub op: u8,
    pub root: u32,
    pub count: u64,
}

pub(crate) const K_ALL_REDUCE: u8 = 1;
pub(crate) const K_BROADCAST: u8 = 2;
pub(crate) const K_ALL_GATHER: u8 = 3;
pub(crate) const K_REDUCE_SCATTER: u8 = 4;
pub(crate) const K_BARRIER: u8 = 5;
pub(crate) const K_REDUCE: u8 = 6;

impl Desc {
    pub fn new(kind: u8, dtype: DType, op: Option<ReduceOp>, root: usize, count: usize) -> Self {
        Self { kind, dtype: dtype as u8, op: op.map_or(0, |o| o as u8 + 1), root: root as u32, count: count as u64 }
    }
    pub fn to_words(self) -> [u64; 2] {
        [
            u64::from(self.kind) | u64::from(self.dtype) << 8 | u64::from(self.op) << 16 | u64::from(self.root) << 32,
            self.count,
        ]
    }
    pub fn from_words(w: [u64; 2]) -> Self {
        Self {
            kind: w[0] as u8,
            dtype: (w[0] >> 8) as u8,
            op: (w[0] >> 16) as u8,
            root: (w[0] >> 32) as u32,
            count: w[1],
        }
    }
    pub fn describe(&self) -> String {
        let kind = match self.kind {
            K_ALL_REDUCE => "all_reduce",
            K_BROADCAST => "broadcast",
            K_ALL_GATHER => "all_gather",
            K_REDUCE_SCATTER => "reduce_scatter",
            K_BARRIER => "barrier",
            K_REDUCE => "reduce",
            _ => "unknown collective",
        };
        let dtype = DType::from_u8(self.dtype).map_or("?", |d| d.name());
        let mut s = format!("{kind} of {} {dtype}", self.count);
        if self.op != 0 {
            s += &format!(" op {:?}", ReduceOp::from_u8(self.op - 1));
        }
        if matches!(self.kind, K_BROADCAST | K_REDUCE) {
            s += &format!(" root {}", self.root);
        }
        s
    }
}

/// A deadline shared by all the waits of one collective; [`abort_all`] ends it early.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    pub at: Instant,
    pub timeout: Duration,
    pub op: &'static str,
    /// When the collective began.
    begun: AbortMark,
}

impl Deadline {
    pub fn new(timeout: Duration, op: &'static str) -> Self {
        Self { at: Instant::now() + timeout, timeout, op, begun: AbortMark::now() }
    }
    /// Whether the waiting must end: the time is up, or the collectives were aborted.
    pub fn expired(&self) -> bool {
        Instant::now() >= self.at || self.aborted()
    }
    pub fn aborted(&self) -> bool {
        self.begun.ended()
    }
    /// The error of an expired deadline (waiting on `rank`).
    pub fn timeout_err(&self, rank: usize) -> CommError {
        if self.aborted() {
            return CommError::Aborted { op: self.op };
        }
        CommError::Timeout { op: self.op, rank, timeout: self.timeout }
    }
}

enum Backend {
    Single,
    Shm(shm::ShmGroup),
    Tcp(tcp::TcpRing),
    Hier { local: shm::ShmGroup, leaders: Option<tcp::TcpRing>, hosts: Vec<HostSpan>, my_host: usize },
}

/// Ranks `[first, first + len)` live on one host (global ranks must be contiguous per host).
#[derive(Debug, Clone, Copy)]
struct HostSpan {
    first: usize,
    len: usize,
}

/// A group of ranks that run collectives together. Every rank of the group must call the same
/// collectives in the same order with the same element counts and types.
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    timeout: Duration,
    backend: Backend,
    backend_name: &'static str,
    poisoned: Option<String>,
    /// When the group was made: a later abort ends it.
    born: AbortMark,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("backend", &self.backend_name)
            .finish()
    }
}

fn key(ns: &str, rest: &str) -> String {
    format!("{ns}/{rest}")
}

impl ProcessGroup {
    /// Forms a group through `store`: every rank publishes its host, then the backend is set up
    /// (shared memory segment names and TCP ring addresses also travel through the store).
    pub fn new(store: &mut dyn Rendezvous, opts: PgOptions) -> Result<Self, CommError> {
        let r = Self::bootstrap(store, opts);
        if matches!(&r, Err(e) if !matches!(e, CommError::InvalidArgument { .. })) {
            note_failure();
        }
        r
    }

    fn bootstrap(store: &mut dyn Rendezvous, opts: PgOptions) -> Result<Self, CommError> {
        let PgOptions { rank, world_size, .. } = opts;
        if world_size == 0 || rank >= world_size {
            return Err(CommError::InvalidArgument {
                op: "ProcessGroup::new",
                reason: format!("rank {rank} outside world size {world_size}"),
            });
        }
        let deadline = Deadline::new(opts.timeout, "bootstrap");
        let born = deadline.begun;
        // Publish which host this rank is on, then learn everyone's.
        store.set(&key(&opts.namespace, &format!("host/{rank}")), opts.group_rank.to_string().as_bytes())?;
        let mut group_of = Vec::with_capacity(world_size);
        for r in 0..world_size {
            let v = store.get(&key(&opts.namespace, &format!("host/{r}")), remaining(&deadline, r)?)?;
            let g: usize = std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok()).ok_or_else(|| {
                CommError::Bootstrap { reason: format!("rank {r} published a malformed host id {v:?}") }
            })?;
            group_of.push(g);
        }
        let local: Vec<usize> = (0..world_size).filter(|&r| group_of[r] == opts.group_rank).collect();
        let local_rank = local.iter().position(|&r| r == rank).expect("this rank is on its own host");
        let local_world_size = local.len();
        let mut hosts_ids: Vec<usize> = group_of.clone();
        hosts_ids.sort_unstable();
        hosts_ids.dedup();
        let n_hosts = hosts_ids.len();

        let kind = match opts.backend {
            BackendKind::Auto if world_size == 1 => BackendKind::Auto,
            BackendKind::Auto if n_hosts == 1 => BackendKind::Shm,
            BackendKind::Auto if local_world_size == 1 && n_hosts == world_size => BackendKind::Tcp,
            BackendKind::Auto => BackendKind::Hierarchical,
            k => k,
        };
        let (backend, backend_name) = match kind {
            BackendKind::Auto => (Backend::Single, "single"),
            BackendKind::Shm => {
                if n_hosts != 1 {
                    return Err(CommError::Bootstrap {
                        reason: format!("the shm backend needs every rank on one host, found {n_hosts} hosts"),
                    });
                }
                let g = shm::ShmGroup::new(store, &key(&opts.namespace, "shm"), &local, local_rank, &opts)?;
                (Backend::Shm(g), "shm")
            }
            BackendKind::Tcp => {
                let all: Vec<usize> = (0..world_size).collect();
                let ring = tcp::TcpRing::new(store, &key(&opts.namespace, "tcp"), &all, rank, &opts)?;
                (Backend::Tcp(ring), "tcp")
            }
            BackendKind::Hierarchical => {
                // Hosts in order of their first rank; ranks must be contiguous per host.
                let mut hosts: Vec<HostSpan> = Vec::new();
                for r in 0..world_size {
                    match hosts.last_mut() {
                        Some(h) if group_of[h.first] == group_of[r] => h.len += 1,
                        _ => hosts.push(HostSpan { first: r, len: 1 }),
                    }
                }
                if hosts.len() != n_hosts {
                    return Err(CommError::Bootstrap {
                        reason: "hierarchical collectives need the ranks of each host to be contiguous".into(),
                    });
                }
                let my_host = hosts.iter().position(|h| rank >= h.first && rank < h.first + h.len).expect("in a host");
                let shm_ns = key(&opts.namespace, &format!("hshm/{}", opts.group_rank));
                let local_g = shm::ShmGroup::new(store, &shm_ns, &local, local_rank, &opts)?;
                let leaders_list: Vec<usize> = hosts.iter().map(|h| h.first).collect();
                let leaders = if local_rank == 0 {
                    Some(tcp::TcpRing::new(store, &key(&opts.namespace, "htcp"), &leaders_list, my_host, &opts)?)
                } else {
                    None
                };
                (Backend::Hier { local: local_g, leaders, hosts, my_host }, "hierarchical")
            }
        };
        tracing::debug!(rank, world_size, local_rank, local_world_size, backend = backend_name, "process group formed");
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            timeout: opts.timeout,
            backend,
            backend_name,
            poisoned: None,
            born,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// Index of this rank among the ranks of its host.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    /// `"single"`, `"shm"`, `"tcp"` or `"hierarchical"`.
    pub fn backend_name(&self) -> &'static str {
        self.backend_name
    }
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// Changes the deadline of later collectives.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        match &mut self.backend {
            Backend::Single => {}
            Backend::Shm(g) => g.timeout = timeout,
            Backend::Tcp(t) => t.timeout = timeout,
            Backend::Hier { local, leaders, .. } => {
                local.timeout = timeout;
                if let Some(l) = leaders {
                    l.timeout = timeout;
                }
            }
        }
    }

    fn all_reduce_inner<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let desc = Desc::new(K_ALL_REDUCE, T::DTYPE, Some(op), 0, buf.len());
        match &mut self.backend {
            Backend::Single => {}
            Backend::Shm(g) => g.all_reduce(buf, op, desc, None)?,
            Backend::Tcp(t) => t.all_reduce(buf, op, desc)?,
            Backend::Hier { local, leaders, .. } => {
                // Sum within the host onto local rank 0, ring among hosts, broadcast back.
                let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
                local.all_reduce(buf, inner, desc, Some(0))?;
                if let Some(ring) = leaders {
                    ring.all_reduce(buf, inner, desc)?;
                    if op == ReduceOp::Avg {
                        T::scale(buf, self.world_size);
                    }
                }
                local.broadcast(buf, 0, Desc::new(K_BROADCAST, T::DTYPE, None, 0, buf.len()))?;
            }
        }
        if op == ReduceOp::Avg && !matches!(self.backend, Backend::Hier { .. }) {
            // Backends sum for Avg; the division happens once here, identically on every rank.
            T::scale(buf, self.world_size);
        }
        Ok(())
    }

    fn broadcast_inner<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        self.check_root(root, "broadcast")?;
        let desc = Desc::new(K_BROADCAST, T::DTYPE, None, root, buf.len());
        match &mut self.backend {
            Backend::Single => Ok(()),
            Backend::Shm(g) => g.broadcast(buf, root, desc),
            Backend::Tcp(t) => t.broadcast(buf, root, desc),
            Backend::Hier { local, leaders, hosts, my_host } => {
                let root_host =
                    hosts.iter().position(|h| root >= h.first && root < h.first + h.len).expect("root in a host");
                if *my_host == root_host {
                    let local_root = root - hosts[root_host].first;
                    if local_root != 0 {
                        local.broadcast(
                            buf,
                            local_root,
                            Desc::new(K_BROADCAST, T::DTYPE, None, local_root, buf.len()),
                        )?;
                    }
                }
                if let Some(ring) = leaders {
                    ring.broadcast(buf, root_host, Desc::new(K_BROADCAST, T::DTYPE, None, root_host, buf.len()))?;
                }
                // On the root's host the ranks other than the leader may already have it: one
                // uniform broadcast from the leader keeps every host's sequence the same.
                local.broadcast(buf, 0, Desc::new(K_BROADCAST, T::DTYPE, None, 0, buf.len()))
            }
        }
    }

    fn all_gather_inner<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<(), CommError> {
        if output.len() != input.len() * self.world_size {
            return Err(CommError::InvalidArgument {
                op: "all_gather",
                reason: format!("output has {} elements, expected {} x {}", output.len(), self.world_size, input.len()),
            });
        }
        let desc = Desc::new(K_ALL_GATHER, T::DTYPE, None, 0, input.len());
        match &mut self.backend {
            Backend::Single => {
                output.copy_from_slice(input);
                Ok(())
            }
            Backend::Shm(g) => g.all_gather(input, output, desc),
            Backend::Tcp(t) => t.all_gather(input, output, desc),
            Backend::Hier { local, leaders, hosts, my_host } => {
                let n = input.len();
                let h = hosts[*my_host];
                local.all_gather(input, &mut output[h.first * n..(h.first + h.len) * n], desc)?;
                if let Some(ring) = leaders {
                    let spans: Vec<(usize, usize)> = hosts.iter().map(|h| (h.first * n, h.len * n)).collect();
                    ring.all_gather_spans(output, &spans, desc)?;
                }
                local.broadcast(output, 0, Desc::new(K_BROADCAST, T::DTYPE, None, 0, output.len()))
            }
        }
    }

    fn reduce_scatter_inner<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        if input.len() != output.len() * self.world_size {
            return Err(CommError::InvalidArgument {
                op: "reduce_scatter",
                reason: format!("input has {} elements, expected {} x {}", input.len(), self.world_size, output.len()),
            });
        }
        let desc = Desc::new(K_REDUCE_SCATTER, T::DTYPE, Some(op), 0, output.len());
        let n = output.len();
        match &mut self.backend {
            Backend::Single => output.copy_from_slice(input),
            Backend::Shm(g) => g.reduce_scatter(input, output, op, desc)?,
            Backend::Tcp(t) => t.reduce_scatter(input, output, op, desc)?,
            Backend::Hier { .. } => {
                let mut tmp = input.to_vec();
                self.all_reduce(&mut tmp, op)?;
                output.copy_from_slice(&tmp[self.rank * n..(self.rank + 1) * n]);
                return Ok(());
            }
        }
        if op == ReduceOp::Avg {
            T::scale(output, self.world_size);
        }
        Ok(())
    }

    fn barrier_inner(&mut self) -> Result<(), CommError> {
        let desc = Desc::new(K_BARRIER, DType::U8, None, 0, 0);
        match &mut self.backend {
            Backend::Single => Ok(()),
            Backend::Shm(g) => g.barrier(desc),
            Backend::Tcp(t) => {
                // A ring all-reduce with a non-empty segment per member carries every rank's
                // arrival to every rank (the header exchange alone only orders neighbours).
                let mut x = vec![0u8; self.world_size];
                t.all_reduce(&mut x, ReduceOp::Sum, desc)
            }
            Backend::Hier { local, leaders, .. } => {
                local.barrier(desc)?;
                if let Some(ring) = leaders {
                    let mut x = vec![0u8; self.world_size];
                    ring.all_reduce(&mut x, ReduceOp::Sum, desc)?;
                }
                local.barrier(desc)
            }
        }
    }

    /// Reduces `buf` element-wise across all ranks; every rank ends with the result.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.check_poisoned()?;
        let r = self.all_reduce_inner(buf, op);
        self.poison_on(r)
    }

    /// Copies `buf` of rank `root` into `buf` of every rank.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        self.check_poisoned()?;
        let r = self.broadcast_inner(buf, root);
        self.poison_on(r)
    }

    /// Concatenates every rank's `input` in rank order into `output` (`world_size * input.len()`).
    pub fn all_gather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<(), CommError> {
        self.check_poisoned()?;
        let r = self.all_gather_inner(input, output);
        self.poison_on(r)
    }

    /// Reduces `input` (`world_size * output.len()` elements) across ranks and leaves block
    /// `rank` of the result in `output`.
    pub fn reduce_scatter<T: Element>(&mut self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.check_poisoned()?;
        let r = self.reduce_scatter_inner(input, output, op);
        self.poison_on(r)
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.check_poisoned()?;
        let r = self.barrier_inner();
        self.poison_on(r)
    }

    /// The error that made this group unusable, if any: after a failed collective the ranks'
    /// positions in the shared sequence are unknown, so every later call fails at once instead
    /// of waiting out its own timeout.
    pub fn failure(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    fn check_poisoned(&mut self) -> Result<(), CommError> {
        if self.poisoned.is_none() && self.born.ended() {
            let e = CommError::Aborted { op: "the process group" };
            note_failure();
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        match &self.poisoned {
            Some(first) => Err(CommError::Poisoned { first: first.clone() }),
            None => Ok(()),
        }
    }

    fn poison_on(&mut self, r: Result<(), CommError>) -> Result<(), CommError> {
        if let Err(e) = &r {
            // Argument errors are caught before any data moves; they leave the group usable.
            if !matches!(e, CommError::InvalidArgument { .. } | CommError::Poisoned { .. }) {
                note_failure();
                self.poisoned.get_or_insert_with(|| e.to_string());
            }
        }
        r
    }

    fn check_root(&self, root: usize, op: &'static str) -> Result<(), CommError> {
        if root >= self.world_size {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!("root {root} outside world size {}", self.world_size),
            });
        }
        Ok(())
    }
}

/// Time left before `deadline`, or a timeout error naming `rank` (the peer being waited for).
pub(crate) fn remaining(deadline: &Deadline, rank: usize) -> Result<Duration, CommError> {
    if deadline.aborted() {
        return Err(CommError::Aborted { op: deadline.op });
    }
    deadline
        .at
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| deadline.timeout_err(rank))
}
