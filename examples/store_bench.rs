//! Store benchmark: our TCPStore server against torch's own, driven by the same torch client.
//!
//! `cargo run --release -p rlaunch --example store_bench` hosts our server in-process, starts
//! torch's server (`bench/store/torch_server.py`), runs `bench/store/driver.py` (torch's
//! `TCPStore` client: latency of set/get/add/wait, multi-process throughput) against each,
//! prints a table with ratios and writes `bench/store/RESULTS.md`.
//! `store_bench serve [PORT]` only hosts our server (prints the port; until stdin closes).

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use rlaunch::store::{ServerConfig, StoreServer};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        let port: u16 = args.get(1).map(|p| p.parse()).transpose()?.unwrap_or(0);
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let multi = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let handle = match std::env::var("STORE_BENCH_RT").as_deref() {
            Ok("multi") => multi.block_on(StoreServer::start(addr))?,
            _ => StoreServer::start_dedicated(addr, ServerConfig::default())?,
        };
        println!("{}", handle.local_addr().port());
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        multi.block_on(handle.shutdown())?;
        return Ok(());
    }
    bench(&args)
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

struct Options {
    repeat: usize,
    rounds: usize,
    ops: usize,
    procs: usize,
    write: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options { repeat: 3, rounds: 3, ops: 3000, procs: 4, write: true };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--repeat" => o.repeat = value()?.parse()?,
            "--rounds" => o.rounds = value()?.parse()?,
            "--ops" => o.ops = value()?.parse()?,
            "--procs" => o.procs = value()?.parse()?,
            "--no-write" => o.write = false,
            other => bail!("unknown flag {other} (use --repeat N --rounds N --ops N --procs N --no-write)"),
        }
    }
    Ok(o)
}

/// Runs the torch-client driver against the server on `port`; returns its JSON metrics.
/// Runs the torch-client driver against both servers at once (alternating small batches);
/// returns the metrics of server A and of server B.
type Metrics = serde_json::Map<String, serde_json::Value>;

fn drive(o: &Options, port_a: u16, port_b: u16, run: usize) -> Result<(Metrics, Metrics)> {
    let out = Command::new(python()?)
        .arg(repo_root().join("bench/store/driver.py"))
        .args(["127.0.0.1", &port_a.to_string(), &port_b.to_string()])
        .arg(format!("run{run}"))
        .args(["--ops", &o.ops.to_string(), "--procs", &o.procs.to_string()])
        .args(["--rounds", &o.rounds.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .context("run bench/store/driver.py")?;
    if !out.status.success() {
        bail!("driver failed: {}", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().context("driver printed nothing")?;
    let mut all: Metrics = serde_json::from_str(line)?;
    let mut take = |k: &str| match all.remove(k) {
        Some(serde_json::Value::Object(m)) => Ok(m),
        _ => Err(anyhow::anyhow!("driver output lacks {k:?}: {line}")),
    };
    Ok((take("a")?, take("b")?))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    // STORE_BENCH_RT=dedicated (default): `StoreServer::start_dedicated`, a single-threaded
    // runtime on a thread of its own; STORE_BENCH_RT=multi: `StoreServer::start` on a
    // multi-thread runtime (one worker per core), as an agent's own runtime would host it.
    let flavor = std::env::var("STORE_BENCH_RT").unwrap_or_else(|_| "dedicated".into());
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let multi = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let ours = match flavor.as_str() {
        "multi" => multi.block_on(StoreServer::start(any))?,
        "dedicated" => StoreServer::start_dedicated(any, ServerConfig::default())?,
        other => bail!("STORE_BENCH_RT={other}: use dedicated or multi"),
    };
    let our_port = ours.local_addr().port();

    let mut torch_server = Command::new(python()?)
        .arg(repo_root().join("bench/store/torch_server.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("start torch's TCPStore server")?;
    let mut line = String::new();
    BufReader::new(torch_server.stdout.take().context("piped stdout")?).read_line(&mut line)?;
    let torch_port: u16 = line.trim().parse().with_context(|| format!("torch server printed {line:?}"))?;

    let mut results = [Vec::new(), Vec::new()];
    for run in 1..=o.repeat {
        eprintln!("run {run}/{}: rlaunch (port {our_port}) and torch (port {torch_port}) side by side", o.repeat);
        let (ours_m, torch_m) = drive(&o, our_port, torch_port, run)?;
        results[0].push(ours_m);
        results[1].push(torch_m);
    }
    drop(torch_server.stdin.take());
    let _ = torch_server.wait();
    multi.block_on(ours.shutdown())?;

    let torch_version = results[1][0].get("torch").and_then(|v| v.as_str()).unwrap_or("?").to_string();
    let metrics: Vec<String> = results[0][0].keys().filter(|k| results[0][0][*k].is_number()).cloned().collect();
    let order = [
        "set_p50_us",
        "set_p99_us",
        "get_p50_us",
        "get_p99_us",
        "add_p50_us",
        "add_p99_us",
        "wait_present_p50_us",
        "wait_present_p99_us",
        "check_p50_us",
        "check_p99_us",
        "wake_p50_us",
        "wake_p99_us",
        "set_1MiB_p50_us",
        "get_1MiB_p50_us",
    ];
    let mut rows = Vec::new();
    for m in order.iter().map(|s| s.to_string()).chain(metrics.iter().filter(|m| !order.contains(&m.as_str())).cloned())
    {
        if !metrics.contains(&m) {
            continue;
        }
        let values = |i: usize| -> Vec<f64> { results[i].iter().filter_map(|r| r.get(&m)?.as_f64()).collect() };
        let (ours_v, torch_v) = (values(0), values(1));
        let latency = m.ends_with("_us");
        // Speed-up per run (both servers measured side by side in it), then the median.
        let speedups: Vec<f64> =
            ours_v.iter().zip(&torch_v).map(|(o, t)| if latency { t / o } else { o / t }).collect();
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{} ({}–{})", fmt(median(v.to_vec())), fmt(lo), fmt(hi))
        };
        let speedup = median(speedups.clone());
        let speedup_range = format!(
            "{speedup:.2}× ({:.2}–{:.2})",
            speedups.iter().copied().fold(f64::INFINITY, f64::min),
            speedups.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        );
        let (label, unit) = if latency {
            (m.trim_end_matches("_us").replace('_', " "), "µs")
        } else {
            (m.trim_end_matches("_ops_s").replace('_', " "), "ops/s")
        };
        rows.push(format!("| {label} ({unit}) | {} | {} | {speedup_range} |", range(&ours_v), range(&torch_v)));
    }
    let table = format!(
        "| metric | rlaunch store | torch TCPStore | rlaunch speed-up |\n|---|---|---|---|\n{}\n\n\
         Each cell: median of {} runs (min–max).\n",
        rows.join("\n"),
        o.repeat
    );
    println!("\n{table}");
    if o.write {
        let doc = format!(
            "# Store benchmark: rlaunch's TCPStore server vs torch's\n\n\
             Date: 2026-11-21. Machine: 2 cores, 24 GiB (shared with other builds and tests).\n\
             Client: torch {torch_version}'s own `torch.distributed.TCPStore` client drives both servers in\n\
             one run (`bench/store/driver.py`); torch's server is its default libuv backend hosted by\n\
             `bench/store/torch_server.py`; ours is `rlaunch::store::StoreServer` in the\n\
             `store_bench` process ({flavor} runtime: `STORE_BENCH_RT`, release build). Both servers are measured in the same driver process,\n\
             in alternating batches of 100 ops (A,B,B,A,…), so load from other jobs hits both alike.\n\
             Latency: {ops} sequential ops per metric from one client (p50/p99). Throughput: {procs}\n\
             client processes at once ({ops} ops each), median of {rounds} alternating rounds. Speed-up > 1 means rlaunch is faster (latency: torch /\n\
             rlaunch; throughput: rlaunch / torch). `wake` is half a set→wait ping-pong round trip\n\
             between two processes: how fast a wait is released by another client's set.\n\n\
             {table}\n\
             Load average (1/5/15 min) when the run started: {load}; other engineers' builds\n\
             and tests shared the two cores, so p99 figures are noisy, p50 and throughput less so.\n\n\
             Reproduce: `cargo run --release -p rlaunch --example store_bench` (writes this file;\n\
             `--repeat N --rounds N --ops N --procs N --no-write`).\n",
            rounds = o.rounds,
            ops = o.ops,
            procs = o.procs,
            flavor = flavor,
            load = load_before.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        );
        let path = repo_root().join("bench/store/RESULTS.md");
        std::fs::write(&path, doc).with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn fmt(v: f64) -> String {
    if v >= 1000.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
