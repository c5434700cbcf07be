//! The few key-value operations the process group needs from a store to bootstrap, as a trait:
//! the agent's TCPStore client implements it, and so does [`super::FileStore`] for tests.

use std::time::Duration;

use super::CommError;

/// Key-value store shared by all ranks of a job.
pub trait Rendezvous: Send {
    /// Sets `key` to `value`, replacing any previous value.
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError>;
    /// Waits up to `timeout` for `key` to exist and returns its value.
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError>;
    /// Atomically adds `delta` to the integer at `key` (absent = 0) and returns the new value.
    fn add(&mut self, key: &str, delta: i64) -> Result<i64, CommError>;
}
