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

fn store_err(what: &'static str, key: &str, e: crate::store::StoreError) -> CommError {
    CommError::Store { what, key: key.to_string(), reason: e.to_string() }
}

/// The agent's TCPStore, through the blocking client.
impl Rendezvous for crate::store::StoreClient {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
        crate::store::StoreClient::set(self, key, value).map_err(|e| store_err("set", key, e))
    }

    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        self.wait(&[key], timeout).map_err(|e| store_err("get", key, e))?;
        crate::store::StoreClient::get(self, key).map_err(|e| store_err("get", key, e))
    }

    fn add(&mut self, key: &str, delta: i64) -> Result<i64, CommError> {
        crate::store::StoreClient::add(self, key, delta).map_err(|e| store_err("add", key, e))
    }
}
