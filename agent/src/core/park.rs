//! Workers that keep their process across rounds (`rlaunch.resilient`).
//!
//! When a round ends elsewhere (a node lost or joining, a worker failing on another node) and
//! every worker of this node opted in, the node does not stop them: it tells them the round
//! ended (`Park`), waits for all of them to end their collectives (`WorkersParked`), joins the
//! next round and hands them its environment (`Resume`). A worker that does not park within
//! [`PARK_WITHIN`], or one that ends while parked, and the node's workers are stopped and
//! started as they are without it. Any end of the run while workers are parked stops them
//! first (`Core::exit`).

use std::time::Duration;

use super::{ms, Action, AfterStop, Core, Millis, Phase, Placement, WorkersEnd};

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
            && self.opted_in >= self.features.local_world_size
    }

    /// The round of `placement` ended elsewhere: tell the workers, with the round's hosts (their
    /// connections to those hosts are what a gloo collective waits on).
    pub(super) fn park(&mut self, placement: &Placement, now: Millis, out: &mut Vec<Action>) {
        let mut hosts: Vec<String> = placement.members.iter().map(|m| m.store_addr.host().to_owned()).collect();
        hosts.extend(placement.master.iter().map(|m| m.host().to_owned()));
        hosts.sort();
        hosts.dedup();
        self.outbox = None;
        // The round's snapshots stay open until the next begins: a save racing the word must
        // not wait for a round that comes only once every worker parked. The workers refuse
        // their own saves from the word on (`rlaunch.snapshot.save` answers False), so a step
        // "completed" on the garbage of an aborted NCCL reduction never commits.
        out.push(Action::Park { round: placement.round, hosts });
        self.phase = Phase::Parking { round: placement.round, until: now.saturating_add(ms(PARK_WITHIN)) };
    }

    /// Every worker parked: join the next round with them.
    pub(super) fn on_parked(&mut self, out: &mut Vec<Action>) {
        let Phase::Parking { round, .. } = self.phase else { return };
        self.parked = Some(round);
        self.park_broken = false;
        self.join(out);
    }

    /// A workers' end outside `Running`: handled here when it concerns parking or parked
    /// workers (returns true).
    pub(super) fn parked_worker_ended(&mut self, end: &WorkersEnd, out: &mut Vec<Action>) -> bool {
        if let Phase::Parking { round, .. } = self.phase {
            if let WorkersEnd::Failed(rc) | WorkersEnd::Hung(rc) = end {
                self.local_failure = Some(rc.clone());
            }
            match end {
                // Every worker finished its function while the round ended: nothing to keep.
                WorkersEnd::Succeeded => {
                    self.workers_alive = false;
                    self.join(out);
                }
                _ => {
                    out.push(Action::Note(
                        "a worker ended while the others parked; stopping this node's workers and rejoining".into(),
                    ));
                    self.stop_workers(round, AfterStop::Rejoin, out);
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
        if let Phase::Parking { round, until } = self.phase {
            if now >= until {
                out.push(Action::Note(format!(
                    "not every worker ended its round within {PARK_WITHIN:?}; stopping this node's workers and rejoining"
                )));
                self.stop_workers(round, AfterStop::Rejoin, out);
            }
        }
    }
}
