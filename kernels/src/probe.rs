//! Finds and loads the CUDA libraries before cudarc touches them.
//!
//! cudarc (with `dynamic-loading`) opens each library by a list of bare names the first time
//! one of its functions is called, and panics when none opens. Two problems follow: a missing
//! library is a panic, and libraries outside the loader's search path (PyPI's `nvidia-*`
//! wheels in a virtualenv) are never found — `LD_LIBRARY_PATH` is read once at process start,
//! so setting it later does nothing.
//!
//! So this module opens each library itself, by full path from a [`SearchPath`] or by bare
//! name, and keeps it loaded for the life of the process. The dynamic loader then answers
//! cudarc's later `dlopen("libnvrtc.so.13")` with the already-loaded object, because a loaded
//! library matches its SONAME. NCCL's SONAME is `libnccl.so.2`, a name cudarc never tries
//! (it tries `libnccl.so`, `.so.13`, `.so.12`, …), which is why [`crate::nccl`] binds NCCL
//! through the handle loaded here instead of through cudarc.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// A library the GPU path needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lib {
    /// The CUDA driver API (`libcuda.so.1`), installed with the NVIDIA driver.
    Driver,
    /// The run-time CUDA C compiler.
    Nvrtc,
    Cublas,
    Nccl,
}

impl Lib {
    pub const ALL: [Lib; 4] = [Lib::Driver, Lib::Nvrtc, Lib::Cublas, Lib::Nccl];

    pub fn label(self) -> &'static str {
        match self {
            Lib::Driver => "CUDA driver (libcuda)",
            Lib::Nvrtc => "NVRTC",
            Lib::Cublas => "cuBLAS",
            Lib::Nccl => "NCCL",
        }
    }

    /// File names tried, best first. The CUDA 13 sonames match the cudarc build
    /// (`cuda-13000`); NCCL's ABI has been `.so.2` for all of NCCL 2.
    pub fn file_names(self) -> &'static [&'static str] {
        match self {
            Lib::Driver => &["libcuda.so.1", "libcuda.so"],
            Lib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so"],
            Lib::Cublas => &["libcublas.so.13", "libcublas.so"],
            Lib::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }

    fn hint(self) -> &'static str {
        match self {
            Lib::Driver => "install the NVIDIA driver (a machine without a GPU has none)",
            Lib::Nvrtc => "install CUDA 13's NVRTC (toolkit, or `pip install nvidia-cuda-nvrtc` in .venv)",
            Lib::Cublas => "install CUDA 13's cuBLAS (toolkit, or `pip install nvidia-cublas` in .venv)",
            Lib::Nccl => "install NCCL 2 (`pip install nvidia-nccl-cu13` in .venv, or the libnccl2 package)",
        }
    }

    /// The driver must match the kernel module, so the system's copy goes first; for the
    /// others an explicitly configured directory wins over whatever the system has.
    fn system_first(self) -> bool {
        matches!(self, Lib::Driver)
    }
}

/// Directories searched (by full path) before or after the dynamic loader's own search.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SearchPath {
    dirs: Vec<PathBuf>,
}

impl SearchPath {
    /// Only the dynamic loader's own search (LD_LIBRARY_PATH as set at start, ld.so.cache).
    pub fn system() -> Self {
        Self::default()
    }

    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        if !self.dirs.contains(&dir) {
            self.dirs.push(dir);
        }
        self
    }

    /// Adds the library folders of PyPI's NVIDIA wheels inside the virtualenv at `venv`
    /// (`lib/python3.*/site-packages/nvidia/*/lib`), the layout torch's CUDA wheels use.
    pub fn venv(mut self, venv: &Path) -> Self {
        for nvidia in venv_nvidia_dirs(venv) {
            let Ok(entries) = std::fs::read_dir(&nvidia) else { continue };
            let mut libs: Vec<PathBuf> =
                entries.flatten().map(|e| e.path().join("lib")).filter(|p| p.is_dir()).collect();
            libs.sort();
            for l in libs {
                self = self.dir(l);
            }
        }
        self
    }

    /// The CUDA toolkit's usual places, then the `.venv` of the nearest ancestor of the
    /// current directory and of the running executable that has one.
    pub fn conventional() -> Self {
        let mut s = Self::system()
            .dir("/usr/local/cuda/lib64")
            .dir("/usr/local/cuda/targets/x86_64-linux/lib")
            .dir("/usr/lib/wsl/lib");
        let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
        for start in starts.into_iter().flatten() {
            if let Some(v) = find_venv_upwards(&start) {
                s = s.venv(&v);
            }
        }
        s
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }
}

fn venv_nvidia_dirs(venv: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in ["lib", "lib64"] {
        let Ok(entries) = std::fs::read_dir(venv.join(lib)) else { continue };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("python3") {
                let n = e.path().join("site-packages").join("nvidia");
                if n.is_dir() && !out.contains(&n) {
                    out.push(n);
                }
            }
        }
    }
    out.sort();
    out
}

/// The first `.venv` holding PyPI NVIDIA wheels in `start` or one of its ancestors.
pub fn find_venv_upwards(start: &Path) -> Option<PathBuf> {
    start.ancestors().map(|a| a.join(".venv")).find(|v| !venv_nvidia_dirs(v).is_empty())
}

/// How one library fared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LibState {
    /// Loaded from this name or path (and kept loaded).
    Loaded { from: String },
    /// Nothing opened; every candidate tried and the last loader error.
    Missing { tried: Vec<String>, last_error: String },
}

impl LibState {
    pub fn is_loaded(&self) -> bool {
        matches!(self, LibState::Loaded { .. })
    }
}

/// A library that could not be loaded, with what was tried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingLib {
    pub lib: Lib,
    pub tried: Vec<String>,
    pub last_error: String,
}

/// Why the GPU path cannot run here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("{}", render_missing(.missing))]
    Missing { missing: Vec<MissingLib> },
    #[error("the CUDA driver is loaded but no GPU is usable: {reason}")]
    NoDevice { reason: String },
}

fn render_missing(missing: &[MissingLib]) -> String {
    let mut s = String::from("CUDA libraries missing:");
    for m in missing {
        let _ = write!(
            s,
            "\n  - {}: none of [{}] could be loaded (last error: {}); {}",
            m.lib.label(),
            m.tried.join(", "),
            m.last_error,
            m.lib.hint()
        );
    }
    s
}

/// The outcome of [`probe`]: every library's state and, when the driver loaded, the number of
/// GPUs it sees (or why it sees none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub libs: Vec<(Lib, LibState)>,
    pub devices: Result<usize, String>,
}

impl Probe {
    pub fn state(&self, lib: Lib) -> &LibState {
        &self.libs.iter().find(|(l, _)| *l == lib).expect("probe covers every Lib").1
    }

    /// `Ok` when every library in `libs` loaded and, if `need_device`, a GPU is visible.
    pub fn require(&self, libs: &[Lib], need_device: bool) -> Result<(), ProbeError> {
        let missing: Vec<MissingLib> = libs
            .iter()
            .filter_map(|&lib| match self.state(lib) {
                LibState::Loaded { .. } => None,
                LibState::Missing { tried, last_error } => {
                    Some(MissingLib { lib, tried: tried.clone(), last_error: last_error.clone() })
                }
            })
            .collect();
        if !missing.is_empty() {
            return Err(ProbeError::Missing { missing });
        }
        if need_device {
            match &self.devices {
                Ok(0) => return Err(ProbeError::NoDevice { reason: "the driver reports 0 devices".into() }),
                Err(reason) => return Err(ProbeError::NoDevice { reason: reason.clone() }),
                Ok(_) => {}
            }
        }
        Ok(())
    }

    /// One line per library, for logs and `--device auto` notices.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for (lib, st) in &self.libs {
            let _ = match st {
                LibState::Loaded { from } => writeln!(s, "{}: {from}", lib.label()),
                LibState::Missing { .. } => writeln!(s, "{}: missing", lib.label()),
            };
        }
        let _ = match &self.devices {
            Ok(n) => write!(s, "GPUs: {n}"),
            Err(e) => write!(s, "GPUs: none ({e})"),
        };
        s
    }
}

struct Loaded {
    from: String,
    lib: &'static libloading::Library,
}

fn registry() -> &'static Mutex<HashMap<Lib, Loaded>> {
    static R: OnceLock<Mutex<HashMap<Lib, Loaded>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Loads `lib` (once per process; later calls return the same handle), trying the
/// directories of `search` and the loader's own search.
pub fn ensure(lib: Lib, search: &SearchPath) -> Result<&'static libloading::Library, ProbeError> {
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = reg.get(&lib) {
        return Ok(l.lib);
    }
    let mut candidates: Vec<String> = Vec::new();
    let in_dirs = search
        .dirs
        .iter()
        .flat_map(|d| lib.file_names().iter().map(move |f| d.join(f)))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string());
    let bare = lib.file_names().iter().map(|s| s.to_string());
    if lib.system_first() {
        candidates.extend(bare);
        candidates.extend(in_dirs);
    } else {
        candidates.extend(in_dirs);
        candidates.extend(bare);
    }
    let mut last_error = String::from("no candidate");
    for c in &candidates {
        // SAFETY: loading a shared library runs its initialisers; these are NVIDIA's own
        // libraries, loaded exactly as cudarc (or any CUDA program) would load them.
        match unsafe { libloading::Library::new(c) } {
            Ok(l) => {
                let leaked: &'static libloading::Library = Box::leak(Box::new(l));
                reg.insert(lib, Loaded { from: c.clone(), lib: leaked });
                return Ok(leaked);
            }
            Err(e) => {
                // libloading's Display is only "dlopen failed"; the loader's text is the source.
                last_error = match std::error::Error::source(&e) {
                    Some(src) => src.to_string(),
                    None => e.to_string(),
                }
            }
        }
    }
    Err(ProbeError::Missing { missing: vec![MissingLib { lib, tried: candidates, last_error }] })
}

/// The handle of `lib` if [`ensure`] loaded it earlier.
pub fn loaded(lib: Lib) -> Option<&'static libloading::Library> {
    registry().lock().unwrap_or_else(|p| p.into_inner()).get(&lib).map(|l| l.lib)
}

/// Where `lib` was loaded from, if it was.
pub fn loaded_from(lib: Lib) -> Option<String> {
    registry().lock().unwrap_or_else(|p| p.into_inner()).get(&lib).map(|l| l.from.clone())
}

/// Tries to load every library and, with the driver loaded, counts the GPUs. Never panics
/// for a missing library.
pub fn probe(search: &SearchPath) -> Probe {
    let libs: Vec<(Lib, LibState)> = Lib::ALL
        .iter()
        .map(|&lib| {
            let st = match ensure(lib, search) {
                Ok(_) => LibState::Loaded { from: loaded_from(lib).unwrap_or_default() },
                Err(ProbeError::Missing { mut missing }) => {
                    let m = missing.pop().expect("ensure reports the library it missed");
                    LibState::Missing { tried: m.tried, last_error: m.last_error }
                }
                Err(e) => LibState::Missing { tried: vec![], last_error: e.to_string() },
            };
            (lib, st)
        })
        .collect();
    let devices = if loaded(Lib::Driver).is_some() {
        count_devices()
    } else {
        Err("the CUDA driver library is not loaded".to_string())
    };
    Probe { libs, devices }
}

/// cuInit and cuDeviceGetCount through cudarc; only called once libcuda is loaded. The
/// catch_unwind is a second fence: a symbol missing from an old driver panics in cudarc.
fn count_devices() -> Result<usize, String> {
    std::panic::catch_unwind(|| -> Result<usize, String> {
        cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {e}"))?;
        let n = cudarc::driver::result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e}"))?;
        Ok(n.max(0) as usize)
    })
    .unwrap_or_else(|_| Err("the CUDA driver panicked in cudarc (too old for CUDA 13?)".to_string()))
}

/// [`ensure`] for `lib` with [`SearchPath::conventional`] unless it is loaded already.
pub(crate) fn ensure_default(lib: Lib) -> Result<&'static libloading::Library, ProbeError> {
    match loaded(lib) {
        Some(l) => Ok(l),
        None => ensure(lib, &SearchPath::conventional()),
    }
}
