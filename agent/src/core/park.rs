//! Workers that keep their process across rounds (`rlaunch.resilient`).
//!
//! When a round ends elsewhere (a node lost or joining, a worker failing on another node) and
//! every worker of this node opted in, the node does not stop them: it tells them the round
//! ended (`Park`), waits for all of them to end their collectives (`WorkersParked`), joins the
//! next round and hands them its environment (`Resume`). A worker that does not park within
//! [`PARK_WITHIN`], or one that ends while parked, and the node's workers are stopped and
//! started as they are without it. Any end of the run while workers are parked stops them
//! first (`Core::exit`).
//!
//! A worker of this node that fails while every other worker of the node opted in costs the
//! others nothing either: they park as above while the failure is reported (the job's restart
//! budget counts it, as any failure), and in the next round they resume while the failed
//! worker alone is started anew (`Resume::fresh`). A worker killed by a stop signal the agent did
//! not send (a scheduler stopping the job) goes the usual way: the whole group stops.

use std::time::Duration;

use super::{ms, Action, AfterStop, Core, Millis, Phase, Placement, Report, RootCause, WorkersEnd};

/// How long the workers told that their round ended have to park: a worker notices within its
/// step (its next collective fails at once); one computing for longer, or stuck, is stopped.
pub const PARK_WITHIN: Duration = Duration::from_secs(10);

impl Core {
    /// Whether this node's workers keep their processes at the end of the round: an elastic
    /// job, workers running, and every one of them opted in.
    pub(super) fn can_park(&self) -> bool {
        self.elastic().is_some()
            && self.workers_alive
            && self.features.local_world_size > 0
            && (0..self.features.local_world_size).all(|i| self.opted_in.contains(&i))
    }

    /// The local indices of the workers a failure names (its worker and those that failed with
    /// it), as the group filled them in (`local_rank`: the worker's index in the node's group,
    /// whatever `--virtual-local-rank` shows it; never derived from a global rank, which a
    /// report made as the ranks moved may hold from the last round).
    fn failed_indices(rc: &RootCause) -> Vec<u32> {
        let mut failed = Vec::new();
        for index in std::iter::once(rc.local_rank).chain(rc.other_failures.iter().map(|o| o.local_rank)) {
            if !failed.contains(&index) {
                failed.push(index);
            }
        }
        failed
    }

    /// Whether this failure of running workers leaves the node's other workers their
    /// processes: not a death by a stop signal the agent did not send (a scheduler stopping the
    /// job: the group stops as before), and [`Core::can_keep_all_but`].
    pub(super) fn keeps_others(&self, rc: &RootCause) -> bool {
        let stop_signal = matches!(rc.exit, rlaunch::contract::Exit::Signal(sig) if super::is_stop_signal(sig));
        matches!(self.phase, Phase::Running { succeeded: false, .. }) && !stop_signal && self.can_keep_all_but(rc)
    }

    /// Whether, after this failure, every other worker of the node keeps its process: an
    /// elastic job, at least one worker left, and each one left opted in.
    fn can_keep_all_but(&self, rc: &RootCause) -> bool {
        let n = self.features.local_world_size;
        let failed = Self::failed_indices(rc);
        self.elastic().is_some()
            && failed.iter().all(|i| *i < n)
            && failed.len() < n as usize
            && (0..n).filter(|i| !failed.contains(i)).all(|i| self.opted_in.contains(&i))
    }

    /// Some of this node's workers failed and every other one opted in: the others park, the
    /// failure is reported at once (the other nodes learn of it as soon as they would otherwise),
    /// and the failed workers are started anew when the others resume.
    pub(super) fn keep_all_but_failed(
        &mut self,
        placement: &Placement,
        rc: Box<RootCause>,
        now: Millis,
        out: &mut Vec<Action>,
    ) {
        let failed = Self::failed_indices(&rc);
        out.push(Action::Note(format!(
            "rank {} failed; this node's other workers keep their processes, and the failed ones start anew in the \
             next round",
            rc.rank
        )));
        self.local_failure = Some(rc.clone());
        self.park_without(placement, failed.clone(), Some(rc.clone()), now, out);
        self.fresh = failed;
        let deadline = now.saturating_add(ms(self.join_timeout()));
        self.send(Report::Failure { round: placement.round, root_cause: Box::new(rc.bounded()) }, now, deadline, out);
    }

    /// What a stop of workers that were parking leads to: the failure that ended the round,
    /// when it was this node's, is reported (again: the rendezvous counts a round's failure
    /// once), else the node rejoins.
    fn after_failed_parking(&self) -> AfterStop {
        match &self.phase {
            Phase::Parking { failure: Some(rc), .. } => AfterStop::ReportFailure(rc.clone()),
            _ => AfterStop::Rejoin,
        }
    }

    /// The round of `placement` ended elsewhere: tell the workers, with the round's hosts (their
    /// connections to those hosts are what a gloo collective waits on).
    pub(super) fn park(&mut self, placement: &Placement, now: Millis, out: &mut Vec<Action>) {
        self.park_without(placement, Vec::new(), None, now, out);
    }

    /// [`Core::park`], but for the workers at the local indices `failed`, which are gone, by
    /// `failure` (this node's own, reported while the others park).
    fn park_without(
        &mut self,
        placement: &Placement,
        failed: Vec<u32>,
        failure: Option<Box<RootCause>>,
        now: Millis,
        out: &mut Vec<Action>,
    ) {
        let mut hosts: Vec<String> = placement.members.iter().map(|m| m.store_addr.host().to_owned()).collect();
        hosts.extend(placement.master.iter().map(|m| m.host().to_owned()));
        hosts.sort();
        hosts.dedup();
        self.outbox = None;
        // The round's snapshots stay open until the next begins: a save racing the word must
        // not wait for a round that comes only once every worker parked. The workers refuse
        // their own saves from the word on (`rlaunch.snapshot.save` answers False), so a step
        // "completed" on the garbage of an aborted NCCL reduction never commits.
        out.push(Action::Park { round: placement.round, hosts, failed });
        self.phase = Phase::Parking { round: placement.round, until: now.saturating_add(ms(PARK_WITHIN)), failure };
    }

    /// Every worker parked: join the next round with them.
    pub(super) fn on_parked(&mut self, out: &mut Vec<Action>) {
        let Phase::Parking { round, failure, .. } = std::mem::replace(&mut self.phase, Phase::Idle) else { return };
        self.parked = Some(round);
        self.park_broken = false;
        match failure {
            // This node's failure is still on its way: the node joins once it is counted.
            Some(root_cause) if self.outbox.is_some() => self.phase = Phase::ReportingFailure { round, root_cause },
            _ => self.join(out),
        }
    }

    /// A workers' end outside `Running`: handled here when it concerns parking or parked
    /// workers (returns true).
    pub(super) fn parked_worker_ended(&mut self, end: &WorkersEnd, out: &mut Vec<Action>) -> bool {
        if let Phase::Parking { round, failure, .. } = &self.phase {
            let (round, own_failure) = (*round, failure.is_some());
            if let WorkersEnd::Failed(rc) | WorkersEnd::Hung(rc) = end {
                if !own_failure {
                    self.local_failure = Some(rc.clone());
                }
            }
            match end {
                // Every worker finished its function while the round ended: nothing to keep.
                WorkersEnd::Succeeded if !own_failure => {
                    self.workers_alive = false;
                    self.join(out);
                }
                _ => {
                    out.push(Action::Note(
                        "a worker ended while the others parked; stopping this node's workers and rejoining".into(),
                    ));
                    let then = self.after_failed_parking();
                    self.stop_workers(round, then, out);
                }
            }
            return true;
        }
        if self.parked.is_some() {
            if let WorkersEnd::Failed(rc) | WorkersEnd::Hung(rc) = end {
                self.local_failure = Some(rc.clone());
            }
            if *end == WorkersEnd::Succeeded {
                // No process of the group is left (a parked worker that exits 0 is a program
                // that ended its function's loop by itself).
                self.workers_alive = false;
                self.parked = None;
            } else {
                self.park_broken = true;
            }
            return true;
        }
        false
    }

    /// A closed round: resume the parked workers in it, or (one ended while parked) stop the
    /// others and start the round's workers anew, or start them as usual.
    pub(super) fn joined(&mut self, placement: Placement, now: Millis, out: &mut Vec<Action>) {
        match self.parked {
            Some(round) if std::mem::take(&mut self.park_broken) => {
                self.parked = None;
                out.push(Action::Note(
                    "a worker that kept its process ended while the job re-formed; starting this node's workers anew"
                        .into(),
                ));
                self.stop_workers(round, AfterStop::Start(Box::new(placement)), out);
            }
            _ => self.start_workers(placement, now, out),
        }
    }

    /// Workers that did not park in time are stopped, and the node rejoins as usual.
    pub(super) fn parking_tick(&mut self, now: Millis, out: &mut Vec<Action>) {
        if let Phase::Parking { round, until, .. } = self.phase {
            if now >= until {
                out.push(Action::Note(format!(
                    "not every worker ended its round within {PARK_WITHIN:?}; stopping this node's workers and rejoining"
                )));
                let then = self.after_failed_parking();
                self.stop_workers(round, then, out);
            }
        }
    }
}
