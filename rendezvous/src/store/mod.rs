//! Where job state lives: in this process (`memory`) or in etcd v3 (`etcd`), behind one enum.
//!
//! Both run the same pure machine ([`crate::round::apply`]); they differ in how an update is made
//! atomic (a mutex, or an etcd transaction on the state key's mod revision), how waiters learn of
//! changes (a `tokio::sync::watch` per job, or an etcd watch) and how liveness is measured
//! (heartbeat times in the job, or one etcd lease per node whose key's presence means "alive").

pub mod etcd;
pub mod memory;

use std::borrow::Cow;
use std::time::Duration;

use tokio::time::Instant;

use crate::detector::{PeerReport, ProbeReport, ProbeRequest, Sent};
use crate::error::RdzvError;
use crate::round::{Decision, Event, Guard, Job, JobSettings, Millis};

/// The state backend of the service's `Rendezvous`.
#[derive(Clone)]
pub enum Store {
    Memory(memory::MemoryStore),
    Etcd(etcd::EtcdStore),
}

/// How long a finished or failed job stays readable (status) by default before the ticker
/// forgets it; after that its run id can be used again (`--terminal-retention-s`).
pub const TERMINAL_RETENTION: Duration = Duration::from_secs(3600);

/// Whether a terminal job has been over for `retention`.
pub(crate) fn outlived(job: &Job, now: Millis, retention: Duration) -> bool {
    let retention = Millis::try_from(retention.as_millis()).unwrap_or(Millis::MAX);
    match job.phase {
        crate::round::Phase::Finished { at } | crate::round::Phase::Failed { at, .. } => {
            now.saturating_sub(at) >= retention
        }
        _ => false,
    }
}

/// A join asking for other settings than the job was created with.
fn mismatch(run_id: &str, job: &JobSettings, asked: &JobSettings) -> RdzvError {
    RdzvError::SettingsMismatch {
        run_id: run_id.to_owned(),
        message: format!(
            "the job was created with {}, this node asks for {}",
            serde_json::to_string(job).unwrap_or_default(),
            serde_json::to_string(asked).unwrap_or_default()
        ),
    }
}

/// A join that would create one job more than the service's bound.
pub(crate) fn too_many_jobs(jobs: usize, bound: usize) -> RdzvError {
    RdzvError::LimitReached {
        message: format!(
            "the service holds {jobs} jobs: its bound on jobs (rlaunch-rendezvous --max-jobs {bound}); \
             finished and failed jobs count until their retention \
             (rlaunch-rendezvous --terminal-retention-s, default 3600) has passed"
        ),
    }
}

/// The job that replaces `existing` for a join (`create` given) of a node that may start a new
/// job under a run id whose job is over ([`Job::successor`]).
pub(crate) fn replacement(existing: &Job, create: Option<&JobSettings>, ev: &Event, now: Millis) -> Option<Job> {
    match (create, ev) {
        (Some(settings), Event::Join(node)) => existing.successor(&node.node_id, settings, now),
        _ => None,
    }
}

/// The creation rule of every store: a join (`create`: its settings) must ask for the settings
/// of the job under `run_id` ([`JobSettings::same_job`]), and creates the job when there is
/// none; any other event needs the job to exist. Answers the job the event goes to: `existing`,
/// borrowed (never copied), or the new one. Each store bounds the jobs it creates itself.
pub(crate) fn existing_or_new<'a>(
    run_id: &str,
    existing: Option<&'a Job>,
    create: Option<&JobSettings>,
    now: Millis,
) -> Result<Cow<'a, Job>, RdzvError> {
    match (existing, create) {
        // The shutdown timeout is each node's own: the job keeps the first node's.
        (Some(job), Some(settings)) if !job.settings.same_job(settings) => {
            Err(mismatch(run_id, &job.settings, settings))
        }
        (Some(job), _) => Ok(Cow::Borrowed(job)),
        (None, Some(settings)) => Ok(Cow::Owned(Job::new(settings.clone(), now))),
        (None, None) => Err(RdzvError::UnknownJob { run_id: run_id.to_owned() }),
    }
}

impl Store {
    pub fn memory() -> Self {
        Store::Memory(memory::MemoryStore::default())
    }

    pub fn name(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Etcd(_) => "etcd",
        }
    }

    /// Most jobs the store creates.
    pub fn set_max_jobs(&self, n: usize) {
        match self {
            Store::Memory(m) => m.set_max_jobs(n),
            Store::Etcd(e) => e.set_max_jobs(n),
        }
    }

    /// Applies `ev` to job `run_id` atomically behind `guard` (the node's secret, the bound on
    /// waiting nodes), creating the job from `create` when it does not exist (joins only), and
    /// answers `view` of the job after it without copying the job. A rejected event leaves the
    /// stored job untouched (`view` sees it so).
    pub async fn apply_view<R>(
        &self,
        run_id: &str,
        create: Option<&JobSettings>,
        ev: Event,
        guard: &Guard,
        now: Millis,
        view: impl FnOnce(&Job) -> R,
    ) -> Result<(R, Decision), RdzvError> {
        match self {
            Store::Memory(m) => m.apply_view(run_id, create, ev, guard, now, view),
            Store::Etcd(e) => e.apply(run_id, create, ev, guard.clone(), now).await.map(|(job, d)| (view(&job), d)),
        }
    }

    /// `view` of job `run_id` as it stands (etcd: as this process last read or watched it, at
    /// least as new as the newest version it has seen; read once for all callers otherwise).
    /// Without liveness: for long-polls, not for the failure detector.
    pub async fn view<R>(&self, run_id: &str, view: impl FnOnce(&Job) -> R) -> Result<Option<R>, RdzvError> {
        match self {
            Store::Memory(m) => Ok(m.view(run_id, view)),
            Store::Etcd(e) => e.view(run_id, None, view).await,
        }
    }

    pub async fn load(&self, run_id: &str, now: Millis) -> Result<Option<Job>, RdzvError> {
        match self {
            Store::Memory(m) => Ok(m.load(run_id)),
            Store::Etcd(e) => e.load(run_id, now).await,
        }
    }

    /// Returns once job `run_id`'s version may differ from `version`, or at `deadline`.
    pub async fn wait_change(&self, run_id: &str, version: u64, deadline: Instant) -> Result<(), RdzvError> {
        match self {
            Store::Memory(m) => m.wait_change(run_id, version, deadline).await,
            Store::Etcd(e) => e.wait_change(run_id, version, deadline).await,
        }
    }

    /// Applies `Tick` to every live job; returns the decisions that changed something.
    pub async fn tick_all(&self, now: Millis, retention: Duration) -> Vec<(String, Decision)> {
        match self {
            Store::Memory(m) => m.tick_all(now, retention),
            Store::Etcd(e) => e.tick_all(now, retention).await,
        }
    }

    /// Every job, for status gauges.
    pub async fn jobs(&self, now: Millis) -> Result<Vec<(String, Job)>, RdzvError> {
        match self {
            Store::Memory(m) => Ok(m.jobs()),
            Store::Etcd(e) => e.jobs(now).await,
        }
    }

    /// Records a sign of life (a heartbeat in memory, a lease keep-alive on etcd) and the
    /// outcomes of the probes it carries; answers the probes `node_id` owes.
    pub async fn heartbeat(
        &self,
        run_id: &str,
        node_id: &str,
        (sent, probes, peers): (Option<Sent>, Vec<ProbeReport>, Vec<PeerReport>),
        guard: &Guard,
        now: Millis,
    ) -> Result<(Decision, Vec<ProbeRequest>), RdzvError> {
        match self {
            Store::Memory(m) => {
                let ev = Event::Heartbeat { node_id: node_id.to_owned(), sent, probes, peers };
                m.apply_view(run_id, None, ev, guard, now, |job| job.probes_for(node_id)).map(|(probes, d)| (d, probes))
            }
            Store::Etcd(e) => e.heartbeat(run_id, node_id, probes, peers, guard, now).await,
        }
    }

    /// Makes sure a node about to join counts as alive (etcd: its alive key exists), once the
    /// caller is known to be allowed to speak for it (memory: the update itself checks,
    /// atomically); returns whether it made a new key (the caller deletes it when the join is
    /// then refused).
    pub async fn register_join(
        &self,
        run_id: &str,
        node_id: &str,
        secret: Option<&str>,
        ttl: Duration,
    ) -> Result<bool, RdzvError> {
        match self {
            Store::Memory(_) => Ok(false),
            Store::Etcd(e) => e.register_join(run_id, node_id, secret, ttl).await,
        }
    }

    /// Drops a departed node's liveness record (etcd: revokes its lease).
    pub async fn forget_node(&self, run_id: &str, node_id: &str) -> Result<(), RdzvError> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Etcd(e) => e.forget_node(run_id, node_id).await,
        }
    }

    /// How often the ticker should run for this store.
    pub fn tick_period(&self) -> Duration {
        match self {
            Store::Memory(_) => Duration::from_millis(100),
            Store::Etcd(_) => Duration::from_millis(250),
        }
    }
}
