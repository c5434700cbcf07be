//! A job as operators see it (`rlaunch status`, `/v1/jobs`, the status page): [`JobStatus`],
//! with a [`NodeStatus`] per node and the failure detector's [`NodeHealth`] of it.

use serde::{Deserialize, Serialize};

use super::job::{Job, Phase};
use super::recovery::{Mark, Phases, Recovery};
use super::settings::{JobSettings, Millis};
use rlaunch::contract::{HostPort, RootCause};

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
    /// What each recovery cost, goodput and the timeline.
    #[serde(default)]
    pub recovery: RecoveryStatus,
}

/// The job's recoveries and goodput, as `status` shows them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RecoveryStatus {
    /// Training time over wall time since the first round closed.
    pub goodput: Option<f64>,
    pub wall_ms: Millis,
    /// Start-up and recoveries.
    pub lost_ms: Millis,
    /// The first round closed → its members' first step (or the last instant they reported).
    pub startup_ms: Option<Millis>,
    /// Recoveries over the job's life (the list keeps the last ones).
    pub count: u64,
    pub recoveries: Vec<RecoveryView>,
    /// When the view was taken, on the service's clock (the timeline's "now").
    pub now: Millis,
    pub began_at: Option<Millis>,
    /// Rounds, joins, losses, failures, the end (a single job's status only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<Mark>,
}

/// One recovery with its phases.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoveryView {
    #[serde(flatten)]
    pub recovery: Recovery,
    pub phases: Phases,
    /// The time it cost (so far, while `ongoing`).
    pub lost_ms: Millis,
    pub ongoing: bool,
}

impl Job {
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
            recovery: self.recovery_status(now),
        }
    }

    /// The recovery accounting as operators see it at `now`.
    pub fn recovery_status(&self, now: Millis) -> RecoveryStatus {
        let a = &self.accounting;
        let ended = match self.phase {
            Phase::Finished { at } | Phase::Failed { at, .. } => Some(at),
            _ => None,
        };
        let end = ended.unwrap_or(now);
        RecoveryStatus {
            goodput: a.goodput(now, ended),
            wall_ms: a.began_at.map_or(0, |b| end.saturating_sub(b)),
            lost_ms: a.lost_ms(now, ended),
            startup_ms: a.startup_ms(end),
            count: a.dropped + a.recoveries.len() as u64,
            recoveries: a
                .recoveries
                .iter()
                .map(|r| RecoveryView {
                    recovery: r.clone(),
                    phases: r.phases(),
                    lost_ms: r.lost_ms(end),
                    ongoing: r.ended_at(end).is_none() && ended.is_none(),
                })
                .collect(),
            now,
            began_at: a.began_at,
            timeline: a.timeline.iter().cloned().collect(),
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
}
