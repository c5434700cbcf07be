//! The agent's typed configuration: what the launcher parsed and validated, nothing left as text.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use rlaunch::contract::{Endpoint, Host, HostPort};
use rlaunch_rendezvous::JobSettings;

use crate::output::StdSet;

/// A setting given for all local ranks at once (`3`) or rank by rank (`0:1,1:2`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerRank<T> {
    All(T),
    Ranks(BTreeMap<u32, T>),
}

impl<T: Copy + Default> PerRank<T> {
    /// The value for `local_rank`; ranks not named get the default (torchrun's behaviour).
    pub fn get(&self, local_rank: u32) -> T {
        match self {
            PerRank::All(v) => *v,
            PerRank::Ranks(m) => m.get(&local_rank).copied().unwrap_or_default(),
        }
    }
}

impl<T: Default> Default for PerRank<T> {
    fn default() -> Self {
        PerRank::All(T::default())
    }
}

/// How this agent finds the other nodes of the job.
#[derive(Debug, Clone)]
pub enum RendezvousConfig {
    /// One node, no service: the agent is the whole job.
    Standalone,
    /// Fixed membership (`--rdzv-backend static`): node `node_rank` of `nnodes`; group rank 0
    /// hosts the workers' store at `master` (port 0: the OS picks, single node only).
    Static { node_rank: u32, nnodes: u32, master: HostPort },
    /// A rendezvous service or etcd decides membership, rounds and restarts.
    Dynamic(DynamicRendezvous),
}

/// Settings of an elastic rendezvous (`--rdzv-backend rlaunch|c10d|etcd`).
#[derive(Debug, Clone)]
pub struct DynamicRendezvous {
    pub backend: DynamicBackend,
    /// Never empty.
    pub endpoints: Vec<Endpoint>,
    pub token: Option<String>,
    /// `--rdzv-conf tls_ca=PATH`: a private CA bundle (PEM) that `https://` endpoints'
    /// certificates are verified against (none: the system's roots).
    pub tls_ca: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DynamicBackend {
    /// An `rlaunch-rendezvous` server (hosted by this agent when the endpoint is local and
    /// nothing answers).
    Server,
    /// Agents run the round state machine directly on etcd v3.
    Etcd,
}

/// Everything the agent needs to run one node of a job.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The worker's argv: the program and its arguments (already wrapped in `python3 -u` where
    /// the launcher decided so).
    pub program: Vec<OsString>,
    pub nproc_per_node: u32,
    pub role: String,
    pub run_id: String,
    /// The job's settings, the one place of each: the restart budget (`--max-restarts`), the
    /// stop grace (SIGTERM to SIGKILL, `--shutdown-timeout`) and the hang timeout in every
    /// mode; an elastic job's also go to the rendezvous, as every node of the job must give them
    /// (validated once, by the launcher, with [`JobSettings::validate`]).
    pub job: JobSettings,
    pub log_dir: Option<PathBuf>,
    pub redirects: PerRank<StdSet>,
    pub tee: PerRank<StdSet>,
    pub local_ranks_filter: Option<BTreeSet<u32>>,
    pub log_line_prefix_template: String,
    /// The address other nodes reach this one at (`--local-addr`).
    pub local_addr: Option<Host>,
    pub rendezvous: RendezvousConfig,
    /// Contain workers with process groups only, even where a cgroup v2 is writable
    /// (`RLAUNCH_CONTAINMENT=process-group`).
    pub process_groups_only: bool,
    /// Where an elastic agent's workers' store listens (`--store-bind`); by default the
    /// address it advertises.
    pub store_bind: Option<Host>,
    /// Bytes of keys and values the workers' store holds at most (`--store-max-bytes`).
    pub store_max_bytes: usize,
    /// torchrun's `--virtual-local-rank`: `LOCAL_RANK=0` and one visible GPU per worker.
    pub virtual_local_rank: bool,
    /// Signals that stop the job and are forwarded to the workers first
    /// (`--signals-to-handle`); SIGTERM, SIGINT, SIGHUP and SIGQUIT stop it in any case.
    pub handled_signals: Vec<i32>,
    /// On a terminal, the global rank whose terminal gets the agent's stdin (`--stdin-rank`).
    pub stdin_rank: u32,
    /// torchrun's `--numa-binding`: every worker pinned to CPUs near its GPU.
    pub numa_binding: Option<crate::numa::NumaMode>,
    /// torchrun's `--duplicate-stdout-filters`: console lines of stdout containing any of these
    /// also go to `attempt_{n}/filtered_stdout.log`.
    pub duplicate_stdout_filters: Vec<String>,
    /// The same for stderr (`filtered_stderr.log`).
    pub duplicate_stderr_filters: Vec<String>,
    /// The node's memory for snapshots (`--snapshot-memory`, bytes): the parts its workers save
    /// and the copies it keeps for another node. 0: no snapshots (`save` and `load` do nothing).
    pub snapshot_memory: u64,
    /// Warm workers (`--warm-workers`): a Python interpreter per local rank, its program's
    /// modules imported, waiting for the next round (`warm.rs`).
    pub warm_workers: bool,
}

impl AgentConfig {
    /// A single-node configuration with torchrun's defaults, for tests and embedding.
    pub fn standalone(program: Vec<OsString>, nproc_per_node: u32) -> AgentConfig {
        AgentConfig {
            program,
            nproc_per_node,
            role: "default".into(),
            run_id: "none".into(),
            job: JobSettings { max_restarts: 0, stop_grace: Duration::from_secs(5), ..JobSettings::default() },
            log_dir: None,
            redirects: PerRank::default(),
            tee: PerRank::default(),
            local_ranks_filter: None,
            log_line_prefix_template: DEFAULT_PREFIX_TEMPLATE.into(),
            local_addr: None,
            rendezvous: RendezvousConfig::Standalone,
            process_groups_only: false,
            store_bind: None,
            store_max_bytes: rlaunch::store::DEFAULT_MAX_TOTAL_BYTES,
            virtual_local_rank: false,
            handled_signals: crate::core::DEFAULT_HANDLED_SIGNALS.to_vec(),
            stdin_rank: 0,
            numa_binding: None,
            duplicate_stdout_filters: Vec::new(),
            duplicate_stderr_filters: Vec::new(),
            snapshot_memory: crate::snapstore::default_cap(),
            warm_workers: true,
        }
    }
}

/// `[default0]:` — torchrun's role-and-rank prefix, with the global rank so that prefixes stay
/// unique across nodes (on one node the global and local ranks coincide).
pub const DEFAULT_PREFIX_TEMPLATE: &str = "[${role_name}${rank}]:";
