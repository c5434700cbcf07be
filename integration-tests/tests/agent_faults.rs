//! Faults just outside the scripted ones, with the real binaries on loopback: a failure report
//! the service refuses, a success report lost while the only replica restarts (state in a real
//! etcd), and workers of one round slow to stop while the next round forms.
//!
//! Every wait has a deadline; a missing `etcd` fails loudly.

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use integration_tests::netns::Proc;
use integration_tests::{bin, tempdir, wait_until, which, worker};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port()
}

fn answers(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(&format!("127.0.0.1:{port}").parse().unwrap(), Duration::from_millis(200))
        .is_ok()
}

/// `rlaunch-rendezvous` on 127.0.0.1:`port`, with extra arguments and environment.
fn service(port: u16, args: &[&str], env: &[(&str, &str)], log: &Path) -> Proc {
    let mut cmd = Command::new(bin("rlaunch-rendezvous"));
    cmd.args(["--listen", &format!("127.0.0.1:{port}")]).args(args).env("RLAUNCH_LOG", "info");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let p = Proc::spawn(cmd, "rlaunch-rendezvous", log);
    wait_until("the rendezvous service to listen", Duration::from_secs(20), || answers(port));
    p
}

/// One agent on loopback against the service at `port`.
fn agent(port: u16, run_id: &str, extra: &[&str], program: &[&str], log: &Path) -> Proc {
    let mut cmd = Command::new(bin("rlaunch"));
    cmd.env("RLAUNCH_LOG", "info")
        .args(["--rdzv-backend", "rlaunch", "--rdzv-endpoint", &format!("127.0.0.1:{port}"), "--rdzv-id", run_id])
        .args(["--local-addr", "127.0.0.1"])
        .args(extra)
        .args(program);
    Proc::spawn(cmd, &format!("rlaunch {run_id}"), log)
}

fn starts(dir: &Path, prefix: &str) -> usize {
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().starts_with(prefix)).count())
        .unwrap_or(0)
}

/// A worker that writes five 70 KB lines to stderr and exits 3: its root cause (the stderr
/// tail) is larger than the service's body limit unless the agent bounds it.
fn loud_failure(dir: &Path) -> Vec<String> {
    let script = format!(
        "touch {d}/start_$$; for i in 1 2 3 4 5; do head -c 70000 /dev/zero | tr '\\0' x >&2; echo >&2; done; exit 3",
        d = dir.display()
    );
    vec!["/bin/sh".into(), "-c".into(), script]
}

fn run_loud_failure(body_limit: Option<&str>) -> (i32, usize, String) {
    let dir = tempdir();
    let port = free_port();
    let env: Vec<(&str, &str)> = body_limit.map(|l| vec![("RLAUNCH_RDZV_BODY_LIMIT", l)]).unwrap_or_default();
    let _svc = service(port, &[], &env, &dir.path().join("service.log"));
    let program = loud_failure(dir.path());
    let program: Vec<&str> = program.iter().map(String::as_str).collect();
    let mut a = agent(port, "loud", &["--max-restarts", "0"], &program, &dir.path().join("agent.log"));
    let status = a.wait(Duration::from_secs(60));
    (status.code().unwrap_or(-1), starts(dir.path(), "start_"), a.output())
}

/// Scenario 1 (a body limit of 1 KiB: smaller than even the bounded report of five long lines,
/// each kept whole and cut for the wire): a failure report the service refuses (413) is never taken as sent: one start,
/// the worker's exit code, and the job over — not a crash loop around the budget.
#[test]
fn a_refused_failure_report_ends_the_run_with_the_workers_exit_code_after_one_start() {
    let (code, n, log) = run_loud_failure(Some("1024"));
    let tail = &log[log.len().saturating_sub(3000)..];
    assert_eq!(code, 3, "the worker's exit code: {tail}");
    assert_eq!(n, 1, "exactly one start: {tail}");
    assert!(log.contains("the failure report could not be delivered (refused"), "the refusal is said: {tail}");
    assert!(!log.contains("bytes cut]"), "the report shown is this node's own, whole: {tail}");
}

/// The same worker with the service's default body limit: the agent bounds the root cause, the
/// report is taken, the budget (0) is spent, and the job fails with the worker's code.
#[test]
fn a_large_root_cause_is_bounded_so_the_report_is_taken_and_the_budget_spent() {
    let (code, n, log) = run_loud_failure(None);
    let tail = &log[log.len().saturating_sub(3000)..];
    assert_eq!(code, 3, "the worker's exit code: {tail}");
    assert_eq!(n, 1, "exactly one start: {tail}");
    // The report shown is the one the service kept: bounded, each cut marked.
    assert!(log.contains("bytes cut]"), "the service took the bounded report: {tail}");
}

struct Etcd {
    _proc: Proc,
    endpoint: String,
    _dir: tempfile::TempDir,
}

fn etcd() -> Etcd {
    let etcd = which("etcd").unwrap_or_else(|| panic!("`etcd` is not on PATH: run scripts/install-deps.sh"));
    let dir = tempfile::Builder::new().prefix("rlaunch-it-etcd-").tempdir().expect("temp dir");
    let (client, peer) = (free_port(), free_port());
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new(etcd);
    cmd.args(["--name", "m0", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("m0={peer_url}")]);
    let p = Proc::spawn(cmd, "etcd", &dir.path().join("etcd.log"));
    wait_until("etcd to listen", Duration::from_secs(20), || answers(client));
    Etcd { _proc: p, endpoint: client_url, _dir: dir }
}

/// Scenario 2: the success report fails once (the only replica restarting, state in etcd); it is
/// sent again, and the job ends with exit 0 once the replica is back.
#[test]
fn a_success_report_lost_while_the_only_replica_restarts_is_sent_again_and_the_job_ends() {
    let dir = tempdir();
    let etcd = etcd();
    let port = free_port();
    let svc_args = ["--store", "etcd", "--etcd-endpoints", etcd.endpoint.as_str()];
    let mut svc = service(port, &svc_args, &[], &dir.path().join("service-1.log"));
    let d = dir.path().display().to_string();
    let script = format!("touch {d}/start_$$; while [ ! -e {d}/go ]; do sleep 0.05; done; exit 0");
    let mut a = agent(
        port,
        "lost-success",
        // A TTL long enough that the replica's restart does not lose the node.
        &["--rdzv-conf", "node_ttl=8,heartbeat_interval=0.5", "--shutdown-timeout", "9"],
        &["/bin/sh", "-c", &script],
        &dir.path().join("agent.log"),
    );
    wait_until("the worker to start", Duration::from_secs(30), || starts(dir.path(), "start_") == 1);
    svc.kill();
    std::fs::write(dir.path().join("go"), "").unwrap();
    // The worker succeeds at once while no replica answers: the first success report fails.
    std::thread::sleep(Duration::from_secs(2));
    let _svc = service(port, &svc_args, &[], &dir.path().join("service-2.log"));
    let status = a.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{}", a.log_tail(3000));
    assert!(a.output().contains("report not acknowledged"), "the first report did fail: {}", a.log_tail(3000));
    assert_eq!(starts(dir.path(), "start_"), 1, "one start");
}

/// Scenario 3 (`--nnodes 1:2`, so round 2 could close without B): node B's round-1 workers take 3 s to stop and keep writing into the store they
/// were given meanwhile; round 2 forms with both nodes (it waits for B), and no round-2 worker
/// ever sees what a round-1 worker wrote.
#[test]
fn rounds_never_mix_a_slow_stopping_workers_writes_never_reach_the_next_round() {
    let dir = tempdir();
    let port = free_port();
    let _svc = service(port, &[], &[], &dir.path().join("service.log"));
    let out = dir.path().display().to_string();
    let w = worker();
    let w = w.to_str().unwrap();
    let common = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "6"];
    // Both nodes first check that nothing of an earlier round is in their store and that the
    // round has both of them.
    let checks = [w, "--out", &out, "store-absent", "stale", "expect-world", "4", "touch", "up"];
    // Node A: its ranks fail on attempt 0 after B's workers are up.
    let a_prog = [&checks[..], &["sleep", "1", "fail-until-attempt", "1", "7", "touch", "done"]].concat();
    // Node B: on attempt 0 its workers linger 3 s after SIGTERM, writing "stale".
    let b_prog = [&checks[..], &["stale-writer-on-attempt0", "stale", "3", "touch", "done"]].concat();
    let mut a = agent(port, "mix", &common, &a_prog, &dir.path().join("a.log"));
    let mut b = agent(port, "mix", &common, &b_prog, &dir.path().join("b.log"));
    let sa = a.wait(Duration::from_secs(90));
    let sb = b.wait(Duration::from_secs(30));
    let logs = format!("A:\n{}\nB:\n{}", a.log_tail(4000), b.log_tail(4000));
    assert_eq!((sa.code(), sb.code()), (Some(0), Some(0)), "{logs}");
    assert!(logs.contains("stale writer:"), "B's slow worker ran: {logs}");
    // Round 2 ran four workers, every one in a world of four (both nodes), none saw "stale".
    assert_eq!(starts(dir.path(), "done_"), 4, "{logs}");
    for r in 0..4 {
        assert!(dir.path().join(format!("up_rank{r}_attempt1")).exists(), "rank {r} ran in round 2: {logs}");
    }
}
