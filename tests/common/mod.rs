//! Test helpers: spawn N real worker processes with torchrun's environment and a file store,
//! wait for them under a deadline, and collect their output.
#![allow(dead_code)]

pub mod reference;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Env var that turns the test binary into a worker (re-exec of `current_exe`).
pub const WORKER: &str = "RLAUNCH_TEST_WORKER";

/// First line of a worker entry point (an `#[ignore]`d test that the parent test runs in child
/// processes through [`self_args`], so it is never counted as a passing test): outside a
/// re-executed worker (e.g. under `--include-ignored`) it fails loudly instead of passing.
pub fn require_worker_env() {
    assert!(
        std::env::var_os(WORKER).is_some(),
        "this is a worker entry point, not a test: the tests of this file run it in child processes with {WORKER} set"
    );
}

pub struct Spawned {
    pub children: Vec<Child>,
    pub logs: Vec<PathBuf>,
}

pub struct Finished {
    pub codes: Vec<Option<i32>>,
    pub logs: Vec<String>,
}

impl Finished {
    pub fn all_ok(&self) -> bool {
        self.codes.iter().all(|c| *c == Some(0))
    }
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for (r, (c, l)) in self.codes.iter().zip(&self.logs).enumerate() {
            s += &format!("--- rank {r} exit {c:?}\n{l}\n");
        }
        s
    }
}

/// Spawns `world` processes of `cmd` (program + args) with ranks and the store set;
/// `hosts[r]` is the GROUP_RANK of rank r (ranks of a host are contiguous).
pub fn spawn(program: &Path, args: &[String], hosts: &[usize], dir: &Path, extra: &[(String, String)]) -> Spawned {
    spawn_wrapped(program, args, hosts, dir, extra, |_| (Vec::new(), Vec::new()))
}

/// [`spawn`] where rank `r` runs as `prefix(r).0 program args` with extra env `prefix(r).1`
/// (e.g. `ip netns exec NS`).
pub fn spawn_wrapped(
    program: &Path,
    args: &[String],
    hosts: &[usize],
    dir: &Path,
    extra: &[(String, String)],
    prefix: impl Fn(usize) -> (Vec<String>, Vec<(String, String)>),
) -> Spawned {
    let world = hosts.len();
    std::fs::create_dir_all(dir).expect("create the attempt's directory");
    let store = dir.join("store");
    let mut children = Vec::new();
    let mut logs = Vec::new();
    for r in 0..world {
        let local: Vec<usize> = (0..world).filter(|&q| hosts[q] == hosts[r]).collect();
        let local_rank = local.iter().position(|&q| q == r).expect("in own host");
        let n_hosts = {
            let mut h = hosts.to_vec();
            h.dedup();
            h.len()
        };
        let log = dir.join(format!("rank{r}.log"));
        let f = std::fs::File::create(&log).expect("create log file");
        let f2 = f.try_clone().expect("clone log file");
        let (pre, pre_env) = prefix(r);
        let mut c = match pre.split_first() {
            Some((p, rest)) => {
                let mut c = Command::new(p);
                c.args(rest).arg(program);
                c
            }
            None => Command::new(program),
        };
        c.envs(pre_env);
        c.args(args)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("LOCAL_WORLD_SIZE", local.len().to_string())
            .env("GROUP_RANK", hosts[r].to_string())
            .env("GROUP_WORLD_SIZE", n_hosts.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", "29999")
            .env("TORCHELASTIC_RUN_ID", "test")
            .env("TORCHELASTIC_RESTART_COUNT", "0")
            .env("RLAUNCH_FILE_STORE", &store)
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2);
        for (k, v) in extra {
            // An empty value removes the variable (e.g. RLAUNCH_FILE_STORE to use MASTER_PORT).
            if v.is_empty() {
                c.env_remove(k);
            } else {
                c.env(k, v);
            }
        }
        children.push(c.spawn().expect("spawn worker"));
        logs.push(log);
    }
    Spawned { children, logs }
}

/// Waits for every child; past `timeout` kills the rest and marks them `None`.
pub fn wait(s: Spawned, timeout: Duration) -> Finished {
    let all: Vec<usize> = (0..s.children.len()).collect();
    wait_for(s, &all, timeout)
}

/// Waits for the children in `which`, then kills every child still running; past `timeout`
/// kills everything. Killed children have code `None`.
pub fn wait_for(mut s: Spawned, which: &[usize], timeout: Duration) -> Finished {
    let deadline = Instant::now() + timeout;
    let mut codes = vec![None; s.children.len()];
    let mut done = vec![false; s.children.len()];
    while which.iter().any(|&i| !done[i]) {
        for (i, c) in s.children.iter_mut().enumerate() {
            if !done[i] {
                if let Ok(Some(st)) = c.try_wait() {
                    codes[i] = st.code().or_else(|| {
                        use std::os::unix::process::ExitStatusExt;
                        st.signal().map(|s| 128 + s)
                    });
                    done[i] = true;
                }
            }
        }
        if Instant::now() > deadline {
            for (i, c) in s.children.iter_mut().enumerate() {
                if !done[i] {
                    let _ = c.kill();
                    let _ = c.wait();
                    done[i] = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for (i, c) in s.children.iter_mut().enumerate() {
        if !done[i] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    let logs = s.logs.iter().map(|p| std::fs::read_to_string(p).unwrap_or_default()).collect();
    Finished { codes, logs }
}

/// Args that make the current test binary run only the ignored worker entry point
/// `test_name`, with output.
pub fn self_args(test_name: &str) -> Vec<String> {
    vec![test_name.into(), "--exact".into(), "--ignored".into(), "--nocapture".into(), "--test-threads=1".into()]
}

pub fn self_exe() -> PathBuf {
    std::env::current_exe().expect("test binary path")
}

/// A fresh seed for this test run, printed so failures can be replayed.
pub fn fresh_seed() -> u64 {
    let s = std::env::var("RLAUNCH_TEST_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(rand::random::<u64>);
    eprintln!("seed {s} (set RLAUNCH_TEST_SEED to replay)");
    s
}

/// splitmix64: a tiny deterministic generator so every rank can recompute every rank's data.
pub struct Mix(pub u64);
impl Mix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Path of an example binary built next to this test binary (`cargo test` builds examples).
pub fn example(name: &str) -> PathBuf {
    let exe = self_exe();
    let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>/deps");
    let p = dir.join("examples").join(name);
    if p.exists() {
        return p;
    }
    // `cargo test --test x` builds no examples: fall back to a release build.
    let release = dir.parent().map(|t| t.join("release").join("examples").join(name));
    match release {
        Some(r) if r.exists() => r,
        _ => panic!("example {name} not built at {}; run `cargo build -p rlaunch --examples`", p.display()),
    }
}
