//! A thin NCCL binding over the library [`crate::probe`] loaded (`libnccl.so.2` as PyPI and
//! the distributions package it), instead of cudarc's, whose loader never tries that name.
//!
//! Only what one-process-per-GPU data parallelism needs: unique ids, communicators, in-place
//! all-reduce, broadcast, the asynchronous error state and abort.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys::CUstream, CudaStream, DevicePtrMut};

use crate::probe::{self, Lib};
use crate::KernelError;

type NcclResult = c_int;
type RawComm = *mut c_void;

const SUCCESS: NcclResult = 0;
const IN_PROGRESS: NcclResult = 7;

/// NCCL's 128-byte unique id: made by one rank, handed to the others out of band.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({:02x?}..)", &self.internal[..8])
    }
}

/// Reduction operators (`ncclRedOp_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedOp {
    Sum = 0,
    Prod = 1,
    Max = 2,
    Min = 3,
    /// Sum divided by the number of ranks (NCCL ≥ 2.10).
    Avg = 4,
}

/// Element types (`ncclDataType_t`).
pub trait NcclType: cudarc::driver::DeviceRepr {
    const DTYPE: c_int;
}
impl NcclType for i8 {
    const DTYPE: c_int = 0;
}
impl NcclType for u8 {
    const DTYPE: c_int = 1;
}
impl NcclType for i32 {
    const DTYPE: c_int = 2;
}
impl NcclType for u32 {
    const DTYPE: c_int = 3;
}
impl NcclType for i64 {
    const DTYPE: c_int = 4;
}
impl NcclType for u64 {
    const DTYPE: c_int = 5;
}
impl NcclType for f32 {
    const DTYPE: c_int = 7;
}
impl NcclType for f64 {
    const DTYPE: c_int = 8;
}
/// bf16 as raw bits.
impl NcclType for u16 {
    const DTYPE: c_int = 9;
}

struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult,
    comm_abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, CUstream) -> NcclResult,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, CUstream) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    get_last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
}

/// The bound API; `Err` keeps the first failure (NCCL absent, a symbol missing).
fn api() -> Result<&'static Api, KernelError> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    if API.get().is_none() {
        // Loading is retried until it succeeds once: a later call may come with a better
        // search path (probe::ensure with more directories).
        let lib = probe::ensure_default(Lib::Nccl)?;
        let _ = API.set(bind(lib));
    }
    match API.get().expect("set above") {
        Ok(a) => Ok(a),
        Err(e) => Err(KernelError::Nccl {
            call: "dlsym",
            code: -1,
            code_name: "missing symbol".into(),
            detail: format!(": {e}"),
        }),
    }
}

fn bind(lib: &'static libloading::Library) -> Result<Api, String> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NCCL's public C API function of that name, and the field
            // it is stored in has the C prototype from nccl.h; the library is never unloaded
            // (probe leaks it), so the pointer stays valid.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("{}: {e}", $name))?
        };
    }
    Ok(Api {
        get_version: sym!("ncclGetVersion"),
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        comm_abort: sym!("ncclCommAbort"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        all_reduce: sym!("ncclAllReduce"),
        broadcast: sym!("ncclBroadcast"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error: sym!("ncclGetLastError"),
    })
}

fn check(api: &Api, call: &'static str, comm: RawComm, r: NcclResult) -> Result<(), KernelError> {
    if r == SUCCESS {
        return Ok(());
    }
    // SAFETY: both return pointers to static or per-communicator strings owned by NCCL
    // (NULL comm is allowed for the last error); copied out immediately.
    let (name, last) = unsafe {
        let n = (api.get_error_string)(r);
        let l = (api.get_last_error)(comm);
        (cstr(n), cstr(l))
    };
    Err(KernelError::Nccl {
        call,
        code: r,
        code_name: name,
        detail: if last.is_empty() { String::new() } else { format!(": {last}") },
    })
}

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: NCCL returns NUL-terminated strings; checked non-null above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// NCCL's version as (major, minor, patch).
pub fn version() -> Result<(u32, u32, u32), KernelError> {
    let api = api()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    check(api, "ncclGetVersion", std::ptr::null_mut(), unsafe { (api.get_version)(&mut v) })?;
    let v = v as u32;
    // NCCL ≥ 2.9 encodes major*10000 + minor*100 + patch.
    Ok((v / 10000, (v % 10000) / 100, v % 100))
}

impl UniqueId {
    /// A fresh id (rank 0 makes it). Needs no GPU: NCCL only picks a bootstrap address.
    pub fn new() -> Result<Self, KernelError> {
        let api = api()?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte struct it is given.
        check(api, "ncclGetUniqueId", std::ptr::null_mut(), unsafe { (api.get_unique_id)(&mut id) })?;
        Ok(id)
    }

    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let internal: [u8; 128] = b.try_into().ok()?;
        Some(Self { internal })
    }
}

/// A communicator: one rank of a group, bound to the GPU current at creation. Not `Send`
/// (NCCL communicators belong to the thread's device context), like cudarc's.
#[derive(Debug)]
pub struct Comm {
    raw: RawComm,
    rank: usize,
    world: usize,
    aborted: bool,
}

impl Comm {
    /// Joins the group `id` as `rank` of `world`. The GPU's context must be current on this
    /// thread (`CudaContext::bind_to_thread`). Blocks until every rank has joined, so callers
    /// should first make sure all ranks are alive (e.g. a store barrier with a deadline).
    pub fn init_rank(id: &UniqueId, rank: usize, world: usize) -> Result<Self, KernelError> {
        let api = api()?;
        if rank >= world {
            return Err(KernelError::InvalidArgument {
                op: "ncclCommInitRank",
                reason: format!("rank {rank} of world {world}"),
            });
        }
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: raw receives the new communicator; id is passed by value as nccl.h says.
        let r = unsafe { (api.comm_init_rank)(&mut raw, world as c_int, *id, rank as c_int) };
        check(api, "ncclCommInitRank", std::ptr::null_mut(), r)?;
        Ok(Self { raw, rank, world, aborted: false })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world_size(&self) -> usize {
        self.world
    }

    fn live(&self, call: &'static str) -> Result<&'static Api, KernelError> {
        if self.aborted {
            return Err(KernelError::Nccl {
                call,
                code: -1,
                code_name: "communicator aborted".into(),
                detail: String::new(),
            });
        }
        api()
    }

    /// In-place all-reduce of `buf` enqueued on `stream`; returns once enqueued. `stream`
    /// first waits for the last writer of `buf` on any stream (cudarc's tracking), and later
    /// users of `buf` wait for this reduction.
    pub fn all_reduce_in_place<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        op: RedOp,
        stream: &Arc<CudaStream>,
    ) -> Result<(), KernelError> {
        let api = self.live("ncclAllReduce")?;
        let count = buf.len();
        let (ptr, _record) = buf.device_ptr_mut(stream);
        // SAFETY: ptr addresses `count` elements of T on this communicator's GPU, alive for the
        // call (the guard records the access on `stream` when dropped after the enqueue).
        let r = unsafe {
            (api.all_reduce)(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                T::DTYPE,
                op as c_int,
                self.raw,
                stream.cu_stream(),
            )
        };
        check(api, "ncclAllReduce", self.raw, r)
    }

    /// The same on raw device pointers, for benchmarks against this crate's tracking.
    ///
    /// # Safety
    /// `send` and `recv` must address `count` elements of `T` on this communicator's GPU that
    /// stay alive and unused by other streams until the reduction on `stream` completes.
    pub unsafe fn all_reduce_raw<T: NcclType>(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        op: RedOp,
        stream: CUstream,
    ) -> Result<(), KernelError> {
        let api = self.live("ncclAllReduce")?;
        // SAFETY: guaranteed by the caller.
        let r = unsafe {
            (api.all_reduce)(send as *const c_void, recv as *mut c_void, count, T::DTYPE, op as c_int, self.raw, stream)
        };
        check(api, "ncclAllReduce", self.raw, r)
    }

    /// In-place broadcast of `buf` from `root`, enqueued on `stream`.
    pub fn broadcast_in_place<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        root: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<(), KernelError> {
        let api = self.live("ncclBroadcast")?;
        let count = buf.len();
        let (ptr, _record) = buf.device_ptr_mut(stream);
        // SAFETY: as in all_reduce_in_place.
        let r = unsafe {
            (api.broadcast)(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                T::DTYPE,
                root as c_int,
                self.raw,
                stream.cu_stream(),
            )
        };
        check(api, "ncclBroadcast", self.raw, r)
    }

    /// Runs `f` between ncclGroupStart and ncclGroupEnd (fusing the collectives it enqueues).
    pub fn group<R>(&self, f: impl FnOnce(&Self) -> Result<R, KernelError>) -> Result<R, KernelError> {
        let api = self.live("ncclGroupStart")?;
        // SAFETY: no arguments; paired with the group_end below on every path.
        check(api, "ncclGroupStart", self.raw, unsafe { (api.group_start)() })?;
        let out = f(self);
        // SAFETY: closes the group opened above.
        let end = check(api, "ncclGroupEnd", self.raw, unsafe { (api.group_end)() });
        let out = out?;
        end?;
        Ok(out)
    }

    /// The communicator's asynchronous error (a failed peer, a network error), if any.
    pub fn async_error(&self) -> Result<(), KernelError> {
        let api = self.live("ncclCommGetAsyncError")?;
        let mut state: NcclResult = SUCCESS;
        // SAFETY: writes one ncclResult_t for a live communicator.
        check(api, "ncclCommGetAsyncError", self.raw, unsafe { (api.comm_get_async_error)(self.raw, &mut state) })?;
        if state == SUCCESS || state == IN_PROGRESS {
            Ok(())
        } else {
            check(api, "communicator (asynchronous error)", self.raw, state)
        }
    }

    /// Aborts every operation in flight and frees the communicator, without waiting for
    /// peers: the way out after a timeout or a lost peer. Idempotent.
    pub fn abort(&mut self) -> Result<(), KernelError> {
        if self.aborted {
            return Ok(());
        }
        self.aborted = true;
        let api = api()?;
        // SAFETY: a live communicator, never used again (aborted is set).
        check(api, "ncclCommAbort", std::ptr::null_mut(), unsafe { (api.comm_abort)(self.raw) })
    }

    /// Orderly teardown: waits for this rank's outstanding operations, then frees. Use
    /// [`Self::abort`] instead when a peer may be gone (destroy could then wait forever).
    pub fn destroy(mut self) -> Result<(), KernelError> {
        self.aborted = true;
        let api = api()?;
        // SAFETY: a live communicator, consumed here (Drop sees aborted and does nothing).
        check(api, "ncclCommDestroy", std::ptr::null_mut(), unsafe { (api.comm_destroy)(self.raw) })
    }
}

impl Drop for Comm {
    /// Aborts rather than destroys: dropping never waits on a peer that may be gone.
    fn drop(&mut self) {
        let _ = self.abort();
    }
}
