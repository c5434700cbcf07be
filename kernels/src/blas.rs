//! The MLP's matrix products on cuBLAS, for row-major tensors (cuBLAS is column-major, so a
//! row-major `rows x cols` matrix is read as its transpose; the mapping is spelled out per
//! product below). Inputs in fp32 or bf16, always accumulated and written in fp32
//! (`CUBLAS_COMPUTE_32F`: no TF32 shortcut, so fp32 results are comparable with the CPU).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::KernelError;

/// Element types cuBLAS reads as GEMM inputs: `f32`, or bf16 as raw `u16`.
pub trait GemmInput: Copy {
    const CUDA_TYPE: cudaDataType_t;
}
impl GemmInput for f32 {
    const CUDA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
}
impl GemmInput for u16 {
    const CUDA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
}

/// A cuBLAS handle bound to one stream.
#[derive(Debug)]
pub struct Blas {
    inner: CudaBlas,
    stream: Arc<CudaStream>,
}

impl Blas {
    /// Needs cuBLAS loaded ([`crate::probe::ensure`]) and a context on `stream`.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, KernelError> {
        crate::probe::ensure_default(crate::probe::Lib::Cublas)?;
        let inner = CudaBlas::new(stream.clone()).map_err(KernelError::cublas("creating a cuBLAS handle"))?;
        Ok(Self { inner, stream: stream.clone() })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Column-major `C = alpha * op(A) op(B) + beta * C` (`C` fp32), through cublasGemmEx.
    #[allow(clippy::too_many_arguments)]
    fn gemm<T: GemmInput>(
        &self,
        ta: bool,
        tb: bool,
        (m, n, k): (usize, usize, usize),
        a: &CudaSlice<T>,
        lda: usize,
        b: &CudaSlice<T>,
        ldb: usize,
        beta: f32,
        c: &mut CudaSlice<f32>,
        ldc: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "gemm";
        let a_need = if ta { lda * m } else { lda * k };
        let b_need = if tb { ldb * k } else { ldb * n };
        if a.len() < a_need || b.len() < b_need || c.len() < ldc * n {
            return Err(KernelError::InvalidArgument {
                op: OP,
                reason: format!(
                    "m {m} n {n} k {k}: A {} (< {a_need}?) B {} (< {b_need}?) C {} (< {}?)",
                    a.len(),
                    b.len(),
                    c.len(),
                    ldc * n
                ),
            });
        }
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| KernelError::InvalidArgument { op: OP, reason: format!("{v} exceeds i32") })
        };
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let (alpha, beta) = (1.0f32, beta);
        let (pa, _ra) = a.device_ptr(&self.stream);
        let (pb, _rb) = b.device_ptr(&self.stream);
        let (pc, _rc) = c.device_ptr_mut(&self.stream);
        // SAFETY: the pointers come from live allocations whose sizes were checked against
        // the GEMM's extents above; alpha and beta are host f32 (the handle's default host
        // pointer mode), matching the fp32 compute type; the SyncOnDrop guards record the
        // accesses on this stream after the call is enqueued.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.inner.handle(),
                op(ta),
                op(tb),
                int(m)?,
                int(n)?,
                int(k)?,
                (&alpha) as *const f32 as *const c_void,
                pa as *const c_void,
                T::CUDA_TYPE,
                int(lda)?,
                pb as *const c_void,
                T::CUDA_TYPE,
                int(ldb)?,
                (&beta) as *const f32 as *const c_void,
                pc as *mut c_void,
                cudaDataType_t::CUDA_R_32F,
                int(ldc)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(KernelError::cublas(format!("gemm m={m} n={n} k={k}")))
    }

    /// Layer forward without bias: `out[s, o] = sum_i x[s, i] w[o, i]`
    /// (`x`: rows x din, `w`: dout x din, `out`: rows x dout, all row-major).
    /// Column-major view: `out^T (dout x rows) = w^T^T (dout x din) * x^T (din x rows)`.
    pub fn linear_fwd<T: GemmInput>(
        &self,
        x: &CudaSlice<T>,
        w: &CudaSlice<T>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        din: usize,
        dout: usize,
    ) -> Result<(), KernelError> {
        self.gemm(true, false, (dout, rows, din), w, din, x, din, 0.0, out, dout)
    }

    /// Weight gradient: `gw[o, i] = beta * gw[o, i] + sum_s dy[s, o] x[s, i]`.
    /// Column-major view: `gw^T (din x dout) = x^T (din x rows) * (dy^T)^T (rows x dout)`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_bwd_weight<T: GemmInput>(
        &self,
        x: &CudaSlice<T>,
        dy: &CudaSlice<T>,
        gw: &mut CudaSlice<f32>,
        rows: usize,
        din: usize,
        dout: usize,
        beta: f32,
    ) -> Result<(), KernelError> {
        self.gemm(false, true, (din, dout, rows), x, din, dy, dout, beta, gw, din)
    }

    /// Input gradient: `dx[s, i] = sum_o dy[s, o] w[o, i]`.
    /// Column-major view: `dx^T (din x rows) = w^T (din x dout) * dy^T (dout x rows)`.
    pub fn linear_bwd_input<T: GemmInput>(
        &self,
        dy: &CudaSlice<T>,
        w: &CudaSlice<T>,
        dx: &mut CudaSlice<f32>,
        rows: usize,
        din: usize,
        dout: usize,
    ) -> Result<(), KernelError> {
        self.gemm(false, false, (din, rows, dout), w, din, dy, dout, 0.0, dx, din)
    }
}
