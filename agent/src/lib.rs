//! rlaunch's per-node elastic agent: takes part in the rendezvous, hosts the workers' store on
//! group rank 0, starts one worker per local rank with torchrun's environment, supervises them,
//! restarts the group within the restart budget, relays signals, and reports the root cause of
//! a failure.
//!
//! `run(config)` returns a [`RunOutcome`]; [`RunOutcome::exit_code`] is the one place that maps
//! outcomes to the launcher's exit code.

pub mod beats;
pub mod config;
pub mod contain;
pub mod core;
mod driver;
mod elastic;
pub mod fingerprint;
pub mod hang;
mod hangwatch;
pub mod logdir;
pub mod numa;
pub mod output;
pub mod process;
pub mod progress;
mod random;
pub mod report;
pub mod rundir;
pub mod snapshots;
pub mod snapstore;
pub mod supervisor;
pub mod warm;
pub mod workers;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use tokio::signal::unix::{signal, SignalKind};
use tracing::{info_span, warn, Instrument};

use rlaunch::contract::HostPort;
use rlaunch::env::WorkerEnv;
use rlaunch::store::{ServerConfig, StoreHandle, StoreServer};

pub use config::{AgentConfig, DynamicBackend, DynamicRendezvous, PerRank, RendezvousConfig};
use output::{render_prefix, Console, StdSet, StdinRouter};
pub use report::{Exit, RootCause};
use workers::{worker_dir, WorkerSpec};

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
    LogRoot(#[from] logdir::LogDirError),
    #[error("cannot serve the workers' store on {addr}")]
    Store {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot bind the workers to CPUs (numa binding {mode}): {reason}")]
    NumaBinding { mode: &'static str, reason: String },
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("rendezvous failed: {message}")]
    Rendezvous {
        message: String,
        #[source]
        source: Option<std::sync::Arc<rlaunch_rendezvous::RdzvError>>,
    },
}

pub use core::RunOutcome;

/// The agent's signal handlers: every signal it stops on or relays arrives here, in order.
pub(crate) struct Signals {
    rx: tokio::sync::mpsc::UnboundedReceiver<i32>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Signals {
    /// Handles the stop signals, SIGUSR1 and SIGUSR2 (relayed), and whatever else `handled`
    /// names (`--signals-to-handle`).
    pub(crate) fn install(handled: &[i32]) -> std::io::Result<Signals> {
        let mut all: Vec<i32> = core::DEFAULT_HANDLED_SIGNALS.to_vec();
        all.extend([libc::SIGUSR1, libc::SIGUSR2]);
        all.extend_from_slice(handled);
        all.sort_unstable();
        all.dedup();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for sig in all {
            let mut stream = signal(SignalKind::from_raw(sig))?;
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send(sig).is_err() {
                        break;
                    }
                }
            }));
        }
        Ok(Signals { rx, tasks })
    }

    /// The next signal; the core decides which stop the job and which are relayed.
    pub(crate) async fn next(&mut self) -> i32 {
        match self.rx.recv().await {
            Some(sig) => sig,
            // The tasks live as long as this; never reached, but waiting forever is right.
            None => std::future::pending().await,
        }
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The name this host goes by, for reports.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Runs this node's part of the job to the end.
pub async fn run(config: AgentConfig) -> Result<RunOutcome, AgentError> {
    let span = info_span!("run", run_id = %config.run_id);
    run_inner(config).instrument(span).await
}

async fn run_inner(config: AgentConfig) -> Result<RunOutcome, AgentError> {
    // No process of this user, the workers included, may read this agent's memory (its
    // snapshot key's private half, every rank's parts) through ptrace or /proc/<pid>/mem, and
    // no core dump of it is written. Workers exec their program, which makes them dumpable
    // again (py-spy still reads their stacks).
    // SAFETY: prctl(PR_SET_DUMPABLE) takes plain integers and touches no memory of ours.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        warn!(error = %std::io::Error::last_os_error(), "cannot make the agent undumpable");
    }
    // The stores and the probe endpoint hold a descriptor per client: the common soft limit of
    // 1024 would run out long before the connection caps do (issue 26, item 3).
    match rlaunch::store::raise_open_files() {
        Ok(files) => tracing::debug!(files, "open-file limit"),
        Err(e) => warn!(error = %e, "cannot raise the open-file limit"),
    }
    let host = hostname();
    let agent_env: BTreeMap<String, String> = std::env::vars().collect();
    let mut signals = Signals::install(&config.handled_signals).map_err(AgentError::Signals)?;
    let console = Console::start();
    // On a terminal, stdin goes to one worker's terminal (`--stdin-rank`).
    // Only typed input: piped data would pass through a terminal's line rules (and its 4 KiB
    // line limit) on the way.
    let stdin_is_tty = std::io::IsTerminal::is_terminal(&std::io::stdin());
    let stdin = (console.tty && stdin_is_tty).then(|| StdinRouter::start(console.clone()));
    let (log_root, temp_logs) = log_root(&config)?;
    let log_root = std::sync::Arc::new(log_root);
    let cpus = numa_binding(&config, &agent_env)?;
    let choice = if config.process_groups_only { Some("process-group") } else { None };
    let containment = std::sync::Arc::new(contain::Containment::detect(config.nproc_per_node, choice));
    // Snapshots in this agent's memory (`--snapshot-memory 0`: none, but `import rlaunch` still
    // works). A store that cannot start leaves the job running without them, said once.
    let progress = std::sync::Arc::new(progress::Tracker::default());
    let snapshots = snapstore::SnapStore::start(config.snapshot_memory, progress.clone())
        .map_err(|e| warn!(error = %e, "cannot start the snapshot store: snapshots are off"))
        .ok();
    let warm = config.warm_workers.then(|| warm::WarmPool::new(&config.program, containment.clone())).flatten();
    let ctx = Ctx {
        warm: warm.as_ref(),
        snapshots: snapshots.as_ref(),
        progress: &progress,
        containment: &containment,
        host: &host,
        agent_env: &agent_env,
        console: &console,
        stdin,
        log_root: &log_root,
        term_size: process::terminal_size(libc::STDOUT_FILENO),
        cpus,
    };
    let outcome = driver::run(&config, &ctx, &mut signals).await;
    // Warm workers never used end here, before the job's cgroups go.
    drop(warm);
    // Every worker is gone. The job's cgroups go with the last holder of this (a worker group
    // task may still hold it briefly); if the process ends first, the watchdog removes them.
    drop(containment);
    console.flush();
    if let Ok(RunOutcome::Failed { root_cause, .. }) = &outcome {
        // Its text may come from another node (through the rendezvous): no escapes on our terminal.
        eprint!("{}", rlaunch::terminal::sanitize(&root_cause.render()));
        eprintln!("rlaunch: the workers' logs are kept in {}", log_root.path().display());
        write_agent_error_file(&log_root, root_cause, &agent_env);
    }
    if temp_logs && matches!(outcome, Ok(RunOutcome::Succeeded { .. })) {
        let _ = std::fs::remove_dir_all(log_root.path());
    }
    outcome
}

/// What every way of running a node shares: where it runs, its environment, console and logs.
pub(crate) struct Ctx<'a> {
    /// The node's warm workers, when they are on and the program is Python.
    pub warm: Option<&'a warm::WarmPool>,
    /// The node's snapshot store, when snapshots are on.
    pub snapshots: Option<&'a snapstore::SnapStore>,
    /// How far the running round got (the recovery accounting).
    pub progress: &'a std::sync::Arc<progress::Tracker>,
    pub containment: &'a std::sync::Arc<contain::Containment>,
    pub host: &'a str,
    pub agent_env: &'a BTreeMap<String, String>,
    pub console: &'a Console,
    pub stdin: Option<StdinRouter>,
    /// The run's log directory, held open: files are made through it (see [`logdir`]).
    pub log_root: &'a std::sync::Arc<logdir::LogRoot>,
    /// The agent's terminal's size (rows, columns), when stdout is one.
    pub term_size: Option<(u16, u16)>,
    /// Each local rank's CPUs (`--numa-binding`).
    pub cpus: Option<Vec<libc::cpu_set_t>>,
}

/// `--numa-binding`: every local rank's CPUs, from the node's topology in sysfs
/// (`RLAUNCH_SYSFS`, default `/sys`) and the GPUs the agent may use (`CUDA_VISIBLE_DEVICES`);
/// decided before any worker starts, so a node where the policy cannot apply fails at once.
fn numa_binding(
    config: &AgentConfig,
    agent_env: &BTreeMap<String, String>,
) -> Result<Option<Vec<libc::cpu_set_t>>, AgentError> {
    let Some(mode) = config.numa_binding else { return Ok(None) };
    let root = PathBuf::from(agent_env.get("RLAUNCH_SYSFS").map(String::as_str).unwrap_or("/sys"));
    let fail = |e: numa::NumaError| AgentError::NumaBinding { mode: mode.as_str(), reason: e.to_string() };
    let allowed = numa::allowed_cpus().map_err(fail)?;
    let topology = numa::Topology::read(&root, &allowed).map_err(fail)?;
    let visible = agent_env.get("CUDA_VISIBLE_DEVICES").map(String::as_str);
    let topology = topology.with_visible_devices(visible).map_err(fail)?;
    let mut sets = Vec::new();
    for local_rank in 0..config.nproc_per_node {
        let cpus = numa::cpus_for(&topology, mode, local_rank as usize).map_err(fail)?;
        tracing::info!(local_rank, cpus = %numa::format_cpu_list(&cpus), mode = mode.as_str(), "numa binding");
        sets.push(numa::to_cpu_set(&cpus));
    }
    Ok(Some(sets))
}

pub(crate) async fn start_store(bind: &str, max_total_bytes: usize) -> Result<StoreHandle, AgentError> {
    let addr: SocketAddr = tokio::net::lookup_host(bind).await.ok().and_then(|mut it| it.next()).ok_or_else(|| {
        AgentError::Store { addr: bind.into(), source: std::io::Error::other("cannot resolve address") }
    })?;
    // On a thread of its own, so the workers' bootstrap never waits behind the agent's work.
    StoreServer::start_dedicated(addr, ServerConfig { max_total_bytes, ..ServerConfig::default() })
        .map_err(|source| AgentError::Store { addr: bind.into(), source })
}

/// `--log-dir/{run_id}_{pid}`, or a private temporary directory removed after a successful run.
/// Either is created here, exclusively, and held open: an existing directory or a planted
/// symlink is never used, and a later rename of it changes nothing (see [`logdir`]). The
/// temporary one is `{base}/rlaunch_{run_id}_{pid}_{64 random bits}`, mode 0700, in the first
/// of `$TMPDIR` and `/tmp` that no other user may rename entries of ([`rundir::bases`]).
fn log_root(config: &AgentConfig) -> Result<(logdir::LogRoot, bool), AgentError> {
    let name = format!("{}_{}", sanitize(&config.run_id), std::process::id());
    match &config.log_dir {
        Some(d) => Ok((logdir::LogRoot::create_in(d, &name)?, false)),
        None => {
            let mut tries = 0;
            loop {
                let random = (u64::from(random::rand_u32()) << 32) | u64::from(random::rand_u32());
                let base = rundir::bases().first().ok_or_else(|| logdir::LogDirError::Io {
                    path: std::env::temp_dir(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        "neither $TMPDIR nor /tmp is a directory only root and this user may rename entries of: \
                             give --log-dir",
                    ),
                })?;
                let root = base.join(format!("rlaunch_{name}_{random:016x}"));
                match logdir::LogRoot::create_private(&root, 0o700) {
                    Ok(r) => return Ok((r, true)),
                    Err(logdir::LogDirError::Io { source, .. })
                        if source.kind() == std::io::ErrorKind::AlreadyExists && tries < 16 =>
                    {
                        tries += 1
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
}

fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

pub(crate) fn worker_specs(
    config: &AgentConfig,
    p: &core::Placement,
    master: &HostPort,
    ctx: &Ctx<'_>,
) -> Vec<WorkerSpec> {
    let (log_root, host) = (ctx.log_root.path(), ctx.host);
    let restart_count = p.restart_count;
    let signals: Vec<String> = config.handled_signals.iter().map(|s| rlaunch::contract::signal_name(*s)).collect();
    let signals_to_handle = signals.join(",");
    (0..config.nproc_per_node)
        .map(|local_rank| {
            // The rendezvous bounds nodes and workers per node, so this never saturates there.
            let rank = p.rank_offset.saturating_add(local_rank);
            let dir = worker_dir(log_root, restart_count, local_rank);
            let redirect = config.redirects.get(local_rank);
            let tee = config.tee.get(local_rank);
            let shown = config.local_ranks_filter.as_ref().is_none_or(|f| f.contains(&local_rank));
            // torchrun: a redirected stream goes to its file only, a teed one to both; with a
            // log directory every stream is also kept in a file.
            let files = if config.log_dir.is_some() {
                StdSet::ALL
            } else {
                StdSet { stdout: redirect.stdout || tee.stdout, stderr: redirect.stderr || tee.stderr }
            };
            let console = StdSet {
                stdout: shown && (!redirect.stdout || tee.stdout),
                stderr: shown && (!redirect.stderr || tee.stderr),
            };
            let prefix = render_prefix(&config.log_line_prefix_template, &config.role, rank, local_rank, host);
            let tty = ctx.console.tty;
            let terminal = process::Terminal {
                stdout: tty && console.stdout,
                stderr: ctx.console.stderr_tty && console.stderr,
                stdin: ctx.stdin.is_some() && tty && console.stdout && rank == config.stdin_rank,
                // The worker's lines are this much narrower than the terminal: its prefix.
                size: ctx.term_size.map(|(rows, cols)| {
                    let width = prefix.chars().count().min(usize::from(u16::MAX)) as u16;
                    (rows, cols.saturating_sub(width).max(20))
                }),
            };
            WorkerSpec {
                env: WorkerEnv {
                    rank,
                    local_rank,
                    group_rank: p.group_rank,
                    role_rank: rank,
                    role_name: config.role.clone(),
                    local_world_size: config.nproc_per_node,
                    world_size: p.world_size,
                    group_world_size: p.group_world_size,
                    role_world_size: p.world_size,
                    master_addr: master.host().to_owned(),
                    master_port: master.port(),
                    restart_count,
                    max_restarts: config.job.max_restarts,
                    run_id: config.run_id.clone(),
                    use_agent_store: true,
                    error_file: Some(dir.join("error.json").to_string_lossy().into_owned()),
                    signals_to_handle: signals_to_handle.clone(),
                },
                prefix,
                terminal,
                cpus: ctx.cpus.as_ref().map(|sets| sets[local_rank as usize]),
                // Hang detection reads it; an elastic job's heartbeats carry the Rust runtime's
                // step waits from it (stragglers). Otherwise the log directory is torchrun's.
                heartbeat: (p.hang_timeout.is_some() || matches!(config.rendezvous, RendezvousConfig::Dynamic(_)))
                    .then(|| dir.join("heartbeat")),
                heartbeat_env: p.hang_timeout.is_some(),
                overrides: {
                    let mut o = if config.virtual_local_rank {
                        virtual_local_rank(local_rank, ctx.agent_env)
                    } else {
                        Vec::new()
                    };
                    o.extend(ctx.snapshots.map(|s| s.worker_env(ctx.agent_env)).unwrap_or_default());
                    o
                },
                dir,
                files,
                console,
            }
        })
        .collect()
}

/// What this node's warm workers are started with: each rank's terminal and CPUs as `p` (or,
/// before any round, a first round of this node alone) gives them, and of the environment the
/// part every round's worker of that rank gets.
pub(crate) fn warm_templates(config: &AgentConfig, p: Option<&core::Placement>, ctx: &Ctx<'_>) -> Vec<warm::Template> {
    let first = core::Placement {
        round: 0,
        group_rank: 0,
        group_world_size: 1,
        rank_offset: 0,
        world_size: config.nproc_per_node,
        master: None,
        restart_count: 0,
        hang_timeout: None,
        fingerprint_diff: Vec::new(),
        members: Vec::new(),
    };
    let p = p.unwrap_or(&first);
    let master = HostPort::new("127.0.0.1", 0).expect("a loopback address is a valid host");
    worker_specs(config, p, &master, ctx).iter().map(|spec| warm_template(spec, ctx.agent_env)).collect()
}

/// The warm worker a worker of `spec` can be made from: `spec`'s environment but for what
/// changes every attempt, its terminal and CPUs.
pub(crate) fn warm_template(spec: &WorkerSpec, agent_env: &BTreeMap<String, String>) -> warm::Template {
    use rlaunch::env::{ERROR_FILE, MASTER_ADDR, MASTER_PORT, RESTART_COUNT};
    let mut env: Vec<(String, String)> = spec
        .env
        .to_vars(agent_env)
        .into_iter()
        .filter(|(k, _)| ![MASTER_ADDR, MASTER_PORT, RESTART_COUNT, ERROR_FILE].contains(k))
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    env.extend(spec.overrides.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    warm::Template { local_rank: spec.env.local_rank, env, terminal: spec.terminal, cpus: spec.cpus }
}

/// torchrun's `--virtual-local-rank`: every worker sees its one GPU as device 0 and
/// `LOCAL_RANK=0`; its GPU is the `local_rank`-th of the agent's `HIP_VISIBLE_DEVICES` or
/// `CUDA_VISIBLE_DEVICES` (the launcher checked there are enough), else `local_rank` itself.
pub fn virtual_local_rank(local_rank: u32, agent_env: &BTreeMap<String, String>) -> Vec<(&'static str, String)> {
    let hip = agent_env.get("HIP_VISIBLE_DEVICES").filter(|v| !v.is_empty());
    let parent = hip.or_else(|| agent_env.get("CUDA_VISIBLE_DEVICES"));
    let gpu = parent
        .and_then(|list| list.split(',').nth(local_rank as usize).map(|g| g.trim().to_owned()))
        .unwrap_or_else(|| local_rank.to_string());
    let mut vars = vec![(rlaunch::env::LOCAL_RANK, "0".to_owned()), ("CUDA_VISIBLE_DEVICES", gpu.clone())];
    if hip.is_some() {
        vars.push(("HIP_VISIBLE_DEVICES", gpu));
    }
    vars
}

/// The agent's own error file: `{log_root}/error.json`, and `$TORCHELASTIC_ERROR_FILE` when the
/// agent was given one (as torchrun's `@record`-decorated main writes it).
fn write_agent_error_file(log_root: &logdir::LogRoot, root_cause: &RootCause, agent_env: &BTreeMap<String, String>) {
    let json = root_cause.to_error_file_json();
    let ours = log_root.path().join("error.json");
    let bytes = match serde_json::to_vec_pretty(&json) {
        Ok(b) => b,
        Err(e) => return warn!(error = %e, "cannot render the agent's error file"),
    };
    if let Err(e) = log_root.write_atomically(&ours, &bytes) {
        warn!(path = %ours.display(), error = %e, "cannot write the agent's error file");
    }
    if let Some(f) = agent_env.get(rlaunch::env::ERROR_FILE).map(PathBuf::from) {
        if let Err(e) = report::write_json_atomically(&f, &json) {
            warn!(path = %f.display(), error = %e, "cannot write the agent's error file");
        }
    }
}
