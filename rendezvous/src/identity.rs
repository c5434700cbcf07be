//! Node identity: the secret a join answers, and how the rendezvous recognises it later.
//!
//! A node's first join mints a 256-bit random secret (at the edge: [`mint`]); the job keeps only
//! its SHA-256 digest ([`digest`], in `round::Job::keys`), so neither `status`, a state
//! dump nor etcd's value holds a usable credential. Every later event for the node (heartbeat,
//! watch, failure, success, leave, re-join) must present the secret; [`matches`] compares in
//! constant time. The agent keeps its secret in memory only.

use rand::RngCore;
use sha2::{Digest, Sha256};

/// Bytes of randomness in a secret (hex-encoded on the wire: 64 characters).
pub const SECRET_BYTES: usize = 32;

/// Bytes as lowercase hex, the form every secret, digest and key takes on the wire.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Lowercase hex back to its bytes; `None` for anything else (uppercase included: one spelling
/// per value).
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok()).collect()
}

/// A fresh secret: 256 bits from the thread's CSPRNG (ChaCha, seeded by the OS), hex.
pub fn mint() -> String {
    let mut bytes = [0u8; SECRET_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    hex(&bytes)
}

/// What the job stores for `secret`: its SHA-256, hex.
pub fn digest(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

/// Whether `presented` is the secret whose digest is `stored`, compared in constant time.
pub fn matches(stored: &str, presented: &str) -> bool {
    let given = digest(presented);
    given.len() == stored.len() && given.bytes().zip(stored.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_fresh_and_only_their_own_digest_matches() {
        let (a, b) = (mint(), mint());
        assert_eq!(a.len(), 2 * SECRET_BYTES);
        assert_ne!(a, b);
        assert!(matches(&digest(&a), &a));
        assert!(!matches(&digest(&a), &b));
        assert!(!matches(&digest(&a), ""));
        assert!(!matches(&digest(&a), &digest(&a)), "the digest itself is not the secret");
    }
}

/// A secret on the wire (request bodies): serialized as the plain string, but never printed by
/// `Debug`, so a logged request does not leak a node's credential.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl std::ops::Deref for Secret {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s)
    }
}
