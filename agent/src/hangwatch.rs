//! Hang detection's edge: samples of running workers (CPU time from `/proc`, bytes of output,
//! the heartbeat file) and their stacks (`py-spy dump` for Python workers, the kernel's wait
//! channel for others). The decisions are in [`crate::hang`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::hang::{self, Frame, Sample, Stack};
use crate::logdir::LogRoot;

// A worker told its heartbeat file (`RLAUNCH_HEARTBEAT_FILE`, with `--hang-timeout`; see
// `spec::WorkerSpec::vars`) touches it as a sign of progress, e.g.
// `os.utime(os.environ["RLAUNCH_HEARTBEAT_FILE"])` once per step (the Rust runtime also writes
// its step statistics there, see `rank_waits`).

/// The pseudo-file of frames that are a thread's kernel wait channel.
const NATIVE_FILE: &str = "[kernel]";

/// Bound on one stack dump (py-spy reads the process's memory; a stuck one must not stall us).
const DUMP_TIMEOUT: Duration = Duration::from_secs(10);

/// One running worker, as hang detection sees it.
#[derive(Debug, Clone)]
pub struct Watched {
    /// Its index in the group.
    pub index: usize,
    pub rank: u32,
    pub pid: u32,
    /// Bytes it wrote to stdout and stderr so far.
    pub written: Arc<AtomicU64>,
    pub heartbeat: Option<PathBuf>,
    /// The run's log directory: the heartbeat is read through it (see [`step_stats`]).
    pub log_root: Arc<crate::logdir::LogRoot>,
}

/// Clock ticks per second of `/proc/{pid}/stat`'s CPU times: Linux's USER_HZ, 100 on every
/// architecture it runs on (part of its ABI, whatever the kernel's own HZ).
pub fn ticks_per_s() -> u64 {
    100
}

/// One process's parent and CPU time (user + system of all its threads, and of its children
/// it waited for), in clock ticks.
fn stat_of(pid: u32) -> Option<(u32, u64)> {
    // Bytes: the command name may be cut inside a multibyte character.
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces and parentheses): fields from `state` on.
    let close = stat.iter().rposition(|b| *b == b')')?;
    let rest = std::str::from_utf8(stat.get(close + 2..)?).ok()?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    // Fields 4 (ppid) and 14-17 (utime, stime, cutime, cstime) of the line: 1 and 11-14 after
    // `state` (index 0).
    let ppid = u32::try_from(num(1)?).ok()?;
    Some((ppid, num(11)? + num(12)? + num(13)? + num(14)?))
}

/// CPU ticks of each worker's whole process tree (a wrapper script's children, data-loader
/// workers), from one pass over `/proc`.
fn tree_cpu_ticks(roots: &[u32]) -> BTreeMap<u32, u64> {
    let mut procs: Vec<(u32, u32, u64)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            if let Some((ppid, ticks)) = stat_of(pid) {
                procs.push((pid, ppid, ticks));
            }
        }
    }
    let parent: BTreeMap<u32, u32> = procs.iter().map(|(p, pp, _)| (*p, *pp)).collect();
    let mut out: BTreeMap<u32, u64> = roots.iter().map(|r| (*r, 0)).collect();
    for (pid, _, ticks) in &procs {
        // Walk up to a root (bounded: a cycle cannot happen, a deep tree is cut).
        let mut p = *pid;
        for _ in 0..64 {
            if let Some(total) = out.get_mut(&p) {
                *total += ticks;
                break;
            }
            match parent.get(&p) {
                Some(pp) if *pp > 1 => p = *pp,
                _ => break,
            }
        }
    }
    out
}

/// The heartbeat file's modification time in ms since the epoch (0 if never touched, or if it is
/// not a regular file: read as [`step_stats`] reads it).
fn heartbeat_ms(root: &LogRoot, path: &Path) -> u64 {
    root.modified(path)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One sample of every watched worker, by index.
pub fn samples(workers: &[Watched], stacks: &BTreeMap<usize, u64>) -> BTreeMap<usize, Sample> {
    let pids: Vec<u32> = workers.iter().map(|w| w.pid).collect();
    let cpu = tree_cpu_ticks(&pids);
    workers
        .iter()
        .map(|w| {
            let s = Sample {
                cpu_ticks: cpu.get(&w.pid).copied().unwrap_or(0),
                output_bytes: w.written.load(Ordering::Relaxed),
                beats: w.heartbeat.as_deref().map_or(0, |p| heartbeat_ms(&w.log_root, p)),
                stack: stacks.get(&w.index).copied(),
            };
            (w.index, s)
        })
        .collect()
}

/// The step statistics a worker's runtime wrote into its heartbeat file, if any.
/// The file is the worker's to write: read through the held run directory, without following a
/// link or waiting on a FIFO it may have put there, and only if it is a regular file.
pub fn step_stats(root: &LogRoot, path: &Path) -> Option<rlaunch::heartbeat::StepStats> {
    let buf = root.read(path, 128).ok()?;
    rlaunch::heartbeat::StepStats::parse(std::str::from_utf8(&buf).ok()?)
}

/// Each worker's wait in all-reduces, for the rendezvous (workers without stats are left out).
pub fn rank_waits(workers: &[Watched]) -> Vec<rlaunch_rendezvous::stragglers::RankWait> {
    workers
        .iter()
        .filter_map(|w| {
            let s = step_stats(&w.log_root, w.heartbeat.as_deref()?)?;
            Some(rlaunch_rendezvous::stragglers::RankWait {
                rank: w.rank,
                mean_wait_us: s.mean_wait_us,
                window: s.window,
            })
        })
        .collect()
}

/// Creates a worker's heartbeat file (its time is the baseline: untouched means no beat).
/// Made through the held run directory, never through a symlink.
pub fn create_heartbeat(root: &crate::logdir::LogRoot, path: &Path) -> std::io::Result<()> {
    root.open(path, crate::logdir::Open::Truncate).map(|_| ())
}

/// py-spy: `RLAUNCH_PY_SPY`, else on `PATH`, else next to the Python the workers run (a
/// virtualenv's `bin/`, as `scripts/install-deps.sh` makes `.venv/`). Only absolute places: the
/// agent often runs as root, and a `py-spy` relative to its working directory (a relative `PATH`
/// entry, a bare `.venv/bin`) is whatever the owner of that directory put there. Each candidate
/// is checked ([`trusted`]) and the first that passes is returned, absolute and resolved; the
/// refusals say why, for the log.
pub fn find_py_spy(
    program: &[std::ffi::OsString],
    agent_env: &BTreeMap<String, String>,
) -> (Option<PathBuf>, Vec<String>) {
    let mut refused = Vec::new();
    for c in py_spy_candidates(program, agent_env.get("RLAUNCH_PY_SPY"), agent_env.get("PATH")) {
        if !c.is_file() {
            continue;
        }
        match trusted(&c, euid()) {
            Ok(p) => return (Some(p), refused),
            Err(why) => refused.push(format!("{}: {why}", c.display())),
        }
    }
    if let Some(p) = agent_env.get("RLAUNCH_PY_SPY").filter(|p| !Path::new(p).is_absolute()) {
        refused.push(format!("RLAUNCH_PY_SPY={p}: not an absolute path"));
    }
    (None, refused)
}

/// Where py-spy may be, in order; every one absolute. Pure.
pub fn py_spy_candidates(
    program: &[std::ffi::OsString],
    rlaunch_py_spy: Option<&String>,
    path: Option<&String>,
) -> Vec<PathBuf> {
    let dirs: Vec<PathBuf> =
        path.map(|p| std::env::split_paths(p).filter(|d| d.is_absolute()).collect()).unwrap_or_default();
    let mut out: Vec<PathBuf> = rlaunch_py_spy.map(PathBuf::from).filter(|p| p.is_absolute()).into_iter().collect();
    out.extend(dirs.iter().map(|d| d.join("py-spy")));
    // The workers' Python: as given when absolute, else (a bare `python3`) the first on the
    // absolute part of `PATH`; beside it, not beside what its symlinks resolve to (a
    // virtualenv's `python` links to the system's).
    let python = program.first().map(PathBuf::from).and_then(|p| {
        if p.is_absolute() {
            Some(p)
        } else if p.components().count() == 1 {
            dirs.iter().map(|d| d.join(&p)).find(|c| c.is_file())
        } else {
            None
        }
    });
    out.extend(python.and_then(|p| Some(p.parent()?.join("py-spy"))));
    out
}

/// Whether the agent (effective uid `euid`) may run `candidate`: resolved, it and every
/// directory above it (as given and resolved) are owned by root or by `euid` and writable by no
/// one else (a directory others may write but not rename in, sticky, is fine). Returns the
/// resolved path, which is what runs: no one else can swap any directory on the way to it.
fn trusted(candidate: &Path, euid: u32) -> Result<PathBuf, String> {
    use std::os::unix::fs::MetadataExt;
    let real = std::fs::canonicalize(candidate).map_err(|e| format!("cannot resolve: {e}"))?;
    let dir = real.parent().ok_or("no directory")?;
    for (what, p, sticky_ok) in [("it", real.as_path(), false), ("its directory", dir, true)] {
        let m = std::fs::metadata(p).map_err(|e| format!("cannot read {what}: {e}"))?;
        if m.uid() != 0 && m.uid() != euid {
            return Err(format!("{what} belongs to uid {}", m.uid()));
        }
        if m.mode() & 0o022 != 0 && !(sticky_ok && m.mode() & 0o1000 != 0) {
            return Err(format!("{what} is writable by others (mode {:o})", m.mode() & 0o7777));
        }
    }
    if let Some(why) = crate::rundir::untrusted(dir, euid) {
        return Err(format!("a directory above it: {why}"));
    }
    Ok(real)
}

fn euid() -> u32 {
    crate::logdir::euid()
}

/// Where `pid` stands: its Python main thread's frames (py-spy), else its threads' kernel wait
/// channels. `pause`: stop the process while reading (a consistent stack, for a report), else
/// read it running (for progress sampling; a torn read only looks like movement).
pub async fn stack(py_spy: Option<&Path>, pid: u32, pause: bool) -> Stack {
    let Some(py_spy) = py_spy else {
        return native(pid).unwrap_or_else(|| {
            Stack::Unavailable("py-spy not found (scripts/install-deps.sh installs it; or set RLAUNCH_PY_SPY)".into())
        });
    };
    let mut cmd = tokio::process::Command::new(py_spy);
    cmd.args(["dump", "--pid", &pid.to_string()]);
    if !pause {
        cmd.arg("--nonblocking");
    }
    cmd.stdin(std::process::Stdio::null()).kill_on_drop(true);
    match tokio::time::timeout(DUMP_TIMEOUT, cmd.output()).await {
        Ok(Ok(out)) if out.status.success() => {
            let frames = hang::parse_py_spy(&String::from_utf8_lossy(&out.stdout));
            if frames.is_empty() {
                native(pid).unwrap_or(Stack::Frames(frames))
            } else {
                Stack::Frames(frames)
            }
        }
        // Not a Python process (or one py-spy does not know): the kernel's view.
        Ok(Ok(out)) => native(pid).unwrap_or_else(|| {
            let err = String::from_utf8_lossy(&out.stderr);
            Stack::Unavailable(format!("py-spy: {}", err.lines().last().unwrap_or("failed").trim()))
        }),
        Ok(Err(e)) => Stack::Unavailable(format!("py-spy could not run: {e}")),
        Err(_) => {
            // Killed while it may have had the worker stopped: a stopped worker would ignore the
            // SIGTERM that comes next until the SIGKILL after the grace.
            if pause {
                crate::process::resume_group(pid);
            }
            Stack::Unavailable(format!("py-spy did not answer within {} s", DUMP_TIMEOUT.as_secs()))
        }
    }
}

/// Digests of where running workers stand, for progress sampling, read at once (by index).
pub async fn stack_digests(py_spy: Option<&Path>, workers: &[&Watched]) -> BTreeMap<usize, u64> {
    let mut dumps = tokio::task::JoinSet::new();
    for w in workers {
        let (py_spy, index, pid) = (py_spy.map(Path::to_path_buf), w.index, w.pid);
        dumps.spawn(async move {
            // Python frames only: the kernel's view changes whenever a helper thread wakes.
            match stack(py_spy.as_deref(), pid, false).await {
                Stack::Frames(f) if !f.is_empty() && f.iter().all(|f| f.file != NATIVE_FILE) => {
                    Some((index, hang::digest(&f)))
                }
                _ => None,
            }
        });
    }
    let mut out = BTreeMap::new();
    while let Some(done) = dumps.join_next().await {
        if let Ok(Some((index, digest))) = done {
            out.insert(index, digest);
        }
    }
    out
}

/// The kernel's view of a non-Python worker: each thread's wait channel (the kernel function it
/// sleeps in) and state, grouped, as frames of the pseudo-file `[kernel]`.
fn native(pid: u32) -> Option<Stack> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut by_wchan: BTreeMap<String, u32> = BTreeMap::new();
    for t in tasks.flatten() {
        let dir = t.path();
        let wchan = std::fs::read_to_string(dir.join("wchan")).unwrap_or_default();
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        let state = stat.rfind(')').and_then(|i| stat.get(i + 2..i + 3)).unwrap_or("?");
        let place = match (state, wchan.trim()) {
            ("R", _) => "running".to_owned(),
            (_, "" | "0") => format!("state {state}"),
            (_, w) => w.to_owned(),
        };
        *by_wchan.entry(place).or_default() += 1;
    }
    let frames = by_wchan
        .into_iter()
        .map(|(place, n)| Frame {
            function: if n == 1 { place } else { format!("{place} ×{n}") },
            file: NATIVE_FILE.into(),
            line: None,
        })
        .collect();
    Some(Stack::Frames(frames))
}

/// Every watched worker's stack, at once, by global rank.
pub async fn stacks(py_spy: Option<&Path>, workers: &[Watched]) -> BTreeMap<u32, Stack> {
    let mut dumps = tokio::task::JoinSet::new();
    for w in workers {
        let (py_spy, rank, pid) = (py_spy.map(Path::to_path_buf), w.rank, w.pid);
        dumps.spawn(async move { (rank, stack(py_spy.as_deref(), pid, true).await) });
    }
    let mut out = BTreeMap::new();
    while let Some(done) = dumps.join_next().await {
        if let Ok((rank, stack)) = done {
            out.insert(rank, stack);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn executable(path: &Path, mode: u32) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// Issue 26, item 2: a `py-spy` planted relative to the agent's working directory (bare, in
    /// `.venv/bin/`, or on a relative `PATH` entry) never runs. The old lookup returned
    /// `.venv/bin/py-spy` from the working directory. The check runs in a child process of this
    /// test binary whose working directory is the planted one (a test must not move this
    /// process's).
    #[test]
    fn a_py_spy_relative_to_the_working_directory_is_never_chosen() {
        const CHILD: &str = "RLAUNCH_TEST_PY_SPY_CWD";
        if std::env::var_os(CHILD).is_some() {
            let env: BTreeMap<String, String> = [
                ("PATH".to_owned(), ":.:bin:.venv/bin".to_owned()),
                ("RLAUNCH_PY_SPY".to_owned(), "py-spy".to_owned()),
            ]
            .into();
            for program in [["python3"], ["bin/python3"], [".venv/bin/python3"]] {
                let program: Vec<std::ffi::OsString> = program.iter().map(Into::into).collect();
                let (found, refused) = find_py_spy(&program, &env);
                assert_eq!(found, None, "{program:?}");
                assert!(refused.iter().any(|r| r.contains("not an absolute path")), "{refused:?}");
            }
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for p in ["py-spy", "bin/py-spy", ".venv/bin/py-spy", "python3", "bin/python3", ".venv/bin/python3"] {
            executable(&dir.path().join(p), 0o755);
        }
        let exe = std::env::current_exe().unwrap();
        let mut child = std::process::Command::new(exe)
            .args(["--exact", "hangwatch::tests::a_py_spy_relative_to_the_working_directory_is_never_chosen"])
            .env(CHILD, "1")
            .current_dir(dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("the child check ran past 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = child.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(status.success() && text.contains("1 passed"), "{text}");
    }

    #[test]
    fn py_spy_is_looked_for_in_absolute_places_only_and_beside_the_workers_python() {
        let dir = tempfile::tempdir().unwrap();
        let venv = dir.path().join("venv/bin");
        executable(&venv.join("python3"), 0o755);
        let path = format!("relative:{}:/usr/bin", venv.display());
        let got = py_spy_candidates(&["python3".into(), "x.py".into()], Some(&"rel/py-spy".into()), Some(&path));
        assert_eq!(got, [venv.join("py-spy"), PathBuf::from("/usr/bin/py-spy"), venv.join("py-spy")]);
        let abs = dir.path().join("py-spy");
        let got = py_spy_candidates(&[venv.join("python3").into()], Some(&abs.display().to_string()), None);
        assert_eq!(got, [abs, venv.join("py-spy")]);
        assert!(py_spy_candidates(&["./python3".into()], None, None).is_empty());
    }

    #[test]
    fn a_py_spy_others_may_write_or_replace_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let me = euid();
        let good = dir.path().join("good/py-spy");
        executable(&good, 0o755);
        assert_eq!(trusted(&good, me), Ok(std::fs::canonicalize(&good).unwrap()));
        let writable = dir.path().join("writable/py-spy");
        executable(&writable, 0o775);
        assert!(trusted(&writable, me).unwrap_err().contains("writable by others"));
        let open_dir = dir.path().join("open/py-spy");
        executable(&open_dir, 0o755);
        std::fs::set_permissions(open_dir.parent().unwrap(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(trusted(&open_dir, me).unwrap_err().contains("its directory"));
        // A directory further up that others may rename entries of: refused too.
        let above = dir.path().join("above");
        let deep = above.join("bin/py-spy");
        executable(&deep, 0o755);
        std::fs::set_permissions(&above, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(trusted(&deep, me).unwrap_err().contains("a directory above it"), "{:?}", trusted(&deep, me));
        // A link to a writable file is judged by the file.
        let link = dir.path().join("good/link");
        std::os::unix::fs::symlink(&writable, &link).unwrap();
        assert!(trusted(&link, me).is_err());
        if me == 0 {
            let theirs = dir.path().join("theirs/py-spy");
            executable(&theirs, 0o755);
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            assert!(trusted(&theirs, me).unwrap_err().contains("belongs to uid 65534"));
        }
    }

    #[test]
    fn step_stats_never_wait_on_a_fifo_or_follow_a_link_a_worker_put_there() {
        let dir = tempfile::tempdir().unwrap();
        let root = crate::logdir::LogRoot::create_in_as(dir.path(), "run", false).unwrap();
        let real = root.path().join("heartbeat");
        let stats = rlaunch::heartbeat::StepStats { steps: 9, window: 9, mean_wait_us: 1234 };
        std::fs::write(&real, stats.line()).unwrap();
        assert_eq!(step_stats(&root, &real), Some(stats));
        assert!(heartbeat_ms(&root, &real) > 0);
        let fifo = root.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) on a NUL-terminated path in a private temporary directory.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let started = std::time::Instant::now();
        assert_eq!(step_stats(&root, &fifo), None);
        assert_eq!(heartbeat_ms(&root, &fifo), 0);
        assert!(started.elapsed() < Duration::from_secs(1), "opened without waiting for a writer");
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(step_stats(&root, &link), None, "a link is not followed");
        assert_eq!(heartbeat_ms(&root, &link), 0, "a link is not followed");
        // Nor a directory above it that a worker swapped for a link.
        std::fs::create_dir(root.path().join("elsewhere")).unwrap();
        std::fs::write(root.path().join("elsewhere/heartbeat"), stats.line()).unwrap();
        std::os::unix::fs::symlink(root.path().join("elsewhere"), root.path().join("attempt_0")).unwrap();
        assert_eq!(step_stats(&root, &root.path().join("attempt_0/heartbeat")), None);
    }

    #[test]
    fn a_busy_process_accumulates_cpu_ticks_and_its_threads_have_a_kernel_view() {
        let me = std::process::id();
        let cpu = |pid| tree_cpu_ticks(&[pid])[&pid];
        let before = cpu(me);
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(300) {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        std::hint::black_box(x);
        assert!(cpu(me) > before);
        match native(me) {
            Some(Stack::Frames(f)) => assert!(f.iter().any(|f| f.function.starts_with("running")), "{f:?}"),
            other => panic!("{other:?}"),
        }
    }
}
