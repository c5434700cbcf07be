//! Why the agent itself (not a worker) could not go on: one error type for the whole crate,
//! each variant keeping its cause whole (the launcher prints the chain).

use std::path::PathBuf;

/// Where the workers' store was to be served: an address, or a host that did not resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreAddr {
    Socket(std::net::SocketAddr),
    Unresolved(rlaunch::contract::HostPort),
}

impl std::fmt::Display for StoreAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreAddr::Socket(a) => write!(f, "{a}"),
            StoreAddr::Unresolved(h) => write!(f, "{h}"),
        }
    }
}

/// Why the agent itself (not a worker) could not go on.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("failed to spawn local rank {local_rank} (`{program}`)")]
    Spawn {
        local_rank: u32,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create log directory {path}")]
    LogDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    LogRoot(#[from] crate::logdir::LogDirError),
    #[error("cannot serve the workers' store on {addr}")]
    Store {
        addr: StoreAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot bind the workers to CPUs (numa binding {mode})")]
    NumaBinding {
        mode: &'static str,
        #[source]
        source: crate::numa::NumaError,
    },
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("rendezvous failed: {message}")]
    Rendezvous {
        message: String,
        #[source]
        source: Option<std::sync::Arc<rlaunch_rendezvous::RdzvError>>,
    },
}
