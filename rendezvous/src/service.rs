//! The rendezvous service: the operations agents need (join, heartbeat, watch, report, leave,
//! status) on top of a [`Store`], with long-polls, a ticker that drives timers, logs and metrics.
//!
//! The HTTP API, the in-process client (`--standalone`, agent-hosted) and the etcd-direct client
//! all call this one type, so they behave alike.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::detector::{ProbeReport, ProbeRequest, Sent};
use crate::error::RdzvError;
use crate::round::{
    Action, Decision, Event, Guard, Job, JobSettings, JobStatus, Millis, NodeInfo, Phase, RoundCause, RoundInfo,
    SettingsError, MAX_NODES,
};
use crate::store::Store;

/// The longest a long-poll may be asked to wait.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// How long the service tries to reach a node a watcher reported gone before it believes it.
pub const GONE_CHECK: Duration = Duration::from_millis(150);

/// Wall-clock milliseconds: the clock every replica and agent shares ([`crate::clock`]).
pub use crate::clock::now_ms;

/// Answer to one join call; on the wire `{"status": "round", "data": RoundInfo}` or
/// `{"status": "wait", "data": {"round", "state"}}` (tag first, so clients parse without
/// buffering a thousand-member answer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", content = "data", rename_all = "snake_case")]
pub enum JoinAnswer {
    /// A round including this node closed.
    Round(RoundInfo),
    /// Still forming (or running without this node): join again.
    Wait { round: u64, state: String },
}

/// What a join long-poll needs of the job, taken without copying it.
struct JoinView {
    version: u64,
    round: u64,
    state: &'static str,
    info: Option<RoundInfo>,
    terminal: Option<RdzvError>,
    /// Still pending or a member (else it was dropped and joins again).
    tracked: bool,
}

impl JoinView {
    fn of(job: &Job, node_id: &str, members: bool) -> Self {
        // Past the nodes snapshots support, no member list: it would make every answer O(N).
        let members = members && job.members.len() <= rlaunch::contract::MAX_SNAPSHOT_NODES;
        let info = job.placement(node_id, members);
        let terminal = Rendezvous::terminal_error(job);
        let tracked = info.is_some() || terminal.is_some() || job.is_member(node_id) || job.tracks(node_id);
        JoinView { version: job.version, round: job.round, state: job.phase.name(), info, terminal, tracked }
    }
}

/// Answer to a join over HTTP: the [`JoinAnswer`] and the node's secret, which every later call
/// for the node must carry (`{"status", "data", "secret"}`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Joined {
    #[serde(flatten)]
    pub answer: JoinAnswer,
    /// Empty from a service without node identity (older versions).
    #[serde(default)]
    pub secret: String,
}

/// The secret is never printed (logs, panics).
impl std::fmt::Debug for Joined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Joined").field("answer", &self.answer).field("secret", &"<redacted>").finish()
    }
}

/// Bounds on what clients make the service keep; operators raise them with flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most jobs the store holds (finished and failed ones count until forgotten).
    pub max_jobs: usize,
    /// Most nodes per job: its `max_nodes` setting and the nodes waiting to join it.
    pub max_nodes: u32,
    /// How long a finished or failed job stays readable before it is forgotten.
    pub retention: Duration,
}

impl Default for Limits {
    /// 10,000 jobs of up to 32,768 nodes (a 262,144-GPU job at 8 per node).
    fn default() -> Self {
        Self { max_jobs: 10_000, max_nodes: 32_768, retention: crate::store::TERMINAL_RETENTION }
    }
}

/// What a heartbeat carries besides the node's id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Beat {
    /// The sender's heartbeat counts (the rendezvous derives the loss rate from them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent: Option<Sent>,
    /// Outcomes of probes this node was asked for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probes: Vec<ProbeReport>,
    /// How long each local rank waits in all-reduces per step (ranks of the Rust runtime).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<crate::stragglers::RankWait>,
    /// What this node's watching says of the members it watches ([`crate::detector::peers`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<crate::detector::PeerReport>,
}

/// Answer to one heartbeat: the probes the node is asked to make (reach each node directly and
/// report with a heartbeat).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatAnswer {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probe: Vec<ProbeRequest>,
}

/// Answer to one watch call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", content = "data", rename_all = "snake_case")]
pub enum WatchEvent {
    /// The round number moved on: stop workers and rejoin.
    NewRound(u64),
    Finished,
    Failed(String),
    /// Nothing changed within the wait.
    NoChange,
}

/// Run ids name etcd keys and URL segments: keep them tame.
pub fn validate_run_id(run_id: &str) -> Result<(), RdzvError> {
    // `.` and `..` are path segments: no URL (the status page's, a proxy's) could address them.
    let ok = !run_id.is_empty()
        && run_id.len() <= 128
        && run_id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && run_id != "."
        && run_id != "..";
    if ok {
        Ok(())
    } else {
        Err(RdzvError::BadRequest {
            message: format!("run id `{run_id}` must be 1 to 128 characters of [A-Za-z0-9._-], not `.` or `..`"),
        })
    }
}

#[derive(Default)]
struct Metrics {
    requests: AtomicU64,
    rejected: AtomicU64,
    rounds_closed: AtomicU64,
    rounds_node_lost: AtomicU64,
    rounds_failure: AtomicU64,
    rounds_scale_up: AtomicU64,
    rounds_member_left: AtomicU64,
    jobs_finished: AtomicU64,
    jobs_failed: AtomicU64,
    probes_reached: AtomicU64,
    probes_missed: AtomicU64,
}

/// The rendezvous over one store. Create with [`Rendezvous::new`]; a ticker task runs while it
/// lives.
pub struct Rendezvous {
    store: Store,
    limits: Limits,
    metrics: Metrics,
    /// What this process's heartbeats said of each rank's waits (not stored: per process).
    stragglers: std::sync::Mutex<crate::stragglers::Stragglers>,
    ticker: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        if let Some(t) = self.ticker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
    }
}

impl Rendezvous {
    /// Wraps `store` and starts the ticker (needs a tokio runtime), with the default [`Limits`].
    pub fn new(store: Store) -> Arc<Self> {
        Self::with_limits(store, Limits::default())
    }

    /// Wraps `store` with the given bounds and starts the ticker.
    pub fn with_limits(store: Store, limits: Limits) -> Arc<Self> {
        store.set_max_jobs(limits.max_jobs);
        let me = Arc::new(Self {
            store,
            limits,
            metrics: Metrics::default(),
            stragglers: Default::default(),
            ticker: std::sync::Mutex::new(None),
        });
        let handle = tokio::spawn(ticker(Arc::downgrade(&me)));
        *me.ticker.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        me
    }

    /// A rendezvous whose state lives in this process.
    pub fn in_memory() -> Arc<Self> {
        Self::new(Store::memory())
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The guard of an event for a node presenting `secret`.
    fn guard(&self, secret: Option<&str>) -> Guard {
        Guard {
            secret: secret.map(str::to_owned),
            minted: None,
            max_pending: Some(self.limits.max_nodes.min(MAX_NODES) as usize),
        }
    }

    fn observe(&self, run_id: &str, d: &Decision) {
        let m = &self.metrics;
        if matches!(
            d.action,
            Action::RoundOpened { .. } | Action::RoundClosed { .. } | Action::Finished | Action::Failed
        ) {
            // Ranks are numbered anew (or gone): the last round's waits compare with nothing.
            self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).forget(run_id);
        }
        match &d.action {
            Action::Nothing | Action::HeartbeatRecorded => {
                debug!(run_id, reason = %d.reason, "no transition");
            }
            Action::Updated if d.reason.contains("suspected") => warn!(run_id, reason = %d.reason, "failure detector"),
            // Members' progress (a few per node and round): for the accounting, not the log.
            Action::Updated if d.reason.starts_with("progress of ") => debug!(run_id, reason = %d.reason, "progress"),
            Action::Updated => info!(run_id, reason = %d.reason, "rendezvous updated"),
            Action::RoundClosed { round } => {
                m.rounds_closed.fetch_add(1, Ordering::Relaxed);
                info!(run_id, round, reason = %d.reason, "round closed");
            }
            Action::RoundOpened { round, cause } => {
                let counter = match cause {
                    RoundCause::NodeLost { .. } => &m.rounds_node_lost,
                    RoundCause::Failure { .. } => &m.rounds_failure,
                    RoundCause::ScaleUp { .. } => &m.rounds_scale_up,
                    RoundCause::MemberLeft { .. } | RoundCause::MemberRejoined { .. } => &m.rounds_member_left,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                warn!(run_id, round, reason = %d.reason, "new round opened");
            }
            Action::Finished => {
                m.jobs_finished.fetch_add(1, Ordering::Relaxed);
                info!(run_id, reason = %d.reason, "job finished");
            }
            Action::Failed => {
                m.jobs_failed.fetch_add(1, Ordering::Relaxed);
                warn!(run_id, reason = %d.reason, "job failed");
            }
            Action::Rejected(_) => {
                m.rejected.fetch_add(1, Ordering::Relaxed);
                debug!(run_id, reason = %d.reason, "event rejected");
            }
        }
    }

    /// Applies `ev` behind `guard`; answers `view` of the job after it (never a copy of it).
    async fn apply<R>(
        &self,
        run_id: &str,
        create: Option<&JobSettings>,
        ev: Event,
        guard: &Guard,
        view: impl FnOnce(&Job) -> R,
    ) -> Result<R, RdzvError> {
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        validate_run_id(run_id)?;
        let (out, d) = self.store.apply_view(run_id, create, ev, guard, now_ms(), view).await?;
        self.observe(run_id, &d);
        if let Action::Rejected(r) = d.action {
            return Err(r.into());
        }
        Ok(out)
    }

    fn terminal_error(job: &Job) -> Option<RdzvError> {
        match &job.phase {
            Phase::Finished { .. } => Some(RdzvError::JobFinished),
            Phase::Failed { kind, reason, .. } => {
                Some(crate::round::Rejection::JobFailed { kind: *kind, reason: reason.clone() }.into())
            }
            _ => None,
        }
    }

    /// Joins (or re-joins) `node` to job `run_id`, creating the job with `settings` if needed,
    /// and waits up to `wait` for a round including it to close. A node the job holds a key for
    /// must present its `secret`; the answer carries the secret to use from now on (a new one
    /// for a node new to the job), and the round's member list only when `members` asks.
    pub async fn join(
        &self,
        run_id: &str,
        settings: &JobSettings,
        node: NodeInfo,
        secret: Option<&str>,
        members: bool,
        wait: Duration,
    ) -> Result<Joined, RdzvError> {
        self.join_proposing(run_id, settings, node, secret, None, members, wait).await
    }

    /// [`Rendezvous::join`] where a node new to the job may propose the secret it is keyed with
    /// (64 lowercase hex digits): its retry after a lost answer proposes the same and is taken
    /// as its own, where a minted secret it never received would lock it out for a TTL.
    #[allow(clippy::too_many_arguments)]
    pub async fn join_proposing(
        &self,
        run_id: &str,
        settings: &JobSettings,
        node: NodeInfo,
        secret: Option<&str>,
        proposed: Option<&str>,
        members: bool,
        wait: Duration,
    ) -> Result<Joined, RdzvError> {
        if let Some(p) = proposed {
            if p.len() != 2 * crate::identity::SECRET_BYTES || crate::identity::unhex(p).is_none() {
                return Err(RdzvError::BadRequest {
                    message: "proposed_secret must be 64 lowercase hex digits".to_owned(),
                });
            }
        }
        validate_run_id(run_id)?;
        settings.validate()?;
        if settings.max_nodes > self.limits.max_nodes {
            let bound = self.limits.max_nodes;
            return Err(SettingsError::TooManyNodes { max: settings.max_nodes, bound }.into());
        }
        crate::round::validate_node(&node)?;
        let deadline = Instant::now() + wait.min(MAX_WAIT);
        // Nothing is registered for a caller that may not speak for the node (etcd: a forged
        // join must not keep a dead node's key alive).
        let registered = self.store.register_join(run_id, &node.node_id, secret, settings.node_ttl).await?;
        let mut guard = self.guard(secret);
        guard.minted = Some(proposed.map_or_else(crate::identity::mint, str::to_owned));
        let id = node.node_id.as_str();
        let joined = |job: &Job, guard: &Guard| {
            (JoinView::of(job, id, members), crate::round::secret_after_join(job, id, guard))
        };
        let (mut view, held) = match self
            .apply(run_id, Some(settings), Event::Join(node.clone()), &guard, |job| joined(job, &guard))
            .await
        {
            Ok(v) => v,
            Err(e) => {
                if registered {
                    // A refused join leaves no lease behind.
                    if let Err(error) = self.store.forget_node(run_id, id).await {
                        warn!(run_id, node_id = %id, %error, "could not revoke a refused join's lease");
                    }
                }
                return Err(e);
            }
        };
        let Some(held) = held else {
            return Err(view
                .terminal
                .unwrap_or_else(|| RdzvError::Store { message: format!("node {id} was dropped while joining") }));
        };
        // From now on the node holds `held`: a re-join below (after it was dropped) presents it,
        // and keys the node with it again if its key was pruned meanwhile.
        guard.secret = Some(held.clone());
        guard.minted = Some(held.clone());
        loop {
            if let Some(info) = view.info {
                return Ok(Joined { answer: JoinAnswer::Round(info), secret: held });
            }
            if let Some(e) = view.terminal {
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Ok(Joined {
                    answer: JoinAnswer::Wait { round: view.round, state: view.state.to_owned() },
                    secret: held,
                });
            }
            self.store.wait_change(run_id, view.version, deadline).await?;
            view = self
                .store
                .view(run_id, |job| JoinView::of(job, id, members))
                .await?
                .ok_or_else(|| RdzvError::UnknownJob { run_id: run_id.to_owned() })?;
            if !view.tracked && view.info.is_none() && view.terminal.is_none() {
                // Dropped meanwhile (silent too long while waiting): join again.
                view = self
                    .apply(run_id, Some(settings), Event::Join(node.clone()), &guard, |job| {
                        JoinView::of(job, id, members)
                    })
                    .await?;
            }
        }
    }

    /// A sign of life from `node_id`, with its sequence number and the outcomes of the probes
    /// it was asked for; answers the probes it owes now.
    pub async fn heartbeat(
        &self,
        run_id: &str,
        node_id: &str,
        secret: Option<&str>,
        beat: Beat,
    ) -> Result<HeartbeatAnswer, RdzvError> {
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        validate_run_id(run_id)?;
        let (reached, missed) =
            beat.probes.iter().fold((0, 0), |(r, m), p| if p.reached { (r + 1, m) } else { (r, m + 1) });
        let guard = self.guard(secret);
        // Reports that a node's agent is gone are checked by the service itself, and only once
        // the heartbeat proved its sender (the first update checks the node's secret).
        let (gone, peers): (Vec<_>, Vec<_>) = beat.peers.into_iter().partition(|r| r.gone);
        let (mut d, probe) =
            self.store.heartbeat(run_id, node_id, (beat.sent, beat.probes, peers), &guard, now_ms()).await?;
        if !gone.is_empty() && !matches!(d.action, Action::Rejected(_)) {
            let confirmed = self.confirm_gone(run_id, node_id, gone).await;
            if !confirmed.is_empty() {
                let (then, _) =
                    self.store.heartbeat(run_id, node_id, (None, Vec::new(), confirmed), &guard, now_ms()).await?;
                if !matches!(then.action, Action::HeartbeatRecorded | Action::Nothing | Action::Rejected(_)) {
                    d = then;
                }
            }
        }
        self.observe(run_id, &d);
        match d.action {
            Action::Rejected(r) => Err(r.into()),
            _ => {
                if !beat.steps.is_empty() {
                    // Only the ranks the running round gave this node count.
                    let own = self.store.view(run_id, |job| job.ranks_of(node_id)).await.ok().flatten().flatten();
                    if let Some(own) = own {
                        self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).record(
                            run_id,
                            node_id,
                            beat.steps,
                            own,
                            now_ms(),
                        );
                    }
                }
                self.metrics.probes_reached.fetch_add(reached, Ordering::Relaxed);
                self.metrics.probes_missed.fetch_add(missed, Ordering::Relaxed);
                Ok(HeartbeatAnswer { probe })
            }
        }
    }

    /// Checks each report that a watched node's agent is gone before it counts: the service
    /// reaches for the node's probe endpoint itself (TCP and UDP, [`GONE_CHECK`]) and keeps the
    /// report only when the node's host refuses it too and nothing answers; otherwise (a watcher
    /// that lies or mistook a firewall's rejection, a lossy path) the report is dropped and
    /// logged. Reports of a silence need no check: the rendezvous' own silence must agree
    /// with them.
    async fn confirm_gone(
        &self,
        run_id: &str,
        watcher: &str,
        mut peers: Vec<crate::detector::PeerReport>,
    ) -> Vec<crate::detector::PeerReport> {
        peers.truncate(crate::detector::peers::MAX_REPORTS);
        peers.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        peers.dedup_by(|a, b| a.node_id == b.node_id);
        let gone: Vec<String> = peers.iter().filter(|r| r.gone).map(|r| r.node_id.clone()).collect();
        if gone.is_empty() {
            return peers;
        }
        let addrs = self
            .store
            .view(run_id, |job| {
                gone.iter()
                    .filter(|id| job.watchers_of(id).contains(&watcher))
                    .filter_map(|id| Some((id.clone(), job.addr_of(id)?.to_string())))
                    .collect::<Vec<_>>()
            })
            .await
            .ok()
            .flatten()
            .unwrap_or_default();
        let refused =
            |r: &std::io::Result<Duration>| matches!(r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused);
        let mut confirmed = Vec::new();
        for (id, addr) in addrs {
            let nonce = rand::random::<u32>();
            let udp = rlaunch::store::probe_udp(&addr, nonce, GONE_CHECK / 3, GONE_CHECK);
            let tcp = rlaunch::store::probe(&addr, nonce.wrapping_add(1), GONE_CHECK);
            let (udp, tcp) = tokio::join!(udp, tcp);
            if udp.is_ok() || tcp.is_ok() || !(refused(&udp) || refused(&tcp)) {
                warn!(run_id, watcher, node = %id, "a watcher reported the node's agent gone, but the service was not refused there: report dropped");
            } else {
                confirmed.push(id);
            }
        }
        peers.retain(|r| r.gone && confirmed.contains(&r.node_id));
        peers
    }

    /// Waits up to `wait` for job `run_id` to leave round `after_round` or end. A watch for a
    /// node (`Some((node_id, secret))`) must carry the node's secret.
    pub async fn watch(
        &self,
        run_id: &str,
        after_round: u64,
        node: Option<(&str, Option<&str>)>,
        wait: Duration,
    ) -> Result<WatchEvent, RdzvError> {
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        validate_run_id(run_id)?;
        let deadline = Instant::now() + wait.min(MAX_WAIT);
        let mut checked = node.is_none();
        loop {
            // A view, not a copy: every agent of a 10,000-node job watches.
            let seen = self
                .store
                .view(run_id, |job| {
                    let allowed = match (node, checked) {
                        (Some((node_id, secret)), false) => crate::round::authorize(job, node_id, secret),
                        _ => Ok(()),
                    };
                    let event = match &job.phase {
                        Phase::Finished { .. } => Some(WatchEvent::Finished),
                        Phase::Failed { reason, .. } => Some(WatchEvent::Failed(reason.clone())),
                        _ if job.round != after_round => Some(WatchEvent::NewRound(job.round)),
                        _ => None,
                    };
                    (allowed, event, job.version)
                })
                .await?
                .ok_or_else(|| RdzvError::UnknownJob { run_id: run_id.to_owned() })?;
            let (allowed, event, version) = seen;
            allowed?;
            checked = true;
            if let Some(event) = event {
                return Ok(event);
            }
            if Instant::now() >= deadline {
                return Ok(WatchEvent::NoChange);
            }
            self.store.wait_change(run_id, version, deadline).await?;
        }
    }

    pub async fn report_failure(
        &self,
        run_id: &str,
        node_id: &str,
        secret: Option<&str>,
        round: u64,
        root_cause: Box<crate::round::RootCause>,
    ) -> Result<(), RdzvError> {
        let ev = Event::ReportFailure { node_id: node_id.to_owned(), round, root_cause };
        self.apply(run_id, None, ev, &self.guard(secret), |_| ()).await
    }

    /// Where `node_id`'s ranks stood when `round` ended by a failure elsewhere: merged into
    /// the job's last root cause (report lines of [`rlaunch::stacks`]).
    pub async fn report_stacks(
        &self,
        run_id: &str,
        node_id: &str,
        secret: Option<&str>,
        round: u64,
        stacks: Vec<String>,
    ) -> Result<(), RdzvError> {
        let ev = Event::ReportStacks { node_id: node_id.to_owned(), round, stacks };
        self.apply(run_id, None, ev, &self.guard(secret), |_| ()).await
    }

    /// How far `node_id` got in `round` (workers started, a step restored, saved, saved again).
    pub async fn report_progress(
        &self,
        run_id: &str,
        node_id: &str,
        secret: Option<&str>,
        round: u64,
        progress: rlaunch::contract::NodeProgress,
    ) -> Result<(), RdzvError> {
        let ev = Event::Progress { node_id: node_id.to_owned(), round, progress };
        self.apply(run_id, None, ev, &self.guard(secret), |_| ()).await
    }

    pub async fn report_success(
        &self,
        run_id: &str,
        node_id: &str,
        secret: Option<&str>,
        round: u64,
    ) -> Result<(), RdzvError> {
        let ev = Event::NodeSucceeded { node_id: node_id.to_owned(), round };
        self.apply(run_id, None, ev, &self.guard(secret), |_| ()).await
    }

    pub async fn leave(&self, run_id: &str, node_id: &str, secret: Option<&str>) -> Result<(), RdzvError> {
        self.apply(run_id, None, Event::Leave { node_id: node_id.to_owned() }, &self.guard(secret), |_| ()).await?;
        self.store.forget_node(run_id, node_id).await
    }

    pub async fn status(&self, run_id: &str) -> Result<JobStatus, RdzvError> {
        validate_run_id(run_id)?;
        let now = now_ms();
        let job =
            self.store.load(run_id, now).await?.ok_or_else(|| RdzvError::UnknownJob { run_id: run_id.to_owned() })?;
        let mut status = job.status(run_id, now);
        status.straggler = self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).slowest(run_id, now);
        Ok(status)
    }

    /// Every job's status.
    pub async fn list(&self) -> Result<Vec<JobStatus>, RdzvError> {
        let now = now_ms();
        // Each job's timeline only in its own status: a list of many stays small.
        let status = |(id, job): &(String, Job)| {
            let mut s = job.status(id, now);
            s.recovery.timeline.clear();
            s
        };
        Ok(self.store.jobs(now).await?.iter().map(status).collect())
    }

    /// Applies `Tick` to every job once (the ticker does this periodically).
    pub async fn tick(&self) {
        for (run_id, d) in self.store.tick_all(now_ms(), self.limits.retention).await {
            self.observe(&run_id, &d);
        }
        self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).prune(now_ms());
    }

    /// Prometheus text exposition.
    pub async fn metrics_text(&self) -> String {
        let m = &self.metrics;
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, labels: &str, v: &AtomicU64, header: bool| {
            if header {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            }
            let _ = writeln!(out, "{name}{labels} {}", v.load(Ordering::Relaxed));
        };
        counter("rlaunch_rdzv_requests_total", "Rendezvous operations served by this process.", "", &m.requests, true);
        counter("rlaunch_rdzv_rejected_total", "Events refused (bad or stale input).", "", &m.rejected, true);
        counter("rlaunch_rdzv_rounds_closed_total", "Rounds closed by this process.", "", &m.rounds_closed, true);
        let opened = "rlaunch_rdzv_rounds_opened_total";
        let help = "Running rounds torn down for a new one, by cause.";
        counter(opened, help, "{cause=\"node_lost\"}", &m.rounds_node_lost, true);
        counter(opened, help, "{cause=\"failure\"}", &m.rounds_failure, false);
        counter(opened, help, "{cause=\"scale_up\"}", &m.rounds_scale_up, false);
        counter(opened, help, "{cause=\"member_left\"}", &m.rounds_member_left, false);
        counter("rlaunch_rdzv_jobs_finished_total", "Jobs finished.", "", &m.jobs_finished, true);
        counter("rlaunch_rdzv_jobs_failed_total", "Jobs failed.", "", &m.jobs_failed, true);
        let probes = "rlaunch_rdzv_probes_total";
        let help = "Indirect probes of suspected nodes reported to this process, by outcome.";
        counter(probes, help, "{result=\"reached\"}", &m.probes_reached, true);
        counter(probes, help, "{result=\"missed\"}", &m.probes_missed, false);
        let _ = writeln!(out, "# HELP rlaunch_rdzv_jobs Jobs in the store, by state.\n# TYPE rlaunch_rdzv_jobs gauge");
        match self.store.jobs(now_ms()).await {
            Ok(jobs) => {
                for state in ["waiting", "last_call", "running", "finished", "failed"] {
                    let n = jobs.iter().filter(|(_, j)| j.phase.name() == state).count();
                    let _ = writeln!(out, "rlaunch_rdzv_jobs{{state=\"{state}\"}} {n}");
                }
                health_metrics(&mut out, &jobs, now_ms());
                recovery_metrics(&mut out, &jobs, now_ms());
            }
            Err(error) => warn!(error = %error, "metrics could not list jobs"),
        }
        let stragglers = self.stragglers.lock().unwrap_or_else(|p| p.into_inner()).all(now_ms());
        let _ = writeln!(
            out,
            "# HELP rlaunch_rdzv_straggler_rank The rank the others wait for most (least time in all-reduce per step, over its last steps).\n# TYPE rlaunch_rdzv_straggler_rank gauge"
        );
        for (run_id, s) in &stragglers {
            let _ = writeln!(
                out,
                "rlaunch_rdzv_straggler_rank{{run_id=\"{run_id}\",node=\"{}\"}} {}",
                label_value(&s.node_id),
                s.rank
            );
        }
        let _ = writeln!(
            out,
            "# HELP rlaunch_rdzv_straggler_late_seconds How much later per step the straggler arrives at the all-reduces than the earliest rank.\n# TYPE rlaunch_rdzv_straggler_late_seconds gauge"
        );
        for (run_id, s) in &stragglers {
            let _ = writeln!(
                out,
                "rlaunch_rdzv_straggler_late_seconds{{run_id=\"{run_id}\",rank=\"{}\"}} {}",
                s.rank,
                s.late_ms / 1000.0
            );
        }
        let _ = writeln!(
            out,
            "# HELP rlaunch_rdzv_store_info Which store backs this process.\n# TYPE rlaunch_rdzv_store_info gauge"
        );
        let _ = writeln!(out, "rlaunch_rdzv_store_info{{store=\"{}\"}} 1", self.store.name());
        out
    }
}

/// Per-node gauges of the failure detector: suspicion, heartbeat loss and phi of every node a
/// live job watches.
fn health_metrics(out: &mut String, jobs: &[(String, Job)], now: Millis) {
    let gauges = [
        (
            "rlaunch_rdzv_node_suspected",
            "1 while the failure detector suspects the node (probes under way or answered).",
        ),
        ("rlaunch_rdzv_node_heartbeat_loss_ratio", "Share of the node's recent heartbeats that never arrived."),
        ("rlaunch_rdzv_node_phi", "How late a suspected node's heartbeats are (phi accrual; suspected from 8)."),
        ("rlaunch_rdzv_node_probes_reached_total", "Probes of the node by other members that reached it."),
        ("rlaunch_rdzv_node_probes_missed_total", "Probes of the node by other members that did not reach it."),
    ];
    let mut rows: Vec<[Option<f64>; 5]> = Vec::new();
    let mut labels = Vec::new();
    for (run_id, job) in jobs.iter().filter(|(_, j)| !j.phase.is_terminal()) {
        for node_id in job.last_seen.keys().chain(job.health.keys().filter(|id| !job.last_seen.contains_key(*id))) {
            let h = job.node_health(node_id, now);
            // At 10,000 nodes five series each is a lot: phi only while suspected, probe
            // counts only once a node was probed.
            let suspected = h.suspected_for_ms.is_some();
            let probed = h.probes_reached + h.probes_missed > 0;
            rows.push([
                Some(if suspected { 1.0 } else { 0.0 }),
                h.heartbeat_loss,
                h.phi.filter(|_| suspected),
                Some(h.probes_reached as f64).filter(|_| probed),
                Some(h.probes_missed as f64).filter(|_| probed),
            ]);
            labels.push(format!("{{run_id=\"{run_id}\",node_id=\"{}\"}}", label_value(node_id)));
        }
    }
    for (i, (name, help)) in gauges.iter().enumerate() {
        let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (row, label) in rows.iter().zip(&labels) {
            if let Some(v) = row[i] {
                let _ = writeln!(out, "{name}{label} {v}");
            }
        }
    }
}

/// A node id as a Prometheus label value, escaped as the text exposition format says
/// (backslash, double quote and line feed as `\\`, `\"` and `\n`): replacing them instead
/// would give `a"b` and `a_b` the same series.
/// Per-job gauges of the recovery accounting: goodput, time lost, recoveries, and the last
/// recovery's phases.
fn recovery_metrics(out: &mut String, jobs: &[(String, Job)], now: Millis) {
    let views: Vec<(String, crate::round::RecoveryStatus)> =
        jobs.iter().map(|(id, job)| (label_value(id), job.recovery_status(now))).collect();
    let head = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    head(out, "rlaunch_job_goodput", "gauge", "Training time over wall time since the job's first round closed.");
    for (id, v) in &views {
        if let Some(g) = v.goodput {
            let _ = writeln!(out, "rlaunch_job_goodput{{run_id=\"{id}\"}} {g:.6}");
        }
    }
    head(out, "rlaunch_job_lost_seconds", "gauge", "Time lost to the first start-up and to recoveries.");
    for (id, v) in &views {
        let _ = writeln!(out, "rlaunch_job_lost_seconds{{run_id=\"{id}\"}} {:.3}", v.lost_ms as f64 / 1000.0);
    }
    head(out, "rlaunch_job_recoveries_total", "counter", "Recoveries: running rounds torn down and formed again.");
    for (id, v) in &views {
        let _ = writeln!(out, "rlaunch_job_recoveries_total{{run_id=\"{id}\"}} {}", v.count);
    }
    let name = "rlaunch_job_last_recovery_seconds";
    head(out, name, "gauge", "The last recovery's phases (a phase not known yet is absent).");
    for (id, v) in &views {
        let Some(r) = v.recoveries.last() else { continue };
        let p = &r.phases;
        let phases = [
            ("noticing", p.noticing_ms),
            ("reforming", p.reforming_ms),
            ("starting", p.starting_ms),
            ("restoring", p.restoring_ms),
            ("computing_again", p.computing_again_ms),
            ("total", Some(r.lost_ms)),
        ];
        for (phase, ms) in phases {
            if let Some(ms) = ms {
                let _ = writeln!(out, "{name}{{run_id=\"{id}\",phase=\"{phase}\"}} {:.3}", ms as f64 / 1000.0);
            }
        }
    }
    let name = "rlaunch_job_last_recovery_steps_redone";
    head(out, name, "gauge", "Steps the last recovery computed a second time.");
    for (id, v) in &views {
        if let Some(n) = v.recoveries.last().and_then(|r| r.phases.steps_redone) {
            let _ = writeln!(out, "{name}{{run_id=\"{id}\"}} {n}");
        }
    }
    let name = "rlaunch_job_last_recovery_ranks_kept";
    head(out, name, "gauge", "Ranks whose process the last recovery kept (rlaunch.resilient).");
    for (id, v) in &views {
        if let Some(n) = v.recoveries.last().and_then(|r| r.phases.ranks_kept) {
            let _ = writeln!(out, "{name}{{run_id=\"{id}\"}} {n}");
        }
    }
}

fn label_value(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Drives timers (heartbeat lapses, last calls, join timeouts) while the rendezvous lives.
async fn ticker(me: Weak<Rendezvous>) {
    let (period, expired) = match me.upgrade() {
        Some(r) => (
            r.store.tick_period(),
            match &r.store {
                Store::Etcd(e) => Some(e.expired()),
                Store::Memory(_) => None,
            },
        ),
        None => return,
    };
    loop {
        match &expired {
            Some(n) => {
                let _ = tokio::time::timeout(period, n.notified()).await;
            }
            None => tokio::time::sleep(period).await,
        }
        let Some(r) = me.upgrade() else { return };
        r.tick().await;
    }
}

#[cfg(test)]
mod label_tests {
    #[test]
    fn label_values_are_escaped_as_the_exposition_format_says_not_replaced() {
        assert_eq!(super::label_value(r#"a"b"#), r#"a\"b"#);
        assert_eq!(super::label_value("a_b"), "a_b");
        assert_eq!(super::label_value(r"a\b"), r"a\\b");
        assert_eq!(super::label_value("a\nb"), r"a\nb");
        assert_ne!(super::label_value(r#"a"b"#), super::label_value("a_b"));
    }
}

#[cfg(test)]
mod run_id_tests {
    #[test]
    fn run_ids_are_tame_url_segments() {
        for ok in ["job42", "slurm-1234", "k8s-train", "a.b", "...", "x".repeat(128).as_str()] {
            assert!(super::validate_run_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "é", "x".repeat(129).as_str()] {
            assert!(super::validate_run_id(bad).is_err(), "{bad:?}");
        }
    }
}

/// Secrets pass through the round machine's guard and the join's answer: neither prints them.
#[cfg(test)]
mod secret_tests {
    #[test]
    fn no_debug_print_of_a_request_guard_or_answer_shows_a_secret() {
        let s = crate::identity::mint();
        let guard = crate::round::Guard { secret: Some(s.clone()), minted: Some(s.clone()), max_pending: Some(3) };
        let joined = crate::service::Joined {
            answer: crate::service::JoinAnswer::Wait { round: 1, state: "forming".into() },
            secret: s.clone(),
        };
        for printed in
            [format!("{guard:?}"), format!("{joined:?}"), format!("{:?}", crate::identity::Secret(s.clone()))]
        {
            assert!(!printed.contains(&s), "{printed}");
            assert!(printed.contains("redacted"), "{printed}");
        }
    }
}
