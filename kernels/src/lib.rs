//! CUDA kernels for the `train` example's MLP, kept as CUDA C sources (`cu/*.cu`) and compiled
//! at run time by NVRTC; cuBLAS for the matrix products; a thin NCCL binding.
//!
//! Code map:
//! - `sources`: the `.cu` texts and the kernels each defines (always built, no CUDA needed);
//! - `reference`: CPU versions of every kernel, the yardstick of the GPU checks (always built);
//! - `probe` (feature `cuda`): finds and loads libcuda, NVRTC, cuBLAS and NCCL, reporting what
//!   is missing instead of letting cudarc panic;
//! - `compile` (feature `cuda`): NVRTC compilation, cached per process by source text;
//! - `ops` (feature `cuda`): the compiled kernels loaded into a context, with typed launchers;
//! - `blas` (feature `cuda`): row-major linear-layer products on cuBLAS (fp32, and bf16 inputs
//!   with fp32 accumulation);
//! - `nccl` (feature `cuda`): unique ids, communicators, all-reduce/broadcast, abort.
//!
//! Invariants: with feature `cuda` the crate still builds and loads on a machine with no CUDA
//! (cudarc's `dynamic-loading`, a fixed CUDA-version feature); no cudarc entry point is called
//! before [`probe`] has loaded the library behind it, so a missing library is an error value,
//! never a panic.

pub mod reference;
pub mod sources;

#[cfg(feature = "cuda")]
pub mod blas;
#[cfg(feature = "cuda")]
pub mod compile;
#[cfg(feature = "cuda")]
mod error;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
pub mod probe;

#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use error::KernelError;
