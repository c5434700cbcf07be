//! What each recovery cost, and the job's goodput: [`Accounting`], kept in the job (plain data,
//! persisted with it) and fed by the machine's transitions and the agents' progress reports.
//!
//! A recovery starts at a fault and ends when the job trains where it stood before it. Its
//! phases, each the time between two instants the rendezvous records on its own clock:
//! - **noticing**: the fault → the verdict (the round opened). A lost node's fault is dated at
//!   its last heartbeat the service holds (with etcd, which keeps no heartbeat times, one TTL
//!   before the verdict); a failed worker's at the moment its agent saw it exit;
//! - **re-forming**: the verdict → the new round closed;
//! - **starting**: the round closed → every member's program up: each rank asked for its state
//!   (`rlaunch.snapshot.load`; for a program that never asks, its workers started, warm or
//!   cold);
//! - **restoring**: → every member's ranks loaded the step their snapshots restore;
//! - **computing again**: → the step the job had saved before the fault saved again.
//!
//! Agents report their instants as "so long ago" ([`NodeProgress`]): the service dates them on
//! its own clock, so no two hosts' clocks need agree. A phase nobody reported (a program that
//! never calls `rlaunch.snapshot`) is unknown, never guessed; the recovery then ends at the last
//! instant known.
//!
//! What a member says of itself is taken only within what the service can know: a milestone
//! is dated no earlier than its round closed and no later than its arrival; a failed worker's
//! exit ([`failure_dated`]) no earlier than the round it failed in ran, and no longer before
//! the report than its agent may take to send it ([`report_delay_ms`]). And every recovery
//! ends: at training where it stood before, at the next fault, or at the latest
//! [`RECOVERY_BOUND_MS`] after its round re-formed (the first start-up likewise after the
//! first round closed) — a member that never reports (an older agent), or one whose step
//! before no member saves again, would otherwise keep it open, and the job's goodput falling,
//! until the next fault.
//!
//! Goodput is training time over wall time since the first round closed: the wall time less
//! the first start-up (round closed → first step) and every recovery (fault → its end).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::settings::{JobSettings, Millis};
use rlaunch::contract::NodeProgress;

/// A recovery (and the first start-up) ends at the latest this long after its round closed,
/// whatever its members reported or failed to: an hour, far more than a program's start,
/// restore and the steps it computes again between snapshots take.
pub const RECOVERY_BOUND_MS: Millis = 60 * 60 * 1000;
/// What an agent may take between seeing a worker exit and sending the report that no setting
/// bounds: the survivors' stacks read (py-spy, 10 s per dump at most) or a hang's linger
/// (10 s), with room to spare.
pub const REPORT_ALLOWANCE_MS: Millis = 30_000;

/// How long before its report an agent may have seen the exit it reports: it stops its workers
/// first (the stop grace), sends again until the report is taken (within the join timeout),
/// and takes [`REPORT_ALLOWANCE_MS`] for the rest.
pub fn report_delay_ms(settings: &JobSettings) -> Millis {
    JobSettings::ms(settings.stop_grace)
        .saturating_add(JobSettings::ms(settings.join_timeout))
        .saturating_add(REPORT_ALLOWANCE_MS)
}

/// A failed worker's exit, reported at `now` as seen `seen_ago_ms` before, in a round running
/// since `since`: never before that round ran, never after `now`, never further back than
/// [`report_delay_ms`].
pub fn failure_dated(now: Millis, seen_ago_ms: u64, since: Millis, settings: &JobSettings) -> Millis {
    now.saturating_sub(seen_ago_ms.min(report_delay_ms(settings))).clamp(since.min(now), now)
}

/// Recoveries kept in full (older ones count in the totals only).
pub const KEEP_RECOVERIES: usize = 32;
/// Timeline marks kept (the oldest go first).
pub const KEEP_MARKS: usize = 256;
/// Rounds with at most this many nodes name them in the timeline (lanes per node on the page);
/// a loss names at most this many.
pub const NAMED_NODES: usize = 32;
/// Join marks kept at most (the rest of the timeline is never pushed out by joins).
pub const KEEP_JOINS: usize = 64;

/// At most [`NAMED_NODES`] of `ids`, and how many more there were.
pub fn named(ids: &[String]) -> String {
    let mut s = ids.iter().take(NAMED_NODES).cloned().collect::<Vec<_>>().join(", ");
    if ids.len() > NAMED_NODES {
        s += &format!(" and {} more", ids.len() - NAMED_NODES);
    }
    s
}

/// Per-node report bits, so a node's repeated report counts once.
const STARTED: u8 = 1;
const RESTORED: u8 = 2;
const FIRST_STEP: u8 = 4;
const CAUGHT_UP: u8 = 8;
const STEP_BEFORE: u8 = 16;
const READY: u8 = 32;

/// What one round's members reported, aggregated: each instant is the last member's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Milestones {
    /// Members whose workers were started; when the last of them was.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub started_nodes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Millis>,
    /// Members whose ranks all asked for their state (the program up); when the last did.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ready_nodes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_at: Option<Millis>,
    /// Members whose ranks all loaded a restored step; the oldest such step; when.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub restored_nodes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_at: Option<Millis>,
    /// Members whose ranks all saved a step in this round; the first such step; when.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub first_step_nodes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_step_at: Option<Millis>,
    /// The newest step any member's ranks had saved before this round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_before: Option<u64>,
    /// Members that had saved steps before this round (they must all catch up).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub before_nodes: u32,
    /// Members that saved that step (or a later one) again; when the last did.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub caught_up_nodes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caught_up_at: Option<Millis>,
    /// Ranks whose process was kept into the round (`rlaunch.resilient`), over the members
    /// that reported their start.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kept_ranks: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Milestones {
    /// When training stood where it did before, for a round of `nodes` members that closed at
    /// `closed`, seen at `now`: [`Milestones::end`], at the latest [`RECOVERY_BOUND_MS`] after
    /// the close once that has passed (`None` until one of them).
    fn end_by(&self, nodes: u32, closed: Millis, now: Millis) -> Option<Millis> {
        let bound = closed.saturating_add(RECOVERY_BOUND_MS);
        match self.end(nodes) {
            Some(end) => Some(end.min(bound)),
            None => (now >= bound).then_some(bound),
        }
    }

    /// When training stood where it did before, for a round of `nodes` members: once every
    /// member started its workers and the steps saved before the fault are saved again (`None`
    /// until then), else the latest instant reported.
    fn end(&self, nodes: u32) -> Option<Millis> {
        if self.started_nodes < nodes.max(1) {
            return None;
        }
        let from = self.restored_step.or(self.first_step);
        if self.step_before.zip(from).is_some_and(|(before, from)| before > from) {
            return self.caught_up_at.filter(|_| self.caught_up_nodes >= self.before_nodes);
        }
        [self.started_at, self.ready_at, self.restored_at, self.first_step_at, self.caught_up_at]
            .into_iter()
            .flatten()
            .max()
    }
}

/// One recovery: the fault, when each phase ended, and what the new round's members reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    /// The round that re-formed (the last opened, when several opened before one closed).
    pub round: u64,
    /// `node_lost`, `failure`, `scale_up`, `member_left`, `member_rejoined`.
    pub kind: String,
    /// The fault in words (`node b lost`, `rank 3 on node a: exit code 1`).
    pub fault: String,
    pub fault_at: Millis,
    /// The verdict: the running round torn down.
    pub noticed_at: Millis,
    /// The new round closed; its node count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reformed_at: Option<Millis>,
    #[serde(default)]
    pub nodes: u32,
    #[serde(default)]
    pub progress: Milestones,
    /// The next fault came before this recovery ended: it ends there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_at: Option<Millis>,
}

impl Recovery {
    /// When it ended as seen at `now` (training where it stood before, the next fault, or
    /// [`RECOVERY_BOUND_MS`] after its round re-formed), or `None` while under way.
    pub fn ended_at(&self, now: Millis) -> Option<Millis> {
        let end = self.reformed_at.and_then(|closed| self.progress.end_by(self.nodes, closed, now));
        [end, self.cut_at].into_iter().flatten().min()
    }

    /// The time it cost so far.
    pub fn lost_ms(&self, now: Millis) -> Millis {
        self.ended_at(now).unwrap_or(now).saturating_sub(self.fault_at)
    }

    /// Its phases in milliseconds, `None` where not (yet) known.
    pub fn phases(&self) -> Phases {
        let m = &self.progress;
        let all = |count: u32, at: Option<Millis>| at.filter(|_| count >= self.nodes && self.nodes > 0);
        // Started: every member's program up (asked for its state), or, where programs never
        // ask, every member's workers started.
        let started =
            if m.ready_nodes == 0 { all(m.started_nodes, m.started_at) } else { all(m.ready_nodes, m.ready_at) };
        let restored = all(m.restored_nodes, m.restored_at);
        let span = |from: Option<Millis>, to: Option<Millis>| Some(to?.saturating_sub(from?));
        let computing = match (m.step_before, m.restored_step) {
            (Some(before), Some(step)) if before <= step => Some(0),
            (Some(_), Some(_)) => span(restored, m.caught_up_at.filter(|_| m.caught_up_nodes >= m.before_nodes)),
            _ => None,
        };
        Phases {
            noticing_ms: Some(self.noticed_at.saturating_sub(self.fault_at)),
            reforming_ms: span(Some(self.noticed_at), self.reformed_at),
            starting_ms: span(self.reformed_at, started),
            restoring_ms: span(started, restored),
            computing_again_ms: computing,
            steps_redone: match (m.step_before, m.restored_step) {
                (Some(before), Some(step)) => Some(before.saturating_sub(step)),
                _ => None,
            },
            first_step_after_ms: m.first_step_at.map(|at| at.saturating_sub(self.fault_at)),
            ranks_kept: (m.started_nodes > 0).then_some(m.kept_ranks),
        }
    }
}

/// A recovery's phases, for operators (`rlaunch status`, the page, `/metrics`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Phases {
    pub noticing_ms: Option<Millis>,
    pub reforming_ms: Option<Millis>,
    pub starting_ms: Option<Millis>,
    pub restoring_ms: Option<Millis>,
    pub computing_again_ms: Option<Millis>,
    /// Steps computed twice: saved before the fault, then again after the restore.
    pub steps_redone: Option<u64>,
    /// The fault → the first step saved in the new round.
    pub first_step_after_ms: Option<Millis>,
    /// Ranks that kept their process through the recovery (`rlaunch.resilient`), as far as
    /// the members that started report.
    #[serde(default)]
    pub ranks_kept: Option<u32>,
}

/// Something that happened to the job, for the timeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    pub at: Millis,
    #[serde(flatten)]
    pub what: MarkKind,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mark", rename_all = "snake_case")]
pub enum MarkKind {
    /// A node joined (named while the forming round has few nodes, or while a round runs).
    Joined { node: String },
    /// A round closed with `nodes` nodes (named when at most [`NAMED_NODES`]).
    RoundClosed {
        round: u64,
        nodes: u32,
        world_size: u32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        node_ids: Vec<String>,
    },
    /// The running round was torn down: `kind` as in [`Recovery::kind`].
    RoundOpened { round: u64, kind: String, fault: String },
    /// Nodes declared lost.
    Lost { nodes: Vec<String> },
    /// A worker failure reported by `node`.
    Failure { node: String, rank: u32 },
    /// The job ended: `finished` or `failed`.
    Ended { state: String },
}

/// The job's recoveries and timeline.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accounting {
    /// When the first round closed: the job's wall time counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub began_at: Option<Millis>,
    /// The first round's members' start-up (no fault before it).
    #[serde(default)]
    pub startup: Milestones,
    /// Members of the first round (for `startup`'s counts).
    #[serde(default)]
    pub startup_nodes: u32,
    /// The first recovery's fault: the start-up ends there at the latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_fault_at: Option<Millis>,
    /// The last [`KEEP_RECOVERIES`], oldest first.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub recoveries: VecDeque<Recovery>,
    /// Recoveries dropped from the list, and the time they cost.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub dropped: u64,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub dropped_lost_ms: u64,
    /// The last [`KEEP_MARKS`] marks, oldest first.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub timeline: VecDeque<Mark>,
    /// What each member of the running round reported so far (bits), so a repeat counts once.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reported: BTreeMap<String, u8>,
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

impl Accounting {
    pub fn is_empty(&self) -> bool {
        self == &Accounting::default()
    }

    pub fn mark(&mut self, at: Millis, what: MarkKind) {
        let is_join = |m: &Mark| matches!(m.what, MarkKind::Joined { .. });
        if matches!(what, MarkKind::Joined { .. }) && self.timeline.iter().filter(|m| is_join(m)).count() >= KEEP_JOINS
        {
            // Joins cost nothing to send (a fresh node id needs no secret): they push out only
            // older joins, never a round, a loss or a failure.
            if let Some(i) = self.timeline.iter().position(is_join) {
                self.timeline.remove(i);
            }
        }
        if self.timeline.len() >= KEEP_MARKS {
            self.timeline.pop_front();
        }
        self.timeline.push_back(Mark { at, what });
    }

    /// The running round was torn down for a fault dated `fault_at`. A round opened again
    /// before the last one closed belongs to the same recovery (its first fault stands).
    pub fn round_opened(&mut self, now: Millis, round: u64, kind: &str, fault: String, fault_at: Millis) {
        self.mark(now, MarkKind::RoundOpened { round, kind: kind.to_owned(), fault: fault.clone() });
        self.reported.clear();
        if self.began_at.is_none() {
            // Torn down before it ever ran: nothing was lost yet.
            return;
        }
        if let Some(r) = self.recoveries.back_mut().filter(|r| r.reformed_at.is_none()) {
            r.round = round;
            return;
        }
        self.first_fault_at.get_or_insert(fault_at.min(now));
        if let Some(last) = self.recoveries.back_mut().filter(|r| r.ended_at(now).is_none()) {
            // Never before its own fault (clocks of replicas may disagree: no clamp that panics).
            last.cut_at = Some(fault_at.min(now).max(last.fault_at));
        }
        if self.recoveries.len() >= KEEP_RECOVERIES {
            if let Some(old) = self.recoveries.pop_front() {
                self.dropped += 1;
                self.dropped_lost_ms = self.dropped_lost_ms.saturating_add(old.lost_ms(now));
            }
        }
        self.recoveries.push_back(Recovery {
            round,
            kind: kind.to_owned(),
            fault,
            fault_at: fault_at.min(now),
            noticed_at: now,
            reformed_at: None,
            nodes: 0,
            progress: Milestones::default(),
            cut_at: None,
        });
    }

    /// Round `round` closed with `node_ids` (in rank order) and `world_size` ranks.
    pub fn round_closed(&mut self, now: Millis, round: u64, node_ids: &[&str], world_size: u32) {
        let nodes = u32::try_from(node_ids.len()).unwrap_or(u32::MAX);
        let named =
            if node_ids.len() <= NAMED_NODES { node_ids.iter().map(|s| (*s).to_owned()).collect() } else { Vec::new() };
        self.mark(now, MarkKind::RoundClosed { round, nodes, world_size, node_ids: named });
        self.reported.clear();
        if self.began_at.is_none() {
            self.began_at = Some(now);
            self.startup_nodes = nodes;
            return;
        }
        if let Some(r) = self.recoveries.back_mut().filter(|r| r.reformed_at.is_none()) {
            r.round = round;
            r.reformed_at = Some(now);
            r.nodes = nodes;
        }
    }

    /// A member of running round `round` reports its progress, dated on this clock (`now` less
    /// each "ago"). What it already reported this round is not counted again.
    pub fn progress(&mut self, now: Millis, round: u64, node_id: &str, p: &NodeProgress) {
        let startup = self.recoveries.back().is_none_or(|r| r.round != round);
        if startup && self.recoveries.back().is_some() {
            return; // neither the first round's nor the last recovery's
        }
        let bits = self.reported.get(node_id).copied().unwrap_or(0);
        let closed = if startup { self.began_at } else { self.recoveries.back().and_then(|r| r.reformed_at) };
        let m = if startup { &mut self.startup } else { &mut self.recoveries.back_mut().expect("checked").progress };
        // Never before the round closed, whatever a member says.
        let floor = closed.unwrap_or(now).min(now);
        let at = |ago: u64| now.saturating_sub(ago).max(floor);
        let mut new = bits;
        if let Some(ago) = p.started_ago_ms.filter(|_| bits & STARTED == 0) {
            m.started_nodes += 1;
            m.started_at = m.started_at.max(Some(at(ago)));
            m.kept_ranks = m.kept_ranks.saturating_add(p.kept_ranks.unwrap_or(0));
            new |= STARTED;
        }
        if let Some(ago) = p.ready_ago_ms.filter(|_| bits & READY == 0) {
            m.ready_nodes += 1;
            m.ready_at = m.ready_at.max(Some(at(ago)));
            new |= READY;
        }
        if let Some(r) = p.restored.as_ref().filter(|_| bits & RESTORED == 0) {
            m.restored_nodes += 1;
            m.restored_at = m.restored_at.max(Some(at(r.ago_ms)));
            m.restored_step = Some(m.restored_step.map_or(r.step, |s| s.min(r.step)));
            new |= RESTORED;
        }
        if let Some(s) = p.first_step.as_ref().filter(|_| bits & FIRST_STEP == 0) {
            m.first_step_nodes += 1;
            m.first_step_at = m.first_step_at.max(Some(at(s.ago_ms)));
            m.first_step = Some(m.first_step.map_or(s.step, |f| f.min(s.step)));
            new |= FIRST_STEP;
        }
        if let Some(before) = p.step_before.filter(|_| bits & STEP_BEFORE == 0) {
            m.step_before = m.step_before.max(Some(before));
            m.before_nodes += 1;
            new |= STEP_BEFORE;
        }
        if let Some(c) = p.caught_up.as_ref().filter(|_| bits & CAUGHT_UP == 0) {
            m.caught_up_nodes += 1;
            m.caught_up_at = m.caught_up_at.max(Some(at(c.ago_ms)));
            new |= CAUGHT_UP;
        }
        if new != bits {
            self.reported.insert(node_id.to_owned(), new);
        }
    }

    /// When the first start-up ended as seen at `now`: every member started, and the latest
    /// instant reported; at the latest the first fault, or [`RECOVERY_BOUND_MS`] after round 1
    /// closed. `None` while under way (or before round 1 closed).
    fn startup_end(&self, now: Millis) -> Option<Millis> {
        let began = self.began_at?;
        let end = self.startup.end_by(self.startup_nodes, began, now);
        [end, self.first_fault_at].into_iter().flatten().min()
    }

    /// The first start-up as seen at `now`: round 1 closed → its end; `None` while under way.
    pub fn startup_ms(&self, now: Millis) -> Option<Millis> {
        Some(self.startup_end(now)?.saturating_sub(self.began_at?))
    }

    /// Time lost so far: the first start-up and every recovery.
    pub fn lost_ms(&self, now: Millis, ended: Option<Millis>) -> Millis {
        let Some(began) = self.began_at else { return 0 };
        let now = ended.unwrap_or(now);
        // Intervals never overlap: each ends at the next one's fault at the latest.
        let next_fault = |i: usize| self.recoveries.get(i).map(|r| r.fault_at).unwrap_or(now).min(now);
        let startup = self.startup_end(now).unwrap_or(now).min(now);
        let mut lost = startup.saturating_sub(began);
        for (i, r) in self.recoveries.iter().enumerate() {
            let end = r.ended_at(now).unwrap_or(now).min(next_fault(i + 1));
            lost = lost.saturating_add(end.saturating_sub(r.fault_at));
        }
        lost.saturating_add(self.dropped_lost_ms)
    }

    /// Training time over wall time since the first round closed; `None` before it did.
    pub fn goodput(&self, now: Millis, ended: Option<Millis>) -> Option<f64> {
        let began = self.began_at?;
        if self.startup.started_nodes == 0 && self.recoveries.iter().all(|r| r.progress.started_nodes == 0) {
            return None; // no member ever reported (agents that do not): nothing to go by
        }
        let wall = ended.unwrap_or(now).saturating_sub(began);
        if wall == 0 {
            return None;
        }
        let lost = self.lost_ms(now, ended).min(wall);
        Some((wall - lost) as f64 / wall as f64)
    }
}
