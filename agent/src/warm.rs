//! Warm workers (`--warm-workers`): per local rank, a Python interpreter started ahead of the
//! round that will need it, which has already imported the program's modules from outside the
//! program's own directory (torch, numpy, ...) and waits for its environment. A new round then
//! starts no interpreter and imports nothing: the agent hands the warm one its rank's whole
//! command line, environment and working directory over a pipe, and it becomes that worker
//! (`warm/bootstrap.py`). Everything else is a worker's like any other: the process was started
//! by [`spawn_worker`] with the rank's terminal and CPUs, in a process group of its own with the
//! parent-death signal; it moves into the rank's cgroup before it runs the program; its output
//! is pumped, its exit noticed and its stacks read as a cold worker's.
//!
//! A node keeps one set: before the first round (a spare has its set ready before any fault),
//! and again [`crate::core::REFILL_AFTER`] after each round's start. A warm worker that died, or was started
//! for another terminal, is not used: that rank starts cold.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::contain::Containment;
use crate::process::{spawn_worker, Placement, Spawned, Terminal};

/// The order pipe's size: 1 MiB, the most an unprivileged process may ask for by default.
const ORDER_PIPE: libc::c_int = 1 << 20;

/// The bootstrap's file name: its frames are left out of a worker's stack.
pub const BOOTSTRAP_FILE: &str = "rlaunch_warm.py";

/// The bootstrap each warm interpreter runs, written out once per agent.
const BOOTSTRAP: &str = include_str!("warm/bootstrap.py");

/// A program a warm interpreter can become: `python [flags] script.py args...` or
/// `python [flags] -m module args...`, as the launcher builds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmProgram {
    python: OsString,
    flags: Vec<OsString>,
    module: bool,
    target: OsString,
    /// Where the script (or module name) stands in the program's argv.
    target_index: usize,
}

/// Interpreter flags that take no argument and change nothing a warm start would miss.
const PLAIN_FLAGS: &[&str] = &["-u", "-B", "-O", "-OO", "-s", "-b", "-bb", "-q", "-d", "-v"];

impl WarmProgram {
    /// The program as a warm interpreter can run it, or `None` (not Python, `-c`, flags with
    /// arguments, an interpreter given no program).
    pub fn parse(program: &[OsString]) -> Option<WarmProgram> {
        let (python, rest) = program.split_first()?;
        let name = std::path::Path::new(python).file_name()?.to_string_lossy().into_owned();
        if !name.starts_with("python") {
            return None;
        }
        let mut flags = Vec::new();
        for (i, arg) in rest.iter().enumerate() {
            let text = arg.to_string_lossy();
            if text == "-m" {
                let target = rest.get(i + 1)?.clone();
                return Some(WarmProgram { python: python.clone(), flags, module: true, target, target_index: i + 2 });
            }
            if PLAIN_FLAGS.contains(&text.as_ref()) {
                flags.push(arg.clone());
                continue;
            }
            if text.starts_with('-') {
                return None;
            }
            return Some(WarmProgram {
                python: python.clone(),
                flags,
                module: false,
                target: arg.clone(),
                target_index: i + 1,
            });
        }
        None
    }
}

/// One warm interpreter, waiting.
struct Warm {
    spawned: Spawned,
    /// The pipe its order is written to (closing it unused lets it exit).
    order: std::fs::File,
    /// What it was started with: it is used only for a worker that would get the same.
    env: Vec<(String, String)>,
    /// Its whole environment as started (the order says how the worker's differs).
    spawned_env: BTreeMap<OsString, OsString>,
    terminal: Terminal,
    cpus: Option<libc::cpu_set_t>,
}

impl Warm {
    fn fits(&self, t: &Template) -> bool {
        let same_cpus = match (&self.cpus, &t.cpus) {
            (None, None) => true,
            // SAFETY: two valid cpu sets, compared.
            (Some(a), Some(b)) => unsafe { libc::CPU_EQUAL(a, b) },
            _ => false,
        };
        // The rank variables may differ (a spare's set was started before it knew its ranks):
        // the interpreter itself starts again cold if a module it imported ahead read one.
        let settled = |env: &[(String, String)]| -> Vec<(String, String)> {
            env.iter().filter(|(k, _)| !RANK_VARS.contains(&k.as_str())).cloned().collect()
        };
        same_cpus && self.terminal == t.terminal && settled(&self.env) == settled(&t.env)
    }
}

/// The variables that place a worker in its round, which bootstrap.py checks itself
/// (`_RANK_VARS` there).
const RANK_VARS: &[&str] = &[
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
];

/// What a warm worker of one local rank is started with.
pub struct Template {
    pub local_rank: u32,
    /// Set over the agent's own environment: what the rank's worker of the round expected next
    /// gets, but for what changes every attempt (the store's address, the restart count, the
    /// error file): its ranks and sizes, OMP_NUM_THREADS, the snapshot package's PYTHONPATH,
    /// `--virtual-local-rank`'s CUDA_VISIBLE_DEVICES. Modules may read these as they are
    /// imported; a worker whose ranks turn out otherwise starts again cold (bootstrap.py).
    pub env: Vec<(String, String)>,
    pub terminal: Terminal,
    pub cpus: Option<libc::cpu_set_t>,
}

/// This node's warm workers.
pub struct WarmPool {
    program: WarmProgram,
    containment: Arc<Containment>,
    /// Holds the bootstrap file; removed with the pool.
    dir: crate::rundir::RunDir,
    ready: Mutex<BTreeMap<u32, Warm>>,
}

impl WarmPool {
    /// A pool for `program`, or `None` when it is not a Python program a warm interpreter can
    /// become (said once), or the bootstrap cannot be written.
    pub fn new(program: &[OsString], containment: Arc<Containment>) -> Option<WarmPool> {
        let Some(program) = WarmProgram::parse(program) else {
            info!(
                "warm workers: the program is not `python script.py` or `python -m module`; every worker starts cold"
            );
            return None;
        };
        let dir = crate::rundir::RunDir::create("rlaunch-warm", 0)
            .and_then(|dir| std::fs::write(dir.path().join(BOOTSTRAP_FILE), BOOTSTRAP).map(|()| dir));
        match dir {
            Ok(dir) => Some(WarmPool { program, containment, dir, ready: Mutex::new(BTreeMap::new()) }),
            Err(e) => {
                warn!(error = %e, "cannot write the warm workers' bootstrap; every worker starts cold");
                None
            }
        }
    }

    fn bootstrap(&self) -> PathBuf {
        self.dir.path().join(BOOTSTRAP_FILE)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Warm>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a warm worker for every template's rank that has none waiting (one that died is
    /// replaced). Must run on a thread that lives as long as the agent (see [`spawn_worker`]).
    pub fn fill(&self, templates: &[Template]) {
        let mut ready = self.lock();
        for t in templates {
            if let Some(w) = ready.get(&t.local_rank) {
                if !w.spawned.proc.has_exited() && w.fits(t) {
                    continue;
                }
            }
            if let Some(old) = ready.remove(&t.local_rank) {
                self.discard(old);
            }
            match self.spawn(t) {
                Ok(w) => {
                    debug!(local_rank = t.local_rank, pid = w.spawned.proc.pid(), "warm worker started");
                    ready.insert(t.local_rank, w);
                }
                Err(e) => {
                    warn!(local_rank = t.local_rank, error = %e, "cannot start a warm worker; this rank starts cold")
                }
            }
        }
    }

    fn spawn(&self, t: &Template) -> std::io::Result<Warm> {
        let (read, write) = pipe()?;
        // Above stderr whatever the agent's own descriptors are (a closed stdin would otherwise
        // hand out 0, which the worker's stdin replaces).
        // SAFETY: fcntl duplicates a descriptor we own into a new one, owned from here.
        let read = match unsafe { libc::fcntl(read.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) } {
            fd if fd >= 3 => unsafe { OwnedFd::from_raw_fd(fd) },
            _ => return Err(std::io::Error::last_os_error()),
        };
        // The order is written without waiting for the interpreter to read it (it may still be
        // importing): the pipe holds any environment a kernel lets a process have.
        // SAFETY: fcntl on a descriptor we own.
        unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, ORDER_PIPE) };
        let p = &self.program;
        let mut cmd = std::process::Command::new(&p.python);
        cmd.args(&p.flags)
            .arg(self.bootstrap())
            .arg(read.as_raw_fd().to_string())
            .arg(if p.module { "module" } else { "script" })
            .arg(&p.target);
        for (k, v) in &t.env {
            cmd.env(k, v);
        }
        // The order pipe's read end stays open across exec (it was made close-on-exec, as
        // every other descriptor of the agent).
        let place = Placement {
            cgroup_procs: self.containment.warm_procs_file(t.local_rank),
            cpus: t.cpus,
            keep_fd: Some(read.as_raw_fd()),
        };
        // Known as warm before a stop's sweep of orphans can see it (process groups).
        let spawned_env = whole_env(&cmd);
        let mut live = crate::process::spared();
        let spawned = spawn_worker(cmd, place, t.terminal)?;
        drop(read);
        let pid = spawned.proc.pid();
        live.insert(pid);
        drop(live);
        self.containment.watch_group(pid, true);
        Ok(Warm {
            spawned,
            order: std::fs::File::from(write),
            env: t.env.clone(),
            spawned_env,
            terminal: t.terminal,
            cpus: t.cpus,
        })
    }

    /// Makes the warm worker of `local_rank` the worker `cmd` describes (`cmd` is the command a
    /// cold start would run, with its whole environment): `None` when there is none fit to use
    /// (then `cmd` is to be started cold).
    pub fn take(&self, t: &Template, cmd: &std::process::Command) -> Option<Spawned> {
        let local_rank = t.local_rank;
        let w = self.lock().remove(&local_rank)?;
        if !w.fits(t) || w.spawned.proc.has_exited() {
            debug!(local_rank, "the warm worker is gone or was started for another placement; starting cold");
            self.discard(w);
            return None;
        }
        let pid = w.spawned.proc.pid();
        if let Err(e) = self.containment.adopt(local_rank) {
            warn!(local_rank, error = %e, "cannot move the warm worker into its rank's cgroup; starting cold");
            self.discard(w);
            return None;
        }
        let bytes = order_bytes(cmd, self.program.target_index, &w.spawned_env);
        // SAFETY: fcntl on a descriptor the pool owns.
        let room = unsafe { libc::fcntl(w.order.as_raw_fd(), libc::F_GETPIPE_SZ) };
        if usize::try_from(room).map_or(true, |room| bytes.len() > room) {
            warn!(
                local_rank,
                bytes = bytes.len(),
                "the worker's environment does not fit the warm worker's pipe; starting cold"
            );
            self.discard(w);
            return None;
        }
        let mut w = w;
        if let Err(e) = w.order.write_all(&bytes) {
            // It died between the look and the order: the rank starts cold.
            warn!(local_rank, pid, error = %e, "the warm worker did not take its order; starting cold");
            self.discard(w);
            return None;
        }
        let Warm { spawned, order, .. } = w;
        drop(order);
        forget(pid);
        debug!(local_rank, pid, "warm worker becomes the rank's worker");
        Some(spawned)
    }

    /// How many warm workers wait now.
    pub fn waiting(&self) -> usize {
        self.lock().len()
    }
}

impl WarmPool {
    /// A warm worker not to be used: killed, and reaped on a task of its own.
    fn discard(&self, w: Warm) {
        let pid = w.spawned.proc.pid();
        drop(w.order);
        let _ = w.spawned.proc.signal_group(libc::SIGKILL);
        self.containment.watch_group(pid, false);
        let proc = w.spawned.proc;
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn(async move {
                    let _ = proc.wait().await;
                    forget(pid);
                });
            }
            Err(_) => {
                proc.kill_and_reap(Duration::from_secs(2));
                forget(pid);
            }
        }
    }
}

impl Drop for WarmPool {
    fn drop(&mut self) {
        for (_, w) in std::mem::take(&mut *self.lock()) {
            let pid = w.spawned.proc.pid();
            drop(w.order);
            if !w.spawned.proc.kill_and_reap(Duration::from_secs(2)) {
                warn!(pid, "a warm worker was killed but not reaped within 2 s");
            }
            self.containment.watch_group(pid, false);
            forget(pid);
        }
    }
}

fn forget(pid: u32) {
    crate::process::spared().remove(&pid);
}

/// The whole environment `cmd` starts a process with: the agent's, with `cmd`'s changes.
fn whole_env(cmd: &std::process::Command) -> BTreeMap<OsString, OsString> {
    let mut env: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => env.insert(k.to_owned(), v.to_owned()),
            None => env.remove(k),
        };
    }
    env
}

/// The order for a warm worker: `cmd`'s whole argv and working directory, and how its
/// environment differs from the one the warm interpreter was started with (`spawned`): each
/// variable that differs, with its value then and its value for the worker (absent: null),
/// each byte string in hex (environments need not be UTF-8), as JSON. The interpreter changes
/// a variable only where it still has the value it was started with, so what its own start set
/// (an interpreter wrapper's variables, the locale it coerced) stays, as in a cold start.
fn order_bytes(cmd: &std::process::Command, target_index: usize, spawned: &BTreeMap<OsString, OsString>) -> Vec<u8> {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let env = whole_env(cmd);
    let argv: Vec<String> =
        std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(|a| hex(a.as_bytes())).collect();
    let keys: BTreeSet<&OsString> = env.keys().chain(spawned.keys()).collect();
    let env: Vec<[Option<String>; 3]> = keys
        .into_iter()
        .filter(|k| env.get(*k) != spawned.get(*k))
        .map(|k| {
            [Some(hex(k.as_bytes())), spawned.get(k).map(|v| hex(v.as_bytes())), env.get(k).map(|v| hex(v.as_bytes()))]
        })
        .collect();
    let cwd = cmd
        .get_current_dir()
        .map(|d| d.as_os_str().to_owned())
        .or_else(|| std::env::current_dir().ok().map(PathBuf::into_os_string))
        .unwrap_or_else(|| ".".into());
    serde_json::to_vec(&serde_json::json!({
        "argv": argv,
        "target_index": target_index,
        "env": env,
        "cwd": hex(cwd.as_bytes()),
    }))
    .expect("json of strings")
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`, which we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn only_python_scripts_and_modules_are_warmed() {
        let p = WarmProgram::parse(&args(&["/v/bin/python3", "-u", "train.py", "--lr", "1"])).unwrap();
        assert_eq!((p.module, p.target.to_str(), p.target_index, p.flags.len()), (false, Some("train.py"), 2, 1));
        let p = WarmProgram::parse(&args(&["python3.11", "-u", "-m", "pkg.train", "x"])).unwrap();
        assert_eq!((p.module, p.target.to_str(), p.target_index), (true, Some("pkg.train"), 3));
        for refused in [
            &["./train"][..],
            &["bash", "run.sh"],
            &["python3", "-c", "print(1)"],
            &["python3", "-u", "-W", "error", "train.py"],
            &["python3", "-u"],
            &["python3", "-u", "-m"],
        ] {
            assert_eq!(WarmProgram::parse(&args(refused)), None, "{refused:?}");
        }
    }

    #[test]
    fn the_rust_and_python_sides_name_the_same_rank_variables() {
        let py = BOOTSTRAP.split("_RANK_VARS = (").nth(1).and_then(|r| r.split(')').next()).expect("_RANK_VARS");
        let names: Vec<&str> = py.split(',').map(|n| n.trim().trim_matches('"')).filter(|n| !n.is_empty()).collect();
        assert_eq!(names, RANK_VARS);
    }

    #[test]
    fn an_order_carries_every_byte_of_argv_and_environment() {
        use std::os::unix::ffi::OsStringExt;
        let mut cmd = std::process::Command::new("python3");
        cmd.arg("-u").arg(OsString::from_vec(b"tr\xffain.py".to_vec())).arg("--x");
        cmd.env("RANK", "3").env(OsString::from_vec(b"ODD\xfe".to_vec()), "v").current_dir("/tmp");
        // Started with RANK=0, WARM_ONLY=1 and the agent's own variables.
        let mut spawned: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
        spawned.insert("RANK".into(), "0".into());
        spawned.insert("WARM_ONLY".into(), "1".into());
        let order: serde_json::Value = serde_json::from_slice(&order_bytes(&cmd, 2, &spawned)).unwrap();
        let argv: Vec<&str> = order["argv"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert_eq!(argv, ["707974686f6e33", "2d75", "7472ff61696e2e7079", "2d2d78"]);
        let env = order["env"].as_array().unwrap();
        assert!(env.iter().any(|kv| kv[0] == "52414e4b" && kv[1] == "30" && kv[2] == "33"), "RANK 0 -> 3: {env:?}");
        assert!(
            env.iter().any(|kv| kv[0] == "4f4444fe" && kv[1].is_null() && kv[2] == "76"),
            "a non-UTF-8 name is set"
        );
        assert!(
            env.iter().any(|kv| kv[0] == "5741524d5f4f4e4c59" && kv[1] == "31" && kv[2].is_null()),
            "a variable only the warm start had is unset"
        );
        assert!(!env.iter().any(|kv| kv[0] == "50415448"), "the agent's own PATH, unchanged, is not sent");
        assert_eq!(order["cwd"], "2f746d70");
        assert_eq!(order["target_index"], 2);
    }
}
