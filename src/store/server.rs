//! The TCPStore-compatible server: one tokio task per connection over a shared `StoreState`.
//!
//! Each connection has a reader task that decodes frames (under `Limits` and a stall deadline)
//! and a serving task that applies them and writes replies in order, interleaving the
//! `STOP_WAITING` of waits released by other clients. A connection that misbehaves is closed
//! with a `warn!`; nothing it stored is dropped, and its pending waits are removed.
//!
//! Idle connections cannot exhaust the server: a connection must send its first frame (the
//! validation every torch and rlaunch client sends at once) within
//! [`ServerConfig::first_frame_timeout`]; at most [`ServerConfig::max_unvalidated`] such
//! connections are kept (a new one evicts the oldest), and at most
//! [`ServerConfig::max_connections`] in all (derived from the open-file limit). A validated
//! client may stay idle, or block in a `wait`, for as long as it likes. Running out of
//! descriptors on accept evicts the oldest unvalidated connection and backs off; it never ends
//! the server. The admission decision is [`admit`], a pure function.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tracing::{debug, error, warn};

use super::protocol::{
    put_bytes, FrameReader, Limits, ProtocolError, Request, CHECK_NOT_READY, CHECK_READY, VALIDATION_MAGIC,
    WAIT_CANCELED, WAIT_STOP_WAITING,
};
use super::state::{ConnId, StateError, StoreState, WaitOutcome, WaiterId, Wake};

/// Tunables of a store server. `Default` suits production; tests shorten the deadlines.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Request size limits.
    pub limits: Limits,
    /// Once a frame has started, or a reply is being written, each read or write must make
    /// progress within this time, else the connection is closed (default 30 s).
    pub stall_timeout: Duration,
    /// Most waits one connection may have pending at once (torch clients have at most one).
    pub max_pending_waits: usize,
    /// Bytes of keys and values the store holds at most: a write that would pass it closes
    /// that client's connection (the TCPStore protocol has no error reply; torch's client
    /// raises on the closed connection), and leaves the store and its keys as they were.
    pub max_total_bytes: usize,
    /// A connection that has not sent a complete first frame within this time is closed
    /// (default [`FIRST_FRAME_TIMEOUT`]).
    pub first_frame_timeout: Duration,
    /// Connections kept open at most; `0`: derived from the open-file limit when serving
    /// starts ([`default_max_connections`]).
    pub max_connections: usize,
    /// Connections not yet validated kept at most (default [`MAX_UNVALIDATED`]); a new one
    /// past it evicts the oldest of them.
    pub max_unvalidated: usize,
}

/// The default of [`ServerConfig::first_frame_timeout`]: torch's and rlaunch's clients send
/// their validation right after connecting, so 10 s is ample on any network.
pub const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// The default of [`ServerConfig::max_unvalidated`].
pub const MAX_UNVALIDATED: usize = 1024;

/// The most connections one server keeps whatever the open-file limit: four per rank of a
/// 16,384-rank job.
pub const MAX_CONNECTIONS_CEILING: usize = 65_536;

/// [`ServerConfig::max_connections`] when it is `0`: a quarter of the soft open-file limit (an
/// agent serves two stores, its probe endpoint and its workers' pipes and logs), less 64, at
/// least 16, at most [`MAX_CONNECTIONS_CEILING`].
pub fn default_max_connections() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct passed.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    };
    (soft / 4).saturating_sub(64).clamp(16, MAX_CONNECTIONS_CEILING)
}

/// What to do with a connection just accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Serve it.
    Admit,
    /// Serve it and close the oldest connection that has not validated yet.
    AdmitEvictingOldest,
    /// Close it: the server is full of validated clients.
    Refuse,
}

/// Whether a new connection is served, given `open` connections of which `unvalidated` have not
/// sent their validation yet. Pure. A new connection is always preferred to the oldest
/// unvalidated one (a real client validates within a round trip; an idle one never does), and
/// validated clients are never evicted.
pub fn admit(open: usize, unvalidated: usize, max_connections: usize, max_unvalidated: usize) -> Admission {
    let full = open >= max_connections;
    if !full && unvalidated < max_unvalidated {
        Admission::Admit
    } else if unvalidated > 0 {
        Admission::AdmitEvictingOldest
    } else {
        Admission::Refuse
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            stall_timeout: Duration::from_secs(30),
            max_pending_waits: 1024,
            max_total_bytes: DEFAULT_MAX_TOTAL_BYTES,
            first_frame_timeout: FIRST_FRAME_TIMEOUT,
            max_connections: 0,
            max_unvalidated: MAX_UNVALIDATED,
        }
    }
}

/// The default of [`ServerConfig::max_total_bytes`]: 1 GiB, far above what bootstrapping
/// any job stores.
pub const DEFAULT_MAX_TOTAL_BYTES: usize = 1 << 30;

/// A key-value store speaking PyTorch's `TCPStore` protocol.
pub struct StoreServer {
    _private: (),
}

/// A running server started by [`StoreServer::start`]. Dropping it stops the server.
pub struct StoreHandle {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    /// Resolves with the serving loop's result once it has ended.
    done: Option<oneshot::Receiver<io::Result<()>>>,
}

impl StoreHandle {
    /// The address the server listens on (with the port the OS picked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Number of keys stored (queues excluded), read in-process.
    pub fn num_keys(&self) -> i64 {
        self.shared.lock().state.num_keys()
    }

    /// Removes every key and queue (returns how many keys), keeping the port, the connections
    /// and pending waits. torch 2.x workers assume a fresh store per restart attempt (their
    /// keys, e.g. gloo's `/default_pg/0//cpu//0/<rank>`, carry no attempt prefix), so an agent
    /// that keeps one store across restarts must clear it before the next attempt's workers.
    pub fn clear(&self) -> usize {
        self.shared.lock().state.clear()
    }

    /// Number of waits (and barriers) clients have pending.
    pub fn pending_waits(&self) -> usize {
        self.shared.lock().state.pending_waits()
    }

    /// Number of client connections open.
    pub fn connections(&self) -> usize {
        self.shared.lock().wakers.len()
    }

    /// Stops accepting, closes every connection and waits for the server task to end.
    pub async fn shutdown(mut self) -> io::Result<()> {
        drop(self.stop.take());
        match self.done.take() {
            Some(done) => done
                .await
                .unwrap_or_else(|_| Err(io::Error::other("store server task ended without a result (panic?)"))),
            None => Ok(()),
        }
    }
}

impl Drop for StoreHandle {
    fn drop(&mut self) {
        // Dropping the sender resolves the server's shutdown future.
        drop(self.stop.take());
    }
}

impl StoreServer {
    /// Serves on an already-bound listener until `shutdown` resolves.
    pub async fn serve(listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> io::Result<()> {
        Self::serve_with_config(listener, ServerConfig::default(), shutdown).await
    }

    /// Binds `addr` (port 0 = OS picks), spawns serving on the current tokio runtime, returns a
    /// handle.
    pub async fn start(addr: SocketAddr) -> io::Result<StoreHandle> {
        Self::start_with_config(addr, ServerConfig::default()).await
    }

    /// [`StoreServer::start`] with explicit tunables.
    pub async fn start_with_config(addr: SocketAddr, config: ServerConfig) -> io::Result<StoreHandle> {
        let listener = bind(addr)?;
        let (handle, serving) = prepare(listener, config)?;
        tokio::spawn(serving);
        Ok(handle)
    }

    /// Binds `addr` and serves on a thread of its own with a single-threaded runtime, apart from
    /// the caller's runtime (callable from sync code too). Waits released by another client's
    /// change are then answered without waking a second worker thread, which keeps wake-up tail
    /// latency low on busy machines (see bench/store/RESULTS.md).
    pub fn start_dedicated(addr: SocketAddr, config: ServerConfig) -> io::Result<StoreHandle> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let listener = {
            let _entered = rt.enter();
            bind(addr)?
        };
        let (handle, serving) = prepare(listener, config)?;
        std::thread::Builder::new().name("rlaunch-store".into()).spawn(move || rt.block_on(serving))?;
        Ok(handle)
    }

    /// [`StoreServer::serve`] with explicit tunables.
    pub async fn serve_with_config(
        listener: TcpListener,
        config: ServerConfig,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> io::Result<()> {
        serve_shared(listener, config, Arc::new(Shared::default()), shutdown).await
    }
}

/// A handle and the future that serves until the handle is shut down or dropped.
fn prepare(
    listener: TcpListener,
    config: ServerConfig,
) -> io::Result<(StoreHandle, impl Future<Output = ()> + Send + 'static)> {
    let local_addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let (done_tx, done) = oneshot::channel();
    let shared = Arc::new(Shared::default());
    let serving = serve_shared(listener, config, shared.clone(), async move {
        let _ = stopped.await;
    });
    let serving = async move {
        let _ = done_tx.send(serving.await);
    };
    let handle = StoreHandle { local_addr, shared, stop: Some(stop), done: Some(done) };
    Ok((handle, serving))
}

/// How many connections may wait to be accepted: every worker of a 16,384-rank job connects at
/// once (std's 128 overflows, and Linux then resets handshakes the clients must retry; torch's
/// server listens with 4096). The kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` (address reuse on, as torch's server) with [`LISTEN_BACKLOG`]; needs a runtime
/// context. The rendezvous service listens the same way (10,000 agents connect at once).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

async fn serve_shared(
    listener: TcpListener,
    config: ServerConfig,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let mut config = config;
    if config.max_connections == 0 {
        config.max_connections = default_max_connections();
    }
    let config = Arc::new(config);
    let mut conns = JoinSet::new();
    let mut next_conn: ConnId = 0;
    let mut backoff = ACCEPT_BACKOFF_MIN;
    let mut complaints = Complaints::default();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    let conn = next_conn;
                    next_conn += 1;
                    let Some(registered) = shared.register(conn, &config) else {
                        complaints.note(&mut || warn!(%peer, max_connections = config.max_connections, "store: full of validated clients; refusing a connection"));
                        continue;
                    };
                    if let Err(err) = stream.set_nodelay(true) {
                        debug!(%peer, error = %err, "store: cannot set TCP_NODELAY");
                    }
                    conns.spawn(serve_connection(shared.clone(), config.clone(), stream, peer, conn, registered));
                }
                Err(err) => {
                    // Out of descriptors or an aborted handshake: keep serving the others. Out
                    // of descriptors, the oldest connection that never validated goes, and the
                    // next accept waits a little longer (up to a second).
                    let out_of_files = matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if out_of_files {
                        shared.evict_oldest_unvalidated();
                    }
                    complaints.note(&mut || warn!(error = %err, "store: accept failed"));
                    tokio::time::sleep(backoff).await;
                    if out_of_files {
                        backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                    }
                }
            },
            Some(joined) = conns.join_next(), if !conns.is_empty() => {
                if let Err(err) = joined {
                    if err.is_panic() {
                        error!(error = %err, "store: connection task panicked");
                    }
                }
            }
        }
    }
    conns.shutdown().await;
    Ok(())
}

/// The first pause after a failed accept, doubled while descriptors stay out, up to the max.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(50);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Logs the first of a kind of trouble, then at most one line (with the count) per 10 s.
#[derive(Default)]
struct Complaints {
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl Complaints {
    fn note(&mut self, log: &mut dyn FnMut()) {
        let now = std::time::Instant::now();
        if self.last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(10)) {
            self.suppressed += 1;
            return;
        }
        if self.suppressed > 0 {
            warn!(suppressed = self.suppressed, "store: more of the same in the last 10 s");
        }
        self.suppressed = 0;
        self.last = Some(now);
        log();
    }
}

/// What a served connection receives when it is registered.
struct Registered {
    wake_rx: mpsc::UnboundedReceiver<WaiterId>,
    /// Fires when the connection is evicted before it validated.
    evicted: oneshot::Receiver<()>,
}

#[derive(Default)]
struct Shared {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    state: StoreState,
    /// Where to deliver the wakes of each live connection.
    wakers: HashMap<ConnId, mpsc::UnboundedSender<WaiterId>>,
    /// Connections not validated yet, oldest first, with what evicts each.
    unvalidated: BTreeMap<ConnId, oneshot::Sender<()>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave `StoreState` half-updated in a way that
        // loses values (each operation is a few map updates), so keep serving.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Shared {
    /// Admits connection `conn` ([`admit`]) and registers it, or `None` when it is refused.
    fn register(&self, conn: ConnId, config: &ServerConfig) -> Option<Registered> {
        let mut inner = self.lock();
        match admit(inner.wakers.len(), inner.unvalidated.len(), config.max_connections, config.max_unvalidated) {
            Admission::Refuse => return None,
            Admission::AdmitEvictingOldest => inner.evict_oldest_unvalidated(),
            Admission::Admit => {}
        }
        let (wake_tx, wake_rx) = mpsc::unbounded_channel();
        let (evict, evicted) = oneshot::channel();
        inner.wakers.insert(conn, wake_tx);
        inner.unvalidated.insert(conn, evict);
        Some(Registered { wake_rx, evicted })
    }

    fn evict_oldest_unvalidated(&self) {
        self.lock().evict_oldest_unvalidated();
    }
}

impl Inner {
    fn evict_oldest_unvalidated(&mut self) {
        if let Some((_, evict)) = self.unvalidated.pop_first() {
            let _ = evict.send(());
        }
    }

    fn deliver(&self, wakes: Vec<Wake>) {
        for wake in wakes {
            if let Some(tx) = self.wakers.get(&wake.conn) {
                // The receiver lives as long as the connection is registered here.
                let _ = tx.send(wake.waiter);
            }
        }
    }
}

/// Unregisters a connection and drops its waits however its task ends (even by abort).
struct ConnGuard {
    shared: Arc<Shared>,
    conn: ConnId,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let mut inner = self.shared.lock();
        inner.wakers.remove(&self.conn);
        inner.unvalidated.remove(&self.conn);
        inner.state.cancel_waits(self.conn);
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum Close {
    #[error("client closed the connection")]
    Eof,
    #[error("bad request")]
    Protocol(#[source] ProtocolError),
    #[error("first request was {query}, not validate")]
    NotValidated { query: &'static str },
    #[error("wrong validation magic {magic:#x}")]
    BadMagic { magic: u32 },
    #[error("request cannot be applied")]
    State(#[source] StateError),
    #[error("more than {limit} waits pending on one connection")]
    TooManyWaits { limit: usize },
    #[error("the store is full: this write would pass its {limit} bytes")]
    StoreFull { limit: usize },
    #[error("writing a reply failed")]
    Write(#[source] io::Error),
    #[error("client read no reply bytes for {0:?}")]
    WriteStalled(Duration),
    #[error("no complete first frame within {0:?}")]
    NoFirstFrame(Duration),
    #[error("evicted before validating: newer connections wanted its place")]
    Evicted,
}

async fn serve_connection(
    shared: Arc<Shared>,
    config: Arc<ServerConfig>,
    stream: TcpStream,
    peer: SocketAddr,
    conn: ConnId,
    registered: Registered,
) {
    let (read_half, write_half) = stream.into_split();
    let Registered { wake_rx, evicted } = registered;
    let _guard = ConnGuard { shared: shared.clone(), conn };

    // One task per connection: the frame being read stays alive (pinned) while released waits
    // are answered, so no reader task or channel hop sits on the request path, and a client that
    // never reads its replies is throttled by TCP, not buffered here.
    // 8 KiB per connection: 16,384 idle workers must not cost a gigabyte (a larger value is
    // read straight into its frame, past the buffer).
    let mut frames =
        FrameReader::new(BufReader::with_capacity(8 * 1024, read_half), config.limits, Some(config.stall_timeout));
    let first_frame_by = tokio::time::Instant::now() + config.first_frame_timeout;
    let mut session = Session {
        shared,
        config,
        conn,
        out: write_half,
        wake_rx,
        pending: 0,
        validated: false,
        first_frame_by,
        evicted: Some(evicted),
    };
    match session.run(&mut frames).await {
        Close::Eof => debug!(%peer, conn, "store: client disconnected"),
        // Idle connections: expected under a flood, not worth a line each.
        close @ (Close::NoFirstFrame(_) | Close::Evicted) => {
            debug!(%peer, conn, reason = %close, "store: closing connection")
        }
        close => {
            let source = std::error::Error::source(&close).map(|s| s.to_string());
            warn!(%peer, conn, reason = %close, source, "store: closing connection");
        }
    }
}

struct Session<W> {
    shared: Arc<Shared>,
    config: Arc<ServerConfig>,
    conn: ConnId,
    out: W,
    wake_rx: mpsc::UnboundedReceiver<WaiterId>,
    pending: usize,
    validated: bool,
    /// Until validated: when the first frame must be complete, and what evicts the connection.
    first_frame_by: tokio::time::Instant,
    evicted: Option<oneshot::Receiver<()>>,
}

/// A reply being assembled: small fields are copied, big values are written from the store's
/// shared buffer without a copy.
#[derive(Default)]
struct Reply {
    parts: Vec<Part>,
}

enum Part {
    Bytes(Vec<u8>),
    Shared(Arc<Vec<u8>>),
}

const INLINE_VALUE: usize = 16 * 1024;
/// Big values are written at most this much per write, each under the stall deadline.
const WRITE_CHUNK: usize = 1 << 20;
/// Most slices in one vectored write (well under any IOV_MAX).
const MAX_IOV: usize = 64;

impl Reply {
    fn tail(&mut self) -> &mut Vec<u8> {
        if !matches!(self.parts.last(), Some(Part::Bytes(_))) {
            self.parts.push(Part::Bytes(Vec::new()));
        }
        match self.parts.last_mut() {
            Some(Part::Bytes(buf)) => buf,
            _ => unreachable!("a Bytes part was just pushed"),
        }
    }
    fn u8(mut self, v: u8) -> Self {
        self.tail().push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.tail().extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.tail().extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, v: &[u8]) -> Self {
        put_bytes(self.tail(), v);
        self
    }
    fn value(mut self, v: Arc<Vec<u8>>) -> Self {
        if v.len() <= INLINE_VALUE {
            return self.bytes(&v);
        }
        self.tail().extend_from_slice(&(v.len() as u64).to_le_bytes());
        self.parts.push(Part::Shared(v));
        self
    }
}

impl<W: AsyncWrite + Unpin> Session<W> {
    async fn run<R: AsyncRead + Unpin>(&mut self, frames: &mut FrameReader<R>) -> Close {
        loop {
            let next = {
                let read = frames.next_request();
                tokio::pin!(read);
                loop {
                    let waiting_first = !self.validated;
                    tokio::select! {
                        biased;
                        _ = tokio::time::sleep_until(self.first_frame_by), if waiting_first => {
                            return Close::NoFirstFrame(self.config.first_frame_timeout);
                        }
                        evicted = async { self.evicted.as_mut().expect("set until validated").await }, if waiting_first && self.evicted.is_some() => {
                            match evicted {
                                Ok(()) => return Close::Evicted,
                                // Unregistered (validated meanwhile): nothing evicts it any more.
                                Err(_) => self.evicted = None,
                            }
                        }
                        Some(_) = self.wake_rx.recv() => {
                            self.pending = self.pending.saturating_sub(1);
                            if let Err(close) = self.send(Reply::default().u8(WAIT_STOP_WAITING)).await {
                                return close;
                            }
                        }
                        next = &mut read => break next,
                    }
                }
            };
            let result = match next {
                Ok(None) => return Close::Eof,
                Err(err) => return Close::Protocol(err),
                Ok(Some(request)) => self.handle(request).await,
            };
            if let Err(close) = result {
                return close;
            }
        }
    }

    /// Writes every part of `reply` with vectored writes (a length prefix and a shared value
    /// leave in one syscall), each write making progress within the stall deadline.
    async fn send(&mut self, reply: Reply) -> Result<(), Close> {
        let stall = self.config.stall_timeout;
        let mut parts: Vec<&[u8]> = reply
            .parts
            .iter()
            .map(|part| match part {
                Part::Bytes(b) => b.as_slice(),
                Part::Shared(b) => b.as_slice(),
            })
            .filter(|b| !b.is_empty())
            .collect();
        let mut first = 0;
        while first < parts.len() {
            let slices: Vec<IoSlice<'_>> =
                parts[first..].iter().take(MAX_IOV).map(|b| IoSlice::new(&b[..b.len().min(WRITE_CHUNK)])).collect();
            let mut written = tokio::time::timeout(stall, self.out.write_vectored(&slices))
                .await
                .map_err(|_| Close::WriteStalled(stall))?
                .map_err(Close::Write)?;
            if written == 0 {
                return Err(Close::Write(io::ErrorKind::WriteZero.into()));
            }
            while written > 0 {
                let head = parts[first];
                if written >= head.len() {
                    written -= head.len();
                    first += 1;
                } else {
                    parts[first] = &head[written..];
                    written = 0;
                }
            }
        }
        Ok(())
    }

    fn register_wait(&mut self, outcome: WaitOutcome) -> Result<Option<Reply>, Close> {
        match outcome {
            WaitOutcome::Ready => Ok(Some(Reply::default().u8(WAIT_STOP_WAITING))),
            WaitOutcome::Registered(_) => {
                self.pending += 1;
                if self.pending > self.config.max_pending_waits {
                    return Err(Close::TooManyWaits { limit: self.config.max_pending_waits });
                }
                Ok(None)
            }
        }
    }

    async fn handle(&mut self, request: Request) -> Result<(), Close> {
        if !self.validated {
            return match request {
                Request::Validate { magic } if magic == VALIDATION_MAGIC => {
                    self.validated = true;
                    self.evicted = None;
                    self.shared.lock().unvalidated.remove(&self.conn);
                    Ok(())
                }
                Request::Validate { magic } => Err(Close::BadMagic { magic }),
                other => Err(Close::NotValidated { query: other.name() }),
            };
        }
        let conn = self.conn;
        let shared = self.shared.clone();
        let reply = {
            let mut inner = shared.lock();
            let growth = match &request {
                Request::Set { key, value } => inner.state.growth_of_set(key, value.len()),
                Request::CompareSet { key, desired, .. } => inner.state.growth_of_set(key, desired.len()),
                // A decimal i64 is at most 20 bytes.
                Request::Add { key, .. } | Request::Barrier { key, .. } => inner.state.growth_of_set(key, 20),
                Request::Append { key, value } => inner.state.growth_of_append(key, value.len()),
                Request::QueuePush { key, value } => inner.state.growth_of_push(key, value.len()),
                // A key set twice in one request is charged twice: an upper bound.
                Request::MultiSet { kvs } => kvs.iter().map(|(k, v)| inner.state.growth_of_set(k, v.len())).sum(),
                _ => 0,
            };
            if growth > 0 && inner.state.bytes().saturating_add(growth) > self.config.max_total_bytes {
                return Err(Close::StoreFull { limit: self.config.max_total_bytes });
            }
            match request {
                Request::Validate { magic } => {
                    if magic != VALIDATION_MAGIC {
                        return Err(Close::BadMagic { magic });
                    }
                    None
                }
                Request::Ping { nonce } => Some(Reply::default().u32(nonce)),
                Request::Set { key, value } => {
                    let wakes = inner.state.set(key, value);
                    inner.deliver(wakes);
                    None
                }
                Request::CompareSet { key, expected, desired } => {
                    let (current, wakes) = inner.state.compare_set(key, expected, desired);
                    inner.deliver(wakes);
                    Some(Reply::default().value(current))
                }
                Request::Get { key } => Some(Reply::default().value(inner.state.get(&key).unwrap_or_default())),
                Request::Add { key, delta } => {
                    let (sum, wakes) = inner.state.add(key, delta).map_err(Close::State)?;
                    inner.deliver(wakes);
                    Some(Reply::default().i64(sum))
                }
                Request::Check { keys } => {
                    Some(Reply::default().u8(if inner.state.check(&keys) { CHECK_READY } else { CHECK_NOT_READY }))
                }
                Request::Wait { keys } => {
                    let outcome = inner.state.wait(conn, keys);
                    drop(inner);
                    self.register_wait(outcome)?
                }
                Request::NumKeys => Some(Reply::default().i64(inner.state.num_keys())),
                Request::DeleteKey { key } => Some(Reply::default().i64(i64::from(inner.state.delete_key(&key)))),
                Request::Append { key, value } => {
                    let wakes = inner.state.append(key, &value);
                    inner.deliver(wakes);
                    None
                }
                Request::MultiGet { keys } => {
                    Some(inner.state.multi_get(&keys).into_iter().fold(Reply::default(), Reply::value))
                }
                Request::MultiSet { kvs } => {
                    let wakes = inner.state.multi_set(kvs);
                    inner.deliver(wakes);
                    None
                }
                Request::CancelWait => {
                    let removed = inner.state.cancel_waits(conn);
                    drop(inner);
                    // Waits released before the cancel already have their wake queued (wakes
                    // are sent under the lock): answer them first, as torch's client expects.
                    let released = self.pending.saturating_sub(removed);
                    self.pending = 0;
                    let mut reply = Reply::default();
                    for _ in 0..released {
                        if self.wake_rx.try_recv().is_ok() {
                            reply = reply.u8(WAIT_STOP_WAITING);
                        }
                    }
                    Some(reply.u8(WAIT_CANCELED))
                }
                Request::QueuePush { key, value } => {
                    let wakes = inner.state.queue_push(key, value);
                    inner.deliver(wakes);
                    None
                }
                Request::QueuePop { key } => {
                    let (len, value) = inner.state.queue_pop(&key);
                    let reply = Reply::default().i64(len);
                    Some(match value {
                        Some(v) => reply.value(Arc::new(v)),
                        None => reply,
                    })
                }
                Request::QueueLen { key } => Some(Reply::default().i64(inner.state.queue_len(&key))),
                Request::ListKeys => {
                    let keys = inner.state.list_keys();
                    let reply = Reply::default().i64(keys.len() as i64);
                    Some(keys.iter().fold(reply, |r, k| r.bytes(k)))
                }
                Request::Barrier { key, world_size } => {
                    let (outcome, wakes) = inner.state.barrier(conn, key, world_size).map_err(Close::State)?;
                    inner.deliver(wakes);
                    drop(inner);
                    self.register_wait(outcome)?
                }
            }
        };
        match reply {
            Some(reply) => self.send(reply).await,
            None => Ok(()),
        }
    }
}
