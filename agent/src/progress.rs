//! How far this node got in the running round, for the rendezvous' recovery accounting: when
//! its workers were started, when its ranks loaded the step their snapshots restore, when they
//! saved a step, and when they saved again the newest step saved here before the round.
//!
//! Only this node's own ranks of the round count: a worker may load another rank's part
//! (`load(rank=k)`, resharding to a new world size) or name any rank, and that rank's part
//! loaded here says nothing of whether this node's ranks are restored.
//!
//! [`RoundProgress`] is pure (instants are milliseconds of a clock the caller passes); the
//! [`Tracker`] around it is what the driver and the snapshot store share, and wakes the task
//! that reports to the rendezvous when something new is known.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use rlaunch::contract::{NodeProgress, StepAgo};

/// Steps whose savers are remembered (a step is whole when every local rank saved it).
const STEPS_KEPT: usize = 8;

/// One round's progress on this node.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RoundProgress {
    round: Option<u64>,
    /// This node's ranks of the round (global ranks): the only ones that count.
    ranks: Range<u32>,
    started: Option<u64>,
    /// Ranks that asked for their state; when the last did.
    asked: BTreeSet<u32>,
    ready: Option<u64>,
    /// Ranks whose part was loaded, and the step.
    loaded: BTreeMap<u32, u64>,
    restored: Option<(u64, u64)>,
    /// Per recent step, the local ranks that saved it.
    saved: BTreeMap<u64, BTreeSet<u32>>,
    first_step: Option<(u64, u64)>,
    caught_up: Option<(u64, u64)>,
    /// The newest step every local rank saved before this round.
    step_before: Option<u64>,
    /// The newest step every local rank saved, in any round.
    newest: Option<u64>,
    /// This node's ranks that kept their process into the round (`rlaunch.resilient`).
    kept: u32,
}

impl RoundProgress {
    /// Round `round` started this node's workers, of global ranks `ranks`, at `now`; `kept`
    /// of them are processes kept from the last round.
    pub fn begin(&mut self, round: u64, ranks: Range<u32>, kept: u32, now: u64) {
        *self = RoundProgress {
            round: Some(round),
            ranks,
            started: Some(now),
            step_before: self.newest,
            newest: self.newest,
            kept,
            ..RoundProgress::default()
        };
    }

    /// The round's workers are gone (stopped or ended): nothing more is reported for it.
    pub fn end(&mut self) {
        self.round = None;
    }

    /// How many of this node's ranks there are (each must count for a milestone).
    fn local(&self) -> usize {
        self.ranks.len().max(1)
    }

    /// Rank `rank` asked for its part (its program is up). True when it was the last of this
    /// node's ranks to.
    pub fn asked(&mut self, rank: u32, now: u64) -> bool {
        if self.round.is_none() || self.ready.is_some() || !self.ranks.contains(&rank) {
            return false;
        }
        self.asked.insert(rank);
        if self.asked.len() < self.local() {
            return false;
        }
        self.ready = Some(now);
        true
    }

    /// Rank `rank`'s part of `step` was loaded (`None`: nothing to restore). True when it
    /// completed what this node restores: a part of a rank not this node's counts for nothing.
    pub fn loaded(&mut self, rank: u32, step: Option<u64>, now: u64) -> bool {
        let ours = self.round.is_some() && self.restored.is_none() && self.ranks.contains(&rank);
        let Some(step) = step.filter(|_| ours) else { return false };
        self.loaded.insert(rank, step);
        if self.loaded.len() < self.local() {
            return false;
        }
        let oldest = self.loaded.values().copied().min().unwrap_or(step);
        self.restored = Some((oldest, now));
        true
    }

    /// Rank `rank` saved `step`. True when that made something new known.
    pub fn saved(&mut self, rank: u32, step: u64, now: u64) -> bool {
        if self.round.is_none() || !self.ranks.contains(&rank) {
            return false;
        }
        let local = self.local();
        let savers = self.saved.entry(step).or_default();
        savers.insert(rank);
        let whole = savers.len() >= local;
        while self.saved.len() > STEPS_KEPT {
            self.saved.pop_first();
        }
        if !whole {
            return false;
        }
        self.newest = self.newest.max(Some(step));
        let mut changed = false;
        if self.first_step.is_none() {
            self.first_step = Some((step, now));
            changed = true;
        }
        if self.caught_up.is_none() && self.step_before.is_some_and(|before| step >= before) {
            self.caught_up = Some((step, now));
            changed = true;
        }
        changed
    }

    /// What to report at `now`: the round and its progress, each instant as "so long ago".
    pub fn report(&self, now: u64) -> Option<(u64, NodeProgress)> {
        let round = self.round?;
        let ago = |at: u64| now.saturating_sub(at);
        let step = |s: Option<(u64, u64)>| s.map(|(step, at)| StepAgo { step, ago_ms: ago(at) });
        Some((
            round,
            NodeProgress {
                started_ago_ms: self.started.map(ago),
                ready_ago_ms: self.ready.map(ago),
                restored: step(self.restored),
                first_step: step(self.first_step),
                step_before: self.step_before,
                caught_up: step(self.caught_up),
                kept_ranks: self.started.map(|_| self.kept),
            },
        ))
    }

    /// Which milestones are known (what a report adds to the last one sent).
    pub fn known(&self) -> Known {
        let has = [
            self.started,
            self.ready,
            self.restored.map(|r| r.1),
            self.first_step.map(|f| f.1),
            self.caught_up.map(|c| c.1),
        ];
        (self.round, has.map(|h| h.is_some()))
    }
}

/// What to report (the round and its progress, each instant as "so long ago") and which
/// milestones it covers.
pub type Snapshot = (Option<(u64, NodeProgress)>, Known);

/// The round and which milestones are known (started, ready, restored, first step, caught up).
pub type Known = (Option<u64>, [bool; 5]);

/// The node's [`RoundProgress`], shared by the driver and the snapshot store.
#[derive(Debug)]
pub struct Tracker {
    state: Mutex<RoundProgress>,
    changed: tokio::sync::Notify,
    clock: Instant,
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker {
            state: Mutex::new(RoundProgress::default()),
            changed: tokio::sync::Notify::new(),
            clock: Instant::now(),
        }
    }
}

impl Tracker {
    fn now(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn update(&self, f: impl FnOnce(&mut RoundProgress, u64) -> bool) {
        let now = self.now();
        let changed = f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner), now);
        if changed {
            self.changed.notify_one();
        }
    }

    /// Round `round` starts this node's workers, of global ranks `ranks`; `kept` of them
    /// keep their process from the last round.
    pub fn begin(&self, round: u64, ranks: Range<u32>, kept: u32) {
        self.update(|p, now| {
            p.begin(round, ranks, kept, now);
            true
        });
    }

    pub fn end(&self) {
        self.update(|p, _| {
            p.end();
            false
        });
    }

    pub fn asked(&self, rank: u32) {
        self.update(|p, now| p.asked(rank, now));
    }

    pub fn loaded(&self, rank: u32, step: Option<u64>) {
        self.update(|p, now| p.loaded(rank, step, now));
    }

    pub fn saved(&self, rank: u32, step: u64) {
        self.update(|p, now| p.saved(rank, step, now));
    }

    /// Waits until something new is known, then answers what to report and what it covers.
    pub async fn next(&self) -> Snapshot {
        self.changed.notified().await;
        let now = self.now();
        let p = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        (p.report(now), p.known())
    }

    /// What is known now, without waiting.
    pub fn current(&self) -> Snapshot {
        let now = self.now();
        let p = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        (p.report(now), p.known())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_reports_start_restore_first_step_and_catching_up_each_once() {
        let mut p = RoundProgress::default();
        assert_eq!(p.report(0), None, "nothing before a round");
        // Round 1: two ranks save steps 1..=5; rank 1 also saves 6 before the fault.
        p.begin(1, 0..2, 0, 100);
        for step in 1..=5 {
            p.saved(0, step, 100 + step * 10);
            p.saved(1, step, 100 + step * 10);
        }
        p.saved(1, 6, 170);
        let (round, r) = p.report(200).unwrap();
        assert_eq!((round, r.started_ago_ms, r.step_before), (1, Some(100), None));
        assert_eq!(r.first_step, Some(StepAgo { step: 1, ago_ms: 90 }));
        assert_eq!(r.caught_up, None, "nothing saved before the first round");
        p.end();
        assert_eq!(p.report(210), None);

        // Round 2 restores step 4 (the last committed everywhere), redoes 5, then goes on.
        p.begin(2, 0..2, 0, 1000);
        assert!(!p.asked(0, 1400) && p.asked(1, 1450) && !p.asked(1, 1460), "ready once, with the last rank");
        assert!(!p.loaded(0, Some(4), 1500), "one of two ranks");
        assert!(p.loaded(1, Some(4), 1600));
        assert!(!p.loaded(1, Some(4), 1700), "restored once");
        assert!(!p.saved(0, 5, 1800));
        assert!(p.saved(1, 5, 1810), "the first step, and step 5 (the newest whole before) again");
        let (round, r) = p.report(2000).unwrap();
        assert_eq!((round, r.started_ago_ms, r.step_before), (2, Some(1000), Some(5)));
        assert_eq!((r.ready_ago_ms, r.restored), (Some(550), Some(StepAgo { step: 4, ago_ms: 400 })));
        assert_eq!(r.first_step, Some(StepAgo { step: 5, ago_ms: 190 }));
        assert_eq!(r.caught_up, Some(StepAgo { step: 5, ago_ms: 190 }));
        assert!(!p.saved(0, 6, 1900) && !p.saved(1, 6, 1910), "nothing new after catching up");
    }

    #[test]
    fn only_this_nodes_own_ranks_count_toward_ready_restored_and_a_whole_step() {
        // The second node of a round: global ranks 2 and 3. Rank 2 reshards: it loads its own
        // part, then other nodes' ranks' parts (`load(rank=k)`), before rank 3 asked for anything.
        let mut p = RoundProgress::default();
        p.begin(4, 2..4, 0, 0);
        assert!(!p.asked(2, 10));
        for k in [0, 1, 4, 7] {
            assert!(!p.asked(k, 20), "rank {k} asked through rank 2: not this node's ready");
        }
        assert!(!p.loaded(2, Some(6), 30));
        for k in [0, 1, 4, 7] {
            assert!(!p.loaded(k, Some(6), 40), "rank {k}'s part loaded by rank 2: not a rank restored here");
        }
        // Steps saved by ranks of other nodes never make a step whole here.
        assert!(!p.saved(2, 7, 50) && !p.saved(0, 7, 55) && !p.saved(1, 7, 56));
        let (_, r) = p.report(60).unwrap();
        assert_eq!((r.ready_ago_ms, r.restored, r.first_step), (None, None, None), "{r:?}");
        // Rank 3 itself: now the node is ready, restored and has saved a whole step.
        assert!(p.asked(3, 70));
        assert!(p.loaded(3, Some(6), 80));
        assert!(p.saved(3, 7, 90));
        let (_, r) = p.report(100).unwrap();
        assert_eq!(r.ready_ago_ms, Some(30));
        assert_eq!(r.restored, Some(StepAgo { step: 6, ago_ms: 20 }));
        assert_eq!(r.first_step, Some(StepAgo { step: 7, ago_ms: 10 }));
    }

    #[test]
    fn a_spare_has_nothing_before_and_a_partial_step_is_never_whole() {
        let mut p = RoundProgress::default();
        p.begin(3, 0..4, 0, 0);
        assert!(!p.loaded(0, None, 5), "nothing restored");
        for rank in 0..3 {
            assert!(!p.saved(rank, 9, 10));
        }
        let (_, r) = p.report(20).unwrap();
        assert_eq!((r.restored, r.first_step, r.step_before, r.caught_up), (None, None, None, None));
        // Steps far behind are forgotten, never completed by a late saver.
        for step in 10..30 {
            p.saved(0, step, 30);
        }
        assert!(!p.saved(3, 9, 40));
        assert_eq!(p.report(50).unwrap().1.first_step, None);
    }
}
