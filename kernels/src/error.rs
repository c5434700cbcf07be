//! The crate's error type.

use std::path::PathBuf;

/// Why a CUDA-side operation failed.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{0}")]
    Missing(#[from] crate::probe::ProbeError),
    #[error("NVRTC could not compile {source_name}: {reason}\n{log}")]
    Compile { source_name: String, reason: String, log: String },
    #[error("CUDA driver call failed while {what}")]
    Driver {
        what: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error("cuBLAS call failed while {what}")]
    Cublas {
        what: String,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    #[error("NCCL {call} failed: {code_name} ({code}){detail}")]
    Nccl { call: &'static str, code: i32, code_name: String, detail: String },
    #[error("invalid arguments to {op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl KernelError {
    pub(crate) fn driver(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        let what = what.into();
        move |source| KernelError::Driver { what, source }
    }
    pub(crate) fn cublas(what: impl Into<String>) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Self {
        let what = what.into();
        move |source| KernelError::Cublas { what, source }
    }
}
