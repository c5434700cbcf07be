//! The GPU checks and benchmarks that `scripts/gpu-check.sh` runs on a machine with a GPU
//! (through the ignored test `kernels_nvrtc::gpu_check` in `integration-tests/tests/kernels_nvrtc.rs`):
//!
//! 1. every kernel against its CPU reference (`rlaunch_kernels::reference`) on fresh random
//!    inputs, within a relative-error bound per precision;
//! 2. GPU training against the CPU model (`crate::model`) from the same initialisation and
//!    batches: gradients, loss curves (fp32 closely, bf16 loosely), through an NCCL group;
//! 3. NCCL all-reduce with the ranks one GPU allows (1), bootstrapped through a real store;
//! 4. benchmarks: the group's all-reduce against raw `ncclAllReduce` of the same sizes, and
//!    the fused update kernels' bandwidth against the card's device-to-device copy.
//!
//! [`run`] returns the report as Markdown (for `bench/gpu/RESULTS.md`) and whether every
//! check passed. Benchmarks never fail the run; they are numbers to read.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rlaunch_kernels::blas::Blas;
use rlaunch_kernels::cudarc::driver::{sys::CUevent_flags, CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use rlaunch_kernels::nccl::RedOp;
use rlaunch_kernels::ops::Kernels;
use rlaunch_kernels::probe::{Lib, SearchPath};
use rlaunch_kernels::reference as r;

use super::{derr, kerr, GpuError, GpuMlp, GpuMlpConfig, NcclGroup, NcclGroupOptions, Optimizer, Precision};
use crate::model::{FlatGrads, Mlp, SplitMix};

/// What [`run`] found.
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// Markdown, ready for RESULTS.md.
    pub markdown: String,
    pub failures: Vec<String>,
}

struct Ctx {
    ctx: Arc<CudaContext>,
    s: Arc<CudaStream>,
    k: Kernels,
    blas: Blas,
    rng: SplitMix,
    md: String,
    failures: Vec<String>,
}

impl Ctx {
    fn randn(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.normal() * scale).collect()
    }
    fn up<T: rlaunch_kernels::cudarc::driver::DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>, GpuError> {
        self.s.clone_htod(v).map_err(derr("uploading"))
    }
    fn down<T: rlaunch_kernels::cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        d: &CudaSlice<T>,
    ) -> Result<Vec<T>, GpuError> {
        let v = self.s.clone_dtoh(d).map_err(derr("downloading"))?;
        self.s.synchronize().map_err(derr("synchronising"))?;
        Ok(v)
    }
    /// Records one comparison as a table row.
    fn cmp(&mut self, what: &str, got: &[f32], want: &[f32], floor: f32, bound: f32) {
        let (err, at) = r::max_rel_err(got, want, floor);
        let ok = err <= bound;
        let _ = writeln!(
            self.md,
            "| {what} | {} | {err:.2e} | {bound:.0e} | {} |",
            got.len(),
            if ok { "pass" } else { "**FAIL**" }
        );
        if !ok {
            self.failures.push(format!(
                "{what}: max relative error {err:.3e} > {bound:.0e} at {at} (got {} want {})",
                got[at], want[at]
            ));
        }
    }
    /// `got` against the f64 truth `exact`, its error bounded by `factor` times that of the plain
    /// f32 evaluation `ref32` (relative, with `floor`): for operations whose conditioning makes
    /// a fixed bound either too loose or too tight.
    fn cmp_to_exact(&mut self, what: &str, got: &[f32], ref32: &[f32], exact: &[f64], floor: f64, factor: f64) {
        let err = |v: &[f32]| {
            v.iter().zip(exact).enumerate().fold((0.0f64, 0usize), |worst, (i, (&a, &e))| {
                let r =
                    if a.is_nan() || e.is_nan() { f64::INFINITY } else { (a as f64 - e).abs() / e.abs().max(floor) };
                if r > worst.0 {
                    (r, i)
                } else {
                    worst
                }
            })
        };
        let ((eg, at), (er, _)) = (err(got), err(ref32));
        let bound = (factor * er).max(f32::EPSILON as f64);
        let ok = eg <= bound;
        let _ = writeln!(
            self.md,
            "| {what} | {} | {eg:.2e} (f32 reference: {er:.2e}) | {bound:.1e} | {} |",
            got.len(),
            if ok { "pass" } else { "**FAIL**" }
        );
        if !ok {
            self.failures.push(format!(
                "{what}: max relative error {eg:.3e} > {bound:.1e} at {at} (got {} want {})",
                got[at], exact[at]
            ));
        }
    }
    fn fail(&mut self, what: String) {
        let _ = writeln!(self.md, "\n**FAIL**: {what}\n");
        self.failures.push(what);
    }
}

/// Runs every check and benchmark on GPU 0. `Err` only when the GPU path cannot start at
/// all (no driver, no GPU, a library missing); failed checks are in the report.
pub fn run(search: &SearchPath, date: &str) -> Result<CheckReport, GpuError> {
    let probe = rlaunch_kernels::probe::probe(search);
    probe
        .require(&[Lib::Driver, Lib::Nvrtc, Lib::Cublas], true)
        .map_err(|source| GpuError::Unavailable { device: "cuda", source })?;
    // Without NCCL the kernel and training checks still run; the NCCL ones are failures.
    let nccl = probe.require(&[Lib::Nccl], false).map_err(|e| e.to_string());
    let ctx = CudaContext::new(0).map_err(derr("creating the context of GPU 0"))?;
    let s = ctx.new_stream().map_err(derr("creating a stream"))?;
    let k = Kernels::load(&ctx).map_err(kerr("compiling and loading the kernels"))?;
    let blas = Blas::new(&s).map_err(kerr("creating cuBLAS"))?;
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    let name = ctx.name().unwrap_or_else(|e| format!("unknown ({e})"));
    let (cc_major, cc_minor) = ctx.compute_capability().unwrap_or((0, 0));
    let mem_gib = ctx.total_mem().map_or(0.0, |b| b as f64 / (1u64 << 30) as f64);
    let nccl_version = match &nccl {
        Ok(()) => rlaunch_kernels::nccl::version()
            .map(|(a, b, c)| format!("NCCL {a}.{b}.{c}"))
            .unwrap_or_else(|e| format!("NCCL unusable: {e}")),
        Err(e) => format!("NCCL missing: {e}"),
    };
    let mut c = Ctx { ctx: ctx.clone(), s, k, blas, rng: SplitMix(seed), md: String::new(), failures: vec![] };
    let _ = writeln!(c.md, "# GPU checks and benchmarks\n");
    let _ =
        writeln!(c.md, "- date: {date}\n- device: {name} (compute capability {cc_major}.{cc_minor}, {mem_gib:.0} GiB)");
    let _ = writeln!(c.md, "- {nccl_version}\n- random seed {seed}; written by `scripts/gpu-check.sh`\n");
    for (lib, st) in &probe.libs {
        if let rlaunch_kernels::probe::LibState::Loaded { from } = st {
            let _ = writeln!(c.md, "- {}: `{from}`", lib.label());
        }
    }

    for kind in c.k.code_kinds().to_vec() {
        let _ = writeln!(c.md, "- kernels: {kind}");
    }

    kernels_vs_reference(&mut c)?;
    // Each NCCL part is fenced: a failure there is reported, and the rest still runs.
    let mut group = match &nccl {
        Ok(()) => match single_rank_group(&ctx) {
            Ok(g) => Some(g),
            Err(e) => {
                c.fail(format!("NCCL group bootstrap: {}", chain(&e)));
                None
            }
        },
        Err(e) => {
            c.fail(format!("NCCL checks not run: {e}"));
            None
        }
    };
    if let Err(e) = training_vs_cpu(&mut c, group.as_mut().map(|g| &mut g.0)) {
        c.fail(format!("training run: {}", chain(&e)));
    }
    if let Some((g, _store)) = group.as_mut() {
        if let Err(e) = nccl_single_rank(&mut c, g) {
            c.fail(format!("NCCL all-reduce: {}", chain(&e)));
        }
        if let Err(e) = bench_nccl(&mut c, g) {
            c.fail(format!("NCCL benchmark: {}", chain(&e)));
        }
    }
    if let Err(e) = bench_update(&mut c) {
        c.fail(format!("update benchmark: {}", chain(&e)));
    }
    let _ = writeln!(
        c.md,
        "\n## Verdict\n\n{}",
        if c.failures.is_empty() {
            "Every check passed.".to_string()
        } else {
            format!("{} check(s) FAILED:\n\n- {}", c.failures.len(), c.failures.join("\n- "))
        }
    );
    Ok(CheckReport { markdown: c.md, failures: c.failures })
}

/// An error with its sources, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        s.push_str(": ");
        s.push_str(&src.to_string());
        cur = src.source();
    }
    s
}

fn kernels_vs_reference(c: &mut Ctx) -> Result<(), GpuError> {
    let _ = writeln!(c.md, "\n## Kernels against the CPU reference (fresh random inputs)\n");
    let _ = writeln!(c.md, "| kernel | elements | max rel. error | bound | |\n|---|---|---|---|---|");
    let (rows, cols) = (317, 263); // odd sizes: partial blocks and rows
    let n = rows * cols;

    // bias + activation (fp32 output, and the fused bf16 copy)
    for relu in [true, false] {
        let y0 = c.randn(n, 1.0);
        let b = c.randn(cols, 0.5);
        let mut dy = c.up(&y0)?;
        let db = c.up(&b)?;
        let mut dh = c.s.alloc_zeros::<u16>(n).map_err(derr("alloc"))?;
        c.k.bias_act_fwd(&c.s, &mut dy, &db, Some(&mut dh), rows, cols, relu).map_err(kerr("bias_act_fwd"))?;
        let mut want = y0.clone();
        r::bias_act_fwd(&mut want, &b, cols, relu);
        let got = c.down(&dy)?;
        c.cmp(
            if relu { "bias_act_fwd (ReLU), fp32" } else { "bias_act_fwd (identity), fp32" },
            &got,
            &want,
            1e-6,
            1e-6,
        );
        let goth: Vec<f32> = c.down(&dh)?.into_iter().map(r::bf16_to_f32).collect();
        let wanth: Vec<f32> = want.iter().map(|&v| r::bf16_to_f32(r::f32_to_bf16(v))).collect();
        c.cmp("bias_act_fwd, fused bf16 copy", &goth, &wanth, 1e-6, 1e-6);
    }
    // ReLU backward
    {
        let g0 = c.randn(n, 1.0);
        let a = c.randn(n, 1.0).into_iter().map(|v| v.max(0.0)).collect::<Vec<_>>();
        let mut dg = c.up(&g0)?;
        let da = c.up(&a)?;
        c.k.relu_bwd(&c.s, &mut dg, &da, None).map_err(kerr("relu_bwd"))?;
        let mut want = g0.clone();
        r::relu_bwd(&mut want, &a);
        let got = c.down(&dg)?;
        c.cmp("relu_bwd", &got, &want, 1e-6, 0.0);
    }
    // GELU forward and backward
    {
        let y0 = c.randn(n, 2.0);
        let b = c.randn(cols, 0.5);
        let g0 = c.randn(n, 1.0);
        let (mut dy, db, mut dpre) = (c.up(&y0)?, c.up(&b)?, c.s.alloc_zeros::<f32>(n).map_err(derr("alloc"))?);
        c.k.bias_gelu_fwd(&c.s, &mut dy, &db, &mut dpre, rows, cols).map_err(kerr("bias_gelu_fwd"))?;
        let mut dg = c.up(&g0)?;
        c.k.gelu_bwd(&c.s, &mut dg, &dpre).map_err(kerr("gelu_bwd"))?;
        let (mut want, mut pre) = (y0.clone(), vec![0.0; n]);
        r::bias_gelu_fwd(&mut want, &b, &mut pre, cols);
        let mut wantg = g0.clone();
        r::gelu_bwd(&mut wantg, &pre);
        let (got, gotg) = (c.down(&dy)?, c.down(&dg)?);
        // fp32 tanhf near t = -1 cancels in 1 + t: the floor keeps the far-negative tail (values
        // ~1e-6 whose absolute error is ~1e-7) from dominating.
        c.cmp("bias_gelu_fwd", &got, &want, 1e-2, 1e-4);
        c.cmp("gelu_bwd", &gotg, &wantg, 1e-2, 1e-4);
    }
    // bias gradient (column sums; fp32 against f64)
    {
        let dy = c.randn(n, 1.0);
        let gb0 = c.randn(cols, 1.0);
        let (ddy, mut dgb) = (c.up(&dy)?, c.up(&gb0)?);
        c.k.bias_grad(&c.s, &ddy, &mut dgb, rows, cols, 0.5).map_err(kerr("bias_grad"))?;
        let mut want = gb0.clone();
        r::bias_grad(&dy, &mut want, cols, 0.5);
        let got = c.down(&dgb)?;
        c.cmp("bias_grad (beta 0.5)", &got, &want, (rows as f32).sqrt(), 3e-5);
    }
    // softmax cross-entropy and the loss sum
    {
        let (b, kc) = (1031, 10);
        let z = c.randn(b * kc, 3.0);
        let labels: Vec<u32> = (0..b).map(|_| c.rng.below(kc as u64) as u32).collect();
        let (dz_, dl) = (c.up(&z)?, c.up(&labels)?);
        let mut ddz = c.s.alloc_zeros::<f32>(b * kc).map_err(derr("alloc"))?;
        let mut dloss = c.s.alloc_zeros::<f32>(b).map_err(derr("alloc"))?;
        let mut dsum = c.s.alloc_zeros::<f32>(1).map_err(derr("alloc"))?;
        let scale = 1.0 / b as f32;
        c.k.softmax_xent(&c.s, &dz_, &dl, &mut ddz, &mut dloss, b, kc, scale).map_err(kerr("softmax_xent"))?;
        c.k.sum_scaled(&c.s, &dloss, &mut dsum, scale).map_err(kerr("sum_scaled"))?;
        let (mut wdz, mut wl) = (vec![0.0; b * kc], vec![0.0; b]);
        r::softmax_xent(&z, &labels, &mut wdz, &mut wl, kc, scale);
        let wsum = (wl.iter().map(|&v| v as f64).sum::<f64>() * scale as f64) as f32;
        let (gdz, gl, gs) = (c.down(&ddz)?, c.down(&dloss)?, c.down(&dsum)?);
        c.cmp("softmax_xent loss", &gl, &wl, 1e-2, 1e-4);
        // p - 1 cancels for confident rows: measured against 1% of the largest entry (scale).
        c.cmp("softmax_xent gradient", &gdz, &wdz, 1e-2 * scale, 1e-4);
        c.cmp("sum_scaled (mean loss)", &gs, &[wsum], 1e-6, 1e-5);
    }
    // fused optimizer updates
    {
        let n = 1_000_003;
        let (p0, v0, g) = (c.randn(n, 1.0), c.randn(n, 0.1), c.randn(n, 0.1));
        let (mut dp, mut dv, dg) = (c.up(&p0)?, c.up(&v0)?, c.up(&g)?);
        let mut dh = c.s.alloc_zeros::<u16>(n).map_err(derr("alloc"))?;
        c.k.sgd_momentum(&c.s, &mut dp, &mut dv, &dg, Some(&mut dh), 0.05, 0.9, 1e-4, 0.5)
            .map_err(kerr("sgd_momentum"))?;
        let (mut wp, mut wv) = (p0.clone(), v0.clone());
        r::sgd_momentum(&mut wp, &mut wv, &g, 0.05, 0.9, 1e-4, 0.5);
        let (gp, gv) = (c.down(&dp)?, c.down(&dv)?);
        let gh: Vec<f32> = c.down(&dh)?.into_iter().map(r::bf16_to_f32).collect();
        let wh: Vec<f32> = gp.iter().map(|&v| r::bf16_to_f32(r::f32_to_bf16(v))).collect();
        c.cmp("sgd_momentum parameters", &gp, &wp, 1e-3, 1e-5);
        c.cmp("sgd_momentum velocity", &gv, &wv, 1e-2, 1e-5);
        c.cmp("sgd_momentum bf16 copy (exact rounding)", &gh, &wh, 1e-6, 0.0);

        let (m0, s0) = (c.randn(n, 0.01), c.randn(n, 0.01).into_iter().map(|v| v * v).collect::<Vec<_>>());
        let (mut dp, mut dm, mut ds) = (c.up(&p0)?, c.up(&m0)?, c.up(&s0)?);
        let h = r::AdamStep::at(7, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 0.5);
        c.k.adam(&c.s, &mut dp, &mut dm, &mut ds, &dg, None, h).map_err(kerr("adam"))?;
        let (mut wp, mut wm, mut ws) = (p0.clone(), m0.clone(), s0.clone());
        r::adam(&mut wp, &mut wm, &mut ws, &g, h);
        let (gp, gm, gs) = (c.down(&dp)?, c.down(&dm)?, c.down(&ds)?);
        let exact = r::adam_f64(&p0, &m0, &s0, &g, h);
        c.cmp_to_exact("adam parameters (vs f64; bound: 4x the f32 reference's error)", &gp, &wp, &exact, 1e-3, 4.0);
        c.cmp("adam first moment", &gm, &wm, 1e-3, 1e-5);
        c.cmp("adam second moment", &gs, &ws, 1e-6, 1e-5);
    }
    // casts
    {
        let mut x = c.randn(n, 10.0);
        x[0] = f32::INFINITY;
        x[1] = -0.0;
        x[2] = 1.0 + 1.0 / 256.0; // a tie
        let dx = c.up(&x)?;
        let mut dh = c.s.alloc_zeros::<u16>(n).map_err(derr("alloc"))?;
        c.k.f32_to_bf16(&c.s, &dx, &mut dh).map_err(kerr("f32_to_bf16"))?;
        let mut back = c.s.alloc_zeros::<f32>(n).map_err(derr("alloc"))?;
        c.k.bf16_to_f32(&c.s, &dh, &mut back).map_err(kerr("bf16_to_f32"))?;
        let gh = c.down(&dh)?;
        let wh: Vec<u16> = x.iter().map(|&v| r::f32_to_bf16(v)).collect();
        let mism = gh.iter().zip(&wh).filter(|(a, b)| a != b).count();
        let _ = writeln!(
            c.md,
            "| f32_to_bf16 (bit-exact) | {n} | {mism} mismatches | 0 | {} |",
            if mism == 0 { "pass" } else { "**FAIL**" }
        );
        if mism != 0 {
            c.failures.push(format!("f32_to_bf16: {mism} of {n} values rounded differently from the reference"));
        }
        let gb = c.down(&back)?;
        let wb: Vec<f32> = wh.iter().map(|&h| r::bf16_to_f32(h)).collect();
        let (gbf, wbf): (Vec<f32>, Vec<f32>) =
            gb.iter().zip(&wb).filter(|(_, w)| w.is_finite()).map(|(a, b)| (*a, *b)).unzip();
        c.cmp("bf16_to_f32 (exact)", &gbf, &wbf, 1e-30, 0.0);
    }
    // GEMMs (cuBLAS), fp32 and bf16 inputs, against f64 references
    {
        let (rows, din, dout) = (129, 257, 65);
        let x = c.randn(rows * din, 1.0);
        let w = c.randn(dout * din, 0.1);
        let dy = c.randn(rows * dout, 1.0);
        let (dx_, dw, ddy) = (c.up(&x)?, c.up(&w)?, c.up(&dy)?);
        let mut out = c.s.alloc_zeros::<f32>(rows * dout).map_err(derr("alloc"))?;
        let mut gw = c.s.alloc_zeros::<f32>(dout * din).map_err(derr("alloc"))?;
        let mut gx = c.s.alloc_zeros::<f32>(rows * din).map_err(derr("alloc"))?;
        c.blas.linear_fwd(&dx_, &dw, &mut out, rows, din, dout).map_err(kerr("gemm"))?;
        c.blas.linear_bwd_weight(&dx_, &ddy, &mut gw, rows, din, dout, 0.0).map_err(kerr("gemm"))?;
        c.blas.linear_bwd_input(&ddy, &dw, &mut gx, rows, din, dout).map_err(kerr("gemm"))?;
        let (wo, wgw, wgx) = (
            r::linear_fwd(&x, &w, din, dout),
            r::linear_bwd_weight(&x, &dy, din, dout),
            r::linear_bwd_input(&dy, &w, din, dout),
        );
        let (go, ggw, ggx) = (c.down(&out)?, c.down(&gw)?, c.down(&gx)?);
        c.cmp("cuBLAS linear forward, fp32", &go, &wo, 1.0, 2e-5);
        c.cmp("cuBLAS weight gradient, fp32", &ggw, &wgw, 1.0, 2e-5);
        c.cmp("cuBLAS input gradient, fp32", &ggx, &wgx, 1.0, 2e-5);

        let q = |v: &[f32]| v.iter().map(|&a| r::f32_to_bf16(a)).collect::<Vec<u16>>();
        let dq = |v: &[u16]| v.iter().map(|&a| r::bf16_to_f32(a)).collect::<Vec<f32>>();
        let (xh, wh, dyh) = (q(&x), q(&w), q(&dy));
        let (dxh, dwh, ddyh) = (c.up(&xh)?, c.up(&wh)?, c.up(&dyh)?);
        c.blas.linear_fwd(&dxh, &dwh, &mut out, rows, din, dout).map_err(kerr("gemm bf16"))?;
        c.blas.linear_bwd_weight(&dxh, &ddyh, &mut gw, rows, din, dout, 0.0).map_err(kerr("gemm bf16"))?;
        c.blas.linear_bwd_input(&ddyh, &dwh, &mut gx, rows, din, dout).map_err(kerr("gemm bf16"))?;
        let (xq, wq, dyq) = (dq(&xh), dq(&wh), dq(&dyh));
        let (wo, wgw, wgx) = (
            r::linear_fwd(&xq, &wq, din, dout),
            r::linear_bwd_weight(&xq, &dyq, din, dout),
            r::linear_bwd_input(&dyq, &wq, din, dout),
        );
        let (go, ggw, ggx) = (c.down(&out)?, c.down(&gw)?, c.down(&gx)?);
        // Inputs rounded alike: only fp32 accumulation differs.
        // (tensor-core accumulation may truncate rather than round: a looser fp32 bound)
        c.cmp("cuBLAS linear forward, bf16 in / fp32 acc", &go, &wo, 1.0, 1e-4);
        c.cmp("cuBLAS weight gradient, bf16 in / fp32 acc", &ggw, &wgw, 1.0, 1e-4);
        c.cmp("cuBLAS input gradient, bf16 in / fp32 acc", &ggx, &wgx, 1.0, 1e-4);
        // Against unrounded fp32 inputs: bf16's 8-bit mantissa shows (2^-8 per input).
        let wo32 = r::linear_fwd(&x, &w, din, dout);
        c.cmp("cuBLAS linear forward, bf16 vs fp32 inputs", &go, &wo32, 1.0, 2e-2);
    }
    Ok(())
}

/// The train example's data, in miniature: Gaussian blobs from a seeded generator.
fn blobs(rng: &mut SplitMix, n: usize, dim: usize, classes: usize) -> (Vec<f32>, Vec<u32>) {
    let centres: Vec<f32> = (0..classes * dim).map(|_| rng.normal() * 0.6).collect();
    let (mut x, mut y) = (Vec::with_capacity(n * dim), Vec::with_capacity(n));
    for _ in 0..n {
        let cl = rng.below(classes as u64) as usize;
        y.push(cl as u32);
        x.extend((0..dim).map(|d| centres[cl * dim + d] + rng.normal()));
    }
    (x, y)
}

fn training_vs_cpu(c: &mut Ctx, mut group: Option<&mut NcclGroup>) -> Result<(), GpuError> {
    let _ = writeln!(c.md, "\n## Training on the GPU against the CPU model\n");
    let (dim, hidden, classes, batch, steps) = (32, 256, 8, 64, 300);
    let (lr, momentum) = (0.05f32, 0.9f32);
    let seed = c.rng.next_u64();
    let (x, y) = blobs(&mut SplitMix(seed), 8192, dim, classes);
    let model = Mlp::new(&[dim, hidden, hidden, classes], seed);

    // Gradients of one batch, fp32, against the CPU model's backward pass.
    {
        let mut g = GpuMlp::new(
            &c.ctx,
            &model,
            &[],
            GpuMlpConfig { precision: Precision::F32, optimizer: Optimizer::Sgd { lr, momentum, weight_decay: 0.0 } },
        )?;
        let lg = g.forward_backward(&x[..batch * dim], &y[..batch], None)?;
        let gg = g.grads_to_host()?;
        let mut cg = FlatGrads::new(&model.param_sizes());
        let lc = model.loss_and_backward(&x[..batch * dim], &y[..batch], &mut cg);
        let _ = writeln!(c.md, "| quantity | elements | max rel. error | bound | |\n|---|---|---|---|---|");
        c.cmp("first-batch loss", &[lg], &[lc], 1e-3, 1e-5);
        c.cmp("first-batch gradients (all parameters)", &gg, &cg.data, 1e-4, 1e-3);
    }

    let mut curves: Vec<(String, Vec<f32>)> = Vec::new();
    // CPU reference run (the train example's loop, one rank).
    {
        let mut m = model.clone();
        let mut opt = crate::model::Sgd::new(m.params.len(), lr, momentum, 0.0);
        let mut grads = FlatGrads::new(&m.param_sizes());
        let mut losses = Vec::with_capacity(steps);
        for st in 0..steps {
            let b = st % (y.len() / batch);
            grads.zero();
            losses.push(m.loss_and_backward(
                &x[b * batch * dim..(b + 1) * batch * dim],
                &y[b * batch..(b + 1) * batch],
                &mut grads,
            ));
            for p in 0..m.param_sizes().len() {
                let range = m.param_range(p);
                opt.step_slice(&mut m.params, range, grads.grad(p));
            }
        }
        curves.push(("cpu fp32".into(), losses));
    }
    // GPU runs through a one-rank NCCL group when NCCL is there (the data-parallel path,
    // overlap included), else without one.
    for precision in [Precision::F32, Precision::Bf16] {
        let mut g = GpuMlp::new(
            &c.ctx,
            &model,
            &[],
            GpuMlpConfig { precision, optimizer: Optimizer::Sgd { lr, momentum, weight_decay: 0.0 } },
        )?;
        let mut losses = Vec::with_capacity(steps);
        let t = Instant::now();
        for st in 0..steps {
            let b = st % (y.len() / batch);
            losses.push(g.step(
                &x[b * batch * dim..(b + 1) * batch * dim],
                &y[b * batch..(b + 1) * batch],
                group.as_deref_mut(),
            )?);
        }
        g.synchronize()?;
        let secs = t.elapsed().as_secs_f64();
        let via = if group.is_some() { "1-rank NCCL group" } else { "no NCCL" };
        curves.push((
            format!(
                "gpu {} ({via}, {:.0} steps/s)",
                if precision == Precision::F32 { "fp32" } else { "bf16" },
                steps as f64 / secs
            ),
            losses,
        ));
    }
    let avg = |v: &[f32], a: usize, b: usize| v[a..b].iter().sum::<f32>() / (b - a) as f32;
    let _ = writeln!(
        c.md,
        "\n| run | loss, steps 0-9 | 50-59 | 140-149 | {}-{} |\n|---|---|---|---|---|",
        steps - 10,
        steps - 1
    );
    for (name, l) in &curves {
        let _ = writeln!(
            c.md,
            "| {name} | {:.4} | {:.4} | {:.4} | {:.4} |",
            avg(l, 0, 10),
            avg(l, 50, 60),
            avg(l, 140, 150),
            avg(l, steps - 10, steps)
        );
    }
    let cpu = &curves[0].1;
    let (f32c, bf16c) = (&curves[1].1, &curves[2].1);
    // fp32: the same maths in another summation order; over 50 steps the curves must agree
    // closely, and at the end within a few percent (chaotic divergence is slow at this lr).
    let early = (0..50).map(|i| ((f32c[i] - cpu[i]) / cpu[i]).abs()).fold(0.0f32, f32::max);
    let late = ((avg(f32c, steps - 10, steps) - avg(cpu, steps - 10, steps)) / avg(cpu, 0, 10)).abs();
    let _ = writeln!(c.md, "\nfp32: max relative loss gap over the first 50 steps {early:.2e} (bound 1e-3); final-window gap {late:.2e} of the initial loss (bound 2e-2).");
    if early > 1e-3 {
        c.fail(format!("GPU fp32 loss curve leaves the CPU's within 50 steps: {early:.3e}"));
    }
    if late > 2e-2 {
        c.fail(format!("GPU fp32 final loss differs from the CPU's by {late:.3e} of the initial loss"));
    }
    let drop_bf16 = avg(bf16c, steps - 10, steps) / avg(bf16c, 0, 10);
    let drop_cpu = avg(cpu, steps - 10, steps) / avg(cpu, 0, 10);
    let _ = writeln!(
        c.md,
        "bf16: final/initial loss {drop_bf16:.3} against the CPU's {drop_cpu:.3} (bound: within 0.05 absolute)."
    );
    if (drop_bf16 - drop_cpu).abs() > 0.05 {
        c.fail(format!(
            "bf16 mixed precision converges differently: final/initial {drop_bf16:.3} vs CPU {drop_cpu:.3}"
        ));
    }
    if let Some(g) = group {
        g.wait()?;
    }
    Ok(())
}

/// A one-rank group bootstrapped through a real TCPStore (served in this process).
fn single_rank_group(ctx: &Arc<CudaContext>) -> Result<(NcclGroup, StoreKeepAlive), GpuError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| GpuError::Invalid { op: "store", reason: format!("tokio runtime: {e}") })?;
    let handle = rt
        .block_on(crate::store::StoreServer::start("127.0.0.1:0".parse().expect("literal address")))
        .map_err(|e| GpuError::Invalid { op: "store", reason: format!("starting a TCPStore: {e}") })?;
    let addr = handle.local_addr().to_string();
    let mut client = crate::store::StoreClient::connect(&addr, Duration::from_secs(10))
        .map_err(|source| GpuError::Store { step: "connect", key: String::new(), source: Box::new(source) })?;
    let prefix = super::group::key_prefix("gpu-check", 0);
    let group =
        NcclGroup::init(&mut client, &prefix, 0, 1, ctx, NcclGroupOptions { timeout: Duration::from_secs(60) })?;
    Ok((group, StoreKeepAlive { _rt: rt, _handle: handle }))
}

/// Keeps the in-process store (and its runtime) alive as long as the group that used it.
pub struct StoreKeepAlive {
    _rt: tokio::runtime::Runtime,
    _handle: crate::store::StoreHandle,
}

fn nccl_single_rank(c: &mut Ctx, group: &mut NcclGroup) -> Result<(), GpuError> {
    let _ = writeln!(c.md, "\n## NCCL all-reduce, 1 rank (all one GPU allows)\n");
    let _ = writeln!(c.md, "| op | elements | max rel. error | bound | |\n|---|---|---|---|---|");
    let n = 1 << 20;
    let v = c.randn(n, 1.0);
    for op in [RedOp::Sum, RedOp::Avg, RedOp::Max] {
        let mut d = group.stream().clone_htod(&v).map_err(derr("upload"))?;
        group.all_reduce(&mut d, op)?;
        let got = c.down(&d)?;
        c.cmp(&format!("all_reduce {op:?} (identity with 1 rank)"), &got, &v, 1e-6, 0.0);
    }
    let mut host = [3i64, -7, 11];
    group.all_reduce_host(&mut host, RedOp::Sum)?;
    if host != [3, -7, 11] {
        c.fail(format!("all_reduce_host of i64 changed the values: {host:?}"));
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench_nccl(c: &mut Ctx, group: &mut NcclGroup) -> Result<(), GpuError> {
    let _ = writeln!(c.md, "\n## NCCL through rlaunch's group against raw ncclAllReduce (1 rank, in place, fp32)\n");
    let _ = writeln!(
        c.md,
        "Each sample enqueues `iters` all-reduces back to back and waits once: rlaunch's \
         `NcclGroup::all_reduce_async` + `wait` (cudarc's per-buffer event tracking, deadline \
         polling) against `ncclAllReduce` on the same stream + `cuStreamSynchronize`. Median of 7 \
         alternating samples. With one rank an in-place `ncclAllReduce` moves no data (the raw \
         column is NCCL's bare call cost, the same at every size), so this measures the fixed \
         cost rlaunch adds per call (`added`: cudarc's cross-stream event waits and record, which \
         let each gradient's reduction overlap the rest of the backward pass), not a share of a \
         real reduction: a percentage here is against a no-op.\n"
    );
    let _ = writeln!(
        c.md,
        "| size | iters | rlaunch µs/op | raw µs/op | added µs/op | overhead |\n|---|---|---|---|---|---|"
    );
    for bytes in [4usize << 10, 256 << 10, 4 << 20, 64 << 20, 256 << 20] {
        let n = bytes / 4;
        let iters = if bytes <= 4 << 20 { 200 } else { 20 };
        let mut buf = group.stream().alloc_zeros::<f32>(n).map_err(derr("alloc"))?;
        let stream = group.stream().clone();
        let (mut ours, mut raw) = (Vec::new(), Vec::new());
        for sample in 0..8 {
            let t = Instant::now();
            for _ in 0..iters {
                group.all_reduce_async(&mut buf, RedOp::Sum)?;
            }
            group.wait()?;
            let a = t.elapsed().as_secs_f64();
            let t = Instant::now();
            {
                let (ptr, _rec) = buf.device_ptr_mut(&stream);
                for _ in 0..iters {
                    // SAFETY: ptr addresses n floats of a live buffer on this GPU; nothing else
                    // uses it until the synchronize below.
                    unsafe { group.comm().all_reduce_raw::<f32>(ptr, ptr, n, RedOp::Sum, stream.cu_stream()) }
                        .map_err(kerr("raw ncclAllReduce"))?;
                }
                stream.synchronize().map_err(derr("synchronize"))?;
            }
            let b = t.elapsed().as_secs_f64();
            if sample > 0 {
                ours.push(a / iters as f64);
                raw.push(b / iters as f64);
            }
        }
        let (o, rw) = (median(ours), median(raw));
        let _ = writeln!(
            c.md,
            "| {} | {iters} | {:.2} | {:.2} | {:+.2} | {:+.1}% |",
            human(bytes),
            o * 1e6,
            rw * 1e6,
            (o - rw) * 1e6,
            (o - rw) / rw * 100.0
        );
    }
    Ok(())
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// GPU time of `f` (enqueued `iters` times on `s`), by CUDA events, in seconds per call.
fn time_gpu(s: &Arc<CudaStream>, iters: usize, mut f: impl FnMut() -> Result<(), GpuError>) -> Result<f64, GpuError> {
    f()?; // warm-up
    let start = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(derr("event"))?;
    for _ in 0..iters {
        f()?;
    }
    let end = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(derr("event"))?;
    end.synchronize().map_err(derr("event synchronize"))?;
    let ms = start.elapsed_ms(&end).map_err(derr("event elapsed"))?;
    Ok(ms as f64 / 1e3 / iters as f64)
}

fn bench_update(c: &mut Ctx) -> Result<(), GpuError> {
    let n: usize = 64 << 20; // 64 Mi floats: 256 MiB per array
    let iters = 20;
    let s = c.s.clone();
    let a = s.alloc_zeros::<f32>(n).map_err(derr("alloc"))?;
    let mut b = s.alloc_zeros::<f32>(n).map_err(derr("alloc"))?;
    let copy = time_gpu(&s, iters, || s.memcpy_dtod(&a, &mut b).map_err(derr("memcpy_dtod")))?;
    let copy_bw = (2 * 4 * n) as f64 / copy / 1e9; // read + write
    let p0 = c.randn(n, 1.0);
    let mut p = c.up(&p0)?;
    let mut v = s.alloc_zeros::<f32>(n).map_err(derr("alloc"))?;
    let g = s.alloc_zeros::<f32>(n).map_err(derr("alloc"))?;
    let k = c.k.clone();
    let sgd =
        time_gpu(&s, iters, || k.sgd_momentum(&s, &mut p, &mut v, &g, None, 0.01, 0.9, 0.0, 1.0).map_err(kerr("sgd")))?;
    let sgd_bw = (5 * 4 * n) as f64 / sgd / 1e9; // read p, v, g; write p, v
    let mut h = s.alloc_zeros::<u16>(n).map_err(derr("alloc"))?;
    let sgdh = time_gpu(&s, iters, || {
        k.sgd_momentum(&s, &mut p, &mut v, &g, Some(&mut h), 0.01, 0.9, 0.0, 1.0).map_err(kerr("sgd"))
    })?;
    let sgdh_bw = (5 * 4 * n + 2 * n) as f64 / sgdh / 1e9;
    let mut m2 = s.alloc_zeros::<f32>(n).map_err(derr("alloc"))?;
    let hyper = r::AdamStep::at(1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0);
    let adam = time_gpu(&s, iters, || k.adam(&s, &mut p, &mut v, &mut m2, &g, None, hyper).map_err(kerr("adam")))?;
    let adam_bw = (7 * 4 * n) as f64 / adam / 1e9; // read p, m, v, g; write p, m, v
    let _ = writeln!(c.md, "\n## Fused update bandwidth against device-to-device copy (same run, {} floats)\n", n);
    let _ = writeln!(c.md, "| operation | bytes moved per call | time | bandwidth | of copy |\n|---|---|---|---|---|");
    for (name, bytes, t, bw) in [
        ("cuMemcpyDtoD (read + write)", 8 * n, copy, copy_bw),
        ("sgd_momentum (fp32)", 20 * n, sgd, sgd_bw),
        ("sgd_momentum + bf16 copy", 22 * n, sgdh, sgdh_bw),
        ("adam (fp32)", 28 * n, adam, adam_bw),
    ] {
        let _ = writeln!(
            c.md,
            "| {name} | {} MiB | {:.3} ms | {bw:.0} GB/s | {:.0}% |",
            bytes >> 20,
            t * 1e3,
            bw / copy_bw * 100.0
        );
    }
    Ok(())
}
