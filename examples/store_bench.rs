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
use rlaunch::store::StoreServer;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let port: u16 = args.get(1).map(|p| p.parse()).transpose()?.unwrap_or(0);
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let handle = rt.block_on(StoreServer::start(addr))?;
        println!("{}", handle.local_addr().port());
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        rt.block_on(handle.shutdown())?;
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
        bail!(
            "{} is missing: run scripts/install-deps.sh",
            python.display()
        );
    }
    Ok(python)
}

struct Options {
    rounds: usize,
    ops: usize,
    procs: usize,
    write: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        rounds: 3,
        ops: 3000,
        procs: 4,
        write: true,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--rounds" => o.rounds = value()?.parse()?,
            "--ops" => o.ops = value()?.parse()?,
            "--procs" => o.procs = value()?.parse()?,
            "--no-write" => o.write = false,
            other => bail!("unknown flag {other} (use --rounds N --ops N --procs N --no-write)"),
        }
    }
    Ok(o)
}

/// Runs the torch-client driver against the server on `port`; returns its JSON metrics.
fn drive(
    o: &Options,
    port: u16,
    run_id: &str,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    let out = Command::new(python()?)
        .arg(repo_root().join("bench/store/driver.py"))
        .args(["127.0.0.1", &port.to_string(), run_id])
        .args(["--ops", &o.ops.to_string(), "--procs", &o.procs.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .context("run bench/store/driver.py")?;
    if !out.status.success() {
        bail!("driver failed against port {port}: {}", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().context("driver printed nothing")?;
    match serde_json::from_str(line)? {
        serde_json::Value::Object(map) => Ok(map),
        other => bail!("driver printed {other}"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    // Our server on its own thread and runtime; STORE_BENCH_RT=current makes that runtime
    // current-thread (default: multi-thread, one worker per core).
    let flavor = std::env::var("STORE_BENCH_RT").unwrap_or_else(|_| "multi-thread".into());
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server_rt = if flavor == "current" {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
    };
    let server_thread = std::thread::spawn(move || {
        server_rt.block_on(async move {
            let handle = StoreServer::start("127.0.0.1:0".parse().expect("valid address")).await?;
            let _ = port_tx.send(handle.local_addr().port());
            let _ = stop_rx.await;
            handle.shutdown().await
        })
    });
    let our_port = port_rx.recv().context("our server did not start")?;

    let mut torch_server = Command::new(python()?)
        .arg(repo_root().join("bench/store/torch_server.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("start torch's TCPStore server")?;
    let mut line = String::new();
    BufReader::new(torch_server.stdout.take().context("piped stdout")?).read_line(&mut line)?;
    let torch_port: u16 = line
        .trim()
        .parse()
        .with_context(|| format!("torch server printed {line:?}"))?;

    let servers = [("rlaunch", our_port), ("torch", torch_port)];
    let mut results: Vec<Vec<serde_json::Map<String, serde_json::Value>>> =
        vec![Vec::new(), Vec::new()];
    for round in 0..o.rounds {
        // Alternate who goes first, so neither always runs on a warmer machine.
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (name, port) = servers[i];
            eprintln!(
                "round {}/{}: {name} server (port {port})",
                round + 1,
                o.rounds
            );
            results[i].push(drive(&o, port, &format!("{name}-{round}"))?);
        }
    }
    drop(torch_server.stdin.take());
    let _ = torch_server.wait();
    let _ = stop_tx.send(());
    server_thread
        .join()
        .map_err(|_| anyhow::anyhow!("server thread panicked"))??;

    let torch_version = results[1][0]
        .get("torch")
        .and_then(|v| v.as_str())
        .unwrap_or("?")
        .to_string();
    let metrics: Vec<String> = results[0][0]
        .keys()
        .filter(|k| results[0][0][*k].is_number())
        .cloned()
        .collect();
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
    for m in order.iter().map(|s| s.to_string()).chain(
        metrics
            .iter()
            .filter(|m| !order.contains(&m.as_str()))
            .cloned(),
    ) {
        if !metrics.contains(&m) {
            continue;
        }
        let value = |i: usize| {
            median(
                results[i]
                    .iter()
                    .filter_map(|r| r.get(&m)?.as_f64())
                    .collect(),
            )
        };
        let (ours, torch) = (value(0), value(1));
        let latency = m.ends_with("_us");
        let speedup = if latency { torch / ours } else { ours / torch };
        let (label, unit) = if latency {
            (m.trim_end_matches("_us").replace('_', " "), "µs")
        } else {
            (m.trim_end_matches("_ops_s").replace('_', " "), "ops/s")
        };
        rows.push(format!(
            "| {label} ({unit}) | {} | {} | {speedup:.2}× |",
            fmt(ours),
            fmt(torch)
        ));
    }
    let table = format!(
        "| metric | rlaunch store | torch TCPStore | rlaunch speed-up |\n|---|---|---|---|\n{}\n",
        rows.join("\n")
    );
    println!("\n{table}");
    if o.write {
        let doc = format!(
            "# Store benchmark: rlaunch's TCPStore server vs torch's\n\n\
             Date: 2026-11-21. Machine: 2 cores, 24 GiB (shared with other builds and tests).\n\
             Client: torch {torch_version}'s own `torch.distributed.TCPStore` client drives both servers in\n\
             one run (`bench/store/driver.py`); torch's server is its default libuv backend hosted by\n\
             `bench/store/torch_server.py`; ours is `rlaunch::store::StoreServer` in the\n\
             `store_bench` process (tokio {flavor} runtime, release build). Median of {rounds} interleaved rounds; {ops}\n\
             sequential ops per latency metric from one client; throughput with {procs} client\n\
             processes at once ({ops} ops each). Speed-up > 1 means rlaunch is faster (latency: torch /\n\
             rlaunch; throughput: rlaunch / torch). `wake` is half a set→wait ping-pong round trip\n\
             between two processes: how fast a wait is released by another client's set.\n\n\
             {table}\n\
             Load average (1/5/15 min) when the run started: {load}; other engineers' builds\n\
             and tests shared the two cores, so p99 figures are noisy, p50 and throughput less so.\n\n\
             Reproduce: `cargo run --release -p rlaunch --example store_bench` (writes this file;\n\
             `--rounds N --ops N --procs N --no-write`).\n",
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
