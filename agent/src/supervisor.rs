//! Supervision of one worker group, pure: what to do when a worker exits, when to sample the
//! workers' progress, when a hang verdict is given, held or reported and which rank it names,
//! when to read stacks and what a request for them gets. No I/O, no clock, no async: the shell
//! (`driver.rs`, `supervise`) feeds [`Event`]s with the time and carries out the [`Action`]s;
//! tests (`supervisor/tests.rs`) drive it with made-up clocks and workers.
//!
//! A group's life: `Running` until every worker succeeded (`Succeeded`), one failed, or a hang
//! verdict stands. A failure waits [`FAILING_ALONG`] for workers failing by themselves in the
//! same moment (they are listed under the report's other failures), then, with hang detection,
//! reads the survivors' stacks before anyone stops them, then reports. The driver's `Stop` ends
//! the group at any point; nothing is reported after it but `Stopped`.

use std::collections::BTreeMap;
use std::time::Duration;

use rlaunch::contract::Exit;

use crate::hang::{self, Detector, HangTimeout, Millis, Sample, Stack, Verdict};

/// How long after a worker's failure other workers failing by themselves count as failing with
/// it (and are listed in the report), before the failure is reported and the survivors are
/// stopped. Ends as soon as every worker has exited. torchrun groups failures by its monitor
/// interval (0.1 s), which is also how late it notices the first; here the first is noticed at
/// once and the wait is short, since every millisecond of it delays the restart.
pub const FAILING_ALONG: Duration = Duration::from_millis(10);

/// How often progress is sampled (hang detection, the ranks' published waits).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Hang detection for the group: the threshold and the job's node count.
#[derive(Debug, Clone, Copy)]
pub struct HangPolicy {
    pub timeout: HangTimeout,
    /// Nodes in the job (a node whose ranks all wait holds its verdict only with several).
    pub nodes: u32,
    /// The kernel's clock ticks per second (CPU time in samples).
    pub ticks_per_s: u64,
}

/// What happens to the group.
#[derive(Debug, Clone)]
pub enum Event {
    /// Worker `index` exited; `seen_at` is the wall time (Unix ms) its exit was noticed, kept
    /// for the report.
    Exited { index: usize, exit: Exit, seen_at: u64 },
    /// Time passed (the shell wakes the supervisor at [`Supervisor::next_wakeup`]).
    Tick,
    /// Progress samples of the running workers, by index (`Action::Sample`'s answer).
    Sampled(BTreeMap<usize, Sample>),
    /// Stacks read (`Action::ReadStacks`'s answer), by rank.
    StacksRead { id: u64, stacks: BTreeMap<u32, Stack> },
    /// The driver relays a signal to every worker.
    Signal(i32),
    /// The driver asks where the ranks stand (report lines).
    StacksWanted,
    /// The driver stops the group: `first` signal, then SIGTERM, then SIGKILL.
    Stop { first: i32 },
    /// The workers were told their round ended (`rlaunch.resilient`): they wait, quiet, for the
    /// next one, and no quiet time of theirs counts toward a hang. After a failure was reported
    /// (some workers died, the others park) the group is watched again: an exit seen since the
    /// report, or any end of a parked worker, is reported.
    Park,
    /// The stop asked for is done: every worker reaped.
    Stopped,
}

/// How a failure's report is to be built: the shell reads the error files and output tails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub index: usize,
    pub exit: Exit,
    pub seen_at: u64,
    /// Workers that failed by themselves within [`FAILING_ALONG`], in the order seen.
    pub others: Vec<(usize, Exit)>,
    /// Where the survivors stood, report lines (with hang detection).
    pub stacks: Vec<String>,
}

/// A hang verdict's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hang {
    /// The root cause: the odd one out, else the longest quiet.
    pub culprit: usize,
    pub message: String,
    pub stacks: Vec<String>,
}

/// What the shell does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Sample the running workers' progress, with a stack digest of these (quiet ones); answer
    /// with `Sampled`.
    Sample {
        stacks_of: Vec<usize>,
    },
    /// Publish the running ranks' waits on their steps (heartbeats carry them).
    PublishSteps,
    /// The group is over: heartbeats stop carrying its ranks' waits.
    ForgetSteps,
    /// Read the stacks of every running worker; answer with `StacksRead` carrying `id`.
    ReadStacks {
        id: u64,
    },
    /// Answer every waiting `StacksWanted` with these lines.
    ReplyStacks(Vec<String>),
    Signal(i32),
    /// Stop every worker, then answer with `Stopped`.
    Stop {
        first: i32,
    },
    /// Report: every worker succeeded (after reaping what they left).
    Succeeded,
    /// Report: a worker failed.
    Failed(Failure),
    /// Report: a hang.
    Hung(Hang),
    /// Report: the stop is done.
    Stopped,
    Info(String),
    Warn(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Running,
    /// A worker failed; others failing until `until` are listed with it.
    Failing {
        failure: Failure,
        until: Millis,
    },
    /// The survivors' stacks are read for the failure's report: by read `id`, or (`None`) by
    /// the next one, once the read already in flight is back.
    FailureStacks {
        failure: Failure,
        id: Option<u64>,
    },
    /// Reported (succeeded, failed or hung): the driver decides what comes next.
    Ended,
    Stopping,
    Stopped,
}

#[derive(Debug, Clone)]
pub struct Supervisor {
    /// Each worker's global rank, by index.
    ranks: Vec<u32>,
    exits: Vec<Option<Exit>>,
    hang: Option<(HangPolicy, Detector)>,
    /// Whether the ranks' waits are published (an elastic job's heartbeats carry them).
    steps: bool,
    phase: Phase,
    /// When progress is sampled next.
    next_sample: Millis,
    /// A sample is being taken.
    sampling: bool,
    /// A verdict held until then (a node whose ranks all wait: `hang::hold_verdict`).
    hold_until: Option<Millis>,
    /// A verdict waiting for its stacks: read `id`, or (`None`) the next one.
    verdict_read: Option<(Option<u64>, Verdict)>,
    /// The read in flight: one at a time, since py-spy pauses a process and a second dump of a
    /// paused process fails (EPERM), and the last id given.
    reading: Option<u64>,
    last_id: u64,
    /// A `StacksWanted` waits for the next read.
    wanted: bool,
    /// The stacks read when the group ended: what a request racing that end gets.
    last_lines: Vec<String>,
    /// The workers wait for the next round (`rlaunch.resilient`): nothing is sampled.
    parked: bool,
    /// Exits seen after the group's report (`Ended`), in the order seen: reported if the group
    /// is watched again ([`Event::Park`]).
    late: Vec<(usize, Exit, u64)>,
}

fn ms(d: Duration) -> Millis {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Supervisor {
    fn on_park(&mut self, out: &mut Vec<Action>) {
        self.parked = true;
        // No verdict of a hang is judged for workers that wait for their next round.
        self.hold_until = None;
        self.verdict_read = None;
        if self.phase != Phase::Ended {
            return;
        }
        self.phase = Phase::Running;
        let mut late = std::mem::take(&mut self.late).into_iter();
        if let Some((index, exit, seen_at)) = late.next() {
            out.push(Action::Warn(format!(
                "worker ended after its group's failure was reported: rank {}, {}",
                self.ranks[index],
                exit.describe()
            )));
            let others = late.map(|(i, e, _)| (i, e)).collect();
            self.end(out);
            out.push(Action::Failed(Failure { index, exit, seen_at, others, stacks: Vec::new() }));
        }
    }

    /// The workers kept their processes into a new round: these are their global ranks now;
    /// the workers at the indices in `fresh` were started anew (their exits are forgotten);
    /// hang detection starts again from `now`.
    pub fn renumber(&mut self, ranks: Vec<u32>, fresh: &[usize], now: Millis) {
        if ranks.len() == self.ranks.len() {
            self.ranks = ranks;
        }
        for i in fresh {
            if let Some(e) = self.exits.get_mut(*i) {
                *e = None;
            }
        }
        self.parked = false;
        self.late.clear();
        let n = self.ranks.len();
        if let Some((p, d)) = &mut self.hang {
            *d = Detector::new(p.timeout, n, p.ticks_per_s, now);
        }
        self.next_sample = now;
        self.hold_until = None;
        self.verdict_read = None;
    }

    /// A group of workers with these global ranks, started at `now`.
    pub fn new(ranks: Vec<u32>, hang: Option<HangPolicy>, steps: bool, now: Millis) -> Supervisor {
        let n = ranks.len();
        Supervisor {
            exits: vec![None; n],
            hang: hang.map(|p| (p, Detector::new(p.timeout, n, p.ticks_per_s, now))),
            ranks,
            steps,
            phase: Phase::Running,
            next_sample: now,
            sampling: false,
            hold_until: None,
            verdict_read: None,
            reading: None,
            last_id: 0,
            wanted: false,
            last_lines: Vec::new(),
            parked: false,
            late: Vec::new(),
        }
    }

    /// When the shell must deliver a `Tick` next, if at all.
    pub fn next_wakeup(&self) -> Option<Millis> {
        match &self.phase {
            Phase::Failing { until, .. } => Some(*until),
            Phase::Running if self.samples() && !self.sampling => Some(self.next_sample),
            _ => None,
        }
    }

    /// Whether the group is still running (no report made, no stop asked for).
    pub fn running(&self) -> bool {
        self.phase == Phase::Running
    }

    fn samples(&self) -> bool {
        !self.parked && (self.hang.is_some() || self.steps)
    }

    fn running_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.exits.iter().enumerate().filter(|(_, e)| e.is_none()).map(|(i, _)| i)
    }

    /// Starts a read unless one is in flight; its id, if started.
    fn read(&mut self, out: &mut Vec<Action>) -> Option<u64> {
        if self.reading.is_some() {
            return None;
        }
        self.last_id += 1;
        self.reading = Some(self.last_id);
        out.push(Action::ReadStacks { id: self.last_id });
        Some(self.last_id)
    }

    pub fn step(&mut self, event: Event, now: Millis) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Exited { index, exit, seen_at } => self.on_exit(index, exit, seen_at, now, &mut out),
            Event::Tick => self.on_tick(now, &mut out),
            Event::Sampled(samples) => self.on_sampled(samples, now, &mut out),
            Event::StacksRead { id, stacks } => self.on_stacks(id, stacks, now, &mut out),
            Event::Signal(sig) => {
                if !matches!(self.phase, Phase::Stopping | Phase::Stopped) {
                    out.push(Action::Signal(sig));
                }
            }
            Event::StacksWanted => self.on_stacks_wanted(&mut out),
            Event::Stop { first } => {
                if matches!(self.phase, Phase::Stopping | Phase::Stopped) {
                    return out;
                }
                if self.phase != Phase::Ended {
                    out.push(Action::ForgetSteps);
                }
                if std::mem::take(&mut self.wanted) {
                    out.push(Action::ReplyStacks(self.last_lines.clone()));
                }
                self.phase = Phase::Stopping;
                out.push(Action::Stop { first });
            }
            Event::Park => self.on_park(&mut out),
            Event::Stopped => {
                if self.phase == Phase::Stopping {
                    self.phase = Phase::Stopped;
                    out.push(Action::Stopped);
                }
            }
        }
        out
    }

    fn on_exit(&mut self, index: usize, exit: Exit, seen_at: u64, now: Millis, out: &mut Vec<Action>) {
        let Some(slot) = self.exits.get_mut(index) else { return };
        if slot.is_some() {
            return; // each worker exits once
        }
        *slot = Some(exit);
        if let Some((_, d)) = &mut self.hang {
            d.retire(index);
        }
        match &mut self.phase {
            Phase::Running => {
                // A worker that kept its process while others of the group failed waits for its
                // next round: any end of it is a failure (its function cannot have returned).
                let beside_failed = self.parked && self.exits.iter().flatten().any(|e| !e.success());
                if exit.success() && !beside_failed {
                    if self.exits.iter().all(|e| *e == Some(Exit::Code(0))) {
                        self.end(out);
                        out.push(Action::Succeeded);
                    }
                    return;
                }
                out.push(Action::Warn(format!("worker failed: rank {}, {}", self.ranks[index], exit.describe())));
                let failure = Failure { index, exit, seen_at, others: Vec::new(), stacks: Vec::new() };
                self.phase = Phase::Failing { failure, until: now.saturating_add(ms(FAILING_ALONG)) };
                self.verdict_read = None;
                if self.exits.iter().all(Option::is_some) {
                    self.failure_settled(out);
                }
            }
            Phase::Failing { failure, .. } => {
                if !exit.success() {
                    failure.others.push((index, exit));
                } else {
                    self.late.push((index, exit, seen_at));
                }
                if self.exits.iter().all(Option::is_some) {
                    self.failure_settled(out);
                }
            }
            // While the survivors' stacks are read, and after the report: kept, in case the
            // group is watched again.
            Phase::FailureStacks { .. } | Phase::Ended => self.late.push((index, exit, seen_at)),
            // Exits after the failure's moment or during a stop are no news.
            _ => {}
        }
    }

    /// The failure's moment is over: read where the survivors stand, or report.
    fn failure_settled(&mut self, out: &mut Vec<Action>) {
        let Phase::Failing { failure, .. } = std::mem::replace(&mut self.phase, Phase::Running) else {
            return;
        };
        if self.hang.is_some() && self.running_indices().next().is_some() {
            let id = self.read(out);
            self.phase = Phase::FailureStacks { failure, id };
        } else {
            self.end(out);
            out.push(Action::Failed(failure));
        }
    }

    /// The group is over (reported).
    fn end(&mut self, out: &mut Vec<Action>) {
        self.phase = Phase::Ended;
        out.push(Action::ForgetSteps);
        if std::mem::take(&mut self.wanted) {
            out.push(Action::ReplyStacks(self.last_lines.clone()));
        }
    }

    fn on_tick(&mut self, now: Millis, out: &mut Vec<Action>) {
        match &self.phase {
            Phase::Failing { until, .. } if now >= *until => self.failure_settled(out),
            Phase::Running if self.samples() && !self.sampling && now >= self.next_sample => {
                // The next sample a whole period after this one (a slow sample delays it).
                self.next_sample = now.saturating_add(ms(SAMPLE_EVERY));
                if self.steps {
                    out.push(Action::PublishSteps);
                }
                if let Some((_, d)) = &self.hang {
                    let stacks_of = self.running_indices().filter(|i| d.wants_stack(*i, now)).collect();
                    self.sampling = true;
                    out.push(Action::Sample { stacks_of });
                }
            }
            _ => {}
        }
    }

    fn on_sampled(&mut self, samples: BTreeMap<usize, Sample>, now: Millis, out: &mut Vec<Action>) {
        self.sampling = false;
        if self.phase != Phase::Running || self.parked {
            return;
        }
        let Some((_, d)) = &mut self.hang else { return };
        for i in 0..self.ranks.len() {
            match samples.get(&i) {
                Some(s) if self.exits[i].is_none() => {
                    d.observe(i, *s, now);
                }
                _ => d.retire(i),
            }
        }
        let Some(verdict) = d.verdict(now) else {
            self.hold_until = None;
            return;
        };
        if self.hold_until.is_some_and(|t| now < t) || self.verdict_read.is_some() {
            return;
        }
        let id = self.read(out);
        self.verdict_read = Some((id, verdict));
    }

    fn on_stacks_wanted(&mut self, out: &mut Vec<Action>) {
        match (&self.hang, &self.phase) {
            (None, _) => out.push(Action::ReplyStacks(Vec::new())),
            (Some(_), Phase::Running | Phase::Failing { .. } | Phase::FailureStacks { .. }) => {
                self.wanted = true;
                self.read(out);
            }
            (Some(_), _) => out.push(Action::ReplyStacks(self.last_lines.clone())),
        }
    }

    fn on_stacks(&mut self, id: u64, stacks: BTreeMap<u32, Stack>, now: Millis, out: &mut Vec<Action>) {
        if self.reading != Some(id) {
            return;
        }
        self.reading = None;
        let lines = hang::report_lines(&stacks);
        if std::mem::take(&mut self.wanted) {
            out.push(Action::ReplyStacks(lines.clone()));
        }
        match std::mem::replace(&mut self.phase, Phase::Running) {
            Phase::FailureStacks { mut failure, id: Some(wanted) } if wanted == id => {
                self.last_lines = lines.clone();
                failure.stacks = lines;
                self.end(out);
                out.push(Action::Failed(failure));
            }
            // A read begun before the failure settled: the survivors' own comes next.
            Phase::FailureStacks { failure, id: None } => {
                let id = self.read(out);
                self.phase = Phase::FailureStacks { failure, id };
            }
            Phase::Running => match self.verdict_read.take() {
                Some((Some(vid), verdict)) if vid == id => self.judge(verdict, &stacks, lines, now, out),
                // A verdict that waited for this read to be back gets its own.
                Some((None, verdict)) => {
                    let id = self.read(out);
                    self.verdict_read = Some((id, verdict));
                }
                other => self.verdict_read = other,
            },
            other => self.phase = other,
        }
    }

    /// A verdict with the stacks read for it: held (this node's ranks all wait, another node
    /// likely holds the culprit), or reported.
    fn judge(
        &mut self,
        verdict: Verdict,
        stacks: &BTreeMap<u32, Stack>,
        lines: Vec<String>,
        now: Millis,
        out: &mut Vec<Action>,
    ) {
        let Some((policy, _)) = &self.hang else { return };
        let groups = hang::group(stacks);
        if self.hold_until.is_none() {
            let hold = hang::hold_verdict(&groups, policy.nodes, verdict.threshold);
            if !hold.is_zero() {
                out.push(Action::Info(format!(
                    "no progress here, every rank waits in a collective: holding the verdict {:.0} s for the node \
                     where the odd one out stands",
                    hold.as_secs_f64()
                )));
                self.hold_until = Some(now.saturating_add(ms(hold)));
                return;
            }
        }
        let ranks: Vec<u32> = verdict
            .stalled
            .iter()
            .filter(|i| self.exits.get(**i).is_some_and(Option::is_none))
            .map(|i| self.ranks[*i])
            .collect();
        let message = format!(
            "hang: no progress from rank(s) {} for {:.0} s (--hang-timeout {:.0} s); where each rank stood, the odd one \
             out first: {}",
            hang::ranges(&ranks),
            verdict.quiet_for.as_secs_f64(),
            verdict.threshold.as_secs_f64(),
            lines.first().map(String::as_str).unwrap_or("no stacks"),
        );
        out.push(Action::Warn(message.clone()));
        for l in &lines {
            out.push(Action::Warn(format!("  {l}")));
        }
        // The root cause is the odd one out (quiet or not: a rank spinning in a loop while the
        // others wait is the culprit), else the longest quiet.
        let running = |i: &usize| self.exits.get(*i).is_some_and(Option::is_none);
        // With every rank at the same place there is no odd one out: the longest quiet it is.
        let culprit = groups
            .first()
            .filter(|_| groups.len() > 1)
            .and_then(|(ranks, _)| ranks.first().copied())
            .and_then(|r| (0..self.ranks.len()).filter(running).find(|i| self.ranks[*i] == r))
            .unwrap_or(verdict.stalled[0]);
        self.last_lines = lines.clone();
        self.end(out);
        out.push(Action::Hung(Hang { culprit, message, stacks: lines }));
    }
}

#[cfg(test)]
mod tests;
