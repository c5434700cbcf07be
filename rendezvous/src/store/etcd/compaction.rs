//! Compaction of etcd's history ([`Compaction`]), one task per store for as long as it lives.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, warn};

use super::{EtcdStore, Inner};

/// How much of etcd's history the service keeps. Every write of a job's state (a round, a
/// node's key, a report) adds a revision, and etcd keeps every revision until it is compacted:
/// a service that never compacts grows etcd's database until its quota (2 GiB by default) is
/// reached, and etcd then refuses every write, every job's. Revisions older than `keep` are
/// compacted every `every` (etcd reuses the space; a defragmentation returns it to the disk).
/// Replicas compacting the same history is harmless; a watch that falls behind the compacted
/// revision starts again from the present and re-reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compaction {
    pub keep: Duration,
    pub every: Duration,
}

impl Default for Compaction {
    /// Five minutes of history, compacted every minute.
    fn default() -> Self {
        Compaction { keep: Duration::from_secs(300), every: Duration::from_secs(60) }
    }
}

impl EtcdStore {
    /// How much of etcd's history to keep ([`Compaction`]; the default otherwise).
    pub fn set_compaction(&self, c: Compaction) {
        *self.inner.compaction.lock().unwrap_or_else(|p| p.into_inner()) = c;
    }
}

/// Every `every`, compacts etcd's history to the newest revision seen at least `keep` ago.
pub(super) async fn compact(inner: std::sync::Weak<Inner>) {
    // (when, revision) seen, oldest first.
    let mut seen: VecDeque<(Instant, i64)> = VecDeque::new();
    let mut last = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(inner) = inner.upgrade() else { return };
        let Compaction { keep, every } = *inner.compaction.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() < every.min(keep).max(Duration::from_millis(100)) {
            continue;
        }
        last = Instant::now();
        let store = EtcdStore { inner };
        let revision = match store.run("status", |mut c| async move { c.status().await }).await {
            Ok(s) => s.header().map_or(0, |h| h.revision()),
            Err(e) => {
                debug!(error = %e, "etcd status for compaction");
                continue;
            }
        };
        let now = Instant::now();
        seen.push_back((now, revision));
        // The newest revision seen at least `keep` ago; samples older than it are not needed.
        let mut target = None;
        while let Some((at, rev)) = seen.front().copied() {
            if now.duration_since(at) < keep {
                break;
            }
            target = Some(rev);
            seen.pop_front();
        }
        let Some(target) = target.filter(|r| *r > 1) else { continue };
        match store.run("compact", |mut c| async move { c.compact(target, None).await }).await {
            Ok(_) => debug!(revision = target, "etcd history compacted"),
            // Another replica compacted as far already.
            Err(e) if e.to_string().contains("compacted") => {}
            Err(e) => warn!(error = %e, revision = target, "cannot compact etcd's history"),
        }
    }
}
