//! NVRTC compilation of the `.cu` sources, cached per process by source text (and target):
//! each distinct source is compiled once however many contexts, models or threads ask for it.
//!
//! Two targets: PTX (virtual architecture, JIT-compiled by the driver when loaded) and CUBIN
//! for the GPU's own `sm_XY`. [`crate::ops::Kernels`] prefers CUBIN: the driver's JIT only
//! accepts PTX of an ISA version it knows, so PTX from a newer NVRTC (13.2 from PyPI) fails
//! to load on an older driver (580 is CUDA 13.0), while a CUBIN runs under CUDA's
//! minor-version compatibility.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
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
        other => {
            KernelError::Compile { source_name: name.to_string(), reason: format!("{other:?}"), log: String::new() }
        }
    }
}

/// CUBINs by (source text, major, minor).
type CubinCache = Mutex<HashMap<(String, u32, u32), Arc<Vec<u8>>>>;

fn cubin_cache() -> &'static CubinCache {
    static C: OnceLock<CubinCache> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The CUBIN of `src` for compute capability `major.minor` (`sm_{major}{minor}`), compiled on
/// first use. Needs NVRTC only, no GPU.
pub fn cubin(src: &Source, (major, minor): (u32, u32)) -> Result<Arc<Vec<u8>>, KernelError> {
    cubin_of_text(src.name, &src.full_text(), (major, minor))
}

/// The CUBIN of an arbitrary CUDA C text.
pub fn cubin_of_text(name: &str, text: &str, (major, minor): (u32, u32)) -> Result<Arc<Vec<u8>>, KernelError> {
    let key = (text.to_string(), major, minor);
    if let Some(c) = cubin_cache().lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(c.clone());
    }
    probe::ensure_default(Lib::Nvrtc)?;
    let fail = |reason: String, log: String| KernelError::Compile {
        source_name: format!("{name} (sm_{major}{minor})"),
        reason,
        log,
    };
    let c_text = CString::new(text).map_err(|_| fail("the source contains a NUL byte".into(), String::new()))?;
    let c_name = CString::new(name).map_err(|_| fail("the name contains a NUL byte".into(), String::new()))?;
    let prog = cudarc::nvrtc::result::create_program(&c_text, Some(&c_name))
        .map_err(|e| fail(format!("{e:?}"), String::new()))?;
    let opts = [format!("--gpu-architecture=sm_{major}{minor}"), "--std=c++17".to_string()];
    // SAFETY: prog was created above and is destroyed exactly once, below, on every path;
    // the CUBIN buffer is sized by nvrtcGetCUBINSize before nvrtcGetCUBIN fills it.
    let out = unsafe {
        let compiled = cudarc::nvrtc::result::compile_program(prog, &opts);
        let result = match compiled {
            Err(e) => {
                let log = cudarc::nvrtc::result::get_program_log(prog).map(|l| log_text(&l)).unwrap_or_default();
                Err(fail(format!("{e:?}"), log))
            }
            Ok(()) => {
                let mut size = 0usize;
                let sys = cudarc::nvrtc::sys::nvrtcGetCUBINSize(prog, &mut size).result();
                match sys {
                    Err(e) => Err(fail(format!("nvrtcGetCUBINSize: {e:?}"), String::new())),
                    Ok(()) => {
                        let mut buf = vec![0u8; size];
                        match cudarc::nvrtc::sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char).result() {
                            Ok(()) => Ok(buf),
                            Err(e) => Err(fail(format!("nvrtcGetCUBIN: {e:?}"), String::new())),
                        }
                    }
                }
            }
        };
        let _ = cudarc::nvrtc::result::destroy_program(prog);
        result
    }?;
    let out = Arc::new(out);
    cubin_cache().lock().unwrap_or_else(|p| p.into_inner()).entry(key).or_insert(out.clone());
    Ok(out)
}

fn log_text(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
