//! The rendezvous round state machine: a pure function `apply(job, event, now) -> (job, decision)`.
//!
//! No I/O, no async, no clock reads: the caller passes `now` in milliseconds (wall-clock millis
//! since the Unix epoch at the edges, so that several server replicas on one etcd agree; made-up
//! numbers in tests). Every store (memory, etcd) and every edge (HTTP, in-process) runs this one
//! machine, so the behaviour is defined here and only here.
//!
//! Life of a job: nodes join a *forming* round (`Waiting` below MIN, `LastCall` once MIN are in)
//! → the round closes (`Running`) with contiguous, deterministic group ranks → a member's
//! heartbeat lapses, a failure is reported, a member leaves, or a node waits to join below MAX
//! → the round number goes up and a new round forms with the survivors → … until every member
//! of a round reports success (`Finished`), the restart budget is spent or too few nodes come
//! back within the join timeout (`Failed`).
//!
//! Round numbers go up when a round is *opened* (torn down for a new one), so a watcher of round
//! N learns "stop your workers and rejoin" as soon as N+1 exists, not when N+1 closes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::detector::{self, Health, ProbeReport, ProbeRequest, Sent, Timing, Verdict};
pub use rlaunch::contract::{HostPort, Member, NodeInfo, RootCause, RoundInfo};

/// Milliseconds: the machine's clock unit (wall-clock millis since the Unix epoch at the edges).
pub type Millis = u64;

/// Most nodes a job may have: with [`MAX_LOCAL_WORLD_SIZE`], every rank (and the world size)
/// fits a `u32` with room to spare.
pub const MAX_NODES: u32 = 1 << 20;
/// Most workers one node may run.
pub const MAX_LOCAL_WORLD_SIZE: u32 = 4096;
/// Longest any timeout of a job may be: a forming job that never expires holds the service's
/// memory for good.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// How many node TTLs a node waiting beside a running round below MAX must keep heartbeating
/// before the round is torn down for it (a scale-up): see [`Job::scale_up_candidate`].
pub const SCALE_UP_TTLS: u32 = 2;
/// Shortest heartbeat interval: faster ones only load the service.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(10);

/// How a job's rendezvous behaves; fixed when the job is created by its first join.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSettings {
    /// Fewest nodes a round may close with (`--nnodes MIN:MAX`).
    pub min_nodes: u32,
    /// Most nodes a round may close with.
    pub max_nodes: u32,
    /// How long a forming round waits for MIN nodes before the job fails.
    #[serde(rename = "join_timeout_ms", with = "duration_ms")]
    pub join_timeout: Duration,
    /// How long a round with at least MIN nodes waits for more. Skipped when every surviving
    /// member of the previous round is back, or at MAX nodes once none of them is still
    /// expected (returning members keep their places over standbys).
    #[serde(rename = "last_call_timeout_ms", with = "duration_ms")]
    pub last_call_timeout: Duration,
    /// How often agents send heartbeats.
    #[serde(rename = "heartbeat_interval_ms", with = "duration_ms")]
    pub heartbeat_interval: Duration,
    /// A node not heard from for this long is suspected at the latest (sooner when its heartbeats
    /// are late by much more than their usual jitter) and probed by other members; on etcd, the
    /// lease TTL, rounded up to whole seconds. See [`crate::detector`].
    #[serde(rename = "node_ttl_ms", with = "duration_ms")]
    pub node_ttl: Duration,
    /// How long the probes of a suspected node may take: a node no member reached within it is
    /// lost. Detection of a dead node therefore takes at most TTL + this.
    #[serde(rename = "probe_timeout_ms", with = "duration_ms", default = "default_probe_timeout")]
    pub probe_timeout: Duration,
    /// Global restart budget: how many reported failures the job survives.
    pub max_restarts: u32,
    /// How long an agent may take to stop its workers (`--shutdown-timeout`). A forming round
    /// waits up to this long past its last call for surviving members of the previous round
    /// that are alive but still stopping their workers, so a slow stop does not leave a node
    /// out (and its old workers running beside the new round). Zero: no such wait.
    #[serde(rename = "stop_grace_ms", with = "duration_ms", default)]
    pub stop_grace: Duration,
    /// `--hang-timeout` for the whole job: the first that a node gives ([`JobSettings::adopt`]);
    /// every node takes it from its round, a node that gives another is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_timeout: Option<rlaunch::contract::HangTimeout>,
    /// `--fingerprint`: how nodes that differ are treated (log them, or refuse them); adopted
    /// like the hang timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<rlaunch::fingerprint::Policy>,
}

fn default_probe_timeout() -> Duration {
    Duration::from_secs(1)
}

impl Default for JobSettings {
    /// A dead node is lost within 3 s of its last heartbeat (suspected after about 1.3 s on a
    /// clean link, at the latest at the 2 s TTL, then 1 s of probes): heartbeat 0.5 s, TTL 2 s,
    /// probe timeout 1 s.
    fn default() -> Self {
        Self {
            min_nodes: 1,
            max_nodes: 1,
            join_timeout: Duration::from_secs(600),
            last_call_timeout: Duration::from_secs(1),
            heartbeat_interval: Duration::from_millis(500),
            node_ttl: Duration::from_secs(2),
            probe_timeout: default_probe_timeout(),
            max_restarts: 0,
            stop_grace: Duration::ZERO,
            hang_timeout: None,
            fingerprint: None,
        }
    }
}

/// Settings that cannot work together, rejected before any job exists.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    #[error("min nodes must be at least 1 (got {min})")]
    MinNodesZero { min: u32 },
    #[error("min nodes ({min}) must not exceed max nodes ({max})")]
    MinAboveMax { min: u32, max: u32 },
    #[error("max nodes ({max}) is over the bound of {bound} nodes per job (rlaunch-rendezvous --max-nodes, at most 1048576)")]
    TooManyNodes { max: u32, bound: u32 },
    #[error("{name} ({value:?}) must be {bound}")]
    OutOfRange { name: &'static str, value: Duration, bound: &'static str },
    #[error("{name} must be greater than zero")]
    Zero { name: &'static str },
    #[error("timeouts must nest: {smaller} ({smaller_value:?}) must be less than {larger} ({larger_value:?})")]
    NotNested { smaller: &'static str, smaller_value: Duration, larger: &'static str, larger_value: Duration },
}

/// Checks that each timeout in `chain` is strictly less than the next one. The launcher passes
/// its whole chain (heartbeat interval < node TTL < collective timeout < stop grace < join
/// timeout); [`JobSettings::validate`] checks the part the rendezvous knows about.
pub fn check_nesting(chain: &[(&'static str, Duration)]) -> Result<(), SettingsError> {
    for pair in chain.windows(2) {
        let ((smaller, smaller_value), (larger, larger_value)) = (pair[0], pair[1]);
        if smaller_value >= larger_value {
            return Err(SettingsError::NotNested { smaller, smaller_value, larger, larger_value });
        }
    }
    Ok(())
}

impl JobSettings {
    /// Rejects settings that cannot work: MIN of 0, MIN > MAX, zero intervals, and timeouts that
    /// do not nest (heartbeat interval < node TTL < join timeout, last call < join timeout).
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.min_nodes == 0 {
            return Err(SettingsError::MinNodesZero { min: self.min_nodes });
        }
        if self.min_nodes > self.max_nodes {
            return Err(SettingsError::MinAboveMax { min: self.min_nodes, max: self.max_nodes });
        }
        if self.max_nodes > MAX_NODES {
            return Err(SettingsError::TooManyNodes { max: self.max_nodes, bound: MAX_NODES });
        }
        if self.heartbeat_interval.is_zero() {
            return Err(SettingsError::Zero { name: "heartbeat_interval" });
        }
        if self.heartbeat_interval < MIN_HEARTBEAT {
            return Err(SettingsError::OutOfRange {
                name: "heartbeat_interval",
                value: self.heartbeat_interval,
                bound: "at least 10 ms",
            });
        }
        for (name, value) in [
            ("join_timeout", self.join_timeout),
            ("last_call_timeout", self.last_call_timeout),
            ("node_ttl", self.node_ttl),
            ("probe_timeout", self.probe_timeout),
            ("shutdown timeout", self.stop_grace),
        ] {
            if value > MAX_TIMEOUT {
                return Err(SettingsError::OutOfRange { name, value, bound: "at most 7 days" });
            }
        }
        if self.probe_timeout.is_zero() {
            return Err(SettingsError::Zero { name: "probe_timeout" });
        }
        check_nesting(&[
            ("heartbeat_interval", self.heartbeat_interval),
            ("node_ttl", self.node_ttl),
            ("join_timeout", self.join_timeout),
        ])?;
        // Probers learn of a suspicion from the answer to their next heartbeat, up to an
        // interval later, and need time to probe and report before the verdict.
        check_nesting(&[
            ("2 x heartbeat_interval", self.heartbeat_interval.saturating_mul(2)),
            ("probe_timeout", self.probe_timeout + Duration::from_millis(1)),
            ("join_timeout", self.join_timeout),
        ])?;
        if !self.stop_grace.is_zero() {
            // A node stopping its workers keeps heartbeating, but the rendezvous must not wait
            // on a stop for longer than a join may take.
            check_nesting(&[
                ("node_ttl", self.node_ttl),
                ("--shutdown-timeout", self.stop_grace),
                ("join_timeout", self.join_timeout),
            ])?;
        }
        check_nesting(&[("last_call_timeout", self.last_call_timeout), ("join_timeout", self.join_timeout)])
    }

    /// Whether a node with `other` belongs to a job created with `self`: the same settings,
    /// except the shutdown timeout, which each node may choose (the job waits by the first
    /// node's), and a hang timeout or fingerprint policy given by one side only.
    pub fn same_job(&self, other: &JobSettings) -> bool {
        let common = |s: &JobSettings| JobSettings {
            stop_grace: Duration::ZERO,
            hang_timeout: None,
            fingerprint: None,
            ..s.clone()
        };
        fn agree<T: PartialEq>(a: Option<T>, b: Option<T>) -> bool {
            a.zip(b).is_none_or(|(a, b)| a == b)
        }
        common(self) == common(other)
            && agree(self.hang_timeout, other.hang_timeout)
            && agree(self.fingerprint, other.fingerprint)
    }

    /// The job's settings once a node with `other` has joined: the first hang timeout a node
    /// gives becomes the job's (nodes started without the flag take it from their round).
    pub fn adopt(&mut self, other: &JobSettings) {
        if self.hang_timeout.is_none() {
            self.hang_timeout = other.hang_timeout;
        }
        if self.fingerprint.is_none() {
            self.fingerprint = other.fingerprint;
        }
    }

    fn ms(d: Duration) -> Millis {
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
    }

    /// The failure detector's timing.
    pub fn timing(&self) -> Timing {
        Timing {
            interval: Self::ms(self.heartbeat_interval),
            ttl: Self::ms(self.node_ttl),
            probe_timeout: Self::ms(self.probe_timeout),
        }
    }
}

/// Group ranks by node id for [`Job::member`]; equal to any other (it is a cache).
#[derive(Debug, Clone, Default)]
pub struct MemberIndex(std::sync::OnceLock<HashMap<String, usize>>);

impl PartialEq for MemberIndex {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for MemberIndex {}

/// A node that joined and waits for the next round to close, in join order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    #[serde(flatten)]
    pub node: NodeInfo,
    pub joined_at: Millis,
    /// The digest of the node's fingerprint (kept once per job in [`Job::fingerprints`]; the
    /// node's own copy is dropped at join).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint_digest: Option<String>,
}

/// Why a job failed, for callers that treat a join timeout differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    JoinTimeout,
    RestartBudget,
}

/// Where the job is in its life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Phase {
    /// A round forms with fewer than MIN nodes; the job fails at `since + join_timeout`.
    Waiting { since: Millis },
    /// At least MIN nodes are in; the round closes at `deadline` (or at MAX).
    LastCall { since: Millis, deadline: Millis },
    /// The round closed; its members run workers.
    Running { since: Millis },
    /// Every member of the last round succeeded.
    Finished { at: Millis },
    /// The job is over without success.
    Failed { at: Millis, kind: FailureKind, reason: String },
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Waiting { .. } => "waiting",
            Phase::LastCall { .. } => "last_call",
            Phase::Running { .. } => "running",
            Phase::Finished { .. } => "finished",
            Phase::Failed { .. } => "failed",
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self, Phase::Finished { .. } | Phase::Failed { .. })
    }

    fn is_forming(&self) -> bool {
        matches!(self, Phase::Waiting { .. } | Phase::LastCall { .. })
    }
}

/// The whole state of one job's rendezvous. Plain data: stores persist it as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub settings: JobSettings,
    pub phase: Phase,
    /// The current round: running when `phase` is `Running`, forming before that.
    pub round: u64,
    /// Goes up on every transition (a round opened or closed, the job over) and only then:
    /// long-polls wait for it to move, so joins and heartbeats do not wake every waiter.
    pub version: u64,
    /// Members of the last closed round in group-rank order (the running one when `Running`).
    pub members: Vec<Member>,
    /// Digest of `members`, computed when the round closed (answers carry it, not the list).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub members_digest: String,
    /// Group ranks by node id, built on first use per round: finding a member among 10,000
    /// is a lookup, not a scan. Not stored; a stale entry is detected and scanned past.
    #[serde(skip)]
    pub member_index: MemberIndex,
    /// Nodes waiting for the next round to close, in join order (standbys beyond MAX too).
    pub pending: Vec<Pending>,
    /// Surviving members of the previous round, in their old rank order, expected to rejoin the
    /// forming round; when all are back the last call is skipped.
    pub previous: Vec<String>,
    /// Members of the running round that reported success.
    pub succeeded: Vec<String>,
    /// Last time each live node (member, pending or previous) was heard from.
    pub last_seen: BTreeMap<String, Millis>,
    /// The failure detector's view of those nodes: recent arrivals, suspicions and probes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub health: BTreeMap<String, Health>,
    /// Nodes suspected at the last tick (so a heartbeat finds the probes it owes without going
    /// through every node; a suspicion cleared since is skipped).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suspects: Vec<String>,
    /// Each node's credential: the SHA-256 digest (hex) of the secret its first join answered.
    /// Every later event for the node must carry that secret ([`apply_guarded`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, String>,
    /// Restarts spent from the global budget (failures only; node loss and scale-up are free).
    pub restart_count: u32,
    /// Root cause of the last reported failure, as the agent sent it, with the stacks of the
    /// other nodes' ranks merged in as they arrive ([`Event::ReportStacks`]).
    pub last_root_cause: Option<RootCause>,
    /// The round that failure ended: stacks are taken for it only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_round: Option<u64>,
    /// Each distinct node fingerprint by digest ([`MAX_FINGERPRINTS`] at most).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fingerprints: BTreeMap<String, rlaunch::fingerprint::Fingerprint>,
    /// The digest of the first fingerprint the job saw: what `--fingerprint strict` requires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint_reference: Option<String>,
    /// How the last closed round's nodes differ ([`rlaunch::fingerprint::report`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fingerprint_diff: Vec<String>,
    /// Human reason of the last transition.
    pub last_reason: String,
    pub created_at: Millis,
    /// How many jobs ran under this run id before this one ([`Job::successor`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
    /// The job this one replaced under the same run id: its nodes are told it is over, never
    /// joined to this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub earlier: Option<Earlier>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What a job keeps of the job it replaced under the same run id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Earlier {
    /// Every node that job knew (members, nodes holding a key), at most [`MAX_NODES`].
    pub nodes: Vec<String>,
    /// How it ended (finished or failed).
    pub end: Phase,
}

/// The effect of one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub action: Action,
    /// Why, in words (logged, shown in status).
    pub reason: String,
}

/// Why a new round was opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoundCause {
    NodeLost {
        nodes: Vec<String>,
    },
    Failure {
        node_id: String,
    },
    ScaleUp {
        node_id: String,
    },
    MemberLeft {
        node_id: String,
    },
    /// A member of the running round joined again with new details (it stopped its workers on
    /// its own, e.g. fenced, and serves a new store): the round re-forms with it.
    MemberRejoined {
        node_id: String,
    },
}

/// What happened, for the edges (metrics, logs, wake-ups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Nothing changed (a stale or redundant event).
    Nothing,
    /// A heartbeat was recorded (no version bump: long-polls do not wake).
    HeartbeatRecorded,
    /// State changed without a round transition (a node joined a forming round, a success was
    /// noted, a node left a forming round, a last call started).
    Updated,
    /// The running round was torn down and round `round` opened.
    RoundOpened {
        round: u64,
        cause: RoundCause,
    },
    /// Round `round` closed with its members.
    RoundClosed {
        round: u64,
    },
    Finished,
    Failed,
    /// The event was refused; the job is untouched.
    Rejected(Rejection),
}

/// Why an event was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("invalid node: {message}")]
    InvalidNode { message: String },
    #[error("node `{node_id}` is unknown to this job (never joined, left, or declared lost): rejoin")]
    UnknownNode { node_id: String },
    #[error("node `{node_id}` is not a member of round {round}")]
    NotMember { node_id: String, round: u64 },
    #[error("the job has finished")]
    JobFinished,
    #[error("the job has failed: {reason}")]
    JobFailed { kind: FailureKind, reason: String },
    #[error("node `{node_id}` is held by another agent: calls for it must carry the secret its join answered")]
    Forbidden { node_id: String },
    #[error("{message}")]
    LimitReached { message: String },
    #[error("{message}")]
    FingerprintMismatch { message: String },
}

/// Something that happened to a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Join(NodeInfo),
    /// A sign of life, with the sender's count of heartbeats and the outcomes of the probes it
    /// was asked for.
    Heartbeat {
        node_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sent: Option<Sent>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        probes: Vec<ProbeReport>,
    },
    /// Time passed: check heartbeats, the last call and the join timeout.
    Tick,
    ReportFailure {
        node_id: String,
        round: u64,
        root_cause: Box<RootCause>,
    },
    NodeSucceeded {
        node_id: String,
        round: u64,
    },
    Leave {
        node_id: String,
    },
    /// Where a node's ranks stood when `round` ended by a failure elsewhere (report lines,
    /// [`rlaunch::stacks`]): merged into the last root cause.
    ReportStacks {
        node_id: String,
        round: u64,
        stacks: Vec<String>,
    },
}

/// One node as `status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node_id: String,
    pub group_rank: Option<u32>,
    pub local_world_size: u32,
    pub store_addr: HostPort,
    /// Milliseconds since last heard from; `None` when not tracked (lost, left, succeeded and gone).
    pub last_heartbeat_ago_ms: Option<u64>,
    pub succeeded: bool,
    /// The failure detector's view of the node.
    #[serde(default)]
    pub health: NodeHealth,
}

/// What the failure detector knows of a node, for operators.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeHealth {
    /// How late its heartbeats are now, as phi (suspected from 8 on).
    pub phi: Option<f64>,
    /// Share of its recent heartbeats that never arrived (from their sequence numbers).
    pub heartbeat_loss: Option<f64>,
    /// Milliseconds since it became suspected, while it is.
    pub suspected_for_ms: Option<u64>,
    /// The member that reached it in the current probe round, if one did.
    pub reached_by: Option<String>,
    /// Members that could not reach it in the current probe round.
    pub missed_by: Vec<String>,
    /// Probes of it that reached it / did not, over the job's life.
    pub probes_reached: u64,
    pub probes_missed: u64,
}

/// A job as `rlaunch status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub run_id: String,
    pub state: String,
    pub round: u64,
    pub members: Vec<NodeStatus>,
    pub pending: Vec<NodeStatus>,
    pub world_size: u32,
    pub restart_count: u32,
    pub max_restarts: u32,
    pub last_root_cause: Option<RootCause>,
    pub failure: Option<String>,
    pub last_reason: String,
    pub settings: JobSettings,
    /// How the running round's nodes differ in their fingerprints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fingerprint_diff: Vec<String>,
    /// The round whose failure `last_root_cause` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_round: Option<u64>,
    /// The rank the others wait for, as the heartbeats this service process served say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub straggler: Option<crate::stragglers::Straggler>,
}

impl Job {
    /// A job created by its first join; round 1 starts forming at `now`.
    pub fn new(settings: JobSettings, now: Millis) -> Self {
        Self {
            settings,
            phase: Phase::Waiting { since: now },
            round: 1,
            version: 0,
            members: Vec::new(),
            members_digest: String::new(),
            member_index: MemberIndex::default(),
            pending: Vec::new(),
            previous: Vec::new(),
            succeeded: Vec::new(),
            last_seen: BTreeMap::new(),
            health: BTreeMap::new(),
            suspects: Vec::new(),
            keys: BTreeMap::new(),
            restart_count: 0,
            last_root_cause: None,
            last_failure_round: None,
            fingerprints: BTreeMap::new(),
            fingerprint_reference: None,
            fingerprint_diff: Vec::new(),
            last_reason: "job created; round 1 forming".to_owned(),
            created_at: now,
            generation: 0,
            earlier: None,
        }
    }

    /// The job a join from `node_id` with `settings` starts under this job's run id, if this one
    /// is over and done with: finished, `node_id` is none of its nodes (nor of the jobs before
    /// it under this id), and none of its nodes was heard from within a node TTL (they left, or
    /// went quiet). A finished run id is thus free again about a TTL after the job's nodes stop
    /// (a Kubernetes Job deleted and created again), not only once the retention has passed. A
    /// failed one is not: an orchestrator that restarts failed pods (a Job's backoffLimit,
    /// `restartPolicy: OnFailure`, systemd's `Restart=`) starts agents with new node ids, which
    /// would start the job again with its restart count back at 0 (`--max-restarts` bypassed)
    /// and its root cause gone; they are refused with the failure until the retention passes.
    /// The new job remembers the nodes of every job before it ([`Earlier`]): one of them joining
    /// late is answered with its old job's end, so it never runs in the new job. Its version
    /// goes on from the old one's, so long-polls see the change.
    pub fn successor(&self, node_id: &str, settings: &JobSettings, now: Millis) -> Option<Job> {
        if !matches!(self.phase, Phase::Finished { .. }) {
            return None;
        }
        let ttl = Self::ttl_ms(&self.settings);
        let quiet = self.last_seen.values().all(|seen| now.saturating_sub(*seen) >= ttl);
        let known = self.members.iter().any(|m| m.node_id == node_id)
            || self.keys.contains_key(node_id)
            || self.last_seen.contains_key(node_id)
            || self.earlier.as_ref().is_some_and(|e| e.nodes.iter().any(|n| n == node_id));
        if !quiet || known {
            return None;
        }
        let mut nodes: Vec<String> = self
            .members
            .iter()
            .map(|m| m.node_id.clone())
            .chain(self.keys.keys().cloned())
            .chain(self.earlier.iter().flat_map(|e| e.nodes.iter().cloned()))
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes.truncate(MAX_NODES as usize);
        let mut next = Job::new(settings.clone(), now);
        next.version = self.version + 1;
        next.generation = self.generation + 1;
        next.earlier = Some(Earlier { nodes, end: self.phase.clone() });
        next.last_reason = format!(
            "job {} of this run id created by node {node_id}; the one before was {} and its nodes quiet",
            next.generation + 1,
            self.phase.name()
        );
        Some(next)
    }

    fn ttl_ms(settings: &JobSettings) -> Millis {
        JobSettings::ms(settings.node_ttl)
    }

    /// Whether the job still counts on `node_id`: a member, pending, or expected back.
    pub fn tracks(&self, node_id: &str) -> bool {
        (matches!(self.phase, Phase::Running { .. }) && self.is_member(node_id))
            || self.is_pending(node_id)
            || self.previous.iter().any(|p| p == node_id)
    }

    pub fn is_member(&self, node_id: &str) -> bool {
        self.member(node_id).is_some()
    }

    /// The member `node_id` of the last closed round, through the index.
    pub fn member(&self, node_id: &str) -> Option<&Member> {
        let index = self
            .member_index
            .0
            .get_or_init(|| self.members.iter().enumerate().map(|(i, m)| (m.node_id.clone(), i)).collect());
        match index.get(node_id).and_then(|i| self.members.get(*i)) {
            Some(m) if m.node_id == node_id => Some(m),
            // Members changed since the index was built (only ever in tests that edit them).
            _ => self.members.iter().find(|m| m.node_id == node_id),
        }
    }

    /// The waiting node a running round below MAX is torn down for: the first (in join order)
    /// that joined at least [`SCALE_UP_TTLS`] node TTLs ago and is still heard from within the
    /// TTL and not suspected. A join that is never followed by heartbeats (a node that died at
    /// once, or joins sent to disturb the job) lapses before that and is dropped without
    /// disturbing the running round. On etcd a node's alive key outlives its last heartbeat by
    /// at most a TTL, so two TTLs prove heartbeats there too.
    pub fn scale_up_candidate(&self, now: Millis) -> Option<String> {
        if !matches!(self.phase, Phase::Running { .. }) || self.members.len() >= self.settings.max_nodes as usize {
            return None;
        }
        let ttl = JobSettings::ms(self.settings.node_ttl);
        let proven = ttl.saturating_mul(u64::from(SCALE_UP_TTLS));
        self.pending
            .iter()
            .filter(|p| now.saturating_sub(p.joined_at) >= proven)
            .filter(|p| self.last_seen.get(&p.node.node_id).is_some_and(|seen| now.saturating_sub(*seen) < ttl))
            .find(|p| self.health.get(&p.node.node_id).is_none_or(|h| h.suspicion.is_none()))
            .map(|p| p.node.node_id.clone())
    }

    /// The global ranks `node_id` runs in the running round; `None` when it runs none.
    pub fn ranks_of(&self, node_id: &str) -> Option<std::ops::Range<u32>> {
        matches!(self.phase, Phase::Running { .. }).then(|| self.member(node_id).map(Member::ranks)).flatten()
    }

    fn is_pending(&self, node_id: &str) -> bool {
        self.pending.iter().any(|p| p.node.node_id == node_id)
    }

    /// Ranks in the round; the bounds on nodes and workers per node keep it within `u32`.
    pub fn world_size(&self) -> u32 {
        self.members.iter().fold(0u32, |sum, m| sum.saturating_add(m.local_world_size))
    }

    /// The round this node runs in, if the job is running a round that includes it, with the
    /// whole member list.
    pub fn round_info(&self, node_id: &str) -> Option<RoundInfo> {
        self.placement(node_id, true)
    }

    /// [`Job::round_info`] with the member list only when asked.
    pub fn placement(&self, node_id: &str, with_members: bool) -> Option<RoundInfo> {
        if !matches!(self.phase, Phase::Running { .. }) {
            return None;
        }
        let me = self.member(node_id)?;
        Some(RoundInfo {
            round: self.round,
            group_rank: me.group_rank,
            group_world_size: u32::try_from(self.members.len()).unwrap_or(u32::MAX),
            members: if with_members { self.members.clone() } else { Vec::new() },
            members_digest: self.members_digest.clone(),
            master_store_addr: self
                .members
                .first()
                .map(|m| m.store_addr.clone())
                .unwrap_or_else(|| me.store_addr.clone()),
            restart_count: self.restart_count,
            max_restarts: self.settings.max_restarts,
            world_size: self.world_size(),
            rank_offset: me.rank_offset,
            local_world_size: me.local_world_size,
            hang_timeout: self.settings.hang_timeout,
            fingerprint_diff: self.fingerprint_diff.clone(),
        })
    }

    /// The job as an operator sees it.
    pub fn status(&self, run_id: &str, now: Millis) -> JobStatus {
        let ago = |id: &str| self.last_seen.get(id).map(|t| now.saturating_sub(*t));
        JobStatus {
            run_id: run_id.to_owned(),
            state: self.phase.name().to_owned(),
            round: self.round,
            members: self
                .members
                .iter()
                .map(|m| NodeStatus {
                    node_id: m.node_id.clone(),
                    group_rank: Some(m.group_rank),
                    local_world_size: m.local_world_size,
                    store_addr: m.store_addr.clone(),
                    last_heartbeat_ago_ms: ago(&m.node_id),
                    succeeded: self.succeeded.contains(&m.node_id),
                    health: self.node_health(&m.node_id, now),
                })
                .collect(),
            pending: self
                .pending
                .iter()
                .map(|p| NodeStatus {
                    node_id: p.node.node_id.clone(),
                    group_rank: None,
                    local_world_size: p.node.local_world_size,
                    store_addr: p.node.store_addr.clone(),
                    last_heartbeat_ago_ms: ago(&p.node.node_id),
                    succeeded: false,
                    health: self.node_health(&p.node.node_id, now),
                })
                .collect(),
            world_size: self.world_size(),
            restart_count: self.restart_count,
            max_restarts: self.settings.max_restarts,
            last_root_cause: self.last_root_cause.clone(),
            fingerprint_diff: self.fingerprint_diff.clone(),
            last_failure_round: self.last_failure_round,
            straggler: None,
            failure: match &self.phase {
                Phase::Failed { reason, .. } => Some(reason.clone()),
                _ => None,
            },
            last_reason: self.last_reason.clone(),
            settings: self.settings.clone(),
        }
    }

    fn rejection_if_terminal(&self) -> Option<Rejection> {
        match &self.phase {
            Phase::Finished { .. } => Some(Rejection::JobFinished),
            Phase::Failed { kind, reason, .. } => Some(Rejection::JobFailed { kind: *kind, reason: reason.clone() }),
            _ => None,
        }
    }

    /// The failure detector's view of `node_id` for status.
    pub fn node_health(&self, node_id: &str, now: Millis) -> NodeHealth {
        let t = self.settings.timing();
        let Some(h) = self.health.get(node_id) else { return NodeHealth::default() };
        let s = h.suspicion.as_ref();
        NodeHealth {
            phi: self.last_seen.get(node_id).map(|last| h.phi(*last, now, &t).min(1e6)),
            heartbeat_loss: h.loss_rate(),
            suspected_for_ms: s.map(|s| now.saturating_sub(s.since)),
            reached_by: s.and_then(|s| s.reached_by.clone()),
            missed_by: s.map(|s| s.missed_by.clone()).unwrap_or_default(),
            probes_reached: h.probes_reached,
            probes_missed: h.probes_missed,
        }
    }

    /// Whether the failure detector holds `node_id` lost at `now`. A node that succeeded may go
    /// quiet: it is only forgotten after a TTL, never probed.
    fn lapsed(&self, node_id: &str, now: Millis) -> bool {
        let last = self.last_seen.get(node_id).copied();
        if self.succeeded.iter().any(|s| s == node_id) {
            let ttl = JobSettings::ms(self.settings.node_ttl);
            return last.is_none_or(|seen| now.saturating_sub(seen) >= ttl);
        }
        let t = self.settings.timing();
        match self.health.get(node_id) {
            Some(h) => h.verdict(last, now, &t) == Verdict::Lost,
            // Not yet seen by a tick: suspected at most, never lost without probes.
            None => false,
        }
    }

    /// Nodes the detector watches: members of the running round still at work, pending nodes,
    /// and survivors of the previous round on their way back.
    pub fn watched(&self) -> Vec<&str> {
        let running = matches!(self.phase, Phase::Running { .. });
        let succeeded: HashSet<&str> = self.succeeded.iter().map(String::as_str).collect();
        let mut ids: Vec<&str> = self
            .members
            .iter()
            .map(|m| m.node_id.as_str())
            .filter(|id| running && !succeeded.contains(id))
            .chain(self.pending.iter().map(|p| p.node.node_id.as_str()))
            .chain(self.previous.iter().map(String::as_str))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Nodes that may probe others now: watched, not suspected, heard from within the TTL;
    /// sorted, so the choice below is the same on every replica.
    fn prober_candidates(&self, now: Millis) -> Vec<&str> {
        let ttl = JobSettings::ms(self.settings.node_ttl);
        self.watched()
            .into_iter()
            .filter(|id| self.health.get(*id).is_none_or(|h| h.suspicion.is_none()))
            .filter(|id| self.last_seen.get(*id).is_some_and(|seen| now.saturating_sub(*seen) < ttl))
            .collect()
    }

    /// Who probes `target`: up to [`detector::PROBERS`] of `candidates` other than it, starting
    /// at a place that depends on the target (and the probe round), so that many suspects at
    /// once spread their probes over the job rather than all landing on the same three nodes.
    fn probers(candidates: &[&str], target: &str, round: u32) -> Vec<String> {
        let others: Vec<&str> = candidates.iter().copied().filter(|id| *id != target).collect();
        if others.is_empty() {
            return Vec::new();
        }
        // FNV-1a: stable across processes and versions (the etcd replicas must agree).
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in target.bytes().chain(round.to_le_bytes()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        let start = (h % others.len() as u64) as usize;
        others.iter().cycle().skip(start).take(detector::PROBERS.min(others.len())).map(|id| (*id).to_owned()).collect()
    }

    /// Where `node_id`'s agent answers probes: its probe endpoint, else its store (the one it
    /// joined with last: a pending node's newer details first).
    fn addr_of(&self, node_id: &str) -> Option<&HostPort> {
        self.pending
            .iter()
            .find(|p| p.node.node_id == node_id)
            .map(|p| p.node.probe_addr.as_ref().unwrap_or(&p.node.store_addr))
            .or_else(|| {
                let m = self.members.iter().find(|m| m.node_id == node_id)?;
                Some(m.probe_addr.as_ref().unwrap_or(&m.store_addr))
            })
    }

    /// The probes `prober` owes: every suspected node whose probe round asked it.
    pub fn probes_for(&self, prober: &str) -> Vec<ProbeRequest> {
        self.suspects
            .iter()
            .filter(|id| self.health.get(*id).is_some_and(|h| h.asks(prober)))
            .filter_map(|id| Some(ProbeRequest { node_id: id.clone(), addr: self.addr_of(id)?.clone() }))
            .collect()
    }

    /// Starts suspicions that are due and the next probe round of those some member reached;
    /// returns what changed, in words.
    fn update_suspicions(&mut self, now: Millis) -> Vec<String> {
        let t = self.settings.timing();
        let mut notes = Vec::new();
        // Only the few nodes due for a (new) probe round are copied out of the job.
        let due: Vec<(String, bool)> = self
            .watched()
            .into_iter()
            .filter_map(|id| {
                let last = self.last_seen.get(id).copied();
                let (due, start) = match self.health.get(id) {
                    None => (Health::default().suspect_due(last, now, &t), true),
                    Some(h) => match &h.suspicion {
                        None => (h.suspect_due(last, now, &t), true),
                        Some(s) => (now >= s.deadline && h.verdict(last, now, &t) == Verdict::Suspected, false),
                    },
                };
                due.then(|| (id.to_owned(), start))
            })
            .collect();
        let candidates: Vec<String> = if due.is_empty() {
            Vec::new()
        } else {
            self.prober_candidates(now).into_iter().map(str::to_owned).collect()
        };
        let candidates: Vec<&str> = candidates.iter().map(String::as_str).collect();
        for (id, start) in due {
            let last = self.last_seen.get(&id).copied();
            let round = self.health.get(&id).and_then(|h| h.suspicion.as_ref()).map_or(0, |s| s.rounds);
            let probers = Self::probers(&candidates, &id, round);
            let asked = if probers.is_empty() {
                "nobody to probe it".to_owned()
            } else {
                format!("probed by {}", probers.join(", "))
            };
            let h = self.health.entry(id.clone()).or_default();
            if start {
                let silence = last.map_or_else(
                    || "never heard from".to_owned(),
                    |l| format!("silent for {} ms", now.saturating_sub(l)),
                );
                let phi = last
                    .filter(|_| h.arrivals.len() >= detector::MIN_ARRIVALS)
                    .map(|l| h.phi(l, now, &t))
                    .filter(|p| *p < 1e6)
                    .map(|p| format!(", phi {p:.1}"))
                    .unwrap_or_default();
                let loss = h.loss_rate().map(|l| format!(", heartbeat loss {:.0}%", l * 100.0)).unwrap_or_default();
                notes.push(format!("node {id} suspected ({silence}{phi}{loss}); {asked}"));
            } else {
                let by = h.suspicion.as_ref().and_then(|s| s.reached_by.clone()).unwrap_or_default();
                notes.push(format!("suspected node {id} answered a probe by {by}: kept, {asked} again"));
            }
            h.suspect(probers, now, &t);
        }
        self.suspects = self.health.iter().filter(|(_, h)| h.suspicion.is_some()).map(|(id, _)| id.clone()).collect();
        notes
    }

    /// Why `node_id` is lost, in words.
    fn loss_detail(&self, node_id: &str, now: Millis) -> String {
        let silence = self
            .last_seen
            .get(node_id)
            .map_or_else(|| "never heard from".to_owned(), |l| format!("silent for {} ms", now.saturating_sub(*l)));
        match self.health.get(node_id).and_then(|h| h.suspicion.as_ref()) {
            Some(s) if s.reached_by.is_some() => format!("{node_id} ({silence}, past the silence limit)"),
            Some(s) if !s.missed_by.is_empty() => {
                format!("{node_id} ({silence}; not reached by {})", s.missed_by.join(", "))
            }
            _ => format!("{node_id} ({silence}; no member reached it)"),
        }
    }

    /// Forgets heartbeats of nodes the job no longer tracks.
    fn prune_last_seen(&mut self) {
        let keep: HashSet<&str> = self
            .members
            .iter()
            .map(|m| m.node_id.as_str())
            .chain(self.pending.iter().map(|p| p.node.node_id.as_str()))
            .chain(self.previous.iter().map(String::as_str))
            .collect();
        if self.last_seen.keys().all(|id| keep.contains(id.as_str()))
            && self.health.keys().all(|id| keep.contains(id.as_str()))
        {
            self.prune_keys();
            return;
        }
        let keep: HashSet<String> = keep.into_iter().map(str::to_owned).collect();
        self.last_seen.retain(|id, _| keep.contains(id));
        self.health.retain(|id, _| keep.contains(id));
        self.prune_keys();
    }

    /// A node the job no longer counts on gives up its id (and key): a new agent may take it.
    /// Members of a round torn down count only while expected back (`previous`).
    fn prune_keys(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let forming = self.phase.is_forming();
        let keep: HashSet<&str> = self
            .members
            .iter()
            .filter(|_| !forming)
            .map(|m| m.node_id.as_str())
            .chain(self.pending.iter().map(|p| p.node.node_id.as_str()))
            .chain(self.previous.iter().map(String::as_str))
            .collect();
        if self.keys.keys().any(|id| !keep.contains(id.as_str())) {
            let keep: HashSet<String> = keep.into_iter().map(str::to_owned).collect();
            self.keys.retain(|id, _| keep.contains(id));
        }
    }

    /// Forgets the detector's view of nodes it no longer watches (a survivor dropped from a
    /// forming round stays in the old round's members until the next closes).
    fn prune_health(&mut self) {
        let watched: HashSet<String> = self.watched().into_iter().map(str::to_owned).collect();
        let succeeded: HashSet<&String> = self.succeeded.iter().collect();
        self.health.retain(|id, _| watched.contains(id) || succeeded.contains(id));
        self.suspects.retain(|id| watched.contains(id));
    }
}

/// Applies one event to a job at time `now`. Pure: the same inputs give the same outputs.
/// A rejected event returns the job unchanged.
pub fn apply(job: &Job, ev: Event, now: Millis) -> (Job, Decision) {
    let mut next = job.clone();
    let decision = apply_in_place(&mut next, ev, now);
    if matches!(decision.action, Action::Rejected(_)) {
        return (job.clone(), decision);
    }
    (next, decision)
}

/// [`apply`] without the copy, for stores that hold the job themselves (a heartbeat should not
/// clone a thousand-node job). Every rejection is decided before anything is touched, so a
/// rejected event leaves `job` as it was (the unit tests check both forms agree on every step).
pub fn apply_in_place(job: &mut Job, ev: Event, now: Millis) -> Decision {
    let version = job.version;
    let next = job;
    let ticked = matches!(ev, Event::Tick);
    // Stacks arriving change no round and say nothing of the job's last transition.
    let keeps_reason = matches!(ev, Event::ReportStacks { .. });
    let decision = match ev {
        Event::Join(node) => join(next, node, now),
        Event::Heartbeat { node_id, sent, probes } => heartbeat(next, &node_id, sent, &probes, now),
        Event::Tick => tick(next, now),
        Event::ReportFailure { node_id, round, root_cause } => report_failure(next, &node_id, round, *root_cause, now),
        Event::NodeSucceeded { node_id, round } => node_succeeded(next, &node_id, round, now),
        Event::Leave { node_id } => leave(next, &node_id, now),
        Event::ReportStacks { node_id, round, stacks } => report_stacks(next, &node_id, round, &stacks),
    };
    if ticked && !next.phase.is_terminal() {
        next.prune_health();
    }
    match decision.action {
        Action::Rejected(_) | Action::Nothing | Action::HeartbeatRecorded => {}
        Action::Updated if keeps_reason => {}
        Action::Updated => next.last_reason = decision.reason.clone(),
        Action::RoundOpened { .. } | Action::RoundClosed { .. } | Action::Finished | Action::Failed => {
            next.version = version + 1;
            next.last_reason = decision.reason.clone();
        }
    }
    decision
}

/// What the service checks before an event for a node takes effect, decided atomically with
/// the event (the same store update).
#[derive(Clone, Default)]
pub struct Guard {
    /// The secret the caller presents for the event's node.
    pub secret: Option<String>,
    /// For a join: the secret the node gets if the job holds no key for it (minted at the edge,
    /// since the machine draws no random numbers).
    pub minted: Option<String>,
    /// Most nodes that may wait to join (forming round and standbys); `None`: [`MAX_NODES`].
    pub max_pending: Option<usize>,
}

/// Secrets are never printed (logs, panics).
impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redacted = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("Guard")
            .field("secret", &redacted(&self.secret))
            .field("minted", &redacted(&self.minted))
            .field("max_pending", &self.max_pending)
            .finish()
    }
}

impl Event {
    /// The node an event speaks for (`None` for a tick).
    pub fn node_id(&self) -> Option<&str> {
        match self {
            Event::Join(n) => Some(&n.node_id),
            Event::Heartbeat { node_id, .. }
            | Event::ReportFailure { node_id, .. }
            | Event::NodeSucceeded { node_id, .. }
            | Event::ReportStacks { node_id, .. }
            | Event::Leave { node_id } => Some(node_id),
            Event::Tick => None,
        }
    }
}

/// Whether a caller presenting `secret` may speak for `node_id`: always when the job holds no
/// key for it (a new node; a node the job forgot), else only with the secret of that key.
pub fn authorize(job: &Job, node_id: &str, secret: Option<&str>) -> Result<(), Rejection> {
    match job.keys.get(node_id) {
        None => Ok(()),
        Some(key) if secret.is_some_and(|s| crate::identity::matches(key, s)) => Ok(()),
        Some(_) => Err(Rejection::Forbidden { node_id: node_id.to_owned() }),
    }
}

/// [`apply_in_place`] behind the service's checks: the caller must hold the node's secret, a
/// new node takes `guard.minted` as its key, and a join beyond the bound on waiting nodes is
/// refused. Every refusal leaves `job` untouched.
pub fn apply_guarded(job: &mut Job, ev: Event, guard: &Guard, now: Millis) -> Decision {
    let new_node = match ev.node_id() {
        Some(id) => {
            // A join whose minted secret the job already took is its own retry (an update
            // applied twice after an answer was lost).
            let own_retry = matches!(ev, Event::Join(_))
                && guard
                    .minted
                    .as_deref()
                    .zip(job.keys.get(id))
                    .is_some_and(|(m, key)| crate::identity::matches(key, m));
            if let Err(r) =
                authorize(job, id, guard.secret.as_deref()).or_else(|r| if own_retry { Ok(()) } else { Err(r) })
            {
                return reject(r);
            }
            (matches!(ev, Event::Join(_)) && !job.keys.contains_key(id)).then(|| id.to_owned())
        }
        None => None,
    };
    if let (Event::Join(n), Some(max)) = (&ev, guard.max_pending) {
        let id = n.node_id.as_str();
        if !job.is_pending(id) && !job.is_member(id) && job.pending.len() >= max && !job.phase.is_terminal() {
            return reject(Rejection::LimitReached {
                message: format!(
                    "job has {} nodes waiting to join: the service's bound on nodes per job \
                     (rlaunch-rendezvous --max-nodes {max})",
                    job.pending.len()
                ),
            });
        }
    }
    let d = apply_in_place(job, ev, now);
    if let (Some(id), Some(minted)) = (new_node, guard.minted.as_deref()) {
        if !matches!(d.action, Action::Rejected(_)) && (job.is_pending(&id) || job.is_member(&id)) {
            job.keys.insert(id, crate::identity::digest(minted));
        }
    }
    d
}

/// [`apply_guarded`] for a call that brings the node's settings (a join): the job first takes
/// what it adopts from them ([`JobSettings::adopt`]), so a node asking for `--fingerprint strict`
/// is itself held to it; a rejected event leaves the settings as they were.
pub fn apply_joining(job: &mut Job, settings: Option<&JobSettings>, ev: Event, guard: &Guard, now: Millis) -> Decision {
    let Some(settings) = settings else { return apply_guarded(job, ev, guard, now) };
    let before = job.settings.clone();
    job.settings.adopt(settings);
    let d = apply_guarded(job, ev, guard, now);
    if matches!(d.action, Action::Rejected(_)) {
        job.settings = before;
    }
    d
}

/// The secret `node_id` holds after a guarded join: the minted one if the job took it, else the
/// one the caller presented.
pub fn secret_after_join(job: &Job, node_id: &str, guard: &Guard) -> Option<String> {
    let key = job.keys.get(node_id)?;
    [guard.minted.as_ref(), guard.secret.as_ref()]
        .into_iter()
        .flatten()
        .find(|s| crate::identity::matches(key, s))
        .cloned()
}

fn decide(action: Action, reason: impl Into<String>) -> Decision {
    Decision { action, reason: reason.into() }
}

fn reject(r: Rejection) -> Decision {
    let reason = r.to_string();
    decide(Action::Rejected(r), reason)
}

/// Checks a node's details (id, workers) before anything is recorded for it.
pub fn validate_node(node: &NodeInfo) -> Result<(), Rejection> {
    let invalid = |message: &str| Err(Rejection::InvalidNode { message: message.to_owned() });
    if node.node_id.is_empty() || node.node_id.len() > 256 {
        return invalid("node_id must be 1 to 256 characters");
    }
    if node.node_id.chars().any(|c| c.is_control() || c == '/') {
        return invalid("node_id must not contain '/' or control characters");
    }
    if node.local_world_size == 0 || node.local_world_size > MAX_LOCAL_WORLD_SIZE {
        return invalid(&format!("local_world_size must be 1 to {MAX_LOCAL_WORLD_SIZE}"));
    }
    if let Some(fp) = &node.fingerprint {
        fp.check().map_err(|m| Rejection::InvalidNode { message: m })?;
    }
    Ok(())
}

/// Whether a node joining from `peer` (the TCP peer address of its join) may advertise the
/// addresses it does: other members connect to its store and send probes to its probe address,
/// so a node may name only itself. Every advertised host must be `peer`'s IP address (an IPv4
/// address also in its IPv6-mapped form), or a host name that `resolved` (what the service's
/// resolver answered for each name, looked up by the caller) maps to it: the name the other
/// members will resolve. A join from loopback is not checked: an agent on the service's own
/// host (a single-host job, `--standalone`), or a proxy on that host, in front of the service,
/// which hides every peer. Behind NAT or a proxy elsewhere the service is started with
/// `--trust-advertised-addrs`, and this check is skipped.
pub fn check_advertised(
    node: &NodeInfo,
    peer: std::net::IpAddr,
    resolved: &BTreeMap<String, Vec<std::net::IpAddr>>,
) -> Result<(), Rejection> {
    let canonical = canonical_ip;
    let peer = canonical(peer);
    if peer.is_loopback() {
        return Ok(());
    }
    for (what, addr) in advertised(node) {
        let ok = match addr.host().parse::<std::net::IpAddr>() {
            Ok(ip) => canonical(ip) == peer,
            Err(_) => resolved.get(addr.host()).is_some_and(|ips| ips.iter().any(|&ip| canonical(ip) == peer)),
        };
        if !ok {
            return Err(Rejection::InvalidNode {
                message: format!(
                    "{what} `{addr}` is not the address this join came from ({peer}): a node may advertise only \
                     its own address (rlaunch --local-addr {peer}, or a host name that resolves to it); behind \
                     NAT or a proxy, start rlaunch-rendezvous with --trust-advertised-addrs"
                ),
            });
        }
    }
    Ok(())
}

/// An IPv4 address given in its IPv6-mapped form (`::ffff:a.b.c.d`) as the IPv4 address.
pub fn canonical_ip(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// Replaces each host name `node` advertises (checked by [`check_advertised`] to resolve to
/// `peer`) with `peer`'s address, so what the others reach is what was checked.
pub fn pin_advertised_names(node: &mut NodeInfo, peer: std::net::IpAddr) {
    let ip = canonical_ip(peer).to_string();
    let pin = |addr: &mut HostPort| {
        if addr.host().parse::<std::net::IpAddr>().is_err() {
            if let Ok(pinned) = HostPort::new(ip.clone(), addr.port()) {
                *addr = pinned;
            }
        }
    };
    pin(&mut node.store_addr);
    if let Some(probe) = node.probe_addr.as_mut() {
        pin(probe);
    }
}

/// The addresses a node asks others to reach it at, named by their field.
pub fn advertised(node: &NodeInfo) -> impl Iterator<Item = (&'static str, &HostPort)> {
    [("store_addr", Some(&node.store_addr)), ("probe_addr", node.probe_addr.as_ref())]
        .into_iter()
        .filter_map(|(what, addr)| Some((what, addr?)))
}

/// Most distinct fingerprints a job keeps; a node with yet another is reported without its
/// entries. With [`MAX_FINGERPRINT_BYTES`], a job's fingerprints stay within 32 kB (a node may
/// send 128 entries of 1 kB: 147 kB, which 32 of, in every job, took the service's memory
/// and etcd's history to hundreds of megabytes).
pub const MAX_FINGERPRINTS: usize = 8;
/// Most bytes (keys and values) of the copy of a node's fingerprint a job keeps
/// ([`fingerprint_summary`]); the digest is of the whole.
pub const MAX_FINGERPRINT_BYTES: usize = 4096;
/// Longest value a kept fingerprint holds whole; a longer one keeps its start and a digest.
const FINGERPRINT_VALUE: usize = 96;
/// The key of the kept fingerprint's entry that stands for the entries past its bound.
pub const FINGERPRINT_MORE: &str = "…";

/// A fingerprint's digest: SHA-256 of its JSON (keys in order), hex, the first 16 characters.
pub fn fingerprint_digest(fp: &rlaunch::fingerprint::Fingerprint) -> String {
    let json = serde_json::to_string(fp).unwrap_or_default();
    crate::identity::digest(&json)[..16].to_owned()
}

/// The copy of `fp` a job keeps: at most [`MAX_FINGERPRINT_BYTES`], and different wherever `fp`
/// is. A long key or value keeps its first 64 characters and a digest of all of it; past the
/// bound, the remaining entries (in key order) become one [`FINGERPRINT_MORE`] entry with their
/// count and digest.
pub fn fingerprint_summary(fp: &rlaunch::fingerprint::Fingerprint) -> rlaunch::fingerprint::Fingerprint {
    let digest = |parts: &[&str]| crate::identity::digest(&parts.join("\0"))[..12].to_owned();
    let short = |s: &str, keep: usize| {
        if s.len() <= keep {
            s.to_owned()
        } else {
            let start: String = s.chars().take(64).collect();
            format!("{start}… (sha256 {})", digest(&[s]))
        }
    };
    // Room for the entry that says what was left out.
    let budget = MAX_FINGERPRINT_BYTES - 64;
    let entries: Vec<(&String, &String)> = fp.0.iter().collect();
    let mut out = BTreeMap::new();
    let mut used = 0usize;
    for (i, (k, v)) in entries.iter().enumerate() {
        let (k, v) = (short(k, 64), short(v, FINGERPRINT_VALUE));
        if used + k.len() + v.len() > budget {
            let rest = &entries[i..];
            let all: Vec<&str> = rest.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()]).collect();
            out.insert(FINGERPRINT_MORE.to_owned(), format!("{} more entries (sha256 {})", rest.len(), digest(&all)));
            break;
        }
        used += k.len() + v.len();
        out.insert(k, v);
    }
    rlaunch::fingerprint::Fingerprint(out)
}

fn join(job: &mut Job, mut node: NodeInfo, now: Millis) -> Decision {
    if let Err(r) = validate_node(&node) {
        return reject(r);
    }
    // A node of the job this one replaced learns that job's end.
    if let Some(earlier) = job.earlier.as_ref().filter(|e| e.nodes.contains(&node.node_id)) {
        return reject(match &earlier.end {
            Phase::Failed { kind, reason, .. } => Rejection::JobFailed { kind: *kind, reason: reason.clone() },
            _ => Rejection::JobFinished,
        });
    }
    if let Some(r) = job.rejection_if_terminal() {
        return reject(r);
    }
    // The job keeps each distinct fingerprint once, bounded; the node's pending entry keeps
    // the digest of the whole.
    let fingerprint = node.fingerprint.take().map(|fp| (fingerprint_digest(&fp), fingerprint_summary(&fp)));
    let strict = job.settings.fingerprint == Some(rlaunch::fingerprint::Policy::Strict);
    if strict && fingerprint.is_none() {
        return reject(Rejection::FingerprintMismatch {
            message: format!("--fingerprint strict: node {} sent no fingerprint (an older agent?)", node.node_id),
        });
    }
    if let (true, Some((digest, fp)), Some(reference)) = (strict, &fingerprint, &job.fingerprint_reference) {
        if digest != reference {
            let what = match job.fingerprints.get(reference) {
                Some(r) => fp.differences(r).join("; "),
                None => "its fingerprint is not the job's".to_owned(),
            };
            return reject(Rejection::FingerprintMismatch {
                message: format!(
                    "--fingerprint strict: node {} differs from the job's first node: {}",
                    node.node_id,
                    rlaunch::contract::cut_end(&what, 2048)
                ),
            });
        }
    }
    let fingerprint_digest = fingerprint.map(|(digest, fp)| {
        job.fingerprint_reference.get_or_insert_with(|| digest.clone());
        if !job.fingerprints.contains_key(&digest) && job.fingerprints.len() < MAX_FINGERPRINTS {
            job.fingerprints.insert(digest.clone(), fp);
        }
        digest
    });
    let id = node.node_id.clone();
    job.last_seen.insert(id.clone(), now);
    job.health.entry(id.clone()).or_default().arrived(None, now);
    if matches!(job.phase, Phase::Running { .. }) && job.is_member(&id) {
        let same = job
            .members
            .iter()
            .any(|m| m.node_id == id && m.store_addr == node.store_addr && m.local_world_size == node.local_world_size);
        if same {
            // Retried or failed-over join: idempotent.
            return decide(Action::Nothing, format!("node {id} is already a member of running round {}", job.round));
        }
        // The member stopped its workers by itself and comes back with a new store: the others'
        // workers point at its old one, so the round must re-form (it keeps its place).
        let round = job.round;
        job.pending.push(Pending { node, joined_at: now, fingerprint_digest });
        let reason = format!("member {id} of running round {round} joined again with new details");
        return open_round(job, now, RoundCause::MemberRejoined { node_id: id }, &[], reason);
    }
    let (newly, changed_info) = match job.pending.iter_mut().find(|p| p.node.node_id == id) {
        Some(p) => {
            let changed = p.node != node || p.fingerprint_digest != fingerprint_digest;
            p.node = node;
            p.fingerprint_digest = fingerprint_digest;
            if !changed && !job.phase.is_forming() {
                return decide(Action::Nothing, format!("node {id} is already waiting"));
            }
            (false, changed)
        }
        None => {
            job.pending.push(Pending { node, joined_at: now, fingerprint_digest });
            (true, false)
        }
    };
    if matches!(job.phase, Phase::Running { .. }) {
        let max = job.settings.max_nodes as usize;
        if job.members.len() < max {
            // A join alone costs nothing to send: the running round is torn down only for a node
            // that keeps heartbeating ([`Job::scale_up_candidate`], at a tick).
            let reason = format!(
                "node {id} waits to join running round {} with {} of at most {max} nodes: scale-up once it \
                 has heartbeated for {:?}",
                job.round,
                job.members.len(),
                job.settings.node_ttl.saturating_mul(SCALE_UP_TTLS)
            );
            return decide(Action::Updated, reason);
        }
        return decide(
            Action::Updated,
            format!("node {id} waits as a standby: round {} runs at MAX ({max}) nodes", job.round),
        );
    }
    // A repeated join (long-poll retry) must not bump the version, or every waiter would wake
    // every other waiter forever.
    let base = if newly {
        format!("node {id} joined forming round {}", job.round)
    } else if changed_info {
        format!("node {id} rejoined forming round {} with new details", job.round)
    } else {
        String::new()
    };
    evaluate_forming(job, now, base)
}

fn heartbeat(job: &mut Job, node_id: &str, sent: Option<Sent>, probes: &[ProbeReport], now: Millis) -> Decision {
    if let Some(r) = job.rejection_if_terminal() {
        return reject(r);
    }
    let Some(seen) = job.last_seen.get_mut(node_id) else {
        return reject(Rejection::UnknownNode { node_id: node_id.to_owned() });
    };
    *seen = (*seen).max(now);
    job.health.entry(node_id.to_owned()).or_default().arrived(sent, now);
    let mut notes = Vec::new();
    for p in probes {
        if p.node_id == node_id {
            continue;
        }
        if job.health.get_mut(&p.node_id).is_some_and(|h| h.probed(node_id, p.reached)) {
            let how = if p.reached { "reached" } else { "could not reach" };
            notes.push(format!("{node_id} {how} suspected node {}", p.node_id));
        }
    }
    if notes.is_empty() {
        decide(Action::HeartbeatRecorded, format!("heartbeat from {node_id}"))
    } else {
        decide(Action::Updated, format!("probe: {}", notes.join("; ")))
    }
}

fn tick(job: &mut Job, now: Millis) -> Decision {
    if job.phase.is_terminal() {
        return decide(Action::Nothing, "job is over");
    }
    let suspects_before = job.suspects.clone();
    let mut suspicions = job.update_suspicions(now);
    let now_suspected: HashSet<&String> = job.suspects.iter().collect();
    let cleared: Vec<&str> = suspects_before
        .iter()
        .filter(|id| !now_suspected.contains(id) && job.health.contains_key(*id))
        .map(String::as_str)
        .collect();
    if !cleared.is_empty() {
        suspicions.push(format!("node(s) {} heard from again: no longer suspected", cleared.join(", ")));
    }
    let before = (job.pending.len(), job.previous.len());
    let mut dropped: Vec<String> = job
        .pending
        .iter()
        .map(|p| p.node.node_id.clone())
        .chain(job.previous.iter().cloned())
        .filter(|id| job.lapsed(id, now))
        .collect();
    dropped.sort();
    dropped.dedup();
    let mut notes = suspicions;
    if !dropped.is_empty() {
        let details: Vec<String> = dropped.iter().map(|id| job.loss_detail(id, now)).collect();
        notes.push(format!("node(s) {} lost and dropped", details.join(", ")));
    }
    job.pending.retain(|p| !dropped.contains(&p.node.node_id));
    job.previous.retain(|id| !dropped.contains(id));
    let note = notes.join("; ");

    match job.phase {
        Phase::Running { .. } => {
            let lost: Vec<String> = job
                .members
                .iter()
                .map(|m| m.node_id.clone())
                .filter(|id| !job.succeeded.contains(id) && job.lapsed(id, now))
                .collect();
            if !lost.is_empty() {
                let details: Vec<String> = lost.iter().map(|id| job.loss_detail(id, now)).collect();
                let prefix = if note.is_empty() { String::new() } else { format!("{note}; ") };
                let reason = format!("{prefix}node(s) {} of round {} lost: node loss", details.join(", "), job.round);
                return open_round(job, now, RoundCause::NodeLost { nodes: lost.clone() }, &lost, reason);
            }
            // Succeeded members may go quiet; forget them without disturbing the round.
            let quiet: Vec<String> = job.succeeded.iter().filter(|id| job.lapsed(id, now)).cloned().collect();
            for id in &quiet {
                job.last_seen.remove(id);
                job.health.remove(id);
            }
            job.prune_last_seen();
            if let Some(id) = job.scale_up_candidate(now) {
                let prefix = if note.is_empty() { String::new() } else { format!("{note}; ") };
                let reason = format!(
                    "{prefix}node {id} has waited and heartbeated for {:?} beside running round {} with {} of at \
                     most {} nodes: scale-up",
                    job.settings.node_ttl.saturating_mul(SCALE_UP_TTLS),
                    job.round,
                    job.members.len(),
                    job.settings.max_nodes
                );
                return open_round(job, now, RoundCause::ScaleUp { node_id: id }, &[], reason);
            }
            if !note.is_empty() {
                decide(Action::Updated, note)
            } else {
                decide(Action::Nothing, "nothing due")
            }
        }
        Phase::Waiting { .. } | Phase::LastCall { .. } => {
            job.prune_last_seen();
            let changed = before != (job.pending.len(), job.previous.len()) || !note.is_empty();
            let d = evaluate_forming(job, now, note);
            if d.action == Action::Nothing && changed {
                decide(Action::Updated, d.reason)
            } else {
                d
            }
        }
        Phase::Finished { .. } | Phase::Failed { .. } => decide(Action::Nothing, "job is over"),
    }
}

fn report_failure(job: &mut Job, node_id: &str, round: u64, root_cause: RootCause, now: Millis) -> Decision {
    if job.last_failure_round == Some(round) && !root_cause.stacks.is_empty() {
        // A second node that saw the same round fail (both saw a hang at once): the failure
        // counts once, its ranks' places join the report.
        return report_stacks(job, node_id, round, &root_cause.stacks);
    }
    if job.phase.is_terminal() {
        return decide(Action::Nothing, format!("failure report from {node_id} ignored: the job is over"));
    }
    if round != job.round || !matches!(job.phase, Phase::Running { .. }) {
        return decide(
            Action::Nothing,
            format!(
                "failure report from {node_id} for round {round} ignored: round {} is {} (a failure counts once per round)",
                job.round,
                job.phase.name()
            ),
        );
    }
    if !job.is_member(node_id) {
        return reject(Rejection::NotMember { node_id: node_id.to_owned(), round });
    }
    let summary = root_cause.summary();
    let mut root_cause = root_cause;
    // The reporting node speaks for its own ranks only.
    let own = job.member(node_id).map(Member::ranks).unwrap_or(0..0);
    root_cause.stacks = rlaunch::stacks::merge(&[&root_cause.stacks], own);
    job.last_root_cause = Some(root_cause);
    job.last_failure_round = Some(round);
    let budget = job.settings.max_restarts;
    if job.restart_count < budget {
        job.restart_count += 1;
        let reason = format!(
            "worker failure on node {node_id} in round {round}: restart {} of {budget}; root cause: {summary}",
            job.restart_count
        );
        open_round(job, now, RoundCause::Failure { node_id: node_id.to_owned() }, &[], reason)
    } else {
        let reason = format!(
            "restart budget exhausted ({budget} restarts used); last failure on node {node_id} in round {round}: {summary}"
        );
        job.phase = Phase::Failed { at: now, kind: FailureKind::RestartBudget, reason: reason.clone() };
        decide(Action::Failed, reason)
    }
}

/// Merges where `node_id`'s ranks stood into the root cause of the failure that ended `round`.
fn report_stacks(job: &mut Job, node_id: &str, round: u64, stacks: &[String]) -> Decision {
    // Only a member of the round, holding its key (a job run without node identity, as in the
    // machine's own tests, has none), and only of its own ranks.
    let keyed = job.keys.is_empty() || job.keys.contains_key(node_id);
    let Some(own) = job.member(node_id).filter(|_| keyed).map(Member::ranks) else {
        return reject(Rejection::UnknownNode { node_id: node_id.to_owned() });
    };
    let Some(rc) = job.last_root_cause.as_mut().filter(|_| job.last_failure_round == Some(round)) else {
        return decide(
            Action::Nothing,
            format!("stacks from {node_id} for round {round} ignored: no failure of that round to add them to"),
        );
    };
    let mine = rlaunch::stacks::merge(&[stacks], own);
    // What the report holds came in the same way, each node's within its own ranks.
    let merged = rlaunch::stacks::merge(&[&rc.stacks, &mine], 0..u32::MAX);
    if merged == rc.stacks {
        return decide(Action::Nothing, format!("stacks from {node_id} for round {round} already in the report"));
    }
    rc.stacks = merged;
    decide(Action::Updated, format!("where the ranks of {node_id} stood in round {round} added to the root cause"))
}

fn node_succeeded(job: &mut Job, node_id: &str, round: u64, now: Millis) -> Decision {
    if job.phase.is_terminal() {
        return decide(Action::Nothing, format!("success of {node_id} noted after the job ended"));
    }
    if round != job.round || !matches!(job.phase, Phase::Running { .. }) {
        return decide(
            Action::Nothing,
            format!(
                "success report from {node_id} for round {round} ignored: round {} is {}",
                job.round,
                job.phase.name()
            ),
        );
    }
    if !job.is_member(node_id) {
        return reject(Rejection::NotMember { node_id: node_id.to_owned(), round });
    }
    if job.succeeded.iter().any(|s| s == node_id) {
        return decide(Action::Nothing, format!("success of {node_id} already noted"));
    }
    job.succeeded.push(node_id.to_owned());
    if let Some(h) = job.health.get_mut(node_id) {
        h.suspicion = None;
    }
    if job.members.iter().all(|m| job.succeeded.contains(&m.node_id)) {
        job.phase = Phase::Finished { at: now };
        job.pending.clear();
        return decide(Action::Finished, format!("every member of round {} succeeded: job finished", job.round));
    }
    decide(
        Action::Updated,
        format!(
            "node {node_id} succeeded in round {round} ({} of {} members done); the others carry on",
            job.succeeded.len(),
            job.members.len()
        ),
    )
}

fn leave(job: &mut Job, node_id: &str, now: Millis) -> Decision {
    if job.phase.is_terminal() {
        job.last_seen.remove(node_id);
        job.health.remove(node_id);
        return decide(Action::Nothing, format!("node {node_id} left after the job ended"));
    }
    let was_pending = job.is_pending(node_id);
    let was_previous = job.previous.iter().any(|p| p == node_id);
    // The id is free again: an agent that joins with it later is a new node.
    job.keys.remove(node_id);
    job.pending.retain(|p| p.node.node_id != node_id);
    job.previous.retain(|p| p != node_id);
    if matches!(job.phase, Phase::Running { .. }) && job.is_member(node_id) {
        job.last_seen.remove(node_id);
        job.health.remove(node_id);
        if job.succeeded.iter().any(|s| s == node_id) {
            return decide(Action::Updated, format!("node {node_id} left after succeeding"));
        }
        let reason = format!("node {node_id} left running round {}", job.round);
        let gone = [node_id.to_owned()];
        return open_round(job, now, RoundCause::MemberLeft { node_id: node_id.to_owned() }, &gone, reason);
    }
    if !was_pending && !was_previous && !job.last_seen.contains_key(node_id) {
        return decide(Action::Nothing, format!("node {node_id} left but was not known"));
    }
    job.last_seen.remove(node_id);
    job.health.remove(node_id);
    let base = format!("node {node_id} left");
    if job.phase.is_forming() {
        let d = evaluate_forming(job, now, base);
        if d.action == Action::Nothing {
            return decide(Action::Updated, d.reason);
        }
        return d;
    }
    decide(Action::Updated, base)
}

/// Tears the running (or forming) round down and opens the next: `gone` nodes are not
/// expected back; surviving members are, in their old rank order.
fn open_round(job: &mut Job, now: Millis, cause: RoundCause, gone: &[String], reason: String) -> Decision {
    job.round += 1;
    let survivors: Vec<String> =
        job.members.iter().map(|m| m.node_id.clone()).filter(|id| !gone.contains(id) && !job.lapsed(id, now)).collect();
    job.previous = survivors;
    job.succeeded.clear();
    for id in gone {
        job.last_seen.remove(id);
        job.health.remove(id);
    }
    job.phase = Phase::Waiting { since: now };
    job.prune_last_seen();
    let reason = format!("{reason}; round {} opened", job.round);
    let d = evaluate_forming(job, now, reason.clone());
    match d.action {
        Action::RoundClosed { .. } | Action::Failed => d,
        _ => decide(Action::RoundOpened { round: job.round, cause }, d.reason),
    }
}

/// Decides whether a forming round closes now, enters or leaves its last call, or fails.
fn evaluate_forming(job: &mut Job, now: Millis, base: String) -> Decision {
    let with = |s: &str| if base.is_empty() { s.to_owned() } else { format!("{base}; {s}") };
    let n = job.pending.len();
    let min = job.settings.min_nodes as usize;
    let max = job.settings.max_nodes as usize;
    // Only a re-forming round has survivors to wait for (a first round of 10,000 joins must not
    // index every pending node on every join).
    let all_previous_back = job.previous.is_empty() || {
        let pending: HashSet<&str> = job.pending.iter().map(|p| p.node.node_id.as_str()).collect();
        job.previous.iter().all(|id| pending.contains(id.as_str()))
    };
    let previous_back = !job.previous.is_empty() && all_previous_back;
    let since = match job.phase {
        Phase::Waiting { since } | Phase::LastCall { since, .. } => since,
        _ => return decide(Action::Nothing, base),
    };
    // At MAX the round closes at once, unless survivors of the previous round are still on
    // their way back: they keep their places over standbys, so the last call waits for them.
    if n >= max && all_previous_back {
        return close_round(job, now, with(&format!("MAX ({max}) nodes are in: last call skipped")));
    }
    if n >= min && previous_back {
        return close_round(job, now, with("every surviving member of the previous round is back: last call skipped"));
    }
    if n >= min {
        match job.phase {
            Phase::LastCall { deadline, since } if now >= deadline => {
                // Survivors of the previous round still on their way back are alive (a lapsed
                // one is dropped from `previous` by the tick) but still stopping their workers:
                // wait for them up to the shutdown timeout rather than close without them.
                let missing =
                    job.previous.len() - job.pending.iter().filter(|p| job.previous.contains(&p.node.node_id)).count();
                let survivors_due = since
                    .saturating_add(JobSettings::ms(job.settings.stop_grace))
                    .saturating_add(JobSettings::ms(job.settings.last_call_timeout));
                if missing > 0 && now < survivors_due {
                    let note = format!(
                        "last call over; waiting for {missing} surviving member(s) still stopping their workers"
                    );
                    if base.is_empty() {
                        decide(Action::Nothing, note)
                    } else {
                        decide(Action::Updated, with(&note))
                    }
                } else {
                    close_round(job, now, with("last call over"))
                }
            }
            Phase::LastCall { .. } => {
                if base.is_empty() {
                    decide(Action::Nothing, "last call runs")
                } else {
                    decide(Action::Updated, base)
                }
            }
            _ => {
                let survivors_missing =
                    job.previous.iter().any(|id| !job.pending.iter().any(|p| &p.node.node_id == id));
                let wait_for_survivors = survivors_missing && !job.settings.stop_grace.is_zero();
                if job.settings.last_call_timeout.is_zero() && !wait_for_survivors {
                    return close_round(job, now, with("MIN reached and the last call is zero"));
                }
                let deadline = now.saturating_add(JobSettings::ms(job.settings.last_call_timeout));
                job.phase = Phase::LastCall { since, deadline };
                decide(
                    Action::Updated,
                    with(&format!("MIN ({min}) nodes are in: last call for {:?}", job.settings.last_call_timeout)),
                )
            }
        }
    } else {
        if matches!(job.phase, Phase::LastCall { .. }) {
            job.phase = Phase::Waiting { since };
        }
        let join_deadline = since.saturating_add(JobSettings::ms(job.settings.join_timeout));
        if now >= join_deadline {
            let reason = with(&format!(
                "only {n} of at least {min} nodes joined round {} within the join timeout ({:?}): job failed",
                job.round, job.settings.join_timeout
            ));
            job.pending.clear();
            job.previous.clear();
            job.prune_last_seen();
            job.phase = Phase::Failed { at: now, kind: FailureKind::JoinTimeout, reason: reason.clone() };
            return decide(Action::Failed, reason);
        }
        if base.is_empty() {
            decide(Action::Nothing, format!("waiting for {} more node(s)", min - n))
        } else {
            decide(Action::Updated, with(&format!("waiting for {} more node(s)", min - n)))
        }
    }
}

/// Closes the forming round: previous members first in their old rank order, then the other
/// joiners by join time; at most MAX; the rest stay pending.
fn close_round(job: &mut Job, now: Millis, reason: String) -> Decision {
    let max = job.settings.max_nodes as usize;
    let mut order: Vec<Pending> = Vec::with_capacity(job.pending.len());
    for id in &job.previous {
        if let Some(p) = job.pending.iter().find(|p| &p.node.node_id == id) {
            order.push(p.clone());
        }
    }
    let previous: HashSet<&str> = job.previous.iter().map(String::as_str).collect();
    let mut rest: Vec<Pending> =
        job.pending.iter().filter(|p| !previous.contains(p.node.node_id.as_str())).cloned().collect();
    rest.sort_by(|a, b| a.joined_at.cmp(&b.joined_at).then_with(|| a.node.node_id.cmp(&b.node.node_id)));
    order.extend(rest);
    let standby = if order.len() > max { order.split_off(max) } else { Vec::new() };
    job.fingerprint_diff = fingerprint_diff(job, &order);
    // Only the reference and the standbys' fingerprints are needed from now on.
    let keep: HashSet<&str> = standby
        .iter()
        .filter_map(|p| p.fingerprint_digest.as_deref())
        .chain(job.fingerprint_reference.as_deref())
        .collect();
    job.fingerprints.retain(|d, _| keep.contains(d.as_str()));
    let mut offset = 0u32;
    job.members = order
        .into_iter()
        .enumerate()
        .map(|(rank, p)| {
            let m = Member {
                node_id: p.node.node_id,
                group_rank: u32::try_from(rank).unwrap_or(u32::MAX),
                local_world_size: p.node.local_world_size,
                rank_offset: offset,
                store_addr: p.node.store_addr,
                probe_addr: p.node.probe_addr,
            };
            offset = offset.saturating_add(m.local_world_size);
            m
        })
        .collect();
    job.members_digest = members_digest(&job.members);
    job.member_index = MemberIndex::default();
    job.pending = standby;
    job.previous.clear();
    job.succeeded.clear();
    job.phase = Phase::Running { since: now };
    job.prune_last_seen();
    let mut reason = format!(
        "{reason}; round {} closed with {} node(s), world size {}",
        job.round,
        job.members.len(),
        job.world_size()
    );
    if let Some(first) = job.fingerprint_diff.first() {
        reason += &format!("; nodes' fingerprints differ: {first}");
        if job.fingerprint_diff.len() > 1 {
            reason += &format!(" (and {} more lines in status)", job.fingerprint_diff.len() - 1);
        }
    }
    decide(Action::RoundClosed { round: job.round }, reason)
}

/// How the nodes about to form a round differ, against the job's first fingerprint when one of
/// them holds it, else against the largest group.
fn fingerprint_diff(job: &Job, order: &[Pending]) -> Vec<String> {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in order {
        if let Some(d) = &p.fingerprint_digest {
            groups.entry(d.clone()).or_default().push(p.node.node_id.clone());
        }
    }
    if groups.len() < 2 {
        return Vec::new();
    }
    let reference = match &job.fingerprint_reference {
        Some(r) if groups.contains_key(r) => r.clone(),
        _ => groups.iter().max_by_key(|(_, ids)| ids.len()).map(|(d, _)| d.clone()).unwrap_or_default(),
    };
    rlaunch::fingerprint::report(&reference, &groups, &job.fingerprints)
        .into_iter()
        .map(|l| rlaunch::contract::cut_end(&l, 1024))
        .collect()
}

/// A digest of a member list: SHA-256 over each member's id, rank, offset, workers and store,
/// hex (the first 32 characters).
fn members_digest(members: &[Member]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for m in members {
        h.update(m.node_id.as_bytes());
        h.update([0]);
        h.update(m.group_rank.to_le_bytes());
        h.update(m.rank_offset.to_le_bytes());
        h.update(m.local_world_size.to_le_bytes());
        h.update(m.store_addr.to_string().as_bytes());
        h.update([0]);
    }
    h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// `Duration` as whole milliseconds in JSON.
mod duration_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

#[cfg(test)]
mod tests;
