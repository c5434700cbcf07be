//! One attempt's worker group: spawning the workers of this node, noticing their exits the
//! moment they happen, and stopping them (SIGTERM to each process group, grace, SIGKILL).

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::contain::Containment;
use crate::error::AgentError;
use crate::output::{pump, Console, DupFilter, Sink, StdinRouter, Stream};
use crate::process::{spawn_worker, Placement, WorkerProc};
use crate::report::{now_unix, now_unix_ms, read_error_file, Exit, RootCause};
use crate::spec::WorkerSpec;
use rlaunch::contract::OtherFailure;

/// Where a group's workers' output and input go, besides their own files.
pub struct GroupIo {
    pub console: Console,
    /// The agent's stdin, for the worker whose [`Terminal::stdin`] is set.
    pub stdin: Option<StdinRouter>,
    /// torchrun's duplicate filters: stdout's, stderr's.
    pub dup: [Option<Arc<DupFilter>>; 2],
    /// The run's log directory, held open: the workers' directories and files are made there.
    pub log_root: Arc<crate::logdir::LogRoot>,
}

struct Running {
    spec: WorkerSpec,
    pid: u32,
    proc: Arc<WorkerProc>,
    exit: Option<Exit>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    pumps: Vec<JoinHandle<()>>,
    /// Its terminal receives the agent's stdin under this id.
    stdin_id: Option<u64>,
    /// Bytes it wrote to stdout and stderr (progress, for hang detection).
    written: Arc<std::sync::atomic::AtomicU64>,
}

/// How every worker of a group is started: its program, the agent's environment, and the warm
/// interpreters that may become workers.
#[derive(Clone, Copy)]
struct How<'a> {
    program: &'a [OsString],
    agent_env: &'a BTreeMap<String, String>,
    warm: Option<&'a crate::warm::WarmPool>,
}

/// A worker started in place of one of a group's that failed (its own rank failed; the others
/// kept their processes): [`WorkerGroup::adopt`] makes it the group's.
pub struct Fresh {
    index: usize,
    running: Running,
    waiter: JoinHandle<()>,
}

impl Fresh {
    /// Kills it: it will never be the group's (the round could not start).
    pub fn kill(self) {
        let _ = self.running.proc.signal_group(libc::SIGKILL);
    }

    pub fn pid(&self) -> u32 {
        self.running.pid
    }

    pub fn index(&self) -> usize {
        self.index
    }
}

/// Starts workers in a running group in place of failed ones: the group's exit channel and
/// containment.
#[derive(Clone)]
pub struct Starter {
    exits: mpsc::UnboundedSender<ExitMsg>,
    containment: Arc<Containment>,
}

impl Starter {
    /// Starts a worker for index `index` in place of one that failed: warm when a warm
    /// interpreter fits, else cold. [`WorkerGroup::adopt`] hands it to the group; an exit of it
    /// before that is held by the group until then.
    pub fn start(
        &self,
        index: usize,
        spec: WorkerSpec,
        program: &[OsString],
        agent_env: &BTreeMap<String, String>,
        io: &GroupIo,
        warm: Option<&crate::warm::WarmPool>,
    ) -> Result<Fresh, AgentError> {
        let how = How { program, agent_env, warm };
        let (running, waiter) = WorkerGroup::spawn_one(&self.containment, index, spec, &how, io, self.exits.clone())?;
        Ok(Fresh { index, running, waiter })
    }
}

/// A worker's exit as its waiter reports it: its index, its pid (a worker started later in place
/// of a failed one reports under the same index), the exit and when it was seen (Unix ms).
type ExitMsg = (usize, u32, Exit, u64);

pub struct WorkerGroup {
    containment: Arc<Containment>,
    workers: Vec<Running>,
    exits: mpsc::UnboundedReceiver<ExitMsg>,
    /// The exit channel's sender, for workers started later in place of failed ones.
    exit_tx: mpsc::UnboundedSender<ExitMsg>,
    /// Exits of workers started in place of failed ones that came before the group adopted
    /// them: handed out once their worker is the group's.
    held: Vec<ExitMsg>,
    waiters: Vec<JoinHandle<()>>,
    host: String,
    stdin: Option<StdinRouter>,
    /// The run's log directory: the workers' error files and heartbeats are read through it.
    log_root: Arc<crate::logdir::LogRoot>,
}

impl WorkerGroup {
    /// Starts every worker. If one cannot be started, those already started are killed.
    pub fn start(
        program: &[OsString],
        specs: Vec<WorkerSpec>,
        agent_env: &BTreeMap<String, String>,
        io: &GroupIo,
        host: &str,
        containment: Arc<Containment>,
        warm: Option<&crate::warm::WarmPool>,
    ) -> Result<WorkerGroup, AgentError> {
        let (tx, exits) = mpsc::unbounded_channel();
        let mut group = WorkerGroup {
            containment,
            workers: Vec::new(),
            exits,
            exit_tx: tx.clone(),
            held: Vec::new(),
            waiters: Vec::new(),
            host: host.to_string(),
            stdin: io.stdin.clone(),
            log_root: io.log_root.clone(),
        };
        let how = How { program, agent_env, warm };
        for (index, spec) in specs.into_iter().enumerate() {
            match Self::spawn_one(&group.containment, index, spec, &how, io, tx.clone()) {
                Ok((running, waiter)) => {
                    group.workers.push(running);
                    group.waiters.push(waiter);
                }
                Err(e) => {
                    group.kill_now();
                    return Err(e);
                }
            }
        }
        Ok(group)
    }

    /// What starting workers in this group later, in place of failed ones, takes.
    pub fn starter(&self) -> Starter {
        Starter { exits: self.exit_tx.clone(), containment: self.containment.clone() }
    }

    /// Makes `fresh` the group's worker at its index (the failed one there was reaped with
    /// [`WorkerGroup::reap_worker`]); an exit of it that came before is handed out next.
    pub fn adopt(&mut self, fresh: Fresh) {
        let Fresh { index, running, waiter } = fresh;
        if let Some(slot) = self.workers.get_mut(index) {
            *slot = running;
            self.waiters.push(waiter);
        } else {
            let _ = running.proc.signal_group(libc::SIGKILL);
            waiter.abort();
        }
    }

    /// Kills what a failed worker left running (its children, its process group) and takes its
    /// last output, while the group's other workers go on.
    pub async fn reap_worker(&mut self, index: usize) {
        let Some(w) = self.workers.get(index) else { return };
        self.containment.watch_group(w.pid, false);
        match &*self.containment {
            Containment::Cgroup(_) => self.containment.kill_rest(&[w.spec.env.local_rank], &[]).await,
            Containment::ProcessGroups(_) => {
                // Its leader is reaped (its exit was reported), so its number is not signalled;
                // what is left of its process group was orphaned to the agent and is killed
                // there: the other workers and their children (in their own groups) go on. A
                // process of it that left the group is killed with the group's last stop.
                let pgid = w.pid;
                let _ = tokio::task::spawn_blocking(move || crate::process::kill_orphans_in_group(pgid)).await;
            }
        }
        let w = &mut self.workers[index];
        for p in w.pumps.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(2), p).await;
        }
        if let (Some(router), Some(id)) = (&self.stdin, w.stdin_id.take()) {
            router.clear(id);
        }
    }

    fn spawn_one(
        containment: &Containment,
        index: usize,
        spec: WorkerSpec,
        how: &How<'_>,
        io: &GroupIo,
        tx: mpsc::UnboundedSender<ExitMsg>,
    ) -> Result<(Running, JoinHandle<()>), AgentError> {
        let How { program, agent_env, warm } = *how;
        let console: &Console = &io.console;
        let local_rank = spec.env.local_rank;
        io.log_root.create_dirs(&spec.dir).map_err(|source| AgentError::LogDir { path: spec.dir.clone(), source })?;
        let (exe, args) = program.split_first().expect("the launcher never passes an empty program");
        let mut cmd = std::process::Command::new(exe);
        cmd.args(args);
        cmd.envs(spec.vars(agent_env));
        if let Some(path) = &spec.heartbeat {
            crate::hangwatch::create_heartbeat(&io.log_root, path)
                .map_err(|source| AgentError::LogDir { path: path.clone(), source })?;
        }
        let place = Placement { cgroup_procs: containment.procs_file(local_rank), cpus: spec.cpus, keep_fd: None };
        // A warm interpreter becomes this worker when one waits (`cmd` says what it becomes);
        // otherwise the worker starts cold.
        let template = crate::spec::warm_template(&spec, agent_env);
        let spawned = match warm.and_then(|w| w.take(&template, &cmd)) {
            Some(spawned) => spawned,
            None => spawn_worker(cmd, place, spec.terminal).map_err(|source| AgentError::Spawn {
                local_rank,
                program: exe.to_string_lossy().into_owned(),
                source,
            })?,
        };
        let proc = Arc::new(spawned.proc);
        let pid = proc.pid();
        // Process groups: the watchdog kills this group too if the agent dies (a child left in
        // the worker's group has no parent-death signal of its own).
        containment.watch_group(pid, true);
        let stdin_id = match (spawned.stdin, &io.stdin) {
            (Some(terminal), Some(router)) => {
                let id = console.new_source();
                router.set(id, terminal);
                Some(id)
            }
            _ => None,
        };
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut pumps = Vec::new();
        for (stream, reader) in [(Stream::Stdout, spawned.stdout), (Stream::Stderr, spawned.stderr)] {
            let name = if stream == Stream::Stdout { "stdout.log" } else { "stderr.log" };
            // A log that cannot be opened leaves the stream to the console, as a full disk does:
            // a worker is never stopped by its logs.
            let file = spec.files.has(stream).then(|| spec.dir.join(name)).and_then(|path| {
                match io.log_root.open(&path, crate::logdir::Open::Append) {
                    Ok(f) => Some((f, path)),
                    Err(e) => {
                        warn!(path = %path.display(), error = %e, "cannot open the log file; this stream is not kept in a file (the console still gets it where it is shown)");
                        None
                    }
                }
            });
            let sink = Sink {
                stream,
                console: spec.console.has(stream).then(|| (console.clone(), spec.prefix.clone().into_bytes())),
                file,
                tail: (stream == Stream::Stderr).then(|| stderr_tail.clone()),
                partial: if stream == Stream::Stdout { spec.terminal.stdout } else { spec.terminal.stderr },
                dup: io.dup[if stream == Stream::Stdout { 0 } else { 1 }].clone(),
                written: Some(written.clone()),
            };
            pumps.push(tokio::spawn(async move {
                if let Err(e) = pump(reader, sink).await {
                    warn!(local_rank, error = %e, "lost worker output");
                }
            }));
        }
        let waited = proc.clone();
        let waiter = tokio::spawn(async move {
            let exit = match waited.wait().await {
                Ok(exit) => exit,
                Err(e) => {
                    warn!(local_rank, error = %e, "could not wait for worker");
                    Exit::Code(1)
                }
            };
            let _ = tx.send((index, pid, exit, now_unix_ms()));
        });
        debug!(local_rank, rank = spec.env.rank, pid, "worker started");
        Ok((Running { spec, pid, proc, exit: None, stderr_tail, pumps, stdin_id, written }, waiter))
    }

    /// The workers still running, as hang detection samples them.
    pub fn watched(&self) -> Vec<crate::hangwatch::Watched> {
        self.workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.exit.is_none())
            .map(|(index, w)| crate::hangwatch::Watched {
                index,
                rank: w.spec.env.rank,
                pid: w.pid,
                written: w.written.clone(),
                heartbeat: w.spec.heartbeat.clone(),
                log_root: self.log_root.clone(),
            })
            .collect()
    }

    /// How many workers the group started.
    pub fn size(&self) -> usize {
        self.workers.len()
    }

    /// The root cause of a hang: worker `index` (the odd one out, or the longest quiet) made no
    /// progress; `stacks` says where every rank stood, the odd one out first. The agent stops
    /// it (SIGTERM).
    pub fn hang_root_cause(&self, index: usize, message: String, stacks: Vec<String>) -> RootCause {
        let tail = self.workers[index].stderr_tail.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect();
        RootCause {
            stderr_tail: tail,
            stacks,
            seen_at_ms: Some(now_unix_ms()),
            ..self.cause_base(index, Exit::Signal(libc::SIGTERM), now_unix(), message)
        }
    }

    /// What every root cause of worker `index` says of it.
    fn cause_base(&self, index: usize, exit: Exit, timestamp: u64, message: String) -> RootCause {
        let w = &self.workers[index];
        RootCause {
            rank: w.spec.env.rank,
            local_rank: w.spec.env.local_rank,
            role: w.spec.env.role_name.clone(),
            host: self.host.clone(),
            pid: w.pid,
            exit,
            timestamp,
            restart_count: w.spec.env.restart_count,
            ..RootCause::from_message(message)
        }
    }

    pub fn pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.pid).collect()
    }

    /// The next worker exit, recorded here (a reaped worker is never signalled again); `None`
    /// only if the channel closed (the group holds a sender for workers started later, so a
    /// waiter that never reports is not seen as one). Cancel-safe: it can sit in a `select!`.
    pub async fn next_exit(&mut self) -> Option<(usize, Exit, u64)> {
        loop {
            if let Some(got) = self.try_held() {
                return Some(got);
            }
            let msg = self.exits.recv().await?;
            if let Some(got) = self.record(msg) {
                return Some(got);
            }
        }
    }

    /// An exit already noticed, without waiting.
    pub fn try_next_exit(&mut self) -> Option<(usize, Exit, u64)> {
        loop {
            if let Some(got) = self.try_held() {
                return Some(got);
            }
            let msg = self.exits.try_recv().ok()?;
            if let Some(got) = self.record(msg) {
                return Some(got);
            }
        }
    }

    /// A held exit whose worker the group has adopted since.
    fn try_held(&mut self) -> Option<(usize, Exit, u64)> {
        let workers = &self.workers;
        let i = self.held.iter().position(|&(index, pid, ..)| workers.get(index).is_some_and(|w| w.pid == pid))?;
        let msg = self.held.swap_remove(i);
        self.record(msg)
    }

    /// Records an exit on its worker; one of a process the group has not adopted yet (started in
    /// place of a failed worker, dead before the group took it) is kept for its adoption.
    fn record(&mut self, (index, pid, exit, seen_at): ExitMsg) -> Option<(usize, Exit, u64)> {
        match self.workers.get_mut(index) {
            Some(w) if w.pid == pid => {
                w.exit = Some(exit);
                Some((index, exit, seen_at))
            }
            _ => {
                self.held.push((index, pid, exit, seen_at));
                None
            }
        }
    }

    /// Whether a worker has not been seen to exit.
    pub fn any_running(&self) -> bool {
        self.workers.iter().any(|w| w.exit.is_none())
    }

    /// The first worker not seen to exit.
    pub fn first_running(&self) -> Option<usize> {
        self.workers.iter().position(|w| w.exit.is_none())
    }

    /// The workers kept their processes into a new round: their environment there (by index),
    /// for the reports that name their ranks and error files.
    pub fn renumber(&mut self, specs: Vec<WorkerSpec>) {
        for (w, spec) in self.workers.iter_mut().zip(specs) {
            w.spec.env = spec.env;
            w.spec.dir = spec.dir;
            w.spec.heartbeat = spec.heartbeat;
        }
    }

    /// Each worker's global rank, by index.
    pub fn ranks(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.spec.env.rank).collect()
    }

    /// The report of a failure the supervisor settled: the first failure's root cause (its error
    /// file, else its stderr tail), the others that failed with it, where the survivors stood.
    pub async fn failure_report(&mut self, failure: crate::supervisor::Failure) -> RootCause {
        let mut rc = self.root_cause(failure.index, failure.exit, failure.seen_at).await;
        rc.other_failures = failure
            .others
            .iter()
            .map(|(i, exit)| {
                let w = &self.workers[*i];
                let data = w.spec.env.error_file.as_ref().and_then(|p| read_error_file(&self.log_root, Path::new(p)));
                OtherFailure {
                    rank: w.spec.env.rank,
                    local_rank: w.spec.env.local_rank,
                    pid: w.pid,
                    exit: *exit,
                    message: data
                        .map(|d| d.message)
                        .unwrap_or_else(|| format!("worker exited with {}", exit.describe())),
                }
            })
            .collect();
        rc.stacks = failure.stacks;
        rc
    }

    /// `seen_at`: when the exit was seen (Unix ms).
    async fn root_cause(&mut self, index: usize, exit: Exit, seen_at: u64) -> RootCause {
        let w = &mut self.workers[index];
        drain_output(&w.pumps, &w.written).await;
        let error_file = w.spec.env.error_file.as_ref().map(PathBuf::from);
        let data = error_file.as_deref().and_then(|p| read_error_file(&self.log_root, p));
        let tail: Vec<String> = w.stderr_tail.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect();
        let timestamp = data.as_ref().and_then(|d| d.timestamp).unwrap_or(seen_at / 1000);
        let message = data
            .as_ref()
            .map(|d| d.message.clone())
            .unwrap_or_else(|| format!("worker exited with {} (no error file written)", exit.describe()));
        RootCause {
            traceback: data.as_ref().and_then(|d| d.traceback.clone()),
            error_file: if data.is_some() { error_file } else { None },
            stderr_tail: if data.is_some() { Vec::new() } else { tail },
            seen_at_ms: Some(seen_at),
            ..self.cause_base(index, exit, timestamp, message)
        }
    }

    /// Relays `signal` to every worker's process group.
    pub fn signal_all(&self, signal: i32) {
        for w in self.workers.iter().filter(|w| w.exit.is_none()) {
            if let Err(e) = w.proc.signal_group(signal) {
                warn!(pid = w.pid, signal, error = %e, "could not signal worker");
            }
        }
    }

    fn kill_now(&self) {
        for w in &self.workers {
            let _ = w.proc.signal_group(libc::SIGKILL);
        }
    }

    /// Stops every worker: SIGTERM to each process group, up to `grace` for them to exit, then
    /// SIGKILL. Returns once every worker is reaped and no process of their groups is left.
    pub async fn stop(&mut self, grace: Duration, first: i32) {
        let deadline = tokio::time::Instant::now() + grace;
        if first != libc::SIGTERM {
            // `first` (SIGINT) for half the grace, then SIGTERM for the rest, as torchrun does.
            self.signal_all(first);
            if !self.await_exits(tokio::time::Instant::now() + grace / 2).await {
                return self.reap_stragglers().await;
            }
        }
        self.signal_all(libc::SIGTERM);
        if self.await_exits(deadline).await {
            warn!(grace_ms = grace.as_millis() as u64, "workers ignored SIGTERM; sending SIGKILL");
            self.kill_now();
            self.await_exits(tokio::time::Instant::now() + Duration::from_secs(10)).await;
        }
        self.reap_stragglers().await;
    }

    /// Records exits until every worker has one or `deadline`; whether some are still running.
    async fn await_exits(&mut self, deadline: tokio::time::Instant) -> bool {
        while self.workers.iter().any(|w| w.exit.is_none()) {
            if self.try_held().is_some() {
                continue;
            }
            match tokio::time::timeout_at(deadline, self.exits.recv()).await {
                Ok(Some(msg)) => {
                    self.record(msg);
                }
                Ok(None) => return false,
                Err(_) => return true,
            }
        }
        false
    }

    /// Kills what is left in the workers' process groups (their own children) and waits for
    /// the output pumps, so nothing of this attempt outlives it.
    pub async fn reap_stragglers(&mut self) {
        match &*self.containment {
            Containment::Cgroup(_) => {
                // The whole tree of each worker, whatever process group or session it is in.
                let ranks: Vec<u32> = self.workers.iter().map(|w| w.spec.env.local_rank).collect();
                self.containment.kill_rest(&ranks, &[]).await;
            }
            Containment::ProcessGroups(_) => {
                // Groups whose leader is reaped are not signalled (their number may name
                // someone else by now); what is left of them was orphaned to this subreaper.
                for w in &self.workers {
                    let _ = w.proc.signal_group(libc::SIGKILL);
                    self.containment.watch_group(w.pid, false);
                }
                // Descendants that left the groups were orphaned to this subreaper.
                let unreaped: Vec<u32> = self.workers.iter().filter(|w| !w.proc.is_reaped()).map(|w| w.pid).collect();
                self.containment.kill_rest(&[], &unreaped).await;
            }
        }
        for w in self.workers.iter_mut() {
            for p in w.pumps.drain(..) {
                let _ = tokio::time::timeout(Duration::from_secs(2), p).await;
            }
        }
        self.release_stdin();
    }

    fn release_stdin(&self) {
        if let Some(router) = &self.stdin {
            for id in self.workers.iter().filter_map(|w| w.stdin_id) {
                router.clear(id);
            }
        }
    }
}

/// How long a dead worker's output must have been quiet for what it wrote to count as read (its
/// pipes' pumps read whatever is in them at once; a runtime too busy to run them for this long
/// would lose the tail's last lines, as the bound below always could).
const OUTPUT_QUIET: Duration = Duration::from_millis(100);
/// Longest the report of a dead worker waits for its output.
const OUTPUT_DRAIN_WITHIN: Duration = Duration::from_millis(500);

/// Waits until a dead worker's output pumps are done, so that its stderr tail is complete: until
/// they end (the pipes closed), or their output was quiet for [`OUTPUT_QUIET`] (a child of the
/// worker, a data loader's process, still holds the pipes: what the worker wrote is in them
/// already and read at once), at most [`OUTPUT_DRAIN_WITHIN`]. The pumps go on.
async fn drain_output(pumps: &[JoinHandle<()>], written: &std::sync::atomic::AtomicU64) {
    use std::sync::atomic::Ordering;
    let start = tokio::time::Instant::now();
    let (mut seen, mut quiet_since) = (written.load(Ordering::Relaxed), start);
    while !pumps.iter().all(JoinHandle::is_finished) && start.elapsed() < OUTPUT_DRAIN_WITHIN {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = written.load(Ordering::Relaxed);
        if now != seen {
            (seen, quiet_since) = (now, tokio::time::Instant::now());
        } else if quiet_since.elapsed() >= OUTPUT_QUIET {
            break;
        }
    }
}

impl Drop for WorkerGroup {
    fn drop(&mut self) {
        // An agent unwinding (error, cancellation) must not leave workers behind.
        for w in self.workers.iter().filter(|w| w.exit.is_none()) {
            let _ = w.proc.signal_group(libc::SIGKILL);
        }
        for w in &self.workers {
            self.containment.watch_group(w.pid, false);
        }
        for t in &self.waiters {
            t.abort();
        }
        self.release_stdin();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AgentConfig;
    use crate::core::Placement;
    use crate::spec::{worker_specs, NodeView, Stdin};
    use rlaunch::contract::HostPort;

    /// What starting two real workers of `script` (sh) as the driver starts them takes.
    struct Parts {
        program: Vec<OsString>,
        env: BTreeMap<String, String>,
        specs: Vec<WorkerSpec>,
        io: GroupIo,
        containment: Arc<Containment>,
    }

    impl Parts {
        fn start(&self) -> WorkerGroup {
            WorkerGroup::start(
                &self.program,
                self.specs.clone(),
                &self.env,
                &self.io,
                "node0",
                self.containment.clone(),
                None,
            )
            .unwrap()
        }
    }

    /// Two real workers of `script` (sh), started as the driver starts them.
    fn group(script: &str, dir: &Path) -> WorkerGroup {
        parts(script, dir).start()
    }

    fn parts(script: &str, dir: &Path) -> Parts {
        let root = Arc::new(crate::logdir::LogRoot::create_private(&dir.join("logs"), 0o700).unwrap());
        let env = BTreeMap::from([("PATH".to_string(), "/usr/bin:/bin".to_string())]);
        let program: Vec<OsString> = vec!["/bin/sh".into(), "-c".into(), script.into()];
        let config = AgentConfig::standalone(program.clone(), 2);
        let view = NodeView {
            host: "node0",
            log_root: root.path(),
            agent_env: &env,
            tty: false,
            stderr_tty: false,
            stdin: Stdin::None,
            term_size: None,
            cpus: None,
            agent_vars: &[],
        };
        let master = HostPort::new("127.0.0.1", 1).unwrap();
        let specs = worker_specs(&config, &Placement::fixed(0, 1, 2, None, None), &master, &view);
        let io = GroupIo { console: Console::start(), stdin: None, dup: [None, None], log_root: root };
        let containment = Arc::new(Containment::detect(2, Some("process-group")));
        Parts { program, env, specs, io, containment }
    }

    async fn exits(g: &mut WorkerGroup, n: usize) -> Vec<(usize, Exit, u64)> {
        let mut seen = Vec::new();
        while seen.len() < n {
            let next = tokio::time::timeout(Duration::from_secs(20), g.next_exit()).await;
            seen.push(next.expect("an exit within 20 s").expect("the waiters report"));
        }
        seen.sort_by_key(|(i, _, _)| *i);
        seen
    }

    #[tokio::test]
    async fn each_exit_is_reported_once_with_its_code_and_a_failure_names_its_rank_and_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let mut g = group("echo \"rank $RANK gives up\" >&2; exit $((LOCAL_RANK + 3))", dir.path());
        let seen = exits(&mut g, 2).await;
        assert_eq!(seen.iter().map(|(i, e, _)| (*i, *e)).collect::<Vec<_>>(), [(0, Exit::Code(3)), (1, Exit::Code(4))]);
        assert!(!g.any_running());
        let (index, exit, seen_at) = seen[1];
        let failure =
            crate::supervisor::Failure { index, exit, seen_at, others: vec![(0, Exit::Code(3))], stacks: vec![] };
        let rc = g.failure_report(failure).await;
        assert_eq!((rc.rank, rc.local_rank, rc.exit, rc.host.as_str()), (1, 1, Exit::Code(4), "node0"));
        assert_eq!(rc.message, "worker exited with exit code 4 (no error file written)");
        assert!(rc.stderr_tail.iter().any(|l| l.contains("rank 1 gives up")), "{:?}", rc.stderr_tail);
        assert_eq!(rc.other_failures.len(), 1);
        assert_eq!((rc.other_failures[0].rank, rc.other_failures[0].exit), (0, Exit::Code(3)));
    }

    /// Worker 1 fails leaving a child that holds its output; worker 0 runs on. The report does
    /// not wait for the child's pipes; what the failed worker left is killed while worker 0 goes
    /// on; a worker started in its place that dies before the group adopts it is reported once
    /// adopted, under its index. In a process of its own: it makes itself a subreaper (as the
    /// agent is), and the other tests' stops kill every child of theirs they do not know.
    #[test]
    fn a_failed_worker_is_reaped_alone_and_its_replacement_s_early_death_is_not_lost() {
        // Spared by the other tests' stops, as a warm interpreter is by a group's (registered
        // under the lock a sweep takes, before any sweep can see it).
        let mut spared = crate::process::spared();
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "workers::tests::failed_worker_reaped_alone_in_its_own_process"])
            .args(["--ignored", "--nocapture", "--test-threads", "1"])
            .env("RLAUNCH_TEST_OWN_PROCESS", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        spared.insert(pid);
        drop(spared);
        let out = child.wait_with_output();
        crate::process::spared().remove(&pid);
        let out = out.unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
    }

    #[tokio::test]
    #[ignore = "run by a_failed_worker_is_reaped_alone_and_its_replacement_s_early_death_is_not_lost"]
    async fn failed_worker_reaped_alone_in_its_own_process() {
        assert!(std::env::var_os("RLAUNCH_TEST_OWN_PROCESS").is_some(), "run alone, in its own process");
        // Orphans come to this process, as to the agent (a subreaper).
        // SAFETY: prctl with an integer argument.
        assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }, 0);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let script = format!(
            "if [ -f {d}/second ]; then exit 9; fi; \
             if [ \"$LOCAL_RANK\" = 1 ]; then sleep 60 & echo $! > {d}/child; echo 'rank 1 gives up' >&2; exit 5; fi; \
             while :; do sleep 0.05; done"
        );
        let parts = parts(&script, dir.path());
        let mut g = parts.start();
        let (index, exit, seen_at) = exits(&mut g, 1).await[0];
        assert_eq!((index, exit), (1, Exit::Code(5)));
        let t = std::time::Instant::now();
        let rc =
            g.failure_report(crate::supervisor::Failure { index, exit, seen_at, others: vec![], stacks: vec![] }).await;
        assert!(
            t.elapsed() < Duration::from_millis(450),
            "the report waited {:?} for pipes a child holds",
            t.elapsed()
        );
        assert!(rc.stderr_tail.iter().any(|l| l.contains("rank 1 gives up")), "{:?}", rc.stderr_tail);
        let child: i32 = std::fs::read_to_string(dir.path().join("child")).unwrap().trim().parse().unwrap();
        g.reap_worker(1).await;
        assert!(!std::path::Path::new(&format!("/proc/{child}")).exists(), "the failed worker's child is gone");
        assert!(g.any_running(), "worker 0 runs on");
        // Its replacement dies at once, before the group adopts it.
        std::fs::write(dir.path().join("second"), "").unwrap();
        let fresh = g.starter().start(1, parts.specs[1].clone(), &parts.program, &parts.env, &parts.io, None).unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let early = g.try_next_exit();
        assert!(early.is_none(), "no exit of a worker the group has not adopted: {early:?}");
        g.adopt(fresh);
        let next = tokio::time::timeout(Duration::from_secs(5), g.next_exit()).await.expect("its exit").unwrap();
        assert_eq!((next.0, next.1), (1, Exit::Code(9)));
        g.stop(Duration::from_millis(300), libc::SIGTERM).await;
    }

    #[tokio::test]
    async fn a_stop_ends_workers_that_ignore_the_first_signal_within_the_grace() {
        let dir = tempfile::tempdir().unwrap();
        let mut g =
            group("trap '' TERM; echo up > \"$TORCHELASTIC_ERROR_FILE.up\"; while :; do sleep 0.05; done", dir.path());
        assert!(g.any_running());
        let started = std::time::Instant::now();
        g.stop(Duration::from_millis(300), libc::SIGTERM).await;
        assert!(!g.any_running(), "every worker is gone after a stop");
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    }
}
