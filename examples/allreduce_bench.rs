//! All-reduce benchmark in the style of nccl-tests: for each message size, the time of one
//! f32 sum all-reduce, algbw = bytes / time and busbw = algbw * 2 (n - 1) / n.
//!
//! Under rlaunch (RANK set) every process is a rank. Run directly, it spawns `--ranks` copies
//! of itself with a file store, so it needs no launcher:
//!
//! ```text
//! allreduce_bench --ranks 4 --backend shm --min 1K --max 256M [--json out.jsonl]
//! rlaunch --standalone --nproc-per-node 4 allreduce_bench
//! ```

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlaunch::comm::ReduceOp;

const ROUNDS: usize = 3;

struct Args {
    ranks: usize,
    backend: String,
    min: usize,
    max: usize,
    json: Option<String>,
    check: bool,
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num.parse::<usize>().with_context(|| format!("bad size {s:?}"))? * mul)
}

fn parse_args() -> Result<Args> {
    let mut a = Args { ranks: 2, backend: "shm".into(), min: 1 << 10, max: 256 << 20, json: None, check: true };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        let mut val = || it.next().with_context(|| format!("{f} needs a value"));
        match f.as_str() {
            "--ranks" => a.ranks = val()?.parse()?,
            "--backend" => a.backend = val()?,
            "--min" => a.min = parse_size(&val()?)?,
            "--max" => a.max = parse_size(&val()?)?,
            "--json" => a.json = Some(val()?),
            "--no-check" => a.check = false,
            other => bail!("unknown flag {other} (--ranks N --backend shm|tcp|auto --min 1K --max 256M --json FILE)"),
        }
    }
    Ok(a)
}

fn main() -> Result<()> {
    let args = parse_args()?;
    if std::env::var("RANK").is_ok() {
        return worker(&args);
    }
    // Launcher mode: one process per rank, bootstrapped through a file store.
    let dir = tempfile::tempdir()?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for r in 0..args.ranks {
        let c = std::process::Command::new(&exe)
            .args(std::env::args().skip(1))
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("WORLD_SIZE", args.ranks.to_string())
            .env("LOCAL_WORLD_SIZE", args.ranks.to_string())
            .env("GROUP_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", "1")
            .env("RLAUNCH_FILE_STORE", dir.path().join("store"))
            .env("RLAUNCH_BACKEND", &args.backend)
            .spawn()
            .context("spawn rank")?;
        children.push(c);
    }
    let mut failed = false;
    for mut c in children {
        failed |= !c.wait()?.success();
    }
    if failed {
        bail!("a rank failed");
    }
    Ok(())
}

fn worker(args: &Args) -> Result<()> {
    let mut pg = rlaunch::worker::init_from_env()?;
    let (me, n) = (pg.rank(), pg.world_size());
    let mut out: Option<Box<dyn Write>> = match (&args.json, me) {
        (Some(p), 0) => Some(Box::new(std::fs::OpenOptions::new().create(true).append(true).open(p)?)),
        _ => None,
    };
    if me == 0 {
        println!("# rlaunch all_reduce f32 sum, {n} ranks, backend {}", pg.backend_name());
        println!("{:>12} {:>10} {:>12} {:>10} {:>10}", "bytes", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    }
    let mut bytes = args.min.max(4);
    while bytes <= args.max {
        let elems = bytes / 4;
        let mut buf: Vec<f32> = (0..elems).map(|i| ((i + me) % 7) as f32).collect();
        let iters = (200_000_000 / bytes).clamp(3, 1000);
        let warm = (iters / 10).max(2);
        for _ in 0..warm {
            pg.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        if args.check {
            // One checked call on known data: element i is sum over ranks of (i + r) % 7.
            for (i, x) in buf.iter_mut().enumerate() {
                *x = ((i + me) % 7) as f32;
            }
            pg.all_reduce(&mut buf, ReduceOp::Sum)?;
            for (i, x) in buf.iter().enumerate().step_by(997) {
                let want: f32 = (0..n).map(|r| ((i + r) % 7) as f32).sum();
                if *x != want {
                    bail!("wrong result at {i}: {x} != {want}");
                }
            }
        }
        // Best of ROUNDS rounds of `iters` calls (the machine is shared); each round's time is
        // the slowest rank's average. gloo is measured the same way (bench/allreduce/gloo_bench.py).
        let mut s = f64::INFINITY;
        for _ in 0..ROUNDS {
            pg.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                pg.all_reduce(&mut buf, ReduceOp::Sum)?;
            }
            let mut secs = [t.elapsed().as_secs_f64() / iters as f64];
            pg.all_reduce(&mut secs, ReduceOp::Max)?;
            s = s.min(secs[0]);
        }
        let algbw = bytes as f64 / s / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if me == 0 {
            println!("{:>12} {:>10} {:>12.2} {:>10.3} {:>10.3}", bytes, iters, s * 1e6, algbw, busbw);
            if let Some(o) = out.as_mut() {
                writeln!(
                    o,
                    "{{\"impl\":\"rlaunch-{}\",\"ranks\":{n},\"bytes\":{bytes},\"time_us\":{:.3},\"algbw\":{algbw:.4},\"busbw\":{busbw:.4}}}",
                    pg.backend_name(),
                    s * 1e6
                )?;
            }
        }
        bytes *= 2;
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}
