//! The compiled kernels loaded into one CUDA context, with a typed launcher per kernel.
//!
//! Buffers are whole `CudaSlice`s (one per tensor): cudarc tracks reads and writes per
//! allocation, so a kernel on one stream waits exactly for the last writer of each buffer it
//! uses on another stream — which is what lets gradient all-reduce overlap backward kernels.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::reference::AdamStep;
use crate::{compile, sources, KernelError};

const BLOCK: u32 = 256;

/// One thread per element, grid-stride beyond 65535 blocks.
fn cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn check(op: &'static str, ok: bool, reason: impl FnOnce() -> String) -> Result<(), KernelError> {
    if ok {
        Ok(())
    } else {
        Err(KernelError::InvalidArgument { op, reason: reason() })
    }
}

fn i32_of(op: &'static str, what: &str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::InvalidArgument { op, reason: format!("{what} = {v} exceeds i32") })
}

/// Every kernel of [`sources::ALL`], loaded into one context.
#[derive(Debug, Clone)]
pub struct Kernels {
    ctx: Arc<CudaContext>,
    funcs: HashMap<&'static str, CudaFunction>,
    code: Vec<String>,
}

impl Kernels {
    /// Compiles (once per process) and loads every source into `ctx`: CUBIN for the GPU's
    /// compute capability, falling back to PTX (driver JIT) when that fails.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, KernelError> {
        let (major, minor) = ctx.compute_capability().map_err(KernelError::driver("reading the compute capability"))?;
        let arch = (major.max(0) as u32, minor.max(0) as u32);
        let mut funcs = HashMap::new();
        let mut code = Vec::new();
        for src in sources::ALL {
            let as_cubin = compile::cubin(src, arch).and_then(|bin| {
                ctx.load_module(Ptx::from_binary((*bin).clone()))
                    .map_err(KernelError::driver(format!("loading the sm_{}{} CUBIN of {}", arch.0, arch.1, src.name)))
            });
            let (module, kind) = match as_cubin {
                Ok(m) => (m, format!("{}: sm_{}{} CUBIN", src.name, arch.0, arch.1)),
                Err(cubin_err) => {
                    let ptx = compile::ptx(src)?;
                    let m = ctx.load_module((*ptx).clone()).map_err(|source| KernelError::Driver {
                        what: format!("loading the PTX of {} (after the CUBIN failed: {cubin_err})", src.name),
                        source,
                    })?;
                    (m, format!("{}: PTX, JIT by the driver (CUBIN failed: {cubin_err})", src.name))
                }
            };
            for &k in src.kernels {
                let f = module.load_function(k).map_err(KernelError::driver(format!("looking up kernel {k}")))?;
                funcs.insert(k, f);
            }
            code.push(kind);
        }
        Ok(Self { ctx: ctx.clone(), funcs, code })
    }

    /// How each source was loaded (CUBIN for which `sm`, or PTX), for reports.
    pub fn code_kinds(&self) -> &[String] {
        &self.code
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn f(&self, name: &'static str) -> &CudaFunction {
        self.funcs.get(name).expect("every kernel of sources::ALL is loaded by Kernels::load")
    }

    /// `y = act(y + b)` on `rows x cols`; also writes bf16 `y_bf16` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn bias_act_fwd(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut CudaSlice<f32>,
        b: &CudaSlice<f32>,
        y_bf16: Option<&mut CudaSlice<u16>>,
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> Result<(), KernelError> {
        const OP: &str = "bias_act_fwd";
        let n = rows * cols;
        check(OP, y.len() >= n && b.len() >= cols, || format!("y {} b {} for {rows}x{cols}", y.len(), b.len()))?;
        let (r, c, act) = (i32_of(OP, "rows", rows)?, i32_of(OP, "cols", cols)?, i32::from(relu));
        let null = 0u64;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(y).arg(b);
        match y_bf16 {
            Some(h) => {
                check(OP, h.len() >= n, || format!("y_bf16 has {} < {n}", h.len()))?;
                l.arg(h)
            }
            None => l.arg(&null),
        };
        l.arg(&r).arg(&c).arg(&act);
        // SAFETY: arguments match `bias_act_fwd(float*, const float*, bf16_t*, int, int, int)`
        // in activation.cu; the buffers hold at least rows*cols (and cols) elements.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    /// `dx = 0` where the ReLU output `a <= 0`; also writes bf16 `dx_bf16` when given.
    pub fn relu_bwd(
        &self,
        stream: &Arc<CudaStream>,
        dx: &mut CudaSlice<f32>,
        a: &CudaSlice<f32>,
        dx_bf16: Option<&mut CudaSlice<u16>>,
    ) -> Result<(), KernelError> {
        const OP: &str = "relu_bwd";
        let n = dx.len();
        check(OP, a.len() >= n, || format!("a has {} < {n}", a.len()))?;
        let n64 = n as i64;
        let null = 0u64;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(dx).arg(a);
        match dx_bf16 {
            Some(h) => {
                check(OP, h.len() >= n, || format!("dx_bf16 has {} < {n}", h.len()))?;
                l.arg(h)
            }
            None => l.arg(&null),
        };
        l.arg(&n64);
        // SAFETY: matches `relu_bwd(float*, const float*, bf16_t*, long long)`; lengths checked.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    /// GELU forward with bias; `pre` keeps the pre-activation for [`Self::gelu_bwd`].
    pub fn bias_gelu_fwd(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut CudaSlice<f32>,
        b: &CudaSlice<f32>,
        pre: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "bias_gelu_fwd";
        let n = rows * cols;
        check(OP, y.len() >= n && pre.len() >= n && b.len() >= cols, || {
            format!("buffers too small for {rows}x{cols}")
        })?;
        let (r, c) = (i32_of(OP, "rows", rows)?, i32_of(OP, "cols", cols)?);
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(y).arg(b).arg(pre).arg(&r).arg(&c);
        // SAFETY: matches `bias_gelu_fwd(float*, const float*, float*, int, int)`; sizes checked.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    pub fn gelu_bwd(
        &self,
        stream: &Arc<CudaStream>,
        dx: &mut CudaSlice<f32>,
        pre: &CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "gelu_bwd";
        let n = dx.len();
        check(OP, pre.len() >= n, || format!("pre has {} < {n}", pre.len()))?;
        let n64 = n as i64;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(dx).arg(pre).arg(&n64);
        // SAFETY: matches `gelu_bwd(float*, const float*, long long)`; lengths checked.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    /// `gb = beta * gb + column sums of dy` (`rows x cols`).
    pub fn bias_grad(
        &self,
        stream: &Arc<CudaStream>,
        dy: &CudaSlice<f32>,
        gb: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
        beta: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "bias_grad";
        check(OP, dy.len() >= rows * cols && gb.len() >= cols, || {
            format!("dy {} gb {} for {rows}x{cols}", dy.len(), gb.len())
        })?;
        let (r, c) = (i32_of(OP, "rows", rows)?, i32_of(OP, "cols", cols)?);
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(dy).arg(gb).arg(&r).arg(&c).arg(&beta);
        // SAFETY: matches `bias_grad(const float*, float*, int, int, float)`; sizes checked.
        unsafe { l.launch(cfg(cols)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    /// `out[0] = scale * sum(x)` in a fixed order.
    pub fn sum_scaled(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        scale: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "sum_scaled";
        check(OP, !out.is_empty(), || "out is empty".into())?;
        let n = i32_of(OP, "n", x.len())?;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(x).arg(out).arg(&n).arg(&scale);
        let one_block = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches `sum_scaled(const float*, float*, int, float)`, which needs exactly
        // one block of 256 threads (its shared array); out holds at least one element.
        unsafe { l.launch(one_block) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    /// Per-row cross-entropy `loss` and `dz = (softmax(z) - onehot) * scale`.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_xent(
        &self,
        stream: &Arc<CudaStream>,
        z: &CudaSlice<f32>,
        labels: &CudaSlice<u32>,
        dz: &mut CudaSlice<f32>,
        loss: &mut CudaSlice<f32>,
        rows: usize,
        k: usize,
        scale: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "softmax_xent";
        let n = rows * k;
        check(OP, z.len() >= n && dz.len() >= n && labels.len() >= rows && loss.len() >= rows, || {
            format!("buffers too small for {rows} rows of {k} classes")
        })?;
        let (r, kk) = (i32_of(OP, "rows", rows)?, i32_of(OP, "k", k)?);
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(z).arg(labels).arg(dz).arg(loss).arg(&r).arg(&kk).arg(&scale);
        // SAFETY: matches `softmax_xent(const float*, const unsigned*, float*, float*, int, int,
        // float)`; sizes checked; labels are bounds-checked in the kernel.
        unsafe { l.launch(cfg(rows)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    /// Fused SGD-momentum update of `p`, `v` from `g` (all the same length); writes the
    /// updated parameters in bf16 to `p_bf16` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn sgd_momentum(
        &self,
        stream: &Arc<CudaStream>,
        p: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        p_bf16: Option<&mut CudaSlice<u16>>,
        lr: f32,
        momentum: f32,
        weight_decay: f32,
        grad_scale: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "sgd_momentum";
        let n = p.len();
        check(OP, v.len() == n && g.len() == n, || format!("p {n} v {} g {}", v.len(), g.len()))?;
        let n64 = n as i64;
        let null = 0u64;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(p).arg(v).arg(g);
        match p_bf16 {
            Some(h) => {
                check(OP, h.len() >= n, || format!("p_bf16 has {} < {n}", h.len()))?;
                l.arg(h)
            }
            None => l.arg(&null),
        };
        l.arg(&n64).arg(&lr).arg(&momentum).arg(&weight_decay).arg(&grad_scale);
        // SAFETY: matches `sgd_momentum(float*, float*, const float*, bf16_t*, long long, float,
        // float, float, float)`; lengths checked.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    /// Fused Adam update (torch's, L2 weight decay).
    #[allow(clippy::too_many_arguments)]
    pub fn adam(
        &self,
        stream: &Arc<CudaStream>,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        p_bf16: Option<&mut CudaSlice<u16>>,
        h: AdamStep,
    ) -> Result<(), KernelError> {
        const OP: &str = "adam";
        let n = p.len();
        check(OP, m.len() == n && v.len() == n && g.len() == n, || {
            format!("p {n} m {} v {} g {}", m.len(), v.len(), g.len())
        })?;
        let n64 = n as i64;
        let null = 0u64;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(p).arg(m).arg(v).arg(g);
        match p_bf16 {
            Some(hb) => {
                check(OP, hb.len() >= n, || format!("p_bf16 has {} < {n}", hb.len()))?;
                l.arg(hb)
            }
            None => l.arg(&null),
        };
        l.arg(&n64)
            .arg(&h.lr)
            .arg(&h.beta1)
            .arg(&h.beta2)
            .arg(&h.eps)
            .arg(&h.weight_decay)
            .arg(&h.bc1)
            .arg(&h.bc2)
            .arg(&h.grad_scale);
        // SAFETY: matches `adam(float*, float*, float*, const float*, bf16_t*, long long, float
        // x8)` in optim.cu; lengths checked.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    pub fn f32_to_bf16(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<u16>,
    ) -> Result<(), KernelError> {
        const OP: &str = "f32_to_bf16_kernel";
        let n = x.len();
        check(OP, y.len() >= n, || format!("y has {} < {n}", y.len()))?;
        let n64 = n as i64;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(x).arg(y).arg(&n64);
        // SAFETY: matches `f32_to_bf16_kernel(const float*, bf16_t*, long long)`; lengths checked.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    pub fn bf16_to_f32(
        &self,
        stream: &Arc<CudaStream>,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "bf16_to_f32_kernel";
        let n = x.len();
        check(OP, y.len() >= n, || format!("y has {} < {n}", y.len()))?;
        let n64 = n as i64;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(x).arg(y).arg(&n64);
        // SAFETY: matches `bf16_to_f32_kernel(const bf16_t*, float*, long long)`; lengths checked.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }

    /// `y += a * x`.
    pub fn axpy(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        a: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "axpy_f32";
        let n = y.len();
        check(OP, x.len() >= n, || format!("x has {} < {n}", x.len()))?;
        let n64 = n as i64;
        let mut l = stream.launch_builder(self.f(OP));
        l.arg(y).arg(x).arg(&a).arg(&n64);
        // SAFETY: matches `axpy_f32(float*, const float*, float, long long)`; lengths checked.
        unsafe { l.launch(cfg(n)) }.map_err(KernelError::driver(OP))?;
        Ok(())
    }
}
