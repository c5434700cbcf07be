//! CPU versions of every kernel in `cu/`, written for clarity: the GPU checks compare each
//! kernel's output on fresh random inputs against these (and their unit tests pin the maths,
//! e.g. the bf16 rounding, on any machine).

/// fp32 to bf16 (raw bits), round to nearest even; NaN stays NaN.
pub fn f32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if f.is_nan() {
        return ((u >> 16) | 0x0040) as u16;
    }
    let u = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    (u >> 16) as u16
}

/// bf16 (raw bits) to fp32, exact.
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// `y[r, c] = act(y[r, c] + b[c])`, ReLU when `relu`.
pub fn bias_act_fwd(y: &mut [f32], b: &[f32], cols: usize, relu: bool) {
    for (i, v) in y.iter_mut().enumerate() {
        let mut t = *v + b[i % cols];
        if relu && t < 0.0 {
            t = 0.0;
        }
        *v = t;
    }
}

/// `dx[i] = 0` where the ReLU output `a[i] <= 0`.
pub fn relu_bwd(dx: &mut [f32], a: &[f32]) {
    for (g, &x) in dx.iter_mut().zip(a) {
        if x <= 0.0 {
            *g = 0.0;
        }
    }
}

/// GELU (tanh approximation) with bias; keeps the pre-activation in `pre`.
pub fn bias_gelu_fwd(y: &mut [f32], b: &[f32], pre: &mut [f32], cols: usize) {
    for i in 0..y.len() {
        let x = (y[i] + b[i % cols]) as f64;
        pre[i] = x as f32;
        let t = (0.797_884_560_802_865_4 * (x + 0.044715 * x * x * x)).tanh();
        y[i] = (0.5 * x * (1.0 + t)) as f32;
    }
}

pub fn gelu_bwd(dx: &mut [f32], pre: &[f32]) {
    for (g, &x) in dx.iter_mut().zip(pre) {
        let x = x as f64;
        let u = 0.797_884_560_802_865_4 * (x + 0.044715 * x * x * x);
        let t = u.tanh();
        let du = 0.797_884_560_802_865_4 * (1.0 + 3.0 * 0.044715 * x * x);
        *g = (*g as f64 * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)) as f32;
    }
}

/// `gb[c] = beta * gb[c] + sum_r dy[r, c]`.
pub fn bias_grad(dy: &[f32], gb: &mut [f32], cols: usize, beta: f32) {
    let rows = dy.len() / cols;
    for c in 0..cols {
        let acc: f64 = (0..rows).map(|r| dy[r * cols + c] as f64).sum();
        gb[c] = if beta == 0.0 { 0.0 } else { beta * gb[c] } + acc as f32;
    }
}

/// Per-row softmax cross-entropy `loss`, and `dz = (softmax - onehot) * scale`.
pub fn softmax_xent(z: &[f32], labels: &[u32], dz: &mut [f32], loss: &mut [f32], k: usize, scale: f32) {
    for (r, &y) in labels.iter().enumerate() {
        let row = &z[r * k..(r + 1) * k];
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let s: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        loss[r] = (s.ln() + m - row[y as usize] as f64) as f32;
        for c in 0..k {
            let p = (row[c] as f64 - m).exp() / s;
            dz[r * k + c] = ((p - if c == y as usize { 1.0 } else { 0.0 }) * scale as f64) as f32;
        }
    }
}

/// torch's SGD with momentum, with the gradient scaled by `grad_scale` first.
#[allow(clippy::too_many_arguments)]
pub fn sgd_momentum(p: &mut [f32], v: &mut [f32], g: &[f32], lr: f32, momentum: f32, wd: f32, grad_scale: f32) {
    for i in 0..p.len() {
        let d = g[i] * grad_scale + wd * p[i];
        v[i] = momentum * v[i] + d;
        p[i] -= lr * v[i];
    }
}

/// Hyper-parameters of [`adam`] for one step (`bc1 = 1 - beta1^t`, `bc2 = 1 - beta2^t`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub bc1: f32,
    pub bc2: f32,
    pub grad_scale: f32,
}

impl AdamStep {
    /// The hyper-parameters of step `t` (1-based).
    pub fn at(t: u32, lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32, grad_scale: f32) -> Self {
        let t = t.max(1) as i32;
        Self { lr, beta1, beta2, eps, weight_decay, bc1: 1.0 - beta1.powi(t), bc2: 1.0 - beta2.powi(t), grad_scale }
    }
}

/// torch's Adam (L2 weight decay added to the gradient).
pub fn adam(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], h: AdamStep) {
    for i in 0..p.len() {
        let gi = g[i] * h.grad_scale + h.weight_decay * p[i];
        m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
        v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
        p[i] -= h.lr * (m[i] / h.bc1) / ((v[i] / h.bc2).sqrt() + h.eps);
    }
}

/// [`adam`]'s new parameters evaluated in f64 from the same f32 inputs and hyper-parameters:
/// the truth both f32 evaluations (this file's and the GPU's) are measured against. Adam is
/// ill-conditioned where the second moment is tiny (the step is `m / sqrt(v)`), so two correct
/// f32 evaluations that round differently (fused multiply-adds) can differ by more than a few
/// ulps there; the check bounds the GPU's error by the f32 reference's own.
pub fn adam_f64(p: &[f32], m: &[f32], v: &[f32], g: &[f32], h: AdamStep) -> Vec<f64> {
    let d = |x: f32| x as f64;
    (0..p.len())
        .map(|i| {
            let gi = d(g[i]) * d(h.grad_scale) + d(h.weight_decay) * d(p[i]);
            let mi = d(h.beta1) * d(m[i]) + (1.0 - d(h.beta1)) * gi;
            let vi = d(h.beta2) * d(v[i]) + (1.0 - d(h.beta2)) * gi * gi;
            d(p[i]) - d(h.lr) * (mi / d(h.bc1)) / ((vi / d(h.bc2)).sqrt() + d(h.eps))
        })
        .collect()
}

/// `out[s, o] = sum_i x[s, i] * w[o, i]` (row-major; `w` is `dout x din`), the layer's GEMM.
pub fn linear_fwd(x: &[f32], w: &[f32], din: usize, dout: usize) -> Vec<f32> {
    let rows = x.len() / din;
    let mut out = vec![0.0f32; rows * dout];
    for s in 0..rows {
        for o in 0..dout {
            let acc: f64 = (0..din).map(|i| x[s * din + i] as f64 * w[o * din + i] as f64).sum();
            out[s * dout + o] = acc as f32;
        }
    }
    out
}

/// `gw[o, i] = sum_s dy[s, o] * x[s, i]`.
pub fn linear_bwd_weight(x: &[f32], dy: &[f32], din: usize, dout: usize) -> Vec<f32> {
    let rows = x.len() / din;
    let mut gw = vec![0.0f32; dout * din];
    for o in 0..dout {
        for i in 0..din {
            let acc: f64 = (0..rows).map(|s| dy[s * dout + o] as f64 * x[s * din + i] as f64).sum();
            gw[o * din + i] = acc as f32;
        }
    }
    gw
}

/// `dx[s, i] = sum_o dy[s, o] * w[o, i]`.
pub fn linear_bwd_input(dy: &[f32], w: &[f32], din: usize, dout: usize) -> Vec<f32> {
    let rows = dy.len() / dout;
    let mut dx = vec![0.0f32; rows * din];
    for s in 0..rows {
        for i in 0..din {
            let acc: f64 = (0..dout).map(|o| dy[s * dout + o] as f64 * w[o * din + i] as f64).sum();
            dx[s * din + i] = acc as f32;
        }
    }
    dx
}

/// The largest `|got - want| / max(|want|, floor)` over the elements (`floor` keeps
/// near-zero references from inflating the ratio), with the index where it occurs.
pub fn max_rel_err(got: &[f32], want: &[f32], floor: f32) -> (f32, usize) {
    assert_eq!(got.len(), want.len(), "compared buffers differ in length");
    let mut worst = (0.0f32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = if g.is_nan() != w.is_nan() {
            f32::INFINITY
        } else if g.is_nan() {
            0.0
        } else {
            (g - w).abs() / w.abs().max(floor)
        };
        if e > worst.0 {
            worst = (e, i);
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_round_trips_exactly() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3 * 2^-8 is halfway too; the even neighbour is above.
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        for h in [0x0000u16, 0x3f80, 0xbf80, 0x7f7f, 0x0001, 0x4049] {
            assert_eq!(f32_to_bf16(bf16_to_f32(h)), h);
        }
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(f32_to_bf16(f32::INFINITY)), f32::INFINITY);
    }

    #[test]
    fn softmax_xent_gradient_rows_sum_to_zero_and_loss_is_log_k_for_equal_logits() {
        let k = 4;
        let z = vec![0.5f32; 2 * k];
        let (mut dz, mut loss) = (vec![0.0; 2 * k], vec![0.0; 2]);
        softmax_xent(&z, &[1, 3], &mut dz, &mut loss, k, 0.5);
        for l in loss {
            assert!((l - (k as f32).ln()).abs() < 1e-6);
        }
        for r in 0..2 {
            let s: f32 = dz[r * k..(r + 1) * k].iter().sum();
            assert!(s.abs() < 1e-6);
        }
    }

    #[test]
    fn sgd_reference_matches_the_cpu_model_optimizer() {
        let mut p = vec![1.0f32, -2.0, 0.5];
        let mut v = vec![0.1f32, 0.0, -0.3];
        let g = vec![0.2f32, 0.4, -0.1];
        let mut q = p.clone();
        let mut opt = rlaunch_model_sgd(v.clone());
        sgd_momentum(&mut p, &mut v, &g, 0.05, 0.9, 1e-4, 1.0);
        opt(&mut q, &g);
        assert_eq!(p, q);
    }

    /// The CPU model's update rule, restated (this crate cannot depend on `rlaunch`).
    fn rlaunch_model_sgd(mut velocity: Vec<f32>) -> impl FnMut(&mut [f32], &[f32]) {
        move |params, grad| {
            for ((p, v), g) in params.iter_mut().zip(velocity.iter_mut()).zip(grad) {
                let d = g + 1e-4 * *p;
                *v = 0.9 * *v + d;
                *p -= 0.05 * *v;
            }
        }
    }

    #[test]
    fn linear_products_agree_with_each_other() {
        // dx . x-shaped and gw . w-shaped products satisfy <dy, x W^T> = <gw, W> for any W.
        let (rows, din, dout) = (3, 4, 2);
        let x: Vec<f32> = (0..rows * din).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..dout * din).map(|i| (i as f32 * 0.11).cos()).collect();
        let dy: Vec<f32> = (0..rows * dout).map(|i| (i as f32 * 0.7).sin()).collect();
        let y = linear_fwd(&x, &w, din, dout);
        let gw = linear_bwd_weight(&x, &dy, din, dout);
        let dx = linear_bwd_input(&dy, &w, din, dout);
        let a: f32 = dy.iter().zip(&y).map(|(a, b)| a * b).sum();
        let b: f32 = gw.iter().zip(&w).map(|(a, b)| a * b).sum();
        let c: f32 = dx.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!((a - b).abs() < 1e-5 && (a - c).abs() < 1e-5, "{a} {b} {c}");
    }
}
