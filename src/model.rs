//! A small multi-layer perceptron classifier with hand-written forward and backward passes,
//! and SGD with momentum: enough of a real model to train data-parallel without a framework.
//!
//! Parameters live in one flat `Vec<f32>`: for each layer its weight (`out x in`, row-major)
//! then its bias. Parameter `2l` is layer `l`'s weight, `2l + 1` its bias. The backward pass
//! hands gradients to a [`GradSink`] last layer first, and says when each is complete, so a
//! data-parallel wrapper can start reducing them while earlier layers are still computed.

use std::ops::Range;

/// Receives gradients during the backward pass.
pub trait GradSink {
    /// The gradient buffer of parameter `param`; the backward pass adds into it.
    fn grad_mut(&mut self, param: usize) -> &mut [f32];
    /// Parameter `param`'s gradient is complete for this backward pass.
    fn ready(&mut self, param: usize);
}

/// Gradients in one flat buffer laid out like the parameters (single-process training).
#[derive(Debug, Clone)]
pub struct FlatGrads {
    pub data: Vec<f32>,
    ranges: Vec<Range<usize>>,
}

impl FlatGrads {
    pub fn new(param_sizes: &[usize]) -> Self {
        let mut ranges = Vec::new();
        let mut at = 0;
        for &s in param_sizes {
            ranges.push(at..at + s);
            at += s;
        }
        Self { data: vec![0.0; at], ranges }
    }
    pub fn grad(&self, param: usize) -> &[f32] {
        &self.data[self.ranges[param].clone()]
    }
    pub fn zero(&mut self) {
        self.data.iter_mut().for_each(|g| *g = 0.0);
    }
}

impl GradSink for FlatGrads {
    fn grad_mut(&mut self, param: usize) -> &mut [f32] {
        &mut self.data[self.ranges[param].clone()]
    }
    fn ready(&mut self, _param: usize) {}
}

/// splitmix64, the deterministic generator used for initialisation and synthetic data.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.unit() as f64).max(1e-12);
        let u2 = self.unit() as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Fully connected layers with ReLU between them and softmax cross-entropy on top.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// Widths: input, hidden..., classes.
    pub sizes: Vec<usize>,
    pub params: Vec<f32>,
    ranges: Vec<Range<usize>>,
}

impl Mlp {
    /// A model with layer widths `sizes`, weights uniform in ±sqrt(6 / fan_in) (He), zero biases.
    pub fn new(sizes: &[usize], seed: u64) -> Self {
        assert!(sizes.len() >= 2, "an MLP needs input and output widths");
        let mut ranges = Vec::new();
        let mut at = 0;
        for l in 0..sizes.len() - 1 {
            ranges.push(at..at + sizes[l] * sizes[l + 1]);
            at += sizes[l] * sizes[l + 1];
            ranges.push(at..at + sizes[l + 1]);
            at += sizes[l + 1];
        }
        let mut rng = SplitMix(seed);
        let mut params = vec![0.0; at];
        for l in 0..sizes.len() - 1 {
            let bound = (6.0 / sizes[l] as f32).sqrt();
            for w in &mut params[ranges[2 * l].clone()] {
                *w = (rng.unit() * 2.0 - 1.0) * bound;
            }
        }
        Self { sizes: sizes.to_vec(), params, ranges }
    }

    pub fn num_layers(&self) -> usize {
        self.sizes.len() - 1
    }
    pub fn param_sizes(&self) -> Vec<usize> {
        self.ranges.iter().map(|r| r.len()).collect()
    }
    pub fn param_range(&self, param: usize) -> Range<usize> {
        self.ranges[param].clone()
    }

    /// Activations of every layer for a batch (`x`: batch x input, row-major).
    fn forward_all(&self, x: &[f32], batch: usize) -> Vec<Vec<f32>> {
        let mut acts = vec![x.to_vec()];
        for l in 0..self.num_layers() {
            let (din, dout) = (self.sizes[l], self.sizes[l + 1]);
            let w = &self.params[self.ranges[2 * l].clone()];
            let b = &self.params[self.ranges[2 * l + 1].clone()];
            let inp = &acts[l];
            let mut out = vec![0.0f32; batch * dout];
            for s in 0..batch {
                let xi = &inp[s * din..(s + 1) * din];
                for o in 0..dout {
                    out[s * dout + o] = dot(xi, &w[o * din..(o + 1) * din]) + b[o];
                }
            }
            if l + 1 < self.num_layers() {
                out.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            acts.push(out);
        }
        acts
    }

    /// Class scores for a batch.
    pub fn logits(&self, x: &[f32], batch: usize) -> Vec<f32> {
        self.forward_all(x, batch).pop().expect("at least one layer")
    }

    /// Mean cross-entropy of the batch; adds its gradient into `sink` (last layer first,
    /// weight then bias, each followed by `ready`).
    pub fn loss_and_backward(&self, x: &[f32], labels: &[u32], sink: &mut dyn GradSink) -> f32 {
        let batch = labels.len();
        let acts = self.forward_all(x, batch);
        let k = *self.sizes.last().expect("sizes");
        let logits = &acts[self.num_layers()];
        let mut loss = 0.0f64;
        // d loss / d logits = (softmax - onehot) / batch
        let mut dy = vec![0.0f32; batch * k];
        for s in 0..batch {
            let row = &logits[s * k..(s + 1) * k];
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = row.iter().map(|v| (v - m).exp()).sum();
            let y = labels[s] as usize;
            loss += (z.ln() + m - row[y]) as f64;
            for c in 0..k {
                let p = (row[c] - m).exp() / z;
                dy[s * k + c] = (p - if c == y { 1.0 } else { 0.0 }) / batch as f32;
            }
        }
        for l in (0..self.num_layers()).rev() {
            let (din, dout) = (self.sizes[l], self.sizes[l + 1]);
            let inp = &acts[l];
            {
                let gw = sink.grad_mut(2 * l);
                // Row o of the weight gradient stays in L1 while the batch streams past it;
                // inactive units (ReLU cut, zero upstream gradient) are skipped.
                for o in 0..dout {
                    let row = &mut gw[o * din..(o + 1) * din];
                    for s in 0..batch {
                        let g = dy[s * dout + o];
                        if g != 0.0 {
                            axpy(row, g, &inp[s * din..(s + 1) * din]);
                        }
                    }
                }
            }
            sink.ready(2 * l);
            {
                let gb = sink.grad_mut(2 * l + 1);
                for s in 0..batch {
                    for o in 0..dout {
                        gb[o] += dy[s * dout + o];
                    }
                }
            }
            sink.ready(2 * l + 1);
            if l > 0 {
                let w = &self.params[self.ranges[2 * l].clone()];
                let mut dx = vec![0.0f32; batch * din];
                for s in 0..batch {
                    let d = &mut dx[s * din..(s + 1) * din];
                    for o in 0..dout {
                        let g = dy[s * dout + o];
                        if g != 0.0 {
                            axpy(d, g, &w[o * din..(o + 1) * din]);
                        }
                    }
                    // ReLU: the input to layer l is relu(pre-activation); zero where it was cut.
                    for (g, a) in d.iter_mut().zip(&inp[s * din..(s + 1) * din]) {
                        if *a <= 0.0 {
                            *g = 0.0;
                        }
                    }
                }
                dy = dx;
            }
        }
        (loss / batch as f64) as f32
    }
}

/// Dot product in a fixed summation order (AVX2+FMA when the CPU has it, else eight
/// independent accumulators so it still vectorises).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { simd::dot(a, b) };
    }
    let mut acc = [0.0f32; 8];
    let n8 = a.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        for j in 0..8 {
            acc[j] += a[i + j] * b[i + j];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `y += a * x`.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { simd::axpy(y, a, x) };
    }
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2 and FMA; `a` and `b` have equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i + 8k + 8 <= n, so both unaligned loads are in bounds.
                unsafe {
                    *acc =
                        _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8 * k)), _mm256_loadu_ps(pb.add(i + 8 * k)), *acc);
                }
            }
            i += 32;
        }
        while i + 8 <= n {
            // SAFETY: i + 8 <= n.
            unsafe { acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]) };
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        // SAFETY: storing 8 floats into an 8-float array.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        let mut s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `y` and `x` have equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        let va = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n for both slices.
            unsafe {
                _mm256_storeu_ps(py.add(i), _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i))))
            };
            i += 8;
        }
        while i < n {
            y[i] += a * x[i];
            i += 1;
        }
    }
}

/// SGD with momentum and weight decay, torch's formulation:
/// `v = momentum * v + (g + wd * p); p -= lr * v`.
#[derive(Debug, Clone)]
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    /// Momentum buffer, laid out like the parameters.
    pub velocity: Vec<f32>,
}

impl Sgd {
    pub fn new(num_params: usize, lr: f32, momentum: f32, weight_decay: f32) -> Self {
        Self { lr, momentum, weight_decay, velocity: vec![0.0; num_params] }
    }

    /// Updates `params[range]` with gradient `grad` (same length).
    pub fn step_slice(&mut self, params: &mut [f32], range: Range<usize>, grad: &[f32]) {
        let p = &mut params[range.clone()];
        let v = &mut self.velocity[range];
        for ((p, v), g) in p.iter_mut().zip(v.iter_mut()).zip(grad) {
            let d = g + self.weight_decay * *p;
            *v = self.momentum * *v + d;
            *p -= self.lr * *v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_matches_finite_differences() {
        let mut m = Mlp::new(&[5, 7, 3], 3);
        let mut rng = SplitMix(9);
        m.params.iter_mut().skip(35).for_each(|b| *b = rng.normal() * 0.1);
        let x: Vec<f32> = (0..4 * 5).map(|_| rng.normal()).collect();
        let y = [0u32, 2, 1, 2];
        let mut g = FlatGrads::new(&m.param_sizes());
        m.loss_and_backward(&x, &y, &mut g);
        let mut sink = FlatGrads::new(&m.param_sizes());
        for i in (0..m.params.len()).step_by(3) {
            let eps = 2e-3;
            let mut a = m.clone();
            a.params[i] += eps;
            let lp = a.loss_and_backward(&x, &y, &mut sink);
            a.params[i] -= 2.0 * eps;
            let lm = a.loss_and_backward(&x, &y, &mut sink);
            let num = (lp - lm) / (2.0 * eps);
            assert!(
                (num - g.data[i]).abs() < 1e-3 + 0.02 * g.data[i].abs(),
                "param {i}: numeric {num} analytic {}",
                g.data[i]
            );
        }
    }
}
