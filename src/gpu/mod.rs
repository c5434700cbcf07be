//! The GPU path of the runtime (feature `cuda`): choosing the device (`--device
//! cuda|auto|cpu`), an NCCL process group bootstrapped through the agent's store, and the
//! train example's MLP trained on the GPU with the kernels of `rlaunch-kernels`.
//!
//! Code map: `device` (probe and choice, with the CPU fallback of `auto`), `group`
//! ([`NcclGroup`]: one process per GPU, `LOCAL_RANK` picks the GPU, the unique id through the
//! store, reductions on their own stream, deadline and abort), `mlp` ([`GpuMlp`]: forward,
//! backward with per-parameter gradient all-reduce overlapping the rest of the backward pass,
//! the fused update; fp32 or bf16 mixed precision), `trainer` ([`GpuTrainer`]: the train
//! example's step on the GPU in three calls), `check` (the GPU checks and benchmarks
//! `scripts/gpu-check.sh` runs).
//!
//! Invariants: nothing here calls into cudarc before `rlaunch_kernels::probe` has loaded the
//! library behind the call; a collective that misses its deadline or sees NCCL's asynchronous
//! error aborts the communicator and returns an error, so the worker exits and rlaunch's
//! restart starts from a clean slate instead of a hung GPU.

pub mod check;
mod device;
mod group;
mod mlp;
mod trainer;

use std::time::Duration;

pub use device::{select, Device, Selected, UnknownDevice};
pub use group::{exchange_unique_id, key_prefix, NcclGroup, NcclGroupOptions};
pub use mlp::{GpuMlp, GpuMlpConfig, Optimizer, Precision, UnknownPrecision};
pub use rlaunch_kernels::probe::{Probe, ProbeError, SearchPath};
pub use rlaunch_kernels::KernelError;
pub use trainer::GpuTrainer;

/// Why the GPU path failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("--device {device}: the GPU path is unavailable")]
    Unavailable {
        device: &'static str,
        #[source]
        source: ProbeError,
    },
    #[error("local rank {local_rank} needs GPU {local_rank}, but this machine has {devices} (one process per GPU)")]
    NotEnoughGpus { local_rank: usize, devices: usize },
    #[error("CUDA failure while {what}")]
    Kernel {
        what: String,
        #[source]
        source: KernelError,
    },
    #[error("NCCL bootstrap through the store failed at {step} (key {key:?})")]
    Store {
        step: &'static str,
        key: String,
        #[source]
        source: Box<crate::store::StoreError>,
    },
    #[error("rank {rank}: {op} did not complete within {timeout:?}; the NCCL communicator was aborted")]
    Timeout { rank: usize, op: &'static str, timeout: Duration },
    #[error("rank {rank}: NCCL failed during {op}; the communicator was aborted")]
    Aborted {
        rank: usize,
        op: &'static str,
        #[source]
        source: KernelError,
    },
    /// The round ended (`rlaunch::comm::abort_all`, what `rlaunch::resilient::run` calls when
    /// the agent says so): the communicator was aborted, or the bootstrap given up.
    #[error("rank {rank}: {op} ended because the round ended; the NCCL communicator was aborted")]
    Interrupted { rank: usize, op: &'static str },
    #[error("the worker environment is unusable for the NCCL group")]
    Env(#[from] crate::env::EnvError),
    #[error("invalid arguments to {op}: {reason}")]
    Invalid { op: &'static str, reason: String },
}

pub(crate) fn kerr(what: impl Into<String>) -> impl FnOnce(KernelError) -> GpuError {
    let what = what.into();
    move |source| GpuError::Kernel { what, source }
}

pub(crate) fn derr(what: impl Into<String>) -> impl FnOnce(rlaunch_kernels::cudarc::driver::DriverError) -> GpuError {
    let what = what.into();
    move |source| GpuError::Kernel { what: what.clone(), source: KernelError::Driver { what, source } }
}
