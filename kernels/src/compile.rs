//! NVRTC compilation of the `.cu` sources, cached per process by source text: each distinct
//! source is compiled once however many contexts, models or threads ask for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::probe::{self, Lib};
use crate::sources::Source;
use crate::KernelError;

fn cache() -> &'static Mutex<HashMap<String, Arc<Ptx>>> {
    static C: OnceLock<Mutex<HashMap<String, Arc<Ptx>>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The options every source is compiled with. No `--gpu-architecture`: NVRTC's default
/// virtual architecture yields PTX that the driver JIT-compiles for whatever GPU runs it.
fn options(name: &str) -> CompileOptions {
    CompileOptions { name: Some(name.to_string()), options: vec!["--std=c++17".into()], ..Default::default() }
}

/// The PTX of `src`, compiled on first use. Loads NVRTC first (with
/// [`probe::SearchPath::conventional`] unless something loaded it already), so a missing
/// NVRTC is an error, not cudarc's panic.
pub fn ptx(src: &Source) -> Result<Arc<Ptx>, KernelError> {
    ptx_of_text(src.name, &src.full_text())
}

/// The PTX of an arbitrary CUDA C text (`name` appears in NVRTC's messages).
pub fn ptx_of_text(name: &str, text: &str) -> Result<Arc<Ptx>, KernelError> {
    if let Some(p) = cache().lock().unwrap_or_else(|p| p.into_inner()).get(text) {
        return Ok(p.clone());
    }
    probe::ensure_default(Lib::Nvrtc)?;
    // Compiled outside the lock: two threads may both compile a new source once, which is
    // harmless, while a slow compile never blocks lookups of other sources.
    let compiled = cudarc::nvrtc::compile_ptx_with_opts(text, options(name)).map_err(|e| compile_error(name, e))?;
    let compiled = Arc::new(compiled);
    cache().lock().unwrap_or_else(|p| p.into_inner()).entry(text.to_string()).or_insert(compiled.clone());
    Ok(compiled)
}

/// How many distinct sources this process has compiled.
pub fn cached_sources() -> usize {
    cache().lock().unwrap_or_else(|p| p.into_inner()).len()
}

fn compile_error(name: &str, e: CompileError) -> KernelError {
    match e {
        CompileError::CompileError { nvrtc, log, .. } => KernelError::Compile {
            source_name: name.to_string(),
            reason: format!("{nvrtc:?}"),
            log: log.to_string_lossy().into_owned(),
        },
        other => KernelError::Compile { source_name: name.to_string(), reason: format!("{other:?}"), log: String::new() },
    }
}
