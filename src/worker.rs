//! A worker's entry into the job: read the environment the agent set, connect to the job's
//! store, and form the process group ([`init_from_env`]).
//!
//! Store keys are namespaced `rlaunch/{run_id}/{restart_count}/pg{n}/…`: the agent's store
//! outlives worker restarts, so each attempt (and each group formed within it) gets fresh keys.
//!
//! Tuning variables (all optional): `RLAUNCH_COLLECTIVE_TIMEOUT` (seconds, default 60),
//! `RLAUNCH_BACKEND` (`auto`, `shm`, `tcp`, `hier`), `RLAUNCH_SHM_CHUNK` (bytes),
//! `RLAUNCH_SPIN_US`, `RLAUNCH_IFADDR` (the address other hosts reach this rank at), and
//! `RLAUNCH_FILE_STORE` (a directory used as the store instead of `MASTER_ADDR:MASTER_PORT`,
//! for runs without an agent).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::comm::{BackendKind, CommError, FileStore, PgOptions, ProcessGroup, Rendezvous};
use crate::env::{EnvError, WorkerEnv};

pub const COLLECTIVE_TIMEOUT: &str = "RLAUNCH_COLLECTIVE_TIMEOUT";
pub const BACKEND: &str = "RLAUNCH_BACKEND";
pub const SHM_CHUNK: &str = "RLAUNCH_SHM_CHUNK";
pub const SPIN_US: &str = "RLAUNCH_SPIN_US";
pub const IFADDR: &str = "RLAUNCH_IFADDR";
pub const FILE_STORE: &str = "RLAUNCH_FILE_STORE";

/// Why a worker could not join its process group.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("cannot read the worker environment")]
    Env(#[from] EnvError),
    #[error("environment variable {name}={value:?} is invalid: {reason}")]
    Config { name: &'static str, value: String, reason: String },
    #[error("cannot reach the job's store at {addr}: {reason}")]
    Store { addr: String, reason: String },
    #[error("cannot form the process group")]
    Comm(#[from] CommError),
}

/// Groups formed since the process started, or since the round began (`new_round`).
static GROUPS_FORMED: AtomicUsize = AtomicUsize::new(0);

/// Forms the job's process group from the environment an agent (rlaunch or torchrun) set.
pub fn init_from_env() -> Result<ProcessGroup, InitError> {
    let env = WorkerEnv::from_env()?;
    let opts = options_from(&env, |k| std::env::var(k).ok())?;
    let mut store = connect_store(&env, opts.timeout, |k| std::env::var(k).ok())?;
    Ok(ProcessGroup::new(store.as_mut(), opts)?)
}

/// Group options for `env`, with tuning read through `get` (see the module doc).
pub fn options_from(env: &WorkerEnv, get: impl Fn(&str) -> Option<String>) -> Result<PgOptions, InitError> {
    let mut o = PgOptions::new(env.rank as usize, env.world_size as usize);
    o.group_rank = env.group_rank as usize;
    let n = GROUPS_FORMED.fetch_add(1, Ordering::Relaxed);
    o.namespace = format!("rlaunch/{}/{}/pg{n}", env.run_id, env.restart_count);
    o.master_addr = Some(env.master_addr.clone());
    let bad =
        |name: &'static str, value: String, reason: &str| InitError::Config { name, value, reason: reason.into() };
    if let Some(v) = get(COLLECTIVE_TIMEOUT) {
        let secs: f64 = v.trim().parse().map_err(|_| bad(COLLECTIVE_TIMEOUT, v.clone(), "expected seconds"))?;
        if !(secs > 0.0 && secs.is_finite()) {
            return Err(bad(COLLECTIVE_TIMEOUT, v, "must be positive"));
        }
        o.timeout = Duration::from_secs_f64(secs);
    }
    if let Some(v) = get(BACKEND) {
        o.backend = v.parse::<BackendKind>().map_err(|e| bad(BACKEND, v.clone(), &e.to_string()))?;
    }
    if let Some(v) = get(SHM_CHUNK) {
        o.shm_chunk_bytes = v.trim().parse().map_err(|_| bad(SHM_CHUNK, v.clone(), "expected bytes"))?;
    }
    if let Some(v) = get(SPIN_US) {
        o.spin = Duration::from_micros(v.trim().parse().map_err(|_| bad(SPIN_US, v.clone(), "expected microseconds"))?);
    }
    if let Some(v) = get(IFADDR) {
        o.advertise_addr = Some(v.trim().parse().map_err(|_| bad(IFADDR, v.clone(), "expected an IP address"))?);
    }
    Ok(o)
}

/// The job's store: `RLAUNCH_FILE_STORE` if set, else the TCPStore at `MASTER_ADDR:MASTER_PORT`.
pub fn connect_store(
    env: &WorkerEnv,
    timeout: Duration,
    get: impl Fn(&str) -> Option<String>,
) -> Result<Box<dyn Rendezvous>, InitError> {
    if let Some(dir) = get(FILE_STORE) {
        return Ok(Box::new(FileStore::new(&dir)?));
    }
    let addr = format!("{}:{}", env.master_addr, env.master_port);
    connect_tcp_store(&addr, timeout)
}

fn connect_tcp_store(addr: &str, timeout: Duration) -> Result<Box<dyn Rendezvous>, InitError> {
    // Given up at a round's end (comm::abort_all, from rlaunch::resilient) between attempts.
    match crate::store::StoreClient::connect_until(addr, timeout, crate::comm::aborted) {
        Ok(client) => Ok(Box::new(client)),
        Err(e) => {
            crate::comm::note_failure();
            if crate::comm::aborted() {
                return Err(CommError::Aborted { op: "connecting to the store" }.into());
            }
            Err(InitError::Store { addr: addr.to_string(), reason: e.to_string() })
        }
    }
}

/// Names the next group formed as the first of a round: `rlaunch::resilient::run` calls it as
/// each round begins, so that a process that runs again names its groups as a fresh worker of
/// the round does.
pub(crate) fn new_round() {
    GROUPS_FORMED.store(0, Ordering::Relaxed);
}
