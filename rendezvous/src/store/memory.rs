//! The in-process store: jobs in a mutex-guarded map, a `watch` channel per job for waiters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::RdzvError;
use crate::round::{self, Action, Decision, Event, Job, JobSettings, Millis};

struct Entry {
    job: Job,
    version: watch::Sender<u64>,
}

/// Jobs held in this process; cheap to clone (shared).
#[derive(Clone, Default)]
pub struct MemoryStore {
    jobs: Arc<Mutex<HashMap<String, Entry>>>,
}

impl MemoryStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock cannot leave a job half-updated: `apply` is pure and
        // the entry is replaced whole, so a poisoned map is still consistent.
        self.jobs.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn apply(
        &self,
        run_id: &str,
        create: Option<&JobSettings>,
        ev: Event,
        now: Millis,
    ) -> Result<(Job, Decision), RdzvError> {
        let mut jobs = self.lock();
        let existing = jobs.get(run_id).map(|e| e.job.clone());
        let created = existing.is_none();
        let job = super::existing_or_new(run_id, existing, create, now)?;
        let (next, decision) = round::apply(&job, ev, now);
        if matches!(decision.action, Action::Rejected(_)) {
            return Ok((job, decision));
        }
        match jobs.get_mut(run_id) {
            Some(entry) => {
                let bumped = next.version != entry.job.version;
                entry.job = next.clone();
                if bumped {
                    entry.version.send_replace(next.version);
                }
            }
            None => {
                debug_assert!(created);
                let (tx, _) = watch::channel(next.version);
                jobs.insert(run_id.to_owned(), Entry { job: next.clone(), version: tx });
            }
        }
        Ok((next, decision))
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

    pub fn tick_all(&self, now: Millis) -> Vec<(String, Decision)> {
        let ids: Vec<String> = self
            .lock()
            .iter()
            .filter(|(_, e)| !e.job.phase.is_terminal())
            .map(|(k, _)| k.clone())
            .collect();
        let mut out = Vec::new();
        for id in ids {
            if let Ok((_, d)) = self.apply(&id, None, Event::Tick, now) {
                if d.action != Action::Nothing {
                    out.push((id, d));
                }
            }
        }
        out
    }
}
