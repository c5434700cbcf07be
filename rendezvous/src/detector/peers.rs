//! Peer watching, the fast half of the detector: during a round each agent pings a few other
//! members' agents ([`watch_offsets`]) over UDP every `peer_interval` and tells the rendezvous at
//! once, with a heartbeat, when one of them falls silent or its host answers that nothing listens
//! there any more. The rendezvous believes such a report only from a node assigned to watch
//! that target, and declares the target lost only when **every** watcher it still trusts
//! reports it, freshly, and either
//!
//! - one of them saw its agent **gone** (ICMP port unreachable or a refused connection: the
//!   host lives, the agent does not) after the rendezvous last heard the node, or
//! - no watcher has heard the node for the stall bound, and its heartbeats to the rendezvous
//!   are overdue ([`Timing::overdue`]).
//!
//! A watcher reports a silence only once it is unlikely under the loss it measures on that
//! link (`agent/src/peers.rs`), and never before the stall bound plus a ping; so a lossy link
//! delays the report, and a heartbeat that reaches the rendezvous refutes it. Everything
//! before (heartbeats, phi, indirect probes) stays as the backstop: a node whose watchers are
//! all lost with it, or that nobody watches (a job of one node), is found as before.

use serde::{Deserialize, Serialize};

use super::{Health, Millis, Timing};

/// What a watcher says of a member it watches. Sent at once when it starts, then with every
/// heartbeat while it holds (a report lost with its heartbeat goes again).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerReport {
    pub node_id: String,
    /// How long before the report was sent the node last answered the watcher (its clock).
    pub silent_ms: u64,
    /// The node's host answered that nothing listens at the node's probe endpoint.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gone: bool,
}

/// Most reports one heartbeat may carry that are read (a node watches at most two).
pub const MAX_REPORTS: usize = 4;

/// One watcher's latest report, on the rendezvous' clock (stored with the job on etcd, so that
/// the replica that ticks, or hears the second watcher, sees it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// When the watcher last heard the node (the report's arrival less its silence: transit
    /// only makes the silence look shorter than it was).
    pub last_sign: Millis,
    pub gone: bool,
    /// When the report arrived.
    pub at: Millis,
    /// The number of the heartbeat that carried it, when known: an older heartbeat arriving
    /// late does not undo a newer report (a watcher taking its report back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

/// Where, after a member in the ring of a round's members (group-rank order), the members it
/// watches are: the next one and the one half the ring away (so that a rack of consecutive
/// ranks lost together still leaves each lost node a watcher elsewhere); fewer in small rounds
/// (none alone, one of two).
pub fn watch_offsets(n: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(2);
    for o in [1, n.div_ceil(2)] {
        if n > 1 && o % n != 0 && !out.contains(&(o % n)) {
            out.push(o % n);
        }
    }
    out
}

impl Timing {
    /// How long a report counts without being repeated: the watcher repeats it with every
    /// heartbeat.
    pub fn evidence_fresh(&self) -> Millis {
        self.interval.saturating_mul(2).max(self.stall_bound)
    }

    /// The rendezvous' own silence that agrees with a watcher's report of a silence: a heartbeat
    /// overdue by half the stall bound (heartbeats come every interval, so a shorter silence
    /// says nothing).
    pub fn overdue(&self) -> Millis {
        self.interval.saturating_add(self.stall_bound / 2)
    }

    /// Silence at the rendezvous after which a watcher is not trusted to report (it is likely
    /// lost itself, or cut off with its target).
    pub fn watcher_silence(&self) -> Millis {
        self.interval.saturating_add(self.stall_bound)
    }
}

impl Health {
    /// Takes `watcher`'s report at `now`, carried by its heartbeat `seq` (the caller checked
    /// that it watches this node); a report from an older heartbeat than the one held is
    /// ignored.
    pub fn reported(&mut self, watcher: &str, r: &PeerReport, seq: Option<u64>, now: Millis) {
        let held = self.peers.get(watcher).and_then(|e| e.seq);
        if held.zip(seq).is_some_and(|(held, seq)| seq < held) {
            return;
        }
        let e = Evidence { last_sign: now.saturating_sub(r.silent_ms), gone: r.gone, at: now, seq };
        self.peers.insert(watcher.to_owned(), e);
    }

    /// Whether the node is lost at `now` by its watchers' reports: every one of `watchers` (those
    /// the rendezvous trusts now; none: never) reports it within [`Timing::evidence_fresh`], and
    /// one saw its agent gone after `last` (the rendezvous' last heartbeat from it), or no
    /// watcher has heard it for the stall bound and its heartbeats are overdue.
    pub fn lost_to_peers(&self, watchers: &[&str], last: Option<Millis>, now: Millis, t: &Timing) -> bool {
        if t.peer_interval == 0 || watchers.is_empty() {
            return false;
        }
        let mut sign = last.unwrap_or(0);
        let mut gone = false;
        for w in watchers {
            let Some(e) = self.peers.get(*w) else { return false };
            if now.saturating_sub(e.at) > t.evidence_fresh() {
                return false;
            }
            sign = sign.max(e.last_sign);
            gone |= e.gone && last.is_none_or(|l| e.at >= l);
        }
        let own = last.is_none_or(|l| now.saturating_sub(l) >= t.overdue());
        gone || (own && now.saturating_sub(sign) >= t.stall_bound)
    }

    /// Forgets reports no longer fresh at `now`.
    pub fn forget_stale_reports(&mut self, now: Millis, t: &Timing) {
        self.peers.retain(|_, e| now.saturating_sub(e.at) <= t.evidence_fresh());
    }

    /// The latest sign of life a watcher reported (a loss is dated from the latest of this and
    /// the last heartbeat).
    pub fn last_peer_sign(&self) -> Option<Millis> {
        self.peers.values().map(|e| e.last_sign).max()
    }

    /// The watchers' reports in words, for the loss's reason.
    pub fn peer_detail(&self, now: Millis) -> Option<String> {
        if self.peers.is_empty() {
            return None;
        }
        let parts: Vec<String> = self
            .peers
            .iter()
            .map(|(w, e)| {
                let what = if e.gone { "its agent gone" } else { "silent" };
                format!("{w}: {what}, last answered {} ms ago", now.saturating_sub(e.last_sign))
            })
            .collect();
        Some(parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timing = Timing { interval: 500, ttl: 2000, probe_timeout: 1000, peer_interval: 100, stall_bound: 500 };

    fn said(h: &mut Health, watcher: &str, silent_ms: u64, gone: bool, now: Millis) {
        h.reported(watcher, &PeerReport { node_id: "t".into(), silent_ms, gone }, None, now);
    }

    #[test]
    fn watchers_sit_at_the_next_place_and_half_the_ring_away() {
        assert!(watch_offsets(0).is_empty());
        assert!(watch_offsets(1).is_empty());
        assert_eq!(watch_offsets(2), [1]);
        assert_eq!(watch_offsets(3), [1, 2]);
        assert_eq!(watch_offsets(4), [1, 2]);
        assert_eq!(watch_offsets(10_000), [1, 5000]);
    }

    #[test]
    fn every_trusted_watcher_must_agree_and_the_heartbeats_be_overdue() {
        let mut h = Health::default();
        // Heartbeat at 1000; both watchers last heard it at 1050.
        said(&mut h, "w1", 600, false, 1650);
        assert!(!h.lost_to_peers(&["w1", "w2"], Some(1000), 1800, &T), "w2 has said nothing");
        said(&mut h, "w2", 700, false, 1750);
        assert!(h.lost_to_peers(&["w1", "w2"], Some(1000), 1800, &T));
        assert!(!h.lost_to_peers(&["w1", "w2"], Some(1100), 1800, &T), "a heartbeat 700 ms ago is not overdue");
        assert!(!h.lost_to_peers(&[], Some(1000), 1800, &T), "nobody watching: never");
        let off = Timing { peer_interval: 0, ..T };
        assert!(!h.lost_to_peers(&["w1", "w2"], Some(1000), 1800, &off));
        // Stale reports count no more.
        assert!(!h.lost_to_peers(&["w1", "w2"], Some(1000), 1650 + T.evidence_fresh() + 1, &T));
        // A watcher that heard the node recently holds it even with the heartbeats overdue.
        said(&mut h, "w2", 100, false, 1750);
        assert!(!h.lost_to_peers(&["w1", "w2"], Some(1000), 1800, &T));
        assert_eq!(h.last_peer_sign(), Some(1650));
    }

    #[test]
    fn a_gone_agent_needs_no_silence_but_a_report_newer_than_the_last_heartbeat() {
        let mut h = Health::default();
        said(&mut h, "w", 40, true, 1020);
        let d = h.peer_detail(1020).unwrap();
        assert!(d.contains("w: its agent gone, last answered 40 ms ago"), "{d}");
        assert!(h.lost_to_peers(&["w"], Some(1000), 1020, &T));
        assert!(!h.lost_to_peers(&["w"], Some(1030), 1040, &T), "heard after the report");
        // A watcher's newer heartbeat said it hears the node again; an older one arriving late
        // does not bring the report back.
        let r = |silent_ms, gone| PeerReport { node_id: "t".into(), silent_ms, gone };
        h.reported("w", &r(0, false), Some(9), 1100);
        h.reported("w", &r(900, true), Some(8), 1110);
        assert!(!h.peers["w"].gone && h.peers["w"].last_sign == 1100, "{:?}", h.peers["w"]);
        h.reported("w", &r(100, true), Some(10), 1200);
        assert!(h.peers["w"].gone);
    }
}
