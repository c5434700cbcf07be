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
//!   unreachable): its agent is dead while the host lives — reported at once;
//! - **silent** when it has not answered for its threshold: the stall bound plus a ping, or
//!   longer, as long as a run of misses that long is less likely than [`FALSE_SILENCE`] under the
//!   loss measured on that link (10 % of pings lost: 0.6 s; 28 %: 1.1 s; 51 %: 2.1 s).
//!
//! A target that never answered (UDP filtered on the path) is never reported: this node cannot
//! watch it, and says so once. When this node's own ticks come late (its agent was stopped or
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
/// Answers a target must have given before its silence is reported.
pub const MIN_ANSWERS: u32 = 3;

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
}

impl Target {
    /// The share of recent pings not answered, with one phantom miss and one phantom answer (so
    /// a clean history is not taken for a perfect link), up to the last answer: the silence
    /// under way is what is judged, not part of the link's measure.
    fn loss(&self) -> f64 {
        let judged = self.outcomes.iter().rposition(|ok| *ok).map_or(0, |i| i + 1);
        let misses = self.outcomes.iter().take(judged).filter(|ok| !**ok).count();
        (misses as f64 + 1.0) / (judged as f64 + 2.0)
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
                if let Some(t) = self.targets.get_mut(&node_id) {
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
        let now_reported: Vec<(String, bool)> = self.reports(now).into_iter().map(|r| (r.node_id, r.gone)).collect();
        if now_reported != self.reported {
            for (id, gone) in &now_reported {
                if !self.reported.contains(&(id.clone(), *gone)) {
                    let what = if *gone { "its agent is gone (nothing listens at its address)" } else { "silent" };
                    out.push(Action::Info(format!("peer watching: {id} {what}; telling the rendezvous")));
                }
            }
            self.reported = now_reported;
            out.push(Action::Urgent);
        }
        out
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
    /// long ago it last answered.
    pub fn reports(&self, now: Millis) -> Vec<PeerReport> {
        self.targets
            .iter()
            .filter_map(|(id, t)| {
                let silent_ms = now.saturating_sub(t.last_answer.unwrap_or(t.since));
                let silent = t.answers >= MIN_ANSWERS && silent_ms >= self.threshold(t);
                (t.gone || silent).then(|| PeerReport { node_id: id.clone(), silent_ms, gone: t.gone })
            })
            .collect()
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
