//! A blocking TCPStore client (std::net only), key-compatible with torch's `TCPStore` client.
//!
//! Like torch's client it prefixes every user key with `/` on the wire, so a key set here is
//! the key a Python worker reads with `store.get(key)`, and it validates the connection
//! (magic number, then a ping) before first use. After a failed exchange (timeout, I/O error)
//! the connection may be out of step with the server, so the client refuses further calls.

use std::io::{self, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::protocol::{
    Limits, Request, CHECK_NOT_READY, CHECK_READY, VALIDATION_MAGIC, WAIT_CANCELED, WAIT_STOP_WAITING,
};
use super::StoreError;

/// What torch's client puts in front of every user key.
const KEY_PREFIX: &str = "/";

/// A blocking connection to a TCPStore server (ours or torch's).
pub struct StoreClient {
    address: String,
    writer: TcpStream,
    reader: BufReader<TcpStream>,
    timeout: Duration,
    limits: Limits,
    broken: bool,
    nonce: u32,
}

fn wire_key(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(KEY_PREFIX.len() + key.len());
    k.extend_from_slice(KEY_PREFIX.as_bytes());
    k.extend_from_slice(key.as_bytes());
    k
}

fn is_timeout(err: &io::Error) -> bool {
    matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Socket timeouts must be non-zero, and finite enough for `timeval`.
fn at_least_1ms(d: Duration) -> Duration {
    d.clamp(Duration::from_millis(1), Duration::from_secs(365 * 24 * 3600))
}

fn connect_once(address: &str, budget: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolved to nothing");
    for sa in address.to_socket_addrs()? {
        match TcpStream::connect_timeout(&sa, at_least_1ms(budget)) {
            Ok(stream) => return Ok(stream),
            Err(err) => last = err,
        }
    }
    Err(last)
}

impl StoreClient {
    /// Connects to `addr` ("host:port"), retrying until `timeout` (the server may not be up
    /// yet), then validates the connection. `timeout` is also the client's default timeout for
    /// replies and for `get`.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self, StoreError> {
        Self::connect_until(addr, timeout, || false)
    }

    /// [`StoreClient::connect`], giving up between attempts (each at most 2 s) once `stop`
    /// answers true (a round's end, `rlaunch::resilient`).
    pub fn connect_until(addr: &str, timeout: Duration, stop: impl Fn() -> bool) -> Result<Self, StoreError> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(10);
        let stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let stopped = || std::io::Error::new(io::ErrorKind::Interrupted, "given up: the round ended");
            if stop() {
                return Err(StoreError::Connect { address: addr.to_string(), timeout, source: stopped() });
            }
            match connect_once(addr, left.min(Duration::from_secs(2))) {
                Ok(stream) => break stream,
                Err(source) if Instant::now() + backoff >= deadline => {
                    return Err(StoreError::Connect { address: addr.to_string(), timeout, source });
                }
                Err(_) => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        };
        let io_err = |source| StoreError::Io { address: addr.to_string(), op: "connect", key: String::new(), source };
        stream.set_nodelay(true).map_err(io_err)?;
        stream.set_read_timeout(Some(at_least_1ms(timeout))).map_err(io_err)?;
        stream.set_write_timeout(Some(at_least_1ms(timeout))).map_err(io_err)?;
        let reader = BufReader::new(stream.try_clone().map_err(io_err)?);
        let mut client = StoreClient {
            address: addr.to_string(),
            writer: stream,
            reader,
            timeout,
            limits: Limits::default(),
            broken: false,
            nonce: std::process::id(),
        };
        client.send("validate", "", &Request::Validate { magic: VALIDATION_MAGIC })?;
        client.ping()?;
        Ok(client)
    }

    /// The address this client was given.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The default timeout for replies and for `get`.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.check_sizes(key, Some(value))?;
        self.send("set", key, &Request::Set { key: wire_key(key), value: value.to_vec() })
    }

    /// Waits for `key` up to the client timeout, then reads it, like torch's `get`.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.check_sizes(key, None)?;
        let timeout = self.timeout;
        self.wait_as("get", &[key], timeout)?;
        self.send("get", key, &Request::Get { key: wire_key(key) })?;
        self.read_bytes("get", key)
    }

    /// Adds `delta` to the integer at `key` (missing = 0) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.check_sizes(key, None)?;
        self.send("add", key, &Request::Add { key: wire_key(key), delta })?;
        self.read_i64("add", key)
    }

    /// Stores `desired` if the current value equals `expected` (an empty `expected` also
    /// matches a missing key) and returns the value now stored (torch semantics: for a missing
    /// key and a non-empty `expected`, `expected` itself).
    pub fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        self.check_sizes(key, Some(expected))?;
        self.check_sizes(key, Some(desired))?;
        let request =
            Request::CompareSet { key: wire_key(key), expected: expected.to_vec(), desired: desired.to_vec() };
        self.send("compare_set", key, &request)?;
        self.read_bytes("compare_set", key)
    }

    /// Waits until every key is set; `StoreError::Timeout` after `timeout`.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.wait_as("wait", keys, timeout)
    }

    /// Whether every key is set, without waiting.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool, StoreError> {
        let shown = keys.join(",");
        for key in keys {
            self.check_sizes(key, None)?;
        }
        let request = Request::Check { keys: keys.iter().map(|k| wire_key(k)).collect() };
        self.send("check", &shown, &request)?;
        match self.read_u8("check", &shown)? {
            CHECK_READY => Ok(true),
            CHECK_NOT_READY => Ok(false),
            other => Err(self.protocol("check", &shown, format!("status byte {other}"))),
        }
    }

    /// Deletes `key`; whether it existed.
    pub fn delete_key(&mut self, key: &str) -> Result<bool, StoreError> {
        self.check_sizes(key, None)?;
        self.send("delete_key", key, &Request::DeleteKey { key: wire_key(key) })?;
        Ok(self.read_i64("delete_key", key)? == 1)
    }

    /// Number of keys in the store (all clients' keys, torch's internal ones included).
    pub fn num_keys(&mut self) -> Result<i64, StoreError> {
        self.send("num_keys", "", &Request::NumKeys)?;
        self.read_i64("num_keys", "")
    }

    /// Appends `value` to the value at `key` (creating it).
    pub fn append(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.check_sizes(key, Some(value))?;
        self.send("append", key, &Request::Append { key: wire_key(key), value: value.to_vec() })
    }

    /// Waits for every key up to the client timeout, then reads them all in one round trip.
    pub fn multi_get(&mut self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        let shown = keys.join(",");
        for key in keys {
            self.check_sizes(key, None)?;
        }
        let timeout = self.timeout;
        self.wait_as("multi_get", keys, timeout)?;
        let request = Request::MultiGet { keys: keys.iter().map(|k| wire_key(k)).collect() };
        self.send("multi_get", &shown, &request)?;
        keys.iter().map(|_| self.read_bytes("multi_get", &shown)).collect()
    }

    pub fn multi_set(&mut self, kvs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        for (key, value) in kvs {
            self.check_sizes(key, Some(value))?;
        }
        let shown = kvs.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(",");
        let request = Request::MultiSet { kvs: kvs.iter().map(|(k, v)| (wire_key(k), v.to_vec())).collect() };
        self.send("multi_set", &shown, &request)
    }

    /// Round trip with a fresh nonce that the server must echo.
    pub fn ping(&mut self) -> Result<(), StoreError> {
        self.nonce = self.nonce.wrapping_add(1);
        let nonce = self.nonce;
        self.send("ping", "", &Request::Ping { nonce })?;
        let mut b = [0u8; 4];
        self.read_exact("ping", "", &mut b)?;
        let echoed = u32::from_le_bytes(b);
        if echoed != nonce {
            return Err(self.protocol("ping", "", format!("nonce {echoed:#x}, sent {nonce:#x}")));
        }
        Ok(())
    }

    /// Pushes `value` to the back of the queue `key`.
    pub fn queue_push(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.check_sizes(key, Some(value))?;
        self.send("queue_push", key, &Request::QueuePush { key: wire_key(key), value: value.to_vec() })
    }

    /// Pops the front of the queue `key`; with `block`, waits for an item up to the client
    /// timeout. `None` when not blocking and the queue is empty.
    pub fn queue_pop(&mut self, key: &str, block: bool) -> Result<Option<Vec<u8>>, StoreError> {
        self.check_sizes(key, None)?;
        if block {
            let timeout = self.timeout;
            self.wait_as("queue_pop", &[key], timeout)?;
        }
        self.send("queue_pop", key, &Request::QueuePop { key: wire_key(key) })?;
        if self.read_i64("queue_pop", key)? == 0 {
            return Ok(None);
        }
        self.read_bytes("queue_pop", key).map(Some)
    }

    pub fn queue_len(&mut self, key: &str) -> Result<i64, StoreError> {
        self.check_sizes(key, None)?;
        self.send("queue_len", key, &Request::QueueLen { key: wire_key(key) })?;
        self.read_i64("queue_len", key)
    }

    /// The user keys in the store (those under torch's `/` prefix), prefix removed.
    pub fn list_keys(&mut self) -> Result<Vec<String>, StoreError> {
        self.send("list_keys", "", &Request::ListKeys)?;
        let count = self.read_i64("list_keys", "")?;
        let mut keys = Vec::new();
        for _ in 0..count.max(0) {
            let raw = self.read_bytes("list_keys", "")?;
            if let Some(user) = raw.strip_prefix(KEY_PREFIX.as_bytes()) {
                keys.push(String::from_utf8_lossy(user).into_owned());
            }
        }
        Ok(keys)
    }

    /// Arrives at the barrier `key` and waits until `world_size` callers have arrived.
    pub fn barrier(&mut self, key: &str, world_size: i64, timeout: Duration) -> Result<(), StoreError> {
        self.check_sizes(key, None)?;
        self.send("barrier", key, &Request::Barrier { key: wire_key(key), world_size })?;
        self.await_release("barrier", key, timeout)
    }

    fn wait_as(&mut self, op: &'static str, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let shown = keys.join(",");
        for key in keys {
            self.check_sizes(key, None)?;
        }
        let request = Request::Wait { keys: keys.iter().map(|k| wire_key(k)).collect() };
        self.send(op, &shown, &request)?;
        self.await_release(op, &shown, timeout)
    }

    /// Reads `STOP_WAITING` within `timeout`; on timeout cancels the wait as torch does and
    /// drains the server's answer, so the connection stays usable.
    fn await_release(&mut self, op: &'static str, key: &str, timeout: Duration) -> Result<(), StoreError> {
        self.set_read_timeout(op, key, timeout)?;
        let mut b = [0u8; 1];
        let first = self.reader.read_exact(&mut b);
        self.set_read_timeout(op, key, self.timeout)?;
        match first {
            Ok(()) if b[0] == WAIT_STOP_WAITING => return Ok(()),
            Ok(()) => return Err(self.protocol(op, key, format!("wait status byte {}", b[0]))),
            Err(err) if is_timeout(&err) => {}
            Err(source) => return Err(self.io(op, key, source)),
        }
        self.send(op, key, &Request::CancelWait)?;
        let mut status = self.read_u8(op, key)?;
        if status == WAIT_STOP_WAITING {
            // Released just before the cancel arrived; the cancel's own answer follows.
            status = self.read_u8(op, key)?;
        }
        if status != WAIT_CANCELED {
            return Err(self.protocol(op, key, format!("cancel status byte {status}")));
        }
        Err(StoreError::Timeout { address: self.address.clone(), op, key: key.to_string(), timeout })
    }

    fn check_sizes(&self, key: &str, value: Option<&[u8]>) -> Result<(), StoreError> {
        let key_len = (KEY_PREFIX.len() + key.len()) as u64;
        if key_len > self.limits.max_key_len {
            return Err(StoreError::TooLarge {
                key: key.chars().take(64).collect(),
                what: "key",
                len: key_len,
                limit: self.limits.max_key_len,
            });
        }
        if let Some(value) = value {
            if value.len() as u64 > self.limits.max_value_len {
                return Err(StoreError::TooLarge {
                    key: key.to_string(),
                    what: "value",
                    len: value.len() as u64,
                    limit: self.limits.max_value_len,
                });
            }
        }
        Ok(())
    }

    fn io(&mut self, op: &'static str, key: &str, source: io::Error) -> StoreError {
        self.broken = true;
        if is_timeout(&source) {
            return StoreError::Timeout {
                address: self.address.clone(),
                op,
                key: key.to_string(),
                timeout: self.timeout,
            };
        }
        StoreError::Io { address: self.address.clone(), op, key: key.to_string(), source }
    }

    fn protocol(&mut self, op: &'static str, key: &str, detail: String) -> StoreError {
        self.broken = true;
        StoreError::Protocol { address: self.address.clone(), op, key: key.to_string(), detail }
    }

    fn set_read_timeout(&mut self, op: &'static str, key: &str, d: Duration) -> Result<(), StoreError> {
        self.writer.set_read_timeout(Some(at_least_1ms(d))).map_err(|source| self.io(op, key, source))
    }

    fn send(&mut self, op: &'static str, key: &str, request: &Request) -> Result<(), StoreError> {
        if self.broken {
            return Err(StoreError::Broken { address: self.address.clone(), op });
        }
        let mut frame = Vec::new();
        request.encode(&mut frame);
        let result = self.writer.write_all(&frame).and_then(|()| self.writer.flush());
        result.map_err(|source| self.io(op, key, source))
    }

    fn read_exact(&mut self, op: &'static str, key: &str, buf: &mut [u8]) -> Result<(), StoreError> {
        self.reader.read_exact(buf).map_err(|source| self.io(op, key, source))
    }

    fn read_u8(&mut self, op: &'static str, key: &str) -> Result<u8, StoreError> {
        let mut b = [0u8; 1];
        self.read_exact(op, key, &mut b)?;
        Ok(b[0])
    }

    fn read_i64(&mut self, op: &'static str, key: &str) -> Result<i64, StoreError> {
        let mut b = [0u8; 8];
        self.read_exact(op, key, &mut b)?;
        Ok(i64::from_le_bytes(b))
    }

    fn read_bytes(&mut self, op: &'static str, key: &str) -> Result<Vec<u8>, StoreError> {
        let mut b = [0u8; 8];
        self.read_exact(op, key, &mut b)?;
        let len = u64::from_le_bytes(b);
        if len > self.limits.max_value_len {
            return Err(self.protocol(op, key, format!("reply length {len}")));
        }
        // Grows as bytes arrive, so a lying length cannot make us allocate up front.
        let mut out = Vec::with_capacity((len as usize).min(64 * 1024));
        let read = (&mut self.reader).take(len).read_to_end(&mut out);
        read.map_err(|source| self.io(op, key, source))?;
        if out.len() as u64 != len {
            let source = io::Error::new(io::ErrorKind::UnexpectedEof, "reply cut short");
            return Err(self.io(op, key, source));
        }
        Ok(out)
    }
}

/// A view of a store under a key prefix, as torch's `PrefixStore`: key `k` is stored as
/// `"{prefix}/{k}"`.
pub struct PrefixStore {
    inner: StoreClient,
    prefix: String,
}

impl PrefixStore {
    pub fn new(prefix: impl Into<String>, inner: StoreClient) -> Self {
        PrefixStore { inner, prefix: prefix.into() }
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let key = self.key(key);
        self.inner.set(&key, value)
    }

    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, StoreError> {
        let key = self.key(key);
        self.inner.get(&key)
    }

    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let key = self.key(key);
        self.inner.add(&key, delta)
    }

    pub fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        let key = self.key(key);
        self.inner.compare_set(&key, expected, desired)
    }

    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.inner.wait(&keys, timeout)
    }

    pub fn check(&mut self, keys: &[&str]) -> Result<bool, StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.inner.check(&keys)
    }

    pub fn delete_key(&mut self, key: &str) -> Result<bool, StoreError> {
        let key = self.key(key);
        self.inner.delete_key(&key)
    }

    pub fn append(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let key = self.key(key);
        self.inner.append(&key, value)
    }

    /// The underlying client, for unprefixed access.
    pub fn inner(&mut self) -> &mut StoreClient {
        &mut self.inner
    }

    pub fn into_inner(self) -> StoreClient {
        self.inner
    }
}

/// Whether a store answers at `addr` within `timeout`: connect, validate, ping, and the nonce
/// echoed. The failure detector's probe (an agent serves its node's store, so an answer means
/// that agent's process runs and is reachable). Never blocks past `timeout`.
pub async fn probe(addr: &str, nonce: u32, timeout: Duration) -> io::Result<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let started = tokio::time::Instant::now();
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let mut frame = Vec::with_capacity(10);
        Request::Validate { magic: VALIDATION_MAGIC }.encode(&mut frame);
        Request::Ping { nonce }.encode(&mut frame);
        stream.write_all(&frame).await?;
        let mut echoed = [0u8; 4];
        stream.read_exact(&mut echoed).await?;
        if u32::from_le_bytes(echoed) != nonce {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the store echoed another nonce"));
        }
        Ok(started.elapsed())
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, format!("no answer within {timeout:?}"))),
    }
}

/// What a UDP probe carries: this prefix, then a nonce the endpoint echoes back.
pub const PROBE_DATAGRAM: &[u8; 14] = b"rlaunch-probe\0";

/// Echoes probe datagrams (the prefix and a nonce, at most 64 bytes) on `socket` until the
/// task is dropped: the UDP half of an agent's probe endpoint. A lost datagram costs nothing but
/// itself, so under heavy loss a UDP probe gets through where a TCP handshake waits a second.
pub async fn serve_udp_probes(socket: tokio::net::UdpSocket) {
    let mut buf = [0u8; 64];
    loop {
        let Ok((n, from)) = socket.recv_from(&mut buf).await else { continue };
        if n == PROBE_DATAGRAM.len() + 4 && buf.starts_with(PROBE_DATAGRAM) {
            let _ = socket.send_to(&buf[..n], from).await;
        }
    }
}

/// A UDP socket connected to `addr` (its first address), bound to any local port of its family:
/// a refusal (ICMP port unreachable) then surfaces as an error of a later send or receive.
pub async fn connect_udp(addr: &str) -> io::Result<tokio::net::UdpSocket> {
    let target = tokio::net::lookup_host(addr)
        .await?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to nothing")))?;
    let socket = tokio::net::UdpSocket::bind(if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).await?;
    socket.connect(target).await?;
    Ok(socket)
}

/// Whether a probe endpoint echoes within `timeout` over UDP: a datagram every `every`, the
/// first echo of this nonce wins.
pub async fn probe_udp(addr: &str, nonce: u32, every: Duration, timeout: Duration) -> io::Result<Duration> {
    let started = tokio::time::Instant::now();
    let socket = connect_udp(addr).await?;
    let mut datagram = PROBE_DATAGRAM.to_vec();
    datagram.extend_from_slice(&nonce.to_le_bytes());
    let attempt = async {
        let mut tick = tokio::time::interval(every);
        let mut buf = [0u8; 64];
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    // An unreachable port answers ICMP: a send or receive error then.
                    socket.send(&datagram).await?;
                }
                got = socket.recv(&mut buf) => {
                    let n = got?;
                    if buf[..n] == datagram[..] {
                        return Ok(started.elapsed());
                    }
                }
            }
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, format!("no echo within {timeout:?}"))),
    }
}
