//! The workers' store at scale: N clients (default 1,024, 4,096 and 16,384) run torch's init
//! pattern against rlaunch's `StoreServer` and against torch's own `TCPStore` server (libuv
//! backend) in the same run; prints time and server memory side by side with torch/rlaunch
//! ratios and writes `bench/store/SCALE.md`.
//!
//! `cargo run --release -p rlaunch --example store_scale -- [--clients 1024,4096,16384]
//! [--procs 8] [--repeat 2] [--inflight 0] [--timeout 120] [--runtime dedicated|multi]
//! [--backlog B] [--torch-listen ipv4|dual] [--no-write]`
//!
//! `--inflight M` caps the handshakes in flight per client process (0: all at once);
//! `--backlog B` hosts our server on a listener with that backlog instead of `start_dedicated`'s;
//! `--torch-listen dual` keeps torch's own "::" listener (see `torch_scale_server.py` for why
//! the default binds 127.0.0.1 like ours).
//!
//! Each client does what a torch worker does in `init_process_group(init_method="env://")`:
//! connect and validate (the magic, then a ping), `set("rank/{i}", its address)`,
//! `add("init/count", 1)`, then a barrier: the client whose add returns N sets `init/done`, and
//! every client waits for it, so N waits are pending at once when it is set.
//!
//! Clients are tokio tasks spread over `--procs` client processes (re-execs of this binary with
//! `--clients-proc`): a process may hold only RLIMIT_NOFILE descriptors, and the blocking
//! `StoreClient` needs a thread per pending wait, which N concurrent waits make impractical. The
//! requests are `rlaunch::store::protocol::Request` frames, the same bytes `StoreClient` and
//! torch's client send. Each server runs in a child process of its own (ours: a re-exec with
//! `--serve`; torch's: `bench/store/torch_scale_server.py`), so its /proc VmRSS and VmHWM are the
//! server's memory alone, and a fresh one serves every run so VmHWM is that run's peak.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlaunch::store::protocol::{Request, VALIDATION_MAGIC, WAIT_STOP_WAITING};
use rlaunch::store::{ServerConfig, StoreServer};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

/// torch's client puts this in front of every user key; using it too makes the keys on the wire
/// exactly those a torch worker would store.
const KEY_PREFIX: &str = "/";
const COUNT_KEY: &str = "init/count";
const DONE_KEY: &str = "init/done";
/// Descriptors a process needs besides its connections (stdio, runtime, pipes, libraries).
const SPARE_FDS: usize = 64;

fn main() -> Result<()> {
    let nofile = rlaunch::store::raise_open_files().context("raising the open-file limit")? as usize;
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--serve") => serve(&args[1..]),
        Some("--clients-proc") => clients_proc(&args[1..]),
        _ => bench(&args, nofile),
    }
}

/// CLOCK_MONOTONIC in ns: one clock for every process on the machine, so the client processes'
/// timestamps can be compared with each other (an `Instant` cannot leave its process).
fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the timespec we pass; CLOCK_MONOTONIC exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> Result<PathBuf> {
    let python = repo_root().join(".venv/bin/python");
    if !python.exists() {
        bail!("{} is missing: run scripts/install-deps.sh", python.display());
    }
    Ok(python)
}

/// Takes the value of flag `name` from `it`.
fn value<'a>(it: &mut impl Iterator<Item = &'a String>, name: &str) -> Result<&'a String> {
    it.next().with_context(|| format!("{name} needs a value"))
}

/// Stdin's lines on a channel, then `None` at its end: lets a child wait for its parent's word,
/// or for the parent to close stdin, with a deadline (the parent's death closes it too).
fn stdin_lines() -> mpsc::Receiver<Option<String>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.send(Some(line)).is_err() {
                return;
            }
        }
        let _ = tx.send(None);
    });
    rx
}

fn until_stdin_closes(stdin: &mpsc::Receiver<Option<String>>, limit: Duration, who: &str) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        match stdin.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Some(_)) => continue,
            Ok(None) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
            Err(RecvTimeoutError::Timeout) => bail!("{who}: the parent did not close stdin within {limit:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// `--serve`: our server alone in a process, so /proc/PID/status is its memory.

fn serve(args: &[String]) -> Result<()> {
    let mut runtime = "dedicated".to_string();
    let mut backlog: Option<u32> = None;
    let mut lifetime = Duration::from_secs(3600);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--runtime" => runtime = value(&mut it, flag)?.clone(),
            "--backlog" => backlog = Some(value(&mut it, flag)?.parse()?),
            "--lifetime-s" => lifetime = Duration::from_secs(value(&mut it, flag)?.parse()?),
            other => bail!("--serve: unknown flag {other}"),
        }
    }
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    // Only the runtime the chosen hosting needs is built: an idle multi-thread runtime's worker
    // threads and stacks would count in the memory this benchmark reports.
    let rt = match runtime.as_str() {
        "dedicated" => tokio::runtime::Builder::new_current_thread().enable_all().build()?,
        "multi" => tokio::runtime::Builder::new_multi_thread().enable_all().build()?,
        other => bail!("--runtime {other}: use dedicated or multi"),
    };
    let Some(backlog) = backlog else {
        // As the agent hosts the store (agent/src/lib.rs: `start_dedicated`), or `start` on a
        // multi-thread runtime.
        let handle = if runtime == "dedicated" {
            StoreServer::start_dedicated(any, ServerConfig::default())?
        } else {
            rt.block_on(StoreServer::start(any))?
        };
        println!("{}", handle.local_addr().port());
        std::io::stdout().flush()?;
        let waited = until_stdin_closes(&stdin_lines(), lifetime, "store_scale --serve");
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(30), handle.shutdown()).await })
            .context("the store did not shut down within 30 s")??;
        return waited;
    };
    // `start_dedicated` binds with std's listen backlog; to see what another backlog changes,
    // bind here with it and serve the same way, on a thread of its own.
    let listener = {
        let _in_runtime = rt.enter();
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(any)?;
        socket.listen(backlog)?
    };
    println!("{}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done) = mpsc::channel();
    std::thread::Builder::new().name("rlaunch-store".into()).spawn(move || {
        let served = rt.block_on(StoreServer::serve(listener, async move {
            let _ = stopped.await;
        }));
        let _ = done_tx.send(served);
    })?;
    let waited = until_stdin_closes(&stdin_lines(), lifetime, "store_scale --serve");
    drop(stop);
    done.recv_timeout(Duration::from_secs(30)).context("the store did not shut down within 30 s")??;
    waited
}

// ---------------------------------------------------------------------------------------------
// `--clients-proc`: one client process, `count` clients as tasks on one thread.

struct ClientArgs {
    addr: SocketAddr,
    first: usize,
    count: usize,
    total: usize,
    inflight: usize,
    timeout: Duration,
}

/// What one client process reports to the bench (one JSON line). Times are CLOCK_MONOTONIC ns.
#[derive(Serialize, Deserialize)]
struct ProcReport {
    clients: usize,
    released: usize,
    /// Failed clients by the step that failed ("connect", "ping", "add", "wait", …).
    errors: BTreeMap<String, usize>,
    /// The first failure that is not a wait timing out (those follow from another failure).
    first_error: Option<String>,
    connect_retries: u64,
    first_start_ns: u64,
    last_connected_ns: u64,
    last_added_ns: u64,
    last_released_ns: u64,
    done_set_ns: Option<u64>,
    /// Per connected client: TCP connect + validate + ping, µs.
    connect_us: Vec<u32>,
}

#[derive(Default)]
struct Timeline {
    start_ns: u64,
    connected_ns: Option<u64>,
    added_ns: Option<u64>,
    released_ns: Option<u64>,
    done_set_ns: Option<u64>,
    retries: u64,
}

fn clients_proc(args: &[String]) -> Result<()> {
    let mut o = ClientArgs {
        addr: "127.0.0.1:0".parse()?,
        first: 0,
        count: 0,
        total: 0,
        inflight: 0,
        timeout: Duration::from_secs(120),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let v = value(&mut it, flag)?;
        match flag.as_str() {
            "--addr" => o.addr = v.parse()?,
            "--first" => o.first = v.parse()?,
            "--count" => o.count = v.parse()?,
            "--total" => o.total = v.parse()?,
            "--inflight" => o.inflight = v.parse()?,
            "--timeout" => o.timeout = Duration::from_secs(v.parse()?),
            other => bail!("--clients-proc: unknown flag {other}"),
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // The parent's words arrive on stdin: "go", then "abort" if a client elsewhere failed (the
    // barrier can then never complete), then end of file when it is done with us.
    let (tx, mut stdin) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.send(Some(line)).is_err() {
                return;
            }
        }
        let _ = tx.send(None);
    });
    println!("ready");
    std::io::stdout().flush()?;
    // Start on the parent's word, once every client process is up: process start-up is not
    // part of the measured time.
    match rt.block_on(async { tokio::time::timeout(Duration::from_secs(120), stdin.recv()).await }) {
        Ok(Some(Some(line))) if line == "go" => {}
        other => bail!("--clients-proc: expected \"go\" on stdin within 120 s, got {other:?}"),
    }
    let (report, streams) = rt.block_on(run_clients(&o, &mut stdin));
    println!("result {}", serde_json::to_string(&report)?);
    std::io::stdout().flush()?;
    // Hold every connection until the parent has read the server's memory with all N clients
    // connected: real workers keep theirs for the whole job.
    let limit = o.timeout + Duration::from_secs(120);
    let closed = rt.block_on(async {
        tokio::time::timeout(limit, async { while let Some(Some(_)) = stdin.recv().await {} }).await
    });
    let _in_runtime = rt.enter();
    drop(streams);
    closed.map_err(|_| anyhow::anyhow!("--clients-proc: the parent did not close stdin within {limit:?}"))
}

async fn run_clients(
    o: &ClientArgs,
    stdin: &mut tokio::sync::mpsc::UnboundedReceiver<Option<String>>,
) -> (ProcReport, Vec<TcpStream>) {
    let deadline = tokio::time::Instant::now() + o.timeout;
    // `--inflight 0`: every client connects at once, as N workers starting together do.
    let gate = Arc::new(Semaphore::new(if o.inflight == 0 { Semaphore::MAX_PERMITS } else { o.inflight }));
    let mut tasks = tokio::task::JoinSet::new();
    for rank in o.first..o.first + o.count {
        let gate = gate.clone();
        let (addr, total) = (o.addr, o.total as i64);
        tasks.spawn(async move {
            let mut t = Timeline::default();
            let result = one_client(rank, addr, total, &gate, deadline, &mut t).await;
            (t, result)
        });
    }
    let mut r = ProcReport {
        clients: o.count,
        released: 0,
        errors: BTreeMap::new(),
        first_error: None,
        connect_retries: 0,
        first_start_ns: u64::MAX,
        last_connected_ns: 0,
        last_added_ns: 0,
        last_released_ns: 0,
        done_set_ns: None,
        connect_us: Vec::with_capacity(o.count),
    };
    let mut streams = Vec::with_capacity(o.count);
    let mut wait_error = None;
    let mut aborted = false;
    loop {
        let joined = tokio::select! {
            joined = tasks.join_next() => match joined {
                Some(joined) => joined,
                None => break,
            },
            word = stdin.recv(), if !aborted => {
                // "abort", or stdin closed (the parent is gone): stop every client now rather
                // than at the deadline.
                if !matches!(word, Some(Some(ref line)) if line != "abort") {
                    aborted = true;
                    tasks.abort_all();
                }
                continue;
            }
        };
        let (t, result) = joined.unwrap_or_else(|err| {
            let step = if err.is_cancelled() { "aborted" } else { "task" };
            (Timeline::default(), Err(format!("{step}: {err}")))
        });
        if t.start_ns > 0 {
            r.first_start_ns = r.first_start_ns.min(t.start_ns);
        }
        r.connect_retries += t.retries;
        if let Some(c) = t.connected_ns {
            r.last_connected_ns = r.last_connected_ns.max(c);
            r.connect_us.push(((c - t.start_ns) / 1000).min(u32::MAX as u64) as u32);
        }
        if let Some(a) = t.added_ns {
            r.last_added_ns = r.last_added_ns.max(a);
        }
        r.done_set_ns = r.done_set_ns.or(t.done_set_ns);
        match result {
            Ok(stream) => {
                r.released += 1;
                r.last_released_ns = r.last_released_ns.max(t.released_ns.unwrap_or(0));
                streams.push(stream);
            }
            Err(err) => {
                let step = err.split(':').next().unwrap_or("?").to_string();
                *r.errors.entry(step.clone()).or_default() += 1;
                if step == "wait" || step == "aborted" {
                    wait_error.get_or_insert(err);
                } else if r.first_error.is_none() {
                    // A client that failed before the barrier means it can never complete: tell
                    // the parent now, so it aborts every client process instead of letting them
                    // all wait for the deadline.
                    println!("failed {err}");
                    let _ = std::io::stdout().flush();
                    r.first_error = Some(err);
                }
            }
        }
    }
    r.first_error = r.first_error.or(wait_error);
    (r, streams)
}

fn wire_key(key: &str) -> Vec<u8> {
    format!("{KEY_PREFIX}{key}").into_bytes()
}

/// One worker's init: connect + validate + ping, set its address, add to the count, barrier.
/// Errors are "step: detail".
async fn one_client(
    rank: usize,
    addr: SocketAddr,
    total: i64,
    gate: &Semaphore,
    deadline: tokio::time::Instant,
    t: &mut Timeline,
) -> Result<TcpStream, String> {
    let mut stream = {
        let _permit = gate.acquire().await.map_err(|e| format!("connect: gate closed: {e}"))?;
        t.start_ns = mono_ns();
        let nonce = std::process::id().wrapping_mul(65_599).wrapping_add(rank as u32);
        // torch's client retries the whole connect + validate + ping on a network error (its
        // comment: a full listen backlog may make the first send in validate fail), after a
        // jittered exponential backoff, until its timeout.
        let mut backoff = TorchBackoff::default();
        let stream = loop {
            match handshake(addr, nonce, deadline).await {
                Ok(stream) => break stream,
                Err(err) => {
                    let delay = backoff.next();
                    if tokio::time::Instant::now() + delay >= deadline {
                        return Err(format!("{err} (after {} retries)", t.retries));
                    }
                    t.retries += 1;
                    tokio::time::sleep(delay).await;
                }
            }
        };
        t.connected_ns = Some(mono_ns());
        stream
    };
    let me = stream.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let set = Request::Set { key: wire_key(&format!("rank/{rank}")), value: me.into_bytes() };
    send(&mut stream, &set, deadline, "set").await?;
    send(&mut stream, &Request::Add { key: wire_key(COUNT_KEY), delta: 1 }, deadline, "add").await?;
    let count = i64::from_le_bytes(read(&mut stream, deadline, "add").await?);
    t.added_ns = Some(mono_ns());
    if count > total {
        return Err(format!("add: {COUNT_KEY} is {count}, more than the {total} clients"));
    }
    if count == total {
        let done = Request::Set { key: wire_key(DONE_KEY), value: b"1".to_vec() };
        send(&mut stream, &done, deadline, "set").await?;
        t.done_set_ns = Some(mono_ns());
    }
    send(&mut stream, &Request::Wait { keys: vec![wire_key(DONE_KEY)] }, deadline, "wait").await?;
    let [status] = read(&mut stream, deadline, "wait").await?;
    if status != WAIT_STOP_WAITING {
        return Err(format!("wait: status byte {status}"));
    }
    t.released_ns = Some(mono_ns());
    Ok(stream)
}

/// One try of what torch's client does before its constructor returns: connect, the validation
/// magic, then a ping whose nonce the server must echo (as `StoreClient::connect` does too).
async fn handshake(addr: SocketAddr, nonce: u32, deadline: tokio::time::Instant) -> Result<TcpStream, String> {
    let mut stream = match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(err)) => return Err(format!("connect: {err}")),
        Err(_) => return Err("connect: not connected by the deadline".into()),
    };
    stream.set_nodelay(true).map_err(|e| format!("connect: TCP_NODELAY: {e}"))?;
    send(&mut stream, &Request::Validate { magic: VALIDATION_MAGIC }, deadline, "validate").await?;
    send(&mut stream, &Request::Ping { nonce }, deadline, "ping").await?;
    let echoed = u32::from_le_bytes(read(&mut stream, deadline, "ping").await?);
    if echoed != nonce {
        return Err(format!("ping: nonce {echoed:#x} echoed, {nonce:#x} sent"));
    }
    Ok(stream)
}

/// The delays of torch's `ExponentialBackoffWithJitter` with its defaults, which its TCPStore
/// client uses between connect/validate tries: 500 ms, ×1.5 per try up to 60 s, each ±50 %.
struct TorchBackoff {
    interval: Duration,
}

impl Default for TorchBackoff {
    fn default() -> Self {
        TorchBackoff { interval: Duration::from_millis(500) }
    }
}

impl TorchBackoff {
    fn next(&mut self) -> Duration {
        let delay = self.interval.mul_f64(rand::random_range(0.5..1.5));
        self.interval = self.interval.mul_f64(1.5).min(Duration::from_secs(60));
        delay
    }
}

async fn send(
    stream: &mut TcpStream,
    request: &Request,
    deadline: tokio::time::Instant,
    step: &str,
) -> Result<(), String> {
    let mut frame = Vec::new();
    request.encode(&mut frame);
    match tokio::time::timeout_at(deadline, stream.write_all(&frame)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(format!("{step}: {err}")),
        Err(_) => Err(format!("{step}: could not send by the deadline")),
    }
}

async fn read<const N: usize>(
    stream: &mut TcpStream,
    deadline: tokio::time::Instant,
    step: &str,
) -> Result<[u8; N], String> {
    let mut b = [0u8; N];
    match tokio::time::timeout_at(deadline, stream.read_exact(&mut b)).await {
        Ok(Ok(_)) => Ok(b),
        Ok(Err(err)) => Err(format!("{step}: {err}")),
        Err(_) => Err(format!("{step}: no reply by the deadline")),
    }
}

// ---------------------------------------------------------------------------------------------
// The bench: servers and client processes, one run at a time.

/// A line of a child's stdout, tagged with the child's index; `None` when its stdout closed.
type Line = (usize, Option<String>);

/// A child process whose stdout lines arrive on a channel, so every read of it has a deadline.
/// Killed (by its own pid) on drop unless it has been reaped.
struct Proc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    /// Its own lines, unless they go to a channel shared with other children.
    lines: Option<mpsc::Receiver<Line>>,
    reaped: bool,
}

impl Proc {
    fn spawn(cmd: Command, name: String) -> Result<Proc> {
        let (tx, lines) = mpsc::channel();
        let mut proc = Proc::spawn_into(cmd, name, 0, tx)?;
        proc.lines = Some(lines);
        Ok(proc)
    }

    /// Spawns with its stdout lines sent to `tx` as `(id, line)`.
    fn spawn_into(mut cmd: Command, name: String, id: usize, tx: mpsc::Sender<Line>) -> Result<Proc> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("start {name}"))?;
        let stdout = child.stdout.take().context("piped stdout")?;
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send((id, Some(line))).is_err() {
                    return;
                }
            }
            let _ = tx.send((id, None));
        });
        Ok(Proc { name, stdin: child.stdin.take(), child, lines: None, reaped: false })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn line(&mut self, deadline: Instant) -> Result<String> {
        let lines = self.lines.as_ref().context("this child's lines go to a shared channel")?;
        match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((_, Some(line))) => Ok(line),
            Err(RecvTimeoutError::Timeout) => bail!("{}: no output by the deadline", self.name),
            Ok((_, None)) | Err(RecvTimeoutError::Disconnected) => {
                // Its stdout closed: it exited (or is exiting); say how if it can be told.
                std::thread::sleep(Duration::from_millis(100));
                let status = self.child.try_wait().ok().flatten();
                bail!("{} closed its output early (exit: {status:?})", self.name)
            }
        }
    }

    fn say(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("stdin already closed")?;
        writeln!(stdin, "{line}").and_then(|()| stdin.flush()).with_context(|| format!("write to {}", self.name))
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Closes its stdin (the signal to finish) and waits up to `limit` for it to exit; kills it
    /// past that.
    fn finish(mut self, limit: Duration) -> Result<ExitStatus> {
        self.stdin = None;
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                self.reaped = true;
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!("{} did not exit within {limit:?} (killed)", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// VmRSS and VmHWM (peak RSS) of a process, KiB.
fn memory_kib(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).context("the server process is gone")?;
    let field = |name: &str| -> Result<u64> {
        let line = status.lines().find_map(|l| l.strip_prefix(name)).with_context(|| format!("no {name}"))?;
        Ok(line.trim().trim_end_matches("kB").trim().parse()?)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Connections the server listening on `port` has open (its side ESTABLISHED or CLOSE_WAIT),
/// from /proc/net/tcp and tcp6 (torch's server listens on both families).
fn server_connections(port: u16) -> usize {
    let mut n = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let mut fields = line.split_whitespace();
            let (Some(_), Some(local), Some(_), Some(state)) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            let local_port = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && (state == "01" || state == "08") {
                n += 1;
            }
        }
    }
    n
}

/// The listen backlog of the socket on `port` (ss's Send-Q of a listening socket). Connections
/// beyond it that arrive at once overflow the accept queue: the kernel falls back to SYN cookies
/// and resets handshakes it cannot complete, which clients see as failed validates or pings.
fn listen_backlog(port: u16) -> Option<u32> {
    let out = Command::new("ss").args(["-Hltn", &format!("sport = :{port}")]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).lines().next()?.split_whitespace().nth(2)?.parse().ok()
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Server {
    Ours,
    Torch,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Ours => "rlaunch",
            Server::Torch => "torch",
        }
    }
}

struct Options {
    sizes: Vec<usize>,
    procs: usize,
    repeat: usize,
    inflight: usize,
    timeout: Duration,
    runtime: String,
    /// Our listen backlog, when not `start_dedicated`'s (std's).
    backlog: Option<u32>,
    /// torch's listener: "ipv4" (127.0.0.1, as ours) or "dual" (torch's own "::").
    torch_listen: String,
    write: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        sizes: vec![1024, 4096, 16384],
        procs: 8,
        repeat: 2,
        inflight: 0,
        timeout: Duration::from_secs(120),
        runtime: "dedicated".into(),
        backlog: None,
        torch_listen: "ipv4".into(),
        write: true,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--clients" => {
                o.sizes = value(&mut it, flag)?.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?
            }
            "--procs" => o.procs = value(&mut it, flag)?.parse()?,
            "--repeat" => o.repeat = value(&mut it, flag)?.parse()?,
            "--inflight" => o.inflight = value(&mut it, flag)?.parse()?,
            "--timeout" => o.timeout = Duration::from_secs(value(&mut it, flag)?.parse()?),
            "--runtime" => o.runtime = value(&mut it, flag)?.clone(),
            "--backlog" => o.backlog = Some(value(&mut it, flag)?.parse()?),
            "--torch-listen" => o.torch_listen = value(&mut it, flag)?.clone(),
            "--no-write" => o.write = false,
            other => bail!(
                "unknown flag {other} (use --clients N[,N…] --procs K --repeat R --inflight M --timeout S \
                 --runtime dedicated|multi --backlog B --torch-listen ipv4|dual --no-write)"
            ),
        }
    }
    if !["ipv4", "dual"].contains(&o.torch_listen.as_str()) {
        bail!("--torch-listen {}: use ipv4 or dual", o.torch_listen);
    }
    if o.sizes.is_empty() || o.sizes.contains(&0) || o.procs == 0 || o.repeat == 0 {
        bail!("--clients, --procs and --repeat must be positive");
    }
    Ok(o)
}

/// One server's numbers for one run.
#[derive(Clone)]
struct Measured {
    total_s: f64,
    connected_s: f64,
    counted_s: f64,
    wake_ms: f64,
    connect_p50_ms: f64,
    connect_p99_ms: f64,
    connect_max_ms: f64,
    retries: f64,
    idle_kib: u64,
    hwm_kib: u64,
    held_kib: u64,
    after_kib: u64,
    clients: usize,
}

/// What each run's server reported about itself (for the write-up).
#[derive(Default, Clone)]
struct ServerInfo {
    version: String,
    backlog: Option<u32>,
}

struct Hosted {
    proc: Proc,
    port: u16,
    info: ServerInfo,
}

fn start_server(server: Server, o: &Options) -> Result<Hosted> {
    let lifetime = (o.timeout * 3 + Duration::from_secs(600)).as_secs();
    let cmd = match server {
        Server::Ours => {
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(["--serve", "--runtime", &o.runtime, "--lifetime-s", &lifetime.to_string()]);
            if let Some(backlog) = o.backlog {
                cmd.args(["--backlog", &backlog.to_string()]);
            }
            cmd
        }
        Server::Torch => {
            let mut cmd = Command::new(python()?);
            cmd.arg(repo_root().join("bench/store/torch_scale_server.py"));
            cmd.args([o.timeout.as_secs().to_string(), o.torch_listen.clone()]);
            cmd
        }
    };
    let mut proc = Proc::spawn(cmd, format!("{} server", server.name()))?;
    // Importing torch takes seconds, more on a loaded machine.
    let line = proc.line(Instant::now() + Duration::from_secs(180))?;
    let mut words = line.split_whitespace();
    let port: u16 = words.next().unwrap_or("").parse().with_context(|| format!("{} printed {line:?}", proc.name))?;
    let version = match server {
        Server::Ours => format!("rlaunch {}", env!("CARGO_PKG_VERSION")),
        Server::Torch => format!("torch {}", words.next().unwrap_or("?")),
    };
    Ok(Hosted { proc, port, info: ServerInfo { version, backlog: listen_backlog(port) } })
}

fn run_once(server: Server, n: usize, o: &Options, info: &mut ServerInfo) -> Result<Measured> {
    let mut hosted = start_server(server, o)?;
    *info = hosted.info.clone();
    let (port, pid) = (hosted.port, hosted.proc.pid());
    // torch's master holds a client connection of its own: count only what the clients add.
    let base_connections = server_connections(port);
    let (idle_kib, _) = memory_kib(pid)?;

    let procs = o.procs.min(n);
    let (tx, lines) = mpsc::channel();
    let mut clients = Vec::with_capacity(procs);
    let mut first = 0;
    for k in 0..procs {
        let count = n / procs + usize::from(k < n % procs);
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("--clients-proc");
        for (flag, v) in [
            ("--addr", format!("127.0.0.1:{port}")),
            ("--first", first.to_string()),
            ("--count", count.to_string()),
            ("--total", n.to_string()),
            ("--inflight", o.inflight.to_string()),
            ("--timeout", o.timeout.as_secs().to_string()),
        ] {
            cmd.args([flag, &v]);
        }
        clients.push(Proc::spawn_into(cmd, format!("client process {k}"), k, tx.clone())?);
        first += count;
    }
    drop(tx);
    let next = |deadline: Instant, what: &str| -> Result<(usize, String)> {
        match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((k, Some(line))) => Ok((k, line)),
            Ok((k, None)) => bail!("client process {k} exited while the bench waited for {what}"),
            Err(_) => bail!("no {what} from the client processes by the deadline"),
        }
    };
    let ready_by = Instant::now() + Duration::from_secs(60);
    for _ in 0..procs {
        let (k, line) = next(ready_by, "\"ready\"")?;
        if line != "ready" {
            bail!("client process {k} printed {line:?}, not \"ready\"");
        }
    }
    for c in &mut clients {
        c.say("go")?;
    }
    let results_by = Instant::now() + o.timeout + Duration::from_secs(30);
    let mut reports: Vec<Option<ProcReport>> = (0..procs).map(|_| None).collect();
    let mut root_cause: Option<String> = None;
    while reports.iter().any(Option::is_none) {
        let (k, line) = next(results_by, "reports")?;
        if let Some(json) = line.strip_prefix("result ") {
            let report = serde_json::from_str(json).with_context(|| format!("client process {k}'s report"))?;
            reports[k] = Some(report);
        } else if let Some(err) = line.strip_prefix("failed ") {
            if root_cause.is_none() {
                root_cause = Some(format!("client process {k}: {err}"));
                for c in &mut clients {
                    // One that already reported has closed nothing yet; the word is harmless.
                    let _ = c.say("abort");
                }
            }
        } else {
            bail!("client process {k} printed {line:?}");
        }
    }
    let reports: Vec<ProcReport> = reports.into_iter().flatten().collect();
    // Every client still holds its connection here.
    if let Some(status) = hosted.proc.exited() {
        bail!("the {} server exited during the run ({status})", server.name());
    }
    let (held_kib, _) = memory_kib(pid)?;
    let held_connections = server_connections(port).saturating_sub(base_connections);

    let released: usize = reports.iter().map(|r| r.released).sum();
    if released < n {
        let mut errors: BTreeMap<&str, usize> = BTreeMap::new();
        for (step, count) in reports.iter().flat_map(|r| r.errors.iter()) {
            *errors.entry(step).or_default() += count;
        }
        let errors: Vec<String> = errors.iter().map(|(step, count)| format!("{step} {count}")).collect();
        let first = root_cause.or_else(|| reports.iter().find_map(|r| r.first_error.clone())).unwrap_or_default();
        bail!("{released} of {n} clients released; failed: {}; first error: {first}", errors.join(", "));
    }
    if held_connections < n {
        eprintln!("  note: /proc/net/tcp shows {held_connections} of {n} connections open at the barrier");
    }
    for c in clients {
        let name = c.name.clone();
        let status = c.finish(Duration::from_secs(30))?;
        if !status.success() {
            bail!("{name} failed: {status}");
        }
    }
    // Wait (bounded) until the server has closed its side of every connection, so "after" is
    // what it keeps once the job's workers are gone, not a mid-teardown sample.
    let closed_by = Instant::now() + Duration::from_secs(30);
    while server_connections(port) > base_connections {
        if Instant::now() >= closed_by {
            bail!("the {} server still had connections open 30 s after every client exited", server.name());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (after_kib, hwm_kib) = memory_kib(pid)?;
    let status = hosted.proc.finish(Duration::from_secs(30))?;
    if !status.success() {
        eprintln!("  note: the {} server exited with {status}", server.name());
    }

    let t0 = reports.iter().map(|r| r.first_start_ns).min().context("no client reports")?;
    let last = |f: fn(&ProcReport) -> u64| reports.iter().map(f).max().unwrap_or(0);
    let done_set = reports.iter().find_map(|r| r.done_set_ns).context("no client saw the count reach N")?;
    let mut connect: Vec<u32> = reports.iter().flat_map(|r| r.connect_us.iter().copied()).collect();
    connect.sort_unstable();
    let pct = |q: f64| connect[((connect.len() as f64 * q) as usize).min(connect.len() - 1)] as f64 / 1e3;
    let secs = |ns: u64| ns.saturating_sub(t0) as f64 / 1e9;
    Ok(Measured {
        total_s: secs(last(|r| r.last_released_ns)),
        connected_s: secs(last(|r| r.last_connected_ns)),
        counted_s: secs(last(|r| r.last_added_ns)),
        wake_ms: last(|r| r.last_released_ns).saturating_sub(done_set) as f64 / 1e6,
        connect_p50_ms: pct(0.5),
        connect_p99_ms: pct(0.99),
        connect_max_ms: pct(1.0),
        retries: reports.iter().map(|r| r.connect_retries).sum::<u64>() as f64,
        idle_kib,
        hwm_kib,
        held_kib,
        after_kib,
        clients: n,
    })
}

type Outcome = std::result::Result<Measured, String>;

/// The median; of an even count, the mean of the middle two (the two indices coincide for an odd
/// count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    (v[(v.len() - 1) / 2] + v[v.len() / 2]) / 2.0
}

fn fmt(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// A row of the table. Ratios are torch / rlaunch, so above 1 means torch took longer or used
/// more memory; a count (retries) gets none.
struct Row {
    label: &'static str,
    value: fn(&Measured) -> f64,
    ratio: bool,
}

fn rows() -> Vec<Row> {
    let row = |label, value, ratio| Row { label, value, ratio };
    vec![
        row("first connect → last client released (s)", |m: &Measured| m.total_s, true),
        row("first connect → last client connected (s)", |m| m.connected_s, true),
        row("first connect → count reached N (s)", |m| m.counted_s, true),
        row("`init/done` set → last waiter released (ms)", |m| m.wake_ms, true),
        row("connect + validate + ping p50, retries included (ms)", |m| m.connect_p50_ms, true),
        row("connect + validate + ping p99, retries included (ms)", |m| m.connect_p99_ms, true),
        row("connect + validate + ping max, retries included (ms)", |m| m.connect_max_ms, true),
        row("handshake retries (connect/validate/ping failed)", |m| m.retries, false),
        row("server RSS idle, before clients (MiB)", |m| mib(m.idle_kib), true),
        row("server peak RSS, VmHWM (MiB)", |m| mib(m.hwm_kib), true),
        row("server peak RSS − idle (MiB)", |m| mib(m.hwm_kib.saturating_sub(m.idle_kib)), true),
        row("server RSS, N clients connected (MiB)", |m| mib(m.held_kib), true),
        row(
            "server RSS per connected client (KiB)",
            |m| m.held_kib.saturating_sub(m.idle_kib) as f64 / m.clients as f64,
            true,
        ),
        row("server RSS after clients closed (MiB)", |m| mib(m.after_kib), true),
    ]
}

/// "median (min–max)" of the successful runs, with how many failed.
fn cell(runs: &[Outcome], f: fn(&Measured) -> f64) -> String {
    let ok: Vec<f64> = runs.iter().filter_map(|r| r.as_ref().ok()).map(f).collect();
    let failed = runs.len() - ok.len();
    if ok.is_empty() {
        return format!("failed {failed}/{}", runs.len());
    }
    let mut s = fmt(median(ok.clone()));
    if ok.len() > 1 {
        let lo = ok.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ok.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        s.push_str(&format!(" ({}–{})", fmt(lo), fmt(hi)));
    }
    if failed > 0 {
        s.push_str(&format!(", failed {failed}/{}", runs.len()));
    }
    s
}

/// Median of torch/rlaunch over the repeats where both runs succeeded (each pair ran back to
/// back, so load from other jobs hit both alike).
fn ratio(ours: &[Outcome], torch: &[Outcome], f: fn(&Measured) -> f64) -> String {
    let pairs: Vec<f64> = ours
        .iter()
        .zip(torch)
        .filter_map(|(o, t)| Some((f(o.as_ref().ok()?), f(t.as_ref().ok()?))))
        .filter(|(o, _)| *o > 0.0)
        .map(|(o, t)| t / o)
        .collect();
    if pairs.is_empty() {
        return "–".into();
    }
    format!("{:.2}×", median(pairs))
}

fn table(n: usize, ours: &[Outcome], torch: &[Outcome]) -> String {
    let mut out = format!("| N = {n} | rlaunch store | torch TCPStore | torch / rlaunch |\n|---|---|---|---|\n");
    for Row { label, value, ratio: with_ratio } in rows() {
        let r = if with_ratio { ratio(ours, torch, value) } else { "–".into() };
        out.push_str(&format!("| {label} | {} | {} | {r} |\n", cell(ours, value), cell(torch, value)));
    }
    for (name, runs) in [("rlaunch", ours), ("torch", torch)] {
        for (i, run) in runs.iter().enumerate() {
            if let Err(err) = run {
                out.push_str(&format!("\n{name} run {} of {}: FAILED: {err}\n", i + 1, runs.len()));
            }
        }
    }
    out
}

fn shell(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn bench(args: &[String], nofile: usize) -> Result<()> {
    let o = parse(args)?;
    let biggest = *o.sizes.iter().max().unwrap_or(&0);
    let per_proc = biggest.div_ceil(o.procs);
    if per_proc + SPARE_FDS > nofile {
        bail!(
            "{per_proc} connections per client process, but a process may open {nofile} files: \
             use more --procs (at least {})",
            biggest.div_ceil(nofile.saturating_sub(SPARE_FDS).max(1))
        );
    }
    if biggest + SPARE_FDS > nofile {
        eprintln!("note: N = {biggest} is near the {nofile}-descriptor limit of the server processes");
    }
    let date = shell("date", &[]);
    let load_before = load_average();
    let mut info: BTreeMap<Server, ServerInfo> = BTreeMap::new();
    let mut results: BTreeMap<(usize, Server), Vec<Outcome>> = BTreeMap::new();
    for &n in &o.sizes {
        for rep in 0..o.repeat {
            // Alternate the order (rlaunch, torch), (torch, rlaunch), …: a drift in the load from
            // other jobs then favours neither server.
            let order = if rep % 2 == 0 { [Server::Ours, Server::Torch] } else { [Server::Torch, Server::Ours] };
            for server in order {
                eprintln!("N = {n}, repeat {}/{}: {} …", rep + 1, o.repeat, server.name());
                let mut i = ServerInfo::default();
                let outcome = run_once(server, n, &o, &mut i).map_err(|e| format!("{e:#}"));
                if !i.version.is_empty() {
                    info.insert(server, i);
                }
                match &outcome {
                    Ok(m) => eprintln!(
                        "  {:.3} s, peak RSS {:.1} MiB (idle {:.1} MiB)",
                        m.total_s,
                        mib(m.hwm_kib),
                        mib(m.idle_kib)
                    ),
                    Err(err) => eprintln!("  FAILED: {err}"),
                }
                results.entry((n, server)).or_default().push(outcome);
            }
        }
    }
    let load_after = load_average();

    let mut tables = String::new();
    for &n in &o.sizes {
        let ours = &results[&(n, Server::Ours)];
        let torch = &results[&(n, Server::Torch)];
        tables.push_str(&format!("### N = {n}\n\n{}\n", table(n, ours, torch)));
    }
    let largest = |server: Server| -> String {
        o.sizes
            .iter()
            .filter(|&&n| results[&(n, server)].iter().all(|r| r.is_ok()))
            .max()
            .map_or_else(|| "none".to_string(), |n| n.to_string())
    };
    let summary = format!(
        "Largest N with every run completed: rlaunch {}, torch {} (of {}).\n",
        largest(Server::Ours),
        largest(Server::Torch),
        o.sizes.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", ")
    );
    println!("\n{tables}{summary}");

    if o.write {
        let describe = |server: Server| {
            info.get(&server).map_or_else(
                || "? (never started)".to_string(),
                |i| {
                    let backlog = i.backlog.map_or_else(|| "?".to_string(), |b| b.to_string());
                    format!("{}, listen backlog {backlog}", i.version)
                },
            )
        };
        let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
        let mem_gib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().to_string())))
            .and_then(|v| v.trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or_else(|| "?".to_string(), |kib| format!("{:.1}", kib / 1048576.0));
        let inflight = if o.inflight == 0 {
            "all connect at once, as N workers starting together do".to_string()
        } else {
            format!("at most {} handshakes in flight per client process", o.inflight)
        };
        let mut command = "cargo run --release -p rlaunch --example store_scale".to_string();
        if !args.is_empty() {
            command = format!("{command} -- {}", args.join(" "));
        }
        let doc = format!(
            "# The workers' store at scale: rlaunch's store vs torch's TCPStore\n\n\
             Date: {date}. Machine: {cores} cores, {mem_gib} GiB, Linux {kernel}, shared with other\n\
             engineers' builds and tests (load average 1/5/15 min: {load_before} at the start, {load_after} at the end).\n\n\
             Command: `{command}`\n\n\
             - Servers, each in a process of its own, a fresh one for every run:\n  \
               - rlaunch's `StoreServer` ({hosting}): {ours};\n  \
               - torch's `TCPStore(is_master=True, use_libuv=True)` in `bench/store/torch_scale_server.py`\n    \
                 ({torch_listen}): {torch}.\n\
             - Clients: N per run, tokio tasks in {procs} client processes (`store_scale --clients-proc`);\n  \
               {inflight}. Each does torch's init pattern: connect, validate + ping,\n  \
               `set(\"rank/i\", its address)`, `add(\"init/count\", 1)`, then a barrier: the client whose add\n  \
               returns N sets `init/done`, all wait for it.\n  \
               Like torch's client, a client whose connect, validate or ping fails retries the three after torch's\n  \
               backoff (500 ms, ×1.5 per try, ±50 %); the retries row counts those tries.\n\
             - Order: for each N, {repeat} repeats alternating (rlaunch, torch), (torch, rlaunch), …; each cell is the\n  \
               median (min–max) over the repeats, each ratio the median of the per-repeat torch / rlaunch ratios\n  \
               (above 1: torch took longer or used more memory).\n\
             - Time: from the first client's connect to the last client released from the barrier, on\n  \
               CLOCK_MONOTONIC across processes (client process start-up excluded). Memory: the server process's\n  \
               VmRSS before any client, with all N connected at the barrier, and after they all closed; VmHWM\n  \
               is its peak. torch's server process is a Python interpreter with torch imported, hence its idle\n  \
               RSS; the growth rows compare what the N clients cost each server.\n\
             - Timeout per run: {timeout} s. A run fails when a client fails past the handshake or its retries, or when\n  \
               not all N clients are released by then; its other clients are then stopped and the failure is shown.\n\n\
             {tables}{summary}",
            kernel = shell("uname", &["-r"]),
            hosting = match (o.runtime.as_str(), o.backlog) {
                ("dedicated", None) => "`start_dedicated`, as the agent hosts it".to_string(),
                (_, None) => "`start` on a multi-thread runtime".to_string(),
                (rt, Some(b)) => format!("`serve` on a {rt} runtime, listener bound here with backlog {b}"),
            },
            torch_listen = if o.torch_listen == "ipv4" {
                "listening on 127.0.0.1 like ours, through `master_listen_fd`".to_string()
            } else {
                "torch's own dual-stack \"::\" listener".to_string()
            },
            ours = describe(Server::Ours),
            torch = describe(Server::Torch),
            procs = o.procs,
            repeat = o.repeat,
            timeout = o.timeout.as_secs(),
        );
        let path = repo_root().join("bench/store/SCALE.md");
        std::fs::write(&path, doc).with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
