//! [`NcclGroup`]: NCCL for one process per GPU, bootstrapped through the agent's store.
//!
//! Bootstrap: rank 0 makes the 128-byte unique id and sets it under
//! `rlaunch/nccl/{run id}/{restart count}/id`; every rank reads it, counts itself in under
//! `…/joined` and waits for `…/ready`, which the last rank to join sets. Only then do ranks
//! call `ncclCommInitRank` (which blocks until all have), so a rank that never comes turns
//! into a store timeout, not a hang inside NCCL. The restart count in the keys keeps an old
//! attempt's id from being picked up by a new one.
//!
//! Reductions are enqueued on the group's own stream. cudarc tracks the last writer of each
//! buffer, so a reduction waits only for the kernel that produced its gradient while the
//! backward pass goes on on the compute stream. [`NcclGroup::wait`] polls completion and
//! NCCL's asynchronous error against the deadline; either failure aborts the communicator.
//!
//! A round's end (`rlaunch::comm::abort_all`, called by `rlaunch::resilient::run` when the
//! agent says the round ended) ends the bootstrap's waits and every wait of a group made before
//! it: the communicator is aborted and [`GpuError::Interrupted`] returned, so a survivor waiting
//! on a lost peer's reduction makes a new group in the same process, on the same CUDA context.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rlaunch_kernels::cudarc::driver::{CudaContext, CudaStream, DevicePtrMut};
use rlaunch_kernels::nccl::{Comm, NcclType, RedOp, UniqueId};

use super::{derr, GpuError};
use crate::env::WorkerEnv;
use crate::store::StoreClient;

/// Settings of an [`NcclGroup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclGroupOptions {
    /// Deadline of the bootstrap and of every [`NcclGroup::wait`].
    pub timeout: Duration,
}

impl Default for NcclGroupOptions {
    fn default() -> Self {
        Self { timeout: crate::comm::DEFAULT_TIMEOUT }
    }
}

/// One rank of an NCCL group on its GPU.
#[derive(Debug)]
pub struct NcclGroup {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Comm,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Operations enqueued since the last successful wait.
    pending: usize,
    /// When the group was made: a round's end since ends it.
    born: crate::comm::AbortMark,
}

/// The store keys of one attempt of one job.
pub fn key_prefix(run_id: &str, restart_count: u32) -> String {
    format!("rlaunch/nccl/{run_id}/{restart_count}/")
}

/// The store half of the bootstrap (no GPU involved): rank 0 makes the NCCL unique id and
/// publishes it under `{prefix}id`; every rank reads it, counts itself in under
/// `{prefix}joined`, and waits (at most `timeout`) until all `world` ranks have.
pub fn exchange_unique_id(
    store: &mut StoreClient,
    prefix: &str,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<UniqueId, GpuError> {
    counted(exchange(store, prefix, rank, world, timeout))
}

/// A failed bootstrap or collective counts in `rlaunch::comm::failures` (what
/// `rlaunch::resilient::run` reads to tell a round's end from the program's own error): a peer
/// gone, a store gone with its agent, a round ended.
fn counted<T>(r: Result<T, GpuError>) -> Result<T, GpuError> {
    if r.is_err() {
        crate::comm::note_failure();
    }
    r
}

fn exchange(
    store: &mut StoreClient,
    prefix: &str,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<UniqueId, GpuError> {
    if world == 0 || rank >= world {
        return Err(GpuError::Invalid { op: "exchange_unique_id", reason: format!("rank {rank} of world {world}") });
    }
    let begun = crate::comm::AbortMark::now();
    if begun.ended() {
        // Started after a round's end and before the next round cleared it: that round is over.
        return Err(GpuError::Interrupted { rank, op: "bootstrap" });
    }
    let t = timeout;
    let store_err = |step: &'static str, key: &str| {
        let key = key.to_string();
        move |source| GpuError::Store { step, key, source: Box::new(source) }
    };
    let id_key = format!("{prefix}id");
    if rank == 0 {
        let id = UniqueId::new().map_err(super::kerr("making the NCCL unique id"))?;
        store.set(&id_key, &id.internal).map_err(store_err("publish id", &id_key))?;
    }
    wait_for_key(store, &id_key, rank, t, begun).map_err(|e| e.keyed("wait for id", &id_key))?;
    let bytes = store.get(&id_key).map_err(store_err("read id", &id_key))?;
    let id = UniqueId::from_bytes(&bytes).ok_or_else(|| GpuError::Invalid {
        op: "exchange_unique_id",
        reason: format!("the id under {id_key:?} has {} bytes, not 128", bytes.len()),
    })?;
    let joined_key = format!("{prefix}joined");
    let ready_key = format!("{prefix}ready");
    let n = store.add(&joined_key, 1).map_err(store_err("count in", &joined_key))?;
    if n == world as i64 {
        store.set(&ready_key, b"1").map_err(store_err("announce ready", &ready_key))?;
    }
    wait_for_key(store, &ready_key, rank, t, begun).map_err(|e| e.keyed("wait for every rank", &ready_key))?;
    Ok(id)
}

/// How a bootstrap wait ended, short of the key.
enum KeyWait {
    Store(crate::store::StoreError),
    Timeout { rank: usize, timeout: Duration },
    Interrupted { rank: usize },
}

impl KeyWait {
    fn keyed(self, step: &'static str, key: &str) -> GpuError {
        match self {
            KeyWait::Store(source) => GpuError::Store { step, key: key.to_string(), source: Box::new(source) },
            KeyWait::Timeout { rank, timeout } => GpuError::Timeout { rank, op: step, timeout },
            KeyWait::Interrupted { rank } => GpuError::Interrupted { rank, op: step },
        }
    }
}

/// How long one slice of a bootstrap wait lasts: a round's end is seen between slices (a wait
/// already blocked also ends when `rlaunch::resilient` shuts the store's connection down).
const WAIT_SLICE: Duration = Duration::from_millis(250);

/// Waits (at most `timeout`) until `key` is set, as the store's own waits in slices of
/// [`WAIT_SLICE`] (one request per rank per slice, released by the store as the key is set);
/// a round's end since `begun` ends the wait.
fn wait_for_key(
    store: &mut StoreClient,
    key: &str,
    rank: usize,
    timeout: Duration,
    begun: crate::comm::AbortMark,
) -> Result<(), KeyWait> {
    let deadline = Instant::now() + timeout;
    loop {
        if begun.ended() {
            return Err(KeyWait::Interrupted { rank });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(KeyWait::Timeout { rank, timeout });
        }
        match store.wait(&[key], WAIT_SLICE.min(deadline - now)) {
            Ok(()) => return Ok(()),
            Err(e) if e.is_timeout() => {}
            Err(e) => return Err(KeyWait::Store(e)),
        }
    }
}

impl NcclGroup {
    /// Joins the group described by the worker environment on GPU `ctx` (the caller picked it
    /// from `LOCAL_RANK`), through the store at `MASTER_ADDR:MASTER_PORT`.
    pub fn from_env(env: &WorkerEnv, ctx: &Arc<CudaContext>, opts: NcclGroupOptions) -> Result<Self, GpuError> {
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        let mut store =
            counted(
                StoreClient::connect_until(&addr, opts.timeout, crate::comm::aborted).map_err(|source| {
                    GpuError::Store { step: "connect", key: String::new(), source: Box::new(source) }
                }),
            )?;
        Self::init(
            &mut store,
            &key_prefix(&env.run_id, env.restart_count),
            env.rank as usize,
            env.world_size as usize,
            ctx,
            opts,
        )
    }

    /// Joins as `rank` of `world`, exchanging the id under `prefix` in `store`.
    pub fn init(
        store: &mut StoreClient,
        prefix: &str,
        rank: usize,
        world: usize,
        ctx: &Arc<CudaContext>,
        opts: NcclGroupOptions,
    ) -> Result<Self, GpuError> {
        let born = crate::comm::AbortMark::now();
        let id = exchange_unique_id(store, prefix, rank, world, opts.timeout)?;
        ctx.bind_to_thread().map_err(derr("binding the GPU context"))?;
        let stream = ctx.new_stream().map_err(derr("creating the NCCL stream"))?;
        // Blocks until every rank joined (all were counted in just before); a peer lost meanwhile
        // fails it when `rlaunch::resilient` shuts the round's connections down (NCCL's bootstrap
        // is TCP to the round's hosts), not on `abort_all` alone.
        let comm = counted(Comm::init_rank(&id, rank, world).map_err(super::kerr("ncclCommInitRank")))?;
        Ok(Self { ctx: ctx.clone(), stream, comm, rank, world, timeout: opts.timeout, pending: 0, born })
    }

    /// Whether a round ended since the group was made (it is unusable then).
    fn round_ended(&self) -> bool {
        self.born.ended()
    }

    /// The round ended: the communicator is aborted (no kernel stays stuck on a lost peer).
    fn interrupted(&mut self, op: &'static str) -> GpuError {
        let _ = self.comm.abort();
        crate::comm::note_failure();
        GpuError::Interrupted { rank: self.rank, op }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world_size(&self) -> usize {
        self.world
    }
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
    /// The stream reductions run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The communicator, for raw calls (benchmarks).
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    fn fail(&mut self, op: &'static str, source: rlaunch_kernels::KernelError) -> GpuError {
        let _ = self.comm.abort();
        crate::comm::note_failure();
        GpuError::Aborted { rank: self.rank, op, source }
    }

    /// Enqueues an in-place all-reduce of `buf` on the group's stream; returns at once.
    pub fn all_reduce_async<T: NcclType, B: DevicePtrMut<T>>(
        &mut self,
        buf: &mut B,
        op: RedOp,
    ) -> Result<(), GpuError> {
        if self.round_ended() {
            return Err(self.interrupted("all_reduce"));
        }
        let stream = self.stream.clone();
        match self.comm.all_reduce_in_place(buf, op, &stream) {
            Ok(()) => {
                self.pending += 1;
                Ok(())
            }
            Err(e) => Err(self.fail("all_reduce", e)),
        }
    }

    /// Enqueues an in-place broadcast of `buf` from `root`.
    pub fn broadcast_async<T: NcclType, B: DevicePtrMut<T>>(
        &mut self,
        buf: &mut B,
        root: usize,
    ) -> Result<(), GpuError> {
        if self.round_ended() {
            return Err(self.interrupted("broadcast"));
        }
        let stream = self.stream.clone();
        match self.comm.broadcast_in_place(buf, root, &stream) {
            Ok(()) => {
                self.pending += 1;
                Ok(())
            }
            Err(e) => Err(self.fail("broadcast", e)),
        }
    }

    /// Waits until everything enqueued so far has completed, at most the group's timeout.
    /// A timeout or an asynchronous NCCL error aborts the communicator (so no kernel stays
    /// stuck waiting on a dead peer) and is returned; the group is unusable afterwards.
    pub fn wait(&mut self) -> Result<(), GpuError> {
        if self.pending == 0 {
            return Ok(());
        }
        let done = self.stream.record_event(None).map_err(derr("recording the NCCL stream's event"))?;
        let start = Instant::now();
        let deadline = start + self.timeout;
        loop {
            match done.try_is_complete() {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    // A fault of the device (not counted as a failed collective: the worker
                    // ends with it, and its rank starts anew in a new process and context).
                    let _ = self.comm.abort();
                    return Err(derr("polling the NCCL stream")(e));
                }
            }
            if let Err(e) = self.comm.async_error() {
                return Err(self.fail("wait", e));
            }
            if self.round_ended() {
                return Err(self.interrupted("wait for NCCL"));
            }
            if Instant::now() >= deadline {
                let _ = self.comm.abort();
                crate::comm::note_failure();
                return Err(GpuError::Timeout { rank: self.rank, op: "wait for NCCL", timeout: self.timeout });
            }
            // Spin briefly (reductions of a step take micro- to milliseconds), then back off.
            if start.elapsed() < Duration::from_millis(2) {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.pending = 0;
        Ok(())
    }

    /// All-reduce and wait.
    pub fn all_reduce<T: NcclType, B: DevicePtrMut<T>>(&mut self, buf: &mut B, op: RedOp) -> Result<(), GpuError> {
        self.all_reduce_async(buf, op)?;
        self.wait()
    }

    /// All-reduce of a small host buffer (counters, a loss) through a device copy.
    pub fn all_reduce_host<T: NcclType + rlaunch_kernels::cudarc::driver::ValidAsZeroBits + Clone + Default>(
        &mut self,
        host: &mut [T],
        op: RedOp,
    ) -> Result<(), GpuError> {
        let stream = self.stream.clone();
        let mut dev = stream.clone_htod(host).map_err(derr("copying to the GPU"))?;
        self.all_reduce(&mut dev, op)?;
        stream.memcpy_dtoh(&dev, host).map_err(derr("copying from the GPU"))?;
        stream.synchronize().map_err(derr("synchronising the NCCL stream"))?;
        Ok(())
    }

    /// Aborts the communicator now (e.g. when the job is being torn down).
    pub fn abort(&mut self) {
        let _ = self.comm.abort();
    }
}
