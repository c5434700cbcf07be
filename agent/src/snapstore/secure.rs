//! Who a snapshot peer is, and a channel only the two ends of a connection can read or write.
//!
//! Each agent makes an X25519 key pair when it starts; only the public half leaves its memory
//! (`NodeInfo::snapshot_key`, so the rendezvous, etcd and `rlaunch status` hold nothing a
//! stranger could prove itself with). A connection between two members opens with a
//! challenge-response bound to the connection and to both ends:
//!
//! ```text
//! client → server   Hello { round, node: C, to: S, nonce_c }           (clear)
//! server → client   Challenge { nonce_s, proof_s }                     (clear)
//! client → server   Proof { proof_c }                                  (clear)
//! server → client   sealed answer; from here on every frame is sealed
//! ```
//!
//! Both ends compute `X25519(own private, other's public)` from the round's member list, and
//! HKDF-SHA256 over it with a salt that digests the round, both node ids, both public keys and
//! both nonces gives each direction an AES-256-GCM key and each end a proof. A proof is good
//! for one connection only (the other end's nonce is fresh), names its receiver (a hello meant
//! for another node derives other keys), and nobody without one of the two private keys can
//! compute it. Every later frame, a part's bytes included, is sealed with a per-direction
//! counter as its nonce: read, changed, replayed or reordered, it fails to open and the
//! connection is dropped. The public keys themselves are only as genuine as the round's member
//! list: over `https://` (or etcd with TLS) to the rendezvous, nobody on the path can swap them.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use aws_lc_rs::agreement::{self, PrivateKey, UnparsedPublicKey, X25519};
use aws_lc_rs::hkdf::{self, Salt, HKDF_SHA256};
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use rlaunch_rendezvous::identity::{hex, unhex};
use serde::{Deserialize, Serialize};

/// The length of a public key, and of a nonce of the handshake.
pub(crate) const KEY_LEN: usize = 32;
const TAG_LEN: usize = 16;
/// A frame of the handshake, which nobody has proven anything for yet.
pub(crate) const MAX_HELLO: usize = 1024;
/// A sealed frame (requests and answers).
pub(crate) const MAX_FRAME: usize = 64 * 1024;
/// A sealed piece of a part's bytes.
pub(crate) const CHUNK: usize = 4 << 20;

/// This agent's key pair for its whole life.
pub(crate) struct Identity {
    private: PrivateKey,
    public: [u8; KEY_LEN],
}

impl Identity {
    pub(crate) fn generate() -> io::Result<Identity> {
        let private = PrivateKey::generate(&X25519).map_err(|_| io::Error::other("cannot make an X25519 key"))?;
        let public = private.compute_public_key().map_err(|_| io::Error::other("cannot compute a public key"))?;
        let public: [u8; KEY_LEN] =
            public.as_ref().try_into().map_err(|_| io::Error::other("an X25519 public key is 32 bytes"))?;
        Ok(Identity { private, public })
    }

    /// The public half, as `NodeInfo::snapshot_key` carries it.
    pub(crate) fn public_hex(&self) -> String {
        hex(&self.public)
    }

    pub(crate) fn shared_with(&self, peer: &[u8; KEY_LEN]) -> io::Result<[u8; KEY_LEN]> {
        agreement::agree(&self.private, UnparsedPublicKey::new(&X25519, peer), bad("a bad public key"), |s| {
            s.try_into().map_err(|_| bad("an X25519 secret is 32 bytes"))
        })
    }
}

/// A public key as the wire carries it (64 lowercase hex digits).
pub(crate) fn parse_public(text: &str) -> Option<[u8; KEY_LEN]> {
    let bytes = unhex(text)?;
    bytes.try_into().ok()
}

fn bad(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_owned())
}

fn fresh_nonce() -> io::Result<[u8; KEY_LEN]> {
    let mut n = [0u8; KEY_LEN];
    SystemRandom::new().fill(&mut n).map_err(|_| io::Error::other("no random bytes"))?;
    Ok(n)
}

/// The frames of the handshake, in clear.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Handshake {
    Hello { round: u64, node: String, to: String, nonce: String },
    Challenge { nonce: String, proof: String },
    Proof { proof: String },
    Refused { error: String },
}

/// What one connection's two ends derive: a key per direction and a proof per end.
#[derive(PartialEq, Eq, Debug)]
pub(crate) struct Session {
    pub to_server: [u8; 32],
    pub to_client: [u8; 32],
    pub server_proof: [u8; 32],
    pub client_proof: [u8; 32],
}

/// Everything both ends must agree on for one connection.
pub(crate) struct Transcript<'a> {
    pub round: u64,
    pub client: &'a str,
    pub server: &'a str,
    pub client_key: &'a [u8; KEY_LEN],
    pub server_key: &'a [u8; KEY_LEN],
    pub client_nonce: &'a [u8; KEY_LEN],
    pub server_nonce: &'a [u8; KEY_LEN],
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// The keys and proofs of one connection (pure: the same inputs, the same session).
pub(crate) fn session(shared: &[u8; KEY_LEN], t: &Transcript<'_>) -> Session {
    let mut salt = Vec::with_capacity(256);
    salt.extend_from_slice(b"rlaunch-snapshot-peer v1\0");
    salt.extend_from_slice(&t.round.to_le_bytes());
    for field in [t.client.as_bytes(), t.server.as_bytes()] {
        salt.extend_from_slice(&(field.len() as u64).to_le_bytes());
        salt.extend_from_slice(field);
    }
    for field in [t.client_key, t.server_key, t.client_nonce, t.server_nonce] {
        salt.extend_from_slice(field);
    }
    let prk = Salt::new(HKDF_SHA256, &salt).extract(shared);
    let mut okm = [0u8; 128];
    prk.expand(&[b"keys and proofs"], Len(okm.len()))
        .and_then(|o| o.fill(&mut okm))
        .expect("128 bytes is within HKDF-SHA256's output");
    let part = |i: usize| -> [u8; 32] { okm[i * 32..(i + 1) * 32].try_into().expect("32 bytes") };
    Session { to_server: part(0), to_client: part(1), server_proof: part(2), client_proof: part(3) }
}

/// Whether two proofs are equal, in time independent of where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    aws_lc_rs::constant_time::verify_slices_are_equal(a, b).is_ok()
}

pub(crate) fn write_clear(s: &mut TcpStream, h: &Handshake) -> io::Result<()> {
    let body = serde_json::to_vec(h).map_err(io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    s.write_all(&frame)
}

/// Reads one handshake frame, the whole of it before `deadline` (a peer sending a byte now and
/// then does not keep the connection).
pub(crate) fn read_clear(s: &mut TcpStream, deadline: Instant) -> io::Result<Handshake> {
    let mut head = [0u8; 4];
    read_by(s, &mut head, deadline)?;
    let len = u32::from_le_bytes(head) as usize;
    if len > MAX_HELLO {
        return Err(bad("a handshake frame too long"));
    }
    let mut body = vec![0u8; len];
    read_by(s, &mut body, deadline)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn read_by(s: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the handshake took too long"));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(buf) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed in the handshake")),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The client's side: proves `me` to `peer` (whose public key the round's member list gives)
/// and checks `peer` proves itself back; answers the sealed channel.
pub(crate) fn client(
    mut s: TcpStream,
    identity: &Identity,
    round: u64,
    me: &str,
    peer: &str,
    peer_key: &[u8; KEY_LEN],
    deadline: Instant,
) -> io::Result<Channel> {
    let client_nonce = fresh_nonce()?;
    write_clear(
        &mut s,
        &Handshake::Hello { round, node: me.to_owned(), to: peer.to_owned(), nonce: hex(&client_nonce) },
    )?;
    let (server_nonce, proof) = match read_clear(&mut s, deadline)? {
        Handshake::Challenge { nonce, proof } => (nonce, proof),
        Handshake::Refused { error } => return Err(io::Error::new(io::ErrorKind::PermissionDenied, error)),
        _ => return Err(bad("the peer did not answer a hello with a challenge")),
    };
    let server_nonce = parse_public(&server_nonce).ok_or_else(|| bad("a malformed nonce"))?;
    let shared = identity.shared_with(peer_key)?;
    let keys = session(
        &shared,
        &Transcript {
            round,
            client: me,
            server: peer,
            client_key: &identity.public,
            server_key: peer_key,
            client_nonce: &client_nonce,
            server_nonce: &server_nonce,
        },
    );
    if !unhex(&proof).is_some_and(|p| same(&p, &keys.server_proof)) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("the agent answering as node {peer} could not prove it is"),
        ));
    }
    write_clear(&mut s, &Handshake::Proof { proof: hex(&keys.client_proof) })?;
    Ok(Channel::new(s, &keys.to_server, &keys.to_client))
}

/// The server's side: `lookup(round, node)` answers this agent's own node id in that round and
/// the public key of `node`, a member of it (else why not). Answers the channel, the round and
/// the proven node.
pub(crate) fn server(
    mut s: TcpStream,
    identity: &Identity,
    deadline: Instant,
    lookup: impl FnOnce(u64, &str) -> Result<(String, [u8; KEY_LEN]), String>,
) -> io::Result<(Channel, u64, String)> {
    let Handshake::Hello { round, node, to, nonce } = read_clear(&mut s, deadline)? else {
        let _ = write_clear(&mut s, &Handshake::Refused { error: "a connection starts with a hello".into() });
        return Err(bad("no hello"));
    };
    let refuse = |s: &mut TcpStream, why: String| {
        let _ = write_clear(s, &Handshake::Refused { error: why.clone() });
        Err(io::Error::new(io::ErrorKind::PermissionDenied, why))
    };
    let Some(client_nonce) = parse_public(&nonce) else { return refuse(&mut s, "a malformed nonce".into()) };
    let (me, client_key) = match lookup(round, &node) {
        Ok(found) => found,
        Err(why) => return refuse(&mut s, why),
    };
    if to != me {
        return refuse(&mut s, format!("this agent is not node {}", to.chars().take(200).collect::<String>()));
    }
    if node == me {
        return refuse(&mut s, format!("node {node} is this agent"));
    }
    let server_nonce = fresh_nonce()?;
    let shared = identity.shared_with(&client_key)?;
    let keys = session(
        &shared,
        &Transcript {
            round,
            client: &node,
            server: &me,
            client_key: &client_key,
            server_key: &identity.public,
            client_nonce: &client_nonce,
            server_nonce: &server_nonce,
        },
    );
    write_clear(&mut s, &Handshake::Challenge { nonce: hex(&server_nonce), proof: hex(&keys.server_proof) })?;
    let proven = match read_clear(&mut s, deadline)? {
        Handshake::Proof { proof } => unhex(&proof).is_some_and(|p| same(&p, &keys.client_proof)),
        _ => false,
    };
    if !proven {
        return refuse(&mut s, format!("node {node} could not prove it is a member of round {round}"));
    }
    Ok((Channel::new(s, &keys.to_client, &keys.to_server), round, node))
}

/// One direction's key and its frame counter (the nonce: never used twice with one key).
struct Direction {
    key: LessSafeKey,
    counter: u64,
}

impl Direction {
    fn new(key: &[u8; 32]) -> Direction {
        let key = UnboundKey::new(&AES_256_GCM, key).expect("32 bytes is an AES-256 key");
        Direction { key: LessSafeKey::new(key), counter: 0 }
    }

    fn nonce(&mut self) -> io::Result<Nonce> {
        let mut n = [0u8; NONCE_LEN];
        n[4..].copy_from_slice(&self.counter.to_be_bytes());
        self.counter = self.counter.checked_add(1).ok_or_else(|| bad("a connection's frames are exhausted"))?;
        Ok(Nonce::assume_unique_for_key(n))
    }
}

/// A connection after the handshake: every frame sealed (AES-256-GCM), its length authenticated.
pub(crate) struct Channel {
    stream: TcpStream,
    send: Direction,
    recv: Direction,
    buf: Vec<u8>,
}

impl Channel {
    fn new(stream: TcpStream, send: &[u8; 32], recv: &[u8; 32]) -> Channel {
        Channel { stream, send: Direction::new(send), recv: Direction::new(recv), buf: Vec::new() }
    }

    pub(crate) fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Seals `self.buf[4..4 + len]` in place (its length in front, the tag behind) and sends it.
    fn send_sealed(&mut self, len: usize) -> io::Result<()> {
        let head = (len as u32).to_le_bytes();
        self.buf[..4].copy_from_slice(&head);
        let nonce = self.send.nonce()?;
        let tag = self
            .send
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(head), &mut self.buf[4..4 + len])
            .map_err(|_| io::Error::other("cannot seal a frame"))?;
        self.buf.truncate(4 + len);
        self.buf.extend_from_slice(tag.as_ref());
        self.stream.write_all(&self.buf)
    }

    /// Receives one sealed frame of at most `max` bytes; its plaintext is `self.buf[..len]`.
    fn recv_sealed(&mut self, max: usize) -> io::Result<usize> {
        let mut head = [0u8; 4];
        self.stream.read_exact(&mut head)?;
        let len = u32::from_le_bytes(head) as usize;
        if len > max {
            return Err(bad("a sealed frame longer than allowed"));
        }
        self.buf.resize(len + TAG_LEN, 0);
        self.stream.read_exact(&mut self.buf)?;
        let nonce = self.recv.nonce()?;
        self.recv
            .key
            .open_in_place(nonce, Aad::from(head), &mut self.buf)
            .map_err(|_| bad("a frame that does not open: changed, replayed or not from the peer"))?;
        Ok(len)
    }

    pub(crate) fn send<T: Serialize>(&mut self, v: &T) -> io::Result<()> {
        let body = serde_json::to_vec(v).map_err(io::Error::other)?;
        if body.len() > MAX_FRAME {
            return Err(bad("a frame too long to send"));
        }
        self.buf.clear();
        self.buf.extend_from_slice(&[0u8; 4]);
        self.buf.extend_from_slice(&body);
        self.send_sealed(body.len())
    }

    pub(crate) fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> io::Result<T> {
        let len = self.recv_sealed(MAX_FRAME)?;
        serde_json::from_slice(&self.buf[..len]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// Sends `len` bytes of `file` from its start, sealed a chunk at a time.
    pub(crate) fn send_file(&mut self, file: &File, len: u64) -> io::Result<()> {
        let mut at = 0u64;
        while at < len {
            let n = ((len - at) as usize).min(CHUNK);
            self.buf.resize(4 + n, 0);
            file.read_exact_at(&mut self.buf[4..4 + n], at)?;
            self.send_sealed(n)?;
            at += n as u64;
        }
        Ok(())
    }

    /// Receives `len` bytes into `file` from its start.
    pub(crate) fn receive_into(&mut self, file: &File, len: u64) -> io::Result<()> {
        let mut at = 0u64;
        while at < len {
            let n = self.recv_sealed(CHUNK)?;
            if n == 0 || at + n as u64 > len {
                return Err(bad("a part's pieces do not add up to its length"));
            }
            file.write_all_at(&self.buf[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }

    /// Reads and drops `len` bytes of a part refused before they came.
    pub(crate) fn drain(&mut self, len: u64) -> io::Result<()> {
        let mut at = 0u64;
        while at < len {
            let n = self.recv_sealed(CHUNK)?;
            if n == 0 {
                return Err(bad("an empty piece of a part"));
            }
            at += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    fn transcript<'a>(keys: &'a [[u8; 32]; 4]) -> Transcript<'a> {
        Transcript {
            round: 3,
            client: "a",
            server: "b",
            client_key: &keys[0],
            server_key: &keys[1],
            client_nonce: &keys[2],
            server_nonce: &keys[3],
        }
    }

    #[test]
    fn both_ends_derive_one_session_and_any_other_input_derives_another() {
        let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
        let keys = [a.public, b.public, [1; 32], [2; 32]];
        let from_a = session(&a.shared_with(&b.public).unwrap(), &transcript(&keys));
        let from_b = session(&b.shared_with(&a.public).unwrap(), &transcript(&keys));
        assert_eq!(from_a, from_b);
        // A stranger (its own key) or any other field: nothing of the session.
        let stranger = Identity::generate().unwrap();
        let s = session(&stranger.shared_with(&b.public).unwrap(), &transcript(&keys));
        assert_ne!(s.client_proof, from_a.client_proof);
        let mut other = keys;
        other[3] = [9; 32];
        assert_ne!(session(&a.shared_with(&b.public).unwrap(), &transcript(&other)).client_proof, from_a.client_proof);
        let t = Transcript { server: "c", ..transcript(&keys) };
        assert_ne!(session(&a.shared_with(&b.public).unwrap(), &t).client_proof, from_a.client_proof);
        let t = Transcript { round: 4, ..transcript(&keys) };
        assert_ne!(session(&a.shared_with(&b.public).unwrap(), &t).client_proof, from_a.client_proof);
    }

    #[test]
    fn public_keys_parse_only_as_64_lowercase_hex_digits() {
        let id = Identity::generate().unwrap();
        assert_eq!(parse_public(&id.public_hex()), Some(id.public));
        for bad in ["", "zz", &"A".repeat(64), &"a".repeat(62), &"a".repeat(66)] {
            assert_eq!(parse_public(bad), None, "{bad}");
        }
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        for x in [&c, &s] {
            x.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        (c, s)
    }

    #[test]
    fn a_sealed_frame_changed_on_the_way_does_not_open() {
        let (c, s) = pair();
        let (mut a, mut b) = (Channel::new(c, &[1; 32], &[2; 32]), Channel::new(s, &[2; 32], &[1; 32]));
        a.send(&"first").unwrap();
        assert_eq!(b.recv::<String>().unwrap(), "first");
        // A byte flipped in the next frame (as a man in the middle would): refused.
        a.buf.clear();
        a.buf.extend_from_slice(&[0u8; 4]);
        a.buf.extend_from_slice(b"\"x\"");
        let head = 3u32.to_le_bytes();
        a.buf[..4].copy_from_slice(&head);
        let nonce = a.send.nonce().unwrap();
        let tag = a.send.key.seal_in_place_separate_tag(nonce, Aad::from(head), &mut a.buf[4..7]).unwrap();
        a.buf.extend_from_slice(tag.as_ref());
        a.buf[5] ^= 1;
        a.stream.write_all(&a.buf).unwrap();
        assert!(b.recv::<String>().is_err());
    }

    #[test]
    fn a_frame_replayed_on_a_connection_does_not_open() {
        let (c, s) = pair();
        let (mut a, mut b) = (Channel::new(c, &[1; 32], &[2; 32]), Channel::new(s, &[2; 32], &[1; 32]));
        a.send(&"once").unwrap();
        let sent = a.buf.clone();
        assert_eq!(b.recv::<String>().unwrap(), "once");
        a.stream.write_all(&sent).unwrap();
        assert!(b.recv::<String>().is_err(), "the same frame twice");
    }
}
