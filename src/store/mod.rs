//! The rendezvous key-value store every worker reaches at `MASTER_ADDR:MASTER_PORT`: a server
//! and a blocking client speaking PyTorch's c10d `TCPStore` wire protocol.
//!
//! The agent of group rank 0 hosts a [`StoreServer`]; unmodified torch clients
//! (`torch.distributed.TCPStore`, `init_process_group(init_method="env://")` with
//! `TORCHELASTIC_USE_AGENT_STORE=True`) and the Rust runtime's [`StoreClient`] use it.
//!
//! Code map: `protocol` (frames, encoding, limits; no state), `state` (keys, values, queues
//! and waiters as a pure state machine), `server` (tokio, one task per connection), `client`
//! (std::net, blocking).
//!
//! Invariants: a misbehaving client only ever loses its own connection; nothing stored is
//! dropped when a connection ends; a wait is released by a change to one of its keys, never
//! by polling; the server allocates memory only for bytes actually received.

mod client;
pub mod protocol;
mod server;
pub mod state;

use std::time::Duration;

pub use client::{connect_udp, probe, probe_udp, serve_udp_probes, PrefixStore, StoreClient, PROBE_DATAGRAM};
pub use protocol::Limits;
pub use server::{
    admit, bind, default_max_connections, Admission, ServerConfig, StoreHandle, StoreServer, DEFAULT_MAX_TOTAL_BYTES,
    FIRST_FRAME_TIMEOUT, MAX_CONNECTIONS_CEILING, MAX_UNVALIDATED,
};

/// Raises this process's soft open-file limit to its hard one (an infinite hard limit: the
/// kernel's `fs.nr_open`) and returns the soft limit now in force. A server of thousands of
/// connections (a job's store, the rendezvous service) runs out at the common soft limit 1024.
pub fn raise_open_files() -> std::io::Result<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut target = lim.rlim_max;
    if target == libc::RLIM_INFINITY {
        // An infinite soft limit is invalid for descriptors; fs.nr_open is the kernel's ceiling.
        let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")?;
        target = nr_open.trim().parse().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    }
    if lim.rlim_cur < target {
        lim.rlim_cur = target;
        // SAFETY: setrlimit only reads the struct passed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(lim.rlim_cur)
}

/// A failed store operation, as seen by a [`StoreClient`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot connect to the store at {address} within {timeout:?}")]
    Connect {
        address: String,
        timeout: Duration,
        #[source]
        source: std::io::Error,
    },
    #[error("store at {address}: {op} of key {key:?} failed")]
    Io {
        address: String,
        op: &'static str,
        key: String,
        #[source]
        source: std::io::Error,
    },
    #[error("store at {address}: {op} of key {key:?} timed out after {timeout:?}")]
    Timeout { address: String, op: &'static str, key: String, timeout: Duration },
    #[error("store at {address}: unexpected reply to {op} of key {key:?}: {detail}")]
    Protocol { address: String, op: &'static str, key: String, detail: String },
    #[error("{what} of {len} bytes for key {key:?} exceeds the store limit of {limit} bytes")]
    TooLarge { key: String, what: &'static str, len: u64, limit: u64 },
    #[error("store at {address}: cannot {op}, the connection failed earlier")]
    Broken { address: String, op: &'static str },
}

impl StoreError {
    /// Whether this is a timeout (of a wait, a `get`, or a reply).
    pub fn is_timeout(&self) -> bool {
        matches!(self, StoreError::Timeout { .. })
    }
}

#[cfg(test)]
mod tests;
