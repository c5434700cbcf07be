//! What every way of running a node shares ([`Ctx`]: its warm workers, snapshot store, console,
//! logs and environment), and the workers' store it serves.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use rlaunch::contract::HostPort;
use rlaunch::store::{ServerConfig, StoreHandle, StoreServer};

use crate::error::{AgentError, StoreAddr};
use crate::output::{Console, StdinRouter};
use crate::spec::NodeView;

/// Where the stdin rank's stdin comes from.
#[derive(Clone)]
pub enum WorkerStdin {
    /// /dev/null for every worker (the agent's stdin is a terminal but its stdout is not).
    None,
    /// Typed input: the agent reads its terminal and forwards it to the worker's terminal.
    Terminal(StdinRouter),
    /// A pipe or a file: the worker inherits the agent's own stdin, as under torchrun.
    Inherited,
}

impl WorkerStdin {
    /// What the agent's stdin gives the workers: a terminal's input is forwarded when the
    /// console is one too (typed input only: piped data would pass through a terminal's line
    /// rules, and its 4 KiB line limit, on the way); anything else is inherited as it is.
    pub fn choose(console: &Console) -> WorkerStdin {
        if std::io::IsTerminal::is_terminal(&std::io::stdin()) {
            if console.tty {
                WorkerStdin::Terminal(StdinRouter::start(console.clone()))
            } else {
                WorkerStdin::None
            }
        } else if stdin_is_something() {
            WorkerStdin::Inherited
        } else {
            WorkerStdin::None
        }
    }

    pub fn router(&self) -> Option<&StdinRouter> {
        match self {
            WorkerStdin::Terminal(r) => Some(r),
            _ => None,
        }
    }
}

/// Whether descriptor 0 holds something to pass on: open, and not /dev/null (what batch
/// systems, services and `nohup` give; Rust's runtime also opens it there when the launcher was
/// started with stdin closed). Every worker reads /dev/null then anyway, and their warm
/// interpreters stay alike: none is started for the stdin rank alone.
fn stdin_is_something() -> bool {
    // SAFETY: `stat` is plain old data; all zeroes is a valid value of it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes only into the buffer we own, for a descriptor number it checks.
    if unsafe { libc::fstat(libc::STDIN_FILENO, &mut st) } != 0 {
        return false;
    }
    let dev_null = st.st_mode & libc::S_IFMT == libc::S_IFCHR && st.st_rdev == libc::makedev(1, 3);
    !dev_null
}

/// What every way of running a node shares: where it runs, its environment, console and logs.
pub struct Ctx<'a> {
    /// The node's warm workers, when they are on and the program is Python.
    pub warm: Option<&'a crate::warm::WarmPool>,
    /// The node's snapshot store, when snapshots are on.
    pub snapshots: Option<&'a crate::snapstore::SnapStore>,
    /// How far the running round got (the recovery accounting).
    pub progress: &'a std::sync::Arc<crate::progress::Tracker>,
    pub containment: &'a std::sync::Arc<crate::contain::Containment>,
    pub host: &'a str,
    pub agent_env: &'a BTreeMap<String, String>,
    pub console: &'a Console,
    /// The agent's stdin as the workers see it (`--stdin-rank`'s worker).
    pub stdin: WorkerStdin,
    /// What the snapshot store adds to every worker's environment (none without the store).
    pub snapshot_env: Vec<(&'static str, String)>,
    /// The run's log directory, held open: files are made through it (see [`crate::logdir`]).
    pub log_root: &'a std::sync::Arc<crate::logdir::LogRoot>,
    /// The agent's terminal's size (rows, columns), when stdout is one.
    pub term_size: Option<(u16, u16)>,
    /// Each local rank's CPUs (`--numa-binding`).
    pub cpus: Option<Vec<libc::cpu_set_t>>,
}

impl Ctx<'_> {
    /// What the pure worker specification reads of this node.
    pub fn view(&self) -> NodeView<'_> {
        NodeView {
            host: self.host,
            log_root: self.log_root.path(),
            agent_env: self.agent_env,
            tty: self.console.tty,
            stderr_tty: self.console.stderr_tty,
            stdin: match self.stdin {
                WorkerStdin::None => crate::spec::Stdin::None,
                WorkerStdin::Terminal(_) => crate::spec::Stdin::Terminal,
                WorkerStdin::Inherited => crate::spec::Stdin::Inherited,
            },
            term_size: self.term_size,
            cpus: self.cpus.as_deref(),
            agent_vars: &self.snapshot_env,
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

/// Serves a workers' store (or a probe endpoint) on `bind`, resolved here.
pub async fn start_store(bind: &HostPort, max_total_bytes: usize) -> Result<StoreHandle, AgentError> {
    let unresolved = || AgentError::Store {
        addr: StoreAddr::Unresolved(bind.clone()),
        source: std::io::Error::other("cannot resolve address"),
    };
    let addr: SocketAddr = tokio::net::lookup_host((bind.host(), bind.port()))
        .await
        .ok()
        .and_then(|mut it| it.next())
        .ok_or_else(unresolved)?;
    // On a thread of its own, so the workers' bootstrap never waits behind the agent's work.
    StoreServer::start_dedicated(addr, ServerConfig { max_total_bytes, ..ServerConfig::default() })
        .map_err(|source| AgentError::Store { addr: StoreAddr::Socket(addr), source })
}
