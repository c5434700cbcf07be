//! Collectives among the ranks of one host through one shared-memory segment.
//!
//! Local rank 0 creates anonymous memory (`memfd_create`), publishes the link to its descriptor
//! (`/proc/{pid}/fd/{fd}`) through the store, and closes the descriptor once every rank has
//! mapped it. The segment never has a name in `/dev/shm`: it goes with the last rank that maps
//! it, whichever step of the bootstrap a rank dies at. The segment
//! holds, per rank, a control block (a step counter peers wait on, its pid for liveness, the
//! header of the current collective) and two staging buffers used alternately by successive
//! steps (double buffering: a rank may write the buffer of step `k` once every peer has arrived
//! at step `k - 1`, i.e. has finished reading step `k - 2`, which used the same buffer).
//!
//! Waiting spins briefly, then sleeps on a futex on the peer's counter (woken by the peer),
//! checking the deadline and the peer's pid every few milliseconds.
//!
//! Small all-reduces: every rank copies its data in and reduces all ranks' copies itself.
//! Large ones, chunk by chunk: each rank copies in the parts others need, reduces its own
//! 1/n portion (reading its own part straight from the user buffer), publishes it, and copies
//! the other portions back (reduce-scatter + all-gather, DeepSpeed's shm scheme).

use std::ffi::CString;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::elem::{as_bytes, Element, ReduceOp};
use super::{CommError, Deadline, Desc, PgOptions, Rendezvous};

/// Default staging buffer per rank and per step (two per rank).
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;
/// All-reduces up to this size are reduced by every rank in one step.
const SMALL_BYTES: usize = 64 << 10;
const MAGIC: u64 = 0x726c_6175_6e63_6801; // "rlaunch" + version 1
const HEADER_BYTES: usize = 4096;
const CTRL_BYTES: usize = 128;
const ALIGN_ELEMS_BYTES: usize = 64;
/// Floor of the adaptive spin budget.
const MIN_SPIN_NS: u64 = 2_000;
/// Buffers from this size on receive results through non-temporal stores.
const STREAM_BYTES: usize = 8 << 20;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    ranks: AtomicU64,
    chunk: AtomicU64,
}

#[repr(C, align(128))]
struct Ctrl {
    /// Number of steps this rank has arrived at (the futex word peers wait on).
    seq: AtomicU32,
    /// Peers currently asleep on `seq`: wake them only when non-zero.
    waiters: AtomicU32,
    pid: AtomicI32,
    attached: AtomicU32,
    /// Header of the collective of the last step of each parity.
    desc: [[AtomicU64; 2]; 2],
}

const _: () = assert!(std::mem::size_of::<Ctrl>() == CTRL_BYTES);

/// One host's ranks joined through a shared-memory segment.
pub struct ShmGroup {
    base: *mut u8,
    len: usize,
    n: usize,
    me: usize,
    /// Global rank of each local index (for error messages).
    ranks: Vec<usize>,
    pids: Vec<i32>,
    chunk: usize,
    step: u32,
    pub(crate) timeout: Duration,
    spin: Duration,
    /// Current adaptive spin budget in nanoseconds (see `wait_peer`).
    spin_ns: std::cell::Cell<u64>,
    yields: u32,
    /// The creator's memfd until every rank has mapped the segment.
    creator_fd: Option<libc::c_int>,
}

// SAFETY: the mapping is owned by this value and stays valid until drop; all cross-process
// synchronisation goes through atomics in the segment, so moving the owner to another thread
// is sound (it is not shared between threads: collectives take `&mut self`).
unsafe impl Send for ShmGroup {}

fn shm_err(path: &str, what: &str, source: std::io::Error) -> CommError {
    CommError::Shm { path: path.to_string(), what: what.to_string(), source }
}

fn segment_len(n: usize, chunk: usize) -> usize {
    let data_off = HEADER_BYTES + (n * CTRL_BYTES).div_ceil(4096) * 4096;
    data_off + 2 * n * chunk
}

impl ShmGroup {
    /// Creates (local index 0) or attaches to the segment of `ranks` (global ranks, local order).
    pub(crate) fn new(
        store: &mut dyn Rendezvous,
        ns: &str,
        ranks: &[usize],
        me: usize,
        opts: &PgOptions,
    ) -> Result<Self, CommError> {
        let n = ranks.len();
        let deadline = Deadline::new(opts.timeout, "shm bootstrap");
        let name_key = format!("{ns}/name");
        let (path, fd, chunk) = if me == 0 {
            let chunk = opts.shm_chunk_bytes.max(4096).div_ceil(4096) * 4096;
            // Anonymous memory, never a name in /dev/shm: the segment lives exactly as long as a
            // rank maps it (or the creator holds the descriptor), whichever step of the
            // bootstrap a rank dies at. Peers open it through the creator's descriptor link.
            // SAFETY: memfd_create with a NUL-terminated name and flags.
            let fd = unsafe { libc::memfd_create(c"rlaunch-shm".as_ptr(), libc::MFD_CLOEXEC) };
            if fd < 0 {
                return Err(shm_err("memfd", "create", std::io::Error::last_os_error()));
            }
            let path = format!("/proc/{}/fd/{fd}", std::process::id());
            let len = segment_len(n, chunk);
            // SAFETY: ftruncate on the descriptor just opened.
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                let e = std::io::Error::last_os_error();
                // SAFETY: closing what we created.
                unsafe { libc::close(fd) };
                return Err(shm_err(&path, "size", e));
            }
            (path, fd, chunk)
        } else {
            let v = store.get(&name_key, super::remaining(&deadline, ranks[0])?)?;
            let path =
                String::from_utf8(v).map_err(|_| CommError::Bootstrap { reason: "malformed shm name".into() })?;
            let c =
                CString::new(path.clone()).map_err(|_| CommError::Bootstrap { reason: "shm name has NUL".into() })?;
            // SAFETY: plain open(2) with a NUL-terminated path.
            let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(shm_err(&path, "open", std::io::Error::last_os_error()));
            }
            (path, fd, 0)
        };
        // SAFETY: fstat into a zeroed struct we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out-pointer.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: closing our descriptor.
            unsafe { libc::close(fd) };
            return Err(shm_err(&path, "stat", e));
        }
        let len = st.st_size as usize;
        // SAFETY: mapping the whole file shared read-write; checked against MAP_FAILED below.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        // The mapping keeps the memory referenced. The creator keeps its descriptor until every
        // peer has opened it (its link is the segment's only name); a peer needs it no more.
        let creator_fd = if me == 0 {
            Some(fd)
        } else {
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(fd) };
            None
        };
        if base == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            if let Some(fd) = creator_fd {
                // SAFETY: closing our own descriptor.
                unsafe { libc::close(fd) };
            }
            return Err(shm_err(&path, "map", e));
        }
        let mut g = ShmGroup {
            base: base.cast(),
            len,
            n,
            me,
            ranks: ranks.to_vec(),
            pids: vec![0; n],
            chunk,
            step: 0,
            timeout: opts.timeout,
            spin: opts.spin,
            spin_ns: std::cell::Cell::new(opts.spin.as_nanos() as u64),
            yields: 0,
            creator_fd,
        };
        let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
        if n > cpus {
            // More ranks than cores: a spinning waiter steals the core its peer needs.
            g.spin = g.spin.min(Duration::from_micros(2));
            g.spin_ns.set(g.spin.as_nanos() as u64);
            g.yields = 8;
        }
        if me == 0 {
            let h = g.header();
            h.ranks.store(n as u64, Ordering::Relaxed);
            h.chunk.store(chunk as u64, Ordering::Relaxed);
            h.magic.store(MAGIC, Ordering::Release);
            store.set(&name_key, path.as_bytes())?;
        } else {
            let h = g.header();
            if len < HEADER_BYTES
                || h.magic.load(Ordering::Acquire) != MAGIC
                || h.ranks.load(Ordering::Relaxed) != n as u64
            {
                return Err(CommError::Bootstrap {
                    reason: format!("shm segment {path} does not match a group of {n} ranks"),
                });
            }
            g.chunk = h.chunk.load(Ordering::Relaxed) as usize;
            if segment_len(n, g.chunk) > len {
                return Err(CommError::Bootstrap { reason: format!("shm segment {path} is too small") });
            }
        }
        let c = g.ctrl(me);
        c.pid.store(std::process::id() as i32, Ordering::Relaxed);
        c.attached.store(1, Ordering::Release);
        // Wait until everyone has mapped the segment; then its name can go.
        for (q, &rank) in ranks.iter().enumerate() {
            loop {
                if g.ctrl(q).attached.load(Ordering::Acquire) == 1 {
                    g.pids[q] = g.ctrl(q).pid.load(Ordering::Relaxed);
                    break;
                }
                if deadline.expired() {
                    return Err(deadline.timeout_err(rank));
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        g.release_name();
        Ok(g)
    }

    /// Closes the creator's descriptor: from now on the segment has no name at all, only
    /// mappings, and goes with the last of them.
    fn release_name(&mut self) {
        if let Some(fd) = self.creator_fd.take() {
            // SAFETY: closing the descriptor this value owns, once.
            unsafe { libc::close(fd) };
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_BYTES long and page aligned; Header is atomics only.
        unsafe { &*self.base.cast::<Header>() }
    }

    fn ctrl(&self, q: usize) -> &Ctrl {
        debug_assert!(q < self.n);
        // SAFETY: control blocks follow the header, CTRL_BYTES apart, inside the mapping; Ctrl
        // is atomics only, so concurrent access from other processes is fine.
        unsafe { &*self.base.add(HEADER_BYTES + q * CTRL_BYTES).cast::<Ctrl>() }
    }

    fn buf_ptr(&self, q: usize, parity: u32) -> *mut u8 {
        let data_off = HEADER_BYTES + (self.n * CTRL_BYTES).div_ceil(4096) * 4096;
        let off = data_off + (q * 2 + parity as usize) * self.chunk;
        debug_assert!(off + self.chunk <= self.len);
        // SAFETY: in bounds of the mapping (segment_len checked at attach).
        unsafe { self.base.add(off) }
    }

    /// A peer's staging buffer of `parity` as `len` elements from element `at`.
    ///
    /// Only called after waiting for the peer to arrive at the step that wrote it and before
    /// this rank arrives at the step after next, during which the peer does not write it.
    fn peer<T: Element>(&self, q: usize, parity: u32, at: usize, len: usize) -> &[T] {
        assert!((at + len) * std::mem::size_of::<T>() <= self.chunk);
        // SAFETY: in bounds (asserted), aligned (page-aligned buffers, element-sized offsets),
        // any bytes are valid T (Element contract), and the step protocol guarantees the peer
        // does not write this buffer while the returned slice is used.
        unsafe { std::slice::from_raw_parts(self.buf_ptr(q, parity).cast::<T>().add(at), len) }
    }

    /// This rank's own staging buffer of `parity`, writable under the same protocol.
    #[allow(clippy::mut_from_ref)]
    fn mine<T: Element>(&self, parity: u32, at: usize, len: usize) -> &mut [T] {
        assert!((at + len) * std::mem::size_of::<T>() <= self.chunk);
        // SAFETY: as in `peer`; only this rank writes its own buffers, and peers read the
        // buffer of a step only after this rank arrives at it (after the writes).
        unsafe { std::slice::from_raw_parts_mut(self.buf_ptr(self.me, parity).cast::<T>().add(at), len) }
    }

    /// Starts step `k = step + 1`: waits until every peer has arrived at `k - 1` (so nobody still
    /// reads the buffer this step overwrites), records the header, returns `(k, parity)`.
    fn begin(&mut self, desc: Desc, dl: &Deadline) -> Result<(u32, u32), CommError> {
        let k = self.step.wrapping_add(1);
        for q in 0..self.n {
            if q != self.me {
                self.wait_peer(q, k.wrapping_sub(1), dl)?;
            }
        }
        let parity = k & 1;
        let w = desc.to_words();
        let c = self.ctrl(self.me);
        c.desc[parity as usize][0].store(w[0], Ordering::Relaxed);
        c.desc[parity as usize][1].store(w[1], Ordering::Relaxed);
        Ok((k, parity))
    }

    /// Publishes step `k` (after writing this rank's buffer) and wakes sleeping peers.
    fn arrive(&mut self, k: u32) {
        self.step = k;
        let c = self.ctrl(self.me);
        c.seq.store(k, Ordering::SeqCst);
        if c.waiters.load(Ordering::SeqCst) != 0 {
            futex_wake(&c.seq);
        }
    }

    /// Waits for every peer to arrive at step `k` and checks they run the same collective.
    fn wait_all_check(&self, k: u32, desc: Desc, dl: &Deadline) -> Result<(), CommError> {
        for q in 0..self.n {
            if q != self.me {
                self.wait_peer(q, k, dl)?;
                self.check_desc(q, k, desc)?;
            }
        }
        Ok(())
    }

    fn check_desc(&self, q: usize, k: u32, desc: Desc) -> Result<(), CommError> {
        let p = (k & 1) as usize;
        let c = self.ctrl(q);
        let theirs = Desc::from_words([c.desc[p][0].load(Ordering::Relaxed), c.desc[p][1].load(Ordering::Relaxed)]);
        if theirs != desc {
            return Err(CommError::Mismatch {
                me: self.ranks[self.me],
                rank: self.ranks[q],
                mine: desc.describe(),
                theirs: theirs.describe(),
            });
        }
        Ok(())
    }

    /// Waits until peer `q` has arrived at step `target`: spins for the current spin budget,
    /// yields a few times when oversubscribed, then sleeps on the peer's futex word.
    ///
    /// The spin budget adapts like an adaptive mutex: a wait that ends while spinning doubles
    /// it (up to the configured spin), a wait that has to sleep halves it. On an idle machine
    /// waits end within the spin (sub-microsecond hand-offs); on a loaded one the spinner soon
    /// stops burning the core its peer may be waiting for.
    fn wait_peer(&self, q: usize, target: u32, dl: &Deadline) -> Result<(), CommError> {
        let c = self.ctrl(q);
        let reached = |v: u32| v.wrapping_sub(target) as i32 >= 0;
        if reached(c.seq.load(Ordering::Acquire)) {
            return Ok(());
        }
        let budget = Duration::from_nanos(self.spin_ns.get());
        let start = Instant::now();
        loop {
            for _ in 0..64 {
                std::hint::spin_loop();
                if reached(c.seq.load(Ordering::Acquire)) {
                    self.spin_ns.set((self.spin_ns.get() * 2).clamp(MIN_SPIN_NS, self.spin.as_nanos() as u64));
                    return Ok(());
                }
            }
            if start.elapsed() >= budget {
                break;
            }
        }
        self.spin_ns.set((self.spin_ns.get() / 2).max(MIN_SPIN_NS));
        for _ in 0..self.yields {
            std::thread::yield_now();
            if reached(c.seq.load(Ordering::Acquire)) {
                return Ok(());
            }
        }
        let mut last_check = Instant::now();
        loop {
            c.waiters.fetch_add(1, Ordering::SeqCst);
            let v = c.seq.load(Ordering::SeqCst);
            if reached(v) {
                c.waiters.fetch_sub(1, Ordering::SeqCst);
                return Ok(());
            }
            futex_wait(&c.seq, v, Duration::from_millis(2));
            c.waiters.fetch_sub(1, Ordering::SeqCst);
            if reached(c.seq.load(Ordering::Acquire)) {
                return Ok(());
            }
            if dl.expired() {
                return Err(dl.timeout_err(self.ranks[q]));
            }
            if last_check.elapsed() >= Duration::from_millis(50) {
                last_check = Instant::now();
                if !pid_alive(self.pids[q]) {
                    return Err(CommError::PeerDied { op: dl.op, rank: self.ranks[q], pid: self.pids[q] });
                }
            }
        }
    }

    fn elems_per_chunk<T>(&self) -> usize {
        self.chunk / std::mem::size_of::<T>()
    }

    /// All-reduce of `buf`; with `gather_to = Some(r)` only local index `r` receives the result
    /// (a reduce), the others' buffers are left in an unspecified state. `Avg` sums here.
    pub(crate) fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        desc: Desc,
        gather_to: Option<usize>,
    ) -> Result<(), CommError> {
        let dl = Deadline::new(self.timeout, "all_reduce");
        let bytes = std::mem::size_of_val(buf);
        let want = gather_to.is_none_or(|r| r == self.me);
        if bytes <= SMALL_BYTES.min(self.chunk) {
            let (k, p) = self.begin(desc, &dl)?;
            self.mine::<T>(p, 0, buf.len()).copy_from_slice(buf);
            self.arrive(k);
            self.wait_all_check(k, desc, &dl)?;
            if want {
                let srcs: Vec<&[T]> = (0..self.n).map(|q| self.peer::<T>(q, p, 0, buf.len())).collect();
                T::reduce_many(buf, &srcs, op);
            }
            return Ok(());
        }
        let per = self.elems_per_chunk::<T>();
        let align = (ALIGN_ELEMS_BYTES / std::mem::size_of::<T>()).max(1);
        let n = self.n;
        let mut first = true;
        // Results of a buffer larger than the caches go straight to memory (no read for ownership).
        let streaming = bytes >= STREAM_BYTES;
        for c0 in (0..buf.len()).step_by(per) {
            let c1 = (c0 + per).min(buf.len());
            let l = c1 - c0;
            let bound = |i: usize| ((l * i / n).div_ceil(align) * align).min(l);
            let (lo, hi) = (bound(self.me), bound(self.me + 1));
            // Step A: publish the parts of this chunk the others reduce.
            let (ka, pa) = self.begin(desc, &dl)?;
            {
                let dst = self.mine::<T>(pa, 0, l);
                dst[..lo].copy_from_slice(&buf[c0..c0 + lo]);
                dst[hi..].copy_from_slice(&buf[c0 + hi..c1]);
            }
            self.arrive(ka);
            if first {
                self.wait_all_check(ka, desc, &dl)?;
                first = false;
            }
            // Step B: reduce my portion into my other buffer, publish it, gather the rest.
            let (kb, pb) = self.begin(desc, &dl)?;
            {
                let mut srcs: Vec<&[T]> = Vec::with_capacity(n);
                for q in 0..n {
                    if q == self.me {
                        srcs.push(&buf[c0 + lo..c0 + hi]);
                    } else {
                        srcs.push(self.peer::<T>(q, pa, lo, hi - lo));
                    }
                }
                let out = self.mine::<T>(pb, lo, hi - lo);
                T::reduce_many(out, &srcs, op);
            }
            self.arrive(kb);
            if want {
                copy_out(&mut buf[c0 + lo..c0 + hi], self.peer::<T>(self.me, pb, lo, hi - lo), streaming);
                for q in 0..n {
                    if q != self.me {
                        self.wait_peer(q, kb, &dl)?;
                        let (qlo, qhi) = (bound(q), bound(q + 1));
                        copy_out(&mut buf[c0 + qlo..c0 + qhi], self.peer::<T>(q, pb, qlo, qhi - qlo), streaming);
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies `buf` of local index `root` to every rank's `buf`.
    pub(crate) fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize, desc: Desc) -> Result<(), CommError> {
        let dl = Deadline::new(self.timeout, "broadcast");
        let per = self.elems_per_chunk::<T>();
        let mut c0 = 0;
        let mut first = true;
        loop {
            let c1 = (c0 + per).min(buf.len());
            let (k, p) = self.begin(desc, &dl)?;
            if self.me == root {
                self.mine::<T>(p, 0, c1 - c0).copy_from_slice(&buf[c0..c1]);
            }
            self.arrive(k);
            if first {
                self.wait_all_check(k, desc, &dl)?;
                first = false;
            }
            if self.me != root {
                self.wait_peer(root, k, &dl)?;
                buf[c0..c1].copy_from_slice(self.peer::<T>(root, p, 0, c1 - c0));
            }
            c0 = c1;
            if c0 >= buf.len() {
                return Ok(());
            }
        }
    }

    /// Concatenates every local rank's `input` into `output` in local order.
    pub(crate) fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        desc: Desc,
    ) -> Result<(), CommError> {
        let dl = Deadline::new(self.timeout, "all_gather");
        let per = self.elems_per_chunk::<T>();
        let m = input.len();
        let mut c0 = 0;
        loop {
            let c1 = (c0 + per).min(m);
            let (k, p) = self.begin(desc, &dl)?;
            self.mine::<T>(p, 0, c1 - c0).copy_from_slice(&input[c0..c1]);
            self.arrive(k);
            self.wait_all_check(k, desc, &dl)?;
            for q in 0..self.n {
                let src: &[T] = if q == self.me { &input[c0..c1] } else { self.peer::<T>(q, p, 0, c1 - c0) };
                output[q * m + c0..q * m + c1].copy_from_slice(src);
            }
            c0 = c1;
            if c0 >= m {
                return Ok(());
            }
        }
    }

    /// Reduces `input` (n blocks of `output.len()`) and leaves block `me` in `output` (`Avg` sums).
    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        desc: Desc,
    ) -> Result<(), CommError> {
        let dl = Deadline::new(self.timeout, "reduce_scatter");
        let n = self.n;
        let m = output.len();
        let per = (self.elems_per_chunk::<T>() / n).max(1);
        let mut c0 = 0;
        loop {
            let c1 = (c0 + per).min(m);
            let l = c1 - c0;
            let (k, p) = self.begin(desc, &dl)?;
            for q in 0..n {
                if q != self.me {
                    self.mine::<T>(p, q * per, l).copy_from_slice(&input[q * m + c0..q * m + c1]);
                }
            }
            self.arrive(k);
            self.wait_all_check(k, desc, &dl)?;
            let srcs: Vec<&[T]> =
                (0..n)
                    .map(|q| {
                        if q == self.me {
                            &input[q * m + c0..q * m + c1]
                        } else {
                            self.peer::<T>(q, p, self.me * per, l)
                        }
                    })
                    .collect();
            T::reduce_many(&mut output[c0..c1], &srcs, op);
            c0 = c1;
            if c0 >= m {
                return Ok(());
            }
        }
    }

    /// Returns once every local rank has arrived.
    pub(crate) fn barrier(&mut self, desc: Desc) -> Result<(), CommError> {
        let dl = Deadline::new(self.timeout, "barrier");
        let (k, _) = self.begin(desc, &dl)?;
        self.arrive(k);
        self.wait_all_check(k, desc, &dl)
    }
}

impl Drop for ShmGroup {
    fn drop(&mut self) {
        self.release_name();
        // SAFETY: unmapping the mapping this value owns; no references into it outlive `self`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// `dst = src`; with `streaming`, through non-temporal stores that bypass the caches.
fn copy_out<T: Element>(dst: &mut [T], src: &[T], streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if streaming {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let (d, s) = (super::elem::as_bytes_mut(dst), as_bytes(src));
        let head = d.as_ptr().align_offset(16).min(d.len());
        d[..head].copy_from_slice(&s[..head]);
        let body = (d.len() - head) / 16 * 16;
        let mut i = head;
        while i < head + body {
            // SAFETY: SSE2 is baseline on x86_64; `d[i..i + 16]` is in bounds and 16-byte
            // aligned (head skipped to alignment), `s[i..i + 16]` is in bounds (unaligned load).
            unsafe {
                let v = _mm_loadu_si128(s.as_ptr().add(i).cast::<__m128i>());
                _mm_stream_si128(d.as_mut_ptr().add(i).cast::<__m128i>(), v);
            }
            i += 16;
        }
        // SAFETY: a store fence orders the streaming stores before later normal stores.
        unsafe { _mm_sfence() };
        d[i..].copy_from_slice(&s[i..]);
        return;
    }
    let _ = streaming;
    dst.copy_from_slice(src);
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: FUTEX_WAIT (shared, not PRIVATE: the word lives in memory mapped by several
    // processes) on a valid, aligned u32 with a relative timeout; returns on wake, timeout,
    // value change or signal, all of which the caller handles by re-checking.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32; wakes all waiters of any process.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}

/// Whether process `pid` still runs (a zombie counts as dead).
pub(crate) fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return true;
    }
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid, 0) };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            // Field 3 (state) follows the parenthesised command name.
            let state = s.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
            !matches!(state, Some('Z') | Some('X'))
        }
        Err(_) => r == 0,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::comm::PgOptions;

    /// An in-process store: enough for one rank's bootstrap.
    #[derive(Default)]
    struct Mem(HashMap<String, Vec<u8>>);

    impl Rendezvous for Mem {
        fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
            self.0.insert(key.to_owned(), value.to_vec());
            Ok(())
        }
        fn get(&mut self, key: &str, _timeout: Duration) -> Result<Vec<u8>, CommError> {
            self.0.get(key).cloned().ok_or_else(|| CommError::Bootstrap { reason: format!("no {key}") })
        }
        fn add(&mut self, key: &str, delta: i64) -> Result<i64, CommError> {
            let v = self.0.get(key).and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok()).unwrap_or(0) + delta;
            self.0.insert(key.to_owned(), v.to_string().into_bytes());
            Ok(v)
        }
    }

    fn rlaunch_entries() -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("rlaunch"))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Local rank 0 creates the segment and waits for a rank 1 that died before attaching:
    /// during that wait (when a SIGKILL of rank 0 would leave whatever has a name) and after the
    /// bootstrap failed, nothing of it is in /dev/shm; peers reach it through rank 0's
    /// descriptor only.
    #[test]
    fn a_segment_waiting_for_a_dead_peer_has_no_name_in_dev_shm() {
        let before = rlaunch_entries();
        let mut opts = PgOptions::new(0, 2);
        opts.timeout = Duration::from_millis(1500);
        let published = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
        let seen = published.clone();
        let waiter = std::thread::spawn(move || {
            let mut store = Mem::default();
            let r = ShmGroup::new(&mut store, "t", &[0, 1], 0, &opts);
            *seen.lock().unwrap() = store.0.get("t/name").map(|v| String::from_utf8_lossy(v).into_owned());
            r.map(|_| ())
        });
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_millis(1200) {
            let new: Vec<String> = rlaunch_entries().into_iter().filter(|n| !before.contains(n)).collect();
            assert!(new.is_empty(), "a named segment exists while rank 0 waits: {new:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        let r = waiter.join().expect("no panic");
        assert!(r.is_err(), "rank 1 never attached: the bootstrap fails");
        let name = published.lock().unwrap().clone().expect("rank 0 published where to find the segment");
        assert!(name.starts_with(&format!("/proc/{}/fd/", std::process::id())), "{name}");
        // Closed: the number may name another test's file by now (tests share the process), but
        // never this segment.
        let target = std::fs::read_link(&name).map(|t| t.display().to_string()).unwrap_or_default();
        assert!(
            !target.starts_with("/memfd:rlaunch-shm"),
            "the descriptor is closed after the failure: {name} -> {target}"
        );
        let new: Vec<String> = rlaunch_entries().into_iter().filter(|n| !before.contains(n)).collect();
        assert!(new.is_empty(), "left in /dev/shm: {new:?}");
    }
}
