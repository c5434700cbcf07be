//! Hang detection with real PyTorch gloo jobs under `rlaunch --hang-timeout`, no change to the
//! scripts: a rank stuck in a function while the others wait in `all_reduce`, a rank waiting
//! forever on a store key, a quiet but computing worker (not a hang), and a failing rank whose
//! survivors' stacks are in the report. Stacks come from py-spy, which `scripts/install-deps.sh`
//! installs into `.venv/` (a missing one fails these tests loudly).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use integration_tests::*;

const DEADLINE: Duration = Duration::from_secs(180);

fn script(name: &str) -> PathBuf {
    repo_root().join("integration-tests/py").join(name)
}

fn py_spy_installed() {
    let p = repo_root().join(".venv/bin/py-spy");
    assert!(p.exists(), "{} is missing: run scripts/install-deps.sh (the README's test command does)", p.display());
}

fn run(args: &[&str], script_name: &str, script_args: &[&str]) -> (std::process::Output, Duration) {
    py_spy_installed();
    let mut cmd = rlaunch();
    cmd.env("RLAUNCH_PYTHON", venv_python()).args(args).arg(script(script_name)).args(script_args);
    let started = Instant::now();
    let o = run_deadline(&mut cmd, DEADLINE);
    (o, started.elapsed())
}

#[test]
fn a_rank_stuck_in_a_function_is_found_and_both_frames_are_named() {
    // 6 s: ranks that finished importing torch early wait for the others in the process group's
    // start, quiet, for as long as the spread of three imports on a loaded machine.
    let (o, took) = run(
        &["--standalone", "--nproc-per-node", "3", "--hang-timeout", "6", "--shutdown-timeout", "2"],
        "hang.py",
        &["sleep"],
    );
    let err = stderr_of(&o);
    assert!(!o.status.success(), "a hang fails the job: {err}");
    assert!(err.contains("hang: no progress from rank(s)"), "{err}");
    assert!(err.contains("rank 1: stuck_here (hang.py:"), "the odd one out, first: {err}");
    assert!(err.contains("ranks 0, 2: all_reduce (distributed_c10d.py:"), "the others, grouped: {err}");
    let odd = err.find("rank 1: stuck_here").unwrap();
    let rest = err.find("ranks 0, 2: all_reduce").unwrap();
    assert!(odd < rest, "the odd one out is listed first: {err}");
    assert!(err.contains("rank        : 1 (local_rank: 1)"), "the odd one out is the root cause: {err}");
    // torch's import and the process group take a few seconds; the hang is then found within
    // the timeout (6 s) and a few samples.
    assert!(took < Duration::from_secs(60), "took {took:?}");
    eprintln!("hang found and reported in {took:?} (whole run)");
}

#[test]
fn a_rank_waiting_forever_on_a_store_key_is_found() {
    let (o, _) = run(
        &["--standalone", "--nproc-per-node", "2", "--hang-timeout", "6", "--shutdown-timeout", "2"],
        "hang.py",
        &["store"],
    );
    let err = stderr_of(&o);
    assert!(!o.status.success(), "{err}");
    let (waiting, all_reduce) =
        (err.find("rank 1: wait_for_key (hang.py:"), err.find("rank 0: all_reduce (distributed_c10d.py:"));
    assert!(waiting.is_some() && all_reduce.is_some(), "{err}");
    assert!(waiting < all_reduce, "one against one, the rank not in a collective is the odd one out: {err}");
    assert!(err.contains("rank        : 1 (local_rank: 1)"), "and the root cause: {err}");
}

#[test]
fn a_worker_that_prints_nothing_while_computing_is_not_hung() {
    let (o, _) = run(&["--standalone", "--nproc-per-node", "2", "--hang-timeout", "2"], "quiet_compute.py", &["7"]);
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    assert_eq!(stdout_of(&o).matches("computed ").count(), 2, "{}", stdout_of(&o));
}

#[test]
fn a_rank_that_finished_early_is_not_hung_while_another_computes() {
    let (o, _) =
        run(&["--standalone", "--nproc-per-node", "2", "--hang-timeout", "2"], "quiet_compute.py", &["6", "staggered"]);
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    assert_eq!(stdout_of(&o).matches("computed ").count(), 2, "{}", stdout_of(&o));
}

#[test]
fn a_worker_that_sleeps_but_sends_the_explicit_heartbeat_is_not_hung() {
    let (o, _) =
        run(&["--standalone", "--nproc-per-node", "2", "--hang-timeout", "2"], "beat_while_sleeping.py", &["6"]);
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    assert_eq!(stdout_of(&o).matches("slept").count(), 2, "{}", stdout_of(&o));
    // Without the beats the same sleep is a hang.
    let (o, _) = run(
        &["--standalone", "--nproc-per-node", "1", "--hang-timeout", "2"],
        "beat_while_sleeping.py",
        &["6", "--no-beat"],
    );
    assert!(!o.status.success(), "{}", stdout_of(&o));
    assert!(stderr_of(&o).contains("rank 0: <module> (beat_while_sleeping.py:"), "{}", stderr_of(&o));
}

#[test]
fn a_failing_ranks_report_says_where_the_survivors_stood() {
    let (o, took) = run(
        &["--standalone", "--nproc-per-node", "3", "--hang-timeout", "60", "--shutdown-timeout", "2"],
        "hang.py",
        &["raise"],
    );
    assert!(took < Duration::from_secs(45), "the failure was reported at once, not after the hang timeout: {took:?}");
    let err = stderr_of(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("message     : RuntimeError: planted failure on rank 1")
            || err.contains("rank        : 1 (local_rank: 1)"),
        "{err}"
    );
    assert!(!err.contains("hang: no progress"), "a failure is never reported as a hang: {err}");
    assert!(err.contains("Where each rank stood"), "{err}");
    assert!(err.contains("ranks 0, 2: wait_for_key (hang.py:"), "the survivors, before they were stopped: {err}");
}

#[test]
fn a_wrapper_scripts_child_doing_the_work_is_not_hung() {
    py_spy_installed();
    let python = venv_python();
    let cmd = format!("{} {} 6", python.display(), script("quiet_compute.py").display());
    let mut c = rlaunch();
    c.args(["--standalone", "--nproc-per-node", "1", "--hang-timeout", "2", "--no-python", "/bin/sh", "-c", &cmd]);
    let o = run_deadline(&mut c, DEADLINE);
    assert!(o.status.success(), "the shell waits, its child computes: {}", stderr_of(&o));
}

#[test]
fn a_bad_hang_timeout_is_refused_with_a_clear_error() {
    let o = run_deadline(rlaunch().args(["--standalone", "--hang-timeout", "soon", "true"]), Duration::from_secs(30));
    assert_eq!(o.status.code(), Some(2), "{}", stderr_of(&o));
    assert!(stderr_of(&o).contains("neither a number of seconds nor `auto`"), "{}", stderr_of(&o));
}

#[test]
fn a_hang_on_one_of_two_hosts_gives_one_report_with_both_hosts_stacks_and_one_hang_timeout() {
    hang_on_one_of_two_hosts(0);
}

#[test]
fn a_hang_on_two_hosts_with_a_restart_left_is_counted_once_and_the_second_report_is_whole() {
    // Round 1 hangs (restart 1 of 1), round 2 hangs again: the budget is spent. In round 2 the
    // culprit's host lingers with round 1's report in the rendezvous (every rank named): it
    // must wait for round 2's stacks, not stop at once.
    let logs = hang_on_one_of_two_hosts(1);
    let all = logs.join("\n");
    assert!(all.contains("restart budget exhausted (1 restarts used)"), "{all}");
}

/// Two hosts, two ranks each; rank 3 hangs in every round. The agents' logs.
fn hang_on_one_of_two_hosts(max_restarts: u32) -> Vec<String> {
    use integration_tests::netns::Cluster;
    py_spy_installed();
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let endpoint = format!("{}:29400", cluster.host(0).ip);
    // The job-wide hang timeout (given on host a only) reached host b.
    // Rank 3 (the second host's second rank, whoever hosts what) sleeps in stuck_here(); ranks
    // 0-2 wait in all_reduce, two of them on the other host, whose agent sees nothing wrong with
    // its own ranks but that they all wait: it holds its verdict, the culprit's host reports.
    let mut agents: Vec<integration_tests::netns::Proc> = cluster
        .hosts()
        .iter()
        .map(|h| {
            let mut c = h.command(bin("rlaunch"));
            c.env("RLAUNCH_PYTHON", venv_python())
                .env("RLAUNCH_LOG", "info")
                // Gloo finds its address from the interface, not the host's name.
                .env("GLOO_SOCKET_IFNAME", "eth0")
                .args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "rlaunch"])
                .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "hang-two-hosts"])
                .args(["--rdzv-conf", "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=60"])
                .args(["--max-restarts", &max_restarts.to_string(), "--shutdown-timeout", "3"]);
            // Only host a gives the hang timeout: it is the job's, through the rendezvous, and
            // host b (where the culprit runs) applies it too.
            if h.name == "a" {
                c.args(["--hang-timeout", "8"]);
            }
            c.arg(script("hang.py")).args(["sleep", "3"]);
            h.spawn(c, &dir.path().join(format!("rlaunch-{}.log", h.name)))
        })
        .collect();
    for a in &mut agents {
        let status = a.wait(DEADLINE);
        assert!(!status.success(), "a hang fails the job on every host: {}", a.log_tail(4000));
    }
    let logs: Vec<String> = agents.iter().map(|a| a.output()).collect();
    for l in &logs {
        let watching = l.lines().find(|l| l.contains("hang detection (--hang-timeout)"));
        assert!(watching.is_some_and(|w| w.contains("timeout=8")), "both hosts apply the job's 8 s: {l}");
    }
    assert!(
        logs.iter()
            .any(|l| l.contains("hang: no progress from rank(s)") && l.contains("rank        : 3 (local_rank: 1)")),
        "the culprit's host found it, rank 3 is the root cause: {logs:#?}"
    );
    // One report holds both hosts' ranks: rank 2 (beside the culprit) and ranks 0-1 (the other
    // host) wait at the same place, merged into one group, after the odd one out.
    let merged = logs.iter().find(|l| l.contains("Where each rank stood") && l.contains("ranks 0-2: all_reduce"));
    let merged = merged.unwrap_or_else(|| panic!("no report merges the two hosts' stacks: {logs:#?}"));
    let report = &merged[merged.rfind("Where each rank stood").unwrap()..];
    let odd = report.find("rank 3: stuck_here (hang.py:").unwrap_or_else(|| panic!("{report}"));
    assert!(odd < report.find("ranks 0-2: all_reduce").unwrap(), "the odd one out first: {report}");
    // The culprit's host announced the hang and kept its ranks until the other host's stacks
    // were in (had it stopped them first, the other host's ranks would have left all_reduce).
    assert!(!logs.iter().any(|l| l.contains("not every rank's stack reached the report")), "{logs:#?}");
    logs
}

#[test]
fn auto_learns_a_steady_step_period_and_finds_the_rank_that_stopped() {
    // A line every 0.5 s (sampled once a second): the learned threshold is 10 × 1 s = 10 s (the
    // floor, 5 s, is below). Rank 1 stops after 10 s; found about 10 s later.
    let (o, took) =
        run(&["--standalone", "--nproc-per-node", "2", "--hang-timeout", "auto:5"], "steady.py", &["stall"]);
    let err = stderr_of(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("hang: no progress from rank(s) 1 for"), "{err}");
    assert!(err.contains("rank 1: stuck_here (steady.py:"), "{err}");
    let threshold = err.split("(--hang-timeout ").nth(1).and_then(|t| t.split(' ').next()).unwrap_or("");
    let threshold: f64 = threshold.parse().unwrap_or_else(|_| panic!("a learned threshold in the message: {err}"));
    assert!((8.0..=14.0).contains(&threshold), "10 × the sampled period, not the floor or the 25 s start: {threshold}");
    assert!(took < Duration::from_secs(45), "took {took:?}");
}

#[test]
fn auto_lets_a_pause_pass_that_a_fixed_timeout_of_the_same_floor_calls_a_hang() {
    // Every rank pauses 6 s once. `auto:5` has learned 10 s by then: no hang. A fixed 5 s is one.
    let (o, _) = run(&["--standalone", "--nproc-per-node", "2", "--hang-timeout", "auto:5"], "steady.py", &["pause"]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let (o, _) = run(&["--standalone", "--nproc-per-node", "2", "--hang-timeout", "5"], "steady.py", &["pause"]);
    assert!(!o.status.success() && stderr_of(&o).contains("hang: no progress"), "{}", stderr_of(&o));
}
