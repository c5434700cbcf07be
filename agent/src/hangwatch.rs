//! Hang detection's edge: samples of running workers (CPU time from `/proc`, bytes of output,
//! the heartbeat file) and their stacks (`py-spy dump` for Python workers, the kernel's wait
//! channel for others). The decisions are in [`crate::hang`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::hang::{self, Frame, Sample, Stack};

/// The variable naming a worker's heartbeat file (with `--hang-timeout`): touching it is a sign
/// of progress, e.g. `os.utime(os.environ["RLAUNCH_HEARTBEAT_FILE"])` once per step (the Rust
/// runtime also writes its step statistics there, see [`rank_waits`]).
pub use rlaunch::heartbeat::HEARTBEAT_ENV;

/// The pseudo-file of frames that are a thread's kernel wait channel.
const NATIVE_FILE: &str = "[kernel]";

/// How often running workers are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);

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

/// The heartbeat file's modification time in ms since the epoch (0 if never touched).
fn heartbeat_ms(path: &Path) -> u64 {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
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
                beats: w.heartbeat.as_deref().map_or(0, heartbeat_ms),
                stack: stacks.get(&w.index).copied(),
            };
            (w.index, s)
        })
        .collect()
}

/// The step statistics a worker's runtime wrote into its heartbeat file, if any.
/// The file is the worker's to write: opened without following a link or waiting on a FIFO
/// it may have put there, and read only if it is a regular file.
pub fn step_stats(path: &Path) -> Option<rlaunch::heartbeat::StepStats> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f =
        std::fs::File::options().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW).open(path).ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut buf = [0u8; 128];
    let n = std::io::Read::read(&mut f, &mut buf).ok()?;
    rlaunch::heartbeat::StepStats::parse(std::str::from_utf8(&buf[..n]).ok()?)
}

/// Each worker's wait in all-reduces, for the rendezvous (workers without stats are left out).
pub fn rank_waits(workers: &[Watched]) -> Vec<rlaunch_rendezvous::stragglers::RankWait> {
    workers
        .iter()
        .filter_map(|w| {
            let s = step_stats(w.heartbeat.as_deref()?)?;
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
/// virtualenv's `bin/`), else the project's own `.venv/bin/` (installed by
/// `scripts/install-deps.sh`).
pub fn find_py_spy(program: &[std::ffi::OsString]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RLAUNCH_PY_SPY") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|d| d.join("py-spy")).collect::<Vec<_>>())
        .unwrap_or_default();
    let beside_python = program.first().map(PathBuf::from).and_then(|p| Some(p.parent()?.join("py-spy")));
    on_path
        .into_iter()
        .chain(beside_python)
        .chain(std::iter::once(PathBuf::from(".venv/bin/py-spy")))
        .find(|p| p.is_file())
        // Absolute: what was checked is what runs, whatever the workers' directory.
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
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

    #[test]
    fn step_stats_never_wait_on_a_fifo_or_follow_a_link_a_worker_put_there() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("heartbeat");
        let stats = rlaunch::heartbeat::StepStats { steps: 9, window: 9, mean_wait_us: 1234 };
        std::fs::write(&real, stats.line()).unwrap();
        assert_eq!(step_stats(&real), Some(stats));
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) on a NUL-terminated path in a private temporary directory.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let started = std::time::Instant::now();
        assert_eq!(step_stats(&fifo), None);
        assert!(started.elapsed() < Duration::from_secs(1), "opened without waiting for a writer");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(step_stats(&link), None, "a link is not followed");
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
