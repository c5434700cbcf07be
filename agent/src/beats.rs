//! The heartbeat loop's decisions, pure: when a heartbeat goes out and what it carries (its
//! number, how many answers came late, the outcomes of probes), which probes the rendezvous'
//! answers start, and what the core hears. No I/O, no clock: `elastic.rs` (`heartbeat_loop`)
//! sends, probes and measures, and feeds the outcomes here; the tests drive it with made-up
//! answers.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use rlaunch_rendezvous::detector::{ProbeReport, ProbeRequest, Sent};

/// Most probes under way at once: a mass suspicion must not exhaust this agent's descriptors.
pub const MAX_PROBES: usize = 16;
/// Most heartbeats in flight at once: a heartbeat held up by a retransmission does not hold up
/// the next (each takes its own kept-alive connection), yet a rendezvous that answers nothing
/// is not sent an unbounded pile.
pub const MAX_IN_FLIGHT: usize = 6;
/// TCP probe attempts per probed node (each takes a nonce of its own, the UDP probe one more).
pub const PROBE_ATTEMPTS: u32 = 3;
/// A heartbeat answered this much over the fastest recent round trip was held up by a
/// retransmission (Linux waits at least 200 ms before resending a lost segment).
const SLOW_MARGIN: Duration = Duration::from_millis(150);
/// Round trips remembered to find the fastest.
const RTT_WINDOW: usize = 64;

/// What happens to the loop.
#[derive(Debug, Clone)]
pub enum Event {
    /// The heartbeat interval came round.
    Tick,
    /// Heartbeat `seq`'s answer after `rtt`: the probes the rendezvous asks for, or whether the
    /// error was transient (the probe outcomes it carried go again).
    Answered { seq: u64, result: Result<Vec<ProbeRequest>, Failed>, rtt: Duration },
    /// A probe's outcome.
    Probed(ProbeReport),
    /// Heartbeat `seq`'s task ended without an answer (it panicked).
    BeatLost { seq: u64 },
    /// A probe's task ended without an outcome.
    ProbeLost { node_id: String },
    /// What this node's peer watching reports changed: tell the rendezvous now.
    Urgent,
}

/// A heartbeat that was not answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failed {
    /// Unreachable, a timeout, a 5xx: outcomes it carried are sent again.
    pub transient: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send a heartbeat (the shell adds the ranks' waits).
    Send {
        sent: Sent,
        probes: Vec<ProbeReport>,
    },
    /// Probe a suspected node, with nonces from `nonce` on.
    Probe {
        req: ProbeRequest,
        nonce: u32,
    },
    /// Tell the core a heartbeat was answered, or not.
    Heard(Result<(), Failed>),
    Info(String),
}

/// Which heartbeat answers were late: the node's own view of its link, sent along so the
/// rendezvous can show each node's loss (over TCP a lost packet is a late answer, not a gap).
#[derive(Debug, Default, Clone)]
struct RoundTrips {
    recent: VecDeque<Duration>,
    slow: u64,
}

impl RoundTrips {
    fn answered(&mut self, rtt: Duration) {
        let fastest = self.recent.iter().min().copied();
        if fastest.is_some_and(|f| rtt > f + SLOW_MARGIN) {
            self.slow += 1;
        }
        if self.recent.len() == RTT_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(rtt);
    }
}

#[derive(Debug, Default, Clone)]
pub struct Beats {
    seq: u64,
    nonce: u32,
    in_flight: usize,
    rtts: RoundTrips,
    /// The latest outcome per probed node, to go with the next heartbeat.
    reports: BTreeMap<String, bool>,
    probing: BTreeSet<String>,
    /// Each node's latest outcome's number, and what each heartbeat in flight carries (with
    /// those numbers): an outcome goes again after a lost heartbeat only if none newer came.
    outcome: u64,
    latest: BTreeMap<String, u64>,
    carrying: BTreeMap<u64, Vec<(ProbeReport, u64)>>,
}

impl Beats {
    pub fn step(&mut self, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        let send_now = match event {
            Event::Tick => true,
            Event::Answered { seq, result, rtt } => {
                self.in_flight = self.in_flight.saturating_sub(1);
                let carried = self.carrying.remove(&seq).unwrap_or_default();
                match &result {
                    Ok(probe) => {
                        self.rtts.answered(rtt);
                        for req in probe {
                            if self.probing.len() < MAX_PROBES && self.probing.insert(req.node_id.clone()) {
                                self.nonce = self.nonce.wrapping_add(PROBE_ATTEMPTS + 1);
                                out.push(Action::Probe { req: req.clone(), nonce: self.nonce });
                            }
                        }
                    }
                    Err(Failed { transient: true }) => {
                        // Sent again, unless a newer outcome came meanwhile (sent or not).
                        for (r, n) in carried {
                            if self.latest.get(&r.node_id) == Some(&n) {
                                self.reports.entry(r.node_id).or_insert(r.reached);
                            }
                        }
                    }
                    Err(_) => {}
                }
                out.push(Action::Heard(result.map(|_| ())));
                false
            }
            Event::Probed(report) => {
                self.probing.remove(&report.node_id);
                if !report.reached {
                    out.push(Action::Info(format!("probe: could not reach the suspected node {}", report.node_id)));
                }
                self.outcome += 1;
                self.latest.insert(report.node_id.clone(), self.outcome);
                self.reports.insert(report.node_id, report.reached);
                // A probe's outcome goes out at once.
                true
            }
            Event::BeatLost { seq } => {
                self.in_flight = self.in_flight.saturating_sub(1);
                self.carrying.remove(&seq);
                false
            }
            Event::ProbeLost { node_id } => {
                self.probing.remove(&node_id);
                false
            }
            Event::Urgent => true,
        };
        if send_now && self.in_flight < MAX_IN_FLIGHT {
            self.seq += 1;
            self.in_flight += 1;
            let probes: Vec<ProbeReport> = std::mem::take(&mut self.reports)
                .into_iter()
                .map(|(node_id, reached)| ProbeReport { node_id, reached })
                .collect();
            if !probes.is_empty() {
                let numbered =
                    probes.iter().map(|r| (r.clone(), self.latest.get(&r.node_id).copied().unwrap_or(0))).collect();
                self.carrying.insert(self.seq, numbered);
            }
            out.push(Action::Send { sent: Sent { seq: self.seq, slow: self.rtts.slow }, probes });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(node: &str) -> ProbeRequest {
        ProbeRequest { node_id: node.into(), addr: format!("{node}:1").parse().unwrap() }
    }

    fn answered(seq: u64, probe: Vec<ProbeRequest>, rtt_ms: u64) -> Event {
        Event::Answered { seq, result: Ok(probe), rtt: Duration::from_millis(rtt_ms) }
    }

    fn sends(actions: &[Action]) -> Vec<(Sent, Vec<ProbeReport>)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { sent, probes } => Some((*sent, probes.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn answers_well_over_the_fastest_round_trip_count_as_slow() {
        let mut r = RoundTrips::default();
        for ms in [3, 2, 4, 2, 210, 3, 2, 420, 150] {
            r.answered(Duration::from_millis(ms));
        }
        // 210 and 420 waited for a retransmission; 150 is within the margin of 2 ms + 150 ms.
        assert_eq!(r.slow, 2);
        let mut first = RoundTrips::default();
        first.answered(Duration::from_millis(900));
        assert_eq!(first.slow, 0, "nothing to compare the first answer with");
    }

    #[test]
    fn a_heartbeat_goes_out_every_tick_numbered_without_waiting_for_answers_up_to_a_bound() {
        let mut b = Beats::default();
        let mut seqs = Vec::new();
        for _ in 0..10 {
            seqs.extend(sends(&b.step(Event::Tick)).into_iter().map(|(s, _)| s.seq));
        }
        assert_eq!(seqs, (1..=MAX_IN_FLIGHT as u64).collect::<Vec<_>>(), "at most {MAX_IN_FLIGHT} unanswered");
        let a = b.step(answered(1, vec![], 5));
        assert_eq!(a, vec![Action::Heard(Ok(()))], "an answer sends nothing by itself");
        assert_eq!(sends(&b.step(Event::Tick))[0].0.seq, MAX_IN_FLIGHT as u64 + 1);
        // A lost task frees its slot too.
        let _ = b.step(Event::BeatLost { seq: 2 });
        assert_eq!(sends(&b.step(Event::Tick)).len(), 1);
    }

    #[test]
    fn probes_asked_for_start_once_per_node_up_to_a_bound_and_their_outcomes_go_out_at_once() {
        let mut b = Beats::default();
        let _ = b.step(Event::Tick);
        let a = b.step(answered(1, vec![req("x"), req("y"), req("x")], 5));
        let probes: Vec<(String, u32)> = a
            .iter()
            .filter_map(|a| match a {
                Action::Probe { req, nonce } => Some((req.node_id.clone(), *nonce)),
                _ => None,
            })
            .collect();
        assert_eq!(probes.len(), 2, "x once: {probes:?}");
        assert!(probes[1].1 - probes[0].1 > PROBE_ATTEMPTS, "each probe's nonces are its own");
        let _ = b.step(Event::Tick);
        let again = b.step(answered(2, vec![req("x")], 5));
        assert!(!again.iter().any(|a| matches!(a, Action::Probe { .. })), "x is still being probed");
        let a = b.step(Event::Probed(ProbeReport { node_id: "x".into(), reached: false }));
        let sent = sends(&a);
        assert_eq!(sent.len(), 1, "the outcome goes out at once: {a:?}");
        assert_eq!(sent[0].1, vec![ProbeReport { node_id: "x".into(), reached: false }]);
        assert!(a.iter().any(|a| matches!(a, Action::Info(m) if m.contains('x'))));
        // Many suspects: no more than MAX_PROBES under way.
        let many: Vec<ProbeRequest> = (0..40).map(|i| req(&format!("n{i}"))).collect();
        let a = b.step(answered(3, many, 5));
        assert_eq!(a.iter().filter(|a| matches!(a, Action::Probe { .. })).count(), MAX_PROBES - 1, "y still runs");
    }

    #[test]
    fn outcomes_a_lost_heartbeat_carried_go_again_unless_a_newer_one_came() {
        let mut b = Beats::default();
        let probed = |b: &mut Beats, node: &str, reached: bool| {
            sends(&b.step(Event::Probed(ProbeReport { node_id: node.into(), reached })))[0].0.seq
        };
        let lost = |b: &mut Beats, seq: u64| {
            let a =
                b.step(Event::Answered { seq, result: Err(Failed { transient: true }), rtt: Duration::from_secs(1) });
            assert_eq!(a, vec![Action::Heard(Err(Failed { transient: true }))]);
        };
        let x_reached = probed(&mut b, "x", true);
        let y_missed = probed(&mut b, "y", false);
        // A newer outcome for x, sent (and answered) before the older heartbeat's loss is known.
        let x_missed = probed(&mut b, "x", false);
        let _ = b.step(answered(x_missed, vec![], 2));
        lost(&mut b, x_reached);
        lost(&mut b, y_missed);
        let sent = sends(&b.step(Event::Tick));
        assert_eq!(
            sent[0].1,
            vec![ProbeReport { node_id: "y".into(), reached: false }],
            "y's outcome goes again; x's stale 'reached' never overrides its newer 'missed'"
        );
        // A refusal (not transient) drops what it carried.
        let _ = b.step(Event::Answered {
            seq: sent[0].0.seq,
            result: Err(Failed { transient: false }),
            rtt: Duration::ZERO,
        });
        assert!(sends(&b.step(Event::Tick))[0].1.is_empty());
    }

    #[test]
    fn late_answers_are_counted_in_the_next_heartbeat() {
        let mut b = Beats::default();
        for rtt in [3, 2, 400] {
            let seq = sends(&b.step(Event::Tick))[0].0.seq;
            let _ = b.step(answered(seq, vec![], rtt));
        }
        assert_eq!(sends(&b.step(Event::Tick))[0].0.slow, 1);
    }
}
