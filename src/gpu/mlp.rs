//! [`GpuMlp`]: the CPU model of `crate::model` (same layout, same maths, same update rule)
//! trained on one GPU, optionally data-parallel through an [`NcclGroup`].
//!
//! Every parameter, gradient and optimizer state is its own device buffer, so the gradient
//! all-reduce of a layer (on the group's stream) waits only for that gradient's kernel and
//! runs while the backward pass of the layers below continues on the compute stream; the
//! fused update of each parameter in turn waits only for its own reduction.
//!
//! Mixed precision ([`Precision::Bf16`]): GEMM inputs (activations, weights, output
//! gradients) in bf16, accumulated and written in fp32; master weights, optimizer state,
//! gradients, biases, activations functions and the loss stay fp32 — autocast's recipe. The
//! fused update writes the bf16 copy of each weight as it updates it.

use std::sync::Arc;

use rlaunch_kernels::blas::Blas;
use rlaunch_kernels::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use rlaunch_kernels::nccl::RedOp;
use rlaunch_kernels::ops::Kernels;
use rlaunch_kernels::reference::AdamStep;

use super::{derr, kerr, GpuError, NcclGroup};
use crate::model::Mlp;

/// Arithmetic of the matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    /// bf16 GEMM inputs, fp32 accumulation and everything else fp32.
    Bf16,
}

impl std::str::FromStr for Precision {
    type Err = UnknownPrecision;
    fn from_str(s: &str) -> Result<Self, UnknownPrecision> {
        match s {
            "fp32" | "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(UnknownPrecision(other.to_owned())),
        }
    }
}

/// A `--precision` value that is no [`Precision`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown precision {0:?} (expected fp32 or bf16)")]
pub struct UnknownPrecision(pub String);

/// The update rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// `crate::model::Sgd`'s rule (torch's SGD with momentum).
    Sgd { lr: f32, momentum: f32, weight_decay: f32 },
    /// torch's Adam.
    Adam { lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuMlpConfig {
    pub precision: Precision,
    pub optimizer: Optimizer,
}

/// An MLP's parameters, gradients, optimizer state and activations on one GPU.
#[derive(Debug)]
pub struct GpuMlp {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Blas,
    k: Kernels,
    cfg: GpuMlpConfig,
    sizes: Vec<usize>,
    params: Vec<CudaSlice<f32>>,
    params_bf16: Vec<CudaSlice<u16>>,
    grads: Vec<CudaSlice<f32>>,
    /// SGD's velocity or Adam's first moment.
    state1: Vec<CudaSlice<f32>>,
    /// Adam's second moment (empty for SGD).
    state2: Vec<CudaSlice<f32>>,
    adam_t: u32,
    batch: usize,
    act: Activations,
}

/// Per-batch buffers, reallocated when the batch size changes.
#[derive(Debug, Default)]
struct Activations {
    x: Option<CudaSlice<f32>>,
    x_bf16: Option<CudaSlice<u16>>,
    labels: Option<CudaSlice<u32>>,
    /// Output of layer l (after its activation).
    out: Vec<CudaSlice<f32>>,
    out_bf16: Vec<CudaSlice<u16>>,
    /// Gradient w.r.t. the output of layer l (before backing through its activation).
    d: Vec<CudaSlice<f32>>,
    d_bf16: Vec<CudaSlice<u16>>,
    row_loss: Option<CudaSlice<f32>>,
    loss: Option<CudaSlice<f32>>,
}

impl GpuMlp {
    /// Uploads `model` and the optimizer state (`state`: SGD's velocity, or Adam's first then
    /// second moment, each laid out like the parameters; empty for zeros).
    pub fn new(ctx: &Arc<CudaContext>, model: &Mlp, state: &[f32], cfg: GpuMlpConfig) -> Result<Self, GpuError> {
        ctx.bind_to_thread().map_err(derr("binding the GPU context"))?;
        let stream = ctx.new_stream().map_err(derr("creating the compute stream"))?;
        let blas = Blas::new(&stream).map_err(kerr("creating the cuBLAS handle"))?;
        let k = Kernels::load(ctx).map_err(kerr("compiling and loading the kernels"))?;
        let mut m = Self {
            ctx: ctx.clone(),
            stream,
            blas,
            k,
            cfg,
            sizes: model.sizes.clone(),
            params: vec![],
            params_bf16: vec![],
            grads: vec![],
            state1: vec![],
            state2: vec![],
            adam_t: 0,
            batch: 0,
            act: Activations::default(),
        };
        let n = model.param_sizes().len();
        for p in 0..n {
            let len = model.param_range(p).len();
            m.params.push(m.zeros(len)?);
            m.grads.push(m.zeros(len)?);
            m.state1.push(m.zeros(len)?);
            if matches!(cfg.optimizer, Optimizer::Adam { .. }) {
                m.state2.push(m.zeros(len)?);
            }
            if cfg.precision == Precision::Bf16 {
                m.params_bf16.push(m.stream.alloc_zeros::<u16>(len).map_err(derr("allocating"))?);
            }
        }
        m.upload(model, state)?;
        Ok(m)
    }

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>, GpuError> {
        self.stream.alloc_zeros::<f32>(len).map_err(derr(format!("allocating {len} floats")))
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream forward, backward and update run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn layers(&self) -> usize {
        self.sizes.len() - 1
    }

    /// Replaces parameters and optimizer state with `model`'s and `state` (see [`Self::new`]).
    pub fn upload(&mut self, model: &Mlp, state: &[f32]) -> Result<(), GpuError> {
        if model.sizes != self.sizes {
            return Err(GpuError::Invalid {
                op: "upload",
                reason: format!("sizes {:?} vs {:?}", model.sizes, self.sizes),
            });
        }
        let total = model.params.len();
        let moments = if self.state2.is_empty() { 1 } else { 2 };
        if !state.is_empty() && state.len() != moments * total {
            return Err(GpuError::Invalid {
                op: "upload",
                reason: format!("state has {} floats, expected {}", state.len(), moments * total),
            });
        }
        for p in 0..self.params.len() {
            let r = model.param_range(p);
            self.stream
                .memcpy_htod(&model.params[r.clone()], &mut self.params[p])
                .map_err(derr("uploading parameters"))?;
            if state.is_empty() {
                self.stream.memset_zeros(&mut self.state1[p]).map_err(derr("zeroing state"))?;
                if let Some(s2) = self.state2.get_mut(p) {
                    self.stream.memset_zeros(s2).map_err(derr("zeroing state"))?;
                }
            } else {
                self.stream.memcpy_htod(&state[r.clone()], &mut self.state1[p]).map_err(derr("uploading state"))?;
                if let Some(s2) = self.state2.get_mut(p) {
                    let r2 = total + r.start..total + r.end;
                    self.stream.memcpy_htod(&state[r2], s2).map_err(derr("uploading state"))?;
                }
            }
            if let Some(h) = self.params_bf16.get_mut(p) {
                self.k.f32_to_bf16(&self.stream, &self.params[p], h).map_err(kerr("casting parameters"))?;
            }
        }
        Ok(())
    }

    /// Copies parameters into `model.params` and the optimizer state into `state` (same layout
    /// as [`Self::upload`]; resized).
    pub fn download(&self, model: &mut Mlp, state: &mut Vec<f32>) -> Result<(), GpuError> {
        let total = model.params.len();
        let moments = if self.state2.is_empty() { 1 } else { 2 };
        state.resize(moments * total, 0.0);
        for p in 0..self.params.len() {
            let r = model.param_range(p);
            self.stream
                .memcpy_dtoh(&self.params[p], &mut model.params[r.clone()])
                .map_err(derr("downloading parameters"))?;
            self.stream.memcpy_dtoh(&self.state1[p], &mut state[r.clone()]).map_err(derr("downloading state"))?;
            if let Some(s2) = self.state2.get(p) {
                self.stream
                    .memcpy_dtoh(s2, &mut state[total + r.start..total + r.end])
                    .map_err(derr("downloading state"))?;
            }
        }
        self.stream.synchronize().map_err(derr("synchronising the compute stream"))
    }

    /// The gradients of the last [`Self::forward_backward`], flat in parameter layout.
    pub fn grads_to_host(&self) -> Result<Vec<f32>, GpuError> {
        let mut out = Vec::new();
        for g in &self.grads {
            out.extend(self.stream.clone_dtoh(g).map_err(derr("downloading gradients"))?);
        }
        self.stream.synchronize().map_err(derr("synchronising the compute stream"))?;
        Ok(out)
    }

    fn ensure_batch(&mut self, batch: usize) -> Result<(), GpuError> {
        if self.batch == batch {
            return Ok(());
        }
        let mixed = self.cfg.precision == Precision::Bf16;
        let s = &self.stream;
        let f = |n: usize| s.alloc_zeros::<f32>(n).map_err(derr("allocating activations"));
        let h = |n: usize| s.alloc_zeros::<u16>(n).map_err(derr("allocating activations"));
        let mut a = Activations {
            x: Some(f(batch * self.sizes[0])?),
            labels: Some(s.alloc_zeros::<u32>(batch).map_err(derr("allocating labels"))?),
            row_loss: Some(f(batch)?),
            loss: Some(f(1)?),
            ..Default::default()
        };
        if mixed {
            a.x_bf16 = Some(h(batch * self.sizes[0])?);
        }
        for l in 0..self.sizes.len() - 1 {
            let n = batch * self.sizes[l + 1];
            a.out.push(f(n)?);
            a.d.push(f(n)?);
            if mixed {
                a.out_bf16.push(h(n)?);
                a.d_bf16.push(h(n)?);
            }
        }
        self.act = a;
        self.batch = batch;
        Ok(())
    }

    fn forward(&mut self, x: &[f32], batch: usize) -> Result<(), GpuError> {
        if batch == 0 || x.len() != batch * self.sizes[0] {
            return Err(GpuError::Invalid {
                op: "forward",
                reason: format!("{} inputs for batch {batch} of width {}", x.len(), self.sizes[0]),
            });
        }
        self.ensure_batch(batch)?;
        let mixed = self.cfg.precision == Precision::Bf16;
        let (s, k, blas) = (&self.stream, &self.k, &self.blas);
        let a = &mut self.act;
        let xs = a.x.as_mut().expect("allocated by ensure_batch");
        s.memcpy_htod(x, xs).map_err(derr("uploading the batch"))?;
        if mixed {
            k.f32_to_bf16(s, xs, a.x_bf16.as_mut().expect("allocated when mixed"))
                .map_err(kerr("casting the batch"))?;
        }
        let layers = self.sizes.len() - 1;
        for l in 0..layers {
            let (din, dout) = (self.sizes[l], self.sizes[l + 1]);
            let (before, rest) = a.out.split_at_mut(l);
            let out = &mut rest[0];
            let res = if mixed {
                let input = if l == 0 { a.x_bf16.as_ref().expect("mixed") } else { &a.out_bf16[l - 1] };
                blas.linear_fwd(input, &self.params_bf16[2 * l], out, batch, din, dout)
            } else {
                let input = if l == 0 { a.x.as_ref().expect("allocated") } else { &before[l - 1] };
                blas.linear_fwd(input, &self.params[2 * l], out, batch, din, dout)
            };
            res.map_err(kerr(format!("layer {l} forward GEMM")))?;
            let last = l + 1 == layers;
            let out_h = if mixed && !last { Some(&mut a.out_bf16[l]) } else { None };
            k.bias_act_fwd(s, out, &self.params[2 * l + 1], out_h, batch, dout, !last)
                .map_err(kerr(format!("layer {l} bias and ReLU")))?;
        }
        Ok(())
    }

    /// Class scores for a batch (`x`: batch x input).
    pub fn logits(&mut self, x: &[f32], batch: usize) -> Result<Vec<f32>, GpuError> {
        self.forward(x, batch)?;
        let out = self.act.out.last().expect("at least one layer");
        let v = self.stream.clone_dtoh(out).map_err(derr("downloading logits"))?;
        self.stream.synchronize().map_err(derr("synchronising the compute stream"))?;
        Ok(v)
    }

    /// Forward and backward: the batch's mean cross-entropy (this rank's), gradients in the
    /// device buffers. With `group`, each gradient's all-reduce (sum) is enqueued as soon as
    /// it is computed; the caller must [`NcclGroup::wait`] before reading them (the update
    /// in [`Self::step`] does).
    pub fn forward_backward(
        &mut self,
        x: &[f32],
        labels: &[u32],
        group: Option<&mut NcclGroup>,
    ) -> Result<f32, GpuError> {
        self.enqueue_forward_backward(x, labels, group)?;
        self.read_loss()
    }

    /// The loss of the last forward pass (waits for the compute stream up to its kernel).
    fn read_loss(&self) -> Result<f32, GpuError> {
        let loss = self
            .stream
            .clone_dtoh(self.act.loss.as_ref().expect("a forward pass ran"))
            .map_err(derr("downloading the loss"))?;
        Ok(loss[0])
    }

    fn enqueue_forward_backward(
        &mut self,
        x: &[f32],
        labels: &[u32],
        mut group: Option<&mut NcclGroup>,
    ) -> Result<(), GpuError> {
        let batch = labels.len();
        self.forward(x, batch)?;
        let mixed = self.cfg.precision == Precision::Bf16;
        let layers = self.layers();
        let kcls = self.sizes[layers];
        let (s, k, blas) = (&self.stream, &self.k, &self.blas);
        let a = &mut self.act;
        let lab = a.labels.as_mut().expect("allocated");
        s.memcpy_htod(labels, lab).map_err(derr("uploading labels"))?;
        let scale = 1.0 / batch as f32;
        k.softmax_xent(
            s,
            &a.out[layers - 1],
            lab,
            &mut a.d[layers - 1],
            a.row_loss.as_mut().expect("allocated"),
            batch,
            kcls,
            scale,
        )
        .map_err(kerr("softmax cross-entropy"))?;
        k.sum_scaled(s, a.row_loss.as_ref().expect("allocated"), a.loss.as_mut().expect("allocated"), scale)
            .map_err(kerr("summing the loss"))?;
        if mixed {
            k.f32_to_bf16(s, &a.d[layers - 1], &mut a.d_bf16[layers - 1])
                .map_err(kerr("casting the logits' gradient"))?;
        }
        for l in (0..layers).rev() {
            let (din, dout) = (self.sizes[l], self.sizes[l + 1]);
            let (gw_slot, gb_slot) = (2 * l, 2 * l + 1);
            // Weight gradient, then its reduction starts.
            {
                let gw = &mut self.grads[gw_slot];
                let r = if mixed {
                    let input = if l == 0 { a.x_bf16.as_ref().expect("mixed") } else { &a.out_bf16[l - 1] };
                    blas.linear_bwd_weight(input, &a.d_bf16[l], gw, batch, din, dout, 0.0)
                } else {
                    let input = if l == 0 { a.x.as_ref().expect("allocated") } else { &a.out[l - 1] };
                    blas.linear_bwd_weight(input, &a.d[l], gw, batch, din, dout, 0.0)
                };
                r.map_err(kerr(format!("layer {l} weight-gradient GEMM")))?;
                if let Some(g) = group.as_deref_mut() {
                    g.all_reduce_async(gw, RedOp::Sum)?;
                }
            }
            {
                let gb = &mut self.grads[gb_slot];
                k.bias_grad(s, &a.d[l], gb, batch, dout, 0.0).map_err(kerr(format!("layer {l} bias gradient")))?;
                if let Some(g) = group.as_deref_mut() {
                    g.all_reduce_async(gb, RedOp::Sum)?;
                }
            }
            if l > 0 {
                let (below, rest) = a.d.split_at_mut(l);
                let (dy, dx) = (&rest[0], &mut below[l - 1]);
                let r = if mixed {
                    blas.linear_bwd_input(&a.d_bf16[l], &self.params_bf16[gw_slot], dx, batch, din, dout)
                } else {
                    blas.linear_bwd_input(dy, &self.params[gw_slot], dx, batch, din, dout)
                };
                r.map_err(kerr(format!("layer {l} input-gradient GEMM")))?;
                let dx_h = if mixed { Some(&mut a.d_bf16[l - 1]) } else { None };
                k.relu_bwd(s, dx, &a.out[l - 1], dx_h).map_err(kerr(format!("layer {l} ReLU backward")))?;
            }
        }
        Ok(())
    }

    /// The fused update of every parameter with the (reduced) gradients; `grad_scale`
    /// multiplies them first (1 / world to average a sum).
    pub fn update(&mut self, grad_scale: f32) -> Result<(), GpuError> {
        let (s, k) = (&self.stream, &self.k);
        if matches!(self.cfg.optimizer, Optimizer::Adam { .. }) {
            self.adam_t += 1;
        }
        for p in 0..self.params.len() {
            let bf = self.params_bf16.get_mut(p);
            match self.cfg.optimizer {
                Optimizer::Sgd { lr, momentum, weight_decay } => k.sgd_momentum(
                    s,
                    &mut self.params[p],
                    &mut self.state1[p],
                    &self.grads[p],
                    bf,
                    lr,
                    momentum,
                    weight_decay,
                    grad_scale,
                ),
                Optimizer::Adam { lr, beta1, beta2, eps, weight_decay } => k.adam(
                    s,
                    &mut self.params[p],
                    &mut self.state1[p],
                    &mut self.state2[p],
                    &self.grads[p],
                    bf,
                    AdamStep::at(self.adam_t, lr, beta1, beta2, eps, weight_decay, grad_scale),
                ),
            }
            .map_err(kerr(format!("updating parameter {p}")))?;
        }
        Ok(())
    }

    /// One data-parallel training step: forward, backward with overlapped gradient
    /// all-reduce, wait for the reductions (under the group's deadline), averaged update.
    /// Returns this rank's batch loss.
    pub fn step(&mut self, x: &[f32], labels: &[u32], mut group: Option<&mut NcclGroup>) -> Result<f32, GpuError> {
        self.enqueue_forward_backward(x, labels, group.as_deref_mut())?;
        let world = group.as_ref().map_or(1, |g| g.world_size());
        // The updates are enqueued before any host wait: each waits on the device for its
        // own gradient's reduction only.
        self.update(1.0 / world as f32)?;
        if let Some(g) = group {
            g.wait()?;
        }
        self.read_loss()
    }

    /// Waits for everything enqueued on the compute stream.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(derr("synchronising the compute stream"))
    }
}
