//! [`GpuTrainer`]: what the `train` example needs to run its step on the GPU — the device
//! picked by `LOCAL_RANK`, an NCCL group when the job has more than one rank, the model and
//! its SGD state on the device — behind three calls: `step`, `download` (for checkpoints and
//! evaluation) and `upload` (after a resume).

use std::sync::Arc;

use rlaunch_kernels::cudarc::driver::CudaContext;

use super::{derr, GpuError, GpuMlp, GpuMlpConfig, NcclGroup, NcclGroupOptions, Optimizer, Precision};
use crate::env::WorkerEnv;
use crate::model::{Mlp, Sgd};

/// GPU `ordinal`'s context, made once per process and kept for its life: a round run again in
/// the same process (`rlaunch::resilient::run`) trains on the context the first round made,
/// never paying for a new one.
fn context(ordinal: usize) -> Result<Arc<CudaContext>, GpuError> {
    static CONTEXTS: std::sync::Mutex<std::collections::BTreeMap<usize, Arc<CudaContext>>> =
        std::sync::Mutex::new(std::collections::BTreeMap::new());
    let mut contexts = CONTEXTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(ctx) = contexts.get(&ordinal) {
        return Ok(ctx.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(derr(format!("opening GPU {ordinal}")))?;
    contexts.insert(ordinal, ctx.clone());
    Ok(ctx)
}

/// The train example's model, optimizer and gradient all-reduce on one GPU.
#[derive(Debug)]
pub struct GpuTrainer {
    ctx: Arc<CudaContext>,
    group: Option<NcclGroup>,
    mlp: GpuMlp,
}

impl GpuTrainer {
    /// On GPU `ordinal` (from [`super::select`]), joins the NCCL group of the job described by
    /// `env` when it has more than one rank, and uploads `model` and `opt`'s velocity.
    pub fn new(
        ordinal: usize,
        env: &WorkerEnv,
        model: &Mlp,
        opt: &Sgd,
        precision: Precision,
    ) -> Result<Self, GpuError> {
        let ctx = context(ordinal)?;
        let group =
            if env.world_size > 1 { Some(NcclGroup::from_env(env, &ctx, NcclGroupOptions::default())?) } else { None };
        let cfg = GpuMlpConfig {
            precision,
            optimizer: Optimizer::Sgd { lr: opt.lr, momentum: opt.momentum, weight_decay: opt.weight_decay },
        };
        let mlp = GpuMlp::new(&ctx, model, &opt.velocity, cfg)?;
        Ok(Self { ctx, group, mlp })
    }

    /// One data-parallel step on the batch; returns this rank's loss.
    pub fn step(&mut self, x: &[f32], labels: &[u32]) -> Result<f32, GpuError> {
        self.mlp.step(x, labels, self.group.as_mut())
    }

    /// Copies the parameters into `model` and the velocity into `opt` (checkpoints, eval).
    pub fn download(&self, model: &mut Mlp, opt: &mut Sgd) -> Result<(), GpuError> {
        self.mlp.download(model, &mut opt.velocity)
    }

    /// Replaces the device state with `model` and `opt`'s velocity (after a resume).
    pub fn upload(&mut self, model: &Mlp, opt: &Sgd) -> Result<(), GpuError> {
        self.mlp.upload(model, &opt.velocity)
    }

    /// The GPU's name, for the start-up line.
    pub fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| format!("GPU {}", self.ctx.ordinal()))
    }

    /// Aborts the NCCL communicator (the job is being torn down).
    pub fn abort(&mut self) {
        if let Some(g) = self.group.as_mut() {
            g.abort();
        }
    }
}
