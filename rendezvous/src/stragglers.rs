//! The slowest rank of each job, from what heartbeats carry: each node reports, per local rank,
//! how long the rank waited in its buckets' all-reduces per step over its last steps (the Rust
//! runtime's `Ddp` measures it, see `rlaunch::heartbeat::StepStats`). The rank that waits least
//! is the one the others wait for; how much later it arrives is the most any rank waits minus
//! its own wait. Waits need no clock agreement between hosts. Pure, with made-up clocks in the
//! tests; each service process knows what the heartbeats it served said.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Milliseconds, as the round machine counts them (`round::Millis`, the same `u64`): named
/// here so that this module imports nothing of `round`, which shows its answer in status.
pub type Millis = u64;

/// One rank's wait, as its node reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankWait {
    pub rank: u32,
    /// Mean time per step in all-reduces, in µs, over the rank's last `window` steps.
    pub mean_wait_us: u64,
    pub window: u32,
}

/// The rank the others wait for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Straggler {
    pub rank: u32,
    pub node_id: String,
    /// How much later than the earliest rank it arrives, per step, on average (ms).
    pub late_ms: f64,
    /// Ranks compared.
    pub ranks: usize,
}

/// Reports older than this are not compared (a node gone, a round over).
pub const FRESH_MS: Millis = 30_000;
/// Ranks one heartbeat may report.
pub const MAX_RANKS_PER_BEAT: usize = 256;

#[derive(Debug, Default)]
pub struct Stragglers {
    jobs: HashMap<String, HashMap<String, (Millis, Vec<RankWait>)>>,
}

impl Stragglers {
    /// Keeps `node_id`'s latest report of its own ranks, `own` (the span the running round gave
    /// it): a rank outside it, or one named twice, is dropped, so no node can name another's
    /// rank the straggler. Ranks beyond [`MAX_RANKS_PER_BEAT`] are dropped too.
    pub fn record(
        &mut self,
        run_id: &str,
        node_id: &str,
        mut waits: Vec<RankWait>,
        own: std::ops::Range<u32>,
        now: Millis,
    ) {
        waits.truncate(MAX_RANKS_PER_BEAT);
        let mut seen = std::collections::HashSet::new();
        waits.retain(|w| w.window > 0 && own.contains(&w.rank) && seen.insert(w.rank));
        if waits.is_empty() {
            return;
        }
        self.jobs.entry(run_id.to_owned()).or_default().insert(node_id.to_owned(), (now, waits));
    }

    /// The slowest rank of `run_id` among fresh reports, once at least two ranks are known.
    pub fn slowest(&self, run_id: &str, now: Millis) -> Option<Straggler> {
        let nodes = self.jobs.get(run_id)?;
        let fresh = nodes.iter().filter(|(_, (at, _))| now.saturating_sub(*at) <= FRESH_MS);
        let mut ranks = 0usize;
        let mut most = 0u64;
        let mut least: Option<(u64, u32, &str)> = None;
        for (node, (_, waits)) in fresh {
            for w in waits {
                ranks += 1;
                most = most.max(w.mean_wait_us);
                if least.is_none_or(|(us, rank, _)| (w.mean_wait_us, w.rank) < (us, rank)) {
                    least = Some((w.mean_wait_us, w.rank, node));
                }
            }
        }
        let (us, rank, node) = least?;
        (ranks >= 2).then(|| Straggler { rank, node_id: node.to_owned(), late_ms: (most - us) as f64 / 1000.0, ranks })
    }

    /// Every job with a straggler now, by run id.
    pub fn all(&self, now: Millis) -> Vec<(String, Straggler)> {
        let mut out: Vec<(String, Straggler)> =
            self.jobs.keys().filter_map(|id| self.slowest(id, now).map(|s| (id.clone(), s))).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Forgets a job's reports (its round changed: ranks are numbered anew).
    pub fn forget(&mut self, run_id: &str) {
        self.jobs.remove(run_id);
    }

    /// Forgets reports that are no longer fresh, and jobs left without any.
    pub fn prune(&mut self, now: Millis) {
        for nodes in self.jobs.values_mut() {
            nodes.retain(|_, (at, _)| now.saturating_sub(*at) <= FRESH_MS);
        }
        self.jobs.retain(|_, nodes| !nodes.is_empty());
    }

    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(rank: u32, ms: u64) -> RankWait {
        RankWait { rank, mean_wait_us: ms * 1000, window: 20 }
    }

    #[test]
    fn the_rank_that_waits_least_is_the_straggler_across_nodes() {
        let mut s = Stragglers::default();
        s.record("j", "a", vec![w(0, 50), w(1, 48)], 0..2, 0);
        assert_eq!(s.slowest("j", 0).map(|x| x.rank), Some(1), "within one node too");
        s.record("j", "b", vec![w(2, 2), w(3, 49)], 2..4, 100);
        let slow = s.slowest("j", 200).expect("a straggler");
        assert_eq!((slow.rank, slow.node_id.as_str(), slow.late_ms, slow.ranks), (2, "b", 48.0, 4));
        // A newer report replaces the node's last one.
        s.record("j", "b", vec![w(2, 45), w(3, 49)], 2..4, 300);
        assert_eq!(s.slowest("j", 300).map(|x| (x.rank, x.late_ms)), Some((2, 5.0)));
    }

    #[test]
    fn stale_reports_and_lone_ranks_name_nobody_and_are_forgotten() {
        let mut s = Stragglers::default();
        s.record("j", "a", vec![w(0, 10)], 0..1, 0);
        assert_eq!(s.slowest("j", 0), None, "one rank is nobody's straggler");
        s.record("j", "b", vec![w(1, 1)], 1..2, 0);
        assert!(s.slowest("j", FRESH_MS).is_some());
        assert_eq!(s.slowest("j", FRESH_MS + 1), None);
        s.record("k", "c", vec![RankWait { rank: 0, mean_wait_us: 5, window: 0 }], 0..1, 0);
        assert_eq!(s.jobs(), 1, "a report without steps is no report");
        s.prune(FRESH_MS + 1);
        assert_eq!(s.jobs(), 0);
        let many: Vec<RankWait> = (0..1000).map(|r| w(r, 1)).collect();
        s.record("j", "a", many, 0..1000, 0);
        assert_eq!(s.slowest("j", 0).map(|x| x.ranks), Some(MAX_RANKS_PER_BEAT));
    }

    #[test]
    fn a_node_names_only_its_own_ranks() {
        let mut s = Stragglers::default();
        s.record("j", "a", vec![w(0, 50), w(1, 49)], 0..2, 0);
        // Node b runs ranks 2 and 3 but claims ranks 0 and 1 waited least, and names its own
        // rank 2 twice.
        s.record("j", "b", vec![w(0, 1), w(1, 1), w(2, 40), w(2, 0), w(3, 45)], 2..4, 0);
        let slow = s.slowest("j", 0).expect("a straggler");
        assert_eq!((slow.rank, slow.node_id.as_str(), slow.ranks), (2, "b", 4), "{slow:?}");
        assert_eq!(slow.late_ms, 10.0, "rank 2 as first named (40 ms), not the repeat");
        // A node with no span in the round (not a member) records nothing.
        s.record("k", "c", vec![w(0, 1), w(1, 2)], 0..0, 0);
        assert_eq!(s.slowest("k", 0), None);
    }
}
