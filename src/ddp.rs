//! Data-parallel training on top of a [`ProcessGroup`], as torch's DDP does it: gradients in
//! flat buckets (25 MiB cap, a 1 MiB first bucket, parameters in reverse order so the first
//! bucket fills first during backward), parameters broadcast from rank 0 at the start,
//! gradients averaged, each bucket's all-reduce started on a communication thread as soon as
//! its last gradient is ready (overlapping the rest of the backward pass), and `no_sync` for
//! gradient accumulation.
//!
//! The process group lives on the communication thread; buckets travel to it and back by
//! value, so the backward pass can never touch a bucket that is being reduced.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::comm::{CommError, Element, ProcessGroup, ReduceOp};
use crate::model::GradSink;

/// Bucket sizes (torch's defaults).
#[derive(Debug, Clone, Copy)]
pub struct DdpConfig {
    pub bucket_cap_bytes: usize,
    pub first_bucket_bytes: usize,
    /// Average gradients (torch DDP); `false` sums them.
    pub average: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self { bucket_cap_bytes: 25 << 20, first_bucket_bytes: 1 << 20, average: true }
    }
}

/// Why a data-parallel step failed.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    #[error("gradient all-reduce of bucket {bucket} failed")]
    Bucket {
        bucket: usize,
        #[source]
        source: CommError,
    },
    #[error("collective on the communication thread failed")]
    Comm(#[from] CommError),
    #[error("the communication thread is gone (it panicked or the group was dropped)")]
    ThreadGone,
    #[error("parameter buffer has {got} elements, the layout expects {want}")]
    Layout { got: usize, want: usize },
}

type Job = Box<dyn FnOnce(&mut ProcessGroup) + Send>;

/// Where parameter `p`'s gradient lives: bucket, offset, length.
#[derive(Debug, Clone, Copy)]
struct Slot {
    bucket: usize,
    offset: usize,
    len: usize,
}

/// Parameters assigned to buckets, in reverse parameter order.
#[derive(Debug, Clone)]
pub struct BucketLayout {
    slots: Vec<Slot>,
    /// Parameters of each bucket, in the order they were placed.
    pub buckets: Vec<Vec<usize>>,
    pub bucket_elems: Vec<usize>,
}

impl BucketLayout {
    /// Fills buckets from the last parameter backwards: the first up to `first_bucket_bytes`,
    /// the rest up to `bucket_cap_bytes`; a parameter larger than the cap gets a bucket alone.
    pub fn new(param_sizes: &[usize], cfg: &DdpConfig) -> Self {
        let mut slots = vec![Slot { bucket: 0, offset: 0, len: 0 }; param_sizes.len()];
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut bucket_elems = Vec::new();
        let mut cur: Vec<usize> = Vec::new();
        let mut cur_elems = 0usize;
        for p in (0..param_sizes.len()).rev() {
            let cap = if buckets.is_empty() { cfg.first_bucket_bytes } else { cfg.bucket_cap_bytes } / 4;
            let sz = param_sizes[p];
            if !cur.is_empty() && cur_elems + sz > cap {
                buckets.push(std::mem::take(&mut cur));
                bucket_elems.push(cur_elems);
                cur_elems = 0;
            }
            slots[p] = Slot { bucket: buckets.len(), offset: cur_elems, len: sz };
            cur.push(p);
            cur_elems += sz;
        }
        if !cur.is_empty() {
            buckets.push(cur);
            bucket_elems.push(cur_elems);
        }
        Self { slots, buckets, bucket_elems }
    }
}

/// A model's gradients, reduced across the group bucket by bucket.
pub struct Ddp {
    layout: BucketLayout,
    /// Bucket storage; `None` while the bucket is on the communication thread.
    grads: Vec<Option<Vec<f32>>>,
    pending: Vec<usize>,
    next_launch: usize,
    in_flight: usize,
    require_sync: bool,
    rank: usize,
    world_size: usize,
    first_error: Option<DdpError>,
    jobs: Option<mpsc::Sender<Job>>,
    done_tx: mpsc::Sender<BucketDone>,
    done_rx: mpsc::Receiver<BucketDone>,
    thread: Option<JoinHandle<()>>,
    average: bool,
    /// A beat per finished step, for `rlaunch --hang-timeout`.
    heartbeat: crate::heartbeat::Heartbeat,
    /// Time this rank waited in the current step's all-reduces, and per step over the window.
    step_wait: Duration,
    waits: std::collections::VecDeque<Duration>,
    steps: u64,
}

/// A bucket back from the communication thread: its index, data, outcome, and how long its
/// all-reduce took on this rank (from this rank's arrival to the end).
type BucketDone = (usize, Vec<f32>, Result<(), CommError>, Duration);

impl Ddp {
    /// Wraps `pg` for a model whose parameters have `param_sizes` elements each (in parameter
    /// order); starts the communication thread.
    pub fn new(pg: ProcessGroup, param_sizes: &[usize], cfg: DdpConfig) -> Self {
        let layout = BucketLayout::new(param_sizes, &cfg);
        let grads = layout.bucket_elems.iter().map(|&n| Some(vec![0.0f32; n])).collect();
        let pending = layout.buckets.iter().map(|b| b.len()).collect();
        let (rank, world_size) = (pg.rank(), pg.world_size());
        let (jobs, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("rlaunch-ddp-comm".into())
            .spawn(move || {
                let mut pg = pg;
                while let Ok(job) = rx.recv() {
                    job(&mut pg);
                }
            })
            .expect("spawning the communication thread");
        let (done_tx, done_rx) = mpsc::channel();
        Self {
            layout,
            grads,
            pending,
            next_launch: 0,
            in_flight: 0,
            require_sync: true,
            rank,
            world_size,
            first_error: None,
            jobs: Some(jobs),
            done_tx,
            done_rx,
            thread: Some(thread),
            average: cfg.average,
            heartbeat: crate::heartbeat::Heartbeat::from_env(),
            step_wait: Duration::ZERO,
            waits: std::collections::VecDeque::with_capacity(crate::heartbeat::STATS_WINDOW),
            steps: 0,
        }
    }

    /// How long this rank waited in its buckets' all-reduces per step, on average over the last
    /// steps (see [`crate::heartbeat::StepStats`]).
    pub fn step_stats(&self) -> crate::heartbeat::StepStats {
        let n = self.waits.len().max(1) as u32;
        let total: Duration = self.waits.iter().sum();
        crate::heartbeat::StepStats {
            steps: self.steps,
            window: self.waits.len() as u32,
            mean_wait_us: u64::try_from((total / n).as_micros()).unwrap_or(u64::MAX),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    pub fn layout(&self) -> &BucketLayout {
        &self.layout
    }

    /// Runs `f` on the communication thread with the process group and returns its result
    /// (waits for in-flight buckets first, so collectives stay in the same order on all ranks).
    pub fn with_pg<R: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut ProcessGroup) -> R + Send + 'static,
    ) -> Result<R, DdpError> {
        self.wait_buckets()?;
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |pg| {
            let _ = tx.send(f(pg));
        });
        self.jobs.as_ref().ok_or(DdpError::ThreadGone)?.send(job).map_err(|_| DdpError::ThreadGone)?;
        rx.recv().map_err(|_| DdpError::ThreadGone)
    }

    /// Copies rank 0's parameters to every rank (call once before training).
    pub fn broadcast_params<T: Element>(&mut self, params: &mut Vec<T>) -> Result<(), DdpError> {
        let mut p = std::mem::take(params);
        let r = self.with_pg(move |pg| {
            let r = pg.broadcast(&mut p, 0);
            (p, r)
        })?;
        *params = r.0;
        r.1?;
        Ok(())
    }

    /// All-reduce of a few values (metrics) through the group.
    pub fn all_reduce<T: Element>(&mut self, values: &mut [T], op: ReduceOp) -> Result<(), DdpError> {
        let mut v = values.to_vec();
        let out = self.with_pg(move |pg| {
            let r = pg.all_reduce(&mut v, op);
            (v, r)
        })?;
        out.1?;
        values.copy_from_slice(&out.0);
        Ok(())
    }

    pub fn barrier(&mut self) -> Result<(), DdpError> {
        self.with_pg(|pg| pg.barrier())??;
        Ok(())
    }

    /// While `false`, backward passes accumulate gradients locally without communicating
    /// (see [`Ddp::no_sync`]).
    pub fn set_require_sync(&mut self, on: bool) {
        self.require_sync = on;
    }

    /// Runs `f` (typically forward and backward of one micro-batch) without gradient
    /// synchronisation; the next backward pass outside reduces the accumulated gradients.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let prev = self.require_sync;
        self.require_sync = false;
        let r = f(self);
        self.require_sync = prev;
        r
    }

    /// Zeroes every gradient (waits for in-flight buckets first).
    pub fn zero_grad(&mut self) -> Result<(), DdpError> {
        self.wait_buckets()?;
        for g in self.grads.iter_mut().flatten() {
            g.iter_mut().for_each(|x| *x = 0.0);
        }
        Ok(())
    }

    /// Waits for every bucket launched by the last backward pass; afterwards [`Ddp::grad`]
    /// returns averaged gradients. Call after the backward pass, before the optimizer step.
    pub fn finish(&mut self) -> Result<(), DdpError> {
        let launched = self.in_flight > 0;
        self.wait_buckets()?;
        if launched {
            self.steps += 1;
            if self.waits.len() == crate::heartbeat::STATS_WINDOW {
                self.waits.pop_front();
            }
            self.waits.push_back(std::mem::take(&mut self.step_wait));
            self.heartbeat.beat_with(self.step_stats());
        } else {
            self.heartbeat.beat();
        }
        Ok(())
    }

    /// The (averaged, after [`Ddp::finish`]) gradient of parameter `param`.
    pub fn grad(&self, param: usize) -> &[f32] {
        let s = self.layout.slots[param];
        let b = self.grads[s.bucket].as_ref().expect("bucket is home: call finish() before reading gradients");
        &b[s.offset..s.offset + s.len]
    }

    fn wait_buckets(&mut self) -> Result<(), DdpError> {
        while self.in_flight > 0 {
            let (b, data, res, took) = self.done_rx.recv().map_err(|_| DdpError::ThreadGone)?;
            self.grads[b] = Some(data);
            self.in_flight -= 1;
            self.step_wait += took;
            if let Err(e) = res {
                self.first_error.get_or_insert(DdpError::Bucket { bucket: b, source: e });
            }
        }
        for p in self.pending.iter_mut().zip(&self.layout.buckets) {
            *p.0 = p.1.len();
        }
        self.next_launch = 0;
        match self.first_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn launch(&mut self, b: usize) {
        let data = self.grads[b].take().expect("a bucket is launched once per backward pass");
        let done = self.done_tx.clone();
        let op = if self.average { ReduceOp::Avg } else { ReduceOp::Sum };
        let job: Job = Box::new(move |pg| {
            let mut data = data;
            let arrived = std::time::Instant::now();
            let r = pg.all_reduce(&mut data, op);
            let _ = done.send((b, data, r, arrived.elapsed()));
        });
        match self.jobs.as_ref().map(|j| j.send(job)) {
            Some(Ok(())) => self.in_flight += 1,
            _ => {
                self.first_error.get_or_insert(DdpError::ThreadGone);
            }
        }
    }
}

impl GradSink for Ddp {
    fn grad_mut(&mut self, param: usize) -> &mut [f32] {
        let s = self.layout.slots[param];
        let b = self.grads[s.bucket].as_mut().expect("gradient written after its bucket was launched");
        &mut b[s.offset..s.offset + s.len]
    }

    fn ready(&mut self, param: usize) {
        if !self.require_sync {
            return;
        }
        let b = self.layout.slots[param].bucket;
        self.pending[b] = self.pending[b].saturating_sub(1);
        // Launch strictly in bucket order so every rank issues the same collective sequence.
        while self.next_launch < self.pending.len() && self.pending[self.next_launch] == 0 {
            let nb = self.next_launch;
            self.next_launch += 1;
            self.launch(nb);
        }
    }
}

impl Drop for Ddp {
    fn drop(&mut self) {
        let _ = self.wait_buckets();
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_reverse_parameter_order_with_a_small_first_bucket() {
        // 4-byte elements: first bucket cap 1 MiB = 262144 elements, others 25 MiB.
        let sizes = [300_000, 1000, 200_000, 100_000, 50_000];
        let l = BucketLayout::new(&sizes, &DdpConfig::default());
        assert_eq!(l.buckets[0], vec![4, 3], "last parameters first, up to 1 MiB");
        assert_eq!(l.buckets[1], vec![2, 1, 0]);
        let tiny = DdpConfig { bucket_cap_bytes: 8, first_bucket_bytes: 4, average: true };
        let l = BucketLayout::new(&[3, 1, 2], &tiny);
        assert_eq!(l.buckets, vec![vec![2], vec![1], vec![0]], "oversized parameters get their own bucket");
    }
}
