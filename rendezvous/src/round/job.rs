//! A job's state, [`Job`] (plain data: stores persist it as JSON), and what is read from it: its
//! members and their ranks, the round a node runs in, and the failure detector's bookkeeping
//! (which nodes are watched, suspected, probed or lost; forgetting the nodes the job no longer
//! counts on).

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::recovery::Accounting;
use super::settings::{JobSettings, Millis, MAX_NODES, SCALE_UP_TTLS};
use crate::detector::{self, Health, ProbeRequest, Timing, Verdict};
use rlaunch::contract::{HostPort, Member, NodeInfo, PeerWatch, RootCause, RoundInfo, WatchTarget};

/// Group ranks by node id for [`Job::member`], and the round's world size; equal to any other
/// (it is a cache).
#[derive(Debug, Clone, Default)]
pub struct MemberIndex(std::sync::OnceLock<(HashMap<String, usize>, u32)>);

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

/// The nodes waiting for the next round, in join order, with an index by node id kept as the
/// list changes: whether a node is pending is a lookup, not a scan of up to 10,000 entries on
/// every join and every woken long-poll. Stored (and compared) as the plain list.
#[derive(Debug, Clone, Default)]
pub struct PendingList {
    list: Vec<Pending>,
    index: HashMap<String, usize>,
}

impl PendingList {
    fn reindex(&mut self) {
        self.index = self.list.iter().enumerate().map(|(i, p)| (p.node.node_id.clone(), i)).collect();
    }

    /// Adds a node not yet pending (one already pending is updated in place instead).
    pub fn push(&mut self, p: Pending) {
        if let Some(&i) = self.index.get(&p.node.node_id) {
            self.list[i] = p;
            return;
        }
        self.index.insert(p.node.node_id.clone(), self.list.len());
        self.list.push(p);
    }

    pub fn contains(&self, node_id: &str) -> bool {
        self.index.contains_key(node_id)
    }

    pub fn get(&self, node_id: &str) -> Option<&Pending> {
        self.index.get(node_id).map(|&i| &self.list[i])
    }

    /// The node's entry, to update its details (never its id).
    pub fn get_mut(&mut self, node_id: &str) -> Option<&mut Pending> {
        self.index.get(node_id).map(|&i| &mut self.list[i])
    }

    pub fn retain(&mut self, keep: impl FnMut(&Pending) -> bool) {
        let before = self.list.len();
        self.list.retain(keep);
        if self.list.len() != before {
            self.reindex();
        }
    }

    pub fn clear(&mut self) {
        self.list.clear();
        self.index.clear();
    }

    /// Removes `node_id`'s entry; a lookup when it is not pending.
    pub fn remove(&mut self, node_id: &str) -> Option<Pending> {
        let i = self.index.remove(node_id)?;
        let gone = self.list.remove(i);
        for p in &self.list[i..] {
            if let Some(j) = self.index.get_mut(&p.node.node_id) {
                *j -= 1;
            }
        }
        Some(gone)
    }
}

impl From<Vec<Pending>> for PendingList {
    fn from(list: Vec<Pending>) -> PendingList {
        let mut out = PendingList { list, index: HashMap::new() };
        // A list read from a store with a node twice keeps its first entry.
        let mut seen = std::collections::HashSet::new();
        out.list.retain(|p| seen.insert(p.node.node_id.clone()));
        out.reindex();
        out
    }
}

impl std::ops::Deref for PendingList {
    type Target = [Pending];
    fn deref(&self) -> &[Pending] {
        &self.list
    }
}

impl PartialEq for PendingList {
    fn eq(&self, other: &Self) -> bool {
        self.list == other.list
    }
}

impl Eq for PendingList {}

impl Serialize for PendingList {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.list.serialize(s)
    }
}

impl<'de> Deserialize<'de> for PendingList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<Pending>::deserialize(d).map(PendingList::from)
    }
}

/// Node ids in an order that matters (the previous round's survivors, in rank order), with a
/// set kept beside them: membership is a lookup. Stored (and compared) as the plain list.
#[derive(Debug, Clone, Default)]
pub struct NodeIds {
    list: Vec<String>,
    set: std::collections::HashSet<String>,
}

impl NodeIds {
    pub fn contains(&self, node_id: &str) -> bool {
        self.set.contains(node_id)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&String) -> bool) {
        let set = &mut self.set;
        self.list.retain(|id| {
            let k = keep(id);
            if !k {
                set.remove(id);
            }
            k
        });
    }

    /// Adds `node_id` at the end, unless it is there already.
    pub fn push(&mut self, node_id: String) {
        if self.set.insert(node_id.clone()) {
            self.list.push(node_id);
        }
    }

    /// Removes `node_id`; a lookup when it is not there.
    pub fn remove(&mut self, node_id: &str) -> bool {
        if !self.set.remove(node_id) {
            return false;
        }
        self.list.retain(|id| id != node_id);
        true
    }

    pub fn clear(&mut self) {
        self.list.clear();
        self.set.clear();
    }
}

impl From<Vec<String>> for NodeIds {
    fn from(mut list: Vec<String>) -> NodeIds {
        let mut set = std::collections::HashSet::new();
        list.retain(|id| set.insert(id.clone()));
        NodeIds { list, set }
    }
}

impl std::ops::Deref for NodeIds {
    type Target = [String];
    fn deref(&self) -> &[String] {
        &self.list
    }
}

impl PartialEq for NodeIds {
    fn eq(&self, other: &Self) -> bool {
        self.list == other.list
    }
}

impl Eq for NodeIds {}

impl<const N: usize> PartialEq<[&str; N]> for NodeIds {
    fn eq(&self, other: &[&str; N]) -> bool {
        self.list.len() == N && self.list.iter().zip(other).all(|(a, b)| a == b)
    }
}

impl Serialize for NodeIds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.list.serialize(s)
    }
}

impl<'de> Deserialize<'de> for NodeIds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<String>::deserialize(d).map(NodeIds::from)
    }
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

    pub(super) fn is_forming(&self) -> bool {
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
    /// The round `members` closed in: the tag its members' snapshot parts were saved under
    /// (0 before any round closed, or in a state written before it was kept).
    #[serde(default)]
    pub members_round: u64,
    /// Group ranks by node id, built on first use per round: finding a member among 10,000
    /// is a lookup, not a scan. Not stored; a stale entry is detected and scanned past.
    #[serde(skip)]
    pub member_index: MemberIndex,
    /// Nodes waiting for the next round to close, in join order (standbys beyond MAX too).
    pub pending: PendingList,
    /// Surviving members of the previous round, in their old rank order, expected to rejoin the
    /// forming round; when all are back the last call is skipped.
    pub previous: NodeIds,
    /// Members of the running round that reported success.
    pub succeeded: NodeIds,
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
    /// Every later event for the node must carry that secret
    /// ([`apply_guarded`](crate::round::apply_guarded)).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, String>,
    /// Restarts spent from the global budget (failures only; node loss and scale-up are free).
    pub restart_count: u32,
    /// Root cause of the last reported failure, as the agent sent it, with the stacks of the
    /// other nodes' ranks merged in as they arrive
    /// ([`Event::ReportStacks`](crate::round::Event::ReportStacks)).
    pub last_root_cause: Option<RootCause>,
    /// The round that failure ended: stacks are taken for it only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_round: Option<u64>,
    /// Each distinct node fingerprint by digest
    /// ([`MAX_FINGERPRINTS`](crate::round::MAX_FINGERPRINTS) at most).
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
    /// Where the store keeps no heartbeat times (etcd): when the service last heard from nodes
    /// whose liveness lapsed, as the replica that let it lapse noted. Never stored; a loss is
    /// dated with it.
    #[serde(skip)]
    pub lapsed_heard: BTreeMap<String, Millis>,
    /// Nodes whose liveness another process vouches for (etcd: their alive key exists on a
    /// lease this process does not hold): this process makes no detector decision about them
    /// (no suspicion started, renewed or cleared) while it does. Never stored.
    #[serde(skip)]
    pub vouched: std::collections::BTreeSet<String>,
    /// What each recovery cost, the job's goodput and its timeline.
    #[serde(default, skip_serializing_if = "Accounting::is_empty")]
    pub accounting: Accounting,
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

// Here, beside the detector's bookkeeping, so that the settings import nothing of the detector
// (which takes `Millis` from them).
impl JobSettings {
    /// The failure detector's timing.
    pub fn timing(&self) -> Timing {
        Timing {
            interval: Self::ms(self.heartbeat_interval),
            ttl: Self::ms(self.node_ttl),
            probe_timeout: Self::ms(self.probe_timeout),
            peer_interval: Self::ms(self.peer_interval),
            stall_bound: Self::ms(self.stall_bound),
        }
    }
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
            members_round: 0,
            member_index: MemberIndex::default(),
            pending: PendingList::default(),
            previous: NodeIds::default(),
            succeeded: NodeIds::default(),
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
            lapsed_heard: BTreeMap::new(),
            vouched: Default::default(),
            accounting: Accounting::default(),
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
            || self.previous.contains(node_id)
    }

    pub fn is_member(&self, node_id: &str) -> bool {
        self.member(node_id).is_some()
    }

    /// The member `node_id` of the last closed round, through the index.
    pub fn member(&self, node_id: &str) -> Option<&Member> {
        let index = &self.member_index.0.get_or_init(|| self.index_members()).0;
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

    pub(super) fn is_pending(&self, node_id: &str) -> bool {
        self.pending.contains(node_id)
    }

    /// Ranks in the round; the bounds on nodes and workers per node keep it within `u32`.
    /// Summed once per round (it is in every answer to 10,000 nodes).
    pub fn world_size(&self) -> u32 {
        let (_, world) = self.member_index.0.get_or_init(|| self.index_members());
        if self.members.len() != self.member_index.0.get().map_or(0, |(by_id, _)| by_id.len()) {
            // Members changed since the index was built (only ever in tests that edit them).
            return Self::sum_world(&self.members);
        }
        *world
    }

    fn sum_world(members: &[Member]) -> u32 {
        members.iter().fold(0u32, |sum, m| sum.saturating_add(m.local_world_size))
    }

    fn index_members(&self) -> (HashMap<String, usize>, u32) {
        let by_id = self.members.iter().enumerate().map(|(i, m)| (m.node_id.clone(), i)).collect();
        (by_id, Self::sum_world(&self.members))
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
            watch: self.watch_of(me.group_rank as usize),
        })
    }

    /// What the member at `index` (its group rank) watches in the running round
    /// ([`detector::peers::watch_offsets`]); `None` with peer watching off.
    fn watch_of(&self, index: usize) -> Option<PeerWatch> {
        if self.settings.peer_interval.is_zero() {
            return None;
        }
        let n = self.members.len();
        let targets = detector::peers::watch_offsets(n)
            .into_iter()
            .filter_map(|o| self.members.get((index + o) % n))
            .map(|m| WatchTarget {
                node_id: m.node_id.clone(),
                addr: m.probe_addr.clone().unwrap_or(m.store_addr.clone()),
            })
            .collect();
        Some(PeerWatch {
            interval_ms: JobSettings::ms(self.settings.peer_interval),
            stall_bound_ms: JobSettings::ms(self.settings.stall_bound),
            targets,
        })
    }

    /// The members assigned to watch `target` in the running round (none when it is no member,
    /// the round is not running, or peer watching is off).
    pub fn watchers_of(&self, target: &str) -> Vec<&str> {
        if self.settings.peer_interval.is_zero() || !matches!(self.phase, Phase::Running { .. }) {
            return Vec::new();
        }
        let Some(t) = self.member(target).map(|m| m.group_rank as usize) else { return Vec::new() };
        let n = self.members.len();
        detector::peers::watch_offsets(n)
            .into_iter()
            .filter_map(|o| self.members.get((t + n - o) % n))
            .map(|m| m.node_id.as_str())
            .filter(|id| *id != target)
            .collect()
    }

    /// The watchers of `target` whose reports count now: assigned, not suspected themselves,
    /// and heard from by the rendezvous recently ([`Timing::watcher_silence`]).
    pub fn trusted_watchers(&self, target: &str, now: Millis) -> Vec<&str> {
        let t = self.settings.timing();
        self.watchers_of(target)
            .into_iter()
            .filter(|w| self.health.get(*w).is_none_or(|h| h.suspicion.is_none()))
            .filter(|w| self.last_seen.get(*w).is_some_and(|s| now.saturating_sub(*s) < t.watcher_silence()))
            .collect()
    }

    /// Whether the failure detector holds `node_id` lost at `now`. A node that succeeded may go
    /// quiet: it is only forgotten after a TTL, never probed.
    pub(super) fn lapsed(&self, node_id: &str, now: Millis) -> bool {
        let last = self.last_seen.get(node_id).copied();
        if self.succeeded.contains(node_id) {
            let ttl = JobSettings::ms(self.settings.node_ttl);
            return last.is_none_or(|seen| now.saturating_sub(seen) >= ttl);
        }
        let t = self.settings.timing();
        match self.health.get(node_id) {
            Some(h) if !h.peers.is_empty() && h.lost_to_peers(&self.trusted_watchers(node_id, now), last, now, &t) => {
                true
            }
            Some(h) => h.verdict(last, now, &t) == Verdict::Lost,
            // Not yet seen by a tick: suspected at most, never lost without probes.
            None => false,
        }
    }

    /// Nodes the detector watches: members of the running round still at work, pending nodes,
    /// and survivors of the previous round on their way back.
    pub fn watched(&self) -> Vec<&str> {
        let running = matches!(self.phase, Phase::Running { .. });
        let succeeded = &self.succeeded;
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
    pub fn addr_of(&self, node_id: &str) -> Option<&HostPort> {
        self.pending.get(node_id).map(|p| p.node.probe_addr.as_ref().unwrap_or(&p.node.store_addr)).or_else(|| {
            let m = self.member(node_id)?;
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
    pub(super) fn update_suspicions(&mut self, now: Millis) -> Vec<String> {
        let t = self.settings.timing();
        let mut notes = Vec::new();
        // Only the few nodes due for a (new) probe round are copied out of the job.
        let due: Vec<(String, bool)> = self
            .watched()
            .into_iter()
            .filter(|id| !self.vouched.contains(*id))
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
    pub(super) fn loss_detail(&self, node_id: &str, now: Millis) -> String {
        let silence = self
            .last_seen
            .get(node_id)
            .map_or_else(|| "never heard from".to_owned(), |l| format!("silent for {} ms", now.saturating_sub(*l)));
        let t = self.settings.timing();
        if let Some(h) = self.health.get(node_id) {
            let last = self.last_seen.get(node_id).copied();
            if !h.peers.is_empty() && h.lost_to_peers(&self.trusted_watchers(node_id, now), last, now, &t) {
                let peers = h.peer_detail(now).unwrap_or_default();
                return format!("{node_id} ({silence}; its watchers: {peers})");
            }
        }
        match self.health.get(node_id).and_then(|h| h.suspicion.as_ref()) {
            Some(s) if s.reached_by.is_some() => format!("{node_id} ({silence}, past the silence limit)"),
            Some(s) if !s.missed_by.is_empty() => {
                format!("{node_id} ({silence}; not reached by {})", s.missed_by.join(", "))
            }
            _ => format!("{node_id} ({silence}; no member reached it)"),
        }
    }

    /// Forgets heartbeats of nodes the job no longer tracks.
    pub(super) fn prune_last_seen(&mut self) {
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
    pub(super) fn prune_health(&mut self) {
        let watched: HashSet<String> = self.watched().into_iter().map(str::to_owned).collect();
        let succeeded = &self.succeeded;
        self.health.retain(|id, _| watched.contains(id) || succeeded.contains(id));
        self.suspects.retain(|id| watched.contains(id));
    }
}
