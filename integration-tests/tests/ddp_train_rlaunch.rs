//! The `train` example under the real launcher: `rlaunch --standalone --nproc-per-node 4
//! train` trains (loss goes down), and a worker SIGKILLed mid-run or dying in the middle of a
//! checkpoint write makes rlaunch restart the group, which resumes from the snapshot of the last
//! step in the agent's memory (or, with `--snapshot-every 0`, from the latest complete disk
//! checkpoint) and ends at exactly the model of an undisturbed run.

use std::path::Path;
use std::time::Duration;

use integration_tests::{bin, rlaunch, run_deadline, tempdir};

fn train_args(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--samples",
        "4096",
        "--dim",
        "16",
        "--hidden",
        "64",
        "--classes",
        "4",
        "--epochs",
        "3",
        "--batch-size",
        "16",
        "--log-every",
        "8",
        "--checkpoint-every",
        "10",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn run(dir: &Path, name: &str, extra: &[&str], rlaunch_flags: &[&str]) -> (std::process::Output, Vec<u8>) {
    let ck = dir.join(format!("ck-{name}"));
    let out = dir.join(format!("{name}.bin"));
    let mut args = train_args(extra);
    args.extend([
        "--checkpoint-dir".into(),
        ck.display().to_string(),
        "--save-final".into(),
        out.display().to_string(),
    ]);
    let train = bin("examples/train");
    let mut cmd = rlaunch();
    cmd.args(["--standalone", "--nproc-per-node", "4"])
        .args(rlaunch_flags)
        .arg(&train)
        .args(&args)
        .env("RLAUNCH_COLLECTIVE_TIMEOUT", "10");
    let o = run_deadline(&mut cmd, Duration::from_secs(300));
    let params = std::fs::read(&out).unwrap_or_default();
    (o, params)
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn losses(s: &str) -> Vec<f64> {
    s.lines()
        .filter_map(|l| l.split(" loss ").nth(1))
        .filter_map(|r| r.split_whitespace().next())
        .filter_map(|v| v.parse().ok())
        .collect()
}

#[test]
fn train_under_rlaunch_with_four_workers_reduces_the_loss() {
    let d = tempdir();
    let (o, params) = run(d.path(), "plain", &[], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let l = losses(&t);
    assert!(l.len() >= 3, "{t}");
    assert!(l.last().expect("losses") < &(l[0] * 0.7), "loss must go down: {l:?}");
    assert!(!params.is_empty());
}

#[test]
fn sigkilled_worker_is_restarted_by_rlaunch_and_the_run_ends_at_the_undisturbed_model() {
    let d = tempdir();
    let (o, want) = run(d.path(), "undisturbed", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let (o, got) = run(
        d.path(),
        "killed",
        &["--fault-kill-step", "25", "--fault-rank", "2", "--snapshot-every", "0"],
        &["--max-restarts", "2"],
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("SIGKILLs itself at step 25"), "{t}");
    assert!(t.contains("resumed at step 20 (epoch"), "from the disk checkpoint: {t}");
    assert_eq!(got, want, "final parameters differ from the undisturbed run");
}

#[test]
fn a_sigkilled_worker_resumes_from_the_agents_snapshot_with_no_step_lost() {
    let d = tempdir();
    let (o, want) = run(d.path(), "undisturbed", &["--snapshot-every", "0"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let (o, got) = run(d.path(), "killed", &["--fault-kill-step", "25", "--fault-rank", "2"], &["--max-restarts", "2"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("SIGKILLs itself at step 25"), "{t}");
    assert!(t.contains("resumed at step 25 (epoch 0, batch 25) from the agents' snapshot"), "{t}");
    assert_eq!(got, want, "the run that resumed from the snapshot ends at the undisturbed model");
}

#[test]
fn death_during_a_checkpoint_write_resumes_from_the_previous_checkpoint_under_rlaunch() {
    let d = tempdir();
    let (o, want) = run(d.path(), "undisturbed", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let (o, got) = run(
        d.path(),
        "ckptkill",
        &["--fault-checkpoint-step", "30", "--snapshot-every", "0"],
        &["--max-restarts", "2"],
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("dying while writing"), "{t}");
    assert!(t.contains("resumed at step 20"), "{t}");
    assert_eq!(got, want, "final parameters differ from the undisturbed run");
}

/// `GET path` on a local HTTP server, the body as text.
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return String::new() };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[test]
fn a_slowed_rank_is_named_the_straggler_on_the_services_metrics_and_in_status() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let addr = format!("127.0.0.1:{port}");
    let mut service = std::process::Command::new(bin("rlaunch-rendezvous"))
        .args(["--listen", &addr, "--store", "memory"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("rlaunch-rendezvous starts");
    integration_tests::wait_until("the service to listen", Duration::from_secs(20), || {
        std::net::TcpStream::connect(&addr).is_ok()
    });
    // Rank 2 sleeps 40 ms before every backward pass: ranks 0 and 1 wait for it in every
    // bucket's all-reduce.
    let mut args = train_args(&["--slow-rank", "2", "--slow-ms", "40", "--no-checkpoint", "--steps", "100000"]);
    args.retain(|a| a != "--checkpoint-every" && a != "10");
    let job = rlaunch()
        .args(["--nnodes", "1", "--nproc-per-node", "3", "--rdzv-backend", "rlaunch", "--rdzv-endpoint", &addr])
        .args(["--rdzv-id", "straggler", "--rdzv-conf", "heartbeat_interval=0.5,node_ttl=3"])
        .arg(bin("examples/train"))
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("rlaunch starts");
    let mut metrics = String::new();
    let named = (0..120).any(|_| {
        std::thread::sleep(Duration::from_millis(500));
        metrics = http_get(&addr, "/metrics");
        metrics.lines().any(|l| l.starts_with("rlaunch_rdzv_straggler_rank{run_id=\"straggler\"") && l.ends_with(" 2"))
    });
    let status = run_deadline(
        std::process::Command::new(bin("rlaunch")).args(["status", "--rdzv-endpoint", &addr, "--rdzv-id", "straggler"]),
        Duration::from_secs(20),
    );
    // SAFETY: kill(2) on a child of this test.
    unsafe { libc::kill(job.id() as i32, libc::SIGTERM) };
    let stopped = integration_tests::wait_deadline(job, Duration::from_secs(30));
    let _ = service.kill();
    let _ = service.wait();
    assert!(named, "rank 2 named the straggler on /metrics: {metrics}");
    let late: f64 = metrics
        .lines()
        .find(|l| l.starts_with("rlaunch_rdzv_straggler_late_seconds{run_id=\"straggler\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(late > 0.015, "about the 40 ms it sleeps (less what the others' compute hides): {late} s");
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("slowest rank: 2 on "), "{text}{}", String::from_utf8_lossy(&status.stderr));
    eprintln!("{}\n{text}", metrics.lines().filter(|l| l.contains("straggler")).collect::<Vec<_>>().join("\n"));
    assert_eq!(
        stopped.status.code(),
        Some(143),
        "the job stops on SIGTERM: {}",
        String::from_utf8_lossy(&stopped.stderr)
    );
}
