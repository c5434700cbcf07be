//! A job's update: the events this process has for a job wait in the job's queue, and one task
//! at a time reads the job, applies every queued event in arrival order and writes the result
//! once, by a transaction that compares the state's mod revision (retried from the read on
//! conflict); a large state is written in parts first.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Compare, CompareOp, DeleteOptions, Txn, TxnOp};
use tokio::sync::oneshot;
use tracing::{debug, warn};

use super::layout::{
    alive_key, alive_prefix, part_key, part_prefix, parts_prefix, prefix_end, state_key, stored, PartsHeader,
    MAX_PARTS, PART_BYTES,
};
use super::EtcdStore;
use crate::error::RdzvError;
use crate::round::liveness::{self, Signs};
use crate::round::{self, Action, Decision, Event, Guard, Job, JobSettings, Millis};
use crate::store::{existing_or_new, replacement, too_many_jobs};

const MAX_ATTEMPTS: u32 = 64;

/// Nodes dropped by one update whose keys are each compared (etcd's default bound on a
/// transaction's compares is 128).
const MAX_KEY_COMPARES: usize = 120;

/// One event waiting for its job's next batched update.
struct Queued {
    create: Option<JobSettings>,
    ev: Event,
    guard: Guard,
    now: Millis,
    reply: oneshot::Sender<Result<(Arc<Job>, Decision), RdzvError>>,
}

#[derive(Default)]
pub(super) struct JobQueue {
    waiting: Vec<Queued>,
    /// A task is draining this queue.
    busy: bool,
}

fn reply_all(batch: Vec<Queued>, outcomes: Vec<Result<Decision, RdzvError>>, job: Option<Arc<Job>>) {
    // One copy of the job shared by every caller of the batch.
    for (q, outcome) in batch.into_iter().zip(outcomes) {
        let answer = outcome.and_then(|d| match &job {
            Some(j) => Ok((Arc::clone(j), d)),
            // Only refused events reach here without a job; their answer needs no job state
            // beyond "none" (a refused first join never creates one).
            None => Err(match d.action {
                Action::Rejected(r) => r.into(),
                _ => RdzvError::Store { message: "no job state after the update".to_owned() },
            }),
        });
        let _ = q.reply.send(answer);
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

impl EtcdStore {
    /// The transaction operations that make `value` job `run_id`'s state: a put of it under
    /// `state` when small; else its parts are written now, each on its own, and the operations
    /// put a header naming their generation. Every other generation's parts are deleted: the
    /// previous one's, and any a writer killed in the middle of a large write left behind,
    /// which no header names. (A concurrent writer whose parts this deletes loses its race
    /// anyway: this transaction changes the state it compared, so it reads again and writes a
    /// new generation.) Each part is put only while `unchanged` (the state as read) holds: a
    /// put whose answer was lost and that lands late, after another writer's transaction, is
    /// refused instead of leaving parts that no later transaction deletes. `None`: the state
    /// changed while the parts were written (this attempt lost; its parts are gone).
    async fn state_ops(
        &self,
        run_id: &str,
        job: &Job,
        value: Vec<u8>,
        unchanged: &Compare,
    ) -> Result<Option<(Vec<TxnOp>, Option<String>)>, RdzvError> {
        let parts = parts_prefix(run_id);
        if value.len() <= PART_BYTES {
            let ops = vec![
                TxnOp::delete(parts, Some(DeleteOptions::new().with_prefix())),
                TxnOp::put(state_key(run_id), value, None),
            ];
            return Ok(Some((ops, None)));
        }
        let chunks: Vec<Vec<u8>> = value.chunks(PART_BYTES).map(<[u8]>::to_vec).collect();
        if chunks.len() > MAX_PARTS {
            return Err(RdzvError::Store {
                message: format!(
                    "job `{run_id}`: a state of {} bytes is over the bound of {} bytes",
                    value.len(),
                    PART_BYTES * MAX_PARTS
                ),
            });
        }
        let generation = format!("{:016x}", rand::random::<u64>());
        for (i, chunk) in chunks.iter().enumerate() {
            let key = part_key(run_id, &generation, i);
            let put = Txn::new().when([unchanged.clone()]).and_then([TxnOp::put(key.clone(), chunk.clone(), None)]);
            let written = self
                .run("put state part", |mut c| {
                    let put = put.clone();
                    async move { c.txn(put).await }
                })
                .await;
            match written {
                Ok(resp) if resp.succeeded() => {}
                Ok(_) => {
                    self.drop_parts(run_id, Some(&generation)).await;
                    return Ok(None);
                }
                Err(e) => {
                    self.drop_parts(run_id, Some(&generation)).await;
                    return Err(e);
                }
            }
        }
        let header = PartsHeader::of(job, chunks.len(), generation.clone());
        let header = serde_json::to_vec(&header).map_err(|e| RdzvError::Store { message: e.to_string() })?;
        // Every generation but the new one: the keys before its prefix and after it.
        let mine = part_prefix(run_id, &generation);
        let ops = vec![
            TxnOp::delete(parts.clone(), Some(DeleteOptions::new().with_range(mine.clone()))),
            TxnOp::delete(prefix_end(&mine), Some(DeleteOptions::new().with_range(prefix_end(&parts)))),
            TxnOp::put(state_key(run_id), header, None),
        ];
        Ok(Some((ops, Some(generation))))
    }

    /// Deletes the parts of a generation no header names (an update that lost its race).
    async fn drop_parts(&self, run_id: &str, generation: Option<&str>) {
        if let Some(generation) = generation {
            let what = "could not delete the parts of an update that did not commit";
            self.delete_prefix(run_id, part_prefix(run_id, generation), what).await;
        }
    }

    /// Applies `ev` to the job in etcd. Concurrent callers in this process are grouped: one
    /// task reads the job once, applies every queued event in arrival order and writes once
    /// (compare mod revision, then put), so a thousand agents joining at once cost a handful of
    /// transactions, not a thousand conflicting ones.
    pub async fn apply(
        &self,
        run_id: &str,
        create: Option<&JobSettings>,
        ev: Event,
        guard: Guard,
        now: Millis,
    ) -> Result<(Arc<Job>, Decision), RdzvError> {
        let (tx, rx) = oneshot::channel();
        let queued = Queued { create: create.cloned(), ev, guard, now, reply: tx };
        let lead = {
            let mut queues = self.inner.queues.lock().unwrap_or_else(|p| p.into_inner());
            let q = queues.entry(run_id.to_owned()).or_default();
            q.waiting.push(queued);
            !std::mem::replace(&mut q.busy, true)
        };
        if lead {
            // On its own task: a caller that gives up (a dropped HTTP request) must not strand
            // the callers queued behind it.
            tokio::spawn(self.clone().drain(run_id.to_owned()));
        }
        rx.await
            .unwrap_or_else(|_| Err(RdzvError::Store { message: "the update task ended without an answer".to_owned() }))
    }

    async fn drain(self, run_id: String) {
        loop {
            let batch = {
                let mut queues = self.inner.queues.lock().unwrap_or_else(|p| p.into_inner());
                let Some(q) = queues.get_mut(&run_id) else { return };
                if q.waiting.is_empty() {
                    queues.remove(&run_id);
                    return;
                }
                std::mem::take(&mut q.waiting)
            };
            self.commit(&run_id, batch).await;
        }
    }

    /// Read, apply a batch of events, compare-and-put; retried from the read on conflict.
    async fn commit(&self, run_id: &str, batch: Vec<Queued>) {
        let key = state_key(run_id);
        let mut failure: Option<String> = None;
        let mut unconfirmed: Option<String> = None;
        for attempt in 1..=MAX_ATTEMPTS {
            if attempt > 1 {
                // Someone else wrote first: back off a little, with jitter, before re-reading.
                let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
                let jitter = u64::from(nanos % 20);
                tokio::time::sleep(Duration::from_millis(jitter + 2 * u64::from(attempt.min(10)))).await;
            }
            let snap = match self.read(run_id).await {
                Ok(snap) => snap,
                Err(e) => {
                    failure = Some(error_chain(&e));
                    break;
                }
            };
            if let Some(generation) = unconfirmed.take() {
                if snap.generation.as_deref() != Some(generation.as_str()) {
                    self.drop_parts(run_id, Some(&generation)).await;
                }
            }
            let created = snap.job.is_none();
            let now = batch.first().map(|q| q.now).unwrap_or(0);
            let heard = self.heard(run_id);
            let signs = Signs { alive: &snap.alive, heard: &heard, lapsed: &snap.lapsed };
            let live = |j: Job, now| liveness::observe(j, &signs, now);
            let mut job: Option<Job> = snap.job.as_deref().cloned().map(|j| live(j, now));
            let mut outcomes: Vec<Result<Decision, RdzvError>> = Vec::with_capacity(batch.len());
            for q in &batch {
                // The job under this run id is over and its nodes quiet: this join starts anew.
                if let Some(mut next) = job.as_ref().and_then(|j| replacement(j, q.create.as_ref(), &q.ev, q.now)) {
                    let d = round::apply_joining(&mut next, q.create.as_ref(), q.ev.clone(), &q.guard, q.now);
                    if !matches!(d.action, Action::Rejected(_)) {
                        job = Some(next);
                    }
                    outcomes.push(Ok(d));
                    continue;
                }
                // The creation rule of every store (the job is borrowed, not copied).
                let fresh = job.is_none();
                match existing_or_new(run_id, job.as_ref(), q.create.as_ref(), q.now) {
                    Ok(Cow::Borrowed(_)) => {}
                    Ok(Cow::Owned(_))
                        if self.inner.job_count.load(Ordering::Relaxed)
                            >= self.inner.max_jobs.load(Ordering::Relaxed) =>
                    {
                        let (n, max) =
                            (self.inner.job_count.load(Ordering::Relaxed), self.inner.max_jobs.load(Ordering::Relaxed));
                        outcomes.push(Err(too_many_jobs(n, max)));
                        continue;
                    }
                    Ok(Cow::Owned(new)) => job = Some(live(new, q.now)),
                    Err(e) => {
                        outcomes.push(Err(e));
                        continue;
                    }
                }
                let j = job.as_mut().expect("the job exists or was just created");
                let d = round::apply_joining(j, q.create.as_ref(), q.ev.clone(), &q.guard, q.now);
                if fresh && matches!(d.action, Action::Rejected(_)) {
                    // A refused first join creates nothing.
                    job = None;
                }
                outcomes.push(Ok(d));
            }
            let Some(next) = job else {
                // Nothing created (every event refused): answer without writing.
                return reply_all(batch, outcomes, None);
            };
            let to_store = stored(&next);
            let unchanged = !created && snap.job.as_deref().map(stored).as_ref() == Some(&to_store);
            if unchanged {
                return reply_all(batch, outcomes, Some(Arc::new(next)));
            }
            let value = match serde_json::to_vec(&to_store) {
                Ok(v) => v,
                Err(e) => {
                    failure = Some(format!("cannot encode job state: {e}"));
                    break;
                }
            };
            let mut cmps = vec![if created {
                Compare::version(key.clone(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(key.clone(), CompareOp::Equal, snap.mod_revision)
            }];
            // A node dropped because its key was missing must still have none: a lease renewed
            // meanwhile (renew_if_tracked) makes this update read the job again. Past a rack of
            // such nodes one compare covers them all: no alive key of the job written since the
            // read (etcd takes at most 128 compares; that one also fails on a join or a key taken
            // over by another replica, so it is the last resort).
            if let Some(before) = &snap.job {
                let alive: HashSet<&str> = snap.alive.iter().map(String::as_str).collect();
                let dropped: Vec<&str> =
                    before.watched().into_iter().filter(|id| !alive.contains(id) && !next.tracks(id)).collect();
                if dropped.len() <= MAX_KEY_COMPARES {
                    cmps.extend(dropped.iter().map(|id| Compare::version(alive_key(run_id, id), CompareOp::Equal, 0)));
                } else {
                    let since = Compare::mod_revision(alive_prefix(run_id), CompareOp::Less, snap.revision + 1);
                    cmps.push(since.with_prefix());
                }
            }
            let (ops, new_generation) = match self.state_ops(run_id, &to_store, value, &cmps[0]).await {
                Ok(Some(ops)) => ops,
                Ok(None) => {
                    debug!(run_id, attempt, "lost a concurrent update while writing the state's parts; retrying");
                    continue;
                }
                Err(e) => {
                    failure = Some(error_chain(&e));
                    break;
                }
            };
            let txn = Txn::new().when(cmps).and_then(ops);
            match self
                .run("transaction", |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                })
                .await
            {
                Ok(resp) if resp.succeeded() => {
                    if created {
                        self.inner.job_count.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(v) = self.inner.versions.lock().unwrap_or_else(|p| p.into_inner()).get_mut(run_id) {
                        *v = (*v).max(next.version);
                    }
                    self.note_keys(run_id, &next);
                    let next = Arc::new(next);
                    self.note_latest(run_id, &next);
                    return reply_all(batch, outcomes, Some(next));
                }
                // The transaction may have committed after all (an answer lost, then the same
                // transaction retried on another member, whose compare fails): its parts are
                // dropped only once a read shows the state does not name them.
                Ok(_) => {
                    unconfirmed = new_generation;
                    debug!(run_id, attempt, "lost a concurrent update of the job; retrying")
                }
                Err(e) => {
                    failure = Some(error_chain(&e));
                    break;
                }
            }
        }
        // Every attempt lost to another writer: contention (transient, as a store failure is).
        let error = || match &failure {
            Some(message) => RdzvError::Store { message: message.clone() },
            None => RdzvError::Contention { run_id: run_id.to_owned(), attempts: MAX_ATTEMPTS },
        };
        warn!(run_id, error = %error(), "job update failed");
        for q in batch {
            let _ = q.reply.send(Err(error()));
        }
    }
}
