//! The command line: torchrun's flags, spellings (`--a-b` and `--a_b`), defaults and `PET_*`
//! environment fallbacks, parsed once into the agent's typed configuration.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};

use rlaunch::contract::{Endpoint, Host};
use rlaunch_agent::config::DEFAULT_PREFIX_TEMPLATE;
use rlaunch_agent::output::StdSet;
use rlaunch_agent::{AgentConfig, DynamicBackend, DynamicRendezvous, PerRank, RendezvousConfig};
use rlaunch_rendezvous::JobSettings;

/// Elastic launcher for distributed training: one worker per local rank with torchrun's
/// environment, supervised, restarted on failure.
#[derive(Debug, Parser)]
#[command(name = "rlaunch", version, about, after_help = EXIT_CODES)]
pub struct Args {
    /// Number of nodes, or a range MIN:MAX for an elastic job.
    #[arg(long, env = "PET_NNODES", default_value = "1:1")]
    pub nnodes: String,

    /// Workers per node: a number, `cpu` (one per core), `gpu` (one per GPU) or `auto`.
    #[arg(
        long = "nproc-per-node",
        alias = "nproc_per_node",
        env = "PET_NPROC_PER_NODE",
        default_value = "1",
        allow_hyphen_values = true
    )]
    pub nproc_per_node: String,

    /// One node, no services: an embedded rendezvous on this host and a random run id.
    #[arg(long, env = "PET_STANDALONE", value_parser = BoolishValueParser::new())]
    pub standalone: bool,

    /// Rendezvous backend: static, rlaunch (alias c10d), or etcd (v3). Default: rlaunch when
    /// --rdzv-endpoint is given (and no --node-rank/--master-addr/--master-port), else static.
    #[arg(long = "rdzv-backend", alias = "rdzv_backend", env = "PET_RDZV_BACKEND")]
    pub rdzv_backend: Option<String>,

    /// Rendezvous endpoint(s), `host:port[,host:port…]`.
    #[arg(long = "rdzv-endpoint", alias = "rdzv_endpoint", env = "PET_RDZV_ENDPOINT", default_value = "")]
    pub rdzv_endpoint: String,

    /// The job's id; every node of one job uses the same. Default for an elastic job: the
    /// scheduler's job id (SLURM_JOB_ID, a Kubernetes Indexed Job's name); static: `none`.
    #[arg(long = "rdzv-id", alias = "rdzv_id", env = "PET_RDZV_ID")]
    pub rdzv_id: Option<String>,

    /// A file holding the rendezvous service's bearer token (instead of `--rdzv-conf token=`,
    /// which `ps` shows).
    #[arg(long = "rdzv-token-file", alias = "rdzv_token_file", env = "PET_RDZV_TOKEN_FILE")]
    pub rdzv_token_file: Option<PathBuf>,

    /// Rendezvous settings `key=value,…` (join_timeout, last_call_timeout, heartbeat_interval,
    /// node_ttl, probe_timeout, peer_interval (0: off), stall_bound in seconds; token).
    #[arg(long = "rdzv-conf", alias = "rdzv_conf", env = "PET_RDZV_CONF", default_value = "")]
    pub rdzv_conf: String,

    /// Restarts of the worker group allowed before the job fails.
    #[arg(long = "max-restarts", alias = "max_restarts", env = "PET_MAX_RESTARTS", default_value_t = 0)]
    pub max_restarts: u32,

    /// Accepted and validated for torchrun compatibility: worker exits are noticed the moment
    /// they happen, so there is nothing to poll.
    #[arg(long = "monitor-interval", alias = "monitor_interval", env = "PET_MONITOR_INTERVAL", default_value = "0.1")]
    pub monitor_interval: String,

    /// Seconds from SIGTERM to SIGKILL when stopping workers.
    #[arg(long = "shutdown-timeout", alias = "shutdown_timeout", env = "PET_SHUTDOWN_TIMEOUT", default_value = "10")]
    pub shutdown_timeout: String,

    /// Accepted for torchrun compatibility; workers are always started as new processes.
    #[arg(
        long = "start-method",
        alias = "start_method",
        env = "PET_START_METHOD",
        default_value = "spawn",
        value_parser = ["spawn", "fork", "forkserver"],
        hide = true
    )]
    pub start_method: String,

    /// Accepted for torchrun compatibility (its event logging handler's name); rlaunch's events
    /// are its log lines and the rendezvous' status.
    #[arg(
        long = "event-log-handler",
        alias = "event_log_handler",
        env = "PET_EVENT_LOG_HANDLER",
        default_value = "null",
        hide = true
    )]
    pub event_log_handler: String,

    /// Accepted for torchrun compatibility (a Python entry point overriding its log layout);
    /// rlaunch's layout is `--log-dir`'s.
    #[arg(long = "logs-specs", alias = "logs_specs", hide = true)]
    pub logs_specs: Option<String>,

    /// The workers' role name.
    #[arg(long, env = "PET_ROLE", default_value = "default")]
    pub role: String,

    /// Run the program as a Python module (`python3 -u -m`).
    #[arg(short = 'm', long, env = "PET_MODULE", value_parser = BoolishValueParser::new())]
    pub module: bool,

    /// Run the program directly, not under python3, even if it ends in `.py`.
    #[arg(long = "no-python", alias = "no_python", env = "PET_NO_PYTHON", value_parser = BoolishValueParser::new())]
    pub no_python: bool,

    /// Accepted for torchrun compatibility: a `.py` program always runs as a script path.
    #[arg(long = "run-path", alias = "run_path", env = "PET_RUN_PATH", value_parser = BoolishValueParser::new())]
    pub run_path: bool,

    /// Keep per-attempt, per-rank stdout/stderr and error files under this directory.
    #[arg(long = "log-dir", alias = "log_dir", env = "PET_LOG_DIR")]
    pub log_dir: Option<PathBuf>,

    /// Send streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or `0:1,1:2` per local rank.
    #[arg(short = 'r', long, env = "PET_REDIRECTS", default_value = "0")]
    pub redirects: String,

    /// Send streams to the console and to log files (same values as --redirects).
    #[arg(short = 't', long, env = "PET_TEE", default_value = "0")]
    pub tee: String,

    /// Prefix of each worker output line (`${role_name}`, `${rank}`, `${local_rank}`, `${hostname}`).
    #[arg(long = "log-line-prefix-template", alias = "log_line_prefix_template", env = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", default_value = DEFAULT_PREFIX_TEMPLATE)]
    pub log_line_prefix_template: String,

    /// Show only these local ranks' output on the console, e.g. `0` or `0,2`.
    #[arg(
        long = "local-ranks-filter",
        alias = "local_ranks_filter",
        env = "PET_LOCAL_RANKS_FILTER",
        default_value = ""
    )]
    pub local_ranks_filter: String,

    /// This node's rank (static rendezvous only).
    #[arg(long = "node-rank", alias = "node_rank", env = "PET_NODE_RANK")]
    pub node_rank: Option<u32>,

    /// Address of node 0, which hosts the workers' store (static rendezvous only).
    #[arg(long = "master-addr", alias = "master_addr", env = "PET_MASTER_ADDR")]
    pub master_addr: Option<String>,

    /// Port of the workers' store on node 0 (static rendezvous; default: one the OS picks on a
    /// single node).
    #[arg(long = "master-port", alias = "master_port", env = "PET_MASTER_PORT")]
    pub master_port: Option<u16>,

    /// The address other nodes reach this one at.
    #[arg(long = "local-addr", alias = "local_addr", env = "PET_LOCAL_ADDR")]
    pub local_addr: Option<String>,

    /// How workers' process trees are contained: `auto` (a cgroup v2 per job where one is
    /// writable, with a watchdog that kills it if rlaunch dies; else process groups and a child
    /// subreaper) or `process-group`.
    #[arg(long, env = "RLAUNCH_CONTAINMENT", value_parser = ["auto", "process-group"])]
    pub containment: Option<String>,

    /// Elastic: the address the workers' store listens on (default: the address this node
    /// advertises; `0.0.0.0` where the advertised address is not local, e.g. behind NAT).
    #[arg(long = "store-bind", env = "RLAUNCH_STORE_BIND")]
    pub store_bind: Option<String>,

    /// Bytes of keys and values the workers' store holds at most; a write past it fails on the
    /// client's side and changes nothing.
    #[arg(long = "store-max-bytes", env = "RLAUNCH_STORE_MAX_BYTES", default_value_t = 1 << 30)]
    pub store_max_bytes: usize,

    /// MiB of this node's memory for snapshots (`rlaunch.snapshot.save`): its workers' parts of
    /// the last committed step and of the steps in progress, and the copies it keeps for another
    /// node. A save that does not fit is refused and the last committed step stays. 0: no
    /// snapshots. Default: a quarter of the node's memory.
    #[arg(long = "snapshot-memory", env = "RLAUNCH_SNAPSHOT_MEMORY", value_name = "MIB")]
    pub snapshot_memory: Option<u64>,

    /// Warm workers for Python programs: per local rank, an interpreter that has imported the
    /// program's modules from outside its own directory (torch, numpy, ...) waits for the next
    /// round, so a restart or a new round starts no Python and imports nothing. Costs one such
    /// interpreter's memory per local rank (docs/src/warm-workers.md); `off`: every worker starts cold.
    #[arg(long = "warm-workers", env = "RLAUNCH_WARM_WORKERS", default_value = "on", value_parser = ["on", "off"])]
    pub warm_workers: String,

    /// Signals that stop the job and reach the workers first, then SIGTERM and SIGKILL after
    /// the grace (torchrun's list). SIGTERM, SIGINT, SIGHUP and SIGQUIT stop the job even when
    /// not listed; SIGUSR1 and SIGUSR2, when not listed, are relayed to the workers.
    #[arg(
        long = "signals-to-handle",
        alias = "signals_to_handle",
        env = "PET_SIGNALS_TO_HANDLE",
        default_value = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    )]
    pub signals_to_handle: String,

    /// Pin every worker to CPUs near its GPU (torchrun's policies: node, socket, exclusive,
    /// core-complex), from the node's topology in sysfs.
    #[arg(long = "numa-binding", alias = "numa_binding", env = "PET_NUMA_BINDING", value_parser = ["node", "socket", "exclusive", "core-complex"])]
    pub numa_binding: Option<String>,

    /// The global rank that gets rlaunch's stdin: typed input through its terminal (`input()`,
    /// `breakpoint()`), a pipe or a file as it is; the other ranks read /dev/null.
    #[arg(long = "stdin-rank", alias = "stdin_rank", env = "PET_STDIN_RANK", default_value_t = 0)]
    pub stdin_rank: u32,

    /// Console lines of the workers' stdout that contain any of these (`a,b`; `,,` for a comma)
    /// are also written to `attempt_{n}/filtered_stdout.log` in the log directory.
    #[arg(
        long = "duplicate-stdout-filters",
        alias = "duplicate_stdout_filters",
        env = "PET_DUPLICATE_STDOUT_FILTERS",
        default_value = ""
    )]
    pub duplicate_stdout_filters: String,

    /// The same for stderr (`filtered_stderr.log`).
    #[arg(
        long = "duplicate-stderr-filters",
        alias = "duplicate_stderr_filters",
        env = "PET_DUPLICATE_STDERR_FILTERS",
        default_value = ""
    )]
    pub duplicate_stderr_filters: String,

    /// A worker without progress for this many seconds is hung: its group is stopped and
    /// restarted (or the job fails) like on a failure, and the report says where every rank
    /// stood. Progress: output, CPU use, a Python stack that moves, or a touch of the file named
    /// in `RLAUNCH_HEARTBEAT_FILE`. `auto`: 10 × the observed step period (twice the longest
    /// gap seen if more), at least 60 s (`auto:SECONDS` for another floor). Job-wide: the first
    /// value a node gives is every node's.
    #[arg(long = "hang-timeout", alias = "hang_timeout", env = "PET_HANG_TIMEOUT", value_parser = parse_hang_timeout)]
    pub hang_timeout: Option<rlaunch_agent::hang::HangTimeout>,

    /// Nodes whose fingerprint differs (python, torch, CUDA, NCCL versions, GPU and driver, the
    /// NCCL_*, GLOO_* and CUDA_* variables, the program's hash): `log` names the difference
    /// when the round closes (what happens without the flag), `strict` refuses such a node at
    /// join. Job-wide, like --hang-timeout.
    #[arg(long = "fingerprint", env = "PET_FINGERPRINT", value_name = "log|strict")]
    pub fingerprint: Option<rlaunch::fingerprint::Policy>,

    /// Every worker sees only its own GPU, as device 0, with LOCAL_RANK=0 (torchrun's flag).
    #[arg(long = "virtual-local-rank", alias = "virtual_local_rank", env = "PET_VIRTUAL_LOCAL_RANK", value_parser = BoolishValueParser::new())]
    pub virtual_local_rank: bool,

    /// Print every effective setting and where it came from (command line, environment, a
    /// config file, or the default), then exit.
    #[arg(long = "print-config", alias = "print_config")]
    pub print_config: bool,

    /// Print a shell completion script for rlaunch and exit (torchrun's flag), e.g.
    /// `rlaunch --print-completion bash > /etc/bash_completion.d/rlaunch`.
    #[arg(long = "print-completion", alias = "print_completion", value_enum)]
    pub print_completion: Option<clap_complete::Shell>,

    /// The program to run on every worker, then its arguments.
    #[arg(required_unless_present_any = ["print_config", "print_completion"], trailing_var_arg = true, value_name = "PROGRAM [ARGS]...")]
    pub program: Vec<OsString>,
}

pub const EXIT_CODES: &str = "Exit codes:
  0        every worker succeeded
  N        the first failing worker's exit code (restart budget spent)
  128+S    the failing worker was killed by signal S, or rlaunch was stopped by signal S
  2        bad arguments
  1        rlaunch itself failed (store, log directory, rendezvous)
  127      the program could not be started";

/// Defined beside the config files it is also raised for (which import nothing of this
/// module), and used here.
pub use crate::config_file::UsageError;

fn usage<T>(msg: impl Into<String>) -> Result<T, UsageError> {
    Err(UsageError(msg.into()))
}

/// `N` or `MIN:MAX`.
pub fn parse_nnodes(s: &str) -> Result<(u32, u32), UsageError> {
    let num = |t: &str| t.trim().parse::<u32>().ok().filter(|n| *n >= 1);
    let (min, max) = match s.split_once(':') {
        None => (num(s), num(s)),
        Some((a, b)) => (num(a), num(b)),
    };
    match (min, max) {
        (Some(a), Some(b)) if a <= b => Ok((a, b)),
        (Some(a), Some(b)) => usage(format!("--nnodes {s}: MIN ({a}) is larger than MAX ({b})")),
        _ => usage(format!("--nnodes {s}: expected a positive number N or a range MIN:MAX, e.g. 2 or 1:4")),
    }
}

/// `N`, `cpu`, `gpu` or `auto`.
pub fn parse_nproc(s: &str) -> Result<u32, UsageError> {
    let cpus = || std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1);
    match s.trim() {
        "cpu" => Ok(cpus()),
        "gpu" => match gpu_count() {
            0 => usage("--nproc-per-node gpu: no GPU found on this node (use a number or `cpu`)"),
            n => Ok(n),
        },
        "auto" => Ok(match gpu_count() {
            0 => cpus(),
            n => n,
        }),
        t => match t.parse::<u32>() {
            Ok(n) if (1..=4096).contains(&n) => Ok(n),
            _ => usage(format!("--nproc-per-node {s}: expected a number from 1 to 4096, `cpu`, `gpu` or `auto`")),
        },
    }
}

/// GPUs the NVIDIA driver exposes on this node (honouring CUDA_VISIBLE_DEVICES).
fn gpu_count() -> u32 {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v.split(',').filter(|s| !s.trim().is_empty() && !s.trim().starts_with('-')).count() as u32;
    }
    std::fs::read_dir("/proc/driver/nvidia/gpus").map(|d| d.count() as u32).unwrap_or(0)
}

/// torchrun's `Std` grammar: `3`, or `0:1,1:2` rank by rank.
pub fn parse_std(flag: &str, s: &str) -> Result<PerRank<StdSet>, UsageError> {
    let code = |t: &str| t.trim().parse::<u8>().ok().and_then(StdSet::from_code);
    let bad = || {
        UsageError(format!(
            "{flag} {s}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank like 0:1,1:2"
        ))
    };
    if !s.contains(':') {
        return code(s).map(PerRank::All).ok_or_else(bad);
    }
    let mut m = BTreeMap::new();
    for part in s.split(',') {
        let (r, c) = part.split_once(':').ok_or_else(bad)?;
        let rank = r.trim().parse::<u32>().map_err(|_| bad())?;
        m.insert(rank, code(c).ok_or_else(bad)?);
    }
    Ok(PerRank::Ranks(m))
}

/// A duration in (fractional) seconds, positive and finite.
pub fn parse_seconds(flag: &str, s: &str) -> Result<Duration, UsageError> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e7 => Ok(Duration::from_secs_f64(v)),
        _ => usage(format!("{flag} {s}: expected a positive number of seconds")),
    }
}

pub fn parse_ranks_filter(s: &str) -> Result<Option<BTreeSet<u32>>, UsageError> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    s.split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| UsageError(format!("--local-ranks-filter {s}: expected local ranks like 0 or 0,2")))
        })
        .collect::<Result<BTreeSet<_>, _>>()
        .map(Some)
}

/// Rendezvous settings from `--rdzv-conf`: the job's timings (the rest of [`JobSettings`] comes
/// from other flags) and the service's token.
#[derive(Debug, Clone, Default)]
pub struct RdzvConf {
    pub settings: JobSettings,
    pub token: Option<String>,
    /// `tls_ca=PATH`: the CA bundle `https://` endpoints are verified against.
    pub tls_ca: Option<PathBuf>,
}

/// torchrun keys rlaunch has no use for; accepted so torchrun command lines keep working.
const IGNORED_TORCHRUN_KEYS: &[&str] =
    &["read_timeout", "close_timeout", "is_host", "keep_alive_max_attempt", "timeout", "use_libuv"];

pub fn parse_rdzv_conf(s: &str) -> Result<RdzvConf, UsageError> {
    let mut conf = RdzvConf {
        settings: JobSettings { join_timeout: Duration::from_secs(600), ..JobSettings::default() },
        token: None,
        tls_ca: None,
    };
    let t = &mut conf.settings;
    let mut probe_timeout_given = false;
    let mut stall_bound_given = false;
    let mut peer_interval_given = false;
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            return usage(format!("--rdzv-conf: `{part}` is not key=value"));
        };
        let (k, v) = (k.trim(), v.trim());
        let flag = format!("--rdzv-conf {k}");
        match k {
            "join_timeout" => t.join_timeout = parse_seconds(&flag, v)?,
            "last_call_timeout" => t.last_call_timeout = parse_seconds(&flag, v)?,
            "heartbeat_interval" | "keep_alive_interval" => t.heartbeat_interval = parse_seconds(&flag, v)?,
            "node_ttl" => t.node_ttl = parse_seconds(&flag, v)?,
            "probe_timeout" => {
                t.probe_timeout = parse_seconds(&flag, v)?;
                probe_timeout_given = true;
            }
            "peer_interval" => {
                t.peer_interval = if v == "0" { Duration::ZERO } else { parse_seconds(&flag, v)? };
                peer_interval_given = true;
            }
            "stall_bound" => {
                t.stall_bound = parse_seconds(&flag, v)?;
                stall_bound_given = true;
            }
            "token" => conf.token = Some(v.to_string()),
            "tls_ca" if v.is_empty() => return usage("--rdzv-conf tls_ca: give the path of a PEM CA bundle"),
            "tls_ca" => conf.tls_ca = Some(PathBuf::from(v)),
            k if IGNORED_TORCHRUN_KEYS.contains(&k) => {}
            _ => {
                return usage(format!(
                    "--rdzv-conf: unknown key `{k}` (known: join_timeout, last_call_timeout, heartbeat_interval, node_ttl, probe_timeout, peer_interval, stall_bound, token, tls_ca)"
                ))
            }
        }
    }
    if !stall_bound_given {
        // A short TTL (fast test setups) gets a stall bound within it, and pings within that.
        let t = &mut conf.settings;
        t.stall_bound = t.stall_bound.min(t.node_ttl / 2);
        if !peer_interval_given {
            t.peer_interval = t.peer_interval.min(t.stall_bound / 4);
        }
    }
    if !probe_timeout_given {
        // Probers hear of a suspicion with their next heartbeat's answer: slower heartbeats
        // (torchrun's keep_alive_interval=5) get a longer probe timeout than the default 1 s.
        let t = &mut conf.settings;
        t.probe_timeout = t.probe_timeout.max(t.heartbeat_interval * 2);
    }
    Ok(conf)
}

/// Builds the worker's argv the way torchrun does: `*.py` under `python3 -u`, `-m` as a module.
pub fn worker_program(args: &Args, python: &OsString) -> Result<Vec<OsString>, UsageError> {
    if args.module && args.no_python {
        return usage("don't use both --no-python and -m/--module: a module needs the Python interpreter");
    }
    let (first, rest) = args.program.split_first().expect("clap requires PROGRAM");
    let mut argv = Vec::with_capacity(args.program.len() + 3);
    let needs_python = args.module
        || (!args.no_python && (first.to_string_lossy().ends_with(".py") || is_python_source(Path::new(first))));
    if needs_python && python.is_empty() {
        return usage(
            "no Python interpreter for the program: none of PYTHON_EXEC, RLAUNCH_PYTHON, $VIRTUAL_ENV, \
             $CONDA_PREFIX, a python beside rlaunch, nor python3 on PATH's absolute entries (relative \
             entries are never searched); set PYTHON_EXEC",
        );
    }
    if args.module {
        argv.extend([python.clone(), "-u".into(), "-m".into()]);
    } else if !args.no_python && (first.to_string_lossy().ends_with(".py") || is_python_source(Path::new(first))) {
        argv.extend([python.clone(), "-u".into()]);
    }
    argv.push(first.clone());
    argv.extend(rest.iter().cloned());
    Ok(argv)
}

/// A file that is neither a `#!` script nor an ELF executable: torchrun would run it under
/// python, and so does rlaunch (a name found only on PATH is run as it is).
fn is_python_source(program: &Path) -> bool {
    use std::io::Read;
    let Ok(mut f) = std::fs::File::open(program) else { return false };
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return false;
    }
    let mut head = [0u8; 4];
    let n = f.read(&mut head).unwrap_or(0);
    !(head[..n].starts_with(b"#!") || head[..n].starts_with(b"\x7fELF"))
}

/// The Python interpreter for `*.py` programs and `-m`, and why: `PYTHON_EXEC` (torchrun's),
/// `RLAUNCH_PYTHON`, the active virtualenv's or conda env's, the one beside rlaunch itself (a
/// pip-installed rlaunch in a venv), else `python3` from PATH's absolute entries (never a
/// relative one), resolved here once. None of them: an empty name, which a Python program is
/// refused with (a bare `python3` would be looked up on the workers' PATH, relative entries too).
pub fn python_interpreter(env: &dyn Fn(&str) -> Option<String>, own_exe: Option<PathBuf>) -> (OsString, String) {
    for var in ["PYTHON_EXEC", "RLAUNCH_PYTHON"] {
        if let Some(p) = env(var).filter(|p| !p.is_empty()) {
            return (p.into(), var.to_owned());
        }
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = env(var).filter(|p| !p.is_empty()) {
            let p = Path::new(&prefix).join("bin/python");
            if p.is_file() {
                return (p.into_os_string(), format!("${var}"));
            }
        }
    }
    if let Some(p) = own_exe.and_then(|e| e.parent().map(|d| d.join("python"))).filter(|p| p.is_file()) {
        return (p.into_os_string(), "beside rlaunch".to_owned());
    }
    // Only PATH's absolute entries: a relative one (`.`, `bin`) names whatever directory the
    // agent happens to run in, which may be another user's.
    let path = env("PATH").unwrap_or_default();
    let found =
        std::env::split_paths(&path).filter(|d| d.is_absolute()).map(|d| d.join("python3")).find(|p| p.is_file());
    match found {
        Some(p) => (p.into_os_string(), "python3 from PATH".to_owned()),
        None => (OsString::new(), "no python3 on PATH's absolute entries".to_owned()),
    }
}

/// A random run id for `--standalone`, a version-4 UUID as torchrun's.
fn random_run_id() -> String {
    let mut bytes = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes)).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        bytes = (t ^ u128::from(std::process::id())).to_le_bytes();
    }
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

impl Args {
    /// Validates every flag and builds the agent's configuration.
    pub fn into_config(
        self,
        python: &OsString,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<AgentConfig, UsageError> {
        let (min_nodes, max_nodes) = parse_nnodes(&self.nnodes)?;
        let nproc_per_node = parse_nproc(&self.nproc_per_node)?;
        parse_seconds("--monitor-interval", &self.monitor_interval)?;
        let stop_grace = parse_seconds("--shutdown-timeout", &self.shutdown_timeout)?;
        let redirects = parse_std("--redirects", &self.redirects)?;
        let tee = parse_std("--tee", &self.tee)?;
        let local_ranks_filter = parse_ranks_filter(&self.local_ranks_filter)?;
        let conf = parse_rdzv_conf(&self.rdzv_conf)?;
        if self.store_max_bytes < 1 << 20 {
            return usage(format!("--store-max-bytes {}: at least 1 MiB (1048576)", self.store_max_bytes));
        }
        let backend_name = self.backend().0;
        let elastic = !self.standalone && matches!(backend_name.as_str(), "rlaunch" | "c10d" | "etcd" | "etcd-v3");
        // The job's settings, checked once here: timeouts must nest (heartbeat interval < node
        // TTL < shutdown timeout < join timeout; the shutdown timeout only matters to elastic
        // rounds, which wait for survivors still stopping their workers).
        let mut job = JobSettings {
            min_nodes,
            max_nodes,
            max_restarts: self.max_restarts,
            stop_grace: if elastic { stop_grace } else { Duration::ZERO },
            hang_timeout: self.hang_timeout,
            fingerprint: self.fingerprint,
            ..conf.settings.clone()
        };
        job.validate().map_err(|e| UsageError(format!("--rdzv-conf / --shutdown-timeout: {e}")))?;
        // The agent stops its workers with this grace in every mode.
        job.stop_grace = stop_grace;
        let program = worker_program(&self, python)?;
        if self.virtual_local_rank {
            for var in ["HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"] {
                if let Some(list) = env(var).filter(|v| !v.is_empty()) {
                    let n = list.split(',').count();
                    if n < nproc_per_node as usize {
                        return usage(format!(
                            "--virtual-local-rank: {var}={list} names {n} device(s) for {nproc_per_node} workers per node"
                        ));
                    }
                    break;
                }
            }
        }
        if let Some(f) = &local_ranks_filter {
            if let Some(r) = f.iter().find(|r| **r >= nproc_per_node) {
                return usage(format!(
                    "--local-ranks-filter: local rank {r} does not exist with --nproc-per-node {nproc_per_node}"
                ));
            }
        }
        let endpoints: Vec<Endpoint> = self
            .rdzv_endpoint
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(parse_endpoint)
            .collect::<Result<_, _>>()?;
        let mut run_id = self.rdzv_id.clone().unwrap_or_else(|| "none".into());
        let rendezvous = if self.standalone {
            if max_nodes > 1 {
                return usage(format!(
                    "--standalone runs a single node, but --nnodes is {}; drop one of them",
                    self.nnodes
                ));
            }
            run_id = random_run_id();
            RendezvousConfig::Standalone
        } else {
            match backend_name.as_str() {
                "static" => {
                    if min_nodes != max_nodes {
                        return usage(format!(
                            "--rdzv-backend static needs a fixed --nnodes, not the range {}",
                            self.nnodes
                        ));
                    }
                    if max_nodes == 1 && self.master_port.is_none() && endpoints.is_empty() && self.rdzv_id.is_none() {
                        // torchrun runs a single node without a port as a standalone job: a
                        // fresh run id (a UUID) per run.
                        run_id = random_run_id();
                    }
                    let node_rank = self.node_rank.unwrap_or(0);
                    if node_rank >= max_nodes {
                        return usage(format!("--node-rank {node_rank} must be below --nnodes {max_nodes}"));
                    }
                    if max_nodes > 1 && self.master_port.is_none() {
                        return usage(
                            "a static multi-node job needs --master-port (and --master-addr) naming node 0's store; \
                             for an elastic job give --rdzv-endpoint host:port of a rendezvous (or node 0's address: \
                             its agent hosts one) and --rdzv-id",
                        );
                    }
                    let master_addr = self.master_addr.as_deref().unwrap_or("127.0.0.1");
                    let master = host_flag("--master-addr", Some(master_addr))?
                        .expect("given")
                        .with_port(self.master_port.unwrap_or(0));
                    RendezvousConfig::Static { node_rank, nnodes: max_nodes, master }
                }
                "rlaunch" | "c10d" | "etcd" | "etcd-v3" => {
                    if endpoints.is_empty() {
                        return usage(format!("--rdzv-backend {backend_name} needs --rdzv-endpoint host:port"));
                    }
                    run_id = self.elastic_run_id(env)?.0;
                    let backend =
                        if backend_name.starts_with("etcd") { DynamicBackend::Etcd } else { DynamicBackend::Server };
                    if backend == DynamicBackend::Etcd {
                        // The agent's etcd client speaks plain gRPC: say so rather than fail to connect.
                        if let Some(e) = endpoints.iter().find(|e| e.is_tls()) {
                            return usage(format!(
                                "--rdzv-backend {backend_name}: `{e}`: etcd over TLS is not supported by the agent's \
                                 etcd client; use a rlaunch-rendezvous service with --tls-cert/--tls-key (its own etcd \
                                 stays on the cluster's network) or a plain http:// etcd endpoint"
                            ));
                        }
                        if conf.tls_ca.is_some() {
                            return usage(format!(
                                "--rdzv-conf tls_ca is for https:// rendezvous services; --rdzv-backend {backend_name} \
                                 does not use it"
                            ));
                        }
                    }
                    RendezvousConfig::Dynamic(DynamicRendezvous {
                        backend,
                        endpoints,
                        token: self.token(&conf)?,
                        tls_ca: conf.tls_ca.clone(),
                    })
                }
                "etcd-v2" => {
                    return usage(
                        "--rdzv-backend etcd-v2: the etcd v2 API was removed in etcd 3.6; use --rdzv-backend etcd (v3)",
                    )
                }
                other => return usage(format!("--rdzv-backend {other}: expected static, rlaunch (or c10d), or etcd")),
            }
        };
        if run_id.is_empty() || run_id.len() > 128 || run_id.chars().any(|c| c.is_control() || c == '/') {
            return usage(format!("--rdzv-id {run_id:?}: expected 1 to 128 characters, no '/' or control characters"));
        }
        let handled_signals =
            parse_signals(&self.signals_to_handle).map_err(|e| UsageError(format!("--signals-to-handle: {e}")))?;
        Ok(AgentConfig {
            program,
            nproc_per_node,
            role: self.role,
            run_id,
            job,
            log_dir: self.log_dir,
            redirects,
            tee,
            local_ranks_filter,
            log_line_prefix_template: self.log_line_prefix_template,
            local_addr: host_flag("--local-addr", self.local_addr.as_deref())?,
            rendezvous,
            process_groups_only: self.containment.as_deref() == Some("process-group"),
            store_bind: host_flag("--store-bind", self.store_bind.as_deref())?,
            store_max_bytes: self.store_max_bytes,
            snapshot_memory: match self.snapshot_memory {
                Some(mib) => mib
                    .checked_mul(1 << 20)
                    .ok_or_else(|| UsageError(format!("--snapshot-memory {mib}: more MiB than any machine has")))?,
                None => rlaunch_agent::snapstore::default_cap(),
            },
            warm_workers: self.warm_workers == "on",
            virtual_local_rank: self.virtual_local_rank,
            handled_signals,
            stdin_rank: self.stdin_rank,
            numa_binding: self.numa_binding.as_deref().map(|m| m.parse().expect("clap checked the choice")),
            duplicate_stdout_filters: comma_separated_list(&self.duplicate_stdout_filters),
            duplicate_stderr_filters: comma_separated_list(&self.duplicate_stderr_filters),
        })
    }
}

fn parse_hang_timeout(s: &str) -> Result<rlaunch_agent::hang::HangTimeout, rlaunch::contract::HangTimeoutError> {
    rlaunch_agent::hang::HangTimeout::parse(s)
}

/// torchrun's list syntax for the duplicate filters: items split at `,`, with `,,` for a comma
/// inside an item.
pub fn comma_separated_list(value: &str) -> Vec<String> {
    if value.is_empty() {
        return Vec::new();
    }
    const PLACEHOLDER: char = '\u{0}';
    let escaped = value.replace(",,", &PLACEHOLDER.to_string());
    escaped.split(',').map(|item| item.replace(PLACEHOLDER, ",")).collect()
}

/// A `--signals-to-handle` entry the launcher cannot handle; `names`: those it can.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{name}` is not a signal the launcher can handle (one of {})", names.join(", "))]
pub struct UnknownSignal {
    pub name: String,
    pub names: Vec<String>,
}

/// `SIGTERM,SIGUSR1` (torchrun's spelling; `TERM` and any case are taken too) into numbers.
pub fn parse_signals(list: &str) -> Result<Vec<i32>, UnknownSignal> {
    use rlaunch::contract::{signal_by_name, signal_name};
    use rlaunch_agent::core::can_handle;
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match signal_by_name(name).filter(|s| can_handle(*s)) {
            Some(sig) if !out.contains(&sig) => out.push(sig),
            Some(_) => {}
            None => {
                let names: Vec<String> = (1..32)
                    .filter(|s| can_handle(*s) && signal_by_name(&signal_name(*s)).is_some())
                    .map(signal_name)
                    .collect();
                return Err(UnknownSignal { name: name.to_owned(), names });
            }
        }
    }
    Ok(out)
}

/// `--print-completion SHELL`: the completion script for `shell` on stdout.
pub fn print_completion(shell: clap_complete::Shell) {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Args::command(), "rlaunch", &mut script);
    // A reader that stops early (`| head`) is not an error of ours.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), &script);
}

/// Every setting with its value and where it came from, for `--print-config`.
pub type Sources = Vec<(String, String, String)>;

/// Why the command line could not be read.
#[derive(Debug)]
pub enum ParseError {
    /// clap's own (help and version included): it prints and exits itself.
    Clap(clap::Error),
    Usage(UsageError),
}

/// Parses `argv` with the cluster's config files under the environment (flag > environment >
/// file > default) and says where each setting came from.
pub fn parse(argv: Vec<OsString>, env: &dyn Fn(&str) -> Option<String>) -> Result<(Args, Sources), ParseError> {
    let cmd = Args::command();
    let env_of = |long: &str| {
        cmd.get_arguments()
            .find(|a| a.get_long() == Some(long))
            .and_then(|a| a.get_env())
            .map(|e| e.to_string_lossy().into_owned())
    };
    let files = crate::config_file::load(&crate::config_file::config_paths(env), &|k| env_of(k).is_some())
        .map_err(ParseError::Usage)?;
    // A file's value stands in for the environment variable where neither the command line nor
    // the environment gives one; clap then sees it as that variable. It is removed again after
    // parsing, so workers never see it.
    let mut injected: BTreeMap<String, PathBuf> = BTreeMap::new();
    for (long, setting) in &files {
        let var = env_of(long).expect("only known keys are loaded");
        if env(&var).is_none() {
            std::env::set_var(&var, &setting.value);
            injected.insert(var, setting.file.clone());
        }
    }
    // clap reads environment variables when the command is built: build it again now.
    let matches = Args::command().try_get_matches_from(argv);
    for var in injected.keys() {
        std::env::remove_var(var);
    }
    let matches = matches.map_err(ParseError::Clap)?;
    let args = Args::from_arg_matches(&matches).map_err(ParseError::Clap)?;
    let mut sources: Sources = Vec::new();
    for a in cmd.get_arguments() {
        let id = a.get_id().as_str();
        if matches!(id, "help" | "version" | "program" | "print_config" | "print_completion") {
            continue;
        }
        let name = a.get_long().unwrap_or(id).to_owned();
        let value = matches
            .get_raw(id)
            .map(|v| v.map(|x| x.to_string_lossy().into_owned()).collect::<Vec<_>>().join(","))
            .unwrap_or_default();
        let var = a.get_env().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default();
        let source = match matches.value_source(id) {
            Some(ValueSource::CommandLine) => "command line".to_owned(),
            Some(ValueSource::EnvVariable) => match injected.get(&var) {
                Some(file) => format!("config file {}", file.display()),
                None => format!("environment ({var})"),
            },
            Some(ValueSource::DefaultValue) => "default".to_owned(),
            _ => "unset".to_owned(),
        };
        sources.push((name, value, source));
    }
    let mut args = args;
    let unset = |name: &str| sources.iter().any(|(n, _, src)| n == name && (src == "default" || src == "unset"));
    let wanted = crate::slurm::Unset {
        nnodes: unset("nnodes"),
        rdzv_endpoint: args.rdzv_endpoint.trim().is_empty() && unset("rdzv-endpoint"),
        nproc_per_node: unset("nproc-per-node"),
    };
    let placed =
        args.standalone || args.node_rank.is_some() || args.master_addr.is_some() || args.master_port.is_some();
    for f in crate::slurm::fill(wanted, placed, env, gpu_count) {
        match f.name {
            "nnodes" => args.nnodes = f.value.clone(),
            "rdzv-endpoint" => args.rdzv_endpoint = f.value.clone(),
            _ => args.nproc_per_node = f.value.clone(),
        }
        if let Some(entry) = sources.iter_mut().find(|(n, _, _)| n == f.name) {
            *entry = (f.name.to_owned(), f.value, f.from);
        }
    }
    Ok((args, sources))
}

/// `--print-config`: every setting, then what rlaunch derives from them.
pub fn render_config(args: &Args, sources: &Sources, env: &dyn Fn(&str) -> Option<String>) -> String {
    let width = sources.iter().map(|(n, _, _)| n.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (name, value, source) in sources {
        let shown = if name == "rdzv-conf" { hide_token(value) } else { value.clone() };
        out += &format!("{name:<width$}  {shown:<24}  ({source})\n");
    }
    let (backend, why) = args.backend();
    let backend = if args.standalone { "standalone (embedded)".to_owned() } else { backend };
    out += &format!("\neffective rdzv-backend: {backend} ({why})\n");
    if !args.standalone && backend != "static" {
        match args.elastic_run_id(env) {
            Ok((id, from)) => out += &format!("effective rdzv-id:      {id} (from {from})\n"),
            Err(e) => out += &format!("effective rdzv-id:      none: {e}\n"),
        }
    }
    out
}

fn hide_token(conf: &str) -> String {
    conf.split(',')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if k.trim() == "token" => format!("{k}=***"),
            _ => kv.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl Args {
    /// The rendezvous backend and why: as given; else elastic (`rlaunch`) when an endpoint is
    /// given and no static flag is; else `static`, torchrun's default.
    pub fn backend(&self) -> (String, &'static str) {
        if let Some(b) = &self.rdzv_backend {
            return (b.clone(), "as given");
        }
        let static_flags = self.node_rank.is_some() || self.master_addr.is_some() || self.master_port.is_some();
        if !self.rdzv_endpoint.trim().is_empty() && !static_flags {
            ("rlaunch".into(), "--rdzv-endpoint given without --node-rank/--master-addr/--master-port")
        } else {
            let why = if static_flags {
                "--node-rank/--master-addr/--master-port given"
            } else {
                "no --rdzv-endpoint (torchrun's default)"
            };
            ("static".into(), why)
        }
    }

    /// An elastic job's id and where it came from: `--rdzv-id`, else the scheduler's job id.
    pub fn elastic_run_id(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<(String, String), UsageError> {
        if let Some(id) = &self.rdzv_id {
            return Ok((id.clone(), "--rdzv-id".into()));
        }
        if let Some(found) = crate::slurm::run_id(env) {
            return Ok(found);
        }
        // A Kubernetes Indexed Job names its pods' hosts `{job name}-{index}`.
        let host = env("HOSTNAME")
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_owned()));
        if let (Some(index), Some(host)) = (env("JOB_COMPLETION_INDEX"), host) {
            if let Some(job) = host.strip_suffix(&format!("-{index}")).filter(|j| !j.is_empty()) {
                return Ok((format!("k8s-{job}"), "a Kubernetes Indexed Job (JOB_COMPLETION_INDEX, HOSTNAME)".into()));
            }
        }
        usage(
            "an elastic job needs an id that every node of the job shares, so that the rendezvous can tell its nodes \
             from other jobs': pass --rdzv-id NAME (or PET_RDZV_ID, or rdzv-id in a config file), or run under Slurm \
             (SLURM_JOB_ID) or as a Kubernetes Indexed Job, whose job id is used",
        )
    }

    /// The rendezvous token: `--rdzv-conf token=`, else `--rdzv-token-file`.
    fn token(&self, conf: &RdzvConf) -> Result<Option<String>, UsageError> {
        if conf.token.is_some() {
            return Ok(conf.token.clone());
        }
        match &self.rdzv_token_file {
            None => Ok(None),
            Some(p) => crate::token_file::read(p).map_err(|e| UsageError(e.to_string())),
        }
    }
}

fn parse_endpoint(given: &str) -> Result<Endpoint, UsageError> {
    given.parse().map_err(|e: rlaunch::contract::HostPortError| {
        UsageError(format!(
            "--rdzv-endpoint {given}: expected host:port, http://host:port or https://host:port ({})",
            e.why
        ))
    })
}

/// An address flag without a port (`--local-addr`, `--store-bind`), parsed once.
fn host_flag(flag: &str, given: Option<&str>) -> Result<Option<Host>, UsageError> {
    given
        .map(|h| {
            h.parse().map_err(|e: rlaunch::contract::HostPortError| {
                UsageError(format!("{flag} {h}: not a host name or address ({})", e.why))
            })
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_to_handle_take_torchruns_spelling_and_refuse_what_cannot_be_handled() {
        let names = |list: &str| -> Vec<String> {
            parse_signals(list).unwrap().into_iter().map(rlaunch::contract::signal_name).collect()
        };
        assert_eq!(names("SIGTERM, usr1,TERM,sigPwr"), ["SIGTERM", "SIGUSR1", "SIGPWR"], "deduplicated, in order");
        assert!(names("").is_empty());
        for bad in ["SIGKILL", "SIGSEGV", "SIGCHLD", "SIGBOGUS", "15"] {
            let e = parse_signals(bad).unwrap_err().to_string();
            let (named, choices) = e.split_once("(one of").unwrap();
            assert!(named.contains(&format!("`{bad}`")), "{e}");
            assert!(choices.contains("SIGUSR1") && !choices.contains("SIGKILL") && !choices.contains("SIGSEGV"), "{e}");
        }
    }

    #[test]
    fn nnodes_grammar() {
        assert_eq!(parse_nnodes("2").unwrap(), (2, 2));
        assert_eq!(parse_nnodes("1:4").unwrap(), (1, 4));
        for bad in ["0", "4:1", "a", "1:", ":2", "-1", ""] {
            assert!(parse_nnodes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn std_grammar_all_and_per_rank() {
        assert_eq!(parse_std("-t", "3").unwrap(), PerRank::All(StdSet::ALL));
        let p = parse_std("-t", "0:1,10:2").unwrap();
        assert_eq!(p.get(0), StdSet { stdout: true, stderr: false });
        assert_eq!(p.get(10), StdSet { stdout: false, stderr: true });
        assert_eq!(p.get(5), StdSet::NONE);
        for bad in ["4", "x", "0:5", "a:1", "0:1,"] {
            assert!(parse_std("-t", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn https_endpoints_and_a_private_ca_are_taken() {
        assert_eq!(parse_rdzv_conf("tls_ca=/etc/rlaunch/ca.pem").unwrap().tls_ca, Some("/etc/rlaunch/ca.pem".into()));
        assert!(parse_rdzv_conf("tls_ca=").is_err());
        for ok in ["https://rdzv.cluster:29400", "http://h:1", "h:1", "[::1]:29400"] {
            assert_eq!(parse_endpoint(ok).map(|e| e.to_string()).ok().as_deref(), Some(ok));
        }
        for bad in ["https://rdzv.cluster", "https://:1", "ftp://h", "h:1/x"] {
            let e = parse_endpoint(bad).unwrap_err().0;
            assert!(e.contains(bad) && e.contains("https://host:port"), "{e}");
        }
    }

    #[test]
    fn rdzv_conf_reads_torchrun_keys_and_its_timeouts_must_nest() {
        assert!(parse_rdzv_conf("bogus=1").is_err());
        let peers = parse_rdzv_conf("peer_interval=0.05,stall_bound=0.3").unwrap().settings;
        assert_eq!((peers.peer_interval, peers.stall_bound), (Duration::from_millis(50), Duration::from_millis(300)));
        assert_eq!(parse_rdzv_conf("peer_interval=0").unwrap().settings.peer_interval, Duration::ZERO);
        assert!(parse_rdzv_conf("peer_interval=0.3,stall_bound=0.5").unwrap().settings.validate().is_err());
        assert!(
            parse_rdzv_conf("peer_interval=0.1,stall_bound=5").unwrap().settings.validate().is_err(),
            "past the TTL"
        );
        let c = parse_rdzv_conf("join_timeout=30,read_timeout=60,node_ttl=3,heartbeat_interval=1").unwrap();
        assert_eq!(c.settings.node_ttl, Duration::from_secs(3));
        assert!(c.settings.validate().is_ok());
        assert!(parse_rdzv_conf("heartbeat_interval=3,node_ttl=2").unwrap().settings.validate().is_err());
        assert!(parse_rdzv_conf("node_ttl=700").unwrap().settings.validate().is_err());
        // The probe timeout follows slow heartbeats unless given; given, it must leave probers
        // two heartbeat intervals.
        let slow = parse_rdzv_conf("keep_alive_interval=5,node_ttl=15").unwrap().settings;
        assert_eq!(slow.probe_timeout, Duration::from_secs(10));
        assert!(slow.validate().is_ok());
        assert_eq!(parse_rdzv_conf("").unwrap().settings.probe_timeout, Duration::from_secs(1));
        let err = parse_rdzv_conf("heartbeat_interval=1,node_ttl=3,probe_timeout=1").unwrap().settings.validate();
        assert!(err.unwrap_err().to_string().contains("probe_timeout"));
    }

    #[test]
    fn python_programs_run_under_the_interpreter() {
        let py: OsString = "python3".into();
        let args = Args::try_parse_from(["rlaunch", "train.py", "--lr", "0.1"]).unwrap();
        assert_eq!(worker_program(&args, &py).unwrap(), ["python3", "-u", "train.py", "--lr", "0.1"]);
        let args = Args::try_parse_from(["rlaunch", "-m", "pkg.train"]).unwrap();
        assert_eq!(worker_program(&args, &py).unwrap(), ["python3", "-u", "-m", "pkg.train"]);
        let args = Args::try_parse_from(["rlaunch", "--no-python", "x.py"]).unwrap();
        assert_eq!(worker_program(&args, &py).unwrap(), ["x.py"]);
        let args = Args::try_parse_from(["rlaunch", "./train", "--epochs", "3"]).unwrap();
        assert_eq!(worker_program(&args, &py).unwrap(), ["./train", "--epochs", "3"]);
    }

    #[test]
    fn underscore_spellings_are_accepted() {
        let a = Args::try_parse_from(["rlaunch", "--nproc_per_node", "3", "--max_restarts=2", "prog"]).unwrap();
        assert_eq!((a.nproc_per_node.as_str(), a.max_restarts), ("3", 2));
    }

    #[test]
    fn an_endpoint_alone_means_elastic_and_static_flags_keep_it_static() {
        let p = |a: &[&str]| Args::try_parse_from([&["rlaunch"], a, &["x"]].concat()).unwrap();
        assert_eq!(p(&["--rdzv-endpoint", "h:1"]).backend().0, "rlaunch");
        assert_eq!(p(&["--rdzv-endpoint", "h:1", "--node-rank", "1"]).backend().0, "static");
        assert_eq!(p(&["--rdzv-endpoint", "h:1", "--rdzv-backend", "etcd"]).backend().0, "etcd");
        // etcd-direct has no TLS: an https:// etcd endpoint or a CA bundle is refused, not ignored.
        for extra in [
            &["--rdzv-endpoint", "https://etcd:2379"][..],
            &["--rdzv-endpoint", "etcd:2379", "--rdzv-conf", "tls_ca=/ca.pem"],
        ] {
            let mut argv = vec!["rlaunch", "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-id", "j"];
            argv.extend_from_slice(extra);
            argv.push("train");
            let err =
                Args::try_parse_from(argv).unwrap().into_config(&"python3".into(), &|_| None).expect_err("refused");
            assert!(err.0.contains("etcd") && (err.0.contains("TLS") || err.0.contains("tls_ca")), "{}", err.0);
        }
        assert_eq!(p(&[]).backend().0, "static");
    }

    #[test]
    fn an_elastic_run_id_comes_from_the_flag_then_slurm_then_an_indexed_job() {
        let a = Args::try_parse_from(["rlaunch", "--rdzv-endpoint", "h:1", "x"]).unwrap();
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(a.elastic_run_id(&env(&[("SLURM_JOB_ID", "9")])).unwrap().0, "slurm-9");
        let k8s = env(&[("JOB_COMPLETION_INDEX", "0"), ("HOSTNAME", "j-0")]);
        assert_eq!(a.elastic_run_id(&k8s).unwrap().0, "k8s-j");
        assert!(a.elastic_run_id(&env(&[("JOB_COMPLETION_INDEX", "0"), ("HOSTNAME", "other")])).is_err());
        let given = Args::try_parse_from(["rlaunch", "--rdzv-id", "mine", "x"]).unwrap();
        assert_eq!(given.elastic_run_id(&env(&[("SLURM_JOB_ID", "9")])).unwrap().0, "mine");
        assert_eq!(hide_token("node_ttl=2,token=s3cret"), "node_ttl=2,token=***");
    }
}

#[cfg(test)]
mod interpreter_tests {
    use super::*;

    #[test]
    fn python3_is_looked_up_on_paths_absolute_entries_only() {
        let dir = std::env::temp_dir().join(format!("rlaunch-interpreter-test-{}", std::process::id()));
        let (rel, abs) = (dir.join("rel"), dir.join("abs"));
        std::fs::create_dir_all(&dir).unwrap();
        for d in [&rel, &abs] {
            std::fs::create_dir(d).unwrap();
            std::fs::write(d.join("python3"), "#!/bin/sh\n").unwrap();
        }
        // A relative entry first (as `.` or `bin` would be): passed over, even where it holds one.
        let path = format!("rel:{}", abs.display());
        let env = |k: &str| (k == "PATH").then(|| path.clone());
        assert_eq!(python_interpreter(&env, None).0, abs.join("python3").into_os_string());
        // None on an absolute entry: no interpreter, and a Python program is refused before
        // anything starts (a bare `python3` was looked up on the workers' PATH, `rel` too).
        let only_rel = |k: &str| (k == "PATH").then(|| "rel".to_owned());
        let (none, why) = python_interpreter(&only_rel, None);
        assert!(none.is_empty(), "{none:?} ({why})");
        for program in [&["rlaunch", "train.py"][..], &["rlaunch", "-m", "pkg.train"]] {
            let e = Args::try_parse_from(program).unwrap().into_config(&none, &only_rel).expect_err("refused");
            assert!(e.to_string().contains("PYTHON_EXEC"), "{e}");
        }
        // A program that is not Python needs none.
        let args = Args::try_parse_from(["rlaunch", "--no-python", "/bin/true"]).unwrap();
        assert!(args.into_config(&none, &only_rel).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod slurm_tests {
    use std::ffi::OsString;

    use super::*;
    use crate::slurm::rdzv_port;

    fn fake_env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    fn argv(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    const SLURM: &[(&str, &str)] = &[
        ("SLURM_JOB_ID", "77"),
        ("SLURM_NNODES", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_JOB_NODELIST", "gpu[03-04]"),
        ("SLURM_GPUS_ON_NODE", "4"),
    ];

    #[test]
    fn under_srun_slurm_fills_in_the_flags_nobody_gave_and_flags_win() {
        let env = fake_env(SLURM);
        let (a, sources) = parse(argv(&["rlaunch", "train.py"]), &env).unwrap();
        let port = rdzv_port("77", None);
        assert_eq!(
            (a.nnodes.as_str(), a.rdzv_endpoint.as_str(), a.nproc_per_node.as_str()),
            ("2", format!("gpu03:{port}").as_str(), "4")
        );
        assert_eq!(a.backend().0, "rlaunch");
        assert_eq!(a.elastic_run_id(&env).unwrap().0, "slurm-77");
        let src = |name: &str| sources.iter().find(|(n, _, _)| n == name).map(|(_, _, s)| s.clone()).unwrap();
        assert_eq!(src("nnodes"), "Slurm (SLURM_NNODES)");
        assert_eq!(src("rdzv-endpoint"), "Slurm (the first host of SLURM_JOB_NODELIST, the step's port)");
        // Explicit flags always win.
        let (a, _) =
            parse(argv(&["rlaunch", "--nproc-per-node", "2", "--rdzv-endpoint", "svc:1", "train.py"]), &env).unwrap();
        assert_eq!((a.nnodes.as_str(), a.rdzv_endpoint.as_str(), a.nproc_per_node.as_str()), ("2", "svc:1", "2"));
        // Standalone and static rendezvous are left alone.
        let (a, _) = parse(argv(&["rlaunch", "--standalone", "train.py"]), &env).unwrap();
        assert_eq!((a.nnodes.as_str(), a.rdzv_endpoint.as_str()), ("1:1", ""));
        let (a, _) = parse(argv(&["rlaunch", "--node-rank", "0", "--master-addr", "h", "train.py"]), &env).unwrap();
        assert_eq!(a.rdzv_endpoint, "");
        // Not under Slurm: nothing changes.
        let (a, _) = parse(argv(&["rlaunch", "train.py"]), &fake_env(&[])).unwrap();
        assert_eq!((a.nnodes.as_str(), a.rdzv_endpoint.as_str(), a.nproc_per_node.as_str()), ("1:1", "", "1"));
    }

    #[test]
    fn a_step_on_part_of_the_job_takes_its_own_nodes_and_port() {
        // `srun -N1 -r1` inside a 2-node job: the step runs on gpu04 alone.
        let mut vars = SLURM.to_vec();
        vars.extend([("SLURM_STEP_ID", "3"), ("SLURM_STEP_NUM_NODES", "1"), ("SLURM_STEP_NODELIST", "gpu04")]);
        let env = fake_env(vars.leak());
        let (a, sources) = parse(argv(&["rlaunch", "train.py"]), &env).unwrap();
        assert_eq!(
            (a.nnodes.as_str(), a.rdzv_endpoint.as_str()),
            ("1", format!("gpu04:{}", rdzv_port("77", Some("3"))).as_str())
        );
        let src = |name: &str| sources.iter().find(|(n, _, _)| n == name).map(|(_, _, s)| s.clone()).unwrap();
        assert_eq!(src("nnodes"), "Slurm (SLURM_STEP_NUM_NODES)");
        assert_eq!(a.elastic_run_id(&env).unwrap().0, "slurm-77.3");
    }
}
