//! Shared helpers for rlaunch's integration tests: where the built binaries are, running a
//! command under a deadline, temporary directories, and waiting for conditions with deadlines.

pub mod browser;
pub mod netns;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

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
pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("rlaunch-it-").tempdir().expect("temp dir")
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
