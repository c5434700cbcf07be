//! Snapshots held in the agents' memory: a worker hands each step's state to its node's agent
//! and gets the newest whole step back after a restart, on this node or another.
//!
//! The agent listens on a Unix socket named in [`SOCKET_ENV`] (a directory only the job's user
//! can enter). A save is two requests: `reserve` answers a memfd the agent owns, sized for the
//! part; the worker writes its bytes into it (one copy) and sends `commit`. Until `commit` the
//! agent holds nothing of that part, so a worker dying half-way leaves no half part behind; after
//! it, the part outlives the worker. `load` answers a read-only descriptor of the part the agent
//! chose for this round, the same step on every rank (or none).
//!
//! This module holds the wire (length-prefixed JSON frames, a descriptor passed with
//! `SCM_RIGHTS`), the Rust client ([`save`], [`load`], [`load_rank`]) and the Rust runtime's
//! layout of a part (named byte ranges). Python's client, `rlaunch.snapshot`, speaks the same wire
//! with its own layout; the agent never looks inside a part.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, OnceLock, PoisonError};

use serde::{Deserialize, Serialize};

/// The agent's socket, set in every worker's environment.
pub const SOCKET_ENV: &str = "RLAUNCH_SNAPSHOT";
/// The biggest frame either side accepts (requests and answers are small JSON).
pub const MAX_FRAME: usize = 64 * 1024;

/// What a worker asks its agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// A buffer of `len` bytes for `rank`'s part of `step` (in a world of `world` ranks).
    Reserve { step: u64, rank: u32, world: u32, len: u64 },
    /// The reserved part's bytes are written: the agent holds it from now on.
    Commit { step: u64, rank: u32 },
    /// The part of `rank` (the caller's own when absent) of the step this round restores.
    Load { rank: Option<u32> },
}

/// The agent's answer: `ok` with the fields of the request's kind, or an error to show.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `load`: the step restored (none: no step to restore).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// `load`: the world size the step was saved in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world: Option<u32>,
    /// `load`: the part's length (the descriptor may be longer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    /// `reserve` refused for the node's snapshot memory: the step is not snapshotted, training
    /// goes on, the last committed step stays.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub full: bool,
}

impl Answer {
    pub fn refused(why: impl Into<String>) -> Answer {
        Answer { ok: false, error: Some(why.into()), ..Answer::default() }
    }
}

/// Writes one frame (a little-endian `u32` length, then the body), with `fd` passed alongside.
pub fn send_frame(sock: &UnixStream, body: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "frame too long"));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    let mut sent = 0;
    if let Some(fd) = fd {
        sent = send_with_fd(sock, &frame, fd)?;
    }
    (&*sock).write_all(&frame[sent..])
}

/// A control buffer with room for `fds` descriptors.
fn control_buffer(fds: usize) -> Vec<u8> {
    // SAFETY: CMSG_SPACE only computes a size.
    vec![0u8; unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<libc::c_int>()) as u32) } as usize]
}

/// A message header over one buffer and a control buffer; both must outlive its use.
fn msghdr(iov: &mut libc::iovec, control: &mut [u8]) -> libc::msghdr {
    // SAFETY: msghdr is plain data; zeroed is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = control.len() as _;
    msg
}

fn send_with_fd(sock: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    let raw = fd.as_raw_fd();
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut control = control_buffer(1);
    let msg = msghdr(&mut iov, &mut control);
    // SAFETY: the control buffer has room for one header with one descriptor (CMSG_SPACE), so
    // CMSG_FIRSTHDR is non-null and CMSG_DATA points inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut libc::c_int, raw);
    }
    loop {
        // SAFETY: msg describes live buffers (above); the socket is open for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Reads one frame and the descriptor that came with it. `Ok(None)`: the peer closed the
/// connection between frames.
pub fn recv_frame(sock: &UnixStream) -> io::Result<Option<(Vec<u8>, Option<OwnedFd>)>> {
    let mut head = [0u8; 4];
    let mut got = 0;
    let mut fd: Option<OwnedFd> = None;
    while got < 4 {
        let (n, passed) = recv_with_fds(sock, &mut head[got..])?;
        for f in passed {
            // A second descriptor is never sent: close it (dropping it does).
            if fd.is_none() {
                fd = Some(f);
            }
        }
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a frame"))
            };
        }
        got += n;
    }
    let len = u32::from_le_bytes(head) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (at most {MAX_FRAME})"),
        ));
    }
    let mut body = vec![0u8; len];
    (&*sock).read_exact(&mut body)?;
    Ok(Some((body, fd)))
}

fn recv_with_fds(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
    // Room for a few descriptors: a peer sending more gets them closed, not leaked.
    let mut control = control_buffer(4);
    let mut msg = msghdr(&mut iov, &mut control);
    let n = loop {
        // SAFETY: msg describes live buffers; MSG_CMSG_CLOEXEC keeps passed descriptors from
        // leaking into the agent's children.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg's control buffer; the CMSG_* macros walk it within
    // msg_controllen, and each SCM_RIGHTS payload holds whole descriptors now owned by us.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const libc::c_int;
                let payload = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..payload / std::mem::size_of::<libc::c_int>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n, fds))
}

/// Why a snapshot could not be saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("the agent's snapshot socket {path}: {source}")]
    Connect { path: String, source: io::Error },
    #[error("talking to the agent's snapshot socket: {0}")]
    Io(#[from] io::Error),
    #[error("the agent refused: {0}")]
    Refused(String),
    /// The step this round restores was saved by a world without this rank (a scale-up).
    #[error("step {step} was saved by {world} ranks: rank {rank} has no part (read the saved ranks' parts with load_rank to reshard)")]
    NoPart { step: u64, world: u32, rank: u32 },
    #[error("{0}")]
    Full(String),
    #[error("the agent's answer: {0}")]
    Protocol(String),
    #[error("part {0}: not a snapshot of the Rust runtime's layout")]
    Layout(String),
}

/// One connection per process, opened at first use; `None`: not started by rlaunch.
fn connection() -> Result<Option<&'static Mutex<UnixStream>>, SnapshotError> {
    static CONN: OnceLock<Option<Mutex<UnixStream>>> = OnceLock::new();
    if let Some(c) = CONN.get() {
        return Ok(c.as_ref());
    }
    let Some(path) = std::env::var_os(SOCKET_ENV) else {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            eprintln!(
                "rlaunch.snapshot: not started by rlaunch ({SOCKET_ENV} unset): snapshots are neither saved nor loaded"
            );
        });
        return Ok(CONN.get_or_init(|| None).as_ref());
    };
    match UnixStream::connect(&path) {
        Ok(s) => Ok(CONN.get_or_init(|| Some(Mutex::new(s))).as_ref()),
        Err(source) => Err(SnapshotError::Connect { path: path.to_string_lossy().into_owned(), source }),
    }
}

fn call(sock: &UnixStream, req: &Request) -> Result<(Answer, Option<OwnedFd>), SnapshotError> {
    let body = serde_json::to_vec(req).map_err(|e| SnapshotError::Protocol(e.to_string()))?;
    send_frame(sock, &body, None)?;
    let (body, fd) =
        recv_frame(sock)?.ok_or_else(|| SnapshotError::Protocol("the agent closed the connection".into()))?;
    let answer: Answer = serde_json::from_slice(&body).map_err(|e| SnapshotError::Protocol(e.to_string()))?;
    if !answer.ok {
        let why = answer.error.unwrap_or_default();
        return Err(if answer.full { SnapshotError::Full(why) } else { SnapshotError::Refused(why) });
    }
    Ok((answer, fd))
}

fn env_u32(name: &str) -> Result<u32, SnapshotError> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| SnapshotError::Protocol(format!("{name} is not set to a number")))
}

const MAGIC: &[u8; 8] = b"RLSNAPRS";

/// A part in the Rust runtime's layout: `RLSNAPRS`, the header's length (`u64` LE), the header
/// (JSON: each entry's name, offset and length), then the entries' bytes.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    name: String,
    offset: u64,
    len: u64,
}

/// Hands this rank's state for `step` to the agent: named byte slices (parameters, optimizer
/// state, the sampler's position, ...). `Ok(false)`: nothing saved, because this process was not
/// started by rlaunch or because the part does not fit in the node's snapshot memory (said once;
/// the last committed step stays). When it returns `Ok(true)` the agent holds the part, whatever
/// becomes of this process. Also `Ok(false)` once this process heard that its round ended
/// (`rlaunch::resilient`), until its function runs again: that step is not the round's.
pub fn save(step: u64, entries: &[(&str, &[u8])]) -> Result<bool, SnapshotError> {
    if crate::resilient::saves_closed() {
        return Ok(false);
    }
    let Some(conn) = connection()? else { return Ok(false) };
    let (rank, world) = (env_u32(crate::env::RANK)?, env_u32(crate::env::WORLD_SIZE)?);
    let mut header = Vec::new();
    let mut offset = 0u64;
    for (name, bytes) in entries {
        header.push(Entry { name: (*name).to_owned(), offset, len: bytes.len() as u64 });
        offset += bytes.len() as u64;
    }
    let header = serde_json::to_vec(&header).map_err(|e| SnapshotError::Protocol(e.to_string()))?;
    let start = 16 + header.len() as u64;
    let len = start + offset;
    let sock = conn.lock().unwrap_or_else(PoisonError::into_inner);
    let (_, fd) = match call(&sock, &Request::Reserve { step, rank, world, len }) {
        Err(SnapshotError::Full(why)) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("rlaunch.snapshot: {why}"));
            return Ok(false);
        }
        other => other?,
    };
    let fd = fd.ok_or_else(|| SnapshotError::Protocol("no buffer came with the reservation".into()))?;
    // The buffer, mapped: the agent hands back the buffer of a step it no longer needs, whose
    // mapping is kept (by inode), so a save after the first is one copy into mapped memory.
    let mut maps = MAPS.lock().unwrap_or_else(PoisonError::into_inner);
    let map = writable_mapping(&mut maps, &fd, len as usize)?;
    drop(fd);
    let out = map.bytes_mut();
    let mut at = 0usize;
    for piece in [&MAGIC[..], &(header.len() as u64).to_le_bytes()[..], &header[..]] {
        out[at..at + piece.len()].copy_from_slice(piece);
        at += piece.len();
    }
    let mut at = start as usize;
    for (_, bytes) in entries {
        out[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    }
    drop(maps);
    call(&sock, &Request::Commit { step, rank })?;
    Ok(true)
}

/// Mappings of the buffers this process saved into, by (device, inode): at most four.
static MAPS: Mutex<Vec<((u64, u64), Mapping)>> = Mutex::new(Vec::new());

fn writable_mapping<'a>(
    maps: &'a mut Vec<((u64, u64), Mapping)>,
    fd: &OwnedFd,
    len: usize,
) -> io::Result<&'a mut Mapping> {
    let meta = std::fs::File::from(fd.try_clone()?).metadata()?;
    let id = (std::os::unix::fs::MetadataExt::dev(&meta), std::os::unix::fs::MetadataExt::ino(&meta));
    if let Some(i) = maps.iter().position(|(k, m)| *k == id && m.len == len) {
        let entry = maps.remove(i);
        maps.push(entry);
    } else {
        maps.retain(|(k, _)| *k != id);
        maps.push((id, Mapping::shared(fd, len)?));
        while maps.len() > 4 {
            maps.remove(0);
        }
    }
    Ok(&mut maps.last_mut().expect("just pushed").1)
}

/// The bytes of `values` as they lie in memory (what [`read_f32s`] reads back), without a copy.
pub fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: any f32 is 4 initialized bytes and u8 has no alignment: the same memory, read as
    // bytes, for as long as `values` is borrowed.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

/// Fills `out` from bytes written by [`f32_bytes`]; an entry of another length is an error.
pub fn read_f32s(bytes: &[u8], out: &mut [f32]) -> Result<(), SnapshotError> {
    if bytes.len() != std::mem::size_of_val(out) {
        return Err(SnapshotError::Layout(format!("an entry of {} bytes for {} values", bytes.len(), out.len())));
    }
    if cfg!(target_endian = "little") {
        // SAFETY: any 4 bytes are a valid f32 and the lengths match (checked above): the same
        // memory written as bytes, one memcpy.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(out)) };
        dst.copy_from_slice(bytes);
    } else {
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
    }
    Ok(())
}

/// A restored part: its step, the world it was saved in, and its named entries (mapped, not
/// copied).
pub struct Loaded {
    pub step: u64,
    pub world: u32,
    map: Mapping,
    entries: Vec<Entry>,
    start: usize,
}

impl Loaded {
    /// The bytes saved under `name`.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        let e = self.entries.iter().find(|e| e.name == name)?;
        let from = self.start + e.offset as usize;
        self.map.bytes().get(from..from + e.len as usize)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.name.as_str())
    }
}

/// The newest whole step this round restores, this rank's part of it; `Ok(None)` when there is
/// none (or outside rlaunch). Every rank of a round gets the same step.
pub fn load() -> Result<Option<Loaded>, SnapshotError> {
    load_part(None)
}

/// Rank `rank`'s part of the step this round restores (a program resharding to a new world
/// size reads the parts it needs).
pub fn load_rank(rank: u32) -> Result<Option<Loaded>, SnapshotError> {
    load_part(Some(rank))
}

fn load_part(rank: Option<u32>) -> Result<Option<Loaded>, SnapshotError> {
    let Some(conn) = connection()? else { return Ok(None) };
    let rank = match rank {
        Some(r) => r,
        None => env_u32(crate::env::RANK)?,
    };
    let sock = conn.lock().unwrap_or_else(PoisonError::into_inner);
    let (answer, fd) = call(&sock, &Request::Load { rank: Some(rank) })?;
    let Some(step) = answer.step else { return Ok(None) };
    let (Some(len), Some(fd)) = (answer.len, fd) else {
        return Err(SnapshotError::NoPart { step, world: answer.world.unwrap_or(0), rank });
    };
    let map = Mapping::read_only(&fd, len as usize)?;
    let bytes = map.bytes();
    let bad = || SnapshotError::Layout(format!("of rank {rank}, step {step}"));
    if bytes.len() < 16 || &bytes[..8] != MAGIC {
        return Err(bad());
    }
    let hlen = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")) as usize;
    let header = bytes.get(16..16usize.saturating_add(hlen)).ok_or_else(bad)?;
    let entries: Vec<Entry> = serde_json::from_slice(header).map_err(|_| bad())?;
    let start = 16 + hlen;
    if entries.iter().any(|e| e.offset.checked_add(e.len).is_none_or(|end| start as u64 + end > len)) {
        return Err(bad());
    }
    Ok(Some(Loaded { step, world: answer.world.unwrap_or(0), map, entries, start }))
}

/// A mapping of a descriptor, unmapped when dropped: read-only and private (a loaded part), or
/// shared and writable (a buffer being saved into, written only through `&mut`).
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is owned; it is written only through `&mut self` (bytes_mut), so moving it
// between threads is as safe as moving a Vec.
unsafe impl Send for Mapping {}
// SAFETY: shared references only read.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn shared(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Ok(Mapping { ptr: std::ptr::null_mut(), len: 0 });
        }
        let (prot, flags) = (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_POPULATE);
        // SAFETY: a fresh mapping of an open descriptor; the kernel checks the length and access.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr, len })
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: ptr maps len writable bytes (made by `shared`) for this value's life; `&mut
        // self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }

    fn read_only(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Ok(Mapping { ptr: std::ptr::null_mut(), len: 0 });
        }
        // SAFETY: a fresh mapping of an open descriptor; the kernel checks the length and access.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr maps len readable bytes for this value's life (unmapped in Drop).
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: ptr/len are the mapping made in read_only or shared, unmapped once.
            unsafe { libc::munmap(self.ptr, self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_carries_its_descriptor_and_a_closed_peer_is_no_frame() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, b"part", 0).unwrap();
        send_frame(&a, br#"{"ok":true}"#, Some(std::os::fd::AsFd::as_fd(&file))).unwrap();
        send_frame(&a, b"second", None).unwrap();
        let (body, fd) = recv_frame(&b).unwrap().unwrap();
        assert_eq!(body, br#"{"ok":true}"#);
        let mut got = String::new();
        let mut passed = std::fs::File::from(fd.expect("the descriptor came with the frame"));
        std::io::Seek::seek(&mut passed, std::io::SeekFrom::Start(0)).unwrap();
        passed.read_to_string(&mut got).unwrap();
        assert_eq!(got, "part");
        let (body, fd) = recv_frame(&b).unwrap().unwrap();
        assert_eq!((body.as_slice(), fd.is_none()), (&b"second"[..], true));
        drop(a);
        assert!(recv_frame(&b).unwrap().is_none());
    }

    #[test]
    fn a_frame_longer_than_the_bound_is_refused_before_it_is_read() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&((MAX_FRAME as u32) + 1).to_le_bytes()).unwrap();
        assert_eq!(recv_frame(&b).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn requests_read_as_the_python_client_writes_them() {
        let r: Request = serde_json::from_str(r#"{"op":"reserve","step":7,"rank":1,"world":4,"len":100}"#).unwrap();
        assert_eq!(r, Request::Reserve { step: 7, rank: 1, world: 4, len: 100 });
        let r: Request = serde_json::from_str(r#"{"op":"load","rank":null}"#).unwrap();
        assert_eq!(r, Request::Load { rank: None });
        let r: Request = serde_json::from_str(r#"{"op":"commit","step":7,"rank":1}"#).unwrap();
        assert_eq!(r, Request::Commit { step: 7, rank: 1 });
    }
}
