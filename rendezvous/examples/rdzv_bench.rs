//! Benchmark: time from the last join to every agent holding the closed round, for N simulated
//! agents (tokio tasks in this process, one HTTP client pool) talking to an `rlaunch-rendezvous`
//! service started as its own process (memory store, and etcd when `--etcd http://host:2379` is
//! given); also the bytes of each agent's answer, the service's memory, and its CPU time (the
//! whole run, and the close alone).
//!
//! `cargo build --release -p rlaunch-launcher --bins && cargo build --release -p rlaunch-rendezvous --examples &&
//!  target/release/examples/rdzv_bench --agents 100,1000,3000,10000 [--etcd URL [--no-memory]] [--snapshots] [--no-peers]`
//!
//! `BENCH_TRACE=1` prints each status poll while the agents join and, after the last join, how
//! many joins were answered every 2 s (this inflates the measured time); `BENCH_JOIN_WAIT_S`
//! bounds the wait for the first N-1 joins (600 s).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlaunch_rendezvous::round::{JobSettings, NodeInfo};
use rlaunch_rendezvous::{Backend, RendezvousClient};

fn settings(n: u32) -> JobSettings {
    JobSettings {
        min_nodes: n,
        max_nodes: n,
        join_timeout: Duration::from_secs(300),
        last_call_timeout: Duration::from_secs(1),
        // torchrun's keep-alive interval: 10,000 agents beat 2,000 times a second.
        heartbeat_interval: Duration::from_secs(5),
        node_ttl: Duration::from_secs(30),
        probe_timeout: Duration::from_secs(10),
        // Peer watching at its default unless `--no-peers` (each answer then names no targets).
        peer_interval: if std::env::var_os("RDZV_BENCH_NO_PEERS").is_some() {
            Duration::ZERO
        } else {
            Duration::from_millis(100)
        },
        stall_bound: Duration::from_millis(500),
        max_restarts: 0,
        stop_grace: Duration::ZERO,
        hang_timeout: None,
        fingerprint: None,
    }
}

/// The service binary next to this example (`target/release/`).
fn service_binary() -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe.parent().and_then(|d| d.parent()).context("example path")?.join("rlaunch-rendezvous");
    if !bin.exists() {
        bail!("{} is missing: cargo build --release -p rlaunch-launcher --bins", bin.display());
    }
    Ok(bin)
}

struct Service {
    child: Child,
    endpoint: String,
}

impl Service {
    fn start(etcd: Option<&str>) -> Result<Service> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let endpoint = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(service_binary()?);
        cmd.args(["--listen", &endpoint, "--max-connections", "19000", "--max-jobs", "100000"]);
        if let Some(url) = etcd {
            cmd.args(["--store", "etcd", "--etcd-endpoints", url]);
        }
        // Its warnings go to a file next to the temp dir, for a run that fails.
        let log = std::fs::File::create(std::env::temp_dir().join("rdzv_bench_service.log"))?;
        let child = cmd.env("RUST_LOG", "warn").stderr(Stdio::from(log)).spawn().context("start the service")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&endpoint).is_err() {
            if Instant::now() > deadline {
                bail!("the service did not listen on {endpoint}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Service { child, endpoint })
    }

    /// Resident memory of the service, in MiB.
    fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(0.0, |kib| kib / 1024.0)
    }

    /// CPU time the service has used so far (user and system), in ms.
    fn cpu_ms(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // The fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
        let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
        let ticks: f64 = [11, 12].iter().filter_map(|&i| fields.get(i)?.parse::<f64>().ok()).sum();
        // SAFETY: sysconf reads a constant of the system.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        ticks * 1e3 / hz
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Run {
    took: Duration,
    answer_bytes: usize,
    rss_mib: f64,
    /// The service's CPU time from its start (the joins included) to all answers, and from the
    /// last join to all answers.
    cpu_ms: f64,
    close_cpu_ms: f64,
}

async fn one(service: &Service, n: u32, run_id: &str, snapshots: bool) -> Result<Run> {
    let backend = Backend::Http { endpoints: vec![service.endpoint.parse().expect("an endpoint")], token: None };
    // With snapshots, each agent joins with its snapshot address and public key and asks for
    // the whole member list, as an agent with `--snapshot-memory` above 0 does.
    let client =
        RendezvousClient::connect(backend, run_id, settings(n)).await.context("client")?.asking_members(snapshots);
    let node = move |i: u32| NodeInfo {
        node_id: format!("agent-{i:05}"),
        local_world_size: 8,
        store_addr: format!("10.0.{}.{}:29500", i / 250, i % 250 + 1).parse().expect("a valid address"),
        probe_addr: None,
        snapshot_addr: snapshots
            .then(|| format!("10.0.{}.{}:29600", i / 250, i % 250 + 1).parse().expect("a valid address")),
        snapshot_key: snapshots.then(|| format!("{:064x}", u128::from(i) * 0x9e37_79b9_7f4a_7c15)),
        snapshots: Vec::new(),
        fingerprint: None,
    };
    let mut joins: Vec<tokio::task::JoinHandle<Result<_, rlaunch_rendezvous::RdzvError>>> = Vec::new();
    for i in 0..n - 1 {
        let c = client.clone();
        joins.push(tokio::spawn(async move { c.join(node(i)).await }));
    }
    // Wait until the first n-1 are all pending.
    let deadline = Instant::now()
        + Duration::from_secs(std::env::var("BENCH_JOIN_WAIT_S").ok().and_then(|s| s.parse().ok()).unwrap_or(600));
    loop {
        let ts = Instant::now();
        let st = client.status().await;
        if std::env::var("BENCH_TRACE").is_ok() {
            eprintln!(
                "status after {:?}: {:?}",
                ts.elapsed(),
                st.as_ref().map(|s| s.pending.len()).map_err(|e| e.to_string())
            );
        }
        if let Ok(st) = st {
            if st.pending.len() as u32 == n - 1 {
                break;
            }
        }
        if Instant::now() > deadline {
            let pending = client.status().await.map(|s| s.pending.len()).unwrap_or(0);
            let mut failed = Vec::new();
            for j in joins.iter_mut().filter(|j| j.is_finished()) {
                if let Ok(Err(e)) = j.await {
                    failed.push(format!("{e:#}"));
                }
            }
            eprintln!("first errors: {:?}", &failed[..failed.len().min(3)]);
            bail!(
                "the first {} agents did not all join in time ({pending} pending, {} join tasks ended)",
                n - 1,
                failed.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let t0 = Instant::now();
    let cpu_at_last_join = service.cpu_ms();
    let last = client.join(node(n - 1)).await.context("last join")?;
    if std::env::var("BENCH_TRACE").is_ok() {
        eprintln!("last join answered after {:?}", t0.elapsed());
        for _ in 0..20 {
            let done = joins.iter().filter(|j| j.is_finished()).count();
            eprintln!("{:?}: {done} joins answered", t0.elapsed());
            if done == joins.len() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
    let mut answer_bytes = 0;
    for j in joins {
        let info = j.await.context("join task")?.map_err(|e| anyhow::anyhow!("join: {e:?}"))?;
        assert_eq!((info.round, &info.members_digest), (last.round, &last.members_digest));
        answer_bytes = answer_bytes.max(serde_json::to_vec(&info)?.len());
    }
    let took = t0.elapsed();
    let rss_mib = service.rss_mib();
    let cpu_ms = service.cpu_ms();
    let close_cpu_ms = cpu_ms - cpu_at_last_join;
    // Every agent leaves at once, as at the end of a job.
    let mut leaves = tokio::task::JoinSet::new();
    for i in 0..n {
        let c = client.clone();
        leaves.spawn(async move { c.leave(&node(i).node_id).await });
    }
    while leaves.join_next().await.is_some() {}
    Ok(Run { took, answer_bytes, rss_mib, cpu_ms, close_cpu_ms })
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut agents = vec![100u32, 1000, 3000, 10000];
    let mut etcd: Option<String> = None;
    let mut memory = true;
    let mut snapshots = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--agents" => {
                agents = args.next().context("--agents N,N")?.split(',').map(str::parse).collect::<Result<_, _>>()?
            }
            "--etcd" => etcd = Some(args.next().context("--etcd URL")?),
            // Only the etcd store (with --etcd).
            "--no-memory" => memory = false,
            // Agents with snapshots: keys in every join, the member list in every answer.
            "--snapshots" => snapshots = true,
            // Jobs without peer watching (answers without whom to watch), to compare.
            "--no-peers" => std::env::set_var("RDZV_BENCH_NO_PEERS", "1"),
            other => bail!("unknown argument {other}"),
        }
    }
    // 10,000 agents hold 10,000 connections.
    rlaunch::store::raise_open_files().context("raising the open-file limit")?;
    println!(
        "store\tagents\tlast_join_to_all_closed_ms\tper_agent_us\tanswer_bytes\tservice_rss_mib\tservice_cpu_ms\tclose_cpu_ms"
    );
    let mut stores: Vec<(&str, Option<&str>)> = if memory { vec![("memory", None)] } else { Vec::new() };
    if let Some(url) = etcd.as_deref() {
        stores.push(("etcd", Some(url)));
    }
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis();
    for (name, url) in stores {
        for &n in &agents {
            // A fresh service per size: its memory is this job's alone.
            let service = Service::start(url)?;
            let run = one(&service, n, &format!("bench-{name}-{n}-{stamp}"), snapshots).await?;
            println!(
                "{name}\t{n}\t{:.1}\t{:.1}\t{}\t{:.1}\t{:.0}\t{:.0}",
                run.took.as_secs_f64() * 1e3,
                run.took.as_secs_f64() * 1e6 / f64::from(n),
                run.answer_bytes,
                run.rss_mib,
                run.cpu_ms,
                run.close_cpu_ms
            );
        }
    }
    Ok(())
}
