//! Watching peers, pure: which of the members this node watches it reports silent or gone, and
//! when. No I/O, no clock: `elastic.rs` (`peer_loop`) pings, receives and ticks, and feeds what
//! happened here; the tests drive it with made-up clocks and made-up loss.
//!
//! During a round the rendezvous gives each node a few members to watch
//! ([`rlaunch::contract::PeerWatch`]). Every interval the shell pings each one over UDP (its
//! agent echoes); each tick closes one ping's window, answered or not, and the recent windows
//! give the link's loss. A target is reported
//!
//! - **gone** when its host answered that nothing listens at its probe endpoint (ICMP port
//!   unreachable) after it had answered pings: its agent is dead while the host lives —
//!   reported at once;
//! - **silent** when it has not answered for its threshold: the stall bound plus a ping, or
//!   longer, as long as a run of misses that long is less likely than [`FALSE_SILENCE`] under the
//!   loss measured on that link, taken two standard errors high (over 100 pings: 10 % of pings
//!   lost, 0.8 s; 28 %, 1.4 s; 51 %, 2.8 s). Until a few pings are measured the threshold is
//!   high (2 s or more): a round's first second trusts the heartbeats.
//!
//! A report ends when the target answers again, and for a while after this node says so with
//! every heartbeat (the rendezvous takes the earlier report back). A target that never answered
//! (UDP filtered or rejected on the path) is never reported: this node cannot watch it, and says
//! so once. When this node's own ticks come late (its agent was stopped or
//! starved), the silence that gap caused is forgiven: a watcher that was not running has seen
//! nothing.

use std::collections::{BTreeMap, VecDeque};

use rlaunch::contract::{HostPort, PeerWatch};
use rlaunch_rendezvous::detector::PeerReport;

/// Milliseconds on the shell's clock.
pub type Millis = u64;

/// The chance per ping, under the measured loss, that a live target's silence reaches the
/// threshold: about 6e-4 a minute per watched node at 10 pings a second.
pub const FALSE_SILENCE: f64 = 1e-6;
/// Ping windows remembered for the loss estimate (10 s at 100 ms).
pub const WINDOW: usize = 100;
/// Answers a target must have given before its silence or a refusal is reported (one that
/// never answered may sit behind a firewall that rejects UDP: refusals say nothing of it).
pub const MIN_ANSWERS: u32 = 3;
/// How long after a report ends (the target answered again) this node still says so with
/// every heartbeat: its earlier report is taken back at the rendezvous, however the
/// heartbeats in flight arrive.
pub const RETRACT_FOR: Millis = 2_000;

#[derive(Debug, Clone)]
struct Target {
    addr: HostPort,
    since: Millis,
    last_answer: Option<Millis>,
    answers: u32,
    /// Whether the ping window now open was answered.
    answered: bool,
    outcomes: VecDeque<bool>,
    /// Refused since its last answer.
    gone: bool,
    said_unwatchable: bool,
    /// When a report of it last ended (it answered again), while that is still said.
    retracted_at: Option<Millis>,
}

impl Target {
    /// The share of recent pings not answered, with one phantom miss and one phantom answer (so
    /// a clean history is not taken for a perfect link), up to the last answer (the silence
    /// under way is what is judged, not part of the link's measure), raised by two standard
    /// errors: a hundred pings measure the loss only roughly, and the threshold must hold for
    /// the link as it may be, not only as it looked.
    fn loss(&self) -> f64 {
        let judged = self.outcomes.iter().rposition(|ok| *ok).map_or(0, |i| i + 1);
        let misses = self.outcomes.iter().take(judged).filter(|ok| !**ok).count();
        let n = judged as f64 + 2.0;
        let p = (misses as f64 + 1.0) / n;
        (p + 2.0 * (p * (1.0 - p) / n).sqrt()).min(0.99)
    }
}

/// What the shell tells the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The round's watch (`None`: no round runs, or nobody watches).
    Watch(Option<PeerWatch>),
    /// `node_id`'s agent echoed a ping.
    Answered { node_id: String },
    /// `node_id`'s host said nothing listens there (ICMP port unreachable).
    Refused { node_id: String },
    /// A ping interval came round (the shell pings every target after this).
    Tick,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Tell the rendezvous now: the set of reported targets changed (the shell sends a
    /// heartbeat at once; every heartbeat carries [`Peers::reports`]).
    Urgent,
    Info(String),
}

#[derive(Debug, Clone, Default)]
pub struct Peers {
    interval: Millis,
    stall_bound: Millis,
    targets: BTreeMap<String, Target>,
    last_tick: Option<Millis>,
    /// What was last reported, to tell when it changes.
    reported: Vec<(String, bool)>,
}

impl Peers {
    pub fn step(&mut self, event: Event, now: Millis) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Watch(w) => {
                let old = std::mem::take(&mut self.targets);
                if let Some(w) = w {
                    self.interval = w.interval_ms.max(1);
                    self.stall_bound = w.stall_bound_ms;
                    for t in w.targets {
                        // A target watched before keeps its history (the same link).
                        let kept = old.get(&t.node_id).filter(|o| o.addr == t.addr).cloned();
                        let fresh = Target {
                            addr: t.addr,
                            since: now,
                            last_answer: None,
                            answers: 0,
                            answered: false,
                            outcomes: VecDeque::new(),
                            gone: false,
                            said_unwatchable: false,
                            retracted_at: None,
                        };
                        self.targets.insert(t.node_id, kept.unwrap_or(fresh));
                    }
                }
                self.last_tick = None;
            }
            Event::Answered { node_id } => {
                if let Some(t) = self.targets.get_mut(&node_id) {
                    t.last_answer = Some(now);
                    t.answers = t.answers.saturating_add(1);
                    t.answered = true;
                    t.gone = false;
                }
            }
            Event::Refused { node_id } => {
                if let Some(t) = self.targets.get_mut(&node_id).filter(|t| t.answers >= MIN_ANSWERS) {
                    t.gone = true;
                }
            }
            Event::Tick => {
                let late = self.last_tick.is_some_and(|l| now.saturating_sub(l) > self.interval.saturating_mul(3));
                self.last_tick = Some(now);
                for (id, t) in &mut self.targets {
                    if late {
                        // This node did not run: what it did not hear meanwhile says nothing.
                        t.last_answer = t.last_answer.map(|_| now);
                        t.since = now;
                    } else {
                        if t.outcomes.len() == WINDOW {
                            t.outcomes.pop_front();
                        }
                        t.outcomes.push_back(t.answered);
                    }
                    t.answered = false;
                    if t.answers == 0 && !t.said_unwatchable && now.saturating_sub(t.since) >= self.stall_bound * 4 {
                        t.said_unwatchable = true;
                        out.push(Action::Info(format!(
                            "peer watching: {id} at {} has not answered a ping since the round began (UDP filtered?): \
                             it is watched by heartbeats and probes only",
                            t.addr
                        )));
                    }
                }
            }
        }
        let now_reported: Vec<(String, bool)> = self.judged(now).into_iter().map(|(id, gone, _)| (id, gone)).collect();
        if now_reported != self.reported {
            for (id, gone) in &now_reported {
                if !self.reported.contains(&(id.clone(), *gone)) {
                    let what = if *gone { "its agent is gone (nothing listens at its address)" } else { "silent" };
                    out.push(Action::Info(format!("peer watching: {id} {what}; telling the rendezvous")));
                }
            }
            for (id, _) in &self.reported {
                if !now_reported.iter().any(|(n, _)| n == id) {
                    if let Some(t) = self.targets.get_mut(id) {
                        t.retracted_at = Some(now);
                        out.push(Action::Info(format!("peer watching: {id} answers again; telling the rendezvous")));
                    }
                }
            }
            self.reported = now_reported;
            out.push(Action::Urgent);
        }
        out
    }

    /// Whether this node's own ticks stopped coming (its agent was stopped or starved): the
    /// silence of its targets since then is its own doing.
    fn paused(&self, now: Millis) -> bool {
        self.last_tick.is_some_and(|l| now.saturating_sub(l) > self.interval.saturating_mul(3))
    }

    /// The targets found silent or gone now: (id, gone, silent for).
    fn judged(&self, now: Millis) -> Vec<(String, bool, Millis)> {
        let paused = self.paused(now);
        self.targets
            .iter()
            .filter_map(|(id, t)| {
                let silent_ms = now.saturating_sub(t.last_answer.unwrap_or(t.since));
                let silent = !paused && t.answers >= MIN_ANSWERS && silent_ms >= self.threshold(t);
                (t.gone || silent).then(|| (id.clone(), t.gone, silent_ms))
            })
            .collect()
    }

    /// How long `t` must be silent before it is reported: the stall bound plus a ping, or the
    /// run of misses that the link's loss makes rarer than [`FALSE_SILENCE`].
    fn threshold(&self, t: &Target) -> Millis {
        let floor = self.stall_bound.saturating_add(self.interval);
        let loss = t.loss();
        let pings = (FALSE_SILENCE.ln() / loss.ln()).ceil();
        let adaptive =
            if pings.is_finite() && pings > 0.0 { (pings as Millis).saturating_mul(self.interval) } else { 0 };
        floor.max(adaptive)
    }

    /// What this node says now of the members it watches: each one gone or silent, with how
    /// long ago it last answered; and, for [`RETRACT_FOR`] after such a report ended, that it
    /// answers again (a report with the short silence since its last answer).
    pub fn reports(&self, now: Millis) -> Vec<PeerReport> {
        let mut out: Vec<PeerReport> = self
            .judged(now)
            .into_iter()
            .map(|(node_id, gone, silent_ms)| PeerReport { node_id, silent_ms, gone })
            .collect();
        for (id, t) in &self.targets {
            let retracting = t.retracted_at.is_some_and(|r| now.saturating_sub(r) < RETRACT_FOR);
            if retracting && !out.iter().any(|r| &r.node_id == id) {
                let silent_ms = now.saturating_sub(t.last_answer.unwrap_or(t.since));
                out.push(PeerReport { node_id: id.clone(), silent_ms, gone: false });
            }
        }
        out
    }

    /// The members watched now, with their addresses (the shell pings these).
    pub fn targets(&self) -> impl Iterator<Item = (&str, &HostPort)> {
        self.targets.iter().map(|(id, t)| (id.as_str(), &t.addr))
    }

    /// The silence after which `node_id` would be reported now (for logs and tests).
    pub fn threshold_of(&self, node_id: &str) -> Option<Millis> {
        self.targets.get(node_id).map(|t| self.threshold(t))
    }
}

#[cfg(test)]
mod tests;
