//! The agent's decisions, pure: [`Core::step`] takes one [`Event`] and the time, updates the
//! core's state and returns the [`Action`]s to carry out. No I/O, no clock reads, no async: the
//! driver (`driver.rs`) turns processes, signals and rendezvous calls into events and actions
//! into effects; tests drive the core with made-up clocks.
//!
//! One core runs every mode. A fixed membership (`--standalone`, `--rdzv-backend static`) is a
//! placement that never changes and a restart budget kept here; an elastic one joins rounds of
//! a rendezvous, which keeps the budget for the whole job.
//!
//! Invariants (checked after every step in the tests):
//! - workers are started only when none of this node's are running or stopping;
//! - a failed worker group is restarted only after the rendezvous acknowledged its failure
//!   report (elastic: the restart was counted, or the round had moved on anyway), or within the
//!   local budget (fixed); a refused report ends the run with the worker's exit;
//! - success, failure and leave reports are sent again until acknowledged or the job is known
//!   to be over, bounded by the join timeout (leave: by the node TTL, heartbeats lapse anyway);
//! - exactly one `Exit` ends a run, and nothing follows it.

use std::time::Duration;

use rlaunch::contract::{RootCause, RoundInfo};

mod events;
mod park;
mod placement;
mod signal;
pub use events::{
    Action, CallError, Cause, Event, Outcome, Report, ReportKind, RunOutcome, SnapshotRound, Watch, WorkersEnd,
};
pub use park::PARK_WITHIN;
pub use placement::Placement;

/// Milliseconds on the driver's monotonic clock (made-up numbers in tests).
pub type Millis = u64;

/// Extra silence tolerated past the node TTL before a node fences itself: an etcd leader
/// election (or a rendezvous replica failing over) stalls every request for a second or two
/// while leases survive it, and a healthy node must not stop its workers for that.
pub const ELECTION_ALLOWANCE: Duration = Duration::from_secs(2);
/// How long a node whose success was acknowledged keeps watching a rendezvous that no longer
/// answers before it ends (the job's end may have been missed while the rendezvous went away).
pub const UNREACHABLE_AFTER_SUCCESS: Duration = Duration::from_secs(10);
/// Delay before a failed join or watch is tried again.
pub const RETRY_DELAY: Duration = Duration::from_millis(300);
/// First and longest delay between tries of a report.
pub const REPORT_BACKOFF_FIRST: Duration = Duration::from_millis(200);
pub const REPORT_BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Longest a node whose ranks hung keeps them after announcing the hang, so that the other
/// nodes read where their ranks stand before the hung ranks' exit breaks their collectives.
pub const HANG_LINGER: Duration = Duration::from_secs(10);
/// How often a lingering node asks whether every rank's stack has reached the root cause.
pub const LINGER_POLL: Duration = Duration::from_millis(500);

/// How membership is decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// Standalone or static: the same placement on every attempt; the budget is this agent's.
    Fixed { placement: Placement, max_restarts: u32 },
    /// A rendezvous decides rounds and keeps the job-wide budget.
    Elastic { node_ttl: Duration, join_timeout: Duration },
}

/// What this node runs besides its workers, which the core's decisions take into account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features {
    /// Snapshots in the agents' memory (`--snapshot-memory` above 0, the store started).
    pub snapshots: bool,
    /// Warm workers (`--warm-workers`, a Python program).
    pub warm_workers: bool,
    /// Workers per node (`--nproc-per-node`).
    pub local_world_size: u32,
}

/// How long after a round's workers start the next set of warm workers is started: the imports
/// of a new set take seconds of CPU, which the round's first steps should not share.
pub const REFILL_AFTER: Duration = Duration::from_secs(2);

/// How a round keeps its snapshots, and what to tell the operator: with its members when the
/// membership is elastic and the round says who they are; otherwise on this node alone, and a
/// round of several nodes then keeps none it could restore across them (said once per round).
pub fn snapshot_round(p: &Placement, elastic: bool, local_world_size: u32) -> (SnapshotRound, Option<String>) {
    if elastic && p.group_world_size > 1 && !p.members.is_empty() {
        return (SnapshotRound::Peers { round: p.round, members: p.members.clone() }, None);
    }
    let note = (p.group_world_size > 1).then(|| {
        format!(
            "no snapshots in round {} of {} nodes: its nodes have no member list to agree on a step by (a static \
             job, a round of more than {} nodes, or an older rendezvous); `save` returns False",
            p.round,
            p.group_world_size,
            rlaunch::contract::MAX_SNAPSHOT_NODES
        )
    });
    let ranks = p.rank_offset..p.rank_offset.saturating_add(local_world_size);
    (SnapshotRound::Local { round: p.round, world_size: p.world_size, ranks }, note)
}

/// Whether this node's stacks are read and shared before its workers are stopped for a round
/// that ended elsewhere: only when that round ended by a failure (a node lost or a scale-up
/// pauses no worker for nothing). `failed_round` is the rendezvous' last failed round, `None`
/// when it could not say: then they are read anyway.
pub fn stacks_worth_sharing(round: u64, failed_round: Option<Option<u64>>) -> bool {
    match failed_round {
        Some(last) => last == Some(round),
        None => true,
    }
}

/// What to do once this node's workers are gone.
#[derive(Debug, Clone, PartialEq, Eq)]
enum AfterStop {
    /// Elastic: join the next round.
    Rejoin,
    /// Fixed: start the next attempt.
    Restart,
    /// Elastic: report this failure, then rejoin once it is acknowledged.
    ReportFailure(Box<RootCause>),
    /// Elastic: the job failed; end with its root cause.
    JobFailed(String),
    /// Elastic: leave the job, then end interrupted.
    Leave(i32),
    Exit(Outcome),
    /// Start this placement's workers (parked workers could not resume: one died).
    Start(Box<Placement>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Idle,
    /// Elastic: a join call is in flight (`retry_at`: waiting to send it again).
    Joining {
        retry_at: Option<Millis>,
    },
    /// Workers run (or, elastic, succeeded and the node waits for the job to end).
    Running {
        placement: Placement,
        succeeded: bool,
    },
    /// Elastic: the round ended (elsewhere, or by the failure of some of this node's workers)
    /// and every other worker of this node keeps its process (`rlaunch.resilient`): they were
    /// told (`Park`); until `until` the node waits for them to park, then joins the next round
    /// with them. `failure`: the failure of this node's own that ended the round, reported
    /// meanwhile (its workers are started anew in the next round).
    Parking {
        round: u64,
        until: Millis,
        failure: Option<Box<RootCause>>,
    },
    /// `StopWorkers` was sent.
    Stopping {
        round: u64,
        then: AfterStop,
    },
    /// Elastic, several nodes: this node's ranks hung; the failure was announced while they
    /// still run, so that every other node reads its ranks' stacks for the report before the
    /// hung ranks' exit breaks their collectives. Ends (the workers stopped, the failure
    /// reported as usual) once the root cause holds a stack for every rank, or at `until`.
    Lingering {
        round: u64,
        root_cause: Box<RootCause>,
        world_size: u32,
        until: Millis,
        /// When to ask for the root cause next; `None` while a fetch is in flight.
        poll_at: Option<Millis>,
    },
    /// The workers were stopped after one died of a stop signal that did not come from this
    /// agent (a scheduler or service manager signalling every process of the job: Slurm under
    /// proctrack/cgroup, systemd's control-group kill). The agent's own signal usually follows
    /// within milliseconds; until `until` the restart (or failure report) waits for it, so a
    /// job being stopped is not restarted first.
    Holding {
        round: u64,
        then: AfterStop,
        until: Millis,
    },
    /// Elastic: the failure report of a stopped group awaits its acknowledgement.
    ReportingFailure {
        round: u64,
        root_cause: Box<RootCause>,
    },
    /// Elastic: the job failed; waiting for its root cause.
    FetchingRootCause {
        reason: String,
    },
    /// Elastic: leaving after a stop signal.
    Leaving {
        signal: i32,
    },
    Done,
}

/// A report on its way, and when to send it again.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outbox {
    report: Report,
    first_sent: Millis,
    /// `None` while a send is in flight.
    retry_at: Option<Millis>,
    backoff: Duration,
    /// Give up past this time.
    deadline: Millis,
}

/// The agent's state: everything its decisions depend on.
#[derive(Debug, Clone)]
pub struct Core {
    membership: Membership,
    phase: Phase,
    outbox: Option<Outbox>,
    /// When the rendezvous last answered anything.
    last_contact: Millis,
    /// Elastic, while running: the watch waits to be sent again at this time.
    watch_retry_at: Option<Millis>,
    /// Elastic, after the success was acknowledged: since when the watch has been failing.
    unreachable_since: Option<Millis>,
    success_acked: bool,
    /// Restarts spent: this agent's (fixed) or the job's as of the last round (elastic).
    restarts: u32,
    /// The last failure of this node's workers.
    local_failure: Option<Box<RootCause>>,
    /// The rank (and signal) of a failure that was a death by a stop signal (not a hang
    /// verdict): the stop it causes holds before going on (`Phase::Holding`).
    killed_by: Option<(u32, i32)>,
    /// A worker process of this node may be alive (started and not yet seen gone).
    workers_alive: bool,
    /// When this node's current workers were started.
    started_at: Millis,
    /// The first signal a stop sends: the handled signal that stopped the job, else SIGTERM.
    stop_first: i32,
    /// The signals that stop the job and are forwarded first (`--signals-to-handle`).
    handled: Vec<i32>,
    /// Whether a join ever answered with a round (a job over before that is someone else's).
    ever_joined: bool,
    features: Features,
    /// When to start the next set of warm workers, and for which placement.
    refill_at: Option<(Millis, Placement)>,
    /// Which of this node's workers (local indices) keep their process across rounds
    /// (`rlaunch.resilient`).
    opted_in: Vec<u32>,
    /// Workers (local indices) whose own rank failed while the others kept their processes:
    /// started anew when the others resume.
    fresh: Vec<u32>,
    /// The round after which this node's workers parked: alive, waiting for the next round.
    parked: Option<u64>,
    /// A parked worker ended while the node joined: the others are stopped, not resumed.
    park_broken: bool,
}

fn ms(d: Duration) -> Millis {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// torchrun's `--signals-to-handle` default: these stop the job, forwarded to the workers first.
pub const DEFAULT_HANDLED_SIGNALS: [i32; 4] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT];

/// Whether the agent can stop on `signal`: not one that cannot be caught (SIGKILL, SIGSTOP),
/// one the kernel sends for a fault of the agent itself (SIGSEGV and the like), one that is the
/// agent's own business (SIGCHLD; SIGTTIN/SIGTTOU, which it ignores on a terminal).
pub fn can_handle(signal: i32) -> bool {
    !matches!(
        signal,
        libc::SIGKILL
            | libc::SIGSTOP
            | libc::SIGILL
            | libc::SIGTRAP
            | libc::SIGABRT
            | libc::SIGBUS
            | libc::SIGFPE
            | libc::SIGSEGV
            | libc::SIGCHLD
            | libc::SIGTTIN
            | libc::SIGTTOU
    )
}

/// Signals that stop the job whether handled or not, so that nothing of it is left running;
/// the others (SIGUSR1, SIGUSR2) are relayed to the workers unless handled.
/// How long a restart waits, after a worker died of a stop signal the agent did not send, for
/// the agent's own (see `Phase::Holding`).
pub const STOP_SIGNAL_HOLD: Duration = Duration::from_millis(500);

pub fn is_stop_signal(signal: i32) -> bool {
    DEFAULT_HANDLED_SIGNALS.contains(&signal)
}

impl Core {
    /// The signals that stop the job and reach the workers first (`--signals-to-handle`);
    /// SIGTERM, SIGINT, SIGHUP and SIGQUIT stop it even when not listed.
    pub fn with_handled_signals(mut self, handled: &[i32]) -> Core {
        self.handled = handled.to_vec();
        self
    }

    pub fn new(membership: Membership) -> Core {
        Core {
            membership,
            phase: Phase::Idle,
            outbox: None,
            last_contact: 0,
            watch_retry_at: None,
            unreachable_since: None,
            success_acked: false,
            restarts: 0,
            local_failure: None,
            killed_by: None,
            workers_alive: false,
            started_at: 0,
            stop_first: libc::SIGTERM,
            handled: DEFAULT_HANDLED_SIGNALS.to_vec(),
            ever_joined: false,
            features: Features::default(),
            refill_at: None,
            opted_in: Vec::new(),
            fresh: Vec::new(),
            parked: None,
            park_broken: false,
        }
    }

    /// What this node runs besides its workers (snapshots, warm workers).
    pub fn with_features(mut self, features: Features) -> Core {
        self.features = features;
        self
    }

    /// Whether the run is over.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Whether a worker process of this node may be alive.
    pub fn workers_alive(&self) -> bool {
        self.workers_alive
    }

    fn elastic(&self) -> Option<(Duration, Duration)> {
        match self.membership {
            Membership::Elastic { node_ttl, join_timeout } => Some((node_ttl, join_timeout)),
            Membership::Fixed { .. } => None,
        }
    }

    fn join_timeout(&self) -> Duration {
        self.elastic().map(|(_, j)| j).unwrap_or(Duration::MAX)
    }

    /// Applies one event at time `now`; returns what to do, in order.
    pub fn step(&mut self, event: Event, now: Millis) -> Vec<Action> {
        if self.phase == Phase::Done {
            return Vec::new();
        }
        let mut out = Vec::new();
        if Self::is_contact(&event) {
            self.last_contact = self.last_contact.max(now);
        }
        // (Not when some of this node's workers failed and the others keep their processes: their
        // round's snapshots stay open until the next begins, as when a round ends elsewhere.)
        let keeps = matches!(&event, Event::WorkersEnded(WorkersEnd::Failed(rc)) if self.keeps_others(rc));
        if matches!(event, Event::WorkersStopped | Event::WorkersEnded(_)) && !keeps {
            out.push(Action::EndRound { flush_console: event == Event::WorkersStopped });
        }
        match event {
            Event::Start => self.on_start(now, &mut out),
            Event::Joined(answer) => self.on_joined(answer, now, &mut out),
            Event::WorkersEnded(end) => self.on_workers_ended(end, now, &mut out),
            Event::WorkersStopped => self.on_workers_stopped(now, &mut out),
            Event::Watched { round, answer } => self.on_watched(round, answer, now, &mut out),
            Event::Reported { kind, result } => self.on_reported(kind, result, now, &mut out),
            Event::Heartbeat(result) => self.on_heartbeat(result, now, &mut out),
            Event::RootCauseFetched(rc, round) => self.on_root_cause(rc, round, now, &mut out),
            Event::Signal(sig) => self.on_signal(sig, now, &mut out),
            Event::OptedIn(ranks) => self.opted_in = ranks,
            Event::WorkersParked => self.on_parked(&mut out),
            Event::Tick => self.on_tick(now, &mut out),
        }
        if let Some((at, _)) = &self.refill_at {
            if *at <= now {
                let (_, placement) = self.refill_at.take().expect("just matched");
                // Not for a run on its way out: a set of interpreters importing torch while
                // the agent leaves, or ends, is work for nothing.
                if self.may_start_again() {
                    out.push(Action::FillWarm(placement));
                }
            }
        }
        out
    }

    /// Whether this run may start workers again (a refill of warm workers is for that).
    fn may_start_again(&self) -> bool {
        match &self.phase {
            Phase::Leaving { .. } | Phase::FetchingRootCause { .. } | Phase::Done => false,
            Phase::Stopping { then, .. } | Phase::Holding { then, .. } => {
                !matches!(then, AfterStop::Leave(_) | AfterStop::JobFailed(_) | AfterStop::Exit(_))
            }
            _ => true,
        }
    }

    /// Any answer from the rendezvous, even a refusal, proves it reachable.
    fn is_contact(event: &Event) -> bool {
        let answered = |e: &CallError| !matches!(e, CallError::Transient(_));
        match event {
            Event::Joined(r) => r.as_ref().err().is_none_or(answered),
            Event::Watched { answer, .. } => answer.as_ref().err().is_none_or(answered),
            Event::Reported { result, .. } | Event::Heartbeat(result) => result.as_ref().err().is_none_or(answered),
            _ => false,
        }
    }

    fn exit(&mut self, outcome: Outcome, out: &mut Vec<Action>) {
        let parking = match self.phase {
            Phase::Parking { round, .. } => Some(round),
            _ => None,
        };
        if let Some(round) = self.parked.take().or(parking) {
            // Parked workers are alive: nothing of the job is left running.
            self.stop_workers(round, AfterStop::Exit(outcome), out);
            return;
        }
        self.phase = Phase::Done;
        self.outbox = None;
        out.push(Action::Exit(outcome));
    }

    /// Starts the placement's workers, or hands it to the parked ones.
    fn start_workers(&mut self, placement: Placement, now: Millis, out: &mut Vec<Action>) {
        let resume = self.parked.take().is_some();
        debug_assert!(resume || !self.workers_alive, "workers are started only once the previous ones are gone");
        let fresh = std::mem::take(&mut self.fresh);
        if resume {
            self.opted_in.retain(|i| !fresh.contains(i)); // their processes are new
        } else {
            self.opted_in.clear(); // new processes opt in anew
        }
        self.workers_alive = true;
        self.started_at = now;
        self.success_acked = false;
        self.unreachable_since = None;
        if self.features.snapshots {
            let (snapshots, note) =
                snapshot_round(&placement, self.elastic().is_some(), self.features.local_world_size);
            out.extend(note.map(Action::Note));
            out.push(Action::BeginSnapshots(snapshots));
        }
        out.push(if resume {
            Action::Resume { placement: placement.clone(), fresh }
        } else {
            Action::StartWorkers(placement.clone())
        });
        if self.features.warm_workers {
            self.refill_at = Some((now.saturating_add(ms(REFILL_AFTER)), placement.clone()));
        }
        if self.elastic().is_some() {
            self.watch_retry_at = None;
            out.push(Action::Watch { round: placement.round });
        }
        self.phase = Phase::Running { placement, succeeded: false };
    }

    fn join(&mut self, out: &mut Vec<Action>) {
        self.phase = Phase::Joining { retry_at: None };
        out.push(Action::Join);
    }

    fn stop_workers(&mut self, round: u64, then: AfterStop, out: &mut Vec<Action>) {
        self.outbox = None;
        self.fresh.clear(); // every worker starts anew
        self.phase = Phase::Stopping { round, then };
        out.push(Action::StopWorkers { first: self.stop_first });
    }

    fn send(&mut self, report: Report, now: Millis, deadline: Millis, out: &mut Vec<Action>) {
        self.outbox = Some(Outbox {
            report: report.clone(),
            first_sent: now,
            retry_at: None,
            backoff: REPORT_BACKOFF_FIRST,
            deadline,
        });
        out.push(Action::Send(report));
    }

    /// Leaves the job when no worker runs; elastic nodes tell the rendezvous first.
    fn leave(&mut self, signal: i32, now: Millis, out: &mut Vec<Action>) {
        match self.elastic() {
            Some((ttl, _)) => {
                self.phase = Phase::Leaving { signal };
                self.send(Report::Leave, now, now.saturating_add(ms(ttl)), out);
            }
            None => self.exit(Outcome::Run(RunOutcome::Interrupted { signal }), out),
        }
    }

    fn job_failed(&mut self, reason: String, out: &mut Vec<Action>) {
        self.phase = Phase::FetchingRootCause { reason };
        out.push(Action::FetchRootCause);
    }

    fn on_start(&mut self, now: Millis, out: &mut Vec<Action>) {
        if self.phase != Phase::Idle {
            return;
        }
        self.last_contact = now;
        match self.membership.clone() {
            Membership::Fixed { placement, .. } => self.start_workers(placement, now, out),
            Membership::Elastic { .. } => self.join(out),
        }
    }

    fn on_joined(&mut self, answer: Result<RoundInfo, CallError>, now: Millis, out: &mut Vec<Action>) {
        if self.phase != (Phase::Joining { retry_at: None }) {
            return; // an answer to a join this node gave up on (it is leaving)
        }
        match answer {
            Ok(round) => {
                self.ever_joined = true;
                self.restarts = round.restart_count;
                self.joined(Placement::from_round(&round), now, out);
            }
            Err(CallError::Transient(e)) => {
                let silent = now.saturating_sub(self.last_contact);
                if silent >= ms(self.join_timeout()) {
                    let message = format!(
                        "the rendezvous has been unreachable for the whole join timeout ({:?}): {e}",
                        self.join_timeout()
                    );
                    self.exit(Outcome::Rendezvous { message, source: Some(e) }, out);
                } else {
                    out.push(Action::Note(format!("cannot reach the rendezvous ({e}); joining again")));
                    self.phase = Phase::Joining { retry_at: Some(now.saturating_add(ms(RETRY_DELAY))) };
                }
            }
            // Over before this node ever ran in it: a run id used again (a second `srun` of one
            // Slurm job, a re-created Kubernetes job), never this run's success.
            Err(CallError::JobFinished) if !self.ever_joined => {
                let message = "the job with this run id has already finished; give this run its own --rdzv-id".into();
                self.exit(Outcome::Rendezvous { message, source: None }, out);
            }
            Err(CallError::JobFailed(reason)) if !self.ever_joined => {
                let message =
                    format!("the job with this run id has already failed ({reason}); give this run its own --rdzv-id");
                self.exit(Outcome::Rendezvous { message, source: None }, out);
            }
            Err(CallError::JobFinished) => {
                let restarts = self.restarts;
                self.exit(Outcome::Run(RunOutcome::Succeeded { restarts }), out);
            }
            Err(CallError::JobFailed(reason)) => self.job_failed(reason, out),
            Err(CallError::NotMember) => self.join(out),
            Err(CallError::Refused(e)) => {
                let message = format!("the rendezvous refused the join: {e}");
                self.exit(Outcome::Rendezvous { message, source: Some(e) }, out)
            }
        }
    }

    fn on_workers_ended(&mut self, end: WorkersEnd, now: Millis, out: &mut Vec<Action>) {
        let Phase::Running { placement, succeeded: false } = &self.phase else {
            if self.parked_worker_ended(&end, out) {
                return;
            }
            // Already stopping them for another reason: the stop decides what comes next.
            if let WorkersEnd::Failed(rc) | WorkersEnd::Hung(rc) = end {
                self.local_failure = Some(rc);
            }
            return;
        };
        let placement = placement.clone();
        // A death by a stop signal (a hang verdict's cause says SIGTERM too, but is no death).
        let killed_by = match &end {
            WorkersEnd::Failed(rc) => match rc.exit {
                rlaunch::contract::Exit::Signal(sig) if is_stop_signal(sig) => Some((rc.rank, sig)),
                _ => None,
            },
            _ => None,
        };
        match end {
            WorkersEnd::Succeeded => {
                self.workers_alive = false;
                match &self.membership {
                    Membership::Fixed { .. } => {
                        let restarts = self.restarts;
                        self.exit(Outcome::Run(RunOutcome::Succeeded { restarts }), out);
                    }
                    Membership::Elastic { .. } => {
                        self.phase = Phase::Running { placement: placement.clone(), succeeded: true };
                        let deadline = now.saturating_add(ms(self.join_timeout()));
                        self.send(Report::Success { round: placement.round }, now, deadline, out);
                    }
                }
            }
            WorkersEnd::Hung(rc) if self.elastic().is_some() && placement.group_world_size > 1 => {
                self.local_failure = Some(rc.clone());
                // Announced now, not in the outbox: the report after the stop is the one that
                // counts (the rendezvous takes the same round's failure once).
                out.push(Action::Send(Report::Failure { round: placement.round, root_cause: Box::new(rc.bounded()) }));
                self.phase = Phase::Lingering {
                    round: placement.round,
                    root_cause: rc,
                    world_size: placement.world_size,
                    until: now.saturating_add(ms(HANG_LINGER)),
                    poll_at: Some(now.saturating_add(ms(LINGER_POLL))),
                };
            }
            WorkersEnd::Failed(rc) if self.keeps_others(&rc) => {
                self.keep_all_but_failed(&placement, rc, now, out);
            }
            WorkersEnd::Failed(rc) | WorkersEnd::Hung(rc) => {
                self.killed_by = killed_by;
                self.local_failure = Some(rc.clone());
                let then = match &self.membership {
                    Membership::Fixed { max_restarts, .. } if self.restarts < *max_restarts => AfterStop::Restart,
                    Membership::Fixed { .. } => {
                        AfterStop::Exit(Outcome::Run(RunOutcome::Failed { root_cause: rc, restarts: self.restarts }))
                    }
                    Membership::Elastic { .. } => AfterStop::ReportFailure(rc),
                };
                self.stop_workers(placement.round, then, out);
            }
        }
    }

    fn on_workers_stopped(&mut self, now: Millis, out: &mut Vec<Action>) {
        let Phase::Stopping { round, then } = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return;
        };
        self.workers_alive = false;
        let killed_by = self.killed_by.take();
        if let (AfterStop::Restart | AfterStop::ReportFailure(_), Some((rank, sig))) = (&then, killed_by) {
            out.push(Action::Note(format!(
                "rank {rank} died of {} that this agent did not send; waiting {STOP_SIGNAL_HOLD:?} for a stop signal \
                 of the agent's own before going on",
                rlaunch::contract::signal_name(sig)
            )));
            self.phase = Phase::Holding { round, then, until: now.saturating_add(ms(STOP_SIGNAL_HOLD)) };
            return;
        }
        self.after_stop(round, then, now, out);
    }

    /// What comes once the workers are stopped.
    fn after_stop(&mut self, round: u64, then: AfterStop, now: Millis, out: &mut Vec<Action>) {
        match then {
            AfterStop::Rejoin => self.join(out),
            AfterStop::Restart => {
                let Membership::Fixed { placement, max_restarts } = &self.membership else {
                    unreachable!("only fixed memberships restart locally")
                };
                self.restarts += 1;
                out.push(Action::Note(format!("worker group failed; restart {} of {max_restarts}", self.restarts)));
                let placement = Placement {
                    round: placement.round + u64::from(self.restarts),
                    restart_count: self.restarts,
                    ..placement.clone()
                };
                self.start_workers(placement, now, out);
            }
            AfterStop::ReportFailure(rc) => {
                self.phase = Phase::ReportingFailure { round, root_cause: rc.clone() };
                let deadline = now.saturating_add(ms(self.join_timeout()));
                self.send(Report::Failure { round, root_cause: Box::new(rc.bounded()) }, now, deadline, out);
            }
            AfterStop::JobFailed(reason) => self.job_failed(reason, out),
            AfterStop::Leave(signal) => self.leave(signal, now, out),
            AfterStop::Exit(outcome) => self.exit(outcome, out),
            AfterStop::Start(placement) => self.start_workers(*placement, now, out),
        }
    }

    fn on_watched(&mut self, round: u64, answer: Result<Watch, CallError>, now: Millis, out: &mut Vec<Action>) {
        let (placement, succeeded) = match &self.phase {
            Phase::Running { placement, succeeded } if placement.round == round => (placement.clone(), *succeeded),
            _ => return, // a watch of a round this node has moved past
        };
        match answer {
            Ok(Watch::NoChange) => {
                self.unreachable_since = None;
                out.push(Action::Watch { round });
            }
            Ok(Watch::NewRound(n)) if !succeeded && self.can_park() => {
                out.push(Action::Note(format!("the job is re-forming (round {n}); the workers keep their processes")));
                // Where they stood, for a hang report elsewhere, before they are told.
                out.push(Action::ShareStacks { round });
                self.park(&placement, now, out);
            }
            Ok(Watch::NewRound(n)) => {
                out.push(Action::Note(format!("the job is re-forming (round {n}); stopping workers and rejoining")));
                if !succeeded {
                    out.push(Action::ShareStacks { round });
                }
                self.rejoin(round, succeeded, out);
            }
            Ok(Watch::Finished) | Err(CallError::JobFinished) => {
                let outcome = Outcome::Run(RunOutcome::Succeeded { restarts: placement.restart_count });
                if succeeded {
                    self.exit(outcome, out);
                } else {
                    self.stop_workers(round, AfterStop::Exit(outcome), out);
                }
            }
            Ok(Watch::Failed(reason)) | Err(CallError::JobFailed(reason)) => {
                if succeeded {
                    self.job_failed(reason, out);
                } else {
                    out.push(Action::ShareStacks { round });
                    self.stop_workers(round, AfterStop::JobFailed(reason), out);
                }
            }
            Err(CallError::NotMember) if !succeeded && self.can_park() => {
                out.push(Action::Note(
                    "the rendezvous declared this node lost; the workers keep their processes".into(),
                ));
                self.park(&placement, now, out);
            }
            Err(CallError::NotMember) => {
                out.push(Action::Note("the rendezvous declared this node lost; stopping workers and rejoining".into()));
                self.rejoin(round, succeeded, out);
            }
            Err(CallError::Transient(e)) | Err(CallError::Refused(e)) => {
                // A rendezvous that cannot be reached is not a reason to stop healthy workers:
                // heartbeats and fencing decide that. Once this node's success is acknowledged
                // there is nothing left to wait for but the job's end.
                let since = *self.unreachable_since.get_or_insert(now);
                if succeeded && self.success_acked && now.saturating_sub(since) >= ms(UNREACHABLE_AFTER_SUCCESS) {
                    out.push(Action::Note(format!(
                        "the rendezvous no longer answers ({e}) and this node's success was acknowledged; exiting"
                    )));
                    self.exit(Outcome::Run(RunOutcome::Succeeded { restarts: placement.restart_count }), out);
                } else {
                    self.watch_retry_at = Some(now.saturating_add(ms(RETRY_DELAY)));
                }
            }
        }
    }

    fn rejoin(&mut self, round: u64, succeeded: bool, out: &mut Vec<Action>) {
        if succeeded {
            self.outbox = None;
            self.join(out);
        } else {
            self.stop_workers(round, AfterStop::Rejoin, out);
        }
    }

    fn on_reported(&mut self, kind: ReportKind, result: Result<(), CallError>, now: Millis, out: &mut Vec<Action>) {
        let Some(outbox) = &self.outbox else { return };
        if outbox.report.kind() != kind || outbox.retry_at.is_some() {
            return; // an answer to a report this node no longer sends
        }
        let report = outbox.report.clone();
        match result {
            Ok(()) => {
                self.outbox = None;
                self.acknowledged(report, out);
            }
            Err(CallError::Transient(e)) => {
                let outbox = self.outbox.as_mut().expect("checked above");
                if now >= outbox.deadline {
                    let waited = now.saturating_sub(outbox.first_sent);
                    self.outbox = None;
                    self.undeliverable(report, format!("no answer for {waited} ms ({e})"), Some(e), out);
                } else {
                    outbox.retry_at = Some(now.saturating_add(ms(outbox.backoff)));
                    outbox.backoff = (outbox.backoff * 2).min(REPORT_BACKOFF_MAX);
                }
            }
            Err(CallError::NotMember) => {
                self.outbox = None;
                match report {
                    // The others still park: the node joins once they did.
                    Report::Failure { .. } if matches!(self.phase, Phase::Parking { .. }) => {}
                    // The round this node reported on is gone (declared lost, or re-formed):
                    // nothing was counted against the budget; join the next one.
                    Report::Failure { .. } => self.join(out),
                    // The watch tells what became of the round.
                    Report::Success { .. } => {}
                    Report::Leave => self.acknowledged(report, out),
                }
            }
            Err(CallError::JobFinished) => {
                self.outbox = None;
                match report {
                    Report::Failure { .. } => self.end_with_local_failure(None, out),
                    _ => {
                        let restarts = self.restarts;
                        match report {
                            Report::Leave => self.acknowledged(report, out),
                            _ => self.exit(Outcome::Run(RunOutcome::Succeeded { restarts }), out),
                        }
                    }
                }
            }
            Err(CallError::JobFailed(reason)) => {
                self.outbox = None;
                match report {
                    Report::Leave => self.acknowledged(report, out),
                    _ => match self.phase {
                        // Workers that were parking are stopped before the root cause is fetched.
                        Phase::Parking { round, .. } => self.stop_workers(round, AfterStop::JobFailed(reason), out),
                        _ => self.job_failed(reason, out),
                    },
                }
            }
            Err(CallError::Refused(e)) => {
                self.outbox = None;
                self.undeliverable(report, format!("refused: {e}"), Some(e), out);
            }
        }
    }

    fn acknowledged(&mut self, report: Report, out: &mut Vec<Action>) {
        match report {
            Report::Success { .. } => self.success_acked = true,
            // Counted once for the round in the job's budget (or the round had already moved
            // on): the next round starts the workers again.
            Report::Failure { .. } => {
                if matches!(self.phase, Phase::ReportingFailure { .. }) {
                    self.join(out);
                }
            }
            Report::Leave => {
                let Phase::Leaving { signal } = self.phase else { return };
                self.exit(Outcome::Run(RunOutcome::Interrupted { signal }), out);
            }
        }
    }

    /// A report that can never arrive: the run ends with what this node knows.
    fn undeliverable(&mut self, report: Report, why: String, source: Option<Cause>, out: &mut Vec<Action>) {
        match report {
            Report::Failure { .. } => {
                self.end_with_local_failure(Some(format!("the failure report could not be delivered ({why})")), out)
            }
            Report::Success { .. } => {
                let message =
                    format!("this node's workers succeeded, but the rendezvous did not take the report ({why})");
                self.exit(Outcome::Rendezvous { message, source }, out);
            }
            Report::Leave => {
                out.push(Action::Note(format!("could not leave the job ({why}); its heartbeats lapse instead")));
                let Phase::Leaving { signal } = self.phase else { return };
                self.exit(Outcome::Run(RunOutcome::Interrupted { signal }), out);
            }
        }
    }

    /// Ends with this node's own failure: its workers are never restarted for a failure the
    /// job's budget did not count.
    fn end_with_local_failure(&mut self, note: Option<String>, out: &mut Vec<Action>) {
        if let Some(n) = note {
            out.push(Action::Note(format!("{n}; ending with this node's failure")));
        }
        match self.local_failure.clone() {
            Some(root_cause) => {
                let restarts = self.restarts;
                self.exit(Outcome::Run(RunOutcome::Failed { root_cause, restarts }), out);
            }
            None => self
                .exit(Outcome::Rendezvous { message: "the job ended without a root cause".into(), source: None }, out),
        }
    }

    fn on_heartbeat(&mut self, result: Result<(), CallError>, now: Millis, out: &mut Vec<Action>) {
        if result != Err(CallError::NotMember) {
            return;
        }
        // A heartbeat sent before this node's join registered can be answered after it: within
        // a TTL of the start, the watch (which knows the round) decides instead.
        let ttl = self.elastic().map(|(ttl, _)| ms(ttl)).unwrap_or(0);
        if now.saturating_sub(self.started_at) < ttl {
            return;
        }
        if let Phase::Running { placement, succeeded: false } = &self.phase {
            let round = placement.round;
            out.push(Action::Note(
                "the rendezvous no longer knows this node (declared lost); stopping workers and rejoining".into(),
            ));
            self.stop_workers(round, AfterStop::Rejoin, out);
        }
    }

    fn on_root_cause(
        &mut self,
        rc: Option<Box<RootCause>>,
        failure_round: Option<u64>,
        now: Millis,
        out: &mut Vec<Action>,
    ) {
        if let Phase::Lingering { round, root_cause, world_size, poll_at, .. } = &mut self.phase {
            // Only this round's report counts (an earlier round's may name every rank too).
            let covered = match rc.as_deref() {
                Some(rc) if failure_round == Some(*round) => rlaunch::stacks::ranks_named(&rc.stacks),
                _ => 0,
            };
            if covered >= u64::from(*world_size) {
                let (round, rc) = (*round, root_cause.clone());
                self.stop_workers(round, AfterStop::ReportFailure(rc), out);
            } else {
                *poll_at = Some(now.saturating_add(ms(LINGER_POLL)));
            }
            return;
        }
        let Phase::FetchingRootCause { reason } = &self.phase else { return };
        let reason = reason.clone();
        match rc.or_else(|| self.local_failure.clone()) {
            Some(root_cause) => {
                let restarts = root_cause.restart_count.max(self.restarts);
                self.exit(Outcome::Run(RunOutcome::Failed { root_cause, restarts }), out);
            }
            None => self.exit(Outcome::Rendezvous { message: format!("the job failed: {reason}"), source: None }, out),
        }
    }

    fn on_tick(&mut self, now: Millis, out: &mut Vec<Action>) {
        self.parking_tick(now, out);
        if matches!(self.phase, Phase::Holding { until, .. } if now >= until) {
            if let Phase::Holding { round, then, .. } = std::mem::replace(&mut self.phase, Phase::Idle) {
                self.after_stop(round, then, now, out);
            }
        }
        // Reports due again.
        if let Some(outbox) = &mut self.outbox {
            if outbox.retry_at.is_some_and(|t| now >= t) {
                outbox.retry_at = None;
                out.push(Action::Send(outbox.report.clone()));
            }
        }
        if let Phase::Lingering { round, root_cause, until, poll_at, .. } = &mut self.phase {
            if now >= *until {
                let (round, rc) = (*round, root_cause.clone());
                out.push(Action::Note(format!(
                    "not every rank's stack reached the report within {HANG_LINGER:?}; stopping the hung workers"
                )));
                self.stop_workers(round, AfterStop::ReportFailure(rc), out);
            } else if poll_at.is_some_and(|t| now >= t) {
                *poll_at = None;
                out.push(Action::FetchRootCause);
            }
            return;
        }
        match &self.phase {
            Phase::Joining { retry_at: Some(t) } if now >= *t => {
                self.phase = Phase::Joining { retry_at: None };
                out.push(Action::Join);
            }
            Phase::Running { placement, succeeded } => {
                let round = placement.round;
                if let Some((ttl, _)) = self.elastic() {
                    // Cut off for longer than the TTL: the rendezvous has declared this node lost
                    // and given its ranks to others. Its workers must not go on (a second rank 0
                    // writing checkpoints would be split brain).
                    let silent = now.saturating_sub(self.last_contact);
                    if !*succeeded && silent > ms(ttl + ELECTION_ALLOWANCE) {
                        out.push(Action::Note(format!(
                            "no contact with the rendezvous for {silent} ms, longer than the node TTL; stopping workers"
                        )));
                        self.stop_workers(round, AfterStop::Rejoin, out);
                        return;
                    }
                    if self.watch_retry_at.is_some_and(|t| now >= t) {
                        self.watch_retry_at = None;
                        out.push(Action::Watch { round });
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests;
