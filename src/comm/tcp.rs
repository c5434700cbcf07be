//! Collectives over a TCP ring: each member sends to the next and receives from the previous.
//!
//! All-reduce is a ring reduce-scatter then a ring all-gather (each member sends
//! `2 (n - 1) / n` of the data). Sending and receiving run together in one `poll(2)` loop on
//! non-blocking sockets, and received bytes are reduced as they arrive, so the reduction of a
//! segment overlaps its transfer. Broadcast relays bytes along the ring as soon as they arrive.
//! Every loop runs under the collective's deadline; a closed or reset connection is an error
//! naming the peer at the other end.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::elem::{as_bytes, as_bytes_mut, from_bytes, Element, ReduceOp};
use super::{CommError, Deadline, Desc, PgOptions, Rendezvous};

const HELLO: u32 = 0x726c_7231;
const DESC_BYTES: usize = 16;
/// Largest read at once: the reduction of received bytes runs between reads, so smaller reads
/// overlap it better with the transfer, larger ones make fewer system calls.
const READ_BYTES: usize = 1 << 18;

/// One member's two connections in the ring.
pub struct TcpRing {
    n: usize,
    me: usize,
    /// Global rank of each ring member (for error messages).
    ranks: Vec<usize>,
    next: Option<TcpStream>,
    prev: Option<TcpStream>,
    scratch: Vec<u64>,
    pub(crate) timeout: Duration,
}

fn sock_err(what: impl Into<String>, source: std::io::Error) -> CommError {
    CommError::Socket { what: what.into(), source }
}

/// The local address used to reach `master` (no packet is sent), else loopback.
fn local_ip_towards(master: Option<&str>) -> IpAddr {
    let probe = || -> std::io::Result<IpAddr> {
        let m = master.unwrap_or("127.0.0.1");
        let target = std::net::ToSocketAddrs::to_socket_addrs(&(m, 9))?
            .next()
            .ok_or_else(|| std::io::Error::new(ErrorKind::NotFound, "master address does not resolve"))?;
        let bind: SocketAddr =
            if target.is_ipv4() { "0.0.0.0:0".parse().expect("literal") } else { "[::]:0".parse().expect("literal") };
        let s = UdpSocket::bind(bind)?;
        s.connect(target)?;
        Ok(s.local_addr()?.ip())
    };
    probe().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

impl TcpRing {
    /// Connects member `me` of `ranks` (global ranks in ring order) to its neighbours.
    pub(crate) fn new(
        store: &mut dyn Rendezvous,
        ns: &str,
        ranks: &[usize],
        me: usize,
        opts: &PgOptions,
    ) -> Result<Self, CommError> {
        let n = ranks.len();
        let mut ring = TcpRing {
            n,
            me,
            ranks: ranks.to_vec(),
            next: None,
            prev: None,
            scratch: Vec::new(),
            timeout: opts.timeout,
        };
        if n == 1 {
            return Ok(ring);
        }
        let deadline = Deadline::new(opts.timeout, "tcp bootstrap");
        let ip = opts.advertise_addr.unwrap_or_else(|| local_ip_towards(opts.master_addr.as_deref()));
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| sock_err(format!("bind {ip}"), e))?;
        let addr = listener.local_addr().map_err(|e| sock_err("local address", e))?;
        store.set(&format!("{ns}/addr/{me}"), addr.to_string().as_bytes())?;
        let ni = (me + 1) % n;
        let pi = (me + n - 1) % n;
        let v = store.get(&format!("{ns}/addr/{ni}"), super::remaining(&deadline, ranks[ni])?)?;
        let next_addr: SocketAddr = std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok()).ok_or_else(|| {
            CommError::Bootstrap { reason: format!("rank {} published a malformed address", ranks[ni]) }
        })?;
        // Connect to the next member (its listener's backlog completes this before it accepts).
        let mut next = loop {
            match TcpStream::connect_timeout(&next_addr, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(_) if deadline.aborted() => return Err(deadline.timeout_err(ranks[ni])),
                Err(e) if deadline.expired() => {
                    return Err(sock_err(format!("connect to rank {} at {next_addr}", ranks[ni]), e))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let hello = [HELLO.to_le_bytes(), (me as u32).to_le_bytes()].concat();
        next.set_write_timeout(Some(opts.timeout)).map_err(|e| sock_err("timeout", e))?;
        next.write_all(&hello).map_err(|e| CommError::PeerIo { op: "tcp bootstrap", rank: ranks[ni], source: e })?;
        // Accept the previous member, ignoring anything else that connects.
        listener.set_nonblocking(true).map_err(|e| sock_err("listener", e))?;
        let prev = loop {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).map_err(|e| sock_err("accepted socket", e))?;
                    s.set_read_timeout(Some(super::remaining(&deadline, ranks[pi])?))
                        .map_err(|e| sock_err("timeout", e))?;
                    let mut b = [0u8; 8];
                    if s.read_exact(&mut b).is_ok()
                        && b[..4] == HELLO.to_le_bytes()
                        && u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize == pi
                    {
                        break s;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if deadline.expired() {
                        return Err(deadline.timeout_err(ranks[pi]));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(sock_err("accept", e)),
            }
        };
        for s in [&next, &prev] {
            s.set_nodelay(true).map_err(|e| sock_err("nodelay", e))?;
            s.set_nonblocking(true).map_err(|e| sock_err("nonblocking", e))?;
        }
        ring.next = Some(next);
        ring.prev = Some(prev);
        Ok(ring)
    }

    fn next_rank(&self) -> usize {
        self.ranks[(self.me + 1) % self.n]
    }
    fn prev_rank(&self) -> usize {
        self.ranks[(self.me + self.n - 1) % self.n]
    }

    /// Sends `send` to the next member while receiving `recv.len()` bytes from the previous
    /// into `recv`, calling `progress(received_so_far)` after each read.
    fn exchange(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dl: &Deadline,
        mut progress: impl FnMut(&[u8], usize),
    ) -> Result<(), CommError> {
        let (nr, pr) = (self.next_rank(), self.prev_rank());
        let next = self.next.as_mut().expect("ring of more than one has sockets");
        let prev = self.prev.as_mut().expect("ring of more than one has sockets");
        let (mut sent, mut got) = (0usize, 0usize);
        while sent < send.len() || got < recv.len() {
            let mut moved = false;
            if sent < send.len() {
                let k = write_some(next, &send[sent..], dl.op, nr)?;
                sent += k;
                moved |= k > 0;
            }
            if got < recv.len() {
                let end = (got + READ_BYTES).min(recv.len());
                let k = read_some(prev, &mut recv[got..end], dl.op, pr)?;
                if k > 0 {
                    got += k;
                    moved = true;
                    progress(recv, got);
                }
            }
            if !moved {
                let waiting_on = if got < recv.len() { pr } else { nr };
                poll_two(next.as_raw_fd(), sent < send.len(), prev.as_raw_fd(), got < recv.len(), dl, waiting_on)?;
            }
        }
        Ok(())
    }

    fn check_header(&mut self, desc: Desc, dl: &Deadline) -> Result<(), CommError> {
        let w = desc.to_words();
        let mut out = [0u8; DESC_BYTES];
        out[..8].copy_from_slice(&w[0].to_le_bytes());
        out[8..].copy_from_slice(&w[1].to_le_bytes());
        let mut inb = [0u8; DESC_BYTES];
        self.exchange(&out, &mut inb, dl, |_, _| {})?;
        let theirs = Desc::from_words([
            u64::from_le_bytes(inb[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(inb[8..].try_into().expect("8 bytes")),
        ]);
        if theirs != desc {
            return Err(CommError::Mismatch {
                me: self.ranks[self.me],
                rank: self.prev_rank(),
                mine: desc.describe(),
                theirs: theirs.describe(),
            });
        }
        Ok(())
    }

    fn scratch_bytes(&mut self, bytes: usize) -> Vec<u64> {
        let mut s = std::mem::take(&mut self.scratch);
        if s.len() * 8 < bytes {
            s.resize(bytes.div_ceil(8), 0);
        }
        s
    }

    /// Ring reduce-scatter over `segs` (element ranges); member `me` ends owning segment
    /// `me + 1 + shift` (mod n).
    fn reduce_scatter_phase<T: Element>(
        &mut self,
        data: &mut [T],
        segs: &[(usize, usize)],
        shift: usize,
        op: ReduceOp,
        dl: &Deadline,
    ) -> Result<(), CommError> {
        let n = self.n;
        let size = std::mem::size_of::<T>();
        let max_seg = segs.iter().map(|s| s.1 - s.0).max().unwrap_or(0);
        let mut scratch = self.scratch_bytes(max_seg * size);
        let mut res = Ok(());
        for t in 0..n - 1 {
            let si = (self.me + n * 2 + shift - t) % n;
            let ri = (self.me + n * 2 + shift - t - 1) % n;
            let (send, dst) = split_pair(data, segs[si], segs[ri]);
            let rlen = std::mem::size_of_val(dst);
            let sbytes = as_bytes(send);
            // SAFETY: viewing the u64 scratch as bytes; u64 has no padding and any bytes are valid.
            let sc: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr().cast::<u8>(), rlen) };
            let mut done = 0usize;
            res = self.exchange(sbytes, sc, dl, |buf, got| {
                let upto = got / size;
                if upto > done {
                    let src: &[T] = from_bytes(&buf[done * size..upto * size]);
                    T::reduce_into(&mut dst[done..upto], src, op);
                    done = upto;
                }
            });
            if res.is_err() {
                break;
            }
        }
        self.scratch = scratch;
        res
    }

    /// Ring all-gather over `segs`; member `me` starts owning segment `me + 1 + shift`.
    fn all_gather_phase<T: Element>(
        &mut self,
        data: &mut [T],
        segs: &[(usize, usize)],
        shift: usize,
        dl: &Deadline,
    ) -> Result<(), CommError> {
        let n = self.n;
        for t in 0..n - 1 {
            let si = (self.me + 1 + shift + n * 2 - t) % n;
            let ri = (self.me + shift + n * 2 - t) % n;
            let (send, dst) = split_pair(data, segs[si], segs[ri]);
            let sb = as_bytes(send);
            self.exchange(sb, as_bytes_mut(dst), dl, |_, _| {})?;
        }
        Ok(())
    }

    pub(crate) fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp, desc: Desc) -> Result<(), CommError> {
        if self.n == 1 {
            return Ok(());
        }
        let dl = Deadline::new(self.timeout, "all_reduce");
        self.check_header(desc, &dl)?;
        let n = self.n;
        let l = buf.len();
        let segs: Vec<(usize, usize)> = (0..n).map(|i| (l * i / n, l * (i + 1) / n)).collect();
        self.reduce_scatter_phase(buf, &segs, 0, op, &dl)?;
        self.all_gather_phase(buf, &segs, 0, &dl)
    }

    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        desc: Desc,
    ) -> Result<(), CommError> {
        let m = output.len();
        if self.n == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let dl = Deadline::new(self.timeout, "reduce_scatter");
        self.check_header(desc, &dl)?;
        let n = self.n;
        let mut work = input.to_vec();
        let segs: Vec<(usize, usize)> = (0..n).map(|i| (i * m, (i + 1) * m)).collect();
        // shift n - 1: member `me` ends owning segment `me`.
        self.reduce_scatter_phase(&mut work, &segs, n - 1, op, &dl)?;
        output.copy_from_slice(&work[self.me * m..(self.me + 1) * m]);
        Ok(())
    }

    pub(crate) fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        desc: Desc,
    ) -> Result<(), CommError> {
        let m = input.len();
        output[self.me * m..(self.me + 1) * m].copy_from_slice(input);
        let spans: Vec<(usize, usize)> = (0..self.n).map(|i| (i * m, m)).collect();
        self.all_gather_spans(output, &spans, desc)
    }

    /// All-gather where member `i` contributes `output[spans[i].0 ..][.. spans[i].1]`, already
    /// in place on member `i`.
    pub(crate) fn all_gather_spans<T: Element>(
        &mut self,
        output: &mut [T],
        spans: &[(usize, usize)],
        desc: Desc,
    ) -> Result<(), CommError> {
        if self.n == 1 {
            return Ok(());
        }
        let dl = Deadline::new(self.timeout, "all_gather");
        self.check_header(desc, &dl)?;
        let segs: Vec<(usize, usize)> = spans.iter().map(|&(o, l)| (o, o + l)).collect();
        // shift n - 1: member `me` starts owning segment `me`.
        self.all_gather_phase(output, &segs, self.n - 1, &dl)
    }

    /// Member `root` sends `buf` around the ring; each member forwards bytes as they arrive.
    pub(crate) fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize, desc: Desc) -> Result<(), CommError> {
        if self.n == 1 {
            return Ok(());
        }
        let dl = Deadline::new(self.timeout, "broadcast");
        self.check_header(desc, &dl)?;
        let n = self.n;
        let forward = (self.me + 1) % n != root;
        let receive = self.me != root;
        let (nr, pr) = (self.next_rank(), self.prev_rank());
        let bytes = as_bytes_mut(buf);
        let total = bytes.len();
        let next = self.next.as_mut().expect("ring of more than one has sockets");
        let prev = self.prev.as_mut().expect("ring of more than one has sockets");
        let mut got = if receive { 0 } else { total };
        let mut sent = if forward { 0 } else { total };
        while got < total || sent < total {
            let mut moved = false;
            if sent < got {
                let k = write_some(next, &bytes[sent..got], dl.op, nr)?;
                sent += k;
                moved |= k > 0;
            }
            if got < total {
                let end = (got + READ_BYTES).min(total);
                let k = read_some(prev, &mut bytes[got..end], dl.op, pr)?;
                got += k;
                moved |= k > 0;
            }
            if !moved {
                let waiting_on = if got < total { pr } else { nr };
                poll_two(next.as_raw_fd(), sent < got, prev.as_raw_fd(), got < total, &dl, waiting_on)?;
            }
        }
        Ok(())
    }
}

/// One non-blocking write to the ring neighbour `rank`: the bytes written, 0 when the socket
/// would block.
fn write_some(sock: &mut TcpStream, buf: &[u8], op: &'static str, rank: usize) -> Result<usize, CommError> {
    match sock.write(buf) {
        Ok(0) => Err(CommError::PeerIo { op, rank, source: ErrorKind::WriteZero.into() }),
        Ok(k) => Ok(k),
        Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(CommError::PeerIo { op, rank, source: e }),
    }
}

/// One non-blocking read from the ring neighbour `rank`: the bytes read, 0 when nothing is
/// there yet; the peer closing the connection is an error naming it.
fn read_some(sock: &mut TcpStream, buf: &mut [u8], op: &'static str, rank: usize) -> Result<usize, CommError> {
    match sock.read(buf) {
        Ok(0) => Err(CommError::PeerIo {
            op,
            rank,
            source: std::io::Error::new(ErrorKind::UnexpectedEof, "connection closed"),
        }),
        Ok(k) => Ok(k),
        Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(CommError::PeerIo { op, rank, source: e }),
    }
}

/// Disjoint views: `a` to read, `b` to write (element ranges `(start, end)`).
fn split_pair<T>(data: &mut [T], a: (usize, usize), b: (usize, usize)) -> (&[T], &mut [T]) {
    if a.0 == a.1 {
        return (&[], &mut data[b.0..b.1]);
    }
    if b.0 == b.1 {
        return (&data[a.0..a.1], &mut []);
    }
    if a.0 < b.0 {
        assert!(a.1 <= b.0, "ring segments are disjoint");
        let (x, y) = data.split_at_mut(b.0);
        (&x[a.0..a.1], &mut y[..b.1 - b.0])
    } else {
        assert!(b.1 <= a.0, "ring segments are disjoint");
        let (x, y) = data.split_at_mut(a.0);
        (&y[..a.1 - a.0], &mut x[b.0..b.1])
    }
}

/// Waits until `wfd` is writable (if `want_w`) or `rfd` readable (if `want_r`), or errors.
fn poll_two(wfd: i32, want_w: bool, rfd: i32, want_r: bool, dl: &Deadline, waiting_on: usize) -> Result<(), CommError> {
    let left = dl.at.saturating_duration_since(Instant::now());
    if left.is_zero() || dl.aborted() {
        return Err(dl.timeout_err(waiting_on));
    }
    let mut fds = [
        libc::pollfd { fd: if want_w { wfd } else { -1 }, events: libc::POLLOUT, revents: 0 },
        libc::pollfd { fd: if want_r { rfd } else { -1 }, events: libc::POLLIN, revents: 0 },
    ];
    let ms = left.as_millis().clamp(1, 100) as i32;
    // SAFETY: poll(2) on two pollfd entries we own; negative fds are ignored by the kernel.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != ErrorKind::Interrupted {
            return Err(sock_err("poll", e));
        }
    }
    Ok(())
}
