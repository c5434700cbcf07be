//! What goes into the agent's core and what comes out: [`Event`]s, [`Action`]s, and the
//! outcomes a run ends in.

use rlaunch::contract::{RootCause, RoundInfo};

use super::Placement;

/// The rendezvous error behind a [`CallError`], carried whole to the outcome it may end in (the
/// `source` of the agent's error): no text in its place, no side channel. Shared, so events
/// stay cheap to clone; equal when they say the same (tests compare events).
#[derive(Debug, Clone)]
pub struct Cause(pub std::sync::Arc<rlaunch_rendezvous::RdzvError>);

impl Cause {
    pub fn new(e: rlaunch_rendezvous::RdzvError) -> Cause {
        Cause(std::sync::Arc::new(e))
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Cause) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for Cause {}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A rendezvous call that did not succeed, as the core needs to tell them apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// Unreachable, a 5xx, an etcd election: the same call may succeed later.
    Transient(Cause),
    /// The rendezvous refused the call (a 4xx other than the ones below): sending it again
    /// cannot help.
    Refused(Cause),
    /// This node is unknown to the job or not a member of the round (declared lost).
    NotMember,
    JobFinished,
    JobFailed(String),
}

/// How this node's worker group ended by itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkersEnd {
    /// Every worker exited 0; the group's processes are gone.
    Succeeded,
    /// The first failure; the other workers may still run.
    Failed(Box<RootCause>),
    /// No progress for the hang timeout (`--hang-timeout`); every worker still runs. A failure
    /// like any other, except that in a job of several nodes it is announced before anything is
    /// stopped (see [`Phase::Lingering`]).
    Hung(Box<RootCause>),
}

/// What the rendezvous said to a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watch {
    NoChange,
    NewRound(u64),
    Finished,
    Failed(String),
}

/// A report to the rendezvous, sent until acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    Success {
        round: u64,
    },
    /// The root cause is already [`RootCause::bounded`].
    Failure {
        round: u64,
        root_cause: Box<RootCause>,
    },
    Leave,
}

impl Report {
    pub(super) fn kind(&self) -> ReportKind {
        match self {
            Report::Success { .. } => ReportKind::Success,
            Report::Failure { .. } => ReportKind::Failure,
            Report::Leave => ReportKind::Leave,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportKind {
    Success,
    Failure,
    Leave,
}

/// Something that happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The first event of a run.
    Start,
    /// The join call answered: a closed round including this node, or why not.
    Joined(Result<RoundInfo, CallError>),
    /// This node's workers ended by themselves.
    WorkersEnded(WorkersEnd),
    /// A `StopWorkers` finished: no process of this node's workers is left.
    WorkersStopped,
    /// A watch of `round` answered.
    Watched { round: u64, answer: Result<Watch, CallError> },
    /// A report was answered.
    Reported { kind: ReportKind, result: Result<(), CallError> },
    /// A heartbeat was answered.
    Heartbeat(Result<(), CallError>),
    /// The job's last root cause as the rendezvous keeps it (after `FetchRootCause`).
    /// With the round whose failure it is, when the rendezvous says.
    RootCauseFetched(Option<Box<RootCause>>, Option<u64>),
    /// A signal reached the agent.
    Signal(i32),
    /// Which of this node's workers (by local index) keep their process across rounds
    /// (`rlaunch.resilient`: connected to the control socket), whenever that changes.
    OptedIn(Vec<u32>),
    /// Every worker told that its round ended (`Action::Park`) has ended its collectives and
    /// waits for the next round.
    WorkersParked,
    /// Time passed (the driver ticks a few times per heartbeat interval).
    Tick,
}

/// How the run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The job is over for this node, as the launcher reports it.
    Run(RunOutcome),
    /// The rendezvous could not be used (unreachable for the whole join timeout, a join
    /// refused, a job that failed without a root cause): the agent's own failure.
    Rendezvous { message: String, source: Option<Cause> },
}

/// How a job ended on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    Succeeded {
        restarts: u32,
    },
    /// Workers failed and the restart budget is spent (or the failure could not be reported).
    Failed {
        root_cause: Box<RootCause>,
        restarts: u32,
    },
    /// The agent was told to stop by a signal.
    Interrupted {
        signal: i32,
    },
}

impl RunOutcome {
    /// The launcher's exit code: 0, the failing worker's own code (128+signal if it was killed
    /// by one), or 128+signal when the agent itself was stopped by a signal.
    pub fn exit_code(&self) -> i32 {
        match self {
            RunOutcome::Succeeded { .. } => 0,
            RunOutcome::Failed { root_cause, .. } => match root_cause.exit.shell_code() {
                0 => 1,
                c => c,
            },
            RunOutcome::Interrupted { signal } => 128 + signal,
        }
    }
}

/// Something to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Elastic: serve a fresh workers' store and join the next round with it.
    Join,
    /// Start this node's workers (the previous ones are gone).
    StartWorkers(Placement),
    /// Open the round's snapshots, right before `StartWorkers` (snapshots on).
    BeginSnapshots(SnapshotRound),
    /// This node's workers of the round are gone: its snapshots and its progress end; with
    /// `flush_console`, what they printed is written out first (they were stopped).
    EndRound { flush_console: bool },
    /// Tell the workers that keep their process (all of this node's, but the failed ones in
    /// `failed`) that `round` ended: they end their collectives, destroy their process group
    /// and wait; answered by `WorkersParked`, or by nothing within `PARK_WITHIN` (then they are
    /// stopped as usual). The workers in `failed` (local indices) are gone: what they left
    /// running is killed, and they are not waited for.
    Park { round: u64, hosts: Vec<String>, failed: Vec<u32> },
    /// Hand the parked workers their environment for this placement: the same processes run
    /// the program's function again (in place of `StartWorkers`); the workers at the local
    /// indices in `fresh` (their own rank failed) are started anew in it.
    Resume { placement: Placement, fresh: Vec<u32> },
    /// Start the next set of warm workers, made for this placement (warm workers on).
    FillWarm(Placement),
    /// Stop the workers: `first` (SIGTERM; SIGINT when the agent got one, so that Python's
    /// `KeyboardInterrupt` runs), then SIGTERM, then SIGKILL after the grace; answered by
    /// `WorkersStopped`.
    StopWorkers { first: i32 },
    /// Take the running workers' stacks (with `--hang-timeout`) and tell the rendezvous where
    /// they stood when `round` ended by something elsewhere; comes right before `StopWorkers`.
    ShareStacks { round: u64 },
    /// Pass a signal on to every worker.
    Relay(i32),
    /// Long-poll the rendezvous for the end of `round`.
    Watch { round: u64 },
    /// Send a report; answered by `Reported`.
    Send(Report),
    /// Ask the rendezvous for the job's last root cause; answered by `RootCauseFetched`.
    FetchRootCause,
    /// Say something to the operator (the driver logs it as a warning).
    Note(String),
    /// The run is over.
    Exit(Outcome),
}

/// How the round's snapshots are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotRound {
    /// With the round's other members: each step committed by all, a copy at a buddy.
    Peers { round: u64, members: Vec<rlaunch::contract::Member> },
    /// On this node alone (one node, or no member list to agree by).
    Local { round: u64, world_size: u32, ranks: std::ops::Range<u32> },
}
