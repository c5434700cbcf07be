//! The in-process store: jobs in a mutex-guarded map, a `watch` channel per job for waiters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::RdzvError;
use crate::round::{self, Action, Decision, Event, Guard, Job, JobSettings, Millis};

struct Entry {
    job: Job,
    version: watch::Sender<u64>,
}

/// Jobs held in this process; cheap to clone (shared).
#[derive(Clone)]
pub struct MemoryStore {
    jobs: Arc<Mutex<HashMap<String, Entry>>>,
    max_jobs: Arc<AtomicUsize>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self { jobs: Arc::default(), max_jobs: Arc::new(AtomicUsize::new(usize::MAX)) }
    }
}

impl MemoryStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock cannot leave a job half-updated: `apply` is pure and
        // the entry is replaced whole, so a poisoned map is still consistent.
        self.jobs.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Most jobs this store creates (finished and failed ones count until forgotten).
    pub fn set_max_jobs(&self, n: usize) {
        self.max_jobs.store(n, Ordering::Relaxed);
    }

    /// Applies `ev` in place under the lock and returns `view` of the result (of the untouched
    /// job when rejected) without copying the job unless `view` does.
    pub fn apply_view<R>(
        &self,
        run_id: &str,
        create: Option<&JobSettings>,
        ev: Event,
        guard: &Guard,
        now: Millis,
        view: impl FnOnce(&Job) -> R,
    ) -> Result<(R, Decision), RdzvError> {
        let mut jobs = self.lock();
        if let Some(entry) = jobs.get_mut(run_id) {
            if let Some(mut next) = super::replacement(&entry.job, create, &ev, now) {
                // The job under this run id is over and its nodes quiet: this join starts anew.
                let decision = round::apply_joining(&mut next, create, ev, guard, now);
                if !matches!(decision.action, Action::Rejected(_)) {
                    entry.job = next;
                    entry.version.send_replace(entry.job.version);
                }
                return Ok((view(&entry.job), decision));
            }
            // The creation rule: a join must ask for the job's settings (it exists: nothing new).
            super::existing_or_new(run_id, Some(&entry.job), create, now)?;
            let before = entry.job.version;
            let decision = round::apply_joining(&mut entry.job, create, ev, guard, now);
            if entry.job.version != before {
                entry.version.send_replace(entry.job.version);
            }
            return Ok((view(&entry.job), decision));
        }
        // The creation rule: a join creates the job, any other event is refused.
        let mut job = super::existing_or_new(run_id, None, create, now)?.into_owned();
        let max_jobs = self.max_jobs.load(Ordering::Relaxed);
        if jobs.len() >= max_jobs {
            return Err(super::too_many_jobs(jobs.len(), max_jobs));
        }
        let decision = round::apply_guarded(&mut job, ev, guard, now);
        let out = view(&job);
        if !matches!(decision.action, Action::Rejected(_)) {
            let (tx, _) = watch::channel(job.version);
            jobs.insert(run_id.to_owned(), Entry { job, version: tx });
        }
        Ok((out, decision))
    }

    /// `view` of job `run_id`, under the lock, without a copy.
    pub fn view<R>(&self, run_id: &str, view: impl FnOnce(&Job) -> R) -> Option<R> {
        self.lock().get(run_id).map(|e| view(&e.job))
    }

    pub fn load(&self, run_id: &str) -> Option<Job> {
        self.lock().get(run_id).map(|e| e.job.clone())
    }

    pub fn jobs(&self) -> Vec<(String, Job)> {
        self.lock().iter().map(|(k, e)| (k.clone(), e.job.clone())).collect()
    }

    pub async fn wait_change(&self, run_id: &str, version: u64, deadline: Instant) -> Result<(), RdzvError> {
        let mut rx = match self.lock().get(run_id) {
            Some(e) => e.version.subscribe(),
            None => return Err(RdzvError::UnknownJob { run_id: run_id.to_owned() }),
        };
        // `wait_for` checks the current value first, so a change made between the caller's read
        // and this subscription is not missed. A closed channel (job removed) ends the wait too.
        let _ = tokio::time::timeout_at(deadline, rx.wait_for(|v| *v != version)).await;
        Ok(())
    }

    pub fn tick_all(&self, now: Millis, retention: std::time::Duration) -> Vec<(String, Decision)> {
        // Dropping an entry closes its channel, which ends the wait of any long-poll on it.
        self.lock().retain(|_, e| !super::outlived(&e.job, now, retention));
        let ids: Vec<String> =
            self.lock().iter().filter(|(_, e)| !e.job.phase.is_terminal()).map(|(k, _)| k.clone()).collect();
        let mut out = Vec::new();
        for id in ids {
            if let Ok(((), d)) = self.apply_view(&id, None, Event::Tick, &Guard::default(), now, |_| ()) {
                if d.action != Action::Nothing {
                    out.push((id, d));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::NodeInfo;

    #[test]
    fn terminal_jobs_are_forgotten_after_the_retention() {
        let store = MemoryStore::default();
        let settings = JobSettings::default();
        let node = NodeInfo {
            node_id: "a".into(),
            local_world_size: 1,
            store_addr: "h:1".parse().unwrap(),
            probe_addr: None,
            snapshot_addr: None,
            snapshot_key: None,
            snapshots: Vec::new(),
            fingerprint: None,
        };
        let g = Guard::default();
        store.apply_view("r", Some(&settings), Event::Join(node), &g, 0, |_| ()).expect("join");
        let success = Event::NodeSucceeded { node_id: "a".into(), round: 1 };
        store.apply_view("r", None, success, &g, 10, |_| ()).expect("success");
        let retention = std::time::Duration::from_secs(60);
        store.tick_all(10 + 60_000 - 1, retention);
        assert!(store.load("r").is_some(), "still readable within the retention");
        store.tick_all(10 + 60_000, retention);
        assert!(store.load("r").is_none());
    }
}
