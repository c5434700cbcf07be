//! Shared helpers for rlaunch's integration tests: where the built binaries are, running a
//! command under a deadline, temporary directories, and waiting for conditions with deadlines.
//!
//! Files that helper processes write while a test reads them: a test never takes a file's
//! existence for its content. A file read once whole (a pid, a port, a JSON record) is waited
//! for until it parses ([`wait_for_file`], [`wait_for_pid`]), and this crate's helpers write
//! such files whole ([`write_atomically`]: a temporary name, then a rename); a log appended to
//! is read up to its last newline ([`complete_text`]), since a half-written last line can
//! parse as a wrong value (`pid=12` of `pid=1234`).

pub mod browser;
pub mod netns;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A child process (a service a test started) killed and reaped when the test ends, passed or not.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `target/<profile>` of the build that produced the running test binary.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test-binary>
    exe.parent().and_then(Path::parent).expect("test binary lives in target/<profile>/deps").to_path_buf()
}

/// The repository root (the workspace).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("integration-tests is one level down").to_path_buf()
}

/// A binary of this workspace, which must already be built (`cargo build --workspace --bins`).
pub fn bin(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.exists(),
        "{} is not built: run `cargo build --workspace --bins --examples` first (the README's test command does)",
        p.display()
    );
    p
}

pub fn rlaunch() -> Command {
    let mut c = Command::new(bin("rlaunch"));
    c.env("RLAUNCH_LOG", "info");
    c
}

pub fn worker() -> PathBuf {
    bin("test_worker")
}

/// A fresh temporary directory, removed when dropped.
/// A test's own directory, removed when the test ends (kept with `RLAUNCH_TEST_KEEP=1`, to read
/// a failed test's files).
pub fn tempdir() -> tempfile::TempDir {
    let keep = std::env::var_os("RLAUNCH_TEST_KEEP").is_some_and(|v| v == "1");
    tempfile::Builder::new().prefix("rlaunch-it-").disable_cleanup(keep).tempdir().expect("temp dir")
}

/// Runs `cmd` to completion; kills it and panics if it runs past `deadline`.
pub fn run_deadline(cmd: &mut Command, deadline: Duration) -> Output {
    let child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    wait_deadline(child, deadline)
}

pub fn wait_deadline(mut child: Child, deadline: Duration) -> Output {
    // Drain the pipes while waiting: a child blocked on a full pipe would never exit.
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(child.stdout.take().map(|s| Box::new(s) as _));
    let err = drain(child.stderr.take().map(|s| Box::new(s) as _));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let (o, e) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
            panic!(
                "command ran past its {deadline:?} deadline\nstdout (tail):\n{}\nstderr (tail):\n{}",
                tail(&o),
                tail(&e)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Grandchildren may hold the pipes open; give them a bounded time.
    let collect = |h: std::thread::JoinHandle<Vec<u8>>| {
        let t0 = Instant::now();
        while !h.is_finished() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        if h.is_finished() {
            h.join().unwrap_or_default()
        } else {
            b"<output pipe still held open by a descendant>".to_vec()
        }
    };
    Output { status, stdout: collect(out), stderr: collect(err) }
}

fn tail(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    let start = s.len().saturating_sub(4000);
    s[s.floor_char_boundary(start)..].to_string()
}

/// Polls `cond` every 20 ms until it holds; panics with `what` after `deadline`.
pub fn wait_until(what: &str, deadline: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < deadline, "timed out after {deadline:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `path` holds what `parse` accepts, and answers it; panics after `deadline`
/// naming `what`, the file and what it last held. A file that exists may still be empty or
/// half-written by the process making it: existence alone is never taken for content.
pub fn wait_for_file<T>(what: &str, path: &Path, deadline: Duration, mut parse: impl FnMut(&str) -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        let text = std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned());
        if let Some(v) = text.as_deref().ok().and_then(&mut parse) {
            return v;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what} in {}: {}",
            path.display(),
            match &text {
                Ok(t) => format!("it holds {:?}", t.chars().take(200).collect::<String>()),
                Err(e) => format!("{e}"),
            }
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the pid file `path` holds a pid (a whole number, blanks around it allowed).
pub fn wait_for_pid(path: &Path, deadline: Duration) -> i32 {
    wait_for_file("a pid", path, deadline, |s| s.trim().parse().ok().filter(|p: &i32| *p > 0))
}

/// What `path` holds up to its last newline (nothing when it is absent): the lines a writer
/// appending at the same time has finished.
pub fn complete_text(path: &Path) -> String {
    let mut text = std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    text.truncate(text.rfind('\n').map_or(0, |i| i + 1));
    text
}

/// Writes `contents` to `path` so that no reader ever sees it present but empty or partial:
/// written whole under a temporary name in the same directory (hidden, so that no test
/// counting files by prefix or suffix counts it), then renamed over `path`.
pub fn write_atomically(path: &Path, contents: impl AsRef<[u8]>) -> std::io::Result<()> {
    let name = path.file_name().ok_or_else(|| std::io::Error::other(format!("{} names no file", path.display())))?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp);
    std::fs::write(&tmp, contents)?;
    std::fs::rename(&tmp, path)
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn pid_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

/// The first `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(name)).find(|p| p.is_file())
}

pub fn stdout_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The repository's Python virtualenv with PyTorch; a loud failure when it is missing.
pub fn venv_python() -> PathBuf {
    let p = repo_root().join(".venv/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run scripts/install-deps.sh (the README's test command does) to create the PyTorch virtualenv",
        p.display()
    );
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_file_created_empty_is_waited_for_until_it_holds_the_pid() {
        let dir = tempdir();
        let path = dir.path().join("pid");
        // As `std::fs::write` leaves it between creating the file and writing it.
        std::fs::write(&path, "").unwrap();
        let writer = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                std::fs::write(&path, "4242").unwrap();
            })
        };
        assert_eq!(wait_for_pid(&path, Duration::from_secs(10)), 4242);
        writer.join().unwrap();
    }

    #[test]
    fn a_file_that_never_parses_fails_at_the_deadline_saying_what_it_held() {
        let dir = tempdir();
        let path = dir.path().join("pid");
        std::fs::write(&path, "not a pid").unwrap();
        let err = std::panic::catch_unwind(|| wait_for_pid(&path, Duration::from_millis(100))).unwrap_err();
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("waiting for a pid") && msg.contains("\"not a pid\""), "{msg}");
    }

    #[test]
    fn a_half_written_last_line_is_left_out() {
        let dir = tempdir();
        let path = dir.path().join("events.log");
        assert_eq!(complete_text(&path), "", "absent: nothing");
        std::fs::write(&path, "start pid=1234\nstart pid=12").unwrap();
        assert_eq!(complete_text(&path), "start pid=1234\n");
        std::fs::write(&path, "no newline yet").unwrap();
        assert_eq!(complete_text(&path), "");
    }

    #[test]
    fn an_atomic_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = tempdir();
        let path = dir.path().join("pid_rank0_attempt0");
        write_atomically(&path, "1").unwrap();
        write_atomically(&path, "23").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "23");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from("pid_rank0_attempt0")]);
    }
}
