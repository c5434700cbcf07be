//! PyTorch interoperability of `rlaunch::store`: torch's own `TCPStore` client and
//! `init_process_group("gloo", init_method="env://")` with the agent store against our
//! server, and our Rust client against torch's own server. Needs the `.venv` with torch
//! (scripts/install-deps.sh); a missing venv fails loudly.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use rlaunch::store::{ServerConfig, StoreClient, StoreHandle, StoreServer};

const DEADLINE: Duration = Duration::from_secs(120);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration-tests lives in the repository root")
        .to_path_buf()
}

fn python() -> PathBuf {
    let python = repo_root().join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/install-deps.sh to create the PyTorch virtualenv \
         (these interoperability tests need real torch and are never skipped)",
        python.display()
    );
    python
}

fn script() -> PathBuf {
    repo_root().join("integration-tests/py/store_torch_client.py")
}

/// Our server on a background runtime, on an OS-chosen loopback port.
struct OurServer {
    handle: Option<StoreHandle>,
    rt: tokio::runtime::Runtime,
}

impl OurServer {
    fn start() -> Self {
        Self::start_with(ServerConfig::default())
    }

    fn start_with(config: ServerConfig) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime builds");
        let any: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        let handle = rt.block_on(StoreServer::start_with_config(any, config)).expect("store binds loopback");
        OurServer { handle: Some(handle), rt }
    }

    fn handle(&self) -> &StoreHandle {
        self.handle.as_ref().expect("running")
    }

    fn port(&self) -> u16 {
        self.handle().local_addr().port()
    }
}

impl Drop for OurServer {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            let _ = self.rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), handle.shutdown()).await });
        }
    }
}

/// Output of a finished child; panics with its output if it outlives `deadline`.
struct Finished {
    success: bool,
    stdout: String,
    stderr: String,
}

/// A child whose output is drained from the start (a full pipe must never block it).
struct Running {
    child: Child,
    out: thread::JoinHandle<String>,
    err: thread::JoinHandle<String>,
}

fn drain(r: Option<impl Read + Send + 'static>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut r) = r {
            let _ = r.read_to_string(&mut s);
        }
        s
    })
}

impl Running {
    fn new(mut child: Child) -> Self {
        let out = drain(child.stdout.take());
        let err = drain(child.stderr.take());
        Running { child, out, err }
    }

    /// Waits for the child; kills it and panics with its output after `deadline`.
    fn finish(mut self, what: &str, deadline: Duration) -> Finished {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait on child") {
                break Some(status);
            }
            if start.elapsed() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            thread::sleep(Duration::from_millis(20));
        };
        let stdout = self.out.join().expect("stdout reader");
        let stderr = self.err.join().expect("stderr reader");
        let Some(status) = status else {
            panic!("{what} did not finish within {deadline:?}\nstdout:\n{stdout}\nstderr:\n{stderr}");
        };
        Finished { success: status.success(), stdout, stderr }
    }
}

fn collect(child: Child, what: &str, deadline: Duration) -> Finished {
    Running::new(child).finish(what, deadline)
}

#[test]
fn torch_tcpstore_client_runs_every_query_against_our_server() {
    let python = python();
    let server = OurServer::start();
    let addr = format!("127.0.0.1:{}", server.port());
    let mut ours = StoreClient::connect(&addr, Duration::from_secs(10)).expect("rust client connects");
    ours.set("from_rust", b"hello from rust").expect("set");

    let child = Command::new(&python)
        .arg(script())
        .args(["api", "127.0.0.1", &server.port().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python");
    let run = collect(child, "torch TCPStore client", DEADLINE);
    assert!(
        run.success && run.stdout.contains("STORE_API_OK"),
        "torch client failed against our server\nstdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    assert_eq!(ours.get("from_py").expect("key set by torch"), b"hello from python");
    assert_eq!(server.handle().pending_waits(), 0, "torch's cancelled waits left nothing behind");
}

#[test]
fn torch_client_sees_an_error_past_the_stores_cap_and_the_other_keys_are_served() {
    let python = python();
    let server = OurServer::start_with(ServerConfig { max_total_bytes: 1 << 20, ..ServerConfig::default() });
    let child = Command::new(&python)
        .arg(script())
        .args(["full", "127.0.0.1", &server.port().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python");
    let run = collect(child, "torch TCPStore client past the cap", DEADLINE);
    assert!(
        run.success && run.stdout.contains("REFUSED") && run.stdout.contains("STORE_FULL_OK"),
        "stdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
}

#[test]
fn torch_init_process_group_env_with_agent_store_all_reduces_over_our_server() {
    let python = python();
    let server = OurServer::start();
    // Two attempts on one store, as across a restart: 2 ranks, then 4 ranks. torch 2.15 puts
    // no attempt prefix on its keys (it expects a fresh store per attempt), so the store is
    // cleared between attempts, as the agent must do.
    for (attempt, world) in [(0, 2), (1, 4)] {
        if attempt > 0 {
            assert!(server.handle().clear() > 0, "attempt {attempt}: previous keys removed");
        }
        let children: Vec<Running> = (0..world)
            .map(|rank| {
                Command::new(&python)
                    .arg(script())
                    .arg("ddp")
                    .env("RANK", rank.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("LOCAL_WORLD_SIZE", world.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", server.port().to_string())
                    .env("TORCHELASTIC_USE_AGENT_STORE", "True")
                    .env("TORCHELASTIC_RESTART_COUNT", attempt.to_string())
                    .env("OMP_NUM_THREADS", "1")
                    .env("GLOO_SOCKET_IFNAME", "lo")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .map(Running::new)
                    .expect("spawn python worker")
            })
            .collect();
        let runs: Vec<Finished> = children
            .into_iter()
            .enumerate()
            .map(|(rank, child)| child.finish(&format!("attempt {attempt} rank {rank}"), DEADLINE))
            .collect();
        let expected_sum = (world * (world + 1) / 2) as f64;
        for (rank, run) in runs.iter().enumerate() {
            assert!(
                run.success && run.stdout.contains(&format!("DDP_OK rank={rank} world={world} sum={expected_sum}")),
                "attempt {attempt} rank {rank} of {world} failed\nstdout:\n{}\nstderr:\n{}",
                run.stdout,
                run.stderr
            );
        }
    }
    assert!(server.handle().num_keys() > 0, "torch stored its rendezvous keys with us");
    assert_eq!(server.handle().pending_waits(), 0);
}

#[test]
fn our_rust_client_runs_every_query_against_torch_tcpstore_server() {
    let python = python();
    let mut child = Command::new(&python)
        .arg(script())
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn torch server");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = match rx.recv_timeout(DEADLINE) {
        Ok(line) => line,
        Err(_) => {
            let _ = child.kill();
            panic!("torch server did not print its port within {DEADLINE:?}");
        }
    };
    let port: u16 = match line.trim().parse() {
        Ok(port) => port,
        Err(_) => {
            let _ = child.kill();
            let run = collect(child, "torch server", Duration::from_secs(5));
            panic!("torch server printed {line:?}\nstderr:\n{}", run.stderr)
        }
    };
    let addr = format!("127.0.0.1:{port}");

    let result = std::panic::catch_unwind(|| {
        let mut c = StoreClient::connect(&addr, Duration::from_secs(10)).expect("connects to torch");
        c.ping().expect("ping");
        c.set("k", b"v1").expect("set");
        assert_eq!(c.get("k").expect("get"), b"v1");
        assert_eq!(c.add("n", 5).expect("add"), 5);
        assert_eq!(c.add("n", -1).expect("add"), 4);
        assert_eq!(c.compare_set("k", b"v1", b"v2").expect("cas"), b"v2");
        assert_eq!(c.compare_set("k", b"no", b"v3").expect("cas miss"), b"v2");
        assert!(c.check(&["k", "n"]).expect("check"));
        assert!(!c.check(&["missing"]).expect("check"));
        c.wait(&["k"], Duration::from_secs(1)).expect("wait");
        let err = c.wait(&["never"], Duration::from_millis(200)).expect_err("timeout");
        assert!(err.is_timeout(), "{err}");
        c.ping().expect("in step after cancel-wait");
        let n = c.num_keys().expect("num_keys");
        c.set("extra", b"x").expect("set");
        assert_eq!(c.num_keys().expect("num_keys"), n + 1);
        assert!(c.delete_key("extra").expect("delete"));
        assert!(!c.delete_key("extra").expect("delete"));
        c.append("app", b"a").expect("append");
        c.append("app", b"b").expect("append");
        assert_eq!(c.get("app").expect("get"), b"ab");
        c.multi_set(&[("m1", b"1".as_slice()), ("m2", b"2".as_slice())]).expect("multi_set");
        assert_eq!(c.multi_get(&["m2", "m1"]).expect("multi_get"), vec![b"2".to_vec(), b"1".to_vec()]);
        c.queue_push("q", b"x").expect("queue_push");
        assert_eq!(c.queue_len("q").expect("queue_len"), 1);
        assert_eq!(c.queue_pop("q", true).expect("queue_pop"), Some(b"x".to_vec()));
        assert_eq!(c.queue_pop("q", false).expect("queue_pop"), None);
        let keys = c.list_keys().expect("list_keys");
        assert!(keys.contains(&"k".to_string()) && keys.contains(&"app".to_string()), "{keys:?}");
        c.barrier("solo", 1, Duration::from_secs(5)).expect("barrier");
    });
    drop(child.stdin.take()); // torch server exits when stdin closes
    let _ = collect(child, "torch server", Duration::from_secs(30));
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}
