//! The etcd v3 store: no truth in memory, so any number of server replicas (or agents running
//! the machine themselves) can serve the same jobs.
//!
//! Layout under `/rlaunch/jobs/{run_id}/`:
//! - `state`: the [`Job`] as JSON, without heartbeat times; every update is a transaction that
//!   compares the key's mod revision (or its absence) before the put, retried on conflict. A
//!   state over 512 KiB (etcd refuses requests over 1.5 MiB) is written first as parts under
//!   `part/{generation}/{i}`, each its own request, and `state` holds a small header naming the
//!   generation, put by the transaction, which deletes every other generation's parts (the
//!   previous one's, and those of a writer killed in the middle of a large write);
//! - `alive/{node_id}`: one key per node, on a lease of the process that hears from the node (one
//!   lease per TTL, see `leases`), deleted by that process when the node falls silent for its
//!   TTL. Its presence is the node's liveness: when the machine runs, every node with a key counts
//!   as just heard from and every other node as lapsed, so a key's deletion (or its lease
//!   expiring with a dead replica) is a node loss.
//!
//! Listing every job (the ticker, `/metrics`) reads the prefix in pages of 64 keys at one
//! revision and parses only the states that changed since the last listing.
//!
//! One background task per store watches the whole prefix: a `state` change wakes long-polls, an
//! `alive` key deleted (lease expiry, revoke) nudges the ticker so loss is acted on at once.
//!
//! What liveness the job read from etcd has (which suspicions a beat refuted, when a lapsed node
//! was last heard, which keys are stale) is decided by `round::liveness`, pure: this store reads
//! and writes the keys and hands what it read there.
//!
//! Files: `layout` (the keys, the state written in parts, what of a job is stored), `leases` (what
//! this process knows of the alive keys it holds), `alive` (the alive keys: held, taken over,
//! renewed, swept; the lease keep-alive), `watch` (the watch on the prefix), `commit` (a job's
//! batched update: queue, read, apply, compare-and-put), `compaction` (etcd's history); the store,
//! its requests and its reads are here.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, DeleteOptions, GetOptions, Txn};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::detector::{PeerReport, ProbeReport, ProbeRequest};
use crate::endpoint::Endpoint;
use crate::error::RdzvError;
use crate::round::liveness::{self, Signs};
use crate::round::{self, Action, Decision, Event, Guard, Job, Millis};

mod alive;
mod commit;
mod compaction;
mod layout;
mod leases;
mod watch;

use compaction::compact;
pub use compaction::Compaction;

use alive::sweep;
use commit::JobQueue;
use layout::{alive_prefix, assemble, lapsed_prefix, prefix_end, state_key, stored, PREFIX};
use leases::Leases;
use watch::{note_probing, watch_loop, Owed};

/// Bound on every single etcd request (streams excepted), so a dead or partitioned member never
/// hangs a caller for long: after it, the request goes to the next member.
const OP_TIMEOUT: Duration = Duration::from_millis(1500);
/// Unary etcd requests one store has in flight at most (streams excepted).
const MAX_IN_FLIGHT: usize = 256;

/// A handle on jobs kept in etcd; cheap to clone.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// One client per endpoint: etcd-client's balanced channel keeps routing to a dead member,
    /// so failover between members is done here.
    clients: Vec<Client>,
    /// The members' endpoints and the options they were connected with: a lease whose keep-alive
    /// stream went unanswered is confirmed on fresh connections ([`alive`]).
    endpoints: Vec<String>,
    options: ConnectOptions,
    /// One such confirmation at a time, and the last one that did not succeed.
    confirming: tokio::sync::Mutex<Option<leases::ConfirmTry>>,
    /// The client that answered last; tried first.
    current: AtomicUsize,
    /// Bumped on every change under the prefix (and after a watch reconnect).
    changes: tokio::sync::watch::Sender<u64>,
    /// Signalled when an `alive` key disappears.
    expired: Arc<Notify>,
    /// Latest job versions seen by the watch, so long-polls need not re-read whole jobs.
    versions: Arc<std::sync::Mutex<HashMap<String, u64>>>,
    /// The probes each node owes, by job, as last seen (watch, reads) for jobs with suspected
    /// nodes: a heartbeat answers from here without reading etcd.
    probing: Arc<std::sync::Mutex<Owed>>,
    /// Events waiting for their job's next batched update, by run id: this process's own
    /// updates of a job never conflict with each other (only with other replicas or agents).
    queues: std::sync::Mutex<HashMap<String, JobQueue>>,
    /// The leases this process puts alive keys on, and the keys it holds (see [`Leases`]).
    leases: Arc<std::sync::Mutex<Leases>>,
    /// Requests in flight to etcd, bounded: 10,000 agents joining at once queue here rather
    /// than in etcd (which refuses past 5,000 proposals behind, and answers late to all).
    in_flight: tokio::sync::Semaphore,
    /// One lease grant at a time (10,000 joins at once must not grant 10,000 leases).
    granting: tokio::sync::Mutex<()>,
    /// Node keys (secret digests) by job, as last read: a heartbeat whose secret matches needs
    /// no read of the job; any other is checked against etcd.
    keys: std::sync::Mutex<HashMap<String, BTreeMap<String, String>>>,
    /// The newest state of each job this process read or wrote, and when: long-polls woken by
    /// a change look here, and one of them reads etcd for all when it is older than the newest
    /// version the watch saw (10,000 waiters must not read a 1.5 MB job each).
    latest: std::sync::Mutex<HashMap<String, (Arc<Job>, Instant)>>,
    /// Each job's state as the ticker last parsed it, by mod revision: a listing parses only
    /// the jobs that changed (finished jobs of 10,000 nodes stay an hour).
    parsed: std::sync::Mutex<HashMap<String, (i64, Arc<Job>)>>,
    /// One refresh at a time per job.
    refreshing: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Most jobs this store creates, and how many the last listing saw (plus those created since).
    max_jobs: AtomicUsize,
    job_count: AtomicUsize,
    watcher: JoinHandle<()>,
    sweeper: JoinHandle<()>,
    /// Compacts etcd's history ([`compact`]).
    compactor: JoinHandle<()>,
    /// How much history is kept, and how often older history is compacted away.
    compaction: std::sync::Mutex<Compaction>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.watcher.abort();
        self.sweeper.abort();
        self.compactor.abort();
        // The leases are not revoked: the nodes on them move to another replica (which takes
        // their keys over) well within the TTL, or lapse with the lease.
        let leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        for keeper in leases.by_ttl.values().filter_map(|l| l.keeper.as_ref()) {
            keeper.abort();
        }
    }
}

/// What one read of a job's prefix holds.
struct Snapshot {
    job: Option<Arc<Job>>,
    /// The store's revision at the read.
    revision: i64,
    /// The generation of the state's parts, when it is written in parts.
    generation: Option<String>,
    mod_revision: i64,
    alive: Vec<String>,
    /// Nodes whose alive key a replica deleted for silence, and when it last heard from them.
    lapsed: Vec<(String, Millis)>,
}

/// Keys per page when listing every job, and the answer size that allows (values are at most
/// etcd's 1.5 MiB request limit each).
const PAGE_KEYS: i64 = 64;
const PAGE_BYTES: usize = 128 << 20;

/// Whether another member might answer where this one failed.
fn is_unavailable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        // Cancelled, Unknown, DeadlineExceeded, Unavailable (no leader, leader changed, down).
        etcd_client::Error::GRpcStatus(s) => matches!(i32::from(s.code()), 1 | 2 | 4 | 14),
        _ => false,
    }
}

fn timed_out(op: &'static str) -> RdzvError {
    RdzvError::Etcd { op, source: etcd_client::Error::InvalidArgs(format!("no answer within {OP_TIMEOUT:?}")) }
}

impl EtcdStore {
    /// Connects to etcd (`endpoints` like `http://127.0.0.1:2379` or `127.0.0.1:2379`: members of
    /// one cluster) and starts watching. Connections are lazy: a member down at start is
    /// tolerated; one that is not an endpoint is refused.
    pub async fn connect(endpoints: &[Endpoint]) -> Result<Self, RdzvError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
            .with_keep_alive_while_idle(true)
            // A member cut off from the quorum refuses requests (and cancels watches) instead of
            // serving stale data, so the request moves on to a member that has a leader.
            .with_require_leader(true);
        let mut clients = Vec::new();
        let endpoints: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
        for e in &endpoints {
            let fut = Client::connect([e.clone()], Some(options.clone()));
            match tokio::time::timeout(OP_TIMEOUT, fut).await {
                Ok(r) => clients.push(r.map_err(RdzvError::etcd("connect"))?),
                Err(_) => return Err(timed_out("connect")),
            }
        }
        if clients.is_empty() {
            return Err(RdzvError::BadRequest { message: "no etcd endpoint given".to_owned() });
        }
        let (changes, _) = tokio::sync::watch::channel(0u64);
        let expired = Arc::new(Notify::new());
        let versions = Arc::new(std::sync::Mutex::new(HashMap::new()));
        let probing = Arc::new(std::sync::Mutex::new(Owed::new()));
        let leases = Arc::new(std::sync::Mutex::new(Leases::default()));
        let watcher = tokio::spawn(watch_loop(
            clients.clone(),
            changes.clone(),
            expired.clone(),
            versions.clone(),
            probing.clone(),
            leases.clone(),
        ));
        let inner = Arc::new_cyclic(|weak| Inner {
            clients,
            endpoints,
            options,
            confirming: tokio::sync::Mutex::new(None),
            current: AtomicUsize::new(0),
            changes,
            expired,
            versions,
            probing,
            queues: std::sync::Mutex::new(HashMap::new()),
            leases,
            in_flight: tokio::sync::Semaphore::new(MAX_IN_FLIGHT),
            granting: tokio::sync::Mutex::new(()),
            keys: std::sync::Mutex::new(HashMap::new()),
            latest: std::sync::Mutex::new(HashMap::new()),
            refreshing: std::sync::Mutex::new(HashMap::new()),
            parsed: std::sync::Mutex::new(HashMap::new()),
            max_jobs: AtomicUsize::new(usize::MAX),
            job_count: AtomicUsize::new(0),
            watcher,
            sweeper: tokio::spawn(sweep(weak.clone())),
            compactor: tokio::spawn(compact(weak.clone())),
            compaction: std::sync::Mutex::new(Compaction::default()),
        });
        let store = Self { inner };
        // Fail fast when no member answers at all.
        store.run("status", |mut c| async move { c.status().await }).await?;
        Ok(store)
    }

    /// Runs one request, on the member that answered last first, then on the others when a
    /// member is down, partitioned or without a leader. Retrying is safe: every write is a
    /// compare-and-put, and the machine treats a repeated event as a no-op.
    async fn run<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T, RdzvError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let n = self.inner.clients.len();
        let start = self.inner.current.load(Ordering::Relaxed);
        let mut last = timed_out(op);
        for i in 0..n {
            let idx = (start + i) % n;
            // Waiting for a slot is not the member's time: the bound starts with the request.
            let _slot = self.inner.in_flight.acquire().await.map_err(|_| timed_out(op))?;
            match tokio::time::timeout(OP_TIMEOUT, f(self.inner.clients[idx].clone())).await {
                Ok(Ok(v)) => {
                    self.inner.current.store(idx, Ordering::Relaxed);
                    return Ok(v);
                }
                Ok(Err(e)) if !is_unavailable(&e) => return Err(RdzvError::Etcd { op, source: e }),
                Ok(Err(e)) => {
                    debug!(op, member = idx, error = %e, "etcd member unavailable; trying the next");
                    last = RdzvError::Etcd { op, source: e };
                }
                Err(_) => {
                    debug!(op, member = idx, "etcd member did not answer in time; trying the next");
                    last = timed_out(op);
                }
            }
        }
        Err(last)
    }

    /// Deletes every key under `prefix`; a failure is logged as `what` (the next pass retries).
    async fn delete_prefix(&self, run_id: &str, prefix: String, what: &'static str) {
        let deleted = self
            .run("delete keys", |mut c| {
                let prefix = prefix.clone();
                async move { c.delete(prefix, Some(DeleteOptions::new().with_prefix())).await }
            })
            .await;
        if let Err(error) = deleted {
            warn!(run_id, %error, "{what}");
        }
    }

    pub(crate) fn expired(&self) -> Arc<Notify> {
        self.inner.expired.clone()
    }

    /// Most jobs this store creates (counted from the ticker's listing, so replicas together
    /// may overshoot by the jobs created within one tick).
    pub fn set_max_jobs(&self, n: usize) {
        self.inner.max_jobs.store(n, Ordering::Relaxed);
    }

    fn note_latest(&self, run_id: &str, job: &Arc<Job>) {
        let mut latest = self.inner.latest.lock().unwrap_or_else(|p| p.into_inner());
        match latest.get(run_id) {
            Some((have, _)) if have.version > job.version => {}
            _ => {
                latest.insert(run_id.to_owned(), (job.clone(), Instant::now()));
            }
        }
    }

    /// `view` of the job as this process last read or wrote it, if that is at least as new as
    /// the newest version seen (and, with `max_age`, read within it); else read from etcd, by
    /// one caller for all. Without liveness.
    pub async fn view<R>(
        &self,
        run_id: &str,
        max_age: Option<Duration>,
        view: impl FnOnce(&Job) -> R,
    ) -> Result<Option<R>, RdzvError> {
        let fresh = |s: &Self| {
            let want = s.inner.versions.lock().unwrap_or_else(|p| p.into_inner()).get(run_id).copied().unwrap_or(0);
            let latest = s.inner.latest.lock().unwrap_or_else(|p| p.into_inner());
            latest
                .get(run_id)
                .filter(|(job, at)| job.version >= want && max_age.is_none_or(|age| at.elapsed() <= age))
                .map(|(job, _)| job.clone())
        };
        if let Some(job) = fresh(self) {
            return Ok(Some(view(&job)));
        }
        let lock = {
            let mut refreshing = self.inner.refreshing.lock().unwrap_or_else(|p| p.into_inner());
            refreshing.entry(run_id.to_owned()).or_default().clone()
        };
        let _one = lock.lock().await;
        if let Some(job) = fresh(self) {
            return Ok(Some(view(&job)));
        }
        Ok(self.read(run_id).await?.job.map(|job| view(&job)))
    }

    fn note_keys(&self, run_id: &str, job: &Job) {
        let mut keys = self.inner.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.get(run_id) != Some(&job.keys) {
            keys.insert(run_id.to_owned(), job.keys.clone());
        }
    }

    /// Checks the caller's secret for `node_id`: against the keys last read, else against etcd.
    pub(crate) async fn authorize(&self, run_id: &str, node_id: &str, secret: Option<&str>) -> Result<(), RdzvError> {
        let cached = {
            let keys = self.inner.keys.lock().unwrap_or_else(|p| p.into_inner());
            keys.get(run_id).and_then(|k| k.get(node_id)).cloned()
        };
        if cached.is_some_and(|key| secret.is_some_and(|s| crate::identity::matches(&key, s))) {
            return Ok(());
        }
        match self.read(run_id).await?.job {
            Some(job) => round::authorize(&job, node_id, secret).map_err(RdzvError::from),
            None => Err(RdzvError::UnknownJob { run_id: run_id.to_owned() }),
        }
    }

    async fn read(&self, run_id: &str) -> Result<Snapshot, RdzvError> {
        let prefix = format!("{PREFIX}{run_id}/");
        let resp = self
            .run("get job", |c| {
                let prefix = prefix.clone();
                // A job in parts is up to 50 MiB: past the client's default 4 MiB answer limit.
                async move {
                    c.kv_client()
                        .max_decoding_message_size(PAGE_BYTES)
                        .get(prefix, Some(GetOptions::new().with_prefix()))
                        .await
                }
            })
            .await?;
        let (skey, aprefix) = (state_key(run_id), alive_prefix(run_id));
        let parts_under = format!("{PREFIX}{run_id}/part/");
        let revision = resp.header().map_or(0, |h| h.revision());
        let lprefix = lapsed_prefix(run_id);
        let mut snap =
            Snapshot { job: None, revision, generation: None, mod_revision: 0, alive: Vec::new(), lapsed: Vec::new() };
        let mut state = None;
        let mut parts = Vec::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            if key == skey {
                state = Some(kv);
            } else if key.starts_with(&parts_under) {
                parts.push(kv);
            } else if let Some(node) = key.strip_prefix(&aprefix) {
                snap.alive.push(node.to_owned());
            } else if let Some(node) = key.strip_prefix(&lprefix) {
                if let Ok(heard) = String::from_utf8_lossy(kv.value()).parse::<Millis>() {
                    snap.lapsed.push((node.to_owned(), heard));
                }
            }
        }
        if let Some(kv) = state {
            let (job, generation) = assemble(run_id, kv, &parts)?;
            note_probing(&self.inner.probing, run_id, Some(&job));
            self.note_keys(run_id, &job);
            let job = Arc::new(job);
            self.note_latest(run_id, &job);
            snap.job = Some(job);
            snap.generation = generation;
            snap.mod_revision = kv.mod_revision();
        }
        Ok(snap)
    }

    /// When this process last heard from the nodes of `run_id` whose alive keys it holds (Unix
    /// ms).
    fn heard(&self, run_id: &str) -> HashMap<String, Millis> {
        let held = self.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).heard_under(&alive_prefix(run_id));
        let (now, mono) = (crate::clock::now_ms(), Instant::now());
        held.into_iter().map(|(id, at)| (id, liveness::heard_at(now, mono.duration_since(at)))).collect()
    }

    /// A heartbeat through etcd: the lease kept alive (renewed when it lapsed while the job
    /// still counts the node: suspected, not lost), probe outcomes written to the job, and the
    /// probes this node owes answered from what the watch saw. Only the keep-alive decides the
    /// answer: reporting probes is best effort, so a busy etcd never silences a live node.
    pub async fn heartbeat(
        &self,
        run_id: &str,
        node_id: &str,
        probes: Vec<ProbeReport>,
        peers: Vec<PeerReport>,
        guard: &Guard,
        now: Millis,
    ) -> Result<(Decision, Vec<ProbeRequest>), RdzvError> {
        // Another agent's heartbeat must not keep this node's lease alive.
        self.authorize(run_id, node_id, guard.secret.as_deref()).await?;
        let mut decision = match self.keep_alive(run_id, node_id).await {
            Ok(d) => d,
            Err(RdzvError::UnknownNode { .. }) => {
                if !self.renew_if_tracked(run_id, node_id).await? {
                    return Err(RdzvError::UnknownNode { node_id: node_id.to_owned() });
                }
                let reason = format!("lease of {node_id} renewed after it lapsed (the job still counts the node)");
                Decision { action: Action::HeartbeatRecorded, reason }
            }
            Err(e) => return Err(e),
        };
        // This node's probes, as the watch last saw the job: only outcomes for those go to etcd
        // (a stale one would cost a write), and those not answered now are still owed.
        let mut owed: Vec<ProbeRequest> = self
            .inner
            .probing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(run_id)
            .and_then(|by_prober| by_prober.get(node_id).cloned())
            .unwrap_or_default();
        let relevant: Vec<ProbeReport> =
            probes.into_iter().filter(|p| owed.iter().any(|r| r.node_id == p.node_id)).collect();
        owed.retain(|r| !relevant.iter().any(|p| p.node_id == r.node_id));
        // The reports of its watching go through the machine too (written only when they
        // change something: a report kept, a round opened).
        if !relevant.is_empty() || !peers.is_empty() {
            let ev = Event::Heartbeat { node_id: node_id.to_owned(), sent: None, probes: relevant, peers };
            match self.apply(run_id, None, ev, guard.clone(), now).await {
                Ok((_, d))
                    if !matches!(d.action, Action::HeartbeatRecorded | Action::Nothing | Action::Rejected(_)) =>
                {
                    decision = d
                }
                Ok(_) => {}
                Err(error) => debug!(run_id, node_id, error = %error, "probe outcomes not recorded"),
            }
        }
        Ok((decision, owed))
    }

    pub async fn load(&self, run_id: &str, now: Millis) -> Result<Option<Job>, RdzvError> {
        let snap = self.read(run_id).await?;
        let heard = self.heard(run_id);
        let signs = Signs { alive: &snap.alive, heard: &heard, lapsed: &[] };
        Ok(snap.job.map(|j| liveness::observe(Arc::unwrap_or_clone(j), &signs, now)))
    }

    /// Every key and value under [`PREFIX`], in pages of [`PAGE_KEYS`] keys read at one
    /// revision: one range of everything fails past the client's 4 MiB answer limit, and with
    /// it the ticker of every job on the service.
    async fn list_paged(&self) -> Result<Vec<etcd_client::KeyValue>, RdzvError> {
        let end = prefix_end(PREFIX);
        let mut start = PREFIX.as_bytes().to_vec();
        let mut revision = 0i64;
        let mut out = Vec::new();
        loop {
            let (key, end) = (start.clone(), end.clone());
            let mut resp = self
                .run("list jobs", |c| {
                    let (key, end) = (key.clone(), end.clone());
                    async move {
                        let opts = GetOptions::new().with_range(end).with_limit(PAGE_KEYS).with_revision(revision);
                        // A page of values up to etcd's own request limit each.
                        c.kv_client().max_decoding_message_size(PAGE_BYTES).get(key, Some(opts)).await
                    }
                })
                .await?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            let more = resp.more();
            let mut kvs = resp.take_kvs();
            match kvs.last() {
                Some(last) if more => {
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => {
                    out.append(&mut kvs);
                    return Ok(out);
                }
            }
            out.append(&mut kvs);
        }
    }

    pub async fn jobs(&self, now: Millis) -> Result<Vec<(String, Job)>, RdzvError> {
        Ok(self
            .snapshots()
            .await?
            .into_iter()
            .map(|(id, job, nodes)| {
                let heard = self.heard(&id);
                let job = liveness::observe(
                    Arc::unwrap_or_clone(job),
                    &Signs { alive: &nodes, heard: &heard, lapsed: &[] },
                    now,
                );
                (id, job)
            })
            .collect())
    }

    /// Every job as stored, with the nodes whose `alive` key exists; parsed only when changed
    /// since the last listing.
    async fn snapshots(&self) -> Result<Vec<(String, Arc<Job>, Vec<String>)>, RdzvError> {
        let kvs = self.list_paged().await?;
        let mut states: BTreeMap<String, Arc<Job>> = BTreeMap::new();
        let mut alive: BTreeMap<String, Vec<String>> = BTreeMap::new();
        // Keys come sorted: a job's `alive/`, then `part/`, then `state`.
        let mut parts: Vec<&etcd_client::KeyValue> = Vec::new();
        let mut parts_of = String::new();
        for kv in &kvs {
            let key = String::from_utf8_lossy(kv.key());
            let Some(rest) = key.strip_prefix(PREFIX) else { continue };
            let Some((run_id, tail)) = rest.split_once('/') else { continue };
            if parts_of != run_id {
                parts.clear();
                parts_of = run_id.to_owned();
            }
            if tail == "state" {
                let cached = {
                    let parsed = self.inner.parsed.lock().unwrap_or_else(|p| p.into_inner());
                    parsed.get(run_id).filter(|(rev, _)| *rev == kv.mod_revision()).map(|(_, j)| j.clone())
                };
                if let Some(job) = cached {
                    states.insert(run_id.to_owned(), job);
                    continue;
                }
                match assemble(run_id, kv, &parts) {
                    Ok((job, _)) => {
                        note_probing(&self.inner.probing, run_id, Some(&job));
                        self.note_keys(run_id, &job);
                        let job = Arc::new(job);
                        let mut parsed = self.inner.parsed.lock().unwrap_or_else(|p| p.into_inner());
                        parsed.insert(run_id.to_owned(), (kv.mod_revision(), job.clone()));
                        states.insert(run_id.to_owned(), job);
                    }
                    Err(error) => warn!(run_id, %error, "skipping unreadable job state"),
                }
            } else if tail.starts_with("part/") {
                parts.push(kv);
            } else if let Some(node) = tail.strip_prefix("alive/") {
                alive.entry(run_id.to_owned()).or_default().push(node.to_owned());
            }
        }
        self.inner.job_count.store(states.len(), Ordering::Relaxed);
        self.inner.keys.lock().unwrap_or_else(|p| p.into_inner()).retain(|run_id, _| states.contains_key(run_id));
        // The watch notes a version for every job it sees; forgotten jobs' entries go here.
        self.inner.versions.lock().unwrap_or_else(|p| p.into_inner()).retain(|run_id, _| states.contains_key(run_id));
        self.inner.latest.lock().unwrap_or_else(|p| p.into_inner()).retain(|run_id, _| states.contains_key(run_id));
        self.inner.parsed.lock().unwrap_or_else(|p| p.into_inner()).retain(|run_id, _| states.contains_key(run_id));
        self.inner
            .refreshing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|run_id, lock| states.contains_key(run_id) || Arc::strong_count(lock) > 1);
        Ok(states
            .into_iter()
            .map(|(id, job)| {
                let nodes = alive.remove(&id).unwrap_or_default();
                (id, job, nodes)
            })
            .collect())
    }

    pub async fn tick_all(&self, now: Millis, retention: Duration) -> Vec<(String, Decision)> {
        let jobs = match self.snapshots().await {
            Ok(jobs) => jobs,
            Err(error) => {
                warn!(error = %error, "etcd ticker could not list jobs");
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for (run_id, job, nodes) in jobs {
            if super::outlived(&job, now, retention) {
                self.delete_prefix(&run_id, format!("{PREFIX}{run_id}/"), "could not forget an old job").await;
                continue;
            }
            if job.phase.is_terminal() {
                continue;
            }
            let heard = self.heard(&run_id);
            let job =
                liveness::observe(Arc::unwrap_or_clone(job), &Signs { alive: &nodes, heard: &heard, lapsed: &[] }, now);
            let (next, _) = round::apply(&job, Event::Tick, now);
            if stored(&next) == stored(&job) {
                continue;
            }
            match self.apply(&run_id, None, Event::Tick, Guard::default(), now).await {
                Ok((_, d)) if d.action != Action::Nothing => out.push((run_id, d)),
                Ok(_) => {}
                Err(error) => warn!(run_id, error = %error, "etcd ticker could not update job"),
            }
        }
        out
    }

    fn note_version(&self, run_id: &str, version: u64) -> u64 {
        let mut versions = self.inner.versions.lock().unwrap_or_else(|p| p.into_inner());
        let v = versions.entry(run_id.to_owned()).or_insert(version);
        *v = (*v).max(version);
        *v
    }

    pub async fn wait_change(&self, run_id: &str, version: u64, deadline: Instant) -> Result<(), RdzvError> {
        let mut rx = self.inner.changes.subscribe();
        let mut authoritative = true;
        loop {
            let current = if authoritative {
                // Read within the last second (by any waiter): the watch may be down.
                match self.view(run_id, Some(Duration::from_secs(1)), |job| job.version).await? {
                    None => return Err(RdzvError::UnknownJob { run_id: run_id.to_owned() }),
                    Some(version) => self.note_version(run_id, version),
                }
            } else {
                let versions = self.inner.versions.lock().unwrap_or_else(|p| p.into_inner());
                versions.get(run_id).copied().unwrap_or(version)
            };
            if current != version || Instant::now() >= deadline {
                return Ok(());
            }
            // Woken by the watch: trust its cache. Not woken within a second: re-read etcd, in
            // case the watch stream is down.
            let wake = deadline.min(Instant::now() + Duration::from_secs(1));
            authoritative = tokio::time::timeout_at(wake, rx.changed()).await.is_err();
        }
    }

    async fn txn(&self, op: &'static str, txn: Txn) -> Result<etcd_client::TxnResponse, RdzvError> {
        self.run(op, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }
}
