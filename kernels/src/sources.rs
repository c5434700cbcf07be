//! The CUDA C sources, embedded at build time, and the kernels each one defines.
//!
//! NVRTC is given no include path, so every source is compiled as `common.cuh` followed by
//! its own text ([`Source::full_text`]).

/// Helpers shared by every source (bf16 conversions, the grid-stride loop).
pub const COMMON: &str = include_str!("../cu/common.cuh");

/// One `.cu` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Source {
    /// File name under `kernels/cu/`.
    pub name: &'static str,
    pub text: &'static str,
    /// The `extern "C" __global__` functions it defines.
    pub kernels: &'static [&'static str],
}

impl Source {
    /// What NVRTC compiles: the common helpers, then this file.
    pub fn full_text(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}\"\n{}", self.name, self.text)
    }
}

pub const ACTIVATION: Source = Source {
    name: "activation.cu",
    text: include_str!("../cu/activation.cu"),
    kernels: &["bias_act_fwd", "relu_bwd", "bias_gelu_fwd", "gelu_bwd"],
};
pub const REDUCE: Source =
    Source { name: "reduce.cu", text: include_str!("../cu/reduce.cu"), kernels: &["bias_grad", "sum_scaled"] };
pub const SOFTMAX_XENT: Source =
    Source { name: "softmax_xent.cu", text: include_str!("../cu/softmax_xent.cu"), kernels: &["softmax_xent"] };
pub const OPTIM: Source =
    Source { name: "optim.cu", text: include_str!("../cu/optim.cu"), kernels: &["sgd_momentum", "adam"] };
pub const CAST: Source = Source {
    name: "cast.cu",
    text: include_str!("../cu/cast.cu"),
    kernels: &["f32_to_bf16_kernel", "bf16_to_f32_kernel", "axpy_f32"],
};

/// Every source, in a fixed order.
pub const ALL: &[Source] = &[ACTIVATION, REDUCE, SOFTMAX_XENT, OPTIM, CAST];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_kernel_is_defined_extern_c_in_its_source() {
        for s in ALL {
            for k in s.kernels {
                let decl = format!("__global__ void {k}(");
                assert!(s.text.contains(&decl), "{} lacks `{decl}`", s.name);
            }
            let defined = s.text.matches("extern \"C\" __global__").count();
            assert_eq!(defined, s.kernels.len(), "{}: every kernel must be listed", s.name);
        }
    }
}
