//! What goes into the machine and what comes out of it: an [`Event`], and the [`Decision`] it
//! makes: an [`Action`] (a round opened for a [`RoundCause`], a [`Rejection`], ...) and why.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::job::FailureKind;
use crate::detector::{ProbeReport, Sent};
use rlaunch::contract::{NodeInfo, NodeProgress, RootCause};

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
    /// A sign of life, with the sender's count of heartbeats, the outcomes of the probes it
    /// was asked for and its reports on the members it watches.
    Heartbeat {
        node_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sent: Option<Sent>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        probes: Vec<ProbeReport>,
        /// What the sender's watching says of the members it watches
        /// ([`crate::detector::peers`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        peers: Vec<crate::detector::PeerReport>,
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
    /// How far a member of `round` got since the round closed (workers started, a step
    /// restored, saved, saved again): for the recovery accounting, dated on arrival.
    Progress {
        node_id: String,
        round: u64,
        progress: NodeProgress,
    },
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
            | Event::Progress { node_id, .. }
            | Event::Leave { node_id } => Some(node_id),
            Event::Tick => None,
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

pub(super) fn decide(action: Action, reason: impl Into<String>) -> Decision {
    Decision { action, reason: reason.into() }
}

pub(super) fn reject(r: Rejection) -> Decision {
    let reason = r.to_string();
    decide(Action::Rejected(r), reason)
}
