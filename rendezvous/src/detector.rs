//! The failure detector: whether a node the rendezvous stopped hearing from is lost. Pure, like
//! [`crate::round`], which calls it: arrival times and `now` come in, verdicts go out.
//!
//! Two opinions before a verdict:
//!
//! 1. **Suspicion, from how late the heartbeats are** (phi accrual, as Cassandra and Akka use):
//!    the recent intervals between arrivals give a mean and a spread; `phi = -log10(P(a heartbeat
//!    comes later than this))` under a normal model. A node is suspected once phi passes
//!    [`PHI_THRESHOLD`] (once [`MIN_ARRIVALS`] heartbeats give a history), and at the latest once
//!    it has been silent for the node TTL. On a clean
//!    link that is about 1.3 s after the last heartbeat (heartbeat 0.5 s); on a lossy link the
//!    spread grows and suspicion waits longer, up to the TTL.
//! 2. **Indirect probes** (as in SWIM): a suspected node is probed directly by up to
//!    [`PROBERS`] other live members of its job, asked through the answers to their heartbeats.
//!    A node that answers any of them stays (suspected, not lost) and is probed again; a node
//!    nobody reached within the probe timeout — and silent for at least the TTL — is lost (also
//!    when there was nobody to ask). A node not heard from for [`SILENCE_LIMIT_TTLS`] TTLs is
//!    lost whatever the probes say: its own agent has stopped its workers by then (it fences
//!    after a TTL and 2 s without an answer, which is sooner for any TTL of 1 s or more).
//!
//! 3. **Peer watching** ([`peers`]), faster than both: members watch a few others over UDP and
//!    report a silence or a vanished agent at once; every watcher agreeing, with the rendezvous'
//!    own silence, is a verdict in well under a second. The two opinions above remain the
//!    backstop.
//!
//! A heartbeat clears a suspicion. Heartbeats carry a sequence number and the sender's count of
//! heartbeats whose answer came late (a retransmission: over TCP a lost packet shows as delay,
//! not as a gap), so the rendezvous knows each node's heartbeat loss rate (shown in status and
//! metrics) before it costs anything.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Milliseconds on the caller's clock (the same `u64` as the round's `Millis`; defined here so
/// that the detector imports nothing of the round that calls it).
pub type Millis = u64;
use rlaunch::contract::HostPort;

/// phi at which a node is suspected: the chance that a live node's heartbeat is this late is
/// 10^-8 under the fitted model.
pub const PHI_THRESHOLD: f64 = 8.0;
/// How many arrivals the interval statistics remember.
pub const WINDOW: usize = 32;
/// Arrivals needed before phi is trusted; until then only the TTL suspects a node.
pub const MIN_ARRIVALS: usize = 8;
/// Most members asked to probe one suspected node.
pub const PROBERS: usize = 3;
/// A node silent for this many TTLs is lost even while probes reach it.
pub const SILENCE_LIMIT_TTLS: u64 = 3;

/// The detector's timing, from the job's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How often nodes send heartbeats.
    pub interval: Millis,
    /// Silence after which a node is suspected whatever phi says.
    pub ttl: Millis,
    /// How long a suspicion's probes may take before the verdict.
    pub probe_timeout: Millis,
    /// How often watchers ping the members they watch (0: no peer watching).
    pub peer_interval: Millis,
    /// Silence (to every source) below which no node is lost through its watchers.
    pub stall_bound: Millis,
}

impl Timing {
    /// The silence after which a node without known arrivals is suspected: the TTL less the
    /// probe timeout, and never within 2.5 intervals.
    pub fn early_suspicion(&self) -> Millis {
        self.ttl.saturating_sub(self.probe_timeout).max(self.interval.saturating_mul(5) / 2)
    }

    /// The smallest spread the model assumes: a clean link has almost none, and a verdict that
    /// trusted that would suspect a node for one late tick.
    fn min_std(&self) -> f64 {
        (self.interval as f64 * 0.3).max(20.0)
    }

    /// Silence after which a node is lost even while probes reach it.
    pub fn silence_limit(&self) -> Millis {
        self.ttl.saturating_mul(SILENCE_LIMIT_TTLS)
    }
}

/// What a node says of the heartbeats it has sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sent {
    /// This heartbeat's number (one per heartbeat sent).
    pub seq: u64,
    /// How many of the heartbeats sent before this one were answered late (a round trip well
    /// over the node's fastest: a packet retransmitted).
    #[serde(default)]
    pub slow: u64,
}

/// One heartbeat as it arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    /// What the sender said, when it says it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent: Option<Sent>,
    pub at: Millis,
}

/// A node's suspicion under way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Suspicion {
    /// When it began.
    pub since: Millis,
    /// When the current probes' time is up.
    pub deadline: Millis,
    /// Members asked to probe, that have not answered yet.
    pub asked: Vec<String>,
    /// A member that reached the node in this probe round.
    pub reached_by: Option<String>,
    /// Members that could not reach it in this probe round.
    pub missed_by: Vec<String>,
    /// Probe rounds so far (the first included).
    pub rounds: u32,
}

/// What the rendezvous knows of one node's liveness besides when it last heard from it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// Recent arrivals, oldest first (never written to etcd, where leases stand for heartbeats).
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub arrivals: VecDeque<Arrival>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspicion: Option<Suspicion>,
    /// Probes of this node that reached it / did not, over the job's life.
    #[serde(default)]
    pub probes_reached: u64,
    #[serde(default)]
    pub probes_missed: u64,
    /// Each watcher's latest report on this node ([`peers`]), while fresh.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub peers: std::collections::BTreeMap<String, peers::Evidence>,
}

/// One probe request for a member: reach `node_id` at `addr` and say whether it answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeRequest {
    pub node_id: String,
    pub addr: HostPort,
}

/// One probe's outcome, as the prober reports it with a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeReport {
    pub node_id: String,
    pub reached: bool,
}

/// The verdict on a node at some time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Alive,
    /// Suspected: probes are under way, or some member reached it.
    Suspected,
    Lost,
}

impl Health {
    /// Records a heartbeat at `at`: it clears any suspicion.
    pub fn arrived(&mut self, sent: Option<Sent>, at: Millis) {
        if self.arrivals.len() == WINDOW {
            self.arrivals.pop_front();
        }
        self.arrivals.push_back(Arrival { sent, at });
        self.suspicion = None;
    }

    /// Mean and standard deviation of the recent intervals between arrivals, in ms; the
    /// heartbeat interval (and the smallest spread) until a few intervals are known.
    pub fn intervals(&self, t: &Timing) -> (f64, f64) {
        let n = self.arrivals.len();
        let expected = t.interval as f64;
        if n < MIN_ARRIVALS {
            return (expected, t.min_std().max(expected / 4.0));
        }
        let gaps: Vec<f64> = self
            .arrivals
            .iter()
            .zip(self.arrivals.iter().skip(1))
            .map(|(a, b)| b.at.saturating_sub(a.at) as f64)
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / gaps.len() as f64;
        // Several heartbeats in flight arrive in bursts: the mean is never below the interval.
        (mean.max(expected), var.sqrt().max(t.min_std()))
    }

    /// How surprising the silence since `last` is at `now` (0 = not at all).
    pub fn phi(&self, last: Millis, now: Millis, t: &Timing) -> f64 {
        let (mean, std) = self.intervals(t);
        phi(now.saturating_sub(last) as f64, mean, std)
    }

    /// The share of recent heartbeats that were lost: never arrived (gaps in the sequence
    /// numbers), or arrived after a retransmission (the sender's count of late answers).
    pub fn loss_rate(&self) -> Option<f64> {
        let sent: Vec<Sent> = self.arrivals.iter().filter_map(|a| a.sent).collect();
        let lo = sent.iter().min_by_key(|s| s.seq)?;
        let hi = sent.iter().max_by_key(|s| s.seq)?;
        let span = hi.seq.checked_sub(lo.seq)?;
        if span == 0 {
            return None;
        }
        // Heartbeats lo+1 ..= hi: those that never came, and those that came late.
        let arrived = sent.iter().filter(|s| s.seq > lo.seq).count() as u64;
        let missing = span.saturating_sub(arrived);
        let late = hi.slow.saturating_sub(lo.slow);
        Some(((missing + late) as f64 / span as f64).min(1.0))
    }

    /// Whether the node should now be suspected (not yet suspected, silent since `last`, or
    /// never heard from when `last` is `None`).
    pub fn suspect_due(&self, last: Option<Millis>, now: Millis, t: &Timing) -> bool {
        if self.suspicion.is_some() {
            return false;
        }
        match last {
            None => true,
            Some(last) => {
                let silence = now.saturating_sub(last);
                // phi cannot reach the threshold within 2.5 intervals (the mean is at least the
                // interval, the spread at least 0.3 of it): most ticks stop here.
                silence >= t.ttl
                    // Where no arrival times are kept (etcd), at the TTL less the probes' time:
                    // the probes end about when the TTL does.
                    || (self.arrivals.is_empty() && silence >= t.early_suspicion())
                    || (silence > t.interval.saturating_mul(5) / 2
                        && self.arrivals.len() >= MIN_ARRIVALS
                        && self.phi(last, now, t) >= PHI_THRESHOLD)
            }
        }
    }

    /// The verdict at `now` given the last arrival.
    pub fn verdict(&self, last: Option<Millis>, now: Millis, t: &Timing) -> Verdict {
        // Without a last arrival (on etcd: the key is gone), the node fell silent at least the
        // early-suspicion silence before it was first suspected (a TTL where arrivals are kept).
        let before = if self.arrivals.is_empty() { t.early_suspicion() } else { t.ttl };
        let silent_since = last.or_else(|| self.suspicion.as_ref().map(|s| s.since.saturating_sub(before)));
        let silent_too_long = silent_since.is_none_or(|l| now.saturating_sub(l) >= t.silence_limit());
        // phi may start the probes early, but a node is never lost before a TTL of silence.
        let past_ttl = silent_since.is_none_or(|l| now.saturating_sub(l) >= t.ttl);
        match &self.suspicion {
            None if self.suspect_due(last, now, t) => Verdict::Suspected,
            None => Verdict::Alive,
            Some(s) if now < s.deadline || !past_ttl => Verdict::Suspected,
            Some(s) if s.reached_by.is_some() && !silent_too_long => Verdict::Suspected,
            Some(_) => Verdict::Lost,
        }
    }

    /// Starts a suspicion (or the next probe round of one a member reached) at `now`, asking
    /// `probers`.
    pub fn suspect(&mut self, probers: Vec<String>, now: Millis, t: &Timing) {
        let rounds = self.suspicion.as_ref().map_or(0, |s| s.rounds);
        let since = self.suspicion.as_ref().map_or(now, |s| s.since);
        self.suspicion = Some(Suspicion {
            since,
            deadline: now.saturating_add(t.probe_timeout),
            asked: probers,
            reached_by: None,
            missed_by: Vec::new(),
            rounds: rounds + 1,
        });
    }

    /// Takes a probe's outcome from `prober`; false when it was not asked (a stale or unasked
    /// report changes nothing).
    pub fn probed(&mut self, prober: &str, reached: bool) -> bool {
        let Some(s) = &mut self.suspicion else { return false };
        let Some(i) = s.asked.iter().position(|p| p == prober) else { return false };
        s.asked.remove(i);
        if reached {
            self.probes_reached += 1;
            s.reached_by.get_or_insert_with(|| prober.to_owned());
        } else {
            self.probes_missed += 1;
            s.missed_by.push(prober.to_owned());
        }
        true
    }

    /// Whether `prober` still owes an answer about this node.
    pub fn asks(&self, prober: &str) -> bool {
        self.suspicion.as_ref().is_some_and(|s| s.asked.iter().any(|p| p == prober))
    }
}

/// phi for a silence of `elapsed` ms given the intervals' `mean` and `std` (a logistic
/// approximation of the normal distribution's tail, as Akka's detector uses).
pub fn phi(elapsed: f64, mean: f64, std: f64) -> f64 {
    let y = (elapsed - mean) / std;
    let e = (-y * (1.5976 + 0.070566 * y * y)).exp();
    let p_later = if elapsed > mean { e / (1.0 + e) } else { 1.0 - 1.0 / (1.0 + e) };
    if p_later <= 0.0 || !p_later.is_finite() {
        // So late that the tail underflows.
        return f64::MAX;
    }
    -p_later.log10()
}

pub mod peers;
pub use peers::PeerReport;

#[cfg(test)]
mod tests;
