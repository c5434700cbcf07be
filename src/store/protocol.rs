//! The TCPStore wire protocol of PyTorch's c10d: query types, request frames and their
//! encoding, and the decoding of requests from any async byte stream under size limits.
//!
//! Every frame starts with one query-type byte. Integers are little-endian (torch writes them
//! in host order, and every platform torch ships for is little-endian). Strings (keys) and
//! byte vectors (values) are a `u64` length followed by the bytes. Requests that reply do so
//! with plain values: a `u64`-prefixed vector, an `i64`, a `u32` nonce or one status byte.
//! There is no error reply: a server that cannot serve a request closes the connection.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

/// The number a client sends in its first frame (`VALIDATE`), `0x3C85F7CE`.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// Query-type bytes, in torch's `c10d::detail::QueryType` order (torch 2.15).
pub mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;
}

/// Reply byte of `CHECK`: every key is present.
pub const CHECK_READY: u8 = 0;
/// Reply byte of `CHECK`: some key is missing.
pub const CHECK_NOT_READY: u8 = 1;
/// Reply byte of `WAIT` / `BARRIER` when the condition is met.
pub const WAIT_STOP_WAITING: u8 = 0;
/// Reply byte of `CANCEL_WAIT`.
pub const WAIT_CANCELED: u8 = 1;

/// Size limits a server enforces on incoming requests (documented protocol limits).
///
/// Lengths are checked as soon as they are read, before any byte of the payload is awaited,
/// and payloads are read in chunks, so memory grows only with bytes actually received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest key, in bytes (default 64 KiB; torch's own server allows 8 KiB).
    pub max_key_len: u64,
    /// Longest value, in bytes (default 1 GiB).
    pub max_value_len: u64,
    /// Most keys in one `CHECK`/`WAIT`/`MULTI_GET`/`MULTI_SET` (default 128 Ki, as torch).
    pub max_keys: u64,
    /// Most key and value bytes in one request, all fields together (default 1 GiB + 1 MiB).
    pub max_request_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_len: 64 * 1024,
            max_value_len: 1 << 30,
            max_keys: 128 * 1024,
            max_request_bytes: (1 << 30) + (1 << 20),
        }
    }
}

/// One request frame, as a client sends it. Keys are raw bytes: torch keys are C++ strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Validate { magic: u32 },
    Set { key: Vec<u8>, value: Vec<u8> },
    CompareSet { key: Vec<u8>, expected: Vec<u8>, desired: Vec<u8> },
    Get { key: Vec<u8> },
    Add { key: Vec<u8>, delta: i64 },
    Check { keys: Vec<Vec<u8>> },
    Wait { keys: Vec<Vec<u8>> },
    NumKeys,
    DeleteKey { key: Vec<u8> },
    Append { key: Vec<u8>, value: Vec<u8> },
    MultiGet { keys: Vec<Vec<u8>> },
    MultiSet { kvs: Vec<(Vec<u8>, Vec<u8>)> },
    CancelWait,
    Ping { nonce: u32 },
    QueuePush { key: Vec<u8>, value: Vec<u8> },
    QueuePop { key: Vec<u8> },
    QueueLen { key: Vec<u8> },
    ListKeys,
    Barrier { key: Vec<u8>, world_size: i64 },
}

impl Request {
    /// The query-type byte this request starts with.
    pub fn query_type(&self) -> u8 {
        match self {
            Request::Validate { .. } => query::VALIDATE,
            Request::Set { .. } => query::SET,
            Request::CompareSet { .. } => query::COMPARE_SET,
            Request::Get { .. } => query::GET,
            Request::Add { .. } => query::ADD,
            Request::Check { .. } => query::CHECK,
            Request::Wait { .. } => query::WAIT,
            Request::NumKeys => query::GETNUMKEYS,
            Request::DeleteKey { .. } => query::DELETE_KEY,
            Request::Append { .. } => query::APPEND,
            Request::MultiGet { .. } => query::MULTI_GET,
            Request::MultiSet { .. } => query::MULTI_SET,
            Request::CancelWait => query::CANCEL_WAIT,
            Request::Ping { .. } => query::PING,
            Request::QueuePush { .. } => query::QUEUE_PUSH,
            Request::QueuePop { .. } => query::QUEUE_POP,
            Request::QueueLen { .. } => query::QUEUE_LEN,
            Request::ListKeys => query::LIST_KEYS,
            Request::Barrier { .. } => query::BARRIER,
        }
    }

    /// A short name for logs.
    pub fn name(&self) -> &'static str {
        query_name(self.query_type())
    }

    /// Appends the wire form of this request to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.query_type());
        match self {
            Request::Validate { magic } => out.extend_from_slice(&magic.to_le_bytes()),
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Request::Set { key, value } | Request::Append { key, value } | Request::QueuePush { key, value } => {
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet { key, expected, desired } => {
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_bytes(out, key),
            Request::Add { key, delta } => {
                put_bytes(out, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Barrier { key, world_size } => {
                put_bytes(out, key);
                out.extend_from_slice(&world_size.to_le_bytes());
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
                for key in keys {
                    put_bytes(out, key);
                }
            }
            Request::MultiSet { kvs } => {
                out.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
                for (key, value) in kvs {
                    put_bytes(out, key);
                    put_bytes(out, value);
                }
            }
            Request::NumKeys | Request::CancelWait | Request::ListKeys => {}
        }
    }
}

/// A short name of a query-type byte, for logs.
pub fn query_name(query_type: u8) -> &'static str {
    match query_type {
        query::VALIDATE => "validate",
        query::SET => "set",
        query::COMPARE_SET => "compare_set",
        query::GET => "get",
        query::ADD => "add",
        query::CHECK => "check",
        query::WAIT => "wait",
        query::GETNUMKEYS => "num_keys",
        query::DELETE_KEY => "delete_key",
        query::APPEND => "append",
        query::MULTI_GET => "multi_get",
        query::MULTI_SET => "multi_set",
        query::CANCEL_WAIT => "cancel_wait",
        query::PING => "ping",
        query::QUEUE_PUSH => "queue_push",
        query::QUEUE_POP => "queue_pop",
        query::QUEUE_LEN => "queue_len",
        query::LIST_KEYS => "list_keys",
        query::BARRIER => "barrier",
        _ => "unknown",
    }
}

/// Appends a `u64`-length-prefixed byte string.
pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Why a request could not be decoded. Every variant ends the connection.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("unknown query type {query_type}")]
    UnknownQuery { query_type: u8 },
    #[error("{what} length {len} exceeds the limit of {limit} bytes")]
    TooLong { what: &'static str, len: u64, limit: u64 },
    #[error("{count} keys in one request exceed the limit of {limit}")]
    TooManyKeys { count: u64, limit: u64 },
    #[error("request carries more than {limit} bytes in all")]
    RequestTooLarge { limit: u64 },
    #[error("connection closed in the middle of a {query} frame")]
    Truncated { query: &'static str },
    #[error("no byte of the {query} frame arrived for {stalled:?}")]
    Stalled { query: &'static str, stalled: Duration },
    #[error("i/o error while reading a request")]
    Io(#[source] std::io::Error),
}

/// Reads request frames from a byte stream, with a stall deadline inside a frame.
///
/// Waiting for the first byte of a frame is unbounded (an idle client is fine); once a frame
/// has started, each read must make progress within `stall`, else the frame is abandoned.
pub struct FrameReader<R> {
    inner: R,
    stall: Option<Duration>,
    limits: Limits,
}

/// Payloads are read (and the buffer grown) this many bytes at a time.
const CHUNK: usize = 64 * 1024;

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// `inner` should be buffered (e.g. a `tokio::io::BufReader`): fields are read a few bytes
    /// at a time.
    pub fn new(inner: R, limits: Limits, stall: Option<Duration>) -> Self {
        FrameReader { inner, stall, limits }
    }

    /// Reads the next request. `Ok(None)`: the peer closed the stream between frames.
    pub async fn next_request(&mut self) -> Result<Option<Request>, ProtocolError> {
        let mut first = [0u8; 1];
        let n = self.inner.read(&mut first).await.map_err(ProtocolError::Io)?;
        if n == 0 {
            return Ok(None);
        }
        let query_type = first[0];
        let mut frame = Frame { reader: self, query: query_name(query_type), budget: 0 };
        frame.budget = frame.reader.limits.max_request_bytes;
        let request = match query_type {
            query::VALIDATE => Request::Validate { magic: frame.u32().await? },
            query::PING => Request::Ping { nonce: frame.u32().await? },
            query::SET => {
                let key = frame.key().await?;
                Request::Set { key, value: frame.value().await? }
            }
            query::COMPARE_SET => {
                let key = frame.key().await?;
                let expected = frame.value().await?;
                Request::CompareSet { key, expected, desired: frame.value().await? }
            }
            query::GET => Request::Get { key: frame.key().await? },
            query::ADD => {
                let key = frame.key().await?;
                Request::Add { key, delta: frame.u64().await? as i64 }
            }
            query::CHECK => Request::Check { keys: frame.keys().await? },
            query::WAIT => Request::Wait { keys: frame.keys().await? },
            query::GETNUMKEYS => Request::NumKeys,
            query::DELETE_KEY => Request::DeleteKey { key: frame.key().await? },
            query::APPEND => {
                let key = frame.key().await?;
                Request::Append { key, value: frame.value().await? }
            }
            query::MULTI_GET => Request::MultiGet { keys: frame.keys().await? },
            query::MULTI_SET => {
                let count = frame.count().await?;
                let mut kvs = Vec::with_capacity(count.min(1024) as usize);
                for _ in 0..count {
                    let key = frame.key().await?;
                    kvs.push((key, frame.value().await?));
                }
                Request::MultiSet { kvs }
            }
            query::CANCEL_WAIT => Request::CancelWait,
            query::QUEUE_PUSH => {
                let key = frame.key().await?;
                Request::QueuePush { key, value: frame.value().await? }
            }
            query::QUEUE_POP => Request::QueuePop { key: frame.key().await? },
            query::QUEUE_LEN => Request::QueueLen { key: frame.key().await? },
            query::LIST_KEYS => Request::ListKeys,
            query::BARRIER => {
                let key = frame.key().await?;
                Request::Barrier { key, world_size: frame.u64().await? as i64 }
            }
            other => return Err(ProtocolError::UnknownQuery { query_type: other }),
        };
        Ok(Some(request))
    }
}

/// The state of one frame being decoded: its name for errors and its remaining byte budget.
struct Frame<'a, R> {
    reader: &'a mut FrameReader<R>,
    query: &'static str,
    budget: u64,
}

impl<R: AsyncRead + Unpin> Frame<'_, R> {
    async fn read_some(&mut self, buf: &mut [u8]) -> Result<usize, ProtocolError> {
        let read = self.reader.inner.read(buf);
        let n = match self.reader.stall {
            Some(stall) => tokio::time::timeout(stall, read)
                .await
                .map_err(|_| ProtocolError::Stalled { query: self.query, stalled: stall })?,
            None => read.await,
        }
        .map_err(ProtocolError::Io)?;
        if n == 0 {
            return Err(ProtocolError::Truncated { query: self.query });
        }
        Ok(n)
    }

    async fn fill(&mut self, buf: &mut [u8]) -> Result<(), ProtocolError> {
        let mut done = 0;
        while done < buf.len() {
            done += self.read_some(&mut buf[done..]).await?;
        }
        Ok(())
    }

    async fn u32(&mut self) -> Result<u32, ProtocolError> {
        let mut b = [0u8; 4];
        self.fill(&mut b).await?;
        Ok(u32::from_le_bytes(b))
    }

    async fn u64(&mut self) -> Result<u64, ProtocolError> {
        let mut b = [0u8; 8];
        self.fill(&mut b).await?;
        Ok(u64::from_le_bytes(b))
    }

    async fn count(&mut self) -> Result<u64, ProtocolError> {
        let count = self.u64().await?;
        let limit = self.reader.limits.max_keys;
        if count > limit {
            return Err(ProtocolError::TooManyKeys { count, limit });
        }
        Ok(count)
    }

    async fn keys(&mut self) -> Result<Vec<Vec<u8>>, ProtocolError> {
        let count = self.count().await?;
        let mut keys = Vec::with_capacity(count.min(1024) as usize);
        for _ in 0..count {
            keys.push(self.key().await?);
        }
        Ok(keys)
    }

    async fn key(&mut self) -> Result<Vec<u8>, ProtocolError> {
        let limit = self.reader.limits.max_key_len;
        self.bytes("key", limit).await
    }

    async fn value(&mut self) -> Result<Vec<u8>, ProtocolError> {
        let limit = self.reader.limits.max_value_len;
        self.bytes("value", limit).await
    }

    /// Reads a length-prefixed byte string, growing the buffer only as bytes arrive.
    async fn bytes(&mut self, what: &'static str, limit: u64) -> Result<Vec<u8>, ProtocolError> {
        let len = self.u64().await?;
        if len > limit {
            return Err(ProtocolError::TooLong { what, len, limit });
        }
        if len > self.budget {
            return Err(ProtocolError::RequestTooLarge { limit: self.reader.limits.max_request_bytes });
        }
        self.budget -= len;
        let len = len as usize;
        let mut out = Vec::with_capacity(len.min(CHUNK));
        while out.len() < len {
            let start = out.len();
            let step = (len - start).min(CHUNK);
            out.resize(start + step, 0);
            let mut filled = 0;
            while filled < step {
                filled += self.read_some(&mut out[start + filled..start + step]).await?;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> Result<Option<Request>, ProtocolError> {
        decode_with(bytes, Limits::default())
    }

    fn decode_with(bytes: &[u8], limits: Limits) -> Result<Option<Request>, ProtocolError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime builds");
        rt.block_on(async {
            let mut reader = FrameReader::new(bytes, limits, Some(Duration::from_secs(1)));
            reader.next_request().await
        })
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("test hex is valid")).collect()
    }

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn all_requests() -> Vec<Request> {
        vec![
            Request::Validate { magic: VALIDATION_MAGIC },
            Request::Set { key: k("/k"), value: k("v1") },
            Request::CompareSet { key: k("/k"), expected: k("v1"), desired: k("v2") },
            Request::Get { key: k("/k") },
            Request::Add { key: k("/n"), delta: -5 },
            Request::Check { keys: vec![k("/k"), k("/zz")] },
            Request::Wait { keys: vec![k("/k")] },
            Request::NumKeys,
            Request::DeleteKey { key: k("/n") },
            Request::Append { key: k("/k"), value: k("xx") },
            Request::MultiGet { keys: vec![k("/a"), k("/b")] },
            Request::MultiSet { kvs: vec![(k("/a"), k("1")), (k("/b"), Vec::new())] },
            Request::CancelWait,
            Request::Ping { nonce: 0x2153 },
            Request::QueuePush { key: k("/q"), value: k("x") },
            Request::QueuePop { key: k("/q") },
            Request::QueueLen { key: k("/q") },
            Request::ListKeys,
            Request::Barrier { key: k("/bar"), world_size: 4 },
        ]
    }

    #[test]
    fn every_request_round_trips_through_encode_and_decode() {
        for request in all_requests() {
            let mut bytes = Vec::new();
            request.encode(&mut bytes);
            let decoded = decode(&bytes).expect("decodes").expect("one frame");
            assert_eq!(decoded, request, "round trip of {}", request.name());
        }
    }

    /// Frames captured from torch 2.15's `TCPStore` client on the wire.
    #[test]
    fn encodes_byte_for_byte_like_torch_client() {
        let cases: Vec<(Request, &str)> = vec![
            (Request::Validate { magic: VALIDATION_MAGIC }, "00cef7853c"),
            (Request::Ping { nonce: 0x2153 }, "0d53210000"),
            (Request::Set { key: k("/k"), value: k("v1") }, "0102000000000000002f6b02000000000000007631"),
            (Request::Get { key: k("/k") }, "0302000000000000002f6b"),
            (Request::Add { key: k("/n"), delta: 5 }, "0402000000000000002f6e0500000000000000"),
            (
                Request::CompareSet { key: k("/k"), expected: k("v1"), desired: k("v2") },
                "0202000000000000002f6b0200000000000000763102000000000000007632",
            ),
            (
                Request::Check { keys: vec![k("/k"), k("/zz")] },
                "05020000000000000002000000000000002f6b03000000000000002f7a7a",
            ),
            (Request::Wait { keys: vec![k("/k")] }, "06010000000000000002000000000000002f6b"),
            (Request::CancelWait, "0c"),
            (Request::NumKeys, "07"),
            (Request::DeleteKey { key: k("/n") }, "0802000000000000002f6e"),
            (Request::Append { key: k("/k"), value: k("xx") }, "0902000000000000002f6b02000000000000007878"),
            (Request::MultiGet { keys: vec![k("/k")] }, "0a010000000000000002000000000000002f6b"),
            (
                Request::MultiSet { kvs: vec![(k("/a"), k("1")), (k("/b"), k("2"))] },
                "0b020000000000000002000000000000002f6101000000000000003102000000000000002f62010000000000000032",
            ),
            (Request::QueuePush { key: k("/q"), value: k("x") }, "0e02000000000000002f71010000000000000078"),
            (Request::QueuePop { key: k("/q") }, "0f02000000000000002f71"),
            (Request::QueueLen { key: k("/q") }, "1002000000000000002f71"),
            (Request::ListKeys, "11"),
            (Request::Barrier { key: k("/bar"), world_size: 1 }, "1204000000000000002f6261720100000000000000"),
        ];
        for (request, wire) in cases {
            let mut bytes = Vec::new();
            request.encode(&mut bytes);
            assert_eq!(bytes, hex(wire), "encoding of {}", request.name());
            assert_eq!(decode(&hex(wire)).expect("decodes"), Some(request));
        }
    }

    #[test]
    fn empty_stream_is_a_clean_close_between_frames() {
        assert!(decode(&[]).expect("no error").is_none());
    }

    #[test]
    fn rejects_unknown_query_type() {
        let err = decode(&[19]).expect_err("19 is not a query");
        assert!(matches!(err, ProtocolError::UnknownQuery { query_type: 19 }), "{err}");
        let err = decode(&[0xff, 1, 2]).expect_err("0xff is not a query");
        assert!(matches!(err, ProtocolError::UnknownQuery { query_type: 0xff }), "{err}");
    }

    #[test]
    fn rejects_absurd_key_length_before_reading_payload() {
        let mut bytes = vec![query::GET];
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        let err = decode(&bytes).expect_err("too long");
        assert!(matches!(err, ProtocolError::TooLong { what: "key", .. }), "{err}");
    }

    #[test]
    fn rejects_absurd_value_length_before_reading_payload() {
        let mut bytes = vec![query::SET];
        put_bytes(&mut bytes, b"/k");
        bytes.extend_from_slice(&((1u64 << 30) + 1).to_le_bytes());
        let err = decode(&bytes).expect_err("too long");
        assert!(matches!(err, ProtocolError::TooLong { what: "value", .. }), "{err}");
    }

    #[test]
    fn rejects_too_many_keys() {
        let mut bytes = vec![query::WAIT];
        bytes.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let err = decode(&bytes).expect_err("too many");
        assert!(matches!(err, ProtocolError::TooManyKeys { .. }), "{err}");
    }

    #[test]
    fn rejects_request_whose_fields_together_exceed_the_budget() {
        let limits = Limits { max_request_bytes: 10, ..Limits::default() };
        let request = Request::MultiSet { kvs: vec![(k("/a"), k("12345")), (k("/b"), k("6789"))] };
        let mut bytes = Vec::new();
        request.encode(&mut bytes);
        let err = decode_with(&bytes, limits).expect_err("over budget");
        assert!(matches!(err, ProtocolError::RequestTooLarge { limit: 10 }), "{err}");
    }

    #[test]
    fn reports_truncated_frame() {
        let mut bytes = Vec::new();
        Request::Set { key: k("/k"), value: k("value") }.encode(&mut bytes);
        for cut in 1..bytes.len() {
            let err = decode(&bytes[..cut]).expect_err("truncated");
            assert!(matches!(err, ProtocolError::Truncated { query: "set" }), "cut {cut}: {err}");
        }
    }

    #[test]
    fn reports_stall_inside_a_frame() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime builds");
        rt.block_on(async {
            let (mut client, server) = tokio::io::duplex(64);
            tokio::io::AsyncWriteExt::write_all(&mut client, &[query::GET, 2, 0]).await.expect("duplex write");
            let mut reader = FrameReader::new(server, Limits::default(), Some(Duration::from_millis(50)));
            let err = reader.next_request().await.expect_err("stalls");
            assert!(matches!(err, ProtocolError::Stalled { query: "get", .. }), "{err}");
            drop(client);
        });
    }
}
